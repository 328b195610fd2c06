//! Per-claim usage: what each prepared claim's devices were given and what they use, and
//! which claims are idle. NVML-free: sampling goes through [`UsageSource`] (the NVML
//! backend's, [`crate::backend::GpuBackend::usage_source`], or a fake).
//!
//! [`UsageSampler::sample`] takes one round over the prepared claims' devices
//! ([`ClaimDevice`], built by the caller from what prepare recorded) and returns one
//! [`DeviceSample`] per claim device. Compute activity names its source, best first:
//! GPM SM activity (Hopper and newer, whole GPUs and MIG instances), then GPU utilization
//! (whole GPUs only: NVML does not report it on MIG-enabled GPUs), then per-process SM
//! utilization for MPS claims and capacity shares whose processes are known; where
//! nothing attributes activity to the claim the sample says so ([`Activity::NotAttributable`]).
//! [`IdleTracker`] turns samples into idle claims. Which NVML call answers what on which
//! device is in `docs/usage-metrics.md`, with the names of the metrics the plugin exports
//! ([`USAGE_METRIC_NAMES`]).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tracing::warn;

use crate::backend::{
    BackendError, GpmReading, GpmTarget, MemoryUse, ProcessMemory, ProcessUtilization, UsageSource,
};

pub mod owner;

use owner::PodResolver;

/// Every usage metric the kubelet plugin exports, full names as scraped (the plugin's
/// registry prefix `cleave_kubelet_plugin` included). The Grafana dashboard
/// (`deployments/grafana/cleave-dashboard.json`) may refer to these only, and
/// `docs/usage-metrics.md` lists exactly these; both are checked.
pub const USAGE_METRIC_NAMES: &[&str] = &[
    "cleave_kubelet_plugin_claim_allocated_memory_bytes",
    "cleave_kubelet_plugin_claim_allocated_sms",
    "cleave_kubelet_plugin_claim_allocated_info",
    "cleave_kubelet_plugin_claim_used_memory_bytes",
    "cleave_kubelet_plugin_claim_compute_activity_percent",
    "cleave_kubelet_plugin_claim_activity_attributable",
    "cleave_kubelet_plugin_claim_idle",
    "cleave_kubelet_plugin_claim_idle_since_timestamp_seconds",
    "cleave_kubelet_plugin_gpu_memory_total_bytes",
    "cleave_kubelet_plugin_gpu_sms",
    "cleave_kubelet_plugin_usage_sample_duration_seconds",
    // Right-sizing (`crate::rightsize::RIGHTSIZE_METRIC_NAMES`).
    "cleave_kubelet_plugin_claim_recommended_memory_bytes",
    "cleave_kubelet_plugin_claim_recommended_multiprocessors",
    "cleave_kubelet_plugin_claim_recommendation_info",
    "cleave_kubelet_plugin_claim_window_peak_memory_bytes",
    "cleave_kubelet_plugin_claim_window_p95_memory_bytes",
    "cleave_kubelet_plugin_claim_window_p95_activity_percent",
    "cleave_kubelet_plugin_claim_window_mean_activity_percent",
    "cleave_kubelet_plugin_claim_window_idle_ratio",
    "cleave_kubelet_plugin_claim_window_samples",
    "cleave_kubelet_plugin_node_gpus_held",
    "cleave_kubelet_plugin_node_gpus_recommended",
    "cleave_kubelet_plugin_node_share_merge_gpus",
];

/// Which claim a device belongs to (the driver's one claim identity).
pub use crate::model::ClaimRef;

/// What the claim holds of the hardware (the `kind` label): a device to itself, a share
/// through its own MPS daemon, or a capacity share. Not [`cleave_api::Holding`], which
/// only says GPU or MIG.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Holding {
    /// A whole GPU to itself.
    Whole,
    /// A MIG device to itself.
    Mig,
    /// A share of a GPU or MIG device served by the claim's own MPS daemon.
    Mps,
    /// A capacity share of a GPU or MIG device (`shareID`), with other claims beside it.
    Share,
}

impl Holding {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Whole => "gpu",
            Self::Mig => "mig",
            Self::Mps => "mps",
            Self::Share => "share",
        }
    }
}

/// How a claim device is shared (the `sharing` label, [`cleave_api::config::sharing_label`]).
pub use cleave_api::SharingStrategy;

/// The MIG device a claim device is on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MigRef {
    /// `MIG-...` UUID.
    pub uuid: String,
    /// GPU instance id.
    pub gi: u32,
    /// Compute instance id.
    pub ci: u32,
}

/// What the claim was given.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Allocation {
    /// Memory, bytes (the device's, or the share's consumed capacity).
    pub memory_bytes: u64,
    /// Streaming multiprocessors, when known.
    pub sms: Option<u32>,
    /// MIG profile name (`3g.40gb`).
    pub mig_profile: Option<String>,
}

/// One prepared claim device, as the sampler needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimDevice {
    /// The claim.
    pub claim: ClaimRef,
    /// Published device name.
    pub device: String,
    /// Whole GPU, MIG device, MPS share or capacity share.
    pub kind: Holding,
    /// How it is shared; `None`: exclusive.
    pub sharing: Option<SharingStrategy>,
    /// `shareID` of a capacity share.
    pub share_id: Option<String>,
    /// UUID of the (parent) GPU.
    pub gpu_uuid: String,
    /// The MIG device, when on one.
    pub mig: Option<MigRef>,
    /// What was given.
    pub allocated: Allocation,
    /// Host PIDs known to be the claim's on this device (an MPS claim's server, a share's
    /// processes); empty when unknown. Only MPS claims and shares use them.
    pub pids: Vec<u32>,
    /// UIDs of the pods on this node that consume the claim: a process whose cgroup names
    /// one of them is the claim's. Empty when unknown.
    pub pods: Vec<String>,
}

impl ClaimDevice {
    /// UUID NVML is asked about: the MIG device's, else the GPU's.
    pub(crate) fn device_uuid(&self) -> &str {
        self.mig.as_ref().map_or(&self.gpu_uuid, |m| &m.uuid)
    }

    fn gpm_target(&self) -> GpmTarget {
        GpmTarget {
            gpu_uuid: self.gpu_uuid.clone(),
            gi: self.mig.as_ref().map(|m| m.gi),
        }
    }

    fn attributes_by_process(&self) -> bool {
        matches!(self.kind, Holding::Mps | Holding::Share)
    }

    /// Whether anything tells this claim's processes apart: host PIDs or pod UIDs.
    fn knows_processes(&self) -> bool {
        !self.pids.is_empty() || !self.pods.is_empty()
    }

    /// Whether host process `pid` is the claim's: a known PID, or one whose cgroup names
    /// one of the claim's pods.
    fn owns(&self, pid: u32, pods: &mut PodResolver) -> bool {
        self.pids.contains(&pid)
            || (!self.pods.is_empty()
                && pods
                    .pod_of(pid)
                    .is_some_and(|uid| self.pods.iter().any(|p| p == uid)))
    }
}

