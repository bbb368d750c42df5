//! `ObjectStore`: the L3 tier's object stores (`radixcache-l3`), and `Breaker`, its
//! circuit breaker, for the Python L3 engine. Converts arguments, releases the GIL around every store call, and maps
//! errors; framing, verification and the deletion of corrupt objects are the crate's.
//! `frame_encode`/`frame_decode` expose the crate's framing to store clients written in
//! Python (`radixcache.mooncake`), so that every backend stores the same bytes.

use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use numpy::{PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use parking_lot::Mutex;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};
use radixcache_l3 as l3;
use radixcache_l3::frame::{self, Label, HASH_LEN, HEADER_LEN, IDENTITY_LEN};

use crate::convert::{type_name, Int};
use crate::errors::{l3_err, open_err};
use crate::gil::lock;

/// An object store of the L3 tier, opened from a URL: `redis://HOST:PORT[/DB]`,
/// `redis+cluster://HOST:PORT[,HOST:PORT...]` or `file:///ABSOLUTE/DIR`.
#[pyclass(frozen, module = "radixcache._core", name = "ObjectStore")]
pub(crate) struct PyObjectStore {
    store: Box<dyn l3::ObjectStore>,
    url: String,
    timeout_ms: i64,
    /// The seed and rates of a `faulty` store.
    faults: Option<(u64, l3::FaultRates)>,
}

/// The longest `timeout_ms` (a day): a deadline past it is a mistake, not a wish.
const MAX_TIMEOUT_MS: i64 = 86_400_000;

/// `timeout_ms` checked: an integer in `1..=MAX_TIMEOUT_MS`.
fn timeout_arg(timeout_ms: Int) -> PyResult<i64> {
    let ms = timeout_ms.get("timeout_ms")?;
    if (1..=MAX_TIMEOUT_MS).contains(&ms) {
        Ok(ms)
    } else {
        Err(PyValueError::new_err(format!(
            "timeout_ms: must be in 1..={MAX_TIMEOUT_MS} (a day), got {ms}"
        )))
    }
}

/// `url` as text: a `str` of valid Unicode without NUL characters.
fn url_arg(url: &Bound<'_, PyAny>) -> PyResult<String> {
    let text = url.cast::<PyString>().map_err(|_| {
        PyTypeError::new_err(format!("url: expected a str, got {}", type_name(url)))
    })?;
    let text = text
        .to_cow()
        .map_err(|_| PyValueError::new_err("url: not valid Unicode (it holds a lone surrogate)"))?;
    if text.contains('\0') {
        return Err(PyValueError::new_err("url: holds a NUL character"));
    }
    Ok(text.into_owned())
}

/// Opens `url` with the GIL released (the file backend creates its directory).
fn open(py: Python<'_>, url: &str, timeout_ms: i64) -> PyResult<Box<dyn l3::ObjectStore>> {
    // `timeout_arg` checked it positive.
    let options = l3::Options::with_timeout(Duration::from_millis(timeout_ms.unsigned_abs()));
    py.detach(|| l3::open(url, options)).map_err(open_err)
}

/// The label of a call's objects: `kind` (`"kv"` or `"mamba"`) and `identity` (the
/// 32-byte identity digest).
fn label_arg(kind: &str, identity: &Bound<'_, PyAny>) -> PyResult<Label> {
    let kind = frame::Kind::from_name(kind).ok_or_else(|| {
        PyValueError::new_err(format!("kind: expected 'kv' or 'mamba', got {kind:?}"))
    })?;
    let bytes = identity.cast::<PyBytes>().map_err(|_| {
        PyTypeError::new_err(format!(
            "identity: expected {IDENTITY_LEN} bytes, got {}",
            type_name(identity)
        ))
    })?;
    let identity = <[u8; IDENTITY_LEN]>::try_from(bytes.as_bytes()).map_err(|_| {
        PyValueError::new_err(format!(
            "identity: expected {IDENTITY_LEN} bytes, got {}",
            bytes.as_bytes().len()
        ))
    })?;
    Ok(Label { kind, identity })
}

