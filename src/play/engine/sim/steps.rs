//! The step cycle: compose a step from the batch, time it with the latency model, and when
//! it ends emit what it produced (tokens, events, stats), plus the scripted requests that
//! replay recorded timing outside the batch.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use sim_protocol::{EngineCoreOutput, FinishReason, SchedulerStats};

use crate::play::content::spec_decode::SpecStepStats;
use crate::play::engine::emit::{Burst, emit, emit_into};
use crate::play::engine::engine_core::{EngineCore, Outbox};

use super::{InFlight, SimEngine};

/// An engine idle this long before a step starts it from idle (a fitted model charges
/// such a step its wake-up).
pub(super) const IDLE_WAKE: Duration = Duration::from_millis(sim_trace::latency::IDLE_WAKE_MS);

impl SimEngine {
    /// Start a step if none is running and there is work (after arrivals, aborts,
    /// resumes).
    pub(super) fn start_step_if_idle(&mut self, now: Instant) {
        if self.in_flight.is_none() {
            self.start_step(now);
        }
    }

    /// Compose the next step, starting at `start`.
    pub(super) fn start_step(&mut self, start: Instant) {
        // whatever started this step, a pending wake has been answered
        self.wake = None;
        if !self.util.scheduling_enabled() {
            return;
        }
        if let Some(mut plan) = self.batch.compose(&self.cfg.rules, start) {
            plan.shape.after_idle = self
                .last_step_end
                .is_some_and(|end| start.saturating_duration_since(end) >= IDLE_WAKE);
            let mut timing = self.latency.step(&plan.shape);
            // a step that samples a first token runs the model at least once, even when
            // the whole prompt was cached (vLLM recomputes its last token): no cheaper than
            // a decode step. Steps with decodes already cost one; chunks that do not finish
            // their prompt sample nothing and keep the model's price.
            let shape = &plan.shape;
            if shape.decodes.is_empty()
                && shape
                    .prefills
                    .iter()
                    .any(|c| c.context + c.tokens >= c.uncached_prompt)
            {
                timing.duration = timing.duration.max(self.cfg.first_token_floor);
            }
            timing.duration += plan.load_time; // blocks loaded from the offload tier
            self.in_flight = Some(InFlight {
                end: start + timing.duration,
                plan,
                timing,
            });
        }
    }

    /// Send one step's envelopes: one per client with outputs, the scheduler stats to
    /// client 0 (in its own envelope if it had no outputs; none under
    /// `--disable-log-stats`), and any finished ids not yet reported to their clients.
    pub(super) fn send_step(
        &mut self,
        mut by_client: BTreeMap<u32, Vec<EngineCoreOutput>>,
        now: Instant,
        out: &mut Outbox,
    ) {
        let mut stats = self.cfg.log_stats.then(|| self.take_stats());
        let mut finished = std::mem::take(&mut self.unreported_finished);
        by_client.entry(0).or_default();
        for client in finished.keys() {
            by_client.entry(*client).or_default();
        }
        for (client, outputs) in by_client {
            let mut env = self.envelope(outputs, now);
            if client == 0 {
                env.scheduler_stats = stats.take().map(Box::new);
            }
            env.finished_requests = finished.remove(&client).filter(|f| !f.is_empty());
            let empty = env.outputs.is_empty()
                && env.scheduler_stats.is_none()
                && env.finished_requests.is_none();
            if !empty {
                out.send(client, env);
            }
        }
    }

    /// Stats for the step that just ran: gauges now, counters since the last stats.
    pub(super) fn take_stats(&mut self) -> SchedulerStats {
        self.step_counter += 1;
        let (g, prefix) = self.batch.take_stats();
        let offload = self.batch.take_offload_stats();
        SchedulerStats {
            num_running_reqs: g.running + self.scripts.len() as u64,
            // vLLM counts a request waiting for its grammar as waiting
            num_waiting_reqs: g.waiting + self.compiling.len() as u64,
            num_skipped_waiting_reqs: g.skipped_waiting,
            step_counter: self.step_counter,
            kv_cache_usage: g.kv_cache_usage,
            prefix_cache_stats: prefix,
            connector_prefix_cache_stats: offload.as_ref().map(|s| s.lookups),
            kv_connector_stats: offload
                .filter(|_| self.cfg.offload.is_some_and(|o| o.connector_stats))
                .and_then(|s| s.kv_connector_stats())
                .or_else(|| self.nixl_stats.take()),
            spec_decoding_stats: self.spec_step.take().and_then(SpecStepStats::into_stats),
            running_lora_adapters: g.running_lora,
            waiting_lora_adapters: g.waiting_lora,
            ..Default::default()
        }
    }

    /// Send a stats-only envelope if the gauges changed outside a step (aborts, pauses) and
    /// no step is in flight: vLLM reports such a change from the next step it runs (a
    /// finished or aborted request alone makes it step), so a step in flight reports it
    /// when it ends — with the requests that step admitted, not before them.
    pub(super) fn flush_stats(&mut self, now: Instant, out: &mut Outbox) {
        if self.in_flight.is_some() {
            return;
        }
        if (self.cfg.log_stats && self.batch.is_dirty()) || !self.unreported_finished.is_empty() {
            self.send_step(BTreeMap::new(), now, out);
        }
    }

