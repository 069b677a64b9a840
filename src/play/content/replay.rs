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
use sim_trace::replay::{ReplayIndex, ReplayLoadOptions};

use super::tokens::{RecordedStream, TokenStream};
use super::vocab::Vocabulary;
use crate::play::engine::block_hash::{self, ExtraKey};

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

/// `--expect-config-hash` (trimmed, lower case) against the meta lines of one loaded
/// trace: the first must carry it, and so must every later one (concatenated captures).
fn check_config_hash(index: &ReplayIndex, expected: &str) -> Result<()> {
    for f in index.files() {
        let Some(first) = f.config_hash() else {
            bail!(
                "{} has no config_hash in its meta line, so --expect-config-hash {expected} cannot be checked (capture with `record --gpu … --vllm-version … --engine-config …`)",
                f.path.display()
            );
        };
        if first.to_ascii_lowercase() != expected {
            bail!(
                "{} was captured under config_hash {first}, not the expected {expected} (another engine configuration: refit or recapture, or drop --expect-config-hash)",
                f.path.display()
            );
        }
        if let Some(other) = f
            .config_hashes
            .iter()
            .find(|h| h.to_ascii_lowercase() != expected)
        {
            bail!(
                "{} holds a capture with config_hash {other}, not the expected {expected} (concatenated captures of different configurations)",
                f.path.display()
            );
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
    /// The recorded thinking block's length (`reasoning_tokens`), when the trace has it.
    pub reasoning_tokens: Option<u32>,
}

/// Why a request has no record: a short label for counts and a message for logs and
/// error finishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Miss {
    pub kind: &'static str,
    pub message: String,
}

/// A request's miss as `--replay-miss fail` refuses it (the request's error message).
impl std::fmt::Display for Miss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no recorded output for this request: {}", self.message)
    }
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
    /// How long a generated answer thinks: the record's count, when the request is served
    /// generated tokens (not recorded ids) and the record has one.
    pub reasoning_tokens: Option<u32>,
}

impl Replay {
    pub fn is_active(&self) -> bool {
        self.tokens.is_some() || self.steps.is_some()
    }

