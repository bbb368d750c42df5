//! State-machine test of the L3 tier: two caches sharing one store that fails, loses
//! objects and returns corrupt bytes, with a data oracle.
//!
//! Two caches (attention-only, or hybrid with state pools on both tiers), pages of 1 or
//! 2 tokens, small pools, write-through with the L3 tier on, written once backed up or
//! only on host eviction (`l3_write`, drawn; then host eviction emits the `l3_put`s,
//! whose host pages drain until they end). Proptest draws sequences of:
//! inserts of token sequences (a shared system prompt and a random tail) into either
//! cache, running its batches (backups, then the `l3_put`s their landing emits, against
//! the store: completed, failed, or left in flight and acknowledged later), fetches from
//! the store as an engine makes them (the leading run of pages the store has after what
//! the cache holds, for a hybrid model cut back to the deepest state; `l3_fetch`; the
//! objects read into the host slots; `complete`, `complete_l3` of the pages that came
//! back whole, `fail`, or `abandon`), device and host evictions, matches, and resets
//! (after ending the cache's batches, or as it is: refused then, changing nothing).
//!
//! The oracle simulates memory: one value per slot of each pool and tier of each cache,
//! and the store's objects. KV of token `p` of a sequence is a hash of its first `p + 1`
//! tokens, the state after `L` tokens another hash of them: the same in both caches, so
//! that one cache's objects are right for the other. The store keeps each object with a
//! checksum of its values, as the real framing does: a corrupt object fails its check
//! and is a miss (and is deleted), a lost one is missing, a failed call fails the batch.
//! After every step: `audit()` passes on both caches; every node of `snapshot()` holds
//! the right data on each tier it claims (device KV unless loading, device state, host
//! KV, host state); every stored object holds the right values for its page or state.
//! Both caches publish events; a router's index of the store (`EXTERNAL`), rebuilt from
//! both streams, never lists an object the store no longer holds: a fetch that finds one
//! missing or corrupt reports it `gone` to `complete_l3_gone`, which announces its removal.
//! Each case ends by acknowledging every batch in flight and evicting everything: both
//! caches' pools must be full again.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use radixcache_core::{
    BatchKind, Cache, Config, KvEvent, L3Write, Medium, PoolKind, Tier, TransferBatch,
};

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Running hashes of `toks`: entry `p` covers the first `p` tokens.
fn prefix_hashes(toks: &[u32]) -> Vec<u64> {
    let mut cur = 0x6c33_0000_u64;
    let mut h = vec![cur];
    for &t in toks {
        cur = mix(cur ^ mix(u64::from(t).wrapping_add(0x9e37_79b9_7f4a_7c15)));
        h.push(cur);
    }
    h
}

/// The KV of token `p` (0-based) of `toks`.
fn kv_of(h: &[u64], p: usize) -> u64 {
    h[p + 1]
}

/// The state after the first `len` tokens.
fn state_of(h: &[u64], len: usize) -> u64 {
    mix(h[len] ^ 0x5374_6174_6500_0000)
}

fn idx(slot: i64) -> usize {
    usize::try_from(slot).unwrap()
}

/// One cache and its simulated memory.
struct Node {
    cache: Cache,
    dev_kv: Vec<Option<u64>>,
    host_kv: Vec<Option<u64>>,
    dev_state: Vec<Option<u64>>,
    host_state: Vec<Option<u64>>,
    /// Batches taken and not yet acknowledged.
    held: Vec<TransferBatch>,
    /// Fetches started and not yet read, with how each is to end.
    gets: Vec<(TransferBatch, u8)>,
}

impl Node {
    fn mem(&mut self, pool: PoolKind, tier: Tier) -> &mut Vec<Option<u64>> {
        match (pool, tier) {
            (PoolKind::Kv, Tier::Device) => &mut self.dev_kv,
            (PoolKind::Kv, Tier::Host) => &mut self.host_kv,
            (PoolKind::Mamba, Tier::Device) => &mut self.dev_state,
            (PoolKind::Mamba, Tier::Host) => &mut self.host_state,
            other => panic!("no memory for {other:?}"),
        }
    }
}

