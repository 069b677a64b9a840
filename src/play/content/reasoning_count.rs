//! How long a recorded answer thought: `record --reasoning-format` counts, from the output
//! ids the tap relays, the tokens of each answer's thinking between the format's markers
//! (`<think>` … `</think>`, `[THINK]` … `[/THINK]`, …): what a frontend's usage reports
//! as `reasoning_tokens`, so that a replay with generated tokens (`--replay-steps`)
//! thinks as long as each request did and its clients read the same count.
//!
//! The markers are the format's tags with the whitespace around them trimmed, found in
//! the tokens' bytes, whatever way the model's tokenizer split them; each takes as many
//! tokens as the tokenizer encodes it in (one for a model that has it as a token). An
//! answer that never closes its block and opened with the opening marker was cut off
//! thinking: all of it after the marker counts. One that never closes it and did not
//! open it thought for nothing, unless the format has no opening marker (Step-3's),
//! which cannot tell the two apart: no count.

use std::sync::Arc;

use crate::play::content::reasoning::ReasoningFormat;
use crate::play::content::vocab::Vocabulary;

/// What the counters of one capture look for: the format's markers, in the bytes of the
/// served model's tokens.
#[derive(Debug)]
pub struct ThinkingMarkers {
    vocab: Arc<Vocabulary>,
    open: Vec<u8>,
    close: Vec<u8>,
    /// The tokens each marker is encoded in.
    open_tokens: u32,
    close_tokens: u32,
}

impl ThinkingMarkers {
    /// The markers of `format` (`None` for `none`, which writes no thinking).
    pub fn new(format: ReasoningFormat, vocab: Arc<Vocabulary>) -> Option<Self> {
        let (open, close) = format.tags()?;
        let (open, close) = (open.trim(), close.trim());
        if close.is_empty() {
            return None;
        }
        let tokens = |s: &str| u32::try_from(vocab.encode(s).len()).unwrap_or(u32::MAX);
        Some(Self {
            open_tokens: tokens(open),
            close_tokens: tokens(close),
            open: open.as_bytes().to_vec(),
            close: close.as_bytes().to_vec(),
            vocab,
        })
    }

    /// The text of token `id` (a special token's without its marker byte).
    fn bytes(&self, id: u32) -> &[u8] {
        if id >= self.vocab.size() {
            return &[];
        }
        let b = self.vocab.token_bytes(id);
        b.strip_prefix(&[0xFF]).unwrap_or(b)
    }
}

/// The count of one answer, fed its output ids as they arrive.
#[derive(Debug, Clone, Default)]
pub struct ThinkingCount {
    /// Tokens read until the closing marker was complete.
    tokens: u32,
    closed: bool,
    /// The answer's first bytes, up to the opening marker's length.
    head: Vec<u8>,
    /// The last bytes read while looking for the closing marker (fewer than it has,
    /// then the newest token's).
    tail: Vec<u8>,
}

impl ThinkingCount {
    /// Read the next output ids of the answer.
    pub fn feed(&mut self, m: &ThinkingMarkers, ids: &[u32]) {
        for &id in ids {
            if self.closed {
                return;
            }
            let b = m.bytes(id);
            self.tokens = self.tokens.saturating_add(1);
            let room = m.open.len().saturating_sub(self.head.len());
            self.head.extend_from_slice(&b[..room.min(b.len())]);
            self.tail.extend_from_slice(b);
            if self.tail.windows(m.close.len()).any(|w| w == m.close) {
                self.closed = true;
                self.tail = Vec::new();
            } else {
                let cut = self.tail.len().saturating_sub(m.close.len() - 1);
                self.tail.drain(..cut);
            }
        }
    }

