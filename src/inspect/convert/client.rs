//! What the load generators' per-request reports have in common, written as a trace.
//!
//! `vllm bench serve`, aiperf and inference-perf each measure every request on the client:
//! when it was sent, its prompt and output lengths, the time to its first token and the
//! gaps between the later ones. Their readers turn each request into a [`ClientRequest`];
//! [`write`] puts them in order of sending, makes the earliest the trace's zero and writes
//! one record each:
//!
//! - `arrival_ms`: the send time from the earliest request (µs resolution);
//! - `reasoning_tokens`: the server's count of the thinking tokens (usage's
//!   `completion_tokens_details.reasoning_tokens`), where the tool keeps it;
//! - `ttft_ms` and `itl_ms`: the tool's own figures, as it measured them (client side, so
//!   they include the frontend and the network);
//! - a request the tool counts as failed becomes an `incomplete` record with the tool's
//!   error and its lengths, but no `ttft_ms` / `itl_ms`: the tools leave failed requests
//!   out of their latency quantiles, and so do `summarize`, `calibrate` and `compare`
//!   when the record carries none. What the tool measured of it is kept under the tool's
//!   key (`"<tool>": {"ttft_ms": …}`), which trace readers ignore.

use std::collections::BTreeMap;

use std::io::Read;
use std::path::Path;

use anyhow::{Context, Result, anyhow};
use serde::Serialize;
use serde_json::Value;
use sim_trace::trace::{TraceMeta, TraceRecord, TraceWriter};

use super::{ConvertArgs, OutputGuard, Report, trace_err};
use crate::inspect::progress::Progress;

/// One request as a load generator reported it.
#[derive(Debug, Default)]
pub struct ClientRequest {
    /// Where it was in the input (`line 12`, `request 3`), for messages.
    pub place: String,
    pub id: Option<String>,
    /// When the client sent it, in seconds on the tool's clock (any zero).
    pub start_s: Option<f64>,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// Of the output, the tokens the server counted as thinking (its usage's
    /// `reasoning_tokens`), when the tool kept them.
    pub reasoning_tokens: Option<u32>,
    pub ttft_ms: Option<f64>,
    /// One gap per output chunk after the first.
    pub itl_ms: Vec<f64>,
    /// The tool's error when it counts the request as failed.
    pub error: Option<String>,
    /// The tool's own facts about the request, kept under the tool's key.
    pub extra: BTreeMap<String, Value>,
}

/// What the trace's meta line says about the run.
#[derive(Debug, Default)]
pub struct Run {
    /// The key of each record's extra facts (`vllm_bench`, `aiperf` …).
    pub tool: &'static str,
    /// The tool as users call it, in notes and abort reasons.
    pub name: &'static str,
    pub model: Option<String>,
    /// `start_s` is on the Unix clock, so the zero is a date (`created_unix_ms`).
    pub epoch_clock: bool,
}

/// A record with the tool's extra facts beside it.
#[derive(Serialize)]
struct RecordLine<'a> {
    #[serde(flatten)]
    record: &'a TraceRecord,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    extra: BTreeMap<&'a str, &'a BTreeMap<String, Value>>,
}

/// Write `record` with `extra` under the key `tool` (none when `extra` is empty): the
/// source's facts the schema has no field for, which trace readers ignore.
pub fn write_line(
    w: &mut TraceWriter,
    record: &TraceRecord,
    tool: &str,
    extra: &BTreeMap<String, Value>,
) -> Result<()> {
    let mut by_tool = BTreeMap::new();
    if !extra.is_empty() {
        by_tool.insert(tool, extra);
    }
    w.write_json(&RecordLine {
        record,
        extra: by_tool,
    })
    .map_err(trace_err)
}

/// How much longer the server's prompts were than the tool's own count of the text it
/// sent: through `/v1/chat/completions`, the chat template's added tokens.
#[derive(Default)]
pub struct TemplateTokens {
    sum: f64,
    n: u64,
}

impl TemplateTokens {
    /// One request's prompt length as the server (usage) and the tool counted it.
    pub fn add(&mut self, server: Option<f64>, tool: Option<f64>) {
        if let (Some(s), Some(t)) = (server, tool)
            && t > 0.0
        {
            self.sum += s - t;
            self.n += 1;
        }
    }

    /// The note for the report, when the server's prompts were longer.
    pub fn note(&self, tool: &str) -> Option<String> {
        (self.n > 0 && self.sum > 0.0).then(|| {
            format!(
                "prompt lengths are the server's (usage): {:.1} tokens a request more than {tool} (the chat template's added tokens)",
                self.sum / self.n as f64
            )
        })
    }
}

