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
use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::time::Duration;

use anyhow::Context as _;
use cleave_controller::backoff::{Backoff, BackoffConfig};
use cleave_controller::{PublisherConfig, SlicePublisher};
use cleave_driver::backend::GpuBackend;
use cleave_driver::driver_root::DriverRootConfig;
use cleave_driver::model::BareGpuInstance;
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::pool::{PoolOptions, build_pool};
use cleave_driver::prepare::{DriverConfig, NodeDriver};
use cleave_driver::sharing::{ProcessLauncher, SharingBinaries, SharingConfig, SharingManager};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::args::{KubeletArgs, MpsLauncherKind, RunArgs};
use crate::k8s::events::{EventReporter, Severity, StartNode};
use crate::k8s::kube_handler::{KubeClaimHandler, release_orphaned_claims};
use crate::kubelet::server::{PluginConfig, PluginServer};
use crate::metrics::Metrics;
use crate::node::lifecycle::reset_command;
use crate::node::node_lock::NodeLock;

mod error;
mod usage;
pub(crate) use error::{DriverNotReady, StartError};

/// The socket and state layout the kubelet flags describe.
pub(crate) fn plugin_config(args: &KubeletArgs) -> PluginConfig {
    PluginConfig::new(
        args.driver_name.clone(),
        args.kubelet_registrar_directory_path.clone(),
        args.kubelet_plugins_directory_path.clone(),
    )
    .with_pod_uid(args.pod_uid.clone())
}

