//! The flags of `inspect calibrate`, and the output guard they imply.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use super::compare::{self, Tolerance};
use crate::inspect::simulate::ArrivalArgs;
use crate::io_guard::{Named, check_outputs, named};
use crate::play::EngineArgs;

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
The model under test is --latency-trace (a model file from `inspect fit`, or traces to fit \
now, with --latency-steps sidecars); it is required. Every other engine flag applies to \
both simulated runs. Exit status: 0 when every gated cell is within tolerance, 1 when one \
is not (the report is printed first, and the error names the cells) or on bad input.")]
pub struct CalibrateArgs {
    /// The capture to calibrate against (`record --trace-out`, or a trace written by
    /// `inspect simulate --dump-trace`): its records need captured timing (`ttft_ms`,
    /// `itl_ms`) and arrivals (`arrival_ms`).
    pub trace: PathBuf,

    #[command(flatten)]
    pub arrivals: ArrivalArgs,

    /// Calibrate only the first N requests (in arrival order).
    #[arg(long, value_name = "N")]
    pub requests: Option<u64>,

    /// The largest |Δ %| of a gated cell, modelled against captured: `PCT` for every
    /// quantile, or per quantile `p50=PCT,p90=PCT,p99=PCT` (items apply in order over the
    /// default; a trailing `%` is allowed).
    #[arg(
        long,
        value_name = "PCT[,pQ=PCT]",
        default_value = "p50=2,p90=2,p99=5",
        value_parser = compare::parse_tolerance
    )]
    pub tolerance: Tolerance,

    /// Concurrency cohorts with fewer compared requests than this are shown but not gated;
    /// a pooled row with fewer fails the command saying so (its quantiles are noise).
    #[arg(long, value_name = "N", default_value_t = 30)]
    pub min_requests: usize,

    /// Print the comparison as one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,

    /// Write every request's captured, modelled and knob samples (TTFT, request total,
    /// inter-token gaps) here, one row per request in arrival order: JSON lines, or CSV
    /// when the name ends in `.csv` (gaps space-separated).
    #[arg(long, value_name = "PATH")]
    pub dump_samples: Option<PathBuf>,

    /// Write SVG figures into this directory (created if missing): survival curves and
    /// Q-Q plots of TTFT and ITL, pooled and per gated cohort, and the output chunk-size
    /// distribution when the capture has multi-token chunks.
    #[arg(long, value_name = "DIR")]
    pub plot: Option<PathBuf>,

    /// The capture's step-stats sidecar (`record --step-stats-out`): adds the step-level
    /// check, each class of captured step (decode-only, prefill-only, mixed; decode-only
    /// also per batch size) against durations the model draws for the same shapes, at
    /// p10 / p50 / p90 / p99 / p99.9. Reported, not gated; a Q-Q figure per class under
    /// --plot. Needs a fitted model (--latency-trace).
    #[arg(long, value_name = "SIDECAR")]
    pub steps: Option<PathBuf>,

    /// Scale the model to the capture's host speed before simulating: the median of the
    /// capture's step durations over the model's law (from --steps), printed. Captures
    /// taken at different times run at different speeds on a shared machine; scaled, the
    /// comparison judges the model's shape (prefill against decode, batch size, the
    /// carry-over of prefills, scheduling) rather than the host's drift since the fit.
    #[arg(long, requires = "steps")]
    pub match_host_speed: bool,

    /// With --match-host-speed: match the decode-only steps and the steps with prefill
    /// work apart, each class by the median of its own captured durations over the law.
    /// A shared host's speed drifts unevenly (between two runs of one workload its
    /// memory-bound decode steps moved up to 25 % against the law, its compute-bound
    /// prefills 5–10 %), which one factor turns into a prefill error; two factors also take
    /// out the model's own prefill-to-decode level for this capture, so the comparison
    /// judges less of the model.
    #[arg(long, requires = "match_host_speed")]
    pub host_speed_per_class: bool,

    #[command(flatten, next_help_heading = "Engine (the flags of `play`)")]
    pub engine: EngineArgs,
}

/// The output guard of `calibrate` (and of `calibrate-e2e`, with its own inputs and
/// outputs added): no output may be the trace, a file the engine flags read, or another
/// output.
pub fn check_calibrate_outputs(
    a: &CalibrateArgs,
    more_inputs: &[Named],
    more_outputs: &[Named],
) -> Result<()> {
    let mut inputs = vec![named("the trace", &a.trace)];
    inputs.extend(a.steps.iter().map(|p| named("--steps", p)));
    inputs.extend(crate::play::artifacts::engine_inputs(&a.engine));
    inputs.extend(more_inputs.iter().cloned());
    let mut outputs: Vec<Named> = a
        .dump_samples
        .iter()
        .map(|p| named("--dump-samples", p))
        .collect();
    outputs.extend(more_outputs.iter().cloned());
    check_outputs(&inputs, &outputs)
}
