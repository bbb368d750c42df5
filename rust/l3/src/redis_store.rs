//! [`RedisStore`] (one Redis server, over the crate's own RESP client, `resp.rs`) and
//! [`RedisClusterStore`] (a Redis Cluster, on the `redis` crate's synchronous cluster client).
//!
//! Each store holds one connection (to each node, for a cluster) behind a mutex, made on
//! first use. Every batch is one pipeline: `EXISTS k`, `SET k v NX` (write-once: an
//! existing key is left alone and answers nil), `GET k` and `DEL k`, one command a key,
//! so a batch costs one round trip per node. Connecting and every read and write on the
//! socket are bounded by the [`Options`]' timeouts; after any error the connection is
//! dropped and the next call connects again, so a restarted server is picked up.

use std::fmt;

use parking_lot::Mutex;
use redis::cluster::{ClusterClient, ClusterConnection, ClusterPipeline};
use redis::{Client, Cmd, ConnectionAddr, RedisError, RedisResult, Value};

use crate::open::OpenError;
use crate::resp::{one, Resp};
use crate::store::{ObjectStore, Options, Parts, StoreError};

/// A store error from a client error of operation `op`.
fn store_error(op: &'static str, e: &RedisError) -> StoreError {
    let detail = e.to_string();
    if e.is_timeout() {
        StoreError::Timeout { op, detail }
    } else {
        StoreError::Failed { op, detail }
    }
}

/// One connection, made on first use and dropped after an error.
struct Link<C> {
    con: Mutex<Option<C>>,
}

impl<C> Link<C> {
    fn new() -> Self {
        Link {
            con: Mutex::new(None),
        }
    }

    /// Runs `f` on the connection (made with `connect` if there is none); drops the
    /// connection when either fails.
    fn with<T>(
        &self,
        connect: impl FnOnce() -> Result<C, StoreError>,
        f: impl FnOnce(&mut C) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut guard = self.con.lock();
        let con = match guard.take() {
            Some(con) => con,
            None => connect()?,
        };
        let con = guard.insert(con);
        f(con).inspect_err(|_| *guard = None)
    }
}

/// What a batch's replies become.
fn unexpected(op: &'static str, v: &Value) -> StoreError {
    let what = match v {
        Value::ServerError(e) => format!("server error {e:?}"),
        Value::BulkString(b) => format!("a {}-byte string", b.len()),
        other => format!("{other:?}"),
    };
    StoreError::Failed {
        op,
        detail: format!("unexpected reply: {what}"),
    }
}

/// A client that runs a batch of commands as pipelines: the one thing the two Redis
/// stores do differently.
trait Pipelined {
    /// Runs `cmds` (one a key, each its arguments, the command's name first; each
    /// argument the concatenation of its two parts); their replies, in order.
    fn run(&self, op: &'static str, cmds: &[Vec<Parts<'_>>]) -> Result<Vec<Value>, StoreError>;
}

/// Runs one `build(i)` command for each of `n` keys; checks that each got a reply.
fn batch<'a>(
    store: &impl Pipelined,
    op: &'static str,
    n: usize,
    build: impl FnMut(usize) -> Vec<Parts<'a>>,
) -> Result<Vec<Value>, StoreError> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let cmds: Vec<Vec<Parts<'_>>> = (0..n).map(build).collect();
    let replies = store.run(op, &cmds)?;
    if replies.len() == n {
        Ok(replies)
    } else {
        Err(StoreError::Failed {
            op,
            detail: format!("{} replies to {n} commands", replies.len()),
        })
    }
}

fn exists(store: &impl Pipelined, keys: &[&[u8]]) -> Result<Vec<bool>, StoreError> {
    batch(store, "exists", keys.len(), |i| {
        vec![one(b"EXISTS"), one(keys[i])]
    })?
    .into_iter()
    .map(|v| match v {
        Value::Int(n) => Ok(n != 0),
        other => Err(unexpected("exists", &other)),
    })
    .collect()
}