/// The kernel's boot ID; the driver forgets prepared claims of an earlier boot.
pub(crate) const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// Builds a Kubernetes client from a kubeconfig file, or the in-cluster / default
/// configuration when none is given.
pub(crate) async fn kube_client(kubeconfig: Option<&Path>) -> Result<kube::Client, StartError> {
    let config = match kubeconfig {
        Some(path) => {
            let bad = |source| StartError::Kubeconfig {
                path: path.to_path_buf(),
                source,
            };
            let file = kube::config::Kubeconfig::read_from(path).map_err(bad)?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(bad)?
        }
        None => kube::Config::infer()
            .await
            .map_err(StartError::NoClusterConfig)?,
    };
    kube::Client::try_from(config).map_err(StartError::Client)
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
    let node_lock = NodeLock::new(plugin.lock_file());

    let mut config = driver_config(args, &plugin);
    config.cdi_hook = install_cdi_hook(args, &config.state_dir)?;
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
    let sharing = Arc::new(sharing_manager(args, &config, &client, node, node_pods.clone()).await?);
    let (driver, instance_lock) = {
        let backend = Arc::clone(&backend);
        let state_dir = plugin.data_dir();
        // --device-metadata: the files copy the attributes of the pool as published.
        let metadata_pool = args.claim_info.device_metadata.then(|| PoolOptions {
            dynamic_mig: args.driver.dynamic_mig,
            consumable_capacity: args.driver.consumable_capacity,
            share_on_demand_mig: args.driver.share_on_demand_mig,
            ..PoolOptions::default()
        });
        node_lock
            .run(move || {
                let driver = NodeDriver::start_with_sharing(config, backend, sharing)
                    .map_err(StartError::from_driver)?;
                if let Some(pool) = metadata_pool {
                    driver.enable_device_metadata(pool);
                    info!("device metadata files on (--device-metadata)");
                }
                // Under the node lock, once the checkpoint has been read: from now on
                // `checkpoint reset` sees a running plugin and refuses.
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
            .map_err(StartError::NodeLock)??
    };
    let driver = Arc::new(driver);

    let released = release_orphaned_claims(&client, &driver, &node_lock).await;
    if !released.is_empty() {
        info!(
            claims = released.len(),
            "released claims deleted while the plugin was down"
        );
    }

    let inventory = driver.inventory();
    let bare_gpu_instances = driver.bare_gpu_instances();
    let pool = build_pool(
        &inventory,
        &PoolOptions {
            dynamic_mig: args.driver.dynamic_mig,
            owned_instances: driver.owned_mig_uuids(),
            bare_gpu_instances: bare_gpu_instances.clone(),
            consumable_capacity: args.driver.consumable_capacity,
            share_on_demand_mig: args.driver.share_on_demand_mig,
        },
    );
    info!(
        gpus = inventory.gpus.len(),
        devices = pool.device_count(),
        dynamic_mig = args.driver.dynamic_mig,
        "discovered devices"
    );
    let mut publisher_config =
        PublisherConfig::new(plugin.driver_name.clone(), args.node_name.clone());
    // The UID as read at start; the publisher reads the Node itself only without one.
    publisher_config.node_uid = node.uid();
    publisher_config.counter_probe_interval =
        std::time::Duration::from_secs(args.lifecycle.counter_probe_interval_secs.max(1));
    if let Some(m) = &metrics {
        publisher_config.observer = Some(m.observability.api_observer());
        m.observability.set_published(&pool);
        m.observability.set_prepared(&driver.prepared_summary());
    }
    let health = crate::node::device_health::start_for_plugin(
        &args.health,
        backend.as_ref(),
        &args.node_name,
        &pool,
        &inventory,
        &driver,
        metrics
            .clone()
            .map(|m| m as Arc<dyn crate::node::device_health::DeviceHealthObserver>),
    );
    let publisher = SlicePublisher::start(client.clone(), publisher_config);
    // NVML sees GPUs but the driver root holds no driver: offer nothing (every claim would
    // fail), serve prepares anyway so they fail naming the files, and wait for the files.
    let driver_wait = driver.missing_driver().map(|e| e.to_string());
    let pending_pool = match &driver_wait {
        Some(reason) => {
            warn!(reason = %reason, "not publishing devices until the driver root holds the NVIDIA driver; claims are refused meanwhile");
            Some(pool)
        }
        None => {
            publisher.publish(pool);
            None
        }
    };

    let events = crate::k8s::events::EventReporter::new(client.clone(), args.node_name.clone());
    report_silent_gpus(
        &client,
        &events,
        node,
        &inventory,
        args.driver.dynamic_mig,
        &driver,
    )
    .await;
    let sampling_gate = cleave_driver::usage::SamplingGate::new();
    let usage = start_usage(
        args,
        node_pods,
        backend.as_ref(),
        &driver,
        metrics.as_ref(),
        &events,
        &sampling_gate,
    );
    let status_writer = args.claim_info.claim_device_status.then(|| {
        crate::k8s::claim_status::ClaimStatusWriter::start(
            client.clone(),
            crate::k8s::claim_status::WriterConfig {
                driver_name: plugin.driver_name.clone(),
                pool_name: args.node_name.clone(),
            },
            health.clone(),
            metrics
                .clone()
                .map(|m| m as Arc<dyn crate::k8s::claim_status::StatusObserver>),
        )
    });
    let handler = Arc::new(
        KubeClaimHandler::new(client, Arc::clone(&driver), node_lock.clone())
            .with_status(status_writer.clone())
            .with_health(health.clone(), &plugin.driver_name)
            .with_events(events)
            .with_metrics(
                metrics
                    .clone()
                    .map(|m| m as Arc<dyn crate::k8s::kube_handler::PrepareObserver>),
            )
            .with_sampling_gate(sampling_gate.clone()),
    );
    let observer = metrics.map(|m| m as Arc<dyn crate::kubelet::dra::DraObserver>);
    let server = PluginServer::start_with_health(&plugin, handler, observer, health)
        .await
        .map_err(StartError::Servers)?;
    Ok(RunningPlugin {
        backend,
        driver,
        node_lock,
        publisher,
        server,
        driver_wait,
        pending_pool,
        instance_lock,
        bare_gpu_instances,
        usage,
        sampling_gate,
        status_writer,
    })
}

/// Starts per-claim usage sampling over the backend's usage source (the driver's NVML
/// handle) unless `--usage-interval=0`; claims that turn idle get a `ClaimIdle` Event with
/// `--idle-events`. Without `--metrics-addr` the rounds still feed idle detection.
fn start_usage(
    args: &RunArgs,
    node_pods: Option<Arc<crate::k8s::node_pods::NodePods>>,
    backend: &dyn GpuBackend,
    driver: &Arc<NodeDriver>,
    metrics: Option<&Arc<Metrics>>,
    events: &EventReporter,
    gate: &cleave_driver::usage::SamplingGate,
) -> Option<crate::node::usage::UsageMonitor> {
    let Some(node_pods) = node_pods else {
        info!("per-claim usage sampling off (--usage-interval=0)");
        return None;
    };
    let Some(source) = backend.usage_source() else {
        warn!("per-claim usage sampling off: the GPU backend has no NVML usage source");
        return None;
    };
    let usage_metrics = metrics.map_or_else(
        || Arc::new(crate::node::usage::metrics::UsageMetrics::default()),
        |m| Arc::clone(&m.usage),
    );
    let idle = args.usage.idle_events.then(|| {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        usage::spawn_idle_events(events.clone(), rx);
        tx
    });
    // This node's pods (`node_pods`): which consume each claim (a share's or MPS claim's
    // `pods`) and their `--claim-pod-labels`.
    let keys = args.usage.claim_pod_labels.0.clone();
    if !keys.is_empty() {
        let source: Arc<dyn crate::node::usage::metrics::PodLabelSource> =
            Arc::clone(&node_pods) as _;
        usage_metrics
            .pod_labels
            .set(keys.clone(), Arc::clone(&source));
        if let Some(m) = metrics {
            m.rightsize.pod_labels.set(keys.clone(), source);
        }
    }
    let inputs: Arc<dyn crate::node::usage::ClaimDevices> = Arc::new(
        crate::node::usage::WithPods::new(Arc::clone(driver) as _, node_pods, !keys.is_empty()),
    );
    match crate::node::usage::UsageMonitor::start(
        crate::node::usage::MonitorConfig {
            interval: args.usage.usage_interval,
            policy: args.usage.idle_policy(),
            pool: args.node_name.clone(),
            rightsize: Some(
                args.usage
                    .rightsize_config(cleave_driver::rightsize::NodeModes {
                        dynamic_mig: args.driver.dynamic_mig,
                        consumable_capacity: args.driver.consumable_capacity,
                    }),
            ),
            rightsize_state: Some(
                driver
                    .config()
                    .state_dir
                    .join(cleave_driver::rightsize::STATE_FILE),
            ),
            oversized: args.usage.rightsize_events.then(|| {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                usage::spawn_oversized_events(events.clone(), rx);
                tx
            }),
            rightsize_metrics: metrics.map(|m| Arc::clone(&m.rightsize)),
            gate: Some(gate.clone()),
            proc_root: args.usage.proc_root.clone(),
        },
        source,
        inputs,
        usage_metrics,
        idle,
    ) {
        Ok(m) => Some(m),
        Err(e) => {
            warn!(error = %e, "per-claim usage sampling not running: cannot start its thread");
            None
        }
    }
}

/// Event reason: MIG-enabled GPUs without instances publish nothing (on-demand MIG off).
pub(crate) const REASON_MIG_WITHOUT_INSTANCES: &str = "MIGEnabledWithoutInstances";
/// Event reason: MIG-enabled GPUs whose MIG profiles NVML does not answer.
pub(crate) const REASON_MIG_PROFILES_UNREADABLE: &str = "MIGProfilesUnreadable";

/// Warns, in the log and with a Warning Event on the Node, about GPUs that publish no
/// device at all, naming them and what to do; an empty pool must never be silent.
async fn report_silent_gpus(
    client: &kube::Client,
    events: &EventReporter,
    start_node: &StartNode,
    inventory: &cleave_driver::model::NodeInventory,
    dynamic_mig: bool,
    driver: &NodeDriver,
) {
    use cleave_driver::pool::{SilentReason, silent_gpus};
    let silent = silent_gpus(
        inventory,
        &PoolOptions {
            dynamic_mig,
            owned_instances: driver.owned_mig_uuids(),
            ..PoolOptions::default()
        },
    );
    for (reason, event_reason) in [
        (
            SilentReason::MigWithoutInstances,
            REASON_MIG_WITHOUT_INSTANCES,
        ),
        (
            SilentReason::MigWithoutProfiles,
            REASON_MIG_PROFILES_UNREADABLE,
        ),
    ] {
        let gpus: Vec<String> = silent
            .iter()
            .filter(|s| s.reason == reason)
            .map(|s| format!("{} ({})", s.name, s.uuid))
            .collect();
        if gpus.is_empty() {
            continue;
        }
        let note = format!(
            "{} GPU(s) publish no device: {}. {reason}",
            gpus.len(),
            gpus.join(", ")
        );
        warn!(gpus = %gpus.join(", "), "{note}");
        let node = start_node.reference(client).await;
        events
            .publish(&node, Severity::Warning, event_reason, "Publish", &note)
            .await;
    }
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

/// Event reason: the checkpoint cannot be read.
pub(crate) const REASON_CHECKPOINT_UNREADABLE: &str = "CheckpointUnreadable";
/// Event reason: NVML cannot be loaded, sees no GPU, or the driver root holds no driver.
pub(crate) const REASON_DRIVER_NOT_READY: &str = "NVIDIADriverNotReady";

/// Why the plugin is not ready yet (None: nothing blocks start-up); `/readyz` shows it.
pub(crate) type Blocker = watch::Sender<Option<String>>;

/// Loads NVML for the driver under `driver_root` (the root's libraries first, then the
/// system's, or `nvml_lib` when given) and checks it sees GPUs; the error says why the
/// driver is not usable yet, naming every library path tried.
pub(crate) async fn open_backend(
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

/// What [`start_when_possible`] reports to.
#[derive(Clone)]
pub(crate) struct StartContext {
    /// The kube client (Events, claims, slices).
    pub client: kube::Client,
    /// Metrics, when served.
    pub metrics: Option<Arc<Metrics>>,
    /// Not-ready reason for `/readyz`.
    pub blocker: Arc<Blocker>,
    /// Events about the Node.
    pub events: EventReporter,
    /// The Node as read once at start.
    pub node: StartNode,
}

impl std::fmt::Debug for StartContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StartContext")
            .field("blocker", &*self.blocker.borrow())
            .finish_non_exhaustive()
    }
}

/// Starts the plugin, retrying with backoff while the NVIDIA driver is missing or the
/// checkpoint unreadable; other start errors are returned.
pub(crate) async fn start_when_possible(
    args: &RunArgs,
    ctx: &StartContext,
) -> Result<RunningPlugin, StartError> {
    let max = Duration::from_millis(args.lifecycle.retry_max_ms);
    let mut backoff = Backoff::new(BackoffConfig {
        initial: Duration::from_millis(args.lifecycle.retry_initial_ms).min(max),
        max,
        conflict_retries: 0,
    });
    let lm = ctx.metrics.as_ref().map(|m| &m.lifecycle);
    let mut backend: Option<Arc<dyn GpuBackend>> = None;
    let mut last_checkpoint_reason: Option<String> = None;
    let mut last_driver_reason: Option<String> = None;
    loop {
        let b = match &backend {
            Some(b) => Arc::clone(b),
            None => {
                match open_backend(
                    args.driver.driver_root.clone(),
                    args.nvml.nvml_lib.clone(),
                    args.lifecycle.allow_no_gpus,
                    args.nvml.sysfs_root.clone(),
                )
                .await
                {
                    Ok(b) => {
                        info!("NVML loaded");
                        if let Some(m) = lm {
                            m.nvml_available.set(1);
                        }
                        backoff.reset();
                        backend = Some(Arc::clone(&b));
                        b
                    }
                    Err(e) if e.is_retried() => {
                        if let Some(m) = lm {
                            m.nvml_available.set(0);
                        }
                        let reason = e.chain();
                        let delay = backoff.next_delay();
                        warn!(reason = %reason, retry_in_ms = delay.as_millis() as u64, "waiting for the NVIDIA driver; not registering or publishing");
                        driver_not_ready_event(ctx, &reason, &mut last_driver_reason).await;
                        ctx.blocker.send_replace(Some(reason));
                        tokio::time::sleep(delay).await;
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        match start_with_backend(args, ctx.client.clone(), ctx.metrics.clone(), b, &ctx.node).await
        {
            Ok(p) => {
                if let Some(m) = lm {
                    m.checkpoint_healthy.set(1);
                }
                if last_checkpoint_reason.is_some() {
                    info!("checkpoint readable again");
                }
                ctx.blocker.send_replace(None);
                return Ok(p);
            }
            Err(e) => {
                let StartError::CheckpointUnreadable { reason, error } = e else {
                    return Err(e);
                };
                if let Some(m) = lm {
                    m.checkpoint_healthy.set(0);
                    m.checkpoint_errors.inc();
                }
                let command = reset_command(
                    &args.kubelet.kubelet_plugins_directory_path,
                    &args.kubelet.driver_name,
                );
                let delay = backoff.next_delay();
                warn!(error = %error, recovery = %command, retry_in_ms = delay.as_millis() as u64, "checkpoint unreadable; not registering, not serving prepares, retrying");
                if last_checkpoint_reason.as_deref() != Some(reason.as_str()) {
                    let node = ctx.node.reference(&ctx.client).await;
                    let note = format!(
                        "checkpoint {reason}. Recovery, after making sure no pod on this node uses a claim of this driver: {command} (the plugin stays not ready and picks the fix up on its next retry)"
                    );
                    ctx.events
                        .publish(
                            &node,
                            Severity::Warning,
                            REASON_CHECKPOINT_UNREADABLE,
                            "Start",
                            &note,
                        )
                        .await;
                    last_checkpoint_reason = Some(reason.clone());
                }
                ctx.blocker
                    .send_replace(Some(format!("checkpoint unreadable: {reason}")));
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Posts a Warning Event on the Node for a driver-not-ready reason, once per distinct
/// reason (a retry loop must not flood the Node's events).
pub(crate) async fn driver_not_ready_event(
    ctx: &StartContext,
    reason: &str,
    last: &mut Option<String>,
) {
    if last.as_deref() == Some(reason) {
        return;
    }
    let node = ctx.node.reference(&ctx.client).await;
    let note = format!(
        "{reason} (the plugin stays not ready and publishes no device until this is fixed; it looks again with backoff)"
    );
    ctx.events
        .publish(
            &node,
            Severity::Warning,
            REASON_DRIVER_NOT_READY,
            "Start",
            &note,
        )
        .await;
    *last = Some(reason.to_owned());
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

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
