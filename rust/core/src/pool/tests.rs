//! Unit tests of the pools: allocation and return, the books per page state, pins and
//! draining, engine-owned pools, SWA companions, and illegal transitions recorded as
//! faults.

use super::*;

fn pool(slots: usize, ps: usize) -> Pool {
    Pool::new("kv_slots", slots, ps).unwrap()
}

#[test]
fn rejects_bad_configuration() {
    assert!(matches!(
        Pool::new("kv_slots", 10, 4),
        Err(Error::InvalidArgument {
            arg: "kv_slots",
            ..
        })
    ));
    assert!(matches!(
        Pool::new("kv_slots", 8, 0),
        Err(Error::InvalidArgument {
            arg: "page_size",
            ..
        })
    ));
}

#[test]
fn a_pool_costs_memory_for_the_pages_it_used_not_for_its_size() {
    // 2**32 - 1 slots would need 36 GiB of books up front; none is allocated.
    let p = pool(u32::MAX as usize, 1);
    assert_eq!(p.free_pages(), u32::MAX as usize);
    let a = p.try_alloc(3).unwrap();
    assert_eq!(a.pages(), &[0, 1, 2]);
    assert_eq!(p.shared.inner.lock().state.len(), 3);
    assert_eq!(p.state(u32::MAX - 1), Some(PageState::Free));
    assert_eq!(p.state(u32::MAX), None);
    drop(a);
    // Given back pages are handed out again first, most recent first.
    let b = p.try_alloc(4).unwrap();
    assert_eq!(b.pages(), &[2, 1, 0, 3]);
    drop(b);
    assert_eq!(p.counts().free, u32::MAX as usize);
}

#[test]
fn alloc_hands_out_ascending_pages_and_drop_returns_them() {
    let p = pool(16, 4);
    let a = p.try_alloc(3).unwrap();
    assert_eq!(a.pages(), &[0, 1, 2]);
    assert_eq!(p.free_pages(), 1);
    assert!(p.try_alloc(2).is_none(), "not enough pages: nothing taken");
    assert_eq!(p.free_pages(), 1);
    drop(a);
    assert_eq!(p.free_pages(), 4);
    assert_eq!(p.audit().unwrap().free, 4);
}

#[test]
fn accounting_free_plus_held_equals_capacity() {
    let p = pool(32, 1);
    let a = p.try_alloc(5).unwrap();
    let b = p.try_alloc(7).unwrap().into_caller();
    let c = p.counts();
    assert_eq!(c.free + c.owned + c.caller + c.tree, 32);
    assert_eq!((c.owned, c.caller), (5, 7));
    drop(a);
    p.free_caller(&b, "indices").unwrap();
    assert_eq!(p.counts().free, 32);
}

#[test]
fn double_free_and_foreign_free_change_nothing() {
    let p = pool(8, 1);
    let held = p.try_alloc(2).unwrap().into_caller();
    p.free_caller(&held, "indices").unwrap();
    let before = p.counts();
    let err = p.free_caller(&held, "indices").unwrap_err();
    assert!(err.to_string().contains("not allocated"), "{err}");
    assert_eq!(p.counts(), before);
    let out = p.free_caller(&[99], "indices").unwrap_err();
    assert!(out.to_string().contains("out of range"), "{out}");
    // A call naming one good and one bad page frees neither.
    let good = p.try_alloc(1).unwrap().into_caller();
    let before = p.counts();
    assert!(p.free_caller(&[good[0], 7], "indices").is_err());
    assert_eq!(p.counts(), before);
    p.audit().unwrap();
}

#[test]
fn claim_rolls_back_on_error() {
    let p = pool(8, 1);
    let held = p.try_alloc(3).unwrap().into_caller();
    let before = p.counts();
    let err = p
        .claim_caller(&[held[0], held[1], held[0]], "kv_indices")
        .unwrap_err();
    assert!(err.to_string().contains("listed twice"), "{err}");
    assert_eq!(p.counts(), before);
    let claimed = p.claim_caller(&held, "kv_indices").unwrap();
    assert_eq!(p.counts().owned, 3);
    drop(claimed);
    assert_eq!(p.counts().free, 8);
}

