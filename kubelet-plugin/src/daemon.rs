//! `run`: the node daemon's loop.
//!
//! `run` first serves `/healthz`, `/readyz` and `/metrics`, then starts through
//! [`crate::start::start_when_possible`] (retrying while the NVIDIA driver is missing or
//! the checkpoint is unreadable), then checks for other GPU managers on the node
//! ([`crate::k8s::coexistence`]), then reacts to what happens until SIGTERM/SIGINT: each event
//! source of the loop has a handler below.
//!
//! Shutdown stops the servers (removing this instance's sockets) and the publisher; the
//! ResourceSlices stay, so a restart or upgrade takes them over without writes.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use cleave_api::pool::PoolDevices;
use cleave_controller::{
    CounterSupport, PARTITIONABLE_DEVICES_GATE, PublisherConfig, uninstall_slices,
};
use cleave_driver::model::BareGpuInstance;
use cleave_driver::pool::{PoolOptions, build_pool};
use cleave_driver::prepare::NodeDriver;
use tracing::{info, warn};

use crate::args::RunArgs;
use crate::k8s::events::{EventReporter, Severity, StartNode};
use crate::kubelet::registration::RegistrationState;
use crate::metrics::{Heartbeat, Metrics, ProbeState};
use crate::node::node_lock::NodeLock;
use crate::start::{Blocker, RunningPlugin, StartContext, kube_client, start_when_possible};

/// How often `mps_daemons_running` is re-read from the checkpoint besides after every DRA
/// call (another plugin instance of a rolling update may have changed it).
pub(crate) const MPS_GAUGE_REFRESH: std::time::Duration = std::time::Duration::from_secs(60);

/// SIGTERM and SIGINT listeners, installed once so no signal is missed.
#[derive(Debug)]
pub(crate) struct ShutdownSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    /// Installs the handlers (from now on these signals no longer kill the process).
    pub(crate) fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("installing SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing SIGINT handler")?,
        })
    }

    /// Waits for the next SIGTERM or SIGINT and names it.
    pub(crate) async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// Event reason: devices are withheld because the API server drops shared counters.
pub(crate) const REASON_COUNTERS_DROPPED: &str = "PartitionableDevicesDisabled";

/// Says on the Node (a Warning Event), in `/readyz` and in the log that devices are
/// withheld because the API server drops counters, or that the full pool is back.
async fn report_counter_support(
    client: &kube::Client,
    events: &EventReporter,
    start_node: &StartNode,
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
        let node = start_node.reference(client).await;
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
                crate::k8s::events::Severity::Warning,
                "MPSDaemonRestarted",
                "Reconcile",
                "the claim's MPS control daemon had stopped and was started again with the \
                 claim's limits; containers that used the old daemon must be restarted",
            )
            .await;
    }
}

