//! Device health from NVML: an event loop for Xid errors and double-bit ECC errors, and a
//! periodic check for GPUs that disappeared (handle lookup by UUID fails, `GPU_IS_LOST`).
//!
//! [`HealthWatcher::start`] runs on its own thread over an [`EventSource`] (the NVML
//! backend's, [`crate::backend::GpuBackend::event_source`], so one NVML handle serves
//! discovery, MIG and health) with bounded waits ([`WatchOptions::wait`]), so
//! [`HealthWatcher::stop`] returns promptly. It reports [`HealthEvent`]s through a
//! callback; mapping GPUs and GPU/compute instance ids to published device names is the
//! caller's business.
//!
//! Application-caused Xids (the list the NVIDIA device plugin and DRA driver skip,
//! `NVIDIA/k8s-device-plugin internal/rm/health.go`) are reported with `fatal: false` and
//! must not mark a device unhealthy.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::backend::{BackendError, EVENT_DOUBLE_BIT_ECC, EVENT_XID, EventSource, EventWait};

/// Xids caused by applications (graphics engine exception, page fault, GPU stopped
/// processing, preemptive cleanup, video processor exception, context switch timeout):
/// they do not make a device unhealthy (`NVIDIA/k8s-device-plugin internal/rm/health.go`).
pub(crate) const DEFAULT_IGNORED_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// NVML's "no GPU/compute instance" id in event data.
pub(crate) const NO_INSTANCE: u32 = 0xFFFF_FFFF;

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
    /// The thread could not be spawned.
    #[error("spawning the health thread: {0}")]
    Spawn(std::io::Error),
}

