//! The framing of every object the L3 tier stores: a fixed header, then the payload.
//!
//! The header (little-endian, [`HEADER_LEN`] bytes):
//!
//! | bytes  | field                                                            |
//! |--------|------------------------------------------------------------------|
//! | 0..4   | magic `b"RCL3"`                                                  |
//! | 4..6   | format version, `u16` ([`FORMAT_VERSION`])                       |
//! | 6      | the object's kind, `u8` ([`Kind`]: 1 a KV page, 2 a Mamba state) |
//! | 7      | reserved: 0 in this version                                      |
//! | 8..16  | payload length, `u64`                                            |
//! | 16..48 | the 32-byte page hash the object is for                          |
//! | 48..80 | the 32-byte identity digest of what its bytes mean ([`Label`])   |
//! | 80..88 | checksum, `u64`: XXH3-64 of the payload, seeded with XXH3-64 of bytes 0..80 |
//!
//! The identity digest names everything that changes what the bytes mean besides the
//! page (the model, the tensor- and pipeline-parallel rank, dtypes, shapes, page size:
//! the caller's, docs/design.md "The L3 key scheme"), so that an object written for one
//! model, rank or layout is never read as another's, even under the right key. The
//! checksum covers the header's fields and the payload: a flipped bit anywhere is
//! caught. [`decode_into`] checks, in order, size, magic, version, the reserved byte,
//! kind, identity, hash, length and checksum, and writes the payload only after all of
//! them passed (nothing is written into `out` for a corrupt or foreign object).

use thiserror::Error;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The first four bytes of every object.
pub const MAGIC: [u8; 4] = *b"RCL3";
/// The format version written, and the one read.
pub const FORMAT_VERSION: u16 = 2;
/// The length of a page hash.
pub const HASH_LEN: usize = 32;
/// The length of an identity digest.
pub const IDENTITY_LEN: usize = 32;
/// The header's length: the payload starts here.
pub const HEADER_LEN: usize = 88;

/// Where the checksummed header fields end (the checksum follows).
const FIELDS_END: usize = 80;

/// What an object holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// One page of a full-attention KV pool (every layer's K and V of its tokens).
    KvPage,
    /// The Mamba state at the end of a page (every Mamba layer's conv and SSM state).
    MambaState,
}

impl Kind {
    /// The byte the header records.
    pub const fn code(self) -> u8 {
        match self {
            Kind::KvPage => 1,
            Kind::MambaState => 2,
        }
    }

    /// `"kv"` or `"mamba"`: the pool's name, as in a copy's `pool`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Kind::KvPage => "kv",
            Kind::MambaState => "mamba",
        }
    }

    /// The kind named `name` (`"kv"` or `"mamba"`).
    pub fn from_name(name: &str) -> Option<Kind> {
        match name {
            "kv" => Some(Kind::KvPage),
            "mamba" => Some(Kind::MambaState),
            _ => None,
        }
    }
}

/// What every object of one call is, besides its page: its kind and the identity digest
/// of what its bytes mean. Written into each header by [`header`], and checked by
/// [`verify`]: an object with another label is foreign ([`Corrupt::is_foreign`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Label {
    /// What the objects hold.
    pub kind: Kind,
    /// The digest of the model, rank and layout the bytes are for (docs/design.md).
    pub identity: [u8; IDENTITY_LEN],
}

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
    /// The reserved byte is set.
    #[error("reserved byte {found:#04x} set")]
    Reserved {
        /// The byte found.
        found: u8,
    },
    /// The object holds another kind than the one asked for (a KV page found under a
    /// state's key, or the other way round): foreign.
    #[error("object of kind {found}, expected kind {expected}")]
    Kind {
        /// The kind byte found.
        found: u8,
        /// The kind byte expected.
        expected: u8,
    },
    /// The object was written for another identity (another model, rank or layout):
    /// foreign.
    #[error("object is for another model, rank or layout (identity digest differs)")]
    Identity,
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

impl Corrupt {
    /// Whether the object is intact as far as its header goes but written for another
    /// kind or identity (another model, rank or layout) than the reader's: a miss the
    /// reader counts apart from damaged objects.
    pub fn is_foreign(&self) -> bool {
        matches!(self, Corrupt::Kind { .. } | Corrupt::Identity)
    }
}

/// The length of the framed object of a `payload_len`-byte payload.
pub const fn encoded_len(payload_len: usize) -> usize {
    HEADER_LEN + payload_len
}

/// Frames `payload` as the object `label` says for the page whose hash is `hash`.
pub fn encode(label: &Label, hash: &[u8; HASH_LEN], payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(label, hash, payload, &mut out);
    out
}

