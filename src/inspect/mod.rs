//! `vllm-vcr inspect`: trace tools. Every subcommand streams its input (memory does not
//! grow with the trace; `fit` keeps one small entry per engine step, `simulate` one per
//! request and a word per block hash, to order the workload by arrival, `calibrate` every
//! request's latencies for exact quantiles), reads `.gz`
//! transparently, prints a machine-readable result with `--json`, and reports progress on
//! stderr for long work.

pub mod calibrate;
pub mod calibrate_e2e;
pub mod compare;
pub mod convert;
pub mod fit;
pub mod fit_config;
pub mod fit_reach;
pub mod gen_demo;
pub mod output;
pub mod perfetto;
pub mod plot;
pub mod progress;
pub mod simulate;
pub mod suite;
pub mod summarize;

use anyhow::Result;
use clap::{Args, Subcommand};

/// Look at traces, convert other tools' formats, make demo traces, fit latency models,
/// simulate workloads offline, calibrate a model against a capture.
#[derive(Debug, Clone, Args)]
pub struct InspectArgs {
    #[command(subcommand)]
    pub command: InspectCommand,
}

#[derive(Debug, Clone, Subcommand)]
pub enum InspectCommand {
    /// Summarize a trace: counts, duration, arrival rate, concurrency, TTFT / ITL /
    /// request-total / output-length quantiles, finish reasons, prefix-cache hit ratio,
    /// multi-token chunk sizes.
    Summarize(summarize::SummarizeArgs),
    /// Turn a trace (and optionally its step-stats sidecar) into a timeline for the
    /// Perfetto UI: Perfetto's protobuf trace, or Chrome Trace Event JSON.
    Perfetto(perfetto::PerfettoArgs),
    /// Convert other tools' formats into the trace schema, or a trace into them
    /// (guidellm, vllm bench, aiperf and inference-perf results; Mooncake, Azure and
    /// BurstGPT traces).
    Convert(convert::ConvertArgs),
    /// Write a synthetic trace with heavy-tailed (log-normal) TTFT and ITL, for demos and
    /// calibration tests.
    GenDemo(gen_demo::GenDemoArgs),
    /// Fit the step latency model to captures and save it (`play --latency-trace`).
    Fit(fit::FitArgs),
    /// Run a trace's requests through the simulated engine offline, on a virtual clock:
    /// replay a capture, or predict TTFT / ITL / throughput / cache hits of a workload
    /// under any engine flags and latency model; write the simulated trace and a summary.
    Simulate(Box<simulate::SimulateArgs>),
    /// Compare a capture with a latency model, via `simulate`: captured vs modelled TTFT,
    /// ITL and request-total p50 / p90 / p99, pooled and per concurrency cohort, beside
    /// the best-fit latency knobs; gate on a tolerance (exit 1 when out), dump the
    /// samples, draw SVG figures.
    Calibrate(Box<calibrate::CalibrateArgs>),
    /// `calibrate` through the wire: a real frontend (`vllm-rs` of the trace's line, or
    /// the Python one), a `record` tap and `play` under the model; the trace's requests
    /// sent over HTTP on the wall clock, the tap's trace compared with the capture.
    #[command(name = "calibrate-e2e")]
    CalibrateE2e(Box<calibrate_e2e::CalibrateE2eArgs>),
    /// Compare the latencies of several traces: TTFT, ITL and request-total p50 / p90 /
    /// p99 per concurrency cohort and each trace's Δ % against the first (two captures of
    /// one workload, a capture and its simulation, two configurations); draw SVG figures.
    Compare(compare::CompareArgs),
    /// Drive the calibration suite's load (a few `bench serve` runs, printed as they run)
    /// against a frontend while `record` taps its engine: the captures a latency model for
    /// that engine is fitted on.
    Suite(suite::SuiteArgs),
}

pub fn run(args: InspectArgs) -> Result<()> {
    let r = match args.command {
        InspectCommand::Summarize(a) => summarize::run(&a),
        InspectCommand::Perfetto(a) => perfetto::run(&a),
        InspectCommand::Convert(a) => convert::run(&a),
        InspectCommand::GenDemo(a) => gen_demo::run(&a),
        InspectCommand::Fit(a) => fit::run(&a),
        InspectCommand::Simulate(a) => simulate::run(&a),
        InspectCommand::Calibrate(a) => calibrate::run(&a),
        InspectCommand::CalibrateE2e(a) => calibrate_e2e::run(&a),
        InspectCommand::Compare(a) => compare::run(&a),
        InspectCommand::Suite(a) => suite::run(&a),
    };
    match r {
        // `inspect … | head` closed our stdout: not an error.
        Err(e) if is_broken_pipe(&e) => Ok(()),
        r => r,
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    let pipe = Some(std::io::ErrorKind::BrokenPipe);
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().map(|io| io.kind()) == pipe
            || c.downcast_ref::<sim_trace::trace::TraceError>()
                .and_then(|t| t.io_kind())
                == pipe
    })
}
