//! The JSONL trace schema and streaming reader/writer.
//!
//! # File layout
//!
//! A trace is JSON Lines (UTF-8, one JSON object per line, `\n`-terminated), gzip-compressed
//! when the path ends in `.gz` (concatenated gzip members are read as one stream, so
//! `cat a.jsonl.gz b.jsonl.gz` works). Blank lines are skipped.
//!
//! * **The metadata line** comes first and is wrapped in a `meta` key:
//!   `{"meta": {"version": 1, "model": "Qwen/Qwen3-8B", "gpu": "H200", ...}}` (see
//!   [`TraceMeta`]). The wrapper keeps the line distinguishable from records with plain
//!   text tools (`grep -v '"meta"' trace.jsonl` strips it, as the docs' trace-concatenation
//!   recipe does). For compatibility the reader also accepts a flat `{"type": "meta", ...}`
//!   line. A meta line is optional, and the reader reports meta lines wherever they occur
//!   (concatenated traces may carry several).
//! * **Every other line is one request record** ([`TraceRecord`]), unwrapped:
//!   `{"request_id": "...", "prompt_tokens": 512, "output_tokens": 128, "ttft_ms": ..., ...}`.
//!
//! # Compatibility rules
//!
//! * Unknown fields are ignored (no `deny_unknown_fields`), so traces written by newer or
//!   older versions load.
//! * Every field other than the basic shape counters is optional and omitted when empty;
//!   absent fields deserialize to their defaults.
//! * `meta.version` is the schema version. Absent means version 1 (traces that predate the
//!   field). Additive changes keep the version; only a change in the *meaning* of an existing
//!   field bumps it, so readers can branch on [`TraceMeta::schema_version`]. The reader does
//!   not reject newer versions.
//!
//! # Times
//!
//! All `*_ms` values are milliseconds as JSON numbers (fractional allowed). `arrival_ms` is
//! measured from the capture's zero (the same zero as the step-stats sidecar's `ts_ms`);
//! `meta.created_unix_ms` records that zero's wall-clock time when known.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use flate2::Compression;
use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;
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
struct MetaLineOut<'a> {
    meta: &'a TraceMeta,
}

#[derive(Deserialize)]
struct MetaLineIn {
    meta: TraceMeta,
}

/// Create (truncate) an output file; `-` is standard output.
pub fn create_output(path: &Path) -> io::Result<File> {
    if path.as_os_str() == "-" {
        File::options().write(true).open("/dev/stdout")
    } else {
        File::create(path)
    }
}

/// Errors name the file and, for line-level problems, the 1-based line number.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{}: {cause}", path.display())]
    Open { path: PathBuf, cause: io::Error },
    #[error("{}:{line}: read error: {cause}", path.display())]
    Read {
        path: PathBuf,
        line: u64,
        cause: io::Error,
    },
    #[error("{}:{line}: invalid trace line: {cause}", path.display())]
    Parse {
        path: PathBuf,
        line: u64,
        cause: serde_json::Error,
    },
    #[error(
        "{}: truncated gzip stream (unexpected end of compressed data); last good line: {last_good_line}",
        path.display()
    )]
    Truncated { path: PathBuf, last_good_line: u64 },
    #[error("{}: write error: {cause}", path.display())]
    Write { path: PathBuf, cause: io::Error },
    /// A line that parsed but holds a value no reader may use (e.g. a latency past a
    /// day), naming the field.
    #[error("{}:{line}: {why}", path.display())]
    Invalid {
        path: PathBuf,
        line: u64,
        why: String,
    },
    /// A line longer than the reader's cap (`--max-line-bytes`): reading it whole could
    /// take all the memory there is.
    #[error(
        "{}:{line}: line longer than {cap} bytes (the cap on one trace line; raise it with --max-line-bytes if the line is real)",
        path.display()
    )]
    LineTooLong {
        path: PathBuf,
        line: u64,
        cap: usize,
    },
    /// A gzip stream whose data is damaged (not merely cut short).
    #[error(
        "{}: corrupt gzip data after line {last_good_line} ({cause}): the file is damaged",
        path.display()
    )]
    Corrupt {
        path: PathBuf,
        last_good_line: u64,
        cause: io::Error,
    },
}

