//! Speculative decoding as vLLM reports it: how many drafts a step accepts, the per-step
//! `SpecDecodingStats` (in `SchedulerStats`) and the per-request `RequestSpecDecodeMetrics`
//! (on a request's final `EngineCoreOutput`, 0.29+).
//!
//! How vLLM's engine uses these (`v1/core/sched/scheduler.py`):
//! - A request's first step (its prefill) verifies no drafts and yields one token. After
//!   every step the drafter proposes up to K tokens, so each later step verifies
//!   `num_draft_tokens` drafts (K, or fewer near `max_model_len`) and yields `1 + accepted`
//!   tokens: the accepted drafts plus the target model's own (bonus or correcting) token.
//! - `update_from_output` computes `num_accepted = len(generated) - 1` *before* stop
//!   checks trim the tokens, and feeds it to both the step's stats
//!   (`make_spec_decoding_stats` → [`SpecStepStats`]) and the request's metrics
//!   (`request.spec_decode_metrics.observe` → [`RequestSpecTracker`]).
//! - The step's `SpecDecodingStats` is `None` when no request verified drafts in it.
//! - The request's metrics exist only when `--per-request-spec-decode-metrics` is not
//!   `none` (`add_request`), and ride on the output that carries `finish_reason`.

use sim_protocol::{RequestSpecDecodeMetrics, SpecDecodingStats};

use crate::play::content::tokens::SplitMix64;

/// Why a speculative-decoding configuration was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecConfigError {
    #[error(
        "the number of speculative tokens must be at least 1 (leave speculative decoding off instead of asking for 0)"
    )]
    NoSpecTokens,
    #[error("the draft acceptance rate must be a probability between 0 and 1, got {0}")]
    AcceptanceRate(f64),
}

/// A drafter with a fixed per-position acceptance probability: draft `i` is accepted with
/// probability `acceptance_rate` if every draft before it was (rejection sampling stops at
/// the first rejected draft), so `P(accepted ≥ i) = acceptance_rate^i`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpecModel {
    /// K, vLLM's `num_speculative_tokens`.
    pub num_spec_tokens: u32,
    /// Per-position conditional acceptance probability, 0..=1.
    pub acceptance_rate: f64,
}

impl SpecModel {
    /// A validated model.
    pub fn new(num_spec_tokens: u32, acceptance_rate: f64) -> Result<Self, SpecConfigError> {
        if num_spec_tokens == 0 {
            return Err(SpecConfigError::NoSpecTokens);
        }
        if !(0.0..=1.0).contains(&acceptance_rate) {
            // also refuses NaN
            return Err(SpecConfigError::AcceptanceRate(acceptance_rate));
        }
        Ok(Self {
            num_spec_tokens,
            acceptance_rate,
        })
    }

    /// Accepted drafts in one step that verifies all K drafts (0..=K); the step delivers
    /// `1 + accepted` tokens.
    pub fn draw(&self, rng: &mut SplitMix64) -> u32 {
        self.draw_from(rng, self.num_spec_tokens)
    }

    /// Accepted drafts out of `num_draft_tokens` (capped at K) verified drafts, for steps
    /// where vLLM schedules fewer drafts (near `max_model_len`).
    pub fn draw_from(&self, rng: &mut SplitMix64, num_draft_tokens: u32) -> u32 {
        let n = num_draft_tokens.min(self.num_spec_tokens);
        let mut accepted = 0;
        while accepted < n && rng.unit() < self.acceptance_rate {
            accepted += 1;
        }
        accepted
    }

    /// Mean accepted drafts per step: `Σ_{i=1..K} a^i`.
    pub fn expected_accepted(&self) -> f64 {
        (1..=self.num_spec_tokens)
            .map(|i| self.acceptance_rate.powi(i as i32))
            .sum()
    }
}

/// One engine step's `SpecDecodingStats`, accumulated over the requests that verified
/// drafts in it. Mirrors `v1/spec_decode/metrics.py::SpecDecodingStats` (`new`,
/// `observe_draft`) as `scheduler.py::make_spec_decoding_stats` fills it.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecStepStats {
    num_spec_tokens: u32,
    /// `None` until a request drafted (vLLM creates the stats lazily).
    stats: Option<SpecDecodingStats>,
}

impl SpecStepStats {
    pub fn new(num_spec_tokens: u32) -> Self {
        Self {
            num_spec_tokens,
            stats: None,
        }
    }

    /// A request verified all K drafts and accepted `accepted` of them.
    pub fn observe(&mut self, accepted: u32) {
        self.observe_draft(self.num_spec_tokens, accepted);
    }

