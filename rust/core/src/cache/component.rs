//! Components: the kinds of layers a model is made of, and the interface through which
//! the cache's shared machinery (the match walk, locks, splits, `audit()`) reaches each.
//!
//! A model is a set of components ([`Model`]): full attention always, Mamba states and
//! sliding-window attention (SWA) when configured. Each is a [`Component`]:
//!
//! | component | keeps per node | a match may end at a node when | evicted | a lock holds | between tiers |
//! |---|---|---|---|---|---|
//! | [`FullAttention`] | KV pages (`Node.kv`), device and host | its KV is on the device (prefix-closed) | leaves only, its own order (`lru.rs`) | the path to the root | pages, both ways |
//! | [`MambaStates`] | at most one state per tier (`Node.mamba`) | it has a device state | any unlocked state (`lru.rs`) | the node's state | states, both ways |
//! | [`SlidingWindow`] | an SWA page paired with each KV page it keeps (`pool.rs`) | the last `swa_window` tokens are live | tombstones in the middle, leaves whole (`swa.rs`) | the window's nodes | the paired pages |
//!
//! The match walk ([`Cut`]) asks every component of the model whether the match may end
//! at each node of the path and cuts at the deepest node all accept; a lock, its release
//! and a split call each component's hook; `audit()` runs each component's own checks.
//! A new kind of layer is one more implementation and one more field of [`Model`].

use crate::config::Config;
use crate::error::Result;

use super::Cache;

/// The kinds of layers a model may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ComponentKind {
    /// Full attention: a KV entry per token, every token attends to all before it.
    Full,
    /// Mamba / linear attention: one recurrent state per sequence.
    Mamba,
    /// Sliding-window attention: each token attends to the last `swa_window` tokens.
    Swa,
}

impl ComponentKind {
    /// The name users see (`HybridCache.components`).
    pub fn name(self) -> &'static str {
        match self {
            ComponentKind::Full => "full",
            ComponentKind::Mamba => "mamba",
            ComponentKind::Swa => "swa",
        }
    }
}

/// The components a model is made of (full attention always).
#[derive(Clone, Copy, Debug, Default)]
pub struct Model {
    mamba: bool,
    swa: bool,
}

impl Model {
    /// The model a configuration describes: Mamba layers with `mamba_slots`, SWA layers
    /// with `swa_slots`.
    pub fn of(config: &Config) -> Model {
        Model {
            mamba: config.mamba_slots > 0,
            swa: config.has_swa(),
        }
    }

    /// Whether the model has component `C`.
    #[inline]
    fn with<C: Component>(self) -> bool {
        self.has(C::KIND)
    }

    /// Whether the model has component `kind`.
    #[inline]
    pub fn has(self, kind: ComponentKind) -> bool {
        match kind {
            ComponentKind::Full => true,
            ComponentKind::Mamba => self.mamba,
            ComponentKind::Swa => self.swa,
        }
    }

    /// The model's components, full attention first.
    pub fn components(self) -> Vec<ComponentKind> {
        [
            ComponentKind::Full,
            ComponentKind::Mamba,
            ComponentKind::Swa,
        ]
        .into_iter()
        .filter(|&k| self.has(k))
        .collect()
    }
}

/// What a component provides to the cache's shared machinery.
pub(crate) trait Component {
    /// Which component this is.
    const KIND: ComponentKind;
    /// What a match walk carries from one node of the path to the next.
    type Walk: Default;

    /// Takes node `i`, the next node of a matched path (whole, `depth` tokens from the
    /// root at its end; `on_device`: it and every node above have their KV on the
    /// device and landed) and says whether a match may end at its end.
    fn cut(c: &Cache, walk: &mut Self::Walk, i: u32, depth: usize, on_device: bool) -> bool;

    /// Whether a load-back could make a match end at node `i` (its data is on some
    /// tier); called once per node after [`Component::cut`], with the same walk.
    fn anywhere(c: &Cache, walk: &mut Self::Walk, i: u32, depth: usize) -> bool;

    /// A lock of the path ending at node `i` was taken: takes this component's share.
    /// Returns whether it took something the receipt must give back.
    fn lock(c: &mut Cache, i: u32) -> bool;

    /// The lock ending at node `i` is released; `took` is what [`Component::lock`] said.
    fn release(c: &mut Cache, i: u32, took: bool);

    /// Node `lower` was split: `upper` is its new upper part.
    fn split(c: &mut Cache, upper: u32, lower: u32);

    /// Checks what this component keeps (beyond the checks every pool and node gets).
    fn audit(c: &Cache) -> Result<()>;
}

/// Full-attention KV: the tree's pages themselves.
pub(crate) struct FullAttention;

