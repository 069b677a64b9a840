//! The step-stats sidecar (`record --step-stats-out`): one JSON line per engine step, with
//! the `SchedulerStats` the engine reported at the end of that step and what the step's
//! outputs carried.
//!
//! Times share the request trace's zero: `ts_ms` of a step and `arrival_ms` of a record
//! are on one axis. Unknown keys are ignored and absent ones take their defaults (all but
//! `ts_ms`, without which a line is no step), so sidecars written by older versions load.
//!
//! # Reading and writing
//!
//! [`StepStatsReader`] streams a sidecar (`.gz` transparently) with the error reporting of
//! the trace reader: a bad line is an error naming the file and line, and reading goes on
//! after it. A sidecar is written with the trace writer, one [`StepStats`] per line and no
//! meta line:
//!
//! ```no_run
//! # use sim_trace::{steps::StepStats, trace::TraceWriter};
//! let mut w = TraceWriter::create_without_meta("steps.jsonl.gz")?;
//! w.write_json(&StepStats { ts_ms: 12.5, num_running_reqs: 3, ..StepStats::default() })?;
//! w.finish()?;
//! # Ok::<(), sim_trace::trace::TraceError>(())
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize};

use crate::trace::{Lines, TraceError};

/// A float that a writer may have written as `null` (serde_json writes NaN and infinities
/// so): `null` reads back as NaN.
fn f64_or_nan<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Prefix-cache counters of one step (deltas since the previous stats, as vLLM sends them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct StepPrefixCache {
    /// The cache was reset in this step.
    pub reset: bool,
    /// Requests that looked up the cache.
    pub requests: u64,
    /// Prompt tokens looked up.
    pub queries: u64,
    /// Prompt tokens found.
    pub hits: u64,
    /// The same three counters for re-admitted (preempted) requests.
    pub preempted_requests: u64,
    pub preempted_queries: u64,
    pub preempted_hits: u64,
}

/// Speculative-decoding counters of one step (vLLM's `SpecDecodingStats`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct StepSpecDecoding {
    /// Draft tokens proposed per draft (K).
    pub num_spec_tokens: u64,
    /// Drafts verified in the step (one per decoding request).
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
    /// Accepted drafts per position `0..K`.
    pub num_accepted_tokens_per_pos: Vec<u64>,
    /// Proposed drafts per position `0..K` (absent on lines that do not send it).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub num_draft_tokens_per_pos: Vec<u64>,
}

/// One sidecar line: an engine step.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StepStats {
    /// When the step's outputs were emitted (engine timestamp), ms from the capture's zero.
    /// The one required key.
    pub ts_ms: f64,
    /// Data-parallel rank of the engine (`EngineCoreOutputs.engine_index`).
    #[serde(default)]
    pub engine: u32,
    /// Time since the same engine's previous step, ms; `None` for its first step.
    #[serde(default)]
    pub step_ms: Option<f64>,
    /// The engine's step counter (`SchedulerStats.step_counter`).
    #[serde(default)]
    pub step_counter: u64,
    /// Data-parallel wave (`SchedulerStats.current_wave`).
    #[serde(default)]
    pub current_wave: u64,
    /// Requests in the running batch after the step.
    #[serde(default)]
    pub num_running_reqs: u64,
    /// Requests waiting for capacity.
    #[serde(default)]
    pub num_waiting_reqs: u64,
    /// Waiting requests deferred for another reason (e.g. no LoRA slot).
    #[serde(default)]
    pub num_skipped_waiting_reqs: u64,
    /// Fraction of KV-cache blocks in use, 0–1.
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub kv_cache_usage: f64,
    /// Request outputs in the step's messages.
    #[serde(default)]
    pub outputs: u64,
    /// Tokens those outputs carried.
    #[serde(default)]
    pub new_tokens: u64,
    /// Requests whose first token came in this step (their prefill finished).
    #[serde(default)]
    pub prefill_requests: u32,
    /// Uncached prompt tokens of those requests.
    #[serde(default)]
    pub prefill_tokens: u64,
    #[serde(default)]
    pub prefix_cache: StepPrefixCache,
    /// LoRA adapter name → running requests.
    #[serde(default)]
    pub running_lora_adapters: BTreeMap<String, u64>,
    /// LoRA adapter name → waiting requests.
    #[serde(default)]
    pub waiting_lora_adapters: BTreeMap<String, u64>,
    /// Speculative-decoding counters, when the engine speculates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_decoding: Option<StepSpecDecoding>,
}

/// Streams a step-stats sidecar line by line (never loading the whole file), gunzipping
/// `.gz` paths.
///
/// Iterates `Result<StepStats, TraceError>` like [`crate::trace::TraceReader`]: blank lines
/// are skipped; a line that is not a step ([`TraceError::Parse`]) names the file and line
/// and reading goes on with the next one; after an I/O error (a truncated gzip stream
/// included, [`TraceError::Truncated`]) iteration ends.
pub struct StepStatsReader {
    lines: Lines,
}

impl StepStatsReader {
    pub fn open(path: impl AsRef<Path>) -> Result<Self, TraceError> {
        Ok(Self {
            lines: Lines::open(path.as_ref())?,
        })
    }

    /// The path being read.
    pub fn path(&self) -> &Path {
        self.lines.path()
    }

    /// The 1-based number of the last line read (0 before the first).
    pub fn line(&self) -> u64 {
        self.lines.line()
    }
}

