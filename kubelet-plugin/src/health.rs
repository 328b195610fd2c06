//! Device health: the state of every published device, fed by the driver's NVML
//! [`HealthWatcher`], served to the kubelet as the `DRAResourceHealth` stream (v1alpha1
//! and v1) and applied to the published pool (a `NoSchedule` taint, or removal).
//!
//! Which devices an event concerns: a GPU-wide event (no GPU/compute instance id) makes
//! every published device of that GPU unhealthy (`gpu-<minor>` and all its MIG devices or
//! on-demand placements); an event attributed to a GPU/compute instance only the MIG device
//! with those ids (all devices of the GPU when the ids match no known instance).
//!
//! Recovery: a lost GPU is healthy again as soon as it answers. Xid and ECC conditions
//! stay until the plugin restarts, or for `--xid-unhealthy-duration` when set (the usual
//! remedy, a GPU reset, needs the operator anyway; restarting the plugin pod after it
//! clears every Xid mark).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cleave_api::names::DeviceName;
use cleave_api::pool::PoolDevices;
use cleave_driver::health::{HealthEvent, HealthEventKind, HealthWatcher, WatchOptions, XidPolicy};
use cleave_driver::model::{MigState, NodeInventory};
use k8s_openapi::api::resource::v1::DeviceTaint;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::proto::health::{v1 as hv1, v1alpha1 as hv1alpha1};

/// Advertised token of the v1alpha1 health service (kubelet 1.34+).
pub const HEALTH_V1ALPHA1: &str = "v1alpha1.DRAResourceHealth";
/// Advertised token of the v1 health service (kubelet 1.37+).
pub const HEALTH_V1: &str = "v1.DRAResourceHealth";
/// Taint key of devices with a fatal Xid; the value is the Xid number.
pub const TAINT_XID: &str = "gpu.cleave.dev/xid";
/// Taint key of devices unhealthy for another reason (lost GPU, double-bit ECC error).
pub const TAINT_UNHEALTHY: &str = "gpu.cleave.dev/unhealthy";
/// How often the complete device list is re-sent on the health stream.
pub const DEFAULT_RESEND_INTERVAL: Duration = Duration::from_secs(10);
/// `health_check_timeout_seconds` sent with every device (well above the resend interval).
pub const HEALTH_TIMEOUT_SECONDS: i64 = 30;
/// Longest `message` the kubelet keeps (FACTS §1.4).
const MAX_MESSAGE: usize = 1024;

/// How unhealthy devices appear in the published ResourceSlices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TaintMode {
    /// Publish them with a `NoSchedule` device taint (needs the `DRADeviceTaints`
    /// feature gate; the API server drops the field without it).
    On,
    /// Remove them from the published pool (works on every cluster).
    #[default]
    Off,
    /// Taint them, check that the stored ResourceSlice kept the taint, and remove
    /// unhealthy devices instead when the API server dropped it (feature gate off).
    Auto,
}

/// Health check flags of `run`.
#[derive(Debug, Clone, clap::Args)]
pub struct HealthArgs {
    /// Turn off NVML health checks (every device stays healthy).
    #[arg(long, env = "DISABLE_HEALTH_CHECKS")]
    pub disable_health_checks: bool,
    /// Xids to ignore besides the application Xids 13, 31, 43, 45, 68, 109 (comma list).
    #[arg(long, env = "ADDITIONAL_XIDS_TO_IGNORE", value_delimiter = ',')]
    pub additional_xids_to_ignore: Vec<u64>,
    /// Xids that mark a device unhealthy even though they are ignored by default
    /// (comma list; wins over the ignore lists).
    #[arg(long, env = "XIDS_TO_CHECK", value_delimiter = ',')]
    pub xids_to_check: Vec<u64>,
    /// How unhealthy devices are published: `on` = NoSchedule taint, `off` = removed,
    /// `auto` = taint, falling back to removal when the API server drops device taints.
    #[arg(long, env = "DEVICE_TAINTS", value_enum, default_value_t = TaintMode::Off)]
    pub device_taints: TaintMode,
    /// Seconds after which an Xid or ECC mark clears by itself; 0 = until restart.
    #[arg(long, env = "XID_UNHEALTHY_DURATION", default_value_t = 0)]
    pub xid_unhealthy_duration: u64,
    /// Seconds between checks for GPUs that disappeared.
    #[arg(long, env = "LOST_GPU_CHECK_INTERVAL", default_value_t = 5)]
    pub lost_gpu_check_interval: u64,
}

