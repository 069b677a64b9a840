//! `inspect simulate`: a trace's workload through the engine, offline, on the virtual
//! clock — no frontend, no sockets, no sleeping. The same `SimEngine` `play` runs (built
//! by the same `PlayConfig` from the same engine flags) is driven by the offline driver;
//! requests are synthesized from the trace's records (`workload.rs`) and sent at their
//! recorded offsets (open loop) or as session turns after their parents finished (closed
//! loop); every finished request becomes a record of the simulated trace (`follow.rs`).
//! It replays a capture, and answers what-if questions about a public workload under other
//! engine settings or another latency model.

pub mod arrivals;
mod follow;
pub mod workload;

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Value, json};
use sim_protocol::{EngineCoreRequest, SamplingParams, VllmLine};
use sim_trace::trace::{TraceMeta, TraceRecord, TraceWriter};

use super::progress::Progress;
use super::summarize::Summary;
use crate::play::EngineArgs;
use crate::play::config::PlayConfig;
use crate::play::engine::offline::OfflineDriver;
use arrivals::Arrivals;
pub use follow::Finished;
use follow::Follower;
use workload::{Sessions, Turn, Workload, duration_ms};

#[derive(Debug, Clone, Args)]
pub struct SimulateArgs {
    /// The trace whose requests to simulate: a capture (`record --trace-out`), or a public
    /// workload converted with `inspect convert` (`.gz` read transparently).
    pub trace: PathBuf,

    #[command(flatten)]
    pub arrivals: ArrivalArgs,

    /// Simulate only the first N requests (in arrival order).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub requests: Option<u64>,

    /// Write the simulated trace here (the capture schema: a meta line with the engine's
    /// configuration, then one record per request, in finish order; `.gz` compresses, `-`
    /// is standard output and sends the summary to standard error).
    #[arg(long, value_name = "PATH")]
    pub dump_trace: Option<PathBuf>,

    /// Write every request's output token ids into the --dump-trace records (like
    /// `record --record-tokens`).
    #[arg(long, requires = "dump_trace")]
    pub record_tokens: bool,

    /// Print the summary as one JSON object.
    #[arg(long)]
    pub json: bool,

    #[command(flatten, next_help_heading = "Engine (the flags of `play`)")]
    pub engine: EngineArgs,
}

/// How the workload arrives, and whether prompts share their prefixes: shared by `inspect
/// simulate` and `inspect calibrate`.
#[derive(Debug, Clone, Args)]
pub struct ArrivalArgs {
    /// Open loop (the default): every request arrives at its recorded `arrival_ms`
    /// offset, whatever the engine does. Records without one arrive at 0.
    #[arg(long, conflicts_with = "replay_sessions")]
    pub replay_arrivals: bool,

    /// Closed loop over sessions inferred from the block-hash chains: a record continues
    /// the latest earlier record whose complete blocks are a prefix of its prompt (the
    /// longest such), and arrives when that parent finished in the simulation plus the
    /// recorded think gap (its arrival − the parent's recorded arrival, TTFT and gaps;
    /// ≥ 0). Records that continue none arrive at their recorded offset.
    #[arg(long)]
    pub replay_sessions: bool,

    /// No prefix reuse between requests: every block of every prompt is unique to its
    /// request (the workload without its shared prefixes).
    #[arg(long)]
    pub cold_prompts: bool,

