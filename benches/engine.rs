//! Engine benchmarks (`cargo bench --bench engine`): not timed tests, a report.
//!
//! 1. Throughput: a Rust client acting as the frontend drives `vllm-vcr play` (a separate
//!    process, instant latency) over ZMQ at several concurrencies and reports output
//!    tokens/s and the engine's CPU seconds per million tokens.
//! 2. Pacing: fixed 10 ms inter-token latency, many concurrent streams; the engine reports
//!    its step emission lateness against the scheduled deadlines.
//! 3. Through a real frontend: `vllm-rs` + `play`, loaded by `vllm-rs bench serve`; reports
//!    frontend-limited throughput and the engine's share of CPU.
//!
//! 4. Replay cost: engine CPU per token serving recorded ids against random ones.
//! 5. Offline simulation: `inspect simulate` on the CPU-engine capture and on synthetic
//!    workloads; simulated seconds per wall second (must be ≥ 100).
//! 6. Grammars off the step loop: a 10 ms-ITL stream's gaps while six requests with huge
//!    JSON schemas compile their grammars, against the same stream alone.
//!
//! Environment: `BENCH_QUICK=1` shrinks every run (smoke mode); `BENCH_SKIP_FRONTEND=1`
//! skips part 3; `BENCH_ONLY=throughput,pacing,grammar,soak,replay,simulate,frontend` runs only those;
//! `BENCH_CONCURRENCY=N` runs only that row of part 1; `BENCH_BIN=PATH` runs another build.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use sim_protocol::decode::{DecodedOutputs, decode_outputs_for};
use sim_protocol::encode::encode_request;
use sim_protocol::transport::{FrontendListener, recv_frames, send_frames};
use sim_protocol::{EngineCoreRequest, SamplingParams, VllmLine};

const BIN: &str = env!("CARGO_BIN_EXE_vllm-vcr");

/// The binary under test: `BENCH_BIN=path` runs another build (e.g. a copy of the previous
/// one, for a before/after in one run).
fn bin() -> String {
    std::env::var("BENCH_BIN").unwrap_or_else(|_| BIN.to_string())
}

fn quick() -> bool {
    std::env::var_os("BENCH_QUICK").is_some()
}

/// Whether to run a part: `BENCH_ONLY=replay,pacing` runs only those (default: all).
fn part(name: &str) -> bool {
    match std::env::var("BENCH_ONLY") {
        Ok(v) if !v.trim().is_empty() => v.split(',').any(|p| p.trim() == name),
        _ => true,
    }
}

/// utime + stime of a process, seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return f64::NAN;
    };
    // fields after the parenthesised command name
    let rest = &stat[stat.rfind(')').map_or(0, |i| i + 2)..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(11) + ticks(12)) / hz
}

struct Engine {
    child: Child,
    log: PathBuf,
}

impl Engine {
    fn start(handshake: &str, extra: &[&str], log: &Path) -> Engine {
        let f = std::fs::File::create(log).unwrap();
        let child = Command::new(bin())
            .arg("play")
            .args(["--handshake-address", handshake])
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(f)
            .spawn()
            .expect("start vllm-vcr play");
        Engine {
            child,
            log: log.to_path_buf(),
        }
    }

