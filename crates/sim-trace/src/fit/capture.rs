//! Reading one capture into engine steps.
//!
//! A step is the unit the model is about: its duration, the decodes it ran (how many, the
//! tokens they delivered, their contexts) and the prefills it finished (their uncached
//! tokens and depths). Two sources give steps:
//!
//! * **with the sidecar** each line is a step, with the engine's own duration and running
//!   count; the trace adds what the sidecar lacks — each token time (arrival + TTFT + gaps)
//!   falls on the sidecar line of its step (within [`MATCH_TOL_MS`]), which gives the step
//!   its decodes' contexts and bursts, its first tokens' depths and arrivals, and the
//!   requests that finished in it;
//! * **without it** the steps are rebuilt from the token times alone, in two passes over
//!   the trace: the first collects the distinct token times (times within
//!   [`MATCH_TOL_MS`] of each other are one step), the second matches events to them as
//!   above; the running count comes from the records' per-gap context
//!   (`itl_ctx.num_running`). Steps that emitted nothing (a step that only computed
//!   prefill chunks) are invisible; their time lands on the next step.
//!
//! Either way memory holds the steps (a step and its observation: under 100 bytes), never
//! the tokens.
//!
//! Records without an engine timeline (no `arrival_ms` or `ttft_ms`: converted client-side
//! reports) still give their gaps, each a decode step of `itl_ctx.num_running` decodes, when
//! there is no sidecar.

use std::path::{Path, PathBuf};

use super::error::FitError;
use super::model::ModelSource;
use crate::steps::StepStatsReader;
use crate::trace::{TraceError, TraceItem, TraceReader, TraceRecord, record_name};

/// A capture to fit: a trace (`record --trace-out`) and, optionally, its step-stats sidecar
/// (`record --step-stats-out`). `.gz` files are read transparently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FitInput {
    /// The request trace.
    pub trace: PathBuf,
    /// The step-stats sidecar written by the same capture, if any.
    pub steps: Option<PathBuf>,
}

/// Token times this close to a step's time belong to it. The trace keeps times to the
/// microsecond, and a token time adds up to a few hundred rounded gaps (6 µs apart at
/// most on the fixture); engine steps are milliseconds apart.
pub(crate) const MATCH_TOL_MS: f64 = 0.05;
/// Below this share of token times on a sidecar step, the sidecar is another capture's.
const MIN_MATCHED: f64 = 0.5;
/// `running` is unknown.
pub(crate) const UNKNOWN: u32 = u32::MAX;

/// One engine step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Step {
    /// When its outputs were emitted, ms from the capture's zero.
    pub ts: f64,
    /// Time since the engine's previous step, ms (NaN: unknown).
    pub step_ms: f32,
    /// Time since the earliest arrival among the requests whose first token came in this
    /// step (infinite: none). The step cannot have started before that request arrived, so
    /// after an idle engine its duration is this, not `step_ms`.
    pub since_arrival: f32,
    /// Summed contexts of the decodes (prompt + tokens emitted before the step).
    pub ctx: f32,
    /// Summed depth work of the finished prefills: `((cached + U)² − cached²)/2` each.
    pub depth: f32,
    /// Requests running after the step, as the engine reported ([`UNKNOWN`]).
    pub running: u32,
    /// Decodes that emitted.
    pub decodes: u32,
    /// Tokens those decodes delivered.
    pub tokens: u32,
    /// Requests whose first token came in this step.
    pub firsts: u32,
    /// Their uncached prompt tokens.
    pub prefill: u32,
    /// Requests that emitted their last token in this step.
    pub finished: u32,
    /// Data-parallel rank.
    pub engine: u16,
    /// The engine reported nothing running or waiting before this step (sidecar only): its
    /// `step_ms` includes idle time.
    pub idle_before: bool,
    /// The engine had nothing running or waiting before this step (sidecar only). Unlike
    /// `idle_before`, kept when the trace's arrivals correct the step's duration: how long
    /// the engine sat idle is read from them.
    pub after_idle: bool,
}

impl Step {
    fn at(ts: f64) -> Self {
        Self {
            ts,
            step_ms: f32::NAN,
            since_arrival: f32::INFINITY,
            ctx: 0.0,
            depth: 0.0,
            running: UNKNOWN,
            decodes: 0,
            tokens: 0,
            firsts: 0,
            prefill: 0,
            finished: 0,
            engine: 0,
            idle_before: false,
            after_idle: false,
        }
    }