/// Where a compute-activity figure comes from (the `source` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActivitySource {
    /// GPM `NVML_GPM_METRIC_SM_UTIL`: share of SMs busy.
    GpmSmActivity,
    /// GPM `NVML_GPM_METRIC_SM_OCCUPANCY`: share of warps resident of the maximum.
    GpmSmOccupancy,
    /// `nvmlDeviceGetUtilizationRates().gpu`: share of time any kernel ran (duty cycle).
    GpuUtilization,
    /// Sum of `nvmlDeviceGetProcessUtilization` SM utilization of the claim's processes.
    ProcessSmUtilization,
}

impl ActivitySource {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::GpmSmActivity => "gpm_sm_activity",
            Self::GpmSmOccupancy => "gpm_sm_occupancy",
            Self::GpuUtilization => "gpu_utilization",
            Self::ProcessSmUtilization => "process_sm_utilization",
        }
    }
}

/// Compute activity of one claim device in one round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activity {
    /// A figure, percent (0 to 100), and where it comes from.
    Measured {
        /// Percent.
        percent: f64,
        /// Source.
        source: ActivitySource,
    },
    /// The first GPM sample was taken; a figure comes with the next round.
    Warming,
    /// NVML cannot tell this claim's activity apart from its neighbours' (a share whose
    /// processes are unknown, or on a MIG-enabled GPU where per-process utilization is
    /// not supported).
    NotAttributable,
    /// NVML has no activity figure for this device (a MIG device before Hopper), or the
    /// query failed.
    Unavailable,
}

impl Activity {
    /// The figure, when measured.
    pub fn percent(&self) -> Option<f64> {
        match self {
            Self::Measured { percent, .. } => Some(*percent),
            _ => None,
        }
    }
}

/// Where a used-memory figure comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemorySource {
    /// The device's own memory counters (GPU or MIG device).
    Device,
    /// The sum over the claim's processes, all listed by
    /// `nvmlDeviceGetComputeRunningProcesses_v3`.
    Processes,
    /// The sum over the claim's processes, some or all of them MPS clients listed by
    /// `nvmlDeviceGetMPSComputeRunningProcesses_v3`.
    MpsClients,
    /// Not attributable to the claim (a share whose processes and pods are unknown).
    NotAttributable,
    /// The query failed.
    Unavailable,
}

/// One claim device after one round.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSample {
    /// The input it is about.
    pub device: ClaimDevice,
    /// Memory in use, bytes.
    pub memory_used: Option<u64>,
    /// Total memory of the device (GPU or MIG device), bytes.
    pub memory_total: Option<u64>,
    /// Where `memory_used` comes from.
    pub memory_source: MemorySource,
    /// Compute activity.
    pub activity: Activity,
    /// GPM SM occupancy, percent, where GPM answered.
    pub sm_occupancy: Option<f64>,
    /// The NVML errors of this round for this device, if any.
    pub errors: Vec<String>,
}

impl DeviceSample {
    /// The activity series to export: `(source, percent)`, the main figure first.
    pub fn activity_series(&self) -> Vec<(ActivitySource, f64)> {
        let mut out = Vec::new();
        if let Activity::Measured { percent, source } = self.activity {
            out.push((source, percent));
        }
        if let Some(o) = self.sm_occupancy {
            out.push((ActivitySource::GpmSmOccupancy, o));
        }
        out
    }
}

/// The result of one round.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageRound {
    /// One sample per input device, in input order.
    pub samples: Vec<DeviceSample>,
    /// NVML queries made (each distinct device/GPU is asked once per round).
    pub queries: usize,
    /// How long the round waited for prepare and unprepare batches ([`SamplingGate`]).
    pub waited: Duration,
}

/// Takes sampling rounds over a [`UsageSource`]. Keeps, between rounds, the newest
/// per-process utilization timestamp per GPU; the source keeps the previous GPM sample
/// per device.
pub struct UsageSampler {
    source: Arc<dyn UsageSource>,
    process_seen_us: HashMap<String, u64>,
    /// Node operations go first (`None`: the round runs straight through).
    gate: Option<SamplingGate>,
    /// The most one round waits at the gate.
    max_wait: Duration,
    /// Where host processes' `<pid>/cgroup` files are read.
    proc_root: PathBuf,
    /// Whether the unreadable proc root was logged.
    blind_warned: bool,
}

impl fmt::Debug for UsageSampler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UsageSampler").finish_non_exhaustive()
    }
}

/// Answers of one round, each NVML query made at most once.
#[derive(Default)]
struct RoundCache {
    memory: HashMap<String, Result<MemoryUse, String>>,
    utilization: HashMap<String, Result<Option<u32>, String>>,
    gpm: HashMap<GpmTarget, Result<GpmReading, String>>,
    processes: HashMap<String, Result<Vec<ProcessMemory>, String>>,
    mps_processes: HashMap<String, Result<Vec<ProcessMemory>, String>>,
    /// Pod of each host PID NVML named this round (read from its cgroup once).
    pods: PodResolver,
    /// A device listed processes none of whose cgroups could be read (the proc root is
    /// not the host's).
    blind: bool,
    process_util: HashMap<String, Result<Option<Vec<ProcessUtilization>>, String>>,
    calls: Calls,
}

/// The round's NVML queries: how many, and the pacing before each.
#[derive(Default)]
struct Calls {
    queries: usize,
    pacing: Pacing,
}

fn cached<K, V>(
    map: &mut HashMap<K, Result<V, String>>,
    calls: &mut Calls,
    key: &K,
    query: impl FnOnce() -> Result<V, BackendError>,
) -> Result<V, String>
where
    K: std::hash::Hash + Eq + Clone,
    V: Clone,
{
    if let Some(v) = map.get(key) {
        return v.clone();
    }
    calls.pacing.before_query();
    calls.queries += 1;
    let v = query().map_err(|e| e.to_string());
    map.insert(key.clone(), v.clone());
    v
}

/// Lets node operations go first: while a prepare or unprepare batch holds the gate, the
/// sampler waits before its next NVML query, and between queries it gives its CPU to any
/// thread that is waiting for it. A sampling round thus never runs beside a batch for
/// longer than one query: measured with `perf sched` on a 2-core node, threads woken
/// during a batch were queued behind a running sampler until the next scheduler tick
/// (4 ms at `HZ=250`) even at `SCHED_IDLE`, the kernel placing them on the sampler's CPU
/// as if it were idle (`docs/architecture.md`, "Cost of sampling"). Cheap to clone;
/// clones share one gate.
#[derive(Debug, Clone, Default)]
pub struct SamplingGate {
    inner: Arc<GateInner>,
}

#[derive(Debug, Default)]
struct GateInner {
    /// Batches holding the gate now.
    held: Mutex<usize>,
    /// Signalled when the last hold ends.
    clear: Condvar,
    /// Rounds waiting for the gate now.
    waiting: AtomicUsize,
}

/// A batch's hold on a [`SamplingGate`]; released when dropped.
#[derive(Debug)]
#[must_use = "the gate is released when the hold is dropped"]
pub struct GateHold {
    inner: Arc<GateInner>,
}

