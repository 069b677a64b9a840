//! Benchmark clients against `serve`: long contexts reach the frontend, a Mooncake trace of
//! long prompts replays through `vllm-rs bench serve` with no failures, and the calibration
//! suite runs against a frontend.

use super::*;

#[test]
fn max_model_len_reaches_the_frontend_for_long_contexts() {
    // a Mooncake-style long prompt: 20,000 tokens under --max-model-len 131072 (the
    // embedded model used to cap every context at 2,048)
    // (and `--` passes the rest to the frontend: here a served name of its own)
    let mut serve = Serve::start(&[
        "--max-model-len",
        "131072",
        "--",
        "--served-model-name",
        "long",
    ]);
    let (_, frontend_pid) = serve.wait_ready();
    let long: Vec<String> = (0..20_000).map(|i| (3 + i % 200).to_string()).collect();
    let (status, body) = post(
        serve.port,
        "/v1/completions",
        &format!(
            r#"{{"model":"long","prompt":[{}],"max_tokens":4}}"#,
            long.join(",")
        ),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 20_000);
    assert_eq!(body["usage"]["completion_tokens"], 4);
    // and past it, the frontend's own refusal
    let (status, body) = post(
        serve.port,
        "/v1/completions",
        &format!(
            r#"{{"model":"long","prompt":[{}],"max_tokens":4}}"#,
            vec!["5"; 131_072].join(",")
        ),
    );
    assert_eq!(status, 400, "{body}");
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}

/// `GET /v1/models` of the frontend on `port`: the served model, its directory (`root`,
/// the tokenizer a benchmark loads) and its `max_model_len`.
fn served_models(port: u16) -> serde_json::Value {
    http_get(port, "/v1/models").json().unwrap()
}

#[test]
fn a_mooncake_trace_of_long_prompts_replays_through_bench_serve_with_no_failures() {
    // what a user does with a public Mooncake trace: `vllm-rs bench serve --dataset-name
    // timed_trace` against `serve --max-model-len 131072`, prompts of 20k–60k tokens fired at
    // their timestamps (this used to fail most requests with "maximum context length is 2048")
    let tmp = TestDir::new("serve-mooncake");
    let dir = tmp.root();
    let trace = dir.join("mooncake.jsonl");
    let (mut lines, mut input_tokens, mut output_tokens) = (String::new(), 0u64, 0u64);
    let (mut t_ms, mut seed) = (0u64, 0x9e37_79b9_7f4a_7c15u64);
    let mut next = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    const REQUESTS: u64 = 30;
    for i in 0..REQUESTS {
        t_ms += 50 + next(200);
        let input = 20_000 + next(40_001);
        let output = 10 + next(100);
        let hash_ids: Vec<String> = (0..input.div_ceil(512))
            .map(|b| (i * 1000 + b).to_string())
            .collect();
        lines.push_str(&format!(
            "{{\"timestamp\": {t_ms}, \"input_length\": {input}, \"output_length\": {output}, \"hash_ids\": [{}]}}\n",
            hash_ids.join(", ")
        ));
        input_tokens += input;
        output_tokens += output;
    }
    std::fs::write(&trace, lines).unwrap();

    let mut serve = Serve::start(&["--max-model-len", "131072"]);
    let (_, frontend_pid) = serve.wait_ready();
    let base = format!("http://127.0.0.1:{}", serve.port);
    // the model directory `serve` generated: the benchmark tokenizes with it
    let models = served_models(serve.port);
    let model_dir = models["data"][0]["root"].as_str().unwrap().to_string();
    assert_eq!(models["data"][0]["max_model_len"], 131_072);

    let out = Command::new(vllm_rs("0.33.0"))
        .args(["bench", "serve", "--base-url", &base, "--model", "tiny"])
        .args(["--tokenizer", &model_dir])
        .args(["--dataset-name", "timed_trace", "--dataset-path"])
        .arg(&trace)
        .args(["--timed-trace-chunk-hash-size", "512"])
        .args(["--timed-trace-sec-multiplier", "0.001"])
        .args(["--num-prompts", &REQUESTS.to_string()])
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout).to_string();
    let field = |name: &str| -> u64 {
        report
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| {
                panic!(
                    "no {name:?} in the benchmark's report:\n{report}\n{}",
                    String::from_utf8_lossy(&out.stderr)
                )
            })
    };
    assert!(out.status.success(), "bench serve failed:\n{report}");
    assert_eq!(field("Failed requests:"), 0, "{report}");
    assert_eq!(field("Successful requests:"), REQUESTS, "{report}");
    assert_eq!(field("Total input tokens:"), input_tokens, "{report}");
    // the server's own count beside the benchmark's: one CI run under load saw the
    // benchmark report 2,229 generated tokens for 2,320 with every request successful
    // (not reproduced since, quiet or beside three busy loops); this says on which side
    // the tokens went missing if it happens again
    let served = super::load_generators::Served::read(serve.port);
    assert_eq!(
        served.output as u64, output_tokens,
        "the server's vllm:generation_tokens_total\n{report}"
    );
    assert_eq!(
        field("Total generated tokens:"),
        output_tokens,
        "the benchmark's count (the server counted {} output tokens)\n{report}",
        served.output
    );
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}

