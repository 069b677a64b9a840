//! The KV offload tier: a second, larger cache of KV blocks in host memory behind the
//! device's prefix cache, as vLLM's OffloadingConnector with its CPU backend keeps it
//! (`--kv-offload-blocks`, `--kv-offload-policy`, `--kv-offload-load-us`).
//!
//! What it mirrors of vLLM (one chunk is one block, vLLM's default `block_size`):
//!
//! - **store**: every full block a step computes is offered to the tier (vLLM's
//!   `_build_store_jobs` offers each request's newly full blocks after every step). Blocks
//!   already in the tier are not stored again but count as reused by the request. Room is
//!   made by evicting idle blocks under the policy, never one of the blocks being offered;
//!   when it cannot be made the whole offer is dropped (an allocation failure).
//! - **lookup and load**: a new request looks up the blocks after its device-cache hit;
//!   the consecutive run found in the tier is loaded into fresh device blocks and counts as
//!   computed (external) tokens. Each loaded block adds `--kv-offload-load-us` to the step
//!   that admits the request. vLLM loads asynchronously and schedules the request once the
//!   load is done; here the wait is folded into that step.
//! - **policies**: LRU (recency set at insertion and, in the request's block order, when
//!   the request finishes) and ARC (T1/T2 with ghost lists B1/B2 and an adaptive T1
//!   target), as vLLM's `LRUCachePolicy` and `ARCCachePolicy` do it.
//! - **events**: a `BlockRemoved` (medium `CPU`) for the blocks an offer evicts, then one
//!   `BlockStored` per stored block in vLLM's placeholder form (the block's hash only, no
//!   tokens, block size 0, medium `CPU`): vLLM's default, without
//!   `self_describing_kv_events`.
//!
//! Not simulated: the store's own transfer time (vLLM overlaps it with compute, off the
//! step's critical path), a store still in flight when a lookup asks (vLLM answers
//! "pending" and delays the request; here a store completes with its step), the store
//! threshold and sliding-window groups.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::BuildHasherDefault;
use std::time::Duration;

use rmpv::Value;
use rustc_hash::FxHasher;
use sim_protocol::PrefixCacheStats;
use sim_protocol::kv_events::KvEvent;

use super::block_hash::{BlockHash, hash_u64};

type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;
type FxSet<K> = HashSet<K, BuildHasherDefault<FxHasher>>;

/// vLLM's `MEDIUM_CPU`: the medium the CPU offload tier's events carry.
pub const MEDIUM_CPU: &str = "CPU";

/// `--kv-offload-policy`: which idle block the tier evicts first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OffloadPolicy {
    /// Least recently used (vLLM's `lru`, its default).
    #[default]
    Lru,
    /// Adaptive replacement: blocks reused by a request are kept apart from blocks seen
    /// once, and the split adapts to ghost hits (vLLM's `arc`).
    Arc,
}

/// The tier's settings (checked by `PlayConfig`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OffloadConfig {
    /// Capacity in blocks (≥ 1).
    pub blocks: usize,
    pub policy: OffloadPolicy,
    /// What loading one block back to the device costs the step that admits it.
    pub load_per_block: Duration,
    /// Bytes of one block, for the transfer metrics (`--kv-block-bytes`).
    pub block_bytes: u64,
    /// Send the transfer metrics as `kv_connector_stats` (`--kv-offload-connector-stats`).
    pub connector_stats: bool,
}

impl OffloadConfig {
    /// The tier the flags ask for (`None` for `--kv-offload-blocks 0`), or why they are
    /// wrong.
    pub fn from_flags(
        blocks: u64,
        policy: OffloadPolicy,
        load_us: f64,
        (block_bytes, connector_stats): (u64, bool),
        prefix_caching: bool,
    ) -> anyhow::Result<Option<Self>> {
        if blocks == 0 {
            return Ok(None);
        }
        if !prefix_caching {
            anyhow::bail!(
                "--kv-offload-blocks needs the prefix cache (its blocks are found by their prefix hashes): drop --no-enable-prefix-caching"
            );
        }
        if !load_us.is_finite() || load_us < 0.0 {
            anyhow::bail!("--kv-offload-load-us must be a finite number ≥ 0, got {load_us}");
        }
        Ok(Some(Self {
            blocks: usize::try_from(blocks)?,
            policy,
            load_per_block: Duration::from_secs_f64(load_us / 1e6),
            block_bytes,
            connector_stats,
        }))
    }
}

