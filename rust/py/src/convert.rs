//! Argument conversion: how token sequences, slot-index arrays and integer arguments
//! cross from Python into Rust. Nothing here knows about the cache.
//!
//! Sequences (`tokens_arg`, `indices_arg`) accept, in the order they are tried:
//! - an exact `list` or `tuple`: indexed in place (borrowed references), one type check
//!   per element (on a free-threaded build a list is iterated instead, holding a strong
//!   reference to each item); an exact `int` converts straight to the target type, anything else
//!   takes the slow path of [`Int`] (`__index__`; `bool` and numpy's bool refused). Where
//!   [`crate::layout`] knows the interpreter's layout, a list's item array and small ints
//!   are read in place rather than through the C API (about 3.5 times faster);
//! - a 1-D numpy array of any integer dtype and either byte order: read in Rust from
//!   numpy's buffer with no Python work per element (one copy when the dtype is already
//!   the target's); masked arrays are refused, since their mask would be ignored;
//! - any other object passing `PySequence_Check` except `str`/`bytes`/`bytearray`
//!   (`range`, `array.array`, user sequences): iterated, element by element, with the
//!   same rules as a list.
//!
//! Everything else (sets, dicts and their views, iterators, scalars) is a `TypeError`.
//! Every error names the argument first (`"tokens: ..."`) and, for an element, its
//! position. No reported length is trusted beyond what is read: lists, tuples and arrays
//! have the length they say, anything else gets at most [`RESERVE_CAP`] elements' room up
//! front, and all room is reserved fallibly (`MemoryError` instead of an abort).

use std::fmt::Display;
use std::mem::size_of;

use numpy::npyffi;
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyException, PyMemoryError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyList, PyString, PyTuple, PyType};
use radixcache_core as core;

use crate::layout::{int_layout, list_items, small_int, small_nonnegative, IntLayout};

/// Room reserved up front for a sequence whose length is only its own word (`__len__`).
const RESERVE_CAP: usize = 1 << 16;

/// What a sequence converts to: `u32` token ids or `i64` slot indices.
pub(crate) trait Target:
    Copy
    + Default
    + TryFrom<i8>
    + TryFrom<i16>
    + TryFrom<i32>
    + TryFrom<i64>
    + TryFrom<u8>
    + TryFrom<u16>
    + TryFrom<u32>
    + TryFrom<u64>
{
    /// One element, in messages.
    const WHAT: &'static str;
    /// Many elements, in messages.
    const PLURAL: &'static str;
    /// The accepted range, in messages.
    const RANGE: &'static str;
    /// Signed: a numpy dtype of the same width and signedness is this very type.
    const SIGNED: bool;
    /// Whether values whose 64-bit forms (sign-extended from a signed source, whose
    /// signedness is `signed`) OR together to `or` all fit this type.
    fn all_fit(or: u64, signed: bool) -> bool;
    /// A value known to fit, from its 64-bit form.
    fn from_bits(bits: u64) -> Self;
}

impl Target for u32 {
    const WHAT: &'static str = "token id";
    const PLURAL: &'static str = "tokens";
    const RANGE: &'static str = "[0, 2**32)";
    const SIGNED: bool = false;

    fn all_fit(or: u64, _signed: bool) -> bool {
        // A negative value, sign-extended, sets the high bits too.
        or >> 32 == 0
    }

    #[allow(clippy::cast_possible_truncation)] // known to fit
    fn from_bits(bits: u64) -> u32 {
        bits as u32
    }
}

impl Target for i64 {
    const WHAT: &'static str = "slot";
    const PLURAL: &'static str = "slots";
    // Negative slots pass here and are refused by the core, which names the slot.
    const RANGE: &'static str = "[0, 2**63)";
    const SIGNED: bool = true;

    fn all_fit(or: u64, signed: bool) -> bool {
        // Signed sources always fit; an unsigned 64-bit one must leave the sign bit clear.
        signed || or >> 63 == 0
    }

    #[allow(clippy::cast_possible_wrap)] // known to fit
    fn from_bits(bits: u64) -> i64 {
        bits as i64
    }
}

