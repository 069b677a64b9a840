//! Tool calls and thinking in every format the engine writes (`--tool-call-format`,
//! `--reasoning-format`), read by the frontends' own parsers: vllm-rs's through `serve`
//! for the formats it has a parser of (its `tool_calls`), the Python frontend's parser
//! classes on the raw text of every format (`tests/clients/parsers_check.py`), and one
//! Python frontend serving a Qwen3 stand-in (`qwen3_xml` calls and `qwen3` thinking), with
//! `reasoning` and its token count in the answer.

use serde_json::{Value, json};

use super::*;
use crate::support::vllm_python;

/// The tool formats, and whether vllm-rs 0.33 has their parser (it then serves
/// `tool_choice: required` with them too, as a structural tag in the format).
const TOOL_FORMATS: &[(&str, bool)] = &[
    ("hermes", true),
    ("qwen3_xml", true),
    ("qwen3_coder", true),
    ("glm45", true),
    ("kimi_k2", true),
    ("internlm", true),
    ("phi4_mini_json", true),
    ("pythonic", false),
    ("llama4_pythonic", false),
    ("granite", false),
    ("xlam", false),
    ("seed_oss", true),
    ("minimax_m2", true),
    ("mimo", true),
    ("dots", false),
    ("step3", false),
    ("longcat", false),
    ("hunyuan_a13b", false),
    ("granite-20b-fc", false),
    ("gigachat3", false),
    ("apertus", false),
    ("olmo3", false),
    ("functiongemma", false),
    ("deepseek_v32", true),
    ("deepseek_v4", true),
    ("deepseek_v41", true),
    ("minimax_m3", true),
    ("plamo3", false),
    // vllm-rs's inkling parser needs its markers as tokens (the marker-token test below)
    ("inkling", false),
    // and so does its muse parser
    ("muse", false),
    ("muse_glimmer", false),
    // vllm-rs's gemma4 parser needs its markers as tokens (the marker-token test below)
    ("gemma4", false),
    // read by `cohere_melody` inside the Python frontend's Cohere Command parser
    ("cohere_command3", false),
    ("cohere_command4", false),
    ("kimi_k3", false),
    ("k2_horizon", false),
    ("minicpm5", false),
    // read with the embedded model's response_template (vllm-rs: `template_parsers.rs`)
    ("hf", false),
    ("beam", false),
];

/// Tool parsers that read a format above under another name (`ALIASES` in
/// `constrained/formats.rs`): the Python frontend's parser of that name reads its raw text.
const TOOL_ALIASES: &[(&str, &str)] = &[
    ("ernie45", "hermes"),
    ("step3p5", "qwen3_coder"),
    ("step5", "qwen3_coder"),
    ("ling3", "glm45"),
    ("poolside_v1", "glm45"),
    ("musespark1x", "muse"),
];

/// Reasoning parsers that read a format above under another name.
const REASONING_ALIASES: &[(&str, &str)] = &[
    ("ling3", "glm45"),
    ("muse_glimmer", "muse"),
    ("granite_thinking_parser", "nemotron_v3"),
    ("minicpmv", "qwen3"),
];

/// The reasoning formats whose Python parsers start with the embedded byte-level
/// tokenizer (each rides along on a tool format vllm-rs does not parse; vllm-rs's parsers
/// of them look `<think>` up as a token).
const REASONING_FORMATS: &[&str] = &[
    "qwen3",
    "glm45",
    "kimi_k2",
    "granite",
    "seed_oss",
    "minimax_m2",
    "step3p5",
    "mimo",
    "nemotron_v3",
    "hunyuan_a13b",
    "deepseek_v4",
    "gemma4",
    "plamo3",
    "inkling",
    "muse",
    "cohere_command3",
    "cohere_command4",
    "minimax_m2_append_think",
    "kimi_k3",
    "hf",
    "beam",
];

pub(super) fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"]}}}
    ])
}

