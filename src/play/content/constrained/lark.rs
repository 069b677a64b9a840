//! Building blocks of the Lark grammars handed to llguidance: quoted literals, sequences,
//! regexes, and JSON schemas closed to their declared keys.

use serde_json::{Value, json};

/// Keywords whose value maps names to subschemas.
const SCHEMA_MAPS: [&str; 6] = [
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
    "dependencies",
];

/// Keywords whose value is a subschema or a list of them.
const SUBSCHEMAS: [&str; 16] = [
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "contains",
    "additionalItems",
    "unevaluatedItems",
    "not",
    "if",
    "then",
    "else",
    "contentSchema",
    "items",
    "prefixItems",
    "allOf",
    "anyOf",
    "oneOf",
];

/// `additionalProperties: false` on every schema that declares `properties` (or
/// `patternProperties`) and does not say otherwise, wherever the schema nests one: what
/// vLLM's default structured-output backend (xgrammar, in its strict mode) enforces, and
/// its `guidance` backend with `disable_additional_properties`. An object schema that
/// declares no properties (`{"type": "object"}`) stays open, as there. Only schema
/// keywords are walked: an `enum` or `const` value is data, not a schema.
pub(super) fn close_objects(v: &mut Value) {
    match v {
        Value::Object(m) => {
            for key in SCHEMA_MAPS {
                if let Some(Value::Object(subs)) = m.get_mut(key) {
                    subs.values_mut().for_each(close_objects);
                }
            }
            for key in SUBSCHEMAS {
                if let Some(sub) = m.get_mut(key) {
                    close_objects(sub);
                }
            }
            let declares = ["properties", "patternProperties"]
                .iter()
                .any(|k| m.get(*k).is_some_and(Value::is_object));
            if declares && !m.contains_key("additionalProperties") {
                m.insert("additionalProperties".into(), Value::Bool(false));
            }
        }
        Value::Array(a) => a.iter_mut().for_each(close_objects),
        _ => {}
    }
}

/// `additionalProperties: false` on every object schema that does not say otherwise, with
/// or without declared properties: a tool's parameters as a model writes them when it
/// follows the signature it was shown (no keys it was not shown, none at all where the
/// signature declares none).
pub(super) fn close_every_object(v: &mut Value) {
    match v {
        Value::Object(m) => {
            let is_object = m.get("type").and_then(Value::as_str) == Some("object")
                || m.contains_key("properties");
            if is_object && !m.contains_key("additionalProperties") {
                m.insert("additionalProperties".into(), Value::Bool(false));
            }
            m.values_mut().for_each(close_every_object);
        }
        Value::Array(a) => a.iter_mut().for_each(close_every_object),
        _ => {}
    }
}

/// A sub-rule with `body`; its name.
pub(super) fn new_rule(body: String, rules: &mut Vec<String>) -> String {
    let name = format!("r{}", rules.len());
    rules.push(format!("{name}: {body}"));
    name
}

/// A Lark string literal.
pub(super) fn lark_str(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// A JSON schema for `%json`, with [`compact`] layout.
pub(super) fn schema_text(schema: &Value) -> String {
    compact(schema.clone(), None).to_string()
}

/// A Lark string literal, or nothing for `""` (which is no Lark expression).
pub(super) fn lark_lit(s: &str) -> String {
    if s.is_empty() {
        String::new()
    } else {
        lark_str(s)
    }
}

/// Lark expressions in sequence, the empty ones left out (`""` when all are).
pub(super) fn lark_seq(parts: &[&str]) -> String {
    let parts: Vec<&str> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
    if parts.is_empty() {
        "\"\"".into()
    } else {
        parts.join(" ")
    }
}

/// A regex as the body of a Lark `/…/` literal: an unescaped `/` gets its backslash (one
/// already escaped, `a\/b`, keeps the one it has), and a line break is written `\n`.
pub(super) fn lark_regex(rx: &str) -> String {
    let mut out = String::with_capacity(rx.len() + 2);
    let mut chars = rx.chars();
    // `\d` is an ASCII digit, as xgrammar reads it and a model writes one: llguidance's
    // `\d` takes any Unicode digit, and a call index written `0５` is no index to a parser
    let mut in_class = false;
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some('d') if in_class => out.push_str("0-9"),
                Some('d') => out.push_str("[0-9]"),
                Some('D') if !in_class => out.push_str("[^0-9]"),
                Some('\n') => out.push_str("\\n"),
                Some(e) => {
                    out.push('\\');
                    out.push(e);
                }
                None => out.push_str("\\\\"),
            },
            '[' => {
                in_class = true;
                out.push(c);
            }
            ']' => {
                in_class = false;
                out.push(c);
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
pub(super) fn regex_escape(s: &str) -> String {
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

/// The schema with llguidance's layout options: no free whitespace, and `", "` / `": "`
/// between items and keys (what `json.dumps` writes), so instances read well and stay
/// short; a request's `whitespace_pattern` is kept. `true` (anything) becomes `{}`.
pub(super) fn compact(schema: Value, whitespace_pattern: Option<&str>) -> Value {
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

/// The arguments a call writes, in the schema's order: the required ones, or all of them
/// when none is required (a call with some arguments reads better than an empty one).
pub(super) fn written_args(params: &Value) -> Vec<(String, Value)> {
    let Some(props) = params.get("properties").and_then(Value::as_object) else {
        return Vec::new();
    };
    let required: Vec<&str> = params
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    props
        .iter()
        .filter(|(k, _)| required.is_empty() || required.contains(&k.as_str()))
        // a name a format cannot spell (quotes, `=` or `>`) is left out
        .filter(|(k, _)| {
            !k.is_empty()
                && k.chars()
                    .all(|c| c.is_alphanumeric() || c == '_' || c == '-' || c == '.')
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Whether `schema` is a string's (the styles with bare strings write its values bare).
pub(super) fn is_string(schema: &Value) -> bool {
    schema.get("type").and_then(Value::as_str) == Some("string")
}

/// A value of `schema`: a string bare (`raw_strings`) or any value as JSON.
pub(super) fn value_rule(schema: &Value, raw_strings: bool) -> String {
    if raw_strings && is_string(schema) {
        if let Some(options) = schema.get("enum").and_then(Value::as_array) {
            let alts: Vec<String> = options
                .iter()
                .filter_map(Value::as_str)
                .map(lark_str)
                .collect();
            if !alts.is_empty() {
                return alts.join(" | ");
            }
        }
        // a few words, no markup: what a model writes for a city or a query
        return format!("/{}/", lark_regex("[A-Za-z][A-Za-z ]{0,40}[A-Za-z]"));
    }
    let schema = if schema.is_object() {
        schema.clone()
    } else {
        json!({})
    };
    format!("%json {}", schema_text(&schema))
}
