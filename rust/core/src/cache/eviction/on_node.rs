//! What the state policies keep on a node's Mamba state: its key in the state eviction
//! set and the state-value policy's own marks.
//!
//! `tree.rs` carries a [`StatePolicy`] in every node (`MambaNode::policy`) and never reads
//! it; `eviction/` is the one part that changes it (the key in `mod.rs`, the marks in
//! `state_value.rs`), and `audit.rs` reads it. A leaf (it imports nothing), so that the
//! tree can carry it without knowing any policy.

/// What became of a device state once deeper states were placed below it (the
/// state-value policy's view). Superseded implies continued, so the two are one enum.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Succession {
    /// No state has been placed below it since it was placed.
    #[default]
    Fresh,
    /// A state has been placed below it.
    Continued,
    /// A match had used it, and the first state placed below it lies on its path with
    /// nothing branching off between the two: it serves only a request that leaves
    /// that path in between, until a match uses it again.
    Superseded,
}

/// The eviction policies' data on a node's state (see the module doc).
#[derive(Debug, Default)]
pub(crate) struct StatePolicy {
    /// The state's key in the state eviction set, while it is in it.
    pub lru_key: (u64, u64),
    /// The state-value policy's aging level when the state was last used
    /// (`state_value.rs`).
    pub aged: u64,
    /// Whether a state has been placed below this one (with this one the nearest state
    /// above it) since this one was placed, and whether that superseded it.
    pub succession: Succession,
    /// This state superseded the one above it, or a load-back restored it for a
    /// request: the state-value policy counts it as used.
    pub resumed: bool,
}
