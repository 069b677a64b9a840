//! How a request the frontend adds is taken in: the checks it must pass (the wire line,
//! the engine's state, the runner, its prompt length), the refusals it gets otherwise (a
//! [`Reject`] with vLLM's error code), and its admission to the waiting queue once its
//! token stream is ready (at once, or after its grammar compiles). Frames that do not
//! decode are refused here too.

use std::time::Instant;

use sim_protocol::{
    EngineCoreEvent, EngineCoreOutput, EngineCoreRequest, EventType, FinishReason, RequestError,
    VllmLine, describe_lines,
};

use crate::play::content::pooling::{PoolingRequest, Runner};
use crate::play::content::spec_decode::RequestSpecTracker;
use crate::play::content::tokens::{SplitMix64, request_seed};
use crate::play::engine::engine_core::{GrammarCompile, GrammarReady, Outbox};
use crate::play::engine::request::SimRequest;
use crate::play::engine::timer::instant_to_monotonic;

use super::{Compiling, SimEngine, lognormal};

impl SimEngine {
    /// A request that never entered the engine (or leaves it at once) finishes with
    /// `reason` and an optional error, the way vLLM answers rejected requests.
    pub(super) fn reject(
        &self,
        out: &mut Outbox,
        client: u32,
        request_id: &str,
        reason: FinishReason,
        error: Option<RequestError>,
        now: Instant,
    ) {
        let error = if self.cfg.line.has_output_error() {
            error
        } else {
            None
        };
        let o = EngineCoreOutput {
            request_id: request_id.into(),
            finish_reason: Some(reason),
            error: error.map(Box::new),
            ..Default::default()
        };
        let mut env = self.envelope(vec![o], now);
        if self.cfg.report_finished {
            env.finished_requests = Some(vec![request_id.to_string()]);
        }
        out.send(client, env);
    }

