//! Unit tests of `Cache::expect`: eviction passes over the nodes waiting requests will
//! resume from, gives out the one needed latest when nothing else is left, and lets a
//! new state go by when every state it could displace is needed sooner.

use super::util::{fresh as cached, policy_cache as cache, seq, stat};
use crate::cache::eviction::WAITING_TAIL;
use crate::cache::*;
use crate::RequestId;

/// Whether `toks` still ends a device match that uses a state.
fn state_kept(c: &Cache, toks: &[u32]) -> bool {
    c.peek_prefix(None, toks).device_len == toks.len()
}

/// `toks` followed by a token no cached prefix has: a waiting request's prompt.
fn prompt(toks: &[u32]) -> Vec<u32> {
    [toks, &[99]].concat()
}

#[test]
fn state_eviction_passes_over_the_states_waiting_requests_resume_from_under_every_policy() {
    for policy in ["lru", "lfu", "priority", "state-value"] {
        let mut c = cache(policy, 32, 3);
        // The oldest, [1, 1], goes first without a hint.
        for toks in [[1, 1], [2, 2], [3, 3]] {
            cached(&mut c, &toks);
        }
        assert_eq!(c.expect(&[(None, &prompt(&[1, 1]))]), 1, "{policy}");
        c.audit().unwrap();
        assert_eq!(c.evict(0, 1).mamba_states, 1);
        c.audit().unwrap();
        assert!(
            state_kept(&c, &[1, 1]),
            "{policy}: the expected state stays"
        );
        assert!(!state_kept(&c, &[2, 2]), "{policy}: the next in order goes");
        assert_eq!(stat(&c, "expected_evictions"), 0, "{policy}");
    }
}

#[test]
fn when_every_state_is_expected_the_one_needed_latest_goes_first_and_is_counted() {
    let mut c = cache("lru", 32, 2);
    cached(&mut c, &[1, 1]);
    cached(&mut c, &[2, 2]);
    // [2, 2] is needed first, [1, 1] second: [1, 1] goes, although it is the older.
    let (a, b) = (prompt(&[2, 2]), prompt(&[1, 1]));
    assert_eq!(c.expect(&[(None, &a), (None, &b)]), 2);
    assert_eq!(c.evict(0, 1).mamba_states, 1);
    assert!(state_kept(&c, &[2, 2]));
    assert!(!state_kept(&c, &[1, 1]));
    assert_eq!(stat(&c, "expected_evictions"), 1);
    c.audit().unwrap();
}

#[test]
fn kv_eviction_passes_over_the_leaf_a_waiting_request_matches_to() {
    let mut c = cache("lru", 32, 0);
    cached(&mut c, &[1, 1]);
    cached(&mut c, &[2, 2]);
    assert_eq!(c.expect(&[(None, &prompt(&[1, 1]))]), 1);
    assert_eq!(c.evict(2, 0).kv_tokens, 2);
    assert_eq!(c.peek_prefix(None, &[1, 1]).device_len, 2);
    assert_eq!(c.peek_prefix(None, &[2, 2]).device_len, 0);
    // Asked for more than the rest, eviction takes the expected leaf too.
    assert_eq!(c.evict(2, 0).kv_tokens, 2);
    assert_eq!(stat(&c, "expected_evictions"), 1);
    c.audit().unwrap();
}

#[test]
fn an_expect_replaces_the_last_marks_and_an_empty_one_clears_them() {
    let mut c = cache("lru", 32, 3);
    for toks in [[1, 1], [2, 2], [3, 3]] {
        cached(&mut c, &toks);
    }
    c.expect(&[(None, &prompt(&[1, 1])), (None, &prompt(&[2, 2]))]);
    assert_eq!(stat(&c, "expected_nodes"), 2);
    c.expect(&[(None, &prompt(&[3, 3]))]);
    assert_eq!(stat(&c, "expected_nodes"), 1);
    // [1, 1] is no longer expected: it goes first again.
    assert_eq!(c.evict(0, 1).mamba_states, 1);
    assert!(!state_kept(&c, &[1, 1]));
    c.expect(&[]);
    assert_eq!(stat(&c, "expected_nodes"), 0);
    assert_eq!(stat(&c, "expect_calls"), 3);
    c.audit().unwrap();
}

