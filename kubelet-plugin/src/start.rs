//! `run`: the node daemon.
//!
//! `run` first serves `/healthz`, `/readyz` and `/metrics`, then starts through
//! [`crate::lifecycle::start_when_possible`] (retrying while the NVIDIA driver is missing or
//! the checkpoint is unreadable), then checks for other GPU managers on the node
//! ([`crate::coexistence`]).
//!
//! Start order: load NVML -> start the node driver (checkpoint load and reconcile) ->
//! release checkpointed claims the API server no longer has -> build the pool -> start
//! the slice publisher -> serve DRA, then registration -> wait for SIGTERM/SIGINT.
//! Shutdown stops the servers (removing this instance's sockets) and the publisher; the
//! ResourceSlices stay, so a restart or upgrade takes them over without writes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use cleave_controller::{
    CounterSupport, PARTITIONABLE_DEVICES_GATE, PublisherConfig, SlicePublisher, uninstall_slices,
};
use cleave_driver::backend::GpuBackend;
use cleave_driver::driver_root::DriverRootConfig;
use cleave_driver::model::BareGpuInstance;
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::pool::{PoolOptions, build_pool};
use cleave_driver::prepare::{DriverConfig, NodeDriver};
use cleave_driver::sharing::{ProcessLauncher, SharingBinaries, SharingConfig, SharingManager};
use tracing::{info, warn};

use crate::cli::{MpsLauncherKind, RunArgs};
use crate::events::{EventReporter, Severity};
use crate::grpc::RegistrationState;
use crate::kube_handler::{KubeClaimHandler, release_orphaned_claims};
use crate::lifecycle::{Heartbeat, StartContext, start_when_possible};
use crate::metrics::{HealthState, Metrics};
use crate::serialize::Serializer;
use crate::server::{PluginConfig, PluginServer};

/// The kernel's boot ID; the driver forgets prepared claims of an earlier boot.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// How often `mps_daemons_running` is re-read from the checkpoint besides after every DRA
/// call (another plugin instance of a rolling update may have changed it).
pub const MPS_GAUGE_REFRESH: std::time::Duration = std::time::Duration::from_secs(60);

/// Builds a Kubernetes client from a kubeconfig file, or the in-cluster / default
/// configuration when none is given.
pub async fn kube_client(kubeconfig: Option<&Path>) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .context("no kubeconfig given and no in-cluster configuration")?,
    };
    kube::Client::try_from(config).context("creating Kubernetes client")
}

/// The driver settings `run` derives from its flags.
pub fn driver_config(args: &RunArgs, plugin: &PluginConfig) -> DriverConfig {
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
    }
}

/// Installs the CDI hook (unless `--disable-cdi-hooks`) and returns its host path.
fn install_cdi_hook(args: &RunArgs, state_dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    if args.driver.disable_cdi_hooks {
        warn!("CDI hooks disabled: claims' containers get no soname links and no ld cache update");
        return Ok(None);
    }
    let source = match &args.driver.cdi_hook_source {
        Some(s) => s.clone(),
        None => {
            let exe = std::env::current_exe().context("finding this executable")?;
            crate::cdi_hook::default_source(&exe)
                .with_context(|| format!("{} has no directory", exe.display()))?
        }
    };
    crate::cdi_hook::install(&source, state_dir).map(Some)
}

/// The sharing (MPS, time-slicing) settings `run` derives from its flags: tools under
/// the driver root unless given explicitly, state in the driver's state directory.
pub fn sharing_config(args: &RunArgs, driver: &DriverConfig) -> SharingConfig {
    let binaries = SharingBinaries::under_driver_root(&args.driver.driver_root).with_overrides(
        args.driver.mps_control_bin.clone(),
        args.driver.nvidia_smi_bin.clone(),
    );
    SharingConfig {
        boot_id_path: driver.boot_id_path.clone(),
        ..SharingConfig::new(driver.state_dir.clone(), binaries)
    }
}