/// The prompt the embedded chat template renders for a user's question with [`tools`]: a
/// completion of it is the engine's raw answer, no parser between.
fn prompt_with_tools() -> String {
    let lines: Vec<String> = tools()
        .as_array()
        .unwrap()
        .iter()
        .map(Value::to_string)
        .collect();
    format!(
        "<|im_start|>system\n<tools>\n{}\n</tools><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n",
        lines.join("\n")
    )
}

/// A call is to one of [`tools`], its arguments JSON valid for that tool's schema.
fn assert_call(name: &str, arguments: &str, label: &str) {
    let args: Value = serde_json::from_str(arguments)
        .unwrap_or_else(|e| panic!("{label}: arguments are not JSON ({e}): {arguments}"));
    let obj = args
        .as_object()
        .unwrap_or_else(|| panic!("{label}: arguments are not an object: {args}"));
    match name {
        "get_weather" => assert!(
            // an integer in JSON Schema's sense: `-0` is one (serde_json reads it as -0.0)
            obj.len() == 2
                && args["city"].is_string()
                && args["days"].as_f64().is_some_and(|d| d.fract() == 0.0),
            "{label}: get_weather({args})"
        ),
        "get_time" => assert!(
            obj.len() == 1 && ["UTC", "CET"].contains(&args["tz"].as_str().unwrap_or("")),
            "{label}: get_time({args})"
        ),
        other => panic!("{label}: a call to {other}, which is no tool of the request"),
    }
}

/// `content` beside tool calls: absent, or prose (under `required` the frontends' tags let
/// text follow the calls), with no markup of the format left in it: no brackets, braces,
/// tags or pipes (the prose's own punctuation includes quotes: `" slowly` was seen).
fn assert_no_markup(content: &Value, label: &str) {
    let text = content.as_str().unwrap_or("");
    assert!(
        text.chars()
            .all(|c| c.is_alphanumeric() || c.is_whitespace() || ",.;:!?'\"-".contains(c)),
        "{label}: markup in the content beside the calls: {content}"
    );
}

