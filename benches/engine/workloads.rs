//! Inputs written for the runs (a replay capture, a latency model, a synthetic workload)
//! and an offline `inspect simulate` run on them.

use std::path::Path;
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
pub(crate) fn simulate_run(args: &[&str]) -> (f64, f64, u64, f64, serde_json::Value) {
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
