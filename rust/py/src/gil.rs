//! The binding's one policy for the GIL and its locks, and how its finalisers call Python.
//!
//! Locks. Every lock the binding takes (the cache's mutex, and its own: a request's read
//! arrays, a lock receipt's slot, a load-back's guard) follows two rules:
//! - a thread attached to the interpreter never waits for a lock: it takes a free lock
//!   attached, and otherwise detaches (releases the GIL) before it waits, so that the
//!   holder and every other Python thread go on ([`run`], [`settle`], [`lock`]);
//! - nothing runs Python code, or creates or drops a Python object, while it holds a
//!   lock: an allocation may start a garbage collection, whose finalisers and
//!   `gc.callbacks` may call the binding on the same thread, which would then wait for a
//!   lock it holds itself.
//!
//! So a holder never needs the GIL to let go, and nobody waits for a lock while holding
//! the GIL that the holder might need. The one lock read attached without this is the
//! core's per-batch outcome (`TransferBatch.outcome`), which is held for a few
//! instructions and never while waiting for anything.
//!
//! Finalisers (the `Drop` of a class that owns slots) run inside the interpreter's
//! deallocation, often while an exception is being raised (a `for` loop or `with` block
//! left by an exception drops what it held) or while the interpreter shuts down. They
//! give back what they own without Python, then report it with
//! [`warn_from_finalizer`], which keeps the exception in flight intact.

use std::ffi::CString;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Mutex, MutexGuard};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyCFunction;
use radixcache_core as core;
use radixcache_core::Cache;

use crate::errors::err;

/// Calls over this many tokens run with the GIL released even when the cache is free:
/// long enough that another Python thread should not wait for them (see [`run`]).
const DETACH_TOKENS: usize = 4096;

/// Runs `f` on the cache and converts its error: the one way binding methods reach the
/// core.
///
/// A call takes the cache without releasing the GIL when no other thread holds it
/// (releasing and retaking the GIL costs more than most calls, measured by
/// `benches/py_calls.py --threads`); when another thread holds the cache, it releases
/// the GIL before it waits; a call over `DETACH_TOKENS` tokens always releases it.
pub(crate) fn run<T: Send>(
    py: Python<'_>,
    cache: &core::HybridCache,
    n: usize,
    f: impl FnOnce(&mut Cache) -> core::Result<T> + Send,
) -> PyResult<T> {
    let f = if n < DETACH_TOKENS {
        match cache.with_uncontended(f) {
            Ok(out) => return out.and_then(|r| r).map_err(err),
            Err(f) => f,
        }
    } else {
        f
    };
    py.detach(|| cache.call(f)).map_err(err)
}

/// Runs `f`, which takes the cache's mutex itself (a core handle's method or drop), by
/// the same policy as [`run`]: attached when the cache is free, detached when another
/// thread holds it. (Should another thread take the cache between the check and `f`,
/// `f` waits attached for a holder that, by the policy, never needs the GIL.)
pub(crate) fn settle<T: Send>(
    py: Python<'_>,
    cache: &core::HybridCache,
    f: impl FnOnce() -> T + Send,
) -> T {
    // While the interpreter shuts down no other Python thread runs, and a thread that
    // detaches then may not be let back in.
    if exiting() || cache.with_uncontended(|_| ()).is_ok() {
        f()
    } else {
        py.detach(f)
    }
}

/// Takes one of the binding's own mutexes without waiting for it while attached: a free
/// mutex is taken at once; a held one is waited for detached, then taken attached. The
/// guard must not be held across Python code or the creation of Python objects.
pub(crate) fn lock<'a, T: Send>(py: Python<'_>, mutex: &'a Mutex<T>) -> MutexGuard<'a, T> {
    loop {
        if let Some(guard) = mutex.try_lock() {
            return guard;
        }
        py.detach(|| drop(mutex.lock()));
    }
}

/// Set by an `atexit` hook ([`init`]): the interpreter is shutting down.
static EXITING: AtomicBool = AtomicBool::new(false);

/// Whether the interpreter is shutting down (after the `atexit` hooks registered before
/// the module was imported, including `threading`'s, ran).
pub(crate) fn exiting() -> bool {
    EXITING.load(Ordering::Relaxed)
}

/// Registers the `atexit` hook behind [`exiting`].
pub(crate) fn init(py: Python<'_>) -> PyResult<()> {
    let hook = PyCFunction::new_closure(py, None, None, |_args, _kwargs| {
        EXITING.store(true, Ordering::Relaxed);
    })?;
    py.import("atexit")?.call_method1("register", (hook,))?;
    Ok(())
}

/// The error indicator, taken aside while a finaliser runs Python code and put back
/// unchanged when dropped (also when there was none: the indicator is then left clear).
struct SavedError {
    ty: *mut ffi::PyObject,
    value: *mut ffi::PyObject,
    traceback: *mut ffi::PyObject,
}

impl SavedError {
    fn take(_py: Python<'_>) -> SavedError {
        let mut saved = SavedError {
            ty: std::ptr::null_mut(),
            value: std::ptr::null_mut(),
            traceback: std::ptr::null_mut(),
        };
        // SAFETY: the thread is attached (`_py`); `PyErr_Fetch` moves the indicator's
        // three references (each possibly NULL) into ours and clears it. (It is the one
        // call for this in the stable ABI of every supported version; 3.12 deprecates it
        // in favour of `PyErr_GetRaisedException` but keeps it, exactly equivalent.)
        unsafe {
            #[allow(deprecated)]
            ffi::PyErr_Fetch(
                &raw mut saved.ty,
                &raw mut saved.value,
                &raw mut saved.traceback,
            );
        }
        saved
    }
}

impl Drop for SavedError {
    fn drop(&mut self) {
        // SAFETY: a `SavedError` only exists on an attached thread, within the finaliser
        // that took it (it is neither `Send` nor stored); `PyErr_Restore` takes back the
        // three references `take` moved out, replacing (and so clearing) anything set
        // since.
        unsafe {
            #[allow(deprecated)]
            ffi::PyErr_Restore(self.ty, self.value, self.traceback);
        }
    }
}

/// Emits a `ResourceWarning` from a finaliser of an instance of `class`, leaving the
/// exception being raised (if any) exactly as it was. A warning that becomes an error
/// (`-W error::ResourceWarning`) cannot be raised from a finaliser: it is reported as
/// unraisable (`sys.unraisablehook`), naming `class`. While the interpreter shuts down
/// nothing is emitted (the warnings machinery may be gone already).
pub(crate) fn warn_from_finalizer(py: Python<'_>, class: &Bound<'_, PyAny>, msg: &str) {
    if exiting() {
        return;
    }
    let msg = CString::new(msg).unwrap_or_default();
    let _saved = SavedError::take(py);
    // SAFETY: attached; the category is a live exception type and `msg` a C string that
    // outlives the call. No exception is set (just saved), so a failure is the warning's.
    let failed = unsafe { ffi::PyErr_WarnEx(ffi::PyExc_ResourceWarning, msg.as_ptr(), 1) } < 0;
    if failed {
        // SAFETY: attached, with the warning's exception set; `class` is a live object
        // (a type, not the instance being torn down). This reports and clears it.
        unsafe { ffi::PyErr_WriteUnraisable(class.as_ptr()) };
    }
}
