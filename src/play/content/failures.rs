//! Failure injection: a fraction of requests ends abnormally, with the finish reasons and
//! wire fields vLLM's engine uses for those endings.
//!
//! - `error`: `FinishReason.ERROR`, after 0 or a few tokens. vLLM's scheduler fails a running
//!   request (KV-load failure, encoder-cache mismatch: `v1/core/sched/scheduler.py::
//!   update_from_output`, the `error_req_ids` block) with `new_token_ids=[]` and
//!   `error=None`; the frontend then raises `GenerationError("Internal server error")`
//!   (`entrypoints/generate/base/serving.py::_raise_if_error`, HTTP 500) and counts the
//!   request under `finished_reason="error"`. A `RequestError` (0.33 `EngineCoreOutput.error`,
//!   `vllm/outputs.py`) is what the engine attaches when it turns a request away before
//!   running it (`engine_paused`, `validation_error`: `v1/engine/core.py`); the Python
//!   frontend short-circuits on it (`output_processor.py::process_outputs`: "Rejected on
//!   arrival … nothing was run", no finish stats). So an error injected before the first
//!   token carries a `RequestError`, a later one does not. vLLM has no code for an internal
//!   engine error, hence [`INJECTED_FAILURE_CODE`].
//! - `length`: `FinishReason.LENGTH` before `max_tokens` (as if the context filled up):
//!   `check_stop`'s `num_tokens >= max_model_len` branch, `stop_reason=None`.
//! - `repetition`: `FinishReason.REPETITION` with `stop_reason="repetition_detected"`, as
//!   `v1/core/sched/utils.py::check_stop` reports a `repetition_detection` hit. `check_stop`
//!   tests it after the length cap and only once `min_tokens` are out, and the shortest
//!   detectable pattern is one token seen twice, so it fires after at least
//!   `max(2, min_tokens)` tokens and before `max_tokens`.
//!
//! The engine emits the failure as the request's final output once it has produced
//! `after_tokens` tokens (with the last of them for `length`/`repetition`, with no new token
//! for `error`), instead of the tokens it would have produced next.

use sim_protocol::{FinishReason, RequestError, StopReason};

use crate::play::content::tokens::SplitMix64;

/// `RequestError.code` of an injected engine error (vLLM itself has none for this case).
pub const INJECTED_FAILURE_CODE: &str = "injected_failure";

/// `stop_reason` of a repetition stop (`check_stop`).
pub const REPETITION_STOP_REASON: &str = "repetition_detected";

/// The token horizon used when a request has no output limit: failures land within it.
const UNBOUNDED_HORIZON: u64 = 256;

/// Most tokens an `error` failure lets through before failing.
const MAX_TOKENS_BEFORE_ERROR: u64 = 4;

/// A way for a request to end abnormally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum FailureType {
    /// The engine fails the request (finish reason `error`, HTTP 500 from the frontend).
    Error,
    /// The request stops early with finish reason `length`.
    Length,
    /// The request stops with finish reason `repetition` (`repetition_detected`).
    Repetition,
}

/// Why a failure-injection configuration was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FailureConfigError {
    #[error("the failure rate must be a probability between 0 and 1, got {0}")]
    Rate(f64),
    #[error("failure injection needs at least one failure type (error, length, repetition)")]
    NoTypes,
}

/// Decides which requests fail, how, and when.
#[derive(Debug, Clone, PartialEq)]
pub struct FailureInjector {
    rate: f64,
    types: Vec<FailureType>,
}

/// One request's injected failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InjectedFailure {
    pub kind: FailureType,
    /// Tokens the request produces before it ends; for `length` and `repetition` the last
    /// of them goes out with the finish reason.
    pub after_tokens: u64,
}

impl FailureInjector {
    /// `rate` is the fraction of requests that fail (0..=1); each failing request takes one
    /// of `types` uniformly (list a type twice to weight it).
    pub fn new(rate: f64, types: Vec<FailureType>) -> Result<Self, FailureConfigError> {
        if !(0.0..=1.0).contains(&rate) {
            // also refuses NaN
            return Err(FailureConfigError::Rate(rate));
        }
        if types.is_empty() {
            return Err(FailureConfigError::NoTypes);
        }
        Ok(Self { rate, types })
    }

    pub fn rate(&self) -> f64 {
        self.rate
    }

    pub fn types(&self) -> &[FailureType] {
        &self.types
    }

    /// Whether the request fails and how. `max_tokens` is the request's output budget (its
    /// `max_tokens`, or what `max_model_len` leaves after the prompt; `None` = unbounded).
    /// Draws from `rng` (seed it per request for reproducible runs).
    pub fn decide(&self, rng: &mut SplitMix64, max_tokens: Option<u64>) -> Option<InjectedFailure> {
        self.decide_bounded(rng, 0, max_tokens)
    }

