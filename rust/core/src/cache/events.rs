//! KV events (docs/design.md, "KV events (core)"): what a cache-aware router needs to
//! keep an index of which page hashes each tier holds, and where a Mamba state sits.
//!
//! Every change to a node's data goes through [`Cache::edit`], which, with events on,
//! compares what the node holds now (`Announced::of`: device KV that has landed, host
//! KV, a device state that has landed, a host state) with what was announced of it and
//! queues one event per difference. So an event is emitted exactly where the tree
//! changes, per tier: a publish (insert, a request's pages), a device eviction or
//! demotion (when the device pages are freed: under write-back when the eviction
//! settles, not when it is chosen), a backup landing, a host eviction, a load-back
//! whose copies landed; a committed load-back still in flight, or one that failed,
//! announces nothing. A split changes no page's hash, so it announces nothing (the
//! upper part takes the lower part's flags for its pages). SWA pages are not announced.

use std::mem;

use crate::error::{Error, Result};
use crate::hashes::PageHash;

use super::components::mamba;
use super::hashing::last_hash_in;
use super::namespaces::Namespaces;
use super::Cache;
use crate::tree::Tree;

/// Where the announced data sits (the names are `SGLang`'s and `vLLM`'s `medium`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Medium {
    /// Device memory (`"GPU"`).
    Device,
    /// The host tier (`"CPU_PINNED"`).
    Host,
    /// A store beyond the machine, the L3 tier (`"EXTERNAL"`), announced through
    /// [`Cache::note_external_stored`] and [`Cache::note_external_removed`].
    External,
}

impl Medium {
    /// The name routers know the medium by.
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Device => "GPU",
            Medium::Host => "CPU_PINNED",
            Medium::External => "EXTERNAL",
        }
    }
}

/// One KV event, in the order the tree changed (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Pages became available on `medium`: one node's pages (`hashes`, one per page,
    /// chained from `parent_hash`, the page before them; `None` at a namespace's root)
    /// with their `token_ids` (every token of the pages), in pages of `block_size`.
    Stored {
        /// Where.
        medium: Medium,
        /// The namespace (`None`: the default one).
        namespace: Option<String>,
        /// One hash per page.
        hashes: Vec<PageHash>,
        /// The hash of the page before the first (`None`: the first page of its chain).
        parent_hash: Option<PageHash>,
        /// The pages' tokens.
        token_ids: Vec<u32>,
        /// Tokens per page.
        block_size: usize,
    },
    /// Pages are no longer on `medium`.
    Removed {
        /// Where.
        medium: Medium,
        /// The namespace.
        namespace: Option<String>,
        /// One hash per page.
        hashes: Vec<PageHash>,
    },
    /// Everything on every medium is gone: [`Cache::reset`] emptied the cache (the
    /// L3 store keeps its objects, but they are not announced again).
    Cleared,
    /// A Mamba state for the prefix ending with page `hash` became available on
    /// `medium` (states sit at node ends, so `hash` is a node's last page).
    StateStored {
        /// Where.
        medium: Medium,
        /// The namespace.
        namespace: Option<String>,
        /// The last page of the state's prefix.
        hash: PageHash,
    },
    /// That state is no longer on `medium`.
    StateRemoved {
        /// Where.
        medium: Medium,
        /// The namespace.
        namespace: Option<String>,
        /// The last page of the state's prefix.
        hash: PageHash,
    },
}

/// The queue of events not yet taken.
#[derive(Debug, Default)]
pub(crate) struct Events {
    queue: Vec<KvEvent>,
    emitted: u64,
}

impl Events {
    fn push(&mut self, e: KvEvent) {
        self.queue.push(e);
        self.emitted += 1;
    }

    /// Events emitted since the cache was built.
    pub fn emitted(&self) -> u64 {
        self.emitted
    }

    /// Events waiting for [`Cache::take_events`].
    pub fn pending(&self) -> usize {
        self.queue.len()
    }

    /// Takes back the events queued after the first `keep` (a reset announces one
    /// `Cleared` instead of what its deletions queued).
    pub fn truncate(&mut self, keep: usize) {
        let dropped = self.queue.len().saturating_sub(keep);
        self.queue.truncate(keep);
        self.emitted -= dropped as u64;
    }

