//! `inspect compare`, through the binary: the quantiles and Δ % a user reads, `--json`,
//! `--plot`, TTFT per session turn, and bad input.

use crate::support::svg::check_xml;
use crate::support::{TestCommand, TestDir, cohort, corpus, fixture, vcr};
use serde_json::Value;
use std::io::Read;

/// `name`'s trace in the conformance corpus.
fn capture(name: &str) -> String {
    corpus(&format!("{name}.trace.jsonl.gz"))
}

fn compare(args: &[&str]) -> TestCommand {
    crate::support::inspect("compare", args)
}

fn json(args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.push("--json");
    let out = compare(&a).run();
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The TTFTs and gaps of a trace's complete records, read here (not by the binary).
fn latencies(path: &str) -> (Vec<f64>, Vec<f64>) {
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap())
        .read_to_string(&mut text)
        .unwrap();
    let (mut ttft, mut itl) = (Vec::new(), Vec::new());
    for line in text.lines().skip(1) {
        let r: Value = serde_json::from_str(line).unwrap();
        if r["incomplete"] == true {
            continue;
        }
        if let Some(t) = r["ttft_ms"].as_f64() {
            ttft.push(t);
            itl.extend(
                r["itl_ms"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap()),
            );
        }
    }
    (ttft, itl)
}

/// The nearest-rank quantile.
fn nearest_rank(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

#[test]
fn a_trace_against_itself_is_zero_and_against_its_repeat_is_the_engines_noise() {
    let a = capture("concurrency-8-s0");
    let b = capture("concurrency-8-s0-repeat");
    let same = json(&[&a, &a]);
    for c in same["cohorts"].as_array().unwrap() {
        for m in ["ttft_ms", "itl_ms", "request_total_ms"] {
            assert!(c["traces"][0][m]["delta_pct"].is_null(), "the reference");
            for q in ["p50", "p90", "p99"] {
                assert_eq!(c["traces"][1][m]["delta_pct"][q], 0.0, "{c}");
            }
        }
    }

    let v = json(&[&a, &b, "--label", "seed 0", "--label", "again"]);
    assert_eq!(v["reference"], "seed 0");
    assert_eq!(v["traces"][1]["label"], "again");
    assert_eq!(v["traces"][0]["records"], 321);
    let all = cohort(&v, "all");
    let (ta, ia) = latencies(&a);
    let (tb, ib) = latencies(&b);
    for (q, level) in [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)] {
        let (x, y) = (nearest_rank(&ta, level), nearest_rank(&tb, level));
        assert_eq!(all["traces"][0]["ttft_ms"]["quantiles"][q], x);
        assert_eq!(all["traces"][1]["ttft_ms"]["quantiles"][q], y);
        let d = all["traces"][1]["ttft_ms"]["delta_pct"][q]
            .as_f64()
            .unwrap();
        assert!((d - (y - x) / x * 100.0).abs() < 1e-9, "{d}");
        let (x, y) = (nearest_rank(&ia, level), nearest_rank(&ib, level));
        assert_eq!(all["traces"][1]["itl_ms"]["quantiles"][q], y);
        let d = all["traces"][1]["itl_ms"]["delta_pct"][q].as_f64().unwrap();
        assert!((d - (y - x) / x * 100.0).abs() < 1e-9, "{d}");
    }
    assert_eq!(all["traces"][0]["itl_ms"]["samples"], ia.len());
    // the repeat ran a little faster: every median below the first run's
    for m in ["ttft_ms", "itl_ms", "request_total_ms"] {
        assert!(all["traces"][1][m]["delta_pct"]["p50"].as_f64().unwrap() < 0.0);
    }
    // two requests ran alone: a cohort too small to read, marked
    assert_eq!(cohort(&v, "1")["traces"][0]["small"], true);
    assert_eq!(cohort(&v, "5-8")["traces"][0]["small"], false);

    // the table says the same
    let out = compare(&[&a, &b, "--label", "seed 0", "--label", "again"]).output();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with("compare: 2 traces; Δ % against the first"),
        "{text}"
    );
    let d50 = all["traces"][1]["ttft_ms"]["delta_pct"]["p50"]
        .as_f64()
        .unwrap();
    let row = text
        .lines()
        .skip_while(|l| !l.starts_with("TTFT"))
        .find(|l| l.trim_start().starts_with("again"))
        .unwrap();
    assert!(row.contains(&format!("{d50:+.1}")), "{row}");
    let c1 = text.lines().find(|l| l.starts_with("c=1")).unwrap();
    assert!(
        c1.split_whitespace().collect::<Vec<_>>()[1..4] == ["seed", "0", "2*"],
        "{c1}"
    );
}

