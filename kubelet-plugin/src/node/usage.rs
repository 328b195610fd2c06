//! Per-claim usage: the sampling thread behind the `claim_*` metrics, idle claims and
//! their `ClaimIdle` Events, and the `usage` command.
//!
//! [`UsageMonitor`] runs [`UsageRounds`] on a thread of its own every `--usage-interval`:
//! it takes the prepared claims' devices from the driver
//! ([`cleave_driver::prepare::NodeDriver::claim_devices`]), samples them through the
//! backend's usage source (the driver's NVML handle), feeds the idle tracker and writes the
//! result into [`crate::node::usage::metrics::UsageMetrics`]. A scrape encodes that last round and
//! never calls NVML. A claim that turns idle is sent once per idle period to the Event
//! task, which posts a Warning `ClaimIdle` on its ResourceClaim (`--idle-events`).
//!
//! Prepare goes first: every prepare and unprepare batch holds the plugin's
//! [`cleave_driver::usage::SamplingGate`], and a round waits at it before it starts, before
//! each NVML query and between its later steps, giving up its CPU there too. Running
//! `SCHED_IDLE` alone did not keep the sampler out of prepare's way (`docs/architecture.md`,
//! "Cost of sampling").
//!
//! MPS claims and capacity shares: a GPU process is the claim's when its cgroup names a pod
//! that consumes the claim ([`WithPods`] fills each device's pods from this node's pod
//! index), or when it is the claim's control daemon (process launcher) or a descendant of
//! it (the MPS server), read from the host's `/proc` (`--proc-root`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use cleave_driver::backend::UsageSource;
use cleave_driver::prepare::NodeDriver;
use cleave_driver::usage::{ClaimDevice, Holding, IdlePolicy, IdleTracker, UsageSampler};
use tracing::{debug, info, warn};

use crate::node::usage::metrics::UsageMetrics;

pub(crate) mod by_command;
pub(crate) mod command;
pub(crate) mod metrics;
pub(crate) mod recommend;
pub(crate) mod recommend_command;
pub(crate) mod rightsize_metrics;
pub(crate) mod round;

pub(crate) use round::{IdleNotice, RoundOutcome};

/// Event reason: a claim stayed below the idle threshold for the idle window.
pub(crate) const REASON_CLAIM_IDLE: &str = "ClaimIdle";

/// What the monitor samples: the prepared claims' devices and the node's GPUs.
pub trait ClaimDevices: Send + Sync {
    /// The devices of the prepared claims now.
    fn claim_devices(&self) -> Vec<ClaimDevice>;
    /// Every GPU: UUID, total memory (bytes), SMs where known.
    fn gpus(&self) -> Vec<(String, u64, Option<u32>)>;
    /// The node's inventory, for right-sizing (MIG profile tables, MIG modes); `None`:
    /// no recommendations.
    fn inventory(&self) -> Option<cleave_driver::model::NodeInventory> {
        None
    }
}

impl ClaimDevices for NodeDriver {
    fn claim_devices(&self) -> Vec<ClaimDevice> {
        NodeDriver::claim_devices(self)
    }
    fn gpus(&self) -> Vec<(String, u64, Option<u32>)> {
        self.inventory()
            .gpus
            .into_iter()
            .map(|g| (g.uuid, g.memory_bytes, g.multiprocessors))
            .collect()
    }
    fn inventory(&self) -> Option<cleave_driver::model::NodeInventory> {
        Some(NodeDriver::inventory(self))
    }
}

/// Claim devices with their consuming pods (`pods`) filled from this node's pod index.
/// The index (one watch on the node's pods) is started and read only when a round has a
/// capacity share or MPS claim (whose processes are attributed by pod) or claim series
/// carry pod labels; whole GPUs and MIG devices alone never start it.
pub(crate) struct WithPods {
    inner: Arc<dyn ClaimDevices>,
    pods: Arc<dyn ClaimConsumers>,
    always: bool,
}

