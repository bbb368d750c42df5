//! Workload generators shared by the criterion benches (see `benches/radix.rs`).
//!
//! [`Traffic`] is a deterministic (seeded) stream of chat-serving requests: a handful of
//! shared system prompts, multi-turn conversations whose prompt grows turn by turn
//! (turn k's prompt is turn k-1's prompt, its answer and a new user message, framed by
//! chat-template header tokens), and unrelated one-off prompts. [`Built::new`] replays
//! that stream into a [`Cache`] exactly as a serving engine would ([`serve`]: match,
//! lock the matched path, allocate the uncached rest, insert the prompt and its answer
//! with `owned_from = device_len`, unlock) for [`WARMUP_REQUESTS`] requests, into a pool
//! of [`TARGET_TOKENS`] slots: the tree ends full (about 100k tokens), in the LRU steady
//! state that eviction keeps it in.
//!
//! Everything is derived from a seed with a small `SplitMix64`, so two runs build the
//! same tree and the benches measure the same operations.

use radixcache_core::{Cache, Config, LockReceipt, RequestId};

/// Device KV slots of the built caches: a full pool holds about this many tokens.
pub const TARGET_TOKENS: usize = 100_000;

/// Requests served to build a cache: enough to fill the pool about 13 times over, so the
/// tree is an LRU steady state of the traffic, not its first minutes.
pub const WARMUP_REQUESTS: usize = 2_000;

/// Vocabulary size (Llama 3's).
pub const VOCAB: u32 = 128_256;

/// Number of shared system prompts.
pub const SYSTEM_PROMPTS: usize = 8;

/// Chat-template tokens opening every user message (`<|start_header_id|>user<|end_header_id|>\n\n`).
pub const USER_HEADER: [u32; 4] = [128_006, 882, 128_007, 271];

/// Chat-template tokens opening every answer.
pub const ASSISTANT_HEADER: [u32; 4] = [128_006, 78_191, 128_007, 271];

/// End-of-turn token closing every message and answer.
pub const EOT: u32 = 128_009;

/// `SplitMix64`: a tiny, fast, well-mixed deterministic generator.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`), by multiply-shift (bias below 2^-32).
    pub fn below(&mut self, n: u32) -> u32 {
        let wide = (self.next_u64() >> 32) * u64::from(n);
        // `wide >> 32 < n`, so it fits.
        #[allow(clippy::cast_possible_truncation)]
        let r = (wide >> 32) as u32;
        r
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        let span = u32::try_from(hi - lo + 1).unwrap_or(u32::MAX);
        lo + self.below(span) as usize
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u32, den: u32) -> bool {
        self.below(den) < num
    }

    /// `n` uniformly random token ids below [`VOCAB`] (ordinary text tokens).
    pub fn tokens(&mut self, n: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(n);
        self.push_tokens(&mut out, n);
        out
    }

    /// Appends `n` random token ids to `out`.
    pub fn push_tokens(&mut self, out: &mut Vec<u32>, n: usize) {
        // Text tokens only: the ids above 128_000 are the template's special tokens.
        out.extend((0..n).map(|_| self.below(128_000)));
    }
}

/// One request of the stream: the prompt the engine receives and the answer it
/// generates (inserted together when the request finishes).
#[derive(Debug, Clone)]
pub struct Request {
    /// Prompt tokens (what `match_prefix` sees).
    pub prompt: Vec<u32>,
    /// Generated tokens, appended to the prompt by the insert at the end of the request.
    pub answer: Vec<u32>,
    /// The conversation the request is a turn of (`None` for a one-off prompt).
    pub conversation: Option<usize>,
}

#[derive(Debug)]
struct Conversation {
    id: usize,
    turns_left: usize,
}

/// A deterministic stream of chat-serving requests.
///
/// * [`SYSTEM_PROMPTS`] system prompts of 500-2000 tokens, picked with Zipf-like
///   popularity (prompt `i` with weight `1 / (i + 1)`).
/// * Conversations of 1-16 turns, 16 of them interleaved at any time. A turn's prompt is
///   the previous turn's prompt and answer plus a new user message of 20-400 tokens (the
///   first message: 20-800); answers are 50-800 tokens.
/// * One request in eight is an unrelated one-off prompt of 100-3000 tokens.
#[derive(Debug)]
pub struct Traffic {
    rng: SplitMix64,
    system_prompts: Vec<Vec<u32>>,
    active: Vec<Conversation>,
    /// Per conversation: its system prompt and the tokens cached after its last finished
    /// turn (its last prompt and answer).
    histories: Vec<(usize, Vec<u32>)>,
}

