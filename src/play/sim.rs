//! `SimEngine`: the production engine behind `vllm-vcr play`.
//!
//! It advances in steps, like vLLM's `EngineCore`: each step is planned by the step
//! composer (`step.rs`, vLLM's scheduler rules: token budget, chunked prefill, prefix
//! cache, KV capacity and preemption, LoRA slots), takes as long as the latency model says
//! for its shape, and when it ends every request that finished its prefill or decoded
//! emits its new tokens: one `EngineCoreOutputs` per client, with QUEUED / SCHEDULED /
//! PREEMPTED events, prefill stats on a request's first output, and one `SchedulerStats`
//! per step. Steps run back to back against absolute deadlines while there is work.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use sim_protocol::{
    EngineCoreEvent, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EventType,
    FinishReason, InputMessage, PrefillStats, PrefixCacheStats, RequestError, SchedulerStats,
    StopReason, VllmLine, describe_lines,
};
use sim_trace::latency::LatencyModel;
use sim_trace::stats::Samples;

use super::block_hash::{BlockHash, default_none_hash, hash_u64};
use super::engine_core::{EngineCore, EngineInput, Outbox};
use super::failures::FailureInjector;
use super::kv_cache::BlockPool;
use super::kv_cache::PoolEvent;
use super::kv_events::KvEventPublisher;
use super::logprobs::{resolve_num_logprobs, sample_logprobs, sample_prompt_logprobs};
use super::request::{Phase, SimRequest};
use super::scheduler::Scheduler;
use super::spec_decode::{RequestSpecTracker, SpecMetricsLevel, SpecModel, SpecStepStats};
use super::step::StepPlan;
use super::timer::{instant_to_monotonic, now_monotonic};
use super::tokens::TokenSource;
use super::tokens::{SplitMix64, request_seed};
use super::utility::{PauseState, UtilityState};
use sim_protocol::kv_events::KvEvent;

/// Engine settings that come from the command line.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub line: VllmLine,
    pub engine_index: u32,
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
    pub max_model_len: u64,
    pub block_size: u64,
    pub num_gpu_blocks: u64,
    /// Tokens per output message per request (≥ 1).
    pub output_token_chunk_size: u32,
    pub log_requests: bool,
    /// Speculative decoding: K drafts per decode step and their acceptance model.
    pub spec: Option<SpecModel>,
    pub spec_metrics: SpecMetricsLevel,
    pub failures: Option<FailureInjector>,
    /// Ids random tokens (and logprob alternatives) come from.
    pub token_ids: std::ops::Range<u32>,
    /// Seed of the per-request randomness.
    pub seed: u64,
    /// Tell the frontend which requests finished (`EngineCoreOutputs.finished_requests`);
    /// vLLM does this with data parallelism, where the frontend balances load with it.
    pub report_finished: bool,
}

pub struct SimEngine {
    pub(super) cfg: EngineConfig,
    tokens: Box<dyn TokenSource>,
    latency: Box<dyn LatencyModel>,
    pub(super) scheduler: Box<dyn Scheduler>,
    pub(super) requests: HashMap<String, SimRequest>,
    pub(super) waiting: Vec<String>,
    /// Waiting requests the last step skipped for lack of a LoRA slot (vLLM reports them
    /// as deferred, apart from those waiting for capacity).
    pub(super) skipped_waiting: usize,
    /// Requests (waiting or running) that name a LoRA adapter: the per-step adapter maps
    /// are only built when there are any.
    lora_requests: usize,
    pub(super) running: Vec<String>,
    pub(super) pool: BlockPool,
    pub(super) none_hash: BlockHash,
    /// The step being executed and when it ends.
    in_flight: Option<(Instant, StepPlan)>,
    next_seq: i64,
    pub(super) next_preempt_seq: i64,
    step_counter: u64,
    /// Counter deltas accumulated since the last stats were sent.
    pub(super) prefix_delta: PrefixCacheStats,
    /// Speculative-decoding counters of the step being reported.
    spec_step: Option<SpecStepStats>,
    pub(super) stats_dirty: bool,
    pub(super) shutting_down: bool,
    pub(super) util: UtilityState,
    warned_request_lens: HashSet<usize>,
    /// Finished request ids not yet reported, per client (with `report_finished`).
    unreported_finished: BTreeMap<u32, Vec<String>>,
    /// Step emission lateness against the scheduled deadline, microseconds.
    pub lateness_us: Samples,
    kv_publisher: Option<KvEventPublisher>,
}

