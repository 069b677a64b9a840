//! Which tool-call and reasoning parsers `serve` starts the frontend with, and the formats
//! the engine writes for them: the engine's `--tool-call-format` / `--reasoning-format`
//! name the parser that reads them, and a parser the user passes after `--` picks the
//! engine's format when the engine knows it.

use std::path::Path;

use anyhow::{Result, bail};

use crate::play::PlayArgs;
use crate::play::content::constrained::{BEAM_MARKERS, ToolCallFormat};
use crate::play::content::reasoning::ReasoningFormat;

/// What the frontend is started with, beyond the user's own arguments.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Parsing {
    /// Tool-calling flags (`--enable-auto-tool-choice --tool-call-parser P`), or none.
    pub tools: Vec<&'static str>,
    /// The `--reasoning-parser` serve passes; `None` when the user passes their own.
    pub reasoning: Option<&'static str>,
}

/// Tool parsers vllm-rs (0.33) does not have: the Python frontend's only.
const PYTHON_ONLY_TOOL_PARSERS: &[&str] = &[
    "pythonic",
    "llama4_pythonic",
    "granite",
    "xlam",
    "dots",
    "step3",
    "longcat",
    "hunyuan_a13b",
    "jamba",
    "granite-20b-fc",
    "gigachat3",
    "apertus",
    "olmo3",
    "lfm2",
    "functiongemma",
    "plamo3",
    "muse_glimmer",
    "cohere_command3",
    "cohere_command4",
    "k2_horizon",
    "minicpm5",
];

/// vllm-rs's parsers that read a family's calls and thinking together (one name for
/// both kinds), and the markers each looks up as single tokens.
pub(crate) const UNIFIED_PARSERS: &[(&str, &[&str])] = &[
    (
        "gemma4",
        &["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>"],
    ),
    (
        "inkling",
        &[
            "<|message_model|>",
            "<|content_text|>",
            "<|content_thinking|>",
            "<|content_invoke_tool_json|>",
            "<|end_message|>",
        ],
    ),
    ("muse", &["<|start|>", "<|message|>", "<|eom|>", "<|eot|>"]),
    (
        "kimi_k3",
        &["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"],
    ),
    ("hy_v3", HY_TOKENS),
    ("hy_v4", HY_TOKENS),
    // reads the model's response_template: no token of its own
    ("hf", &[]),
];

