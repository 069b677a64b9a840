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
//! - process 2, the engine steps (with `--step-stats`): one span per scheduler step, back
//!   to back, named by what it ran, and counters `sched_running_reqs`,
//!   `sched_waiting_reqs`, `sched_kv_cache_usage`, `sched_accept_rate` (when drafting).
//!
//! Two passes over the trace: the first keeps 24 bytes per request (arrival, end, order)
//! to pack lanes in arrival order (records are written in finish order) and the counter
//! samples (16 bytes per gap) that must be emitted in time order; the second streams the
//! records again and writes their spans as it goes.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Serialize;
use serde_json::{Value, json};
use sim_trace::trace::{JsonlReader, TraceItem, TraceReader, TraceRecord};

use super::progress::Progress;

#[derive(Debug, Clone, Args)]
pub struct PerfettoArgs {
    /// The trace (JSONL; `.gz` read transparently).
    pub trace: PathBuf,

    /// Write the Chrome Trace Event JSON here (`.gz` → gzip; default: stdout, or a
    /// temporary file with `--open`).
    #[arg(short, long, value_name = "PATH")]
    pub output: Option<PathBuf>,

    /// Overlay the step-stats sidecar written by `record --step-stats-out` (`.gz` ok):
    /// scheduler counters and a track of engine steps.
    #[arg(long, value_name = "PATH")]
    pub step_stats: Option<PathBuf>,

    /// Label of the requests' process row (default: the trace's model).
    #[arg(long, value_name = "LABEL")]
    pub name: Option<String>,

    /// One labelled row per request instead of packed lanes (for small traces).
    #[arg(long)]
    pub track_per_request: bool,

    /// Serve the file on 127.0.0.1 for the hosted Perfetto UI and print the URL to open;
    /// runs until Ctrl-C.
    #[arg(long)]
    pub open: bool,

    /// Port for `--open` (0: any free port).
    #[arg(long, default_value_t = 0)]
    pub port: u16,

    /// Print a JSON summary (events, lanes, requests placed and not placed) on stdout
    /// (with `-o` or `--open`).
    #[arg(long)]
    pub json: bool,
}

const REQUESTS_PID: u32 = 1;
const STEPS_PID: u32 = 2;
const COUNTER_TID: u64 = 0;

/// One Chrome trace event.
#[derive(Serialize)]
struct Event<'a> {
    name: &'a str,
    ph: &'static str,
    ts: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    dur: Option<f64>,
    pid: u32,
    tid: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    cat: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cname: Option<&'static str>,
    #[serde(skip_serializing_if = "Value::is_null")]
    args: Value,
}

/// Writes `{"traceEvents":[…], …}` one event at a time.
struct Sink {
    out: Box<dyn Write>,
    first: bool,
    events: u64,
}

impl Sink {
    fn new(path: Option<&Path>) -> Result<Sink> {
        let out: Box<dyn Write> = match path {
            None => Box::new(BufWriter::new(std::io::stdout())),
            Some(p) => {
                let f = std::fs::File::create(p)
                    .with_context(|| format!("creating {}", p.display()))?;
                if p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gz")) {
                    // Buffer before the encoder: every write into it costs a pass over
                    // its internal buffer, and events are written in small pieces.
                    Box::new(BufWriter::with_capacity(
                        1 << 16,
                        flate2::write::GzEncoder::new(
                            BufWriter::new(f),
                            flate2::Compression::default(),
                        ),
                    ))
                } else {
                    Box::new(BufWriter::with_capacity(1 << 16, f))
                }
            }
        };
        let mut s = Sink {
            out,
            first: true,
            events: 0,
        };
        s.out
            .write_all(b"{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n")?;
        Ok(s)
    }

    fn event(&mut self, e: &Event) -> Result<()> {
        if !self.first {
            self.out.write_all(b",\n")?;
        }
        self.first = false;
        serde_json::to_writer(&mut self.out, e)?;
        self.events += 1;
        Ok(())
    }

    fn metadata(&mut self, kind: &str, pid: u32, tid: u64, name: &str) -> Result<()> {
        self.event(&Event {
            name: kind,
            ph: "M",
            ts: 0.0,
            dur: None,
            pid,
            tid,
            cat: None,
            cname: None,
            args: json!({ "name": name }),
        })
    }

    fn counter(&mut self, name: &str, pid: u32, ts: f64, value: f64) -> Result<()> {
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

    fn finish(mut self) -> Result<()> {
        self.out.write_all(b"\n]}\n")?;
        self.out.flush()?;
        Ok(())
    }
}

