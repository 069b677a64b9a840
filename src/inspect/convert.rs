//! `inspect convert`: other tools' formats into the trace schema, and the trace into them.
//!
//! - `--from mooncake` / `--to mooncake`: the Mooncake / "timed trace" JSONL (see
//!   `convert/mooncake.rs`). `--from` then `--to` gives the file back.
//! - `--from guidellm`: a guidellm benchmark report (JSON) → one record per request with
//!   the latencies guidellm measured (see `convert/guidellm.rs`).
//! - `--from vllm-bench`, `--from aiperf`, `--from inference-perf`: the per-request results
//!   of `vllm bench serve --save-detailed`, aiperf's `profile_export.jsonl` and
//!   inference-perf's per-request lifecycle metrics (see `convert/vllm_bench.rs`, `convert/aiperf.rs`,
//!   `convert/inference_perf.rs`; what they share is `convert/client.rs`).
//! - `--from azure`, `--from burstgpt`, `--to azure`: the public CSV request traces as
//!   workloads (see `convert/csv_trace.rs`).
//!
//! Every conversion streams its records, names file and line (or benchmark and request) in
//! its errors, and removes a half-written output when it fails.

mod aiperf;
mod client;
mod csv_trace;
mod guidellm;
mod inference_perf;
mod mooncake;
mod mooncake_line;
mod vllm_bench;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use serde_json::json;
use sim_trace::trace::TraceError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// The Mooncake / timed-trace JSONL: one request a line with `timestamp` (ms),
    /// `input_length`, `output_length` and `hash_ids` (one id per `--block-size` tokens).
    Mooncake,
    /// A guidellm benchmark report (`guidellm run … --output kind=json,path=report.json`;
    /// `.json` or `.json.gz`). `--from` only.
    Guidellm,
    /// `vllm bench serve --save-result --save-detailed` JSON (vllm-rs or Python): per
    /// request `input_lens`, `output_lens`, `ttfts`, `itls`, `start_times`, `errors`.
    /// `--from` only.
    VllmBench,
    /// aiperf's per-request `profile_export.jsonl` (`aiperf profile --export-level
    /// records`). `--from` only.
    Aiperf,
    /// inference-perf's `per_request_lifecycle_metrics.json`
    /// (`report.request_lifecycle.per_request: true`). `--from` only.
    InferencePerf,
    /// The Azure LLM inference trace CSV, `TIMESTAMP,ContextTokens,GeneratedTokens`, as
    /// inference-perf's `trace_replay` reads it: a workload (arrivals and lengths). Both
    /// ways.
    Azure,
    /// The BurstGPT CSV (`Timestamp,Model,Request tokens,Response tokens,Total
    /// tokens,Log Type`): a workload. `--from` only.
    Burstgpt,
}

#[derive(Debug, Clone, Args)]
#[command(
    group(clap::ArgGroup::new("direction").required(true).args(["from", "to"])),
    after_help = "Examples:
  vllm-vcr inspect convert --from mooncake mooncake_trace.jsonl -o trace.jsonl.gz
  vllm-vcr inspect convert --to mooncake trace.jsonl.gz -o timed.jsonl
  vllm-rs bench serve --dataset-name timed_trace --dataset-path timed.jsonl \\
      --timed-trace-chunk-hash-size 16 --timed-trace-sec-multiplier 0.001 ...
  vllm-vcr inspect convert --from guidellm report.json -o trace.jsonl --json
  vllm-vcr inspect convert --from guidellm sweep.json --benchmark 2 -o rate-2.jsonl
  vllm-vcr inspect convert --from vllm-bench result.json -o trace.jsonl
  vllm-vcr inspect convert --from aiperf artifacts/profile_export.jsonl -o trace.jsonl
  vllm-vcr inspect convert --from inference-perf reports/per_request_lifecycle_metrics.json -o trace.jsonl
  vllm-vcr inspect convert --from azure AzureLLMInferenceTrace_conv.csv -o workload.jsonl
  vllm-vcr inspect convert --from burstgpt BurstGPT_1.csv -o workload.jsonl
  vllm-vcr inspect convert --to azure trace.jsonl -o trace.csv   # inference-perf trace_replay"
)]
pub struct ConvertArgs {
    /// Convert INPUT, a file in this format, into a trace.
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub from: Option<Format>,

    /// Convert INPUT, a trace, into this format.
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub to: Option<Format>,

    /// The input file (`.gz` is read transparently).
    pub input: PathBuf,

    /// Where to write the result (a path ending in `.gz` is gzip-compressed). Removed again
    /// if the conversion fails; it may not be the input.
    #[arg(short, long, value_name = "PATH")]
    pub output: PathBuf,

    /// Mooncake only: tokens per hash id. `--from mooncake`: the unit of the file's
    /// `hash_ids` (default 512, as in Mooncake's public traces), stamped in the trace's
    /// meta line. `--to mooncake`: the unit to write (default: the trace's meta
    /// `block_size`); a multiple of the trace's block size merges its block hashes into
    /// coarser ids, anything else is refused.
    #[arg(long, value_name = "TOKENS", value_parser = clap::value_parser!(u32).range(1..))]
    pub block_size: Option<u32>,

    /// guidellm only: also convert requests outside each benchmark's measured window
    /// (warmup, cooldown, or started after the benchmark ended), which guidellm leaves out
    /// of its own metrics. By default they are skipped, so the trace's numbers agree with
    /// the report's.
    #[arg(long)]
    pub all_requests: bool,

