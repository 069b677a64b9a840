//! Latency models: how long one engine step takes.
//!
//! The engine advances in steps, like vLLM: each step runs a batch of decodes (one token
//! per running request) and some prefill chunks. A model turns the step's shape into a
//! duration, so long prefills slow the decodes that share their step, as on a GPU, and
//! queueing and chunk serialisation come from the scheduler rather than from knobs.

use std::time::Duration;

/// The longest duration a trace, a model file or a flag may give, in ms: a day. Anything
/// longer is a typo or a hostile file, and is refused where it is read, naming the field.
pub const MAX_DURATION_MS: f64 = 86_400_000.0;

/// Where [`duration_from_ms`] stops: about 31,700 years, far past any refusal bound and
/// still far from overflowing an `Instant` it is added to.
const SATURATE_SECS: f64 = 1e12;

/// `ms` milliseconds as a duration, never panicking: negative and NaN give zero, values past
/// about 31,700 years (infinity included) stop there. Bounds are checked where values are
/// read (see [`MAX_DURATION_MS`]); this is the last line of defence behind them.
pub fn duration_from_ms(ms: f64) -> Duration {
    secs_to_duration(ms / 1e3)
}

/// `secs` seconds as a duration, with the saturation of [`duration_from_ms`].
pub fn secs_to_duration(secs: f64) -> Duration {
    if secs.is_nan() || secs <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(secs.min(SATURATE_SECS)).unwrap_or(Duration::ZERO)
}

/// A number for a message: as written when it is of a readable size, else in scientific
/// notation (`1e300`, not three hundred digits).
pub fn show_number(v: f64) -> String {
    if v != 0.0 && v.is_finite() && !(1e-4..1e12).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// Whether `ms` is a duration a trace or model may hold: finite and at most
/// [`MAX_DURATION_MS`] in size (small negative values, clock jitter, read as zero).
pub fn is_sane_ms(ms: f64) -> bool {
    ms.is_finite() && ms.abs() <= MAX_DURATION_MS
}

/// One prefill chunk scheduled in a step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefillChunk {
    /// Tokens computed in this chunk.
    pub tokens: u64,
    /// Tokens of the request already in KV cache before the chunk (cached + earlier chunks).
    pub context: u64,
    /// Prompt tokens of the whole request (cached ones included): a chunk's share of the
    /// TTFT knob is `tokens / uncached_prompt`, so cache hits shorten the first token.
    pub uncached_prompt: u64,
}

/// One running request that decodes in a step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeSlot {
    /// Tokens of the request already in KV cache (prompt and output so far): the context
    /// this decode attends over.
    pub context: u64,
    /// A stable key of the request, for models that keep per-request state (a request
    /// that drew a slow donor stays slow). Not an index: compare for equality only.
    pub request_key: u64,
}

/// An engine idle at least this long before a step starts the step from idle, ms: the
/// CPU engine's worker threads have gone to sleep by then, and waking them costs the step
/// a millisecond or two (captured: a lone 128-token prefill 12.3 ms within 2 ms of the
/// previous step, 13.2–14.4 ms after 5 ms or more).
pub const IDLE_WAKE_MS: u64 = 5;

/// What ran in one step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Running requests that decode in this step, in batch order.
    pub decodes: Vec<DecodeSlot>,
    /// Prefill chunks in this step.
    pub prefills: Vec<PrefillChunk>,
    /// Tokens whose KV is pulled from a remote (prefill) engine in this step, one entry per
    /// request (P/D disaggregation: a decode engine loads instead of computing).
    pub kv_transfers: Vec<u64>,
    /// Requests in the running batch after scheduling.
    pub running: u64,
    /// Requests still waiting after scheduling.
    pub waiting: u64,
    /// The batch capacity (`--max-num-seqs`), for load-dependent slowdowns.
    pub max_num_seqs: u64,
    /// The step's token budget (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: u64,
    /// The engine sat idle for at least [`IDLE_WAKE_MS`] before this step (a fitted model
    /// charges such a step its wake-up).
    pub after_idle: bool,
}

impl StepShape {
    /// Running requests that decode in this step.
    pub fn decode_requests(&self) -> u64 {
        self.decodes.len() as u64
    }
    /// Sum of the decodes' contexts.
    pub fn decode_context(&self) -> u64 {
        self.decodes.iter().map(|d| d.context).sum()
    }
    pub fn prefill_tokens(&self) -> u64 {
        self.prefills.iter().map(|c| c.tokens).sum()
    }
    pub fn is_empty(&self) -> bool {
        self.decodes.is_empty() && self.prefills.is_empty() && self.kv_transfers.is_empty()
    }
}

