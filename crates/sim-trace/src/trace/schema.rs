//! The trace's line types: the meta line, the request record and its fields, and the
//! parsing of one line into them.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The schema version this crate writes (`meta.version`).
pub const SCHEMA_VERSION: u32 = 1;

/// The tool name written to `meta.tool`.
pub const TOOL_NAME: &str = "vllm-vcr";

#[allow(clippy::borrowed_box)] // serde's skip_serializing_if passes `&field`
fn no_notes(n: &Box<BTreeMap<String, String>>) -> bool {
    n.is_empty()
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// `itl_tokens` is omitted when every chunk delivered exactly one token (plain
/// autoregressive decoding), so such traces stay unchanged.
fn all_ones(v: &[u32]) -> bool {
    v.iter().all(|&n| n == 1)
}

/// The trace metadata line (`{"meta": {...}}`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TraceMeta {
    /// Schema version; absent = 1. Use [`TraceMeta::schema_version`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
    /// Served model name, e.g. `Qwen/Qwen3-8B`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Accelerator, e.g. `H200`; `cpu` for an engine on the host CPU (then `host_cpu` is
    /// the hardware).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    /// The CPU of the host the capture ran on (model, vendor numbers, vector flags,
    /// logical CPUs); an input of `config_hash`. Absent in traces that predate it, from
    /// hosts without `/proc/cpuinfo`, and with `record --host-cpu none`.
    /// (Boxed, like `notes`, to keep `TraceMeta` small in enums that hold one.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_cpu: Option<Box<crate::host::HostCpu>>,
    /// Tensor-parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp: Option<u32>,
    /// KV-cache block size in tokens (the unit of `block_hashes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// Scheduler `--max-num-seqs` of the captured engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_num_seqs: Option<u32>,
    /// The engine's raw reported version (e.g. `0.23.0.dev1+g...`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vllm_version: Option<String>,
    /// The capture-config fingerprint (see [`crate::config_hash`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_hash: Option<String>,
    /// The engine's ready (handshake) response, hex-encoded bytes as relayed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_response_hex: Option<String>,
    /// Writing tool, `vllm-vcr`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// Writing tool's version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_version: Option<String>,
    /// Wall-clock time of the capture's zero (Unix epoch milliseconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_unix_ms: Option<u64>,
    /// Free-form notes of the capture driver (`record --note KEY=VALUE`), e.g. how the
    /// engine was run (`rig`: allocator preloads, thread binding, CPU pinning). Not hashed.
    #[serde(default, skip_serializing_if = "no_notes")]
    pub notes: Box<BTreeMap<String, String>>,
}

impl TraceMeta {
    /// A meta stamped with the current schema version, this tool's name and version, and
    /// the current wall-clock time.
    pub fn new() -> Self {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .ok()
            .map(|d| d.as_millis() as u64);
        Self {
            version: Some(SCHEMA_VERSION),
            tool: Some(TOOL_NAME.to_string()),
            tool_version: Some(env!("CARGO_PKG_VERSION").to_string()),
            created_unix_ms: created,
            ..Self::default()
        }
    }

    /// The schema version, treating an absent `version` as 1.
    pub fn schema_version(&self) -> u32 {
        self.version.unwrap_or(1)
    }

    /// A warning for a meta line of a newer schema than this build reads (such a trace is
    /// read, but a field whose meaning changed may be read wrong); `None` otherwise.
    pub fn newer_schema_warning(&self) -> Option<String> {
        let v = self.schema_version();
        (v > SCHEMA_VERSION).then(|| {
            format!(
                "meta version {v} is newer than the schema this build reads (version {SCHEMA_VERSION}): fields whose meaning changed may be read wrong; use a newer vllm-vcr"
            )
        })
    }
}

/// One chained KV-block hash. The tap writes unsigned 64-bit integers; string hashes (e.g.
/// hex digests from converted workload traces) are accepted and kept verbatim.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(untagged)]
pub enum BlockHash {
    Int(u64),
    Str(String),
}

