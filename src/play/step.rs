//! The step composer: which requests run in the next step and how many tokens each
//! computes, following vLLM's `Scheduler.schedule` (`vllm/v1/core/sched/scheduler.py`):
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
//!    cache cannot take it (FCFS).

use std::collections::{BTreeSet, HashSet};
use std::time::Instant;

use sim_protocol::{EngineCoreEvent, EventType};
use sim_trace::latency::{PrefillChunk, StepShape};

use super::request::Phase;
use super::scheduler::WaitingKey;
use super::sim::SimEngine;
use super::timer::instant_to_monotonic;

/// One planned step.
#[derive(Debug, Clone)]
pub struct StepPlan {
    /// `(request id, tokens computed in this step)`.
    pub scheduled: Vec<(String, u64)>,
    pub shape: StepShape,
}

impl SimEngine {
    /// Blocks a request needs to hold `tokens` tokens.
    fn blocks_for(&self, tokens: u64) -> usize {
        tokens.div_ceil(self.cfg.block_size.max(1)) as usize
    }

    /// Give `id` room for `n` more computed tokens (vLLM's `allocate_slots` for a running
    /// request); registers the blocks that become full in the prefix cache.
    fn allocate_running(&mut self, id: &str, n: u64) -> bool {
        let Some(r) = self.requests.get(id) else {
            return false;
        };
        let need = self
            .blocks_for(r.num_computed + n)
            .saturating_sub(r.blocks.len());
        if need > 0 {
            let Some(new) = self.pool.allocate(need) else {
                return false;
            };
            if let Some(r) = self.requests.get_mut(id) {
                r.blocks.extend(new);
            }
        }
        self.cache_full_blocks(id, n);
        true
    }