/// How one step plays out: its duration and, for models that deliver several tokens per
/// decode (speculative or block decoding seen in a capture), each decode's burst.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepTiming {
    pub duration: Duration,
    /// Tokens each decode delivers in this step, parallel to [`StepShape::decodes`]; empty
    /// means the engine's own rule (one token, or its speculative-decoding draw).
    pub decode_tokens: Vec<u32>,
}

impl StepTiming {
    /// A step of `duration` with the engine's own token counts.
    pub fn of(duration: Duration) -> Self {
        Self {
            duration,
            decode_tokens: Vec::new(),
        }
    }
}

/// The pacing contract the engine drives. The engine calls [`LatencyModel::step`] once per
/// step, when it composes the step; the result is final (a step's duration is computed
/// once and every decode in it gets that gap).
pub trait LatencyModel: Send {
    /// Duration (and decode bursts) of a step of this shape.
    fn step(&mut self, shape: &StepShape) -> StepTiming;
    /// Short description for logs.
    fn describe(&self) -> String;
    /// Whether every step takes no time (nothing to pace).
    fn is_instant(&self) -> bool {
        false
    }
    /// K of the speculative decoding this model replays (largest burst − 1), so the engine
    /// can report spec-decode stats from the bursts; `None` for autoregressive models.
    fn num_spec_tokens(&self) -> Option<u32> {
        None
    }
    /// The request with this key left the engine (finished or aborted): drop its state.
    fn forget(&mut self, _request_key: u64) {}
}

/// Everything happens as soon as possible (the default).
#[derive(Debug, Clone, Copy, Default)]
pub struct InstantLatency;

impl LatencyModel for InstantLatency {
    fn step(&mut self, _: &StepShape) -> StepTiming {
        StepTiming::of(Duration::ZERO)
    }
    fn describe(&self) -> String {
        "instant".to_string()
    }
    fn is_instant(&self) -> bool {
        true
    }
}

/// The latency knobs, in milliseconds (0 = none).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Knobs {
    /// Mean time to first token of a cold request (nothing cached) prefilled in one step;
    /// a chunk costs its share of the prompt, so cached tokens shorten it. Prefills sharing
    /// a step are batched: the step pays the largest share, not the sum.
    pub ttft_ms: f64,
    pub ttft_std_ms: f64,
    /// Mean duration of a decode step (the inter-token latency).
    pub itl_ms: f64,
    pub itl_std_ms: f64,
    /// Fixed cost of a step that contains prefill work.
    pub prefill_overhead_ms: f64,
    /// Cost per prefilled (uncached) token.
    pub prefill_per_token_ms: f64,
    /// Fixed cost of a step that pulls KV from a remote engine.
    pub kv_transfer_ms: f64,
    /// Cost per token of KV pulled from a remote engine.
    pub kv_transfer_per_token_ms: f64,
    /// Multiplier on every step at full load (running = max_num_seqs); linear in between.
    pub time_factor_under_load: f64,
    /// Divide every duration by this (e.g. 100 replays 100× faster).
    pub time_scale: f64,
}

impl Default for Knobs {
    fn default() -> Self {
        Self {
            ttft_ms: 0.0,
            ttft_std_ms: 0.0,
            itl_ms: 0.0,
            itl_std_ms: 0.0,
            prefill_overhead_ms: 0.0,
            prefill_per_token_ms: 0.0,
            kv_transfer_ms: 0.0,
            kv_transfer_per_token_ms: 0.0,
            time_factor_under_load: 1.0,
            time_scale: 1.0,
        }
    }
}

impl Knobs {
    /// Whether every step would take no time.
    pub fn is_instant(&self) -> bool {
        self.ttft_ms <= 0.0
            && self.itl_ms <= 0.0
            && self.prefill_overhead_ms <= 0.0
            && self.prefill_per_token_ms <= 0.0
            && self.kv_transfer_ms <= 0.0
            && self.kv_transfer_per_token_ms <= 0.0
    }

    pub fn validate(&self) -> Result<(), String> {
        let all = [
            ("time to first token", self.ttft_ms),
            ("time to first token std-dev", self.ttft_std_ms),
            ("inter-token latency", self.itl_ms),
            ("inter-token latency std-dev", self.itl_std_ms),
            ("prefill overhead", self.prefill_overhead_ms),
            ("prefill time per token", self.prefill_per_token_ms),
            ("KV transfer latency", self.kv_transfer_ms),
            ("KV transfer time per token", self.kv_transfer_per_token_ms),
        ];
        for (name, v) in all {
            if !(v.is_finite() && (0.0..=MAX_DURATION_MS).contains(&v)) {
                return Err(format!(
                    "{name} must be between 0 and {MAX_DURATION_MS} ms (a day), got {}",
                    show_number(v)
                ));
            }
        }
        let f = self.time_factor_under_load;
        if !(f.is_finite() && (1.0..=MAX_TIME_FACTOR).contains(&f)) {
            return Err(format!(
                "time factor under load must be between 1 and {MAX_TIME_FACTOR}, got {}",
                show_number(f)
            ));
        }
        let s = self.time_scale;
        if !(s.is_finite() && (MIN_TIME_SCALE..=MAX_TIME_SCALE).contains(&s)) {
            return Err(format!(
                "time scale must be between {MIN_TIME_SCALE} and {MAX_TIME_SCALE}, got {}",
                show_number(s)
            ));
        }
        Ok(())
    }
}

