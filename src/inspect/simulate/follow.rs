//! Following simulated requests from their arrival to their finish, and writing each one
//! as a trace record — the record a `vllm-vcr record` tap in front of this engine would
//! have written: engine-side arrival, TTFT and inter-token gaps from the step times,
//! `cached_tokens` from the prefill stats, per-gap `itl_ctx`, the prompt's vLLM block
//! hashes at the engine's block size, and the finish.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::time::Duration;

use rustc_hash::FxHasher;

use sim_protocol::{EngineCoreRequest, EventType, FinishReason};
use sim_trace::trace::{BlockHash, ItlCtx, TraceRecord};

use crate::play::content::replay::prompt_block_hashes;
use crate::play::engine::offline::TimedOutput;

/// A request in flight.
struct Flight {
    index: usize,
    /// When it was sent, then (once its QUEUED event is seen) when the engine queued it.
    arrival: Duration,
    /// When it was sent.
    sent: Duration,
    queued: bool,
    prompt_tokens: u32,
    cached_tokens: Option<u32>,
    output_tokens: u32,
    first_token: Option<Duration>,
    last_chunk: Duration,
    /// The gaps it will have (`max_tokens - 1`), reserved at its first token: not
    /// before, as a long waiting queue would hold them all.
    gaps: usize,
    itl_ms: Vec<f64>,
    itl_tokens: Vec<u32>,
    num_running: Vec<u32>,
    prefill_tokens: Vec<u32>,
    concurrency: u32,
    block_hashes: Vec<BlockHash>,
    token_ids: Option<Vec<u32>>,
    error: Option<String>,
}

/// A request that finished (or was given up), with its record.
pub struct Finished {
    /// Its position in arrival order.
    pub index: usize,
    /// When it finished, on the virtual clock.
    pub at: Duration,
    pub record: TraceRecord,
}

/// Follows every request through the engine's outputs.
///
/// Every output of every step is looked up here, so the lookup is kept cheap: the flights
/// sit in a slab (slots reused as requests finish, so its size is the most ever in flight,
/// not the trace's length) and each id is hashed once per output (FxHash: the ids are ours,
/// `replay-<i>`, not an adversary's).
pub struct Follower {
    slots: Vec<Option<Flight>>,
    /// Free slots.
    vacant: Vec<usize>,
    /// Request id → its slot.
    by_id: HashMap<String, usize, BuildHasherDefault<FxHasher>>,
    /// The slot of each output of the message being absorbed (reused between messages).
    found: Vec<Option<usize>>,
    /// The engine's block size, when the records carry their prompts' block hashes.
    hash_blocks: Option<usize>,
    record_tokens: bool,
    /// The running count of the last step's scheduler stats.
    running: u32,
    /// PREEMPTED events seen.
    pub preemptions: u64,
    /// The virtual clock's zero on the engine's event clock (monotonic seconds).
    origin: f64,
}

/// Milliseconds, rounded to the microsecond (as the tap writes them).
fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1000.0
}

impl Follower {
    /// `hash_blocks`: the engine's block size, to write every prompt's block hashes into
    /// its record (`None`: no hashes, when no trace is written — they cost a SHA-256 per
    /// block).
    /// `origin`: the virtual clock's zero as the engine stamps events
    /// (`instant_to_monotonic` of the driver's origin).
    pub fn new(hash_blocks: Option<usize>, record_tokens: bool, origin: f64) -> Self {
        Self {
            slots: Vec::new(),
            vacant: Vec::new(),
            by_id: HashMap::default(),
            found: Vec::new(),
            hash_blocks,
            record_tokens,
            running: 0,
            preemptions: 0,
            origin,
        }
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.by_id.len()
    }

