//! The sharing seam: what prepare calls to share a device, and the strategies behind it.
//!
//! Prepare decodes and merges the claim's configs; for the devices whose effective config
//! has a `sharing` block it calls [`SharingHandler::apply`] after any MIG instance exists and
//! before the CDI spec is written, and puts the returned edits into the spec. Unprepare (and
//! the rollback of a failed or interrupted prepare) calls [`SharingHandler::release`] with the
//! state `apply` returned ([`SharingState`], as recorded in the checkpoint). A capacity share
//! goes to [`SharingHandler::apply_shares`] and [`SharingHandler::release_shares`] with every
//! share the checkpoint records ([`ShareHolder`]). Prepare owns the inventory and the
//! checkpoint and hands a strategy what it needs with every call: the facts of the GPU behind
//! each device ([`GpuFacts`]) and the time slices every recorded claim asks for
//! ([`TimeSliceNeed`]); a strategy keeps no backend and reads no checkpoint of its own.
//! [`NoopSharing`] accepts every strategy and sets nothing up.
//!
//! [`SharingManager`] implements the seam, one module per strategy, each owning its plan,
//! start, stop and CDI edits:
//!
//! - `per_claim`: a claim whose devices say `strategy: MPS` gets its own control daemon,
//!   limited to those devices, with a pipe directory mounted into the claim's containers
//!   only, the claim's thread and pinned-memory limits, and whole GPUs in
//!   `EXCLUSIVE_PROCESS` compute mode while it runs.
//! - `shared`: consumable capacity (`--consumable-capacity mps`): one multi-user daemon per
//!   shared device and claim namespace ([`shared_daemon_key`]), started by the namespace's
//!   first share and stopped after its last, each share's device with client limits from
//!   what it consumed. Tenants of different namespaces never share an MPS server, pipe
//!   directory or `/dev/shm`.
//! - `timeslice`: `nvidia-smi compute-policy --set-timeslice` on whole GPUs, restored to
//!   the default when no recorded claim needs another interval.
//!
//! Both MPS strategies run their daemons through `daemon` (start, readiness, limits, stop;
//! no client gets the `control_privileged` socket), [`mps`] (daemon spec, record, layout,
//! the [`DaemonLauncher`] seam) and a launcher: [`ProcessLauncher`] runs daemons as detached
//! host processes (local runs, tests); the kubelet plugin's pod launcher runs each in a pod
//! whose entry point is [`supervise`]. Daemons outlive plugin restarts; `reconcile` re-finds
//! them after one. The tools are found under the driver root or given ([`SharingBinaries`]).
//! A daemon's one record is `daemon.json` in its directory: the checkpoint's [`SharingState`]
//! names a claim's daemon by key only, and readers get the rest with [`daemon_record`].

mod config;
mod daemon;
mod error;
mod launcher;
mod manager;
pub mod mps;
mod per_claim;
mod process;
mod reconcile;
mod shared;
pub mod supervise;
#[cfg(test)]
mod tests;
mod timeslice;

use std::collections::{BTreeMap, BTreeSet};

use cleave_api::config::{DeviceKind, Sharing, SharingStrategy, TimeSliceInterval};
use cleave_api::names::{DeviceName, profile_label};
use serde::{Deserialize, Serialize};

use crate::cdi::ContainerEdits;
use crate::model::{GpuInfo, MigState};

pub use config::{
    MASK_SOURCE, MPS_CONTROL_TOOL, MPS_MIN_COMPUTE_CAPABILITY, NVIDIA_SMI_TOOL, PIPE_ROOT_MODE,
    SHM_DIR, SharingBinaries, SharingConfig, pipe_dir_under,
};
pub use error::SharingFailure;
pub use launcher::ProcessLauncher;
pub use manager::SharingManager;
pub use mps::{
    DaemonHandle, DaemonLauncher, DaemonPod, DaemonSpec, MpsRecord, MpsTimings, PinnedLimit,
    daemon_record,
};
pub use reconcile::ReconcileReport;
pub use shared::{legacy_shared_daemon_key, shared_daemon_key};
pub use timeslice::{ComputeMode, NvidiaSmi, TimeSliceSetting};

