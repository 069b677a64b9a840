//! One request inside the simulated engine, and vLLM's stop rules for it.

use sim_protocol::{EngineCoreEvent, EngineCoreRequest, FinishReason, StopReason};

use super::block_hash::{BlockHash, ExtraKey};
use crate::play::content::failures::InjectedFailure;
use crate::play::content::spec_decode::RequestSpecTracker;
use crate::play::content::tokens::{SplitMix64, TokenStream};

/// A token drawn by [`SimRequest::generate_one`], and the stop it triggered.
pub type Generated = (u32, Option<(FinishReason, Option<StopReason>)>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Waiting,
    Running,
}

pub struct SimRequest {
    pub id: sim_protocol::RequestId,
    /// A stable 64-bit key of the id (for latency models that keep per-request state).
    pub key: u64,
    pub client: u32,
    pub prompt_len: u64,
    /// `None`: no `max_tokens` limit, only the model length stops it.
    pub max_tokens: Option<u64>,
    pub min_tokens: u64,
    pub eos: Option<u32>,
    pub stop_token_ids: Vec<u32>,
    /// What the sampler masks while `min_tokens` is not reached (`_all_stop_token_ids`).
    pub masked_until_min: Vec<u32>,
    pub stream: Box<dyn TokenStream>,
    pub num_output: u64,
    /// Queue order (see `WaitingKey::seq`).
    pub seq: i64,
    /// Its place in the waiting queue while it waits (the batch sets it).
    pub wait_key: (i64, i64, i64),
    pub priority: i64,
    pub phase: Phase,
    /// Arrived while the scheduler was pausing/paused: not admitted until resumed.
    pub held: bool,
    /// Events not yet delivered (attached to the request's next output).
    pub pending_events: Vec<EngineCoreEvent>,
    /// Whether the first output (with prefill stats) went out.
    pub started: bool,
    pub lora_name: Option<String>,
    pub lora_id: Option<i64>,
    /// The LoRA extra key of every block hash (vLLM keys blocks by adapter).
    pub lora_key: Option<ExtraKey>,
    pub cache_salt: Option<String>,
    /// Prompt then output token ids (what the KV cache holds once computed).
    pub tokens: Vec<u32>,
    /// Tokens whose KV is computed (vLLM's `num_computed_tokens`).
    pub num_computed: u64,
    /// KV blocks held, in order.
    pub blocks: Vec<usize>,
    /// Chained hashes of the full blocks of `tokens` computed so far.
    pub block_hashes: Vec<BlockHash>,
    /// Leading blocks already registered in the prefix cache.
    pub cached_blocks: usize,
    pub num_preemptions: u64,
    /// Prompt tokens that were prefix-cache hits at first admission.
    pub cached_tokens: u64,
    /// Per-request randomness (logprobs, speculative acceptance, failures).
    pub rng: SplitMix64,
    /// `logprobs` / `prompt_logprobs` asked for (vLLM's `SamplingParams`).
    pub logprobs: Option<i64>,
    pub prompt_logprobs: Option<i64>,
    pub spec: Option<RequestSpecTracker>,
    pub failure: Option<InjectedFailure>,
    /// A P/D decode-side request (`kv_transfer_params.do_remote_prefill`): its prompt KV is
    /// pulled from the prefill engine instead of computed.
    pub remote_prefill: bool,
    /// Prompt tokens that came from the remote engine.
    pub external_cached_tokens: u64,
    /// A replayed record's end: after this many output tokens the request finishes with
    /// the recorded reason (`--replay-tokens`).
    pub recorded_end: Option<(u64, FinishReason)>,
    /// Recorded timing to follow once the first token is out (`--replay-steps` with a
    /// latency model pacing the prefill).
    pub script: Option<crate::play::content::replay::Script>,
    /// A pooling request (`--runner pooling`): it ends with its embedding after the prefill.
    pub pooling: Option<crate::play::content::pooling::PoolingRequest>,
    /// P/D prefill side: `kv_transfer_params.do_remote_decode`; its KV is kept for a
    /// decode engine when it stops.
    pub remote_decode: bool,
    /// P/D decode side: the pull of its KV is under way (vLLM's WAITING_FOR_REMOTE_KVS);
    /// the request is not scheduled until it ends.
    pub awaiting_kv: bool,
    /// `--ttft-mode fixed`: not admitted before this moment.
    pub not_before: Option<std::time::Instant>,
    /// The answer's own length (`--natural-output-len`): a request the client did not
    /// bound samples EOS as this token, as a model ends its answer.
    pub natural_end: Option<u64>,
}

