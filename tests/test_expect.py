"""``HybridCache.expect`` and the scheduler's ``lookahead``: eviction told the waiting queue."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import radixcache as rc
import radixcache.serving as sv

POLICIES = ["lru", "lfu", "priority", "state-value"]


def hybrid(states: int = 3, policy: str = "lru") -> rc.HybridCache:
    return rc.HybridCache(kv_slots=64, page_size=1, mamba_slots=states, eviction_policy=policy)


def cached(c: rc.HybridCache, toks: list[int]) -> None:
    """Cache `toks` with fresh slots and, in a hybrid cache, a state at the end."""
    kv = c.alloc_kv(len(toks))
    state = c.alloc_mamba() if c.mamba_slots else None
    c.insert(toks, kv, mamba_slot=state)


def kept(c: rc.HybridCache, toks: list[int]) -> bool:
    """Whether a match of `toks` would still use a state at their end."""
    return c.peek_prefix(toks)[0] == len(toks)


@pytest.mark.parametrize("policy", POLICIES)
def test_state_eviction_keeps_what_a_waiting_request_resumes_from(policy: str) -> None:
    c = hybrid(policy=policy)
    for toks in ([1, 1], [2, 2], [3, 3]):
        cached(c, toks)
    assert c.expect([np.array([1, 1, 9], dtype=np.uint32)]) == 1
    assert c.evict(mamba_states=1).mamba_states == 1
    assert kept(c, [1, 1]), "the expected state stays though it is the oldest"
    assert not kept(c, [2, 2])
    assert c.stats()["expected_evictions"] == 0
    c.audit()


def test_with_every_state_expected_the_one_needed_latest_goes_and_is_counted() -> None:
    c = hybrid(states=2)
    cached(c, [1, 1])
    cached(c, [2, 2])
    assert c.expect([[2, 2, 9], [1, 1, 9]]) == 2
    c.evict(mamba_states=1)
    assert kept(c, [2, 2])
    assert not kept(c, [1, 1])
    s = c.stats()
    assert (s["expected_evictions"], s["expected_nodes"]) == (1, 1)
    c.audit()


def test_kv_eviction_passes_over_the_path_a_waiting_request_matches() -> None:
    c = rc.HybridCache(kv_slots=64, page_size=1)
    cached(c, [1, 1])
    cached(c, [2, 2])
    c.expect([[1, 1, 5]])
    assert c.evict(kv_tokens=2).kv_tokens == 2
    assert c.peek_prefix([1, 1])[0] == 2
    assert c.peek_prefix([2, 2])[0] == 0
    c.audit()


def test_prompts_may_be_any_iterable_of_token_sequences() -> None:
    c = hybrid()
    cached(c, [1, 1])
    cached(c, [2, 2])
    rows = np.array([[1, 1, 9], [2, 2, 9]], dtype=np.uint32)
    assert c.expect(rows) == 2, "a 2-D array: one prompt a row"
    assert c.expect(([1, 1, 9],), namespaces=(None,)) == 1
    assert c.expect(p for p in rows) == 2


def test_expect_in_a_namespace_marks_that_tree_only() -> None:
    c = hybrid()
    cached(c, [1, 1])
    kv = c.alloc_kv(2)
    c.insert([1, 1], kv, namespace="a", mamba_slot=c.alloc_mamba())
    assert c.expect([[1, 1, 9]], namespaces=["a"]) == 1
    assert c.expect([[1, 1, 9], [1, 1, 9]], namespaces=["a", None]) == 2
    assert c.expect([[1, 1, 9]], namespaces=["nobody"]) == 0
    c.audit()


def test_an_expect_replaces_the_marks_and_an_empty_one_clears_them() -> None:
    c = hybrid()
    for toks in ([1, 1], [2, 2], [3, 3]):
        cached(c, toks)
    c.expect([[1, 1, 9], [2, 2, 9]])
    assert c.stats()["expected_nodes"] == 2
    c.expect([[3, 3, 9]])
    assert c.stats()["expected_nodes"] == 1
    c.evict(mamba_states=1)
    assert not kept(c, [1, 1]), "no longer expected, the oldest goes first again"
    assert c.expect([]) == 0
    s = c.stats()
    assert (s["expected_nodes"], s["expect_calls"]) == (0, 3)
    c.audit()


def test_an_expect_changes_nothing_else() -> None:
    c = hybrid(policy="state-value")
    cached(c, [1, 2, 3, 4])
    before = {k: v for k, v in c.stats().items() if not k.startswith("expect")}
    # Ends inside the cached node (no state there), matches nothing, an unknown tree.
    assert c.expect([[1, 2], [7], [1, 2, 3, 4, 5]], namespaces=[None, None, "x"]) == 0
    after = {k: v for k, v in c.stats().items() if not k.startswith("expect")}
    assert after == before, "no split (the nodes gauge), refresh or count"
    c.audit()


def test_a_checkpoint_no_waiting_request_needs_sooner_is_let_go_by() -> None:
    c = hybrid()
    cached(c, [1, 1])
    cached(c, [2, 2])
    req = c.admit([5, 5])
    c.extend(req, [5, 5])
    assert c.available_mamba() == 0
    c.expect([[1, 1, 9], [2, 2, 9]])
    c.checkpoint(req)
    assert c.stats()["checkpoint_states_bypassed"] == 1
    assert c.take_batches() == []
    assert kept(c, [1, 1])
    assert kept(c, [2, 2])
    # Needed second, before [2, 2]: placed, and [2, 2]'s state goes instead.
    c.expect([[1, 1, 9], [5, 5, 9], [2, 2, 9]])
    c.checkpoint(req)
    (batch,) = c.take_batches()
    c.complete(batch.id)
    assert kept(c, [1, 1])
    assert kept(c, [5, 5])
    assert not kept(c, [2, 2])
    c.finish(req)
    c.audit()


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (("abc",), {}, TypeError, "prompts: expected an iterable of token sequences, got str"),
        ((5,), {}, TypeError, "prompts: expected an iterable of token sequences, got int"),
        (((1, 2),), {}, TypeError, "prompts[0]"),
        (([[1], "x"],), {}, TypeError, "prompts[1]"),
        (([[1], [-1]],), {}, ValueError, "prompts[1]"),
        (([[1]],), {"namespaces": "a"}, TypeError, "namespaces: expected an iterable of str"),
        (([[1]],), {"namespaces": [3]}, TypeError, "namespaces[0]: expected str or None"),
        (([[1]],), {"namespaces": ["a", "b"]}, ValueError, "namespaces: 2 given for 1 prompts"),
    ],
)
def test_bad_expect_arguments_are_named_and_change_nothing(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    c = hybrid()
    cached(c, [1, 1])
    c.expect([[1, 1, 9]])
    with pytest.raises(error) as e:
        c.expect(*args, **kwargs)
    assert message in str(e.value)
    s = c.stats()
    assert (s["expected_nodes"], s["expect_calls"]) == (1, 1), "the last marks stay"
    c.audit()


def test_lookahead_must_not_be_negative() -> None:
    c = hybrid()
    with pytest.raises(ValueError, match="lookahead: must be >= 0"):
        sv.Scheduler(c, sv.InstantEngine(c), lookahead=-1)


def gsp_rates(requests: int, states: int) -> dict[int, float]:
    """`gsp`'s hit rate without and with a lookahead of 128 (model-free, no host tier)."""
    jobs = sv.load("gsp", requests)
    rates = {}
    for lookahead in (0, 128):
        cfg = sv.ReplayConfig(
            mamba_slots=states,
            host_kv_slots=0,
            oracle=False,
            attention_only=False,
            lookahead=lookahead,
        )
        r, _ = sv.replay(jobs, cfg)
        assert (r["audit"], r["pools_full_at_end"], r["rejected"]) == ("pass", True, 0)
        assert r["lookahead"] == lookahead
        rates[lookahead] = r["hit_rate"]
    return rates


