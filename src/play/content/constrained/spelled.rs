//! The tool-call formats that spell each argument on its own (pythonic, Qwen3's XML, GLM's
//! key/value tags, DeepSeek's DSML, …): one Lark rule per property of the tool's schema,
//! each value written as the style's parser reads it back. [`super::formats`] uses them for
//! whole calls, and a structural tag's `json_schema` content of an XML style
//! ([`styled_arguments`]) for the calls the frontend itself frames.

use serde_json::Value;

use super::lark::{is_string, lark_lit, lark_seq, lark_str, new_rule, value_rule, written_args};

/// A call whose arguments are spelled one by one in `style`, between `begin` and `end`.
pub(super) fn spelled(begin: &str, style: Style, params: &Value, end: &str) -> String {
    let mut rules = Vec::new();
    let args = spelled_arguments(style, params, &mut rules);
    let mut lark = format!(
        "start: {}\n",
        lark_seq(&[&lark_str(begin), &args, &lark_str(end)])
    );
    for r in rules {
        lark.push_str(&r);
        lark.push('\n');
    }
    lark
}

/// How the formats that spell each argument on its own write one.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Style {
    /// `city="Paris", days=3`: every value as JSON (the parser takes JSON's literals as
    /// Python's).
    Pythonic,
    /// `<parameter=city>\nParis\n</parameter>\n`: strings bare (the parser reads them so,
    /// and converts the other types by the schema), other values as JSON.
    QwenXml,
    /// `<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n`, values as in Qwen's.
    GlmXml,
    /// `<parameter=city>Paris</parameter>`, values as in Qwen's, inline (MiMo).
    QwenInline,
    /// `<parameter name="city">Paris</parameter>\n` (MiniMax-M2, dots), values as in Qwen's.
    InvokeXml,
    /// `<steptml:parameter name="city">Paris</steptml:parameter>` (Step-3), values as in
    /// Qwen's.
    StepXml,
    /// `city:<escape>"Paris"<escape>,days:<escape>3<escape>` (FunctionGemma): every value
    /// as JSON, which its parser reads first, so that a bare word such as `true` cannot
    /// turn a string into another type.
    Gemma,
    /// `<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n` (DeepSeek's
    /// DSML): a string bare under `string="true"`, any other value as JSON under
    /// `string="false"`, which is how the parser tells them apart.
    Dsml,
    /// `<atem:parameter name="city">Paris</atem:parameter>\n` (Muse), values as in Qwen's.
    Atem,
    /// The same with every value as JSON (Muse Glimmer).
    AtemJson,
    /// The same in DeepSeek-V4.1's spaced tags, `<｜DSML｜ parameter name="city" …>`.
    DsmlSpaced,
    /// `<arg_key>city</arg_key><arg_value>Paris</arg_value>` (Hunyuan), values as in
    /// Qwen's.
    HyXml,
    /// `<ifm|arg_key>city</ifm|arg_key><ifm|arg_value>Paris</ifm|arg_value>` (K2 Horizon),
    /// values as in Qwen's.
    IfmXml,
    /// `<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>`
    /// (Kimi K3): the type tells its parser whether to read the value as JSON.
    Xtml,
    /// `<param name="city">Paris</param>` (MiniCPM5), values as in Qwen's.
    ParamXml,
    /// `\n<rfl:parameter name="city">\nParis\n</rfl:parameter>` (Beam's markup), values as
    /// in Qwen's.
    Rfl,
}

