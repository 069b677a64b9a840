//! `inspect calibrate-e2e TRACE --latency-trace FIT`: `calibrate` at the wire level. A real
//! vLLM frontend (the `vllm-rs` of the trace's line, or the Python one) with a `record` tap
//! behind it and `play` (the model under test, in this process) behind the tap; the
//! trace's requests are sent over HTTP on the wall clock — prompts as token-id lists that
//! reproduce the captured prefix sharing, arrivals as `calibrate` replays them — and the
//! tap's trace (engine-side timing: the capture's own measurement point) is compared with
//! the capture exactly as `calibrate` compares a simulation.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use serde_json::{Value, json};
use sim_protocol::VllmLine;
use sim_trace::trace::{TraceItem, TraceReader};
use vcr_host::child::{ChildGuard, free_ports, wait_listening};
use vcr_host::frontends;

use super::calibrate::compare::{Sample, chunk_sizes};
use super::calibrate::{CalibrateArgs, ModelRun, check_calibrate_outputs, run_with};
use super::progress::Progress;
use super::simulate::arrivals::Arrivals;
use super::simulate::workload::Workload;
use super::simulate::{Counts, RunOptions};
use crate::compat;
use crate::io_guard::{Named, named};
use crate::play::{EngineArgs, PlayArgs};
use crate::serve::Frontend;
use crate::serve::frontend;

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Needs the frontend: `vllm-rs` is found as `serve` finds it (--frontend-bin, $PATH, the \
cache of `cargo xtask fetch`, else downloaded from the PyPI wheel of the line); the Python \
frontend needs --python-venv. The engine flags (below) configure `play`; the capture's \
block size, max_num_seqs, token budget and prefix caching are taken from it as \
`calibrate` does. The knob column is computed offline, as in `calibrate`. Exit status: 0 \
when every gated cell is within tolerance and every request succeeded, 1 otherwise.")]
pub struct CalibrateE2eArgs {
    #[command(flatten)]
    pub calibrate: CalibrateArgs,

    /// The real frontend in front of the tap and `play`.
    #[arg(long, value_enum, default_value_t = Frontend::Rs)]
    pub frontend: Frontend,

    /// A `vllm-rs` binary (default: the one of the trace's vLLM line).
    #[arg(long, value_name = "PATH")]
    pub frontend_bin: Option<PathBuf>,

    /// With --frontend python: the venv that has `vllm` installed.
    #[arg(long, value_name = "DIR")]
    pub python_venv: Option<PathBuf>,

    /// Keep the tap's trace of the run here (the measured side of the comparison).
    #[arg(long, value_name = "PATH")]
    pub dump_trace: Option<PathBuf>,

    /// Keep the processes' logs in this directory (default: a temporary one, removed
    /// unless the run fails).
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<PathBuf>,

    /// Seconds the stack may take to answer /health (at most a day).
    #[arg(long, value_name = "S", default_value_t = 120.0, value_parser = crate::flag_ranges::seconds)]
    pub startup_timeout: f64,

    /// Seconds one request may take (at most a day).
    #[arg(long, value_name = "S", default_value_t = 120.0, value_parser = crate::flag_ranges::seconds)]
    pub request_timeout: f64,
}

pub fn run(a: &CalibrateE2eArgs) -> Result<()> {
    if !a.calibrate.engine.uses_latency_model() {
        bail!(
            "calibrate-e2e runs `play` under a latency model: pass --latency-trace MODEL (from `inspect fit`)"
        );
    }
    let inputs: Vec<Named> = a
        .frontend_bin
        .iter()
        .map(|p| named("--frontend-bin", p))
        .collect();
    let outputs: Vec<Named> = a
        .dump_trace
        .iter()
        .map(|p| named("--dump-trace", p))
        .collect();
    check_calibrate_outputs(&a.calibrate, &inputs, &outputs)?;
    // the trace's line picks the frontend and the wire: checked before anything is fetched
    let mut reader = TraceReader::open(&a.calibrate.trace)
        .with_context(|| format!("reading {}", a.calibrate.trace.display()))?;
    let (meta, _) = reader
        .read_header()
        .with_context(|| format!("reading {}", a.calibrate.trace.display()))?;
    if let Some(meta) = meta {
        meta_line(&meta, &a.calibrate.trace)?;
    }
    run_with(&a.calibrate, |work, engine, opts| {
        wire_run(a, work, engine, opts)
    })
}

