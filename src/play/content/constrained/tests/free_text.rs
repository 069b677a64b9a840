//! Free text under a grammar (`any_text`): compiled as xgrammar reads it, and written by
//! the walker (a think block for its share of the answer, other free text a few words).

use super::*;

/// A think block of free text (xgrammar's `any_text`) opened by `begin` (`""`: the prompt
/// opened it), as vllm-rs 0.33 writes it.
fn think_tag(begin: &str) -> Value {
    json!({"type": "tag", "begin": begin, "end": "</think>", "content": {"type": "any_text",
        "excludes": [], "max_tokens": null, "max_chars": null}})
}

/// What vllm-rs 0.33 sends behind a reasoning parser: an optional think block (`qwen3`:
/// followed by `"\n\n"`, as behind its `qwen3` parser; else as behind `deepseek_r1`), then
/// `rest`.
fn behind_a_think_block(begin: &str, rest: Value, qwen3: bool) -> Value {
    let block = if qwen3 {
        json!({"type": "sequence", "elements": [think_tag(begin),
            {"type": "const_string", "value": "\n\n"}]})
    } else {
        think_tag(begin)
    };
    json!({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "optional", "content": block}, rest]}})
}

/// A structural tag of one format.
fn tag_of(format: Value) -> Value {
    json!({"type": "structural_tag", "format": format})
}

/// hermes calls to `get_weather` under `tool_choice: required`.
fn required_calls() -> Value {
    json!({"type": "tags_with_separator", "separator": "", "at_least_one": true,
        "stop_after_first": false, "tags": [{"type": "tag",
            "begin": "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ",
            "content": {"type": "json_schema", "json_schema": true}, "end": "}\n</tool_call>"}]})
}

/// Issue r28: vllm-rs opens the tag of `tool_choice: required` with a think block of
/// `any_text` behind a reasoning parser, which was refused (HTTP 400). Free text, as
/// xgrammar reads it: inside a tag it runs to the tag's first end string and holds none of
/// its `excludes`; elsewhere to the answer's end; in a sequence only last.
#[test]
fn any_text_is_free_text_that_its_tag_ends() {
    let none = PromptTools::default();
    let next = json!({"type": "const_string", "value": "X"});
    let g = || tag_grammar(&behind_a_think_block("<think>", next.clone(), false), &none);
    assert!(accepts(g(), "<think>abc</think>X"));
    assert!(accepts(g(), "<think></think>X"));
    assert!(accepts(g(), "X"), "the block is optional");
    assert!(accepts(
        g(),
        "<think>\nsome <b>lines</b>,\n{\"of\": 1}\n</think>X"
    ));
    assert!(
        !accepts(g(), "<think>a</think>b</think>X"),
        "the first end ends it"
    );
    assert!(!accepts(g(), "<think>abc"));
    assert!(!accepts(g(), "<think>abc</think>"));
    let qwen3 = behind_a_think_block("<think>", next.clone(), true);
    assert!(accepts(
        tag_grammar(&qwen3, &none),
        "<think>abc</think>\n\nX"
    ));
    let opened = tag_of(json!({"type": "sequence", "elements": [think_tag(""), next]}));
    assert!(accepts(tag_grammar(&opened, &none), "abc</think>X"));
    assert!(!accepts(tag_grammar(&opened, &none), "X"));
    // excluded strings stay out of the text
    let mut ex = think_tag("<think>");
    ex["content"]["excludes"] = json!(["<think>", ""]);
    let ex = tag_of(ex);
    assert!(!accepts(
        tag_grammar(&ex, &none),
        "<think>a<think>b</think>"
    ));
    assert!(accepts(tag_grammar(&ex, &none), "<think>a<thin</think>"));
    // an end that may be left out: the text may run to the answer's end
    let mut open_end = think_tag("<think>");
    open_end["end"] = json!(["</think>", ""]);
    let open_end = tag_of(open_end);
    assert!(accepts(tag_grammar(&open_end, &none), "<think>abc</think>"));
    assert!(accepts(tag_grammar(&open_end, &none), "<think>abc"));
    // at the top level: any text, none at all included
    let top = tag_of(json!({"type": "any_text"}));
    assert!(accepts(tag_grammar(&top, &none), "anything <at> all\n"));
    assert!(accepts(tag_grammar(&top, &none), ""));
    // in a sequence, the string after free text ends it (vllm-rs's Hunyuan values); any
    // other format cannot follow text that has no end
    let seq = tag_of(json!({"type": "sequence", "elements": [
        {"type": "const_string", "value": "<v>"}, {"type": "any_text"}, next]}));
    assert!(accepts(tag_grammar(&seq, &none), "<v>a b, c</v>X"));
    assert!(!accepts(tag_grammar(&seq, &none), "<v>aXbX"));
    let seq = tag_of(
        json!({"type": "sequence", "elements": [{"type": "any_text"},
        {"type": "json_schema", "json_schema": true}]}),
    );
    let e = grammar_for(&so(Constraint::StructuralTag(seq.to_string())), &none).unwrap_err();
    assert!(e.contains("only a `const_string` can follow it"), "{e}");
}