    /// guidellm only: convert only this benchmark of the report (0 is the first; a sweep
    /// or `--override profile.streams 1,4` writes several). By default every benchmark is
    /// converted, on one timeline, each record carrying its benchmark's index and strategy
    /// under `"guidellm"`.
    #[arg(long, value_name = "N")]
    pub benchmark: Option<usize>,

    /// Print a JSON summary on stdout: records written, records skipped (counted by
    /// reason, with examples) and notes on what the conversion assumed.
    #[arg(long)]
    pub json: bool,
}

/// How many skipped records are listed one by one (all are counted).
const SKIP_EXAMPLES: usize = 20;

/// What a conversion did.
#[derive(Debug, Default)]
pub struct Report {
    pub written: u64,
    /// Skipped records by reason.
    pub skipped: BTreeMap<String, u64>,
    /// The first few skipped records, each with where it was and why.
    pub skipped_examples: Vec<String>,
    pub notes: Vec<String>,
}

impl Report {
    /// Count a skipped record: `reason` is the category, `detail` where it was.
    pub fn skip(&mut self, reason: &str, detail: impl FnOnce() -> String) {
        *self.skipped.entry(reason.to_string()).or_default() += 1;
        if self.skipped_examples.len() < SKIP_EXAMPLES {
            self.skipped_examples
                .push(format!("{}: {reason}", detail()));
        }
    }

    pub fn skipped_total(&self) -> u64 {
        self.skipped.values().sum()
    }
}

pub use super::output::OutputGuard;

fn check_args(args: &ConvertArgs) -> Result<()> {
    let format = match (args.from, args.to) {
        (Some(_), Some(_)) | (None, None) => bail!("give exactly one of --from and --to"),
        (Some(f), None) | (None, Some(f)) => f,
    };
    if args.block_size.is_some() && format != Format::Mooncake {
        bail!("--block-size applies to the Mooncake format only");
    }
    if args.all_requests && format != Format::Guidellm {
        bail!("--all-requests applies to --from guidellm only");
    }
    if args.benchmark.is_some() && format != Format::Guidellm {
        bail!("--benchmark applies to --from guidellm only");
    }
    if let Some(to) = args.to
        && !matches!(to, Format::Mooncake | Format::Azure)
    {
        bail!(
            "--to {} is not supported: only --to mooncake and --to azure write another tool's format",
            format_name(to)
        );
    }
    crate::io_guard::check_outputs(
        &[crate::io_guard::named("the input file", &args.input)],
        &[crate::io_guard::named("-o", &args.output)],
    )?;
    Ok(())
}

pub fn run(args: &ConvertArgs) -> Result<()> {
    check_args(args)?;
    let mut guard = OutputGuard::new(&args.output);
    let report = match (args.from, args.to) {
        (Some(Format::Mooncake), None) => mooncake::from_mooncake(args, &mut guard)?,
        (None, Some(Format::Mooncake)) => mooncake::to_mooncake(args, &mut guard)?,
        (Some(Format::Guidellm), None) => guidellm::convert(args, &mut guard)?,
        (Some(Format::VllmBench), None) => vllm_bench::convert(args, &mut guard)?,
        (Some(Format::Aiperf), None) => aiperf::convert(args, &mut guard)?,
        (Some(Format::InferencePerf), None) => inference_perf::convert(args, &mut guard)?,
        (Some(Format::Azure), None) => csv_trace::from_azure(args, &mut guard)?,
        (Some(Format::Burstgpt), None) => csv_trace::from_burstgpt(args, &mut guard)?,
        (None, Some(Format::Azure)) => csv_trace::to_azure(args, &mut guard)?,
        _ => unreachable!("checked by check_args"),
    };
    guard.disarm();
    if args.json {
        let summary = json!({
            "from": args.from.map(format_name),
            "to": args.to.map(format_name),
            "input": args.input,
            "output": args.output,
            "written": report.written,
            "skipped": {
                "total": report.skipped_total(),
                "reasons": report.skipped,
                "examples": report.skipped_examples,
            },
            "notes": report.notes,
        });
        let mut out = std::io::stdout().lock();
        writeln!(out, "{summary}").context("writing the summary to stdout")?;
    } else {
        let skipped = report.skipped_total();
        crate::errln!(
            "convert: wrote {} ({} records{})",
            args.output.display(),
            report.written,
            if skipped == 0 {
                String::new()
            } else {
                format!(", {skipped} skipped")
            }
        );
        for (reason, n) in &report.skipped {
            crate::errln!("  skipped {n}: {reason}");
        }
        for s in report.skipped_examples.iter().take(5) {
            crate::errln!("    e.g. {s}");
        }
        for n in &report.notes {
            crate::errln!("  note: {n}");
        }
    }
    Ok(())
}

fn format_name(f: Format) -> &'static str {
    match f {
        Format::Mooncake => "mooncake",
        Format::Guidellm => "guidellm",
        Format::VllmBench => "vllm-bench",
        Format::Aiperf => "aiperf",
        Format::InferencePerf => "inference-perf",
        Format::Azure => "azure",
        Format::Burstgpt => "burstgpt",
    }
}

/// A trace error for anyhow. Write errors keep the I/O error as the cause (a `TraceError`
/// states its cause in its message and has no `source`), so that a closed stdout is still
/// recognised as one.
pub(crate) fn trace_err(e: TraceError) -> anyhow::Error {
    match e {
        TraceError::Write {
            path,
            cause: source,
        } => anyhow::Error::new(source).context(format!("{}: write error", path.display())),
        e => anyhow::Error::msg(e.to_string()),
    }
}