    /// Closed loop at N requests in flight, as a load generator with a concurrency cap
    /// (`bench serve --max-concurrency N`) sends them: in arrival order, the first N (and
    /// any before the capture first had N in flight) when the load generator sent them
    /// (a record's arrival is its engine's QUEUED time; one queued within 1 ms of an
    /// earlier one's first token was sent with that one), or when a slot frees if later;
    /// then each next one the moment a request finishes in the simulation (plus
    /// --replay-think-ms; the recorded arrivals of the later requests are not used). `auto`: N is the capture's concurrency — the largest of the
    /// records' `concurrency`, else the most requests in flight at once by the recorded
    /// arrivals and ends. With --replay-sessions, N counts sessions, as a multi-turn load
    /// generator keeps N conversations going: the first N sessions start at their
    /// recorded offsets, each next one when a session's last turn finishes (plus
    /// --replay-think-ms); `auto` is then the most sessions in flight at once in the
    /// capture (a session spans its first arrival to its last recorded end).
    #[arg(
        long,
        value_name = "N|auto",
        value_parser = parse_replay_concurrency,
        conflicts_with = "replay_arrivals"
    )]
    pub replay_concurrency: Option<ReplayConcurrency>,

    /// With --replay-concurrency: the time from a finish to the next request's (or
    /// session's) arrival at the engine. Default: the capture's own turnaround when its
    /// tap recorded each send (`sent_ms`): the median time from a finish to the next send,
    /// plus the time a send took to reach an idle engine — a few ms, enough that the next
    /// request misses the step that starts as the last one finishes, as on the real
    /// engine; 0 for traces without sends (and for sessions, whose turns keep their own
    /// recorded gaps). `calibrate-e2e` sends through a real frontend, which takes its own
    /// turnaround: there the default is 0.
    #[arg(long, value_name = "MS", requires = "replay_concurrency", value_parser = parse_think_ms)]
    pub replay_think_ms: Option<f64>,
}

fn parse_think_ms(s: &str) -> std::result::Result<f64, String> {
    let max = sim_trace::latency::MAX_DURATION_MS;
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=max).contains(&v) => Ok(v),
        _ => Err(format!("`{s}` is not a time in ms from 0 to {max} (a day)")),
    }
}

/// `--replay-concurrency`: a number of requests in flight, or the capture's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReplayConcurrency {
    Fixed(usize),
    Auto,
}

fn parse_replay_concurrency(s: &str) -> std::result::Result<ReplayConcurrency, String> {
    if s.eq_ignore_ascii_case("auto") {
        return Ok(ReplayConcurrency::Auto);
    }
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(ReplayConcurrency::Fixed(n)),
        _ => Err(format!(
            "`{s}` is not a number of requests in flight (1 or more) or `auto`"
        )),
    }
}

impl ArrivalArgs {
    /// Resolve the arrival mode for `work` (printing notes on it) into run options.
    pub fn options(&self, work: &Workload, engine: &EngineArgs) -> Result<RunOptions> {
        let concurrency = self.resolve(work)?;
        notes(self.replay_sessions, work, engine);
        let think = match (self.replay_think_ms, concurrency) {
            (None, Some(c)) if !self.replay_sessions => {
                duration_ms(work.turnaround_ms(work.ramp(c)).unwrap_or(0.0))
            }
            _ => self.think(),
        };
        Ok(RunOptions {
            replay_sessions: self.replay_sessions,
            concurrency,
            think,
            cold_prompts: self.cold_prompts,
            hash_blocks: None,
            record_tokens: false,
        })
    }

    /// The arrival mode, for `--json`: `sessions`, `concurrency` or `recorded`.
    pub fn mode(&self, concurrency: Option<usize>) -> &'static str {
        if self.replay_sessions {
            if concurrency.is_some() {
                "sessions-concurrency"
            } else {
                "sessions"
            }
        } else if concurrency.is_some() {
            "concurrency"
        } else {
            "recorded"
        }
    }

    /// The number of requests in flight for `work`, when closed loop.
    pub fn resolve(&self, work: &Workload) -> Result<Option<usize>> {
        Ok(match self.replay_concurrency {
            None => None,
            Some(ReplayConcurrency::Fixed(n)) => Some(n),
            Some(ReplayConcurrency::Auto) if self.replay_sessions => Some(
                Sessions::of(&work.sessions())
                    .captured_concurrency(work)
                    .context(
                        "--replay-concurrency auto: the trace tells no session concurrency (no record has both an arrival_ms and a ttft_ms): pass a number",
                    )?,
            ),
            Some(ReplayConcurrency::Auto) => Some(work.captured_concurrency().context(
                "--replay-concurrency auto: the trace tells no concurrency (no record has `concurrency`, nor both an arrival_ms and a ttft_ms): pass a number",
            )?),
        })
    }

    /// The time from a finish to the next arrival.
    pub fn think(&self) -> Duration {
        duration_ms(self.replay_think_ms.unwrap_or(0.0))
    }

    /// The report's words for the arrivals: `closed loop, N in flight (…)`.
    pub fn describe(&self, n: usize, think: Duration) -> String {
        let how = match self.replay_concurrency {
            Some(ReplayConcurrency::Auto) => " (auto: the capture's)",
            _ => "",
        };
        let ms = think.as_secs_f64() * 1e3;
        let when = match self.replay_think_ms {
            Some(t) if t > 0.0 => format!("{t} ms after one finishes"),
            None if ms > 0.0 => format!("{ms:.2} ms after one finishes (the capture's turnaround)"),
            _ => "when one finishes".to_string(),
        };
        if self.replay_sessions {
            return format!(
                "closed loop over sessions, {n} in flight{how}, each next session {when}"
            );
        }
        format!("closed loop, {n} in flight{how}, each next request {when}")
    }
}

