//! The batch: every request inside one engine, its queues and its KV blocks.
//!
//! [`Batch`] owns the request table, the waiting queue, the running batch, the KV block
//! pool and the prefix-cache counters, and its methods keep them consistent: a request is
//! in exactly one of `waiting` / `running` (as its `phase` says), holds blocks only while
//! it runs, and leaves the table together with its blocks. Phase changes (admission,
//! preemption, removal) happen only here; the step composer (`compose.rs`, vLLM's
//! scheduler rules) is a method of the batch. The engine (`sim.rs`) asks the batch for a
//! step plan, advances the requests the step computed, and reads the gauges for stats.

mod compose;
mod table;

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use sim_protocol::kv_events::KvEvent;
use sim_protocol::{EngineCoreEvent, EventType, PrefixCacheStats};

use super::block_hash::{BlockHash, default_none_hash};
use super::kv_cache::{BlockPool, PoolEvent};
use super::offload::{OffloadStats, OffloadTier};
use super::queue_policy::{QueuePolicy, WaitingKey};
use super::request::{Phase, SimRequest};
use super::timer::instant_to_monotonic;

pub use compose::{ComposeRules, StepPlan};
use table::RequestTable;
pub use table::Slot;

/// The scheduler gauges of a moment, for `SchedulerStats`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Gauges {
    pub running: u64,
    /// Waiting for capacity.
    pub waiting: u64,
    /// Waiting, but deferred for another reason (no LoRA slot).
    pub skipped_waiting: u64,
    pub kv_cache_usage: f64,
    /// LoRA adapter → running / waiting requests (empty when no request names one).
    pub running_lora: Vec<(String, u64)>,
    pub waiting_lora: Vec<(String, u64)>,
}

/// Every request of one engine and the KV cache they share.
pub struct Batch {
    requests: RequestTable,
    /// Waiting request ids by admission order: the queue policy's key of each (unique:
    /// every key ends in the request's `seq`), so a step reads the head of the queue
    /// without looking at the rest.
    waiting: BTreeMap<WaitKey, Slot>,
    policy: Box<dyn QueuePolicy>,
    /// Running requests, in admission order.
    running: Vec<Slot>,
    /// Waiting requests the last step skipped for lack of a LoRA slot (vLLM reports them
    /// apart from those waiting for capacity).
    skipped_waiting: usize,
    /// Requests that name a LoRA adapter: the per-step adapter maps are only built when
    /// there are any.
    lora_requests: usize,
    pool: BlockPool,
    none_hash: BlockHash,
    block_size: u64,
    /// Admission order of the next arrival.
    next_seq: i64,
    /// Admission order of the next preempted request (negative: ahead of every arrival).
    next_preempt_seq: i64,
    /// Prefix-cache counters since the last stats.
    prefix_delta: PrefixCacheStats,
    /// The gauges changed since the last stats.
    dirty: bool,
    log_requests: bool,
    /// Blocks of finished prefill-instance requests (P/D), kept for the decode instance
    /// to read: request id → (block ids, when they are freed unread).
    held: HashMap<String, (Vec<usize>, Instant)>,
    /// The KV offload tier behind the pool (`--kv-offload-blocks`), if any.
    offload: Option<OffloadTier>,
}

/// A waiting request's place in the queue ([`QueuePolicy::sort_key`]).
pub(crate) type WaitKey = (i64, i64, i64);

impl Batch {
    /// The parent hash of every prompt's first block (vLLM's `NONE_HASH`).
    pub fn block_hash_root(&self) -> BlockHash {
        self.none_hash
    }

    pub fn new(
        num_gpu_blocks: u64,
        block_size: u64,
        log_requests: bool,
        policy: Box<dyn QueuePolicy>,
    ) -> Self {
        Self {
            requests: RequestTable::default(),
            waiting: BTreeMap::new(),
            policy,
            running: Vec::new(),
            skipped_waiting: 0,
            lora_requests: 0,
            pool: BlockPool::new(num_gpu_blocks as usize, false),
            none_hash: default_none_hash(),
            block_size: block_size.max(1),
            next_seq: 0,
            next_preempt_seq: -1,
            prefix_delta: PrefixCacheStats::default(),
            dirty: false,
            log_requests,
            held: HashMap::new(),
            offload: None,
        }
    }

    /// Put an offload tier behind the prefix cache.
    pub fn set_offload(&mut self, tier: OffloadTier) {
        self.offload = Some(tier);
    }

    /// The offload tier's KV events since the last call (medium `CPU`); vLLM publishes
    /// them after the pool's events of the same step.
    pub fn take_offload_events(&mut self) -> Vec<KvEvent> {
        self.offload
            .as_mut()
            .map(OffloadTier::take_events)
            .unwrap_or_default()
    }

    /// The offload tier's counters since the last call; `None` without a tier.
    pub fn take_offload_stats(&mut self) -> Option<OffloadStats> {
        self.offload.as_mut().map(OffloadTier::take_stats)
    }

