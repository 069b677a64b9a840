//! Reading a `structured_outputs` map (vLLM's `StructuredOutputsParams`) into
//! [`StructuredOutputs`]. It sits with the decoders, not with the types, because it reads
//! a msgpack value with their helpers; the types stay a leaf every decoder can use.

use rmpv::Value;

use super::value::kind;
use crate::types::{Constraint, StructuredOutputs, value_to_json};

impl StructuredOutputs {
    /// Reads the `structured_outputs` map. `Err` names what is wrong with it.
    pub fn parse(value: &Value) -> Result<Self, String> {
        let Value::Map(m) = value else {
            return Err(format!(
                "structured_outputs is not a map but {}",
                kind(value)
            ));
        };
        let mut kinds = Vec::new();
        let mut out = StructuredOutputs {
            constraint: Constraint::JsonObject,
            disable_any_whitespace: false,
            disable_additional_properties: false,
            whitespace_pattern: None,
            backend: None,
        };
        let text = |k: &str, x: &Value| -> Result<String, String> {
            x.as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("structured_outputs.{k} is not a string"))
        };
        for (k, x) in m {
            let (Some(k), false) = (k.as_str(), x.is_nil()) else {
                continue;
            };
            match k {
                "json" => kinds.push(Constraint::JsonSchema(match x {
                    Value::String(_) => text(k, x)?,
                    other => value_to_json(other),
                })),
                "json_object" if x.as_bool() == Some(true) => kinds.push(Constraint::JsonObject),
                "regex" => kinds.push(Constraint::Regex(text(k, x)?)),
                "grammar" => kinds.push(Constraint::Grammar(text(k, x)?)),
                "structural_tag" => kinds.push(Constraint::StructuralTag(match x {
                    Value::String(_) => text(k, x)?,
                    other => value_to_json(other),
                })),
                "choice" => {
                    let Value::Array(a) = x else {
                        return Err("structured_outputs.choice is not a list".into());
                    };
                    let c = a
                        .iter()
                        .map(|c| text(k, c))
                        .collect::<Result<Vec<_>, _>>()?;
                    kinds.push(Constraint::Choice(c));
                }
                "disable_any_whitespace" => out.disable_any_whitespace = x.as_bool() == Some(true),
                "disable_additional_properties" => {
                    out.disable_additional_properties = x.as_bool() == Some(true)
                }
                "whitespace_pattern" => out.whitespace_pattern = Some(text(k, x)?),
                "_backend" => out.backend = Some(text(k, x)?),
                _ => {}
            }
        }
        match kinds.len() {
            1 => {
                out.constraint = kinds.pop().expect("one kind");
                Ok(out)
            }
            0 => Err("structured_outputs names no constraint (json, json_object, regex, choice, grammar or structural_tag)".into()),
            n => Err(format!("structured_outputs names {n} constraints; vLLM allows one")),
        }
    }
}
