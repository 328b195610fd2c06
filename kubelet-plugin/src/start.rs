//! Start-up: NVML -> node driver (checkpoint load and reconcile, under the node lock) ->
//! release of checkpointed claims the API server no longer has -> pool -> slice
//! publisher -> DRA service, then registration ([`start_with_backend`]).
//!
//! Start-up waits instead of crashing on a late NVIDIA driver or an unreadable checkpoint:
//! [`start_when_possible`] retries with a bounded exponential backoff
//! (`--retry-initial-ms` .. `--retry-max-ms`, default 1 s .. 30 s), as the [`StartError`]
//! variant says:
//! - [`StartError::DriverNotReady`]: NVML cannot be loaded or initialised, or finds no GPU
//!   (the driver is not installed yet). Zero GPUs counts as "driver not ready" unless
//!   `--allow-no-gpus` (a node that has the library but no GPU then publishes an empty pool);
//! - [`StartError::CheckpointUnreadable`]: the checkpoint cannot be read (corrupt, bad
//!   checksum, unknown layout version, I/O error). The plugin never resets it by itself,
//!   since pods may still use its claims: it logs the path and reason, sets
//!   `cleave_kubelet_plugin_checkpoint_healthy` to 0, counts
//!   `cleave_kubelet_plugin_checkpoint_errors_total`, posts a Warning Event
//!   `CheckpointUnreadable` on the Node naming the one recovery command
//!   (`cleave-kubelet-plugin checkpoint reset`, see [`crate::node::lifecycle::reset_checkpoint`]),
//!   and reads the file again on every retry, so an operator's fix is picked up without a
//!   restart;
//! - the other variants (the API server's configuration, bad flags, the sockets taken by
//!   another instance, the state directory, the node driver, the servers) end start-up.
//!
//! Each step returns its variant where it fails (see the `error` module), so the caller
//! matches variants.
//!
//! Meanwhile nothing is registered with the kubelet (no prepare can arrive), no slice is
//! published (an empty pool would tell the scheduler the node has no GPUs), `/readyz`
//! answers 503 with the reason, and `/healthz` stays 200 (the process works; a restart would
//! not help).

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Context as _;
use cleave_controller::SlicePublisher;
use cleave_driver::backend::GpuBackend;
use cleave_driver::model::BareGpuInstance;
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::prepare::NodeDriver;
use tracing::{info, warn};

use crate::args::RunArgs;
use crate::k8s::events::StartNode;
use crate::k8s::kube_handler::release_orphaned_claims;
use crate::kubelet::server::{PluginConfig, PluginServer};
use crate::metrics::Metrics;
use crate::node::node_lock::NodeLock;

mod api;
mod driver;
mod error;
mod kubelet;
mod retry;
mod sharing;
mod usage;

pub(crate) use api::kube_client;
pub(crate) use driver::plugin_config;
pub(crate) use error::{DriverNotReady, StartError};
pub(crate) use retry::{Blocker, StartContext, driver_not_ready_event, start_when_possible};

/// A started plugin: driver, slice publisher and gRPC servers.
pub struct RunningPlugin {
    /// The GPU backend (NVML).
    pub backend: Arc<dyn GpuBackend>,
    /// The node driver.
    pub driver: Arc<NodeDriver>,
    /// The node lock shared by every prepare and unprepare.
    pub(crate) node_lock: NodeLock,
    /// Publishes the pool as ResourceSlices.
    pub publisher: SlicePublisher,
    /// The DRA and registration servers.
    pub server: PluginServer,
    /// Why devices are not published yet: NVML sees GPUs but the driver root holds no
    /// driver files (see `NodeDriver::missing_driver`).
    pub driver_wait: Option<String>,
    /// The pool to publish once the driver's files are there.
    pub pending_pool: Option<cleave_api::pool::PoolDevices>,
    /// The shared instance lock, held until the plugin is dropped (see
    /// [`crate::node::lifecycle::INSTANCE_LOCK_FILE`]).
    pub instance_lock: std::fs::File,
    /// GPU instances without compute instance when the pool was built (their placements
    /// are published as taken; the periodic check republishes when they change).
    pub bare_gpu_instances: BTreeMap<String, Vec<BareGpuInstance>>,
    /// The per-claim usage sampling thread (`None` with `--usage-interval=0`).
    pub usage: Option<crate::node::usage::UsageMonitor>,
    /// Held by every prepare and unprepare batch; usage sampling waits at it meanwhile.
    pub sampling_gate: cleave_driver::usage::SamplingGate,
    /// The claim status writer (`None` with `--claim-device-status=false`): flushed at
    /// shutdown.
    pub(crate) status_writer: Option<crate::k8s::claim_status::ClaimStatusWriter>,
}

