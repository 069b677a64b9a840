//! The streaming readers: [`TraceReader`] for traces, [`JsonlReader`] for any JSON-lines file.

use std::path::Path;

use serde::de::DeserializeOwned;

use super::error::TraceError;
use super::lines::Lines;
use super::schema::{TraceItem, TraceLine, TraceMeta, TraceRecord, parse_line, parse_line_as};

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
        self.lines.path()
    }

    /// This reader's cap on one line's length, instead of [`super::max_line_bytes`].
    pub fn with_max_line_bytes(mut self, cap: usize) -> Self {
        self.lines.cap = cap.max(1);
        self
    }

    /// The 1-based number of the last line read (0 before the first).
    pub fn line(&self) -> u64 {
        self.lines.line()
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
        self.lines.line()
    }

    pub fn path(&self) -> &Path {
        self.lines.path()
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
