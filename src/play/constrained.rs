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
    /// The grammar of an unprompted tool call for this request, if it makes one: a prompt
    /// with tools whose last message is not a tool result, and a draw under the rate.
    pub fn decide(&self, tools: &PromptTools, seed: u64) -> Option<TopLevelGrammar> {
        if tools.tools.is_empty() || tools.after_tool_result || self.rate <= 0.0 {
            return None;
        }
        let mut rng = SplitMix64(seed ^ 0x7001_ca11);
        if (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 >= self.rate {
            return None;
        }
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
        let structured = req
            .sampling_params
            .as_ref()
            .and_then(|sp| sp.structured_outputs.as_ref());
        let grammar = match structured {
            Some(v) => {
                let so = StructuredOutputs::parse(v)?;
                let tools = match so.constraint {
                    Constraint::StructuralTag(_) => self.prompt_tools(req),
                    _ => PromptTools::default(),
                };
                grammar_for(&so, &tools)?
            }
            None if self.tool_calls.rate > 0.0 => {
                let tools = self.prompt_tools(req);
                match self.tool_calls.decide(&tools, stream_seed(seed, req)) {
                    Some(g) => g,
                    None => return Ok(None),
                }
            }
            None => return Ok(None),
        };
        let kind = structured
            .and_then(|v| StructuredOutputs::parse(v).ok())
            .map_or("tool call", |s| s.constraint.kind());
        ConstrainedStream::new(self.vocab.clone(), grammar, req, seed)
            .map(|s| Some(Box::new(s) as Box<dyn TokenStream>))
            .map_err(|e| format!("structured outputs of kind `{kind}` cannot be generated: {e}"))
    }

    fn prompt_tools(&self, req: &EngineCoreRequest) -> PromptTools {
        match &req.prompt_token_ids {
            Some(ids) => PromptTools::from_prompt(&self.vocab.decode(ids)),
            None => PromptTools::default(),
        }
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
            let v: Value =
                serde_json::from_str(text).map_err(|e| fail(format!("it is not JSON: {e}")))?;
            TopLevelGrammar::from_lark(structural_tag_to_lark(&v, tools).map_err(fail)?)
        }
    })
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
/// send for `tool_choice` `required` and named functions) as a Lark grammar. A
/// `json_schema` of `true` inside a tag that names a tool the prompt shows becomes that
/// tool's parameter schema, as a model that follows its tool signatures would write.
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
    let new_rule = |body: String, rules: &mut Vec<String>| {
        let name = format!("r{}", rules.len());
        rules.push(format!("{name}: {body}"));
        name
    };
    Ok(match ty {
        "const_string" => lark_str(string("value")?),
        "regex" => {
            let rx = string("pattern")?;
            new_rule(format!("/{}/", rx.replace('/', "\\/")), rules)
        }
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
            let begin = string("begin")?;
            let named = tool_named_in(begin);
            let content = f
                .get("content")
                .ok_or("a tag has no `content`".to_string())?;
            let inner = format_rule(content, named.as_deref().or(tool), tools, rules)?;
            let end = match f.get("end") {
                Some(Value::String(s)) => lark_str(s),
                Some(Value::Array(a)) => {
                    let e: Vec<String> = a.iter().filter_map(Value::as_str).map(lark_str).collect();
                    format!("({})", e.join(" | "))
                }
                _ => return Err("a tag has no `end`".into()),
            };
            new_rule(format!("{} {inner} {end}", lark_str(begin)), rules)
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
            let at_least_one = f
                .get("at_least_one")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let first = f
                .get("stop_after_first")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let sep = f.get("separator").and_then(Value::as_str).unwrap_or("");
            let sep = if sep.is_empty() {
                String::new()
            } else {
                format!("{} ", lark_str(sep))
            };
            let body = match (first, at_least_one) {
                (true, true) => one,
                (true, false) => format!("{one}?"),
                (false, true) => format!("{one} ({sep}{one})*"),
                (false, false) => format!("({one} ({sep}{one})*)?"),
            };
            new_rule(body, rules)
        }
        other => {
            return Err(format!(
                "structural-tag format `{other}` is not supported (const_string, regex, json_schema, sequence, or, tag and tags_with_separator are)"
            ));
        }
    })
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
    let name_of = |n: &str| -> String {
        if n == "root" {
            "start".into()
        } else {
            format!("g_{}", n.replace('-', "_").to_lowercase())
        }
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
                out.push_str(&class.replace('/', "\\/"));
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
    /// What the request stops on once the grammar is complete.
    eos: u32,
    done: bool,
}

