//! Structured outputs and tool calls end to end: grammars compiled, followed and refused.

use llguidance::Matcher;
use llguidance::api::TopLevelGrammar;
use serde_json::{Value, json};
use sim_protocol::{Constraint, EngineCoreRequest, StructuredOutputs};

use crate::play::content::reasoning::{AnswerLength, Reasoning, ReasoningFormat};
use crate::play::content::tokens::TokenStream;
use crate::play::content::vocab::{Specials, Vocabulary};

use super::formats::ToolCallFormat;
use super::gbnf::gbnf_to_lark;
use super::grammar::*;
use super::shaping::*;
use super::stream::*;
use super::tools::*;
use sim_protocol::SamplingParams;

mod formats;
mod free_text;
mod gbnf;
mod specials;

fn so(c: Constraint) -> StructuredOutputs {
    StructuredOutputs {
        constraint: c,
        disable_any_whitespace: false,
        disable_additional_properties: false,
        whitespace_pattern: None,
        backend: None,
    }
}

/// The text a constraint produces for request `id`, and whether it ended with EOS.
fn generate(c: Constraint, tools: &PromptTools, id: &str) -> (String, bool) {
    let vocab = Vocabulary::embedded();
    let g = grammar_for(&so(c), tools).unwrap();
    let mut s = ConstrainedStream::new(vocab.clone(), g, &req(id), 1).unwrap();
    let mut ids = Vec::new();
    for _ in 0..2000 {
        let t = s.next_token(&[]);
        if t == vcr_host::tiny_model::EOS_TOKEN_ID {
            return (vocab.decode(&ids), true);
        }
        ids.push(t);
    }
    (vocab.decode(&ids), false)
}

/// An instance of a JSON `schema` for request `id`: it ended with EOS and parses.
fn json_instance(schema: &Value, id: &str) -> (String, Value) {
    let (text, stopped) = generate(
        Constraint::JsonSchema(schema.to_string()),
        &PromptTools::default(),
        id,
    );
    assert!(stopped, "{text}");
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (text, v)
}

fn req(id: &str) -> EngineCoreRequest {
    req_max(id, None)
}

