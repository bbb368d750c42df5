//! Reading exact `list`s and small exact `int`s from their memory layout, for the token
//! lists a serving engine passes on every call.
//!
//! Through the stable ABI, every element of a list costs two calls into the interpreter
//! (`PyList_GetItem`, `PyLong_AsLongLongAndOverflow`): about 3.7 ns, as much as CPython's
//! own `sum(lst)`, where reading the two fields that hold a small int's value costs a
//! fraction of that. So, on the interpreters whose layouts are known, an exact list's item
//! array and an exact int of at most one digit (`|v| < 2**30`, every token id and slot in
//! practice) are read directly; anything else takes the C-API path as before, which stays
//! the definition of the conversion.
//!
//! The layouts read (CPython, 64- or 32-bit, default build; a free-threaded build, where
//! another thread may change a list while it is read, never uses them):
//! - every object starts `{ob_refcnt, ob_type}`; a list continues `{ob_size, ob_item}`
//!   (unchanged since Python 3.0);
//! - an int continues with one machine word and then its 30-bit digits: on 3.9-3.11 the
//!   word is `ob_size` (the digit count, negated for a negative value), from 3.12 it is
//!   `lv_tag` (digit count `<< 3`, sign in the low two bits: 0 positive, 1 zero,
//!   2 negative). Only the digits the count says exist are read: an int of one digit is
//!   28 bytes on 64-bit (less than the header and a digit rounded up to a word), and a
//!   zero before 3.12 may have no digit at all.
//!
//! Both are used only when, at import, (1) the interpreter is a CPython 3.9-3.14 with
//! 30-bit digits, (2) a self-test decodes a set of probe ints (around every digit and sign
//! boundary) exactly as the C API does, and declines every one the C API needs, and
//! (3) a probe list's size and items read the same as through the C API. Otherwise, or
//! with `RADIXCACHE_INT_FAST_PATH=0` in the environment, every read goes through the C
//! API. `radixcache._core._int_fast_path` says which is in use.

use std::ffi::c_void;
use std::sync::OnceLock;

use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// How the word after an int's object header encodes its sign and digit count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IntLayout {
    /// 3.9-3.11: `ob_size`, a signed digit count.
    SignedSize,
    /// 3.12+: `lv_tag`, `ndigits << 3 | sign`.
    Tagged,
}

/// An exact int's head: the object header and the size word, which every int has; its
/// digits (`u32` each, for 30-bit digits) follow at once.
#[repr(C)]
struct LongHead {
    ob_refcnt: isize,
    ob_type: *mut c_void,
    size: isize,
}

/// An exact list's head: the variable-size object header and the item array.
#[repr(C)]
#[allow(clippy::struct_field_names)] // CPython's names
struct ListHead {
    ob_refcnt: isize,
    ob_type: *mut c_void,
    ob_size: isize,
    ob_item: *const *mut ffi::PyObject,
}

/// The environment variable that turns the layout reads off (`0`).
const SWITCH: &str = "RADIXCACHE_INT_FAST_PATH";

/// Decided once, at import ([`init`]).
static LAYOUT: OnceLock<Option<IntLayout>> = OnceLock::new();

/// The layout in use, `None` for the C-API path.
#[inline]
pub(crate) fn int_layout() -> Option<IntLayout> {
    LAYOUT.get().copied().flatten()
}

/// Decides, once, whether the layout reads are used (see the module docs); returns the
/// decision.
pub(crate) fn init(py: Python<'_>) -> PyResult<bool> {
    let chosen = if cfg!(Py_GIL_DISABLED) || std::env::var(SWITCH).is_ok_and(|v| v.trim() == "0") {
        None
    } else {
        match candidate(py)? {
            Some(l) if self_test(py, l)? => Some(l),
            _ => None,
        }
    };
    Ok(LAYOUT.get_or_init(|| chosen).is_some())
}

/// The layout this interpreter should have, from its version and digit size.
fn candidate(py: Python<'_>) -> PyResult<Option<IntLayout>> {
    let implementation: String = py
        .import("sys")?
        .getattr("implementation")?
        .getattr("name")?
        .extract()?;
    let bits: u32 = py
        .import("sys")?
        .getattr("int_info")?
        .getattr("bits_per_digit")?
        .extract()?;
    if implementation != "cpython" || bits != 30 {
        return Ok(None);
    }
    let v = py.version_info();
    Ok(match (v.major, v.minor) {
        (3, 9..=11) => Some(IntLayout::SignedSize),
        (3, 12..=14) => Some(IntLayout::Tagged),
        _ => None,
    })
}

