//! The Redis stores against real `redis-server` processes, which each test starts on a
//! free loopback port in a temporary directory and kills at the end.
//!
//! Without `redis-server` on PATH a test returns early (saying so on stderr), unless
//! `RADIXCACHE_REQUIRE_REDIS=1` is set (as in CI), which turns that into a failure.

// The helpers below are test code too (outside `#[test]` functions, which clippy's
// test allowances do not reach): the skip notice is printed, and failures panic.
#![allow(clippy::print_stderr, clippy::unwrap_used, clippy::expect_used)]

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use radixcache_l3::{
    get_pages_into, open, put_pages, Cause, Fetched, Kind, Label, Object, ObjectStore, Options,
    Parts, RedisStore, StoreError,
};

/// The label of the framed objects these tests write.
const LABEL: Label = Label {
    kind: Kind::KvPage,
    identity: [9; 32],
};

/// Whether redis-server can be run here; panics when it cannot but must.
fn redis_available() -> bool {
    let found = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var("RADIXCACHE_REQUIRE_REDIS").as_deref() != Ok("1"),
            "redis-server is not on PATH and RADIXCACHE_REQUIRE_REDIS=1"
        );
        eprintln!("skipped: redis-server is not on PATH");
    }
    found
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A free port whose cluster-bus port (the port + 10000, where a cluster node also
/// listens) is free too: an ephemeral port above 55535 has none.
fn free_cluster_port() -> u16 {
    loop {
        let port = free_port();
        let Some(bus) = port.checked_add(10_000) else {
            continue;
        };
        if TcpListener::bind(("127.0.0.1", bus)).is_ok() {
            return port;
        }
    }
}

/// A redis-server on loopback, killed (and its directory removed) on drop.
struct Server {
    port: u16,
    dir: PathBuf,
    cluster: bool,
    extra: Vec<String>,
    child: Option<Child>,
}

impl Server {
    fn start(tag: &str, cluster: bool) -> Server {
        Server::start_with(tag, cluster, &[])
    }

    fn start_with(tag: &str, cluster: bool, extra: &[&str]) -> Server {
        let port = if cluster {
            free_cluster_port()
        } else {
            free_port()
        };
        let dir =
            std::env::temp_dir().join(format!("rcl3-redis-{tag}-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut s = Server {
            port,
            dir,
            cluster,
            extra: extra.iter().map(ToString::to_string).collect(),
            child: None,
        };
        s.restart();
        s
    }

    /// Starts the process (again, on the same port and directory); waits until it
    /// accepts connections.
    fn restart(&mut self) {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if self.cluster {
            cmd.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ])
            .args(["--cluster-node-timeout", "2000"]);
        }
        self.child = Some(cmd.spawn().unwrap());
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "redis-server on {} did not start",
                self.port
            );
            sleep(Duration::from_millis(20));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends SIGSTOP or SIGCONT: a stopped server keeps its connections open and never
    /// answers.
    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().unwrap().id();
        let ok = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {pid}");
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `redis-cli -p PORT ARGS...`'s output.
    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(
                self.extra
                    .iter()
                    .any(|a| a == "--requirepass")
                    .then_some(["-a", PASSWORD])
                    .into_iter()
                    .flatten(),
            )
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const PASSWORD: &str = "sekret";

/// Three cluster nodes, all masters, the slots split between them.
fn cluster(tag: &str) -> Vec<Server> {
    let nodes: Vec<Server> = (0..3)
        .map(|i| Server::start(&format!("{tag}{i}"), true))
        .collect();
    let addrs: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    let out = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addrs)
        .arg("--cluster-yes")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    wait_cluster_ok(&nodes);
    nodes
}

fn wait_cluster_ok(nodes: &[Server]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !nodes
        .iter()
        .all(|n| n.cli(&["cluster", "info"]).contains("cluster_state:ok"))
    {
        assert!(Instant::now() < deadline, "the cluster did not come up");
        sleep(Duration::from_millis(100));
    }
}

fn cluster_url(nodes: &[Server]) -> String {
    let addrs: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    format!("redis+cluster://{}", addrs.join(","))
}

fn keys(tag: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("{tag}:{i}").into_bytes()).collect()
}

fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
    v.iter().map(Vec::as_slice).collect()
}

