//! The comparison itself: per-request samples of the three runs (captured, modelled,
//! knobs), concurrency cohorts, exact quantiles, Δ %, and the tolerance gate.

use std::collections::BTreeMap;

use serde_json::{Value, json};
use sim_trace::stats::quantile_of;
use sim_trace::trace::TraceRecord;

/// The quantiles compared, with their names.
pub const QUANTILES: [(f64, &str); 3] = [(0.5, "p50"), (0.9, "p90"), (0.99, "p99")];

/// The three sources of samples, in the order of the table's columns.
pub const SOURCES: [&str; 3] = ["captured", "modelled", "knobs"];

/// What one request took: TTFT, request total (TTFT + every gap) and its gaps, ms.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub ttft_ms: f64,
    pub total_ms: f64,
    pub itl_ms: Vec<f64>,
}

impl Sample {
    /// The sample of a complete record with a TTFT; `None` otherwise (incomplete records,
    /// records without timing).
    pub fn of(r: &TraceRecord) -> Option<Sample> {
        let ttft = r.ttft_ms.filter(|t| t.is_finite())?;
        if r.incomplete {
            return None;
        }
        let gaps: f64 = r.itl_ms.iter().sum();
        Some(Sample {
            ttft_ms: ttft,
            // traces keep µs: the sum, without its float noise
            total_ms: ((ttft + gaps) * 1e3).round() / 1e3,
            itl_ms: r.itl_ms.clone(),
        })
    }
}

/// The metrics compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    Ttft,
    Itl,
    Total,
}

impl Metric {
    pub const ALL: [Metric; 3] = [Metric::Ttft, Metric::Itl, Metric::Total];

    /// The key in `--json` and in failure names.
    pub fn key(self) -> &'static str {
        match self {
            Metric::Ttft => "ttft_ms",
            Metric::Itl => "itl_ms",
            Metric::Total => "request_total_ms",
        }
    }

    /// The short name in the table and in failure names.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Ttft => "TTFT",
            Metric::Itl => "ITL",
            Metric::Total => "request total",
        }
    }

    /// Append this metric's values of `s` to `out`.
    pub fn extend(self, s: &Sample, out: &mut Vec<f64>) {
        match self {
            Metric::Ttft => out.push(s.ttft_ms),
            Metric::Itl => out.extend_from_slice(&s.itl_ms),
            Metric::Total => out.push(s.total_ms),
        }
    }
}

/// Concurrency cohorts: the requests in flight when a request arrived (itself included).
pub const BUCKETS: [(u32, u32, &str); 7] = [
    (1, 1, "1"),
    (2, 2, "2"),
    (3, 4, "3-4"),
    (5, 8, "5-8"),
    (9, 16, "9-16"),
    (17, 32, "17-32"),
    (33, u32::MAX, ">32"),
];

/// The bucket of a concurrency (0 counts as 1: the request itself).
pub fn bucket(concurrency: u32) -> usize {
    let c = concurrency.max(1);
    BUCKETS
        .iter()
        .position(|&(lo, hi, _)| (lo..=hi).contains(&c))
        .unwrap_or(BUCKETS.len() - 1)
}

/// A cohort's name in file names: `all`, `c1`, `c3-4`, `c33-plus`.
pub fn slug(label: &str) -> String {
    match label {
        "all" => "all".into(),
        l if l.starts_with('>') => format!("c{}-plus", l[1..].parse::<u32>().unwrap_or(0) + 1),
        l => format!("c{l}"),
    }
}

/// The concurrency at arrival of every request that has an arrival, computed from the
/// arrivals and ends (arrival + `total`, or the arrival itself when the record has no
/// timing): the requests that arrived at or before it and had not ended by then.
pub fn concurrency_from_timing(spans: &[Option<(f64, f64)>]) -> Vec<Option<u32>> {
    let mut starts: Vec<f64> = spans.iter().flatten().map(|s| s.0).collect();
    let mut ends: Vec<f64> = spans.iter().flatten().map(|s| s.0 + s.1.max(0.0)).collect();
    starts.sort_by(f64::total_cmp);
    ends.sort_by(f64::total_cmp);
    spans
        .iter()
        .map(|s| {
            let (a, _) = (*s)?;
            let started = starts.partition_point(|x| *x <= a);
            let ended = ends.partition_point(|x| *x <= a);
            Some(u32::try_from(started.saturating_sub(ended).max(1)).unwrap_or(u32::MAX))
        })
        .collect()
}

/// The gate: the largest |Δ %| allowed per quantile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Per quantile of [`QUANTILES`], percent.
    pub pct: [f64; 3],
}

impl Default for Tolerance {
    /// The goal: 2 % at p50 and p90, 5 % at p99.
    fn default() -> Self {
        Self {
            pct: [2.0, 2.0, 5.0],
        }
    }
}

