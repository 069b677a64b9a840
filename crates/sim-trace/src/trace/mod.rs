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

mod error;
mod io;
mod lines;
mod reader;
mod schema;
mod writer;

pub use error::TraceError;
pub use io::{
    DEFAULT_MAX_LINE_BYTES, create_output, is_gzip_head, max_line_bytes, open_maybe_gz,
    read_capped, set_max_line_bytes,
};
pub(crate) use lines::Lines;
pub use reader::{JsonlReader, TraceReader};
pub use schema::{
    BlockHash, ItlCtx, SCHEMA_VERSION, TOOL_NAME, TraceItem, TraceLine, TraceMeta, TraceRecord,
    contains_bytes, parse_line, parse_line_as, record_name,
};
pub use writer::TraceWriter;