/// Write-once, exists, get and delete, as every backend must do them.
fn round_trips(store: &dyn ObjectStore) {
    let k = keys("rt", 64);
    let v: Vec<Vec<u8>> = (0..64u8).map(|i| vec![i; 1000 + usize::from(i)]).collect();
    assert_eq!(store.exists(&refs(&k)).unwrap(), vec![false; 64]);
    assert_eq!(store.get(&refs(&k)).unwrap(), vec![None; 64]);
    assert_eq!(store.put(&refs(&k), &refs(&v)).unwrap(), vec![true; 64]);
    // Write-once: other bytes under the same keys leave the first.
    let other = vec![0xEEu8; 10];
    assert_eq!(
        store.put(&refs(&k), &vec![other.as_slice(); 64]).unwrap(),
        vec![false; 64]
    );
    assert_eq!(store.exists(&refs(&k)).unwrap(), vec![true; 64]);
    assert_eq!(
        store.get(&refs(&k)).unwrap(),
        v.iter().cloned().map(Some).collect::<Vec<_>>()
    );
    store.delete(&refs(&k[..32])).unwrap();
    let mut want = vec![false; 32];
    want.extend([true; 32]);
    assert_eq!(store.exists(&refs(&k)).unwrap(), want);
    assert_eq!(store.get(&refs(&k[..1])).unwrap(), vec![None]);
    // Objects in two parts are stored joined, write-once as well.
    let pk = keys("parts", 3);
    let parts: [Parts<'_>; 3] = [[b"ab", b"cd"], [b"", b"x"], [b"y", b""]];
    assert_eq!(store.put_parts(&refs(&pk), &parts).unwrap(), [true; 3]);
    assert_eq!(store.put_parts(&refs(&pk), &parts).unwrap(), [false; 3]);
    assert_eq!(
        store.get(&refs(&pk)).unwrap(),
        [
            Some(b"abcd".to_vec()),
            Some(b"x".to_vec()),
            Some(b"y".to_vec())
        ]
    );
    // Absent keys delete fine; empty batches need no round trip.
    store.delete(&refs(&k[..32])).unwrap();
    assert_eq!(store.exists(&[]).unwrap(), Vec::<bool>::new());
    assert_eq!(store.put(&[], &[]).unwrap(), Vec::<bool>::new());
    assert_eq!(store.get(&[]).unwrap(), Vec::<Option<Vec<u8>>>::new());
    store.delete(&[]).unwrap();
    // A mismatched batch is refused before the store is called.
    assert_eq!(
        store.put(&refs(&k[..2]), &[b"x".as_slice()]).unwrap_err(),
        StoreError::Mismatch {
            what: "values",
            len: 1,
            keys: 2
        }
    );
}

/// `get_each` hands out each object exactly, whatever the order of sizes (the stores read
/// them into one buffer a connection reuses), once a key (a cluster in its own order).
fn get_each_sizes(store: &dyn ObjectStore) {
    let sizes = [300_000usize, 10, 0, 70_000, 300_001, 1];
    let k = keys("each", sizes.len());
    let v: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| vec![u8::try_from(i).unwrap() + 1; n])
        .collect();
    store.put(&refs(&k), &refs(&v)).unwrap();
    let mut absent = k.clone();
    absent.insert(2, b"each:absent".to_vec());
    let mut seen = Vec::new();
    store
        .get_each(&refs(&absent), &mut |i, object| {
            seen.push((
                i,
                match object {
                    Object::Bytes(b) => Some(b.to_vec()),
                    Object::Missing => None,
                    Object::Unreadable(why) => panic!("{why}"),
                },
            ));
        })
        .unwrap();
    seen.sort_by_key(|(i, _)| *i);
    let mut want: Vec<(usize, Option<Vec<u8>>)> = Vec::new();
    for (i, value) in v.iter().enumerate() {
        want.push((want.len(), Some(value.clone())));
        if i == 1 {
            want.push((want.len(), None));
        }
    }
    assert_eq!(seen, want);
}