/// Checks `layout` against the C API on probe ints and a probe list.
fn self_test(py: Python<'_>, layout: IntLayout) -> PyResult<bool> {
    const DIGIT: i64 = 1 << 30;
    let mut probes: Vec<i64> = vec![
        0,
        1,
        2,
        7,
        255,
        256,
        257,
        1 << 15,
        (1 << 16) + 1,
        DIGIT - 1,
        DIGIT,
        DIGIT + 1,
        (1 << 31) - 1,
        1 << 31,
        (1 << 32) - 1,
        1 << 32,
        1 << 59,
        (1 << 60) - 1,
        1 << 60,
        1 << 61,
        i64::MAX,
    ];
    let negated: Vec<i64> = probes.iter().map(|v| -v).collect();
    probes.extend(negated);
    probes.push(i64::MIN);
    let mut objects = Vec::with_capacity(probes.len() + 1);
    for &v in &probes {
        objects.push(v.into_pyobject(py)?.into_any());
    }
    // Beyond 64 bits.
    objects.push(py.eval(c"-(1 << 100)", None, None)?);
    for obj in &objects {
        let mut overflow = 0;
        // SAFETY: `obj` is a live exact int.
        let api = unsafe { ffi::PyLong_AsLongLongAndOverflow(obj.as_ptr(), &raw mut overflow) };
        let expect = (overflow == 0 && api.unsigned_abs() < DIGIT.unsigned_abs()).then_some(api);
        // SAFETY: `obj` is a live exact int.
        if unsafe { small_int(layout, obj.as_ptr()) } != expect {
            return Ok(false);
        }
        let nonnegative = expect.and_then(|v| u32::try_from(v).ok());
        // SAFETY: `obj` is a live exact int.
        if unsafe { small_nonnegative(layout, obj.as_ptr()) } != nonnegative {
            return Ok(false);
        }
    }
    for n in [0, 1, objects.len()] {
        let list = PyList::new(py, &objects[..n])?;
        let ptr = list.as_ptr();
        // SAFETY: `list` is a live exact list, so it is at least a `ListHead`.
        let head = unsafe { &*ptr.cast::<ListHead>() };
        // SAFETY: as above.
        if head.ob_size != unsafe { ffi::PyList_Size(ptr) } {
            return Ok(false);
        }
        for (i, obj) in objects[..n].iter().enumerate() {
            // SAFETY: `i < ob_size`, which was just checked to be the list's length, so
            // the item array holds element `i`.
            if unsafe { *head.ob_item.add(i) } != obj.as_ptr() {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// The value of an exact int with at most one digit (`|v| < 2**30`), `None` for a larger
/// one.
///
/// # Safety
/// `item` is a live exact `int` (`PyLong_Type`, not a subclass) on an interpreter whose
/// layout is `layout`.
#[inline]
pub(crate) unsafe fn small_int(layout: IntLayout, item: *mut ffi::PyObject) -> Option<i64> {
    // SAFETY: the caller's contract.
    unsafe { small_int_read(layout, item) }.0
}

/// [`small_int`], and how many bytes from `item` it read.
///
/// # Safety
/// As for [`small_int`].
#[inline]
pub(crate) unsafe fn small_int_read(
    layout: IntLayout,
    item: *mut ffi::PyObject,
) -> (Option<i64>, usize) {
    // SAFETY: the caller's contract.
    let (digits, negative) = unsafe { digits_sign(layout, item) };
    let head = std::mem::size_of::<LongHead>();
    match digits {
        0 => (Some(0), head),
        1 => {
            // SAFETY: the size word says the int has a digit, which follows the head.
            let digit = unsafe { item.cast::<u8>().add(head).cast::<u32>().read_unaligned() };
            let digit = i64::from(digit);
            let value = if negative { -digit } else { digit };
            (Some(value), head + std::mem::size_of::<u32>())
        }
        _ => (None, head),
    }
}

/// The value of an exact int in `[0, 2**30)` (every token id and slot in practice), `None`
/// for any other: [`small_int`] restricted to the values every conversion target holds,
/// for the conversion's inner loop.
///
/// # Safety
/// As for [`small_int`].
#[inline]
pub(crate) unsafe fn small_nonnegative(layout: IntLayout, item: *mut ffi::PyObject) -> Option<u32> {
    // SAFETY: the caller's contract.
    let (digits, negative) = unsafe { digits_sign(layout, item) };
    if negative || digits > 1 {
        return None;
    }
    if digits == 0 {
        return Some(0);
    }
    // SAFETY: the size word says the int has a digit, which follows the head.
    Some(unsafe {
        item.cast::<u8>()
            .add(std::mem::size_of::<LongHead>())
            .cast::<u32>()
            .read_unaligned()
    })
}

/// An exact int's digit count and whether it is negative, from its size word alone.
///
/// # Safety
/// As for [`small_int`].
#[inline]
unsafe fn digits_sign(layout: IntLayout, item: *mut ffi::PyObject) -> (usize, bool) {
    // SAFETY: the caller's contract: every int has the object header and its size word.
    let size = unsafe { (*item.cast::<LongHead>()).size };
    match layout {
        IntLayout::SignedSize => (size.unsigned_abs(), size < 0),
        IntLayout::Tagged => {
            let tag = size.cast_unsigned();
            (tag >> 3, tag & 3 == 2)
        }
    }
}

/// An exact list's length and item array, read in place.
///
/// # Safety
/// `list` is a live exact `list` and layout reads are enabled ([`int_layout`] is `Some`).
/// The array is valid until Python code runs (which may resize the list).
#[inline]
#[cfg_attr(Py_GIL_DISABLED, allow(dead_code))] // lists are iterated there
pub(crate) unsafe fn list_items(list: *mut ffi::PyObject) -> (usize, *const *mut ffi::PyObject) {
    // SAFETY: the caller's contract; the layout was checked at import.
    let head = unsafe { &*list.cast::<ListHead>() };
    (head.ob_size.unsigned_abs(), head.ob_item)
}

/// For tests of the layout reads: `(value, bytes read)` of the fast path on `obj`, an
/// exact int (`value` None where the fast path declines it), or None when the layout
/// reads are off.
#[pyfunction]
pub(crate) fn _small_int_read(obj: &Bound<'_, PyAny>) -> PyResult<Option<(Option<i64>, usize)>> {
    if !obj.is_exact_instance_of::<pyo3::types::PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "obj: expected an exact int, got {}",
            obj.get_type().name()?
        )));
    }
    // SAFETY: `obj` is a live exact int, and the layout is this interpreter's.
    Ok(int_layout().map(|l| unsafe { small_int_read(l, obj.as_ptr()) }))
}
