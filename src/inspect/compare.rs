//! `inspect compare A B…`: the latencies of several traces side by side — TTFT, ITL and
//! request total quantiles per concurrency cohort, each trace's Δ % against the first —
//! and, with `--plot`, figures of the same: survival curves and Q-Q plots, output chunk
//! sizes, TTFT per session turn. Two captures of one workload (the engine's own
//! run-to-run distance), a capture and its simulation, two engine configurations.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Value, json};

use super::calibrate::compare::{
    BUCKETS, Metric, QUANTILES, Sample, bucket, chunk_sizes, concurrency_from_timing, delta_pct,
    per_turn, quantiles, slug,
};
use super::plot;
use super::simulate::workload::Workload;

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Cohorts group each trace's requests by the requests in flight when they arrived (the \
records' `concurrency`, else computed from the arrivals and ends), as `inspect calibrate` \
does; a trace's cohort with fewer than --min-requests requests is shown with `*` and left \
out of the figures. Δ % is (trace − reference) / reference of the same quantile and \
cohort. Exit status 0, or 1 on bad input.")]
pub struct CompareArgs {
    /// Traces with captured timing (`record --trace-out`, `inspect simulate --dump-trace`;
    /// `.gz` read transparently): records with `ttft_ms` and `itl_ms`. The first is the
    /// reference the others are compared with.
    #[arg(num_args = 2.., required = true, value_name = "TRACE")]
    pub traces: Vec<PathBuf>,

    /// A trace's name in the table and the figures, in the traces' order (repeat it; the
    /// traces without one are named by their file name).
    #[arg(long = "label", value_name = "NAME")]
    pub labels: Vec<String>,

    /// Cohorts with fewer requests than this are marked and not plotted (the pooled
    /// `all` cohort always is).
    #[arg(long, value_name = "N", default_value_t = 30)]
    pub min_requests: usize,

    /// Print the comparison as one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,

    /// Write SVG figures into this directory (created if missing): survival curves and
    /// Q-Q plots (each trace against the first) of TTFT and ITL, pooled and per cohort
    /// every trace fills; the output chunk-size distribution when a trace has multi-token
    /// chunks; TTFT per session turn when the traces hold conversations (turns inferred
    /// from the block-hash chains, as `--replay-sessions` does).
    #[arg(long, value_name = "DIR")]
    pub plot: Option<PathBuf>,
}

/// One trace, read: its compared requests in arrival order.
struct Trace {
    label: String,
    path: PathBuf,
    records: u64,
    samples: Vec<Sample>,
    /// Per sample: its concurrency cohort (an index into `BUCKETS`), if known.
    cohort: Vec<Option<usize>>,
    /// Per sample: its session turn (1 for a conversation's first request).
    turn: Vec<u32>,
    chunks: BTreeMap<u32, u64>,
}

impl Trace {
    fn read(path: &Path, label: String) -> Result<Self> {
        let mut samples: Vec<Option<Sample>> = Vec::new();
        let mut concurrency: Vec<Option<u32>> = Vec::new();
        let mut arrival: Vec<Option<f64>> = Vec::new();
        let mut chunks: BTreeMap<u32, u64> = BTreeMap::new();
        let work = Workload::load_with(path, None, None, |_, r| {
            for (k, v) in chunk_sizes(std::iter::once(r)) {
                *chunks.entry(k).or_default() += v;
            }
            samples.push(Sample::of(r));
            concurrency.push(r.concurrency);
            arrival.push(r.arrival_ms.filter(|a| a.is_finite()));
        })
        .with_context(|| format!("reading {}", path.display()))?;
        // in arrival order
        let order: Vec<usize> = work.reqs.iter().map(|p| p.source as usize).collect();
        let turn_of = Workload::turn_numbers(&work.sessions());
        let from_records = order
            .iter()
            .filter(|&&i| arrival[i].is_some())
            .all(|&i| concurrency[i].is_some());
        let conc: Vec<Option<u32>> = if from_records {
            order.iter().map(|&i| concurrency[i]).collect()
        } else {
            let spans: Vec<Option<(f64, f64)>> = order
                .iter()
                .map(|&i| Some((arrival[i]?, samples[i].as_ref().map_or(0.0, |s| s.total_ms))))
                .collect();
            concurrency_from_timing(&spans)
        };
        let mut t = Trace {
            label,
            path: path.to_path_buf(),
            records: work.records_in_trace,
            samples: Vec::new(),
            cohort: Vec::new(),
            turn: Vec::new(),
            chunks,
        };
        for (k, &i) in order.iter().enumerate() {
            if let Some(s) = samples[i].take() {
                t.samples.push(s);
                t.cohort.push(conc[k].map(bucket));
                t.turn.push(turn_of[k]);
            }
        }
        if t.samples.is_empty() {
            bail!(
                "{}: no complete record has timing (ttft_ms): compare needs captured latencies (a converted workload such as a Mooncake trace has none; `inspect simulate --dump-trace` gives it some)",
                path.display()
            );
        }
        Ok(t)
    }

