//! The workload of an open-loop `inspect simulate` read as a stream, so that memory stays
//! flat however long the trace: each request is read from the file just before the
//! virtual clock reaches its arrival, and its plan is dropped once it is sent.
//!
//! A first pass reads only each record's `arrival_ms` and `cached_tokens` (what the run
//! needs to know before its first step: how many requests, whether the capture's engine
//! ran without prefix caching, where recorded offsets start) and how far out of arrival
//! order the file is: the most a record's arrival falls behind the latest one before it
//! (a capture is written as requests finish, so by up to its longest request). The
//! second pass sorts as it reads, holding only the records that a later one could still
//! precede (those within that lateness of the latest arrival read; none for a file in
//! order), equal arrivals in file order as the held sort keeps them. The trace is streamed
//! when every record has an arrival and nothing else needs the whole workload. Otherwise —
//! records without `arrival_ms` (due at 0, after every timed one in the naming order), a
//! capture whose every record reports 0 cached tokens (whether its engine had prefix
//! caching is told from the whole workload's sharing), `--replay-sessions` or
//! `--replay-concurrency` — the workload is held in memory and sorted, as
//! [`Workload::load`] does. Both give the same requests, in the same order, at the same
//! times, under the same names.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use sim_trace::trace::{TraceItem, TraceLine, TraceReader};

use super::arrivals::Arrivals;
use super::options::RunOptions;
use super::workload::{PlanRef, Planned, Streamed, Turn, Workload, duration_ms, planned};
use crate::inspect::progress::Progress;

/// Read `path` for `inspect simulate`: streamed when the first pass finds it can be and
/// `hold` is not set (`--replay-sessions` and `--replay-concurrency` need the whole
/// workload), else held ([`Workload::load`]).
pub fn open(
    path: &Path,
    engine_block_size: Option<u64>,
    limit: Option<u64>,
    hold: bool,
) -> Result<Workload> {
    if !hold && let Some(w) = glance(path, engine_block_size, limit)? {
        return Ok(w);
    }
    Workload::load(path, engine_block_size, limit)
}

/// What the first pass reads of a record.
#[derive(Deserialize)]
struct Glance {
    #[serde(default)]
    arrival_ms: Option<f64>,
    #[serde(default)]
    cached_tokens: Option<u32>,
}

/// The first pass over `path`: the workload to stream (with no request held), or `None`
/// when it must be held (see the module docs; a file the held reader would refuse or
/// warn about is left to it, so its errors read the same).
fn glance(
    path: &Path,
    engine_block_size: Option<u64>,
    limit: Option<u64>,
) -> Result<Option<Workload>> {
    let Ok(mut reader) = TraceReader::open(path) else {
        return Ok(None);
    };
    let mut meta = None;
    let mut records = 0u64;
    let mut cached_tokens: Option<u64> = None;
    let mut first: Option<f64> = None;
    let mut latest = f64::NEG_INFINITY;
    let mut lateness = 0f64;
    let mut progress = Progress::new("simulate: scanning records");
    while let Some(line) = reader.next_as::<Glance>() {
        match line {
            Err(_) => return Ok(None),
            Ok(TraceLine::Meta(m)) => {
                meta.get_or_insert(m);
            }
            Ok(TraceLine::Record(g)) => {
                progress.tick();
                records += 1;
                if let Some(c) = g.cached_tokens {
                    *cached_tokens.get_or_insert(0) += u64::from(c);
                }
                let Some(a) = g.arrival_ms.filter(|a| a.is_finite()) else {
                    return Ok(None);
                };
                if a < latest {
                    lateness = lateness.max(latest - a);
                }
                latest = latest.max(a);
                let earliest = first.get_or_insert(a);
                *earliest = earliest.min(a);
            }
        }
    }
    progress.finish();
    let (Some(meta), Some(first)) = (meta, first) else {
        return Ok(None);
    };
    if cached_tokens == Some(0) {
        return Ok(None);
    }
    let trace_block_size = match (meta.block_size, engine_block_size) {
        (Some(b), _) if b > 0 => b as usize,
        (_, Some(b)) => b as usize,
        _ => return Ok(None),
    };
    if let Some(w) = meta.newer_schema_warning() {
        crate::errln!("warning: {}: {w}", path.display());
    }
    let requests = limit.map_or(records, |n| n.min(records));
    let streamed = Streamed {
        path: path.to_path_buf(),
        requests: usize::try_from(requests).context("too many records")?,
        shift: first.min(0.0),
        lateness_ms: lateness,
    };
    Ok(Some(Workload::streamed(
        meta,
        trace_block_size,
        records,
        cached_tokens,
        streamed,
    )))
}

