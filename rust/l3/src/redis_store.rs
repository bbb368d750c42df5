//! [`RedisStore`]: objects on one Redis server, over the crate's own RESP client
//! (`resp.rs`); the batch operations that it and [`crate::RedisClusterStore`] share; and
//! the parsing of their URLs.
//!
//! Every batch is one pipeline: `EXISTS k`, `SET k v NX` (write-once: an existing key is
//! left alone and answers nil), `GET k` and `DEL k`, one command a key, so a batch costs
//! one round trip (per node, for a cluster). The store holds one connection behind a
//! mutex, made on first use; every call keeps to one deadline for the whole call
//! (`deadline.rs`: [`Options::timeout`], plus the connect timeout when it connects, plus
//! 10 ms per MB moved by default); after any error the connection is dropped and the next
//! call connects again, so a restarted server is picked up and a reply that broke the
//! protocol never leaves the connection out of step.
//!
//! A `GET` answered `-WRONGTYPE` (the key holds a list, a hash...) is
//! [`Object::Unreadable`] for that key, and the rest of the batch is served; `DEL`
//! removes a key of any type.

use std::fmt;

use parking_lot::Mutex;

use crate::deadline::Deadline;
use crate::resp::{describe, one, Addr, Cmd, Conn, Head, Reply};
use crate::store::OpenError;
use crate::store::{get_via_each, Cause, Object, ObjectStore, Options, Parts, StoreError};

/// What a `redis://` or `redis+cluster://` URL says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RedisUrl {
    /// The server, or the cluster nodes to discover the cluster from.
    pub(crate) nodes: Vec<Addr>,
    /// `AUTH`'s arguments: none, the password, or the user and the password.
    pub(crate) auth: Vec<Vec<u8>>,
    /// The database (0 for a cluster).
    pub(crate) db: u32,
}

/// `text` with its `%XX` escapes decoded.
fn percent_decode(text: &str) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(out)
}

/// A `HOST:PORT` part of `url`.
fn host_port(url: &str, part: &str) -> Result<Addr, OpenError> {
    let bad = |reason: String| OpenError::Url {
        url: url.to_owned(),
        reason,
    };
    let Some((host, number)) = part.rsplit_once(':') else {
        return Err(bad(format!("{part:?} is not HOST:PORT")));
    };
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() {
        return Err(bad(format!("{part:?} has no host")));
    }
    match number.parse::<u16>() {
        Ok(n) if n > 0 => Ok(Addr {
            host: host.to_owned(),
            port: n,
        }),
        _ => Err(bad(format!("port {number:?} is not a number in 1..=65535"))),
    }
}

impl RedisUrl {
    /// Parses `redis://[[USER]:PASSWORD@]HOST:PORT[/DB]` (`cluster` false) or
    /// `redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]`; the user and
    /// password are percent-decoded.
    pub(crate) fn parse(url: &str, cluster: bool) -> Result<RedisUrl, OpenError> {
        let bad = |reason: String| OpenError::Url {
            url: url.to_owned(),
            reason,
        };
        let scheme = if cluster {
            "redis+cluster://"
        } else {
            "redis://"
        };
        let Some(rest) = url.strip_prefix(scheme) else {
            return Err(bad(format!("does not start with {scheme}")));
        };
        if rest.contains(['?', '#']) {
            return Err(bad("a query or fragment (?, #) is not supported".to_owned()));
        }
        let (authority, path) = match rest.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (rest, None),
        };
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let auth = match userinfo {
            None => Vec::new(),
            Some(info) => {
                let Some((user, password)) = info.split_once(':') else {
                    return Err(bad(
                        "a user needs a password (USER:PASSWORD@ or :PASSWORD@)".to_owned(),
                    ));
                };
                let decode = |what: &str, text: &str| {
                    percent_decode(text)
                        .ok_or_else(|| bad(format!("the {what} has a bad %-escape")))
                };
                let (user, password) = (decode("user", user)?, decode("password", password)?);
                match (user.is_empty(), password.is_empty()) {
                    (true, true) => Vec::new(),
                    (true, false) => vec![password],
                    (false, _) => vec![user, password],
                }
            }
        };
        let nodes = if cluster {
            hosts
                .split(',')
                .map(|part| host_port(url, part))
                .collect::<Result<Vec<_>, _>>()?
        } else {
            vec![host_port(url, hosts)?]
        };
        let db = match path {
            None | Some("") => 0,
            Some(_) if cluster => {
                return Err(bad("a cluster has no database: drop the path".to_owned()))
            }
            Some(p) => p.parse::<u32>().map_err(|_| {
                bad(format!(
                    "database {p:?} is not a number (redis://HOST:PORT/DB)"
                ))
            })?,
        };
        Ok(RedisUrl { nodes, auth, db })
    }
}

/// What runs a batch of commands: calls `on(i, connection, head)` once for the reply to
/// each command `i` (in an order it chooses), which reads the rest of the reply (a bulk
/// string's bytes) from the connection. An error from `on` ends the call.
pub(crate) type OnReply<'a> = dyn FnMut(usize, &mut Conn, Head) -> Result<(), StoreError> + 'a;