/// What a run counted, beyond the records' own summary.
pub struct Counts {
    pub requests: usize,
    /// `--replay-sessions`: (roots, turns, turns without a recorded gap).
    pub sessions: Option<(usize, usize, usize)>,
    pub preemptions: u64,
    pub not_finished: u64,
    pub never_sent: u64,
    /// Refused before the engine ([`Limits`]).
    pub rejected: u64,
    /// The engine's own description (its latency model, queue, …).
    pub describe: String,
    /// The replay counts, when replaying (`--replay-tokens`, `--replay-steps`).
    pub replay: Option<(String, Value)>,
}

/// How a run sends the workload, and what its records carry.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Closed loop over sessions (`--replay-sessions`) instead of the recorded arrivals.
    pub replay_sessions: bool,
    /// Closed loop at this many requests in flight (`--replay-concurrency`): the first
    /// ones at their recorded offsets, each next one when a request finishes.
    pub concurrency: Option<usize>,
    /// With `concurrency`: from a finish to the next request's arrival.
    pub think: Duration,
    /// No prefix reuse between requests (`--cold-prompts`).
    pub cold_prompts: bool,
    /// Write each prompt's vLLM block hashes into its record, at this block size (a
    /// SHA-256 per block: only when the records are written out).
    pub hash_blocks: Option<usize>,
    /// Write each request's output token ids into its record.
    pub record_tokens: bool,
}

/// The engine flags a run of `work` uses: `engine`, with the trace's block size, and its
/// engine's `max_num_seqs` and `max_num_batched_tokens` (from the ready response a capture
/// keeps in its meta), unless the flags say otherwise; and without prefix caching when the
/// capture shows its engine had none ([`Workload::captured_without_prefix_caching`]).
pub fn engine_for(work: &Workload, engine: &EngineArgs) -> EngineArgs {
    let mut engine = engine.clone();
    engine
        .block_size
        .get_or_insert(work.trace_block_size as u64);
    let captured = work.captured_engine();
    let mut taken = Vec::new();
    if engine.max_num_seqs.is_none()
        && let Some(n) = captured
            .as_ref()
            .map(|r| r.max_num_seqs)
            .or(work.meta.max_num_seqs.map(u64::from))
            .filter(|&n| n > 0)
    {
        engine.max_num_seqs = Some(n);
        taken.push(format!("--max-num-seqs {n}"));
    }
    if engine.max_num_batched_tokens.is_none()
        && let Some(n) = captured
            .as_ref()
            .map(|r| r.max_num_batched_tokens)
            .filter(|&n| n > 0)
    {
        engine.max_num_batched_tokens = Some(n);
        taken.push(format!("--max-num-batched-tokens {n}"));
    }
    if !taken.is_empty() {
        crate::errln!(
            "note: the capture's scheduler settings: {} (give the flags to override)",
            taken.join(" ")
        );
    }
    if !engine.no_enable_prefix_caching
        && !engine.enable_prefix_caching
        && work.captured_without_prefix_caching()
    {
        crate::errln!(
            "note: the capture's engine ran without prefix caching (no prompt token came from its cache, though {} requests began with a block an earlier one had): simulating with --no-enable-prefix-caching",
            work.sharing_requests()
        );
        engine.no_enable_prefix_caching = true;
    }
    engine
}

/// A simulated run held in memory: what each request's record became, by arrival-order
/// index (`None` for a request never sent: a turn whose parent never finished).
pub struct Simulated<T = TraceRecord> {
    pub records: Vec<Option<T>>,
    pub counts: Counts,
}

/// Run `work` through an engine built from `engine` (see [`engine_for`]) and keep the
/// records in memory, indexed by arrival order. What `inspect simulate` does without
/// writing anything.
pub fn simulate_records(
    work: &Workload,
    engine: &EngineArgs,
    opts: &RunOptions,
) -> Result<Simulated> {
    simulate_map(work, engine, opts, |r| r)
}