/// Token ids: `0 <= t < 2**32`.
pub(crate) fn tokens_arg(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Vec<u32>> {
    int_seq(obj, arg)
}

/// Slot indices as int64 (range against the pool is the core's check).
pub(crate) fn indices_arg(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Vec<i64>> {
    int_seq(obj, arg)
}

/// A 1-D integer sequence in any accepted form (see the module docs).
fn int_seq<T: Target>(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Vec<T>> {
    if obj.is_exact_instance_of::<PyList>() {
        // Without the GIL another thread may change the list while it is read, freeing
        // an item a borrowed reference points to: its items are taken as strong
        // references, one by one.
        #[cfg(Py_GIL_DISABLED)]
        return from_iter(obj, arg);
        #[cfg(not(Py_GIL_DISABLED))]
        {
            if let Some(layout) = int_layout() {
                return from_list(obj, layout, arg);
            }
            return from_indexable(obj, ffi::PyList_Size, ffi::PyList_GetItem, arg);
        }
    }
    if obj.is_exact_instance_of::<PyTuple>() {
        return from_indexable(obj, ffi::PyTuple_Size, ffi::PyTuple_GetItem, arg);
    }
    let py = obj.py();
    // SAFETY: `obj` is a live object; the check only compares its type with numpy's.
    if unsafe { npyffi::PyArray_CheckExact(py, obj.as_ptr()) } != 0 {
        return from_array(obj.cast::<PyUntypedArray>()?, arg);
    }
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        refuse_masked(arr, arg)?;
        return from_array(arr, arg);
    }
    if obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
    {
        return Err(not_a_sequence(obj, arg));
    }
    // SAFETY: `obj` is a live object; `PySequence_Check` only reads its type's slots.
    if unsafe { ffi::PySequence_Check(obj.as_ptr()) } == 1 {
        return from_iter(obj, arg);
    }
    Err(not_a_sequence(obj, arg))
}

fn not_a_sequence(obj: &Bound<'_, PyAny>, arg: &str) -> PyErr {
    PyTypeError::new_err(format!(
        "{arg}: expected a sequence of integers (list, tuple or 1-D integer array), got {}",
        type_name(obj)
    ))
}

pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map_or_else(
        |_| "an object of unknown type".to_owned(),
        |n| n.to_string(),
    )
}

// ------------------------------------------------------------------- room, fallibly

#[cold]
fn no_room<T: Target>(arg: &str, n: usize) -> PyErr {
    PyMemoryError::new_err(format!(
        "{arg}: cannot hold {n} {} ({} bytes)",
        T::PLURAL,
        n.saturating_mul(size_of::<T>())
    ))
}

/// A vector with room for `n` elements, or a `MemoryError` naming `arg`.
fn with_room<T: Target>(n: usize, arg: &str) -> PyResult<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(n).map_err(|_| no_room::<T>(arg, n))?;
    Ok(out)
}

/// Pushes, growing fallibly (amortised) when full.
#[inline]
fn push<T: Target>(out: &mut Vec<T>, v: T, arg: &str) -> PyResult<()> {
    if out.len() == out.capacity() {
        grow(out, arg)?;
    }
    out.push(v);
    Ok(())
}

#[cold]
#[inline(never)]
fn grow<T: Target>(out: &mut Vec<T>, arg: &str) -> PyResult<()> {
    let n = out.len().saturating_add(1);
    out.try_reserve(1).map_err(|_| no_room::<T>(arg, n))
}

// ------------------------------------------------------------- Python sequences

#[cold]
fn out_of_range<T: Target>(arg: &str, v: impl Display, pos: usize) -> PyErr {
    PyValueError::new_err(format!(
        "{arg}: {} {v} at position {pos} is out of range {}",
        T::WHAT,
        T::RANGE
    ))
}

/// The value of `item` if it is an exact `int` that fits in 64 bits (`Ok(None)` for
/// anything else, which the slow path then decides). Runs no Python code.
///
/// # Safety
/// `item` is a live object.
#[inline]
unsafe fn exact_int(py: Python<'_>, item: *mut ffi::PyObject) -> PyResult<Option<i64>> {
    // SAFETY: `item` is live (the caller's contract), so reading its type is sound.
    if unsafe { ffi::Py_TYPE(item) } != &raw mut ffi::PyLong_Type {
        return Ok(None);
    }
    if let Some(layout) = int_layout() {
        // SAFETY: `item` is a live exact int, and `layout` is this interpreter's.
        if let Some(v) = unsafe { small_int(layout, item) } {
            return Ok(Some(v));
        }
    }
    let mut overflow = 0;
    // SAFETY: `item` is an exact int; the conversion runs no Python code.
    let v = unsafe { ffi::PyLong_AsLongLongAndOverflow(item, &raw mut overflow) };
    if overflow != 0 {
        return Ok(None);
    }
    if v == -1 {
        if let Some(e) = PyErr::take(py) {
            return Err(e);
        }
    }
    Ok(Some(v))
}