    fn first(&mut self, e: &FirstEv) {
        self.firsts += 1;
        self.prefill = self.prefill.saturating_add(e.uncached);
        let (c, u) = (f64::from(e.cached), f64::from(e.uncached));
        self.depth += (((c + u) * (c + u) - c * c) / 2.0) as f32;
        self.since_arrival = self.since_arrival.min(e.since_arrival);
        self.finished += u32::from(e.last);
    }

    fn decode(&mut self, e: &DecEv, running: bool) {
        self.decodes += 1;
        self.tokens += e.tokens;
        self.ctx += e.ctx as f32;
        self.finished += u32::from(e.last);
        if running && e.running != UNKNOWN {
            self.running = if self.running == UNKNOWN {
                e.running
            } else {
                self.running.max(e.running)
            };
        }
    }
}

/// A decode step seen only as one request's gap (records without a timeline, no sidecar).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gap {
    pub ms: f32,
    /// Decodes in the step (`itl_ctx.num_running`, else `concurrency`, else 1).
    pub decodes: u32,
    /// Tokens this request received.
    pub tokens: u32,
    /// This request's context.
    pub ctx: u32,
}

/// What one capture holds.
pub(crate) struct Capture {
    /// Steps in time order per engine (sorted by engine, then time).
    pub steps: Vec<Step>,
    /// Gaps of records without a timeline.
    pub gaps: Vec<Gap>,
    /// Decode bursts: `bursts[n - 1]` chunks of `n` tokens.
    pub bursts: Vec<u64>,
    pub source: ModelSource,
}

/// A request's first token.
#[derive(Debug, Clone, Copy)]
struct FirstEv {
    ts_us: i64,
    since_arrival: f32,
    uncached: u32,
    cached: u32,
    last: bool,
}

/// A decode's chunk.
#[derive(Debug, Clone, Copy)]
struct DecEv {
    ts_us: i64,
    ctx: u32,
    tokens: u32,
    /// The last chunk of its request.
    last: bool,
    /// Running count the engine reported for the step ([`UNKNOWN`]).
    running: u32,
}

fn us(ms: f64) -> i64 {
    (ms * 1e3).round() as i64
}

/// Where a record's events go.
trait Sink {
    fn first(&mut self, e: FirstEv);
    fn decode(&mut self, e: DecEv);
}

/// The events of one record with a timeline; `false` when it has none.
fn events(r: &TraceRecord, bursts: &mut Vec<u64>, sink: &mut dyn Sink) -> bool {
    let (Some(arrival), Some(ttft)) = (r.arrival_ms, r.ttft_ms) else {
        return false;
    };
    if !(arrival.is_finite() && ttft.is_finite()) {
        return false;
    }
    let cached = r.cached_tokens.unwrap_or(0).min(r.prompt_tokens);
    let mut t = arrival + ttft;
    sink.first(FirstEv {
        ts_us: us(t),
        since_arrival: ttft as f32,
        uncached: r.prompt_tokens - cached,
        cached,
        last: r.itl_ms.is_empty(),
    });
    let mut ctx = u64::from(r.prompt_tokens) + u64::from(r.first_chunk_tokens().max(1));
    let last = r.itl_ms.len().saturating_sub(1);
    for (i, &gap) in r.itl_ms.iter().enumerate() {
        t += gap;
        let n = r.itl_tokens.get(i).copied().unwrap_or(1).max(1);
        count_burst(bursts, n);
        sink.decode(DecEv {
            ts_us: us(t),
            ctx: ctx.min(u64::from(u32::MAX)) as u32,
            tokens: n,
            last: i == last,
            running: r
                .itl_ctx
                .num_running
                .get(i)
                .map_or(UNKNOWN, |&x| x.min(UNKNOWN - 1)),
        });
        ctx += u64::from(n);
    }
    true
}

fn count_burst(bursts: &mut Vec<u64>, n: u32) {
    let i = n as usize - 1;
    if bursts.len() <= i {
        bursts.resize(i + 1, 0);
    }
    bursts[i] += 1;
}

/// Matches events to steps.
struct OnSteps<'a> {
    steps: &'a mut [Step],
    /// `steps[i].ts` in µs, for the search.
    ts_us: Vec<i64>,
    /// Take the running count from the records (the steps have none of their own).
    running: bool,
    matched: u64,
    total: u64,
}

impl<'a> OnSteps<'a> {
    fn new(steps: &'a mut [Step], running: bool) -> Self {
        Self {
            ts_us: steps.iter().map(|s| us(s.ts)).collect(),
            steps,
            running,
            matched: 0,
            total: 0,
        }
    }

