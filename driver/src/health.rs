//! Device health from NVML: an event loop for Xid errors and double-bit ECC errors, and a
//! periodic check for GPUs that disappeared (handle lookup by UUID fails, `GPU_IS_LOST`).
//!
//! [`HealthWatcher::spawn`] runs on its own thread with its own NVML handle and bounded
//! waits ([`WatchOptions::wait`]), so [`HealthWatcher::stop`] returns promptly. It reports
//! [`HealthEvent`]s through a callback; mapping GPUs and GPU/compute instance ids to
//! published device names is the caller's business.
//!
//! Application-caused Xids (the list the NVIDIA device plugin and DRA driver skip,
//! MIG-FACTS §8) are reported with `fatal: false` and must not mark a device unhealthy.

#![allow(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings::nvmlEventData_t;
use tracing::{debug, info, warn};

/// Xids caused by applications (graphics engine exception, page fault, GPU stopped
/// processing, preemptive cleanup, video processor exception, context switch timeout):
/// they do not make a device unhealthy (MIG-FACTS §8).
pub const DEFAULT_IGNORED_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// NVML's "no GPU/compute instance" id in event data.
pub const NO_INSTANCE: u32 = 0xFFFF_FFFF;

/// `NVML_ERROR_TIMEOUT`.
const ERROR_TIMEOUT: u32 = 10;
/// `NVML_ERROR_GPU_IS_LOST`.
const ERROR_GPU_IS_LOST: u32 = 15;

/// Which Xids count as device failures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidPolicy {
    ignored: BTreeSet<u64>,
}

impl Default for XidPolicy {
    fn default() -> Self {
        Self::new(&[], &[])
    }
}

impl XidPolicy {
    /// The default ignore list plus `additional_ignored`, minus `reenabled` (which wins).
    pub fn new(additional_ignored: &[u64], reenabled: &[u64]) -> Self {
        let mut ignored: BTreeSet<u64> = DEFAULT_IGNORED_XIDS.into_iter().collect();
        ignored.extend(additional_ignored.iter().copied());
        for x in reenabled {
            ignored.remove(x);
        }
        Self { ignored }
    }

    /// True if `xid` marks a device unhealthy.
    pub fn is_fatal(&self, xid: u64) -> bool {
        !self.ignored.contains(&xid)
    }

    /// The ignored Xids, sorted.
    pub fn ignored(&self) -> impl Iterator<Item = u64> + '_ {
        self.ignored.iter().copied()
    }
}

/// What happened to a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HealthEventKind {
    /// An Xid error (`xid` holds its number; 999 = unknown).
    Xid,
    /// A double-bit (uncorrectable) ECC error.
    DoubleBitEcc,
    /// The GPU can no longer be reached (lookup by UUID fails or `GPU_IS_LOST`).
    Lost,
    /// A lost GPU answers again.
    Recovered,
}

impl HealthEventKind {
    /// Short lower-case name (metric label, taint value).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Xid => "xid",
            Self::DoubleBitEcc => "ecc-dbe",
            Self::Lost => "gpu-lost",
            Self::Recovered => "recovered",
        }
    }
}

/// One health observation about a GPU (or one of its MIG devices).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthEvent {
    /// UUID of the (parent) GPU.
    pub gpu_uuid: String,
    /// GPU instance id when the error is attributed to one; `None` means GPU-wide.
    pub gi: Option<u32>,
    /// Compute instance id when the error is attributed to one.
    pub ci: Option<u32>,
    /// What happened.
    pub kind: HealthEventKind,
    /// The Xid number for [`HealthEventKind::Xid`].
    pub xid: Option<u64>,
    /// True if the device must be considered unhealthy (false for application Xids and
    /// for [`HealthEventKind::Recovered`]).
    pub fatal: bool,
}

impl HealthEvent {
    /// True if the event concerns the whole GPU (no GPU/compute instance attribution).
    pub fn is_gpu_wide(&self) -> bool {
        self.gi.is_none()
    }

    /// A one-line description for logs, Events and the health stream's message.
    pub fn describe(&self) -> String {
        let place = match (self.gi, self.ci) {
            (Some(gi), Some(ci)) => format!(" (GPU instance {gi}, compute instance {ci})"),
            (Some(gi), None) => format!(" (GPU instance {gi})"),
            _ => String::new(),
        };
        match self.kind {
            HealthEventKind::Xid => format!(
                "Xid {} on {}{place}",
                self.xid.map_or_else(|| "?".into(), |x| x.to_string()),
                self.gpu_uuid
            ),
            HealthEventKind::DoubleBitEcc => {
                format!("double-bit ECC error on {}{place}", self.gpu_uuid)
            }
            HealthEventKind::Lost => format!("GPU {} is lost", self.gpu_uuid),
            HealthEventKind::Recovered => format!("GPU {} is reachable again", self.gpu_uuid),
        }
    }
}

