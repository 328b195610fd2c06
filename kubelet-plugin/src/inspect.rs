//! `inspect`: what this node has and what it would publish, without a cluster.

use std::process::ExitCode;

use anyhow::Context as _;
use cleave_controller::{SliceLayout, slices_yaml};
use cleave_driver::backend::GpuBackend as _;
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::pool::{PoolOptions, build_pool, silent_gpus};

use crate::args::InspectArgs;

/// Discovers the GPUs and prints a table (or ResourceSlice YAML with `--yaml`) on stdout.
pub(crate) fn run(args: &InspectArgs) -> anyhow::Result<ExitCode> {
    let backend =
        NvmlBackend::open_in_driver_root(&args.driver_root, args.nvml.nvml_lib.as_deref())
            .context("loading NVML")?
            .with_sysfs_root(&args.nvml.sysfs_root);
    let inventory = backend.inventory().context("discovering GPUs")?;
    let options = PoolOptions {
        dynamic_mig: args.dynamic_mig,
        consumable_capacity: args.consumable_capacity,
        share_on_demand_mig: args.share_on_demand_mig,
        ..PoolOptions::default()
    };
    let pool = build_pool(&inventory, &options);
    let out = if args.yaml {
        // The table names silent GPUs itself; YAML cannot, so say it on stderr.
        for silent in silent_gpus(&inventory, &options) {
            eprintln!(
                "note: {} ({}) publishes no device: {}",
                silent.name, silent.uuid, silent.reason
            );
        }
        let node = args.node_name.clone().unwrap_or_else(hostname);
        let layout = SliceLayout::for_server_version("1", &args.kubernetes_minor.to_string());
        slices_yaml(&pool, layout, &args.driver_name, &node).context("planning ResourceSlices")?
    } else {
        cleave_driver::inspect::render_table(&inventory, &pool)
    };
    write_stdout(&out)?;
    Ok(ExitCode::SUCCESS)
}

/// This host's name, the pool name a plugin on it would use.
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// Writes to stdout; a closed pipe (`inspect | head`) is not an error.
pub(crate) fn write_stdout(text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r,
    }
}
