//! Grammar compilation: each constraint kind (JSON schema, regex, choice, GBNF, structural
//! tags and tool calls) becomes a Lark grammar over the model's vocabulary for llguidance.

use llguidance::api::TopLevelGrammar;
use serde_json::{Value, json};
use sim_protocol::{Constraint, StructuredOutputs};

use super::gbnf::{gbnf_rules, gbnf_to_lark};
use super::lark::*;
use super::spelled::styled_arguments;
use super::tools::PromptTools;
use crate::play::content::vocab::Specials;

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
            // vLLM's xgrammar backend (what its frontends pick unless a schema needs
            // another) compiles schemas in strict mode: an object that declares its
            // properties has no others. Its guidance backend leaves them open unless the
            // request disables them.
            if so.backend.as_deref() != Some("guidance") || so.disable_additional_properties {
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

/// Which tokens the literal text of a request's grammar matches, as vLLM's backend
/// compiles it: its xgrammar backend (what it picks unless told otherwise) compiles
/// structural tags and Lark grammars over the whole vocabulary, where a model's special
/// token (gpt-oss's `<|channel|>`) is its text, and the other kinds without special tokens;
/// its guidance backend never matches a special token by text.
pub fn specials_for(so: &StructuredOutputs) -> Specials {
    if so.backend.as_deref() == Some("guidance") {
        return Specials::Apart;
    }
    match &so.constraint {
        Constraint::StructuralTag(_) => Specials::AsText,
        Constraint::Grammar(g) if !g.contains("::=") => Specials::AsText,
        _ => Specials::Apart,
    }
}

/// The legacy structural tag (`{"structures": [{"begin", "schema", "end"}], "triggers"}`,
/// the only form vLLM's `guidance` backend reads) as the `triggered_tags` format it
/// means; any other tag as it is.
pub(super) fn upgrade_legacy_tag(tag: &mut Value) -> Result<Value, String> {
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

/// The `triggered_tags` format that ends a structural tag (the whole of it, or the last
/// element of its sequence, after a think block) when it leaves the model free to answer
/// with text (`at_least_one` false): what the frontends send for `tool_choice` `auto` with
/// strict tools.
pub(super) fn open_triggered_tags(tag: &mut Value) -> Option<&mut serde_json::Map<String, Value>> {
    let mut format = match tag.get("format") {
        Some(_) => tag.get_mut("format")?,
        None => tag,
    };
    while format.get("type").and_then(Value::as_str) == Some("sequence") {
        format = format.get_mut("elements")?.as_array_mut()?.last_mut()?;
    }
    let f = format.as_object_mut()?;
    let open = f.get("type").and_then(Value::as_str) == Some("triggered_tags")
        && !f
            .get("at_least_one")
            .and_then(Value::as_bool)
            .unwrap_or(false);
    open.then_some(f)
}

/// Makes the optional closers that end a structural tag's format (in the last elements of
/// its sequences, in each branch of an `or`) written: Beam's tags let the end of the
/// answer stand for a call's closer (`}\n</tool_call>`), and the walker, finding the
/// grammar complete, would mostly end there; a model writes the closer, and so does the
/// engine.
pub(super) fn write_optional_closers(tag: &mut Value) {
    fn literal(f: &Value) -> bool {
        match f.get("type").and_then(Value::as_str) {
            Some("const_string") => true,
            Some("or") => f
                .get("elements")
                .and_then(Value::as_array)
                .is_some_and(|e| e.iter().all(literal)),
            _ => false,
        }
    }
    fn walk(f: &mut Value) {
        match f.get("type").and_then(Value::as_str) {
            Some("sequence") => {
                if let Some(last) = f
                    .get_mut("elements")
                    .and_then(Value::as_array_mut)
                    .and_then(|e| e.last_mut())
                {
                    let closer = (last.get("type").and_then(Value::as_str) == Some("optional"))
                        .then(|| last.get("content").filter(|c| literal(c)).cloned())
                        .flatten();
                    match closer {
                        Some(c) => *last = c,
                        None => walk(last),
                    }
                }
            }
            Some("or") => {
                for e in f
                    .get_mut("elements")
                    .and_then(Value::as_array_mut)
                    .into_iter()
                    .flatten()
                {
                    walk(e);
                }
            }
            _ => {}
        }
    }
    match tag.get_mut("format") {
        Some(f) => walk(f),
        None => walk(tag),
    }
}

/// xgrammar's structural tag (`{"type": "structural_tag", "format": …}`, what the frontends
/// send for tool calls: `tool_choice` `required` and named functions, and `auto` with
/// strict tools) as a Lark grammar. A `json_schema` of `true` inside a tag that names a
/// tool the prompt shows becomes that tool's parameter schema, as a model that follows its
/// tool signatures would write.
pub(super) fn structural_tag_to_lark(tag: &Value, tools: &PromptTools) -> Result<String, String> {
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
pub(super) fn format_rule(
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
            let schema = f.get("json_schema").cloned().unwrap_or(Value::Bool(true));
            // xgrammar compiles a tag's schema in strict mode too
            let schema = match (&schema, tool.and_then(|t| tools.parameters_of(t))) {
                (Value::Bool(true), Some(p)) => p,
                _ => {
                    let mut schema = schema;
                    close_objects(&mut schema);
                    schema
                }
            };
            if style != "json" {
                return styled_arguments(style, &schema, rules).ok_or_else(|| {
                    format!(
                        "json_schema style `{style}` is not supported (json, qwen_xml, glm_xml, minimax_xml, deepseek_xml and deepseek_v4_1_xml are)"
                    )
                });
            }
            new_rule(format!("%json {}", schema_text(&schema)), rules)
        }
        // free text to the end of the answer (inside a tag, [`tag_parts`] ends it at the
        // tag's end)
        "any_text" => any_text(f, rules)?,
        "sequence" => {
            let elements = list("elements")?;
            let mut parts = Vec::with_capacity(elements.len());
            let mut j = 0;
            while j < elements.len() {
                let e = &elements[j];
                match elements.get(j + 1) {
                    // free text the string after it ends (vllm-rs's Hunyuan values:
                    // `<arg_value>`, the text, `</arg_value>`): text and string are one
                    // lazy lexeme, as at a tag's end; free text has no end of its own,
                    // so nothing else can follow it
                    Some(next) if is_any_text(e) => {
                        let end = const_value(next).ok_or(
                            "`any_text` runs to the end of its tag or of the answer: in a sequence only a `const_string` can follow it",
                        )?;
                        parts.push(any_text_until(e, end, rules)?);
                        j += 2;
                    }
                    _ => {
                        parts.push(format_rule(e, tool, tools, rules)?);
                        j += 1;
                    }
                }
            }
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
        // an xgrammar EBNF grammar (Cohere Command's calls: a JSON array of them, each
        // from `xgr.Grammar.from_json_schema`), its rules beside the tag's
        "grammar" => {
            let prefix = format!("gr{}_", rules.len());
            let root = format!("{prefix}root");
            let lark = gbnf_rules(string("grammar")?, &prefix, &root)?;
            rules.extend(
                lark.lines()
                    .filter(|l| !l.trim().is_empty())
                    .map(String::from),
            );
            root
        }
        // what the frontends wrap an optional part in (llama3_json's `<|python_tag|>`)
        "optional" => {
            let content = f
                .get("content")
                .ok_or_else(|| "format `optional` has no `content`".to_string())?;
            format!("({})?", format_rule(content, tool, tools, rules)?)
        }
        // repeats: Beam's tags (derived from the model's response template) follow the
        // first call with a `star` of more calls
        "star" | "plus" => {
            let content = f
                .get("content")
                .ok_or_else(|| format!("format `{ty}` has no `content`"))?;
            let one = format_rule(content, tool, tools, rules)?;
            if ty == "star" {
                format!("({one})*")
            } else {
                format!("({one})+")
            }
        }
        other => {
            return Err(format!(
                "structural-tag format `{other}` is not supported (const_string, regex, json_schema, grammar, any_text, sequence, or, optional, star, plus, tag, tags_with_separator and triggered_tags are)"
            ));
        }
    })
}

/// A `tag` format's parts: its begin string, and the Lark expressions of its content and
/// of its end.
pub(super) struct TagParts {
    begin: String,
    content: String,
    end: String,
}

pub(super) fn tag_parts(
    f: &Value,
    tool: Option<&str>,
    tools: &PromptTools,
    rules: &mut Vec<String>,
) -> Result<TagParts, String> {
    let begin = tag_begin(f)?;
    let named = tool_named_in(&begin);
    let content = f
        .get("content")
        .ok_or_else(|| format!("the tag {begin:?} has no `content`"))?;
    let content = free_text_of(content).unwrap_or(content);
    let (ends, optional) = tag_ends(f, &begin)?;
    // `""` is no Lark expression: an empty end makes the whole choice optional
    let alts = format!(
        "({})",
        ends.iter()
            .map(|e| lark_str(e))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    if is_any_text(content) {
        // free text ends where the tag's end first appears: text and end are one lazy
        // lexeme, as xgrammar's tag dispatch stops at the end string
        let text = any_text(content, rules)?;
        let content = if ends.is_empty() {
            text
        } else {
            let name = format!("r{}", rules.len());
            rules.push(format!("{name}[lazy]: {text} {alts}"));
            if optional {
                format!("({name} | {text})")
            } else {
                name
            }
        };
        return Ok(TagParts {
            begin,
            content,
            end: String::new(),
        });
    }
    // MiMo's tag spells Qwen's XML without line breaks (`<tool_call><function=NAME>`), and
    // its parser keeps a value's line breaks as part of it: after a begin without one, the
    // values go inline
    let inline;
    let content = if content.get("style").and_then(Value::as_str) == Some("qwen_xml")
        && !begin.ends_with('\n')
    {
        let mut c = content.clone();
        c["style"] = Value::from("qwen_xml_inline");
        inline = c;
        &inline
    } else {
        content
    };
    let content = format_rule(content, named.as_deref().or(tool), tools, rules)?;
    let end = match (ends.is_empty(), optional) {
        (true, _) => String::new(),
        (false, false) => alts,
        (false, true) => format!("{alts}?"),
    };
    Ok(TagParts {
        begin,
        content,
        end,
    })
}

/// A tag's `begin` string.
pub(super) fn tag_begin(f: &Value) -> Result<String, String> {
    match f.get("begin") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err("a tag's `begin` is not a string (token begins are not supported)".into()),
        None => Err("a tag has no `begin`".into()),
    }
}

/// A tag's end strings, the empty one left out, and whether it may end with none (an end
/// of `""`).
pub(super) fn tag_ends(f: &Value, begin: &str) -> Result<(Vec<String>, bool), String> {
    let ends = match f.get("end") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(format!(
                "the tag {begin:?} has an empty `end` list: it could never close (give at least one end string, \"\" for none)"
            ));
        }
        Some(v @ Value::Array(_)) => string_list(v).ok_or_else(|| {
            format!("the tag {begin:?} has an `end` list that is not all strings")
        })?,
        Some(_) => {
            return Err(format!(
                "the tag {begin:?} has an `end` that is neither a string nor a list of strings (token ends are not supported)"
            ));
        }
        None => return Err(format!("the tag {begin:?} has no `end`")),
    };
    let optional = ends.iter().any(String::is_empty);
    Ok((
        ends.into_iter().filter(|e| !e.is_empty()).collect(),
        optional,
    ))
}

