//! guidellm benchmark reports (JSON, report `metadata.version` 2, written by guidellm 0.8 with
//! `--output kind=json,path=report.json`) → trace records.
//!
//! A report holds one or more benchmarks (a sweep, or `--override profile.streams 1,4`
//! runs several one after the other); each lists its requests by outcome
//! (`requests.successful | errored | incomplete`), every request with guidellm's own
//! per-request figures: `prompt_tokens`, `output_tokens`, `request_start_time` and
//! `request_end_time` (epoch s), `time_to_first_token_ms`, and `inter_token_latency_ms`
//! (the request's mean gap: (last token − first token) / (output tokens − 1)).
//!
//! Mapping, one record per request, in order of request start:
//! - `arrival_ms`: `request_start_time` from the earliest converted request (benchmarks of
//!   one report share one timeline); the meta line's `created_unix_ms` is that zero;
//! - `ttft_ms`: guidellm's TTFT (client side: it includes the frontend and the network);
//! - `itl_ms`: `output_tokens − 1` gaps, each the request's mean inter-token latency.
//!   guidellm keeps only the first and last token times of a request, so the gaps within a
//!   request are uniform: per-request means, totals and the trace-wide mean ITL are exact;
//!   the spread within a request is not in the report;
//! - `finish_reason`: not in the report, so inferred for successful requests only:
//!   `length` when the request produced its `max_tokens`, `stop` when it produced fewer
//!   without `ignore_eos`, none otherwise;
//! - errored and incomplete (cancelled) requests become `incomplete` records with
//!   guidellm's error and the tokens they had, but no `ttft_ms` / `itl_ms`: guidellm's
//!   headline figures (its `successful` statistics) leave them out, and so do the
//!   quantiles of `summarize`, `calibrate` and `compare` when a record carries none. A
//!   TTFT guidellm measured for one is kept as `"guidellm": {"ttft_ms": …}`;
//! - every record says which benchmark it came from under `"guidellm"`: `benchmark` (its
//!   index in the report, 0 first) and `strategy` (`synchronous`, `concurrent`,
//!   `throughput`, `constant`, `poisson` …, with `streams` or `rate` when it has one).
//!   `--benchmark N` converts that benchmark alone.
//!
//! guidellm computes its metrics over each benchmark's measured window (`start_time` …
//! `end_time`, after warmup and before cooldown) and lists requests outside it too (e.g.
//! one started as the benchmark was stopped). Those are skipped, so the trace's counts and
//! means agree with the report's; `--all-requests` keeps them.
//!
//! The report is one JSON document, read with a typed reader that keeps the few fields
//! above for each request and skips the rest (metric distributions, prompts, outputs) as
//! it reads; the trace is written as a stream.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Deserializer};
use serde_json::Value;
use sim_trace::trace::{TraceMeta, TraceRecord, TraceWriter};

use super::{ConvertArgs, OutputGuard, Report, client, trace_err};
use crate::inspect::progress::Progress;

/// The parts of a report this reader uses; the rest (the metric distributions, the
/// prompts and outputs of every request) is skipped as it is read.
#[derive(Deserialize)]
struct ReportIn {
    metadata: Option<MetadataIn>,
    benchmarks: Option<Vec<Benchmark>>,
}