/// The markers vllm-rs's Hunyuan parsers were seen to read with (`<tool_call>` is the first
/// they ask for).
const HY_TOKENS: &[&str] = &[
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

/// Reasoning parsers vllm-rs (0.33) does not have: the Python frontend's only.
const PYTHON_ONLY_REASONING_PARSERS: &[&str] = &[
    "olmo3",
    "plamo3",
    "cohere_command3",
    "cohere_command4",
    "minimax_m2_append_think",
    "k2_horizon",
];

impl Parsing {
    /// Refuses, before anything starts, the parsers serve chose that vllm-rs cannot run:
    /// a tool parser it does not have (it would exit at start), and, for the embedded
    /// model, a reasoning parser (its qwen3, glm45 and kimi_k2 parsers look `<think>` up as
    /// one token, which the byte-level tokenizer lacks, and fail every chat request).
    pub(super) fn check_vllm_rs(&self, model: Option<&Path>) -> Result<()> {
        let embedded_model = model.is_none();
        if let Some(p) = self
            .tools
            .get(2)
            .filter(|p| PYTHON_ONLY_TOOL_PARSERS.contains(p))
        {
            bail!(
                "vllm-rs has no `{p}` tool-call parser: serve it with --frontend python (or pass `-- --tool-call-parser none` to get the calls as raw text)"
            );
        }
        if let Some(r) = self
            .reasoning
            .filter(|r| PYTHON_ONLY_REASONING_PARSERS.contains(r))
        {
            bail!(
                "vllm-rs has no `{r}` reasoning parser: serve it with --frontend python (or pass `-- --reasoning-parser none` to get the thinking inside the content)"
            );
        }
        // vllm-rs reads Gemma 4's, Inkling's and Muse's thinking and calls with one parser each:
        // either of its two names fails every chat request (HTTP 500) beside another parser
        // of the other kind, and it looks the family's markers up as tokens
        let tool = self.tools.get(2).copied();
        for &(name, tokens) in UNIFIED_PARSERS {
            let as_tools = tool == Some(name);
            let as_reasoning = self.reasoning == Some(name);
            if as_tools && !as_reasoning {
                // Hunyuan's thinking is DeepSeek-R1's text: the engine's format of that
                // name is not the parser's, so the user names both parsers
                let add = match ReasoningFormat::from_parser(name) {
                    Some(f) if f.parser() == name => format!("add --reasoning-format {name}"),
                    _ => format!("pass `-- --tool-call-parser {name} --reasoning-parser {name}`"),
                };
                bail!(
                    "vllm-rs reads `{name}` calls only beside its `{name}` reasoning parser: {add} (or serve it with --frontend python)"
                );
            }
            if as_reasoning && tool.is_some() && !as_tools {
                bail!(
                    "vllm-rs runs its `{name}` reasoning parser only beside its `{name}` tool-call parser: use --tool-call-format {name} (or serve it with --frontend python)"
                );
            }
            if embedded_model && !tokens.is_empty() && (as_tools || as_reasoning) {
                bail!(
                    "vllm-rs's `{name}` parser needs {} as single tokens, which the embedded model's tokenizer lacks: serve a model whose tokenizer has them (--model DIR) or serve it with --frontend python",
                    tokens.join(", ")
                );
            }
        }
        if (tool == Some("beam") || self.reasoning == Some("beam"))
            && !model.is_some_and(beam_markup_template)
        {
            bail!(
                "vllm-rs's `beam` parser constrains every answer to Beam's own markup (`<|channel|>analysis<|message|>` thinking, calls as ` to=NAME<|channel|>analysis <|constrain|>xml<|message|>` with `<rfl:parameter>` values, the answer in `<|channel|>final<|message|>`) and reads it with the model's response_template: serve a model (--model DIR) whose tokenizer_config.json has a response_template of that markup and whose tokenizer has its markers as tokens (docs/tool-formats.md), `beam` with --frontend python, or `hf` behind vllm-rs"
            );
        }
        if let Some(r) = self
            .reasoning
            .filter(|r| *r != "none" && *r != "hf" && embedded_model)
        {
            bail!(
                "vllm-rs's `{r}` reasoning parser needs `<think>` as one token, which the embedded model's tokenizer lacks: serve it with --frontend python (or pass `-- --reasoning-parser none` to get the thinking inside the content)"
            );
        }
        Ok(())
    }
}

/// Whether the model directory's `response_template` reads Beam's own markup (its thinking
/// opened by `<|channel|>analysis<|message|>`) and its tokenizer has Beam's markers as
/// tokens (special or not): vllm-rs's `beam` parser constrains answers to that markup and
/// reads them with the template, so only then does it split them; spelled in bytes, the
/// markup leaves the answers too little room (a chat answer ran to `max_tokens`).
fn beam_markup_template(dir: &Path) -> bool {
    let read = |name: &str| -> Option<serde_json::Value> {
        serde_json::from_str(&std::fs::read_to_string(dir.join(name)).ok()?).ok()
    };
    let template = read("tokenizer_config.json").is_some_and(|c| {
        c["response_template"]["fields"]["thinking"]["open"] == "<|channel|>analysis<|message|>"
    });
    let tokens = read("tokenizer.json").is_some_and(|t| {
        let added = t["added_tokens"].as_array().cloned().unwrap_or_default();
        BEAM_MARKERS.iter().all(|m| {
            added.iter().any(|a| a["content"] == *m) || t["model"]["vocab"].get(*m).is_some()
        })
    });
    template && tokens
}

/// Reasoning parsers only vllm-rs (0.33) has: the Python frontend would exit at start.
const VLLM_RS_ONLY_REASONING_PARSERS: &[&str] = &["kimi"];

impl Parsing {
    /// Refuses, before anything starts, a reasoning parser serve chose that the Python
    /// frontend does not have.
    pub(super) fn check_python(&self) -> Result<()> {
        if let Some(r) = self
            .reasoning
            .filter(|r| VLLM_RS_ONLY_REASONING_PARSERS.contains(r))
        {
            bail!(
                "the Python frontend has no `{r}` reasoning parser (vllm-rs has): serve it behind vllm-rs (the default --frontend)"
            );
        }
        Ok(())
    }
}

/// The value of `flag` among the user's frontend arguments (`--flag V` or `--flag=V`).
fn user_value<'a>(user: &'a [String], flag: &str) -> Option<&'a str> {
    let mut it = user.iter();
    while let Some(a) = it.next() {
        if a == flag {
            return it.next().map(String::as_str);
        }
        if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            return Some(v);
        }
    }
    None
}

