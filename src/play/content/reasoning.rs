//! Thinking blocks (`--reasoning-format`, `--reasoning-share`): a free-text answer opens
//! with the format's think block, so that the reasoning parser the frontend was started
//! with (`--reasoning-parser`) moves it into `reasoning_content` and leaves the rest in
//! `content`.
//!
//! The block spends `--reasoning-share` of the answer's output tokens (the tags included
//! in the share, so that usage counts every token the client is billed for): of the
//! `max_tokens` the client bounded the answer with, or of the length the engine draws for
//! an unbounded one (`--natural-output-len`). A structural tag that opens with a think
//! block (vllm-rs behind a reasoning parser, `tool_choice: required`) gets one of the same
//! share, at most half of `max_tokens` so that the calls after it have room
//! (`constrained/free_text.rs`).
//!
//! deepseek_r1's, ernie45's, step3's, mistral's, olmo3's, minimax_m3's and k2_horizon's parsers
//! look their tags (`<think>`, `</think>`, `[THINK]`, …) up as single tokens of the vocabulary
//! and refuse to start with a byte-level tokenizer such as the embedded model's
//! ([`ReasoningFormat::needs_tokens`]); gpt-oss's harmony (`openai_gptoss`) is read from the
//! token ids of gpt-oss's own vocabulary, so only a model with its tokenizer is read.

use std::sync::Arc;

use sim_protocol::EngineCoreRequest;

use crate::play::content::tokens::{TokenSource, TokenStream, natural_length};
use crate::play::content::vocab::Vocabulary;

