//! aiperf's per-request records (`profile_export.jsonl`, written by `aiperf profile` with
//! `--export-level records` or higher) → trace records.
//!
//! One request a line: `metadata` (`x_request_id`, `request_start_ns` on the Unix clock,
//! `benchmark_phase` `warmup` | `profiling`, `was_cancelled`), `metrics` (each
//! `{"value": …, "unit": "ms" | "tokens" | …}`) and, for a failed request, `error`
//! (`{"type", "message"}`) with only `error_isl` among its metrics. Mapping:
//!
//! - `prompt_tokens`: `usage_prompt_tokens` (the server's count, chat template included)
//!   when the server reported usage, else aiperf's `input_sequence_length` (its tokenizer's
//!   count of the text it sent); the note says by how much the template grew prompts;
//! - `output_tokens`: `usage_completion_tokens`, else `output_sequence_length`;
//! - `reasoning_tokens`: `usage_reasoning_tokens` (the server's usage), when present;
//! - `ttft_ms`: `time_to_first_token`; `itl_ms`: `inter_chunk_latency` (one gap per chunk
//!   after the first, as aiperf measured them);
//! - a failed or cancelled request: an incomplete record with aiperf's error, out of the
//!   quantiles as aiperf leaves it out of its own;
//! - warmup requests are skipped (aiperf's metrics cover the profiling phase only).
//!
//! The file is read a line at a time.

use std::collections::BTreeMap;

use anyhow::{Result, anyhow, bail};
use serde::Deserialize;
use serde_json::Value;
use sim_trace::fastjson;
use sim_trace::trace::JsonlReader;

use super::client::{self, ClientRequest, Run, ms};
use super::{ConvertArgs, OutputGuard, Report, trace_err};

#[derive(Deserialize, Default)]
struct Metadata {
    x_request_id: Option<String>,
    request_start_ns: Option<f64>,
    benchmark_phase: Option<String>,
    #[serde(default)]
    was_cancelled: bool,
    conversation_id: Option<String>,
    turn_index: Option<u64>,
}

#[derive(Deserialize)]
struct Metric {
    value: Value,
    unit: Option<String>,
}

#[derive(Deserialize)]
struct ErrorInfo {
    #[serde(rename = "type")]
    kind: Option<String>,
    message: Option<String>,
}

#[derive(Deserialize)]
struct Line {
    metadata: Option<Metadata>,
    #[serde(default)]
    metrics: BTreeMap<String, Metric>,
    error: Option<ErrorInfo>,
}

/// A duration metric in milliseconds, whatever unit aiperf wrote it in.
fn to_ms(v: f64, unit: Option<&str>) -> Result<f64, String> {
    let scale = match unit.unwrap_or("ms") {
        "ns" => 1e-6,
        "us" => 1e-3,
        "ms" => 1.0,
        "s" | "sec" => 1e3,
        other => return Err(format!("unknown time unit `{other}`")),
    };
    Ok(ms(v * scale))
}

impl Line {
    fn num(&self, key: &str) -> Option<f64> {
        self.metrics.get(key).and_then(|m| m.value.as_f64())
    }

    fn duration(&self, key: &str) -> Result<Option<f64>, String> {
        match self.metrics.get(key) {
            None => Ok(None),
            Some(m) => match m.value.as_f64() {
                Some(v) => to_ms(v, m.unit.as_deref()).map(Some),
                None => Err(format!("`{key}` is not a number")),
            },
        }
    }

    fn gaps(&self, key: &str) -> Result<Vec<f64>, String> {
        let Some(m) = self.metrics.get(key) else {
            return Ok(Vec::new());
        };
        let Some(list) = m.value.as_array() else {
            return Err(format!("`{key}` is not a list"));
        };
        list.iter()
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| format!("`{key}` holds {v}, not a number"))
                    .and_then(|v| to_ms(v, m.unit.as_deref()))
            })
            .collect()
    }
}

pub fn convert(args: &ConvertArgs, guard: &mut OutputGuard) -> Result<Report> {
    let input = &args.input;
    let mut reader = JsonlReader::open(input).map_err(trace_err)?;
    let mut out = Report::default();
    let mut requests = Vec::new();
    let mut template = client::TemplateTokens::default();
    while let Some(item) = reader.next_with(fastjson::from_slice::<Line>) {
        let line_no = reader.line();
        let place = format!("line {line_no}");
        let line = item.map_err(|e| {
            anyhow!(
                "{}: not an aiperf record ({}): {}",
                input.display(),
                place,
                trace_err(e)
            )
        })?;
        let bad = |what: String| anyhow!("{}:{line_no}: {what}", input.display());
        let meta = line.metadata.as_ref();
        let Some(meta) = meta else {
            bail!(bad(
                "no `metadata`: not a line of aiperf's profile_export.jsonl".into()
            ));
        };
        if meta.benchmark_phase.as_deref() == Some("warmup") {
            out.skip("warmup request (not in aiperf's metrics)", || place.clone());
            continue;
        }
        let isl = line.num("input_sequence_length").or(line.num("error_isl"));
        let usage_prompt = line.num("usage_prompt_tokens");
        template.add(usage_prompt, isl);
        let Some(prompt) = usage_prompt.or(isl) else {
            out.skip("no prompt length", || place.clone());
            continue;
        };
        let output = line
            .num("usage_completion_tokens")
            .or(line.num("output_sequence_length"))
            .unwrap_or(0.0);
        let error = match (&line.error, meta.was_cancelled) {
            (Some(e), _) => Some(
                e.message
                    .clone()
                    .or_else(|| e.kind.clone())
                    .unwrap_or_else(|| "error".into()),
            ),
            (None, true) => Some("cancelled".into()),
            (None, false) => None,
        };
        let mut extra = BTreeMap::new();
        if let Some(c) = &meta.conversation_id {
            extra.insert("conversation_id".to_string(), Value::from(c.as_str()));
        }
        if let Some(t) = meta.turn_index {
            extra.insert("turn_index".to_string(), Value::from(t));
        }
        requests.push(ClientRequest {
            id: meta.x_request_id.clone(),
            start_s: meta.request_start_ns.map(|ns| ns / 1e9),
            prompt_tokens: client::token_count(prompt, &place, "prompt tokens")?,
            output_tokens: client::token_count(output, &place, "output tokens")?,
            reasoning_tokens: line
                .num("usage_reasoning_tokens")
                .map(|n| client::token_count(n, &place, "usage_reasoning_tokens"))
                .transpose()?,
            ttft_ms: line.duration("time_to_first_token").map_err(bad)?,
            itl_ms: line.gaps("inter_chunk_latency").map_err(bad)?,
            error,
            extra,
            place,
        });
    }
    out.notes
        .extend(template.note("aiperf's input_sequence_length"));
    let run = Run {
        tool: "aiperf",
        name: "aiperf",
        model: None,
        epoch_clock: true,
    };
    client::write(args, guard, &run, requests, &mut out)?;
    Ok(out)
}
