//! The token masks and the walker: a [`GrammarJob`] compiles into a [`ConstrainedStream`],
//! which samples one allowed token at a time, preferring whole words inside strings and
//! ending structures sooner the longer it runs.

use std::collections::VecDeque;
use std::sync::Arc;

use llguidance::Matcher;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::SimpleVob;
use serde_json::Value;
use sim_protocol::{EngineCoreRequest, StructuredOutputs};

use crate::play::content::text::Prose;
use crate::play::content::tokens::{SplitMix64, TokenStream, stream_seed};
use crate::play::content::vocab::{Specials, Vocabulary};

use super::free_text::{FreeText, FreeTextPlan, Pen};
use super::grammar::{grammar_for, specials_for, structural_tag_to_lark};
use super::tools::PromptTools;

/// A request's grammar and what its stream needs, ready to build and compile (see
/// [`super::Shaping::plan`]). Owns everything it uses, so it can run on another thread.
pub struct GrammarJob {
    pub(super) vocab: Arc<Vocabulary>,
    pub(super) recipe: Recipe,
    /// The constraint's kind, for messages.
    pub kind: &'static str,
    /// The request's stream seed ([`stream_seed`]).
    pub(super) seed: u64,
    pub(super) eos: u32,
    pub(super) max_tokens: Option<u64>,
    /// Where the grammar leaves the text free, and how long the walker makes it.
    pub(super) free: FreeTextPlan,
    /// Lark grammars of the calls the model would write in its own format (a structural
    /// tag's job, when the prompt shows tools): the answer is the first of them whose text
    /// the grammar admits from its start, as a model trained on that format writes it; the
    /// grammar is walked after it, or from the start when it admits none.
    pub(super) calls: Vec<String>,
}

/// What a [`GrammarJob`] builds its grammar from.
pub(super) enum Recipe {
    /// A request's structured outputs other than a structural tag.
    Structured(StructuredOutputs),
    /// A structural tag, read (and, for an open `triggered_tags`, decided), with the tools
    /// the prompt shows and the tokens its text matches ([`specials_for`]).
    Tag(Value, PromptTools, Specials),
    /// A grammar already built (a tool call under `auto`: the model's own text, its
    /// markers the special tokens they may be).
    Grammar(TopLevelGrammar),
}