    /// [`decide`](Self::decide) for a request with `min_tokens`: a repetition stop cannot
    /// fire before them. A failure that cannot happen within the budget (a repetition with
    /// `max_tokens` ≤ `max(2, min_tokens)`) is dropped: the request ends normally.
    pub fn decide_bounded(
        &self,
        rng: &mut SplitMix64,
        min_tokens: u64,
        max_tokens: Option<u64>,
    ) -> Option<InjectedFailure> {
        if self.rate <= 0.0 || rng.unit() >= self.rate {
            return None;
        }
        let kind = self.types[rng.below(self.types.len() as u64) as usize];
        let budget = max_tokens.unwrap_or(UNBOUNDED_HORIZON).max(1);
        let after_tokens = match kind {
            // Half fail before the first token, the rest after a few, never at the budget
            // (the request would already have finished with `length`).
            FailureType::Error => {
                let most = MAX_TOKENS_BEFORE_ERROR.min(budget - 1);
                if most == 0 || rng.unit() < 0.5 {
                    0
                } else {
                    1 + rng.below(most)
                }
            }
            // Anywhere in [1, budget - 1]; a one-token budget can only end at 1.
            FailureType::Length => 1 + rng.below((budget - 1).max(1)),
            // In [max(2, min_tokens), budget - 1].
            FailureType::Repetition => {
                let first = min_tokens.max(2);
                if first >= budget {
                    return None;
                }
                first + rng.below(budget - first)
            }
        };
        Some(InjectedFailure { kind, after_tokens })
    }

