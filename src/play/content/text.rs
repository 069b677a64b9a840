//! `--tokens text`: readable prose in the model's own tokens.
//!
//! Sentences of ordinary English words, each word encoded with the model's tokenizer (so
//! with a real tokenizer most words are one or two tokens, and with the embedded byte-level
//! one a word is one token per letter). Seeded like random tokens: the same seed and the
//! same request give the same text. Prose never contains a stop token: a request runs to
//! `max_tokens`, as random requests do.

use std::collections::VecDeque;
use std::sync::Arc;

use sim_protocol::EngineCoreRequest;

use super::tokens::{SplitMix64, TokenSource, TokenStream, stream_seed};
use super::vocab::Vocabulary;

/// Ordinary words: the prose vocabulary (nouns, verbs, adjectives and small words, so random
/// sentences read as language).
const WORDS: &[&str] = &[
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "this",
    "from",
    "or",
    "but",
    "not",
    "are",
    "we",
    "they",
    "you",
    "can",
    "will",
    "one",
    "all",
    "there",
    "what",
    "so",
    "up",
    "out",
    "if",
    "about",
    "who",
    "which",
    "when",
    "more",
    "some",
    "time",
    "very",
    "just",
    "then",
    "now",
    "only",
    "also",
    "well",
    "back",
    "after",
    "first",
    "new",
    "good",
    "little",
    "long",
    "great",
    "old",
    "big",
    "small",
    "high",
    "different",
    "large",
    "next",
    "early",
    "young",
    "important",
    "few",
    "public",
    "bad",
    "same",
    "able",
    "light",
    "quiet",
    "bright",
    "simple",
    "clear",
    "warm",
    "green",
    "open",
    "river",
    "city",
    "garden",
    "window",
    "morning",
    "evening",
    "system",
    "engine",
    "model",
    "request",
    "answer",
    "question",
    "story",
    "world",
    "house",
    "road",
    "mountain",
    "forest",
    "village",
    "market",
    "letter",
    "table",
    "paper",
    "music",
    "water",
    "stone",
    "cloud",
    "bridge",
    "station",
    "library",
    "teacher",
    "student",
    "friend",
    "family",
    "number",
    "problem",
    "idea",
    "reason",
    "result",
    "moment",
    "season",
    "journey",
    "signal",
    "pattern",
    "method",
    "plan",
    "report",
    "sound",
    "color",
    "voice",
    "picture",
    "machine",
    "network",
    "make",
    "take",
    "see",
    "come",
    "think",
    "look",
    "want",
    "give",
    "use",
    "find",
    "tell",
    "ask",
    "work",
    "seem",
    "feel",
    "try",
    "leave",
    "call",
    "keep",
    "begin",
    "show",
    "hear",
    "play",
    "run",
    "move",
    "live",
    "believe",
    "bring",
    "write",
    "learn",
    "change",
    "follow",
    "stop",
    "create",
    "speak",
    "read",
    "grow",
    "remember",
    "build",
    "carry",
    "explain",
    "measure",
    "return",
    "travel",
    "wonder",
    "gather",
    "answered",
    "walked",
    "found",
    "carefully",
    "quickly",
    "slowly",
    "often",
    "together",
    "again",
    "always",
    "never",
    "perhaps",
    "almost",
    "really",
    "still",
    "soon",
    "here",
    "today",
    "tomorrow",
    "yesterday",
];

/// Prose, one word at a time.
pub struct Prose {
    rng: SplitMix64,
    words_left: u32,
    started: bool,
}

impl Prose {
    pub fn new(seed: u64) -> Self {
        Prose {
            rng: SplitMix64(seed),
            words_left: 0,
            started: false,
        }
    }

