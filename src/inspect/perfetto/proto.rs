//! The Perfetto protobuf writer: a `Trace` message, i.e. a stream of `TracePacket`s (each
//! `packet = 1` of `Trace`: a key byte, a length, the packet), as Perfetto's own tracing
//! service writes it. The Perfetto UI and `trace_processor` read it natively, at a fraction
//! of the JSON's size and parsing cost.
//!
//! What is written (field numbers from Perfetto's public trace protos, listed below):
//! - a process track per process (`TrackDescriptor.process`: pid, name), and under it one
//!   named track per lane / request row / engine steps (a custom track: `parent_uuid`, `name`,
//!   ordered by `sibling_order_rank` = the JSON's tid, never merged with a same-named
//!   sibling) and one counter track per counter (`TrackDescriptor.counter`);
//! - a slice is a `TrackEvent` of type SLICE_BEGIN (name, category, debug annotations for
//!   its arguments) and one of type SLICE_END, timestamps in ns (the JSON's µs × 1000);
//! - a counter sample is a `TrackEvent` of type COUNTER (`counter_value` for whole numbers,
//!   `double_counter_value` otherwise);
//! - every packet is on one sequence (`trusted_packet_sequence_id` 1); the first clears its
//!   incremental state, and event names, categories and argument names are interned
//!   (`InternedData`, sent once in the first packet that uses them, then referred to by a
//!   small id), so a repeated `decode` costs a one-byte varint. Packets that use interned
//!   ids say so (`sequence_flags` = SEQ_NEEDS_INCREMENTAL_STATE).
//!
//! No colours: the format has none for slices (the UI colours them by name, so `prefill`
//! and `decode` still differ).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::io::Write;

use anyhow::{Result, bail};

use super::pb::Encoder;
use super::sink::{Arg, Output, Sink, Slice};

/// Field numbers of Perfetto's trace protos (perfetto/trace/…/*.proto).
mod field {
    /// `Trace.packet`.
    pub const TRACE_PACKET: u32 = 1;

    // TracePacket
    pub const TIMESTAMP: u32 = 8;
    pub const TRUSTED_PACKET_SEQUENCE_ID: u32 = 10;
    pub const TRACK_EVENT: u32 = 11;
    pub const INTERNED_DATA: u32 = 12;
    pub const SEQUENCE_FLAGS: u32 = 13;
    pub const TRACK_DESCRIPTOR: u32 = 60;

    // TrackDescriptor
    pub const TD_UUID: u32 = 1;
    pub const TD_NAME: u32 = 2;
    pub const TD_PROCESS: u32 = 3;
    pub const TD_PARENT_UUID: u32 = 5;
    pub const TD_COUNTER: u32 = 8;
    pub const TD_CHILD_ORDERING: u32 = 11;
    pub const TD_SIBLING_ORDER_RANK: u32 = 12;
    pub const TD_SIBLING_MERGE_BEHAVIOR: u32 = 15;

    // ProcessDescriptor
    pub const PD_PID: u32 = 1;
    pub const PD_PROCESS_NAME: u32 = 6;

    // TrackEvent
    pub const TE_CATEGORY_IIDS: u32 = 3;
    pub const TE_DEBUG_ANNOTATIONS: u32 = 4;
    pub const TE_TYPE: u32 = 9;
    pub const TE_NAME_IID: u32 = 10;
    pub const TE_TRACK_UUID: u32 = 11;
    pub const TE_NAME: u32 = 23;
    pub const TE_COUNTER_VALUE: u32 = 30;
    pub const TE_DOUBLE_COUNTER_VALUE: u32 = 44;

    // DebugAnnotation
    pub const DA_NAME_IID: u32 = 1;
    pub const DA_BOOL_VALUE: u32 = 2;
    pub const DA_UINT_VALUE: u32 = 3;
    pub const DA_DOUBLE_VALUE: u32 = 5;
    pub const DA_STRING_VALUE: u32 = 6;
    pub const DA_NAME: u32 = 10;
    pub const DA_ARRAY_VALUES: u32 = 12;

    // InternedData
    pub const ID_EVENT_CATEGORIES: u32 = 1;
    pub const ID_EVENT_NAMES: u32 = 2;
    pub const ID_DEBUG_ANNOTATION_NAMES: u32 = 3;

    // EventName, EventCategory, DebugAnnotationName
    pub const INTERNED_IID: u32 = 1;
    pub const INTERNED_NAME: u32 = 2;
}