/// The sharing manager `run` uses: daemons as host processes, or (`--mps-launcher=pod`) in
/// pods of their own created through `client`.
pub async fn sharing_manager(
    args: &RunArgs,
    driver: &DriverConfig,
    client: &kube::Client,
) -> anyhow::Result<SharingManager> {
    let config = sharing_config(args, driver);
    if args.mps.mps_launcher == MpsLauncherKind::Process {
        return Ok(SharingManager::new(config));
    }
    let mps = &args.mps;
    let namespace = mps
        .namespace
        .clone()
        .context("--mps-launcher=pod needs --namespace (POD_NAMESPACE)")?;
    let image = mps
        .mps_daemon_image
        .clone()
        .context("--mps-launcher=pod needs --mps-daemon-image")?;
    let parent = crate::mps_pod::resolve_parent(
        client,
        &namespace,
        mps.pod_name.as_deref(),
        &args.node_name,
    )
    .await
    .context("finding the owner of MPS daemon pods")?;
    info!(namespace = %namespace, image = %image, owner = %format!("{}/{}", parent.owner.kind, parent.owner.name), "MPS daemons run in pods");
    let launcher = crate::mps_pod::PodLauncher::new(
        crate::mps_pod::PodLauncherConfig {
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
    );
    Ok(SharingManager::with_launcher(config, Arc::new(launcher)))
}

/// SIGTERM and SIGINT listeners, installed once so no signal is missed.
#[derive(Debug)]
pub struct ShutdownSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    /// Installs the handlers (from now on these signals no longer kill the process).
    pub fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("installing SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing SIGINT handler")?,
        })
    }

    /// Waits for the next SIGTERM or SIGINT and names it.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// A started plugin: driver, slice publisher and gRPC servers.
pub struct RunningPlugin {
    /// The GPU backend (NVML).
    pub backend: Arc<dyn GpuBackend>,
    /// The node driver.
    pub driver: Arc<NodeDriver>,
    /// The node lock shared by every prepare and unprepare.
    pub serializer: Serializer,
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
    /// [`crate::lifecycle::INSTANCE_LOCK_FILE`]).
    pub instance_lock: std::fs::File,
    /// GPU instances without compute instance when the pool was built (their placements
    /// are published as taken; the periodic check republishes when they change).
    pub bare_gpu_instances: BTreeMap<String, Vec<BareGpuInstance>>,
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
    start_with_metrics(args, client, None).await
}

/// [`start`], recording DRA calls in `metrics`.
pub async fn start_with_metrics(
    args: &RunArgs,
    client: kube::Client,
    metrics: Option<Arc<Metrics>>,
) -> anyhow::Result<RunningPlugin> {
    let nvml_lib = args.nvml.nvml_lib.clone();
    let driver_root = args.driver.driver_root.clone();
    let backend: Arc<dyn GpuBackend> = Arc::new(
        tokio::task::spawn_blocking(move || {
            NvmlBackend::open_in_driver_root(&driver_root, nvml_lib.as_deref())
        })
        .await?
        .context("loading NVML")?,
    );
    start_with_backend(args, client, metrics, backend).await
}

