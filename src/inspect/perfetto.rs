//! `inspect perfetto`: a trace (and its step-stats sidecar) as Chrome Trace Event JSON,
//! which the Perfetto UI (and chrome://tracing) opens.
//!
//! Layout:
//! - process 1, the requests: each request is a `prefill` span (arrival → first token)
//!   followed by one `decode` span per inter-token gap (`decode xN` when a step delivered N
//!   tokens). Requests are packed into reusable lanes (a lane frees when its request ends,
//!   so there are as many lanes as the peak concurrency), or one named row per request
//!   with `--track-per-request`. Counter tracks: `active_requests` (swept from the spans),
//!   `engine_running` and `prefill_tokens` (the records' per-gap engine context).
//! - process 2 (and 2 + N for data-parallel engine N), the engine steps (with
//!   `--step-stats`): one span per scheduler step, back to back, named by what it ran, and
//!   counters `sched_running_reqs`, `sched_waiting_reqs`, `sched_kv_cache_usage`,
//!   `sched_accept_rate` (when drafting).
//!
//! Memory. Records come in finish order, but lanes must be packed in arrival order and
//! counters emitted in time order. Two passes over the trace:
//! 1. keeps 36 bytes per request and nothing else: (arrival, end, index) to sort and pack
//!    lanes in arrival order (dropped after packing), the lane of each record, and for each
//!    record index the earliest arrival among the records from that index on;
//! 2. streams the records again and writes their spans as it goes. Counter samples go
//!    through small min-heaps that are drained up to the earliest arrival of the records
//!    not read yet: no later record can put a sample before it, so what is drained is
//!    final and in time order. The heaps hold only the samples of the requests in flight
//!    around the read position (a request that is still running when later ones finish
//!    holds the drain back until it is read).
//!
//! The sidecar is streamed once; its counters go through a bounded reorder buffer (lines
//! are written in time order per engine; the buffer absorbs interleaving between engines).

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Serialize;
use serde_json::{Map, Value, json};
use sim_trace::steps::StepStatsReader;
use sim_trace::trace::{TraceItem, TraceReader, TraceRecord};

use super::progress::Progress;

/// The only port the hosted UI (ui.perfetto.dev) may fetch from: its Content-Security-Policy
/// allows `http://127.0.0.1:9001` (trace_processor's port, which Perfetto's own
/// `open_trace_in_ui` script reuses for this reason).
pub const PERFETTO_UI_PORT: u16 = 9001;

#[derive(Debug, Clone, Args)]
pub struct PerfettoArgs {
    /// The trace (JSONL; `.gz` read transparently). Read twice, so it must be a file.
    pub trace: PathBuf,

    /// Write the Chrome Trace Event JSON here (`.gz` suffix → gzip). Default: stdout, or
    /// an unlinked temporary file with `--open`.
    #[arg(short, long, value_name = "PATH")]
    pub output: Option<PathBuf>,

    /// Overlay the step-stats sidecar written by `record --step-stats-out` (`.gz` ok):
    /// scheduler counters and a track of engine steps.
    #[arg(long, value_name = "PATH")]
    pub step_stats: Option<PathBuf>,

    /// Label of the requests' process row (default: the trace's meta model).
    #[arg(long, value_name = "LABEL")]
    pub name: Option<String>,

    /// One row per request, named by its request id, instead of packed lanes (for small
    /// traces: a row per request is hard to read beyond a few hundred).
    #[arg(long)]
    pub track_per_request: bool,

    /// Serve the file on 127.0.0.1 with CORS for the hosted Perfetto UI, print the
    /// ui.perfetto.dev URL that opens it, and block until Ctrl-C.
    #[arg(long)]
    pub open: bool,

    /// Port for `--open`. The hosted UI's Content-Security-Policy only lets it fetch from
    /// 127.0.0.1:9001; another port (0: any free port) suits a self-hosted UI or curl.
    #[arg(long, value_name = "N", default_value_t = PERFETTO_UI_PORT)]
    pub port: u16,

    /// Print a JSON summary on stdout: events written, lanes, requests placed, requests
    /// without arrival_ms, steps. Only when the trace goes to a file (`-o` or `--open`).
    #[arg(long)]
    pub json: bool,

    /// Only requests arriving at or after this time (ms, the trace's clock), and steps
    /// ending then or later: a window of a big trace the UI can open.
    #[arg(long, value_name = "MS")]
    pub from_ms: Option<f64>,

    /// Only requests arriving before this time (ms), and steps ending before it.
    #[arg(long, value_name = "MS")]
    pub to_ms: Option<f64>,

    /// At most this many requests (the first ones of the window, in file order).
    #[arg(long, value_name = "N")]
    pub max_requests: Option<u64>,
}

