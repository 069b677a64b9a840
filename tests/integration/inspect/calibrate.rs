//! `inspect calibrate`, through the binary: the comparison table, the gate and its exit
//! status, `--json`, `--plot`, `--dump-samples`, bad input.

use std::path::{Path, PathBuf};

use crate::support::svg::check_xml;
use crate::support::{
    TestCommand, TestDir, cohort, cpu_capture, fixture, number, process_dir, s, texts, vcr,
};
use serde_json::{Value, json};

fn inspect(sub: &str, args: &[&str]) -> TestCommand {
    let mut c = vcr();
    c.args(["inspect", sub]).args(args);
    c
}

fn calibrate(args: &[&str]) -> TestCommand {
    inspect("calibrate", args)
}

/// Exit status 1 (out of tolerance, or bad input): what the process printed.
fn exit_1(mut cmd: TestCommand) -> (String, String) {
    let out = cmd.output();
    let (o, e) = texts(&out);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}\nstdout:\n{o}\nstderr:\n{e}",
        cmd.describe()
    );
    (o, e)
}

/// The model `inspect fit` makes of the committed capture (with its sidecar), once per
/// test process.
fn fixture_model() -> PathBuf {
    static MODEL: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    MODEL
        .get_or_init(|| {
            let model = process_dir("inspect-calibrate").join("fixture-model.json");
            inspect(
                "fit",
                &[
                    s(&cpu_capture("trace.jsonl.gz")),
                    "--steps",
                    s(&cpu_capture("steps.jsonl.gz")),
                    "-o",
                    s(&model),
                ],
            )
            .run();
            model
        })
        .clone()
}

/// The fixture calibrated against its own model, with the captured engine's
/// `max_num_seqs` (block size 128 comes from the trace).
fn fixture_args(model: &Path, extra: &[&str]) -> Vec<String> {
    let mut a = vec![
        s(&cpu_capture("trace.jsonl.gz")).to_string(),
        "--latency-trace".into(),
        s(model).to_string(),
        "--max-num-seqs".into(),
        "128".into(),
    ];
    a.extend(extra.iter().map(|x| x.to_string()));
    a
}

fn calibrate_fixture(extra: &[&str]) -> TestCommand {
    let model = fixture_model();
    let a = fixture_args(&model, extra);
    calibrate(&a.iter().map(String::as_str).collect::<Vec<_>>())
}

#[test]
fn in_sample_on_the_cpu_engine_capture() {
    // A loose gate passes. What it has to allow: the capture is closed loop (the load
    // generator kept 8 requests in flight) and the replay open loop (the recorded
    // arrivals, whatever the engine does), so more prefills land between the decodes of
    // a batch than they did, and the modelled ITL tail is far above the captured one —
    // ITL p99 +268 % pooled and +1,800 % in the 5-8 cohort at this seed. That is what
    // calibrate is for; the loose gate here only checks the exit status.
    let (out, err) = texts(&calibrate_fixture(&["--tolerance", "p50=50,p90=100,p99=5000"]).run());
    assert!(
        out.starts_with("calibrate: ") && out.contains("(301 records, 301 with captured timing, 301 compared; arrivals at their recorded offsets)"),
        "{out}"
    );
    assert!(out.contains("— in-sample: the model"), "{out}");
    assert!(out.contains("was fitted to this trace"), "{out}");
    assert!(out.contains("latency fitted (step 8.817"), "{out}");
    assert!(out.contains("knobs: --time-to-first-token "), "{out}");
    assert!(out.contains("the records' `concurrency`"), "{out}");
    for header in ["TTFT (ms)", "ITL (ms)", "request total (ms)"] {
        assert!(out.contains(header), "{header}: {out}");
    }
    // the pooled row and the cohorts with their counts; a cohort of 2 is not gated
    for row in [
        "all    n=301 ",
        "c=1    n=2 *",
        "c=2    n=38 ",
        "c=3-4  n=76 ",
        "c=5-8  n=185 ",
        "all    n=301 (18903 gaps)",
    ] {
        assert!(out.contains(row), "{row:?} in:\n{out}");
    }
    assert!(
        out.contains("result: pass (36 gated cells within tolerance)"),
        "{out}"
    );
    assert!(!err.contains("error"), "{err}");

    let loose = ["--json", "--tolerance", "p50=50,p90=100,p99=5000"];
    let v: Value = serde_json::from_str(&texts(&calibrate_fixture(&loose).run()).0).unwrap();
    assert_eq!(v["pass"], true);
    let all = cohort(&v, "all");
    let d = |m: &str, q: &str| number(&all[m]["modelled_delta_pct"][q]);
    // Observed over seeds 0–7: TTFT p50 +2.0 … +5.3 %, ITL p50 +0.2 … +0.9 %; the open
    // loop lets requests overlap a little more than they did.
    assert!(d("ttft_ms", "p50").abs() < 8.0, "{}", all["ttft_ms"]);
    assert!(d("itl_ms", "p50").abs() < 3.0, "{}", all["itl_ms"]);
    // the capture's own numbers: exact nearest-rank quantiles
    assert_eq!(number(&all["ttft_ms"]["captured"]["p50"]), 336.669);
    assert_eq!(all["ttft_ms"]["samples"]["captured"], 301);
    assert_eq!(all["itl_ms"]["samples"]["captured"], 18903);
    // the knobs match the medians by construction; their spread runs out in the tail
    let k = |m: &str, q: &str| number(&all[m]["knobs_delta_pct"][q]);
    assert!(k("ttft_ms", "p50").abs() < 1.0, "{}", all["ttft_ms"]);
    assert!(k("itl_ms", "p50").abs() < 1.0, "{}", all["itl_ms"]);
    assert!(k("ttft_ms", "p99") < -15.0, "{}", all["ttft_ms"]);
    assert_eq!(cohort(&v, "1")["gated"], false);
    assert_eq!(cohort(&v, "5-8")["gated"], true);
    assert_eq!(cohort(&v, "5-8")["requests"], 185);

    // the default gate (2 / 2 / 5 %) fails; a strict one fails every cell, and says which
    let (out, err) = exit_1(calibrate_fixture(&["--tolerance", "0.01"]));
    assert!(
        out.contains("result: FAIL — 36 of 36 gated cells out of tolerance"),
        "{out}"
    );
    assert!(
        out.contains("+0.9 !"),
        "the failing cells are marked:\n{out}"
    );
    assert!(
        err.contains("error: 36 of 36 gated cells out of tolerance: TTFT p50 all +0.9 % (339.6 vs captured 336.7, tolerance 0.01 %)"),
        "{err}"
    );
    assert!(err.contains("and 30 more"), "{err}");
    exit_1(calibrate_fixture(&[]));
}