/// Records read ahead of the virtual clock at a time: read in one go, rather than one
/// between two engine steps, the parser's code and data stay in cache; ~0.2 MB of plans
/// and hashes.
const AHEAD: usize = 1024;

/// A record read and not yet in arrival order: its plan and its block hashes.
struct Sorting {
    plan: Planned,
    hashes: Vec<u64>,
}

impl Sorting {
    fn arrival(&self) -> f64 {
        self.plan.arrival_ms.unwrap_or(f64::INFINITY)
    }
}

impl PartialEq for Sorting {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for Sorting {}

impl PartialOrd for Sorting {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Sorting {
    /// By arrival, then by place in the file: the held workload's stable sort.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.arrival()
            .total_cmp(&other.arrival())
            .then(self.plan.source.cmp(&other.plan.source))
    }
}

/// The requests of a streamed workload, read [`AHEAD`] at a time.
pub struct Stream {
    reader: TraceReader,
    /// The file's name, for errors.
    path: String,
    block_size: usize,
    shift: f64,
    /// Records still to read (the whole file: the first `--requests` by arrival may sit
    /// anywhere in one out of order), records read (their positions in the file) and
    /// requests still to hand out.
    left: usize,
    read: u32,
    to_send: usize,
    /// Records read that a record still unread could precede (see the module docs): the
    /// earliest on top, ties in file order.
    sorting: BinaryHeap<Reverse<Sorting>>,
    /// The most records `sorting` held at once (what the tests bound).
    #[cfg(test)]
    most_sorting: usize,
    /// The latest arrival read, and the most any record falls behind it.
    latest: f64,
    lateness: f64,
    /// The arrival of the last request handed on: a file that changed since the first
    /// pass is an error, not a reordered run.
    last: f64,
    /// The requests read and not yet due (when each is due, its plan), from `pos` on, and
    /// their hashes.
    ahead: Vec<(Duration, Planned)>,
    pos: usize,
    ahead_hashes: Vec<u64>,
    /// The request last handed out, until the next one is.
    current: Option<Planned>,
    current_hashes: Vec<u64>,
    /// The arrival-order index of the next request.
    index: usize,
}

impl Stream {
    /// The stream of `work`, a workload [`glance`] made.
    pub fn open(work: &Workload) -> Result<Self> {
        let s = work
            .stream
            .as_ref()
            .context("the workload is held, not streamed")?;
        let mut stream = Self {
            reader: TraceReader::open(&s.path)?,
            path: s.path.display().to_string(),
            block_size: work.trace_block_size,
            shift: s.shift,
            left: usize::try_from(work.records_in_trace).context("too many records")?,
            read: 0,
            to_send: s.requests,
            sorting: BinaryHeap::new(),
            #[cfg(test)]
            most_sorting: 0,
            latest: f64::NEG_INFINITY,
            lateness: s.lateness_ms,
            last: f64::NEG_INFINITY,
            ahead: Vec::with_capacity(AHEAD.min(s.requests)),
            pos: 0,
            ahead_hashes: Vec::new(),
            current: None,
            current_hashes: Vec::new(),
            index: 0,
        };
        stream.read_ahead()?;
        Ok(stream)
    }

    /// When the next request is due.
    fn next_due(&self) -> Option<Duration> {
        self.ahead.get(self.pos).map(|n| n.0)
    }