/// Framed pages through the store: verified on the way back, corrupt ones deleted; a key
/// holding a list (made by `rpush(key)`) is corrupt too, deleted, and the rest served.
fn framed_pages(store: &dyn ObjectStore, rpush: impl Fn(&str)) {
    let k = keys("pg", 4);
    let h = [[1u8; 32], [2; 32], [3; 32], [4; 32]];
    let pages = [vec![1u8; 4096], vec![2; 4096], vec![3; 4096], vec![4; 4096]];
    let p: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
    assert_eq!(
        put_pages(store, &LABEL, &refs(&k[..1]), &h[..1], &p[..1]).unwrap(),
        [true]
    );
    rpush("pg:1");
    store
        .put(&refs(&k[2..3]), &[b"not a frame".as_slice()])
        .unwrap();
    put_pages(store, &LABEL, &refs(&k[3..]), &h[3..], &p[3..]).unwrap();
    let mut out = vec![vec![0u8; 4096]; 4];
    let mut rows: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
    let got = get_pages_into(store, &LABEL, &refs(&k), &h, &mut rows).unwrap();
    assert_eq!(got[0], Fetched::Ok);
    assert!(
        matches!(&got[1], Fetched::Unreadable(why) if why.contains("WRONGTYPE")),
        "{got:?}"
    );
    assert_eq!([got[1].as_str(), got[2].as_str()], ["corrupt", "corrupt"]);
    assert_eq!(got[3], Fetched::Ok);
    assert_eq!((&out[0], &out[3]), (&pages[0], &pages[3]));
    assert!(out[1].iter().all(|&b| b == 0));
    assert_eq!(store.exists(&refs(&k)).unwrap(), [true, false, false, true]);
    // The deleted key takes a page again.
    assert_eq!(
        put_pages(store, &LABEL, &refs(&k[1..2]), &h[1..2], &p[1..2]).unwrap(),
        [true]
    );
}

fn timeout_options() -> Options {
    Options::with_timeout(Duration::from_millis(200))
}

/// Runs `f`, checks it failed within `limit`; the error.
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

#[test]
fn redis_round_trips_and_write_once() {
    if !redis_available() {
        return;
    }
    let server = Server::start("rt", false);
    let store = open(&server.url(), timeout_options()).unwrap();
    store.check().unwrap();
    round_trips(&*store);
    framed_pages(&*store, |key| {
        assert_eq!(server.cli(&["rpush", key, "x"]).trim(), "1");
    });
    get_each_sizes(&*store);
    // The database number in the URL is used.
    let db = open(&format!("{}/3", server.url()), timeout_options()).unwrap();
    db.put(&[b"only-in-3".as_slice()], &[b"x".as_slice()])
        .unwrap();
    assert_eq!(store.exists(&[b"only-in-3".as_slice()]).unwrap(), [false]);
    assert_eq!(server.cli(&["-n", "3", "exists", "only-in-3"]).trim(), "1");
}

#[test]
fn redis_down_fails_fast_and_a_restart_is_picked_up() {
    if !redis_available() {
        return;
    }
    let mut server = Server::start("restart", false);
    let store = RedisStore::new(&server.url(), timeout_options()).unwrap();
    let k = keys("r", 4);
    assert_eq!(store.put(&refs(&k), &refs(&k)).unwrap(), vec![true; 4]);
    server.kill();
    let e = fails_within(Duration::from_secs(1), || store.get(&refs(&k)));
    assert!(matches!(e, StoreError::Failed { op: "get", .. }), "{e}");
    // Still down: connecting fails fast too, and says why.
    let e = fails_within(Duration::from_secs(1), || store.exists(&refs(&k)));
    assert_eq!(e.cause(), Cause::ConnectionRefused, "{e}");
    server.restart();
    // The data went with the process (no persistence); the store reconnects.
    assert_eq!(store.exists(&refs(&k)).unwrap(), vec![false; 4]);
    assert_eq!(store.put(&refs(&k), &refs(&k)).unwrap(), vec![true; 4]);
}

#[test]
fn redis_that_stops_answering_times_out() {
    if !redis_available() {
        return;
    }
    let server = Server::start("stop", false);
    let store = RedisStore::new(&server.url(), timeout_options()).unwrap();
    let k = keys("s", 2);
    store.put(&refs(&k), &refs(&k)).unwrap();
    server.signal("-STOP");
    let e = fails_within(Duration::from_secs(1), || store.get(&refs(&k)));
    server.signal("-CONT");
    assert!(e.is_timeout(), "{e}");
    assert!(e.to_string().starts_with("get timed out"), "{e}");
    // Answering again: the next call reconnects and works.
    assert_eq!(
        store.get(&refs(&k)).unwrap(),
        k.iter().cloned().map(Some).collect::<Vec<_>>()
    );
}