fn req_max(id: &str, max_tokens: Option<u32>) -> EngineCoreRequest {
    EngineCoreRequest {
        request_id: id.into(),
        prompt_token_ids: Some(vec![10, 11]),
        sampling_params: Some(SamplingParams {
            eos_token_id: Some(vcr_host::tiny_model::EOS_TOKEN_ID),
            max_tokens,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// How a stream under `max_tokens` ends, as the engine would end it.
#[derive(Debug, PartialEq)]
enum End {
    Eos,
    Length,
    Failed(String),
}

/// Run `g` for request `id` as the engine would: to EOS, a failure or `max_tokens`.
fn run(g: TopLevelGrammar, id: &str, max_tokens: u32) -> (String, End) {
    let vocab = Vocabulary::embedded();
    let s = ConstrainedStream::new(vocab, g, &req_max(id, Some(max_tokens)), 1).unwrap();
    drain(Box::new(s), max_tokens)
}

/// A stream's answer under `max_tokens`, as the engine would end it.
fn drain(mut s: Box<dyn TokenStream>, max_tokens: u32) -> (String, End) {
    let vocab = Vocabulary::embedded();
    let mut ids = Vec::new();
    while ids.len() < max_tokens as usize {
        let t = s.next_token(&[]);
        if let Some(why) = s.failure() {
            return (vocab.decode(&ids), End::Failed(why.to_string()));
        }
        if t == vcr_host::tiny_model::EOS_TOKEN_ID {
            return (vocab.decode(&ids), End::Eos);
        }
        ids.push(t);
    }
    (vocab.decode(&ids), End::Length)
}

/// Whether the grammar accepts `text` whole (its tokens in the embedded vocabulary,
/// then EOS).
fn accepts(g: TopLevelGrammar, text: &str) -> bool {
    let vocab = Vocabulary::embedded();
    let parser = vocab.factory(Specials::AsText).create_parser(g).unwrap();
    let mut m = Matcher::new(Ok(parser));
    vocab
        .encode(text)
        .iter()
        .all(|t| m.consume_token(*t).is_ok())
        && m.is_accepting().unwrap_or(false)
}

fn tag_grammar(tag: &Value, tools: &PromptTools) -> TopLevelGrammar {
    grammar_for(&so(Constraint::StructuralTag(tag.to_string())), tools)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// What vLLM 0.33's hermes tool parser builds for a strict tool (two layouts of the
/// call, with and without line breaks), as `triggered_tags`.
fn hermes_triggered(name: &str, params: Value, at_least_one: bool, first: bool) -> Value {
    let tags: Vec<Value> = [
        ("<tool_call>\n", "}\n</tool_call>"),
        ("<tool_call>", "}</tool_call>"),
    ]
    .iter()
    .map(|(b, e)| {
        json!({"type": "tag", "begin": format!("{b}{{\"name\": \"{name}\", \"arguments\": "),
                    "content": {"type": "json_schema", "json_schema": params.clone()}, "end": e})
    })
    .collect();
    json!({"type": "structural_tag", "format": {"type": "triggered_tags",
            "triggers": ["<tool_call>"], "tags": tags,
            "at_least_one": at_least_one, "stop_after_first": first}})
}

fn strict_params() -> Value {
    json!({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": false})
}

/// The calls in a hermes answer, parsed (`Err`: a call that is not valid JSON).
fn hermes_calls(text: &str) -> Result<Vec<Value>, String> {
    text.split("<tool_call>")
        .skip(1)
        .map(|c| {
            let body = c.split("</tool_call>").next().unwrap_or(c).trim();
            serde_json::from_str(body).map_err(|e| format!("{e}: {text}"))
        })
        .collect()
}

/// A chat prompt as the embedded template renders it, without tools.
const PROMPT: &str = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";

/// A request under structural tag `tag` (prompt [`PROMPT`]).
fn tag_req(tag: &Value, max_tokens: u32) -> EngineCoreRequest {
    let mut r = req_max("a", Some(max_tokens));
    r.prompt_token_ids = Some(Vocabulary::embedded().encode(PROMPT));
    r.sampling_params.as_mut().unwrap().structured_outputs = Some(rmpv::Value::Map(vec![(
        "structural_tag".into(),
        tag.to_string().into(),
    )]));
    r
}

/// The engine's shaping at `--tool-call-rate rate` and `--reasoning-share share`, in a
/// context of 2048 tokens.
fn shaping(rate: f64, share: f64) -> Shaping {
    Shaping {
        vocab: Vocabulary::embedded(),
        tool_calls: ToolCalls {
            rate,
            format: Default::default(),
        },
        reasoning: Reasoning {
            format: ReasoningFormat::Qwen3,
            share,
        },
        length: AnswerLength {
            max_model_len: 2048,
            natural_mean: Some(256),
            seed: 1,
        },
    }
}

/// Issue 22 H6: `tools` with `strict: true` made the frontends send a `triggered_tags`
/// structural tag, which was refused (HTTP 500). As xgrammar reads it: free text with
/// calls where a trigger starts them; `at_least_one` starts with a call;
/// `stop_after_first` ends after one; a tag must begin with a trigger.
#[test]
fn triggered_tags_are_text_with_calls_where_a_trigger_starts_them() {
    let none = PromptTools::default();
    let open = hermes_triggered("f", strict_params(), false, false);
    let call = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"x\"}}\n</tool_call>";
    let g = || tag_grammar(&open, &none);
    assert!(accepts(g(), "just text"));
    assert!(accepts(g(), ""));
    assert!(accepts(g(), &format!("Let me look. {call}")));
    assert!(accepts(g(), &format!("{call} and {call} done")));
    assert!(accepts(
        g(),
        "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"\"}}</tool_call>"
    ));
    // a trigger commits to a call that follows the schema
    assert!(!accepts(g(), "text <tool_call> more text"));
    assert!(!accepts(
        g(),
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"b\": 1}}\n</tool_call>"
    ));
    assert!(!accepts(
        g(),
        "<tool_call>\n{\"name\": \"g\", \"arguments\": {\"a\": \"x\"}}\n</tool_call>"
    ));
    let first = hermes_triggered("f", strict_params(), false, true);
    assert!(accepts(tag_grammar(&first, &none), &format!("hm {call}")));
    assert!(!accepts(
        tag_grammar(&first, &none),
        &format!("{call} more")
    ));
    let required = hermes_triggered("f", strict_params(), true, false);
    assert!(accepts(
        tag_grammar(&required, &none),
        &format!("{call} ok {call}")
    ));
    assert!(!accepts(
        tag_grammar(&required, &none),
        &format!("hm {call}")
    ));
    assert!(!accepts(tag_grammar(&required, &none), "no call"));
    let one = hermes_triggered("f", strict_params(), true, true);
    assert!(accepts(tag_grammar(&one, &none), call));
    assert!(!accepts(tag_grammar(&one, &none), &format!("{call} more")));
    // excluded strings stay out of the free text
    let mut ex = open.clone();
    ex["format"]["excludes"] = json!(["<think>"]);
    assert!(!accepts(tag_grammar(&ex, &none), "a <think> b"));
    assert!(accepts(tag_grammar(&ex, &none), "a <thin b"));
    // the legacy form (`structures` + `triggers`) means the same
    let legacy = json!({"type": "structural_tag", "triggers": ["<tool_call>"],
            "structures": [{"begin": "<tool_call>\n{\"name\": \"f\", \"arguments\": ",
                            "schema": strict_params(), "end": "}\n</tool_call>"}]});
    assert!(accepts(tag_grammar(&legacy, &none), &format!("so {call}")));
    // a tag no trigger starts is refused with the reason
    let mut bad = open.clone();
    bad["format"]["triggers"] = json!(["<call>"]);
    let e = grammar_for(&so(Constraint::StructuralTag(bad.to_string())), &none).unwrap_err();
    assert!(e.contains("none of the triggers"), "{e}");
    // generated: a call whose arguments follow the schema, every time
    for i in 0..20 {
        let (t, end) = run(tag_grammar(&one, &none), &format!("s{i}"), 300);
        assert_eq!(end, End::Eos, "{t}");
        let calls = hermes_calls(&t).unwrap();
        assert_eq!(calls.len(), 1, "{t}");
        assert_eq!(calls[0]["name"], "f");
        assert!(calls[0]["arguments"]["a"].is_string(), "{t}");
    }
}

/// Issue r28: the text a `required` answer under `triggered_tags` may add after its calls
/// (what vllm-rs sends with the qwen3_xml parser) held stray digits and brackets, which
/// clients got as `content` ("]" was seen). It is prose or nothing.
#[test]
fn text_after_required_calls_is_prose() {
    let required = hermes_triggered("f", strict_params(), true, false);
    for i in 0..100 {
        let g = tag_grammar(&required, &PromptTools::default());
        let (t, end) = run(g, &format!("p{i}"), 300);
        assert_eq!(end, End::Eos, "{t}");
        let after = t.rsplit("</tool_call>").next().unwrap_or("");
        let prose = |c: char| c.is_ascii_alphabetic() || c == ' ' || ",.".contains(c);
        assert!(after.chars().all(prose), "{after:?} after the calls: {t}");
    }
}

/// Issue 22 H6: under `tool_choice: auto` the model chooses between text and a call;
/// the engine draws it under `--tool-call-rate`, as it does for tools without `strict`.
/// A call starts the answer and follows the schema; text comes from the token source.
#[test]
fn an_open_triggered_tag_is_a_call_or_text_under_the_tool_call_rate() {
    let vocab = Vocabulary::embedded();
    let tag = hermes_triggered("f", strict_params(), false, false);
    let mut r = tag_req(&tag, 300);
    assert!(
        shaping(0.0, 0.0).plan(&r, 1).unwrap().is_none(),
        "rate 0: text"
    );
    let mut s = shaping(1.0, 0.0)
        .stream_for(&r, 1)
        .unwrap()
        .expect("rate 1: a call");
    let ids: Vec<u32> = (0..300)
        .map(|_| s.next_token(&[]))
        .take_while(|t| *t != vcr_host::tiny_model::EOS_TOKEN_ID)
        .collect();
    let t = vocab.decode(&ids);
    assert!(t.starts_with("<tool_call>"), "{t}");
    assert!(
        hermes_calls(&t).unwrap()[0]["arguments"]["a"].is_string(),
        "{t}"
    );
    // after a tool's result the answer is text
    let answered = PROMPT.replace("user\nhi", "tool\n<tool_response>\n{}\n</tool_response>");
    r.prompt_token_ids = Some(vocab.encode(&answered));
    assert!(shaping(1.0, 0.0).plan(&r, 1).unwrap().is_none());
}

/// Issue 22 H1: a grammar the backend cannot follow (a lexer past its limits, a
/// required recursion) ended the answer with EOS, so it finished as `stop` with "" or
/// "{". It fails, with the backend's reason and the kind.
#[test]
fn a_grammar_the_backend_cannot_follow_fails_with_its_reason() {
    let none = PromptTools::default();
    let rx = grammar_for(&so(Constraint::Regex("a{300000}".into())), &none).unwrap();
    let (text, end) = run(rx, "rx", 50);
    let End::Failed(why) = end else {
        panic!("{end:?}: {text}")
    };
    assert!(
        why.contains("lexer error") && why.contains("after 0 tokens"),
        "{why}"
    );
    assert!(!why.contains("<state>"), "no parser dump: {why}");
    let recursive = r##"{"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}}}"##;
    let g = grammar_for(&so(Constraint::JsonSchema(recursive.into())), &none).unwrap();
    let (text, end) = run(g, "rec", 200);
    assert!(
        matches!(&end, End::Failed(w) if w.contains("parser error")),
        "{end:?}: {text}"
    );
}

/// Issue 22 L14: with `tool_choice: "required"` and a small `max_tokens`, the engine
/// opened a second call it had no room to finish (cut at `length`, unparsable). A
/// further call is opened only when one like the first fits, and open structures close
/// as the budget runs out: at 128 tokens every answer is complete calls.
#[test]
fn tool_calls_near_the_token_limit_end_after_a_complete_call() {
    let tag = json!({"type": "structural_tag", "format": {"type": "tags_with_separator",
            "tags": [{"type": "tag", "begin": "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ",
                      "content": {"type": "json_schema", "json_schema": true}, "end": "}\n</tool_call>"}],
            "separator": "", "at_least_one": true, "stop_after_first": false}});
    let mut complete = 0;
    for i in 0..100 {
        let (t, end) = run(tag_grammar(&tag, &weather_tools()), &format!("l{i}"), 128);
        if end == End::Eos && hermes_calls(&t).is_ok_and(|c| !c.is_empty()) {
            complete += 1;
        } else {
            assert!(
                !t.contains("</tool_call>"),
                "a second call opened without room: {t}"
            );
        }
    }
    assert!(
        complete >= 97,
        "{complete}/100 complete calls at max_tokens 128"
    );
}

/// Issue 22 L1: a structural-tag regex with an escaped slash (`a\/b`) became
/// `a\\/b`, a Lark lexer error (HTTP 500). Only an unescaped `/` gets a backslash.
#[test]
fn a_structural_tag_regex_keeps_its_escaped_slashes() {
    let none = PromptTools::default();
    let rx = json!({"type": "structural_tag", "format": {"type": "regex", "pattern": "a\\/b|c/d"}});
    assert!(accepts(tag_grammar(&rx, &none), "a/b"));
    assert!(accepts(tag_grammar(&rx, &none), "c/d"));
    assert!(!accepts(tag_grammar(&rx, &none), "a\\/b"));
}

/// Issue 22 L2: GBNF rules `a-b` and `a_b` both became `g_a_b` ("duplicate rule",
/// HTTP 500). Names map to Lark without collisions (case included).
#[test]
fn gbnf_rule_names_stay_distinct_in_lark() {
    let g = "root ::= a-b a_b A a\na-b ::= \"x\"\na_b ::= \"y\"\nA ::= [\\/]\na ::= \"z\"\n";
    let lark = gbnf_to_lark(g).unwrap();
    assert!(
        accepts(TopLevelGrammar::from_lark(lark.clone()), "xy/z"),
        "{lark}"
    );
}

/// Issue 22 L3: a tag with `"end": []` generated `<a>x` with no end. It is refused with
/// the reason; an empty string among the ends makes the end optional.
#[test]
fn a_tag_with_an_empty_end_list_is_refused() {
    let none = PromptTools::default();
    let tag = json!({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>",
            "content": {"type": "const_string", "value": "x"}, "end": []}});
    let e = grammar_for(&so(Constraint::StructuralTag(tag.to_string())), &none).unwrap_err();
    assert!(
        e.contains("structural_tag") && e.contains("empty `end` list"),
        "{e}"
    );
    let tag = json!({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>",
            "content": {"type": "const_string", "value": "x"}, "end": ["</a>", ""]}});
    assert!(accepts(tag_grammar(&tag, &none), "<a>x</a>"));
    assert!(accepts(tag_grammar(&tag, &none), "<a>x"));
}

#[test]
fn json_schema_instances_parse_and_follow_the_schema() {
    let schema = json!({
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 3, "maximum": 9000},
            "b": {"enum": ["x", "y"]},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        },
        "required": ["a", "b", "tags"],
    });
    for i in 0..20 {
        let (text, v) = json_instance(&schema, &format!("r{i}"));
        let a = v["a"].as_i64().unwrap();
        assert!((3..=9000).contains(&a), "{text}");
        assert!(["x", "y"].contains(&v["b"].as_str().unwrap()), "{text}");
        assert!(!v["tags"].as_array().unwrap().is_empty(), "{text}");
        assert!(text.len() < 400, "instances stay short: {text}");
    }
}

/// vLLM's default backend (xgrammar, strict) never writes a key an object's schema does not
/// declare, whether or not it says `additionalProperties`; an object that declares no
/// properties takes any keys; the `guidance` backend leaves declared objects open unless
/// the request disables additional properties.
#[test]
fn objects_with_declared_properties_get_no_others_as_xgrammar_writes_them() {
    let schema = json!({
        "type": "object",
        "properties": {"a": {"type": "integer"}, "meta": {"type": "object"}},
        "required": ["a", "meta"],
    });
    let outputs = |backend: Option<&str>, disable: bool| -> Vec<Value> {
        (0..60)
            .map(|i| {
                let mut so = so(Constraint::JsonSchema(schema.to_string()));
                so.backend = backend.map(str::to_string);
                so.disable_additional_properties = disable;
                let g = grammar_for(&so, &PromptTools::default()).unwrap();
                let (text, end) = run(g, &format!("o{i}"), 300);
                assert_eq!(end, End::Eos, "{text}");
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
            })
            .collect()
    };
    let extra = |v: &Value| {
        v.as_object()
            .unwrap()
            .keys()
            .any(|k| k != "a" && k != "meta")
    };
    for (backend, disable) in [
        (Some("xgrammar"), false),
        (None, false),
        (Some("guidance"), true),
    ] {
        let out = outputs(backend, disable);
        assert!(
            !out.iter().any(extra),
            "{backend:?}: {:?}",
            out.iter().find(|v| extra(v))
        );
        assert!(
            out.iter()
                .any(|v| !v["meta"].as_object().unwrap().is_empty()),
            "{backend:?}: an object without declared properties takes keys"
        );
    }
    assert!(outputs(Some("guidance"), false).iter().any(extra));
}

/// A model writes numbers a client's JSON parser reads as finite doubles: an exponent is
/// rare and short.
#[test]
fn numbers_stay_finite_doubles() {
    let schema = json!({"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"]});
    let mut exponents = 0;
    for i in 0..200 {
        let (text, v) = json_instance(&schema, &format!("n{i}"));
        for k in ["x", "y"] {
            assert!(v[k].as_f64().is_some_and(f64::is_finite), "{text}");
        }
        exponents += usize::from(text.contains(['e', 'E']));
    }
    assert!(
        exponents < 20,
        "{exponents} of 200 answers wrote an exponent"
    );
}

/// Parsers read an `integer` into 64 bits (vllm-rs's `qwen3_coder` keeps a longer one as
/// a string), and a model writes short numbers: in the call formats that spell arguments
/// one by one, a number ends only with a newline, which the walker rarely picks.
#[test]
fn integers_are_written_short_enough_for_a_parser_to_read() {
    let params = json!({"type": "object", "properties": {"days": {"type": "integer"}},
        "required": ["days"]});
    let lark = ToolCallFormat::Qwen3Coder.grammar("get_weather", &params);
    let vocab = Vocabulary::embedded();
    let mut longest = 0;
    for i in 0..300 {
        let g = TopLevelGrammar::from_lark(lark.clone());
        let mut s = ConstrainedStream::new(vocab.clone(), g, &req(&format!("n{i}")), 1).unwrap();
        let ids: Vec<u32> = (0..200)
            .map(|_| s.next_token(&[]))
            .take_while(|&t| t != vcr_host::tiny_model::EOS_TOKEN_ID)
            .collect();
        let text = vocab.decode(&ids);
        let days = text
            .split("<parameter=days>\n")
            .nth(1)
            .and_then(|v| v.split("\n</parameter>").next())
            .unwrap_or_else(|| panic!("no days: {text}"));
        assert!(days.parse::<i64>().is_ok(), "not a 64-bit integer: {text}");
        longest = longest.max(days.trim_start_matches('-').len());
    }
    assert!(longest <= 9, "a {longest}-digit number");
}

#[test]
fn regex_choice_grammar_and_json_object() {
    let none = PromptTools::default();
    let (t, ok) = generate(Constraint::Regex("[a-z]+@[a-z]+\\.com".into()), &none, "x");
    assert!(ok && t.ends_with(".com") && t.contains('@'), "{t}");
    let (t, ok) = generate(
        Constraint::Choice(vec!["yes".into(), "no".into()]),
        &none,
        "y",
    );
    assert!(ok && (t == "yes" || t == "no"), "{t}");
    let g = "root ::= \"up\" | \"down\" dir\ndir ::= [a-c]+ # a comment\n";
    let (t, ok) = generate(Constraint::Grammar(g.into()), &none, "z");
    assert!(ok && (t == "up" || t.starts_with("down")), "{t}");
    let (t, ok) = generate(Constraint::JsonObject, &none, "w");
    assert!(
        ok && serde_json::from_str::<serde_json::Map<String, Value>>(&t).is_ok(),
        "{t}"
    );
}

fn weather_tools() -> PromptTools {
    PromptTools {
        tools: vec![Tool {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]}),
        }],
        after_tool_result: false,
    }
}