/// The requests and steps a run draws (`--from-ms`, `--to-ms`, `--max-requests`). Both
/// passes ask it in the same order, so they agree on every record.
#[derive(Debug, Clone)]
struct Window {
    from: f64,
    to: f64,
    max: u64,
    taken: u64,
}

impl Window {
    fn of(args: &PerfettoArgs) -> Window {
        Window {
            from: args.from_ms.unwrap_or(f64::NEG_INFINITY),
            to: args.to_ms.unwrap_or(f64::INFINITY),
            max: args.max_requests.unwrap_or(u64::MAX),
            taken: 0,
        }
    }

    /// Whether the record that arrived at `arrival` is drawn (counts it when it is).
    fn take(&mut self, arrival: f64) -> bool {
        if arrival < self.from || arrival >= self.to || self.taken >= self.max {
            return false;
        }
        self.taken += 1;
        true
    }

    fn has_step(&self, end_ms: f64) -> bool {
        end_ms >= self.from && end_ms < self.to
    }
}

/// JSON traces past this size do not open in the Perfetto UI (it runs out of memory).
const TOO_BIG_FOR_THE_UI: u64 = 1 << 30;

const REQUESTS_PID: u32 = 1;
/// Engine N's steps are process `STEPS_PID + N`.
const STEPS_PID: u32 = 2;
/// Counters are process-scoped; their events carry this tid.
const COUNTER_TID: u64 = 0;

/// Chrome `cname` colours (chrome://tracing's reserved names): orange for prefill, green
/// for decode, yellow for a step that ran both.
const PREFILL_COLOUR: &str = "rail_idle";
const DECODE_COLOUR: &str = "rail_load";
const MIXED_COLOUR: &str = "yellow";

/// Steps' counter samples held back to absorb interleaving between engines.
const STEP_REORDER: usize = 4096;

/// One Chrome trace event.
#[derive(Serialize)]
struct Event<'a> {
    name: &'a str,
    ph: &'static str,
    ts: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    dur: Option<i64>,
    pid: u32,
    tid: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    cat: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cname: Option<&'static str>,
    #[serde(skip_serializing_if = "Value::is_null")]
    args: Value,
}

enum Out {
    Plain(BufWriter<Box<dyn Write>>),
    /// Buffered before the encoder: every write into it costs a pass over its internal
    /// buffer, and events are written in small pieces.
    Gz(BufWriter<flate2::write::GzEncoder<BufWriter<File>>>),
}

/// Writes `{"displayTimeUnit":"ms","traceEvents":[…]}` one event at a time.
struct Sink {
    out: Out,
    first: bool,
    events: u64,
}

impl Sink {
    fn new(out: Option<File>, gz: bool) -> Result<Sink> {
        let out = match out {
            None => Out::Plain(BufWriter::with_capacity(
                1 << 16,
                Box::new(std::io::stdout()),
            )),
            Some(f) if gz => Out::Gz(BufWriter::with_capacity(
                1 << 16,
                flate2::write::GzEncoder::new(BufWriter::new(f), flate2::Compression::default()),
            )),
            Some(f) => Out::Plain(BufWriter::with_capacity(1 << 16, Box::new(f))),
        };
        let mut s = Sink {
            out,
            first: true,
            events: 0,
        };
        s.w()
            .write_all(b"{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n")?;
        Ok(s)
    }

    fn w(&mut self) -> &mut dyn Write {
        match &mut self.out {
            Out::Plain(w) => w,
            Out::Gz(w) => w,
        }
    }

    fn event(&mut self, e: &Event) -> Result<()> {
        let first = std::mem::replace(&mut self.first, false);
        let w = self.w();
        if !first {
            w.write_all(b",\n")?;
        }
        serde_json::to_writer(&mut *w, e)?;
        self.events += 1;
        Ok(())
    }

    fn metadata(&mut self, kind: &str, pid: u32, tid: u64, name: &str) -> Result<()> {
        self.event(&Event {
            name: kind,
            ph: "M",
            ts: 0,
            dur: None,
            pid,
            tid,
            cat: None,
            cname: None,
            args: json!({ "name": name }),
        })
    }

    fn counter(&mut self, name: &str, pid: u32, ts: i64, value: f64) -> Result<()> {
        self.event(&Event {
            name,
            ph: "C",
            ts,
            dur: None,
            pid,
            tid: COUNTER_TID,
            cat: None,
            cname: None,
            args: json!({ "value": value }),
        })
    }