    /// Read the next [`AHEAD`] requests in arrival order (fewer at the end), once every
    /// one read before is handed out.
    fn read_ahead(&mut self) -> Result<()> {
        self.ahead.clear();
        self.ahead_hashes.clear();
        self.pos = 0;
        while self.to_send > 0 && self.ahead.len() < AHEAD {
            if let Some(r) = self.next_in_order()? {
                let Some(a) = r
                    .plan
                    .arrival_ms
                    .filter(|a| a.total_cmp(&self.last).is_ge())
                else {
                    bail!("{}: its arrivals changed while it was read", self.path);
                };
                self.last = a;
                let start = u32::try_from(self.ahead_hashes.len()).context("too many hashes")?;
                self.ahead_hashes.extend_from_slice(&r.hashes);
                let mut plan = r.plan;
                plan.hashes.0 = start;
                self.to_send -= 1;
                self.ahead.push((duration_ms(a - self.shift), plan));
                continue;
            }
            let item = self
                .reader
                .next()
                .transpose()
                .with_context(|| self.path.clone())?;
            let r = match item {
                None => bail!(
                    "{} ended before its last record: it changed while read",
                    self.path
                ),
                Some(TraceItem::Meta(_)) => continue,
                Some(TraceItem::Record(r)) => r,
            };
            let mut hashes = Vec::new();
            let plan = planned(&r, self.read, &mut hashes)?;
            self.read = self.read.checked_add(1).context("more than 2^32 records")?;
            let Some(a) = plan.arrival_ms else {
                bail!("{}: its arrivals changed while it was read", self.path);
            };
            self.latest = self.latest.max(a);
            self.left -= 1;
            self.sorting.push(Reverse(Sorting { plan, hashes }));
            #[cfg(test)]
            {
                self.most_sorting = self.most_sorting.max(self.sorting.len());
            }
        }
        Ok(())
    }

    /// The earliest record read, when no record still unread can precede it.
    fn next_in_order(&mut self) -> Result<Option<Sorting>> {
        let Some(Reverse(top)) = self.sorting.peek() else {
            return Ok(None);
        };
        let a = top.arrival();
        // a record read later arrives no earlier than `latest − lateness` (with room for
        // the rounding of that difference); an equal arrival later in the file comes after
        let bound = self.latest - self.lateness * (1.0 + 1e-9) - 1e-9 * self.latest.abs();
        if self.left > 0 && a > bound {
            return Ok(None);
        }
        Ok(self.sorting.pop().map(|Reverse(s)| s))
    }

    /// Hand out the next request, due at or before `until`: (when, arrival-order index).
    fn pop_due(&mut self, until: Duration) -> Result<Option<(Duration, usize)>> {
        let Some((at, p)) = self.ahead.get(self.pos).filter(|n| n.0 <= until) else {
            return Ok(None);
        };
        let at = *at;
        let (start, len) = p.hashes;
        self.current_hashes.clear();
        self.current_hashes
            .extend_from_slice(&self.ahead_hashes[start as usize..(start + len) as usize]);
        self.current = Some(p.clone());
        self.pos += 1;
        let i = self.index;
        self.index += 1;
        if self.pos == self.ahead.len() {
            self.read_ahead()?;
        }
        Ok(Some((at, i)))
    }
}

/// Where a run's requests come from, and when each is due: a held workload and its
/// [`Arrivals`] (any arrival mode), or a stream (open loop, in arrival order).
pub enum Feed<'a> {
    Held(&'a Workload, Box<Arrivals<'a>>),
    Stream(Box<Stream>),
}

impl<'a> Feed<'a> {
    /// The feed of `work`: streamed when it was glanced as such.
    pub fn of(work: &'a Workload, opts: &'a RunOptions) -> Result<Self> {
        Ok(match &work.stream {
            Some(_) => Feed::Stream(Box::new(Stream::open(work)?)),
            None => Feed::Held(work, Box::new(Arrivals::new(work, opts))),
        })
    }

    /// When the next request is due, if one is.
    pub fn next_due(&self) -> Option<Duration> {
        match self {
            Feed::Held(_, a) => a.next_due(),
            Feed::Stream(s) => s.next_due(),
        }
    }

    /// The next request due at or before `until`: (when, arrival-order index). Its plan
    /// is [`Self::plan`] until the next one is popped.
    pub fn pop_due(&mut self, until: Duration) -> Result<Option<(Duration, usize)>> {
        match self {
            Feed::Held(_, a) => Ok(a.pop_due(until)),
            Feed::Stream(s) => s.pop_due(until),
        }
    }

