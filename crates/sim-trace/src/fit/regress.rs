//! Fitting the law: weighted least squares with term selection.
//!
//! The noise of a step is multiplicative (a prefill step of 340 ms varies by tens of
//! milliseconds, a decode step of 13 ms by one), so the fit minimises relative errors:
//! ordinary least squares first, then twice reweighted by `1/ŷ²`.
//!
//! A term is kept only when the captures identify it:
//!
//! 1. a term that is zero in every observation never happened (no prefill depth in a
//!    capture without prefix hits or chunking, no bursts without speculative decoding),
//!    and one that is non-zero in fewer than [`MIN_SEEN`] is not fitted;
//! 2. a term the captures vary (almost) only together with earlier terms (in [`TERMS`]
//!    order) is not identifiable: the Cholesky pivot of its standardised column (almost)
//!    vanishes (the fixture's prompts all have 128 tokens at depth 0 but for one warm-up
//!    request, so depth work is a multiple of the prefilled tokens);
//! 3. a term whose coefficient is negative, or less than [`MIN_T`] standard errors from
//!    zero, is dropped, the worst first, and the rest refitted. Consecutive steps share
//!    their conditions (the fixture's decode step drifts from 14 to 12 ms over the
//!    capture), so the residuals are autocorrelated and plain standard errors too small:
//!    they are widened by `√((1 + ρ)/(1 − ρ))`, ρ the lag-1 autocorrelation of the
//!    standardised residuals in capture order.
//!
//! The intercept (`step_ms`, the fixed cost of a step) is always kept.

use serde::{Deserialize, Serialize};

use super::features::{NF, Obs, TERMS};

/// Standard errors a kept coefficient must be away from zero.
pub(crate) const MIN_T: f64 = 3.0;
/// Observations a term must be non-zero in to be fitted at all: a fixed-shape capture
/// runs a new step size only in its first few steps, whose cost is the engine warming up
/// (100 ms and more), not what a new size costs later.
const MIN_SEEN: usize = 20;
/// A squared standardised Cholesky pivot below this — less than 0.01 % of the column's
/// norm not explained by the earlier columns — makes the column (almost) a combination of
/// earlier ones: its coefficient would rest on a handful of observations. (The fixture's
/// depth work is 64 × its prefilled tokens in every observation but one warm-up request:
/// 1.4e-6.)
const COLLINEAR: f64 = 1e-4;

/// How one term fared in the selection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TermFit {
    /// The coefficient's name in [`super::StepLaw`].
    pub term: String,
    /// Whether the law uses it.
    pub kept: bool,
    /// Its coefficient over its (autocorrelation-widened) standard error, when it was fitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub t: Option<f64>,
    /// Why it was dropped (empty when kept).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub why: String,
}

/// The selected law.
pub(crate) struct Selection {
    pub coef: [f64; NF],
    pub terms: Vec<TermFit>,
    /// Lag-1 autocorrelation of the final fit's standardised residuals.
    pub rho: f64,
}

/// One weighted fit over the active columns.
struct Fit {
    coef: [f64; NF],
    /// Standard errors (autocorrelation-widened) of the active columns.
    se: [f64; NF],
    rho: f64,
}

enum Outcome {
    Fitted(Fit),
    /// This column is a combination of earlier active ones.
    Collinear(usize),
}