/// How an answer's thinking is written: the name is the frontend's `--reasoning-parser`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ReasoningFormat {
    /// No thinking block.
    #[default]
    #[value(name = "none")]
    None,
    /// `<think>\n…\n</think>\n\n` (Qwen3, QwQ).
    #[value(name = "qwen3")]
    Qwen3,
    /// The same tags, read by GLM-4.5's parser.
    #[value(name = "glm45")]
    Glm45,
    /// The same tags, read by Kimi K2's parser.
    #[value(name = "kimi_k2")]
    KimiK2,
    /// Granite 3.2's prose markers: `Here is my thought process: … Here is my response: …`.
    #[value(name = "granite")]
    Granite,
    /// `<think>\n…\n</think>\n\n` (DeepSeek-R1; its parser needs `<think>` and `</think>`
    /// in the vocabulary: a model of your own, `serve --model DIR`).
    #[value(name = "deepseek_r1")]
    DeepseekR1,
    /// `[THINK]…[/THINK]` (Magistral; its parser needs `[THINK]` in the vocabulary).
    #[value(name = "mistral")]
    Mistral,
    /// `<seed:think>\n…\n</seed:think>\n\n` (Seed-OSS).
    #[value(name = "seed_oss")]
    SeedOss,
    /// `<think>\n…\n</think>\n\n`, read by MiniMax-M2's parser (the Python one also reads
    /// a block without its opening tag; vllm-rs's does not, so the engine writes it).
    #[value(name = "minimax_m2")]
    MinimaxM2,
    /// `…\n</think>\n\n`: Step-3 writes no opening tag, and its parser takes what comes
    /// before `</think>` as thinking, an opening tag included (it needs `</think>` in the
    /// vocabulary).
    #[value(name = "step3")]
    Step3,
    /// `<think>\n…\n</think>\n\n`, read by Step-3.5's parser.
    #[value(name = "step3p5")]
    Step3p5,
    /// `<think>\n…\n</think>\n\n`, read by MiMo's parser.
    #[value(name = "mimo")]
    Mimo,
    /// `<think>\n…\n</think>\n\n`, read by Nemotron 3's parser.
    #[value(name = "nemotron_v3")]
    NemotronV3,
    /// `<think>\n…\n</think>\n<answer>\n` then the answer (Hunyuan-A13B).
    #[value(name = "hunyuan_a13b")]
    HunyuanA13b,
    /// `<think>\n…\n</think>\n\n` (ERNIE 4.5; its parser needs `<think>` and `</think>` in
    /// the vocabulary).
    #[value(name = "ernie45")]
    Ernie45,
    /// `<think>\n…\n</think>\n\n`, read by DeepSeek-V4's parser.
    #[value(name = "deepseek_v4")]
    DeepseekV4,
    /// `<|channel>thought\n…<channel|>` then the answer (Gemma 4).
    #[value(name = "gemma4")]
    Gemma4,
    /// `<think>\n…\n</think>\n\n` (OLMo 3: plain text, but its parser looks `</think>`'s
    /// byte-pair pieces up in the vocabulary, `Ġ</`, `</`, `think` and `>`).
    #[value(name = "olmo3")]
    Olmo3,
    /// `<|plamo:begin_think:plamo|>\n…\n<|plamo:end_think:plamo|>` then the answer
    /// (PLaMo 3).
    #[value(name = "plamo3")]
    Plamo3,
    /// `<|message_model|><|content_thinking|>…<|end_message|>` then the answer in a text
    /// block, `<|message_model|><|content_text|>…` (Inkling).
    #[value(name = "inkling")]
    Inkling,
    /// ` to=self<|message|>…<|eom|>` then the answer to the user,
    /// `<|start|>assistant to=user<|message|>…` (Muse Spark and Muse Glimmer: the prompt
    /// ends with `<|start|>assistant`, so the first message opens with its recipient).
    #[value(name = "muse")]
    Muse,
    /// `<mm:think>\n…\n</mm:think>\n\n` (MiniMax-M3; its parser needs both tags in the
    /// vocabulary).
    #[value(name = "minimax_m3")]
    MinimaxM3,
    /// `<|START_THINKING|>…<|END_THINKING|><|START_RESPONSE|>` then the answer (Command A,
    /// Cohere's `cmd3` rendering).
    #[value(name = "cohere_command3")]
    CohereCommand3,
    /// `<|START_THINKING|>…<|END_THINKING|><|START_TEXT|>` then the answer (Command A
    /// Reasoning, `cmd4`).
    #[value(name = "cohere_command4")]
    CohereCommand4,
    /// `…\n</think>\n\n` then the answer, as MiniMax-M2 writes it (no opening tag): its
    /// `minimax_m2_append_think` parser splits nothing, it hands the whole answer to the
    /// client as `content` with `<think>` put back in front.
    #[value(name = "minimax_m2_append_think")]
    MinimaxM2AppendThink,
    /// `<ifm|think>…</ifm|think>` then the answer (K2 Horizon at its default
    /// `reasoning_effort`, `high`; its parser needs both tags in the vocabulary).
    #[value(name = "k2_horizon")]
    K2Horizon,
    /// Kimi K3's XTML channels: `<|open|>think<|sep|>…<|close|>think<|sep|>` then the
    /// answer in `<|open|>response<|sep|>…`.
    #[value(name = "kimi_k3")]
    KimiK3,
    /// gpt-oss's harmony: `<|channel|>analysis<|message|>…<|end|>` then the answer in
    /// `<|start|>assistant<|channel|>final<|message|>…` (the prompt ends with
    /// `<|start|>assistant`; the frontend reads it as token ids of gpt-oss's own
    /// vocabulary).
    #[value(name = "openai_gptoss")]
    OpenaiGptoss,
    /// `<think>\n…\n</think>\n\n`, read by the frontends' `hf` parser through the model's
    /// `response_template` (the embedded model's describes these tags).
    #[value(name = "hf")]
    Hf,
    /// The same, read by Beam's parser through the same template.
    #[value(name = "beam")]
    Beam,
    /// `◁think▷…◁/think▷` then the answer (Kimi-VL's thinking): vllm-rs's `kimi` parser
    /// (the Python frontend has none of that name); it needs both tags in the vocabulary.
    #[value(name = "kimi")]
    Kimi,
}

