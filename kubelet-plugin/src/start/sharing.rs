//! The sharing manager's start: MPS daemons as host processes, or in pods of their own.

use std::sync::Arc;

use cleave_driver::prepare::DriverConfig;
use cleave_driver::sharing::{ProcessLauncher, SharingBinaries, SharingConfig, SharingManager};
use tracing::info;

use super::StartError;
use crate::args::{MpsLauncherKind, RunArgs};
use crate::k8s::events::StartNode;

/// The sharing (MPS, time-slicing) settings `run` derives from its flags: tools under
/// the driver root unless given explicitly, state in the driver's state directory.
pub(crate) fn sharing_config(args: &RunArgs, driver: &DriverConfig) -> SharingConfig {
    let binaries = SharingBinaries::under_driver_root(&args.driver.driver_root).with_overrides(
        args.driver.mps_control_bin.clone(),
        args.driver.nvidia_smi_bin.clone(),
    );
    SharingConfig {
        boot_id_path: driver.boot_id_path.clone(),
        pipe_root: Some(args.mps.mps_pipe_root.clone()),
        ..SharingConfig::new(driver.state_dir.clone(), binaries)
    }
}

/// The sharing manager `run` uses: daemons as host processes, or (`--mps-launcher=pod`) in
/// pods of their own created through `client`, learned from `node_pods` when given.
pub(crate) async fn sharing_manager(
    args: &RunArgs,
    driver: &DriverConfig,
    client: &kube::Client,
    node: &StartNode,
    node_pods: Option<Arc<crate::k8s::node_pods::NodePods>>,
) -> Result<SharingManager, StartError> {
    let config = sharing_config(args, driver);
    if args.mps.mps_launcher == MpsLauncherKind::Process {
        return Ok(SharingManager::new(config));
    }
    let mps = &args.mps;
    let namespace = mps.namespace.clone().ok_or(StartError::MissingFlag {
        flag: "--mps-launcher=pod",
        needs: "--namespace (POD_NAMESPACE)",
    })?;
    let image = mps
        .mps_daemon_image
        .clone()
        .ok_or(StartError::MissingFlag {
            flag: "--mps-launcher=pod",
            needs: "--mps-daemon-image",
        })?;
    let parent = crate::k8s::mps_pod::resolve_parent(
        client,
        &namespace,
        mps.pod_name.as_deref(),
        &args.node_name,
        node.uid(),
    )
    .await
    .map_err(|e| StartError::MpsPodOwner(e.into()))?;
    info!(namespace = %namespace, image = %image, owner = %format!("{}/{}", parent.owner.kind, parent.owner.name), "MPS daemons run in pods");
    let launcher = crate::k8s::mps_pod::PodLauncher::new(
        crate::k8s::mps_pod::PodLauncherConfig {
            namespace,
            node_name: args.node_name.clone(),
            image,
            image_pull_policy: mps.mps_daemon_image_pull_policy.clone(),
            priority_class: mps.mps_daemon_priority_class.clone(),
            service_account: mps.mps_daemon_service_account.clone(),
            owner: parent.owner,
            image_pull_secrets: parent.image_pull_secrets,
            control_bin: args.driver.mps_control_bin.clone(),
            state_dir: config.state_dir.clone(),
            host_state_dir: config
                .host_state_dir
                .clone()
                .unwrap_or_else(|| config.state_dir.clone()),
            host_driver_root: args
                .driver
                .host_driver_root
                .clone()
                .unwrap_or_else(|| args.driver.driver_root.clone()),
            kubelet_root: mps.kubelet_root_dir.clone(),
            command: vec![
                "/usr/bin/cleave-kubelet-plugin".to_owned(),
                "mps-daemon".to_owned(),
            ],
            container_pipe_dir: config.container_pipe_dir.clone(),
            api_timeout: std::time::Duration::from_secs(10),
            poll: std::time::Duration::from_millis(100),
        },
        client.clone(),
        tokio::runtime::Handle::current(),
        ProcessLauncher::new(
            &config.binaries.mps_control,
            config.extra_env.clone(),
            &config.boot_id_path,
        ),
        node_pods,
    );
    Ok(SharingManager::with_launcher(config, Arc::new(launcher)))
}
