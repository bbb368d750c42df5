//! Unit tests of the eviction policies: the order each gives on small hand-built trees.

use super::util::policy_cache as cache;
use crate::cache::eviction::on_node::Succession;
use crate::cache::*;
use crate::config::{EvictionPolicies, EvictionPolicy};
use crate::error::Error;

/// Caches `toks` (KV, and a state at the end when the cache has a state pool) with
/// `priority`, through the low-level API and without a match (an insert is no hit):
/// fresh slots for every token, those of tokens cached already freed by the insert.
fn cached(c: &mut Cache, toks: &[u32], priority: i64) -> Insert {
    let kv = c.alloc_kv(toks.len()).unwrap().unwrap();
    let state = if c.is_hybrid() {
        Some(i64::from(c.alloc_mamba().unwrap().unwrap()))
    } else {
        None
    };
    c.insert_with_priority(None, toks, &kv, 0, state, priority)
        .unwrap()
}

/// Whether a node ends at `toks` with device KV (and a state, in a hybrid cache), read
/// from the snapshot: a match would count as a use.
fn kept(c: &Cache, toks: &[u32]) -> bool {
    c.snapshot().iter().any(|n| {
        n.prefix == toks && n.kv_indices.is_some() && (!c.is_hybrid() || n.mamba_slot.is_some())
    })
}

#[test]
fn lfu_evicts_the_node_no_match_used_before_an_older_matched_one() {
    for (policy, matched_kept) in [("lru", false), ("lfu", true)] {
        let mut c = cache(policy, 32, 0);
        cached(&mut c, &[1, 1], 0);
        assert_eq!(c.match_prefix(None, &[1, 1, 7]).device_len, 2);
        // Inserted three times (inserts are not hits) and more recent than [1, 1].
        for _ in 0..3 {
            cached(&mut c, &[2, 2], 0);
        }
        c.audit().unwrap();
        assert_eq!(c.evict(2, 0).kv_tokens, 2);
        c.audit().unwrap();
        assert_eq!(kept(&c, &[1, 1]), matched_kept, "{policy}");
        assert_eq!(kept(&c, &[2, 2]), !matched_kept, "{policy}");
    }
}

#[test]
fn lfu_counts_only_the_state_a_match_uses() {
    let mut c = cache("lfu", 64, 3);
    // [1, 1] and its extension [1, 1, 2, 2] both hold states; a match of the longer
    // prefix uses only the deeper one.
    cached(&mut c, &[1, 1], 0);
    cached(&mut c, &[1, 1, 2, 2], 0);
    cached(&mut c, &[3, 3], 0);
    for _ in 0..2 {
        assert_eq!(c.match_prefix(None, &[1, 1, 2, 2]).device_len, 4);
    }
    assert_eq!(c.match_prefix(None, &[3, 3]).device_len, 2);
    c.audit().unwrap();
    // [1, 1]'s state was passed twice but used by none: it goes first, then [3, 3]'s
    // (one use), and [1, 1, 2, 2]'s (two) stays.
    assert_eq!(c.evict(0, 2).mamba_states, 2);
    assert_eq!(c.match_prefix(None, &[1, 1]).device_len, 0);
    assert_eq!(c.match_prefix(None, &[3, 3]).device_len, 0);
    assert!(kept(&c, &[1, 1, 2, 2]));
    c.audit().unwrap();
}

#[test]
fn priority_keeps_the_high_priority_node_and_ties_go_least_recent_first() {
    for (policy, high_kept) in [("lru", false), ("priority", true)] {
        let mut c = cache(policy, 32, 0);
        cached(&mut c, &[1, 1], 5);
        cached(&mut c, &[2, 2], 0);
        cached(&mut c, &[3, 3], 0);
        c.audit().unwrap();
        assert_eq!(c.evict(2, 0).kv_tokens, 2);
        assert_eq!(kept(&c, &[1, 1]), high_kept, "{policy}");
        if high_kept {
            // Between the two of priority 0, the least recently used went.
            assert!(!kept(&c, &[2, 2]));
            assert!(kept(&c, &[3, 3]));
        }
        c.audit().unwrap();
    }
}