#[test]
fn redis_nothing_listening_fails_fast() {
    let store = open(
        &format!("redis://127.0.0.1:{}", free_port()),
        timeout_options(),
    )
    .unwrap();
    let e = fails_within(Duration::from_secs(1), || store.exists(&[b"k".as_slice()]));
    assert!(
        matches!(
            e,
            StoreError::Failed {
                op: "exists",
                cause: Cause::ConnectionRefused,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn redis_cluster_round_trips_over_every_node() {
    if !redis_available() {
        return;
    }
    let nodes = cluster("crt");
    let store = open(&cluster_url(&nodes), timeout_options()).unwrap();
    store.check().unwrap();
    round_trips(&*store);
    framed_pages(&*store, |key| {
        assert_eq!(nodes[0].cli(&["-c", "rpush", key, "x"]).trim(), "1");
    });
    get_each_sizes(&*store);
    // Keys spread over the slots of all three nodes.
    let k = keys("spread", 60);
    store.put(&refs(&k), &refs(&k)).unwrap();
    for n in &nodes {
        let size: u64 = n.cli(&["dbsize"]).trim().parse().unwrap();
        assert!(size > 5, "node {} holds {size} keys", n.port);
    }
    // One node is enough to find the others.
    let one = open(
        &format!("redis+cluster://127.0.0.1:{}", nodes[2].port),
        timeout_options(),
    )
    .unwrap();
    assert_eq!(one.exists(&refs(&k)).unwrap(), vec![true; 60]);
}

#[test]
fn redis_cluster_node_down_fails_fast_and_recovers() {
    if !redis_available() {
        return;
    }
    let mut nodes = cluster("cdown");
    let store = open(&cluster_url(&nodes), timeout_options()).unwrap();
    let k = keys("d", 30);
    assert_eq!(store.put(&refs(&k), &refs(&k)).unwrap(), vec![true; 30]);
    nodes[1].kill();
    // Some keys live on the dead node: the batch fails, within a few timeouts.
    fails_within(Duration::from_secs(3), || store.get(&refs(&k)));
    nodes[1].restart();
    wait_cluster_ok(&nodes);
    // The restarted node rejoined (its identity is in nodes.conf) without its data.
    let got = store.get(&refs(&k)).unwrap();
    let kept = got.iter().filter(|v| v.is_some()).count();
    assert!(kept > 0 && kept < 30, "{kept} of 30 kept");
    assert_eq!(
        store
            .put(&refs(&k), &refs(&k))
            .unwrap()
            .iter()
            .filter(|&&s| s)
            .count(),
        30 - kept
    );
}

#[test]
fn redis_password_in_the_url_authenticates() {
    if !redis_available() {
        return;
    }
    let server = Server::start_with("auth", false, &["--requirepass", PASSWORD]);
    let port = server.port;
    let k = keys("a", 2);
    for url in [
        format!("redis://:{PASSWORD}@127.0.0.1:{port}"),
        format!("redis://default:{PASSWORD}@127.0.0.1:{port}/2"),
    ] {
        let store = open(&url, timeout_options()).unwrap();
        store.put(&refs(&k), &refs(&k)).unwrap();
        assert_eq!(store.exists(&refs(&k)).unwrap(), [true, true], "{url}");
    }
    // No password: the server's error reply fails the call, naming it.
    let store = open(&server.url(), timeout_options()).unwrap();
    let e = store.exists(&refs(&k)).unwrap_err();
    assert!(
        matches!(
            &e,
            StoreError::Failed { op: "exists", cause: Cause::AuthFailed, detail }
                if detail.contains("NOAUTH")
        ),
        "{e}"
    );
    assert_eq!(store.check().unwrap_err().cause(), Cause::AuthFailed);
    // A wrong one: refused while connecting.
    let store = open(
        &format!("redis://:wrong@127.0.0.1:{port}"),
        timeout_options(),
    )
    .unwrap();
    let e = store.get(&refs(&k)).unwrap_err();
    assert!(
        matches!(
            &e,
            StoreError::Failed { op: "get", cause: Cause::AuthFailed, detail }
                if detail.contains("WRONGPASS")
        ),
        "{e}"
    );
    assert!(
        e.to_string()
            .starts_with("get failed: authentication failed: "),
        "{e}"
    );
    assert_eq!(store.check().unwrap_err().cause(), Cause::AuthFailed);
    // A database out of range.
    let store = open(
        &format!("redis://:{PASSWORD}@127.0.0.1:{port}/99"),
        timeout_options(),
    )
    .unwrap();
    let e = store.check().unwrap_err();
    assert_eq!(e.cause(), Cause::BadDatabase, "{e}");
    assert!(e.to_string().contains("DB index is out of range"), "{e}");
}

#[test]
fn redis_cluster_follows_ask_and_moved_while_a_slot_migrates() {
    if !redis_available() {
        return;
    }
    let nodes = cluster("cmig");
    let store = open(&cluster_url(&nodes), timeout_options()).unwrap();
    // Two keys of one slot (a hash tag), stored while the topology is read.
    let k = [b"{mig}a".as_slice(), b"{mig}b"];
    store.put(&k, &[b"A".as_slice(), b"B"]).unwrap();
    let slot = nodes[0].cli(&["cluster", "keyslot", "{mig}a"]);
    let slot = slot.trim();
    let ids: Vec<String> = nodes
        .iter()
        .map(|n| n.cli(&["cluster", "myid"]).trim().to_owned())
        .collect();
    let from = (0..3)
        .find(|&i| {
            let count = nodes[i].cli(&["cluster", "countkeysinslot", slot]);
            count.trim() == "2"
        })
        .expect("the slot's owner");
    let to = (from + 1) % 3;
    let migrate = |key: &str| {
        let port = nodes[to].port.to_string();
        let out = nodes[from].cli(&["migrate", "127.0.0.1", &port, "", "0", "5000", "keys", key]);
        assert_eq!(out.trim(), "OK", "migrate {key}");
    };
    // Half migrated: the moved key is found by ASK, the other where it was.
    nodes[to].cli(&["cluster", "setslot", slot, "importing", &ids[from]]);
    nodes[from].cli(&["cluster", "setslot", slot, "migrating", &ids[to]]);
    migrate("{mig}a");
    assert_eq!(
        store.get(&k).unwrap(),
        [Some(b"A".to_vec()), Some(b"B".to_vec())]
    );
    // Migrated: the old owner answers MOVED, and the store follows it.
    migrate("{mig}b");
    for n in &nodes {
        n.cli(&["cluster", "setslot", slot, "node", &ids[to]]);
    }
    assert_eq!(store.exists(&k).unwrap(), [true, true]);
    assert_eq!(
        store.get(&k).unwrap(),
        [Some(b"A".to_vec()), Some(b"B".to_vec())]
    );
    store.delete(&k[..1]).unwrap();
    assert_eq!(
        nodes[to].cli(&["cluster", "countkeysinslot", slot]).trim(),
        "1"
    );
    assert_eq!(
        nodes[from]
            .cli(&["cluster", "countkeysinslot", slot])
            .trim(),
        "0"
    );
}

#[test]
fn redis_large_batches_pass_within_the_default_timeout() {
    if !redis_available() {
        return;
    }
    // 128 MB put in one call with the default 200 ms timeout: the call's deadline grows
    // with the bytes it moves (hostile.rs paces a transfer to show that it must). Each
    // value is read back in a call of its own: Redis copies all of a pipeline's replies
    // before it sends the first, a wait the timeout (not the bytes) must cover.
    let server = Server::start("large", false);
    // A floor of 10 MB/s (100 ms per MB) rather than the default 100 MB/s: far below any
    // loopback, so that a loaded test machine cannot fail it.
    let options = Options {
        min_rate: 10_000_000,
        ..Options::default()
    };
    let store = open(&server.url(), options).unwrap();
    let k = keys("large", 8);
    let v: Vec<Vec<u8>> = (0..8u8).map(|i| vec![i; 16 << 20]).collect();
    // Connected first, so that the put's deadline has no allowance for connecting.
    store.check().unwrap();
    assert_eq!(store.put(&refs(&k), &refs(&v)).unwrap(), [true; 8]);
    for (key, value) in k.iter().zip(&v) {
        let mut seen = 0;
        store
            .get_each(&[key.as_slice()], &mut |_, object| {
                assert!(object == Object::Bytes(value));
                seen += 1;
            })
            .unwrap();
        assert_eq!(seen, 1);
    }
}
