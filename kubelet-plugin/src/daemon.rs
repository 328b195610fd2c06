//! `run`: the node daemon.
use std::process::ExitCode;

use crate::cli::RunArgs;

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(_args: RunArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("run: waiting for cleave-driver's prepare module")
}
