//! A minimal RESP2 connection for [`crate::RedisStore`]: pipelines of commands written
//! straight from the caller's buffers, bulk replies read straight into their vectors.
//!
//! The `redis` crate's synchronous connection copies every argument twice before it
//! writes (into the command, then into the packed pipeline) and parses replies with a
//! general parser that is slow for values of a page's size (a quarter to a third of
//! `redis-benchmark`'s GB/s at 1 MiB, `benches/l3_throughput.py`). The L3 tier needs
//! five replies (`+OK`, `-ERR`, `:N`, `$N` and `$-1`) to four commands, so the
//! single-node store speaks the protocol itself; the `redis` crate parses its URL, and
//! runs the cluster store (slot routing, redirects, topology).

use std::io::{self, BufRead, BufReader, BufWriter, ErrorKind, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use redis::Value;

use crate::store::{Parts, StoreError};

/// Buffer sizes: headers and small replies are buffered; a value larger than this goes
/// between the socket and the caller's memory directly.
const BUF: usize = 64 * 1024;

/// An argument in one part.
pub(crate) fn one(a: &[u8]) -> Parts<'_> {
    [a, &[]]
}

/// A connection to one Redis server.
pub(crate) struct Resp {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
    /// The buffer [`Resp::get_each`] reads values into, kept between calls.
    scratch: Vec<u8>,
}

/// An I/O error of `op` as a store error (a timeout when the socket timed out).
pub(crate) fn io_error(op: &'static str, e: &io::Error) -> StoreError {
    let detail = e.to_string();
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => StoreError::Timeout { op, detail },
        _ => StoreError::Failed { op, detail },
    }
}

fn protocol(op: &'static str, what: &str) -> StoreError {
    StoreError::Failed {
        op,
        detail: format!("protocol error: {what}"),
    }
}