def test_lookahead_raises_the_hit_rate_where_the_state_pool_is_short() -> None:
    # gsp at 64 states: 64 groups' prompts, uniformly mixed, and about 30 state slots for
    # the tree. Told the queue, eviction keeps the groups that come next.
    rates = gsp_rates(512, 64)
    assert rates[128] > rates[0] + 0.1, rates


def test_a_replay_with_lookahead_serves_every_sample_right() -> None:
    cfg = sv.ReplayConfig(mamba_slots=24, host_kv_slots=4096, lookahead=16, attention_only=False)
    r, _ = sv.replay(sv.load("mixed", 96), cfg)
    assert (r["mismatches"], r["audit"], r["pools_full_at_end"]) == (0, "pass", True)
    assert r["samples_checked"] > 0
    assert r["queue_cuts"] > 0  # the cuts were served too


# -------------------------------------------------------------- queue cuts (lookahead)

SYSTEM = list(range(1000, 1100))  # 100 tokens: with pages of 16, a state fits at 96


def job(prompt: list[int], out: int = 4, namespace: str | None = None) -> sv.Job:
    tail = np.arange(5000, 5000 + out, dtype=np.uint32)
    return sv.Job(np.array(prompt, dtype=np.uint32), tail, namespace=namespace)


def serve(jobs: list[sv.Job], lookahead: int, cached: list[int] | None = None) -> sv.Counters:
    """Serve `jobs` one at a time (the next ones wait); the counters, after an audit."""
    c = rc.HybridCache(kv_slots=1024, page_size=16, mamba_slots=8)
    if cached is not None:
        c.insert(cached, c.alloc_kv(len(cached)), mamba_slot=c.alloc_mamba())
    s = sv.Scheduler(c, sv.InstantEngine(c), max_running=1, lookahead=lookahead)
    s.add(jobs)
    counters = s.run()
    c.audit()
    return counters


