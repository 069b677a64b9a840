//! Fitting cost (`cargo bench -p sim-trace --bench fit`): time and peak memory to fit the
//! latency model to 100k synthetic records, with and without the step-stats sidecar, and to
//! save and load the model, and what one step's draw costs. A report, not a timed test.
//!
//! The capture comes from the synthetic engine of the fit tests
//! (`tests/support/synth.rs`): 32 closed-loop clients, prompts of 128–1024 tokens with
//! prefix-cache hits, 64 output tokens each, a 2048-token budget, 10 % noise. Each fit's
//! peak RSS is measured on its own (the peak is reset before it through
//! `/proc/self/clear_refs`). Files go to `std::env::temp_dir()` and are removed.
//!
//! `BENCH_QUICK=1` shrinks the run to 10k records.

#[path = "../tests/support/synth.rs"]
mod synth;

use std::path::Path;
use std::time::Instant;

use sim_trace::fit::{FitInput, FittedModel, fit};
use sim_trace::latency::{DecodeSlot, LatencyModel, PrefillChunk, StepShape};

fn mem_mib(key: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .unwrap_or(0.0)
        / 1024.0
}

/// Reset the peak RSS to the current RSS (Linux ≥ 4.0), so the next peak is one step's.
fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn size(p: &Path) -> f64 {
    std::fs::metadata(p).map_or(0.0, |m| m.len() as f64)
}

fn main() {
    let n = if std::env::var_os("BENCH_QUICK").is_some() {
        10_000
    } else {
        100_000
    };
    let dir = std::env::temp_dir().join(format!("vllm-vcr-fit-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (trace, steps) = (dir.join("trace.jsonl.gz"), dir.join("steps.jsonl.gz"));
    let t = Instant::now();
    let w = synth::Synth {
        requests: n,
        concurrency: 32,
        step_ms: 6.0,
        per_decode_ms: 0.3,
        per_context_token_ms: 0.0002,
        per_prefill_token_ms: 0.04,
        per_prefill_depth_ms: 0.00001,
        noise: 0.1,
        budget: 2048,
        prompt: (128, 1024),
        cached_blocks: 8,
        output: (64, 64),
        think_ms: 5.0,
        ..synth::Synth::default()
    }
    .write(&trace, Some(&steps));
    println!(
        "wrote {} records, {} output tokens ({:.1} MiB gz) and {} steps ({:.1} MiB gz) in {:.1} s",
        w.records,
        w.tokens,
        size(&trace) / (1 << 20) as f64,
        w.steps,
        size(&steps) / (1 << 20) as f64,
        t.elapsed().as_secs_f64()
    );
    println!();
    println!("| fit | time | peak RSS (process) | RSS before |");
    println!("|---|---:|---:|---:|");
    let mut model = None;
    for (what, sidecar) in [
        ("records only", None),
        ("records + sidecar", Some(steps.clone())),
    ] {
        reset_peak();
        let before = mem_mib("VmRSS:");
        let t = Instant::now();
        let m = fit(&[FitInput {
            trace: trace.clone(),
            steps: sidecar,
        }])
        .unwrap();
        let secs = t.elapsed().as_secs_f64();
        println!(
            "| {what} | {secs:.2} s | {:.0} MiB | {before:.0} MiB |",
            mem_mib("VmHWM:")
        );
        model = Some(m);
    }
    let model = model.unwrap();
    let out = dir.join("model.json");
    let t = Instant::now();
    model.save(&out).unwrap();
    let save_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let back = FittedModel::load(&out).unwrap();
    let load_ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(back, model);
    println!();
    println!(
        "model: {:.1} KB, save {save_ms:.2} ms, load {load_ms:.2} ms",
        size(&out) / 1e3
    );
    // what a step costs the engine: 64 decodes, and every 8th step a 512-token chunk
    let decode = StepShape {
        decodes: (0..64)
            .map(|i| DecodeSlot {
                context: 500 + i,
                request_key: i,
            })
            .collect(),
        ..StepShape::default()
    };
    let mut mixed = decode.clone();
    mixed.prefills.push(PrefillChunk {
        tokens: 512,
        context: 256,
        uncached_prompt: 768,
    });
    let mut lat = back.latency(1, 1.0);
    let steps = 1_000_000;
    let t = Instant::now();
    let mut total = 0.0;
    for i in 0..steps {
        let s = if i % 8 == 0 { &mixed } else { &decode };
        total += lat.step(std::hint::black_box(s)).duration.as_secs_f64();
    }
    println!(
        "draw: {:.0} ns per step (64 decodes; mean step {:.2} ms)",
        t.elapsed().as_secs_f64() * 1e9 / f64::from(steps),
        total * 1e3 / f64::from(steps)
    );
    let l = &model.law;
    println!(
        "law: {:.3} + {:.4}·D + {:.3e}·ΣC + {:.4}·P + {:.3e}·Q ms (truth 6 + 0.3·D + 2e-4·ΣC + 0.04·P + 1e-5·Q)",
        l.step_ms,
        l.per_decode_ms,
        l.per_context_token_ms,
        l.per_prefill_token_ms,
        l.per_prefill_depth_ms
    );
    std::fs::remove_dir_all(&dir).ok();
}