/// TracePacket.SequenceFlags.
const SEQ_INCREMENTAL_STATE_CLEARED: u64 = 1;
const SEQ_NEEDS_INCREMENTAL_STATE: u64 = 2;
/// TrackEvent.Type.
const TYPE_SLICE_BEGIN: u64 = 1;
const TYPE_SLICE_END: u64 = 2;
const TYPE_COUNTER: u64 = 4;
/// TrackDescriptor.ChildTracksOrdering.EXPLICIT.
const CHILD_ORDERING_EXPLICIT: u64 = 3;
/// TrackDescriptor.SiblingMergeBehavior.NONE.
const SIBLING_MERGE_NONE: u64 = 2;

const SEQUENCE: u64 = 1;

/// Distinct event names interned at most: past this, new names are written in full (step
/// names such as `prefill+decode B12 (+1r 345t)` vary without end; interning a name used
/// once costs more than writing it).
const MAX_INTERNED_NAMES: usize = 4096;

/// A multiply-rotate hash for the writer's own small keys (ids, a handful of names): every
/// slice looks up its track and three names, so the hash is on the writer's hot path, and
/// resistance to chosen keys (what SipHash, the std default, pays for) does not matter for
/// keys the program makes itself.
#[derive(Default, Clone, Copy)]
struct QuickHasher(u64);

impl QuickHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

impl Hasher for QuickHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(c);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        let mut word = [0u8; 8];
        word[..rest.len()].copy_from_slice(rest);
        self.add(u64::from_le_bytes(word) ^ ((rest.len() as u64) << 59));
    }

    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    fn finish(&self) -> u64 {
        // the table picks buckets by the low bits: fold the well-mixed high half in
        self.0 ^ (self.0 >> 32)
    }
}

type QuickMap<K, V> = HashMap<K, V, BuildHasherDefault<QuickHasher>>;

/// Packets are encoded one after the other into one buffer, written out once it holds
/// this much: no copy per packet into a second buffer, one large write instead.
const FLUSH_AT: usize = 1 << 17;

/// Strings → interned ids (from 1) of one kind.
#[derive(Default)]
struct Interner {
    ids: QuickMap<String, u64>,
    /// The last strings looked up, with their ids: a slice's name and category are nearly
    /// always one of a few (`decode`, `request`), and comparing a few short strings is
    /// cheaper than hashing one (the lookups were still 18 % of the run with the map alone).
    recent: [Option<(Box<str>, u64)>; RECENT],
    next_recent: usize,
}

/// Strings an [`Interner`] remembers outside its map.
const RECENT: usize = 4;

impl Interner {
    /// The id of `s`, and whether it is new (to be sent in this packet's InternedData).
    /// `None` when the table holds `cap` strings and `s` is not one of them.
    fn id(&mut self, s: &str, cap: usize) -> Option<(u64, bool)> {
        for (known, id) in self.recent.iter().flatten() {
            if **known == *s {
                return Some((*id, false));
            }
        }
        if let Some(&id) = self.ids.get(s) {
            self.remember(s, id);
            return Some((id, false));
        }
        if self.ids.len() >= cap {
            return None;
        }
        let id = self.ids.len() as u64 + 1;
        self.ids.insert(s.to_string(), id);
        self.remember(s, id);
        Some((id, true))
    }

    fn remember(&mut self, s: &str, id: u64) {
        self.recent[self.next_recent] = Some((s.into(), id));
        self.next_recent = (self.next_recent + 1) % RECENT;
    }
}

/// A few packets of varint fields numbered below 16 (one-byte keys) and messages under 128
/// bytes (one-byte lengths), written into a fixed room: [`ProtoSink::plain_slice`]'s two
/// packets take at most 2 × 4 one-byte headers, 9 one-byte keys and 9 ten-byte varints.
struct Small<'a> {
    b: &'a mut [u8; SMALL],
    n: usize,
}

/// The room of a [`Small`].
const SMALL: usize = 112;

