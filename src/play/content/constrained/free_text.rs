//! Free text under a grammar (xgrammar's `any_text` inside a structural tag's `tag`): the
//! walker writes prose there and closes it with the tag's end after a length the engine
//! decides. A think block that opens the answer (what vllm-rs puts before the calls of
//! `tool_choice: required` behind a reasoning parser) spends `--reasoning-share` of the
//! answer, as the blocks of free-text answers do ([`Reasoning::wrap`]); other free text (an
//! XML argument's value) a few words.
//!
//! Left to the token-by-token walker, free text would not end: its end is a run of ordinary
//! tokens (`</think>`), which sampling finds only by chance, so the answer would run to
//! `max_tokens`.
//!
//! A call's index that a tag leaves free (a number right after its begin: Kimi K2's
//! `functions.NAME:` then `\d+`, what vllm-rs and xgrammar send for it) is written here
//! too, as the call's place in the answer: 0 for the first call, 1 for the second, as the
//! model numbers them. Drawn freely, two calls of one answer could carry one id, and
//! vllm-rs hands such calls to the client as one, their arguments run together.
//!
//! [`Reasoning::wrap`]: crate::play::content::reasoning::Reasoning::wrap

use std::collections::VecDeque;

use llguidance::toktrie::SimpleVob;
use serde_json::Value;

use crate::play::content::text::Prose;
use crate::play::content::tokens::SplitMix64;
use crate::play::content::vocab::Vocabulary;

use super::grammar::{const_value, free_text_of, is_any_text, tag_begin, tag_ends};

/// A `tag` whose content is free text.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct FreeTag {
    begin: String,
    /// The end the engine writes (the tag's first).
    end: String,
    /// The `any_text`'s own bound on its tokens.
    max_tokens: Option<u64>,
    /// Whether the tag asks for some text (Beam's think block opens with a character that
    /// is not its end's): at least a word, however short the block's share.
    nonempty: bool,
}

impl FreeTag {
    /// The free-text tag `f` is, if it is one with an end (text without an end runs to the
    /// answer's, which the walker ends as it ends any answer).
    fn of(f: &Value) -> Option<FreeTag> {
        let whole = f.get("content")?;
        let content = free_text_of(whole)?;
        if f.get("type").and_then(Value::as_str) != Some("tag") || !is_any_text(content) {
            return None;
        }
        let begin = tag_begin(f).ok()?;
        let (ends, _) = tag_ends(f, &begin).ok()?;
        Some(FreeTag {
            begin,
            end: ends.into_iter().next()?,
            max_tokens: content.get("max_tokens").and_then(Value::as_u64),
            nonempty: !std::ptr::eq(whole, content),
        })
    }
}

/// A `tag` whose content opens with a number the tag leaves free: the call's index.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct IndexedTag {
    begin: String,
    /// The literal that follows the number (Kimi K2's `<|tool_call_argument_begin|>`, or
    /// the tag's end when the number is all its content), written with it so that the
    /// number ends there; `""` when no literal follows.
    after: String,
}

impl IndexedTag {
    /// The indexed tag `f` is, if it is one.
    fn of(f: &Value) -> Option<IndexedTag> {
        if f.get("type").and_then(Value::as_str) != Some("tag") {
            return None;
        }
        let content = f.get("content")?;
        let begin = tag_begin(f).ok()?;
        let (first, next) = match content.get("type").and_then(Value::as_str)? {
            "sequence" => {
                let elements = content.get("elements")?.as_array()?;
                (elements.first()?, elements.get(1))
            }
            _ => (content, None),
        };
        let pattern = first
            .get("pattern")
            .and_then(Value::as_str)
            .filter(|_| first.get("type").and_then(Value::as_str) == Some("regex"))?;
        if !is_number(pattern) {
            return None;
        }
        let after = match next {
            Some(n) => n
                .get("value")
                .and_then(Value::as_str)
                .filter(|_| n.get("type").and_then(Value::as_str) == Some("const_string"))
                .map(str::to_string),
            None => tag_ends(f, &begin).ok()?.0.into_iter().next(),
        };
        Some(IndexedTag {
            begin,
            after: after.unwrap_or_default(),
        })
    }
}

