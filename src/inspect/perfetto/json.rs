//! The Chrome Trace Event JSON writer: `{"displayTimeUnit":"ms","traceEvents":[…]}`, one
//! event a line, as chrome://tracing and the Perfetto UI read it. Slices are complete
//! events (`ph: X`, with `dur`), counters `ph: C` with `args.value`, names `ph: M`
//! (`process_name`, `thread_name`); times in µs.
//!
//! An event is written by hand, byte for byte what serde_json wrote for it before (keys in
//! the same order, numbers through serde_json's own formatter, strings as is unless they need
//! escaping, and then by serde_json): going through serde's map serialiser escaped every key
//! and name (a fifth of the run) for strings that never need it.

use std::io::Write;

use anyhow::Result;
use serde_json::ser::{CompactFormatter, Formatter};

use super::sink::{Arg, Output, Sink, Slice};

/// Counters are process-scoped; their events carry this tid.
const COUNTER_TID: u64 = 0;

/// The bytes serde_json escapes in a string: control characters, `"` and `\\`.
const ESCAPED: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        t[b] = true;
        b += 1;
    }
    t[b'"' as usize] = true;
    t[b'\\' as usize] = true;
    t
};

/// `s` as a JSON string, as serde_json writes it.
#[inline]
fn string(buf: &mut Vec<u8>, s: &str) {
    if s.bytes().any(|b| ESCAPED[usize::from(b)]) {
        // escaping: serde_json's own (writing into a Vec cannot fail)
        let _ = serde_json::to_writer(&mut *buf, s);
    } else {
        buf.reserve(s.len() + 2);
        buf.push(b'"');
        buf.extend_from_slice(s.as_bytes());
        buf.push(b'"');
    }
}

#[inline]
pub(crate) fn uint(buf: &mut Vec<u8>, v: u64) {
    let _ = CompactFormatter.write_u64(buf, v);
}

#[inline]
pub(crate) fn int(buf: &mut Vec<u8>, v: i64) {
    let _ = CompactFormatter.write_i64(buf, v);
}

/// A float as serde_json writes it: `null` when not finite.
#[inline]
pub(crate) fn float(buf: &mut Vec<u8>, v: f64) {
    if v.is_finite() {
        let _ = CompactFormatter.write_f64(buf, v);
    } else {
        buf.extend_from_slice(b"null");
    }
}

/// Writes the events as they come.
pub struct JsonSink {
    out: Output,
    first: bool,
    /// Events written and not yet passed to the output, the one being written last.
    line: Vec<u8>,
}

/// Events are written one after the other into one buffer, passed to the output once it
/// holds this much: one copy of each event fewer than writing them one at a time.
const FLUSH_AT: usize = 1 << 17;

impl JsonSink {
    pub fn new(mut out: Output) -> Result<JsonSink> {
        out.write_all(b"{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n")?;
        Ok(JsonSink {
            out,
            first: true,
            line: Vec::with_capacity(FLUSH_AT + 4096),
        })
    }

    /// Start an event: `{"name":…,"ph":"…","ts":…` into `self.line` (a separator first
    /// but for the first event). [`end`](Self::end) writes the buffered events out once
    /// they fill it: writes into the output stream cost more than the encoding when they
    /// came a few bytes at a time.
    #[inline]
    fn begin(&mut self, name: &str, ph: &[u8], ts: i64) {
        if !std::mem::replace(&mut self.first, false) {
            self.line.extend_from_slice(b",\n");
        }
        self.line.extend_from_slice(b"{\"name\":");
        string(&mut self.line, name);
        self.line.extend_from_slice(b",\"ph\":\"");
        self.line.extend_from_slice(ph);
        self.line.extend_from_slice(b"\",\"ts\":");
        int(&mut self.line, ts);
    }

    /// `,"pid":…,"tid":…`.
    #[inline]
    fn ids(&mut self, pid: u32, tid: u64) {
        self.line.extend_from_slice(b",\"pid\":");
        uint(&mut self.line, u64::from(pid));
        self.line.extend_from_slice(b",\"tid\":");
        uint(&mut self.line, tid);
    }

