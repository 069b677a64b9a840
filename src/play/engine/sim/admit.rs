//! How a request the frontend adds is taken in: the checks it must pass (the wire line,
//! the engine's state, the runner, its prompt length), the refusals it gets otherwise (a
//! [`Reject`] with vLLM's error code), and its admission to the waiting queue once its
//! token stream is ready (at once, or after its grammar compiles). Frames that do not
//! decode are refused here too.

use std::time::Instant;

use sim_protocol::{
    EngineCoreEvent, EngineCoreOutput, EngineCoreRequest, EventType, FinishReason, VllmLine,
    describe_lines,
};

use crate::play::content::pooling::{PoolingRequest, Runner};
use crate::play::content::spec_decode::RequestSpecTracker;
use crate::play::content::tokens::{SplitMix64, TokenStream, natural_length, request_seed};
use crate::play::engine::engine_core::{GrammarCompile, GrammarReady, Outbox};
use crate::play::engine::request::SimRequest;
use crate::play::engine::timer::instant_to_monotonic;

use super::reject::{Refusal, Reject};
use super::{Compiling, SimEngine, lognormal};

impl SimEngine {
    /// Tell the frontend a request it sent will not run (an ignored duplicate is told
    /// nothing): one output finishing it, with vLLM's `RequestError` for a [`Reject`] on
    /// lines that carry one.
    pub(super) fn refuse(
        &self,
        out: &mut Outbox,
        client: u32,
        request_id: &str,
        refusal: Refusal,
        now: Instant,
    ) {
        let (reason, error) = match refusal {
            Refusal::Duplicate => return,
            Refusal::Finish(reason) => (reason, None),
            Refusal::Reject(r) => (FinishReason::Error, Some(r.request_error())),
        };
        let error = error.filter(|_| self.cfg.line.has_output_error());
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

    /// A request from the frontend (vLLM's `EngineCore.add_request`): checked, then
    /// admitted once its token stream is ready (at once, or when its grammar compiles).
    pub(super) fn on_add(
        &mut self,
        client: u32,
        req: Box<EngineCoreRequest>,
        now: Instant,
        out: &mut Outbox,
    ) {
        let client = reply_client(client, &req);
        if let Err(refusal) = self.check_add(&req) {
            self.prehashed.remove(&req.request_id);
            self.refuse(out, client, &req.request_id, refusal, now);
            return;
        }
        if let Some(lora) = &req.lora_request {
            // vLLM loads an adapter the first time a request names it.
            self.util.register_lora(lora.int_id, &lora.name, &lora.path);
        }
        if self.cfg.log_requests {
            tracing::info!(
                request_id = %req.request_id,
                engine = self.cfg.engine_index,
                client,
                prompt_tokens = req.prompt_len(),
                max_tokens = ?req.sampling_params.as_ref().and_then(|s| s.max_tokens),
                "request added"
            );
        }
        let structured = req
            .sampling_params
            .as_ref()
            .is_some_and(|sp| sp.structured_outputs.is_some());
        let job = if self.cfg.runner == Runner::Pooling {
            Ok(None)
        } else if self.synthesized_prompts && !structured {
            // what `plan` finds for a prompt that declares no tools and asks for no
            // structure: nothing, so its tokens are not read
            Ok(None)
        } else {
            self.cfg.shaping.plan(&req, self.cfg.seed)
        };
        match job.map_err(|why| self.unsupported_grammar(&req.request_id, why)) {
            Ok(Some(job)) => {
                // its grammar compiles off the step loop; it waits (not scheduled) until
                // the grammar is ready, and the other requests keep their pace
                let request_id = req.request_id.clone();
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
            }
            Ok(None) => {
                let stream = self.tokens.stream_for(&req);
                let queued_at = self.input_taken_at(now);
                self.admit(client, req, stream, queued_at, now, out);
            }
            Err(reject) => {
                self.prehashed.remove(&req.request_id);
                self.refuse(out, client, &req.request_id, reject.into(), now);
            }
        }
    }

    /// The checks a request passes before anything is planned for it, in vLLM's order:
    /// the wire line, the engine's state, the runner, a known id, the prompt length.
    fn check_add(&mut self, req: &EngineCoreRequest) -> Result<(), Refusal> {
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
            let readable = !likely.is_empty() && likely.iter().all(|l| l.has_output_error());
            return Err(if readable {
                Reject::version_mismatch(msg).into()
            } else {
                Refusal::Finish(FinishReason::Error)
            });
        }
        if self.shutting_down {
            tracing::info!(request_id = %id, "engine is shutting down: request aborted");
            return Err(Refusal::Finish(FinishReason::Abort));
        }
        if self.util.rejects_new_requests() {
            return Err(Reject::paused().into());
        }
        match (&req.sampling_params, self.cfg.runner == Runner::Pooling) {
            (None, false) => {
                return Err(Reject::invalid("a pooling request reached a generating engine: start play with --runner pooling (and the frontend with --runner pooling) to serve embeddings").into());
            }
            (Some(_), true) => {
                return Err(Reject::invalid("a generation request reached a pooling engine (--runner pooling): it only serves embeddings").into());
            }
            _ => {}
        }
        if self.batch.contains(id) || self.compiling.contains_key(id) {
            tracing::warn!(request_id = %id, "duplicate request id ignored");
            return Err(Refusal::Duplicate);
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
            return Err(Reject::invalid(msg).into());
        }
        Ok(())
    }

