//! The best-fit knob model beside the model under test: TTFT and ITL knobs (log-normal
//! median and σ) fitted to the capture by simulation. Each knob's median starts at the
//! captured p50 with no spread; each round simulates the workload under the knobs and
//! rescales both medians by captured p50 / simulated p50 (at most ×2 a round, half steps
//! after the first rounds: under load TTFT and ITL pull on each other through the queue).
//! Once the medians are close, the spread is set once: σ² = σ²(captured) − σ²(simulated),
//! with σ = 1.4826 × the median absolute deviation of the logs, so the spread the queue
//! already adds is not counted twice. At most [`KNOB_ROUNDS`] simulations; the closest run
//! is kept. The simulated TTFT includes queueing and the decode step it shares, which the
//! knob does not: that is why it is fitted through the simulation.

use anyhow::{Context, Result, bail};
use sim_trace::stats::quantile_of;

use super::compare::{self, Sample};
use crate::inspect::simulate::workload::Workload;
use crate::inspect::simulate::{Counts, RunOptions, simulate_map};
use crate::play::EngineArgs;

/// The fitted knobs and their run.
pub(super) struct KnobFit {
    pub(super) ttft_ms: f64,
    pub(super) ttft_std_ms: f64,
    pub(super) itl_ms: f64,
    pub(super) itl_std_ms: f64,
    /// Simulations the fit ran (the kept one, the closest, may be an earlier one).
    pub(super) rounds: usize,
    /// The simulated median of each knob's metric (TTFT, ITL) over the captured one,
    /// minus 1, largest in absolute value: how far the fit is from matching.
    pub(super) miss: f64,
    pub(super) samples: Vec<Option<Sample>>,
    pub(super) counts: Counts,
}

impl KnobFit {
    pub(super) fn converged(&self) -> bool {
        self.miss <= KNOB_CONVERGED
    }

    pub(super) fn flags(&self) -> String {
        format!(
            "--time-to-first-token {} --time-to-first-token-std-dev {} --inter-token-latency {} --inter-token-latency-std-dev {}",
            self.ttft_ms, self.ttft_std_ms, self.itl_ms, self.itl_std_ms
        )
    }
}

/// The largest number of knob-fitting simulations.
const KNOB_ROUNDS: usize = 8;
/// The knob fit stops once both simulated medians are within this fraction of the
/// captured ones.
const KNOB_MATCH: f64 = 0.0025;
/// The knobs' spread is fitted once the medians are this close (or half-way through).
const SPREAD_AFTER: f64 = 0.005;
/// Full steps for the medians in the first rounds, half steps after.
const DAMP_AFTER: usize = 3;
/// A knob fit whose medians are further than this from the captured ones is reported as
/// not converged.
const KNOB_CONVERGED: f64 = 0.01;

