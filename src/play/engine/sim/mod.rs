//! `SimEngine`: the production engine behind `vllm-vcr play`.
//!
//! It advances in steps, like vLLM's `EngineCore`: each step is composed by the batch
//! (`batch/compose.rs`, vLLM's scheduler rules: token budget, chunked prefill, prefix
//! cache, KV capacity and preemption, LoRA slots), takes as long as the latency model says
//! for its shape, and when it ends every request that finished its prefill or decoded
//! emits its new tokens (`emit.rs`): one `EngineCoreOutputs` per client, with QUEUED /
//! SCHEDULED / PREEMPTED events, prefill stats on a request's first output, and one
//! `SchedulerStats` per step. Steps run back to back against absolute deadlines while
//! there is work.
//!
//! The engine never reads a clock: every call carries `now`, and a step that ends at `t`
//! is followed by one that starts at `t`, so a live run and an offline run on a virtual
//! clock (`offline.rs`) that see the same arrivals compose the same steps.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use rmpv::Value;
use sim_protocol::kv_events::KvEvent;
use sim_protocol::{
    CallId, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, InputMessage,
    UtilityCall, UtilityOutput,
};
use sim_trace::latency::{LatencyModel, StepTiming};
use sim_trace::stats::Samples;

use super::batch::{Batch, StepPlan};
use super::block_hash::BlockHash;
use super::engine_core::{EngineCore, EngineInput, Outbox};
use super::queue_policy::QueuePolicy;
use super::request::SimRequest;
use super::scripted::Scripts;
use super::timer::instant_to_monotonic;
use super::utility::{EngineView, PauseState, UtilityEffect, UtilityState};
use crate::play::content::replay::Replay;
use crate::play::content::spec_decode::SpecStepStats;
use crate::play::content::tokens::{SplitMix64, TokenSource};
use crate::play::pd::kv_events::KvEventPublisher;

mod admit;
mod bad_frames;
pub mod config;
/// The P/D side of the engine: admission of transfer requests, the side channel's and
/// the pulls' reports, and prefill requests that keep their KV.
mod pd_flow;
pub mod reject;
mod steps;

use bad_frames::BadFrames;
pub use config::EngineConfig;

/// A step emitted this late restarts the step clock at the moment it was emitted.
const STALL: std::time::Duration = std::time::Duration::from_millis(20);

/// The step being executed.
struct InFlight {
    end: Instant,
    plan: StepPlan,
    timing: StepTiming,
}

pub struct SimEngine {
    cfg: EngineConfig,
    tokens: Box<dyn TokenSource>,
    latency: Box<dyn LatencyModel>,
    batch: Batch,
    in_flight: Option<InFlight>,
    /// An idle engine that took in a request starts its step at this time, after every
    /// other input of the same instant: vLLM's engine-core drains its input queue before
    /// it schedules, so requests that reach it together share the first step.
    wake: Option<Instant>,
    /// When the last step ended: a step that starts long after it starts from idle
    /// ([`sim_trace::latency::StepShape::after_idle`]).
    last_step_end: Option<Instant>,
    step_counter: u64,
    /// Each decode's token count in the step that just ended, by request key (sorted);
    /// kept between steps so a step reuses its room.
    bursts: Vec<(u64, u32)>,
    /// Speculative-decoding counters of the step being reported.
    spec_step: Option<SpecStepStats>,
    /// NIXL reads since the last stats (`--nixl-connector-stats`).
    nixl_stats: crate::play::pd::connector_stats::NixlStats,
    shutting_down: bool,
    util: UtilityState,
    warned_request_lens: HashSet<usize>,
    /// Finished request ids not yet reported, per client (with `report_finished`).
    unreported_finished: BTreeMap<u32, Vec<String>>,
    /// Step (and scripted chunk) emission lateness against the scheduled deadline,
    /// microseconds.
    lateness_us: Samples,
    kv_publisher: Option<KvEventPublisher>,
    /// Where a P/D prefill request's KV bytes are published (no-op unless NIXL).
    data_plane: std::sync::Arc<dyn crate::play::pd::data_plane::DataPlane>,
    /// Recorded content and timing (`--replay-tokens`, `--replay-steps`).
    replay: Replay,
    /// Requests following their recorded timing.
    scripts: Scripts,
    /// Undecodable frames: the first few are logged, then a count once a second.
    bad_frames: BadFrames,
    /// When an idle engine last tried to admit requests whose `--ttft-mode fixed` delay
    /// had passed.
    due_tried: Option<Instant>,
    /// Requests waiting for their grammar to compile (vLLM's `WAITING_FOR_FSM`), by id.
    compiling: BTreeMap<String, Compiling>,
    /// Prompt block hashes a caller computed before adding the request, by id (see
    /// [`SimEngine::offer_prompt_hashes`]); taken when the request's add is handled.
    prehashed: HashMap<String, Vec<BlockHash>>,
    /// Every prompt is synthesized ids (see [`SimEngine::set_synthesized_prompts`]).
    synthesized_prompts: bool,
}

