//! `cargo xtask cpu-engine`: one real frontend with the real CPU engine behind it, timed
//! and checked by hand (boot to `/health`, a greedy completion, RSS, a clean stop or a
//! crash), optionally held running for poking at.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{Value, json};
use vcr_host::child::{free_ports, wait_listening};

use crate::http::Client;
use crate::stack::cpu_engine::{BOOT_TIMEOUT, CpuEngine, group_members, rss_kib};
use crate::stack::frontend::{Frontend, start_frontend, wait_health};

static STOP_HOLD: AtomicBool = AtomicBool::new(false);

extern "C" fn on_hold_signal(_: libc::c_int) {
    STOP_HOLD.store(true, Ordering::SeqCst);
}

/// What `cargo xtask cpu-engine` runs.
pub struct SmokeOptions {
    /// The frontend in front of the engine.
    pub frontend: Frontend,
    /// Where the model directory and the logs go.
    pub dir: PathBuf,
    /// Extra engine flags.
    pub engine_args: Vec<String>,
    /// Keep both running after the checks (until Ctrl-C).
    pub hold: bool,
    /// End the engine with [`CpuEngine::kill_hard`] (a crash) instead of a stop.
    pub crash: bool,
}

/// `cargo xtask cpu-engine`: one real frontend in external-engine mode with the real CPU
/// engine behind it. Times engine start → `/health` 200, sends the same greedy completion
/// (16 tokens) twice, reports RSS, stops both and checks that no engine process survives.
/// Returns whether every check passed.
pub fn smoke(cache: &Path, o: &SmokeOptions) -> Result<bool> {
    let venv = crate::fetch::fetch_cpu_engine(cache)?;
    let model = o.dir.join("model");
    vcr_host::tiny_model::write_real_engine_model_to(&model)
        .with_context(|| format!("writing {}", model.display()))?;
    let ports = free_ports(2)?;
    let (http_port, hs_port) = (ports[0], ports[1]);
    let fe_log = o.dir.join("frontend.log");
    let en_log = o.dir.join("engine.log");
    let _ = std::fs::remove_file(&fe_log);
    let _ = std::fs::remove_file(&en_log);

    let t = Instant::now();
    let (mut frontend, listen_timeout, _, _) =
        start_frontend(&o.frontend, &[], &model, http_port, hs_port, &fe_log)?;
    wait_listening(hs_port, listen_timeout, &mut [&mut frontend])
        .context("waiting for the frontend's handshake socket")?;
    eprintln!(
        "cpu-engine: frontend handshake port {hs_port} listening after {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let mut engine =
        CpuEngine::start(&venv, &model, "127.0.0.1", hs_port, &o.engine_args, &en_log)?;
    let http = Client::new(http_port, Duration::from_secs(120));
    wait_health(&http, BOOT_TIMEOUT, &mut [&mut frontend, engine.guard()]).with_context(|| {
        format!(
            "waiting for /health (logs: {} and {})",
            fe_log.display(),
            en_log.display()
        )
    })?;
    let boot = engine.uptime();
    eprintln!(
        "cpu-engine: engine start -> /health 200 in {:.1} s",
        boot.as_secs_f64()
    );

    let mut ok = true;
    let body = json!({
        "model": "tiny",
        "prompt": "The quick brown fox",
        "max_tokens": 16,
        "temperature": 0,
    });
    let mut texts = Vec::new();
    for i in 1..=3 {
        let t = Instant::now();
        let r = http.post("/v1/completions", &body)?;
        let secs = t.elapsed().as_secs_f64();
        let v = r.json().unwrap_or(Value::Null);
        let tokens = v["usage"]["completion_tokens"].as_u64();
        let text = v["choices"][0]["text"].as_str().unwrap_or("").to_string();
        let finish = v["choices"][0]["finish_reason"].as_str().unwrap_or("?");
        eprintln!(
            "cpu-engine: completion {i}: HTTP {} in {secs:.3} s, completion_tokens {tokens:?}, finish_reason {finish}, text {text:?}",
            r.status
        );
        if r.status != 200 || tokens != Some(16) {
            eprintln!(
                "cpu-engine: FAIL: expected 200 with 16 completion tokens: {}",
                r.text()
            );
            ok = false;
        }
        texts.push(text);
    }
    if ok {
        let deterministic = texts.windows(2).all(|w| w[0] == w[1]);
        eprintln!("cpu-engine: greedy output identical across the 3 requests: {deterministic}");
        ok &= deterministic;
    }

    let members = engine.group_pids();
    let per_pid: Vec<String> = members
        .iter()
        .map(|&p| format!("{p}: {} MiB", rss_kib(p).unwrap_or(0) / 1024))
        .collect();
    eprintln!(
        "cpu-engine: engine RSS {} MiB over {} processes ({}); frontend RSS {} MiB",
        engine.rss_kib() / 1024,
        members.len(),
        per_pid.join(", "),
        group_members(frontend.pid() as i32)
            .into_iter()
            .filter_map(rss_kib)
            .sum::<u64>()
            / 1024
    );

    if o.hold {
        eprintln!(
            "cpu-engine: holding: http://127.0.0.1:{http_port} (engine pid {}, log {}); Ctrl-C stops both",
            engine.pid(),
            engine.log().display()
        );
        // Ctrl-C / SIGTERM end the hold and fall through to the normal stops below (the
        // xtask's own handler would SIGKILL both, leaving the engine's /dev/shm queues).
        STOP_HOLD.store(false, Ordering::SeqCst);
        let handler = on_hold_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: the handler only stores to an atomic.
        unsafe {
            libc::signal(libc::SIGINT, handler);
            libc::signal(libc::SIGTERM, handler);
        }
        while !STOP_HOLD.load(Ordering::SeqCst) {
            frontend.ensure_running()?;
            engine.ensure_running()?;
            std::thread::sleep(Duration::from_millis(200));
        }
        eprintln!("cpu-engine: stopping");
        vcr_host::child::install_signal_handlers();
    }

    let pgid = engine.pid() as i32;
    if o.crash {
        let t = Instant::now();
        let how = engine.kill_hard();
        let left = group_members(pgid);
        eprintln!(
            "cpu-engine: crashed the engine: {how} in {:.2} s; processes left in its group: {left:?}",
            t.elapsed().as_secs_f64()
        );
        ok &= left.is_empty();
        // a frontend does not notice an engine killed without ENGINE_CORE_DEAD (vllm-rs
        // keeps answering /health 200 and new requests hang): just report
        let quick = Client::new(http_port, Duration::from_secs(5));
        match quick.post("/v1/completions", &body) {
            Ok(r) => eprintln!(
                "cpu-engine: after the crash: completion -> HTTP {} {}",
                r.status,
                crate::http::snippet(&r.text())
            ),
            Err(e) => eprintln!("cpu-engine: after the crash: completion -> {e:#}"),
        }
        let health = quick.get("/health").map(|r| r.status);
        eprintln!("cpu-engine: after the crash: /health -> {health:?}");
    }
    let how = frontend.stop();
    eprintln!("cpu-engine: stopped the frontend: {how}");
    if !o.crash {
        let how = engine.stop();
        let left = group_members(pgid);
        eprintln!("cpu-engine: stopped the engine: {how}; processes left in its group: {left:?}");
        ok &= left.is_empty();
    }
    eprintln!("cpu-engine: {}", if ok { "PASS" } else { "FAIL" });
    Ok(ok)
}
