//! Grammars whose literal text is a special token of the model (gpt-oss's harmony markers
//! are): matched by that token where vLLM's xgrammar backend matches it (structural tags,
//! Lark grammars), spelled in ordinary tokens where it leaves special tokens out.

use super::*;
use crate::play::content::constrained::BEAM_MARKERS;
use crate::play::content::vocab::embedded_with_markers;

/// Harmony-like markers, in the order [`embedded_with_markers`] gives them ids.
const MARKERS: &[&str] = &[
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|start|>",
    "<|return|>",
];

/// The id of `MARKERS[i]`.
fn marker(i: usize) -> u32 {
    vcr_host::tiny_model::TOKENIZER_VOCAB + i as u32
}

/// A thinking channel of free text, then a final one holding a JSON object.
fn harmony_tag() -> Value {
    json!({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<|channel|>analysis<|message|>",
         "content": {"type": "any_text"}, "end": "<|end|>"},
        {"type": "tag", "begin": "<|start|>assistant<|channel|>final<|message|>",
         "content": {"type": "json_schema", "json_schema": {"type": "object",
             "properties": {"city": {"type": "string"}}, "required": ["city"]}},
         "end": "<|return|>"}]}})
}

/// What the engine answers `structured` (a request's `structured_outputs`) with, its
/// markers special tokens or ordinary ones: the ids up to EOS, or why it failed.
fn answer(structured: Value, special: bool) -> Result<Vec<u32>, String> {
    let vocab = embedded_with_markers(MARKERS, special);
    let mut r = req_max("s", Some(300));
    r.prompt_token_ids = Some(vocab.encode(PROMPT));
    r.sampling_params.as_mut().unwrap().structured_outputs =
        Some(rmpv::Value::Map(match structured {
            Value::Object(m) => m
                .into_iter()
                .map(|(k, v)| {
                    let v = match v {
                        Value::String(s) => s,
                        v => v.to_string(),
                    };
                    (k.into(), v.into())
                })
                .collect(),
            _ => panic!("structured outputs are an object"),
        }));
    let mut shaping = shaping(0.0, 0.3);
    shaping.vocab = vocab;
    let mut s = shaping.stream_for(&r, 1)?.expect("a constrained answer");
    let mut ids = Vec::new();
    for _ in 0..300 {
        let t = s.next_token(&[]);
        if let Some(why) = s.failure() {
            return Err(why.to_string());
        }
        if t == vcr_host::tiny_model::EOS_TOKEN_ID {
            return Ok(ids);
        }
        ids.push(t);
    }
    Err(format!("no EOS in 300 tokens: {ids:?}"))
}

/// With the markers as special tokens, a structural tag holding them must not fail at its
/// first token (as when the grammar backend is handed `<|channel|>` as the special token,
/// which its text does not admit). As vLLM's xgrammar backend reads the tag, the markers' text
/// is matched by their tokens: the answer follows the tag, each marker one token.
#[test]
fn a_tag_whose_text_holds_special_tokens_is_written_with_them() {
    for special in [true, false] {
        let ids = answer(json!({"structural_tag": harmony_tag()}), special)
            .unwrap_or_else(|e| panic!("special {special}: {e}"));
        let vocab = embedded_with_markers(MARKERS, special);
        let text = vocab.decode(&ids);
        let count = |i| ids.iter().filter(|&&t| t == marker(i)).count();
        assert_eq!(
            [0, 1, 2, 3, 4].map(count),
            [2, 2, 1, 1, 1],
            "special {special}: {text}"
        );
        let thinking = text
            .strip_prefix("<|channel|>analysis<|message|>")
            .and_then(|t| t.split_once("<|end|>"))
            .map(|(thinking, _)| thinking);
        assert!(
            thinking.is_some_and(|t| t.split_whitespace().count() > 3),
            "special {special}: {text}"
        );
        let json = text
            .split_once("<|start|>assistant<|channel|>final<|message|>")
            .and_then(|(_, rest)| rest.strip_suffix("<|return|>"))
            .unwrap_or_else(|| panic!("special {special}: {text}"));
        let v: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v["city"].is_string(), "{text}");
    }
}

/// A Lark grammar is compiled the same way; a JSON schema, a regex and GBNF without
/// special tokens (vLLM's xgrammar backend leaves them out of those), so their text is
/// spelled in ordinary tokens; and vLLM's guidance backend never matches one by text.
#[test]
fn other_grammars_match_special_tokens_as_vllms_backends_do() {
    let lark = json!({"grammar": "start: \"<|channel|>\" \"x\""});
    assert_eq!(answer(lark, true), Ok(vec![marker(0), 3 + u32::from(b'x')]));
    let spelled = |text: &str| Ok(vcr_host::tiny_model::encode_text(text));
    let schema = json!({"json": {"type": "string", "const": "<|channel|>"}});
    assert_eq!(answer(schema, true), spelled("\"<|channel|>\""));
    let regex = json!({"regex": "<\\|channel\\|>x"});
    assert_eq!(answer(regex, true), spelled("<|channel|>x"));
    let gbnf = json!({"grammar": "root ::= \"<|channel|>\" \"x\""});
    assert_eq!(answer(gbnf, true), spelled("<|channel|>x"));
    let guidance = json!({"grammar": "start: \"<|channel|>\" \"x\"", "_backend": "guidance"});
    assert_eq!(answer(guidance, true), spelled("<|channel|>x"));
}

