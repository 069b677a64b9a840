//! The record index that `play --replay-tokens` / `--replay-steps` serve from.
//!
//! A replaying engine answers each incoming request with a recorded one: its generated
//! token ids (`--replay-tokens`, traces captured with `record --record-tokens`) and/or its
//! per-chunk timing (`--replay-steps`). [`ReplayIndex::load`] streams one or more traces
//! (`.gz` transparently) and keeps only what serving needs; the engine then asks, per
//! request, for a record with [`ReplayIndex::lookup_index`] or [`ReplayIndex::lookup_prefix`]
//! and reads the hit through [`ReplayIndex::record`]. The module knows nothing of the wire
//! protocol: the engine turns a request into an id or into block hashes.
//!
//! # Arrival order
//!
//! Traces are written in finish order. The index orders records by `arrival_ms` with a
//! stable sort over all files (file order, then line order, breaks ties); records without
//! `arrival_ms` come after every timed record, in file and line order (a harness that only
//! enumerates the timed records gets the same numbers). Record `i` is the i-th in that
//! order: the `i` of `replay-<i>` and of every [`Hit::record`].
//!
//! # `--replay-match index`
//!
//! The request id must contain `replay-<digits>`: the number of the LAST such occurrence
//! is the record. The token must stand on its own — not preceded by a letter or digit,
//! and the digits not followed by one — so a frontend's additions (`cmpl-replay-17-0-3f2a9c1b`,
//! `chatcmpl-replay-17-5d1e…`) are skipped, while `xreplay-3` or `replay-3f2a` (a hex
//! id) are refused rather than read as another record. There is no fallback to a bare
//! trailing number: frontends append their own numeric suffixes, so that could silently
//! serve the wrong record. A miss says what the id looked like.
//!
//! # `--replay-match prefix`
//!
//! The engine computes the prompt's chained block hashes with the function the tap uses
//! (vLLM's sha256 hash as 64 bits, LoRA and cache-salt keys included) and **the trace's
//! [`block_size`](ReplayIndex::block_size)**, not its own. The records' `block_hashes`
//! form a trie (keyed by parent node and hash, so it is correct even for unchained
//! hashes). Then:
//!
//! 1. The longest shared prefix wins: the walk goes as deep as the prompt's hashes match.
//! 2. It is a hit only when every full block of the prompt matched (depth =
//!    `prompt_hashes.len()` ≥ 1) and some record's own chain ends there. Otherwise it is a
//!    miss naming the depth, the prompt's block count and the closest record (the
//!    earliest-arriving one sharing the matched prefix).
//! 3. Among the records whose chain ends there, unconsumed ones come first, then those
//!    whose `prompt_tokens` equals the request's (the same prompt up to the unhashed
//!    tail), then arrival order.
//! 4. A record is consumed by its first match, so duplicate prompts take the duplicate
//!    records one to one, in arrival order. Once all are consumed the best one (same
//!    ordering, consumption ignored) is served again and the hit says it is a re-serve.
//!
//! A prompt shorter than one block cannot match (`short_prompt`). Records with string
//! (non-integer) block hashes cannot be matched; the load counts them in a
//! [warning](ReplayIndex::warnings).
//!
//! # Serving
//!
//! A chosen record must carry what the index was loaded for: with `tokens` its
//! `output_token_ids`, with `steps` its `ttft_ms`. A record without them is consumed but
//! the lookup misses (`no_tokens`, `no_steps`), so the pairing of requests to records
//! stays one to one.
//!
//! # Sharing
//!
//! Lookups consume records, so they take `&mut self`. The index is `Send + Sync`: an
//! engine process running several DP ranks should share ONE index behind
//! `Arc<Mutex<ReplayIndex>>` (a lookup holds the lock for microseconds), so a record is
//! consumed once across ranks and the memory is not duplicated. Separate indexes per rank
//! also work for `index` matching (ids are unique), but under `prefix` each rank pairs
//! duplicate prompts on its own, so the same record can be served by two ranks without
//! being counted as a re-serve.

#![warn(missing_docs)]

mod load;
mod lookup;
mod prefix;
mod stats;

use std::path::{Path, PathBuf};

use crate::trace::TraceError;

pub use lookup::{Hit, MissReason, RecordRef, parse_replay_index};
pub use stats::ReplayStats;