/// The smallest `--time-scale`: a thousand times slower than configured.
pub const MIN_TIME_SCALE: f64 = 1e-3;
/// The largest `--time-scale`: a million times faster than configured.
pub const MAX_TIME_SCALE: f64 = 1e6;
/// The largest `--time-factor-under-load`.
pub const MAX_TIME_FACTOR: f64 = 1e3;

/// Step durations from the knobs, with log-normal spread around the means (always
/// positive, any std-dev; no clamp that would cut the tail).
#[derive(Debug, Clone)]
pub struct KnobLatency {
    pub knobs: Knobs,
    rng: u64,
}

impl KnobLatency {
    pub fn new(knobs: Knobs, seed: u64) -> Self {
        Self {
            knobs,
            rng: seed ^ 0x5eed_1a7e_0c11_u64,
        }
    }

    fn normal(&mut self) -> f64 {
        crate::rng::standard_normal(&mut self.rng)
    }

    /// A draw with the given mean and standard deviation: the mean itself when the spread
    /// is zero, otherwise log-normal with exactly that mean and std-dev.
    pub fn draw(&mut self, mean: f64, std: f64) -> f64 {
        if mean <= 0.0 {
            return 0.0;
        }
        if std <= 0.0 {
            return mean;
        }
        let sigma2 = (1.0 + (std / mean).powi(2)).ln();
        let mu = mean.ln() - sigma2 / 2.0;
        (mu + sigma2.sqrt() * self.normal()).exp()
    }
}

impl KnobLatency {
    /// Duration of a step of this shape.
    pub fn step_duration(&mut self, shape: &StepShape) -> Duration {
        let k = self.knobs;
        let mut ms = 0.0;
        if !shape.decodes.is_empty() {
            ms += self.draw(k.itl_ms, k.itl_std_ms);
        }
        if !shape.prefills.is_empty() {
            ms += k.prefill_overhead_ms;
            let mut batched = 0.0f64;
            for c in &shape.prefills {
                ms += k.prefill_per_token_ms * c.tokens as f64;
                if k.ttft_ms > 0.0 && c.uncached_prompt > 0 {
                    let share = c.tokens as f64 / c.uncached_prompt as f64;
                    batched = batched.max(self.draw(k.ttft_ms, k.ttft_std_ms) * share.min(1.0));
                }
            }
            ms += batched;
        }
        if !shape.kv_transfers.is_empty() {
            ms += k.kv_transfer_ms
                + k.kv_transfer_per_token_ms * shape.kv_transfers.iter().sum::<u64>() as f64;
        }
        if k.time_factor_under_load > 1.0 && shape.max_num_seqs > 0 {
            let load = (shape.running as f64 / shape.max_num_seqs as f64).min(1.0);
            ms *= 1.0 + (k.time_factor_under_load - 1.0) * load;
        }
        ms /= k.time_scale;
        duration_from_ms(ms)
    }
}

impl LatencyModel for KnobLatency {
    fn step(&mut self, shape: &StepShape) -> StepTiming {
        StepTiming::of(self.step_duration(shape))
    }

    fn describe(&self) -> String {
        let k = self.knobs;
        let mut parts = vec![format!(
            "ttft {} ms (sd {}), itl {} ms (sd {})",
            k.ttft_ms, k.ttft_std_ms, k.itl_ms, k.itl_std_ms
        )];
        if k.prefill_overhead_ms > 0.0 || k.prefill_per_token_ms > 0.0 {
            parts.push(format!(
                "prefill {} ms + {} ms/token",
                k.prefill_overhead_ms, k.prefill_per_token_ms
            ));
        }
        if k.kv_transfer_ms > 0.0 || k.kv_transfer_per_token_ms > 0.0 {
            parts.push(format!(
                "KV transfer {} ms + {} ms/token",
                k.kv_transfer_ms, k.kv_transfer_per_token_ms
            ));
        }
        if k.time_factor_under_load > 1.0 {
            parts.push(format!("×{} at full load", k.time_factor_under_load));
        }
        if k.time_scale != 1.0 {
            parts.push(format!("time scale {}", k.time_scale));
        }
        format!("knobs ({})", parts.join(", "))
    }