/// Runs the daemon until SIGTERM or SIGINT.
pub(crate) async fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let mut signals = ShutdownSignals::install()?;
    let client = kube_client(args.kubeconfig.as_deref()).await?;

    if args.uninstall {
        return uninstall(&args, &client).await;
    }

    let metrics = args.metrics_addr.map(|_| Arc::new(Metrics::new()));
    if let Some(m) = &metrics {
        m.observability.install_driver_observer();
        m.set_claim_labels(args.metrics.metrics_claim_labels);
    }
    let taint_client = client.clone();
    // Health is served before start-up, which may wait for the NVIDIA driver or a readable
    // checkpoint (see the start module); /readyz names what it waits for.
    let Probes {
        registration_tx,
        ready_tx,
        degraded_tx,
        blocker,
        heartbeat_task,
        http,
    } = serve_probes(&args, &client, metrics.as_ref()).await?;
    let events = EventReporter::new(client.clone(), args.node_name.clone());
    let mps_events = events.clone();
    // The one Node GET of the start: the publisher, the daemon pods' owner, the coexistence
    // check and the Node's Events all take what it read.
    let start_node = StartNode::read(&client, &args.node_name).await;
    let ctx = StartContext {
        client: client.clone(),
        metrics: metrics.clone(),
        blocker,
        events: events.clone(),
        node: start_node,
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
    let coexistence = spawn_coexistence_check(&args, client, &ctx, &plugin, events);
    let mut registration = plugin.server.registration_state();
    registration_tx.send_replace(registration.borrow().clone());
    let mut published = plugin.publisher.status();
    let mut health_changes = plugin.server.health().map(|h| h.subscribe());
    let mut mps_refresh = tokio::time::interval(MPS_GAUGE_REFRESH);
    mps_refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // Daemons of prepared claims that died (an evicted daemon pod, a crash) are started
    // again between prepares too, not only at the next start.
    let (check_every, mut mps_check) = mps_check_timer(&args);
    // While the driver root holds no driver: not ready with the reason, and looked at again
    // on the start-up retry schedule's longest wait.
    if let Some(reason) = plugin.driver_wait.clone() {
        report_driver_wait(&ctx, reason).await;
    }
    let mut driver_check = driver_check_timer(&args);
    // The periodic check also looks for GPU instances left without compute instance (a
    // destroy that failed during a rollback) and republishes the pool when they change, so
    // that their placements are published as taken, never as free.
    let last_bare = Arc::new(std::sync::Mutex::new(plugin.bare_gpu_instances.clone()));
    let (pool_tx, mut pool_rx) =
        tokio::sync::mpsc::unbounded_channel::<cleave_api::pool::PoolDevices>();
    let counter_events = EventReporter::new(taint_client.clone(), args.node_name.clone());
    let mut background = vec![heartbeat_task.abort_handle(), coexistence.abort_handle()];
    background.extend(http.as_ref().map(|t| t.abort_handle()));
    let mut daemon = Daemon {
        args: &args,
        blocker: &ctx.blocker,
        start_node: &ctx.node,
        plugin,
        metrics,
        taint_client,
        counter_events,
        registration_tx,
        ready_tx,
        degraded_tx,
        last_error: None,
        was_published: false,
        counters_reported: false,
        mps_events,
        last_bare,
        pool_tx,
        pool_options: pool_options(&args),
        mps_check_task: None,
        background,
    };
    // Each event and its handler.
    loop {
        tokio::select! {
            s = signals.recv() => return daemon.on_shutdown_signal(s).await,
            _ = driver_check.tick(), if daemon.plugin.driver_wait.is_some() => {
                daemon.on_driver_check_tick().await;
            }
            _ = mps_check.tick(), if !check_every.is_zero() => daemon.on_mps_check_tick(),
            Some(pool) = pool_rx.recv() => daemon.on_pool_rebuilt(pool),
            _ = mps_refresh.tick() => daemon.on_mps_refresh_tick(),
            Some(()) = async {
                match health_changes.as_mut() {
                    Some(rx) => rx.changed().await.ok(),
                    None => std::future::pending().await,
                }
            } => daemon.on_health_change(),
            Ok(()) = registration.changed() => {
                daemon.on_registration_change(registration.borrow_and_update().clone());
            }
            Ok(()) = published.changed() => {
                daemon.on_publish_status(published.borrow_and_update().clone()).await;
            }
        }
    }
}

/// `run --uninstall`: deletes this node's ResourceSlices and exits.
async fn uninstall(args: &RunArgs, client: &kube::Client) -> anyhow::Result<ExitCode> {
    let config = PublisherConfig::new(args.kubelet.driver_name.clone(), args.node_name.clone());
    let deleted = uninstall_slices(client, &config)
        .await
        .context("deleting ResourceSlices")?;
    info!(deleted, node = %args.node_name, driver = %config.driver_name, "uninstalled ResourceSlices");
    Ok(ExitCode::SUCCESS)
}

/// The probe endpoints' inputs `run` updates, and the tasks serving them.
struct Probes {
    registration_tx: tokio::sync::watch::Sender<RegistrationState>,
    ready_tx: tokio::sync::watch::Sender<bool>,
    degraded_tx: tokio::sync::watch::Sender<Option<String>>,
    blocker: Arc<Blocker>,
    heartbeat_task: tokio::task::JoinHandle<()>,
    http: Option<tokio::task::JoinHandle<()>>,
}