/// The `any_text` of a tag's content: the content itself, or the last of a sequence that
/// only keeps the text from being empty before it (Beam's think block: a `regex` of
/// negated classes, any first character but the end's), which the engine's prose, opening
/// on a word, satisfies: the engine follows the text alone.
pub(super) fn free_text_of(content: &Value) -> Option<&Value> {
    if content.get("type").and_then(Value::as_str) != Some("sequence") {
        return Some(content);
    }
    let (last, before) = content.get("elements")?.as_array()?.split_last()?;
    let nonempty = |e: &Value| {
        e.get("type").and_then(Value::as_str) == Some("regex")
            && e.get("pattern")
                .and_then(Value::as_str)
                .is_some_and(|p| p.starts_with("[^"))
    };
    (before.len() == 1 && before.iter().all(nonempty)).then_some(last)
}

/// Whether a format is xgrammar's `any_text`.
pub(super) fn is_any_text(f: &Value) -> bool {
    f.get("type").and_then(Value::as_str) == Some("any_text")
}

/// xgrammar's `any_text` as a Lark terminal: any text that holds none of its `excludes`.
/// Its name.
fn any_text(f: &Value, rules: &mut Vec<String>) -> Result<String, String> {
    let excludes = match f.get("excludes") {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => string_list(v).ok_or("any_text `excludes` is not a list of strings")?,
    };
    let name = format!("ANY{}", rules.len());
    rules.push(format!("{name}: {}", text_without(&excludes)));
    Ok(name)
}