/// Why the watcher could not start.
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    /// NVML could not be loaded or initialised.
    #[error("loading NVML {path} for health checks: {source}")]
    Init {
        /// Library path.
        path: PathBuf,
        /// Underlying error.
        source: NvmlError,
    },
    /// The event set could not be created.
    #[error("creating an NVML event set: {0}")]
    CreateEventSet(NvmlError),
    /// The thread could not be spawned.
    #[error("spawning the health thread: {0}")]
    Spawn(std::io::Error),
}

/// Settings of [`HealthWatcher::spawn`].
#[derive(Debug, Clone)]
pub struct WatchOptions {
    /// Which Xids are fatal.
    pub policy: XidPolicy,
    /// Longest single event wait (bounds shutdown latency).
    pub wait: Duration,
    /// How often every GPU is looked up by UUID to notice lost GPUs.
    pub lost_check_interval: Duration,
}

impl Default for WatchOptions {
    fn default() -> Self {
        Self {
            policy: XidPolicy::default(),
            wait: Duration::from_secs(1),
            lost_check_interval: Duration::from_secs(5),
        }
    }
}

/// The running health thread. Dropping it stops the thread (without waiting).
#[derive(Debug)]
pub struct HealthWatcher {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HealthWatcher {
    /// Loads NVML from `lib_path`, registers Xid and double-bit ECC events on every GPU in
    /// `gpu_uuids` and reports events to `sink` from a new thread until stopped. GPUs whose
    /// registration fails are still checked for loss.
    pub fn spawn(
        lib_path: &Path,
        gpu_uuids: Vec<String>,
        options: WatchOptions,
        sink: impl Fn(HealthEvent) + Send + 'static,
    ) -> Result<Self, HealthError> {
        let nvml = Nvml::builder()
            .lib_path(OsStr::new(lib_path.as_os_str()))
            .init()
            .map_err(|source| HealthError::Init {
                path: lib_path.to_owned(),
                source,
            })?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("cleave-health".into())
            .spawn(move || {
                if let Err(e) = watch_loop(&nvml, &gpu_uuids, &options, &flag, &sink) {
                    warn!(error = %e, "device health checks stopped");
                }
            })
            .map_err(HealthError::Spawn)?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the thread and waits for it (at most one event wait).
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            warn!("health thread panicked");
        }
    }
}

impl Drop for HealthWatcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The outcome of one raw event wait.
enum Waited {
    Event(nvmlEventData_t),
    Timeout,
    GpuLost,
    Failed(u32),
}

/// `nvmlEventSetWait_v2` called directly: nvml-wrapper's `EventData` drops the GPU and
/// compute instance ids.
fn raw_wait(nvml: &Nvml, set: &nvml_wrapper::EventSet<'_>, timeout_ms: u32) -> Waited {
    let Ok(wait) = nvml.lib().nvmlEventSetWait_v2.as_ref() else {
        return Waited::Failed(13);
    };
    // SAFETY: `data` is a plain C struct NVML fills in; zeroed is a valid initial value.
    let mut data: nvmlEventData_t = unsafe { std::mem::zeroed() };
    // SAFETY: the set handle comes from this `Nvml` and lives while `set` is borrowed;
    // `data` is a valid, exclusively borrowed out-pointer.
    let code = unsafe { wait(set.handle(), &mut data, timeout_ms) };
    match code {
        0 => Waited::Event(data),
        ERROR_TIMEOUT => Waited::Timeout,
        ERROR_GPU_IS_LOST => Waited::GpuLost,
        c => Waited::Failed(c),
    }
}

/// UUIDs of the GPU handles NVML gives out, by raw handle address.
fn device_uuid_of(nvml: &Nvml, data: &nvmlEventData_t) -> Option<String> {
    // SAFETY: the handle comes from NVML's event data for this library instance.
    let device = unsafe { nvml_wrapper::Device::new(data.device, nvml) };
    device.uuid().ok()
}

fn instance_id(raw: u32) -> Option<u32> {
    (raw != NO_INSTANCE).then_some(raw)
}

/// Turns raw event data into a [`HealthEvent`]; `None` for event types we do not act on.
pub fn classify(
    gpu_uuid: String,
    event_type: u64,
    event_data: u64,
    gi: u32,
    ci: u32,
    policy: &XidPolicy,
) -> Option<HealthEvent> {
    let types = EventTypes::from_bits_truncate(event_type);
    let (kind, xid, fatal) = if types.contains(EventTypes::CRITICAL_XID_ERROR) {
        (
            HealthEventKind::Xid,
            Some(event_data),
            policy.is_fatal(event_data),
        )
    } else if types.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
        (HealthEventKind::DoubleBitEcc, None, true)
    } else {
        return None;
    };
    let gi = instance_id(gi);
    let ci = if gi.is_some() { instance_id(ci) } else { None };
    Some(HealthEvent {
        gpu_uuid,
        gi,
        ci,
        kind,
        xid,
        fatal,
    })
}