/// One element of a Python sequence.
///
/// # Safety
/// `item` is a live object for the duration of the call (the fast path runs no Python
/// code; the slow path takes its own strong reference before it runs any).
#[inline]
unsafe fn element<T: Target>(
    py: Python<'_>,
    item: *mut ffi::PyObject,
    arg: &str,
    pos: usize,
) -> PyResult<T> {
    // SAFETY: the caller's contract.
    if let Some(v) = unsafe { exact_int(py, item) }? {
        return T::try_from(v).map_err(|_| out_of_range::<T>(arg, v, pos));
    }
    // SAFETY: `item` is live (the caller's contract); this takes a new reference.
    let owned = unsafe { Bound::from_borrowed_ptr(py, item) };
    slow_element(&owned, arg, pos)
}

/// An element that is not an exact `int` in the 64-bit range: `bool` is refused, an
/// object with `__index__` is converted through it, anything else is a `TypeError`.
#[cold]
#[inline(never)]
fn slow_element<T: Target>(item: &Bound<'_, PyAny>, arg: &str, pos: usize) -> PyResult<T> {
    match Int::of(item)? {
        Int::Value(v) => T::try_from(v).map_err(|_| out_of_range::<T>(arg, v, pos)),
        Int::TooLarge(v) => Err(PyValueError::new_err(match &v.decimal {
            Some(d) => format!(
                "{arg}: {} {d} at position {pos} is out of range {} (outside the 64-bit range)",
                T::WHAT,
                T::RANGE
            ),
            None => format!(
                "{arg}: {} at position {pos} is out of range {}: got {v}",
                T::WHAT,
                T::RANGE
            ),
        })),
        Int::Bool => Err(PyTypeError::new_err(format!(
            "{arg}: expected integers, got bool at position {pos}"
        ))),
        Int::Other(ty) => Err(PyTypeError::new_err(format!(
            "{arg}: expected integers, got {ty} at position {pos}"
        ))),
        Int::IndexFailed { ty, err } => Err(index_failed(
            item.py(),
            err,
            &format!("{arg}: expected integers, got {ty} at position {pos}"),
            &format!("{arg}: could not convert the {ty} at position {pos} to an integer"),
        )),
    }
}

/// The C-API pair that reads an exact list or tuple in place.
type SizeFn = unsafe extern "C" fn(*mut ffi::PyObject) -> ffi::Py_ssize_t;
type GetItemFn = unsafe extern "C" fn(*mut ffi::PyObject, ffi::Py_ssize_t) -> *mut ffi::PyObject;

/// An exact list or tuple, indexed in place with borrowed references.
fn from_indexable<T: Target>(
    seq: &Bound<'_, PyAny>,
    size: SizeFn,
    get: GetItemFn,
    arg: &str,
) -> PyResult<Vec<T>> {
    let py = seq.py();
    let ptr = seq.as_ptr();
    // SAFETY: `seq` is a live exact list/tuple, as `size` expects.
    let mut n = unsafe { size(ptr) };
    // The list's own array already holds `n` pointers, so `n` is a real size.
    let mut out = with_room::<T>(n.unsigned_abs(), arg)?;
    let mut i: ffi::Py_ssize_t = 0;
    while i < n {
        // SAFETY: `0 <= i < n`, and `n` is the current length: no Python code ran since
        // it was read (the fast path runs none; after the slow path, which may run
        // `__index__` and so mutate a list, it is read again). The borrowed reference
        // stays valid while no Python code runs, and `element` needs no more.
        let item = unsafe { get(ptr, i) };
        if item.is_null() {
            return Err(PyErr::fetch(py));
        }
        let pos = i.unsigned_abs();
        // SAFETY: `item` is live (see above).
        let v = if let Some(v) = unsafe { exact_int(py, item) }? {
            T::try_from(v).map_err(|_| out_of_range::<T>(arg, v, pos))?
        } else {
            // SAFETY: `item` is live; this takes a strong reference before any Python
            // code runs.
            let owned = unsafe { Bound::from_borrowed_ptr(py, item) };
            let v = slow_element(&owned, arg, pos)?;
            // SAFETY: as for the first read.
            n = unsafe { size(ptr) };
            v
        };
        push(&mut out, v, arg)?;
        i += 1;
    }
    Ok(out)
}

