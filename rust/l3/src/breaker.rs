//! [`Breaker`]: a circuit breaker that turns the L3 tier off after repeated errors, so
//! that serving goes on from the device and host tiers without waiting on a dead store.
//!
//! Closed: calls go through; `threshold` consecutive errors open it. Open: calls are
//! refused until `cooldown` has passed since it opened; the first call after that moves
//! it to half-open and goes through as the probe, while others are still refused.
//! Half-open: the probe's success closes it, its failure opens it again (a new trip and
//! a new cooldown). Pure logic: the caller passes the time, and reports each call's
//! outcome.

use std::num::NonZeroU32;
use std::time::{Duration, Instant};

/// The breaker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go through.
    Closed,
    /// Calls are refused (until the cooldown has passed).
    Open,
    /// One probe call is in flight; others are refused.
    HalfOpen,
}

impl BreakerState {
    /// `"closed"`, `"open"` or `"half_open"`.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

/// A circuit breaker (see the module docs).
#[derive(Debug, Clone)]
pub struct Breaker {
    threshold: NonZeroU32,
    cooldown: Duration,
    state: BreakerState,
    /// Consecutive errors while closed.
    consecutive: u32,
    /// When it last opened.
    opened_at: Option<Instant>,
    errors: u64,
    trips: u64,
}

impl Breaker {
    /// A closed breaker that opens after `threshold` consecutive errors and stays open
    /// for `cooldown`.
    pub fn new(threshold: NonZeroU32, cooldown: Duration) -> Breaker {
        Breaker {
            threshold,
            cooldown,
            state: BreakerState::Closed,
            consecutive: 0,
            opened_at: None,
            errors: 0,
            trips: 0,
        }
    }

    /// Whether a call may go through at `now`. An open breaker whose cooldown has passed
    /// becomes half-open and lets this call through as its probe.
    pub fn allow(&mut self, now: Instant) -> bool {
        match self.state {
            BreakerState::Closed => true,
            BreakerState::HalfOpen => false,
            BreakerState::Open => {
                let cooled = self
                    .opened_at
                    .is_none_or(|at| now.saturating_duration_since(at) >= self.cooldown);
                if cooled {
                    self.state = BreakerState::HalfOpen;
                }
                cooled
            }
        }
    }

    /// A call that went through succeeded.
    pub fn success(&mut self) {
        self.consecutive = 0;
        if self.state == BreakerState::HalfOpen {
            self.state = BreakerState::Closed;
        }
    }

    /// A call that went through failed at `now`.
    pub fn failure(&mut self, now: Instant) {
        self.errors += 1;
        match self.state {
            BreakerState::Closed => {
                self.consecutive += 1;
                if self.consecutive >= self.threshold.get() {
                    self.trip(now);
                }
            }
            BreakerState::HalfOpen => self.trip(now),
            // A late report of a call let through before it opened.
            BreakerState::Open => {}
        }
    }

    fn trip(&mut self, now: Instant) {
        self.state = BreakerState::Open;
        self.opened_at = Some(now);
        self.consecutive = 0;
        self.trips += 1;
    }

    /// The state.
    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// Failed calls reported, in all.
    pub fn errors(&self) -> u64 {
        self.errors
    }

    /// Times it opened.
    pub fn trips(&self) -> u64 {
        self.trips
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COOL: Duration = Duration::from_millis(100);
    const JUST_BEFORE: Duration = Duration::from_millis(99);

    fn breaker(threshold: u32) -> Breaker {
        Breaker::new(NonZeroU32::new(threshold).unwrap(), COOL)
    }

    #[test]
    fn opens_after_threshold_consecutive_errors() {
        let t = Instant::now();
        let mut b = breaker(3);
        assert_eq!(b.state().as_str(), "closed");
        for _ in 0..2 {
            assert!(b.allow(t));
            b.failure(t);
        }
        assert_eq!(b.state(), BreakerState::Closed);
        b.failure(t);
        assert_eq!(b.state().as_str(), "open");
        assert_eq!((b.errors(), b.trips()), (3, 1));
        assert!(!b.allow(t));
    }

    #[test]
    fn a_success_resets_the_count() {
        let t = Instant::now();
        let mut b = breaker(3);
        b.failure(t);
        b.failure(t);
        b.success();
        b.failure(t);
        b.failure(t);
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(b.errors(), 4);
    }

    #[test]
    fn stays_open_for_the_cooldown_then_lets_one_probe_through() {
        let t = Instant::now();
        let mut b = breaker(1);
        b.failure(t);
        assert!(!b.allow(t + JUST_BEFORE));
        assert_eq!(b.state(), BreakerState::Open);
        assert!(b.allow(t + COOL));
        assert_eq!(b.state().as_str(), "half_open");
        // Only the one probe.
        assert!(!b.allow(t + COOL));
        assert!(!b.allow(t + COOL * 5));
    }

    #[test]
    fn a_successful_probe_closes() {
        let t = Instant::now();
        let mut b = breaker(1);
        b.failure(t);
        assert!(b.allow(t + COOL));
        b.success();
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(b.allow(t + COOL));
        assert_eq!(b.trips(), 1);
    }

    #[test]
    fn a_failed_probe_reopens_for_a_new_cooldown() {
        let t = Instant::now();
        let mut b = breaker(2);
        b.failure(t);
        b.failure(t);
        let probe = t + COOL;
        assert!(b.allow(probe));
        b.failure(probe);
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!((b.errors(), b.trips()), (3, 2));
        // The cooldown counts from the re-opening.
        assert!(!b.allow(probe + JUST_BEFORE));
        assert!(b.allow(probe + COOL));
    }

    #[test]
    fn late_failures_while_open_count_errors_but_not_trips() {
        let t = Instant::now();
        let mut b = breaker(1);
        b.failure(t);
        b.failure(t);
        assert_eq!((b.errors(), b.trips()), (2, 1));
        assert!(b.allow(t + COOL));
    }
}