/// A whole-document input (a JSON report) for a streaming reader: gunzipped by content,
/// and refused past `--max-line-bytes` (the cap on one trace line, which a document is),
/// so that a small `.gz` cannot keep a reader busy with gigabytes.
pub fn open_document(path: &Path) -> Result<impl std::io::BufRead> {
    let file = sim_trace::trace::open_maybe_gz(path)
        .with_context(|| format!("reading {}", path.display()))?;
    let cap = sim_trace::trace::max_line_bytes();
    Ok(std::io::BufReader::with_capacity(
        1 << 16,
        Capped {
            inner: file,
            left: cap as u64,
            cap,
        },
    ))
}

/// A JSON document's read error: file, line and column, and what the input is not (`not
/// a guidellm JSON report`); a read error (too large, not gzip) as itself.
pub fn json_error(path: &Path, e: serde_json::Error, not_what: &str) -> anyhow::Error {
    if e.is_io() {
        anyhow!("reading {}: {e}", path.display())
    } else {
        anyhow!(
            "{}:{}:{}: {not_what}: {e}",
            path.display(),
            e.line(),
            e.column()
        )
    }
}

/// A reader that fails once more than `cap` bytes came through.
struct Capped<R> {
    inner: R,
    left: u64,
    cap: usize,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.left = self.left.checked_sub(n as u64).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "larger than {} bytes (--max-line-bytes; raise it for a larger document)",
                    self.cap
                ),
            )
        })?;
        Ok(n)
    }
}

/// A token count read from a JSON number; `what` names it in the error.
pub fn token_count(v: f64, place: &str, what: &str) -> Result<u32> {
    if v >= 0.0 && v.fract() == 0.0 && v <= f64::from(u32::MAX) {
        Ok(v as u32)
    } else {
        Err(anyhow!("{place}: `{what}` {v} is not a token count"))
    }
}

/// Milliseconds rounded to 1 µs: the tools' float noise is not worth the bytes.
pub fn ms(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// Write `requests` as a trace (see the module doc) and count them in `out`.
pub fn write(
    args: &ConvertArgs,
    guard: &mut OutputGuard,
    run: &Run,
    mut requests: Vec<ClientRequest>,
    out: &mut Report,
) -> Result<()> {
    let input = args.input.display();
    requests.sort_by(|a, b| {
        let key = |r: &ClientRequest| r.start_s.unwrap_or(f64::INFINITY);
        key(a).total_cmp(&key(b))
    });
    let zero = requests
        .iter()
        .filter_map(|r| r.start_s)
        .fold(f64::INFINITY, f64::min);
    let mut meta = TraceMeta::new();
    meta.model.clone_from(&run.model);
    // the zero's date when the tool's clock has one; never the conversion's
    meta.created_unix_ms =
        (run.epoch_clock && zero.is_finite() && zero > 0.0).then(|| (zero * 1000.0).round() as u64);
    guard.arm();
    let mut w = TraceWriter::create(&args.output, &meta).map_err(trace_err)?;
    let mut progress = Progress::new("convert: requests");
    let (mut failed, mut uneven) = (0u64, 0u64);
    for mut r in requests {
        progress.tick();
        let ok = r.error.is_none();
        if !ok {
            failed += 1;
            if let Some(t) = r.ttft_ms.take() {
                r.extra.insert("ttft_ms".into(), t.into());
            }
            r.itl_ms.clear();
        } else if r.output_tokens > 0 && r.itl_ms.len() as u64 >= u64::from(r.output_tokens) {
            uneven += 1;
        }
        let record = TraceRecord {
            request_id: r.id,
            prompt_tokens: r.prompt_tokens,
            output_tokens: r.output_tokens,
            reasoning_tokens: r.reasoning_tokens,
            arrival_ms: r
                .start_s
                .filter(|_| zero.is_finite())
                .map(|t| ((t - zero) * 1e6).round() / 1e3),
            ttft_ms: r.ttft_ms,
            itl_ms: r.itl_ms,
            incomplete: !ok,
            abort_reason: (!ok).then(|| format!("{}: failed", run.name)),
            error: r.error,
            ..TraceRecord::default()
        };
        record
            .check_times()
            .map_err(|e| anyhow!("{input}: {}: {e}", r.place))?;
        write_line(&mut w, &record, run.tool, &r.extra)?;
        out.written += 1;
    }
    progress.finish();
    w.finish().map_err(trace_err)?;
    if failed > 0 {
        out.notes.push(format!(
            "{failed} request(s) {} counts as failed: incomplete records without TTFT / ITL (out of the quantiles, as in {}'s own)",
            run.name, run.name
        ));
    }
    if uneven > 0 {
        out.notes.push(format!(
            "{uneven} request(s) have as many inter-token gaps as output tokens or more (the tool counted tokens and chunks differently)"
        ));
    }
    Ok(())
}
