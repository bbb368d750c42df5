//! One deadline for a whole store call ([`Deadline`]), and a socket that keeps to it
//! ([`Timed`]).
//!
//! A call's deadline is its start, plus [`Options::timeout`], plus
//! [`Options::connect_timeout`] once if the call connects, plus one second per
//! [`Options::min_rate`] bytes the call moved over any of its sockets. Every read and
//! write on a [`Timed`] socket first sets the socket's timeout to what is left, so that no
//! single read can outlive the deadline, and fails with [`ErrorKind::TimedOut`] once
//! nothing is left: a store that trickles a byte at a time cannot hold a call past about
//! `timeout`, while a large batch moving faster than `min_rate` earns the time it needs.

use std::io::{self, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::store::Options;

/// The deadline of one call, shared by the sockets the call uses (cheap to clone).
#[derive(Debug, Clone)]
pub(crate) struct Deadline {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    start: Instant,
    timeout: Duration,
    connect: Duration,
    min_rate: u64,
    /// Whether the call connected (its deadline has the connect allowance).
    connected: AtomicBool,
    /// Bytes sent and received.
    moved: AtomicU64,
}

impl Deadline {
    /// A call starting now under `options`.
    pub(crate) fn start(options: &Options) -> Deadline {
        Deadline {
            inner: Arc::new(Inner {
                start: Instant::now(),
                timeout: options.timeout,
                connect: options.connect_timeout,
                min_rate: options.min_rate,
                connected: AtomicBool::new(false),
                moved: AtomicU64::new(0),
            }),
        }
    }

    /// The call connects: its deadline grows by the connect timeout (once a call).
    pub(crate) fn connecting(&self) {
        self.inner.connected.store(true, Ordering::Relaxed);
    }

    /// `n` more bytes moved.
    fn moved(&self, n: usize) {
        self.inner.moved.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// The time the call may take, all in all, as of now.
    pub(crate) fn budget(&self) -> Duration {
        let i = &*self.inner;
        let mut budget = i.timeout;
        if i.connected.load(Ordering::Relaxed) {
            budget = budget.saturating_add(i.connect);
        }
        if i.min_rate > 0 {
            let moved = u128::from(i.moved.load(Ordering::Relaxed));
            let nanos = moved * 1_000_000_000 / u128::from(i.min_rate);
            let secs = u64::try_from(nanos / 1_000_000_000).unwrap_or(u64::MAX);
            // Below 1e9: fits.
            let sub = u32::try_from(nanos % 1_000_000_000).unwrap_or(0);
            budget = budget.saturating_add(Duration::new(secs, sub));
        }
        budget
    }

    /// The time left, `None` once the deadline has passed.
    pub(crate) fn remaining(&self) -> Option<Duration> {
        let left = self.budget().checked_sub(self.inner.start.elapsed())?;
        (!left.is_zero()).then_some(left)
    }

    /// Bytes moved so far.
    pub(crate) fn bytes_moved(&self) -> u64 {
        self.inner.moved.load(Ordering::Relaxed)
    }

    /// The error of a socket call made after the deadline passed.
    pub(crate) fn passed(&self) -> io::Error {
        io::Error::new(ErrorKind::TimedOut, self.describe())
    }

    /// What the deadline was, for a timeout's message.
    pub(crate) fn describe(&self) -> String {
        format!(
            "the call's deadline passed ({} ms for {} bytes moved)",
            self.budget().as_millis(),
            self.bytes_moved()
        )
    }
}

/// A TCP stream whose every read and write keeps to a [`Deadline`] and counts the bytes
/// it moves towards it.
#[derive(Debug)]
pub(crate) struct Timed {
    stream: TcpStream,
    deadline: Deadline,
}

impl Timed {
    /// `stream`, keeping to `deadline`.
    pub(crate) fn new(stream: TcpStream, deadline: Deadline) -> Timed {
        Timed { stream, deadline }
    }

    /// Keeps to `deadline` from now on (each call arms its connections).
    pub(crate) fn arm(&mut self, deadline: &Deadline) {
        self.deadline = deadline.clone();
    }

    /// The time left, or the error of having none.
    fn left(&self) -> io::Result<Duration> {
        self.deadline
            .remaining()
            .ok_or_else(|| self.deadline.passed())
    }
}

/// A timed-out socket call says so in the deadline's words.
fn timed_out(e: io::Error, deadline: &Deadline) -> io::Error {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => deadline.passed(),
        _ => e,
    }
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.stream.set_read_timeout(Some(left))?;
        let n = self
            .stream
            .read(buf)
            .map_err(|e| timed_out(e, &self.deadline))?;
        self.deadline.moved(n);
        Ok(n)
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.stream.set_write_timeout(Some(left))?;
        let n = self
            .stream
            .write(buf)
            .map_err(|e| timed_out(e, &self.deadline))?;
        self.deadline.moved(n);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(timeout_ms: u64, min_rate: u64) -> Options {
        Options {
            min_rate,
            ..Options::with_timeout(Duration::from_millis(timeout_ms))
        }
    }

    #[test]
    fn the_budget_grows_with_the_bytes_moved_and_a_connection() {
        let d = Deadline::start(&options(200, 100_000_000));
        assert_eq!(d.budget(), Duration::from_millis(200));
        d.moved(50_000_000);
        assert_eq!(d.budget(), Duration::from_millis(700));
        d.connecting();
        d.connecting();
        assert_eq!(d.budget(), Duration::from_millis(900));
        assert_eq!(d.bytes_moved(), 50_000_000);
        // No allowance at a rate of 0; no overflow at the extremes.
        let d = Deadline::start(&options(200, 0));
        d.moved(usize::MAX);
        assert_eq!(d.budget(), Duration::from_millis(200));
        let d = Deadline::start(&options(200, 1));
        d.moved(usize::MAX);
        d.moved(usize::MAX);
        assert!(d.budget() > Duration::from_secs(1 << 40));
    }

    #[test]
    fn nothing_remains_once_the_deadline_passed() {
        let d = Deadline::start(&options(1, 0));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(d.remaining(), None);
        let e = d.passed();
        assert_eq!(e.kind(), ErrorKind::TimedOut);
        assert!(
            e.to_string()
                .starts_with("the call's deadline passed (1 ms"),
            "{e}"
        );
        let d = Deadline::start(&options(10_000, 0));
        assert!(d.remaining().unwrap() > Duration::from_secs(9));
    }
}