    fn is_instant(&self) -> bool {
        self.knobs.is_instant()
    }
}

/// The model the knobs describe: instant when they are all zero.
pub fn from_knobs(knobs: Knobs, seed: u64) -> Box<dyn LatencyModel> {
    if knobs.is_instant() {
        Box::new(InstantLatency)
    } else {
        Box::new(KnobLatency::new(knobs, seed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(decodes: u64, prefills: &[(u64, u64)]) -> StepShape {
        StepShape {
            decodes: vec![DecodeSlot::default(); decodes as usize],
            prefills: prefills
                .iter()
                .map(|&(tokens, uncached_prompt)| PrefillChunk {
                    tokens,
                    context: 0,
                    uncached_prompt,
                })
                .collect(),
            running: decodes + prefills.len() as u64,
            max_num_seqs: 8,
            ..Default::default()
        }
    }

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1e3
    }

    #[test]
    fn decode_and_prefill_compose() {
        let mut m = KnobLatency::new(
            Knobs {
                ttft_ms: 40.0,
                itl_ms: 5.0,
                ..Default::default()
            },
            1,
        );
        assert!((ms(m.step_duration(&shape(3, &[]))) - 5.0).abs() < 1e-9);
        // a whole prompt in one step costs the TTFT
        assert!((ms(m.step_duration(&shape(0, &[(100, 100)]))) - 40.0).abs() < 1e-9);
        // half of a prompt costs half; decodes sharing the step wait for it
        assert!((ms(m.step_duration(&shape(2, &[(50, 100)]))) - 25.0).abs() < 1e-9);
        assert_eq!(m.step_duration(&shape(0, &[])), Duration::ZERO);
        // pulling remote KV costs its fixed latency plus per token
        let mut m2 = KnobLatency::new(
            Knobs {
                kv_transfer_ms: 3.0,
                kv_transfer_per_token_ms: 0.01,
                ..Default::default()
            },
            1,
        );
        let mut s = shape(0, &[]);
        s.kv_transfers = vec![100, 300];
        assert!((ms(m2.step_duration(&s)) - 7.0).abs() < 1e-9);
        // prefills sharing a step are batched: the largest share, not the sum
        assert!(
            (ms(m.step_duration(&shape(0, &[(10, 10), (20, 20), (5, 10)]))) - 40.0).abs() < 1e-9
        );
    }

    #[test]
    fn per_token_prefill_load_and_scale() {
        let mut m = KnobLatency::new(
            Knobs {
                itl_ms: 10.0,
                prefill_overhead_ms: 2.0,
                prefill_per_token_ms: 0.1,
                time_factor_under_load: 3.0,
                time_scale: 2.0,
                ..Default::default()
            },
            1,
        );
        let mut s = shape(1, &[(100, 100)]);
        s.running = 8; // full load: ×3
        // (10 + 2 + 10) × 3 / 2
        assert!((ms(m.step_duration(&s)) - 33.0).abs() < 1e-9);
    }

    #[test]
    fn lognormal_spread_keeps_mean_and_std() {
        let mut m = KnobLatency::new(Knobs::default(), 7);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|_| m.draw(10.0, 8.0)).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!((mean - 10.0).abs() < 0.15, "mean {mean}");
        assert!((var.sqrt() - 8.0).abs() < 0.4, "std {}", var.sqrt());
        assert!(xs.iter().all(|x| *x > 0.0));
    }

    #[test]
    fn knobs_validate() {
        assert!(Knobs::default().validate().is_ok());
        assert!(Knobs::default().is_instant());
        let bad = Knobs {
            itl_ms: -1.0,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("inter-token latency"));
        let bad = Knobs {
            time_scale: 0.0,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        // huge values are refused, not left to panic when a step is timed
        let bad = Knobs {
            ttft_ms: 1e29,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("a day"));
        let bad = Knobs {
            time_scale: 1e-300,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("time scale"));
    }

    #[test]
    fn conversion_never_panics() {
        assert_eq!(duration_from_ms(f64::NAN), Duration::ZERO);
        assert_eq!(duration_from_ms(-5.0), Duration::ZERO);
        assert_eq!(duration_from_ms(1.5), Duration::from_micros(1500));
        let huge = duration_from_ms(1e300);
        assert_eq!(huge, duration_from_ms(f64::INFINITY));
        assert!(huge > Duration::from_secs(1_000_000_000));
        let _ = std::time::Instant::now() + huge;
    }
}