    /// Request `i`'s plan: any of a held workload, the one last popped of a stream.
    pub fn plan(&self, i: usize) -> PlanRef<'_> {
        match self {
            Feed::Held(w, _) => w.plan(i),
            Feed::Stream(s) => {
                debug_assert_eq!(
                    i + 1,
                    s.index,
                    "a stream keeps only the request last popped"
                );
                PlanRef {
                    index: i,
                    plan: s.current.as_ref().expect("a request was popped"),
                    hashes: &s.current_hashes,
                    block_size: s.block_size,
                }
            }
        }
    }

    /// Request `index` finished (or was refused) at `at`.
    pub fn finished(&mut self, index: usize, at: Duration) {
        if let Feed::Held(_, a) = self {
            a.finished(index, at);
        }
    }

    /// The session turns (every request a root unless --replay-sessions, which holds).
    pub fn turns(&self) -> &[Turn] {
        match self {
            Feed::Held(_, a) => a.turns(),
            Feed::Stream(_) => &[],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trace of `records` (after a meta line) at a fresh path.
    fn trace<S: AsRef<str>>(name: &str, records: &[S]) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!(
            "vllm-vcr-stream-{}-{name}.jsonl",
            std::process::id()
        ));
        let lines: Vec<&str> = records.iter().map(AsRef::as_ref).collect();
        let text = format!("{{\"meta\":{{\"block_size\":16}}}}\n{}\n", lines.join("\n"));
        std::fs::write(&path, text).unwrap();
        path
    }

    /// `glance` of a trace of these records (after a meta line): whether it streams, and
    /// how many requests.
    fn streams(name: &str, records: &[&str], limit: Option<u64>) -> Option<usize> {
        let path = trace(name, records);
        let got = glance(&path, None, limit).unwrap();
        std::fs::remove_file(&path).unwrap();
        got.map(|w| w.requests())
    }

    /// A capture is written as requests finish: arrivals out of order by up to the
    /// longest request. Streamed, it hands out the requests the held workload sorts, in
    /// its order (ties in file order), with their hashes, the first `--requests` of them
    /// by arrival wherever they sit in the file.
    #[test]
    fn a_trace_out_of_order_streams_in_the_held_order() {
        let mut rng = 7u64;
        let mut next = || {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            rng >> 33
        };
        // arrivals every ~10 ms, each written at its arrival plus a latency of 0–300 ms,
        // in the order written; some ties
        let mut recs: Vec<(f64, String)> = (0..400u64)
            .map(|i| {
                let a = (i * 10 - i % 3) as f64 + if i % 7 == 0 { 0.0 } else { 0.5 };
                let done = a + (next() % 300) as f64;
                let r = format!(
                    "{{\"prompt_tokens\":32,\"output_tokens\":{},\"arrival_ms\":{a},\"block_hashes\":[{},{}]}}",
                    1 + i % 5,
                    i,
                    1000 + i
                );
                (done, r)
            })
            .collect();
        recs.sort_by(|x, y| x.0.total_cmp(&y.0));
        let lines: Vec<String> = recs.into_iter().map(|(_, r)| r).collect();
        let path = trace("finish-order", &lines);
        for limit in [None, Some(57)] {
            let held = Workload::load(&path, None, limit).unwrap();
            let work = glance(&path, None, limit).unwrap().expect("it streams");
            let mut stream = Stream::open(&work).unwrap();
            let mut n = 0;
            while let Some((at, i)) = stream.pop_due(Duration::MAX).unwrap() {
                let want = held.plan(i);
                let got = stream.current.as_ref().unwrap();
                assert_eq!(got.source, want.plan.source, "request {i}");
                assert_eq!(stream.current_hashes, want.hashes, "request {i}");
                assert_eq!(
                    at,
                    duration_ms(want.plan.arrival_ms.unwrap()),
                    "request {i}"
                );
                n += 1;
            }
            assert_eq!(n, held.requests(), "{limit:?}");
            // 300 ms of requests every 10 ms: a few dozen, not the file
            let most = stream.most_sorting;
            assert!(most < 80, "{most} records held at once");
        }
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_trace_streams_when_every_record_has_an_arrival() {
        let r = |a: &str| format!("{{\"prompt_tokens\":4,\"output_tokens\":1{a}}}");
        let (a0, a5, a9) = (
            r(",\"arrival_ms\":0"),
            r(",\"arrival_ms\":5"),
            r(",\"arrival_ms\":9"),
        );
        assert_eq!(streams("sorted", &[&a0, &a5, &a5, &a9], None), Some(4));
        assert_eq!(streams("limit", &[&a0, &a5, &a9], Some(2)), Some(2));
        assert_eq!(streams("unsorted", &[&a0, &a9, &a5], None), Some(3));
        assert_eq!(streams("untimed", &[&a0, &r("")], None), None);
        // every record served nothing from a cache: whether it had one is the whole trace's
        let cold = |a: &str| r(&format!(",\"arrival_ms\":{a},\"cached_tokens\":0"));
        assert_eq!(streams("cold", &[&cold("0"), &cold("1")], None), None);
        assert_eq!(streams("empty", &[], None), None);
    }
}
