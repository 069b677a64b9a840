//! What one request emits at the end of a step that sampled it: its new tokens (one, a
//! speculative burst, or a burst the latency model drew), stop checks, injected failures,
//! logprobs, prefill stats on its first output and spec-decode metrics on its last.

use sim_protocol::{EngineCoreOutput, FinishReason, PrefillStats, RequestError, StopReason};

use super::request::SimRequest;
use super::sim::config::EngineConfig;
use crate::play::content::logprobs::{
    resolve_num_logprobs, sample_logprobs, sample_prompt_logprobs,
};
use crate::play::content::spec_decode::SpecStepStats;

/// The prefix of the error message of a request whose structured output failed
/// mid-answer (its grammar could not be followed to its end). The error's code is
/// `validation_error`, the one non-retryable code both frontends pass to the client with
/// its message (any other reaches a vllm-rs client as a bare "Internal server error").
pub const STRUCTURED_OUTPUT_FAILED: &str = "structured_output_failed";

/// How many tokens a sampled request delivers in this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Burst {
    /// The engine's own rule: `--output-token-chunk-size` tokens, or 1 + accepted drafts
    /// under `--num-speculative-tokens`.
    Engine,
    /// A burst the latency model drew from a capture, replayed as speculative decoding
    /// with `k` drafts: `n` tokens = the target's own token + `n - 1` accepted drafts.
    Model { n: u32, k: Option<u32> },
}

/// Build request `r`'s output for this step; `true` when the request finished.
pub fn emit(
    r: &mut SimRequest,
    cfg: &EngineConfig,
    burst: Burst,
    spec_step: &mut Option<SpecStepStats>,
) -> (EngineCoreOutput, bool) {
    let mut o = EngineCoreOutput::for_request(r.id.clone());
    let done = emit_into(&mut o, r, cfg, burst, spec_step);
    (o, done)
}

