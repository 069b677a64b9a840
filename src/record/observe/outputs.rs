//! The observer's side of what engines send: each output step mapped onto the tap's clock,
//! the requests' chunks and finishes, and one step-stats line per step.

use std::collections::BTreeMap;

use bytes::Bytes;
use sim_protocol::decode::{DecodedOutputs, decode_outputs, decode_outputs_for};
use sim_protocol::{EngineCoreOutputs, EventType, FinishReason, SchedulerStats};
use sim_trace::steps::{StepPrefixCache, StepSpecDecoding, StepStats};

use super::{Clock, Observer, SAME_CLOCK_WINDOW_S};

impl Observer {
    /// The engine timestamp `ts` on the tap's clock, for an output received at `t`.
    fn engine_time(&mut self, rank: u32, ts: f64, t: f64) -> f64 {
        if !ts.is_finite() || ts <= 0.0 {
            return t;
        }
        let diff = t - ts;
        let clock = self.clocks.entry(rank).or_insert_with(|| {
            if diff.abs() < SAME_CLOCK_WINDOW_S {
                Clock::Same
            } else {
                tracing::info!(
                    engine = rank,
                    offset_s = diff,
                    "the engine's clock is not the tap's; mapping its timestamps"
                );
                Clock::Offset(diff)
            }
        });
        match clock {
            Clock::Same => ts,
            Clock::Offset(off) => {
                if diff < *off {
                    *off = diff;
                }
                ts + *off
            }
        }
    }

    pub(super) fn on_output(&mut self, t: f64, frames: &[Bytes]) {
        let decoded = match self.line {
            Some(line) => decode_outputs_for(line, frames),
            None => decode_outputs(frames),
        };
        match decoded {
            Ok(DecodedOutputs::Dead) => {
                tracing::error!("the engine sent ENGINE_CORE_DEAD (relayed to the frontend)");
                let ids: Vec<String> = self.reqs.keys().cloned().collect();
                for id in ids {
                    if let Some(r) = self.reqs.get_mut(&id) {
                        r.error = Some("engine core dead".into());
                    }
                    self.finalize(&id, None, Some("engine core dead".into()));
                }
            }
            Ok(DecodedOutputs::Outputs(o)) => self.on_outputs(t, o),
            Err(e) => self.undecodable(&format!("an engine output message: {e}")),
        }
    }

    fn on_outputs(&mut self, t: f64, o: EngineCoreOutputs) {
        let rank = o.engine_index;
        let te = self.engine_time(rank, o.timestamp, t);
        if let Some(s) = &o.scheduler_stats {
            self.running
                .insert(rank, u32::try_from(s.num_running_reqs).unwrap_or(u32::MAX));
        }
        // Prompts whose prefill finished in this step: their first token is in it.
        let mut prefill_requests = 0u32;
        let mut prefill_tokens = 0u64;
        let mut new_tokens = 0u64;
        for out in &o.outputs {
            new_tokens += out.new_token_ids.len() as u64;
            if let Some(r) = self.reqs.get(out.request_id.as_str())
                && r.first_token.is_none()
                && !out.new_token_ids.is_empty()
            {
                let cached = out
                    .prefill_stats
                    .as_deref()
                    .map(|p| p.num_cached_tokens)
                    .unwrap_or(0);
                prefill_requests += 1;
                prefill_tokens += u64::from(r.prompt_tokens).saturating_sub(cached);
            }
        }
        let prefill_tokens_u32 = u32::try_from(prefill_tokens).unwrap_or(u32::MAX);
        let engine_in_flight = self.reqs.values().filter(|r| r.engine == rank).count() as u32;
        let running = self.running.get(&rank).copied().unwrap_or(engine_in_flight);
        let record_tokens = self.cfg.record_tokens;
        let mut finished = Vec::new();
        let mut queued_at = Vec::new();
        for out in &o.outputs {
            let Some(r) = self.reqs.get_mut(out.request_id.as_str()) else {
                self.summary.unmatched_outputs += 1;
                continue;
            };
            let n = out.new_token_ids.len() as u32;
            if r.queued.is_none()
                && let Some(q) = out.events.iter().find(|e| e.kind == EventType::Queued)
            {
                queued_at.push((out.request_id.clone(), q.timestamp));
            }
            if r.cached_tokens.is_none()
                && let Some(p) = out.prefill_stats.as_deref()
            {
                r.cached_tokens = u32::try_from(p.num_cached_tokens).ok();
            }
            if n > 0 {
                if r.first_token.is_none() {
                    r.first_token = Some(te);
                } else {
                    let gap = ((te - r.last_chunk) * 1000.0).max(0.0);
                    r.itl_ms.push((gap * 1000.0).round() / 1000.0);
                    r.itl_tokens.push(n);
                    r.num_running.push(running);
                    r.prefill_tokens.push(prefill_tokens_u32);
                }
                r.last_chunk = te;
                r.output_tokens += n;
                if record_tokens && let Some(ids) = r.token_ids.as_mut() {
                    ids.extend_from_slice(&out.new_token_ids);
                }
                if let (Some(c), Some(m)) = (r.thinking.as_mut(), self.cfg.thinking.as_deref()) {
                    c.feed(m, &out.new_token_ids);
                }
            }
            if let Some(e) = &out.error {
                r.error = Some(format!("{}: {}", e.code, e.message));
            }
            if let Some(reason) = out.finish_reason {
                finished.push((out.request_id.clone(), reason));
            }
        }
        for (id, ts) in queued_at {
            let q = self.engine_time(rank, ts, t);
            if let Some(r) = self.reqs.get_mut(id.as_str()) {
                r.queued = Some(q);
            }
        }
        for (id, reason) in finished {
            let why = match reason {
                FinishReason::Abort => Some("aborted by the engine".to_string()),
                FinishReason::Error => Some("finished with an error".to_string()),
                _ => None,
            };
            self.finalize(&id, Some(reason), why);
        }
        if let Some(stats) = o.scheduler_stats.as_deref() {
            let step = StepCounts {
                outputs: o.outputs.len() as u64,
                new_tokens,
                prefill_requests,
                prefill_tokens,
            };
            self.write_step(rank, te, stats, &step);
        }
    }