impl Default for HealthArgs {
    fn default() -> Self {
        Self {
            disable_health_checks: false,
            additional_xids_to_ignore: Vec::new(),
            xids_to_check: Vec::new(),
            device_taints: TaintMode::Off,
            xid_unhealthy_duration: 0,
            lost_gpu_check_interval: 5,
        }
    }
}

/// Health state for `run`: all devices of `pool` healthy, the NVML watcher on `nvml_lib`
/// (default library when `None`) feeding it. `None` with `--disable-health-checks`. A
/// watcher that cannot start is logged; the stream then reports every device healthy.
pub fn start_for_plugin(
    args: &HealthArgs,
    nvml_lib: Option<&std::path::Path>,
    pool_name: &str,
    pool: &PoolDevices,
    inventory: &NodeInventory,
    driver: &Arc<cleave_driver::prepare::NodeDriver>,
    metrics: Option<Arc<Metrics>>,
) -> Option<Arc<DeviceHealth>> {
    if args.disable_health_checks {
        info!("device health checks disabled");
        return None;
    }
    let health = Arc::new(DeviceHealth::new(pool_name, pool.clone(), args).with_metrics(metrics));
    if let Some(m) = &health.metrics {
        m.health.set_unhealthy(0);
    }
    let lib = nvml_lib.map_or_else(
        || PathBuf::from(cleave_driver::nvml::DEFAULT_LIBRARY),
        std::path::Path::to_path_buf,
    );
    let driver = Arc::clone(driver);
    if let Err(e) =
        health.start_watching(lib, inventory, args, Arc::new(move || driver.inventory()))
    {
        warn!(error = %e, "device health checks not running; all devices reported healthy");
    }
    Some(health)
}

impl HealthArgs {
    /// The Xid policy the flags describe.
    pub fn policy(&self) -> XidPolicy {
        XidPolicy::new(&self.additional_xids_to_ignore, &self.xids_to_check)
    }
}

/// Why a device is unhealthy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    /// What happened (kind and, for Xids, the number).
    pub kind: HealthEventKind,
    /// The Xid number for Xid conditions.
    pub xid: Option<u64>,
    /// UUID of the GPU the condition came from.
    pub gpu_uuid: String,
    /// Human-readable reason.
    pub message: String,
    /// When the mark clears by itself (Xid/ECC with a duration), if ever.
    pub expires: Option<Instant>,
}

impl Condition {
    /// The NoSchedule taint this condition publishes.
    pub fn taint(&self) -> DeviceTaint {
        let (key, value) = match (self.kind, self.xid) {
            (HealthEventKind::Xid, Some(xid)) => (TAINT_XID, xid.to_string()),
            (kind, _) => (TAINT_UNHEALTHY, kind.as_str().to_owned()),
        };
        DeviceTaint {
            key: key.to_owned(),
            value: Some(value),
            effect: "NoSchedule".to_owned(),
            time_added: None,
        }
    }
}

/// One device as the health stream reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceStatus {
    /// Device name in the pool.
    pub device: String,
    /// False when a condition holds.
    pub healthy: bool,
    /// Reason (empty when healthy).
    pub message: String,
}

#[derive(Debug, Default)]
struct Inner {
    /// The pool before health is applied (see [`DeviceHealth::set_base_pool`]).
    base_pool: PoolDevices,
    /// Devices of the published pool, in pool order.
    devices: Vec<String>,
    /// Conditions by device name.
    conditions: BTreeMap<String, Condition>,
}

