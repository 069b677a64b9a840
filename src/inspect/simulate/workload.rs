//! The workload a trace describes, ready to drive the engine: its requests in arrival
//! order, the prompt each one sends, and — for `--replay-sessions` — which earlier request
//! each one continues.
//!
//! **Arrival order** is the replay index's: `arrival_ms` ascending, ties in file order,
//! records without an arrival after every timed one. Request `i` is named `replay-<i>`,
//! which is what `--replay-tokens`/`--replay-steps` (`--replay-match index`) look up.
//!
//! **Prompts.** A trace keeps no prompt text, only each record's chained block hashes
//! (one per block of the trace's block size; an id names its block *and everything before
//! it*, so two records share a prefix exactly as far as their hashes agree). Every distinct
//! hash becomes one deterministic block of token ids (a generator seeded with the hash),
//! and every block without a hash — the trailing partial block of a capture, all of a
//! record without hashes, or every block under `--cold-prompts` — gets ids unique to its
//! request. The engine's prefix cache then sees exactly the captured sharing. Blocks are
//! cut at the *trace's* block size whatever the engine's: two prompts share the same
//! tokens as far as their hashes agree, and an engine with another `--block-size` reuses
//! what its own blocks cover of that shared prefix (all of it for a divisor of the trace's
//! size, the whole engine blocks inside it otherwise), as a real engine would.
//!
//! **Sessions.** A record's *chain* is the hashes of its complete blocks (a converted
//! Mooncake line also names its partial last block, which the next turn completes with
//! other tokens, so that id is not part of the chain). A record's parent is an earlier
//! record whose chain is a prefix of this record's hashes, whose prompt and answer this
//! record's prompt can hold and which ended before it arrived (see `links.rs`); a record
//! without one is a root. The think gap is the record's arrival minus its parent's
//! recorded end (arrival + TTFT + inter-token gaps), at least 0.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use sim_protocol::ReadyResponse;
use sim_trace::trace::{BlockHash, TraceItem, TraceMeta, TraceReader, TraceRecord};

use crate::inspect::progress::Progress;
use crate::play::content::tokens::{SplitMix64, request_seed};

/// `u32::MAX`: no request.
const NONE: u32 = u32::MAX;

/// Seeds of hashed (shared) blocks and of blocks unique to a request never meet.
const SHARED_SALT: u64 = 0x5eed_b10c_0000_0001;
const UNIQUE_SALT: u64 = 0x5eed_b10c_0000_0002;

/// One request of the workload.
#[derive(Debug, Clone)]
pub struct Planned {
    /// Recorded arrival, ms from the trace's zero.
    pub arrival_ms: Option<f64>,
    /// When the tap relayed the request to the engine, same clock (traces recorded by a
    /// tap that kept it).
    pub sent_ms: Option<f64>,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// Recorded end to end: TTFT plus every inter-token gap (records with a TTFT).
    pub e2e_ms: Option<f64>,
    /// Recorded TTFT, ms.
    pub ttft_ms: Option<f64>,
    /// The record's `concurrency` (requests in flight when it arrived, itself included).
    pub concurrency: Option<u32>,
    /// Its record's position in the trace file (0 for the first record).
    pub source: u32,
    /// Where its hashes are in [`Workload::hashes`].
    pub(super) hashes: (u32, u32),
}

/// Pairs of sends after one finish [`client_spacing_ms`] needs to say how the
/// client sent them.
pub const MIN_SPACINGS: usize = 10;

/// How a session turn arrives (`--replay-sessions`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Turn {
    /// A root: at its recorded arrival.
    Root,
    /// This long after its parent finished.
    After { parent: u32, gap: Duration },
    /// The parent has no recorded end (no TTFT, or no arrival on either side): the gap
    /// cannot be told from the parent's own time, so the turn arrives at its recorded
    /// arrival, or when its parent finished if that is later.
    NotBefore { parent: u32 },
}

/// The trace, read and ordered.
pub struct Workload {
    /// The trace's first meta line.
    pub meta: TraceMeta,
    /// The block size of the trace's hashes (`meta.block_size`, else the engine's).
    pub trace_block_size: usize,
    /// In arrival order.
    pub reqs: Vec<Planned>,
    /// Every record's block hashes, as 64-bit values (string hashes are hashed).
    hashes: Vec<u64>,
    /// Records in the trace (before `--requests`).
    pub records_in_trace: u64,
    /// Records without `arrival_ms`.
    pub without_arrival: u64,
    /// The records' `cached_tokens` summed, when any record has the field.
    pub cached_tokens: Option<u64>,
    /// Read as a stream while the run goes (`reqs` is then empty): see `stream.rs`.
    pub stream: Option<Streamed>,
}