/// The items of `obj`, a list or tuple of `bytes`, copied; errors name `arg`.
fn byte_strings(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<Vec<Vec<u8>>> {
    let not_a_list = || {
        PyTypeError::new_err(format!(
            "{arg}: expected a list of bytes, got {}",
            type_name(obj)
        ))
    };
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyString>() {
        return Err(not_a_list());
    }
    let items = obj.try_iter().map_err(|_| not_a_list())?;
    items
        .enumerate()
        .map(|(i, item)| {
            let item = item?;
            item.cast::<PyBytes>()
                .map(|b| b.as_bytes().to_vec())
                .map_err(|_| {
                    PyTypeError::new_err(format!(
                        "{arg}[{i}]: expected bytes, got {}",
                        type_name(&item)
                    ))
                })
        })
        .collect()
}

/// The page hashes in `obj`, 32 bytes each, one per key.
fn hashes(obj: &Bound<'_, PyAny>, keys: usize) -> PyResult<Vec<[u8; HASH_LEN]>> {
    let raw = byte_strings(obj, "hashes")?;
    if raw.len() != keys {
        return Err(PyValueError::new_err(format!(
            "hashes: {} given for {keys} keys",
            raw.len()
        )));
    }
    raw.iter()
        .enumerate()
        .map(|(i, h)| {
            <[u8; HASH_LEN]>::try_from(h.as_slice()).map_err(|_| {
                PyValueError::new_err(format!(
                    "hashes[{i}]: expected {HASH_LEN} bytes, got {}",
                    h.len()
                ))
            })
        })
        .collect()
}

/// `obj` as a 2-D uint8 array of one row per key; errors name `arg`.
fn rows<'py>(
    obj: &Bound<'py, PyAny>,
    arg: &str,
    keys: usize,
) -> PyResult<Bound<'py, PyArray2<u8>>> {
    let arr = obj.cast::<PyArray2<u8>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{arg}: expected a 2-D numpy uint8 array, got {}",
            describe(obj)
        ))
    })?;
    let shape = arr.shape();
    if shape[0] != keys {
        return Err(PyValueError::new_err(format!(
            "{arg}: {} rows for {keys} keys",
            shape[0]
        )));
    }
    if shape[1] == 0 {
        return Err(PyValueError::new_err(format!("{arg}: rows of 0 bytes")));
    }
    if !arr.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{arg}: must be C-contiguous"
        )));
    }
    Ok(arr.clone())
}

/// An object's type, with dtype and dimensions for a numpy array.
fn describe(obj: &Bound<'_, PyAny>) -> String {
    match obj.cast::<numpy::PyUntypedArray>() {
        Ok(a) => match a.dtype().str() {
            Ok(dtype) => format!("a {}-D array of {dtype}", a.ndim()),
            Err(_) => format!("a {}-D array", a.ndim()),
        },
        Err(_) => type_name(obj),
    }
}

fn as_refs(keys: &[Vec<u8>]) -> Vec<&[u8]> {
    keys.iter().map(Vec::as_slice).collect()
}