fn put(
    store: &impl Pipelined,
    keys: &[&[u8]],
    values: &[Parts<'_>],
) -> Result<Vec<bool>, StoreError> {
    StoreError::check_len("values", values.len(), keys.len())?;
    batch(store, "put", keys.len(), |i| {
        vec![one(b"SET"), one(keys[i]), values[i], one(b"NX")]
    })?
    .into_iter()
    .map(|v| match v {
        Value::Okay => Ok(true),
        Value::Nil => Ok(false),
        other => Err(unexpected("put", &other)),
    })
    .collect()
}

fn get(store: &impl Pipelined, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
    batch(store, "get", keys.len(), |i| {
        vec![one(b"GET"), one(keys[i])]
    })?
    .into_iter()
    .map(|v| match v {
        Value::BulkString(b) => Ok(Some(b)),
        Value::Nil => Ok(None),
        other => Err(unexpected("get", &other)),
    })
    .collect()
}

fn delete(store: &impl Pipelined, keys: &[&[u8]]) -> Result<(), StoreError> {
    let replies = batch(store, "delete", keys.len(), |i| {
        vec![one(b"DEL"), one(keys[i])]
    })?;
    match replies.iter().find(|v| !matches!(v, Value::Int(_))) {
        None => Ok(()),
        Some(other) => Err(unexpected("delete", other)),
    }
}

/// Objects on one Redis server (`redis://[[USER]:PASSWORD@]HOST:PORT[/DB]`).
pub struct RedisStore {
    host: String,
    port: u16,
    db: i64,
    /// `AUTH`'s arguments (none, the password, or the user and password).
    auth: Vec<Vec<u8>>,
    options: Options,
    link: Link<Resp>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("db", &self.db)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store on the server at `url` (`redis://HOST:PORT[/DB]`, with `USER:PASSWORD@`
    /// or `:PASSWORD@` before the host where the server needs it); connects on first use.
    pub fn new(url: &str, options: Options) -> Result<RedisStore, OpenError> {
        let bad = |reason: String| OpenError::Url {
            url: url.to_owned(),
            reason,
        };
        let client = Client::open(url).map_err(|e| bad(e.to_string()))?;
        let info = client.get_connection_info();
        let ConnectionAddr::Tcp(host, port) = info.addr() else {
            return Err(bad("only plain TCP (redis://) is supported".to_owned()));
        };
        let settings = info.redis_settings();
        let auth = match (settings.username(), settings.password()) {
            (_, None) => Vec::new(),
            (None, Some(p)) => vec![p.as_bytes().to_vec()],
            (Some(u), Some(p)) => vec![u.as_bytes().to_vec(), p.as_bytes().to_vec()],
        };
        Ok(RedisStore {
            host: host.clone(),
            port: *port,
            db: settings.db(),
            auth,
            options,
            link: Link::new(),
        })
    }

    fn connect(&self, op: &'static str) -> Result<Resp, StoreError> {
        let auth: Vec<&[u8]> = self.auth.iter().map(Vec::as_slice).collect();
        Resp::connect(
            op,
            (&self.host, self.port),
            self.options.connect_timeout,
            self.options.io_timeout,
            &auth,
            self.db,
        )
    }
}

impl Pipelined for RedisStore {
    fn run(&self, op: &'static str, cmds: &[Vec<Parts<'_>>]) -> Result<Vec<Value>, StoreError> {
        self.link
            .with(|| self.connect(op), |con| con.pipeline(op, cmds))
    }
}

impl ObjectStore for RedisStore {
    fn exists(&self, keys: &[&[u8]]) -> Result<Vec<bool>, StoreError> {
        exists(self, keys)
    }

    fn get_each(
        &self,
        keys: &[&[u8]],
        visit: &mut dyn FnMut(usize, Option<&[u8]>),
    ) -> Result<(), StoreError> {
        if keys.is_empty() {
            return Ok(());
        }
        let cmds: Vec<Vec<Parts<'_>>> = keys.iter().map(|k| vec![one(b"GET"), one(k)]).collect();
        self.link.with(
            || self.connect("get"),
            |con| con.get_each("get", &cmds, visit),
        )
    }

    fn put(&self, keys: &[&[u8]], values: &[&[u8]]) -> Result<Vec<bool>, StoreError> {
        let parts: Vec<Parts<'_>> = values.iter().map(|v| one(v)).collect();
        put(self, keys, &parts)
    }

    fn put_parts(&self, keys: &[&[u8]], values: &[Parts<'_>]) -> Result<Vec<bool>, StoreError> {
        put(self, keys, values)
    }

    fn get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        get(self, keys)
    }

    fn delete(&self, keys: &[&[u8]]) -> Result<(), StoreError> {
        delete(self, keys)
    }
}

/// Objects on a Redis Cluster (`redis+cluster://HOST:PORT[,HOST:PORT...]`): keys spread
/// over the slots, each batch split by the client into one pipeline per node.
pub struct RedisClusterStore {
    client: ClusterClient,
    nodes: Vec<String>,
    options: Options,
    link: Link<ClusterConnection>,
}

impl fmt::Debug for RedisClusterStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisClusterStore")
            .field("nodes", &self.nodes)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl RedisClusterStore {
    /// A store on the cluster that `nodes` (`redis://HOST:PORT` each) belong to; connects
    /// on first use.
    pub fn new(nodes: Vec<String>, options: Options) -> Result<RedisClusterStore, OpenError> {
        let client = ClusterClient::builder(nodes.clone())
            .connection_timeout(options.connect_timeout)
            .response_timeout(options.io_timeout)
            // One retry: enough to follow a MOVED or ASK redirect, little enough that a
            // dead node fails the call within about two timeouts.
            .retries(1)
            .build()
            .map_err(|e| OpenError::Url {
                url: nodes.join(","),
                reason: e.to_string(),
            })?;
        Ok(RedisClusterStore {
            client,
            nodes,
            options,
            link: Link::new(),
        })
    }

    fn connect(&self) -> RedisResult<ClusterConnection> {
        let con = self.client.get_connection()?;
        con.set_read_timeout(Some(self.options.io_timeout))?;
        con.set_write_timeout(Some(self.options.io_timeout))?;
        Ok(con)
    }
}

impl Pipelined for RedisClusterStore {
    fn run(&self, op: &'static str, cmds: &[Vec<Parts<'_>>]) -> Result<Vec<Value>, StoreError> {
        let mut pipe = ClusterPipeline::with_capacity(cmds.len());
        for args in cmds {
            let mut c = Cmd::new();
            for [a, b] in args {
                if b.is_empty() {
                    c.arg(*a);
                } else {
                    c.arg([*a, *b].concat());
                }
            }
            pipe.add_command(c);
        }
        self.link.with(
            || self.connect().map_err(|e| store_error(op, &e)),
            |con| {
                pipe.query::<Vec<Value>>(con)
                    .map_err(|e| store_error(op, &e))
            },
        )
    }
}

impl ObjectStore for RedisClusterStore {
    fn exists(&self, keys: &[&[u8]]) -> Result<Vec<bool>, StoreError> {
        exists(self, keys)
    }

    fn put(&self, keys: &[&[u8]], values: &[&[u8]]) -> Result<Vec<bool>, StoreError> {
        let parts: Vec<Parts<'_>> = values.iter().map(|v| one(v)).collect();
        put(self, keys, &parts)
    }

    fn put_parts(&self, keys: &[&[u8]], values: &[Parts<'_>]) -> Result<Vec<bool>, StoreError> {
        put(self, keys, values)
    }

    fn get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        get(self, keys)
    }

    fn delete(&self, keys: &[&[u8]]) -> Result<(), StoreError> {
        delete(self, keys)
    }
}
