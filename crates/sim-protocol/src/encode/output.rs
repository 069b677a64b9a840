//! `EngineCoreOutputs` → `[payload, aux…]` for one line.

use bytes::Bytes;

use super::{EncodeError, EncodeOptions, Writer};
use crate::line::{OutputField, VllmLine};
use crate::types::{
    CallId, EngineCoreOutput, EngineCoreOutputs, LogprobsLists, PrefillStats, PrefixCacheStats,
    SchedulerStats, StopReason, UtilityOutput,
};

/// Encode one envelope for `line` with default options. See [`encode_outputs_with`].
pub fn encode_outputs(line: VllmLine, out: &EngineCoreOutputs) -> Result<Vec<Bytes>, EncodeError> {
    encode_outputs_with(line, out, &EncodeOptions::default())
}

/// Encode one envelope for `line`: frames `[payload, aux…]`.
///
/// The envelope is trimmed after its last non-default field and never longer than
/// `line.outputs_len()`; each `EngineCoreOutput` is laid out by `line.output_layout()` and
/// trimmed the same way. Fields the line does not have are dropped (logged at debug).
/// Refuses envelopes that `vllm-rs` would die on: nothing set, or request outputs mixed with
/// a utility reply.
pub fn encode_outputs_with(
    line: VllmLine,
    out: &EngineCoreOutputs,
    opts: &EncodeOptions,
) -> Result<Vec<Bytes>, EncodeError> {
    OutputEncoder::new(line, *opts).encode(out)
}

/// A reusable encoder for one line; remembers the last payload size to size the next
/// buffer in one allocation.
#[derive(Debug, Clone)]
pub struct OutputEncoder {
    line: VllmLine,
    opts: EncodeOptions,
    size_hint: usize,
}

impl OutputEncoder {
    pub fn new(line: VllmLine, opts: EncodeOptions) -> Self {
        Self {
            line,
            opts,
            size_hint: 128,
        }
    }

    pub fn line(&self) -> VllmLine {
        self.line
    }

    pub fn encode(&mut self, out: &EngineCoreOutputs) -> Result<Vec<Bytes>, EncodeError> {
        let mut buf = Vec::with_capacity(self.estimate(out));
        let aux = self.encode_into(out, &mut buf)?;
        let mut frames = Vec::with_capacity(1 + aux.len());
        frames.push(Bytes::from(buf));
        frames.extend(aux);
        Ok(frames)
    }

    /// Append the payload frame to `buf` (a sender's reused buffer, e.g. after the ZMTP
    /// frame header it will fill in) and return the aux frames, usually none.
    pub fn encode_into(
        &mut self,
        out: &EngineCoreOutputs,
        buf: &mut Vec<u8>,
    ) -> Result<Vec<Bytes>, EncodeError> {
        let start = buf.len();
        buf.reserve(self.estimate(out));
        let mut w = Writer {
            buf: std::mem::take(buf),
            aux: Vec::new(),
            threshold: self.opts.inline_threshold,
            overflow: None,
        };
        let written = write_envelope(&mut w, self.line, out);
        *buf = w.buf;
        written?;
        if let Some(n) = w.overflow {
            return Err(EncodeError::TooLong(n));
        }
        self.size_hint = buf.len() - start;
        Ok(w.aux)
    }

    fn estimate(&self, out: &EngineCoreOutputs) -> usize {
        let estimate = 32
            + out
                .outputs
                .iter()
                .map(|o| 16 + o.request_id.len() + 5 * o.new_token_ids.len())
                .sum::<usize>()
            + if out.scheduler_stats.is_some() {
                700
            } else {
                0
            };
        estimate.max(self.size_hint.min(1 << 20))
    }
}

