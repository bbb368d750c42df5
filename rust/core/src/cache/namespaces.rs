//! Namespaces: one radix tree each (a `LoRA` adapter, a tenant's cache salt), over one set
//! of pools. [`Namespaces`] owns the table of roots.
//!
//! A named namespace has a root only while it holds something: the root is made by the
//! first call that caches into it (an insert, or an admission, whose request will) and
//! dropped when it has no child and no lock. A read of a namespace that has no root is a
//! miss answered from one shared empty root that is never given children, so reads with
//! ever new names (cache salts) cost no memory.

use std::collections::HashMap;
use std::sync::Arc;

use crate::tree::{Tree, NONE};

use super::Cache;

/// The root of every namespace.
pub(crate) struct Namespaces {
    /// Root of the default namespace (`None`): always there.
    default: u32,
    /// The answer of reads in a namespace without a root: never has children.
    empty: u32,
    /// Roots of named namespaces that hold something (looked up by `&str`, no
    /// allocation per call).
    named: HashMap<Arc<str>, u32>,
    /// The name of each named root (to drop it in O(1)).
    names: HashMap<u32, Arc<str>>,
}

impl Namespaces {
    pub fn new(tree: &mut Tree) -> Namespaces {
        Namespaces {
            default: new_root(tree),
            empty: new_root(tree),
            named: HashMap::new(),
            names: HashMap::new(),
        }
    }

    /// The root of `namespace`, if it exists.
    pub fn get(&self, namespace: Option<&str>) -> Option<u32> {
        match namespace {
            None => Some(self.default),
            Some(ns) => self.named.get(ns).copied(),
        }
    }

    /// The root reads of `namespace` start from: its own, or the empty one.
    pub fn read(&self, namespace: Option<&str>) -> u32 {
        self.get(namespace).unwrap_or(self.empty)
    }

    /// The shared empty root.
    pub fn empty(&self) -> u32 {
        self.empty
    }

    /// The name of root `r` (`None`: the default or the empty root).
    pub fn name_of(&self, r: u32) -> Option<&str> {
        self.names.get(&r).map(|n| &**n)
    }

    /// Named namespaces.
    pub fn named(&self) -> usize {
        self.named.len()
    }

    /// Every namespace with its root: the default one first, then by name (the empty
    /// root is no namespace's).
    pub fn all(&self) -> Vec<(Option<&str>, u32)> {
        let mut named: Vec<_> = self.named.iter().map(|(k, &r)| (Some(&**k), r)).collect();
        named.sort_unstable();
        let mut out = vec![(None, self.default)];
        out.extend(named);
        out
    }
}

/// A new root: no key, no parent, an empty device KV run.
fn new_root(tree: &mut Tree) -> u32 {
    let r = tree.alloc_node(NONE, Vec::new());
    tree.node_mut(r).kv.device = Some(Vec::new());
    r
}

impl Cache {
    /// The root of `namespace`, made if it has none (by calls that cache into it).
    pub(crate) fn root(&mut self, namespace: Option<&str>) -> u32 {
        if let Some(r) = self.roots.get(namespace) {
            return r;
        }
        let r = new_root(&mut self.tree);
        self.tree.node_mut(r).hashes = self.root_hashes(namespace);
        let name: Arc<str> = Arc::from(namespace.unwrap_or_default());
        self.roots.named.insert(Arc::clone(&name), r);
        self.roots.names.insert(r, name);
        r
    }

    /// Drops node `r` if it is a named namespace's root that holds nothing (no child,
    /// no lock): called wherever a root may have lost its last child or lock.
    pub(crate) fn drop_root_if_empty(&mut self, r: u32) {
        let n = self.tree.node(r);
        if !n.is_root() || !n.children.is_empty() || n.kv.lock > 0 {
            return;
        }
        let Some(name) = self.roots.names.remove(&r) else {
            // The default or the empty root: never dropped.
            return;
        };
        self.roots.named.remove(&name);
        // Tables that grew for a burst of namespaces give the memory back.
        for cap in [self.roots.named.capacity(), self.roots.names.capacity()] {
            if cap > 64 && cap > 4 * self.roots.named.len() {
                self.roots.named.shrink_to_fit();
                self.roots.names.shrink_to_fit();
                break;
            }
        }
        self.tree.free_node(r);
    }
}