/// The header of the object framing `payload` for page `hash` as `label` says: the
/// object is this followed by the payload.
pub fn header(label: &Label, hash: &[u8; HASH_LEN], payload: &[u8]) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[6] = label.kind.code();
    // 7: reserved, 0.
    h[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    h[16..48].copy_from_slice(hash);
    h[48..FIELDS_END].copy_from_slice(&label.identity);
    let sum = checksum(&h[..FIELDS_END], payload);
    h[FIELDS_END..].copy_from_slice(&sum.to_le_bytes());
    h
}

/// [`encode`], appended to `out` (so one buffer holds a whole batch, object after
/// object, and a cleared buffer is reused without allocating again).
pub fn encode_into(label: &Label, hash: &[u8; HASH_LEN], payload: &[u8], out: &mut Vec<u8>) {
    out.reserve(encoded_len(payload.len()));
    out.extend_from_slice(&header(label, hash, payload));
    out.extend_from_slice(payload);
}

/// Verifies `bytes` as the object `label` says for page `expected_hash` with an
/// `out.len()`-byte payload, and copies the payload into `out`. On error `out` is left
/// untouched.
pub fn decode_into(
    label: &Label,
    expected_hash: &[u8; HASH_LEN],
    bytes: &[u8],
    out: &mut [u8],
) -> Result<(), Corrupt> {
    let payload = verify(label, expected_hash, bytes, out.len())?;
    out.copy_from_slice(payload);
    Ok(())
}

