//! `inspect fit`, through the binary, on the real CPU-engine capture.

use std::path::Path;

use crate::support::{TestCommand, TestDir, cpu_capture, s, texts};
use serde_json::Value;
use sim_trace::fit::FittedModel;

fn fit(args: &[&str]) -> TestCommand {
    crate::support::inspect("fit", args)
}

#[test]
fn fits_the_capture_and_saves_a_loadable_model() {
    let tmp = TestDir::new("fits_the_capture_and_saves_a_loadable_model");
    let (trace, steps) = (cpu_capture("trace.jsonl.gz"), cpu_capture("steps.jsonl.gz"));
    let model = tmp.path("model.json");
    let (_, err) = texts(&fit(&[s(&trace), "--steps", s(&steps), "-o", s(&model)]).run());
    assert!(
        err.contains("fitted 301 records → 2474 observations (2476 sidecar steps)"),
        "{err}"
    );
    assert!(err.contains("decode batches: 4 (62 steps"), "{err}");
    assert!(
        err.contains("dropped per_prefill_depth_ms: not identifiable"),
        "{err}"
    );
    // the file is what the library loads, small and readable
    let m = FittedModel::load(&model).unwrap();
    assert_eq!(m.meta.sources.len(), 1);
    let src = &m.meta.sources[0];
    assert_eq!(src.records, 301);
    assert_eq!(src.block_size, Some(128));
    assert_eq!(src.steps.as_deref(), Some(s(&steps)));
    assert!(src.config_hash.as_deref().unwrap().starts_with("727153f7"));
    let text = std::fs::read_to_string(&model).unwrap();
    assert!(text.len() < 10_000 && text.lines().count() < 150, "{text}");
    assert!(FittedModel::is_model_file(&model));

    // --json: the same fit, summarised on stdout
    let (out, _) = texts(
        &fit(&[
            s(&trace),
            "--steps",
            s(&steps),
            "-o",
            s(&tmp.path("model2.json")),
            "--json",
        ])
        .run(),
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["records"], 301);
    assert_eq!(v["observations"], 2474);
    assert_eq!(v["sidecar_steps"], 2476);
    assert_eq!(v["num_spec_tokens"], Value::Null);
    let p = v["law"]["per_prefill_token_ms"].as_f64().unwrap();
    assert!((0.3..0.45).contains(&p), "{p}");
    let bins: Vec<&Value> = v["decode"].as_array().unwrap().iter().collect();
    assert!(
        bins.iter()
            .any(|b| b["decodes"] == serde_json::json!([8, 8]))
    );
    assert!(v["bytes"].as_u64().unwrap() > 1000);

    // -o -: the model itself on stdout
    let (out, _) = texts(&fit(&[s(&trace), "--steps", s(&steps), "-o", "-"]).run());
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["format"], "vllm-vcr-latency-model");
    assert_eq!(v["version"], 2);
}

#[test]
fn a_sidecar_beside_the_trace_is_not_used_unless_given() {
    let tmp = TestDir::new("a_sidecar_beside_the_trace_is_not_used_unless_given");
    let model = tmp.path("records-only.json");
    let (_, err) = texts(&fit(&[s(&cpu_capture("trace.jsonl.gz")), "-o", s(&model)]).run());
    assert!(
        err.contains("is fitted from its records alone")
            && err.contains("steps.jsonl.gz is not used"),
        "{err}"
    );
    let m = FittedModel::load(&model).unwrap();
    assert_eq!(m.meta.sources[0].steps, None);
    assert_eq!(m.meta.sources[0].sidecar_steps, 0);
}

#[test]
fn one_steps_flag_takes_a_sidecar_for_each_trace() {
    let tmp = TestDir::new("one_steps_flag_takes_a_sidecar_for_each_trace");
    let (trace, steps) = (cpu_capture("trace.jsonl.gz"), cpu_capture("steps.jsonl.gz"));
    let model = tmp.path("two.json");
    let (trace, steps) = (s(&trace), s(&steps));
    fit(&[trace, trace, "--steps", steps, steps, "-o", s(&model)]).run();
    let m = FittedModel::load(&model).unwrap();
    assert_eq!(
        m.meta.sources.len(),
        2,
        "two captures, no sidecar read as a trace"
    );
    for src in &m.meta.sources {
        assert_eq!(src.steps.as_deref(), Some(steps));
        assert_eq!(src.sidecar_steps, 2476);
    }
}