    /// The next word as it appears in the text: a leading space (but for the very first),
    /// a capital at a sentence start, a period at its end and now and then a comma.
    pub fn next_word(&mut self) -> String {
        let start = self.words_left == 0;
        if start {
            self.words_left = 5 + (self.rng.next_u64() % 10) as u32;
        }
        let w = WORDS[(self.rng.next_u64() % WORDS.len() as u64) as usize];
        let mut s = String::with_capacity(w.len() + 2);
        if self.started {
            s.push(' ');
        }
        self.started = true;
        if start {
            let mut c = w.chars();
            if let Some(f) = c.next() {
                s.extend(f.to_uppercase());
                s.push_str(c.as_str());
            }
        } else {
            s.push_str(w);
        }
        self.words_left -= 1;
        if self.words_left == 0 {
            s.push('.');
        } else if self.words_left > 2 && self.rng.next_u64().is_multiple_of(9) {
            s.push(',');
        }
        s
    }

    /// The next words, until they spell at least `tokens` of `vocab`'s tokens, the first
    /// without its leading space (text that opens a block or an answer): each word's text
    /// and its tokens.
    pub fn words_for(&mut self, vocab: &Vocabulary, tokens: usize) -> Vec<(String, Vec<u32>)> {
        let (mut words, mut spelled) = (Vec::new(), 0);
        while spelled < tokens {
            let word = self.next_word();
            let word = if words.is_empty() {
                word.trim_start().to_string()
            } else {
                word
            };
            let ids = vocab.encode(&word);
            spelled += ids.len();
            words.push((word, ids));
        }
        words
    }
}

/// `--tokens text`.
#[derive(Debug, Clone)]
pub struct TextTokens {
    pub seed: u64,
    pub vocab: Arc<Vocabulary>,
}

impl TokenSource for TextTokens {
    fn stream_for(&self, req: &EngineCoreRequest) -> Box<dyn TokenStream> {
        Box::new(TextStream {
            prose: Prose::new(stream_seed(self.seed, req)),
            vocab: self.vocab.clone(),
            pending: VecDeque::new(),
        })
    }

    fn describe(&self) -> String {
        format!(
            "text (seed {}, tokenizer of {})",
            self.seed, self.vocab.source
        )
    }
}

struct TextStream {
    prose: Prose,
    vocab: Arc<Vocabulary>,
    pending: VecDeque<u32>,
}

impl TokenStream for TextStream {
    fn free_text(&self) -> bool {
        true
    }

    fn next_token(&mut self, _avoid: &[u32]) -> u32 {
        for _ in 0..8 {
            if let Some(t) = self.pending.pop_front() {
                return t;
            }
            let word = self.prose.next_word();
            self.pending.extend(self.vocab.encode(&word));
        }
        // a tokenizer that encodes words to nothing: fall back to the first letter's bytes
        self.vocab.encode("a").first().copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sim_protocol::SamplingParams;

    fn req(id: &str) -> EngineCoreRequest {
        EngineCoreRequest {
            request_id: id.into(),
            prompt_token_ids: Some(vec![10, 11]),
            sampling_params: Some(SamplingParams::default()),
            ..Default::default()
        }
    }

    fn text(src: &TextTokens, id: &str, n: usize) -> String {
        let mut s = src.stream_for(&req(id));
        let ids: Vec<u32> = (0..n).map(|_| s.next_token(&[])).collect();
        src.vocab.decode(&ids)
    }

    #[test]
    fn text_reads_as_sentences_and_is_seeded() {
        let src = TextTokens {
            seed: 7,
            vocab: Vocabulary::embedded(),
        };
        let a = text(&src, "r1", 300);
        assert_eq!(a, text(&src, "r1", 300), "same seed and request, same text");
        assert_ne!(a, text(&src, "r2", 300));
        assert!(a.chars().next().unwrap().is_uppercase(), "{a}");
        assert!(a.contains(". "), "{a}");
        let words: Vec<&str> = a.split_whitespace().collect();
        assert!(words.len() > 30, "{a}");
        for w in &words[..words.len() - 1] {
            let bare = w.trim_end_matches(['.', ',']).to_lowercase();
            assert!(WORDS.contains(&bare.as_str()), "{w} in {a}");
        }
    }
}
