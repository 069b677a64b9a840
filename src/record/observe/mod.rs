//! The observing half of the tap: decodes the copies the relay hands over, follows each
//! request from its ADD to its finish, and writes one trace record per request (and, with
//! `--step-stats-out`, one line per engine step with the `SchedulerStats` it reported).
//!
//! Runs on its own thread, fed by an unbounded queue ([`super::handoff`]): however slow
//! decoding or the disk is, the relay never waits for it. The observer's methods are
//! split by what they handle: `inputs` (the ready response and ADDs), `outputs` (engine
//! steps) and `records` (the meta line and each finished request).
//!
//! Times. All trace times are milliseconds from the capture's zero, the moment the tap
//! relayed the first ADD. Every time in a record is the engine's own: a request arrives
//! when the engine queued it (the QUEUED event of its first output; engines that report
//! no events fall back to the moment the tap relayed the ADD), and each output chunk is
//! timed by the engine's timestamp of the step that produced it.
//! On one host the engine's clock is the tap's (`CLOCK_MONOTONIC`, which Python's
//! `time.monotonic()` also reads); for an engine on another host the tap maps the engine
//! clock onto its own with the smallest observed (receive − send) difference.

mod inputs;
mod outputs;
mod records;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use sim_protocol::VllmLine;
use sim_protocol::transport::identity_rank;
use sim_trace::trace::{BlockHash, TraceMeta, TraceWriter};

use super::handoff::{RELEASE_EVERY, Recv, Seen, SeenReceiver};
use crate::play::content::reasoning_count::{ThinkingCount, ThinkingMarkers};
use crate::play::engine::block_hash;

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
    /// The thinking markers each answer's `reasoning_tokens` is counted by
    /// (`--reasoning-format`); `None`: not counted.
    pub thinking: Option<std::sync::Arc<ThinkingMarkers>>,
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
    /// Its thinking so far, when the capture counts it.
    thinking: Option<ThinkingCount>,
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
            let mut decoded = 0;
            for seen in batch.drain(..) {
                decoded += seen.bytes();
                match seen {
                    Seen::Stop { reason } => {
                        stopped.get_or_insert(reason);
                    }
                    seen => self.handle(seen),
                }
                if decoded >= RELEASE_EVERY {
                    rx.release_some(std::mem::take(&mut decoded));
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

    fn ms(&self, t: f64) -> f64 {
        let ms = (t - self.zero.unwrap_or(t)) * 1000.0;
        (ms * 1000.0).round() / 1000.0
    }
}

#[cfg(test)]
mod tests {
    use sim_protocol::{PrefixCacheStats, SchedulerStats, SpecDecodingStats};

    use super::outputs::{StepCounts, step_stats};

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
            connector_prefix_cache_stats: None,
            kv_connector_stats: None,
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