    /// The final output's `finish_reason`, `stop_reason` and `error` (0.33+) for `f`.
    pub fn finish(
        &self,
        f: &InjectedFailure,
    ) -> (FinishReason, Option<StopReason>, Option<RequestError>) {
        match f.kind {
            FailureType::Error => (
                FinishReason::Error,
                None,
                (f.after_tokens == 0).then(|| RequestError {
                    code: INJECTED_FAILURE_CODE.to_string(),
                    message: "Injected engine failure (vllm-vcr failure injection).".to_string(),
                    retryable: false,
                }),
            ),
            FailureType::Length => (FinishReason::Length, None, None),
            FailureType::Repetition => (
                FinishReason::Repetition,
                Some(StopReason::Text(REPETITION_STOP_REASON.to_string())),
                None,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use FailureType::*;
    use sim_protocol::{
        DecodedOutputs, EngineCoreOutput, EngineCoreOutputs, VllmLine, decode_outputs_for,
        encode_outputs,
    };

    fn all() -> Vec<FailureType> {
        vec![Error, Length, Repetition]
    }

    #[test]
    fn observed_rate_within_three_sigma() {
        const N: u64 = 10_000;
        for (seed, rate) in [(1u64, 0.01), (2, 0.1), (3, 0.5), (4, 0.9)] {
            let inj = FailureInjector::new(rate, all()).unwrap();
            let mut rng = SplitMix64(seed);
            let failed = (0..N)
                .filter(|_| inj.decide(&mut rng, Some(100)).is_some())
                .count() as f64;
            let sigma = (N as f64 * rate * (1.0 - rate)).sqrt();
            let expected = N as f64 * rate;
            assert!(
                (failed - expected).abs() <= 3.0 * sigma,
                "rate {rate}: {failed} failures, expected {expected} ± {sigma}"
            );
        }
        let mut rng = SplitMix64(5);
        let never = FailureInjector::new(0.0, all()).unwrap();
        let always = FailureInjector::new(1.0, all()).unwrap();
        assert!((0..1000).all(|_| never.decide(&mut rng, Some(10)).is_none()));
        assert!((0..1000).all(|_| always.decide(&mut rng, Some(10)).is_some()));
    }

    #[test]
    fn every_type_is_used_and_within_bounds() {
        let inj = FailureInjector::new(1.0, all()).unwrap();
        let mut rng = SplitMix64(6);
        let mut seen = [0u32; 3];
        for i in 0..3000u64 {
            let max = 1 + i % 20;
            let Some(f) = inj.decide(&mut rng, Some(max)) else {
                // only a repetition that cannot fit is dropped
                assert!(max <= 2);
                continue;
            };
            match f.kind {
                Error => {
                    seen[0] += 1;
                    assert!(f.after_tokens <= MAX_TOKENS_BEFORE_ERROR);
                    assert!(f.after_tokens < max);
                }
                Length => {
                    seen[1] += 1;
                    assert!(f.after_tokens >= 1);
                    assert!(f.after_tokens < max || max == 1);
                }
                Repetition => {
                    seen[2] += 1;
                    assert!(f.after_tokens >= 2 && f.after_tokens < max);
                }
            }
        }
        assert!(seen.iter().all(|&n| n > 800), "{seen:?}");
        // errors before any token and after some
        let zeros = (0..1000)
            .filter_map(|_| {
                FailureInjector::new(1.0, vec![Error])
                    .unwrap()
                    .decide(&mut rng, None)
            })
            .filter(|f| f.after_tokens == 0)
            .count();
        assert!((400..600).contains(&zeros), "{zeros}");
    }

    #[test]
    fn repetition_respects_min_tokens_and_unbounded_requests() {
        let inj = FailureInjector::new(1.0, vec![Repetition]).unwrap();
        let mut rng = SplitMix64(7);
        for _ in 0..500 {
            let f = inj.decide_bounded(&mut rng, 10, Some(15)).unwrap();
            assert!((10..15).contains(&f.after_tokens), "{f:?}");
            let f = inj.decide(&mut rng, None).unwrap();
            assert!((2..UNBOUNDED_HORIZON).contains(&f.after_tokens));
        }
        assert_eq!(inj.decide_bounded(&mut rng, 10, Some(10)), None);
        assert_eq!(inj.decide(&mut rng, Some(2)), None);
        let len = FailureInjector::new(1.0, vec![Length]).unwrap();
        assert_eq!(
            len.decide(&mut rng, Some(1)),
            Some(InjectedFailure {
                kind: Length,
                after_tokens: 1
            })
        );
    }

    #[test]
    fn deterministic_per_seed() {
        let inj = FailureInjector::new(0.3, all()).unwrap();
        let run = |seed| {
            let mut rng = SplitMix64(seed);
            (0..200)
                .map(|_| inj.decide(&mut rng, Some(64)))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(11), run(11));
        assert_ne!(run(11), run(12));
    }

    #[test]
    fn validation_messages() {
        for bad in [-0.1, 1.01, f64::NAN, f64::INFINITY] {
            let e = FailureInjector::new(bad, all()).unwrap_err();
            assert!(matches!(e, FailureConfigError::Rate(_)));
            assert!(e.to_string().contains("between 0 and 1"), "{e}");
        }
        let e = FailureInjector::new(0.5, vec![]).unwrap_err();
        assert_eq!(e, FailureConfigError::NoTypes);
        assert!(e.to_string().contains("error, length, repetition"));
        assert!(FailureInjector::new(0.0, vec![Error]).is_ok());
        assert!(FailureInjector::new(1.0, vec![Error]).is_ok());
    }

    #[test]
    fn cli_names() {
        use clap::ValueEnum;
        let names: Vec<String> = FailureType::value_variants()
            .iter()
            .filter_map(|v| v.to_possible_value().map(|p| p.get_name().to_string()))
            .collect();
        assert_eq!(names, ["error", "length", "repetition"]);
        assert_eq!(FailureType::from_str("repetition", true), Ok(Repetition));
    }

    #[test]
    fn finish_fields_as_vllm_sends_them() {
        let inj = FailureInjector::new(1.0, all()).unwrap();
        let (r, s, e) = inj.finish(&InjectedFailure {
            kind: Error,
            after_tokens: 0,
        });
        assert_eq!((r, s), (FinishReason::Error, None));
        let e = e.unwrap();
        assert_eq!(e.code, INJECTED_FAILURE_CODE);
        assert!(!e.retryable && !e.message.is_empty());
        assert_eq!(
            inj.finish(&InjectedFailure {
                kind: Error,
                after_tokens: 3
            }),
            (FinishReason::Error, None, None)
        );
        assert_eq!(
            inj.finish(&InjectedFailure {
                kind: Length,
                after_tokens: 3
            }),
            (FinishReason::Length, None, None)
        );
        assert_eq!(
            inj.finish(&InjectedFailure {
                kind: Repetition,
                after_tokens: 3
            }),
            (
                FinishReason::Repetition,
                Some(StopReason::Text("repetition_detected".into())),
                None
            )
        );
    }

    #[test]
    fn finish_round_trips_on_the_wire() {
        let inj = FailureInjector::new(1.0, all()).unwrap();
        let line = VllmLine::parse("0.33").unwrap();
        for f in [
            InjectedFailure {
                kind: Error,
                after_tokens: 0,
            },
            InjectedFailure {
                kind: Repetition,
                after_tokens: 4,
            },
        ] {
            let (finish_reason, stop_reason, error) = inj.finish(&f);
            let out = EngineCoreOutputs {
                outputs: vec![EngineCoreOutput {
                    request_id: "r".into(),
                    new_token_ids: if f.after_tokens == 0 {
                        Default::default()
                    } else {
                        vec![9].into()
                    },
                    finish_reason: Some(finish_reason),
                    stop_reason: stop_reason.clone(),
                    error: error.clone().map(Box::new),
                    ..Default::default()
                }],
                timestamp: 3.0,
                ..Default::default()
            };
            let frames = encode_outputs(line, &out).unwrap();
            let DecodedOutputs::Outputs(got) = decode_outputs_for(line, &frames).unwrap() else {
                panic!("dead")
            };
            let o = &got.outputs[0];
            assert_eq!(o.finish_reason, Some(finish_reason));
            assert_eq!(o.stop_reason, stop_reason);
            assert_eq!(o.error.as_deref(), error.as_ref());
        }
    }
}