impl Iterator for StepStatsReader {
    type Item = Result<StepStats, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.lines.next_json()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::PathBuf;

    use super::*;
    use crate::trace::TraceWriter;

    fn tmp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("sim-trace-steps-{}-{name}", std::process::id()))
    }

    #[test]
    fn steps_round_trip_through_the_writer_and_reader() {
        let steps = vec![
            StepStats {
                ts_ms: 20.25,
                num_running_reqs: 1,
                kv_cache_usage: 0.125,
                outputs: 1,
                new_tokens: 1,
                prefill_requests: 1,
                prefill_tokens: 7,
                prefix_cache: StepPrefixCache {
                    requests: 1,
                    queries: 7,
                    hits: 4,
                    ..StepPrefixCache::default()
                },
                running_lora_adapters: BTreeMap::from([("sql".to_string(), 1)]),
                ..StepStats::default()
            },
            StepStats {
                ts_ms: 31.5,
                engine: 1,
                step_ms: Some(11.25),
                step_counter: 7,
                current_wave: 2,
                num_running_reqs: 2,
                num_waiting_reqs: 3,
                num_skipped_waiting_reqs: 1,
                kv_cache_usage: 0.5,
                outputs: 2,
                new_tokens: 5,
                waiting_lora_adapters: BTreeMap::from([("chat".to_string(), 3)]),
                spec_decoding: Some(StepSpecDecoding {
                    num_spec_tokens: 2,
                    num_drafts: 2,
                    num_draft_tokens: 4,
                    num_accepted_tokens: 3,
                    num_accepted_tokens_per_pos: vec![2, 1],
                    num_draft_tokens_per_pos: vec![2, 2],
                }),
                ..StepStats::default()
            },
        ];
        for name in ["round-trip.jsonl", "round-trip.jsonl.gz"] {
            let path = tmp(name);
            let mut w = TraceWriter::create_without_meta(&path).unwrap();
            for s in &steps {
                w.write_json(s).unwrap();
            }
            w.finish().unwrap();
            let back: Vec<StepStats> = StepStatsReader::open(&path)
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            assert_eq!(back, steps, "{name}");
            std::fs::remove_file(&path).unwrap();
        }
    }

    #[test]
    fn the_cpu_engine_fixture_sidecar_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/cpu-engine-capture/steps.jsonl.gz");
        let mut reader = StepStatsReader::open(&path).unwrap();
        let mut last: HashMap<u32, f64> = HashMap::new();
        let mut n = 0u64;
        while let Some(step) = reader.next() {
            let step = step.unwrap_or_else(|e| panic!("{e}"));
            n += 1;
            assert_eq!(reader.line(), n, "one step per line");
            let prev = last.insert(step.engine, step.ts_ms);
            if let Some(prev) = prev {
                assert!(
                    step.ts_ms >= prev,
                    "line {n}: ts_ms {} after {prev}",
                    step.ts_ms
                );
                assert!(
                    step.step_ms.is_some(),
                    "line {n}: no step_ms after the first"
                );
            } else {
                assert_eq!(step.step_ms, None, "line {n}: a first step has no step_ms");
            }
            assert!((0.0..=1.0).contains(&step.kv_cache_usage), "line {n}");
        }
        assert!(n > 0);
        assert!(!last.is_empty());
    }

    #[test]
    fn a_bad_line_names_its_line_and_reading_goes_on() {
        let path = tmp("bad.jsonl");
        std::fs::write(
            &path,
            "{\"ts_ms\": 1.0}\n\n{\"ts_ms\": \"soon\"}\n{\"num_running_reqs\": 2}\n{\"ts_ms\": 4.0}\n",
        )
        .unwrap();
        let items: Vec<_> = StepStatsReader::open(&path).unwrap().collect();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(items.len(), 4);
        assert_eq!(items[0].as_ref().unwrap().ts_ms, 1.0);
        // line 2 is blank; line 3 has a ts_ms of the wrong type, line 4 none at all
        for (item, line) in items[1..3].iter().zip([3, 4]) {
            let e = item.as_ref().unwrap_err();
            assert_eq!(e.line(), Some(line));
            assert!(e.to_string().contains(&format!("bad.jsonl:{line}:")), "{e}");
        }
        assert!(items[2].as_ref().unwrap_err().to_string().contains("ts_ms"));
        assert_eq!(items[3].as_ref().unwrap().ts_ms, 4.0);
    }

    #[test]
    fn a_null_kv_cache_usage_reads_as_nan() {
        // serde_json writes a NaN as null; the line must still load.
        let s = StepStats {
            ts_ms: 1.0,
            kv_cache_usage: f64::NAN,
            ..StepStats::default()
        };
        let line = serde_json::to_string(&s).unwrap();
        assert!(line.contains("\"kv_cache_usage\":null"), "{line}");
        let back: StepStats = serde_json::from_str(&line).unwrap();
        assert!(back.kv_cache_usage.is_nan());
    }

    #[test]
    fn an_older_line_with_missing_keys_loads_with_defaults() {
        let s: StepStats =
            serde_json::from_str(r#"{"ts_ms": 12.5, "num_running_reqs": 3, "extra": 1}"#).unwrap();
        assert_eq!(s.ts_ms, 12.5);
        assert_eq!(s.num_running_reqs, 3);
        assert_eq!(s.step_ms, None);
        assert!(s.spec_decoding.is_none());
    }
}