    fn find(&mut self, ts_us: i64) -> Option<usize> {
        self.total += 1;
        let i = self.ts_us.partition_point(|&t| t < ts_us);
        let tol = us(MATCH_TOL_MS);
        let best = [i.checked_sub(1), Some(i)]
            .into_iter()
            .flatten()
            .filter(|&j| j < self.ts_us.len())
            .min_by_key(|&j| (self.ts_us[j] - ts_us).abs())?;
        if (self.ts_us[best] - ts_us).abs() > tol {
            return None;
        }
        self.matched += 1;
        Some(best)
    }
}

impl Sink for OnSteps<'_> {
    fn first(&mut self, e: FirstEv) {
        if let Some(j) = self.find(e.ts_us) {
            self.steps[j].first(&e);
        }
    }
    fn decode(&mut self, e: DecEv) {
        if let Some(j) = self.find(e.ts_us) {
            self.steps[j].decode(&e, self.running);
        }
    }
}

/// Collects the distinct token times: per 10 µs bucket, the earliest time in it.
#[derive(Default)]
struct Times(std::collections::HashMap<i64, i64>);

impl Times {
    fn add(&mut self, ts_us: i64) {
        let e = self.0.entry(ts_us.div_euclid(10)).or_insert(ts_us);
        *e = (*e).min(ts_us);
    }
}

impl Sink for Times {
    fn first(&mut self, e: FirstEv) {
        self.add(e.ts_us);
    }
    fn decode(&mut self, e: DecEv) {
        self.add(e.ts_us);
    }
}

/// Read one capture.
pub(crate) fn read(input: &FitInput) -> Result<Capture, FitError> {
    let mut source = ModelSource {
        trace: input.trace.display().to_string(),
        steps: input.steps.as_ref().map(|p| p.display().to_string()),
        ..ModelSource::default()
    };
    let mut bursts = Vec::new();
    let mut gaps = Vec::new();
    let steps = match &input.steps {
        Some(path) => {
            let mut steps = read_sidecar(path)?;
            source.sidecar_steps = steps.len() as u64;
            let mut sink = OnSteps::new(&mut steps, false);
            // The sidecar's own counts stand until the first record with a timeline: the
            // trace's are better (they see every client's outputs), but a trace without a
            // timeline has none to give.
            let mut timeline = false;
            for_records(&input.trace, &mut source, |r| {
                if r.arrival_ms.is_some() && r.ttft_ms.is_some() && !timeline {
                    timeline = true;
                    for s in sink.steps.iter_mut() {
                        *s = Step {
                            decodes: 0,
                            tokens: 0,
                            firsts: 0,
                            prefill: 0,
                            depth: 0.0,
                            ctx: 0.0,
                            ..*s
                        };
                    }
                }
                events(r, &mut bursts, &mut sink);
            })?;
            let (matched, total) = (sink.matched, sink.total);
            if total > 0 && (matched as f64) < MIN_MATCHED * total as f64 {
                return Err(FitError::Mismatch {
                    trace: input.trace.clone(),
                    steps: path.clone(),
                    matched,
                    total,
                });
            }
            if timeline {
                // without the trace's first tokens there is no arrival to correct with
                for s in &mut steps {
                    s.idle_before = false;
                }
            }
            steps.sort_by(|a, b| a.engine.cmp(&b.engine).then(a.ts.total_cmp(&b.ts)));
            steps
        }
        None => {
            let mut times = Times::default();
            let (mut scratch, mut no_bursts) = (ModelSource::default(), Vec::new());
            for_records(&input.trace, &mut scratch, |r| {
                events(r, &mut no_bursts, &mut times);
            })?;
            let mut steps = steps_at(times);
            let mut sink = OnSteps::new(&mut steps, true);
            for_records(&input.trace, &mut source, |r| {
                if !events(r, &mut bursts, &mut sink) {
                    record_gaps(r, &mut bursts, &mut gaps);
                }
            })?;
            steps
        }
    };
    Ok(Capture {
        steps,
        gaps,
        bursts,
        source,
    })
}

/// Stream the records of a trace, noting its meta in `source`.
fn for_records(
    path: &Path,
    source: &mut ModelSource,
    mut each: impl FnMut(&TraceRecord),
) -> Result<(), FitError> {
    let mut reader = TraceReader::open(path)?;
    while let Some(item) = reader.next() {
        match item? {
            TraceItem::Meta(m) => {
                source.config_hash = source.config_hash.take().or(m.config_hash);
                source.block_size = source.block_size.or(m.block_size);
                source.max_num_seqs = source.max_num_seqs.or(m.max_num_seqs);
                source.vllm_version = source.vllm_version.take().or(m.vllm_version);
            }
            TraceItem::Record(r) => {
                // a latency past a day would make the law absurd (or a draw panic)
                r.check_times().map_err(|why| TraceError::Invalid {
                    path: path.to_path_buf(),
                    line: reader.line(),
                    why: format!("record {}: {why}", record_name(&r, source.records)),
                })?;
                source.records += 1;
                let [lo, hi] = source
                    .prompt_tokens
                    .unwrap_or([r.prompt_tokens, r.prompt_tokens]);
                source.prompt_tokens = Some([lo.min(r.prompt_tokens), hi.max(r.prompt_tokens)]);
                each(&r);
            }
        }
    }
    Ok(())
}