/// Where a streamed workload is read from, and what the first pass over it found.
#[derive(Debug, Clone)]
pub struct Streamed {
    pub path: std::path::PathBuf,
    /// Requests to simulate (the records, or the first `--requests` of them).
    pub requests: usize,
    /// Recorded offsets are shifted by this so that none is negative.
    pub shift: f64,
    /// How far a record's arrival falls behind the latest one before it in the file, at
    /// most, ms (0: the file is in arrival order): a record read is due no earlier than
    /// the latest arrival read so far minus this.
    pub lateness_ms: f64,
}

/// One request's plan and block hashes: what its prompt is synthesized from.
#[derive(Clone, Copy)]
pub struct PlanRef<'a> {
    /// Its arrival-order index (blocks without a hash are unique to it).
    pub index: usize,
    pub plan: &'a Planned,
    pub hashes: &'a [u64],
    /// The trace's block size.
    pub block_size: usize,
}

impl PlanRef<'_> {
    /// The synthesized prompt (see the module docs). `ids` is the vocabulary range the
    /// ids come from; `cold` gives every block ids unique to the request.
    pub fn prompt(&self, ids: std::ops::Range<u32>, cold: bool) -> Vec<u32> {
        let len = self.plan.prompt_tokens.max(1) as usize;
        let mut out = Vec::with_capacity(len);
        for k in 0..len.div_ceil(self.block_size) {
            self.push_block(k, &ids, cold, &mut out);
        }
        out
    }

    /// Append block `k` of the prompt (at the trace's block size) to `out`, which holds
    /// its blocks before `k`: what [`Self::prompt`] writes there.
    pub fn push_block(&self, k: usize, ids: &std::ops::Range<u32>, cold: bool, out: &mut Vec<u32>) {
        let len = self.plan.prompt_tokens.max(1) as usize;
        let bs = self.block_size;
        let seed = match self.hashes.get(k) {
            Some(h) if !cold => mix(*h ^ SHARED_SALT),
            _ => mix(mix(self.index as u64 ^ UNIQUE_SALT) ^ k as u64),
        };
        let n = bs.min(len.saturating_sub(k * bs));
        let span = u64::from(ids.end - ids.start);
        fill_block(out, SplitMix64(seed), ids.start, span, n);
    }
}

/// The plan of record `r`, the `source`-th of its file, its hashes appended to `hashes`.
pub(super) fn planned(r: &TraceRecord, source: u32, hashes: &mut Vec<u64>) -> Result<Planned> {
    let start = hashes.len();
    hashes.extend(r.block_hashes.iter().map(hash_value));
    let gaps: f64 = r.itl_ms.iter().sum();
    Ok(Planned {
        arrival_ms: r.arrival_ms.filter(|a| a.is_finite()),
        sent_ms: r.sent_ms.filter(|a| a.is_finite()),
        prompt_tokens: r.prompt_tokens,
        output_tokens: r.output_tokens,
        e2e_ms: r.ttft_ms.map(|t| t + gaps),
        ttft_ms: r.ttft_ms,
        concurrency: r.concurrency,
        source,
        hashes: (
            u32::try_from(start).context("more than 2^32 block hashes")?,
            u32::try_from(r.block_hashes.len()).unwrap_or(u32::MAX),
        ),
    })
}

impl Workload {
    /// Read `path`: every record's shape, arrival, recorded end and hashes (8 bytes a
    /// block), then sort by arrival and keep the first `limit`. `engine_block_size` is
    /// the user's `--block-size`, used for the hashes of a trace whose meta has none.
    pub fn load(path: &Path, engine_block_size: Option<u64>, limit: Option<u64>) -> Result<Self> {
        Self::load_with(path, engine_block_size, limit, |_, _| {})
    }

