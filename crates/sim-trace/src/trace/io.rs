//! Opening trace-adjacent files: standard output for `-`, gzip by its magic bytes, the cap
//! on one line's length, and whole-file reads with a size cap.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;

use flate2::read::MultiGzDecoder;

/// Create (truncate) an output file; `-` is standard output.
pub fn create_output(path: &Path) -> io::Result<File> {
    if path.as_os_str() == "-" {
        File::options().write(true).open("/dev/stdout")
    } else {
        File::create(path)
    }
}

/// The default cap on one line's length ([`set_max_line_bytes`]): 64 MiB, far above any
/// record a capture writes (a 32k-token record with token ids and block hashes is under
/// 1 MiB), far below what would exhaust a host.
pub const DEFAULT_MAX_LINE_BYTES: usize = 64 << 20;

static MAX_LINE_BYTES: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(DEFAULT_MAX_LINE_BYTES);

/// Set the cap on one line's length for every reader opened from now on (the binary's
/// `--max-line-bytes`). A longer line is a [`TraceError::LineTooLong`](super::TraceError::LineTooLong) naming it: a reader
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
