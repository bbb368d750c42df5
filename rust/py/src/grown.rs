//! The arrays `Request.tokens` and `Request.kv_indices` hand out: read-only int64 views
//! of a buffer that grows with the request, so that reading them after each decode step
//! costs time in proportion to what the request gained, not to its length.
//!
//! Each read asks the core for what changed since the last one ([`core::Grown`]): while
//! the request only grew at the end, the new entries are written past the end of the
//! buffer (into room no array handed out covers) and a new view of the longer prefix is
//! handed out; when anything else changed (a checkpoint, a load-back, a failed copy), the
//! whole answer goes into a new buffer. So an array once handed out never changes: it is
//! a snapshot of the request when it was read.

use numpy::{PyArray1, PyArrayMethods};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PySlice};
use radixcache_core as core;

use crate::gil;

/// Makes `array` read-only for good: numpy refuses `setflags(write=True)` on an array
/// whose memory it does not own (a `PyArray1::from_vec` array, a view of a read-only
/// buffer).
fn freeze(array: &Bound<'_, PyArray1<i64>>) -> PyResult<()> {
    let kwargs = PyDict::new(array.py());
    kwargs.set_item("write", false)?;
    array.call_method("setflags", (), Some(&kwargs))?;
    Ok(())
}

/// A read-only int64 array of `values`.
pub(crate) fn read_only(py: Python<'_>, values: &[i64]) -> PyResult<Py<PyArray1<i64>>> {
    let array = PyArray1::from_vec(py, values.to_vec());
    freeze(&array)?;
    Ok(array.unbind())
}

/// The last read of one of a request's arrays.
#[derive(Default)]
pub(crate) struct GrownArray {
    /// The request's epoch at the last read (`None`: never read).
    epoch: Option<u64>,
    /// Entries read so far: `buf[..len]`.
    len: usize,
    /// The buffer's length (its capacity).
    capacity: usize,
    /// The buffer; never handed out itself.
    buf: Option<Py<PyArray1<i64>>>,
    /// The array last handed out (`buf[..len]`), handed out again while nothing changed.
    view: Option<Py<PyArray1<i64>>>,
}

/// What a read does after the core answered, decided under the array's lock.
enum Plan {
    /// Nothing changed: hand out the last array again.
    Same(Py<PyArray1<i64>>),
    /// The new entries were written in place, past what any array handed out covers:
    /// hand out a view of `buf[..len]` (`stale`: the last view, to drop unlocked).
    View {
        buf: Py<PyArray1<i64>>,
        len: usize,
        stale: Option<Py<PyArray1<i64>>>,
    },
    /// A new buffer: the first `keep` entries of `old`, then `items`.
    Rebuild {
        old: Option<Py<PyArray1<i64>>>,
        keep: usize,
    },
    /// Another thread read since this read's position was taken.
    Raced,
}

