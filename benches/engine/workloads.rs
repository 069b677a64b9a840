//! Inputs written for the runs (a replay capture, a latency model, a synthetic workload,
//! a Mooncake-shaped trace) and the offline `inspect simulate` part run on them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::process::bin;

/// A capture of `n` requests with `tokens` recorded ids each, for `--replay-tokens`.
pub(crate) fn write_replay_trace(path: &Path, n: usize, tokens: u32) {
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
pub(crate) fn write_model(path: &Path) {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/cpu-engine-capture");
    let model = sim_trace::fit::fit(&[sim_trace::fit::FitInput {
        trace: fixture.join("trace.jsonl.gz"),
        steps: Some(fixture.join("steps.jsonl.gz")),
    }])
    .unwrap();
    model.save(path).unwrap();
}

/// A deterministic draw in [0, 1) (xorshift64 from `seed`): the same workload every run.
fn uniform(mut rng: u64) -> impl FnMut() -> f64 {
    move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A synthetic workload for `inspect simulate`: Poisson arrivals at `rate` per second,
/// prompts of 512 tokens (block size 16) opening with one of 8 shared 256-token system
/// prompts, 128 output tokens each, with recorded timings. With `turns > 1` the requests
/// are sessions: each turn's prompt extends the previous turn's (prompt + answer + a new
/// 64-token message) and arrives 2 s after it ended.
pub(crate) fn write_workload(path: &Path, n: usize, rate: f64, turns: usize) {
    use sim_trace::trace::{BlockHash, TraceMeta, TraceRecord, TraceWriter};
    let meta = TraceMeta {
        block_size: Some(16),
        ..TraceMeta::new()
    };
    let mut w = TraceWriter::create(path, &meta).unwrap();
    let mut next = uniform(0x2545_f491_4f6c_dd1d);
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

/// A Mooncake-format trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids`
/// of 512-token blocks) shaped like the public conversation trace: `n` requests spread
/// over `span_s` seconds; 60 % of them continue one of the 200 latest conversations (its
/// blocks plus 1–4 new ones), the rest open a new one of ~16 blocks (log-normal); answers
/// ~300 tokens (log-normal, at most 2,000); prompts capped at 60 blocks.
pub(crate) fn write_mooncake(path: &Path, n: usize, span_s: f64) {
    use std::io::Write;
    let mut unit = uniform(0x9e37_79b9_7f4a_7c15);
    // log-normal by Box–Muller
    let lognormal = |median: f64, sigma: f64, u: &mut dyn FnMut() -> f64| {
        let (a, b) = (1.0 - u(), u());
        median * (sigma * (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()).exp()
    };
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut convs: Vec<Vec<u64>> = Vec::new();
    let mut next_id = 0u64;
    for i in 0..n {
        let ts = (i as f64 * span_s * 1000.0 / n as f64 + unit() * 300.0) as u64;
        if !convs.is_empty() && unit() < 0.6 {
            let c = (unit() * convs.len() as f64) as usize;
            let more = 1 + (unit() * 4.0) as usize;
            for _ in 0..more {
                next_id += 1;
                convs[c].push(next_id);
            }
            let c = convs.remove(c);
            convs.push(c);
        } else {
            let len = (lognormal(16.0, 0.8, &mut unit) as usize).max(1);
            let c: Vec<u64> = (0..len).map(|k| next_id + 1 + k as u64).collect();
            next_id += len as u64;
            convs.push(c);
            if convs.len() > 200 {
                convs.remove(0);
            }
        }
        let hashes = &convs[convs.len() - 1][..convs[convs.len() - 1].len().min(60)];
        let input = hashes.len() * 512 - (unit() * 511.0) as usize;
        let output = (lognormal(300.0, 0.7, &mut unit) as u64).clamp(1, 2000);
        let line = serde_json::json!({
            "timestamp": ts,
            "input_length": input,
            "output_length": output,
            "hash_ids": hashes,
        });
        writeln!(f, "{line}").unwrap();
    }
    f.flush().unwrap();
}

/// A Mooncake-format file as a trace (`inspect convert --from mooncake`, 512-token blocks).
fn convert_mooncake(from: &Path, to: &Path) {
    let ok = Command::new(bin())
        .args([
            "inspect",
            "convert",
            "--from",
            "mooncake",
            "--block-size",
            "512",
        ])
        .arg(from)
        .arg("-o")
        .arg(to)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run vllm-vcr inspect convert")
        .success();
    assert!(
        ok,
        "inspect convert --from mooncake {} failed",
        from.display()
    );
}

/// What one `inspect simulate` run took and did.
pub(crate) struct SimRun {
    /// Simulated span (first arrival to last end), seconds.
    pub(crate) sim: f64,
    pub(crate) wall: f64,
    /// User + system CPU seconds of the command: what the machine's load does not inflate.
    pub(crate) cpu: f64,
    pub(crate) requests: u64,
    pub(crate) tokens: f64,
    pub(crate) json: serde_json::Value,
}

/// CPU seconds of this process's waited-for children so far.
fn children_cpu() -> f64 {
    crate::cpu::rusage_seconds(libc::RUSAGE_CHILDREN)
}

/// One `inspect simulate --json` run.
pub(crate) fn simulate_run(args: &[&str]) -> SimRun {
    let cpu = children_cpu();
    let t = Instant::now();
    let out = Command::new(bin())
        .args(["inspect", "simulate", "--json"])
        .args(args)
        .stderr(Stdio::null())
        .output()
        .expect("run vllm-vcr inspect simulate");
    let wall = t.elapsed().as_secs_f64();
    let cpu = children_cpu() - cpu;
    assert!(out.status.success(), "inspect simulate {args:?} failed");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let sim = v["simulated_ms"].as_f64().unwrap_or(f64::NAN) / 1000.0;
    let s = &v["summary"]["output_tokens"];
    let tokens = s["mean"].as_f64().unwrap_or(0.0) * s["count"].as_f64().unwrap_or(0.0);
    SimRun {
        sim,
        wall,
        cpu,
        requests: v["requests"].as_u64().unwrap_or(0),
        tokens,
        json: v,
    }
}

/// Part 5: `inspect simulate` on the CPU-engine capture with its fitted model, on a
/// Mooncake-shaped trace under the settings Dynamo's mocker was compared with (block 512,
/// 64 seqs, budget 8,192, 4,096 blocks; `BENCH_MOONCAKE=PATH` replays that file instead,
/// e.g. the public conversation trace), and on the synthetic workloads.
pub(crate) fn simulate_part(dir: &Path, q: bool) {
    println!("\n## Offline simulation (`inspect simulate`, the whole command)\n");
    println!(
        "| workload | requests | output tokens | preemptions | simulated s | wall s | CPU s | simulated s per wall s | per CPU s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
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
    let (mooncake, mooncake_label) = match std::env::var_os("BENCH_MOONCAKE") {
        Some(p) => (PathBuf::from(p), "BENCH_MOONCAKE"),
        None => {
            let p = dir.join("sim-mooncake.jsonl");
            write_mooncake(&p, 2000, 600.0);
            (p, "a Mooncake-shaped trace")
        }
    };
    let mc = dir.join("sim-mooncake.jsonl.gz");
    convert_mooncake(&mooncake, &mc);
    // the same shape ×10: ten times the requests over ten times the span
    let mc10 = dir.join("sim-mooncake10.jsonl.gz");
    if !q {
        let p = dir.join("sim-mooncake10.jsonl");
        write_mooncake(&p, 20_000, 6000.0);
        convert_mooncake(&p, &mc10);
    }
    let (f, b, c, se, mc, mc10) = (
        fixture.to_str().unwrap(),
        busy.to_str().unwrap(),
        calm.to_str().unwrap(),
        sessions.to_str().unwrap(),
        mc.to_str().unwrap(),
        mc10.to_str().unwrap(),
    );
    let knobs = [
        "--time-to-first-token",
        "120",
        "--inter-token-latency",
        "20",
    ];
    // Dynamo's mocker's settings; step costs from knobs (TTFT 20 ms + 0.02 ms per prompt
    // token, ITL 15 ms)
    let matched = [
        "--block-size",
        "512",
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        "8192",
        "--num-gpu-blocks",
        "4096",
        "--time-to-first-token",
        "20",
        "--inter-token-latency",
        "15",
        "--prefill-time-per-token",
        "0.02",
    ];
    let mut runs: Vec<(String, Vec<&str>)> = vec![
        (
            "the CPU-engine capture (301 requests), its fitted model".into(),
            vec![f, "--latency-trace", m, "--max-num-seqs", "128"],
        ),
        (
            format!("{mooncake_label}, block 512, 64 seqs, 8,192 budget, 4,096 blocks"),
            [&[mc][..], &matched].concat(),
        ),
    ];
    if !q {
        runs.push((
            "the same shape ×10 (20,000 requests over 6,000 s)".into(),
            [&[mc10][..], &matched].concat(),
        ));
    }
    runs.extend([
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
    ]);
    for (label, args) in runs {
        let r = simulate_run(&args);
        println!(
            "| {label} | {} | {:.0} | {} | {:.1} | {:.2} | {:.2} | {:.0} | {:.0} |",
            r.requests,
            r.tokens,
            r.json["preemptions"],
            r.sim,
            r.wall,
            r.cpu,
            r.sim / r.wall,
            r.sim / r.cpu
        );
    }
}