/// The sidecar's lines as steps, with the sidecar's own counts (replaced by the trace's
/// when it has a timeline).
fn read_sidecar(path: &Path) -> Result<Vec<Step>, FitError> {
    let mut steps = Vec::new();
    // per engine: (running, waiting) of its previous step
    let mut before: Vec<Option<(u64, u64)>> = Vec::new();
    let mut reader = StepStatsReader::open(path)?;
    while let Some(s) = reader.next() {
        let s = s?;
        if let Some(ms) = s.step_ms
            && !crate::latency::is_sane_ms(ms)
        {
            return Err(TraceError::Invalid {
                path: path.to_path_buf(),
                line: reader.line(),
                why: format!(
                    "step_ms = {} ms is not a duration an engine takes (at most {} ms, a day)",
                    crate::latency::show_number(ms),
                    crate::latency::MAX_DURATION_MS
                ),
            }
            .into());
        }
        let engine = s.engine.min(u32::from(u16::MAX)) as usize;
        if before.len() <= engine {
            before.resize(engine + 1, None);
        }
        let idle = matches!(before[engine], Some((0, 0)));
        before[engine] = Some((s.num_running_reqs, s.num_waiting_reqs));
        let firsts = s.prefill_requests;
        let mut step = Step::at(s.ts_ms);
        step.step_ms = s
            .step_ms
            .filter(|m| m.is_finite() && *m > 0.0)
            .map_or(f32::NAN, |m| m as f32);
        step.running = s.num_running_reqs.min(u64::from(UNKNOWN - 1)) as u32;
        step.decodes = s.outputs.saturating_sub(u64::from(firsts)) as u32;
        step.tokens = s.new_tokens.saturating_sub(u64::from(firsts)) as u32;
        step.tokens = step.tokens.max(step.decodes);
        step.firsts = firsts;
        step.prefill = s.prefill_tokens.min(u64::from(u32::MAX)) as u32;
        step.engine = engine as u16;
        step.idle_before = idle;
        step.after_idle = idle;
        steps.push(step);
    }
    // sidecar lines come in emission order; several engines may interleave out of order
    steps.sort_by(|a, b| a.ts.total_cmp(&b.ts));
    Ok(steps)
}

/// A record without a timeline: its gaps, each a decode step it took part in.
fn record_gaps(r: &TraceRecord, bursts: &mut Vec<u64>, gaps: &mut Vec<Gap>) {
    let mut ctx = u64::from(r.prompt_tokens) + u64::from(r.first_chunk_tokens().max(1));
    for (i, &ms) in r.itl_ms.iter().enumerate() {
        let n = r.itl_tokens.get(i).copied().unwrap_or(1).max(1);
        count_burst(bursts, n);
        let prefill = r.itl_ctx.prefill_tokens.get(i).copied().unwrap_or(0);
        // a gap whose step also finished prefills: their share of it is unknown
        if prefill == 0 && ms.is_finite() && ms > 0.0 {
            let decodes = r
                .itl_ctx
                .num_running
                .get(i)
                .copied()
                .or(r.concurrency)
                .unwrap_or(1)
                .max(1);
            gaps.push(Gap {
                ms: ms as f32,
                decodes,
                tokens: n,
                ctx: ctx.min(u64::from(u32::MAX)) as u32,
            });
        }
        ctx += u64::from(n);
    }
}

/// Steps at the distinct token times: a time within the tolerance of the previous one is
/// the same step, which is at its earliest time.
fn steps_at(times: Times) -> Vec<Step> {
    let mut t: Vec<i64> = times.0.into_values().collect();
    t.sort_unstable();
    let tol = us(MATCH_TOL_MS);
    let mut steps: Vec<Step> = Vec::new();
    let mut last = i64::MIN;
    for &ts in &t {
        if steps.is_empty() || ts - last > tol {
            let mut s = Step::at(ts as f64 / 1e3);
            if let Some(prev) = steps.last() {
                s.step_ms = (s.ts - prev.ts) as f32;
            }
            steps.push(s);
        }
        last = ts;
    }
    steps
}