fn write_envelope(
    w: &mut Writer,
    line: VllmLine,
    out: &EngineCoreOutputs,
) -> Result<(), EncodeError> {
    let has_weight_version = line.outputs_len() >= 9;
    if out.weight_version.is_some() && !has_weight_version {
        tracing::debug!(%line, "dropping weight_version: the line has no such field");
    }
    let set = [
        out.engine_index != 0,
        !out.outputs.is_empty(),
        out.scheduler_stats.is_some(),
        out.timestamp != 0.0,
        out.utility_output.is_some(),
        out.finished_requests.is_some(),
        out.wave_complete.is_some(),
        out.start_wave.is_some(),
        out.weight_version.is_some() && has_weight_version,
    ];
    let is_class = set[1] || set[2] || set[4] || set[5] || set[6] || set[7];
    if !is_class {
        return Err(EncodeError::EmptyEnvelope);
    }
    if set[4] && set[1] {
        return Err(EncodeError::MixedEnvelope);
    }
    let len = set
        .iter()
        .rposition(|s| *s)
        .map_or(0, |i| i + 1)
        .min(line.outputs_len());
    w.array(len);
    for i in 0..len {
        match i {
            0 => w.uint(u64::from(out.engine_index)),
            1 => {
                w.array(out.outputs.len());
                for o in &out.outputs {
                    write_output(w, line, o)?;
                }
            }
            2 => match &out.scheduler_stats {
                Some(s) => write_scheduler_stats(w, s),
                None => w.nil(),
            },
            3 => w.f64(out.timestamp),
            4 => match &out.utility_output {
                Some(u) => write_utility_output(w, u),
                None => w.nil(),
            },
            5 => match &out.finished_requests {
                Some(ids) => {
                    w.array(ids.len());
                    for id in ids {
                        w.str(id);
                    }
                }
                None => w.nil(),
            },
            6 => opt_int(w, out.wave_complete),
            7 => opt_int(w, out.start_wave),
            _ => w.opt_str(out.weight_version.as_deref()),
        }
    }
    Ok(())
}

fn opt_int(w: &mut Writer, v: Option<i64>) {
    match v {
        Some(v) => w.int(v),
        None => w.nil(),
    }
}

pub(crate) fn write_call_id(w: &mut Writer, id: CallId) {
    match id {
        CallId::Unsigned(v) => w.uint(v),
        CallId::Negative(v) => w.int(v),
    }
}

/// `[call_id, failure_message|nil, [nil, value]|nil]` (always 3 elements, as Python sends).
fn write_utility_output(w: &mut Writer, u: &UtilityOutput) {
    w.array(3);
    write_call_id(w, u.call_id);
    match &u.outcome {
        Ok(value) => {
            w.nil();
            w.array(2);
            w.nil();
            w.value(value);
        }
        Err(msg) => {
            w.str(msg);
            w.nil();
        }
    }
}

/// Fields that some lines lack; checked so that a dropped one is at least logged.
const LINE_DEPENDENT: [OutputField; 6] = [
    OutputField::EcTransferParams,
    OutputField::MmCacheMissHashes,
    OutputField::NewSamplingMask,
    OutputField::SpecDecodeMetrics,
    OutputField::PromptTokenIdLogprobs,
    OutputField::Error,
];

/// Every field of `o` that is set, one bit per [`OutputField`] (its discriminant): read
/// once per output, then looked up per layout position (the engine encodes one output per
/// request per step, so this is on its hot path).
fn set_fields(o: &EngineCoreOutput) -> u32 {
    use OutputField as F;
    let on = |f: OutputField, set: bool| u32::from(set) << (f as u32);
    bit(F::RequestId)
        | bit(F::NewTokenIds)
        | on(F::NewLogprobs, o.new_logprobs.is_some())
        | on(
            F::NewPromptLogprobsTensors,
            o.new_prompt_logprobs_tensors.is_some(),
        )
        | on(F::PoolingOutput, o.pooling_output.is_some())
        | on(F::FinishReason, o.finish_reason.is_some())
        | on(F::StopReason, o.stop_reason.is_some())
        | on(F::Events, !o.events.is_empty())
        | on(F::KvTransferParams, o.kv_transfer_params.is_some())
        | on(F::EcTransferParams, o.ec_transfer_params.is_some())
        | on(F::TraceHeaders, o.trace_headers.is_some())
        | on(F::PrefillStats, o.prefill_stats.is_some())
        | on(F::RoutedExperts, o.routed_experts.is_some())
        | on(F::NumNansInLogits, o.num_nans_in_logits != 0)
        | on(F::MmCacheMissHashes, o.mm_cache_miss_hashes.is_some())
        | on(F::NewSamplingMask, o.new_sampling_mask.is_some())
        | on(F::SpecDecodeMetrics, o.spec_decode_metrics.is_some())
        | on(
            F::PromptTokenIdLogprobs,
            o.prompt_token_id_logprobs.is_some(),
        )
        | on(F::Error, o.error.is_some())
}

fn bit(f: OutputField) -> u32 {
    1 << (f as u32)
}

fn write_output(w: &mut Writer, line: VllmLine, o: &EngineCoreOutput) -> Result<(), EncodeError> {
    let layout = line.output_layout();
    let set = set_fields(o);
    if LINE_DEPENDENT.iter().any(|f| set & bit(*f) != 0) {
        for f in LINE_DEPENDENT {
            if set & bit(f) != 0 && !layout.contains(&f) {
                tracing::debug!(%line, field = ?f, request_id = %o.request_id, "dropping a field the line does not have");
            }
        }
    }
    let len = layout
        .iter()
        .rposition(|f| set & bit(*f) != 0)
        .map_or(2, |i| i + 1);
    w.array(len);
    for f in &layout[..len] {
        write_field(w, line, o, *f)?;
    }
    Ok(())
}