    fn write_step(&mut self, rank: u32, te: f64, s: &SchedulerStats, step: &StepCounts) {
        if self.steps.is_none() || self.zero.is_none() {
            return;
        }
        let step_ms = self
            .last_step
            .insert(rank, te)
            .map(|prev| ((te - prev) * 1000.0 * 1000.0).round() / 1000.0);
        let line = step_stats(self.ms(te), rank, step_ms, s, step);
        if let Some(w) = self.steps.as_mut()
            && let Err(e) = w.write_json(&line)
        {
            self.summary.dropped_steps += 1;
            self.write_failed("the step-stats file", e.into());
        }
        self.summary.steps += 1;
        self.dirty = true;
    }
}

pub(super) struct StepCounts {
    pub(super) outputs: u64,
    pub(super) new_tokens: u64,
    pub(super) prefill_requests: u32,
    pub(super) prefill_tokens: u64,
}

/// One step-stats sidecar line: what the engine reported at the end of the step and what
/// the step's outputs carried.
pub(super) fn step_stats(
    ts_ms: f64,
    engine: u32,
    step_ms: Option<f64>,
    s: &SchedulerStats,
    step: &StepCounts,
) -> StepStats {
    let adapters = |v: &[(String, u64)]| v.iter().cloned().collect::<BTreeMap<_, _>>();
    let p = &s.prefix_cache_stats;
    StepStats {
        ts_ms,
        engine,
        step_ms,
        step_counter: s.step_counter,
        current_wave: s.current_wave,
        num_running_reqs: s.num_running_reqs,
        num_waiting_reqs: s.num_waiting_reqs,
        num_skipped_waiting_reqs: s.num_skipped_waiting_reqs,
        kv_cache_usage: s.kv_cache_usage,
        outputs: step.outputs,
        new_tokens: step.new_tokens,
        prefill_requests: step.prefill_requests,
        prefill_tokens: step.prefill_tokens,
        prefix_cache: StepPrefixCache {
            reset: p.reset,
            requests: p.requests,
            queries: p.queries,
            hits: p.hits,
            preempted_requests: p.preempted_requests,
            preempted_queries: p.preempted_queries,
            preempted_hits: p.preempted_hits,
        },
        running_lora_adapters: adapters(&s.running_lora_adapters),
        waiting_lora_adapters: adapters(&s.waiting_lora_adapters),
        spec_decoding: s.spec_decoding_stats.as_ref().map(|sd| StepSpecDecoding {
            num_spec_tokens: sd.num_spec_tokens,
            num_drafts: sd.num_drafts,
            num_draft_tokens: sd.num_draft_tokens,
            num_accepted_tokens: sd.num_accepted_tokens,
            num_accepted_tokens_per_pos: sd.num_accepted_tokens_per_pos.clone(),
            num_draft_tokens_per_pos: sd.num_draft_tokens_per_pos.clone(),
        }),
    }
}
