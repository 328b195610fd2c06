//! Sharing strategies on the node: per-claim MPS control daemons with thread and memory
//! limits, and GPU time-slicing. [`SharingManager`] implements the prepare state machine's
//! [`SharingHandler`] seam.
//!
//! - MPS ([`mps`]): a claim whose devices say `strategy: MPS` gets its own control daemon,
//!   limited to those devices (`CUDA_VISIBLE_DEVICES`), with its own pipe directory that is
//!   mounted into the claim's containers only (so no other claim reaches it), the claim's
//!   default active thread percentage and pinned memory limits, and whole GPUs in
//!   `EXCLUSIVE_PROCESS` compute mode while it runs. The daemon outlives plugin restarts;
//!   [`SharingManager::reconcile`] re-finds daemons after a restart, restarts dead ones of
//!   live claims and stops those whose claims are gone.
//! - Shares (consumable capacity, `--consumable-capacity mps`): one multi-user daemon per
//!   shared device (`mps/shared-<device>`, unlimited defaults), started by its first share
//!   and stopped after its last, counted from the checkpoint by the caller; each share's
//!   device gets client limits from what it consumed ([`SharingManager::apply_shares_of`]).
//! - Time-slicing ([`timeslice`]): `nvidia-smi compute-policy --set-timeslice` on whole GPUs,
//!   restored to the default when no recorded claim needs another interval.
//!
//! The tools are found under the driver root (`usr/bin/nvidia-cuda-mps-control`,
//! `usr/bin/nvidia-smi`) or given explicitly ([`SharingBinaries`]). Daemons are started by
//! a [`DaemonLauncher`]: [`ProcessLauncher`] runs them as detached host processes (local
//! runs, tests); the kubelet plugin's pod launcher runs each in a pod of its own, whose
//! entry point is [`supervise`]. Only the pod launcher gives a daemon a `/dev/shm` of its
//! own, shared with the claim's containers (MPS clients and server exchange memory there),
//! and lets servers started with a client's UID reach the pipe and log directories (in the
//! pod they are mounted directly; on the host they sit in the 0700 claim directory, so the
//! process launcher serves root clients only).

pub mod mps;
mod process;
pub mod supervise;
pub mod timeslice;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cleave_api::config::{DeviceKind, MpsConfig, SharingStrategy, TimeSliceInterval};
use serde::{Deserialize, Serialize};

use crate::cdi::{ContainerEdits, Mount};
use crate::checkpoint::DEFAULT_BOOT_ID_PATH;
use crate::prepare::{
    GpuFacts, ShareDevice, ShareHolder, SharingClaim, SharingDevice, SharingEdits, SharingError,
    SharingHandler, shared_daemon_key,
};

pub use mps::{
    DaemonHandle, DaemonLauncher, DaemonPod, DaemonSpec, MpsRecord, PinnedLimit, ProcessLauncher,
};
pub use timeslice::{ComputeMode, NvidiaSmi, TimeSliceNeed, TimeSliceSetting};

/// File name of the MPS control tool.
pub const MPS_CONTROL_TOOL: &str = "nvidia-cuda-mps-control";
/// File name of `nvidia-smi`.
pub const NVIDIA_SMI_TOOL: &str = "nvidia-smi";
/// Where MPS clients and server share memory; a daemon with a `/dev/shm` of its own has it
/// mounted here in the claim's containers.
pub const SHM_DIR: &str = "/dev/shm";
/// Lowest compute capability whose MPS honours thread and memory limits (Volta).
pub const MPS_MIN_COMPUTE_CAPABILITY: (u32, u32) = (7, 0);

