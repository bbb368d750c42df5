//! A minimal RESP2 client: a reply reader that a hostile server cannot crash or wedge
//! ([`read_head`], [`read_bulk_into`], [`read_reply`], over any [`BufRead`], so that the
//! fuzz target feeds it bytes from memory), and the connection the Redis stores use.
//!
//! The reader trusts nothing a reply announces:
//!
//! - every line (a reply's type and header) is at most [`Limits::max_line`] bytes: a line
//!   that does not end by then is a protocol error, never buffered without limit;
//! - a bulk string's length is checked against [`Limits::max_bulk`] (the store's
//!   [`Options::max_object_size`]) before anything is allocated, and the buffer it is read
//!   into grows with the bytes that actually arrive, not with the length announced;
//! - `$-1` and `*-1` are nil; any other negative length is a protocol error;
//! - arrays (only the cluster's topology has them) are bounded in depth and in the
//!   number of values in all.
//!
//! The connection (`Conn`) writes commands straight from the caller's buffers and reads
//! bulk replies into one buffer it keeps: the `redis` crate's synchronous connection
//! copied every argument twice and parsed page-sized replies at a third of
//! `redis-benchmark`'s GB/s (`benches/l3_throughput.py`). Every read and write keeps to
//! the call's deadline (`deadline.rs`). After any error the stores drop the
//! connection: a protocol error leaves it out of step with the server.

use std::fmt;
use std::io::{self, BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};

use crate::deadline::{Deadline, Timed};
use crate::store::{Cause, Options, Parts, StoreError};

/// Buffer sizes: headers and small replies are buffered; a value larger than this goes
/// between the socket and the caller's memory directly.
const BUF: usize = 64 * 1024;

/// The longest reply line read: error messages and headers are far shorter.
pub const MAX_LINE: usize = 64 * 1024;

/// A bulk string's buffer grows by at least this much at a time (and at most doubles),
/// so that what is allocated follows what arrived.
const GROW: usize = 64 * 1024;

/// What a reply may announce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The longest bulk string, in bytes.
    pub max_bulk: usize,
    /// The longest line (without its CRLF).
    pub max_line: usize,
    /// The most values in one reply, over all its arrays (0: no array may hold any).
    pub max_elements: usize,
    /// The deepest nesting of arrays.
    pub max_depth: usize,
}

impl Limits {
    /// The replies to data commands (`EXISTS`, `SET`, `GET`, `DEL`): values up to
    /// `max_object_size`, no arrays.
    pub const fn data(max_object_size: usize) -> Limits {
        Limits {
            max_bulk: max_object_size,
            max_line: MAX_LINE,
            max_elements: 0,
            max_depth: 0,
        }
    }

    /// The replies of a cluster's topology (`CLUSTER SLOTS`): small strings, arrays of
    /// up to a million values in all, four deep.
    pub const fn topology() -> Limits {
        Limits {
            max_bulk: MAX_LINE,
            max_line: MAX_LINE,
            max_elements: 1 << 20,
            max_depth: 4,
        }
    }
}

/// A whole reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+OK`.
    Ok,
    /// Another simple string.
    Status(String),
    /// An integer.
    Int(i64),
    /// A bulk string.
    Bulk(Vec<u8>),
    /// `$-1` or `*-1`.
    Nil,
    /// The server's error message (without the `-`).
    Error(String),
    /// An array.
    Array(Vec<Reply>),
}

/// The start of a reply: a whole value, or the length of what follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Head {
    /// A value that fits its line (never a bulk string or an array).
    Value(Reply),
    /// A bulk string of this many bytes follows (then CRLF).
    Bulk(usize),
    /// An array of this many replies follows.
    Array(usize),
}