/// Settings of [`HealthWatcher::start`].
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
    /// Registers Xid and double-bit ECC events on every GPU in `gpu_uuids` with `source`
    /// and reports events to `sink` from a new thread until stopped. GPUs whose
    /// registration fails are still checked for loss.
    pub fn start(
        source: Arc<dyn EventSource>,
        gpu_uuids: Vec<String>,
        options: WatchOptions,
        sink: impl Fn(HealthEvent) + Send + 'static,
    ) -> Result<Self, HealthError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("cleave-health".into())
            .spawn(move || {
                if let Err(e) = watch_loop(source.as_ref(), &gpu_uuids, &options, &flag, &sink) {
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

fn instance_id(raw: u32) -> Option<u32> {
    (raw != NO_INSTANCE).then_some(raw)
}

/// Turns raw event data into a [`HealthEvent`]; `None` for event types we do not act on.
pub(crate) fn classify(
    gpu_uuid: String,
    event_type: u64,
    event_data: u64,
    gi: u32,
    ci: u32,
    policy: &XidPolicy,
) -> Option<HealthEvent> {
    let (kind, xid, fatal) = if event_type & EVENT_XID != 0 {
        (
            HealthEventKind::Xid,
            Some(event_data),
            policy.is_fatal(event_data),
        )
    } else if event_type & EVENT_DOUBLE_BIT_ECC != 0 {
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
    source: &dyn EventSource,
    gpu_uuids: &[String],
    options: &WatchOptions,
    stop: &AtomicBool,
    sink: &dyn Fn(HealthEvent),
) -> Result<(), BackendError> {
    let mut events = source.subscribe(gpu_uuids)?;
    info!(
        gpus = gpu_uuids.len(),
        unregistered = events.unregistered().len(),
        ignored_xids = ?options.policy.ignored().collect::<Vec<_>>(),
        "watching device health"
    );
    let pace = options.wait.min(Duration::from_millis(200));
    let mut lost: BTreeMap<String, bool> = gpu_uuids.iter().map(|u| (u.clone(), false)).collect();
    let mut next_check = Instant::now();
    while !stop.load(Ordering::SeqCst) {
        let mut check_now = Instant::now() >= next_check;
        match events.wait(options.wait) {
            EventWait::Event(raw) => {
                let Some(uuid) = raw.gpu_uuid else {
                    debug!("event for a device without UUID; skipped");
                    continue;
                };
                if let Some(ev) = classify(
                    uuid,
                    raw.event_type,
                    raw.event_data,
                    raw.gi,
                    raw.ci,
                    &options.policy,
                ) {
                    sink(ev);
                }
            }
            EventWait::Timeout => {}
            EventWait::GpuLost => {
                check_now = true;
                // Waiting again would return at once; pace the loop.
                std::thread::sleep(pace);
            }
            EventWait::Failed(code) => {
                debug!(code, "event wait failed");
                std::thread::sleep(pace);
            }
        }
        if check_now {
            next_check = Instant::now() + options.lost_check_interval;
            for (uuid, was_lost) in &mut lost {
                let gone = source.is_lost(uuid);
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
        let xid = EVENT_XID;
        let ev = classify("GPU-a".into(), xid, 79, NO_INSTANCE, NO_INSTANCE, &p).unwrap();
        assert!(ev.fatal && ev.is_gpu_wide());
        assert_eq!(ev.xid, Some(79));
        let ev = classify("GPU-a".into(), xid, 31, 7, 0, &p).unwrap();
        assert!(!ev.fatal);
        assert_eq!((ev.gi, ev.ci), (Some(7), Some(0)));
        let dbe = EVENT_DOUBLE_BIT_ECC;
        let ev = classify("GPU-a".into(), dbe, 0, NO_INSTANCE, 3, &p).unwrap();
        assert_eq!(ev.kind, HealthEventKind::DoubleBitEcc);
        assert!(ev.fatal && ev.ci.is_none());
        let pstate = 0x4; // nvmlEventTypePState
        assert!(classify("GPU-a".into(), pstate, 0, 0, 0, &p).is_none());
        assert!(ev.describe().contains("double-bit"));
    }

    use crate::backend::{EventWait, RawEvent};
    use crate::prepare::testing::FakeEvents;
    use std::sync::mpsc;

    fn raw(gpu: &str, event_type: u64, data: u64, gi: u32, ci: u32) -> EventWait {
        EventWait::Event(RawEvent {
            gpu_uuid: Some(gpu.into()),
            event_type,
            event_data: data,
            gi,
            ci,
        })
    }

    fn watch(
        fake: &Arc<FakeEvents>,
        gpus: &[&str],
    ) -> (HealthWatcher, mpsc::Receiver<HealthEvent>) {
        let (tx, rx) = mpsc::channel();
        let w = HealthWatcher::start(
            Arc::clone(fake) as Arc<dyn EventSource>,
            gpus.iter().map(|g| (*g).to_owned()).collect(),
            WatchOptions {
                wait: Duration::from_millis(20),
                lost_check_interval: Duration::from_millis(20),
                ..WatchOptions::default()
            },
            move |e| {
                let _ = tx.send(e);
            },
        )
        .unwrap();
        (w, rx)
    }

    fn next(rx: &mpsc::Receiver<HealthEvent>) -> HealthEvent {
        rx.recv_timeout(Duration::from_secs(10))
            .expect("no health event within 10 s")
    }

    #[test]
    fn watcher_classifies_events_from_the_source() {
        let fake = Arc::new(FakeEvents::default());
        let (w, rx) = watch(&fake, &["GPU-0", "GPU-1"]);
        fake.push(raw("GPU-1", EVENT_XID, 31, NO_INSTANCE, NO_INSTANCE));
        fake.push(EventWait::Event(RawEvent {
            gpu_uuid: None,
            event_type: EVENT_XID,
            event_data: 79,
            gi: NO_INSTANCE,
            ci: NO_INSTANCE,
        }));
        fake.push(raw("GPU-0", 0x4, 0, NO_INSTANCE, NO_INSTANCE));
        fake.push(EventWait::Failed(999));
        fake.push(raw("GPU-0", EVENT_XID, 48, 7, 0));
        fake.push(raw(
            "GPU-0",
            EVENT_DOUBLE_BIT_ECC,
            0,
            NO_INSTANCE,
            NO_INSTANCE,
        ));
        let ev = next(&rx);
        assert_eq!(
            (ev.gpu_uuid.as_str(), ev.xid, ev.fatal),
            ("GPU-1", Some(31), false)
        );
        // The UUID-less event, the PState event and the failed wait give nothing.
        let ev = next(&rx);
        assert_eq!(
            (ev.xid, ev.gi, ev.ci, ev.fatal),
            (Some(48), Some(7), Some(0), true)
        );
        let ev = next(&rx);
        assert_eq!(ev.kind, HealthEventKind::DoubleBitEcc);
        assert_eq!(fake.subscribed(), ["GPU-0", "GPU-1"]);
        w.stop();
        assert!(fake.released(), "the event set is released at stop");
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn watcher_reports_lost_and_recovered_gpus_even_unregistered() {
        let mut fake = FakeEvents::default();
        fake.failing.insert("GPU-1".into());
        let fake = Arc::new(fake);
        let (w, rx) = watch(&fake, &["GPU-0", "GPU-1"]);
        fake.set_lost("GPU-1", true);
        let ev = next(&rx);
        assert_eq!(
            (ev.gpu_uuid.as_str(), ev.kind, ev.fatal),
            ("GPU-1", HealthEventKind::Lost, true)
        );
        // A GPU_IS_LOST wait triggers a check at once.
        fake.set_lost("GPU-1", false);
        fake.set_lost("GPU-0", true);
        fake.push(EventWait::GpuLost);
        let mut got = [next(&rx), next(&rx)];
        got.sort_by(|a, b| a.gpu_uuid.cmp(&b.gpu_uuid));
        assert_eq!(
            got.iter()
                .map(|e| (e.gpu_uuid.as_str(), e.kind))
                .collect::<Vec<_>>(),
            [
                ("GPU-0", HealthEventKind::Lost),
                ("GPU-1", HealthEventKind::Recovered)
            ]
        );
        assert!(!got[1].fatal);
        let started = Instant::now();
        w.stop();
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}