#[test]
fn panic_inside_a_scope_returns_pages() {
    let p = pool(8, 1);
    let p2 = p.clone();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let _held = p2.try_alloc(4).unwrap();
        panic!("boom");
    }));
    assert!(r.is_err());
    assert_eq!(p.free_pages(), 8);
    p.audit().unwrap();
}

#[test]
fn a_run_hands_out_pages_front_to_back_and_returns_the_rest_when_dropped() {
    let p = pool(8, 1);
    let mut run = p.try_alloc(6).unwrap().into_run();
    let a = run.take(2);
    let b = run.take(1);
    assert_eq!(
        (a.pages(), b.pages(), run.pages()),
        (&[0, 1][..], &[2][..], &[3, 4, 5][..])
    );
    drop(run);
    assert_eq!(p.counts().owned, 3, "the three pages not taken went back");
    let mut run = p.try_alloc(5).unwrap().into_run();
    let c = run.take(10);
    assert_eq!((c.len(), run.pages().len()), (5, 0), "as many as are left");
    drop((a, b, c, run));
    assert_eq!(p.counts().free, 8);
    p.audit().unwrap();
}

/// The fault a pool recorded, after checking that audit reports it too.
fn fault_of(p: &Pool) -> String {
    let why = p.fault().expect("an illegal transition is recorded");
    assert!(
        matches!(p.audit(), Err(Error::Invariant(w)) if w == why),
        "audit reports the fault"
    );
    why
}

/// Pages `pages` of `p`, as a value the pool never handed out (what a bug would hold).
fn forged(p: &Pool, pages: &[u32]) -> Pages {
    Pages {
        pool: p.clone(),
        pages: pages.to_vec(),
    }
}

#[test]
fn publishing_pages_that_are_not_owned_moves_nothing_and_records_the_fault() {
    let p = pool(8, 1);
    let held = p.try_alloc(2).unwrap();
    let caller = p.try_alloc(1).unwrap().into_caller();
    let before = p.counts();
    // An owned page, then the caller's: the first is moved back, nothing changes.
    let pages = forged(&p, &[held.pages()[0], caller[0]]).into_tree();
    assert_eq!(pages.len(), 2);
    assert_eq!(p.counts(), before);
    assert_eq!(p.state(held.pages()[0]), Some(PageState::Owned));
    assert!(fault_of(&p).contains("page 2 is Caller, not Owned"));
    // A page never handed out, and a page listed twice.
    let q = pool(8, 1);
    let _ = forged(&q, &[7]).into_caller();
    assert!(fault_of(&q).contains("page 7 (Owned to Caller) was never handed out"));
    let r = pool(8, 1);
    let one = r.try_alloc(1).unwrap();
    let before = r.counts();
    let _ = forged(&r, &[one.pages()[0], one.pages()[0]]).into_tree();
    assert_eq!(r.counts(), before);
    assert_eq!(
        r.state(0),
        Some(PageState::Owned),
        "the first mention moved back"
    );
    assert!(fault_of(&r).contains("page 0 is Tree, not Owned"));
    drop(one);
    assert_eq!(r.counts().free, 8);
    drop(held);
}

#[test]
fn freeing_pages_in_another_state_frees_only_the_legal_ones_and_records_the_fault() {
    let p = pool(8, 1);
    let tree = p.try_alloc(2).unwrap().into_tree();
    let owned = p.try_alloc(1).unwrap();
    // The tree gives back its pages and, by mistake, a page a request holds.
    p.release_tree(&[tree[0], owned.pages()[0], tree[1]]);
    let counts = p.counts();
    assert_eq!((counts.free, counts.owned, counts.tree), (7, 1, 0));
    assert!(fault_of(&p).contains("page 2 is Owned, not Tree"));
    // A double free leaves the free list as it was (each page on it once).
    let twice = pool(8, 1);
    let freed = twice.try_alloc(1).unwrap().into_tree();
    twice.release_tree(&freed);
    twice.release_tree(&freed);
    assert_eq!(twice.shared.inner.lock().free, vec![0]);
    assert!(fault_of(&twice).contains("page 0 is Free, not Tree"));
    // Owned pages listed twice, dropped: the page is freed once.
    let listed = pool(8, 1);
    let page = listed.try_alloc(1).unwrap().into_caller()[0];
    drop(listed.claim_caller(&[page], "indices").map(|mut a| {
        a.pages.push(page);
        a
    }));
    assert_eq!(listed.shared.inner.lock().free, vec![0]);
    assert!(fault_of(&listed).contains("page 0 is Free, not Owned"));
    // Out of the books.
    let out = pool(8, 1);
    out.release_tree(&[99]);
    assert!(fault_of(&out).contains("page 99 (Tree to Free) was never handed out"));
    drop(owned);
}