/// Health of the node's devices, shared by the event task, the gRPC health service, the
/// slice publishing and prepare.
#[derive(Debug)]
pub struct DeviceHealth {
    pool_name: String,
    taints: TaintMode,
    /// Taints in use now (`on`, or `auto` until the server showed it drops them).
    use_taints: std::sync::atomic::AtomicBool,
    /// `auto`: the server kept a taint once, no more checks needed.
    taints_verified: std::sync::atomic::AtomicBool,
    xid_duration: Option<Duration>,
    inner: Mutex<Inner>,
    changed: watch::Sender<u64>,
    shutdown: watch::Sender<bool>,
    resend: Duration,
    metrics: Option<Arc<Metrics>>,
    watcher: Mutex<Option<HealthWatcher>>,
}

impl DeviceHealth {
    /// Health state for `pool` (named `pool_name`) with every device healthy.
    pub fn new(pool_name: impl Into<String>, pool: PoolDevices, args: &HealthArgs) -> Self {
        let devices = pool.devices().map(|d| d.name.clone()).collect();
        Self {
            pool_name: pool_name.into(),
            taints: args.device_taints,
            use_taints: std::sync::atomic::AtomicBool::new(args.device_taints != TaintMode::Off),
            taints_verified: std::sync::atomic::AtomicBool::new(false),
            xid_duration: (args.xid_unhealthy_duration > 0)
                .then(|| Duration::from_secs(args.xid_unhealthy_duration)),
            inner: Mutex::new(Inner {
                base_pool: pool,
                devices,
                conditions: BTreeMap::new(),
            }),
            changed: watch::channel(0).0,
            shutdown: watch::channel(false).0,
            resend: DEFAULT_RESEND_INTERVAL,
            metrics: None,
            watcher: Mutex::new(None),
        }
    }