impl Small<'_> {
    #[inline]
    fn byte(&mut self, v: u8) {
        self.b[self.n] = v;
        self.n += 1;
    }

    #[inline]
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.byte((v as u8) | 0x80);
            v >>= 7;
        }
        self.byte(v as u8);
    }

    /// A varint field (wire type 0).
    #[inline]
    fn uint(&mut self, field: u32, v: u64) {
        debug_assert!(field < 16);
        self.byte((field << 3) as u8);
        self.varint(v);
    }

    /// Start a message field (wire type 2); its length goes where this returns.
    #[inline]
    fn open(&mut self, field: u32) -> usize {
        debug_assert!(field < 16);
        self.byte(((field << 3) | 2) as u8);
        self.byte(0);
        self.n - 1
    }

    #[inline]
    fn close(&mut self, at: usize) {
        let len = self.n - at - 1;
        debug_assert!(len < 0x80);
        self.b[at] = len as u8;
    }
}

/// Interned entries a packet introduces: (InternedData field, iid, string).
type NewEntries<'a> = Vec<(u32, u64, &'a str)>;

/// Writes TracePackets as the events come.
pub struct ProtoSink {
    out: Output,
    /// Packets encoded and not yet written (each a whole `Trace.packet` field), and the
    /// one being built.
    packet: Encoder,
    /// Where the length of the packet being built goes.
    open: usize,
    /// Scratch: the interned ids of a slice's argument names.
    arg_ids: Vec<Option<u64>>,
    first: bool,
    names: Interner,
    categories: Interner,
    arg_names: Interner,
    processes: QuickMap<u32, u64>,
    threads: QuickMap<(u32, u64), u64>,
    /// The last thread track looked up: a request's slices come one after another on its
    /// row, so most lookups are the previous one's (the map lookup was 9 % of the run).
    last_thread: Option<((u32, u64), u64)>,
    /// Plain slices take [`plain_slice`](Self::plain_slice) (off in a test, to compare
    /// with the general path).
    fast: bool,
    counters: QuickMap<(u32, &'static str), u64>,
    next_uuid: u64,
}

/// ns on the trace's clock from µs; the format's timestamps are unsigned.
fn ns(us: i64) -> Result<u64> {
    match us.checked_mul(1000).and_then(|t| u64::try_from(t).ok()) {
        Some(t) => Ok(t),
        None => bail!(
            "a time of {us} µs cannot be written in Perfetto's protobuf format (its \
             timestamps are unsigned ns): use --format json"
        ),
    }
}

impl ProtoSink {
    pub fn new(out: Output) -> ProtoSink {
        ProtoSink {
            out,
            packet: Encoder::new(),
            open: 0,
            arg_ids: Vec::new(),
            first: true,
            names: Interner::default(),
            categories: Interner::default(),
            arg_names: Interner::default(),
            processes: QuickMap::default(),
            threads: QuickMap::default(),
            last_thread: None,
            fast: true,
            counters: QuickMap::default(),
            next_uuid: 1,
        }
    }

    fn uuid(&mut self) -> u64 {
        let u = self.next_uuid;
        self.next_uuid += 1;
        u
    }

    /// Start a packet (a `Trace.packet` field): every packet begins with this, and ends
    /// with [`emit`](Self::emit).
    fn start_packet(&mut self) {
        self.open = self.packet.begin_message(field::TRACE_PACKET);
    }

    /// The sequence fields every packet carries; the first packet clears the state.
    fn sequence(&mut self, needs_state: bool) {
        self.packet
            .uint(field::TRUSTED_PACKET_SEQUENCE_ID, SEQUENCE);
        let mut flags = 0;
        if std::mem::replace(&mut self.first, false) {
            flags |= SEQ_INCREMENTAL_STATE_CLEARED;
        }
        if needs_state {
            flags |= SEQ_NEEDS_INCREMENTAL_STATE;
        }
        if flags != 0 {
            self.packet.uint(field::SEQUENCE_FLAGS, flags);
        }
    }

    /// End the packet begun by [`start_packet`](Self::start_packet); write out the
    /// packets encoded so far once they fill the buffer.
    fn emit(&mut self) -> Result<()> {
        self.packet.end_message(self.open);
        if self.packet.len() >= FLUSH_AT {
            self.flush_packets()?;
        }
        Ok(())
    }

    /// After packets written whole with [`Encoder::raw`]: write out what fills the buffer.
    fn emit_written(&mut self) -> Result<()> {
        if self.packet.len() >= FLUSH_AT {
            self.flush_packets()?;
        }
        Ok(())
    }

