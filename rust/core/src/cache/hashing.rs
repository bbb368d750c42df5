//! Page hashes on the tree's nodes (docs/design.md, "Page hashes"): a node's hashes are
//! computed once, when it is added with its pages ([`Cache::leaf_hashes`]), chained from
//! its parent's last hash or its namespace's seed; a split splits them. Nothing here
//! runs on the lookup path but reading a node's last hash.

use crate::error::{Error, Result};
use crate::hashes::{self, PageHash};
use crate::ids::NodeId;

use super::Cache;
use crate::tree::Tree;

impl Cache {
    /// The seed of `namespace`'s chains (the prior of its first page), from the
    /// configuration's `hash_seed` ([`hashes::namespace_seed`]).
    pub fn namespace_seed(&self, namespace: Option<&str>) -> Option<PageHash> {
        hashes::namespace_seed(self.config.hash_seed.as_ref(), namespace)
    }

    /// What a new root of `namespace` holds as its hashes: its seed, when page hashes
    /// are on and the namespace has one.
    pub(crate) fn root_hashes(&self, namespace: Option<&str>) -> Vec<PageHash> {
        if !self.config.page_hashes {
            return Vec::new();
        }
        self.namespace_seed(namespace).into_iter().collect()
    }

    /// The hashes of a new node under `parent` with key `key` (empty with page hashes
    /// off): chained from the parent's last hash (a root's: its namespace's seed).
    pub(crate) fn leaf_hashes(&self, parent: u32, key: &[u32]) -> Vec<PageHash> {
        if !self.config.page_hashes {
            return Vec::new();
        }
        let prior = self.tree.node(parent).hashes.last().copied();
        hashes::chain(prior.as_ref(), key, self.config.page_size)
    }

    /// The hash of node `i`'s last page (`None` for a root, or with page hashes off):
    /// read from the node, nothing is hashed.
    pub(crate) fn last_hash(&self, i: u32) -> Option<PageHash> {
        last_hash_in(&self.tree, i)
    }

    /// The hashes of `node`'s pages, one per page, in order (empty for a root). Refused
    /// (naming `page_hashes`) when the cache was built without page hashes.
    pub fn node_hashes(&self, node: NodeId) -> Result<&[PageHash]> {
        let i = self.tree.resolve(node)?;
        if !self.config.page_hashes {
            return Err(Error::arg(
                "page_hashes",
                "the cache was built with page_hashes=False: its pages have no hashes",
            ));
        }
        let n = self.tree.node(i);
        Ok(if n.is_root() { &[] } else { &n.hashes })
    }

    /// The hashes of the whole pages of `tokens` as this cache would chain them in
    /// `namespace`: from `parent_hash` (the hash of the page just before `tokens`, such
    /// as [`crate::Match::last_hash`]), or from the namespace's seed when `None` (the
    /// tokens start at the root). An unaligned tail is not hashed. A pure computation:
    /// the tree is not read and works with page hashes off too.
    pub fn chain_hashes(
        &self,
        namespace: Option<&str>,
        parent_hash: Option<PageHash>,
        tokens: &[u32],
    ) -> Vec<PageHash> {
        let prior = parent_hash.or_else(|| self.namespace_seed(namespace));
        hashes::chain(prior.as_ref(), tokens, self.config.page_size)
    }
}

