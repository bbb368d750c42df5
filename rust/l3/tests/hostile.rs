//! The Redis stores against fake servers on loopback that send what a real server will
//! not: oversized and negative lengths, lines that never end, replies trickled a byte at
//! a time, `-WRONGTYPE` for one key of a batch, endless redirects. Every call must end in
//! a `StoreError` (never a crash, never a wait past its deadline) whose cause says why.
//!
//! The fake ([`Fake`]) is a tiny in-memory Redis (`SET NX`, `GET`, `EXISTS`, `DEL`,
//! `PING`, `AUTH`, `SELECT`, `CLUSTER SLOTS` naming itself for every slot) whose answer to
//! any command a test can replace.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::sleep;
use std::time::{Duration, Instant};

use radixcache_l3::{
    get_pages_into, open, put_pages, Cause, Fetched, Kind, Label, Object, ObjectStore, Options,
    StoreError,
};

/// The label of the framed objects these tests write.
const LABEL: Label = Label {
    kind: Kind::KvPage,
    identity: [9; 32],
};

/// What the fake does with a command.
enum Answer {
    /// Sends these bytes.
    Send(Vec<u8>),
    /// Sends these bytes one at a time, this long apart.
    Trickle(Vec<u8>, Duration),
    /// Sends this byte, this long apart, until the client goes.
    TrickleForever(u8, Duration),
    /// Sends this byte as fast as it can until the client goes.
    Flood(u8),
    /// Sends these bytes in chunks of [`CHUNK`], [`GAP`] apart (about 13 MB/s).
    Paced(Vec<u8>),
    /// Sends these bytes, then closes the connection.
    Last(Vec<u8>),
    /// Closes the connection.
    Close,
    /// What the in-memory Redis answers.
    Normal,
}

/// The chunk and the gap of a paced transfer.
const CHUNK: usize = 64 * 1024;
const GAP: Duration = Duration::from_millis(5);

/// A command's arguments.
type Command = Vec<Vec<u8>>;

/// The in-memory Redis's strings (shared, so that a large value is sent without a copy).
type Data = HashMap<Vec<u8>, Arc<Vec<u8>>>;

/// The hook a test gives: its answer to a command on the `n`th connection (from 1).
type Hook = dyn Fn(usize, &Command) -> Answer + Send + Sync;

/// A fake Redis on a loopback port; its threads end with the test process.
struct Fake {
    port: u16,
    /// Connections accepted.
    conns: Arc<AtomicUsize>,
    /// Every command received, in order.
    log: Arc<Mutex<Vec<Command>>>,
    /// Keys holding a list: `GET` answers `-WRONGTYPE`, `DEL` removes them.
    lists: Arc<Mutex<HashSet<Vec<u8>>>>,
}

impl Fake {
    fn start(hook: impl Fn(u16, usize, &Command) -> Answer + Send + Sync + 'static) -> Fake {
        Fake::with(false, hook)
    }

    /// `paced`: arguments longer than [`CHUNK`] are read a chunk every [`GAP`].
    fn with(
        paced: bool,
        hook: impl Fn(u16, usize, &Command) -> Answer + Send + Sync + 'static,
    ) -> Fake {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let fake = Fake {
            port,
            conns: Arc::default(),
            log: Arc::default(),
            lists: Arc::default(),
        };
        let hook: Arc<Hook> = Arc::new(move |n, cmd| hook(port, n, cmd));
        let data: Arc<Mutex<Data>> = Arc::default();
        let (conns, log, lists) = (fake.conns.clone(), fake.log.clone(), fake.lists.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let n = conns.fetch_add(1, Ordering::SeqCst) + 1;
                let (hook, data, log, lists) =
                    (hook.clone(), data.clone(), log.clone(), lists.clone());
                std::thread::spawn(move || {
                    serve(&stream, paced, port, n, &*hook, &data, &log, &lists);
                });
            }
        });
        fake
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn cluster_url(&self) -> String {
        format!("redis+cluster://127.0.0.1:{}", self.port)
    }

    /// The commands received whose name is `name`.
    fn commands(&self, name: &str) -> Vec<Command> {
        let log = self.log.lock().unwrap();
        log.iter()
            .filter(|c| c[0].eq_ignore_ascii_case(name.as_bytes()))
            .cloned()
            .collect()
    }
}

