//! Running the engine binary's offline subcommands (fit, calibrate, ...) for the figures:
//! quietly, or for the JSON they print.

use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// Run `cmd`, keeping its output unless it fails.
pub(crate) fn run_quiet(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.output().with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// The JSON a command prints (calibrate exits 1 when a cell is out of its default
/// tolerance: the JSON is still the result).
pub(crate) fn json_of(cmd: &mut Command, what: &str) -> Result<Value> {
    let out = cmd.output().with_context(|| format!("running {what}"))?;
    serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "{what} ({}) printed no JSON: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    })
}
