//! Structured outputs and tool calls: output that a grammar constrains.
//!
//! vLLM runs a request that carries `structured_outputs` under an allowed-token mask, so a
//! model with random weights still answers a JSON schema with a valid instance. The engine
//! does the same with `llguidance` (vLLM's own `guidance` backend): each constraint kind
//! becomes a grammar over the model's vocabulary ([`grammar_for`]), and
//! [`ConstrainedStream`] samples one allowed token at a time, preferring whole words inside
//! strings and ending structures sooner the longer it runs, so that instances are short
//! and readable. A request ends with EOS once its grammar is complete (finish reason `stop`),
//! or is cut at `max_tokens` (`length`) as vLLM's are.
//!
//! Tool calls ride on the same machinery: the frontends turn `tool_choice` `required` or a
//! named function into a structural tag, and under `auto` the engine decides itself
//! ([`ToolCalls`]): it reads the tools the chat template rendered into the prompt (hermes
//! style, `<tools>…</tools>`) and, with probability `--tool-call-rate`, answers with a
//! `<tool_call>` block whose arguments follow the tool's JSON schema.

use std::collections::VecDeque;
use std::sync::Arc;

use llguidance::Matcher;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::SimpleVob;
use serde_json::{Value, json};
use sim_protocol::{Constraint, EngineCoreRequest, StructuredOutputs};

use super::text::Prose;
use super::tokens::{SplitMix64, TokenStream, stream_seed};
use super::vocab::Vocabulary;

/// A tool the chat template showed the model.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    /// The JSON schema of its arguments (`{}` when the tool has none).
    pub parameters: Value,
}

/// The tools rendered into a prompt, and whether the model was just given a tool's result.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptTools {
    pub tools: Vec<Tool>,
    /// The last message before the answer holds a `<tool_response>`.
    pub after_tool_result: bool,
}

impl PromptTools {
    /// Reads a decoded prompt: the last `<tools>` … `</tools>` block (one JSON tool per
    /// line, OpenAI's `{"type": "function", "function": {…}}` or a bare function), and the
    /// message before the final `<|im_start|>`.
    pub fn from_prompt(text: &str) -> PromptTools {
        let mut out = PromptTools::default();
        if let Some(start) = text.rfind("<tools>")
            && let Some(len) = text[start..].find("</tools>")
        {
            let block = &text[start + "<tools>".len()..start + len];
            for line in block.lines().map(str::trim).filter(|l| !l.is_empty()) {
                let Ok(v) = serde_json::from_str::<Value>(line) else {
                    continue;
                };
                let f = v.get("function").unwrap_or(&v);
                if let Some(name) = f.get("name").and_then(Value::as_str) {
                    out.tools.push(Tool {
                        name: name.to_string(),
                        parameters: f.get("parameters").cloned().unwrap_or_else(|| json!({})),
                    });
                }
            }
        }
        let trimmed = text.trim_end();
        let body = trimmed
            .rfind("<|im_start|>")
            .map(|i| &trimmed[..i])
            .unwrap_or(trimmed);
        let last = body
            .rfind("<|im_start|>")
            .map(|i| &body[i..])
            .unwrap_or(body);
        out.after_tool_result = last.contains("<tool_response>");
        out
    }

    /// A tool's parameter schema, closed to its declared keys: a model that follows the
    /// signature it was shown writes only those.
    fn parameters_of(&self, name: &str) -> Option<Value> {
        let mut p = self
            .tools
            .iter()
            .find(|t| t.name == name)?
            .parameters
            .clone();
        close_objects(&mut p);
        Some(p)
    }
}

/// `--tool-call-rate`: under `tool_choice: auto`, how often a prompt with tools is answered
/// with a tool call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ToolCalls {
    pub rate: f64,
}

impl ToolCalls {
    /// Whether this request answers with a tool call where it may choose (a draw under
    /// the rate), given that the last message is not a tool result.
    pub fn calls(&self, tools: &PromptTools, seed: u64) -> bool {
        self.draw(tools, seed).is_some()
    }