/// The frontend, the tap and the engine, while they run.
struct Stack {
    frontend: ChildGuard,
    tap: ChildGuard,
    engine_stop: tokio::sync::watch::Sender<bool>,
    engine: tokio::task::JoinHandle<Result<()>>,
    http_port: u16,
    name: &'static str,
    describe: String,
}

fn wire_run(
    a: &CalibrateE2eArgs,
    work: &Workload,
    engine: &EngineArgs,
    opts: &RunOptions,
) -> Result<ModelRun> {
    let (dir, keep_dir) = match &a.log_dir {
        Some(d) => (d.clone(), true),
        None => (
            std::env::temp_dir().join(format!("vllm-vcr-calibrate-e2e-{}", std::process::id())),
            false,
        ),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let trace = dir.join("trace.jsonl");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut stack = start(a, work, engine, &dir, &trace, &rt)?;
    // the real frontend and load take their own turnaround: no modelled one on top
    let opts = &RunOptions {
        think: a.calibrate.arrivals.think(),
        own_turnarounds: None,
        ..opts.clone()
    };
    let sent = Instant::now();
    let outcome = drive(a, work, engine, opts, &mut stack);
    let wall = sent.elapsed();
    // every response is in: the engine has finished them; let the tap write its last
    // records, then stop the tap (it flushes), the frontend and the engine
    std::thread::sleep(Duration::from_millis(300));
    let tap_how = stack.tap.stop();
    let fe_how = stack.frontend.stop();
    let _ = stack.engine_stop.send(true);
    let _ = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(10), &mut stack.engine).await });
    // the in-process engine logged its pacing as it stopped
    let pacing = crate::play::io::take_pacing().pop();
    let failed = match outcome {
        Ok(f) => f,
        Err(e) => {
            crate::errln!(
                "calibrate-e2e: logs kept in {} (tap {tap_how}; frontend {fe_how})",
                dir.display()
            );
            return Err(e);
        }
    };
    let (samples, chunks) = read_tapped(&trace, work.reqs.len())?;
    let got = samples.iter().filter(|s| s.is_some()).count();
    if let Some(p) = &a.dump_trace {
        std::fs::copy(&trace, p).with_context(|| format!("writing {}", p.display()))?;
    }
    if !keep_dir && failed.is_empty() {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        crate::errln!("calibrate-e2e: logs in {}", dir.display());
    }
    crate::errln!(
        "calibrate-e2e: {} requests through {} in {:.1} s, {got} recorded by the tap",
        work.reqs.len(),
        stack.name,
        wall.as_secs_f64()
    );
    Ok(ModelRun {
        samples,
        chunks,
        counts: Counts {
            requests: work.reqs.len(),
            sessions: None,
            // a trace records no preemptions; the engine's count stays in play's log
            preemptions: 0,
            not_finished: (work.reqs.len() - got) as u64,
            never_sent: 0,
            rejected: 0,
            describe: stack.describe.clone(),
            replay: None,
        },
        failed,
        pacing,
    })
}

/// The trace's vLLM line (its engine's version, which must be a version in the supported
/// window: a meta is outside input, and a line outside the window would fetch a frontend
/// and run a wire this binary refuses everywhere else), else the default line.
fn meta_line(meta: &sim_trace::trace::TraceMeta, path: &Path) -> Result<VllmLine> {
    match meta.vllm_version.as_deref() {
        None => Ok(compat::default_line()),
        Some(v) => VllmLine::parse(v).map_err(|e| {
            anyhow!(
                "{}: the meta line's vllm_version {v:?}: {e}; calibrate-e2e runs the frontend of the trace's vLLM line, so it needs a capture of a supported line",
                path.display()
            )
        }),
    }
}

