//! Frontend → engine messages: `[type_byte, payload, aux…]`.

use bytes::Bytes;
use rmpv::Value;

use super::value::{self as v, R};
use super::{DecodeError, DecodeErrorKind, ErrorContext};
use crate::types::{
    CallId, EngineCoreRequest, InputMessage, LoRARequest, RequestType, SamplingParams, UtilityCall,
};

/// Field names of `EngineCoreRequest` by position (0.33, the longest layout).
const REQUEST_FIELDS: [&str; 22] = [
    "request_id",
    "prompt_token_ids",
    "mm_features",
    "sampling_params",
    "pooling_params",
    "arrival_time",
    "lora_request",
    "cache_salt",
    "data_parallel_rank",
    "prompt_embeds",
    "prompt_is_token_ids",
    "client_index",
    "current_wave",
    "priority",
    "trace_headers",
    "resumable",
    "external_req_id",
    "reasoning_ended",
    "reasoning_parser_kwargs",
    "abort_immediately",
    "session_id",
    "kv_hints",
];

/// Elements 0–8 have no default in any line.
const REQUEST_REQUIRED: usize = 9;

/// Decode one message as the engine's input DEALER receives it:
/// `[type_byte, msgpack_payload, aux…]`. Tensor data given as a frame index `k` refers to
/// `frames[k + 1]` (index 1 is the first aux frame, as in vLLM, where the type frame is not
/// counted).
pub fn decode_input(frames: &[Bytes]) -> Result<InputMessage, DecodeError> {
    decode_input_with(frames, &DecodeLimits::default())
}

/// What an engine takes from a frontend before it decodes further.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Prompts with more token ids are refused before the ids are read (the engine's
    /// maximum model length: it could never serve them).
    pub max_prompt_tokens: usize,
    /// Payload frames (the msgpack, not the tensor aux frames) larger than this are
    /// refused undecoded.
    pub max_frame_bytes: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits {
            max_prompt_tokens: usize::MAX,
            max_frame_bytes: usize::MAX,
        }
    }
}

/// [`decode_input`] under `limits`.
pub fn decode_input_with(
    frames: &[Bytes],
    limits: &DecodeLimits,
) -> Result<InputMessage, DecodeError> {
    let Some(type_frame) = frames.first() else {
        return Err(DecodeError::bare(DecodeErrorKind::EmptyMessage));
    };
    if type_frame.len() != 1 {
        return Err(DecodeError::bare(DecodeErrorKind::BadTypeFrame(
            type_frame.len(),
        )));
    }
    let Some(rt) = RequestType::from_byte(type_frame[0]) else {
        return Err(DecodeError::bare(DecodeErrorKind::UnknownRequestType(
            type_frame[0],
        )));
    };
    let mut ctx = ErrorContext {
        request_type: Some(rt),
        ..Default::default()
    };
    let Some(payload) = frames.get(1) else {
        return Err(DecodeError::new(DecodeErrorKind::MissingPayload, ctx));
    };
    let aux = &frames[2..];
    if payload.len() > limits.max_frame_bytes {
        // say which request, if its id can be read from the head of the frame
        if rt == RequestType::Add {
            let mut cur = &payload[..];
            if rmp::decode::read_array_len(&mut cur).is_ok()
                && let Ok(Value::String(s)) = rmpv::decode::read_value(&mut cur)
            {
                ctx.request_id = s.as_str().map(str::to_string);
            }
        }
        return Err(DecodeError::new(
            DecodeErrorKind::InvalidValue {
                field: "payload".into(),
                reason: format!(
                    "a {} MiB frame is larger than this engine takes ({} MiB, --max-frame-size)",
                    payload.len() >> 20,
                    limits.max_frame_bytes >> 20
                ),
            },
            ctx,
        ));
    }
    let result = match rt {
        RequestType::Add => decode_add(payload, aux, &mut ctx, limits.max_prompt_tokens)
            .map(|r| InputMessage::Add(Box::new(r))),
        RequestType::Abort => decode_abort(payload).map(InputMessage::Abort),
        RequestType::Utility => decode_utility(payload, &mut ctx).map(InputMessage::Utility),
        RequestType::StartDpWave => decode_start_wave(payload),
    };
    result.map_err(|kind| DecodeError::new(kind, ctx))
}

