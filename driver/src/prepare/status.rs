//! What a prepared claim got, per allocated device, for the claim's
//! `status.devices[].data` (resource.k8s.io/v1 `AllocatedDeviceStatus`, KEP-4817
//! `keps/sig-node/4817-resource-claim-device-status`).
//!
//! Read-only: built from the checkpoint record of the claim, the record of its MPS daemon
//! (`daemon.json`, which the checkpoint names by key: the daemon as it runs now, restarted or
//! not) and the inventory, never from the hardware, so it costs no NVML call and answers what
//! prepare actually did (the MIG instance it created, the MPS limits it set and read back,
//! the share's client limits it wrote into the CDI spec). The shell turns a
//! [`ClaimStatusReport`] into API entries and adds the conditions; nothing here knows about
//! the API server.
//!
//! The data is versioned (`apiVersion: gpu.cleave.dev/v1alpha1`, `kind: DeviceStatus`);
//! docs/attributes.md documents the schema. New fields are optional, so readers of an
//! older version keep working.

use serde::Serialize;

use super::NodeDriver;
use crate::checkpoint::{ClaimRecord, ClaimState, DeviceRecord, ShareRecord};
use crate::model::{ClaimRef, NodeInventory};
use crate::sharing::{
    MpsRecord, ShareDevice, SharingState, device_multiprocessors, shared_daemon_key,
};

/// `apiVersion` of the status data.
pub const STATUS_API_VERSION: &str = "gpu.cleave.dev/v1alpha1";
/// `kind` of the status data.
pub const STATUS_KIND: &str = "DeviceStatus";

/// The status of every device of one claim on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimStatusReport {
    /// The claim.
    pub claim: ClaimRef,
    /// True once the claim is prepared and answered (not while being prepared, not while
    /// its hardware state waits to be recreated after a reboot).
    pub ready: bool,
    /// Why it is not ready, when it is not.
    pub not_ready_reason: Option<String>,
    /// One entry per allocated device (and per `shareID` of a device the claim holds
    /// several shares of), in allocation order.
    pub entries: Vec<DeviceStatusEntry>,
}

/// One `status.devices` entry's identity and data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceStatusEntry {
    /// Pool of the device.
    pub pool: String,
    /// Device name.
    pub device: String,
    /// The allocation's `shareID`, for a share.
    pub share_id: Option<String>,
    /// UUID of the (parent) GPU: what a health event names.
    pub gpu_uuid: String,
    /// The data written into the entry.
    pub data: DeviceStatusData,
}

/// `status.devices[].data` of one device (JSON object).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceStatusData {
    /// [`STATUS_API_VERSION`].
    pub api_version: String,
    /// [`STATUS_KIND`].
    pub kind: String,
    /// UUID the containers see: the MIG device's for a MIG device, else the GPU's.
    pub uuid: String,
    /// UUID of the (parent) GPU.
    #[serde(rename = "gpuUUID")]
    pub gpu_uuid: String,
    /// The MIG instance behind the device.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigStatus>,
    /// The claim's own MPS control daemon and the limits it was given, as its record says
    /// now; absent when that record cannot be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mps: Option<MpsStatus>,
    /// The share of the device the claim holds (consumable capacity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub share: Option<ShareStatus>,
    /// Time-slice interval set on the GPU for the claim (`Default`, `Short`, `Medium`,
    /// `Long`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time_slice: Option<String>,
    /// Allocated with admin access: nothing applied to the device.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub admin_access: bool,
    /// CDI device IDs the containers got.
    #[serde(rename = "cdiDeviceIDs", skip_serializing_if = "Vec::is_empty")]
    pub cdi_device_ids: Vec<String>,
}

/// The MIG instance of a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MigStatus {
    /// `MIG-…` UUID, once the instance exists.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Profile name (`1g.10gb`).
    pub profile: String,
    /// First memory slice of the placement.
    pub placement_start: u32,
    /// Memory slices of the placement.
    pub placement_size: u32,
    /// GPU-instance ID.
    #[serde(rename = "gpuInstanceID", skip_serializing_if = "Option::is_none")]
    pub gpu_instance_id: Option<u32>,
    /// Compute-instance ID.
    #[serde(rename = "computeInstanceID", skip_serializing_if = "Option::is_none")]
    pub compute_instance_id: Option<u32>,
    /// Created for this claim at prepare (destroyed at unprepare); false for an instance
    /// that existed before.
    pub created_for_claim: bool,
}