/// Parser names that read a format under another name.
const ALIASES: &[(&str, ReasoningFormat)] = &[
    ("glm47", ReasoningFormat::Glm45),
    // Step-5's and Holo2's parsers are DeepSeek-R1's
    ("step5", ReasoningFormat::DeepseekR1),
    ("holo2", ReasoningFormat::DeepseekR1),
    // DeepSeek-V3's parser is DeepSeek-R1's when the request turns thinking on
    // (`chat_template_kwargs: {"thinking": true}`), and leaves the text alone otherwise
    ("deepseek_v3", ReasoningFormat::DeepseekR1),
    ("deepseek_v41", ReasoningFormat::DeepseekV4),
    // Ling 3's parser is GLM-4.7's
    ("ling3", ReasoningFormat::Glm45),
    // Muse Glimmer's parser reads Muse Spark's messages
    ("muse_glimmer", ReasoningFormat::Muse),
    // Granite 4.2's parser is Nemotron 3's; MiniCPM-V's is Qwen3's (its own newline
    // recovery aside)
    ("granite_thinking_parser", ReasoningFormat::NemotronV3),
    ("minicpmv", ReasoningFormat::Qwen3),
    // Hunyuan's V3 and V4 parsers read `<think>` tags (V3's only at a `reasoning_effort`
    // other than `no_think`, its default); Poolside's is DeepSeek-V3's, which needs an
    // `<assistant>` token too
    ("hy_v3", ReasoningFormat::DeepseekR1),
    ("hy_v4", ReasoningFormat::DeepseekR1),
    ("poolside_v1", ReasoningFormat::DeepseekR1),
];

