//! `--plot DIR`: the figures of a calibration, pooled and per gated cohort.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::compare::{self, BUCKETS, Cohort, Metric, SOURCES, Sample};
use crate::inspect::plot;

/// `--plot DIR`: the figures, pooled and per gated cohort.
#[allow(clippy::too_many_arguments)]
pub(super) fn write_plots(
    dir: &Path,
    trace: &Path,
    cohorts: &[Cohort],
    all: &[usize],
    by_bucket: &[Vec<usize>],
    triples: &[[&Sample; 3]],
    captured_chunks: &BTreeMap<u32, u64>,
    model_chunks: &BTreeMap<u32, u64>,
) -> Result<Vec<PathBuf>> {
    let name = trace.file_name().map_or_else(
        || trace.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let mut written = Vec::new();
    for c in cohorts.iter().filter(|c| c.gated) {
        let members: &[usize] = if c.label == "all" {
            all
        } else {
            let b = BUCKETS
                .iter()
                .position(|x| x.2 == c.label)
                .expect("a bucket");
            &by_bucket[b]
        };
        let who = if c.label == "all" {
            format!("all requests (n = {})", c.requests)
        } else {
            format!("{} in flight at arrival (n = {})", c.label, c.requests)
        };
        for metric in [Metric::Ttft, Metric::Itl] {
            let per: Vec<Vec<f64>> = (0..SOURCES.len())
                .map(|src| {
                    let mut v = Vec::new();
                    for &i in members {
                        metric.extend(triples[i][src], &mut v);
                    }
                    v
                })
                .collect();
            let samples: Vec<(&str, &[f64])> = SOURCES
                .iter()
                .zip(&per)
                .map(|(s, v)| (*s, v.as_slice()))
                .collect();
            let stem = format!(
                "{}-{{}}-{}.svg",
                metric.name().to_ascii_lowercase(),
                compare::slug(&c.label)
            );
            let path = plot::file(dir, &stem.replace("{}", "survival"))?;
            plot::survival(
                &path,
                &format!("{} survival — {name}, {who}", metric.name()),
                metric.name(),
                &samples,
            )
            .with_context(|| format!("writing {}", path.display()))?;
            written.push(path);
            let path = plot::file(dir, &stem.replace("{}", "qq"))?;
            plot::qq(
                &path,
                &format!("{} Q-Q — {name}, {who}", metric.name()),
                metric.name(),
                ("captured", "simulated"),
                &samples,
            )
            .with_context(|| format!("writing {}", path.display()))?;
            written.push(path);
        }
    }
    if captured_chunks.keys().any(|&k| k > 1) {
        let path = plot::file(dir, "chunk-sizes.svg")?;
        plot::chunk_sizes(
            &path,
            &format!("output chunk sizes — {name}"),
            &[("captured", captured_chunks), ("modelled", model_chunks)],
        )
        .with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}
