//! The `hf` and `beam` parsers, which read answers with the model's `response_template`
//! (the embedded model ships one that describes the engine's `hf`/`beam` text): served
//! behind vllm-rs (`hf`) and the Python 0.33 frontend (`hf`, and `beam`, whose parser
//! derives the grammar of `required` and named calls from the template). And vllm-rs's
//! `kimi` thinking, the one other parser name of vllm-rs 0.33 the engine writes.

use serde_json::{Value, json};

use super::parsers::{
    assert_parsed_calls, assert_required_thinks, assert_thinking_parsed, chat_with_tools,
    model_with_markers, reasoning_of, tools,
};
use super::*;

/// `serve` writing `format` calls and thinking, the frontend started with that parser for
/// both kinds (`python`: the Python 0.33 frontend, else vllm-rs).
fn serve_template_format(format: &str, python: bool) -> Serve {
    let frontend = PythonFrontend::of("vllm", "0.33.0");
    let flags = [
        "--tool-call-rate",
        "1",
        "--tool-call-format",
        format,
        "--reasoning-format",
        format,
        "--reasoning-share",
        "0.5",
    ];
    let mut serve = Serve::start(&if python {
        frontend.with(&flags)
    } else {
        flags.to_vec()
    });
    serve.wait_ready();
    serve
}

/// A chat answer that must call `get_time` (a named tool choice): the message, or the
/// status and error.
fn chat_naming_get_time(port: u16) -> (u16, Value) {
    let body = json!({"model": "tiny", "max_tokens": 800, "tools": tools(),
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "messages": [{"role": "user", "content": "Time in Paris?"}]});
    let (status, answer) = http_post_json(port, "/v1/chat/completions", &body);
    (status, answer["choices"][0]["message"].clone())
}

/// vllm-rs's `hf` parser reads the embedded model's template: calls and thinking. It sends
/// no grammar for `required` or a named choice, so the calls there are the engine's own
/// (`--tool-call-rate 1`), to any of the tools: a named choice may get another.
#[test]
fn hf_behind_vllm_rs_reads_the_embedded_models_response_template() {
    let serve = serve_template_format("hf", false);
    let label = "vllm-rs hf";
    for choice in ["auto", "required"] {
        assert_parsed_calls(&chat_with_tools(serve.port, choice, label), label);
    }
    let (status, named) = chat_naming_get_time(serve.port);
    assert_eq!(status, 200, "{named}");
    assert_parsed_calls(&named, label);
    assert_thinking_parsed(serve.port, label);
}

/// The Python frontend's Beam parser: `auto` calls read with the template; for `required`
/// and a named choice it sends a grammar derived from the template (a thinking block that
/// is not empty, then the calls), which the engine follows: thinking parsed out, calls
/// parsed. Its `hf` parser reads the same answers, and refuses `required` (HTTP 400: it
/// derives no grammar).
#[test]
fn beam_and_hf_behind_the_python_frontend_read_the_embedded_models_template() {
    let serve = serve_template_format("beam", true);
    let label = "python beam";
    assert_parsed_calls(&chat_with_tools(serve.port, "auto", label), label);
    let required = chat_with_tools(serve.port, "required", label);
    assert_parsed_calls(&required, label);
    assert_required_thinks(&required, label);
    let (status, named) = chat_naming_get_time(serve.port);
    assert_eq!(status, 200, "{named}");
    assert_eq!(
        named["tool_calls"][0]["function"]["name"], "get_time",
        "{named}"
    );
    assert!(!reasoning_of(&named).trim().is_empty(), "{named}");
    assert_thinking_parsed(serve.port, label);
    drop(serve);

    let serve = serve_template_format("hf", true);
    let label = "python hf";
    assert_parsed_calls(&chat_with_tools(serve.port, "auto", label), label);
    assert_thinking_parsed(serve.port, label);
    let body = json!({"model": "tiny", "max_tokens": 100, "tools": tools(),
        "tool_choice": "required", "messages": [{"role": "user", "content": "Weather?"}]});
    let (status, answer) = http_post_json(serve.port, "/v1/chat/completions", &body);
    assert_eq!(status, 400, "{answer}");
}

/// vllm-rs's `kimi` reasoning parser reads Kimi-VL's `◁think▷…◁/think▷` with a model whose
/// tokenizer has both tags (the embedded one lacks them: refused before anything starts).
#[test]
fn kimi_thinking_behind_vllm_rs_with_its_tags_as_tokens() {
    let model = TestDir::new("kimi-think-model");
    model_with_markers(&model, &["◁think▷", "◁/think▷"]);
    let dir = model.root().to_str().unwrap();
    let flags = ["--reasoning-format", "kimi", "--reasoning-share", "0.5"];
    let mut serve =
        Serve::start(&[&["--model", dir, "--served-model-name", "tiny"], &flags[..]].concat());
    serve.wait_ready();
    let body = json!({"model": "tiny", "max_tokens": 80,
        "messages": [{"role": "user", "content": "Hello"}]});
    let (status, answer) = http_post_json(serve.port, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{answer}");
    let message = &answer["choices"][0]["message"];
    let content = message["content"].as_str().unwrap_or("");
    assert!(reasoning_of(message).trim().len() > 4, "{answer}");
    assert!(
        content.trim().len() > 4 && !content.contains("think▷"),
        "{answer}"
    );
    drop(serve);
    let refused = vcr_command()
        .args(["serve", "--reasoning-format", "kimi"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("◁think▷"),
        "{err}"
    );
}