#[test]
fn plot_draws_every_trace_and_session_turns() {
    let tmp = TestDir::new("plot_draws_every_trace_and_session_turns");
    let dir = tmp.path("plots");
    let on = capture("sessions-s1");
    let off = capture("sessions-no-prefix-cache-s1");
    let v = json(&[
        &on,
        &off,
        "--label",
        "prefix caching",
        "--label",
        "no prefix caching",
        "--plot",
        dir.to_str().unwrap(),
    ]);
    // turns 1..4 of the conversations; without prefix caching every turn's TTFT is longer
    let turns = v["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 2);
    let p50 = |t: &Value| -> Vec<f64> {
        t["ttft_ms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["p50"].as_f64().unwrap())
            .collect()
    };
    let (a, b) = (p50(&turns[0]), p50(&turns[1]));
    assert_eq!(a.len(), 4, "{turns:?}");
    assert_eq!(b.len(), 4, "{turns:?}");
    assert!(a.iter().zip(&b).all(|(x, y)| y > x), "{a:?} {b:?}");
    // with caching, later turns reuse their history and stay within ~2.5× of the first
    assert!(a[3] < 2.5 * a[0], "{a:?}");

    let plots: Vec<String> = v["plots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect();
    for name in [
        "ttft-survival-all.svg",
        "ttft-qq-all.svg",
        "itl-survival-all.svg",
        "itl-qq-all.svg",
        "ttft-per-turn.svg",
    ] {
        let p = dir.join(name);
        assert!(
            plots.contains(&p.display().to_string()),
            "{name}: {plots:?}"
        );
        let svg = check_xml(&p);
        if name.contains("survival") || name.contains("turn") {
            assert!(svg.contains("prefix caching"), "{name}");
            assert!(svg.contains("no prefix caching"), "{name}");
        }
    }
}

#[test]
fn bad_input_is_refused_with_a_clear_error() {
    let tmp = TestDir::new("bad_input_is_refused_with_a_clear_error");
    let a = capture("concurrency-8-s0");
    let e = compare(&[&a]).run_failing();
    assert!(e.contains("TRACE"), "{e}");
    let e = compare(&[&a, "/nonexistent/trace.jsonl"]).run_failing();
    assert!(e.contains("/nonexistent/trace.jsonl"), "{e}");
    // a converted Mooncake trace has arrivals and lengths but no latencies
    let mooncake = tmp.path("mooncake.jsonl");
    vcr()
        .args(["inspect", "convert", "--from", "mooncake"])
        .arg(fixture("tests/fixtures/mooncake/sample.jsonl"))
        .arg("-o")
        .arg(&mooncake)
        .run();
    let e = compare(&[&a, mooncake.to_str().unwrap()]).run_failing();
    assert!(e.contains("no complete record has timing"), "{e}");
    let e = compare(&[&a, &a, "--label", "x", "--label", "y", "--label", "z"]).run_failing();
    assert!(e.contains("3 --label for 2 traces"), "{e}");
    // a capture that ended before any request: said so, not "no records to simulate"
    let meta_only = tmp.path("meta-only.jsonl");
    std::fs::write(
        &meta_only,
        "{\"meta\": {\"version\": 1, \"block_size\": 16}}\n",
    )
    .unwrap();
    let e = compare(&[&a, meta_only.to_str().unwrap()]).run_failing();
    assert!(
        e.contains("holds no request records, only its meta line") && !e.contains("simulate"),
        "{e}"
    );
    let _ = std::fs::remove_file(&mooncake);
}