    /// Queues `Cleared`.
    pub fn push_cleared(&mut self) {
        self.push(KvEvent::Cleared);
    }
}

impl Cache {
    /// The events emitted since the last call, oldest first. Refused (naming `events`,
    /// and saying how to turn them on) when the cache was built without events: it
    /// queues none, and a router fed from it would wait for ever.
    pub fn take_events(&mut self) -> Result<Vec<KvEvent>> {
        self.events_on("take_events")?;
        self.reap();
        Ok(mem::take(&mut self.events.queue))
    }

    /// The namespace node `i` belongs to (`None`: the default one).
    pub(crate) fn namespace_of(&self, i: u32) -> Option<String> {
        namespace_in(&self.tree, &self.roots, i)
    }

    /// With events on, what a landed `l3_put` of node `i`'s pages (`kv`) or of the state
    /// at its end (else) will announce on the `EXTERNAL` medium: taken when the put is
    /// emitted, so that a split or eviction meanwhile does not change it.
    pub(crate) fn external_event(&self, i: u32, kv: bool) -> Option<KvEvent> {
        if !self.config.events {
            return None;
        }
        let n = self.tree.node(i);
        let namespace = self.namespace_of(i);
        if kv {
            Some(KvEvent::Stored {
                medium: Medium::External,
                namespace,
                hashes: n.hashes.clone(),
                parent_hash: self.tree.node(n.parent).hashes.last().copied(),
                token_ids: n.key.clone(),
                block_size: self.config.page_size,
            })
        } else {
            Some(KvEvent::StateStored {
                medium: Medium::External,
                namespace,
                hash: *n.hashes.last()?,
            })
        }
    }

    /// Queues events prepared by [`Cache::external_event`] (a put landed).
    pub(crate) fn push_events(&mut self, events: Vec<KvEvent>) {
        for e in events {
            self.events.push(e);
        }
    }

    /// Refuses an events call (`call`) when events are off, saying how to turn them on.
    fn events_on(&self, call: &str) -> Result<()> {
        if self.config.events {
            return Ok(());
        }
        Err(Error::arg(
            "events",
            format!(
                "{call}: the cache was built with events=False, so it queues no KV events; \
                 build it with page_hashes=True, events=True (events name pages by their \
                 hashes)"
            ),
        ))
    }

    /// Announces pages stored in the L3 tier (medium `EXTERNAL`): the tier calls this
    /// once its objects are written. `hashes` one per page of `token_ids` (pages of
    /// the cache's page size), chained from `parent_hash`. The core keeps no books of
    /// the external tier: what is announced is the caller's to get right.
    pub fn note_external_stored(
        &mut self,
        namespace: Option<&str>,
        hashes: Vec<PageHash>,
        parent_hash: Option<PageHash>,
        token_ids: Vec<u32>,
    ) -> Result<()> {
        self.events_on("note_external_stored")?;
        let ps = self.config.page_size;
        if token_ids.len() != hashes.len() * ps {
            return Err(Error::arg(
                "token_ids",
                format!(
                    "has {} tokens for {} pages of {ps}",
                    token_ids.len(),
                    hashes.len()
                ),
            ));
        }
        self.events.push(KvEvent::Stored {
            medium: Medium::External,
            namespace: namespace.map(str::to_owned),
            hashes,
            parent_hash,
            token_ids,
            block_size: ps,
        });
        Ok(())
    }

    /// Announces pages gone from the L3 tier (medium `EXTERNAL`).
    pub fn note_external_removed(
        &mut self,
        namespace: Option<&str>,
        hashes: Vec<PageHash>,
    ) -> Result<()> {
        self.events_on("note_external_removed")?;
        self.events.push(KvEvent::Removed {
            medium: Medium::External,
            namespace: namespace.map(str::to_owned),
            hashes,
        });
        Ok(())
    }

    /// Events emitted since the cache was built, and events pending (`stats()`).
    pub(crate) fn event_counts(&self) -> (u64, usize) {
        (self.events.emitted(), self.events.pending())
    }

