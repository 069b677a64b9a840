//! A whole stack started together for a leg: a frontend, optionally the `record` tap, and
//! an engine (`play` or the real CPU engine), up and healthy; and its orderly stop.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use vcr_host::child::{ChildGuard, free_ports, wait_listening};

use crate::http::Client;
use crate::stack::engine::{Backend, spawn_engine};
use crate::stack::frontend::{Frontend, start_frontend, wait_health};
use crate::stack::tap::start_tap;

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
    let backend = match backend {
        Backend::Play { line, mut args } => {
            args.insert(0, "--log-requests".to_string());
            Backend::Play { line, args }
        }
        cpu => cpu,
    };
    let engine_log = dir.join("engine.log");
    // The real engine's handshake socket connects lazily (ZeroMQ queues its HELLO until
    // the frontend binds), so straight behind a frontend it boots while the frontend
    // does: two Python start-ups on two cores instead of one after the other.
    let mut early = match (&backend, tap) {
        (Backend::Cpu { .. }, None) => Some(spawn_engine(
            &backend,
            engine_bin,
            model,
            hs_port,
            &engine_log,
        )?),
        _ => None,
    };
    {
        let mut watch: Vec<&mut ChildGuard> = vec![&mut frontend];
        if let Some((e, _)) = early.as_mut() {
            watch.push(e);
        }
        wait_listening(hs_port, listen_timeout, &mut watch)
            .context("waiting for the frontend's handshake socket")?;
    }
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
    let (mut engine, engine_wait) = match early {
        Some(started) => started,
        None => spawn_engine(&backend, engine_bin, model, port, &engine_log)?,
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
