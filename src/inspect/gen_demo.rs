//! `inspect gen-demo`: a synthetic trace with heavy-tailed timing, for demos and for
//! checking that a latency model reproduces tails (a mean/std-dev knob model cannot).
//!
//! Per request: prompt and output lengths log-normal; TTFT log-normal with a slow tail
//! (1 request in 20 is a "cold" one, 3x slower); every inter-token gap log-normal with an
//! occasional stall (1 gap in 50 is 4x longer, as when a prefill joins the batch).
//! Deterministic for a given `--seed`. Records carry no arrival times unless
//! `--arrival-rate` asks for a Poisson arrival process.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::json;
use sim_trace::trace::{TraceMeta, TraceRecord, TraceWriter};

use super::progress::Progress;
use crate::play::content::tokens::SplitMix64;

#[derive(Debug, Clone, Args)]
pub struct GenDemoArgs {
    /// Write the trace here (`.gz` → gzip).
    #[arg(short, long, value_name = "PATH")]
    pub output: PathBuf,

    /// Number of request records.
    #[arg(long, default_value_t = 2000)]
    pub records: u64,

    /// Random seed: the same seed writes the same trace.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Small magnitudes for quick end-to-end tests: TTFT median 24 ms (p99 ~90 ms) and ITL
    /// median 5 ms (p99 ~20 ms), short prompts and outputs (default: TTFT median 120 ms,
    /// ITL median 18 ms).
    #[arg(long)]
    pub fast: bool,

    /// Stamp Poisson arrivals at this many requests per second, from 0.00001 to 1000000
    /// (default: no arrival times, like converted client reports).
    #[arg(long, value_name = "REQ_PER_S", value_parser = crate::flag_ranges::rate)]
    pub arrival_rate: Option<f64>,

    /// Print a JSON summary of what was written on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Medians and log-space spreads of the generated distributions.
struct Shape {
    ttft_median_ms: f64,
    ttft_sigma: f64,
    itl_median_ms: f64,
    itl_sigma: f64,
    prompt_median: f64,
    output_median: f64,
    max_output: u32,
}

const DEFAULT: Shape = Shape {
    ttft_median_ms: 120.0,
    ttft_sigma: 0.55,
    itl_median_ms: 18.0,
    itl_sigma: 0.30,
    prompt_median: 512.0,
    output_median: 128.0,
    max_output: 1024,
};

const FAST: Shape = Shape {
    ttft_median_ms: 24.0,
    ttft_sigma: 0.25,
    itl_median_ms: 5.0,
    itl_sigma: 0.25,
    prompt_median: 64.0,
    output_median: 16.0,
    max_output: 64,
};

struct Rng(SplitMix64);

impl Rng {
    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f64 {
        let u1 = self.0.unit().max(f64::MIN_POSITIVE);
        let u2 = self.0.unit();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        median * (sigma * self.normal()).exp()
    }

    fn chance(&mut self, p: f64) -> bool {
        self.0.unit() < p
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

pub fn run(args: &GenDemoArgs) -> Result<()> {
    if args.records == 0 {
        bail!("--records must be at least 1");
    }
    if let Some(r) = args.arrival_rate
        && crate::flag_ranges::rate(&r.to_string()).is_err()
    {
        bail!(
            "--arrival-rate must be between {} and {} requests per second, got {r}",
            crate::flag_ranges::MIN_RATE,
            crate::flag_ranges::MAX_RATE
        );
    }
    let shape = if args.fast { &FAST } else { &DEFAULT };
    let mut meta = TraceMeta::new();
    meta.model = Some(if args.fast { "demo-fast" } else { "demo" }.to_string());
    meta.gpu = Some("synthetic".to_string());
    let mut w = TraceWriter::create(&args.output, &meta)
        .with_context(|| format!("creating {}", args.output.display()))?;
    let mut rng = Rng(SplitMix64(args.seed ^ 0x6e6e_5eed_d3e0_0001));
    let mut clock_ms = 0.0;
    let mut progress = Progress::new("gen-demo: records");
    let mut tokens = 0u64;
    for i in 0..args.records {
        let prompt = rng
            .lognormal(shape.prompt_median, 0.6)
            .round()
            .clamp(1.0, 8192.0) as u32;
        let output = rng
            .lognormal(shape.output_median, 0.7)
            .round()
            .clamp(1.0, f64::from(shape.max_output)) as u32;
        let cold = if rng.chance(0.05) { 3.0 } else { 1.0 };
        let ttft = rng.lognormal(shape.ttft_median_ms, shape.ttft_sigma) * cold;
        let itl_ms: Vec<f64> = (1..output)
            .map(|_| {
                let stall = if rng.chance(0.02) { 4.0 } else { 1.0 };
                round3(rng.lognormal(shape.itl_median_ms, shape.itl_sigma) * stall)
            })
            .collect();
        let arrival_ms = args.arrival_rate.map(|rate| {
            // exponential inter-arrival times
            let gap_s = -(1.0 - rng.0.unit()).ln() / rate;
            if i > 0 {
                clock_ms += gap_s * 1000.0;
            }
            round3(clock_ms)
        });
        tokens += u64::from(output);
        w.write_record(&TraceRecord {
            request_id: Some(format!("demo-{i}")),
            prompt_tokens: prompt,
            output_tokens: output,
            arrival_ms,
            ttft_ms: Some(round3(ttft)),
            itl_ms,
            finish_reason: Some("length".to_string()),
            ..TraceRecord::default()
        })?;
        progress.tick();
    }
    progress.finish();
    w.finish()?;
    if args.json {
        crate::outln!(
            "{}",
            json!({
                "output": args.output,
                "records": args.records,
                "output_tokens": tokens,
                "seed": args.seed,
                "fast": args.fast,
                "arrival_rate": args.arrival_rate,
            })
        );
    } else {
        crate::errln!(
            "gen-demo: wrote {} ({} records, {} output tokens, seed {})",
            args.output.display(),
            args.records,
            tokens,
            args.seed
        );
    }
    Ok(())
}
