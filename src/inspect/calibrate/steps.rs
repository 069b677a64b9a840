//! `calibrate --steps SIDECAR`: the step-level check beside the request-level table.
//!
//! Request latencies mix the step model's error with the scheduler's; this section shows
//! the step model alone: for each class of captured step (decode-only, prefill-only,
//! mixed) the captured durations against durations drawn from the model for the same
//! shapes ([`sim_trace::fit::check_steps`]), quantile by quantile, and a Q-Q figure per
//! class under `--plot`. It is reported, not gated.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{Value, json};
use sim_trace::fit::{CHECK_LEVELS, ClassScale, FitInput, FittedModel, HostSpeeds, StepCheck};

use crate::inspect::plot;

/// Run the check of `model`, its durations multiplied by `scale`, on `trace` with its
/// `sidecar`.
pub fn check(
    model: &FittedModel,
    trace: &Path,
    sidecar: &Path,
    scale: ClassScale,
    seed: u64,
) -> Result<StepCheck> {
    let input = FitInput {
        trace: trace.to_path_buf(),
        steps: Some(sidecar.to_path_buf()),
    };
    sim_trace::fit::check_steps(model, &input, scale, seed)
        .with_context(|| format!("--steps {}: the step-level check", sidecar.display()))
}

/// The capture's host speed against the model, and how calibrate used it.
pub struct HostSpeed {
    pub speeds: HostSpeeds,
    /// `--match-host-speed`: the model's run was scaled by it.
    pub applied: bool,
    /// `--host-speed-per-class`: each step class by its own speed.
    pub per_class: bool,
}

impl HostSpeed {
    /// What `--match-host-speed` multiplies the model's durations by, per step class.
    pub fn scale(&self) -> ClassScale {
        if !self.applied {
            return ClassScale::uniform(1.0);
        }
        let all = self.speeds.all.0;
        if !self.per_class {
            return ClassScale::uniform(all);
        }
        // a class with too few steps of its own keeps the overall speed
        ClassScale {
            decode: self.speeds.decode.map_or(all, |d| d.0),
            prefill: self.speeds.prefill.map_or(all, |p| p.0),
        }
    }
}

/// Measure the host speed of `trace` with its `sidecar` against `model`.
pub fn host_speed(
    model: &FittedModel,
    trace: &Path,
    sidecar: &Path,
    applied: bool,
    per_class: bool,
) -> Result<HostSpeed> {
    let input = FitInput {
        trace: trace.to_path_buf(),
        steps: Some(sidecar.to_path_buf()),
    };
    let speeds = sim_trace::fit::host_speeds(model, &input)
        .with_context(|| format!("--steps {}: the host speed", sidecar.display()))?;
    Ok(HostSpeed {
        speeds,
        applied,
        per_class,
    })
}

fn levels() -> String {
    CHECK_LEVELS
        .iter()
        .map(|l| format!("p{}", l * 100.0))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// The text section.
pub fn write_text(out: &mut impl Write, c: &StepCheck, sidecar: &Path) -> std::io::Result<()> {
    writeln!(
        out,
        "\nsteps ({}): modelled against captured step durations for the same shapes, Δ % at {}",
        sidecar.display(),
        levels()
    )?;
    let rows = c
        .classes
        .iter()
        .map(|k| (k.class.name().to_string(), k))
        .chain(
            c.decode_bins
                .iter()
                .filter(|(_, k)| k.steps >= 30)
                .map(|(b, k)| {
                    let d = if b[0] == b[1] {
                        b[0].to_string()
                    } else {
                        format!("{}–{}", b[0], b[1])
                    };
                    (format!("  {d} decodes"), k)
                }),
        );
    for (name, k) in rows {
        let d: Vec<String> = k.delta_pct().iter().map(|x| format!("{x:+.1}")).collect();
        writeln!(
            out,
            "  {name:<16} {:>6} steps  captured p50 {:>7.2} ms  Δ {}  (mean {:+.1})",
            k.steps,
            k.captured_ms.get(1).copied().unwrap_or(0.0),
            d.join(" / "),
            if k.captured_mean_ms > 0.0 {
                (k.modelled_mean_ms / k.captured_mean_ms - 1.0) * 100.0
            } else {
                0.0
            }
        )?;
    }
    Ok(())
}

/// The JSON section.
pub fn json(c: &StepCheck, sidecar: &Path) -> Value {
    json!({
        "sidecar": sidecar,
        "levels": CHECK_LEVELS,
        "classes": c.classes.iter().map(|k| json!({
            "class": k.class,
            "steps": k.steps,
            "captured_ms": k.captured_ms,
            "modelled_ms": k.modelled_ms,
            "delta_pct": k.delta_pct(),
            "captured_mean_ms": k.captured_mean_ms,
            "modelled_mean_ms": k.modelled_mean_ms,
        })).collect::<Vec<_>>(),
        "decode_bins": c.decode_bins.iter().map(|(b, k)| json!({
            "decodes": b,
            "steps": k.steps,
            "captured_ms": k.captured_ms,
            "modelled_ms": k.modelled_ms,
            "delta_pct": k.delta_pct(),
        })).collect::<Vec<_>>(),
    })
}

/// One Q-Q figure per class: `steps-<class>-qq.svg`.
pub fn plots(dir: &Path, trace: &Path, c: &StepCheck) -> Result<Vec<PathBuf>> {
    let name = trace.file_name().unwrap_or_default().to_string_lossy();
    let mut out = Vec::new();
    for k in &c.classes {
        if k.steps < 2 {
            continue;
        }
        let path = plot::file(dir, &format!("steps-{}-qq.svg", k.class.name()))?;
        plot::qq(
            &path,
            &format!("{} step durations — {name}", k.class.name()),
            "step duration",
            ("captured", "modelled"),
            &[
                ("captured", k.samples[0].as_slice()),
                ("modelled", k.samples[1].as_slice()),
            ],
        )
        .with_context(|| format!("writing {}", path.display()))?;
        out.push(path);
    }
    Ok(out)
}
