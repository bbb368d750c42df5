//! [`FileStore`]: one file per object under a directory, for one machine (or a shared
//! file system).
//!
//! A key's file is `DIR/FF/k<hex of the key>`, where `FF` is a fan-out directory (the
//! low byte of the key's XXH3-64, in hex: 256 directories, evenly filled whatever the
//! keys' common prefixes). A write goes to a temporary file in the same directory,
//! which is then hard-linked to the key's name: the link fails when the name exists,
//! so a write never replaces an object, and readers see either no file or a complete
//! one. The temporary file is removed either way.
//!
//! A key whose path is not a readable regular file (a directory, a FIFO, a file that
//! cannot be opened or read) or is a file larger than [`Options::max_object_size`] (never
//! read) is [`Object::Unreadable`]; `delete` removes it whatever it is. A broken
//! directory above the keys (a fan-out directory that is a file, say) fails the call.
use std::fmt::Write as _;
use std::fs;
use std::io::{ErrorKind, Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use xxhash_rust::xxh3::xxh3_64;

use crate::store::{get_via_each, Cause, Object, ObjectStore, Options, Parts, StoreError};

/// The longest key: its name (`k` and two hex digits a byte) must fit the usual 255-byte
/// limit of a file name.
pub const MAX_KEY_LEN: usize = 127;

/// Objects as files under one directory.
#[derive(Debug)]
pub struct FileStore {
    dir: PathBuf,
    /// Makes temporary names unique within the process (the pid across processes).
    counter: AtomicU64,
    /// Larger files are unreadable objects.
    max_object_size: usize,
    /// The buffer `get_each` reads files into, kept between calls.
    scratch: parking_lot::Mutex<Vec<u8>>,
}

impl FileStore {
    /// A store under `dir`, created (with its parents) if missing, with the default
    /// [`Options`].
    pub fn new(dir: impl Into<PathBuf>) -> Result<FileStore, StoreError> {
        FileStore::with_options(dir, Options::default())
    }

    /// A store under `dir`, created (with its parents) if missing; of `options`, only
    /// `max_object_size` applies (files have no timeouts).
    pub fn with_options(
        dir: impl Into<PathBuf>,
        options: Options,
    ) -> Result<FileStore, StoreError> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(|e| failed("open", &dir, &e))?;
        Ok(FileStore {
            dir,
            counter: AtomicU64::new(0),
            max_object_size: options.max_object_size,
            scratch: parking_lot::Mutex::new(Vec::new()),
        })
    }

    /// A name for a temporary file, unique among this process's and others'.
    fn temp_name(&self, what: &str) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        format!(".{what}-{}-{n}", std::process::id())
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The fan-out directory and file of `key`.
    fn path(&self, index: usize, key: &[u8]) -> Result<(PathBuf, PathBuf), StoreError> {
        if key.len() > MAX_KEY_LEN {
            return Err(StoreError::KeyTooLong {
                index,
                len: key.len(),
                max: MAX_KEY_LEN,
            });
        }
        let fan = self.dir.join(format!("{:02x}", xxh3_64(key) & 0xff));
        let mut name = String::with_capacity(1 + 2 * key.len());
        name.push('k');
        for b in key {
            // Writing to a String cannot fail.
            let _ = write!(name, "{b:02x}");
        }
        let file = fan.join(name);
        Ok((fan, file))
    }

    /// The paths of every key, checked before any file is touched.
    fn paths(&self, keys: &[&[u8]]) -> Result<Vec<(PathBuf, PathBuf)>, StoreError> {
        keys.iter()
            .enumerate()
            .map(|(i, k)| self.path(i, k))
            .collect()
    }

    /// Stores `value` at `file` (in directory `fan`) unless it exists; whether it stored.
    fn put_one(&self, fan: &Path, file: &Path, value: Parts<'_>) -> Result<bool, StoreError> {
        if file.exists() {
            return Ok(false);
        }
        fs::create_dir_all(fan).map_err(|e| failed("put", fan, &e))?;
        let tmp = fan.join(self.temp_name("tmp"));
        let written = fs::File::create(&tmp).and_then(|mut f| {
            f.write_all(value[0])?;
            f.write_all(value[1])
        });
        let linked = written.and_then(|()| fs::hard_link(&tmp, file));
        // The temporary name goes in every case; a failure to remove it leaves a stray
        // file, never a wrong object.
        let _ = fs::remove_file(&tmp);
        match linked {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(failed("put", file, &e)),
        }
    }

    /// Reads the object at `file` into `buf` (cleared first): `Ok(Err(why))` where the
    /// path holds no readable object, `Ok(Ok(false))` where it holds nothing, `Err` where
    /// the directories above it are broken.
    fn read_one(&self, file: &Path, buf: &mut Vec<u8>) -> Result<Result<bool, String>, StoreError> {
        let meta = match fs::metadata(file) {
            Ok(m) => m,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Ok(false)),
            Err(e) => return Err(failed("get", file, &e)),
        };
        if meta.is_dir() {
            return Ok(Err("a directory".to_owned()));
        }
        if !meta.is_file() {
            return Ok(Err("not a regular file".to_owned()));
        }
        let max = self.max_object_size as u64;
        if meta.len() > max {
            return Ok(Err(format!(
                "{} bytes, over the maximum object size of {max}",
                meta.len()
            )));
        }
        buf.clear();
        // A file that grew since: read one byte past the limit to notice.
        let read = fs::File::open(file)
            .and_then(|f| f.take(max + 1).read_to_end(buf))
            .map_err(|e| e.to_string());
        Ok(match read {
            Ok(n) if n as u64 > max => Err(format!("over the maximum object size of {max}")),
            Ok(_) => Ok(true),
            Err(why) => Err(why),
        })
    }
}