/// Reads one command (an array of bulk strings), a long argument a chunk every [`GAP`]
/// if `paced`; `None` when the client went.
fn read_command(r: &mut impl BufRead, paced: bool) -> Option<Command> {
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let n: usize = line.trim_end().strip_prefix('*')?.parse().ok()?;
    let mut args = Vec::with_capacity(n);
    for _ in 0..n {
        line.clear();
        r.read_line(&mut line).ok()?;
        let len: usize = line.trim_end().strip_prefix('$')?.parse().ok()?;
        let mut arg = vec![0; len + 2];
        if paced {
            for chunk in arg.chunks_mut(CHUNK) {
                sleep(GAP);
                r.read_exact(chunk).ok()?;
            }
        } else {
            r.read_exact(&mut arg).ok()?;
        }
        arg.truncate(len);
        args.push(arg);
    }
    Some(args)
}

fn bulk(v: &[u8]) -> Vec<u8> {
    let mut out = format!("${}\r\n", v.len()).into_bytes();
    out.extend_from_slice(v);
    out.extend_from_slice(b"\r\n");
    out
}

/// The in-memory Redis's answer: a reply, or a bulk string's value.
fn normal(
    port: u16,
    cmd: &Command,
    data: &Mutex<Data>,
    lists: &Mutex<HashSet<Vec<u8>>>,
) -> Result<Vec<u8>, Arc<Vec<u8>>> {
    let mut data = data.lock().unwrap();
    let mut lists = lists.lock().unwrap();
    let key = cmd.get(1).cloned().unwrap_or_default();
    Ok(match cmd[0].to_ascii_uppercase().as_slice() {
        b"PING" => b"+PONG\r\n".to_vec(),
        b"AUTH" | b"SELECT" | b"ASKING" => b"+OK\r\n".to_vec(),
        b"EXISTS" => {
            let there = data.contains_key(&key) || lists.contains(&key);
            format!(":{}\r\n", u8::from(there)).into_bytes()
        }
        b"SET" if data.contains_key(&key) || lists.contains(&key) => b"$-1\r\n".to_vec(),
        b"SET" => {
            data.insert(key, Arc::new(cmd[2].clone()));
            b"+OK\r\n".to_vec()
        }
        b"GET" if lists.contains(&key) => {
            b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n".to_vec()
        }
        b"GET" => match data.get(&key) {
            Some(v) => return Err(v.clone()),
            None => b"$-1\r\n".to_vec(),
        },
        b"DEL" => {
            let gone = data.remove(&key).is_some() | lists.remove(&key);
            format!(":{}\r\n", u8::from(gone)).into_bytes()
        }
        b"CLUSTER" => {
            format!("*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:{port}\r\n$2\r\nid\r\n")
                .into_bytes()
        }
        other => format!(
            "-ERR unknown command {:?}\r\n",
            String::from_utf8_lossy(other)
        )
        .into_bytes(),
    })
}

#[allow(clippy::too_many_arguments)] // a test's fake: what one connection shares
fn serve(
    stream: &TcpStream,
    paced: bool,
    port: u16,
    n: usize,
    hook: &Hook,
    data: &Mutex<Data>,
    log: &Mutex<Vec<Command>>,
    lists: &Mutex<HashSet<Vec<u8>>>,
) {
    let mut reader = BufReader::new(stream);
    let mut w = stream;
    while let Some(cmd) = read_command(&mut reader, paced) {
        log.lock().unwrap().push(cmd.clone());
        let sent = match hook(n, &cmd) {
            Answer::Normal => match normal(port, &cmd, data, lists) {
                Ok(reply) => w.write_all(&reply),
                Err(value) => w
                    .write_all(format!("${}\r\n", value.len()).as_bytes())
                    .and_then(|()| w.write_all(&value))
                    .and_then(|()| w.write_all(b"\r\n")),
            },
            Answer::Send(bytes) => w.write_all(&bytes),
            Answer::Trickle(bytes, gap) => bytes.iter().try_for_each(|b| {
                sleep(gap);
                w.write_all(&[*b])
            }),
            Answer::TrickleForever(b, gap) => loop {
                sleep(gap);
                if let Err(e) = w.write_all(&[b]) {
                    break Err(e);
                }
            },
            Answer::Paced(bytes) => bytes.chunks(CHUNK).try_for_each(|c| {
                sleep(GAP);
                w.write_all(c)
            }),
            Answer::Flood(b) => {
                let chunk = vec![b; 64 * 1024];
                loop {
                    if let Err(e) = w.write_all(&chunk) {
                        break Err(e);
                    }
                }
            }
            Answer::Last(bytes) => {
                let _ = w.write_all(&bytes);
                return;
            }
            Answer::Close => return,
        };
        if sent.is_err() {
            return;
        }
    }
}