#[test]
fn pinning_a_free_page_pins_nothing_and_records_the_fault() {
    let p = pool(8, 1);
    let tree = p.try_alloc(1).unwrap().into_tree();
    p.release_tree(&tree);
    p.pin(&[0, 5]);
    assert_eq!((p.pins(0), p.pins(5)), (0, 0));
    assert!(fault_of(&p).contains("page 0 is pinned but free"));
}

#[test]
fn an_unpin_without_a_pin_changes_nothing_and_records_the_fault() {
    let p = pool(8, 1);
    let tree = p.try_alloc(1).unwrap().into_tree();
    p.pin(&tree);
    p.release_tree(&tree);
    assert_eq!(p.state(0), Some(PageState::Draining));
    p.unpin(&tree);
    assert_eq!(p.state(0), Some(PageState::Free));
    assert!(p.fault().is_none(), "one pin, one unpin: legal");
    // The double unpin: before, `saturating_sub` let it pass in release builds.
    p.unpin(&tree);
    assert_eq!((p.state(0), p.pins(0)), (Some(PageState::Free), 0));
    assert_eq!(p.shared.inner.lock().free, vec![0], "freed once");
    assert!(fault_of(&p).contains("page 0 is unpinned more often than it was pinned"));
    // A page never handed out.
    let q = pool(8, 1);
    q.unpin(&[3]);
    assert!(fault_of(&q).contains("page 3 is unpinned"));
}

#[test]
fn appending_pages_of_another_pool_records_the_fault_and_leaves_them_to_their_pool() {
    let p = pool(8, 1);
    let other = pool(8, 1);
    let mut a = p.try_alloc(1).unwrap();
    a.append(other.try_alloc(2).unwrap());
    assert_eq!(a.pages(), &[0]);
    assert_eq!(other.counts().free, 8, "the other pool's pages went home");
    assert!(fault_of(&p).contains("page 0 of another pool"));
    drop(a);
    assert_eq!(p.counts().free, 8);
}

#[test]
fn a_free_list_holding_a_page_in_use_hands_out_nothing_and_records_the_fault() {
    let p = pool(8, 1);
    let held = p.try_alloc(1).unwrap();
    p.shared.inner.lock().free.push(held.pages()[0]);
    assert!(p.try_alloc(1).is_none());
    assert_eq!(p.counts().owned, 1);
    assert!(p.fault().unwrap().contains("page 0 is Owned, not Free"));
    std::mem::forget(held);
}

#[test]
fn the_pools_of_a_cache_share_one_fault_record_and_the_first_fault_is_kept() {
    let fault = Arc::<Fault>::default();
    let kv = Pool::with_fault("kv_slots", 8, 1, fault.clone(), PoolOwner::Cache).unwrap();
    let states = Pool::with_fault("mamba_slots", 8, 1, fault, PoolOwner::Cache).unwrap();
    states.unpin(&[1]);
    kv.unpin(&[2]);
    let why = kv.fault().unwrap();
    assert!(
        why.contains("illegal page transition in mamba_slots: page 1"),
        "{why}"
    );
    assert_eq!(states.fault(), Some(why));
}

fn engine_pool(slots: usize, ps: usize) -> Pool {
    Pool::with_fault("kv_slots", slots, ps, Arc::default(), PoolOwner::Engine).unwrap()
}

