//! The fitted latency model against the real CPU-engine capture and synthetic captures of
//! known costs.

#[path = "support/synth.rs"]
mod synth;

use std::path::{Path, PathBuf};
use std::time::Duration;

use sim_trace::fit::{FitError, FitInput, FittedModel, InputKind, fit, sniff};
use sim_trace::latency::{DecodeSlot, LatencyModel, PrefillChunk, StepShape};
use sim_trace::steps::{StepStats, StepStatsReader};
use synth::Synth;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/cpu-engine-capture")
        .join(name)
}

fn tmp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fit");
    std::fs::create_dir_all(&d).unwrap();
    d.join(format!("{}-{name}", std::process::id()))
}

fn fixture_model() -> FittedModel {
    fit(&[FitInput {
        trace: fixture("trace.jsonl.gz"),
        steps: Some(fixture("steps.jsonl.gz")),
    }])
    .unwrap()
}

/// `decodes` decodes at context 160 and cold prefill chunks of these sizes.
fn shape(decodes: u32, prefills: &[u64]) -> StepShape {
    StepShape {
        decodes: (0..decodes)
            .map(|i| DecodeSlot {
                context: 160,
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

fn quantile(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let pos = (v.len() - 1) as f64 * q;
    let lo = pos.floor() as usize;
    let hi = (lo + 1).min(v.len() - 1);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

fn draws(lat: &mut impl LatencyModel, s: &StepShape, n: usize) -> Vec<f64> {
    (0..n).map(|_| ms(lat.step(s).duration)).collect()
}

/// Captured step durations of the fixture: steps with `outputs` outputs of which
/// `prefills` were first tokens.
fn captured(outputs: u64, prefills: u32) -> Vec<f64> {
    StepStatsReader::open(fixture("steps.jsonl.gz"))
        .unwrap()
        .map(Result::unwrap)
        .filter(|s: &StepStats| s.outputs == outputs && s.prefill_requests == prefills)
        .filter_map(|s| s.step_ms)
        .collect()
}

fn within(what: &str, sim: f64, real: f64, tol: f64) {
    let err = (sim - real).abs() / real;
    assert!(
        err < tol,
        "{what}: {sim:.3} vs captured {real:.3} ({:+.1} %)",
        100.0 * (sim - real) / real
    );
}

#[test]
fn fitted_on_the_real_engine_it_reproduces_its_steps() {
    let model = fixture_model();
    assert_eq!(model.num_spec_tokens(), None, "an autoregressive capture");
    let mut lat = model.clone().latency(1, 1.0);
    // decode-only steps of the full batch: p50 and p90 within 10 %
    let sim = draws(&mut lat, &shape(8, &[]), 20_000);
    let real = captured(8, 0);
    for q in [0.5, 0.9] {
        within(
            &format!("decode p{}", q * 100.0),
            quantile(&sim, q),
            quantile(&real, q),
            0.10,
        );
    }
    // the tail is the capture's, not a normal's: p99 within 10 % too
    within(
        "decode p99",
        quantile(&sim, 0.99),
        quantile(&real, 0.99),
        0.10,
    );
    // seven 128-token prompts admitted next to one decode (the batch becomes 8): the
    // capture's long step, within 15 %
    let sim = draws(&mut lat, &shape(1, &[128; 7]), 4000);
    let real = captured(8, 7);
    within(
        "7 × 128 prefill + 1 decode p50",
        quantile(&sim, 0.5),
        quantile(&real, 0.5),
        0.15,
    );
    within(
        "7 × 128 prefill + 1 decode p90",
        quantile(&sim, 0.9),
        quantile(&real, 0.9),
        0.15,
    );
    // one 128-token prompt alone
    let sim = draws(&mut lat, &shape(0, &[128]), 4000);
    within(
        "1 × 128 prefill p50",
        quantile(&sim, 0.5),
        quantile(&captured(1, 1), 0.5),
        0.15,
    );
    // batch sizes never captured follow the law's per-decode trend
    let e8 = model.expected_ms(&shape(8, &[]));
    let e16 = model.expected_ms(&shape(16, &[]));
    let e64 = model.expected_ms(&shape(64, &[]));
    assert!(e8 < e16 && e16 < e64, "{e8} {e16} {e64}");
    let law = |d| model.law_ms(&shape(d, &[]));
    assert!(model.law.per_decode_ms > 0.0);
    within(
        "law slope",
        law(64) - law(16),
        48.0 * model.law.per_decode_ms,
        1e-6,
    );
    // beyond the largest captured batch, the largest bin's ratios
    within("batch 64 ratio", e64 / law(64), e8 / law(8), 1e-9);
    // the fixture identifies batch size and prefill tokens; its prompts all have one
    // length at depth 0, so depth work is not identifiable
    let kept: Vec<&str> = model
        .law
        .terms
        .iter()
        .filter(|t| t.kept)
        .map(|t| t.term.as_str())
        .collect();
    assert_eq!(kept, ["step_ms", "per_decode_ms", "per_prefill_token_ms"]);
    // --time-scale divides every duration
    let mut fast = model.clone().latency(1, 10.0);
    let mut slow = model.latency(1, 1.0);
    let s = shape(8, &[128]);
    for _ in 0..50 {
        let (a, b) = (ms(fast.step(&s).duration), ms(slow.step(&s).duration));
        assert!((a * 10.0 - b).abs() < 1e-4, "{a} × 10 vs {b}");
    }
}

#[test]
fn without_the_sidecar_the_records_give_the_same_steps() {
    let with = fixture_model();
    let without = fit(&[FitInput {
        trace: fixture("trace.jsonl.gz"),
        steps: None,
    }])
    .unwrap();
    // every step of the fixture emitted a token, so the token times show them all; only
    // the sidecar says when the engine sat idle (its one such step is too few to fit)
    let terms = |law: &sim_trace::fit::StepLaw| {
        law.terms
            .iter()
            .filter(|t| t.term != "after_idle_ms")
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(terms(&with.law), terms(&without.law));
    assert_eq!(
        sim_trace::fit::StepLaw {
            terms: Vec::new(),
            ..with.law.clone()
        },
        sim_trace::fit::StepLaw {
            terms: Vec::new(),
            ..without.law.clone()
        }
    );
    assert_eq!(with.decode, without.decode);
    assert_eq!(with.prefill, without.prefill);
}

/// A capture of the synthetic engine with every cost term in play: batches up to 16,
/// prompts of 64–2048 tokens with prefix-cache hits, chunked in a 512-token budget, and
/// outputs of 16–256 tokens.
fn linear_synth() -> Synth {
    Synth {
        requests: 1500,
        concurrency: 16,
        seed: 7,
        step_ms: 5.0,
        per_decode_ms: 0.4,
        per_context_token_ms: 0.0005,
        per_prefill_token_ms: 0.05,
        per_prefill_depth_ms: 0.00002,
        noise: 0.05,
        budget: 512,
        prompt: (64, 2048),
        cached_blocks: 12,
        output: (16, 256),
        think_ms: 30.0,
        ..Synth::default()
    }
}

/// A step of a size (prefilled tokens plus decodes) the engine has not run before costs
/// 3 ms more: varied prompts run many sizes, and the fit finds the cost — not a fixed
/// cost on every prefill step. (Unchunked: a capture reports a chunked prompt's tokens
/// when its prefill completes, so the sizes of chunk steps are not in it.)
#[test]
fn the_cost_of_a_step_size_never_run_before_is_recovered() {
    let s = Synth {
        new_size_ms: 3.0,
        budget: 4096,
        ..linear_synth()
    };
    let (trace, steps) = (tmp("new-size.jsonl.gz"), tmp("new-size-steps.jsonl.gz"));
    s.write(&trace, Some(&steps));
    let model = fit(&[FitInput {
        trace,
        steps: Some(steps),
    }])
    .unwrap();
    assert_recovers(&model, &s, 0.05);
    within("new_shape_ms", model.law.new_shape_ms, 3.0, 0.15);
    assert!(model.law.prefill_step_ms.abs() < 0.5, "{:?}", model.law);
}

/// A step the engine starts after sitting idle for 5 ms or more costs 2 ms more (its
/// worker threads are woken); one it starts sooner does not. A client that thinks 0–12 ms
/// between requests leaves both kinds; the fit finds the cost, and the pacer charges it to
/// the steps the engine says start from idle, and to no other.
#[test]
fn the_wake_up_of_an_idle_engine_is_recovered() {
    let s = Synth {
        idle_wake_ms: 2.0,
        requests: 600,
        concurrency: 1,
        think_ms: 12.0,
        budget: 4096,
        output: (8, 64),
        ..linear_synth()
    };
    let (trace, steps) = (tmp("idle-wake.jsonl.gz"), tmp("idle-wake-steps.jsonl.gz"));
    s.write(&trace, Some(&steps));
    let model = fit(&[FitInput {
        trace,
        steps: Some(steps),
    }])
    .unwrap();
    within("after_idle_ms", model.law.after_idle_ms, 2.0, 0.15);
    let warm = shape(0, &[300]);
    let cold = StepShape {
        after_idle: true,
        ..warm.clone()
    };
    within(
        "a 300-token prefill from idle over one straight after a step",
        model.law_ms(&cold) - model.law_ms(&warm),
        2.0,
        0.15,
    );
}

/// Each request whose prefill completes in a step costs the step 1.5 ms more (its first
/// token sampled), whatever its length: a step that finishes three prompts of 100 tokens
/// costs more than one that finishes one of 300. Unchunked prompts of 64–512 tokens at 8
/// in flight run steps finishing one to several; the fit finds the cost per request, not
/// per step.
#[test]
fn the_cost_of_each_first_token_is_recovered() {
    let s = Synth {
        per_first_token_ms: 1.5,
        requests: 1500,
        concurrency: 8,
        prompt: (64, 512),
        output: (4, 48),
        budget: 4096,
        think_ms: 0.0,
        ..linear_synth()
    };
    let (trace, steps) = (
        tmp("first-token.jsonl.gz"),
        tmp("first-token-steps.jsonl.gz"),
    );
    s.write(&trace, Some(&steps));
    let model = fit(&[FitInput {
        trace,
        steps: Some(steps),
    }])
    .unwrap();
    within("per_first_token_ms", model.law.per_first_token_ms, 1.5, 0.2);
}

fn assert_recovers(model: &FittedModel, s: &Synth, tol: f64) {
    let l = &model.law;

    for (name, got, want) in [
        ("step_ms", l.step_ms, s.step_ms),
        ("per_decode_ms", l.per_decode_ms, s.per_decode_ms),
        (
            "per_context_token_ms",
            l.per_context_token_ms,
            s.per_context_token_ms,
        ),
        (
            "per_prefill_token_ms",
            l.per_prefill_token_ms,
            s.per_prefill_token_ms,
        ),
        (
            "per_prefill_depth_ms",
            l.per_prefill_depth_ms,
            s.per_prefill_depth_ms,
        ),
    ] {
        within(name, got, want, tol);
    }
    // no fixed prefill-step cost in the truth: dropped, or negligible
    assert!(l.prefill_step_ms.abs() < 0.5, "{l:?}");
}

#[test]
fn a_synthetic_linear_capture_is_recovered() {
    let s = linear_synth();
    let (trace, steps) = (tmp("linear.jsonl.gz"), tmp("linear-steps.jsonl.gz"));
    let w = s.write(&trace, Some(&steps));
    assert!(w.steps > 10_000, "{w:?}");
    let model = fit(&[FitInput {
        trace: trace.clone(),
        steps: Some(steps),
    }])
    .unwrap();
    assert_recovers(&model, &s, 0.05);
    // from the records alone: steps that computed only prefill chunks are invisible, the
    // rest is the same
    let model = fit(&[FitInput { trace, steps: None }]).unwrap();
    assert_recovers(&model, &s, 0.05);
}

#[test]
fn multi_token_bursts_replay_jointly_with_their_gaps() {
    // one request at a time, K = 3; a step delivering n tokens costs 3·n ms
    let s = Synth {
        requests: 60,
        concurrency: 1,
        step_ms: 3.0,
        per_decode_ms: 0.0,
        per_burst_token_ms: 3.0,
        per_prefill_token_ms: 0.1,
        noise: 0.02,
        prompt: (32, 32),
        output: (200, 200),
        spec: Some((3, 0.6)),
        ..Synth::default()
    };
    let trace = tmp("spec.jsonl");
    s.write(&trace, None);
    let model = fit(&[FitInput {
        trace: trace.clone(),
        steps: None,
    }])
    .unwrap();
    assert_eq!(model.num_spec_tokens(), Some(3));
    let counts = model.bursts.as_ref().unwrap().counts.clone();
    let total: u64 = counts.iter().sum();
    let mut lat = model.latency(5, 1.0);
    assert_eq!(lat.num_spec_tokens(), Some(3));
    let mut by_n: Vec<Vec<f64>> = vec![Vec::new(); 5];
    for _ in 0..20_000 {
        let t = lat.step(&shape(1, &[]));
        assert_eq!(t.decode_tokens.len(), 1, "one burst per decode");
        let n = t.decode_tokens[0] as usize;
        by_n[n].push(ms(t.duration));
    }
    for n in 1..=4 {
        // each burst comes after its own gap: one gap, not n gaps of a share
        within(
            &format!("{n}-token burst gap"),
            quantile(&by_n[n], 0.5),
            3.0 * n as f64,
            0.05,
        );
        // and as often as captured
        let share = by_n[n].len() as f64 / 20_000.0;
        let captured = counts[n - 1] as f64 / total as f64;
        assert!(
            (share - captured).abs() < 0.02,
            "{n}: {share} vs {captured}"
        );
    }
}

/// Lag-1 correlation of a series.
fn lag1(v: &[f64]) -> f64 {
    let m = v.iter().sum::<f64>() / v.len() as f64;
    let var: f64 = v.iter().map(|x| (x - m) * (x - m)).sum();
    let cov: f64 = v.windows(2).map(|w| (w[0] - m) * (w[1] - m)).sum();
    cov / var
}

/// Consecutive captured steps share their conditions, and so do the model's: the full
/// batch's decode steps, one after another, are as correlated with their neighbours as
/// the captured ones (each draw alone keeps the captured distribution: the test above).
#[test]
fn slow_steps_come_in_runs_as_captured() {
    let model = fixture_model();
    let rho = model.law.residual_autocorrelation;
    let mut lat = model.latency(1, 1.0);
    let sim = lag1(&draws(&mut lat, &shape(8, &[]), 20_000));
    let real = lag1(&captured(8, 0));
    assert!(
        real > 0.2 && (sim - real).abs() < 0.15,
        "lag-1 correlation of decode steps: modelled {sim:.3}, captured {real:.3} (the law's residuals: {rho:.3})"
    );
}

#[test]
fn a_saved_model_loads_and_draws_the_same() {
    let model = fixture_model();
    let path = tmp("model.json");
    model.save(&path).unwrap();
    let size = std::fs::metadata(&path).unwrap().len();
    assert!(size < 8_000, "{size} bytes");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with("{\n  \"format\": \"vllm-vcr-latency-model\",\n  \"version\": 2,"));
    assert!(text.contains("\"config_hash\": \"727153f7"), "{text}");
    let back = FittedModel::load(&path).unwrap();
    assert_eq!(back, model);
    let (mut a, mut b) = (model.latency(3, 1.0), back.clone().latency(3, 1.0));
    for i in 0..200u32 {
        let s = shape(i % 12, &[64 * u64::from(i % 3)]);
        assert_eq!(a.step(&s), b.step(&s));
    }
    // a model file and traces are told apart by their heads
    assert_eq!(sniff(&path).unwrap(), InputKind::Model);
    assert!(FittedModel::is_model_file(&path));
    assert_eq!(sniff(&fixture("trace.jsonl.gz")).unwrap(), InputKind::Trace);
    let plain = tmp("plain-trace.jsonl");
    std::fs::write(
        &plain,
        "{\"meta\":{\"version\":1}}\n{\"prompt_tokens\":3}\n",
    )
    .unwrap();
    assert_eq!(sniff(&plain).unwrap(), InputKind::Trace);
    let one_line = tmp("one-line-model.json");
    std::fs::write(&one_line, serde_json::to_string(&back).unwrap()).unwrap();
    assert_eq!(sniff(&one_line).unwrap(), InputKind::Model);
    assert_eq!(FittedModel::load(&one_line).unwrap(), back);
}

#[test]
fn a_bad_model_file_says_what_is_wrong() {
    let err = |name: &str, text: &str| -> String {
        let p = tmp(name);
        std::fs::write(&p, text).unwrap();
        FittedModel::load(&p).unwrap_err().to_string()
    };
    let e = err(
        "other.json",
        r#"{"format": "something-else", "version": 1}"#,
    );
    assert!(
        e.contains("format \"something-else\" version 1 is not a latency model this build reads")
            && e.contains("inspect fit"),
        "{e}"
    );
    let e = err(
        "old.json",
        r#"{"format": "vllm-vcr-latency-model", "version": 1}"#,
    );
    assert!(e.contains("written by an older vllm-vcr"), "{e}");
    let e = err("plain.json", r#"{"decode": []}"#);
    assert!(e.contains("without a \"format\" field"), "{e}");
    let e = err("garbage.json", "not json");
    assert!(e.contains("not a vllm-vcr latency model file"), "{e}");
    // the right head over broken contents
    let mut v = serde_json::to_value(fixture_model()).unwrap();
    v["levels"] = serde_json::json!([0.0, 0.5, 1.0]);
    let e = err("levels.json", &v.to_string());
    assert!(
        e.contains("invalid latency model") && e.contains("19 ratios for 3 levels"),
        "{e}"
    );
    let e = FittedModel::load(Path::new("/nonexistent/model.json")).unwrap_err();
    assert!(matches!(e, FitError::Io { .. }), "{e}");
}

/// Numbers no engine step could take are refused at load, naming the field (a law of
/// 1e300 ms used to panic the engine at its first step), and a negative floor is called
/// what it is, not "not finite".
#[test]
fn absurd_model_numbers_are_refused_by_name() {
    let err = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| -> String {
        let mut v = serde_json::to_value(fixture_model()).unwrap();
        edit(&mut v);
        let p = tmp(name);
        std::fs::write(&p, v.to_string()).unwrap();
        FittedModel::load(&p).unwrap_err().to_string()
    };
    let e = err("step.json", &|v| v["law"]["step_ms"] = 1e300.into());
    assert!(
        e.contains("law.step_ms is 1e300") && e.contains("a day"),
        "{e}"
    );
    let e = err("floor.json", &|v| v["law"]["floor_ms"] = (-3.0).into());
    assert!(
        e.contains("law.floor_ms is -3: the floor must be between 0"),
        "{e}"
    );
    let e = err("ratio.json", &|v| {
        let r = v["prefill"][0]["ratio"].as_array_mut().unwrap();
        let n = r.len();
        r[n - 1] = 1e300.into();
    });
    assert!(
        e.contains("prefill class") && e.contains("ratio 1e300 is out of range"),
        "{e}"
    );
    // whatever slips through, a step's duration never panics
    let mut m = fixture_model();
    m.law.step_ms = 1e300;
    let mut lat = m.latency(1, 1.0);
    let d = lat.step(&shape(4, &[])).duration;
    assert!(d > Duration::from_secs(1_000_000));
}

#[test]
fn a_sidecar_of_another_capture_is_refused() {
    let (trace, steps) = (tmp("a.jsonl"), tmp("b-steps.jsonl"));
    Synth::default().write(&trace, None);
    Synth {
        seed: 99,
        step_ms: 7.3,
        ..Synth::default()
    }
    .write(&tmp("b.jsonl"), Some(&steps));
    let e = fit(&[FitInput {
        trace,
        steps: Some(steps),
    }])
    .unwrap_err();
    assert!(matches!(e, FitError::Mismatch { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("is not that trace's step-stats sidecar"),
        "{e}"
    );
}

#[test]
fn an_idle_engine_does_not_count_as_prefill_time() {
    // one request at a time with long pauses: every prefill step's step_ms is mostly idle
    let s = Synth {
        requests: 200,
        concurrency: 1,
        step_ms: 4.0,
        per_prefill_token_ms: 0.1,
        noise: 0.02,
        prompt: (100, 400),
        output: (4, 4),
        think_ms: 500.0,
        ..Synth::default()
    };
    let (trace, steps) = (tmp("idle.jsonl"), tmp("idle-steps.jsonl"));
    s.write(&trace, Some(&steps));
    let model = fit(&[FitInput {
        trace,
        steps: Some(steps),
    }])
    .unwrap();
    within(
        "per prefill token",
        model.law.per_prefill_token_ms,
        0.1,
        0.05,
    );
    let e = model.expected_ms(&shape(0, &[300]));
    within("300-token prefill", e, 4.0 + 30.0, 0.05);
}