    /// A request verified `num_draft_tokens` drafts and accepted `num_accepted_tokens`
    /// (`SpecDecodingStats.observe_draft`). vLLM only calls it for requests with scheduled
    /// drafts, so a call with 0 drafts is ignored; counts are capped at K (vLLM asserts).
    pub fn observe_draft(&mut self, num_draft_tokens: u32, num_accepted_tokens: u32) {
        let k = self.num_spec_tokens;
        debug_assert!(num_draft_tokens <= k && num_accepted_tokens <= num_draft_tokens);
        let drafted = num_draft_tokens.min(k);
        let accepted = num_accepted_tokens.min(drafted);
        if drafted == 0 {
            return;
        }
        let s = self.stats.get_or_insert_with(|| SpecDecodingStats {
            num_spec_tokens: u64::from(k),
            num_accepted_tokens_per_pos: vec![0; k as usize],
            num_draft_tokens_per_pos: vec![0; k as usize],
            ..Default::default()
        });
        s.num_drafts += 1;
        s.num_draft_tokens += u64::from(drafted);
        s.num_accepted_tokens += u64::from(accepted);
        for c in &mut s.num_accepted_tokens_per_pos[..accepted as usize] {
            *c += 1;
        }
        for c in &mut s.num_draft_tokens_per_pos[..drafted as usize] {
            *c += 1;
        }
    }

    /// The step's `SchedulerStats.spec_decoding_stats`: `None` if no request drafted.
    pub fn into_stats(self) -> Option<SpecDecodingStats> {
        self.stats
    }
}

/// vLLM's `--per-request-spec-decode-metrics` (`config/observability.py`): whether and how
/// a request's final output carries `spec_decode_metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SpecMetricsLevel {
    /// No per-request metrics (vLLM's default).
    #[default]
    None,
    /// Acceptance histogram and drafted-token total.
    Summary,
    /// Also the ordered accepted/drafted counts of every verify step.
    Detailed,
}

/// One request's `RequestSpecDecodeMetrics` (`v1/metrics/stats.py`): a histogram indexed by
/// accepted drafts per verify step (length K + 1), the total of drafted tokens and, at the
/// `detailed` level, the ordered per-step accepted/drafted counts.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpecTracker {
    metrics: RequestSpecDecodeMetrics,
    detailed: bool,
}

impl RequestSpecTracker {
    /// `RequestSpecDecodeMetrics.new(num_spec_tokens)`.
    pub fn new(num_spec_tokens: u32, detailed: bool) -> Self {
        Self {
            metrics: RequestSpecDecodeMetrics {
                num_spec_tokens: u64::from(num_spec_tokens),
                histogram: vec![0; num_spec_tokens as usize + 1],
                ..Default::default()
            },
            detailed,
        }
    }

    /// The tracker a request gets at admission (`scheduler.py::add_request`): none at level
    /// `none`.
    pub fn for_level(level: SpecMetricsLevel, num_spec_tokens: u32) -> Option<Self> {
        match level {
            SpecMetricsLevel::None => None,
            SpecMetricsLevel::Summary => Some(Self::new(num_spec_tokens, false)),
            SpecMetricsLevel::Detailed => Some(Self::new(num_spec_tokens, true)),
        }
    }

    /// A verify step with all K drafts, `accepted` of them accepted.
    pub fn observe(&mut self, accepted: u32) {
        let k = self.metrics.num_spec_tokens as u32;
        self.observe_draft(k, accepted);
    }

    /// `RequestSpecDecodeMetrics.observe(num_draft_tokens, num_accepted, detailed)`. Called
    /// once per step in which the request verified drafts (never for its prefill step);
    /// counts are capped at K.
    pub fn observe_draft(&mut self, num_draft_tokens: u32, accepted: u32) {
        let k = self.metrics.num_spec_tokens as u32;
        debug_assert!(num_draft_tokens <= k && accepted <= num_draft_tokens);
        let drafted = num_draft_tokens.min(k);
        let accepted = accepted.min(drafted);
        self.metrics.histogram[accepted as usize] += 1;
        self.metrics.num_draft_tokens += u64::from(drafted);
        if self.detailed {
            self.metrics.per_step_accepted.push(u64::from(accepted));
            self.metrics.per_step_drafted.push(u64::from(drafted));
        }
    }

    /// Verify steps observed so far.
    pub fn steps(&self) -> u64 {
        self.metrics.histogram.iter().sum()
    }

