//! The Chrome Trace Event JSON writer: `{"displayTimeUnit":"ms","traceEvents":[…]}`, one
//! event a line, as chrome://tracing and the Perfetto UI read it. Slices are complete
//! events (`ph: X`, with `dur`), counters `ph: C` with `args.value`, names `ph: M`
//! (`process_name`, `thread_name`); times in µs.
//!
//! An event is written by hand, byte for byte what serde_json wrote for it before (keys in
//! the same order, numbers as serde_json formats them, strings as is unless they need
//! escaping, and then by serde_json): going through serde's map serialiser escaped every key
//! and name (a fifth of the run) for strings that never need it.
//!
//! Nearly every event of a big trace is a slice without arguments (a `decode` gap) or a
//! counter sample whose name, process and category repeat the previous one's. Those are
//! written by [`Plain`]: the repeated parts are kept as ready-made byte strings, copied
//! with fixed-size copies into room reserved in the output buffer, and the numbers between
//! them are formatted in place. Small copies of varying length are library calls that cost
//! more than the bytes they move, and this path runs ~100 times per request. A request's
//! decode gaps without arguments come as one [`Sink::run`], written in one loop.

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

/// "00" to "99": two digits per table look-up.
const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
2021222324252627282930313233343536373839\
4041424344454647484950515253545556575859\
6061626364656667686970717273747576777879\
8081828384858687888990919293949596979899";

/// `v < 10^8` in exactly eight digits (leading zeros) at `room[at..at + 8]`: four pairs
/// computed independently of each other, not one after the other.
#[inline(always)]
fn put_8(room: &mut [u8], at: usize, v: u32) {
    let (hi, lo) = (v / 10_000, v % 10_000);
    for (k, part) in [hi / 100, hi % 100, lo / 100, lo % 100]
        .into_iter()
        .enumerate()
    {
        let r = part as usize * 2;
        room[at + 2 * k..at + 2 * k + 2].copy_from_slice(&PAIRS[r..r + 2]);
    }
}

/// `v < 10^8` in decimal at `room[at..]`; returns the end.
#[inline(always)]
fn put_small(room: &mut [u8], at: usize, v: u32) -> usize {
    let end = at + v.checked_ilog10().unwrap_or(0) as usize + 1;
    let mut i = end;
    let mut v = v;
    while v >= 100 {
        let r = (v % 100) as usize * 2;
        v /= 100;
        i -= 2;
        room[i..i + 2].copy_from_slice(&PAIRS[r..r + 2]);
    }
    if v >= 10 {
        let r = v as usize * 2;
        room[i - 2..i].copy_from_slice(&PAIRS[r..r + 2]);
    } else {
        room[i - 1] = b'0' + v as u8;
    }
    end
}

/// `v` in decimal at `room[at..]`; returns the end. `room` has 20 bytes from `at` on.
/// Eight digits at a time from the right: a trace's µs times have ten.
#[inline(always)]
fn put_u64(room: &mut [u8], at: usize, v: u64) -> usize {
    const E8: u64 = 100_000_000;
    if v < E8 {
        return put_small(room, at, v as u32);
    }
    let (high, low) = (v / E8, (v % E8) as u32);
    let at = if high < E8 {
        put_small(room, at, high as u32)
    } else {
        let at = put_small(room, at, (high / E8) as u32);
        put_8(room, at, (high % E8) as u32);
        at + 8
    };
    put_8(room, at, low);
    at + 8
}

/// `v` in decimal (`-` first when negative) at `room[at..]`; returns the end. `room` has
/// 20 bytes from `at` on.
#[inline(always)]
fn put_i64(room: &mut [u8], at: usize, v: i64) -> usize {
    let at = if v < 0 {
        room[at] = b'-';
        at + 1
    } else {
        at
    };
    put_u64(room, at, v.unsigned_abs())
}

/// A run of bytes that repeats from one event to the next, padded to `N` so that it is
/// copied with one fixed-size copy (the bytes past its length are overwritten next).
struct Piece<const N: usize> {
    bytes: [u8; N],
    len: usize,
}

impl<const N: usize> Piece<N> {
    fn new() -> Self {
        Piece {
            bytes: [0; N],
            len: 0,
        }
    }

    /// Make it `parts` one after the other; false (and empty) when they exceed `N`.
    fn set(&mut self, parts: &[&[u8]]) -> bool {
        self.len = 0;
        for p in parts {
            let Some(room) = self.bytes.get_mut(self.len..self.len + p.len()) else {
                self.len = 0;
                return false;
            };
            room.copy_from_slice(p);
            self.len += p.len();
        }
        true
    }

