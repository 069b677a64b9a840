//! The messages that cross the engine-core wire, as Rust values.
//!
//! These are line-independent: decoding fills them from any supported line's arrays
//! (leniently), encoding lays them out for one line (`crate::codec`). Fields the simulator
//! does not interpret are kept as opaque [`rmpv::Value`]s so nothing is lost.

use rmpv::Value;

/// Request type byte of a frame on the input socket (`EngineCoreRequestType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RequestType {
    Add = 0x00,
    Abort = 0x01,
    StartDpWave = 0x02,
    Utility = 0x03,
}

impl RequestType {
    pub fn from_byte(b: u8) -> Option<Self> {
        match b {
            0x00 => Some(Self::Add),
            0x01 => Some(Self::Abort),
            0x02 => Some(Self::StartDpWave),
            0x03 => Some(Self::Utility),
            _ => None,
        }
    }
}

/// A decoded frontend → engine message.
#[derive(Debug, Clone, PartialEq)]
pub enum InputMessage {
    Add(Box<EngineCoreRequest>),
    /// Internal request ids to abort.
    Abort(Vec<String>),
    Utility(UtilityCall),
    StartDpWave {
        wave: i64,
        exclude_engine_index: Option<i64>,
    },
}

/// `EngineCoreRequest` (array_like). Only what an engine needs is typed; the rest is kept.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineCoreRequest {
    pub request_id: String,
    pub prompt_token_ids: Option<Vec<u32>>,
    /// `mm_features`, opaque.
    pub mm_features: Option<Value>,
    pub sampling_params: Option<SamplingParams>,
    /// `pooling_params`, opaque.
    pub pooling_params: Option<Value>,
    /// Frontend wall clock (epoch seconds).
    pub arrival_time: f64,
    pub lora_request: Option<LoRARequest>,
    pub cache_salt: Option<String>,
    pub data_parallel_rank: Option<i64>,
    pub prompt_embeds: Option<Tensor>,
    pub prompt_is_token_ids: Option<Vec<bool>>,
    pub client_index: u32,
    pub current_wave: i64,
    pub priority: i64,
    pub trace_headers: Option<Value>,
    pub resumable: bool,
    pub external_req_id: Option<String>,
    pub reasoning_ended: Option<bool>,
    pub reasoning_parser_kwargs: Option<Value>,
    pub abort_immediately: bool,
    pub session_id: Option<String>,
    pub kv_hints: Option<Value>,
    /// Number of elements of the array as received (the version guard compares it with the
    /// configured line's layout).
    pub wire_len: usize,
}

impl EngineCoreRequest {
    /// Prompt length as vLLM counts it: the token ids, else the embeddings' first dimension.
    pub fn prompt_len(&self) -> usize {
        if let Some(ids) = &self.prompt_token_ids {
            return ids.len();
        }
        self.prompt_embeds
            .as_ref()
            .and_then(|t| t.shape.first().copied())
            .unwrap_or(0) as usize
    }
}

/// `SamplingParams` (a map with defaults omitted). Missing keys take vLLM's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub n: u32,
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: i64,
    pub seed: Option<i64>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// `None` means "no limit" (the model length decides).
    pub max_tokens: Option<u32>,
    pub min_tokens: u32,
    pub logprobs: Option<i64>,
    pub prompt_logprobs: Option<i64>,
    /// `RequestOutputKind`: 0 cumulative, 1 delta, 2 final only.
    pub output_kind: u8,
    /// `_eos_token_id`; absent when the client asked for `ignore_eos`.
    pub eos_token_id: Option<u32>,
    /// `_all_stop_token_ids` (eos plus stop ids), used for `min_tokens` masking.
    pub all_stop_token_ids: Vec<u32>,
    /// `extra_args` (P/D puts `kv_transfer_params` here), opaque.
    pub extra_args: Option<Value>,
    /// `structured_outputs` (`StructuredOutputsParams`), as sent; [`StructuredOutputs::parse`]
    /// reads it.
    pub structured_outputs: Option<Value>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            max_tokens: Some(16),
            min_tokens: 0,
            logprobs: None,
            prompt_logprobs: None,
            output_kind: 0,
            eos_token_id: None,
            all_stop_token_ids: Vec::new(),
            extra_args: None,
            structured_outputs: None,
        }
    }
}