#[test]
fn an_expect_splits_nothing_counts_no_hit_and_marks_nothing_for_an_uncached_prompt() {
    let mut c = cache("state-value", 32, 2);
    cached(&mut c, &seq(4));
    let nodes = c.snapshot().len();
    let before: Vec<_> = c
        .stats()
        .into_iter()
        .filter(|(k, _)| !k.starts_with("expect"))
        .collect();
    // [1, 2] ends inside the cached node (no state there), [7] matches nothing; a
    // prompt in a namespace that does not exist matches nothing either.
    let marked = c.expect(&[(None, &[1, 2]), (None, &[7]), (Some("nobody"), &seq(5))]);
    assert_eq!(marked, 0);
    assert_eq!(c.snapshot().len(), nodes, "an expect splits nothing");
    let after: Vec<_> = c
        .stats()
        .into_iter()
        .filter(|(k, _)| !k.starts_with("expect"))
        .collect();
    assert_eq!(before, after, "an expect moves no other statistic");
    c.audit().unwrap();
}

#[test]
fn marks_left_on_evicted_nodes_are_harmless_and_audited() {
    let mut c = cache("lru", 4, 0);
    cached(&mut c, &[1, 1]);
    c.expect(&[(None, &prompt(&[1, 1]))]);
    // Evicted (nothing else is left), then the slot of its node reused by another.
    assert_eq!(c.evict(2, 0).kv_tokens, 2);
    cached(&mut c, &[2, 2]);
    assert_eq!(stat(&c, "expected_nodes"), 0);
    c.audit().unwrap();
    assert_eq!(c.evict(2, 0).kv_tokens, 2);
    assert_eq!(stat(&c, "expected_evictions"), 1);
}

/// A request that cached `toks` (its state is the pool's last free slot), ready to
/// checkpoint there.
fn request_at(c: &mut Cache, toks: &[u32]) -> RequestId {
    let id = c.admit(None, toks).unwrap().unwrap();
    c.extend(id, toks).unwrap().unwrap();
    id
}

#[test]
fn a_checkpoint_no_waiting_request_needs_sooner_is_let_go_by() {
    let mut c = cache("lru", 64, 3);
    cached(&mut c, &[1, 1]);
    cached(&mut c, &[2, 2]);
    let id = request_at(&mut c, &[5, 5]);
    assert_eq!(c.available_mamba(), 0);
    c.expect(&[(None, &prompt(&[1, 1])), (None, &prompt(&[2, 2]))]);
    // Nobody waits for [5, 5]: both expected states stay, nothing is copied.
    c.checkpoint(id).unwrap();
    assert_eq!(stat(&c, "checkpoint_states_bypassed"), 1);
    assert!(c.take_batches().is_empty());
    assert!(state_kept(&c, &[1, 1]) && state_kept(&c, &[2, 2]));
    c.audit().unwrap();
    // Now a waiting request passes [5, 5] second: its state is needed before [2, 2]'s,
    // which goes instead, and the new state is expected from its placement on.
    let (a, b, d) = (prompt(&[1, 1]), prompt(&[5, 5]), prompt(&[2, 2]));
    c.expect(&[(None, &a), (None, &b), (None, &d)]);
    c.checkpoint(id).unwrap();
    assert_eq!(stat(&c, "checkpoint_states_bypassed"), 1);
    let batches = c.take_batches();
    assert_eq!(batches.len(), 1);
    c.complete(batches[0].id).unwrap();
    assert!(state_kept(&c, &[1, 1]) && !state_kept(&c, &[2, 2]));
    assert!(state_kept(&c, &[5, 5]));
    assert_eq!(stat(&c, "expected_nodes"), 2);
    c.finish(id).unwrap();
    c.audit().unwrap();
}