/// A request whose grammar is being compiled off the step loop.
struct Compiling {
    client: u32,
    req: Box<EngineCoreRequest>,
    /// When it was taken in: its QUEUED event's time once it joins the queue.
    queued_at: Instant,
}

impl SimEngine {
    /// An engine; use `PlayConfig::build_engine` rather than calling this directly.
    pub fn new(
        cfg: EngineConfig,
        tokens: Box<dyn TokenSource>,
        latency: Box<dyn LatencyModel>,
        policy: Box<dyn QueuePolicy>,
    ) -> Self {
        let mut batch = Batch::new(cfg.num_gpu_blocks, cfg.block_size, cfg.log_requests, policy);
        if let Some(o) = cfg.offload {
            batch.set_offload(super::offload::OffloadTier::new(o));
        }
        Self {
            tokens,
            latency,
            batch,
            in_flight: None,
            wake: None,
            last_step_end: None,
            step_counter: 0,
            bursts: Vec::new(),
            spec_step: None,
            nixl_stats: Default::default(),
            shutting_down: false,
            util: UtilityState::default(),
            warned_request_lens: HashSet::new(),
            unreported_finished: BTreeMap::new(),
            // a reservoir of 65,536 (every 2^k-th step once full): 512 KiB at most. The
            // default million grew RSS by 0.24 MiB per 5 minutes of a soak at 100 steps/s
            lateness_us: Samples::with_capacity(1 << 16),
            kv_publisher: None,
            data_plane: std::sync::Arc::new(crate::play::pd::data_plane::NoopDataPlane),
            replay: Replay::default(),
            scripts: Scripts::default(),
            bad_frames: BadFrames::default(),
            due_tried: None,
            compiling: BTreeMap::new(),
            prehashed: HashMap::new(),
            synthesized_prompts: false,
            cfg,
        }
    }

    /// The parent hash of every prompt's first block (vLLM's `NONE_HASH`), where a
    /// caller's [`offer_prompt_hashes`](Self::offer_prompt_hashes) chain starts.
    pub fn block_hash_root(&self) -> BlockHash {
        self.batch.block_hash_root()
    }

    /// Hand over the hashes of the complete blocks of the prompt of the request
    /// `request_id` that is about to be added, so the engine does not compute them: each
    /// `block_hash::hash_block(parent, block, &[])` at this engine's block size, chained
    /// from [`block_hash_root`](Self::block_hash_root). A driver that sees many prompts
    /// share blocks (conversation turns) computes each distinct one once. Ignored for a
    /// request whose hashes carry extra keys (LoRA, cache salt); taken when the request is
    /// admitted (after its grammar compiles, if it has one), dropped if it is refused.
    pub fn offer_prompt_hashes(&mut self, request_id: &str, hashes: Vec<BlockHash>) {
        self.prehashed.insert(request_id.to_string(), hashes);
    }

    /// Tell the engine that every prompt it is given is synthesized: token ids a driver
    /// drew per block (`inspect simulate` has no prompt text, only a trace's block ids), not
    /// a tokenized conversation. Such a prompt declares no tools, so a request without
    /// structured outputs is not scanned for `<tools>` (the scan read every prompt token,
    /// 6 % of a simulation of long prompts).
    pub fn set_synthesized_prompts(&mut self, synthesized: bool) {
        self.synthesized_prompts = synthesized;
    }

    pub fn engine_index(&self) -> u32 {
        self.cfg.engine_index
    }

    /// Step emission lateness against the scheduled deadlines, microseconds.
    pub fn lateness_us(&self) -> &Samples {
        &self.lateness_us
    }

    /// Serve recorded content and timing (`--replay-tokens`, `--replay-steps`).
    pub fn set_replay(&mut self, replay: Replay) {
        self.replay = replay;
    }

    /// The replay counts, when replaying.
    pub fn replay_summary(&self) -> Option<(String, serde_json::Value)> {
        self.replay.summary()
    }