/// [`simulate_records`], keeping only what `keep` makes of each record as its request
/// finishes (`inspect calibrate` keeps its latencies, not the whole record).
pub fn simulate_map<T>(
    work: &Workload,
    engine: &EngineArgs,
    opts: &RunOptions,
    mut keep: impl FnMut(TraceRecord) -> T,
) -> Result<Simulated<T>> {
    let cfg = PlayConfig::offline(engine)?;
    let mut records: Vec<Option<T>> = std::iter::repeat_with(|| None)
        .take(work.reqs.len())
        .collect();
    let counts = run_workload(work, &cfg, opts, |f| {
        records[f.index] = Some(keep(f.record));
        Ok(())
    })?;
    Ok(Simulated { records, counts })
}

pub fn run(a: &SimulateArgs) -> Result<()> {
    let started = Instant::now();
    let to_stdout = a.dump_trace.as_ref().is_some_and(|p| p.as_os_str() == "-");
    if to_stdout && a.json {
        bail!("--json and `--dump-trace -` both write to standard output: pick one");
    }
    if let Some(out) = &a.dump_trace {
        let mut inputs = vec![named("the trace", &a.trace)];
        inputs.extend(engine_inputs(&a.engine));
        check_outputs(&inputs, &[named("--dump-trace", out)])?;
    }
    let work = Workload::load(&a.trace, a.engine.block_size, a.requests)
        .with_context(|| format!("reading {}", a.trace.display()))?;
    let other_config = crate::inspect::fit_config::other_config(
        work.meta.config_hash.as_deref(),
        &crate::inspect::fit_config::fit_set_hashes(&a.engine.latency_trace)?,
    );
    if let Some(o) = &other_config {
        crate::errln!("simulate: WARNING: {}", o.describe());
    }
    let engine = engine_for(&work, &a.engine);
    let block_size = engine.block_size_or_default();
    let opts = RunOptions {
        hash_blocks: a.dump_trace.is_some().then_some(block_size as usize),
        record_tokens: a.record_tokens,
        ..a.arrivals.options(&work, &engine)?
    };
    let concurrency = opts.concurrency;
    let think = opts.think;
    let cfg = PlayConfig::offline(&engine)?;
    let mut sink = Sink::open(a, &work.meta, &cfg)?;

    let mut summary = Summary::new();
    summary.meta = Some(sink.meta.clone());
    let counts = run_workload(&work, &cfg, &opts, |f| {
        summary.add(&f.record);
        sink.write(&f.record)
    })?;
    sink.finish()?;
    let wall = started.elapsed().as_secs_f64();

    let report = Report {
        args: a,
        other_config,
        concurrency,
        think,
        work: &work,
        summary: &summary,
        counts: &counts,
        block_size,
        wall,
    };
    if a.json {
        // one write, so a closed pipe is an io error (`inspect … | head` ends quietly)
        let text = serde_json::to_string_pretty(&report.json())?;
        writeln!(std::io::stdout().lock(), "{text}")?;
    } else if to_stdout {
        report.write_text(&mut std::io::stderr().lock())?;
    } else {
        report.write_text(&mut std::io::stdout().lock())?;
    }
    Ok(())
}

