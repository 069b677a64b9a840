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

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use rmpv::Value;
use sim_protocol::kv_events::KvEvent;
use sim_protocol::{
    CallId, EngineCoreEvent, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EventType,
    FinishReason, InputMessage, RequestError, SchedulerStats, UtilityCall, UtilityOutput, VllmLine,
    describe_lines,
};
use sim_trace::latency::{LatencyModel, StepTiming};
use sim_trace::stats::Samples;

use super::batch::{Batch, StepPlan};
use super::emit::{Burst, emit, emit_into};
use super::engine_core::{EngineCore, EngineInput, GrammarCompile, GrammarReady, Outbox};
use super::queue_policy::QueuePolicy;
use super::request::SimRequest;
use super::scripted::Scripts;
use super::timer::instant_to_monotonic;
use super::utility::{EngineView, PauseState, UtilityEffect, UtilityState};
use crate::play::content::pooling::{PoolingRequest, Runner};
use crate::play::content::replay::Replay;
use crate::play::content::spec_decode::{RequestSpecTracker, SpecStepStats};
use crate::play::content::tokens::{SplitMix64, TokenSource, request_seed};
use crate::play::pd::kv_events::KvEventPublisher;

pub mod config;
/// The P/D side of the engine: admission of transfer requests, the side channel's and
/// the pulls' reports, and prefill requests that keep their KV.
mod pd_flow;

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
    step_counter: u64,
    /// Speculative-decoding counters of the step being reported.
    spec_step: Option<SpecStepStats>,
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
}

/// A request whose grammar is being compiled off the step loop.
struct Compiling {
    client: u32,
    req: Box<EngineCoreRequest>,
    /// When it was taken in: its QUEUED event's time once it joins the queue.
    queued_at: Instant,
}

/// Keeps a flood of undecodable frames from flooding the log.
#[derive(Debug, Default)]
struct BadFrames {
    total: u64,
    unreported: u64,
    last_report: Option<Instant>,
}

impl BadFrames {
    /// Logged one by one, up to this many.
    const LOUD: u64 = 10;

    /// Count a bad frame at `now`; `true` when it should be logged in full. Past the first
    /// [`Self::LOUD`], a summary line comes at most once a second.
    fn note(&mut self, now: Instant) -> bool {
        self.total += 1;
        if self.total <= Self::LOUD {
            if self.total == Self::LOUD {
                tracing::warn!(
                    "{} undecodable frames so far: from now on they are counted, and reported once a second",
                    self.total
                );
                self.last_report = Some(now);
            }
            return true;
        }
        self.unreported += 1;
        if self
            .last_report
            .is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(1))
        {
            tracing::error!(
                total = self.total,
                "{} more undecodable frames dropped or rejected since the last report",
                self.unreported
            );
            self.unreported = 0;
            self.last_report = Some(now);
        }
        false
    }
}

impl SimEngine {
    /// An engine; use `PlayConfig::build_engine` rather than calling this directly.
    pub fn new(
        cfg: EngineConfig,
        tokens: Box<dyn TokenSource>,
        latency: Box<dyn LatencyModel>,
        policy: Box<dyn QueuePolicy>,
    ) -> Self {
        Self {
            tokens,
            latency,
            batch: Batch::new(cfg.num_gpu_blocks, cfg.block_size, cfg.log_requests, policy),
            in_flight: None,
            wake: None,
            step_counter: 0,
            spec_step: None,
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
            cfg,
        }
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
        self.kv_publisher = Some(p);
    }

