//! The timeline of a trace, built in two streaming passes and handed event by event to a
//! [`Sink`] (the JSON or the protobuf writer), so both formats hold the same content.
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

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use sim_trace::steps::StepStatsReader;
use sim_trace::trace::{TraceItem, TraceLine, TraceReader, TraceRecord};

use super::PerfettoArgs;
use super::sink::{Arg, NamedArg, Sink, Slice};
use super::time::us;
use crate::inspect::progress::Progress;

mod tracks;

use tracks::{Combine, CounterTrack, Writer};

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

const REQUESTS_PID: u32 = 1;
/// Engine N's steps are process `STEPS_PID + N`.
const STEPS_PID: u32 = 2;

/// Chrome `cname` colours (chrome://tracing's reserved names): orange for prefill, green
/// for decode, yellow for a step that ran both.
const PREFILL_COLOUR: &str = "rail_idle";
const DECODE_COLOUR: &str = "rail_load";
const MIXED_COLOUR: &str = "yellow";

/// Steps' counter samples held back to absorb interleaving between engines.
const STEP_REORDER: usize = 4096;

/// The boundaries of a request's spans in µs: arrival, first token, then the end of each
/// gap. Each boundary is rounded once and kept non-decreasing, so consecutive spans tile
/// exactly (no 1 µs overlap with the next request in the lane) and both passes agree on
/// the request's end.
fn boundaries<'a>(
    ttft_ms: Option<f64>,
    itl_ms: &'a [f64],
    arrival_ms: f64,
) -> impl Iterator<Item = i64> + 'a {
    let mut t = arrival_ms;
    let mut prev = i64::MIN;
    [0.0, ttft_ms.unwrap_or(0.0)]
        .into_iter()
        .chain(itl_ms.iter().copied())
        .map(move |d| {
            t += d;
            prev = us(t).max(prev);
            prev
        })
}

/// What the first pass reads of a record: its timing. The rest of the line (ids, token ids,
/// engine context) is skipped without being decoded; the second pass reads it all, and
/// reports a bad line then.
#[derive(Deserialize)]
struct Timing {
    #[serde(default)]
    arrival_ms: Option<f64>,
    #[serde(default)]
    ttft_ms: Option<f64>,
    #[serde(default, deserialize_with = "gaps")]
    itl_ms: Vec<f64>,
    #[serde(default)]
    incomplete: bool,
}