    /// Records health events and the unhealthy gauge in `metrics`.
    pub fn with_metrics(mut self, metrics: Option<Arc<Metrics>>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Re-sends the full device list on the stream this often (default 10 s).
    pub fn with_resend_interval(mut self, every: Duration) -> Self {
        self.resend = every;
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Pool name the stream reports.
    pub fn pool_name(&self) -> &str {
        &self.pool_name
    }

    /// Follows changes (the value counts them).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Replaces the pool health is applied to (its counters changed, e.g. a GPU instance
    /// without compute instance appeared or went) and tells subscribers, which publish
    /// [`Self::pool_to_publish`] again.
    pub fn set_base_pool(&self, pool: PoolDevices) {
        {
            let mut inner = self.lock();
            inner.devices = pool.devices().map(|d| d.name.clone()).collect();
            inner.base_pool = pool;
        }
        self.changed.send_modify(|v| *v += 1);
    }

    fn bump(&self) {
        let n = {
            let inner = self.lock();
            inner.conditions.len()
        };
        if let Some(m) = &self.metrics {
            m.health.set_unhealthy(n);
        }
        self.changed.send_modify(|v| *v += 1);
    }

    /// Applies one event; `inventory` maps the GPU UUID and instance ids to device names.
    /// Returns the devices whose state changed.
    pub fn apply(&self, event: &HealthEvent, inventory: &NodeInventory) -> Vec<String> {
        if let Some(m) = &self.metrics {
            m.health.record_event(event);
        }
        if event.kind == HealthEventKind::Xid && !event.fatal {
            info!(event = %event.describe(), "application Xid; device stays healthy");
            return Vec::new();
        }
        let targets = affected_devices(event, inventory, &self.lock().devices);
        let mut changed = Vec::new();
        {
            let mut inner = self.lock();
            for device in &targets {
                if event.kind == HealthEventKind::Recovered {
                    let was_lost = inner
                        .conditions
                        .get(device)
                        .is_some_and(|c| c.kind == HealthEventKind::Lost);
                    if was_lost {
                        inner.conditions.remove(device);
                        changed.push(device.clone());
                    }
                    continue;
                }
                let condition = Condition {
                    kind: event.kind,
                    xid: event.xid,
                    gpu_uuid: event.gpu_uuid.clone(),
                    message: truncate(event.describe()),
                    expires: match event.kind {
                        HealthEventKind::Lost => None,
                        _ => self.xid_duration.map(|d| Instant::now() + d),
                    },
                };
                if inner.conditions.get(device) != Some(&condition) {
                    inner.conditions.insert(device.clone(), condition);
                    changed.push(device.clone());
                }
            }
        }
        if changed.is_empty() {
            return changed;
        }
        if event.fatal {
            warn!(event = %event.describe(), devices = ?changed, "devices unhealthy");
        } else {
            info!(event = %event.describe(), devices = ?changed, "devices healthy again");
        }
        self.bump();
        changed
    }

    /// Drops conditions whose duration ran out; true if any did.
    pub fn expire(&self, now: Instant) -> bool {
        let expired: Vec<String> = {
            let mut inner = self.lock();
            let gone: Vec<String> = inner
                .conditions
                .iter()
                .filter(|(_, c)| c.expires.is_some_and(|e| e <= now))
                .map(|(d, _)| d.clone())
                .collect();
            for d in &gone {
                inner.conditions.remove(d);
            }
            gone
        };
        if expired.is_empty() {
            return false;
        }
        info!(devices = ?expired, "health marks expired; devices healthy again");
        self.bump();
        true
    }

    /// The condition of `device`, if it is unhealthy.
    pub fn condition(&self, device: &str) -> Option<Condition> {
        self.lock().conditions.get(device).cloned()
    }

    /// Every device with its state, in pool order (the stream's complete list).
    pub fn statuses(&self) -> Vec<DeviceStatus> {
        let inner = self.lock();
        inner
            .devices
            .iter()
            .map(|d| match inner.conditions.get(d) {
                Some(c) => DeviceStatus {
                    device: d.clone(),
                    healthy: false,
                    message: c.message.clone(),
                },
                None => DeviceStatus {
                    device: d.clone(),
                    healthy: true,
                    message: String::new(),
                },
            })
            .collect()
    }

    /// The pool to publish: the base pool with unhealthy devices tainted (`on`) or
    /// removed (`off`).
    pub fn pool_to_publish(&self) -> PoolDevices {
        let inner = self.lock();
        let mut pool = inner.base_pool.clone();
        let taints = self.use_taints.load(std::sync::atomic::Ordering::SeqCst);
        for group in &mut pool.groups {
            match if taints {
                TaintMode::On
            } else {
                TaintMode::Off
            } {
                TaintMode::Off | TaintMode::Auto => group
                    .devices
                    .retain(|d| !inner.conditions.contains_key(&d.name)),
                TaintMode::On => {
                    for d in &mut group.devices {
                        if let Some(c) = inner.conditions.get(&d.name) {
                            let taint = c.taint();
                            let taints = d.taints.get_or_insert_with(Vec::new);
                            if !taints.iter().any(|t| t.key == taint.key) {
                                taints.push(taint);
                            }
                        }
                    }
                }
            }
        }
        pool
    }

    /// True while `--device-taints=auto` has not yet seen whether the API server keeps
    /// device taints and some device is tainted: call [`Self::verify_taints`].
    pub fn needs_taint_check(&self) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        self.taints == TaintMode::Auto
            && self.use_taints.load(SeqCst)
            && !self.taints_verified.load(SeqCst)
            && !self.lock().conditions.is_empty()
    }

    /// `--device-taints=auto`: waits until the publisher stored version `version`, reads
    /// this node's ResourceSlices back and, if a tainted device came back without its
    /// taint (the `DRADeviceTaints` gate is off), switches to removing unhealthy devices
    /// (a change: the daemon republishes). Returns true when taints were kept.
    pub async fn verify_taints(
        self: Arc<Self>,
        client: kube::Client,
        driver_name: String,
        version: u64,
        mut status: watch::Receiver<cleave_controller::PublisherStatus>,
    ) -> Option<bool> {
        use k8s_openapi::api::resource::v1::ResourceSlice;
        use std::sync::atomic::Ordering::SeqCst;
        let stored = matches!(
            tokio::time::timeout(
                Duration::from_secs(60),
                status.wait_for(|s| s.published_version >= version),
            )
            .await,
            Ok(Ok(_))
        );
        if !stored {
            warn!("device taints: publication not confirmed; checking later");
            return None;
        }
        let tainted: Vec<(String, String)> = self
            .lock()
            .conditions
            .iter()
            .map(|(d, c)| (d.clone(), c.taint().key))
            .collect();
        let api: kube::Api<ResourceSlice> = kube::Api::all(client);
        let params = kube::api::ListParams::default().fields(&format!(
            "spec.nodeName={},spec.driver={driver_name}",
            self.pool_name
        ));
        let slices = match api.list(&params).await {
            Ok(l) => l.items,
            Err(e) => {
                warn!(error = %e, "device taints: cannot read ResourceSlices back");
                return None;
            }
        };
        let devices: BTreeMap<&str, &k8s_openapi::api::resource::v1::Device> = slices
            .iter()
            .filter_map(|s| s.spec.devices.as_ref())
            .flatten()
            .map(|d| (d.name.as_str(), d))
            .collect();
        let mut checked = false;
        for (name, key) in &tainted {
            let Some(d) = devices.get(name.as_str()) else {
                continue;
            };
            checked = true;
            let kept = d
                .taints
                .as_ref()
                .is_some_and(|t| t.iter().any(|t| &t.key == key));
            if !kept {
                warn!(device = %name, "the API server dropped the device taint (DRADeviceTaints feature gate off?); removing unhealthy devices from the pool instead");
                self.use_taints.store(false, SeqCst);
                self.taints_verified.store(true, SeqCst);
                self.changed.send_modify(|v| *v += 1);
                return Some(false);
            }
        }
        if checked {
            info!("the API server keeps device taints");
            self.taints_verified.store(true, SeqCst);
            return Some(true);
        }
        None
    }

    /// Ends every health stream and stops the NVML watcher.
    pub fn close(&self) {
        self.shutdown.send_replace(true);
        let watcher = self
            .watcher
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(w) = watcher {
            w.stop();
        }
    }

    /// Starts the NVML watcher on `lib_path` for the GPUs of `inventory` and a task that
    /// applies its events (looking devices up in `current_inventory()`, so MIG devices
    /// created after start are found) and expires marks.
    pub fn start_watching(
        self: &Arc<Self>,
        lib_path: PathBuf,
        inventory: &NodeInventory,
        args: &HealthArgs,
        current_inventory: Arc<dyn Fn() -> NodeInventory + Send + Sync>,
    ) -> Result<(), cleave_driver::health::HealthError> {
        let (tx, mut rx) = mpsc::unbounded_channel::<HealthEvent>();
        let options = WatchOptions {
            policy: args.policy(),
            lost_check_interval: Duration::from_secs(args.lost_gpu_check_interval.max(1)),
            ..WatchOptions::default()
        };
        let uuids = inventory.gpus.iter().map(|g| g.uuid.clone()).collect();
        let watcher = HealthWatcher::spawn(&lib_path, uuids, options, move |e| {
            let _ = tx.send(e);
        })?;
        *self
            .watcher
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(watcher);
        let this = Arc::clone(self);
        let mut shutdown = self.shutdown.subscribe();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    ev = rx.recv() => match ev {
                        Some(ev) => {
                            let inv = current_inventory();
                            this.apply(&ev, &inv);
                        }
                        None => break,
                    },
                    _ = tick.tick() => { this.expire(Instant::now()); }
                    _ = shutdown.changed() => break,
                }
            }
        });
        Ok(())
    }

    fn stream<R: Send + 'static>(
        self: &Arc<Self>,
        convert: fn(&str, &[DeviceStatus]) -> R,
    ) -> Pin<Box<dyn futures::Stream<Item = Result<R, Status>> + Send>> {
        let (tx, rx) = mpsc::channel::<Result<R, Status>>(4);
        let this = Arc::clone(self);
        let mut changed = self.changed.subscribe();
        let mut shutdown = self.shutdown.subscribe();
        tokio::spawn(async move {
            loop {
                if *shutdown.borrow_and_update() {
                    break;
                }
                changed.borrow_and_update();
                let msg = convert(&this.pool_name, &this.statuses());
                if tx.send(Ok(msg)).await.is_err() {
                    break;
                }
                tokio::select! {
                    r = changed.changed() => if r.is_err() { break },
                    () = tokio::time::sleep(this.resend) => {}
                    _ = shutdown.changed() => break,
                    () = tx.closed() => break,
                }
            }
        });
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
    }
}