/// Why a reply could not be read.
#[derive(Debug)]
pub enum ReadError {
    /// The socket failed (a timeout included).
    Io(io::Error),
    /// The stream ended: before a reply began (`mid_reply` false), or inside one.
    Closed {
        /// Whether part of a reply had been read.
        mid_reply: bool,
    },
    /// The bytes are not a reply this reader accepts.
    Protocol(String),
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::Closed { mid_reply: false } => f.write_str("closed the connection"),
            ReadError::Closed { mid_reply: true } => {
                f.write_str("closed the connection in the middle of a reply")
            }
            ReadError::Protocol(what) => f.write_str(what),
        }
    }
}

fn protocol(what: impl Into<String>) -> ReadError {
    ReadError::Protocol(what.into())
}

/// Reads one line into `line` (cleared first), without its CRLF: at most `max` bytes.
fn read_line<R: BufRead>(r: &mut R, max: usize, line: &mut Vec<u8>) -> Result<(), ReadError> {
    line.clear();
    loop {
        let buf = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(ReadError::Io(e)),
        };
        if buf.is_empty() {
            return Err(ReadError::Closed {
                mid_reply: !line.is_empty(),
            });
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(at) => (at + 1, true),
            None => (buf.len(), false),
        };
        // `max` bytes, CR and LF.
        if line.len() + take > max.saturating_add(2) {
            return Err(protocol(format!("a reply line longer than {max} bytes")));
        }
        line.extend_from_slice(&buf[..take]);
        r.consume(take);
        if done {
            break;
        }
    }
    if !line.ends_with(b"\r\n") {
        return Err(protocol("a reply line without CRLF"));
    }
    line.truncate(line.len() - 2);
    Ok(())
}

/// A length or integer field.
fn number(text: &[u8]) -> Result<i64, ReadError> {
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| {
            protocol(format!(
                "{:?} is not a number",
                String::from_utf8_lossy(text)
            ))
        })
}

/// A length field: `None` for `-1` (nil); at most `max`.
fn length(kind: &str, text: &[u8], max: usize) -> Result<Option<usize>, ReadError> {
    let n = number(text)?;
    if n == -1 {
        return Ok(None);
    }
    let Ok(n) = u64::try_from(n) else {
        return Err(protocol(format!("{kind} of negative length {n}")));
    };
    match usize::try_from(n) {
        Ok(n) if n <= max => Ok(Some(n)),
        _ => Err(protocol(format!(
            "{kind} of {n} {}, over the limit of {max}",
            if kind == "a bulk string" {
                "bytes"
            } else {
                "values"
            }
        ))),
    }
}

/// Reads the start of one reply. `line` is a buffer the caller keeps between calls.
pub fn read_head<R: BufRead>(
    r: &mut R,
    limits: &Limits,
    line: &mut Vec<u8>,
) -> Result<Head, ReadError> {
    read_line(r, limits.max_line, line)?;
    let Some((&kind, rest)) = line.split_first() else {
        return Err(protocol("an empty reply line"));
    };
    let text = || String::from_utf8_lossy(rest).into_owned();
    Ok(match kind {
        b'+' if rest == b"OK" => Head::Value(Reply::Ok),
        b'+' => Head::Value(Reply::Status(text())),
        b'-' => Head::Value(Reply::Error(text())),
        b':' => Head::Value(Reply::Int(number(rest)?)),
        b'$' => match length("a bulk string", rest, limits.max_bulk)? {
            Some(n) => Head::Bulk(n),
            None => Head::Value(Reply::Nil),
        },
        b'*' => match length("an array", rest, limits.max_elements)? {
            Some(n) => Head::Array(n),
            None => Head::Value(Reply::Nil),
        },
        other => {
            return Err(protocol(format!(
                "unexpected reply type {:?}",
                char::from(other)
            )))
        }
    })
}

