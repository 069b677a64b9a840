//! Plain SVG figures written by the binary (plotters, its SVG backend only), for `inspect
//! calibrate --plot` and `inspect compare --plot`: survival curves and Q-Q plots of
//! latency samples, output chunk-size distributions and per-turn TTFT lines, each over any
//! number of named series (the first is the reference, drawn in black).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Result, anyhow};
use plotters::coord::Shift;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use sim_trace::stats::quantile_of;

const SIZE: (u32, u32) = (760, 520);
const GRID: RGBColor = RGBColor(150, 150, 150);

/// Series colours in order: the reference black, then a qualitative palette.
const PALETTE: [RGBColor; 7] = [
    RGBColor(0, 0, 0),
    RGBColor(31, 119, 180),
    RGBColor(230, 120, 0),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// The colour of series `i`.
fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// One named sample: what a series is drawn from.
pub type Named<'a, T> = (&'a str, T);

/// A quantity per session turn: (turn, p50, p90).
pub type PerTurn = (u32, f64, f64);

/// How a series is drawn.
#[derive(Clone, Copy, PartialEq)]
enum Mark {
    Line,
    Dashed,
    Dots,
}

struct Series {
    name: String,
    color: RGBColor,
    mark: Mark,
    points: Vec<(f64, f64)>,
}

/// Plotters' errors carry the backend's error type; flatten them.
fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing: {e}")
}

/// Whether values spanning `lo..hi` read better on a log axis.
fn wide(lo: f64, hi: f64) -> bool {
    lo > 0.0 && hi / lo > 20.0
}