/// The claim whose devices are being shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharingClaim<'a> {
    /// Claim UID.
    pub uid: &'a str,
    /// Claim namespace.
    pub namespace: &'a str,
    /// Claim name.
    pub name: &'a str,
}

/// One device of the claim with a sharing config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharingDevice {
    /// Device name in the pool.
    pub device_name: String,
    /// Whole GPU or MIG device.
    pub kind: DeviceKind,
    /// UUID of the device (`GPU-…` or `MIG-…`).
    pub uuid: String,
    /// UUID of the (parent) GPU.
    pub gpu_uuid: String,
    /// The (parent) GPU as the driver's inventory knows it; `None` when the inventory has
    /// no GPU with `gpu_uuid` (even after a fresh discovery).
    pub gpu: Option<GpuFacts>,
    /// The effective sharing block (defaults applied, validated).
    pub sharing: Sharing,
}

/// What a sharing strategy needs to know about the GPU behind a device, taken from the
/// driver's inventory (discovered through NVML).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuFacts {
    /// GPU UUID.
    pub uuid: String,
    /// NVML index.
    pub index: u32,
    /// Minor number (`/dev/nvidia<minor>`).
    pub minor: u32,
    /// Product name, for error messages.
    pub product_name: String,
    /// CUDA compute capability (major, minor).
    pub compute_capability: (u32, u32),
    /// Memory of the device in bytes: the GPU's, or its MIG profile's for a MIG device;
    /// `None` when the MIG profile is not known.
    pub device_memory_bytes: Option<u64>,
    /// Streaming multiprocessors of the GPU, when NVML reports them.
    pub multiprocessors: Option<u32>,
    /// MIG mode is on: the GPU has no compute mode of its own to set (`nvidia-smi -c` is
    /// refused on a MIG-enabled GPU).
    pub mig_enabled: bool,
}

impl GpuFacts {
    /// The facts of `gpu` for the device `device_name` on it.
    pub fn of(gpu: &GpuInfo, device_name: &str) -> Self {
        let device_memory_bytes = match device_name.parse::<DeviceName>() {
            Ok(DeviceName::Mig { profile, .. }) => match &gpu.mig {
                MigState::Enabled { profiles, .. } => profiles
                    .iter()
                    .find(|p| profile_label(&p.name) == profile)
                    .map(|p| p.memory_mib << 20),
                _ => None,
            },
            _ => Some(gpu.memory_bytes),
        };
        Self {
            uuid: gpu.uuid.clone(),
            index: gpu.index,
            minor: gpu.minor,
            product_name: gpu.product_name.clone(),
            compute_capability: gpu.cuda_compute_capability,
            device_memory_bytes,
            multiprocessors: gpu.multiprocessors,
            mig_enabled: matches!(gpu.mig, MigState::Enabled { .. }),
        }
    }
}

/// One share of a device held by the claim being prepared (consumable capacity).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareDevice {
    /// Device name in the pool.
    pub device_name: String,
    /// UUID of the device (`GPU-…` or `MIG-…`).
    pub uuid: String,
    /// UUID of the (parent) GPU.
    pub gpu_uuid: String,
    /// The (parent) GPU's facts; `None` when the inventory has no GPU with `gpu_uuid`.
    pub gpu: Option<GpuFacts>,
    /// Streaming multiprocessors of the device itself (the GPU's, or the MIG profile's),
    /// when known: what `multiprocessors` is published as.
    pub device_multiprocessors: Option<u32>,
    /// The allocation result's `shareID`.
    pub share_id: String,
    /// Consumed memory in bytes, when the allocation names it.
    pub memory_bytes: Option<u64>,
    /// Consumed multiprocessors, when the allocation names it.
    pub multiprocessors: Option<u32>,
    /// A stricter thread percentage asked for by an MPS config of the claim.
    pub client_thread_percentage: Option<u8>,
    /// A stricter pinned-memory limit (bytes) asked for by an MPS config of the claim.
    pub client_memory_bytes: Option<u64>,
}

