//! The errors of reading and writing a trace: each names the file and, for line-level
//! problems, the line.

use std::io;
use std::path::{Path, PathBuf};

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