/// The constraint of a `StructuredOutputsParams`: exactly one kind is set (vLLM's
/// `__post_init__` refuses zero or several).
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// A JSON schema, as JSON text (the wire carries a string or a map).
    JsonSchema(String),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    Regex(String),
    Choice(Vec<String>),
    /// A grammar (Lark / EBNF text).
    Grammar(String),
    /// A structural tag (JSON text: triggers and tagged structures).
    StructuralTag(String),
}

impl Constraint {
    /// The name vLLM's `StructuredOutputOptions` gives this kind.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonSchema(_) => "json",
            Self::JsonObject => "json_object",
            Self::Regex(_) => "regex",
            Self::Choice(_) => "choice",
            Self::Grammar(_) => "grammar",
            Self::StructuralTag(_) => "structural_tag",
        }
    }
}

/// `StructuredOutputsParams` (a msgspec dataclass map; the same keys on every line 0.25–0.33).
#[derive(Debug, Clone, PartialEq)]
pub struct StructuredOutputs {
    pub constraint: Constraint,
    pub disable_any_whitespace: bool,
    pub disable_additional_properties: bool,
    pub whitespace_pattern: Option<String>,
    /// `_backend`, as the frontend chose it (`xgrammar`, `guidance`, …).
    pub backend: Option<String>,
}

/// A msgpack value as JSON text (binary as an array of bytes, non-string keys stringified).
pub fn value_to_json(v: &Value) -> String {
    let mut s = String::new();
    write_json(v, &mut s);
    s
}

fn write_json(v: &Value, s: &mut String) {
    use std::fmt::Write;
    match v {
        Value::Nil => s.push_str("null"),
        Value::Boolean(b) => s.push_str(if *b { "true" } else { "false" }),
        Value::Integer(i) => {
            let _ = write!(s, "{i}");
        }
        Value::F32(f) => write_float(f64::from(*f), s),
        Value::F64(f) => write_float(*f, s),
        Value::String(t) => write_json_str(t.as_str().unwrap_or_default(), s),
        Value::Binary(b) => write_json(
            &Value::Array(b.iter().map(|x| Value::from(*x)).collect()),
            s,
        ),
        Value::Array(a) => {
            s.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    s.push(',');
                }
                write_json(x, s);
            }
            s.push(']');
        }
        Value::Map(m) => {
            s.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    s.push(',');
                }
                match k.as_str() {
                    Some(k) => write_json_str(k, s),
                    None => write_json_str(&value_to_json(k), s),
                }
                s.push(':');
                write_json(x, s);
            }
            s.push('}');
        }
        Value::Ext(_, b) => write_json(&Value::Binary(b.clone()), s),
    }
}

fn write_float(f: f64, s: &mut String) {
    use std::fmt::Write;
    if f.is_finite() {
        let _ = write!(s, "{f:?}");
    } else {
        s.push_str("null");
    }
}

fn write_json_str(t: &str, s: &mut String) {
    use std::fmt::Write;
    s.push('"');
    for c in t.chars() {
        match c {
            '"' => s.push_str("\\\""),
            '\\' => s.push_str("\\\\"),
            '\n' => s.push_str("\\n"),
            '\r' => s.push_str("\\r"),
            '\t' => s.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(s, "\\u{:04x}", c as u32);
            }
            c => s.push(c),
        }
    }
    s.push('"');
}

/// `LoRARequest`: 6 (0.32+) or 7 (≤0.31, and what vllm-rs 0.32 sends) elements; only the
/// first three positions are stable, so only they are read.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LoRARequest {
    pub name: String,
    pub int_id: i64,
    pub path: String,
}

/// A numpy array / torch tensor triple `[dtype, shape, data]` with its data resolved (inline
/// ext 3, or an aux frame referenced by index).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Tensor {
    pub dtype: String,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

/// A utility call id, echoed back verbatim: Python sends full-range u64 values, vLLM
/// reserves negative ids for engine notifications.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CallId {
    Unsigned(u64),
    Negative(i64),
}

/// `[client_index, call_id, method_name, args]`.
#[derive(Debug, Clone, PartialEq)]
pub struct UtilityCall {
    pub client_index: u32,
    pub call_id: CallId,
    pub method: String,
    pub args: Vec<Value>,
}

/// `FinishReason` (IntEnum).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FinishReason {
    Stop = 0,
    Length = 1,
    Abort = 2,
    Error = 3,
    Repetition = 4,
}

impl FinishReason {
    /// The external API string (and Prometheus `finished_reason` label).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
            Self::Error => "error",
            Self::Repetition => "repetition",
        }
    }
}

