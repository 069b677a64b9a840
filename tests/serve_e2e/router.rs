//! `serve --engine-count N --route …`: the router in front of the frontend picks each
//! request's engine (the `X-data-parallel-rank` header) and the frontend's per-engine
//! counters (`engine="0"`, `engine="1"`) show where each request ran.

use std::time::Duration;

use serde_json::{Value, json};

use super::*;
use crate::support::http::{http_client, metric_sum, parse_metrics};

/// The frontend's counter `name` for engine `rank`.
fn per_engine(port: u16, name: &str, rank: &str) -> f64 {
    metric_sum(
        &parse_metrics(&http_get(port, "/metrics").text()),
        name,
        &[("engine", rank)],
    )
    .unwrap_or(0.0)
}

/// A completion of `prompt`, `max_tokens` 3: its prompt token count.
fn complete(port: u16, prompt: &str) -> f64 {
    let (status, answer) = http_post_json(
        port,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": prompt, "max_tokens": 3}),
    );
    assert_eq!(status, 200, "{answer}");
    answer["usage"]["prompt_tokens"].as_f64().unwrap()
}

#[test]
fn round_robin_sends_every_other_request_to_each_engine() {
    let mut serve = Serve::start(&["--engine-count", "2", "--route", "round-robin"]);
    serve.wait_ready();
    for i in 0..6 {
        complete(serve.port, &format!("request {i}"));
    }
    for rank in ["0", "1"] {
        assert_eq!(
            per_engine(serve.port, "vllm:request_success_total", rank),
            3.0,
            "engine {rank}\n{}",
            serve.stderr()
        );
    }
}

#[test]
fn prefix_aware_keeps_each_shared_prefix_on_one_engine_through_vllm_rs() {
    prefix_aware_keeps_each_shared_prefix_on_one_engine(&[]);
}

#[test]
fn prefix_aware_keeps_each_shared_prefix_on_one_engine_through_the_python_frontend() {
    prefix_aware_keeps_each_shared_prefix_on_one_engine(
        &PythonFrontend::of("vllm", "0.33.0").args(),
    );
}

/// Requests with one of two long shared prefixes, the first of each overlapping: each
/// prefix's prompts all run on the engine its first went to (the frontend's own balancing
/// would send the later ones, one at a time, wherever its load says).
fn prefix_aware_keeps_each_shared_prefix_on_one_engine(frontend: &[&str]) {
    let mut args = vec![
        "--engine-count",
        "2",
        "--route",
        "prefix-aware",
        "--inter-token-latency",
        "5",
    ];
    args.extend_from_slice(frontend);
    let mut serve = Serve::start(&args);
    serve.wait_ready();
    let port = serve.port;
    // two system prompts of 20 routing blocks each
    let a = "You are a careful assistant for the airline. ".repeat(30);
    let b = "Tu es un assistant prudent pour la banque. ".repeat(30);
    // the first A is in flight (streaming) when the first B arrives: no engine was sent B
    // before, so it goes to the idle engine
    let client = http_client(port, Duration::from_secs(60));
    let mut first_a = client
        .post_sse(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": format!("{a} question 0"), "max_tokens": 100,
                    "stream": true, "stream_options": {"include_usage": true}}),
        )
        .unwrap();
    assert!(first_a.next_data().unwrap().is_some(), "no first chunk");
    let mut b_tokens = complete(port, &format!("{b} question 0"));
    let mut a_tokens = 0.0;
    while let Some(data) = first_a.next_data().unwrap() {
        if let Ok(v) = serde_json::from_str::<Value>(&data)
            && let Some(n) = v["usage"]["prompt_tokens"].as_f64()
        {
            a_tokens = n;
        }
    }
    assert!(a_tokens > 0.0, "the stream carried no usage");
    // then each prefix follows the engine it went to, whichever is busier
    for i in 1..4 {
        a_tokens += complete(port, &format!("{a} question {i}"));
        b_tokens += complete(port, &format!("{b} question {i}"));
    }
    let tokens = |rank| per_engine(port, "vllm:prompt_tokens_total", rank);
    assert_eq!(
        (tokens("0"), tokens("1")),
        (a_tokens, b_tokens),
        "every A prompt on engine 0 and every B prompt on engine 1\n{}",
        serve.stderr()
    );
}

#[test]
fn route_without_several_engines_is_refused_before_anything_starts() {
    let err = vcr()
        .args([
            "serve",
            "--route",
            "least-loaded",
            "--port",
            &free_port().to_string(),
        ])
        .run_failing();
    assert!(err.contains("--engine-count"), "{err}");
}
