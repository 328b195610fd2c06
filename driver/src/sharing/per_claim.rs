//! Per-claim MPS: a claim whose devices say `strategy: MPS` gets a control daemon of its
//! own, limited to those devices (`CUDA_VISIBLE_DEVICES`), with the claim's default active
//! thread percentage and pinned memory limits, its pipe directory mounted into the claim's
//! containers only, and whole GPUs in `EXCLUSIVE_PROCESS` compute mode while it runs. This
//! module plans that daemon and the claim's client edits; `daemon` runs and stops it.

use std::collections::BTreeSet;

use cleave_api::config::MpsConfig;

use super::mps::{self, MpsRecord, PinnedLimit};
use super::{GpuFacts, MPS_MIN_COMPUTE_CAPABILITY, SharingDevice, SharingFailure, SharingManager};
use crate::cdi::ContainerEdits;

/// One MPS device of a claim, with its effective MPS config.
pub(super) struct PlannedMps<'a> {
    /// The device.
    pub device: &'a SharingDevice,
    /// Its MPS block (defaults when the config has none).
    pub config: MpsConfig,
}

impl SharingManager {
    /// Plans the claim's daemon (everything checked, nothing changed), then starts it or
    /// finds it running with the same settings.
    pub(super) fn apply_mps(
        &self,
        claim_uid: &str,
        devices: &[PlannedMps<'_>],
    ) -> Result<MpsRecord, SharingFailure> {
        let plan = self.plan_mps(claim_uid, devices)?;
        self.start_mps(plan)
    }

    /// The daemon the claim's MPS devices need: one thread percentage and multi-user mode
    /// for all of them, a limit per device that asks for one, and the whole GPUs to put in
    /// `EXCLUSIVE_PROCESS`.
    fn plan_mps(
        &self,
        claim_uid: &str,
        devices: &[PlannedMps<'_>],
    ) -> Result<MpsRecord, SharingFailure> {
        let (pct, multi_user) = one_setting(claim_uid, devices)?;
        let mut limits = Vec::new();
        let mut exclusive = Vec::new();
        for (ordinal, planned) in (0u32..).zip(devices) {
            let d = planned.device;
            let gpu = mps_gpu(d, multi_user)?;
            if let Some(limit) = pinned_limit(planned, ordinal, gpu)? {
                limits.push(limit);
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
        let spec = self.checked_spec(claim_uid, uuids, multi_user)?;
        Ok(MpsRecord {
            spec,
            host_pipe_dir: self.host_pipe_dir(claim_uid),
            active_thread_percentage: pct,
            pinned_limits: limits,
            exclusive_gpus: exclusive,
            daemon: None,
        })
    }

    /// CDI edits for every container of the claim: the pipe directory and the client env.
    pub(super) fn client_edits(&self, record: &MpsRecord) -> ContainerEdits {
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

/// The thread percentage and multi-user mode the claim's devices agree on (one daemon per
/// claim).
fn one_setting(claim_uid: &str, devices: &[PlannedMps<'_>]) -> Result<(u8, bool), SharingFailure> {
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
    Ok((pct, modes.contains(&true)))
}

/// The GPU behind `d`, refused when it cannot run MPS with limits (or multi-user MPS).
fn mps_gpu(d: &SharingDevice, multi_user: bool) -> Result<&GpuFacts, SharingFailure> {
    let gpu = d.gpu.as_ref().ok_or_else(|| SharingFailure::UnknownGpu {
        gpu: d.gpu_uuid.clone(),
    })?;
    if gpu.compute_capability >= MPS_MIN_COMPUTE_CAPABILITY {
        return Ok(gpu);
    }
    let (device, product) = (d.device_name.clone(), gpu.product_name.clone());
    let (gpu, (major, minor)) = (gpu.uuid.clone(), gpu.compute_capability);
    Err(if multi_user {
        SharingFailure::MultiUserUnsupported {
            device,
            gpu,
            product,
            major,
            minor,
        }
    } else {
        SharingFailure::MpsUnsupported {
            device,
            gpu,
            product,
            major,
            minor,
        }
    })
}

/// The pinned memory limit the config asks for on device `ordinal`, checked against the
/// device's memory and the daemon's 1 MiB unit.
fn pinned_limit(
    planned: &PlannedMps<'_>,
    ordinal: u32,
    gpu: &GpuFacts,
) -> Result<Option<PinnedLimit>, SharingFailure> {
    let d = planned.device;
    let Some(limit) = planned
        .config
        .pinned_memory_limit
        .as_ref()
        .and_then(|l| l.limit_for(&d.uuid, ordinal))
    else {
        return Ok(None);
    };
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
    let text = mps::format_limit(bytes).ok_or_else(|| SharingFailure::LimitTooSmall {
        device: d.device_name.clone(),
        uuid: d.uuid.clone(),
        limit: limit.to_string(),
    })?;
    Ok(Some(PinnedLimit {
        ordinal,
        uuid: d.uuid.clone(),
        limit: text,
    }))
}