/// `stop_reason`: the stop token id, or a string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    Token(i64),
    Text(String),
}

/// `EngineCoreEventType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum EventType {
    Queued = 1,
    Scheduled = 2,
    Preempted = 3,
}

/// `EngineCoreEvent`, a map `{type, timestamp}`; the timestamp is the engine's monotonic
/// clock, the same one as `EngineCoreOutputs::timestamp`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineCoreEvent {
    pub kind: EventType,
    pub timestamp: f64,
}

/// `PrefillStats` (dataclass → map with every key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefillStats {
    pub num_prompt_tokens: u64,
    pub num_computed_tokens: u64,
    pub num_cached_tokens: u64,
    pub num_local_cached_tokens: u64,
    pub num_external_cached_tokens: u64,
    /// 0.26+.
    pub num_cache_creation_tokens: u64,
}

/// `RequestError` (0.32+ dataclass; carried by `EngineCoreOutput.error` on 0.33).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestError {
    pub code: String,
    pub message: String,
    pub retryable: bool,
}

/// `RequestSpecDecodeMetrics` (0.29+), on a request's final output.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestSpecDecodeMetrics {
    pub num_spec_tokens: u64,
    pub histogram: Vec<u64>,
    pub num_draft_tokens: u64,
    pub per_step_accepted: Vec<u64>,
    pub per_step_drafted: Vec<u64>,
}

/// `LogprobsLists` NamedTuple: `[ids (n,k+1) int32, logprobs (n,k+1) float32, ranks (n,)
/// int64, cu_num_generated_tokens|nil]`; encoded as ndarray triples.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LogprobsLists {
    /// Row-major `rows × cols` token ids; column 0 is the sampled token.
    pub token_ids: Vec<i32>,
    pub logprobs: Vec<f32>,
    pub ranks: Vec<i64>,
    pub rows: usize,
    pub cols: usize,
    pub cu_num_generated_tokens: Option<Vec<i64>>,
}

/// A request id as outputs carry it: shared, so the engine's per-token output of a request
/// costs a reference count, not a copy of the string (an owned `String` per output was 9 %
/// of the engine's profile: allocated, copied and freed once per token).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct RequestId(std::sync::Arc<str>);

impl RequestId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for RequestId {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for RequestId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for RequestId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0, f)
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for RequestId {
    fn from(s: &str) -> Self {
        Self(s.into())
    }
}

impl From<String> for RequestId {
    fn from(s: String) -> Self {
        Self(s.into())
    }
}

impl From<&String> for RequestId {
    fn from(s: &String) -> Self {
        Self(s.as_str().into())
    }
}

impl From<RequestId> for String {
    fn from(id: RequestId) -> Self {
        id.0.to_string()
    }
}

impl PartialEq<str> for RequestId {
    fn eq(&self, other: &str) -> bool {
        *self.0 == *other
    }
}

impl PartialEq<&str> for RequestId {
    fn eq(&self, other: &&str) -> bool {
        *self.0 == **other
    }
}

impl PartialEq<String> for RequestId {
    fn eq(&self, other: &String) -> bool {
        *self.0 == **other
    }
}

/// The new tokens of one output: a step delivers one token per request (a few under
/// speculative decoding), so they are stored inline, with no allocation per output.
pub type TokenIds = smallvec::SmallVec<[u32; 4]>;

/// One request's output in one step (`EngineCoreOutput`). The fields a step rarely sets are
/// boxed: the engine builds, moves and drops one of these per token, and at 760 bytes the
/// moves showed in its profile.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineCoreOutput {
    pub request_id: RequestId,
    pub new_token_ids: TokenIds,
    pub new_logprobs: Option<Box<LogprobsLists>>,
    /// Opaque, passed through as given.
    pub new_prompt_logprobs_tensors: Option<Box<Value>>,
    pub pooling_output: Option<Box<Value>>,
    pub finish_reason: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
    pub events: Vec<EngineCoreEvent>,
    pub kv_transfer_params: Option<Box<Value>>,
    pub ec_transfer_params: Option<Box<Value>>,
    pub trace_headers: Option<Box<Value>>,
    pub prefill_stats: Option<Box<PrefillStats>>,
    /// `routed_experts` ndarray, opaque (passed through as given; the simulator never sets
    /// it, decoding fills it).
    pub routed_experts: Option<Box<Value>>,
    pub num_nans_in_logits: u32,
    pub mm_cache_miss_hashes: Option<Vec<String>>,
    /// `new_sampling_mask` (0.28+), opaque.
    pub new_sampling_mask: Option<Box<Value>>,
    pub spec_decode_metrics: Option<Box<RequestSpecDecodeMetrics>>,
    /// `prompt_token_id_logprobs` tensor (0.31+), opaque.
    pub prompt_token_id_logprobs: Option<Box<Value>>,
    pub error: Option<Box<RequestError>>,
}