/// vllm-rs's tag of `tool_choice: required` for Hunyuan (`hy_v3`) writes each argument as
/// `<arg_value>`, free text, `</arg_value>`: the engine writes a few words there and the
/// end, so the call completes (the value's free text does not run to `max_tokens`).
#[test]
fn free_text_between_two_strings_is_a_few_words_then_the_second() {
    let value = |key: &str| {
        json!({"type": "sequence", "elements": [
            {"type": "const_string", "value": "<arg_key>"},
            {"type": "const_string", "value": key},
            {"type": "const_string", "value": "</arg_key>\n<arg_value>"},
            {"type": "any_text", "excludes": ["<arg_value>", "</arg_value>"]},
            {"type": "const_string", "value": "</arg_value>\n"}]})
    };
    let tag = json!({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<tool_calls>\n"},
        {"type": "tag", "begin": "<tool_call>get_weather<tool_sep>\n",
         "content": {"type": "sequence", "elements": [value("city"), value("day")]},
         "end": "</tool_call>"},
        {"type": "const_string", "value": "\n</tool_calls>"}]}});
    for i in 0..5 {
        let mut r = tag_req(&tag, 400);
        r.request_id = format!("h{i}");
        let s = shaping(0.0, 0.0).stream_for(&r, 1).unwrap().unwrap();
        let (t, end) = drain(s, 400);
        assert_eq!(end, End::Eos, "{t}");
        let city = t
            .split("<arg_key>city</arg_key>\n<arg_value>")
            .nth(1)
            .and_then(|v| v.split("</arg_value>").next())
            .expect(&t);
        assert!(!city.is_empty() && city.len() < 80, "{t}");
        assert!(t.ends_with("</tool_call>\n</tool_calls>"), "{t}");
    }
}

/// The think block before a required call spends `--reasoning-share` of the answer (its
/// tags included, as in a free-text answer), at most half of `max_tokens`, then the call
/// follows, complete: the free text does not run to `max_tokens`.
#[test]
fn a_required_call_behind_a_think_block_thinks_for_its_share_then_calls() {
    let vocab = Vocabulary::embedded();
    let with_tools = |tag: &Value| {
        let mut r = tag_req(tag, 300);
        r.prompt_token_ids = Some(vocab.encode(&weather_prompt()));
        r
    };
    for qwen3 in [false, true] {
        let mut r = with_tools(&behind_a_think_block("<think>", required_calls(), qwen3));
        for (share, block) in [(0.2, 60), (0.5, 150), (0.9, 150)] {
            for i in 0..10 {
                r.request_id = format!("t{i}");
                let s = shaping(0.0, share).stream_for(&r, 1).unwrap().unwrap();
                let (t, end) = drain(s, 300);
                assert_eq!(end, End::Eos, "share {share}: {t}");
                // one byte per token in the embedded vocabulary
                let (thinking, call) = t.split_once("</think>").expect(&t);
                assert_eq!(
                    thinking.len() + "</think>".len(),
                    block,
                    "share {share}: {t}"
                );
                let body = thinking.strip_prefix("<think>\n").expect(&t);
                assert!(body.ends_with('\n') && body.trim().len() > 10, "{t}");
                let calls = hermes_calls(call).unwrap();
                assert_eq!(calls[0]["name"], "get_weather", "{t}");
                assert!(calls[0]["arguments"]["city"].is_string(), "{t}");
            }
        }
    }
    // the prompt opened the block: the answer starts inside it
    let opened = tag_of(json!({"type": "sequence", "elements": [think_tag(""), required_calls()]}));
    let s = shaping(0.0, 0.5).stream_for(&with_tools(&opened), 1);
    let (t, end) = drain(s.unwrap().unwrap(), 300);
    assert_eq!(end, End::Eos, "{t}");
    let (thinking, call) = t.split_once("</think>").expect(&t);
    assert_eq!(thinking.len(), 150 - "</think>".len(), "{t}");
    assert!(
        thinking.starts_with('\n') && call.starts_with("<tool_call>\n"),
        "{t}"
    );
}