/// `--tolerance`: comma-separated items, applied in order over the default: `PCT` sets
/// every quantile, `p50=PCT` (`p90=`, `p99=`) one.
pub fn parse_tolerance(s: &str) -> Result<Tolerance, String> {
    let mut t = Tolerance::default();
    let pct = |v: &str| -> Result<f64, String> {
        let v = v.trim().trim_end_matches('%').trim();
        match v.parse::<f64>() {
            Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
            _ => Err(format!("`{v}` is not a percentage ≥ 0")),
        }
    };
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        match item.split_once('=') {
            None => t.pct = [pct(item)?; 3],
            Some((q, v)) => {
                let i = QUANTILES
                    .iter()
                    .position(|(_, name)| name.eq_ignore_ascii_case(q.trim()))
                    .ok_or_else(|| format!("`{q}`: the quantiles are p50, p90 and p99"))?;
                t.pct[i] = pct(v)?;
            }
        }
    }
    Ok(t)
}

impl Tolerance {
    pub fn to_json(self) -> Value {
        let mut m = serde_json::Map::new();
        for (i, (_, q)) in QUANTILES.iter().enumerate() {
            m.insert((*q).to_string(), json!(self.pct[i]));
        }
        Value::Object(m)
    }
}

/// p50, p90, p99 of `v` (exact, nearest rank), `None` when empty.
pub fn quantiles(v: &mut [f64]) -> [Option<f64>; 3] {
    QUANTILES.map(|(q, _)| quantile_of(v, q))
}

/// `(model − captured) / captured`, percent.
pub fn delta_pct(captured: Option<f64>, model: Option<f64>) -> Option<f64> {
    let (c, m) = (captured?, model?);
    (c != 0.0).then(|| (m - c) / c * 100.0)
}

/// One metric of one cohort: the samples' counts and quantiles of every source.
#[derive(Debug, Clone)]
pub struct Cell {
    pub metric: Metric,
    /// Samples per source (requests for TTFT and request total, gaps for ITL).
    pub samples: [usize; 3],
    /// Quantiles per source.
    pub q: [[Option<f64>; 3]; 3],
    /// Quantile indexes out of tolerance (modelled against captured), when gated.
    pub out: Vec<usize>,
}

impl Cell {
    pub fn delta(&self, source: usize, qi: usize) -> Option<f64> {
        delta_pct(self.q[0][qi], self.q[source][qi])
    }
}

/// A cohort: every compared request, or those of one concurrency bucket.
#[derive(Debug, Clone)]
pub struct Cohort {
    pub label: String,
    pub requests: usize,
    pub gated: bool,
    pub cells: Vec<Cell>,
}

/// Build the cohort of `members` (indexes into `samples`), gated when `gated`.
pub fn cohort(
    label: &str,
    members: &[usize],
    samples: &[[&Sample; 3]],
    gated: bool,
    tol: &Tolerance,
) -> Cohort {
    let cells = Metric::ALL
        .iter()
        .map(|&metric| {
            let mut counts = [0; 3];
            let mut q = [[None; 3]; 3];
            for (src, (count, quant)) in counts.iter_mut().zip(q.iter_mut()).enumerate() {
                let mut v = Vec::new();
                for &i in members {
                    metric.extend(samples[i][src], &mut v);
                }
                *count = v.len();
                *quant = quantiles(&mut v);
            }
            let mut cell = Cell {
                metric,
                samples: counts,
                q,
                out: Vec::new(),
            };
            if gated {
                cell.out = (0..QUANTILES.len())
                    .filter(|&qi| {
                        cell.delta(1, qi)
                            .is_some_and(|d| d.abs() > tol.pct[qi] || d.is_nan())
                    })
                    .collect();
            }
            cell
        })
        .collect();
    Cohort {
        label: label.to_string(),
        requests: members.len(),
        gated,
        cells,
    }
}

/// A robust log-normal fit: the median, and σ of the logs from their median absolute
/// deviation (× 1.4826, σ of a normal). Positive values only; `None` when there are none.
pub fn lognormal(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let mut logs: Vec<f64> = values.filter(|v| *v > 0.0).map(f64::ln).collect();
    let mid = median(&mut logs)?;
    let mut dev: Vec<f64> = logs.iter().map(|l| (l - mid).abs()).collect();
    let mad = median(&mut dev)?;
    Some((mid.exp(), 1.4826 * mad))
}

/// The true median (the mean of the two middle values of an even count).
fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// The knob (mean, std-dev) of a log-normal with this median and σ: the knobs draw a
/// log-normal with the given mean and std-dev, whose median is then `median`.
pub fn knob_of(median: f64, sigma: f64) -> (f64, f64) {
    let mean = median * (sigma * sigma / 2.0).exp();
    (mean, mean * ((sigma * sigma).exp() - 1.0).sqrt())
}