impl std::fmt::Debug for GrammarJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarJob")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl GrammarJob {
    /// Build and compile the grammar into the request's stream; `Err` says why it cannot
    /// be generated (naming the kind).
    pub fn compile(self) -> Result<ConstrainedStream, String> {
        let GrammarJob {
            vocab,
            recipe,
            kind,
            seed,
            eos,
            max_tokens,
            free,
            calls,
        } = self;
        let fail =
            |why: String| format!("structured outputs of kind `{kind}` cannot be generated: {why}");
        let (grammar, specials) = match recipe {
            Recipe::Structured(so) => (
                grammar_for(&so, &PromptTools::default())?,
                specials_for(&so),
            ),
            Recipe::Tag(tag, tools, specials) => (
                TopLevelGrammar::from_lark(structural_tag_to_lark(&tag, &tools).map_err(fail)?),
                specials,
            ),
            Recipe::Grammar(g) => (g, Specials::AsText),
        };
        let parser = vocab
            .factory(specials)
            .create_parser(grammar)
            .map_err(|e| fail(first_line(&e.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(fail(first_line(&e)));
        }
        let own_calls = own_calls(&vocab, calls, seed, eos, max_tokens);
        let mut rng = SplitMix64(seed);
        let mut prose = Prose::new(seed ^ 0x5eed);
        let free = FreeText::new(
            free,
            Pen {
                vocab: &vocab,
                prose: &mut prose,
                rng: &mut rng,
            },
        );
        Ok(ConstrainedStream {
            matcher,
            rng,
            prose,
            free,
            vocab,
            word: VecDeque::new(),
            forced: VecDeque::new(),
            own_calls,
            own_call_tries: 0,
            sampled: 0,
            emitted: 0,
            digit_run: 0,
            in_exponent: false,
            max_tokens,
            eos,
            done: false,
            kind,
            failure: None,
        })
    }
}

/// Tokens under a grammar's mask, one at a time (see the module docs).
pub struct ConstrainedStream {
    matcher: Matcher,
    vocab: Arc<Vocabulary>,
    rng: SplitMix64,
    prose: Prose,
    /// The free text the grammar leaves, written as prose of a planned length.
    free: FreeText,
    /// The rest of the word being spelled.
    word: VecDeque<u32>,
    /// Tokens the grammar forced, already consumed by the matcher.
    forced: VecDeque<u32>,
    /// Calls in the model's own format ([`GrammarJob::calls`], as tokens): the first the
    /// grammar admits where the walker's free text leaves off (the answer's start, or the
    /// end of the think block it opens with) is written there.
    own_calls: Vec<Vec<u32>>,
    /// Steps tried since the free text left off; the calls are dropped after a few.
    own_call_tries: u32,
    sampled: u32,
    /// Tokens handed out so far, forced ones included.
    emitted: u64,
    /// Digits written since the last other character: a number's length so far.
    digit_run: u32,
    /// Whether the number being written is in its exponent (its digits then count from
    /// [`MAX_DIGITS`] − 2, so it takes one or two).
    in_exponent: bool,
    /// The request's `max_tokens`: what is left of it decides whether another structure
    /// is opened and how soon open ones close.
    max_tokens: Option<u64>,
    /// What the request stops on once the grammar is complete.
    eos: u32,
    done: bool,
    /// The constraint's kind, for the failure message.
    kind: &'static str,
    /// Why the grammar could not be followed (see [`TokenStream::failure`]).
    failure: Option<String>,
}

impl ConstrainedStream {
    /// A stream for `req` under `grammar`; `Err` when the grammar does not compile.
    pub fn new(
        vocab: Arc<Vocabulary>,
        grammar: TopLevelGrammar,
        req: &EngineCoreRequest,
        seed: u64,
    ) -> Result<Self, String> {
        let sp = req.sampling_params.as_ref();
        GrammarJob {
            eos: sp.and_then(|sp| sp.eos_token_id).unwrap_or(vocab.eos),
            vocab,
            recipe: Recipe::Grammar(grammar),
            kind: "grammar",
            seed: stream_seed(seed, req),
            max_tokens: sp.and_then(|sp| sp.max_tokens).map(u64::from),
            free: FreeTextPlan::default(),
            calls: Vec::new(),
        }
        .compile()
    }

    fn unit(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn finish(&mut self) -> u32 {
        self.done = true;
        self.eos
    }

    /// Where the free text leaves off: the first own call the grammar admits whole from
    /// here, consumed, its first token returned and the rest queued. Tried for a few steps
    /// (the grammar may still force a few characters the calls do not write, which the
    /// walker writes meanwhile), then given up.
    fn own_call(&mut self) -> Option<u32> {
        /// Steps after the free text left off in which the calls are tried.
        const TRIES: u32 = 8;
        self.own_call_tries += 1;
        if self.own_call_tries > TRIES {
            self.own_calls.clear();
            return None;
        }
        let i = self
            .own_calls
            .iter()
            .position(|ids| self.matcher.validate_tokens(ids).ok() == Some(ids.len()))?;
        let ids = self.own_calls.swap_remove(i);
        self.own_calls.clear();
        self.matcher.consume_tokens(&ids).ok()?;
        self.word.clear();
        let (&first, rest) = ids.split_first()?;
        self.forced.extend(rest);
        Some(first)
    }

    /// The grammar cannot be followed any further: say why (its backend's reason, without
    /// the parser dump llguidance appends) and end the stream.
    fn fail(&mut self, why: &str) -> u32 {
        let why = first_line(why);
        let why = if why.is_empty() {
            "the grammar allows no further token".to_string()
        } else {
            why
        };
        self.failure = Some(format!(
            "structured outputs of kind `{}` could not be completed after {} tokens: {why} \
             (the grammar is too large, or recursive without a way out, for the engine's grammar backend)",
            self.kind, self.emitted
        ));
        self.finish()
    }

    /// Tokens left under `max_tokens` after the one being chosen.
    fn left(&self) -> Option<u64> {
        self.max_tokens.map(|m| m.saturating_sub(self.emitted + 1))
    }

    /// The budget is nearly spent: close what is open as fast as the grammar allows, so the
    /// answer is complete rather than cut at `length`.
    fn tight(&self) -> bool {
        self.left()
            .zip(self.max_tokens)
            .is_some_and(|(l, m)| l < (m / 4).max(8))
    }

    fn pick(&mut self, mask: &SimpleVob, avoid: &[u32]) -> Option<u32> {
        let n = f64::from(self.sampled);
        let trie_eos = self.vocab.eos;
        let left = self.left();
        let tight = self.tight();
        // 1. go on spelling the current word
        if let Some(&w) = self.word.front() {
            if mask.is_allowed(w) && !tight && self.unit() < 0.9 {
                self.word.pop_front();
                return Some(w);
            }
            self.word.clear();
        }
        let space = self.vocab.encode(" ");
        let free_text = matches!(space[..], [t] if mask.is_allowed(t));
        let can_end = mask.is_allowed(trie_eos) && !avoid.contains(&self.eos);
        // 2. the grammar is complete and could go on with another structure (a further
        //    tool call, another item): end here when one more like what was written so far
        //    would not fit in what is left of `max_tokens`, and mostly end anyway (a model
        //    that has made its call stops)
        if can_end && !free_text {
            let no_room = left.is_some_and(|l| l < self.emitted);
            if no_room || tight || self.unit() < 0.85 {
                return Some(trie_eos);
            }
        }
        // 3. at a word boundary, end what is open, more likely the longer the output
        let p_end = if self.sampled > 400 || tight {
            1.0
        } else {
            (0.08 + n / 60.0).min(0.95)
        };
        if self.unit() < p_end {
            if can_end {
                return Some(trie_eos);
            }
            // a quote first: inside a string it is the only closer (a bracket there is text);
            // `/` last, after a `<` that could open another element or close the one
            // around it (`</minimax:tool_call>` after a call)
            for closer in [&b"\""[..], b"}", b"]", b")", b"/"] {
                let ids = self
                    .vocab
                    .encode(std::str::from_utf8(closer).unwrap_or_default());
                if let [t] = ids[..]
                    && mask.is_allowed(t)
                {
                    return Some(t);
                }
            }
        }
        // 4. start a new word where free text goes (the grammar takes a space here)
        if free_text && !tight && self.unit() < 0.75 {
            let w = self.prose.next_word();
            for text in [w.as_str(), w.trim_start()] {
                let ids = self.vocab.encode(text);
                if let Some(&first) = ids.first()
                    && mask.is_allowed(first)
                {
                    self.word.extend(&ids[1..]);
                    return Some(first);
                }
            }
        }
        // 5. the grammar is complete and only free text could follow (after the calls of a
        //    `required` answer): a model that has answered stops, rather than trail off into
        //    stray digits and brackets, which a client would get as `content`
        if can_end {
            return Some(trie_eos);
        }
        // 6. a class of allowed tokens (letters, digits, a closer, other punctuation, …),
        //    then a token of that class: short lexemes, and closing grows likelier
        let mut classes: Vec<(Class, Vec<u32>)> = Vec::new();
        let run = self.digit_run;
        mask.iter_set_entries(|t| {
            let t = t as u32;
            let class = if t == trie_eos {
                if avoid.contains(&self.eos) {
                    return;
                }
                Class::Eos
            } else if self.vocab.is_special(t) {
                return;
            } else if run > 0 && is_exponent(self.vocab.token_bytes(t)) {
                Class::Exponent
            } else {
                Class::of(self.vocab.token_bytes(t))
            };
            match classes.iter_mut().find(|(c, _)| *c == class) {
                Some((_, v)) => v.push(t),
                None => classes.push((class, vec![t])),
            }
        });
        let total: f64 = classes.iter().map(|(c, _)| c.weight(n, run)).sum();
        let mut x = self.unit() * total;
        for (c, ids) in &classes {
            let w = c.weight(n, run);
            if x < w {
                return Some(ids[(self.rng.next_u64() % ids.len() as u64) as usize]);
            }
            x -= w;
        }
        mask.first_bit_set().map(|t| t as u32)
    }
}

/// The first line of a grammar backend's error: llguidance appends its parser state and
/// the grammar, which are no use to a client.
pub(super) fn first_line(e: &str) -> String {
    e.lines().next().unwrap_or_default().trim().to_string()
}

/// The longest number the walker writes where the grammar lets it stop (see
/// [`Class::weight`]).
const MAX_DIGITS: u32 = 9;

/// Whether a token right after digits starts a number's exponent (`e`, `E+`, `e-12`, …).
fn is_exponent(b: &[u8]) -> bool {
    matches!(b.first(), Some(b'e' | b'E'))
        && b[1..]
            .iter()
            .all(|c| c.is_ascii_digit() || *c == b'+' || *c == b'-')
}

/// What a token looks like, for step 6 of [`ConstrainedStream::pick`].
#[derive(Debug, Clone, Copy, PartialEq)]
enum Class {
    Eos,
    Letters,
    Digits,
    /// `e`/`E` after digits: a number's exponent, which models seldom write.
    Exponent,
    Space,
    Quote,
    Punctuation,
    Other,
}

impl Class {
    fn of(b: &[u8]) -> Class {
        match b {
            [] => Class::Other,
            // only a quote: `}` or `]` inside a string is text (step 2 closes structures)
            [b'"'] => Class::Quote,
            _ if b.iter().all(u8::is_ascii_whitespace) => Class::Space,
            _ if b.iter().all(|c| c.is_ascii_alphabetic() || *c == b' ') => Class::Letters,
            _ if b.iter().all(u8::is_ascii_digit) => Class::Digits,
            _ if b.iter().all(|c| c.is_ascii_graphic() || *c == b' ') => Class::Punctuation,
            _ => Class::Other,
        }
    }

    /// `n`: tokens sampled so far; `digits`: the length of the number being written.
    /// A model writes short numbers: each digit makes another less likely, and none
    /// follows the ninth where the grammar allows anything else, so an integer stays
    /// inside the 64-bit range parsers read it into (vllm-rs's `qwen3_coder` keeps a
    /// 20-digit `integer` argument as a string).
    fn weight(&self, n: f64, digits: u32) -> f64 {
        match self {
            Class::Eos => 2.0 + n / 4.0,
            Class::Letters => 3.0,
            Class::Digits if digits >= MAX_DIGITS => 0.0,
            Class::Digits => 2.0 * 0.5f64.powi(digits as i32),
            Class::Exponent => 0.02,
            Class::Space => 0.3,
            Class::Quote => 1.0 + n / 8.0,
            Class::Punctuation => 0.5 + n / 20.0,
            Class::Other => 0.05,
        }
    }
}

impl TokenStream for ConstrainedStream {
    fn next_token(&mut self, avoid: &[u32]) -> u32 {
        let t = self.next_inner(avoid);
        if self.failure.is_none() && !self.done {
            self.emitted += 1;
            let bytes = self.vocab.token_bytes(t);
            let digits = !bytes.is_empty() && bytes.iter().all(u8::is_ascii_digit);
            let sign = !bytes.is_empty() && bytes.iter().all(|c| *c == b'+' || *c == b'-');
            let exponent = self.digit_run > 0 && is_exponent(bytes);
            self.digit_run = if digits {
                self.digit_run + bytes.len() as u32
            } else if exponent || (self.in_exponent && sign) {
                // an exponent takes a digit or two, so the number stays a finite f64
                MAX_DIGITS - 2
            } else {
                0
            };
            self.in_exponent = exponent || (self.in_exponent && (digits || sign));
            let pen = Pen {
                vocab: &self.vocab,
                prose: &mut self.prose,
                rng: &mut self.rng,
            };
            // a special token's text, which a tag's begin may hold (`<|channel|>`)
            self.free.saw(self.vocab.token_text(t), pen);
        }
        t
    }

    fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }
}

impl ConstrainedStream {
    fn next_inner(&mut self, avoid: &[u32]) -> u32 {
        if let Some(t) = self.forced.pop_front() {
            return t;
        }
        if self.failure.is_some() || self.done {
            return self.eos;
        }
        if self.matcher.is_stopped() {
            // a stop the grammar reached (complete, nothing can follow) ends the answer;
            // any other (an error, a lexer or parser past its limits) is a failure
            let reason = self.matcher.stop_reason();
            return match self.matcher.get_error() {
                Some(e) => self.fail(&e),
                None if reason.is_ok() => self.finish(),
                None => self.fail(&format!("the grammar backend stopped ({reason})")),
            };
        }
        if !self.own_calls.is_empty()
            && self.free.idle()
            && let Some(t) = self.own_call()
        {
            return t;
        }
        let ff = self.matcher.consume_ff_tokens();
        if let Some(e) = self.matcher.get_error() {
            return self.fail(&e);
        }
        if let Some((&first, rest)) = ff.split_first() {
            self.word.clear();
            self.free.grammar_writes();
            self.forced.extend(rest);
            return first;
        }
        if self.matcher.is_stopped() {
            return self.next_inner(avoid);
        }
        let mask = match self.matcher.compute_mask() {
            Ok(m) if !m.is_zero() => m,
            Ok(_) => return self.fail(""),
            Err(e) => return self.fail(&e.to_string()),
        };
        // free text the walker planned: not sampled, so it leaves the shaping of what
        // follows (how soon structures close) as it was
        let tight = self.tight();
        if let Some(t) = self.free.next(&mask, tight) {
            if let Err(e) = self.matcher.consume_token(t) {
                return self.fail(&e.to_string());
            }
            return t;
        }
        let Some(t) = self.pick(&mask, avoid) else {
            return self.fail("");
        };
        if t == self.vocab.eos {
            // only offered where the mask allows it: the grammar is complete
            return self.finish();
        }
        if let Err(e) = self.matcher.consume_token(t) {
            return self.fail(&e.to_string());
        }
        self.sampled += 1;
        t
    }
}

/// `calls` (Lark grammars of a call in the model's own format) as the tokens the engine
/// writes for each: those that end within `max_tokens` (a runaway grammar is given up).
fn own_calls(
    vocab: &Arc<Vocabulary>,
    calls: Vec<String>,
    seed: u64,
    eos: u32,
    max_tokens: Option<u64>,
) -> Vec<Vec<u32>> {
    /// How long a call may run before it is given up.
    const MAX_CALL_TOKENS: u64 = 4096;
    let limit = max_tokens.unwrap_or(MAX_CALL_TOKENS).min(MAX_CALL_TOKENS) as usize;
    let mut out = Vec::with_capacity(calls.len());
    for call in calls {
        let job = GrammarJob {
            vocab: vocab.clone(),
            recipe: Recipe::Grammar(TopLevelGrammar::from_lark(call)),
            kind: "tool call",
            seed,
            eos,
            max_tokens: Some(limit as u64),
            free: FreeTextPlan::default(),
            calls: Vec::new(),
        };
        let Ok(mut s) = job.compile() else {
            continue;
        };
        let mut ids = Vec::new();
        while ids.len() < limit {
            let t = s.next_token(&[]);
            if s.failure().is_some() {
                break;
            }
            if t == eos {
                if !ids.is_empty() {
                    out.push(std::mem::take(&mut ids));
                }
                break;
            }
            ids.push(t);
        }
    }
    out
}