    /// What the tree holds, as a router's index built from the events would: per
    /// medium (device, host), the hashes of the pages there (landed) and of the node
    /// ends with a state there, with their namespaces. Computed from the nodes alone
    /// (not from what was announced), for tests that rebuild the index from the events.
    pub fn event_contents(&self) -> EventContents {
        let mut out = EventContents::default();
        for (ns, root) in self.roots.all() {
            let ns = ns.map(str::to_owned);
            for i in self.tree.preorder(root).into_iter().skip(1) {
                let n = self.tree.node(i);
                let a = mamba::announced(n);
                let last = n.hashes.last().copied();
                for (medium, kv, state) in [
                    (Medium::Device, a.device, a.device_state),
                    (Medium::Host, a.host, a.host_state),
                ] {
                    if kv {
                        for &h in &n.hashes {
                            out.pages.push((medium, ns.clone(), h));
                        }
                    }
                    if let (true, Some(h)) = (state, last) {
                        out.states.push((medium, ns.clone(), h));
                    }
                }
            }
        }
        out.pages.sort_unstable();
        out.states.sort_unstable();
        out
    }
}

/// What [`Cache::event_contents`] answers: sorted `(medium, namespace, hash)` entries.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EventContents {
    /// Every page on each medium.
    pub pages: Vec<(Medium, Option<String>, PageHash)>,
    /// Every node end with a state on each medium.
    pub states: Vec<(Medium, Option<String>, PageHash)>,
}

impl Events {
    /// Emits the events that bring what was announced of node `i` of `tree` (whose
    /// namespaces `roots` names, pages of `page_size` tokens) to what it holds now
    /// (called by [`Cache::edit`] and [`Parts::edit`] with events on). States go before
    /// their pages go, and come after them.
    pub(crate) fn announce(
        &mut self,
        tree: &mut Tree,
        roots: &Namespaces,
        page_size: usize,
        i: u32,
    ) {
        let n = tree.node(i);
        if n.is_root() {
            return;
        }
        let now = mamba::announced(n);
        let was = n.announced;
        if now == was {
            return;
        }
        tree.node_mut(i).announced = now;
        let namespace = namespace_in(tree, roots, i);
        let n = tree.node(i);
        let last = n.hashes.last().copied().unwrap_or_default();
        let state = |medium, on: bool| {
            let namespace = namespace.clone();
            if on {
                KvEvent::StateStored {
                    medium,
                    namespace,
                    hash: last,
                }
            } else {
                KvEvent::StateRemoved {
                    medium,
                    namespace,
                    hash: last,
                }
            }
        };
        let mut out = Vec::new();
        for (medium, on, off) in [
            (Medium::Device, now.device_state, was.device_state),
            (Medium::Host, now.host_state, was.host_state),
        ] {
            if off && !on {
                out.push(state(medium, false));
            }
        }
        for (medium, on, off) in [
            (Medium::Device, now.device, was.device),
            (Medium::Host, now.host, was.host),
        ] {
            if off && !on {
                out.push(KvEvent::Removed {
                    medium,
                    namespace: namespace.clone(),
                    hashes: n.hashes.clone(),
                });
            }
        }
        for (medium, on, off) in [
            (Medium::Device, now.device, was.device),
            (Medium::Host, now.host, was.host),
        ] {
            if on && !off {
                out.push(KvEvent::Stored {
                    medium,
                    namespace: namespace.clone(),
                    hashes: n.hashes.clone(),
                    parent_hash: last_hash_in(tree, n.parent),
                    token_ids: n.key.clone(),
                    block_size: page_size,
                });
            }
        }
        for (medium, on, off) in [
            (Medium::Device, now.device_state, was.device_state),
            (Medium::Host, now.host_state, was.host_state),
        ] {
            if on && !off {
                out.push(state(medium, true));
            }
        }
        for e in out {
            self.push(e);
        }
    }
}

/// The namespace node `i` of `tree` belongs to (`None`: the default one).
fn namespace_in(tree: &Tree, roots: &Namespaces, mut i: u32) -> Option<String> {
    while !tree.node(i).is_root() {
        i = tree.node(i).parent;
    }
    roots.name_of(i).map(str::to_owned)
}
