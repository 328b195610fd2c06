//! The `mps-daemon` subcommand: the program inside a claim's MPS daemon pod (created by
//! the plugin's pod launcher, `mps_pod`). It supervises the claim's `nvidia-cuda-mps-control`
//! daemon and quits it on SIGTERM.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use cleave_driver::sharing::SharingBinaries;
use cleave_driver::sharing::supervise::{SuperviseConfig, SuperviseOutcome, supervise};

use crate::args::MpsDaemonArgs;

/// The `mps-daemon` subcommand: supervises the claim's control daemon until SIGTERM (then
/// `quit`) or until the daemon exits by itself; exits 0 in both cases.
pub(crate) async fn run(args: MpsDaemonArgs) -> anyhow::Result<ExitCode> {
    let var = |name: &str| {
        std::env::var(name).with_context(|| format!("{name} is not set (the pod sets it)"))
    };
    let control_bin = args
        .mps_control_bin
        .clone()
        .unwrap_or_else(|| SharingBinaries::under_driver_root(&args.driver_root).mps_control);
    let config = SuperviseConfig {
        claim_uid: std::env::var("CLEAVE_CLAIM_UID").unwrap_or_default(),
        control_bin,
        driver_root: args.driver_root.clone(),
        lib_dir: Some(args.lib_dir.clone()),
        pipe_dir: var("CUDA_MPS_PIPE_DIRECTORY")?.into(),
        log_dir: var("CUDA_MPS_LOG_DIRECTORY")?.into(),
        env: Vec::new(),
        multi_user: args.multi_user,
        start_timeout: Duration::from_secs(args.start_timeout_secs),
        stop_timeout: Duration::from_secs(args.stop_timeout_secs),
        poll: Duration::from_millis(200),
        reap_orphans: std::process::id() == 1,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let mut signals = crate::daemon::ShutdownSignals::install()?;
    let work = {
        let stop = Arc::clone(&stop);
        tokio::task::spawn_blocking(move || supervise(&config, &stop, &mut std::io::stdout()))
    };
    tokio::pin!(work);
    let result = tokio::select! {
        r = &mut work => r,
        signal = signals.recv() => {
            tracing::info!(signal, "stopping");
            stop.store(true, Ordering::SeqCst);
            work.await
        }
    };
    match result.context("the supervisor panicked")? {
        Ok(SuperviseOutcome::Stopped) => {
            tracing::info!("MPS control daemon stopped");
            Ok(ExitCode::SUCCESS)
        }
        Ok(SuperviseOutcome::Exited) => Ok(ExitCode::SUCCESS),
        Err(e) => Err(e.into()),
    }
}