    /// Request `index` is sent at `at`. Its record's arrival is when the engine queued it
    /// (its QUEUED event: the end of the step in flight when it came), as a capture's is.
    /// `hashes`: its prompt's block hashes as the record writes them, when the caller has
    /// them (else they are computed from the prompt, when records carry them).
    pub fn arrive(
        &mut self,
        index: usize,
        at: Duration,
        req: &EngineCoreRequest,
        hashes: Option<Vec<u64>>,
    ) {
        let block_hashes = match self.hash_blocks {
            Some(bs) => hashes
                .unwrap_or_else(|| prompt_block_hashes(req, bs))
                .into_iter()
                .map(BlockHash::Int)
                .collect(),
            None => Vec::new(),
        };
        let concurrency = self.by_id.len() as u32 + 1;
        // one gap per output token after the first, known up front: no regrowing
        let gaps = req
            .sampling_params
            .as_ref()
            .and_then(|sp| sp.max_tokens)
            .map_or(0, |m| m.saturating_sub(1).min(1 << 16) as usize);
        let flight = Flight {
            index,
            arrival: at,
            sent: at,
            queued: false,
            prompt_tokens: req.prompt_len() as u32,
            cached_tokens: None,
            output_tokens: 0,
            first_token: None,
            last_chunk: at,
            gaps,
            itl_ms: Vec::new(),
            itl_tokens: Vec::new(),
            num_running: Vec::new(),
            prefill_tokens: Vec::new(),
            concurrency,
            block_hashes,
            token_ids: self.record_tokens.then(Vec::new),
            error: None,
        };
        let slot = match self.vacant.pop() {
            Some(s) => {
                self.slots[s] = Some(flight);
                s
            }
            None => {
                self.slots.push(Some(flight));
                self.slots.len() - 1
            }
        };
        if let Some(old) = self.by_id.insert(req.request_id.clone(), slot) {
            // an id sent twice while the first is in flight: the newer one is followed
            self.slots[old] = None;
            self.vacant.push(old);
        }
    }

    /// Stop following the request in `slot`.
    fn take(&mut self, slot: usize, id: &str) -> Option<Flight> {
        self.by_id.remove(id);
        self.vacant.push(slot);
        self.slots[slot].take()
    }

    /// Take in one output message; requests it finished go to `done`.
    pub fn absorb(&mut self, out: &TimedOutput, done: &mut Vec<Finished>) {
        let o = &out.outputs;
        if let Some(s) = &o.scheduler_stats {
            self.running = u32::try_from(s.num_running_reqs).unwrap_or(u32::MAX);
        }
        let mut found = std::mem::take(&mut self.found);
        found.clear();
        found.extend(
            o.outputs
                .iter()
                .map(|x| self.by_id.get(x.request_id.as_str()).copied()),
        );
        // prompts whose prefill finished in this step: their first token is in it
        let mut prefill_tokens = 0u64;
        for (x, slot) in o.outputs.iter().zip(&found) {
            if let Some(f) = slot.and_then(|s| self.slots[s].as_ref())
                && f.first_token.is_none()
                && !x.new_token_ids.is_empty()
            {
                let cached = x
                    .prefill_stats
                    .as_deref()
                    .map_or(0, |p| p.num_cached_tokens);
                prefill_tokens += u64::from(f.prompt_tokens).saturating_sub(cached);
            }
        }
        let prefill_tokens = u32::try_from(prefill_tokens).unwrap_or(u32::MAX);
        for (x, &slot) in o.outputs.iter().zip(&found) {
            self.preemptions += x
                .events
                .iter()
                .filter(|e| e.kind == EventType::Preempted)
                .count() as u64;
            let Some(slot) = slot else {
                continue;
            };
            let Some(f) = self.slots[slot].as_mut() else {
                continue;
            };
            if !f.queued
                && let Some(e) = x.events.iter().find(|e| e.kind == EventType::Queued)
            {
                f.queued = true;
                f.arrival = sim_trace::latency::secs_to_duration(e.timestamp - self.origin);
            }
            if f.cached_tokens.is_none()
                && let Some(p) = x.prefill_stats.as_deref()
            {
                f.cached_tokens = u32::try_from(p.num_cached_tokens).ok();
            }
            let n = x.new_token_ids.len() as u32;
            if n > 0 {
                if f.first_token.is_none() {
                    f.first_token = Some(out.at);
                    f.itl_ms.reserve_exact(f.gaps);
                    f.itl_tokens.reserve_exact(f.gaps);
                    f.num_running.reserve_exact(f.gaps);
                    f.prefill_tokens.reserve_exact(f.gaps);
                } else {
                    f.itl_ms.push(ms(out.at.saturating_sub(f.last_chunk)));
                    f.itl_tokens.push(n);
                    f.num_running.push(self.running);
                    f.prefill_tokens.push(prefill_tokens);
                }
                f.last_chunk = out.at;
                f.output_tokens += n;
                if let Some(ids) = f.token_ids.as_mut() {
                    ids.extend_from_slice(&x.new_token_ids);
                }
            }
            if let Some(e) = &x.error {
                f.error = Some(format!("{}: {}", e.code, e.message));
            }
            if let Some(reason) = x.finish_reason {
                let why = match reason {
                    FinishReason::Abort => Some("aborted by the engine".to_string()),
                    FinishReason::Error => Some("finished with an error".to_string()),
                    _ => None,
                };
                if let Some(f) = self.take(slot, &x.request_id) {
                    done.push(finish(
                        x.request_id.to_string(),
                        f,
                        out.at,
                        Some(reason),
                        why,
                    ));
                }
            }
        }
        self.found = found;
    }

