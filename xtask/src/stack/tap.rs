//! Starting `vllm-vcr record`, the tap, between a frontend's handshake and an engine.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use vcr_host::child::ChildGuard;

/// Start `vllm-vcr record` between the frontend's handshake port and `tap_port`.
pub(crate) fn start_tap(
    engine_bin: &Path,
    frontend_port: u16,
    tap_port: u16,
    trace: &Path,
    steps: &Path,
    extra: &[&str],
    log: &Path,
) -> Result<ChildGuard> {
    let mut cmd = Command::new(engine_bin);
    cmd.env("NO_COLOR", "1")
        .arg("record")
        .arg("--frontend-handshake")
        .arg(format!("tcp://127.0.0.1:{frontend_port}"))
        .arg("--engine-handshake")
        .arg(format!("tcp://127.0.0.1:{tap_port}"))
        .arg("--trace-out")
        .arg(trace)
        .arg("--step-stats-out")
        .arg(steps)
        .args(["--force", "--model", "tiny", "--gpu", "cpu"])
        .args(extra);
    ChildGuard::spawn("record", cmd, log, Duration::from_secs(10))
}
