//! `inspect perfetto` — being written.

use anyhow::{Result, bail};
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct PerfettoArgs {}

pub fn run(_args: &PerfettoArgs) -> Result<()> {
    bail!("inspect perfetto is not implemented yet")
}
