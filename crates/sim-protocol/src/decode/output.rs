//! Engine → frontend messages: `[payload, aux…]` as the frontend's PULL receives them.

use bytes::Bytes;
use rmpv::Value;

use super::input::call_id;
use super::value::{self as v, R};
use super::{DecodeError, DecodeErrorKind};
use crate::line::{OutputField, VllmLine};
use crate::types::{
    ENGINE_CORE_DEAD, EngineCoreEvent, EngineCoreOutput, EngineCoreOutputs, EventType,
    FinishReason, LogprobsLists, PrefillStats, PrefixCacheStats, RequestError,
    RequestSpecDecodeMetrics, SchedulerStats, SpecDecodingStats, StopReason, UtilityOutput,
};

/// What arrived on an output socket.
#[derive(Debug, Clone, PartialEq)]
pub enum DecodedOutputs {
    /// The raw `ENGINE_CORE_DEAD` sentinel: the engine died.
    Dead,
    Outputs(EngineCoreOutputs),
}

/// Decode an output message of any supported line.
///
/// The `EngineCoreOutput` layout is detected per output from what it holds: the 0.25 layout
/// (13 fields) differs from 0.26+ from index 9 on (`ec_transfer_params` was inserted). An
/// integer at index 12, an ndarray at 11 or prefill stats at 10 mean 0.25; anything else is
/// read with the newest layout, which agrees with every line on the first 9 positions and
/// keeps trailing fields the sender's line did not have at their defaults. Use
/// [`decode_outputs_for`] when the line is known.
pub fn decode_outputs(frames: &[Bytes]) -> Result<DecodedOutputs, DecodeError> {
    decode_outputs_impl(None, frames)
}

/// Decode an output message with the `EngineCoreOutput` layout of `line`.
pub fn decode_outputs_for(line: VllmLine, frames: &[Bytes]) -> Result<DecodedOutputs, DecodeError> {
    decode_outputs_impl(Some(line), frames)
}

fn decode_outputs_impl(
    line: Option<VllmLine>,
    frames: &[Bytes],
) -> Result<DecodedOutputs, DecodeError> {
    let Some(payload) = frames.first() else {
        return Err(DecodeError::bare(DecodeErrorKind::EmptyMessage));
    };
    if payload.as_ref() == ENGINE_CORE_DEAD {
        return Ok(DecodedOutputs::Dead);
    }
    let aux = &frames[1..];
    envelope(line, payload, aux)
        .map(DecodedOutputs::Outputs)
        .map_err(DecodeError::bare)
}

fn envelope(line: Option<VllmLine>, payload: &[u8], aux: &[Bytes]) -> R<EngineCoreOutputs> {
    let (mut items, err) = v::read_top_array(payload, "EngineCoreOutputs");
    if let Some(e) = err {
        return Err(e);
    }
    items.truncate(9);
    items.resize(9, Value::Nil);
    let mut out = EngineCoreOutputs::default();
    let x = &items;
    if !v::is_nil(&x[0]) {
        out.engine_index = v::u32_(&x[0], "engine_index")?;
    }
    if !v::is_nil(&x[1]) {
        let list = v::array(&x[1], "outputs")?;
        out.outputs.reserve(list.len());
        for (i, o) in list.iter().enumerate() {
            out.outputs.push(output(line, o, aux, i)?);
        }
    }
    if !v::is_nil(&x[2]) {
        out.scheduler_stats = Some(Box::new(scheduler_stats(&x[2])?));
    }
    if !v::is_nil(&x[3]) {
        out.timestamp = v::f64_(&x[3], "timestamp")?;
    }
    if !v::is_nil(&x[4]) {
        out.utility_output = Some(utility_output(&x[4])?);
    }
    if !v::is_nil(&x[5]) {
        out.finished_requests = Some(v::string_list(&x[5], "finished_requests")?);
    }
    out.wave_complete = v::opt_i64(&x[6], "wave_complete")?;
    out.start_wave = v::opt_i64(&x[7], "start_wave")?;
    out.weight_version = v::opt_string(&x[8], "weight_version")?;
    Ok(out)
}