/// Read as `#[serde(untagged)]` would (an unsigned integer, else a string, else the same
/// error), without its buffering of every value first: that made a trace's block hashes
/// cost several times their integers' parsing.
impl<'de> Deserialize<'de> for BlockHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        const NO_MATCH: &str = "data did not match any variant of untagged enum BlockHash";
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = BlockHash;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an unsigned integer or a string")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<BlockHash, E> {
                Ok(BlockHash::Int(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<BlockHash, E> {
                u64::try_from(v)
                    .map(BlockHash::Int)
                    .map_err(|_| E::custom(NO_MATCH))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<BlockHash, E> {
                Ok(BlockHash::Str(v.to_string()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<BlockHash, E> {
                Ok(BlockHash::Str(v))
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<BlockHash, E> {
                Err(E::custom(NO_MATCH))
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<BlockHash, E> {
                Err(E::custom(NO_MATCH))
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<BlockHash, E> {
                Err(E::custom(NO_MATCH))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, _: A) -> Result<BlockHash, A::Error> {
                Err(serde::de::Error::custom(NO_MATCH))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, _: A) -> Result<BlockHash, A::Error> {
                Err(serde::de::Error::custom(NO_MATCH))
            }
        }
        d.deserialize_any(V)
    }
}

impl From<u64> for BlockHash {
    fn from(v: u64) -> Self {
        BlockHash::Int(v)
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlockHash::Int(v) => write!(f, "{v}"),
            BlockHash::Str(s) => f.write_str(s),
        }
    }
}

/// Per-gap engine context, as parallel arrays aligned with `itl_ms` (entry `i` describes
/// the engine step that produced gap `i`). Arrays may be shorter than `itl_ms` when the
/// engine did not report a value for the trailing gaps.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ItlCtx {
    /// Engine-reported running request count for the gap's step.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub num_running: Vec<u32>,
    /// Prompt tokens that finished prefill in the gap's step.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefill_tokens: Vec<u32>,
}

impl ItlCtx {
    pub fn is_empty(&self) -> bool {
        self.num_running.is_empty() && self.prefill_tokens.is_empty()
    }
}

/// One request record.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TraceRecord {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// Prompt length in tokens.
    #[serde(default)]
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache (absent = unknown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u32>,
    /// Generated tokens.
    #[serde(default)]
    pub output_tokens: u32,
    /// Arrival offset from the capture's zero; absent for traces without a timeline
    /// (e.g. converted client reports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrival_ms: Option<f64>,
    /// When the frontend's request reached the engine's socket (the tap relayed its ADD),
    /// on the same clock as `arrival_ms`. `arrival_ms` is the engine's QUEUED time, which
    /// comes after the step in flight (vLLM's engine-core takes in requests between
    /// steps). Absent in traces written before it was recorded, and in converted ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent_ms: Option<f64>,
    /// Time to first token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// One gap per output chunk after the first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub itl_ms: Vec<f64>,
    /// Tokens delivered by each chunk, parallel to `itl_ms`; omitted when all are 1. The
    /// first chunk's size is `output_tokens - sum(itl_tokens)`. Use
    /// [`TraceRecord::chunk_tokens`] to read it with the default applied.
    #[serde(default, skip_serializing_if = "all_ones")]
    pub itl_tokens: Vec<u32>,
    /// Requests in flight (this one included) when the request arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    /// Per-gap engine context.
    #[serde(default, skip_serializing_if = "ItlCtx::is_empty")]
    pub itl_ctx: ItlCtx,
    /// Chained per-block prompt hashes (block size `meta.block_size`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub block_hashes: Vec<BlockHash>,
    /// Multimodal input hashes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mm_hashes: Vec<String>,
    /// Of `output_tokens`, those the model spent thinking: the tokens between its
    /// thinking markers, as a frontend's usage counts them (`reasoning_tokens`), counted by
    /// `record --reasoning-format` from the output ids or read from a converted client
    /// report. A replay with generated tokens thinks for as many; `None` = not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<u32>,
    /// Generated token ids (opt-in, `--record-tokens`); `None` = not recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_token_ids: Option<Vec<u32>>,
    /// `stop`, `length`, `abort`, ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<String>,
    /// The request did not complete normally (aborted, errored, or cut off when the
    /// capture stopped); its timing fields cover only what was observed.
    #[serde(default, skip_serializing_if = "is_false")]
    pub incomplete: bool,
    /// Why an incomplete request was aborted (client disconnect, shutdown, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort_reason: Option<String>,
    /// Engine/transport error for an errored request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The engine of a fleet that served it (0-based; `inspect simulate --engines N`
    /// with N > 1). Absent when one engine served the whole trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<u32>,
}

impl TraceRecord {
    /// Tokens per chunk after the first, parallel to `itl_ms` (1 each when `itl_tokens`
    /// was omitted).
    pub fn chunk_tokens(&self) -> Vec<u32> {
        if self.itl_tokens.is_empty() {
            vec![1; self.itl_ms.len()]
        } else {
            self.itl_tokens.clone()
        }
    }

    /// Check the record's latencies (`ttft_ms`, every `itl_ms`) are durations an engine can
    /// take: finite and at most [`MAX_DURATION_MS`](crate::latency::MAX_DURATION_MS) (a day)
    /// in size. The error names the field (and the gap's index).
    pub fn check_times(&self) -> Result<(), String> {
        use crate::latency::{MAX_DURATION_MS, is_sane_ms};
        let bad = |field: String, v: f64| {
            format!(
                "{field} = {} ms is not a duration an engine takes (at most {MAX_DURATION_MS} ms, a day)",
                crate::latency::show_number(v)
            )
        };
        if let Some(t) = self.ttft_ms
            && !is_sane_ms(t)
        {
            return Err(bad("ttft_ms".into(), t));
        }
        if let Some((i, &g)) = self
            .itl_ms
            .iter()
            .enumerate()
            .find(|(_, g)| !is_sane_ms(**g))
        {
            return Err(bad(format!("itl_ms[{i}]"), g));
        }
        Ok(())
    }

    /// Tokens delivered by the first chunk: `output_tokens - sum(itl_tokens)` (saturating).
    pub fn first_chunk_tokens(&self) -> u32 {
        let rest: u64 = if self.itl_tokens.is_empty() {
            self.itl_ms.len() as u64
        } else {
            self.itl_tokens.iter().map(|&n| u64::from(n)).sum()
        };
        u64::from(self.output_tokens).saturating_sub(rest) as u32
    }
}

/// How messages name a record: its request id when it has one, else its position among
/// the file's records (0-based, in file order).
pub fn record_name(r: &TraceRecord, position: u64) -> String {
    match &r.request_id {
        Some(id) => format!("`{id}`"),
        None => format!("#{position} (no request_id)"),
    }
}

/// One line of a trace.
#[derive(Debug, Clone, PartialEq)]
pub enum TraceItem {
    Meta(TraceMeta),
    Record(TraceRecord),
}

#[derive(Serialize)]
pub(super) struct MetaLineOut<'a> {
    pub(super) meta: &'a TraceMeta,
}

#[derive(Deserialize)]
struct MetaLineIn {
    meta: TraceMeta,
}

/// One line of a trace, its record read as an `R`: a [`TraceRecord`], or a smaller type
/// with only the fields a pass needs (the others are skipped unparsed, so such a type
/// checks less of the line).
// Unboxed like `TraceItem`: a line is parsed, matched and taken apart at once, and a trace
// has one meta line, so boxing it would only add an allocation to the reader's API.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum TraceLine<R> {
    Meta(TraceMeta),
    Record(R),
}

/// Parse one (non-blank) trace line.
pub fn parse_line(line: &[u8]) -> Result<TraceItem, serde_json::Error> {
    parse_line_as(line).map(|l| match l {
        TraceLine::Meta(m) => TraceItem::Meta(m),
        TraceLine::Record(r) => TraceItem::Record(r),
    })
}

/// Parse one (non-blank) trace line, its record as an `R` (see [`TraceLine`]).
pub fn parse_line_as<R: DeserializeOwned>(line: &[u8]) -> Result<TraceLine<R>, serde_json::Error> {
    // Fast path: a line that cannot be a meta line parses straight into a record.
    if !contains_bytes(line, b"\"meta\"") {
        return crate::fastjson::from_slice(line).map(TraceLine::Record);
    }
    let value: serde_json::Value = serde_json::from_slice(line)?;
    if value.get("meta").is_some_and(|m| m.is_object()) {
        return serde_json::from_value::<MetaLineIn>(value).map(|m| TraceLine::Meta(m.meta));
    }
    if value.get("type").and_then(|t| t.as_str()) == Some("meta") {
        return serde_json::from_value(value).map(TraceLine::Meta);
    }
    serde_json::from_value(value).map(TraceLine::Record)
}

/// Whether `needle` occurs in `hay`. Every record line is searched for `"meta"`, so this
/// uses memchr's vectorised searcher rather than comparing window by window.
pub fn contains_bytes(hay: &[u8], needle: &[u8]) -> bool {
    memchr::memmem::find(hay, needle).is_some()
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn itl_tokens_omitted_when_all_ones() {
        let mut r = TraceRecord {
            output_tokens: 3,
            itl_ms: vec![1.0, 2.0],
            itl_tokens: vec![1, 1],
            ..Default::default()
        };
        let s = serde_json::to_string(&r).unwrap();
        assert!(!s.contains("itl_tokens"), "{s}");
        assert_eq!(r.first_chunk_tokens(), 1);
        r.itl_tokens = vec![1, 4];
        let s = serde_json::to_string(&r).unwrap();
        assert!(s.contains("\"itl_tokens\":[1,4]"), "{s}");
        r.output_tokens = 6;
        assert_eq!(r.first_chunk_tokens(), 1);
        assert_eq!(r.chunk_tokens(), vec![1, 4]);
    }

    #[test]
    fn meta_shapes() {
        let wrapped = br#"{"meta": {"model": "m", "tp": 2, "future_field": [1]}}"#;
        let TraceItem::Meta(m) = parse_line(wrapped).unwrap() else {
            panic!("not meta")
        };
        assert_eq!(m.model.as_deref(), Some("m"));
        assert_eq!(m.tp, Some(2));
        assert_eq!(m.schema_version(), 1);

        let flat = br#"{"type": "meta", "model": "m", "version": 3}"#;
        let TraceItem::Meta(m) = parse_line(flat).unwrap() else {
            panic!("not meta")
        };
        assert_eq!(m.schema_version(), 3);

        // A record whose request id merely contains "meta" is still a record.
        let rec = br#"{"request_id": "\"meta\"-1", "prompt_tokens": 4}"#;
        assert!(matches!(parse_line(rec).unwrap(), TraceItem::Record(_)));
    }

    #[test]
    fn block_hashes_accept_ints_and_strings() {
        let line = br#"{"block_hashes": [18446744073709551615, "ab12"]}"#;
        let TraceItem::Record(r) = parse_line(line).unwrap() else {
            panic!("not a record")
        };
        assert_eq!(
            r.block_hashes,
            vec![BlockHash::Int(u64::MAX), BlockHash::Str("ab12".into())]
        );
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(
            s,
            r#"{"prompt_tokens":0,"output_tokens":0,"block_hashes":[18446744073709551615,"ab12"]}"#
        );
        // what untagged deserialisation refused, still refused, with its message
        for bad in ["-1", "1.5", "true", "null", "[1]", "{}"] {
            let line = format!(r#"{{"block_hashes": [{bad}]}}"#);
            let e = parse_line(line.as_bytes()).unwrap_err().to_string();
            assert!(e.contains("did not match any variant"), "{bad}: {e}");
        }
        let escaped = br#"{"block_hashes": ["a\"b"]}"#;
        let TraceItem::Record(r) = parse_line(escaped).unwrap() else {
            panic!("not a record")
        };
        assert_eq!(r.block_hashes, vec![BlockHash::Str("a\"b".into())]);
    }
}