fn write_field(
    w: &mut Writer,
    line: VllmLine,
    o: &EngineCoreOutput,
    f: OutputField,
) -> Result<(), EncodeError> {
    use OutputField as F;
    match f {
        F::RequestId => w.str(&o.request_id),
        F::NewTokenIds => w.uint_list(o.new_token_ids.iter().map(|t| u64::from(*t))),
        F::NewLogprobs => match &o.new_logprobs {
            Some(lp) => write_logprobs(w, lp, &o.request_id)?,
            None => w.nil(),
        },
        F::NewPromptLogprobsTensors => w.opt_value(o.new_prompt_logprobs_tensors.as_deref()),
        F::PoolingOutput => w.opt_value(o.pooling_output.as_deref()),
        F::FinishReason => match o.finish_reason {
            Some(r) => w.uint(r as u64),
            None => w.nil(),
        },
        F::StopReason => match &o.stop_reason {
            Some(StopReason::Token(t)) => w.int(*t),
            Some(StopReason::Text(s)) => w.str(s),
            None => w.nil(),
        },
        F::Events => {
            if o.events.is_empty() {
                w.nil();
            } else {
                w.array(o.events.len());
                for e in &o.events {
                    // A map: Python rejects the array form.
                    w.map(2);
                    w.str("type");
                    w.uint(e.kind as u64);
                    w.str("timestamp");
                    w.f64(e.timestamp);
                }
            }
        }
        F::KvTransferParams => w.opt_value(o.kv_transfer_params.as_deref()),
        F::EcTransferParams => w.opt_value(o.ec_transfer_params.as_deref()),
        F::TraceHeaders => w.opt_value(o.trace_headers.as_deref()),
        F::PrefillStats => match &o.prefill_stats {
            Some(p) => write_prefill_stats(w, line, p),
            None => w.nil(),
        },
        F::RoutedExperts => w.opt_value(o.routed_experts.as_deref()),
        F::NumNansInLogits => w.uint(u64::from(o.num_nans_in_logits)),
        F::MmCacheMissHashes => match &o.mm_cache_miss_hashes {
            Some(hs) => {
                w.array(hs.len());
                for h in hs {
                    w.str(h);
                }
            }
            None => w.nil(),
        },
        F::NewSamplingMask => w.opt_value(o.new_sampling_mask.as_deref()),
        F::SpecDecodeMetrics => match &o.spec_decode_metrics {
            Some(m) => {
                w.map(5);
                w.str("num_spec_tokens");
                w.uint(m.num_spec_tokens);
                w.str("histogram");
                w.uint_list(m.histogram.iter().copied());
                w.str("num_draft_tokens");
                w.uint(m.num_draft_tokens);
                w.str("per_step_accepted");
                w.uint_list(m.per_step_accepted.iter().copied());
                w.str("per_step_drafted");
                w.uint_list(m.per_step_drafted.iter().copied());
            }
            None => w.nil(),
        },
        F::PromptTokenIdLogprobs => w.opt_value(o.prompt_token_id_logprobs.as_deref()),
        F::Error => match &o.error {
            Some(e) => {
                w.map(3);
                w.str("code");
                w.str(&e.code);
                w.str("message");
                w.str(&e.message);
                w.str("retryable");
                w.bool(e.retryable);
            }
            None => w.nil(),
        },
    }
    Ok(())
}

fn write_prefill_stats(w: &mut Writer, line: VllmLine, p: &PrefillStats) {
    let with_creation = line.prefill_stats_has_cache_creation();
    w.map(if with_creation { 6 } else { 5 });
    w.str("num_prompt_tokens");
    w.uint(p.num_prompt_tokens);
    w.str("num_computed_tokens");
    w.uint(p.num_computed_tokens);
    w.str("num_cached_tokens");
    w.uint(p.num_cached_tokens);
    w.str("num_local_cached_tokens");
    w.uint(p.num_local_cached_tokens);
    w.str("num_external_cached_tokens");
    w.uint(p.num_external_cached_tokens);
    if with_creation {
        w.str("num_cache_creation_tokens");
        w.uint(p.num_cache_creation_tokens);
    }
}