#[derive(Deserialize)]
struct MetadataIn {
    guidellm_version: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Benchmark {
    config: Option<BenchConfig>,
    start_time: Option<f64>,
    end_time: Option<f64>,
    scheduler_metrics: Option<SchedulerMetrics>,
    metrics: Option<Metrics>,
    requests: Option<Lists>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct BenchConfig {
    strategy: Option<BTreeMap<String, Value>>,
    backend: Option<Backend>,
}

#[derive(Deserialize)]
struct Backend {
    model: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct SchedulerMetrics {
    measure_start_time: Option<f64>,
    measure_end_time: Option<f64>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Metrics {
    request_totals: BTreeMap<String, Value>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Lists {
    successful: Vec<Req>,
    errored: Vec<Req>,
    incomplete: Vec<Req>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Req {
    request_id: Option<String>,
    response_id: Option<String>,
    prompt_tokens: Option<f64>,
    output_tokens: Option<f64>,
    cached_tokens: Option<f64>,
    request_start_time: Option<f64>,
    request_end_time: Option<f64>,
    time_to_first_token_ms: Option<f64>,
    inter_token_latency_ms: Option<f64>,
    #[serde(deserialize_with = "limits")]
    request_args: Option<Limits>,
    info: Option<InfoIn>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct InfoIn {
    status: Option<Value>,
    error: Option<Value>,
}

/// What the request body said about its length.
#[derive(Default)]
struct Limits {
    max_tokens: Option<u64>,
    ignore_eos: bool,
}

/// `request_args` (the request guidellm sent, a JSON string or object) down to its
/// length limits; the prompt is dropped as soon as it is read.
fn limits<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Limits>, D::Error> {
    let args = match Value::deserialize(d)? {
        Value::String(s) => serde_json::from_str::<Value>(&s).unwrap_or(Value::Null),
        v => v,
    };
    let Some(body) = args.get("body") else {
        return Ok(None);
    };
    Ok(Some(Limits {
        max_tokens: body
            .get("max_tokens")
            .or_else(|| body.get("max_completion_tokens"))
            .and_then(Value::as_u64),
        ignore_eos: body.get("ignore_eos").and_then(Value::as_bool) == Some(true),
    }))
}

fn read_report(input: &Path) -> Result<ReportIn> {
    let mut reader = client::open_document(input)?;
    // a YAML report is refused with the command that re-exports it
    let first = loop {
        let buf = reader
            .fill_buf()
            .with_context(|| format!("reading {}", input.display()))?;
        match buf.iter().position(|b| !b.is_ascii_whitespace()) {
            Some(i) => break Some(buf[i]),
            None if buf.is_empty() => break None,
            None => {
                let n = buf.len();
                reader.consume(n);
            }
        }
    };
    if first.is_some_and(|c| c != b'{' && c != b'[') {
        bail!(
            "{}: not JSON (a YAML report?): only guidellm's JSON reports are read; re-export with `guidellm export {} --output kind=json,path=report.json`",
            input.display(),
            input.display()
        );
    }
    serde_json::from_reader(reader)
        .map_err(|e| client::json_error(input, e, "not a guidellm JSON report"))
}

/// `finish_reason` of a successful request, as far as the request body tells.
fn finish_reason(req: &Req, output_tokens: u64) -> Option<&'static str> {
    let limits = req.request_args.as_ref()?;
    let max = limits.max_tokens?;
    if output_tokens >= max {
        Some("length")
    } else if !limits.ignore_eos {
        Some("stop")
    } else {
        None
    }
}

/// One request to convert.
struct Request {
    benchmark: usize,
    outcome: &'static str,
    index: usize,
    req: Req,
    /// Where it sorts: its start, else its end.
    order: f64,
}

pub fn convert(args: &ConvertArgs, guard: &mut OutputGuard) -> Result<Report> {
    let input = &args.input;
    let report = read_report(input)?;
    let Some(mut benchmarks) = report.benchmarks else {
        bail!(
            "{}: no `benchmarks` array: not a guidellm report (guidellm 0.8 writes one with `guidellm run … --output kind=json,path=report.json`)",
            input.display()
        );
    };
    let version = report
        .metadata
        .and_then(|m| m.guidellm_version)
        .unwrap_or_else(|| "unknown".into());
    let mut out = Report::default();
    if let Some(n) = args.benchmark
        && n >= benchmarks.len()
    {
        bail!(
            "{}: --benchmark {n}: the report has {} benchmark(s), numbered from 0",
            input.display(),
            benchmarks.len()
        );
    }

    // Pick the requests: the measured window of each benchmark, as guidellm's metrics do.
    let mut requests: Vec<Request> = Vec::new();
    for (bi, b) in benchmarks.iter_mut().enumerate() {
        if args.benchmark.is_some_and(|n| n != bi) {
            continue;
        }
        let Some(lists) = b.requests.take() else {
            out.skip("benchmark without `requests`", || format!("benchmark {bi}"));
            continue;
        };
        let measured = b.scheduler_metrics.as_ref();
        let window = (
            b.start_time.or(measured.and_then(|m| m.measure_start_time)),
            b.end_time.or(measured.and_then(|m| m.measure_end_time)),
        );
        let totals = b.metrics.as_ref().map(|m| &m.request_totals);
        let Lists {
            successful,
            errored,
            incomplete,
        } = lists;
        for (outcome, list) in [
            ("successful", successful),
            ("errored", errored),
            ("incomplete", incomplete),
        ] {
            let mut in_window = 0u64;
            for (ri, req) in list.into_iter().enumerate() {
                let where_ = || format!("benchmark {bi}, {outcome} request {ri}");
                let (start, end) = (req.request_start_time, req.request_end_time);
                // guidellm's `get_within_range`: a request counts if it overlaps the
                // window; one without an end time does not count.
                let inside = match (window, end) {
                    ((Some(ws), Some(we)), Some(end)) => end >= ws && start.unwrap_or(end) <= we,
                    ((Some(_), Some(_)), None) => false,
                    _ => true,
                };
                if inside {
                    in_window += 1;
                } else if !args.all_requests {
                    out.skip(
                        "outside the benchmark's measured window (not in guidellm's metrics; --all-requests keeps it)",
                        where_,
                    );
                    continue;
                }
                if req.prompt_tokens.is_none() {
                    out.skip("no prompt_tokens (never sent)", where_);
                    continue;
                }
                if outcome == "successful" && req.output_tokens.is_none() {
                    out.skip("successful without output_tokens", where_);
                    continue;
                }
                requests.push(Request {
                    benchmark: bi,
                    outcome,
                    index: ri,
                    order: start.or(end).unwrap_or(f64::INFINITY),
                    req,
                });
            }
            // Metrics over fewer requests than listed, or more: guidellm sampled them.
            if let Some(total) = totals.and_then(|t| t.get(outcome)).and_then(Value::as_u64)
                && total != in_window
            {
                out.notes.push(format!(
                    "benchmark {bi}: guidellm's metrics count {total} {outcome} requests, the report lists {in_window} in the measured window (sampled with --metrics sample_size?): the trace holds the listed ones"
                ));
            }
        }
    }
    requests.sort_by(|a, b| a.order.total_cmp(&b.order));
    let zero = requests
        .iter()
        .filter_map(|r| r.req.request_start_time)
        .fold(f64::INFINITY, f64::min);

    let mut meta = TraceMeta::new();
    meta.model = benchmarks
        .iter()
        .find_map(|b| b.config.as_ref()?.backend.as_ref()?.model.clone());
    if zero.is_finite() {
        meta.created_unix_ms = Some((zero * 1000.0).round() as u64);
    }
    guard.arm();
    let mut w = TraceWriter::create(&args.output, &meta).map_err(trace_err)?;
    let mut progress = Progress::new("convert: requests");
    for Request {
        benchmark,
        outcome,
        index,
        req: r,
        ..
    } in &requests
    {
        let start = r.request_start_time;
        progress.tick();
        let bad = |what: &str| {
            anyhow::anyhow!(
                "{}: benchmark {benchmark}, {outcome} request {index}: {what}",
                input.display()
            )
        };
        let count = |key: &str, value: Option<f64>| -> Result<u32> {
            match value {
                None => Ok(0),
                Some(v) if v >= 0.0 && v.fract() == 0.0 && v <= f64::from(u32::MAX) => Ok(v as u32),
                Some(v) => Err(bad(&format!("`{key}` {v} is not a token count"))),
            }
        };
        let n = count("output_tokens", r.output_tokens)?;
        let ttft = r.time_to_first_token_ms;
        let itl = r.inter_token_latency_ms;
        let itl_ms = match (ttft, itl) {
            (Some(_), Some(g)) if n > 1 => {
                // 1 µs resolution: the report's float noise is not worth the bytes.
                let g = (g * 1000.0).round() / 1000.0;
                vec![g; n as usize - 1]
            }
            _ => Vec::new(),
        };
        let complete = *outcome == "successful";
        let info = r.info.as_ref();
        let status = info
            .and_then(|i| i.status.as_ref())
            .and_then(Value::as_str)
            .unwrap_or(outcome);
        let mut extra = strategy(&benchmarks[*benchmark], *benchmark);
        let (ttft, itl_ms) = if complete {
            (ttft, itl_ms)
        } else {
            if let Some(t) = ttft {
                extra.insert("ttft_ms".into(), t.into());
            }
            (None, Vec::new())
        };
        let record = TraceRecord {
            request_id: r.response_id.clone().or_else(|| r.request_id.clone()),
            prompt_tokens: count("prompt_tokens", r.prompt_tokens)?,
            cached_tokens: r.cached_tokens.map(|c| c as u32),
            output_tokens: n,
            arrival_ms: start
                .filter(|_| zero.is_finite())
                .map(|t| ((t - zero) * 1e6).round() / 1e3),
            ttft_ms: ttft,
            itl_ms,
            finish_reason: complete
                .then(|| finish_reason(r, u64::from(n)))
                .flatten()
                .map(str::to_string),
            incomplete: !complete,
            abort_reason: (!complete).then(|| format!("guidellm: {outcome} ({status})")),
            error: (!complete)
                .then(|| info?.error.as_ref())
                .flatten()
                .map(|e| match e {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                }),
            ..TraceRecord::default()
        };
        client::write_line(&mut w, &record, "guidellm", &extra)?;
        out.written += 1;
    }
    progress.finish();
    w.finish().map_err(trace_err)?;
    out.notes.push(format!(
        "guidellm {version}: {} benchmark(s){}; inter-token gaps are each request's mean (guidellm keeps only first and last token times)",
        benchmarks.len(),
        args.benchmark
            .map(|n| format!(", benchmark {n} converted"))
            .unwrap_or_default()
    ));
    Ok(out)
}

/// What a record says about its benchmark: its index and scheduling strategy.
fn strategy(b: &Benchmark, index: usize) -> BTreeMap<String, Value> {
    let mut m = BTreeMap::new();
    m.insert("benchmark".to_string(), Value::from(index));
    let s = b.config.as_ref().and_then(|c| c.strategy.as_ref());
    if let Some(kind) = s.and_then(|s| s.get("type_")).and_then(Value::as_str) {
        m.insert("strategy".to_string(), Value::from(kind));
    }
    for key in ["streams", "rate"] {
        if let Some(v) = s.and_then(|s| s.get(key)).filter(|v| v.is_number()) {
            m.insert(key.to_string(), v.clone());
        }
    }
    m
}
