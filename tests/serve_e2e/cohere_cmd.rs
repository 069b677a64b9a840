//! vllm-rs 0.33's `cohere_cmd` reasoning parser on what a Cohere Command model writes
//! (the engine's `cohere_command3`): it splits the thinking off at `<|END_THINKING|>` and
//! hands the rest to `content` as it is, the answer's `<|START_RESPONSE|>` included, and
//! with the markers as special tokens the detokenizer drops them before it reads the
//! text. What `docs/tool-formats.md` says it cannot parse, pinned: a vllm-rs that reads
//! the model's answer marker changes these answers.

use serde_json::{Value, json};

use super::*;

const COHERE_MARKERS: &[&str] = &[
    "<|START_THINKING|>",
    "<|END_THINKING|>",
    "<|START_RESPONSE|>",
    "<|END_RESPONSE|>",
];

/// An 80-token chat answer thinking half of it, through `cohere_cmd`, the markers
/// `special` or not in the model's tokenizer; `skip` is the request's
/// `skip_special_tokens` for each answer asked. The answers' messages and usage.
fn answers(special: bool, skip: &[bool]) -> Vec<(Value, Value)> {
    let dir = TestDir::new(if special {
        "cohere-special"
    } else {
        "cohere-plain"
    });
    super::parsers::model_with_markers(&dir, COHERE_MARKERS);
    if special {
        let path = dir.path("tokenizer.json");
        let text = std::fs::read_to_string(&path).unwrap();
        let mut t: Value = serde_json::from_str(&text).unwrap();
        for token in t["added_tokens"].as_array_mut().unwrap() {
            if COHERE_MARKERS.contains(&token["content"].as_str().unwrap_or("")) {
                token["special"] = true.into();
            }
        }
        std::fs::write(&path, t.to_string()).unwrap();
    }
    let model = dir.root().to_str().unwrap();
    let mut serve = Serve::start(&[
        "--model",
        model,
        "--reasoning-format",
        "cohere_command3",
        "--reasoning-share",
        "0.5",
        "--",
        "--reasoning-parser",
        "cohere_cmd",
    ]);
    serve.wait_ready();
    // serve names the model after its directory
    let name = dir.root().file_name().unwrap().to_str().unwrap();
    skip.iter()
        .map(|&skip| {
            let body = json!({"model": name, "max_tokens": 80, "skip_special_tokens": skip,
                "messages": [{"role": "user", "content": "Hello"}]});
            let (status, answer) = http_post_json(serve.port, "/v1/chat/completions", &body);
            assert_eq!(status, 200, "{answer}");
            let message = answer["choices"][0]["message"].clone();
            (message, answer["usage"].clone())
        })
        .collect()
}

#[test]
fn vllm_rs_cohere_cmd_leaves_the_answer_marker_or_reads_no_markers() {
    let content = |m: &Value| m["content"].as_str().unwrap_or("").to_string();
    let reasoning = |m: &Value| super::parsers::reasoning_of(m).to_string();
    let thinking = |u: &Value| u["completion_tokens_details"]["reasoning_tokens"].clone();
    // ordinary tokens: the thinking is split off, the answer keeps its marker
    for (m, usage) in answers(false, &[true]) {
        assert!(reasoning(&m).len() > 20, "{m}");
        assert!(!reasoning(&m).contains("<|"), "{m}");
        assert!(content(&m).starts_with("<|START_RESPONSE|>"), "{m}");
        assert!(thinking(&usage).as_u64().unwrap_or(0) > 20, "{usage}");
    }
    let special = answers(true, &[true, false]);
    // special tokens, skipped by default: no markers left to split at
    let (m, usage) = &special[0];
    assert_eq!(reasoning(m), "", "{m}");
    assert!(content(m).len() > 60 && !content(m).contains("<|"), "{m}");
    assert_eq!(thinking(usage), 0, "{usage}");
    // kept (`skip_special_tokens: false`): as with ordinary tokens
    let (m, _) = &special[1];
    assert!(reasoning(m).len() > 20, "{m}");
    assert!(content(m).starts_with("<|START_RESPONSE|>"), "{m}");
}
