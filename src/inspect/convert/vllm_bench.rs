//! `vllm bench serve --save-result --save-detailed` results (JSON) → trace records.
//!
//! Both `vllm-rs bench serve` and the Python `vllm bench serve` write one JSON object with
//! the run's aggregates and, with `--save-detailed`, parallel per-request arrays:
//! `input_lens`, `output_lens`, `ttfts` (s), `itls` (s, one list per request: the gap
//! before each streamed chunk after the first), `start_times` (s; vllm-rs counts from the
//! benchmark's start, Python from `time.perf_counter()`'s zero: either way only the
//! differences matter) and `errors` (`""` when the request succeeded). A failed request
//! has `output_lens` 0 and is counted in `failed`; it becomes an incomplete record with
//! its error, out of the quantiles, as `bench serve` leaves it out of its own.
//!
//! The document is read with a typed reader: the arrays are kept, everything else
//! (`generated_texts` above all) is skipped as it is read, never held.

use anyhow::{Result, bail};
use serde::Deserialize;

use super::client::{self, ClientRequest, Run, ms};
use super::{ConvertArgs, OutputGuard, Report};

/// The keys of a detailed result this reader uses.
#[derive(Deserialize)]
struct Detailed {
    #[serde(default)]
    model_id: Option<String>,
    #[serde(default)]
    completed: Option<u64>,
    #[serde(default)]
    failed: Option<u64>,
    input_lens: Option<Vec<f64>>,
    #[serde(default)]
    output_lens: Vec<f64>,
    #[serde(default)]
    ttfts: Vec<Option<f64>>,
    #[serde(default)]
    itls: Vec<Option<Vec<f64>>>,
    #[serde(default)]
    start_times: Vec<Option<f64>>,
    #[serde(default)]
    errors: Vec<Option<String>>,
}

pub fn convert(args: &ConvertArgs, guard: &mut OutputGuard) -> Result<Report> {
    let input = &args.input;
    let file = client::open_document(input)?;
    let d: Detailed = serde_json::from_reader(file)
        .map_err(|e| client::json_error(input, e, "not a `bench serve` result"))?;
    let Some(input_lens) = d.input_lens else {
        bail!(
            "{}: no `input_lens`: not a detailed `bench serve` result (run it with --save-result --save-detailed)",
            input.display()
        );
    };
    let n = input_lens.len();
    if d.start_times.len() != n || d.ttfts.len() != n {
        bail!(
            "{}: {n} requests in `input_lens` but {} `start_times` and {} `ttfts`: written without --save-detailed?",
            input.display(),
            d.start_times.len(),
            d.ttfts.len()
        );
    }
    let mut requests = Vec::with_capacity(n);
    for (i, prompt) in input_lens.iter().enumerate() {
        let place = format!("request {i}");
        let error = d.errors.get(i).cloned().flatten().filter(|e| !e.is_empty());
        let output = d.output_lens.get(i).copied().unwrap_or(0.0);
        let itl_ms = d
            .itls
            .get(i)
            .cloned()
            .flatten()
            .unwrap_or_default()
            .into_iter()
            .map(|s| ms(s * 1000.0))
            .collect();
        requests.push(ClientRequest {
            prompt_tokens: client::token_count(*prompt, &place, "input_lens")?,
            output_tokens: client::token_count(output, &place, "output_lens")?,
            start_s: d.start_times[i],
            // a failed request's ttft is 0.0: not a measurement
            ttft_ms: d.ttfts[i]
                .filter(|_| error.is_none())
                .map(|s| ms(s * 1000.0)),
            itl_ms,
            error,
            place,
            ..ClientRequest::default()
        });
    }
    let mut out = Report::default();
    let failed = requests.iter().filter(|r| r.error.is_some()).count() as u64;
    if let (Some(c), Some(f)) = (d.completed, d.failed)
        && (c + f != n as u64 || f != failed)
    {
        out.notes.push(format!(
            "the result says {c} completed and {f} failed; its arrays hold {n} requests, {failed} with an error"
        ));
    }
    let run = Run {
        tool: "vllm_bench",
        name: "bench serve",
        model: d.model_id,
        epoch_clock: false,
    };
    client::write(args, guard, &run, requests, &mut out)?;
    out.notes.push(
        "arrival times are relative to the first request (the result has no wall-clock start per request)"
            .to_string(),
    );
    Ok(out)
}