/// A stored object: its values and the checksum written with them.
#[derive(Clone)]
struct Object {
    values: Vec<u64>,
    sum: u64,
}

fn checksum(values: &[u64]) -> u64 {
    values.iter().fold(0x5eed, |a, &v| mix(a ^ v))
}

/// The shared store, with its faults drawn from `rng`.
#[derive(Default)]
struct Store {
    objects: HashMap<(bool, [u8; 32]), Object>,
    rng: u64,
    /// Per mille: a call fails, an object is lost, an object comes back corrupt.
    fail: u64,
    lose: u64,
    corrupt: u64,
}

impl Store {
    fn draw(&mut self, per_mille: u64) -> bool {
        self.rng = mix(self.rng.wrapping_add(0x9e37_79b9));
        self.rng % 1000 < per_mille
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Insert system prompt `sys` plus `tail` into cache `c`.
    Insert {
        c: usize,
        sys: usize,
        tail: Vec<u32>,
    },
    /// Run cache `c`'s batches: `hold` keeps one in flight; `fail` fails them.
    Run {
        c: usize,
        hold: bool,
        fail: bool,
    },
    /// Acknowledge the batches cache `c` holds (`fail`: failed).
    Ack {
        c: usize,
        fail: bool,
    },
    /// Fetch system prompt `sys` plus `tail` into cache `c`; `end` how it ends.
    Fetch {
        c: usize,
        sys: usize,
        tail: Vec<u32>,
        end: u8,
    },
    Evict {
        c: usize,
        kv: usize,
    },
    EvictHost {
        c: usize,
        kv: usize,
    },
    Match {
        c: usize,
        sys: usize,
        tail: Vec<u32>,
    },
    /// Reset cache `c`, after ending its batches (`drain`) or as it is.
    Reset {
        c: usize,
        drain: bool,
    },
}

const SYSTEM: [&[u32]; 3] = [
    &[1, 2, 3, 4, 5, 6],
    &[1, 2, 3, 4, 7, 7, 7, 7],
    &[9, 9, 8, 8],
];

fn op() -> impl Strategy<Value = Op> {
    let c = 0usize..2;
    let sys = 0usize..3;
    let tail = prop::collection::vec(0u32..4, 0..8);
    prop_oneof![
        4 => (c.clone(), sys.clone(), tail.clone()).prop_map(|(c, sys, tail)| Op::Insert { c, sys, tail }),
        4 => (c.clone(), any::<bool>(), prop::bool::weighted(0.15)).prop_map(|(c, hold, fail)| Op::Run { c, hold, fail }),
        3 => (c.clone(), any::<bool>()).prop_map(|(c, fail)| Op::Ack { c, fail }),
        4 => (c.clone(), sys.clone(), tail.clone(), 0u8..8).prop_map(|(c, sys, tail, end)| Op::Fetch { c, sys, tail, end }),
        2 => (c.clone(), 1usize..16).prop_map(|(c, kv)| Op::Evict { c, kv }),
        2 => (c.clone(), 1usize..16).prop_map(|(c, kv)| Op::EvictHost { c, kv }),
        1 => (c.clone(), sys, tail).prop_map(|(c, sys, tail)| Op::Match { c, sys, tail }),
        1 => (c, any::<bool>()).prop_map(|(c, drain)| Op::Reset { c, drain }),
    ]
}

struct Machine {
    nodes: Vec<Node>,
    store: Store,
    /// The tokens up to the end of each page hash inserted (to check stored objects).
    names: HashMap<[u8; 32], Vec<u32>>,
    hybrid: bool,
    ps: usize,
    /// A router's index of the store from both caches' events: (state?, page hash).
    external: HashSet<(bool, [u8; 32])>,
}

impl Machine {
    fn new(
        hybrid: bool,
        ps: usize,
        kv: usize,
        host: usize,
        faults: (u64, u64, u64),
        l3_write: L3Write,
    ) -> Self {
        let config = Config {
            kv_slots: kv,
            page_size: ps,
            mamba_slots: if hybrid { 4 } else { 0 },
            host_kv_slots: host,
            host_mamba_slots: if hybrid { 4 } else { 0 },
            page_hashes: true,
            l3: true,
            l3_write,
            events: true,
            ..Config::default()
        };
        let nodes = (0..2)
            .map(|_| Node {
                cache: Cache::new(config.clone()).unwrap(),
                dev_kv: vec![None; kv],
                host_kv: vec![None; host],
                dev_state: vec![None; 4],
                host_state: vec![None; 4],
                held: Vec::new(),
                gets: Vec::new(),
            })
            .collect();
        Machine {
            nodes,
            names: HashMap::new(),
            store: Store {
                fail: faults.0,
                lose: faults.1,
                corrupt: faults.2,
                rng: faults.0 ^ faults.1 << 10 ^ faults.2 << 20,
                ..Store::default()
            },
            hybrid,
            ps,
            external: HashSet::new(),
        }
    }