/// An exact list, its items and small ints read in place ([`crate::layout`]): runs of
/// ints in `[0, 2**30)` go through [`small_run`], and each other item through
/// [`element`].
#[cfg_attr(Py_GIL_DISABLED, allow(dead_code))] // lists are iterated there
fn from_list<T: Target>(list: &Bound<'_, PyAny>, layout: IntLayout, arg: &str) -> PyResult<Vec<T>> {
    let py = list.py();
    let ptr = list.as_ptr();
    // SAFETY: `list` is a live exact list and layout reads are on (the caller checked).
    let (mut n, mut items) = unsafe { list_items(ptr) };
    // The list's own array already holds `n` pointers, so `n` is a real size.
    let mut out = with_room::<T>(n, arg)?;
    let mut i = 0;
    while i < n {
        // A list that `__index__` grew needs more room than was reserved.
        if out.capacity() - out.len() < n - i {
            out.try_reserve(n - i)
                .map_err(|_| no_room::<T>(arg, out.len().saturating_add(n - i)))?;
        }
        // SAFETY: `i < n`, the list's current length: no Python code ran since `n` and
        // `items` were read (the fast path runs none; after `element`, which may run
        // `__index__` and so resize the list, both are read again), so `items + i` holds
        // `n - i` live borrowed references; `out` has room for `n - i` more.
        i += unsafe { small_run(layout, items.add(i), n - i, &mut out) };
        if i == n {
            break;
        }
        // SAFETY: as above, `i < n`; `element` takes a strong reference before it runs
        // any Python code.
        let v = unsafe { element::<T>(py, *items.add(i), arg, i) }?;
        // SAFETY: as for the first read.
        (n, items) = unsafe { list_items(ptr) };
        push(&mut out, v, arg)?;
        i += 1;
    }
    Ok(out)
}

/// Appends the leading run of `items[..n]` that are exact ints in `[0, 2**30)` to `out`,
/// and returns its length; the first other item (if any) is left to the caller. Out of
/// line and specialised per layout, so that the loop a token list spends its time in is
/// a few loads and compares per item, whatever code surrounds it.
///
/// # Safety
/// `items` points at `n` live objects, `layout` is this interpreter's, and `out` has room
/// for `n` more values.
#[inline(never)]
#[cfg_attr(Py_GIL_DISABLED, allow(dead_code))] // lists are iterated there
unsafe fn small_run<T: Target>(
    layout: IntLayout,
    items: *const *mut ffi::PyObject,
    n: usize,
    out: &mut Vec<T>,
) -> usize {
    match layout {
        // SAFETY: the caller's contract, passed on.
        IntLayout::SignedSize => unsafe { small_run_in(IntLayout::SignedSize, items, n, out) },
        // SAFETY: as above.
        IntLayout::Tagged => unsafe { small_run_in(IntLayout::Tagged, items, n, out) },
    }
}

/// [`small_run`] for one layout, inlined into each of its arms (it is small) so that the
/// layout is a constant there.
///
/// # Safety
/// As for [`small_run`].
#[inline]
unsafe fn small_run_in<T: Target>(
    layout: IntLayout,
    items: *const *mut ffi::PyObject,
    n: usize,
    out: &mut Vec<T>,
) -> usize {
    let len = out.len();
    // SAFETY: the caller's contract: `items` points at `n` live objects.
    let items = unsafe { std::slice::from_raw_parts(items, n) };
    let mut done = 0;
    for (slot, &item) in out.spare_capacity_mut().iter_mut().zip(items) {
        // SAFETY: `item` is live; its type is checked before the int is read.
        if unsafe { ffi::Py_TYPE(item) } != &raw mut ffi::PyLong_Type {
            break;
        }
        // SAFETY: `item` is a live exact int, and `layout` is this interpreter's.
        let Some(v) = (unsafe { small_nonnegative(layout, item) }) else {
            break;
        };
        slot.write(T::from_bits(u64::from(v)));
        done += 1;
    }
    // SAFETY: the first `done` spare slots were just written.
    unsafe { out.set_len(len + done) };
    done
}