#[test]
fn bad_invocations_say_what_is_wrong() {
    let tmp = TestDir::new("bad_invocations_say_what_is_wrong");
    let trace = cpu_capture("trace.jsonl.gz");
    let steps = cpu_capture("steps.jsonl.gz");
    let out = s(&tmp.path("never.json")).to_string();
    let e = fit(&[
        s(&trace),
        "--steps",
        s(&steps),
        "--steps",
        s(&steps),
        "-o",
        &out,
    ])
    .run_failing();
    assert!(e.contains("2 sidecars for 1 traces"), "{e}");
    let e = fit(&[s(&trace), "-o", "-", "--json"]).run_failing();
    assert!(e.contains("pick one"), "{e}");
    let e = fit(&["/nonexistent/trace.jsonl", "-o", &out]).run_failing();
    assert!(e.contains("/nonexistent/trace.jsonl"), "{e}");
    // a model is not a trace
    let model = tmp.path("m.json");
    fit(&[s(&trace), "-o", s(&model)]).run();
    let e = fit(&[s(&model), "-o", &out]).run_failing();
    assert!(e.contains("is a latency model file, not a trace"), "{e}");
    // a sidecar is not a trace (`--steps a b` once read `b` as a second trace)
    let e = fit(&[s(&trace), s(&steps), "-o", &out]).run_failing();
    assert!(
        e.contains("is a step-stats sidecar, not a trace: give it after --steps"),
        "{e}"
    );
    // a sidecar of another capture
    let other = tmp.path("other-steps.jsonl");
    let lines: String = (0..200)
        .map(|i| {
            format!(
                "{{\"ts_ms\":{},\"step_ms\":7.0,\"num_running_reqs\":8}}\n",
                3.3 + 7.0 * f64::from(i)
            )
        })
        .collect();
    std::fs::write(&other, lines).unwrap();
    let e = fit(&[s(&trace), "--steps", s(&other), "-o", &out]).run_failing();
    assert!(e.contains("is not that trace's step-stats sidecar"), "{e}");
    assert!(!Path::new(&out).exists(), "nothing written on failure");
}

/// One absurd gap in a capture without a timeline pulled the law (a 0.5 s step where the
/// engine's are 13 ms) with no word; the fit now warns, in the report and on stderr under
/// `--json`. A gap past a day is refused, naming the record and field.
#[test]
fn an_outlier_gap_is_warned_about_and_an_absurd_one_refused() {
    let tmp = TestDir::new("an_outlier_gap_is_warned_about_and_an_absurd_one_refused");
    use sim_trace::trace::{TraceItem, TraceReader, TraceWriter};
    let write = |name: &str, gap: f64| {
        let path = tmp.path(name);
        let mut w = TraceWriter::create_without_meta(&path).unwrap();
        let mut edited = false;
        for item in TraceReader::open(cpu_capture("trace.jsonl.gz")).unwrap() {
            match item.unwrap() {
                TraceItem::Meta(m) => w.write_meta(&m).unwrap(),
                TraceItem::Record(mut r) => {
                    // gaps without a timeline: each is a decode step of its own
                    r.arrival_ms = None;
                    r.ttft_ms = None;
                    if !edited && r.itl_ms.len() > 3 {
                        r.itl_ms[2] = gap;
                        edited = true;
                    }
                    w.write_record(&r).unwrap();
                }
            }
        }
        w.finish().unwrap();
        path
    };
    let outlier = write("outlier.jsonl", 1e7);
    let model = tmp.path("outlier-model.json");
    let (_, err) = texts(&fit(&[outlier.to_str().unwrap(), "-o", model.to_str().unwrap()]).run());
    assert!(
        err.contains("WARNING: 1 observation(s) last more than 1000× the median step")
            && err.contains("the largest 10000000 ms"),
        "{err}"
    );
    let (out, err) = texts(
        &fit(&[
            outlier.to_str().unwrap(),
            "-o",
            model.to_str().unwrap(),
            "--json",
        ])
        .run(),
    );
    assert!(err.contains("WARNING"), "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(v["law"]["notes"].to_string().contains("WARNING"), "{v}");

    let absurd = write("absurd.jsonl", 1e20);
    let err = fit(&[absurd.to_str().unwrap(), "-o", model.to_str().unwrap()]).run_failing();
    assert!(
        err.contains("itl_ms[2] = 1e20 ms") && err.contains("a day"),
        "{err}"
    );
}