    /// Record the pool's cache events (for the KV-events publisher).
    pub fn record_kv_events(&mut self, on: bool) {
        self.pool.set_record_events(on);
    }

    /// Record the offload tier's events (for the KV-events publisher; the offline
    /// router follows the device cache only).
    pub fn record_offload_events(&mut self, on: bool) {
        if let Some(t) = &mut self.offload {
            t.set_record_events(on);
        }
    }

    /// The pool's cache events since the last call.
    pub fn take_kv_events(&mut self) -> Vec<PoolEvent> {
        self.pool.take_events()
    }

    pub fn contains(&self, id: &str) -> bool {
        self.requests.contains(id)
    }

    pub fn get(&self, id: &str) -> Option<&SimRequest> {
        self.requests.by_id(id)
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// The queue policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Put `r` (phase already Waiting, `seq` set) in the waiting queue at its policy place.
    fn enqueue(&mut self, slot: Slot) {
        let Some(r) = self.requests.get_mut(slot) else {
            return;
        };
        let key = self.policy.sort_key(&WaitingKey {
            seq: r.seq,
            priority: r.priority,
            prompt_len: r.prompt_len,
        });
        r.wait_key = key;
        self.waiting.insert(key, slot);
    }

    /// Requests not held back by a pause.
    pub fn num_unheld(&self) -> usize {
        self.requests.values().filter(|r| !r.held).count()
    }

    /// Every request, in no particular order.
    pub fn requests(&self) -> impl Iterator<Item = &SimRequest> {
        self.requests.values()
    }

    /// Queue a new request (its QUEUED event is stamped `now`).
    pub fn insert(&mut self, mut r: SimRequest, now: Instant) {
        r.seq = self.next_seq;
        self.next_seq += 1;
        r.phase = Phase::Waiting;
        r.pending_events.push(EngineCoreEvent {
            kind: EventType::Queued,
            timestamp: instant_to_monotonic(now),
        });
        if r.lora_name.is_some() {
            self.lora_requests += 1;
        }
        let slot = self.requests.insert(r);
        self.enqueue(slot);
        self.dirty = true;
    }

    /// Take a request out with its blocks (finished or aborted).
    pub fn remove(&mut self, id: &str) -> Option<SimRequest> {
        let slot = self.requests.slot(id)?;
        self.remove_slot(slot)
    }

    /// Take the request at `slot` out with its blocks.
    fn remove_slot(&mut self, slot: Slot) -> Option<SimRequest> {
        self.free_blocks(slot);
        let r = self.requests.remove(slot)?;
        if let Some(t) = &mut self.offload {
            t.finish(r.key);
        }
        if r.lora_name.is_some() {
            self.lora_requests -= 1;
        }
        match r.phase {
            Phase::Waiting => {
                self.waiting.remove(&r.wait_key);
            }
            Phase::Running => self.running.retain(|w| *w != slot),
        }
        self.dirty = true;
        Some(r)
    }

    /// The earliest moment a waiting request held back by `not_before` becomes due.
    pub fn next_not_before(&self) -> Option<Instant> {
        self.waiting
            .values()
            .filter_map(|s| self.requests.get(*s)?.not_before)
            .min()
    }

    /// A request, to change what the composer reads of it (P/D pull state).
    pub fn get_mut(&mut self, id: &str) -> Option<&mut SimRequest> {
        self.dirty = true;
        self.requests.by_id_mut(id)
    }

    /// Take a finished request out but keep its blocks allocated until
    /// [`Batch::release_held`] (the decode instance read them) or `until` passes
    /// ([`Batch::expire_held`]): a P/D prefill instance's `delay_free_blocks`. Returns the
    /// request and its block ids.
    pub fn remove_keeping_blocks(
        &mut self,
        id: &str,
        until: Instant,
    ) -> Option<(SimRequest, Vec<usize>)> {
        let blocks = std::mem::take(&mut self.requests.by_id_mut(id)?.blocks);
        let r = self.remove(id)?;
        self.held.insert(id.to_string(), (blocks.clone(), until));
        Some((r, blocks))
    }

    /// The blocks a finished request still holds for a reader.
    pub fn held_blocks(&self, id: &str) -> Option<&[usize]> {
        self.held.get(id).map(|(b, _)| b.as_slice())
    }

    /// Free the blocks kept for `id` (the reader is done); how many there were.
    pub fn release_held(&mut self, id: &str) -> Option<usize> {
        let (blocks, _) = self.held.remove(id)?;
        let n = blocks.len();
        self.pool.free(blocks.into_iter().rev());
        self.dirty = true;
        Some(n)
    }

    /// Free kept blocks whose reader did not come by `now`; their request ids.
    pub fn expire_held(&mut self, now: Instant) -> Vec<String> {
        let mut gone: Vec<String> = self
            .held
            .iter()
            .filter(|(_, (_, until))| *until <= now)
            .map(|(id, _)| id.clone())
            .collect();
        gone.sort();
        for id in &gone {
            self.release_held(id);
        }
        gone
    }

    /// When the next kept blocks expire.
    pub fn next_held_expiry(&self) -> Option<Instant> {
        self.held.values().map(|(_, until)| *until).min()
    }

    /// Requests whose blocks are kept for a reader.
    pub fn num_held(&self) -> usize {
        self.held.len()
    }

    /// Take every request out, sorted by id.
    pub fn drain(&mut self) -> Vec<SimRequest> {
        let mut ids: Vec<sim_protocol::RequestId> = self.requests.ids().cloned().collect();
        ids.sort();
        ids.iter().filter_map(|id| self.remove(id)).collect()
    }

    /// Release every request held back by a pause.
    pub fn unhold_all(&mut self) {
        for r in self.requests.values_mut() {
            r.held = false;
        }
    }

    /// A step computed `n` tokens of request `id`: returns the request when it is still
    /// running and its whole prompt (and output so far) is now computed, i.e. it samples
    /// a token in this step. `None` for a partial prefill, or a request that was aborted
    /// or preempted while the step ran.
    pub fn advance(&mut self, slot: Slot, n: u64) -> Option<&mut SimRequest> {
        let r = self.requests.get_mut(slot)?;
        if r.phase != Phase::Running {
            return None;
        }
        r.num_computed += n;
        if r.num_computed < r.tokens.len() as u64 {
            return None;
        }
        Some(r)
    }

    /// Preempt a running request (vLLM's `_preempt_request`, recompute mode): its blocks
    /// are freed and it goes back to the front of the queue.
    pub fn preempt(&mut self, slot: Slot, now: Instant) {
        self.free_blocks(slot);
        self.running.retain(|r| *r != slot);
        let seq = self.next_preempt_seq;
        self.next_preempt_seq -= 1;
        if let Some(r) = self.requests.get_mut(slot) {
            r.phase = Phase::Waiting;
            r.num_computed = 0;
            r.seq = seq;
            r.num_preemptions += 1;
            r.pending_events.push(EngineCoreEvent {
                kind: EventType::Preempted,
                timestamp: instant_to_monotonic(now),
            });
            if self.log_requests {
                tracing::info!(request_id = %r.id, "request preempted (KV cache full)");
            }
        }
        self.enqueue(slot);
        self.dirty = true;
    }

    /// Preempt every running request, newest first (vLLM's `reset_prefix_cache` with
    /// `reset_running_requests`).
    pub fn preempt_all_running(&mut self, now: Instant) {
        while let Some(slot) = self.running.last().copied() {
            self.preempt(slot, now);
        }
    }

    /// Clear the prefix cache (only possible while no block is in use); the next stats
    /// carry `prefix_cache_stats.reset`.
    pub fn reset_prefix_cache(&mut self) -> bool {
        let done = self.pool.reset();
        if done {
            self.prefix_delta.reset = true;
            self.dirty = true;
        }
        done
    }

    /// The gauges changed since the last [`Batch::take_stats`].
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// The gauges now and the prefix-cache counters since the last call.
    pub fn take_stats(&mut self) -> (Gauges, PrefixCacheStats) {
        self.dirty = false;
        let skipped = self.skipped_waiting.min(self.waiting.len());
        let mut running_lora: BTreeMap<String, u64> = BTreeMap::new();
        let mut waiting_lora: BTreeMap<String, u64> = BTreeMap::new();
        if self.lora_requests > 0 {
            for r in self.requests.values() {
                if let Some(name) = &r.lora_name {
                    let map = match r.phase {
                        Phase::Running => &mut running_lora,
                        Phase::Waiting => &mut waiting_lora,
                    };
                    *map.entry(name.clone()).or_default() += 1;
                }
            }
        }
        let gauges = Gauges {
            running: self.running.len() as u64,
            waiting: (self.waiting.len() - skipped) as u64,
            skipped_waiting: skipped as u64,
            kv_cache_usage: self.pool.usage(),
            running_lora: running_lora.into_iter().collect(),
            waiting_lora: waiting_lora.into_iter().collect(),
        };
        (gauges, std::mem::take(&mut self.prefix_delta))
    }

    /// Blocks a request needs to hold `tokens` tokens.
    fn blocks_for(&self, tokens: u64) -> usize {
        tokens.div_ceil(self.block_size) as usize
    }

    /// Release a request's KV blocks (its tail blocks become the first to evict).
    fn free_blocks(&mut self, slot: Slot) {
        if let Some(r) = self.requests.get_mut(slot) {
            let blocks = std::mem::take(&mut r.blocks);
            r.cached_blocks = 0;
            self.pool.free(blocks.into_iter().rev());
        }
    }
}

#[cfg(test)]
mod tests;