    /// Copy it to `room[at..]` (which has `N` bytes from there); returns its end.
    #[inline(always)]
    fn put(&self, room: &mut [u8], at: usize) -> usize {
        room[at..at + N].copy_from_slice(&self.bytes);
        at + self.len
    }
}

/// `"s"` as JSON, or `None` when `s` needs escaping (then the general path writes it).
fn plain_string(s: &str) -> Option<Vec<u8>> {
    if s.bytes().any(|b| ESCAPED[usize::from(b)]) {
        return None;
    }
    let mut v = Vec::with_capacity(s.len() + 2);
    v.push(b'"');
    v.extend_from_slice(s.as_bytes());
    v.push(b'"');
    Some(v)
}

/// Room reserved in the buffer for one event of the fast path: its pieces at their
/// padded sizes, three numbers of at most 20 bytes each and `,"dur":`.
const ROOM: usize = HEAD + 20 + 8 + 20 + IDS + 20 + TAIL;
const HEAD: usize = 96;
const IDS: usize = 48;
const TAIL: usize = 64;

/// The pieces of the last slice and the last counter written by the fast path, and what
/// they were made from.
struct Plain {
    /// `,\n{"name":NAME,"ph":"X","ts":` for `slice_name` (`None`: no head made yet).
    slice_head: Piece<HEAD>,
    slice_name: Option<Vec<u8>>,
    /// `,"pid":PID,"tid":` for `slice_pid`.
    slice_ids: Piece<IDS>,
    slice_pid: Option<u32>,
    /// `,"cat":CAT,"cname":COLOUR}` for `(slice_category, slice_colour)`, compared by
    /// address: they are `'static`, so equal addresses and lengths mean equal contents.
    slice_tail: Piece<TAIL>,
    slice_style: Option<(&'static str, &'static str)>,
    /// `,\n{"name":NAME,"ph":"C","ts":` for `counter_name` (`'static` too).
    counter_head: Piece<HEAD>,
    counter_name: Option<&'static str>,
    /// `,"pid":PID,"tid":0,"args":{"value":` for `counter_pid`.
    counter_ids: Piece<IDS>,
    counter_pid: Option<u32>,
}

/// `a == b`, compared inline: a name is a few bytes, and a library call to compare them
/// cost more than the compare.
#[inline(always)]
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(true, |same, (x, y)| same & (x == y))
}

fn same_static(a: &'static str, b: &'static str) -> bool {
    std::ptr::eq(a, b)
}

impl Plain {
    fn new() -> Plain {
        Plain {
            slice_head: Piece::new(),
            slice_name: None,
            slice_ids: Piece::new(),
            slice_pid: None,
            slice_tail: Piece::new(),
            slice_style: None,
            counter_head: Piece::new(),
            counter_name: None,
            counter_ids: Piece::new(),
            counter_pid: None,
        }
    }

    /// Make the slice pieces fit `s`; false when one of its strings needs escaping or a
    /// piece would not fit (the general path writes the event then).
    #[inline]
    fn fit_slice(&mut self, s: &Slice) -> bool {
        if !self
            .slice_name
            .as_deref()
            .is_some_and(|n| same_bytes(n, s.name.as_bytes()))
        {
            self.slice_name = None;
            let Some(name) = plain_string(s.name) else {
                return false;
            };
            if !self
                .slice_head
                .set(&[b",\n{\"name\":", &name, b",\"ph\":\"X\",\"ts\":"])
            {
                return false;
            }
            self.slice_name = Some(s.name.as_bytes().to_vec());
        }
        if self.slice_pid != Some(s.pid) {
            let mut pid = Vec::new();
            uint(&mut pid, u64::from(s.pid));
            self.slice_pid = None;
            if !self.slice_ids.set(&[b",\"pid\":", &pid, b",\"tid\":"]) {
                return false;
            }
            self.slice_pid = Some(s.pid);
        }
        if !self
            .slice_style
            .is_some_and(|(c, k)| same_static(c, s.category) && same_static(k, s.colour))
        {
            self.slice_style = None;
            let (Some(cat), Some(colour)) = (plain_string(s.category), plain_string(s.colour))
            else {
                return false;
            };
            if !self
                .slice_tail
                .set(&[b",\"cat\":", &cat, b",\"cname\":", &colour, b"}"])
            {
                return false;
            }
            self.slice_style = Some((s.category, s.colour));
        }
        true
    }