impl ReasoningFormat {
    /// The `--reasoning-parser` that reads this format (`none` turns parsing off).
    pub fn parser(self) -> &'static str {
        match self {
            ReasoningFormat::None => "none",
            ReasoningFormat::Qwen3 => "qwen3",
            ReasoningFormat::Glm45 => "glm45",
            ReasoningFormat::KimiK2 => "kimi_k2",
            ReasoningFormat::Granite => "granite",
            ReasoningFormat::DeepseekR1 => "deepseek_r1",
            ReasoningFormat::Mistral => "mistral",
            ReasoningFormat::SeedOss => "seed_oss",
            ReasoningFormat::MinimaxM2 => "minimax_m2",
            ReasoningFormat::Step3 => "step3",
            ReasoningFormat::Step3p5 => "step3p5",
            ReasoningFormat::Mimo => "mimo",
            ReasoningFormat::NemotronV3 => "nemotron_v3",
            ReasoningFormat::HunyuanA13b => "hunyuan_a13b",
            ReasoningFormat::Ernie45 => "ernie45",
            ReasoningFormat::DeepseekV4 => "deepseek_v4",
            ReasoningFormat::Gemma4 => "gemma4",
            ReasoningFormat::Olmo3 => "olmo3",
            ReasoningFormat::Plamo3 => "plamo3",
            ReasoningFormat::Inkling => "inkling",
            ReasoningFormat::Muse => "muse",
            ReasoningFormat::MinimaxM3 => "minimax_m3",
            ReasoningFormat::CohereCommand3 => "cohere_command3",
            ReasoningFormat::CohereCommand4 => "cohere_command4",
            ReasoningFormat::MinimaxM2AppendThink => "minimax_m2_append_think",
            ReasoningFormat::K2Horizon => "k2_horizon",
            ReasoningFormat::KimiK3 => "kimi_k3",
            ReasoningFormat::OpenaiGptoss => "openai_gptoss",
            ReasoningFormat::Hf => "hf",
            ReasoningFormat::Beam => "beam",
            ReasoningFormat::Kimi => "kimi",
        }
    }

    /// The markers this format's parser looks up as single tokens of the vocabulary (it
    /// refuses to start without them). vllm-rs's parsers of the `<think>` formats need
    /// `<think>` too ([`ReasoningFormat::think_token`]).
    pub fn needs_tokens(self) -> &'static [&'static str] {
        match self {
            ReasoningFormat::DeepseekR1 | ReasoningFormat::Ernie45 => &["<think>", "</think>"],
            ReasoningFormat::Mistral => &["[THINK]", "[/THINK]"],
            ReasoningFormat::Step3 => &["</think>"],
            ReasoningFormat::Olmo3 => &["Ġ</", "</", "think", ">"],
            ReasoningFormat::MinimaxM3 => &["<mm:think>", "</mm:think>"],
            ReasoningFormat::K2Horizon => &["<ifm|think>", "</ifm|think>"],
            ReasoningFormat::Kimi => &["◁think▷", "◁/think▷"],
            ReasoningFormat::OpenaiGptoss => {
                &["<|channel|>", "<|message|>", "<|end|>", "<|start|>"]
            }
            _ => &[],
        }
    }

    /// Whether the thinking is in `<think>` tags (vllm-rs's parsers of it need the token).
    pub fn think_token(self) -> bool {
        matches!(self.tags(), Some((open, _)) if open.starts_with("<think>"))
    }

    /// The format a `--reasoning-parser` reads, when the engine can write it.
    pub fn from_parser(name: &str) -> Option<ReasoningFormat> {
        use clap::ValueEnum;
        ReasoningFormat::from_str(name, false)
            .ok()
            .or_else(|| ALIASES.iter().find(|(n, _)| *n == name).map(|(_, f)| *f))
    }

    /// The text that opens and the text that closes the thinking.
    pub(crate) fn tags(self) -> Option<(&'static str, &'static str)> {
        match self {
            ReasoningFormat::None => None,
            ReasoningFormat::Qwen3
            | ReasoningFormat::Glm45
            | ReasoningFormat::KimiK2
            | ReasoningFormat::DeepseekR1
            | ReasoningFormat::MinimaxM2
            | ReasoningFormat::Step3p5
            | ReasoningFormat::Mimo
            | ReasoningFormat::NemotronV3
            | ReasoningFormat::Ernie45
            | ReasoningFormat::DeepseekV4
            | ReasoningFormat::Olmo3
            | ReasoningFormat::Hf
            | ReasoningFormat::Beam => Some(("<think>\n", "\n</think>\n\n")),
            ReasoningFormat::Gemma4 => Some(("<|channel>thought\n", "<channel|>")),
            ReasoningFormat::Step3 | ReasoningFormat::MinimaxM2AppendThink => {
                Some(("", "\n</think>\n\n"))
            }
            ReasoningFormat::K2Horizon => Some(("<ifm|think>", "</ifm|think>")),
            ReasoningFormat::Kimi => Some(("◁think▷", "◁/think▷")),
            ReasoningFormat::OpenaiGptoss => Some((
                "<|channel|>analysis<|message|>",
                "<|end|><|start|>assistant<|channel|>final<|message|>",
            )),
            ReasoningFormat::KimiK3 => Some((
                "<|open|>think<|sep|>",
                "<|close|>think<|sep|><|open|>response<|sep|>",
            )),
            ReasoningFormat::MinimaxM3 => Some(("<mm:think>\n", "\n</mm:think>\n\n")),
            ReasoningFormat::Muse => Some((
                " to=self<|message|>",
                "<|eom|><|start|>assistant to=user<|message|>",
            )),
            ReasoningFormat::Inkling => Some((
                "<|message_model|><|content_thinking|>",
                "<|end_message|><|message_model|><|content_text|>",
            )),
            ReasoningFormat::Plamo3 => Some((
                "<|plamo:begin_think:plamo|>\n",
                "\n<|plamo:end_think:plamo|>",
            )),
            ReasoningFormat::SeedOss => Some(("<seed:think>\n", "\n</seed:think>\n\n")),
            ReasoningFormat::CohereCommand3 => {
                Some(("<|START_THINKING|>", "<|END_THINKING|><|START_RESPONSE|>"))
            }
            ReasoningFormat::CohereCommand4 => {
                Some(("<|START_THINKING|>", "<|END_THINKING|><|START_TEXT|>"))
            }
            ReasoningFormat::HunyuanA13b => Some(("<think>\n", "\n</think>\n<answer>\n")),
            ReasoningFormat::Mistral => Some(("[THINK]", "[/THINK]")),
            ReasoningFormat::Granite => {
                Some(("Here is my thought process:", " Here is my response:"))
            }
        }
    }
}

