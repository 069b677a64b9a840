//! What a frontend sends: `[type_byte, payload, aux…]` (the ROUTER prepends the identity).

use bytes::Bytes;

use super::output::write_call_id;
use super::{EncodeOptions, Writer};
use crate::line::VllmLine;
use crate::types::{
    EngineCoreRequest, InputMessage, LoRARequest, RequestType, SamplingParams, Tensor, UtilityCall,
};

fn type_frame(t: RequestType) -> Bytes {
    Bytes::from_static(match t {
        RequestType::Add => &[0x00],
        RequestType::Abort => &[0x01],
        RequestType::StartDpWave => &[0x02],
        RequestType::Utility => &[0x03],
    })
}

fn frames(t: RequestType, w: Writer) -> Vec<Bytes> {
    let mut out = vec![type_frame(t)];
    out.extend(w.into_frames());
    out
}

/// Encode any input message (ADD for `line`).
pub fn encode_input(line: VllmLine, msg: &InputMessage) -> Vec<Bytes> {
    match msg {
        InputMessage::Add(r) => encode_request(line, r),
        InputMessage::Abort(ids) => encode_abort(ids),
        InputMessage::Utility(c) => encode_utility(c),
        InputMessage::StartDpWave {
            wave,
            exclude_engine_index,
        } => encode_start_dp_wave(*wave, *exclude_engine_index),
    }
}

/// An ADD as `vllm-rs` of `line` sends it: `[0x00, payload, aux…]`, the request array with
/// exactly `line.request_len()` elements, sampling floats as float32. A `prompt_embeds`
/// tensor of 256 bytes or more goes to an aux frame (index 1 = the frame after the payload).
pub fn encode_request(line: VllmLine, req: &EngineCoreRequest) -> Vec<Bytes> {
    encode_request_with(line, req, &EncodeOptions::default())
}

pub fn encode_request_with(
    line: VllmLine,
    req: &EngineCoreRequest,
    opts: &EncodeOptions,
) -> Vec<Bytes> {
    let mut w = Writer::new(256 + 5 * req.prompt_len(), opts.inline_threshold);
    let len = line.request_len();
    w.array(len);
    w.str(&req.request_id);
    match &req.prompt_token_ids {
        Some(ids) => w.uint_list(ids.iter().map(|t| u64::from(*t))),
        None => w.nil(),
    }
    w.opt_value(req.mm_features.as_ref());
    match &req.sampling_params {
        Some(sp) => write_sampling_params(&mut w, line, sp),
        None => w.nil(),
    }
    w.opt_value(req.pooling_params.as_ref());
    w.f64(req.arrival_time);
    match &req.lora_request {
        Some(l) => write_lora(&mut w, line, l),
        None => w.nil(),
    }
    w.opt_str(req.cache_salt.as_deref());
    match req.data_parallel_rank {
        Some(r) => w.int(r),
        None => w.nil(),
    }
    match &req.prompt_embeds {
        Some(t) => write_tensor(&mut w, t),
        None => w.nil(),
    }
    match &req.prompt_is_token_ids {
        Some(mask) => {
            w.array(mask.len());
            for b in mask {
                w.bool(*b);
            }
        }
        None => w.nil(),
    }
    w.uint(u64::from(req.client_index));
    w.int(req.current_wave);
    w.int(req.priority);
    w.opt_value(req.trace_headers.as_ref());
    w.bool(req.resumable);
    w.opt_str(req.external_req_id.as_deref());
    match req.reasoning_ended {
        Some(b) => w.bool(b),
        None => w.nil(),
    }
    w.opt_value(req.reasoning_parser_kwargs.as_ref());
    w.bool(req.abort_immediately);
    if len > 20 {
        w.opt_str(req.session_id.as_deref());
    }
    if len > 21 {
        w.opt_value(req.kv_hints.as_ref());
    }
    frames(RequestType::Add, w)
}

fn write_tensor(w: &mut Writer, t: &Tensor) {
    w.ndarray(&t.dtype, &t.shape, t.data.clone());
}

/// `LoRARequest`: 6 elements on 0.33, else the 7-element layout (which `vllm-rs` 0.32 still
/// sends).
fn write_lora(w: &mut Writer, line: VllmLine, l: &LoRARequest) {
    let six = line >= VllmLine::new(0, 33);
    w.array(if six { 6 } else { 7 });
    w.str(&l.name);
    w.int(l.int_id);
    w.str(&l.path);
    w.nil(); // base_model_name
    if !six {
        w.nil(); // tensorizer_config_dict
    }
    w.bool(false); // load_inplace
    w.bool(false); // is_3d_lora_weight
}