    /// Applies cache `c`'s events to the index of the store, as a router would.
    fn drain_events(&mut self, c: usize) {
        for e in self.nodes[c].cache.take_events().unwrap() {
            match e {
                KvEvent::Stored {
                    medium: Medium::External,
                    hashes,
                    ..
                } => self.external.extend(hashes.into_iter().map(|h| (false, h))),
                KvEvent::Removed {
                    medium: Medium::External,
                    hashes,
                    ..
                } => {
                    for h in hashes {
                        self.external.remove(&(false, h));
                    }
                }
                KvEvent::StateStored {
                    medium: Medium::External,
                    hash,
                    ..
                } => {
                    self.external.insert((true, hash));
                }
                KvEvent::StateRemoved {
                    medium: Medium::External,
                    hash,
                    ..
                } => {
                    self.external.remove(&(true, hash));
                }
                // One cache's reset: this shared index forgets everything (a router's
                // per-worker index would forget that worker's announcements).
                KvEvent::Cleared => self.external.clear(),
                _ => {}
            }
        }
    }

    fn tokens(sys: usize, tail: &[u32]) -> Vec<u32> {
        let mut t = SYSTEM[sys].to_vec();
        t.extend_from_slice(tail);
        t
    }

    fn insert(&mut self, c: usize, toks: &[u32]) {
        let h = prefix_hashes(toks);
        let names = self.nodes[c].cache.chain_hashes(None, None, toks);
        for (k, name) in names.into_iter().enumerate() {
            self.names.insert(name, toks[..(k + 1) * self.ps].to_vec());
        }
        let n = &mut self.nodes[c];
        let m = n.cache.match_prefix(None, toks);
        // The matched prefix is locked while slots are found (allocation evicts).
        let lock = n.cache.lock(m.node).unwrap();
        let rest = toks.len() - m.device_len;
        let Ok(Some(fresh)) = n.cache.alloc_kv(rest.div_ceil(self.ps) * self.ps) else {
            n.cache.unlock(lock).unwrap();
            return;
        };
        for (k, &s) in fresh[..rest].iter().enumerate() {
            n.dev_kv[idx(s)] = Some(kv_of(&h, m.device_len + k));
        }
        let state = if self.hybrid {
            if let Some(s) = n.cache.alloc_mamba().unwrap() {
                n.dev_state[s as usize] = Some(state_of(&h, toks.len()));
                Some(i64::from(s))
            } else {
                n.cache.free_kv(&fresh).unwrap();
                n.cache.unlock(lock).unwrap();
                return;
            }
        } else {
            None
        };
        let mut kv = m.kv_indices.clone();
        kv.extend_from_slice(&fresh[..rest]);
        n.cache
            .insert_with_state(None, toks, &kv, m.device_len, state)
            .unwrap();
        // The unaligned tail's page was freed by the insert; the rest of `fresh` too.
        let spare: Vec<i64> = fresh[rest..].to_vec();
        if !spare.is_empty() {
            let _ = n.cache.free_kv(&spare);
        }
    }

    /// Runs a device/host batch's copies in memory (complete) or poisons (fail).
    fn copy(n: &mut Node, b: &TransferBatch, land: bool) {
        for copy in &b.copies {
            let vals: Vec<Option<u64>> = copy
                .src
                .iter()
                .map(|&s| n.mem(copy.pool, copy.src_tier)[idx(s)])
                .collect();
            for (&d, v) in copy.dst.iter().zip(vals) {
                n.mem(copy.pool, copy.dst_tier)[idx(d)] = if land { v } else { Some(u64::MAX) };
            }
        }
    }

