//! The Chrome Trace Event JSON writer: `{"displayTimeUnit":"ms","traceEvents":[…]}`, one
//! event a line, as chrome://tracing and the Perfetto UI read it. Slices are complete
//! events (`ph: X`, with `dur`), counters `ph: C` with `args.value`, names `ph: M`
//! (`process_name`, `thread_name`); times in µs.

use std::io::Write;

use anyhow::Result;
use serde::Serialize;
use serde::ser::{SerializeMap, Serializer};

use super::sink::{Arg, NamedArg, Output, Sink, Slice};

/// Counters are process-scoped; their events carry this tid.
const COUNTER_TID: u64 = 0;

/// One Chrome trace event.
#[derive(Serialize)]
struct Event<'a, A: Serialize> {
    name: &'a str,
    ph: &'static str,
    ts: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    dur: Option<i64>,
    pid: u32,
    tid: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    cat: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cname: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    args: Option<A>,
}

/// A slice's arguments as a JSON object.
struct ArgsObject<'a>(&'a [NamedArg<'a>]);

impl Serialize for ArgsObject<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0 {
            match v {
                Arg::Uint(n) => m.serialize_entry(k, n)?,
                Arg::Float(x) => m.serialize_entry(k, x)?,
                Arg::Bool(b) => m.serialize_entry(k, b)?,
                Arg::Str(t) => m.serialize_entry(k, t)?,
                Arg::Ids(ids) => m.serialize_entry(k, ids)?,
            }
        }
        m.end()
    }
}

#[derive(Serialize)]
struct Name<'a> {
    name: &'a str,
}

#[derive(Serialize)]
struct Value {
    value: f64,
}

/// Writes the events as they come.
pub struct JsonSink {
    out: Output,
    first: bool,
    /// Scratch: the event being written.
    line: Vec<u8>,
}

impl JsonSink {
    pub fn new(mut out: Output) -> Result<JsonSink> {
        out.write_all(b"{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n")?;
        Ok(JsonSink {
            out,
            first: true,
            line: Vec::with_capacity(1024),
        })
    }

    /// One event, serialised into `self.line` and written in one call: serde_json writes
    /// in pieces of a few bytes, and each write into the output stream cost more than
    /// serialising (40 % of the run went to `write_all`).
    fn event<A: Serialize>(&mut self, e: &Event<A>) -> Result<()> {
        self.line.clear();
        if !std::mem::replace(&mut self.first, false) {
            self.line.extend_from_slice(b",\n");
        }
        serde_json::to_writer(&mut self.line, e)?;
        self.out.write_all(&self.line)?;
        Ok(())
    }

    fn metadata(&mut self, kind: &str, pid: u32, tid: u64, name: &str) -> Result<()> {
        self.event(&Event {
            name: kind,
            ph: "M",
            ts: 0,
            dur: None,
            pid,
            tid,
            cat: None,
            cname: None,
            args: Some(Name { name }),
        })
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
        self.event(&Event {
            name: s.name,
            ph: "X",
            ts: s.ts,
            dur: Some(s.dur),
            pid: s.pid,
            tid: s.tid,
            cat: Some(s.category),
            cname: Some(s.colour),
            args: (!s.args.is_empty()).then_some(ArgsObject(s.args)),
        })
    }

    fn counter(&mut self, pid: u32, name: &'static str, ts: i64, value: f64) -> Result<()> {
        self.event(&Event {
            name,
            ph: "C",
            ts,
            dur: None,
            pid,
            tid: COUNTER_TID,
            cat: None,
            cname: None,
            args: Some(Value { value }),
        })
    }

    fn finish(mut self: Box<Self>) -> Result<u64> {
        self.out.write_all(b"\n]}\n")?;
        self.out.finish()
    }
}