impl Component for FullAttention {
    const KIND: ComponentKind = ComponentKind::Full;
    type Walk = ();

    #[inline]
    fn cut(_: &Cache, (): &mut (), _: u32, _: usize, on_device: bool) -> bool {
        on_device
    }

    #[inline]
    fn anywhere(_: &Cache, (): &mut (), _: u32, _: usize) -> bool {
        true
    }

    /// The path lock is the shared part of every lock ([`Cache::lock_index`]).
    #[inline]
    fn lock(_: &mut Cache, _: u32) -> bool {
        false
    }

    #[inline]
    fn release(_: &mut Cache, _: u32, _: bool) {}

    /// A split shares the KV pages between the parts ([`crate::tree::Tree::split`]).
    #[inline]
    fn split(_: &mut Cache, _: u32, _: u32) {}

    /// Pages, path locks and the eviction sets are checked for every node (`audit.rs`).
    fn audit(_: &Cache) -> Result<()> {
        Ok(())
    }
}

/// Mamba states: at most one per node and tier, at the node's end.
pub(crate) struct MambaStates;

impl Component for MambaStates {
    const KIND: ComponentKind = ComponentKind::Mamba;
    type Walk = ();

    #[inline]
    fn cut(c: &Cache, (): &mut (), i: u32, _: usize, on_device: bool) -> bool {
        on_device && c.tree.node(i).mamba.device.is_some()
    }

    #[inline]
    fn anywhere(c: &Cache, (): &mut (), i: u32, _: usize) -> bool {
        let m = &c.tree.node(i).mamba;
        m.device.is_some() || m.host.is_some()
    }

    /// Holds the node's state (a single-node lock), when it has one.
    #[inline]
    fn lock(c: &mut Cache, i: u32) -> bool {
        let has = c.tree.node(i).mamba.device.is_some();
        if has {
            c.edit(i, |n| n.mamba.lock += 1);
            c.refresh(i);
        }
        has
    }

    #[inline]
    fn release(c: &mut Cache, i: u32, took: bool) {
        if took {
            // A locked state is never evicted: it is still there.
            c.edit(i, |n| n.mamba.lock -= 1);
        }
    }

    /// The state stays with the lower part, which keeps the node's end.
    #[inline]
    fn split(_: &mut Cache, _: u32, _: u32) {}

    /// State placement and locks are checked per node (`audit.rs`, invariant 3).
    fn audit(_: &Cache) -> Result<()> {
        Ok(())
    }
}

/// Sliding-window attention (`swa.rs`).
pub(crate) struct SlidingWindow;

impl Component for SlidingWindow {
    const KIND: ComponentKind = ComponentKind::Swa;
    /// The live SWA tokens ending at the current node: on the device, and counting
    /// host-only nodes by their host SWA pages.
    type Walk = (usize, usize);

    #[inline]
    fn cut(c: &Cache, walk: &mut (usize, usize), i: u32, depth: usize, on_device: bool) -> bool {
        walk.0 = if on_device { c.swa_run(i, walk.0) } else { 0 };
        // A prefix shorter than the window needs all its tokens live.
        walk.0 >= c.swa.need() || walk.0 == depth
    }

    #[inline]
    fn anywhere(c: &Cache, walk: &mut (usize, usize), i: u32, depth: usize) -> bool {
        walk.1 = c.swa_run_any(i, walk.1);
        walk.1 >= c.swa.need() || walk.1 == depth
    }

    fn lock(c: &mut Cache, i: u32) -> bool {
        c.swa_lock(i);
        false
    }

    fn release(c: &mut Cache, i: u32, _: bool) {
        c.swa_unlock(i);
    }

    fn split(c: &mut Cache, upper: u32, lower: u32) {
        c.swa_split(upper, lower);
    }

    fn audit(c: &Cache) -> Result<()> {
        c.audit_swa()
    }
}

/// A match walk over the model's components: cut where all of them accept.
#[derive(Default)]
pub(crate) struct Cut {
    model: Model,
    swa: <SlidingWindow as Component>::Walk,
}

impl Cut {
    /// A walk for `model`, from the root.
    pub fn new(model: Model) -> Cut {
        Cut {
            model,
            ..Cut::default()
        }
    }

    /// Takes the path's next node (see [`Component::cut`]); true when every component
    /// accepts a match ending there.
    #[inline]
    pub fn step(&mut self, c: &Cache, i: u32, depth: usize, on_device: bool) -> bool {
        // Every component sees every node (a walk keeps its own state), so no `&&`
        // short-circuit before the stateful ones.
        let swa = !self.model.with::<SlidingWindow>()
            || SlidingWindow::cut(c, &mut self.swa, i, depth, on_device);
        let full = FullAttention::cut(c, &mut (), i, depth, on_device);
        let mamba =
            !self.model.with::<MambaStates>() || MambaStates::cut(c, &mut (), i, depth, on_device);
        full && mamba && swa
    }