/// Reads a bulk string's `n` bytes and its CRLF into the start of `buf`: the string is
/// `buf[..n]`. `buf` grows (zeroed, at most doubling) only as bytes arrive, and is never
/// shrunk or cleared, so a buffer kept between calls costs neither allocation nor memset.
pub fn read_bulk_into<R: Read>(r: &mut R, n: usize, buf: &mut Vec<u8>) -> Result<(), ReadError> {
    let total = n
        .checked_add(2)
        .ok_or_else(|| protocol(format!("a bulk string of {n} bytes")))?;
    let mut filled = 0;
    while filled < total {
        if buf.len() <= filled {
            // A zeroed allocation (fresh pages, no memset) and a copy of what arrived:
            // fast in any build, which `resize` is not in a debug one.
            let grown = filled.saturating_mul(2).max(filled + GROW).min(total);
            let mut bigger = vec![0u8; grown];
            bigger[..filled].copy_from_slice(&buf[..filled]);
            *buf = bigger;
        }
        let end = buf.len().min(total);
        match r.read(&mut buf[filled..end]) {
            Ok(0) => return Err(ReadError::Closed { mid_reply: true }),
            Ok(k) => filled += k,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    if &buf[n..total] != b"\r\n" {
        return Err(protocol("a bulk string without CRLF"));
    }
    Ok(())
}

/// Reads one whole reply (arrays included, within `limits`).
pub fn read_reply<R: BufRead>(r: &mut R, limits: &Limits) -> Result<Reply, ReadError> {
    let mut line = Vec::new();
    let mut budget = limits.max_elements;
    reply_at(r, limits, &mut line, 0, &mut budget)
}

/// A reply at nesting `depth`, with `budget` array values left.
fn reply_at<R: BufRead>(
    r: &mut R,
    limits: &Limits,
    line: &mut Vec<u8>,
    depth: usize,
    budget: &mut usize,
) -> Result<Reply, ReadError> {
    match read_head(r, limits, line)? {
        Head::Value(v) => Ok(v),
        Head::Bulk(n) => {
            let mut v = Vec::new();
            read_bulk_into(r, n, &mut v)?;
            v.truncate(n);
            Ok(Reply::Bulk(v))
        }
        Head::Array(n) => {
            if limits.max_depth == 0 {
                return Err(protocol("an array where none is expected"));
            }
            if depth >= limits.max_depth {
                return Err(protocol(format!(
                    "arrays nested deeper than {}",
                    limits.max_depth
                )));
            }
            *budget = budget.checked_sub(n).ok_or_else(|| {
                protocol(format!(
                    "a reply of more than {} values",
                    limits.max_elements
                ))
            })?;
            // Each value takes at least 3 bytes: grow with what arrives.
            let mut items = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                let item = reply_at(r, limits, line, depth + 1, budget).map_err(|e| match e {
                    ReadError::Closed { .. } => ReadError::Closed { mid_reply: true },
                    other => other,
                })?;
                items.push(item);
            }
            Ok(Reply::Array(items))
        }
    }
}

/// A server's address.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Addr {
    /// The host name or IP address (an IPv6 address without brackets).
    pub(crate) host: String,
    /// The port.
    pub(crate) port: u16,
}

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// A command: its arguments, the name first, each the concatenation of its two parts.
pub(crate) type Cmd<'a> = Vec<Parts<'a>>;

/// An argument in one part.
pub(crate) fn one(a: &[u8]) -> Parts<'_> {
    [a, &[]]
}

/// The cause of a server's error reply: `NOAUTH` and `WRONGPASS` are the credentials',
/// `CLUSTERDOWN` the cluster's.
pub(crate) fn server_cause(message: &str) -> Cause {
    let code = message.split(' ').next().unwrap_or_default();
    match code {
        "NOAUTH" | "WRONGPASS" => Cause::AuthFailed,
        "CLUSTERDOWN" => Cause::Cluster,
        _ => Cause::Server,
    }
}