/// [`start_with_metrics`] on an already loaded backend (see
/// [`crate::lifecycle::start_when_possible`], which retries while NVML or the checkpoint
/// is not usable).
pub async fn start_with_backend(
    args: &RunArgs,
    client: kube::Client,
    metrics: Option<Arc<Metrics>>,
    backend: Arc<dyn GpuBackend>,
) -> anyhow::Result<RunningPlugin> {
    let plugin = args.kubelet.plugin_config();
    plugin
        .prepare_dirs()
        .context("preparing plugin directories")?;
    // Before the checkpoint or the API server is touched: a second instance on the same
    // socket names stops here, naming the one that runs.
    crate::server::check_sockets_free(&plugin)
        .await
        .context("checking the plugin sockets")?;
    let serializer = Serializer::new(plugin.lock_file());

    let mut config = driver_config(args, &plugin);
    config.cdi_hook = install_cdi_hook(args, &config.state_dir)?;
    let sharing = Arc::new(sharing_manager(args, &config, &client).await?);
    let (driver, instance_lock) = {
        let backend = Arc::clone(&backend);
        let state_dir = plugin.data_dir();
        serializer
            .run(move || {
                let driver = NodeDriver::start_with_sharing(config, backend, sharing)
                    .map_err(anyhow::Error::from)
                    .context("starting the node driver")?;
                // Under the node lock, once the checkpoint has been read: from now on
                // `checkpoint reset` sees a running plugin and refuses.
                let lock = crate::lifecycle::hold_instance_lock(&state_dir).with_context(|| {
                    format!(
                        "taking the instance lock {}",
                        state_dir
                            .join(crate::lifecycle::INSTANCE_LOCK_FILE)
                            .display()
                    )
                })?;
                Ok::<_, anyhow::Error>((driver, lock))
            })
            .await??
    };
    let driver = Arc::new(driver);

    let released = release_orphaned_claims(&client, &driver, &serializer).await;
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
    publisher_config.counter_probe_interval =
        std::time::Duration::from_secs(args.lifecycle.counter_probe_interval_secs.max(1));
    if let Some(m) = &metrics {
        publisher_config.observer = Some(m.observability.api_observer());
        m.observability.set_published(&pool);
        m.observability
            .refresh_mps_daemons(&driver.config().state_dir);
    }
    let nvml_library = backend
        .nvml_library()
        .or_else(|| args.nvml.nvml_lib.clone());
    let health = crate::health::start_for_plugin(
        &args.health,
        nvml_library.as_deref(),
        &args.node_name,
        &pool,
        &inventory,
        &driver,
        metrics.clone(),
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

    let events = crate::events::EventReporter::new(client.clone(), args.node_name.clone());
    report_silent_gpus(
        &client,
        &events,
        &args.node_name,
        &inventory,
        args.driver.dynamic_mig,
        &driver,
    )
    .await;
    let handler = Arc::new(
        KubeClaimHandler::new(client, Arc::clone(&driver), serializer.clone())
            .with_health(health.clone(), &plugin.driver_name)
            .with_events(events)
            .with_metrics(metrics.as_ref().map(|m| m.observability.clone())),
    );
    let server = PluginServer::start_with_health(&plugin, handler, metrics, health)
        .await
        .context("starting the plugin servers")?;
    Ok(RunningPlugin {
        backend,
        driver,
        serializer,
        publisher,
        server,
        driver_wait,
        pending_pool,
        instance_lock,
        bare_gpu_instances,
    })
}

/// Event reason: MIG-enabled GPUs without instances publish nothing (on-demand MIG off).
pub const REASON_MIG_WITHOUT_INSTANCES: &str = "MIGEnabledWithoutInstances";
/// Event reason: MIG-enabled GPUs whose MIG profiles NVML does not answer.
pub const REASON_MIG_PROFILES_UNREADABLE: &str = "MIGProfilesUnreadable";

/// Warns, in the log and with a Warning Event on the Node, about GPUs that publish no
/// device at all, naming them and what to do; an empty pool must never be silent.
async fn report_silent_gpus(
    client: &kube::Client,
    events: &EventReporter,
    node_name: &str,
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
        let node = crate::events::node_reference(client, node_name).await;
        events
            .publish(&node, Severity::Warning, event_reason, "Publish", &note)
            .await;
    }
}

impl RunningPlugin {
    /// Stops the servers (removing this instance's sockets), then the publisher; the
    /// ResourceSlices stay.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        let stopped = self.server.shutdown().await;
        self.publisher.shutdown().await;
        stopped.context("stopping the plugin servers")
    }
}

/// Event reason: devices are withheld because the API server drops shared counters.
pub const REASON_COUNTERS_DROPPED: &str = "PartitionableDevicesDisabled";

/// Says on the Node (a Warning Event), in `/readyz` and in the log that devices are
/// withheld because the API server drops counters, or that the full pool is back.
async fn report_counter_support(
    client: &kube::Client,
    events: &EventReporter,
    node_name: &str,
    degraded: &tokio::sync::watch::Sender<Option<String>>,
    status: &cleave_controller::PublisherStatus,
) {
    if status.counters == CounterSupport::Dropped {
        let note = format!(
            "the API server drops sharedCounters/consumesCounters from ResourceSlices (feature gate {PARTITIONABLE_DEVICES_GATE} off; alpha and off by default before Kubernetes 1.36): \
             {} devices that depend on counters (on-demand MIG placements and their GPUs) are withheld so that the scheduler cannot hand out overlapping MIG placements; \
             GPUs without on-demand MIG are published. Fix: enable {PARTITIONABLE_DEVICES_GATE} on kube-apiserver and kube-scheduler (or run the plugin without --dynamic-mig); \
             the plugin notices within a minute and publishes the full pool",
            status.withdrawn_devices
        );
        warn!(
            withheld = status.withdrawn_devices,
            gate = PARTITIONABLE_DEVICES_GATE,
            "devices withheld: the API server drops counters"
        );
        degraded.send_replace(Some(format!(
            "{} devices withheld: the API server drops shared counters (enable the {PARTITIONABLE_DEVICES_GATE} feature gate)",
            status.withdrawn_devices
        )));
        let node = crate::events::node_reference(client, node_name).await;
        events
            .publish(
                &node,
                Severity::Warning,
                REASON_COUNTERS_DROPPED,
                "Publish",
                &note,
            )
            .await;
    } else {
        info!("the API server keeps counters; the full pool is published");
        degraded.send_replace(None);
    }
}

