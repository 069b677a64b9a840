//! The flags of `inspect simulate`, and how the arrival flags become a run's options.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;

use super::options::{OwnTurnarounds, RunOptions, notes};
use super::route::{Fleet, Route};
use super::workload::{LoopUnit, Sessions, Workload, client_spacing_ms, duration_ms, ramp};
use crate::play::EngineArgs;

#[derive(Debug, Clone, Args)]
pub struct SimulateArgs {
    /// The trace whose requests to simulate: a capture (`record --trace-out`), or a public
    /// workload converted with `inspect convert` (`.gz` read transparently). An open loop
    /// over a trace whose records all have `arrival_ms` is read as a stream, memory flat
    /// however long it is (a capture, written as requests finished, is sorted as it is
    /// read, holding only the requests within its longest request's time of the latest
    /// arrival read); records without `arrival_ms`, and --replay-sessions or
    /// --replay-concurrency, hold and sort the whole workload (~0.4 KB a request).
    pub trace: PathBuf,

    #[command(flatten)]
    pub arrivals: ArrivalArgs,

    /// Simulate only the first N requests (in arrival order).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub requests: Option<u64>,

    /// Write the simulated trace here (the capture schema: a meta line with the engine's
    /// configuration, then one record per request, in finish order; `.gz` compresses, `-`
    /// is standard output and sends the summary to standard error).
    #[arg(long, value_name = "PATH")]
    pub dump_trace: Option<PathBuf>,

    /// Write every request's output token ids into the --dump-trace records (like
    /// `record --record-tokens`).
    #[arg(long, requires = "dump_trace")]
    pub record_tokens: bool,

    /// Print the summary as one JSON object.
    #[arg(long)]
    pub json: bool,

    #[command(flatten, next_help_heading = "Fleet (several engines behind a router)")]
    pub fleet: FleetArgs,

    #[command(flatten, next_help_heading = "Engine (the flags of `play`)")]
    pub engine: EngineArgs,
}

/// A fleet of engines behind a router: how many replicas a workload needs, and what a
/// KV-aware router buys.
#[derive(Debug, Clone, Args)]
pub struct FleetArgs {
    /// Serve the workload with N independent engines, each built from the engine flags
    /// below with its own KV cache and prefix cache, all on one virtual clock. With N > 1
    /// every --dump-trace record names its engine (`engine`, 0-based) and the summary adds
    /// each engine's TTFT, ITL, request total, prefix-cache hit rate and requests. 1 (the
    /// default) is the single engine of `play`.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = parse_engines)]
    pub engines: usize,

    /// How the router picks an engine for each request, when it arrives (session turns
    /// too), by the rules below. The cache-aware routes (prefix-aware, kv-aware) follow
    /// each engine's cache events (blocks stored, evicted, cleared), as llm-d's scheduler
    /// follows KV events, and match the prompt's chained block hashes (vLLM's, at the
    /// engine's block size): a block still being prefilled counts once its step ends. A
    /// prefix every prompt shares (a system prompt) keeps prefix-aware on the engine that
    /// cached it first; kv-aware spreads such a load.
    #[arg(long, value_enum, default_value_t = Route::RoundRobin, value_name = "ROUTE")]
    pub route: Route,
}

/// The most engines a fleet may have (each a whole engine in memory).
pub const MAX_ENGINES: usize = 1024;

fn parse_engines(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=MAX_ENGINES).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a number of engines from 1 to {MAX_ENGINES}"
        )),
    }
}

impl FleetArgs {
    /// The fleet these flags ask for.
    pub fn fleet(&self) -> Fleet {
        Fleet {
            engines: self.engines,
            route: self.route,
        }
    }
}

/// How the workload arrives, and whether prompts share their prefixes: shared by `inspect
/// simulate` and `inspect calibrate`.
#[derive(Debug, Clone, Args)]
pub struct ArrivalArgs {
    /// Open loop (the default): every request arrives at its recorded `arrival_ms`
    /// offset, whatever the engine does. Records without one arrive at 0.
    #[arg(long, conflicts_with = "replay_sessions")]
    pub replay_arrivals: bool,

    /// Closed loop over sessions inferred from the block-hash chains: a record continues
    /// an earlier record whose complete blocks are a prefix of its prompt, whose prompt
    /// and answer its prompt is long enough to hold, and which ended before it arrived
    /// (the longest such chain; of equals, the earliest not yet continued), and arrives
    /// when that parent finished in the simulation plus the recorded think gap (its
    /// arrival − the parent's recorded arrival, TTFT and gaps). Records that continue
    /// none (a prompt that only shares a system prompt, or repeats an earlier prompt) are
    /// new conversations and arrive at their recorded offset.
    #[arg(long)]
    pub replay_sessions: bool,