/// What [`ReplayIndex::load`] keeps besides the prefix structure and the per-record shape.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayLoadOptions {
    /// Keep the recorded output token ids (`--replay-tokens`); every file must carry some.
    pub tokens: bool,
    /// Keep the recorded timing: ttft, inter-chunk gaps and chunk sizes (`--replay-steps`).
    pub steps: bool,
}

/// Why a trace cannot be indexed. Every variant names the file it is about.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// Opening, reading or parsing a trace failed (a bad line is fatal: skipping it would
    /// shift every later record's index).
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// No trace path was given.
    #[error("no replay trace given")]
    NoPaths,
    /// The files contain no request record at all.
    #[error("no request records in {paths}")]
    Empty {
        /// The paths, comma-separated.
        paths: String,
    },
    /// Two meta lines disagree on `block_size`: one prefix index cannot serve both.
    #[error(
        "{}: meta block_size {found} disagrees with block_size {expected} of {}; traces replayed together must be captured with one block size",
        path.display(), first.display()
    )]
    BlockSizeMismatch {
        /// The file with the disagreeing meta line.
        path: PathBuf,
        /// Its block size.
        found: u32,
        /// The file that declared a block size first.
        first: PathBuf,
        /// That file's block size.
        expected: u32,
    },
    /// `tokens` was asked for but a file has no `output_token_ids` on any record.
    #[error(
        "{}: no record carries output_token_ids, so its tokens cannot be replayed; capture with `vllm-vcr record --record-tokens`",
        path.display()
    )]
    NoTokenIds {
        /// The file without token ids.
        path: PathBuf,
    },
    /// `steps` was asked for but a file has no `ttft_ms` on any record.
    #[error(
        "{}: no record carries timing (ttft_ms), so its steps cannot be replayed; use a trace written by `vllm-vcr record`",
        path.display()
    )]
    NoTiming {
        /// The file without timing.
        path: PathBuf,
    },
    /// More records, tokens or trie nodes than the index's 32-bit counters hold.
    #[error("{}: too many {what} for one replay index", path.display())]
    TooLarge {
        /// The file being read when a counter overflowed.
        path: PathBuf,
        /// What overflowed (`records`, `token ids`, ...).
        what: &'static str,
    },
}

/// One loaded trace file, as the meta lines described it.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceFile {
    /// The path as given.
    pub path: PathBuf,
    /// Distinct `config_hash` values of the file's meta lines, in order (several when
    /// captures were concatenated); empty when no meta line carries one.
    pub config_hashes: Vec<String>,
    /// The file's `block_size`, when a meta line declares it.
    pub block_size: Option<u32>,
    /// Request records read from the file.
    pub records: usize,
}

impl TraceFile {
    /// The first `config_hash` of the file, for `--expect-config-hash` checks (which should
    /// also refuse files with several, see [`TraceFile::config_hashes`]).
    pub fn config_hash(&self) -> Option<&str> {
        self.config_hashes.first().map(String::as_str)
    }
}

/// A range of one of the flat arenas. 32-bit offsets keep records small; they cap an
/// arena at 4 G items (16 GiB of token ids), which loading checks.
#[derive(Debug, Clone, Copy, Default)]
struct Span {
    start: u32,
    len: u32,
}

impl Span {
    fn range(self) -> std::ops::Range<usize> {
        self.start as usize..self.start as usize + self.len as usize
    }
}

/// `Rec::finish` of a record without `finish_reason`.
const NO_FINISH: u16 = u16::MAX;

/// `Rec::reasoning` of a record without `reasoning_tokens` (a sentinel rather than an
/// `Option`, which would grow every record by 8 bytes).
const NO_REASONING: u32 = u32::MAX;

/// What the index keeps of one record (variable-length parts live in the arenas).
#[derive(Debug, Clone)]
struct Rec {
    id: Option<Span>,
    file: u32,
    line: u64,
    prompt_tokens: u32,
    output_tokens: u32,
    /// Integer block hashes of the record's chain (0 when it has string hashes).
    blocks: u32,
    /// Index into `ReplayIndex::finish_names`, or [`NO_FINISH`].
    finish: u16,
    incomplete: bool,
    /// Recorded `reasoning_tokens`, or [`NO_REASONING`].
    reasoning: u32,
    tokens: Option<Span>,
    ttft_ms: Option<f64>,
    first_chunk: u32,
    gaps: Span,
    /// Explicit chunk sizes; `None` = one token per later chunk.
    chunk_tokens: Option<Span>,
}

