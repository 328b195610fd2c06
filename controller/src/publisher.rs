//! The ResourceSlice publisher: one background task per node and driver.
//!
//! ```text
//! publish(pool) --watch--> task: plan_slices -> diff(cache, desired) -> delete / update / create
//!                            ^ cache = list+watch (field selector spec.nodeName; this driver's kept)
//! status <--watch--------- task (published, generation, last error)
//! ```
//! The cache is fed by `kube::runtime::watcher`, so a restart with nothing changed costs
//! one list and makes no writes; objects returned by our own writes go into the cache at
//! once, and the watch events they cause are recognised by resourceVersion and ignored.
//! A foreign edit or deletion (the kubelet wipes a node's slices at its start and 30 s
//! after losing the plugin) is seen on the watch and repaired after a short debounce.
//! Failures are retried with jittered exponential backoff; 409 conflicts re-read the
//! object and re-plan at once (a few times per sync).
//!
//! The watch selects the node only (`spec.nodeName`, the field the API server's watch cache
//! indexes ResourceSlices by: kubernetes `pkg/registry/resource/resourceslice/strategy.go`,
//! `Indexers()`), not the driver: its initial list walks the same objects either way, and
//! the slices of other drivers on this node it brings are kept apart, never written, and
//! offered through [`SlicePublisher::other_drivers`] (the kubelet plugin's coexistence
//! check reads them there instead of listing them once more).
//!
//! Never publish what the cluster cannot enforce: a pool with shared counters (on-demand
//! MIG) is safe only if the API server keeps them. With `DRAPartitionableDevices` off it
//! drops `sharedCounters` and `consumesCounters` on write without an error, and every
//! overlapping placement would look independently allocatable. Before the first write of a
//! pool with counters the publisher asks the server with a dry-run create of a slice that
//! holds them (a dry run goes through the same field dropping as a write); if they are
//! dropped (or a real write comes back without them), it withdraws every device that
//! consumes counters, publishes what is still safe, reports it in
//! [`PublisherStatus::counters`], and asks again every
//! [`PublisherConfig::counter_probe_interval`]; once counters survive, the full pool is
//! published.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cleave_api::pool::{DeviceGroup, PoolDevices};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourcePool, ResourceSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::backoff::{Backoff, BackoffConfig};
use crate::diff::{PoolTarget, SyncPlan, content_key, diff};
use crate::plan::{PlanError, SliceLayout, plan_slices};
use crate::stats::ApiObserver;

