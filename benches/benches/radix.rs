//! Criterion benches of `match_prefix` and `insert` on trees of about 100k cached tokens
//! shaped like chat-serving traffic.
//!
//! Each tree is a full pool of 100k device KV slots after 2,000 requests of the seeded
//! stream in `radixcache_benches` (8 shared system prompts of 500-2000 tokens with
//! Zipf-like popularity, 16 interleaved multi-turn conversations whose prompt grows by the
//! previous answer and a new user message each turn, one request in eight an unrelated
//! one-off prompt), each served as an engine does (match, lock, `alloc_kv` of the
//! uncached rest with LRU eviction, `insert` with `owned_from = device_len`, unlock).
//! `radix/match/{len}` matches next-turn prompts of exactly `len` tokens (a conversation's
//! history, 70% of `len` or more still cached, then a new user message), round-robin over
//! 4 of them; `radix/match_miss/{len}` matches unrelated `len`-token prompts that share
//! nothing with the tree; `radix/insert/{len}` inserts a new request made of a cached
//! system prompt (round-robin over the 8) and `len` new tokens, after an untimed match,
//! lock and `alloc_kv` (which evicts, so the pool stays full and the tree keeps its size;
//! after a while it holds the system prompts and the latest inserted requests) and
//! followed by an untimed unlock: only the `insert` call is timed. The `_p16` variants run
//! the same on a tree with pages of 16 tokens. Reading the figures: criterion's `time` is
//! the time of one call (ns per op); `thrpt` is in tokens of the prompt per second
//! (`Throughput::Elements(len)`), so ns per token is `time / len`, or `1e9 / thrpt`. For
//! inserts `len` counts the new tokens only: the shared system prompt (walked, and its
//! slots checked against the tree's) adds a fixed cost per call on top.
//! `radix/insert_hashed{suffix}/{len}` is the same on the same trees built with page
//! hashes on: each new page's SHA-256 is computed by the timed insert.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_main, BenchmarkId, Criterion, Throughput};
use radixcache_benches::{prepare, release, serve_request, Built, Traffic};
use radixcache_core::{Cache, Config};

/// Prompt lengths measured.
const LENS: [usize; 3] = [512, 2048, 8192];

/// New-token lengths of the insert benches (4k: the page-hash goal's length).
const INSERT_LENS: [usize; 4] = [512, 2048, 4096, 8192];

/// Page sizes measured, with the suffix of their bench ids.
const PAGE_SIZES: [(usize, &str); 2] = [(1, ""), (16, "_p16")];

/// Seed of the traffic stream.
const SEED: u64 = 0x5eed_2024;

/// Prompts each match bench cycles through.
const QUERIES: usize = 4;

fn elements(len: usize) -> Throughput {
    Throughput::Elements(u64::try_from(len).unwrap_or(u64::MAX))
}

fn configure(
    criterion: &mut Criterion,
) -> criterion::BenchmarkGroup<'_, criterion::measurement::WallTime> {
    let mut group = criterion.benchmark_group("radix");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(400))
        .measurement_time(Duration::from_millis(1200));
    group
}

fn bench_match(criterion: &mut Criterion) {
    for (page_size, suffix) in PAGE_SIZES {
        let mut built = Built::new(page_size, SEED);
        let mut group = configure(criterion);
        for len in LENS {
            let queries = built.next_turn_prompts(len, QUERIES);
            assert_eq!(queries.len(), QUERIES, "too few cached conversations");
            group.throughput(elements(len));
            let cache = &mut built.cache;
            let mut next = 0;
            group.bench_function(BenchmarkId::new(format!("match{suffix}"), len), |bencher| {
                bencher.iter(|| {
                    next = (next + 1) % QUERIES;
                    cache.match_prefix(None, black_box(&queries[next]))
                });
            });
        }
        for len in LENS {
            let queries = built.miss_prompts(len, QUERIES);
            group.throughput(elements(len));
            let cache = &mut built.cache;
            let mut next = 0;
            group.bench_function(
                BenchmarkId::new(format!("match_miss{suffix}"), len),
                |bencher| {
                    bencher.iter(|| {
                        next = (next + 1) % QUERIES;
                        cache.match_prefix(None, black_box(&queries[next]))
                    });
                },
            );
        }
        group.finish();
    }
}