impl TraceError {
    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            TraceError::Open { path, .. }
            | TraceError::Read { path, .. }
            | TraceError::Parse { path, .. }
            | TraceError::Truncated { path, .. }
            | TraceError::Invalid { path, .. }
            | TraceError::LineTooLong { path, .. }
            | TraceError::Corrupt { path, .. }
            | TraceError::Write { path, .. } => path,
        }
    }

    /// The kind of the underlying I/O error, if it is one (e.g. `BrokenPipe` when a reader
    /// of `-o -` went away).
    pub fn io_kind(&self) -> Option<io::ErrorKind> {
        match self {
            TraceError::Open { cause, .. }
            | TraceError::Read { cause, .. }
            | TraceError::Write { cause, .. } => Some(cause.kind()),
            TraceError::Parse { .. }
            | TraceError::Truncated { .. }
            | TraceError::Invalid { .. }
            | TraceError::LineTooLong { .. }
            | TraceError::Corrupt { .. } => None,
        }
    }

    /// The 1-based line the error is about, for line-level errors.
    pub fn line(&self) -> Option<u64> {
        match self {
            TraceError::Read { line, .. }
            | TraceError::Parse { line, .. }
            | TraceError::Invalid { line, .. }
            | TraceError::LineTooLong { line, .. } => Some(*line),
            _ => None,
        }
    }
}

fn is_gz(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gz"))
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

/// Whether `needle` occurs in `hay`. (memchr's searcher: a naive window-by-window compare
/// cost about 5 % of reading a trace, as every record line is searched for `"meta"`.)
pub fn contains_bytes(hay: &[u8], needle: &[u8]) -> bool {
    memchr::memmem::find(hay, needle).is_some()
}

/// The default cap on one line's length ([`set_max_line_bytes`]): 64 MiB, far above any
/// record a capture writes (a 32k-token record with token ids and block hashes is under
/// 1 MiB), far below what would exhaust a host.
pub const DEFAULT_MAX_LINE_BYTES: usize = 64 << 20;

static MAX_LINE_BYTES: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(DEFAULT_MAX_LINE_BYTES);

/// Set the cap on one line's length for every reader opened from now on (the binary's
/// `--max-line-bytes`). A longer line is a [`TraceError::LineTooLong`] naming it: a reader
/// never holds more than this (plus one read buffer) of a line, so one hostile line in a
/// small `.gz` cannot make it allocate gigabytes.
pub fn set_max_line_bytes(bytes: usize) {
    MAX_LINE_BYTES.store(bytes.max(1), std::sync::atomic::Ordering::Relaxed);
}

/// The cap on one line's length readers opened now get (see [`set_max_line_bytes`]).
pub fn max_line_bytes() -> usize {
    MAX_LINE_BYTES.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether a file starts with the gzip magic bytes: such a file is gunzipped whatever its
/// name (a `.jsonl` that is really gzip is common after a rename).
pub fn is_gzip_head(head: &[u8]) -> bool {
    head.starts_with(&[0x1f, 0x8b])
}

/// Open `path` for reading, gunzipped when its content is gzip (by its magic bytes, not
/// its name). For the whole-file inputs (a model file, a guidellm report) that are not
/// read line by line; [`read_capped`] bounds what they may take.
pub fn open_maybe_gz(path: &Path) -> io::Result<Box<dyn Read + Send>> {
    let file = File::open(path)?;
    let mut r = BufReader::with_capacity(1 << 16, file);
    let gz = is_gzip_head(r.fill_buf()?);
    Ok(if gz {
        Box::new(MultiGzDecoder::new(r))
    } else {
        Box::new(r)
    })
}

/// Read a whole (possibly gzipped) file, refusing one larger than `cap` bytes after
/// decompression (`InvalidData`, naming the cap).
pub fn read_capped(path: &Path, cap: usize) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    open_maybe_gz(path)?
        .take(cap as u64 + 1)
        .read_to_end(&mut out)?;
    if out.len() > cap {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "larger than {cap} bytes (the cap on one document; raise it with --max-line-bytes if the file is real)"
            ),
        ));
    }
    Ok(out)
}