/// A request's prompt ids, with room for the output it may generate (up to 4,096 tokens):
/// a vector sized to the prompt would be copied whole when its first token is appended.
fn prompt_and_room(req: &EngineCoreRequest, max_tokens: Option<u32>) -> Vec<u32> {
    let room = max_tokens.map_or(0, |m| m.min(1 << 12)) as usize;
    let mut tokens = Vec::with_capacity(req.prompt_len() + room);
    match &req.prompt_token_ids {
        Some(ids) => tokens.extend_from_slice(ids),
        // prompt embeddings only: placeholders keep the lengths right
        None => tokens.resize(req.prompt_len(), 0),
    }
    tokens
}

impl SimRequest {
    pub fn new(req: &EngineCoreRequest, stream: Box<dyn TokenStream>, seq: i64) -> Self {
        let sp = req.sampling_params.clone().unwrap_or_default();
        let mut masked: Vec<u32> = sp.all_stop_token_ids.clone();
        masked.extend(sp.eos_token_id);
        masked.extend(sp.stop_token_ids.iter().copied());
        masked.sort_unstable();
        masked.dedup();
        Self {
            id: req.request_id.as_str().into(),
            key: crate::play::content::tokens::request_seed(0, &req.request_id),
            client: req.client_index,
            prompt_len: req.prompt_len() as u64,
            max_tokens: sp.max_tokens.map(u64::from),
            min_tokens: u64::from(sp.min_tokens),
            eos: if sp.ignore_eos { None } else { sp.eos_token_id },
            stop_token_ids: sp.stop_token_ids.clone(),
            masked_until_min: masked,
            stream,
            num_output: 0,
            seq,
            wait_key: (0, 0, 0),
            priority: req.priority,
            phase: Phase::Waiting,
            held: false,
            pending_events: Vec::new(),
            started: false,
            lora_name: req.lora_request.as_ref().map(|l| l.name.clone()),
            lora_id: req.lora_request.as_ref().map(|l| l.int_id),
            lora_key: req.lora_request.as_ref().map(|l| ExtraKey::Lora {
                name: l.name.clone(),
                path: l.path.clone(),
            }),
            cache_salt: req.cache_salt.clone(),
            tokens: prompt_and_room(req, sp.max_tokens),
            num_computed: 0,
            blocks: Vec::new(),
            block_hashes: Vec::new(),
            cached_blocks: 0,
            num_preemptions: 0,
            cached_tokens: 0,
            rng: SplitMix64(0),
            logprobs: sp.logprobs,
            prompt_logprobs: sp.prompt_logprobs,
            spec: None,
            failure: None,
            remote_prefill: crate::play::pd::wants_remote_prefill(
                crate::play::pd::transfer_params(sp.extra_args.as_ref()),
            ),
            external_cached_tokens: 0,
            recorded_end: None,
            script: None,
            pooling: None,
            remote_decode: crate::play::pd::wants_remote_decode(crate::play::pd::transfer_params(
                sp.extra_args.as_ref(),
            )),
            awaiting_kv: false,
            not_before: None,
            natural_end: None,
        }
    }

    /// Extend `block_hashes` to cover the first `n_blocks` full blocks.
    pub fn hash_blocks(&mut self, n_blocks: usize, block_size: usize, none: &BlockHash) {
        while self.block_hashes.len() < n_blocks {
            let i = self.block_hashes.len();
            let Some(block) = self.tokens.get(i * block_size..(i + 1) * block_size) else {
                return;
            };
            let mut extra = Vec::new();
            if let Some(k) = &self.lora_key {
                extra.push(k.clone());
            }
            if i == 0
                && let Some(s) = self.cache_salt.as_ref().filter(|s| !s.is_empty())
            {
                extra.push(ExtraKey::CacheSalt(s.clone()));
            }
            let parent = self.block_hashes.last().unwrap_or(none);
            let h = super::block_hash::hash_block(parent, block, &extra);
            self.block_hashes.push(h);
        }
    }

    /// Draw the next token the way vLLM's sampler would see it (stop ids masked before
    /// `min_tokens`), append it, and apply the engine's stop checks. `Err` says why the
    /// request's stream failed (a grammar it could not follow); nothing was appended.
    pub fn generate_one(&mut self, max_model_len: u64) -> Result<Generated, String> {
        let avoid: &[u32] = if self.num_output < self.min_tokens {
            &self.masked_until_min
        } else {
            &[]
        };
        let t = match (self.natural_end, self.eos) {
            (Some(end), Some(eos)) if self.num_output + 1 >= end.max(self.min_tokens + 1) => eos,
            _ => self.stream.next_token(avoid),
        };
        if let Some(why) = self.stream.failure() {
            return Err(why.to_string());
        }
        self.num_output += 1;
        self.tokens.push(t);
        Ok((t, self.check_stop(t, max_model_len)))
    }