    /// Runs an `l3_put` against the store; false when a store call failed.
    fn put(&mut self, c: usize, b: &TransferBatch) -> bool {
        if self.store.draw(self.store.fail) {
            return false;
        }
        let mut key = b.keys.iter();
        for copy in &b.copies {
            let per = if copy.pool == PoolKind::Kv {
                self.ps
            } else {
                1
            };
            let state = copy.pool == PoolKind::Mamba;
            for chunk in copy.src.chunks(per) {
                let k = *key.next().unwrap();
                let values: Vec<u64> = chunk
                    .iter()
                    .map(|&s| {
                        self.nodes[c].mem(copy.pool, Tier::Host)[idx(s)]
                            .expect("an unwritten host slot put")
                    })
                    .collect();
                if self.store.objects.contains_key(&(state, k)) {
                    continue;
                }
                let sum = checksum(&values);
                self.store
                    .objects
                    .insert((state, k), Object { values, sum });
            }
        }
        true
    }

    fn run(&mut self, c: usize, hold: bool, fail: bool) {
        let batches = self.nodes[c].cache.take_batches();
        for (k, b) in batches.into_iter().enumerate() {
            self.nodes[c].cache.start(b.id).unwrap();
            if hold && k == 0 {
                self.nodes[c].held.push(b);
                continue;
            }
            self.end(c, &b, fail);
        }
    }

    fn end(&mut self, c: usize, b: &TransferBatch, fail: bool) {
        let ok = !fail
            && match b.kind {
                BatchKind::L3Put => self.put(c, b),
                _ => true,
            };
        if b.kind != BatchKind::L3Put {
            Self::copy(&mut self.nodes[c], b, ok);
        }
        if ok {
            self.nodes[c].cache.complete(b.id).unwrap();
        } else {
            self.nodes[c].cache.fail(b.id).unwrap();
        }
    }

    /// A reset empties cache `c` (its pools full) when nothing holds it, else is refused
    /// and changes nothing; the store keeps its objects, so later fetches find them.
    fn reset(&mut self, c: usize, drain: bool) {
        if drain {
            self.ack(c, false);
            for _ in 0..4 {
                self.run(c, false, false);
            }
        }
        self.drain_events(c); // the next call releases dropped receipts: this one
        let cache = &mut self.nodes[c].cache;
        let before = (cache.stats(), cache.pretty(10_000, 1));
        if let Err(e) = cache.reset() {
            assert!(!drain, "a drained cache refused a reset: {e}");
            assert_eq!((cache.stats(), cache.pretty(10_000, 1)), before);
            return;
        }
        assert!(
            cache.snapshot().iter().all(|n| n.prefix.is_empty()),
            "only roots"
        );
        for pool in [
            cache.kv_pool(),
            cache.host_kv_pool(),
            cache.mamba_pool(),
            cache.host_mamba_pool(),
        ] {
            assert_eq!(pool.counts().free, pool.capacity_pages());
        }
    }

    fn ack(&mut self, c: usize, fail: bool) {
        for b in std::mem::take(&mut self.nodes[c].held) {
            self.end(c, &b, fail);
        }
        for (b, end) in std::mem::take(&mut self.nodes[c].gets) {
            self.read_fetch(c, &b, if fail { 1 } else { end });
        }
    }

    /// What an engine fetches: the leading pages the store has after what the cache
    /// holds (for a hybrid model, up to the deepest with a state).
    fn lookup(&self, c: usize, toks: &[u32]) -> usize {
        let cache = &self.nodes[c].cache;
        let p = cache.peek_prefix(None, toks);
        // After the KV the tree holds on either tier (past a hybrid match's cut too).
        let have = p.kv_len / self.ps;
        let hashes = cache.chain_hashes(None, None, toks);
        assert_eq!(
            cache.chain_hashes(None, p.kv_hash, &toks[p.kv_len..]),
            hashes[have..],
            "the chain of the rest continues from the peek's hash"
        );
        let run = hashes[have..]
            .iter()
            .take_while(|h| self.store.objects.contains_key(&(false, **h)))
            .count();
        if !self.hybrid {
            return run;
        }
        (1..=run)
            .rev()
            .find(|&k| {
                self.store
                    .objects
                    .contains_key(&(true, hashes[have + k - 1]))
            })
            .unwrap_or(0)
    }

