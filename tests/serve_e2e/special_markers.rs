//! A structural tag whose literal text is a special token of the served model (gpt-oss's
//! harmony markers are): the request succeeds and its answer follows the tag, each marker
//! the model's token, as vLLM's xgrammar backend admits it.

use serde_json::{Value, json};

use super::*;
use vllm_vcr::play::content::constrained::BEAM_MARKERS;

/// A model of one's own: the embedded one with [`BEAM_MARKERS`] as special tokens.
fn model_with_special_markers(dir: &TestDir) {
    super::parsers::model_with_markers(dir, BEAM_MARKERS);
    let path = dir.path("tokenizer.json");
    let mut t: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for token in t["added_tokens"].as_array_mut().unwrap() {
        if BEAM_MARKERS.contains(&token["content"].as_str().unwrap_or("")) {
            token["special"] = true.into();
        }
    }
    std::fs::write(&path, t.to_string()).unwrap();
}

/// Such a tag must not fail at its first token (an HTTP 400 when the grammar backend is
/// handed `<|channel|>` as the special token its text does not admit). Through vllm-rs
/// 0.33: 200, thinking then a final answer holding the schema's object, each
/// marker one token of the model.
#[test]
fn a_structural_tag_holding_special_tokens_is_followed_with_them() {
    let dir = TestDir::new("special-markers");
    model_with_special_markers(&dir);
    let mut serve = Serve::start(&["--model", dir.root().to_str().unwrap()]);
    serve.wait_ready();
    let name = dir.root().file_name().unwrap().to_str().unwrap();
    let tag = json!({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<|channel|>analysis<|message|>",
         "content": {"type": "any_text"}, "end": "<|end|>"},
        {"type": "tag", "begin": "<|start|>assistant<|channel|>final<|message|>",
         "content": {"type": "json_schema", "json_schema": {"type": "object",
             "properties": {"city": {"type": "string"}}, "required": ["city"]}},
         "end": "<|return|>"}]}});
    let channel = u64::from(vllm_vcr::tiny_model::TOKENIZER_VOCAB);
    for skip in [false, true] {
        let body = json!({"model": name, "max_tokens": 120, "skip_special_tokens": skip,
            "return_token_ids": true, "response_format": tag,
            "messages": [{"role": "user", "content": "Weather in Paris?"}]});
        let (status, answer) = http_post_json(serve.port, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{answer}");
        let choice = &answer["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{answer}");
        let content = choice["message"]["content"].as_str().unwrap_or("");
        let ids: Vec<u64> = choice["token_ids"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        assert_eq!(ids.iter().filter(|&&t| t == channel).count(), 2, "{answer}");
        let (thinking, json_text) = if skip {
            // the detokenizer drops special tokens: the thinking, then the object
            let (thinking, rest) = content
                .split_once('{')
                .unwrap_or_else(|| panic!("{answer}"));
            (thinking.to_string(), format!("{{{rest}"))
        } else {
            let rest = content
                .strip_prefix("<|channel|>analysis<|message|>")
                .unwrap_or_else(|| panic!("{answer}"));
            let (thinking, rest) = rest
                .split_once("<|end|><|start|>assistant<|channel|>final<|message|>")
                .unwrap_or_else(|| panic!("{answer}"));
            let object = rest
                .strip_suffix("<|return|>")
                .unwrap_or_else(|| panic!("{answer}"));
            (thinking.to_string(), object.to_string())
        };
        // the think block spends its share of the answer's 120 tokens less its markup,
        // about 20 one-character tokens: one word or a few, as the drawn words are long
        assert!(thinking.split_whitespace().count() >= 1, "{answer}");
        let object: Value =
            serde_json::from_str(&json_text).unwrap_or_else(|e| panic!("{e}: {answer}"));
        assert!(object["city"].is_string(), "{answer}");
    }
}

/// A response_template of Beam's own markup: what vllm-rs's `beam` parser reads its
/// answers with (docs/tool-formats.md).
fn beam_template() -> Value {
    json!({"start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "thinking": {"open": "<|channel|>analysis<|message|>",
                         "close": "<|end|><|start|>assistant"},
            "tool_calls": {
                "open_pattern": " to=(?P<name>[^<]+)<\\|channel\\|>analysis <\\|constrain\\|>xml<\\|message\\|>",
                "close": ["<|call|>", "<|end|><|start|>assistant"],
                "content": "xml-inline",
                "content_args": {"tag_pattern":
                    "<rfl:parameter name=\"(?P<key>[^\"]+)\">\\n?(?P<value>.*?)\\n?</rfl:parameter>"},
                "repeats": true,
                "transform": {"type": "function",
                              "function": {"name": "{name}", "arguments": "{content}"}}},
            "content": {"open": "<|channel|>final<|message|>", "close": "<|return|>"}}})
}