#[test]
fn a_node_keeps_the_highest_priority_that_went_through_it() {
    let mut c = cache("priority", 32, 0);
    let a = cached(&mut c, &[1, 1, 1, 1], 3);
    // A lower priority through the same tokens does not lower it; a split copies it.
    cached(&mut c, &[1, 1], -4);
    let i = c.tree.resolve(a.node).unwrap();
    let upper = c.tree.node(i).parent;
    assert_eq!(c.tree.node(i).priority, 3);
    assert_eq!(c.tree.node(upper).priority, 3);
    // A negative priority goes before the default 0.
    cached(&mut c, &[2, 2], -1);
    cached(&mut c, &[3, 3], 0);
    c.audit().unwrap();
    assert_eq!(c.evict(2, 0).kv_tokens, 2);
    assert!(!kept(&c, &[2, 2]));
    assert!(kept(&c, &[3, 3]));
    c.audit().unwrap();
}

#[test]
fn an_admission_raises_the_priority_of_what_it_uses_and_its_finish_carries_it() {
    let mut c = cache("priority", 64, 4);
    cached(&mut c, &[1, 1], 0);
    cached(&mut c, &[2, 2], 0);
    // Admitted with priority 7 through [1, 1], and caching [1, 1, 5, 5] when it ends.
    let r = c.admit_with_priority(None, &[1, 1, 5], 7).unwrap().unwrap();
    let batches = c.take_batches();
    for b in &batches {
        c.complete(b.id).unwrap();
    }
    c.extend(r, &[5, 5]).unwrap().unwrap();
    c.finish(r).unwrap();
    cached(&mut c, &[3, 3], 0);
    c.audit().unwrap();
    // States go by priority: [2, 2]'s and [3, 3]'s (0) before the request's (7).
    assert_eq!(c.evict(0, 2).mamba_states, 2);
    assert!(kept(&c, &[1, 1]));
    assert!(kept(&c, &[1, 1, 5, 5]));
    assert!(!kept(&c, &[2, 2]));
    assert!(!kept(&c, &[3, 3]));
    c.audit().unwrap();
}

#[test]
fn state_value_keeps_the_state_that_saves_more_compute() {
    let long: Vec<u32> = vec![1; 48];
    for (policy, long_kept) in [("lru", false), ("state-value", true)] {
        let mut c = cache(policy, 128, 2);
        cached(&mut c, &long, 0);
        cached(&mut c, &[2, 2], 0);
        // The pool is full: the next state evicts one.
        cached(&mut c, &[3, 3], 0);
        c.audit().unwrap();
        assert_eq!(kept(&c, &long), long_kept, "{policy}");
        assert_eq!(kept(&c, &[2, 2]), !long_kept, "{policy}");
    }
}

#[test]
fn state_value_counts_the_tokens_back_to_the_nearest_state_above() {
    let mut c = cache("state-value", 128, 4);
    let parent: Vec<u32> = vec![1; 24];
    let mut child = parent.clone();
    child.extend([2; 8]);
    cached(&mut c, &child, 0);
    let node = c.match_prefix(None, &child).node;
    let i = c.tree.resolve(node).unwrap();
    let alone = eviction::state_value::state_cost(&c.tree, i);
    // A state on the parent: the child's state saves only the last 8 tokens' compute.
    cached(&mut c, &parent, 0);
    let below = eviction::state_value::state_cost(&c.tree, i);
    assert!(below < alone / 3, "{below} vs {alone}");
    c.audit().unwrap();
    // The parent's state evicted: the child's is worth all 32 tokens again (audit
    // checks that its key moved).
    let node = c.match_prefix(None, &parent).node;
    let p = c.tree.resolve(node).unwrap();
    let mut out = Evicted::default();
    c.lru.unlist_state(&mut c.tree, p);
    c.drop_state(p, &mut out);
    c.refresh(p);
    assert_eq!(eviction::state_value::state_cost(&c.tree, i), alone);
    c.audit().unwrap();
    // Deeper tokens weigh more: 8 tokens from depth 24 cost more than 8 from the root.
    assert!(below > 8 * eviction::state_value::DEPTH_SCALE + 7 * 8 / 2);
}