    /// No prefix reuse between requests: every block of every prompt is unique to its
    /// request (the workload without its shared prefixes).
    #[arg(long)]
    pub cold_prompts: bool,

    /// Closed loop at N requests in flight, as a load generator with a concurrency cap
    /// (`bench serve --max-concurrency N`) sends them: in arrival order, the first N (and
    /// any before the capture first had N in flight) when the load generator sent them
    /// (a record's arrival is its engine's QUEUED time; one queued within 1 ms of an
    /// earlier one's first token was sent with that one), or when a slot frees if later;
    /// then each next one the moment a request finishes in the simulation (plus
    /// --replay-think-ms; the recorded arrivals of the later requests are not used). `auto`: N is the capture's concurrency — the largest of the
    /// records' `concurrency`, else the most requests in flight at once by the recorded
    /// arrivals and ends. With --replay-sessions, N counts sessions, as a multi-turn load
    /// generator keeps N conversations going, and the same holds with a session in place
    /// of a request (a session spans its root's arrival to its last recorded end): the
    /// ramp's sessions start when their roots were sent, each next one when a session's
    /// last turn finishes (plus the turnaround, below); `auto` is then the most sessions
    /// in flight at once in the capture.
    #[arg(
        long,
        value_name = "N|auto",
        value_parser = parse_replay_concurrency,
        conflicts_with = "replay_arrivals"
    )]
    pub replay_concurrency: Option<ReplayConcurrency>,

    /// With --replay-concurrency: the time from a finish to the next request's (or
    /// session's) arrival at the engine. Default: the capture's own turnaround when its
    /// tap recorded each send (`sent_ms`): the median time from a finish to the next send,
    /// plus the time a send took to reach an idle engine — a few ms, enough that the next
    /// request misses the step that starts as the last one finishes, as on the real
    /// engine; 0 for traces without sends. Over sessions, from a session's end to the next
    /// session's root (a session's turns keep their own recorded gaps). `calibrate-e2e`
    /// sends through a real frontend, which takes its own turnaround: there the default
    /// is 0.
    #[arg(long, value_name = "MS", requires = "replay_concurrency", value_parser = parse_think_ms)]
    pub replay_think_ms: Option<f64>,

    /// With --replay-concurrency (without --replay-think-ms): whose turnaround each next
    /// request (or, with --replay-sessions, each next session) takes. `median`: the
    /// capture's median, every request the same.
    /// `recorded`: each request its own, as the capture's client sent it (its send less
    /// the latest recorded finish before it, plus the time a send took to reach an idle
    /// engine; the median for a request without a send). `auto`: `recorded` when the
    /// capture's client sent the requests one finish freed one after another (spaced by
    /// more than 0.1 ms at the median over at least 10 such pairs: a client doing work
    /// for each answer, as a multi-turn chat does, which splits what finished together
    /// across the engine's steps), else `median` (a load generator that refills every
    /// freed slot at once, whose rare late sends are jitter the loop would carry on).
    #[arg(long, value_enum, default_value_t = Turnarounds::Auto, value_name = "HOW")]
    pub replay_turnarounds: Turnarounds,
}

/// `--replay-turnarounds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Turnarounds {
    Median,
    Recorded,
    Auto,
}

/// Sends after one finish spaced by more than this (ms, at the median) come from a client
/// that sends them one after another (`--replay-turnarounds auto`).
const ONE_AT_A_TIME_MS: f64 = 0.1;

fn parse_think_ms(s: &str) -> std::result::Result<f64, String> {
    let max = sim_trace::latency::MAX_DURATION_MS;
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=max).contains(&v) => Ok(v),
        _ => Err(format!("`{s}` is not a time in ms from 0 to {max} (a day)")),
    }
}

/// `--replay-concurrency`: a number of requests in flight, or the capture's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReplayConcurrency {
    Fixed(usize),
    Auto,
}

fn parse_replay_concurrency(s: &str) -> std::result::Result<ReplayConcurrency, String> {
    if s.eq_ignore_ascii_case("auto") {
        return Ok(ReplayConcurrency::Auto);
    }
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(ReplayConcurrency::Fixed(n)),
        _ => Err(format!(
            "`{s}` is not a number of requests in flight (1 or more) or `auto`"
        )),
    }
}

