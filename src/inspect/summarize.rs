//! `inspect summarize`: one pass over a trace, constant memory.
//!
//! Quantiles come from log-bucketed histograms (within 0.5 % of the exact nearest-rank
//! value; minimum and maximum exact). Concurrency is summarised without sorting the trace:
//! the mean number of requests in flight is Little's law (total request time over the
//! trace's span), and the distribution of `concurrency` at arrival comes from the records
//! when the trace has it (tap captures do).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::{Value, json};
use sim_trace::stats::Histogram;
use sim_trace::trace::{TraceItem, TraceMeta, TraceReader, TraceRecord};

use super::progress::Progress;

#[derive(Debug, Clone, Args)]
pub struct SummarizeArgs {
    /// The trace (JSONL; `.gz` read transparently).
    pub trace: PathBuf,

    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Everything `summarize` reports, built in one streaming pass.
#[derive(Debug, Default)]
pub struct Summary {
    pub meta: Option<TraceMeta>,
    pub records: u64,
    pub incomplete: u64,
    pub without_arrival: u64,
    pub first_arrival_ms: Option<f64>,
    pub last_arrival_ms: Option<f64>,
    /// Latest end (arrival + TTFT + gaps) of a record with an arrival.
    pub last_end_ms: Option<f64>,
    /// Sum of request totals (ms) of records with an arrival and a TTFT.
    busy_ms: f64,
    pub ttft_ms: Histogram,
    pub itl_ms: Histogram,
    pub total_ms: Histogram,
    pub output_tokens: Histogram,
    pub prompt_tokens: Histogram,
    pub concurrency: Histogram,
    pub finish_reasons: BTreeMap<String, u64>,
    pub prompt_tokens_with_cache_info: u64,
    pub cached_tokens: u64,
    /// Output chunks by size (tokens per chunk, first chunks included), of records with
    /// timing.
    pub chunk_sizes: BTreeMap<u32, u64>,
    /// What the reader warned about: a trace that ends early (a killed or disk-full
    /// capture), no meta line.
    pub warnings: Vec<String>,
}

impl Summary {
    /// An empty summary, to [`add`](Self::add) records to.
    pub fn new() -> Summary {
        Summary {
            ttft_ms: Histogram::new(),
            itl_ms: Histogram::new(),
            total_ms: Histogram::new(),
            output_tokens: Histogram::for_integers(),
            prompt_tokens: Histogram::for_integers(),
            concurrency: Histogram::for_integers(),
            ..Summary::default()
        }
    }

    /// Read `path` to the end. A gzip trace cut short (a killed or disk-full capture) is
    /// summarized up to its last complete record, with a warning; a bad line is an error
    /// naming the file and line.
    pub fn of(path: &std::path::Path) -> Result<Summary> {
        let mut s = Summary::new();
        let mut progress = Progress::new("summarize: records");
        for item in TraceReader::open(path)? {
            let item = match item {
                Ok(item) => item,
                Err(e @ sim_trace::trace::TraceError::Truncated { .. }) => {
                    s.warnings.push(format!(
                        "the trace ends early ({e}): summarizing its {} complete record(s)",
                        s.records
                    ));
                    break;
                }
                Err(e) => return Err(e.into()),
            };
            match item {
                TraceItem::Meta(m) => {
                    if let Some(w) = m.newer_schema_warning()
                        && !s.warnings.contains(&w)
                    {
                        s.warnings.push(w);
                    }
                    if s.meta.is_none() {
                        s.meta = Some(m);
                    }
                }
                TraceItem::Record(r) => {
                    progress.tick();
                    s.add(&r);
                }
            }
        }
        progress.finish();
        if s.meta.is_none() {
            s.warnings.push(if s.records == 0 {
                "the trace is empty: no meta line and no record".to_string()
            } else {
                "the trace has no meta line (not written by vllm-vcr, or its start was lost)"
                    .to_string()
            });
        }
        Ok(s)
    }

