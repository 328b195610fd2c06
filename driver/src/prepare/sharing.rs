//! The seam where a sharing strategy (time-slicing, MPS) plugs into prepare and unprepare.
//!
//! Prepare decodes and merges the claim's configs; for the devices whose effective config
//! has a `sharing` block it calls [`SharingHandler::apply`] after any MIG instance exists and
//! before the CDI spec is written, and puts the returned edits into the spec. Unprepare (and
//! the rollback of a failed or interrupted prepare) calls [`SharingHandler::release`] with the
//! state `apply` returned, as recorded in the checkpoint. [`NoopSharing`] accepts every
//! strategy and sets nothing up: devices are then used exclusively by the claim's containers
//! (which still share the device through the GPU's default scheduler).
//!
//! The prepare state machine owns the inventory and the checkpoint; a strategy gets what it
//! needs from them with every call: the facts of the GPU behind each device
//! ([`GpuFacts`]) and the time slices every recorded claim asks for ([`TimeSliceNeed`]).
//! A strategy keeps no backend and reads no checkpoint of its own.
//!
//! Shares (consumable capacity, `--consumable-capacity mps`): a device allocated to several
//! claims, each with its own `shareID`, is served by one MPS daemon per device and claim
//! namespace ([`shared_daemon_key`]), not one per claim: tenants of different namespaces
//! never share an MPS server, pipe directory or `/dev/shm`. Prepare hands the claim's shares
//! to [`SharingHandler::apply_shares`] and unprepare to [`SharingHandler::release_shares`],
//! each with every other share the checkpoint records ([`share_holders`]): a namespace's
//! daemon is started by its first share of the device and stopped after its last, counted
//! from the checkpoint, so that a restart or a crash in between neither kills a daemon other
//! shares use nor leaks one.

use std::collections::{BTreeMap, BTreeSet};

use cleave_api::config::{DeviceKind, Sharing, SharingStrategy, TimeSliceInterval};
use cleave_api::merge::ResolvedConfig;
use cleave_api::names::{DeviceName, profile_label};

use crate::cdi::ContainerEdits;
use crate::checkpoint::{self, CheckpointData};
use crate::model::{GpuInfo, MigState};

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
    pub fn memory_limit_bytes(&self) -> Option<u64> {
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

    /// True when the share consumed the whole device (its memory, rounded down to 1Mi as
    /// published, and all its SMs): what the scheduler allocates to a claim that asks for no
    /// capacity. Such a share is served like a whole device, with no MPS. False when either
    /// size is unknown.
    pub fn takes_whole_device(&self) -> bool {
        let memory = self
            .gpu
            .as_ref()
            .and_then(|g| g.device_memory_bytes)
            .map(|b| (b >> 20) << 20);
        match (
            self.memory_bytes,
            memory,
            self.multiprocessors,
            self.device_multiprocessors,
        ) {
            (Some(m), Some(total_m), Some(s), Some(total_s)) => m >= total_m && s >= total_s,
            _ => false,
        }
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

/// Every share the checkpoint records, in any state (a half-done prepare holds its share
/// until its rollback finished).
pub fn share_holders(data: &CheckpointData) -> Vec<ShareHolder> {
    data.claims
        .values()
        .flat_map(|c| {
            c.devices
                .iter()
                .filter(|d| {
                    !d.admin_access && checkpoint::ShareRecord::partial(d.share.as_ref()).is_some()
                })
                .map(|d| ShareHolder {
                    claim_uid: c.uid.clone(),
                    namespace: c.namespace.clone(),
                    device_name: d.name.clone(),
                })
        })
        .collect()
}

/// Name of the MPS daemon shared by the shares of the device `device_name` whose claims are
/// in `namespace`: `shared-<device name, cut to 45 bytes>-<10 hex digits of SHA-256(device
/// name, 0, namespace)>`, a DNS label of at most 63 bytes that names directories and pods.
/// One daemon per device and namespace keeps tenants of different namespaces from sharing
/// an MPS server, its pipe directory and its `/dev/shm`.
pub fn shared_daemon_key(device_name: &str, namespace: &str) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(device_name.as_bytes());
    h.update([0]);
    h.update(namespace.as_bytes());
    let digest = hex::encode(h.finalize());
    let mut device = device_name.to_owned();
    device.truncate(45);
    while device.ends_with('-') {
        device.pop();
    }
    format!("shared-{device}-{}", &digest[..10])
}

/// The name earlier releases gave the one MPS daemon of every share of `device_name`, of
/// any namespace: `shared-<device name>` (cut to 63 bytes). Such a daemon, recorded before
/// an upgrade, is kept while any share of the device remains and stopped after the last.
pub fn legacy_shared_daemon_key(device_name: &str) -> String {
    let mut key = format!("shared-{device_name}");
    key.truncate(63);
    while key.ends_with('-') {
        key.pop();
    }
    key
}

/// Streaming multiprocessors of the device `device_name` on `gpu`: its MIG profile's for a
/// MIG device, else the GPU's.
pub fn device_multiprocessors(gpu: &GpuInfo, device_name: &str) -> Option<u32> {
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

/// Every time slice the claims recorded in `data` ask for on whole GPUs (MIG devices have
/// none of their own), from the effective config recorded with every device, so that a
/// restart never loses count. Devices whose recorded config does not decode are skipped with
/// a warning (they were written by this or an older release, so this does not happen).
pub fn time_slice_needs(data: &CheckpointData) -> Vec<TimeSliceNeed> {
    let mut needs = Vec::new();
    for claim in data.claims.values() {
        for device in &claim.devices {
            let is_whole =
                device.kind == DeviceKind::Gpu && device.mig.is_none() && !device.admin_access;
            let Some(raw) = device.config.as_ref().filter(|_| is_whole) else {
                continue;
            };
            let resolved: ResolvedConfig = match serde_json::from_value(raw.clone()) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(claim = %claim.uid, device = %device.name, error = %e, "recorded config does not decode");
                    continue;
                }
            };
            let Some(sharing) = resolved.config.sharing() else {
                continue;
            };
            if sharing.strategy != SharingStrategy::TimeSlicing {
                continue;
            }
            let interval = sharing
                .time_slicing
                .as_ref()
                .map(|t| t.interval_or_default())
                .unwrap_or_default();
            needs.push(TimeSliceNeed {
                claim_uid: claim.uid.clone(),
                gpu_uuid: device.gpu_uuid.clone(),
                interval,
            });
        }
    }
    needs
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
    pub state: Option<serde_json::Value>,
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

/// A sharing strategy failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SharingError {
    /// Setting up sharing failed.
    #[error("setting up sharing for claim {claim}: {message}")]
    Apply {
        /// Claim UID.
        claim: String,
        /// What failed.
        message: String,
    },
    /// Tearing sharing down failed.
    #[error("releasing sharing of claim {claim}: {message}")]
    Release {
        /// Claim UID.
        claim: String,
        /// What failed.
        message: String,
    },
}