impl std::fmt::Debug for RunningPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningPlugin")
            .field("driver", &self.driver)
            .field("server", &self.server)
            .finish_non_exhaustive()
    }
}

/// Starts everything `run` runs, in order: NVML, node driver (checkpoint load and
/// reconcile, under the node lock), release of claims deleted while down, pool, slice
/// publisher, then the DRA and registration servers.
pub async fn start(args: &RunArgs, client: kube::Client) -> anyhow::Result<RunningPlugin> {
    Ok(start_with_metrics(args, client, None).await?)
}

/// [`start`], recording DRA calls in `metrics`.
pub(crate) async fn start_with_metrics(
    args: &RunArgs,
    client: kube::Client,
    metrics: Option<Arc<Metrics>>,
) -> Result<RunningPlugin, StartError> {
    let nvml_lib = args.nvml.nvml_lib.clone();
    let driver_root = args.driver.driver_root.clone();
    let sysfs_root = args.nvml.sysfs_root.clone();
    let backend: Arc<dyn GpuBackend> = Arc::new(
        tokio::task::spawn_blocking(move || {
            NvmlBackend::open_in_driver_root(&driver_root, nvml_lib.as_deref())
                .map(|b| b.with_sysfs_root(sysfs_root))
        })
        .await
        .map_err(StartError::Task)?
        .map_err(|e| StartError::DriverNotReady(DriverNotReady::Load(e)))?,
    );
    let node = StartNode::read(&client, &args.node_name).await;
    start_with_backend(args, client, metrics, backend, &node).await
}

/// [`start_with_metrics`] on an already loaded backend (see [`start_when_possible`],
/// which retries while NVML or the checkpoint is not usable). `node` is the Node as read
/// once at start: its UID goes to the slice publisher and the daemon pods' owner, so neither
/// reads it again.
pub(crate) async fn start_with_backend(
    args: &RunArgs,
    client: kube::Client,
    metrics: Option<Arc<Metrics>>,
    backend: Arc<dyn GpuBackend>,
    node: &StartNode,
) -> Result<RunningPlugin, StartError> {
    let plugin = plugin_config(&args.kubelet);
    plugin.prepare_dirs().map_err(StartError::Dirs)?;
    // Before the checkpoint or the API server is touched: a second instance on the same
    // socket names stops here, naming the one that runs.
    crate::kubelet::server::check_sockets_free(&plugin)
        .await
        .map_err(StartError::Sockets)?;
    let inputs = StartInputs {
        args,
        plugin: &plugin,
        client: &client,
        node,
        metrics: metrics.as_ref(),
    };
    let node_lock = NodeLock::new(plugin.lock_file());
    // One watch on this node's pods, started on first need, serves usage sampling (which
    // pods consume each claim) and, with the pod launcher, the MPS daemon pods. Only with
    // sampling on: the chart grants the cluster-wide pod list and watch it needs with it.
    let node_pods = (!args.usage.usage_interval.is_zero()).then(|| {
        Arc::new(crate::k8s::node_pods::NodePods::new(
            client.clone(),
            &args.node_name,
            tokio::runtime::Handle::current(),
        ))
    });
    let (driver, instance_lock) =
        driver::start_driver(&inputs, &backend, &node_lock, node_pods.clone()).await?;

    let released = release_orphaned_claims(&client, &driver, &node_lock).await;
    if !released.is_empty() {
        info!(
            claims = released.len(),
            "released claims deleted while the plugin was down"
        );
    }

    let found = api::Discovered::new(&inputs, &driver);
    let health = crate::node::device_health::start_for_plugin(
        &args.health,
        backend.as_ref(),
        &args.node_name,
        &found.pool,
        &found.inventory,
        &driver,
        metrics
            .clone()
            .map(|m| m as Arc<dyn crate::node::device_health::DeviceHealthObserver>),
    );
    let published = api::publish(&inputs, &driver, found).await;
    let sampling_gate = cleave_driver::usage::SamplingGate::new();
    let usage = usage::start_usage(
        args,
        node_pods,
        backend.as_ref(),
        &driver,
        metrics.as_ref(),
        &published.events,
        &sampling_gate,
    );
    let servers = kubelet::start_servers(
        &inputs,
        &driver,
        &node_lock,
        health,
        published.events,
        &sampling_gate,
    )
    .await?;
    Ok(RunningPlugin {
        backend,
        driver,
        node_lock,
        publisher: published.publisher,
        server: servers.server,
        driver_wait: published.driver_wait,
        pending_pool: published.pending_pool,
        instance_lock,
        bare_gpu_instances: published.bare_gpu_instances,
        usage,
        sampling_gate,
        status_writer: servers.status_writer,
    })
}