    /// The slice `s` (pieces fitted) into `room`; returns its length.
    #[inline(always)]
    fn slice(&self, room: &mut [u8; ROOM], s: &Slice) -> usize {
        let mut n = self.slice_head.put(room, 0);
        n = put_i64(room, n, s.ts);
        room[n..n + 7].copy_from_slice(b",\"dur\":");
        n = put_i64(room, n + 7, s.dur);
        n = self.slice_ids.put(room, n);
        n = put_u64(room, n, s.tid);
        self.slice_tail.put(room, n)
    }

    /// Make the counter pieces fit; false as for [`fit_slice`](Self::fit_slice).
    #[inline]
    fn fit_counter(&mut self, pid: u32, name: &'static str) -> bool {
        if !self.counter_name.is_some_and(|c| same_static(c, name)) {
            self.counter_name = None;
            let Some(quoted) = plain_string(name) else {
                return false;
            };
            if !self
                .counter_head
                .set(&[b",\n{\"name\":", &quoted, b",\"ph\":\"C\",\"ts\":"])
            {
                return false;
            }
            self.counter_name = Some(name);
        }
        if self.counter_pid != Some(pid) {
            let mut ids = Vec::new();
            uint(&mut ids, u64::from(pid));
            self.counter_pid = None;
            let fits = self.counter_ids.set(&[
                b",\"pid\":",
                &ids,
                b",\"tid\":",
                COUNTER_TID.to_string().as_bytes(),
                b",\"args\":{\"value\":",
            ]);
            if !fits {
                return false;
            }
            self.counter_pid = Some(pid);
        }
        true
    }

    /// A counter sample (pieces fitted) whose value is a whole number below 10^15 in
    /// magnitude and not -0 (written as serde_json writes it, `N.0`) into `room`; returns
    /// its length.
    #[inline(always)]
    fn counter(&self, room: &mut [u8; ROOM], ts: i64, whole: i64) -> usize {
        let mut n = self.counter_head.put(room, 0);
        n = put_i64(room, n, ts);
        n = self.counter_ids.put(room, n);
        n = put_i64(room, n, whole);
        room[n..n + 4].copy_from_slice(b".0}}");
        n + 4
    }
}

/// `v` as the whole number serde_json prints as `N.0`, when it is one the fast path writes:
/// below 10^15 in magnitude serde_json (ryu) prints a whole number in full; -0.0 keeps its
/// sign.
#[inline]
fn whole(v: f64) -> Option<i64> {
    if v.abs() >= 1e15 || v.is_nan() {
        return None;
    }
    let w = v as i64;
    (w as f64 == v && !(w == 0 && v.is_sign_negative())).then_some(w)
}

/// `{"name":…,"ph":"…","ts":…,` of an event.
#[inline]
fn head(buf: &mut Vec<u8>, name: &str, ph: &[u8], ts: i64) {
    buf.extend_from_slice(b"{\"name\":");
    string(buf, name);
    buf.extend_from_slice(b",\"ph\":\"");
    buf.extend_from_slice(ph);
    buf.extend_from_slice(b"\",\"ts\":");
    int(buf, ts);
}

/// `,"pid":…,"tid":…`.
#[inline]
fn ids(buf: &mut Vec<u8>, pid: u32, tid: u64) {
    buf.extend_from_slice(b",\"pid\":");
    uint(buf, u64::from(pid));
    buf.extend_from_slice(b",\"tid\":");
    uint(buf, tid);
}

/// A slice event, whatever it holds.
fn write_slice(buf: &mut Vec<u8>, s: &Slice) {
    head(buf, s.name, b"X", s.ts);
    buf.extend_from_slice(b",\"dur\":");
    int(buf, s.dur);
    ids(buf, s.pid, s.tid);
    buf.extend_from_slice(b",\"cat\":");
    string(buf, s.category);
    buf.extend_from_slice(b",\"cname\":");
    string(buf, s.colour);
    if !s.args.is_empty() {
        buf.extend_from_slice(b",\"args\":{");
        for (i, (k, v)) in s.args.iter().enumerate() {
            if i > 0 {
                buf.push(b',');
            }
            string(buf, k);
            buf.push(b':');
            match *v {
                Arg::Uint(n) => uint(buf, n),
                Arg::Float(x) => float(buf, x),
                Arg::Bool(b) => buf.extend_from_slice(if b { b"true" } else { b"false" }),
                Arg::Str(t) => string(buf, t),
                Arg::Ids(ids) => {
                    buf.push(b'[');
                    for (j, &id) in ids.iter().enumerate() {
                        if j > 0 {
                            buf.push(b',');
                        }
                        uint(buf, u64::from(id));
                    }
                    buf.push(b']');
                }
            }
        }
        buf.push(b'}');
    }
    buf.push(b'}');
}

