//! The step composer: which requests run in the next step and how many tokens each
//! computes, following vLLM's `Scheduler.schedule` (`vllm/v1/core/sched/scheduler.py`).
//! It is a method of [`Batch`], the only code besides the batch itself that moves requests
//! between the queues:
//!
//! 1. Running requests first, in admission order: each claims what it still has to compute
//!    (1 token for a decode, the rest of its prompt for a partial prefill), capped by
//!    `--long-prefill-token-threshold` (when more than one request is eligible) and by the
//!    remaining `--max-num-batched-tokens` budget. When the KV cache cannot grow, the most
//!    recently admitted running request is preempted (recompute: its blocks are freed and
//!    it goes back to the front of the queue), until the allocation fits or the request
//!    itself was preempted. Under the priority policy the victim is the lowest priority
//!    (highest value, latest arrival).
//! 2. Only if nothing was preempted: waiting requests in policy order while the budget
//!    lasts and the batch has room (`--max-num-seqs`). A request whose LoRA adapter would
//!    exceed `--max-loras` distinct adapters in the batch is skipped this step. New
//!    requests look up the prefix cache (at most `num_tokens - 1` tokens can hit, in whole
//!    blocks), then prefill the rest in chunks (chunked prefill on by default; without it a
//!    prompt must fit the budget whole). The head of the queue blocks the rest when the KV
//!    cache cannot take its whole sequence, not only the first chunk (vLLM's
//!    `scheduler_reserve_full_isl`, on by default in every line) (FCFS).

use std::collections::BTreeSet;
use std::ops::Bound::{Excluded, Unbounded};
use std::time::{Duration, Instant};

use sim_protocol::{EngineCoreEvent, EventType};
use sim_trace::latency::{DecodeSlot, PrefillChunk, StepShape};

use super::WaitKey;
use super::{Batch, Slot};
use crate::play::engine::block_hash::BlockHash;
use crate::play::engine::request::Phase;
use crate::play::engine::timer::instant_to_monotonic;

/// The scheduler settings a step is composed under (vLLM's `SchedulerConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComposeRules {
    pub max_num_seqs: usize,
    /// Token budget of one step.
    pub max_num_batched_tokens: u64,
    /// Cap on one prefill chunk when several requests compete (0 = none).
    pub long_prefill_token_threshold: u64,
    pub enable_chunked_prefill: bool,
    pub enable_prefix_caching: bool,
    /// Distinct LoRA adapters allowed in the running batch (0 = no cap).
    pub max_loras: usize,
    /// Preempt the lowest-priority request rather than the newest (priority policy).
    pub priority_preemption: bool,
}

/// One planned step.
#[derive(Debug, Clone)]
pub struct StepPlan {
    /// `(request, tokens computed in this step)`.
    pub scheduled: Vec<(Slot, u64)>,
    pub shape: StepShape,
    /// Loading the blocks this step's new requests found in the offload tier: added to
    /// the step's duration.
    pub load_time: Duration,
}

impl Batch {
    /// Give `id` room for `n` more computed tokens (vLLM's `allocate_slots` for a running
    /// request); registers the blocks that become full in the prefix cache.
    fn allocate_running(&mut self, slot: Slot, n: u64, prefix_caching: bool) -> bool {
        let Some(r) = self.requests.get(slot) else {
            return false;
        };
        let need = self
            .blocks_for(r.num_computed + n)
            .saturating_sub(r.blocks.len());
        if need > 0 {
            let Some(new) = self.pool.allocate(need) else {
                return false;
            };
            if let Some(r) = self.requests.get_mut(slot) {
                r.blocks.extend(new);
            }
        }
        self.cache_full_blocks(slot, n, prefix_caching);
        true
    }

