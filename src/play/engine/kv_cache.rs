//! The KV-cache block pool with prefix caching, following vLLM's `BlockPool`
//! (`vllm/v1/core/block_pool.py`) and `KVCacheManager` (`kv_cache_manager.py`):
//!
//! - block 0 is the reserved null block, so `num_gpu_blocks - 1` blocks are usable and
//!   `kv_cache_usage = 1 - free / (num_gpu_blocks - 1)`;
//! - free blocks sit in one LRU queue; allocation takes from the head and evicts the
//!   block's cached hash (a BlockRemoved event); freed blocks join the tail, a request's
//!   blocks in reverse order so its tail blocks are evicted first;
//! - full blocks are cached under their chained hash (a BlockStored event); a cache hit
//!   takes a block back out of the free queue (`touch`);
//! - `reset` clears every cached hash, only while no block is in use (AllBlocksCleared).

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use rustc_hash::FxHasher;

use sim_protocol::kv_events::KvEvent;

use super::block_hash::{BlockHash, hash_u64};

/// What the pool did to its cache, for KV-cache events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolEvent {
    Stored {
        hashes: Vec<BlockHash>,
        parent: Option<BlockHash>,
        token_ids: Vec<u32>,
        lora: Option<(i64, String)>,
    },
    Removed {
        hashes: Vec<BlockHash>,
    },
    AllCleared,
}

impl PoolEvent {
    /// The KV-cache event vLLM publishes for it (64-bit hashes, `block_size` tokens per
    /// block).
    pub fn into_kv_event(self, block_size: u32) -> KvEvent {
        match self {
            PoolEvent::Stored {
                hashes,
                parent,
                token_ids,
                lora,
            } => {
                let mut ev = KvEvent::block_stored(
                    hashes.iter().map(hash_u64).collect(),
                    parent.as_ref().map(hash_u64),
                    token_ids,
                    block_size,
                );
                if let (
                    KvEvent::BlockStored {
                        lora_id, lora_name, ..
                    },
                    Some((id, name)),
                ) = (&mut ev, lora)
                {
                    *lora_id = Some(id);
                    *lora_name = Some(name);
                }
                ev
            }
            PoolEvent::Removed { hashes } => {
                KvEvent::block_removed(hashes.iter().map(hash_u64).collect())
            }
            PoolEvent::AllCleared => KvEvent::AllBlocksCleared,
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Block {
    ref_cnt: u32,
    hash: Option<BlockHash>,
}

const NIL: usize = usize::MAX;

/// An intrusive doubly linked list over block ids: O(1) push-back, pop-front and removal.
#[derive(Debug)]
struct FreeQueue {
    prev: Vec<usize>,
    next: Vec<usize>,
    head: usize,
    tail: usize,
    len: usize,
    member: Vec<bool>,
}

impl FreeQueue {
    fn new(n: usize) -> Self {
        Self {
            prev: vec![NIL; n],
            next: vec![NIL; n],
            head: NIL,
            tail: NIL,
            len: 0,
            member: vec![false; n],
        }
    }

    fn push_back(&mut self, id: usize) {
        debug_assert!(!self.member[id]);
        self.prev[id] = self.tail;
        self.next[id] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail] = id;
        }
        self.tail = id;
        self.member[id] = true;
        self.len += 1;
    }

    fn remove(&mut self, id: usize) {
        if !self.member[id] {
            return;
        }
        let (p, n) = (self.prev[id], self.next[id]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n] = p;
        }
        self.member[id] = false;
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<usize> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.remove(id);
        Some(id)
    }
}

#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    free: FreeQueue,
    /// Block hash → block. The hashes are SHA-256 digests already: FxHash over them is as
    /// good as SipHash and much cheaper (it showed in the engine's profile).
    cached: HashMap<BlockHash, usize, BuildHasherDefault<FxHasher>>,
    record_events: bool,
    events: Vec<PoolEvent>,
    /// (lifetime, idle) seconds of evicted blocks would go here; not tracked yet.
    pub evictions: u64,
}

impl BlockPool {
    pub fn new(num_gpu_blocks: usize, record_events: bool) -> Self {
        let n = num_gpu_blocks.max(2);
        let mut free = FreeQueue::new(n);
        for id in 1..n {
            free.push_back(id);
        }
        Self {
            blocks: vec![Block::default(); n],
            free,
            cached: HashMap::default(),
            record_events,
            events: Vec::new(),
            evictions: 0,
        }
    }

    /// Start or stop recording cache events.
    pub fn set_record_events(&mut self, on: bool) {
        self.record_events = on;
        if !on {
            self.events.clear();
        }
    }

    /// Usable blocks (the null block excluded).
    pub fn capacity(&self) -> usize {
        self.blocks.len() - 1
    }

    /// Free blocks, cached-but-unused ones included (they can be evicted).
    pub fn num_free(&self) -> usize {
        self.free.len
    }