/// The run itself: send every request when it is due, drive the engine from event to
/// event, and hand every record to `on_record` as its request finishes (refused and
/// abandoned requests too, as incomplete records).
pub fn run_workload(
    work: &Workload,
    cfg: &PlayConfig,
    opts: &RunOptions,
    mut on_record: impl FnMut(Finished) -> Result<()>,
) -> Result<Counts> {
    let n = work.reqs.len();
    let line = cfg.line;
    let ids = cfg.engine.token_ids.clone();
    let mut arrivals = Arrivals::new(work, opts);

    let mut driver = OfflineDriver::new(cfg.build_engine(0));
    let mut follower = Follower::new(
        opts.hash_blocks,
        opts.record_tokens,
        crate::play::engine::timer::instant_to_monotonic(driver.origin()),
    );
    let mut finished = Vec::new();
    let mut progress = Progress::new("simulate:");
    let mut done = 0usize;
    let mut rejected = 0u64;
    let limits = Limits {
        max_model_len: cfg.engine.max_model_len,
        kv_tokens: cfg.engine.num_gpu_blocks.saturating_sub(1) * cfg.engine.block_size,
    };
    let mut record = |f: Finished, arrivals: &mut Arrivals| -> Result<()> {
        arrivals.finished(f.index, f.at);
        on_record(f)
    };
    loop {
        let next = match (arrivals.next_due(), driver.next_event()) {
            (Some(x), Some(y)) => x.min(y),
            (x, y) => match x.or(y) {
                Some(t) => t,
                None => break,
            },
        };
        while let Some((at, i)) = arrivals.pop_due(next) {
            let p = &work.reqs[i];
            if let Some(why) = limits.refuse(p.prompt_tokens.max(1), p.output_tokens.max(1)) {
                rejected += 1;
                done += 1;
                let f = follow::rejected(i, at, p.prompt_tokens.max(1), why);
                record(f, &mut arrivals)?;
                continue;
            }
            let prompt = work.prompt(i, ids.clone(), opts.cold_prompts);
            let req = request(i, prompt, work.reqs[i].output_tokens, line, at);
            follower.arrive(i, at, &req);
            driver.add(at, 0, req);
        }
        for out in driver.run_until(next) {
            follower.absorb(&out, &mut finished);
        }
        for f in finished.drain(..) {
            done += 1;
            record(f, &mut arrivals)?;
        }
        progress.status(|| {
            format!(
                "{done}/{n} requests, {} in flight, {:.1} s simulated",
                follower.in_flight(),
                driver.now().as_secs_f64()
            )
        });
    }
    // Requests the engine could not finish (nothing left to happen, yet they are still
    // in flight): written incomplete; turns that continue them are never sent.
    let not_finished = follower.in_flight() as u64;
    if not_finished > 0 {
        let why = "the engine could not finish it";
        follower.abandon_all(driver.now(), why, &mut finished);
        for f in finished.drain(..) {
            done += 1;
            on_record(f)?;
        }
        crate::errln!(
            "warning: {not_finished} request(s) never finished; they are written incomplete"
        );
    }
    if rejected > 0 {
        crate::errln!(
            "warning: {rejected} request(s) refused before the engine (longer than --max-model-len, or than the KV cache); they are written incomplete with the reason"
        );
    }
    progress.finish_status(&format!("{done}/{n} requests"));
    let turns = arrivals.turns();
    let sessions = opts.replay_sessions.then(|| {
        let roots = turns.iter().filter(|t| **t == Turn::Root).count();
        let untimed = turns
            .iter()
            .filter(|t| matches!(t, Turn::NotBefore { .. }))
            .count();
        (roots, n - roots, untimed)
    });
    let engine = driver.into_engine();
    let counts = Counts {
        requests: n,
        sessions,
        preemptions: follower.preemptions,
        not_finished,
        never_sent: (n - done) as u64,
        rejected,
        describe: engine.describe(),
        replay: engine.replay_summary(),
    };
    Ok(counts)
}

/// What a request may ask for. A frontend refuses a request longer than the model's
/// context (`--max-model-len`, prompt plus `max_tokens`), and vLLM does not start with a
/// context longer than its KV cache, so no request it serves is longer than that either:
/// the engine would queue it forever (first come, first served: with everything behind
/// it).
struct Limits {
    max_model_len: u64,
    kv_tokens: u64,
}

impl Limits {
    fn refuse(&self, prompt: u32, output: u32) -> Option<String> {
        let total = u64::from(prompt) + u64::from(output);
        if total > self.max_model_len {
            return Some(format!(
                "refused as a frontend would: {prompt} prompt + {output} output tokens exceed the maximum model length {} (--max-model-len, capped at what the KV cache holds)",
                self.max_model_len
            ));
        }
        (total > self.kv_tokens).then(|| {
            format!(
                "refused: {prompt} prompt + {output} output tokens do not fit the KV cache of {} tokens ((--num-gpu-blocks − 1) × --block-size; vLLM does not start with a --max-model-len above it)",
                self.kv_tokens
            )
        })
    }
}