impl Traffic {
    /// Conversations in flight at any time.
    pub const CONCURRENT: usize = 16;

    /// The stream for `seed`.
    pub fn new(seed: u64) -> Traffic {
        let mut rng = SplitMix64::new(seed);
        let system_prompts = (0..SYSTEM_PROMPTS)
            .map(|_| {
                let n = rng.range(500, 2000);
                rng.tokens(n)
            })
            .collect();
        Traffic {
            rng,
            system_prompts,
            active: Vec::new(),
            histories: Vec::new(),
        }
    }

    /// The shared system prompts, most popular first.
    pub fn system_prompts(&self) -> &[Vec<u32>] {
        &self.system_prompts
    }

    /// Per conversation: the index of its system prompt and its history (the tokens a
    /// finished turn cached: that turn's prompt and answer).
    pub fn histories(&self) -> &[(usize, Vec<u32>)] {
        &self.histories
    }

    /// The random source, for callers that need more tokens from the same seed.
    pub fn rng(&mut self) -> &mut SplitMix64 {
        &mut self.rng
    }

    fn pick_system_prompt(&mut self) -> usize {
        // Weights 1/(i+1), scaled to integers: 840 is divisible by 1..=8.
        let weights: Vec<u32> = (1..=8u32).map(|i| 840 / i).collect();
        let total: u32 = weights.iter().sum();
        let mut r = self.rng.below(total);
        for (i, &w) in weights.iter().enumerate() {
            if r < w {
                return i;
            }
            r -= w;
        }
        SYSTEM_PROMPTS - 1
    }

    fn user_message(&mut self, out: &mut Vec<u32>, lo: usize, hi: usize) {
        out.extend_from_slice(&USER_HEADER);
        let n = self.rng.range(lo, hi);
        self.rng.push_tokens(out, n);
        out.push(EOT);
    }

    fn answer(&mut self) -> Vec<u32> {
        let mut a = ASSISTANT_HEADER.to_vec();
        let n = self.rng.range(50, 800);
        self.rng.push_tokens(&mut a, n);
        a.push(EOT);
        a
    }

    /// The next request. Its answer is recorded as the conversation's history at once
    /// (the stream assumes each request finishes before the next one is drawn).
    pub fn next_request(&mut self) -> Request {
        if self.rng.chance(1, 8) {
            let n = self.rng.range(100, 3000);
            let prompt = self.rng.tokens(n);
            let answer = self.answer();
            return Request {
                prompt,
                answer,
                conversation: None,
            };
        }
        if self.active.len() < Self::CONCURRENT {
            let sp = self.pick_system_prompt();
            let mut prompt = self.system_prompts[sp].clone();
            self.user_message(&mut prompt, 20, 800);
            let answer = self.answer();
            let id = self.histories.len();
            let mut history = prompt.clone();
            history.extend_from_slice(&answer);
            self.histories.push((sp, history));
            let turns_left = self.rng.range(0, 15);
            if turns_left > 0 {
                self.active.push(Conversation { id, turns_left });
            }
            return Request {
                prompt,
                answer,
                conversation: Some(id),
            };
        }
        let k = self
            .rng
            .below(u32::try_from(self.active.len()).unwrap_or(u32::MAX)) as usize;
        let id = self.active[k].id;
        let mut prompt = std::mem::take(&mut self.histories[id].1);
        self.user_message(&mut prompt, 20, 400);
        let answer = self.answer();
        let mut history = prompt.clone();
        history.extend_from_slice(&answer);
        self.histories[id].1 = history;
        self.active[k].turns_left -= 1;
        if self.active[k].turns_left == 0 {
            self.active.swap_remove(k);
        }
        Request {
            prompt,
            answer,
            conversation: Some(id),
        }
    }
}

/// Slots a serving engine allocates for `n` uncached tokens: whole pages.
pub fn pages_for(n: usize, page_size: usize) -> usize {
    n.div_ceil(page_size) * page_size
}

