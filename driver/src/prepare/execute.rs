//! Phase 2 of prepare, and unprepare: execute. Records the intent, then runs the apply step
//! ([`NodeDriver::apply`]: on-demand MIG instances, sharing, the claim's CDI spec and its
//! `Prepared` record); a failure rolls back what the claim created
//! ([`NodeDriver::release_record`]). Unprepare is the same release followed by dropping the
//! record. Calls go one way: this module calls `apply`, which calls nothing here.
//!
//! # GPU instances without compute instance
//!
//! A MIG device is two NVML objects, made and destroyed in two calls each. A crash between
//! them, or a rollback whose GPU-instance destroy fails ([`BackendError::LeftBare`]), leaves a
//! GPU instance without compute instance: no MIG device, yet NVML refuses its placement.
//! `list_mig` does not show it, so every path that looks for an instance of ours by its
//! record also looks among [`GpuBackend::list_bare_gpu_instances`] at exactly the recorded
//! profile and placement (and GPU-instance id, when recorded), and destroys what it finds:
//! the rollback at start, the retry of failed rollbacks before every prepare, unprepare, and
//! recreation (whose intent marks the placement as ours). A create that failed without
//! `LeftBare` made nothing, so its rollback looks for nothing. While one exists, the pool
//! publishes its placement as taken (`NodeDriver::bare_gpu_instances`).
//!
//! [`BackendError::LeftBare`]: crate::backend::BackendError::LeftBare
//! [`GpuBackend::list_bare_gpu_instances`]: crate::backend::GpuBackend::list_bare_gpu_instances

use cleave_api::merge::base_request;
use cleave_api::pool::ConsumableCapacity;
use k8s_openapi::api::resource::v1::ResourceClaim;

use super::apply::{ApplyPath, record_shares};
use super::cdi_spec::cdi_name;
use super::plan::{MigPlan, PlannedDevice, claim_label};
use super::{
    NodeDriver, PrepareError, PreparedClaim, PreparedDevice, State, device_need, share_holders,
    time_slice_needs,
};
use crate::cdi;
use crate::checkpoint::{CheckpointData, ClaimRecord, ClaimState, DeviceRecord, ShareRecord};
use crate::driver_root::DeviceNeed;
use crate::model::{MigState, NodeInventory};
use crate::sharing::{SharingClaim, SharingState};

/// The kubelet answer for a recorded claim.
pub(super) fn answer(record: &ClaimRecord) -> PreparedClaim {
    PreparedClaim {
        devices: record
            .devices
            .iter()
            .flat_map(|d| {
                let mut request_names: Vec<String> = Vec::new();
                for r in &d.request_names {
                    let base = base_request(r).to_owned();
                    if !request_names.contains(&base) {
                        request_names.push(base);
                    }
                }
                // One entry per shareID: several shares of one device in a claim use one
                // CDI device with their summed limits.
                let share_ids: Vec<Option<String>> = match &d.share {
                    Some(s) => std::iter::once(&s.share_id)
                        .chain(&s.more_share_ids)
                        .map(|id| Some(id.clone()))
                        .collect(),
                    None => vec![None],
                };
                share_ids
                    .into_iter()
                    .map(|share_id| PreparedDevice {
                        request_names: request_names.clone(),
                        pool_name: d.pool.clone(),
                        device_name: d.name.clone(),
                        cdi_device_ids: d.cdi_device_ids.clone(),
                        share_id,
                    })
                    .collect::<Vec<_>>()
            })
            .collect(),
    }
}

/// Whether a claim other than `uid` records the MIG device `uuid` (another share of it):
/// then it is not destroyed with `uid`'s record.
pub(super) fn held_elsewhere(data: &CheckpointData, uid: &str, uuid: &str) -> bool {
    data.claims
        .values()
        .filter(|c| c.uid != uid)
        .flat_map(|c| &c.devices)
        .filter(|d| !d.admin_access)
        .any(|d| d.mig.as_ref().and_then(|m| m.uuid.as_deref()) == Some(uuid))
}

