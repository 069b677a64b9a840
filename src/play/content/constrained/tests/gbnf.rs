//! GBNF and xgrammar EBNF grammars: what xgrammar prints for a JSON schema (ranges,
//! lookaheads, `Regex(…)`) followed, alone and as a structural tag's content.

use super::*;

/// The structural tag vLLM 0.33's Python frontend builds for a Cohere Command model
/// (`Cohere2ForCausalLM`) and one tool, `get_weather(city, days?)`: `triggered_tags` whose
/// content is xgrammar's own EBNF for a JSON array of calls (written by
/// `vllm.parser.cohere_command.convert_schema_to_structural_tags`).
const COHERE_TOOLS_TAG: &str = include_str!("cohere_tools_tag.json");

#[test]
fn a_repetition_range_bounds_its_item() {
    let g = |rule: &str| TopLevelGrammar::from_lark(gbnf_to_lark(rule).unwrap());
    assert!(accepts(g("root ::= [a-z]{2, 3}"), "ab"));
    assert!(accepts(g("root ::= [a-z]{2, 3}"), "abc"));
    assert!(!accepts(g("root ::= [a-z]{2, 3}"), "a"));
    assert!(!accepts(g("root ::= [a-z]{2, 3}"), "abcd"));
    // xgrammar's -1: no upper bound
    assert!(accepts(g("root ::= \"x\" [0-9]{1, -1}"), "x2026"));
    assert!(!accepts(g("root ::= \"x\" [0-9]{1, -1}"), "x"));
    assert!(accepts(g("root ::= \"x\" [0-9]{0, -1}"), "x"));
    let e = gbnf_to_lark("root ::= [a-z]{3, 2}").unwrap_err();
    assert!(e.contains("repetition range"), "{e}");
}

#[test]
fn a_lookahead_and_a_regex_terminal_are_read() {
    let g = gbnf_to_lark(
        "root ::= \"\\\"\" id \"\\\"\" (=([ \\n]* [,}]))\nid ::= Regex(\"^[0-9]+$\", json_string=true)",
    )
    .unwrap();
    let g = || TopLevelGrammar::from_lark(g.clone());
    assert!(accepts(g(), "\"42\""));
    assert!(!accepts(g(), "\"4a\""));
    assert!(!accepts(g(), "\"\""));
}

#[test]
fn xgrammars_grammar_of_a_cohere_call_accepts_the_call_and_nothing_else() {
    let tag: Value = serde_json::from_str(COHERE_TOOLS_TAG).unwrap();
    let g = || tag_grammar(&tag, &PromptTools::default());
    let call = r#"<|START_ACTION|>[
    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris", "days": 3}}
]<|END_ACTION|>"#;
    assert!(accepts(g(), call));
    assert!(accepts(g(), "Let me look that up."));
    // the id is digits, the name the tool's, `city` comes before `days`
    assert!(!accepts(g(), &call.replace("\"0\"", "\"a\"")));
    assert!(!accepts(g(), &call.replace("get_weather", "get_time")));
    assert!(!accepts(
        g(),
        r#"<|START_ACTION|>[{"parameters": {"days": 3, "city": "Paris"}}]<|END_ACTION|>"#
    ));
}

/// The calls of a Cohere action block.
fn cohere_calls(text: &str) -> Vec<Value> {
    let body = text
        .strip_prefix("<|START_ACTION|>")
        .and_then(|t| t.strip_suffix("<|END_ACTION|>"))
        .unwrap_or_else(|| panic!("not one action block: {text}"));
    let calls: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {text}"));
    calls.as_array().cloned().unwrap_or_default()
}

/// The Cohere tag as `tool_choice: required` has it (a call, and nothing after it), for a
/// prompt that shows `tools` (none: [`PROMPT`]).
fn cohere_req(id: &str, tools: &str) -> EngineCoreRequest {
    let mut tag: Value = serde_json::from_str(COHERE_TOOLS_TAG).unwrap();
    tag["format"]["at_least_one"] = json!(true);
    tag["format"]["stop_after_first"] = json!(true);
    let mut r = tag_req(&tag, 600);
    r.request_id = id.into();
    let prompt = PROMPT.replace(
        "user\nhi",
        &format!("system\n<tools>\n{tools}\n</tools><|im_end|>\n<|im_start|>user\nhi"),
    );
    r.prompt_token_ids = Some(Vocabulary::embedded().encode(&prompt));
    r
}

/// The answer the engine writes for `r` with `--tool-call-format format`.
fn answer(r: &EngineCoreRequest, format: ToolCallFormat) -> String {
    let mut shaping = shaping(0.5, 0.0);
    shaping.tool_calls.format = format;
    let s = shaping.stream_for(r, 1).unwrap().expect("a grammar");
    let (text, end) = drain(s, 600);
    assert_eq!(end, End::Eos, "{text}");
    text
}

const GET_WEATHER: &str = r#"{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}"#;

#[test]
fn a_cohere_call_is_written_as_command_a_writes_it_when_the_prompt_shows_the_tool() {
    let tag: Value = serde_json::from_str(COHERE_TOOLS_TAG).unwrap();
    for id in ["c-0", "c-1", "c-2"] {
        let text = answer(&cohere_req(id, GET_WEATHER), ToolCallFormat::CohereCommand3);
        assert!(text.starts_with("<|START_ACTION|>[\n    {\"tool_call_id\": \"0\", \"tool_name\": \"get_weather\", \"parameters\": {"), "{text}");
        let calls = cohere_calls(&text);
        assert_eq!(calls.len(), 1, "{text}");
        assert!(calls[0]["parameters"]["city"].is_string(), "{text}");
        // what the frontend's grammar admits
        assert!(
            accepts(tag_grammar(&tag, &PromptTools::default()), &text),
            "{text}"
        );
    }
}

#[test]
fn a_cohere_call_follows_the_grammar_alone_in_another_format_or_without_the_tools() {
    for id in ["c-0", "c-1", "c-2"] {
        for (r, format) in [
            (cohere_req(id, GET_WEATHER), ToolCallFormat::Hermes),
            (cohere_req(id, ""), ToolCallFormat::CohereCommand3),
        ] {
            // every key is optional in xgrammar's rendering: valid, if terse
            let text = answer(&r, format);
            assert!(!cohere_calls(&text).is_empty(), "{text}");
        }
    }
}

#[test]
fn a_malformed_grammar_is_an_error_not_a_panic() {
    for g in [
        "root ::= x{",
        "root ::= x{1,",
        "root ::= x{a, b}",
        "root ::= x{-2, 3}",
        "",
    ] {
        assert!(gbnf_to_lark(g).is_err(), "{g:?}");
    }
    for g in [
        "root ::= x{",
        "root ::= x{1,",
        "root ::= x{a, b}",
        "root ::= x{-2, 3}",
        "root ::= (= \"a\"",
        "root ::= Regex(",
        "root ::= Regex(\"[0-9\"",
        "root ::= Regex(\"unterminated",
        "root ::= \"a\" )) ((",
        "root ::= [\\",
        "root ::= \"\\",
        "::=",
        "",
        "root",
    ] {
        // whatever the converter makes of it, llguidance then refuses it or follows it
        if let Ok(lark) = gbnf_to_lark(g) {
            let _ = Vocabulary::embedded()
                .factory(Specials::Apart)
                .create_parser(TopLevelGrammar::from_lark(lark));
        }
    }
}