/// A trace of `n` requests of 64 prompt / 32 output tokens (distinct prompts, blocks of
/// 16), Poisson arrivals at `rate` per second from a fixed generator.
fn hand_trace(tmp: &TestDir, name: &str, n: usize, rate: f64, seed: u64) -> PathBuf {
    let mut x = seed;
    let mut uniform = || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let mut t = 0.0;
    let mut text = json!({"meta": {"block_size": 16}}).to_string() + "\n";
    for i in 0..n as u64 {
        t += -uniform().ln() / rate * 1000.0;
        let hashes: Vec<u64> = (1..=4).map(|b| seed * 1_000_000 + i * 10 + b).collect();
        let r = json!({"prompt_tokens": 64, "output_tokens": 32,
                       "arrival_ms": (t * 1000.0).round() / 1000.0, "block_hashes": hashes});
        text += &(r.to_string() + "\n");
    }
    let path = tmp.path(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// A synthetic capture: `trace` simulated with knobs, dumped as a trace.
fn synthetic_capture(tmp: &TestDir, trace: &Path, name: &str, knobs: &[&str]) -> PathBuf {
    let dump = tmp.path(name);
    let mut a = vec![s(trace), "--dump-trace", s(&dump)];
    a.extend_from_slice(knobs);
    inspect("simulate", &a).run();
    dump
}

fn fit(tmp: &TestDir, traces: &[&Path], name: &str) -> PathBuf {
    let model = tmp.path(name);
    let mut a: Vec<&str> = traces.iter().map(|t| s(t)).collect();
    a.extend(["-o", s(&model)]);
    inspect("fit", &a).run();
    model
}

#[test]
fn a_synthetic_capture_made_with_known_knobs() {
    let tmp = TestDir::new("a_synthetic_capture_made_with_known_knobs");
    // 400 requests at 10/s, each 50 ms to the first token then 10 ms a token: about 7 in
    // flight, cohorts 1 to 17-32
    let knobs = ["--time-to-first-token", "50", "--inter-token-latency", "10"];
    let trace = hand_trace(&tmp, "hand.jsonl", 400, 10.0, 7);
    let capture = synthetic_capture(&tmp, &trace, "synthetic.jsonl", &knobs);
    let model = fit(&tmp, &[&capture], "synthetic-model.json");
    let out = calibrate(&[s(&capture), "--latency-trace", s(&model), "--json"]).output();
    // the pooled cells pass; some cohort cells of ~100 requests miss 2 % (the model
    // draws a prefill step's cost from its captured spread, 50 ms alone or 60 ms beside
    // decodes, where the knobs were exact): the exit status is not the point here
    let v: Value = serde_json::from_str(&texts(&out).0).unwrap();
    assert_eq!(v["fit_set"]["relation"], "in-sample", "{}", v["fit_set"]);
    assert_eq!(v["compared"], 400);
    let all = cohort(&v, "all");
    // Observed: TTFT and ITL within 0.3 % at every quantile, request total within 1.6 %
    // at p50 / p90 and +3.4 % at p99 (the 4th largest of 400): the issue's gate, 2 % at
    // p50 / p90 and 5 % at p99, holds for every pooled cell.
    for m in ["ttft_ms", "itl_ms", "request_total_ms"] {
        for (q, tol) in [("p50", 2.0), ("p90", 2.0), ("p99", 5.0)] {
            let d = number(&all[m]["modelled_delta_pct"][q]);
            assert!(d.abs() < tol, "{m} {q}: {d:+.2} % in {}", all[m]);
        }
        assert!(all[m]["out_of_tolerance"].as_array().unwrap().is_empty());
    }
    for q in ["p50", "p90", "p99"] {
        let d = number(&all["ttft_ms"]["modelled_delta_pct"][q]);
        assert!(d.abs() < 1.0, "ttft {q}: {d:+.2} %");
    }
    // the knob row gives back the knobs the capture was made with (observed 49.5 ms with
    // a spread of 2.1, and 10 / 0: the TTFT median is matched to the captured p50, which
    // includes the wait for the step in flight, within 1 %)
    let k = &v["knobs"];
    assert!(
        (number(&k["time_to_first_token"]) - 50.0).abs() < 2.0,
        "{k}"
    );
    assert!(
        (number(&k["inter_token_latency"]) - 10.0).abs() < 0.2,
        "{k}"
    );
    assert!(number(&k["time_to_first_token_std_dev"]) < 3.0, "{k}");
    assert!(number(&k["inter_token_latency_std_dev"]) < 0.5, "{k}");
    let cohorts: Vec<&str> = v["cohorts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["cohort"].as_str().unwrap())
        .collect();
    assert!(
        cohorts.starts_with(&["all", "1", "2", "3-4", "5-8"]),
        "{cohorts:?}"
    );

    // against a model fitted to another workload of the same engine: counterfactual
    let other = synthetic_capture(
        &tmp,
        &hand_trace(&tmp, "hand-2.jsonl", 300, 8.0, 11),
        "synthetic-2.jsonl",
        &knobs,
    );
    let model_2 = fit(&tmp, &[&other], "synthetic-model-2.json");
    let out = calibrate(&[s(&capture), "--latency-trace", s(&model_2)]).output();
    let (o, _) = texts(&out);
    assert!(
        o.contains("— counterfactual: the trace is not in the fit set"),
        "{o}"
    );
    // a fit set of traces (fitted now) that includes the calibrated one is in-sample
    let out = calibrate(&[
        s(&capture),
        "--latency-trace",
        s(&other),
        s(&capture),
        "--json",
    ])
    .output();
    let v: Value = serde_json::from_str(&texts(&out).0).unwrap();
    assert_eq!(v["fit_set"]["in_sample"], true, "{}", v["fit_set"]);
}

/// The table's rows as (metric, cohort, quantile) → the six printed cells.
fn table(out: &str) -> Vec<(String, String, String, Vec<String>)> {
    let mut rows = Vec::new();
    let (mut metric, mut cohort) = (String::new(), String::new());
    for line in out.lines() {
        if line.contains(" captured ") && line.contains(" modelled ") {
            metric = line.split(" (ms)").next().unwrap().to_string();
            continue;
        }
        if line.trim().is_empty() {
            // a table ends with a blank line
            metric.clear();
        }
        if metric.is_empty() {
            continue;
        }
        let toks: Vec<&str> = line.split_whitespace().collect();
        let Some(qi) = toks.iter().position(|t| ["p50", "p90", "p99"].contains(t)) else {
            continue;
        };
        if qi > 0 {
            cohort = toks[0].trim_start_matches("c=").to_string();
        }
        let cells: Vec<String> = toks[qi + 1..]
            .iter()
            .filter(|t| **t != "!")
            .map(|t| t.to_string())
            .collect();
        rows.push((metric.clone(), cohort.clone(), toks[qi].to_string(), cells));
    }
    rows
}

fn num(v: &Value) -> String {
    let x = number(v);
    if x.abs() >= 100.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

#[test]
fn json_has_the_numbers_of_the_table() {
    let (out, _) = exit_1(calibrate_fixture(&[]));
    let (js, _) = exit_1(calibrate_fixture(&["--json"]));
    let v: Value = serde_json::from_str(&js).unwrap();
    assert_eq!(v["records"], 301);
    assert_eq!(v["pass"], false);
    assert_eq!(
        v["tolerance_pct"],
        json!({"p50": 2.0, "p90": 2.0, "p99": 5.0})
    );
    assert_eq!(v["min_requests"], 30);
    assert_eq!(v["fit_set"]["in_sample"], true);
    assert!(
        v["knobs"]["flags"]
            .as_str()
            .unwrap()
            .starts_with("--time-to-first-token ")
    );
    let rows = table(&out);
    assert_eq!(rows.len(), 3 * 5 * 3, "{rows:?}");
    let key = |m: &str| match m {
        "TTFT" => "ttft_ms",
        "ITL" => "itl_ms",
        _ => "request_total_ms",
    };
    for (metric, co, q, cells) in &rows {
        let c = &cohort(&v, co)[key(metric)];
        let delta = |x: &Value| format!("{:+.1}", number(x));
        let want = [
            num(&c["captured"][q]),
            num(&c["modelled"][q]),
            delta(&c["modelled_delta_pct"][q]),
            num(&c["knobs"][q]),
            delta(&c["knobs_delta_pct"][q]),
        ];
        assert_eq!(cells, &want, "{metric} {co} {q}");
    }
    // every cell the table marks is a failure in the JSON, and no other
    let marked = out
        .lines()
        .filter(|l| l.contains(" ! ") && !l.starts_with('*'))
        .count();
    assert_eq!(v["failures"].as_array().unwrap().len(), marked);
    // failures come in the table's order: the pooled TTFT's first failing quantile first
    let f0 = &v["failures"][0];
    let first = &cohort(&v, "all")["ttft_ms"]["out_of_tolerance"][0];
    assert!(first.is_string(), "{}", cohort(&v, "all")["ttft_ms"]);
    assert_eq!(
        (
            f0["metric"].as_str(),
            f0["cohort"].as_str(),
            f0["quantile"].as_str()
        ),
        (Some("ttft_ms"), Some("all"), first.as_str())
    );
}

#[test]
fn plot_writes_svg_figures_of_every_gated_cohort() {
    let tmp = TestDir::new("plot_writes_svg_figures_of_every_gated_cohort");
    let dir = tmp.path("plots");
    let _ = std::fs::remove_dir_all(&dir);
    let (out, _) = exit_1(calibrate_fixture(&["--plot", s(&dir)]));
    assert!(
        out.contains(&format!("plots: 16 SVG files in {}", dir.display())),
        "{out}"
    );
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut want = Vec::new();
    for metric in ["itl", "ttft"] {
        for kind in ["qq", "survival"] {
            // the cohort of 2 requests is not gated: no figure
            for co in ["all", "c2", "c3-4", "c5-8"] {
                want.push(format!("{metric}-{kind}-{co}.svg"));
            }
        }
    }
    want.sort();
    assert_eq!(names, want);
    for name in &names {
        let svg = check_xml(&dir.join(name));
        if name.contains("survival") {
            // a curve per source, with the legend's own
            assert!(svg.matches("<polyline").count() >= 3, "{name}");
        } else {
            assert!(svg.matches("<circle").count() > 50, "{name}");
        }
        assert!(
            svg.contains("trace.jsonl.gz"),
            "{name}: the title names the trace"
        );
        assert!(svg.contains("captured") && svg.contains("modelled") && svg.contains("knobs"));
    }
    let all = std::fs::read_to_string(dir.join("ttft-survival-all.svg")).unwrap();
    assert!(all.contains("TTFT survival — trace.jsonl.gz, all requests (n = 301)"));
    assert!(all.contains("fraction of samples ≥ x (log scale)"));

    // a capture with multi-token chunks (speculative decoding) also gets its chunk sizes
    let trace = hand_trace(&tmp, "spec.jsonl", 120, 10.0, 3);
    let capture = synthetic_capture(
        &tmp,
        &trace,
        "spec-capture.jsonl",
        &[
            "--time-to-first-token",
            "50",
            "--inter-token-latency",
            "10",
            "--num-speculative-tokens",
            "2",
        ],
    );
    let model = fit(&tmp, &[&capture], "spec-model.json");
    let dir = tmp.path("spec-plots");
    // the gate does not matter here: plots are written either way
    let out = calibrate(&[s(&capture), "--latency-trace", s(&model), "--plot", s(&dir)]).output();
    let (o, e) = texts(&out);
    assert!(matches!(out.status.code(), Some(0 | 1)), "{o}\n{e}");
    let svg = check_xml(&dir.join("chunk-sizes.svg"));
    assert!(
        svg.matches("<rect").count() >= 6,
        "bars of sizes 1–3, twice"
    );
    assert!(svg.contains("output chunk sizes — spec-capture.jsonl"));
}

#[test]
fn dump_samples_writes_one_row_per_request() {
    let tmp = TestDir::new("dump_samples_writes_one_row_per_request");
    let path = tmp.path("samples.jsonl");
    exit_1(calibrate_fixture(&["--dump-samples", s(&path)]));
    let text = std::fs::read_to_string(&path).unwrap();
    let rows: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 301);
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["index"], i, "arrival order");
        assert_eq!(r["compared"], true);
        for src in ["captured", "modelled", "knobs"] {
            let x = &r[src];
            let gaps: f64 = x["itl_ms"].as_array().unwrap().iter().map(number).sum();
            assert!(
                (number(&x["ttft_ms"]) + gaps - number(&x["total_ms"])).abs() < 1e-6,
                "{r}"
            );
        }
    }
    // the first arrival is the warm-up request, alone
    assert_eq!(rows[0]["concurrency"], 1);
    assert_eq!(rows[0]["cohort"], "1");
    assert_eq!(rows[0]["captured"]["itl_ms"].as_array().unwrap().len(), 3);
    assert!(rows.iter().all(|r| r["request_id"].is_string()));

    let csv = tmp.path("samples.csv");
    exit_1(calibrate_fixture(&["--dump-samples", s(&csv)]));
    let text = std::fs::read_to_string(&csv).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 302, "a header and a row per request");
    assert!(lines[0].starts_with("index,request_id,arrival_ms,concurrency,cohort,compared,captured_ttft_ms,modelled_ttft_ms,knobs_ttft_ms,"));
    assert_eq!(lines[1].split(',').count(), lines[0].split(',').count());
    // the same numbers as the JSON lines
    let first: Vec<&str> = lines[1].split(',').collect();
    assert_eq!(
        first[6].parse::<f64>().unwrap(),
        number(&rows[0]["captured"]["ttft_ms"])
    );
}