/// The tier's counters since the last [`OffloadTier::take_stats`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OffloadStats {
    /// Blocks stored into the tier (GPU_to_CPU).
    pub stored_blocks: u64,
    /// Blocks loaded back to the device (CPU_to_GPU).
    pub loaded_blocks: u64,
    /// Blocks evicted from the tier to make room.
    pub evicted_blocks: u64,
    /// Offers dropped because no room could be made (`vllm:kv_offload_allocation_failure`).
    pub allocation_failures: u64,
    /// What new requests asked the tier for and found there: vLLM's connector prefix
    /// cache stats (`vllm:external_prefix_cache_queries` / `_hits`).
    pub lookups: PrefixCacheStats,
    /// Bytes of each load (a request's blocks from the tier) and each store (an offer's
    /// new blocks), and the seconds the loads took.
    pub load_sizes: Vec<u64>,
    pub store_sizes: Vec<u64>,
    pub load_seconds: f64,
}

/// vLLM's offloading connector metric names (its `_TransferMetricName` and
/// `_ConnectorMetricName`).
const LOAD_BYTES: &str = "vllm:kv_offload_load_bytes";
const LOAD_TIME: &str = "vllm:kv_offload_load_time";
const LOAD_SIZE: &str = "vllm:kv_offload_load_size";
const STORE_BYTES: &str = "vllm:kv_offload_store_bytes";
const STORE_SIZE: &str = "vllm:kv_offload_store_size";
const ALLOCATION_FAILURE: &str = "vllm:kv_offload_allocation_failure";

impl OffloadStats {
    /// The connector's `kv_connector_stats` payload, as vLLM's `OffloadingConnectorStats`
    /// serializes it: `{"types": {metric: kind}, "data": {metric: {label values: value}}}`,
    /// every metric unlabeled (label values `()`); `None` when nothing happened (vLLM sends
    /// no empty stats). The store time is not modelled, so it is not sent.
    pub fn kv_connector_stats(&self) -> Option<Value> {
        let mut types = Vec::new();
        let mut data = Vec::new();
        let mut put = |name: &str, kind: &str, v: Value| {
            types.push((Value::from(name), Value::from(kind)));
            data.push((
                Value::from(name),
                Value::Map(vec![(Value::Array(vec![]), v)]),
            ));
        };
        let sizes = |xs: &[u64]| Value::Array(xs.iter().map(|&x| Value::from(x)).collect());
        if !self.load_sizes.is_empty() {
            put(
                LOAD_BYTES,
                "counter",
                Value::from(self.load_sizes.iter().sum::<u64>()),
            );
            put(LOAD_TIME, "counter", Value::from(self.load_seconds));
            put(LOAD_SIZE, "histogram", sizes(&self.load_sizes));
        }
        if !self.store_sizes.is_empty() {
            put(
                STORE_BYTES,
                "counter",
                Value::from(self.store_sizes.iter().sum::<u64>()),
            );
            put(STORE_SIZE, "histogram", sizes(&self.store_sizes));
        }
        if self.allocation_failures > 0 {
            put(
                ALLOCATION_FAILURE,
                "counter",
                Value::from(self.allocation_failures),
            );
        }
        (!data.is_empty()).then(|| {
            Value::Map(vec![
                (Value::from("types"), Value::Map(types)),
                (Value::from("data"), Value::Map(data)),
            ])
        })
    }
}

/// Keys in insertion order, with O(log n) move-to-end and removal.
#[derive(Debug, Default)]
struct Ordered {
    rank: FxMap<BlockHash, u64>,
    by_rank: BTreeMap<u64, BlockHash>,
    next: u64,
}

impl Ordered {
    fn contains(&self, k: &BlockHash) -> bool {
        self.rank.contains_key(k)
    }

    fn len(&self) -> usize {
        self.rank.len()
    }