fn options(timeout_ms: u64) -> Options {
    Options::with_timeout(Duration::from_millis(timeout_ms))
}

/// Runs `f`, checks that it failed within `limit`; the error.
fn fails_within<T: std::fmt::Debug>(
    limit: Duration,
    f: impl FnOnce() -> Result<T, StoreError>,
) -> StoreError {
    let t = Instant::now();
    let e = f().unwrap_err();
    let took = t.elapsed();
    assert!(took < limit, "{e} after {took:?}");
    e
}

/// Every key's object, owned, from `get_each`.
fn each(store: &dyn ObjectStore, keys: &[&[u8]]) -> Result<Vec<String>, StoreError> {
    let mut seen = vec![String::new(); keys.len()];
    store.get_each(keys, &mut |i, object| {
        seen[i] = match object {
            Object::Missing => "missing".to_owned(),
            Object::Bytes(b) => String::from_utf8_lossy(b).into_owned(),
            Object::Unreadable(why) => format!("unreadable: {why}"),
        };
    })?;
    Ok(seen)
}

const K: &[u8] = b"k";

/// Both kinds of store on the fake.
fn stores(fake: &Fake, timeout_ms: u64) -> Vec<Box<dyn ObjectStore>> {
    vec![
        open(&fake.url(), options(timeout_ms)).unwrap(),
        open(&fake.cluster_url(), options(timeout_ms)).unwrap(),
    ]
}

/// A fake that answers every data command with `reply`.
fn answering(reply: &'static [u8]) -> Fake {
    Fake::start(move |_, _, cmd| {
        if cmd[0] == b"CLUSTER" {
            Answer::Normal
        } else {
            Answer::Send(reply.to_vec())
        }
    })
}

#[test]
fn a_huge_bulk_length_is_a_protocol_error_before_any_allocation() {
    let fake = answering(b"$9000000000000000000\r\n");
    for store in stores(&fake, 500) {
        let e = each(&*store, &[K]).unwrap_err();
        assert_eq!(e.cause(), Cause::Protocol, "{e}");
        assert!(
            e.to_string().ends_with(&format!(
                "127.0.0.1:{}: a bulk string of 9000000000000000000 bytes, over the limit \
                 of 536870912",
                fake.port
            )),
            "{e}"
        );
        let e = store.exists(&[K]).unwrap_err();
        assert_eq!(e.cause(), Cause::Protocol, "{e}");
    }
    // The limit is the store's maximum object size.
    let fake = answering(b"$11\r\n0123456789a\r\n");
    let small = Options {
        max_object_size: 10,
        ..options(500)
    };
    let store = open(&fake.url(), small).unwrap();
    let e = store.get(&[K]).unwrap_err();
    assert!(e.to_string().contains("bytes, over the limit of 10"), "{e}");
    let store = open(&fake.url(), options(500)).unwrap();
    assert_eq!(store.get(&[K]).unwrap(), [Some(b"0123456789a".to_vec())]);
}

#[test]
fn negative_lengths_other_than_nil_are_protocol_errors() {
    for (reply, what) in [
        (&b"$-2\r\n"[..], "a bulk string of negative length -2"),
        (b"*-3\r\n", "an array of negative length -3"),
    ] {
        let fake = answering(reply);
        for store in stores(&fake, 500) {
            let e = each(&*store, &[K]).unwrap_err();
            assert_eq!(e.cause(), Cause::Protocol, "{e}");
            assert!(e.to_string().ends_with(what), "{e}");
        }
    }
    // `$-1` is nil.
    let fake = answering(b"$-1\r\n");
    for store in stores(&fake, 500) {
        assert_eq!(each(&*store, &[K]).unwrap(), ["missing"]);
    }
}