#[pymethods]
impl PyObjectStore {
    /// Opens the store at `url`; connects on first use (a store that is down opens and
    /// fails its calls). `timeout_ms` is each call's deadline (plus the connect timeout
    /// when the call connects, plus 10 ms per MB it moves).
    #[new]
    // The default (200 ms, also `faulty`'s) is written out: a constant would show as
    // `...` in the signature Python sees.
    #[pyo3(signature = (url, *, timeout_ms = Int::Value(200)),
           text_signature = "(url, *, timeout_ms=200)")]
    fn new(py: Python<'_>, url: &Bound<'_, PyAny>, timeout_ms: Int) -> PyResult<Self> {
        let url = url_arg(url)?;
        let timeout_ms = timeout_arg(timeout_ms)?;
        Ok(PyObjectStore {
            store: open(py, &url, timeout_ms)?,
            url,
            timeout_ms,
            faults: None,
        })
    }

    /// For tests: the store at `url` with faults drawn from `seed` (rates in 0..=1):
    /// calls that fail or time out, objects lost or corrupted on `get`.
    #[staticmethod]
    #[pyo3(signature = (url, *, seed, fail = 0.0, timeout = 0.0, lose = 0.0, corrupt = 0.0, timeout_ms = Int::Value(200)),
               text_signature = "(url, *, seed, fail=0.0, timeout=0.0, lose=0.0, corrupt=0.0, timeout_ms=200)")]
    #[allow(clippy::too_many_arguments)] // the keyword arguments of the Python signature
    fn faulty(
        py: Python<'_>,
        url: &Bound<'_, PyAny>,
        seed: Int,
        fail: f64,
        timeout: f64,
        lose: f64,
        corrupt: f64,
        timeout_ms: Int,
    ) -> PyResult<Self> {
        let url = url_arg(url)?;
        let timeout_ms = timeout_arg(timeout_ms)?;
        let seed = seed.count("seed")? as u64;
        let rates = l3::FaultRates {
            fail,
            timeout,
            lose,
            corrupt,
        };
        rates
            .validate()
            .map_err(|e| PyValueError::new_err(format!("{}: {e}", e.name)))?;
        let inner = open(py, &url, timeout_ms)?;
        let store = l3::Faulty::new(inner, seed, rates)
            .map_err(|e| PyValueError::new_err(format!("{}: {e}", e.name)))?;
        Ok(PyObjectStore {
            store: Box::new(store),
            url,
            timeout_ms,
            faults: Some((seed, rates)),
        })
    }

    /// The URL it was opened with.
    #[getter]
    fn url(&self) -> &str {
        &self.url
    }

    /// The timeout of each call, in milliseconds.
    #[getter]
    fn timeout_ms(&self) -> i64 {
        self.timeout_ms
    }

    /// Checks now that the store can be used (Redis: connect, authenticate and select the
    /// database; a cluster: its topology; files: the directory is writable), so that a
    /// caller can refuse to start against a store it cannot use.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.store.check()).map_err(l3_err)
    }

    /// Whether each key holds an object.
    fn exists(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let keys = byte_strings(keys, "keys")?;
        py.detach(|| self.store.exists(&as_refs(&keys)))
            .map_err(l3_err)
    }

    /// Frames row `i` of `data` as the object of page `hashes[i]`, of kind `kind`
    /// (`"kv"` or `"mamba"`) for identity `identity` (a 32-byte digest), and stores it
    /// under `keys[i]`, unless the key holds an object already (write-once); per key,
    /// whether this call stored it.
    #[pyo3(signature = (keys, hashes, data, *, kind, identity))]
    fn put(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
        kind: &str,
        identity: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<bool>> {
        let label = label_arg(kind, identity)?;
        let keys = byte_strings(keys, "keys")?;
        let hashes = self::hashes(hashes, keys.len())?;
        let data = rows(data, "data", keys.len())?;
        let size = data.shape()[1];
        let data = data
            .try_readonly()
            .map_err(|e| PyValueError::new_err(format!("data: cannot be read ({e})")))?;
        let bytes = data
            .as_slice()
            .map_err(|e| PyValueError::new_err(format!("data: {e}")))?;
        py.detach(|| {
            let payloads: Vec<&[u8]> = bytes.chunks_exact(size).collect();
            l3::put_pages(&*self.store, &label, &as_refs(&keys), &hashes, &payloads)
        })
        .map_err(l3_err)
    }

    /// Fetches `keys` into the rows of `out` (one row per key, the page's size), each
    /// verified as the object of page `hashes[i]`, of kind `kind`, for identity
    /// `identity`. One outcome per key: `"ok"` (the row holds the page), `"missing"`,
    /// `"foreign"` (an intact object of another kind or identity: deleted) or
    /// `"corrupt"` (the object failed verification: deleted); rows not `"ok"` are left
    /// untouched. When it raises, any row may hold part of what was read.
    #[pyo3(signature = (keys, hashes, out, *, kind, identity))]
    fn get_into(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        kind: &str,
        identity: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<&'static str>> {
        let label = label_arg(kind, identity)?;
        let keys = byte_strings(keys, "keys")?;
        let hashes = self::hashes(hashes, keys.len())?;
        let out = rows(out, "out", keys.len())?;
        let size = out.shape()[1];
        let mut out = out
            .try_readwrite()
            .map_err(|e| PyValueError::new_err(format!("out: must be a writable array ({e})")))?;
        let bytes = out
            .as_slice_mut()
            .map_err(|e| PyValueError::new_err(format!("out: {e}")))?;
        let fetched = py
            .detach(|| {
                let mut rows: Vec<&mut [u8]> = bytes.chunks_exact_mut(size).collect();
                l3::get_pages_into(&*self.store, &label, &as_refs(&keys), &hashes, &mut rows)
            })
            .map_err(l3_err)?;
        Ok(fetched.iter().map(l3::Fetched::as_str).collect())
    }

    /// Removes the objects under `keys` (absent ones are no error).
    fn delete(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = byte_strings(keys, "keys")?;
        py.detach(|| self.store.delete(&as_refs(&keys)))
            .map_err(l3_err)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let url = PyString::new(py, &self.url).repr()?;
        Ok(match &self.faults {
            None => format!("ObjectStore({url}, timeout_ms={})", self.timeout_ms),
            Some((seed, r)) => format!(
                "ObjectStore.faulty({url}, seed={seed}, fail={:?}, timeout={:?}, lose={:?}, \
                 corrupt={:?}, timeout_ms={})",
                r.fail, r.timeout, r.lose, r.corrupt, self.timeout_ms
            ),
        })
    }
}

