//! `KvEvent`: one KV event of the core (docs/design.md, "KV events (core)"), as the
//! events publisher reads it.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use radixcache_core as core;

use crate::convert::hash_list;

/// One KV event, oldest first from `HybridCache.take_events()`.
#[pyclass(frozen, module = "radixcache._core", name = "KvEvent")]
pub(crate) struct PyKvEvent {
    kind: &'static str,
    medium: &'static str,
    namespace: Option<String>,
    hashes: Vec<core::PageHash>,
    parent_hash: Option<core::PageHash>,
    token_ids: Vec<u32>,
    block_size: usize,
}

impl PyKvEvent {
    /// The binding's form of a core event; `block_size`: the cache's page size (every
    /// event carries it).
    pub(crate) fn new(e: core::KvEvent, block_size: usize) -> PyKvEvent {
        let mut out = PyKvEvent {
            kind: "cleared",
            medium: "",
            namespace: None,
            hashes: Vec::new(),
            parent_hash: None,
            token_ids: Vec::new(),
            block_size,
        };
        match e {
            core::KvEvent::Stored {
                medium,
                namespace,
                hashes,
                parent_hash,
                token_ids,
                block_size,
            } => {
                out.kind = "stored";
                out.medium = medium.as_str();
                out.namespace = namespace;
                out.hashes = hashes;
                out.parent_hash = parent_hash;
                out.token_ids = token_ids;
                out.block_size = block_size;
            }
            core::KvEvent::Removed {
                medium,
                namespace,
                hashes,
            } => {
                out.kind = "removed";
                out.medium = medium.as_str();
                out.namespace = namespace;
                out.hashes = hashes;
            }
            core::KvEvent::Cleared => {}
            core::KvEvent::StateStored {
                medium,
                namespace,
                hash,
            } => {
                out.kind = "state_stored";
                out.medium = medium.as_str();
                out.namespace = namespace;
                out.hashes = vec![hash];
            }
            core::KvEvent::StateRemoved {
                medium,
                namespace,
                hash,
            } => {
                out.kind = "state_removed";
                out.medium = medium.as_str();
                out.namespace = namespace;
                out.hashes = vec![hash];
            }
        }
        out
    }
}

#[pymethods]
impl PyKvEvent {
    /// `"stored"`, `"removed"`, `"cleared"`, `"state_stored"` or `"state_removed"`.
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind
    }

    /// `"GPU"`, `"CPU_PINNED"` or `"EXTERNAL"` (`""` for `"cleared"`, every medium's).
    #[getter]
    fn medium(&self) -> &'static str {
        self.medium
    }

    /// The namespace (None: the default one).
    #[getter]
    fn namespace(&self) -> Option<&str> {
        self.namespace.as_deref()
    }

    /// The pages' hashes (a state kind: the one hash of its prefix's last page).
    #[getter]
    fn hashes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        hash_list(py, &self.hashes)
    }

    /// "stored": the hash of the page before the first (None: the first of its chain).
    #[getter]
    fn parent_hash<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.parent_hash.map(|h| PyBytes::new(py, &h))
    }

    /// "stored": the pages' tokens (empty for the other kinds).
    #[getter]
    fn token_ids(&self) -> Vec<u32> {
        self.token_ids.clone()
    }

    /// Tokens per page.
    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn __repr__(&self) -> String {
        // The first four bytes of a hash, in hex.
        let short =
            |h: &core::PageHash| format!("{:02x}{:02x}{:02x}{:02x}…", h[0], h[1], h[2], h[3]);
        format!(
            "KvEvent(kind={:?}, medium={:?}, namespace={}, hashes=[{}], parent_hash={}, \
             tokens={}, block_size={})",
            self.kind,
            self.medium,
            self.namespace
                .as_deref()
                .map_or_else(|| "None".to_owned(), |n| format!("{n:?}")),
            self.hashes.iter().map(short).collect::<Vec<_>>().join(", "),
            self.parent_hash
                .as_ref()
                .map_or_else(|| "None".to_owned(), short),
            self.token_ids.len(),
            self.block_size
        )
    }
}