#[test]
fn state_value_ages_out_a_valuable_state_nobody_uses_any_more() {
    let long: Vec<u32> = vec![1; 48];
    let mut c = cache("state-value", 512, 2);
    cached(&mut c, &long, 0);
    let mut first_gone = None;
    for t in 2..200u32 {
        cached(&mut c, &[t, t], 0);
        c.audit().unwrap();
        if !kept(&c, &long) {
            first_gone = Some(t);
            break;
        }
    }
    // Short states come and go; each eviction raises the aging level, until the long
    // state, never used again, is the cheapest to keep.
    let gone = first_gone.expect("the unused long state never aged out");
    assert!(gone > 10, "went after only {gone} short states");
}

#[test]
fn audit_catches_a_key_the_policy_would_compute_differently() {
    for policy in ["lfu", "priority"] {
        let mut c = cache(policy, 16, 0);
        cached(&mut c, &[1, 2], 0);
        cached(&mut c, &[3, 4], 0);
        c.audit().unwrap();
        let i = c.lru.sets()[0].first().map(|&(_, _, i)| i).unwrap();
        // Changed behind the sets' back: the entry is listed under a stale key.
        c.tree.node_mut(i).matches += 1;
        c.tree.node_mut(i).priority += 1;
        let err = c.audit().unwrap_err();
        assert!(
            matches!(&err, Error::Invariant(m) if m.contains("eviction")),
            "{policy}: {err}"
        );
    }
}

#[test]
fn per_component_policies_order_each_set_by_its_own() {
    let mut c = Cache::new(Config {
        mamba_slots: 4,
        eviction_policy: EvictionPolicies {
            kv: EvictionPolicy::Priority,
            mamba: EvictionPolicy::Lru,
            swa: EvictionPolicy::Lru,
        },
        ..Config::kv(64, 1)
    })
    .unwrap();
    cached(&mut c, &[1, 1], 9);
    cached(&mut c, &[2, 2], 0);
    // States by recency: [1, 1]'s is the oldest unused one.
    assert_eq!(c.evict(0, 1).mamba_states, 1);
    assert_eq!(c.match_prefix(None, &[1, 1]).device_len, 0);
    c.audit().unwrap();
    assert_eq!(c.config().eviction_policy.kv, EvictionPolicy::Priority);
}

#[test]
fn state_value_evicts_states_no_match_used_before_used_ones() {
    let long: Vec<u32> = vec![1; 48];
    let mut c = cache("state-value", 128, 2);
    cached(&mut c, &[2, 2], 0);
    assert_eq!(c.match_prefix(None, &[2, 2, 9]).device_len, 2);
    // Saves far more, but no match has used it yet (like a finished request's end).
    cached(&mut c, &long, 0);
    cached(&mut c, &[3, 3], 0);
    c.audit().unwrap();
    assert!(kept(&c, &[2, 2]));
    assert!(!kept(&c, &long));
}

#[test]
fn state_value_orders_used_states_by_recency_and_compute_not_by_their_match_count() {
    let mut c = cache("state-value", 64, 2);
    cached(&mut c, &[1, 1], 0);
    cached(&mut c, &[2, 2], 0);
    // [1, 1] saves as much as [2, 2] and was used five times, but before [2, 2]'s one
    // use: past matches do not keep a state (on `gsp` a group's many past requests
    // mean fewer to come).
    for _ in 0..5 {
        assert_eq!(c.match_prefix(None, &[1, 1, 9]).device_len, 2);
    }
    assert_eq!(c.match_prefix(None, &[2, 2, 9]).device_len, 2);
    assert_eq!(c.evict(0, 1).mamba_states, 1);
    c.audit().unwrap();
    assert!(!kept(&c, &[1, 1]));
    assert!(kept(&c, &[2, 2]));
}

/// Admits `prompt` (the copy of its state done), extends it by `more` and finishes it:
/// a conversation's next turn, which caches a state at its end.
fn turn(c: &mut Cache, prompt: &[u32], more: &[u32]) {
    let r = c.admit(None, prompt).unwrap().unwrap();
    for b in c.take_batches() {
        c.complete(b.id).unwrap();
    }
    c.extend(r, more).unwrap().unwrap();
    c.finish(r).unwrap();
}