#[test]
fn bad_input_is_refused_with_a_clear_error() {
    let tmp = TestDir::new("bad_input_is_refused_with_a_clear_error");
    let model = fixture_model();
    let (_, e) = exit_1(calibrate(&[
        "/nonexistent/trace.jsonl",
        "--latency-trace",
        s(&model),
    ]));
    assert!(e.contains("/nonexistent/trace.jsonl"), "{e}");

    // the model under test is required
    let (_, e) = exit_1(calibrate(&[s(&cpu_capture("trace.jsonl.gz"))]));
    assert!(e.contains("pass --latency-trace MODEL"), "{e}");

    // a JSON file of another format
    let not_model = tmp.path("not-a-model.json");
    std::fs::write(
        &not_model,
        "{\"format\": \"something-else\", \"version\": 3}\n",
    )
    .unwrap();
    let (_, e) = exit_1(calibrate(&[
        s(&cpu_capture("trace.jsonl.gz")),
        "--latency-trace",
        s(&not_model),
    ]));
    assert!(e.contains("is not a latency model this build reads"), "{e}");
    // a file that is neither a model nor a trace
    let junk = tmp.path("junk.txt");
    std::fs::write(&junk, "hello\n").unwrap();
    let (_, e) = exit_1(calibrate(&[
        s(&cpu_capture("trace.jsonl.gz")),
        "--latency-trace",
        s(&junk),
    ]));
    assert!(e.contains("junk.txt:1: invalid trace line"), "{e}");

    // a converted Mooncake trace has arrivals and lengths, no timing
    let mooncake = tmp.path("mooncake.jsonl");
    inspect(
        "convert",
        &[
            "--from",
            "mooncake",
            s(&fixture("tests/fixtures/mooncake/sample.jsonl")),
            "-o",
            s(&mooncake),
        ],
    )
    .run();
    let (_, e) = exit_1(calibrate(&[s(&mooncake), "--latency-trace", s(&model)]));
    assert!(
        e.contains("no complete record has captured timing (ttft_ms)"),
        "{e}"
    );
    assert!(e.contains("Mooncake"), "{e}");

    // timing without arrivals (a converted client report without them)
    let untimed = tmp.path("no-arrivals.jsonl");
    std::fs::write(
        &untimed,
        "{\"meta\":{\"block_size\":16}}\n{\"prompt_tokens\":8,\"output_tokens\":2,\"ttft_ms\":5,\"itl_ms\":[1]}\n",
    )
    .unwrap();
    let (_, e) = exit_1(calibrate(&[s(&untimed), "--latency-trace", s(&model)]));
    assert!(e.contains("no record has an arrival_ms"), "{e}");

    let trace = cpu_capture("trace.jsonl.gz");
    for (flag, msg) in [
        ("--tolerance=p95=3", "the quantiles are p50, p90 and p99"),
        ("--tolerance=-2", "not a percentage"),
    ] {
        let out = calibrate(&[s(&trace), "--latency-trace", s(&model), flag]).output();
        let (_, e) = texts(&out);
        assert!(!out.status.success() && e.contains(msg), "{flag}: {e}");
    }
    let (_, e) = exit_1(calibrate(&[
        s(&trace),
        "--latency-trace",
        s(&model),
        "--dump-samples",
        s(&trace),
    ]));
    assert!(e.contains("is the same file as the trace"), "{e}");
    // knobs and a model do not mix, as in `play`
    let (_, e) = exit_1(calibrate(&[
        s(&trace),
        "--latency-trace",
        s(&model),
        "--inter-token-latency",
        "5",
    ]));
    assert!(
        e.contains("does not combine with --inter-token-latency"),
        "{e}"
    );
}