/// Starts the heartbeat and, with `--metrics-addr`, serves `/metrics`, `/healthz` and
/// `/readyz` (not ready, "starting", until start-up says otherwise).
async fn serve_probes(
    args: &RunArgs,
    client: &kube::Client,
    metrics: Option<&Arc<Metrics>>,
) -> anyhow::Result<Probes> {
    let (registration_tx, registration_rx) =
        tokio::sync::watch::channel(RegistrationState::Pending);
    let (ready_tx, ready_rx) = tokio::sync::watch::channel(false);
    let blocker = Arc::new(tokio::sync::watch::channel(Some("starting".to_owned())).0);
    let (degraded_tx, degraded_rx) = tokio::sync::watch::channel(None::<String>);
    let heartbeat = Arc::new(Heartbeat::default());
    heartbeat.beat();
    let heartbeat_task = heartbeat.spawn();
    let http = match (args.metrics_addr, metrics) {
        (Some(addr), Some(m)) => {
            let state = ProbeState {
                metrics: Arc::clone(m),
                registration: registration_rx,
                published: ready_rx,
                blocker: blocker.subscribe(),
                degraded: degraded_rx,
                heartbeat: Arc::clone(&heartbeat),
                auth: (args.metrics.metrics_auth == crate::args::MetricsAuth::Kubernetes)
                    .then(|| Arc::new(crate::metrics::auth::ScrapeAuth::new(client.clone()))),
            };
            let (local, task) = crate::metrics::start(addr, state, (&args.metrics).into())
                .await
                .map_err(|source| crate::start::StartError::Metrics { addr, source })?;
            info!(addr = %local, auth = ?args.metrics.metrics_auth, "serving /metrics, /healthz and /readyz");
            Some(task)
        }
        _ => None,
    };
    Ok(Probes {
        registration_tx,
        ready_tx,
        degraded_tx,
        blocker,
        heartbeat_task,
        http,
    })
}

/// Looks for other managers of this node's GPUs in the background (see
/// [`crate::k8s::coexistence`]).
fn spawn_coexistence_check(
    args: &RunArgs,
    client: kube::Client,
    ctx: &StartContext,
    plugin: &RunningPlugin,
    events: EventReporter,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(crate::k8s::coexistence::check_and_report(
        client,
        ctx.node.clone(),
        args.kubelet.driver_name.clone(),
        plugin
            .driver
            .inventory()
            .gpus
            .iter()
            .map(|g| g.uuid.clone())
            .collect(),
        plugin.publisher.other_drivers(),
        events,
    ))
}

/// The check for dead MPS daemons of prepared claims: its period (jittered per node; zero:
/// off) and its timer, first firing one period after start.
fn mps_check_timer(args: &RunArgs) -> (std::time::Duration, tokio::time::Interval) {
    let check_every = jittered_check_interval(
        std::time::Duration::from_secs(args.mps.mps_check_interval_secs),
        &args.node_name,
    );
    let mut mps_check = tokio::time::interval_at(
        tokio::time::Instant::now() + check_every.max(std::time::Duration::from_secs(1)),
        check_every.max(std::time::Duration::from_secs(1)),
    );
    mps_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    (check_every, mps_check)
}

/// Not ready, with `reason` (the driver root holds no driver), on `/readyz` and in a Node
/// Event.
async fn report_driver_wait(ctx: &StartContext, reason: String) {
    let reason = format!("NVIDIA driver not ready: {reason}");
    crate::start::driver_not_ready_event(ctx, &reason, &mut None).await;
    ctx.blocker.send_replace(Some(reason));
}

/// How often the driver root is looked at again while it holds no driver: the start-up
/// retry schedule's longest wait.
fn driver_check_timer(args: &RunArgs) -> tokio::time::Interval {
    let mut driver_check = tokio::time::interval(std::time::Duration::from_millis(
        args.lifecycle.retry_max_ms.clamp(100, 10_000),
    ));
    driver_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    driver_check
}

/// How the pool is published (the instances are filled in when it is rebuilt).
fn pool_options(args: &RunArgs) -> PoolOptions {
    PoolOptions {
        dynamic_mig: args.driver.dynamic_mig,
        consumable_capacity: args.driver.consumable_capacity,
        share_on_demand_mig: args.driver.share_on_demand_mig,
        ..PoolOptions::default()
    }
}