// The sharing the module docs promise.
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<ReplayIndex>();
};

// Records are the per-record fixed cost: keep them small.
const _: () = assert!(std::mem::size_of::<Rec>() <= 96);

/// The replay index: records in arrival order, their payloads in flat arenas, the prefix
/// trie, what has been consumed, and the counts. See the [module docs](self).
#[derive(Debug)]
pub struct ReplayIndex {
    opts: ReplayLoadOptions,
    block_size: Option<u32>,
    files: Vec<TraceFile>,
    warnings: Vec<String>,
    records: Vec<Rec>,
    /// Request ids, concatenated.
    ids: String,
    /// Distinct finish reasons (there are a handful), referenced by `Rec::finish`.
    finish_names: Vec<Box<str>>,
    tokens: Vec<u32>,
    /// Inter-chunk gaps in ms. `f32` halves the largest arena; its error at one second is
    /// below 0.1 µs, far under any engine's timing noise.
    gaps_ms: Vec<f32>,
    chunk_tokens: Vec<u32>,
    max_chunk_tokens: u32,
    trie: prefix::Trie,
    consumed: Vec<bool>,
    stats: ReplayStats,
}

impl ReplayIndex {
    /// Number of indexed records (the valid `replay-<i>` are `0..len()`).
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether no record is indexed (a loaded index never is: loading refuses that).
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// What the index was loaded with.
    pub fn options(&self) -> ReplayLoadOptions {
        self.opts
    }

    /// The traces' KV block size (the unit of their block hashes), when a meta line
    /// declares it. Prompt hashes for [`lookup_prefix`](Self::lookup_prefix) must be
    /// computed with this size.
    pub fn block_size(&self) -> Option<u32> {
        self.block_size
    }

    /// The loaded files, in the order given.
    pub fn files(&self) -> &[TraceFile] {
        &self.files
    }

    /// Things the load noticed that do not stop replay but change what can match (string
    /// hashes, records without tokens or arrival times, a truncated gzip stream, ...), one
    /// human-readable line each, for the engine to log.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Records that can be reached by [`lookup_prefix`](Self::lookup_prefix) (integer
    /// block hashes, at least one block).
    pub fn prefix_indexed(&self) -> usize {
        self.trie.indexed
    }

    /// The largest later-chunk size among the indexed timings (1 without speculative
    /// decoding bursts; 0 when not loaded with `steps`).
    pub fn max_chunk_tokens(&self) -> u32 {
        self.max_chunk_tokens
    }

    /// Counts of lookups so far.
    pub fn stats(&self) -> &ReplayStats {
        &self.stats
    }

    /// Approximate heap bytes held by the index (arenas, records, trie), for reports.
    pub fn memory_bytes(&self) -> usize {
        use std::mem::size_of;
        self.records.capacity() * size_of::<Rec>()
            + self.ids.capacity()
            + self.tokens.capacity() * 4
            + self.gaps_ms.capacity() * 4
            + self.chunk_tokens.capacity() * 4
            + self.consumed.capacity()
            + self.trie.memory_bytes()
    }

    /// Record `i` (arrival order). Panics when `i >= len()`, like slice indexing; a
    /// [`Hit::record`] is always in range.
    pub fn record(&self, i: usize) -> RecordView<'_> {
        RecordView {
            index: self,
            i,
            rec: &self.records[i],
        }
    }

    /// Whether record `i` has been served (or chosen) by a lookup already.
    pub fn is_consumed(&self, i: usize) -> bool {
        self.consumed[i]
    }
}

/// Read access to one indexed record.
#[derive(Debug, Clone, Copy)]
pub struct RecordView<'a> {
    index: &'a ReplayIndex,
    i: usize,
    rec: &'a Rec,
}

impl<'a> RecordView<'a> {
    /// Position in arrival order (the `i` of `replay-<i>`).
    pub fn index(&self) -> usize {
        self.i
    }