/// Any other sequence: iterated, trusting its `__len__` only for a bounded hint.
fn from_iter<T: Target>(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Vec<T>> {
    let py = obj.py();
    // A hint only: a failing `__len__` is not this function's business (iteration does
    // not use it), and a lying one must not make us reserve what it claims.
    let hint = obj.len().unwrap_or(0).min(RESERVE_CAP);
    let mut out = with_room::<T>(hint, arg)?;
    for (pos, item) in obj.try_iter()?.enumerate() {
        let item = item?;
        // SAFETY: `item` is an owned reference, live for the call.
        let v = unsafe { element::<T>(py, item.as_ptr(), arg, pos) }?;
        push(&mut out, v, arg)?;
    }
    Ok(out)
}

// ------------------------------------------------------------------ numpy arrays

/// The class of numpy masked arrays, looked up the first time a subclass of ndarray is
/// passed (an exact ndarray never needs it).
static MASKED_ARRAY: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn refuse_masked(arr: &Bound<'_, PyUntypedArray>, arg: &str) -> PyResult<()> {
    let masked = MASKED_ARRAY.import(arr.py(), "numpy.ma", "MaskedArray")?;
    if arr.is_instance(masked)? {
        return Err(PyTypeError::new_err(format!(
            "{arg}: expected a plain integer array, got a masked array (its mask would be \
             ignored); pass .filled(value) or .compressed()"
        )));
    }
    Ok(())
}

/// A numpy element type we read from: the eight integer widths.
trait Src: Copy + Display {
    const SIGNED: bool;
    fn swap(self) -> Self;
    /// The value as 64 bits: sign-extended when signed, zero-extended when not.
    fn widen(self) -> u64;
}

macro_rules! src {
    ($($t:ty => $signed:literal, $via:ty),+) => {$(
        impl Src for $t {
            const SIGNED: bool = $signed;
            #[inline(always)]
            fn swap(self) -> Self {
                self.swap_bytes()
            }
            #[inline(always)]
            #[allow(clippy::cast_sign_loss, clippy::cast_lossless)] // the bits, on purpose
            fn widen(self) -> u64 {
                self as $via as u64
            }
        }
    )+};
}
src!(i8 => true, i64, i16 => true, i64, i32 => true, i64, i64 => true, i64,
     u8 => false, u64, u16 => false, u64, u32 => false, u64, u64 => false, u64);

/// A 1-D numpy array of any integer dtype and byte order.
fn from_array<T: Target>(arr: &Bound<'_, PyUntypedArray>, arg: &str) -> PyResult<Vec<T>> {
    if arr.ndim() != 1 {
        return Err(PyValueError::new_err(format!(
            "{arg}: expected a 1-D sequence of integers, got a {}-D array",
            arr.ndim()
        )));
    }
    let dtype = arr.dtype();
    let (kind, size) = (dtype.kind(), dtype.itemsize());
    let swap = dtype.is_native_byteorder() == Some(false);
    let n = arr.shape()[0];
    let stride = arr.strides()[0];
    // SAFETY: `arr` is a live array; this reads its data pointer.
    let data = unsafe { (*npyffi::_PyArray_GET_ITEM_DATA(arr.as_array_ptr())).data };
    let data = data.cast_const().cast::<u8>();
    let mut out = with_room::<T>(n, arg)?;
    macro_rules! read {
        ($s:ty, $swap:literal) => {
            // SAFETY: numpy's invariant for a live 1-D array whose dtype is `$s` (the
            // match below checks kind and size): for every `i < n`, `data + i * stride`
            // is the address of an element inside the array's buffer. The buffer lives
            // as long as `arr` (we hold it) and we read it with the GIL held, running no
            // Python code, so nothing frees or resizes it meanwhile. (Code that released
            // the GIL could still write the integers while we read them, as it could
            // under any reader; the values would be torn, never out of bounds.)
            unsafe { read::<$s, T, $swap>(data, n, stride, &mut out, arg) }
        };
    }
    match (kind, size, swap) {
        (b'i', 1, _) => read!(i8, false),
        (b'u', 1, _) => read!(u8, false),
        (b'i', 2, false) => read!(i16, false),
        (b'i', 2, true) => read!(i16, true),
        (b'u', 2, false) => read!(u16, false),
        (b'u', 2, true) => read!(u16, true),
        (b'i', 4, false) => read!(i32, false),
        (b'i', 4, true) => read!(i32, true),
        (b'u', 4, false) => read!(u32, false),
        (b'u', 4, true) => read!(u32, true),
        (b'i', 8, false) => read!(i64, false),
        (b'i', 8, true) => read!(i64, true),
        (b'u', 8, false) => read!(u64, false),
        (b'u', 8, true) => read!(u64, true),
        _ => {
            return Err(PyTypeError::new_err(format!(
                "{arg}: expected integers, got an array of dtype {dtype}"
            )))
        }
    }?;
    Ok(out)
}

/// Appends `n` elements of type `S` (byte-swapped if `SWAP`) read at byte stride
/// `stride` from `data`, converted to `T` with a range check, to `out`, which has room.
///
/// # Safety
/// For every `i < n`, `data + i * stride` is the (possibly unaligned) address of an `S`
/// that stays readable and unchanged for the duration of the call; `out` has room for
/// `n` more elements.
unsafe fn read<S: Src, T: Target + TryFrom<S>, const SWAP: bool>(
    data: *const u8,
    n: usize,
    stride: isize,
    out: &mut Vec<T>,
    arg: &str,
) -> PyResult<()> {
    let width = size_of::<S>();
    if n == 0 {
        return Ok(());
    }
    if usize::try_from(stride) == Ok(width) {
        if !SWAP && S::SIGNED == T::SIGNED && width == size_of::<T>() {
            // Same width and signedness: `S` is `T`, so the bytes are the values.
            // SAFETY: the caller's contract: `n * width` readable bytes from `data` (the
            // array is contiguous), room for `n` elements in `out` (so `len + n` is
            // within capacity and initialised after the copy); bytes need no alignment.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data,
                    out.as_mut_ptr().add(out.len()).cast::<u8>(),
                    n * width,
                );
                out.set_len(out.len() + n);
            }
            return Ok(());
        }
        // SAFETY: the caller's contract with `stride == width`: `n` elements of `S` from
        // `data`, and room for `n` more in `out`.
        unsafe { convert_contiguous::<S, T, SWAP>(data.cast::<S>(), n, out, arg) }
    } else {
        #[allow(clippy::cast_possible_wrap)] // i < n <= isize::MAX (numpy's npy_intp shape)
        // SAFETY: the caller's contract: `data + i * stride` for `i < n` is an element
        // (for a negative stride numpy's data pointer is the first element, the highest
        // address; for a zero stride every element is the same one).
        let at = |i: usize| unsafe {
            data.offset(i as isize * stride)
                .cast::<S>()
                .read_unaligned()
        };
        convert::<S, T, SWAP>(n, at, out, arg)
    }
}