    /// A slice without arguments whose name and category are interned already (every
    /// `decode` of a trace without token ids: nearly all of its events): its two packets,
    /// byte for byte what the general path writes, built on the stack and appended at
    /// once. The general path's per-field pushes and length back-patching were a third of
    /// the run.
    fn plain_slice(&mut self, begin: u64, end: u64, track: u64, name: u64, category: u64) {
        self.packet.write_in_place(|b: &mut [u8; SMALL]| {
            let mut p = Small { b, n: 0 };
            let packet = p.open(field::TRACE_PACKET);
            p.uint(field::TIMESTAMP, begin);
            p.uint(field::TRUSTED_PACKET_SEQUENCE_ID, SEQUENCE);
            p.uint(field::SEQUENCE_FLAGS, SEQ_NEEDS_INCREMENTAL_STATE);
            let event = p.open(field::TRACK_EVENT);
            p.uint(field::TE_TYPE, TYPE_SLICE_BEGIN);
            p.uint(field::TE_TRACK_UUID, track);
            p.uint(field::TE_NAME_IID, name);
            p.uint(field::TE_CATEGORY_IIDS, category);
            p.close(event);
            p.close(packet);
            let packet = p.open(field::TRACE_PACKET);
            p.uint(field::TIMESTAMP, end);
            p.uint(field::TRUSTED_PACKET_SEQUENCE_ID, SEQUENCE);
            let event = p.open(field::TRACK_EVENT);
            p.uint(field::TE_TYPE, TYPE_SLICE_END);
            p.uint(field::TE_TRACK_UUID, track);
            p.close(event);
            p.close(packet);
            p.n
        });
    }

    fn flush_packets(&mut self) -> Result<()> {
        self.out.write_all(self.packet.bytes())?;
        self.packet.clear();
        Ok(())
    }

    /// Bytes of the trace so far, written or still in the buffer.
    #[cfg(test)]
    fn bytes(&self) -> u64 {
        self.out.bytes() + self.packet.len() as u64
    }

    /// The process track of `pid` (described on first use, unnamed if never named).
    fn process_track(&mut self, pid: u32, name: Option<&str>) -> Result<u64> {
        if let Some(&u) = self.processes.get(&pid) {
            return Ok(u);
        }
        let pid_i32 = i32::try_from(pid)
            .map_err(|_| anyhow::anyhow!("process id {pid} does not fit Perfetto's int32 pid"))?;
        let uuid = self.uuid();
        self.processes.insert(pid, uuid);
        self.start_packet();
        self.sequence(false);
        self.packet.message(field::TRACK_DESCRIPTOR, |d| {
            d.uint(field::TD_UUID, uuid);
            d.message(field::TD_PROCESS, |p| {
                p.int(field::PD_PID, i64::from(pid_i32));
                if let Some(n) = name {
                    p.string(field::PD_PROCESS_NAME, n);
                }
            });
            d.uint(field::TD_CHILD_ORDERING, CHILD_ORDERING_EXPLICIT);
        });
        self.emit()?;
        Ok(uuid)
    }

    /// The track of thread `tid` of `pid` (described on first use).
    fn thread_track(&mut self, pid: u32, tid: u64, name: Option<&str>) -> Result<u64> {
        match self.last_thread {
            Some((key, u)) if key == (pid, tid) => return Ok(u),
            _ => {}
        }
        if let Some(&u) = self.threads.get(&(pid, tid)) {
            self.last_thread = Some(((pid, tid), u));
            return Ok(u);
        }
        let parent = self.process_track(pid, None)?;
        let uuid = self.uuid();
        self.threads.insert((pid, tid), uuid);
        let fallback;
        let name = match name {
            Some(n) => n,
            None => {
                fallback = format!("thread {tid}");
                &fallback
            }
        };
        // ranks are int32: rows past that keep their order among themselves less exactly
        let rank = i64::try_from(tid)
            .unwrap_or(i64::MAX)
            .min(i64::from(i32::MAX));
        self.start_packet();
        self.sequence(false);
        self.packet.message(field::TRACK_DESCRIPTOR, |d| {
            d.uint(field::TD_UUID, uuid);
            d.uint(field::TD_PARENT_UUID, parent);
            d.string(field::TD_NAME, name);
            d.int(field::TD_SIBLING_ORDER_RANK, rank);
            d.uint(field::TD_SIBLING_MERGE_BEHAVIOR, SIBLING_MERGE_NONE);
        });
        self.emit()?;
        Ok(uuid)
    }

