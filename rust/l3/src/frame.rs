//! The framing of every object the L3 tier stores: a fixed header, then the payload.
//!
//! The header (little-endian, [`HEADER_LEN`] bytes):
//!
//! | bytes  | field                                                            |
//! |--------|------------------------------------------------------------------|
//! | 0..4   | magic `b"RCL3"`                                                  |
//! | 4..6   | format version, `u16` ([`FORMAT_VERSION`])                       |
//! | 6..8   | flags, `u16`, reserved: 0 in this version                        |
//! | 8..16  | payload length, `u64`                                            |
//! | 16..48 | the 32-byte page hash the object is for                          |
//! | 48..56 | checksum, `u64`: XXH3-64 of the payload, seeded with XXH3-64 of bytes 0..48 |
//!
//! So the checksum covers the header's fields and the payload: a flipped bit anywhere
//! is caught, and an object stored under one page's key but holding another page's
//! bytes fails the hash check. [`decode_into`] checks, in order, size, magic, version,
//! flags, hash, length and checksum, and writes the payload only after all of them
//! passed (nothing is written into `out` for a corrupt object).

use thiserror::Error;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The first four bytes of every object.
pub const MAGIC: [u8; 4] = *b"RCL3";
/// The format version written, and the one read.
pub const FORMAT_VERSION: u16 = 1;
/// The length of a page hash.
pub const HASH_LEN: usize = 32;
/// The header's length: the payload starts here.
pub const HEADER_LEN: usize = 56;

/// Where the checksummed header fields end (the checksum follows).
const FIELDS_END: usize = 48;

/// Why a stored object failed verification.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum Corrupt {
    /// Fewer bytes than a header.
    #[error("object of {len} bytes is shorter than the {HEADER_LEN}-byte header")]
    Truncated {
        /// The object's length.
        len: usize,
    },
    /// The first four bytes are not [`MAGIC`].
    #[error("bad magic {found:02x?}")]
    Magic {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// A format version this build does not read.
    #[error("format version {found}, expected {FORMAT_VERSION}")]
    Version {
        /// The version found.
        found: u16,
    },
    /// Reserved flag bits set.
    #[error("reserved flags {found:#06x} set")]
    Flags {
        /// The flags found.
        found: u16,
    },
    /// The object is for another page hash than the one asked for.
    #[error("object is for another page hash")]
    Hash,
    /// The header's payload length is not the length the caller expects.
    #[error("payload length {found} in the header, expected {expected}")]
    Length {
        /// The header's payload length.
        found: u64,
        /// The length the caller expects (its buffer's).
        expected: usize,
    },
    /// The object holds another number of payload bytes than its header says.
    #[error("object holds {found} payload bytes, its header says {header}")]
    Size {
        /// Payload bytes present.
        found: usize,
        /// The header's payload length.
        header: u64,
    },
    /// The checksum does not match the header fields and payload.
    #[error("checksum mismatch")]
    Checksum,
}

/// The length of the framed object of a `payload_len`-byte payload.
pub const fn encoded_len(payload_len: usize) -> usize {
    HEADER_LEN + payload_len
}

/// Frames `payload` as the object for the page whose hash is `hash`.
pub fn encode(hash: &[u8; HASH_LEN], payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(hash, payload, &mut out);
    out
}

/// The header of the object framing `payload` for page `hash`: the object is this
/// followed by the payload.
pub fn header(hash: &[u8; HASH_LEN], payload: &[u8]) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    // 6..8: flags, 0.
    h[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    h[16..FIELDS_END].copy_from_slice(hash);
    let sum = checksum(&h[..FIELDS_END], payload);
    h[FIELDS_END..].copy_from_slice(&sum.to_le_bytes());
    h
}

/// [`encode`], appended to `out` (so one buffer holds a whole batch, object after
/// object, and a cleared buffer is reused without allocating again).
pub fn encode_into(hash: &[u8; HASH_LEN], payload: &[u8], out: &mut Vec<u8>) {
    out.reserve(encoded_len(payload.len()));
    out.extend_from_slice(&header(hash, payload));
    out.extend_from_slice(payload);
}