/// What every start step reads: the flags, the socket and state layout, the API client,
/// the Node as read at start, and the metrics when served.
struct StartInputs<'a> {
    args: &'a RunArgs,
    plugin: &'a PluginConfig,
    client: &'a kube::Client,
    node: &'a StartNode,
    metrics: Option<&'a Arc<Metrics>>,
}

impl RunningPlugin {
    /// Stops the servers (removing this instance's sockets), then the publisher; the
    /// ResourceSlices stay.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        if let Some(u) = self.usage {
            let _ = tokio::task::spawn_blocking(move || u.stop()).await;
        }
        let stopped = self.server.shutdown().await;
        // No batch runs any more: what the writer still holds is written now, once, so a
        // claim's entries do not wait for the next start (which would read the claim again).
        if let Some(writer) = &self.status_writer {
            match writer.flush(STATUS_FLUSH_TIMEOUT).await {
                Some(0) => {}
                Some(left) => warn!(
                    left,
                    "claim status writes still failing at shutdown; the next start writes them"
                ),
                None => warn!(
                    timeout_s = STATUS_FLUSH_TIMEOUT.as_secs(),
                    "claim status writes not done at shutdown; the next start writes them"
                ),
            }
        }
        self.publisher.shutdown().await;
        stopped.context("stopping the plugin servers")
    }
}

/// How long shutdown waits for the claim status writes still pending.
const STATUS_FLUSH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::start::driver::{BOOT_ID_PATH, driver_config};
    use crate::start::sharing::sharing_config;
    use clap::Parser as _;
    use std::path::Path;

    #[derive(clap::Parser)]
    struct T {
        #[command(flatten)]
        run: RunArgs,
    }

    fn run_args(extra: &[&str]) -> RunArgs {
        let mut argv = vec!["x", "--node-name", "n1", "--driver-root", "/driver-root"];
        argv.extend_from_slice(extra);
        T::try_parse_from(argv).unwrap().run
    }

    #[test]
    fn driver_and_sharing_settings_follow_the_flags() {
        let args = run_args(&[
            "--host-driver-root",
            "/run/nvidia/driver",
            "--nvidia-smi-bin",
            "/opt/smi",
        ]);
        let plugin = plugin_config(&args.kubelet);
        let driver = driver_config(&args, &plugin);
        assert_eq!(driver.pool_name, "n1");
        assert_eq!(
            driver.state_dir,
            Path::new("/var/lib/kubelet/plugins/gpu.cleave.dev")
        );
        assert_eq!(driver.driver_root.root, Path::new("/driver-root"));
        assert_eq!(
            driver.driver_root.host_root.as_deref(),
            Some(Path::new("/run/nvidia/driver"))
        );
        assert_eq!(driver.boot_id_path, Path::new(BOOT_ID_PATH));
        let sharing = sharing_config(&args, &driver);
        assert_eq!(sharing.state_dir, driver.state_dir);
        assert_eq!(sharing.binaries.nvidia_smi, Path::new("/opt/smi"));
        assert_eq!(
            sharing.binaries.mps_control,
            Path::new("/driver-root/usr/bin/nvidia-cuda-mps-control")
        );
    }
}