impl ShareDevice {
    /// The pinned-memory limit of the share's clients: what it consumed, or the claim's
    /// stricter MPS limit.
    pub(crate) fn memory_limit_bytes(&self) -> Option<u64> {
        match (self.memory_bytes, self.client_memory_bytes) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` of the share: `floor(consumed SMs × 100 / device
    /// SMs)`, at least 1 and at most 100; 100 when either count is unknown.
    pub fn thread_percentage(&self) -> u8 {
        let consumed = match (self.multiprocessors, self.device_multiprocessors) {
            (Some(used), Some(total)) if total > 0 => {
                let pct = u64::from(used) * 100 / u64::from(total);
                u8::try_from(pct.clamp(1, 100)).unwrap_or(100)
            }
            _ => 100,
        };
        self.client_thread_percentage
            .map_or(consumed, |c| consumed.min(c.clamp(1, 100)))
    }

    /// True when the share consumed the whole device ([`takes_whole_device`]); false when
    /// the device's size is unknown.
    pub(crate) fn takes_whole_device(&self) -> bool {
        let device = Capacity {
            memory_bytes: self.gpu.as_ref().and_then(|g| g.device_memory_bytes),
            multiprocessors: self.device_multiprocessors,
        };
        takes_whole_device(
            Capacity {
                memory_bytes: self.memory_bytes,
                multiprocessors: self.multiprocessors,
            },
            device,
        )
    }
}

/// Memory and streaming multiprocessors of a device, or what a share of it consumed; each
/// `None` when unknown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capacity {
    /// Memory in bytes.
    pub memory_bytes: Option<u64>,
    /// Streaming multiprocessors.
    pub multiprocessors: Option<u32>,
}

impl Capacity {
    /// What the recorded share consumed.
    pub(crate) fn consumed_by(share: &ShareRecord) -> Self {
        Self {
            memory_bytes: share.memory_bytes,
            multiprocessors: share.multiprocessors,
        }
    }
}

/// The one rule for "this share is the whole device": it consumed all of the device's
/// memory (rounded down to 1Mi, as published) and all its SMs, which is what the scheduler
/// allocates to a claim that asks for no capacity. Such a share is served like a device
/// allocated whole: no MPS daemon, no limits, measured as the device alone. False when any
/// of the four sizes is unknown.
pub(crate) fn takes_whole_device(used: Capacity, device: Capacity) -> bool {
    match (
        used.memory_bytes,
        device.memory_bytes.map(|b| (b >> 20) << 20),
        used.multiprocessors,
        device.multiprocessors,
    ) {
        (Some(m), Some(total_m), Some(n), Some(total_n)) => m >= total_m && n >= total_n,
        _ => false,
    }
}

/// A share recorded in the checkpoint: which claim holds a share of which device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareHolder {
    /// Claim UID.
    pub claim_uid: String,
    /// Claim namespace: shares of one namespace use one daemon per device.
    pub namespace: String,
    /// Device name in the pool (stable across restarts and reboots, unlike MIG UUIDs).
    pub device_name: String,
}

/// Streaming multiprocessors of the device `device_name` on `gpu`: its MIG profile's for a
/// MIG device, else the GPU's.
pub(crate) fn device_multiprocessors(gpu: &GpuInfo, device_name: &str) -> Option<u32> {
    match device_name.parse::<DeviceName>() {
        Ok(DeviceName::Mig { profile, .. }) => match &gpu.mig {
            MigState::Enabled { profiles, .. } => profiles
                .iter()
                .find(|p| profile_label(&p.name) == profile)
                .map(|p| p.multiprocessors),
            _ => None,
        },
        _ => gpu.multiprocessors,
    }
}