/// A claim's MPS control daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsStatus {
    /// The daemon: `pod <namespace>/<name>` or `PID <pid>`; empty before it started.
    pub daemon: String,
    /// Default active thread percentage set in the daemon (and read back).
    pub active_thread_percentage: u8,
    /// Default pinned memory limit of this device set in the daemon (and read back), in
    /// the control daemon's syntax (`8192M`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned_memory_limit: Option<String>,
    /// Multi-user mode.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub multi_user: bool,
}

/// A share of a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ShareStatus {
    /// The allocation's `shareID` this entry is for.
    #[serde(rename = "shareID")]
    pub share_id: String,
    /// Consumed memory in bytes (summed over the claim's shares of the device).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consumed_memory_bytes: Option<u64>,
    /// Consumed streaming multiprocessors (summed likewise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consumed_multiprocessors: Option<u32>,
    /// The share consumed the whole device and is served like an exclusive device.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub whole_device: bool,
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` of the share's clients (partial shares under
    /// `--consumable-capacity mps`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_active_thread_percentage: Option<u8>,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` of the share's clients, in MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_pinned_memory_limit_mib: Option<u64>,
    /// The device's shared MPS daemon (`shared-<device>`), for partial shares under MPS.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub daemon: Option<String>,
}

impl NodeDriver {
    /// The status of the claim `uid` as the checkpoint records it, with its MPS daemon as
    /// the daemon's record says now; `None` when the claim is not recorded (never prepared
    /// here, or unprepared). Reads the cached state and, for an MPS claim, the daemon's
    /// record (no checkpoint read, no hardware call).
    pub fn claim_status(&self, uid: &str) -> Option<ClaimStatusReport> {
        let state = self.lock();
        let record = state.data.claims.get(uid)?;
        let daemon = record
            .sharing
            .as_ref()
            .and_then(|s| s.mps_daemon.as_deref())
            .and_then(|key| self.mps_daemon(key));
        Some(report(
            record,
            daemon.as_ref(),
            &state.inventory,
            self.config.consumable_capacity,
        ))
    }
}

/// The report of one checkpoint record; `daemon`: the record of the MPS daemon its sharing
/// state names, when it could be read.
pub(crate) fn report(
    record: &ClaimRecord,
    daemon: Option<&MpsRecord>,
    inventory: &NodeInventory,
    mode: cleave_api::pool::ConsumableCapacity,
) -> ClaimStatusReport {
    let sharing = record.sharing.as_ref();
    let (ready, not_ready_reason) = match record.state {
        ClaimState::Prepared => (true, None),
        ClaimState::PrepareStarted => (false, Some("Preparing".to_owned())),
        ClaimState::NeedsRecreate => (false, Some("WaitingForRecreate".to_owned())),
    };
    let mut entries = Vec::new();
    for device in &record.devices {
        let data = device_data(device, &record.namespace, sharing, daemon, inventory, mode);
        let share_ids: Vec<Option<String>> = match &device.share {
            None => vec![None],
            Some(s) => std::iter::once(&s.share_id)
                .chain(&s.more_share_ids)
                .map(|id| Some(id.clone()))
                .collect(),
        };
        for share_id in share_ids {
            let mut data = data.clone();
            if let (Some(share), Some(id)) = (data.share.as_mut(), &share_id) {
                share.share_id.clone_from(id);
            }
            entries.push(DeviceStatusEntry {
                pool: device.pool.clone(),
                device: device.name.clone(),
                share_id,
                gpu_uuid: device.gpu_uuid.clone(),
                data,
            });
        }
    }
    ClaimStatusReport {
        claim: ClaimRef {
            uid: record.uid.clone(),
            namespace: record.namespace.clone(),
            name: record.name.clone(),
        },
        ready,
        not_ready_reason,
        entries,
    }
}