    fn counter_track(&mut self, pid: u32, name: &'static str) -> Result<u64> {
        if let Some(&u) = self.counters.get(&(pid, name)) {
            return Ok(u);
        }
        let parent = self.process_track(pid, None)?;
        let uuid = self.uuid();
        self.counters.insert((pid, name), uuid);
        self.start_packet();
        self.sequence(false);
        self.packet.message(field::TRACK_DESCRIPTOR, |d| {
            d.uint(field::TD_UUID, uuid);
            d.uint(field::TD_PARENT_UUID, parent);
            d.string(field::TD_NAME, name);
            d.message(field::TD_COUNTER, |_| {});
        });
        self.emit()?;
        Ok(uuid)
    }
}

impl Sink for ProtoSink {
    fn process(&mut self, pid: u32, name: &str) -> Result<()> {
        if self.processes.contains_key(&pid) {
            bail!("process {pid} named twice");
        }
        self.process_track(pid, Some(name)).map(drop)
    }

    fn thread(&mut self, pid: u32, tid: u64, name: &str) -> Result<()> {
        if self.threads.contains_key(&(pid, tid)) {
            bail!("thread {tid} of process {pid} named twice");
        }
        self.thread_track(pid, tid, Some(name)).map(drop)
    }

    fn slice(&mut self, s: &Slice) -> Result<()> {
        let track = self.thread_track(s.pid, s.tid, None)?;
        let (begin, end) = (ns(s.ts)?, ns(s.ts + s.dur)?);
        let mut new: NewEntries = Vec::new();
        let name = self.names.id(s.name, MAX_INTERNED_NAMES);
        if let Some((id, true)) = name {
            new.push((field::ID_EVENT_NAMES, id, s.name));
        }
        // categories and argument names are a handful of constants: always interned
        let category = self.categories.id(s.category, usize::MAX);
        if let Some((id, true)) = category {
            new.push((field::ID_EVENT_CATEGORIES, id, s.category));
        }
        if let (true, Some((name, false)), Some((category, false))) = (
            s.args.is_empty() && !self.first && self.fast,
            name,
            category,
        ) {
            self.plain_slice(begin, end, track, name, category);
            return self.emit_written();
        }
        let mut arg_ids = std::mem::take(&mut self.arg_ids);
        arg_ids.clear();
        for (k, _) in s.args {
            let id = self.arg_names.id(k, usize::MAX);
            if let Some((id, true)) = id {
                new.push((field::ID_DEBUG_ANNOTATION_NAMES, id, k));
            }
            arg_ids.push(id.map(|(id, _)| id));
        }

        self.start_packet();
        self.packet.uint(field::TIMESTAMP, begin);
        self.sequence(true);
        if !new.is_empty() {
            self.packet.message(field::INTERNED_DATA, |d| {
                for &(f, id, text) in &new {
                    d.message(f, |e| {
                        e.uint(field::INTERNED_IID, id);
                        e.string(field::INTERNED_NAME, text);
                    });
                }
            });
        }
        self.packet.message(field::TRACK_EVENT, |e| {
            e.uint(field::TE_TYPE, TYPE_SLICE_BEGIN);
            e.uint(field::TE_TRACK_UUID, track);
            match name {
                Some((id, _)) => e.uint(field::TE_NAME_IID, id),
                None => e.string(field::TE_NAME, s.name),
            }
            if let Some((id, _)) = category {
                e.uint(field::TE_CATEGORY_IIDS, id);
            }
            for ((k, v), id) in s.args.iter().zip(&arg_ids) {
                e.message(field::TE_DEBUG_ANNOTATIONS, |a| {
                    match id {
                        Some(id) => a.uint(field::DA_NAME_IID, *id),
                        None => a.string(field::DA_NAME, k),
                    }
                    match *v {
                        Arg::Uint(n) => a.uint(field::DA_UINT_VALUE, n),
                        Arg::Float(x) => a.double(field::DA_DOUBLE_VALUE, x),
                        Arg::Bool(b) => a.bool(field::DA_BOOL_VALUE, b),
                        Arg::Str(t) => a.string(field::DA_STRING_VALUE, t),
                        Arg::Ids(ids) => {
                            for &id in ids {
                                a.message(field::DA_ARRAY_VALUES, |x| {
                                    x.uint(field::DA_UINT_VALUE, u64::from(id))
                                });
                            }
                        }
                    }
                });
            }
        });
        self.arg_ids = arg_ids;
        self.emit()?;

        self.start_packet();
        self.packet.uint(field::TIMESTAMP, end);
        self.sequence(false);
        self.packet.message(field::TRACK_EVENT, |e| {
            e.uint(field::TE_TYPE, TYPE_SLICE_END);
            e.uint(field::TE_TRACK_UUID, track);
        });
        self.emit()
    }