impl SimEngine {
    pub fn new(
        cfg: EngineConfig,
        tokens: Box<dyn TokenSource>,
        latency: Box<dyn LatencyModel>,
        scheduler: Box<dyn Scheduler>,
    ) -> Self {
        Self {
            tokens,
            latency,
            scheduler,
            requests: HashMap::new(),
            waiting: Vec::new(),
            skipped_waiting: 0,
            lora_requests: 0,
            running: Vec::new(),
            pool: BlockPool::new(cfg.num_gpu_blocks as usize, false),
            none_hash: default_none_hash(),
            in_flight: None,
            next_seq: 0,
            next_preempt_seq: -1,
            step_counter: 0,
            prefix_delta: PrefixCacheStats::default(),
            spec_step: None,
            stats_dirty: false,
            shutting_down: false,
            util: UtilityState::default(),
            warned_request_lens: HashSet::new(),
            unreported_finished: BTreeMap::new(),
            lateness_us: Samples::default(),
            kv_publisher: None,
            cfg,
        }
    }

    /// Publish the block pool's cache events (BlockStored / BlockRemoved / AllBlocksCleared).
    pub fn set_kv_publisher(&mut self, p: KvEventPublisher) {
        self.pool.set_record_events(p.is_enabled());
        self.kv_publisher = Some(p);
    }

    pub fn take_kv_publisher(&mut self) -> Option<KvEventPublisher> {
        self.kv_publisher.take()
    }

    /// Hand the pool's events since the last call to the publisher (once per step, like
    /// vLLM's scheduler).
    pub(super) fn publish_kv_events(&mut self) {
        let Some(p) = &self.kv_publisher else {
            return;
        };
        let bs = self.cfg.block_size as u32;
        let events: Vec<KvEvent> = self
            .pool
            .take_events()
            .into_iter()
            .map(|e| match e {
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
                        bs,
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
            })
            .collect();
        if !events.is_empty() {
            p.publish(events);
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "engine {}: vLLM {} wire, tokens {}, latency {}, scheduler {}, max_num_seqs {}",
            self.cfg.engine_index,
            self.cfg.line,
            self.tokens.describe(),
            self.latency.describe(),
            self.scheduler.name(),
            self.cfg.max_num_seqs
        )
    }

    fn envelope(&self, outputs: Vec<EngineCoreOutput>, timestamp: f64) -> EngineCoreOutputs {
        EngineCoreOutputs {
            engine_index: self.cfg.engine_index,
            outputs,
            timestamp,
            ..Default::default()
        }
    }

    /// A request that never entered the engine (or leaves it at once) finishes with
    /// `reason` and an optional error, the way vLLM answers rejected requests.
    pub(super) fn reject(
        &self,
        out: &mut Outbox,
        client: u32,
        request_id: &str,
        reason: FinishReason,
        error: Option<RequestError>,
    ) {
        let error = if self.cfg.line.has_output_error() {
            error
        } else {
            None
        };
        let o = EngineCoreOutput {
            request_id: request_id.to_string(),
            finish_reason: Some(reason),
            error,
            ..Default::default()
        };
        let mut env = self.envelope(vec![o], now_monotonic());
        if self.cfg.report_finished {
            env.finished_requests = Some(vec![request_id.to_string()]);
        }
        out.send(client, env);
    }

    /// Finish a request with `error` and vLLM's `RequestError` (on lines that carry it).
    fn reject_error(
        &self,
        out: &mut Outbox,
        client: u32,
        request_id: &str,
        code: &str,
        message: impl Into<String>,
        retryable: bool,
    ) {
        let error = RequestError {
            code: code.into(),
            message: message.into(),
            retryable,
        };
        self.reject(out, client, request_id, FinishReason::Error, Some(error));
    }

