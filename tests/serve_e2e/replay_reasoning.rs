//! A reasoning model's capture replayed with generated text (`--replay-steps`): each
//! request thinks for its record's `reasoning_tokens`, not the global `--reasoning-share`,
//! as the client reads it from the frontend's reasoning parser.

use serde_json::json;

use super::*;
use crate::support::http_client;

/// Two records of 80 output tokens, one that thought for 30 of them and one for 60
/// (between the tags), timed 1 ms a token so the replay is quick.
fn write_trace(path: &std::path::Path) {
    let record = |id: &str, arrival: f64, thinking: u32| {
        json!({"request_id": id, "prompt_tokens": 9, "output_tokens": 80,
            "arrival_ms": arrival, "ttft_ms": 1.0, "itl_ms": vec![1.0; 79],
            "reasoning_tokens": thinking, "finish_reason": "length"})
    };
    let lines = [
        json!({"meta": {"block_size": 16}}),
        record("cap-a", 0.0, 30),
        record("cap-b", 5.0, 60),
    ];
    let text: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    std::fs::write(path, text.join("\n") + "\n").unwrap();
}

/// Through the Python frontend's `qwen3` parser, with the embedded model (one token a
/// byte): the client reads the recorded counts as `reasoning_tokens`, and as many bytes
/// of `reasoning` (its newlines inside the tags among them); the answer is the rest of the
/// 80 after the block's other 17 (`<think>`, `</think>` and the blank line after it). The
/// share (0.25 by default) would have given both 20 tokens of block.
#[test]
fn a_replayed_capture_thinks_as_long_as_each_request_did() {
    let tmp = TestDir::new("serve-replay-reasoning");
    let trace = tmp.path("thinking.jsonl");
    write_trace(&trace);
    let trace_arg = trace.display().to_string();
    let python = PythonFrontend::of("vllm", "0.33.0");
    let flags = ["--replay-steps", &trace_arg, "--reasoning-format", "qwen3"];
    let mut serve = Serve::start(&python.with(&flags));
    serve.wait_ready();
    let client = http_client(serve.port, Duration::from_secs(60));
    for (i, thinking) in [(0, 30), (1, 60)] {
        let body = json!({"model": "tiny", "max_tokens": 100,
            "messages": [{"role": "user", "content": "Think first."}]});
        let id = format!("replay-{i}");
        let r = client
            .request_with(
                "POST",
                "/v1/chat/completions",
                Some(&body),
                &[("X-Request-Id", &id)],
            )
            .unwrap();
        let answer = r.json().unwrap();
        assert_eq!(r.status, 200, "{id}: {answer}");
        let usage = &answer["usage"];
        assert_eq!(usage["completion_tokens"], 80, "{id}: {answer}");
        let details = &usage["completion_tokens_details"];
        assert_eq!(details["reasoning_tokens"], thinking, "{id}: {answer}");
        let message = &answer["choices"][0]["message"];
        let reasoning = super::parsers::reasoning_of(message);
        assert_eq!(
            reasoning.trim_matches('\n').len(),
            thinking - 2,
            "{id}: {answer}"
        );
        let content = message["content"].as_str().unwrap_or("");
        assert!(!content.contains("think>"), "{id}: {answer}");
        let rest = content.trim_start_matches('\n').len();
        assert_eq!(rest, 80 - (thinking + 17), "{id}: {answer}");
    }
}
