//! Lookups: a request id or a prompt's block hashes to a record, and why a lookup missed.

use std::fmt;

use super::ReplayIndex;

/// A served record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hit {
    /// The record's position in arrival order; read it with [`ReplayIndex::record`].
    pub record: usize,
    /// Blocks matched (prefix lookups; 0 for index lookups).
    pub depth: usize,
    /// The record had been served before (every candidate was consumed).
    pub reserve: bool,
}

/// A record named in a miss message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordRef {
    /// Position in arrival order.
    pub index: usize,
    /// The recorded request id.
    pub request_id: Option<String>,
    /// Length of the record's block-hash chain.
    pub blocks: usize,
}

impl fmt::Display for RecordRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "record {i} (replay-{i}", i = self.index)?;
        if let Some(id) = &self.request_id {
            write!(f, ", id {id}")?;
        }
        f.write_str(")")
    }
}

/// Why a lookup found nothing to serve. `Display` is the message for logs and for the
/// error a request finishes with; [`MissReason::kind`] is a short label for counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MissReason {
    /// The id has no `replay-<n>` token.
    BadId {
        /// The request id as the engine received it.
        id: String,
    },
    /// `replay-<n>` names a record past the end.
    OutOfRange {
        /// The request id as the engine received it.
        id: String,
        /// The `n` it names, its digits as the id gives them (a number past `u64` is
        /// reported as written, not saturated).
        index: String,
        /// Records in the index.
        records: usize,
    },
    /// The prompt has no full block to hash.
    ShortPrompt {
        /// The prompt's length.
        prompt_tokens: u32,
        /// The traces' block size, when declared.
        block_size: Option<u32>,
    },
    /// Not even the first block matches a record.
    NoRecord {
        /// Full blocks of the prompt.
        prompt_blocks: usize,
        /// Records in the trie (0: nothing could ever match).
        indexed: usize,
    },
    /// Some blocks match, but no record has exactly the prompt's full blocks.
    PartialPrefix {
        /// Blocks matched.
        depth: usize,
        /// Full blocks of the prompt.
        prompt_blocks: usize,
        /// The earliest-arriving record sharing the matched blocks.
        closest: RecordRef,
    },
    /// The chosen record has no `output_token_ids` (it was consumed all the same).
    NoTokens {
        /// The chosen record.
        record: RecordRef,
    },
    /// The chosen record has no timing (no `ttft_ms`; consumed all the same).
    NoSteps {
        /// The chosen record.
        record: RecordRef,
    },
}

impl MissReason {
    /// A short label: `bad_id`, `out_of_range`, `short_prompt`, `no_record`,
    /// `partial_prefix`, `no_tokens`, `no_steps`.
    pub fn kind(&self) -> &'static str {
        match self {
            MissReason::BadId { .. } => "bad_id",
            MissReason::OutOfRange { .. } => "out_of_range",
            MissReason::ShortPrompt { .. } => "short_prompt",
            MissReason::NoRecord { .. } => "no_record",
            MissReason::PartialPrefix { .. } => "partial_prefix",
            MissReason::NoTokens { .. } => "no_tokens",
            MissReason::NoSteps { .. } => "no_steps",
        }
    }

    /// The record the miss is about, if one was chosen or came closest.
    pub fn record(&self) -> Option<&RecordRef> {
        match self {
            MissReason::PartialPrefix { closest: r, .. }
            | MissReason::NoTokens { record: r }
            | MissReason::NoSteps { record: r } => Some(r),
            _ => None,
        }
    }
}

impl fmt::Display for MissReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MissReason::BadId { id } => write!(
                f,
                "request id `{id}` contains no `replay-<n>` (--replay-match index needs the client to name requests `replay-<i>`, i = the record's position in arrival order; the frontend may wrap it, e.g. `cmpl-replay-17-0-…`), or use --replay-match prefix"
            ),
            MissReason::OutOfRange { id, index, records } => write!(
                f,
                "request id `{id}` names record {index}, but the replay traces hold {records} records (replay-0 … replay-{})",
                records.saturating_sub(1)
            ),
            MissReason::ShortPrompt {
                prompt_tokens,
                block_size: Some(b),
            } => write!(
                f,
                "prompt shorter than one block ({prompt_tokens} tokens < block size {b})"
            ),
            MissReason::ShortPrompt {
                prompt_tokens,
                block_size: None,
            } => write!(
                f,
                "prompt has no full block to hash ({prompt_tokens} tokens; the traces declare no block_size)"
            ),
            MissReason::NoRecord { indexed: 0, .. } => f.write_str(
                "no record has integer block hashes to match against (the traces carry no block_hashes, or only string ones)",
            ),
            MissReason::NoRecord { prompt_blocks, .. } => write!(
                f,
                "no record shares the first block (the prompt has {prompt_blocks} blocks)"
            ),
            MissReason::PartialPrefix {
                depth,
                prompt_blocks,
                closest,
            } if depth < prompt_blocks => write!(
                f,
                "prompt diverges from {closest} after {depth} of {prompt_blocks} blocks (the record has {})",
                closest.blocks
            ),
            MissReason::PartialPrefix {
                prompt_blocks,
                closest,
                ..
            } => write!(
                f,
                "all {prompt_blocks} prompt blocks match {closest}, but every record there is longer ({} blocks)",
                closest.blocks
            ),
            MissReason::NoTokens { record } => write!(
                f,
                "{record} has no output_token_ids (recorded without --record-tokens, or cut off)"
            ),
            MissReason::NoSteps { record } => write!(
                f,
                "{record} has no recorded timing (no ttft_ms: it ended before its first token)"
            ),
        }
    }
}

