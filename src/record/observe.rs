//! The observing half of the tap: decodes the copies the relay hands over, follows each
//! request from its ADD to its finish, and writes one trace record per request (and, with
//! `--step-stats-out`, one line per engine step with the `SchedulerStats` it reported).
//!
//! Runs on its own thread, fed by an unbounded queue ([`super::handoff`]): however slow decoding or the disk
//! is, the relay never waits for it.
//!
//! Times. All trace times are milliseconds from the capture's zero, the moment the tap
//! relayed the first ADD. Every time in a record is the engine's own: a request arrives
//! when the engine queued it (the QUEUED event of its first output; engines that report
//! no events fall back to the moment the tap relayed the ADD), and each output chunk is
//! timed by the engine's timestamp of the step that produced it.
//! On one host the engine's clock is the tap's (`CLOCK_MONOTONIC`, which Python's
//! `time.monotonic()` also reads); for an engine on another host the tap maps the engine
//! clock onto its own with the smallest observed (receive − send) difference.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;
use rmpv::Value;
use sim_protocol::decode::{DecodedOutputs, decode_input_with, decode_outputs, decode_outputs_for};
use sim_protocol::transport::identity_rank;
use sim_protocol::{
    EngineCoreOutputs, EngineCoreRequest, EventType, FinishReason, InputMessage, ReadyResponse,
    SchedulerStats, VllmLine,
};
use sim_trace::steps::{StepPrefixCache, StepSpecDecoding, StepStats};
use sim_trace::trace::{BlockHash, ItlCtx, TraceMeta, TraceRecord, TraceWriter};

use super::handoff::{Recv, SeenReceiver};
use super::relay::Seen;
use crate::play::engine::block_hash::{self, ExtraKey};
use crate::play::engine::timer::now_monotonic;

/// Meta fields given on the command line (they win over what the engine reports).
#[derive(Debug, Clone, Default)]
pub struct MetaOverrides {
    pub model: Option<String>,
    pub gpu: Option<String>,
    pub tp: Option<u32>,
    pub block_size: Option<u32>,
    pub max_num_seqs: Option<u32>,
    pub config_hash: Option<String>,
    pub host_cpu: Option<sim_trace::host::HostCpu>,
    pub notes: BTreeMap<String, String>,
}

#[derive(Debug, Clone)]
pub struct ObserverConfig {
    pub trace_out: PathBuf,
    pub step_stats_out: Option<PathBuf>,
    pub record_tokens: bool,
    pub meta: MetaOverrides,
    /// Frames larger than this (bytes) are relayed but not decoded (`--max-frame-size`).
    pub max_frame_bytes: usize,
}

/// What the capture wrote.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    pub records: u64,
    pub incomplete: u64,
    pub steps: u64,
    /// Messages the tap relayed but could not decode (relayed unchanged all the same).
    pub undecodable: u64,
    /// Outputs for request ids the tap was not following (e.g. after their abort).
    pub unmatched_outputs: u64,
    /// Records (and step lines) that could not be written (a full disk); relaying went on.
    pub dropped: u64,
    pub dropped_steps: u64,
    /// The first write error, naming the file.
    pub write_error: Option<String>,
}

/// How long written records may sit in the writer's buffer before a flush.
const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// One request being followed.
struct Req {
    engine: u32,
    /// When the tap relayed the ADD.
    relayed: f64,
    /// The engine's QUEUED event, on the tap's clock (the engine-side arrival).
    queued: Option<f64>,
    prompt_tokens: u32,
    cached_tokens: Option<u32>,
    output_tokens: u32,
    first_token: Option<f64>,
    last_chunk: f64,
    itl_ms: Vec<f64>,
    itl_tokens: Vec<u32>,
    num_running: Vec<u32>,
    prefill_tokens: Vec<u32>,
    concurrency: u32,
    block_hashes: Vec<BlockHash>,
    mm_hashes: Vec<String>,
    token_ids: Option<Vec<u32>>,
    error: Option<String>,
}

/// How an engine's timestamps map onto the tap's clock.
#[derive(Debug, Clone, Copy)]
enum Clock {
    /// Same host: the same monotonic clock.
    Same,
    /// Another clock: tap time = engine time + offset (the smallest difference seen).
    Offset(f64),
}

/// Engine timestamps within this distance of the tap's clock are taken to be the same
/// clock (two hosts' monotonic clocks differ by their uptimes, almost never this little).
const SAME_CLOCK_WINDOW_S: f64 = 5.0;

