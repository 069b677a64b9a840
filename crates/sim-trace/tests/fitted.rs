//! The fitted latency model against the real CPU-engine capture and synthetic captures of
//! known shape.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sim_trace::fitted::{FitInput, FittedModel, fit};
use sim_trace::latency::{DecodeSlot, LatencyModel, PrefillChunk, StepShape};
use sim_trace::trace::{ItlCtx, TraceMeta, TraceRecord, TraceWriter};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/cpu-engine-capture")
        .join(name)
}

fn tmp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fitted");
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn shape(decodes: u32, prefills: &[u64]) -> StepShape {
    StepShape {
        decodes: (0..decodes)
            .map(|i| DecodeSlot {
                context: 150,
                request_key: u64::from(i),
            })
            .collect(),
        prefills: prefills
            .iter()
            .map(|&t| PrefillChunk {
                tokens: t,
                context: 0,
                uncached_prompt: t,
            })
            .collect(),
        ..Default::default()
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// The captured step durations of a shape, from the sidecar.
fn captured(running: u64, prefills: u32) -> Vec<f64> {
    sim_trace::steps::StepStatsReader::open(fixture("steps.jsonl.gz"))
        .unwrap()
        .map(Result::unwrap)
        .filter(|s| s.num_running_reqs == running && s.prefill_requests == prefills)
        .filter_map(|s| s.step_ms)
        .collect()
}

#[test]
fn fitted_on_the_real_engine_it_reproduces_its_step_times() {
    let model = fit(&[FitInput {
        trace: fixture("trace.jsonl.gz"),
        steps: Some(fixture("steps.jsonl.gz")),
    }])
    .unwrap();
    assert_eq!(model.num_spec_tokens, None, "an autoregressive capture");
    let mut lat = model.clone().latency(1, 1.0);
    // decode-only steps of the full batch: p50 and p90 within 10 %
    let sim: Vec<f64> = (0..4000)
        .map(|_| ms(lat.step(&shape(8, &[])).duration))
        .collect();
    let real = captured(8, 0);
    for q in [0.5, 0.9] {
        let (s, r) = (quantile(sim.clone(), q), quantile(real.clone(), q));
        assert!(
            (s - r).abs() / r < 0.10,
            "decode p{}: {s:.2} vs {r:.2} ms",
            q * 100.0
        );
    }
    // seven 128-token prompts admitted next to one decode: the capture's long step
    let sim: Vec<f64> = (0..400)
        .map(|_| ms(lat.step(&shape(1, &[128; 7])).duration))
        .collect();
    let (s, r) = (quantile(sim, 0.5), quantile(captured(8, 7), 0.5));
    assert!((s - r).abs() / r < 0.15, "7 prefills: {s:.1} vs {r:.1} ms");
    // one prompt alone
    let s = ms(lat.step(&shape(0, &[128])).duration);
    let r = quantile(captured(1, 1), 0.5);
    assert!((s - r).abs() / r < 0.15, "1 prefill: {s:.1} vs {r:.1} ms");
    // a batch never seen follows the trend instead of copying the nearest batch
    assert!(model.decode_median(16) > model.decode_median(8));
    // --time-scale divides
    let mut fast = model.latency(1, 10.0);
    let s = ms(fast.step(&shape(0, &[128])).duration);
    assert!((s * 10.0 - r).abs() / r < 0.15, "scaled: {s:.2} ms");
}

#[test]
fn a_synthetic_linear_capture_is_recovered() {
    // decode step = 2 + 0.5·b ms; a prefill of t tokens adds 3 + 0.02·t ms
    let path = tmp("linear.jsonl");
    let mut w = TraceWriter::create(&path, &TraceMeta::new()).unwrap();
    for r in 0..400u32 {
        let b = 2 + r % 12; // a prefill step always has decodes beside it
        let t = 64 * (1 + r % 8);
        let mut itl = Vec::new();
        let mut ctx = ItlCtx::default();
        for g in 0..20u32 {
            let jitter = f64::from((r * 7 + g * 13) % 5) * 0.01;
            let prefill = if g == 5 { t } else { 0 };
            let mut gap = 2.0 + 0.5 * f64::from(b) + jitter;
            if prefill > 0 {
                gap = 2.0 + 0.5 * f64::from(b - 1) + 3.0 + 0.02 * f64::from(t) + jitter;
            }
            itl.push(gap);
            ctx.num_running.push(b);
            ctx.prefill_tokens.push(prefill);
        }
        w.write_record(&TraceRecord {
            prompt_tokens: 100,
            output_tokens: 21,
            itl_ms: itl,
            itl_ctx: ctx,
            ..Default::default()
        })
        .unwrap();
    }
    w.finish().unwrap();
    let model = fit(&[FitInput {
        trace: path,
        steps: None,
    }])
    .unwrap();
    let (a, k) = model.decode_trend_ms;
    assert!(
        (k - 0.5).abs() < 0.025 && (a - 2.02).abs() < 0.15,
        "trend {a} + {k}·b"
    );
    let p = model.prefill;
    assert!((p.per_token_ms - 0.02).abs() < 0.001, "{p:?}");
    assert!((p.overhead_ms - 3.0).abs() < 0.15, "{p:?}");
}

#[test]
fn multi_token_chunks_are_drawn_with_their_own_gaps() {
    // speculative capture: a chunk of n tokens took 3·n ms
    let path = tmp("spec.jsonl");
    let mut w = TraceWriter::create(&path, &TraceMeta::new()).unwrap();
    for r in 0..100u32 {
        let sizes: Vec<u32> = (0..30).map(|g| 1 + (r + g) % 4).collect();
        w.write_record(&TraceRecord {
            prompt_tokens: 10,
            output_tokens: 1 + sizes.iter().sum::<u32>(),
            itl_ms: sizes.iter().map(|&n| 3.0 * f64::from(n)).collect(),
            itl_tokens: sizes,
            concurrency: Some(1),
            ..Default::default()
        })
        .unwrap();
    }
    w.finish().unwrap();
    let model = fit(&[FitInput {
        trace: path.clone(),
        steps: None,
    }])
    .unwrap();
    assert_eq!(model.num_spec_tokens, Some(3));
    let mut lat = model.latency(5, 1.0);
    let mut seen = [0u32; 5];
    for _ in 0..400 {
        let t = lat.step(&shape(1, &[]));
        let n = t.decode_tokens[0];
        assert!(
            (ms(t.duration) - 3.0 * f64::from(n)).abs() < 1e-6,
            "a {n}-token burst after {:?}",
            t.duration
        );
        seen[n as usize] += 1;
    }
    assert!(seen[1..].iter().all(|&c| c > 50), "{seen:?}");
}

#[test]
fn a_saved_model_loads_and_draws_the_same() {
    let model = fit(&[FitInput {
        trace: fixture("trace.jsonl.gz"),
        steps: Some(fixture("steps.jsonl.gz")),
    }])
    .unwrap();
    let path = tmp("model.json");
    model.save(&path).unwrap();
    assert!(FittedModel::is_model_file(&path));
    assert!(!FittedModel::is_model_file(&fixture("trace.jsonl.gz")));
    let size = std::fs::metadata(&path).unwrap().len();
    assert!(size < 16_000, "{size} bytes");
    let back = FittedModel::load(&path).unwrap();
    assert_eq!(back.decode.len(), model.decode.len());
    let (mut a, mut b) = (model.latency(3, 1.0), back.latency(3, 1.0));
    for i in 0..100 {
        let s = shape(1 + i % 8, &[64 * u64::from(i % 3)]);
        let (x, y) = (a.step(&s).duration, b.step(&s).duration);
        assert!(x.abs_diff(y) < Duration::from_nanos(10), "{x:?} vs {y:?}");
    }
    let bad = tmp("bad.json");
    std::fs::write(&bad, r#"{"format": "something-else", "version": 1}"#).unwrap();
    let e = FittedModel::load(&bad).unwrap_err().to_string();
    assert!(e.contains("not a vllm-vcr latency model"), "{e}");
}