    /// The samples of cohort `c` (`None`: all).
    fn members(&self, c: Option<usize>) -> Vec<&Sample> {
        self.samples
            .iter()
            .zip(&self.cohort)
            .filter(|(_, b)| c.is_none() || **b == c)
            .map(|(s, _)| s)
            .collect()
    }
}

/// One metric of one trace in one cohort.
struct Stat {
    samples: usize,
    q: [Option<f64>; 3],
}

fn stat(members: &[&Sample], metric: Metric) -> (Stat, Vec<f64>) {
    let mut v = Vec::new();
    for s in members {
        metric.extend(s, &mut v);
    }
    let q = quantiles(&mut v.clone());
    (
        Stat {
            samples: v.len(),
            q,
        },
        v,
    )
}

/// The label of cohort `c`.
fn cohort_label(c: Option<usize>) -> &'static str {
    c.map_or("all", |b| BUCKETS[b].2)
}

pub fn run(a: &CompareArgs) -> Result<()> {
    if a.traces.len() < 2 {
        bail!("compare needs at least two traces (the first is the reference)");
    }
    if a.labels.len() > a.traces.len() {
        bail!(
            "{} --label for {} traces: give at most one per trace",
            a.labels.len(),
            a.traces.len()
        );
    }
    let traces: Vec<Trace> = a
        .traces
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let label = a.labels.get(i).cloned().unwrap_or_else(|| {
                p.file_name()
                    .map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into())
                    .trim_end_matches(".gz")
                    .trim_end_matches(".jsonl")
                    .trim_end_matches(".trace")
                    .to_string()
            });
            Trace::read(p, label)
        })
        .collect::<Result<_>>()?;

    // the cohorts any trace has, pooled first
    let mut cohorts: Vec<Option<usize>> = vec![None];
    for b in 0..BUCKETS.len() {
        if traces.iter().any(|t| t.cohort.contains(&Some(b))) {
            cohorts.push(Some(b));
        }
    }

    let mut plots = Vec::new();
    if let Some(dir) = &a.plot {
        plots = write_plots(dir, &traces, &cohorts, a.min_requests)?;
    }
    let report = Report {
        traces: &traces,
        cohorts: &cohorts,
        min: a.min_requests,
        plots: &plots,
    };
    let mut out = std::io::stdout().lock();
    let r = if a.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&report.json())?)
    } else {
        report.write_text(&mut out)
    };
    match r {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("writing the comparison"),
    }
}

struct Report<'a> {
    traces: &'a [Trace],
    cohorts: &'a [Option<usize>],
    min: usize,
    plots: &'a [PathBuf],
}