    /// Whether a load-back could end a match at node `i` for every component (called
    /// once per node, after [`Cut::step`]).
    #[inline]
    pub fn anywhere(&mut self, c: &Cache, i: u32, depth: usize) -> bool {
        let swa = !self.model.with::<SlidingWindow>()
            || SlidingWindow::anywhere(c, &mut self.swa, i, depth);
        let full = FullAttention::anywhere(c, &mut (), i, depth);
        let mamba =
            !self.model.with::<MambaStates>() || MambaStates::anywhere(c, &mut (), i, depth);
        full && mamba && swa
    }
}

impl Cache {
    /// The components of the cache's model, full attention first.
    pub fn components(&self) -> Vec<ComponentKind> {
        self.model.components()
    }

    /// The model the cache serves.
    #[inline]
    pub(crate) fn model(&self) -> Model {
        self.model
    }

    /// Every component's share of a lock ending at node `i`; returns what the receipt
    /// must give back (the state lock).
    pub(crate) fn lock_components(&mut self, i: u32) -> bool {
        let model = self.model;
        FullAttention::lock(self, i);
        let mamba = model.with::<MambaStates>() && MambaStates::lock(self, i);
        if model.with::<SlidingWindow>() {
            SlidingWindow::lock(self, i);
        }
        mamba
    }

    /// Every component's share of releasing the lock ending at node `i`.
    pub(crate) fn release_components(&mut self, i: u32, mamba: bool) {
        let model = self.model;
        if model.with::<SlidingWindow>() {
            SlidingWindow::release(self, i, false);
        }
        if model.with::<MambaStates>() {
            MambaStates::release(self, i, mamba);
        }
        FullAttention::release(self, i, false);
    }

    /// Every component's share of splitting node `lower` (its new upper part `upper`).
    pub(crate) fn split_components(&mut self, upper: u32, lower: u32) {
        let model = self.model;
        FullAttention::split(self, upper, lower);
        if model.with::<MambaStates>() {
            MambaStates::split(self, upper, lower);
        }
        if model.with::<SlidingWindow>() {
            SlidingWindow::split(self, upper, lower);
        }
    }

    /// Every component's own checks (`audit()`).
    pub(crate) fn audit_components(&self) -> Result<()> {
        FullAttention::audit(self)?;
        if self.model.with::<MambaStates>() {
            MambaStates::audit(self)?;
        }
        if self.model.with::<SlidingWindow>() {
            SlidingWindow::audit(self)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{ComponentKind, Model};
    use crate::cache::Cache;
    use crate::config::Config;

    fn config(mamba: usize, swa: usize) -> Config {
        Config {
            kv_slots: 64,
            page_size: 4,
            mamba_slots: mamba,
            swa_slots: swa,
            swa_window: if swa > 0 { 8 } else { 0 },
            ..Config::default()
        }
    }

    #[test]
    fn a_model_is_the_set_of_configured_components_full_attention_first() {
        let names = |mamba, swa| {
            let c = Cache::new(config(mamba, swa)).unwrap();
            c.components()
                .into_iter()
                .map(ComponentKind::name)
                .collect::<Vec<_>>()
        };
        assert_eq!(names(0, 0), ["full"]);
        assert_eq!(names(4, 0), ["full", "mamba"]);
        assert_eq!(names(0, 32), ["full", "swa"]);
        assert_eq!(names(4, 32), ["full", "mamba", "swa"]);
        assert!(Model::default().has(ComponentKind::Full));
        assert!(!Model::default().has(ComponentKind::Swa));
    }

    #[test]
    fn a_match_is_cut_where_every_component_accepts() {
        // Mamba + SWA: KV and window reach 16 tokens, the only state sits at 8; the match
        // ends there.
        let mut c = Cache::new(config(4, 32)).unwrap();
        let tokens: Vec<u32> = (1..=16).collect();
        let slots = c.alloc_kv(16).unwrap().unwrap();
        c.insert(None, &tokens, &slots, 0).unwrap();
        let state = c.alloc_mamba().unwrap().unwrap();
        c.insert_with_state(None, &tokens[..8], &slots[..8], 8, Some(i64::from(state)))
            .unwrap();
        c.audit().unwrap();
        let m = c.match_prefix(None, &tokens);
        assert_eq!(m.kv_len, 16, "the KV match reaches the end");
        assert_eq!(m.device_len, 8, "cut at the only node end with a state");
        c.audit().unwrap();
    }
}