/// A file-system error as a store error naming the path.
fn failed(op: &'static str, path: &Path, e: &std::io::Error) -> StoreError {
    StoreError::failed(op, Cause::Io, format!("{}: {e}", path.display()))
}

impl ObjectStore for FileStore {
    fn exists(&self, keys: &[&[u8]]) -> Result<Vec<bool>, StoreError> {
        self.paths(keys)?
            .into_iter()
            .map(|(_, file)| match fs::metadata(&file) {
                Ok(_) => Ok(true),
                Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
                Err(e) => Err(failed("exists", &file, &e)),
            })
            .collect()
    }

    fn put(&self, keys: &[&[u8]], values: &[&[u8]]) -> Result<Vec<bool>, StoreError> {
        let parts: Vec<Parts<'_>> = values.iter().map(|v| [*v, &[][..]]).collect();
        self.put_parts(keys, &parts)
    }

    fn put_parts(&self, keys: &[&[u8]], values: &[Parts<'_>]) -> Result<Vec<bool>, StoreError> {
        StoreError::check_len("values", values.len(), keys.len())?;
        self.paths(keys)?
            .iter()
            .zip(values)
            .map(|((fan, file), v)| self.put_one(fan, file, *v))
            .collect()
    }

    fn get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        get_via_each(self, keys, Cause::Io)
    }