    /// Reads one object into host memory; whether it came back whole.
    fn read(&mut self, c: usize, state: bool, key: [u8; 32], slots: &[i64]) -> bool {
        if self.store.draw(self.store.lose) {
            self.store.objects.remove(&(state, key));
        }
        let Some(mut obj) = self.store.objects.get(&(state, key)).cloned() else {
            return false;
        };
        if self.store.draw(self.store.corrupt) {
            obj.values[0] ^= 1;
        }
        if checksum(&obj.values) != obj.sum {
            // Corrupt: a miss, and the store client deletes it.
            self.store.objects.remove(&(state, key));
            return false;
        }
        let pool = if state { PoolKind::Mamba } else { PoolKind::Kv };
        for (&s, v) in slots.iter().zip(obj.values) {
            self.nodes[c].mem(pool, Tier::Host)[idx(s)] = Some(v);
        }
        true
    }

    fn fetch(&mut self, c: usize, toks: &[u32], end: u8) {
        let upto = self.lookup(c, toks);
        if upto == 0 {
            return;
        }
        let Some(b) = self.nodes[c].cache.l3_fetch(None, toks, upto).unwrap() else {
            return;
        };
        assert_eq!(b.kind, BatchKind::L3Get);
        let pages = b.copies[0].dst.len() / self.ps;
        assert_eq!(b.keys.len(), pages + usize::from(self.hybrid), "{b:?}");
        let cache = &mut self.nodes[c].cache;
        if end == 0 {
            cache.abandon(b.id);
            return;
        }
        cache.start(b.id).unwrap();
        if end >= 6 {
            // Read later: the tree may change meanwhile.
            self.nodes[c].gets.push((b, end - 4));
            return;
        }
        self.read_fetch(c, &b, end);
    }

    /// Reads a started fetch's objects into host memory and acknowledges what landed:
    /// `end` 1 fails it, 2 claims one page less than landed, else what came back whole.
    fn read_fetch(&mut self, c: usize, b: &TransferBatch, end: u8) {
        let pages = b.copies[0].dst.len() / self.ps;
        if end == 1 || self.store.draw(self.store.fail) {
            self.nodes[c].cache.fail(b.id).unwrap();
            return;
        }
        let kv = &b.copies[0];
        let mut landed = 0;
        // The objects the store did not hold (missing, or corrupt and deleted).
        let mut gone = Vec::new();
        for (k, chunk) in kv.dst.chunks(self.ps).enumerate() {
            if !self.read(c, false, b.keys[k], chunk) {
                gone.push(k);
                break;
            }
            landed += 1;
        }
        let state = self.hybrid && landed == pages && {
            let ok = self.read(c, true, b.keys[pages], &b.copies[1].dst);
            if !ok {
                gone.push(pages);
            }
            ok
        };
        let cache = &mut self.nodes[c].cache;
        if end == 2 && landed > 0 {
            // Claims less than landed: fine, the rest is a miss.
            cache
                .complete_l3_gone(b.id, landed - 1, false, &gone)
                .unwrap();
        } else if landed == pages && (state || !self.hybrid) {
            cache.complete(b.id).unwrap();
        } else {
            cache.complete_l3_gone(b.id, landed, state, &gone).unwrap();
        }
    }

    fn step(&mut self, op: &Op) {
        match op {
            Op::Insert { c, sys, tail } => self.insert(*c, &Self::tokens(*sys, tail)),
            Op::Run { c, hold, fail } => self.run(*c, *hold, *fail),
            Op::Ack { c, fail } => self.ack(*c, *fail),
            Op::Fetch { c, sys, tail, end } => self.fetch(*c, &Self::tokens(*sys, tail), *end),
            Op::Evict { c, kv } => {
                self.nodes[*c].cache.evict(*kv, 1);
            }
            Op::EvictHost { c, kv } => {
                self.nodes[*c].cache.evict_host(*kv, 1).unwrap();
            }
            Op::Reset { c, drain } => self.reset(*c, *drain),
            Op::Match { c, sys, tail } => {
                let toks = Self::tokens(*sys, tail);
                let h = prefix_hashes(&toks);
                let n = &mut self.nodes[*c];
                let m = n.cache.match_prefix(None, &toks);
                for (p, &s) in m.kv_indices.iter().enumerate() {
                    assert_eq!(n.dev_kv[idx(s)], Some(kv_of(&h, p)), "match slot {p}");
                }
            }
        }
        self.check();
    }