/// Decides the parsers and completes `play`'s formats from them. `own_model`: the user
/// serves their own model (`--model`), whose chat template may not render tools the way
/// the embedded one does, so no tool parser is chosen for it unless a format is asked for.
pub(super) fn choose(play: &mut PlayArgs, user: &[String], own_model: bool) -> Result<Parsing> {
    let tools = match user_value(user, "--tool-call-parser") {
        Some("none") => Vec::new(),
        Some(parser) => {
            let known = ToolCallFormat::from_parser(parser);
            adopt(
                &mut play.tool_call_format,
                known,
                parser,
                Kind::TOOLS,
                |f| f.parser(),
            )?;
            Vec::new()
        }
        None if user
            .iter()
            .any(|a| a.starts_with("--enable-auto-tool-choice")) =>
        {
            Vec::new()
        }
        None if own_model && play.tool_call_format.is_none() => Vec::new(),
        None => vec![
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            play.tool_call_format.unwrap_or_default().parser(),
        ],
    };
    let reasoning = match user_value(user, "--reasoning-parser") {
        // the user turns parsing off: the engine's thinking (if any) stays in `content`
        Some("none") => None,
        Some(parser) => {
            let known = ReasoningFormat::from_parser(parser);
            adopt(
                &mut play.reasoning_format,
                known,
                parser,
                Kind::REASONING,
                |f| f.parser(),
            )?;
            None
        }
        None => Some(play.reasoning_format.unwrap_or_default().parser()),
    };
    check_template_parsers(
        user_value(user, "--tool-call-parser").or(tools.get(2).copied()),
        user_value(user, "--reasoning-parser").or(reasoning),
    )?;
    if !own_model {
        let tool = play.tool_call_format.unwrap_or_default();
        let thinking = play.reasoning_format.unwrap_or_default();
        for (flag, name, needs) in [
            ("--tool-call-format", tool.parser(), tool.needs_tokens()),
            (
                "--reasoning-format",
                thinking.parser(),
                thinking.needs_tokens(),
            ),
        ] {
            if !needs.is_empty() {
                bail!(
                    "{flag} {name}: its parser needs {} as single tokens, which the embedded model's tokenizer lacks: serve a model whose tokenizer has them (--model DIR)",
                    needs.join(" and ")
                );
            }
        }
    }
    Ok(Parsing { tools, reasoning })
}

/// The parsers that read answers with the model's `response_template`: both frontends
/// build one parser of the template for calls and thinking, so a parser of the other kind
/// beside it must be the same one (the Python frontend fails to start otherwise; vllm-rs
/// fails every chat request).
const TEMPLATE_PARSERS: &[&str] = &["hf", "beam"];

/// Refuses a template parser beside a different parser of the other kind.
fn check_template_parsers(tool: Option<&str>, reasoning: Option<&str>) -> Result<()> {
    let (Some(t), Some(r)) = (tool, reasoning.filter(|r| *r != "none")) else {
        return Ok(());
    };
    if t != r && (TEMPLATE_PARSERS.contains(&t) || TEMPLATE_PARSERS.contains(&r)) {
        bail!(
            "the `{t}` tool-call parser and the `{r}` reasoning parser cannot be combined: `hf` and `beam` read calls and thinking with one parser of the model's response_template, so give both kinds the same one (--tool-call-format and --reasoning-format {}, or --reasoning-format none)",
            if TEMPLATE_PARSERS.contains(&t) { t } else { r }
        );
    }
    Ok(())
}