/// The embedded template's prompt with [`weather_tools`] shown.
fn weather_prompt() -> String {
    let params = weather_tools().tools[0].parameters.clone();
    let tool =
        json!({"type": "function", "function": {"name": "get_weather", "parameters": params}});
    format!("<|im_start|>system\n<tools>\n{tool}\n</tools><|im_end|>\n{PROMPT}")
}

/// Free text elsewhere in a tag (an XML argument's value) is a few words, closed by its
/// tag's end; behind a think block, `auto` with strict tools is a call or text under
/// `--tool-call-rate`, as without one.
#[test]
fn other_free_text_is_a_few_words_and_auto_behind_a_think_block_still_chooses() {
    let value = tag_of(json!({"type": "sequence", "elements": [
        {"type": "const_string", "value": "city="},
        {"type": "tag", "begin": "<arg_value>", "content": {"type": "any_text"},
            "end": "</arg_value>"}]}));
    for i in 0..10 {
        let mut r = tag_req(&value, 300);
        r.request_id = format!("v{i}");
        let (t, end) = drain(shaping(0.0, 0.5).stream_for(&r, 1).unwrap().unwrap(), 300);
        assert_eq!(end, End::Eos, "{t}");
        let words = t
            .strip_prefix("city=<arg_value>")
            .and_then(|v| v.strip_suffix("</arg_value>"))
            .expect(&t);
        assert!(!words.is_empty() && words.len() < 60, "{t}");
    }
    let auto = behind_a_think_block(
        "<think>",
        hermes_triggered("f", strict_params(), false, false)["format"].clone(),
        true,
    );
    let r = tag_req(&auto, 300);
    assert!(
        shaping(0.0, 0.5).plan(&r, 1).unwrap().is_none(),
        "rate 0: text"
    );
    let (t, end) = drain(shaping(1.0, 0.5).stream_for(&r, 1).unwrap().unwrap(), 300);
    assert_eq!(end, End::Eos, "{t}");
    let (_, call) = t.split_once("</think>\n\n").expect(&t);
    assert!(call.starts_with("<tool_call>"), "{t}");
    assert!(
        hermes_calls(call).unwrap()[0]["arguments"]["a"].is_string(),
        "{t}"
    );
}

/// What vllm-rs 0.33 sends for `tool_choice: required` with its `kimi_k2` parser: calls
/// whose id (`functions.NAME:N`) the tag leaves free, a number.
fn kimi_k2_required(names: &[&str]) -> Value {
    let tags: Vec<Value> = names
        .iter()
        .map(|name| {
            json!({"type": "tag", "begin": format!("<|tool_call_begin|>functions.{name}:"),
                "content": {"type": "sequence", "elements": [
                    {"type": "regex", "pattern": "\\d+"},
                    {"type": "const_string", "value": "<|tool_call_argument_begin|>"},
                    {"type": "json_schema", "json_schema": true, "style": "json"}]},
                "end": "<|tool_call_end|>"})
        })
        .collect();
    tag_of(json!({"type": "sequence", "elements": [
        {"type": "const_string", "value": "<|tool_calls_section_begin|>"},
        {"type": "tags_with_separator", "tags": tags, "separator": "",
            "at_least_one": true, "stop_after_first": false},
        {"type": "const_string", "value": "<|tool_calls_section_end|>"}]}))
}

/// Issue 25: the ids Kimi K2's calls carry, `functions.NAME:N`, in the order the answer
/// writes them.
fn kimi_k2_ids(text: &str) -> Vec<String> {
    text.split("<|tool_call_begin|>functions.")
        .skip(1)
        .map(|call| {
            let (id, _) = call.split_once("<|tool_call_argument_begin|>").expect(text);
            id.to_string()
        })
        .collect()
}