/// Append the next line of `input` (through its `\n`) to `buf`, reading at most `cap`
/// bytes of it: `Ok(None)` when the line is longer (what was read of it is dropped), else
/// the bytes read (0 at the end).
fn read_line_capped(
    input: &mut dyn BufRead,
    buf: &mut Vec<u8>,
    cap: usize,
) -> io::Result<Option<usize>> {
    let mut total = 0;
    loop {
        let avail = match input.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            return Ok(Some(total));
        }
        let (n, ends) = match memchr::memchr(b'\n', avail) {
            Some(i) => (i + 1, true),
            None => (avail.len(), false),
        };
        if buf.len() + n - usize::from(ends) > cap {
            buf.clear();
            return Ok(None);
        }
        buf.extend_from_slice(&avail[..n]);
        input.consume(n);
        total += n;
        if ends {
            return Ok(Some(total));
        }
    }
}

/// Read a gzip file to its end, discarding the data: the stream's own error (damaged
/// data, a bad checksum) if it has one. `Ok` for an intact stream, and for one cut short
/// (that is reported as truncation, not as damage).
fn gzip_damage(path: &Path) -> Option<io::Error> {
    let file = File::open(path).ok()?;
    let mut gz = MultiGzDecoder::new(BufReader::with_capacity(1 << 16, file));
    match io::copy(&mut gz, &mut io::sink()) {
        Err(e) if e.kind() != io::ErrorKind::UnexpectedEof => Some(e),
        _ => None,
    }
}

/// Bytes read from a file at a time: fewer system calls than std's 8 KiB default, still
/// small next to the caches.
const READ_BUFFER: usize = 1 << 18;

/// Decompressed chunks in flight between the gunzip thread and the reader (each
/// [`READ_BUFFER`] bytes): bounds the memory whatever the file's size.
const GUNZIP_CHUNKS: usize = 4;

/// A gzip file decompressed on its own thread, read as a [`BufRead`]: decompression costs
/// about as much as parsing the JSON, so on two cores the two overlap instead of adding up.
/// The stream is the one [`MultiGzDecoder`] gives, chunk by chunk in order; its first error
/// (`UnexpectedEof` for a truncated file) comes after every byte decoded before it.
struct GunzipThread {
    chunks: std::sync::mpsc::Receiver<io::Result<Vec<u8>>>,
    /// Emptied chunks go back to the thread to be refilled, so nothing is allocated per chunk.
    spent: std::sync::mpsc::SyncSender<Vec<u8>>,
    chunk: Vec<u8>,
    pos: usize,
    /// The thread's error, kept to be returned again if the reader asks once more.
    failed: Option<io::ErrorKind>,
}

impl GunzipThread {
    fn spawn(file: BufReader<File>) -> GunzipThread {
        let (tx, chunks) = std::sync::mpsc::sync_channel(GUNZIP_CHUNKS);
        let (spent, recycled) = std::sync::mpsc::sync_channel::<Vec<u8>>(GUNZIP_CHUNKS + 1);
        std::thread::spawn(move || {
            let mut gz = flate2::bufread::MultiGzDecoder::new(file);
            loop {
                let mut buf = recycled.try_recv().unwrap_or_default();
                buf.resize(READ_BUFFER, 0);
                let mut filled = 0;
                let mut error = None;
                while filled < buf.len() {
                    match gz.read(&mut buf[filled..]) {
                        Ok(0) => break,
                        Ok(n) => filled += n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            error = Some(e);
                            break;
                        }
                    }
                }
                buf.truncate(filled);
                let end = filled == 0 || error.is_some();
                // a send fails once the reader is dropped: nothing more to do
                if filled > 0 && tx.send(Ok(buf)).is_err() {
                    return;
                }
                if let Some(e) = error {
                    let _ = tx.send(Err(e));
                    return;
                }
                if end {
                    return;
                }
            }
        });
        GunzipThread {
            chunks,
            spent,
            chunk: Vec::new(),
            pos: 0,
            failed: None,
        }
    }
}

