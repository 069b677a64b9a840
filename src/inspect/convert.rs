//! `inspect convert`: other tools' formats into the trace schema, and the trace into them.
//!
//! - `--from mooncake`: the Mooncake / "timed trace" JSONL (`timestamp` ms, `input_length`,
//!   `output_length`, `hash_ids` — one id per `--block-size` tokens) → trace records with
//!   `arrival_ms`, `prompt_tokens`, `output_tokens`, `block_hashes` (no timings: the format
//!   has none). The block size goes into the meta line.
//! - `--to mooncake`: the reverse, so traces drive `vllm-rs bench serve --dataset-name
//!   timed_trace` and other simulators. `--from` then `--to` gives back the same values.
//! - `--from guidellm`: a guidellm benchmark report (JSON) → one record per request with
//!   the latencies guidellm measured (see [`guidellm`]).

mod guidellm;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use serde_json::{Map, Value, json};
use sim_trace::trace::{
    BlockHash, JsonlReader, TraceItem, TraceMeta, TraceReader, TraceRecord, TraceWriter,
};

use super::progress::Progress;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// The Mooncake / timed-trace JSONL (`timestamp`, `input_length`, `output_length`,
    /// `hash_ids`).
    Mooncake,
    /// A guidellm benchmark report (`guidellm benchmark … --output-path report.json`);
    /// `--from` only.
    Guidellm,
}

#[derive(Debug, Clone, Args)]
#[command(group(clap::ArgGroup::new("direction").required(true).args(["from", "to"])))]
pub struct ConvertArgs {
    /// Convert INPUT from this format into a trace.
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub from: Option<Format>,

    /// Convert the trace INPUT into this format.
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub to: Option<Format>,

    /// The input file (`.gz` read transparently).
    pub input: PathBuf,

    /// Write the result here (`.gz` → gzip).
    #[arg(short, long, value_name = "PATH")]
    pub output: PathBuf,

    /// Tokens per hash id (Mooncake's public traces use 512; traces recorded by the tap
    /// hash blocks of the engine's block size, usually 16). `--from mooncake` stamps it in
    /// the meta line; `--to mooncake` checks it against the trace's.
    #[arg(long, value_name = "TOKENS")]
    pub block_size: Option<u32>,

    /// Print a JSON summary of the conversion on stdout.
    #[arg(long)]
    pub json: bool,
}

/// What a conversion did.
#[derive(Debug, Default)]
pub struct Report {
    pub written: u64,
    pub skipped: Vec<String>,
    pub notes: Vec<String>,
}

pub fn run(args: &ConvertArgs) -> Result<()> {
    let report = match (args.from, args.to) {
        (Some(Format::Mooncake), None) => from_mooncake(args)?,
        (Some(Format::Guidellm), None) => guidellm::convert(&args.input, &args.output)?,
        (None, Some(Format::Mooncake)) => to_mooncake(args)?,
        (None, Some(Format::Guidellm)) => {
            bail!("--to guidellm is not supported: guidellm reports are produced by guidellm")
        }
        _ => bail!("give exactly one of --from and --to"),
    };
    if args.json {
        println!(
            "{}",
            json!({
                "input": args.input,
                "output": args.output,
                "written": report.written,
                "skipped": report.skipped,
                "notes": report.notes,
            })
        );
    } else {
        eprintln!(
            "convert: wrote {} ({} records{})",
            args.output.display(),
            report.written,
            if report.skipped.is_empty() {
                String::new()
            } else {
                format!(", {} skipped", report.skipped.len())
            }
        );
        for s in report.skipped.iter().take(10) {
            eprintln!("  skipped: {s}");
        }
        for n in &report.notes {
            eprintln!("  note: {n}");
        }
    }
    Ok(())
}

/// Mooncake's public traces hash 512-token blocks.
const MOONCAKE_BLOCK_SIZE: u32 = 512;

fn line_error(path: &Path, line: u64, what: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("{}:{line}: {what}", path.display())
}

fn uint(path: &Path, line: u64, obj: &Map<String, Value>, key: &str) -> Result<u64> {
    match obj.get(key) {
        Some(v) => v
            .as_u64()
            .or_else(|| {
                v.as_f64()
                    .filter(|f| *f >= 0.0 && f.fract() == 0.0)
                    .map(|f| f as u64)
            })
            .ok_or_else(|| {
                line_error(
                    path,
                    line,
                    format!("`{key}` must be a non-negative integer, got {v}"),
                )
            }),
        None => Err(line_error(path, line, format!("missing `{key}`"))),
    }
}

