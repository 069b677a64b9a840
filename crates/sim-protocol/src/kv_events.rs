//! KV-cache events, as vLLM's engine publishes them on its optional ZMQ PUB socket
//! (`vllm/distributed/kv_events.py`), and the `KVEventsConfig` map the ready response
//! advertises (`vllm/config/kv_events.py`).
//!
//! - [`KvEvent`]: `BlockStored` / `BlockRemoved` / `AllBlocksCleared`;
//! - [`encode_kv_event_batch`]: a `KVEventBatch` exactly as msgspec writes it for a line;
//! - [`decode_kv_event_batch`]: the reverse, lenient (for tests and the record tap);
//! - [`KvEventsConfig`]: the `--kv-events-config` dataclass, its defaults and its map.
//!
//! Wire facts (checked byte for byte against msgspec with vLLM 0.33.0's own classes in
//! `tests/kv_events.rs`):
//! - the batch is `array_like`: always 3 elements `[ts, events, data_parallel_rank]`, the
//!   rank nil when unset (msgspec does not trim `array_like` tails);
//! - each event is a *tagged map* (`"type": "<ClassName>"` first), keys in declaration
//!   order; required keys are always written (nil included), default-valued optional keys
//!   are omitted (`omit_defaults=True`);
//! - msgspec sizes a struct's map header for the most keys the class *could* have: a class
//!   with 16 or more (fields + tag) gets a map16 header (`de 00 nn`) even when fewer keys are
//!   written. `BlockStored` reaches 16 on 0.33 (15 fields), so its header differs by line;
//! - block hashes are msgpack uints (vLLM's default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`
//!   sends the low 64 bits of the hash).

use rmpv::Value;

use crate::decode::value::{self as v, R};
use crate::decode::{DecodeError, DecodeErrorKind};
use crate::encode::Writer;
use crate::line::VllmLine;

/// `MEDIUM_GPU`: the medium vLLM's GPU block pool reports.
pub const MEDIUM_GPU: &str = "GPU";

/// One KV-cache event. Field order is the wire order.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks newly cached (or, from 0.33, reused from the prefix cache).
    BlockStored {
        /// Low 64 bits of each block's hash, oldest block first.
        block_hashes: Vec<u64>,
        /// Hash of the block before the first one, `None` for a prompt's first block.
        parent_block_hash: Option<u64>,
        /// The tokens of all the blocks, concatenated.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The LoRA adapter's id (`LoRARequest.lora_int_id`), `None` without LoRA.
        lora_id: Option<i64>,
        /// The LoRA adapter's name, `None` without LoRA.
        lora_name: Option<String>,
        /// `"GPU"` for vLLM's block pool.
        medium: Option<String>,
        /// Optional (omitted when `None`). One entry per block: the untagged extra keys of
        /// that block's hash (the LoRA name, `[mm_identifier, offset]` pairs, the cache
        /// salt, prompt-embeds digests), or `None`. vLLM 0.33's block pool always sends a
        /// list, `[nil]` per block for a plain request.
        extra_keys: Option<Vec<Option<Vec<Value>>>>,
        /// Optional: the KV-cache group (0 with one group; vLLM 0.33 always sets it).
        group_idx: Option<u32>,
        /// Optional, 0.30+ only (not encoded on older lines): the request's session id.
        session_id: Option<String>,
    },
    /// Blocks evicted from the prefix cache.
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
        /// Optional: the KV-cache group (vLLM 0.33 always sets it).
        group_idx: Option<u32>,
    },
    /// The whole prefix cache was reset (`reset_prefix_cache`).
    AllBlocksCleared,
}

