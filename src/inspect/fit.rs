//! `inspect fit`: fit the step latency model to captures and save it, so `play
//! --latency-trace model.json` starts without refitting (`docs/latency-model.md`).
//!
//! Sidecars are paired explicitly (`--steps`, in the traces' order), never picked up from
//! the trace's folder: a capture rig writes `steps.jsonl.gz` next to every trace, and a
//! stale one from another run would fit silently wrong (the fit refuses a sidecar whose
//! steps do not line up with the trace, but one that partly does would pass). A trace
//! fitted without a sidecar that has one beside it gets a note saying so.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::json;
use sim_trace::fit::{FitInput, FitOptions, FittedModel, InputKind, fit_with, sniff};

use crate::io_guard::{check_outputs, named};

#[derive(Debug, Clone, Args)]
pub struct FitArgs {
    /// Captures to fit (`record --trace-out`; `.gz` read transparently). Several captures
    /// of the same engine fit one model.
    #[arg(required = true, value_name = "TRACE")]
    pub traces: Vec<PathBuf>,

    /// The step-stats sidecars (`record --step-stats-out`) of the traces, in the traces'
    /// order (the first goes with the first trace, …): `--steps a b` or `--steps a --steps
    /// b`. Traces after the last sidecar are fitted from their records alone.
    #[arg(long = "steps", value_name = "SIDECAR", num_args = 1..)]
    pub steps: Vec<PathBuf>,

    /// Write the model here (`-` for standard output).
    #[arg(short, long, value_name = "PATH")]
    pub output: PathBuf,

    /// Print a JSON summary of the fit on standard output.
    #[arg(long)]
    pub json: bool,

    /// Fit one host speed per capture (written into the model's sources) and the law on
    /// the captures brought to their average speed. For captures taken at different times
    /// on a machine whose speed drifts, when each capture varies its shapes (the
    /// calibration suite does); not for captures that each hold one shape (one
    /// concurrency, one prompt length), whose speeds would absorb what differs between
    /// them.
    #[arg(long)]
    pub per_capture_speed: bool,
}

/// What the capture rig names a sidecar next to its trace.
const RIG_SIDECARS: [&str; 2] = ["steps.jsonl.gz", "steps.jsonl"];