    /// The tokens between the markers, once the answer has ended.
    pub fn finish(&self, m: &ThinkingMarkers) -> Option<u32> {
        let opened = !m.open.is_empty() && self.head == m.open;
        let open = if opened { m.open_tokens } else { 0 };
        if self.closed {
            return Some(self.tokens.saturating_sub(open + m.close_tokens));
        }
        match () {
            _ if opened => Some(self.tokens.saturating_sub(open)),
            _ if m.open.is_empty() => None,
            _ => Some(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(format: ReasoningFormat, text: &str) -> Option<u32> {
        let vocab = Vocabulary::embedded();
        let m = ThinkingMarkers::new(format, vocab.clone()).expect("a thinking format");
        let ids = vocab.encode(text);
        let mut c = ThinkingCount::default();
        // as the tap sees them: a few ids an output
        for chunk in ids.chunks(3) {
            c.feed(&m, chunk);
        }
        c.finish(&m)
    }

    #[test]
    fn the_thinking_between_the_markers_is_counted() {
        // one token a byte in the embedded vocabulary: the newlines inside the tags count
        // as thinking, as a frontend's usage counts them
        let text = "<think>\nthe user greets me\n</think>\n\nHello there.";
        assert_eq!(count(ReasoningFormat::Qwen3, text), Some(20));
        // an answer that never thinks, or whose opening marker came in the prompt
        assert_eq!(count(ReasoningFormat::Qwen3, "Hello there."), Some(0));
        let text = "weighing it\n</think>\n\nHi";
        assert_eq!(count(ReasoningFormat::Qwen3, text), Some(12));
        // cut off while thinking: all of it after the marker
        let text = "<think>\nstill going";
        assert_eq!(count(ReasoningFormat::Qwen3, text), Some(12));
        // no opening marker to tell a cut-off block from an answer: unknown
        assert_eq!(count(ReasoningFormat::Step3, "just text"), None);
        assert_eq!(count(ReasoningFormat::Step3, "hm\n</think>\n\nok"), Some(3));
    }

    #[test]
    fn markers_of_several_tokens_and_prose_markers_are_found_in_the_bytes() {
        let text = "<|START_THINKING|>plan<|END_THINKING|><|START_RESPONSE|>Sure.";
        assert_eq!(count(ReasoningFormat::CohereCommand3, text), Some(4));
        let text = "Here is my thought process: ok. Here is my response: Fine.";
        assert_eq!(count(ReasoningFormat::Granite, text), Some(5));
    }

    #[test]
    fn what_the_engine_writes_counts_as_its_share() {
        use crate::play::content::reasoning::{AnswerLength, Reasoning};
        use crate::play::content::text::TextTokens;
        use sim_protocol::{EngineCoreRequest, SamplingParams};
        let vocab = Vocabulary::embedded();
        let inner = Box::new(TextTokens {
            seed: 3,
            vocab: vocab.clone(),
        });
        let length = AnswerLength {
            max_model_len: 2048,
            natural_mean: None,
            seed: 3,
        };
        let format = ReasoningFormat::Qwen3;
        let source = Reasoning { format, share: 0.4 }.wrap(inner, vocab.clone(), length);
        let req = EngineCoreRequest {
            request_id: "r".into(),
            prompt_token_ids: Some(vec![1; 4]),
            sampling_params: Some(SamplingParams {
                max_tokens: Some(100),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut s = source.stream_for(&req);
        let ids: Vec<u32> = (0..100).map(|_| s.next_token(&[])).collect();
        let m = ThinkingMarkers::new(format, vocab.clone()).expect("qwen3 thinks");
        let mut c = ThinkingCount::default();
        c.feed(&m, &ids);
        // a block of 40: `<think>\n` (8), 21 of thinking, `\n</think>\n\n` (11)
        assert_eq!(c.finish(&m), Some(23));
        // and a replayed count is written so that it counts back the same
        for n in [0, 2, 30, 60] {
            let mut s = source.stream_thinking(&req, n);
            let ids: Vec<u32> = (0..100).map(|_| s.next_token(&[])).collect();
            let mut c = ThinkingCount::default();
            c.feed(&m, &ids);
            assert_eq!(c.finish(&m), Some(n as u32), "{}", vocab.decode(&ids));
        }
        // one past the answer's length is clamped to it: all thinking, cut off
        let mut s = source.stream_thinking(&req, 500);
        let ids: Vec<u32> = (0..100).map(|_| s.next_token(&[])).collect();
        assert!(vocab.decode(&ids).ends_with("\n</think>\n\n"));
    }
}
