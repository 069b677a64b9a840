//! Reading a (possibly gzipped) text file line by line, with the line numbers, the line
//! length cap and the truncation reporting every reader of the crate shares; gzip is
//! decompressed on its own thread.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use flate2::read::MultiGzDecoder;
use serde::de::DeserializeOwned;

use super::error::TraceError;
use super::io::{is_gzip_head, max_line_bytes};

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
    pub(super) cap: usize,
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