#[test]
fn help_explains_every_flag() {
    let (help, _) = texts(&calibrate(&["--help"]).run());
    for flag in [
        "--latency-trace",
        "--replay-arrivals",
        "--replay-sessions",
        "--cold-prompts",
        "--tolerance",
        "--min-requests",
        "--json",
        "--dump-samples",
        "--plot",
        "--max-num-seqs",
        "Exit status",
    ] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }
    let cli = <vllm_vcr::cli::Cli as clap::CommandFactory>::command();
    let cal = cli
        .find_subcommand("inspect")
        .and_then(|i| i.find_subcommand("calibrate"))
        .unwrap();
    for arg in cal.get_arguments() {
        let id = arg.get_id().as_str();
        assert!(
            id == "help" || arg.get_help().is_some_and(|h| h.to_string().len() > 10),
            "inspect calibrate --{id} has no help text"
        );
    }
}

/// The modelled Δ % of a pooled cell: `metric` (`ttft_ms`, `itl_ms`,
/// `request_total_ms`), quantile index 0/1/2 (p50/p90/p99).
fn pooled_delta(v: &Value, metric: &str, q: usize) -> f64 {
    number(&cohort(v, "all")[metric]["modelled_delta_pct"][["p50", "p90", "p99"][q]])
}

#[test]
fn closed_loop_replay_of_the_cpu_engine_capture_at_its_concurrency() {
    let json = |extra: &[&str]| -> Value {
        let mut a = vec!["--json", "--tolerance", "5000"];
        a.extend_from_slice(extra);
        let (out, _) = texts(&calibrate_fixture(&a).run());
        serde_json::from_str(&out).unwrap()
    };
    // open loop: the medians are close, the ITL tail is not (+268 % at this seed)
    let open = json(&[]);
    assert_eq!(open["arrivals"], "recorded");
    assert!(
        pooled_delta(&open, "itl_ms", 2) > 100.0,
        "{}",
        open["cohorts"]
    );
    assert!(pooled_delta(&open, "ttft_ms", 0).abs() < 5.0);

    // closed loop at the load generator's 8 (what `auto` infers): the first 8 sent
    // together, the engine queueing what arrives during a step when the step ends (as
    // vLLM's engine-core does), so the engine falls into the capture's rhythm — one
    // request prefilled alone, the other seven in the next step — and TTFT and the whole
    // ITL distribution follow the capture (TTFT −0.2 / −3.4 / −7.1 %, ITL −0.2 / −0.2 /
    // −0.3 %, request total +0.4 / −5.1 / −10.1 % at this seed)
    let closed = json(&["--replay-concurrency", "auto"]);
    assert_eq!(closed["arrivals"], "concurrency");
    assert_eq!(closed["replay_concurrency"], 8);
    for (metric, q, within) in [
        ("ttft_ms", 0, 2.0),
        ("ttft_ms", 1, 5.0),
        ("ttft_ms", 2, 10.0),
        ("itl_ms", 0, 2.0),
        ("itl_ms", 1, 2.0),
        ("itl_ms", 2, 3.0),
        ("request_total_ms", 0, 2.0),
        ("request_total_ms", 1, 7.0),
        ("request_total_ms", 2, 12.0),
    ] {
        let d = pooled_delta(&closed, metric, q);
        assert!(
            d.abs() < within,
            "{metric} [{q}] {d} %: {}",
            closed["cohorts"]
        );
    }
    assert!(
        pooled_delta(&closed, "request_total_ms", 1).abs()
            < pooled_delta(&open, "request_total_ms", 1).abs() / 4.0
    );

    // the header says how the requests arrived
    let out = calibrate_fixture(&["--replay-concurrency", "8", "--tolerance", "1000"]).run();
    let (out, err) = texts(&out);
    assert!(
        out.contains(
            "301 compared; closed loop, 8 in flight, each next request when one finishes)"
        ),
        "{out}"
    );
    assert!(
        err.contains("note: the capture's scheduler settings"),
        "{err}"
    );
    // over sessions, the cap counts sessions (every request of this capture is one)
    let out = calibrate_fixture(&[
        "--replay-concurrency",
        "8",
        "--replay-sessions",
        "--tolerance",
        "1000",
    ])
    .run();
    let (out, _) = texts(&out);
    assert!(
        out.contains("closed loop over sessions, 8 in flight, each next session when one finishes"),
        "{out}"
    );
}

