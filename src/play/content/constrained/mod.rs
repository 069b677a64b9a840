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
//! call whose arguments follow the tool's JSON schema, written in the format of the
//! frontend's `--tool-call-parser` (`--tool-call-format`, [`ToolCallFormat`]).
//!
//! Where a structural tag leaves the text free (`any_text`: the think block vllm-rs opens
//! `required` with behind a reasoning parser), the walker writes prose of a length it plans
//! and then the tag's end (`free_text.rs`): a think block spends `--reasoning-share` of the
//! answer. Where it leaves a call's index free (a number after a tag's begin, Kimi K2's
//! `functions.NAME:N`), the walker numbers the answer's calls 0, 1, 2… as the model does:
//! two calls with one id reach a vllm-rs client as one.

mod formats;
mod free_text;
mod gbnf;
mod grammar;
mod lark;
mod nested;
mod shaping;
mod spelled;
mod stream;
#[cfg(test)]
mod tests;
mod tools;

pub use formats::{BEAM_MARKERS, ToolCallFormat};
pub use gbnf::gbnf_to_lark;
pub use grammar::grammar_for;
pub use shaping::Shaping;
pub use stream::{ConstrainedStream, GrammarJob};
pub use tools::{PromptTools, Tool, ToolCalls};