/// What `run`'s event loop keeps between events; each event has a handler method.
struct Daemon<'a> {
    args: &'a RunArgs,
    /// Why the plugin is not ready (the driver root without driver).
    blocker: &'a Blocker,
    /// The Node as read at start (the reference of its Events).
    start_node: &'a StartNode,
    plugin: RunningPlugin,
    metrics: Option<Arc<Metrics>>,
    /// The client the taint checks and the counter Events use.
    taint_client: kube::Client,
    counter_events: EventReporter,
    registration_tx: tokio::sync::watch::Sender<RegistrationState>,
    ready_tx: tokio::sync::watch::Sender<bool>,
    degraded_tx: tokio::sync::watch::Sender<Option<String>>,
    /// The last publish error logged (each new one is logged once).
    last_error: Option<String>,
    was_published: bool,
    /// Whether the dropped-counters warning is the one reported.
    counters_reported: bool,
    mps_events: EventReporter,
    last_bare: Arc<Mutex<BTreeMap<String, Vec<BareGpuInstance>>>>,
    pool_tx: tokio::sync::mpsc::UnboundedSender<PoolDevices>,
    pool_options: PoolOptions,
    /// The periodic sharing check in progress, if any.
    mps_check_task: Option<tokio::task::JoinHandle<()>>,
    /// Tasks aborted at shutdown (heartbeat, coexistence check, HTTP server), in order.
    background: Vec<tokio::task::AbortHandle>,
}

impl Daemon<'_> {
    /// SIGTERM or SIGINT: lets a running sharing check finish, stops the background tasks
    /// and shuts the plugin down.
    async fn on_shutdown_signal(self, signal: &'static str) -> anyhow::Result<ExitCode> {
        info!(signal, "shutting down");
        if let Some(task) = self.mps_check_task {
            // Let a check that runs finish: it may be starting a daemon.
            let _ = tokio::time::timeout(std::time::Duration::from_secs(30), task).await;
        }
        for task in &self.background {
            task.abort();
        }
        self.plugin.shutdown().await?;
        info!("stopped");
        Ok(ExitCode::SUCCESS)
    }

    /// While the driver root holds no driver: looks at it again.
    async fn on_driver_check_tick(&mut self) {
        recheck_driver_root(&mut self.plugin, self.metrics.as_deref(), self.blocker).await;
    }

    /// Starts the periodic sharing check unless the previous one still runs.
    fn on_mps_check_tick(&mut self) {
        if self.mps_check_task.as_ref().is_none_or(|t| t.is_finished()) {
            self.mps_check_task = Some(spawn_sharing_check(
                Arc::clone(&self.plugin.driver),
                self.plugin.node_lock.clone(),
                self.mps_events.clone(),
                Arc::clone(&self.last_bare),
                self.pool_tx.clone(),
                self.pool_options.clone(),
            ));
        }
    }

    /// The sharing check rebuilt the pool: hands it to health, holds it, or publishes it.
    fn on_pool_rebuilt(&mut self, pool: PoolDevices) {
        // Health applies its taints to the new pool and triggers the publish.
        match self.plugin.server.health() {
            Some(h) => h.set_base_pool(pool),
            // Nothing is published while the driver root holds no driver.
            None if self.plugin.driver_wait.is_some() => self.plugin.pending_pool = Some(pool),
            None => {
                publish(&self.plugin, self.metrics.as_deref(), pool);
            }
        }
    }

    /// Refreshes the MPS gauges from the checkpoint.
    fn on_mps_refresh_tick(&self) {
        if let Some(m) = &self.metrics {
            m.observability.refresh_from_checkpoint(&self.plugin.driver);
        }
    }

    /// A device became unhealthy or healthy again: taint or drop it (nothing is published
    /// while the driver root holds no driver).
    fn on_health_change(&self) {
        let plugin = &self.plugin;
        if let Some(h) = plugin
            .server
            .health()
            .filter(|_| plugin.driver_wait.is_none())
        {
            let version = publish(plugin, self.metrics.as_deref(), h.pool_to_publish());
            if h.needs_taint_check() {
                tokio::spawn(Arc::clone(h).verify_taints(
                    self.taint_client.clone(),
                    self.args.kubelet.driver_name.clone(),
                    version,
                    plugin.publisher.status(),
                ));
            }
        }
    }

    /// The kubelet's registration verdict changed: logs it and passes it to `/readyz`.
    fn on_registration_change(&self, state: RegistrationState) {
        info!(state = ?state, "registration state changed");
        if let Some(m) = &self.metrics {
            m.set_registered(state == RegistrationState::Registered);
        }
        self.registration_tx.send_replace(state);
    }

    /// The publisher's status changed: logs errors once, marks ready, updates the gauges
    /// and reports dropped counters.
    async fn on_publish_status(&mut self, s: cleave_controller::PublisherStatus) {
        if s.last_error != self.last_error {
            if let Some(e) = &s.last_error {
                warn!(error = %e, "publishing ResourceSlices failed; retrying");
            }
            self.last_error = s.last_error.clone();
        }
        if s.published {
            self.ready_tx.send_replace(true);
            if let Some(m) = &self.metrics {
                m.set_slices_published(s.slices);
                m.set_devices_withheld(s.withdrawn_devices);
            }
            let withheld = s.counters == CounterSupport::Dropped;
            if withheld != self.counters_reported {
                self.counters_reported = withheld;
                report_counter_support(
                    &self.taint_client,
                    &self.counter_events,
                    self.start_node,
                    &self.degraded_tx,
                    &s,
                )
                .await;
            }
        }
        if s.published && !self.was_published {
            info!(
                slices = s.slices,
                generation = s.generation,
                writes = s.writes,
                "ResourceSlices published"
            );
        }
        self.was_published = s.published;
    }
}