pub struct Observer {
    cfg: ObserverConfig,
    writer: TraceWriter,
    steps: Option<TraceWriter>,
    meta: TraceMeta,
    meta_written: bool,
    block_size: usize,
    line: Option<VllmLine>,
    none_hash: block_hash::BlockHash,
    zero: Option<f64>,
    clocks: HashMap<u32, Clock>,
    running: HashMap<u32, u32>,
    last_step: HashMap<u32, f64>,
    reqs: HashMap<String, Req>,
    summary: Summary,
    dirty: bool,
    last_flush: Instant,
    write_error: Option<anyhow::Error>,
}

impl Observer {
    /// Create the output files now, so a bad path fails before anything connects.
    pub fn create(cfg: ObserverConfig) -> Result<Self> {
        let writer = TraceWriter::create_without_meta(&cfg.trace_out)
            .with_context(|| format!("creating the trace {}", cfg.trace_out.display()))?;
        let steps = match &cfg.step_stats_out {
            Some(p) => Some(
                TraceWriter::create_without_meta(p)
                    .with_context(|| format!("creating the step-stats file {}", p.display()))?,
            ),
            None => None,
        };
        let mut meta = TraceMeta::new();
        let o = &cfg.meta;
        meta.model = o.model.clone();
        meta.gpu = o.gpu.clone();
        meta.tp = o.tp;
        meta.block_size = o.block_size;
        meta.max_num_seqs = o.max_num_seqs;
        meta.config_hash = o.config_hash.clone();
        meta.host_cpu = o.host_cpu.clone().map(Box::new);
        meta.notes = Box::new(o.notes.clone());
        let block_size = o.block_size.unwrap_or(16) as usize;
        Ok(Self {
            cfg,
            writer,
            steps,
            meta,
            meta_written: false,
            block_size,
            line: None,
            none_hash: block_hash::default_none_hash(),
            zero: None,
            clocks: HashMap::new(),
            running: HashMap::new(),
            last_step: HashMap::new(),
            reqs: HashMap::new(),
            summary: Summary::default(),
            dirty: false,
            last_flush: Instant::now(),
            write_error: None,
        })
    }

    /// Consume copies until [`Seen::Stop`] (or until every sender is gone), then close the
    /// files: in-flight requests are written as incomplete, the gzip footer is written and
    /// the files are synced.
    pub fn run(mut self, mut rx: SeenReceiver) -> Result<Summary> {
        let mut batch = Vec::new();
        let mut stopped = None;
        while stopped.is_none() {
            if rx.recv_batch(&mut batch, FLUSH_EVERY) == Recv::Disconnected {
                stopped = Some("the relay stopped".to_string());
            }
            // Anything the relay handed over, even behind a stop, is still observed.
            for seen in batch.drain(..) {
                match seen {
                    Seen::Stop { reason } => {
                        stopped.get_or_insert(reason);
                    }
                    seen => self.handle(seen),
                }
            }
            if self.dirty && self.last_flush.elapsed() >= FLUSH_EVERY {
                self.flush();
            }
        }
        rx.try_recv_all(&mut batch);
        for seen in batch.drain(..) {
            if !matches!(seen, Seen::Stop { .. }) {
                self.handle(seen);
            }
        }
        let reason = stopped.unwrap_or_default();
        self.finish_all(&reason);
        self.close()
    }

    fn close(mut self) -> Result<Summary> {
        self.ensure_meta();
        let Observer {
            cfg,
            writer,
            steps,
            write_error,
            summary,
            ..
        } = self;
        let closed = writer
            .finish()
            .with_context(|| format!("closing the trace {}", cfg.trace_out.display()));
        let steps_closed = match steps {
            Some(w) => w.finish().context("closing the step-stats file"),
            None => Ok(()),
        };
        let mut summary = summary;
        if let Some(e) = write_error {
            // the capture went on: say what was lost, do not lose the counts
            summary.write_error = Some(format!("{e:#}"));
            return Ok(summary);
        }
        if let Err(e) = closed.and(steps_closed) {
            summary.write_error = Some(format!("{e:#}"));
        }
        Ok(summary)
    }

    fn flush(&mut self) {
        let r = self.writer.flush();
        let r2 = match self.steps.as_mut() {
            Some(w) => w.flush(),
            None => Ok(()),
        };
        if let Err(e) = r {
            let what = format!("the trace {}", self.cfg.trace_out.display());
            self.write_failed(&what, e.into());
        }
        if let Err(e) = r2 {
            self.write_failed("the step-stats file", e.into());
        }
        self.dirty = false;
        self.last_flush = Instant::now();
    }

