//! Playing a capture back: which record a request gets (`--replay-tokens`,
//! `--replay-steps`, `--replay-match`), what a miss does (`--replay-miss`), and the
//! `--expect-config-hash` guard.
//!
//! The record index itself (arrival order, prefix matching, consumption, counts) lives in
//! `sim_trace::replay`; this module turns an incoming request into a lookup (its
//! `replay-<i>` id, or its prompt's vLLM block hashes with the LoRA and cache-salt keys the
//! tap uses) and a hit into what the engine serves.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use sim_protocol::{EngineCoreRequest, FinishReason};
use sim_trace::trace::TraceReader;

use super::block_hash::{self, ExtraKey};
use super::tokens::{RecordedStream, TokenStream};

/// How a request finds its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MatchMode {
    /// `replay-<i>` inside the request id: the i-th record in arrival order.
    #[default]
    Index,
    /// The prompt's chained block hashes against the records': longest shared prefix.
    Prefix,
}

/// What a request without a record gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MissPolicy {
    /// Random tokens (the miss is logged and counted).
    #[default]
    Random,
    /// The request finishes with an error naming the reason.
    Fail,
}

/// Refuse traces captured under another configuration: every path's meta must carry
/// `expected` as its `config_hash`.
pub fn check_config_hash(expected: &str, paths: &[&Path]) -> Result<()> {
    let expected = expected.trim().to_ascii_lowercase();
    if expected.is_empty() {
        bail!("--expect-config-hash needs a hash (the `config_hash` of a trace's meta line)");
    }
    for path in paths {
        let mut reader = TraceReader::open(path)
            .with_context(|| format!("--expect-config-hash: opening {}", path.display()))?;
        let (meta, _) = reader
            .read_header()
            .with_context(|| format!("--expect-config-hash: reading {}", path.display()))?;
        match meta.and_then(|m| m.config_hash) {
            Some(h) if h.to_ascii_lowercase() == expected => {}
            Some(h) => bail!(
                "{} was captured under config_hash {h}, not the expected {expected} (another engine configuration: refit or recapture, or drop --expect-config-hash)",
                path.display()
            ),
            None => bail!(
                "{} has no config_hash in its meta line, so --expect-config-hash {expected} cannot be checked (capture with `record --gpu … --vllm-version … --engine-config …`)",
                path.display()
            ),
        }
    }
    Ok(())
}

/// The finish reason a record ended with, as the engine reports it. Records that did not
/// finish normally (aborted by the client, cut off by the end of the capture) end the
/// replayed request with `abort`.
pub fn recorded_finish(reason: Option<&str>) -> FinishReason {
    match reason {
        Some("stop") => FinishReason::Stop,
        Some("length") => FinishReason::Length,
        Some("error") => FinishReason::Error,
        Some("repetition") => FinishReason::Repetition,
        _ => FinishReason::Abort,
    }
}

/// The prompt's chained block hashes as the tap records them (vLLM's hash, 64-bit form,
/// LoRA and cache-salt keys included).
pub fn prompt_block_hashes(req: &EngineCoreRequest, block_size: usize) -> Vec<u64> {
    let Some(prompt) = &req.prompt_token_ids else {
        return Vec::new();
    };
    let lora = req.lora_request.as_ref().map(|l| ExtraKey::Lora {
        name: l.name.clone(),
        path: l.path.clone(),
    });
    let none = block_hash::default_none_hash();
    block_hash::chain(
        &none,
        prompt,
        block_size,
        lora.as_ref(),
        req.cache_salt.as_deref(),
    )
    .iter()
    .map(block_hash::hash_u64)
    .collect()
}

/// A request's recorded timing (`--replay-steps`).
#[derive(Debug, Clone, PartialEq)]
pub struct Script {
    /// The recorded time to first token (engine side: queueing included).
    pub ttft: Duration,
    /// Tokens of the first chunk (`output_tokens − Σ itl_tokens`).
    pub first: u32,
    /// Every later chunk: the gap before it and its tokens.
    pub chunks: Vec<(Duration, u32)>,
}

/// Where the replay flags point, checked.
#[derive(Debug, Clone, Default)]
pub struct ReplayPaths {
    pub tokens: Option<PathBuf>,
    pub steps: Option<PathBuf>,
}