/// Reads one of a request's arrays incrementally: `fetch(epoch, from)` asks the core
/// for what the request gained since the read at that position ([`core::Grown`]).
///
/// By the GIL policy ([`gil`]), the array's lock is held only to read and update its
/// plain fields and write entries into room no array handed out covers: every Python
/// object is created, and every one it replaces dropped, after the lock is released.
/// The core is called without the lock. A read that raced another one is answered from
/// a fresh read of its own, which it does not keep.
pub(crate) fn read<T: Copy + Into<i64>>(
    py: Python<'_>,
    array: &Mutex<GrownArray>,
    fetch: impl Fn(Option<u64>, usize) -> PyResult<core::Grown<T>>,
) -> PyResult<Py<PyArray1<i64>>> {
    let position = gil::lock(py, array).position();
    let grown = fetch(position.0, position.1)?;
    let plan = {
        let mut last = gil::lock(py, array);
        if last.position() == position {
            last.plan(py, &grown)
        } else {
            Plan::Raced
        }
    };
    match plan {
        Plan::Same(view) => Ok(view),
        Plan::View { buf, len, stale } => {
            drop(stale);
            let view = slice(buf.bind(py), len)?;
            let mut last = gil::lock(py, array);
            let old = (last.position() == (Some(grown.epoch), len) && last.view.is_none())
                .then(|| last.view.replace(view.clone_ref(py)));
            drop(last);
            drop(old);
            Ok(view)
        }
        Plan::Rebuild { old, keep } => {
            let len = keep + grown.items.len();
            let capacity = (len * 3 / 2).max(64);
            let buf = PyArray1::<i64>::zeros(py, capacity, false);
            freeze(&buf)?;
            if let Some(old) = &old {
                // SAFETY: both buffers are contiguous int64 arrays of at least `keep`
                // entries (`keep <=` the old `len <=` its capacity, `keep <= len <`
                // the new one), distinct allocations, and no Rust reference to either
                // exists; Python cannot write them (not writeable, never handed out),
                // and no thread writes the old one's first `len` entries (see `plan`).
                unsafe {
                    std::ptr::copy_nonoverlapping(old.bind(py).data(), buf.data(), keep);
                }
            }
            let out = buf.data();
            for (k, v) in grown.items.iter().enumerate() {
                // SAFETY: `keep + k < len <= capacity`; the buffer is this thread's alone
                // until it is installed below.
                unsafe { out.add(keep + k).write((*v).into()) };
            }
            let view = slice(&buf, len)?;
            let mut last = gil::lock(py, array);
            let replaced = (last.position() == position).then(|| {
                last.epoch = Some(grown.epoch);
                last.len = len;
                last.capacity = capacity;
                (
                    last.buf.replace(buf.unbind()),
                    last.view.replace(view.clone_ref(py)),
                )
            });
            drop(last);
            drop((old, replaced));
            Ok(view)
        }
        Plan::Raced => {
            let full = fetch(None, 0)?;
            let items: Vec<i64> = full.items.iter().map(|&v| v.into()).collect();
            read_only(py, &items)
        }
    }
}

/// `buf[:len]`.
fn slice(buf: &Bound<'_, PyArray1<i64>>, len: usize) -> PyResult<Py<PyArray1<i64>>> {
    let end = isize::try_from(len).unwrap_or(isize::MAX);
    Ok(buf
        .get_item(PySlice::new(buf.py(), 0, end, 1))?
        .cast_into::<PyArray1<i64>>()?
        .unbind())
}

impl GrownArray {
    /// What to ask the core for: the epoch and how many entries this holds.
    fn position(&self) -> (Option<u64>, usize) {
        (self.epoch, self.len)
    }

    /// Decides how to apply what the core answered for [`GrownArray::position`], under
    /// the lock: creates no Python object (`clone_ref` only counts a reference).
    fn plan<T: Copy + Into<i64>>(&mut self, py: Python<'_>, grown: &core::Grown<T>) -> Plan {
        let same = self.epoch == Some(grown.epoch) && grown.start == self.len;
        if same && grown.items.is_empty() {
            if let Some(view) = &self.view {
                return Plan::Same(view.clone_ref(py));
            }
        }
        let len = self.len + grown.items.len();
        match &self.buf {
            Some(buf) if same && len <= self.capacity => {
                let out = buf.bind(py).data();
                for (k, v) in grown.items.iter().enumerate() {
                    // SAFETY: `self.len + k < len <= capacity`; the entries from
                    // `self.len` on are covered by no array handed out (those cover at
                    // most `self.len` entries of this buffer) and written by no other
                    // thread (this one holds the lock, and `len` moves past them before
                    // it is released), so nothing reads them while they are written; the
                    // buffer is not writeable from Python.
                    unsafe { out.add(self.len + k).write((*v).into()) };
                }
                self.epoch = Some(grown.epoch);
                self.len = len;
                // The last view is stale: the read that wrote this installs its own.
                Plan::View {
                    buf: buf.clone_ref(py),
                    len,
                    stale: self.view.take(),
                }
            }
            old => Plan::Rebuild {
                old: if same {
                    old.as_ref().map(|b| b.clone_ref(py))
                } else {
                    None
                },
                keep: if same { self.len } else { 0 },
            },
        }
    }
}
