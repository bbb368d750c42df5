//! Coverage-guided fuzzing of what an L3 store sends back: RESP replies
//! (`radixcache_l3::resp`, the reader the Redis stores use) and frames
//! (`radixcache_l3::frame::verify`), fed hostile bytes from memory.
//!
//! The first input byte picks the mode (modulo 5), the rest is the input:
//!
//! 0. whole replies to data commands, one after another until an error or the end, under
//!    the default limits (values up to 512 MiB announced, no arrays);
//! 1. the same under the cluster topology's limits (arrays, small strings);
//! 2. heads and bulk strings read into one reused buffer, as `get_each` reads them;
//! 3. `frame::verify` of raw bytes (the expected label, hash and length taken from the
//!    input);
//! 4. a frame encoded from the input's label, hash and payload, verified, then one byte
//!    of it changed (position and mask from the input) and verified again.
//!
//! What counts as a finding (a panic, an out-of-memory, a timeout):
//!
//! * any panic in the reader or in `verify`;
//! * memory that follows what a reply announces rather than what arrived: a bulk
//!   buffer longer than twice the input plus one growth step (64 KiB), a value longer
//!   than the limit, more values in a reply than the limit;
//! * a read that consumed nothing yet succeeded (the loops would spin);
//! * `verify` accepting an object whose kind, identity, length, size or hash is not the
//!   expected one;
//! * an encoded frame that does not verify, or that still verifies once a byte changed.

#![no_main]

use std::io::BufRead;

use libfuzzer_sys::fuzz_target;
use radixcache_l3::frame::{self, Kind, Label, HASH_LEN, HEADER_LEN, IDENTITY_LEN};
use radixcache_l3::resp::{read_bulk_into, read_head, read_reply, Head, Limits, Reply};
use radixcache_l3::Options;

/// The bulk buffer's growth step (`resp.rs`).
const GROW: usize = 64 * 1024;

/// The most values a reply holds, arrays included, counting itself.
fn values(reply: &Reply) -> usize {
    match reply {
        Reply::Array(items) => items.len() + items.iter().map(values).sum::<usize>(),
        _ => 0,
    }
}

/// Checks a reply against `limits`.
fn within(reply: &Reply, limits: &Limits) {
    match reply {
        Reply::Bulk(b) => assert!(b.len() <= limits.max_bulk),
        Reply::Array(items) => items.iter().for_each(|r| within(r, limits)),
        _ => {}
    }
}

/// Reads whole replies until an error or the end.
fn replies(input: &[u8], limits: &Limits) {
    let mut r = input;
    loop {
        let before = r.len();
        match read_reply(&mut r, limits) {
            Ok(reply) => {
                assert!(r.len() < before, "a reply read from nothing");
                within(&reply, limits);
                assert!(values(&reply) <= limits.max_elements);
            }
            Err(_) => return,
        }
    }
}

/// Reads heads and bulk strings into one buffer, as a `GET` pipeline is read.
fn get_path(input: &[u8]) {
    let limits = Limits::data(Options::DEFAULT_MAX_OBJECT_SIZE);
    let mut r = input;
    let mut line = Vec::new();
    let mut buf = Vec::new();
    loop {
        let before = r.len();
        match read_head(&mut r, &limits, &mut line) {
            Ok(Head::Bulk(n)) => {
                assert!(n <= limits.max_bulk);
                let read = read_bulk_into(&mut r, n, &mut buf);
                // Memory follows the bytes that arrived, not the length announced.
                assert!(
                    buf.len() <= 2 * input.len() + GROW,
                    "a buffer of {} bytes for {} input bytes",
                    buf.len(),
                    input.len()
                );
                if read.is_err() {
                    return;
                }
                assert!(buf.len() >= n + 2);
            }
            Ok(Head::Value(_) | Head::Array(_)) => {}
            Err(_) => return,
        }
        assert!(r.len() < before, "a head read from nothing");
        // `fill_buf` on a slice never fails; an empty rest ends the loop next time.
        let _ = r.fill_buf();
    }
}

/// Splits off `N` bytes (zeros where the input is short).
fn take<const N: usize>(input: &mut &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    let n = N.min(input.len());
    out[..n].copy_from_slice(&input[..n]);
    *input = &input[n..];
    out
}

/// A label from the input: a kind (one byte's low bit) and an identity.
fn label(input: &mut &[u8]) -> Label {
    let [k] = take::<1>(input);
    let kind = if k & 1 == 0 {
        Kind::KvPage
    } else {
        Kind::MambaState
    };
    Label {
        kind,
        identity: take::<IDENTITY_LEN>(input),
    }
}

/// `verify` of raw bytes.
fn raw_frame(mut input: &[u8]) {
    let label = label(&mut input);
    let hash: [u8; HASH_LEN] = take(&mut input);
    // Lengths near the input's, and a few beyond it.
    let len = u32::from_le_bytes(take(&mut input)) as usize % (input.len() + 64);
    if let Ok(payload) = frame::verify(&label, &hash, input, len) {
        assert_eq!(payload.len(), len);
        assert_eq!(input.len(), HEADER_LEN + len);
        assert_eq!(input[6], label.kind.code());
        assert_eq!(&input[16..16 + HASH_LEN], &hash);
        assert_eq!(&input[48..48 + IDENTITY_LEN], &label.identity);
        let mut out = vec![0u8; len];
        frame::decode_into(&label, &hash, input, &mut out).expect("verify passed");
        assert_eq!(out, payload);
    }
}

/// An encoded frame verifies; with one byte changed, it does not.
fn round_trip(mut input: &[u8]) {
    let label = label(&mut input);
    let hash: [u8; HASH_LEN] = take(&mut input);
    let at = u32::from_le_bytes(take(&mut input)) as usize;
    let [mask] = take::<1>(&mut input);
    let payload = input;
    let mut object = frame::encode(&label, &hash, payload);
    assert_eq!(frame::verify(&label, &hash, &object, payload.len()), Ok(payload));
    let at = at % object.len();
    let mask = mask.max(1);
    object[at] ^= mask;
    assert!(
        frame::verify(&label, &hash, &object, payload.len()).is_err(),
        "byte {at} changed by {mask:#04x} still verifies"
    );
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, input)) = data.split_first() else {
        return;
    };
    match mode % 5 {
        0 => replies(input, &Limits::data(Options::DEFAULT_MAX_OBJECT_SIZE)),
        1 => replies(input, &Limits::topology()),
        2 => get_path(input),
        3 => raw_frame(input),
        _ => round_trip(input),
    }
});