    /// Give up on every request still in flight (the engine could not finish them): their
    /// records are incomplete, with `reason`.
    pub fn abandon_all(&mut self, at: Duration, reason: &str, done: &mut Vec<Finished>) {
        let mut left: Vec<(String, Flight)> = self
            .by_id
            .drain()
            .filter_map(|(id, s)| Some((id, self.slots[s].take()?)))
            .collect();
        self.vacant.clear();
        self.slots.clear();
        left.sort_by_key(|(_, f)| f.index);
        for (id, f) in left {
            done.push(finish(id, f, at, None, Some(reason.to_string())));
        }
    }
}

/// The record of a request refused before the engine (see `Limits`): it arrived, and
/// got nothing.
pub fn rejected(index: usize, at: Duration, prompt_tokens: u32, why: String) -> Finished {
    let record = TraceRecord {
        request_id: Some(format!("replay-{index}")),
        prompt_tokens,
        arrival_ms: Some(ms(at)),
        incomplete: true,
        abort_reason: Some(why.clone()),
        error: Some(why),
        ..TraceRecord::default()
    };
    Finished { index, at, record }
}

/// The record of a finished request. Anything but stop / length / repetition (or no
/// finish at all) makes it incomplete, as in a capture.
fn finish(
    id: String,
    f: Flight,
    at: Duration,
    reason: Option<FinishReason>,
    why: Option<String>,
) -> Finished {
    let complete = matches!(
        reason,
        Some(FinishReason::Stop | FinishReason::Length | FinishReason::Repetition)
    );
    let record = TraceRecord {
        request_id: Some(id),
        prompt_tokens: f.prompt_tokens,
        cached_tokens: f.cached_tokens,
        output_tokens: f.output_tokens,
        arrival_ms: Some(ms(f.arrival)),
        sent_ms: Some(ms(f.sent)),
        ttft_ms: f.first_token.map(|t| ms(t.saturating_sub(f.arrival))),
        itl_ms: f.itl_ms,
        itl_tokens: f.itl_tokens,
        concurrency: Some(f.concurrency),
        itl_ctx: ItlCtx {
            num_running: f.num_running,
            prefill_tokens: f.prefill_tokens,
        },
        block_hashes: f.block_hashes,
        mm_hashes: Vec::new(),
        reasoning_tokens: None,
        output_token_ids: f.token_ids,
        finish_reason: reason.map(|r| r.as_str().to_string()),
        incomplete: !complete,
        abort_reason: if complete { None } else { why },
        error: f.error,
        engine: None,
    };
    Finished {
        index: f.index,
        at,
        record,
    }
}