/// A connection to one Redis server.
pub(crate) struct Conn {
    reader: BufReader<Timed>,
    addr: Addr,
    limits: Limits,
    /// Commands are written here, and flushed when it is full or holds them all.
    out: Vec<u8>,
    /// The buffer bulk replies are read into, kept between calls.
    scratch: Vec<u8>,
    /// The buffer reply lines are read into.
    line: Vec<u8>,
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Conn {
    /// Connects to `addr` within the connect timeout and the call's `deadline` (which
    /// grows by the connect timeout), then authenticates with `auth` (none, the
    /// password, or the user and the password) and selects `db` (unless 0).
    pub(crate) fn connect(
        op: &'static str,
        addr: &Addr,
        options: &Options,
        deadline: &Deadline,
        auth: &[Vec<u8>],
        db: u32,
    ) -> Result<Conn, StoreError> {
        deadline.connecting();
        let failed = |e: &io::Error| {
            let detail = format!("connecting to {addr}: {e}");
            match e.kind() {
                ErrorKind::ConnectionRefused => {
                    StoreError::failed(op, Cause::ConnectionRefused, detail)
                }
                ErrorKind::TimedOut | ErrorKind::WouldBlock => StoreError::Timeout { op, detail },
                _ => StoreError::failed(op, Cause::Unreachable, detail),
            }
        };
        let addrs = (addr.host.as_str(), addr.port)
            .to_socket_addrs()
            .map_err(|e| failed(&e))?;
        let mut last = io::Error::new(ErrorKind::NotFound, "the host has no address");
        let mut stream = None;
        for a in addrs {
            let Some(left) = deadline.remaining() else {
                last = deadline.passed();
                break;
            };
            match TcpStream::connect_timeout(&a, left.min(options.connect_timeout)) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let stream = stream.ok_or_else(|| failed(&last))?;
        stream.set_nodelay(true).map_err(|e| failed(&e))?;
        let mut con = Conn {
            reader: BufReader::with_capacity(BUF, Timed::new(stream, deadline.clone())),
            addr: addr.clone(),
            limits: Limits::data(options.max_object_size),
            out: Vec::new(),
            scratch: Vec::new(),
            line: Vec::new(),
        };
        con.setup(op, auth, db)?;
        Ok(con)
    }

    /// `AUTH` and `SELECT` as the URL asked, in one round trip.
    fn setup(&mut self, op: &'static str, auth: &[Vec<u8>], db: u32) -> Result<(), StoreError> {
        let db_arg = db.to_string();
        let mut cmds: Vec<(Cause, &str, Cmd<'_>)> = Vec::new();
        if !auth.is_empty() {
            let mut c = vec![one(b"AUTH")];
            c.extend(auth.iter().map(|a| one(a)));
            cmds.push((Cause::AuthFailed, "AUTH", c));
        }
        if db != 0 {
            let c = vec![one(b"SELECT"), one(db_arg.as_bytes())];
            cmds.push((Cause::BadDatabase, "SELECT", c));
        }
        if cmds.is_empty() {
            return Ok(());
        }
        let sent: Vec<Cmd<'_>> = cmds.iter().map(|(_, _, c)| c.clone()).collect();
        self.send(op, &sent)?;
        let mut first = None;
        for (cause, name, _) in &cmds {
            let reply = self.reply(op)?;
            let error = match reply {
                Reply::Ok => continue,
                Reply::Error(e) => {
                    StoreError::failed(op, *cause, format!("{}: {name} refused: {e}", self.addr))
                }
                other => self.protocol(op, &format!("{name} answered {}", describe(&other))),
            };
            first.get_or_insert(error);
        }
        first.map_or(Ok(()), Err)
    }

    /// The server's address.
    pub(crate) fn addr(&self) -> &Addr {
        &self.addr
    }

    /// Keeps to `deadline` from now on.
    pub(crate) fn arm(&mut self, deadline: &Deadline) {
        self.reader.get_mut().arm(deadline);
    }

    /// A protocol error of this connection.
    pub(crate) fn protocol(&self, op: &'static str, what: &str) -> StoreError {
        StoreError::failed(op, Cause::Protocol, format!("{}: {what}", self.addr))
    }

    /// A server's error reply to `op` on this connection.
    pub(crate) fn server_error(&self, op: &'static str, message: &str) -> StoreError {
        StoreError::failed(
            op,
            server_cause(message),
            format!("{}: {message}", self.addr),
        )
    }

    /// A socket error of `op` on this connection.
    fn io_error(&self, op: &'static str, e: &io::Error) -> StoreError {
        let detail = format!("{}: {e}", self.addr);
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => StoreError::Timeout { op, detail },
            ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::BrokenPipe
            | ErrorKind::UnexpectedEof => StoreError::failed(op, Cause::Closed, detail),
            _ => StoreError::failed(op, Cause::Io, detail),
        }
    }

    /// A reply that could not be read.
    fn read_error(&self, op: &'static str, e: ReadError) -> StoreError {
        match e {
            ReadError::Io(e) => self.io_error(op, &e),
            ReadError::Closed { .. } => {
                StoreError::failed(op, Cause::Closed, format!("{} {e}", self.addr))
            }
            ReadError::Protocol(what) => self.protocol(op, &what),
        }
    }

    /// Writes `cmds`; a part larger than the buffer goes to the socket directly.
    pub(crate) fn send(&mut self, op: &'static str, cmds: &[Cmd<'_>]) -> Result<(), StoreError> {
        self.write_all(cmds).map_err(|e| self.io_error(op, &e))
    }

    fn write_all(&mut self, cmds: &[Cmd<'_>]) -> io::Result<()> {
        let out = &mut self.out;
        let sock = self.reader.get_mut();
        out.clear();
        for args in cmds {
            write!(out, "*{}\r\n", args.len())?;
            for [a, b] in args {
                let len = a.len() + b.len();
                write!(out, "${len}\r\n")?;
                if len > BUF {
                    sock.write_all(out)?;
                    out.clear();
                    sock.write_all(a)?;
                    sock.write_all(b)?;
                } else {
                    out.extend_from_slice(a);
                    out.extend_from_slice(b);
                }
                out.extend_from_slice(b"\r\n");
                if out.len() >= BUF {
                    sock.write_all(out)?;
                    out.clear();
                }
            }
        }
        sock.write_all(out)?;
        out.clear();
        sock.flush()
    }

    /// The start of the next reply.
    pub(crate) fn head(&mut self, op: &'static str) -> Result<Head, StoreError> {
        read_head(&mut self.reader, &self.limits, &mut self.line)
            .map_err(|e| self.read_error(op, e))
    }

    /// The bulk string of `n` bytes that follows a [`Head::Bulk`], in the connection's
    /// buffer.
    pub(crate) fn bulk(&mut self, op: &'static str, n: usize) -> Result<&[u8], StoreError> {
        let mut buf = std::mem::take(&mut self.scratch);
        let read = read_bulk_into(&mut self.reader, n, &mut buf);
        self.scratch = buf;
        read.map_err(|e| self.read_error(op, e))?;
        Ok(&self.scratch[..n])
    }

    /// The next whole reply to a data command (no arrays).
    pub(crate) fn reply(&mut self, op: &'static str) -> Result<Reply, StoreError> {
        let limits = self.limits;
        read_reply(&mut self.reader, &limits).map_err(|e| self.read_error(op, e))
    }

    /// The next whole reply to a topology command (arrays of small values).
    pub(crate) fn topology_reply(&mut self, op: &'static str) -> Result<Reply, StoreError> {
        read_reply(&mut self.reader, &Limits::topology()).map_err(|e| self.read_error(op, e))
    }
}

/// A reply, for an error message (a bulk string by its length only).
pub(crate) fn describe(reply: &Reply) -> String {
    match reply {
        Reply::Ok => "OK".to_owned(),
        Reply::Status(s) => format!("status {s:?}"),
        Reply::Int(n) => format!("integer {n}"),
        Reply::Bulk(b) => format!("a {}-byte string", b.len()),
        Reply::Nil => "nil".to_owned(),
        Reply::Error(e) => format!("error {e:?}"),
        Reply::Array(a) => format!("an array of {}", a.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DATA: Limits = Limits::data(1 << 20);

    fn reply(bytes: &[u8], limits: &Limits) -> Result<Reply, String> {
        read_reply(&mut &bytes[..], limits).map_err(|e| e.to_string())
    }

    #[test]
    fn values_of_every_kind() {
        assert_eq!(reply(b"+OK\r\n", &DATA), Ok(Reply::Ok));
        assert_eq!(reply(b"+PONG\r\n", &DATA), Ok(Reply::Status("PONG".into())));
        assert_eq!(
            reply(b"-ERR no\r\n", &DATA),
            Ok(Reply::Error("ERR no".into()))
        );
        assert_eq!(reply(b":-7\r\n", &DATA), Ok(Reply::Int(-7)));
        assert_eq!(
            reply(b"$3\r\nabc\r\n", &DATA),
            Ok(Reply::Bulk(b"abc".to_vec()))
        );
        assert_eq!(reply(b"$0\r\n\r\n", &DATA), Ok(Reply::Bulk(Vec::new())));
        assert_eq!(reply(b"$-1\r\n", &DATA), Ok(Reply::Nil));
        assert_eq!(reply(b"*-1\r\n", &DATA), Ok(Reply::Nil));
        assert_eq!(
            reply(b"*0\r\n", &Limits::topology()),
            Ok(Reply::Array(Vec::new()))
        );
        assert_eq!(
            reply(b"*0\r\n", &DATA).unwrap_err(),
            "an array where none is expected"
        );
        assert_eq!(
            reply(b"*2\r\n:1\r\n*1\r\n$1\r\nx\r\n", &Limits::topology()),
            Ok(Reply::Array(vec![
                Reply::Int(1),
                Reply::Array(vec![Reply::Bulk(b"x".to_vec())])
            ]))
        );
    }

    #[test]
    fn announced_lengths_are_bounded_before_any_allocation() {
        let e = reply(b"$9000000000000000000\r\n", &DATA).unwrap_err();
        assert_eq!(
            e,
            "a bulk string of 9000000000000000000 bytes, over the limit of 1048576"
        );
        assert!(reply(b"$1048577\r\n", &DATA)
            .unwrap_err()
            .contains("over the limit"));
        let e = reply(b"*5\r\n", &DATA).unwrap_err();
        assert_eq!(e, "an array of 5 values, over the limit of 0");
        let e = reply(b"*3000000\r\n", &Limits::topology()).unwrap_err();
        assert!(e.contains("over the limit of 1048576"), "{e}");
        // The budget counts every array of the reply.
        let limits = Limits {
            max_elements: 3,
            ..Limits::topology()
        };
        let e = reply(b"*2\r\n*2\r\n:1\r\n:2\r\n:3\r\n", &limits).unwrap_err();
        assert_eq!(e, "a reply of more than 3 values");
        let e = reply(b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n", &Limits::topology()).unwrap_err();
        assert_eq!(e, "arrays nested deeper than 4");
    }

    #[test]
    fn negative_lengths_other_than_nil_are_errors() {
        for bytes in [&b"$-2\r\n"[..], b"*-5\r\n", b"$-9223372036854775808\r\n"] {
            let e = reply(bytes, &Limits::topology()).unwrap_err();
            assert!(e.contains("of negative length"), "{e}");
        }
    }

    #[test]
    fn lines_are_bounded() {
        let mut long = b"+".to_vec();
        long.extend(vec![b'a'; MAX_LINE + 10]);
        long.extend(b"\r\n");
        assert_eq!(
            reply(&long, &DATA).unwrap_err(),
            format!("a reply line longer than {MAX_LINE} bytes")
        );
        // Exactly the limit passes.
        let mut max = b"+".to_vec();
        max.extend(vec![b'a'; MAX_LINE - 1]);
        max.extend(b"\r\n");
        assert!(reply(&max, &DATA).is_ok());
        assert_eq!(
            reply(b":1\n", &DATA).unwrap_err(),
            "a reply line without CRLF"
        );
        assert_eq!(reply(b"\r\n", &DATA).unwrap_err(), "an empty reply line");
    }

    #[test]
    fn malformed_replies_are_errors() {
        assert_eq!(
            reply(b"?x\r\n", &DATA).unwrap_err(),
            "unexpected reply type '?'"
        );
        assert_eq!(
            reply(b":12x\r\n", &DATA).unwrap_err(),
            "\"12x\" is not a number"
        );
        assert_eq!(
            reply(b"$x\r\n", &DATA).unwrap_err(),
            "\"x\" is not a number"
        );
        assert_eq!(
            reply(b"$3\r\nabcde", &DATA).unwrap_err(),
            "a bulk string without CRLF"
        );
        assert_eq!(reply(b"", &DATA).unwrap_err(), "closed the connection");
        for cut in [&b":1"[..], b"$3\r\nab", b"*2\r\n:1\r\n"] {
            assert_eq!(
                reply(cut, &Limits::topology()).unwrap_err(),
                "closed the connection in the middle of a reply",
                "{cut:?}"
            );
        }
    }

    #[test]
    fn a_bulk_buffer_grows_with_what_arrives_and_is_reused() {
        // Announced 1 MiB, 10 bytes sent: the buffer holds no more than one step.
        let mut buf = Vec::new();
        let mut input = &b"0123456789"[..];
        assert!(matches!(
            read_bulk_into(&mut input, 1 << 20, &mut buf),
            Err(ReadError::Closed { mid_reply: true })
        ));
        assert_eq!(buf.len(), GROW);
        // A large value arrives whole; a shorter one reuses the buffer.
        let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let mut input = big.clone();
        input.extend(b"\r\n");
        read_bulk_into(&mut &input[..], big.len(), &mut buf).unwrap();
        assert_eq!(&buf[..big.len()], &big[..]);
        let len = buf.len();
        read_bulk_into(&mut &b"xy\r\n"[..], 2, &mut buf).unwrap();
        assert_eq!((&buf[..2], buf.len()), (&b"xy"[..], len));
    }

    #[test]
    fn heads_leave_bulk_bodies_to_the_caller() {
        let mut input = &b"$2\r\nhi\r\n*1\r\n"[..];
        let mut line = Vec::new();
        assert_eq!(
            read_head(&mut input, &Limits::topology(), &mut line).unwrap(),
            Head::Bulk(2)
        );
        let mut buf = Vec::new();
        read_bulk_into(&mut input, 2, &mut buf).unwrap();
        assert_eq!(
            read_head(&mut input, &Limits::topology(), &mut line).unwrap(),
            Head::Array(1)
        );
    }

    #[test]
    fn error_codes_have_causes() {
        assert_eq!(
            server_cause("NOAUTH Authentication required."),
            Cause::AuthFailed
        );
        assert_eq!(
            server_cause("WRONGPASS invalid username-password pair"),
            Cause::AuthFailed
        );
        assert_eq!(
            server_cause("CLUSTERDOWN The cluster is down"),
            Cause::Cluster
        );
        assert_eq!(server_cause("ERR no"), Cause::Server);
        assert_eq!(server_cause(""), Cause::Server);
    }

    #[test]
    fn addresses_print_as_urls_write_them() {
        let a = Addr {
            host: "::1".into(),
            port: 7,
        };
        assert_eq!(a.to_string(), "[::1]:7");
        let a = Addr {
            host: "h".into(),
            port: 7,
        };
        assert_eq!(a.to_string(), "h:7");
    }
}