/// [`convert`] for a contiguous array, written as plain loops over raw reads and writes
/// (what the compiler vectorises best: about twice as fast as the general loop).
///
/// # Safety
/// `src[..n]` are readable (possibly unaligned) elements that stay unchanged for the
/// call; `out` has room for `n` more elements.
unsafe fn convert_contiguous<S: Src, T: Target + TryFrom<S>, const SWAP: bool>(
    src: *const S,
    n: usize,
    out: &mut Vec<T>,
    arg: &str,
) -> PyResult<()> {
    let get = |i: usize| {
        // SAFETY: called with `i < n` only: within the caller's `n` elements.
        let v = unsafe { src.add(i).read_unaligned() };
        if SWAP {
            v.swap()
        } else {
            v
        }
    };
    // One pass: each value is written converted (truncated) and its 64-bit form ORed
    // into the range check, a reduction the compiler turns into vector code with the
    // stores (a per-element check would not vectorise). The length covers the written
    // values only once the check has passed; a value out of range is looked up again.
    let len = out.len();
    // SAFETY: the caller's contract: room for `n` elements past `len`; each is written
    // below, and the length covers them only if all of them fit.
    let dst = unsafe { out.as_mut_ptr().add(len) };
    let mut or = 0u64;
    for i in 0..n {
        let bits = get(i).widen();
        or |= bits;
        // SAFETY: `i < n`, within the room.
        unsafe { dst.add(i).write(T::from_bits(bits)) };
    }
    if !T::all_fit(or, S::SIGNED) {
        let first = (0..n).find(|&i| T::try_from(get(i)).is_err()).unwrap_or(0);
        return Err(out_of_range::<T>(arg, get(first), first));
    }
    // SAFETY: the `n` elements past `len` were just written.
    unsafe { out.set_len(len + n) };
    Ok(())
}

/// The conversion loop of [`read`]: a range check over all elements first (no early
/// exit, so it vectorises), then the conversion, which can no longer fail.
#[inline]
fn convert<S: Src, T: Target + TryFrom<S>, const SWAP: bool>(
    n: usize,
    at: impl Fn(usize) -> S,
    out: &mut Vec<T>,
    arg: &str,
) -> PyResult<()> {
    let get = |i| if SWAP { at(i).swap() } else { at(i) };
    let bad = (0..n).fold(false, |bad, i| bad | T::try_from(get(i)).is_err());
    if bad {
        let first = (0..n).find(|&i| T::try_from(get(i)).is_err()).unwrap_or(0);
        return Err(out_of_range::<T>(arg, get(first), first));
    }
    out.extend((0..n).map(|i| T::try_from(get(i)).unwrap_or_default()));
    Ok(())
}

// ---------------------------------------------------------------------- integers