/// The engine-side request a record becomes: named `replay-<i>` (its arrival-order
/// index, what `--replay-match index` looks up), generating exactly the recorded number
/// of tokens (`ignore_eos`; at least one, as vLLM requires).
fn request(
    i: usize,
    prompt: Vec<u32>,
    output_tokens: u32,
    line: VllmLine,
    at: Duration,
) -> EngineCoreRequest {
    let id = format!("replay-{i}");
    EngineCoreRequest {
        request_id: id.clone(),
        prompt_token_ids: Some(prompt),
        sampling_params: Some(SamplingParams {
            max_tokens: Some(output_tokens.max(1)),
            ignore_eos: true,
            output_kind: 1,
            ..Default::default()
        }),
        arrival_time: at.as_secs_f64(),
        external_req_id: Some(id),
        wire_len: line.request_len(),
        ..Default::default()
    }
}

/// Notes on stderr about what a run of `work` on `engine` assumes.
pub fn notes(replay_sessions: bool, work: &Workload, engine: &EngineArgs) {
    let note = |s: &str| crate::errln!("note: {s}");
    let bs = engine.block_size_or_default();
    if work.trace_block_size as u64 != bs {
        note(&format!(
            "the trace's block hashes are per {} tokens and the engine's blocks {bs}: prompts share what they shared in the trace, and the engine reuses the whole {bs}-token blocks inside it",
            work.trace_block_size
        ));
    }
    if let Some(m) = work.meta.max_num_seqs
        && u64::from(m) != engine.max_num_seqs_or_default()
    {
        note(&format!(
            "the trace was captured with max_num_seqs {m}; simulating with --max-num-seqs {}",
            engine.max_num_seqs_or_default()
        ));
    }
    if work.without_arrival > 0 {
        note(&format!(
            "{} of {} records have no arrival_ms: they arrive at 0, after every timed request in the naming order{}",
            work.without_arrival,
            work.reqs.len(),
            if replay_sessions {
                " (as session roots; as turns, when their parent finished)"
            } else {
                ""
            }
        ));
    }
    let knobs = engine.knobs();
    let paced = !engine.latency_trace.is_empty()
        || engine.replay_steps.is_some()
        || knobs.ttft_ms > 0.0
        || knobs.itl_ms > 0.0
        || knobs.prefill_overhead_ms > 0.0
        || knobs.prefill_per_token_ms > 0.0;
    if !paced {
        note(
            "no latency model: every step is instant (pass --latency-trace MODEL, or --time-to-first-token / --inter-token-latency)",
        );
    }
}

use crate::io_guard::{check_outputs, named};
use crate::play::artifacts::engine_inputs;

/// Where simulated records go: the `--dump-trace` file, if any.
struct Sink {
    meta: TraceMeta,
    writer: Option<TraceWriter>,
    path: Option<PathBuf>,
}

impl Sink {
    fn open(a: &SimulateArgs, source: &TraceMeta, cfg: &PlayConfig) -> Result<Self> {
        let e = &cfg.engine;
        let mut meta = TraceMeta::new();
        meta.model = source.model.clone();
        meta.gpu = Some("simulated".to_string());
        meta.block_size = u32::try_from(e.block_size).ok();
        meta.max_num_seqs = u32::try_from(cfg.max_num_seqs).ok();
        meta.vllm_version = Some(
            crate::compat::tag_for(cfg.line)
                .trim_start_matches('v')
                .to_string(),
        );
        meta.ready_response_hex = Some(hex(&cfg.ready_response(0).encode()));
        let writer = match &a.dump_trace {
            Some(p) => Some(
                TraceWriter::create(p, &meta)
                    .with_context(|| format!("creating --dump-trace {}", p.display()))?,
            ),
            None => None,
        };
        Ok(Self {
            meta,
            writer,
            path: a.dump_trace.clone().filter(|p| p.as_os_str() != "-"),
        })
    }

