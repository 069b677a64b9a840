//! Building the model from the observations: the law, then the ratio distributions of
//! every state with enough steps.

use std::collections::BTreeMap;

use super::features::{Kind, Obs, TERMS};
use super::format::{FORMAT, VERSION};
use super::model::{
    Bursts, DecodeBin, FittedModel, ModelMeta, ModelSource, PrefillClass, RatioCell, StepLaw,
};
use super::regress;
use super::residual::{self, LEVELS, MIN_CELL};

/// Ratios of the decode steps of one bin, by burst, and their durations.
#[derive(Default)]
struct DecodeAcc {
    cells: BTreeMap<u32, Vec<f32>>,
    ms: Vec<f32>,
}

/// Ratios of the prefill observations of one class, and their durations.
#[derive(Default)]
struct PrefillAcc {
    ratios: Vec<f32>,
    ms: Vec<f32>,
}

/// Six significant digits: what the file needs, and readable.
fn sig(v: f64) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let p = 10f64.powi(5 - v.abs().log10().floor() as i32);
    (v * p).round() / p
}

/// Merge burst cells with too few steps into their neighbours (by burst), so every kept
/// cell has [`MIN_CELL`] steps; the merged cell's burst is its steps' mean.
fn merge_cells(cells: BTreeMap<u32, Vec<f32>>) -> Vec<(u32, Vec<f32>)> {
    let mut out: Vec<(u64, Vec<f32>)> = Vec::new(); // (Σ burst, ratios)
    let mut acc: (u64, Vec<f32>) = (0, Vec::new());
    for (burst, v) in cells {
        acc.0 += u64::from(burst) * v.len() as u64;
        acc.1.extend(v);
        if acc.1.len() >= MIN_CELL {
            out.push(std::mem::take(&mut acc));
        }
    }
    if !acc.1.is_empty() {
        match out.last_mut() {
            Some(last) => {
                last.0 += acc.0;
                last.1.extend(acc.1);
            }
            None => out.push(acc),
        }
    }
    out.into_iter()
        .map(|(sum, v)| (((sum as f64 / v.len() as f64).round() as u32).max(1), v))
        .collect()
}

/// An observation this many times the median step is an outlier worth a warning: a real
/// engine's slow steps (a long prefill, a preemption) stay within a few tens of medians.
const OUTLIER_FACTOR: f64 = 1000.0;

/// A warning when some observations dwarf the rest (a capture with a stalled gap, a
/// damaged line): least squares follows them, and the law then says little about the
/// ordinary steps (one absurd gap once gave an intercept of −1.7e14 ms).
fn outlier_note(obs: &[Obs], intercept: f64) -> Option<String> {
    let mut ys: Vec<f32> = obs.iter().map(|o| o.y).collect();
    if ys.is_empty() {
        return None;
    }
    let mid = ys.len() / 2;
    let (_, median, _) = ys.select_nth_unstable_by(mid, f32::total_cmp);
    let median = f64::from(*median).max(1e-3);
    let outliers: Vec<f64> = obs
        .iter()
        .map(|o| f64::from(o.y))
        .filter(|&y| y > OUTLIER_FACTOR * median)
        .collect();
    if outliers.is_empty() && intercept.abs() <= OUTLIER_FACTOR * median {
        return None;
    }
    let largest = obs.iter().map(|o| f64::from(o.y)).fold(0.0, f64::max);
    Some(format!(
        "WARNING: {} observation(s) last more than {OUTLIER_FACTOR}× the median step ({} ms; the largest {} ms), and the law's intercept is {} ms: outliers such as a stalled or damaged record pull the fit; check the capture (`inspect summarize`) and refit without them",
        outliers.len(),
        sig(median),
        crate::latency::show_number(sig(largest)),
        crate::latency::show_number(intercept),
    ))
}