/// Errors of the publisher, named after the failed operation.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The pool cannot be published under the server's limits.
    #[error("planning ResourceSlices: {0}")]
    Plan(#[from] PlanError),
    /// `GET /version` failed.
    #[error("reading the API server version: {0}")]
    GetVersion(#[source] kube::Error),
    /// `GET` of the Node (for the owner reference) failed.
    #[error("reading node {node}: {source}")]
    GetNode {
        /// Node name.
        node: String,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// Listing this driver's slices failed.
    #[error("listing ResourceSlices ({selector}): {source}")]
    ListSlices {
        /// Field selector used.
        selector: String,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// Re-reading a slice after a conflict failed.
    #[error("reading ResourceSlice {name}: {source}")]
    GetSlice {
        /// Object name.
        name: String,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// Creating a slice failed.
    #[error("creating a ResourceSlice of pool {pool}: {source}")]
    CreateSlice {
        /// Pool name.
        pool: String,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// Updating a slice failed.
    #[error("updating ResourceSlice {name}: {source}")]
    UpdateSlice {
        /// Object name.
        name: String,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// Deleting a slice failed.
    #[error("deleting ResourceSlice {name}: {source}")]
    DeleteSlice {
        /// Object name.
        name: String,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// Still conflicting after the configured number of re-reads.
    #[error("ResourceSlice {name}: still conflicting after {attempts} re-reads")]
    Conflicts {
        /// Object name.
        name: String,
        /// Re-reads done.
        attempts: u32,
    },
    /// The server stored something other than what was written (a field dropped,
    /// e.g. a feature gate is off), so the slices can never match the desired state.
    #[error("the API server altered ResourceSlices on write (fields dropped? feature gate off?)")]
    ServerAlteredSlices,
    /// Rendering YAML failed.
    #[error("rendering ResourceSlices as YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
    /// Waiting for the publisher timed out.
    #[error("timed out after {0:?} waiting for the ResourceSlices to be published")]
    WaitTimeout(Duration),
    /// The background task is gone.
    #[error("the publisher task has stopped")]
    Stopped,
}

/// Settings of a [`SlicePublisher`].
#[derive(Clone)]
pub struct PublisherConfig {
    /// DRA driver name (`spec.driver`).
    pub driver_name: String,
    /// Node name: `spec.nodeName` and the pool name.
    pub node_name: String,
    /// Node UID for the owner reference; fetched once (`GET node`) when a slice has to
    /// be created and this is `None`.
    pub node_uid: Option<String>,
    /// Force a layout instead of deriving it from `GET /version`.
    pub layout: Option<SliceLayout>,
    /// Retry settings.
    pub backoff: BackoffConfig,
    /// Quiet time that batches watch events and `publish` calls before a sync.
    pub debounce: Duration,
    /// Called per API request (verb, result), e.g. to feed Prometheus.
    pub observer: Option<ApiObserver>,
    /// While the server drops counters, how often to ask again whether it keeps them.
    pub counter_probe_interval: Duration,
}

impl std::fmt::Debug for PublisherConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublisherConfig")
            .field("driver_name", &self.driver_name)
            .field("node_name", &self.node_name)
            .field("node_uid", &self.node_uid)
            .field("layout", &self.layout)
            .field("backoff", &self.backoff)
            .field("debounce", &self.debounce)
            .field("observer", &self.observer.is_some())
            .field("counter_probe_interval", &self.counter_probe_interval)
            .finish()
    }
}

impl PublisherConfig {
    /// Defaults for `driver` on `node`: layout from the server, 20 ms debounce,
    /// backoff 100 ms .. 30 s.
    pub fn new(driver: impl Into<String>, node: impl Into<String>) -> Self {
        Self {
            driver_name: driver.into(),
            node_name: node.into(),
            node_uid: None,
            layout: None,
            backoff: BackoffConfig::default(),
            debounce: Duration::from_millis(20),
            observer: None,
            counter_probe_interval: Duration::from_secs(60),
        }
    }

    /// The watch's selector: this node's slices of every driver (see the module docs).
    fn watch_selector(&self) -> String {
        format!("spec.nodeName={}", self.node_name)
    }

    /// This driver's slices on this node (the uninstall's list).
    fn selector(&self) -> String {
        format!(
            "spec.driver={},spec.nodeName={}",
            self.driver_name, self.node_name
        )
    }

    fn observe(&self, verb: &'static str, result: &'static str) {
        if let Some(o) = &self.observer {
            o(verb, result);
        }
    }

    fn observe_result<T>(&self, verb: &'static str, r: &Result<T, kube::Error>) {
        self.observe(verb, result_label(r));
    }
}

fn status_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

fn result_label<T>(r: &Result<T, kube::Error>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(e) => match status_code(e) {
            Some(404) => "not_found",
            Some(409) => "conflict",
            _ => "error",
        },
    }
}

/// What readiness probes and metrics look at.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PublisherStatus {
    /// The API server holds exactly the latest desired state.
    pub published: bool,
    /// Which `publish` call (1, 2, …) the last successful sync wrote; 0 before any.
    pub published_version: u64,
    /// Pool generation of the published slices.
    pub generation: i64,
    /// Number of published slices.
    pub slices: usize,
    /// Layout in use, once known.
    pub layout: Option<SliceLayout>,
    /// Error of the last failed sync, cleared by a successful one.
    pub last_error: Option<String>,
    /// Sync attempts so far (successful or not).
    pub syncs: u64,
    /// Write requests (create, update, delete) made so far.
    pub writes: u64,
    /// Whether the server keeps the shared counters of the pool.
    pub counters: CounterSupport,
    /// Devices withheld because the server drops counters (0 otherwise).
    pub withdrawn_devices: usize,
}

/// Whether the API server keeps `sharedCounters` and `consumesCounters`
/// (the `DRAPartitionableDevices` feature gate).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CounterSupport {
    /// Not known yet, or the pool has no counters.
    #[default]
    Unknown,
    /// A write (or dry run) kept them.
    Kept,
    /// The server dropped them: devices that consume counters are withheld.
    Dropped,
}

/// The feature gate without which the API server drops counters.
pub const PARTITIONABLE_DEVICES_GATE: &str = "DRAPartitionableDevices";

/// `pool` without what depends on counters: counter sets, and every device that consumes
/// counters (MIG placements and the whole GPUs of on-demand GPUs). Returns it with the
/// number of devices withheld.
pub fn without_counters(pool: &PoolDevices) -> (PoolDevices, usize) {
    let mut withdrawn = 0;
    let groups = pool
        .groups
        .iter()
        .map(|g| {
            let devices: Vec<_> = g
                .devices
                .iter()
                .filter(|d| d.consumes_counters.as_ref().is_none_or(Vec::is_empty))
                .cloned()
                .collect();
            withdrawn += g.devices.len() - devices.len();
            DeviceGroup {
                counter_sets: Vec::new(),
                devices,
            }
        })
        .filter(|g| !g.devices.is_empty())
        .collect();
    (PoolDevices { groups }, withdrawn)
}

fn consumes_counters(d: &k8s_openapi::api::resource::v1::Device) -> bool {
    d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
}

fn uses_counters(spec: &crate::plan::SliceSpec) -> bool {
    !spec.shared_counters.is_empty() || spec.devices.iter().any(consumes_counters)
}

/// Whether the server dropped counters that `written` carried.
fn lost_counters(stored: &ResourceSlice, written: &ResourceSlice) -> bool {
    let w = &written.spec;
    let st = &stored.spec;
    let sets = |s: &k8s_openapi::api::resource::v1::ResourceSliceSpec| {
        s.shared_counters.as_ref().map_or(0, Vec::len)
    };
    let consuming = |s: &k8s_openapi::api::resource::v1::ResourceSliceSpec| {
        s.devices
            .iter()
            .flatten()
            .filter(|d| d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty()))
            .count()
    };
    sets(st) < sets(w) || consuming(st) < consuming(w)
}

/// Desired state plus its sequence number.
type Desired = Option<(u64, Arc<PoolDevices>)>;

/// Keeps a node's ResourceSlices equal to the last pool given to [`publish`](Self::publish).
/// Drop or [`shutdown`](Self::shutdown) leaves the slices in place (a restarted plugin
/// takes them over without a write); [`uninstall`](Self::uninstall) deletes them.
pub struct SlicePublisher {
    desired: watch::Sender<Desired>,
    status: watch::Receiver<PublisherStatus>,
    others: watch::Receiver<OtherDrivers>,
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
    client: Client,
    config: PublisherConfig,
    version: AtomicU64,
}

impl std::fmt::Debug for SlicePublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlicePublisher")
            .field("config", &self.config)
            .field("version", &self.version)
            .finish()
    }
}