    /// Close the JSON, flush, and write the gzip trailer.
    fn finish(mut self) -> Result<()> {
        self.w().write_all(b"\n]}\n")?;
        match self.out {
            Out::Plain(mut w) => w.flush()?,
            Out::Gz(w) => {
                let gz = w.into_inner().map_err(|e| e.into_error())?;
                gz.finish()?.flush()?;
            }
        }
        Ok(())
    }
}

/// µs on the trace's clock.
fn us(ms: f64) -> i64 {
    (ms * 1000.0).round() as i64
}

/// The boundaries of a request's spans in µs: arrival, first token, then the end of each
/// gap. Each boundary is rounded once and kept non-decreasing, so consecutive spans tile
/// exactly (no 1 µs overlap with the next request in the lane) and both passes agree on
/// the request's end.
fn boundaries(r: &TraceRecord, arrival_ms: f64) -> impl Iterator<Item = i64> + '_ {
    let mut t = arrival_ms;
    let mut prev = i64::MIN;
    [0.0, r.ttft_ms.unwrap_or(0.0)]
        .into_iter()
        .chain(r.itl_ms.iter().copied())
        .map(move |d| {
            t += d;
            prev = us(t).max(prev);
            prev
        })
}

/// What the first pass keeps per placed request while lanes are packed.
#[derive(Clone, Copy)]
struct Span {
    arrival: i64,
    end: i64,
    index: u32,
}

struct FirstPass {
    model: Option<String>,
    spans: Vec<Span>,
    /// Per record index: its arrival in µs (`i64::MAX` without one); turned into the
    /// suffix minimum by [`plan`].
    arrivals: Vec<i64>,
    without_arrival: u64,
    incomplete: u64,
}

fn first_pass(path: &Path, mut window: Window) -> Result<FirstPass> {
    let mut p = FirstPass {
        model: None,
        spans: Vec::new(),
        arrivals: Vec::new(),
        without_arrival: 0,
        incomplete: 0,
    };
    let mut progress = Progress::new("perfetto: reading");
    for item in TraceReader::open(path)? {
        match item? {
            TraceItem::Meta(m) => {
                if p.model.is_none() {
                    p.model = m.model;
                }
            }
            TraceItem::Record(r) => {
                progress.tick();
                let index =
                    u32::try_from(p.arrivals.len()).context("more than 4 billion records")?;
                let Some(arrival) = r.arrival_ms else {
                    p.without_arrival += 1;
                    p.arrivals.push(i64::MAX);
                    continue;
                };
                if !window.take(arrival) {
                    p.arrivals.push(i64::MAX);
                    continue;
                }
                p.incomplete += u64::from(r.incomplete);
                let start = us(arrival);
                let end = boundaries(&r, arrival).last().unwrap_or(start);
                p.arrivals.push(start);
                p.spans.push(Span {
                    arrival: start,
                    end,
                    index,
                });
            }
        }
    }
    progress.finish();
    Ok(p)
}

/// Greedy lane packing in arrival order; returns the lane of each record index
/// (`u32::MAX` for records not placed) and the number of lanes. Sorts the compact spans,
/// not records.
fn pack_lanes(spans: &mut [Span], records: usize) -> (Vec<u32>, u32) {
    spans.sort_unstable_by_key(|s| (s.arrival, s.index));
    let mut lane_of = vec![u32::MAX; records];
    // (end, lane) of busy lanes; free lanes, lowest first
    let mut busy: BinaryHeap<Reverse<(i64, u32)>> = BinaryHeap::new();
    let mut free: BinaryHeap<Reverse<u32>> = BinaryHeap::new();
    let mut lanes = 0u32;
    for s in spans.iter() {
        while let Some(&Reverse((end, lane))) = busy.peek() {
            if end > s.arrival {
                break;
            }
            busy.pop();
            free.push(Reverse(lane));
        }
        let lane = match free.pop() {
            Some(Reverse(l)) => l,
            None => {
                lanes += 1;
                lanes - 1
            }
        };
        lane_of[s.index as usize] = lane;
        busy.push(Reverse((s.end, lane)));
    }
    (lane_of, lanes)
}

/// One counter sample, ordered by (time, arrival order).
#[derive(Clone, Copy)]
struct Sample {
    ts: i64,
    seq: u64,
    value: f64,
}

