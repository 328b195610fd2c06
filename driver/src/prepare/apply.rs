//! The one apply step of a claim: its MIG instances, its sharing (own strategy, then its
//! shares of devices), its CDI spec, its device metadata and its durable record. Prepare,
//! recreation (after a reboot or a vanished instance: [`NodeDriver::recreate`]) and the
//! refresh of a restarted sharing set-up ([`NodeDriver::refresh_sharing`]) all run it;
//! [`ApplyPath`] says what differs between them. The CDI spec and the device metadata are
//! written by `cdi_spec`.

use cleave_api::pool::ConsumableCapacity;

use super::plan::{MigPlan, PlannedDevice};
use super::recover::Recovery;
use super::{NodeDriver, PrepareError, device_uuid, share_holders, time_slice_needs};
use crate::backend::{BackendError, GpuBackend};
use crate::checkpoint::{CheckpointData, ClaimRecord, ClaimState, ShareRecord};
use crate::model::{MigState, NodeInventory};
use crate::sharing::{
    GpuFacts, ShareDevice, SharingClaim, SharingDevice, SharingEdits, device_multiprocessors,
};

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
            ApplyPath::Recreate => {
                Recovery::new(&self.mig, &self.claims).recreate_migs(record, data)?
            }
            ApplyPath::Refresh => {}
        }
        let shared = match path {
            ApplyPath::Prepare { plan, .. } => planned_sharing(plan, record),
            _ => recorded_sharing(&*self.backend, record, inventory),
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

    /// Recreates the hardware state of the `NeedsRecreate` claim `uid` (see
    /// `recover`'s module docs) and records it `Prepared`. On failure the claim stays
    /// `NeedsRecreate` with what was created recorded, and its CDI spec is removed.
    pub(super) fn recreate(
        &self,
        uid: &str,
        data: &mut CheckpointData,
        inventory: &mut NodeInventory,
    ) -> Result<(), PrepareError> {
        let Some(mut record) = data.claims.get(uid).cloned() else {
            return Ok(());
        };
        let result = self.apply(&ApplyPath::Recreate, &mut record, data, inventory);
        if let Err(e) = &result {
            if let Some(r) = data.claims.get_mut(uid) {
                r.state = ClaimState::NeedsRecreate;
            }
            tracing::warn!(claim = %uid, error = %e, "recreation failed");
            if let Err(cdi_err) = self.files.view().cdi.remove_claim_spec(uid) {
                tracing::warn!(claim = %uid, error = %cdi_err, "removing the CDI spec of a claim waiting for recreation");
            }
        }
        result
    }

    /// After the sharing of a prepared claim was started again (its MPS daemon had died):
    /// takes the sharing edits of now (a restarted daemon pod has a new `/dev/shm`), records
    /// them and rewrites the claim's CDI spec, so that containers started from now on use
    /// the new daemon.
    pub(super) fn refresh_sharing(
        &self,
        uid: &str,
        data: &mut CheckpointData,
        inventory: &mut NodeInventory,
    ) -> Result<(), PrepareError> {
        let Some(mut record) = data.claims.get(uid).cloned() else {
            return Ok(());
        };
        let has_sharing = record.devices.iter().any(|d| {
            d.share.is_some() || d.config.as_ref().and_then(|c| c.config.sharing()).is_some()
        });
        if !has_sharing {
            return Ok(());
        }
        self.apply(&ApplyPath::Refresh, &mut record, data, inventory)?;
        tracing::info!(claim = %uid, "rewrote the CDI spec of a claim whose sharing was restarted");
        Ok(())
    }

    /// Step 3: creates the plan's on-demand MIG instances (not those another share of the
    /// device holds), recording each in `record` and the inventory.
    fn create_planned_migs(
        &self,
        label: &str,
        plan: &[PlannedDevice],
        record: &mut ClaimRecord,
        inventory: &mut NodeInventory,
    ) -> Result<(), PrepareError> {
        for (i, d) in plan.iter().enumerate() {
            let Some(MigPlan::Create {
                profile_id,
                placement,
                ..
            }) = &d.mig
            else {
                continue;
            };
            let created = self.mig.create(&d.gpu.uuid, *profile_id, *placement);
            let inst = match created {
                Ok(inst) => inst,
                Err(source) => {
                    // Tell the rollback what exists: only a GPU instance the backend could
                    // not destroy (then by its id), else nothing, so that it never takes
                    // an instance someone else holds at this placement (the usual cause
                    // of the failure) for ours.
                    match &source {
                        BackendError::LeftBare { gi_id, .. } => {
                            if let Some(m) = record.devices[i].mig.as_mut() {
                                m.gi_id = *gi_id;
                            }
                        }
                        _ => record.devices[i].mig = None,
                    }
                    return Err(PrepareError::MigCreate {
                        claim: label.to_owned(),
                        device: d.name.clone(),
                        source,
                    });
                }
            };
            crate::fault::point("prepare.after_mig_create");
            if let Some(m) = record.devices[i].mig.as_mut() {
                m.record_instance(&inst);
            }
            tracing::info!(device = %d.name, mig = %inst.uuid, gi = inst.gi_id, ci = inst.ci_id, "created MIG device");
            if let Some(gpu) = inventory.gpus.iter_mut().find(|g| g.uuid == d.gpu.uuid)
                && let MigState::Enabled { instances, .. } = &mut gpu.mig
            {
                instances.push(inst);
            }
        }
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

    /// Enforces the record's shares when consumable capacity is `mps` (the shared daemon of
    /// each device runs; the edits carry each share's client limits); nothing otherwise.
    /// The GPU facts of a device prepare planned come from `plan`; others (recreation,
    /// refresh) are looked up in `inventory`.
    fn apply_record_shares(
        &self,
        record: &ClaimRecord,
        data: &CheckpointData,
        inventory: &mut NodeInventory,
        plan: Option<&[PlannedDevice]>,
    ) -> Result<SharingEdits, PrepareError> {
        if self.config.consumable_capacity != ConsumableCapacity::Mps {
            return Ok(SharingEdits::default());
        }
        let mut shares = record_shares(record);
        if shares.is_empty() {
            return Ok(SharingEdits::default());
        }
        for s in &mut shares {
            // Prepare planned the device with its GPU: its facts come from there.
            if let Some(d) = plan
                .into_iter()
                .flatten()
                .find(|d| d.name == s.device_name && d.gpu.uuid == s.gpu_uuid)
            {
                s.gpu = Some(GpuFacts::of(&d.gpu, &d.name));
                s.device_multiprocessors = device_multiprocessors(&d.gpu, &d.name);
                continue;
            }
            s.gpu = gpu_facts(&*self.backend, inventory, &s.gpu_uuid, &s.device_name);
            s.device_multiprocessors = inventory
                .gpus
                .iter()
                .find(|g| g.uuid == s.gpu_uuid)
                .and_then(|g| device_multiprocessors(g, &s.device_name));
        }
        // A share of the whole device (a claim that asked for no capacity) has the device
        // alone, as without sharing: no daemon, no limits.
        shares.retain(|s| {
            let whole = s.takes_whole_device();
            if whole {
                tracing::info!(claim = %record.uid, device = %s.device_name, share = %s.share_id, "share consumed the whole device; used without MPS");
            }
            !whole
        });
        if shares.is_empty() {
            return Ok(SharingEdits::default());
        }
        let claim = SharingClaim {
            uid: &record.uid,
            namespace: &record.namespace,
            name: &record.name,
        };
        Ok(self
            .sharing
            .apply_shares(&claim, &shares, &share_holders(data))?)
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

/// The sharing devices of a record, from the effective configs it recorded, with the facts
/// of their GPUs from `inventory` (see [`gpu_facts`]).
fn recorded_sharing(
    backend: &dyn GpuBackend,
    record: &ClaimRecord,
    inventory: &mut NodeInventory,
) -> Vec<SharingDevice> {
    record
        .devices
        .iter()
        .filter_map(|r| {
            let sharing = r.config.as_ref()?.config.sharing()?.clone();
            Some(SharingDevice {
                device_name: r.name.clone(),
                kind: r.kind,
                uuid: device_uuid(r),
                gpu_uuid: r.gpu_uuid.clone(),
                gpu: gpu_facts(backend, inventory, &r.gpu_uuid, &r.name),
                sharing,
            })
        })
        .collect()
}

/// The shares a record holds, without GPU facts (enough to release them).
pub(super) fn record_shares(record: &ClaimRecord) -> Vec<ShareDevice> {
    record
        .devices
        .iter()
        .filter(|d| !d.admin_access)
        .filter_map(|d| {
            let s = ShareRecord::partial(d.share.as_ref())?;
            Some(ShareDevice {
                device_name: d.name.clone(),
                uuid: device_uuid(d),
                gpu_uuid: d.gpu_uuid.clone(),
                gpu: None,
                device_multiprocessors: None,
                share_id: s.share_id.clone(),
                memory_bytes: s.memory_bytes,
                multiprocessors: s.multiprocessors,
                client_thread_percentage: s.client_thread_percentage,
                client_memory_bytes: s.client_memory_bytes,
            })
        })
        .collect()
}

/// The facts of GPU `gpu_uuid` for `device`, from `inventory`. A GPU the inventory lacks
/// (at start it is not discovered yet) is looked for in a fresh discovery through
/// `backend`, which then replaces `inventory`; `None` when it is not there either.
fn gpu_facts(
    backend: &dyn GpuBackend,
    inventory: &mut NodeInventory,
    gpu_uuid: &str,
    device: &str,
) -> Option<GpuFacts> {
    let find = |inv: &NodeInventory| {
        inv.gpus
            .iter()
            .find(|g| g.uuid == gpu_uuid)
            .map(|g| GpuFacts::of(g, device))
    };
    if let Some(facts) = find(inventory) {
        return Some(facts);
    }
    match backend.inventory() {
        Ok(fresh) => *inventory = fresh,
        Err(e) => tracing::warn!(error = %e, "rediscovering GPUs for sharing"),
    }
    find(inventory)
}