/// A recorded claim's need of a time slice on a whole GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimeSliceNeed {
    /// Claim UID.
    pub claim_uid: String,
    /// GPU UUID.
    pub gpu_uuid: String,
    /// The interval its config asks for.
    pub interval: TimeSliceInterval,
}

/// What a sharing strategy adds to the claim's CDI spec and records in the checkpoint.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SharingEdits {
    /// Edits for every container that gets any device of the claim (e.g. the MPS pipe
    /// directory mount and client env).
    pub claim_edits: ContainerEdits,
    /// Extra edits per device name.
    pub device_edits: BTreeMap<String, ContainerEdits>,
    /// State to keep in the checkpoint and hand back to [`SharingHandler::release`].
    pub state: Option<SharingState>,
}

impl SharingEdits {
    /// Adds `more` (claim edits, then per-device edits); `self.state` is kept.
    pub fn merge(&mut self, more: SharingEdits) {
        self.claim_edits.extend(&more.claim_edits);
        for (device, e) in more.device_edits {
            self.device_edits.entry(device).or_default().extend(&e);
        }
    }
}

/// What a claim's sharing state in the checkpoint holds: which MPS daemon the claim uses (by
/// key; the daemon's one record is its `daemon.json`, read with [`daemon_record`]) and the
/// time slices set for it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SharingState {
    /// The key of the claim's own MPS daemon, the name of its directory `mps/<key>` under
    /// the state directory: the claim UID. Checkpoint layout 1 held the whole daemon record
    /// here instead (`mps`); it loads as this key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_daemon: Option<String>,
    /// Time slices set for the claim.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub time_slicing: Vec<TimeSliceSetting>,
}

impl SharingState {
    /// The strategy the recorded state belongs to; `None` when nothing was set up.
    pub fn strategy(&self) -> Option<SharingStrategy> {
        if self.mps_daemon.is_some() {
            Some(SharingStrategy::Mps)
        } else if !self.time_slicing.is_empty() {
            Some(SharingStrategy::TimeSlicing)
        } else {
            None
        }
    }
}

/// A sharing strategy implementation (time-slicing settings, MPS daemons): the seam
/// prepare calls. Errors are [`SharingFailure::Apply`] or [`SharingFailure::Release`]
/// around what failed.
///
/// Calls come with the node driver's lock held, one at a time. Both methods must be
/// idempotent: after a crash, `release` may be called for a claim whose `apply` never
/// finished (with `state` `None`), and `apply` may run again for the same claim.
/// `needs` are the time slices of every claim the checkpoint records at the time of the
/// call (the claim itself included once it is recorded), as prepare reads them from the
/// recorded configs.
pub trait SharingHandler: Send + Sync {
    /// Sets up sharing for `devices` (each with its effective sharing config and its GPU's
    /// facts) of `claim`.
    fn apply(
        &self,
        claim: &SharingClaim<'_>,
        devices: &[SharingDevice],
        needs: &[TimeSliceNeed],
    ) -> Result<SharingEdits, SharingFailure>;

    /// Undoes [`apply`](Self::apply) for the claim; `state` is what `apply` returned. A
    /// daemon whose record does not decode is not stopped on a guess: the release fails
    /// ([`SharingFailure::RecordUnreadable`], saying how to fix it) and is tried again.
    fn release(
        &self,
        claim_uid: &str,
        state: Option<&SharingState>,
        needs: &[TimeSliceNeed],
    ) -> Result<(), SharingFailure>;

    /// Called once at start, after interrupted prepares were rolled back, with the UIDs of
    /// the claims the checkpoint still holds: re-find what outlived the previous plugin
    /// process (MPS daemons), start again what died for live claims, stop what belongs to
    /// claims that are gone. Failures are logged, never fatal. Returns the live claims whose
    /// sharing was started again (their CDI edits may differ: the driver applies and writes
    /// them anew). Default: nothing to do.
    fn reconcile(&self, _live_claims: &BTreeSet<String>) -> BTreeSet<String> {
        BTreeSet::new()
    }

