//! The match walk over the model's components: at each node of a matched path, every
//! component of the model says whether a match may end there ([`Component::cut`]), and
//! the match cuts at the deepest node all accept. What each component carries from node
//! to node is its field of `Walks`, generated from the list of components.

#[cfg(test)]
use super::balanced;
use super::{full, mamba, swa};
use super::{Component, Model};
use crate::cache::Cache;

/// What a match walk carries per component: `Walks` with a field per component of the
/// list, each reached through [`WalkOf`].
macro_rules! walks_of {
    ({} $( $(#[$a:meta])* $name:ident : $t:ty ,)*) => {
        /// What a match walk carries from node to node, per component.
        #[derive(Default)]
        struct Walks {
            $( $(#[$a])* $name: <$t as Component>::Walk, )*
        }
        $(
            $(#[$a])*
            impl WalkOf<$t> for Walks {
                #[inline]
                fn walk(&mut self) -> &mut <$t as Component>::Walk {
                    &mut self.$name
                }
            }
        )*
    };
}

/// Component `C`'s part of a match walk.
trait WalkOf<C: Component> {
    fn walk(&mut self) -> &mut C::Walk;
}

components!(walks_of! {});

/// A match walk over the model's components: cut where all of them accept.
#[derive(Default)]
pub(crate) struct Cut {
    model: Model,
    walks: Walks,
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
    // Always inlined: the match walk calls it per node, and out of line it costs a
    // match more (benches/instructions.py).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub fn step(&mut self, c: &Cache, i: u32, depth: usize, on_device: bool) -> bool {
        // Every component sees every node (a walk keeps its own state), so no `&&`
        // short-circuit.
        let mut ok = true;
        each_component!(self.model, |C| {
            ok &= C::cut(c, WalkOf::<C>::walk(&mut self.walks), i, depth, on_device);
        });
        ok
    }

    /// Whether a load-back could end a match at node `i` for every component (called
    /// once per node, after [`Cut::step`]).
    #[inline]
    pub fn cut_any_tier(&mut self, c: &Cache, i: u32, depth: usize) -> bool {
        let mut ok = true;
        each_component!(self.model, |C| {
            ok &= C::cut_any_tier(c, WalkOf::<C>::walk(&mut self.walks), i, depth);
        });
        ok
    }

    /// [`Cut::step`] and [`Cut::cut_any_tier`] for a path's last node, matched `len`
    /// tokens into (see [`Component::cut_inside`]).
    pub fn cut_inside(
        &mut self,
        c: &Cache,
        i: u32,
        len: usize,
        depth: usize,
        on_device: bool,
    ) -> (bool, bool) {
        let (mut device, mut any) = (true, true);
        each_component!(self.model, |C| {
            let (d, a) = C::cut_inside(
                c,
                WalkOf::<C>::walk(&mut self.walks),
                i,
                len,
                depth,
                on_device,
            );
            device &= d;
            any &= a;
        });
        (device, any)
    }
}