    /// Publish the block pool's cache events (BlockStored / BlockRemoved / AllBlocksCleared).
    pub fn set_kv_publisher(&mut self, p: KvEventPublisher) {
        self.batch.record_kv_events(p.is_enabled());
        self.batch.record_offload_events(p.is_enabled());
        self.kv_publisher = Some(p);
    }

    /// The data plane a P/D prefill engine publishes finished requests' KV on.
    pub fn set_data_plane(
        &mut self,
        plane: std::sync::Arc<dyn crate::play::pd::data_plane::DataPlane>,
    ) {
        self.data_plane = plane;
    }

    /// The block pool's cache events since the last call, recording them from now on:
    /// offline, where no publisher takes them, a fleet's router follows them.
    pub fn take_cache_events(&mut self) -> Vec<super::kv_cache::PoolEvent> {
        self.batch.record_kv_events(true);
        self.batch.take_kv_events()
    }

    pub fn take_kv_publisher(&mut self) -> Option<KvEventPublisher> {
        self.kv_publisher.take()
    }

    /// Hand the pool's events since the last call to the publisher (once per step, like
    /// vLLM's scheduler).
    fn publish_kv_events(&mut self) {
        let Some(p) = &self.kv_publisher else {
            return;
        };
        let bs = self.cfg.block_size as u32;
        let events: Vec<KvEvent> = self
            .batch
            .take_kv_events()
            .into_iter()
            .map(|e| e.into_kv_event(bs))
            .chain(self.batch.take_offload_events())
            .collect();
        if !events.is_empty() {
            p.publish(events);
        }
    }

    pub fn describe(&self) -> String {
        let mut latency = self.latency.describe();
        if let Some((mean, std)) = self.cfg.fixed_ttft_ms {
            // the knobs' step TTFT is 0 under --ttft-mode fixed: name the delay in force
            // (unscaled, as the knobs are printed)
            let ts = self.cfg.time_scale;
            latency = latency.replacen("ttft 0 ms (sd 0), ", "", 1);
            latency = format!(
                "{latency}, ttft fixed {} ms (sd {}) after arrival",
                mean * ts,
                std * ts
            );
        }
        format!(
            "engine {}: vLLM {} wire, tokens {}, latency {}, queue {}, max_num_seqs {}",
            self.cfg.engine_index,
            self.cfg.line,
            self.tokens.describe(),
            latency,
            self.batch.policy_name(),
            self.cfg.rules.max_num_seqs
        )
    }

    fn envelope(&self, outputs: Vec<EngineCoreOutput>, now: Instant) -> EngineCoreOutputs {
        EngineCoreOutputs {
            engine_index: self.cfg.engine_index,
            outputs,
            timestamp: instant_to_monotonic(now),
            ..Default::default()
        }
    }

    /// Remove a request without telling the frontend (client aborts, as vLLM does).
    fn finish_silently(&mut self, id: &str) -> bool {
        if self.compiling.remove(id).is_some() {
            // its grammar is still compiling: the result is dropped when it comes
            return true;
        }
        let Some(r) = self.batch.remove(id).or_else(|| self.scripts.remove(id)) else {
            return false;
        };
        self.forget_finished(&r);
        true
    }

    /// A request left the engine: the latency model forgets it, and the frontend is told
    /// it finished (with `report_finished`).
    fn forget_finished(&mut self, r: &SimRequest) {
        self.latency.forget(r.key);
        if self.cfg.report_finished {
            self.unreported_finished
                .entry(r.client)
                .or_default()
                .push(r.id.to_string());
        }
    }

    /// When the engine takes in what arrives at `now`: at once when it is idle, else when
    /// the step in flight ends. vLLM's engine-core reads its input queue between steps, so
    /// the QUEUED event of a request that arrives during a step carries the step's end (and
    /// a capture's TTFT, measured from QUEUED, leaves that wait out).
    fn input_taken_at(&self, now: Instant) -> Instant {
        self.in_flight.as_ref().map_or(now, |s| s.end.max(now))
    }

    /// Finish every request with ABORT outputs (pause in abort mode, shutdown).
    fn abort_everything(&mut self, now: Instant, out: &mut Outbox) {
        let mut by_client: BTreeMap<u32, Vec<EngineCoreOutput>> = BTreeMap::new();
        for (id, c) in std::mem::take(&mut self.compiling) {
            by_client
                .entry(c.client)
                .or_default()
                .push(EngineCoreOutput {
                    request_id: id.as_str().into(),
                    finish_reason: Some(FinishReason::Abort),
                    ..Default::default()
                });
        }
        let mut all = self.batch.drain();
        all.extend(self.scripts.drain());
        for r in all {
            self.forget_finished(&r);
            by_client
                .entry(r.client)
                .or_default()
                .push(EngineCoreOutput {
                    request_id: r.id,
                    finish_reason: Some(FinishReason::Abort),
                    ..Default::default()
                });
        }
        self.in_flight = None;
        self.send_step(by_client, now, out);
    }