    /// Look `req` up. A miss is logged; under `--replay-miss fail` it is the `Err` (its
    /// `Display` is the message the request finishes with), otherwise the request keeps
    /// `stream`.
    pub fn resolve(
        &mut self,
        req: &EngineCoreRequest,
        stream: Box<dyn TokenStream>,
        log: bool,
    ) -> Result<Served, Miss> {
        let id = req.request_id.as_str();
        let mut served = Served {
            stream,
            recorded_end: None,
            script: None,
            reasoning_tokens: None,
        };
        let mut finish = None;
        let mut recorded_ids = false;
        let mut missed = None;
        let lookups = self.tokens.iter_mut().chain(self.steps.iter_mut());
        for source in lookups {
            match source.lookup(req) {
                Ok(rec) => {
                    if log {
                        tracing::info!(request_id = %id, record = rec.record, "replaying a record");
                    }
                    served.reasoning_tokens = served.reasoning_tokens.or(rec.reasoning_tokens);
                    if let Some(ids) = rec.tokens {
                        recorded_ids = true;
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
        if recorded_ids {
            // the recorded ids hold the thinking as it was written
            served.reasoning_tokens = None;
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
                return Err(m);
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

/// Every recorded output id must be one the frontend's tokenizer knows: an id past the
/// vocabulary decodes to nothing (the client got "" with `completion_tokens` 3).
fn check_vocabulary(index: &ReplayIndex, vocab: &Vocabulary, flag: &str) -> Result<()> {
    let size = vocab.size();
    for i in 0..index.len() {
        let rec = index.record(i);
        if let Some(&bad) = rec.tokens().and_then(|t| t.iter().find(|&&t| t >= size)) {
            let (path, line) = rec.source();
            bail!(
                "{flag} {}:{line}: record {} holds output token id {bad}, outside the vocabulary of {} ({size} ids, 0 … {}): replay a capture of the model the frontend serves (--tokenizer, or serve --model)",
                path.display(),
                rec.request_id()
                    .map_or_else(|| format!("#{i}"), |id| format!("`{id}`")),
                vocab.source,
                size.saturating_sub(1)
            );
        }
    }
    Ok(())
}

/// `--replay-tokens A --replay-steps B` with two files: they must be one capture, or the
/// pairing of content and timing is silent nonsense. Checked: the config hashes, the block
/// sizes, the record counts and the request ids in arrival order. `allow` turns the
/// refusal into a warning.
fn pair_check(
    tokens: &ReplayIndex,
    steps: &ReplayIndex,
    tokens_path: &Path,
    steps_path: &Path,
    allow: bool,
) -> Result<()> {
    let hashes = |i: &ReplayIndex| -> Vec<String> {
        i.files()
            .iter()
            .flat_map(|f| f.config_hashes.iter().map(|h| h.to_ascii_lowercase()))
            .collect()
    };
    let (th, sh) = (hashes(tokens), hashes(steps));
    let mut why = Vec::new();
    if !th.is_empty() && !sh.is_empty() && !th.iter().any(|h| sh.contains(h)) {
        why.push(format!("config_hash {} vs {}", th.join(","), sh.join(",")));
    }
    if let (Some(a), Some(b)) = (tokens.block_size(), steps.block_size())
        && a != b
    {
        why.push(format!("block_size {a} vs {b}"));
    }
    if tokens.len() != steps.len() {
        why.push(format!("{} vs {} records", tokens.len(), steps.len()));
    }
    let n = tokens.len().min(steps.len());
    if let Some(i) = (0..n).find(|&i| tokens.record(i).request_id() != steps.record(i).request_id())
    {
        let id = |r: Option<&str>| r.map_or_else(|| "none".to_string(), |s| format!("`{s}`"));
        why.push(format!(
            "record {i} is request {} in one and {} in the other",
            id(tokens.record(i).request_id()),
            id(steps.record(i).request_id())
        ));
    }
    if why.is_empty() {
        return Ok(());
    }
    let msg = format!(
        "--replay-tokens {} and --replay-steps {} are not one capture ({})",
        tokens_path.display(),
        steps_path.display(),
        why.join("; ")
    );
    if allow {
        tracing::warn!("{msg}: pairing them anyway (--replay-allow-mismatch)");
        return Ok(());
    }
    bail!(
        "{msg}: each request would get content from one capture and timing from another; pass --replay-allow-mismatch to pair them anyway"
    )
}

/// A [`RecordSource`] over a record index shared by every engine of the process (a
/// record is consumed once across DP ranks).
pub struct IndexSource {
    index: std::sync::Arc<std::sync::Mutex<ReplayIndex>>,
    mode: MatchMode,
}

impl IndexSource {
    pub fn new(index: std::sync::Arc<std::sync::Mutex<ReplayIndex>>, mode: MatchMode) -> Self {
        Self { index, mode }
    }
}

/// A recorded time as a duration (bounded at load; the conversion never panics).
fn ms(v: f64) -> Duration {
    sim_trace::latency::duration_from_ms(v)
}

impl RecordSource for IndexSource {
    fn lookup(&mut self, req: &EngineCoreRequest) -> Result<Recorded, Miss> {
        let mut index = self.index.lock().unwrap_or_else(|p| p.into_inner());
        let hit = match self.mode {
            MatchMode::Index => index.lookup_index(&req.request_id),
            MatchMode::Prefix => {
                let bs = index.block_size().unwrap_or(0) as usize;
                let hashes = if bs == 0 {
                    Vec::new()
                } else {
                    prompt_block_hashes(req, bs)
                };
                let prompt = u32::try_from(req.prompt_len()).unwrap_or(u32::MAX);
                index.lookup_prefix(&hashes, prompt)
            }
        };
        let hit = hit.map_err(|m| Miss {
            kind: m.kind(),
            message: m.to_string(),
        })?;
        let rec = index.record(hit.record);
        let script = rec.steps().map(|s| Script {
            ttft: ms(s.ttft_ms),
            first: s.first_chunk_tokens,
            chunks: s.chunks().map(|(g, n)| (ms(g), n)).collect(),
        });
        Ok(Recorded {
            record: hit.record,
            tokens: rec.tokens().map(<[u32]>::to_vec),
            finish: recorded_finish(rec.finish_reason()),
            script,
            reasoning_tokens: rec.reasoning_tokens(),
        })
    }

    fn summary(&self) -> String {
        let index = self.index.lock().unwrap_or_else(|p| p.into_inner());
        index.stats().summary()
    }

    fn summary_json(&self) -> serde_json::Value {
        let index = self.index.lock().unwrap_or_else(|p| p.into_inner());
        serde_json::to_value(index.stats()).unwrap_or_default()
    }
}

/// The loaded replay indexes, shared by every engine of the process.
#[derive(Clone)]
pub struct ReplaySetup {
    pub tokens: Option<std::sync::Arc<std::sync::Mutex<ReplayIndex>>>,
    /// `--replay-steps` from another trace than `--replay-tokens` (with the same trace, the
    /// tokens index carries the timing).
    pub steps: Option<std::sync::Arc<std::sync::Mutex<ReplayIndex>>>,
    pub mode: MatchMode,
    pub miss: MissPolicy,
    pub script_k: Option<u32>,
}

impl std::fmt::Debug for ReplaySetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplaySetup")
            .field("tokens", &self.tokens.is_some())
            .field("steps", &self.steps.is_some())
            .field("mode", &self.mode)
            .field("miss", &self.miss)
            .finish()
    }
}

impl ReplaySetup {
    /// Load what --replay-tokens and --replay-steps name; `None` when neither is given.
    /// Recorded token ids must be ids of `vocab` (the frontend's tokenizer); two different
    /// files must be one capture (config hash, block size, records and their ids) unless
    /// `allow_mismatch`. With `expected_hash` (trimmed, lower case), every file's meta lines
    /// must carry it.
    pub fn load(
        tokens: Option<&Path>,
        steps: Option<&Path>,
        mode: MatchMode,
        miss: MissPolicy,
        vocab: &Vocabulary,
        allow_mismatch: bool,
        expected_hash: Option<&str>,
    ) -> Result<Option<Self>> {
        let open = |path: &Path, opts: ReplayLoadOptions, flag: &str| -> Result<ReplayIndex> {
            let t = std::time::Instant::now();
            let index = ReplayIndex::load(&[path.to_path_buf()], opts)
                .with_context(|| format!("{flag} {}", path.display()))?;
            for w in index.warnings() {
                tracing::warn!("{flag}: {w}");
            }
            if let Some(expected) = expected_hash {
                check_config_hash(&index, expected)?;
            }
            if mode == MatchMode::Prefix && index.block_size().is_none() {
                bail!(
                    "{flag} {}: prefix matching hashes prompts with the capture's block size, and the trace's meta line does not give one (block_size)",
                    path.display()
                );
            }
            if mode == MatchMode::Prefix && index.block_size() == Some(0) {
                bail!(
                    "{flag} {}: the meta line's block_size is 0, and prefix matching hashes prompts in blocks of the capture's size (a damaged meta line?)",
                    path.display()
                );
            }
            if opts.tokens {
                check_vocabulary(&index, vocab, flag)?;
            }
            tracing::info!(
                records = index.len(),
                secs = format!("{:.2}", t.elapsed().as_secs_f64()),
                "{flag} {}: indexed",
                path.display()
            );
            Ok(index)
        };
        let shared = |i| std::sync::Arc::new(std::sync::Mutex::new(i));
        let (tokens_index, steps_index) = match (tokens, steps) {
            (None, None) => return Ok(None),
            (Some(t), Some(s)) if t == s => {
                let opts = ReplayLoadOptions {
                    tokens: true,
                    steps: true,
                };
                (Some(shared(open(t, opts, "--replay-tokens")?)), None)
            }
            (t, s) => {
                let t = t
                    .map(|p| {
                        let opts = ReplayLoadOptions {
                            tokens: true,
                            steps: false,
                        };
                        open(p, opts, "--replay-tokens")
                    })
                    .transpose()?;
                let s = s
                    .map(|p| {
                        let opts = ReplayLoadOptions {
                            tokens: false,
                            steps: true,
                        };
                        open(p, opts, "--replay-steps")
                    })
                    .transpose()?;
                if let (Some(t), Some(s), Some(tp), Some(sp)) = (&t, &s, tokens, steps) {
                    pair_check(t, s, tp, sp, allow_mismatch)?;
                }
                (t.map(shared), s.map(shared))
            }
        };
        let timing = if steps.is_some() {
            steps_index.as_ref().or(tokens_index.as_ref())
        } else {
            None
        };
        let script_k = timing
            .map(|i| {
                i.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .max_chunk_tokens()
            })
            .filter(|&m| m > 1)
            .map(|m| m - 1);
        Ok(Some(Self {
            tokens: tokens_index,
            steps: steps_index,
            mode,
            miss,
            script_k,
        }))
    }

    /// The config hashes of every replayed file's meta lines (lower case).
    pub fn config_hashes(&self) -> Vec<String> {
        let mut out = Vec::new();
        for index in self.tokens.iter().chain(self.steps.iter()) {
            let index = index.lock().unwrap_or_else(|p| p.into_inner());
            for f in index.files() {
                out.extend(f.config_hashes.iter().map(|h| h.to_ascii_lowercase()));
            }
        }
        out.sort();
        out.dedup();
        out
    }

    /// The engine-side sources over the shared indexes.
    pub fn engine_replay(&self) -> Replay {
        let source = |i: &std::sync::Arc<std::sync::Mutex<ReplayIndex>>| -> Box<dyn RecordSource> {
            Box::new(IndexSource::new(i.clone(), self.mode))
        };
        Replay {
            tokens: self.tokens.as_ref().map(source),
            steps: self.steps.as_ref().map(source),
            miss: self.miss,
            script_k: self.script_k,
        }
    }
}