/// Verifies `bytes` as the object for page `expected_hash` with an `out.len()`-byte
/// payload, and copies the payload into `out`. On error `out` is left untouched.
pub fn decode_into(
    expected_hash: &[u8; HASH_LEN],
    bytes: &[u8],
    out: &mut [u8],
) -> Result<(), Corrupt> {
    let payload = verify(expected_hash, bytes, out.len())?;
    out.copy_from_slice(payload);
    Ok(())
}

/// Verifies `bytes` as the object for page `expected_hash` with a `len`-byte payload;
/// returns the payload.
pub fn verify<'a>(
    expected_hash: &[u8; HASH_LEN],
    bytes: &'a [u8],
    len: usize,
) -> Result<&'a [u8], Corrupt> {
    let Some((header, payload)) = bytes.split_first_chunk::<HEADER_LEN>() else {
        return Err(Corrupt::Truncated { len: bytes.len() });
    };
    let magic = field::<4>(header, 0);
    if magic != MAGIC {
        return Err(Corrupt::Magic { found: magic });
    }
    let version = u16::from_le_bytes(field(header, 4));
    if version != FORMAT_VERSION {
        return Err(Corrupt::Version { found: version });
    }
    let flags = u16::from_le_bytes(field(header, 6));
    if flags != 0 {
        return Err(Corrupt::Flags { found: flags });
    }
    if field::<HASH_LEN>(header, 16) != *expected_hash {
        return Err(Corrupt::Hash);
    }
    let header_len = u64::from_le_bytes(field(header, 8));
    if header_len != len as u64 {
        return Err(Corrupt::Length {
            found: header_len,
            expected: len,
        });
    }
    if payload.len() != len {
        return Err(Corrupt::Size {
            found: payload.len(),
            header: header_len,
        });
    }
    let sum = u64::from_le_bytes(field(header, FIELDS_END));
    if sum != checksum(&header[..FIELDS_END], payload) {
        return Err(Corrupt::Checksum);
    }
    Ok(payload)
}

/// `N` bytes of the header from `at`.
fn field<const N: usize>(header: &[u8; HEADER_LEN], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&header[at..at + N]);
    out
}