impl SamplingGate {
    /// An open gate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Holds the gate until the returned value is dropped.
    pub fn hold(&self) -> GateHold {
        *self
            .inner
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner) += 1;
        GateHold {
            inner: Arc::clone(&self.inner),
        }
    }

    /// Whether a batch holds the gate now.
    pub fn is_held(&self) -> bool {
        *self
            .inner
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            > 0
    }

    /// How many sampling rounds wait for the gate now.
    pub fn waiting(&self) -> usize {
        self.inner.waiting.load(Ordering::SeqCst)
    }

    /// Between two steps of a round: waits while the gate is held (within what is left
    /// of `budget`, which it lowers), then offers the CPU to any thread waiting for it.
    /// Returns how long it waited.
    pub fn pause(&self, budget: &mut Duration) -> Duration {
        let waited = self.wait_clear(*budget);
        *budget = budget.saturating_sub(waited);
        std::thread::yield_now();
        waited
    }

    /// Waits while the gate is held, at most `budget`; returns how long it waited.
    pub(crate) fn wait_clear(&self, budget: Duration) -> Duration {
        let started = Instant::now();
        let held = self
            .inner
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if *held == 0 || budget.is_zero() {
            return Duration::ZERO;
        }
        self.inner.waiting.fetch_add(1, Ordering::SeqCst);
        let (held, _) = self
            .inner
            .clear
            .wait_timeout_while(held, budget, |n| *n > 0)
            .unwrap_or_else(PoisonError::into_inner);
        self.inner.waiting.fetch_sub(1, Ordering::SeqCst);
        drop(held);
        started.elapsed()
    }
}

impl Drop for GateHold {
    fn drop(&mut self) {
        let mut held = self
            .inner
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *held = held.saturating_sub(1);
        if *held == 0 {
            self.inner.clear.notify_all();
        }
    }
}

/// How a round yields to node operations: the gate, and what is left of the round's
/// waiting budget.
#[derive(Default)]
struct Pacing {
    gate: Option<SamplingGate>,
    budget: Duration,
    waited: Duration,
}

impl Pacing {
    /// Before an NVML query: waits while a batch holds the gate (within the budget), then
    /// offers the CPU to any thread waiting for it.
    fn before_query(&mut self) {
        if let Some(gate) = &self.gate {
            self.waited += gate.pause(&mut self.budget);
        }
    }
}

impl UsageSampler {
    /// A sampler over `source`.
    pub fn new(source: Arc<dyn UsageSource>) -> Self {
        Self {
            source,
            process_seen_us: HashMap::new(),
            gate: None,
            max_wait: Duration::ZERO,
            proc_root: PathBuf::from("/proc"),
            blind_warned: false,
        }
    }

    /// This sampler, reading processes' cgroups under `proc_root` (default `/proc`) to
    /// find the pod each GPU process runs in ([`owner`]).
    pub fn with_proc_root(mut self, proc_root: PathBuf) -> Self {
        self.proc_root = proc_root;
        self
    }

    /// This sampler, waiting before each query while `gate` is held, at most `max_wait`
    /// per round (a steady stream of batches delays sampling, never stops it).
    pub fn with_gate(mut self, gate: SamplingGate, max_wait: Duration) -> Self {
        self.gate = Some(gate);
        self.max_wait = max_wait;
        self
    }

    /// One sampling round over `devices`. An NVML failure affects only the samples of the
    /// devices it was about (they carry it in [`DeviceSample::errors`]).
    pub fn sample(&mut self, devices: &[ClaimDevice]) -> UsageRound {
        let mut cache = RoundCache {
            calls: Calls {
                queries: 0,
                pacing: Pacing {
                    gate: self.gate.clone(),
                    budget: self.max_wait,
                    waited: Duration::ZERO,
                },
            },
            pods: PodResolver::new(&self.proc_root),
            ..RoundCache::default()
        };
        let samples = devices
            .iter()
            .map(|d| self.sample_one(d, &mut cache))
            .collect();
        if cache.blind && !self.blind_warned {
            self.blind_warned = true;
            warn!(proc_root = %self.proc_root.display(), "cannot read the cgroup of any GPU process: shares and MPS claims known by their pods are not attributable (does the plugin run in the host's PID namespace?)");
        }
        let mut live: Vec<GpmTarget> = cache.gpm.keys().cloned().collect();
        live.sort();
        self.source.gpm_retain(&live);
        // Newest per-process sample per GPU: the next round asks only for newer ones.
        for (gpu, list) in &cache.process_util {
            if let Ok(Some(list)) = list
                && let Some(ts) = list.iter().map(|p| p.timestamp_us).max()
            {
                let seen = self.process_seen_us.entry(gpu.clone()).or_insert(0);
                *seen = (*seen).max(ts);
            }
        }
        self.process_seen_us
            .retain(|gpu, _| cache.process_util.contains_key(gpu));
        UsageRound {
            samples,
            queries: cache.calls.queries,
            waited: cache.calls.pacing.waited,
        }
    }

    fn sample_one(&self, d: &ClaimDevice, c: &mut RoundCache) -> DeviceSample {
        let src = &self.source;
        let mut errors = Vec::new();
        let device_uuid = d.device_uuid().to_owned();
        let memory = cached(&mut c.memory, &mut c.calls, &device_uuid, || {
            src.memory(&device_uuid)
        });
        let memory_total = memory.as_ref().ok().map(|m| m.total);
        // Known by its pods only, on a device whose processes' cgroups cannot be read: the
        // claim's processes cannot be told apart (not "uses nothing").
        let mut blind = false;
        let (memory_used, memory_source) = if !d.attributes_by_process() {
            match &memory {
                Ok(m) => (Some(m.used), MemorySource::Device),
                Err(e) => {
                    errors.push(e.clone());
                    (None, MemorySource::Unavailable)
                }
            }
        } else if !d.knows_processes() {
            (None, MemorySource::NotAttributable)
        } else {
            match self.device_processes(&device_uuid, c) {
                Ok((plain, mps))
                    if d.pids.is_empty()
                        && !(plain.is_empty() && mps.is_empty())
                        && !plain.iter().chain(&mps).any(|p| c.pods.readable(p.pid)) =>
                {
                    blind = true;
                    c.blind = true;
                    (None, MemorySource::NotAttributable)
                }
                Ok((plain, mps)) => {
                    // The union of both lists, each PID once (the plain list first).
                    let mut seen = std::collections::BTreeSet::new();
                    let mut used = 0;
                    let mut from_mps = false;
                    for (p, is_mps) in plain
                        .iter()
                        .map(|p| (p, false))
                        .chain(mps.iter().map(|p| (p, true)))
                    {
                        if seen.insert(p.pid) && d.owns(p.pid, &mut c.pods) {
                            used += p.used.unwrap_or(0);
                            from_mps |= is_mps;
                        }
                    }
                    let source = if from_mps {
                        MemorySource::MpsClients
                    } else {
                        MemorySource::Processes
                    };
                    (Some(used), source)
                }
                Err(e) => {
                    errors.push(e);
                    (None, MemorySource::Unavailable)
                }
            }
        };
        let mut sm_occupancy = None;
        let activity = if blind {
            Activity::NotAttributable
        } else if d.attributes_by_process() {
            self.process_activity(d, c, &mut errors)
        } else {
            let target = d.gpm_target();
            match cached(&mut c.gpm, &mut c.calls, &target, || src.gpm(&target)) {
                Ok(GpmReading::Ready(a)) => {
                    sm_occupancy = a.sm_occupancy;
                    Activity::Measured {
                        percent: a.sm_activity,
                        source: ActivitySource::GpmSmActivity,
                    }
                }
                Ok(GpmReading::Warming) => Activity::Warming,
                Ok(GpmReading::Unsupported) if d.mig.is_some() => Activity::Unavailable,
                Ok(GpmReading::Unsupported) => {
                    let gpu = d.gpu_uuid.clone();
                    match cached(&mut c.utilization, &mut c.calls, &gpu, || {
                        src.gpu_utilization(&gpu)
                    }) {
                        Ok(Some(u)) => Activity::Measured {
                            percent: f64::from(u),
                            source: ActivitySource::GpuUtilization,
                        },
                        Ok(None) => Activity::Unavailable,
                        Err(e) => {
                            errors.push(e);
                            Activity::Unavailable
                        }
                    }
                }
                Err(e) => {
                    errors.push(e);
                    Activity::Unavailable
                }
            }
        };
        if !errors.is_empty() {
            warn!(claim = %d.claim, device = %d.device, errors = ?errors, "usage sampling failed for a device");
        }
        DeviceSample {
            device: d.clone(),
            memory_used,
            memory_total,
            memory_source,
            activity,
            sm_occupancy,
            errors,
        }
    }