/// A model fitted on another configuration (its captures' config_hash differs from the
/// trace's) is called out in the `fit set:` line and in JSON; a run with too few requests
/// to have quantiles ends with a message saying that, not with a pooled FAIL.
#[test]
fn another_configuration_and_too_few_requests_are_said_plainly() {
    let tmp = TestDir::new("another_configuration_and_too_few_requests_are_said_plainly");
    // the capture, stamped as another configuration's
    let other = tmp.path("other-config.jsonl");
    crate::support::copy_with_config_hash(
        &cpu_capture("trace.jsonl.gz"),
        &other,
        "0123456789abcdef",
    );
    let model = fixture_model();
    let base = ["--latency-trace", s(&model), "--max-num-seqs", "128"];

    let mut args = vec![
        s(&other),
        "--requests",
        "40",
        "--tolerance",
        "1000",
        "--json",
    ];
    args.extend(base);
    args.extend(["--min-requests", "10"]);
    let (out, err) = texts(&calibrate(&args).run());
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v["fit_set"]["other_configuration"], true,
        "{}",
        v["fit_set"]
    );
    assert_eq!(v["fit_set"]["config_hashes"]["trace"], "0123456789abcdef");
    assert!(
        v["fit_set"]["config_hashes"]["fit"][0]
            .as_str()
            .unwrap()
            .starts_with("727153f7"),
        "{}",
        v["fit_set"]
    );
    assert!(
        err.contains("WARNING: the model was fitted on another configuration"),
        "{err}"
    );

    let mut args = vec![s(&other), "--requests", "1"];
    args.extend(base);
    let (out, err) = exit_1(calibrate(&args));
    let fit_line = out.lines().find(|l| l.starts_with("fit set:")).unwrap();
    assert!(
        fit_line.contains(
            "WARNING: the model was fitted on another configuration (config_hash 727153f7"
        ),
        "{fit_line}"
    );
    assert!(
        err.contains("only 1 request(s) compared, fewer than --min-requests 30")
            && !err.contains("out of tolerance"),
        "{err}"
    );
}