/// The flags and words of one kind of parser, for [`adopt`]'s messages.
struct Kind {
    format_flag: &'static str,
    parser_flag: &'static str,
    /// What the engine writes when it does not know the user's parser.
    otherwise: &'static str,
}

impl Kind {
    const TOOLS: Kind = Kind {
        format_flag: "--tool-call-format",
        parser_flag: "--tool-call-parser",
        otherwise: "its calls stay hermes-style",
    };
    const REASONING: Kind = Kind {
        format_flag: "--reasoning-format",
        parser_flag: "--reasoning-parser",
        otherwise: "its answers carry no thinking block",
    };
}

/// The user started the frontend with `parser`, which reads format `known` (if the engine
/// writes it): the engine writes that format unless told another (`given`), which is an
/// error when they differ.
fn adopt<F: Copy + PartialEq>(
    given: &mut Option<F>,
    known: Option<F>,
    parser: &str,
    kind: Kind,
    name: impl Fn(F) -> &'static str,
) -> Result<()> {
    let Kind {
        format_flag,
        parser_flag,
        otherwise,
    } = kind;
    match (*given, known) {
        (Some(f), Some(k)) if f != k => bail!(
            "{format_flag} {} and the frontend's {parser_flag} {parser} disagree: give one of them",
            name(f)
        ),
        (Some(_), _) => {}
        (None, Some(k)) => *given = Some(k),
        (None, None) => tracing::warn!(
            "the engine does not write the format of {parser_flag} {parser}: {otherwise} (see {format_flag} for the formats it writes)"
        ),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_engine_format_names_the_parser() {
        let mut play = PlayArgs::defaults();
        let p = choose(&mut play, &[], false).unwrap();
        assert_eq!(
            p.tools,
            ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        );
        assert_eq!(p.reasoning, Some("none"));
        play.tool_call_format = Some(ToolCallFormat::Qwen3Xml);
        play.reasoning_format = Some(ReasoningFormat::Qwen3);
        let p = choose(&mut play, &[], true).unwrap();
        assert_eq!(p.tools[2], "qwen3_xml");
        assert_eq!(p.reasoning, Some("qwen3"));
        // the user's own model without a format asked for: no parser chosen for it
        let p = choose(&mut PlayArgs::defaults(), &[], true).unwrap();
        assert!(p.tools.is_empty());
    }

    #[test]
    fn the_users_parser_picks_the_engine_format() {
        let mut play = PlayArgs::defaults();
        let u = user(&[
            "--enable-auto-tool-choice",
            "--tool-call-parser=pythonic",
            "--reasoning-parser",
            "glm47",
        ]);
        let p = choose(&mut play, &u, false).unwrap();
        assert!(p.tools.is_empty() && p.reasoning.is_none(), "{p:?}");
        assert_eq!(play.tool_call_format, Some(ToolCallFormat::Pythonic));
        assert_eq!(play.reasoning_format, Some(ReasoningFormat::Glm45));
        // a parser the engine has no format for leaves the default
        let mut play = PlayArgs::defaults();
        choose(
            &mut play,
            &user(&["--tool-call-parser", "my_plugin"]),
            false,
        )
        .unwrap();
        assert_eq!(play.tool_call_format, None);
        // parsing turned off after `--` keeps the engine's formats
        play.tool_call_format = Some(ToolCallFormat::Xlam);
        play.reasoning_format = Some(ReasoningFormat::Granite);
        let off = user(&["--tool-call-parser", "none", "--reasoning-parser", "none"]);
        let p = choose(&mut play, &off, false).unwrap();
        assert!(p.tools.is_empty() && p.reasoning.is_none(), "{p:?}");
        assert_eq!(play.reasoning_format, Some(ReasoningFormat::Granite));
    }

    #[test]
    fn parsers_vllm_rs_cannot_run_are_refused_before_it_starts() {
        let mut play = PlayArgs::defaults();
        assert!(
            choose(&mut play, &[], false)
                .unwrap()
                .check_vllm_rs(None)
                .is_ok()
        );
        play.tool_call_format = Some(ToolCallFormat::Pythonic);
        let e = choose(&mut play, &[], false)
            .unwrap()
            .check_vllm_rs(None)
            .unwrap_err();
        assert!(e.to_string().contains("--frontend python"), "{e}");
        play.tool_call_format = Some(ToolCallFormat::Glm45);
        play.reasoning_format = Some(ReasoningFormat::Qwen3);
        let p = choose(&mut play, &[], false).unwrap();
        assert!(
            p.check_vllm_rs(None)
                .unwrap_err()
                .to_string()
                .contains("<think>")
        );
        // a model of the user's own may have the token; parsing off passes
        assert!(p.check_vllm_rs(Some(Path::new("/nonexistent"))).is_ok());
        // Gemma 4's thinking beside another tool parser: vllm-rs would fail every request
        play.reasoning_format = Some(ReasoningFormat::Gemma4);
        let p = choose(&mut play, &[], true).unwrap();
        let e = p
            .check_vllm_rs(Some(Path::new("/nonexistent")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`gemma4`") && e.contains("--frontend python"),
            "{e}"
        );
        let off = user(&["--tool-call-parser", "none"]);
        assert!(
            choose(&mut play, &off, true)
                .unwrap()
                .check_vllm_rs(Some(Path::new("/nonexistent")))
                .is_ok()
        );
        // beside its own tool parser, with a model that has its markers, it runs
        play.tool_call_format = Some(ToolCallFormat::Gemma4);
        let pair = choose(&mut play, &[], true).unwrap();
        assert!(pair.check_vllm_rs(Some(Path::new("/nonexistent"))).is_ok());
        let e = pair.check_vllm_rs(None).unwrap_err().to_string();
        assert!(e.contains("<|channel>") && e.contains("--model DIR"), "{e}");
        // a reasoning parser vllm-rs does not have, even with a model of one's own
        play.reasoning_format = Some(ReasoningFormat::Olmo3);
        let e = choose(&mut play, &[], true)
            .unwrap()
            .check_vllm_rs(Some(Path::new("/nonexistent")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no `olmo3` reasoning parser"), "{e}");
        // Gemma 4's calls without its thinking parser: vllm-rs would fail every request
        play.reasoning_format = None;
        let e = choose(&mut play, &[], true)
            .unwrap()
            .check_vllm_rs(Some(Path::new("/nonexistent")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--reasoning-format gemma4"), "{e}");
        // Kimi K3's calls the same; Hunyuan's thinking has no format of its parser's name
        // (the engine writes DeepSeek-R1's text), so the user names both parsers
        play.tool_call_format = Some(ToolCallFormat::KimiK3);
        let e = choose(&mut play, &[], true)
            .unwrap()
            .check_vllm_rs(Some(Path::new("/nonexistent")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--reasoning-format kimi_k3"), "{e}");
        play.tool_call_format = Some(ToolCallFormat::HyV3);
        let e = choose(&mut play, &[], true)
            .unwrap()
            .check_vllm_rs(Some(Path::new("/nonexistent")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--reasoning-parser hy_v3`"), "{e}");
        play.tool_call_format = None;
        let both = user(&["--tool-call-parser", "hy_v3", "--reasoning-parser", "hy_v3"]);
        let p = choose(&mut play, &both, true).unwrap();
        assert!(p.check_vllm_rs(Some(Path::new("/nonexistent"))).is_ok());
        assert_eq!(play.tool_call_format, Some(ToolCallFormat::HyV3));
        assert_eq!(play.reasoning_format, Some(ReasoningFormat::DeepseekR1));
        play.tool_call_format = Some(ToolCallFormat::Glm45);
        play.reasoning_format = None;
        let off = user(&["--reasoning-parser", "none"]);
        assert!(
            choose(&mut play, &off, false)
                .unwrap()
                .check_vllm_rs(None)
                .is_ok()
        );
    }

    #[test]
    fn formats_whose_parser_needs_marker_tokens_need_a_model_of_ones_own() {
        let mut play = PlayArgs::defaults();
        play.tool_call_format = Some(ToolCallFormat::Mistral);
        let e = choose(&mut play, &[], false).unwrap_err().to_string();
        assert!(
            e.contains("[TOOL_CALLS]") && e.contains("--model DIR"),
            "{e}"
        );
        assert!(choose(&mut play, &[], true).is_ok());
        let mut play = PlayArgs::defaults();
        let e = choose(
            &mut play,
            &user(&["--reasoning-parser", "deepseek_r1"]),
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--reasoning-format deepseek_r1") && e.contains("<think>"),
            "{e}"
        );
    }

    #[test]
    fn a_format_and_a_parser_that_disagree_are_refused() {
        let mut play = PlayArgs::defaults();
        play.tool_call_format = Some(ToolCallFormat::Hermes);
        let e = choose(&mut play, &user(&["--tool-call-parser", "xlam"]), false).unwrap_err();
        assert!(e.to_string().contains("disagree"), "{e}");
        play.tool_call_format = None;
        play.reasoning_format = Some(ReasoningFormat::Granite);
        let e = choose(&mut play, &user(&["--reasoning-parser", "qwen3"]), false).unwrap_err();
        assert!(e.to_string().contains("--reasoning-format granite"), "{e}");
    }

    #[test]
    fn template_parsers_read_calls_and_thinking_with_one_parser() {
        let formats = |t, r| {
            let mut play = PlayArgs::defaults();
            play.tool_call_format = Some(t);
            play.reasoning_format = Some(r);
            choose(&mut play, &[], false)
        };
        // beside another reasoning parser both frontends fail: refused before anything starts
        let e = formats(ToolCallFormat::Hf, ReasoningFormat::Qwen3).unwrap_err();
        assert!(e.to_string().contains("cannot be combined"), "{e}");
        let e = formats(ToolCallFormat::Hermes, ReasoningFormat::Beam).unwrap_err();
        assert!(e.to_string().contains("`beam` reasoning parser"), "{e}");
        // vllm-rs reads `hf` with the embedded model (its template ships with it), as one
        // parser for both kinds; its `beam` is refused
        let hf = formats(ToolCallFormat::Hf, ReasoningFormat::Hf).unwrap();
        assert_eq!(hf.tools[2], "hf");
        assert!(hf.check_vllm_rs(None).is_ok());
        let alone = formats(ToolCallFormat::Hf, ReasoningFormat::None).unwrap();
        let e = alone.check_vllm_rs(None).unwrap_err().to_string();
        assert!(e.contains("--reasoning-format hf"), "{e}");
        // the Python frontend reads both (`required` aside)
        assert!(hf.check_python().is_ok());
        let beam = formats(ToolCallFormat::Beam, ReasoningFormat::Beam).unwrap();
        assert!(beam.check_python().is_ok());
        let e = beam.check_vllm_rs(None).unwrap_err().to_string();
        assert!(e.contains("--frontend python"), "{e}");
        // served for a model whose response_template reads Beam's own markup
        let dir = std::env::temp_dir().join(format!("vcr-beam-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = beam.check_vllm_rs(Some(&dir)).unwrap_err().to_string();
        assert!(e.contains("response_template"), "{e}");
        let thinking = serde_json::json!({"open": "<|channel|>analysis<|message|>"});
        let config = serde_json::json!({"response_template": {"fields": {"thinking": thinking}}});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        assert!(beam.check_vllm_rs(Some(&dir)).is_err(), "no marker tokens");
        let added: Vec<_> = BEAM_MARKERS
            .iter()
            .map(|m| serde_json::json!({"content": m}))
            .collect();
        let tokenizer = serde_json::json!({"added_tokens": added, "model": {"vocab": {}}});
        std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
        assert!(beam.check_vllm_rs(Some(&dir)).is_ok());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn kimi_thinking_is_refused_before_the_python_frontend_starts() {
        let mut play = PlayArgs::defaults();
        play.reasoning_format = Some(ReasoningFormat::Kimi);
        // with a model of one's own, which may have its tags
        let p = choose(&mut play, &[], true).unwrap();
        let e = p.check_python().unwrap_err().to_string();
        assert!(e.contains("`kimi`") && e.contains("vllm-rs"), "{e}");
        assert!(p.check_vllm_rs(Some(Path::new("/nonexistent"))).is_ok());
    }
}