    /// A write to `what` failed: said once (relaying goes on; later losses are counted).
    fn write_failed(&mut self, what: &str, e: anyhow::Error) {
        if self.write_error.is_none() {
            tracing::error!(
                "writing {what} failed: {e:#}; the tap keeps relaying, and counts what cannot be written"
            );
            self.write_error = Some(e.context(format!("writing {what}")));
        }
    }

    fn handle(&mut self, seen: Seen) {
        match seen {
            Seen::Ready {
                engine,
                client,
                payload,
            } => self.on_ready(&engine, client, &payload),
            Seen::Input {
                t,
                engine,
                frames,
                client,
            } => self.on_input(t, client, &engine, &frames),
            Seen::Output { t, frames, .. } => self.on_output(t, &frames),
            Seen::EngineGone { engine } => {
                let rank = identity_rank(&engine).map(u32::from);
                let ids: Vec<String> = self
                    .reqs
                    .iter()
                    .filter(|(_, r)| Some(r.engine) == rank)
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in ids {
                    self.finalize(&id, None, Some("engine disconnected".into()));
                }
            }
            Seen::Streamed { what } => self.undecodable(&what),
            Seen::Stop { .. } => {}
        }
    }

    fn on_ready(&mut self, engine: &[u8], client: usize, payload: &[u8]) {
        if self.meta.ready_response_hex.is_some() {
            return;
        }
        tracing::debug!(client, engine = ?engine, "observing the ready response");
        self.meta.ready_response_hex = Some(hex(payload));
        match ReadyResponse::decode(payload) {
            Ok(r) => {
                if !r.vllm_version.is_empty() {
                    self.meta.vllm_version = Some(r.vllm_version.clone());
                }
                self.line = VllmLine::parse_any(&r.vllm_version).ok();
                let o = &self.cfg.meta;
                self.meta.block_size = o.block_size.or(u32::try_from(r.block_size).ok());
                self.meta.tp = o.tp.or(u32::try_from(r.tensor_parallel_size).ok());
                self.meta.max_num_seqs = o.max_num_seqs.or(u32::try_from(r.max_num_seqs).ok());
                if let Some(bs) = self.meta.block_size.filter(|&b| b > 0) {
                    self.block_size = bs as usize;
                }
                tracing::info!(
                    vllm_version = %r.vllm_version,
                    block_size = self.block_size,
                    num_gpu_blocks = r.num_gpu_blocks,
                    "engine attached"
                );
                // the meta line goes to disk now, so a capture that later fills the disk
                // still leaves a readable trace
                self.ensure_meta();
                self.flush();
            }
            Err(e) => tracing::warn!(
                "cannot decode the engine's ready response ({e}); relayed unchanged, meta keeps only its hex"
            ),
        }
    }

    fn ms(&self, t: f64) -> f64 {
        let ms = (t - self.zero.unwrap_or(t)) * 1000.0;
        (ms * 1000.0).round() / 1000.0
    }

    fn on_input(&mut self, t: f64, client: usize, engine: &[u8], frames: &[Bytes]) {
        let limits = sim_protocol::decode::DecodeLimits {
            max_frame_bytes: self.cfg.max_frame_bytes,
            ..Default::default()
        };
        match decode_input_with(frames, &limits) {
            Ok(InputMessage::Add(req)) => self.on_add(t, engine, &req),
            Ok(InputMessage::Abort(ids)) => {
                for id in ids {
                    if self.reqs.contains_key(&id) {
                        self.finalize(
                            &id,
                            Some(FinishReason::Abort),
                            Some("aborted by the frontend".into()),
                        );
                    }
                }
            }
            Ok(InputMessage::Utility(call)) => {
                tracing::debug!(client, method = %call.method, "utility call relayed");
            }
            Ok(InputMessage::StartDpWave { .. }) => {}
            Err(e) => self.undecodable(&format!("a frontend message on client {client}: {e}")),
        }
    }

    fn undecodable(&mut self, what: &str) {
        self.summary.undecodable += 1;
        if self.summary.undecodable <= 5 {
            tracing::warn!("relayed unchanged but cannot decode {what}");
        }
    }