fn from_mooncake(args: &ConvertArgs) -> Result<Report> {
    let block_size = args.block_size.unwrap_or(MOONCAKE_BLOCK_SIZE);
    let mut meta = TraceMeta::new();
    meta.block_size = Some(block_size);
    let mut w = TraceWriter::create(&args.output, &meta)
        .with_context(|| format!("creating {}", args.output.display()))?;
    let mut reader = JsonlReader::open(&args.input)?;
    let mut report = Report::default();
    let mut extra_keys = std::collections::BTreeSet::new();
    let mut progress = Progress::new("convert: lines");
    let mut index = 0u64;
    while let Some(item) = reader.next() {
        let value = item?;
        let line = reader.line();
        progress.tick();
        let Value::Object(obj) = value else {
            bail!(line_error(&args.input, line, "expected a JSON object"));
        };
        let timestamp = obj
            .get("timestamp")
            .and_then(Value::as_f64)
            .ok_or_else(|| line_error(&args.input, line, "missing or non-numeric `timestamp`"))?;
        let input_length = uint(&args.input, line, &obj, "input_length")?;
        let output_length = uint(&args.input, line, &obj, "output_length")?;
        let hash_ids = match obj.get("hash_ids") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(ids)) => ids
                .iter()
                .map(|v| match v {
                    Value::Number(n) if n.as_u64().is_some() => {
                        Ok(BlockHash::Int(n.as_u64().unwrap_or_default()))
                    }
                    Value::String(s) => Ok(BlockHash::Str(s.clone())),
                    other => Err(line_error(
                        &args.input,
                        line,
                        format!("`hash_ids` holds {other}, not an id"),
                    )),
                })
                .collect::<Result<Vec<_>>>()?,
            Some(other) => bail!(line_error(
                &args.input,
                line,
                format!("`hash_ids` must be an array, got {other}")
            )),
        };
        for k in obj.keys() {
            if !matches!(
                k.as_str(),
                "timestamp" | "input_length" | "output_length" | "hash_ids"
            ) {
                extra_keys.insert(k.clone());
            }
        }
        let to_u32 = |v: u64, key: &str| {
            u32::try_from(v)
                .map_err(|_| line_error(&args.input, line, format!("`{key}` {v} is too large")))
        };
        w.write_record(&TraceRecord {
            request_id: Some(format!("mooncake-{index}")),
            prompt_tokens: to_u32(input_length, "input_length")?,
            output_tokens: to_u32(output_length, "output_length")?,
            arrival_ms: Some(timestamp),
            block_hashes: hash_ids,
            ..TraceRecord::default()
        })?;
        index += 1;
        report.written += 1;
    }
    progress.finish();
    w.finish()?;
    if !extra_keys.is_empty() {
        report.notes.push(format!(
            "keys the trace schema has no place for were dropped: {}",
            extra_keys.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    Ok(report)
}

/// One Mooncake line, keys in the format's order.
#[derive(serde::Serialize)]
struct MooncakeLine {
    timestamp: Value,
    input_length: u32,
    output_length: u32,
    hash_ids: Vec<Value>,
}

/// Write a number as Mooncake does: integers without a fraction.
fn number(x: f64) -> Value {
    if x.fract() == 0.0 && x.abs() < 9.0e15 {
        json!(x as i64)
    } else {
        json!(x)
    }
}

fn to_mooncake(args: &ConvertArgs) -> Result<Report> {
    let mut reader = TraceReader::open(&args.input)?;
    let mut out = TraceWriter::create_without_meta(&args.output)
        .with_context(|| format!("creating {}", args.output.display()))?;
    let mut report = Report::default();
    let mut trace_block_size: Option<u32> = None;
    // String hashes (converted workloads) become dense integer ids, in first-seen order.
    let mut string_ids: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    let mut progress = Progress::new("convert: records");
    while let Some(item) = reader.next() {
        let record = match item? {
            TraceItem::Meta(m) => {
                trace_block_size = m.block_size;
                if let (Some(want), Some(have)) = (args.block_size, m.block_size)
                    && want != have
                {
                    bail!(
                        "{}: the trace's block hashes cover {have} tokens each (meta block_size); \
                         --block-size {want} would misstate them (pass --block-size {have})",
                        args.input.display()
                    );
                }
                continue;
            }
            TraceItem::Record(r) => r,
        };
        progress.tick();
        let Some(arrival) = record.arrival_ms else {
            report.skipped.push(format!(
                "{}:{}: no arrival_ms (a timed trace needs one)",
                args.input.display(),
                reader.line()
            ));
            continue;
        };
        let next_id = string_ids.len() as u64;
        let hash_ids: Vec<Value> = record
            .block_hashes
            .iter()
            .map(|h| match h {
                BlockHash::Int(v) => json!(v),
                BlockHash::Str(s) => json!(*string_ids.entry(s.clone()).or_insert(next_id)),
            })
            .collect();
        out.write_json(&MooncakeLine {
            timestamp: number(arrival),
            input_length: record.prompt_tokens,
            output_length: record.output_tokens,
            hash_ids,
        })?;
        report.written += 1;
    }
    progress.finish();
    out.finish()?;
    if !string_ids.is_empty() {
        report.notes.push(format!(
            "{} string block hashes were numbered in first-seen order",
            string_ids.len()
        ));
    }
    let bs = args
        .block_size
        .or(trace_block_size)
        .unwrap_or(MOONCAKE_BLOCK_SIZE);
    report.notes.push(format!(
        "each hash id stands for {bs} tokens: replay with `vllm-rs bench serve --dataset-name timed_trace --dataset-path {} --timed-trace-chunk-hash-size {bs} --timed-trace-sec-multiplier 0.001`",
        args.output.display()
    ));
    Ok(report)
}