impl Report<'_> {
    /// Every trace's stat of `metric` in cohort `c`, with its member count.
    fn row(&self, c: Option<usize>, metric: Metric) -> Vec<(usize, Stat)> {
        self.traces
            .iter()
            .map(|t| {
                let m = t.members(c);
                (m.len(), stat(&m, metric).0)
            })
            .collect()
    }

    fn write_text(&self, out: &mut impl Write) -> std::io::Result<()> {
        writeln!(
            out,
            "compare: {} traces; Δ % against the first",
            self.traces.len()
        )?;
        for t in self.traces {
            writeln!(
                out,
                "  {}: {} ({} records, {} compared)",
                t.label,
                t.path.display(),
                t.records,
                t.samples.len()
            )?;
        }
        let w = self
            .traces
            .iter()
            .map(|t| t.label.chars().count())
            .max()
            .unwrap_or(5)
            .clamp(5, 40);
        for metric in Metric::ALL {
            writeln!(out)?;
            writeln!(out, "{} (ms)", metric.name())?;
            writeln!(
                out,
                "{:<8} {:<w$} {:>7} {:>10} {:>10} {:>10} {:>8} {:>8} {:>8}",
                "cohort", "trace", "n", "p50", "p90", "p99", "Δ p50", "Δ p90", "Δ p99"
            )?;
            for &c in self.cohorts {
                let row = self.row(c, metric);
                let reference = &row[0].1;
                for (k, (t, (requests, s))) in self.traces.iter().zip(&row).enumerate() {
                    if *requests == 0 {
                        continue;
                    }
                    let first = if k == 0 {
                        if c.is_none() {
                            "all".to_string()
                        } else {
                            format!("c={}", cohort_label(c))
                        }
                    } else {
                        String::new()
                    };
                    let small = c.is_some() && *requests < self.min;
                    let n = format!("{}{}", s.samples, if small { "*" } else { "" });
                    let val = |x: Option<f64>| x.map_or("-".to_string(), fmt);
                    let delta = |qi: usize| {
                        if k == 0 {
                            String::new()
                        } else {
                            delta_pct(reference.q[qi], s.q[qi])
                                .map_or("-".to_string(), |d| format!("{d:+.1}"))
                        }
                    };
                    let line = format!(
                        "{first:<8} {:<w$} {n:>7} {:>10} {:>10} {:>10} {:>8} {:>8} {:>8}",
                        t.label,
                        val(s.q[0]),
                        val(s.q[1]),
                        val(s.q[2]),
                        delta(0),
                        delta(1),
                        delta(2)
                    );
                    writeln!(out, "{}", line.trim_end())?;
                }
            }
        }
        writeln!(out)?;
        writeln!(
            out,
            "n: requests (TTFT, request total) or gaps (ITL); * a cohort with fewer than {} requests in that trace",
            self.min
        )?;
        let turns = self.turns();
        if !turns.is_empty() {
            writeln!(out, "TTFT per session turn (p50 / p90 ms):")?;
            for (t, rows) in self.traces.iter().zip(&turns) {
                let cells: Vec<String> = rows
                    .iter()
                    .map(|(k, p50, p90)| format!("{k}: {} / {}", fmt(*p50), fmt(*p90)))
                    .collect();
                writeln!(out, "  {}: {}", t.label, cells.join(", "))?;
            }
        }
        if !self.plots.is_empty() {
            let dir = self.plots[0].parent().unwrap_or(Path::new("."));
            writeln!(
                out,
                "plots: {} SVG files in {}",
                self.plots.len(),
                dir.display()
            )?;
        }
        Ok(())
    }

    /// TTFT per session turn of every trace; empty when no trace has conversations.
    fn turns(&self) -> Vec<Vec<(u32, f64, f64)>> {
        let t: Vec<Vec<(u32, f64, f64)>> = self.traces.iter().map(turn_ttft).collect();
        if t.iter().all(Vec::is_empty) {
            Vec::new()
        } else {
            t
        }
    }

    fn json(&self) -> Value {
        let reference = &self.traces[0];
        let cohorts: Vec<Value> = self
            .cohorts
            .iter()
            .map(|&c| {
                // every trace's stats, once per metric
                let rows: Vec<Vec<(usize, Stat)>> =
                    Metric::ALL.iter().map(|&m| self.row(c, m)).collect();
                let per_trace: Vec<Value> = (0..self.traces.len())
                    .map(|k| {
                        let mut m = serde_json::Map::new();
                        m.insert("label".into(), json!(self.traces[k].label));
                        let requests = rows[0][k].0;
                        m.insert("requests".into(), json!(requests));
                        m.insert("small".into(), json!(c.is_some() && requests < self.min));
                        for (metric, row) in Metric::ALL.iter().zip(&rows) {
                            let (r, s) = (&row[0].1, &row[k].1);
                            let q: serde_json::Map<String, Value> = QUANTILES
                                .iter()
                                .zip(s.q)
                                .map(|((_, name), v)| (name.to_string(), json!(v)))
                                .collect();
                            let d: Value = if k == 0 {
                                Value::Null
                            } else {
                                Value::Object(
                                    QUANTILES
                                        .iter()
                                        .enumerate()
                                        .map(|(qi, (_, name))| {
                                            (name.to_string(), json!(delta_pct(r.q[qi], s.q[qi])))
                                        })
                                        .collect(),
                                )
                            };
                            m.insert(
                                metric.key().into(),
                                json!({"samples": s.samples, "quantiles": q, "delta_pct": d}),
                            );
                        }
                        Value::Object(m)
                    })
                    .collect();
                json!({"cohort": cohort_label(c), "traces": per_trace})
            })
            .collect();
        let turns: Vec<Value> = self
            .turns()
            .iter()
            .zip(self.traces)
            .map(|(rows, t)| {
                json!({
                    "label": t.label,
                    "ttft_ms": rows.iter().map(|(k, p50, p90)| json!({"turn": k, "p50": p50, "p90": p90})).collect::<Vec<_>>(),
                })
            })
            .collect();
        json!({
            "reference": reference.label,
            "traces": self.traces.iter().map(|t| json!({
                "label": t.label,
                "path": t.path,
                "records": t.records,
                "compared": t.samples.len(),
            })).collect::<Vec<_>>(),
            "min_requests": self.min,
            "cohorts": cohorts,
            "turns": turns,
            "plots": self.plots,
        })
    }
}