    fn on_add(&mut self, t: f64, engine: &[u8], req: &EngineCoreRequest) {
        if self.zero.is_none() {
            self.zero = Some(t);
        }
        if self.reqs.contains_key(&req.request_id) {
            self.finalize(
                &req.request_id,
                None,
                Some("replaced by a new request with the same id".into()),
            );
        }
        let block_hashes = match &req.prompt_token_ids {
            Some(ids) => {
                let lora = req.lora_request.as_ref().map(|l| ExtraKey::Lora {
                    name: l.name.clone(),
                    path: l.path.clone(),
                });
                block_hash::chain(
                    &self.none_hash,
                    ids,
                    self.block_size,
                    lora.as_ref(),
                    req.cache_salt.as_deref(),
                )
                .iter()
                .map(|h| BlockHash::Int(block_hash::hash_u64(h)))
                .collect()
            }
            None => Vec::new(),
        };
        let rank = identity_rank(engine)
            .map(u32::from)
            .or_else(|| req.data_parallel_rank.and_then(|r| u32::try_from(r).ok()))
            .unwrap_or(0);
        let concurrency = self.reqs.len() as u32 + 1;
        self.reqs.insert(
            req.request_id.clone(),
            Req {
                engine: rank,
                relayed: t,
                queued: None,
                prompt_tokens: req.prompt_len() as u32,
                cached_tokens: None,
                output_tokens: 0,
                first_token: None,
                last_chunk: t,
                itl_ms: Vec::new(),
                itl_tokens: Vec::new(),
                num_running: Vec::new(),
                prefill_tokens: Vec::new(),
                concurrency,
                block_hashes,
                mm_hashes: mm_hashes(req.mm_features.as_ref()),
                token_ids: self.cfg.record_tokens.then(Vec::new),
                error: None,
            },
        );
    }

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

    fn on_output(&mut self, t: f64, frames: &[Bytes]) {
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

    fn ensure_meta(&mut self) {
        if self.meta_written {
            return;
        }
        // `created_unix_ms` is the wall-clock time of the capture's zero.
        if let Ok(now) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            let since_zero = self
                .zero
                .map_or(0.0, |zero| (now_monotonic() - zero).max(0.0));
            self.meta.created_unix_ms =
                Some((now.as_secs_f64() * 1000.0 - since_zero * 1000.0) as u64);
        }
        if let Err(e) = self.writer.write_meta(&self.meta) {
            let what = format!("the trace {}", self.cfg.trace_out.display());
            self.write_failed(&what, e.into());
        }
        self.meta_written = true;
    }

    /// Write the record of request `id` and stop following it. `finish` is the engine's
    /// finish reason; anything but stop/length (or none at all) makes the record incomplete.
    fn finalize(&mut self, id: &str, finish: Option<FinishReason>, why: Option<String>) {
        let Some(r) = self.reqs.remove(id) else {
            return;
        };
        self.ensure_meta();
        // Engine-side arrival when the engine reported it (its QUEUED event), else the
        // moment the tap relayed the ADD.
        let arrival = r.queued.unwrap_or(r.relayed);
        let complete = matches!(
            finish,
            Some(FinishReason::Stop | FinishReason::Length | FinishReason::Repetition)
        );
        let record = TraceRecord {
            request_id: Some(id.to_string()),
            prompt_tokens: r.prompt_tokens,
            cached_tokens: r.cached_tokens,
            output_tokens: r.output_tokens,
            arrival_ms: Some(self.ms(arrival)),
            sent_ms: Some(self.ms(r.relayed)),
            ttft_ms: r
                .first_token
                .map(|f| (((f - arrival) * 1000.0).max(0.0) * 1000.0).round() / 1000.0),
            itl_ms: r.itl_ms,
            itl_tokens: r.itl_tokens,
            concurrency: Some(r.concurrency),
            itl_ctx: ItlCtx {
                num_running: r.num_running,
                prefill_tokens: r.prefill_tokens,
            },
            block_hashes: r.block_hashes,
            mm_hashes: r.mm_hashes,
            output_token_ids: r.token_ids,
            finish_reason: finish.map(|f| f.as_str().to_string()),
            incomplete: !complete,
            abort_reason: if complete { None } else { why },
            error: r.error,
        };
        if self.write_error.is_some() {
            // after a failed write the writer's state is unknown: count, do not write
            self.summary.dropped += 1;
            return;
        }
        if let Err(e) = self.writer.write_record(&record) {
            let what = format!("the trace {}", self.cfg.trace_out.display());
            self.write_failed(&what, e.into());
            self.summary.dropped += 1;
            self.dirty = true;
            return;
        }
        self.summary.records += 1;
        if !complete {
            self.summary.incomplete += 1;
        }
        self.dirty = true;
    }