/// The calibrate examples of docs/inspect.md are what the binary prints: the in-sample
/// run's whole output block (the `wall:` time aside, which is the machine's; its count of
/// simulations is checked), the knob TTFT, the knob row's figures quoted in the prose,
/// and the synthetic run's knob line. The docs' figures used to drift from the binary.
#[test]
fn the_documented_calibrate_examples_are_what_the_binary_prints() {
    let tmp = TestDir::new("the_documented_calibrate_examples_are_what_the_binary_prints");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/inspect.md")).unwrap();
    // the commands as written, from a directory where the fixture's relative path holds
    let dir = tmp.path("doc-example");
    std::fs::create_dir_all(&dir).unwrap();
    let _ = std::os::unix::fs::symlink(root.join("tests"), dir.join("tests"));
    let in_dir = |args: &[&str]| {
        let mut c = vcr();
        c.current_dir(&dir).args(args);
        c
    };
    let trace = "tests/fixtures/cpu-engine-capture/trace.jsonl.gz";
    in_dir(&[
        "inspect",
        "fit",
        trace,
        "--steps",
        "tests/fixtures/cpu-engine-capture/steps.jsonl.gz",
        "-o",
        "model.json",
    ])
    .run();
    let (out, _) = exit_1(in_dir(&[
        "inspect",
        "calibrate",
        trace,
        "--latency-trace",
        "model.json",
        "--plot",
        "figures",
        "--dump-samples",
        "samples.jsonl",
    ]));
    let first = out.lines().next().unwrap();
    let start = doc
        .find(first)
        .expect("the first line of the run in docs/inspect.md");
    let block: Vec<&str> = doc[start..].lines().take_while(|l| *l != "```").collect();
    let printed: Vec<&str> = out.lines().collect();
    assert_eq!(
        block.len(),
        printed.len(),
        "docs:\n{}\nrun:\n{out}",
        block.join("\n")
    );
    for (d, p) in block.iter().zip(&printed) {
        if let (Some(d), Some(p)) = (d.strip_prefix("wall: "), p.strip_prefix("wall: ")) {
            let sims = |l: &str| l.split_once('(').map(|(_, r)| r.to_string());
            assert_eq!(sims(d), sims(p), "wall line: docs {d} run {p}");
            assert!(doc.contains(&format!(
                "({} on the fixture",
                sims(p).unwrap().split(' ').next().unwrap()
            )));
            continue;
        }
        assert_eq!(d, p, "docs/inspect.md and the run differ");
    }
    // the prose on the knob row quotes the knob TTFT and the row's pooled p99 and c=1 p50
    let knob_ttft = out
        .split("--time-to-first-token ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap();
    assert!(
        doc.contains(&format!("or seven ({knob_ttft} ms")),
        "{knob_ttft}"
    );
    let ttft_rows: Vec<&str> = out.lines().skip_while(|l| !l.starts_with("TTFT")).collect();
    let last = |l: &str| l.split_whitespace().last().unwrap().replace('-', "−");
    assert!(doc.contains(&format!("TTFT p99 is {} %", last(ttft_rows[3]))));
    assert!(doc.contains(&format!("lone requests {} %", last(ttft_rows[4]))));

    // the synthetic example: the knob row gives back what made the capture
    in_dir(&[
        "inspect",
        "simulate",
        trace,
        "--time-to-first-token",
        "50",
        "--inter-token-latency",
        "10",
        "--dump-trace",
        "synthetic.jsonl.gz",
    ])
    .run();
    in_dir(&[
        "inspect",
        "fit",
        "synthetic.jsonl.gz",
        "-o",
        "synthetic-model.json",
    ])
    .run();
    let (out, _) = texts(
        &in_dir(&[
            "inspect",
            "calibrate",
            "synthetic.jsonl.gz",
            "--latency-trace",
            "synthetic-model.json",
        ])
        .run(),
    );
    let ttft = out
        .split("--time-to-first-token ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap();
    assert!(
        doc.contains(&format!(
            "`--time-to-first-token {ttft} … --inter-token-latency 10`"
        )),
        "{ttft}"
    );
    assert!(
        doc.contains(&format!("gives back {ttft} ± 0 / 10 ± 0")),
        "{ttft}"
    );
}

#[test]
fn the_step_check_and_the_host_speed_judge_the_model_on_the_captured_steps() {
    let tmp =
        TestDir::new("the_step_check_and_the_host_speed_judge_the_model_on_the_captured_steps");
    let (trace, steps) = (cpu_capture("trace.jsonl.gz"), cpu_capture("steps.jsonl.gz"));
    let model = tmp.path("steps-model.json");
    inspect("fit", &[s(&trace), "--steps", s(&steps), "-o", s(&model)]).run();
    // in sample: the capture ran at the model's speed, and every class of its steps is
    // reproduced at the median
    let (out, _) = texts(
        &calibrate(&[
            s(&trace),
            "--latency-trace",
            s(&model),
            "--steps",
            s(&steps),
            "--json",
            // the gate's verdict on this capture is calibrate's own business (docs: 24 of
            // 36 cells out with recorded arrivals); this test reads the step check
            "--tolerance",
            "100000",
        ])
        .run(),
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    let speed = v["host_speed"]["factor"].as_f64().unwrap();
    assert!((0.97..=1.03).contains(&speed), "{}", v["host_speed"]);
    assert_eq!(v["host_speed"]["applied"], false);
    let classes = v["steps"]["classes"].as_array().unwrap();
    let decode = classes
        .iter()
        .find(|c| c["class"] == "decode-only")
        .expect("a decode-only class");
    assert!(decode["steps"].as_u64().unwrap() > 1000, "{decode}");
    let p50 = decode["delta_pct"][1].as_f64().unwrap();
    assert!(p50.abs() < 5.0, "decode-only p50 {p50:+.1} %");
    assert!(classes.iter().any(|c| c["class"] == "mixed"), "{classes:?}");

    // the same capture judged against a model 25 % too fast: the host speed says so, and
    // --match-host-speed brings the simulated TTFT and ITL back to the capture's
    let fast = tmp.path("steps-model-fast.json");
    let mut m: Value = serde_json::from_str(&std::fs::read_to_string(&model).unwrap()).unwrap();
    for k in [
        "step_ms",
        "per_decode_ms",
        "per_prefill_token_ms",
        "floor_ms",
    ] {
        let x = m["law"][k].as_f64().unwrap();
        m["law"][k] = json!(x * 0.8);
    }
    std::fs::write(&fast, serde_json::to_string(&m).unwrap()).unwrap();
    let pooled = |args: &[&str]| -> (f64, [f64; 2]) {
        let (out, _) = texts(&calibrate(args).output());
        let v: Value = serde_json::from_str(&out).unwrap();
        let all = crate::support::pooled_cohort(&v).clone();
        (
            v["host_speed"]["factor"].as_f64().unwrap(),
            [
                all["ttft_ms"]["modelled_delta_pct"]["p50"]
                    .as_f64()
                    .unwrap(),
                all["itl_ms"]["modelled_delta_pct"]["p50"].as_f64().unwrap(),
            ],
        )
    };
    let base = [
        s(&trace),
        "--latency-trace",
        s(&fast),
        "--steps",
        s(&steps),
        "--json",
    ];
    let (speed, raw) = pooled(&base);
    assert!((1.2..=1.3).contains(&speed), "host speed {speed}");
    assert!(
        raw[1] < -15.0,
        "a 20 % faster law gives a faster ITL: {raw:?}"
    );
    let mut matched = base.to_vec();
    matched.push("--match-host-speed");
    let (_, fixed) = pooled(&matched);
    assert!(fixed[0].abs() < 5.0 && fixed[1].abs() < 5.0, "{fixed:?}");
}