/// Whether a regex is a bare run of decimal digits: what a tag leaves free for a number it
/// does not fix.
fn is_number(pattern: &str) -> bool {
    matches!(pattern, "\\d+" | "\\d*" | "[0-9]+" | "[0-9]*")
}

/// Where a structural tag leaves the text free, and how long the think block it opens
/// with is.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct FreeTextPlan {
    tags: Vec<FreeTag>,
    /// The tags whose index the walker writes.
    indexed: Vec<IndexedTag>,
    /// The free-text tag the answer opens with (a think block), and the tokens it spends,
    /// its begin and end included.
    lead: Option<(FreeTag, u64)>,
}

impl FreeTextPlan {
    /// The free-text tags of a structural tag's `format`; a think block that opens the
    /// answer spends `lead_tokens`.
    pub(super) fn of(format: &Value, lead_tokens: u64) -> FreeTextPlan {
        let mut plan = FreeTextPlan::default();
        collect(format, &mut plan);
        plan.lead = leading(format)
            .and_then(FreeTag::of)
            .map(|t| (t, lead_tokens));
        plan
    }
}

/// Every free-text tag and every indexed tag of a format, wherever it is nested.
fn collect(f: &Value, out: &mut FreeTextPlan) {
    if let Some(t) = FreeTag::of(f) {
        out.tags.push(t);
        return;
    }
    // free text between two strings of a sequence (`<arg_value>`, the text,
    // `</arg_value>`): the first opens it, the second ends it
    if f.get("type").and_then(Value::as_str) == Some("sequence")
        && let Some(elements) = f.get("elements").and_then(Value::as_array)
    {
        for w in elements.windows(3) {
            if let (Some(begin), true, Some(end)) =
                (const_value(&w[0]), is_any_text(&w[1]), const_value(&w[2]))
                && !begin.is_empty()
                && !end.is_empty()
            {
                out.tags.push(FreeTag {
                    begin: begin.to_string(),
                    end: end.to_string(),
                    max_tokens: w[1].get("max_tokens").and_then(Value::as_u64),
                    nonempty: false,
                });
            }
        }
    }
    if let Some(t) = IndexedTag::of(f) {
        out.indexed.push(t);
    }
    for key in ["elements", "tags"] {
        for e in f.get(key).and_then(Value::as_array).into_iter().flatten() {
            collect(e, out);
        }
    }
    if let Some(c) = f.get("content") {
        collect(c, out);
    }
}

/// The format an answer opens with: a sequence's first element, an optional's content.
fn leading(f: &Value) -> Option<&Value> {
    match f.get("type").and_then(Value::as_str)? {
        "sequence" => leading(f.get("elements")?.as_array()?.first()?),
        "optional" => leading(f.get("content")?),
        _ => Some(f),
    }
}

/// The walker's free text: it watches the text handed out for a free-text tag's begin, and
/// then writes the tag's text and end.
pub(super) struct FreeText {
    plan: FreeTextPlan,
    /// The last bytes handed out, as many as the longest begin.
    tail: Vec<u8>,
    longest: usize,
    /// What is left to write: an open tag's text and then its end, or, at the answer's start,
    /// the rest of the think block's begin (vllm-rs makes the block optional).
    queue: VecDeque<u32>,
    /// While the answer may still open with the think block: what it has written so far.
    opening: Option<Vec<u8>>,
    /// How many of `queue`'s last tokens are the open tag's end.
    end_len: usize,
    /// The indexed tags begun so far: the next one's index.
    calls: u64,
    /// While an index is being written: what is left of it and of the literal after it.
    /// The grammar forces the literal once it has begun, and those tokens do not come from
    /// `queue`: what is handed out is followed here, not what the queue gave.
    index_rest: Option<String>,
}