/// Output chunks by size (tokens per chunk, first chunks included), over `records`.
pub fn chunk_sizes<'a>(records: impl Iterator<Item = &'a TraceRecord>) -> BTreeMap<u32, u64> {
    let mut m = BTreeMap::new();
    for r in records.filter(|r| r.output_tokens > 0) {
        *m.entry(r.first_chunk_tokens()).or_default() += 1;
        for n in r.chunk_tokens() {
            *m.entry(n).or_default() += 1;
        }
    }
    m
}

/// (turn, p50, p90) of `values` grouped by session turn (`(turn, value)` pairs), for the
/// turns with at least `min` values; empty when no turn after the first has them.
pub fn per_turn(values: impl Iterator<Item = (u32, f64)>, min: usize) -> Vec<(u32, f64, f64)> {
    let mut by: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
    for (t, v) in values {
        by.entry(t).or_default().push(v);
    }
    let out: Vec<(u32, f64, f64)> = by
        .into_iter()
        .filter(|(_, v)| v.len() >= min)
        .filter_map(|(t, mut v)| Some((t, quantile_of(&mut v, 0.5)?, quantile_of(&mut v, 0.9)?)))
        .collect();
    if out.iter().any(|&(t, _, _)| t > 1) {
        out
    } else {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_and_slugs() {
        let got: Vec<&str> = [0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 1000]
            .iter()
            .map(|&c| BUCKETS[bucket(c)].2)
            .collect();
        assert_eq!(
            got,
            [
                "1", "1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "9-16", "17-32", "17-32", ">32",
                ">32"
            ]
        );
        assert_eq!(slug("all"), "all");
        assert_eq!(slug("3-4"), "c3-4");
        assert_eq!(slug(">32"), "c33-plus");
    }

    #[test]
    fn tolerance_items_apply_over_the_default() {
        assert_eq!(parse_tolerance("").unwrap().pct, [2.0, 2.0, 5.0]);
        assert_eq!(parse_tolerance("10").unwrap().pct, [10.0; 3]);
        assert_eq!(parse_tolerance("p99=8").unwrap().pct, [2.0, 2.0, 8.0]);
        assert_eq!(
            parse_tolerance("3, P90=4%,p99=12").unwrap().pct,
            [3.0, 4.0, 12.0]
        );
        assert!(parse_tolerance("p95=3").unwrap_err().contains("p50, p90"));
        assert!(parse_tolerance("-1").is_err());
        assert!(parse_tolerance("x").is_err());
    }

    #[test]
    fn concurrency_counts_requests_in_flight_at_arrival() {
        // 0: [0, 10), 1: [5, 20), 2: [10, 12), 3: [30, 31), untimed
        let c = concurrency_from_timing(&[
            Some((0.0, 10.0)),
            Some((5.0, 15.0)),
            Some((10.0, 2.0)),
            Some((30.0, 1.0)),
            None,
        ]);
        assert_eq!(c, [Some(1), Some(2), Some(2), Some(1), None]);
    }

    #[test]
    fn lognormal_fit_recovers_median_and_sigma() {
        // e^(±1.349 σ / 2)... a symmetric sample in log space around ln 10
        let v: Vec<f64> = (-500..=500)
            .map(|i| (10f64.ln() + 0.3 * (i as f64 / 500.0) * 1.7).exp())
            .collect();
        let (m, s) = lognormal(v.iter().copied()).unwrap();
        assert!((m - 10.0).abs() < 1e-9, "{m}");
        // uniform on ±0.51 in logs: MAD 0.255
        assert!((s - 1.4826 * 0.255).abs() < 1e-3, "{s}");
        let (mean, std) = knob_of(10.0, 0.0);
        assert_eq!((mean, std), (10.0, 0.0));
        let (mean, std) = knob_of(10.0, 0.5);
        assert!((mean - 10.0 * (0.125f64).exp()).abs() < 1e-9);
        assert!((std / mean - ((0.25f64).exp() - 1.0).sqrt()).abs() < 1e-12);
        assert_eq!(lognormal([0.0, -1.0].into_iter()), None);
    }

    #[test]
    fn cells_gate_the_modelled_column_only() {
        let mk = |t: f64| Sample {
            ttft_ms: t,
            total_ms: t + 10.0,
            itl_ms: vec![10.0],
        };
        let (c, m, k) = (mk(100.0), mk(101.0), mk(150.0));
        let samples = [[&c, &m, &k]];
        let tol = Tolerance::default();
        let co = cohort("all", &[0], &samples, true, &tol);
        let ttft = &co.cells[0];
        assert_eq!(ttft.q[0][0], Some(100.0));
        assert!((ttft.delta(1, 0).unwrap() - 1.0).abs() < 1e-9);
        assert!(
            ttft.out.is_empty(),
            "1 % is within 2 %; the knobs are not gated"
        );
        let strict = parse_tolerance("0.5").unwrap();
        let co = cohort("all", &[0], &samples, true, &strict);
        assert_eq!(co.cells[0].out, [0, 1, 2]);
        let co = cohort("1", &[0], &samples, false, &strict);
        assert!(co.cells[0].out.is_empty(), "not gated");
    }
}