    /// Called after the driver rewrote the CDI specs of every claim that uses the sharing
    /// `keys` reported by [`reconcile`](Self::reconcile); until then `reconcile` keeps
    /// reporting them (a crash between a restart and the rewrite loses nothing). Default:
    /// nothing to do.
    fn clients_refreshed(&self, _keys: &BTreeSet<String>) {}

    /// Enforces the claim's `shares` (consumable capacity, mode `mps`): the shared daemon
    /// of each device runs (started if this is the first share), and the edits give each
    /// share's device its client limits. `holders`: every share the checkpoint records (the
    /// claim's own included once recorded). Same idempotency rules as `apply`. Default:
    /// nothing is enforced (logged).
    fn apply_shares(
        &self,
        claim: &SharingClaim<'_>,
        shares: &[ShareDevice],
        _holders: &[ShareHolder],
    ) -> Result<SharingEdits, SharingFailure> {
        for s in shares {
            tracing::warn!(claim = claim.uid, device = %s.device_name, share = %s.share_id, "share accepted but not enforced by this sharing handler");
        }
        Ok(SharingEdits::default())
    }

    /// Undoes [`apply_shares`](Self::apply_shares) for the claim's `shares`: the daemon of a
    /// device and the claim's namespace is stopped when no other claim of that namespace in
    /// `holders` holds a share of the device. Idempotent.
    fn release_shares(
        &self,
        _claim: &SharingClaim<'_>,
        _shares: &[ShareDevice],
        _holders: &[ShareHolder],
    ) -> Result<(), SharingFailure> {
        Ok(())
    }
}

/// Accepts every sharing config and sets nothing up (until the strategies are implemented).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoopSharing;

impl SharingHandler for NoopSharing {
    fn apply(
        &self,
        claim: &SharingClaim<'_>,
        devices: &[SharingDevice],
        _needs: &[TimeSliceNeed],
    ) -> Result<SharingEdits, SharingFailure> {
        for d in devices {
            tracing::warn!(
                claim = claim.uid,
                device = %d.device_name,
                strategy = %d.sharing.strategy,
                "sharing strategy accepted but not applied by this release; the device is used without it"
            );
        }
        Ok(SharingEdits::default())
    }

    fn release(
        &self,
        _claim_uid: &str,
        _state: Option<&SharingState>,
        _needs: &[TimeSliceNeed],
    ) -> Result<(), SharingFailure> {
        Ok(())
    }
}

/// One share of a device allocated with consumable capacity: several claims hold shares of
/// one device, each with its own `shareID` (resource.k8s.io/v1
/// `DeviceRequestAllocationResult.shareID`) and what it consumed (`consumedCapacity`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShareRecord {
    /// The allocation result's `shareID`.
    #[serde(rename = "shareID")]
    pub share_id: String,
    /// Consumed `memory` in bytes, when the allocation names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// Consumed `multiprocessors`, when the allocation names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multiprocessors: Option<u32>,
    /// The share consumed the whole device (what a claim that asks for no capacity gets):
    /// the claim has the device alone, served as without consumable capacity.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub whole: bool,
    /// Further `shareID`s of this device in the same claim (several requests placed on one
    /// device); what they consumed is summed into this record, and they share its CDI device.
    #[serde(
        default,
        rename = "moreShareIDs",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub more_share_ids: Vec<String>,
    /// Stricter client thread percentage an MPS config of the claim asked for than what the
    /// share consumed gives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_thread_percentage: Option<u8>,
    /// Stricter pinned-memory limit (bytes) an MPS config of the claim asked for than what
    /// the share consumed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_memory_bytes: Option<u64>,
}

impl ShareRecord {
    /// The share when it is a part of its device (its daemon and limits apply); `None` for a
    /// share that consumed the whole device.
    pub fn partial(share: Option<&ShareRecord>) -> Option<&ShareRecord> {
        share.filter(|s| !s.whole)
    }
}