/// A counter sample event, whatever its value.
fn write_counter(buf: &mut Vec<u8>, pid: u32, name: &str, ts: i64, value: f64) {
    head(buf, name, b"C", ts);
    ids(buf, pid, COUNTER_TID);
    buf.extend_from_slice(b",\"args\":{\"value\":");
    float(buf, value);
    buf.extend_from_slice(b"}}");
}

/// Writes the events as they come.
pub struct JsonSink {
    out: Output,
    first: bool,
    /// Events written and not yet passed to the output: `buf[..len]`. Its length is
    /// fixed (`FLUSH_AT + ROOM`), so the fast path always finds its room after a flush.
    buf: Vec<u8>,
    len: usize,
    /// An event of the general path, copied into `buf` once whole.
    event: Vec<u8>,
    plain: Plain,
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
            buf: vec![0; FLUSH_AT + ROOM],
            len: 0,
            event: Vec::with_capacity(4096),
            plain: Plain::new(),
        })
    }

    fn flush_buf(&mut self) -> Result<()> {
        self.out.write_all(&self.buf[..self.len])?;
        self.len = 0;
        Ok(())
    }

    /// Write the buffered events out when they fill the buffer: the fast path's room is
    /// past them.
    #[inline]
    fn make_room(&mut self) -> Result<()> {
        if self.len > FLUSH_AT {
            self.flush_buf()?;
        }
        Ok(())
    }

    /// Start an event of the general path in `self.event`: a separator but for the
    /// first event; [`end`](Self::end) appends it to the buffer.
    #[inline]
    fn begin(&mut self) {
        self.event.clear();
        if !std::mem::replace(&mut self.first, false) {
            self.event.extend_from_slice(b",\n");
        }
    }

    fn end(&mut self) -> Result<()> {
        if self.len + self.event.len() > self.buf.len() {
            self.flush_buf()?;
        }
        if self.event.len() > self.buf.len() {
            self.out.write_all(&self.event)?;
        } else {
            self.buf[self.len..self.len + self.event.len()].copy_from_slice(&self.event);
            self.len += self.event.len();
        }
        Ok(())
    }

    fn metadata(&mut self, kind: &str, pid: u32, tid: u64, name: &str) -> Result<()> {
        self.begin();
        head(&mut self.event, kind, b"M", 0);
        ids(&mut self.event, pid, tid);
        self.event.extend_from_slice(b",\"args\":{\"name\":");
        string(&mut self.event, name);
        self.event.extend_from_slice(b"}}");
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
        if s.args.is_empty() && !self.first && self.plain.fit_slice(s) {
            self.make_room()?;
            let at = self.len;
            let room = (&mut self.buf[at..at + ROOM])
                .try_into()
                .expect("ROOM bytes past FLUSH_AT");
            self.len += self.plain.slice(room, s);
            return Ok(());
        }
        self.begin();
        write_slice(&mut self.event, s);
        self.end()
    }

    fn run(&mut self, template: &Slice, bounds: &[i64]) -> Result<()> {
        let plain = Slice {
            args: &[],
            ..*template
        };
        if self.first || !self.plain.fit_slice(&plain) {
            for w in bounds.windows(2) {
                self.slice(&Slice {
                    ts: w[0],
                    dur: w[1] - w[0],
                    ..plain
                })?;
            }
            return Ok(());
        }
        for w in bounds.windows(2) {
            self.make_room()?;
            let at = self.len;
            let room = (&mut self.buf[at..at + ROOM])
                .try_into()
                .expect("ROOM bytes past FLUSH_AT");
            self.len += self.plain.slice(
                room,
                &Slice {
                    ts: w[0],
                    dur: w[1] - w[0],
                    ..plain
                },
            );
        }
        Ok(())
    }

    fn counter(&mut self, pid: u32, name: &'static str, ts: i64, value: f64) -> Result<()> {
        if let Some(w) = whole(value)
            && !self.first
            && self.plain.fit_counter(pid, name)
        {
            self.make_room()?;
            let at = self.len;
            let room = (&mut self.buf[at..at + ROOM])
                .try_into()
                .expect("ROOM bytes past FLUSH_AT");
            self.len += self.plain.counter(room, ts, w);
            return Ok(());
        }
        self.begin();
        write_counter(&mut self.event, pid, name, ts, value);
        self.end()
    }

    fn finish(mut self: Box<Self>) -> Result<u64> {
        self.flush_buf()?;
        self.out.write_all(b"\n]}\n")?;
        self.out.finish()
    }
}
#[cfg(test)]
mod tests;