/// A request matched, locked and given slots, ready for the insert that finishes it.
#[derive(Debug)]
pub struct Prepared {
    /// Tokens to insert (prompt and answer).
    pub tokens: Vec<u32>,
    /// One slot per token: the tree's slots of the matched prefix, then the fresh ones.
    pub kv_indices: Vec<i64>,
    /// Tokens the tree already had at match time (`Match::device_len`).
    pub owned_from: usize,
    /// The lock taken on the matched path, released once the insert is done.
    pub lock: LockReceipt,
}

/// The first half of [`serve`]: match `prompt`, lock the matched path, allocate slots for
/// the uncached rest of `prompt ++ answer` (evicting when the pool is short).
///
/// # Panics
///
/// When the cache refuses a call: the pool cannot hold the request even after evicting
/// everything evictable, or a core API rejects what an engine legitimately passes.
pub fn prepare(cache: &mut Cache, prompt: &[u32], answer: &[u32]) -> Prepared {
    let m = cache.match_prefix(None, prompt);
    let lock = match cache.lock(m.node) {
        Ok(l) => l,
        Err(e) => panic!("lock of a just-matched node failed: {e}"),
    };
    let mut tokens = Vec::with_capacity(prompt.len() + answer.len());
    tokens.extend_from_slice(prompt);
    tokens.extend_from_slice(answer);
    let rest = tokens.len() - m.device_len;
    let fresh = match cache.alloc_kv(pages_for(rest, cache.page_size())) {
        Ok(Some(s)) => s,
        Ok(None) => panic!("pool too small: cannot allocate {rest} slots (cache: {cache:?})"),
        Err(e) => panic!("alloc_kv rejected a page-aligned request: {e}"),
    };
    let mut kv_indices = m.kv_indices;
    kv_indices.extend_from_slice(&fresh[..rest]);
    Prepared {
        tokens,
        kv_indices,
        owned_from: m.device_len,
        lock,
    }
}

/// The second half of [`serve`]: release the lock taken by [`prepare`].
///
/// # Panics
///
/// When the receipt was already released (a bug in the caller).
pub fn release(cache: &mut Cache, lock: LockReceipt) {
    if let Err(e) = cache.unlock(lock) {
        panic!("unlock failed: {e}");
    }
}

/// Serves one request as an engine does: match the prompt, lock the matched path,
/// allocate the uncached rest (prompt and answer), insert everything with
/// `owned_from = device_len` (the tree takes the fresh slots), unlock.
///
/// # Panics
///
/// When the cache refuses a call (see [`prepare`]).
pub fn serve(cache: &mut Cache, prompt: &[u32], answer: &[u32]) {
    let p = prepare(cache, prompt, answer);
    if let Err(e) = cache.insert(None, &p.tokens, &p.kv_indices, p.owned_from) {
        panic!("insert failed: {e}");
    }
    release(cache, p.lock);
}

/// A cache of [`TARGET_TOKENS`] slots in LRU steady state under [`Traffic`], and that
/// traffic.
#[derive(Debug)]
pub struct Built {
    /// The cache (full: about [`TARGET_TOKENS`] tokens cached).
    pub cache: Cache,
    /// The stream that filled it, positioned after the last request served.
    pub traffic: Traffic,
}

impl Built {
    /// Builds the cache for `page_size` by serving [`WARMUP_REQUESTS`] requests of the
    /// stream of `seed` (allocations evict least recently used leaves once the pool is
    /// full, as in a server).
    ///
    /// # Panics
    ///
    /// When the cache cannot be created or refuses a request (see [`serve`]).
    pub fn new(page_size: usize, seed: u64) -> Built {
        Built::hashed(page_size, seed, false)
    }

    /// [`Built::new`], with page hashes on or off (`page_hashes`): the same tree, each
    /// page also carrying its chained SHA-256.
    ///
    /// # Panics
    ///
    /// As [`Built::new`].
    pub fn hashed(page_size: usize, seed: u64, page_hashes: bool) -> Built {
        let slots = pages_for(TARGET_TOKENS, page_size);
        let config = Config {
            page_hashes,
            ..Config::kv(slots, page_size)
        };
        let mut cache = match Cache::new(config) {
            Ok(c) => c,
            Err(e) => panic!("bad bench configuration: {e}"),
        };
        let mut traffic = Traffic::new(seed);
        for _ in 0..WARMUP_REQUESTS {
            let r = traffic.next_request();
            serve(&mut cache, &r.prompt, &r.answer);
        }
        Built { cache, traffic }
    }