    /// Register the full blocks covered once `n` more tokens are computed.
    fn cache_full_blocks(&mut self, slot: Slot, n: u64, prefix_caching: bool) {
        if !prefix_caching {
            return;
        }
        let bs = self.block_size as usize;
        let none = self.none_hash;
        let Some(r) = self.requests.get_mut(slot) else {
            return;
        };
        let full = (((r.num_computed + n) as usize) / bs).min(r.blocks.len());
        if full <= r.cached_blocks {
            return;
        }
        r.hash_blocks(full, bs, &none);
        let full = full.min(r.block_hashes.len());
        if full <= r.cached_blocks {
            return;
        }
        let from = r.cached_blocks;
        let parent = from.checked_sub(1).map(|i| r.block_hashes[i]);
        r.cached_blocks = full;
        // the request and the pool are separate fields: the slices are lent, not copied
        self.pool.cache(
            &r.blocks[from..full],
            &r.block_hashes[from..full],
            parent,
            &r.tokens[from * bs..full * bs],
            r.lora_id.zip(r.lora_name.as_deref()),
        );
        // vLLM's offloading connector offers each newly full block to its tier too
        if let Some(t) = &mut self.offload {
            t.store(r.key, &r.block_hashes[from..full]);
        }
    }

    /// Index in `running` of the request to preempt: the newest, or under the priority
    /// policy the lowest priority (largest value), latest arrival.
    fn victim_index(&self, priority_preemption: bool) -> Option<usize> {
        if priority_preemption {
            self.running
                .iter()
                .enumerate()
                .filter_map(|(i, s)| self.requests.get(*s).map(|r| (i, (r.priority, r.seq))))
                .max_by_key(|(_, k)| *k)
                .map(|(i, _)| i)
        } else {
            self.running.len().checked_sub(1)
        }
    }