/// A value for the table: 4 significant figures.
fn fmt(x: f64) -> String {
    if x.abs() >= 100.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// (turn, p50, p90) of a trace's TTFT per session turn (turns with at least 5 requests).
fn turn_ttft(t: &Trace) -> Vec<(u32, f64, f64)> {
    per_turn(
        t.turn
            .iter()
            .copied()
            .zip(t.samples.iter().map(|s| s.ttft_ms)),
        5,
    )
}

fn write_plots(
    dir: &Path,
    traces: &[Trace],
    cohorts: &[Option<usize>],
    min: usize,
) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let names: Vec<&str> = traces.iter().map(|t| t.label.as_str()).collect();
    for &c in cohorts {
        let members: Vec<Vec<&Sample>> = traces.iter().map(|t| t.members(c)).collect();
        if c.is_some() && members.iter().any(|m| m.len() < min) {
            continue;
        }
        let who = match c {
            None => "all requests".to_string(),
            Some(_) => format!("{} in flight at arrival", cohort_label(c)),
        };
        for metric in [Metric::Ttft, Metric::Itl] {
            let values: Vec<Vec<f64>> = members.iter().map(|m| stat(m, metric).1).collect();
            let named: Vec<(&str, &[f64])> = names
                .iter()
                .zip(&values)
                .map(|(n, v)| (*n, v.as_slice()))
                .collect();
            let stem = format!(
                "{}-{{}}-{}.svg",
                metric.name().to_ascii_lowercase(),
                slug(cohort_label(c))
            );
            let path = plot::file(dir, &stem.replace("{}", "survival"))?;
            plot::survival(
                &path,
                &format!("{} survival — {who}", metric.name()),
                metric.name(),
                &named,
            )
            .with_context(|| format!("writing {}", path.display()))?;
            written.push(path);
            let path = plot::file(dir, &stem.replace("{}", "qq"))?;
            plot::qq(
                &path,
                &format!("{} Q-Q against {} — {who}", metric.name(), names[0]),
                metric.name(),
                (names[0], "other"),
                &named,
            )
            .with_context(|| format!("writing {}", path.display()))?;
            written.push(path);
        }
    }
    if traces.iter().any(|t| t.chunks.keys().any(|&k| k > 1)) {
        let path = plot::file(dir, "chunk-sizes.svg")?;
        let runs: Vec<(&str, &BTreeMap<u32, u64>)> = names
            .iter()
            .zip(traces)
            .map(|(n, t)| (*n, &t.chunks))
            .collect();
        plot::chunk_sizes(&path, "output chunk sizes", &runs)
            .with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    let turns: Vec<Vec<(u32, f64, f64)>> = traces.iter().map(turn_ttft).collect();
    if turns.iter().any(|t| !t.is_empty()) {
        let path = plot::file(dir, "ttft-per-turn.svg")?;
        let runs: Vec<(&str, &[plot::PerTurn])> = names
            .iter()
            .zip(&turns)
            .map(|(n, t)| (*n, t.as_slice()))
            .collect();
        plot::per_turn(&path, "TTFT per session turn", "TTFT", &runs)
            .with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}