    /// Finish a request with `error` and vLLM's `RequestError` (on lines that carry it).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reject_error(
        &self,
        out: &mut Outbox,
        client: u32,
        request_id: &str,
        code: &str,
        message: impl Into<String>,
        retryable: bool,
        now: Instant,
    ) {
        let error = RequestError {
            code: code.into(),
            message: message.into(),
            retryable,
        };
        self.reject(
            out,
            client,
            request_id,
            FinishReason::Error,
            Some(error),
            now,
        );
    }

    pub(super) fn on_add(
        &mut self,
        client: u32,
        req: Box<EngineCoreRequest>,
        now: Instant,
        out: &mut Outbox,
    ) {
        let client = if req.client_index != client && req.client_index != 0 {
            req.client_index
        } else {
            client.max(req.client_index)
        };
        let id = req.request_id.as_str();
        let expected = self.cfg.line.request_len();
        if req.wire_len != expected {
            let likely = VllmLine::lines_with_request_len(req.wire_len);
            let guess = if likely.is_empty() {
                "its line is none of the supported ones (vllm-vcr speaks 0.25–0.33)".to_string()
            } else {
                format!(
                    "the frontend looks like vLLM {}. Restart vllm-vcr (play or serve) with --vllm-version set to the frontend's line",
                    describe_lines(&likely)
                )
            };
            let msg = format!(
                "the frontend sent a {}-element EngineCoreRequest, but vLLM {} sends {}: {guess}",
                req.wire_len, self.cfg.line, expected,
            );
            if self.warned_request_lens.insert(req.wire_len) {
                tracing::error!(request_id = %id, "wire version mismatch: {msg}");
            } else {
                tracing::debug!(request_id = %id, "wire version mismatch");
            }
            // The reply must be readable by the frontend that sent the request, not only by
            // the configured line: an `EngineCoreOutput` holding just the request id, no
            // tokens and the finish reason has the same layout on every line (the fields that
            // differ all come later and are trimmed), so vLLM's `error` field is added only
            // when every line the frontend may be has it. A reply in the configured layout
            // kills an older vllm-rs's output dispatcher, which then fails every request.
            let error =
                (!likely.is_empty() && likely.iter().all(|l| l.has_output_error())).then(|| {
                    RequestError {
                        code: "version_mismatch".into(),
                        message: msg,
                        retryable: false,
                    }
                });
            self.reject(out, client, id, FinishReason::Error, error, now);
            return;
        }
        if self.shutting_down {
            tracing::info!(request_id = %id, "engine is shutting down: request aborted");
            self.reject(out, client, id, FinishReason::Abort, None, now);
            return;
        }
        if self.util.rejects_new_requests() {
            let msg = "Generation is paused. Please retry after it resumes.";
            self.reject_error(out, client, id, "engine_paused", msg, true, now);
            return;
        }
        let pooling = self.cfg.runner == Runner::Pooling;
        match (&req.sampling_params, pooling) {
            (None, false) => {
                let msg = "a pooling request reached a generating engine: start play with --runner pooling (and the frontend with --runner pooling) to serve embeddings";
                self.reject_error(out, client, id, "validation_error", msg, false, now);
                return;
            }
            (Some(_), true) => {
                let msg = "a generation request reached a pooling engine (--runner pooling): it only serves embeddings";
                self.reject_error(out, client, id, "validation_error", msg, false, now);
                return;
            }
            _ => {}
        }
        if self.batch.contains(id) || self.compiling.contains_key(id) {
            tracing::warn!(request_id = %id, "duplicate request id ignored");
            return;
        }
        if req.prompt_len() as u64 >= self.cfg.max_model_len {
            // vLLM's frontends refuse these; a client that does not would otherwise wait
            // forever for a request no KV cache of this size can hold
            let msg = format!(
                "the prompt has {} tokens, and this engine's maximum model length is {} (the most its KV cache holds): at least one token must be left to generate",
                req.prompt_len(),
                self.cfg.max_model_len
            );
            tracing::warn!(request_id = %id, "{msg}");
            self.reject_error(out, client, id, "validation_error", msg, false, now);
            return;
        }
        if let Some(lora) = &req.lora_request {
            // vLLM loads an adapter the first time a request names it.
            self.util.register_lora(lora.int_id, &lora.name, &lora.path);
        }
        if self.cfg.log_requests {
            tracing::info!(
                request_id = %id,
                engine = self.cfg.engine_index,
                client,
                prompt_tokens = req.prompt_len(),
                max_tokens = ?req.sampling_params.as_ref().and_then(|s| s.max_tokens),
                "request added"
            );
        }
        let shaped = if pooling {
            Ok(None)
        } else {
            self.cfg.shaping.plan(&req, self.cfg.seed)
        };
        let stream = match shaped {
            Ok(Some(job)) => {
                // its grammar compiles off the step loop; it waits (not scheduled) until
                // the grammar is ready, and the other requests keep their pace
                let request_id = id.to_string();
                let queued_at = self.input_taken_at(now);
                self.compiling.insert(
                    request_id.clone(),
                    Compiling {
                        client,
                        req,
                        queued_at,
                    },
                );
                out.compile(GrammarCompile { request_id, job });
                return;
            }
            Ok(None) => self.tokens.stream_for(&req),
            Err(msg) => {
                self.reject_structured(out, client, id, msg, now);
                return;
            }
        };
        let queued_at = self.input_taken_at(now);
        self.admit(client, req, stream, queued_at, now, out);
    }

    /// A request's structured outputs cannot be generated: finish it with the reason.
    pub(super) fn reject_structured(
        &self,
        out: &mut Outbox,
        client: u32,
        id: &str,
        msg: String,
        now: Instant,
    ) {
        tracing::warn!(request_id = %id, "{msg}");
        // `validation_error`: the one non-retryable code both frontends turn into an
        // answer that carries the message (HTTP 400); any other code reaches a vllm-rs
        // client as a bare "Internal server error"
        let msg = format!("structured_output_unsupported: {msg}");
        self.reject_error(out, client, id, "validation_error", msg, false, now);
    }

    /// A request's grammar is compiled: the request joins the waiting queue (its QUEUED
    /// event keeps its arrival), or finishes with the reason its grammar failed.
    pub(super) fn on_grammar(&mut self, ready: GrammarReady, now: Instant, out: &mut Outbox) {
        let Some(c) = self.compiling.remove(&ready.request_id) else {
            tracing::debug!(request_id = %ready.request_id, "grammar of an aborted request dropped");
            return;
        };
        match ready.result {
            Ok(stream) => self.admit(c.client, c.req, stream, c.queued_at, now, out),
            Err(msg) => {
                self.reject_structured(out, c.client, &ready.request_id, msg, now);
                self.complete_drain(now, out);
            }
        }
    }

    /// Admit a validated request whose token stream is ready: replay, the P/D role,
    /// failures and spec decoding set it up, and it joins the waiting queue as of
    /// `queued_at`.
    pub(super) fn admit(
        &mut self,
        client: u32,
        req: Box<EngineCoreRequest>,
        stream: Box<dyn crate::play::content::tokens::TokenStream>,
        queued_at: Instant,
        now: Instant,
        out: &mut Outbox,
    ) {
        let id = req.request_id.as_str();
        let pooling = self.cfg.runner == Runner::Pooling;
        let served = match self.replay.resolve(&req, stream, self.cfg.log_requests) {
            Ok(served) => served,
            Err(msg) => {
                // `validation_error`, so that the client reads why (see above)
                let msg = format!("replay_miss: {msg}");
                self.reject_error(out, client, id, "validation_error", msg, false, now);
                return;
            }
        };
        let script = served.script;
        let mut r = SimRequest::new(&req, served.stream, 0);
        if let Some((len, reason)) = served.recorded_end {
            // the stream ends where the capture did
            r.max_tokens = Some(r.max_tokens.map_or(len, |m| m.min(len)));
            r.recorded_end = Some((len, reason));
        }
        r.client = client;
        if pooling {
            r.pooling = Some(PoolingRequest::from_params(req.pooling_params.as_ref()));
        }
        r.rng = SplitMix64(request_seed(self.cfg.seed ^ 0x1f1f, &r.id));
        if let Some(f) = &self.cfg.failures {
            r.failure = f.decide_bounded(&mut r.rng, r.min_tokens, r.max_tokens);
        }
        let k = self
            .cfg
            .spec
            .map(|m| m.num_spec_tokens)
            .or_else(|| self.latency.num_spec_tokens());
        if let Some(k) = k {
            r.spec = RequestSpecTracker::for_level(self.cfg.spec_metrics, k);
        }
        r.held = self.util.holds_new_requests();
        if let Some((mean, std)) = self.cfg.fixed_ttft_ms {
            let ms = lognormal(&mut r.rng, mean, std);
            r.not_before = Some(now + sim_trace::latency::duration_from_ms(ms));
        }
        let pull = self.pd_admit(&mut r, &req);
        let id = r.id.clone();
        match script {
            Some(s) if !self.cfg.modeled_prefill => {
                // the recorded TTFT includes the recorded queueing: follow it verbatim
                for kind in [EventType::Queued, EventType::Scheduled] {
                    r.pending_events.push(EngineCoreEvent {
                        kind,
                        timestamp: instant_to_monotonic(now),
                    });
                }
                let due = now + self.scaled(s.ttft);
                self.scripts.insert(r, s, 0, due);
                return;
            }
            Some(s) => {
                r.script = Some(s);
                self.batch.insert(r, queued_at);
            }
            None => self.batch.insert(r, queued_at),
        }
        if req.abort_immediately {
            // vLLM admits and aborts at once so connector cleanup runs; no output.
            self.finish_silently(&id);
            return;
        }
        let pulling = pull.is_some();
        if let Some(p) = pull {
            out.pull(p);
        }
        if self.in_flight.is_none() {
            self.wake = Some(now);
        }
        if pulling {
            // vLLM keeps stepping while a request waits for its KV: its stats show it
            self.flush_stats(now, out);
        }
    }

    pub(super) fn on_bad_frame(
        &mut self,
        client: u32,
        error: sim_protocol::decode::DecodeError,
        now: Instant,
        out: &mut Outbox,
    ) {
        let ctx = &error.context;
        let loud = self.bad_frames.note(now);
        match (ctx.request_type, &ctx.request_id, ctx.call_id) {
            (Some(sim_protocol::RequestType::Add), Some(id), _) => {
                if loud {
                    tracing::error!(request_id = %id, client, "rejecting an undecodable ADD: {error}");
                }
                let client = ctx.client_index.unwrap_or(client);
                let id = id.clone();
                let msg = error.to_string();
                self.reject_error(out, client, &id, "invalid_request", msg, false, now);
            }
            (Some(sim_protocol::RequestType::Utility), _, Some(call_id)) => {
                let method = ctx.method.clone().unwrap_or_else(|| "<unknown>".into());
                if loud {
                    tracing::error!(
                        client,
                        method,
                        "failing an undecodable utility call: {error}"
                    );
                }
                let client = ctx.client_index.unwrap_or(client);
                let msg = format!("Call to {method} method failed: {error}");
                self.reply(out, client, call_id, Err(msg), now);
            }
            _ if loud => {
                tracing::error!(client, "dropping an undecodable frame: {error}");
            }
            _ => {}
        }
    }
}
