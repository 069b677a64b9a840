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
//! The report is one JSON document, read whole (reports are megabytes, not gigabytes);
//! the trace is written as a stream.

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::Value;
use sim_trace::trace::{TraceMeta, TraceRecord, TraceWriter};

use super::{ConvertArgs, OutputGuard, Report, client, trace_err};
use crate::inspect::progress::Progress;

const OUTCOMES: [&str; 3] = ["successful", "errored", "incomplete"];

fn read_report(input: &Path) -> Result<Value> {
    // gzip by content, and the report bounded like one trace line (it is one document)
    let raw = sim_trace::trace::read_capped(input, sim_trace::trace::max_line_bytes())
        .with_context(|| format!("reading {}", input.display()))?;
    let text = String::from_utf8(raw)
        .map_err(|e| anyhow::anyhow!("{}: not UTF-8 text: {e}", input.display()))?;
    let first = text.trim_start().chars().next();
    if first.is_some_and(|c| c != '{' && c != '[') {
        bail!(
            "{}: not JSON (a YAML report?): only guidellm's JSON reports are read; re-export with `guidellm export {} --output kind=json,path=report.json`",
            input.display(),
            input.display()
        );
    }
    serde_json::from_str(&text).map_err(|e| {
        anyhow::anyhow!(
            "{}:{}:{}: not a guidellm JSON report: {e}",
            input.display(),
            e.line(),
            e.column()
        )
    })
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

/// The request body guidellm sent (serialised as a JSON string in `request_args`).
fn body(req: &Value) -> Option<Value> {
    let args = match req.get("request_args")? {
        Value::String(s) => serde_json::from_str::<Value>(s).ok()?,
        v => v.clone(),
    };
    args.get("body").cloned()
}

/// `finish_reason` of a successful request, as far as the request body tells.
fn finish_reason(req: &Value, output_tokens: u64) -> Option<&'static str> {
    let body = body(req)?;
    let max = body
        .get("max_tokens")
        .or_else(|| body.get("max_completion_tokens"))
        .and_then(Value::as_u64)?;
    let ignore_eos = body.get("ignore_eos").and_then(Value::as_bool) == Some(true);
    if output_tokens >= max {
        Some("length")
    } else if !ignore_eos {
        Some("stop")
    } else {
        None
    }
}

/// One request to convert.
struct Request<'a> {
    benchmark: usize,
    outcome: &'static str,
    index: usize,
    req: &'a Value,
    /// `request_start_time` (epoch s).
    start: Option<f64>,
    /// Where it sorts: its start, else its end.
    order: f64,
}

pub fn convert(args: &ConvertArgs, guard: &mut OutputGuard) -> Result<Report> {
    let input = &args.input;
    let report = read_report(input)?;
    let Some(benchmarks) = report.get("benchmarks").and_then(Value::as_array) else {
        bail!(
            "{}: no `benchmarks` array: not a guidellm report (guidellm 0.8 writes one with `guidellm run … --output kind=json,path=report.json`)",
            input.display()
        );
    };
    let version = report
        .pointer("/metadata/guidellm_version")
        .and_then(Value::as_str)
        .unwrap_or("unknown");
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
    for (bi, b) in benchmarks.iter().enumerate() {
        if args.benchmark.is_some_and(|n| n != bi) {
            continue;
        }
        let Some(lists) = b.get("requests") else {
            out.skip("benchmark without `requests`", || format!("benchmark {bi}"));
            continue;
        };
        let window = (
            num(b, "start_time")
                .or_else(|| b.pointer("/scheduler_metrics/measure_start_time")?.as_f64()),
            num(b, "end_time")
                .or_else(|| b.pointer("/scheduler_metrics/measure_end_time")?.as_f64()),
        );
        for outcome in OUTCOMES {
            let Some(list) = lists.get(outcome).and_then(Value::as_array) else {
                continue;
            };
            let mut in_window = 0u64;
            for (ri, req) in list.iter().enumerate() {
                let where_ = || format!("benchmark {bi}, {outcome} request {ri}");
                let end = num(req, "request_end_time");
                let start = num(req, "request_start_time");
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
                if num(req, "prompt_tokens").is_none() {
                    out.skip("no prompt_tokens (never sent)", where_);
                    continue;
                }
                if outcome == "successful" && num(req, "output_tokens").is_none() {
                    out.skip("successful without output_tokens", where_);
                    continue;
                }
                requests.push(Request {
                    benchmark: bi,
                    outcome,
                    index: ri,
                    req,
                    start,
                    order: start.or(end).unwrap_or(f64::INFINITY),
                });
            }
            // Metrics over fewer requests than listed, or more: guidellm sampled them.
            if let Some(total) = b
                .pointer(&format!("/metrics/request_totals/{outcome}"))
                .and_then(Value::as_u64)
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
        .filter_map(|r| r.start)
        .fold(f64::INFINITY, f64::min);

    let mut meta = TraceMeta::new();
    meta.model = benchmarks
        .iter()
        .find_map(|b| b.pointer("/config/backend/model"))
        .and_then(Value::as_str)
        .map(str::to_string);
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
        start,
        ..
    } in &requests
    {
        progress.tick();
        let bad = |what: &str| {
            anyhow::anyhow!(
                "{}: benchmark {benchmark}, {outcome} request {index}: {what}",
                input.display()
            )
        };
        let count = |key: &str| -> Result<u32> {
            match num(r, key) {
                None => Ok(0),
                Some(v) if v >= 0.0 && v.fract() == 0.0 && v <= f64::from(u32::MAX) => Ok(v as u32),
                Some(v) => Err(bad(&format!("`{key}` {v} is not a token count"))),
            }
        };
        let n = count("output_tokens")?;
        let ttft = num(r, "time_to_first_token_ms");
        let itl = num(r, "inter_token_latency_ms");
        let itl_ms = match (ttft, itl) {
            (Some(_), Some(g)) if n > 1 => {
                // 1 µs resolution: the report's float noise is not worth the bytes.
                let g = (g * 1000.0).round() / 1000.0;
                vec![g; n as usize - 1]
            }
            _ => Vec::new(),
        };
        let complete = *outcome == "successful";
        let status = r
            .pointer("/info/status")
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
            request_id: r
                .get("response_id")
                .and_then(Value::as_str)
                .or_else(|| r.get("request_id").and_then(Value::as_str))
                .map(str::to_string),
            prompt_tokens: count("prompt_tokens")?,
            cached_tokens: num(r, "cached_tokens").map(|c| c as u32),
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
                .then(|| r.pointer("/info/error").and_then(Value::as_str))
                .flatten()
                .map(str::to_string),
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
fn strategy(b: &Value, index: usize) -> std::collections::BTreeMap<String, Value> {
    let mut m = std::collections::BTreeMap::new();
    m.insert("benchmark".to_string(), Value::from(index));
    let s = b.pointer("/config/strategy");
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