/// The engine's reasoning settings, and what it needs to know an answer's length ahead.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Reasoning {
    pub format: ReasoningFormat,
    /// The share of an answer's output tokens spent thinking, in [0, 1].
    pub share: f64,
}

/// What decides an answer's length: the engine's context and its natural-length draw.
#[derive(Debug, Clone, Copy)]
pub struct AnswerLength {
    pub max_model_len: u64,
    /// `--natural-output-len` (its mean), when on.
    pub natural_mean: Option<u64>,
    /// The engine's seed (`--seed`), which the natural length is drawn from.
    pub seed: u64,
}

impl AnswerLength {
    /// How many tokens `req`'s answer will have if it is free text: its `max_tokens`, or
    /// for an unbounded one, the engine's natural length (drawn as the engine draws it, from
    /// the request id).
    pub fn of(&self, req: &EngineCoreRequest) -> u64 {
        let prompt = req.prompt_token_ids.as_ref().map_or(0, Vec::len) as u64;
        let left = self.max_model_len.saturating_sub(prompt);
        let sp = req.sampling_params.as_ref();
        let max = sp.and_then(|sp| sp.max_tokens).map(u64::from);
        let unbounded = max.is_none_or(|m| prompt + m >= self.max_model_len);
        let ignore_eos = sp.is_some_and(|sp| sp.ignore_eos);
        match self.natural_mean {
            Some(mean) if unbounded && !ignore_eos => {
                natural_length(self.seed, &req.request_id, mean).min(max.unwrap_or(left))
            }
            _ => max.unwrap_or(left).min(left.max(1)),
        }
    }
}

impl Reasoning {
    /// `inner`'s answers, each opening with a thinking block (unchanged when off).
    pub fn wrap(
        self,
        inner: Box<dyn TokenSource>,
        vocab: Arc<Vocabulary>,
        length: AnswerLength,
    ) -> Box<dyn TokenSource> {
        // a share of 0 still wraps: a replayed record's own count may ask for a block
        if self.format == ReasoningFormat::None {
            return inner;
        }
        Box::new(Thinking {
            reasoning: self,
            inner,
            vocab,
            length,
        })
    }
}

/// A token source whose answers think first.
struct Thinking {
    reasoning: Reasoning,
    inner: Box<dyn TokenSource>,
    vocab: Arc<Vocabulary>,
    length: AnswerLength,
}

impl Thinking {
    /// `req`'s stream with a block of `thinking` tokens, tags included; a block too short
    /// for its tags is not written.
    fn with_block(&self, req: &EngineCoreRequest, thinking: u64) -> Box<dyn TokenStream> {
        let inner = self.inner.stream_for(req);
        let Some((open, close)) = self.reasoning.format.tags().filter(|_| thinking > 0) else {
            return inner;
        };
        let (open, close) = (self.vocab.encode(open), self.vocab.encode(close));
        let tags = (open.len() + close.len()) as u64;
        if thinking < tags {
            return inner;
        }
        Box::new(ThinkingStream {
            inner,
            open,
            close,
            words: thinking - tags,
            at: 0,
        })
    }
}

impl TokenSource for Thinking {
    fn stream_for(&self, req: &EngineCoreRequest) -> Box<dyn TokenStream> {
        let total = self.length.of(req);
        self.with_block(req, (self.reasoning.share * total as f64).round() as u64)
    }