    /// Total requests known (waiting + running).
    pub fn num_requests(&self) -> usize {
        self.batch.len() + self.scripts.len() + self.compiling.len()
    }

    /// A recorded duration on this engine's clock (`--time-scale`).
    fn scaled(&self, d: Duration) -> Duration {
        // `div_f64` panics on overflow; the scale is range-checked, and this never panics
        sim_trace::latency::secs_to_duration(d.as_secs_f64() / self.cfg.time_scale)
    }

    /// Send a utility reply on its own (never mixed with request outputs).
    fn reply(
        &self,
        out: &mut Outbox,
        client: u32,
        call_id: CallId,
        outcome: Result<Value, String>,
        now: Instant,
    ) {
        out.send(
            client,
            EngineCoreOutputs {
                engine_index: self.cfg.engine_index,
                timestamp: instant_to_monotonic(now),
                utility_output: Some(UtilityOutput { call_id, outcome }),
                ..Default::default()
            },
        );
    }

    fn on_utility(&mut self, call: UtilityCall, now: Instant, out: &mut Outbox) {
        let UtilityCall {
            client_index: client,
            call_id,
            method,
            args,
        } = call;
        tracing::debug!(method, ?args, client, "utility call");
        let view = EngineView {
            line: self.cfg.line,
            block_size: self.cfg.block_size,
            num_gpu_blocks: self.cfg.num_gpu_blocks,
            running: self.batch.num_running(),
            requests: self.batch.len(),
            tasks: self.cfg.runner.tasks(),
        };
        let effect = self
            .util
            .dispatch(&method, &args, &view, client, call_id, now);
        let answer = match effect {
            Ok(UtilityEffect::Reply(v)) => Some(Ok(v)),
            Ok(UtilityEffect::Deferred) => {
                self.complete_drain(now, out);
                None
            }
            Ok(UtilityEffect::AbortAllThenReply) => {
                self.abort_everything(now, out);
                Some(Ok(Value::Nil))
            }
            Ok(UtilityEffect::ResetPrefixCache { preempt_running }) => {
                if preempt_running {
                    self.batch.preempt_all_running(now);
                    self.in_flight = None;
                }
                // vLLM's `reset_prefix_cache`: every cached hash goes (AllBlocksCleared);
                // the frontend sees `prefix_cache_stats.reset`
                let done = self.batch.reset_prefix_cache();
                self.start_step_if_idle(now);
                Some(Ok(Value::Boolean(done)))
            }
            Ok(UtilityEffect::Resume {
                shift,
                drained,
                reply,
            }) => {
                if let Some(step) = &mut self.in_flight {
                    step.end += shift;
                }
                self.scripts.shift(shift);
                for (c, id) in drained {
                    self.reply(out, c, id, Ok(Value::Nil), now);
                }
                self.batch.unhold_all();
                self.start_step_if_idle(now);
                Some(Ok(reply))
            }
            Err(e) => {
                tracing::warn!(method, "utility call failed: {e}");
                Some(Err(format!("Call to {method} method failed: {e}")))
            }
        };
        if let Some(outcome) = answer {
            self.reply(out, client, call_id, outcome, now);
        }
    }

    /// Complete a draining pause once the requests it waits for are gone.
    fn complete_drain(&mut self, now: Instant, out: &mut Outbox) {
        if !matches!(self.util.pause, PauseState::Draining { .. }) {
            return;
        }
        for (client, call_id) in self.util.complete_drain(
            self.batch.num_unheld() + self.scripts.len() + self.compiling.len(),
            now,
        ) {
            self.reply(out, client, call_id, Ok(Value::Nil), now);
        }
    }
}

