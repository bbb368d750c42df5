//! Criterion benches of each cache operation against the size of the tree: 10k, 100k,
//! 1M and 10M cached tokens, at a fixed prompt length (`LEN` = 2,048 tokens).
//!
//! Each tree is a pool of that many device KV slots (page size 1) filled to its LRU
//! steady state by the seeded chat-serving stream of `radixcache_benches` (shared system
//! prompts, growing multi-turn conversations, one-off prompts): the stream is served until
//! it has fed twice the pool's size ([`Built::with_tokens`]). Ids are
//! `scale/{op}/{tree tokens}`; every figure is the time of one operation, so a flat row
//! across sizes means the cost does not grow with the tree (the path walked is the same
//! length at every size). The operations, each on a prompt of `LEN` tokens made of the
//! most popular system prompt and new tokens:
//!
//! * `match`: `match_prefix` (the system prompt is cached, the rest is not);
//! * `insert`: `insert` of a new request after an untimed match, lock and `alloc_kv`;
//! * `evict`: `evict` of `LEN` tokens (an untimed new request refills the pool);
//! * `lock_unlock`: `lock` then `unlock` of the node a cached prompt ends at;
//! * `alloc_free`: `alloc_kv(LEN)` (evicting, the pool being full) then `free_kv`;
//! * `request`: admit, extend by the uncached prompt, extend by 64 decoded tokens one at
//!   a time, finish (attention-only cache);
//! * `hybrid_request`: the same on a hybrid cache with a host tier (256 states, a host
//!   pool as large as the device's, write-through): admit with its state copy, extend,
//!   checkpoint half-way (the state fork), decode, finish, then every batch acknowledged
//!   (copy-on-write, backups; demotions happen in the evictions `extend` makes);
//! * `load_back_abort`, `load_back_commit`, `backup`, `evict_demote`: the host tier on
//!   the same hybrid cache (see `bench_host`).
//!
//! `RADIXCACHE_SCALE_MAX` (tokens) caps the sizes, e.g. `100000` for a quick run.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_main, BenchmarkId, Criterion};
use radixcache_benches::{admit_acked, complete_all, end_request, prepare, release, serve, Built};
use radixcache_core::{Cache, Config, LoadTarget, NodeId, WritePolicy};

/// Tree sizes measured (cached tokens).
const SIZES: [usize; 4] = [10_000, 100_000, 1_000_000, 10_000_000];

/// Prompt length of every operation.
const LEN: usize = 2048;

/// Decode steps of the request benches.
const DECODE: usize = 64;

/// Seed of the traffic stream.
const SEED: u64 = 0x5eed_2024;

fn sizes() -> Vec<usize> {
    let max = std::env::var("RADIXCACHE_SCALE_MAX")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(usize::MAX);
    SIZES.into_iter().filter(|&s| s <= max).collect()
}

fn configure(
    criterion: &mut Criterion,
) -> criterion::BenchmarkGroup<'_, criterion::measurement::WallTime> {
    let mut group = criterion.benchmark_group("scale");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    group
}

/// A fresh prompt of `LEN` tokens: the most popular system prompt, then new tokens.
fn prompt(built: &mut Built) -> Vec<u32> {
    let system = built.traffic.system_prompts()[0].len();
    built.new_request(0, LEN.saturating_sub(system))
}

/// Serves a new `LEN`-token request through the low-level path, acknowledging any
/// backup it emits (refills the pool after an eviction).
fn refill(built: &mut Built) {
    let q = prompt(built);
    serve(&mut built.cache, &q, &[]);
    complete_all(&mut built.cache);
}

/// Times `iters` evictions of `LEN` tokens, each followed by an untimed [`refill`].
fn timed_evictions(built: &mut Built, iters: u64) -> Duration {
    let mut timed = Duration::ZERO;
    for _ in 0..iters {
        let start = Instant::now();
        black_box(built.cache.evict(LEN, 0));
        timed += start.elapsed();
        refill(built);
    }
    timed
}