    /// Write every request still in flight as incomplete, oldest first.
    fn finish_all(&mut self, reason: &str) {
        let mut ids: Vec<(f64, String)> = self
            .reqs
            .iter()
            .map(|(id, r)| (r.relayed, id.clone()))
            .collect();
        ids.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (_, id) in ids {
            self.finalize(&id, None, Some(reason.to_string()));
        }
    }
}

struct StepCounts {
    outputs: u64,
    new_tokens: u64,
    prefill_requests: u32,
    prefill_tokens: u64,
}

/// One step-stats sidecar line: what the engine reported at the end of the step and what
/// the step's outputs carried.
fn step_stats(
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

/// `mm_hash` (else `identifier`) of every multimodal feature of an ADD.
fn mm_hashes(features: Option<&Value>) -> Vec<String> {
    let Some(Value::Array(items)) = features else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|item| {
            let Value::Map(m) = item else { return None };
            let get = |key: &str| {
                m.iter()
                    .find(|(k, _)| k.as_str() == Some(key))
                    .and_then(|(_, v)| v.as_str())
                    .map(str::to_string)
            };
            get("mm_hash").or_else(|| get("identifier"))
        })
        .collect()
}

fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        s.push(char::from_digit(u32::from(x >> 4), 16).unwrap_or('0'));
        s.push(char::from_digit(u32::from(x & 0xf), 16).unwrap_or('0'));
    }
    s
}

#[cfg(test)]
mod tests {
    use sim_protocol::{PrefixCacheStats, SpecDecodingStats};

    use super::*;

    #[test]
    fn a_step_line_carries_every_scheduler_stat_and_step_count() {
        let stats = SchedulerStats {
            num_running_reqs: 3,
            num_waiting_reqs: 4,
            num_skipped_waiting_reqs: 5,
            step_counter: 6,
            current_wave: 7,
            kv_cache_usage: 0.25,
            prefix_cache_stats: PrefixCacheStats {
                reset: true,
                requests: 8,
                queries: 9,
                hits: 10,
                preempted_requests: 11,
                preempted_queries: 12,
                preempted_hits: 13,
            },
            spec_decoding_stats: Some(SpecDecodingStats {
                num_spec_tokens: 2,
                num_drafts: 3,
                num_draft_tokens: 6,
                num_accepted_tokens: 4,
                num_accepted_tokens_per_pos: vec![3, 1],
                num_draft_tokens_per_pos: vec![3, 3],
            }),
            waiting_lora_adapters: vec![("b".into(), 2)],
            running_lora_adapters: vec![("a".into(), 1), ("c".into(), 3)],
        };
        let step = StepCounts {
            outputs: 14,
            new_tokens: 15,
            prefill_requests: 16,
            prefill_tokens: 17,
        };
        let line = serde_json::to_value(step_stats(1.5, 1, Some(0.5), &stats, &step)).unwrap();
        assert_eq!(
            line,
            serde_json::json!({
                "ts_ms": 1.5, "engine": 1, "step_ms": 0.5, "step_counter": 6, "current_wave": 7,
                "num_running_reqs": 3, "num_waiting_reqs": 4, "num_skipped_waiting_reqs": 5,
                "kv_cache_usage": 0.25, "outputs": 14, "new_tokens": 15,
                "prefill_requests": 16, "prefill_tokens": 17,
                "prefix_cache": {
                    "reset": true, "requests": 8, "queries": 9, "hits": 10,
                    "preempted_requests": 11, "preempted_queries": 12, "preempted_hits": 13,
                },
                "running_lora_adapters": {"a": 1, "c": 3},
                "waiting_lora_adapters": {"b": 2},
                "spec_decoding": {
                    "num_spec_tokens": 2, "num_drafts": 3, "num_draft_tokens": 6,
                    "num_accepted_tokens": 4, "num_accepted_tokens_per_pos": [3, 1],
                    "num_draft_tokens_per_pos": [3, 3],
                },
            })
        );
        // a first step: no step_ms (null), no speculation (no key)
        let first = SchedulerStats {
            spec_decoding_stats: None,
            ..stats
        };
        let line = serde_json::to_value(step_stats(0.0, 0, None, &first, &step)).unwrap();
        assert_eq!(line["step_ms"], serde_json::Value::Null);
        assert!(line.get("spec_decoding").is_none());
    }
}