impl io::Read for GunzipThread {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let available = self.fill_buf()?;
        let n = available.len().min(out.len());
        out[..n].copy_from_slice(&available[..n]);
        self.consume(n);
        Ok(n)
    }
}

impl BufRead for GunzipThread {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        if self.pos == self.chunk.len() {
            if let Some(kind) = self.failed {
                return Err(io::Error::new(kind, "the gzip stream failed before"));
            }
            match self.chunks.recv() {
                Ok(Ok(next)) => {
                    let spent = std::mem::replace(&mut self.chunk, next);
                    // the thread may have ended; the buffer is then simply dropped
                    let _ = self.spent.try_send(spent);
                    self.pos = 0;
                }
                Ok(Err(e)) => {
                    self.failed = Some(e.kind());
                    return Err(e);
                }
                // the thread ended without an error: the end of the stream
                Err(_) => return Ok(&[]),
            }
        }
        Ok(&self.chunk[self.pos..])
    }

    fn consume(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.chunk.len());
    }
}

/// Lines of a (possibly gzipped) text file, with the numbering and truncation reporting
/// every reader of this crate shares.
pub(crate) struct Lines {
    path: PathBuf,
    input: Box<dyn BufRead + Send>,
    gz: bool,
    buf: Vec<u8>,
    line: u64,
    last_good_line: u64,
    done: bool,
    /// The longest line read ([`max_line_bytes`] when opened).
    cap: usize,
    /// The gzip stream was checked for damage after a line that did not parse.
    checked_damage: bool,
}

impl Lines {
    pub(crate) fn open(path: &Path) -> Result<Self, TraceError> {
        let open_error = |source| TraceError::Open {
            path: path.to_path_buf(),
            cause: source,
        };
        let file = File::open(path).map_err(open_error)?;
        let mut reader = BufReader::with_capacity(READ_BUFFER, file);
        // gzip by content, not by name: a renamed `.jsonl` that is gzip is read as such
        let gz = is_gzip_head(reader.fill_buf().map_err(open_error)?);
        let input: Box<dyn BufRead + Send> = if gz {
            Box::new(GunzipThread::spawn(reader))
        } else {
            Box::new(reader)
        };
        Ok(Self {
            path: path.to_path_buf(),
            input,
            gz,
            buf: Vec::new(),
            line: 0,
            last_good_line: 0,
            done: false,
            cap: max_line_bytes(),
            checked_damage: false,
        })
    }

    /// The next non-blank line, trimmed; `None` at the end. After an I/O error (a
    /// truncated gzip stream included) the reader is done. Call [`Lines::good`] once the
    /// line parsed, so a truncation reports the last good line.
    fn next_line(&mut self) -> Option<Result<&[u8], TraceError>> {
        loop {
            if self.done {
                return None;
            }
            self.buf.clear();
            match read_line_capped(&mut *self.input, &mut self.buf, self.cap) {
                Ok(Some(0)) => {
                    self.done = true;
                    return None;
                }
                Ok(Some(_)) => {}
                Ok(None) => {
                    // the rest of the line is not read: nothing after it can be trusted
                    self.done = true;
                    return Some(Err(TraceError::LineTooLong {
                        path: self.path.clone(),
                        line: self.line + 1,
                        cap: self.cap,
                    }));
                }
                Err(source) => {
                    self.done = true;
                    if self.gz && source.kind() == io::ErrorKind::UnexpectedEof {
                        return Some(Err(TraceError::Truncated {
                            path: self.path.clone(),
                            last_good_line: self.last_good_line,
                        }));
                    }
                    if self.gz {
                        return Some(Err(TraceError::Corrupt {
                            path: self.path.clone(),
                            last_good_line: self.last_good_line,
                            cause: source,
                        }));
                    }
                    return Some(Err(TraceError::Read {
                        path: self.path.clone(),
                        line: self.line + 1,
                        cause: source,
                    }));
                }
            }
            self.line += 1;
            if self.buf.trim_ascii().is_empty() {
                self.last_good_line = self.line;
                continue;
            }
            return Some(Ok(self.buf.trim_ascii()));
        }
    }

