//! Page hashes: one SHA-256 per full page, chained from the page before it.
//!
//! `H_i = sha256(H_{i-1} ‖ page i's tokens as u32 little-endian)`, 32 bytes. The first
//! page's prior `H_{-1}` is its namespace's seed ([`namespace_seed`]); with no seed the
//! first page is hashed with no prior at all. In the default namespace without a
//! `hash_seed` the chain is byte for byte `SGLang` `HiCache`'s (`get_hash_str` with no
//! namespace), and a named namespace without a `hash_seed` is seeded as `SGLang` seeds a
//! request's `extra_key` (`storage_namespace_seed(extra_key=name, cache_salt=None)`), so
//! that a store or a router can be shared with `SGLang` servers (docs/design.md, "Page
//! hashes").

use sha2::{Digest, Sha256};

/// One page's hash.
pub type PageHash = [u8; 32];

/// The version tag of `SGLang`'s namespace seed (`storage_namespace_seed`).
const SGLANG_NAMESPACE_TAG: &[u8] = b"sglang-cache-namespace-v1";

/// The version tag of a namespace seed derived from a `hash_seed`.
const SEEDED_NAMESPACE_TAG: &[u8] = b"radixcache-namespace-v1";

/// Tokens converted to bytes at a time (a stack buffer of 1 KiB).
const CHUNK: usize = 256;

/// The prior of the first page of `namespace` (`None`: the default namespace), given
/// the cache's `hash_seed`:
///
/// * default namespace: `hash_seed` itself (`None`: no prior);
/// * a named namespace without `hash_seed`: `sha256(b"sglang-cache-namespace-v1" ‖ 0x01
///   ‖ u64 LE byte length of the name ‖ the name in UTF-8 ‖ 0x00)` (`SGLang`'s seed of an
///   `extra_key` without a cache salt);
/// * a named namespace with `hash_seed`: `sha256(b"radixcache-namespace-v1" ‖
///   hash_seed ‖ u64 LE byte length of the name ‖ the name in UTF-8)`.
pub fn namespace_seed(hash_seed: Option<&PageHash>, namespace: Option<&str>) -> Option<PageHash> {
    let Some(name) = namespace else {
        return hash_seed.copied();
    };
    let len = (name.len() as u64).to_le_bytes();
    let mut h = Sha256::new();
    match hash_seed {
        None => {
            h.update(SGLANG_NAMESPACE_TAG);
            h.update([1u8]);
            h.update(len);
            h.update(name.as_bytes());
            h.update([0u8]);
        }
        Some(seed) => {
            h.update(SEEDED_NAMESPACE_TAG);
            h.update(seed);
            h.update(len);
            h.update(name.as_bytes());
        }
    }
    Some(h.finalize().into())
}

/// Appends to `out` the hashes of the whole pages of `tokens` (pages of `page_size`;
/// an unaligned tail is not hashed), chained from `prior` (`None`: the first page has
/// no prior).
pub fn chain_into(
    prior: Option<&PageHash>,
    tokens: &[u32],
    page_size: usize,
    out: &mut Vec<PageHash>,
) {
    if page_size == 0 {
        return;
    }
    out.reserve(tokens.len() / page_size);
    let mut prior = prior.copied();
    let mut bytes = [0u8; CHUNK * 4];
    for page in tokens.chunks_exact(page_size) {
        let mut h = Sha256::new();
        if let Some(p) = &prior {
            h.update(p);
        }
        for chunk in page.chunks(CHUNK) {
            for (dst, &t) in bytes.chunks_exact_mut(4).zip(chunk) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            h.update(&bytes[..chunk.len() * 4]);
        }
        let digest: PageHash = h.finalize().into();
        out.push(digest);
        prior = Some(digest);
    }
}