/// What a matched request is served.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    /// Position of the record in arrival order (its `replay-<i>` index).
    pub record: usize,
    /// The recorded output ids (`--replay-tokens`).
    pub tokens: Option<Vec<u32>>,
    /// How the record ended.
    pub finish: FinishReason,
    /// The recorded chunk sizes and gaps (`--replay-steps`).
    pub script: Option<Script>,
}

/// Why a request has no record: a short label for counts and a message for logs and
/// error finishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Miss {
    pub kind: &'static str,
    pub message: String,
}

/// Finds the record of each request. One per engine: lookups consume records.
pub trait RecordSource: Send {
    fn lookup(&mut self, req: &EngineCoreRequest) -> Result<Recorded, Miss>;
    /// One line of counts (served, by depth, missed by reason), for the exit log.
    fn summary(&self) -> String;
    /// The counts as JSON (`--replay-summary`).
    fn summary_json(&self) -> serde_json::Value;
}

/// The replay sources of one engine.
#[derive(Default)]
pub struct Replay {
    /// Recorded content (`--replay-tokens`); with the same trace as `--replay-steps`, its
    /// hits carry the timing too.
    pub tokens: Option<Box<dyn RecordSource>>,
    /// Recorded timing from another trace than the content's (`--replay-steps`).
    pub steps: Option<Box<dyn RecordSource>>,
    pub miss: MissPolicy,
    /// K of the recorded timing's bursts (largest chunk − 1), for spec-decode stats.
    pub script_k: Option<u32>,
}

/// What a request is served: its token stream, where it ends, and its recorded timing.
pub struct Served {
    pub stream: Box<dyn TokenStream>,
    /// After this many tokens the request ends with this reason (the record's end).
    pub recorded_end: Option<(u64, FinishReason)>,
    pub script: Option<Script>,
}

impl Replay {
    pub fn is_active(&self) -> bool {
        self.tokens.is_some() || self.steps.is_some()
    }

    /// Look `req` up. A miss is logged; under `--replay-miss fail` it is an `Err` with the
    /// message the request finishes with, otherwise the request keeps `stream`.
    pub fn resolve(
        &mut self,
        req: &EngineCoreRequest,
        stream: Box<dyn TokenStream>,
        log: bool,
    ) -> Result<Served, String> {
        let id = req.request_id.as_str();
        let mut served = Served {
            stream,
            recorded_end: None,
            script: None,
        };
        let mut finish = None;
        let mut missed = None;
        let lookups = self.tokens.iter_mut().chain(self.steps.iter_mut());
        for source in lookups {
            match source.lookup(req) {
                Ok(rec) => {
                    if log {
                        tracing::info!(request_id = %id, record = rec.record, "replaying a record");
                    }
                    if let Some(ids) = rec.tokens {
                        served.recorded_end = Some((ids.len() as u64, rec.finish));
                        let after = std::mem::replace(&mut served.stream, Box::new(Empty));
                        served.stream = Box::new(RecordedStream { ids, pos: 0, after });
                    }
                    served.script = rec.script.or(served.script.take());
                    finish = finish.or(Some(rec.finish));
                }
                Err(m) => missed = missed.or(Some(m)),
            }
        }
        if served.recorded_end.is_none()
            && let (Some(s), Some(finish)) = (&served.script, finish)
        {
            // generated tokens on a recorded timeline: as many as the record had
            let total = s.first + s.chunks.iter().map(|c| c.1).sum::<u32>();
            served.recorded_end = Some((u64::from(total), finish));
        }
        if let Some(m) = missed {
            tracing::warn!(request_id = %id, reason = m.kind, "replay miss: {}", m.message);
            if self.miss == MissPolicy::Fail {
                return Err(format!(
                    "no recorded output for this request: {}",
                    m.message
                ));
            }
        }
        Ok(served)
    }

    /// One line and the JSON of the counts, when replaying.
    pub fn summary(&self) -> Option<(String, serde_json::Value)> {
        let sources = self.tokens.iter().chain(self.steps.iter());
        let mut line = Vec::new();
        let mut json = serde_json::Map::new();
        for (name, s) in ["tokens", "steps"].into_iter().zip(sources) {
            line.push(format!("{name}: {}", s.summary()));
            json.insert(name.to_string(), s.summary_json());
        }
        (!line.is_empty()).then(|| (line.join("; "), serde_json::Value::Object(json)))
    }
}

/// A placeholder stream while a recorded one takes the real one over.
struct Empty;

impl TokenStream for Empty {
    fn next_token(&mut self, _avoid: &[u32]) -> u32 {
        0
    }
}
