//! Whether a latency model (or the captures it would be fitted on) comes from the same
//! engine configuration as the trace it is asked about.
//!
//! A capture's `config_hash` covers the host CPU, the capture rig and the engine flags: a
//! model fitted under another hash is another engine's, and a comparison with it measures
//! the configuration change as much as the model. `calibrate`, `simulate` and
//! `calibrate-e2e` say so loudly, in their text and their JSON, rather than leave a user
//! to read a −45 % table as the model's error.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{Value, json};
use sim_trace::fit::FittedModel;

/// The fit set was captured under other configurations than the trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtherConfig {
    /// The trace's `config_hash` (lower case).
    pub trace: String,
    /// The fit set's hashes that differ from it.
    pub fit: Vec<String>,
}

impl OtherConfig {
    /// One sentence for a warning line.
    pub fn describe(&self) -> String {
        format!(
            "the model was fitted on another configuration (config_hash {} ≠ the trace's {}): the deltas measure the configuration change as much as the model",
            self.fit.join(", "),
            self.trace
        )
    }

    /// The JSON form: both hashes and the warning.
    pub fn json(&self) -> Value {
        json!({ "trace": self.trace, "fit": self.fit, "warning": self.describe() })
    }
}

/// The `config_hash`es a fit set was captured under: a model file's sources, or each
/// trace's meta line.
pub fn fit_set_hashes(paths: &[PathBuf]) -> Result<Vec<String>> {
    let mut hashes = Vec::new();
    for p in paths {
        hashes.extend(hashes_of(p)?);
    }
    Ok(hashes)
}

fn hashes_of(p: &Path) -> Result<Vec<String>> {
    if FittedModel::is_model_file(p) {
        let m = FittedModel::load(p).with_context(|| format!("--latency-trace {}", p.display()))?;
        return Ok(m
            .meta
            .sources
            .iter()
            .filter_map(|s| s.config_hash.clone())
            .collect());
    }
    if let Ok(mut r) = sim_trace::trace::TraceReader::open(p)
        && let Ok((Some(meta), _)) = r.read_header()
    {
        return Ok(meta.config_hash.into_iter().collect());
    }
    Ok(Vec::new())
}

/// The fit set's hashes that differ from the trace's, if the trace has one.
pub fn other_config(trace_hash: Option<&str>, fit_hashes: &[String]) -> Option<OtherConfig> {
    let t = trace_hash?.to_ascii_lowercase();
    let mut fit: Vec<String> = fit_hashes
        .iter()
        .map(|h| h.to_ascii_lowercase())
        .filter(|h| *h != t)
        .collect();
    fit.sort();
    fit.dedup();
    (!fit.is_empty()).then_some(OtherConfig { trace: t, fit })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_hashes_that_differ_are_named_once_each() {
        let fit = vec!["AB".to_string(), "cd".into(), "ab".into(), "cd".into()];
        let o = other_config(Some("ab"), &fit).unwrap();
        assert_eq!(o.fit, vec!["cd".to_string()]);
        assert!(o.describe().contains("cd ≠ the trace's ab"));
        assert_eq!(other_config(Some("ab"), &["AB".to_string()]), None);
        assert_eq!(other_config(None, &fit), None);
    }
}