impl KvEvent {
    /// A `BlockStored` shaped as vLLM 0.33's block pool emits it for a request without
    /// LoRA, multimodal inputs or cache salt: medium `GPU`, group 0, one nil extra key per
    /// block.
    pub fn block_stored(
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
    ) -> Self {
        let n = block_hashes.len();
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: None,
            lora_name: None,
            medium: Some(MEDIUM_GPU.to_string()),
            extra_keys: Some(vec![None; n]),
            group_idx: Some(0),
            session_id: None,
        }
    }

    /// A `BlockRemoved` shaped as vLLM 0.33's block pool emits it: medium `GPU`, group 0.
    pub fn block_removed(block_hashes: Vec<u64>) -> Self {
        KvEvent::BlockRemoved {
            block_hashes,
            medium: Some(MEDIUM_GPU.to_string()),
            group_idx: Some(0),
        }
    }

    /// The class name, which is also the msgspec tag.
    pub fn type_name(&self) -> &'static str {
        match self {
            KvEvent::BlockStored { .. } => "BlockStored",
            KvEvent::BlockRemoved { .. } => "BlockRemoved",
            KvEvent::AllBlocksCleared => "AllBlocksCleared",
        }
    }
}

const fn at_least(line: VllmLine, minor: u16) -> bool {
    line.major > 0 || line.minor >= minor
}

/// Number of fields of vLLM's `BlockStored` class on a line (`fields-*.txt`): 11 on 0.25,
/// +`locality` 0.26, +`ownership` 0.29, +`session_id` 0.30, +`lookahead_token_ids` 0.33.
fn block_stored_class_fields(line: VllmLine) -> usize {
    if at_least(line, 33) {
        15
    } else if at_least(line, 30) {
        14
    } else if at_least(line, 29) {
        13
    } else if at_least(line, 26) {
        12
    } else {
        11
    }
}

/// Number of fields of vLLM's `BlockRemoved` class on a line: 3 on 0.25, +`locality` 0.26,
/// +`ownership` 0.29.
fn block_removed_class_fields(line: VllmLine) -> usize {
    if at_least(line, 29) {
        5
    } else if at_least(line, 26) {
        4
    } else {
        3
    }
}

/// A struct map header as msgspec writes it: sized for `max_keys` (the class's fields plus
/// the tag), holding `n` keys.
fn struct_map_header(w: &mut Writer, n: usize, max_keys: usize) {
    if max_keys < 16 {
        w.map(n);
    } else {
        w.buf.push(0xde);
        w.buf.extend_from_slice(&(n as u16).to_be_bytes());
    }
}

fn write_hashes(w: &mut Writer, hashes: &[u64]) {
    w.uint_list(hashes.iter().copied());
}

fn write_opt_uint(w: &mut Writer, x: Option<u64>) {
    match x {
        Some(x) => w.uint(x),
        None => w.nil(),
    }
}

fn write_event(w: &mut Writer, line: VllmLine, event: &KvEvent) {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            lora_name,
            medium,
            extra_keys,
            group_idx,
            session_id,
        } => {
            let session_id = session_id.as_deref().filter(|_| at_least(line, 30));
            let n = 8
                + usize::from(extra_keys.is_some())
                + usize::from(group_idx.is_some())
                + usize::from(session_id.is_some());
            struct_map_header(w, n, block_stored_class_fields(line) + 1);
            w.str("type");
            w.str("BlockStored");
            w.str("block_hashes");
            write_hashes(w, block_hashes);
            w.str("parent_block_hash");
            write_opt_uint(w, *parent_block_hash);
            w.str("token_ids");
            w.uint_list(token_ids.iter().map(|&t| u64::from(t)));
            w.str("block_size");
            w.uint(u64::from(*block_size));
            w.str("lora_id");
            match lora_id {
                Some(id) => w.int(*id),
                None => w.nil(),
            }
            w.str("medium");
            w.opt_str(medium.as_deref());
            w.str("lora_name");
            w.opt_str(lora_name.as_deref());
            if let Some(keys) = extra_keys {
                w.str("extra_keys");
                w.array(keys.len());
                for k in keys {
                    match k {
                        Some(items) => {
                            w.array(items.len());
                            for item in items {
                                w.value(item);
                            }
                        }
                        None => w.nil(),
                    }
                }
            }
            if let Some(g) = group_idx {
                w.str("group_idx");
                w.uint(u64::from(*g));
            }
            if let Some(s) = session_id {
                w.str("session_id");
                w.str(s);
            }
        }
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
            group_idx,
        } => {
            let n = 3 + usize::from(group_idx.is_some());
            struct_map_header(w, n, block_removed_class_fields(line) + 1);
            w.str("type");
            w.str("BlockRemoved");
            w.str("block_hashes");
            write_hashes(w, block_hashes);
            w.str("medium");
            w.opt_str(medium.as_deref());
            if let Some(g) = group_idx {
                w.str("group_idx");
                w.uint(u64::from(*g));
            }
        }
        KvEvent::AllBlocksCleared => {
            w.map(1);
            w.str("type");
            w.str("AllBlocksCleared");
        }
    }
}

