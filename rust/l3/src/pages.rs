//! Pages in and out of a store: framing on the way in, verification on the way out.
//!
//! What the cache stores is a page's bytes under a key derived from its page hash; these
//! two calls frame a batch of pages ([`crate::frame`]) and put them, and get a batch,
//! verify each object against the label (kind and identity), page hash and length the
//! caller expects, copy the payloads that pass into the caller's buffers, and delete the
//! objects that fail (damaged ones, and foreign ones: the key scheme gives each identity
//! keys of its own, so a foreign object under a key is as wrong for it as a damaged one).

use crate::frame::{self, Corrupt, Label, HASH_LEN};
use crate::store::{Object, ObjectStore, Parts, StoreError};

/// What [`get_pages_into`] found for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fetched {
    /// Verified; the buffer holds the page.
    Ok,
    /// No object (the buffer is untouched).
    Missing,
    /// The object failed verification and was deleted (the buffer is untouched): damaged,
    /// or foreign ([`Corrupt::is_foreign`]: written for another kind or identity).
    Corrupt(Corrupt),
    /// The store could not read an object under the key (a Redis key of another type, a
    /// directory or an oversized file: [`Object::Unreadable`], the reason given); it
    /// counts as corrupt, and was deleted (the buffer is untouched).
    Unreadable(String),
}

impl Fetched {
    /// `"ok"`, `"missing"`, `"foreign"` (an intact object of another kind or identity)
    /// or `"corrupt"` (unreadable objects included).
    pub fn as_str(&self) -> &'static str {
        match self {
            Fetched::Ok => "ok",
            Fetched::Missing => "missing",
            Fetched::Corrupt(c) if c.is_foreign() => "foreign",
            Fetched::Corrupt(_) | Fetched::Unreadable(_) => "corrupt",
        }
    }
}

/// Frames `payloads[i]` as `label` says for page `hashes[i]` and puts it under `keys[i]`
/// (write-once); per key, whether this call stored it.
pub fn put_pages(
    store: &dyn ObjectStore,
    label: &Label,
    keys: &[&[u8]],
    hashes: &[[u8; HASH_LEN]],
    payloads: &[&[u8]],
) -> Result<Vec<bool>, StoreError> {
    StoreError::check_len("hashes", hashes.len(), keys.len())?;
    StoreError::check_len("payloads", payloads.len(), keys.len())?;
    // Headers here, payloads where they are: no copy of a page before the store's.
    let headers: Vec<[u8; frame::HEADER_LEN]> = hashes
        .iter()
        .zip(payloads)
        .map(|(h, p)| frame::header(label, h, p))
        .collect();
    let values: Vec<Parts<'_>> = headers
        .iter()
        .zip(payloads)
        .map(|(h, p)| [h.as_slice(), *p])
        .collect();
    store.put_parts(keys, &values)
}

/// Gets `keys`, verifies each object as the object `label` says for page `hashes[i]`
/// with `outs[i].len()` payload bytes, and copies each verified payload into `outs[i]`;
/// deletes the objects that fail verification and those the store cannot read. One
/// outcome per key. After an error, some buffers may hold what was read: treat every one
/// of them as not fetched.
pub fn get_pages_into(
    store: &dyn ObjectStore,
    label: &Label,
    keys: &[&[u8]],
    hashes: &[[u8; HASH_LEN]],
    outs: &mut [&mut [u8]],
) -> Result<Vec<Fetched>, StoreError> {
    StoreError::check_len("hashes", hashes.len(), keys.len())?;
    StoreError::check_len("outs", outs.len(), keys.len())?;
    let mut outcomes = vec![Fetched::Missing; keys.len()];
    let mut corrupt = Vec::new();
    store.get_each(keys, &mut |i, object| {
        outcomes[i] = match object {
            Object::Missing => Fetched::Missing,
            Object::Bytes(bytes) => match frame::decode_into(label, &hashes[i], bytes, outs[i]) {
                Ok(()) => Fetched::Ok,
                Err(e) => {
                    corrupt.push(keys[i]);
                    Fetched::Corrupt(e)
                }
            },
            Object::Unreadable(why) => {
                corrupt.push(keys[i]);
                Fetched::Unreadable(why.to_owned())
            }
        };
    })?;
    if !corrupt.is_empty() {
        store.delete(&corrupt)?;
    }
    Ok(outcomes)
}