    /// The step in flight ends: requests that completed their prefill or decoded emit
    /// their new tokens.
    pub(super) fn complete_step(&mut self, step: InFlight, now: Instant, out: &mut Outbox) {
        if !self.latency.is_instant() {
            self.lateness_us
                .push(now.saturating_duration_since(step.end).as_secs_f64() * 1e6);
        }
        let InFlight { plan, timing, end } = step;
        let mut to_script: Vec<String> = Vec::new();
        let k = self.latency.num_spec_tokens();
        let mut bursts = std::mem::take(&mut self.bursts);
        bursts.clear();
        bursts.extend(
            plan.shape
                .decodes
                .iter()
                .zip(&timing.decode_tokens)
                .map(|(d, n)| (d.request_key, *n)),
        );
        bursts.sort_unstable_by_key(|b| b.0);
        let mut by_client: BTreeMap<u32, Vec<EngineCoreOutput>> = BTreeMap::new();
        let mut finished: Vec<String> = Vec::new();
        let capacity = plan.scheduled.len();
        for (slot, n) in plan.scheduled {
            let Some(r) = self.batch.advance(slot, n) else {
                continue; // a partial prefill, or aborted / preempted during the step
            };
            let burst = match bursts.binary_search_by_key(&r.key, |b| b.0) {
                Ok(i) if r.started => Burst::Model { n: bursts[i].1, k },
                _ => Burst::Engine,
            };
            // one vector per client, sized for the whole step: growing it moved every
            // output several times at thousands of streams
            let outputs = by_client
                .entry(r.client)
                .or_insert_with(|| Vec::with_capacity(capacity));
            outputs.push(EngineCoreOutput::for_request(r.id.clone()));
            let o = outputs.last_mut().expect("just pushed");
            let done = emit_into(o, r, &self.cfg, burst, &mut self.spec_step);
            let keeps_kv = done
                && r.remote_decode
                && matches!(
                    o.finish_reason,
                    Some(FinishReason::Stop | FinishReason::Length)
                );
            if keeps_kv {
                let id = r.id.clone();
                o.kv_transfer_params = self.finish_keeping_kv(&id, now).map(Box::new);
            } else if done {
                finished.push(r.id.to_string());
            } else if r.script.is_some() {
                to_script.push(r.id.to_string());
            }
        }
        self.bursts = bursts;
        for id in &finished {
            self.finish_silently(id);
        }
        // the prefill was modeled; the rest follows the recorded gaps from this step's end
        for id in to_script {
            if let Some(mut r) = self.batch.remove(&id)
                && let Some(s) = r.script.take()
            {
                let due = end
                    + s.chunks
                        .first()
                        .map_or(Duration::ZERO, |c| self.scaled(c.0));
                self.scripts.insert(r, s, 1, due);
            }
        }
        // every step reports stats, like vLLM's scheduler
        self.send_step(by_client, now, out);
        if !finished.is_empty() && self.is_idle() {
            // vLLM steps once more to hand the finished ids to its workers: an empty step
            // whose stats (nothing running or waiting) close the burst
            self.send_step(BTreeMap::new(), now, out);
        }
        self.publish_kv_events();
        self.complete_drain(now, out);
    }

    /// Emit every scripted chunk that is due: one envelope per client, with stats.
    pub(super) fn fire_scripts(&mut self, now: Instant, out: &mut Outbox) {
        if let Some(due) = self.scripts.next_due() {
            self.lateness_us
                .push(now.saturating_duration_since(due).as_secs_f64() * 1e6);
        }
        let mut by_client: BTreeMap<u32, Vec<EngineCoreOutput>> = BTreeMap::new();
        let cfg = &self.cfg;
        let k = self.replay.script_k;
        let spec_step = &mut self.spec_step;
        let ended = self.scripts.fire(now, |r, n| {
            let (o, done) = emit(r, cfg, Burst::Model { n, k }, spec_step);
            by_client.entry(r.client).or_default().push(o);
            done
        });
        for (r, done) in ended {
            if !done {
                // the script ran out before the request's stop rules ended it: end it
                // where the capture did
                let reason = r.recorded_end.map_or(FinishReason::Length, |e| e.1);
                let outputs = by_client.entry(r.client).or_default();
                match outputs.iter_mut().rev().find(|o| o.request_id == r.id) {
                    Some(o) => o.finish_reason = Some(reason),
                    None => outputs.push(EngineCoreOutput {
                        request_id: r.id.clone(),
                        finish_reason: Some(reason),
                        ..Default::default()
                    }),
                }
            }
            self.latency.forget(r.key);
            if self.cfg.report_finished {
                self.unreported_finished
                    .entry(r.client)
                    .or_default()
                    .push(r.id.into());
            }
        }
        self.send_step(by_client, now, out);
        self.complete_drain(now, out);
    }
}
