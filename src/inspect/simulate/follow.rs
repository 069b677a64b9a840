//! Following simulated requests from their arrival to their finish, and writing each one
//! as a trace record — the record a `vllm-vcr record` tap in front of this engine would
//! have written: engine-side arrival, TTFT and inter-token gaps from the step times,
//! `cached_tokens` from the prefill stats, per-gap `itl_ctx`, the prompt's vLLM block
//! hashes at the engine's block size, and the finish.

use std::collections::HashMap;
use std::time::Duration;

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
pub struct Follower {
    flights: HashMap<String, Flight>,
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
            flights: HashMap::new(),
            hash_blocks,
            record_tokens,
            running: 0,
            preemptions: 0,
            origin,
        }
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.flights.len()
    }

    /// Request `index` is sent at `at`. Its record's arrival is when the engine queued it
    /// (its QUEUED event: the end of the step in flight when it came), as a capture's is.
    pub fn arrive(&mut self, index: usize, at: Duration, req: &EngineCoreRequest) {
        let block_hashes = match self.hash_blocks {
            Some(bs) => prompt_block_hashes(req, bs)
                .into_iter()
                .map(BlockHash::Int)
                .collect(),
            None => Vec::new(),
        };
        let concurrency = self.flights.len() as u32 + 1;
        self.flights.insert(
            req.request_id.clone(),
            Flight {
                index,
                arrival: at,
                sent: at,
                queued: false,
                prompt_tokens: req.prompt_len() as u32,
                cached_tokens: None,
                output_tokens: 0,
                first_token: None,
                last_chunk: at,
                itl_ms: Vec::new(),
                itl_tokens: Vec::new(),
                num_running: Vec::new(),
                prefill_tokens: Vec::new(),
                concurrency,
                block_hashes,
                token_ids: self.record_tokens.then(Vec::new),
                error: None,
            },
        );
    }

    /// Take in one output message; requests it finished go to `done`.
    pub fn absorb(&mut self, out: &TimedOutput, done: &mut Vec<Finished>) {
        let o = &out.outputs;
        if let Some(s) = &o.scheduler_stats {
            self.running = u32::try_from(s.num_running_reqs).unwrap_or(u32::MAX);
        }
        // prompts whose prefill finished in this step: their first token is in it
        let mut prefill_tokens = 0u64;
        for x in &o.outputs {
            if let Some(f) = self.flights.get(x.request_id.as_str())
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
        for x in &o.outputs {
            self.preemptions += x
                .events
                .iter()
                .filter(|e| e.kind == EventType::Preempted)
                .count() as u64;
            let Some(f) = self.flights.get_mut(x.request_id.as_str()) else {
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
                if let Some(f) = self.flights.remove(x.request_id.as_str()) {
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
    }

    /// Give up on every request still in flight (the engine could not finish them): their
    /// records are incomplete, with `reason`.
    pub fn abandon_all(&mut self, at: Duration, reason: &str, done: &mut Vec<Finished>) {
        let mut left: Vec<(String, Flight)> = self.flights.drain().collect();
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