/// Whether an `EngineCoreOutput` array looks like the 0.25 layout.
fn looks_like_025(a: &[Value]) -> bool {
    if a.len() >= 14 {
        return false;
    }
    if matches!(a.get(12), Some(Value::Integer(_))) {
        return true;
    }
    match a.get(11) {
        Some(Value::Array(_)) => return true,
        Some(Value::Map(_)) => return false,
        _ => {}
    }
    if let Some(Value::Map(m)) = a.get(10) {
        return v::str_entries(m).any(|(k, _)| k == "num_prompt_tokens");
    }
    false
}

fn output(line: Option<VllmLine>, value: &Value, aux: &[Bytes], i: usize) -> R<EngineCoreOutput> {
    // field names are written for an error only: formatting `outputs[i].field` for every
    // field of every output was a third of a decoder's allocations
    output_fields(line, value, aux).map_err(|e| e.under(&format!("outputs[{i}]")))
}

fn output_fields(line: Option<VllmLine>, value: &Value, aux: &[Bytes]) -> R<EngineCoreOutput> {
    let a = v::array(value, "")?;
    let layout = match line {
        Some(l) => l.output_layout(),
        None if looks_like_025(a) => VllmLine::new(0, 25).output_layout(),
        None => crate::line::NEWEST.output_layout(),
    };
    if a.len() < 2 {
        return Err(DecodeErrorKind::MissingElement {
            what: "EngineCoreOutput",
            index: a.len(),
            field: ["request_id", "new_token_ids"][a.len()],
            len: a.len(),
        });
    }
    let mut o = EngineCoreOutput::default();
    for (field, x) in layout.iter().zip(a.iter()) {
        let fname = |f: &'static str| f;
        use OutputField as F;
        match field {
            F::RequestId => o.request_id = v::str_ref(x, fname("request_id"))?.into(),
            F::NewTokenIds => o.new_token_ids = v::u32_list(x, fname("new_token_ids"))?.into(),
            _ if v::is_nil(x) => {}
            F::NewLogprobs => {
                o.new_logprobs = Some(Box::new(logprobs(x, aux, fname("new_logprobs"))?))
            }
            F::NewPromptLogprobsTensors => {
                o.new_prompt_logprobs_tensors = Some(Box::new(x.clone()))
            }
            F::PoolingOutput => o.pooling_output = Some(Box::new(x.clone())),
            F::FinishReason => o.finish_reason = Some(finish_reason(x, fname("finish_reason"))?),
            F::StopReason => {
                o.stop_reason = Some(match x {
                    Value::String(_) => StopReason::Text(v::string(x, fname("stop_reason"))?),
                    _ => StopReason::Token(v::i64_(x, fname("stop_reason"))?),
                })
            }
            F::Events => {
                let list = v::array(x, fname("events"))?;
                o.events = list
                    .iter()
                    .map(|e| event(e, fname("events")))
                    .collect::<R<_>>()?;
            }
            F::KvTransferParams => o.kv_transfer_params = Some(Box::new(x.clone())),
            F::EcTransferParams => o.ec_transfer_params = Some(Box::new(x.clone())),
            F::TraceHeaders => o.trace_headers = Some(Box::new(x.clone())),
            F::PrefillStats => {
                o.prefill_stats = Some(Box::new(prefill_stats(x, fname("prefill_stats"))?))
            }
            F::RoutedExperts => o.routed_experts = Some(Box::new(x.clone())),
            F::NumNansInLogits => o.num_nans_in_logits = v::u32_(x, fname("num_nans_in_logits"))?,
            F::MmCacheMissHashes => {
                o.mm_cache_miss_hashes = Some(v::string_list(x, fname("mm_cache_miss_hashes"))?)
            }
            F::NewSamplingMask => o.new_sampling_mask = Some(Box::new(x.clone())),
            F::SpecDecodeMetrics => {
                o.spec_decode_metrics =
                    Some(Box::new(spec_metrics(x, fname("spec_decode_metrics"))?))
            }
            F::PromptTokenIdLogprobs => o.prompt_token_id_logprobs = Some(Box::new(x.clone())),
            F::Error => o.error = Some(Box::new(request_error(x, fname("error"))?)),
        }
    }
    Ok(o)
}