#[test]
fn a_line_that_never_ends_is_cut_at_the_line_limit() {
    let fake = Fake::start(|_, _, cmd| {
        if cmd[0] == b"CLUSTER" {
            Answer::Normal
        } else {
            Answer::Flood(b'a')
        }
    });
    for store in stores(&fake, 5_000) {
        let e = fails_within(Duration::from_secs(4), || store.exists(&[K]));
        assert_eq!(e.cause(), Cause::Protocol, "{e}");
        assert!(
            e.to_string()
                .ends_with("a reply line longer than 65536 bytes"),
            "{e}"
        );
    }
}

#[test]
fn a_store_trickling_its_reply_fails_the_call_at_its_deadline() {
    // A byte every 0.1 s: each read gets one in time, but the call's deadline (200 ms,
    // plus 200 ms for connecting) ends it.
    let gap = Duration::from_millis(100);
    for answer in [0, 1] {
        let fake = Fake::start(move |_, _, cmd| match (cmd[0].as_slice(), answer) {
            (b"CLUSTER", _) => Answer::Normal,
            (_, 0) => Answer::TrickleForever(b'a', gap),
            // A value announced whole and sent slowly.
            (_, _) => Answer::Trickle(bulk(&[b'v'; 200]), gap),
        });
        for store in stores(&fake, 200) {
            let e = fails_within(Duration::from_millis(1500), || store.exists(&[K]));
            assert!(e.is_timeout(), "{e}");
            assert!(
                e.to_string()
                    .contains("the call's deadline passed (400 ms for "),
                "{e}"
            );
            let e = fails_within(Duration::from_millis(1500), || each(&*store, &[K, K]));
            assert_eq!(e.cause(), Cause::Timeout, "{e}");
        }
    }
}

#[test]
fn a_large_value_moving_above_the_floor_earns_its_time() {
    // 4 MB each way, paced by the fake at about 13 MB/s (64 KiB every 5 ms, some 320 ms),
    // with a 100 ms timeout and a floor of 1 MB/s: each byte moved buys 1 µs, so the call
    // passes, while a byte every 0.1 s fails (above). (The default floor is 100 MB/s.)
    let value = vec![7u8; 4 << 20];
    let big = value.clone();
    let fake = Fake::with(true, move |_, _, cmd| match cmd[0].as_slice() {
        b"GET" => Answer::Paced(bulk(&big)),
        _ => Answer::Normal,
    });
    let options = Options {
        min_rate: 1_000_000,
        ..options(100)
    };
    for url in [fake.url(), fake.cluster_url()] {
        let store = open(&url, options).unwrap();
        let key: &[u8] = b"big";
        store.delete(&[key]).unwrap();
        let t = Instant::now();
        assert_eq!(store.put(&[key], &[&value]).unwrap(), [true]);
        let mut got = 0;
        store
            .get_each(&[key], &mut |_, object| {
                assert!(object == Object::Bytes(&value));
                got += 1;
            })
            .unwrap();
        assert_eq!(got, 1);
        // Each way took longer than the timeout.
        assert!(
            t.elapsed() > Duration::from_millis(400),
            "{:?}",
            t.elapsed()
        );
    }
}

#[test]
fn a_key_of_another_type_is_corrupt_deleted_and_the_rest_served() {
    let fake = Fake::start(|_, _, _| Answer::Normal);
    for (which, store) in stores(&fake, 500).iter().enumerate() {
        let keys: Vec<Vec<u8>> = (0..3)
            .map(|i| format!("t{which}:{i}").into_bytes())
            .collect();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let hashes = [[1u8; 32], [2; 32], [3; 32]];
        let pages = [[1u8; 64], [2; 64], [3; 64]];
        put_pages(
            &**store,
            &LABEL,
            &[refs[0], refs[2]],
            &[hashes[0], hashes[2]],
            &[&pages[0], &pages[2]],
        )
        .unwrap();
        // Key 1 holds a list.
        fake.lists.lock().unwrap().insert(keys[1].clone());
        // get_each: the one key unreadable, the others served.
        let seen = each(&**store, &refs).unwrap();
        assert_eq!(
            seen[1],
            format!(
                "unreadable: 127.0.0.1:{}: WRONGTYPE Operation against a key holding the wrong \
             kind of value",
                fake.port
            )
        );
        assert!(seen[0].len() > 64 && seen[2].len() > 64, "{seen:?}");
        // get: refused, naming the key.
        let err = store.get(&refs).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("get failed: server error: key 1: "),
            "{err}"
        );
        // Pages: the others land, the list counts as corrupt and is deleted.
        let mut out = [[0u8; 64]; 3];
        let mut rows: Vec<&mut [u8]> = out.iter_mut().map(<[u8; 64]>::as_mut_slice).collect();
        let got = get_pages_into(&**store, &LABEL, &refs, &hashes, &mut rows).unwrap();
        assert_eq!((&got[0], &got[2]), (&Fetched::Ok, &Fetched::Ok));
        assert_eq!(got[1].as_str(), "corrupt");
        assert!(matches!(&got[1], Fetched::Unreadable(why) if why.contains("WRONGTYPE")));
        assert_eq!((out[0], out[1], out[2]), (pages[0], [0; 64], pages[2]));
        assert!(fake.lists.lock().unwrap().is_empty());
        let dels = fake.commands("DEL");
        assert_eq!(dels.last().unwrap()[1], keys[1]);
        assert_eq!(store.exists(&refs).unwrap(), [true, false, true]);
    }
}