/// A sharing set-up or tear-down failed; the message names the claim, device or GPU, and the
/// file or tool involved.
#[derive(Debug, thiserror::Error)]
pub enum SharingFailure {
    /// The GPU is not in the driver's inventory.
    #[error("GPU {gpu} is not known on this node")]
    UnknownGpu {
        /// GPU UUID.
        gpu: String,
    },
    /// The GPU cannot run MPS with limits.
    #[error(
        "device {device}: MPS is not supported on GPU {gpu} ({product}, compute capability {major}.{minor}); thread and memory limits need compute capability 7.0 (Volta) or newer"
    )]
    MpsUnsupported {
        /// Device name.
        device: String,
        /// GPU UUID.
        gpu: String,
        /// Product name.
        product: String,
        /// Compute capability major.
        major: u32,
        /// Compute capability minor.
        minor: u32,
    },
    /// Multi-user MPS was asked for on a GPU that cannot do it.
    #[error(
        "device {device}: mps.multiUser was requested but multi-user MPS is not supported on GPU {gpu} ({product}, compute capability {major}.{minor}); it needs compute capability 7.0 (Volta) or newer (on Pascal, clients of other users fail with CUDA_ERROR_NOT_PERMITTED)"
    )]
    MultiUserUnsupported {
        /// Device name.
        device: String,
        /// GPU UUID.
        gpu: String,
        /// Product name.
        product: String,
        /// Compute capability major.
        major: u32,
        /// Compute capability minor.
        minor: u32,
    },
    /// A share under `--consumable-capacity mps` on a GPU without multi-user MPS.
    #[error(
        "device {device}: --consumable-capacity mps needs multi-user MPS (shares of different pods may run as different users, and a single-user MPS server makes a client of another user wait without an error), which needs compute capability 7.0 (Volta) or newer; GPU {gpu} ({product}) has compute capability {major}.{minor}; run this node with --consumable-capacity time-slicing or off"
    )]
    ShareNeedsMultiUser {
        /// Device name.
        device: String,
        /// GPU UUID.
        gpu: String,
        /// Product name.
        product: String,
        /// Compute capability major.
        major: u32,
        /// Compute capability minor.
        minor: u32,
    },
    /// Devices of one claim ask for different MPS thread percentages or multi-user modes
    /// (one daemon per claim).
    #[error(
        "claim {claim}: its MPS devices ask for different {field} values ({values}); a claim has one MPS daemon, so they must agree"
    )]
    MixedMpsSettings {
        /// Claim UID.
        claim: String,
        /// `activeThreadPercentage` or `multiUser`.
        field: &'static str,
        /// The values found.
        values: String,
    },
    /// A claim mixes MPS with time-slicing.
    #[error(
        "claim {claim}: mixes strategy MPS with TimeSlicing; every container of the claim gets the MPS client settings, so use one claim per strategy"
    )]
    MixedStrategies {
        /// Claim UID.
        claim: String,
    },
    /// A pinned memory limit exceeds the device's memory.
    #[error(
        "device {device} ({uuid}): pinned memory limit {limit} ({bytes} bytes) is larger than the device's memory ({memory} bytes)"
    )]
    LimitTooLarge {
        /// Device name.
        device: String,
        /// Device UUID.
        uuid: String,
        /// The limit as written.
        limit: String,
        /// The limit in bytes.
        bytes: u64,
        /// The device's memory in bytes.
        memory: u64,
    },
    /// A pinned memory limit below 1 MiB (the control daemon's unit).
    #[error(
        "device {device} ({uuid}): pinned memory limit {limit} is below 1Mi, the smallest limit MPS takes"
    )]
    LimitTooSmall {
        /// Device name.
        device: String,
        /// Device UUID.
        uuid: String,
        /// The limit as written.
        limit: String,
    },
    /// Another recorded claim needs a different time slice on the same GPU.
    #[error(
        "GPU {gpu}: claim {claim} asks for time slice {interval}, but another claim on the same GPU needs {other_interval}"
    )]
    TimeSliceConflict {
        /// GPU UUID.
        gpu: String,
        /// Claim UID.
        claim: String,
        /// Interval asked for.
        interval: TimeSliceInterval,
        /// The other claim's UID (not in the message: it may be another tenant's).
        other_claim: String,
        /// Its interval.
        other_interval: TimeSliceInterval,
    },
    /// The GPU does not support compute-policy time slices (`nvidia-smi` said `Not
    /// Supported`, exit status 3; Pascal GPUs such as the Tesla P4 do this).
    #[error(
        "GPU {gpu}: time slice {interval} is not supported on this GPU (nvidia-smi compute-policy: {output}); use a GPU that supports compute-policy time slices, or timeSlicing.interval Default"
    )]
    TimeSliceNotSupported {
        /// GPU UUID.
        gpu: String,
        /// The interval asked for.
        interval: TimeSliceInterval,
        /// What `nvidia-smi` printed.
        output: String,
    },
    /// `nvidia-smi` failed.
    #[error("{} {args}: {message}", tool.display())]
    Tool {
        /// The tool run.
        tool: PathBuf,
        /// Its arguments.
        args: String,
        /// Exit status and output.
        message: String,
    },
    /// Starting a claim's MPS control daemon failed.
    #[error("claim {claim}: starting MPS control daemon {}: {message}", tool.display())]
    DaemonStart {
        /// Claim UID.
        claim: String,
        /// The control tool.
        tool: PathBuf,
        /// What failed.
        message: String,
    },
    /// The daemon did not answer in time after it started.
    #[error("claim {claim}: MPS control daemon did not answer within {waited:?} (last: {last})")]
    DaemonNotReady {
        /// Claim UID.
        claim: String,
        /// How long it was given.
        waited: Duration,
        /// The last failure.
        last: String,
    },
    /// A command to a daemon failed.
    #[error("claim {claim}: MPS control command `{command}`: {message}")]
    DaemonControl {
        /// Claim UID.
        claim: String,
        /// The command(s) sent.
        command: String,
        /// What failed.
        message: String,
    },
    /// The daemon did not take the limits: a value read back differs from what was set, or
    /// a set was rejected (the control UI still exits 0 then).
    #[error("claim {claim}: the MPS control daemon did not take the claim's limits: {problem}")]
    DaemonRejected {
        /// Claim UID.
        claim: String,
        /// Which value differs, with the daemon's answers.
        problem: String,
    },
    /// A daemon could not be stopped.
    #[error("stopping MPS control daemon {daemon}: {message}")]
    DaemonStop {
        /// Which daemon: `PID <pid>` or `pod <namespace>/<name>`.
        daemon: String,
        /// What failed.
        message: String,
    },
    /// The claim's MPS control socket path does not fit in a unix socket address.
    #[error(
        "claim {claim}: MPS control socket {} would be {len} bytes, longer than the {max} a unix socket path may have; use a shorter state (kubelet plugins) directory", path.display(), max = mps::MAX_SOCKET_PATH
    )]
    PipeDirTooLong {
        /// Claim UID.
        claim: String,
        /// The socket path.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
    /// A file operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// `creating`, `reading`, …
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A daemon record does not decode.
    #[error("MPS daemon record {path}: {message}")]
    Record {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A claim UID that cannot name a directory (it would leave the MPS directory).
    #[error(transparent)]
    InvalidClaim(#[from] crate::cdi::CdiError),
}

/// Paths of the two tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharingBinaries {
    /// `nvidia-cuda-mps-control`.
    pub mps_control: PathBuf,
    /// `nvidia-smi`.
    pub nvidia_smi: PathBuf,
}

impl SharingBinaries {
    /// The tools under a driver root as this process sees it: the first of
    /// `usr/bin/<tool>`, `bin/<tool>` that exists (else the `usr/bin` path, so that an error
    /// names where the tool was expected).
    pub fn under_driver_root(root: &Path) -> Self {
        let find = |tool: &str| {
            crate::driver_root::BINARY_DIRS
                .iter()
                .map(|dir| root.join(dir).join(tool))
                .find(|p| p.is_file())
                .unwrap_or_else(|| root.join("usr/bin").join(tool))
        };
        Self {
            mps_control: find(MPS_CONTROL_TOOL),
            nvidia_smi: find(NVIDIA_SMI_TOOL),
        }
    }

    /// Replaces the tools given explicitly (`--mps-control-bin`, `--nvidia-smi-bin`).
    pub fn with_overrides(
        mut self,
        mps_control: Option<PathBuf>,
        nvidia_smi: Option<PathBuf>,
    ) -> Self {
        if let Some(p) = mps_control {
            self.mps_control = p;
        }
        if let Some(p) = nvidia_smi {
            self.nvidia_smi = p;
        }
        self
    }
}

/// Settings of the sharing manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharingConfig {
    /// State directory, `<plugins dir>/<driver name>` (holds `checkpoint.json` and `mps/`).
    pub state_dir: PathBuf,
    /// The same directory as the container runtime on the host sees it, when it differs
    /// (CDI mount sources are host paths). `None`: same as `state_dir`.
    pub host_state_dir: Option<PathBuf>,
    /// The tools.
    pub binaries: SharingBinaries,
    /// File with the kernel boot ID.
    pub boot_id_path: PathBuf,
    /// Where containers see the pipe directory.
    pub container_pipe_dir: String,
    /// Short directory under which each daemon's pipe directory lives
    /// (`<root>/<16 hex digits>`), seen at the same path by the host, the plugin and daemon
    /// pods, so that the control sockets' paths fit a unix socket address (107 bytes)
    /// whatever the kubelet root. `None`: `<state dir>/mps/<claim>/pipe` (tests, old layout).
    pub pipe_root: Option<PathBuf>,
    /// How long a new daemon may take to start and answer.
    pub ready_timeout: Duration,
    /// How long a daemon may take to exit after `quit` (then after SIGTERM) before it is killed.
    pub stop_timeout: Duration,
    /// Deadline of one `nvidia-smi` or control command.
    pub command_timeout: Duration,
    /// Environment added to every tool run (tests set the fakes' knobs here).
    pub extra_env: Vec<(String, String)>,
}

