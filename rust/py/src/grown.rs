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

use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PySlice};
use radixcache_core as core;

/// The last read of one of a request's arrays.
#[derive(Default)]
pub(crate) struct GrownArray {
    /// The request's epoch at the last read (`None`: never read).
    epoch: Option<u64>,
    /// Entries read so far: `buf[..len]`.
    len: usize,
    /// The buffer (its length is its capacity); never handed out itself.
    buf: Option<Py<PyArray1<i64>>>,
    /// The array last handed out (`buf[..len]`), handed out again while nothing changed.
    view: Option<Py<PyArray1<i64>>>,
}

impl GrownArray {
    /// What to ask the core for: the epoch and how many entries this holds.
    pub fn position(&self) -> (Option<u64>, usize) {
        (self.epoch, self.len)
    }

    /// Applies what the core answered for [`GrownArray::position`] and returns the
    /// array of every entry.
    pub fn apply<T: Copy + Into<i64>>(
        &mut self,
        py: Python<'_>,
        grown: core::Grown<T>,
    ) -> PyResult<Py<PyArray1<i64>>> {
        let same = self.epoch == Some(grown.epoch) && grown.start == self.len;
        if same && grown.items.is_empty() {
            if let Some(view) = &self.view {
                return Ok(view.clone_ref(py));
            }
        }
        let keep = if same { self.len } else { 0 };
        let len = keep + grown.items.len();
        let capacity = self.buf.as_ref().map_or(0, |b| b.bind(py).len());
        // Arrays handed out may cover `buf[..self.len]`: anything else is written into a
        // new buffer (with room to grow), keeping what is still right.
        let buf = match &self.buf {
            Some(buf) if same && len <= capacity => buf.bind(py).clone(),
            old => {
                let buf = PyArray1::<i64>::zeros(py, (len * 3 / 2).max(64), false);
                let kwargs = PyDict::new(py);
                kwargs.set_item("write", false)?;
                buf.call_method("setflags", (), Some(&kwargs))?;
                if let Some(old) = old {
                    // SAFETY: both buffers are contiguous int64 arrays of at least `keep`
                    // entries (`keep <= self.len <=` the old capacity, `keep <= len <`
                    // the new one), distinct allocations, and no Rust reference to either
                    // exists; Python cannot write them (not writeable, never handed out).
                    unsafe {
                        std::ptr::copy_nonoverlapping(old.bind(py).data(), buf.data(), keep);
                    }
                }
                self.buf = Some(buf.clone().unbind());
                buf
            }
        };
        let out = buf.data();
        for (k, v) in grown.items.into_iter().enumerate() {
            // SAFETY: `keep + k < len <= buf.len()`; the entries from `keep` on are
            // covered by no array handed out (those cover at most `keep` entries of this
            // buffer), so nothing reads them while they are written, and the buffer is
            // not writeable from Python.
            unsafe { out.add(keep + k).write(v.into()) };
        }
        let view = buf
            .get_item(PySlice::new(
                py,
                0,
                isize::try_from(len).unwrap_or(isize::MAX),
                1,
            ))?
            .cast_into::<PyArray1<i64>>()?
            .unbind();
        self.epoch = Some(grown.epoch);
        self.len = len;
        self.view = Some(view.clone_ref(py));
        Ok(view)
    }
}