/// A Warning Event on each claim whose MPS daemon had died and was started again: its
/// running clients lost their server and need a restart (`kubectl describe
/// resourceclaim` shows it).
async fn report_mps_restarts(
    events: &EventReporter,
    driver: &NodeDriver,
    restarted: &std::collections::BTreeSet<String>,
) {
    for claim in driver
        .prepared_claims()
        .into_iter()
        .filter(|c| restarted.contains(&c.uid))
    {
        let regarding = k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some("resource.k8s.io/v1".into()),
            kind: Some("ResourceClaim".into()),
            namespace: Some(claim.namespace.clone()),
            name: Some(claim.name.clone()),
            uid: Some(claim.uid.clone()),
            ..Default::default()
        };
        events
            .publish(
                &regarding,
                crate::events::Severity::Warning,
                "MPSDaemonRestarted",
                "Reconcile",
                "the claim's MPS control daemon had stopped and was started again with the \
                 claim's limits; containers that used the old daemon must be restarted",
            )
            .await;
    }
}

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let mut signals = ShutdownSignals::install()?;
    let client = kube_client(args.kubeconfig.as_deref()).await?;

    if args.uninstall {
        let config = PublisherConfig::new(args.kubelet.driver_name.clone(), args.node_name.clone());
        let deleted = uninstall_slices(&client, &config)
            .await
            .context("deleting ResourceSlices")?;
        info!(deleted, node = %args.node_name, driver = %config.driver_name, "uninstalled ResourceSlices");
        return Ok(ExitCode::SUCCESS);
    }

    let metrics = args.metrics_addr.map(|_| Arc::new(Metrics::new()));
    if let Some(m) = &metrics {
        m.observability.install_driver_observer();
    }
    let taint_client = client.clone();
    // Health is served before start-up, which may wait for the NVIDIA driver or a readable
    // checkpoint (crate::lifecycle); /readyz names what it waits for.
    let (registration_tx, registration_rx) =
        tokio::sync::watch::channel(RegistrationState::Pending);
    let (ready_tx, ready_rx) = tokio::sync::watch::channel(false);
    let blocker = Arc::new(tokio::sync::watch::channel(Some("starting".to_owned())).0);
    let (degraded_tx, degraded_rx) = tokio::sync::watch::channel(None::<String>);
    let heartbeat = Arc::new(Heartbeat::default());
    heartbeat.beat();
    let heartbeat_task = heartbeat.spawn();
    let http = match (args.metrics_addr, &metrics) {
        (Some(addr), Some(m)) => {
            let state = HealthState {
                metrics: Arc::clone(m),
                registration: registration_rx,
                published: ready_rx,
                blocker: blocker.subscribe(),
                degraded: degraded_rx,
                heartbeat: Arc::clone(&heartbeat),
            };
            let (local, task) = crate::metrics::start(addr, state)
                .await
                .with_context(|| format!("serving metrics on {addr}"))?;
            info!(addr = %local, "serving /metrics, /healthz and /readyz");
            Some(task)
        }
        _ => None,
    };
    let events = EventReporter::new(client.clone(), args.node_name.clone());
    let mps_events = events.clone();
    let ctx = StartContext {
        client: client.clone(),
        metrics: metrics.clone(),
        blocker,
        events: events.clone(),
    };
    let plugin = tokio::select! {
        s = signals.recv() => {
            info!(signal = s, "shutting down before start-up finished");
            heartbeat_task.abort();
            if let Some(task) = http {
                task.abort();
            }
            return Ok(ExitCode::SUCCESS);
        }
        r = start_when_possible(&args, &ctx) => r?,
    };
    let coexistence = tokio::spawn(crate::coexistence::check_and_report(
        client,
        args.node_name.clone(),
        args.kubelet.driver_name.clone(),
        plugin
            .driver
            .inventory()
            .gpus
            .iter()
            .map(|g| g.uuid.clone())
            .collect(),
        events,
    ));
    let mut registration = plugin.server.registration_state();
    registration_tx.send_replace(registration.borrow().clone());
    let mut published = plugin.publisher.status();
    let mut last_error: Option<String> = None;
    let mut was_published = false;
    let mut counters_reported = false;
    let counter_client = taint_client.clone();
    let counter_events = EventReporter::new(counter_client.clone(), args.node_name.clone());
    let mut health_changes = plugin.server.health().map(|h| h.subscribe());
    let mut mps_refresh = tokio::time::interval(MPS_GAUGE_REFRESH);
    mps_refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // Daemons of prepared claims that died (an evicted daemon pod, a crash) are started
    // again between prepares too, not only at the next start.
    let check_every = std::time::Duration::from_secs(args.mps.mps_check_interval_secs);
    let mut mps_check = tokio::time::interval_at(
        tokio::time::Instant::now() + check_every.max(std::time::Duration::from_secs(1)),
        check_every.max(std::time::Duration::from_secs(1)),
    );
    mps_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut mps_check_task: Option<tokio::task::JoinHandle<()>> = None;
    // While the driver root holds no driver: not ready with the reason, and looked at again
    // on the start-up retry schedule's longest wait.
    let mut plugin = plugin;
    if let Some(reason) = plugin.driver_wait.clone() {
        let reason = format!("NVIDIA driver not ready: {reason}");
        crate::lifecycle::driver_not_ready_event(&args, &ctx, &reason, &mut None).await;
        ctx.blocker.send_replace(Some(reason));
    }
    let mut driver_check = tokio::time::interval(std::time::Duration::from_millis(
        args.lifecycle.retry_max_ms.clamp(100, 10_000),
    ));
    driver_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // The periodic check also looks for GPU instances left without compute instance (a
    // destroy that failed during a rollback) and republishes the pool when they change, so
    // that their placements are published as taken, never as free.
    let last_bare = Arc::new(std::sync::Mutex::new(plugin.bare_gpu_instances.clone()));
    let (pool_tx, mut pool_rx) =
        tokio::sync::mpsc::unbounded_channel::<cleave_api::pool::PoolDevices>();
    let dynamic_mig = args.driver.dynamic_mig;
    let signal = loop {
        tokio::select! {
            s = signals.recv() => break s,
            _ = driver_check.tick(), if plugin.driver_wait.is_some() => {
                let driver = Arc::clone(&plugin.driver);
                let found = tokio::task::spawn_blocking(move || {
                    driver
                        .rediscover_driver_files()
                        .map(|()| driver.missing_driver().is_none())
                        .map_err(|e| e.to_string())
                })
                .await;
                match found {
                    Ok(Ok(true)) => {
                        info!("the driver root holds the NVIDIA driver now; publishing devices");
                        let pool = match plugin.server.health() {
                            Some(h) => h.pool_to_publish(),
                            None => plugin.pending_pool.take().unwrap_or_default(),
                        };
                        if let Some(m) = &metrics {
                            m.observability.set_published(&pool);
                        }
                        plugin.publisher.publish(pool);
                        plugin.driver_wait = None;
                        plugin.pending_pool = None;
                        ctx.blocker.send_replace(None);
                    }
                    Ok(Ok(false)) => {}
                    Ok(Err(e)) => warn!(error = %e, "looking at the driver root again"),
                    Err(e) => warn!(error = %e, "looking at the driver root again"),
                }
            }
            _ = mps_check.tick(), if !check_every.is_zero() => {
                if mps_check_task.as_ref().is_none_or(|t| t.is_finished()) {
                    let driver = Arc::clone(&plugin.driver);
                    let serializer = plugin.serializer.clone();
                    let events = mps_events.clone();
                    let last_bare = Arc::clone(&last_bare);
                    let pool_tx = pool_tx.clone();
                    mps_check_task = Some(tokio::spawn(async move {
                        let check = Arc::clone(&driver);
                        match serializer
                            .run(move || check.reconcile_sharing().map_err(|e| e.to_string()))
                            .await
                        {
                            Ok(Ok(restarted)) if !restarted.is_empty() => {
                                info!(claims = ?restarted, "started MPS daemons of prepared claims again");
                                report_mps_restarts(&events, &driver, &restarted).await;
                            }
                            Ok(Ok(_)) => {}
                            Ok(Err(e)) => warn!(error = %e, "checking MPS daemons"),
                            Err(e) => warn!(error = %e, "checking MPS daemons"),
                        }
                        if dynamic_mig {
                            let check = Arc::clone(&driver);
                            let Ok(bare) = serializer.run(move || check.bare_gpu_instances()).await else {
                                return;
                            };
                            let changed = {
                                let mut last = last_bare.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                                let changed = *last != bare;
                                *last = bare.clone();
                                changed
                            };
                            if changed {
                                info!(bare = ?bare, "GPU instances without compute instance changed; republishing the pool");
                                let pool = build_pool(
                                    &driver.inventory(),
                                    &PoolOptions {
                                        dynamic_mig: true,
                                        owned_instances: driver.owned_mig_uuids(),
                                        bare_gpu_instances: bare,
                                    },
                                );
                                let _ = pool_tx.send(pool);
                            }
                        }
                    }));
                }
            }
            Some(pool) = pool_rx.recv() => {
                // Health applies its taints to the new pool and triggers the publish.
                match plugin.server.health() {
                    Some(h) => h.set_base_pool(pool),
                    // Nothing is published while the driver root holds no driver.
                    None if plugin.driver_wait.is_some() => plugin.pending_pool = Some(pool),
                    None => {
                        if let Some(m) = &metrics {
                            m.observability.set_published(&pool);
                        }
                        plugin.publisher.publish(pool);
                    }
                }
            }
            _ = mps_refresh.tick() => {
                if let Some(m) = &metrics {
                    m.observability.refresh_mps_daemons(&plugin.driver.config().state_dir);
                }
            }
            Some(()) = async {
                match health_changes.as_mut() {
                    Some(rx) => rx.changed().await.ok(),
                    None => std::future::pending().await,
                }
            } => {
                // A device became unhealthy or healthy again: taint or drop it (nothing is
                // published while the driver root holds no driver).
                if let Some(h) = plugin.server.health().filter(|_| plugin.driver_wait.is_none()) {
                    let pool = h.pool_to_publish();
                    if let Some(m) = &metrics {
                        m.observability.set_published(&pool);
                    }
                    let version = plugin.publisher.publish(pool);
                    if h.needs_taint_check() {
                        tokio::spawn(Arc::clone(h).verify_taints(
                            taint_client.clone(),
                            args.kubelet.driver_name.clone(),
                            version,
                            plugin.publisher.status(),
                        ));
                    }
                }
            }
            Ok(()) = registration.changed() => {
                let state = registration.borrow_and_update().clone();
                info!(state = ?state, "registration state changed");
                if let Some(m) = &metrics {
                    m.set_registered(state == RegistrationState::Registered);
                }
                registration_tx.send_replace(state);
            }
            Ok(()) = published.changed() => {
                let s = published.borrow_and_update().clone();
                if s.last_error != last_error {
                    if let Some(e) = &s.last_error {
                        warn!(error = %e, "publishing ResourceSlices failed; retrying");
                    }
                    last_error = s.last_error.clone();
                }
                if s.published {
                    ready_tx.send_replace(true);
                    if let Some(m) = &metrics {
                        m.set_slices_published(s.slices);
                        m.set_devices_withheld(s.withdrawn_devices);
                    }
                    let withheld = s.counters == CounterSupport::Dropped;
                    if withheld != counters_reported {
                        counters_reported = withheld;
                        report_counter_support(&counter_client, &counter_events, &args.node_name, &degraded_tx, &s).await;
                    }
                }
                if s.published && !was_published {
                    info!(slices = s.slices, generation = s.generation, writes = s.writes, "ResourceSlices published");
                }
                was_published = s.published;
            }
        }
    };
    info!(signal, "shutting down");
    if let Some(task) = mps_check_task {
        // Let a check that runs finish: it may be starting a daemon.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(30), task).await;
    }
    heartbeat_task.abort();
    coexistence.abort();
    if let Some(task) = http {
        task.abort();
    }
    plugin.shutdown().await?;
    info!("stopped");
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    fn run_args(extra: &[&str]) -> RunArgs {
        let mut argv = vec![
            "x",
            "run",
            "--node-name",
            "n1",
            "--driver-root",
            "/driver-root",
        ];
        argv.extend_from_slice(extra);
        match crate::cli::Cli::try_parse_from(argv).unwrap().command {
            crate::cli::Command::Run(a) => a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn driver_and_sharing_settings_follow_the_flags() {
        let args = run_args(&[
            "--host-driver-root",
            "/run/nvidia/driver",
            "--nvidia-smi-bin",
            "/opt/smi",
        ]);
        let plugin = args.kubelet.plugin_config();
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