/// µs on the trace's clock.
fn us(ms: f64) -> f64 {
    (ms * 1000.0).round()
}

/// What the first pass keeps per request.
#[derive(Clone, Copy)]
struct Span {
    arrival: f64,
    end: f64,
    index: u32,
}

struct FirstPass {
    model: Option<String>,
    spans: Vec<Span>,
    without_arrival: u64,
    /// (ts µs, value) samples of the per-gap engine context.
    running: Vec<(f64, f64)>,
    prefill: Vec<(f64, f64)>,
}

fn end_ms(r: &TraceRecord, arrival: f64) -> f64 {
    arrival + r.ttft_ms.unwrap_or(0.0) + r.itl_ms.iter().sum::<f64>()
}

fn first_pass(path: &Path) -> Result<FirstPass> {
    let mut p = FirstPass {
        model: None,
        spans: Vec::new(),
        without_arrival: 0,
        running: Vec::new(),
        prefill: Vec::new(),
    };
    let mut progress = Progress::new("perfetto: reading");
    let mut index: u32 = 0;
    for item in TraceReader::open(path)? {
        match item? {
            TraceItem::Meta(m) => {
                if p.model.is_none() {
                    p.model = m.model;
                }
            }
            TraceItem::Record(r) => {
                progress.tick();
                let i = index;
                index = index
                    .checked_add(1)
                    .context("more than 4 billion records")?;
                let Some(arrival) = r.arrival_ms else {
                    p.without_arrival += 1;
                    continue;
                };
                p.spans.push(Span {
                    arrival: us(arrival),
                    end: us(end_ms(&r, arrival)),
                    index: i,
                });
                let mut t = arrival + r.ttft_ms.unwrap_or(0.0);
                for (k, gap) in r.itl_ms.iter().enumerate() {
                    t += gap;
                    if let Some(&n) = r.itl_ctx.num_running.get(k) {
                        p.running.push((us(t), f64::from(n)));
                    }
                    if let Some(&n) = r.itl_ctx.prefill_tokens.get(k) {
                        p.prefill.push((us(t), f64::from(n)));
                    }
                }
            }
        }
    }
    progress.finish();
    Ok(p)
}

/// Greedy lane packing in arrival order; returns the lane of each record index
/// (`u32::MAX` for records not placed) and the number of lanes.
fn pack_lanes(spans: &mut [Span], records: usize) -> (Vec<u32>, u32) {
    spans.sort_by(|a, b| a.arrival.total_cmp(&b.arrival).then(a.index.cmp(&b.index)));
    let mut lane_of = vec![u32::MAX; records];
    // (end, lane) of busy lanes; free lanes, lowest first
    let mut busy: BinaryHeap<Reverse<(u64, u32)>> = BinaryHeap::new();
    let mut free: BinaryHeap<Reverse<u32>> = BinaryHeap::new();
    let mut lanes = 0u32;
    for s in spans.iter() {
        while let Some(&Reverse((end, lane))) = busy.peek() {
            if end as f64 <= s.arrival {
                busy.pop();
                free.push(Reverse(lane));
            } else {
                break;
            }
        }
        let lane = match free.pop() {
            Some(Reverse(l)) => l,
            None => {
                lanes += 1;
                lanes - 1
            }
        };
        lane_of[s.index as usize] = lane;
        busy.push(Reverse((s.end.max(s.arrival) as u64, lane)));
    }
    (lane_of, lanes)
}

/// Emit samples as one counter track in time order (the last value of equal times wins).
fn counter_track(
    sink: &mut Sink,
    name: &str,
    pid: u32,
    mut samples: Vec<(f64, f64)>,
) -> Result<()> {
    samples.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut i = 0;
    while i < samples.len() {
        let mut j = i;
        while j + 1 < samples.len() && samples[j + 1].0 == samples[i].0 {
            j += 1;
        }
        sink.counter(name, pid, samples[j].0, samples[j].1)?;
        i = j + 1;
    }
    Ok(())
}