#[cfg(test)]
#[allow(clippy::many_single_char_names)] // k, h, p: keys, hashes, pages
mod tests {
    use super::*;
    use crate::faulty::{FaultRates, Faulty};
    use crate::file::FileStore;
    use crate::frame::{Kind, IDENTITY_LEN};

    const L: Label = Label {
        kind: Kind::KvPage,
        identity: [5; IDENTITY_LEN],
    };

    struct Temp(FileStore);

    impl Drop for Temp {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(self.0.dir());
        }
    }

    fn temp(tag: &str) -> Temp {
        let dir = std::env::temp_dir().join(format!("rcl3-pages-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Temp(FileStore::new(dir).unwrap())
    }

    const SIZE: usize = 256;

    /// Keys, page hashes and pages.
    type Batch = (Vec<Vec<u8>>, Vec<[u8; HASH_LEN]>, Vec<Vec<u8>>);

    fn batch(n: usize) -> Batch {
        let keys = (0..n).map(|i| format!("p{i}").into_bytes()).collect();
        let hashes = (0..n)
            .map(|i| [u8::try_from(i).unwrap(); HASH_LEN])
            .collect();
        let pages = (0..n)
            .map(|i| {
                (0..SIZE)
                    .map(|j| u8::try_from((i * 7 + j) % 256).unwrap())
                    .collect()
            })
            .collect();
        (keys, hashes, pages)
    }

    fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
        v.iter().map(Vec::as_slice).collect()
    }

    fn fetch(
        store: &dyn ObjectStore,
        keys: &[Vec<u8>],
        hashes: &[[u8; HASH_LEN]],
    ) -> (Vec<Fetched>, Vec<Vec<u8>>) {
        let mut out = vec![vec![0u8; SIZE]; keys.len()];
        let mut rows: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
        let outcomes = get_pages_into(store, &L, &refs(keys), hashes, &mut rows).unwrap();
        (outcomes, out)
    }

    #[test]
    fn pages_round_trip_framed() {
        let t = temp("round");
        let (k, h, p) = batch(8);
        assert_eq!(
            put_pages(&t.0, &L, &refs(&k), &h, &refs(&p)).unwrap(),
            vec![true; 8]
        );
        // Stored framed.
        let raw = t.0.get(&refs(&k[..1])).unwrap().remove(0).unwrap();
        assert_eq!(raw, frame::encode(&L, &h[0], &p[0]));
        let (outcomes, out) = fetch(&t.0, &k, &h);
        assert_eq!(outcomes, vec![Fetched::Ok; 8]);
        assert_eq!(out, p);
        // Write-once through pages too.
        assert_eq!(
            put_pages(&t.0, &L, &refs(&k), &h, &refs(&p)).unwrap(),
            vec![false; 8]
        );
    }

    #[test]
    fn missing_pages_leave_their_rows_alone() {
        let t = temp("missing");
        let (k, h, p) = batch(4);
        put_pages(&t.0, &L, &refs(&k[..2]), &h[..2], &refs(&p[..2])).unwrap();
        let (outcomes, out) = fetch(&t.0, &k, &h);
        assert_eq!(
            outcomes.iter().map(Fetched::as_str).collect::<Vec<_>>(),
            ["ok", "ok", "missing", "missing"]
        );
        assert_eq!(out[..2], p[..2]);
        assert!(out[2..].iter().all(|r| r.iter().all(|&b| b == 0)));
    }

    #[test]
    fn corrupt_objects_are_reported_and_deleted() {
        let t = temp("corrupt");
        let (k, h, p) = batch(4);
        put_pages(&t.0, &L, &refs(&k[..1]), &h[..1], &refs(&p[..1])).unwrap();
        // Raw garbage, another page's object, and a payload of another size.
        let other = frame::encode(&L, &h[0], &p[2]);
        let short = frame::encode(&L, &h[3], &p[3][..10]);
        t.0.put(&refs(&k[1..]), &[b"garbage".as_slice(), &other, &short])
            .unwrap();
        let (outcomes, out) = fetch(&t.0, &k, &h);
        assert_eq!(outcomes[0], Fetched::Ok);
        assert_eq!(outcomes[1], Fetched::Corrupt(Corrupt::Truncated { len: 7 }));
        assert_eq!(outcomes[2], Fetched::Corrupt(Corrupt::Hash));
        assert_eq!(
            outcomes[3],
            Fetched::Corrupt(Corrupt::Length {
                found: 10,
                expected: SIZE
            })
        );
        assert_eq!(outcomes[3].as_str(), "corrupt");
        assert!(out[1..].iter().all(|r| r.iter().all(|&b| b == 0)));
        assert_eq!(t.0.exists(&refs(&k)).unwrap(), [true, false, false, false]);
    }

    #[test]
    fn foreign_objects_are_reported_apart_and_deleted() {
        let t = temp("foreign");
        let (k, h, p) = batch(3);
        // Another model's page, and a state, under this model's KV keys: intact objects
        // of the same page and size, written with another label.
        let other_model = Label {
            identity: [6; IDENTITY_LEN],
            ..L
        };
        let state = Label {
            kind: Kind::MambaState,
            ..L
        };
        put_pages(&t.0, &L, &refs(&k[..1]), &h[..1], &refs(&p[..1])).unwrap();
        put_pages(
            &t.0,
            &other_model,
            &refs(&k[1..2]),
            &h[1..2],
            &refs(&p[1..2]),
        )
        .unwrap();
        put_pages(&t.0, &state, &refs(&k[2..]), &h[2..], &refs(&p[2..])).unwrap();
        let (outcomes, out) = fetch(&t.0, &k, &h);
        assert_eq!(
            outcomes.iter().map(Fetched::as_str).collect::<Vec<_>>(),
            ["ok", "foreign", "foreign"]
        );
        assert_eq!(outcomes[1], Fetched::Corrupt(Corrupt::Identity));
        assert_eq!(out[0], p[0]);
        assert!(out[1..].iter().all(|r| r.iter().all(|&b| b == 0)));
        assert_eq!(t.0.exists(&refs(&k)).unwrap(), [true, false, false]);
    }

    #[test]
    fn flipped_bytes_from_the_store_never_land() {
        let t = temp("flip");
        let (k, h, p) = batch(16);
        put_pages(&t.0, &L, &refs(&k), &h, &refs(&p)).unwrap();
        let rates = FaultRates {
            corrupt: 0.5,
            lose: 0.2,
            ..FaultRates::default()
        };
        let faulty = Faulty::new(&t.0 as &dyn ObjectStore, 9, rates).unwrap();
        let (outcomes, out) = fetch(&faulty, &k, &h);
        let count = |s: &str| outcomes.iter().filter(|o| o.as_str() == s).count();
        assert!(count("corrupt") > 0 && count("ok") > 0 && count("missing") > 0);
        for (i, o) in outcomes.iter().enumerate() {
            if *o == Fetched::Ok {
                assert_eq!(out[i], p[i]);
            } else {
                assert!(out[i].iter().all(|&b| b == 0));
            }
            // Corrupt ones are gone; lost ones are still there.
            let there = t.0.exists(&refs(&k[i..=i])).unwrap()[0];
            assert_eq!(there, o.as_str() != "corrupt");
        }
    }

    #[test]
    fn lengths_must_match_keys() {
        let t = temp("lengths");
        let (k, h, p) = batch(2);
        let e = put_pages(&t.0, &L, &refs(&k), &h[..1], &refs(&p)).unwrap_err();
        assert_eq!(e.to_string(), "hashes: 1 given for 2 keys");
        let e = put_pages(&t.0, &L, &refs(&k), &h, &refs(&p[..1])).unwrap_err();
        assert_eq!(e.to_string(), "payloads: 1 given for 2 keys");
        let mut row = [0u8; SIZE];
        let e = get_pages_into(&t.0, &L, &refs(&k), &h, &mut [&mut row]).unwrap_err();
        assert_eq!(e.to_string(), "outs: 1 given for 2 keys");
        let e = get_pages_into(&t.0, &L, &refs(&k), &h[..1], &mut []).unwrap_err();
        assert_eq!(e.to_string(), "hashes: 1 given for 2 keys");
    }

    #[test]
    fn a_store_error_is_passed_on() {
        let t = temp("error");
        let (k, h, p) = batch(2);
        let failing = Faulty::new(
            &t.0 as &dyn ObjectStore,
            1,
            FaultRates {
                timeout: 1.0,
                ..FaultRates::default()
            },
        )
        .unwrap();
        assert!(put_pages(&failing, &L, &refs(&k), &h, &refs(&p))
            .unwrap_err()
            .is_timeout());
        let mut rows = [[0u8; SIZE]; 2];
        let [a, b] = &mut rows;
        assert!(get_pages_into(&failing, &L, &refs(&k), &h, &mut [a, b])
            .unwrap_err()
            .is_timeout());
    }
}