#[test]
fn after_a_protocol_error_the_connection_is_dropped() {
    // The first connection's first answer breaks the protocol; later ones are fine.
    let fake = Fake::start(|_, n, cmd| match (n, cmd[0].as_slice()) {
        (1, _) => Answer::Send(b"?garbage\r\n".to_vec()),
        _ => Answer::Normal,
    });
    let store = open(&fake.url(), options(500)).unwrap();
    let e = store.exists(&[K, K]).unwrap_err();
    assert_eq!(e.cause(), Cause::Protocol);
    assert!(e.to_string().ends_with("unexpected reply type '?'"), "{e}");
    assert_eq!(store.exists(&[K, K]).unwrap(), [false, false]);
    assert_eq!(fake.conns.load(Ordering::SeqCst), 2);
}

#[test]
fn replies_that_do_not_fit_the_command_are_errors_with_causes() {
    for (reply, cause, want) in [
        (&b":1\r\n"[..], Cause::Protocol, "GET answered integer 1"),
        (b"+OK\r\n", Cause::Protocol, "GET answered OK"),
        (b"-ERR no\r\n", Cause::Server, "ERR no"),
        (
            b"-NOAUTH Authentication required.\r\n",
            Cause::AuthFailed,
            "NOAUTH",
        ),
        (
            b"-CLUSTERDOWN The cluster is down\r\n",
            Cause::Cluster,
            "CLUSTERDOWN",
        ),
        (
            b"$5\r\nabcdefg",
            Cause::Protocol,
            "a bulk string without CRLF",
        ),
        (
            b":1",
            Cause::Closed,
            "closed the connection in the middle of a reply",
        ),
        (b"", Cause::Closed, "closed the connection"),
    ] {
        let fake = Fake::start(move |_, _, _| Answer::Last(reply.to_vec()));
        let store = open(&fake.url(), options(500)).unwrap();
        let e = each(&*store, &[K]).unwrap_err();
        assert_eq!(e.cause(), cause, "{e} for {reply:?}");
        assert!(e.to_string().contains(want), "{e} for {reply:?}");
    }
    let fake = Fake::start(|_, _, _| Answer::Close);
    let store = open(&fake.url(), options(500)).unwrap();
    let e = store.put(&[K], &[b"v"]).unwrap_err();
    assert_eq!(e.cause(), Cause::Closed, "{e}");
    assert!(
        e.to_string().starts_with("put failed: connection closed: "),
        "{e}"
    );
    let e = store.check().unwrap_err();
    assert_eq!(e.cause(), Cause::Closed, "{e}");
}

#[test]
fn setup_refusals_say_which() {
    let fake = Fake::start(|_, _, cmd| match cmd[0].as_slice() {
        b"AUTH" => Answer::Send(b"-WRONGPASS invalid username-password pair\r\n".to_vec()),
        b"SELECT" => Answer::Send(b"-ERR DB index is out of range\r\n".to_vec()),
        _ => Answer::Normal,
    });
    let port = fake.port;
    let e = open(&format!("redis://:pw@127.0.0.1:{port}"), options(500))
        .unwrap()
        .check()
        .unwrap_err();
    assert_eq!(e.cause(), Cause::AuthFailed);
    assert_eq!(
        e.to_string(),
        format!(
            "check failed: authentication failed: 127.0.0.1:{port}: AUTH refused: WRONGPASS \
             invalid username-password pair"
        )
    );
    let e = open(&format!("redis://127.0.0.1:{port}/3"), options(500))
        .unwrap()
        .exists(&[K])
        .unwrap_err();
    assert_eq!(e.cause(), Cause::BadDatabase);
    assert!(
        e.to_string()
            .ends_with("SELECT refused: ERR DB index is out of range"),
        "{e}"
    );
    // The user and password go as AUTH's arguments, decoded.
    let _ = open(
        &format!("redis://a%40b:p%3Aw@127.0.0.1:{port}"),
        options(500),
    )
    .unwrap()
    .check();
    let auth = fake.commands("AUTH");
    assert_eq!(
        auth.last().unwrap()[1..],
        [b"a@b".to_vec(), b"p:w".to_vec()]
    );
}