    /// The compute processes and the MPS clients of a GPU or MIG device, each list asked
    /// for once per round.
    fn device_processes(
        &self,
        device_uuid: &String,
        c: &mut RoundCache,
    ) -> Result<(Vec<ProcessMemory>, Vec<ProcessMemory>), String> {
        let src = &self.source;
        let plain = cached(&mut c.processes, &mut c.calls, device_uuid, || {
            src.processes(device_uuid)
        })?;
        let mps = cached(&mut c.mps_processes, &mut c.calls, device_uuid, || {
            src.mps_processes(device_uuid)
        })?;
        Ok((plain, mps))
    }

    /// Activity of an MPS claim or share: the sum of its processes' SM utilization, where
    /// NVML reports it per process (whole GPUs not in MIG mode) and the processes are known
    /// (by PID or by pod). Where the claim's processes are MPS clients but the samples name
    /// no MPS client of the GPU (NVML may report the MPS server only: unverified), the
    /// activity is not attributable rather than a false zero.
    fn process_activity(
        &self,
        d: &ClaimDevice,
        c: &mut RoundCache,
        errors: &mut Vec<String>,
    ) -> Activity {
        if !d.knows_processes() || d.mig.is_some() {
            return Activity::NotAttributable;
        }
        let gpu = d.gpu_uuid.clone();
        let since = self.process_seen_us.get(&gpu).copied().unwrap_or(0);
        let src = &self.source;
        match cached(&mut c.process_util, &mut c.calls, &gpu, || {
            src.process_utilization(&gpu, since)
        }) {
            Ok(Some(list)) => {
                let clients: Vec<u32> = match self.device_processes(&gpu, c) {
                    Ok((_, mps)) => mps.iter().map(|p| p.pid).collect(),
                    Err(e) => {
                        errors.push(e);
                        return Activity::Unavailable;
                    }
                };
                let mine_are_clients = clients.iter().any(|&pid| d.owns(pid, &mut c.pods));
                if mine_are_clients
                    && !list.is_empty()
                    && !list.iter().any(|p| clients.contains(&p.pid))
                {
                    return Activity::NotAttributable;
                }
                // The newest sample per process; a process without a sample since the
                // last round had no utilization (nvml.h: samples are only kept for
                // processes with non-zero utilization).
                let mut newest: BTreeMap<u32, &ProcessUtilization> = BTreeMap::new();
                for p in list.iter().filter(|p| d.owns(p.pid, &mut c.pods)) {
                    let e = newest.entry(p.pid).or_insert(p);
                    if p.timestamp_us > e.timestamp_us {
                        *e = p;
                    }
                }
                let percent: u32 = newest.values().map(|p| p.sm_percent).sum();
                Activity::Measured {
                    percent: f64::from(percent.min(100)),
                    source: ActivitySource::ProcessSmUtilization,
                }
            }
            Ok(None) => Activity::NotAttributable,
            Err(e) => {
                errors.push(e);
                Activity::Unavailable
            }
        }
    }
}

/// When a claim counts as idle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IdlePolicy {
    /// Activity below this (percent) counts as idle.
    pub threshold_percent: f64,
    /// For at least this long.
    pub window: Duration,
}

impl Default for IdlePolicy {
    fn default() -> Self {
        Self {
            threshold_percent: 5.0,
            window: Duration::from_secs(30 * 60),
        }
    }
}

/// The idle view of one claim after a round.
#[derive(Debug, Clone, PartialEq)]
pub struct IdleState {
    /// The claim.
    pub claim: ClaimRef,
    /// True once every device stayed below the threshold for the whole window.
    pub idle: bool,
    /// Since when every device has been below the threshold (`None`: not below, or
    /// activity unknown).
    pub below_since: Option<Instant>,
    /// The claim's activity this round: the highest over its devices, percent.
    pub activity_percent: Option<f64>,
    /// The highest activity since `below_since`, percent.
    pub peak_percent: Option<f64>,
    /// Sources of the figures (distinct, in device order).
    pub sources: Vec<ActivitySource>,
}

impl IdleState {
    /// One line for an Event or a log: the claim, the threshold, the window and the figures.
    pub fn describe(&self, policy: &IdlePolicy, now: Instant) -> String {
        let sources: Vec<&str> = self.sources.iter().map(|s| s.as_str()).collect();
        let below = self
            .below_since
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        format!(
            "claim {} has stayed below {}% compute activity on all its devices for {}s (window {}s; peak {:.1}%, now {:.1}%, source {})",
            self.claim,
            policy.threshold_percent,
            below.as_secs(),
            policy.window.as_secs(),
            self.peak_percent.unwrap_or(0.0),
            self.activity_percent.unwrap_or(0.0),
            sources.join(", ")
        )
    }
}

#[derive(Debug)]
struct ClaimTrack {
    claim: ClaimRef,
    below_since: Option<Instant>,
    peak: f64,
    last: Option<f64>,
    sources: Vec<ActivitySource>,
}

/// Idle detection over rounds: a claim is idle when all its devices stayed below
/// [`IdlePolicy::threshold_percent`] for [`IdlePolicy::window`]; activity at or above the
/// threshold resets it. A claim any of whose devices has no attributable figure is never
/// idle (unknown is not idle); a warming round changes nothing. The clock is the caller's
/// (`now`), so tests script time.
#[derive(Debug)]
pub struct IdleTracker {
    policy: IdlePolicy,
    claims: BTreeMap<String, ClaimTrack>,
}