    fn check(&mut self) {
        for c in 0..2 {
            self.drain_events(c);
        }
        for key in &self.external {
            assert!(
                self.store.objects.contains_key(key),
                "the index lists an object the store no longer holds: {key:?}"
            );
        }
        for ((state, name), obj) in &self.store.objects {
            let prefix = &self.names[name];
            let h = prefix_hashes(prefix);
            let want: Vec<u64> = if *state {
                vec![state_of(&h, prefix.len())]
            } else {
                (prefix.len() - self.ps..prefix.len())
                    .map(|p| kv_of(&h, p))
                    .collect()
            };
            assert_eq!(obj.values, want, "a stored object holds other bytes");
        }
        for (c, n) in self.nodes.iter().enumerate() {
            n.cache.audit().unwrap_or_else(|e| panic!("cache {c}: {e}"));
            for info in n.cache.snapshot() {
                let h = prefix_hashes(&info.prefix);
                let start = info.prefix.len() - info.key_len;
                if let (Some(kv), false) = (&info.kv_indices, info.loading) {
                    for (k, &s) in kv.iter().enumerate() {
                        assert_eq!(
                            n.dev_kv[idx(s)],
                            Some(kv_of(&h, start + k)),
                            "cache {c} device KV"
                        );
                    }
                }
                if let Some(kv) = &info.host_kv_indices {
                    for (k, &s) in kv.iter().enumerate() {
                        assert_eq!(
                            n.host_kv[idx(s)],
                            Some(kv_of(&h, start + k)),
                            "cache {c} host KV of {info:?}"
                        );
                    }
                }
                let want = state_of(&h, info.prefix.len());
                if let Some(s) = info.mamba_slot {
                    assert_eq!(
                        n.dev_state[s as usize],
                        Some(want),
                        "cache {c} device state"
                    );
                }
                if let Some(s) = info.host_mamba_slot {
                    assert_eq!(n.host_state[s as usize], Some(want), "cache {c} host state");
                }
            }
        }
    }

    /// Acknowledges everything and evicts everything: every pool back to full.
    fn finish(&mut self) {
        for c in 0..2 {
            self.ack(c, false);
            self.run(c, false, false);
            loop {
                let ev = self.nodes[c].cache.evict(usize::MAX / 2, usize::MAX / 2);
                self.run(c, false, false);
                if ev.kv_tokens == 0 && ev.mamba_states == 0 {
                    break;
                }
            }
            let cache = &mut self.nodes[c].cache;
            cache.evict_host(usize::MAX / 2, usize::MAX / 2).unwrap();
            // Under l3_write="host_eviction" that emitted puts: their pages drain.
            self.run(c, false, false);
            let cache = &mut self.nodes[c].cache;
            cache.audit().unwrap();
            for pool in [
                cache.kv_pool(),
                cache.mamba_pool(),
                cache.host_kv_pool(),
                cache.host_mamba_pool(),
            ] {
                let counts = pool.counts();
                assert_eq!(counts.free, pool.capacity_pages(), "cache {c}: {counts:?}");
            }
        }
    }
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 96,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "proptest-regressions/l3_machine.txt",
        ))),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn two_caches_share_a_faulty_store_and_serve_the_right_bytes(
        hybrid in any::<bool>(),
        ps in 1usize..=2,
        kv in 8usize..=16,
        host in 12usize..=24,
        fail in prop_oneof![Just(0u64), 50u64..300],
        lose in prop_oneof![Just(0u64), 50u64..300],
        corrupt in prop_oneof![Just(0u64), 50u64..300],
        on_eviction in any::<bool>(),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let l3_write = if on_eviction { L3Write::HostEviction } else { L3Write::Backup };
        let mut m = Machine::new(hybrid, ps, kv * ps, host * ps, (fail, lose, corrupt), l3_write);
        for op in &ops {
            m.step(op);
        }
        m.finish();
    }
}