/// Tick labels: short and without float noise.
fn tick(v: &f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-3..1e5).contains(&a) {
        format!("{v:.0e}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{}", (v * 10.0).round() / 10.0)
    } else {
        let s = format!("{v:.4}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// A log axis' tick label: only at 1, 2 and 5 × a power of ten (the others crowd).
fn log_tick(v: &f64) -> String {
    let m = *v / 10f64.powf(v.abs().log10().floor());
    if [1.0, 2.0, 5.0].iter().any(|x| (m - x).abs() < 1e-6) {
        tick(v)
    } else {
        String::new()
    }
}

/// What a chart looks like around its series.
struct Frame<'a> {
    title: &'a str,
    x_desc: &'a str,
    y_desc: &'a str,
    /// Log axes (x, y): their ticks are labelled at 1, 2, 5 only.
    log: (bool, bool),
    legend: SeriesLabelPosition,
    /// A `y = x` reference line over this span (Q-Q plots).
    diagonal: Option<(f64, f64)>,
    /// Label only the whole numbers of the x axis (turns, counts).
    whole_x: bool,
}

/// One chart on `root` with the given axes and series, a legend and axis labels.
fn chart<X, Y>(
    root: &DrawingArea<SVGBackend, Shift>,
    f: &Frame,
    x: X,
    y: Y,
    series: &[Series],
) -> Result<()>
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    root.fill(&WHITE).map_err(err)?;
    let mut c = ChartBuilder::on(root)
        .caption(f.title, ("sans-serif", 17))
        .margin(14)
        .x_label_area_size(46)
        .y_label_area_size(70)
        .build_cartesian_2d(x, y)
        .map_err(err)?;
    let fmt = |log: bool| -> &dyn Fn(&f64) -> String { if log { &log_tick } else { &tick } };
    let whole = |v: &f64| {
        if (v - v.round()).abs() < 1e-9 {
            format!("{v:.0}")
        } else {
            String::new()
        }
    };
    c.configure_mesh()
        .x_desc(f.x_desc)
        .y_desc(f.y_desc)
        .x_label_formatter(if f.whole_x { &whole } else { fmt(f.log.0) })
        .y_label_formatter(fmt(f.log.1))
        .light_line_style(WHITE)
        .bold_line_style(GRID.mix(0.25))
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    if let Some((lo, hi)) = f.diagonal {
        c.draw_series(LineSeries::new([(lo, lo), (hi, hi)], GRID.stroke_width(1)))
            .map_err(err)?
            .label("y = x")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 22, y)], GRID.stroke_width(1)));
    }
    for s in series {
        let color = s.color;
        let dashed = s.mark == Mark::Dashed;
        match s.mark {
            Mark::Line => c
                .draw_series(LineSeries::new(
                    s.points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(err)?,
            Mark::Dashed => c
                .draw_series(DashedLineSeries::new(
                    s.points.iter().copied(),
                    6,
                    4,
                    color.stroke_width(2),
                ))
                .map_err(err)?,
            Mark::Dots => c
                .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(err)?,
        }
        .label(s.name.as_str())
        .legend(move |(x, y)| {
            // a dashed series gets a gap in its legend line
            let gap = if dashed { 6 } else { 0 };
            EmptyElement::at((x, y))
                + PathElement::new([(0, 0), (8, 0)], color.stroke_width(3))
                + PathElement::new([(8 + gap, 0), (22, 0)], color.stroke_width(3))
        });
    }
    c.configure_series_labels()
        .position(f.legend.clone())
        .background_style(WHITE.mix(0.9))
        .border_style(GRID)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// The range of the points' coordinates (positive ones only, for a log axis).
fn span(series: &[Series], pick: impl Fn(&(f64, f64)) -> f64, positive: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in series.iter().flat_map(|s| s.points.iter().map(&pick)) {
        if v.is_finite() && (!positive || v > 0.0) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
    }
    if !lo.is_finite() {
        return (if positive { 1.0 } else { 0.0 }, 1.0);
    }
    if hi <= lo {
        hi = lo + lo.abs().max(1.0) * 0.1;
    }
    (lo, hi)
}

fn padded(lo: f64, hi: f64, log: bool) -> (f64, f64) {
    if log {
        (lo / 1.15, hi * 1.15)
    } else {
        let pad = (hi - lo) * 0.04;
        ((lo - pad).max(0.0), hi + pad)
    }
}

/// The survival points of `values`: (x, fraction of values ≥ x), every point of the last
/// 200 and about 400 log-spaced ones before them, so a long sample stays small.
fn survival_points(values: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return Vec::new();
    }
    // k = values ≥ x: from n (the smallest) down to 1 (the largest)
    let mut ks: Vec<usize> = (1..=n.min(200)).collect();
    let steps = 400.0;
    let top = (n as f64).ln();
    ks.extend((0..=400).map(|j| (top * j as f64 / steps).exp().round() as usize));
    ks.retain(|k| (1..=n).contains(k));
    ks.sort_unstable();
    ks.dedup();
    ks.iter()
        .rev()
        .map(|&k| (v[n - k], k as f64 / n as f64))
        .collect()
}

/// A survival figure (1 − CDF on a log axis) of one metric, one curve per sample (a
/// sample named `knobs` is dashed).
pub fn survival(path: &Path, title: &str, what: &str, samples: &[Named<&[f64]>]) -> Result<()> {
    let series: Vec<Series> = samples
        .iter()
        .enumerate()
        .map(|(i, (name, v))| Series {
            name: format!("{name} (n = {})", v.len()),
            color: color(i),
            mark: if *name == "knobs" {
                Mark::Dashed
            } else {
                Mark::Line
            },
            points: survival_points(v),
        })
        .collect();
    let (xlo, xhi) = span(&series, |p| p.0, false);
    let (ylo, _) = span(&series, |p| p.1, true);
    let ys = (ylo / 1.5)..1.2;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    let log = wide(xlo, xhi);
    let x_desc = format!("{what} (ms{})", if log { ", log scale" } else { "" });
    // the curves fall from the top left: the lower left is free
    let frame = Frame {
        title,
        x_desc: &x_desc,
        y_desc: "fraction of samples ≥ x (log scale)",
        log: (log, true),
        legend: SeriesLabelPosition::LowerLeft,
        diagonal: None,
        whole_x: false,
    };
    let (a, b) = padded(xlo, xhi, log);
    if log {
        chart(&root, &frame, (a..b).log_scale(), ys.log_scale(), &series)
    } else {
        chart(&root, &frame, a..b, ys.log_scale(), &series)
    }
}

/// The Q-Q levels for a sample of `n`: every percent, then the tail as far as the sample
/// reaches (99.5, 99.9, 99.95, 99.99 %).
fn qq_levels(n: usize) -> Vec<f64> {
    let mut l: Vec<f64> = (1..100).map(|i| f64::from(i) / 100.0).collect();
    for q in [0.995, 0.999, 0.9995, 0.9999] {
        if (1.0 - q) * n as f64 >= 1.0 {
            l.push(q);
        }
    }
    l
}

/// A Q-Q figure: the quantiles of every other sample against the first one's.
/// `axes`: what the x and y quantiles are (`captured`, `simulated`).
pub fn qq(
    path: &Path,
    title: &str,
    what: &str,
    axes: (&str, &str),
    samples: &[Named<&[f64]>],
) -> Result<()> {
    let Some(((_, reference), others)) = samples.split_first() else {
        return Err(anyhow!("a Q-Q plot needs a reference sample"));
    };
    let mut reference = reference.to_vec();
    let levels = qq_levels(samples.iter().map(|s| s.1.len()).min().unwrap_or(0));
    let rq: Vec<Option<f64>> = levels
        .iter()
        .map(|&q| quantile_of(&mut reference, q))
        .collect();
    let series: Vec<Series> = others
        .iter()
        .enumerate()
        .map(|(k, (name, v))| {
            let mut v = v.to_vec();
            let n = v.len();
            let points = levels
                .iter()
                .zip(&rq)
                .filter_map(|(&q, r)| Some(((*r)?, quantile_of(&mut v, q)?)))
                .collect();
            Series {
                name: format!("{name} (n = {n})"),
                color: color(k + 1),
                mark: Mark::Dots,
                points,
            }
        })
        .collect();
    let (xlo, xhi) = span(&series, |p| p.0, false);
    let (ylo, yhi) = span(&series, |p| p.1, false);
    let (lo, hi) = (xlo.min(ylo), xhi.max(yhi));
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    let log = wide(lo, hi);
    let scale = if log { ", log scale" } else { "" };
    let x_desc = format!("{} {what} quantile (ms{scale})", axes.0);
    let y_desc = format!("{} {what} quantile (ms{scale})", axes.1);
    let (a, b) = padded(lo, hi, log);
    let frame = Frame {
        title,
        x_desc: &x_desc,
        y_desc: &y_desc,
        log: (log, log),
        legend: SeriesLabelPosition::LowerRight,
        diagonal: Some((a, b)),
        whole_x: false,
    };
    if log {
        chart(
            &root,
            &frame,
            (a..b).log_scale(),
            (a..b).log_scale(),
            &series,
        )
    } else {
        chart(&root, &frame, a..b, a..b, &series)
    }
}

/// Grouped bars: the fraction of output chunks of each size, one bar per run.
pub fn chunk_sizes(path: &Path, title: &str, runs: &[Named<&BTreeMap<u32, u64>>]) -> Result<()> {
    let max = runs
        .iter()
        .filter_map(|(_, m)| m.keys().next_back().copied())
        .max()
        .unwrap_or(1);
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut c = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 17))
        .margin(14)
        .x_label_area_size(46)
        .y_label_area_size(70)
        .build_cartesian_2d(0.5f64..f64::from(max) + 0.5, 0f64..1.05)
        .map_err(err)?;
    c.configure_mesh()
        .x_desc("tokens in one output chunk")
        .y_desc("fraction of chunks")
        .x_labels(max.min(32) as usize + 1)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&tick)
        .light_line_style(WHITE)
        .bold_line_style(GRID.mix(0.25))
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    let width = 0.8 / runs.len().max(1) as f64;
    for (k, (name, m)) in runs.iter().enumerate() {
        let total: u64 = m.values().sum();
        let color = color(k);
        let off = -0.4 + width * k as f64;
        c.draw_series(m.iter().map(|(&size, &n)| {
            let x = f64::from(size) + off;
            let y = n as f64 / total.max(1) as f64;
            Rectangle::new([(x, 0.0), (x + width, y)], color.mix(0.8).filled())
        }))
        .map_err(err)?
        .label(format!("{name} ({total} chunks)"))
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(GRID)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// TTFT per session turn: for each run, its p50 (solid) and p90 (dashed) at turn 1, 2, …
/// (`turns[k]` = (turn, p50, p90)).
pub fn per_turn(path: &Path, title: &str, what: &str, runs: &[Named<&[PerTurn]>]) -> Result<()> {
    let mut series = Vec::new();
    for (k, (name, turns)) in runs.iter().enumerate() {
        for (label, mark, pick) in [("p50", Mark::Line, 0usize), ("p90", Mark::Dashed, 1usize)] {
            series.push(Series {
                name: format!("{name} {label}"),
                color: color(k),
                mark,
                points: turns
                    .iter()
                    .map(|&(t, p50, p90)| (f64::from(t), if pick == 0 { p50 } else { p90 }))
                    .collect(),
            });
        }
    }
    let (xlo, xhi) = span(&series, |p| p.0, false);
    let (ylo, yhi) = span(&series, |p| p.1, false);
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    let y_desc = format!("{what} (ms)");
    let frame = Frame {
        title,
        x_desc: "session turn (1 = a conversation's first request)",
        y_desc: &y_desc,
        log: (false, false),
        legend: SeriesLabelPosition::UpperLeft,
        diagonal: None,
        whole_x: true,
    };
    let (a, b) = padded(ylo, yhi, false);
    chart(&root, &frame, (xlo - 0.2)..(xhi + 0.2), a..b, &series)
}

/// `dir/name`, creating `dir`.
pub fn file(dir: &Path, name: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)
        .map_err(|e| anyhow!("creating --plot directory {}: {e}", dir.display()))?;
    Ok(dir.join(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn survival_points_run_from_one_down_to_one_over_n() {
        let v: Vec<f64> = (1..=10_000).map(f64::from).collect();
        let p = survival_points(&v);
        assert_eq!(p.first(), Some(&(1.0, 1.0)));
        assert_eq!(p.last(), Some(&(10_000.0, 1e-4)));
        assert!(p.len() < 650, "{}", p.len());
        assert!(p.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 > w[1].1));
    }

    #[test]
    fn qq_levels_reach_as_far_as_the_sample() {
        assert_eq!(qq_levels(100).len(), 99);
        assert_eq!(*qq_levels(1000).last().unwrap(), 0.999);
        assert_eq!(qq_levels(20_000).len(), 103);
    }
}