enum ClaimActivity {
    Known(f64, Vec<ActivitySource>),
    Warming,
    Unknown,
}

impl IdleTracker {
    /// A tracker with `policy`.
    pub fn new(policy: IdlePolicy) -> Self {
        Self {
            policy,
            claims: BTreeMap::new(),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &IdlePolicy {
        &self.policy
    }

    /// Feeds one round taken at `now`; returns every claim in the round, by UID. Claims
    /// not in the round (unprepared) are forgotten.
    pub fn observe(&mut self, now: Instant, samples: &[DeviceSample]) -> Vec<IdleState> {
        let mut by_claim: BTreeMap<&str, (ClaimRef, ClaimActivity)> = BTreeMap::new();
        for s in samples {
            let entry = by_claim
                .entry(s.device.claim.uid.as_str())
                .or_insert_with(|| {
                    (
                        s.device.claim.clone(),
                        ClaimActivity::Known(0.0, Vec::new()),
                    )
                });
            entry.1 = match (
                std::mem::replace(&mut entry.1, ClaimActivity::Unknown),
                s.activity,
            ) {
                (ClaimActivity::Unknown, _) => ClaimActivity::Unknown,
                (_, Activity::NotAttributable | Activity::Unavailable) => ClaimActivity::Unknown,
                (ClaimActivity::Warming, _) | (_, Activity::Warming) => ClaimActivity::Warming,
                (
                    ClaimActivity::Known(max, mut sources),
                    Activity::Measured { percent, source },
                ) => {
                    if !sources.contains(&source) {
                        sources.push(source);
                    }
                    ClaimActivity::Known(max.max(percent), sources)
                }
            };
        }
        self.claims
            .retain(|uid, _| by_claim.contains_key(uid.as_str()));
        let mut out = Vec::with_capacity(by_claim.len());
        for (uid, (claim, activity)) in by_claim {
            let t = self
                .claims
                .entry(uid.to_owned())
                .or_insert_with(|| ClaimTrack {
                    claim: claim.clone(),
                    below_since: None,
                    peak: 0.0,
                    last: None,
                    sources: Vec::new(),
                });
            t.claim = claim;
            match activity {
                ClaimActivity::Known(a, sources) => {
                    t.last = Some(a);
                    t.sources = sources;
                    if a < self.policy.threshold_percent {
                        if t.below_since.is_none() {
                            t.below_since = Some(now);
                            t.peak = a;
                        }
                        t.peak = t.peak.max(a);
                    } else {
                        t.below_since = None;
                        t.peak = 0.0;
                    }
                }
                ClaimActivity::Warming => {}
                ClaimActivity::Unknown => {
                    t.last = None;
                    t.below_since = None;
                    t.peak = 0.0;
                    t.sources.clear();
                }
            }
            let idle = t
                .below_since
                .is_some_and(|since| now.saturating_duration_since(since) >= self.policy.window);
            out.push(IdleState {
                claim: t.claim.clone(),
                idle,
                below_since: t.below_since,
                activity_percent: t.last,
                peak_percent: t.below_since.map(|_| t.peak),
                sources: t.sources.clone(),
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::backend::GpmActivity;
    use crate::prepare::testing::{FakeUsage, FakeUsageDevice};

    fn claim(uid: &str) -> ClaimRef {
        ClaimRef {
            uid: uid.into(),
            namespace: "team-a".into(),
            name: format!("claim-{uid}"),
        }
    }

    fn whole(uid: &str, gpu: &str) -> ClaimDevice {
        ClaimDevice {
            claim: claim(uid),
            device: format!("gpu-{gpu}"),
            kind: Holding::Whole,
            sharing: None,
            share_id: None,
            gpu_uuid: gpu.into(),
            mig: None,
            allocated: Allocation {
                memory_bytes: 80 << 30,
                sms: Some(132),
                mig_profile: None,
            },
            pids: Vec::new(),
            pods: Vec::new(),
        }
    }

    fn mig(uid: &str, gpu: &str, mig_uuid: &str, gi: u32) -> ClaimDevice {
        ClaimDevice {
            kind: Holding::Mig,
            mig: Some(MigRef {
                uuid: mig_uuid.into(),
                gi,
                ci: 0,
            }),
            allocated: Allocation {
                memory_bytes: 10 << 30,
                sms: Some(16),
                mig_profile: Some("1g.10gb".into()),
            },
            ..whole(uid, gpu)
        }
    }

    fn share(uid: &str, gpu: &str, pids: &[u32]) -> ClaimDevice {
        ClaimDevice {
            kind: Holding::Share,
            sharing: Some(SharingStrategy::TimeSlicing),
            share_id: Some(format!("share-{uid}")),
            pids: pids.to_vec(),
            pods: Vec::new(),
            ..whole(uid, gpu)
        }
    }

    #[test]
    fn whole_gpu_uses_gpm_after_one_warming_round() {
        let fake = Arc::new(FakeUsage::default());
        fake.set(
            "GPU-h",
            FakeUsageDevice {
                used: 30 << 30,
                total: 80 << 30,
                gpm: Some(GpmActivity {
                    sm_activity: 42.0,
                    sm_occupancy: Some(17.0),
                }),
                utilization: Some(99),
                ..FakeUsageDevice::default()
            },
        );
        let mut s = UsageSampler::new(fake.clone());
        let devices = [whole("a", "GPU-h")];
        let r = s.sample(&devices);
        assert_eq!(r.samples[0].activity, Activity::Warming);
        assert_eq!(r.samples[0].memory_used, Some(30 << 30));
        assert_eq!(r.samples[0].memory_source, MemorySource::Device);
        let r = s.sample(&devices);
        assert_eq!(
            r.samples[0].activity,
            Activity::Measured {
                percent: 42.0,
                source: ActivitySource::GpmSmActivity
            }
        );
        assert_eq!(
            r.samples[0].activity_series(),
            [
                (ActivitySource::GpmSmActivity, 42.0),
                (ActivitySource::GpmSmOccupancy, 17.0)
            ]
        );
        // Duty-cycle utilization (99 %) is not used where GPM exists.
        assert!(!fake.calls().iter().any(|c| c.starts_with("utilization")));
    }

    #[test]
    fn ampere_falls_back_to_utilization_and_mig_has_none() {
        let fake = Arc::new(FakeUsage::default());
        fake.set(
            "GPU-a",
            FakeUsageDevice {
                used: 1 << 30,
                total: 40 << 30,
                utilization: Some(63),
                ..FakeUsageDevice::default()
            },
        );
        fake.set(
            "MIG-1",
            FakeUsageDevice {
                used: 2 << 30,
                total: 5 << 30,
                ..FakeUsageDevice::default()
            },
        );
        let mut s = UsageSampler::new(fake);
        let r = s.sample(&[whole("a", "GPU-a"), mig("b", "GPU-a", "MIG-1", 7)]);
        assert_eq!(
            r.samples[0].activity,
            Activity::Measured {
                percent: 63.0,
                source: ActivitySource::GpuUtilization
            }
        );
        assert_eq!(r.samples[1].activity, Activity::Unavailable);
        assert_eq!(r.samples[1].memory_used, Some(2 << 30));
        assert_eq!(r.samples[1].memory_total, Some(5 << 30));
        assert!(r.samples.iter().all(|s| s.errors.is_empty()));
    }

    #[test]
    fn mig_instances_use_their_own_gpm_sample() {
        let fake = Arc::new(FakeUsage::default());
        fake.set("MIG-1", FakeUsageDevice::default());
        fake.set("MIG-2", FakeUsageDevice::default());
        fake.set_gpm("GPU-h", Some(3), 11.0);
        fake.set_gpm("GPU-h", Some(4), 77.0);
        let mut s = UsageSampler::new(fake.clone());
        let devices = [mig("a", "GPU-h", "MIG-1", 3), mig("b", "GPU-h", "MIG-2", 4)];
        s.sample(&devices);
        let r = s.sample(&devices);
        let got: Vec<_> = r.samples.iter().map(|s| s.activity.percent()).collect();
        assert_eq!(got, [Some(11.0), Some(77.0)]);
        // Unprepared instance: its kept GPM sample is dropped.
        s.sample(&devices[..1]);
        assert_eq!(
            fake.kept_gpm(),
            [GpmTarget {
                gpu_uuid: "GPU-h".into(),
                gi: Some(3)
            }]
        );
    }

    #[test]
    fn shares_attribute_by_process_or_say_they_cannot() {
        let fake = Arc::new(FakeUsage::default());
        fake.set(
            "GPU-s",
            FakeUsageDevice {
                used: 50 << 30,
                total: 80 << 30,
                utilization: Some(90),
                processes: vec![(100, 3 << 30), (200, 5 << 30), (300, 7 << 30)],
                process_util: Some(vec![(100, 20), (200, 15), (300, 60)]),
                ..FakeUsageDevice::default()
            },
        );
        let mut s = UsageSampler::new(fake.clone());
        let r = s.sample(&[
            share("a", "GPU-s", &[100, 200]),
            share("b", "GPU-s", &[]),
            ClaimDevice {
                kind: Holding::Mps,
                sharing: Some(SharingStrategy::Mps),
                ..share("c", "GPU-s", &[300])
            },
        ]);
        assert_eq!(r.samples[0].memory_used, Some(8 << 30));
        assert_eq!(r.samples[0].memory_source, MemorySource::Processes);
        assert_eq!(
            r.samples[0].activity,
            Activity::Measured {
                percent: 35.0,
                source: ActivitySource::ProcessSmUtilization
            }
        );
        assert_eq!(r.samples[1].activity, Activity::NotAttributable);
        assert_eq!(r.samples[1].memory_source, MemorySource::NotAttributable);
        assert_eq!(r.samples[2].activity.percent(), Some(60.0));
        assert_eq!(r.samples[2].memory_used, Some(7 << 30));
        // One process list and one per-process query for the GPU, however many shares.
        let calls = fake.calls();
        assert_eq!(
            calls.iter().filter(|c| c.starts_with("processes")).count(),
            1
        );
        assert_eq!(
            calls
                .iter()
                .filter(|c| c.starts_with("process_util"))
                .count(),
            1
        );
        // The next round asks only for newer samples.
        s.sample(&[share("a", "GPU-s", &[100])]);
        assert!(
            fake.calls()
                .contains(&"process_util GPU-s since 1000".to_owned())
        );
    }

    const POD_A: &str = "0f6b2c1e-7a3d-4c55-9e21-8b1d2f3a4c5d";
    const POD_B: &str = "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d";

    /// A proc root whose PIDs run in the given pods (`None`: a host process).
    fn proc_root(pids: &[(u32, Option<&str>)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (pid, pod) in pids {
            let p = dir.path().join(pid.to_string());
            std::fs::create_dir(&p).unwrap();
            let line = match pod {
                Some(uid) => format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{pid}.scope\n",
                    uid.replace('-', "_")
                ),
                None => "0::/system.slice/containerd.service\n".to_owned(),
            };
            std::fs::write(p.join("cgroup"), line).unwrap();
        }
        dir
    }

    fn share_of_pods(uid: &str, gpu: &str, pods: &[&str]) -> ClaimDevice {
        ClaimDevice {
            pods: pods.iter().map(|p| (*p).to_owned()).collect(),
            ..share(uid, gpu, &[])
        }
    }

    /// Shares of two pods on one GPU, their processes MPS clients, beside a per-claim MPS
    /// claim known by its server's PID: each gets its own memory and activity; a host
    /// process is nobody's.
    #[test]
    fn shares_attribute_by_pod_cgroup_and_mps_clients() {
        let root = proc_root(&[
            (100, Some(POD_A)),
            (400, Some(POD_A)),
            (200, Some(POD_B)),
            (300, None),
        ]);
        let fake = Arc::new(FakeUsage::default());
        fake.set(
            "GPU-s",
            FakeUsageDevice {
                used: 50 << 30,
                total: 80 << 30,
                processes: vec![(900, 1 << 30), (300, 4 << 30)],
                mps_processes: vec![(100, 3 << 30), (400, 2 << 30), (200, 5 << 30)],
                process_util: Some(vec![(100, 20), (400, 10), (200, 15), (900, 40), (300, 30)]),
                ..FakeUsageDevice::default()
            },
        );
        let mut s = UsageSampler::new(fake.clone()).with_proc_root(root.path().to_path_buf());
        let r = s.sample(&[
            share_of_pods("a", "GPU-s", &[POD_A]),
            share_of_pods("b", "GPU-s", &[POD_B]),
            ClaimDevice {
                kind: Holding::Mps,
                sharing: Some(SharingStrategy::Mps),
                ..share("c", "GPU-s", &[900])
            },
            share_of_pods("d", "GPU-s", &["11111111-2222-4333-8444-555555555555"]),
        ]);
        let got: Vec<_> = r
            .samples
            .iter()
            .map(|s| (s.memory_used, s.memory_source, s.activity.percent()))
            .collect();
        assert_eq!(
            got,
            [
                (Some(5 << 30), MemorySource::MpsClients, Some(30.0)),
                (Some(5 << 30), MemorySource::MpsClients, Some(15.0)),
                (Some(1 << 30), MemorySource::Processes, Some(40.0)),
                (Some(0), MemorySource::Processes, Some(0.0)),
            ]
        );
        assert!(r.samples.iter().all(|s| s.errors.is_empty()));
        // Each list asked for once for the GPU, however many shares.
        let calls = fake.calls();
        for call in ["processes GPU-s", "mps_processes GPU-s"] {
            assert_eq!(calls.iter().filter(|c| *c == call).count(), 1, "{calls:?}");
        }
    }

    /// Where the samples name no MPS client (only the server), a share of MPS clients is
    /// not attributable rather than idle; its memory still is.
    #[test]
    fn mps_clients_without_their_own_samples_are_not_attributable() {
        let root = proc_root(&[(100, Some(POD_A))]);
        let fake = Arc::new(FakeUsage::default());
        fake.set(
            "GPU-s",
            FakeUsageDevice {
                processes: vec![(900, 1 << 30)],
                mps_processes: vec![(100, 3 << 30)],
                process_util: Some(vec![(900, 70)]),
                ..FakeUsageDevice::default()
            },
        );
        let mut s = UsageSampler::new(fake).with_proc_root(root.path().to_path_buf());
        let r = s.sample(&[share_of_pods("a", "GPU-s", &[POD_A])]);
        assert_eq!(r.samples[0].activity, Activity::NotAttributable);
        assert_eq!(r.samples[0].memory_used, Some(3 << 30));
    }

    /// A proc root that shows none of the GPU's processes (not the host's PID namespace):
    /// a share known by its pods is not attributable, not idle; one known by PIDs still is.
    #[test]
    fn an_unreadable_proc_root_makes_pod_shares_not_attributable() {
        let root = proc_root(&[]);
        let fake = Arc::new(FakeUsage::default());
        fake.set(
            "GPU-s",
            FakeUsageDevice {
                mps_processes: vec![(100, 3 << 30)],
                process_util: Some(vec![(100, 70)]),
                ..FakeUsageDevice::default()
            },
        );
        let mut s = UsageSampler::new(fake).with_proc_root(root.path().to_path_buf());
        let r = s.sample(&[
            share_of_pods("a", "GPU-s", &[POD_A]),
            share("b", "GPU-s", &[100]),
        ]);
        assert_eq!(
            (r.samples[0].memory_source, r.samples[0].activity),
            (MemorySource::NotAttributable, Activity::NotAttributable)
        );
        assert_eq!(r.samples[1].memory_used, Some(3 << 30));
        assert_eq!(r.samples[1].activity.percent(), Some(70.0));
    }

    /// A share on a MIG device: memory by pod from the MIG device's lists; activity is
    /// not attributable (no per-process utilization in MIG mode).
    #[test]
    fn shares_on_a_mig_device_get_memory_by_pod() {
        let root = proc_root(&[(100, Some(POD_A)), (200, Some(POD_B))]);
        let fake = Arc::new(FakeUsage::default());
        fake.set(
            "MIG-1",
            FakeUsageDevice {
                total: 10 << 30,
                mps_processes: vec![(100, 1 << 30), (200, 2 << 30)],
                ..FakeUsageDevice::default()
            },
        );
        let on_mig = |uid: &str, pod: &str| ClaimDevice {
            mig: Some(MigRef {
                uuid: "MIG-1".into(),
                gi: 3,
                ci: 0,
            }),
            ..share_of_pods(uid, "GPU-m", &[pod])
        };
        let mut s = UsageSampler::new(fake).with_proc_root(root.path().to_path_buf());
        let r = s.sample(&[on_mig("a", POD_A), on_mig("b", POD_B)]);
        assert_eq!(r.samples[0].memory_used, Some(1 << 30));
        assert_eq!(r.samples[1].memory_used, Some(2 << 30));
        assert_eq!(r.samples[1].memory_source, MemorySource::MpsClients);
        assert_eq!(r.samples[0].activity, Activity::NotAttributable);
    }

    #[test]
    fn a_failing_device_does_not_spoil_the_round() {
        let fake = Arc::new(FakeUsage::default());
        fake.set(
            "GPU-1",
            FakeUsageDevice {
                utilization: Some(5),
                ..FakeUsageDevice::default()
            },
        );
        let mut s = UsageSampler::new(fake);
        let r = s.sample(&[whole("a", "GPU-gone"), whole("b", "GPU-1")]);
        assert_eq!(r.samples[0].activity, Activity::Unavailable);
        assert!(
            r.samples[0].errors[0].contains("GPU-gone"),
            "{:?}",
            r.samples[0].errors
        );
        assert_eq!(r.samples[1].activity.percent(), Some(5.0));
    }

    fn sample(uid: &str, activity: Activity) -> DeviceSample {
        DeviceSample {
            device: whole(uid, "GPU-x"),
            memory_used: None,
            memory_total: None,
            memory_source: MemorySource::Device,
            activity,
            sm_occupancy: None,
            errors: Vec::new(),
        }
    }

    fn gpm(percent: f64) -> Activity {
        Activity::Measured {
            percent,
            source: ActivitySource::GpmSmActivity,
        }
    }

    #[test]
    fn idle_after_the_window_and_reset_by_activity() {
        let policy = IdlePolicy {
            threshold_percent: 5.0,
            window: Duration::from_secs(600),
        };
        let mut t = IdleTracker::new(policy);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let st = t.observe(at(0), &[sample("a", gpm(1.0))]);
        assert!(!st[0].idle);
        assert_eq!(st[0].below_since, Some(at(0)));
        t.observe(at(300), &[sample("a", gpm(4.0))]);
        let st = t.observe(at(599), &[sample("a", gpm(2.0))]);
        assert!(!st[0].idle, "one second short of the window");
        let st = t.observe(at(600), &[sample("a", gpm(0.5))]);
        assert!(st[0].idle);
        assert_eq!(st[0].peak_percent, Some(4.0));
        assert_eq!(st[0].activity_percent, Some(0.5));
        let text = st[0].describe(&policy, at(600));
        assert!(
            text.contains("team-a/claim-a") && text.contains("600s") && text.contains("peak 4.0%"),
            "{text}"
        );
        assert!(text.contains("gpm_sm_activity"), "{text}");
        // Activity at the threshold resets; the window starts again.
        let st = t.observe(at(660), &[sample("a", gpm(5.0))]);
        assert!(!st[0].idle && st[0].below_since.is_none());
        t.observe(at(700), &[sample("a", gpm(0.0))]);
        let st = t.observe(at(1299), &[sample("a", gpm(0.0))]);
        assert!(!st[0].idle);
        let st = t.observe(at(1300), &[sample("a", gpm(0.0))]);
        assert!(st[0].idle);
    }

    #[test]
    fn idle_needs_every_device_low_and_known() {
        let mut t = IdleTracker::new(IdlePolicy {
            threshold_percent: 10.0,
            window: Duration::from_secs(60),
        });
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        // Two devices of claim "a": one busy keeps the claim busy.
        let st = t.observe(at(0), &[sample("a", gpm(1.0)), sample("a", gpm(50.0))]);
        assert_eq!(st[0].activity_percent, Some(50.0));
        assert!(st[0].below_since.is_none());
        // Unknown is never idle, and clears the window.
        t.observe(at(10), &[sample("a", gpm(1.0))]);
        let st = t.observe(
            at(100),
            &[
                sample("a", gpm(1.0)),
                sample("a", Activity::NotAttributable),
            ],
        );
        assert!(!st[0].idle && st[0].below_since.is_none());
        // A warming round changes nothing.
        t.observe(at(200), &[sample("a", gpm(1.0))]);
        let st = t.observe(at(300), &[sample("a", Activity::Warming)]);
        assert_eq!(st[0].below_since, Some(at(200)));
        assert!(st[0].idle);
        // An unprepared claim is forgotten: back later, it starts afresh.
        assert!(
            t.observe(at(310), &[sample("b", gpm(1.0))])
                .iter()
                .all(|s| s.claim.uid == "b")
        );
        let st = t.observe(at(400), &[sample("a", gpm(1.0))]);
        assert_eq!(st[0].below_since, Some(at(400)));
    }

    #[test]
    fn metric_names_follow_the_plugin_style_and_match_the_docs() {
        let mut seen = std::collections::BTreeSet::new();
        for name in USAGE_METRIC_NAMES {
            assert!(name.starts_with("cleave_kubelet_plugin_"), "{name}");
            assert!(
                name.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{name}"
            );
            assert!(seen.insert(*name), "duplicate {name}");
        }
        let docs = include_str!("../../docs/usage-metrics.md");
        let in_docs: std::collections::BTreeSet<String> = docs
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split('`').next())
            .filter(|n| n.starts_with("cleave_"))
            .map(str::to_owned)
            .collect();
        let seen: std::collections::BTreeSet<String> =
            seen.into_iter().map(str::to_owned).collect();
        assert_eq!(
            in_docs, seen,
            "docs/usage-metrics.md metric table vs USAGE_METRIC_NAMES"
        );
    }
    /// A source that notes, at every query, whether a batch held the gate.
    struct Watching {
        inner: FakeUsage,
        gate: SamplingGate,
        held_at_query: std::sync::Mutex<Vec<bool>>,
    }

    impl Watching {
        fn note(&self) {
            self.held_at_query.lock().unwrap().push(self.gate.is_held());
        }
    }

    impl UsageSource for Watching {
        fn memory(&self, uuid: &str) -> Result<MemoryUse, BackendError> {
            self.note();
            self.inner.memory(uuid)
        }
        fn gpu_utilization(&self, uuid: &str) -> Result<Option<u32>, BackendError> {
            self.note();
            self.inner.gpu_utilization(uuid)
        }
        fn gpm(&self, target: &GpmTarget) -> Result<GpmReading, BackendError> {
            self.note();
            self.inner.gpm(target)
        }
        fn gpm_retain(&self, live: &[GpmTarget]) {
            self.inner.gpm_retain(live);
        }
        fn processes(&self, uuid: &str) -> Result<Vec<ProcessMemory>, BackendError> {
            self.note();
            self.inner.processes(uuid)
        }
        fn process_utilization(
            &self,
            uuid: &str,
            since_us: u64,
        ) -> Result<Option<Vec<ProcessUtilization>>, BackendError> {
            self.note();
            self.inner.process_utilization(uuid, since_us)
        }
    }

    fn watched_mig_gpu(gate: &SamplingGate) -> (Arc<Watching>, Vec<ClaimDevice>) {
        let inner = FakeUsage::default();
        inner.set(
            "MIG-a",
            FakeUsageDevice {
                used: 1 << 30,
                total: 10 << 30,
                ..Default::default()
            },
        );
        inner.set(
            "MIG-b",
            FakeUsageDevice {
                used: 2 << 30,
                total: 10 << 30,
                ..Default::default()
            },
        );
        inner.set_gpm("GPU-h", Some(1), 10.0);
        inner.set_gpm("GPU-h", Some(2), 20.0);
        let source = Arc::new(Watching {
            inner,
            gate: gate.clone(),
            held_at_query: std::sync::Mutex::new(Vec::new()),
        });
        let devices = vec![mig("a", "GPU-h", "MIG-a", 1), mig("b", "GPU-h", "MIG-b", 2)];
        (source, devices)
    }

    /// While a batch holds the gate the round makes no NVML query; once it lets go, the
    /// round goes on and says how long it waited.
    #[test]
    fn round_makes_no_query_while_a_batch_holds_the_gate() {
        let gate = SamplingGate::new();
        let (source, devices) = watched_mig_gpu(&gate);
        let mut sampler = UsageSampler::new(Arc::clone(&source) as Arc<dyn UsageSource>)
            .with_gate(gate.clone(), Duration::from_secs(30));
        let hold = gate.hold();
        let waiting = gate.clone();
        let round = std::thread::spawn(move || sampler.sample(&devices));
        // The round is blocked on the gate (not merely not yet started) before the check.
        let deadline = Instant::now() + Duration::from_secs(30);
        while waiting.waiting() == 0 {
            assert!(
                Instant::now() < deadline,
                "the round never waited for the gate"
            );
            std::thread::yield_now();
        }
        assert!(
            source.held_at_query.lock().unwrap().is_empty(),
            "no query while the batch runs"
        );
        drop(hold);
        let r = round.join().unwrap();
        assert_eq!(r.samples.len(), 2);
        assert_eq!(r.samples[1].memory_used, Some(2 << 30));
        let held = source.held_at_query.lock().unwrap().clone();
        assert_eq!(held.len(), r.queries);
        assert!(
            held.iter().all(|h| !h),
            "every query after the batch: {held:?}"
        );
        assert!(r.waited > Duration::ZERO, "the round says it waited");
        assert!(r.waited < Duration::from_secs(30));
    }

    /// A batch that never ends delays a round by the waiting budget, then the round runs:
    /// sampling is postponed, never stopped.
    #[test]
    fn a_held_gate_delays_a_round_by_its_budget_only() {
        let gate = SamplingGate::new();
        let (source, devices) = watched_mig_gpu(&gate);
        let mut sampler = UsageSampler::new(Arc::clone(&source) as Arc<dyn UsageSource>)
            .with_gate(gate.clone(), Duration::from_millis(30));
        let _hold = gate.hold();
        let r = sampler.sample(&devices);
        assert_eq!(r.samples.len(), 2);
        assert_eq!(r.samples[0].memory_used, Some(1 << 30));
        assert!(
            r.waited >= Duration::from_millis(30),
            "waited {:?}",
            r.waited
        );
        assert!(
            r.waited < Duration::from_secs(10),
            "one budget per round: {:?}",
            r.waited
        );
        let held = source.held_at_query.lock().unwrap().clone();
        assert_eq!(held.len(), 4, "memory and GPM of both devices");
        // Without a gate the same round never waits.
        let mut plain = UsageSampler::new(Arc::clone(&source) as Arc<dyn UsageSource>);
        assert_eq!(plain.sample(&devices).waited, Duration::ZERO);
    }

    /// Holds nest: the gate opens when the last batch lets go.
    #[test]
    fn gate_opens_when_the_last_hold_ends() {
        let gate = SamplingGate::new();
        assert!(!gate.is_held());
        assert_eq!(gate.wait_clear(Duration::from_secs(5)), Duration::ZERO);
        let a = gate.hold();
        let b = gate.clone().hold();
        drop(a);
        assert!(gate.is_held());
        drop(b);
        assert!(!gate.is_held());
        assert_eq!(gate.wait_clear(Duration::from_secs(5)), Duration::ZERO);
    }
}