    /// Count one record.
    pub fn add(&mut self, r: &TraceRecord) {
        self.records += 1;
        if r.incomplete {
            self.incomplete += 1;
        }
        let reason = r.finish_reason.as_deref().unwrap_or("(none)");
        match self.finish_reasons.get_mut(reason) {
            Some(n) => *n += 1,
            None => {
                self.finish_reasons.insert(reason.to_string(), 1);
            }
        }
        self.prompt_tokens.push(f64::from(r.prompt_tokens));
        self.output_tokens.push(f64::from(r.output_tokens));
        if let Some(c) = r.cached_tokens {
            self.prompt_tokens_with_cache_info += u64::from(r.prompt_tokens);
            self.cached_tokens += u64::from(c.min(r.prompt_tokens));
        }
        if let Some(c) = r.concurrency {
            self.concurrency.push(f64::from(c));
        }
        let gaps: f64 = r.itl_ms.iter().sum();
        for g in &r.itl_ms {
            self.itl_ms.push(*g);
        }
        // a record without timing (a converted Mooncake line) has no chunks to count
        if r.output_tokens > 0 && r.ttft_ms.is_some() {
            *self.chunk_sizes.entry(r.first_chunk_tokens()).or_default() += 1;
            if r.itl_tokens.is_empty() {
                // every chunk after the first is one token: one count for them all, not
                // a map update per gap
                if !r.itl_ms.is_empty() {
                    *self.chunk_sizes.entry(1).or_default() += r.itl_ms.len() as u64;
                }
            } else {
                for &n in &r.itl_tokens {
                    *self.chunk_sizes.entry(n).or_default() += 1;
                }
            }
        }
        let total = r.ttft_ms.map(|t| t + gaps);
        if let Some(t) = r.ttft_ms {
            self.ttft_ms.push(t);
        }
        if let Some(total) = total {
            self.total_ms.push(total);
        }
        match r.arrival_ms {
            None => self.without_arrival += 1,
            Some(a) => {
                self.first_arrival_ms = Some(self.first_arrival_ms.map_or(a, |f: f64| f.min(a)));
                self.last_arrival_ms = Some(self.last_arrival_ms.map_or(a, |l: f64| l.max(a)));
                let end = a + total.unwrap_or(0.0);
                self.last_end_ms = Some(self.last_end_ms.map_or(end, |e: f64| e.max(end)));
                self.busy_ms += total.unwrap_or(0.0);
            }
        }
    }

    /// From the first arrival to the last end, ms.
    pub fn duration_ms(&self) -> Option<f64> {
        Some(self.last_end_ms? - self.first_arrival_ms?)
    }

    /// Arrivals per second between the first and the last arrival.
    pub fn arrival_rate(&self) -> Option<f64> {
        let span = self.last_arrival_ms? - self.first_arrival_ms?;
        let with_arrival = self.records - self.without_arrival;
        (span > 0.0 && with_arrival > 1).then(|| (with_arrival - 1) as f64 / (span / 1000.0))
    }

    /// Mean requests in flight over the trace's span (Little's law).
    pub fn mean_concurrency(&self) -> Option<f64> {
        let d = self.duration_ms()?;
        // records without timing have no busy time: no concurrency to tell
        (d > 0.0 && self.busy_ms > 0.0).then(|| self.busy_ms / d)
    }

    /// Chunk sizes for the report: as they are when there are a few, else in power-of-two
    /// ranges (`1`, `2-3`, `4-7`, …).
    pub fn chunk_size_buckets(&self) -> Vec<(String, u64)> {
        if self.chunk_sizes.len() <= 12 {
            return self
                .chunk_sizes
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect();
        }
        let mut buckets: BTreeMap<u32, u64> = BTreeMap::new();
        for (k, v) in &self.chunk_sizes {
            let lo = if *k == 0 {
                0
            } else {
                1 << (31 - k.leading_zeros())
            };
            *buckets.entry(lo).or_default() += v;
        }
        buckets
            .into_iter()
            .map(|(lo, v)| {
                let hi = if lo <= 1 { lo } else { lo * 2 - 1 };
                let label = if lo == hi {
                    lo.to_string()
                } else {
                    format!("{lo}-{hi}")
                };
                (label, v)
            })
            .collect()
    }

    pub fn prefix_cache_hit_ratio(&self) -> Option<f64> {
        (self.prompt_tokens_with_cache_info > 0)
            .then(|| self.cached_tokens as f64 / self.prompt_tokens_with_cache_info as f64)
    }