pub fn run(a: &FitArgs) -> Result<()> {
    if a.steps.len() > a.traces.len() {
        bail!(
            "{} sidecars for {} traces: --steps pairs with the traces in order, one each",
            a.steps.len(),
            a.traces.len()
        );
    }
    if a.json && a.output.as_os_str() == "-" {
        bail!("--json and `-o -` both write to standard output: pick one");
    }
    let mut inputs: Vec<_> = a.traces.iter().map(|t| named("the trace", t)).collect();
    inputs.extend(a.steps.iter().map(|s| named("--steps", s)));
    check_outputs(&inputs, &[named("-o", &a.output)])?;
    for t in &a.traces {
        match sniff(t).with_context(|| format!("reading {}", t.display()))? {
            InputKind::Model => bail!(
                "{} is a latency model file, not a trace: `inspect fit` fits traces (`play --latency-trace` takes the model as it is)",
                t.display()
            ),
            InputKind::Sidecar => bail!(
                "{} is a step-stats sidecar, not a trace: give it after --steps, in its trace's place (`inspect fit a.trace b.trace --steps a.steps b.steps`)",
                t.display()
            ),
            InputKind::Trace => {}
        }
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
    for input in inputs.iter().filter(|i| i.steps.is_none()) {
        if let Some(beside) = rig_sidecar(&input.trace) {
            crate::errln!(
                "note: {} is fitted from its records alone; {} is not used (pass it with --steps if it is this capture's sidecar)",
                input.trace.display(),
                beside.display()
            );
        }
    }
    let t = std::time::Instant::now();
    let opts = FitOptions {
        per_capture_speed: a.per_capture_speed,
    };
    let model = fit_with(&inputs, &opts).context("fitting the latency model")?;
    let secs = t.elapsed().as_secs_f64();
    model
        .save(&a.output)
        .with_context(|| format!("writing {}", a.output.display()))?;
    let bytes = model.to_text().map(|t| t.len()).unwrap_or(0);
    if a.json {
        // warnings reach the terminal even when stdout is for the JSON
        for n in model.law.notes.iter().filter(|n| n.starts_with("WARNING")) {
            crate::errln!("inspect fit: {n}");
        }
        crate::outln!("{}", summary(&model, &a.output, bytes, secs));
    } else {
        crate::errp!("{}", report(&model, &a.output, bytes, secs));
    }
    Ok(())
}

/// A sidecar named as the capture rig names it, next to `trace`.
fn rig_sidecar(trace: &Path) -> Option<PathBuf> {
    let dir = trace.parent()?;
    RIG_SIDECARS
        .iter()
        .map(|n| dir.join(n))
        .find(|p| p.is_file() && p.as_path() != trace)
}

fn totals(m: &FittedModel) -> (u64, u64, u64) {
    let s = &m.meta.sources;
    (
        s.iter().map(|s| s.records).sum(),
        s.iter().map(|s| s.observations).sum(),
        s.iter().map(|s| s.sidecar_steps).sum(),
    )
}

/// The `--json` summary.
fn summary(m: &FittedModel, output: &Path, bytes: usize, secs: f64) -> serde_json::Value {
    let (records, observations, sidecar_steps) = totals(m);
    json!({
        "output": output,
        "bytes": bytes,
        "seconds": secs,
        "records": records,
        "observations": observations,
        "sidecar_steps": sidecar_steps,
        "sources": m.meta.sources,
        "law": m.law,
        "decode": m.decode.iter().map(|b| json!({
            "decodes": b.decodes, "steps": b.steps, "median_ms": b.median_ms,
        })).collect::<Vec<_>>(),
        "prefill": m.prefill.iter().map(|c| json!({
            "tokens": c.tokens, "steps": c.steps, "median_ms": c.median_ms,
        })).collect::<Vec<_>>(),
        "num_spec_tokens": m.num_spec_tokens(),
    })
}

fn range(r: [u32; 2]) -> String {
    if r[0] == r[1] {
        r[0].to_string()
    } else {
        format!("{}–{}", r[0], r[1])
    }
}

/// The human report (stderr).
fn report(m: &FittedModel, output: &Path, bytes: usize, secs: f64) -> String {
    let (records, observations, sidecar_steps) = totals(m);
    let l = &m.law;
    let mut law = format!("{}", l.step_ms);
    for (c, what) in [
        (l.per_decode_ms, "decodes"),
        (l.per_prefill_token_ms, "prefill tokens"),
        (l.prefill_step_ms, "[prefill]"),
        (l.per_context_token_ms, "Σ decode context"),
        (l.per_burst_token_ms, "extra burst tokens"),
        (l.per_prefill_depth_ms, "Σ (d1² − d0²)/2"),
        (l.after_prefill_ms, "Σ γ^k"),
        (l.per_after_prefill_token_ms, "Σ P·γ^k"),
        (l.new_shape_ms, "[new step size]"),
        (l.after_idle_ms, "[from idle]"),
        (l.per_first_token_ms, "first tokens"),
    ] {
        if c != 0.0 {
            law += &format!(" + {c}·{what}");
        }
    }
    if l.after_prefill_ms != 0.0 || l.per_after_prefill_token_ms != 0.0 {
        law += &format!(
            " (earlier prefills: P tokens k steps ago, γ = {})",
            l.after_prefill_decay
        );
    }
    let mut out = format!(
        "fitted {records} records → {observations} observations{} in {secs:.2} s → {} ({bytes} bytes)\n  law: {law} ms (floor {} ms)\n",
        if sidecar_steps > 0 {
            format!(" ({sidecar_steps} sidecar steps)")
        } else {
            String::new()
        },
        if output.as_os_str() == "-" {
            "standard output".into()
        } else {
            output.display().to_string()
        },
        l.floor_ms,
    );
    for t in l.terms.iter().filter(|t| !t.kept) {
        out += &format!("  dropped {}: {}\n", t.term, t.why);
    }
    for n in &l.notes {
        out += &format!("  note: {n}\n");
    }
    let bins: Vec<String> = m
        .decode
        .iter()
        .map(|b| {
            format!(
                "{} ({} steps, p50 {} ms)",
                range(b.decodes),
                b.steps,
                b.median_ms
            )
        })
        .collect();
    out += &format!("  decode batches: {}\n", bins.join(", "));
    let classes: Vec<String> = m
        .prefill
        .iter()
        .map(|c| {
            format!(
                "{} tokens ({} steps, p50 {} ms)",
                range(c.tokens),
                c.steps,
                c.median_ms
            )
        })
        .collect();
    out += &format!("  prefill classes: {}\n", classes.join(", "));
    if let Some(k) = m.num_spec_tokens() {
        out += &format!("  bursts up to {} tokens (K = {k})\n", k + 1);
    }
    out
}
