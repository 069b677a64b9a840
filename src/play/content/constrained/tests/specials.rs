//! Grammars whose literal text is a special token of the model (gpt-oss's harmony markers
//! are): matched by that token where vLLM's xgrammar backend matches it (structural tags,
//! Lark grammars), spelled in ordinary tokens where it leaves special tokens out.

use super::*;
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

/// r35: with the markers as special tokens, a structural tag holding them failed at its
/// first token (the grammar backend was handed `<|channel|>` as the special token, which
/// its text did not admit). As vLLM's xgrammar backend reads the tag, the markers' text
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
