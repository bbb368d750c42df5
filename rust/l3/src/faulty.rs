//! [`Faulty`]: a store that misbehaves on purpose, for the property machines and the
//! fuzz target (not for users).
//!
//! Each call first draws whether it fails (`fail`: a [`StoreError::Failed`]; half of
//! these run the inner call first, so the error hides effects that happened, as a
//! connection dropped before the reply would) or times out (`timeout`: a
//! [`StoreError::Timeout`], same halves). A `get` that goes through then draws, for each
//! object found, whether it is lost (`lose`: reported missing although `exists` says it
//! is there) or corrupt (`corrupt`: one byte flipped at a drawn position). Every draw
//! comes from one seeded generator, so a run is reproduced by its seed and call order.

use parking_lot::Mutex;
use thiserror::Error;

use crate::store::{Cause, Object, ObjectStore, Parts, StoreError};

/// A rate outside `0..=1`.
#[derive(Debug, Clone, Error, PartialEq)]
#[error("{name} rate {value} is not in 0..=1")]
pub struct RateError {
    /// The rate's name (`fail`, `timeout`, `lose`, `corrupt`).
    pub name: &'static str,
    /// The value given.
    pub value: f64,
}

/// How often each fault happens: probabilities in `0..=1`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FaultRates {
    /// A call fails.
    pub fail: f64,
    /// A call times out.
    pub timeout: f64,
    /// An object found by `get` is reported missing.
    pub lose: f64,
    /// An object found by `get` comes back with a byte flipped.
    pub corrupt: f64,
}

impl FaultRates {
    /// Checks every rate.
    pub fn validate(&self) -> Result<(), RateError> {
        for (name, value) in [
            ("fail", self.fail),
            ("timeout", self.timeout),
            ("lose", self.lose),
            ("corrupt", self.corrupt),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(RateError { name, value });
            }
        }
        Ok(())
    }
}

/// `SplitMix64`: small, fast and good enough for drawing faults.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// True with probability `p`.
    fn chance(&mut self, p: f64) -> bool {
        // The top 53 bits as a uniform float in [0, 1).
        #[allow(clippy::cast_precision_loss)] // 53 bits fit an f64 exactly
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        u < p
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        // Modulo bias is irrelevant at these sizes.
        usize::try_from(self.next() % n as u64).unwrap_or(0)
    }
}

/// A store wrapping `S` with drawn faults.
#[derive(Debug)]
pub struct Faulty<S> {
    inner: S,
    rates: FaultRates,
    rng: Mutex<Rng>,
}

impl<S: ObjectStore> Faulty<S> {
    /// Wraps `inner`; draws from `seed`.
    pub fn new(inner: S, seed: u64, rates: FaultRates) -> Result<Faulty<S>, RateError> {
        rates.validate()?;
        Ok(Faulty {
            inner,
            rates,
            rng: Mutex::new(Rng(seed)),
        })
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Draws this call's fault, running `call` first for half of the faults; the call's
    /// result when no fault was drawn.
    fn call<T>(
        &self,
        op: &'static str,
        call: impl FnOnce() -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let (fault, before) = {
            let mut rng = self.rng.lock();
            let fault = if rng.chance(self.rates.fail) {
                Some(StoreError::failed(op, Cause::Injected, ""))
            } else if rng.chance(self.rates.timeout) {
                Some(StoreError::Timeout {
                    op,
                    detail: "injected timeout".to_owned(),
                })
            } else {
                None
            };
            let before = fault.is_some() && rng.chance(0.5);
            (fault, before)
        };
        match fault {
            None => call(),
            Some(e) => {
                if before {
                    // The effects happen; the reply is lost.
                    let _ = call();
                }
                Err(e)
            }
        }
    }
}

/// What happens to one object a `get` found.
enum Draw {
    Keep,
    Lose,
    /// The byte at this position is flipped by this (non-zero) mask, with `^`.
    Flip(usize, u8),
}

impl<S: ObjectStore> Faulty<S> {
    /// Draws the fate of an object of `len` bytes.
    fn draw(&self, rng: &mut Rng, len: usize) -> Draw {
        if rng.chance(self.rates.lose) {
            Draw::Lose
        } else if len > 0 && rng.chance(self.rates.corrupt) {
            let at = rng.below(len);
            // A non-zero mask: the byte always changes.
            let mask = u8::try_from(rng.below(255) + 1).unwrap_or(1);
            Draw::Flip(at, mask)
        } else {
            Draw::Keep
        }
    }
}

impl<S: ObjectStore> ObjectStore for Faulty<S> {
    fn exists(&self, keys: &[&[u8]]) -> Result<Vec<bool>, StoreError> {
        self.call("exists", || self.inner.exists(keys))
    }

    fn put(&self, keys: &[&[u8]], values: &[&[u8]]) -> Result<Vec<bool>, StoreError> {
        self.call("put", || self.inner.put(keys, values))
    }

    fn put_parts(&self, keys: &[&[u8]], values: &[Parts<'_>]) -> Result<Vec<bool>, StoreError> {
        self.call("put", || self.inner.put_parts(keys, values))
    }

    fn get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let mut got = self.call("get", || self.inner.get(keys))?;
        let mut rng = self.rng.lock();
        for slot in &mut got {
            let Some(value) = slot else { continue };
            match self.draw(&mut rng, value.len()) {
                Draw::Keep => {}
                Draw::Lose => *slot = None,
                Draw::Flip(at, mask) => value[at] ^= mask,
            }
        }
        Ok(got)
    }