    /// [`load`](Self::load), handing every record to `observe` as it is read, with its
    /// position in the file (what [`Planned::source`] names).
    pub fn load_with(
        path: &Path,
        engine_block_size: Option<u64>,
        limit: Option<u64>,
        mut observe: impl FnMut(u32, &TraceRecord),
    ) -> Result<Self> {
        let mut meta = None;
        let mut staged: Vec<Planned> = Vec::new();
        let mut hashes: Vec<u64> = Vec::new();
        let mut cached_tokens: Option<u64> = None;
        let mut progress = Progress::new("simulate: reading records");
        for item in TraceReader::open(path)? {
            match item? {
                TraceItem::Meta(m) => {
                    if meta.is_none()
                        && let Some(w) = m.newer_schema_warning()
                    {
                        crate::errln!("warning: {}: {w}", path.display());
                    }
                    meta.get_or_insert(m);
                }
                TraceItem::Record(r) => {
                    progress.tick();
                    let source = u32::try_from(staged.len()).context("more than 2^32 records")?;
                    observe(source, &r);
                    if let Some(c) = r.cached_tokens {
                        *cached_tokens.get_or_insert(0) += u64::from(c);
                    }
                    staged.push(planned(&r, source, &mut hashes)?);
                }
            }
        }
        progress.finish();
        let Some(meta) = meta else {
            bail!(
                "{} has no meta line: it is not a trace written by vllm-vcr (`record`, `inspect convert`, `inspect gen-demo`); convert other formats first (`vllm-vcr inspect convert --from mooncake …`)",
                path.display()
            );
        };
        let records_in_trace = staged.len() as u64;
        if staged.is_empty() {
            bail!(
                "{} holds no request records, only its meta line (a capture stopped before any request was written?)",
                path.display()
            );
        }
        let has_hashes = !hashes.is_empty();
        let trace_block_size = match (meta.block_size, engine_block_size) {
            (Some(b), _) if b > 0 => b as usize,
            (_, Some(b)) => b as usize,
            _ if !has_hashes => crate::play::engine_args::DEFAULT_BLOCK_SIZE as usize,
            _ => bail!(
                "{} has block hashes but no block_size in its meta line: pass --block-size with the block size they were computed with",
                path.display()
            ),
        };
        // stable: equal arrivals keep file order; untimed records after every timed one
        staged.sort_by(|a, b| {
            let key = |p: &Planned| p.arrival_ms.unwrap_or(f64::INFINITY);
            key(a).total_cmp(&key(b))
        });
        if let Some(n) = limit {
            staged.truncate(usize::try_from(n).unwrap_or(usize::MAX));
        }
        let without_arrival = staged.iter().filter(|p| p.arrival_ms.is_none()).count() as u64;
        Ok(Self {
            meta,
            trace_block_size,
            reqs: staged,
            hashes,
            records_in_trace,
            without_arrival,
            cached_tokens,
            stream: None,
        })
    }

    /// A workload read as it runs (see `stream.rs`): nothing held but what the first
    /// pass counted.
    pub(super) fn streamed(
        meta: TraceMeta,
        trace_block_size: usize,
        records_in_trace: u64,
        cached_tokens: Option<u64>,
        stream: Streamed,
    ) -> Self {
        Self {
            meta,
            trace_block_size,
            reqs: Vec::new(),
            hashes: Vec::new(),
            records_in_trace,
            without_arrival: 0,
            cached_tokens,
            stream: Some(stream),
        }
    }

    /// Requests to simulate (held or streamed).
    pub fn requests(&self) -> usize {
        self.stream.as_ref().map_or(self.reqs.len(), |s| s.requests)
    }

    /// Request `i`'s plan and hashes (a held workload's).
    pub fn plan(&self, i: usize) -> PlanRef<'_> {
        PlanRef {
            index: i,
            plan: &self.reqs[i],
            hashes: self.hashes(i),
            block_size: self.trace_block_size,
        }
    }

    /// The capture's engine as it described itself to the frontend (the ready response
    /// `record` keeps in the meta line), when the trace has it and it decodes.
    pub fn captured_engine(&self) -> Option<ReadyResponse> {
        let hex = self.meta.ready_response_hex.as_deref()?;
        let bytes: Option<Vec<u8>> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
            .collect();
        ReadyResponse::decode(&bytes?).ok()
    }

    /// Each request's turn in its conversation, from `turns` ([`Self::sessions`]): 1 for a
    /// root, one more than its parent for a turn.
    pub fn turn_numbers(turns: &[Turn]) -> Vec<u32> {
        let mut n: Vec<u32> = Vec::with_capacity(turns.len());
        for t in turns {
            n.push(match *t {
                Turn::Root => 1,
                Turn::After { parent, .. } | Turn::NotBefore { parent } => n[parent as usize] + 1,
            });
        }
        n
    }

    /// How many requests start with a complete block an earlier request had, and hold at
    /// least one more token: the ones an engine with prefix caching would have served
    /// from its cache (vLLM computes at least a prompt's last token, so a prompt of
    /// exactly one shared block gets no hit).
    pub fn sharing_requests(&self) -> usize {
        let mut seen = std::collections::HashSet::new();
        let mut sharing = 0;
        for i in 0..self.reqs.len() {
            let chain = &self.hashes(i)[..self.chain_len(i)];
            let cacheable = self.reqs[i].prompt_tokens.saturating_sub(1) as usize
                / self.trace_block_size.max(1);
            if cacheable > 0 && chain.first().is_some_and(|h| seen.contains(h)) {
                sharing += 1;
            }
            seen.extend(chain.iter().copied());
        }
        sharing
    }

    /// Whether the capture says its engine ran without prefix caching: its records report
    /// `cached_tokens`, none was served from the cache, yet at least 5 requests began with
    /// a block an earlier request had.
    pub fn captured_without_prefix_caching(&self) -> bool {
        self.cached_tokens == Some(0) && self.sharing_requests() >= 5
    }

    /// Request `i`'s block hashes.
    pub fn hashes(&self, i: usize) -> &[u64] {
        let (start, len) = self.reqs[i].hashes;
        let start = start as usize;
        &self.hashes[start..start + len as usize]
    }

    /// The length of request `i`'s chain: the hashes of its complete blocks.
    fn chain_len(&self, i: usize) -> usize {
        let full = self.reqs[i].prompt_tokens as usize / self.trace_block_size;
        self.hashes(i).len().min(full)
    }

    /// Request `i`'s synthesized prompt ([`PlanRef::prompt`]).
    pub fn prompt(&self, i: usize, ids: std::ops::Range<u32>, cold: bool) -> Vec<u32> {
        self.plan(i).prompt(ids, cold)
    }
}