fn device_data(
    device: &DeviceRecord,
    namespace: &str,
    sharing: Option<&SharingState>,
    daemon: Option<&MpsRecord>,
    inventory: &NodeInventory,
    mode: cleave_api::pool::ConsumableCapacity,
) -> DeviceStatusData {
    let uuid = super::device_uuid(device);
    let mig = device.mig.as_ref().map(|m| MigStatus {
        uuid: m.uuid.clone(),
        profile: m.profile_name.clone(),
        placement_start: m.placement.start,
        placement_size: m.placement.size,
        gpu_instance_id: m.gi_id,
        compute_instance_id: m.ci_id,
        created_for_claim: m.is_cleaves(),
    });
    let mps = daemon.map(|r| MpsStatus {
        daemon: r.daemon.as_ref().map(|d| d.describe()).unwrap_or_default(),
        active_thread_percentage: r.active_thread_percentage,
        pinned_memory_limit: r
            .pinned_limits
            .iter()
            .find(|l| l.uuid == uuid)
            .map(|l| l.limit.clone()),
        multi_user: r.spec.multi_user,
    });
    let time_slice = sharing.and_then(|s| {
        s.time_slicing
            .iter()
            .find(|t| t.gpu_uuid == device.gpu_uuid)
            .map(|t| format!("{:?}", t.interval))
    });
    let share = device
        .share
        .as_ref()
        .map(|s| share_status(device, namespace, s, inventory, mode));
    DeviceStatusData {
        api_version: STATUS_API_VERSION.to_owned(),
        kind: STATUS_KIND.to_owned(),
        uuid,
        gpu_uuid: device.gpu_uuid.clone(),
        mig,
        mps,
        share,
        time_slice,
        admin_access: device.admin_access,
        cdi_device_ids: device.cdi_device_ids.clone(),
    }
}