/// A sharing strategy implementation (time-slicing settings, per-claim MPS daemons).
///
/// Calls come with the node driver's lock held, one at a time. Both methods must be
/// idempotent: after a crash, `release` may be called for a claim whose `apply` never
/// finished (with `state` `None`), and `apply` may run again for the same claim.
/// `needs` are the time slices of every claim the checkpoint records at the time of the
/// call (the claim itself included once it is recorded), from [`time_slice_needs`].
pub trait SharingHandler: Send + Sync {
    /// Sets up sharing for `devices` (each with its effective sharing config and its GPU's
    /// facts) of `claim`.
    fn apply(
        &self,
        claim: &SharingClaim<'_>,
        devices: &[SharingDevice],
        needs: &[TimeSliceNeed],
    ) -> Result<SharingEdits, SharingError>;

    /// Undoes [`apply`](Self::apply) for the claim; `state` is what `apply` returned.
    fn release(
        &self,
        claim_uid: &str,
        state: Option<&serde_json::Value>,
        needs: &[TimeSliceNeed],
    ) -> Result<(), SharingError>;

    /// Called once at start, after interrupted prepares were rolled back, with the UIDs of
    /// the claims the checkpoint still holds: re-find what outlived the previous plugin
    /// process (MPS daemons), start again what died for live claims, stop what belongs to
    /// claims that are gone. Failures are logged, never fatal. Returns the live claims whose
    /// sharing was started again (their CDI edits may differ: the driver applies and writes
    /// them anew). Default: nothing to do.
    fn reconcile(&self, _live_claims: &BTreeSet<String>) -> BTreeSet<String> {
        BTreeSet::new()
    }

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
    ) -> Result<SharingEdits, SharingError> {
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
    ) -> Result<(), SharingError> {
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
    ) -> Result<SharingEdits, SharingError> {
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
        _state: Option<&serde_json::Value>,
        _needs: &[TimeSliceNeed],
    ) -> Result<(), SharingError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{ClaimRecord, ClaimState, DeviceKind, DeviceRecord};

    fn device(gpu: &str, config: Option<serde_json::Value>) -> DeviceRecord {
        DeviceRecord {
            name: "gpu-0".into(),
            pool: "node".into(),
            request_names: vec!["r".into()],
            kind: DeviceKind::Gpu,
            admin_access: false,
            gpu_uuid: gpu.into(),
            gpu_minor: 0,
            mig: None,
            config,
            cdi_device_ids: vec![],
            share: None,
        }
    }

    fn share(used: (Option<u64>, Option<u32>), device: (u64, Option<u32>)) -> ShareDevice {
        ShareDevice {
            device_name: "gpu-0".into(),
            uuid: "GPU-1".into(),
            gpu_uuid: "GPU-1".into(),
            gpu: Some(GpuFacts {
                uuid: "GPU-1".into(),
                index: 0,
                minor: 0,
                product_name: "H100".into(),
                compute_capability: (9, 0),
                device_memory_bytes: Some(device.0),
                multiprocessors: device.1,
                mig_enabled: false,
            }),
            device_multiprocessors: device.1,
            share_id: "s".into(),
            memory_bytes: used.0,
            multiprocessors: used.1,
            client_thread_percentage: None,
            client_memory_bytes: None,
        }
    }

    #[test]
    fn share_thread_percentage_and_whole_device() {
        const GIB: u64 = 1 << 30;
        // H100 80GB: 81559 MiB and 1/2 MiB more, published rounded down to 1Mi.
        let memory = 81_559 * (1 << 20) + (1 << 19);
        let s = |m, sms| share((Some(m), Some(sms)), (memory, Some(132)));
        assert_eq!(s(20 * GIB, 44).thread_percentage(), 33);
        assert_eq!(s(20 * GIB, 1).thread_percentage(), 1, "at least 1");
        assert_eq!(s(20 * GIB, 132).thread_percentage(), 100);
        assert_eq!(share((None, None), (memory, None)).thread_percentage(), 100);
        assert!(!s(20 * GIB, 132).takes_whole_device());
        assert!(!s(81_559 << 20, 131).takes_whole_device());
        assert!(s(81_559 << 20, 132).takes_whole_device());
        assert!(!share((Some(memory), None), (memory, Some(132))).takes_whole_device());
    }

    #[test]
    fn shared_daemon_names_are_valid_claim_names() {
        let long_ns = "n".repeat(63);
        for device in [
            "gpu-0",
            "gpu-12-mig-1g10gb-6",
            &"a".repeat(63),
            &format!("{}-b", "a".repeat(44)),
        ] {
            for ns in ["default", "a", long_ns.as_str()] {
                let key = shared_daemon_key(device, ns);
                assert!(key.len() <= 63, "{key}");
                crate::cdi::validate_claim_uid(&key).unwrap();
            }
            let legacy = legacy_shared_daemon_key(device);
            assert!(legacy.len() <= 63, "{legacy}");
            crate::cdi::validate_claim_uid(&legacy).unwrap();
        }
        // One daemon per device and namespace; never the name an earlier release used.
        let a = shared_daemon_key("gpu-0", "team-a");
        assert!(a.starts_with("shared-gpu-0-"), "{a}");
        assert_ne!(a, shared_daemon_key("gpu-0", "team-b"));
        assert_ne!(a, shared_daemon_key("gpu-1", "team-a"));
        assert_eq!(a, shared_daemon_key("gpu-0", "team-a"));
        assert_ne!(a, legacy_shared_daemon_key("gpu-0"));
        assert_eq!(legacy_shared_daemon_key("gpu-0"), "shared-gpu-0");
        let name = crate::cdi::share_device_name(
            "gpu-7-mig-3g40gb-4",
            "5a000000-0000-4000-8000-00000000000a",
        );
        assert!(name.len() <= 63 && !name.ends_with('-'), "{name}");
        crate::cdi::validate_device_name(&name).unwrap();
    }

    #[test]
    fn needs_come_from_recorded_configs() {
        let ts = |interval: &str| {
            serde_json::json!({
                "index": 0, "source": "FromClaim",
                "config": {"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
                    "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}}
            })
        };
        let mut data = CheckpointData::default();
        for (uid, dev) in [
            ("a", device("GPU-1", Some(ts("Long")))),
            ("b", device("GPU-2", None)),
            (
                "c",
                device("GPU-3", Some(serde_json::json!({"garbage": true}))),
            ),
        ] {
            data.claims.insert(
                uid.into(),
                ClaimRecord {
                    uid: uid.into(),
                    namespace: "ns".into(),
                    name: uid.into(),
                    state: ClaimState::Prepared,
                    devices: vec![dev],
                    sharing: None,
                },
            );
        }
        let needs = time_slice_needs(&data);
        assert_eq!(
            needs,
            vec![TimeSliceNeed {
                claim_uid: "a".into(),
                gpu_uuid: "GPU-1".into(),
                interval: TimeSliceInterval::Long,
            }]
        );
    }
}