    #[inline]
    fn end(&mut self) -> Result<()> {
        self.line.push(b'}');
        if self.line.len() >= FLUSH_AT {
            self.out.write_all(&self.line)?;
            self.line.clear();
        }
        Ok(())
    }

    fn metadata(&mut self, kind: &str, pid: u32, tid: u64, name: &str) -> Result<()> {
        self.begin(kind, b"M", 0);
        self.ids(pid, tid);
        self.line.extend_from_slice(b",\"args\":{\"name\":");
        string(&mut self.line, name);
        self.line.push(b'}');
        self.end()
    }
}

impl Sink for JsonSink {
    fn process(&mut self, pid: u32, name: &str) -> Result<()> {
        self.metadata("process_name", pid, 0, name)
    }

    fn thread(&mut self, pid: u32, tid: u64, name: &str) -> Result<()> {
        self.metadata("thread_name", pid, tid, name)
    }

    fn slice(&mut self, s: &Slice) -> Result<()> {
        self.begin(s.name, b"X", s.ts);
        self.line.extend_from_slice(b",\"dur\":");
        int(&mut self.line, s.dur);
        self.ids(s.pid, s.tid);
        self.line.extend_from_slice(b",\"cat\":");
        string(&mut self.line, s.category);
        self.line.extend_from_slice(b",\"cname\":");
        string(&mut self.line, s.colour);
        if !s.args.is_empty() {
            self.line.extend_from_slice(b",\"args\":{");
            for (i, (k, v)) in s.args.iter().enumerate() {
                if i > 0 {
                    self.line.push(b',');
                }
                string(&mut self.line, k);
                self.line.push(b':');
                match *v {
                    Arg::Uint(n) => uint(&mut self.line, n),
                    Arg::Float(x) => float(&mut self.line, x),
                    Arg::Bool(b) => self
                        .line
                        .extend_from_slice(if b { b"true" } else { b"false" }),
                    Arg::Str(t) => string(&mut self.line, t),
                    Arg::Ids(ids) => {
                        self.line.push(b'[');
                        for (j, &id) in ids.iter().enumerate() {
                            if j > 0 {
                                self.line.push(b',');
                            }
                            uint(&mut self.line, u64::from(id));
                        }
                        self.line.push(b']');
                    }
                }
            }
            self.line.push(b'}');
        }
        self.end()
    }

    fn counter(&mut self, pid: u32, name: &'static str, ts: i64, value: f64) -> Result<()> {
        self.begin(name, b"C", ts);
        self.ids(pid, COUNTER_TID);
        self.line.extend_from_slice(b",\"args\":{\"value\":");
        float(&mut self.line, value);
        self.line.push(b'}');
        self.end()
    }

    fn finish(mut self: Box<Self>) -> Result<u64> {
        self.out.write_all(&self.line)?;
        self.out.write_all(b"\n]}\n")?;
        self.out.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hand-written strings and numbers are serde_json's.
    #[test]
    fn strings_and_numbers_are_serde_jsons() {
        for s in [
            "",
            "decode",
            "a\"b",
            "tab\there",
            "back\\slash",
            "ünï",
            "\u{1}",
            "/",
        ] {
            let mut buf = Vec::new();
            string(&mut buf, s);
            assert_eq!(buf, serde_json::to_vec(s).unwrap(), "{s:?}");
        }
        for x in [
            0.0,
            -0.0,
            1.5,
            1e-7,
            123456789.125,
            1e300,
            f64::NAN,
            f64::INFINITY,
        ] {
            let mut buf = Vec::new();
            float(&mut buf, x);
            assert_eq!(buf, serde_json::to_vec(&x).unwrap(), "{x}");
        }
        for v in [i64::MIN, -1, 0, 7, i64::MAX] {
            let mut buf = Vec::new();
            int(&mut buf, v);
            assert_eq!(buf, serde_json::to_vec(&v).unwrap());
        }
    }
}
