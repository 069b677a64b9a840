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

/// The tag as `tool_choice: required` has it: a call, and nothing after it.
fn required(tag: &str) -> Constraint {
    let mut tag: Value = serde_json::from_str(tag).unwrap();
    tag["format"]["at_least_one"] = json!(true);
    tag["format"]["stop_after_first"] = json!(true);
    Constraint::StructuralTag(tag.to_string())
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

#[test]
fn a_cohere_call_is_written_as_command_a_writes_it_when_the_prompt_shows_the_tool() {
    let tools = PromptTools {
        tools: vec![Tool {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"},
                "days": {"type": "integer"}}, "required": ["city"]}),
        }],
        after_tool_result: false,
    };
    let tag: Value = serde_json::from_str(COHERE_TOOLS_TAG).unwrap();
    for id in ["c-0", "c-1", "c-2"] {
        let (text, stopped) = generate(required(COHERE_TOOLS_TAG), &tools, id);
        assert!(stopped, "{text}");
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
fn a_cohere_call_follows_the_grammar_alone_when_the_prompt_shows_no_tools() {
    for id in ["c-0", "c-1", "c-2"] {
        let (text, stopped) = generate(required(COHERE_TOOLS_TAG), &PromptTools::default(), id);
        assert!(stopped, "{text}");
        // every key is optional in xgrammar's rendering: valid, if terse
        assert!(!cohere_calls(&text).is_empty(), "{text}");
    }
}