    fn stop(mut self) -> String {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

fn request(id: String, prompt_len: usize, max_tokens: u32) -> EngineCoreRequest {
    EngineCoreRequest {
        request_id: id,
        prompt_token_ids: Some((0..prompt_len as u32).map(|i| 3 + i % 200).collect()),
        sampling_params: Some(SamplingParams {
            max_tokens: Some(max_tokens),
            eos_token_id: None, // ignore_eos: every request runs to max_tokens
            output_kind: 1,
            ..Default::default()
        }),
        arrival_time: 0.0,
        ..Default::default()
    }
}

struct DirectResult {
    concurrency: usize,
    tokens: u64,
    wall: f64,
    engine_cpu: f64,
    /// Engine resident memory (KiB) after a quarter, half and all of the requests.
    rss_kib: [u64; 3],
}

/// VmRSS of a process, KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Closed loop: keep `concurrency` requests in flight until `total` were served.
async fn direct_run(
    concurrency: usize,
    total: usize,
    max_tokens: u32,
    extra: &[&str],
    log: &Path,
) -> (DirectResult, String) {
    let line = VllmLine::new(0, 33);
    // `replay-<i>` names the i-th record of a --replay-tokens trace
    let replaying = extra.contains(&"--replay-tokens");
    let prefix = if replaying { "replay-" } else { "b" };
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let seqs = concurrency.to_string();
    let mut args = vec!["--max-num-seqs", &seqs, "--max-model-len", "1000000"];
    args.extend_from_slice(extra);
    let engine = Engine::start(fl.handshake_address(), &args, log);
    let engines = fl.accept_engines(1, Duration::from_secs(30)).await.unwrap();
    let identity = engines[0].identity.clone();
    let mut socks = fl.into_sockets();
    let mut input = socks.inputs.remove(0);
    let mut output = socks.outputs.remove(0);
    let pid = engine.child.id();

    let cpu0 = cpu_seconds(pid);
    let start = Instant::now();
    let mut sent = 0usize;
    let mut in_flight: HashSet<String> = HashSet::new();
    let mut tokens = 0u64;
    let mut done = 0usize;
    let mut rss = [0u64; 3];
    let send = |i: usize| {
        let mut frames = vec![identity.clone()];
        frames.extend(encode_request(
            line,
            &request(format!("{prefix}{i}"), 32, max_tokens),
        ));
        frames
    };
    while sent < concurrency.min(total) {
        send_frames(&mut input, send(sent)).await.unwrap();
        in_flight.insert(format!("{prefix}{sent}"));
        sent += 1;
    }
    while done < total {
        let frames: Vec<Bytes> = recv_frames(&mut output).await.unwrap();
        let Ok(DecodedOutputs::Outputs(env)) = decode_outputs_for(line, &frames) else {
            panic!("bad output");
        };
        let mut refill = 0;
        for o in &env.outputs {
            tokens += o.new_token_ids.len() as u64;
            if o.finish_reason.is_some() && in_flight.remove(o.request_id.as_str()) {
                done += 1;
                refill += 1;
                if done == total / 4 {
                    rss[0] = rss_kib(pid);
                } else if done == total / 2 {
                    rss[1] = rss_kib(pid);
                }
            }
        }
        for _ in 0..refill {
            if sent < total {
                send_frames(&mut input, send(sent)).await.unwrap();
                in_flight.insert(format!("{prefix}{sent}"));
                sent += 1;
            }
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let engine_cpu = cpu_seconds(pid) - cpu0;
    rss[2] = rss_kib(pid);
    drop(input);
    drop(output);
    let log = engine.stop();
    (
        DirectResult {
            concurrency,
            tokens,
            wall,
            engine_cpu,
            rss_kib: rss,
        },
        log,
    )
}

/// The inter-token gaps (engine timestamps, ms) of one stream at a fixed 10 ms ITL while
/// `grammars` requests with a 60,000-entry enum schema arrive (each compiles a grammar of
/// some hundreds of milliseconds); `grammars = 0` is the baseline. Returns the stream's
/// gaps and the wall time until every grammar request finished.
async fn grammar_run(grammars: usize, log: &Path) -> (Vec<f64>, f64) {
    use rmpv::Value;
    let line = VllmLine::new(0, 33);
    let mut fl = FrontendListener::bind("127.0.0.1", 1).await.unwrap();
    let engine = Engine::start(
        fl.handshake_address(),
        &["--inter-token-latency", "10", "--time-to-first-token", "10"],
        log,
    );
    let engines = fl.accept_engines(1, Duration::from_secs(30)).await.unwrap();
    let identity = engines[0].identity.clone();
    let mut socks = fl.into_sockets();
    let mut input = socks.inputs.remove(0);
    let mut output = socks.outputs.remove(0);
    let words: Vec<String> = (0..60_000)
        .map(|i| format!("option-{i:06}-{}", (i * 7919) % 100_003))
        .collect();
    let schema = serde_json::json!({"type": "object", "properties": {"pick": {"enum": words}},
        "required": ["pick"]})
    .to_string();
    let send = |r: &EngineCoreRequest| {
        let mut frames = vec![identity.clone()];
        frames.extend(encode_request(line, r));
        frames
    };
    let stream = request("stream".into(), 16, 200);
    send_frames(&mut input, send(&stream)).await.unwrap();
    let mut stamps: Vec<f64> = Vec::new();
    let mut pending: HashSet<String> = (0..grammars).map(|i| format!("g{i}")).collect();
    let mut stream_done = false;
    let mut sent = false;
    let start = Instant::now();
    let mut grammars_done_at = 0.0;
    while !stream_done || !pending.is_empty() {
        let frames: Vec<Bytes> = recv_frames(&mut output).await.unwrap();
        let Ok(DecodedOutputs::Outputs(env)) = decode_outputs_for(line, &frames) else {
            continue;
        };
        for o in &env.outputs {
            if o.request_id.as_str() == "stream" {
                stamps.push(env.timestamp);
                stream_done |= o.finish_reason.is_some();
            } else if o.finish_reason.is_some() && pending.remove(o.request_id.as_str()) {
                grammars_done_at = start.elapsed().as_secs_f64();
            }
        }
        // the grammars arrive once the stream is in its stride
        if !sent && stamps.len() == 20 {
            for i in 0..grammars {
                let mut r = request(format!("g{i}"), 16, 8);
                if let Some(sp) = r.sampling_params.as_mut() {
                    sp.structured_outputs = Some(Value::Map(vec![
                        (Value::from("json"), Value::from(schema.clone())),
                        (Value::from("_backend"), Value::from("xgrammar")),
                    ]));
                }
                send_frames(&mut input, send(&r)).await.unwrap();
            }
            sent = true;
        }
    }
    drop(input);
    drop(output);
    engine.stop();
    let gaps = stamps.windows(2).map(|p| (p[1] - p[0]) * 1e3).collect();
    (gaps, grammars_done_at)
}

/// A capture of `n` requests with `tokens` recorded ids each, for `--replay-tokens`.
fn write_replay_trace(path: &Path, n: usize, tokens: u32) {
    use sim_trace::trace::{TraceMeta, TraceRecord, TraceWriter};
    let meta = TraceMeta {
        block_size: Some(16),
        ..TraceMeta::new()
    };
    let mut w = TraceWriter::create(path, &meta).unwrap();
    for i in 0..n {
        w.write_record(&TraceRecord {
            request_id: Some(format!("cap-{i}")),
            prompt_tokens: 32,
            output_tokens: tokens,
            arrival_ms: Some(i as f64),
            ttft_ms: Some(1.0),
            output_token_ids: Some((0..tokens).map(|t| 3 + (t + i as u32) % 250).collect()),
            finish_reason: Some("length".into()),
            ..Default::default()
        })
        .unwrap();
    }
    w.finish().unwrap();
}

/// The model `inspect fit` makes of the real CPU-engine capture fixture.
fn write_model(path: &Path) {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/cpu-engine-capture");
    let model = sim_trace::fit::fit(&[sim_trace::fit::FitInput {
        trace: fixture.join("trace.jsonl.gz"),
        steps: Some(fixture.join("steps.jsonl.gz")),
    }])
    .unwrap();
    model.save(path).unwrap();
}

/// A synthetic workload for `inspect simulate`: Poisson arrivals at `rate` per second,
/// prompts of 512 tokens (block size 16) opening with one of 8 shared 256-token system
/// prompts, 128 output tokens each, with recorded timings. With `turns > 1` the requests
/// are sessions: each turn's prompt extends the previous turn's (prompt + answer + a new
/// 64-token message) and arrives 2 s after it ended.
fn write_workload(path: &Path, n: usize, rate: f64, turns: usize) {
    use sim_trace::trace::{BlockHash, TraceMeta, TraceRecord, TraceWriter};
    let meta = TraceMeta {
        block_size: Some(16),
        ..TraceMeta::new()
    };
    let mut w = TraceWriter::create(path, &meta).unwrap();
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 11) as f64 / (1u64 << 53) as f64
    };
    let (ttft, itl, out) = (120.0, 20.0, 128u32);
    let e2e = ttft + itl * f64::from(out - 1);
    let mut fresh = 1u64 << 40;
    let mut t = 0.0;
    let mut written = 0;
    while written < n {
        t += -(1.0 - next()).ln() / rate * 1000.0;
        let system = (next() * 8.0) as u64;
        let mut hashes: Vec<u64> = (0..16).map(|k| system * 1000 + k).collect();
        let mut arrival = t;
        for _ in 0..turns.min(n - written) {
            // this turn's own blocks: 256 tokens on the first turn, 64 + the answer later
            let own = if hashes.len() == 16 {
                16
            } else {
                (64 + out as usize) / 16
            };
            for _ in 0..own {
                fresh += 1;
                hashes.push(fresh);
            }
            w.write_record(&TraceRecord {
                prompt_tokens: (hashes.len() * 16) as u32,
                output_tokens: out,
                arrival_ms: Some(arrival),
                ttft_ms: Some(ttft),
                itl_ms: vec![itl; out as usize - 1],
                block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
                finish_reason: Some("length".into()),
                ..Default::default()
            })
            .unwrap();
            written += 1;
            arrival += e2e + 2000.0;
        }
    }
    w.finish().unwrap();
}

/// One `inspect simulate` run: (simulated s, wall s, requests, output tokens, its JSON).
fn simulate_run(args: &[&str]) -> (f64, f64, u64, f64, serde_json::Value) {
    let t = Instant::now();
    let out = Command::new(bin())
        .args(["inspect", "simulate", "--json"])
        .args(args)
        .stderr(Stdio::null())
        .output()
        .expect("run vllm-vcr inspect simulate");
    let wall = t.elapsed().as_secs_f64();
    assert!(out.status.success(), "inspect simulate {args:?} failed");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let sim = v["simulated_ms"].as_f64().unwrap_or(f64::NAN) / 1000.0;
    let s = &v["summary"]["output_tokens"];
    let tokens = s["mean"].as_f64().unwrap_or(0.0) * s["count"].as_f64().unwrap_or(0.0);
    (sim, wall, v["requests"].as_u64().unwrap_or(0), tokens, v)
}

fn log_field(log: &str, key: &str) -> Option<f64> {
    let line = log.lines().rev().find(|l| l.contains("pacing:"))?;
    let plain: String = strip_ansi(line);
    let at = plain.find(&format!("{key}="))? + key.len() + 1;
    let rest = plain[at..].trim_start_matches('"');
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::new();
    let mut esc = false;
    for c in s.chars() {
        if esc {
            if c.is_ascii_alphabetic() {
                esc = false;
            }
        } else if c == '\u{1b}' {
            esc = true;
        } else {
            out.push(c);
        }
    }
    out
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_health(port: u16, timeout: Duration) -> bool {
    use std::io::{Read, Write};
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.write_all(b"GET /health HTTP/1.0\r\nHost: x\r\n\r\n");
            let mut buf = [0u8; 32];
            if let Ok(n) = s.read(&mut buf)
                && String::from_utf8_lossy(&buf[..n]).contains(" 200")
            {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

struct FrontendResult {
    output_tok_s: f64,
    engine_cpu: f64,
    frontend_cpu: f64,
    wall: f64,
    concurrency: usize,
}

fn vllm_rs_path() -> Option<PathBuf> {
    let home = std::env::var_os("VLLM_VCR_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/vllm-vcr")))?;
    let p = home.join("vllm-rs/0.33.0/vllm-rs");
    p.exists().then_some(p)
}

fn frontend_run(dir: &Path, concurrency: usize, prompts: usize) -> Option<FrontendResult> {
    let rs = vllm_rs_path()?;
    std::fs::create_dir_all(dir).ok()?;
    let model = dir.join("model");
    vllm_vcr::tiny_model::write_to(&model).unwrap();
    let (hp, port) = (free_port(), free_port());
    let mut front = Command::new(&rs)
        .args([
            "serve",
            model.to_str().unwrap(),
            "--data-parallel-size-local",
            "0",
        ])
        .args([
            "--handshake-host",
            "127.0.0.1",
            "--handshake-port",
            &hp.to_string(),
        ])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args([
            "--served-model-name",
            "tiny",
            "--reasoning-parser",
            "none",
            "--disable-log-stats",
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("frontend.log")).unwrap())
        .spawn()
        .ok()?;
    let engine = Engine::start(
        &format!("tcp://127.0.0.1:{hp}"),
        &["--max-num-seqs", "1024"],
        &dir.join("engine-frontend.log"),
    );
    if !wait_health(port, Duration::from_secs(30)) {
        let _ = front.kill();
        engine.stop();
        return None;
    }
    let (fcpu0, ecpu0) = (cpu_seconds(front.id()), cpu_seconds(engine.child.id()));
    let start = Instant::now();
    let out = Command::new(&rs)
        .args([
            "bench",
            "serve",
            "--port",
            &port.to_string(),
            "--model",
            "tiny",
        ])
        .args([
            "--tokenizer",
            model.to_str().unwrap(),
            "--dataset-name",
            "random",
        ])
        .args(["--random-input-len", "64", "--random-output-len", "256"])
        .args(["--num-prompts", &prompts.to_string()])
        .args(["--max-concurrency", &concurrency.to_string()])
        .args(["--prompt-token-ids", "--disable-tqdm", "--ignore-eos"])
        .args(["--save-result", "--result-dir", dir.to_str().unwrap()])
        .output()
        .ok()?;
    let wall = start.elapsed().as_secs_f64();
    let (fcpu, ecpu) = (
        cpu_seconds(front.id()) - fcpu0,
        cpu_seconds(engine.child.id()) - ecpu0,
    );
    // SAFETY: signalling our own child.
    unsafe { libc::kill(front.id() as i32, libc::SIGTERM) };
    let _ = front.wait();
    engine.stop();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    std::fs::write(dir.join("bench-serve.txt"), &text).ok();
    if !out.status.success() {
        eprintln!(
            "vllm-rs bench serve failed:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let output_tok_s = result_json_value(dir, "output_throughput").or_else(|| {
        text.lines()
            .find(|l| l.to_lowercase().contains("output token throughput"))
            .and_then(|l| l.split_whitespace().last()?.parse().ok())
    })?;
    Some(FrontendResult {
        output_tok_s,
        engine_cpu: ecpu,
        frontend_cpu: fcpu,
        wall,
        concurrency,
    })
}

fn result_json_value(dir: &Path, key: &str) -> Option<f64> {
    for e in std::fs::read_dir(dir).ok()? {
        let p = e.ok()?.path();
        if p.extension().is_some_and(|x| x == "json") {
            let v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&p).ok()?).ok()?;
            if let Some(x) = v.get(key).and_then(|x| x.as_f64()) {
                return Some(x);
            }
        }
    }
    None
}

fn main() {
    // `cargo bench` passes `--bench`; ignore arguments.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = std::env::temp_dir().join(format!("vllm-vcr-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let q = quick();

    if part("throughput") {
        println!(
            "## Engine throughput (direct ZMQ client, instant latency, 256 tokens per request)\n"
        );
        println!(
            "| concurrency | requests | output tokens | wall s | tokens/s | engine CPU s | engine CPU s per 1M tokens |"
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|");
        // BENCH_CONCURRENCY=4096 runs one row (e.g. to profile it)
        let only: Option<usize> = std::env::var("BENCH_CONCURRENCY")
            .ok()
            .and_then(|v| v.parse().ok());
        for &(c, total) in &[(1usize, 200usize), (64, 2000), (1024, 8192), (4096, 16384)] {
            if only.is_some_and(|o| o != c) {
                continue;
            }
            let total = if q { total / 10 } else { total }.max(c);
            let (r, _) = rt.block_on(direct_run(
                c,
                total,
                256,
                &[],
                &dir.join(format!("engine-{c}.log")),
            ));
            println!(
                "| {} | {} | {} | {:.2} | {:.0} | {:.2} | {:.2} |",
                r.concurrency,
                total,
                r.tokens,
                r.wall,
                r.tokens as f64 / r.wall,
                r.engine_cpu,
                r.engine_cpu / (r.tokens as f64 / 1e6)
            );
        }
    }
    if part("pacing") {
        println!("\n## Pacing precision (fixed 10 ms inter-token latency)\n");
        println!(
            "| concurrent streams | steps | lateness p50 µs | lateness p99 µs | lateness max µs |"
        );
        println!("|---:|---:|---:|---:|---:|");
        for &streams in &[100usize, 1000] {
            let tokens = if q { 50 } else { 200 };
            let (_, log) = rt.block_on(direct_run(
                streams,
                streams,
                tokens,
                &["--inter-token-latency", "10", "--time-to-first-token", "10"],
                &dir.join(format!("pacing-{streams}.log")),
            ));
            println!(
                "| {} | {} | {:.0} | {:.0} | {:.0} |",
                streams,
                log_field(&log, "steps").unwrap_or(f64::NAN),
                log_field(&log, "lateness_p50_us").unwrap_or(f64::NAN),
                log_field(&log, "lateness_p99_us").unwrap_or(f64::NAN),
                log_field(&log, "lateness_max_us").unwrap_or(f64::NAN),
            );
        }
    }
    if part("grammar") {
        println!(
            "\n## A stream's pace while grammars compile (10 ms ITL; 60,000-entry enum schemas)\n"
        );
        println!(
            "| grammar requests | stream gaps | gap p50 ms | gap p99 ms | gap max ms | grammars done after s |"
        );
        println!("|---:|---:|---:|---:|---:|---:|");
        for &g in &[0usize, 6] {
            let (mut gaps, done) =
                rt.block_on(grammar_run(g, &dir.join(format!("grammar-{g}.log"))));
            gaps.sort_by(f64::total_cmp);
            let q = |p: f64| gaps[((gaps.len() - 1) as f64 * p).round() as usize];
            println!(
                "| {g} | {} | {:.1} | {:.1} | {:.1} | {} |",
                gaps.len(),
                q(0.5),
                q(0.99),
                q(1.0),
                if g == 0 {
                    "-".to_string()
                } else {
                    format!("{done:.2}")
                }
            );
        }
    }
    if part("soak") {
        println!(
            "\n## Memory over a soak (concurrency 64, 64 tokens per request, instant latency)\n"
        );
        println!("| requests | engine RSS after 1/4 | after 1/2 | at the end | growth 1/4 → end |");
        println!("|---:|---:|---:|---:|---:|");
        let soak = if q { 4000 } else { 40_000 };
        let (r, _) = rt.block_on(direct_run(64, soak, 64, &[], &dir.join("soak.log")));
        let [a, b, c] = r.rss_kib;
        println!(
            "| {soak} | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:+.1} % |",
            a as f64 / 1024.0,
            b as f64 / 1024.0,
            c as f64 / 1024.0,
            100.0 * (c as f64 - a as f64) / a.max(1) as f64
        );
    }
    if part("replay") {
        println!(
            "\n## Replay cost (concurrency 64, 256 tokens per request, instant latency; engine CPU s per 1M tokens)\n"
        );
        println!(
            "| tokens | requests | output tokens | engine CPU s | per 1M tokens | vs random |"
        );
        println!("|---|---:|---:|---:|---:|---:|");
        let n = if q { 1000 } else { 8000 };
        let trace = dir.join("replay.jsonl.gz");
        write_replay_trace(&trace, n, 256);
        let trace_arg = trace.to_str().unwrap();
        let mut base = f64::NAN;
        let model = dir.join("model.json");
        write_model(&model);
        let model_arg = model.to_str().unwrap();
        for (label, extra) in [
            ("random", vec![]),
            (
                "--replay-tokens (index)",
                vec!["--replay-tokens", trace_arg],
            ),
            (
                "random, knobs (ITL 45 ms = the model's step at 64, time scale 100)",
                vec!["--inter-token-latency", "45", "--time-scale", "100"],
            ),
            (
                "random, --latency-trace (fixture model, time scale 100)",
                vec!["--latency-trace", model_arg, "--time-scale", "100"],
            ),
        ] {
            let (r, _) = rt.block_on(direct_run(
                64,
                n,
                256,
                &extra,
                &dir.join(format!("replay-{}.log", label.len())),
            ));
            let per_m = r.engine_cpu / (r.tokens as f64 / 1e6);
            if extra.is_empty() {
                base = per_m;
            }
            println!(
                "| {label} | {n} | {} | {:.2} | {:.2} | {:.2}× |",
                r.tokens,
                r.engine_cpu,
                per_m,
                per_m / base
            );
        }
    }
    if part("simulate") {
        println!("\n## Offline simulation (`inspect simulate`, wall time of the whole command)\n");
        println!(
            "| workload | requests | output tokens | preemptions | simulated s | wall s | simulated s per wall s |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|");
        let model = dir.join("sim-model.json");
        write_model(&model);
        let m = model.to_str().unwrap();
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/cpu-engine-capture/trace.jsonl.gz");
        let n = if q { 2000 } else { 20_000 };
        let busy = dir.join("sim-busy.jsonl.gz");
        write_workload(&busy, n, 20.0, 1);
        let calm = dir.join("sim-calm.jsonl.gz");
        write_workload(&calm, n, 1.0, 1);
        let sessions = dir.join("sim-sessions.jsonl.gz");
        write_workload(&sessions, n, 1.0, 10);
        let (f, b, c, se) = (
            fixture.to_str().unwrap(),
            busy.to_str().unwrap(),
            calm.to_str().unwrap(),
            sessions.to_str().unwrap(),
        );
        let knobs = [
            "--time-to-first-token",
            "120",
            "--inter-token-latency",
            "20",
        ];
        let runs: [(String, Vec<&str>); 5] = [
            (
                "the CPU-engine capture (301 requests), its fitted model".into(),
                vec![f, "--latency-trace", m, "--max-num-seqs", "128"],
            ),
            (
                format!("{n} requests at 20/s, knobs (TTFT 120, ITL 20 ms)"),
                [&[b][..], &knobs].concat(),
            ),
            (
                "the same, what-if 64 seqs and 1,024 blocks".into(),
                [
                    &[b][..],
                    &knobs,
                    &["--max-num-seqs", "64", "--num-gpu-blocks", "1024"],
                ]
                .concat(),
            ),
            (
                format!("{n} requests at 1/s, the fixture's fitted model"),
                vec![c, "--latency-trace", m],
            ),
            (
                format!("{} sessions of 10 turns, --replay-sessions, knobs", n / 10),
                [&[se, "--replay-sessions"][..], &knobs].concat(),
            ),
        ];
        for (label, args) in runs {
            let (sim, wall, reqs, tokens, v) = simulate_run(&args);
            println!(
                "| {label} | {reqs} | {tokens:.0} | {} | {sim:.1} | {wall:.2} | {:.0} |",
                v["preemptions"],
                sim / wall
            );
        }
    }
    if part("frontend") && std::env::var_os("BENCH_SKIP_FRONTEND").is_none() {
        println!(
            "\n## Through vllm-rs 0.33 (`vllm-rs bench serve`, random dataset, 64 in / 256 out)\n"
        );
        println!(
            "| concurrency | output tokens/s | wall s | engine CPU s | frontend CPU s | engine share of CPU |"
        );
        println!("|---:|---:|---:|---:|---:|---:|");
        for &(c, n) in &[(16usize, 1000usize), (64, 3000), (256, 6000)] {
            let n = if q { n / 4 } else { n };
            match frontend_run(&dir.join(format!("fe-{c}")), c, n) {
                Some(r) => println!(
                    "| {} | {:.0} | {:.1} | {:.2} | {:.2} | {:.1} % |",
                    r.concurrency,
                    r.output_tok_s,
                    r.wall,
                    r.engine_cpu,
                    r.frontend_cpu,
                    100.0 * r.engine_cpu / (r.engine_cpu + r.frontend_cpu)
                ),
                None => println!(
                    "| {c} | (vllm-rs 0.33.0 not in the cache or failed; see {}) | | | | |",
                    dir.display()
                ),
            }
        }
    }
    eprintln!("logs in {}", dir.display());
}
