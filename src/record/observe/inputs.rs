//! The observer's side of what the frontend sends: the engine's ready response, and each
//! ADD (or abort) decoded into the request it starts following.

use bytes::Bytes;
use rmpv::Value;
use sim_protocol::decode::decode_input_with;
use sim_protocol::transport::identity_rank;
use sim_protocol::{EngineCoreRequest, FinishReason, InputMessage, ReadyResponse, VllmLine};
use sim_trace::trace::BlockHash;

use crate::play::engine::block_hash::{self, ExtraKey};

use super::{Observer, Req};

impl Observer {
    pub(super) fn on_ready(&mut self, engine: &[u8], client: usize, payload: &[u8]) {
        if self.meta.ready_response_hex.is_some() {
            return;
        }
        tracing::debug!(client, engine = ?engine, "observing the ready response");
        self.meta.ready_response_hex = Some(hex(payload));
        match ReadyResponse::decode(payload) {
            Ok(r) => {
                if !r.vllm_version.is_empty() {
                    self.meta.vllm_version = Some(r.vllm_version.clone());
                }
                self.line = VllmLine::parse_any(&r.vllm_version).ok();
                let o = &self.cfg.meta;
                self.meta.block_size = o.block_size.or(u32::try_from(r.block_size).ok());
                self.meta.tp = o.tp.or(u32::try_from(r.tensor_parallel_size).ok());
                self.meta.max_num_seqs = o.max_num_seqs.or(u32::try_from(r.max_num_seqs).ok());
                if let Some(bs) = self.meta.block_size.filter(|&b| b > 0) {
                    self.block_size = bs as usize;
                }
                tracing::info!(
                    vllm_version = %r.vllm_version,
                    block_size = self.block_size,
                    num_gpu_blocks = r.num_gpu_blocks,
                    "engine attached"
                );
                // the meta line goes to disk now, so a capture that later fills the disk
                // still leaves a readable trace
                self.ensure_meta();
                self.flush();
            }
            Err(e) => tracing::warn!(
                "cannot decode the engine's ready response ({e}); relayed unchanged, meta keeps only its hex"
            ),
        }
    }

    pub(super) fn on_input(&mut self, t: f64, client: usize, engine: &[u8], frames: &[Bytes]) {
        let limits = sim_protocol::decode::DecodeLimits {
            max_frame_bytes: self.cfg.max_frame_bytes,
            ..Default::default()
        };
        match decode_input_with(frames, &limits) {
            Ok(InputMessage::Add(req)) => self.on_add(t, engine, &req),
            Ok(InputMessage::Abort(ids)) => {
                for id in ids {
                    if self.reqs.contains_key(&id) {
                        self.finalize(
                            &id,
                            Some(FinishReason::Abort),
                            Some("aborted by the frontend".into()),
                        );
                    }
                }
            }
            Ok(InputMessage::Utility(call)) => {
                tracing::debug!(client, method = %call.method, "utility call relayed");
            }
            Ok(InputMessage::StartDpWave { .. }) => {}
            Err(e) => self.undecodable(&format!("a frontend message on client {client}: {e}")),
        }
    }

    pub(super) fn undecodable(&mut self, what: &str) {
        self.summary.undecodable += 1;
        if self.summary.undecodable <= 5 {
            tracing::warn!("relayed unchanged but cannot decode {what}");
        }
    }

    fn on_add(&mut self, t: f64, engine: &[u8], req: &EngineCoreRequest) {
        if self.zero.is_none() {
            self.zero = Some(t);
        }
        if self.reqs.contains_key(&req.request_id) {
            self.finalize(
                &req.request_id,
                None,
                Some("replaced by a new request with the same id".into()),
            );
        }
        let block_hashes = match &req.prompt_token_ids {
            Some(ids) => {
                let lora = req.lora_request.as_ref().map(|l| ExtraKey::Lora {
                    name: l.name.clone(),
                    path: l.path.clone(),
                });
                block_hash::chain(
                    &self.none_hash,
                    ids,
                    self.block_size,
                    lora.as_ref(),
                    req.cache_salt.as_deref(),
                )
                .iter()
                .map(|h| BlockHash::Int(block_hash::hash_u64(h)))
                .collect()
            }
            None => Vec::new(),
        };
        let rank = identity_rank(engine)
            .map(u32::from)
            .or_else(|| req.data_parallel_rank.and_then(|r| u32::try_from(r).ok()))
            .unwrap_or(0);
        let concurrency = self.reqs.len() as u32 + 1;
        self.reqs.insert(
            req.request_id.clone(),
            Req {
                engine: rank,
                relayed: t,
                queued: None,
                prompt_tokens: req.prompt_len() as u32,
                cached_tokens: None,
                output_tokens: 0,
                first_token: None,
                last_chunk: t,
                itl_ms: Vec::new(),
                itl_tokens: Vec::new(),
                num_running: Vec::new(),
                prefill_tokens: Vec::new(),
                concurrency,
                block_hashes,
                mm_hashes: mm_hashes(req.mm_features.as_ref()),
                token_ids: self.cfg.record_tokens.then(Vec::new),
                thinking: self
                    .cfg
                    .thinking
                    .as_ref()
                    .map(|_| super::ThinkingCount::default()),
                error: None,
            },
        );
    }
}

/// `mm_hash` (else `identifier`) of every multimodal feature of an ADD.
pub(super) fn mm_hashes(features: Option<&Value>) -> Vec<String> {
    let Some(Value::Array(items)) = features else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|item| {
            let Value::Map(m) = item else { return None };
            let get = |key: &str| {
                m.iter()
                    .find(|(k, _)| k.as_str() == Some(key))
                    .and_then(|(_, v)| v.as_str())
                    .map(str::to_string)
            };
            get("mm_hash").or_else(|| get("identifier"))
        })
        .collect()
}

fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        s.push(char::from_digit(u32::from(x >> 4), 16).unwrap_or('0'));
        s.push(char::from_digit(u32::from(x & 0xf), 16).unwrap_or('0'));
    }
    s
}