impl Resp {
    /// Connects to `host:port` within `connect`, sets `io` as the read and write timeout,
    /// then authenticates and selects `db` as the URL asked.
    /// Errors are `op`'s (the call that needed the connection), naming the server.
    pub(crate) fn connect(
        op: &'static str,
        (host, port): (&str, u16),
        connect: Duration,
        io: Duration,
        auth: &[&[u8]],
        db: i64,
    ) -> Result<Resp, StoreError> {
        let failed = |e: &io::Error| {
            let mut err = io_error(op, e);
            if let StoreError::Failed { detail, .. } | StoreError::Timeout { detail, .. } = &mut err
            {
                *detail = format!("connecting to {host}:{port}: {detail}");
            }
            err
        };
        let addrs = (host, port).to_socket_addrs().map_err(|e| failed(&e))?;
        let mut last = io::Error::new(ErrorKind::NotFound, format!("{host}: no address"));
        let mut stream = None;
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, connect) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let stream = stream.ok_or_else(|| failed(&last))?;
        let setup = |s: &TcpStream| {
            s.set_read_timeout(Some(io))?;
            s.set_write_timeout(Some(io))?;
            s.set_nodelay(true)?;
            s.try_clone()
        };
        let clone = setup(&stream).map_err(|e| failed(&e))?;
        let mut con = Resp {
            reader: BufReader::with_capacity(BUF, clone),
            writer: BufWriter::with_capacity(BUF, stream),
            scratch: Vec::new(),
        };
        let db_arg = db.to_string();
        let mut setup_cmds: Vec<Vec<Parts<'_>>> = Vec::new();
        if !auth.is_empty() {
            let mut c = vec![one(b"AUTH")];
            c.extend(auth.iter().map(|a| one(a)));
            setup_cmds.push(c);
        }
        if db != 0 {
            setup_cmds.push(vec![one(b"SELECT"), one(db_arg.as_bytes())]);
        }
        if !setup_cmds.is_empty() {
            for reply in con.pipeline(op, &setup_cmds)? {
                if reply != Value::Okay {
                    return Err(protocol(op, "AUTH or SELECT was not answered OK"));
                }
            }
        }
        Ok(con)
    }

    /// Sends `cmds` (each a list of arguments, the command's name first, each argument
    /// the concatenation of its two parts) in one write and reads one reply each. A
    /// server error reply fails the call.
    pub(crate) fn pipeline(
        &mut self,
        op: &'static str,
        cmds: &[Vec<Parts<'_>>],
    ) -> Result<Vec<Value>, StoreError> {
        self.send(cmds).map_err(|e| io_error(op, &e))?;
        let mut replies = Vec::with_capacity(cmds.len());
        let mut first_error = None;
        for _ in cmds {
            match self.reply(op)? {
                Ok(v) => replies.push(v),
                // Read the rest, so the connection stays in step, then report it.
                Err(e) => {
                    first_error.get_or_insert(e);
                    replies.push(Value::Nil);
                }
            }
        }
        match first_error {
            None => Ok(replies),
            Some(e) => Err(StoreError::Failed {
                op,
                detail: format!("server error: {e}"),
            }),
        }
    }

    /// Writes `cmds`; a part larger than the buffer goes to the socket directly.
    fn send(&mut self, cmds: &[Vec<Parts<'_>>]) -> io::Result<()> {
        let w = &mut self.writer;
        for args in cmds {
            write!(w, "*{}\r\n", args.len())?;
            for [a, b] in args {
                write!(w, "${}\r\n", a.len() + b.len())?;
                w.write_all(a)?;
                w.write_all(b)?;
                w.write_all(b"\r\n")?;
            }
        }
        w.flush()
    }

    /// One header line, without its `\r\n`.
    fn line(&mut self, op: &'static str) -> Result<Vec<u8>, StoreError> {
        let mut line = Vec::new();
        self.reader
            .read_until(b'\n', &mut line)
            .map_err(|e| io_error(op, &e))?;
        if !line.ends_with(b"\r\n") {
            return Err(if line.is_empty() {
                StoreError::Failed {
                    op,
                    detail: "connection closed by the server".to_owned(),
                }
            } else {
                protocol(op, "a reply line without CRLF")
            });
        }
        line.truncate(line.len() - 2);
        Ok(line)
    }

    /// The start of one reply: a whole value, the server's error message, or the length
    /// of a bulk string whose bytes (and CRLF) follow.
    fn head(&mut self, op: &'static str) -> Result<Head, StoreError> {
        let line = self.line(op)?;
        let Some((&kind, rest)) = line.split_first() else {
            return Err(protocol(op, "an empty reply line"));
        };
        let text = String::from_utf8_lossy(rest);
        let number = || {
            text.parse::<i64>()
                .map_err(|_| protocol(op, &format!("{text:?} is not a number")))
        };
        Ok(match kind {
            b'+' if rest == b"OK" => Head::Value(Value::Okay),
            b'+' => Head::Value(Value::SimpleString(text.into_owned())),
            b'-' => Head::Error(text.into_owned()),
            b':' => Head::Value(Value::Int(number()?)),
            b'$' => match usize::try_from(number()?) {
                Ok(n) => Head::Bulk(n),
                // `$-1`: nil.
                Err(_) => Head::Value(Value::Nil),
            },
            other => {
                return Err(protocol(
                    op,
                    &format!("unexpected reply type {:?}", char::from(other)),
                ))
            }
        })
    }

    /// Reads a bulk string's `n` bytes and CRLF into the start of `buf`, which grows
    /// (zeroed) where it is shorter but is never cleared: a reused buffer costs no
    /// memset. The string is `buf[..n]`.
    fn bulk_into(
        &mut self,
        op: &'static str,
        n: usize,
        buf: &mut Vec<u8>,
    ) -> Result<(), StoreError> {
        if buf.len() < n + 2 {
            buf.resize(n + 2, 0);
        }
        let bytes = &mut buf[..n + 2];
        self.reader
            .read_exact(bytes)
            .map_err(|e| io_error(op, &e))?;
        if !bytes.ends_with(b"\r\n") {
            return Err(protocol(op, "a bulk string without CRLF"));
        }
        Ok(())
    }

    /// One reply: a value, or the server's error message.
    fn reply(&mut self, op: &'static str) -> Result<Result<Value, String>, StoreError> {
        Ok(match self.head(op)? {
            Head::Value(v) => Ok(v),
            Head::Error(e) => Err(e),
            Head::Bulk(n) => {
                let mut v = Vec::new();
                self.bulk_into(op, n, &mut v)?;
                v.truncate(n);
                Ok(Value::BulkString(v))
            }
        })
    }

    /// Sends `cmds` (`GET`s) and calls `visit(i, reply)` with each bulk reply read into
    /// one buffer reused for all of them (`None` for nil). Another reply fails the call
    /// after the rest were read.
    pub(crate) fn get_each(
        &mut self,
        op: &'static str,
        cmds: &[Vec<Parts<'_>>],
        visit: &mut dyn FnMut(usize, Option<&[u8]>),
    ) -> Result<(), StoreError> {
        self.send(cmds).map_err(|e| io_error(op, &e))?;
        let mut buf = std::mem::take(&mut self.scratch);
        let mut wrong = None;
        for i in 0..cmds.len() {
            match self.head(op)? {
                Head::Bulk(n) => {
                    self.bulk_into(op, n, &mut buf)?;
                    visit(i, Some(&buf[..n]));
                }
                Head::Value(Value::Nil) => visit(i, None),
                Head::Value(v) => {
                    wrong.get_or_insert_with(|| format!("unexpected reply: {v:?}"));
                }
                Head::Error(e) => {
                    wrong.get_or_insert_with(|| format!("server error: {e}"));
                }
            }
        }
        self.scratch = buf;
        match wrong {
            None => Ok(()),
            Some(detail) => Err(StoreError::Failed { op, detail }),
        }
    }
}

/// The start of a reply.
enum Head {
    Value(Value),
    Error(String),
    Bulk(usize),
}