fn write_logprobs(w: &mut Writer, lp: &LogprobsLists, request_id: &str) -> Result<(), EncodeError> {
    let n = lp.rows.checked_mul(lp.cols);
    let bad = |reason: String| EncodeError::Invalid {
        field: format!("new_logprobs of `{request_id}`"),
        reason,
    };
    if n != Some(lp.token_ids.len()) || n != Some(lp.logprobs.len()) {
        return Err(bad(format!(
            "{} token ids and {} logprobs for a {}×{} array",
            lp.token_ids.len(),
            lp.logprobs.len(),
            lp.rows,
            lp.cols
        )));
    }
    if lp.ranks.len() != lp.rows {
        return Err(bad(format!(
            "{} ranks for {} rows",
            lp.ranks.len(),
            lp.rows
        )));
    }
    let shape2 = [lp.rows as u64, lp.cols as u64];
    w.array(4);
    w.ndarray(
        "<i4",
        &shape2,
        lp.token_ids.iter().flat_map(|x| x.to_le_bytes()).collect(),
    );
    w.ndarray(
        "<f4",
        &shape2,
        lp.logprobs.iter().flat_map(|x| x.to_le_bytes()).collect(),
    );
    w.ndarray(
        "<i8",
        &[lp.rows as u64],
        lp.ranks.iter().flat_map(|x| x.to_le_bytes()).collect(),
    );
    match &lp.cu_num_generated_tokens {
        Some(cu) => w.int_list(cu),
        None => w.nil(),
    }
    Ok(())
}

/// `SchedulerStats` with every key of the 0.33 set, in dataclass order (`vllm-rs` rejects
/// maps missing required keys; every decoder ignores keys it does not know).
fn write_scheduler_stats(w: &mut Writer, s: &SchedulerStats) {
    w.map(18);
    w.str("num_running_reqs");
    w.uint(s.num_running_reqs);
    w.str("num_waiting_reqs");
    w.uint(s.num_waiting_reqs);
    w.str("num_skipped_waiting_reqs");
    w.uint(s.num_skipped_waiting_reqs);
    w.str("num_kv_fetch_reqs_by_stage");
    w.map(0);
    w.str("step_counter");
    w.uint(s.step_counter);
    w.str("current_wave");
    w.uint(s.current_wave);
    w.str("kv_cache_usage");
    w.f64(s.kv_cache_usage);
    w.str("iteration_details");
    w.nil();
    w.str("prefix_cache_stats");
    write_prefix_cache_stats(w, &s.prefix_cache_stats);
    w.str("connector_prefix_cache_stats");
    match &s.connector_prefix_cache_stats {
        Some(p) => write_prefix_cache_stats(w, p),
        None => w.nil(),
    }
    w.str("kv_cache_eviction_events");
    w.array(0);
    w.str("spec_decoding_stats");
    match &s.spec_decoding_stats {
        Some(sd) => {
            w.map(6);
            w.str("num_spec_tokens");
            w.uint(sd.num_spec_tokens);
            w.str("num_drafts");
            w.uint(sd.num_drafts);
            w.str("num_draft_tokens");
            w.uint(sd.num_draft_tokens);
            w.str("num_accepted_tokens");
            w.uint(sd.num_accepted_tokens);
            w.str("num_accepted_tokens_per_pos");
            w.uint_list(sd.num_accepted_tokens_per_pos.iter().copied());
            w.str("num_draft_tokens_per_pos");
            w.uint_list(sd.num_draft_tokens_per_pos.iter().copied());
        }
        None => w.nil(),
    }
    w.str("kv_connector_stats");
    w.opt_value(s.kv_connector_stats.as_ref());
    w.str("ec_connector_stats");
    w.nil();
    for (key, adapters) in [
        ("waiting_lora_adapters", &s.waiting_lora_adapters),
        ("running_lora_adapters", &s.running_lora_adapters),
    ] {
        w.str(key);
        w.map(adapters.len());
        for (name, n) in adapters {
            w.str(name);
            w.uint(*n);
        }
    }
    w.str("cudagraph_stats");
    w.nil();
    w.str("perf_stats");
    w.nil();
}

/// A `PrefixCacheStats`: the device cache's, or a KV connector's.
fn write_prefix_cache_stats(w: &mut Writer, p: &PrefixCacheStats) {
    w.map(8);
    w.str("reset");
    w.bool(p.reset);
    w.str("requests");
    w.uint(p.requests);
    w.str("queries");
    w.uint(p.queries);
    w.str("hits");
    w.uint(p.hits);
    w.str("preempted_requests");
    w.uint(p.preempted_requests);
    w.str("preempted_queries");
    w.uint(p.preempted_queries);
    w.str("preempted_hits");
    w.uint(p.preempted_hits);
    w.str("hits_by_source");
    w.map(0);
}