/// Which of this node's pods consume each claim; the API server side implements it over
/// its pod watch (wired in `crate::start::usage`).
pub(crate) trait ClaimConsumers: Send + Sync {
    /// Sets each device's `pods` to the pods that consume its claim.
    fn fill_pods(&self, devices: &mut [ClaimDevice]);
}

impl WithPods {
    /// `inner`'s devices with `pods` from `pods`; `always`: for every round (pod labels on).
    pub(crate) fn new(
        inner: Arc<dyn ClaimDevices>,
        pods: Arc<dyn ClaimConsumers>,
        always: bool,
    ) -> Self {
        Self {
            inner,
            pods,
            always,
        }
    }
}

impl ClaimDevices for WithPods {
    fn claim_devices(&self) -> Vec<ClaimDevice> {
        let mut devices = self.inner.claim_devices();
        let needed = self.always
            || devices
                .iter()
                .any(|d| matches!(d.kind, Holding::Mps | Holding::Share));
        if needed && !devices.is_empty() {
            self.pods.fill_pods(&mut devices);
        }
        devices
    }
    fn gpus(&self) -> Vec<(String, u64, Option<u32>)> {
        self.inner.gpus()
    }
    fn inventory(&self) -> Option<cleave_driver::model::NodeInventory> {
        self.inner.inventory()
    }
}

/// Sampler, idle tracker and the once-per-idle-period bookkeeping, without a thread (the
/// monitor's thread, the `usage --mock` command and the bench drive it).
#[derive(Debug)]
pub struct UsageRounds {
    sampler: UsageSampler,
    tracker: IdleTracker,
    /// Claims (UID) whose current idle period was already reported.
    reported: BTreeSet<String>,
    /// Usage windows and recommendations (`None`: off).
    rightsizer: Option<recommend::Rightsizer>,
    /// Batches go first (see [`Self::with_gate`]); with the most a round waits.
    gate: Option<(cleave_driver::usage::SamplingGate, Duration)>,
}

impl UsageRounds {
    /// Rounds over `source` with idle `policy`.
    pub fn new(source: Arc<dyn UsageSource>, policy: IdlePolicy) -> Self {
        Self {
            sampler: UsageSampler::new(source),
            tracker: IdleTracker::new(policy),
            reported: BTreeSet::new(),
            rightsizer: None,
            gate: None,
        }
    }

    /// These rounds, waiting at `gate` while a batch holds it: before each NVML query (at
    /// most `max_wait` per round) and between the right-sizing steps (as much again).
    pub(crate) fn with_gate(
        mut self,
        gate: cleave_driver::usage::SamplingGate,
        max_wait: Duration,
    ) -> Self {
        self.sampler = self.sampler.with_gate(gate.clone(), max_wait);
        self.gate = Some((gate, max_wait));
        self
    }

    /// These rounds, reading processes under `proc_root` (the host's `/proc`): their
    /// cgroups name the pod each GPU process runs in, their parents an MPS daemon's server.
    pub fn with_proc_root(mut self, proc_root: std::path::PathBuf) -> Self {
        self.sampler = self.sampler.with_proc_root(proc_root);
        self
    }

    /// These rounds, also feeding usage windows and recommendations.
    pub fn with_rightsizer(mut self, rightsizer: recommend::Rightsizer) -> Self {
        self.rightsizer = Some(rightsizer);
        self
    }

    /// The right-sizing state, when on.
    pub fn rightsizer(&self) -> Option<&recommend::Rightsizer> {
        self.rightsizer.as_ref()
    }

    /// Writes the usage windows (at shutdown).
    pub fn flush(&mut self, wall: SystemTime) {
        if let Some(r) = &mut self.rightsizer {
            r.flush(wall);
        }
    }

    /// One round over `devices` at `now` (no right-sizing).
    pub fn round(&mut self, devices: &[ClaimDevice], now: Instant) -> RoundOutcome {
        self.round_with(devices, now, SystemTime::now(), None)
    }

