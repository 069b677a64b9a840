//! The timeline's output side: the sink that counts what it is given ([`Writer`]) and the
//! counter tracks whose samples come out of order and leave in time order
//! ([`CounterTrack`]).

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use anyhow::Result;

use super::super::sink::{Sink, Slice};

/// The sink, counting the events it is given.
pub(super) struct Writer {
    sink: Box<dyn Sink>,
    events: u64,
}

impl Writer {
    pub(super) fn new(sink: Box<dyn Sink>) -> Self {
        Self { sink, events: 0 }
    }

    /// The events given so far.
    pub(super) fn events(&self) -> u64 {
        self.events
    }

    /// Finish the sink: the bytes it wrote.
    pub(super) fn finish(self) -> Result<u64> {
        self.sink.finish()
    }

    pub(super) fn process(&mut self, pid: u32, name: &str) -> Result<()> {
        self.events += 1;
        self.sink.process(pid, name)
    }

    pub(super) fn thread(&mut self, pid: u32, tid: u64, name: &str) -> Result<()> {
        self.events += 1;
        self.sink.thread(pid, tid, name)
    }

    pub(super) fn slice(&mut self, s: &Slice) -> Result<()> {
        self.events += 1;
        self.sink.slice(s)
    }

    pub(super) fn counter(
        &mut self,
        pid: u32,
        name: &'static str,
        ts: i64,
        value: f64,
    ) -> Result<()> {
        self.events += 1;
        self.sink.counter(pid, name, ts, value)
    }

    pub(super) fn run(&mut self, template: &Slice, bounds: &[i64]) -> Result<()> {
        self.events += bounds.len().saturating_sub(1) as u64;
        self.sink.run(template, bounds)
    }
}

/// One counter sample, ordered by (time, arrival order).
#[derive(Clone, Copy)]
struct Sample {
    ts: i64,
    seq: u64,
    value: f64,
}

impl PartialEq for Sample {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Sample {}
impl PartialOrd for Sample {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Sample {
    fn cmp(&self, o: &Self) -> Ordering {
        (self.ts, self.seq).cmp(&(o.ts, o.seq))
    }
}

/// How samples at the same time combine.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Combine {
    /// The latest sample at a time is the value.
    Last,
    /// Samples are deltas; the value is the running sum.
    Sum,
}

/// One counter track fed out of order and emitted in time order: samples wait in a
/// min-heap until the caller knows that nothing earlier can come.
pub(super) struct CounterTrack {
    name: &'static str,
    pid: u32,
    combine: Combine,
    heap: BinaryHeap<Reverse<Sample>>,
    seq: u64,
    total: f64,
    last_ts: i64,
    /// Samples that came after a later time had been emitted (emitted at that time).
    pub(super) late: u64,
}

impl CounterTrack {
    pub(super) fn new(name: &'static str, pid: u32, combine: Combine) -> Self {
        Self {
            name,
            pid,
            combine,
            heap: BinaryHeap::new(),
            seq: 0,
            total: 0.0,
            last_ts: i64::MIN,
            late: 0,
        }
    }

    pub(super) fn push(&mut self, ts: i64, value: f64) {
        self.seq += 1;
        self.heap.push(Reverse(Sample {
            ts,
            seq: self.seq,
            value,
        }));
    }

    /// Emit every time before `watermark`, one event per distinct time.
    pub(super) fn drain_before(&mut self, sink: &mut Writer, watermark: i64) -> Result<()> {
        while let Some(&Reverse(first)) = self.heap.peek() {
            if first.ts >= watermark {
                break;
            }
            self.emit_group(sink)?;
        }
        Ok(())
    }

    /// Emit the earliest times until at most `keep` samples are held.
    pub(super) fn drain_over(&mut self, sink: &mut Writer, keep: usize) -> Result<()> {
        while self.heap.len() > keep {
            self.emit_group(sink)?;
        }
        Ok(())
    }

    pub(super) fn emit_group(&mut self, sink: &mut Writer) -> Result<()> {
        let Some(Reverse(first)) = self.heap.pop() else {
            return Ok(());
        };
        let mut value = first.value;
        let mut sum = first.value;
        while let Some(&Reverse(next)) = self.heap.peek() {
            if next.ts != first.ts {
                break;
            }
            self.heap.pop();
            value = next.value;
            sum += next.value;
        }
        let value = match self.combine {
            Combine::Last => value,
            Combine::Sum => {
                self.total += sum;
                self.total
            }
        };
        let ts = if first.ts < self.last_ts {
            self.late += 1;
            self.last_ts
        } else {
            first.ts
        };
        self.last_ts = ts;
        sink.counter(self.pid, self.name, ts, value)
    }
}
