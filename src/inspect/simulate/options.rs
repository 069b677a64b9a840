//! What a simulated run is told (its options, the engine flags it uses) and what it
//! counts beyond the records.

use std::time::Duration;

use serde_json::Value;

use super::route::Fleet;
use super::workload::Workload;
use crate::play::EngineArgs;

/// What a run counted, beyond the records' own summary.
pub struct Counts {
    pub requests: usize,
    /// `--replay-sessions`: (roots, turns, turns without a recorded gap).
    pub sessions: Option<(usize, usize, usize)>,
    pub preemptions: u64,
    pub not_finished: u64,
    pub never_sent: u64,
    /// Refused before the engine (the fleet's limits: `fleet.rs`).
    pub rejected: u64,
    /// The engine's own description (its latency model, queue, …).
    pub describe: String,
    /// The replay counts, when replaying (`--replay-tokens`, `--replay-steps`).
    pub replay: Option<(String, Value)>,
}

/// A closed loop that sends each request (or session) after its own recorded turnaround
/// (`--replay-turnarounds`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OwnTurnarounds {
    /// How far apart the capture's client sent what one finish freed, ms, when measured
    /// ([`client_spacing_ms`](super::workload::client_spacing_ms)).
    pub client_spacing_ms: Option<f64>,
}

/// How a run sends the workload, and what its records carry.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Closed loop over sessions (`--replay-sessions`) instead of the recorded arrivals.
    pub replay_sessions: bool,
    /// Closed loop at this many requests in flight (`--replay-concurrency`): the first
    /// ones at their recorded offsets, each next one when a request finishes.
    pub concurrency: Option<usize>,
    /// With `concurrency`: from a finish to the next request's arrival.
    pub think: Duration,
    /// With `concurrency`: each request (or session) after its own recorded turnaround
    /// ([`Workload::turnarounds_ms`]) instead of `think`, where it has one.
    pub own_turnarounds: Option<OwnTurnarounds>,
    /// No prefix reuse between requests (`--cold-prompts`).
    pub cold_prompts: bool,
    /// Write each prompt's vLLM block hashes into its record, at this block size (a
    /// SHA-256 per block: only when the records are written out).
    pub hash_blocks: Option<usize>,
    /// Write each request's output token ids into its record.
    pub record_tokens: bool,
    /// The engines serving the workload (one by default) and their router.
    pub fleet: Fleet,
}

/// The engine flags a run of `work` uses: `engine`, with the trace's block size, and its
/// engine's `max_num_seqs` and `max_num_batched_tokens` (from the ready response a capture
/// keeps in its meta), unless the flags say otherwise; and without prefix caching when the
/// capture shows its engine had none ([`Workload::captured_without_prefix_caching`]).
pub fn engine_for(work: &Workload, engine: &EngineArgs) -> EngineArgs {
    let mut engine = engine.clone();
    engine
        .block_size
        .get_or_insert(work.trace_block_size as u64);
    let captured = work.captured_engine();
    let mut taken = Vec::new();
    if engine.max_num_seqs.is_none()
        && let Some(n) = captured
            .as_ref()
            .map(|r| r.max_num_seqs)
            .or(work.meta.max_num_seqs.map(u64::from))
            .filter(|&n| n > 0)
    {
        engine.max_num_seqs = Some(n);
        taken.push(format!("--max-num-seqs {n}"));
    }
    if engine.max_num_batched_tokens.is_none()
        && let Some(n) = captured
            .as_ref()
            .map(|r| r.max_num_batched_tokens)
            .filter(|&n| n > 0)
    {
        engine.max_num_batched_tokens = Some(n);
        taken.push(format!("--max-num-batched-tokens {n}"));
    }
    if !taken.is_empty() {
        crate::errln!(
            "note: the capture's scheduler settings: {} (give the flags to override)",
            taken.join(" ")
        );
    }
    if !engine.no_enable_prefix_caching
        && !engine.enable_prefix_caching
        && work.captured_without_prefix_caching()
    {
        crate::errln!(
            "note: the capture's engine ran without prefix caching (no prompt token came from its cache, though {} requests began with a block an earlier one had): simulating with --no-enable-prefix-caching",
            work.sharing_requests()
        );
        engine.no_enable_prefix_caching = true;
    }
    engine
}

/// Notes on stderr about what a run of `work` on `engine` assumes.
pub fn notes(replay_sessions: bool, work: &Workload, engine: &EngineArgs) {
    let note = |s: &str| crate::errln!("note: {s}");
    let bs = engine.block_size_or_default();
    if work.trace_block_size as u64 != bs {
        note(&format!(
            "the trace's block hashes are per {} tokens and the engine's blocks {bs}: prompts share what they shared in the trace, and the engine reuses the whole {bs}-token blocks inside it",
            work.trace_block_size
        ));
    }
    if let Some(m) = work.meta.max_num_seqs
        && u64::from(m) != engine.max_num_seqs_or_default()
    {
        note(&format!(
            "the trace was captured with max_num_seqs {m}; simulating with --max-num-seqs {}",
            engine.max_num_seqs_or_default()
        ));
    }
    if work.without_arrival > 0 {
        note(&format!(
            "{} of {} records have no arrival_ms: they arrive at 0, after every timed request in the naming order{}",
            work.without_arrival,
            work.requests(),
            if replay_sessions {
                " (as session roots; as turns, when their parent finished)"
            } else {
                ""
            }
        ));
    }
    let knobs = engine.knobs();
    let paced = !engine.latency_trace.is_empty()
        || engine.replay_steps.is_some()
        || knobs.ttft_ms > 0.0
        || knobs.itl_ms > 0.0
        || knobs.prefill_overhead_ms > 0.0
        || knobs.prefill_per_token_ms > 0.0;
    if !paced {
        note(
            "no latency model: every step is instant (pass --latency-trace MODEL, or --time-to-first-token / --inter-token-latency)",
        );
    }
}