#[test]
fn a_structural_tag_for_a_required_tool_gives_a_call_with_its_arguments() {
    // what vllm-rs 0.33 sends for tool_choice "required" with the hermes parser
    let tag = json!({"type": "structural_tag", "format": {"type": "tags_with_separator",
            "tags": [{"type": "tag", "begin": "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ",
                      "content": {"type": "json_schema", "json_schema": true, "style": "json"},
                      "end": "}\n</tool_call>"}],
            "separator": "", "at_least_one": true, "stop_after_first": false}});
    let (t, ok) = generate(
        Constraint::StructuralTag(tag.to_string()),
        &weather_tools(),
        "t",
    );
    assert!(ok, "{t}");
    let body = t
        .strip_prefix("<tool_call>\n")
        .and_then(|b| b.split("\n</tool_call>").next())
        .unwrap();
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {t}"));
    assert_eq!(v["name"], "get_weather");
    assert!(
        v["arguments"]["city"].is_string() && v["arguments"]["days"].is_i64(),
        "{t}"
    );
}

#[test]
fn tools_are_read_from_the_prompt_and_auto_calls_follow_the_rate() {
    let prompt = "<|im_start|>system\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}}\n</tools><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    let p = PromptTools::from_prompt(prompt);
    assert_eq!(p.tools.len(), 1);
    assert_eq!(p.tools[0].name, "get_weather");
    assert!(!p.after_tool_result);
    let answered = prompt.replace("user\nhi", "user\n<tool_response>\n{}\n</tool_response>");
    assert!(PromptTools::from_prompt(&answered).after_tool_result);
    let calls = (0..400u64)
        .filter(|s| {
            ToolCalls {
                rate: 0.25,
                format: Default::default(),
            }
            .decide(&p, *s)
            .is_some()
        })
        .count();
    assert!((60..140).contains(&calls), "{calls} of 400 at rate 0.25");
    assert!(
        ToolCalls {
            rate: 1.0,
            format: Default::default()
        }
        .decide(&PromptTools::from_prompt(&answered), 1)
        .is_none()
    );
    let g = ToolCalls {
        rate: 1.0,
        format: Default::default(),
    }
    .decide(&weather_tools(), 3)
    .unwrap();
    let vocab = Vocabulary::embedded();
    let mut s = ConstrainedStream::new(vocab.clone(), g, &req("auto"), 1).unwrap();
    let ids: Vec<u32> = (0..600)
        .map(|_| s.next_token(&[]))
        .take_while(|t| *t != 2)
        .collect();
    let t = vocab.decode(&ids);
    assert!(
        t.starts_with("<tool_call>\n{\"name\": \"get_weather\"") && t.ends_with("}\n</tool_call>"),
        "{t}"
    );
}

#[test]
fn unsupported_kinds_are_named() {
    // token-level formats: the engine's grammars are over text
    let tag = json!({"type": "structural_tag", "format": {"type": "any_tokens"}});
    let e = grammar_for(
        &so(Constraint::StructuralTag(tag.to_string())),
        &PromptTools::default(),
    )
    .unwrap_err();
    assert!(
        e.contains("structural_tag") && e.contains("`any_tokens` is not supported"),
        "{e}"
    );
}

#[test]
fn a_frontends_digit_class_takes_ascii_digits_only() {
    use super::lark::lark_regex;
    assert_eq!(lark_regex(r"\d+:[\d_]\D"), "[0-9]+:[0-9_][^0-9]");
    // everything else passes through as before
    assert_eq!(lark_regex("a/b\\w\n"), "a\\/b\\w\\n");
}