    /// One round over `devices` at `now` (`wall` on the wall clock); with right-sizing on
    /// and `inventory` given, the windows take the round and every claim device gets a
    /// recommendation.
    pub fn round_with(
        &mut self,
        devices: &[ClaimDevice],
        now: Instant,
        wall: SystemTime,
        inventory: Option<&cleave_driver::model::NodeInventory>,
    ) -> RoundOutcome {
        let started = Instant::now();
        let (samples, waited) = if devices.is_empty() {
            (Vec::new(), Duration::ZERO)
        } else {
            let r = self.sampler.sample(devices);
            (r.samples, r.waited)
        };
        let idle = self.tracker.observe(now, &samples);
        let policy = *self.tracker.policy();
        let mut newly_idle = Vec::new();
        let mut still_idle = BTreeSet::new();
        for st in &idle {
            if !st.idle {
                continue;
            }
            still_idle.insert(st.claim.uid.clone());
            if !self.reported.contains(&st.claim.uid) {
                newly_idle.push(IdleNotice {
                    claim: st.claim.clone(),
                    note: st.describe(&policy, now),
                });
            }
        }
        self.reported = still_idle;
        let mut budget = self.gate.as_ref().map_or(Duration::ZERO, |g| g.1);
        let mut waited_after = Duration::ZERO;
        let gate = self.gate.as_ref().map(|g| &g.0);
        let mut pace = || {
            if let Some(g) = gate {
                waited_after += g.pause(&mut budget);
            }
        };
        let rightsize = match (&mut self.rightsizer, inventory) {
            (Some(r), Some(inv)) => Some(r.round_paced(devices, &samples, inv, wall, &mut pace)),
            _ => None,
        };
        let waited = waited + waited_after;
        let took = started.elapsed().saturating_sub(waited);
        RoundOutcome {
            samples,
            idle,
            newly_idle,
            took,
            waited,
            rightsize,
        }
    }
}

/// How the monitor runs.
#[derive(Debug, Clone)]
pub struct MonitorConfig {
    /// Time between rounds (start to start).
    pub interval: Duration,
    /// When a claim is idle.
    pub policy: IdlePolicy,
    /// The `pool` label (the node name).
    pub pool: String,
    /// Right-sizing (`None`: off).
    pub rightsize: Option<recommend::RightsizeConfig>,
    /// Where the usage windows are kept (`None`: in memory only).
    pub rightsize_state: Option<std::path::PathBuf>,
    /// Where claims that turned oversized are sent (`--rightsize-events`).
    pub oversized: Option<tokio::sync::mpsc::UnboundedSender<recommend::OversizedNotice>>,
    /// Where recommendations are exported (`None`: not exported).
    pub rightsize_metrics: Option<Arc<crate::node::usage::rightsize_metrics::RightsizeMetrics>>,
    /// Held by prepare and unprepare batches; a round waits at it before it starts,
    /// before each NVML query and between its later steps: at most one interval in its
    /// sampling and one outside it (`None`: rounds run straight through).
    pub gate: Option<cleave_driver::usage::SamplingGate>,
    /// The host's `/proc` (`--proc-root`).
    pub proc_root: std::path::PathBuf,
}