/// Verifies `bytes` as the object `label` says for page `expected_hash` with a
/// `len`-byte payload; returns the payload.
pub fn verify<'a>(
    label: &Label,
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
    if header[7] != 0 {
        return Err(Corrupt::Reserved { found: header[7] });
    }
    if header[6] != label.kind.code() {
        return Err(Corrupt::Kind {
            found: header[6],
            expected: label.kind.code(),
        });
    }
    if field::<IDENTITY_LEN>(header, 48) != label.identity {
        return Err(Corrupt::Identity);
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
    const L: Label = Label {
        kind: Kind::KvPage,
        identity: [3; IDENTITY_LEN],
    };

    fn payload() -> Vec<u8> {
        (0..1000u32).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn round_trip_copies_the_payload() {
        let p = payload();
        let obj = encode(&L, &H, &p);
        assert_eq!(obj.len(), encoded_len(p.len()));
        assert_eq!(&obj[..4], b"RCL3");
        let mut out = vec![0u8; p.len()];
        decode_into(&L, &H, &obj, &mut out).unwrap();
        assert_eq!(out, p);
    }

    #[test]
    fn header_is_the_start_of_the_object() {
        let p = payload();
        assert_eq!(header(&L, &H, &p)[..], encode(&L, &H, &p)[..HEADER_LEN]);
    }

    #[test]
    fn empty_payload_round_trips() {
        let obj = encode(&L, &H, &[]);
        assert_eq!(obj.len(), HEADER_LEN);
        decode_into(&L, &H, &obj, &mut []).unwrap();
    }

    #[test]
    fn encode_into_appends() {
        let mut buf = vec![9u8; 5];
        encode_into(&L, &H, &payload(), &mut buf);
        encode_into(&L, &[1; HASH_LEN], &[3, 4], &mut buf);
        let first = encode(&L, &H, &payload());
        assert_eq!(buf[..5], [9; 5]);
        assert_eq!(buf[5..5 + first.len()], first[..]);
        assert_eq!(
            buf[5 + first.len()..],
            encode(&L, &[1; HASH_LEN], &[3, 4])[..]
        );
    }

    /// Decodes `obj` expecting a failure; checks that `out` was not written.
    fn corrupt(obj: &[u8], hash: &[u8; HASH_LEN], len: usize) -> Corrupt {
        let mut out = vec![0xAAu8; len];
        let e = decode_into(&L, hash, obj, &mut out).unwrap_err();
        assert!(out.iter().all(|&b| b == 0xAA), "out written for {e}");
        e
    }

    #[test]
    fn flipped_payload_byte_fails_the_checksum() {
        let p = payload();
        for at in [HEADER_LEN, HEADER_LEN + 500, HEADER_LEN + p.len() - 1] {
            let mut obj = encode(&L, &H, &p);
            obj[at] ^= 0x10;
            assert_eq!(corrupt(&obj, &H, p.len()), Corrupt::Checksum);
        }
    }

    #[test]
    fn flipped_checksum_byte_fails_the_checksum() {
        let mut obj = encode(&L, &H, &payload());
        obj[82] ^= 1;
        assert_eq!(corrupt(&obj, &H, 1000), Corrupt::Checksum);
    }

    #[test]
    fn wrong_hash_is_caught() {
        let obj = encode(&L, &H, &payload());
        let mut other = H;
        other[31] ^= 1;
        assert_eq!(corrupt(&obj, &other, 1000), Corrupt::Hash);
        // A hash byte flipped in the object is caught the same way.
        let mut obj = encode(&L, &H, &payload());
        obj[16] ^= 1;
        assert_eq!(corrupt(&obj, &H, 1000), Corrupt::Hash);
    }

    #[test]
    fn wrong_length_is_caught() {
        let obj = encode(&L, &H, &payload());
        assert_eq!(
            corrupt(&obj, &H, 999),
            Corrupt::Length {
                found: 1000,
                expected: 999
            }
        );
        // A length field rewritten to the caller's length, payload unchanged.
        let mut obj = encode(&L, &H, &payload());
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
        let obj = encode(&L, &H, &payload());
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
        let mut obj = encode(&L, &H, &payload());
        obj[0] = b'X';
        assert_eq!(corrupt(&obj, &H, 1000), Corrupt::Magic { found: *b"XCL3" });
    }

    #[test]
    fn bad_version_is_caught() {
        let mut obj = encode(&L, &H, &payload());
        obj[4..6].copy_from_slice(&3u16.to_le_bytes());
        assert_eq!(corrupt(&obj, &H, 1000), Corrupt::Version { found: 3 });
    }

    #[test]
    fn a_set_reserved_byte_is_caught() {
        let mut obj = encode(&L, &H, &payload());
        obj[7] = 1;
        assert_eq!(corrupt(&obj, &H, 1000), Corrupt::Reserved { found: 1 });
    }

    #[test]
    fn the_label_is_recorded_in_the_header() {
        let obj = encode(&L, &H, &payload());
        assert_eq!(obj[6], 1);
        assert_eq!(obj[48..80], [3; IDENTITY_LEN]);
        let state = Label {
            kind: Kind::MambaState,
            ..L
        };
        assert_eq!(encode(&state, &H, &payload())[6], 2);
    }

    #[test]
    fn a_kv_page_read_as_a_state_is_foreign() {
        // Same page hash, same size: only the kind tells them apart.
        let obj = encode(&L, &H, &payload());
        let state = Label {
            kind: Kind::MambaState,
            ..L
        };
        let mut out = vec![0xAAu8; 1000];
        let e = decode_into(&state, &H, &obj, &mut out).unwrap_err();
        assert_eq!(
            e,
            Corrupt::Kind {
                found: 1,
                expected: 2
            }
        );
        assert!(e.is_foreign());
        assert!(out.iter().all(|&b| b == 0xAA));
    }

    #[test]
    fn another_models_object_is_foreign() {
        // Same page, kind and size, written for another identity (model, rank, layout).
        let other = Label {
            identity: [4; IDENTITY_LEN],
            ..L
        };
        let obj = encode(&other, &H, &payload());
        let mut out = vec![0xAAu8; 1000];
        let e = decode_into(&L, &H, &obj, &mut out).unwrap_err();
        assert_eq!(e, Corrupt::Identity);
        assert!(e.is_foreign());
        assert!(out.iter().all(|&b| b == 0xAA));
        // A flipped identity byte is caught the same way.
        let mut obj = encode(&L, &H, &payload());
        obj[60] ^= 1;
        assert_eq!(corrupt(&obj, &H, 1000), Corrupt::Identity);
    }

    #[test]
    fn damage_is_not_foreign() {
        for e in [
            Corrupt::Checksum,
            Corrupt::Hash,
            Corrupt::Truncated { len: 0 },
            Corrupt::Version { found: 1 },
        ] {
            assert!(!e.is_foreign(), "{e}");
        }
    }

    #[test]
    fn version_1_objects_are_not_read() {
        let mut obj = encode(&L, &H, &payload());
        obj[4..6].copy_from_slice(&1u16.to_le_bytes());
        assert_eq!(corrupt(&obj, &H, 1000), Corrupt::Version { found: 1 });
    }

    #[test]
    fn kind_names_round_trip() {
        for k in [Kind::KvPage, Kind::MambaState] {
            assert_eq!(Kind::from_name(k.as_str()), Some(k));
        }
        assert_eq!(Kind::from_name("swa"), None);
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
            "object of 3 bytes is shorter than the 88-byte header"
        );
    }
}
