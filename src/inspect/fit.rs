//! `inspect fit`: fit the step latency model to captures and save it, so `play
//! --latency-trace model.json` starts without refitting (`docs/latency-model.md`).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use sim_trace::fitted::{FitInput, fit};

#[derive(Debug, Clone, Args)]
pub struct FitArgs {
    /// Captures to fit (`record --trace-out`; `.gz` too).
    #[arg(required = true, value_name = "TRACE")]
    pub traces: Vec<PathBuf>,

    /// The step-stats sidecars (`record --step-stats-out`) of the traces, in the same
    /// order (the first sidecar goes with the first trace, …); a trace without one is fitted
    /// from its records' per-gap context.
    #[arg(long = "steps", value_name = "SIDECAR")]
    pub steps: Vec<PathBuf>,

    /// Write the model here (`-` for standard output).
    #[arg(short, long, value_name = "PATH")]
    pub output: PathBuf,

    /// Print a JSON summary of the fit on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: &FitArgs) -> Result<()> {
    if a.steps.len() > a.traces.len() {
        bail!(
            "{} sidecars for {} traces: --steps pairs with the traces in order",
            a.steps.len(),
            a.traces.len()
        );
    }
    if a.json && a.output.as_os_str() == "-" {
        bail!("--json and `-o -` both write to standard output: pick one");
    }
    let inputs: Vec<FitInput> = a
        .traces
        .iter()
        .enumerate()
        .map(|(i, t)| FitInput {
            trace: t.clone(),
            steps: a.steps.get(i).cloned(),
        })
        .collect();
    let t = std::time::Instant::now();
    let model = fit(&inputs).context("fitting the latency model")?;
    let secs = t.elapsed().as_secs_f64();
    model
        .save(&a.output)
        .with_context(|| format!("writing {}", a.output.display()))?;
    let steps: u64 = model.sources.iter().map(|s| s.steps_used).sum();
    let records: u64 = model.sources.iter().map(|s| s.records).sum();
    if a.json {
        let summary = serde_json::json!({
            "output": a.output,
            "records": records,
            "steps": steps,
            "seconds": secs,
            "decode_batches": model.decode.iter().map(|d| d.batch).collect::<Vec<_>>(),
            "decode_trend_ms": model.decode_trend_ms,
            "prefill": model.prefill,
            "num_spec_tokens": model.num_spec_tokens,
        });
        println!("{summary}");
    } else {
        let batches: Vec<String> = model
            .decode
            .iter()
            .map(|d| format!("{} ({} steps)", d.batch, d.n))
            .collect();
        eprintln!(
            "fitted {records} records and {steps} steps in {secs:.2} s → {}\n  decode batches: {}\n  decode median ≈ {:.2} + {:.3}·b ms; prefill {:.2} ms + {:.4} ms/token{}",
            a.output.display(),
            batches.join(", "),
            model.decode_trend_ms.0,
            model.decode_trend_ms.1,
            model.prefill.overhead_ms,
            model.prefill.per_token_ms,
            model
                .num_spec_tokens
                .map(|k| format!("; bursts up to {} tokens", k + 1))
                .unwrap_or_default()
        );
    }
    Ok(())
}
