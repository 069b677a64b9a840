//! Tool calls under `tool_choice: auto`: the tools a chat template rendered into the
//! prompt (hermes style, `<tools>…</tools>`), and the engine's own choice to call one,
//! written in the `--tool-call-format` of the frontend's parser ([`ToolCallFormat`]).

use llguidance::api::TopLevelGrammar;
use serde_json::{Value, json};

use crate::play::content::tokens::SplitMix64;

use super::formats::ToolCallFormat;
use super::lark::close_every_object;

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
    pub(super) fn parameters_of(&self, name: &str) -> Option<Value> {
        let mut p = self
            .tools
            .iter()
            .find(|t| t.name == name)?
            .parameters
            .clone();
        close_every_object(&mut p);
        Some(p)
    }
}

/// `--tool-call-rate`: under `tool_choice: auto`, how often a prompt with tools is answered
/// with a tool call; `--tool-call-format`: how the call is written.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ToolCalls {
    pub rate: f64,
    pub format: ToolCallFormat,
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

    /// Lark grammars of one call in the format to each of the prompt's tools that `tag`
    /// (the structural tag's text) names, at most two, the first drawn from `seed`, in each
    /// form the format's calls take: what a structural tag's answer writes where the tag
    /// admits it ([`super::stream::GrammarJob`]). Each is compiled and written before the
    /// answer starts, so only tools the tag can call are tried (one, for a named function),
    /// and the first suffices wherever the tag admits any.
    pub fn own_calls(&self, tools: &PromptTools, tag: &str, seed: u64) -> Vec<String> {
        /// Candidates written ahead per request.
        const MAX_CALLS: usize = 2;
        let named: Vec<&Tool> = tools
            .tools
            .iter()
            .filter(|t| !t.name.is_empty() && tag.contains(t.name.as_str()))
            .collect();
        let n = named.len();
        if n == 0 {
            return Vec::new();
        }
        let first = (SplitMix64(seed ^ 0xca11_0f7a).next_u64() % n as u64) as usize;
        (0..n.min(MAX_CALLS))
            .map(|k| named[(first + k) % n])
            .flat_map(|tool| {
                let params = tools.parameters_of(&tool.name).unwrap_or_else(|| json!({}));
                let mut forms = vec![self.format.grammar(&tool.name, &params)];
                forms.extend(self.format.other_forms(&tool.name, &params));
                forms
            })
            .collect()
    }

    /// The grammar of an unprompted tool call for this request, if it makes one: a prompt
    /// with tools whose last message is not a tool result, and a draw under the rate.
    pub fn decide(&self, tools: &PromptTools, seed: u64) -> Option<TopLevelGrammar> {
        if tools.tools.is_empty() {
            return None;
        }
        let mut rng = self.draw(tools, seed)?;
        let tool = &tools.tools[(rng.next_u64() % tools.tools.len() as u64) as usize];
        let params = tools.parameters_of(&tool.name).unwrap_or_else(|| json!({}));
        let lark = self.format.grammar(&tool.name, &params);
        Some(TopLevelGrammar::from_lark(lark))
    }
}