/// The hash of the last page of node `i` of `tree` (`None` for a root, or with page
/// hashes off).
pub(crate) fn last_hash_in(tree: &Tree, i: u32) -> Option<PageHash> {
    let n = tree.node(i);
    if n.is_root() {
        return None;
    }
    n.hashes.last().copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::tests::util::{cached, seq};
    use crate::config::Config;
    use sha2::{Digest, Sha256};

    /// A cache of 64 slots in pages of `ps`, with page hashes and `seed`.
    fn hashed(ps: usize, seed: Option<PageHash>) -> Cache {
        Cache::new(Config {
            page_hashes: true,
            hash_seed: seed,
            ..Config::kv(64, ps)
        })
        .unwrap()
    }

    /// The chain written out from the definition: sha256(prior ‖ tokens u32 LE) per
    /// page (independent of `hashes::chain`).
    fn by_hand(prior: Option<PageHash>, tokens: &[u32], ps: usize) -> Vec<PageHash> {
        let mut prior = prior;
        let mut out = Vec::new();
        for page in tokens.chunks_exact(ps) {
            let mut bytes = prior.map(|p| p.to_vec()).unwrap_or_default();
            for t in page {
                bytes.extend_from_slice(&t.to_le_bytes());
            }
            let h: PageHash = Sha256::digest(&bytes).into();
            out.push(h);
            prior = Some(h);
        }
        out
    }

    /// Caches `toks` in `namespace` with fresh slots; returns its end node.
    fn cached_in(c: &mut Cache, ns: Option<&str>, toks: &[u32]) -> NodeId {
        let m = c.match_prefix(ns, toks);
        let ps = c.page_size();
        let rest = toks.len() - m.device_len;
        let mut kv = m.kv_indices.clone();
        kv.extend(c.alloc_kv(rest.div_ceil(ps) * ps).unwrap().unwrap()[..rest].iter());
        c.insert(ns, toks, &kv, m.device_len).unwrap().node
    }

    #[test]
    fn an_inserted_node_holds_the_chain_of_its_pages() {
        let mut c = hashed(2, None);
        let node = cached(&mut c, &seq(7)).node;
        // Three whole pages; the unaligned seventh token is not cached.
        assert_eq!(c.node_hashes(node).unwrap(), by_hand(None, &seq(6), 2));
        c.audit().unwrap();
    }

    #[test]
    fn a_branch_chains_from_its_parents_last_hash_and_a_split_keeps_every_hash() {
        let mut c = hashed(2, None);
        let a = cached(&mut c, &seq(8)).node;
        let whole = c.node_hashes(a).unwrap().to_vec();
        // A branch after two pages splits [1..8] there.
        let b = cached(&mut c, &[1, 2, 3, 4, 9, 9]).node;
        let upper = c.tree.node(c.tree.resolve(b).unwrap()).parent;
        let upper = c.tree.id(upper);
        assert_eq!(c.node_hashes(upper).unwrap(), &whole[..2]);
        assert_eq!(
            c.node_hashes(a).unwrap(),
            &whole[2..],
            "split, not recomputed"
        );
        assert_eq!(
            c.node_hashes(b).unwrap(),
            by_hand(Some(whole[1]), &[9, 9], 2)
        );
        assert_eq!(
            c.node_hashes(b).unwrap(),
            &by_hand(None, &[1, 2, 3, 4, 9, 9], 2)[2..]
        );
        c.audit().unwrap();
    }

    #[test]
    fn a_match_splitting_a_node_keeps_the_chain_and_reports_its_last_hash() {
        let mut c = hashed(2, None);
        cached(&mut c, &seq(8));
        let m = c.match_prefix(None, &[1, 2, 3, 4, 5, 7]);
        assert_eq!(m.device_len, 4);
        let chain = by_hand(None, &seq(8), 2);
        assert_eq!(m.last_hash, Some(chain[1]));
        assert_eq!(c.node_hashes(m.node).unwrap(), &chain[..2]);
        c.audit().unwrap();
        // The rest of the prompt, hashed from there, continues the same chain.
        assert_eq!(
            c.chain_hashes(None, m.last_hash, &[5, 6, 7, 8, 9]),
            &chain[2..]
        );
        assert_eq!(c.chain_hashes(None, None, &seq(8)), chain);
        // Nothing matched: no last hash.
        assert_eq!(c.match_prefix(None, &[9, 9]).last_hash, None);
    }

    #[test]
    fn a_peek_reports_the_hash_where_the_kv_match_ends_inside_a_node_and_splits_nothing() {
        let mut c = hashed(2, None);
        cached(&mut c, &seq(8));
        let chain = by_hand(None, &seq(8), 2);
        let nodes = c.snapshot().len();
        // Two pages into the four-page node: the hash of the second page, no split.
        let p = c.peek_prefix(None, &[1, 2, 3, 4, 5, 7]);
        assert_eq!((p.kv_len, p.kv_hash), (4, Some(chain[1])));
        assert_eq!(c.snapshot().len(), nodes);
        // The whole node, and past it (the unaligned tail is not matched).
        let p = c.peek_prefix(None, &seq(9));
        assert_eq!((p.kv_len, p.kv_hash), (8, Some(chain[3])));
        // The rest of a prompt chains on from it.
        let p = c.peek_prefix(None, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 9]);
        assert_eq!(
            c.chain_hashes(None, p.kv_hash, &[9, 9]),
            by_hand(None, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 9], 2)[4..]
        );
        assert_eq!(
            c.peek_prefix(None, &[9, 9]).kv_hash,
            None,
            "nothing matched"
        );
        // Without page hashes there is none.
        let mut plain = Cache::new(Config::kv(64, 2)).unwrap();
        cached(&mut plain, &seq(8));
        assert_eq!(plain.peek_prefix(None, &seq(8)).kv_hash, None);
        c.audit().unwrap();
    }

    #[test]
    fn the_default_namespace_starts_from_hash_seed() {
        let seed = [5u8; 32];
        let mut c = hashed(2, Some(seed));
        let node = cached(&mut c, &seq(4)).node;
        assert_eq!(
            c.node_hashes(node).unwrap(),
            by_hand(Some(seed), &seq(4), 2)
        );
        assert_eq!(
            c.chain_hashes(None, None, &seq(4)),
            by_hand(Some(seed), &seq(4), 2)
        );
        c.audit().unwrap();
    }

    #[test]
    fn a_named_namespace_starts_from_its_seed() {
        for seed in [None, Some([5u8; 32])] {
            let mut c = hashed(2, seed);
            let node = cached_in(&mut c, Some("lora"), &seq(4));
            let ns_seed = hashes::namespace_seed(seed.as_ref(), Some("lora"));
            assert!(ns_seed.is_some());
            assert_eq!(c.node_hashes(node).unwrap(), by_hand(ns_seed, &seq(4), 2));
            assert_ne!(
                c.node_hashes(node).unwrap(),
                by_hand(seed, &seq(4), 2),
                "namespaces do not share chains"
            );
            assert_eq!(
                c.chain_hashes(Some("lora"), None, &seq(4)),
                by_hand(ns_seed, &seq(4), 2)
            );
            let m = c.match_prefix(Some("lora"), &seq(4));
            assert_eq!(m.last_hash, Some(by_hand(ns_seed, &seq(4), 2)[1]));
            c.audit().unwrap();
        }
    }

    #[test]
    fn without_page_hashes_nothing_is_hashed_and_node_hashes_is_refused() {
        let mut c = Cache::new(Config::kv(64, 2)).unwrap();
        let node = cached(&mut c, &seq(4)).node;
        assert!(matches!(
            c.node_hashes(node),
            Err(Error::InvalidArgument {
                arg: "page_hashes",
                ..
            })
        ));
        assert_eq!(c.match_prefix(None, &seq(4)).last_hash, None);
        let i = c.tree.resolve(node).unwrap();
        assert!(c.tree.node(i).hashes.is_empty());
        // The pure helper still works.
        assert_eq!(
            c.chain_hashes(None, None, &seq(4)),
            by_hand(None, &seq(4), 2)
        );
        c.audit().unwrap();
    }

    #[test]
    fn a_stale_node_is_refused() {
        let mut c = hashed(1, None);
        let node = cached(&mut c, &seq(2)).node;
        c.evict(2, 0);
        assert!(matches!(c.node_hashes(node), Err(Error::StaleNode(_))));
    }

    #[test]
    fn audit_catches_a_wrong_hash_and_a_missing_seed() {
        let mut c = hashed(2, None);
        let node = cached(&mut c, &seq(4)).node;
        let i = c.tree.resolve(node).unwrap();
        c.tree.node_mut(i).hashes[1][0] ^= 1;
        let err = c.audit().unwrap_err();
        assert!(err.to_string().contains("page hashes"), "{err}");
        c.tree.node_mut(i).hashes[1][0] ^= 1;
        c.audit().unwrap();
        let mut c = hashed(2, Some([1; 32]));
        let root = c.roots.read(None);
        c.tree.node_mut(root).hashes.clear();
        let err = c.audit().unwrap_err();
        assert!(err.to_string().contains("seed"), "{err}");
    }

    #[test]
    fn a_host_only_node_keeps_its_hashes() {
        let mut c = Cache::new(Config {
            page_hashes: true,
            host_kv_slots: 64,
            ..Config::kv(64, 2)
        })
        .unwrap();
        let node = cached(&mut c, &seq(4)).node;
        for b in c.take_batches() {
            c.start(b.id).unwrap();
            c.complete(b.id).unwrap();
        }
        assert_eq!(c.evict(4, 0).kv_tokens, 4);
        let m = c.match_prefix(None, &seq(4));
        assert_eq!((m.device_len, m.host_len), (0, 4));
        let chain = by_hand(None, &seq(4), 2);
        assert_eq!(c.node_hashes(node).unwrap(), chain);
        assert_eq!(m.last_hash, Some(chain[1]), "host data counts");
        c.audit().unwrap();
    }
}