impl std::error::Error for MissReason {}

/// The `n` of the last standalone `replay-<n>` in `id` (see the module docs for what
/// standalone means). Saturates at `u64::MAX` (then out of range) rather than failing.
pub fn parse_replay_index(id: &str) -> Option<u64> {
    replay_digits(id).map(|d| {
        d.bytes().fold(0u64, |n, c| {
            n.saturating_mul(10).saturating_add(u64::from(c - b'0'))
        })
    })
}

/// The digits of the last standalone `replay-<n>` in `id`, as written.
fn replay_digits(id: &str) -> Option<&str> {
    const TAG: &[u8] = b"replay-";
    let b = id.as_bytes();
    let mut found = None;
    let mut from = 0;
    while let Some(pos) = b[from..].windows(TAG.len()).position(|w| w == TAG) {
        let start = from + pos;
        from = start + 1;
        let digits = start + TAG.len();
        let end = digits
            + b[digits..]
                .iter()
                .take_while(|c| c.is_ascii_digit())
                .count();
        let before_ok = start == 0 || !b[start - 1].is_ascii_alphanumeric();
        let after_ok = end == b.len() || !b[end].is_ascii_alphanumeric();
        if end > digits && before_ok && after_ok {
            found = Some(&id[digits..end]);
        }
    }
    found
}

impl ReplayIndex {
    /// `--replay-match index`: the record named by the last `replay-<n>` in `request_id`.
    /// Consumes it; a record served before is a re-serve.
    pub fn lookup_index(&mut self, request_id: &str) -> Result<Hit, MissReason> {
        let result = self.index_hit(request_id);
        self.count(result)
    }

    fn index_hit(&mut self, request_id: &str) -> Result<Hit, MissReason> {
        let Some(n) = parse_replay_index(request_id) else {
            return Err(MissReason::BadId {
                id: request_id.to_string(),
            });
        };
        let i = usize::try_from(n)
            .ok()
            .filter(|&i| i < self.records.len())
            .ok_or_else(|| MissReason::OutOfRange {
                id: request_id.to_string(),
                index: replay_digits(request_id).unwrap_or_default().to_string(),
                records: self.records.len(),
            })?;
        self.take(i, 0)
    }

    /// `--replay-match prefix`: the record whose block-hash chain is the prompt's
    /// (`prompt_hashes`, computed with [`block_size`](Self::block_size)); `prompt_tokens` is
    /// the prompt's length, to prefer records with the same unhashed tail. See the module
    /// docs for the rules.
    pub fn lookup_prefix(
        &mut self,
        prompt_hashes: &[u64],
        prompt_tokens: u32,
    ) -> Result<Hit, MissReason> {
        // a prompt without a full block counts at depth 0
        let (depth, node) = self.trie.walk(prompt_hashes);
        *self.stats.prefix_depth.entry(depth).or_default() += 1;
        let result = self.prefix_hit(prompt_hashes, prompt_tokens, depth, node);
        self.count(result)
    }

    fn prefix_hit(
        &mut self,
        hashes: &[u64],
        prompt_tokens: u32,
        depth: usize,
        node: u32,
    ) -> Result<Hit, MissReason> {
        if hashes.is_empty() {
            return Err(MissReason::ShortPrompt {
                prompt_tokens,
                block_size: self.block_size,
            });
        }
        if depth == 0 {
            return Err(MissReason::NoRecord {
                prompt_blocks: hashes.len(),
                indexed: self.trie.indexed,
            });
        }
        if depth == hashes.len()
            && let Some(i) = self.trie.select(node, prompt_tokens, &self.consumed)
        {
            return self.take(i, depth);
        }
        let closest = self
            .trie
            .closest(node)
            .expect("a non-root node has a record");
        Err(MissReason::PartialPrefix {
            depth,
            prompt_blocks: hashes.len(),
            closest: self.record(closest).to_ref(),
        })
    }

    /// Consume record `i` and check it carries what the index serves.
    fn take(&mut self, i: usize, depth: usize) -> Result<Hit, MissReason> {
        let reserve = std::mem::replace(&mut self.consumed[i], true);
        let rec = &self.records[i];
        if self.opts.tokens && rec.tokens.is_none() {
            return Err(MissReason::NoTokens {
                record: self.record(i).to_ref(),
            });
        }
        if self.opts.steps && rec.ttft_ms.is_none() {
            return Err(MissReason::NoSteps {
                record: self.record(i).to_ref(),
            });
        }
        Ok(Hit {
            record: i,
            depth,
            reserve,
        })
    }

    fn count(&mut self, result: Result<Hit, MissReason>) -> Result<Hit, MissReason> {
        match &result {
            Ok(hit) => {
                self.stats.served += 1;
                self.stats.reserved += u64::from(hit.reserve);
            }
            Err(miss) => *self.stats.missed.entry(miss.kind()).or_default() += 1,
        }
        result
    }
}