    /// The data plane a P/D prefill engine publishes finished requests' KV on.
    pub fn set_data_plane(
        &mut self,
        plane: std::sync::Arc<dyn crate::play::pd::data_plane::DataPlane>,
    ) {
        self.data_plane = plane;
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

    /// A request that never entered the engine (or leaves it at once) finishes with
    /// `reason` and an optional error, the way vLLM answers rejected requests.
    fn reject(
        &self,
        out: &mut Outbox,
        client: u32,
        request_id: &str,
        reason: FinishReason,
        error: Option<RequestError>,
        now: Instant,
    ) {
        let error = if self.cfg.line.has_output_error() {
            error
        } else {
            None
        };
        let o = EngineCoreOutput {
            request_id: request_id.into(),
            finish_reason: Some(reason),
            error: error.map(Box::new),
            ..Default::default()
        };
        let mut env = self.envelope(vec![o], now);
        if self.cfg.report_finished {
            env.finished_requests = Some(vec![request_id.to_string()]);
        }
        out.send(client, env);
    }

    /// Finish a request with `error` and vLLM's `RequestError` (on lines that carry it).
    #[allow(clippy::too_many_arguments)]
    fn reject_error(
        &self,
        out: &mut Outbox,
        client: u32,
        request_id: &str,
        code: &str,
        message: impl Into<String>,
        retryable: bool,
        now: Instant,
    ) {
        let error = RequestError {
            code: code.into(),
            message: message.into(),
            retryable,
        };
        self.reject(
            out,
            client,
            request_id,
            FinishReason::Error,
            Some(error),
            now,
        );
    }

    fn on_add(&mut self, client: u32, req: Box<EngineCoreRequest>, now: Instant, out: &mut Outbox) {
        let client = if req.client_index != client && req.client_index != 0 {
            req.client_index
        } else {
            client.max(req.client_index)
        };
        let id = req.request_id.as_str();
        let expected = self.cfg.line.request_len();
        if req.wire_len != expected {
            let likely = VllmLine::lines_with_request_len(req.wire_len);
            let guess = if likely.is_empty() {
                "its line is none of the supported ones (vllm-vcr speaks 0.25–0.33)".to_string()
            } else {
                format!(
                    "the frontend looks like vLLM {}. Restart vllm-vcr (play or serve) with --vllm-version set to the frontend's line",
                    describe_lines(&likely)
                )
            };
            let msg = format!(
                "the frontend sent a {}-element EngineCoreRequest, but vLLM {} sends {}: {guess}",
                req.wire_len, self.cfg.line, expected,
            );
            if self.warned_request_lens.insert(req.wire_len) {
                tracing::error!(request_id = %id, "wire version mismatch: {msg}");
            } else {
                tracing::debug!(request_id = %id, "wire version mismatch");
            }
            // The reply must be readable by the frontend that sent the request, not only by
            // the configured line: an `EngineCoreOutput` holding just the request id, no
            // tokens and the finish reason has the same layout on every line (the fields that
            // differ all come later and are trimmed), so vLLM's `error` field is added only
            // when every line the frontend may be has it. A reply in the configured layout
            // kills an older vllm-rs's output dispatcher, which then fails every request.
            let error =
                (!likely.is_empty() && likely.iter().all(|l| l.has_output_error())).then(|| {
                    RequestError {
                        code: "version_mismatch".into(),
                        message: msg,
                        retryable: false,
                    }
                });
            self.reject(out, client, id, FinishReason::Error, error, now);
            return;
        }
        if self.shutting_down {
            tracing::info!(request_id = %id, "engine is shutting down: request aborted");
            self.reject(out, client, id, FinishReason::Abort, None, now);
            return;
        }
        if self.util.rejects_new_requests() {
            let msg = "Generation is paused. Please retry after it resumes.";
            self.reject_error(out, client, id, "engine_paused", msg, true, now);
            return;
        }
        let pooling = self.cfg.runner == Runner::Pooling;
        match (&req.sampling_params, pooling) {
            (None, false) => {
                let msg = "a pooling request reached a generating engine: start play with --runner pooling (and the frontend with --runner pooling) to serve embeddings";
                self.reject_error(out, client, id, "validation_error", msg, false, now);
                return;
            }
            (Some(_), true) => {
                let msg = "a generation request reached a pooling engine (--runner pooling): it only serves embeddings";
                self.reject_error(out, client, id, "validation_error", msg, false, now);
                return;
            }
            _ => {}
        }
        if self.batch.contains(id) || self.compiling.contains_key(id) {
            tracing::warn!(request_id = %id, "duplicate request id ignored");
            return;
        }
        if req.prompt_len() as u64 >= self.cfg.max_model_len {
            // vLLM's frontends refuse these; a client that does not would otherwise wait
            // forever for a request no KV cache of this size can hold
            let msg = format!(
                "the prompt has {} tokens, and this engine's maximum model length is {} (the most its KV cache holds): at least one token must be left to generate",
                req.prompt_len(),
                self.cfg.max_model_len
            );
            tracing::warn!(request_id = %id, "{msg}");
            self.reject_error(out, client, id, "validation_error", msg, false, now);
            return;
        }
        if let Some(lora) = &req.lora_request {
            // vLLM loads an adapter the first time a request names it.
            self.util.register_lora(lora.int_id, &lora.name, &lora.path);
        }
        if self.cfg.log_requests {
            tracing::info!(
                request_id = %id,
                engine = self.cfg.engine_index,
                client,
                prompt_tokens = req.prompt_len(),
                max_tokens = ?req.sampling_params.as_ref().and_then(|s| s.max_tokens),
                "request added"
            );
        }
        let shaped = if pooling {
            Ok(None)
        } else {
            self.cfg.shaping.plan(&req, self.cfg.seed)
        };
        let stream = match shaped {
            Ok(Some(job)) => {
                // its grammar compiles off the step loop; it waits (not scheduled) until
                // the grammar is ready, and the other requests keep their pace
                let request_id = id.to_string();
                let queued_at = self.input_taken_at(now);
                self.compiling.insert(
                    request_id.clone(),
                    Compiling {
                        client,
                        req,
                        queued_at,
                    },
                );
                out.compile(GrammarCompile { request_id, job });
                return;
            }
            Ok(None) => self.tokens.stream_for(&req),
            Err(msg) => {
                self.reject_structured(out, client, id, msg, now);
                return;
            }
        };
        let queued_at = self.input_taken_at(now);
        self.admit(client, req, stream, queued_at, now, out);
    }

    /// A request's structured outputs cannot be generated: finish it with the reason.
    fn reject_structured(
        &self,
        out: &mut Outbox,
        client: u32,
        id: &str,
        msg: String,
        now: Instant,
    ) {
        tracing::warn!(request_id = %id, "{msg}");
        // `validation_error`: the one non-retryable code both frontends turn into an
        // answer that carries the message (HTTP 400); any other code reaches a vllm-rs
        // client as a bare "Internal server error"
        let msg = format!("structured_output_unsupported: {msg}");
        self.reject_error(out, client, id, "validation_error", msg, false, now);
    }

    /// A request's grammar is compiled: the request joins the waiting queue (its QUEUED
    /// event keeps its arrival), or finishes with the reason its grammar failed.
    fn on_grammar(&mut self, ready: GrammarReady, now: Instant, out: &mut Outbox) {
        let Some(c) = self.compiling.remove(&ready.request_id) else {
            tracing::debug!(request_id = %ready.request_id, "grammar of an aborted request dropped");
            return;
        };
        match ready.result {
            Ok(stream) => self.admit(c.client, c.req, stream, c.queued_at, now, out),
            Err(msg) => {
                self.reject_structured(out, c.client, &ready.request_id, msg, now);
                self.complete_drain(now, out);
            }
        }
    }

    /// Admit a validated request whose token stream is ready: replay, the P/D role,
    /// failures and spec decoding set it up, and it joins the waiting queue as of
    /// `queued_at`.
    fn admit(
        &mut self,
        client: u32,
        req: Box<EngineCoreRequest>,
        stream: Box<dyn crate::play::content::tokens::TokenStream>,
        queued_at: Instant,
        now: Instant,
        out: &mut Outbox,
    ) {
        let id = req.request_id.as_str();
        let pooling = self.cfg.runner == Runner::Pooling;
        let served = match self.replay.resolve(&req, stream, self.cfg.log_requests) {
            Ok(served) => served,
            Err(msg) => {
                // `validation_error`, so that the client reads why (see above)
                let msg = format!("replay_miss: {msg}");
                self.reject_error(out, client, id, "validation_error", msg, false, now);
                return;
            }
        };
        let script = served.script;
        let mut r = SimRequest::new(&req, served.stream, 0);
        if let Some((len, reason)) = served.recorded_end {
            // the stream ends where the capture did
            r.max_tokens = Some(r.max_tokens.map_or(len, |m| m.min(len)));
            r.recorded_end = Some((len, reason));
        }
        r.client = client;
        if pooling {
            r.pooling = Some(PoolingRequest::from_params(req.pooling_params.as_ref()));
        }
        r.rng = SplitMix64(request_seed(self.cfg.seed ^ 0x1f1f, &r.id));
        if let Some(f) = &self.cfg.failures {
            r.failure = f.decide_bounded(&mut r.rng, r.min_tokens, r.max_tokens);
        }
        let k = self
            .cfg
            .spec
            .map(|m| m.num_spec_tokens)
            .or_else(|| self.latency.num_spec_tokens());
        if let Some(k) = k {
            r.spec = RequestSpecTracker::for_level(self.cfg.spec_metrics, k);
        }
        r.held = self.util.holds_new_requests();
        if let Some((mean, std)) = self.cfg.fixed_ttft_ms {
            let ms = lognormal(&mut r.rng, mean, std);
            r.not_before = Some(now + sim_trace::latency::duration_from_ms(ms));
        }
        let pull = self.pd_admit(&mut r, &req);
        let id = r.id.clone();
        match script {
            Some(s) if !self.cfg.modeled_prefill => {
                // the recorded TTFT includes the recorded queueing: follow it verbatim
                for kind in [EventType::Queued, EventType::Scheduled] {
                    r.pending_events.push(EngineCoreEvent {
                        kind,
                        timestamp: instant_to_monotonic(now),
                    });
                }
                let due = now + self.scaled(s.ttft);
                self.scripts.insert(r, s, 0, due);
                return;
            }
            Some(s) => {
                r.script = Some(s);
                self.batch.insert(r, queued_at);
            }
            None => self.batch.insert(r, queued_at),
        }
        if req.abort_immediately {
            // vLLM admits and aborts at once so connector cleanup runs; no output.
            self.finish_silently(&id);
            return;
        }
        let pulling = pull.is_some();
        if let Some(p) = pull {
            out.pull(p);
        }
        if self.in_flight.is_none() {
            self.wake = Some(now);
        }
        if pulling {
            // vLLM keeps stepping while a request waits for its KV: its stats show it
            self.flush_stats(now, out);
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

    /// Start a step if none is running and there is work (after arrivals, aborts,
    /// resumes).
    fn start_step_if_idle(&mut self, now: Instant) {
        if self.in_flight.is_none() {
            self.start_step(now);
        }
    }

    /// Compose the next step, starting at `start`.
    fn start_step(&mut self, start: Instant) {
        // whatever started this step, a pending wake has been answered
        self.wake = None;
        if !self.util.scheduling_enabled() {
            return;
        }
        if let Some(plan) = self.batch.compose(&self.cfg.rules, start) {
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
            self.in_flight = Some(InFlight {
                end: start + timing.duration,
                plan,
                timing,
            });
        }
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
        self.send_step(by_client, true, now, out);
    }

    /// Send one step's envelopes: one per client with outputs, the scheduler stats to
    /// client 0 (in its own envelope if it had no outputs) when `stats` or the gauges
    /// changed, and any finished ids not yet reported to their clients.
    fn send_step(
        &mut self,
        mut by_client: BTreeMap<u32, Vec<EngineCoreOutput>>,
        stats: bool,
        now: Instant,
        out: &mut Outbox,
    ) {
        let mut stats = (stats || self.batch.is_dirty()).then(|| self.take_stats());
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
    fn take_stats(&mut self) -> SchedulerStats {
        self.step_counter += 1;
        let (g, prefix) = self.batch.take_stats();
        SchedulerStats {
            num_running_reqs: g.running + self.scripts.len() as u64,
            // vLLM counts a request waiting for its grammar as waiting
            num_waiting_reqs: g.waiting + self.compiling.len() as u64,
            num_skipped_waiting_reqs: g.skipped_waiting,
            step_counter: self.step_counter,
            kv_cache_usage: g.kv_cache_usage,
            prefix_cache_stats: prefix,
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
    fn flush_stats(&mut self, now: Instant, out: &mut Outbox) {
        if self.in_flight.is_some() {
            return;
        }
        if self.batch.is_dirty() || !self.unreported_finished.is_empty() {
            self.send_step(BTreeMap::new(), true, now, out);
        }
    }

    /// The step in flight ends: requests that completed their prefill or decoded emit
    /// their new tokens.
    fn complete_step(&mut self, step: InFlight, now: Instant, out: &mut Outbox) {
        if !self.latency.is_instant() {
            self.lateness_us
                .push(now.saturating_duration_since(step.end).as_secs_f64() * 1e6);
        }
        let InFlight { plan, timing, end } = step;
        let mut to_script: Vec<String> = Vec::new();
        let k = self.latency.num_spec_tokens();
        let bursts: BTreeMap<u64, u32> = plan
            .shape
            .decodes
            .iter()
            .zip(&timing.decode_tokens)
            .map(|(d, n)| (d.request_key, *n))
            .collect();
        let mut by_client: BTreeMap<u32, Vec<EngineCoreOutput>> = BTreeMap::new();
        let mut finished: Vec<String> = Vec::new();
        let capacity = plan.scheduled.len();
        for (slot, n) in plan.scheduled {
            let Some(r) = self.batch.advance(slot, n) else {
                continue; // a partial prefill, or aborted / preempted during the step
            };
            let burst = match bursts.get(&r.key) {
                Some(&n) if r.started => Burst::Model { n, k },
                _ => Burst::Engine,
            };
            // one vector per client, sized for the whole step: growing it moved every
            // output several times at thousands of streams
            let outputs = by_client
                .entry(r.client)
                .or_insert_with(|| Vec::with_capacity(capacity));
            outputs.push(EngineCoreOutput::default());
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
        self.send_step(by_client, true, now, out);
        if !finished.is_empty() && self.is_idle() {
            // vLLM steps once more to hand the finished ids to its workers: an empty step
            // whose stats (nothing running or waiting) close the burst
            self.send_step(BTreeMap::new(), true, now, out);
        }
        self.publish_kv_events();
        self.complete_drain(now, out);
    }

    fn on_bad_frame(
        &mut self,
        client: u32,
        error: sim_protocol::decode::DecodeError,
        now: Instant,
        out: &mut Outbox,
    ) {
        let ctx = &error.context;
        let loud = self.bad_frames.note(now);
        match (ctx.request_type, &ctx.request_id, ctx.call_id) {
            (Some(sim_protocol::RequestType::Add), Some(id), _) => {
                if loud {
                    tracing::error!(request_id = %id, client, "rejecting an undecodable ADD: {error}");
                }
                let client = ctx.client_index.unwrap_or(client);
                let id = id.clone();
                let msg = error.to_string();
                self.reject_error(out, client, &id, "invalid_request", msg, false, now);
            }
            (Some(sim_protocol::RequestType::Utility), _, Some(call_id)) => {
                let method = ctx.method.clone().unwrap_or_else(|| "<unknown>".into());
                if loud {
                    tracing::error!(
                        client,
                        method,
                        "failing an undecodable utility call: {error}"
                    );
                }
                let client = ctx.client_index.unwrap_or(client);
                let msg = format!("Call to {method} method failed: {error}");
                self.reply(out, client, call_id, Err(msg), now);
            }
            _ if loud => {
                tracing::error!(client, "dropping an undecodable frame: {error}");
            }
            _ => {}
        }
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

    /// Emit every scripted chunk that is due: one envelope per client, with stats.
    fn fire_scripts(&mut self, now: Instant, out: &mut Outbox) {
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
        self.send_step(by_client, true, now, out);
        self.complete_drain(now, out);
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

#[cfg(test)]
mod bad_frame_tests {
    use super::*;

    #[test]
    fn a_flood_of_bad_frames_logs_ten_then_a_count_a_second() {
        let mut b = BadFrames::default();
        let t0 = Instant::now();
        // 20,000 garbage frames within half a second: ten logged in full
        let loud = (0..20_000u64)
            .filter(|i| b.note(t0 + Duration::from_micros(i * 25)))
            .count();
        assert_eq!(loud, BadFrames::LOUD as usize);
        assert_eq!(b.total, 20_000);
        // the summary of the rest comes once the second is over
        assert!(!b.note(t0 + Duration::from_millis(1500)));
        assert_eq!(b.unreported, 0, "reported and reset");
    }
}