/// The arguments of a structural tag's `json_schema` content of an XML `style` (what the
/// frontends send for `tool_choice: required` with Qwen3's and GLM's parsers), as a Lark
/// expression whose sub-rules go to `rules`; `None` for a style the engine cannot write.
pub(super) fn styled_arguments(
    style: &str,
    params: &Value,
    rules: &mut Vec<String>,
) -> Option<String> {
    let style = match style {
        "qwen_xml" => Style::QwenXml,
        // the same after a tag's begin without a line break (MiMo's: `grammar::tag_parts`)
        "qwen_xml_inline" => Style::QwenInline,
        "glm_xml" => Style::GlmXml,
        // MiniMax-M2's parser's tag (`<invoke name="NAME">` around the arguments)
        "minimax_xml" => Style::InvokeXml,
        // DeepSeek-V3.2's and V4's (`<｜DSML｜parameter name="KEY" string="…">`)
        "deepseek_xml" => Style::Dsml,
        // DeepSeek-V4.1's (`<｜DSML｜ parameter name="KEY" string="…">`)
        "deepseek_v4_1_xml" => Style::DsmlSpaced,
        _ => return None,
    };
    Some(spelled_arguments(style, params, rules))
}

fn spelled_arguments(style: Style, params: &Value, rules: &mut Vec<String>) -> String {
    let parts: Vec<String> = written_args(params)
        .iter()
        .enumerate()
        .map(|(i, (k, schema))| {
            let (before, after) = match style {
                Style::Pythonic if i == 0 => (format!("{k}="), ""),
                Style::Pythonic => (format!(", {k}="), ""),
                Style::QwenXml => (format!("<parameter={k}>\n"), "\n</parameter>\n"),
                Style::GlmXml => (
                    format!("<arg_key>{k}</arg_key>\n<arg_value>"),
                    "</arg_value>\n",
                ),
                Style::QwenInline => (format!("<parameter={k}>"), "</parameter>"),
                Style::InvokeXml => (format!("<parameter name=\"{k}\">"), "</parameter>\n"),
                Style::StepXml => (
                    format!("<steptml:parameter name=\"{k}\">"),
                    "</steptml:parameter>",
                ),
                Style::Gemma if i == 0 => (format!("{k}:<escape>"), "<escape>"),
                Style::Gemma => (format!(",{k}:<escape>"), "<escape>"),
                Style::Dsml => (
                    format!(
                        "<｜DSML｜parameter name=\"{k}\" string=\"{}\">",
                        is_string(schema)
                    ),
                    "</｜DSML｜parameter>\n",
                ),
                Style::Atem | Style::AtemJson => (
                    format!("<atem:parameter name=\"{k}\">"),
                    "</atem:parameter>\n",
                ),
                Style::DsmlSpaced => (
                    format!(
                        "<｜DSML｜ parameter name=\"{k}\" string=\"{}\">",
                        is_string(schema)
                    ),
                    "</｜DSML｜ parameter>\n",
                ),
                Style::HyXml => (format!("<arg_key>{k}</arg_key><arg_value>"), "</arg_value>"),
                Style::IfmXml => (
                    format!("<ifm|arg_key>{k}</ifm|arg_key><ifm|arg_value>"),
                    "</ifm|arg_value>",
                ),
                Style::Xtml => (
                    format!(
                        "<|open|>argument key=\"{k}\" type=\"{}\"<|sep|>",
                        xtml_type(schema)
                    ),
                    "<|close|>argument<|sep|>",
                ),
                Style::ParamXml => (format!("<param name=\"{k}\">"), "</param>"),
                Style::Rfl => (
                    format!("\n<rfl:parameter name=\"{k}\">\n"),
                    "\n</rfl:parameter>",
                ),
            };
            let raw_strings = !matches!(style, Style::Pythonic | Style::Gemma | Style::AtemJson);
            let value = new_rule(value_rule(schema, raw_strings), rules);
            lark_seq(&[&lark_str(&before), &value, &lark_lit(after)])
        })
        .collect();
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    lark_seq(&parts)
}

/// Kimi K3's `type=` of an argument of `schema`: its JSON type (integers as `number`, as
/// Kimi K3 writes them); `json` where the schema names none, which its parser reads as
/// JSON like every type but `string`.
fn xtml_type(schema: &Value) -> &'static str {
    match schema.get("type").and_then(Value::as_str) {
        Some("string") => "string",
        Some("integer" | "number") => "number",
        Some("boolean") => "boolean",
        Some("object") => "object",
        Some("array") => "array",
        Some("null") => "null",
        _ => "json",
    }
}