impl SharingConfig {
    /// Defaults: host boot ID, pipe directory `/tmp/nvidia-mps` in containers, 10 s to get
    /// ready, 5 s to stop, 10 s per command.
    pub fn new(state_dir: impl Into<PathBuf>, binaries: SharingBinaries) -> Self {
        Self {
            state_dir: state_dir.into(),
            host_state_dir: None,
            binaries,
            boot_id_path: PathBuf::from(DEFAULT_BOOT_ID_PATH),
            container_pipe_dir: mps::DEFAULT_CONTAINER_PIPE_DIR.to_owned(),
            pipe_root: None,
            ready_timeout: Duration::from_secs(10),
            stop_timeout: Duration::from_secs(5),
            command_timeout: Duration::from_secs(10),
            extra_env: Vec::new(),
        }
    }

    /// `<state dir>/mps`.
    pub fn mps_dir(&self) -> PathBuf {
        self.state_dir.join(mps::MPS_DIR)
    }
}

/// What a claim's sharing state in the checkpoint holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SharingState {
    /// The claim's MPS daemon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<MpsRecord>,
    /// Time slices set for the claim.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub time_slicing: Vec<TimeSliceSetting>,
}

/// Where the time of the last MPS start went (for benchmarks and metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MpsTimings {
    /// Directories, record and compute modes.
    pub setup: Duration,
    /// Launching the daemon until its PID is known.
    pub launch: Duration,
    /// From the PID until the daemon answered.
    pub ready: Duration,
    /// Setting and checking the limits, writing the record.
    pub limits: Duration,
    /// The whole start.
    pub total: Duration,
}

/// What [`SharingManager::reconcile`] did, by claim UID.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Live claims whose daemon runs and answers.
    pub kept: Vec<String>,
    /// Live claims whose daemon was gone and was started again.
    pub restarted: Vec<String>,
    /// Claims that are gone; their daemons were stopped and directories removed.
    pub stopped: Vec<String>,
    /// Claims where something failed, with the message.
    pub failed: Vec<(String, String)>,
}

/// Applies and releases sharing for claims; see the module docs. Calls are serialised.
pub struct SharingManager {
    config: SharingConfig,
    launcher: Arc<dyn DaemonLauncher>,
    smi: NvidiaSmi,
    ops: Mutex<()>,
    last_timings: Mutex<Option<MpsTimings>>,
}

impl std::fmt::Debug for SharingManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharingManager")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The pipe directory of daemon `key` of the driver whose state directory is `state_dir`,
/// under `pipe_root`: `<pipe_root>/<first 16 hex digits of SHA-256(state_dir, 0, key)>`.
pub fn pipe_dir_under(pipe_root: &Path, state_dir: &Path, key: &str) -> PathBuf {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(state_dir.as_os_str().as_encoded_bytes());
    h.update([0]);
    h.update(key.as_bytes());
    let digest = hex::encode(h.finalize());
    pipe_root.join(&digest[..16])
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One MPS device of a claim, planned.
struct PlannedMps<'a> {
    device: &'a SharingDevice,
    config: MpsConfig,
}

impl SharingManager {
    /// A manager launching daemons as host processes ([`ProcessLauncher`]).
    pub fn new(config: SharingConfig) -> Self {
        let launcher = ProcessLauncher::new(
            &config.binaries.mps_control,
            config.extra_env.clone(),
            &config.boot_id_path,
        );
        Self::with_launcher(config, Arc::new(launcher))
    }

    /// A manager with its own daemon launcher.
    pub fn with_launcher(config: SharingConfig, launcher: Arc<dyn DaemonLauncher>) -> Self {
        let smi = NvidiaSmi::new(
            &config.binaries.nvidia_smi,
            config.extra_env.clone(),
            config.command_timeout,
        );
        Self {
            config,
            launcher,
            smi,
            ops: Mutex::new(()),
            last_timings: Mutex::new(None),
        }
    }

    /// The settings.
    pub fn config(&self) -> &SharingConfig {
        &self.config
    }

    /// `<state dir>/mps/<claim UID>`.
    pub fn claim_dir(&self, claim_uid: &str) -> PathBuf {
        self.config.mps_dir().join(claim_uid)
    }

    /// Where the time of the last successful MPS start went.
    pub fn last_mps_timings(&self) -> Option<MpsTimings> {
        *lock(&self.last_timings)
    }

    /// The short pipe directory of the daemon `key` under the pipe root, if one is set: its
    /// name is the first 16 hex digits of SHA-256 over the state directory and the key, so
    /// two drivers on one node never meet.
    pub fn short_pipe_dir(&self, key: &str) -> Option<PathBuf> {
        let root = self.config.pipe_root.as_ref()?;
        Some(pipe_dir_under(root, &self.config.state_dir, key))
    }

    /// Removes the daemon `key`'s directories: its state directory and its short pipe
    /// directory.
    fn remove_daemon_dirs(&self, key: &str) -> Result<(), SharingFailure> {
        if let Some(pipe) = self.short_pipe_dir(key) {
            remove_dir(&pipe)?;
        }
        remove_dir(&self.claim_dir(key))
    }

    fn spec(&self, claim_uid: &str, devices: Vec<String>) -> DaemonSpec {
        let dir = self.claim_dir(claim_uid);
        DaemonSpec {
            claim_uid: claim_uid.to_owned(),
            pipe_dir: self
                .short_pipe_dir(claim_uid)
                .unwrap_or_else(|| dir.join("pipe")),
            log_dir: dir.join("log"),
            visible_devices: devices,
            multi_user: false,
        }
    }

    fn host_pipe_dir(&self, claim_uid: &str) -> PathBuf {
        if let Some(short) = self.short_pipe_dir(claim_uid) {
            return short;
        }
        let base = self
            .config
            .host_state_dir
            .as_ref()
            .unwrap_or(&self.config.state_dir);
        base.join(mps::MPS_DIR).join(claim_uid).join("pipe")
    }