/// The hashes of the whole pages of `tokens`, chained from `prior` (see
/// [`chain_into`]).
pub fn chain(prior: Option<&PageHash>, tokens: &[u32], page_size: usize) -> Vec<PageHash> {
    let mut out = Vec::new();
    chain_into(prior, tokens, page_size, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hex of a digest (tests compare against digests written out by hand).
    fn hex(h: &PageHash) -> String {
        use std::fmt::Write;
        h.iter().fold(String::new(), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
    }

    /// `sha256(bytes)` through the crate, independently of the chain's code.
    fn sha(bytes: &[u8]) -> PageHash {
        Sha256::digest(bytes).into()
    }

    fn le(tokens: &[u32]) -> Vec<u8> {
        tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    #[test]
    fn sha256_of_the_empty_string_is_the_standard_vector() {
        // FIPS 180-2 test vector: the SHA-256 in use is the real one.
        assert_eq!(
            hex(&sha(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex(&sha(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn the_first_page_without_a_prior_hashes_its_tokens_alone() {
        // SGLang's chain with no namespace: sha256 of the page's u32 LE bytes.
        let h = chain(None, &[1, 2, 3, 4], 2);
        assert_eq!(h.len(), 2);
        assert_eq!(h[0], sha(&[1, 0, 0, 0, 2, 0, 0, 0]));
        let mut second = h[0].to_vec();
        second.extend_from_slice(&[3, 0, 0, 0, 4, 0, 0, 0]);
        assert_eq!(h[1], sha(&second));
    }

    #[test]
    fn a_page_of_one_token_matches_a_known_digest() {
        // sha256(00 00 00 00): written out once by hand, from the definition.
        assert_eq!(
            hex(&chain(None, &[0], 1)[0]),
            "df3f619804a92fdb4057192dc43dd748ea778adc52bc498ce80524c014b81119"
        );
    }

    #[test]
    fn a_prior_is_hashed_before_the_tokens_and_an_unaligned_tail_is_left_out() {
        let prior = [7u8; 32];
        let h = chain(Some(&prior), &[0x0102_0304, 5, 6], 2);
        assert_eq!(h.len(), 1, "the tail token is not a whole page");
        let mut want = prior.to_vec();
        want.extend_from_slice(&le(&[0x0102_0304, 5]));
        assert_eq!(h[0], sha(&want));
        assert_eq!(want[32..36], [4, 3, 2, 1], "little-endian tokens");
    }

    #[test]
    fn long_pages_are_hashed_whole_across_the_conversion_buffer() {
        let tokens: Vec<u32> = (0..1000).collect();
        let h = chain(None, &tokens, 600);
        assert_eq!(h, vec![sha(&le(&tokens[..600]))]);
    }

    #[test]
    fn chains_continue_from_any_page_hash() {
        let tokens: Vec<u32> = (0..64).collect();
        let whole = chain(None, &tokens, 16);
        let rest = chain(Some(&whole[1]), &tokens[32..], 16);
        assert_eq!(rest, whole[2..]);
    }

    #[test]
    fn the_default_namespace_is_seeded_by_hash_seed_alone() {
        assert_eq!(namespace_seed(None, None), None);
        let seed = [9u8; 32];
        assert_eq!(namespace_seed(Some(&seed), None), Some(seed));
    }

    #[test]
    fn a_named_namespace_without_hash_seed_is_seeded_as_sglang_seeds_an_extra_key() {
        // storage_namespace_seed(extra_key="lora-a", cache_salt=None): the tag, then
        // 0x01, the u64 LE byte length and the bytes of "lora-a", then 0x00 for the
        // absent salt.
        let mut want = b"sglang-cache-namespace-v1".to_vec();
        want.push(1);
        want.extend_from_slice(&6u64.to_le_bytes());
        want.extend_from_slice(b"lora-a");
        want.push(0);
        assert_eq!(namespace_seed(None, Some("lora-a")), Some(sha(&want)));
        // What SGLang 0.5.23's own `storage_namespace_seed("lora-a", None)` returns.
        assert_eq!(
            namespace_seed(None, Some("lora-a")).map(|h| hex(&h)),
            Some("407c773a7c02b33bd4a62af6bf5fc77997c2c8067811ecf2b39e3839c3f4284b".to_owned())
        );
        // The length counts UTF-8 bytes, not characters.
        let mut want = b"sglang-cache-namespace-v1".to_vec();
        want.push(1);
        want.extend_from_slice(&2u64.to_le_bytes());
        want.extend_from_slice("é".as_bytes());
        want.push(0);
        assert_eq!(namespace_seed(None, Some("é")), Some(sha(&want)));
        // The empty name is a namespace of its own, not the default one.
        assert!(namespace_seed(None, Some("")).is_some());
    }

    #[test]
    fn a_named_namespace_with_hash_seed_is_seeded_from_it() {
        let seed = [3u8; 32];
        let mut want = b"radixcache-namespace-v1".to_vec();
        want.extend_from_slice(&seed);
        want.extend_from_slice(&3u64.to_le_bytes());
        want.extend_from_slice(b"abc");
        assert_eq!(namespace_seed(Some(&seed), Some("abc")), Some(sha(&want)));
        assert_ne!(
            namespace_seed(Some(&seed), Some("abc")),
            namespace_seed(Some(&[4u8; 32]), Some("abc")),
            "another seed, another chain"
        );
    }
}