/// What writing free text needs from the stream.
pub(super) struct Pen<'a> {
    pub vocab: &'a Vocabulary,
    pub prose: &'a mut Prose,
    pub rng: &'a mut SplitMix64,
}

impl FreeText {
    pub(super) fn new(plan: FreeTextPlan, pen: Pen) -> FreeText {
        let begins = plan.tags.iter().map(|t| &t.begin);
        let longest = begins
            .chain(plan.indexed.iter().map(|t| &t.begin))
            .map(String::len)
            .max()
            .unwrap_or(0);
        let mut free = FreeText {
            plan,
            tail: Vec::new(),
            longest,
            queue: VecDeque::new(),
            opening: None,
            end_len: 0,
            calls: 0,
            index_rest: None,
        };
        if let Some((lead, _)) = &free.plan.lead {
            if lead.begin.is_empty() {
                // the prompt opened the block: the answer starts inside it
                free.open_lead(pen);
            } else {
                free.queue.extend(pen.vocab.encode(&lead.begin));
                free.opening = Some(Vec::new());
            }
        }
        free
    }

    /// Whether a tag's text is being written.
    fn in_text(&self) -> bool {
        self.end_len > 0
    }

    /// A token was handed out: when it completes a free-text tag's begin, that tag's text
    /// and end are what comes next; an indexed tag's, its index.
    pub(super) fn saw(&mut self, bytes: &[u8], pen: Pen) {
        self.follow_opening(bytes, pen.vocab);
        self.follow_index(bytes, pen.vocab);
        if (self.plan.tags.is_empty() && self.plan.indexed.is_empty()) || self.in_text() {
            return;
        }
        self.tail.extend_from_slice(bytes);
        let cut = self.tail.len().saturating_sub(self.longest);
        self.tail.drain(..cut);
        let begun = |t: &FreeTag| !t.begin.is_empty() && self.tail.ends_with(t.begin.as_bytes());
        let begun_indexed =
            |t: &IndexedTag| !t.begin.is_empty() && self.tail.ends_with(t.begin.as_bytes());
        if self.plan.lead.as_ref().is_some_and(|(t, _)| begun(t)) {
            self.open_lead(pen);
        } else if let Some(tag) = self.plan.tags.iter().find(|t| begun(t)).cloned() {
            // a value's worth of words
            let tokens = 4 + pen.rng.next_u64() % 16;
            self.open(&tag, tokens, false, pen);
        } else if let Some(tag) = self.plan.indexed.iter().find(|t| begun_indexed(t)) {
            let index = format!("{}{}", self.calls, tag.after);
            self.calls += 1;
            self.tail.clear();
            self.write_index(index, pen.vocab);
        }
    }

    /// Plans `index` (a call's number and the literal after it) as what comes next. All of
    /// it is written, as a tag's end is: a budget nearly spent does not cut it, and the
    /// walker does not go on with digits of its own.
    fn write_index(&mut self, index: String, vocab: &Vocabulary) {
        self.queue.clear();
        self.queue.extend(vocab.encode(&index));
        self.end_len = self.queue.len();
        self.index_rest = Some(index);
    }

    /// Keeps the index being written in step with what is handed out; text that is not
    /// its continuation (or the end of it) ends it.
    fn follow_index(&mut self, bytes: &[u8], vocab: &Vocabulary) {
        let Some(rest) = self.index_rest.take() else {
            return;
        };
        let left = rest
            .as_bytes()
            .strip_prefix(bytes)
            .and_then(|r| std::str::from_utf8(r).ok())
            .filter(|r| !r.is_empty());
        match left {
            Some(left) => self.write_index(left.to_string(), vocab),
            None => {
                self.queue.clear();
                self.end_len = 0;
            }
        }
    }