    fn write(&mut self, r: &sim_trace::trace::TraceRecord) -> Result<()> {
        if let Some(w) = self.writer.as_mut() {
            w.write_record(r)?;
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        if let Some(w) = self.writer.take() {
            w.finish()?;
        }
        self.path = None;
        Ok(())
    }
}

impl Drop for Sink {
    /// A run that failed leaves no half-written trace behind.
    fn drop(&mut self) {
        if let Some(p) = self.path.take() {
            drop(self.writer.take());
            let _ = std::fs::remove_file(p);
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Everything the summary shows.
struct Report<'a> {
    args: &'a SimulateArgs,
    /// The latency model was fitted under another configuration than the trace's.
    other_config: Option<crate::inspect::fit_config::OtherConfig>,
    /// `--replay-concurrency`, resolved.
    concurrency: Option<usize>,
    /// The closed loop's turnaround, resolved.
    think: Duration,
    work: &'a Workload,
    summary: &'a Summary,
    counts: &'a Counts,
    block_size: u64,
    wall: f64,
}

impl Report<'_> {
    fn simulated_ms(&self) -> Option<f64> {
        self.summary.duration_ms()
    }

    fn output_tokens_per_s(&self) -> Option<f64> {
        let d = self.simulated_ms()?;
        (d > 0.0).then(|| self.summary.output_tokens.sum() / (d / 1000.0))
    }

    fn speedup(&self) -> Option<f64> {
        let d = self.simulated_ms()?;
        (self.wall > 0.0).then(|| d / 1000.0 / self.wall)
    }

    fn json(&self) -> Value {
        let c = self.counts;
        json!({
            "trace": self.args.trace,
            "records_in_trace": self.work.records_in_trace,
            "requests": c.requests,
            "arrivals": self.args.arrivals.mode(self.concurrency),
            "replay_concurrency": self.concurrency,
            "sessions": c.sessions.map(|(roots, turns, untimed)| json!({
                "roots": roots, "turns": turns, "turns_without_recorded_gap": untimed,
            })),
            "cold_prompts": self.args.arrivals.cold_prompts,
            "engine": c.describe,
            "block_size": self.block_size,
            "trace_block_size": self.work.trace_block_size,
            "simulated_ms": self.simulated_ms(),
            "wall_s": self.wall,
            "speedup": self.speedup(),
            "output_tokens_per_s": self.output_tokens_per_s(),
            "preemptions": c.preemptions,
            "prefix_cache_hit_ratio": self.summary.prefix_cache_hit_ratio(),
            "rejected": c.rejected,
            "not_finished": c.not_finished,
            "never_sent": c.never_sent,
            "replay": c.replay.as_ref().map(|r| &r.1),
            "dump_trace": self.args.dump_trace,
            "other_configuration": self.other_config.is_some(),
            "config_hashes": self.other_config.as_ref().map(|o| o.json()),
            "summary": self.summary.to_json(),
        })
    }

    fn write_text(&self, out: &mut impl Write) -> std::io::Result<()> {
        let c = self.counts;
        let mut how = match c.sessions {
            Some((roots, turns, untimed)) => format!(
                "sessions: {roots} root(s), {turns} turn(s) after their parent{}",
                if untimed > 0 {
                    format!(" ({untimed} without a recorded think gap)")
                } else {
                    String::new()
                }
            ),
            None => match self.concurrency {
                Some(c) => self.args.arrivals.describe(c, self.think),
                None => "arrivals at their recorded offsets".to_string(),
            },
        };
        if self.args.arrivals.cold_prompts {
            how += "; cold prompts";
        }
        writeln!(
            out,
            "simulated: {} ({} of {} records; {how})",
            self.args.trace.display(),
            c.requests,
            self.work.records_in_trace
        )?;
        writeln!(out, "{}", c.describe)?;
        if let Some(o) = &self.other_config {
            writeln!(out, "WARNING: {}", o.describe())?;
        }
        self.summary.write_text(out)?;
        let f = |v: Option<f64>, d: usize| v.map_or("-".to_string(), |x| format!("{x:.d$}"));
        writeln!(
            out,
            "throughput: {} output tok/s; preemptions: {}",
            f(self.output_tokens_per_s(), 1),
            c.preemptions
        )?;
        if c.rejected > 0 || c.not_finished > 0 || c.never_sent > 0 {
            writeln!(
                out,
                "refused before the engine: {}; not finished: {}; never sent: {} (their parent never finished)",
                c.rejected, c.not_finished, c.never_sent
            )?;
        }
        if let Some((line, _)) = &c.replay {
            writeln!(out, "replay: {line}")?;
        }
        writeln!(
            out,
            "wall: {:.2} s for {} s simulated ({}× real time)",
            self.wall,
            f(self.simulated_ms().map(|d| d / 1000.0), 1),
            f(self.speedup(), 0)
        )?;
        Ok(())
    }
}