/// The sampling thread; stopped when dropped.
#[derive(Debug)]
pub struct UsageMonitor {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl UsageMonitor {
    /// Starts rounds over `source` for the devices `inputs` lists, every
    /// `config.interval` (a whole interval apart when a round takes longer), writing into `metrics` and sending claims that turned idle to
    /// `idle` (when given).
    pub fn start(
        config: MonitorConfig,
        source: Arc<dyn UsageSource>,
        inputs: Arc<dyn ClaimDevices>,
        metrics: Arc<UsageMetrics>,
        idle: Option<tokio::sync::mpsc::UnboundedSender<IdleNotice>>,
    ) -> std::io::Result<Self> {
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("cleave-usage".into())
            .spawn(move || {
                lower_own_priority();
                let mut rounds = UsageRounds::new(source, config.policy)
                    .with_proc_root(config.proc_root.clone());
                if let Some(gate) = config.gate.clone() {
                    rounds = rounds.with_gate(gate, config.interval);
                }
                let rightsize_metrics = config.rightsize_metrics.clone();
                if let Some(rc) = config.rightsize {
                    rounds = rounds.with_rightsizer(match &config.rightsize_state {
                        Some(path) => recommend::Rightsizer::open(rc, path),
                        None => recommend::Rightsizer::in_memory(rc),
                    });
                }
                let mut warned_slow = false;
                info!(
                    interval_ms = config.interval.as_millis() as u64,
                    idle_threshold = config.policy.threshold_percent,
                    idle_after_s = config.policy.window.as_secs(),
                    "sampling per-claim usage"
                );
                loop {
                    let now = Instant::now();
                    // Batches go first, within one interval across these pauses (and one
                    // within the round's sampling). A batch in flight also holds the
                    // driver whose claim list the round reads: the round waits here
                    // rather than on that.
                    let mut budget = config.interval;
                    let mut pause = || {
                        config
                            .gate
                            .as_ref()
                            .map_or(Duration::ZERO, |g| g.pause(&mut budget))
                    };
                    let mut waited = pause();
                    let devices = with_mps_servers(inputs.claim_devices(), &config.proc_root);
                    let wall = SystemTime::now();
                    let inventory = config.rightsize.and_then(|_| inputs.inventory());
                    let r = rounds.round_with(&devices, now, wall, inventory.as_ref());
                    waited += pause();
                    metrics.apply_round(&config.pool, &r, &inputs.gpus(), now, wall);
                    if let (Some(rs), Some(m)) = (&r.rightsize, &rightsize_metrics) {
                        waited += pause();
                        m.apply(&config.pool, rs);
                    }
                    let waited = waited + r.waited;
                    if let (Some(rs), Some(tx)) = (&r.rightsize, &config.oversized) {
                        for n in &rs.newly_oversized {
                            info!(claim = %n.claim, note = %n.note, "claim oversized");
                            let _ = tx.send(n.clone());
                        }
                    }
                    debug!(
                        devices = devices.len(),
                        took_ms = r.took.as_millis() as u64,
                        waited_for_batches_ms = waited.as_millis() as u64,
                        "usage round"
                    );
                    for n in r.newly_idle {
                        info!(claim = %n.claim, note = %n.note, "claim idle");
                        if let Some(tx) = &idle {
                            let _ = tx.send(n);
                        }
                    }
                    // A round longer than the interval would sample back to back and take
                    // a core from prepare: wait a whole interval then, and say so once.
                    let took = now.elapsed().saturating_sub(waited);
                    let wait = if took >= config.interval {
                        if !warned_slow {
                            warned_slow = true;
                            warn!(
                                took_ms = took.as_millis() as u64,
                                interval_ms = config.interval.as_millis() as u64,
                                devices = devices.len(),
                                "a usage round took longer than --usage-interval; waiting a whole interval between rounds (raise --usage-interval)"
                            );
                        }
                        config.interval
                    } else {
                        config.interval - took
                    };
                    match stop_rx.recv_timeout(wait) {
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                        _ => break,
                    }
                }
                rounds.flush(SystemTime::now());
            })?;
        Ok(Self {
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// Stops the thread and waits for its round in flight.
    pub fn stop(mut self) {
        self.halt(true);
    }

    fn halt(&mut self, join: bool) {
        self.stop.take();
        if let Some(t) = self.thread.take()
            && join
            && t.join().is_err()
        {
            warn!("usage sampling thread panicked");
        }
    }
}

impl Drop for UsageMonitor {
    fn drop(&mut self) {
        // Dropping the sender ends the thread's wait; it exits after its round.
        self.halt(false);
    }
}

/// Nice value of the sampling thread where `SCHED_IDLE` is refused: prepare and the gRPC
/// threads win the CPU over it.
pub(crate) const SAMPLING_NICE: i32 = 10;

/// Puts the calling thread in the `SCHED_IDLE` scheduling policy, so it runs only when no
/// other thread of the node wants the CPU and gives it up at once when one wakes
/// (man-pages `sched(7)`, "SCHED_IDLE: Scheduling very low priority jobs"; on Linux the
/// policy is per thread, and `sched_setscheduler(0, ...)` sets the caller's). A nice value
/// alone still lets the thread finish its time slice before a woken prepare thread runs,
/// which on a node with few cores shows in prepare's tail latency. Where the policy is
/// refused, lowers the thread's nice value to [`SAMPLING_NICE`] instead
/// (`setpriority(PRIO_PROCESS, <thread id>)`, `setpriority(2)` NOTES). A failure is logged.
#[allow(unsafe_code)]
fn lower_own_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler reads the sched_param we pass by reference for the
    // duration of the call; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if rc == 0 {
        return;
    }
    debug!(error = %std::io::Error::last_os_error(), "SCHED_IDLE refused for the usage sampling thread; lowering its nice value");
    lower_own_nice();
}

/// Lowers the calling thread's nice value to [`SAMPLING_NICE`].
#[allow(unsafe_code)]
fn lower_own_nice() {
    // SAFETY: gettid and setpriority take plain integers and touch no memory of ours.
    let rc = unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, SAMPLING_NICE)
    };
    if rc != 0 {
        debug!(error = %std::io::Error::last_os_error(), "could not lower the usage sampling thread's priority");
    }
}

