//! [`TraceWriter`]: writes the meta line then records, gzip when the path ends in `.gz`.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use flate2::Compression;
use flate2::write::GzEncoder;
use serde::Serialize;

use super::error::TraceError;
use super::io::create_output;
use super::schema::{MetaLineOut, TraceMeta, TraceRecord};

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
/// before `finish` lacks the gzip footer; [`super::TraceReader`] still yields every line up to
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

fn is_gz(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gz"))
}