impl ConstrainedStream {
    /// A stream for `req` under `grammar`; `Err` when the grammar does not compile.
    pub fn new(
        vocab: Arc<Vocabulary>,
        grammar: TopLevelGrammar,
        req: &EngineCoreRequest,
        seed: u64,
    ) -> Result<Self, String> {
        let parser = vocab
            .factory()
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        let s = stream_seed(seed, req);
        let eos = req
            .sampling_params
            .as_ref()
            .and_then(|sp| sp.eos_token_id)
            .unwrap_or(vocab.eos);
        Ok(ConstrainedStream {
            matcher,
            rng: SplitMix64(s),
            prose: Prose::new(s ^ 0x5eed),
            vocab,
            word: VecDeque::new(),
            forced: VecDeque::new(),
            sampled: 0,
            eos,
            done: false,
        })
    }

    fn unit(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn finish(&mut self) -> u32 {
        self.done = true;
        self.eos
    }

    fn pick(&mut self, mask: &SimpleVob, avoid: &[u32]) -> Option<u32> {
        let n = f64::from(self.sampled);
        let trie_eos = self.vocab.eos;
        // 1. go on spelling the current word
        if let Some(&w) = self.word.front() {
            if mask.is_allowed(w) && self.unit() < 0.9 {
                self.word.pop_front();
                return Some(w);
            }
            self.word.clear();
        }
        // 2. at a word boundary, end what is open, more likely the longer the output
        let p_end = if self.sampled > 400 {
            1.0
        } else {
            (0.08 + n / 60.0).min(0.95)
        };
        if self.unit() < p_end {
            if mask.is_allowed(trie_eos) && !avoid.contains(&self.eos) {
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
        // 3. start a new word where free text goes (the grammar takes a space here)
        let space = self.vocab.encode(" ");
        let free_text = matches!(space[..], [t] if mask.is_allowed(t));
        if free_text && self.unit() < 0.75 {
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
        // 4. a class of allowed tokens (letters, digits, a closer, other punctuation, …),
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
        if let Some(t) = self.forced.pop_front() {
            return t;
        }
        if self.done || self.matcher.is_stopped() {
            return self.finish();
        }
        let ff = self.matcher.consume_ff_tokens();
        if let Some((&first, rest)) = ff.split_first() {
            self.word.clear();
            self.forced.extend(rest);
            return first;
        }
        let mask = match self.matcher.compute_mask() {
            Ok(m) if !m.is_zero() => m,
            _ => return self.finish(),
        };
        let Some(t) = self.pick(&mask, avoid) else {
            return self.finish();
        };
        if t == self.vocab.eos || self.matcher.consume_token(t).is_err() {
            return self.finish();
        }
        self.sampled += 1;
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sim_protocol::SamplingParams;

    fn req(id: &str) -> EngineCoreRequest {
        EngineCoreRequest {
            request_id: id.into(),
            prompt_token_ids: Some(vec![10, 11]),
            sampling_params: Some(SamplingParams {
                eos_token_id: Some(crate::tiny_model::EOS_TOKEN_ID),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

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
            if t == crate::tiny_model::EOS_TOKEN_ID {
                return (vocab.decode(&ids), true);
            }
            ids.push(t);
        }
        (vocab.decode(&ids), false)
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