/// The checksum of the header's fields and the payload.
fn checksum(fields: &[u8], payload: &[u8]) -> u64 {
    xxh3_64_with_seed(payload, xxh3_64(fields))
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: [u8; HASH_LEN] = [7; HASH_LEN];

    fn payload() -> Vec<u8> {
        (0..1000u32).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn round_trip_copies_the_payload() {
        let p = payload();
        let obj = encode(&H, &p);
        assert_eq!(obj.len(), encoded_len(p.len()));
        assert_eq!(&obj[..4], b"RCL3");
        let mut out = vec![0u8; p.len()];
        decode_into(&H, &obj, &mut out).unwrap();
        assert_eq!(out, p);
    }

    #[test]
    fn header_is_the_start_of_the_object() {
        let p = payload();
        assert_eq!(header(&H, &p)[..], encode(&H, &p)[..HEADER_LEN]);
    }

    #[test]
    fn empty_payload_round_trips() {
        let obj = encode(&H, &[]);
        assert_eq!(obj.len(), HEADER_LEN);
        decode_into(&H, &obj, &mut []).unwrap();
    }

    #[test]
    fn encode_into_appends() {
        let mut buf = vec![9u8; 5];
        encode_into(&H, &payload(), &mut buf);
        encode_into(&[1; HASH_LEN], &[3, 4], &mut buf);
        let first = encode(&H, &payload());
        assert_eq!(buf[..5], [9; 5]);
        assert_eq!(buf[5..5 + first.len()], first[..]);
        assert_eq!(buf[5 + first.len()..], encode(&[1; HASH_LEN], &[3, 4])[..]);
    }

    /// Decodes `obj` expecting a failure; checks that `out` was not written.
    fn corrupt(obj: &[u8], hash: &[u8; HASH_LEN], len: usize) -> Corrupt {
        let mut out = vec![0xAAu8; len];
        let e = decode_into(hash, obj, &mut out).unwrap_err();
        assert!(out.iter().all(|&b| b == 0xAA), "out written for {e}");
        e
    }

    #[test]
    fn flipped_payload_byte_fails_the_checksum() {
        let p = payload();
        for at in [HEADER_LEN, HEADER_LEN + 500, HEADER_LEN + p.len() - 1] {
            let mut obj = encode(&H, &p);
            obj[at] ^= 0x10;
            assert_eq!(corrupt(&obj, &H, p.len()), Corrupt::Checksum);
        }
    }

    #[test]
    fn flipped_checksum_byte_fails_the_checksum() {
        let mut obj = encode(&H, &payload());
        obj[50] ^= 1;
        assert_eq!(corrupt(&obj, &H, 1000), Corrupt::Checksum);
    }

    #[test]
    fn wrong_hash_is_caught() {
        let obj = encode(&H, &payload());
        let mut other = H;
        other[31] ^= 1;
        assert_eq!(corrupt(&obj, &other, 1000), Corrupt::Hash);
        // A hash byte flipped in the object is caught the same way.
        let mut obj = encode(&H, &payload());
        obj[16] ^= 1;
        assert_eq!(corrupt(&obj, &H, 1000), Corrupt::Hash);
    }

    #[test]
    fn wrong_length_is_caught() {
        let obj = encode(&H, &payload());
        assert_eq!(
            corrupt(&obj, &H, 999),
            Corrupt::Length {
                found: 1000,
                expected: 999
            }
        );
        // A length field rewritten to the caller's length, payload unchanged.
        let mut obj = encode(&H, &payload());
        obj[8..16].copy_from_slice(&1001u64.to_le_bytes());
        assert_eq!(
            corrupt(&obj, &H, 1001),
            Corrupt::Size {
                found: 1000,
                header: 1001
            }
        );
    }

    #[test]
    fn truncated_objects_are_caught() {
        let obj = encode(&H, &payload());
        assert_eq!(
            corrupt(&obj[..HEADER_LEN - 1], &H, 1000),
            Corrupt::Truncated {
                len: HEADER_LEN - 1
            }
        );
        assert_eq!(corrupt(&[], &H, 1000), Corrupt::Truncated { len: 0 });
        assert_eq!(
            corrupt(&obj[..obj.len() - 1], &H, 1000),
            Corrupt::Size {
                found: 999,
                header: 1000
            }
        );
        // Extra bytes after the payload are as wrong as missing ones.
        let mut long = obj.clone();
        long.push(0);
        assert_eq!(
            corrupt(&long, &H, 1000),
            Corrupt::Size {
                found: 1001,
                header: 1000
            }
        );
    }

    #[test]
    fn bad_magic_is_caught() {
        let mut obj = encode(&H, &payload());
        obj[0] = b'X';
        assert_eq!(corrupt(&obj, &H, 1000), Corrupt::Magic { found: *b"XCL3" });
    }

    #[test]
    fn bad_version_is_caught() {
        let mut obj = encode(&H, &payload());
        obj[4..6].copy_from_slice(&2u16.to_le_bytes());
        assert_eq!(corrupt(&obj, &H, 1000), Corrupt::Version { found: 2 });
    }

    #[test]
    fn reserved_flags_are_caught() {
        let mut obj = encode(&H, &payload());
        obj[6] = 1;
        assert_eq!(corrupt(&obj, &H, 1000), Corrupt::Flags { found: 1 });
    }

    #[test]
    fn messages_carry_the_numbers() {
        assert_eq!(
            Corrupt::Length {
                found: 5,
                expected: 6
            }
            .to_string(),
            "payload length 5 in the header, expected 6"
        );
        assert_eq!(
            Corrupt::Truncated { len: 3 }.to_string(),
            "object of 3 bytes is shorter than the 56-byte header"
        );
    }
}
