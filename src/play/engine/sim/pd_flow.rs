//! `SimEngine`'s prefill/decode handling (see `play/pd/mod.rs` for the protocol): which side
//! of a transfer a request is on, what the side channel and the pulls report, and the
//! prefill requests whose blocks stay for a decode engine.

use std::time::{Duration, Instant};

use rmpv::Value;
use sim_protocol::{EngineCoreRequest, FinishReason};

use super::SimEngine;
use super::reject::Refusal;
use crate::play::engine::engine_core::Outbox;
use crate::play::engine::request::SimRequest;
use crate::play::pd::{self, LoadFailurePolicy, PdEvent, PdRole, Pull};

impl SimEngine {
    /// P/D on admission: which side of a transfer the request is on for this engine's
    /// role, and the pull a decode request needs (vLLM's WAITING_FOR_REMOTE_KVS).
    pub(super) fn pd_admit(&self, r: &mut SimRequest, req: &EngineCoreRequest) -> Option<Pull> {
        let pd = &self.cfg.pd;
        r.remote_decode &= pd.role.prefills();
        if !r.remote_prefill {
            return None;
        }
        if !pd.role.decodes() {
            r.remote_prefill = false;
            return None;
        }
        let extra = req
            .sampling_params
            .as_ref()
            .and_then(|s| s.extra_args.as_ref());
        let params = pd::transfer_params(extra)?;
        match pd::remote_kv(params) {
            Ok(remote) => {
                if self.cfg.log_requests {
                    tracing::info!(
                        request_id = %r.id,
                        prefill_engine = %remote.engine_id,
                        prefill_request = %remote.request_id,
                        blocks = remote.block_ids.len(),
                        "waiting for remote KV: pulling it from the prefill engine"
                    );
                }
                r.awaiting_kv = true;
                Some(Pull {
                    request_id: r.id.to_string(),
                    engine_id: pd.engine_id.clone(),
                    remote,
                    timeout: crate::play::pd::side_channel::PULL_TIMEOUT,
                })
            }
            // a decode engine cannot pull without the remote fields; vLLM would leave the
            // request parked forever: prefill it here instead, and say so
            Err(msg) if pd.role == PdRole::Decode => {
                tracing::warn!(request_id = %r.id, "invalid kv_transfer_params ({msg}): this request will not use KV transfer and is prefilled locally");
                r.remote_prefill = false;
                None
            }
            // a single engine (`both`) without a prefill peer: the transfer is modeled by
            // the KV-transfer latency knobs
            Err(_) => None,
        }
    }

    /// The side channel or a pull reports.
    pub(super) fn on_pd(&mut self, ev: PdEvent, now: Instant, out: &mut Outbox) {
        match ev {
            PdEvent::Read {
                engine_id,
                request_id,
                block_ids,
                reply,
            } => {
                let answer = match self.batch.held_blocks(&request_id) {
                    Some(held)
                        if !block_ids.is_empty()
                            && block_ids.iter().any(|b| !held.contains(&(*b as usize))) =>
                    {
                        Err(format!(
                            "request {request_id} holds blocks {held:?}, not {block_ids:?}"
                        ))
                    }
                    Some(_) => Ok(self.batch.release_held(&request_id).unwrap_or(0)),
                    None => Err(format!(
                        "no KV is held for request {request_id}: unknown, already read, or its lease expired"
                    )),
                };
                match &answer {
                    Ok(n) => {
                        tracing::info!(request_id = %request_id, blocks = n, reader = %engine_id, "KV read by the decode engine: blocks freed")
                    }
                    Err(e) => tracing::warn!(reader = %engine_id, "refused a KV read: {e}"),
                }
                let _ = reply.send(answer);
                self.flush_stats(now, out);
            }
            PdEvent::Pulled {
                request_id,
                result,
                transfer,
            } => {
                if self.cfg.pd.connector_stats {
                    self.nixl_stats.record(transfer);
                }
                let policy = self.cfg.pd.failure_policy;
                let Some(r) = self.batch.get_mut(&request_id).filter(|r| r.awaiting_kv) else {
                    tracing::debug!(request_id = %request_id, "a KV pull ended for a request that is gone");
                    return;
                };
                r.awaiting_kv = false;
                let client = r.client;
                match result {
                    Ok(n) => {
                        if self.cfg.log_requests {
                            tracing::info!(request_id = %request_id, blocks = n, "remote KV pulled");
                        }
                    }
                    Err(e) if policy == LoadFailurePolicy::Recompute => {
                        tracing::warn!(request_id = %request_id, "KV load failed ({e}): recomputing the prompt locally (--kv-load-failure-policy recompute)");
                        r.remote_prefill = false;
                    }
                    Err(e) => {
                        tracing::warn!(request_id = %request_id, "KV load failed ({e}): failing the request (--kv-load-failure-policy fail)");
                        self.finish_silently(&request_id);
                        self.refuse(
                            out,
                            client,
                            &request_id,
                            Refusal::Finish(FinishReason::Error),
                            now,
                        );
                    }
                }
                self.start_step_if_idle(now);
                self.flush_stats(now, out);
            }
        }
    }

    /// A P/D prefill request stopped: it leaves the batch, its blocks stay for the decode
    /// engine (until read, or the lease ends), and its output says where they are.
    pub(super) fn finish_keeping_kv(&mut self, id: &str, now: Instant) -> Option<Value> {
        let lease = Duration::from_secs_f64(self.cfg.pd.lease_s);
        let (r, blocks) = self.batch.remove_keeping_blocks(id, now + lease)?;
        self.forget_finished(&r);
        if let Err(e) = self.data_plane.publish(id, &blocks) {
            tracing::warn!(request_id = %id, "writing the KV bytes of a prefill request: {e}");
        }
        if self.cfg.log_requests {
            tracing::info!(request_id = %id, blocks = blocks.len(), lease_s = self.cfg.pd.lease_s, data_plane = %self.data_plane.name(), "prefill done: KV kept for the decode engine");
        }
        Some(pd::prefill_params(
            &self.cfg.pd,
            self.cfg.engine_index,
            id,
            &blocks,
            r.num_computed.min(r.prompt_len).max(r.prompt_len),
            r.cached_tokens,
        ))
    }
}