/// [`emit`] into `o`, an empty output of `r` (`EngineCoreOutput::for_request(r.id)`)
/// already in its place in the step's vector: the output is built where it stays, not
/// built and then moved (one per token, at ~220 bytes the moves showed in the engine's
/// profile).
pub fn emit_into(
    o: &mut EngineCoreOutput,
    r: &mut SimRequest,
    cfg: &EngineConfig,
    burst: Burst,
    spec_step: &mut Option<SpecStepStats>,
) -> bool {
    debug_assert_eq!(o.request_id, r.id);
    let mut stop: Option<(FinishReason, Option<StopReason>)> = None;
    let mut count = u64::from(cfg.output_token_chunk_size.max(1));
    match burst {
        // a decode step verifies K drafts and delivers 1 + accepted tokens
        Burst::Engine => {
            if let (Some(m), true) = (&cfg.spec, r.started) {
                let accepted = m.draw(&mut r.rng);
                observe_spec(r, spec_step, m.num_spec_tokens, accepted);
                count = 1 + u64::from(accepted);
            }
        }
        Burst::Model { n, k } => {
            let n = n.max(1);
            if let (Some(k), true) = (k, r.started) {
                observe_spec(r, spec_step, k, (n - 1).min(k));
            }
            count = u64::from(n);
        }
    }
    let failure = r.failure;
    let failed = |r: &SimRequest| failure.as_ref().filter(|f| r.num_output >= f.after_tokens);
    let failure_finish = |f| {
        cfg.failures
            .as_ref()
            .map_or((FinishReason::Error, None, None), |inj| inj.finish(f))
    };
    if let Some(p) = r.pooling {
        // a pooling request's output is its vector, sent when its prefill is done
        let prompt = &r.tokens[..r.prompt_len as usize];
        let v = crate::play::content::pooling::embed(prompt, cfg.embedding_dim, p, cfg.seed);
        o.pooling_output = Some(Box::new(crate::play::content::pooling::tensor_value(&v)));
        stop = Some((FinishReason::Stop, None));
        count = 0;
    }
    for _ in 0..count {
        if let Some(f) = failed(r) {
            let (reason, why, err) = failure_finish(f);
            o.error = err.map(Box::new);
            stop = Some((reason, why));
            break;
        }
        let (t, s) = match r.generate_one(cfg.max_model_len) {
            Ok(g) => g,
            Err(why) => {
                // a grammar the stream could not follow to its end: an error with the
                // reason, never `stop` on an unfinished structure
                tracing::warn!(
                    request_id = %r.id,
                    output_tokens = r.num_output,
                    "structured output failed: {why}"
                );
                o.error = Some(Box::new(RequestError {
                    code: "validation_error".to_string(),
                    message: format!("{STRUCTURED_OUTPUT_FAILED}: {why}"),
                    retryable: false,
                }));
                stop = Some((FinishReason::Error, None));
                break;
            }
        };
        o.new_token_ids.push(t);
        if s.is_some() {
            stop = s;
            break;
        }
    }
    if stop.is_none()
        && let Some(f) = failed(r)
    {
        let (reason, why, err) = failure_finish(f);
        o.error = err.map(Box::new);
        stop = Some((reason, why));
    }
    // accepted drafts were computed by the verify pass
    r.num_computed = r.num_computed.max(r.tokens.len() as u64 - 1);
    let range = cfg.token_ids.clone();
    if let Some(k) = r.logprobs
        && !o.new_token_ids.is_empty()
    {
        let k = resolve_num_logprobs(k, range.end);
        o.new_logprobs = Some(Box::new(sample_logprobs(
            &mut r.rng,
            &o.new_token_ids,
            k,
            range.clone(),
        )));
    }
    if !r.started
        && let Some(k) = r.prompt_logprobs
    {
        let k = resolve_num_logprobs(k, range.end);
        let prompt = r.tokens[..r.prompt_len as usize].to_vec();
        o.new_prompt_logprobs_tensors =
            sample_prompt_logprobs(&mut r.rng, &prompt, k, range).map(Box::new);
    }
    if cfg.log_stats {
        o.events = std::mem::take(&mut r.pending_events);
    } else {
        r.pending_events.clear();
    }
    if !r.started {
        r.started = true;
        o.prefill_stats = Some(Box::new(prefill_stats(r, cfg)));
    }
    match stop {
        Some((reason, why)) => {
            o.finish_reason = Some(reason);
            o.stop_reason = why;
            o.spec_decode_metrics = r.spec.as_ref().map(|t| Box::new(t.finish()));
            if cfg.log_requests {
                tracing::info!(
                    request_id = %r.id,
                    output_tokens = r.num_output,
                    finish_reason = reason.as_str(),
                    "request finished"
                );
            }
            true
        }
        None => false,
    }
}

fn observe_spec(r: &mut SimRequest, step: &mut Option<SpecStepStats>, k: u32, accepted: u32) {
    step.get_or_insert_with(|| SpecStepStats::new(k))
        .observe(accepted);
    if let Some(t) = &mut r.spec {
        t.observe(accepted);
    }
}

/// The prefill stats of a request's first output.
fn prefill_stats(r: &SimRequest, cfg: &EngineConfig) -> PrefillStats {
    let created = (r.cached_blocks as u64 * cfg.block_size)
        .min(r.prompt_len)
        .saturating_sub(r.cached_tokens);
    PrefillStats {
        num_prompt_tokens: r.prompt_len,
        num_computed_tokens: r.prompt_len - r.cached_tokens.min(r.prompt_len),
        num_cached_tokens: r.cached_tokens,
        num_local_cached_tokens: r.cached_tokens - r.external_cached_tokens,
        num_external_cached_tokens: r.external_cached_tokens,
        num_cache_creation_tokens: if cfg.line.prefill_stats_has_cache_creation() {
            created
        } else {
            0
        },
    }
}