/// A client that runs a batch of commands, one a key: the one thing the two Redis
/// stores do differently.
pub(crate) trait Pipelined {
    /// Runs `cmds`, command `i` about `keys[i]`, within one deadline; see [`OnReply`].
    fn run(
        &self,
        op: &'static str,
        keys: &[&[u8]],
        cmds: &[Cmd<'_>],
        on: &mut OnReply<'_>,
    ) -> Result<(), StoreError>;
}

/// A whole reply that is not an error and not a bulk string or array.
fn value(con: &mut Conn, op: &'static str, head: Head, cmd: &str) -> Result<Reply, StoreError> {
    match head {
        Head::Value(Reply::Error(e)) => Err(con.server_error(op, &e)),
        Head::Value(v) => Ok(v),
        Head::Bulk(n) => Err(con.protocol(op, &format!("{cmd} answered a {n}-byte string"))),
        Head::Array(n) => Err(con.protocol(op, &format!("{cmd} answered an array of {n}"))),
    }
}

/// The error of an answer that does not fit the command.
fn unexpected(con: &Conn, op: &'static str, cmd: &str, reply: &Reply) -> StoreError {
    con.protocol(op, &format!("{cmd} answered {}", describe(reply)))
}

pub(crate) fn exists(store: &impl Pipelined, keys: &[&[u8]]) -> Result<Vec<bool>, StoreError> {
    let op = "exists";
    let cmds: Vec<Cmd<'_>> = keys.iter().map(|k| vec![one(b"EXISTS"), one(k)]).collect();
    let mut out = vec![false; keys.len()];
    store.run(op, keys, &cmds, &mut |i, con, head| {
        match value(con, op, head, "EXISTS")? {
            Reply::Int(n) => out[i] = n != 0,
            other => return Err(unexpected(con, op, "EXISTS", &other)),
        }
        Ok(())
    })?;
    Ok(out)
}

pub(crate) fn put(
    store: &impl Pipelined,
    keys: &[&[u8]],
    values: &[Parts<'_>],
) -> Result<Vec<bool>, StoreError> {
    let op = "put";
    StoreError::check_len("values", values.len(), keys.len())?;
    let cmds: Vec<Cmd<'_>> = keys
        .iter()
        .zip(values)
        .map(|(k, v)| vec![one(b"SET"), one(k), *v, one(b"NX")])
        .collect();
    let mut out = vec![false; keys.len()];
    store.run(op, keys, &cmds, &mut |i, con, head| {
        match value(con, op, head, "SET")? {
            Reply::Ok => out[i] = true,
            Reply::Nil => out[i] = false,
            other => return Err(unexpected(con, op, "SET", &other)),
        }
        Ok(())
    })?;
    Ok(out)
}

pub(crate) fn delete(store: &impl Pipelined, keys: &[&[u8]]) -> Result<(), StoreError> {
    let op = "delete";
    let cmds: Vec<Cmd<'_>> = keys.iter().map(|k| vec![one(b"DEL"), one(k)]).collect();
    store.run(
        op,
        keys,
        &cmds,
        &mut |_, con, head| match value(con, op, head, "DEL")? {
            Reply::Int(_) => Ok(()),
            other => Err(unexpected(con, op, "DEL", &other)),
        },
    )
}

pub(crate) fn get_each(
    store: &impl Pipelined,
    keys: &[&[u8]],
    visit: &mut dyn FnMut(usize, Object<'_>),
) -> Result<(), StoreError> {
    let op = "get";
    let cmds: Vec<Cmd<'_>> = keys.iter().map(|k| vec![one(b"GET"), one(k)]).collect();
    store.run(op, keys, &cmds, &mut |i, con, head| {
        match head {
            Head::Bulk(n) => visit(i, Object::Bytes(con.bulk(op, n)?)),
            Head::Value(Reply::Nil) => visit(i, Object::Missing),
            // The key holds a list, a hash...: this key's object is unreadable.
            Head::Value(Reply::Error(e)) if e.starts_with("WRONGTYPE") => {
                visit(i, Object::Unreadable(&format!("{}: {e}", con.addr())));
            }
            other => {
                value(con, op, other, "GET").and_then(|v| Err(unexpected(con, op, "GET", &v)))?;
            }
        }
        Ok(())
    })
}

/// Objects on one Redis server (`redis://[[USER]:PASSWORD@]HOST:PORT[/DB]`).
pub struct RedisStore {
    addr: Addr,
    db: u32,
    /// `AUTH`'s arguments (none, the password, or the user and password).
    auth: Vec<Vec<u8>>,
    options: Options,
    con: Mutex<Option<Conn>>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("addr", &self.addr.to_string())
            .field("db", &self.db)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store on the server at `url` (`redis://HOST:PORT[/DB]`, with `USER:PASSWORD@`
    /// or `:PASSWORD@` before the host where the server needs it, percent-encoded);
    /// connects on first use.
    pub fn new(url: &str, options: Options) -> Result<RedisStore, OpenError> {
        let RedisUrl {
            mut nodes,
            auth,
            db,
        } = RedisUrl::parse(url, false)?;
        let Some(addr) = nodes.pop() else {
            return Err(OpenError::Url {
                url: url.to_owned(),
                reason: "no HOST:PORT".to_owned(),
            });
        };
        Ok(RedisStore {
            addr,
            db,
            auth,
            options,
            con: Mutex::new(None),
        })
    }
}

impl Pipelined for RedisStore {
    fn run(
        &self,
        op: &'static str,
        _keys: &[&[u8]],
        cmds: &[Cmd<'_>],
        on: &mut OnReply<'_>,
    ) -> Result<(), StoreError> {
        if cmds.is_empty() {
            return Ok(());
        }
        let deadline = Deadline::start(&self.options);
        let mut slot = self.con.lock();
        let con = match slot.take() {
            Some(mut con) => {
                con.arm(&deadline);
                con
            }
            None => Conn::connect(
                op,
                &self.addr,
                &self.options,
                &deadline,
                &self.auth,
                self.db,
            )?,
        };
        let con = slot.insert(con);
        let result = (|| {
            con.send(op, cmds)?;
            for i in 0..cmds.len() {
                let head = con.head(op)?;
                on(i, con, head)?;
            }
            Ok(())
        })();
        if result.is_err() {
            // Out of step, broken or closed: the next call connects again.
            *slot = None;
        }
        result
    }
}

impl ObjectStore for RedisStore {
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
        get_via_each(self, keys, Cause::Server)
    }

    fn get_each(
        &self,
        keys: &[&[u8]],
        visit: &mut dyn FnMut(usize, Object<'_>),
    ) -> Result<(), StoreError> {
        get_each(self, keys, visit)
    }

    fn delete(&self, keys: &[&[u8]]) -> Result<(), StoreError> {
        delete(self, keys)
    }

    fn check(&self) -> Result<(), StoreError> {
        let op = "check";
        self.run(
            op,
            &[],
            &[vec![one(b"PING")]],
            &mut |_, con, head| match value(con, op, head, "PING")? {
                Reply::Status(s) if s == "PONG" => Ok(()),
                other => Err(unexpected(con, op, "PING", &other)),
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(host: &str, port: u16) -> Addr {
        Addr {
            host: host.to_owned(),
            port,
        }
    }

    fn reason(url: &str, cluster: bool) -> String {
        match RedisUrl::parse(url, cluster).unwrap_err() {
            OpenError::Url { reason, .. } => reason,
            other @ OpenError::Store(_) => panic!("{other}"),
        }
    }

    #[test]
    fn urls_give_the_server_credentials_and_database() {
        let u = RedisUrl::parse("redis://h:1", false).unwrap();
        assert_eq!(
            u,
            RedisUrl {
                nodes: vec![addr("h", 1)],
                auth: vec![],
                db: 0
            }
        );
        let u = RedisUrl::parse("redis://:pw@h:1/3", false).unwrap();
        assert_eq!((u.auth, u.db), (vec![b"pw".to_vec()], 3));
        let u = RedisUrl::parse("redis://us%40er:p%3Aw%2F%25@[::1]:7/", false).unwrap();
        assert_eq!(u.nodes, [addr("::1", 7)]);
        assert_eq!(u.auth, [b"us@er".to_vec(), b"p:w/%".to_vec()]);
        // A password may hold an '@' as it is: the last one ends it.
        let u = RedisUrl::parse("redis://:a@b@h:1", false).unwrap();
        assert_eq!(u.auth, [b"a@b".to_vec()]);
        // No password at all.
        assert!(RedisUrl::parse("redis://:@h:1", false)
            .unwrap()
            .auth
            .is_empty());
        let u = RedisUrl::parse("redis+cluster://u:p@a:1,b:2", true).unwrap();
        assert_eq!(u.nodes, [addr("a", 1), addr("b", 2)]);
        assert_eq!(u.auth, [b"u".to_vec(), b"p".to_vec()]);
    }

    #[test]
    fn bad_urls_name_the_bad_part() {
        assert!(reason("redis://h:1/x", false).contains("database \"x\""));
        assert!(reason("redis://h:1/-1", false).contains("database \"-1\""));
        assert!(reason("redis://h:1/0?protocol=3", false).contains("query"));
        assert!(reason("redis://user@h:1", false).contains("needs a password"));
        assert!(reason("redis://:p%zz@h:1", false).contains("password has a bad %-escape"));
        assert!(reason("redis://u%4:p@h:1", false).contains("user has a bad %-escape"));
        assert!(reason("redis://[]:1", false).contains("no host"));
        assert!(reason("redis+cluster://a:1,b:2/0", true).contains("no database"));
        assert!(reason("redis+cluster://a:1,", true).contains("\"\" is not HOST:PORT"));
        assert!(reason("http://h:1", false).contains("does not start with redis://"));
    }
}
