//! guidellm benchmark reports (JSON, report `metadata.version` 2, guidellm 0.8) → trace
//! records.
//!
//! A report holds one or more benchmarks; each lists its requests by outcome
//! (`requests.successful | errored | incomplete`), every request with guidellm's own
//! per-request figures: `prompt_tokens`, `output_tokens`, `request_start_time` (epoch s),
//! `time_to_first_token_ms`, `inter_token_latency_ms` (the request's mean gap between
//! tokens: (last token − first token) / (output tokens − 1)) and `request_latency`.
//!
//! Mapping, one record per request:
//! - `arrival_ms`: `request_start_time` from the earliest request of the report (benchmarks
//!   of a sweep run one after the other, so they share one timeline);
//! - `ttft_ms`: guidellm's TTFT (client side: it includes the frontend and the network);
//! - `itl_ms`: `output_tokens − 1` gaps, each the request's mean inter-token latency.
//!   guidellm keeps only the first and last token times of a request, so the gaps within a
//!   request are uniform: per-request means, totals and the trace-wide mean ITL are
//!   exact, the spread within a request is not in the report;
//! - `finish_reason`: `length`/`stop` are not reported; successful requests get `stop`
//!   unless they produced `max_tokens` (then `length`); errored and incomplete requests
//!   are `incomplete` records with guidellm's error.
//!
//! The report is one JSON document: it is read whole (reports are megabytes, not
//! gigabytes); the trace is written as a stream.

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::Value;
use sim_trace::trace::{TraceMeta, TraceRecord, TraceWriter};

use super::Report;
use crate::inspect::progress::Progress;

fn read_report(input: &Path) -> Result<Value> {
    let file = std::fs::File::open(input).with_context(|| format!("{}", input.display()))?;
    let reader: Box<dyn std::io::Read> = if input
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gz"))
    {
        Box::new(flate2::read::MultiGzDecoder::new(file))
    } else {
        Box::new(file)
    };
    serde_json::from_reader(std::io::BufReader::new(reader)).map_err(|e| {
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

/// `max_tokens` the client asked for, from guidellm's serialised request arguments.
fn max_tokens(req: &Value) -> Option<u64> {
    let args = req.get("request_args")?;
    let parsed;
    let args = match args {
        Value::String(s) => {
            parsed = serde_json::from_str::<Value>(s).ok()?;
            &parsed
        }
        v => v,
    };
    args.get("body")?.get("max_tokens")?.as_u64()
}

pub fn convert(input: &Path, output: &Path) -> Result<Report> {
    let report = read_report(input)?;
    let Some(benchmarks) = report.get("benchmarks").and_then(Value::as_array) else {
        bail!(
            "{}: no `benchmarks` array: not a guidellm report (guidellm 0.8 writes one with `--output kind=json,path=…`)",
            input.display()
        );
    };
    let version = report
        .get("metadata")
        .and_then(|m| m.get("guidellm_version"))
        .and_then(Value::as_str)
        .unwrap_or("unknown");
    // The timeline's zero: the earliest request start of the whole report.
    let mut zero = f64::INFINITY;
    for b in benchmarks {
        for outcome in ["successful", "errored", "incomplete"] {
            for r in b
                .get("requests")
                .and_then(|q| q.get(outcome))
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if let Some(t) = num(r, "request_start_time") {
                    zero = zero.min(t);
                }
            }
        }
    }
    let mut meta = TraceMeta::new();
    meta.model = benchmarks
        .first()
        .and_then(|b| b.pointer("/config/backend/model"))
        .and_then(Value::as_str)
        .map(str::to_string);
    let mut w = TraceWriter::create(output, &meta)
        .with_context(|| format!("creating {}", output.display()))?;
    let mut out = Report::default();
    let mut progress = Progress::new("convert: requests");
    for (bi, b) in benchmarks.iter().enumerate() {
        let Some(requests) = b.get("requests") else {
            out.skipped.push(format!("benchmark {bi}: no `requests`"));
            continue;
        };
        for outcome in ["successful", "errored", "incomplete"] {
            let Some(list) = requests.get(outcome).and_then(Value::as_array) else {
                continue;
            };
            for (ri, r) in list.iter().enumerate() {
                progress.tick();
                let where_ = format!("benchmark {bi}, {outcome} request {ri}");
                let (Some(prompt), Some(output_tokens)) =
                    (num(r, "prompt_tokens"), num(r, "output_tokens"))
                else {
                    if outcome == "successful" {
                        bail!(
                            "{}: {where_}: no prompt_tokens/output_tokens",
                            input.display()
                        );
                    }
                    out.skipped
                        .push(format!("{where_}: no token counts (never started)"));
                    continue;
                };
                let n = output_tokens.max(0.0) as u32;
                let ttft = num(r, "time_to_first_token_ms");
                let itl = num(r, "inter_token_latency_ms");
                let itl_ms = match (ttft, itl) {
                    (Some(_), Some(g)) if n > 1 => {
                        let g = (g * 1000.0).round() / 1000.0;
                        vec![g; n as usize - 1]
                    }
                    _ => Vec::new(),
                };
                let complete = outcome == "successful";
                let finish = complete.then(|| {
                    if max_tokens(r).is_some_and(|m| m == u64::from(n)) {
                        "length"
                    } else {
                        "stop"
                    }
                });
                let error = r
                    .pointer("/info/error")
                    .and_then(Value::as_str)
                    .map(str::to_string);
                w.write_record(&TraceRecord {
                    request_id: r
                        .get("response_id")
                        .and_then(Value::as_str)
                        .or_else(|| r.get("request_id").and_then(Value::as_str))
                        .map(str::to_string),
                    prompt_tokens: prompt.max(0.0) as u32,
                    cached_tokens: num(r, "cached_tokens").map(|c| c as u32),
                    output_tokens: n,
                    arrival_ms: num(r, "request_start_time")
                        .filter(|_| zero.is_finite())
                        .map(|t| ((t - zero) * 1e6).round() / 1e3),
                    ttft_ms: ttft,
                    itl_ms,
                    finish_reason: finish.map(str::to_string),
                    incomplete: !complete,
                    abort_reason: (!complete).then(|| format!("guidellm: {outcome}")),
                    error,
                    ..TraceRecord::default()
                })?;
                out.written += 1;
            }
        }
    }
    progress.finish();
    w.finish()?;
    out.notes.push(format!(
        "guidellm {version}: {} benchmark(s); inter-token gaps are each request's mean (guidellm keeps only first and last token times)",
        benchmarks.len()
    ));
    Ok(out)
}