/// The share's figures; client limits only for a partial share enforced with MPS (the same
/// [`ShareDevice`] arithmetic that wrote them into the CDI spec).
fn share_status(
    device: &DeviceRecord,
    namespace: &str,
    share: &ShareRecord,
    inventory: &NodeInventory,
    mode: cleave_api::pool::ConsumableCapacity,
) -> ShareStatus {
    let enforced =
        !share.whole && !device.admin_access && mode == cleave_api::pool::ConsumableCapacity::Mps;
    let (client_active_thread_percentage, client_pinned_memory_limit_mib, daemon) = if enforced {
        let gpu = inventory.gpus.iter().find(|g| g.uuid == device.gpu_uuid);
        let view = ShareDevice {
            device_name: device.name.clone(),
            uuid: super::device_uuid(device),
            gpu_uuid: device.gpu_uuid.clone(),
            gpu: None,
            device_multiprocessors: gpu.and_then(|g| device_multiprocessors(g, &device.name)),
            share_id: share.share_id.clone(),
            memory_bytes: share.memory_bytes,
            multiprocessors: share.multiprocessors,
            client_thread_percentage: share.client_thread_percentage,
            client_memory_bytes: share.client_memory_bytes,
        };
        (
            Some(view.thread_percentage()),
            view.memory_limit_bytes()
                .filter(|b| *b >= 1 << 20)
                .map(|b| b >> 20),
            Some(shared_daemon_key(&device.name, namespace)),
        )
    } else {
        (None, None, None)
    };
    ShareStatus {
        share_id: share.share_id.clone(),
        consumed_memory_bytes: share.memory_bytes,
        consumed_multiprocessors: share.multiprocessors,
        whole_device: share.whole,
        client_active_thread_percentage,
        client_pinned_memory_limit_mib,
        daemon,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{DeviceKind, MigRecord};
    use crate::model::Placement;
    use cleave_api::pool::ConsumableCapacity;

    fn inventory() -> NodeInventory {
        NodeInventory {
            driver_version: String::new(),
            driver_semver: String::new(),
            cuda_driver_semver: String::new(),
            gpus: Vec::new(),
        }
    }

    fn device(name: &str) -> DeviceRecord {
        DeviceRecord {
            name: name.into(),
            pool: "node-a".into(),
            request_names: vec!["gpu".into()],
            kind: DeviceKind::Gpu,
            admin_access: false,
            gpu_uuid: "GPU-0".into(),
            gpu_minor: 0,
            mig: None,
            config: None,
            cdi_device_ids: vec!["k8s.gpu.cleave.dev/claim=u-gpu-0".into()],
            share: None,
        }
    }

    fn record(devices: Vec<DeviceRecord>, state: ClaimState) -> ClaimRecord {
        ClaimRecord {
            uid: "u".into(),
            namespace: "ns".into(),
            name: "c".into(),
            state,
            devices,
            sharing: None,
        }
    }

    #[test]
    fn whole_gpu_names_its_uuid_and_is_ready() {
        let r = report(
            &record(vec![device("gpu-0")], ClaimState::Prepared),
            None,
            &inventory(),
            ConsumableCapacity::Off,
        );
        assert!(r.ready);
        assert_eq!(r.entries.len(), 1);
        let v = serde_json::to_value(&r.entries[0].data).unwrap_or_default();
        assert_eq!(v["apiVersion"], STATUS_API_VERSION);
        assert_eq!(v["kind"], STATUS_KIND);
        assert_eq!(v["uuid"], "GPU-0");
        assert!(v.get("mig").is_none() && v.get("share").is_none(), "{v}");
    }

    /// The MPS entry comes from the daemon's record (what `claim_status` reads from its
    /// `daemon.json`), not from the checkpoint, which names the daemon by key only.
    #[test]
    fn mps_status_is_the_daemon_records() {
        let mut r = record(vec![device("gpu-0")], ClaimState::Prepared);
        r.sharing = Some(crate::prepare::testing::mps_sharing_state("u"));
        let mut daemon = crate::prepare::testing::mps_record("u");
        daemon.pinned_limits = vec![crate::sharing::PinnedLimit {
            ordinal: 0,
            uuid: "GPU-0".into(),
            limit: "8192M".into(),
        }];
        daemon.daemon = Some(crate::sharing::DaemonHandle::process(
            31337,
            5,
            "boot".into(),
        ));
        let got = report(&r, Some(&daemon), &inventory(), ConsumableCapacity::Off);
        let v = serde_json::to_value(&got.entries[0].data).unwrap_or_default();
        assert_eq!(v["mps"]["daemon"], "PID 31337", "{v}");
        assert_eq!(v["mps"]["activeThreadPercentage"], 50, "{v}");
        assert_eq!(v["mps"]["pinnedMemoryLimit"], "8192M", "{v}");
        // The record could not be read: no MPS entry rather than a guess.
        let got = report(&r, None, &inventory(), ConsumableCapacity::Off);
        let v = serde_json::to_value(&got.entries[0].data).unwrap_or_default();
        assert!(v.get("mps").is_none(), "{v}");
    }

    #[test]
    fn mig_device_carries_its_instance() {
        let mut d = device("gpu-0-mig-1g10gb-3");
        d.kind = DeviceKind::Mig;
        d.mig = Some(MigRecord {
            profile_id: 19,
            profile_name: "1g.10gb".into(),
            placement: Placement { start: 3, size: 1 },
            uuid: Some("MIG-1".into()),
            gi_id: Some(9),
            ci_id: Some(0),
            created_by_cleave: true,
            creating_in_boot: None,
        });
        let r = report(
            &record(vec![d], ClaimState::PrepareStarted),
            None,
            &inventory(),
            ConsumableCapacity::Off,
        );
        assert!(!r.ready);
        assert_eq!(r.not_ready_reason.as_deref(), Some("Preparing"));
        let v = serde_json::to_value(&r.entries[0].data).unwrap_or_default();
        assert_eq!(v["uuid"], "MIG-1");
        assert_eq!(v["mig"]["profile"], "1g.10gb");
        assert_eq!(v["mig"]["placementStart"], 3);
        assert_eq!(v["mig"]["gpuInstanceID"], 9);
        assert_eq!(v["mig"]["computeInstanceID"], 0);
        assert_eq!(v["mig"]["createdForClaim"], true);
    }

    #[test]
    fn each_share_id_of_a_device_gets_its_own_entry() {
        let mut d = device("gpu-0");
        d.share = Some(ShareRecord {
            share_id: "s-1".into(),
            memory_bytes: Some(20 << 30),
            multiprocessors: Some(44),
            more_share_ids: vec!["s-2".into()],
            ..ShareRecord::default()
        });
        let r = report(
            &record(vec![d], ClaimState::Prepared),
            None,
            &inventory(),
            ConsumableCapacity::Mps,
        );
        let ids: Vec<_> = r.entries.iter().map(|e| e.share_id.clone()).collect();
        assert_eq!(ids, [Some("s-1".to_owned()), Some("s-2".to_owned())]);
        let v = serde_json::to_value(&r.entries[1].data).unwrap_or_default();
        assert_eq!(v["share"]["shareID"], "s-2");
        assert_eq!(v["share"]["consumedMultiprocessors"], 44);
        // Unknown device SMs: 100 % of the daemon's threads, the memory limit consumed.
        assert_eq!(v["share"]["clientActiveThreadPercentage"], 100);
        assert_eq!(v["share"]["clientPinnedMemoryLimitMib"], 20 * 1024);
        // The daemon of the device and the claim's namespace.
        assert_eq!(
            v["share"]["daemon"],
            super::shared_daemon_key("gpu-0", "ns")
        );
    }
}