/// The L3 tier's circuit breaker (`radixcache-l3`'s `Breaker`) on the monotonic clock:
/// opens after `threshold` consecutive failures, refuses calls for `cooldown_ms`, then
/// lets one probe through (half-open) whose outcome closes or re-opens it.
#[pyclass(frozen, module = "radixcache._core", name = "Breaker")]
pub(crate) struct PyBreaker {
    breaker: Mutex<l3::Breaker>,
    threshold: u32,
    cooldown_ms: u64,
}

#[pymethods]
impl PyBreaker {
    #[new]
    #[pyo3(signature = (*, threshold = 5, cooldown_ms = 1000))]
    fn new(threshold: i64, cooldown_ms: i64) -> PyResult<Self> {
        let t = u32::try_from(threshold)
            .ok()
            .and_then(NonZeroU32::new)
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "threshold: must be in 1..=4294967295, got {threshold}"
                ))
            })?;
        let c = u64::try_from(cooldown_ms).map_err(|_| {
            PyValueError::new_err(format!(
                "cooldown_ms: must be at least 0, got {cooldown_ms}"
            ))
        })?;
        Ok(PyBreaker {
            breaker: Mutex::new(l3::Breaker::new(t, Duration::from_millis(c))),
            threshold: t.get(),
            cooldown_ms: c,
        })
    }

    /// Whether a call may go to the store now. After the cooldown, the first caller is
    /// let through as the probe (the state becomes `"half_open"`).
    fn allow(&self, py: Python<'_>) -> bool {
        lock(py, &self.breaker).allow(Instant::now())
    }

    /// A call that was let through succeeded.
    fn success(&self, py: Python<'_>) {
        lock(py, &self.breaker).success();
    }

    /// A call that was let through failed.
    fn failure(&self, py: Python<'_>) {
        lock(py, &self.breaker).failure(Instant::now());
    }

    /// `"closed"`, `"open"` or `"half_open"`.
    #[getter]
    fn state(&self, py: Python<'_>) -> &'static str {
        lock(py, &self.breaker).state().as_str()
    }

    /// Failures reported, in all.
    #[getter]
    fn errors(&self, py: Python<'_>) -> u64 {
        lock(py, &self.breaker).errors()
    }

    /// Times it opened.
    #[getter]
    fn trips(&self, py: Python<'_>) -> u64 {
        lock(py, &self.breaker).trips()
    }

    /// Consecutive failures that open it.
    #[getter]
    fn threshold(&self) -> u32 {
        self.threshold
    }

    /// How long it stays open before a probe, in milliseconds.
    #[getter]
    fn cooldown_ms(&self) -> u64 {
        self.cooldown_ms
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let (state, errors, trips) = {
            let b = lock(py, &self.breaker);
            (b.state().as_str(), b.errors(), b.trips())
        };
        format!(
            "Breaker(state={state:?}, errors={errors}, trips={trips}, threshold={}, \
             cooldown_ms={})",
            self.threshold, self.cooldown_ms
        )
    }
}

/// `objects`, a 2-D uint8 array of one framed object per row, each `HEADER_LEN` bytes
/// wider than a row of `payloads`; errors name `arg`.
fn framed_rows<'py>(
    obj: &Bound<'py, PyAny>,
    arg: &str,
    keys: usize,
    payload: usize,
) -> PyResult<Bound<'py, PyArray2<u8>>> {
    let arr = rows(obj, arg, keys)?;
    let width = arr.shape()[1];
    if width != HEADER_LEN + payload {
        return Err(PyValueError::new_err(format!(
            "{arg}: rows of {width} bytes, expected {} (a {HEADER_LEN}-byte header and \
             {payload} bytes of payload)",
            HEADER_LEN + payload
        )));
    }
    Ok(arr)
}