    /// Keeps the rest of the think block's begin to write in step with the answer's start:
    /// the grammar may have forced part of it (the calls after it begin with the same `<`).
    /// Text that is no start of the begin means the answer does not think.
    fn follow_opening(&mut self, bytes: &[u8], vocab: &Vocabulary) {
        let (Some(written), Some((lead, _))) = (&mut self.opening, &self.plan.lead) else {
            return;
        };
        written.extend_from_slice(bytes);
        let rest = lead
            .begin
            .as_bytes()
            .strip_prefix(written.as_slice())
            .and_then(|r| std::str::from_utf8(r).ok())
            .filter(|r| !r.is_empty());
        self.queue.clear();
        match rest {
            Some(rest) => self.queue.extend(vocab.encode(rest)),
            None => self.opening = None,
        }
    }

    /// The think block the answer opens with: its text spends what is left of the block's
    /// tokens after its begin and end, framed by line breaks as thinking is written.
    fn open_lead(&mut self, pen: Pen) {
        let Some((tag, tokens)) = self.plan.lead.take() else {
            return;
        };
        let tags = pen.vocab.encode(&tag.begin).len() + pen.vocab.encode(&tag.end).len();
        self.open(&tag, tokens.saturating_sub(tags as u64), true, pen);
    }

    /// Plans `tag`'s text, about `tokens` of it (exactly, when `block`: a think block,
    /// whose length is its share of the answer), then its end.
    fn open(&mut self, tag: &FreeTag, tokens: u64, block: bool, pen: Pen) {
        let tokens = tag.max_tokens.map_or(tokens, |m| tokens.min(m));
        let tokens = if tag.nonempty { tokens.max(1) } else { tokens } as usize;
        let nl = pen.vocab.encode("\n");
        let framed = block && tokens > 2 * nl.len();
        let inner = if framed {
            tokens - 2 * nl.len()
        } else {
            tokens
        };
        let words = pen.prose.words_for(pen.vocab, inner);
        // a tag that asks for text gets its first word whole, however small its share
        let whole = match words.first() {
            Some((_, ids)) if tag.nonempty => ids.len(),
            _ => 0,
        };
        let mut text: Vec<u32> = words.into_iter().flat_map(|(_, ids)| ids).collect();
        if block {
            text.truncate(inner.max(whole));
        }
        let end = pen.vocab.encode(&tag.end);
        self.queue.clear();
        if framed {
            self.queue.extend(&nl);
        }
        self.queue.extend(text);
        if framed {
            self.queue.extend(&nl);
        }
        self.end_len = end.len();
        self.queue.extend(end);
        self.tail.clear();
    }

    /// The next token of the free text being written, if any. `tight`: the answer's budget
    /// is nearly spent, so an open tag ends now (and no think block starts).
    pub(super) fn next(&mut self, mask: &SimpleVob, tight: bool) -> Option<u32> {
        if tight {
            self.cut_to_end();
            self.opening = None;
        }
        loop {
            let &t = self.queue.front()?;
            if mask.is_allowed(t) {
                self.queue.pop_front();
                self.end_len = self.end_len.min(self.queue.len());
                return Some(t);
            }
            // the grammar refuses the text (an excluded string): end the tag now; refused
            // too, the grammar is not where the plan thought, and the walker decides
            if self.queue.len() > self.end_len {
                self.cut_to_end();
            } else {
                self.queue.clear();
                self.end_len = 0;
                return None;
            }
        }
    }

    /// Whether the walker's free text has nothing planned: no text or end to write, no
    /// think block the answer may still open with.
    pub(super) fn idle(&self) -> bool {
        self.queue.is_empty() && self.opening.is_none()
    }

    /// The grammar forces what comes next: in an open tag's end, the rest of it (and
    /// whatever fixed text follows, the next value's begin among it), which the grammar
    /// writes, so the plan's copy of the end goes and the next begin is watched for again.
    pub(super) fn grammar_writes(&mut self) {
        if self.in_text() && self.queue.len() <= self.end_len {
            self.queue.clear();
            self.end_len = 0;
        }
    }

    /// Drops what is left of the text: only the end remains to write.
    fn cut_to_end(&mut self) {
        let text = self.queue.len() - self.end_len;
        self.queue.drain(..text);
    }
}