/// Fit the TTFT and ITL knobs (with their spread) to the capture by simulation; see the
/// module docs.
pub(super) fn fit_knobs(
    work: &Workload,
    engine: &EngineArgs,
    opts: &RunOptions,
    captured: &[Option<&Sample>],
) -> Result<KnobFit> {
    let (mut t, mut g) = (Vec::new(), Vec::new());
    for s in captured.iter().flatten() {
        t.push(s.ttft_ms);
        g.extend_from_slice(&s.itl_ms);
    }
    let target = [Shape::of(&mut t), Shape::of(&mut g)];
    let Some(ttft) = target[0] else {
        bail!("the capture has no positive TTFT to fit the knobs to");
    };
    // (median, σ) of each knob's log-normal: TTFT, ITL (none without gaps)
    let mut knob = [
        (ttft.p50, 0.0),
        target[1].map_or((0.0, 0.0), |s| (s.p50, 0.0)),
    ];
    let mut best: Option<(f64, KnobFit)> = None;
    let mut ran = 0;
    let mut spread_fitted = false;
    for round in 1..=KNOB_ROUNDS {
        ran = round;
        // this run's knobs already carry the fitted spread
        let spread_final = spread_fitted;
        let (ttft_ms, ttft_std_ms) = compare::knob_of(knob[0].0, knob[0].1);
        let (itl_ms, itl_std_ms) = compare::knob_of(knob[1].0, knob[1].1);
        let mut e = engine.clone();
        e.latency_trace.clear();
        e.latency_steps.clear();
        e.time_to_first_token = round_sig(ttft_ms);
        e.time_to_first_token_std_dev = round_sig(ttft_std_ms);
        e.inter_token_latency = round_sig(itl_ms);
        e.inter_token_latency_std_dev = round_sig(itl_std_ms);
        let run = simulate_map(work, &e, opts, |r| Sample::of(&r))
            .context("simulating under the knobs")?;
        let samples: Vec<Option<Sample>> = run.records.into_iter().map(Option::flatten).collect();
        let (mut t, mut g) = (Vec::new(), Vec::new());
        for s in samples.iter().flatten() {
            t.push(s.ttft_ms);
            g.extend_from_slice(&s.itl_ms);
        }
        let got = [Shape::of(&mut t), Shape::of(&mut g)];
        let pairs: Vec<(usize, Shape, Shape)> = (0..2)
            .filter_map(|k| Some((k, target[k]?, got[k]?)))
            .collect();
        let miss = pairs
            .iter()
            .map(|(_, want, sim)| (want.p50 / sim.p50 - 1.0).abs())
            .fold(0.0, f64::max);
        // the spread, once, when the medians are close (the queue's share of the spread
        // depends on them): what the queue already adds is taken off in variance
        let fit_spread = !spread_fitted && (miss <= SPREAD_AFTER || round == KNOB_ROUNDS / 2);
        let mut spread_moved = false;
        for &(k, want, sim) in &pairs {
            // at most ×2 or ÷2 a round, and half steps (in logs) after the first rounds:
            // under load TTFT and ITL pull on each other through the queue
            let step = (want.p50 / sim.p50).clamp(0.5, 2.0);
            knob[k].0 *= if round > DAMP_AFTER {
                step.sqrt()
            } else {
                step
            };
            if fit_spread {
                let s = (knob[k].1.powi(2) + want.sigma.powi(2) - sim.sigma.powi(2))
                    .max(0.0)
                    .sqrt();
                spread_moved |= (s - knob[k].1).abs() > 1e-3;
                knob[k].1 = s;
            }
        }
        spread_fitted |= fit_spread;
        let fit = KnobFit {
            ttft_ms: e.time_to_first_token,
            ttft_std_ms: e.time_to_first_token_std_dev,
            itl_ms: e.inter_token_latency,
            itl_std_ms: e.inter_token_latency_std_dev,
            rounds: round,
            miss,
            samples,
            counts: run.counts,
        };
        // keep the closest run whose knobs have the final spread (the last one if none)
        let eligible = spread_final || (fit_spread && !spread_moved);
        let done = eligible && miss <= KNOB_MATCH;
        if eligible && best.as_ref().is_none_or(|(m, _)| miss < *m)
            || round == KNOB_ROUNDS && best.is_none()
        {
            best = Some((miss, fit));
        }
        if done {
            break;
        }
    }
    let (_, mut fit) = best.expect("the last round at least");
    fit.rounds = ran;
    Ok(fit)
}

/// What the knob fit matches: the p50 (nearest rank, as the table's) and the robust σ of
/// the logs.
#[derive(Debug, Clone, Copy)]
struct Shape {
    p50: f64,
    sigma: f64,
}

impl Shape {
    fn of(v: &mut [f64]) -> Option<Shape> {
        let p50 = quantile_of(v, 0.5).filter(|m| *m > 0.0)?;
        let (_, sigma) = compare::lognormal(v.iter().copied())?;
        Some(Shape { p50, sigma })
    }
}

/// Four significant digits: the knobs print as flags that reproduce the run.
fn round_sig(v: f64) -> f64 {
    if v <= 0.0 || !v.is_finite() {
        return 0.0;
    }
    let scale = 10f64.powi(3 - v.log10().floor() as i32);
    let r = (v * scale).round() / scale;
    // drop float noise (12.950000000000001)
    format!("{r:.6}").parse().unwrap_or(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knobs_round_to_four_significant_digits() {
        assert_eq!(round_sig(331.2345), 331.2);
        assert_eq!(round_sig(12.95049), 12.95);
        assert_eq!(round_sig(0.093_456), 0.09346);
        assert_eq!(round_sig(0.0), 0.0);
        assert_eq!(round_sig(50.0), 50.0);
    }
}