/// Frames row `i` of `data` as the object of page `hashes[i]`, of kind `kind` for
/// identity `identity`, into row `i` of `out` (`HEADER_LEN` bytes wider than `data`): the
/// bytes `ObjectStore.put` stores.
#[pyfunction]
#[pyo3(signature = (hashes, data, out, *, kind, identity))]
pub(crate) fn frame_encode(
    py: Python<'_>,
    hashes: &Bound<'_, PyAny>,
    data: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    kind: &str,
    identity: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let label = label_arg(kind, identity)?;
    let count = byte_strings(hashes, "hashes")?.len();
    let hashes = self::hashes(hashes, count)?;
    let data = rows(data, "data", count)?;
    let size = data.shape()[1];
    let out = framed_rows(out, "out", hashes.len(), size)?;
    let data = data
        .try_readonly()
        .map_err(|e| PyValueError::new_err(format!("data: cannot be read ({e})")))?;
    let payloads = data
        .as_slice()
        .map_err(|e| PyValueError::new_err(format!("data: {e}")))?;
    let mut out = out
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("out: must be a writable array ({e})")))?;
    let objects = out
        .as_slice_mut()
        .map_err(|e| PyValueError::new_err(format!("out: {e}")))?;
    py.detach(|| {
        let rows = payloads
            .chunks_exact(size)
            .zip(objects.chunks_exact_mut(HEADER_LEN + size));
        for (hash, (payload, object)) in hashes.iter().zip(rows) {
            let (head, body) = object.split_at_mut(HEADER_LEN);
            head.copy_from_slice(&frame::header(&label, hash, payload));
            body.copy_from_slice(payload);
        }
    });
    Ok(())
}

/// Verifies the first `lengths[i]` bytes of row `i` of `objects` as the object of page
/// `hashes[i]`, of kind `kind` for identity `identity`, and copies its payload into row
/// `i` of `out`; per row, `"ok"` (verified and copied), `"foreign"` (an intact object of
/// another kind or identity) or `"corrupt"` (the row of `out` left untouched but for
/// `"ok"`).
#[pyfunction]
#[pyo3(signature = (hashes, objects, lengths, out, *, kind, identity))]
pub(crate) fn frame_decode(
    py: Python<'_>,
    hashes: &Bound<'_, PyAny>,
    objects: &Bound<'_, PyAny>,
    lengths: Vec<i64>,
    out: &Bound<'_, PyAny>,
    kind: &str,
    identity: &Bound<'_, PyAny>,
) -> PyResult<Vec<&'static str>> {
    let label = label_arg(kind, identity)?;
    let hashes = self::hashes(hashes, lengths.len())?;
    let out = rows(out, "out", hashes.len())?;
    let size = out.shape()[1];
    let objects = framed_rows(objects, "objects", hashes.len(), size)?;
    let width = HEADER_LEN + size;
    let lengths = lengths
        .into_iter()
        .enumerate()
        .map(|(i, n)| match usize::try_from(n) {
            Ok(n) if n <= width => Ok(n),
            _ => Err(PyValueError::new_err(format!(
                "lengths[{i}]: must be in 0..={width}, got {n}"
            ))),
        })
        .collect::<PyResult<Vec<usize>>>()?;
    let objects = objects
        .try_readonly()
        .map_err(|e| PyValueError::new_err(format!("objects: cannot be read ({e})")))?;
    let objects = objects
        .as_slice()
        .map_err(|e| PyValueError::new_err(format!("objects: {e}")))?;
    let mut out = out
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("out: must be a writable array ({e})")))?;
    let payloads = out
        .as_slice_mut()
        .map_err(|e| PyValueError::new_err(format!("out: {e}")))?;
    Ok(py.detach(|| {
        let rows = objects
            .chunks_exact(width)
            .zip(payloads.chunks_exact_mut(size));
        hashes
            .iter()
            .zip(&lengths)
            .zip(rows)
            .map(|((hash, &n), (object, payload))| {
                match frame::decode_into(&label, hash, &object[..n], payload) {
                    Ok(()) => "ok",
                    Err(e) if e.is_foreign() => "foreign",
                    Err(_) => "corrupt",
                }
            })
            .collect()
    }))
}