    /// The value for the final output's `spec_decode_metrics`.
    pub fn finish(&self) -> RequestSpecDecodeMetrics {
        self.metrics.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sim_protocol::{
        DecodedOutputs, EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats,
        VllmLine, decode_outputs_for, encode_outputs,
    };

    #[test]
    fn mean_accepted_matches_the_geometric_expectation() {
        const N: usize = 100_000;
        for (k, a) in [(1u32, 0.5), (3, 0.7), (5, 0.3), (5, 0.9), (8, 0.6)] {
            let m = SpecModel::new(k, a).unwrap();
            let mut rng = SplitMix64(u64::from(k) * 1000 + (a * 100.0) as u64);
            let mut counts = vec![0u64; k as usize + 1];
            for _ in 0..N {
                let x = m.draw(&mut rng);
                assert!(x <= k);
                counts[x as usize] += 1;
            }
            let mean = counts
                .iter()
                .enumerate()
                .map(|(j, c)| j as f64 * *c as f64)
                .sum::<f64>()
                / N as f64;
            let expected = m.expected_accepted();
            // Var = E[X²] − E[X]², E[X²] = Σ (2i − 1) a^i
            let ex2: f64 = (1..=k).map(|i| (2 * i - 1) as f64 * a.powi(i as i32)).sum();
            let sigma = ((ex2 - expected * expected) / N as f64).sqrt();
            assert!(
                (mean - expected).abs() < 5.0 * sigma,
                "K={k} a={a}: mean {mean}, expected {expected} ± {sigma}"
            );
            // P(X = j) = a^j (1 − a) for j < K, a^K for j = K
            for (j, c) in counts.iter().enumerate() {
                let p = if j < k as usize {
                    a.powi(j as i32) * (1.0 - a)
                } else {
                    a.powi(k as i32)
                };
                let sd = (p * (1.0 - p) / N as f64).sqrt();
                let f = *c as f64 / N as f64;
                assert!(
                    (f - p).abs() < 5.0 * sd + 1e-9,
                    "K={k} a={a} j={j}: {f} vs {p}"
                );
            }
        }
    }

    #[test]
    fn edge_rates_and_short_drafts() {
        let mut rng = SplitMix64(1);
        let always = SpecModel::new(4, 1.0).unwrap();
        let never = SpecModel::new(4, 0.0).unwrap();
        for _ in 0..100 {
            assert_eq!(always.draw(&mut rng), 4);
            assert_eq!(never.draw(&mut rng), 0);
            assert_eq!(always.draw_from(&mut rng, 2), 2);
            assert_eq!(always.draw_from(&mut rng, 9), 4, "capped at K");
        }
        assert_eq!(always.expected_accepted(), 4.0);
        assert_eq!(never.expected_accepted(), 0.0);
    }

    #[test]
    fn validation() {
        assert_eq!(SpecModel::new(0, 0.5), Err(SpecConfigError::NoSpecTokens));
        assert!(matches!(
            SpecModel::new(3, 1.5),
            Err(SpecConfigError::AcceptanceRate(_))
        ));
        assert!(SpecModel::new(3, -0.1).is_err());
        assert!(SpecModel::new(3, f64::NAN).is_err());
        let msg = SpecModel::new(3, 2.0).unwrap_err().to_string();
        assert!(
            msg.contains("between 0 and 1") && msg.contains('2'),
            "{msg}"
        );
    }

    #[test]
    fn deterministic_per_seed() {
        let m = SpecModel::new(5, 0.6).unwrap();
        let run = |seed| {
            let mut rng = SplitMix64(seed);
            (0..64).map(|_| m.draw(&mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn step_stats_match_observe_draft() {
        // the Python reference: SpecDecodingStats.new(3); observe_draft(3, 2); observe_draft(2, 0)
        let mut s = SpecStepStats::new(3);
        s.observe(2);
        s.observe_draft(2, 0);
        assert_eq!(
            s.into_stats(),
            Some(SpecDecodingStats {
                num_spec_tokens: 3,
                num_drafts: 2,
                num_draft_tokens: 5,
                num_accepted_tokens: 2,
                num_accepted_tokens_per_pos: vec![1, 1, 0],
                num_draft_tokens_per_pos: vec![2, 2, 1],
            })
        );
        assert_eq!(
            SpecStepStats::new(3).into_stats(),
            None,
            "no draft, no stats"
        );
        let mut s = SpecStepStats::new(3);
        s.observe_draft(0, 0);
        assert_eq!(s.into_stats(), None);
    }

    #[test]
    fn stats_add_up_over_many_steps() {
        let m = SpecModel::new(4, 0.65).unwrap();
        let mut rng = SplitMix64(99);
        let mut summary = RequestSpecTracker::new(4, false);
        let mut detailed = RequestSpecTracker::for_level(SpecMetricsLevel::Detailed, 4).unwrap();
        let (mut total_drafts, mut total_accepted, mut total_draft_tokens) = (0u64, 0u64, 0u64);
        for step in 0..500u32 {
            let mut stats = SpecStepStats::new(4);
            let mut step_accepted = 0u64;
            let requests = step % 7; // some steps have no drafting request
            for r in 0..requests {
                let drafted = if r == 0 { 1 + step % 4 } else { 4 };
                let acc = m.draw_from(&mut rng, drafted);
                stats.observe_draft(drafted, acc);
                step_accepted += u64::from(acc);
                total_drafts += 1;
                total_accepted += u64::from(acc);
                total_draft_tokens += u64::from(drafted);
                if r == 1 {
                    summary.observe(acc);
                    detailed.observe(acc);
                }
            }
            let Some(s) = stats.into_stats() else {
                assert_eq!(requests, 0);
                continue;
            };
            assert_eq!(s.num_drafts, u64::from(requests));
            assert_eq!(s.num_accepted_tokens, step_accepted);
            assert_eq!(
                s.num_accepted_tokens_per_pos.iter().sum::<u64>(),
                step_accepted
            );
            assert_eq!(
                s.num_draft_tokens_per_pos.iter().sum::<u64>(),
                s.num_draft_tokens
            );
            assert_eq!(s.num_accepted_tokens_per_pos.len(), 4);
            assert_eq!(s.num_draft_tokens_per_pos[0], s.num_drafts);
            // accepting draft i+1 requires accepting draft i
            assert!(
                s.num_accepted_tokens_per_pos
                    .windows(2)
                    .all(|w| w[0] >= w[1])
            );
            assert!(
                s.num_accepted_tokens_per_pos
                    .iter()
                    .zip(&s.num_draft_tokens_per_pos)
                    .all(|(a, d)| a <= d)
            );
        }
        assert!(total_drafts > 0 && total_accepted <= total_draft_tokens);

        let f = summary.finish();
        assert_eq!(f.num_spec_tokens, 4);
        assert_eq!(f.histogram.len(), 5);
        assert_eq!(summary.steps(), f.histogram.iter().sum::<u64>());
        assert_eq!(f.num_draft_tokens, 4 * summary.steps());
        assert!(f.per_step_accepted.is_empty() && f.per_step_drafted.is_empty());
        let d = detailed.finish();
        assert_eq!(d.histogram, f.histogram);
        assert_eq!(d.per_step_accepted.len() as u64, detailed.steps());
        assert_eq!(d.per_step_drafted, vec![4; d.per_step_accepted.len()]);
        let accepted: u64 = d.per_step_accepted.iter().sum();
        let from_hist: u64 = d
            .histogram
            .iter()
            .enumerate()
            .map(|(j, c)| j as u64 * c)
            .sum();
        assert_eq!(accepted, from_hist);
        assert!(RequestSpecTracker::for_level(SpecMetricsLevel::None, 4).is_none());
    }

    #[test]
    fn request_tracker_short_drafts() {
        let mut t = RequestSpecTracker::new(3, true);
        t.observe_draft(3, 3);
        t.observe_draft(1, 0);
        t.observe_draft(2, 1);
        let m = t.finish();
        assert_eq!(m.histogram, vec![1, 1, 0, 1]);
        assert_eq!(m.num_draft_tokens, 6);
        assert_eq!(m.per_step_accepted, vec![3, 0, 1]);
        assert_eq!(m.per_step_drafted, vec![3, 1, 2]);
    }

    #[test]
    fn round_trip_through_the_codec() {
        let line = VllmLine::parse("0.33").unwrap();
        let mut step = SpecStepStats::new(2);
        step.observe(1);
        let mut t = RequestSpecTracker::new(2, true);
        t.observe(1);
        let out = EngineCoreOutputs {
            outputs: vec![EngineCoreOutput {
                request_id: "r".into(),
                new_token_ids: vec![5, 6].into(),
                finish_reason: Some(FinishReason::Length),
                spec_decode_metrics: Some(Box::new(t.finish())),
                ..Default::default()
            }],
            scheduler_stats: Some(Box::new(SchedulerStats {
                spec_decoding_stats: step.clone().into_stats(),
                ..Default::default()
            })),
            timestamp: 2.0,
            ..Default::default()
        };
        let frames = encode_outputs(line, &out).unwrap();
        let DecodedOutputs::Outputs(got) = decode_outputs_for(line, &frames).unwrap() else {
            panic!("dead")
        };
        assert_eq!(
            got.outputs[0].spec_decode_metrics.as_deref(),
            Some(&t.finish())
        );
        assert_eq!(
            got.scheduler_stats.unwrap().spec_decoding_stats,
            step.into_stats()
        );
    }
}