fn decode_add(
    payload: &[u8],
    aux: &[Bytes],
    ctx: &mut ErrorContext,
    max_prompt_tokens: usize,
) -> R<EngineCoreRequest> {
    let field = v::TokenField {
        index: 1,
        max: max_prompt_tokens,
        name: "prompt_token_ids",
    };
    let (mut items, flat, err) = v::read_top_array_with(payload, "EngineCoreRequest", Some(&field));
    // Context first, so that every later failure carries it.
    if let Some(Value::String(s)) = items.first() {
        ctx.request_id = s.as_str().map(str::to_string);
    }
    if let Some(Value::Integer(i)) = items.get(11) {
        ctx.client_index = i.as_u64().and_then(|n| u32::try_from(n).ok());
    }
    if let Some(e) = err {
        return Err(e);
    }
    let len = items.len();
    if len < REQUEST_REQUIRED {
        return Err(DecodeErrorKind::MissingElement {
            what: "EngineCoreRequest",
            index: len,
            field: REQUEST_FIELDS[len],
            len,
        });
    }
    items.truncate(REQUEST_FIELDS.len());
    items.resize(REQUEST_FIELDS.len(), Value::Nil);
    let mut take = |i: usize| std::mem::replace(&mut items[i], Value::Nil);
    let f = |i: usize| REQUEST_FIELDS[i];

    let request_id = v::string(&take(0), f(0))?;
    let prompt = take(1);
    let prompt_token_ids = match flat {
        Some(ids) => Some(ids),
        None if v::is_nil(&prompt) => None,
        None => Some(v::u32_list(&prompt, f(1))?),
    };
    let mm_features = v::opaque(take(2));
    let sp = take(3);
    let sampling_params = if v::is_nil(&sp) {
        None
    } else {
        Some(decode_sampling_params(&sp)?)
    };
    let pooling_params = v::opaque(take(4));
    let arrival_time = v::f64_(&take(5), f(5))?;
    let lora = take(6);
    let lora_request = if v::is_nil(&lora) {
        None
    } else {
        Some(decode_lora(&lora, f(6))?)
    };
    let cache_salt = v::opt_string(&take(7), f(7))?;
    let data_parallel_rank = v::opt_i64(&take(8), f(8))?;
    let embeds = take(9);
    let prompt_embeds = if v::is_nil(&embeds) {
        None
    } else {
        Some(v::tensor(&embeds, aux, f(9))?)
    };
    let mask = take(10);
    let prompt_is_token_ids = if v::is_nil(&mask) {
        None
    } else {
        let a = v::array(&mask, f(10))?;
        Some(
            a.iter()
                .map(|x| v::bool_(x, f(10)))
                .collect::<R<Vec<_>>>()?,
        )
    };
    let client_index = or_default(take(11), |x| v::u32_(&x, f(11)))?;
    let current_wave = or_default(take(12), |x| v::i64_(&x, f(12)))?;
    let priority = or_default(take(13), |x| v::i64_(&x, f(13)))?;
    let trace_headers = v::opaque(take(14));
    let resumable = or_default(take(15), |x| v::bool_(&x, f(15)))?;
    let external_req_id = v::opt_string(&take(16), f(16))?;
    let reasoning_ended = v::opt_bool(&take(17), f(17))?;
    let reasoning_parser_kwargs = v::opaque(take(18));
    let abort_immediately = or_default(take(19), |x| v::bool_(&x, f(19)))?;
    let session_id = v::opt_string(&take(20), f(20))?;
    let kv_hints = v::opaque(take(21));

    Ok(EngineCoreRequest {
        request_id,
        prompt_token_ids,
        mm_features,
        sampling_params,
        pooling_params,
        arrival_time,
        lora_request,
        cache_salt,
        data_parallel_rank,
        prompt_embeds,
        prompt_is_token_ids,
        client_index,
        current_wave,
        priority,
        trace_headers,
        resumable,
        external_req_id,
        reasoning_ended,
        reasoning_parser_kwargs,
        abort_immediately,
        session_id,
        kv_hints,
        wire_len: len,
    })
}

/// A defaulted non-optional element: absent (padded with nil) or nil → default. msgspec
/// would reject an explicit nil here; accepting it is harmless and keeps a sloppy client up.
fn or_default<T: Default>(x: Value, f: impl FnOnce(Value) -> R<T>) -> R<T> {
    if v::is_nil(&x) {
        Ok(T::default())
    } else {
        f(x)
    }
}

/// `SamplingParams`: a map with defaults omitted; unknown keys ignored.
pub(crate) fn decode_sampling_params(value: &Value) -> R<SamplingParams> {
    let m = v::map(value, "sampling_params")?;
    let mut sp = SamplingParams::default();
    for (key, x) in v::str_entries(m) {
        let field = |k: &str| format!("sampling_params.{k}");
        match key {
            "n" => sp.n = v::u32_(x, &field(key))?,
            "temperature" => sp.temperature = v::f64_(x, &field(key))?,
            "top_p" => sp.top_p = v::f64_(x, &field(key))?,
            "top_k" => sp.top_k = v::i64_(x, &field(key))?,
            "seed" => sp.seed = v::opt_i64(x, &field(key))?,
            "stop_token_ids" => {
                sp.stop_token_ids = if v::is_nil(x) {
                    Vec::new()
                } else {
                    v::u32_list(x, &field(key))?
                }
            }
            "ignore_eos" => sp.ignore_eos = v::bool_(x, &field(key))?,
            "max_tokens" => sp.max_tokens = v::opt_u32(x, &field(key))?,
            "min_tokens" => sp.min_tokens = v::u32_(x, &field(key))?,
            "logprobs" => sp.logprobs = v::opt_i64(x, &field(key))?,
            "prompt_logprobs" => sp.prompt_logprobs = v::opt_i64(x, &field(key))?,
            "output_kind" => {
                let k = v::u64_(x, &field(key))?;
                sp.output_kind = u8::try_from(k).ok().filter(|k| *k <= 2).ok_or_else(|| {
                    DecodeErrorKind::InvalidValue {
                        field: field(key),
                        reason: format!("{k} is not a RequestOutputKind (0, 1 or 2)"),
                    }
                })?;
            }
            "_eos_token_id" => sp.eos_token_id = v::opt_u32(x, &field(key))?,
            "_all_stop_token_ids" => {
                sp.all_stop_token_ids = if v::is_nil(x) {
                    Vec::new()
                } else {
                    v::u32_list(x, &field(key))?
                }
            }
            "extra_args" => sp.extra_args = v::opaque(x.clone()),
            "structured_outputs" => sp.structured_outputs = v::opaque(x.clone()),
            _ => {}
        }
    }
    Ok(sp)
}

