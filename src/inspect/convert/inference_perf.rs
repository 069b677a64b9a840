//! inference-perf's per-request lifecycle metrics (`per_request_lifecycle_metrics.json`,
//! written with `report.request_lifecycle.per_request: true`) → trace records.
//!
//! The file is a JSON array with one entry per request: `start_time` and `end_time`
//! (seconds on the client's monotonic clock), the raw `request` and `response`, `info`
//! (`input_tokens`, and `response_metrics` with `output_tokens`, `server_usage` when the
//! server sent usage, and for streamed requests `output_token_times`: one time per output
//! token, every token of a chunk at the chunk's arrival) and `error`
//! (`{"error_type", "error_msg"}` or null). Mapping, as inference-perf computes its own
//! metrics:
//!
//! - `prompt_tokens`: the server's `prompt_tokens` when it sent usage (through `/chat`,
//!   with the chat template's tokens: the note says how many), else inference-perf's
//!   `input_tokens`; `output_tokens`: the server's `completion_tokens`, else inference-perf's
//!   `output_tokens` (its tokenizer's count of the text, which can differ: the note counts
//!   such requests);
//! - `reasoning_tokens`: the server's `completion_tokens_details.reasoning_tokens`;
//! - `ttft_ms`: first output token time − `start_time`; `itl_ms`: the differences of
//!   consecutive `output_token_times` (0 within a chunk), which are the samples of
//!   inference-perf's inter-token latency;
//! - a request with an `error`: an incomplete record with it, out of the quantiles as in
//!   inference-perf's `successes` (inference-perf records 0 input tokens for a request that
//!   failed, so its `prompt_tokens` is 0; a note counts them).
//!
//! The array is read entry by entry into the few fields above; the raw request and response
//! text is skipped as it is read.

use anyhow::Result;
use serde::Deserialize;

use super::client::{self, ClientRequest, Run, ms};
use super::{ConvertArgs, OutputGuard, Report};

#[derive(Deserialize, Default)]
struct Usage {
    prompt_tokens: Option<f64>,
    completion_tokens: Option<f64>,
    completion_tokens_details: Option<CompletionDetails>,
}

#[derive(Deserialize, Default)]
struct CompletionDetails {
    reasoning_tokens: Option<f64>,
}

#[derive(Deserialize, Default)]
struct ResponseMetrics {
    output_tokens: Option<f64>,
    server_usage: Option<Usage>,
    #[serde(default)]
    output_token_times: Vec<f64>,
}

#[derive(Deserialize, Default)]
struct Info {
    input_tokens: Option<f64>,
    response_metrics: Option<ResponseMetrics>,
}

#[derive(Deserialize)]
struct ErrorInfo {
    error_type: Option<String>,
    error_msg: Option<String>,
}

#[derive(Deserialize)]
struct Entry {
    start_time: f64,
    #[serde(default)]
    info: Info,
    error: Option<ErrorInfo>,
}

pub fn convert(args: &ConvertArgs, guard: &mut OutputGuard) -> Result<Report> {
    let input = &args.input;
    let file = client::open_document(input)?;
    let entries: Vec<Entry> = serde_json::from_reader(file)
        .map_err(|e| client::json_error(input, e, "not inference-perf's per_request_lifecycle_metrics.json (an array of requests with `start_time`, `info`, `error`)"))?;
    let mut out = Report::default();
    let (mut recounted, mut unmeasured) = (0u64, 0u64);
    let mut template = client::TemplateTokens::default();
    let mut requests = Vec::with_capacity(entries.len());
    for (i, e) in entries.into_iter().enumerate() {
        let place = format!("request {i}");
        let rm = e.info.response_metrics.unwrap_or_default();
        let usage = rm.server_usage.unwrap_or_default();
        template.add(usage.prompt_tokens, e.info.input_tokens);
        let Some(prompt) = usage.prompt_tokens.or(e.info.input_tokens) else {
            out.skip("no prompt length", || place.clone());
            continue;
        };
        let output = match (usage.completion_tokens, rm.output_tokens) {
            (Some(server), Some(client)) => {
                if server != client {
                    recounted += 1;
                }
                server
            }
            (server, client) => server.or(client).unwrap_or(0.0),
        };
        let times = &rm.output_token_times;
        let error = e.error.map(|x| match (x.error_type, x.error_msg) {
            (Some(t), Some(m)) => format!("{t}: {m}"),
            (t, m) => t.or(m).unwrap_or_else(|| "error".into()),
        });
        if error.is_some() && prompt == 0.0 {
            unmeasured += 1;
        }
        requests.push(ClientRequest {
            prompt_tokens: client::token_count(prompt, &place, "input_tokens")?,
            output_tokens: client::token_count(output, &place, "output_tokens")?,
            reasoning_tokens: usage
                .completion_tokens_details
                .as_ref()
                .and_then(|d| d.reasoning_tokens)
                .map(|n| client::token_count(n, &place, "reasoning_tokens"))
                .transpose()?,
            start_s: Some(e.start_time),
            ttft_ms: times.first().map(|t| ms((t - e.start_time) * 1000.0)),
            itl_ms: times
                .windows(2)
                .map(|w| ms((w[1] - w[0]) * 1000.0))
                .collect(),
            error,
            place,
            ..ClientRequest::default()
        });
    }
    out.notes
        .extend(template.note("inference-perf's input_tokens"));
    if unmeasured > 0 {
        out.notes.push(format!(
            "{unmeasured} failed request(s) have no prompt length in inference-perf's file (it counts 0 input tokens for a request that failed): prompt_tokens 0"
        ));
    }
    if recounted > 0 {
        out.notes.push(format!(
            "{recounted} request(s): inference-perf's own output token count differs from the server's usage; the trace has the server's"
        ));
    }
    let run = Run {
        tool: "inference_perf",
        name: "inference-perf",
        model: None,
        epoch_clock: false,
    };
    client::write(args, guard, &run, requests, &mut out)?;
    Ok(out)
}