/// `itl_ms` as `Vec<f64>` reads it, with room for a typical record's gaps made once: the
/// reader cannot tell the array's length, and growing a vector from empty to a few hundred
/// gaps reallocated it seven times a record.
fn gaps<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
    struct Gaps;
    impl<'de> serde::de::Visitor<'de> for Gaps {
        type Value = Vec<f64>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a sequence")
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<f64>, A::Error> {
            let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).max(256));
            while let Some(x) = seq.next_element()? {
                v.push(x);
            }
            Ok(v)
        }
    }
    d.deserialize_seq(Gaps)
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
    let mut reader = TraceReader::open(path)?;
    while let Some(item) = reader.next_as::<Timing>() {
        match item? {
            TraceLine::Meta(m) => {
                if p.model.is_none() {
                    p.model = m.model;
                }
            }
            TraceLine::Record(r) => {
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
                let end = boundaries(r.ttft_ms, &r.itl_ms, arrival)
                    .last()
                    .unwrap_or(start);
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

/// What was written.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Summary {
    /// Events drawn: slices, counter samples, process and thread names (in the JSON
    /// format, one Chrome trace event each).
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
    /// The format written (`proto` or `json`).
    pub format: &'static str,
    /// Bytes written, before compression.
    pub bytes: u64,
}

/// Draw `args.trace` (and its step stats) into `sink`; returns what was drawn, with the
/// bytes the sink wrote (before compression).
pub fn convert(args: &PerfettoArgs, sink: Box<dyn Sink>) -> Result<Summary> {
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

    let mut sink = Writer::new(sink);
    let label = args
        .name
        .clone()
        .or_else(|| first.model.clone())
        .unwrap_or_else(|| "inference trace".to_string());
    sink.process(REQUESTS_PID, &label)?;
    if !args.track_per_request {
        for lane in 0..lanes {
            sink.thread(REQUESTS_PID, u64::from(lane) + 1, &format!("lane {lane}"))?;
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
            sink.thread(REQUESTS_PID, tid, &name)?;
            tid
        } else {
            match lane_of.get(i) {
                Some(&lane) if lane != u32::MAX => u64::from(lane) + 1,
                _ => bail!("the trace changed between the two passes"),
            }
        };
        bounds.clear();
        bounds.extend(boundaries(r.ttft_ms, &r.itl_ms, arrival));
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
    summary.events = sink.events();
    summary.bytes = sink.finish()?;
    Ok(summary)
}

/// A request's spans: `bounds` from [`boundaries`].
fn write_request(
    sink: &mut Writer,
    r: &TraceRecord,
    bounds: &[i64],
    tid: u64,
    names: &mut Vec<String>,
) -> Result<()> {
    let ids = r.output_token_ids.as_deref();
    let first_n = r.first_chunk_tokens() as usize;
    let mut args: Vec<NamedArg> = Vec::with_capacity(10);
    if let Some(id) = &r.request_id {
        args.push(("request_id", Arg::Str(id)));
    }
    args.push(("prompt_tokens", Arg::Uint(r.prompt_tokens.into())));
    if let Some(c) = r.cached_tokens {
        args.push(("cached_tokens", Arg::Uint(c.into())));
    }
    args.push(("output_tokens", Arg::Uint(r.output_tokens.into())));
    if let Some(c) = r.concurrency {
        args.push(("concurrency", Arg::Uint(c.into())));
    }
    if let Some(f) = &r.finish_reason {
        args.push(("finish_reason", Arg::Str(f)));
    }
    if r.incomplete {
        args.push(("incomplete", Arg::Bool(true)));
        if let Some(a) = &r.abort_reason {
            args.push(("abort_reason", Arg::Str(a)));
        }
    }
    if let Some(e) = &r.error {
        args.push(("error", Arg::Str(e)));
    }
    // the first chunk arrives with the first token, at the end of the prefill span
    if let Some(ids) = ids
        && first_n > 0
    {
        args.push(("token_ids", Arg::Ids(&ids[..first_n.min(ids.len())])));
    }
    sink.slice(&Slice {
        pid: REQUESTS_PID,
        tid,
        name: "prefill",
        category: "request",
        colour: PREFILL_COLOUR,
        ts: bounds[0],
        dur: bounds[1] - bounds[0],
        args: &args,
    })?;
    let decode = Slice {
        pid: REQUESTS_PID,
        tid,
        name: "decode",
        category: "request",
        colour: DECODE_COLOUR,
        ts: 0,
        dur: 0,
        args: &[],
    };
    if r.itl_tokens.is_empty() && !r.incomplete && ids.is_none_or(|ids| first_n >= ids.len()) {
        // one token per gap, nothing to show but its times: the common case, in one call
        return sink.run(&decode, &bounds[1..]);
    }
    let mut at = first_n;
    for (k, w) in bounds[1..].windows(2).enumerate() {
        // a record without itl_tokens delivered one token per gap
        let n = r.itl_tokens.get(k).copied().unwrap_or(1) as usize;
        let name: &str = if n == 1 {
            "decode"
        } else {
            while names.len() <= n {
                let m = names.len();
                names.push(format!("decode x{m}"));
            }
            &names[n]
        };
        let mut args: [NamedArg; 2] = [("", Arg::Bool(false)); 2];
        let mut used = 0;
        if let Some(ids) = ids
            && at < ids.len()
        {
            args[used] = ("token_ids", Arg::Ids(&ids[at..(at + n).min(ids.len())]));
            used += 1;
        }
        if r.incomplete {
            args[used] = ("incomplete", Arg::Bool(true));
            used += 1;
        }
        at += n;
        sink.slice(&Slice {
            name,
            ts: w[0],
            dur: w[1] - w[0],
            args: &args[..used],
            ..decode
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
fn write_steps(
    sink: &mut Writer,
    path: &Path,
    summary: &mut Summary,
    window: &Window,
) -> Result<()> {
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
                sink.process(pid, &label)?;
                sink.thread(pid, 1, &format!("engine {engine} steps"))?;
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
        let mut args: Vec<NamedArg> = vec![
            ("running", Arg::Uint(v.num_running_reqs)),
            ("waiting", Arg::Uint(v.num_waiting_reqs)),
            ("prefill_requests", Arg::Uint(v.prefill_requests.into())),
            ("prefill_tokens", Arg::Uint(v.prefill_tokens)),
            ("new_tokens", Arg::Uint(v.new_tokens)),
            ("outputs", Arg::Uint(v.outputs)),
        ];
        if v.kv_cache_usage.is_finite() {
            args.push(("kv_cache_usage", Arg::Float(v.kv_cache_usage)));
        }
        if let Some(ms) = v.step_ms.filter(|ms| ms.is_finite()) {
            args.push(("step_ms", Arg::Float(ms)));
        }
        if let Some(spec) = &v.spec_decoding {
            args.push(("spec_accepted", Arg::Uint(spec.num_accepted_tokens)));
            args.push(("spec_draft", Arg::Uint(spec.num_draft_tokens)));
            args.push(("spec_drafts", Arg::Uint(spec.num_drafts)));
        }
        sink.slice(&Slice {
            pid: e.pid,
            tid: 1,
            name: &name,
            category: "step",
            colour,
            ts: start,
            dur: end - start,
            args: &args,
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