/// Health metrics, registered into the plugin's registry by [`Metrics::new`].
#[derive(Debug, Clone, Default)]
pub struct HealthMetrics {
    events: Family<HealthEventLabels, Counter>,
    unhealthy: Gauge,
}

/// Labels of `health_events_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HealthEventLabels {
    /// `xid`, `ecc-dbe`, `gpu-lost` or `recovered`.
    pub kind: &'static str,
    /// The Xid number; empty for other kinds.
    pub xid: String,
    /// `true` if the event marks devices unhealthy.
    pub fatal: &'static str,
}

impl HealthMetrics {
    /// Registers `health_events` (counter by kind, Xid and fatality) and
    /// `devices_unhealthy` (gauge) in `registry`.
    pub fn register(registry: &mut prometheus_client::registry::Registry) -> Self {
        let m = Self::default();
        registry.register(
            "health_events",
            "Device health events from NVML (Xid, double-bit ECC, lost and recovered GPUs)",
            m.events.clone(),
        );
        registry.register(
            "devices_unhealthy",
            "Published devices currently marked unhealthy",
            m.unhealthy.clone(),
        );
        m
    }

    /// Counts one event.
    pub fn record_event(&self, event: &HealthEvent) {
        self.events
            .get_or_create(&HealthEventLabels {
                kind: event.kind.as_str(),
                xid: event.xid.map(|x| x.to_string()).unwrap_or_default(),
                fatal: if event.fatal { "true" } else { "false" },
            })
            .inc();
    }