/// A `KVEventBatch` `[ts, [events…], data_parallel_rank]` as msgspec encodes it with the
/// classes of `line`. Fields the line's classes lack (`session_id` before 0.30) are not
/// written. The rank is nil when `None` (vLLM's publisher always fills it in).
pub fn encode_kv_event_batch(
    line: VllmLine,
    ts: f64,
    events: &[KvEvent],
    data_parallel_rank: Option<i64>,
) -> Vec<u8> {
    let mut w = Writer::new(64 + 96 * events.len(), usize::MAX);
    w.array(3);
    w.f64(ts);
    w.array(events.len());
    for e in events {
        write_event(&mut w, line, e);
    }
    match data_parallel_rank {
        Some(r) => w.int(r),
        None => w.nil(),
    }
    w.buf
}

/// A block hash as a consumer reads it: a uint, or (with
/// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) the raw hash bytes, of which the low 64 bits
/// are kept (`int.from_bytes(b, "big") & (2**64 - 1)`).
fn hash(x: &Value, field: &str) -> R<u64> {
    match x {
        Value::Binary(b) => {
            let tail = &b[b.len().saturating_sub(8)..];
            Ok(tail
                .iter()
                .fold(0u64, |acc, &byte| (acc << 8) | u64::from(byte)))
        }
        _ => v::u64_(x, field),
    }
}

fn hashes(x: &Value, field: &str) -> R<Vec<u64>> {
    v::array(x, field)?.iter().map(|h| hash(h, field)).collect()
}

fn opt_hash(x: &Value, field: &str) -> R<Option<u64>> {
    if v::is_nil(x) {
        Ok(None)
    } else {
        hash(x, field).map(Some)
    }
}

fn extra_keys(x: &Value, field: &str) -> R<Option<Vec<Option<Vec<Value>>>>> {
    if v::is_nil(x) {
        return Ok(None);
    }
    let entries = v::array(x, field)?;
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        out.push(if v::is_nil(e) {
            None
        } else {
            Some(v::array(e, field)?.to_vec())
        });
    }
    Ok(Some(out))
}

fn missing(field: &str) -> DecodeErrorKind {
    DecodeErrorKind::MissingKey {
        field: field.to_string(),
    }
}