/// An integer argument, extracted without failing so that the error can name the
/// argument on every Python version (pyo3 names it only in an exception note, which
/// Python < 3.11 does not have). The same classification serves sequence elements.
pub(crate) enum Int {
    Value(i64),
    /// An integer out of the 64-bit range.
    TooLarge(Large),
    /// `True` or `False`: an `int` subclass, but never meant as a number here.
    Bool,
    /// Not an integer (no `__index__`): its type name.
    Other(String),
    /// `__index__` raised: the type name and the exception, chained when reported.
    IndexFailed {
        ty: String,
        err: PyErr,
    },
}

impl<'a, 'py> FromPyObject<'a, 'py> for Int {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Int::of(&obj)
    }
}

impl Int {
    /// Classifies `obj`. An `Err` is only a failure of the interpreter itself.
    fn of(obj: &Bound<'_, PyAny>) -> PyResult<Int> {
        let py = obj.py();
        // SAFETY: `obj` is a live object.
        if let Some(v) = unsafe { exact_int(py, obj.as_ptr()) }? {
            return Ok(Int::Value(v));
        }
        if obj.is_exact_instance_of::<PyBool>() {
            return Ok(Int::Bool);
        }
        // SAFETY: `obj` is a live object; the check only reads its type's slots.
        if unsafe { ffi::PyIndex_Check(obj.as_ptr()) } == 0 {
            return Ok(Int::Other(type_name(obj)));
        }
        if is_numpy_bool(obj) {
            return Ok(Int::Bool);
        }
        // `__index__` may run arbitrary code: `obj` is a strong reference, so the object
        // outlives the call whatever it does.
        // SAFETY: `obj` is live; `PyNumber_Index` returns a new reference or NULL with an
        // exception set, which `from_owned_ptr_or_err` takes.
        let index = unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyNumber_Index(obj.as_ptr())) };
        let index = match index {
            Ok(i) => i,
            Err(err) => {
                return Ok(Int::IndexFailed {
                    ty: type_name(obj),
                    err,
                })
            }
        };
        let mut overflow = 0;
        // SAFETY: `index` is a live int (`PyNumber_Index`'s result).
        let v = unsafe { ffi::PyLong_AsLongLongAndOverflow(index.as_ptr(), &raw mut overflow) };
        if overflow != 0 {
            return Ok(Int::TooLarge(Large::of(&index)));
        }
        if v == -1 {
            if let Some(e) = PyErr::take(py) {
                return Err(e);
            }
        }
        Ok(Int::Value(v))
    }

    /// The value, or a `TypeError`/`ValueError` naming `arg`.
    pub(crate) fn get(self, arg: &str) -> PyResult<i64> {
        match self {
            Int::Value(v) => Ok(v),
            Int::TooLarge(v) => Err(PyValueError::new_err(format!(
                "{arg}: {v} is out of the 64-bit range"
            ))),
            Int::Bool => Err(PyTypeError::new_err(format!(
                "{arg}: expected an integer, got bool"
            ))),
            Int::Other(t) => Err(PyTypeError::new_err(format!(
                "{arg}: expected an integer, got {t}"
            ))),
            Int::IndexFailed { ty, err } => Err(Python::attach(|py| {
                index_failed(
                    py,
                    err,
                    &format!("{arg}: expected an integer, got {ty}"),
                    &format!("{arg}: could not convert the {ty} to an integer"),
                )
            })),
        }
    }

    /// A count: an integer >= 0.
    pub(crate) fn count(self, arg: &str) -> PyResult<usize> {
        let v = self.get(arg)?;
        usize::try_from(v)
            .map_err(|_| PyValueError::new_err(format!("{arg}: must be >= 0, got {v}")))
    }
}

/// numpy's bool scalar (`np.True_`). Before numpy 2.1 it has an `__index__` that only
/// warns, so it must be refused by type; it cannot be subclassed, so the check is exact.
fn is_numpy_bool(obj: &Bound<'_, PyAny>) -> bool {
    // SAFETY: reads a type object pointer from numpy's C-API table (loaded on first use,
    // as by every array check).
    let ty = unsafe { npyffi::get_type_object(obj.py(), npyffi::NpyTypes::PyBoolArrType_Type) };
    obj.get_type().as_type_ptr() == ty
}

/// The error for an `__index__` that raised `err`, with `err` as its `__cause__`: a
/// `TypeError` (`type_msg`) when `err` is one, else a `ValueError` (`value_msg`). What is
/// not an `Exception` (`KeyboardInterrupt`, `SystemExit`) passes through untouched.
fn index_failed(py: Python<'_>, err: PyErr, type_msg: &str, value_msg: &str) -> PyErr {
    if !err.is_instance_of::<PyException>(py) {
        return err;
    }
    let wrapped = if err.is_instance_of::<PyTypeError>(py) {
        PyTypeError::new_err(format!("{type_msg} ({err})"))
    } else {
        PyValueError::new_err(format!("{value_msg}: its __index__ raised {err}"))
    };
    wrapped.set_cause(py, Some(err));
    wrapped
}