    /// Sets the unhealthy-devices gauge.
    pub fn set_unhealthy(&self, n: usize) {
        self.unhealthy.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

fn truncate(mut s: String) -> String {
    if s.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE - 3;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

/// The published devices an event concerns (see the module doc).
pub fn affected_devices(
    event: &HealthEvent,
    inventory: &NodeInventory,
    published: &[String],
) -> Vec<String> {
    let Some(gpu) = inventory.gpus.iter().find(|g| g.uuid == event.gpu_uuid) else {
        warn!(gpu = %event.gpu_uuid, "health event for an unknown GPU");
        return Vec::new();
    };
    let of_gpu: Vec<String> = published
        .iter()
        .filter(|n| {
            n.parse::<DeviceName>()
                .is_ok_and(|d| d.minor() == gpu.minor)
        })
        .cloned()
        .collect();
    let Some(gi) = event.gi else {
        return of_gpu;
    };
    if let MigState::Enabled { instances, .. } = &gpu.mig {
        let names: Vec<String> = instances
            .iter()
            .filter(|i| i.gi_id == gi && event.ci.is_none_or(|ci| i.ci_id == ci))
            .map(|i| DeviceName::mig(gpu.minor, &i.profile_name, i.placement.start).to_string())
            .filter(|n| published.contains(n))
            .collect();
        if !names.is_empty() {
            return names;
        }
    }
    warn!(gpu = %event.gpu_uuid, gi, ci = ?event.ci, "no published MIG device has these ids; marking the whole GPU");
    of_gpu
}

fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

macro_rules! health_version {
    ($m:ident, $svc:ident) => {
        fn $svc(pool: &str, statuses: &[DeviceStatus]) -> $m::NodeWatchResourcesResponse {
            let now = now_unix();
            $m::NodeWatchResourcesResponse {
                devices: statuses
                    .iter()
                    .map(|s| $m::DeviceHealth {
                        device: Some($m::DeviceIdentifier {
                            pool_name: pool.to_owned(),
                            device_name: s.device.clone(),
                        }),
                        health: if s.healthy {
                            $m::HealthStatus::Healthy as i32
                        } else {
                            $m::HealthStatus::Unhealthy as i32
                        },
                        last_updated_time: now,
                        health_check_timeout_seconds: HEALTH_TIMEOUT_SECONDS,
                        message: s.message.clone(),
                    })
                    .collect(),
            }
        }

        #[tonic::async_trait]
        impl $m::dra_resource_health_server::DraResourceHealth for HealthService {
            type NodeWatchResourcesStream = Pin<
                Box<
                    dyn futures::Stream<Item = Result<$m::NodeWatchResourcesResponse, Status>>
                        + Send,
                >,
            >;

            async fn node_watch_resources(
                &self,
                _request: Request<$m::NodeWatchResourcesRequest>,
            ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
                Ok(Response::new(self.0.stream($svc)))
            }
        }
    };
}

/// The `DRAResourceHealth` gRPC service (both versions) over a [`DeviceHealth`].
#[derive(Debug, Clone)]
pub struct HealthService(pub Arc<DeviceHealth>);

health_version!(hv1alpha1, to_v1alpha1);
health_version!(hv1, to_v1);

impl HealthService {
    /// The v1alpha1 tonic service.
    pub fn v1alpha1_svc(
        &self,
    ) -> hv1alpha1::dra_resource_health_server::DraResourceHealthServer<Self> {
        hv1alpha1::dra_resource_health_server::DraResourceHealthServer::new(self.clone())
    }

    /// The v1 tonic service.
    pub fn v1_svc(&self) -> hv1::dra_resource_health_server::DraResourceHealthServer<Self> {
        hv1::dra_resource_health_server::DraResourceHealthServer::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;
    use cleave_driver::model::{GpuInfo, MigInstance, Placement};

    #[derive(clap::Parser)]
    struct T {
        #[command(flatten)]
        h: HealthArgs,
    }

    fn args(extra: &[&str]) -> HealthArgs {
        let mut v = vec!["x"];
        v.extend_from_slice(extra);
        T::try_parse_from(v).unwrap().h
    }

    fn gpu(minor: u32, instances: Vec<MigInstance>) -> GpuInfo {
        GpuInfo {
            index: minor,
            minor,
            uuid: format!("GPU-{minor}"),
            product_name: "p".into(),
            brand: "b".into(),
            architecture: "a".into(),
            cuda_compute_capability: (9, 0),
            memory_bytes: 1,
            multiprocessors: None,
            pci_bus_id: String::new(),
            pcie_root: None,
            mig: if instances.is_empty() {
                MigState::NotCapable
            } else {
                MigState::Enabled {
                    profiles: Vec::new(),
                    instances,
                    memory_slices: 8,
                }
            },
        }
    }

    fn inst(gi: u32, ci: u32, profile: &str, start: u32) -> MigInstance {
        MigInstance {
            uuid: format!("MIG-{gi}-{ci}"),
            profile_id: 19,
            profile_name: profile.into(),
            gi_id: gi,
            ci_id: ci,
            placement: Placement { start, size: 1 },
        }
    }

    fn ev(uuid: &str, gi: Option<u32>, ci: Option<u32>, xid: u64, fatal: bool) -> HealthEvent {
        HealthEvent {
            gpu_uuid: uuid.into(),
            gi,
            ci,
            kind: HealthEventKind::Xid,
            xid: Some(xid),
            fatal,
        }
    }

    fn pool(names: &[&str]) -> PoolDevices {
        PoolDevices {
            groups: vec![cleave_api::pool::DeviceGroup {
                counter_sets: Vec::new(),
                devices: names
                    .iter()
                    .map(|n| k8s_openapi::api::resource::v1::Device {
                        name: (*n).into(),
                        ..Default::default()
                    })
                    .collect(),
            }],
        }
    }

    #[test]
    fn flags_parse() {
        let a = args(&[
            "--additional-xids-to-ignore",
            "79,48",
            "--xids-to-check",
            "31",
            "--device-taints",
            "on",
        ]);
        assert_eq!(a.device_taints, TaintMode::On);
        let p = a.policy();
        assert!(!p.is_fatal(79) && p.is_fatal(31) && !p.is_fatal(13));
        assert_eq!(args(&[]).device_taints, TaintMode::Off);
    }

    #[test]
    fn gpu_wide_and_instance_events_map_to_devices() {
        let inv = NodeInventory {
            driver_version: String::new(),
            driver_semver: String::new(),
            cuda_driver_semver: String::new(),
            gpus: vec![
                gpu(0, vec![inst(7, 0, "1g.10gb", 0), inst(8, 0, "1g.10gb", 1)]),
                gpu(1, Vec::new()),
            ],
        };
        let names = [
            "gpu-0",
            "gpu-0-mig-1g10gb-0",
            "gpu-0-mig-1g10gb-1",
            "gpu-0-mig-2g20gb-2",
            "gpu-1",
        ];
        let published: Vec<String> = names.iter().map(|s| (*s).to_owned()).collect();
        assert_eq!(
            affected_devices(&ev("GPU-0", None, None, 79, true), &inv, &published),
            &names[..4]
        );
        assert_eq!(
            affected_devices(&ev("GPU-0", Some(8), Some(0), 79, true), &inv, &published),
            ["gpu-0-mig-1g10gb-1"]
        );
        // Unknown ids: the whole GPU.
        assert_eq!(
            affected_devices(&ev("GPU-0", Some(3), Some(0), 79, true), &inv, &published).len(),
            4
        );
        assert!(affected_devices(&ev("GPU-9", None, None, 79, true), &inv, &published).is_empty());

        for (mode, expect_tainted) in [("on", true), ("off", false)] {
            let h = DeviceHealth::new("n1", pool(&names), &args(&["--device-taints", mode]));
            assert!(
                h.apply(&ev("GPU-1", None, None, 31, false), &inv)
                    .is_empty()
            );
            assert_eq!(h.apply(&ev("GPU-1", None, None, 79, true), &inv), ["gpu-1"]);
            // The same condition again changes nothing.
            assert!(h.apply(&ev("GPU-1", None, None, 79, true), &inv).is_empty());
            let st = h.statuses();
            assert_eq!(st.len(), 5);
            assert!(!st[4].healthy && st[4].message.contains("Xid 79"));
            let p = h.pool_to_publish();
            let d: Vec<_> = p.devices().collect();
            if expect_tainted {
                assert_eq!(d.len(), 5);
                let t = d[4].taints.as_ref().unwrap();
                assert_eq!(
                    (
                        t[0].key.as_str(),
                        t[0].value.as_deref(),
                        t[0].effect.as_str()
                    ),
                    (TAINT_XID, Some("79"), "NoSchedule")
                );
            } else {
                assert_eq!(d.len(), 4);
                assert!(d.iter().all(|d| d.name != "gpu-1"));
            }
        }
    }

    #[test]
    fn lost_gpu_recovers_and_xid_marks_expire() {
        let inv = NodeInventory {
            driver_version: String::new(),
            driver_semver: String::new(),
            cuda_driver_semver: String::new(),
            gpus: vec![gpu(0, Vec::new()), gpu(1, Vec::new())],
        };
        let h = DeviceHealth::new(
            "n1",
            pool(&["gpu-0", "gpu-1"]),
            &args(&["--xid-unhealthy-duration", "60"]),
        );
        let lost = HealthEvent {
            gpu_uuid: "GPU-0".into(),
            gi: None,
            ci: None,
            kind: HealthEventKind::Lost,
            xid: None,
            fatal: true,
        };
        assert_eq!(h.apply(&lost, &inv), ["gpu-0"]);
        assert_eq!(h.apply(&ev("GPU-1", None, None, 48, true), &inv), ["gpu-1"]);
        let back = HealthEvent {
            kind: HealthEventKind::Recovered,
            fatal: false,
            ..lost
        };
        assert_eq!(h.apply(&back, &inv), ["gpu-0"]);
        assert!(h.condition("gpu-0").is_none());
        // A lost GPU never expires; the Xid mark does after its duration.
        assert!(!h.expire(Instant::now()));
        assert!(h.expire(Instant::now() + Duration::from_secs(61)));
        assert!(h.statuses().iter().all(|s| s.healthy));
    }

    #[test]
    fn long_messages_are_truncated() {
        let s = truncate("é".repeat(2000));
        assert!(s.len() <= MAX_MESSAGE && s.ends_with("..."));
    }
}