fn decode_event(x: &Value, idx: usize) -> R<KvEvent> {
    let what = format!("events[{idx}]");
    let m = v::map(x, &what)?;
    let get = |key: &str| v::str_entries(m).find(|(k, _)| *k == key).map(|(_, x)| x);
    let f = |key: &str| format!("{what}.{key}");
    let req = |key: &str| get(key).ok_or_else(|| missing(&f(key)));
    let opt = |key: &str| get(key).filter(|x| !v::is_nil(x));
    let ty = v::str_ref(req("type")?, &f("type"))?;
    match ty {
        "BlockStored" => Ok(KvEvent::BlockStored {
            block_hashes: hashes(req("block_hashes")?, &f("block_hashes"))?,
            parent_block_hash: opt_hash(req("parent_block_hash")?, &f("parent_block_hash"))?,
            token_ids: v::u32_list(req("token_ids")?, &f("token_ids"))?,
            block_size: v::u32_(req("block_size")?, &f("block_size"))?,
            lora_id: v::opt_i64(req("lora_id")?, &f("lora_id"))?,
            lora_name: v::opt_string(req("lora_name")?, &f("lora_name"))?,
            medium: v::opt_string(req("medium")?, &f("medium"))?,
            extra_keys: match get("extra_keys") {
                Some(x) => extra_keys(x, &f("extra_keys"))?,
                None => None,
            },
            group_idx: opt("group_idx")
                .map(|x| v::u32_(x, &f("group_idx")))
                .transpose()?,
            session_id: opt("session_id")
                .map(|x| v::string(x, &f("session_id")))
                .transpose()?,
        }),
        "BlockRemoved" => Ok(KvEvent::BlockRemoved {
            block_hashes: hashes(req("block_hashes")?, &f("block_hashes"))?,
            medium: v::opt_string(req("medium")?, &f("medium"))?,
            group_idx: opt("group_idx")
                .map(|x| v::u32_(x, &f("group_idx")))
                .transpose()?,
        }),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Err(DecodeErrorKind::InvalidValue {
            field: f("type"),
            reason: format!(
                "unknown KV event type `{other}` (expected BlockStored, BlockRemoved or AllBlocksCleared)"
            ),
        }),
    }
}

/// Decode a `KVEventBatch` payload into `(ts, events, data_parallel_rank)`. Lenient like
/// msgspec: an integer `ts` is accepted, a 2-element batch has no rank, extra batch
/// elements and unknown event keys (`locality`, `ownership`, …) are ignored; a missing
/// required key or an unknown event type is an error.
pub fn decode_kv_event_batch(
    payload: &[u8],
) -> Result<(f64, Vec<KvEvent>, Option<i64>), DecodeError> {
    decode_batch_inner(payload).map_err(DecodeError::bare)
}

fn decode_batch_inner(payload: &[u8]) -> R<(f64, Vec<KvEvent>, Option<i64>)> {
    let value = v::read_whole(payload)?;
    let a = v::array(&value, "KVEventBatch")?;
    if a.len() < 2 {
        return Err(DecodeErrorKind::MissingElement {
            what: "KVEventBatch",
            index: a.len(),
            field: if a.is_empty() { "ts" } else { "events" },
            len: a.len(),
        });
    }
    let ts = v::f64_(&a[0], "KVEventBatch.ts")?;
    let events = v::array(&a[1], "KVEventBatch.events")?
        .iter()
        .enumerate()
        .map(|(i, e)| decode_event(e, i))
        .collect::<R<Vec<_>>>()?;
    let rank = match a.get(2) {
        Some(x) => v::opt_i64(x, "KVEventBatch.data_parallel_rank")?,
        None => None,
    };
    Ok((ts, events, rank))
}

/// vLLM's `KVEventsConfig` (`--kv-events-config`), with `publisher` already resolved the
/// way its `__post_init__` does (`"zmq"` when events are enabled, else `"null"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    pub enable_kv_cache_events: bool,
    /// `"zmq"` or `"null"`.
    pub publisher: String,
    /// PUB endpoint; binds when it contains `*` or `::` or is `ipc://`, else connects.
    pub endpoint: String,
    /// Bound ROUTER endpoint answering replay requests.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: u64,
    /// PUB high-water mark.
    pub hwm: u64,
    /// Batches queued before publishing.
    pub max_queue_size: u64,
    /// First frame of every published message.
    pub topic: String,
}