impl SlicePublisher {
    /// Starts the background task (list+watch begins at once; nothing is written until
    /// the first [`publish`](Self::publish)). Must be called inside a tokio runtime.
    pub fn start(client: Client, config: PublisherConfig) -> Self {
        let (desired_tx, desired_rx) = watch::channel(None);
        let (status_tx, status_rx) = watch::channel(PublisherStatus {
            layout: config.layout,
            ..Default::default()
        });
        let (stop_tx, stop_rx) = watch::channel(false);
        let (others_tx, others_rx) = watch::channel(None);
        let worker = Worker {
            api: Api::all(client.clone()),
            client: client.clone(),
            config: config.clone(),
            cache: BTreeMap::new(),
            staging: None,
            others: BTreeMap::new(),
            others_staging: None,
            others_tx,
            initialized: false,
            deleted: BTreeSet::new(),
            layout: config.layout,
            node_uid: config.node_uid.clone(),
            last_generation: 0,
            status: status_tx,
            desired: desired_rx,
            counters: CounterSupport::Unknown,
            next_counter_probe: None,
        };
        let task = tokio::spawn(worker.run(stop_rx));
        Self {
            desired: desired_tx,
            status: status_rx,
            others: others_rx,
            stop: stop_tx,
            task: Some(task),
            client,
            config,
            version: AtomicU64::new(0),
        }
    }

    /// Replaces the desired state (any time; e.g. MIG state changed, a GPU vanished).
    /// Returns its sequence number, which [`PublisherStatus::published_version`]
    /// reaches once it is on the server.
    pub fn publish(&self, pool: PoolDevices) -> u64 {
        let pool = Arc::new(pool);
        let mut version = 0;
        // Numbering inside send_modify keeps versions and values in the same order when
        // several tasks publish at once.
        self.desired.send_modify(|d| {
            version = self.version.fetch_add(1, Ordering::SeqCst) + 1;
            *d = Some((version, pool));
        });
        version
    }

    /// Status updates, for readiness probes (`published`) and metrics.
    pub fn status(&self) -> watch::Receiver<PublisherStatus> {
        self.status.clone()
    }

    /// Other drivers' ResourceSlices on this node, as the watch sees them: `None` until its
    /// first list is complete, then kept current (no request of its own).
    pub fn other_drivers(&self) -> watch::Receiver<OtherDrivers> {
        self.others.clone()
    }

    /// Waits until the latest [`publish`](Self::publish) is on the server.
    pub async fn wait_published(&self, timeout: Duration) -> Result<PublisherStatus, Error> {
        let want = self.version.load(Ordering::SeqCst);
        let mut rx = self.status.clone();
        let wait = rx.wait_for(|s| s.published && s.published_version >= want);
        match tokio::time::timeout(timeout, wait).await {
            Ok(Ok(s)) => Ok(s.clone()),
            Ok(Err(_)) => Err(Error::Stopped),
            Err(_) => Err(Error::WaitTimeout(timeout)),
        }
    }

    /// Stops the background task; the slices stay (normal restart and upgrade path).
    pub async fn shutdown(mut self) {
        self.stop_task().await;
    }

