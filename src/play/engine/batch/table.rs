//! The request table: every request of one engine in a slab, reached by a [`Slot`] on the
//! step's hot path and by request id from the outside (aborts, P/D, utility calls).
//!
//! A step touches every running request several times (compose, allocate, advance, emit);
//! with thousands of streams, hashing and cloning their string ids dominated the engine's
//! profile. A slot is a copyable index with a generation, so a slot kept across a step
//! (the step plan) never reaches a request that took the place of a removed one.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use rustc_hash::FxHasher;

use crate::play::engine::request::SimRequest;

/// Where a request lives in the table. Stale once the request is removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot {
    index: u32,
    generation: u32,
}

type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// Requests by slot, with an index by request id.
#[derive(Default)]
pub struct RequestTable {
    entries: Vec<Entry>,
    free: Vec<u32>,
    by_id: FxMap<sim_protocol::RequestId, Slot>,
}

#[derive(Default)]
struct Entry {
    generation: u32,
    request: Option<SimRequest>,
}

impl RequestTable {
    /// Add `r` (its id must not be in the table); its slot.
    pub fn insert(&mut self, r: SimRequest) -> Slot {
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                self.entries.push(Entry::default());
                (self.entries.len() - 1) as u32
            }
        };
        let e = &mut self.entries[index as usize];
        let slot = Slot {
            index,
            generation: e.generation,
        };
        self.by_id.insert(r.id.clone(), slot);
        e.request = Some(r);
        slot
    }

    /// Take the request at `slot` out; its place is reused with a new generation.
    pub fn remove(&mut self, slot: Slot) -> Option<SimRequest> {
        let e = self.entries.get_mut(slot.index as usize)?;
        if e.generation != slot.generation {
            return None;
        }
        let r = e.request.take()?;
        e.generation = e.generation.wrapping_add(1);
        self.free.push(slot.index);
        self.by_id.remove(r.id.as_str());
        Some(r)
    }

    pub fn get(&self, slot: Slot) -> Option<&SimRequest> {
        let e = self.entries.get(slot.index as usize)?;
        (e.generation == slot.generation)
            .then_some(e.request.as_ref())
            .flatten()
    }

    pub fn get_mut(&mut self, slot: Slot) -> Option<&mut SimRequest> {
        let e = self.entries.get_mut(slot.index as usize)?;
        if e.generation != slot.generation {
            return None;
        }
        e.request.as_mut()
    }

    /// The slot of request `id`.
    pub fn slot(&self, id: &str) -> Option<Slot> {
        self.by_id.get(id).copied()
    }

    pub fn by_id(&self, id: &str) -> Option<&SimRequest> {
        self.get(self.slot(id)?)
    }

    pub fn by_id_mut(&mut self, id: &str) -> Option<&mut SimRequest> {
        let slot = self.slot(id)?;
        self.get_mut(slot)
    }

    pub fn contains(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Every request, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &SimRequest> {
        self.entries.iter().filter_map(|e| e.request.as_ref())
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut SimRequest> {
        self.entries.iter_mut().filter_map(|e| e.request.as_mut())
    }

    /// Every request id, in no particular order.
    pub fn ids(&self) -> impl Iterator<Item = &sim_protocol::RequestId> {
        self.by_id.keys()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::play::content::tokens::{RandomTokens, TokenSource};
    use sim_protocol::EngineCoreRequest;

    fn req(id: &str) -> SimRequest {
        let r = EngineCoreRequest {
            request_id: id.into(),
            prompt_token_ids: Some(vec![1, 2, 3]),
            ..Default::default()
        };
        let tokens = RandomTokens {
            seed: 0,
            min_id: 3,
            vocab_size: 259,
        };
        SimRequest::new(&r, tokens.stream_for(&r), 0)
    }

    #[test]
    fn a_slot_of_a_removed_request_never_reaches_the_next_one_in_its_place() {
        let mut t = RequestTable::default();
        let a = t.insert(req("a"));
        assert_eq!(t.by_id("a").map(|r| r.id.as_str()), Some("a"));
        assert_eq!(t.remove(a).map(|r| r.id.to_string()), Some("a".to_string()));
        let b = t.insert(req("b"));
        assert_ne!(a, b, "the place is reused with a new generation");
        assert!(t.get(a).is_none());
        assert!(t.remove(a).is_none());
        assert_eq!(t.get(b).map(|r| r.id.as_str()), Some("b"));
        assert!(!t.contains("a"));
        assert_eq!(t.len(), 1);
        assert_eq!(t.slot("b"), Some(b));
    }
}