/// What was written.
#[derive(Debug, Default)]
pub struct Summary {
    pub events: u64,
    pub lanes: u32,
    pub requests: u64,
    pub without_arrival: u64,
    pub steps: u64,
}

/// Convert `args.trace` into `output` (stdout when `None`).
pub fn convert(args: &PerfettoArgs, output: Option<&Path>) -> Result<Summary> {
    let mut first = first_pass(&args.trace)?;
    let records = first
        .spans
        .iter()
        .map(|s| s.index as usize + 1)
        .max()
        .unwrap_or(0);
    let placed = first.spans.len() as u64;
    let (lane_of, lanes) = if args.track_per_request {
        (Vec::new(), placed as u32)
    } else {
        pack_lanes(&mut first.spans, records)
    };
    let mut sink = Sink::new(output)?;
    let label = args
        .name
        .clone()
        .or_else(|| first.model.clone())
        .unwrap_or_else(|| "inference trace".to_string());
    sink.metadata("process_name", REQUESTS_PID, 0, &label)?;
    sink.metadata("thread_name", REQUESTS_PID, COUNTER_TID, "counters")?;
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

    // active_requests, swept from the spans (ends before starts at equal times)
    let mut sweep: Vec<(f64, i32)> = Vec::with_capacity(first.spans.len() * 2);
    for s in &first.spans {
        sweep.push((s.arrival, 1));
        sweep.push((s.end.max(s.arrival), -1));
    }
    sweep.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut active = 0i64;
    let mut samples = Vec::with_capacity(sweep.len());
    for (t, d) in sweep {
        active += i64::from(d);
        samples.push((t, active as f64));
    }
    counter_track(&mut sink, "active_requests", REQUESTS_PID, samples)?;
    counter_track(
        &mut sink,
        "engine_running",
        REQUESTS_PID,
        std::mem::take(&mut first.running),
    )?;
    counter_track(
        &mut sink,
        "prefill_tokens",
        REQUESTS_PID,
        std::mem::take(&mut first.prefill),
    )?;
    drop(first.spans);

    // Second pass: the spans, record by record.
    let mut progress = Progress::new("perfetto: writing");
    let mut index = 0usize;
    let mut decode_names: Vec<String> = Vec::new();
    for item in TraceReader::open(&args.trace)? {
        let TraceItem::Record(r) = item? else {
            continue;
        };
        let i = index;
        index += 1;
        let Some(arrival) = r.arrival_ms else {
            continue;
        };
        progress.tick();
        let tid = if args.track_per_request {
            let tid = i as u64 + 1;
            let name = r
                .request_id
                .clone()
                .unwrap_or_else(|| format!("request {i}"));
            sink.metadata("thread_name", REQUESTS_PID, tid, &name)?;
            tid
        } else {
            u64::from(lane_of[i]) + 1
        };
        write_request(&mut sink, &r, arrival, tid, &mut decode_names)?;
    }
    progress.finish();

    let mut steps = 0;
    if let Some(path) = &args.step_stats {
        steps = write_steps(&mut sink, path)?;
    }
    let events = sink.events;
    sink.finish()?;
    Ok(Summary {
        events,
        lanes,
        requests: placed,
        without_arrival: first.without_arrival,
        steps,
    })
}

fn write_request(
    sink: &mut Sink,
    r: &TraceRecord,
    arrival: f64,
    tid: u64,
    names: &mut Vec<String>,
) -> Result<()> {
    let ttft = r.ttft_ms.unwrap_or(0.0);
    let mut args = json!({
        "request_id": r.request_id,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
    });
    if let Some(o) = args.as_object_mut() {
        if let Some(c) = r.cached_tokens {
            o.insert("cached_tokens".into(), json!(c));
        }
        if let Some(c) = r.concurrency {
            o.insert("concurrency".into(), json!(c));
        }
        if let Some(f) = &r.finish_reason {
            o.insert("finish_reason".into(), json!(f));
        }
        if r.incomplete {
            o.insert("incomplete".into(), json!(true));
            if let Some(a) = &r.abort_reason {
                o.insert("abort_reason".into(), json!(a));
            }
        }
    }
    sink.event(&Event {
        name: "prefill",
        ph: "X",
        ts: us(arrival),
        dur: Some(us(ttft).max(0.0)),
        pid: REQUESTS_PID,
        tid,
        cat: Some("request"),
        cname: Some("rail_load"),
        args,
    })?;
    if r.output_tokens == 0 && r.itl_ms.is_empty() {
        return Ok(());
    }
    let chunks = r.chunk_tokens();
    let ids = r.output_token_ids.as_deref();
    let mut at = r.first_chunk_tokens() as usize;
    let mut t = arrival + ttft;
    for (k, gap) in r.itl_ms.iter().enumerate() {
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
        let args = match ids {
            Some(ids) if at < ids.len() => {
                json!({ "token_ids": &ids[at..(at + n).min(ids.len())] })
            }
            _ => Value::Null,
        };
        at += n;
        sink.event(&Event {
            name,
            ph: "X",
            ts: us(t),
            dur: Some(us(*gap).max(0.0)),
            pid: REQUESTS_PID,
            tid,
            cat: Some("request"),
            cname: Some("good"),
            args,
        })?;
        t += gap;
    }
    Ok(())
}