/// A chat completion with [`tools`] under `tool_choice`; the answer's message.
pub(super) fn chat_with_tools(port: u16, tool_choice: &str, label: &str) -> Value {
    // room for a few calls (their markers are a token a byte in the embedded vocabulary)
    let body = json!({"model": "tiny", "max_tokens": 800, "tools": tools(),
        "tool_choice": tool_choice,
        "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    let (status, answer) = http_post_json(port, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{label} {tool_choice}: {answer}");
    assert_eq!(
        answer["choices"][0]["finish_reason"], "tool_calls",
        "{label} {tool_choice}: {answer}"
    );
    answer["choices"][0]["message"].clone()
}

/// The message's calls are parsed, to the tools, with valid arguments, and nothing else.
pub(super) fn assert_parsed_calls(message: &Value, label: &str) {
    let calls = message["tool_calls"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(!calls.is_empty(), "{label}: no tool_calls: {message}");
    for c in &calls {
        let f = &c["function"];
        assert_call(
            f["name"].as_str().unwrap_or(""),
            f["arguments"].as_str().unwrap_or(""),
            label,
        );
    }
    assert_no_markup(&message["content"], label);
}

/// The raw text of a completion.
fn complete(port: u16, prompt: &str, max_tokens: u32, label: &str) -> String {
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens});
    let (status, answer) = http_post_json(port, "/v1/completions", &body);
    assert_eq!(status, 200, "{label}: {answer}");
    answer["choices"][0]["text"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// `serve` (vllm-rs) writing `format` calls (always, where the prompt shows tools) and
/// `reasoning` thinking, serving `own_model` if given; `parses`: whether vllm-rs parses
/// them, else its parsing is off and the raw text is what the test checks.
fn serve_writing(
    own_model: Option<&str>,
    format: &str,
    reasoning: Option<&str>,
    parses: bool,
) -> Serve {
    let mut flags = Vec::new();
    if let Some(m) = own_model {
        flags.extend(["--model", m, "--served-model-name", "tiny"]);
    }
    flags.extend(["--tool-call-rate", "1", "--tool-call-format", format]);
    if let Some(r) = reasoning {
        flags.extend(["--reasoning-format", r, "--reasoning-share", "0.5"]);
    }
    if !parses {
        flags.extend(["--", "--tool-call-parser", "none"]);
        flags.extend(["--reasoning-parser", "none"]);
    }
    let mut serve = Serve::start(&flags);
    serve.wait_ready();
    serve
}

/// Raw answers of `serve` (completions: no parser between) for the Python frontend's
/// parsers: `calls` answers to a prompt with tools, and a thinking one when `reasoning`
/// is on.
fn raw_cases(
    serve: &Serve,
    format: &str,
    reasoning: Option<&str>,
    calls: usize,
    cases: &mut Vec<Value>,
) {
    for n in 0..calls {
        // room for the longest call (Step-3's markers are 3 bytes a character)
        let text = complete(serve.port, &prompt_with_tools(), 500, format);
        cases.push(json!({"label": format!("{format} #{n}"), "tools": tools(),
            "text": text, "tool_parser": format}));
    }
    if let Some(r) = reasoning {
        let text = complete(serve.port, "Hello", 240, r);
        cases.push(json!({"label": format!("{r} ({format})"), "tools": [],
            "text": text, "reasoning_parser": r}));
    }
}

/// Every tool format through vllm-rs 0.33 (one quick start each): its own parser where it
/// has one (`auto` and `required`), and the raw text of every format
/// and every thinking format read by the Python frontend's parser classes.
#[test]
fn every_format_reaches_clients_parsed_by_the_frontends_parsers() {
    let mut cases = Vec::new();
    let mut riders = REASONING_FORMATS.iter().copied().cycle();
    for &(format, rs_parses) in TOOL_FORMATS {
        // a thinking format rides along on the formats vllm-rs does not parse (the raw
        // text is what is checked then)
        let reasoning = if rs_parses { None } else { riders.next() };
        let serve = serve_writing(None, format, reasoning, rs_parses);
        let label = format!("vllm-rs {format}");
        if rs_parses {
            for choice in ["auto", "required"] {
                assert_parsed_calls(&chat_with_tools(serve.port, choice, &label), &label);
            }
        }
        raw_cases(&serve, format, reasoning, 2, &mut cases);
    }
    let covered: Vec<&str> = cases
        .iter()
        .filter_map(|c| c["reasoning_parser"].as_str())
        .collect();
    assert!(
        REASONING_FORMATS.iter().all(|r| covered.contains(r)),
        "{covered:?}"
    );
    cases.extend(alias_cases(&cases, "tool_parser", TOOL_ALIASES));
    cases.extend(alias_cases(&cases, "reasoning_parser", REASONING_ALIASES));

    let model = TestDir::new("parsers-model");
    vllm_vcr::tiny_model::write_to(model.root()).unwrap();
    assert_read_back(&cases, model.root());
}

/// The cases of each aliased parser (`key`: `tool_parser` or `reasoning_parser`) again,
/// read by the parser of the alias's name.
fn alias_cases(cases: &[Value], key: &str, aliases: &[(&str, &str)]) -> Vec<Value> {
    let mut more = Vec::new();
    for (alias, format) in aliases {
        let of_format = cases.iter().filter(|c| c[key] == *format);
        for c in of_format {
            let mut c = c.clone();
            c["label"] = json!(format!("{} as {alias}", c["label"].as_str().unwrap_or("")));
            c[key] = json!(alias);
            more.push(c);
        }
    }
    assert!(
        aliases
            .iter()
            .all(|(a, _)| more.iter().any(|c| c[key] == *a)),
        "an alias without a case of its format: {aliases:?}"
    );
    more
}

/// The Python frontend's parsers read each case as the engine meant it: one call to a
/// tool with valid arguments and no content, or thinking and content split.
fn assert_read_back(cases: &[Value], model: &std::path::Path) {
    for answer in python_parsers(cases, model) {
        let label = answer["label"].as_str().unwrap_or("?").to_string();
        assert!(answer.get("error").is_none(), "{label}: {answer}");
        let case = cases.iter().find(|c| c["label"] == label).unwrap();
        if case.get("tool_parser").is_some() {
            let calls = answer["calls"].as_array().cloned().unwrap_or_default();
            assert_eq!(calls.len(), 1, "{label}: {answer} from {}", case["text"]);
            assert_call(
                calls[0]["name"].as_str().unwrap_or(""),
                calls[0]["arguments"].as_str().unwrap_or(""),
                &label,
            );
            assert_no_markup(&answer["content"], &label);
        } else if case["reasoning_parser"] == "minimax_m2_append_think" {
            // this parser splits nothing: the client gets the whole answer as content,
            // the thinking block in it whole with the opening tag the model never writes
            let content = answer["content"].as_str().unwrap_or("");
            let (thinking, rest) = content.split_once("\n</think>\n\n").unwrap_or(("", ""));
            assert!(answer["reasoning"].is_null(), "{label}: {answer}");
            assert!(
                thinking.len() > 10 && thinking.starts_with("<think>") && rest.trim().len() > 4,
                "{label}: {answer}"
            );
            assert_eq!(content.matches("think>").count(), 2, "{label}: {answer}");
        } else {
            // the thinking is half the answer (120 of 240 tokens, tags included: room for
            // Inkling's 80 bytes of them, one token a byte), the rest is content without the
            // format's markers
            let reasoning = answer["reasoning"].as_str().unwrap_or("");
            let content = answer["content"].as_str().unwrap_or("");
            assert!(reasoning.trim().len() > 4, "{label}: {answer}");
            assert!(content.trim().len() > 4, "{label}: {answer}");
            // `|>` ends Gemma 4's and PLaMo 3's markers
            for marker in ["think>", "thought process", "my response", "|>"] {
                assert!(!content.contains(marker), "{label}: {answer}");
            }
        }
    }
}

/// The cases read by the Python frontend's parsers (the cached vLLM 0.33.0 venv) with the
/// tokenizer of `model`: one answer per case.
fn python_parsers(cases: &[Value], model: &std::path::Path) -> Vec<Value> {
    let python = vllm_python("the Python frontend's parsers read the engine's formats");
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/clients/parsers_check.py"
    );
    let mut child = Command::new(python)
        .args([script, model.to_str().unwrap()])
        .env("HF_HUB_OFFLINE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        for c in cases {
            writeln!(stdin, "{c}").unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let answers: Vec<Value> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(
        out.status.success() && answers.len() == cases.len(),
        "parsers_check.py: {} answers of {}:\n{stdout}\n{}",
        answers.len(),
        cases.len(),
        String::from_utf8_lossy(&out.stderr)
    );
    answers
}

/// A Qwen3 stand-in behind the Python frontend: `qwen3_xml` calls and `qwen3` thinking,
/// parsed by the frontend started with the parsers `serve` chose for them.
#[test]
fn a_qwen3_stand_in_behind_the_python_frontend_gives_parsed_calls_and_reasoning() {
    let python = PythonFrontend::of("vllm", "0.33.0");
    let mut serve = Serve::start(&python.with(&[
        "--tool-call-rate",
        "1",
        "--tool-call-format",
        "qwen3_xml",
        "--reasoning-format",
        "qwen3",
        "--reasoning-share",
        "0.5",
    ]));
    serve.wait_ready();
    let label = "python qwen3_xml";
    for choice in ["auto", "auto", "required"] {
        assert_parsed_calls(&chat_with_tools(serve.port, choice, label), label);
    }
    assert_thinking_parsed(serve.port, label);
}

/// A chat answer of 80 tokens thinks half of them: `reasoning` (`reasoning_content` on
/// older lines) holds the thinking, `content` the rest without tags, and usage counts all
/// 80 with the thinking among them.
pub(super) fn assert_thinking_parsed(port: u16, label: &str) {
    let body = json!({"model": "tiny", "max_tokens": 80,
        "messages": [{"role": "user", "content": "Hello"}]});
    let (status, answer) = http_post_json(port, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{label}: {answer}");
    let message = &answer["choices"][0]["message"];
    let reasoning = reasoning_of(message);
    let content = message["content"].as_str().unwrap_or("");
    assert!(
        reasoning.trim().len() > 4,
        "{label}: no reasoning: {answer}"
    );
    assert!(
        content.trim().len() > 4 && !content.contains("think>"),
        "{label}: {answer}"
    );
    let usage = &answer["usage"];
    assert_eq!(usage["completion_tokens"], 80, "{label}: {answer}");
    let thinking = usage["completion_tokens_details"]["reasoning_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!((10..=40).contains(&thinking), "{label}: {answer}");
}

/// The thinking a frontend's reasoning parser took out of an answer: `reasoning`
/// (`reasoning_content` on older lines).
pub(super) fn reasoning_of(message: &Value) -> &str {
    message["reasoning"]
        .as_str()
        .or(message["reasoning_content"].as_str())
        .unwrap_or("")
}

/// A `required` answer behind a reasoning parser thinks before its calls: the frontend
/// parses the block out, prose without its tags, of its share of the answer: half of the
/// 800 tokens (`--reasoning-share 0.5`), its two tags among them, one token a byte.
pub(super) fn assert_required_thinks(message: &Value, label: &str) {
    let reasoning = reasoning_of(message);
    assert!(
        (300..=400).contains(&reasoning.trim().len()) && !reasoning.contains("think>"),
        "{label}: the thinking before a required call: {message}"
    );
}

/// What vllm-rs cannot parse with the embedded model is refused before anything starts,
/// with the way out, rather than a frontend that exits or fails every request.
#[test]
fn formats_vllm_rs_cannot_parse_are_refused_with_the_way_out() {
    for (flags, says) in [
        (
            ["--tool-call-format", "pythonic"],
            "no `pythonic` tool-call parser",
        ),
        (
            ["--reasoning-format", "qwen3"],
            "needs `<think>` as one token",
        ),
    ] {
        let port = free_port().to_string();
        let out = vcr().args(["serve", "--port", &port]).args(flags).output();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(says) && err.contains("--frontend python"),
            "{err}"
        );
        assert!(!err.contains("starting the frontend"), "{err}");
    }
}

/// The markers the llama3_json, mistral, deepseek_v3, deepseek_v31, jamba and lfm2 tool
/// parsers, the deepseek_r1, ernie45, step3 and mistral reasoning parsers and vllm-rs's
/// gemma4, inkling and muse parsers (calls and thinking in one) look up as single tokens.
const MARKERS: &[&str] = &[
    "<think>",
    "</think>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[THINK]",
    "[/THINK]",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<tool_calls>",
    "</tool_calls>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<seed:think>",
    "</seed:think>",
    "<|channel>",
    "<channel|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|message_model|>",
    "<|content_text|>",
    "<|content_thinking|>",
    "<|content_invoke_tool_json|>",
    "<|end_message|>",
    "<|start|>",
    "<|message|>",
    "<|eom|>",
    "<|eot|>",
    "<mm:think>",
    "</mm:think>",
    // Poolside's reasoning parser (DeepSeek-V3's) looks up its turn's start
    "<assistant>",
    "<ifm|think>",
    "</ifm|think>",
    // gpt-oss's harmony (its parser reads them as ids of its own vocabulary: the check
    // re-encodes the text)
    "<|channel|>",
    "<|constrain|>",
    "<|call|>",
    "<|end|>",
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "<|end_of_msg|>",
];

/// A model of one's own whose tokenizer has `markers`: the embedded one with them added
/// (not special, so answers keep them) after its 259 tokens.
pub(super) fn model_with_markers(dir: &TestDir, markers: &[&str]) {
    vllm_vcr::tiny_model::write_to(dir.root()).unwrap();
    let path = dir.path("tokenizer.json");
    let mut t: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let added = t["added_tokens"].as_array_mut().unwrap();
    let first = vllm_vcr::tiny_model::TOKENIZER_VOCAB as usize;
    for (i, m) in markers.iter().enumerate() {
        added.push(json!({"id": first + i, "content": m, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": false}));
    }
    std::fs::write(&path, t.to_string()).unwrap();
}

/// The markers vllm-rs's `hy_v3` and `hy_v4` parsers read with.
const HY_MARKERS: &[&str] = &[
    "<think>",
    "</think>",
    "<tool_calls>",
    "</tool_calls>",
    "<tool_call>",
    "</tool_call>",
    "<tool_sep>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
];

/// The embedded model with [`OLMO3_PIECES`] in its vocabulary (a model of its own: beside
/// the markers, the engine's grammar backend stalled on DeepSeek-V3's calls).
fn model_with_olmo3_pieces(dir: &TestDir) {
    vllm_vcr::tiny_model::write_to(dir.root()).unwrap();
    let path = dir.path("tokenizer.json");
    let mut t: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let first = vllm_vcr::tiny_model::TOKENIZER_VOCAB as usize;
    let vocab = t["model"]["vocab"].as_object_mut().unwrap();
    for (i, piece) in OLMO3_PIECES.iter().enumerate() {
        vocab.insert(piece.to_string(), json!(first + i));
    }
    std::fs::write(&path, t.to_string()).unwrap();
}

/// The pieces of `</think>` OLMo 3's reasoning parser looks up (`>` is a byte's token).
const OLMO3_PIECES: &[&str] = &["Ġ</", "</", "think"];

/// The formats whose parsers need marker tokens, with a model that has them
/// (`serve --model DIR`): llama3_json, deepseek_v3 and deepseek_v31 calls and deepseek_r1
/// thinking parsed by vllm-rs, and the raw text of those and of mistral's, jamba's and
/// lfm2's calls and mistral's, ernie45's, step3's, minimax_m3's and olmo3's thinking read
/// by the Python frontend's parsers. Behind a reasoning parser (deepseek_r1, and qwen3
/// beside qwen3_xml calls, which needs `<think>` as a token), vllm-rs opens the tag of
/// `tool_choice: required` with a think block of free text: the answer thinks, then calls,
/// and both reach the client parsed. vllm-rs's seed_oss, minimax_m2, mimo, step3p5,
/// nemotron_v3 and deepseek_v4 reasoning parsers split a chat answer's thinking beside
/// their families' calls (their `required` tags open with no think block), and its gemma4,
/// inkling and muse parsers read their families' calls and thinking together.
#[test]
fn formats_whose_parsers_need_marker_tokens_work_with_a_model_that_has_them() {
    let dir = TestDir::new("parsers-markers");
    model_with_markers(&dir, MARKERS);
    let model = dir.root().to_str().unwrap();
    let mut cases = Vec::new();
    // (format, reasoning format, whether vllm-rs parses them, whether its tag of `required`
    // opens with a think block: `None` where `required` is not checked beside thinking)
    for (format, reasoning, rs_parses, required_thinks) in [
        ("llama3_json", None, true, Some(false)),
        ("deepseek_v3", Some("deepseek_r1"), true, Some(true)),
        ("qwen3_xml", Some("qwen3"), true, Some(true)),
        ("mistral", Some("mistral"), false, Some(false)),
        ("deepseek_v31", None, true, Some(false)),
        ("jamba", Some("ernie45"), false, Some(false)),
        ("lfm2", Some("step3"), false, Some(false)),
        // vllm-rs's reasoning parsers of these families, beside their calls
        ("seed_oss", Some("seed_oss"), true, Some(false)),
        ("minimax_m2", Some("minimax_m2"), true, Some(true)),
        ("mimo", Some("mimo"), true, Some(false)),
        ("qwen3_coder", Some("step3p5"), true, Some(false)),
        ("hermes", Some("nemotron_v3"), true, Some(false)),
        ("deepseek_v4", Some("deepseek_v4"), true, Some(false)),
        // vllm-rs reads Gemma 4's calls and thinking with one parser
        ("gemma4", Some("gemma4"), true, Some(false)),
        ("inkling", Some("inkling"), true, Some(false)),
        ("muse", Some("muse"), true, Some(false)),
        // MiniMax-M3's thinking, read by the Python frontend's parser
        ("minimax_m3", Some("minimax_m3"), false, Some(false)),
        // and K2 Horizon's
        ("hunyuan_a13b", Some("k2_horizon"), false, Some(false)),
        // Hunyuan's calls, read by the Python frontend's parsers
        ("hy_v3", None, false, Some(false)),
        ("hy_v4", None, false, Some(false)),
        // vllm-rs reads Kimi K3's calls and thinking with one parser; its tag of
        // `required` opens with a think block, then a `star` of argument blocks
        ("kimi_k3", Some("kimi_k3"), true, Some(true)),
        // gpt-oss's harmony calls and thinking
        ("openai", Some("openai_gptoss"), false, Some(false)),
    ] {
        let serve = serve_writing(Some(model), format, reasoning, rs_parses);
        let label = format!("vllm-rs {format} (own model)");
        if rs_parses {
            assert_parsed_calls(&chat_with_tools(serve.port, "auto", &label), &label);
            if let Some(thinks) = required_thinks {
                let message = chat_with_tools(serve.port, "required", &label);
                assert_parsed_calls(&message, &label);
                if thinks {
                    assert_required_thinks(&message, &label);
                }
            }
            if reasoning.is_some() {
                assert_thinking_parsed(serve.port, &label);
            }
        }
        raw_cases(&serve, format, reasoning, 1, &mut cases);
    }
    // DeepSeek-R1's thinking read by the parsers that are DeepSeek-R1's under other names;
    // DeepSeek-V3's reads it when the request turns thinking on, as a client of a V3.1
    // deployment does
    let mut more = alias_cases(
        &cases,
        "reasoning_parser",
        &[
            ("step5", "deepseek_r1"),
            ("holo2", "deepseek_r1"),
            ("deepseek_v3", "deepseek_r1"),
            ("poolside_v1", "deepseek_r1"),
            ("hy_v3", "deepseek_r1"),
            ("hy_v4", "deepseek_r1"),
        ],
    );
    // Hunyuan V3's parser splits thinking only at a `reasoning_effort` the request names
    // (its default is `no_think`)
    for c in &mut more {
        match c["reasoning_parser"].as_str() {
            Some("deepseek_v3" | "poolside_v1") => {
                c["chat_template_kwargs"] = json!({"thinking": true})
            }
            Some("hy_v3") => c["chat_template_kwargs"] = json!({"reasoning_effort": "high"}),
            _ => {}
        }
    }
    cases.extend(more);
    assert_read_back(&cases, dir.root());

    // vllm-rs's Hunyuan parsers read calls and thinking together (the user names both, as
    // the engine's thinking for them is DeepSeek-R1's text), with their own markers as
    // tokens (a model of their own: `<tool_call>` as a token is not Hermes's test here)
    let hy = TestDir::new("parsers-hy");
    model_with_markers(&hy, HY_MARKERS);
    let hy_model = hy.root().to_str().unwrap();
    for name in ["hy_v3", "hy_v4"] {
        let mut serve = Serve::start(&[
            "--model",
            hy_model,
            "--served-model-name",
            "tiny",
            "--tool-call-rate",
            "1",
            "--reasoning-share",
            "0.5",
            "--",
            "--tool-call-parser",
            name,
            "--reasoning-parser",
            name,
        ]);
        serve.wait_ready();
        let label = format!("vllm-rs {name} (own model)");
        assert_parsed_calls(&chat_with_tools(serve.port, "auto", &label), &label);
        // its tag of `required` opens with a think block and writes each value as free
        // text that `</arg_value>` ends
        let message = chat_with_tools(serve.port, "required", &label);
        assert_parsed_calls(&message, &label);
        assert_required_thinks(&message, &label);
        assert_thinking_parsed(serve.port, &label);
    }

    // OLMo 3's thinking parser (the Python frontend's only) with a vocabulary that has the
    // pieces of `</think>` it looks up
    let olmo = TestDir::new("parsers-olmo3");
    model_with_olmo3_pieces(&olmo);
    let serve = serve_writing(olmo.root().to_str(), "olmo3", Some("olmo3"), false);
    let mut cases = Vec::new();
    raw_cases(&serve, "olmo3", Some("olmo3"), 1, &mut cases);
    assert_read_back(&cases, olmo.root());
}