    /// Builds a cache of `tokens` device KV slots (page size 1) in LRU steady state: the
    /// stream of `seed` is served until the pool has been filled, then as much again
    /// (allocations evict least recently used leaves, as in a server). `config` gives the
    /// rest of the cache's configuration; requests go through [`serve`] (the low-level
    /// path) when `config` has no states, through [`serve_request`] otherwise.
    ///
    /// # Panics
    ///
    /// When the cache cannot be created or refuses a request.
    pub fn with_tokens(tokens: usize, config: &Config, seed: u64) -> Built {
        let config = Config {
            kv_slots: tokens,
            page_size: 1,
            ..config.clone()
        };
        let hybrid = config.mamba_slots > 0;
        let mut cache = match Cache::new(config) {
            Ok(c) => c,
            Err(e) => panic!("bad bench configuration: {e}"),
        };
        let mut traffic = Traffic::new(seed);
        let mut fed = 0;
        while fed < 2 * tokens {
            let r = traffic.next_request();
            fed += r.prompt.len() + r.answer.len();
            if hybrid {
                serve_request(&mut cache, &r.prompt, &r.answer);
            } else {
                serve(&mut cache, &r.prompt, &r.answer);
                complete_all(&mut cache); // backups, with a host tier
            }
        }
        Built { cache, traffic }
    }

    /// How many of the first `n` tokens of `tokens` are cached on the device (a match: it
    /// refreshes their LRU position and may split the node where they end).
    fn cached(&mut self, tokens: &[u32], n: usize) -> usize {
        self.cache.match_prefix(None, &tokens[..n]).device_len
    }

    /// Up to `count` next-turn prompts of exactly `len` tokens, mostly cached: the
    /// history of a conversation (longest first, of which 70% of `len` or more is still
    /// cached) followed by a new user message filling the rest. Falls back to longer histories cut short (an edited
    /// or regenerated turn; the first match of such a prompt splits a node) when too few
    /// conversations fit. Deterministic.
    pub fn next_turn_prompts(&mut self, len: usize, count: usize) -> Vec<Vec<u32>> {
        let min = len * 7 / 10;
        // The cached part leaves room for at least a short user message after it.
        let max = len.saturating_sub(USER_HEADER.len() + 16);
        let mut fits: Vec<Vec<u32>> = Vec::new();
        let mut longer: Vec<Vec<u32>> = Vec::new();
        for (_, h) in &self.traffic.histories {
            if (min..=max).contains(&h.len()) {
                fits.push(h.clone());
            } else if h.len() > max {
                longer.push(h.clone());
            }
        }
        fits.sort_by_key(|h| std::cmp::Reverse(h.len()));
        longer.sort_by_key(Vec::len);
        let mut out = Vec::with_capacity(count);
        for h in fits.into_iter().chain(longer) {
            if out.len() == count {
                break;
            }
            let keep = h.len().min(max);
            if self.cached(&h, keep) < min {
                continue;
            }
            let mut q = h;
            q.truncate(keep);
            q.extend_from_slice(&USER_HEADER);
            let n = len - q.len();
            self.traffic.rng.push_tokens(&mut q, n);
            out.push(q);
        }
        out
    }

    /// `count` unrelated prompts of `len` tokens sharing nothing with the tree (checked:
    /// a candidate whose first page happens to be cached is drawn again).
    pub fn miss_prompts(&mut self, len: usize, count: usize) -> Vec<Vec<u32>> {
        let mut out = Vec::with_capacity(count);
        while out.len() < count {
            let q = self.traffic.rng.tokens(len);
            if self.cache.match_prefix(None, &q).device_len == 0 {
                out.push(q);
            }
        }
        out
    }

    /// A new request sharing system prompt `system` (modulo [`SYSTEM_PROMPTS`]): that
    /// prompt followed by `len` new tokens (a user message, starting with the template's
    /// user header).
    pub fn new_request(&mut self, system: usize, len: usize) -> Vec<u32> {
        let mut q = self.traffic.system_prompts[system % SYSTEM_PROMPTS].clone();
        q.extend_from_slice(&USER_HEADER);
        let n = len.saturating_sub(USER_HEADER.len());
        self.traffic.rng.push_tokens(&mut q, n);
        q
    }