/// Select the terms and fit the law.
pub(crate) fn select(obs: &[Obs]) -> Selection {
    let mut active = [true; NF];
    let mut terms: Vec<TermFit> = TERMS
        .iter()
        .map(|t| TermFit {
            term: (*t).to_string(),
            kept: true,
            t: None,
            why: String::new(),
        })
        .collect();
    for j in 1..NF {
        let seen = obs.iter().filter(|o| o.x[j] != 0.0).count();
        if seen == 0 {
            active[j] = false;
            terms[j].kept = false;
            terms[j].why = "the captures never show it".into();
        } else if seen < MIN_SEEN {
            active[j] = false;
            terms[j].kept = false;
            terms[j].why =
                format!("the captures show it in {seen} observations only (fewer than {MIN_SEEN})");
        }
    }
    loop {
        let fit = match irls(obs, &active) {
            Outcome::Collinear(j) => {
                active[j] = false;
                terms[j].kept = false;
                terms[j].why = format!(
                    "not identifiable: the captures vary it (almost) only together with {}",
                    (0..j)
                        .filter(|&k| active[k])
                        .map(|k| TERMS[k])
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                continue;
            }
            Outcome::Fitted(f) => f,
        };
        let worst = (1..NF)
            .filter(|&j| active[j])
            .map(|j| (j, t_value(fit.coef[j], fit.se[j])))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        for j in (1..NF).filter(|&j| active[j]) {
            terms[j].t = Some(round(t_value(fit.coef[j], fit.se[j]), 2));
        }
        match worst {
            Some((j, t)) if t < MIN_T => {
                active[j] = false;
                terms[j].kept = false;
                terms[j].why = if fit.coef[j] < 0.0 {
                    format!(
                        "negative ({:.3e} ± {:.1e}): the captures do not show it costs time",
                        fit.coef[j], fit.se[j]
                    )
                } else {
                    format!("not significant (t = {t:.2} < {MIN_T})")
                };
            }
            _ => {
                terms[0].t = Some(round(t_value(fit.coef[0], fit.se[0]), 2));
                return Selection {
                    coef: fit.coef,
                    terms,
                    rho: round(fit.rho, 3),
                };
            }
        }
    }
}

fn t_value(coef: f64, se: f64) -> f64 {
    if se > 0.0 && se.is_finite() {
        coef / se
    } else if se == 0.0 && coef > 0.0 {
        f64::INFINITY
    } else {
        0.0
    }
}

fn round(v: f64, digits: i32) -> f64 {
    if !v.is_finite() {
        return v;
    }
    let p = 10f64.powi(digits);
    (v * p).round() / p
}

/// The law's value for features `x`.
pub(crate) fn predict(coef: &[f64; NF], x: &[f64; NF]) -> f64 {
    coef.iter().zip(x).map(|(c, v)| c * v).sum()
}

/// Ordinary least squares, then two passes reweighted by `1/ŷ²`.
fn irls(obs: &[Obs], active: &[bool; NF]) -> Outcome {
    // ŷ is floored: an observation the current fit predicts near zero must not take all
    // the weight
    let floor = {
        let mut ys: Vec<f32> = obs.iter().map(|o| o.y).collect();
        let k = ys.len() / 100;
        *ys.select_nth_unstable_by(k, f32::total_cmp).1 as f64
    };
    let mut coef: Option<[f64; NF]> = None;
    let mut last = None;
    for _ in 0..3 {
        let weight = |o: &Obs| -> f64 {
            let w = f64::from(o.weight);
            match &coef {
                None => w,
                Some(c) => {
                    let y = predict(c, &o.xf()).max(floor);
                    w / (y * y)
                }
            }
        };
        match wls(obs, active, weight) {
            Outcome::Collinear(j) => return Outcome::Collinear(j),
            Outcome::Fitted(f) => {
                coef = Some(f.coef);
                last = Some(f);
            }
        }
    }
    Outcome::Fitted(last.expect("three passes"))
}

/// Weighted least squares over the active columns, standardised so the collinearity test
/// does not depend on units.
fn wls(obs: &[Obs], active: &[bool; NF], weight: impl Fn(&Obs) -> f64) -> Outcome {
    let cols: Vec<usize> = (0..NF).filter(|&j| active[j]).collect();
    let p = cols.len();
    let mut xtx = vec![0.0; p * p];
    let mut xty = vec![0.0; p];
    for o in obs {
        let w = weight(o);
        let x = o.xf();
        let y = f64::from(o.y);
        for (a, &ja) in cols.iter().enumerate() {
            let wx = w * x[ja];
            xty[a] += wx * y;
            for (b, &jb) in cols.iter().enumerate().take(a + 1) {
                xtx[a * p + b] += wx * x[jb];
            }
        }
    }
    for a in 0..p {
        for b in 0..a {
            xtx[b * p + a] = xtx[a * p + b];
        }
    }
    // standardise: unit diagonal
    let scale: Vec<f64> = (0..p).map(|a| xtx[a * p + a].sqrt().max(1e-300)).collect();
    let mut m = xtx;
    for a in 0..p {
        for b in 0..p {
            m[a * p + b] /= scale[a] * scale[b];
        }
    }
    if let Err(a) = cholesky(&mut m, p) {
        return Outcome::Collinear(cols[a]);
    }
    let rhs: Vec<f64> = (0..p).map(|a| xty[a] / scale[a]).collect();
    let beta_s = solve(&m, p, &rhs);
    let mut coef = [0.0; NF];
    for (a, &j) in cols.iter().enumerate() {
        coef[j] = beta_s[a] / scale[a];
    }
    // residual scale and autocorrelation, in capture order
    let (mut rss, mut lag, mut prev) = (0.0, 0.0, None::<f64>);
    for o in obs {
        let w = weight(o);
        let e = w.sqrt() * (f64::from(o.y) - predict(&coef, &o.xf()));
        rss += e * e;
        if let Some(p) = prev {
            lag += e * p;
        }
        prev = Some(e);
    }
    let n_eff = obs.iter().filter(|o| weight(o) > 0.0).count();
    let dof = n_eff.saturating_sub(p);
    let sigma2 = if dof > 0 {
        rss / dof as f64
    } else {
        f64::INFINITY
    };
    let rho = if rss > 0.0 {
        (lag / rss).clamp(0.0, 0.98)
    } else {
        0.0
    };
    let widen = ((1.0 + rho) / (1.0 - rho)).sqrt();
    let mut se = [0.0; NF];
    for (a, &j) in cols.iter().enumerate() {
        let mut e = vec![0.0; p];
        e[a] = 1.0;
        let inv = solve(&m, p, &e)[a];
        se[j] = (sigma2 * inv).sqrt() / scale[a] * widen;
    }
    Outcome::Fitted(Fit { coef, se, rho })
}

/// In-place Cholesky (lower triangle) of a unit-diagonal matrix; `Err(column)` when a
/// pivot vanishes (that column is a combination of the earlier ones).
fn cholesky(m: &mut [f64], p: usize) -> Result<(), usize> {
    for j in 0..p {
        let mut d = m[j * p + j];
        for k in 0..j {
            d -= m[j * p + k] * m[j * p + k];
        }
        if d <= COLLINEAR {
            return Err(j);
        }
        let d = d.sqrt();
        m[j * p + j] = d;
        for i in j + 1..p {
            let mut v = m[i * p + j];
            for k in 0..j {
                v -= m[i * p + k] * m[j * p + k];
            }
            m[i * p + j] = v / d;
        }
    }
    Ok(())
}

/// Solve `L Lᵀ x = b` with the factor in the lower triangle of `m`.
fn solve(m: &[f64], p: usize, b: &[f64]) -> Vec<f64> {
    let mut y = b.to_vec();
    for i in 0..p {
        for k in 0..i {
            y[i] -= m[i * p + k] * y[k];
        }
        y[i] /= m[i * p + i];
    }
    for i in (0..p).rev() {
        for k in i + 1..p {
            y[i] -= m[k * p + i] * y[k];
        }
        y[i] /= m[i * p + i];
    }
    y
}
