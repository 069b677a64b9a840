//! Token sources: which token ids a request emits.
//!
//! A source creates one [`TokenStream`] per request. Streams are deterministic: a random
//! stream is seeded from the engine seed and the request (never from wall time), so the same
//! seed and the same inputs give the same tokens.

use sim_protocol::EngineCoreRequest;

/// Produces the token ids of one request, one at a time.
pub trait TokenStream: Send {
    /// The next token. `avoid` lists ids the engine's sampler would mask right now (the stop
    /// ids while `min_tokens` is not reached, as vLLM's sampler does).
    fn next_token(&mut self, avoid: &[u32]) -> u32;

    /// Why the stream cannot go on: set when a stream that must follow a grammar could not
    /// (its grammar backend failed, or left no token to take). The token `next_token`
    /// returned with it is not an answer: the engine finishes the request with an error
    /// instead of emitting it, never with `stop` on an unfinished structure.
    fn failure(&self) -> Option<&str> {
        None
    }

    /// Whether the stream is free text a model could end with EOS at any token (random
    /// ids, prose), as opposed to a structure, a recording or an echo that ends itself.
    fn free_text(&self) -> bool {
        false
    }
}

/// Creates a stream per request.
pub trait TokenSource: Send {
    fn stream_for(&self, req: &EngineCoreRequest) -> Box<dyn TokenStream>;
    fn describe(&self) -> String;

    /// `req`'s stream when its answer thinks for `tokens` tokens (a replayed record's
    /// count, between the format's markers) instead of the engine's `--reasoning-share`.
    /// A source that writes no thinking has nothing to change.
    fn stream_thinking(&self, req: &EngineCoreRequest, tokens: u64) -> Box<dyn TokenStream> {
        let _ = tokens;
        self.stream_for(req)
    }
}

/// The default lowest id random tokens use: ids 0–2 are special tokens in most vocabularies
/// (and in the embedded tiny model), and a real model rarely samples them mid-text.
pub const FIRST_RANDOM_ID: u32 = 3;

/// Uniform random ids in `[min_id, vocab_size)`, never a stop id of the request, so random
/// requests run to `max_tokens` unless a client asks otherwise.
#[derive(Debug, Clone)]
pub struct RandomTokens {
    pub seed: u64,
    pub min_id: u32,
    pub vocab_size: u32,
}

impl TokenSource for RandomTokens {
    fn stream_for(&self, req: &EngineCoreRequest) -> Box<dyn TokenStream> {
        let stops = stop_ids(req);
        Box::new(RandomStream {
            rng: SplitMix64(stream_seed(self.seed, req)),
            lo: self.min_id.min(self.vocab_size.saturating_sub(1)),
            hi: self.vocab_size.max(1),
            stops,
        })
    }

    fn describe(&self) -> String {
        format!(
            "random (seed {}, ids {}..{})",
            self.seed, self.min_id, self.vocab_size
        )
    }
}

/// The seed of one request's token stream. A client-supplied sampling seed makes the stream
/// depend on the prompt and that seed only (reproducible across runs, like vLLM's
/// per-request seed); otherwise the request id decides.
pub fn stream_seed(seed: u64, req: &EngineCoreRequest) -> u64 {
    let sp_seed = req.sampling_params.as_ref().and_then(|s| s.seed);
    let mut h = Fnv::new(seed);
    match sp_seed {
        Some(s) => {
            h.write_u64(s as u64);
            for t in req.prompt_token_ids.iter().flatten() {
                h.write_u64(u64::from(*t));
            }
        }
        None => h.write(req.request_id.as_bytes()),
    }
    h.finish()
}

fn stop_ids(req: &EngineCoreRequest) -> Vec<u32> {
    let mut v = Vec::new();
    if let Some(sp) = &req.sampling_params {
        v.extend(sp.eos_token_id);
        v.extend(sp.stop_token_ids.iter().copied());
        v.extend(sp.all_stop_token_ids.iter().copied());
    }
    v.sort_unstable();
    v.dedup();
    v
}

struct RandomStream {
    rng: SplitMix64,
    lo: u32,
    hi: u32,
    stops: Vec<u32>,
}

impl TokenStream for RandomStream {
    fn free_text(&self) -> bool {
        true
    }

    fn next_token(&mut self, _avoid: &[u32]) -> u32 {
        let span = u64::from(self.hi.saturating_sub(self.lo).max(1));
        // bounded retries: a vocabulary made only of stop ids still terminates
        let mut t = self.lo;
        for _ in 0..16 {
            t = self.lo + (self.rng.next_u64() % span) as u32;
            if self.stops.binary_search(&t).is_err() {
                break;
            }
        }
        t
    }
}

/// Echo the prompt back token by token; once it is exhausted emit the request's EOS (so the
/// request stops like a model that finished its answer), or wrap around when the request
/// has no EOS (`ignore_eos`).
#[derive(Debug, Clone, Default)]
pub struct EchoTokens {
    /// Used when a request has no prompt token ids (prompt embeddings only).
    pub fallback: Option<RandomTokens>,
}

impl TokenSource for EchoTokens {
    fn stream_for(&self, req: &EngineCoreRequest) -> Box<dyn TokenStream> {
        let prompt = req.prompt_token_ids.clone().unwrap_or_default();
        if prompt.is_empty() {
            let fb = self.fallback.clone().unwrap_or(RandomTokens {
                seed: 0,
                min_id: FIRST_RANDOM_ID,
                vocab_size: 259,
            });
            return fb.stream_for(req);
        }
        let eos = req.sampling_params.as_ref().and_then(|s| s.eos_token_id);
        Box::new(EchoStream {
            prompt,
            pos: 0,
            eos,
        })
    }

    fn describe(&self) -> String {
        "echo".to_string()
    }
}