impl PartialEq for Sample {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Sample {}
impl PartialOrd for Sample {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Sample {
    fn cmp(&self, o: &Self) -> Ordering {
        (self.ts, self.seq).cmp(&(o.ts, o.seq))
    }
}

/// How samples at the same time combine.
#[derive(Clone, Copy, PartialEq)]
enum Combine {
    /// The latest sample at a time is the value.
    Last,
    /// Samples are deltas; the value is the running sum.
    Sum,
}

/// One counter track fed out of order and emitted in time order: samples wait in a
/// min-heap until the caller knows that nothing earlier can come.
struct CounterTrack {
    name: &'static str,
    pid: u32,
    combine: Combine,
    heap: BinaryHeap<Reverse<Sample>>,
    seq: u64,
    total: f64,
    last_ts: i64,
    /// Samples that came after a later time had been emitted (emitted at that time).
    late: u64,
}

impl CounterTrack {
    fn new(name: &'static str, pid: u32, combine: Combine) -> Self {
        Self {
            name,
            pid,
            combine,
            heap: BinaryHeap::new(),
            seq: 0,
            total: 0.0,
            last_ts: i64::MIN,
            late: 0,
        }
    }

    fn push(&mut self, ts: i64, value: f64) {
        self.seq += 1;
        self.heap.push(Reverse(Sample {
            ts,
            seq: self.seq,
            value,
        }));
    }

    /// Emit every time before `watermark`, one event per distinct time.
    fn drain_before(&mut self, sink: &mut Sink, watermark: i64) -> Result<()> {
        while let Some(&Reverse(first)) = self.heap.peek() {
            if first.ts >= watermark {
                break;
            }
            self.emit_group(sink)?;
        }
        Ok(())
    }

    /// Emit the earliest times until at most `keep` samples are held.
    fn drain_over(&mut self, sink: &mut Sink, keep: usize) -> Result<()> {
        while self.heap.len() > keep {
            self.emit_group(sink)?;
        }
        Ok(())
    }