    async fn stop_task(&mut self) {
        self.stop.send_replace(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }

    /// Stops the task and deletes every slice of this driver on this node (the explicit
    /// cleanup path, never run on a normal restart). Returns how many were deleted.
    pub async fn uninstall(mut self) -> Result<usize, Error> {
        self.stop_task().await;
        uninstall_slices(&self.client, &self.config).await
    }
}

impl Drop for SlicePublisher {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

/// Deletes every ResourceSlice of `config.driver_name` on `config.node_name` (list with
/// the field selector, then delete each with uid preconditions), retrying transient
/// failures with backoff a few times. Usable without a running publisher (`--uninstall`).
pub async fn uninstall_slices(client: &Client, config: &PublisherConfig) -> Result<usize, Error> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let selector = config.selector();
    let mut backoff = Backoff::new(config.backoff.clone());
    let mut deleted = 0;
    loop {
        match uninstall_once(&api, config, &selector, &mut deleted).await {
            Ok(()) => return Ok(deleted),
            Err(e) if backoff.attempts() < 5 => {
                warn!(error = %e, "uninstalling ResourceSlices failed, retrying");
                tokio::time::sleep(backoff.next_delay()).await;
            }
            Err(e) => return Err(e),
        }
    }
}

async fn uninstall_once(
    api: &Api<ResourceSlice>,
    config: &PublisherConfig,
    selector: &str,
    deleted: &mut usize,
) -> Result<(), Error> {
    let r = api.list(&ListParams::default().fields(selector)).await;
    config.observe_result("list", &r);
    let list = r.map_err(|source| Error::ListSlices {
        selector: selector.to_owned(),
        source,
    })?;
    for s in list.items {
        let name = s.metadata.name.clone().unwrap_or_default();
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: s.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        let r = api.delete(&name, &dp).await;
        config.observe_result("delete", &r);
        match r {
            Ok(_) => *deleted += 1,
            Err(e) if status_code(&e) == Some(404) => {}
            Err(source) => return Err(Error::DeleteSlice { name, source }),
        }
    }
    Ok(())
}

/// The desired state as ResourceSlice YAML documents (`inspect --yaml`): what a fresh
/// publish would create (generation 1, no owner reference).
pub fn slices_yaml(
    pool: &PoolDevices,
    layout: SliceLayout,
    driver: &str,
    node: &str,
) -> Result<String, Error> {
    let specs = plan_slices(pool, layout)?;
    let count = i64::try_from(specs.len()).unwrap_or(i64::MAX);
    let mut out = String::new();
    for s in &specs {
        let obj = ResourceSlice {
            metadata: ObjectMeta {
                generate_name: Some(generate_name(node, driver)),
                ..ObjectMeta::default()
            },
            spec: s.to_spec(
                driver,
                node,
                ResourcePool {
                    name: node.to_owned(),
                    generation: 1,
                    resource_slice_count: count,
                },
            ),
        };
        out.push_str("---\n");
        out.push_str(&crate::yaml::yaml11_safe(&serde_yaml::to_string(&obj)?));
    }
    Ok(out)
}

/// The `generateName` of this node's slices: `<node>-<driver>-`, with the node name cut so
/// the prefix stays within the 58 characters the API server keeps of it (63 less its 5
/// random ones, k8s.io/apiserver/pkg/storage/names/generate.go) — a longer prefix is cut
/// there anyway, and one over 253 characters is refused as an invalid `generateName`.
fn generate_name(node: &str, driver: &str) -> String {
    const KEPT: usize = 58;
    let room = KEPT.saturating_sub(driver.len() + 2);
    let mut end = node.len().min(room);
    while !node.is_char_boundary(end) {
        end -= 1;
    }
    let node = node[..end].trim_end_matches(['.', '-']);
    if node.is_empty() {
        format!("{driver}-")
    } else {
        format!("{node}-{driver}-")
    }
}

/// Other drivers' slices on the node (`None` before the watch's first list completes).
pub type OtherDrivers = Option<Arc<Vec<ResourceSlice>>>;

/// Outcome of applying one plan.
enum Applied {
    Done {
        /// Some object came back different from what was written.
        altered: bool,
        /// Some object came back without the counters it was written with.
        counters_lost: bool,
    },
    /// A write hit a conflict or a vanished object; the cache was refreshed: re-plan.
    Replan(String),
}

struct Worker {
    api: Api<ResourceSlice>,
    client: Client,
    config: PublisherConfig,
    /// This driver's slices on this node, by name, as last seen or written.
    cache: BTreeMap<String, ResourceSlice>,
    /// Objects of a watcher (re)list in progress.
    staging: Option<BTreeMap<String, ResourceSlice>>,
    /// Other drivers' slices on this node, by name (never written).
    others: BTreeMap<String, ResourceSlice>,
    /// Other drivers' slices of a (re)list in progress.
    others_staging: Option<BTreeMap<String, ResourceSlice>>,
    others_tx: watch::Sender<OtherDrivers>,
    initialized: bool,
    /// Names we deleted (generated names are never reused): late events are ignored.
    deleted: BTreeSet<String>,
    layout: Option<SliceLayout>,
    node_uid: Option<String>,
    last_generation: i64,
    status: watch::Sender<PublisherStatus>,
    desired: watch::Receiver<Desired>,
    counters: CounterSupport,
    /// When to ask again whether counters are kept (while they are dropped).
    next_counter_probe: Option<Instant>,
}

/// Whether the server stored `written` differently (semantically) from how it was sent.
fn stored_differs(stored: &ResourceSlice, written: &ResourceSlice) -> bool {
    stored.spec.pool != written.spec.pool || content_key(&stored.spec) != content_key(&written.spec)
}

fn rv(s: &ResourceSlice) -> Option<&str> {
    s.metadata.resource_version.as_deref()
}

/// Whether `new` is not newer than `old` (same or older resourceVersion). Versions are
/// opaque strings; when both are integers (every real server) they are compared as such.
fn not_newer(new: &ResourceSlice, old: &ResourceSlice) -> bool {
    match (rv(new), rv(old)) {
        (Some(n), Some(o)) if n == o => true,
        (Some(n), Some(o)) => match (n.parse::<u64>(), o.parse::<u64>()) {
            (Ok(n), Ok(o)) => n <= o,
            _ => false,
        },
        _ => false,
    }
}

/// Server-side timeout of the node's watches (ResourceSlices here, MPS daemon pods in the
/// kubelet plugin), in seconds, spread over 960–1199 s by the node's name. Each renewal is
/// one WATCH request from the last resourceVersion, so a node holding both watches costs at
/// most 2/960 requests/s (0.0021/s) at rest: no more than one client-go informer on
/// average (k8s.io/client-go/tools/cache/reflector.go draws each timeout from
/// [minWatchTimeout, 2 × minWatchTimeout) with minWatchTimeout 5 min: 7.5 min mean,
/// 0.0022/s), which is what NVIDIA's GPU plugin was measured at. The API server honours the
/// asked timeout and, when none is asked, picks one in [1800, 3600) s itself
/// (`--min-request-timeout` 1800 s; k8s.io/apiserver/pkg/endpoints/handlers/get.go), so 16–20
/// minutes stays below its own choice. kube's default is a fixed 290 s, so plugins started
/// together (a rollout, a power event) would also renew in step forever; a hash of the name,
/// not a random draw, keeps each node's figure stable and the spread over many nodes even.
/// kube's watcher allows 5 s more than this on the client side before it calls the stream dead.
pub fn watch_timeout_secs(node_name: &str) -> u32 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    node_name.hash(&mut h);
    WATCH_TIMEOUT_MIN_SECS
        + u32::try_from(h.finish() % u64::from(WATCH_TIMEOUT_SPREAD_SECS)).unwrap_or(0)
}