/// `any_text` and then `end`, the string a sequence has after it: the text ends where the
/// string first appears.
fn any_text_until(f: &Value, end: &str, rules: &mut Vec<String>) -> Result<String, String> {
    let text = any_text(f, rules)?;
    let name = format!("r{}", rules.len());
    rules.push(format!("{name}[lazy]: {text} {}", lark_str(end)));
    Ok(name)
}

/// The string a `const_string` format writes.
pub(super) fn const_value(f: &Value) -> Option<&str> {
    (f.get("type").and_then(Value::as_str) == Some("const_string"))
        .then(|| f.get("value").and_then(Value::as_str))
        .flatten()
}

/// The body of a Lark terminal of any text that holds none of `banned` (empty strings are
/// no ban).
fn text_without(banned: &[String]) -> String {
    let banned: Vec<String> = banned
        .iter()
        .filter(|b| !b.is_empty())
        .map(|b| regex_escape(b))
        .collect();
    if banned.is_empty() {
        "/(.|\\n)*/".into()
    } else {
        format!("/(.|\\n)*/ & ~/(.|\\n)*({})(.|\\n)*/", banned.join("|"))
    }
}

/// A JSON list of strings.
fn string_list(v: &Value) -> Option<Vec<String>> {
    v.as_array()?
        .iter()
        .map(|x| x.as_str().map(str::to_string))
        .collect()
}

