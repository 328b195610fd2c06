//! The node driver's start: its settings from the flags, the CDI hook, NVML, and
//! `NodeDriver::start` (checkpoint load and recovery) with the instance lock, both under the
//! node lock.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cleave_driver::backend::GpuBackend;
use cleave_driver::driver_root::DriverRootConfig;
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::pool::PoolOptions;
use cleave_driver::prepare::{DriverConfig, NodeDriver};
use tracing::{info, warn};

use super::{DriverNotReady, StartError, StartInputs};
use crate::args::{KubeletArgs, RunArgs};
use crate::k8s::node_pods::NodePods;
use crate::kubelet::server::PluginConfig;
use crate::node::node_lock::NodeLock;

/// The kernel's boot ID; the driver forgets prepared claims of an earlier boot.
pub(crate) const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// The socket and state layout the kubelet flags describe.
pub(crate) fn plugin_config(args: &KubeletArgs) -> PluginConfig {
    PluginConfig::new(
        args.driver_name.clone(),
        args.kubelet_registrar_directory_path.clone(),
        args.kubelet_plugins_directory_path.clone(),
    )
    .with_pod_uid(args.pod_uid.clone())
}

/// The driver settings `run` derives from its flags.
pub(crate) fn driver_config(args: &RunArgs, plugin: &PluginConfig) -> DriverConfig {
    DriverConfig {
        driver_name: plugin.driver_name.clone(),
        pool_name: args.node_name.clone(),
        state_dir: plugin.data_dir(),
        cdi_root: args.driver.cdi_root.clone(),
        driver_root: DriverRootConfig {
            host_root: args.driver.host_driver_root.clone(),
            ..DriverRootConfig::at(args.driver.driver_root.clone())
        },
        dynamic_mig: args.driver.dynamic_mig,
        boot_id_path: PathBuf::from(BOOT_ID_PATH),
        cdi_hook: None,
        consumable_capacity: args.driver.consumable_capacity,
    }
}

/// Installs the CDI hook (unless `--disable-cdi-hooks`) and returns its host path.
fn install_cdi_hook(args: &RunArgs, state_dir: &Path) -> Result<Option<PathBuf>, StartError> {
    if args.driver.disable_cdi_hooks {
        warn!("CDI hooks disabled: claims' containers get no soname links and no ld cache update");
        return Ok(None);
    }
    let source = crate::node::cdi_hook::source_path(args.driver.cdi_hook_source.as_deref())
        .map_err(StartError::CdiHook)?;
    crate::node::cdi_hook::install(&source, state_dir)
        .map(Some)
        .map_err(StartError::CdiHook)
}

/// Loads NVML for the driver under `driver_root` (the root's libraries first, then the
/// system's, or `nvml_lib` when given) and checks it sees GPUs; the error says why the
/// driver is not usable yet, naming every library path tried.
pub(super) async fn open_backend(
    driver_root: PathBuf,
    nvml_lib: Option<PathBuf>,
    allow_no_gpus: bool,
    sysfs_root: PathBuf,
) -> Result<Arc<dyn GpuBackend>, StartError> {
    tokio::task::spawn_blocking(move || -> Result<Arc<dyn GpuBackend>, DriverNotReady> {
        let backend = NvmlBackend::open_in_driver_root(&driver_root, nvml_lib.as_deref())
            .map_err(DriverNotReady::Load)?
            .with_sysfs_root(sysfs_root);
        let inventory = backend.inventory().map_err(DriverNotReady::Inventory)?;
        if inventory.gpus.is_empty() && !allow_no_gpus {
            return Err(DriverNotReady::NoGpus);
        }
        Ok(Arc::new(backend))
    })
    .await
    .map_err(StartError::Task)?
    .map_err(StartError::DriverNotReady)
}

/// Starts the node driver with its sharing manager (`node_pods`: the pod watch the MPS pod
/// launcher learns from), then takes the instance lock, both under the node lock: from then
/// on `checkpoint reset` sees a running plugin and refuses.
pub(super) async fn start_driver(
    inputs: &StartInputs<'_>,
    backend: &Arc<dyn GpuBackend>,
    node_lock: &NodeLock,
    node_pods: Option<Arc<NodePods>>,
) -> Result<(Arc<NodeDriver>, std::fs::File), StartError> {
    let args = inputs.args;
    let mut config = driver_config(args, inputs.plugin);
    config.cdi_hook = install_cdi_hook(args, &config.state_dir)?;
    let sharing = Arc::new(
        super::sharing::sharing_manager(args, &config, inputs.client, inputs.node, node_pods)
            .await?,
    );
    let backend = Arc::clone(backend);
    let state_dir = inputs.plugin.data_dir();
    // --device-metadata: the files copy the attributes of the pool as published.
    let metadata_pool = args.claim_info.device_metadata.then(|| PoolOptions {
        dynamic_mig: args.driver.dynamic_mig,
        consumable_capacity: args.driver.consumable_capacity,
        share_on_demand_mig: args.driver.share_on_demand_mig,
        ..PoolOptions::default()
    });
    let (driver, lock) = node_lock
        .run(move || {
            let driver = NodeDriver::start_with_sharing(config, backend, sharing)
                .map_err(StartError::from_driver)?;
            if let Some(pool) = metadata_pool {
                driver.enable_device_metadata(pool);
                info!("device metadata files on (--device-metadata)");
            }
            let lock =
                crate::node::lifecycle::hold_instance_lock(&state_dir).map_err(|source| {
                    StartError::InstanceLock {
                        path: state_dir.join(crate::node::lifecycle::INSTANCE_LOCK_FILE),
                        source,
                    }
                })?;
            Ok::<_, StartError>((driver, lock))
        })
        .await
        .map_err(StartError::NodeLock)??;
    Ok((Arc::new(driver), lock))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::cdi_hook::CdiHookError;
    use clap::Parser as _;

    #[derive(clap::Parser)]
    struct T {
        #[command(flatten)]
        run: RunArgs,
    }

    #[test]
    fn a_missing_cdi_hook_is_a_typed_start_error_naming_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("no-hook");
        let argv = ["x", "--node-name", "n1", "--cdi-hook-source"];
        let mut args = T::try_parse_from(argv.iter().copied().chain([source.to_str().unwrap()]))
            .unwrap()
            .run;
        let e = install_cdi_hook(&args, &dir.path().join("state")).unwrap_err();
        assert!(
            matches!(&e, StartError::CdiHook(CdiHookError::Read { path, .. }) if path.ends_with("no-hook")),
            "{e:?}"
        );
        assert!(!e.is_retried());
        assert!(e.chain().contains("--disable-cdi-hooks"), "{}", e.chain());
        args.driver.disable_cdi_hooks = true;
        assert_eq!(install_cdi_hook(&args, dir.path()).unwrap(), None);
    }
}