impl EngineCore for SimEngine {
    fn on_input(&mut self, input: EngineInput, now: Instant, out: &mut Outbox) {
        match input {
            EngineInput::Message { client, msg } => match msg {
                InputMessage::Add(req) => self.on_add(client, req, now, out),
                InputMessage::Abort(ids) => {
                    let mut n = 0;
                    for id in &ids {
                        if self.finish_silently(id) {
                            n += 1;
                            if self.cfg.log_requests {
                                tracing::info!(request_id = %id, "request aborted by the frontend");
                            }
                        } else {
                            tracing::debug!(request_id = %id, "abort for an unknown or finished request ignored");
                        }
                    }
                    if n > 0 {
                        self.start_step_if_idle(now);
                        self.flush_stats(now, out);
                        self.complete_drain(now, out);
                    }
                }
                InputMessage::Utility(call) => {
                    self.on_utility(call, now, out);
                    self.flush_stats(now, out);
                    self.publish_kv_events();
                }
                InputMessage::StartDpWave { wave, .. } => {
                    tracing::debug!(wave, "START_DP_WAVE ignored (no DP coordinator waves)");
                }
            },
            EngineInput::Bad { client, error } => self.on_bad_frame(client, error, now, out),
            EngineInput::Pd(ev) => self.on_pd(ev, now, out),
            EngineInput::Grammar(ready) => self.on_grammar(ready, now, out),
        }
    }

    fn on_deadline(&mut self, now: Instant, out: &mut Outbox) {
        if self.scripts.next_due().is_some_and(|d| d <= now) {
            self.fire_scripts(now, out);
        }
        if self.batch.next_held_expiry().is_some_and(|d| d <= now) {
            for id in self.batch.expire_held(now) {
                tracing::warn!(request_id = %id, lease_s = self.cfg.pd.lease_s, "releasing the KV blocks of a prefill request no decode engine read before its lease expired");
            }
            self.flush_stats(now, out);
        }
        if self.in_flight.is_none() {
            // nothing in flight: the requests that woke the engine, or a request held back
            // by --ttft-mode fixed, may be due. A woken step starts when the first of them
            // arrived (a live loop reaches its deadline a little late; the step clock does
            // not move with it, as for back-to-back steps below)
            let start = self.wake.take().map_or(now, |w| w.min(now));
            self.due_tried = Some(now);
            self.start_step_if_idle(start);
            return;
        }
        if self.in_flight.as_ref().is_some_and(|s| s.end > now) {
            return;
        }
        let Some(step) = self.in_flight.take() else {
            return;
        };
        let end = step.end;
        self.last_step_end = Some(end);
        self.complete_step(step, now, out);
        // Back to back: the next step starts when this one ended, whenever the loop got
        // round to it, so the step clock does not drift with the loop's lateness (and a
        // live run composes the same steps as the offline driver). After a real stall the
        // clock restarts instead, rather than firing a burst of catch-up steps.
        let start = if now.saturating_duration_since(end) > STALL {
            tracing::debug!(
                late_ms = now.saturating_duration_since(end).as_secs_f64() * 1e3,
                "engine loop stalled: the step clock restarts"
            );
            now
        } else {
            end
        };
        if self.in_flight.is_none() {
            self.start_step(start);
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        if matches!(self.util.pause, PauseState::Paused { .. }) {
            return None;
        }
        let step = self.in_flight.as_ref().map(|s| s.end);
        // --ttft-mode fixed: an idle engine wakes when a held-back request is due (one it
        // already tried and could not admit waits for the next event instead of spinning)
        let due = match (&self.in_flight, self.cfg.fixed_ttft_ms) {
            (None, Some(_)) => self
                .batch
                .next_not_before()
                .filter(|t| self.due_tried.is_none_or(|tried| *t > tried)),
            _ => None,
        };
        [
            step,
            self.wake,
            self.scripts.next_due(),
            self.batch.next_held_expiry(),
            due,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    fn begin_shutdown(&mut self, _now: Instant, _out: &mut Outbox) {
        tracing::info!(
            in_flight = self.batch.len(),
            "shutdown requested: no new requests; draining the admitted ones"
        );
        self.shutting_down = true;
    }

    fn abort_all(&mut self, now: Instant, out: &mut Outbox) {
        if !self.is_idle() {
            tracing::warn!(
                aborted = self.num_requests(),
                "shutdown timeout reached: aborting the remaining requests"
            );
            self.abort_everything(now, out);
        }
    }

    fn is_idle(&self) -> bool {
        self.batch.is_empty() && self.scripts.is_empty() && self.compiling.is_empty()
    }
}

/// A log-normal draw with this mean and standard deviation (the mean itself when there is
/// no spread), from the request's own generator.
fn lognormal(rng: &mut SplitMix64, mean: f64, std: f64) -> f64 {
    if mean <= 0.0 || std <= 0.0 {
        return mean.max(0.0);
    }
    let u = |rng: &mut SplitMix64| ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let (u1, u2) = (u(rng), u(rng));
    let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
    let sigma2 = (1.0 + (std / mean).powi(2)).ln();
    (mean.ln() - sigma2 / 2.0 + sigma2.sqrt() * z).exp()
}