#[test]
fn without_expect_a_checkpoint_displaces_as_before() {
    let mut c = cache("lru", 64, 3);
    cached(&mut c, &[1, 1]);
    cached(&mut c, &[2, 2]);
    let id = request_at(&mut c, &[5, 5]);
    c.checkpoint(id).unwrap();
    let batches = c.take_batches();
    assert_eq!(batches.len(), 1);
    c.complete(batches[0].id).unwrap();
    assert!(!state_kept(&c, &[1, 1]), "the least recently used goes");
    assert_eq!(stat(&c, "checkpoint_states_bypassed"), 0);
    c.finish(id).unwrap();
    c.audit().unwrap();
}

#[test]
fn a_finished_requests_state_a_waiting_request_will_resume_from_is_marked_at_once() {
    let mut c = cache("lru", 64, 3);
    // [5, 5]'s KV is cached without a state: a waiting request's walk passes it.
    let kv = c.alloc_kv(2).unwrap().unwrap();
    c.insert(None, &[5, 5], &kv, 0).unwrap();
    assert_eq!(
        c.expect(&[(None, &prompt(&[5, 5]))]),
        0,
        "no state to resume from yet"
    );
    let id = c.admit(None, &[5, 5]).unwrap().unwrap();
    c.extend(id, &[5, 5]).unwrap().unwrap();
    c.finish(id).unwrap();
    assert!(state_kept(&c, &[5, 5]));
    assert_eq!(
        stat(&c, "expected_nodes"),
        1,
        "the finished state is expected"
    );
    // Two more states fill the pool; asked for one, eviction passes over [5, 5].
    cached(&mut c, &[1, 1]);
    cached(&mut c, &[2, 2]);
    assert_eq!(c.evict(0, 1).mamba_states, 1);
    assert!(state_kept(&c, &[5, 5]) && !state_kept(&c, &[1, 1]));
    c.audit().unwrap();
}

/// A running request for `[5, 5, 6, 6]` fed its whole sequence while the pool is full
/// ([1, 1] and [2, 2] cached); `next` waits second, between their prompts.
fn checkpoint_past_the_walk(next: &[u32]) -> Cache {
    let mut c = cache("lru", 64, 3);
    let id = c.admit(None, &[]).unwrap().unwrap();
    c.extend(id, &[5, 5]).unwrap().unwrap();
    cached(&mut c, &[1, 1]);
    cached(&mut c, &[2, 2]);
    assert_eq!(c.available_mamba(), 0);
    // The walks see no KV of [5, 5, ...] yet: the running request has cached nothing.
    let (a, d) = (prompt(&[1, 1]), prompt(&[2, 2]));
    c.expect(&[(None, &a), (None, next), (None, &d)]);
    c.extend(id, &[6, 6]).unwrap().unwrap();
    c.checkpoint(id).unwrap();
    for b in c.take_batches() {
        c.complete(b.id).unwrap();
    }
    c.audit().unwrap();
    c
}

#[test]
fn a_state_placed_past_a_waiting_prompts_walk_on_its_path_is_ranked_for_it() {
    // The waiting prompt extends the running request's sequence (a conversation's next
    // turn): the state its checkpoint places, deeper than any KV the walk saw, serves
    // it second, before [2, 2]'s, which goes instead.
    let c = checkpoint_past_the_walk(&prompt(&[5, 5, 6, 6]));
    assert_eq!(stat(&c, "checkpoint_states_bypassed"), 0);
    assert!(state_kept(&c, &[5, 5, 6, 6]) && state_kept(&c, &[1, 1]));
    assert!(!state_kept(&c, &[2, 2]));
    // One that leaves the path past the walk is not served: the state is let go by.
    let c = checkpoint_past_the_walk(&prompt(&[5, 5, 7, 7]));
    assert_eq!(stat(&c, "checkpoint_states_bypassed"), 1);
    assert!(state_kept(&c, &[1, 1]) && state_kept(&c, &[2, 2]));
    assert!(!state_kept(&c, &[5, 5, 6, 6]));
    // A long prompt: what the walk keeps of it past its cached KV still reaches the
    // state.
    let far: Vec<u32> = [&[5, 5, 6, 6][..], &[6; WAITING_TAIL]].concat();
    let c = checkpoint_past_the_walk(&far);
    assert_eq!(stat(&c, "checkpoint_states_bypassed"), 0);
}