struct EchoStream {
    prompt: Vec<u32>,
    pos: usize,
    eos: Option<u32>,
}

impl TokenStream for EchoStream {
    fn next_token(&mut self, avoid: &[u32]) -> u32 {
        // At most one pass over the prompt looking for a token the sampler allows.
        for _ in 0..=self.prompt.len() {
            let t = if self.pos >= self.prompt.len() {
                match self.eos {
                    Some(e) if !avoid.contains(&e) => {
                        self.pos = 0;
                        return e;
                    }
                    _ => {
                        self.pos = 0;
                        continue;
                    }
                }
            } else {
                self.prompt[self.pos]
            };
            self.pos += 1;
            if !avoid.contains(&t) {
                return t;
            }
        }
        // every prompt token is masked: emit the first one that is not a stop id, if any
        self.prompt
            .iter()
            .copied()
            .find(|t| !avoid.contains(t))
            .unwrap_or(FIRST_RANDOM_ID)
    }
}

/// Recorded token ids, served in order (`--replay-tokens`). The engine ends the request
/// at the recorded length; past it (which only a request that outlives its record can
/// ask for) the stream falls back to `after`.
pub struct RecordedStream {
    pub ids: Vec<u32>,
    pub pos: usize,
    pub after: Box<dyn TokenStream>,
}

impl TokenStream for RecordedStream {
    fn next_token(&mut self, avoid: &[u32]) -> u32 {
        // the recorded run's sampler already applied the same masks: serve verbatim
        match self.ids.get(self.pos) {
            Some(&t) => {
                self.pos += 1;
                t
            }
            None => self.after.next_token(avoid),
        }
    }

    fn failure(&self) -> Option<&str> {
        self.after.failure()
    }
}

/// A per-request seed: the engine seed mixed with the request id (stable across runs).
pub fn request_seed(seed: u64, request_id: &str) -> u64 {
    let mut h = Fnv::new(seed);
    h.write(request_id.as_bytes());
    h.finish()
}

/// The natural length of an answer the client did not bound (`--natural-output-len`,
/// mean `mean`): exponential, at least one token, drawn from the request's own seed so no
/// other per-request draw moves. The engine ends the answer there; the thinking block of
/// `--reasoning-share` is sized from the same draw.
pub fn natural_length(seed: u64, request_id: &str, mean: u64) -> u64 {
    let mut rng = SplitMix64(request_seed(seed ^ 0x6e61_7475, request_id));
    let u = ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    1 + (-(mean as f64) * u.ln()) as u64
}

/// FNV-1a, for seeding (stable across platforms and releases, unlike `DefaultHasher`).
struct Fnv(u64);

impl Fnv {
    fn new(seed: u64) -> Self {
        let mut h = Self(0xcbf2_9ce4_8422_2325);
        h.write_u64(seed);
        h
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.write(&v.to_le_bytes());
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// SplitMix64: tiny, fast, good enough for token ids.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [0, n) for n ≥ 1 (multiply-shift; the bias is below 2^-32 for any n
    /// this engine uses).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sim_protocol::SamplingParams;

    fn req(id: &str, prompt: &[u32], eos: Option<u32>, stops: &[u32]) -> EngineCoreRequest {
        EngineCoreRequest {
            request_id: id.to_string(),
            prompt_token_ids: Some(prompt.to_vec()),
            sampling_params: Some(SamplingParams {
                eos_token_id: eos,
                stop_token_ids: stops.to_vec(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn take(s: &mut dyn TokenStream, n: usize) -> Vec<u32> {
        (0..n).map(|_| s.next_token(&[])).collect()
    }

    #[test]
    fn random_is_deterministic_per_seed_and_request() {
        let src = RandomTokens {
            seed: 7,
            min_id: 3,
            vocab_size: 259,
        };
        let a = take(&mut *src.stream_for(&req("a", &[5], Some(2), &[0])), 50);
        let a2 = take(&mut *src.stream_for(&req("a", &[5], Some(2), &[0])), 50);
        let b = take(&mut *src.stream_for(&req("b", &[5], Some(2), &[0])), 50);
        assert_eq!(a, a2);
        assert_ne!(a, b);
        assert!(a.iter().all(|t| (3..259).contains(t)));
        let other_seed = RandomTokens {
            seed: 8,
            min_id: 3,
            vocab_size: 259,
        };
        assert_ne!(
            a,
            take(
                &mut *other_seed.stream_for(&req("a", &[5], Some(2), &[0])),
                50
            )
        );
    }

    #[test]
    fn random_never_draws_stop_ids() {
        let src = RandomTokens {
            seed: 1,
            min_id: 3,
            vocab_size: 6,
        };
        let toks = take(&mut *src.stream_for(&req("x", &[], Some(4), &[5])), 200);
        assert!(toks.iter().all(|t| *t == 3), "{toks:?}");
    }

    #[test]
    fn echo_returns_the_prompt_then_eos_or_wraps() {
        let src = EchoTokens::default();
        let mut s = src.stream_for(&req("e", &[10, 11, 12], Some(2), &[]));
        assert_eq!(take(&mut *s, 5), vec![10, 11, 12, 2, 10]);
        let mut s = src.stream_for(&req("e", &[10, 11], None, &[]));
        assert_eq!(take(&mut *s, 5), vec![10, 11, 10, 11, 10]);
    }

    #[test]
    fn echo_respects_min_tokens_masking() {
        let src = EchoTokens::default();
        let mut s = src.stream_for(&req("e", &[10, 2, 12], Some(2), &[]));
        // id 2 masked: skipped, then eos after the prompt masked too: wraps
        let got: Vec<u32> = (0..4).map(|_| s.next_token(&[2])).collect();
        assert_eq!(got, vec![10, 12, 10, 12]);
    }
}