    fn good(&mut self) {
        self.last_good_line = self.line;
    }

    fn parse_error(&mut self, source: serde_json::Error) -> TraceError {
        // Damaged gzip data often inflates to garbage before the stream's own check fails:
        // the first line that does not parse in a gzip file has the whole stream checked,
        // so damage is reported as damage rather than as a JSON error.
        if self.gz && !self.checked_damage {
            self.checked_damage = true;
            if let Some(cause) = gzip_damage(&self.path) {
                self.done = true;
                return TraceError::Corrupt {
                    path: self.path.clone(),
                    last_good_line: self.last_good_line,
                    cause,
                };
            }
        }
        TraceError::Parse {
            path: self.path.clone(),
            line: self.line,
            cause: source,
        }
    }

    /// The next non-blank line deserialised as a `T`; a line that does not parse is a
    /// [`TraceError::Parse`] naming it, and the reader goes on with the next one.
    pub(crate) fn next_json<T: DeserializeOwned>(&mut self) -> Option<Result<T, TraceError>> {
        self.next_with(|text| crate::fastjson::from_slice(text))
    }

    /// The next non-blank line (trimmed) turned into a `T` by `parse`, with the errors of
    /// [`next_json`](Self::next_json).
    pub(crate) fn next_with<T>(
        &mut self,
        parse: impl FnOnce(&[u8]) -> Result<T, serde_json::Error>,
    ) -> Option<Result<T, TraceError>> {
        let parsed = match self.next_line()? {
            Err(e) => return Some(Err(e)),
            Ok(text) => parse(text),
        };
        Some(match parsed {
            Ok(v) => {
                self.good();
                Ok(v)
            }
            Err(source) => Err(self.parse_error(source)),
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The 1-based number of the last line read (0 before the first).
    pub(crate) fn line(&self) -> u64 {
        self.line
    }
}

/// Streams a trace line by line (never loading the whole file), gunzipping `.gz` paths.
///
/// Iterates `Result<TraceItem, TraceError>`. After an I/O error (including a truncated
/// gzip stream) iteration ends; after a parse error it continues with the next line, so
/// callers choose whether a bad line is fatal.
pub struct TraceReader {
    lines: Lines,
}

impl TraceReader {
    pub fn open(path: impl AsRef<Path>) -> Result<Self, TraceError> {
        Ok(Self {
            lines: Lines::open(path.as_ref())?,
        })
    }

    /// The path being read.
    pub fn path(&self) -> &Path {
        &self.lines.path
    }

    /// This reader's cap on one line's length, instead of [`max_line_bytes`].
    pub fn with_max_line_bytes(mut self, cap: usize) -> Self {
        self.lines.cap = cap.max(1);
        self
    }

    /// The 1-based number of the last line read (0 before the first).
    pub fn line(&self) -> u64 {
        self.lines.line
    }

    /// Reads items until the first record, returning the meta line if the trace starts
    /// with one (and the first record, if any, so nothing is lost).
    pub fn read_header(&mut self) -> Result<(Option<TraceMeta>, Option<TraceRecord>), TraceError> {
        match self.next().transpose()? {
            Some(TraceItem::Meta(m)) => Ok((Some(m), None)),
            Some(TraceItem::Record(r)) => Ok((None, Some(r))),
            None => Ok((None, None)),
        }
    }

    /// The next line, its record read as an `R` (see [`TraceLine`]); `None` at the end.
    /// Errors as for the iterator.
    pub fn next_as<R: DeserializeOwned>(&mut self) -> Option<Result<TraceLine<R>, TraceError>> {
        self.lines.next_with(|text| parse_line_as(text))
    }

    /// Iterate only the records, skipping meta lines.
    pub fn records(self) -> impl Iterator<Item = Result<TraceRecord, TraceError>> {
        self.filter_map(|item| match item {
            Ok(TraceItem::Record(r)) => Some(Ok(r)),
            Ok(TraceItem::Meta(_)) => None,
            Err(e) => Some(Err(e)),
        })
    }
}

impl Iterator for TraceReader {
    type Item = Result<TraceItem, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.lines.next_with(parse_line)
    }
}

/// Streams any JSON-lines file (a Mooncake trace, …) value by value, gunzipping `.gz`
/// paths, with the same error reporting as [`TraceReader`]: errors name the file and line,
/// blank lines are skipped, a truncated gzip stream ends with [`TraceError::Truncated`]
/// after every complete line. (The step-stats sidecar has its typed reader,
/// [`crate::steps::StepStatsReader`].)
pub struct JsonlReader {
    lines: Lines,
}

impl JsonlReader {
    pub fn open(path: impl AsRef<Path>) -> Result<Self, TraceError> {
        Ok(Self {
            lines: Lines::open(path.as_ref())?,
        })
    }

    /// The 1-based number of the last line read.
    pub fn line(&self) -> u64 {
        self.lines.line
    }

    pub fn path(&self) -> &Path {
        &self.lines.path
    }

    /// The next non-blank line (trimmed) turned into a `T` by `parse` (e.g.
    /// `serde_json::from_slice` into a type of the caller's, which then need not go
    /// through a [`serde_json::Value`]), with the iterator's errors.
    pub fn next_with<T>(
        &mut self,
        parse: impl FnOnce(&[u8]) -> Result<T, serde_json::Error>,
    ) -> Option<Result<T, TraceError>> {
        self.lines.next_with(parse)
    }
}

impl Iterator for JsonlReader {
    type Item = Result<serde_json::Value, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.lines.next_json()
    }
}

enum Sink {
    Plain(BufWriter<File>),
    /// Boxed: zlib-rs's encoder state is large, and a writer has one sink.
    Gz(Box<GzEncoder<BufWriter<File>>>),
}

impl Sink {
    fn writer(&mut self) -> &mut dyn Write {
        match self {
            Sink::Plain(w) => w,
            Sink::Gz(w) => w,
        }
    }
}

/// Writes a trace: the meta line, then records; gzip when the path ends in `.gz`.
///
/// The writer writes **directly to the final path**, not to a temp file renamed on
/// [`finish`](Self::finish): a recording is long-lived and must be followable while it
/// runs (`tail -f`, or a reader streaming a periodically [`flush`](Self::flush)ed file),
/// and a recorder killed before `finish` must leave every record already flushed on disk
/// under the expected name rather than in an orphaned temp file. A `.gz` trace cut off
/// before `finish` lacks the gzip footer; [`TraceReader`] still yields every line up to
/// the cut and then reports [`TraceError::Truncated`].
pub struct TraceWriter {
    path: PathBuf,
    sink: Option<Sink>,
    /// One line is serialised here, then written in one call: serde_json writes in tiny
    /// pieces, and each write into the gzip encoder costs a pass over its buffer.
    line: Vec<u8>,
}

impl TraceWriter {
    /// Create (truncate) `path` and write the meta line.
    pub fn create(path: impl AsRef<Path>, meta: &TraceMeta) -> Result<Self, TraceError> {
        let mut w = Self::create_without_meta(path)?;
        w.write_meta(meta)?;
        Ok(w)
    }