/// The step-stats sidecar: a steps track per engine and the scheduler counters.
fn write_steps(sink: &mut Sink, path: &Path) -> Result<u64> {
    sink.metadata("process_name", STEPS_PID, 0, "scheduler steps")?;
    sink.metadata("thread_name", STEPS_PID, COUNTER_TID, "counters")?;
    let mut running = Vec::new();
    let mut waiting = Vec::new();
    let mut kv = Vec::new();
    let mut accept = Vec::new();
    let mut engines: Vec<(u64, f64)> = Vec::new(); // (engine, end of its last step µs)
    let mut steps = 0u64;
    let mut reader = JsonlReader::open(path)?;
    while let Some(item) = reader.next() {
        let v = item?;
        let line = reader.line();
        let Some(ts_ms) = v.get("ts_ms").and_then(Value::as_f64) else {
            bail!("{}:{line}: a step line without ts_ms", path.display());
        };
        let get = |k: &str| v.get(k).and_then(Value::as_f64);
        let engine = v.get("engine").and_then(Value::as_u64).unwrap_or(0);
        let end = us(ts_ms);
        let tid = engine + 1;
        let prev_end = match engines.iter_mut().find(|(e, _)| *e == engine) {
            Some(e) => std::mem::replace(&mut e.1, end),
            None => {
                sink.metadata(
                    "thread_name",
                    STEPS_PID,
                    tid,
                    &format!("engine {engine} steps"),
                )?;
                engines.push((engine, end));
                f64::NEG_INFINITY
            }
        };
        let step_ms = get("step_ms").unwrap_or(0.0);
        // back to back: a step never starts before the previous one ended
        let start = (end - us(step_ms)).max(prev_end).min(end);
        let run = get("num_running_reqs").unwrap_or(0.0);
        let wait = get("num_waiting_reqs").unwrap_or(0.0);
        let prefill_reqs = get("prefill_requests").unwrap_or(0.0);
        let prefill_tokens = get("prefill_tokens").unwrap_or(0.0);
        let new_tokens = get("new_tokens").unwrap_or(0.0);
        let decodes = (run - prefill_reqs).max(0.0);
        let name = match (prefill_reqs > 0.0, decodes > 0.0) {
            (true, false) => "prefill".to_string(),
            (true, true) => format!(
                "prefill+decode B{} (+{}r {}t)",
                decodes as u64, prefill_reqs as u64, prefill_tokens as u64
            ),
            _ => format!("decode B{}", run as u64),
        };
        let spec = v.get("spec_decoding");
        let (acc, draft) = (
            spec.and_then(|s| s.get("num_accepted_tokens"))
                .and_then(Value::as_f64),
            spec.and_then(|s| s.get("num_draft_tokens"))
                .and_then(Value::as_f64),
        );
        sink.event(&Event {
            name: &name,
            ph: "X",
            ts: start,
            dur: Some(end - start),
            pid: STEPS_PID,
            tid,
            cat: Some("step"),
            cname: Some(if prefill_reqs > 0.0 {
                "rail_load"
            } else {
                "good"
            }),
            args: json!({
                "running": run,
                "waiting": wait,
                "prefill_requests": prefill_reqs,
                "prefill_tokens": prefill_tokens,
                "new_tokens": new_tokens,
                "kv_cache_usage": get("kv_cache_usage"),
                "step_ms": step_ms,
                "spec_accepted": acc,
                "spec_draft": draft,
            }),
        })?;
        running.push((end, run));
        waiting.push((end, wait));
        if let Some(k) = get("kv_cache_usage") {
            kv.push((end, k));
        }
        if let (Some(a), Some(d)) = (acc, draft)
            && d > 0.0
        {
            accept.push((end, a / d));
        }
        steps += 1;
    }
    counter_track(sink, "sched_running_reqs", STEPS_PID, running)?;
    counter_track(sink, "sched_waiting_reqs", STEPS_PID, waiting)?;
    counter_track(sink, "sched_kv_cache_usage", STEPS_PID, kv)?;
    if !accept.is_empty() {
        counter_track(sink, "sched_accept_rate", STEPS_PID, accept)?;
    }
    Ok(steps)
}

