//! The one apply step of a claim: its MIG instances, its sharing (own strategy, then its
//! shares of devices), its CDI spec, its device metadata and its durable record. Prepare,
//! recreation (after a reboot or a vanished instance) and the refresh of a restarted sharing
//! set-up all run it; [`ApplyPath`] says what differs between them.

use super::plan::PlannedDevice;
use super::{NodeDriver, PrepareError, device_uuid, time_slice_needs};
use crate::checkpoint::{CheckpointData, ClaimRecord, ClaimState};
use crate::model::NodeInventory;
use crate::sharing::{GpuFacts, SharingClaim, SharingDevice, SharingEdits};

/// Which path applies a claim, and what it does differently.
pub(super) enum ApplyPath<'a> {
    /// A new prepare: creates the plan's on-demand MIG instances; the sharing devices come
    /// from the plan (with their GPUs' facts); the steps are timed.
    Prepare {
        /// `namespace/name` of the claim, for errors.
        label: &'a str,
        /// The planned devices, in the order of the record's devices.
        plan: &'a [PlannedDevice],
        /// The pod's name for the claim (its annotation), for the device metadata.
        pod_claim_name: Option<&'a str>,
    },
    /// A `NeedsRecreate` claim: finds, or creates again, its MIG instances; the sharing
    /// devices come from the record.
    Recreate,
    /// A prepared claim whose sharing was started again: MIG instances and device metadata
    /// are left as they are, and the record keeps its state.
    Refresh,
}

impl ApplyPath<'_> {
    /// Crash-harness points after the own sharing and after the shares were applied.
    fn fault_points(&self) -> Option<(&'static str, &'static str)> {
        match self {
            Self::Prepare { .. } => {
                Some(("prepare.after_sharing_apply", "prepare.after_share_apply"))
            }
            Self::Recreate => Some(("recreate.after_sharing_apply", "recreate.after_share_apply")),
            Self::Refresh => Some(("refresh.after_sharing_apply", "refresh.after_share_apply")),
        }
    }

    /// Runs `f`, timed as `step` on the prepare path only.
    fn timed<T, E>(&self, step: &'static str, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        match self {
            Self::Prepare { .. } => crate::timing::timed(step, f),
            _ => f(),
        }
    }
}

impl NodeDriver {
    /// Applies `record` along `path` and records it `Prepared`. On error the caller undoes
    /// (prepare) or keeps for a retry (recreation) what `record` shows; the checkpoint entry
    /// is put back as it was when the final store fails.
    pub(super) fn apply(
        &self,
        path: &ApplyPath<'_>,
        record: &mut ClaimRecord,
        data: &mut CheckpointData,
        inventory: &mut NodeInventory,
    ) -> Result<(), PrepareError> {
        let uid = record.uid.clone();
        match path {
            ApplyPath::Prepare { label, plan, .. } => {
                self.create_planned_migs(label, plan, record, inventory)?;
            }
            ApplyPath::Recreate => self.recreate_migs(record, data)?,
            ApplyPath::Refresh => {}
        }
        let shared = match path {
            ApplyPath::Prepare { plan, .. } => planned_sharing(plan, record),
            _ => self.recorded_sharing(record, inventory),
        };
        let edits = self.apply_sharing(path, record, &shared, data, inventory)?;
        path.timed(crate::timing::step::CDI_WRITE, || {
            self.write_cdi(&uid, record, &edits)
        })?;
        if let ApplyPath::Refresh = path {
            self.claims.put(data, record.clone())?;
            return Ok(());
        }
        // Device metadata (`--device-metadata`), after the CDI spec; it adds its CDI IDs to
        // the record. A failed write is only logged, as in the Go helper. Recreation
        // rewrites it: its CDI specs live in the CDI root (gone after a reboot) and a
        // recreated MIG device has a new UUID (the next generation).
        if let Some(m) = self.metadata.get() {
            let looked_up;
            let pod_claim_name = match path {
                ApplyPath::Prepare { pod_claim_name, .. } => *pod_claim_name,
                _ => {
                    looked_up = m.store.pod_claim_name(&record.namespace, &record.name);
                    looked_up.as_deref()
                }
            };
            self.write_metadata(m, pod_claim_name, record, data, inventory);
        }

        // Durable record, then the answer.
        record.state = ClaimState::Prepared;
        self.claims.put(data, record.clone())?;
        Ok(())
    }

    /// Applies the devices' own sharing configs (`shared`) and the claim's shares of
    /// devices, recording the sharing state in `record`; the CDI edits of both.
    fn apply_sharing(
        &self,
        path: &ApplyPath<'_>,
        record: &mut ClaimRecord,
        shared: &[SharingDevice],
        data: &CheckpointData,
        inventory: &mut NodeInventory,
    ) -> Result<SharingEdits, PrepareError> {
        let points = path.fault_points();
        let mut edits = if shared.is_empty() {
            SharingEdits::default()
        } else {
            let claim = SharingClaim {
                uid: &record.uid,
                namespace: &record.namespace,
                name: &record.name,
            };
            let edits = path.timed(crate::timing::step::SHARING_APPLY, || {
                self.sharing.apply(&claim, shared, &time_slice_needs(data))
            })?;
            if let Some((after_sharing, _)) = points {
                crate::fault::point(after_sharing);
            }
            record.sharing = Some(edits.state.clone().unwrap_or_default());
            edits
        };
        let plan = match path {
            ApplyPath::Prepare { plan, .. } => Some(*plan),
            _ => None,
        };
        let share_edits = self.apply_record_shares(record, data, inventory, plan)?;
        if share_edits != SharingEdits::default()
            && let Some((_, after_share)) = points
        {
            crate::fault::point(after_share);
        }
        edits.merge(share_edits);
        Ok(edits)
    }
}

/// The sharing devices of a plan: each device with a sharing config, with its GPU's facts.
fn planned_sharing(plan: &[PlannedDevice], record: &ClaimRecord) -> Vec<SharingDevice> {
    plan.iter()
        .zip(&record.devices)
        .filter_map(|(d, r)| {
            let sharing = d.config.as_ref()?.config.sharing()?.clone();
            Some(SharingDevice {
                device_name: d.name.clone(),
                kind: r.kind,
                uuid: device_uuid(r),
                gpu_uuid: r.gpu_uuid.clone(),
                gpu: Some(GpuFacts::of(&d.gpu, &d.name)),
                sharing,
            })
        })
        .collect()
}