    /// Create (truncate) `path` without a meta line (for converters that have none).
    pub fn create_without_meta(path: impl AsRef<Path>) -> Result<Self, TraceError> {
        let path = path.as_ref().to_path_buf();
        let file = create_output(&path).map_err(|source| TraceError::Open {
            path: path.clone(),
            cause: source,
        })?;
        let buffered = BufWriter::with_capacity(1 << 16, file);
        let sink = if is_gz(&path) {
            Sink::Gz(Box::new(GzEncoder::new(buffered, Compression::default())))
        } else {
            Sink::Plain(buffered)
        };
        Ok(Self {
            path,
            sink: Some(sink),
            line: Vec::with_capacity(4096),
        })
    }

    /// The path being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_line<T: Serialize>(&mut self, value: &T) -> Result<(), TraceError> {
        self.line.clear();
        serde_json::to_writer(&mut self.line, value)
            .map_err(|e| self.write_error(io::Error::from(e)))?;
        self.line.push(b'\n');
        self.write_buffered_line()
    }

    /// One `write_all` per line: many small writes into flate2 cost far more than one.
    fn write_buffered_line(&mut self) -> Result<(), TraceError> {
        let Some(sink) = self.sink.as_mut() else {
            return Err(self.write_error(io::Error::other("trace writer already finished")));
        };
        let written = sink.writer().write_all(&self.line);
        written.map_err(|e| self.write_error(e))
    }