#[test]
fn nothing_listening_is_connection_refused() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    for url in [
        format!("redis://127.0.0.1:{port}"),
        format!("redis+cluster://127.0.0.1:{port}"),
    ] {
        let store = open(&url, options(200)).unwrap();
        let e = fails_within(Duration::from_secs(1), || store.check());
        assert_eq!(e.cause(), Cause::ConnectionRefused, "{e}");
        assert!(
            e.to_string().starts_with(&format!(
                "check failed: connection refused: connecting to 127.0.0.1:{port}: "
            )),
            "{e}"
        );
        let e = store.exists(&[K]).unwrap_err();
        assert_eq!(e.cause(), Cause::ConnectionRefused, "{e}");
    }
}

#[test]
fn a_cluster_that_redirects_for_ever_fails_within_the_deadline() {
    let fake = Fake::start(|port, _, cmd| match cmd[0].as_slice() {
        b"GET" => Answer::Send(format!("-MOVED 1 127.0.0.1:{port}\r\n").into_bytes()),
        _ => Answer::Normal,
    });
    let store = open(&fake.cluster_url(), options(500)).unwrap();
    let e = fails_within(Duration::from_secs(2), || each(&*store, &[K]));
    assert_eq!(e.cause(), Cause::Cluster, "{e}");
    assert!(
        e.to_string()
            .ends_with("keys still redirected after 5 rounds"),
        "{e}"
    );
    // Each MOVED re-read the topology.
    assert!(fake.commands("CLUSTER").len() >= 5);
}

#[test]
fn a_cluster_ask_to_a_dead_node_fails_with_its_cause() {
    let dead = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let fake = Fake::start(move |_, _, cmd| match cmd[0].as_slice() {
        b"GET" => Answer::Send(format!("-ASK 1 127.0.0.1:{dead}\r\n").into_bytes()),
        _ => Answer::Normal,
    });
    let store = open(&fake.cluster_url(), options(500)).unwrap();
    let e = each(&*store, &[K]).unwrap_err();
    assert_eq!(e.cause(), Cause::ConnectionRefused, "{e}");
    assert!(
        e.to_string()
            .contains(&format!("connecting to 127.0.0.1:{dead}")),
        "{e}"
    );
}

#[test]
fn a_bad_cluster_topology_is_refused_with_its_cause() {
    for (answer, cause, want) in [
        (
            &b"-ERR This instance has cluster support disabled\r\n"[..],
            Cause::Cluster,
            "CLUSTER SLOTS refused: ERR This instance has cluster support disabled",
        ),
        (
            b"*1\r\n:5\r\n",
            Cause::Protocol,
            "a malformed CLUSTER SLOTS entry: integer 5",
        ),
        (
            b"*0\r\n",
            Cause::Cluster,
            "16384 of 16384 slots are served by no node (the first: 0)",
        ),
        (b"$9000000\r\n", Cause::Protocol, "over the limit of 65536"),
    ] {
        let fake = Fake::start(move |_, _, cmd| match cmd[0].as_slice() {
            b"CLUSTER" => Answer::Send(answer.to_vec()),
            _ => Answer::Normal,
        });
        let store = open(&fake.cluster_url(), options(500)).unwrap();
        let e = store.check().unwrap_err();
        assert_eq!(e.cause(), cause, "{e}");
        assert!(e.to_string().ends_with(want), "{e}");
    }
}

#[test]
fn check_passes_on_a_store_that_answers() {
    let fake = Fake::start(|_, _, _| Answer::Normal);
    for store in stores(&fake, 500) {
        store.check().unwrap();
    }
    assert_eq!(fake.commands("PING").len(), 2);
}