    fn get_each(
        &self,
        keys: &[&[u8]],
        visit: &mut dyn FnMut(usize, Object<'_>),
    ) -> Result<(), StoreError> {
        let paths = self.paths(keys)?;
        let mut buf = self.scratch.lock();
        for (i, (_, file)) in paths.iter().enumerate() {
            match self.read_one(file, &mut buf)? {
                Ok(true) => visit(i, Object::Bytes(&buf)),
                Ok(false) => visit(i, Object::Missing),
                Err(why) => visit(i, Object::Unreadable(&format!("{}: {why}", file.display()))),
            }
        }
        Ok(())
    }

    fn delete(&self, keys: &[&[u8]]) -> Result<(), StoreError> {
        for (_, file) in self.paths(keys)? {
            let removed = match fs::remove_file(&file) {
                // What is not a file under a key's name is removed too: only this
                // store writes there.
                Err(_) if file.is_dir() => fs::remove_dir_all(&file),
                other => other,
            };
            match removed {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(failed("delete", &file, &e)),
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), StoreError> {
        let meta = fs::metadata(&self.dir).map_err(|e| failed("check", &self.dir, &e))?;
        if !meta.is_dir() {
            return Err(StoreError::failed(
                "check",
                Cause::Io,
                format!("{}: not a directory", self.dir.display()),
            ));
        }
        let probe = self.dir.join(self.temp_name("check"));
        let written = fs::write(&probe, b"radixcache");
        let _ = fs::remove_file(&probe);
        written.map_err(|e| failed("check", &self.dir, &e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A store in a fresh directory, removed on drop.
    struct Temp(FileStore);

    impl Drop for Temp {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(self.0.dir());
        }
    }

    fn temp(tag: &str) -> Temp {
        let dir = std::env::temp_dir().join(format!("rcl3-file-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        Temp(FileStore::new(dir).unwrap())
    }

    fn keys(n: usize) -> Vec<Vec<u8>> {
        (0..n)
            .map(|i| format!("page/{i:04}").into_bytes())
            .collect()
    }

    fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
        v.iter().map(Vec::as_slice).collect()
    }

    /// Every file under the store's directory.
    fn files(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        for fan in fs::read_dir(dir).unwrap() {
            for f in fs::read_dir(fan.unwrap().path()).unwrap() {
                out.push(f.unwrap().file_name().to_string_lossy().into_owned());
            }
        }
        out
    }

    #[test]
    fn round_trip_exists_get_delete() {
        let t = temp("round");
        let s = &t.0;
        let k = keys(40);
        let v: Vec<Vec<u8>> = (0..40u8).map(|i| vec![i; usize::from(i) * 10]).collect();
        assert_eq!(s.exists(&refs(&k)).unwrap(), vec![false; 40]);
        assert_eq!(s.put(&refs(&k), &refs(&v)).unwrap(), vec![true; 40]);
        assert_eq!(s.exists(&refs(&k)).unwrap(), vec![true; 40]);
        let got = s.get(&refs(&k)).unwrap();
        assert_eq!(got, v.iter().cloned().map(Some).collect::<Vec<_>>());
        s.delete(&refs(&k[..20])).unwrap();
        let mut want = vec![false; 20];
        want.extend([true; 20]);
        assert_eq!(s.exists(&refs(&k)).unwrap(), want);
        assert_eq!(s.get(&refs(&k[..1])).unwrap(), vec![None]);
        // Deleting what is gone is no error.
        s.delete(&refs(&k[..20])).unwrap();
        // Spread over fan-out directories, no temporary files left.
        assert!(fs::read_dir(s.dir()).unwrap().count() > 10);
        assert!(files(s.dir()).iter().all(|f| f.starts_with('k')));
    }

    #[test]
    fn put_is_write_once() {
        let t = temp("once");
        let s = &t.0;
        let k = keys(3);
        s.put(&refs(&k), &[b"first".as_slice(); 3]).unwrap();
        assert_eq!(
            s.put(&refs(&k), &[b"second".as_slice(); 3]).unwrap(),
            vec![false; 3]
        );
        assert_eq!(s.get(&refs(&k)).unwrap(), vec![Some(b"first".to_vec()); 3]);
    }

    #[test]
    fn objects_in_parts_are_stored_joined() {
        let t = temp("parts");
        let s = &t.0;
        let k = keys(2);
        let parts: [Parts<'_>; 2] = [[b"head", b"body"], [b"", b""]];
        assert_eq!(s.put_parts(&refs(&k), &parts).unwrap(), [true, true]);
        assert_eq!(s.put_parts(&refs(&k), &parts).unwrap(), [false, false]);
        assert_eq!(
            s.get(&refs(&k)).unwrap(),
            [Some(b"headbody".to_vec()), Some(Vec::new())]
        );
        let e = s.put_parts(&refs(&k), &parts[..1]).unwrap_err();
        assert_eq!(e.to_string(), "values: 1 given for 2 keys");
    }

    #[test]
    fn racing_writers_store_exactly_one_value() {
        let t = Arc::new(temp("race"));
        let threads: Vec<_> = (0..4u8)
            .map(|w| {
                let t = Arc::clone(&t);
                std::thread::spawn(move || {
                    let k = keys(50);
                    let v = vec![w; 4096];
                    t.0.put(&refs(&k), &vec![v.as_slice(); 50]).unwrap()
                })
            })
            .collect();
        let stored: Vec<Vec<bool>> = threads.into_iter().map(|h| h.join().unwrap()).collect();
        let k = keys(50);
        let got = t.0.get(&refs(&k)).unwrap();
        for (i, value) in got.into_iter().enumerate() {
            let winners: Vec<u8> = (0..4u8).filter(|&w| stored[usize::from(w)][i]).collect();
            assert_eq!(winners.len(), 1, "key {i}: {winners:?}");
            assert_eq!(value.unwrap(), vec![winners[0]; 4096]);
        }
        assert!(files(t.0.dir()).iter().all(|f| f.starts_with('k')));
    }

    #[test]
    fn keys_are_any_bytes_up_to_the_limit() {
        let t = temp("keys");
        let s = &t.0;
        let odd: Vec<Vec<u8>> = vec![vec![], vec![0, b'/', 0xff], vec![b'.'; MAX_KEY_LEN]];
        assert_eq!(s.put(&refs(&odd), &refs(&odd)).unwrap(), vec![true; 3]);
        assert_eq!(
            s.get(&refs(&odd)).unwrap(),
            odd.iter().cloned().map(Some).collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_long_key_fails_the_batch_before_any_write() {
        let t = temp("long");
        let s = &t.0;
        let k = vec![b"ok".to_vec(), vec![1; MAX_KEY_LEN + 1]];
        let e = s.put(&refs(&k), &refs(&k)).unwrap_err();
        assert_eq!(
            e,
            StoreError::KeyTooLong {
                index: 1,
                len: 128,
                max: 127
            }
        );
        assert_eq!(
            e.to_string(),
            "key 1 is 128 bytes, over the backend's limit of 127"
        );
        assert_eq!(s.exists(&refs(&k[..1])).unwrap(), vec![false]);
        for r in [
            s.exists(&refs(&k)).map(drop),
            s.get(&refs(&k)).map(drop),
            s.delete(&refs(&k)),
        ] {
            assert!(matches!(r, Err(StoreError::KeyTooLong { index: 1, .. })));
        }
    }

    #[test]
    fn values_must_match_keys() {
        let t = temp("mismatch");
        let e = t.0.put(&refs(&keys(2)), &[b"x".as_slice()]).unwrap_err();
        assert_eq!(e.to_string(), "values: 1 given for 2 keys");
    }

    #[test]
    fn file_system_errors_name_the_path() {
        let t = temp("fs");
        let s = &t.0;
        let k = keys(1);
        // A regular file where the key's fan-out directory should be.
        let (fan, _) = s.path(0, &k[0]).unwrap();
        fs::write(&fan, b"in the way").unwrap();
        let e = s.put(&refs(&k), &refs(&k)).unwrap_err();
        match &e {
            StoreError::Failed {
                op: "put",
                cause: Cause::Io,
                detail,
            } => {
                assert!(detail.contains(&fan.display().to_string()), "{detail}");
            }
            other => panic!("{other}"),
        }
        assert!(matches!(
            s.exists(&refs(&k)),
            Err(StoreError::Failed { op: "exists", .. })
        ));
        assert!(matches!(
            s.get(&refs(&k)),
            Err(StoreError::Failed { op: "get", .. })
        ));
        assert!(matches!(
            s.delete(&refs(&k)),
            Err(StoreError::Failed { op: "delete", .. })
        ));
    }

    /// What `get_each` hands out for one key, owned: the bytes or nothing, or why not.
    type Seen = (usize, Result<Option<Vec<u8>>, String>);

    fn each(s: &FileStore, k: &[Vec<u8>]) -> Vec<Seen> {
        let mut seen = Vec::new();
        s.get_each(&refs(k), &mut |i, object| {
            seen.push((
                i,
                match object {
                    Object::Missing => Ok(None),
                    Object::Bytes(b) => Ok(Some(b.to_vec())),
                    Object::Unreadable(why) => Err(why.to_owned()),
                },
            ));
        })
        .unwrap();
        seen
    }

    #[test]
    fn a_key_that_is_not_a_readable_file_is_unreadable_and_deletable() {
        let t = temp("unreadable");
        let s = &t.0;
        let k = keys(4);
        s.put(&refs(&k[..1]), &[b"fine".as_slice()]).unwrap();
        // A directory (with something in it) and a FIFO (which would block a read) under
        // keys 1 and 2; key 3 holds nothing.
        let (fan, dir) = s.path(1, &k[1]).unwrap();
        fs::create_dir_all(dir.join("inside")).unwrap();
        let (fan2, fifo) = s.path(2, &k[2]).unwrap();
        fs::create_dir_all(&fan2).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let seen = each(s, &k);
        assert_eq!(seen[0], (0, Ok(Some(b"fine".to_vec()))));
        let why = seen[1].1.clone().unwrap_err();
        assert!(
            why.ends_with(": a directory") && why.contains(&dir.display().to_string()),
            "{why}"
        );
        assert!(seen[2]
            .1
            .clone()
            .unwrap_err()
            .ends_with(": not a regular file"));
        assert_eq!(seen[3], (3, Ok(None)));
        // `get` refuses the batch, naming the key.
        let e = s.get(&refs(&k)).unwrap_err();
        assert_eq!(e.cause(), Cause::Io);
        assert!(
            e.to_string().starts_with("get failed: i/o error: key 1: "),
            "{e}"
        );
        // Deleting removes them whatever they are.
        s.delete(&refs(&k)).unwrap();
        assert!(!dir.exists() && !fifo.exists() && fan.is_dir());
        assert_eq!(s.exists(&refs(&k)).unwrap(), [false; 4]);
    }

    #[test]
    fn a_file_over_the_maximum_object_size_is_unreadable_without_being_read() {
        let dir = std::env::temp_dir().join(format!("rcl3-file-max-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let options = Options {
            max_object_size: 10,
            ..Options::default()
        };
        let t = Temp(FileStore::with_options(&dir, options).unwrap());
        let s = &t.0;
        let k = keys(2);
        s.put(&refs(&k), &[b"0123456789".as_slice(), b"0123456789!"])
            .unwrap();
        let seen = each(s, &k);
        assert_eq!(seen[0], (0, Ok(Some(b"0123456789".to_vec()))));
        let why = seen[1].1.clone().unwrap_err();
        assert!(
            why.ends_with(": 11 bytes, over the maximum object size of 10"),
            "{why}"
        );
    }

    #[test]
    fn check_says_whether_the_directory_takes_files() {
        let t = temp("check");
        t.0.check().unwrap();
        // No probe file is left behind.
        assert_eq!(fs::read_dir(t.0.dir()).unwrap().count(), 0);
        // Gone, or a file where the directory was.
        fs::remove_dir_all(t.0.dir()).unwrap();
        let e = t.0.check().unwrap_err();
        assert!(
            e.to_string().starts_with("check failed: i/o error: "),
            "{e}"
        );
        fs::write(t.0.dir(), b"x").unwrap();
        let e = t.0.check().unwrap_err();
        assert!(e.to_string().ends_with(": not a directory"), "{e}");
        fs::remove_file(t.0.dir()).unwrap();
    }
}
