//! What prepare reads from the checkpoint for the sharing seam: every recorded share
//! ([`share_holders`]) and every time slice recorded claims ask for ([`time_slice_needs`]),
//! so that a strategy counts from the checkpoint and a restart never loses count.

use cleave_api::config::{DeviceKind, SharingStrategy};

use crate::checkpoint::{self, CheckpointData};
use crate::sharing::{ShareHolder, TimeSliceNeed};

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

/// Every time slice the claims recorded in `data` ask for on whole GPUs (MIG devices have
/// none of their own), from the effective config recorded with every device, so that a
/// restart never loses count.
pub fn time_slice_needs(data: &CheckpointData) -> Vec<TimeSliceNeed> {
    let mut needs = Vec::new();
    for claim in data.claims.values() {
        for device in &claim.devices {
            let is_whole =
                device.kind == DeviceKind::Gpu && device.mig.is_none() && !device.admin_access;
            let Some(resolved) = device.config.as_ref().filter(|_| is_whole) else {
                continue;
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

#[cfg(test)]
mod tests {
    use cleave_api::config::TimeSliceInterval;

    use super::*;
    use crate::checkpoint::{ClaimRecord, ClaimState, DeviceRecord};

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
            config: config.map(|c| serde_json::from_value(c).unwrap()),
            cdi_device_ids: vec![],
            share: None,
        }
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