    /// The recorded request id (the capturing frontend's, e.g. `cmpl-…-0`).
    pub fn request_id(&self) -> Option<&'a str> {
        self.rec.id.map(|s| &self.index.ids[s.range()])
    }

    /// The file the record came from and its 1-based line there.
    pub fn source(&self) -> (&'a Path, u64) {
        (
            &self.index.files[self.rec.file as usize].path,
            self.rec.line,
        )
    }

    /// Recorded prompt length in tokens.
    pub fn prompt_tokens(&self) -> u32 {
        self.rec.prompt_tokens
    }

    /// Recorded number of generated tokens.
    pub fn output_tokens(&self) -> u32 {
        self.rec.output_tokens
    }

    /// Length of the record's integer block-hash chain (0 for string hashes or none).
    pub fn blocks(&self) -> usize {
        self.rec.blocks as usize
    }

    /// `stop`, `length`, `abort`, ...; `None` when the request never finished.
    pub fn finish_reason(&self) -> Option<&'a str> {
        (self.rec.finish != NO_FINISH).then(|| &*self.index.finish_names[self.rec.finish as usize])
    }

    /// The request did not complete normally (aborted, errored, cut off by the capture).
    pub fn incomplete(&self) -> bool {
        self.rec.incomplete
    }

    /// The recorded thinking block's length in tokens (`reasoning_tokens`), when known.
    pub fn reasoning_tokens(&self) -> Option<u32> {
        (self.rec.reasoning != NO_REASONING).then_some(self.rec.reasoning)
    }

    /// The recorded output ids; `None` when not loaded with `tokens` or not recorded.
    pub fn tokens(&self) -> Option<&'a [u32]> {
        self.rec.tokens.map(|s| &self.index.tokens[s.range()])
    }

    /// The recorded timing; `None` when not loaded with `steps` or the record has no
    /// `ttft_ms` (it produced nothing before it ended).
    pub fn steps(&self) -> Option<RecordSteps<'a>> {
        if !self.index.opts.steps {
            return None;
        }
        let ttft_ms = self.rec.ttft_ms?;
        Some(RecordSteps {
            ttft_ms,
            first_chunk_tokens: self.rec.first_chunk,
            gaps_ms: &self.index.gaps_ms[self.rec.gaps.range()],
            chunk_tokens: self
                .rec
                .chunk_tokens
                .map(|s| &self.index.chunk_tokens[s.range()]),
        })
    }

    /// A short name for messages: `record 17 (replay-17, id cmpl-…)`.
    pub fn to_ref(&self) -> RecordRef {
        RecordRef {
            index: self.i,
            request_id: self.request_id().map(str::to_owned),
            blocks: self.blocks(),
        }
    }
}

/// A record's timing: time to first token, then one gap and size per later chunk.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RecordSteps<'a> {
    /// Time to first token (engine side, queueing included).
    pub ttft_ms: f64,
    /// Tokens of the first chunk (`output_tokens − Σ later chunks`).
    pub first_chunk_tokens: u32,
    gaps_ms: &'a [f32],
    chunk_tokens: Option<&'a [u32]>,
}

impl<'a> RecordSteps<'a> {
    /// Number of chunks after the first.
    pub fn len(&self) -> usize {
        self.gaps_ms.len()
    }

    /// Whether the whole output came in the first chunk.
    pub fn is_empty(&self) -> bool {
        self.gaps_ms.is_empty()
    }

    /// The gaps before each later chunk, in ms.
    pub fn gaps_ms(&self) -> &'a [f32] {
        self.gaps_ms
    }

    /// Tokens of later chunk `i` (1 when the trace omitted `itl_tokens`).
    pub fn chunk_tokens(&self, i: usize) -> u32 {
        self.chunk_tokens
            .and_then(|c| c.get(i).copied())
            .unwrap_or(1)
    }

    /// Every later chunk as `(gap before it in ms, tokens)`.
    pub fn chunks(&self) -> impl Iterator<Item = (f64, u32)> + 'a {
        let sizes = self.chunk_tokens;
        self.gaps_ms.iter().enumerate().map(move |(i, &g)| {
            let n = sizes.and_then(|c| c.get(i).copied()).unwrap_or(1);
            (f64::from(g), n)
        })
    }

    /// All tokens the timing delivers (first chunk included).
    pub fn total_tokens(&self) -> u64 {
        u64::from(self.first_chunk_tokens) + self.chunks().map(|c| u64::from(c.1)).sum::<u64>()
    }
}