    /// The draw behind [`ToolCalls::calls`]; on a call, the generator that picks the tool.
    fn draw(&self, tools: &PromptTools, seed: u64) -> Option<SplitMix64> {
        if tools.after_tool_result || self.rate <= 0.0 {
            return None;
        }
        let mut rng = SplitMix64(seed ^ 0x7001_ca11);
        (((rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < self.rate).then_some(rng)
    }

    /// The grammar of an unprompted tool call for this request, if it makes one: a prompt
    /// with tools whose last message is not a tool result, and a draw under the rate.
    pub fn decide(&self, tools: &PromptTools, seed: u64) -> Option<TopLevelGrammar> {
        if tools.tools.is_empty() {
            return None;
        }
        let mut rng = self.draw(tools, seed)?;
        let tool = &tools.tools[(rng.next_u64() % tools.tools.len() as u64) as usize];
        let begin = format!(
            "<tool_call>\n{{\"name\": {}, \"arguments\": ",
            json!(tool.name)
        );
        let lark = format!(
            "start: {} args {}\nargs: %json {}\n",
            lark_str(&begin),
            lark_str("}\n</tool_call>"),
            schema_text(&tools.parameters_of(&tool.name).unwrap_or_else(|| json!({})))
        );
        Some(TopLevelGrammar::from_lark(lark))
    }
}

/// What shapes a request's output beyond its token source: its structured outputs, and
/// tool calls under `tool_choice: auto`.
#[derive(Debug, Clone)]
pub struct Shaping {
    pub vocab: Arc<Vocabulary>,
    pub tool_calls: ToolCalls,
}

impl Shaping {
    /// A constrained stream when `req` needs one (`Ok(None)`: the token source decides);
    /// `Err` names a constraint that cannot be generated.
    pub fn stream_for(
        &self,
        req: &EngineCoreRequest,
        seed: u64,
    ) -> Result<Option<Box<dyn TokenStream>>, String> {
        match self.plan(req, seed)? {
            Some(job) => job
                .compile()
                .map(|s| Some(Box::new(s) as Box<dyn TokenStream>)),
            None => Ok(None),
        }
    }

    /// The grammar `req` is answered under, not yet built nor compiled (`Ok(None)`: the
    /// token source decides; `Err`: a `structured_outputs` map the engine cannot read).
    /// Cheap, for the engine thread: building and compiling the grammar is
    /// [`GrammarJob::compile`]'s, which can take long (a schema with a 60k-entry enum).
    pub fn plan(&self, req: &EngineCoreRequest, seed: u64) -> Result<Option<GrammarJob>, String> {
        let structured = req
            .sampling_params
            .as_ref()
            .and_then(|sp| sp.structured_outputs.as_ref());
        let stream_seed = stream_seed(seed, req);
        let (recipe, kind) = match structured {
            Some(v) => {
                let so = StructuredOutputs::parse(v)?;
                let kind = so.constraint.kind();
                let recipe = match &so.constraint {
                    Constraint::StructuralTag(text) => {
                        let tools = self.prompt_tools(req);
                        let fail = |why: String| {
                            format!(
                                "structured outputs of kind `{kind}` cannot be generated: {why}"
                            )
                        };
                        let mut tag: Value = serde_json::from_str(text)
                            .map_err(|e| fail(format!("it is not JSON: {e}")))?;
                        let mut tag = upgrade_legacy_tag(&mut tag).map_err(fail)?;
                        // text or tool calls, the model's choice: the engine chooses as it
                        // does under `auto` (`--tool-call-rate`); text comes from the token
                        // source, a call starts the answer
                        if let Some(f) = open_triggered_tags(&mut tag) {
                            if !self.tool_calls.calls(&tools, stream_seed) {
                                return Ok(None);
                            }
                            f.insert("at_least_one".into(), Value::Bool(true));
                        }
                        Recipe::Tag(tag, tools)
                    }
                    _ => Recipe::Structured(so),
                };
                (recipe, kind)
            }
            None if self.tool_calls.rate > 0.0 => {
                let tools = self.prompt_tools(req);
                match self.tool_calls.decide(&tools, stream_seed) {
                    Some(g) => (Recipe::Grammar(g), "tool call"),
                    None => return Ok(None),
                }
            }
            None => return Ok(None),
        };
        let sp = req.sampling_params.as_ref();
        Ok(Some(GrammarJob {
            vocab: self.vocab.clone(),
            recipe,
            kind,
            seed: stream_seed,
            eos: sp.and_then(|sp| sp.eos_token_id).unwrap_or(self.vocab.eos),
            max_tokens: sp.and_then(|sp| sp.max_tokens).map(u64::from),
        }))
    }

    fn prompt_tools(&self, req: &EngineCoreRequest) -> PromptTools {
        match &req.prompt_token_ids {
            Some(ids) => PromptTools::from_prompt(&self.vocab.decode(ids)),
            None => PromptTools::default(),
        }
    }
}

/// A request's grammar and what its stream needs, ready to build and compile (see
/// [`Shaping::plan`]). Owns everything it uses, so it can run on another thread.
pub struct GrammarJob {
    vocab: Arc<Vocabulary>,
    recipe: Recipe,
    /// The constraint's kind, for messages.
    pub kind: &'static str,
    /// The request's stream seed ([`stream_seed`]).
    seed: u64,
    eos: u32,
    max_tokens: Option<u64>,
}

/// What a [`GrammarJob`] builds its grammar from.
enum Recipe {
    /// A request's structured outputs other than a structural tag.
    Structured(StructuredOutputs),
    /// A structural tag, read (and, for an open `triggered_tags`, decided), with the tools
    /// the prompt shows.
    Tag(Value, PromptTools),
    /// A grammar already built (a tool call under `auto`).
    Grammar(TopLevelGrammar),
}

impl std::fmt::Debug for GrammarJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarJob")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl GrammarJob {
    /// Build and compile the grammar into the request's stream; `Err` says why it cannot
    /// be generated (naming the kind).
    pub fn compile(self) -> Result<ConstrainedStream, String> {
        let GrammarJob {
            vocab,
            recipe,
            kind,
            seed,
            eos,
            max_tokens,
        } = self;
        let fail =
            |why: String| format!("structured outputs of kind `{kind}` cannot be generated: {why}");
        let grammar = match recipe {
            Recipe::Structured(so) => grammar_for(&so, &PromptTools::default())?,
            Recipe::Tag(tag, tools) => {
                TopLevelGrammar::from_lark(structural_tag_to_lark(&tag, &tools).map_err(fail)?)
            }
            Recipe::Grammar(g) => g,
        };
        let parser = vocab
            .factory()
            .create_parser(grammar)
            .map_err(|e| fail(first_line(&e.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(fail(first_line(&e)));
        }
        Ok(ConstrainedStream {
            matcher,
            rng: SplitMix64(seed),
            prose: Prose::new(seed ^ 0x5eed),
            vocab,
            word: VecDeque::new(),
            forced: VecDeque::new(),
            sampled: 0,
            emitted: 0,
            max_tokens,
            eos,
            done: false,
            kind,
            failure: None,
        })
    }
}

/// The grammar of a request's structured outputs. `Err` names the kind and why it cannot
/// be generated.
pub fn grammar_for(so: &StructuredOutputs, tools: &PromptTools) -> Result<TopLevelGrammar, String> {
    let kind = so.constraint.kind();
    let fail =
        |why: String| format!("structured outputs of kind `{kind}` cannot be generated: {why}");
    Ok(match &so.constraint {
        Constraint::JsonSchema(text) => {
            let mut schema: Value = serde_json::from_str(text)
                .map_err(|e| fail(format!("the schema is not JSON: {e}")))?;
            if so.disable_additional_properties {
                close_objects(&mut schema);
            }
            TopLevelGrammar::from_json_schema(compact(schema, so.whitespace_pattern.as_deref()))
        }
        Constraint::JsonObject => TopLevelGrammar::from_json_schema(compact(
            json!({"type": "object"}),
            so.whitespace_pattern.as_deref(),
        )),
        Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
        Constraint::Choice(choices) => {
            if choices.is_empty() {
                return Err(fail("the choice list is empty".into()));
            }
            let alts: Vec<String> = choices.iter().map(|c| lark_str(c)).collect();
            TopLevelGrammar::from_lark(format!("start: {}\n", alts.join(" | ")))
        }
        Constraint::Grammar(g) => {
            let lark = if g.contains("::=") {
                gbnf_to_lark(g).map_err(fail)?
            } else {
                g.clone()
            };
            TopLevelGrammar::from_lark(lark)
        }
        Constraint::StructuralTag(text) => {
            let mut v: Value =
                serde_json::from_str(text).map_err(|e| fail(format!("it is not JSON: {e}")))?;
            let v = upgrade_legacy_tag(&mut v).map_err(fail)?;
            TopLevelGrammar::from_lark(structural_tag_to_lark(&v, tools).map_err(fail)?)
        }
    })
}

/// The legacy structural tag (`{"structures": [{"begin", "schema", "end"}], "triggers"}`,
/// the only form vLLM's `guidance` backend reads) as the `triggered_tags` format it
/// means; any other tag as it is.
fn upgrade_legacy_tag(tag: &mut Value) -> Result<Value, String> {
    let Some(structures) = tag.get("structures") else {
        return Ok(tag.take());
    };
    let structures = structures.as_array().ok_or("`structures` is not a list")?;
    let tags = structures
        .iter()
        .map(|s| {
            let field = |k: &str| {
                s.get(k)
                    .cloned()
                    .ok_or_else(|| format!("a structure has no `{k}`"))
            };
            Ok(json!({"type": "tag", "begin": field("begin")?,
                "content": {"type": "json_schema", "json_schema": field("schema")?},
                "end": field("end")?}))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let triggers = tag.get("triggers").cloned().unwrap_or(json!([]));
    Ok(json!({"type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}))
}

/// The top-level `triggered_tags` format of a structural tag when it leaves the model free
/// to answer with text (`at_least_one` false): what the frontends send for `tool_choice`
/// `auto` with strict tools.
fn open_triggered_tags(tag: &mut Value) -> Option<&mut serde_json::Map<String, Value>> {
    let format = match tag.get("format") {
        Some(_) => tag.get_mut("format")?,
        None => tag,
    };
    let f = format.as_object_mut()?;
    let open = f.get("type").and_then(Value::as_str) == Some("triggered_tags")
        && !f
            .get("at_least_one")
            .and_then(Value::as_bool)
            .unwrap_or(false);
    open.then_some(f)
}

/// `additionalProperties: false` on every object schema that does not say otherwise
/// (`disable_additional_properties`).
fn close_objects(v: &mut Value) {
    match v {
        Value::Object(m) => {
            let is_object = m.get("type").and_then(Value::as_str) == Some("object")
                || m.contains_key("properties");
            if is_object && !m.contains_key("additionalProperties") {
                m.insert("additionalProperties".into(), Value::Bool(false));
            }
            m.values_mut().for_each(close_objects);
        }
        Value::Array(a) => a.iter_mut().for_each(close_objects),
        _ => {}
    }
}

/// A Lark string literal.
fn lark_str(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// A JSON schema for `%json`, with [`compact`] layout.
fn schema_text(schema: &Value) -> String {
    compact(schema.clone(), None).to_string()
}

/// The schema with llguidance's layout options: no free whitespace, and `", "` / `": "`
/// between items and keys (what `json.dumps` writes), so instances read well and stay
/// short; a request's `whitespace_pattern` is kept. `true` (anything) becomes `{}`.
fn compact(schema: Value, whitespace_pattern: Option<&str>) -> Value {
    let mut schema = match schema {
        Value::Bool(true) => json!({}),
        other => other,
    };
    if let Value::Object(m) = &mut schema
        && !m.contains_key("x-guidance")
    {
        let mut opts =
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        if let Some(p) = whitespace_pattern {
            opts = json!({"whitespace_flexible": true, "whitespace_pattern": p});
        }
        m.insert("x-guidance".into(), opts);
    }
    schema
}

/// xgrammar's structural tag (`{"type": "structural_tag", "format": …}`, what the frontends
/// send for tool calls: `tool_choice` `required` and named functions, and `auto` with
/// strict tools) as a Lark grammar. A `json_schema` of `true` inside a tag that names a
/// tool the prompt shows becomes that tool's parameter schema, as a model that follows its
/// tool signatures would write.
fn structural_tag_to_lark(tag: &Value, tools: &PromptTools) -> Result<String, String> {
    let format = tag.get("format").unwrap_or(tag);
    let mut rules = Vec::new();
    let top = format_rule(format, None, tools, &mut rules)?;
    let mut lark = format!("start: {top}\n");
    for r in rules {
        lark.push_str(&r);
        lark.push('\n');
    }
    Ok(lark)
}

/// The Lark expression of one structural-tag format; sub-rules go to `rules`. `tool` is the
/// tool a surrounding tag's `begin` names.
fn format_rule(
    f: &Value,
    tool: Option<&str>,
    tools: &PromptTools,
    rules: &mut Vec<String>,
) -> Result<String, String> {
    let ty = f.get("type").and_then(Value::as_str).unwrap_or("");
    let list = |key: &str| -> Result<&Vec<Value>, String> {
        f.get(key)
            .and_then(Value::as_array)
            .ok_or_else(|| format!("format `{ty}` has no `{key}` list"))
    };
    let string = |key: &str| -> Result<&str, String> {
        f.get(key)
            .and_then(Value::as_str)
            .ok_or_else(|| format!("format `{ty}` has no `{key}` string"))
    };
    let flag = |key: &str| f.get(key).and_then(Value::as_bool).unwrap_or(false);
    Ok(match ty {
        "const_string" => lark_str(string("value")?),
        "regex" => new_rule(format!("/{}/", lark_regex(string("pattern")?)), rules),
        "json_schema" => {
            let style = f.get("style").and_then(Value::as_str).unwrap_or("json");
            if style != "json" {
                return Err(format!(
                    "json_schema style `{style}` is not supported (only `json`)"
                ));
            }
            let schema = f.get("json_schema").cloned().unwrap_or(Value::Bool(true));
            let schema = match (&schema, tool.and_then(|t| tools.parameters_of(t))) {
                (Value::Bool(true), Some(p)) => p,
                _ => schema,
            };
            new_rule(format!("%json {}", schema_text(&schema)), rules)
        }
        "sequence" => {
            let parts = list("elements")?
                .iter()
                .map(|e| format_rule(e, tool, tools, rules))
                .collect::<Result<Vec<_>, _>>()?;
            format!("({})", parts.join(" "))
        }
        "or" => {
            let parts = list("elements")?
                .iter()
                .map(|e| format_rule(e, tool, tools, rules))
                .collect::<Result<Vec<_>, _>>()?;
            format!("({})", parts.join(" | "))
        }
        "tag" => {
            let t = tag_parts(f, tool, tools, rules)?;
            new_rule(lark_seq(&[&lark_lit(&t.begin), &t.content, &t.end]), rules)
        }
        "tags_with_separator" => {
            let tags = list("tags")?
                .iter()
                .map(|t| format_rule(t, tool, tools, rules))
                .collect::<Result<Vec<_>, _>>()?;
            if tags.is_empty() {
                return Err("tags_with_separator has no tags".into());
            }
            let one = new_rule(tags.join(" | "), rules);
            let sep = f.get("separator").and_then(Value::as_str).unwrap_or("");
            let sep = lark_lit(sep);
            let more = format!("({})*", lark_seq(&[&sep, &one]));
            let body = match (flag("stop_after_first"), flag("at_least_one")) {
                (true, true) => one,
                (true, false) => format!("{one}?"),
                (false, true) => format!("{one} {more}"),
                (false, false) => format!("({one} {more})?"),
            };
            new_rule(body, rules)
        }
        "triggered_tags" => triggered_tags(f, tool, tools, rules)?,
        other => {
            return Err(format!(
                "structural-tag format `{other}` is not supported (const_string, regex, json_schema, sequence, or, tag, tags_with_separator and triggered_tags are)"
            ));
        }
    })
}

/// A sub-rule with `body`; its name.
fn new_rule(body: String, rules: &mut Vec<String>) -> String {
    let name = format!("r{}", rules.len());
    rules.push(format!("{name}: {body}"));
    name
}

/// A `tag` format's parts: its begin string, and the Lark expressions of its content and
/// of its end.
struct TagParts {
    begin: String,
    content: String,
    end: String,
}

fn tag_parts(
    f: &Value,
    tool: Option<&str>,
    tools: &PromptTools,
    rules: &mut Vec<String>,
) -> Result<TagParts, String> {
    let begin = match f.get("begin") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => {
            return Err("a tag's `begin` is not a string (token begins are not supported)".into());
        }
        None => return Err("a tag has no `begin`".into()),
    };
    let named = tool_named_in(&begin);
    let content = f
        .get("content")
        .ok_or_else(|| format!("the tag {begin:?} has no `content`"))?;
    let content = format_rule(content, named.as_deref().or(tool), tools, rules)?;
    let end = match f.get("end") {
        Some(Value::String(s)) => lark_lit(s),
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(format!(
                "the tag {begin:?} has an empty `end` list: it could never close (give at least one end string, \"\" for none)"
            ));
        }
        Some(Value::Array(a)) => {
            let ends = a
                .iter()
                .map(|e| e.as_str().map(lark_lit))
                .collect::<Option<Vec<String>>>()
                .ok_or_else(|| {
                    format!("the tag {begin:?} has an `end` list that is not all strings")
                })?;
            // `""` is no Lark expression: an empty end makes the whole choice optional
            let (empty, ends): (Vec<String>, Vec<String>) =
                ends.into_iter().partition(String::is_empty);
            let alts = format!("({})", ends.join(" | "));
            match (empty.is_empty(), ends.is_empty()) {
                (_, true) => String::new(),
                (true, false) => alts,
                (false, false) => format!("{alts}?"),
            }
        }
        Some(_) => {
            return Err(format!(
                "the tag {begin:?} has an `end` that is neither a string nor a list of strings (token ends are not supported)"
            ));
        }
        None => return Err(format!("the tag {begin:?} has no `end`")),
    };
    Ok(TagParts {
        begin,
        content,
        end,
    })
}

/// xgrammar's `triggered_tags`: free text, in which each trigger starts one of the tags
/// that begin with it; after a tag's end, free text again (`stop_after_first`: nothing
/// more). Free text never holds a trigger or an `excludes` string. `at_least_one`: the
/// answer starts with a tag (xgrammar's reading: the first tag is not preceded by text).
fn triggered_tags(
    f: &Value,
    tool: Option<&str>,
    tools: &PromptTools,
    rules: &mut Vec<String>,
) -> Result<String, String> {
    let strings = |key: &str, required: bool| -> Result<Vec<String>, String> {
        let Some(v) = f.get(key) else {
            return if required {
                Err(format!("triggered_tags has no `{key}` list"))
            } else {
                Ok(Vec::new())
            };
        };
        v.as_array()
            .and_then(|a| {
                a.iter()
                    .map(|x| x.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| format!("triggered_tags `{key}` is not a list of strings"))
    };
    let triggers = strings("triggers", true)?;
    if triggers.is_empty() || triggers.iter().any(String::is_empty) {
        return Err("triggered_tags needs at least one trigger, and no empty one".into());
    }
    let excludes: Vec<String> = strings("excludes", false)?
        .into_iter()
        .filter(|e| !e.is_empty())
        .collect();
    let tags = f
        .get("tags")
        .and_then(Value::as_array)
        .filter(|t| !t.is_empty())
        .ok_or("triggered_tags has no tags")?;
    let flag = |key: &str| f.get(key).and_then(Value::as_bool).unwrap_or(false);
    let n = rules.len();
    // free text: anything that holds no trigger and no excluded string
    let text = format!("TT{n}_TEXT");
    let banned: Vec<String> = triggers
        .iter()
        .chain(&excludes)
        .map(|t| regex_escape(t))
        .collect();
    rules.push(format!(
        "{text}: /(.|\\n)*/ & ~/(.|\\n)*({})(.|\\n)*/",
        banned.join("|")
    ));
    // text up to a trigger, as one lazy lexeme: it ends where the trigger does
    for (i, t) in triggers.iter().enumerate() {
        rules.push(format!("tt{n}_trigger{i}[lazy]: {text} {}", lark_str(t)));
    }
    let mut first = Vec::new();
    let mut after_text = Vec::new();
    for tag in tags {
        let t = tag_parts(tag, tool, tools, rules)?;
        let Some(i) = triggers
            .iter()
            .position(|tr| t.begin.starts_with(tr.as_str()))
        else {
            return Err(format!(
                "the tag {:?} begins with none of the triggers {triggers:?}",
                t.begin
            ));
        };
        let rest = &t.begin[triggers[i].len()..];
        first.push(lark_seq(&[&lark_lit(&t.begin), &t.content, &t.end]));
        after_text.push(lark_seq(&[
            &format!("tt{n}_trigger{i}"),
            &lark_lit(rest),
            &t.content,
            &t.end,
        ]));
    }
    let first = new_rule(first.join(" | "), rules);
    let call = new_rule(after_text.join(" | "), rules);
    let tail = new_rule(text, rules);
    let body = match (flag("at_least_one"), flag("stop_after_first")) {
        (false, false) => format!("{call}* {tail}"),
        (false, true) => format!("{call} | {tail}"),
        (true, false) => format!("{first} {call}* {tail}"),
        (true, true) => first,
    };
    Ok(new_rule(body, rules))
}

/// A Lark string literal, or nothing for `""` (which is no Lark expression).
fn lark_lit(s: &str) -> String {
    if s.is_empty() {
        String::new()
    } else {
        lark_str(s)
    }
}

/// Lark expressions in sequence, the empty ones left out (`""` when all are).
fn lark_seq(parts: &[&str]) -> String {
    let parts: Vec<&str> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
    if parts.is_empty() {
        "\"\"".into()
    } else {
        parts.join(" ")
    }
}

/// A regex as the body of a Lark `/…/` literal: an unescaped `/` gets its backslash (one
/// already escaped, `a\/b`, keeps the one it has), and a line break is written `\n`.
fn lark_regex(rx: &str) -> String {
    let mut out = String::with_capacity(rx.len() + 2);
    let mut chars = rx.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                out.push('\\');
                match chars.next() {
                    Some('\n') => out.push('n'),
                    Some(e) => out.push(e),
                    None => out.push('\\'),
                }
            }
            '/' => out.push_str("\\/"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
    out
}

/// `s` as a regex that matches it literally, ready for a Lark `/…/` literal.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 2);
    for c in s.chars() {
        match c {
            '\\' | '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$'
            | '#' | '&' | '-' | '~' | '/' => {
                out.push('\\');
                out.push(c);
            }
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\x{{{:x}}}", u32::from(c))),
            c => out.push(c),
        }
    }
    out
}

/// `"name": "X"` in a tag's `begin`: the tool that tag calls.
fn tool_named_in(begin: &str) -> Option<String> {
    let i = begin.find("\"name\"")?;
    let rest = begin[i + 6..].trim_start().strip_prefix(':')?.trim_start();
    let mut de = serde_json::Deserializer::from_str(rest).into_iter::<String>();
    de.next()?.ok()
}

/// A GBNF / EBNF grammar (`root ::= …`, what xgrammar takes) as Lark: `::=` becomes `:`,
/// `root` becomes `start`, rule names are made Lark-safe, character classes become regex
/// terminals and comments go.
pub fn gbnf_to_lark(g: &str) -> Result<String, String> {
    // Lark rule names are lower case: `_` is written `__`, `-` `_d` and a capital `X`
    // `_ux`, so that distinct GBNF names (`a-b` and `a_b`, `A` and `a`) stay distinct
    let name_of = |n: &str| -> String {
        if n == "root" {
            return "start".into();
        }
        let mut out = String::from("g_");
        for c in n.chars() {
            match c {
                '_' => out.push_str("__"),
                '-' => out.push_str("_d"),
                c if c.is_ascii_uppercase() => {
                    out.push_str("_u");
                    out.push(c.to_ascii_lowercase());
                }
                c => out.push(c),
            }
        }
        out
    };
    let mut out = String::new();
    let chars: Vec<char> = g.chars().collect();
    let mut i = 0;
    let mut saw_rule = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '"' => {
                let start = i;
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    if chars[i] == '\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i += 1;
                out.extend(&chars[start..i.min(chars.len())]);
            }
            '[' => {
                let start = i;
                i += 1;
                while i < chars.len() && chars[i] != ']' {
                    if chars[i] == '\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i += 1;
                let class: String = chars[start..i.min(chars.len())].iter().collect();
                out.push('/');
                out.push_str(&lark_regex(&class));
                out.push('/');
            }
            '{' => return Err("GBNF repetition ranges `{m,n}` are not supported".into()),
            c if c.is_ascii_alphabetic() || c == '_' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == '-')
                {
                    i += 1;
                }
                let name: String = chars[start..i].iter().collect();
                let mut j = i;
                while j < chars.len() && (chars[j] == ' ' || chars[j] == '\t') {
                    j += 1;
                }
                let defines = chars[j..].starts_with(&[':', ':', '=']);
                if defines {
                    if saw_rule {
                        out.push('\n');
                    }
                    saw_rule = true;
                    out.push_str(&name_of(&name));
                    out.push(':');
                    i = j + 3;
                } else {
                    out.push_str(&name_of(&name));
                }
            }
            '\n' => {
                out.push(' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    if !saw_rule {
        return Err("no `name ::= …` rule".into());
    }
    out.push('\n');
    Ok(out)
}

/// Tokens under a grammar's mask, one at a time (see the module docs).
pub struct ConstrainedStream {
    matcher: Matcher,
    vocab: Arc<Vocabulary>,
    rng: SplitMix64,
    prose: Prose,
    /// The rest of the word being spelled.
    word: VecDeque<u32>,
    /// Tokens the grammar forced, already consumed by the matcher.
    forced: VecDeque<u32>,
    sampled: u32,
    /// Tokens handed out so far, forced ones included.
    emitted: u64,
    /// The request's `max_tokens`: what is left of it decides whether another structure
    /// is opened and how soon open ones close.
    max_tokens: Option<u64>,
    /// What the request stops on once the grammar is complete.
    eos: u32,
    done: bool,
    /// The constraint's kind, for the failure message.
    kind: &'static str,
    /// Why the grammar could not be followed (see [`TokenStream::failure`]).
    failure: Option<String>,
}

impl ConstrainedStream {
    /// A stream for `req` under `grammar`; `Err` when the grammar does not compile.
    pub fn new(
        vocab: Arc<Vocabulary>,
        grammar: TopLevelGrammar,
        req: &EngineCoreRequest,
        seed: u64,
    ) -> Result<Self, String> {
        let sp = req.sampling_params.as_ref();
        GrammarJob {
            eos: sp.and_then(|sp| sp.eos_token_id).unwrap_or(vocab.eos),
            vocab,
            recipe: Recipe::Grammar(grammar),
            kind: "grammar",
            seed: stream_seed(seed, req),
            max_tokens: sp.and_then(|sp| sp.max_tokens).map(u64::from),
        }
        .compile()
    }

    fn unit(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn finish(&mut self) -> u32 {
        self.done = true;
        self.eos
    }

    /// The grammar cannot be followed any further: say why (its backend's reason, without
    /// the parser dump llguidance appends) and end the stream.
    fn fail(&mut self, why: &str) -> u32 {
        let why = first_line(why);
        let why = if why.is_empty() {
            "the grammar allows no further token".to_string()
        } else {
            why
        };
        self.failure = Some(format!(
            "structured outputs of kind `{}` could not be completed after {} tokens: {why} \
             (the grammar is too large, or recursive without a way out, for the engine's grammar backend)",
            self.kind, self.emitted
        ));
        self.finish()
    }

    /// Tokens left under `max_tokens` after the one being chosen.
    fn left(&self) -> Option<u64> {
        self.max_tokens.map(|m| m.saturating_sub(self.emitted + 1))
    }

    fn pick(&mut self, mask: &SimpleVob, avoid: &[u32]) -> Option<u32> {
        let n = f64::from(self.sampled);
        let trie_eos = self.vocab.eos;
        let left = self.left();
        // the budget is nearly spent: close what is open as fast as the grammar allows, so
        // the answer is complete rather than cut at `length`
        let tight = left
            .zip(self.max_tokens)
            .is_some_and(|(l, m)| l < (m / 4).max(8));
        // 1. go on spelling the current word
        if let Some(&w) = self.word.front() {
            if mask.is_allowed(w) && !tight && self.unit() < 0.9 {
                self.word.pop_front();
                return Some(w);
            }
            self.word.clear();
        }
        let space = self.vocab.encode(" ");
        let free_text = matches!(space[..], [t] if mask.is_allowed(t));
        let can_end = mask.is_allowed(trie_eos) && !avoid.contains(&self.eos);
        // 2. the grammar is complete and could go on with another structure (a further
        //    tool call, another item): end here when one more like what was written so far
        //    would not fit in what is left of `max_tokens`, and mostly end anyway (a model
        //    that has made its call stops)
        if can_end && !free_text {
            let no_room = left.is_some_and(|l| l < self.emitted);
            if no_room || tight || self.unit() < 0.85 {
                return Some(trie_eos);
            }
        }
        // 3. at a word boundary, end what is open, more likely the longer the output
        let p_end = if self.sampled > 400 || tight {
            1.0
        } else {
            (0.08 + n / 60.0).min(0.95)
        };
        if self.unit() < p_end {
            if can_end {
                return Some(trie_eos);
            }
            // a quote first: inside a string it is the only closer (a bracket there is text)
            for closer in [&b"\""[..], b"}", b"]", b")"] {
                let ids = self
                    .vocab
                    .encode(std::str::from_utf8(closer).unwrap_or_default());
                if let [t] = ids[..]
                    && mask.is_allowed(t)
                {
                    return Some(t);
                }
            }
        }
        // 4. start a new word where free text goes (the grammar takes a space here)
        if free_text && !tight && self.unit() < 0.75 {
            let w = self.prose.next_word();
            for text in [w.as_str(), w.trim_start()] {
                let ids = self.vocab.encode(text);
                if let Some(&first) = ids.first()
                    && mask.is_allowed(first)
                {
                    self.word.extend(&ids[1..]);
                    return Some(first);
                }
            }
        }
        // 5. a class of allowed tokens (letters, digits, a closer, other punctuation, …),
        //    then a token of that class: short lexemes, and closing grows likelier
        let mut classes: Vec<(Class, Vec<u32>)> = Vec::new();
        mask.iter_set_entries(|t| {
            let t = t as u32;
            let class = if t == trie_eos {
                if avoid.contains(&self.eos) {
                    return;
                }
                Class::Eos
            } else if self.vocab.is_special(t) {
                return;
            } else {
                Class::of(self.vocab.token_bytes(t))
            };
            match classes.iter_mut().find(|(c, _)| *c == class) {
                Some((_, v)) => v.push(t),
                None => classes.push((class, vec![t])),
            }
        });
        let total: f64 = classes.iter().map(|(c, _)| c.weight(n)).sum();
        let mut x = self.unit() * total;
        for (c, ids) in &classes {
            let w = c.weight(n);
            if x < w {
                return Some(ids[(self.rng.next_u64() % ids.len() as u64) as usize]);
            }
            x -= w;
        }
        mask.first_bit_set().map(|t| t as u32)
    }
}

/// The first line of a grammar backend's error: llguidance appends its parser state and
/// the grammar, which are no use to a client.
fn first_line(e: &str) -> String {
    e.lines().next().unwrap_or_default().trim().to_string()
}

/// What a token looks like, for step 4 of [`ConstrainedStream::pick`].
#[derive(Debug, Clone, Copy, PartialEq)]
enum Class {
    Eos,
    Letters,
    Digits,
    Space,
    Quote,
    Punctuation,
    Other,
}

impl Class {
    fn of(b: &[u8]) -> Class {
        match b {
            [] => Class::Other,
            // only a quote: `}` or `]` inside a string is text (step 2 closes structures)
            [b'"'] => Class::Quote,
            _ if b.iter().all(u8::is_ascii_whitespace) => Class::Space,
            _ if b.iter().all(|c| c.is_ascii_alphabetic() || *c == b' ') => Class::Letters,
            _ if b.iter().all(u8::is_ascii_digit) => Class::Digits,
            _ if b.iter().all(|c| c.is_ascii_graphic() || *c == b' ') => Class::Punctuation,
            _ => Class::Other,
        }
    }

    /// `n`: tokens sampled so far.
    fn weight(&self, n: f64) -> f64 {
        match self {
            Class::Eos => 2.0 + n / 4.0,
            Class::Letters => 3.0,
            Class::Digits => 2.0,
            Class::Space => 0.3,
            Class::Quote => 1.0 + n / 8.0,
            Class::Punctuation => 0.5 + n / 20.0,
            Class::Other => 0.05,
        }
    }
}

impl TokenStream for ConstrainedStream {
    fn next_token(&mut self, avoid: &[u32]) -> u32 {
        let t = self.next_inner(avoid);
        if self.failure.is_none() && !self.done {
            self.emitted += 1;
        }
        t
    }

    fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }
}

impl ConstrainedStream {
    fn next_inner(&mut self, avoid: &[u32]) -> u32 {
        if let Some(t) = self.forced.pop_front() {
            return t;
        }
        if self.failure.is_some() || self.done {
            return self.eos;
        }
        if self.matcher.is_stopped() {
            // a stop the grammar reached (complete, nothing can follow) ends the answer;
            // any other (an error, a lexer or parser past its limits) is a failure
            let reason = self.matcher.stop_reason();
            return match self.matcher.get_error() {
                Some(e) => self.fail(&e),
                None if reason.is_ok() => self.finish(),
                None => self.fail(&format!("the grammar backend stopped ({reason})")),
            };
        }
        let ff = self.matcher.consume_ff_tokens();
        if let Some(e) = self.matcher.get_error() {
            return self.fail(&e);
        }
        if let Some((&first, rest)) = ff.split_first() {
            self.word.clear();
            self.forced.extend(rest);
            return first;
        }
        if self.matcher.is_stopped() {
            return self.next_inner(avoid);
        }
        let mask = match self.matcher.compute_mask() {
            Ok(m) if !m.is_zero() => m,
            Ok(_) => return self.fail(""),
            Err(e) => return self.fail(&e.to_string()),
        };
        let Some(t) = self.pick(&mask, avoid) else {
            return self.fail("");
        };
        if t == self.vocab.eos {
            // only offered where the mask allows it: the grammar is complete
            return self.finish();
        }
        if let Err(e) = self.matcher.consume_token(t) {
            return self.fail(&e.to_string());
        }
        self.sampled += 1;
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sim_protocol::SamplingParams;

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
        let mut s =
            ConstrainedStream::new(vocab.clone(), g, &req_max(id, Some(max_tokens)), 1).unwrap();
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
        let parser = vocab.factory().create_parser(g).unwrap();
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

    /// Issue 22 H6: under `tool_choice: auto` the model chooses between text and a call;
    /// the engine draws it under `--tool-call-rate`, as it does for tools without `strict`.
    /// A call starts the answer and follows the schema; text comes from the token source.
    #[test]
    fn an_open_triggered_tag_is_a_call_or_text_under_the_tool_call_rate() {
        let vocab = Vocabulary::embedded();
        let tag = hermes_triggered("f", strict_params(), false, false);
        let prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
        let mut r = req_max("a", Some(300));
        r.prompt_token_ids = Some(vocab.encode(prompt));
        r.sampling_params.as_mut().unwrap().structured_outputs = Some(rmpv::Value::Map(vec![(
            "structural_tag".into(),
            tag.to_string().into(),
        )]));
        let shaping = |rate| Shaping {
            vocab: vocab.clone(),
            tool_calls: ToolCalls { rate },
        };
        assert!(shaping(0.0).plan(&r, 1).unwrap().is_none(), "rate 0: text");
        let mut s = shaping(1.0)
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
        let answered = prompt.replace("user\nhi", "tool\n<tool_response>\n{}\n</tool_response>");
        r.prompt_token_ids = Some(vocab.encode(&answered));
        assert!(shaping(1.0).plan(&r, 1).unwrap().is_none());
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
        let rx =
            json!({"type": "structural_tag", "format": {"type": "regex", "pattern": "a\\/b|c/d"}});
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
            let (text, stopped) = generate(
                Constraint::JsonSchema(schema.to_string()),
                &PromptTools::default(),
                &format!("r{i}"),
            );
            assert!(stopped, "{text}");
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            let a = v["a"].as_i64().unwrap();
            assert!((3..=9000).contains(&a), "{text}");
            assert!(["x", "y"].contains(&v["b"].as_str().unwrap()), "{text}");
            assert!(!v["tags"].as_array().unwrap().is_empty(), "{text}");
            assert!(text.len() < 400, "instances stay short: {text}");
        }
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
            .filter(|s| ToolCalls { rate: 0.25 }.decide(&p, *s).is_some())
            .count();
        assert!((60..140).contains(&calls), "{calls} of 400 at rate 0.25");
        assert!(
            ToolCalls { rate: 1.0 }
                .decide(&PromptTools::from_prompt(&answered), 1)
                .is_none()
        );
        let g = ToolCalls { rate: 1.0 }.decide(&weather_tools(), 3).unwrap();
        let vocab = Vocabulary::embedded();
        let mut s = ConstrainedStream::new(vocab.clone(), g, &req("auto"), 1).unwrap();
        let ids: Vec<u32> = (0..600)
            .map(|_| s.next_token(&[]))
            .take_while(|t| *t != 2)
            .collect();
        let t = vocab.decode(&ids);
        assert!(
            t.starts_with("<tool_call>\n{\"name\": \"get_weather\"")
                && t.ends_with("}\n</tool_call>"),
            "{t}"
        );
    }

    #[test]
    fn unsupported_kinds_are_named() {
        let tag = json!({"type": "structural_tag", "format": {"type": "any_text"}});
        let e = grammar_for(
            &so(Constraint::StructuralTag(tag.to_string())),
            &PromptTools::default(),
        )
        .unwrap_err();
        assert!(
            e.contains("structural_tag") && e.contains("any_text"),
            "{e}"
        );
        let e = gbnf_to_lark("root ::= [a-z]{2,3}").unwrap_err();
        assert!(e.contains("repetition"), "{e}");
    }
}