pub(crate) fn finish_reason(x: &Value, field: &str) -> R<FinishReason> {
    let n = v::u64_(x, field)?;
    Ok(match n {
        0 => FinishReason::Stop,
        1 => FinishReason::Length,
        2 => FinishReason::Abort,
        3 => FinishReason::Error,
        4 => FinishReason::Repetition,
        _ => {
            return Err(DecodeErrorKind::InvalidValue {
                field: field.into(),
                reason: format!("{n} is not a FinishReason (0–4)"),
            });
        }
    })
}

fn event(x: &Value, field: &str) -> R<EngineCoreEvent> {
    // Python sends maps; vllm-rs also accepts `[type, ts]`, so do we.
    let (t, ts) = match x {
        Value::Map(m) => {
            let mut t = None;
            let mut ts = None;
            for (k, val) in v::str_entries(m) {
                match k {
                    "type" => t = Some(val),
                    "timestamp" => ts = Some(val),
                    _ => {}
                }
            }
            let missing = |k: &str| DecodeErrorKind::MissingKey {
                field: format!("{field}.{k}"),
            };
            (
                t.ok_or_else(|| missing("type"))?,
                ts.ok_or_else(|| missing("timestamp"))?,
            )
        }
        Value::Array(a) if a.len() >= 2 => (&a[0], &a[1]),
        other => {
            return Err(DecodeErrorKind::WrongType {
                field: field.into(),
                expected: "an event map {type, timestamp}",
                found: v::kind(other),
            });
        }
    };
    let kind = match v::u64_(t, &format!("{field}.type"))? {
        1 => EventType::Queued,
        2 => EventType::Scheduled,
        3 => EventType::Preempted,
        n => {
            return Err(DecodeErrorKind::InvalidValue {
                field: format!("{field}.type"),
                reason: format!("{n} is not an EngineCoreEventType (1–3)"),
            });
        }
    };
    Ok(EngineCoreEvent {
        kind,
        timestamp: v::f64_(ts, &format!("{field}.timestamp"))?,
    })
}

fn prefill_stats(x: &Value, field: &str) -> R<PrefillStats> {
    let m = v::map(x, field)?;
    let mut p = PrefillStats::default();
    for (k, val) in v::str_entries(m) {
        let f = format!("{field}.{k}");
        match k {
            "num_prompt_tokens" => p.num_prompt_tokens = v::u64_(val, &f)?,
            "num_computed_tokens" => p.num_computed_tokens = v::u64_(val, &f)?,
            "num_cached_tokens" => p.num_cached_tokens = v::u64_(val, &f)?,
            "num_local_cached_tokens" => p.num_local_cached_tokens = v::u64_(val, &f)?,
            "num_external_cached_tokens" => p.num_external_cached_tokens = v::u64_(val, &f)?,
            "num_cache_creation_tokens" => p.num_cache_creation_tokens = v::u64_(val, &f)?,
            _ => {}
        }
    }
    Ok(p)
}

fn request_error(x: &Value, field: &str) -> R<RequestError> {
    let m = v::map(x, field)?;
    let (mut code, mut message, mut retryable) = (None, None, false);
    for (k, val) in v::str_entries(m) {
        let f = format!("{field}.{k}");
        match k {
            "code" => code = Some(v::string(val, &f)?),
            "message" => message = Some(v::string(val, &f)?),
            "retryable" => retryable = v::bool_(val, &f)?,
            _ => {}
        }
    }
    let missing = |k: &str| DecodeErrorKind::MissingKey {
        field: format!("{field}.{k}"),
    };
    Ok(RequestError {
        code: code.ok_or_else(|| missing("code"))?,
        message: message.ok_or_else(|| missing("message"))?,
        retryable,
    })
}

fn spec_metrics(x: &Value, field: &str) -> R<RequestSpecDecodeMetrics> {
    let m = v::map(x, field)?;
    let mut s = RequestSpecDecodeMetrics::default();
    for (k, val) in v::str_entries(m) {
        let f = format!("{field}.{k}");
        match k {
            "num_spec_tokens" => s.num_spec_tokens = v::u64_(val, &f)?,
            "histogram" => s.histogram = v::u64_list(val, &f)?,
            "num_draft_tokens" => s.num_draft_tokens = v::u64_(val, &f)?,
            "per_step_accepted" => s.per_step_accepted = v::u64_list(val, &f)?,
            "per_step_drafted" => s.per_step_drafted = v::u64_list(val, &f)?,
            _ => {}
        }
    }
    Ok(s)
}