pub fn run(args: &PerfettoArgs) -> Result<()> {
    let output = match (&args.output, args.open) {
        (Some(p), _) => Some(p.clone()),
        (None, true) => Some(
            std::env::temp_dir().join(format!("vllm-vcr-perfetto-{}.json", std::process::id())),
        ),
        (None, false) => None,
    };
    let summary = convert(args, output.as_deref())
        .with_context(|| format!("converting {}", args.trace.display()))?;
    if summary.without_arrival > 0 {
        eprintln!(
            "perfetto: {} record(s) have no arrival_ms and cannot be placed on the timeline",
            summary.without_arrival
        );
    }
    if let Some(p) = &output {
        eprintln!(
            "perfetto: wrote {} ({} events, {} requests in {} {}{})",
            p.display(),
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
            println!(
                "{}",
                json!({
                    "output": p,
                    "events": summary.events,
                    "lanes": summary.lanes,
                    "requests": summary.requests,
                    "without_arrival": summary.without_arrival,
                    "steps": summary.steps,
                })
            );
        }
    }
    if args.open {
        let path = output.context("--open needs a file")?;
        serve(&path, args.port)?;
    }
    Ok(())
}

/// Serve `path` to the hosted Perfetto UI until the process is interrupted.
fn serve(path: &Path, port: u16) -> Result<()> {
    use std::net::TcpListener;
    let listener = TcpListener::bind(("127.0.0.1", port))
        .with_context(|| format!("binding 127.0.0.1:{port}"))?;
    let port = listener.local_addr()?.port();
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("trace.json")
        .to_string();
    let url = format!("http://127.0.0.1:{port}/{name}");
    println!("serving {url}");
    println!("open https://ui.perfetto.dev/#!/?url={url}");
    println!("(Ctrl-C to stop)");
    let _ = std::io::stdout().flush();
    let path = path.to_path_buf();
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let path = path.clone();
        let name = name.clone();
        std::thread::spawn(move || {
            if let Err(e) = answer(stream, &path, &name) {
                eprintln!("perfetto: a request failed: {e}");
            }
        });
    }
    Ok(())
}

const CORS: &str = "Access-Control-Allow-Origin: https://ui.perfetto.dev\r\n\
Access-Control-Allow-Methods: GET, OPTIONS\r\n\
Access-Control-Allow-Headers: *\r\n";

fn answer(mut stream: std::net::TcpStream, path: &Path, name: &str) -> std::io::Result<()> {
    use std::io::{BufRead, BufReader};
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
    if method == "OPTIONS" {
        return stream.write_all(
            format!(
                "HTTP/1.1 204 No Content\r\n{CORS}Content-Length: 0\r\nConnection: close\r\n\r\n"
            )
            .as_bytes(),
        );
    }
    let wanted = target.trim_start_matches('/');
    if method != "GET" || (wanted != name && !wanted.is_empty()) {
        return stream.write_all(
            format!(
                "HTTP/1.1 404 Not Found\r\n{CORS}Content-Length: 0\r\nConnection: close\r\n\r\n"
            )
            .as_bytes(),
        );
    }
    let body = std::fs::read(path)?;
    let encoding = if name.ends_with(".gz") {
        "Content-Encoding: gzip\r\n"
    } else {
        ""
    };
    stream.write_all(
        format!(
            "HTTP/1.1 200 OK\r\n{CORS}Content-Type: application/json\r\n{encoding}Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    )?;
    stream.write_all(&body)
}
