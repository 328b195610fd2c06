//! Device health: the state of every published device, fed by the driver's
//! [`HealthWatcher`] over the backend's event source (the driver's own NVML handle),
//! streamed to the kubelet by the kubelet health service and applied to the published pool
//! (a `NoSchedule` taint, or removal).
//!
//! Which devices an event concerns, and the conditions themselves, are the driver's pure
//! [`cleave_driver::device_health`]; this module holds them behind a lock, runs the watcher
//! task, tells subscribers, reports to a [`DeviceHealthObserver`] and checks device taints.
//!
//! Recovery: a lost GPU is healthy again as soon as it answers. Xid and ECC conditions
//! stay until the plugin restarts, or for `--xid-unhealthy-duration` when set (the usual
//! remedy, a GPU reset, needs the operator anyway; restarting the plugin pod after it
//! clears every Xid mark).

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cleave_api::pool::PoolDevices;
use cleave_driver::device_health::DeviceConditions;
use cleave_driver::device_health::{Condition, DeviceStatus};
use cleave_driver::health::{HealthEvent, HealthEventKind, HealthWatcher, WatchOptions};
use cleave_driver::model::NodeInventory;
use tokio::sync::{mpsc, watch};
use tonic::Status;
use tracing::{info, warn};

pub(crate) use crate::args::{HealthArgs, TaintMode};

/// Where health reports what it sees (the metrics registry implements it).
pub(crate) trait DeviceHealthObserver: Send + Sync + std::fmt::Debug {
    /// One event from the NVML watcher, before it is applied.
    fn health_event(&self, event: &HealthEvent);
    /// How many published devices are unhealthy now.
    fn unhealthy_devices(&self, count: usize);
}

/// How often the complete device list is re-sent on the health stream.
pub(crate) const DEFAULT_RESEND_INTERVAL: Duration = Duration::from_secs(10);

/// Health state for `run`: all devices of `pool` healthy, the watcher over the event
/// source of `backend` (the same NVML handle the driver uses) feeding it. `None` with
/// `--disable-health-checks`. A watcher that cannot start (a backend without event source)
/// is logged; the stream then reports every device healthy.
pub(crate) fn start_for_plugin(
    args: &HealthArgs,
    backend: &dyn cleave_driver::backend::GpuBackend,
    pool_name: &str,
    pool: &PoolDevices,
    inventory: &NodeInventory,
    driver: &Arc<cleave_driver::prepare::NodeDriver>,
    observer: Option<Arc<dyn DeviceHealthObserver>>,
) -> Option<Arc<DeviceHealth>> {
    if args.disable_health_checks {
        info!("device health checks disabled");
        return None;
    }
    let health = Arc::new(DeviceHealth::new(pool_name, pool.clone(), args).with_observer(observer));
    if let Some(o) = &health.observer {
        o.unhealthy_devices(0);
    }
    let driver = Arc::clone(driver);
    match backend.event_source() {
        Some(source) => {
            if let Err(e) = health.start_watching(
                source,
                inventory,
                args,
                Arc::new(move || driver.inventory()),
            ) {
                warn!(error = %e, "device health checks not running; all devices reported healthy");
            }
        }
        None => warn!(
            "device health checks not running: the GPU backend has no NVML event source; all devices reported healthy"
        ),
    }
    Some(health)
}

#[derive(Debug, Default)]
struct Inner {
    /// The pool before health is applied (see [`DeviceHealth::set_base_pool`]).
    base_pool: PoolDevices,
    /// The published devices and their conditions.
    state: DeviceConditions,
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
    observer: Option<Arc<dyn DeviceHealthObserver>>,
    watcher: Mutex<Option<HealthWatcher>>,
}

impl DeviceHealth {
    /// Health state for `pool` (named `pool_name`) with every device healthy.
    pub fn new(pool_name: impl Into<String>, pool: PoolDevices, args: &HealthArgs) -> Self {
        Self {
            pool_name: pool_name.into(),
            taints: args.device_taints,
            use_taints: std::sync::atomic::AtomicBool::new(args.device_taints != TaintMode::Off),
            taints_verified: std::sync::atomic::AtomicBool::new(false),
            xid_duration: (args.xid_unhealthy_duration > 0)
                .then(|| Duration::from_secs(args.xid_unhealthy_duration)),
            inner: Mutex::new(Inner {
                state: DeviceConditions::new(&pool),
                base_pool: pool,
            }),
            changed: watch::channel(0).0,
            shutdown: watch::channel(false).0,
            resend: DEFAULT_RESEND_INTERVAL,
            observer: None,
            watcher: Mutex::new(None),
        }
    }