/// `LogprobsLists`: `[ids (rows, cols) <i4, logprobs (rows, cols) <f4, ranks (rows,) <i8,
/// cu|nil]`.
fn logprobs(x: &Value, aux: &[Bytes], field: &str) -> R<LogprobsLists> {
    let a = v::array(x, field)?;
    if a.len() < 3 {
        return Err(DecodeErrorKind::Shape {
            what: field.into(),
            expected: "a LogprobsLists array of at least 3 elements",
            found: format!("{} elements", a.len()),
        });
    }
    let ids = v::tensor(&a[0], aux, &format!("{field}.logprob_token_ids"))?;
    let lps = v::tensor(&a[1], aux, &format!("{field}.logprobs"))?;
    let ranks = v::tensor(&a[2], aux, &format!("{field}.sampled_token_ranks"))?;
    let (rows, cols) = match ids.shape.as_slice() {
        [r, c] => (*r as usize, *c as usize),
        [r] => (*r as usize, 1),
        _ => {
            return Err(DecodeErrorKind::InvalidValue {
                field: format!("{field}.logprob_token_ids.shape"),
                reason: format!("expected 2 dimensions, found {:?}", ids.shape),
            });
        }
    };
    let n = rows
        .checked_mul(cols)
        .ok_or_else(|| DecodeErrorKind::InvalidValue {
            field: format!("{field}.logprob_token_ids.shape"),
            reason: "shape overflows".into(),
        })?;
    let token_ids: Vec<i32> = match ids.dtype.as_str() {
        "<i4" | "int32" => le_chunks::<4>(&ids.data, n, field)?
            .map(i32::from_le_bytes)
            .collect(),
        "<i8" | "int64" => le_chunks::<8>(&ids.data, n, field)?
            .map(|b| i64::from_le_bytes(b) as i32)
            .collect(),
        other => return Err(bad_dtype(field, "logprob_token_ids", other)),
    };
    let logprobs: Vec<f32> = match lps.dtype.as_str() {
        "<f4" | "float32" => le_chunks::<4>(&lps.data, n, field)?
            .map(f32::from_le_bytes)
            .collect(),
        "<f8" | "float64" => le_chunks::<8>(&lps.data, n, field)?
            .map(|b| f64::from_le_bytes(b) as f32)
            .collect(),
        other => return Err(bad_dtype(field, "logprobs", other)),
    };
    let ranks: Vec<i64> = match ranks.dtype.as_str() {
        "<i8" | "int64" => le_chunks::<8>(&ranks.data, rows, field)?
            .map(i64::from_le_bytes)
            .collect(),
        "<i4" | "int32" => le_chunks::<4>(&ranks.data, rows, field)?
            .map(|b| i64::from(i32::from_le_bytes(b)))
            .collect(),
        other => return Err(bad_dtype(field, "sampled_token_ranks", other)),
    };
    let cu_num_generated_tokens = match a.get(3) {
        None | Some(Value::Nil) => None,
        Some(c) => Some(v::i64_list(c, &format!("{field}.cu_num_generated_tokens"))?),
    };
    Ok(LogprobsLists {
        token_ids,
        logprobs,
        ranks,
        rows,
        cols,
        cu_num_generated_tokens,
    })
}

fn bad_dtype(field: &str, part: &str, dtype: &str) -> DecodeErrorKind {
    DecodeErrorKind::InvalidValue {
        field: format!("{field}.{part}.dtype"),
        reason: format!("unsupported dtype {dtype:?}"),
    }
}

fn le_chunks<'a, const N: usize>(
    data: &'a [u8],
    n: usize,
    field: &str,
) -> R<impl Iterator<Item = [u8; N]> + 'a> {
    if n.checked_mul(N) != Some(data.len()) {
        return Err(DecodeErrorKind::InvalidValue {
            field: field.into(),
            reason: format!("{} data bytes for {n} elements of {N} bytes", data.len()),
        });
    }
    Ok(data
        .chunks_exact(N)
        .map(|c| <[u8; N]>::try_from(c).unwrap_or([0; N])))
}