/// Publishes `pool` and records it as the published pool.
fn publish(plugin: &RunningPlugin, metrics: Option<&Metrics>, pool: PoolDevices) -> u64 {
    if let Some(m) = metrics {
        m.observability.set_published(&pool);
    }
    plugin.publisher.publish(pool)
}

/// While the driver root holds no driver: looks again, and once the files are there
/// publishes the pool that was held back and clears the not-ready reason.
async fn recheck_driver_root(
    plugin: &mut RunningPlugin,
    metrics: Option<&Metrics>,
    blocker: &Blocker,
) {
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
            publish(plugin, metrics, pool);
            plugin.driver_wait = None;
            plugin.pending_pool = None;
            blocker.send_replace(None);
        }
        Ok(Ok(false)) => {}
        Ok(Err(e)) => warn!(error = %e, "looking at the driver root again"),
        Err(e) => warn!(error = %e, "looking at the driver root again"),
    }
}

/// The periodic sharing check, under the node lock: starts dead MPS daemons of prepared
/// claims again (with an Event on each claim) and, with on-demand MIG, sends a new pool on
/// `pool_tx` when the GPU instances without compute instance changed.
/// The MPS check interval of `node`: `every` spread over ±10 % by a hash of the node's name,
/// so that plugins started together (a rollout) do not check in step forever; stable per
/// node, like the slice watch's timeout.
fn jittered_check_interval(every: std::time::Duration, node: &str) -> std::time::Duration {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    node.hash(&mut h);
    // 900..=1100 thousandths.
    let per_mille = 900 + u32::try_from(h.finish() % 201).unwrap_or(0);
    every * per_mille / 1000
}

fn spawn_sharing_check(
    driver: Arc<NodeDriver>,
    node_lock: NodeLock,
    events: EventReporter,
    last_bare: Arc<Mutex<BTreeMap<String, Vec<BareGpuInstance>>>>,
    pool_tx: tokio::sync::mpsc::UnboundedSender<PoolDevices>,
    pool_options: PoolOptions,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let check = Arc::clone(&driver);
        match node_lock
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
        if pool_options.dynamic_mig {
            let check = Arc::clone(&driver);
            let Ok(bare) = node_lock.run(move || check.bare_gpu_instances()).await else {
                return;
            };
            let changed = {
                let mut last = last_bare
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                let changed = *last != bare;
                *last = bare.clone();
                changed
            };
            if changed {
                info!(bare = ?bare, "GPU instances without compute instance changed; republishing the pool");
                let pool = build_pool(
                    &driver.inventory(),
                    &PoolOptions {
                        owned_instances: driver.owned_mig_uuids(),
                        bare_gpu_instances: bare,
                        ..pool_options
                    },
                );
                let _ = pool_tx.send(pool);
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::jittered_check_interval;
    use std::time::Duration;

    #[test]
    fn check_interval_is_spread_by_node_within_ten_percent() {
        let every = Duration::from_secs(30);
        let spread: std::collections::BTreeSet<Duration> = (0..50)
            .map(|i| jittered_check_interval(every, &format!("node-{i}")))
            .collect();
        assert!(spread.len() > 10, "{spread:?}");
        for d in &spread {
            assert!(
                *d >= Duration::from_secs(27) && *d <= Duration::from_secs(33),
                "{d:?}"
            );
        }
        assert_eq!(
            jittered_check_interval(every, "node-a"),
            jittered_check_interval(every, "node-a")
        );
        assert!(jittered_check_interval(Duration::ZERO, "node-a").is_zero());
    }
}