impl EngineCoreOutput {
    /// An empty output of request `request_id`. `Default` would give it an empty id first
    /// (a shared one: a reference count taken and dropped, two atomic operations per
    /// output of the engine's hot loop, 3 % of a simulation).
    pub fn for_request(request_id: RequestId) -> Self {
        Self {
            request_id,
            new_token_ids: TokenIds::new(),
            new_logprobs: None,
            new_prompt_logprobs_tensors: None,
            pooling_output: None,
            finish_reason: None,
            stop_reason: None,
            events: Vec::new(),
            kv_transfer_params: None,
            ec_transfer_params: None,
            trace_headers: None,
            prefill_stats: None,
            routed_experts: None,
            num_nans_in_logits: 0,
            mm_cache_miss_hashes: None,
            new_sampling_mask: None,
            spec_decode_metrics: None,
            prompt_token_id_logprobs: None,
            error: None,
        }
    }
}

/// `PrefixCacheStats` deltas (counters are added by the frontend per message).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixCacheStats {
    pub reset: bool,
    pub requests: u64,
    pub queries: u64,
    pub hits: u64,
    pub preempted_requests: u64,
    pub preempted_queries: u64,
    pub preempted_hits: u64,
}

/// `SpecDecodingStats` deltas for one step.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SpecDecodingStats {
    pub num_spec_tokens: u64,
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
    pub num_accepted_tokens_per_pos: Vec<u64>,
    pub num_draft_tokens_per_pos: Vec<u64>,
}

/// `SchedulerStats`, sent at most once per step to one client. Encoded with every key of
/// the newest line (vllm-rs rejects maps missing some keys; older decoders ignore extras).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SchedulerStats {
    pub num_running_reqs: u64,
    pub num_waiting_reqs: u64,
    pub num_skipped_waiting_reqs: u64,
    pub step_counter: u64,
    pub current_wave: u64,
    /// Fraction 0..1, not a percentage.
    pub kv_cache_usage: f64,
    pub prefix_cache_stats: PrefixCacheStats,
    /// A KV connector's hits (`vllm:external_prefix_cache_*`); `None` without one.
    pub connector_prefix_cache_stats: Option<PrefixCacheStats>,
    /// A KV connector's own stats, as its `KVConnectorStats.data` (`vllm:kv_offload_*`).
    pub kv_connector_stats: Option<Value>,
    pub spec_decoding_stats: Option<SpecDecodingStats>,
    /// `{adapter name: request count}`.
    pub waiting_lora_adapters: Vec<(String, u64)>,
    pub running_lora_adapters: Vec<(String, u64)>,
}

/// `UtilityOutput`: `[call_id, failure_message, result]` where a success result is encoded
/// as `[nil, value]` (`UtilityResult`).
#[derive(Debug, Clone, PartialEq)]
pub struct UtilityOutput {
    pub call_id: CallId,
    pub outcome: Result<Value, String>,
}

/// One envelope on an output socket (`EngineCoreOutputs`). Never send one with nothing set,
/// and never mix request outputs with a utility reply (vllm-rs kills its dispatcher).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineCoreOutputs {
    pub engine_index: u32,
    pub outputs: Vec<EngineCoreOutput>,
    pub scheduler_stats: Option<Box<SchedulerStats>>,
    /// Engine monotonic clock, seconds.
    pub timestamp: f64,
    pub utility_output: Option<UtilityOutput>,
    pub finished_requests: Option<Vec<String>>,
    pub wave_complete: Option<i64>,
    pub start_wave: Option<i64>,
    pub weight_version: Option<String>,
}

/// The raw single frame an engine sends on a fatal error.
pub const ENGINE_CORE_DEAD: &[u8] = b"ENGINE_CORE_DEAD";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_for_a_request_is_an_empty_output_with_its_id() {
        let id = RequestId::from("replay-7");
        assert_eq!(
            EngineCoreOutput::for_request(id.clone()),
            EngineCoreOutput {
                request_id: id,
                ..Default::default()
            }
        );
    }
}
