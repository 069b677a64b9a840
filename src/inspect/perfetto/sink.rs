//! What the timeline is made of, as the writers receive it: named processes and threads,
//! slices with typed arguments, counter samples; and the byte stream both writers write
//! into (a file, gzip, or stdout), which counts the bytes before compression.

use std::fs::File;
use std::io::{BufWriter, Write};

use anyhow::Result;

/// One argument of a slice, typed so that each format writes it natively.
#[derive(Debug, Clone, Copy)]
pub enum Arg<'a> {
    Uint(u64),
    /// A finite number (non-finite ones are left out by whoever builds the arguments).
    Float(f64),
    Bool(bool),
    Str(&'a str),
    /// Token ids.
    Ids(&'a [u32]),
}

/// A named argument.
pub type NamedArg<'a> = (&'static str, Arg<'a>);

/// A span of time on a thread (µs on the trace's clock).
#[derive(Debug, Clone, Copy)]
pub struct Slice<'a> {
    pub pid: u32,
    pub tid: u64,
    pub name: &'a str,
    pub category: &'static str,
    /// chrome://tracing's reserved colour name (the JSON format's `cname`; Perfetto's
    /// protobuf format has no colour: its UI colours slices by name).
    pub colour: &'static str,
    pub ts: i64,
    pub dur: i64,
    pub args: &'a [NamedArg<'a>],
}

/// A timeline format. The timeline calls these in the order the events are written; each
/// call is one event of the summary's count.
pub trait Sink {
    /// Name process `pid` (before any of its threads, slices or counters).
    fn process(&mut self, pid: u32, name: &str) -> Result<()>;
    /// Name thread `tid` of process `pid` (before its slices).
    fn thread(&mut self, pid: u32, tid: u64, name: &str) -> Result<()>;
    fn slice(&mut self, s: &Slice) -> Result<()>;
    /// Back-to-back slices without arguments: one from each of `bounds` to the next, all
    /// with `template`'s process, thread, name, category and colour (its times and
    /// arguments are not used). A request's decode gaps are nearly every event of a big
    /// trace; a writer may write them in one loop.
    fn run(&mut self, template: &Slice, bounds: &[i64]) -> Result<()> {
        for w in bounds.windows(2) {
            self.slice(&Slice {
                ts: w[0],
                dur: w[1] - w[0],
                args: &[],
                ..*template
            })?;
        }
        Ok(())
    }
    /// A sample of the counter `name` of process `pid`; a track's samples come in time
    /// order.
    fn counter(&mut self, pid: u32, name: &'static str, ts: i64, value: f64) -> Result<()>;
    /// Close the format and the stream; returns the bytes written before compression.
    fn finish(self: Box<Self>) -> Result<u64>;
}

enum Stream {
    Plain(BufWriter<Box<dyn Write>>),
    /// Buffered before the encoder: every write into it costs a pass over its internal
    /// buffer, and events are written in small pieces.
    /// (Boxed: zlib-rs's encoder state is large.)
    Gz(Box<BufWriter<flate2::write::GzEncoder<BufWriter<File>>>>),
}

/// The output: a file (gzip when asked) or stdout, buffered; counts what goes in.
pub struct Output {
    stream: Stream,
    bytes: u64,
}

impl Output {
    /// `file` (stdout when `None`), gzip-compressed when `gz`.
    pub fn new(file: Option<File>, gz: bool) -> Output {
        let stream = match file {
            None => Stream::Plain(BufWriter::with_capacity(
                1 << 16,
                Box::new(std::io::stdout()),
            )),
            Some(f) if gz => Stream::Gz(Box::new(BufWriter::with_capacity(
                1 << 16,
                flate2::write::GzEncoder::new(BufWriter::new(f), flate2::Compression::default()),
            ))),
            Some(f) => Stream::Plain(BufWriter::with_capacity(1 << 16, Box::new(f))),
        };
        Output { stream, bytes: 0 }
    }

    /// Bytes written so far (before compression).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Flush, and write the gzip trailer; returns the bytes written before compression.
    pub fn finish(self) -> Result<u64> {
        match self.stream {
            Stream::Plain(mut w) => w.flush()?,
            Stream::Gz(w) => {
                let gz = (*w).into_inner().map_err(|e| e.into_error())?;
                gz.finish()?.flush()?;
            }
        }
        Ok(self.bytes)
    }
}

impl Write for Output {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = match &mut self.stream {
            Stream::Plain(w) => w.write(buf)?,
            Stream::Gz(w) => w.write(buf)?,
        };
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match &mut self.stream {
            Stream::Plain(w) => w.flush(),
            Stream::Gz(w) => w.flush(),
        }
    }
}