    fn emit_group(&mut self, sink: &mut Sink) -> Result<()> {
        let Some(Reverse(first)) = self.heap.pop() else {
            return Ok(());
        };
        let mut value = first.value;
        let mut sum = first.value;
        while let Some(&Reverse(next)) = self.heap.peek() {
            if next.ts != first.ts {
                break;
            }
            self.heap.pop();
            value = next.value;
            sum += next.value;
        }
        let value = match self.combine {
            Combine::Last => value,
            Combine::Sum => {
                self.total += sum;
                self.total
            }
        };
        let ts = if first.ts < self.last_ts {
            self.late += 1;
            self.last_ts
        } else {
            first.ts
        };
        self.last_ts = ts;
        sink.counter(self.name, self.pid, ts, value)
    }
}

/// What was written.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Summary {
    /// Chrome trace events written.
    pub events: u64,
    /// Lanes (or rows, with `--track-per-request`).
    pub lanes: u32,
    /// Requests placed on the timeline.
    pub requests: u64,
    /// Records without `arrival_ms`, not placed.
    pub without_arrival: u64,
    /// Placed requests marked incomplete.
    pub incomplete: u64,
    /// Scheduler steps from the sidecar.
    pub steps: u64,
    /// Engines seen in the sidecar.
    pub engines: u32,
    /// Step counter samples that arrived after a later time had been written, written at
    /// that later time (0 unless the sidecar's lines are far out of time order).
    pub late_samples: u64,
}

/// Convert `args.trace` into `out` (stdout when `None`; gzip when `gz`).
pub fn convert(args: &PerfettoArgs, out: Option<File>, gz: bool) -> Result<Summary> {
    let mut window = Window::of(args);
    let mut first = first_pass(&args.trace, window.clone())?;
    let records = first.arrivals.len();
    let placed = first.spans.len() as u64;
    let (lane_of, lanes) = if args.track_per_request {
        (Vec::new(), u32::try_from(placed).unwrap_or(u32::MAX))
    } else {
        pack_lanes(&mut first.spans, records)
    };
    drop(std::mem::take(&mut first.spans));
    // min_future[i]: the earliest arrival among records i.. (what pass 2 can still see)
    let mut min_future = std::mem::take(&mut first.arrivals);
    for i in (0..min_future.len().saturating_sub(1)).rev() {
        min_future[i] = min_future[i].min(min_future[i + 1]);
    }

    let mut sink = Sink::new(out, gz)?;
    let label = args
        .name
        .clone()
        .or_else(|| first.model.clone())
        .unwrap_or_else(|| "inference trace".to_string());
    sink.metadata("process_name", REQUESTS_PID, 0, &label)?;
    if !args.track_per_request {
        for lane in 0..lanes {
            sink.metadata(
                "thread_name",
                REQUESTS_PID,
                u64::from(lane) + 1,
                &format!("lane {lane}"),
            )?;
        }
    }

    let mut active = CounterTrack::new("active_requests", REQUESTS_PID, Combine::Sum);
    let mut running = CounterTrack::new("engine_running", REQUESTS_PID, Combine::Last);
    let mut prefill = CounterTrack::new("prefill_tokens", REQUESTS_PID, Combine::Last);

    let mut progress = Progress::new("perfetto: writing");
    let mut index = 0usize;
    let mut decode_names: Vec<String> = Vec::new();
    let mut bounds: Vec<i64> = Vec::new();
    for item in TraceReader::open(&args.trace)? {
        let TraceItem::Record(r) = item? else {
            continue;
        };
        let i = index;
        index += 1;
        progress.tick();
        let Some(arrival) = r.arrival_ms else {
            continue;
        };
        if !window.take(arrival) {
            continue;
        }
        let tid = if args.track_per_request {
            let tid = i as u64 + 1;
            let name = r
                .request_id
                .clone()
                .unwrap_or_else(|| format!("request {i}"));
            sink.metadata("thread_name", REQUESTS_PID, tid, &name)?;
            tid
        } else {
            match lane_of.get(i) {
                Some(&lane) if lane != u32::MAX => u64::from(lane) + 1,
                _ => bail!("the trace changed between the two passes"),
            }
        };
        bounds.clear();
        bounds.extend(boundaries(&r, arrival));
        write_request(&mut sink, &r, &bounds, tid, &mut decode_names)?;

        let (start, end) = (bounds[0], bounds[bounds.len() - 1]);
        active.push(start, 1.0);
        active.push(end, -1.0);
        for (k, &t) in bounds.iter().skip(2).enumerate() {
            if let Some(&n) = r.itl_ctx.num_running.get(k) {
                running.push(t, f64::from(n));
            }
            if let Some(&n) = r.itl_ctx.prefill_tokens.get(k) {
                prefill.push(t, f64::from(n));
            }
        }
        // No record after this one arrives before `watermark`: emit what precedes it.
        let watermark = min_future.get(index).copied().unwrap_or(i64::MAX);
        for track in [&mut active, &mut running, &mut prefill] {
            track.drain_before(&mut sink, watermark)?;
        }
    }
    for track in [&mut active, &mut running, &mut prefill] {
        track.drain_before(&mut sink, i64::MAX)?;
    }
    progress.finish();
    if index != records {
        bail!("the trace changed between the two passes");
    }

    let mut summary = Summary {
        lanes,
        requests: placed,
        without_arrival: first.without_arrival,
        incomplete: first.incomplete,
        ..Summary::default()
    };
    if let Some(path) = &args.step_stats {
        write_steps(&mut sink, path, &mut summary, &window)
            .with_context(|| format!("reading {}", path.display()))?;
    }
    summary.events = sink.events;
    sink.finish()?;
    Ok(summary)
}

/// A request's spans: `bounds` from [`boundaries`].
fn write_request(
    sink: &mut Sink,
    r: &TraceRecord,
    bounds: &[i64],
    tid: u64,
    names: &mut Vec<String>,
) -> Result<()> {
    let ids = r.output_token_ids.as_deref();
    let first_n = r.first_chunk_tokens() as usize;
    let mut args = Map::new();
    args.insert("request_id".into(), json!(r.request_id));
    args.insert("prompt_tokens".into(), json!(r.prompt_tokens));
    if let Some(c) = r.cached_tokens {
        args.insert("cached_tokens".into(), json!(c));
    }
    args.insert("output_tokens".into(), json!(r.output_tokens));
    if let Some(c) = r.concurrency {
        args.insert("concurrency".into(), json!(c));
    }
    if let Some(f) = &r.finish_reason {
        args.insert("finish_reason".into(), json!(f));
    }
    if r.incomplete {
        args.insert("incomplete".into(), json!(true));
        if let Some(a) = &r.abort_reason {
            args.insert("abort_reason".into(), json!(a));
        }
    }
    if let Some(e) = &r.error {
        args.insert("error".into(), json!(e));
    }
    // the first chunk arrives with the first token, at the end of the prefill span
    if let Some(ids) = ids
        && first_n > 0
    {
        args.insert("token_ids".into(), json!(&ids[..first_n.min(ids.len())]));
    }
    sink.event(&Event {
        name: "prefill",
        ph: "X",
        ts: bounds[0],
        dur: Some(bounds[1] - bounds[0]),
        pid: REQUESTS_PID,
        tid,
        cat: Some("request"),
        cname: Some(PREFILL_COLOUR),
        args: Value::Object(args),
    })?;
    let chunks = r.chunk_tokens();
    let mut at = first_n;
    for (k, w) in bounds[1..].windows(2).enumerate() {
        let n = chunks.get(k).copied().unwrap_or(1) as usize;
        let name: &str = if n == 1 {
            "decode"
        } else {
            while names.len() <= n {
                let m = names.len();
                names.push(format!("decode x{m}"));
            }
            &names[n]
        };
        let mut args = Map::new();
        if let Some(ids) = ids
            && at < ids.len()
        {
            args.insert("token_ids".into(), json!(&ids[at..(at + n).min(ids.len())]));
        }
        if r.incomplete {
            args.insert("incomplete".into(), json!(true));
        }
        at += n;
        sink.event(&Event {
            name,
            ph: "X",
            ts: w[0],
            dur: Some(w[1] - w[0]),
            pid: REQUESTS_PID,
            tid,
            cat: Some("request"),
            cname: Some(DECODE_COLOUR),
            args: if args.is_empty() {
                Value::Null
            } else {
                Value::Object(args)
            },
        })?;
    }
    Ok(())
}

/// One engine's steps and counters.
struct EngineSteps {
    engine: u64,
    pid: u32,
    /// End of its last step (µs): a step never starts before it.
    prev_end: i64,
    running: CounterTrack,
    waiting: CounterTrack,
    kv: CounterTrack,
    accept: CounterTrack,
}

impl EngineSteps {
    fn tracks(&mut self) -> [&mut CounterTrack; 4] {
        [
            &mut self.running,
            &mut self.waiting,
            &mut self.kv,
            &mut self.accept,
        ]
    }
}

/// The step-stats sidecar: per engine, a process with the steps track and the scheduler
/// counters.
fn write_steps(sink: &mut Sink, path: &Path, summary: &mut Summary, window: &Window) -> Result<()> {
    let mut engines: Vec<EngineSteps> = Vec::new();
    let mut progress = Progress::new("perfetto: steps");
    let mut reader = StepStatsReader::open(path)?;
    while let Some(item) = reader.next() {
        let v = item?;
        progress.tick();
        if !window.has_step(v.ts_ms) {
            continue;
        }
        let line = reader.line();
        let engine = u64::from(v.engine);
        let e = match engines.iter().position(|e| e.engine == engine) {
            Some(i) => &mut engines[i],
            None => {
                let pid = u32::try_from(engine)
                    .ok()
                    .and_then(|n| n.checked_add(STEPS_PID))
                    .with_context(|| format!("{}:{line}: engine {engine}", path.display()))?;
                let label = if engine == 0 {
                    "scheduler steps".to_string()
                } else {
                    format!("scheduler steps (engine {engine})")
                };
                sink.metadata("process_name", pid, 0, &label)?;
                sink.metadata("thread_name", pid, 1, &format!("engine {engine} steps"))?;
                engines.push(EngineSteps {
                    engine,
                    pid,
                    prev_end: i64::MIN,
                    running: CounterTrack::new("sched_running_reqs", pid, Combine::Last),
                    waiting: CounterTrack::new("sched_waiting_reqs", pid, Combine::Last),
                    kv: CounterTrack::new("sched_kv_cache_usage", pid, Combine::Last),
                    accept: CounterTrack::new("sched_accept_rate", pid, Combine::Last),
                });
                engines.last_mut().expect("just pushed")
            }
        };
        let end = us(v.ts_ms);
        let step_ms = v.step_ms.unwrap_or(0.0).max(0.0);
        // back to back: a step never starts before the previous one ended
        let start = (end - us(step_ms)).max(e.prev_end).min(end);
        let end = end.max(e.prev_end);
        e.prev_end = end;
        let run = v.num_running_reqs as f64;
        let wait = v.num_waiting_reqs as f64;
        let prefill_reqs = f64::from(v.prefill_requests);
        let decodes = (run - prefill_reqs).max(0.0);
        let (name, colour) = match (prefill_reqs > 0.0, decodes > 0.0) {
            (true, false) => ("prefill".to_string(), PREFILL_COLOUR),
            (true, true) => (
                format!(
                    "prefill+decode B{} (+{}r {}t)",
                    decodes as u64, v.prefill_requests, v.prefill_tokens
                ),
                MIXED_COLOUR,
            ),
            _ => (format!("decode B{}", v.num_running_reqs), DECODE_COLOUR),
        };
        // the sidecar's own numbers, as written
        let mut args = json!({
            "running": v.num_running_reqs,
            "waiting": v.num_waiting_reqs,
            "prefill_requests": v.prefill_requests,
            "prefill_tokens": v.prefill_tokens,
            "new_tokens": v.new_tokens,
            "outputs": v.outputs,
            "kv_cache_usage": v.kv_cache_usage,
            "step_ms": v.step_ms,
        });
        if let (Some(spec), Some(args)) = (&v.spec_decoding, args.as_object_mut()) {
            args.insert("spec_accepted".into(), spec.num_accepted_tokens.into());
            args.insert("spec_draft".into(), spec.num_draft_tokens.into());
            args.insert("spec_drafts".into(), spec.num_drafts.into());
        }
        sink.event(&Event {
            name: &name,
            ph: "X",
            ts: start,
            dur: Some(end - start),
            pid: e.pid,
            tid: 1,
            cat: Some("step"),
            cname: Some(colour),
            args,
        })?;
        e.running.push(end, run);
        e.waiting.push(end, wait);
        if v.kv_cache_usage.is_finite() {
            e.kv.push(end, v.kv_cache_usage);
        }
        if let Some(spec) = &v.spec_decoding
            && spec.num_draft_tokens > 0
        {
            e.accept.push(
                end,
                spec.num_accepted_tokens as f64 / spec.num_draft_tokens as f64,
            );
        }
        for t in e.tracks() {
            t.drain_over(sink, STEP_REORDER)?;
        }
        summary.steps += 1;
    }
    progress.finish();
    for e in &mut engines {
        for t in e.tracks() {
            t.drain_before(sink, i64::MAX)?;
            summary.late_samples += t.late;
        }
    }
    summary.engines = engines.len() as u32;
    Ok(())
}

pub fn run(args: &PerfettoArgs) -> Result<()> {
    let gz = |p: &Path| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gz"));
    // inputs are checked before the output is created: a missing trace must not leave an
    // empty output behind, and the output must never be one of the inputs
    for (p, what) in std::iter::once((&args.trace, "the trace")).chain(
        args.step_stats
            .as_ref()
            .map(|s| (s, "the --step-stats file")),
    ) {
        std::fs::metadata(p).with_context(|| format!("{what} {}", p.display()))?;
    }
    let mut guard = None;
    if let Some(out) = &args.output {
        let mut inputs = vec![(args.trace.as_path(), "the trace")];
        if let Some(s) = &args.step_stats {
            inputs.push((s.as_path(), "the --step-stats file"));
        }
        super::output::refuse_overwriting(out, "-o", &inputs)?;
        guard = Some(super::output::OutputGuard::new(out));
    }
    // With --open and no -o: a temporary file, unlinked once open (served from the
    // handle), so nothing is left behind when Ctrl-C ends the process.
    let (out, shown, temp): (Option<File>, Option<PathBuf>, bool) = match (&args.output, args.open)
    {
        (Some(p), _) => (
            Some(
                sim_trace::trace::create_output(p)
                    .with_context(|| format!("creating {}", p.display()))?,
            ),
            Some(p.clone()),
            false,
        ),
        (None, true) => {
            let p =
                std::env::temp_dir().join(format!("vllm-vcr-perfetto-{}.json", std::process::id()));
            let f = File::create(&p).with_context(|| format!("creating {}", p.display()))?;
            (Some(f), Some(p), true)
        }
        (None, false) => (None, None, false),
    };
    // the output exists now: a failure from here on removes it
    if let Some(g) = &mut guard {
        g.arm();
    }
    let served = match &shown {
        Some(p) if args.open => {
            Some(File::open(p).with_context(|| format!("opening {}", p.display()))?)
        }
        _ => None,
    };
    if temp && let Some(p) = &shown {
        let _ = std::fs::remove_file(p);
    }
    let summary = convert(args, out, shown.as_deref().is_some_and(gz))
        .with_context(|| format!("converting {}", args.trace.display()))?;
    if summary.without_arrival > 0 {
        crate::errln!(
            "perfetto: {} record(s) have no arrival_ms and cannot be placed on the timeline",
            summary.without_arrival
        );
    }
    if summary.late_samples > 0 {
        crate::errln!(
            "perfetto: {} step counter sample(s) were out of time order and were drawn at the \
             previous sample's time",
            summary.late_samples
        );
    }
    if let Some(p) = shown.as_ref().filter(|_| !temp)
        && let Ok(m) = std::fs::metadata(p)
        && m.len() > TOO_BIG_FOR_THE_UI
    {
        crate::errln!(
            "perfetto: warning: {} is {} MiB; the Perfetto UI runs out of memory on JSON traces past about 1 GiB: draw a window (--from-ms/--to-ms) or fewer requests (--max-requests)",
            p.display(),
            m.len() >> 20
        );
    }
    if let Some(p) = &shown {
        crate::errln!(
            "perfetto: wrote {} ({} events, {} requests in {} {}{})",
            if temp {
                "a temporary file".to_string()
            } else {
                p.display().to_string()
            },
            summary.events,
            summary.requests,
            summary.lanes,
            if args.track_per_request {
                "rows"
            } else {
                "lanes"
            },
            if summary.steps > 0 {
                format!(", {} steps", summary.steps)
            } else {
                String::new()
            }
        );
        if args.json {
            let mut v = serde_json::to_value(&summary)?;
            if !temp && let Some(o) = v.as_object_mut() {
                o.insert("output".into(), json!(p));
            }
            writeln!(std::io::stdout(), "{v}")?;
        }
    }
    if let Some(g) = &mut guard {
        g.disarm();
    }
    if let (Some(file), Some(p)) = (served, &shown) {
        serve(file, &url_name(p), args.port)?;
    }
    Ok(())
}

/// The file's name as a URL path segment (characters outside `[A-Za-z0-9._-]` → `_`).
fn url_name(path: &Path) -> String {
    let name: String = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.is_empty() {
        "trace.json".to_string()
    } else {
        name
    }
}

/// Serve `file` as `/name` to the hosted Perfetto UI until the process is interrupted.
fn serve(file: File, name: &str, port: u16) -> Result<()> {
    use std::net::TcpListener;
    let listener = TcpListener::bind(("127.0.0.1", port)).with_context(|| {
        format!(
            "binding 127.0.0.1:{port}{}",
            if port == PERFETTO_UI_PORT {
                " (the port the hosted Perfetto UI may fetch from; is trace_processor \
                 --httpd running? Stop it, or write the file with -o and drag it into \
                 the UI)"
            } else {
                ""
            }
        )
    })?;
    let port = listener.local_addr()?.port();
    let url = format!("http://127.0.0.1:{port}/{name}");
    if port != PERFETTO_UI_PORT {
        crate::errln!(
            "perfetto: note: ui.perfetto.dev may only fetch from 127.0.0.1:{PERFETTO_UI_PORT} \
             (its Content-Security-Policy); from port {port} the link suits a self-hosted UI"
        );
    }
    // One write, and its failure ignored: whoever reads our stdout may stop after the URL
    // (`| head -2`, a test), and that must not stop the server.
    let _ = std::io::stdout().lock().write_all(
        format!("serving {url}\nopen https://ui.perfetto.dev/#!/?url={url}\n(Ctrl-C to stop)\n")
            .as_bytes(),
    );
    let file = Arc::new(file);
    let name: Arc<str> = Arc::from(name);
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let (file, name) = (Arc::clone(&file), Arc::clone(&name));
        std::thread::spawn(move || {
            if let Err(e) = answer(stream, &file, &name) {
                crate::errln!("perfetto: a request failed: {e}");
            }
        });
    }
    Ok(())
}