    fn on_add(&mut self, client: u32, req: Box<EngineCoreRequest>, now: Instant, out: &mut Outbox) {
        let client = if req.client_index != client && req.client_index != 0 {
            req.client_index
        } else {
            client.max(req.client_index)
        };
        let expected = self.cfg.line.request_len();
        if req.wire_len != expected {
            let likely = VllmLine::lines_with_request_len(req.wire_len);
            let msg = format!(
                "the frontend sent a {}-element EngineCoreRequest, but vLLM {} sends {}: the frontend looks like vLLM {}. Restart vllm-vcr (play or serve) with --vllm-version set to the frontend's line",
                req.wire_len,
                self.cfg.line,
                expected,
                describe_lines(&likely)
            );
            if self.warned_request_lens.insert(req.wire_len) {
                tracing::error!(request_id = %req.request_id, "wire version mismatch: {msg}");
            } else {
                tracing::debug!(request_id = %req.request_id, "wire version mismatch");
            }
            self.reject_error(out, client, &req.request_id, "version_mismatch", msg, false);
            return;
        }
        if self.shutting_down {
            tracing::info!(request_id = %req.request_id, "engine is shutting down: request aborted");
            self.reject(out, client, &req.request_id, FinishReason::Abort, None);
            return;
        }
        if self.util.rejects_new_requests() {
            self.reject_error(
                out,
                client,
                &req.request_id,
                "engine_paused",
                "Generation is paused. Please retry after it resumes.",
                true,
            );
            return;
        }
        if req.sampling_params.is_none() {
            self.reject_error(
                out,
                client,
                &req.request_id,
                "validation_error",
                "pooling requests are not supported: the engine's only task is generate",
                false,
            );
            return;
        }
        if self.requests.contains_key(&req.request_id) {
            tracing::warn!(request_id = %req.request_id, "duplicate request id ignored");
            return;
        }
        if let Some(lora) = &req.lora_request {
            // vLLM loads an adapter the first time a request names it.
            self.util.register_lora(lora.int_id, &lora.name, &lora.path);
        }
        if self.cfg.log_requests {
            tracing::info!(
                request_id = %req.request_id,
                engine = self.cfg.engine_index,
                client,
                prompt_tokens = req.prompt_len(),
                max_tokens = ?req.sampling_params.as_ref().and_then(|s| s.max_tokens),
                "request added"
            );
        }
        let stream = self.tokens.stream_for(&req);
        let mut r = SimRequest::new(&req, stream, self.next_seq);
        r.client = client;
        r.rng = SplitMix64(request_seed(self.cfg.seed ^ 0x1f1f, &r.id));
        if let Some(f) = &self.cfg.failures {
            r.failure = f.decide_bounded(&mut r.rng, r.min_tokens, r.max_tokens);
        }
        if let Some(m) = &self.cfg.spec {
            r.spec = RequestSpecTracker::for_level(self.cfg.spec_metrics, m.num_spec_tokens);
        }
        self.next_seq += 1;
        r.pending_events.push(EngineCoreEvent {
            kind: EventType::Queued,
            timestamp: instant_to_monotonic(now),
        });
        r.held = self.util.holds_new_requests();
        let abort_now = req.abort_immediately;
        let id = r.id.clone();
        if r.lora_name.is_some() {
            self.lora_requests += 1;
        }
        self.requests.insert(id.clone(), r);
        self.waiting.push(id.clone());
        if abort_now {
            // vLLM admits and aborts at once so connector cleanup runs; no output.
            self.finish_silently(&id);
            return;
        }
        self.admit(now);
    }

    /// Remove a request without telling the frontend (client aborts, as vLLM does).
    pub(super) fn finish_silently(&mut self, id: &str) -> bool {
        self.free_blocks(id);
        let Some(r) = self.requests.remove(id) else {
            return false;
        };
        if r.lora_name.is_some() {
            self.lora_requests -= 1;
        }
        if self.cfg.report_finished {
            self.unreported_finished
                .entry(r.client)
                .or_default()
                .push(r.id.clone());
        }
        match r.phase {
            Phase::Waiting => self.waiting.retain(|w| w != id),
            Phase::Running => self.running.retain(|w| w != id),
        }
        self.stats_dirty = true;
        true
    }

