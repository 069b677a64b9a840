//! The tool-call formats whose arguments nest in a syntax of their own rather than JSON
//! (Gemma 4's `key:value` braces, MiniMax-M3's elements): a value of the tool's schema
//! written in that syntax, objects and lists recursively. Their parsers hand scalars back
//! as text and the frontend types them by the schema, nested ones included.

use serde_json::{Value, json};

use super::lark::{lark_seq, lark_str, new_rule, schema_text, value_rule, written_args};

/// Gemma 4's string delimiter (one token of its vocabulary).
const GEMMA4_QUOTE: &str = "<|\"|>";

/// How deep Gemma 4's arguments nest before a value is written flat (a string).
const GEMMA4_DEPTH: usize = 4;

/// The fields of an object of `schema` in Gemma 4's syntax, `key:value` joined by `,`
/// (its parser splits at the first `:`, so keys are bare).
pub(super) fn gemma4_fields(schema: &Value, rules: &mut Vec<String>, depth: usize) -> String {
    let parts: Vec<String> = written_args(schema)
        .iter()
        .enumerate()
        .map(|(i, (k, s))| {
            let before = if i == 0 {
                format!("{k}:")
            } else {
                format!(",{k}:")
            };
            let value = new_rule(gemma4_value(s, rules, depth), rules);
            lark_seq(&[&lark_str(&before), &value])
        })
        .collect();
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    lark_seq(&parts)
}

/// A value of `schema` in Gemma 4's syntax. Its parser hands back scalars as the text it
/// read and the frontend types them by the tool's schema (into nested objects and list
/// items too), so numbers and booleans are written bare as JSON spells them; a string goes
/// between `<|"|>` (its parser would cut a bare one at a comma); an object is `{…}` of its
/// fields and a list `[…]` of one item.
fn gemma4_value(schema: &Value, rules: &mut Vec<String>, depth: usize) -> String {
    let ty = match schema.get("type") {
        Some(Value::String(t)) => t.as_str(),
        // a union: its first type (a parser converts to any of them)
        Some(Value::Array(ts)) => ts.iter().find_map(Value::as_str).unwrap_or("string"),
        _ if schema.get("enum").is_some() => "enum",
        _ => "string",
    };
    let quoted = |body: &str| {
        lark_seq(&[
            &lark_str(GEMMA4_QUOTE),
            &format!("({body})"),
            &lark_str(GEMMA4_QUOTE),
        ])
    };
    match ty {
        "object" if depth < GEMMA4_DEPTH => {
            let fields = gemma4_fields(schema, rules, depth + 1);
            lark_seq(&[&lark_str("{"), &fields, &lark_str("}")])
        }
        "array" if depth < GEMMA4_DEPTH => {
            let empty = json!({});
            let items = schema.get("items").unwrap_or(&empty);
            if schema.get("maxItems").and_then(Value::as_u64) == Some(0) {
                return lark_str("[]");
            }
            let item = new_rule(gemma4_value(items, rules, depth + 1), rules);
            lark_seq(&[&lark_str("["), &item, &lark_str("]")])
        }
        "integer" | "number" | "boolean" | "null" | "enum" => {
            // a string among an enum's values goes quoted, the others bare
            if let Some(options) = schema.get("enum").and_then(Value::as_array) {
                let alts: Vec<String> = options
                    .iter()
                    .map(|o| match o {
                        Value::String(s) => quoted(&lark_str(s)),
                        other => lark_str(&other.to_string()),
                    })
                    .collect();
                if !alts.is_empty() {
                    return alts.join(" | ");
                }
            }
            format!("%json {}", schema_text(schema))
        }
        // a string, or a value of no declared type (which a string satisfies)
        _ => quoted(&value_rule(
            &json!({"type": "string", "enum": schema.get("enum")}),
            true,
        )),
    }
}

/// How deep MiniMax-M3's elements nest before a value is written flat (a string).
const M3_DEPTH: usize = 4;

/// MiniMax-M3's marker before every tag.
const M3: &str = "]<]minimax[>[";

/// The fields of an object of `schema` as MiniMax-M3's elements, `<key>value</key>` each
/// after the marker, `sep` after each (its parser skips the whitespace between the
/// parameters of a call; inside a nested element it would be text of its own).
pub(super) fn minimax_m3_fields(
    schema: &Value,
    rules: &mut Vec<String>,
    depth: usize,
    sep: &str,
) -> String {
    let parts: Vec<String> = written_args(schema)
        .iter()
        .map(|(k, s)| m3_element(k, s, rules, depth, sep))
        .collect();
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    lark_seq(&parts)
}

/// One element `<name>value</name>` of `schema`, then `sep`.
fn m3_element(
    name: &str,
    schema: &Value,
    rules: &mut Vec<String>,
    depth: usize,
    sep: &str,
) -> String {
    let value = new_rule(m3_value(schema, rules, depth), rules);
    lark_seq(&[
        &lark_str(&format!("{M3}<{name}>")),
        &value,
        &lark_str(&format!("{M3}</{name}>{sep}")),
    ])
}

/// A value of `schema` inside a MiniMax-M3 element: an object's fields as elements, a
/// list as one `<item>` element (the parser makes a list of an element's children when
/// the schema says array), a string bare, any other scalar as JSON spells it.
fn m3_value(schema: &Value, rules: &mut Vec<String>, depth: usize) -> String {
    let ty = match schema.get("type") {
        Some(Value::String(t)) => t.as_str(),
        Some(Value::Array(ts)) => ts.iter().find_map(Value::as_str).unwrap_or("string"),
        _ => "string",
    };
    match ty {
        "object" if depth < M3_DEPTH && !written_args(schema).is_empty() => {
            minimax_m3_fields(schema, rules, depth + 1, "")
        }
        "array"
            if depth < M3_DEPTH && schema.get("maxItems").and_then(Value::as_u64) != Some(0) =>
        {
            let empty = json!({});
            let items = schema.get("items").unwrap_or(&empty);
            m3_element("item", items, rules, depth + 1, "")
        }
        "integer" | "number" | "boolean" | "null" => format!("%json {}", schema_text(schema)),
        _ => value_rule(&json!({"type": "string", "enum": schema.get("enum")}), true),
    }
}