def hits(c: sv.Counters) -> list[int]:
    return [device for _, device, _ in c.served]


def test_a_prefill_keeps_a_state_where_a_waiting_request_leaves_its_prompt() -> None:
    # Nothing is cached: the first request cannot know the branch point at 100 but the
    # queue does; without the lookahead the second finds no state on its path.
    jobs = [job(SYSTEM + list(range(1, 51))), job(SYSTEM + list(range(60, 120)))]
    without, told = serve(jobs, 0), serve(jobs, 4)
    assert (hits(without), without.queue_cuts) == ([0, 0], 0)
    assert (hits(told), told.queue_cuts) == ([0, 96], 1)


def test_a_waiting_prompt_inside_this_one_gets_a_state_where_it_resumes() -> None:
    jobs = [job(SYSTEM + list(range(1, 51))), job(SYSTEM)]
    c = serve(jobs, 4)
    assert (hits(c), c.queue_cuts) == ([0, 96], 1)  # it resumes before its last token


def test_a_later_turn_places_no_cut_it_resumes_from_the_end_state() -> None:
    first = job(SYSTEM + list(range(1, 51)))
    turn = [*first.prompt.tolist(), *first.output.tolist(), 7, 8, 9]
    c = serve([first, job(turn)], 4)
    assert c.queue_cuts == 0
    assert hits(c)[1] == (len(first.prompt) + len(first.output) - 1) // 16 * 16


@pytest.mark.parametrize(
    ("second", "cached"),
    [
        (job([*SYSTEM, 7], namespace="lora"), None),  # another namespace's tree
        (job(SYSTEM[:40] + [7] * 30), SYSTEM[:64]),  # leaves it before what it matched
        (job([7, *SYSTEM]), None),  # shares nothing
    ],
)
def test_no_cut_where_no_waiting_request_would_resume_past_the_match(
    second: sv.Job, cached: list[int] | None
) -> None:
    c = serve([job(SYSTEM + list(range(1, 51))), second], 4, cached)
    assert c.queue_cuts == 0


def test_the_marks_name_the_requests_still_waiting_after_the_admissions() -> None:
    # Marks made before a step's admissions would rank the request just admitted: its
    # state, no longer needed by anyone waiting, would be kept over a waiting one's.
    c = rc.HybridCache(kv_slots=1024, page_size=16, mamba_slots=8)
    first, second = SYSTEM[:64], [7] * 64
    for toks in (first, second):
        c.insert(toks, c.alloc_kv(len(toks)), mamba_slot=c.alloc_mamba())
    s = sv.Scheduler(c, sv.InstantEngine(c), max_running=1, lookahead=4)
    s.add([job([*first, 1, 2]), job([*second, 3, 4])])
    s.step()
    assert len(s.running) == 1
    assert c.stats()["expected_nodes"] == 1  # the second's state alone
    s.stop()  # the first's lock goes; the marks stay until the next `expect`
    assert c.evict(mamba_states=1).mamba_states == 1
    assert (kept(c, first), kept(c, second)) == (False, True)
    c.audit()


def test_lookahead_keeps_states_where_running_requests_nearly_fill_the_pool() -> None:
    # gsp at 16 states: 14 running requests leave the tree about two slots. With marks
    # made after the admissions and the running requests' matched states not locked
    # once copied, eviction keeps the groups that come next (0.09 with marks made
    # before the admissions: they ranked the requests just admitted; 0.165 with the
    # matched states locked until their requests end).
    rates = gsp_rates(256, 16)
    assert rates[128] > 5 * rates[0], rates
    assert rates[128] > 0.2, rates


def test_lookahead_ranks_the_end_state_a_later_turn_resumes_from() -> None:
    # multiturn at 16 states: a conversation's next turn waits while the turn before
    # decodes, so its walk sees the KV only up to that turn's prompt. The end state the
    # turn places, deeper, is ranked from the prompt's next tokens the cache keeps; it
    # was let go by before (0.82 of the offline bound: 8 requests hit against 10).
    cfg = sv.ReplayConfig(
        mamba_slots=16, host_kv_slots=0, oracle=False, lookahead=128, offline_bound=True
    )
    r, _ = sv.replay(sv.load("multiturn"), cfg)
    assert (r["audit"], r["pools_full_at_end"], r["rejected"]) == ("pass", True, 0)
    assert r["device_hit_rate"] >= 0.9 * r["offline_bound_hit_rate"] > 0, r