/// `inspect suite` drives the calibration suite's three loads, under each of its two
/// seeds, through a real frontend (`serve`, vllm-rs 0.33's `bench serve`): each command is
/// printed before it runs, every request succeeds, and the shared-prefix load shows as prefix-cache hits in the
/// frontend's metrics.
#[test]
fn the_calibration_suite_runs_against_a_frontend() {
    let mut serve = Serve::start(&["--max-model-len", "2048"]);
    let (_, frontend_pid) = serve.wait_ready();
    let base = format!("http://127.0.0.1:{}", serve.port);
    let model_dir = served_models(serve.port)["data"][0]["root"]
        .as_str()
        .unwrap()
        .to_string();
    let out = vcr()
        .args(["inspect", "suite", "--base-url", &base, "--model", "tiny"])
        .args(["--tokenizer", &model_dir])
        .arg("--bench-bin")
        .arg(vllm_rs("0.33.0"))
        .env("NO_COLOR", "1")
        .output();
    let report = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seeds = sim_trace::loads::SUITE_SEEDS;
    for seed in seeds {
        for name in sim_trace::loads::CALIBRATION_SUITE {
            let w = sim_trace::loads::workload(name).unwrap();
            let args = w.bench_args(w.requests, seed, std::path::Path::new("/unused"));
            let seed_arg = format!("--seed {seed}");
            let line = report
                .lines()
                .find(|l| {
                    l.contains(" bench serve ")
                        && l.contains(&args[3])
                        && l.contains(&args[5])
                        && l.contains(&seed_arg)
                })
                .unwrap_or_else(|| panic!("no command for {name} seed {seed}:\n{report}"));
            assert!(line.contains(&format!("--base-url {base}")), "{line}");
        }
    }
    let succeeded: Vec<u64> = report
        .lines()
        .filter_map(|l| l.strip_prefix("Successful requests:"))
        .map(|v| v.trim().parse().unwrap())
        .collect();
    let wanted: Vec<u64> = seeds
        .iter()
        .flat_map(|_| sim_trace::loads::CALIBRATION_SUITE)
        .map(|n| u64::from(sim_trace::loads::workload(n).unwrap().requests))
        .collect();
    assert_eq!(succeeded, wanted, "{report}");
    let failed: Vec<&str> = report
        .lines()
        .filter_map(|l| l.strip_prefix("Failed requests:"))
        .map(str::trim)
        .collect();
    assert_eq!(failed, vec!["0"; wanted.len()], "{report}");
    let text = http_get(serve.port, "/metrics").text();
    let hits: f64 = text
        .lines()
        .find(|l| l.starts_with("vllm:prefix_cache_hits_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(hits > 10_000.0, "prefix-cache hits {hits}");
    assert_ctrl_c_stops_everything(&mut serve, frontend_pid);
}