/// Shortest watch timeout [`watch_timeout_secs`] gives a node.
pub const WATCH_TIMEOUT_MIN_SECS: u32 = 960;
/// Width of the window [`watch_timeout_secs`] spreads nodes over.
pub const WATCH_TIMEOUT_SPREAD_SECS: u32 = 240;

impl Worker {
    async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let cfg = watcher::Config::default()
            .fields(&self.config.watch_selector())
            .timeout(watch_timeout_secs(&self.config.node_name));
        let mut events = watcher(self.api.clone(), cfg).default_backoff().boxed();
        let mut backoff = Backoff::new(self.config.backoff.clone());
        let mut due: Option<Instant> = None;
        info!(driver = %self.config.driver_name, node = %self.config.node_name, "ResourceSlice publisher started");
        loop {
            let timer = async {
                match due {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            let soon = |due: Option<Instant>, debounce| {
                let t = Instant::now() + debounce;
                Some(due.map_or(t, |d| d.min(t)))
            };
            tokio::select! {
                biased;
                _ = stop.changed() => break,
                ev = events.next() => match ev {
                    Some(Ok(ev)) => {
                        if self.on_event(ev) && self.desired.borrow().is_some() {
                            self.status.send_modify(|s| s.published = false);
                            due = soon(due, self.config.debounce);
                        }
                    }
                    Some(Err(e)) => {
                        self.config.observe("watch", "error");
                        warn!(error = %e, "watching ResourceSlices failed");
                    }
                    None => break,
                },
                changed = self.desired.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    backoff.reset();
                    due = soon(due, self.config.debounce);
                }
                () = timer => {
                    due = None;
                    if !self.initialized || self.staging.is_some() {
                        // The first sync runs when the list is complete (InitDone marks it due).
                        continue;
                    }
                    let desired = self.desired.borrow().clone();
                    let Some((version, pool)) = desired else { continue };
                    let result = tokio::select! {
                        biased;
                        _ = stop.changed() => break,
                        r = self.sync(&pool) => r,
                    };
                    match result {
                        Ok((generation, slices, withdrawn)) => {
                            backoff.reset();
                            let counters = self.counters;
                            self.status.send_modify(|s| {
                                s.published = true;
                                s.published_version = version;
                                s.generation = generation;
                                s.slices = slices;
                                s.layout = self.layout;
                                s.last_error = None;
                                s.syncs += 1;
                                s.counters = counters;
                                s.withdrawn_devices = withdrawn;
                            });
                            // Ask again later whether the server keeps counters now.
                            if let Some(t) = self.next_counter_probe {
                                due = Some(due.map_or(t, |d| d.min(t)));
                            }
                        }
                        Err(e) => {
                            let delay = match e {
                                // Only a new publish can fix the plan.
                                Error::Plan(_) => None,
                                _ => Some(backoff.next_delay()),
                            };
                            warn!(error = %e, retry_in = ?delay, "publishing ResourceSlices failed");
                            self.status.send_modify(|s| {
                                s.published = false;
                                s.layout = self.layout;
                                s.last_error = Some(e.to_string());
                                s.syncs += 1;
                            });
                            due = delay.map(|d| Instant::now() + d);
                        }
                    }
                }
            }
        }
        debug!("ResourceSlice publisher stopped");
    }

    /// Offers the other drivers' slices as they are now.
    fn send_others(&self) {
        let all = self.others.values().cloned().collect();
        self.others_tx.send_replace(Some(Arc::new(all)));
    }