    /// Start a step if none is running and there is work (after arrivals, aborts,
    /// resumes). The name is historical: admission happens inside the step composer.
    pub(super) fn admit(&mut self, now: Instant) {
        if self.in_flight.is_none() {
            self.plan_step(now, now);
        }
    }

    fn plan_step(&mut self, start: Instant, now: Instant) {
        if let Some(plan) = self.schedule(now) {
            let d = self.latency.step_duration(&plan.shape);
            self.in_flight = Some((start + d, plan));
        }
    }

    /// Preempt every running request (recompute), newest first, as vLLM does when it
    /// resets the prefix cache with `reset_running_requests`.
    pub(super) fn preempt_all_running(&mut self, now: Instant) {
        while let Some(id) = self.running.last().cloned() {
            self.preempt(&id, now);
        }
        self.in_flight = None;
    }

    /// Finish every request with ABORT outputs (pause in abort mode, shutdown).
    pub(super) fn abort_everything(&mut self, out: &mut Outbox) {
        let mut by_client: BTreeMap<u32, Vec<EngineCoreOutput>> = BTreeMap::new();
        let mut ids: Vec<&String> = self.requests.keys().collect();
        ids.sort();
        for id in ids {
            let r = &self.requests[id];
            by_client
                .entry(r.client)
                .or_default()
                .push(EngineCoreOutput {
                    request_id: id.clone(),
                    finish_reason: Some(FinishReason::Abort),
                    ..Default::default()
                });
        }
        let ids: Vec<String> = self.requests.keys().cloned().collect();
        for id in &ids {
            self.free_blocks(id);
        }
        self.requests.clear();
        self.lora_requests = 0;
        self.waiting.clear();
        self.running.clear();
        self.in_flight = None;
        if self.cfg.report_finished {
            for (client, outputs) in &by_client {
                let ids = outputs.iter().map(|o| o.request_id.clone());
                self.unreported_finished
                    .entry(*client)
                    .or_default()
                    .extend(ids);
            }
        }
        self.stats_dirty = true;
        self.send_step(by_client, now_monotonic(), out);
    }