    /// A recorded count: the tokens between the format's markers, as a frontend's usage
    /// counts them (the blanks inside the tags among them). The block is those, the
    /// markers and the blanks outside them, clamped to the answer's length (what
    /// `max_tokens` or the natural length leave; the caller clamps it to the record's).
    fn stream_thinking(&self, req: &EngineCoreRequest, tokens: u64) -> Box<dyn TokenStream> {
        let Some((open, close)) = self.reasoning.format.tags().filter(|_| tokens > 0) else {
            return self.with_block(req, 0);
        };
        let len = |s: &str| self.vocab.encode(s).len() as u64;
        let inside = len(&open[open.trim_end().len()..])
            + len(&close[..close.len() - close.trim_start().len()]);
        let block = tokens.saturating_sub(inside) + len(open) + len(close);
        self.with_block(req, block.min(self.length.of(req)))
    }

    fn describe(&self) -> String {
        format!(
            "{}, thinking {:.0}% of each answer ({} format)",
            self.inner.describe(),
            self.reasoning.share * 100.0,
            self.reasoning.format.parser()
        )
    }
}

/// The opening tag, `words` tokens of the inner stream, the closing tag, then the inner
/// stream's answer.
struct ThinkingStream {
    inner: Box<dyn TokenStream>,
    open: Vec<u32>,
    close: Vec<u32>,
    words: u64,
    /// Tokens handed out so far.
    at: u64,
}

impl TokenStream for ThinkingStream {
    fn next_token(&mut self, avoid: &[u32]) -> u32 {
        let (o, w, c) = (self.open.len() as u64, self.words, self.close.len() as u64);
        let at = self.at;
        self.at += 1;
        if at < o {
            self.open[at as usize]
        } else if at < o + w {
            self.inner.next_token(avoid)
        } else if at < o + w + c {
            self.close[(at - o - w) as usize]
        } else {
            self.inner.next_token(avoid)
        }
    }

    fn failure(&self) -> Option<&str> {
        self.inner.failure()
    }