    fn write_error(&self, cause: io::Error) -> TraceError {
        TraceError::Write {
            path: self.path.clone(),
            cause,
        }
    }

    /// Write a `{"meta": {...}}` line.
    pub fn write_meta(&mut self, meta: &TraceMeta) -> Result<(), TraceError> {
        self.write_line(&MetaLineOut { meta })
    }

    /// Write any serialisable value as one line (for sidecar files such as step stats).
    pub fn write_json<T: Serialize>(&mut self, value: &T) -> Result<(), TraceError> {
        self.write_line(value)
    }

    /// Write one already-serialised line (`line` without its `\n`), for writers of other
    /// line formats that want the same `.gz`, `-` and error handling.
    pub fn write_raw_line(&mut self, line: &[u8]) -> Result<(), TraceError> {
        self.line.clear();
        self.line.extend_from_slice(line);
        self.line.push(b'\n');
        self.write_buffered_line()
    }

    /// Write one record line.
    pub fn write_record(&mut self, record: &TraceRecord) -> Result<(), TraceError> {
        self.write_line(record)
    }

    /// Push everything written so far to the file (a gzip sync flush for `.gz`), so a
    /// concurrent reader sees every complete line.
    pub fn flush(&mut self) -> Result<(), TraceError> {
        if let Some(sink) = self.sink.as_mut() {
            sink.writer().flush().map_err(|source| TraceError::Write {
                path: self.path.clone(),
                cause: source,
            })?;
        }
        Ok(())
    }

    /// Flush, write the gzip footer (for `.gz`) and sync the file to disk.
    pub fn finish(mut self) -> Result<(), TraceError> {
        self.finish_inner()
    }

    fn finish_inner(&mut self) -> Result<(), TraceError> {
        let err = |source: io::Error| TraceError::Write {
            path: self.path.clone(),
            cause: source,
        };
        let buffered = match self.sink.take() {
            None => return Ok(()),
            Some(Sink::Plain(w)) => w,
            Some(Sink::Gz(w)) => (*w).finish().map_err(err)?,
        };
        let file = buffered.into_inner().map_err(|e| err(e.into_error()))?;
        // Pipes and terminals cannot be synced (EINVAL); only files are.
        if file.metadata().is_ok_and(|m| m.is_file()) {
            file.sync_all().map_err(err)?;
        }
        Ok(())
    }
}

impl Drop for TraceWriter {
    /// Best effort: a writer dropped without [`finish`](TraceWriter::finish) still flushes
    /// and completes the gzip stream; errors are ignored (call `finish` to see them).
    fn drop(&mut self) {
        let _ = self.finish_inner();
    }
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