/// vllm-rs 0.33's `beam` tag for `get_weather(city, days)` (its shape, with a model whose
/// response_template reads Beam's markup): a think block that is not empty, then the
/// calls (`required`), or the calls or a final answer (`auto`).
fn beam_tag(auto: bool) -> Value {
    let call = json!({"type": "sequence", "elements": [
        {"type": "const_string",
         "value": " to=get_weather<|channel|>analysis <|constrain|>xml<|message|>"},
        {"type": "sequence", "elements": [
            {"type": "optional", "content": {"type": "const_string", "value": "\n"}},
            {"type": "tag", "begin": "<rfl:parameter name=\"city\">\n",
             "content": {"type": "any_text", "excludes": ["<|end|>", "<|call|>", "</rfl:parameter>"]},
             "end": "\n</rfl:parameter>"}]},
        {"type": "sequence", "elements": [
            {"type": "optional", "content": {"type": "const_string", "value": "\n"}},
            {"type": "tag", "begin": "<rfl:parameter name=\"days\">\n",
             "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
             "end": "\n</rfl:parameter>"}]}]});
    let calls = json!({"type": "sequence", "elements": [call.clone(),
        {"type": "star", "content": {"type": "sequence", "elements": [
            {"type": "const_string", "value": "<|end|><|start|>assistant"}, call]}},
        {"type": "optional", "content": {"type": "const_string", "value": "<|call|>"}}]});
    let final_answer = json!({"type": "sequence", "elements": [
        {"type": "const_string", "value": "<|channel|>final<|message|>"},
        {"type": "any_text", "excludes": ["<|end|>", "<|return|>"]},
        {"type": "optional", "content": {"type": "const_string", "value": "<|return|>"}}]});
    let after = if auto {
        json!({"type": "or", "elements": [calls, final_answer]})
    } else {
        calls
    };
    json!({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<|channel|>analysis<|message|>",
         "content": {"type": "sequence", "elements": [{"type": "regex", "pattern": "[^<]"},
             {"type": "any_text"}]},
         "end": ["<|end|><|start|>assistant"]},
        after]}})
}

/// The answer to `tag` at `--tool-call-rate rate` for a prompt showing `get_weather`, with
/// Beam's markers as special tokens, as text.
fn beam_answer(tag: &Value, rate: f64, id: &str, max_tokens: u32) -> String {
    let vocab = embedded_with_markers(BEAM_MARKERS, true);
    let mut r = req_max(id, Some(max_tokens));
    let params = weather_tools().tools[0].parameters.clone();
    let tool =
        json!({"type": "function", "function": {"name": "get_weather", "parameters": params}});
    r.prompt_token_ids = Some(vocab.encode(&format!(
        "<|im_start|>system\n<tools>\n{tool}\n</tools><|im_end|>\n{PROMPT}"
    )));
    r.sampling_params.as_mut().unwrap().structured_outputs = Some(rmpv::Value::Map(vec![(
        "structural_tag".into(),
        tag.to_string().into(),
    )]));
    let mut shaping = shaping(rate, 0.25);
    shaping.vocab = vocab.clone();
    shaping.tool_calls.format = ToolCallFormat::Beam;
    let mut s = shaping.stream_for(&r, 1).unwrap().expect("a tag's answer");
    let mut ids = Vec::new();
    while ids.len() < max_tokens as usize {
        let t = s.next_token(&[]);
        assert!(s.failure().is_none(), "{:?}", s.failure());
        if t == vcr_host::tiny_model::EOS_TOKEN_ID {
            break;
        }
        ids.push(t);
    }
    vocab.decode(&ids)
}

/// vllm-rs's `beam` constrains answers to Beam's markup, which its parser then reads with
/// the model's template: the engine thinks (at least a word, as the tag asks, however short
/// the answer), then calls in that markup, each argument by the schema, closed by
/// `<|call|>`; under `auto` it calls at `--tool-call-rate`, and answers in the final
/// channel otherwise.
#[test]
fn vllm_rs_beam_tags_are_answered_in_beams_markup() {
    let think = "<|channel|>analysis<|message|>";
    let call = " to=get_weather<|channel|>analysis <|constrain|>xml<|message|>\n<rfl:parameter name=\"city\">\n";
    for (auto, rate) in [(false, 0.0), (true, 1.0)] {
        for id in ["a", "b", "c"] {
            let text = beam_answer(&beam_tag(auto), rate, id, 300);
            let (thinking, rest) = text
                .strip_prefix(think)
                .and_then(|t| t.split_once("<|end|><|start|>assistant"))
                .unwrap_or_else(|| panic!("{text}"));
            assert!(thinking.split_whitespace().count() > 2, "{text}");
            let args = rest
                .strip_prefix(call)
                .and_then(|r| r.strip_suffix("<|call|>"))
                .unwrap_or_else(|| panic!("{text}"));
            let (city, days) = args
                .split_once("\n</rfl:parameter>\n<rfl:parameter name=\"days\">\n")
                .unwrap_or_else(|| panic!("{text}"));
            assert!(
                city.chars().all(|c| c.is_ascii_alphabetic() || c == ' '),
                "{text}"
            );
            let days = days.strip_suffix("\n</rfl:parameter>").unwrap_or("");
            assert!(days.parse::<i64>().is_ok(), "{text}");
        }
    }
    for id in ["a", "b", "c"] {
        let text = beam_answer(&beam_tag(true), 0.0, id, 300);
        let answer = text
            .split_once("<|end|><|start|>assistant<|channel|>final<|message|>")
            .and_then(|(_, a)| a.strip_suffix("<|return|>"))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(answer.split_whitespace().count() > 5, "{text}");
        // however short the answer, the think block holds a word
        let short = beam_answer(&beam_tag(true), 0.0, id, 40);
        let thinking = short
            .strip_prefix(think)
            .and_then(|t| t.split_once("<|end|>"))
            .map_or("", |(t, _)| t);
        assert!(
            thinking.len() > 1 && thinking.chars().all(|c| c.is_ascii_alphabetic()),
            "{short}"
        );
    }
}
