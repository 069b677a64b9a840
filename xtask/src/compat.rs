//! The supported vLLM lines, read from compat.toml at the workspace root.

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
pub struct Line {
    /// `0.25` … `0.33`: what `vllm-vcr play --vllm-version` takes.
    pub line: String,
    /// The exact PyPI `vllm` release whose `vllm-rs` the e2e runs for this line.
    pub tag: String,
    #[serde(default)]
    pub default: bool,
    #[serde(default)]
    pub fidelity_validated: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct PythonFrontend {
    pub package: String,
    pub version: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Compat {
    pub vllm: Vec<Line>,
    pub python_frontend: PythonFrontend,
}

impl Compat {
    pub fn load(root: &Path) -> Result<Compat> {
        let path = root.join("compat.toml");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let c: Compat =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        if c.vllm.iter().filter(|l| l.default).count() != 1 {
            bail!(
                "{}: exactly one [[vllm]] line must have default = true",
                path.display()
            );
        }
        Ok(c)
    }

    /// The lines named on the command line (by line `0.27` or tag `0.27.1`), or all of them.
    pub fn select(&self, wanted: &[String]) -> Result<Vec<Line>> {
        if wanted.is_empty() {
            return Ok(self.vllm.clone());
        }
        wanted
            .iter()
            .map(|w| {
                let w = w.trim_start_matches('v');
                self.vllm
                    .iter()
                    .find(|l| l.line == w || l.tag == w)
                    .cloned()
                    .with_context(|| {
                        let known: Vec<&str> = self.vllm.iter().map(|l| l.line.as_str()).collect();
                        format!(
                            "unknown vLLM line {w:?} (compat.toml has {})",
                            known.join(", ")
                        )
                    })
            })
            .collect()
    }
}