/// The `SamplingParams` map the way `vllm-rs` of `line` sends it (key set per line, floats
/// as float32), plus the keys it never sends when they are not at their default.
pub fn encode_sampling_params(line: VllmLine, sp: &SamplingParams) -> Vec<u8> {
    let mut w = Writer::new(256, usize::MAX);
    write_sampling_params(&mut w, line, sp);
    w.buf
}

fn write_sampling_params(w: &mut Writer, line: VllmLine, sp: &SamplingParams) {
    let watermarking = line >= VllmLine::new(0, 30);
    let routed = line >= VllmLine::new(0, 29);
    let n = 11
        + usize::from(watermarking)
        + usize::from(routed)
        + usize::from(sp.seed.is_some())
        + usize::from(sp.eos_token_id.is_some())
        + usize::from(sp.n != 1)
        + usize::from(sp.ignore_eos)
        + usize::from(sp.logprobs.is_some())
        + usize::from(sp.prompt_logprobs.is_some())
        + usize::from(sp.output_kind != 0)
        + usize::from(sp.extra_args.is_some())
        + usize::from(sp.structured_outputs.is_some());
    w.map(n);
    if sp.n != 1 {
        w.str("n");
        w.uint(u64::from(sp.n));
    }
    w.str("temperature");
    w.f32(sp.temperature as f32);
    if watermarking {
        w.str("watermarking");
        w.bool(true);
    }
    w.str("top_p");
    w.f32(sp.top_p as f32);
    w.str("top_k");
    w.int(sp.top_k);
    if let Some(seed) = sp.seed {
        w.str("seed");
        w.int(seed);
    }
    w.str("max_tokens");
    match sp.max_tokens {
        Some(m) => w.uint(u64::from(m)),
        None => w.nil(),
    }
    w.str("min_tokens");
    w.uint(u64::from(sp.min_tokens));
    for key in ["min_p", "frequency_penalty", "presence_penalty"] {
        w.str(key);
        w.f32(0.0);
    }
    w.str("repetition_penalty");
    w.f32(1.0);
    w.str("stop_token_ids");
    w.uint_list(sp.stop_token_ids.iter().map(|t| u64::from(*t)));
    if sp.ignore_eos {
        w.str("ignore_eos");
        w.bool(true);
    }
    if let Some(lp) = sp.logprobs {
        w.str("logprobs");
        w.int(lp);
    }
    if let Some(lp) = sp.prompt_logprobs {
        w.str("prompt_logprobs");
        w.int(lp);
    }
    if sp.output_kind != 0 {
        w.str("output_kind");
        w.uint(u64::from(sp.output_kind));
    }
    if let Some(eos) = sp.eos_token_id {
        w.str("_eos_token_id");
        w.uint(u64::from(eos));
    }
    w.str("_all_stop_token_ids");
    w.uint_list(sp.all_stop_token_ids.iter().map(|t| u64::from(*t)));
    if let Some(extra) = &sp.extra_args {
        w.str("extra_args");
        w.value(extra);
    }
    if let Some(so) = &sp.structured_outputs {
        w.str("structured_outputs");
        w.value(so);
    }
    if routed {
        w.str("routed_experts_prompt_start");
        w.uint(0);
    }
}

/// `[0x01, ["id", …]]`.
pub fn encode_abort(ids: &[String]) -> Vec<Bytes> {
    let mut w = Writer::new(
        8 + ids.iter().map(|s| s.len() + 2).sum::<usize>(),
        usize::MAX,
    );
    w.array(ids.len());
    for id in ids {
        w.str(id);
    }
    frames(RequestType::Abort, w)
}

/// `[0x03, [client_index, call_id, method, args]]`.
pub fn encode_utility(call: &UtilityCall) -> Vec<Bytes> {
    let mut w = Writer::new(64, usize::MAX);
    w.array(4);
    w.uint(u64::from(call.client_index));
    write_call_id(&mut w, call.call_id);
    w.str(&call.method);
    w.array(call.args.len());
    for a in &call.args {
        w.value(a);
    }
    frames(RequestType::Utility, w)
}

/// `[0x02, [wave, exclude_engine_index|nil]]` (sent by the DP coordinator).
pub fn encode_start_dp_wave(wave: i64, exclude_engine_index: Option<i64>) -> Vec<Bytes> {
    let mut w = Writer::new(16, usize::MAX);
    w.array(2);
    w.int(wave);
    match exclude_engine_index {
        Some(e) => w.int(e),
        None => w.nil(),
    }
    frames(RequestType::StartDpWave, w)
}
