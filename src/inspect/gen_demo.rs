//! `inspect gen_demo` — being written.

use anyhow::{Result, bail};
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct GenDemoArgs {}

pub fn run(_args: &GenDemoArgs) -> Result<()> {
    bail!("inspect gen_demo is not implemented yet")
}
