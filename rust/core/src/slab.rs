//! A slab: entries in reused slots, each named by its index and a 64-bit generation, so
//! that the name of a removed entry never reaches the entry that reuses its slot.

use crate::ids::Slot;

/// Entries of type `T` in reused slots.
pub(crate) struct Slab<T> {
    slots: Vec<(u64, Option<T>)>,
    free: Vec<u32>,
    live: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Slab<T> {
        Slab {
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
        }
    }
}

impl<T> Slab<T> {
    /// Entries in the slab.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Stores `value`; returns its name.
    pub fn insert(&mut self, value: T) -> Slot {
        let index = self.free.pop().unwrap_or_else(|| {
            self.slots.push((0, None));
            crate::pool::index_u32(self.slots.len() - 1)
        });
        let slot = &mut self.slots[index as usize];
        slot.1 = Some(value);
        self.live += 1;
        Slot {
            index,
            generation: slot.0,
        }
    }

    /// The entry named `at`, if it is still there.
    pub fn get(&self, at: Slot) -> Option<&T> {
        match self.slots.get(at.index as usize) {
            Some((g, Some(v))) if *g == at.generation => Some(v),
            _ => None,
        }
    }

    /// The entry named `at`, if it is still there.
    pub fn get_mut(&mut self, at: Slot) -> Option<&mut T> {
        match self.slots.get_mut(at.index as usize) {
            Some((g, Some(v))) if *g == at.generation => Some(v),
            _ => None,
        }
    }

    /// Takes out the entry named `at`; its name goes stale.
    pub fn remove(&mut self, at: Slot) -> Option<T> {
        self.get(at)?;
        let slot = &mut self.slots[at.index as usize];
        slot.0 = slot.0.wrapping_add(1);
        self.free.push(at.index);
        self.live -= 1;
        slot.1.take()
    }

    /// Every entry with its name.
    pub fn iter(&self) -> impl Iterator<Item = (Slot, &T)> {
        self.slots.iter().enumerate().filter_map(|(i, (g, v))| {
            v.as_ref().map(|v| {
                (
                    Slot {
                        index: crate::pool::index_u32(i),
                        generation: *g,
                    },
                    v,
                )
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_removed_entry_s_name_never_reaches_the_entry_that_reuses_its_slot() {
        let mut s = Slab::default();
        let a = s.insert("a");
        assert_eq!(s.remove(a), Some("a"));
        let b = s.insert("b");
        assert_eq!(b.index, a.index, "slot reused");
        assert_eq!(s.get(a), None);
        assert_eq!(s.remove(a), None);
        assert_eq!(s.get(b), Some(&"b"));
        assert_eq!(s.len(), 1);
        assert_eq!(
            s.iter().map(|(k, v)| (k, *v)).collect::<Vec<_>>(),
            [(b, "b")]
        );
    }
}