    /// Append `k`, or move it to the end when present.
    fn push_back(&mut self, k: BlockHash) {
        self.remove(&k);
        self.next += 1;
        self.rank.insert(k, self.next);
        self.by_rank.insert(self.next, k);
    }

    fn remove(&mut self, k: &BlockHash) -> bool {
        match self.rank.remove(k) {
            Some(r) => {
                self.by_rank.remove(&r);
                true
            }
            None => false,
        }
    }

    fn pop_front(&mut self) -> Option<BlockHash> {
        let (_, k) = self.by_rank.pop_first()?;
        self.rank.remove(&k);
        Some(k)
    }

    /// Oldest first.
    fn iter(&self) -> impl Iterator<Item = &BlockHash> {
        self.by_rank.values()
    }

    fn clear(&mut self) {
        self.rank.clear();
        self.by_rank.clear();
    }
}

/// ARC's lists (vLLM's `ARCCachePolicy`).
#[derive(Debug, Default)]
struct ArcLists {
    t1: Ordered,
    t2: Ordered,
    b1: Ordered,
    b2: Ordered,
    target_t1: f64,
}

impl ArcLists {
    /// A ghost hit moves the T1 target (towards recency for B1, frequency for B2).
    fn adapt_to_ghost_hit(&mut self, k: &BlockHash, capacity: usize) {
        if self.b1.contains(k) {
            let delta = (self.b2.len() as f64 / self.b1.len() as f64).max(1.0);
            self.target_t1 = (self.target_t1 + delta).min(capacity as f64);
            self.b1.push_back(*k);
        } else if self.b2.contains(k) {
            let delta = (self.b1.len() as f64 / self.b2.len() as f64).max(1.0);
            self.target_t1 = (self.target_t1 - delta).max(0.0);
            self.b2.push_back(*k);
        }
    }

    /// `n` idle blocks to evict, none of `protected`, or `None` when there are fewer.
    fn evict(
        &mut self,
        n: usize,
        protected: &FxSet<BlockHash>,
        capacity: usize,
    ) -> Option<Vec<BlockHash>> {
        let mut virtual_t1 = self.t1.len();
        let target = self.target_t1 as usize; // vLLM: int(target_t1_size)
        let mut picked: Vec<(BlockHash, bool)> = Vec::with_capacity(n);
        let mut t1 = self.t1.iter().filter(|k| !protected.contains(*k));
        let mut t2 = self.t2.iter().filter(|k| !protected.contains(*k));
        for _ in 0..n {
            let mut c = None;
            if virtual_t1 >= target
                && let Some(k) = t1.next()
            {
                c = Some((*k, true));
                virtual_t1 -= 1;
            }
            if c.is_none() {
                c = t2.next().map(|k| (*k, false));
            }
            if c.is_none() {
                let k = t1.next()?;
                c = Some((*k, true));
                virtual_t1 = virtual_t1.saturating_sub(1);
            }
            picked.extend(c);
        }
        drop((t1, t2));
        let mut out = Vec::with_capacity(n);
        for (k, from_t1) in picked {
            if from_t1 {
                self.t1.remove(&k);
                self.b1.push_back(k);
            } else {
                self.t2.remove(&k);
                self.b2.push_back(k);
            }
            out.push(k);
        }
        for ghost in [&mut self.b1, &mut self.b2] {
            while ghost.len() > capacity {
                ghost.pop_front();
            }
        }
        Some(out)
    }
}

#[derive(Debug)]
enum Policy {
    Lru(Ordered),
    Arc(ArcLists),
}

/// What one request did with the tier until it finishes (vLLM's `_RequestCacheAccess`).
#[derive(Debug, Default)]
struct Access {
    /// Every block it stored or found, in its own block order.
    keys: Vec<BlockHash>,
    seen: FxSet<BlockHash>,
    inserted: FxSet<BlockHash>,
    reused: FxSet<BlockHash>,
    store_misses: FxSet<BlockHash>,
}

impl Access {
    fn see(&mut self, k: &BlockHash) {
        if self.seen.insert(*k) {
            self.keys.push(*k);
        }
    }
}