/// xgrammar's `triggered_tags`: free text, in which each trigger starts one of the tags
/// that begin with it; after a tag's end, free text again (`stop_after_first`: nothing
/// more). Free text never holds a trigger or an `excludes` string. `at_least_one`: the
/// answer starts with a tag (xgrammar's reading: the first tag is not preceded by text).
pub(super) fn triggered_tags(
    f: &Value,
    tool: Option<&str>,
    tools: &PromptTools,
    rules: &mut Vec<String>,
) -> Result<String, String> {
    let strings = |key: &str, required: bool| -> Result<Vec<String>, String> {
        match f.get(key) {
            None if required => Err(format!("triggered_tags has no `{key}` list")),
            None => Ok(Vec::new()),
            Some(v) => string_list(v)
                .ok_or_else(|| format!("triggered_tags `{key}` is not a list of strings")),
        }
    };
    let triggers = strings("triggers", true)?;
    if triggers.is_empty() || triggers.iter().any(String::is_empty) {
        return Err("triggered_tags needs at least one trigger, and no empty one".into());
    }
    let excludes = strings("excludes", false)?;
    let tags = f
        .get("tags")
        .and_then(Value::as_array)
        .filter(|t| !t.is_empty())
        .ok_or("triggered_tags has no tags")?;
    let flag = |key: &str| f.get(key).and_then(Value::as_bool).unwrap_or(false);
    let n = rules.len();
    // free text: anything that holds no trigger and no excluded string
    let text = format!("TT{n}_TEXT");
    let banned: Vec<String> = triggers.iter().chain(&excludes).cloned().collect();
    rules.push(format!("{text}: {}", text_without(&banned)));
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

/// The tool a tag's `begin` calls: `"name": "X"` (the JSON formats), `<function=X>`
/// (Qwen3's XML), `functions.X:` (Kimi K2's), `<｜tool▁sep｜>X\n` (DeepSeek-V3's),
/// `<｜tool▁call▁begin｜>X<｜tool▁sep｜>` (DeepSeek-V3.1's), `invoke name="X"` (MiniMax-M2's,
/// DeepSeek-V3.2's DSML) or `<tool_call>X\n` (GLM's).
pub(super) fn tool_named_in(begin: &str) -> Option<String> {
    if let Some(i) = begin.find("\"name\"") {
        let rest = begin[i + 6..].trim_start().strip_prefix(':')?.trim_start();
        let mut de = serde_json::Deserializer::from_str(rest).into_iter::<String>();
        return de.next()?.ok();
    }
    [
        ("<function=", '>'),
        ("functions.", ':'),
        ("<｜tool▁sep｜>", '\n'),
        ("<｜tool▁call▁begin｜>", '<'),
        ("invoke name=\"", '"'),
        ("<tool_call>", '\n'),
    ]
    .iter()
    .find_map(|(open, close)| {
        let rest = &begin[begin.find(open)? + open.len()..];
        Some(rest[..rest.find(*close)?].to_string())
    })
    .filter(|name| !name.is_empty())
}