fn watch_loop(
    nvml: &Nvml,
    gpu_uuids: &[String],
    options: &WatchOptions,
    stop: &AtomicBool,
    sink: &dyn Fn(HealthEvent),
) -> Result<(), HealthError> {
    let set = nvml
        .create_event_set()
        .map_err(HealthError::CreateEventSet)?;
    let wanted = EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR;
    for uuid in gpu_uuids {
        let device = match nvml.device_by_uuid(uuid.as_str()) {
            Ok(d) => d,
            Err(e) => {
                warn!(gpu = %uuid, error = %e, "no handle for health events");
                continue;
            }
        };
        let types = device
            .supported_event_types()
            .map_or(wanted, |s| s & wanted);
        // Raw call: nvml-wrapper's `register_events` frees the whole set on any error,
        // which would drop the GPUs registered before.
        let Ok(register) = nvml.lib().nvmlDeviceRegisterEvents.as_ref() else {
            warn!("NVML lacks nvmlDeviceRegisterEvents; only lost GPUs are detected");
            break;
        };
        // SAFETY: both handles come from this `Nvml` and outlive the call.
        let code = unsafe { register(device.handle(), types.bits(), set.handle()) };
        if code != 0 {
            warn!(gpu = %uuid, code, "cannot register health events (too old a GPU or driver?)");
        }
    }
    info!(
        gpus = gpu_uuids.len(),
        ignored_xids = ?options.policy.ignored().collect::<Vec<_>>(),
        "watching device health"
    );
    let wait_ms = u32::try_from(options.wait.as_millis()).unwrap_or(u32::MAX);
    let mut lost: BTreeMap<String, bool> = gpu_uuids.iter().map(|u| (u.clone(), false)).collect();
    let mut next_check = Instant::now();
    while !stop.load(Ordering::SeqCst) {
        let mut check_now = Instant::now() >= next_check;
        match raw_wait(nvml, &set, wait_ms) {
            Waited::Event(data) => {
                let Some(uuid) = device_uuid_of(nvml, &data) else {
                    debug!("event for a device without UUID; skipped");
                    continue;
                };
                if let Some(ev) = classify(
                    uuid,
                    data.eventType,
                    data.eventData,
                    data.gpuInstanceId,
                    data.computeInstanceId,
                    &options.policy,
                ) {
                    sink(ev);
                }
            }
            Waited::Timeout => {}
            Waited::GpuLost => {
                check_now = true;
                // Waiting again would return at once; pace the loop.
                std::thread::sleep(options.wait.min(Duration::from_millis(200)));
            }
            Waited::Failed(code) => {
                debug!(code, "event wait failed");
                std::thread::sleep(options.wait.min(Duration::from_millis(200)));
            }
        }
        if check_now {
            next_check = Instant::now() + options.lost_check_interval;
            for (uuid, was_lost) in &mut lost {
                let gone = match nvml.device_by_uuid(uuid.as_str()) {
                    Ok(d) => matches!(d.uuid(), Err(NvmlError::GpuLost)),
                    Err(_) => true,
                };
                if gone != *was_lost {
                    *was_lost = gone;
                    let kind = if gone {
                        HealthEventKind::Lost
                    } else {
                        HealthEventKind::Recovered
                    };
                    sink(HealthEvent {
                        gpu_uuid: uuid.clone(),
                        gi: None,
                        ci: None,
                        kind,
                        xid: None,
                        fatal: gone,
                    });
                }
            }
        }
    }
    if let Err(e) = set.release_events() {
        debug!(error = %e, "releasing the event set");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_ignores_application_xids_and_reenables() {
        let p = XidPolicy::default();
        for x in DEFAULT_IGNORED_XIDS {
            assert!(!p.is_fatal(x), "{x}");
        }
        assert!(p.is_fatal(79));
        assert!(p.is_fatal(48));
        let p = XidPolicy::new(&[79], &[31]);
        assert!(!p.is_fatal(79));
        assert!(p.is_fatal(31));
        assert!(!p.is_fatal(13));
    }

    #[test]
    fn classify_xid_and_instances() {
        let p = XidPolicy::default();
        let xid = EventTypes::CRITICAL_XID_ERROR.bits();
        let ev = classify("GPU-a".into(), xid, 79, NO_INSTANCE, NO_INSTANCE, &p).unwrap();
        assert!(ev.fatal && ev.is_gpu_wide());
        assert_eq!(ev.xid, Some(79));
        let ev = classify("GPU-a".into(), xid, 31, 7, 0, &p).unwrap();
        assert!(!ev.fatal);
        assert_eq!((ev.gi, ev.ci), (Some(7), Some(0)));
        let dbe = EventTypes::DOUBLE_BIT_ECC_ERROR.bits();
        let ev = classify("GPU-a".into(), dbe, 0, NO_INSTANCE, 3, &p).unwrap();
        assert_eq!(ev.kind, HealthEventKind::DoubleBitEcc);
        assert!(ev.fatal && ev.ci.is_none());
        let pstate = EventTypes::PSTATE_CHANGE.bits();
        assert!(classify("GPU-a".into(), pstate, 0, 0, 0, &p).is_none());
        assert!(ev.describe().contains("double-bit"));
    }
}