/// The succession of the state of the node that ends at `toks` (read from the snapshot:
/// a match would count as a use).
fn succession(c: &Cache, toks: &[u32]) -> Succession {
    let node = c
        .snapshot()
        .into_iter()
        .find(|n| n.prefix == toks)
        .unwrap()
        .id;
    c.tree
        .node(c.tree.resolve(node).unwrap())
        .mamba
        .policy
        .succession
}

#[test]
fn state_value_evicts_a_used_state_first_once_the_next_turn_supersedes_it() {
    let first: Vec<u32> = vec![1; 32];
    let mut second = first.clone();
    second.extend([5; 8]);
    let mut c = cache("state-value", 256, 5);
    cached(&mut c, &first, 0);
    // Another used state, which saves far less than `first`.
    cached(&mut c, &[2, 2], 0);
    assert_eq!(c.match_prefix(None, &[2, 2, 9]).device_len, 2);
    // The next turn resumes from `first` (a hit) and caches its end, `second`: a
    // request going past `first` now resumes from `second`.
    turn(&mut c, &second[..33], &second[32..]);
    c.audit().unwrap();
    assert_eq!(succession(&c, &first), Succession::Superseded);
    // An unused state placed last, which saves more than any other.
    cached(&mut c, &[3; 48], 0);
    c.audit().unwrap();
    // `first` goes first although it is used; then the unused one, although it saves
    // the most: `second` took `first`'s place among the used states.
    assert_eq!(c.evict(0, 1).mamba_states, 1);
    assert!(!kept(&c, &first));
    assert!(kept(&c, &second) && kept(&c, &[3; 48]));
    assert_eq!(c.evict(0, 1).mamba_states, 1);
    assert!(!kept(&c, &[3; 48]));
    assert!(kept(&c, &second) && kept(&c, &[2, 2]));
    c.audit().unwrap();
}

#[test]
fn state_value_supersedes_no_state_that_a_branch_or_a_running_request_leaves_from() {
    let p: Vec<u32> = vec![1; 16];
    let below = |t: u32| -> Vec<u32> { p.iter().copied().chain([t, t]).collect() };
    for case in ["none", "branch", "request", "earlier state", "hit again"] {
        let mut c = cache("state-value", 256, 4);
        cached(&mut c, &p, 0);
        let mut held = None;
        match case {
            // A branch without a state (KV alone) leaves from `p`.
            "branch" => {
                let kv = c.alloc_kv(18).unwrap().unwrap();
                c.insert_with_priority(None, &below(3), &kv, 0, None, 0)
                    .unwrap();
            }
            // A state was placed below `p` before (its branch evicted since).
            "earlier state" => {
                cached(&mut c, &below(3), 0);
                assert_eq!(c.evict(0, 1).mamba_states, 1);
                assert!(kept(&c, &p) && !kept(&c, &below(3)));
            }
            _ => {}
        }
        assert_eq!(c.match_prefix(None, &below(9)).device_len, 16);
        if case == "request" {
            // A request resumed from `p` and has cached nothing of its own yet.
            held = c.admit(None, &below(7)).unwrap();
            for b in c.take_batches() {
                c.complete(b.id).unwrap();
            }
        }
        cached(&mut c, &below(2), 0);
        if case == "hit again" {
            // A request leaving the path between the two uses `p` again.
            assert_eq!(c.match_prefix(None, &below(9)).device_len, 16);
        }
        c.audit().unwrap();
        let superseded = case == "none";
        assert_eq!(
            succession(&c, &p) == Succession::Superseded,
            superseded,
            "{case}"
        );
        // An unused state goes before `p` unless `p` is superseded.
        cached(&mut c, &[4, 4], 0);
        assert_eq!(c.evict(0, 1).mamba_states, 1);
        assert_eq!(kept(&c, &p), !superseded, "{case}");
        assert_eq!(kept(&c, &[4, 4]), superseded, "{case}");
        if let Some(r) = held {
            c.abort(r).unwrap();
        }
        c.audit().unwrap();
    }
}
