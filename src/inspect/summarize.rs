//! `inspect summarize` — being written.

use anyhow::{Result, bail};
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct SummarizeArgs {}

pub fn run(_args: &SummarizeArgs) -> Result<()> {
    bail!("inspect summarize is not implemented yet")
}