    /// Fraction of usable blocks in use (vLLM's `get_usage`).
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free() as f64 / self.capacity() as f64
    }

    /// The longest run of cached blocks matching `hashes` from the start
    /// (`find_longest_cache_hit`).
    pub fn lookup(&self, hashes: &[BlockHash]) -> Vec<usize> {
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }

    /// How many of `ids` are cached blocks nobody uses (they occupy free-queue slots).
    pub fn num_evictable(&self, ids: &[usize]) -> usize {
        ids.iter()
            .filter(|id| self.blocks[**id].ref_cnt == 0)
            .count()
    }

    /// Take a reference on cache-hit blocks.
    pub fn touch(&mut self, ids: &[usize]) {
        for &id in ids {
            if self.blocks[id].ref_cnt == 0 {
                self.free.remove(id);
            }
            self.blocks[id].ref_cnt += 1;
        }
    }

    /// `n` fresh blocks from the head of the free queue, or `None` if there are fewer.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<usize>> {
        if n > self.free.len {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        let mut removed = Vec::new();
        for _ in 0..n {
            let id = self.free.pop_front()?;
            if let Some(h) = self.blocks[id].hash.take() {
                if self.cached.get(&h) == Some(&id) {
                    self.cached.remove(&h);
                }
                self.evictions += 1;
                removed.push(h);
            }
            self.blocks[id].ref_cnt = 1;
            out.push(id);
        }
        if self.record_events && !removed.is_empty() {
            self.events.push(PoolEvent::Removed { hashes: removed });
        }
        Some(out)
    }

    /// Register full blocks under their hashes (`cache_full_blocks`). `blocks` and `hashes`
    /// are parallel; `parent` is the hash before the first; `tokens` the blocks' token ids.
    pub fn cache(
        &mut self,
        blocks: &[usize],
        hashes: &[BlockHash],
        parent: Option<BlockHash>,
        tokens: &[u32],
        lora: Option<(i64, &str)>,
    ) {
        let mut stored = 0usize;
        for (&id, h) in blocks.iter().zip(hashes) {
            if self.blocks[id].hash.is_some() {
                continue;
            }
            // A block computed twice (two requests in one step) keeps its hash too, as in
            // vLLM; lookups find the first copy.
            self.blocks[id].hash = Some(*h);
            self.cached.entry(*h).or_insert(id);
            stored += 1;
        }
        if self.record_events && stored > 0 {
            self.events.push(PoolEvent::Stored {
                hashes: hashes.to_vec(),
                parent,
                token_ids: tokens.to_vec(),
                lora: lora.map(|(id, name)| (id, name.to_string())),
            });
        }
    }

    /// Drop a request's references; blocks nobody uses go to the free queue tail, in the
    /// order given (callers pass a request's blocks reversed).
    pub fn free(&mut self, ids: impl IntoIterator<Item = usize>) {
        for id in ids {
            let b = &mut self.blocks[id];
            b.ref_cnt = b.ref_cnt.saturating_sub(1);
            if b.ref_cnt == 0 {
                self.free.push_back(id);
            }
        }
    }

    /// Forget every cached hash; refused (false) while any block is in use.
    pub fn reset(&mut self) -> bool {
        if self.free.len != self.capacity() {
            return false;
        }
        for b in &mut self.blocks {
            b.hash = None;
        }
        self.cached.clear();
        if self.record_events {
            self.events.push(PoolEvent::AllCleared);
        }
        true
    }

    /// Events since the last call.
    pub fn take_events(&mut self) -> Vec<PoolEvent> {
        std::mem::take(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> BlockHash {
        [i; 32]
    }

    #[test]
    fn usage_excludes_the_null_block() {
        let mut p = BlockPool::new(11, false);
        assert_eq!(p.capacity(), 10);
        assert_eq!(p.usage(), 0.0);
        let got = p.allocate(4).unwrap();
        assert_eq!(got, vec![1, 2, 3, 4]);
        assert!((p.usage() - 0.4).abs() < 1e-9);
        assert!(p.allocate(7).is_none(), "only 6 left");
        p.free(got.into_iter().rev());
        assert_eq!(p.usage(), 0.0);
    }

    #[test]
    fn cached_blocks_survive_until_evicted_lru() {
        let mut p = BlockPool::new(5, true); // 4 usable
        let a = p.allocate(2).unwrap(); // blocks 1, 2
        p.cache(&a, &[h(1), h(2)], None, &[0; 32], None);
        p.free(a.iter().rev().copied()); // tail order: ..., 2, 1
        assert_eq!(p.lookup(&[h(1), h(2), h(3)]), vec![1, 2]);
        // a hit takes the blocks back out of the free queue
        p.touch(&[1, 2]);
        assert_eq!(p.num_free(), 2);
        p.free([2, 1]);
        // fresh allocations take free blocks in LRU order: 3, 4 first, then 2 (freed
        // before 1), evicting its hash
        let b = p.allocate(3).unwrap();
        assert_eq!(b, vec![3, 4, 2]);
        assert_eq!(p.lookup(&[h(1), h(2)]), vec![1], "block 2 was evicted");
        let ev = p.take_events();
        assert!(matches!(&ev[0], PoolEvent::Stored { hashes, .. } if hashes.len() == 2));
        assert_eq!(ev[1], PoolEvent::Removed { hashes: vec![h(2)] });
    }

    #[test]
    fn reset_only_when_idle() {
        let mut p = BlockPool::new(4, true);
        let a = p.allocate(1).unwrap();
        p.cache(&a, &[h(9)], None, &[1; 16], None);
        assert!(!p.reset(), "a block is in use");
        p.free(a);
        assert!(p.reset());
        assert!(p.lookup(&[h(9)]).is_empty());
        assert_eq!(p.take_events().last(), Some(&PoolEvent::AllCleared));
    }
}