#[test]
fn an_engine_owned_pool_starts_as_the_engines_and_keeps_books_only_for_pages_claimed() {
    let p = engine_pool(u32::MAX as usize, 1);
    assert!(p.engine_owned());
    assert_eq!(p.counts().caller, u32::MAX as usize);
    assert_eq!(p.state(7), Some(PageState::Caller));
    // Claiming page 5 covers the books up to it; the pages below stay the engine's.
    let claimed = p.claim_caller(&[5], "kv_indices").unwrap();
    assert_eq!(p.shared.inner.lock().state.len(), 6);
    assert_eq!(
        (p.state(4), p.state(5)),
        (Some(PageState::Caller), Some(PageState::Owned))
    );
    assert!(
        p.try_alloc(1).is_none(),
        "nothing is free to allocate: the queue is empty"
    );
    drop(claimed);
    assert_eq!(
        p.state(5),
        Some(PageState::Free),
        "dropped: queued for the engine"
    );
    assert_eq!((p.counts().free, p.queued_len()), (1, 1));
    p.audit().unwrap();
}

#[test]
fn take_queued_hands_the_queue_from_a_mark_back_to_the_engine_once() {
    let p = engine_pool(16, 4);
    let tree = p
        .claim_caller(&[0, 1, 2], "kv_indices")
        .unwrap()
        .into_tree();
    p.release_tree(&tree[..1]);
    let mark = p.queued_len();
    p.release_tree(&tree[1..]);
    assert_eq!(
        p.take_queued(mark),
        vec![1, 2],
        "only what joined after the mark"
    );
    assert_eq!(p.take_queued(0), vec![0]);
    assert!(p.take_queued(0).is_empty());
    assert_eq!(p.counts().caller, 4);
    p.audit().unwrap();
}

#[test]
fn a_pinned_page_the_tree_gives_up_joins_the_queue_when_its_last_pin_goes() {
    let p = engine_pool(8, 1);
    let tree = p.claim_caller(&[3], "kv_indices").unwrap().into_tree();
    p.pin(&tree);
    p.release_tree(&tree);
    assert_eq!(p.state(3), Some(PageState::Draining));
    assert!(p.take_queued(0).is_empty(), "not queued while pinned");
    p.unpin(&tree);
    assert_eq!(p.take_queued(0), vec![3]);
    assert_eq!(p.state(3), Some(PageState::Caller));
    p.audit().unwrap();
}

#[test]
fn claiming_a_queued_or_tree_page_of_an_engine_pool_says_whose_it_is() {
    let p = engine_pool(16, 4);
    let tree = p.claim_caller(&[0, 1], "kv_indices").unwrap().into_tree();
    p.release_tree(&tree[1..]);
    let before = p.counts();
    let queued = p.claim_caller(&[2, 1], "kv_indices").unwrap_err();
    assert!(
        queued
            .to_string()
            .contains("page 1 (slots 4..8) is queued to go back to the engine"),
        "{queued}"
    );
    let in_tree = p.claim_caller(&[0], "kv_indices").unwrap_err();
    assert!(
        in_tree.to_string().contains("in the cache's tree"),
        "{in_tree}"
    );
    assert_eq!(p.counts(), before);
    assert_eq!(
        p.state(2),
        Some(PageState::Caller),
        "the claim was rolled back"
    );
    p.audit().unwrap();
}

#[test]
fn a_queue_holding_a_page_in_use_hands_back_nothing_and_records_the_fault() {
    let p = engine_pool(8, 1);
    let held = p.claim_caller(&[2], "kv_indices").unwrap();
    p.shared.inner.lock().free.push(2);
    assert!(p.take_queued(0).is_empty());
    assert_eq!(p.state(2), Some(PageState::Owned));
    assert!(p.fault().unwrap().contains("page 2 is Owned, not Free"));
    std::mem::forget(held);
}

#[test]
fn split_and_append_keep_ownership_exact() {
    let p = pool(8, 1);
    let mut a = p.try_alloc(6).unwrap();
    let b = a.split_off(2);
    assert_eq!((a.len(), b.len()), (2, 4));
    drop(b);
    assert_eq!(p.free_pages(), 6);
    let c = p.try_alloc(1).unwrap();
    a.append(c);
    assert_eq!(a.len(), 3);
    let tree = a.into_tree();
    assert_eq!(p.counts().tree, 3);
    p.release_tree(&tree);
    assert_eq!(p.free_pages(), 8);
}