    /// Compose the next step under `rules`, admitting waiting requests in the queue
    /// policy's order;
    /// `None` when nothing can run.
    pub fn compose(&mut self, rules: &ComposeRules, now: Instant) -> Option<StepPlan> {
        let mut budget = rules.max_num_batched_tokens;
        let eligible = self.running.len() + self.waiting.len();
        let threshold = if eligible > 1 {
            rules.long_prefill_token_threshold
        } else {
            0
        };
        let mut scheduled: Vec<(Slot, u64)> = Vec::with_capacity(self.running.len());
        let mut shape = StepShape {
            max_num_seqs: rules.max_num_seqs as u64,
            max_num_batched_tokens: rules.max_num_batched_tokens,
            ..Default::default()
        };
        let mut preempted_any = false;
        let mut load_time = Duration::ZERO;

        // 1. running requests
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(r) = self.requests.get(id) else {
                self.running.remove(i);
                continue;
            };
            let total = r.tokens.len() as u64;
            let mut n = total.saturating_sub(r.num_computed);
            if threshold > 0 && n > threshold {
                n = threshold;
            }
            n = n.min(budget);
            if n == 0 {
                i += 1;
                continue;
            }
            let mut self_preempted = false;
            while !self.allocate_running(id, n, rules.enable_prefix_caching) {
                let Some(v) = self.victim_index(rules.priority_preemption) else {
                    break;
                };
                let victim = self.running[v];
                preempted_any = true;
                // a victim already scheduled this step gives its budget back
                if let Some(pos) = scheduled.iter().position(|(s, _)| *s == victim) {
                    budget += scheduled.remove(pos).1;
                }
                self.preempt(victim, now);
                if v < i {
                    i -= 1; // priority policy: a victim before us shifts us left
                }
                if victim == id {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted {
                continue; // position `i` now holds the next request
            }
            budget -= n;
            scheduled.push((id, n));
            i += 1;
        }

        // 2. waiting requests, only when nothing was preempted (as vLLM) and there is room
        let room = budget > 0 && self.running.len() < rules.max_num_seqs;
        if !preempted_any && room && !self.waiting.is_empty() {
            let mut loras: BTreeSet<i64> = self
                .running
                .iter()
                .filter_map(|s| self.requests.get(*s)?.lora_id)
                .collect();
            // the queue is kept in policy order: walk it from the head, so a step costs
            // what it admits, not the length of the queue
            let mut admitted: Vec<WaitKey> = Vec::new();
            let mut skipped = 0usize;
            let mut cursor: Option<WaitKey> = None;
            loop {
                let next = match cursor {
                    None => self.waiting.iter().next(),
                    Some(k) => self.waiting.range((Excluded(k), Unbounded)).next(),
                };
                let Some((key, id)) = next.map(|(k, id)| (*k, *id)) else {
                    break;
                };
                cursor = Some(key);
                if self.requests.get(id).is_some_and(|r| r.held) {
                    continue; // held back by a pause
                }
                if budget == 0 || self.running.len() >= rules.max_num_seqs {
                    break;
                }
                let Some(r) = self.requests.get(id) else {
                    continue;
                };
                if r.not_before.is_some_and(|t| t > now) {
                    continue; // --ttft-mode fixed: its first token is not due yet
                }
                if r.awaiting_kv {
                    // WAITING_FOR_REMOTE_KVS: counted as deferred, not scheduled
                    skipped += 1;
                    continue;
                }
                if let Some(l) = r.lora_id
                    && rules.max_loras > 0
                    && !loras.contains(&l)
                    && loras.len() >= rules.max_loras
                {
                    // deferred, not short of capacity: vLLM's `skipped_waiting`
                    skipped += 1;
                    continue;
                }
                let total = r.tokens.len() as u64;
                let first_admission = r.num_computed == 0;
                let remote = first_admission && r.remote_prefill && !r.started;
                // the offload tier is asked what a new, locally computed prompt's device
                // hit leaves (vLLM's offloading connector)
                let asks_tier = self.offload.is_some()
                    && first_admission
                    && rules.enable_prefix_caching
                    && !remote;
                let bs = self.block_size as usize;
                // prefix-cache lookup: whole blocks, leaving at least one token to compute
                let mut hits: Vec<usize> = Vec::new();
                if first_admission && rules.enable_prefix_caching {
                    let max_blocks = (total.saturating_sub(1) as usize) / bs;
                    let none = self.none_hash;
                    if let Some(r) = self.requests.get_mut(id) {
                        r.hash_blocks(max_blocks, bs, &none);
                        let probe = &r.block_hashes[..max_blocks.min(r.block_hashes.len())];
                        hits = self.pool.lookup(probe);
                    }
                }
                // the offload tier: the run of blocks after the device hit found there is
                // loaded (vLLM's offloading connector's `get_num_new_matched_tokens`); every
                // full block of the prompt can hit, the last one too
                let mut from_tier: Vec<BlockHash> = Vec::new();
                if asks_tier
                    && let Some(t) = &self.offload
                    && let Some(r) = self.requests.get_mut(id)
                {
                    let max_blocks = total as usize / bs;
                    r.hash_blocks(max_blocks, bs, &self.none_hash);
                    let probe = &r.block_hashes[hits.len()..max_blocks.min(r.block_hashes.len())];
                    from_tier = probe[..t.lookup(probe)].to_vec();
                }
                let tier_tokens = (from_tier.len() * bs) as u64;
                let mut computed = (hits.len() * bs) as u64 + tier_tokens;
                // a whole prompt loaded: its last token is computed again to sample the next
                // (vLLM, once the load is done); it still counts as cached
                let tier_whole = u64::from(tier_tokens > 0 && computed >= total);
                computed -= tier_whole;
                // P/D decode side: the rest of the prompt (all but the last token, which is
                // computed to sample) is pulled from the prefill engine, like the
                // NixlConnector's `get_num_new_matched_tokens`
                let external = if remote {
                    total.saturating_sub(1).saturating_sub(computed)
                } else {
                    0
                };
                computed += external;
                let mut n = total - computed;
                if threshold > 0 && n > threshold {
                    n = threshold;
                }
                if !rules.enable_chunked_prefill && n > budget {
                    break;
                }
                n = n.min(budget);
                let need = self.blocks_for(computed + n).saturating_sub(hits.len());
                // (external tokens need blocks too: they are included in `computed`)
                let evictable = self.pool.num_evictable(&hits);
                // vLLM's admission gate (`scheduler_reserve_full_isl`, on by default in
                // every line): the whole sequence must fit, not only its first chunk, so a
                // chunked prefill is never admitted into a cache it would then thrash
                let need_full = self.blocks_for(total).saturating_sub(hits.len());
                if need.max(need_full) + evictable > self.pool.num_free() {
                    break; // the KV cache cannot take the head of the queue
                }
                self.pool.touch(&hits);
                let Some(new) = self.pool.allocate(need) else {
                    self.pool.free(hits.into_iter().rev());
                    break;
                };
                let preempted_before;
                {
                    let Some(r) = self.requests.get_mut(id) else {
                        continue;
                    };
                    preempted_before = r.num_preemptions > 0;
                    r.blocks = hits.clone();
                    r.blocks.extend(new);
                    r.cached_blocks = hits.len();
                    r.num_computed = computed;
                    if !preempted_before && !r.started {
                        // a pulled prompt counts whole as external (vLLM's connector
                        // matches every prompt token, then recomputes the last one)
                        let whole = u64::from(remote && external > 0);
                        r.cached_tokens = computed + whole + tier_whole;
                        r.external_cached_tokens = external + whole + tier_tokens;
                    }
                    r.phase = Phase::Running;
                    r.pending_events.push(EngineCoreEvent {
                        kind: EventType::Scheduled,
                        timestamp: instant_to_monotonic(now),
                    });
                    if let Some(l) = r.lora_id {
                        loras.insert(l);
                    }
                }
                if asks_tier && let Some(t) = &mut self.offload {
                    // the connector is asked for what the device cache did not hold
                    let key = self.requests.get(id).map_or(0, |r| r.key);
                    let queried = total - (hits.len() * bs) as u64;
                    t.record_query(queried, tier_tokens, preempted_before);
                    load_time += t.load(key, &from_tier);
                }
                if first_admission {
                    // the device cache's own hits (the tier's are the connector's)
                    let computed = computed + tier_whole - tier_tokens;
                    let d = &mut self.prefix_delta;
                    if preempted_before {
                        d.preempted_requests += 1;
                        d.preempted_queries += total;
                        d.preempted_hits += computed;
                    } else {
                        d.requests += 1;
                        d.queries += total;
                        d.hits += computed;
                    }
                }
                // without a load, vLLM's store index stays at the request's first block:
                // its device hits are offered to the tier with what it computes (a hit the
                // tier lost is stored again); a load skips every hit block
                if from_tier.is_empty()
                    && !hits.is_empty()
                    && let Some(t) = &mut self.offload
                    && let Some(r) = self.requests.get(id)
                {
                    t.store(r.key, &r.block_hashes[..hits.len()]);
                }
                self.cache_full_blocks(id, n, rules.enable_prefix_caching);
                if external > 0 {
                    shape.kv_transfers.push(external);
                }
                self.running.push(id);
                admitted.push(key);
                budget -= n;
                scheduled.push((id, n));
                self.dirty = true;
            }
            for key in &admitted {
                self.waiting.remove(key);
            }
            if self.skipped_waiting != skipped {
                self.skipped_waiting = skipped;
                self.dirty = true;
            }
        } else if self.skipped_waiting != 0 {
            // nothing was considered this step: whoever waits, waits for capacity
            self.skipped_waiting = 0;
            self.dirty = true;
        }

        if scheduled.is_empty() {
            return None;
        }
        for (id, n) in &scheduled {
            let Some(r) = self.requests.get(*id) else {
                continue;
            };
            let decode = r.num_computed + 1 >= r.tokens.len() as u64 && *n == 1 && r.started;
            if decode {
                shape.decodes.push(DecodeSlot {
                    context: r.num_computed,
                    request_key: r.key,
                });
            } else {
                shape.prefills.push(PrefillChunk {
                    tokens: *n,
                    context: r.num_computed,
                    // the TTFT knob prices a whole cold prompt: cached and pulled tokens
                    // make a request's share smaller
                    uncached_prompt: (r.tokens.len() as u64).max(*n),
                });
            }
        }
        shape.running = self.running.len() as u64;
        shape.waiting = self.waiting.len() as u64;
        Some(StepPlan {
            scheduled,
            shape,
            load_time,
        })
    }
}