impl NodeDriver {
    /// Prepares a claim (see the module docs). Idempotent for a prepared claim.
    pub fn prepare(&self, claim: &ResourceClaim) -> Result<PreparedClaim, PrepareError> {
        let label = claim_label(claim);
        let uid = claim_uid(claim, &label)?;
        let span = tracing::info_span!("prepare", claim = %label, uid);
        let _enter = span.enter();

        let mut state = self.lock_synced()?;
        if state
            .data
            .claims
            .values()
            .any(|r| r.state == ClaimState::PrepareStarted && r.uid != uid)
        {
            self.retry_failed_rollbacks(&mut state, uid);
        }
        if let Some(answered) = self.resume_recorded(uid, &label, &mut state)? {
            return Ok(answered);
        }

        let plan = self.planner.plan(claim, &label, uid, &state)?;
        let needs: Vec<DeviceNeed> = plan
            .iter()
            .map(|d| device_need(d.gpu.minor, d.mig.as_ref().map(MigPlan::record).as_ref()))
            .collect();
        self.files.view_for(&label, &needs)?;
        let mut record = self.new_record(claim, uid, &plan);
        let mps_shares = self.config.consumable_capacity == ConsumableCapacity::Mps;
        let needs_intent = record.sharing.is_some()
            || plan.iter().any(|d| {
                d.mig.as_ref().is_some_and(MigPlan::is_cleaves)
                    || (mps_shares && ShareRecord::partial(d.share.as_ref()).is_some())
            });
        if needs_intent {
            self.claims.put(&mut state.data, record.clone())?;
        }

        let pod_claim_name = claim
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(crate::metadata::POD_CLAIM_NAME_ANNOTATION))
            .map(String::as_str);
        match self.execute(&label, &plan, &mut record, &mut state, pod_claim_name) {
            Ok(()) => {
                tracing::info!(devices = record.devices.len(), "prepared");
                Ok(answer(&record))
            }
            Err(e) => {
                tracing::warn!(error = %e, "prepare failed; rolling back");
                self.roll_back(record, &mut state);
                Err(e)
            }
        }
    }

    /// What the checkpoint already holds for the claim `uid`: a prepared claim is answered
    /// again; one waiting for recreation is recreated and then answered; one whose rollback
    /// failed is rolled back now, and `None` lets prepare start afresh.
    fn resume_recorded(
        &self,
        uid: &str,
        label: &str,
        state: &mut State,
    ) -> Result<Option<PreparedClaim>, PrepareError> {
        let Some(record) = state.data.claims.get(uid) else {
            return Ok(None);
        };
        match record.state {
            ClaimState::Prepared => Ok(Some(answer(record))),
            ClaimState::NeedsRecreate => {
                // The kubelet replays prepare after a reboot: answer only once the hardware
                // state exists again.
                let result = self.recreate(uid, &mut state.data, &mut state.inventory);
                match self.backend.inventory() {
                    Ok(inventory) => state.inventory = inventory,
                    Err(e) => tracing::warn!(error = %e, "rediscovering GPUs after recreation"),
                }
                match result {
                    Ok(()) => {
                        state.recreate_errors.remove(uid);
                        tracing::info!("recreated the hardware state of a prepared claim");
                        state
                            .data
                            .claims
                            .get(uid)
                            .map(answer)
                            .map(Some)
                            .ok_or_else(|| PrepareError::InvalidClaim {
                                claim: label.to_owned(),
                                reason: "record vanished during recreation".into(),
                            })
                    }
                    Err(e) => {
                        state.recreate_errors.insert(uid.to_owned(), e.to_string());
                        Err(e)
                    }
                }
            }
            ClaimState::PrepareStarted => {
                // Only left behind when a rollback failed; try it again first.
                let record = record.clone();
                self.release_record(&record, &state.data)?;
                Self::forget_instances(&mut state.inventory, &record, &state.data);
                self.claims.remove(&mut state.data, uid)?;
                Ok(None)
            }
        }
    }

    /// The record of a claim about to be prepared by `plan` (state `PrepareStarted`).
    fn new_record(&self, claim: &ResourceClaim, uid: &str, plan: &[PlannedDevice]) -> ClaimRecord {
        let own_sharing = plan.iter().any(|d| {
            d.config
                .as_ref()
                .is_some_and(|c| c.config.sharing().is_some())
        });
        ClaimRecord {
            uid: uid.to_owned(),
            namespace: claim.metadata.namespace.clone().unwrap_or_default(),
            name: claim.metadata.name.clone().unwrap_or_default(),
            state: ClaimState::PrepareStarted,
            devices: plan
                .iter()
                .map(|d| DeviceRecord {
                    name: d.name.clone(),
                    pool: self.config.pool_name.clone(),
                    request_names: d.request_names.clone(),
                    kind: d.kind,
                    admin_access: d.admin_access,
                    gpu_uuid: d.gpu.uuid.clone(),
                    gpu_minor: d.gpu.minor,
                    mig: d.mig.as_ref().map(MigPlan::record),
                    config: d.config.clone(),
                    cdi_device_ids: vec![cdi::qualified_device_id(
                        uid,
                        &cdi_name(&d.name, d.share.as_ref()),
                    )],
                    share: d.share.clone(),
                })
                .collect(),
            sharing: own_sharing.then(SharingState::default),
        }
    }

    /// Undoes a failed prepare as far as `record` shows; what cannot be undone stays in the
    /// checkpoint as `PrepareStarted`, for a retry or the next start.
    fn roll_back(&self, record: ClaimRecord, state: &mut State) {
        let uid = record.uid.clone();
        match self.release_record(&record, &state.data) {
            Ok(()) => {
                Self::forget_instances(&mut state.inventory, &record, &state.data);
                if let Err(store_err) = self.claims.remove(&mut state.data, &uid) {
                    // The record stays on disk as PrepareStarted: start() or a later
                    // prepare of the claim rolls it back again (idempotently).
                    tracing::error!(error = %store_err, "recording the rollback");
                }
            }
            Err(rollback_err) => {
                // Keep what is known so that a retry or the next start finishes it.
                tracing::error!(error = %rollback_err, "rollback incomplete; kept in the checkpoint");
                let mut record = record;
                record.state = ClaimState::PrepareStarted;
                state.data.claims.insert(uid, record);
                let _ = self.claims.store(&state.data);
            }
        }
    }

    /// Steps 3 and 4 of prepare ([`NodeDriver::apply`]); on error the caller rolls back
    /// what `record` shows.
    pub(super) fn execute(
        &self,
        label: &str,
        plan: &[PlannedDevice],
        record: &mut ClaimRecord,
        state: &mut State,
        pod_claim_name: Option<&str>,
    ) -> Result<(), PrepareError> {
        let path = ApplyPath::Prepare {
            label,
            plan,
            pod_claim_name,
        };
        self.apply(&path, record, &mut state.data, &mut state.inventory)
    }

    /// Undoes everything a record describes, except the checkpoint entry: sharing, MIG
    /// instances cleave created (verified against NVML first), the CDI spec. Idempotent.
    /// An instance without a recorded UUID is looked for by profile and placement (skipping
    /// the UUIDs recorded in `data`) only for an interrupted prepare of this boot
    /// (`PrepareStarted`) or a recreation intent of this boot; never otherwise for a claim
    /// waiting for recreation, whose unrecorded instances do not exist.
    pub(super) fn release_record(
        &self,
        record: &ClaimRecord,
        data: &CheckpointData,
    ) -> Result<(), PrepareError> {
        if record.sharing.is_some() {
            self.sharing.release(
                &record.uid,
                record.sharing.as_ref(),
                &time_slice_needs(data),
            )?;
            crate::fault::point("release.after_sharing_release");
        }
        let shares = record_shares(record);
        if !shares.is_empty() {
            self.sharing.release_shares(
                &SharingClaim {
                    uid: &record.uid,
                    namespace: &record.namespace,
                    name: &record.name,
                },
                &shares,
                &share_holders(data),
            )?;
            crate::fault::point("release.after_share_release");
        }
        let taken = data.mig_uuids_with(record);
        for d in record.devices.iter().rev() {
            let Some(mig) = d.mig.as_ref().filter(|m| m.is_cleaves()) else {
                continue;
            };
            let by_placement =
                record.state == ClaimState::PrepareStarted || mig.intent_of(&data.boot_id);
            if mig.uuid.is_none() && !by_placement {
                continue;
            }
            if let Some(uuid) = mig.uuid.as_deref()
                && held_elsewhere(data, &record.uid, uuid)
            {
                tracing::info!(device = %d.name, mig = %uuid, "MIG device kept: other shares of it are prepared");
                continue;
            }
            self.mig.destroy_owned(&record.uid, d, mig, &taken)?;
        }
        self.files
            .view()
            .cdi
            .remove_claim_spec(&record.uid)
            .map_err(|source| PrepareError::Cdi {
                claim: record.uid.clone(),
                source,
            })?;
        // Device metadata, whether or not it is on now: it may have been written by a run
        // with `--device-metadata`, or half-written before a rollback.
        let removed = match self.metadata.get() {
            Some(m) => m
                .store
                .remove_claim(&record.namespace, &record.name, &record.uid),
            None => {
                self.metadata_store()
                    .remove_claim(&record.namespace, &record.name, &record.uid)
            }
        };
        removed.map_err(|source| PrepareError::Metadata {
            claim: record.uid.clone(),
            source,
        })?;
        Ok(())
    }

    /// Finishes the rollbacks that failed before (records left `PrepareStarted` by another
    /// claim's prepare whose rollback could not destroy what it made, or by a crashed
    /// instance). Under the node lock no prepare is in flight, so every such record is a
    /// leftover. Their devices stay busy, and a bare GPU instance of theirs would make
    /// NVML refuse its placement to the next claim, so they are retried before every
    /// prepare; what still fails stays recorded and logged.
    pub(super) fn retry_failed_rollbacks(&self, state: &mut State, except: &str) {
        let pending: Vec<ClaimRecord> = state
            .data
            .claims
            .values()
            .filter(|r| r.state == ClaimState::PrepareStarted && r.uid != except)
            .cloned()
            .collect();
        for record in pending {
            match self.release_record(&record, &state.data) {
                Ok(()) => {
                    {
                        let st = &mut *state;
                        Self::forget_instances(&mut st.inventory, &record, &st.data);
                    }
                    match self.claims.remove(&mut state.data, &record.uid) {
                        Ok(()) => {
                            tracing::info!(claim = %record.uid, "finished an earlier rollback")
                        }
                        Err(e) => {
                            tracing::error!(claim = %record.uid, error = %e, "recording a finished rollback");
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(claim = %record.uid, error = %e, "earlier rollback still incomplete")
                }
            }
        }
    }

    /// Removes the instances a record created from the cached inventory, except those
    /// other claims in `data` still record (shares of one MIG device).
    pub(super) fn forget_instances(
        inventory: &mut NodeInventory,
        record: &ClaimRecord,
        data: &CheckpointData,
    ) {
        for d in &record.devices {
            let Some(uuid) = d
                .mig
                .as_ref()
                .filter(|m| m.is_cleaves())
                .and_then(|m| m.uuid.as_ref())
                .filter(|u| !held_elsewhere(data, &record.uid, u))
            else {
                continue;
            };
            for gpu in &mut inventory.gpus {
                if let MigState::Enabled { instances, .. } = &mut gpu.mig {
                    instances.retain(|i| &i.uuid != uuid);
                }
            }
        }
    }

    /// Unprepares a claim: releases sharing, destroys the MIG instances it created, deletes
    /// its CDI spec and drops its record. An unknown claim succeeds (its CDI spec is removed
    /// if one is left).
    pub fn unprepare(&self, claim_uid: &str) -> Result<(), PrepareError> {
        cdi::validate_claim_uid(claim_uid).map_err(|e| PrepareError::InvalidClaim {
            claim: claim_uid.to_owned(),
            reason: e.to_string(),
        })?;
        let span = tracing::info_span!("unprepare", uid = claim_uid);
        let _enter = span.enter();
        let mut state = self.lock_synced()?;
        let Some(record) = state.data.claims.get(claim_uid).cloned() else {
            self.files
                .view()
                .cdi
                .remove_claim_spec(claim_uid)
                .map_err(|source| PrepareError::Cdi {
                    claim: claim_uid.to_owned(),
                    source,
                })?;
            return Ok(());
        };
        self.release_record(&record, &state.data)?;
        {
            let st = &mut *state;
            Self::forget_instances(&mut st.inventory, &record, &st.data);
        }
        // On a failed write the record stays (now describing nothing that exists), so
        // that a retry finishes the bookkeeping.
        self.claims.remove(&mut state.data, claim_uid)?;
        tracing::info!("unprepared");
        Ok(())
    }
}

/// The claim's UID, checked to be one a CDI name and a file name can carry.
fn claim_uid<'a>(claim: &'a ResourceClaim, label: &str) -> Result<&'a str, PrepareError> {
    let uid = claim
        .metadata
        .uid
        .as_deref()
        .filter(|u| !u.is_empty())
        .ok_or_else(|| PrepareError::InvalidClaim {
            claim: label.to_owned(),
            reason: "no UID".into(),
        })?;
    cdi::validate_claim_uid(uid).map_err(|e| PrepareError::InvalidClaim {
        claim: label.to_owned(),
        reason: e.to_string(),
    })?;
    Ok(uid)
}