    fn counter(&mut self, pid: u32, name: &'static str, ts: i64, value: f64) -> Result<()> {
        let track = self.counter_track(pid, name)?;
        let ts = ns(ts)?;
        self.start_packet();
        self.packet.uint(field::TIMESTAMP, ts);
        self.sequence(false);
        self.packet.message(field::TRACK_EVENT, |e| {
            e.uint(field::TE_TYPE, TYPE_COUNTER);
            e.uint(field::TE_TRACK_UUID, track);
            // whole numbers (request counts) as varints; the rest as doubles
            if value.fract() == 0.0 && value.abs() < 9.0e15 {
                e.int(field::TE_COUNTER_VALUE, value as i64);
            } else {
                e.double(field::TE_DOUBLE_COUNTER_VALUE, value);
            }
        });
        self.emit()
    }

    fn finish(mut self: Box<Self>) -> Result<u64> {
        self.flush_packets()?;
        self.out.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;

    fn count(hay: &[u8], needle: &[u8]) -> usize {
        hay.windows(needle.len()).filter(|w| *w == needle).count()
    }

    /// A plain slice's packets are the general path's, byte for byte, for small and
    /// large timestamps and ids.
    #[test]
    fn plain_slices_are_written_as_the_general_path_writes_them() {
        let run = |fast: bool| {
            let path = std::env::temp_dir().join(format!(
                "vcr-proto-plain-{fast}-{}.pftrace",
                std::process::id()
            ));
            let file = File::create(&path).unwrap();
            let mut sink = Box::new(ProtoSink::new(Output::new(Some(file), false)));
            sink.fast = fast;
            sink.process(1, "model").unwrap();
            for (i, ts) in [0i64, 1, 127, 128, 4_000_000_000, i64::MAX / 1001]
                .into_iter()
                .enumerate()
            {
                let tid = [1, 200, 1 << 40][i % 3];
                for name in ["decode", "decode x2", "prefill"] {
                    sink.slice(&Slice {
                        pid: 1,
                        tid,
                        name,
                        category: "request",
                        colour: "",
                        ts,
                        dur: [0, 5, 1 << 20][i % 3],
                        args: &[],
                    })
                    .unwrap();
                }
            }
            sink.finish().unwrap();
            let bytes = std::fs::read(&path).unwrap();
            std::fs::remove_file(&path).ok();
            bytes
        };
        assert_eq!(run(true), run(false));
    }

    /// Names, categories and argument names go out once; every later use is an id.
    #[test]
    fn repeated_names_are_sent_once_then_referred_to() {
        let path = std::env::temp_dir().join(format!("vcr-proto-{}.pftrace", std::process::id()));
        let file = File::create(&path).unwrap();
        let mut sink = Box::new(ProtoSink::new(Output::new(Some(file), false)));
        sink.process(1, "model").unwrap();
        sink.thread(1, 1, "lane 0").unwrap();
        let slice = |ts: i64| Slice {
            pid: 1,
            tid: 1,
            name: "decode",
            category: "request",
            colour: "",
            ts,
            dur: 10,
            args: &[("token_ids", Arg::Ids(&[5, 6]))],
        };
        sink.slice(&slice(0)).unwrap();
        let after_one = sink.bytes();
        sink.slice(&slice(10)).unwrap();
        let second = sink.bytes() - after_one;
        sink.counter(1, "active_requests", 0, 1.0).unwrap();
        sink.counter(1, "active_requests", 10, 0.5).unwrap();
        let written = sink.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).ok();
        assert_eq!(written, bytes.len() as u64);
        for s in ["model", "decode", "token_ids", "active_requests", "lane 0"] {
            assert_eq!(count(&bytes, s.as_bytes()), 1, "{s}");
        }
        // the category, and inside the counter's name
        assert_eq!(count(&bytes, b"request"), 2);
        // the second slice, no string in it: a 31-byte begin (framing 2, timestamp 3,
        // sequence id 2, flags 2, track event 2 + type 2, track 2, name id 2, category
        // id 2, the argument 2 + its name id 2 and two 4-byte array values) and a 14-byte
        // end (framing 2, timestamp 4, sequence id 2, track event 2 + type 2, track 2)
        assert_eq!(second, 31 + 14, "{bytes:02x?}");
    }
}