    /// vLLM's `check_stop` (`vllm/v1/core/sched/utils.py`): EOS, then stop token ids, then
    /// the length limits. EOS is `_eos_token_id`, absent under `ignore_eos`.
    pub fn check_stop(
        &self,
        last: u32,
        max_model_len: u64,
    ) -> Option<(FinishReason, Option<StopReason>)> {
        if self.num_output >= self.min_tokens {
            if self.eos == Some(last) {
                return Some((FinishReason::Stop, None));
            }
            if self.stop_token_ids.contains(&last) {
                return Some((FinishReason::Stop, Some(StopReason::Token(i64::from(last)))));
            }
        }
        if let Some((len, reason)) = self.recorded_end
            && self.num_output >= len
        {
            // the record's own end: a stop token says which, an EOS says nothing
            let why = (reason == FinishReason::Stop && self.stop_token_ids.contains(&last))
                .then(|| StopReason::Token(i64::from(last)));
            return Some((reason, why));
        }
        if self.prompt_len + self.num_output >= max_model_len
            || self.max_tokens.is_some_and(|m| self.num_output >= m)
        {
            return Some((FinishReason::Length, None));
        }
        None
    }

    /// Tokens held in KV cache (prompt plus output).
    pub fn num_tokens(&self) -> u64 {
        self.prompt_len + self.num_output
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sim_protocol::SamplingParams;

    struct Fixed(Vec<u32>, usize);
    impl TokenStream for Fixed {
        fn next_token(&mut self, avoid: &[u32]) -> u32 {
            loop {
                let t = self.0[self.1 % self.0.len()];
                self.1 += 1;
                if !avoid.contains(&t) {
                    return t;
                }
            }
        }
    }

    fn make(sp: SamplingParams, prompt: u64, toks: Vec<u32>) -> SimRequest {
        let req = EngineCoreRequest {
            request_id: "r".into(),
            prompt_token_ids: Some((0..prompt as u32).map(|i| 100 + i).collect()),
            sampling_params: Some(sp),
            ..Default::default()
        };
        SimRequest::new(&req, Box::new(Fixed(toks, 0)), 0)
    }

    fn run(r: &mut SimRequest, mml: u64) -> (Vec<u32>, (FinishReason, Option<StopReason>)) {
        let mut out = vec![];
        loop {
            let (t, stop) = r.generate_one(mml).unwrap();
            out.push(t);
            if let Some(s) = stop {
                return (out, s);
            }
            assert!(out.len() < 1000);
        }
    }

    #[test]
    fn eos_stops_without_a_reason() {
        let sp = SamplingParams {
            eos_token_id: Some(2),
            max_tokens: Some(10),
            ..Default::default()
        };
        let mut r = make(sp, 4, vec![5, 6, 2, 7]);
        assert_eq!(
            run(&mut r, 2048),
            (vec![5, 6, 2], (FinishReason::Stop, None))
        );
    }

    #[test]
    fn stop_token_ids_carry_the_id() {
        let sp = SamplingParams {
            eos_token_id: Some(2),
            stop_token_ids: vec![0, 6],
            max_tokens: Some(10),
            ..Default::default()
        };
        let mut r = make(sp, 4, vec![5, 6, 2]);
        assert_eq!(
            run(&mut r, 2048),
            (vec![5, 6], (FinishReason::Stop, Some(StopReason::Token(6))))
        );
    }

    #[test]
    fn ignore_eos_runs_to_max_tokens() {
        let sp = SamplingParams {
            eos_token_id: Some(2),
            ignore_eos: true,
            max_tokens: Some(4),
            ..Default::default()
        };
        let mut r = make(sp, 4, vec![2]);
        assert_eq!(
            run(&mut r, 2048),
            (vec![2, 2, 2, 2], (FinishReason::Length, None))
        );
    }

    #[test]
    fn model_length_caps_output() {
        let sp = SamplingParams {
            max_tokens: None,
            ..Default::default()
        };
        let mut r = make(sp, 10, vec![5]);
        let (toks, why) = run(&mut r, 13);
        assert_eq!(toks.len(), 3);
        assert_eq!(why, (FinishReason::Length, None));
    }

    #[test]
    fn min_tokens_masks_stop_ids() {
        let sp = SamplingParams {
            eos_token_id: Some(2),
            all_stop_token_ids: vec![2],
            min_tokens: 3,
            max_tokens: Some(10),
            ..Default::default()
        };
        let mut r = make(sp, 4, vec![2, 5]);
        // 2 is masked for the first three tokens, then allowed
        assert_eq!(
            run(&mut r, 2048),
            (vec![5, 5, 5, 2], (FinishReason::Stop, None))
        );
    }
}