fn bench_attention(criterion: &mut Criterion) {
    let mut group = configure(criterion);
    for size in sizes() {
        let mut built = Built::with_tokens(size, &Config::default(), SEED);
        let queries: Vec<Vec<u32>> = (0..4).map(|_| prompt(&mut built)).collect();
        let mut next = 0;
        group.bench_function(BenchmarkId::new("match", size), |b| {
            b.iter(|| {
                let q = &queries[next % queries.len()];
                next += 1;
                black_box(built.cache.match_prefix(None, black_box(q)));
            });
        });
        group.bench_function(BenchmarkId::new("insert", size), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let q = prompt(&mut built);
                    let p = prepare(&mut built.cache, &q, &[]);
                    let start = Instant::now();
                    let r = built
                        .cache
                        .insert(None, &p.tokens, &p.kv_indices, p.owned_from);
                    timed += start.elapsed();
                    if let Err(e) = r {
                        panic!("insert failed: {e}");
                    }
                    release(&mut built.cache, p.lock);
                }
                timed
            });
        });
        group.bench_function(BenchmarkId::new("evict", size), |b| {
            b.iter_custom(|iters| timed_evictions(&mut built, iters));
        });
        let cached = queries[0].clone();
        group.bench_function(BenchmarkId::new("lock_unlock", size), |b| {
            let node = built.cache.match_prefix(None, &cached).node;
            b.iter(|| {
                let Ok(lock) = built.cache.lock(black_box(node)) else {
                    panic!("lock failed");
                };
                release(&mut built.cache, lock);
            });
        });
        group.bench_function(BenchmarkId::new("alloc_free", size), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let start = Instant::now();
                    let Ok(Some(slots)) = built.cache.alloc_kv(LEN) else {
                        panic!("alloc_kv failed");
                    };
                    let freed = built.cache.free_kv(black_box(&slots));
                    timed += start.elapsed();
                    assert!(freed.is_ok(), "free_kv failed");
                    refill(&mut built);
                }
                timed
            });
        });
        group.bench_function(BenchmarkId::new("request", size), |b| {
            b.iter_custom(|iters| timed_requests(&mut built, iters, false));
        });
    }
    group.finish();
}

fn bench_hybrid(criterion: &mut Criterion) {
    let mut group = configure(criterion);
    for size in sizes() {
        let config = Config {
            mamba_slots: 256,
            host_kv_slots: size,
            host_mamba_slots: 256,
            write_policy: WritePolicy::WriteThrough,
            ..Config::default()
        };
        let mut built = Built::with_tokens(size, &config, SEED);
        group.bench_function(BenchmarkId::new("hybrid_request", size), |b| {
            b.iter_custom(|iters| timed_requests(&mut built, iters, true));
        });
    }
    group.finish();
}

/// The host tier at scale: an attention-only cache whose host pool is as large as the
/// device's, write-through (every cached node is backed up), filled like the others so
/// that the nodes evicted while filling it were demoted to the host. (Attention-only so
/// that every load moves the same [`LOAD`] tokens: a hybrid host match stops at nodes
/// with a state. The hybrid host path is in `hybrid_request`.)
///
/// * `load_back_abort`: `load_back` of [`LOAD`] host-only tokens (a conversation whose
///   history was demoted), then the guard called off (`cancel_load`): the cost of a
///   load-back the engine refuses;
/// * `load_back_commit`: `load_back`, `commit_load`, and the batch started and completed:
///   a load-back that lands (each takes a different prefix; when they run out, an
///   untimed eviction of a tenth of the device demotes more);
/// * `backup`: acknowledging (start, complete) the backup batch the insert of a new
///   request emitted (the request itself is served untimed);
/// * `evict_demote`: `evict` of `LEN` tokens, whose nodes are demoted to the host
///   (an untimed request refills the device).
fn bench_host(criterion: &mut Criterion) {
    let mut group = configure(criterion);
    for size in sizes() {
        let config = Config {
            host_kv_slots: size,
            write_policy: WritePolicy::WriteThrough,
            ..Config::default()
        };
        let mut built = Built::with_tokens(size, &config, SEED);
        let mut targets = host_targets(&mut built, size);
        let fixed = targets.clone();
        let mut next = 0;
        group.bench_function(BenchmarkId::new("load_back_abort", size), |b| {
            b.iter(|| {
                let node = fixed[next % fixed.len()];
                next += 1;
                let Ok(Some(record)) = built.cache.load_back(LoadTarget::Node(node), None, None)
                else {
                    panic!("nothing to load at a host-only prefix");
                };
                built.cache.cancel_load(black_box(record));
            });
        });
        group.bench_function(BenchmarkId::new("load_back_commit", size), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let node = loop {
                        if let Some(n) = targets.pop() {
                            break n;
                        }
                        targets = host_targets(&mut built, size);
                    };
                    let start = Instant::now();
                    if let Ok(Some(record)) =
                        built.cache.load_back(LoadTarget::Node(node), None, None)
                    {
                        let id = record.id();
                        let ok = built.cache.commit_load(record).is_ok()
                            && built.cache.start(id).is_ok()
                            && built.cache.complete(id).is_ok();
                        assert!(ok, "a load-back could not land");
                    }
                    timed += start.elapsed();
                }
                timed
            });
        });
        group.bench_function(BenchmarkId::new("backup", size), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let q = prompt(&mut built);
                    serve(&mut built.cache, &q, &[]);
                    let start = Instant::now();
                    complete_all(&mut built.cache);
                    timed += start.elapsed();
                }
                timed
            });
        });
        group.bench_function(BenchmarkId::new("evict_demote", size), |b| {
            b.iter_custom(|iters| timed_evictions(&mut built, iters));
        });
    }
    group.finish();
}