fn utility_output(x: &Value) -> R<UtilityOutput> {
    let a = v::array(x, "utility_output")?;
    let Some(id) = a.first() else {
        return Err(DecodeErrorKind::MissingElement {
            what: "UtilityOutput",
            index: 0,
            field: "call_id",
            len: 0,
        });
    };
    let call_id = call_id(id, "utility_output.call_id")?;
    let failure = match a.get(1) {
        None => None,
        Some(f) => v::opt_string(f, "utility_output.failure_message")?,
    };
    let outcome = match failure {
        Some(msg) => Err(msg),
        None => Ok(match a.get(2) {
            None | Some(Value::Nil) => Value::Nil,
            // `UtilityResult` = `(type_info, value)`.
            Some(Value::Array(r)) if r.len() == 2 => r[1].clone(),
            Some(other) => {
                return Err(DecodeErrorKind::WrongType {
                    field: "utility_output.result".into(),
                    expected: "a [type_info, value] pair",
                    found: v::kind(other),
                });
            }
        }),
    };
    Ok(UtilityOutput { call_id, outcome })
}

fn prefix_cache_stats(x: &Value, field: &str) -> R<PrefixCacheStats> {
    let m = v::map(x, field)?;
    let mut p = PrefixCacheStats::default();
    for (k, val) in v::str_entries(m) {
        let f = format!("{field}.{k}");
        match k {
            "reset" => p.reset = v::bool_(val, &f)?,
            "requests" => p.requests = v::u64_(val, &f)?,
            "queries" => p.queries = v::u64_(val, &f)?,
            "hits" => p.hits = v::u64_(val, &f)?,
            "preempted_requests" => p.preempted_requests = v::u64_(val, &f)?,
            "preempted_queries" => p.preempted_queries = v::u64_(val, &f)?,
            "preempted_hits" => p.preempted_hits = v::u64_(val, &f)?,
            _ => {}
        }
    }
    Ok(p)
}

fn spec_decoding_stats(x: &Value, field: &str) -> R<SpecDecodingStats> {
    let m = v::map(x, field)?;
    let mut s = SpecDecodingStats::default();
    for (k, val) in v::str_entries(m) {
        let f = format!("{field}.{k}");
        match k {
            "num_spec_tokens" => s.num_spec_tokens = v::u64_(val, &f)?,
            "num_drafts" => s.num_drafts = v::u64_(val, &f)?,
            "num_draft_tokens" => s.num_draft_tokens = v::u64_(val, &f)?,
            "num_accepted_tokens" => s.num_accepted_tokens = v::u64_(val, &f)?,
            "num_accepted_tokens_per_pos" => s.num_accepted_tokens_per_pos = v::u64_list(val, &f)?,
            "num_draft_tokens_per_pos" => s.num_draft_tokens_per_pos = v::u64_list(val, &f)?,
            _ => {}
        }
    }
    Ok(s)
}

/// `SchedulerStats` (map; unknown keys ignored, missing ones default).
pub(crate) fn scheduler_stats(x: &Value) -> R<SchedulerStats> {
    let field = "scheduler_stats";
    let m = v::map(x, field)?;
    let mut s = SchedulerStats::default();
    for (k, val) in v::str_entries(m) {
        let f = format!("{field}.{k}");
        match k {
            "num_running_reqs" => s.num_running_reqs = v::u64_(val, &f)?,
            "num_waiting_reqs" => s.num_waiting_reqs = v::u64_(val, &f)?,
            "num_skipped_waiting_reqs" => s.num_skipped_waiting_reqs = v::u64_(val, &f)?,
            "step_counter" => s.step_counter = v::u64_(val, &f)?,
            "current_wave" => s.current_wave = v::u64_(val, &f)?,
            "kv_cache_usage" => s.kv_cache_usage = v::f64_(val, &f)?,
            "prefix_cache_stats" if !v::is_nil(val) => {
                s.prefix_cache_stats = prefix_cache_stats(val, &f)?
            }
            "spec_decoding_stats" if !v::is_nil(val) => {
                s.spec_decoding_stats = Some(spec_decoding_stats(val, &f)?)
            }
            "waiting_lora_adapters" => s.waiting_lora_adapters = v::str_u64_pairs(val, &f)?,
            "running_lora_adapters" => s.running_lora_adapters = v::str_u64_pairs(val, &f)?,
            _ => {}
        }
    }
    Ok(s)
}