/// The machine's steps do reach the store: a prompt one cache computed and put is
/// fetched by the other, lands on its host tier with the right bytes, and is matched.
#[test]
fn a_page_one_cache_put_lands_in_the_other() {
    for hybrid in [false, true] {
        let mut m = Machine::new(hybrid, 2, 32, 48, (0, 0, 0), L3Write::Backup);
        let toks = Machine::tokens(0, &[1, 2]);
        m.step(&Op::Insert {
            c: 0,
            sys: 0,
            tail: vec![1, 2],
        });
        m.step(&Op::Run {
            c: 0,
            hold: false,
            fail: false,
        });
        m.step(&Op::Run {
            c: 0,
            hold: false,
            fail: false,
        });
        assert_eq!(
            m.store.objects.len(),
            4 + usize::from(hybrid),
            "4 pages (and a state)"
        );
        m.step(&Op::Fetch {
            c: 1,
            sys: 0,
            tail: vec![1, 2],
            end: 5,
        });
        let p = m.nodes[1].cache.peek_prefix(None, &toks);
        assert_eq!((p.device_len, p.host_len), (0, 8), "hybrid={hybrid}");
        m.finish();
    }
}

/// A fetch in flight while the same prompt is computed and cached: the pages the tree
/// gained meanwhile are not placed twice, the others land with the right bytes.
#[test]
fn a_fetch_landing_after_the_tree_gained_its_pages_places_only_the_rest() {
    for hybrid in [false, true] {
        let mut m = Machine::new(hybrid, 2, 32, 48, (0, 0, 0), L3Write::Backup);
        let tail = vec![1, 2, 3, 0];
        m.step(&Op::Insert {
            c: 0,
            sys: 0,
            tail: tail.clone(),
        });
        m.step(&Op::Run {
            c: 0,
            hold: false,
            fail: false,
        });
        m.step(&Op::Run {
            c: 0,
            hold: false,
            fail: false,
        });
        m.step(&Op::Fetch {
            c: 1,
            sys: 0,
            tail: tail.clone(),
            end: 7,
        });
        assert_eq!(m.nodes[1].gets.len(), 1, "in flight");
        m.step(&Op::Insert {
            c: 1,
            sys: 0,
            tail: vec![],
        });
        m.step(&Op::Ack { c: 1, fail: false });
        let toks = Machine::tokens(0, &tail);
        let p = m.nodes[1].cache.peek_prefix(None, &toks);
        assert_eq!(p.kv_len, 10, "hybrid={hybrid}");
        m.finish();
    }
}

/// Under `l3_write="host_eviction"` a backup writes nothing to the store; host eviction
/// does, and the other cache then fetches the right bytes.
#[test]
fn pages_one_cache_evicts_from_its_host_tier_land_in_the_other() {
    for hybrid in [false, true] {
        let mut m = Machine::new(hybrid, 2, 32, 48, (0, 0, 0), L3Write::HostEviction);
        let tail = vec![1, 2];
        let toks = Machine::tokens(0, &tail);
        let run = Op::Run {
            c: 0,
            hold: false,
            fail: false,
        };
        m.step(&Op::Insert {
            c: 0,
            sys: 0,
            tail: tail.clone(),
        });
        m.step(&run);
        m.step(&run);
        assert!(m.store.objects.is_empty(), "nothing written on backup");
        m.step(&Op::Evict { c: 0, kv: 32 });
        m.step(&Op::EvictHost { c: 0, kv: 32 });
        assert!(m.nodes[0].cache.host_kv_pool().counts().draining > 0);
        m.step(&run);
        assert_eq!(
            m.store.objects.len(),
            4 + usize::from(hybrid),
            "4 pages (and a state)"
        );
        m.step(&Op::Fetch {
            c: 1,
            sys: 0,
            tail,
            end: 5,
        });
        let p = m.nodes[1].cache.peek_prefix(None, &toks);
        assert_eq!((p.device_len, p.host_len), (0, 8), "hybrid={hybrid}");
        m.finish();
    }
}