const CORS: &str = "Access-Control-Allow-Origin: https://ui.perfetto.dev\r\n\
Access-Control-Allow-Methods: GET, HEAD, OPTIONS\r\n\
Access-Control-Allow-Headers: *\r\n\
Access-Control-Allow-Private-Network: true\r\n\
Cache-Control: no-cache\r\n";

/// Answer one HTTP/1.x request: OPTIONS (CORS preflight), GET or HEAD of `/name`.
fn answer(mut stream: std::net::TcpStream, file: &File, name: &str) -> std::io::Result<()> {
    use std::io::{BufRead, BufReader};
    use std::os::unix::fs::FileExt;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(30)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request = String::new();
    reader.read_line(&mut request)?;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
    }
    let mut parts = request.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let simple = |status: &str| {
        format!("HTTP/1.1 {status}\r\n{CORS}Content-Length: 0\r\nConnection: close\r\n\r\n")
    };
    if method == "OPTIONS" {
        return stream.write_all(simple("204 No Content").as_bytes());
    }
    if method != "GET" && method != "HEAD" {
        return stream.write_all(simple("405 Method Not Allowed").as_bytes());
    }
    let wanted = target
        .split(['?', '#'])
        .next()
        .unwrap_or("")
        .trim_start_matches('/');
    if wanted != name && !wanted.is_empty() {
        return stream.write_all(simple("404 Not Found").as_bytes());
    }
    let len = file.metadata()?.len();
    let encoding = if name.ends_with(".gz") {
        "Content-Encoding: gzip\r\n"
    } else {
        ""
    };
    stream.write_all(
        format!(
            "HTTP/1.1 200 OK\r\n{CORS}Content-Type: application/json\r\n{encoding}\
             Content-Length: {len}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )?;
    if method == "HEAD" {
        return Ok(());
    }
    // positioned reads: connections share the one handle
    let mut buf = vec![0u8; 1 << 16];
    let mut off = 0u64;
    while off < len {
        let n = file.read_at(&mut buf, off)?;
        if n == 0 {
            break;
        }
        stream.write_all(&buf[..n])?;
        off += n as u64;
    }
    stream.flush()
}