/// Host-only prefixes to load back: the conversations' histories that are (partly) only
/// on the host; when there are none, a tenth of the device is evicted (demoted) and they
/// are looked for again.
///
/// # Panics
///
/// When ten such rounds find none.
fn host_targets(built: &mut Built, size: usize) -> Vec<NodeId> {
    for _ in 0..10 {
        let found = host_only(built);
        if !found.is_empty() {
            return found;
        }
        built.cache.evict(size / 10, 0);
        complete_all(&mut built.cache);
    }
    panic!("no host-only prefix to load back");
}

/// Tokens each load-back bench loads from the host.
const LOAD: usize = 512;

/// Nodes whose path ends with exactly [`LOAD`] host-only tokens, from the
/// conversations' histories that are partly only on the host (the match that finds one
/// splits the node there, as a request's would).
fn host_only(built: &mut Built) -> Vec<NodeId> {
    let histories: Vec<Vec<u32>> = built
        .traffic
        .histories()
        .iter()
        .map(|h| h.1.clone())
        .collect();
    histories
        .iter()
        .filter_map(|h| {
            let m = built.cache.match_prefix(None, h);
            if m.host_len < LOAD {
                return None;
            }
            let cut = built.cache.match_prefix(None, &h[..m.device_len + LOAD]);
            (cut.host_len == LOAD).then_some(cut.host_node)
        })
        .collect()
}

/// Times `iters` requests of `LEN` prompt tokens through the request API: admit, extend
/// by the uncached prompt (checkpointing half-way when `checkpoint`), decode `DECODE`
/// tokens one by one, finish; every batch is acknowledged (and timed) as it comes.
fn timed_requests(built: &mut Built, iters: u64, checkpoint: bool) -> Duration {
    let mut timed = Duration::ZERO;
    for _ in 0..iters {
        let q = prompt(built);
        let answer: Vec<u32> = built.traffic.rng().tokens(DECODE);
        let start = Instant::now();
        serve_timed(&mut built.cache, &q, &answer, checkpoint);
        timed += start.elapsed();
    }
    timed
}

fn serve_timed(cache: &mut Cache, prompt: &[u32], answer: &[u32], checkpoint: bool) {
    let (id, prefix_len) = admit_acked(cache, prompt);
    let rest = &prompt[prefix_len..];
    let (first, second) = rest.split_at(if checkpoint { rest.len() / 2 } else { 0 });
    let mut ok = first.is_empty() || matches!(cache.extend(id, first), Ok(Some(_)));
    if ok && checkpoint && !first.is_empty() {
        ok = cache.checkpoint(id).is_ok();
        complete_all(cache);
    }
    ok = ok && matches!(cache.extend(id, second), Ok(Some(_)));
    for t in answer {
        ok = ok && matches!(cache.extend(id, std::slice::from_ref(t)), Ok(Some(_)));
    }
    end_request(cache, id, ok);
}

/// `criterion_group!` defines an undocumented `pub fn`; a private module keeps it out of
/// the `missing_docs` lint.
mod harness {
    criterion::criterion_group!(
        benches,
        super::bench_attention,
        super::bench_hybrid,
        super::bench_host
    );
}

criterion_main!(harness::benches);