/// The offload tier of one engine.
#[derive(Debug)]
pub struct OffloadTier {
    cfg: OffloadConfig,
    policy: Policy,
    /// Request key → its accesses, until it finishes.
    access: FxMap<u64, Access>,
    record_events: bool,
    events: Vec<KvEvent>,
    stats: OffloadStats,
}

impl OffloadTier {
    pub fn new(cfg: OffloadConfig) -> Self {
        let policy = match cfg.policy {
            OffloadPolicy::Lru => Policy::Lru(Ordered::default()),
            OffloadPolicy::Arc => Policy::Arc(ArcLists::default()),
        };
        Self {
            cfg: OffloadConfig {
                blocks: cfg.blocks.max(1),
                ..cfg
            },
            policy,
            access: FxMap::default(),
            record_events: false,
            events: Vec::new(),
            stats: OffloadStats::default(),
        }
    }

    /// Start or stop recording the tier's KV events.
    pub fn set_record_events(&mut self, on: bool) {
        self.record_events = on;
        if !on {
            self.events.clear();
        }
    }

    /// Blocks the tier holds.
    pub fn len(&self) -> usize {
        match &self.policy {
            Policy::Lru(l) => l.len(),
            Policy::Arc(a) => a.t1.len() + a.t2.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn contains(&self, k: &BlockHash) -> bool {
        match &self.policy {
            Policy::Lru(l) => l.contains(k),
            Policy::Arc(a) => a.t1.contains(k) || a.t2.contains(k),
        }
    }

    /// How many of `hashes`, from the first, the tier holds (vLLM's maximal prefix
    /// lookup). `hashes` are the blocks after the device-cache hit.
    pub fn lookup(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.contains(h)).count()
    }

    /// A new request asked the tier for the `queried` tokens its device-cache hit did not
    /// cover and found `hit` of them (vLLM's `connector_prefix_cache_stats.record`).
    pub fn record_query(&mut self, queried: u64, hit: u64, preempted: bool) {
        let l = &mut self.stats.lookups;
        if preempted {
            l.preempted_requests += 1;
            l.preempted_queries += queried;
            l.preempted_hits += hit;
        } else {
            l.requests += 1;
            l.queries += queried;
            l.hits += hit;
        }
    }

    /// Load `hashes` (a [`OffloadTier::lookup`] hit) for request `req`; what the load
    /// costs its step.
    pub fn load(&mut self, req: u64, hashes: &[BlockHash]) -> Duration {
        let a = self.access.entry(req).or_default();
        for k in hashes {
            a.see(k);
            if !a.inserted.contains(k) {
                a.reused.insert(*k);
            }
        }
        let cost = self.cfg.load_per_block * hashes.len() as u32;
        if !hashes.is_empty() {
            self.stats.loaded_blocks += hashes.len() as u64;
            self.stats
                .load_sizes
                .push(hashes.len() as u64 * self.cfg.block_bytes);
            self.stats.load_seconds += cost.as_secs_f64();
        }
        cost
    }

    /// Offer request `req`'s newly full blocks `hashes` (vLLM's `prepare_store` followed by
    /// its completion).
    pub fn store(&mut self, req: u64, hashes: &[BlockHash]) {
        if hashes.is_empty() {
            return;
        }
        let capacity = self.cfg.blocks;
        let mut to_store: Vec<BlockHash> = Vec::new();
        let mut existing: Vec<BlockHash> = Vec::new();
        let mut fresh = FxSet::default();
        for k in hashes {
            if self.contains(k) {
                existing.push(*k);
            } else if fresh.insert(*k) {
                to_store.push(*k);
            }
        }
        let a = self.access.entry(req).or_default();
        let misses: Vec<BlockHash> = to_store
            .iter()
            .filter(|k| a.store_misses.insert(**k))
            .copied()
            .collect();
        if let Policy::Arc(arc) = &mut self.policy {
            // ARC learns from B1/B2 before insertion removes the ghost entry
            for k in misses.iter().rev() {
                arc.adapt_to_ghost_hit(k, capacity);
            }
        }
        for k in hashes {
            a.see(k);
        }
        for k in &existing {
            if !a.inserted.contains(k) {
                a.reused.insert(*k);
            }
        }
        if to_store.is_empty() {
            return;
        }
        let held = self.len();
        let n_evict = (held + to_store.len()).saturating_sub(capacity);
        if n_evict > 0 {
            let protected: FxSet<BlockHash> = hashes.iter().copied().collect();
            let evicted = if n_evict > held {
                None
            } else {
                match &mut self.policy {
                    Policy::Lru(l) => evict_lru(l, n_evict, &protected),
                    Policy::Arc(arc) => arc.evict(n_evict, &protected, capacity),
                }
            };
            let Some(evicted) = evicted else {
                self.stats.allocation_failures += 1;
                return;
            };
            self.stats.evicted_blocks += evicted.len() as u64;
            if self.record_events {
                self.events.push(KvEvent::BlockRemoved {
                    block_hashes: evicted.iter().map(hash_u64).collect(),
                    medium: Some(MEDIUM_CPU.to_string()),
                    group_idx: Some(0),
                });
            }
        }
        for k in &to_store {
            match &mut self.policy {
                Policy::Lru(l) => l.push_back(*k),
                Policy::Arc(arc) => {
                    arc.t1.push_back(*k);
                    arc.b1.remove(k);
                    arc.b2.remove(k);
                }
            }
        }
        if let Some(a) = self.access.get_mut(&req) {
            a.inserted.extend(to_store.iter().copied());
        }
        self.stats.stored_blocks += to_store.len() as u64;
        self.stats
            .store_sizes
            .push(to_store.len() as u64 * self.cfg.block_bytes);
        if self.record_events {
            self.events
                .extend(to_store.iter().map(|k| KvEvent::BlockStored {
                    block_hashes: vec![hash_u64(k)],
                    parent_block_hash: None,
                    token_ids: Vec::new(),
                    block_size: 0,
                    lora_id: None,
                    lora_name: None,
                    medium: Some(MEDIUM_CPU.to_string()),
                    extra_keys: None,
                    group_idx: Some(0),
                    session_id: None,
                }));
        }
    }

    /// Request `req` finished (or was aborted): its blocks' recency is set, in its block
    /// order (vLLM's `on_request_finished`).
    pub fn finish(&mut self, req: u64) {
        let Some(a) = self.access.remove(&req) else {
            return;
        };
        match &mut self.policy {
            Policy::Lru(l) => {
                // the request's first block becomes the most recent: its tail goes first
                for k in a.keys.iter().rev() {
                    if l.contains(k) {
                        l.push_back(*k);
                    }
                }
            }
            Policy::Arc(arc) => {
                for k in a.keys.iter().rev() {
                    let reused = a.reused.contains(k);
                    if a.inserted.contains(k) && !reused {
                        if arc.t1.contains(k) {
                            arc.t1.push_back(*k);
                        } else if arc.t2.contains(k) {
                            arc.t2.push_back(*k);
                        }
                    } else if reused && arc.t1.contains(k) {
                        arc.t1.remove(k);
                        arc.t2.push_back(*k);
                    } else if reused && arc.t2.contains(k) {
                        arc.t2.push_back(*k);
                    }
                }
            }
        }
    }

    /// Forget every block (vLLM's `reset_cache`: no event).
    pub fn reset(&mut self) {
        match &mut self.policy {
            Policy::Lru(l) => l.clear(),
            Policy::Arc(a) => *a = ArcLists::default(),
        }
        self.access.clear();
    }

    /// Events since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Counters since the last call.
    pub fn take_stats(&mut self) -> OffloadStats {
        std::mem::take(&mut self.stats)
    }
}

/// The `n` least recently used blocks not in `protected`, removed; `None` when fewer.
fn evict_lru(l: &mut Ordered, n: usize, protected: &FxSet<BlockHash>) -> Option<Vec<BlockHash>> {
    let out: Vec<BlockHash> = l
        .iter()
        .filter(|k| !protected.contains(*k))
        .take(n)
        .copied()
        .collect();
    if out.len() < n {
        return None;
    }
    for k in &out {
        l.remove(k);
    }
    Some(out)
}

#[cfg(test)]
mod tests;