    /// Sets up sharing for the claim's `devices` and returns the CDI edits and the state to
    /// record. Everything is checked before anything changes; on failure nothing of this
    /// call is left behind. Calling it again with the same devices and settings while the
    /// daemon runs changes nothing and returns the same edits. `needs`: the time slices the
    /// recorded claims ask for (a conflict with another claim's is refused).
    pub fn apply_claim(
        &self,
        claim_uid: &str,
        devices: &[SharingDevice],
        needs: &[TimeSliceNeed],
    ) -> Result<SharingEdits, SharingFailure> {
        crate::cdi::validate_claim_uid(claim_uid)?;
        let _ops = lock(&self.ops);
        let mut mps_devices = Vec::new();
        let mut ts_devices = Vec::new();
        for d in devices {
            match d.sharing.strategy {
                SharingStrategy::Mps => mps_devices.push(PlannedMps {
                    device: d,
                    config: d.sharing.mps.clone().unwrap_or_default(),
                }),
                SharingStrategy::TimeSlicing => ts_devices.push((
                    d,
                    d.sharing
                        .time_slicing
                        .as_ref()
                        .map(|t| t.interval_or_default())
                        .unwrap_or_default(),
                )),
            }
        }
        if !mps_devices.is_empty() && !ts_devices.is_empty() {
            return Err(SharingFailure::MixedStrategies {
                claim: claim_uid.to_owned(),
            });
        }

        // Check everything first.
        let mps_plan = if mps_devices.is_empty() {
            None
        } else {
            Some(self.plan_mps(claim_uid, &mps_devices)?)
        };
        let ts_plan = self.plan_timeslices(claim_uid, &ts_devices, needs)?;

        // Then act.
        let mut state = SharingState::default();
        for (i, setting) in ts_plan.iter().enumerate() {
            if let Err(e) = self.smi.set_timeslice(&setting.gpu_uuid, setting.interval) {
                self.restore_timeslices(claim_uid, &ts_plan[..i], needs);
                return Err(e);
            }
        }
        state.time_slicing = ts_plan;
        let mut edits = SharingEdits::default();
        if let Some(plan) = mps_plan {
            let record = match self.start_mps(plan) {
                Ok(r) => r,
                Err(e) => {
                    self.restore_timeslices(claim_uid, &state.time_slicing, needs);
                    return Err(e);
                }
            };
            edits.claim_edits = self.client_edits(&record);
            state.mps = Some(record);
        }
        edits.state = serde_json::to_value(&state).ok();
        Ok(edits)
    }