    pub fn to_json(&self) -> Value {
        let h = |h: &Histogram| -> Value {
            if h.is_empty() {
                return Value::Null;
            }
            json!({
                "count": h.count(),
                "mean": h.mean(),
                "p50": h.quantile(0.5),
                "p90": h.quantile(0.9),
                "p99": h.quantile(0.99),
                "max": h.max(),
            })
        };
        json!({
            "meta": self.meta,
            "records": self.records,
            "incomplete": self.incomplete,
            "without_arrival": self.without_arrival,
            "duration_ms": self.duration_ms(),
            "arrival_rate_per_s": self.arrival_rate(),
            "mean_concurrency": self.mean_concurrency(),
            "concurrency_at_arrival": h(&self.concurrency),
            "ttft_ms": h(&self.ttft_ms),
            "itl_ms": h(&self.itl_ms),
            "request_total_ms": h(&self.total_ms),
            "output_tokens": h(&self.output_tokens),
            "prompt_tokens": h(&self.prompt_tokens),
            "finish_reasons": self.finish_reasons,
            "prefix_cache_hit_ratio": self.prefix_cache_hit_ratio(),
            "chunk_sizes": self.chunk_sizes.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "warnings": self.warnings,
        })
    }
}

fn fmt(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(x) if x.abs() >= 100.0 => format!("{x:.1}"),
        Some(x) => format!("{x:.2}"),
    }
}

pub fn run(args: &SummarizeArgs) -> Result<()> {
    let s = Summary::of(&args.trace)
        .with_context(|| format!("summarizing {}", args.trace.display()))?;
    for w in &s.warnings {
        crate::errln!("warning: {}: {w}", args.trace.display());
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &s.to_json())?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(out, "trace: {}", args.trace.display())?;
    s.write_text(&mut out)?;
    Ok(())
}

impl Summary {
    /// The human-readable report (what `inspect summarize` prints after the trace's name).
    pub fn write_text(&self, out: &mut impl Write) -> std::io::Result<()> {
        let s = self;
        if let Some(m) = &s.meta {
            let field = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
            writeln!(
                out,
                "meta: model {}, gpu {}, vllm {}, block size {}, config hash {}",
                field(&m.model),
                field(&m.gpu),
                field(&m.vllm_version),
                m.block_size.map_or("-".into(), |b| b.to_string()),
                field(&m.config_hash)
            )?;
        }
        writeln!(
            out,
            "requests: {} ({} incomplete, {} without arrival time)",
            s.records, s.incomplete, s.without_arrival
        )?;
        writeln!(
            out,
            "duration: {} ms; arrival rate {} req/s; mean concurrency {}",
            fmt(s.duration_ms()),
            fmt(s.arrival_rate()),
            fmt(s.mean_concurrency())
        )?;
        writeln!(
            out,
            "\n{:<24} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "", "count", "mean", "p50", "p90", "p99", "max"
        )?;
        for (name, h) in [
            ("ttft (ms)", &s.ttft_ms),
            ("itl (ms)", &s.itl_ms),
            ("request total (ms)", &s.total_ms),
            ("output tokens", &s.output_tokens),
            ("prompt tokens", &s.prompt_tokens),
            ("concurrency at arrival", &s.concurrency),
        ] {
            writeln!(
                out,
                "{:<24} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10}",
                name,
                h.count(),
                fmt(h.mean()),
                fmt(h.quantile(0.5)),
                fmt(h.quantile(0.9)),
                fmt(h.quantile(0.99)),
                fmt(h.max())
            )?;
        }
        let reasons: Vec<String> = s
            .finish_reasons
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        writeln!(out, "\nfinish reasons: {}", reasons.join(", "))?;
        writeln!(
            out,
            "prefix-cache hit ratio: {}",
            s.prefix_cache_hit_ratio().map_or(
                "- (no cached_tokens in the trace)".into(),
                |r| format!("{:.1} % of prompt tokens", r * 100.0)
            )
        )?;
        let chunks: Vec<String> = s
            .chunk_size_buckets()
            .iter()
            .map(|(k, v)| format!("{k} token{}: {v}", if k == "1" { "" } else { "s" }))
            .collect();
        if chunks.is_empty() {
            writeln!(out, "output chunks: - (no timing in the trace)")?;
        } else {
            writeln!(out, "output chunks: {}", chunks.join(", "))?;
        }
        Ok(())
    }
}
