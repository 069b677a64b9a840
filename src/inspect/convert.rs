//! `inspect convert` — being written.

use anyhow::{Result, bail};
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct ConvertArgs {}

pub fn run(_args: &ConvertArgs) -> Result<()> {
    bail!("inspect convert is not implemented yet")
}