    /// Nodes in the tree (from the cache's stats).
    pub fn nodes(&self) -> u64 {
        stat(&self.cache, "nodes")
    }
}

/// Serves one request through the request API: admit (its state copy acknowledged),
/// extend by the uncached prompt and by the answer, finish, then complete every batch the
/// cache emitted (copies, backups); a request that cannot get slots is aborted.
///
/// # Panics
///
/// When the cache refuses a call an engine legitimately makes.
pub fn serve_request(cache: &mut Cache, prompt: &[u32], answer: &[u32]) {
    let (id, prefix_len) = admit_acked(cache, prompt);
    let ok = matches!(cache.extend(id, &prompt[prefix_len..]), Ok(Some(_)))
        && matches!(cache.extend(id, answer), Ok(Some(_)));
    end_request(cache, id, ok);
}

/// Admits `prompt` and acknowledges its state copy; returns the request and its reused
/// prefix length.
///
/// # Panics
///
/// When the admission is refused.
pub fn admit_acked(cache: &mut Cache, prompt: &[u32]) -> (RequestId, usize) {
    let Ok(Some(id)) = cache.admit(None, prompt) else {
        panic!("admission refused");
    };
    complete_all(cache);
    let Ok(view) = cache.request(id) else {
        panic!("request vanished");
    };
    (id, view.prefix_len)
}

/// Finishes request `id` (`ok`) or aborts it (it could not get slots), then
/// acknowledges every batch that emitted.
///
/// # Panics
///
/// When the request cannot end.
pub fn end_request(cache: &mut Cache, id: RequestId, ok: bool) {
    let done = if ok {
        cache.finish(id)
    } else {
        cache.abort(id)
    };
    assert!(done.is_ok(), "request could not end");
    complete_all(cache);
}

/// Starts and completes every batch the cache has emitted (an engine whose copies
/// always succeed at once).
///
/// # Panics
///
/// When the cache refuses to start or complete a batch it emitted.
pub fn complete_all(cache: &mut Cache) {
    for b in cache.take_batches() {
        let ok = cache.start(b.id).is_ok() && cache.complete(b.id).is_ok();
        assert!(ok, "batch {} could not be acknowledged", b.id);
    }
}

/// A named counter of [`Cache::stats`] (0 if absent).
pub fn stat(cache: &Cache, name: &str) -> u64 {
    cache
        .stats()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map_or(0, |(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_the_intended_tree_and_its_queries_hit() {
        for ps in [1, 16] {
            let mut b = Built::new(ps, 7);
            let total = b.cache.total_size();
            assert!(
                (TARGET_TOKENS * 95 / 100..=TARGET_TOKENS).contains(&total),
                "page size {ps}: {total} tokens cached"
            );
            b.cache.audit().unwrap();
            assert!(
                stat(&b.cache, "evicted_kv_tokens") > 0,
                "the tree is in steady state"
            );
            assert!(b.nodes() > 50, "a real tree: {} nodes", b.nodes());
            for len in [512, 2048, 8192] {
                let qs = b.next_turn_prompts(len, 4);
                assert_eq!(qs.len(), 4, "page size {ps}, len {len}");
                for q in &qs {
                    assert_eq!(q.len(), len);
                    let m = b.cache.match_prefix(None, q);
                    assert!(
                        m.device_len >= len * 6 / 10 && m.device_len < len,
                        "page size {ps}, len {len}: {} cached",
                        m.device_len
                    );
                }
                for q in b.miss_prompts(len, 4) {
                    assert_eq!(b.cache.match_prefix(None, &q).device_len, 0);
                }
                let shared = b.traffic.system_prompts()[0].len();
                let req = b.new_request(0, len);
                assert_eq!(req.len(), shared + len);
                // The most popular system prompt stays cached.
                let m = b.cache.match_prefix(None, &req);
                assert!(m.device_len >= shared / ps * ps, "system prompt evicted");
            }
            b.cache.audit().unwrap();
        }
    }

    #[test]
    fn the_stream_is_deterministic() {
        let mut a = Traffic::new(3);
        let mut b = Traffic::new(3);
        for _ in 0..50 {
            let (x, y) = (a.next_request(), b.next_request());
            assert_eq!(x.prompt, y.prompt);
            assert_eq!(x.answer, y.answer);
        }
    }
}