impl ArrivalArgs {
    /// Resolve the arrival mode for `work` (printing notes on it) into run options.
    pub fn options(&self, work: &Workload, engine: &EngineArgs) -> Result<RunOptions> {
        let concurrency = self.resolve(work)?;
        notes(self.replay_sessions, work, engine);
        // what takes a slot of the closed loop: requests, or sessions
        let units = concurrency.map(|_| {
            let sessions = self.replay_sessions.then(|| Sessions::of(&work.sessions()));
            work.loop_units(sessions.as_ref())
        });
        let think = match (self.replay_think_ms, concurrency, &units) {
            (None, Some(c), Some(units)) => {
                duration_ms(work.turnaround_ms(units, ramp(units, c)).unwrap_or(0.0))
            }
            _ => self.think(),
        };
        Ok(RunOptions {
            replay_sessions: self.replay_sessions,
            concurrency,
            think,
            own_turnarounds: units.as_deref().and_then(|u| self.own_turnarounds(u)),
            cold_prompts: self.cold_prompts,
            hash_blocks: None,
            record_tokens: false,
            fleet: Fleet::default(),
        })
    }

    /// The arrival mode, for `--json`: `sessions`, `concurrency` or `recorded`.
    pub fn mode(&self, concurrency: Option<usize>) -> &'static str {
        if self.replay_sessions {
            if concurrency.is_some() {
                "sessions-concurrency"
            } else {
                "sessions"
            }
        } else if concurrency.is_some() {
            "concurrency"
        } else {
            "recorded"
        }
    }

    /// The number of requests in flight for `work`, when closed loop.
    pub fn resolve(&self, work: &Workload) -> Result<Option<usize>> {
        Ok(match self.replay_concurrency {
            None => None,
            Some(ReplayConcurrency::Fixed(n)) => Some(n),
            Some(ReplayConcurrency::Auto) if self.replay_sessions => Some(
                Sessions::of(&work.sessions())
                    .captured_concurrency(work)
                    .context(
                        "--replay-concurrency auto: the trace tells no session concurrency (no record has both an arrival_ms and a ttft_ms): pass a number",
                    )?,
            ),
            Some(ReplayConcurrency::Auto) => Some(work.captured_concurrency().context(
                "--replay-concurrency auto: the trace tells no concurrency (no record has `concurrency`, nor both an arrival_ms and a ttft_ms): pass a number",
            )?),
        })
    }

    /// Whether each unit of a closed loop over `units` (requests, or sessions) takes its
    /// own recorded turnaround (`--replay-turnarounds`).
    fn own_turnarounds(&self, units: &[LoopUnit]) -> Option<OwnTurnarounds> {
        if self.replay_think_ms.is_some() {
            return None;
        }
        let client_spacing_ms = client_spacing_ms(units);
        let own = match self.replay_turnarounds {
            Turnarounds::Median => false,
            Turnarounds::Recorded => true,
            Turnarounds::Auto => client_spacing_ms.is_some_and(|s| s > ONE_AT_A_TIME_MS),
        };
        own.then_some(OwnTurnarounds { client_spacing_ms })
    }

    /// The time from a finish to the next arrival.
    pub fn think(&self) -> Duration {
        duration_ms(self.replay_think_ms.unwrap_or(0.0))
    }

    /// The report's words for the arrivals: `closed loop, N in flight (…)`.
    pub fn describe(&self, n: usize, think: Duration, own: Option<OwnTurnarounds>) -> String {
        let how = match self.replay_concurrency {
            Some(ReplayConcurrency::Auto) => " (auto: the capture's)",
            _ => "",
        };
        let ms = think.as_secs_f64() * 1e3;
        let when = match (self.replay_think_ms, own) {
            (Some(t), _) if t > 0.0 => format!("{t} ms after one finishes"),
            (
                None,
                Some(OwnTurnarounds {
                    client_spacing_ms: Some(s),
                }),
            ) => format!(
                "after its own recorded turnaround (the capture's client sent what one finish freed {s:.2} ms apart)"
            ),
            (None, Some(_)) => "after its own recorded turnaround".to_string(),
            (None, None) if ms > 0.0 => {
                format!("{ms:.2} ms after one finishes (the capture's turnaround)")
            }
            _ => "when one finishes".to_string(),
        };
        if self.replay_sessions {
            return format!(
                "closed loop over sessions, {n} in flight{how}, each next session {when}"
            );
        }
        format!("closed loop, {n} in flight{how}, each next request {when}")
    }
}