    fn free_text(&self) -> bool {
        self.inner.free_text()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::play::content::text::TextTokens;
    use sim_protocol::SamplingParams;

    fn req(max_tokens: Option<u32>) -> EngineCoreRequest {
        EngineCoreRequest {
            request_id: "r1".into(),
            prompt_token_ids: Some(vec![1; 10]),
            sampling_params: Some(SamplingParams {
                max_tokens,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn answer(format: ReasoningFormat, share: f64, max_tokens: Option<u32>) -> (String, usize) {
        let vocab = Vocabulary::embedded();
        let inner = Box::new(TextTokens {
            seed: 7,
            vocab: vocab.clone(),
        });
        let length = AnswerLength {
            max_model_len: 2048,
            natural_mean: Some(64),
            seed: 7,
        };
        let source = Reasoning { format, share }.wrap(inner, vocab.clone(), length);
        let r = req(max_tokens);
        let n = length.of(&r) as usize;
        let mut s = source.stream_for(&r);
        let ids: Vec<u32> = (0..n).map(|_| s.next_token(&[])).collect();
        (vocab.decode(&ids), n)
    }

    #[test]
    fn a_bounded_answer_thinks_for_its_share_of_max_tokens() {
        let (text, n) = answer(ReasoningFormat::Qwen3, 0.5, Some(100));
        assert_eq!(n, 100);
        let body = text.strip_prefix("<think>\n").expect(&text);
        let (thinking, rest) = body.split_once("\n</think>\n\n").expect(&text);
        // one byte per token in the embedded vocabulary: the block is half the answer
        assert_eq!(
            thinking.len() + "<think>\n\n</think>\n\n".len(),
            50,
            "{text}"
        );
        assert_eq!(rest.len(), 50, "{text}");
        assert!(!rest.contains("think>"), "{text}");
    }

    #[test]
    fn an_unbounded_answer_thinks_for_its_share_of_the_natural_length() {
        let (text, n) = answer(ReasoningFormat::Granite, 0.6, None);
        assert!(n > 0 && n < 2000, "{n}");
        if n >= 60 {
            let body = text
                .strip_prefix("Here is my thought process:")
                .expect(&text);
            let (thinking, _) = body.split_once(" Here is my response:").expect(&text);
            let block = thinking.len() + 48;
            assert_eq!(block, (0.6 * n as f64).round() as usize, "{text}");
        }
    }

    #[test]
    fn off_or_too_short_leaves_the_answer_alone() {
        let (plain, _) = answer(ReasoningFormat::None, 0.5, Some(40));
        assert!(!plain.contains("think"), "{plain}");
        let (short, _) = answer(ReasoningFormat::Qwen3, 0.1, Some(40));
        assert!(!short.contains("<think>"), "{short}");
    }

    #[test]
    fn formats_without_an_opening_tag_or_with_an_answer_tag_spend_the_same_share() {
        // Step-3's block has no opening tag: the answer opens with the thinking itself
        let (text, _) = answer(ReasoningFormat::Step3, 0.5, Some(100));
        let (thinking, rest) = text.split_once("\n</think>\n\n").expect(&text);
        assert!(!thinking.contains("<think>"), "{text}");
        assert_eq!(thinking.len() + "\n</think>\n\n".len(), 50, "{text}");
        assert_eq!(rest.len(), 50, "{text}");
        // Hunyuan's closes the block by opening the answer
        let (text, _) = answer(ReasoningFormat::HunyuanA13b, 0.5, Some(100));
        let body = text.strip_prefix("<think>\n").expect(&text);
        let (_, rest) = body.split_once("\n</think>\n<answer>\n").expect(&text);
        assert_eq!(rest.len(), 50, "{text}");
        // Cohere Command's closes the block by opening the answer's, in either rendering
        for (format, answer_tag) in [
            (ReasoningFormat::CohereCommand3, "<|START_RESPONSE|>"),
            (ReasoningFormat::CohereCommand4, "<|START_TEXT|>"),
        ] {
            // its tags are 52 bytes, a token each: room for them and some thinking
            let (text, _) = answer(format, 0.5, Some(200));
            let body = text.strip_prefix("<|START_THINKING|>").expect(&text);
            let (thinking, rest) = body.split_once("<|END_THINKING|>").expect(&text);
            let rest = rest.strip_prefix(answer_tag).expect(&text);
            assert!(!thinking.is_empty() && !rest.contains("<|"), "{text}");
            assert_eq!(rest.len(), 100, "{text}");
        }
        let (text, _) = answer(ReasoningFormat::SeedOss, 0.5, Some(100));
        let body = text.strip_prefix("<seed:think>\n").expect(&text);
        assert!(body.contains("\n</seed:think>\n\n"), "{text}");
    }

    #[test]
    fn parser_names_read_back() {
        use clap::ValueEnum;
        for f in ReasoningFormat::value_variants().iter().copied() {
            assert_eq!(ReasoningFormat::from_parser(f.parser()), Some(f));
        }
        for (alias, f) in [
            ("glm47", ReasoningFormat::Glm45),
            ("step5", ReasoningFormat::DeepseekR1),
            ("holo2", ReasoningFormat::DeepseekR1),
            ("deepseek_v3", ReasoningFormat::DeepseekR1),
            ("deepseek_v41", ReasoningFormat::DeepseekV4),
            ("ling3", ReasoningFormat::Glm45),
            ("muse_glimmer", ReasoningFormat::Muse),
            ("granite_thinking_parser", ReasoningFormat::NemotronV3),
            ("minicpmv", ReasoningFormat::Qwen3),
            ("hy_v3", ReasoningFormat::DeepseekR1),
            ("hy_v4", ReasoningFormat::DeepseekR1),
            ("poolside_v1", ReasoningFormat::DeepseekR1),
        ] {
            assert_eq!(ReasoningFormat::from_parser(alias), Some(f), "{alias}");
        }
        assert_eq!(ReasoningFormat::from_parser("my_plugin"), None);
    }
}