/// Issue 25: two calls of one answer with the same id reach a vllm-rs client as one call,
/// their arguments run together. Where the tag leaves a call's index free, the answer
/// numbers its calls 0, 1, 2… as Kimi K2 does.
#[test]
fn calls_whose_index_the_tag_leaves_free_are_numbered_from_0() {
    let vocab = Vocabulary::embedded();
    let time = json!({"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["tz"]}}});
    let prompt = weather_prompt().replacen("\n</tools>", &format!("\n{time}\n</tools>"), 1);
    let tag = kimi_k2_required(&["get_weather", "get_time"]);
    let mut most = 0;
    for i in 0..40 {
        let mut r = tag_req(&tag, 800);
        r.request_id = format!("k{i}");
        r.prompt_token_ids = Some(vocab.encode(&prompt));
        let (t, end) = drain(shaping(0.0, 0.5).stream_for(&r, 1).unwrap().unwrap(), 800);
        assert_eq!(end, End::Eos, "{t}");
        let ids = kimi_k2_ids(&t);
        let names: Vec<&str> = ids.iter().map(|id| id.split(':').next().unwrap()).collect();
        let numbered: Vec<String> = names
            .iter()
            .enumerate()
            .map(|(n, name)| format!("{name}:{n}"))
            .collect();
        assert_eq!(ids, numbered, "{t}");
        // the literal after the number is written once, not again into the arguments
        assert_eq!(
            t.matches("tool_call_argument_begin").count(),
            ids.len(),
            "{t}"
        );
        most = most.max(ids.len());
    }
    assert!(most >= 2, "no answer made two calls");
}

/// A number that is all of a call tag's content is its index too, the tag's end written
/// after it.
#[test]
fn a_tag_of_only_a_free_number_is_numbered_from_0_and_ends() {
    // closed by a literal, as Kimi K2's section end closes its calls: the walker cannot
    // stop after the first call, so answers of several calls come
    let tag = tag_of(json!({"type": "sequence", "elements": [
        {"type": "tags_with_separator", "separator": "", "at_least_one": true,
            "stop_after_first": false, "tags": [{"type": "tag", "begin": "<call n=",
                "content": {"type": "regex", "pattern": "[0-9]+"}, "end": "/>"}]},
        {"type": "const_string", "value": "."}]}));
    let mut most = 0;
    for i in 0..40 {
        let mut r = tag_req(&tag, 200);
        r.request_id = format!("n{i}");
        let (t, end) = drain(shaping(0.0, 0.5).stream_for(&r, 1).unwrap().unwrap(), 200);
        assert_eq!(end, End::Eos, "{t}");
        let calls = t.matches("<call").count();
        let numbered: String = (0..calls).map(|n| format!("<call n={n}/>")).collect();
        assert_eq!(t, format!("{numbered}."));
        most = most.max(calls);
    }
    assert!(most >= 2, "no answer made two calls");
}

/// What vLLM 0.33's Beam parser sends for `tool_choice: required` at the start of the
/// answer, derived from the embedded model's response template: a thinking block that is
/// not empty, a call, then a `star` of more calls each after the previous one's closer.
fn beam_required_tag() -> Value {
    let params = json!({"type": "object", "properties": {"city": {"type": "string"},
        "days": {"type": "integer"}}, "required": ["city", "days"]});
    let call = json!({"type": "sequence", "elements": [
        {"type": "regex", "pattern": "<tool_call>\\n\\{\"name\": \"get_weather\", \"arguments\": "},
        {"type": "json_schema", "json_schema": params, "excludes": ["}\n</tool_call>"]}]});
    let closer = json!({"type": "const_string", "value": "}\n</tool_call>"});
    json!({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<think>\n", "end": ["\n</think>\n\n"],
            "content": {"type": "sequence", "elements": [
                {"type": "regex", "pattern": "[^\\n]|\n[^\\n<]|\n<[^\\n/]"},
                {"type": "any_text"}]}},
        call,
        {"type": "star", "content": {"type": "sequence", "elements": [closer, call]}},
        {"type": "optional", "content": closer}]}})
}

#[test]
fn beams_required_tag_gives_thinking_then_calls_in_the_templates_format() {
    let vocab = Vocabulary::embedded();
    let mut r = tag_req(&beam_required_tag(), 300);
    r.prompt_token_ids = Some(vocab.encode(&weather_prompt()));
    for i in 0..6 {
        r.request_id = format!("b{i}");
        let s = shaping(0.0, 0.3).stream_for(&r, 1).unwrap().unwrap();
        let (t, end) = drain(s, 300);
        assert_eq!(end, End::Eos, "{t}");
        let (thinking, calls) = t
            .strip_prefix("<think>\n")
            .and_then(|r| r.split_once("\n</think>\n\n"))
            .unwrap_or_else(|| panic!("no thinking block: {t}"));
        assert!(!thinking.trim().is_empty(), "{t}");
        // the template's tool field: one call per block, Hermes's text
        let calls = hermes_calls(calls).unwrap_or_else(|e| panic!("{e}"));
        assert!(!calls.is_empty(), "{t}");
        for c in calls {
            assert_eq!(c["name"], "get_weather", "{t}");
            let args = &c["arguments"];
            assert!(args["city"].is_string() && args["days"].is_i64(), "{t}");
        }
    }
}
