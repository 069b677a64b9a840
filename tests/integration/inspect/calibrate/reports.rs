//! What calibrate writes besides its table: `--json` with the table's numbers, `--plot` SVG
//! figures of every gated cohort, `--dump-samples` one row per request.

use super::*;

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