/// `LoRARequest`: 6 (0.32+) or 7 (≤0.31) elements; positions 0–2 are stable.
pub(crate) fn decode_lora(value: &Value, field: &str) -> R<LoRARequest> {
    let a = v::array(value, field)?;
    if a.len() < 2 {
        return Err(DecodeErrorKind::Shape {
            what: field.to_string(),
            expected: "a LoRARequest array of at least 2 elements",
            found: format!("{} elements", a.len()),
        });
    }
    let name = v::string(&a[0], &format!("{field}.lora_name"))?;
    let int_id = v::i64_(&a[1], &format!("{field}.lora_int_id"))?;
    let path = match a.get(2) {
        None | Some(Value::Nil) => String::new(),
        Some(p) => v::string(p, &format!("{field}.lora_path"))?,
    };
    Ok(LoRARequest { name, int_id, path })
}

fn decode_abort(payload: &[u8]) -> R<Vec<String>> {
    let value = v::read_whole(payload)?;
    let a = v::array(&value, "ABORT payload")?;
    a.iter().map(|x| v::string(x, "ABORT request id")).collect()
}

/// `[client_index, call_id, method, args]`; `args` may be missing (no arguments).
fn decode_utility(payload: &[u8], ctx: &mut ErrorContext) -> R<UtilityCall> {
    let (items, err) = v::read_top_array(payload, "UTILITY payload");
    if let Some(Value::Integer(i)) = items.first() {
        ctx.client_index = i.as_u64().and_then(|n| u32::try_from(n).ok());
    }
    if let Some(x) = items.get(1) {
        ctx.call_id = call_id(x, "call_id").ok();
    }
    if let Some(Value::String(s)) = items.get(2) {
        ctx.method = s.as_str().map(str::to_string);
    }
    if let Some(e) = err {
        return Err(e);
    }
    const NAMES: [&str; 3] = ["client_index", "call_id", "method_name"];
    if items.len() < 3 {
        return Err(DecodeErrorKind::MissingElement {
            what: "UTILITY payload",
            index: items.len(),
            field: NAMES[items.len()],
            len: items.len(),
        });
    }
    let client_index = v::u32_(&items[0], "client_index")?;
    let call_id = call_id(&items[1], "call_id")?;
    let method = v::string(&items[2], "method_name")?;
    let args = match items.into_iter().nth(3) {
        None | Some(Value::Nil) => Vec::new(),
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(DecodeErrorKind::WrongType {
                field: "args".into(),
                expected: "array",
                found: v::kind(&other),
            });
        }
    };
    Ok(UtilityCall {
        client_index,
        call_id,
        method,
        args,
    })
}

pub(crate) fn call_id(x: &Value, field: &str) -> R<CallId> {
    match x {
        Value::Integer(i) => {
            if let Some(u) = i.as_u64() {
                Ok(CallId::Unsigned(u))
            } else if let Some(n) = i.as_i64() {
                Ok(CallId::Negative(n))
            } else {
                Err(DecodeErrorKind::InvalidValue {
                    field: field.into(),
                    reason: format!("{i} is not a 64-bit call id"),
                })
            }
        }
        other => Err(DecodeErrorKind::WrongType {
            field: field.into(),
            expected: "int",
            found: v::kind(other),
        }),
    }
}

fn decode_start_wave(payload: &[u8]) -> R<InputMessage> {
    let value = v::read_whole(payload)?;
    let a = v::array(&value, "START_DP_WAVE payload")?;
    let Some(wave) = a.first() else {
        return Err(DecodeErrorKind::MissingElement {
            what: "START_DP_WAVE payload",
            index: 0,
            field: "wave",
            len: 0,
        });
    };
    let wave = v::i64_(wave, "wave")?;
    let exclude_engine_index = match a.get(1) {
        None => None,
        Some(x) => v::opt_i64(x, "exclude_engine_index")?,
    };
    Ok(InputMessage::StartDpWave {
        wave,
        exclude_engine_index,
    })
}