    /// A request's structured outputs cannot be generated: logged, and refused with why.
    fn unsupported_grammar(&self, id: &str, why: String) -> Reject {
        tracing::warn!(request_id = %id, "{why}");
        Reject::structured_output_unsupported(why)
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
            Err(why) => {
                let reject = self.unsupported_grammar(&ready.request_id, why);
                self.refuse(out, c.client, &ready.request_id, reject.into(), now);
                self.complete_drain(now, out);
            }
        }
    }

    /// Where an answer the client did not bound ends (`--natural-output-len`): its
    /// `max_tokens` reaches the end of the context, it is free text and may stop at EOS.
    /// Drawn from its own seed, so no other per-request draw moves.
    fn natural_end(&self, r: &SimRequest) -> Option<u64> {
        let mean = self.cfg.natural_output_len?;
        let unbounded = r
            .max_tokens
            .is_none_or(|m| r.prompt_len + m >= self.cfg.max_model_len);
        if !unbounded || r.eos.is_none() || !r.stream.free_text() || r.recorded_end.is_some() {
            return None;
        }
        Some(natural_length(self.cfg.seed, &r.id, mean))
    }

    /// Admit a checked request whose token stream is ready: it becomes a [`SimRequest`]
    /// and joins the waiting queue as of `queued_at`, or is refused.
    fn admit(
        &mut self,
        client: u32,
        req: Box<EngineCoreRequest>,
        stream: Box<dyn TokenStream>,
        queued_at: Instant,
        now: Instant,
        out: &mut Outbox,
    ) {
        match self.new_request(client, &req, stream, now) {
            Ok(r) => self.enqueue(r, &req, queued_at, now, out),
            Err(reject) => self.refuse(out, client, &req.request_id, reject.into(), now),
        }
    }

    /// The engine's request for `req`, served from `stream` (or a replayed record):
    /// failures, speculative decoding, a pause and a fixed TTFT set it up.
    fn new_request(
        &mut self,
        client: u32,
        req: &EngineCoreRequest,
        stream: Box<dyn TokenStream>,
        now: Instant,
    ) -> Result<SimRequest, Reject> {
        let prehashed = self.prehashed.remove(&req.request_id);
        let free_text = stream.free_text();
        let mut served = self
            .replay
            .resolve(req, stream, self.cfg.log_requests)
            .map_err(Reject::replay_miss)?;
        if let Some(n) = served.reasoning_tokens.filter(|_| free_text) {
            // generated text on a record that says how long it thought: that long, not
            // --reasoning-share, and never past the record's end
            let end = served.recorded_end.map_or(u64::MAX, |(len, _)| len);
            served.stream = self.tokens.stream_thinking(req, u64::from(n).min(end));
        }
        let mut r = SimRequest::new(req, served.stream, 0);
        if let Some(mut hashes) = prehashed
            && r.lora_key.is_none()
            && r.cache_salt.as_deref().is_none_or(str::is_empty)
        {
            // what `hash_blocks` would compute for the prompt's complete blocks
            hashes.truncate(r.tokens.len() / (self.cfg.block_size.max(1) as usize));
            r.block_hashes = hashes;
        }
        r.script = served.script;
        if let Some((len, reason)) = served.recorded_end {
            // the stream ends where the capture did
            r.max_tokens = Some(r.max_tokens.map_or(len, |m| m.min(len)));
            r.recorded_end = Some((len, reason));
        }
        r.client = client;
        if self.cfg.runner == Runner::Pooling {
            r.pooling = Some(PoolingRequest::from_params(req.pooling_params.as_ref()));
        }
        r.rng = SplitMix64(request_seed(self.cfg.seed ^ 0x1f1f, &r.id));
        r.natural_end = self.natural_end(&r);
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
        Ok(r)
    }

    /// An admitted request joins the engine: its P/D transfer starts, and it waits in the
    /// batch's queue as of `queued_at` (or follows its recorded timing verbatim).
    fn enqueue(
        &mut self,
        mut r: SimRequest,
        req: &EngineCoreRequest,
        queued_at: Instant,
        now: Instant,
        out: &mut Outbox,
    ) {
        let pull = self.pd_admit(&mut r, req);
        let id = r.id.clone();
        match r.script.take() {
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
            script => {
                r.script = script;
                self.batch.insert(r, queued_at);
            }
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
                self.refuse(out, client, &id, Reject::undecodable(msg).into(), now);
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

/// The client to answer: the one the request names, else the socket's.
fn reply_client(socket_client: u32, req: &EngineCoreRequest) -> u32 {
    if req.client_index != socket_client && req.client_index != 0 {
        req.client_index
    } else {
        socket_client.max(req.client_index)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sim_protocol::{EngineCoreRequest, SamplingParams};

    use crate::play::args::PlayArgs;
    use crate::play::config::PlayConfig;
    use crate::play::engine::offline::OfflineDriver;

    /// What the answer to a prompt declaring a tool spells, at a tool-call rate of 1, from
    /// an engine told its prompts are synthesized or not.
    fn answer(synthesized: bool) -> String {
        let mut a = PlayArgs::defaults();
        a.engine.tool_call_rate = 1.0;
        let cfg = PlayConfig::try_from(&a).expect("valid flags");
        let mut engine = cfg.build_engine(0);
        engine.set_synthesized_prompts(synthesized);
        let prompt = "<|im_start|>system\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}}\n</tools><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
        let req = EngineCoreRequest {
            request_id: "r".into(),
            prompt_token_ids: Some(cfg.vocab.encode(prompt)),
            sampling_params: Some(SamplingParams {
                max_tokens: Some(200),
                ..Default::default()
            }),
            wire_len: cfg.line.request_len(),
            ..Default::default()
        };
        let mut run = OfflineDriver::new(engine);
        run.add(Duration::ZERO, 0, req);
        let ids: Vec<u32> = run
            .run_until_idle()
            .iter()
            .flat_map(|o| &o.outputs.outputs)
            .flat_map(|x| x.new_token_ids.iter().copied())
            .collect();
        cfg.vocab.decode(&ids)
    }

    #[test]
    fn a_synthesized_prompt_declares_no_tools() {
        let read = answer(false);
        assert!(read.contains("get_weather"), "a tool call: {read}");
        let synthesized = answer(true);
        assert!(
            !synthesized.contains("get_weather"),
            "free text: {synthesized}"
        );
    }
}