/// vllm-rs 0.33's `beam` constrains every answer to Beam's markup and reads it with
/// the model's response_template. With a model whose template is of that markup and whose
/// tokenizer has its markers as special tokens, `serve --tool-call-format beam` behind
/// vllm-rs gives the client the thinking as `reasoning`, a chat answer as `content`, and
/// calls (`required`, a named tool, `auto` at `--tool-call-rate 1`) as `tool_calls` whose
/// arguments follow the schema.
#[test]
fn vllm_rs_beam_splits_beams_markup_with_a_model_whose_template_reads_it() {
    beam_splits_beams_markup(false);
}

/// The Python 0.33 frontend's `beam` reads the same template: the same answers split alike.
#[test]
fn python_beam_splits_beams_markup_with_a_model_whose_template_reads_it() {
    beam_splits_beams_markup(true);
}

fn beam_splits_beams_markup(python: bool) {
    let dir = TestDir::new(if python {
        "beam-markup-python"
    } else {
        "beam-markup"
    });
    model_with_special_markers(&dir);
    let path = dir.path("tokenizer_config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["response_template"] = beam_template();
    std::fs::write(&path, config.to_string()).unwrap();
    let flags = [
        "--model",
        dir.root().to_str().unwrap(),
        "--tool-call-format",
        "beam",
        "--reasoning-format",
        "beam",
        "--tool-call-rate",
        "1",
    ];
    let frontend = PythonFrontend::of("vllm", "0.33.0");
    let mut serve = Serve::start(&if python {
        frontend.with(&flags)
    } else {
        flags.to_vec()
    });
    serve.wait_ready();
    let name = dir.root().file_name().unwrap().to_str().unwrap();
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "required": ["city", "days"],
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]);
    let ask = |extra: Value| {
        let mut body = json!({"model": name, "max_tokens": 300,
            "messages": [{"role": "user", "content": "Weather in Paris?"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, answer) = http_post_json(serve.port, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{answer}");
        answer["choices"][0]["message"].clone()
    };
    let reasoning = |m: &Value| super::parsers::reasoning_of(m).to_string();
    let chat = ask(json!({}));
    let content = chat["content"].as_str().unwrap_or("");
    assert!(content.split_whitespace().count() > 3, "{chat}");
    assert!(!content.contains("<|"), "{chat}");
    assert!(reasoning(&chat).split_whitespace().count() > 3, "{chat}");
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    for choice in [json!("required"), named, json!("auto")] {
        let m = ask(json!({"tools": tools, "tool_choice": choice}));
        let calls = m["tool_calls"]
            .as_array()
            .unwrap_or_else(|| panic!("{choice}: {m}"));
        assert!(!calls.is_empty(), "{choice}: {m}");
        for call in calls {
            assert_eq!(call["function"]["name"], "get_weather", "{m}");
            let args: Value =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap_or(""))
                    .unwrap_or_else(|e| panic!("{e}: {m}"));
            assert!(args["city"].is_string() && args["days"].is_i64(), "{m}");
        }
        assert!(
            !reasoning(&m).is_empty() && !reasoning(&m).contains("<|"),
            "{m}"
        );
        assert!(
            m["content"].as_str().unwrap_or("").is_empty(),
            "{choice}: {m}"
        );
    }
}