/// Adds to every MPS claim device's PIDs (its control daemon) the daemon's descendants
/// (the MPS server and anything it started), read from `proc_root` (the host's `/proc`).
pub(crate) fn with_mps_servers(
    mut devices: Vec<ClaimDevice>,
    proc_root: &std::path::Path,
) -> Vec<ClaimDevice> {
    if !devices
        .iter()
        .any(|d| d.kind == Holding::Mps && !d.pids.is_empty())
    {
        return devices;
    }
    let children = process_children(proc_root);
    for d in devices.iter_mut().filter(|d| d.kind == Holding::Mps) {
        d.pids = descendants(&children, &d.pids);
    }
    devices
}

/// Parent PID -> child PIDs of every process under `proc_root`.
pub(crate) fn process_children(proc_root: &std::path::Path) -> BTreeMap<u32, Vec<u32>> {
    let mut out: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return out;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if let Some(ppid) = std::fs::read_to_string(e.path().join("stat"))
            .ok()
            .as_deref()
            .and_then(parent_pid)
        {
            out.entry(ppid).or_default().push(pid);
        }
    }
    out
}

/// The parent PID in a `/proc/<pid>/stat` line (`pid (comm) state ppid ...`; `comm` may
/// hold spaces and parentheses, so the fields after the last `)` are read).
fn parent_pid(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// `roots` and all their descendants in `children`, sorted.
fn descendants(children: &BTreeMap<u32, Vec<u32>>, roots: &[u32]) -> Vec<u32> {
    let mut seen: BTreeSet<u32> = BTreeSet::new();
    let mut todo: Vec<u32> = roots.to_vec();
    while let Some(p) = todo.pop() {
        if seen.insert(p)
            && let Some(c) = children.get(&p)
        {
            todo.extend(c);
        }
    }
    seen.into_iter().collect()
}

/// `usage`: the table from the running plugin, or with `--recommend` the rightsizing one.
pub(crate) fn run_command(args: &crate::args::UsageCommandArgs) -> anyhow::Result<String> {
    if args.recommend {
        recommend_command::run_live(&args.metrics_addr)
    } else if let Some(by) = &args.by {
        let scrapes = command::scrape_all(args)?;
        Ok(by_command::render(&scrapes, by))
    } else {
        command::run_live(args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cleave_driver::backend::{
        BackendError, GpmReading, GpmTarget, MemoryUse, ProcessMemory, ProcessUtilization,
    };
    use cleave_driver::usage::Allocation;
    use cleave_driver::usage::ClaimRef;
    use std::sync::Mutex;

    /// Whole GPUs without GPM whose utilization the test sets.
    #[derive(Default)]
    struct Util(Mutex<u32>);

    impl UsageSource for Util {
        fn memory(&self, _: &str) -> Result<MemoryUse, BackendError> {
            Ok(MemoryUse {
                used: 1 << 30,
                total: 80 << 30,
            })
        }
        fn gpu_utilization(&self, _: &str) -> Result<Option<u32>, BackendError> {
            Ok(Some(*self.0.lock().unwrap()))
        }
        fn gpm(&self, _: &GpmTarget) -> Result<GpmReading, BackendError> {
            Ok(GpmReading::Unsupported)
        }
        fn gpm_retain(&self, _: &[GpmTarget]) {}
        fn processes(&self, _: &str) -> Result<Vec<ProcessMemory>, BackendError> {
            Ok(Vec::new())
        }
        fn process_utilization(
            &self,
            _: &str,
            _: u64,
        ) -> Result<Option<Vec<ProcessUtilization>>, BackendError> {
            Ok(None)
        }
    }

    fn whole(uid: &str) -> ClaimDevice {
        ClaimDevice {
            claim: ClaimRef {
                uid: uid.into(),
                namespace: "ns".into(),
                name: format!("c-{uid}"),
            },
            device: "gpu-0".into(),
            kind: Holding::Whole,
            sharing: None,
            share_id: None,
            gpu_uuid: "GPU-0".into(),
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

    #[test]
    fn an_idle_claim_is_told_once_per_idle_period() {
        let src = Arc::new(Util::default());
        let mut r = UsageRounds::new(
            src.clone(),
            IdlePolicy {
                threshold_percent: 5.0,
                window: Duration::from_secs(60),
            },
        );
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let d = [whole("a")];
        *src.0.lock().unwrap() = 1;
        assert!(r.round(&d, at(0)).newly_idle.is_empty());
        let told = r.round(&d, at(60)).newly_idle;
        assert_eq!(told.len(), 1);
        assert!(told[0].note.contains("ns/c-a"), "{}", told[0].note);
        assert!(r.round(&d, at(90)).newly_idle.is_empty(), "told twice");
        // Busy again: the next idle period is told again.
        *src.0.lock().unwrap() = 50;
        assert!(!r.round(&d, at(100)).idle[0].idle);
        *src.0.lock().unwrap() = 0;
        r.round(&d, at(110));
        assert_eq!(r.round(&d, at(170)).newly_idle.len(), 1);
        // No devices: no NVML call, no claims.
        let empty = r.round(&[], at(200));
        assert!(empty.samples.is_empty() && empty.idle.is_empty());
    }

    /// `--metrics-claim-labels=uid-only`: the per-claim series carry the claim's UID, never
    /// its namespace or name.
    #[test]
    fn uid_only_series_name_no_tenant() {
        let src = Arc::new(Util::default());
        *src.0.lock().unwrap() = 1;
        let mut r = UsageRounds::new(src, IdlePolicy::default());
        let mut registry =
            prometheus_client::registry::Registry::with_prefix("cleave_kubelet_plugin");
        let usage = metrics::UsageMetrics::register(&mut registry);
        usage.set_uid_only(true);
        let now = Instant::now();
        let gpus = [("GPU-0".to_owned(), 80u64 << 30, Some(132))];
        let round = r.round(&[whole("uid-a")], now);
        usage.apply_round("n1", &round, &gpus, now, SystemTime::now());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(r#"cleave_kubelet_plugin_claim_allocated_sms{namespace="",claim="uid-a",device="gpu-0""#),
            "{text}"
        );
        assert!(
            text.contains(r#"cleave_kubelet_plugin_claim_idle{namespace="",claim="uid-a"}"#),
            "{text}"
        );
        assert!(
            !text.contains("c-uid-a") && !text.contains(r#""ns""#),
            "{text}"
        );
    }

    /// This node's pods: `u-b` and `u-a` consume the share claim `c-s` (labels `team`),
    /// `u-x` another claim.
    fn node_pods() -> Arc<crate::k8s::node_pods::NodePods> {
        use k8s_openapi::api::core::v1::{Pod, PodResourceClaim, PodSpec};
        let pod = |uid: &str, claim: &str, team: &str| Pod {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                uid: Some(uid.into()),
                namespace: Some("ns".into()),
                labels: Some([("team".to_owned(), team.to_owned())].into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some("n1".into()),
                resource_claims: Some(vec![PodResourceClaim {
                    name: "gpu".into(),
                    resource_claim_name: Some(claim.into()),
                    resource_claim_template_name: None,
                }]),
                ..Default::default()
            }),
            status: None,
        };
        let mut index = crate::k8s::node_pods::PodIndex::new("n1");
        index.apply(&pod("u-b", "c-s", "blue"));
        index.apply(&pod("u-a", "c-s", "red"));
        index.apply(&pod("u-x", "c-other", "green"));
        Arc::new(crate::k8s::node_pods::NodePods::fixed(index))
    }

    /// Claim devices of `devices` (fixed).
    struct Fixed(Vec<ClaimDevice>);

    impl ClaimDevices for Fixed {
        fn claim_devices(&self) -> Vec<ClaimDevice> {
            self.0.clone()
        }
        fn gpus(&self) -> Vec<(String, u64, Option<u32>)> {
            Vec::new()
        }
    }

    fn share(uid: &str) -> ClaimDevice {
        ClaimDevice {
            kind: Holding::Share,
            share_id: Some("s1".into()),
            ..whole(uid)
        }
    }

    #[test]
    fn a_shares_claim_device_gets_the_uids_of_its_pods() {
        let pods = node_pods();
        let with = WithPods::new(Arc::new(Fixed(vec![share("s"), whole("w")])), pods, false);
        let devices = with.claim_devices();
        assert_eq!(devices[0].pods, vec!["u-a".to_owned(), "u-b".to_owned()]);
        assert!(devices[1].pods.is_empty(), "no pod consumes c-w");
    }

    #[test]
    fn whole_gpus_alone_do_not_start_the_pod_watch() {
        let pods = node_pods();
        let with = WithPods::new(Arc::new(Fixed(vec![whole("w")])), pods.clone(), false);
        with.claim_devices();
        assert!(!pods.started());
    }

    /// `--claim-pod-labels team,model`: every claim series carries `label_team` and
    /// `label_model`, from the first consuming pod by UID ("" when none or absent).
    #[test]
    fn claim_series_carry_the_allowlisted_pod_labels() {
        let src = Arc::new(Util::default());
        *src.0.lock().unwrap() = 30;
        let mut r = UsageRounds::new(src, IdlePolicy::default());
        let mut registry =
            prometheus_client::registry::Registry::with_prefix("cleave_kubelet_plugin");
        let usage = metrics::UsageMetrics::register(&mut registry);
        let pods = node_pods();
        usage
            .pod_labels
            .set(vec!["team".into(), "model".into()], pods.clone() as _);
        let with = WithPods::new(Arc::new(Fixed(vec![share("s"), whole("w")])), pods, true);
        let now = Instant::now();
        let round = r.round(&with.claim_devices(), now);
        usage.apply_round("n1", &round, &[], now, SystemTime::now());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            r#"cleave_kubelet_plugin_claim_allocated_memory_bytes{namespace="ns",claim="c-s",device="gpu-0",gpu="GPU-0",kind="share",sharing="exclusive",pool="n1",share="s1",label_team="red",label_model=""}"#,
            r#"cleave_kubelet_plugin_claim_allocated_memory_bytes{namespace="ns",claim="c-w",device="gpu-0",gpu="GPU-0",kind="gpu",sharing="exclusive",pool="n1",share="",label_team="",label_model=""}"#,
            r#"cleave_kubelet_plugin_claim_idle{namespace="ns",claim="c-s",label_team="red",label_model=""}"#,
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
    }

    #[test]
    fn series_follow_the_prepared_claims() {
        let src = Arc::new(Util::default());
        *src.0.lock().unwrap() = 30;
        let mut r = UsageRounds::new(src, IdlePolicy::default());
        let mut registry =
            prometheus_client::registry::Registry::with_prefix("cleave_kubelet_plugin");
        let usage = metrics::UsageMetrics::register(&mut registry);
        let now = Instant::now();
        let gpus = [("GPU-0".to_owned(), 80u64 << 30, Some(132))];
        let round = r.round(&[whole("a"), whole("b")], now);
        usage.apply_round("n1", &round, &gpus, now, SystemTime::now());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            r#"cleave_kubelet_plugin_claim_compute_activity_percent{namespace="ns",claim="c-a",device="gpu-0",gpu="GPU-0",kind="gpu",sharing="exclusive",pool="n1",share="",source="gpu_utilization"} 30.0"#,
            r#"cleave_kubelet_plugin_claim_used_memory_bytes{namespace="ns",claim="c-b",device="gpu-0",gpu="GPU-0",kind="gpu",sharing="exclusive",pool="n1",share=""} 1073741824"#,
            r#"cleave_kubelet_plugin_claim_allocated_sms{namespace="ns",claim="c-a",device="gpu-0",gpu="GPU-0",kind="gpu",sharing="exclusive",pool="n1",share=""} 132"#,
            r#"cleave_kubelet_plugin_claim_idle{namespace="ns",claim="c-a"} 0"#,
            r#"cleave_kubelet_plugin_gpu_sms{gpu="GPU-0"} 132"#,
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
        // Claim b unprepared: all its series go, claim a's stay.
        let round = r.round(&[whole("a")], now);
        usage.apply_round("n1", &round, &gpus, now, SystemTime::now());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(!text.contains("c-b"), "{text}");
        assert!(text.contains(r#"claim="c-a""#), "{text}");
        // Every exported usage name is one of USAGE_METRIC_NAMES, and every one is exported.
        let exported: BTreeSet<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split(['{', ' ']).next())
            .filter(|n| {
                cleave_driver::usage::USAGE_METRIC_NAMES
                    .iter()
                    .any(|u| n.starts_with(u))
                    || n.starts_with("cleave_kubelet_plugin_claim_")
                    || n.starts_with("cleave_kubelet_plugin_gpu_")
            })
            .filter(|n| {
                !cleave_driver::rightsize::RIGHTSIZE_METRIC_NAMES
                    .iter()
                    .any(|r| n.starts_with(r))
            })
            .collect();
        let names: BTreeSet<&str> = cleave_driver::usage::USAGE_METRIC_NAMES
            .iter()
            .copied()
            .filter(|n| !n.ends_with("idle_since_timestamp_seconds"))
            .filter(|n| !cleave_driver::rightsize::RIGHTSIZE_METRIC_NAMES.contains(n))
            .collect();
        assert_eq!(exported, names, "{text}");
    }

    #[test]
    fn stat_lines_with_odd_names_parse() {
        assert_eq!(parent_pid("42 (nvidia-cuda-mps) S 7 42 42 0"), Some(7));
        assert_eq!(parent_pid("42 (a) b) (c) R 9 1"), Some(9));
        assert_eq!(parent_pid("garbage"), None);
    }

    #[test]
    fn descendants_follow_the_tree_once() {
        let mut children = BTreeMap::new();
        children.insert(10, vec![11, 12]);
        children.insert(12, vec![13]);
        children.insert(99, vec![100]);
        assert_eq!(descendants(&children, &[10]), [10, 11, 12, 13]);
        assert_eq!(descendants(&children, &[5]), [5]);
    }

    #[test]
    fn this_process_is_a_child_of_its_parent() {
        let children = process_children(std::path::Path::new("/proc"));
        let me = std::process::id();
        let parent = std::os::unix::process::parent_id();
        assert!(children.get(&parent).is_some_and(|c| c.contains(&me)));
    }
}