/// Times `iters` inserts of new `len`-token requests into `built`; each is prepared
/// (match, lock, `alloc_kv`, evicting as needed) and released (unlock) outside the timing.
fn timed_inserts(built: &mut Built, system: &mut usize, len: usize, iters: u64) -> Duration {
    let mut timed = Duration::ZERO;
    for _ in 0..iters {
        let tokens = built.new_request(*system, len);
        *system += 1;
        let request = prepare(&mut built.cache, &tokens, &[]);
        let start = Instant::now();
        let result = built.cache.insert(
            None,
            black_box(&request.tokens),
            black_box(&request.kv_indices),
            request.owned_from,
        );
        timed += start.elapsed();
        match result {
            Ok(insert) => {
                black_box(insert);
            }
            Err(e) => panic!("insert failed: {e}"),
        }
        release(&mut built.cache, request.lock);
    }
    timed
}

fn bench_insert(criterion: &mut Criterion) {
    for (page_size, suffix) in PAGE_SIZES {
        let mut group = configure(criterion);
        for (hashed, name) in [(false, "insert"), (true, "insert_hashed")] {
            for len in INSERT_LENS {
                // A fresh tree per length: each bench churns its own.
                let mut built = Built::hashed(page_size, SEED, hashed);
                let mut system = 0;
                group.throughput(elements(len));
                group.bench_function(
                    BenchmarkId::new(format!("{name}{suffix}"), len),
                    |bencher| {
                        bencher.iter_custom(|iters| {
                            timed_inserts(&mut built, &mut system, len, iters)
                        });
                    },
                );
            }
        }
        group.finish();
    }
}

/// One request's whole life on a hybrid cache (admit with its state copy acknowledged,
/// extend by the uncached prompt, extend by the answer, finish), per request of the
/// traffic stream; `radix/request{suffix}/stream`. After a warm-up of 500 requests, 64
/// requests are served round-robin, so after the first round their prompts are mostly
/// cached (the common case of a busy server). Throughput counts prompt tokens.
fn bench_request(criterion: &mut Criterion) {
    for (page_size, suffix) in PAGE_SIZES {
        let mut group = configure(criterion);
        let config = Config {
            mamba_slots: 64,
            ..Config::kv(100_000, page_size)
        };
        let Ok(mut cache) = Cache::new(config) else {
            panic!("bad bench configuration");
        };
        let mut traffic = Traffic::new(SEED);
        // Warm the cache up to steady state before measuring.
        for _ in 0..500 {
            let r = traffic.next_request();
            serve_request(&mut cache, &r.prompt, &r.answer);
        }
        let sample: Vec<_> = (0..64).map(|_| traffic.next_request()).collect();
        let tokens: usize = sample.iter().map(|r| r.prompt.len()).sum();
        group.throughput(elements(tokens / sample.len()));
        let mut next = 0;
        group.bench_function(
            BenchmarkId::new(format!("request{suffix}"), "stream"),
            |bencher| {
                bencher.iter(|| {
                    let r = &sample[next % sample.len()];
                    next += 1;
                    serve_request(&mut cache, black_box(&r.prompt), black_box(&r.answer));
                });
            },
        );
        group.finish();
    }
}

/// `criterion_group!` defines an undocumented `pub fn`; a private module keeps it out of
/// the `missing_docs` lint.
mod harness {
    criterion::criterion_group!(
        benches,
        super::bench_match,
        super::bench_insert,
        super::bench_request
    );
}

criterion_main!(harness::benches);