    fn get_each(
        &self,
        keys: &[&[u8]],
        visit: &mut dyn FnMut(usize, Object<'_>),
    ) -> Result<(), StoreError> {
        let mut copy = Vec::new();
        self.call("get", || {
            self.inner.get_each(keys, &mut |i, object| {
                let Object::Bytes(value) = object else {
                    return visit(i, object);
                };
                let draw = self.draw(&mut self.rng.lock(), value.len());
                match draw {
                    Draw::Keep => visit(i, object),
                    Draw::Lose => visit(i, Object::Missing),
                    Draw::Flip(at, mask) => {
                        copy.clear();
                        copy.extend_from_slice(value);
                        copy[at] ^= mask;
                        visit(i, Object::Bytes(&copy));
                    }
                }
            })
        })
    }

    fn check(&self) -> Result<(), StoreError> {
        // No faults: a check says whether the store itself can be used.
        self.inner.check()
    }

    fn delete(&self, keys: &[&[u8]]) -> Result<(), StoreError> {
        self.call("delete", || self.inner.delete(keys))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::file::FileStore;

    fn store(tag: &str, seed: u64, rates: FaultRates) -> (Faulty<FileStore>, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("rcl3-faulty-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let f = Faulty::new(FileStore::new(&dir).unwrap(), seed, rates).unwrap();
        (f, dir)
    }

    fn keys(n: usize) -> Vec<Vec<u8>> {
        (0..n).map(|i| format!("key{i}").into_bytes()).collect()
    }

    fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
        v.iter().map(Vec::as_slice).collect()
    }

    #[test]
    fn rates_out_of_range_are_refused_by_name() {
        for (rates, name) in [
            (
                FaultRates {
                    fail: 1.5,
                    ..FaultRates::default()
                },
                "fail",
            ),
            (
                FaultRates {
                    timeout: -0.1,
                    ..FaultRates::default()
                },
                "timeout",
            ),
            (
                FaultRates {
                    lose: f64::NAN,
                    ..FaultRates::default()
                },
                "lose",
            ),
            (
                FaultRates {
                    corrupt: 2.0,
                    ..FaultRates::default()
                },
                "corrupt",
            ),
        ] {
            assert_eq!(rates.validate().unwrap_err().name, name);
        }
        assert_eq!(
            RateError {
                name: "fail",
                value: 1.5
            }
            .to_string(),
            "fail rate 1.5 is not in 0..=1"
        );
    }

    #[test]
    fn zero_rates_pass_everything_through() {
        let (f, dir) = store("zero", 1, FaultRates::default());
        let k = keys(20);
        let v: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; 100]).collect();
        assert_eq!(f.put(&refs(&k), &refs(&v)).unwrap(), vec![true; 20]);
        let got = f.get(&refs(&k)).unwrap();
        assert_eq!(got, v.into_iter().map(Some).collect::<Vec<_>>());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn failures_and_timeouts_are_errors_of_their_kind() {
        let (f, dir) = store(
            "fail",
            2,
            FaultRates {
                fail: 1.0,
                ..FaultRates::default()
            },
        );
        let e = f.exists(&refs(&keys(1))).unwrap_err();
        assert!(matches!(e, StoreError::Failed { op: "exists", .. }) && !e.is_timeout());
        let (t, dir2) = store(
            "timeout",
            2,
            FaultRates {
                timeout: 1.0,
                ..FaultRates::default()
            },
        );
        let e = t.get(&refs(&keys(1))).unwrap_err();
        assert!(e.is_timeout(), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
        std::fs::remove_dir_all(dir2).unwrap();
    }

    #[test]
    fn a_failed_put_sometimes_took_effect() {
        let (f, dir) = store(
            "effect",
            3,
            FaultRates {
                fail: 1.0,
                ..FaultRates::default()
            },
        );
        let k = keys(40);
        let mut took = 0;
        for key in &k {
            assert!(f.put(&[key.as_slice()], &[b"v".as_slice()]).is_err());
            took += usize::from(f.inner().exists(&[key.as_slice()]).unwrap()[0]);
        }
        assert!(took > 5 && took < 35, "{took} of 40 took effect");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn lost_objects_exist_but_are_not_found() {
        let (f, dir) = store(
            "lose",
            4,
            FaultRates {
                lose: 1.0,
                ..FaultRates::default()
            },
        );
        let k = keys(5);
        f.put(&refs(&k), &refs(&k)).unwrap();
        assert_eq!(f.exists(&refs(&k)).unwrap(), vec![true; 5]);
        assert_eq!(f.get(&refs(&k)).unwrap(), vec![None; 5]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn corrupt_objects_differ_in_exactly_one_byte() {
        let (f, dir) = store(
            "corrupt",
            5,
            FaultRates {
                corrupt: 1.0,
                ..FaultRates::default()
            },
        );
        let k = keys(30);
        let v: Vec<Vec<u8>> = (0..30u8).map(|i| vec![i; 64]).collect();
        f.put(&refs(&k), &refs(&v)).unwrap();
        for (got, want) in f.get(&refs(&k)).unwrap().into_iter().zip(&v) {
            let got = got.unwrap();
            let diff = got.iter().zip(want).filter(|(a, b)| a != b).count();
            assert_eq!(diff, 1);
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_seed_decides_the_faults() {
        let rates = FaultRates {
            fail: 0.3,
            timeout: 0.2,
            lose: 0.2,
            corrupt: 0.2,
        };
        let run = |tag: &str, seed: u64| {
            let (f, dir) = store(tag, seed, rates);
            let k = keys(8);
            let _ = f.inner().put(&refs(&k), &refs(&k));
            let trace: Vec<String> = (0..50).map(|_| format!("{:?}", f.get(&refs(&k)))).collect();
            std::fs::remove_dir_all(dir).unwrap();
            trace
        };
        assert_eq!(run("seed-a", 42), run("seed-b", 42));
        assert_ne!(run("seed-c", 42), run("seed-d", 43));
    }
}