/// Children of every request, as linked lists (first child, next sibling), so releasing a
/// finished request's turns costs nothing per request that has none.
pub struct Children {
    first: Vec<u32>,
    next: Vec<u32>,
}

impl Children {
    pub fn of(turns: &[Turn]) -> Self {
        let mut first = vec![NONE; turns.len()];
        let mut next = vec![NONE; turns.len()];
        // built backwards, so each list runs in arrival order
        for (i, t) in turns.iter().enumerate().rev() {
            if let Turn::After { parent, .. } | Turn::NotBefore { parent } = *t {
                next[i] = first[parent as usize];
                first[parent as usize] = i as u32;
            }
        }
        Self { first, next }
    }

    /// The turns that continue request `i`, in arrival order.
    pub fn of_request(&self, i: usize) -> impl Iterator<Item = usize> + '_ {
        fn some(c: u32) -> Option<usize> {
            (c != NONE).then_some(c as usize)
        }
        std::iter::successors(some(self.first[i]), |&c| some(self.next[c]))
    }
}

/// A block hash as 64 bits: integer hashes as they are, strings hashed.
fn hash_value(h: &BlockHash) -> u64 {
    match h {
        BlockHash::Int(v) => *v,
        BlockHash::Str(s) => request_seed(SHARED_SALT, s),
    }
}

/// `ms` milliseconds as a duration: negative (and NaN) is 0, and absurd values stop at
/// about 30,000 years instead of overflowing.
pub fn duration_ms(ms: f64) -> Duration {
    // (`clamp` keeps NaN, which `from_secs_f64` panics on)
    sim_trace::latency::duration_from_ms(ms)
}

/// Append `n` ids in `start..start + span` drawn from `rng`. A vocabulary range of at most
/// 2^16 ids takes four ids from each 64-bit draw (each 16-bit lane scaled onto the range),
/// a quarter of the generator's work on the long prompts of a conversation trace; a wider
/// range takes one draw per id.
fn fill_block(out: &mut Vec<u32>, mut rng: SplitMix64, start: u32, span: u64, n: usize) {
    if span > 1 << 16 {
        out.extend((0..n).map(|_| start + rng.below(span) as u32));
        return;
    }
    let lane = |x: u64| start + (((x & 0xffff) * span) >> 16) as u32;
    let mut left = n;
    while left >= 4 {
        let x = rng.next_u64();
        out.extend_from_slice(&[lane(x), lane(x >> 16), lane(x >> 32), lane(x >> 48)]);
        left -= 4;
    }
    let mut x = rng.next_u64();
    for _ in 0..left {
        out.push(lane(x));
        x >>= 16;
    }
}

/// SplitMix64's finaliser: spreads nearby seeds (consecutive hashes, request indexes).
fn mix(x: u64) -> u64 {
    SplitMix64(x).next_u64()
}

mod closed_loop;
mod links;

pub use closed_loop::{LoopUnit, Sessions, client_spacing_ms, ramp, ramp_sends};

#[cfg(test)]
mod tests;
