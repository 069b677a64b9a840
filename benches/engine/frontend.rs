//! Through a real frontend: `vllm-rs` in front of `play`, loaded by `vllm-rs bench serve`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::{Engine, clock_seconds, free_port, process_cpu_seconds, wait_health};

pub(crate) struct FrontendResult {
    pub(crate) output_tok_s: f64,
    pub(crate) engine_cpu: f64,
    pub(crate) frontend_cpu: f64,
    pub(crate) wall: f64,
    pub(crate) concurrency: usize,
}

pub(crate) fn vllm_rs_path() -> Option<PathBuf> {
    let home = std::env::var_os("VLLM_VCR_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/vllm-vcr")))?;
    let p = home.join("vllm-rs/0.33.0/vllm-rs");
    p.exists().then_some(p)
}

/// One `vllm-rs bench serve` run against the engine build at `bin`, started with
/// `engine_args` (e.g. an inter-token latency).
pub(crate) fn frontend_run(
    dir: &Path,
    bin: &str,
    engine_args: &[&str],
    concurrency: usize,
    prompts: usize,
) -> Option<FrontendResult> {
    let rs = vllm_rs_path()?;
    // a fresh directory per run: the result JSON read below must be this run's
    let _ = std::fs::remove_dir_all(dir);
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
    let args: Vec<&str> = ["--max-num-seqs", "1024"]
        .into_iter()
        .chain(engine_args.iter().copied())
        .collect();
    let engine = Engine::start_bin(
        bin,
        &format!("tcp://127.0.0.1:{hp}"),
        &args,
        &dir.join("engine-frontend.log"),
    );
    if !wait_health(port, Duration::from_secs(30)) {
        let _ = front.kill();
        engine.stop();
        return None;
    }
    let (fcpu0, ecpu0) = (
        process_cpu_seconds(front.id()),
        process_cpu_seconds(engine.child.id()),
    );
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
        process_cpu_seconds(front.id()) - fcpu0,
        process_cpu_seconds(engine.child.id()) - ecpu0,
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

pub(crate) fn result_json_value(dir: &Path, key: &str) -> Option<f64> {
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

/// Part 3: the engine's CPU as a share of the frontend's, unpaced (the engine as fast as
/// it can go) and paced (10 ms between tokens), at concurrency 16, 64 and 256. With
/// `BENCH_BEFORE=PATH` each row runs that build and this one alternately (`BENCH_PAIRS`
/// pairs), so a before/after shares one session's load.
pub(crate) fn frontend_part(dir: &Path, quick: bool) {
    let after = crate::process::bin();
    let before = std::env::var("BENCH_BEFORE").ok();
    let pairs: usize = std::env::var("BENCH_PAIRS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let builds: Vec<(&str, &str)> = match &before {
        Some(b) => vec![("before", b.as_str()), ("after", after.as_str())],
        None => vec![("this", after.as_str())],
    };
    let rounds = if before.is_some() { pairs } else { 1 };
    println!(
        "\n## Through vllm-rs 0.33 (`vllm-rs bench serve`, random dataset, 64 in / 256 out)\n"
    );
    println!(
        "| pacing | concurrency | build | output tokens/s | wall s | engine CPU s | frontend CPU s | engine CPU / frontend CPU |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|");
    // paced runs last (prompts / concurrency) × 2.6 s: about 16 s each
    let cases: [(&str, &[&str], usize, usize); 6] = [
        ("unpaced", &[], 16, 1000),
        ("unpaced", &[], 64, 3000),
        ("unpaced", &[], 256, 6000),
        ("ITL 10 ms", &["--inter-token-latency", "10"], 16, 96),
        ("ITL 10 ms", &["--inter-token-latency", "10"], 64, 384),
        ("ITL 10 ms", &["--inter-token-latency", "10"], 256, 1536),
    ];
    let mut paced: Vec<(usize, &str, FrontendResult)> = Vec::new();
    for (pacing, args, c, n) in cases {
        let n = if quick { (n / 4).max(c) } else { n };
        for round in 0..rounds {
            for &(name, bin) in &builds {
                let run_dir = dir.join(format!("fe-{c}-{}-{name}-{round}", args.len()));
                match frontend_run(&run_dir, bin, args, c, n) {
                    Some(r) => {
                        println!(
                            "| {pacing} | {} | {name} | {:.0} | {:.1} | {:.3} | {:.3} | {:.1} % |",
                            r.concurrency,
                            r.output_tok_s,
                            r.wall,
                            r.engine_cpu,
                            r.frontend_cpu,
                            100.0 * r.engine_cpu / r.frontend_cpu
                        );
                        if !args.is_empty() {
                            paced.push((c, name, r));
                        }
                    }
                    None => println!(
                        "| {pacing} | {c} | {name} | (vllm-rs 0.33.0 not in the cache or failed; see {}) | | | | |",
                        run_dir.display()
                    ),
                }
            }
        }
    }
    paced_floor_table(&paced, quick);
}

/// The paced rows per step, beside the floor: what a thread costs that only wakes at each
/// step's deadline and writes one step's message to a TCP loopback peer. No engine behind
/// this frontend can spend less a step on this host, so the floor as a share of the
/// frontend's CPU is the lowest share any stand-in can reach at that concurrency.
fn paced_floor_table(paced: &[(usize, &str, FrontendResult)], quick: bool) {
    if paced.is_empty() {
        return;
    }
    println!(
        "\n### Paced rows per step, beside the floor (a thread that wakes every 10 ms and sends one step's message over TCP loopback)\n"
    );
    println!(
        "| concurrency | build | engine CPU µs a step | floor µs a step | frontend CPU µs a step | floor / frontend | engine / frontend |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|");
    let steps = if quick { 100 } else { 500 };
    for (c, name, r) in paced {
        // a step's message: about 70 bytes an output (id, one token, the fixed fields)
        let Some(floor) = paced_floor_us(steps, 300 + 70 * c) else {
            println!("| {c} | {name} | (the floor could not be measured) | | | | |");
            continue;
        };
        // paced steps run back to back while requests are in flight: one per 10 ms of wall
        let n = (r.wall / 0.010).max(1.0);
        let (e, f) = (r.engine_cpu * 1e6 / n, r.frontend_cpu * 1e6 / n);
        println!(
            "| {c} | {name} | {e:.0} | {floor:.0} | {f:.0} | {:.1} % | {:.1} % |",
            100.0 * floor / f,
            100.0 * e / f
        );
    }
}

/// CPU µs per step of a thread that sleeps to each 10 ms deadline and writes `bytes` to a
/// TCP loopback peer (another thread reads them), on the thread's own CPU clock.
fn paced_floor_us(steps: usize, bytes: usize) -> Option<f64> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").ok()?;
    let addr = listener.local_addr().ok()?;
    let reader = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().ok()?;
        let mut buf = vec![0u8; 1 << 16];
        while s.read(&mut buf).ok()? > 0 {}
        Some(())
    });
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_nodelay(true).ok()?;
    let msg = vec![0x5a_u8; bytes];
    let thread_cpu = || clock_seconds(libc::CLOCK_THREAD_CPUTIME_ID);
    let t0 = thread_cpu()?;
    let mut next = Instant::now();
    for _ in 0..steps {
        next += Duration::from_millis(10);
        if let Some(d) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
        s.write_all(&msg).ok()?;
    }
    let cpu = thread_cpu()? - t0;
    drop(s);
    reader.join().ok()??;
    Some(cpu * 1e6 / steps as f64)
}