/// [`meta_line`] of a loaded workload.
fn trace_line(work: &Workload, path: &Path) -> Result<VllmLine> {
    meta_line(&work.meta, path)
}

fn start(
    a: &CalibrateE2eArgs,
    work: &Workload,
    engine: &EngineArgs,
    dir: &Path,
    trace: &Path,
    rt: &tokio::runtime::Runtime,
) -> Result<Stack> {
    let cache = frontends::cache_root()?;
    let model = frontend::write_embedded_model(&cache, engine.max_model_len)?;
    let ports = free_ports(3)?;
    let (http_port, hs_port, tap_port) = (ports[0], ports[1], ports[2]);
    let timeout = a.startup_timeout.max(1.0);
    let mut line = trace_line(work, &a.calibrate.trace)?;
    let spec = frontend::FrontendSpec {
        model: &model,
        name: "tiny",
        aliases: &[],
        host: "127.0.0.1",
        port: http_port,
        handshake_port: hs_port,
        engines: 1,
        ready_timeout_s: timeout.ceil() as u64,
    };
    let (mut cmd, grace, name) = match a.frontend {
        Frontend::Rs => {
            let bin = frontends::find_vllm_rs(a.frontend_bin.as_deref(), &compat::tag_for(line))
                .context("finding vllm-rs (`cargo xtask fetch` caches every line's; or pass --frontend-bin)")?;
            if let Some(l) = frontend::line_of_vllm_rs(&bin) {
                line = l;
            }
            let cmd = frontend::vllm_rs_command(&bin, &spec);
            (cmd, Duration::from_secs(3), "vllm-rs")
        }
        Frontend::Python => {
            let venv = a.python_venv.clone().context(
                "--frontend python needs --python-venv DIR (a venv with vllm installed)",
            )?;
            let cmd = frontend::python_command(&venv, &spec)?;
            (cmd, Duration::from_secs(5), "the Python frontend")
        }
    };
    frontend::die_with_parent(&mut cmd);
    let fe_log = dir.join("frontend.log");
    let mut frontend = ChildGuard::spawn("frontend", cmd, &fe_log, grace)?;
    let listen = sim_trace::latency::secs_to_duration(timeout);
    wait_listening(hs_port, listen, &mut [&mut frontend]).with_context(|| {
        format!(
            "waiting for the frontend's handshake socket; last lines of {}:\n{}",
            fe_log.display(),
            frontend::log_tail(&fe_log)
        )
    })?;

    let me = std::env::current_exe().context("locating this binary for the record tap")?;
    let mut tap_cmd = Command::new(me);
    tap_cmd
        .env("NO_COLOR", "1")
        .arg("record")
        .arg("--frontend-handshake")
        .arg(format!("tcp://127.0.0.1:{hs_port}"))
        .arg("--engine-handshake")
        .arg(format!("tcp://127.0.0.1:{tap_port}"))
        .arg("--trace-out")
        .arg(trace)
        .args(["--force", "--model", "tiny", "--gpu", "simulated"]);
    frontend::die_with_parent(&mut tap_cmd);
    let mut tap = ChildGuard::spawn(
        "record",
        tap_cmd,
        &dir.join("record.log"),
        Duration::from_secs(10),
    )?;
    wait_listening(
        tap_port,
        Duration::from_secs(30),
        &mut [&mut frontend, &mut tap],
    )
    .context("waiting for the record tap's engine handshake socket")?;

    // the engine: `play` in this process, configured like the simulation
    let mut play = PlayArgs::defaults();
    play.engine = engine.clone();
    play.handshake_address = format!("tcp://127.0.0.1:{tap_port}");
    play.vllm_version = line;
    play.engine.vocab_size = play
        .engine
        .vocab_size
        .min(vcr_host::tiny_model::TOKENIZER_VOCAB);
    if let Some(m) = frontend::model_max_len(&model) {
        play.engine.max_model_len = play.engine.max_model_len.min(m);
    }
    let describe = format!(
        "play (vLLM {line} wire, block size {}, max_num_seqs {}, latency {}) behind {name} and the record tap, on the wall clock",
        play.engine.block_size_or_default(),
        play.engine.max_num_seqs_or_default(),
        play.engine
            .latency_trace
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let (engine_stop, stop_rx) = tokio::sync::watch::channel(false);
    let engine_task = rt.spawn(crate::play::run(play, stop_rx));
    let mut stack = Stack {
        frontend,
        tap,
        engine_stop,
        engine: engine_task,
        http_port,
        name,
        describe,
    };
    // /health, watching every part
    let t = Instant::now();
    loop {
        if let Ok((200, _)) = http(http_port, "GET", "/health", None, Duration::from_secs(2)) {
            break;
        }
        stack.frontend.ensure_running().with_context(|| {
            format!(
                "the frontend stopped during start-up; last lines of {}:\n{}",
                fe_log.display(),
                frontend::log_tail(&fe_log)
            )
        })?;
        stack
            .tap
            .ensure_running()
            .context("the record tap stopped during start-up")?;
        if stack.engine.is_finished() {
            bail!("the engine (play) stopped during start-up");
        }
        if t.elapsed().as_secs_f64() > timeout {
            bail!(
                "the frontend did not answer /health within {timeout} s; last lines of {}:\n{}",
                fe_log.display(),
                frontend::log_tail(&fe_log)
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    crate::errln!(
        "calibrate-e2e: {name} (vLLM {line}) > record > play ready after {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok(stack)
}

/// Send every request when `Arrivals` says, each on its own thread; returns the failures.
fn drive(
    a: &CalibrateE2eArgs,
    work: &Workload,
    engine: &EngineArgs,
    opts: &RunOptions,
    stack: &mut Stack,
) -> Result<Vec<String>> {
    let n = work.reqs.len();
    let lo = engine.min_token_id.max(3);
    let hi = engine
        .vocab_size
        .min(vcr_host::tiny_model::TOKENIZER_VOCAB)
        .max(lo + 1);
    let mut arrivals = Arrivals::new(work, opts);
    let (tx, rx) = mpsc::channel::<(usize, Duration, Result<()>)>();
    let t0 = Instant::now();
    let timeout = sim_trace::latency::secs_to_duration(a.request_timeout.max(1.0));
    let mut in_flight = 0usize;
    let mut done = 0usize;
    let mut failed: Vec<String> = Vec::new();
    let mut progress = Progress::new("calibrate-e2e:");
    loop {
        let now = t0.elapsed();
        while let Some((_, i)) = arrivals.pop_due(now) {
            let prompt = work.prompt(i, lo..hi, opts.cold_prompts);
            let max_tokens = work.reqs[i].output_tokens.max(1);
            let port = stack.http_port;
            let tx = tx.clone();
            in_flight += 1;
            std::thread::spawn(move || {
                let r = complete(port, i, &prompt, max_tokens, timeout);
                let _ = tx.send((i, t0.elapsed(), r));
            });
        }
        if in_flight == 0 && arrivals.next_due().is_none() {
            break;
        }
        let wait = arrivals.next_due().map_or(Duration::from_millis(500), |d| {
            d.saturating_sub(t0.elapsed())
                .min(Duration::from_millis(500))
        });
        match rx.recv_timeout(wait) {
            Ok((i, at, r)) => {
                in_flight -= 1;
                done += 1;
                if let Err(e) = r {
                    failed.push(format!("request {i}: {e:#}"));
                }
                arrivals.finished(i, at);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        stack
            .frontend
            .ensure_running()
            .context("the frontend stopped during the run")?;
        stack
            .tap
            .ensure_running()
            .context("the record tap stopped during the run")?;
        if stack.engine.is_finished() {
            bail!("the engine (play) stopped during the run");
        }
        progress.status(|| {
            format!(
                "{done}/{n} requests, {in_flight} in flight, {} failed, {:.1} s",
                failed.len(),
                t0.elapsed().as_secs_f64()
            )
        });
    }
    progress.finish_status(&format!("{done}/{n} requests, {} failed", failed.len()));
    Ok(failed)
}

/// One completion: `max_tokens` tokens for a token-id prompt, named `replay-<i>` (the
/// tap's record carries the name, which pairs it with the capture's request `i`).
fn complete(port: u16, i: usize, prompt: &[u32], max_tokens: u32, timeout: Duration) -> Result<()> {
    let body = json!({
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "stream": false,
    });
    let (status, text) = http(port, "POST", "/v1/completions", Some((i, &body)), timeout)?;
    if status != 200 {
        bail!("HTTP {status}: {}", snippet(&text));
    }
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("the response is not JSON: {}", snippet(&text)))?;
    let got = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    if got != u64::from(max_tokens) {
        bail!("{got} tokens generated, {max_tokens} asked");
    }
    Ok(())
}

fn snippet(s: &str) -> String {
    let s = s.trim();
    match s.char_indices().nth(300) {
        Some((k, _)) => format!("{}…", &s[..k]),
        None => s.to_string(),
    }
}

/// A blocking HTTP/1.1 exchange with 127.0.0.1:`port` (`Connection: close`): the status
/// and the body, de-chunked. With `body`, a JSON POST named `replay-<i>` by its
/// `X-Request-Id`.
fn http(
    port: u16,
    method: &str,
    path: &str,
    body: Option<(usize, &Value)>,
    timeout: Duration,
) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let mut req =
        format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n");
    let payload = match body {
        Some((i, v)) => {
            let p = serde_json::to_vec(v)?;
            req.push_str(&format!(
                "Content-Type: application/json\r\nX-Request-Id: replay-{i}\r\nContent-Length: {}\r\n",
                p.len()
            ));
            p
        }
        None => Vec::new(),
    };
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    s.write_all(&payload)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("no HTTP header in the response"))?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut body = raw[split + 4..].to_vec();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow!("bad status line: {}", head.lines().next().unwrap_or("")))?;
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    if chunked {
        body = dechunk(&body)?;
    }
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| anyhow!("truncated chunked body"))?;
        let size_text = String::from_utf8_lossy(&b[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| anyhow!("bad chunk size {size_text:?}"))?;
        b = &b[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size {
            bail!("truncated chunk");
        }
        out.extend_from_slice(&b[..size]);
        b = b.get(size + 2..).unwrap_or(&[]);
    }
}

/// The tap's records, as samples by the capture's arrival-order index (from the
/// `replay-<i>` in their request ids), with the output chunk sizes.
type Tapped = (Vec<Option<Sample>>, BTreeMap<u32, u64>);

fn read_tapped(trace: &Path, n: usize) -> Result<Tapped> {
    let mut samples: Vec<Option<Sample>> = vec![None; n];
    let mut chunks: BTreeMap<u32, u64> = BTreeMap::new();
    for item in TraceReader::open(trace)
        .with_context(|| format!("reading the tap's trace {}", trace.display()))?
    {
        let TraceItem::Record(r) = item? else {
            continue;
        };
        let Some(i) = r.request_id.as_deref().and_then(replay_index) else {
            continue;
        };
        if i < n {
            for (k, v) in chunk_sizes(std::iter::once(&r)) {
                *chunks.entry(k).or_default() += v;
            }
            samples[i] = Sample::of(&r);
        }
    }
    Ok((samples, chunks))
}

/// `i` of the first `replay-<i>` in a request id (frontends add prefixes and suffixes).
fn replay_index(id: &str) -> Option<usize> {
    let at = id.find("replay-")? + "replay-".len();
    let digits: String = id[at..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_index_is_found_inside_a_frontends_request_id() {
        assert_eq!(replay_index("cmpl-replay-17-0a1b"), Some(17));
        assert_eq!(replay_index("replay-3"), Some(3));
        assert_eq!(replay_index("cmpl-abc"), None);
    }

    #[test]
    fn chunked_bodies_are_joined() {
        let b = b"4\r\nWiki\r\n5;x=1\r\npedia\r\n0\r\n\r\n";
        assert_eq!(dechunk(b).unwrap(), b"Wikipedia");
        assert!(dechunk(b"4\r\nWi").is_err());
    }
}