    /// Reports health events and the number of unhealthy devices to `observer`.
    pub(crate) fn with_observer(mut self, observer: Option<Arc<dyn DeviceHealthObserver>>) -> Self {
        self.observer = observer;
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
    pub(crate) fn pool_name(&self) -> &str {
        &self.pool_name
    }

    /// Follows changes (the value counts them).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Replaces the pool health is applied to (its counters changed, e.g. a GPU instance
    /// without compute instance appeared or went) and tells subscribers, which publish
    /// [`Self::pool_to_publish`] again.
    pub(crate) fn set_base_pool(&self, pool: PoolDevices) {
        {
            let mut inner = self.lock();
            inner.state.set_pool(&pool);
            inner.base_pool = pool;
        }
        self.changed.send_modify(|v| *v += 1);
    }

    fn bump(&self) {
        let n = {
            let inner = self.lock();
            inner.state.unhealthy()
        };
        if let Some(o) = &self.observer {
            o.unhealthy_devices(n);
        }
        self.changed.send_modify(|v| *v += 1);
    }

    /// Applies one event; `inventory` maps the GPU UUID and instance ids to device names.
    /// Returns the devices whose state changed.
    pub fn apply(&self, event: &HealthEvent, inventory: &NodeInventory) -> Vec<String> {
        if let Some(o) = &self.observer {
            o.health_event(event);
        }
        if event.kind == HealthEventKind::Xid && !event.fatal {
            info!(event = %event.describe(), "application Xid; device stays healthy");
            return Vec::new();
        }
        let changed = self
            .lock()
            .state
            .apply(event, inventory, self.xid_duration, Instant::now());
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
        let expired = self.lock().state.expire(now);
        if expired.is_empty() {
            return false;
        }
        info!(devices = ?expired, "health marks expired; devices healthy again");
        self.bump();
        true
    }

    /// The condition of `device`, if it is unhealthy.
    pub fn condition(&self, device: &str) -> Option<Condition> {
        self.lock().state.condition(device).cloned()
    }

    /// Every device with its state, in pool order (the stream's complete list).
    pub(crate) fn statuses(&self) -> Vec<DeviceStatus> {
        self.lock().state.statuses()
    }

    /// The pool to publish: the base pool with unhealthy devices tainted (`on`) or
    /// removed (`off`).
    pub fn pool_to_publish(&self) -> PoolDevices {
        let inner = self.lock();
        let taints = self.use_taints.load(std::sync::atomic::Ordering::SeqCst);
        inner.state.apply_to_pool(inner.base_pool.clone(), taints)
    }

    /// True while `--device-taints=auto` has not yet seen whether the API server keeps
    /// device taints and some device is tainted: call [`Self::verify_taints`].
    pub fn needs_taint_check(&self) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        self.taints == TaintMode::Auto
            && self.use_taints.load(SeqCst)
            && !self.taints_verified.load(SeqCst)
            && self.lock().state.unhealthy() > 0
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
            .state
            .conditions()
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
    pub(crate) fn close(&self) {
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

    /// Starts the watcher over `source` (the backend's event source) for the GPUs of
    /// `inventory` and a task that applies its events (looking devices up in
    /// `current_inventory()`, so MIG devices created after start are found) and expires marks.
    pub(crate) fn start_watching(
        self: &Arc<Self>,
        source: Arc<dyn cleave_driver::backend::EventSource>,
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
        let watcher = HealthWatcher::start(source, uuids, options, move |e| {
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

    /// The health stream: `convert(pool name, every device's status)` now, after every
    /// change and every resend interval, until [`Self::close`] or the receiver goes.
    pub fn stream<R: Send + 'static>(
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;
    use cleave_driver::device_health::TAINT_XID;
    use cleave_driver::model::{GpuInfo, MigInstance, MigState};
    use cleave_driver::prepare::testing::{mig_instance as inst, xid_event as ev};

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

    /// The driver's test GPU with this test's UUIDs, MIG-enabled when given instances.
    fn gpu(minor: u32, instances: Vec<MigInstance>) -> GpuInfo {
        GpuInfo {
            uuid: format!("GPU-{minor}"),
            mig: if instances.is_empty() {
                MigState::NotCapable
            } else {
                MigState::Enabled {
                    profiles: Vec::new(),
                    instances,
                    memory_slices: 8,
                }
            },
            ..cleave_driver::prepare::testing::plain_gpu(minor)
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
        // Which devices each event concerns: cleave_driver::device_health's tests.
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
}
