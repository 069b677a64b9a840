//! What shapes a request's output beyond its token source ([`Shaping`]): its structured
//! outputs, and tool calls under `tool_choice: auto`, planned as a [`GrammarJob`].

use std::sync::Arc;

use serde_json::Value;
use sim_protocol::{Constraint, EngineCoreRequest, StructuredOutputs};

use crate::play::content::reasoning::{AnswerLength, Reasoning};
use crate::play::content::text::Prose;
use crate::play::content::tokens::{TokenStream, stream_seed};
use crate::play::content::vocab::Vocabulary;

use super::free_text::FreeTextPlan;
use super::grammar::{
    open_triggered_tags, specials_for, upgrade_legacy_tag, write_optional_closers,
};
use super::stream::{GrammarJob, Recipe};
use super::tools::{PromptTools, ToolCalls};

/// What shapes a request's output beyond its token source: its structured outputs, and
/// tool calls under `tool_choice: auto`.
#[derive(Debug, Clone)]
pub struct Shaping {
    pub vocab: Arc<Vocabulary>,
    pub tool_calls: ToolCalls,
    /// Thinking blocks in free-text answers (the token source's, see
    /// [`Reasoning::wrap`]), and in the think block a structural tag opens with.
    pub reasoning: Reasoning,
    /// What an answer's length is, which the thinking is a share of.
    pub length: AnswerLength,
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
        let sp = req.sampling_params.as_ref();
        let max_tokens = sp.and_then(|sp| sp.max_tokens).map(u64::from);
        let mut free = FreeTextPlan::default();
        let mut calls = Vec::new();
        let (recipe, kind) = match structured {
            Some(v) => {
                let so = StructuredOutputs::parse(v)?;
                let kind = so.constraint.kind();
                let recipe = match &so.constraint {
                    Constraint::StructuralTag(text) => {
                        // what a frontend sends for its tool calls is worth seeing when
                        // a parser reads the answer otherwise than meant
                        tracing::debug!(request_id = %req.request_id, tag = %text, "structural tag");
                        let tools = self.prompt_tools(req);
                        let fail = |why: String| {
                            format!(
                                "structured outputs of kind `{kind}` cannot be generated: {why}"
                            )
                        };
                        let mut tag: Value = serde_json::from_str(text)
                            .map_err(|e| fail(format!("it is not JSON: {e}")))?;
                        let mut tag = upgrade_legacy_tag(&mut tag).map_err(fail)?;
                        write_optional_closers(&mut tag);
                        // text or tool calls, the model's choice: the engine chooses as it
                        // does under `auto` (`--tool-call-rate`); text comes from the token
                        // source, a call starts the answer (after the think block the tag
                        // may open with)
                        if let Some(f) = open_triggered_tags(&mut tag) {
                            if !self.tool_calls.calls(&tools, stream_seed) {
                                return Ok(None);
                            }
                            f.insert("at_least_one".into(), Value::Bool(true));
                        }
                        let format = tag.get("format").unwrap_or(&tag);
                        let thinking = self.thinking(req, max_tokens);
                        free = FreeTextPlan::of(format, thinking);
                        calls = self.tool_calls.own_calls(&tools, text, stream_seed);
                        // a tag that offers a text answer in markup of its own beside the
                        // calls (vllm-rs's `beam` under `auto`): text, unless the draw
                        // under `--tool-call-rate` calls
                        let format = self.tool_calls.format;
                        if format.offers_text_answer(text)
                            && (tools.tools.is_empty()
                                || !self.tool_calls.calls(&tools, stream_seed))
                        {
                            let words = self.answer_words(req, thinking, stream_seed);
                            calls.insert(0, format.text_answer(&words));
                        }
                        Recipe::Tag(tag, tools, specials_for(&so))
                    }
                    _ => Recipe::Structured(so),
                };
                (recipe, kind)
            }
            None if self.tool_calls.rate > 0.0 && self.prompt_mentions_tools(req) => {
                let tools = self.prompt_tools(req);
                match self.tool_calls.decide(&tools, stream_seed) {
                    Some(g) => (Recipe::Grammar(g), "tool call"),
                    None => return Ok(None),
                }
            }
            None => return Ok(None),
        };
        Ok(Some(GrammarJob {
            vocab: self.vocab.clone(),
            recipe,
            kind,
            seed: stream_seed,
            eos: sp.and_then(|sp| sp.eos_token_id).unwrap_or(self.vocab.eos),
            max_tokens,
            free,
            calls,
        }))
    }

    /// The tokens of a think block that opens `req`'s answer under a grammar, tags
    /// included: `--reasoning-share` of the answer's length, as in a free-text answer, but at
    /// most half of `max_tokens`, so that what the grammar asks after it (the calls) has
    /// room.
    fn thinking(&self, req: &EngineCoreRequest, max_tokens: Option<u64>) -> u64 {
        let share = (self.reasoning.share * self.length.of(req) as f64).round() as u64;
        max_tokens.map_or(share, |m| share.min(m / 2))
    }

    /// Prose for a text answer under a tag: what is left of the answer's length after its
    /// think block and the markup around the text (room for it spelled a byte a token), at
    /// least a word.
    fn answer_words(&self, req: &EngineCoreRequest, thinking: u64, seed: u64) -> String {
        /// Tokens left for the markup around the text.
        const MARKUP: u64 = 40;
        let tokens = self.length.of(req).saturating_sub(thinking + MARKUP).max(1);
        Prose::new(seed ^ 0xa45e_7e47)
            .words_for(&self.vocab, tokens as usize)
            .into_iter()
            .map(|(word, _)| word)
            .collect()
    }

    /// Whether the prompt's text holds `<tools>`. Without it the prompt declares no tool
    /// ([`PromptTools::from_prompt`]), so no tool call is drawn and the prompt need not be
    /// decoded: decoding every prompt was a tenth of `inspect simulate`'s time.
    fn prompt_mentions_tools(&self, req: &EngineCoreRequest) -> bool {
        req.prompt_token_ids
            .as_deref()
            .is_some_and(|ids| self.vocab.text_contains(ids, b"<tools>"))
    }

    fn prompt_tools(&self, req: &EngineCoreRequest) -> PromptTools {
        match &req.prompt_token_ids {
            Some(ids) => PromptTools::from_prompt(&self.vocab.decode(ids)),
            None => PromptTools::default(),
        }
    }
}
