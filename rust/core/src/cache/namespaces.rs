//! Namespaces: one radix tree each (a `LoRA` adapter, a tenant's cache salt), over one set
//! of pools. [`Namespaces`] owns the table of roots.

use std::collections::HashMap;

use crate::tree::{Tree, NONE};

use super::Cache;

/// The root of every namespace.
pub(crate) struct Namespaces {
    /// Root of the default namespace (`None`).
    default: u32,
    /// Roots of named namespaces (looked up by `&str`, no allocation per call).
    named: HashMap<String, u32>,
}

impl Namespaces {
    pub fn new(tree: &mut Tree) -> Namespaces {
        Namespaces {
            default: new_root(tree),
            named: HashMap::new(),
        }
    }

    /// The root of `namespace`, if it exists.
    pub fn get(&self, namespace: Option<&str>) -> Option<u32> {
        match namespace {
            None => Some(self.default),
            Some(ns) => self.named.get(ns).copied(),
        }
    }

    /// Named namespaces.
    pub fn named(&self) -> usize {
        self.named.len()
    }

    /// Every namespace with its root: the default one first, then by name.
    pub fn all(&self) -> Vec<(Option<&str>, u32)> {
        let mut named: Vec<_> = self
            .named
            .iter()
            .map(|(k, &r)| (Some(k.as_str()), r))
            .collect();
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
    /// The root of `namespace`, made on first use.
    pub(crate) fn root(&mut self, namespace: Option<&str>) -> u32 {
        if let Some(r) = self.roots.get(namespace) {
            return r;
        }
        let r = new_root(&mut self.tree);
        self.roots
            .named
            .insert(namespace.unwrap_or_default().to_owned(), r);
        r
    }
}