    /// Applies a watcher event to the cache; true when the cache changed.
    fn on_event(&mut self, ev: watcher::Event<ResourceSlice>) -> bool {
        match ev {
            watcher::Event::Init => {
                self.staging = Some(BTreeMap::new());
                self.others_staging = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(o) if o.spec.driver != self.config.driver_name => {
                if let (Some(staging), Some(name)) =
                    (self.others_staging.as_mut(), o.metadata.name.clone())
                {
                    staging.insert(name, o);
                }
                false
            }
            watcher::Event::Apply(o) if o.spec.driver != self.config.driver_name => {
                if let Some(name) = o.metadata.name.clone() {
                    self.others.insert(name, o);
                    self.send_others();
                }
                false
            }
            watcher::Event::Delete(o) if o.spec.driver != self.config.driver_name => {
                if let Some(name) = &o.metadata.name
                    && self.others.remove(name).is_some()
                {
                    self.send_others();
                }
                false
            }
            watcher::Event::InitApply(o) => {
                if let (Some(staging), Some(name)) =
                    (self.staging.as_mut(), o.metadata.name.clone())
                {
                    staging.insert(name, o);
                }
                false
            }
            watcher::Event::InitDone => {
                self.config.observe("list", "ok");
                self.others = self.others_staging.take().unwrap_or_default();
                self.send_others();
                let fresh = self.staging.take().unwrap_or_default();
                let same = fresh.len() == self.cache.len()
                    && fresh
                        .iter()
                        .all(|(k, v)| self.cache.get(k).is_some_and(|c| rv(c) == rv(v)));
                self.cache = fresh;
                self.deleted.clear();
                let first = !self.initialized;
                self.initialized = true;
                first || !same
            }
            watcher::Event::Apply(o) => {
                let Some(name) = o.metadata.name.clone() else {
                    return false;
                };
                if self.deleted.contains(&name) {
                    return false;
                }
                if self.cache.get(&name).is_some_and(|old| not_newer(&o, old)) {
                    return false;
                }
                self.cache.insert(name, o);
                true
            }
            watcher::Event::Delete(o) => o
                .metadata
                .name
                .as_ref()
                .is_some_and(|n| self.cache.remove(n).is_some()),
        }
    }

    async fn layout(&mut self) -> Result<SliceLayout, Error> {
        if let Some(l) = self.layout {
            return Ok(l);
        }
        let r = self.client.apiserver_version().await;
        self.config.observe_result("get_version", &r);
        let info = r.map_err(Error::GetVersion)?;
        let layout = SliceLayout::for_server_version(&info.major, &info.minor);
        info!(major = %info.major, minor = %info.minor, %layout, "ResourceSlice layout chosen from the server version");
        self.layout = Some(layout);
        Ok(layout)
    }

    async fn node_uid(&mut self) -> Result<String, Error> {
        if let Some(uid) = &self.node_uid {
            return Ok(uid.clone());
        }
        let nodes: Api<Node> = Api::all(self.client.clone());
        let r = nodes.get(&self.config.node_name).await;
        self.config.observe_result("get_node", &r);
        let node = r.map_err(|source| Error::GetNode {
            node: self.config.node_name.clone(),
            source,
        })?;
        let uid = node.metadata.uid.unwrap_or_default();
        self.node_uid = Some(uid.clone());
        Ok(uid)
    }

    /// Asks the server, with dry-run creates, whether it keeps the counters of `full`
    /// (one slice with counter sets, one with counter-consuming devices). Sets
    /// [`Self::counters`]; a failed dry run leaves it as it was (writes still detect it).
    async fn probe_counters(&mut self, full: &[crate::plan::SliceSpec]) {
        let mut probes: Vec<&crate::plan::SliceSpec> = Vec::new();
        if let Some(s) = full.iter().find(|s| !s.shared_counters.is_empty()) {
            probes.push(s);
        }
        if let Some(s) = full
            .iter()
            .find(|s| s.devices.iter().any(consumes_counters))
            && !probes.iter().any(|p| std::ptr::eq(*p, s))
        {
            probes.push(s);
        }
        let pool = ResourcePool {
            name: self.config.node_name.clone(),
            generation: self.last_generation,
            resource_slice_count: i64::try_from(full.len()).unwrap_or(i64::MAX),
        };
        let pp = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        let mut dropped = false;
        for spec in probes {
            let obj = ResourceSlice {
                metadata: ObjectMeta {
                    generate_name: Some(generate_name(
                        &self.config.node_name,
                        &self.config.driver_name,
                    )),
                    ..ObjectMeta::default()
                },
                spec: spec.to_spec(
                    &self.config.driver_name,
                    &self.config.node_name,
                    pool.clone(),
                ),
            };
            let r = self.api.create(&pp, &obj).await;
            self.config.observe_result("dry_run_create", &r);
            match r {
                Ok(o) => dropped |= lost_counters(&o, &obj),
                Err(e) => {
                    warn!(error = %e, "dry-run create to check that the API server keeps counters failed; relying on the writes");
                    return;
                }
            }
        }
        self.set_counters(if dropped {
            CounterSupport::Dropped
        } else {
            CounterSupport::Kept
        });
    }

    fn set_counters(&mut self, now: CounterSupport) {
        if now == CounterSupport::Dropped {
            self.next_counter_probe = Some(Instant::now() + self.config.counter_probe_interval);
        } else {
            self.next_counter_probe = None;
        }
        if now == self.counters {
            return;
        }
        match now {
            CounterSupport::Dropped => warn!(
                gate = PARTITIONABLE_DEVICES_GATE,
                "the API server drops sharedCounters/consumesCounters (feature gate {PARTITIONABLE_DEVICES_GATE} off?): withholding every device that consumes counters (MIG placements, whole GPUs of on-demand GPUs)"
            ),
            CounterSupport::Kept if self.counters == CounterSupport::Dropped => {
                info!("the API server keeps counters now; publishing the full pool")
            }
            _ => {}
        }
        self.counters = now;
    }

    /// One sync: returns (generation, slice count, withheld devices) once the server
    /// matches `pool`, or `pool` without what depends on counters when the server drops them.
    async fn sync(&mut self, pool: &PoolDevices) -> Result<(i64, usize, usize), Error> {
        let layout = self.layout().await?;
        let full = plan_slices(pool, layout)?;
        let has_counters = full.iter().any(uses_counters);
        if !has_counters {
            self.counters = CounterSupport::Unknown;
            self.next_counter_probe = None;
        } else if self.counters != CounterSupport::Dropped
            && diff(
                self.cache.values(),
                &full,
                &PoolTarget {
                    driver: &self.config.driver_name,
                    node: &self.config.node_name,
                    min_generation: self.last_generation,
                },
            )
            .is_empty()
        {
            // The server holds the full pool, counters included (a restart with nothing
            // changed): they are kept, and nothing is written or asked.
            self.set_counters(CounterSupport::Kept);
        } else if self.counters == CounterSupport::Unknown
            || self.next_counter_probe.is_some_and(|t| Instant::now() >= t)
        {
            self.probe_counters(&full).await;
        }
        let (mut desired, mut withdrawn) =
            if has_counters && self.counters == CounterSupport::Dropped {
                let (safe, n) = without_counters(pool);
                (plan_slices(&safe, layout)?, n)
            } else {
                (full, 0)
            };
        let mut replans = 0;
        loop {
            let target = PoolTarget {
                driver: &self.config.driver_name,
                node: &self.config.node_name,
                min_generation: self.last_generation,
            };
            let plan = diff(self.cache.values(), &desired, &target);
            if plan.is_empty() {
                self.last_generation = plan.generation;
                return Ok((plan.generation, desired.len(), withdrawn));
            }
            debug!(
                generation = plan.generation,
                deletes = plan.deletes.len(),
                updates = plan.updates.len(),
                creates = plan.creates.len(),
                "syncing ResourceSlices"
            );
            let generation = plan.generation;
            match self.apply(plan).await? {
                // Every write came back as written: the server now holds `desired`
                // (the cache has the returned objects), no second diff needed.
                Applied::Done { altered: false, .. } => {
                    if has_counters && withdrawn == 0 {
                        self.set_counters(CounterSupport::Kept);
                    }
                    self.last_generation = generation;
                    return Ok((generation, desired.len(), withdrawn));
                }
                // The counters were dropped on write (the dry run did not tell): what was
                // just written is unsafe. Withhold what depends on counters and write again.
                Applied::Done {
                    counters_lost: true,
                    ..
                } if withdrawn == 0 => {
                    self.set_counters(CounterSupport::Dropped);
                    let (safe, n) = without_counters(pool);
                    desired = plan_slices(&safe, layout)?;
                    withdrawn = n;
                }
                // Accepted, yet stored differently (a field dropped): a re-diff would only
                // write again.
                Applied::Done { altered: true, .. } => return Err(Error::ServerAlteredSlices),
                Applied::Replan(name) => {
                    replans += 1;
                    if replans > self.config.backoff.conflict_retries {
                        return Err(Error::Conflicts {
                            name,
                            attempts: replans - 1,
                        });
                    }
                }
            }
        }
    }

    fn count_write(&self) {
        self.status.send_modify(|s| s.writes += 1);
    }

    /// Re-reads one object after a conflict.
    async fn refresh(&mut self, name: &str) -> Result<(), Error> {
        let r = self.api.get_opt(name).await;
        self.config.observe_result("get", &r);
        match r.map_err(|source| Error::GetSlice {
            name: name.to_owned(),
            source,
        })? {
            Some(o) => {
                self.cache.insert(name.to_owned(), o);
            }
            None => {
                self.cache.remove(name);
            }
        }
        Ok(())
    }

    async fn apply(&mut self, plan: SyncPlan) -> Result<Applied, Error> {
        let mut altered = false;
        let mut counters_lost = false;
        for s in plan.deletes {
            let name = s.metadata.name.clone().unwrap_or_default();
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: s.metadata.uid.clone(),
                    resource_version: s.metadata.resource_version.clone(),
                }),
                ..DeleteParams::default()
            };
            let r = self.api.delete(&name, &dp).await;
            self.config.observe_result("delete", &r);
            self.count_write();
            match r {
                Ok(_) => {
                    self.cache.remove(&name);
                    self.deleted.insert(name);
                }
                Err(e) if status_code(&e) == Some(404) => {
                    self.cache.remove(&name);
                }
                Err(e) if status_code(&e) == Some(409) => {
                    self.refresh(&name).await?;
                    return Ok(Applied::Replan(name));
                }
                Err(source) => return Err(Error::DeleteSlice { name, source }),
            }
        }
        for s in plan.updates {
            let name = s.metadata.name.clone().unwrap_or_default();
            let r = self.api.replace(&name, &PostParams::default(), &s).await;
            self.config.observe_result("update", &r);
            self.count_write();
            match r {
                Ok(o) => {
                    altered |= stored_differs(&o, &s);
                    counters_lost |= lost_counters(&o, &s);
                    self.cache.insert(name, o);
                }
                Err(e) if matches!(status_code(&e), Some(404 | 409)) => {
                    self.refresh(&name).await?;
                    return Ok(Applied::Replan(name));
                }
                Err(source) => return Err(Error::UpdateSlice { name, source }),
            }
        }
        if !plan.creates.is_empty() {
            let owner = OwnerReference {
                api_version: "v1".to_owned(),
                kind: "Node".to_owned(),
                name: self.config.node_name.clone(),
                uid: self.node_uid().await?,
                controller: Some(true),
                ..OwnerReference::default()
            };
            for spec in plan.creates {
                let obj = ResourceSlice {
                    metadata: ObjectMeta {
                        generate_name: Some(generate_name(
                            &self.config.node_name,
                            &self.config.driver_name,
                        )),
                        owner_references: Some(vec![owner.clone()]),
                        ..ObjectMeta::default()
                    },
                    spec,
                };
                let r = self.api.create(&PostParams::default(), &obj).await;
                self.config.observe_result("create", &r);
                self.count_write();
                match r {
                    Ok(o) => {
                        altered |= stored_differs(&o, &obj);
                        counters_lost |= lost_counters(&o, &obj);
                        if let Some(name) = o.metadata.name.clone() {
                            self.cache.insert(name, o);
                        }
                    }
                    Err(source) => {
                        return Err(Error::CreateSlice {
                            pool: self.config.node_name.clone(),
                            source,
                        });
                    }
                }
            }
        }
        Ok(Applied::Done {
            altered,
            counters_lost,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::on_demand_mig_pool;

    fn slice(name: &str, rv: &str) -> ResourceSlice {
        ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                resource_version: Some(rv.into()),
                ..ObjectMeta::default()
            },
            spec: Default::default(),
        }
    }

    #[test]
    fn watch_timeouts_are_spread_over_nodes_and_stable_per_node() {
        let all: Vec<u32> = (0..1000)
            .map(|i| watch_timeout_secs(&format!("gpu-node-{i:04}")))
            .collect();
        assert!(all.iter().all(|t| (960..1200).contains(t)), "{all:?}");
        let distinct: std::collections::BTreeSet<u32> = all.iter().copied().collect();
        assert!(
            distinct.len() > 220,
            "the window is used: {}",
            distinct.len()
        );
        // No second takes much more than its share (1000 / 240 ≈ 4).
        for t in &distinct {
            let n = all.iter().filter(|x| *x == t).count();
            assert!(n < 15, "{n} of 1000 nodes renew at {t} s");
        }
        // The busiest node, with both watches, costs no more at rest than an informer's
        // mean (one watch renewed every 450 s).
        let worst = all.iter().map(|t| 2.0 / f64::from(*t)).fold(0.0, f64::max);
        assert!(worst <= 1.0 / 450.0, "{worst} renewals/s");
        assert_eq!(watch_timeout_secs("node-a"), watch_timeout_secs("node-a"));
    }

    #[test]
    fn slice_name_prefixes_fit_for_any_node_name() {
        assert_eq!(
            generate_name("node-a", "gpu.cleave.dev"),
            "node-a-gpu.cleave.dev-"
        );
        let label = "a".repeat(63);
        let longest = format!("{label}.{label}.{label}.{}", "b".repeat(61));
        assert_eq!(longest.len(), 253);
        let prefix = generate_name(&longest, "gpu.cleave.dev");
        assert!(prefix.len() <= 58, "{prefix}");
        assert!(prefix.starts_with(&longest[..40]) && prefix.ends_with("-gpu.cleave.dev-"));
        // A cut that would end in '.' drops it: the prefix stays a DNS subdomain start.
        let dotted = format!("{}.{}", "a".repeat(41), "b".repeat(30));
        let p = generate_name(&dotted, "gpu.cleave.dev");
        assert!(!p.contains(".-"), "{p}");
    }

    #[test]
    fn resource_versions_compare_numerically_when_they_can() {
        assert!(not_newer(&slice("a", "9"), &slice("a", "10")));
        assert!(not_newer(&slice("a", "10"), &slice("a", "10")));
        assert!(!not_newer(&slice("a", "11"), &slice("a", "10")));
        assert!(!not_newer(&slice("a", "x"), &slice("a", "y")));
    }

    #[test]
    fn yaml_has_one_document_per_slice() {
        let y = slices_yaml(
            &on_demand_mig_pool(2),
            SliceLayout::SeparateCounterSlices,
            "gpu.cleave.dev",
            "n1",
        )
        .unwrap();
        assert_eq!(y.matches("---\n").count(), 3);
        assert_eq!(y.matches("kind: ResourceSlice").count(), 3);
        assert!(y.contains("generateName: n1-gpu.cleave.dev-"));
        assert!(y.contains("resourceSliceCount: 3"));
        let docs: Vec<ResourceSlice> = y
            .split("---\n")
            .filter(|d| !d.trim().is_empty())
            .map(|d| serde_yaml::from_str(d).unwrap())
            .collect();
        assert_eq!(docs[1].spec.devices.as_ref().unwrap().len(), 26);
    }
}