    /// Register the full blocks covered once `n` more tokens are computed.
    fn cache_full_blocks(&mut self, id: &str, n: u64) {
        if !self.cfg.enable_prefix_caching {
            return;
        }
        let bs = self.cfg.block_size as usize;
        let none = self.none_hash;
        let Some(r) = self.requests.get_mut(id) else {
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
        let blocks = r.blocks[from..full].to_vec();
        let hashes = r.block_hashes[from..full].to_vec();
        let tokens = r.tokens[from * bs..full * bs].to_vec();
        let lora = r.lora_id.zip(r.lora_name.clone());
        r.cached_blocks = full;
        self.pool.cache(&blocks, &hashes, parent, &tokens, lora);
    }

    /// Release a request's KV blocks (its tail blocks become the first to evict).
    pub(super) fn free_blocks(&mut self, id: &str) {
        if let Some(r) = self.requests.get_mut(id) {
            let blocks = std::mem::take(&mut r.blocks);
            r.cached_blocks = 0;
            self.pool.free(blocks.into_iter().rev());
        }
    }

    /// Preempt a running request (vLLM's `_preempt_request`, recompute mode).
    pub(super) fn preempt(&mut self, id: &str, now: Instant) {
        self.free_blocks(id);
        self.running.retain(|r| r != id);
        let seq = self.next_preempt_seq;
        self.next_preempt_seq -= 1;
        if let Some(r) = self.requests.get_mut(id) {
            r.phase = Phase::Waiting;
            r.num_computed = 0;
            r.seq = seq;
            r.num_preemptions += 1;
            r.pending_events.push(EngineCoreEvent {
                kind: EventType::Preempted,
                timestamp: instant_to_monotonic(now),
            });
            if self.cfg.log_requests {
                tracing::info!(request_id = %id, "request preempted (KV cache full)");
            }
        }
        self.waiting.push(id.to_string());
        self.stats_dirty = true;
    }

    /// Index in `running` of the request to preempt: the newest, or under the priority
    /// policy the lowest priority (largest value), latest arrival.
    fn victim_index(&self) -> Option<usize> {
        if self.cfg.priority_preemption {
            self.running
                .iter()
                .enumerate()
                .filter_map(|(i, id)| self.requests.get(id).map(|r| (i, (r.priority, r.seq))))
                .max_by_key(|(_, k)| *k)
                .map(|(i, _)| i)
        } else {
            self.running.len().checked_sub(1)
        }
    }

    /// Plan the next step; `None` when nothing can run.
    pub(super) fn schedule(&mut self, now: Instant) -> Option<StepPlan> {
        if !self.util.scheduling_enabled() {
            return None;
        }
        let mut budget = self.cfg.max_num_batched_tokens;
        let eligible = self.running.len() + self.waiting.len();
        let threshold = if eligible > 1 {
            self.cfg.long_prefill_token_threshold
        } else {
            0
        };
        let mut scheduled: Vec<(String, u64)> = Vec::new();
        let mut shape = StepShape {
            max_num_seqs: self.cfg.max_num_seqs as u64,
            ..Default::default()
        };
        let mut preempted_any = false;

        // 1. running requests
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i].clone();
            let Some(r) = self.requests.get(&id) else {
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
            while !self.allocate_running(&id, n) {
                let Some(v) = self.victim_index() else {
                    break;
                };
                let victim = self.running[v].clone();
                preempted_any = true;
                // a victim already scheduled this step gives its budget back
                if let Some(pos) = scheduled.iter().position(|(s, _)| *s == victim) {
                    budget += scheduled.remove(pos).1;
                }
                self.preempt(&victim, now);
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
        let room = budget > 0 && self.running.len() < self.cfg.max_num_seqs;
        if !preempted_any && room && !self.waiting.is_empty() {
            let mut loras: BTreeSet<i64> = self
                .running
                .iter()
                .filter_map(|id| self.requests.get(id)?.lora_id)
                .collect();
            let mut candidates: Vec<((i64, i64, i64), String)> = self
                .waiting
                .iter()
                .filter_map(|id| {
                    let r = self.requests.get(id)?;
                    let key = WaitingKey {
                        seq: r.seq,
                        priority: r.priority,
                        prompt_len: r.prompt_len,
                    };
                    (!r.held).then(|| (self.scheduler.sort_key(&key), id.clone()))
                })
                .collect();
            candidates.sort();
            let mut admitted: HashSet<String> = HashSet::new();
            let mut skipped = 0usize;
            for (_, id) in candidates {
                if budget == 0 || self.running.len() >= self.cfg.max_num_seqs {
                    break;
                }
                let Some(r) = self.requests.get(&id) else {
                    continue;
                };
                if let Some(l) = r.lora_id
                    && self.cfg.max_loras > 0
                    && !loras.contains(&l)
                    && loras.len() >= self.cfg.max_loras
                {
                    // deferred, not short of capacity: vLLM's `skipped_waiting`
                    skipped += 1;
                    continue;
                }
                let total = r.tokens.len() as u64;
                let first_admission = r.num_computed == 0;
                let remote = first_admission && r.remote_prefill && !r.started;
                let bs = self.cfg.block_size as usize;
                // prefix-cache lookup: whole blocks, leaving at least one token to compute
                let mut hits: Vec<usize> = Vec::new();
                if first_admission && self.cfg.enable_prefix_caching {
                    let max_blocks = (total.saturating_sub(1) as usize) / bs;
                    let none = self.none_hash;
                    if let Some(r) = self.requests.get_mut(&id) {
                        r.hash_blocks(max_blocks, bs, &none);
                        let probe = &r.block_hashes[..max_blocks.min(r.block_hashes.len())];
                        hits = self.pool.lookup(probe);
                    }
                }
                let mut computed = (hits.len() * bs) as u64;
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
                if !self.cfg.enable_chunked_prefill && n > budget {
                    break;
                }
                n = n.min(budget);
                let need = self.blocks_for(computed + n).saturating_sub(hits.len());
                // (external tokens need blocks too: they are included in `computed`)
                let evictable = self.pool.num_evictable(&hits);
                if need + evictable > self.pool.num_free() {
                    break; // the KV cache cannot take the head of the queue
                }
                self.pool.touch(&hits);
                let Some(new) = self.pool.allocate(need) else {
                    self.pool.free(hits.into_iter().rev());
                    break;
                };
                let preempted_before;
                {
                    let Some(r) = self.requests.get_mut(&id) else {
                        continue;
                    };
                    preempted_before = r.num_preemptions > 0;
                    r.blocks = hits.clone();
                    r.blocks.extend(new);
                    r.cached_blocks = hits.len();
                    r.num_computed = computed;
                    if !preempted_before && !r.started {
                        r.cached_tokens = computed;
                        r.external_cached_tokens = external;
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
                if first_admission {
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
                self.cache_full_blocks(&id, n);
                if external > 0 {
                    shape.kv_transfers.push(external);
                }
                self.running.push(id.clone());
                admitted.insert(id.clone());
                budget -= n;
                scheduled.push((id, n));
                self.stats_dirty = true;
            }
            if !admitted.is_empty() {
                self.waiting.retain(|id| !admitted.contains(id));
            }
            if self.skipped_waiting != skipped {
                self.skipped_waiting = skipped;
                self.stats_dirty = true;
            }
        } else if self.skipped_waiting != 0 {
            // nothing was considered this step: whoever waits, waits for capacity
            self.skipped_waiting = 0;
            self.stats_dirty = true;
        }

        if scheduled.is_empty() {
            return None;
        }
        for (id, n) in &scheduled {
            let Some(r) = self.requests.get(id) else {
                continue;
            };
            let decode = r.num_computed + 1 >= r.tokens.len() as u64 && *n == 1 && r.started;
            if decode {
                shape.decode_requests += 1;
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
        Some(StepPlan { scheduled, shape })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::play::engine_core::{EngineCore, EngineInput, Outbox};
    use crate::play::scheduler::SchedulingPolicy;
    use crate::play::sim::EngineConfig;
    use crate::play::tokens::RandomTokens;
    use crate::play::utility::{PauseKind, PauseState};
    use sim_protocol::{EngineCoreRequest, InputMessage, LoRARequest, SamplingParams, VllmLine};

    fn engine(f: impl FnOnce(&mut EngineConfig)) -> SimEngine {
        let mut cfg = EngineConfig {
            line: VllmLine::new(0, 33),
            engine_index: 0,
            max_num_seqs: 16,
            max_num_batched_tokens: 8192,
            long_prefill_token_threshold: 0,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
            max_loras: 0,
            priority_preemption: false,
            max_model_len: 4096,
            block_size: 16,
            num_gpu_blocks: 1000,
            output_token_chunk_size: 1,
            log_requests: false,
            report_finished: false,
            spec: None,
            spec_metrics: Default::default(),
            failures: None,
            token_ids: 3..259,
            seed: 0,
        };
        f(&mut cfg);
        let mut e = SimEngine::new(
            cfg,
            Box::new(RandomTokens {
                seed: 0,
                min_id: 3,
                vocab_size: 259,
            }),
            sim_trace::latency::from_knobs(Default::default(), 0),
            SchedulingPolicy::Fcfs.build(),
        );
        // paused: requests queue up without starting steps, so tests plan them by hand
        e.util.pause = PauseState::Paused {
            kind: PauseKind::Scheduler,
            since: Instant::now(),
        };
        e
    }

    fn add(e: &mut SimEngine, id: &str, prompt: Vec<u32>, lora: Option<i64>) {
        let req = EngineCoreRequest {
            request_id: id.into(),
            prompt_token_ids: Some(prompt),
            sampling_params: Some(SamplingParams {
                max_tokens: Some(100),
                ..Default::default()
            }),
            lora_request: lora.map(|i| LoRARequest {
                name: format!("l{i}"),
                int_id: i,
                path: format!("/l{i}"),
            }),
            wire_len: 22,
            ..Default::default()
        };
        let mut out = Outbox::default();
        e.on_input(
            EngineInput::Message {
                client: 0,
                msg: InputMessage::Add(Box::new(req)),
            },
            Instant::now(),
            &mut out,
        );
    }

    fn plan(e: &mut SimEngine) -> Vec<(String, u64)> {
        e.util.pause = PauseState::Running;
        e.unhold_all();
        e.schedule(Instant::now())
            .map(|p| p.scheduled)
            .unwrap_or_default()
    }

    /// Run the plan to completion (what the end of the step does).
    fn finish(e: &mut SimEngine, scheduled: &[(String, u64)]) {
        for (id, n) in scheduled {
            let r = e.requests.get_mut(id).unwrap();
            r.num_computed += n;
            if r.num_computed >= r.tokens.len() as u64 {
                r.started = true;
                r.generate_one(4096);
            }
        }
    }

    fn s(v: &[(&str, u64)]) -> Vec<(String, u64)> {
        v.iter().map(|(a, b)| (a.to_string(), *b)).collect()
    }

    #[test]
    fn budget_goes_to_running_requests_first_then_chunks() {
        let mut e = engine(|c| c.max_num_batched_tokens = 100);
        add(&mut e, "a", vec![5; 60], None);
        add(&mut e, "b", vec![6; 60], None);
        add(&mut e, "c", vec![7; 10], None);
        let p1 = plan(&mut e);
        assert_eq!(p1, s(&[("a", 60), ("b", 40)]), "b is chunked, c waits");
        finish(&mut e, &p1);
        // a decodes (1), b finishes its prompt (20), c gets the rest of the budget
        let p2 = plan(&mut e);
        assert_eq!(p2, s(&[("a", 1), ("b", 20), ("c", 10)]));
    }

    #[test]
    fn long_prefill_threshold_caps_chunks_when_requests_compete() {
        let mut e = engine(|c| c.long_prefill_token_threshold = 16);
        add(&mut e, "a", vec![5; 40], None);
        add(&mut e, "b", vec![6; 40], None);
        assert_eq!(plan(&mut e), s(&[("a", 16), ("b", 16)]));
        // alone, a request may use the whole budget
        let mut e = engine(|c| c.long_prefill_token_threshold = 16);
        add(&mut e, "solo", vec![5; 40], None);
        assert_eq!(plan(&mut e), s(&[("solo", 40)]));
    }

    #[test]
    fn without_chunked_prefill_a_prompt_must_fit_the_budget() {
        let mut e = engine(|c| {
            c.max_num_batched_tokens = 50;
            c.enable_chunked_prefill = false;
        });
        add(&mut e, "a", vec![5; 30], None);
        add(&mut e, "b", vec![6; 30], None);
        assert_eq!(plan(&mut e), s(&[("a", 30)]));
    }

    #[test]
    fn max_num_seqs_caps_the_batch() {
        let mut e = engine(|c| c.max_num_seqs = 2);
        for id in ["a", "b", "c"] {
            add(&mut e, id, vec![5; 4], None);
        }
        assert_eq!(plan(&mut e), s(&[("a", 4), ("b", 4)]));
    }

    #[test]
    fn the_newest_running_request_is_preempted_when_kv_runs_out() {
        // 4 usable blocks of 4 tokens; two 7-token prompts take 2 blocks each
        let mut e = engine(|c| {
            c.block_size = 4;
            c.num_gpu_blocks = 5;
        });
        add(&mut e, "old", vec![5; 7], None);
        add(&mut e, "new", vec![6; 7], None);
        let p1 = plan(&mut e);
        assert_eq!(p1, s(&[("old", 7), ("new", 7)]));
        finish(&mut e, &p1); // 8 tokens each, 7 computed
        let p2 = plan(&mut e);
        assert_eq!(
            p2,
            s(&[("old", 1), ("new", 1)]),
            "8 tokens still fit 2 blocks"
        );
        finish(&mut e, &p2); // 9 tokens each: the 9th needs a third block
        let p3 = plan(&mut e);
        assert_eq!(p3, s(&[("old", 1)]), "new was preempted to make room");
        let new = &e.requests["new"];
        assert_eq!(new.phase, Phase::Waiting);
        assert_eq!(new.num_computed, 0);
        assert_eq!(new.num_preemptions, 1);
        assert!(
            new.pending_events
                .iter()
                .any(|ev| ev.kind == EventType::Preempted)
        );
        assert!(new.seq < 0, "back at the front of the queue");
        assert_eq!(e.running, vec!["old".to_string()]);
    }

    #[test]
    fn a_repeated_prompt_hits_the_prefix_cache() {
        let mut e = engine(|_| {});
        let prompt: Vec<u32> = (0..40).collect();
        add(&mut e, "first", prompt.clone(), None);
        let p = plan(&mut e);
        assert_eq!(p, s(&[("first", 40)]));
        assert_eq!((e.prefix_delta.queries, e.prefix_delta.hits), (40, 0));
        finish(&mut e, &p);
        e.finish_silently("first");
        e.prefix_delta = Default::default();
        add(&mut e, "second", prompt, None);
        // 2 full blocks (32 tokens) are cached; the rest is computed
        assert_eq!(plan(&mut e), s(&[("second", 8)]));
        assert_eq!((e.prefix_delta.queries, e.prefix_delta.hits), (40, 32));
        assert_eq!(e.requests["second"].cached_tokens, 32);
    }

    #[test]
    fn at_least_one_token_is_always_computed() {
        let mut e = engine(|_| {});
        let prompt: Vec<u32> = (0..32).collect();
        add(&mut e, "a", prompt.clone(), None);
        let p = plan(&mut e);
        finish(&mut e, &p);
        e.finish_silently("a");
        add(&mut e, "b", prompt, None);
        // a 32-token prompt can hit at most 31 tokens: one block (16)
        assert_eq!(plan(&mut e), s(&[("b", 16)]));
    }

    #[test]
    fn max_loras_limits_distinct_adapters_in_the_batch() {
        let mut e = engine(|c| c.max_loras = 1);
        add(&mut e, "l1", vec![5; 4], Some(1));
        add(&mut e, "l2", vec![5; 4], Some(2));
        add(&mut e, "base", vec![5; 4], None);
        add(&mut e, "l1b", vec![5; 4], Some(1));
        assert_eq!(plan(&mut e), s(&[("l1", 4), ("base", 4), ("l1b", 4)]));
        assert_eq!(e.waiting, vec!["l2".to_string()]);
        assert_eq!(
            e.skipped_waiting, 1,
            "reported as deferred, not waiting for capacity"
        );
    }
}