    /// Undoes [`Self::apply_claim`]: stops the claim's daemon (`quit`, then signals), restores
    /// compute modes and time slices no other recorded claim needs, removes the claim's MPS
    /// directory. Idempotent; works from the files on disk and the recorded `needs` when
    /// `state` is missing (a prepare interrupted before its state was recorded).
    pub fn release_claim(
        &self,
        claim_uid: &str,
        state: Option<&serde_json::Value>,
        needs: &[TimeSliceNeed],
    ) -> Result<(), SharingFailure> {
        crate::cdi::validate_claim_uid(claim_uid)?;
        let _ops = lock(&self.ops);
        let state: SharingState = state
            .and_then(|v| serde_json::from_value(v.clone()).ok())
            .unwrap_or_default();
        let dir = self.claim_dir(claim_uid);
        let record = match mps::load_record(&dir) {
            Ok(r) => r.or(state.mps.clone()),
            Err(e) => {
                tracing::warn!(claim = claim_uid, error = %e, "daemon record unreadable; using the checkpoint's");
                state.mps.clone()
            }
        };
        if let Some(record) = record {
            self.stop_mps(&record)?;
        } else if dir.exists() {
            // Directories without a record: a start interrupted before its first write.
            let spec = self.spec(claim_uid, Vec::new());
            if let Some(handle) = self.launcher.find(&spec) {
                self.stop_daemon(&spec, &handle)?;
            }
            self.remove_daemon_dirs(claim_uid)?;
        }

        // Time slices: what the state says, plus what the claim's recorded configs ask for.
        let mut set: Vec<TimeSliceSetting> = state.time_slicing;
        for need in needs {
            if need.claim_uid == claim_uid && !set.iter().any(|s| s.gpu_uuid == need.gpu_uuid) {
                set.push(TimeSliceSetting {
                    gpu_uuid: need.gpu_uuid.clone(),
                    interval: need.interval,
                });
            }
        }
        let mut first_error = None;
        for s in &set {
            if let Err(e) = self.restore_timeslice(claim_uid, s, needs) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// After a restart: keeps the daemons of `live_claims` that run and answer, starts again
    /// those that died (with their recorded settings), and stops daemons of claims not in
    /// `live_claims`, removing their directories. Failures are reported per claim.
    pub fn reconcile(&self, live_claims: &BTreeSet<String>) -> ReconcileReport {
        let _ops = lock(&self.ops);
        let mut report = ReconcileReport::default();
        let mut uids: Vec<String> = std::fs::read_dir(self.config.mps_dir())
            .map(|entries| {
                entries
                    .flatten()
                    .filter(|e| e.path().is_dir())
                    .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                    .filter(|uid| crate::cdi::validate_claim_uid(uid).is_ok())
                    .collect()
            })
            .unwrap_or_default();
        uids.sort();
        // Daemons no directory names any more (state directory reset): only the launcher
        // can still find them. Live claims and directories that failed to reconcile keep
        // theirs.
        let mut keep: BTreeSet<String> = live_claims.clone();
        keep.extend(uids.iter().cloned());
        for uid in self.launcher.sweep(&keep) {
            report.stopped.push(uid);
        }
        for uid in uids {
            let dir = self.claim_dir(&uid);
            let record = match mps::load_record(&dir) {
                Ok(r) => r,
                Err(e) => {
                    report.failed.push((uid, e.to_string()));
                    continue;
                }
            };
            let result = if live_claims.contains(&uid) {
                match record {
                    Some(record) => self.keep_or_restart(&dir, record).map(|restarted| {
                        if restarted {
                            report.restarted.push(uid.clone());
                        } else {
                            report.kept.push(uid.clone());
                        }
                    }),
                    None => Err(SharingFailure::Record {
                        path: dir.join(mps::RECORD_FILE),
                        message: "missing for a live claim".into(),
                    }),
                }
            } else {
                let stopped = match record {
                    Some(record) => self.stop_mps(&record),
                    None => {
                        let spec = self.spec(&uid, Vec::new());
                        match self.launcher.find(&spec) {
                            Some(h) => self.stop_daemon(&spec, &h),
                            None => Ok(()),
                        }
                        .and_then(|()| self.remove_daemon_dirs(&uid))
                    }
                };
                stopped.map(|()| report.stopped.push(uid.clone()))
            };
            if let Err(e) = result {
                tracing::warn!(claim = %uid, error = %e, "reconciling MPS daemon");
                report.failed.push((uid, e.to_string()));
            }
        }
        report
    }

    fn keep_or_restart(&self, dir: &Path, mut record: MpsRecord) -> Result<bool, SharingFailure> {
        if let Some(handle) = &record.daemon
            && self.launcher.is_running(handle)
            && self.answers(&record.spec)
        {
            return Ok(false);
        }
        tracing::info!(claim = %record.spec.claim_uid, "MPS daemon of a live claim is gone; starting it again");
        record.daemon = None;
        mps::create_dirs(dir, &record.spec)?;
        for gpu in &record.exclusive_gpus {
            self.smi
                .set_compute_mode(gpu, ComputeMode::ExclusiveProcess)?;
        }
        self.launch_and_configure(dir, &mut record)?;
        Ok(true)
    }

    /// True if the daemon of `spec` answers the readiness query right now.
    fn answers(&self, spec: &DaemonSpec) -> bool {
        self.launcher
            .control(spec, mps::READY_QUERY, self.config.command_timeout)
            .is_ok_and(|a| mps::parse_percentage(&a).is_some())
    }

    fn plan_mps(
        &self,
        claim_uid: &str,
        devices: &[PlannedMps<'_>],
    ) -> Result<MpsRecord, SharingFailure> {
        let percentages: BTreeSet<u8> = devices
            .iter()
            .map(|d| d.config.active_thread_percentage_or_default())
            .collect();
        let Some(&pct) = percentages.first().filter(|_| percentages.len() == 1) else {
            return Err(SharingFailure::MixedMpsSettings {
                claim: claim_uid.to_owned(),
                field: "activeThreadPercentage",
                values: percentages
                    .iter()
                    .map(u8::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        };
        let modes: BTreeSet<bool> = devices
            .iter()
            .map(|d| d.config.multi_user_or_default())
            .collect();
        if modes.len() > 1 {
            return Err(SharingFailure::MixedMpsSettings {
                claim: claim_uid.to_owned(),
                field: "multiUser",
                values: "false, true".to_owned(),
            });
        }
        let multi_user = modes.contains(&true);
        let mut limits = Vec::new();
        let mut exclusive = Vec::new();
        for (ordinal, planned) in (0u32..).zip(devices) {
            let d = planned.device;
            let gpu: &GpuFacts = d.gpu.as_ref().ok_or_else(|| SharingFailure::UnknownGpu {
                gpu: d.gpu_uuid.clone(),
            })?;
            if multi_user && gpu.compute_capability < MPS_MIN_COMPUTE_CAPABILITY {
                return Err(SharingFailure::MultiUserUnsupported {
                    device: d.device_name.clone(),
                    gpu: gpu.uuid.clone(),
                    product: gpu.product_name.clone(),
                    major: gpu.compute_capability.0,
                    minor: gpu.compute_capability.1,
                });
            }
            if gpu.compute_capability < MPS_MIN_COMPUTE_CAPABILITY {
                return Err(SharingFailure::MpsUnsupported {
                    device: d.device_name.clone(),
                    gpu: gpu.uuid.clone(),
                    product: gpu.product_name.clone(),
                    major: gpu.compute_capability.0,
                    minor: gpu.compute_capability.1,
                });
            }
            if let Some(limit) = planned
                .config
                .pinned_memory_limit
                .as_ref()
                .and_then(|l| l.limit_for(&d.uuid, ordinal))
            {
                let bytes = u64::try_from(limit.value()).unwrap_or(0);
                if let Some(memory) = gpu.device_memory_bytes
                    && bytes > memory
                {
                    return Err(SharingFailure::LimitTooLarge {
                        device: d.device_name.clone(),
                        uuid: d.uuid.clone(),
                        limit: limit.to_string(),
                        bytes,
                        memory,
                    });
                }
                let text =
                    mps::format_limit(bytes).ok_or_else(|| SharingFailure::LimitTooSmall {
                        device: d.device_name.clone(),
                        uuid: d.uuid.clone(),
                        limit: limit.to_string(),
                    })?;
                limits.push(PinnedLimit {
                    ordinal,
                    uuid: d.uuid.clone(),
                    limit: text,
                });
            }
            // Compute modes are per GPU; MIG devices have none of their own, and nvidia-smi
            // refuses `-c` on a MIG-enabled GPU ("Setting compute mode to %s is not supported
            // on a MIG-enabled device."), so such a GPU is never asked.
            let mig_enabled = gpu.mig_enabled;
            if mig_enabled {
                tracing::debug!(device = %d.device_name, gpu = %gpu.uuid, "MIG-enabled GPU: compute mode left alone");
            }
            if d.uuid.starts_with("GPU-") && !mig_enabled && !exclusive.contains(&d.uuid) {
                exclusive.push(d.uuid.clone());
            }
        }
        let uuids = devices.iter().map(|d| d.device.uuid.clone()).collect();
        let mut spec = self.spec(claim_uid, uuids);
        spec.multi_user = multi_user;
        if let Some(len) = mps::socket_path_too_long(&spec.pipe_dir, mps::CONTROL_SOCKET) {
            return Err(SharingFailure::PipeDirTooLong {
                claim: claim_uid.to_owned(),
                path: spec.pipe_dir.join(mps::CONTROL_SOCKET),
                len,
            });
        }
        Ok(MpsRecord {
            spec,
            host_pipe_dir: self.host_pipe_dir(claim_uid),
            active_thread_percentage: pct,
            pinned_limits: limits,
            exclusive_gpus: exclusive,
            daemon: None,
        })
    }

    fn plan_timeslices(
        &self,
        claim_uid: &str,
        devices: &[(&SharingDevice, TimeSliceInterval)],
        needs: &[TimeSliceNeed],
    ) -> Result<Vec<TimeSliceSetting>, SharingFailure> {
        let mut plan: Vec<TimeSliceSetting> = Vec::new();
        if devices.is_empty() {
            return Ok(plan);
        }
        for (d, interval) in devices {
            if d.kind == DeviceKind::Mig || d.uuid.starts_with("MIG-") {
                // nvidia-smi compute-policy does not support MIG: a MIG device runs in its
                // parent GPU's time slice. The claim is served; the interval is not applied.
                if *interval == TimeSliceInterval::Default {
                    tracing::debug!(device = %d.device_name, "MIG device keeps its parent GPU's time slice");
                } else {
                    tracing::warn!(device = %d.device_name, uuid = %d.uuid, interval = %interval, "time slice not applied: a MIG device runs in its parent GPU's time slice (nvidia-smi compute-policy does not support MIG)");
                }
                continue;
            }
            if let Some(other) = needs.iter().find(|n| {
                n.claim_uid != claim_uid && n.gpu_uuid == d.uuid && n.interval != *interval
            }) {
                return Err(SharingFailure::TimeSliceConflict {
                    gpu: d.uuid.clone(),
                    claim: claim_uid.to_owned(),
                    interval: *interval,
                    other_claim: other.claim_uid.clone(),
                    other_interval: other.interval,
                });
            }
            if !plan.iter().any(|s| s.gpu_uuid == d.uuid) {
                plan.push(TimeSliceSetting {
                    gpu_uuid: d.uuid.clone(),
                    interval: *interval,
                });
            }
        }
        Ok(plan)
    }

    /// Restores the default slice on `setting`'s GPU unless another claim of `needs` still
    /// needs a non-default one there.
    fn restore_timeslice(
        &self,
        claim_uid: &str,
        setting: &TimeSliceSetting,
        needs: &[TimeSliceNeed],
    ) -> Result<(), SharingFailure> {
        if setting.interval == TimeSliceInterval::Default {
            return Ok(());
        }
        let still_needed = needs.iter().find(|n| {
            n.claim_uid != claim_uid
                && n.gpu_uuid == setting.gpu_uuid
                && n.interval != TimeSliceInterval::Default
        });
        if let Some(n) = still_needed {
            tracing::info!(gpu = %setting.gpu_uuid, other = %n.claim_uid, "time slice still needed by another claim; kept");
            return Ok(());
        }
        self.smi
            .set_timeslice(&setting.gpu_uuid, TimeSliceInterval::Default)
    }

    /// Best-effort rollback of time slices set by a failing apply.
    fn restore_timeslices(
        &self,
        claim_uid: &str,
        settings: &[TimeSliceSetting],
        needs: &[TimeSliceNeed],
    ) {
        for s in settings {
            if let Err(e) = self.restore_timeslice(claim_uid, s, needs) {
                tracing::error!(gpu = %s.gpu_uuid, error = %e, "rolling back a time slice");
            }
        }
    }

    /// Starts (or finds running with the same settings) the daemon of `plan`.
    fn start_mps(&self, mut record: MpsRecord) -> Result<MpsRecord, SharingFailure> {
        let started = Instant::now();
        let dir = self.claim_dir(&record.spec.claim_uid);
        if let Some(existing) = mps::load_record(&dir).ok().flatten() {
            if existing.same_settings(&record)
                && existing
                    .daemon
                    .as_ref()
                    .is_some_and(|h| self.launcher.is_running(h))
                && self.answers(&existing.spec)
            {
                tracing::debug!(claim = %record.spec.claim_uid, "MPS daemon already runs with these settings");
                return Ok(existing);
            }
            self.stop_mps(&existing)?;
        } else if dir.exists() {
            // Leftovers without a record.
            let spec = self.spec(&record.spec.claim_uid, Vec::new());
            if let Some(h) = self.launcher.find(&spec) {
                self.stop_daemon(&spec, &h)?;
            }
            self.remove_daemon_dirs(&record.spec.claim_uid)?;
        }

        let result = (|| {
            mps::create_dirs(&dir, &record.spec)?;
            mps::store_record(&dir, &record)?;
            crate::fault::point("mps.after_record");
            for gpu in &record.exclusive_gpus {
                self.smi
                    .set_compute_mode(gpu, ComputeMode::ExclusiveProcess)?;
                crate::fault::point("mps.after_compute_mode");
            }
            let setup = started.elapsed();
            let mut timings = self.launch_and_configure(&dir, &mut record)?;
            timings.setup = setup;
            timings.total = started.elapsed();
            *lock(&self.last_timings) = Some(timings);
            Ok(())
        })();
        match result {
            Ok(()) => {
                tracing::info!(
                    claim = %record.spec.claim_uid,
                    daemon = %record.daemon.as_ref().map(DaemonHandle::describe).unwrap_or_default(),
                    devices = %record.spec.visible_devices.join(","),
                    "MPS control daemon ready"
                );
                Ok(record)
            }
            Err(e) => {
                if let Err(cleanup) = self.stop_mps(&record) {
                    tracing::error!(error = %cleanup, "cleaning up after a failed MPS start");
                }
                Err(e)
            }
        }
    }

    /// Launches the daemon of `record`, waits until it answers, sets and checks the limits,
    /// and records the daemon.
    fn launch_and_configure(
        &self,
        dir: &Path,
        record: &mut MpsRecord,
    ) -> Result<MpsTimings, SharingFailure> {
        let claim = record.spec.claim_uid.clone();
        let t0 = Instant::now();
        let deadline = t0 + self.config.ready_timeout;
        let handle = self
            .launcher
            .start(&record.spec, self.config.ready_timeout)?;
        crate::fault::point("mps.after_launch");
        record.daemon = Some(handle);
        mps::store_record(dir, record)?;
        let launch = t0.elapsed();

        let t1 = Instant::now();
        let mut last = String::from("no attempt");
        let ready = process::poll_until(deadline.saturating_duration_since(Instant::now()), || {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            let timeout = left.min(self.config.command_timeout);
            match self
                .launcher
                .control(&record.spec, mps::READY_QUERY, timeout)
            {
                Ok(answer) if mps::parse_percentage(&answer).is_some() => Some(()),
                Ok(answer) => {
                    last = answer.trim().to_owned();
                    None
                }
                Err(e) => {
                    last = e.to_string();
                    None
                }
            }
        });
        if ready.is_none() {
            return Err(SharingFailure::DaemonNotReady {
                claim,
                waited: self.config.ready_timeout,
                last,
            });
        }
        let ready = t1.elapsed();
        crate::fault::point("mps.after_ready");

        let t2 = Instant::now();
        let answer = self.launcher.control(
            &record.spec,
            &record.limit_commands(),
            self.config.command_timeout,
        )?;
        record
            .check_limit_answer(&answer)
            .map_err(|problem| SharingFailure::DaemonRejected { claim, problem })?;
        tracing::debug!(claim = %record.spec.claim_uid, "MPS limits set and read back");
        Ok(MpsTimings {
            setup: Duration::ZERO,
            launch,
            ready,
            limits: t2.elapsed(),
            total: Duration::ZERO,
        })
    }

    /// Asks the daemon to quit, waits, kills it if it did not exit, then lets the launcher
    /// remove what is left (its pod).
    fn stop_daemon(&self, spec: &DaemonSpec, handle: &DaemonHandle) -> Result<(), SharingFailure> {
        if self.launcher.is_running(handle) {
            self.quit_daemon(spec, handle)?;
        }
        self.launcher.cleanup(spec, handle)
    }

    fn quit_daemon(&self, spec: &DaemonSpec, handle: &DaemonHandle) -> Result<(), SharingFailure> {
        if let Err(e) = self
            .launcher
            .control(spec, "quit\n", self.config.stop_timeout)
        {
            tracing::warn!(claim = %spec.claim_uid, error = %e, "MPS daemon did not take quit");
        }
        let gone = process::poll_until(self.config.stop_timeout, || {
            (!self.launcher.is_running(handle)).then_some(())
        });
        if gone.is_none() {
            tracing::warn!(claim = %spec.claim_uid, daemon = %handle.describe(), "MPS daemon did not exit after quit; killing it");
            self.launcher.kill(handle, self.config.stop_timeout)?;
        }
        Ok(())
    }

    /// Stops the daemon of `record`, restores compute modes, removes the claim directory.
    fn stop_mps(&self, record: &MpsRecord) -> Result<(), SharingFailure> {
        let handle = record
            .daemon
            .clone()
            .or_else(|| self.launcher.find(&record.spec));
        if let Some(h) = handle {
            self.stop_daemon(&record.spec, &h)?;
            crate::fault::point("mps.after_stop");
        }
        for gpu in &record.exclusive_gpus {
            // Kept on failure: the directory (and record) stay so that a retry restores it.
            self.smi.set_compute_mode(gpu, ComputeMode::Default)?;
            crate::fault::point("mps.after_compute_mode_restore");
        }
        if record.spec.pipe_dir != self.claim_dir(&record.spec.claim_uid).join("pipe") {
            remove_dir(&record.spec.pipe_dir)?;
        }
        remove_dir(&self.claim_dir(&record.spec.claim_uid))
    }

    /// Enforces the claim's `shares` (consumable capacity, mode `mps`): each device's shared
    /// daemon (multi-user, defaults unlimited) runs, started by the first share or found
    /// running, and each share's device gets its client limits. On failure nothing this
    /// call started is left running (a daemon other shares were using was not answering, so
    /// it is started again or stopped). `holders`: every recorded share (for the log).
    pub fn apply_shares_of(
        &self,
        claim_uid: &str,
        shares: &[ShareDevice],
        holders: &[ShareHolder],
    ) -> Result<SharingEdits, SharingFailure> {
        crate::cdi::validate_claim_uid(claim_uid)?;
        let _ops = lock(&self.ops);
        let mut edits = SharingEdits::default();
        for share in shares {
            let planned = self.plan_shared(share)?;
            let others = holders
                .iter()
                .filter(|h| h.claim_uid != claim_uid && h.device_name == share.device_name)
                .count();
            let record = self.start_mps(planned)?;
            tracing::info!(
                claim = claim_uid,
                device = %share.device_name,
                share = %share.share_id,
                other_shares = others,
                daemon = %record.daemon.as_ref().map(DaemonHandle::describe).unwrap_or_default(),
                "share served by the device's MPS daemon"
            );
            edits
                .device_edits
                .insert(share.device_name.clone(), self.share_edits(&record, share));
        }
        Ok(edits)
    }

    /// Undoes [`Self::apply_shares_of`] for the claim: the shared daemon of a device is
    /// stopped (compute mode restored, directory removed) only when no other claim of
    /// `holders` holds a share of it. Idempotent.
    pub fn release_shares_of(
        &self,
        claim_uid: &str,
        shares: &[ShareDevice],
        holders: &[ShareHolder],
    ) -> Result<(), SharingFailure> {
        crate::cdi::validate_claim_uid(claim_uid)?;
        let _ops = lock(&self.ops);
        for share in shares {
            let others: Vec<&str> = holders
                .iter()
                .filter(|h| h.claim_uid != claim_uid && h.device_name == share.device_name)
                .map(|h| h.claim_uid.as_str())
                .collect();
            if !others.is_empty() {
                tracing::info!(claim = claim_uid, device = %share.device_name, others = ?others, "other shares still use the device's MPS daemon; kept");
                continue;
            }
            let key = shared_daemon_key(&share.device_name);
            self.release_daemon_dir(&key)?;
            tracing::info!(claim = claim_uid, device = %share.device_name, "last share of the device released; its MPS daemon is stopped");
        }
        Ok(())
    }

    /// Stops the daemon recorded (or only found) under `mps/<key>` and removes the directory.
    fn release_daemon_dir(&self, key: &str) -> Result<(), SharingFailure> {
        let dir = self.claim_dir(key);
        match mps::load_record(&dir) {
            Ok(Some(record)) => self.stop_mps(&record),
            Ok(None) | Err(_) if dir.exists() => {
                let spec = self.spec(key, Vec::new());
                if let Some(handle) = self.launcher.find(&spec) {
                    self.stop_daemon(&spec, &handle)?;
                }
                self.remove_daemon_dirs(key)
            }
            _ => Ok(()),
        }
    }

    /// The shared daemon a share's device needs: multi-user, this device only, no limits
    /// of its own (each share's clients bring theirs).
    fn plan_shared(&self, share: &ShareDevice) -> Result<MpsRecord, SharingFailure> {
        let gpu: &GpuFacts = share
            .gpu
            .as_ref()
            .ok_or_else(|| SharingFailure::UnknownGpu {
                gpu: share.gpu_uuid.clone(),
            })?;
        // Multi-user MPS (all clients served by one root server) is what lets pods of
        // different users share the daemon; Volta or newer (NVIDIA MPS docs, "Architecture"
        // and "Troubleshooting"; kubernetes-sigs/dra-driver-nvidia-gpu refuses it below 7.0).
        if gpu.compute_capability < MPS_MIN_COMPUTE_CAPABILITY {
            return Err(SharingFailure::ShareNeedsMultiUser {
                device: share.device_name.clone(),
                gpu: gpu.uuid.clone(),
                product: gpu.product_name.clone(),
                major: gpu.compute_capability.0,
                minor: gpu.compute_capability.1,
            });
        }
        let key = shared_daemon_key(&share.device_name);
        crate::cdi::validate_claim_uid(&key)?;
        let mut spec = self.spec(&key, vec![share.uuid.clone()]);
        spec.multi_user = true;
        if let Some(len) = mps::socket_path_too_long(&spec.pipe_dir, mps::CONTROL_SOCKET) {
            return Err(SharingFailure::PipeDirTooLong {
                claim: key,
                path: spec.pipe_dir.join(mps::CONTROL_SOCKET),
                len,
            });
        }
        let exclusive = if share.uuid.starts_with("GPU-") && !gpu.mig_enabled {
            vec![share.uuid.clone()]
        } else {
            Vec::new()
        };
        Ok(MpsRecord {
            spec,
            host_pipe_dir: self.host_pipe_dir(&key),
            active_thread_percentage: 100,
            pinned_limits: Vec::new(),
            exclusive_gpus: exclusive,
            daemon: None,
        })
    }

    /// CDI edits of one share's device: the shared daemon's pipe directory (and `/dev/shm`)
    /// and the share's client limits. The memory limit is keyed by ordinal 0: the daemon
    /// runs with `CUDA_VISIBLE_DEVICES` = this device alone, so its clients enumerate it as
    /// device 0 (NVIDIA MPS docs, "Environment Variables": the daemon's
    /// `CUDA_VISIBLE_DEVICES` remaps the clients' devices), and NVIDIA's device plugin sets
    /// MPS memory limits by index because limits set by UUID were not applied
    /// (NVIDIA/k8s-device-plugin `CHANGELOG.md`, v0.15.0-rc.2).
    fn share_edits(&self, record: &MpsRecord, share: &ShareDevice) -> ContainerEdits {
        let pipe = &self.config.container_pipe_dir;
        let mut env = vec![
            format!("CUDA_MPS_PIPE_DIRECTORY={pipe}"),
            format!(
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={}",
                share.thread_percentage()
            ),
        ];
        if let Some(bytes) = share.memory_limit_bytes().filter(|b| *b >= 1 << 20) {
            env.push(format!(
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={}M",
                bytes >> 20
            ));
        }
        ContainerEdits {
            env,
            mounts: self.client_mounts(record),
            ..ContainerEdits::default()
        }
    }

    /// The pipe directory, and the daemon's `/dev/shm` when it has one, for clients.
    fn client_mounts(&self, record: &MpsRecord) -> Vec<Mount> {
        let options = || vec!["rw".into(), "nosuid".into(), "nodev".into(), "bind".into()];
        let mut mounts = vec![Mount {
            host_path: record.host_pipe_dir.display().to_string(),
            container_path: self.config.container_pipe_dir.clone(),
            options: options(),
        }];
        if let Some(shm) = record.daemon.as_ref().and_then(|d| d.shm_host_dir.as_ref()) {
            mounts.push(Mount {
                host_path: shm.display().to_string(),
                container_path: SHM_DIR.to_owned(),
                options: options(),
            });
        }
        mounts
    }

    /// CDI edits for every container of the claim: the pipe directory and the client env.
    fn client_edits(&self, record: &MpsRecord) -> ContainerEdits {
        let pipe = &self.config.container_pipe_dir;
        let mut env = vec![
            format!("CUDA_MPS_PIPE_DIRECTORY={pipe}"),
            format!(
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={}",
                record.active_thread_percentage
            ),
        ];
        if let Some(limits) = record.client_memory_limit() {
            env.push(format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={limits}"));
        }
        ContainerEdits {
            env,
            mounts: self.client_mounts(record),
            ..ContainerEdits::default()
        }
    }
}

fn remove_dir(dir: &Path) -> Result<(), SharingFailure> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(SharingFailure::Io {
            op: "removing",
            path: dir.to_owned(),
            source,
        }),
    }
}

impl SharingHandler for SharingManager {
    fn apply(
        &self,
        claim: &SharingClaim<'_>,
        devices: &[SharingDevice],
        needs: &[TimeSliceNeed],
    ) -> Result<SharingEdits, SharingError> {
        self.apply_claim(claim.uid, devices, needs)
            .map_err(|e| SharingError::Apply {
                claim: claim.uid.to_owned(),
                message: e.to_string(),
            })
    }

    fn release(
        &self,
        claim_uid: &str,
        state: Option<&serde_json::Value>,
        needs: &[TimeSliceNeed],
    ) -> Result<(), SharingError> {
        self.release_claim(claim_uid, state, needs)
            .map_err(|e| SharingError::Release {
                claim: claim_uid.to_owned(),
                message: e.to_string(),
            })
    }

    fn apply_shares(
        &self,
        claim: &SharingClaim<'_>,
        shares: &[ShareDevice],
        holders: &[ShareHolder],
    ) -> Result<SharingEdits, SharingError> {
        self.apply_shares_of(claim.uid, shares, holders)
            .map_err(|e| SharingError::Apply {
                claim: claim.uid.to_owned(),
                message: e.to_string(),
            })
    }

    fn release_shares(
        &self,
        claim_uid: &str,
        shares: &[ShareDevice],
        holders: &[ShareHolder],
    ) -> Result<(), SharingError> {
        self.release_shares_of(claim_uid, shares, holders)
            .map_err(|e| SharingError::Release {
                claim: claim_uid.to_owned(),
                message: e.to_string(),
            })
    }

    fn reconcile(&self, live_claims: &BTreeSet<String>) -> BTreeSet<String> {
        let report = SharingManager::reconcile(self, live_claims);
        if report.restarted.is_empty() && report.stopped.is_empty() && report.failed.is_empty() {
            tracing::debug!(kept = report.kept.len(), "MPS daemons checked");
        } else {
            tracing::info!(
                kept = report.kept.len(),
                restarted = report.restarted.len(),
                stopped = report.stopped.len(),
                failed = report.failed.len(),
                "reconciled MPS daemons"
            );
        }
        for (claim, error) in &report.failed {
            tracing::error!(claim = %claim, error = %error, "reconciling the MPS daemon failed");
        }
        report.restarted.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tools_are_found_under_the_driver_root_or_given() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("bin")).unwrap();
        std::fs::write(root.path().join("bin/nvidia-smi"), "").unwrap();
        let found = SharingBinaries::under_driver_root(root.path());
        assert_eq!(found.nvidia_smi, root.path().join("bin/nvidia-smi"));
        // Missing: the usual place, so that an error names where it was expected.
        assert_eq!(
            found.mps_control,
            root.path().join("usr/bin/nvidia-cuda-mps-control")
        );
        let given = found.with_overrides(Some("/opt/mps".into()), None);
        assert_eq!(given.mps_control, PathBuf::from("/opt/mps"));
        assert_eq!(given.nvidia_smi, root.path().join("bin/nvidia-smi"));
    }

    #[test]
    fn mount_source_is_the_host_view_of_the_state_dir() {
        let mut config = SharingConfig::new(
            "/var/lib/kubelet/plugins/gpu.cleave.dev",
            SharingBinaries::under_driver_root(Path::new("/")),
        );
        config.host_state_dir = Some("/host/plugins/gpu.cleave.dev".into());
        let m = SharingManager::new(config);
        assert_eq!(
            m.host_pipe_dir("uid-1"),
            PathBuf::from("/host/plugins/gpu.cleave.dev/mps/uid-1/pipe")
        );
        assert_eq!(
            m.spec("uid-1", vec![]).pipe_dir,
            PathBuf::from("/var/lib/kubelet/plugins/gpu.cleave.dev/mps/uid-1/pipe")
        );
    }
}