    /// Send one step's envelopes: one per client with outputs, the scheduler stats to
    /// client 0 (in its own envelope if it had no outputs), and any finished ids not yet
    /// reported to their clients.
    fn send_step(
        &mut self,
        mut by_client: BTreeMap<u32, Vec<EngineCoreOutput>>,
        ts: f64,
        out: &mut Outbox,
    ) {
        let mut stats = self.stats_dirty.then(|| self.take_stats());
        let mut finished = std::mem::take(&mut self.unreported_finished);
        by_client.entry(0).or_default();
        for client in finished.keys() {
            by_client.entry(*client).or_default();
        }
        for (client, outputs) in by_client {
            let mut env = self.envelope(outputs, ts);
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
        self.stats_dirty = false;
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
        SchedulerStats {
            num_running_reqs: self.running.len() as u64,
            num_waiting_reqs: (self.waiting.len() - self.skipped_waiting.min(self.waiting.len()))
                as u64,
            num_skipped_waiting_reqs: self.skipped_waiting.min(self.waiting.len()) as u64,
            step_counter: self.step_counter,
            kv_cache_usage: self.pool.usage(),
            prefix_cache_stats: std::mem::take(&mut self.prefix_delta),
            spec_decoding_stats: self.spec_step.take().and_then(SpecStepStats::into_stats),
            running_lora_adapters: running_lora.into_iter().collect(),
            waiting_lora_adapters: waiting_lora.into_iter().collect(),
            ..Default::default()
        }
    }

    /// Send a stats-only envelope if the gauges changed outside a step (aborts, pauses).
    pub(super) fn flush_stats(&mut self, out: &mut Outbox) {
        if self.stats_dirty || !self.unreported_finished.is_empty() {
            self.stats_dirty = true;
            self.send_step(BTreeMap::new(), now_monotonic(), out);
        }
    }

    /// The step that was in flight ends: requests that completed their prefill or decoded
    /// emit their new tokens.
    fn complete_step(&mut self, end: Instant, plan: StepPlan, now: Instant, out: &mut Outbox) {
        if !self.latency.is_instant() {
            self.lateness_us
                .push(now.saturating_duration_since(end).as_secs_f64() * 1e6);
        }
        let ts = instant_to_monotonic(now);
        let mut by_client: BTreeMap<u32, Vec<EngineCoreOutput>> = BTreeMap::new();
        let mut finished: Vec<String> = Vec::new();
        let chunk = self.cfg.output_token_chunk_size.max(1);
        let max_model_len = self.cfg.max_model_len;
        let line = self.cfg.line;
        let bs = self.cfg.block_size;
        for (id, n) in plan.scheduled {
            let Some(r) = self.requests.get_mut(&id) else {
                continue; // aborted during the step
            };
            if r.phase != Phase::Running {
                continue; // preempted during the step
            }
            r.num_computed += n;
            if r.num_computed < r.tokens.len() as u64 {
                continue; // a partial prefill: no token yet
            }
            let mut o = EngineCoreOutput {
                request_id: id.clone(),
                ..Default::default()
            };
            let mut stop: Option<(FinishReason, Option<StopReason>)> = None;
            // a decode step verifies K drafts and delivers 1 + accepted tokens
            let mut count = chunk as u64;
            if let (Some(m), true) = (&self.cfg.spec, r.started) {
                let accepted = m.draw(&mut r.rng);
                self.spec_step
                    .get_or_insert_with(|| SpecStepStats::new(m.num_spec_tokens))
                    .observe(accepted);
                if let Some(t) = &mut r.spec {
                    t.observe(accepted);
                }
                count = 1 + u64::from(accepted);
            }
            let failure = r.failure;
            for _ in 0..count {
                if let Some(f) = failure.as_ref().filter(|f| r.num_output >= f.after_tokens) {
                    let (reason, why, err) = self
                        .cfg
                        .failures
                        .as_ref()
                        .map_or((FinishReason::Error, None, None), |inj| inj.finish(f));
                    o.error = err;
                    stop = Some((reason, why));
                    break;
                }
                let (t, s) = r.generate_one(max_model_len);
                o.new_token_ids.push(t);
                if s.is_some() {
                    stop = s;
                    break;
                }
            }
            if stop.is_none()
                && let Some(f) = failure.as_ref().filter(|f| r.num_output >= f.after_tokens)
            {
                let (reason, why, err) = self
                    .cfg
                    .failures
                    .as_ref()
                    .map_or((FinishReason::Error, None, None), |inj| inj.finish(f));
                o.error = err;
                stop = Some((reason, why));
            }
            // accepted drafts were computed by the verify pass
            r.num_computed = r.num_computed.max(r.tokens.len() as u64 - 1);
            let range = self.cfg.token_ids.clone();
            if let Some(k) = r.logprobs
                && !o.new_token_ids.is_empty()
            {
                let k = resolve_num_logprobs(k, range.end);
                o.new_logprobs = Some(sample_logprobs(
                    &mut r.rng,
                    &o.new_token_ids,
                    k,
                    range.clone(),
                ));
            }
            if !r.started
                && let Some(k) = r.prompt_logprobs
            {
                let k = resolve_num_logprobs(k, range.end);
                let prompt = r.tokens[..r.prompt_len as usize].to_vec();
                o.new_prompt_logprobs_tensors =
                    sample_prompt_logprobs(&mut r.rng, &prompt, k, range);
            }
            o.events = std::mem::take(&mut r.pending_events);
            if !r.started {
                r.started = true;
                let created = (r.cached_blocks as u64 * bs)
                    .min(r.prompt_len)
                    .saturating_sub(r.cached_tokens);
                o.prefill_stats = Some(PrefillStats {
                    num_prompt_tokens: r.prompt_len,
                    num_computed_tokens: r.prompt_len - r.cached_tokens.min(r.prompt_len),
                    num_cached_tokens: r.cached_tokens,
                    num_local_cached_tokens: r.cached_tokens - r.external_cached_tokens,
                    num_external_cached_tokens: r.external_cached_tokens,
                    num_cache_creation_tokens: if line.prefill_stats_has_cache_creation() {
                        created
                    } else {
                        0
                    },
                });
            }
            if let Some((reason, why)) = stop {
                o.finish_reason = Some(reason);
                o.stop_reason = why;
                o.spec_decode_metrics = r.spec.as_ref().map(RequestSpecTracker::finish);
                finished.push(id.clone());
                if self.cfg.log_requests {
                    tracing::info!(
                        request_id = %id,
                        output_tokens = r.num_output,
                        finish_reason = reason.as_str(),
                        "request finished"
                    );
                }
            }
            by_client.entry(r.client).or_default().push(o);
        }
        for id in &finished {
            self.finish_silently(id);
        }
        // every step reports stats, like vLLM's scheduler
        self.stats_dirty = true;
        self.send_step(by_client, ts, out);
        self.publish_kv_events();
        self.after_step(out);
    }

    fn on_bad_frame(
        &mut self,
        client: u32,
        error: sim_protocol::decode::DecodeError,
        out: &mut Outbox,
    ) {
        let ctx = &error.context;
        match (ctx.request_type, &ctx.request_id, ctx.call_id) {
            (Some(sim_protocol::RequestType::Add), Some(id), _) => {
                tracing::error!(request_id = %id, client, "rejecting an undecodable ADD: {error}");
                let client = ctx.client_index.unwrap_or(client);
                let id = id.clone();
                self.reject_error(
                    out,
                    client,
                    &id,
                    "invalid_request",
                    error.to_string(),
                    false,
                );
            }
            (Some(sim_protocol::RequestType::Utility), _, Some(call_id)) => {
                let method = ctx.method.clone().unwrap_or_else(|| "<unknown>".into());
                tracing::error!(
                    client,
                    method,
                    "failing an undecodable utility call: {error}"
                );
                let client = ctx.client_index.unwrap_or(client);
                let msg = format!("Call to {method} method failed: {error}");
                self.reply(out, client, call_id, Err(msg));
            }
            _ => {
                tracing::error!(client, "dropping an undecodable frame: {error}");
            }
        }
    }

    /// Total requests known (waiting + running).
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Push the step in flight back by `by` (resume after a pause in keep mode).
    pub(super) fn shift_deadlines(&mut self, by: Duration) {
        if let Some((end, _)) = &mut self.in_flight {
            *end += by;
        }
    }

    pub(super) fn unhold_all(&mut self) {
        for r in self.requests.values_mut() {
            r.held = false;
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
                        self.admit(now);
                        self.flush_stats(out);
                        self.after_step(out);
                    }
                }
                InputMessage::Utility(call) => {
                    self.handle_utility(call, now, out);
                    self.flush_stats(out);
                    self.publish_kv_events();
                }
                InputMessage::StartDpWave { wave, .. } => {
                    tracing::debug!(wave, "START_DP_WAVE ignored (no DP coordinator waves)");
                }
            },
            EngineInput::Bad { client, error } => self.on_bad_frame(client, error, out),
        }
    }

    fn on_deadline(&mut self, now: Instant, out: &mut Outbox) {
        let Some((end, _)) = &self.in_flight else {
            return;
        };
        if *end > now {
            return;
        }
        let Some((end, plan)) = self.in_flight.take() else {
            return;
        };
        self.complete_step(end, plan, now, out);
        // back to back: the next step starts when this one ended, unless we are late
        let start = if now.saturating_duration_since(end) < Duration::from_millis(1) {
            end
        } else {
            now
        };
        if self.in_flight.is_none() {
            self.plan_step(start, now);
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        if matches!(self.util.pause, PauseState::Paused { .. }) {
            return None;
        }
        self.in_flight.as_ref().map(|(end, _)| *end)
    }

    fn begin_shutdown(&mut self, _now: Instant, _out: &mut Outbox) {
        tracing::info!(
            in_flight = self.requests.len(),
            "shutdown requested: no new requests; draining the admitted ones"
        );
        self.shutting_down = true;
    }

    fn abort_all(&mut self, _now: Instant, out: &mut Outbox) {
        if !self.requests.is_empty() {
            tracing::warn!(
                aborted = self.requests.len(),
                "shutdown timeout reached: aborting the remaining requests"
            );
            self.abort_everything(out);
        }
    }

    fn is_idle(&self) -> bool {
        self.requests.is_empty()
    }
}