/// An int beyond 64 bits, described without printing a huge number (Python 3.11+
/// refuses `str` of ints past 4300 digits, and nobody reads them anyway).
pub(crate) struct Large {
    /// The decimal form, for ints of at most 256 bits.
    decimal: Option<String>,
    /// `int.bit_length()`, when it could be asked.
    bits: Option<u64>,
}

impl Large {
    fn of(v: &Bound<'_, PyAny>) -> Large {
        let bits = v
            .call_method0("bit_length")
            .and_then(|b| b.extract::<u64>())
            .ok();
        let decimal = match bits {
            Some(b) if b <= 256 => v.str().ok().map(|s| s.to_string()),
            _ => None,
        };
        Large { decimal, bits }
    }
}

impl Display for Large {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.decimal, self.bits) {
            (Some(d), _) => f.write_str(d),
            (None, Some(b)) => write!(f, "a {b}-bit integer"),
            (None, None) => f.write_str("an integer"),
        }
    }
}

/// A batch id: the integer `TransferBatch.id` (the issuing cache in its high 64 bits,
/// so ids pass the 64-bit range). An id no cache could have issued is a `ValueError`
/// ("no batch ... in flight"); an unknown or foreign one is the core's error. Like
/// [`Int`], extraction never fails, so that the error names the argument on every
/// Python version: [`BatchArg::get`] raises it.
pub(crate) struct BatchArg(PyResult<core::BatchId>);

impl<'a, 'py> FromPyObject<'a, 'py> for BatchArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let no_batch =
            |v: &dyn Display| PyValueError::new_err(format!("batch_id: no batch {v} in flight"));
        let v = match Int::of(&obj)? {
            Int::Value(v) => u128::try_from(v).map_err(|_| no_batch(&v)),
            Int::TooLarge(large) => obj.extract::<u128>().map_err(|_| no_batch(&large)),
            other => other.get("batch_id").and(Err(no_batch(&"?"))),
        };
        Ok(BatchArg(v.and_then(|v| {
            core::BatchId::from_u128(v).ok_or_else(|| no_batch(&v))
        })))
    }
}

impl BatchArg {
    /// The id, or the error naming `batch_id`.
    pub(crate) fn get(self) -> PyResult<core::BatchId> {
        self.0
    }
}

/// A page hash (`hash_seed`, a prior): exactly 32 `bytes`; the error names `arg`.
pub(crate) fn hash_arg(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<core::PageHash> {
    let Ok(bytes) = obj.cast::<PyBytes>() else {
        return Err(PyTypeError::new_err(format!(
            "{arg}: expected 32 bytes or None, got {}",
            type_name(obj)
        )));
    };
    core::PageHash::try_from(bytes.as_bytes()).map_err(|_| {
        PyValueError::new_err(format!(
            "{arg}: expected 32 bytes (a SHA-256 digest), got {}",
            bytes.as_bytes().len()
        ))
    })
}

/// An optional page hash (`None` or 32 bytes), see [`hash_arg`].
pub(crate) fn opt_hash_arg(
    obj: Option<&Bound<'_, PyAny>>,
    arg: &str,
) -> PyResult<Option<core::PageHash>> {
    obj.filter(|o| !o.is_none())
        .map(|o| hash_arg(o, arg))
        .transpose()
}

/// Page hashes as a list of `bytes`.
pub(crate) fn hash_list<'py>(
    py: Python<'py>,
    hashes: &[core::PageHash],
) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, h)))
}

/// Page hashes: a list or tuple of 32-byte `bytes`; errors name `arg` and the position.
pub(crate) fn hashes_arg(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Vec<core::PageHash>> {
    let items: Vec<Bound<'_, PyAny>> = if let Ok(list) = obj.cast::<PyList>() {
        list.iter().collect()
    } else if let Ok(tuple) = obj.cast::<PyTuple>() {
        tuple.iter().collect()
    } else {
        return Err(PyTypeError::new_err(format!(
            "{arg}: expected a list of 32-byte hashes, got {}",
            type_name(obj)
        )));
    };
    items
        .iter()
        .enumerate()
        .map(|(k, h)| hash_arg(h, &format!("{arg}[{k}]")))
        .collect()
}
