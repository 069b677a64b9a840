//! The model under test as a fit set: its files, and whether the calibrated trace is among
//! what it was fitted to (in-sample) or another engine configuration's.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use sim_trace::fit::FittedModel;

use crate::inspect::fit_config::{OtherConfig, fit_set_hashes, other_config};
use crate::inspect::fit_reach::PromptReach;
use crate::inspect::output::same_file;

/// The model under test, and whether the calibrated trace is among what it was fitted to.
pub(super) struct FitSet {
    pub(super) paths: Vec<PathBuf>,
    pub(super) in_sample: bool,
    pub(super) why: String,
    /// The fit set's config hashes when one differs from the trace's: the model is
    /// another engine's, so its deltas mix the model's error with the configuration's.
    pub(super) other_config: Option<OtherConfig>,
    /// The longest prompt the model's captures held (a model file's; a fit set of traces
    /// is fitted by the run itself and not read twice here).
    pub(super) reach: Option<PromptReach>,
}

/// Two files with the same bytes (a copy of the trace counts as the trace).
fn same_content(a: &Path, b: &Path) -> bool {
    let len = |p: &Path| std::fs::metadata(p).map(|m| m.len()).ok();
    if len(a).is_none() || len(a) != len(b) {
        return false;
    }
    match (std::fs::read(a), std::fs::read(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

impl FitSet {
    /// Which fit set `paths` is, and whether `trace` is in it: a trace given as itself
    /// (or a byte-identical copy), or a model whose sources are this trace (the same file or
    /// the same bytes). The captures of a corpus share their `config_hash` and often their
    /// record count, so neither says which trace a model saw.
    pub(super) fn of(trace: &Path, paths: &[PathBuf], trace_hash: Option<&str>) -> Result<FitSet> {
        let mut why = None;
        let mut reach = None;
        let other_config = other_config(trace_hash, &fit_set_hashes(paths)?);
        for p in paths {
            if FittedModel::is_model_file(p) {
                let m = FittedModel::load(p)
                    .with_context(|| format!("--latency-trace {}", p.display()))?;
                reach = reach.or_else(|| PromptReach::of(&m));
                for s in &m.meta.sources {
                    let src = Path::new(&s.trace);
                    if same_file(src, trace) || same_content(src, trace) {
                        why = Some(format!(
                            "the model {} was fitted to this trace",
                            p.display()
                        ));
                    }
                }
            } else if same_file(p, trace) || same_content(p, trace) {
                why = Some(format!("{} is in the fit set", p.display()));
            }
            if why.is_some() {
                break;
            }
        }
        Ok(FitSet {
            paths: paths.to_vec(),
            in_sample: why.is_some(),
            why: why.unwrap_or_else(|| {
                "the trace is not in the fit set: an out-of-sample check".to_string()
            }),
            other_config,
            reach,
        })
    }

    pub(super) fn relation(&self) -> &'static str {
        if self.in_sample {
            "in-sample"
        } else {
            "counterfactual"
        }
    }
}
