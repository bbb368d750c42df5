//! `chain_hashes`: the page-hash chain as a plain function (no cache needed).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;
use radixcache_core as core;

use crate::convert::{hash_list, opt_hash_arg, tokens_arg, Int};

/// The SHA-256 chain of the whole pages of `tokens` (pages of `page_size`; an unaligned
/// tail is not hashed), each `sha256(prior || page tokens as u32 little-endian)`, the
/// first chained from `prior` (32 bytes, or None for no prior).
#[pyfunction]
#[pyo3(signature = (tokens, page_size, prior=None))]
pub(crate) fn chain_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'_, PyAny>,
    page_size: Int,
    prior: Option<&Bound<'_, PyAny>>,
) -> PyResult<Bound<'py, PyList>> {
    let tokens = tokens_arg(tokens, "tokens")?;
    let page_size = page_size.count("page_size")?;
    if page_size == 0 {
        return Err(PyValueError::new_err("page_size: must be at least 1"));
    }
    let prior = opt_hash_arg(prior, "prior")?;
    let hashes = if tokens.len() > 4096 {
        py.detach(|| core::hashes::chain(prior.as_ref(), &tokens, page_size))
    } else {
        core::hashes::chain(prior.as_ref(), &tokens, page_size)
    };
    hash_list(py, &hashes)
}