/// Build the model from the observations of every capture.
pub(crate) fn build(
    sources: Vec<ModelSource>,
    obs: &[Obs],
    bursts: Vec<u64>,
    after_prefill_decay: f64,
) -> FittedModel {
    let mut sel = regress::select(obs);
    if after_prefill_decay == 0.0 {
        for t in sel.terms.iter_mut().filter(|t| {
            t.term.starts_with("after_prefill") || t.term.starts_with("per_after_prefill")
        }) {
            t.why = "the captures fit best without a carry-over from earlier prefills".into();
        }
    }
    let mut notes = Vec::new();
    let mut coef = sel.coef.map(sig);
    let has_prefill = obs.iter().any(|o| matches!(o.kind, Kind::Prefill { .. }));
    if !has_prefill {
        coef[2] = coef[1];
        notes.push(format!(
            "the captures finish no prefill: a prompt token costs what one more decode costs ({} ms)",
            coef[2]
        ));
    }
    let floor_ms = obs
        .iter()
        .map(|o| f64::from(o.y))
        .fold(f64::INFINITY, f64::min);
    notes.extend(outlier_note(obs, coef[0]));
    let law = StepLaw {
        step_ms: coef[0],
        per_decode_ms: coef[1],
        per_prefill_token_ms: coef[2],
        prefill_step_ms: coef[3],
        per_context_token_ms: coef[4],
        per_burst_token_ms: coef[5],
        per_prefill_depth_ms: coef[6],
        after_prefill_ms: coef[7],
        per_after_prefill_token_ms: coef[8],
        after_prefill_decay,
        new_shape_ms: coef[9],
        after_idle_ms: coef[10],
        per_first_token_ms: coef[11],
        floor_ms: sig(floor_ms),
        residual_autocorrelation: sel.rho,
        terms: sel.terms,
        notes,
    };
    debug_assert_eq!(TERMS.len(), law.coef().len());
    // ratios by state
    let mut dec: BTreeMap<(u32, u32), DecodeAcc> = BTreeMap::new();
    let mut pre: BTreeMap<(u32, u32), PrefillAcc> = BTreeMap::new();
    for o in obs {
        let r = (f64::from(o.y) / law.ms(&o.xf())) as f32;
        match o.kind {
            Kind::Decode { decodes, burst } => {
                let e = dec.entry(residual::decode_bin(decodes)).or_default();
                e.cells.entry(burst).or_default().push(r);
                e.ms.push(o.y);
            }
            Kind::Prefill { per_step } => {
                let e = pre.entry(residual::prefill_class(per_step)).or_default();
                e.ratios.push(r);
                e.ms.push(o.y);
            }
        }
    }
    // a kind where no state has enough steps pools into one state spanning them all
    if !dec.is_empty() && dec.values().all(|e| e.ms.len() < MIN_CELL) {
        let span = span(dec.keys());
        let mut all = DecodeAcc::default();
        for e in std::mem::take(&mut dec).into_values() {
            for (b, v) in e.cells {
                all.cells.entry(b).or_default().extend(v);
            }
            all.ms.extend(e.ms);
        }
        dec.insert(span, all);
    }
    if !pre.is_empty() && pre.values().all(|e| e.ms.len() < MIN_CELL) {
        let span = span(pre.keys());
        let mut all = PrefillAcc::default();
        for e in std::mem::take(&mut pre).into_values() {
            all.ratios.extend(e.ratios);
            all.ms.extend(e.ms);
        }
        pre.insert(span, all);
    }
    // a state with too few steps draws from its nearest neighbour instead (unless it is
    // the only one)
    let (ndec, npre) = (dec.len(), pre.len());
    let decode = dec
        .into_iter()
        .filter(|(_, e)| e.ms.len() >= MIN_CELL || ndec == 1)
        .map(|((lo, hi), mut e)| DecodeBin {
            decodes: [lo, hi],
            steps: e.ms.len() as u64,
            median_ms: sig(residual::median(&mut e.ms)),
            cells: merge_cells(e.cells)
                .into_iter()
                .map(|(burst, mut v)| RatioCell {
                    burst,
                    steps: v.len() as u64,
                    ratio: residual::quantiles(&mut v),
                })
                .collect(),
        })
        .collect();
    let prefill = pre
        .into_iter()
        .filter(|(_, e)| e.ms.len() >= MIN_CELL || npre == 1)
        .map(|((lo, hi), mut e)| PrefillClass {
            tokens: [lo, hi],
            steps: e.ms.len() as u64,
            median_ms: sig(residual::median(&mut e.ms)),
            ratio: residual::quantiles(&mut e.ratios),
        })
        .collect();
    let bursts = (bursts.len() > 1).then(|| Bursts {
        num_spec_tokens: bursts.len() as u32 - 1,
        counts: bursts,
    });
    FittedModel {
        format: FORMAT.into(),
        version: VERSION,
        meta: ModelMeta {
            tool: "vllm-vcr".into(),
            tool_version: env!("CARGO_PKG_VERSION").into(),
            sources,
        },
        law,
        levels: LEVELS.to_vec(),
        decode,
        prefill,
        bursts,
    }
}

/// Σ weight · (captured / law − 1)² over the observations: how well a law fits, in the
/// fit's own (relative) terms.
pub(crate) fn relative_rss(law: &StepLaw, obs: &[Obs]) -> f64 {
    obs.iter()
        .map(|o| {
            let e = f64::from(o.y) / law.ms(&o.xf()) - 1.0;
            f64::from(o.weight) * e * e
        })
        .sum()
}

/// How fast a capture ran against `law`: the median of its captured / law ratios over the
/// given (captured duration, observation) pairs, and how many it rests on; `None` when
/// none is usable. One measure for a fit's per-capture speeds and a judged capture's.
pub(crate) fn median_speed<'a>(
    law: &StepLaw,
    obs: impl Iterator<Item = (f32, &'a Obs)>,
) -> Option<(f64, u64)> {
    let mut r: Vec<f64> = obs
        .map(|(y, o)| f64::from(y) / law.ms(&o.xf()))
        .filter(|r| r.is_finite() && *r > 0.0)
        .collect();
    (!r.is_empty()).then(|| (super::residual::median_f64(&mut r), r.len() as u64))
}

/// The smallest range covering every key's range.
fn span<'a>(keys: impl Iterator<Item = &'a (u32, u32)>) -> (u32, u32) {
    keys.fold((u32::MAX, 0), |(lo, hi), k| (lo.min(k.0), hi.max(k.1)))
}