/// The keys of the config map, in dataclass order.
pub const KV_EVENTS_CONFIG_KEYS: [&str; 8] = [
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
];

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            enable_kv_cache_events: false,
            publisher: "null".to_string(),
            endpoint: "tcp://*:5557".to_string(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

impl KvEventsConfig {
    /// The publisher vLLM resolves when `publisher` is unset.
    pub fn default_publisher(enable_kv_cache_events: bool) -> &'static str {
        if enable_kv_cache_events {
            "zmq"
        } else {
            "null"
        }
    }

    /// Whether vLLM would create a real publisher (`EventPublisherFactory.create`):
    /// events enabled and the publisher not `"null"`.
    pub fn is_active(&self) -> bool {
        self.enable_kv_cache_events && self.publisher != "null"
    }

    /// The map as the ready response carries it: all 8 keys in dataclass order (`vllm-rs`
    /// requires all 8), as msgspec encodes the dataclass.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new(192, usize::MAX);
        w.map(8);
        w.str("enable_kv_cache_events");
        w.bool(self.enable_kv_cache_events);
        w.str("publisher");
        w.str(&self.publisher);
        w.str("endpoint");
        w.str(&self.endpoint);
        w.str("replay_endpoint");
        w.opt_str(self.replay_endpoint.as_deref());
        w.str("buffer_steps");
        w.uint(self.buffer_steps);
        w.str("hwm");
        w.uint(self.hwm);
        w.str("max_queue_size");
        w.uint(self.max_queue_size);
        w.str("topic");
        w.str(&self.topic);
        w.buf
    }

    /// The same map as an [`rmpv::Value`], for `ReadyResponse::kv_events_config`.
    pub fn to_value(&self) -> Value {
        let s = |x: &str| Value::from(x);
        Value::Map(vec![
            (
                s("enable_kv_cache_events"),
                Value::from(self.enable_kv_cache_events),
            ),
            (s("publisher"), s(&self.publisher)),
            (s("endpoint"), s(&self.endpoint)),
            (
                s("replay_endpoint"),
                self.replay_endpoint.as_deref().map_or(Value::Nil, s),
            ),
            (s("buffer_steps"), Value::from(self.buffer_steps)),
            (s("hwm"), Value::from(self.hwm)),
            (s("max_queue_size"), Value::from(self.max_queue_size)),
            (s("topic"), s(&self.topic)),
        ])
    }

    /// Lenient decode of the map: missing keys take vLLM's defaults, unknown keys are
    /// ignored, a nil or missing `publisher` is resolved from `enable_kv_cache_events`.
    pub fn decode(payload: &[u8]) -> Result<Self, DecodeError> {
        v::read_whole(payload)
            .and_then(|x| Self::from_value_inner(&x))
            .map_err(DecodeError::bare)
    }

    /// [`decode`](Self::decode) from an already-read value (e.g. the ready response's
    /// `kv_events_config`).
    pub fn from_value(value: &Value) -> Result<Self, DecodeError> {
        Self::from_value_inner(value).map_err(DecodeError::bare)
    }

    fn from_value_inner(value: &Value) -> R<Self> {
        let m = v::map(value, "kv_events_config")?;
        let mut c = KvEventsConfig::default();
        let mut publisher = None;
        for (k, x) in v::str_entries(m) {
            let f = format!("kv_events_config.{k}");
            let f = f.as_str();
            match k {
                "enable_kv_cache_events" => c.enable_kv_cache_events = v::bool_(x, f)?,
                "publisher" => publisher = v::opt_string(x, f)?,
                "endpoint" => c.endpoint = v::string(x, f)?,
                "replay_endpoint" => c.replay_endpoint = v::opt_string(x, f)?,
                "buffer_steps" => c.buffer_steps = v::u64_(x, f)?,
                "hwm" => c.hwm = v::u64_(x, f)?,
                "max_queue_size" => c.max_queue_size = v::u64_(x, f)?,
                "topic" => c.topic = v::string(x, f)?,
                _ => {}
            }
        }
        c.publisher = publisher
            .unwrap_or_else(|| Self::default_publisher(c.enable_kv_cache_events).to_string());
        Ok(c)
    }
}
