//! Recovery: what brings the node back in line with the checkpoint after a crash, a
//! restart or a reboot, and later whenever something recorded is found missing: the
//! rollback of interrupted prepares and the CDI sweep at start, the reboot and
//! vanished-instance handling with recreation, the reconciliation of sharing (MPS daemons
//! that died), and the rediscovery of the driver root when a claim needs a file that was
//! missing.
//!
//! # Reboots and vanished instances
//!
//! The checkpoint records the kernel boot ID (`DriverConfig::boot_id_path`) of the boot its
//! hardware state belongs to, for the whole file. When [`NodeDriver::start`] finds another
//! boot ID, nothing the records describe exists any more (MIG instances, MPS daemons, time
//! slices, and usually the CDI specs, which live on a tmpfs), and nothing is assumed to:
//! - every MIG record loses its UUID and GPU/compute-instance IDs (those IDs may now belong
//!   to someone else's instance; nothing is ever destroyed by them);
//! - `Prepared` claims become [`ClaimState::NeedsRecreate`]; `PrepareStarted` claims are
//!   rolled back without any MIG destroy (their MIG records are dropped): sharing released,
//!   CDI spec removed, record dropped;
//! - the new boot ID is stored before anything is created.
//!
//! Start without a new boot checks once, cheaply, that the instances recorded for `Prepared`
//! claims still exist (one `list_mig` per GPU that has any); a claim whose instance vanished
//! (someone destroyed it) loses that instance's IDs and becomes `NeedsRecreate` too. A GPU
//! that cannot be listed is skipped with a warning.
//!
//! Recreation (eagerly at start, best effort and logged per claim; and again on every
//! prepare of a `NeedsRecreate` claim, which the kubelet replays after a reboot):
//! 1. per MIG device in record order: an instance recorded in this boot that still exists is
//!    kept; an instance cleave created is created again with exactly the recorded profile and
//!    placement (`create_mig`) and recorded at once, after its intent (`MigRecord::
//!    creating_in_boot` = this boot ID) was recorded durably; a static instance (not created
//!    by cleave) must exist again with the recorded profile and placement, else the claim
//!    fails with [`PrepareError::StaticMigMissing`] naming the device;
//! 2. sharing is applied again ([`SharingHandler::apply`] with the device UUIDs of now: MPS
//!    daemon started again, time slices set again);
//! 3. the CDI spec is rewritten: the same CDI device names and IDs, new per-device values
//!    (MIG UUIDs change);
//! 4. the record becomes `Prepared` with the new UUIDs and IDs.
//!
//! A failed recreation keeps the claim `NeedsRecreate` (with what it did create, recorded by
//! UUID), removes its CDI spec, and keeps the error (see [`NodeDriver::claims_needing_recreate`]);
//! prepare then fails with that error and never answers for a claim whose hardware is
//! missing. Start passes only claims that are not `NeedsRecreate` to
//! [`SharingHandler::reconcile`], so a daemon of a claim still waiting is stopped rather than
//! restarted with stale device UUIDs. Unprepare of a `NeedsRecreate` claim releases sharing,
//! destroys the instances recorded in this boot (by UUID) and those of a recreation intent of
//! this boot (by profile and placement, as below), and drops the record.
//!
//! A crash between creating an instance and recording it leaves the instance unrecorded but
//! its intent recorded. The next recreation (or unprepare) of the claim takes the instance at
//! exactly the intended profile and placement as its own when the intent names the current
//! boot and no claim records that instance's UUID: it adopts it (records its UUID and IDs)
//! instead of creating again, which would fail with NVML's insufficient resources at that
//! placement. The intent names the boot, so an instance a boot-time MIG configuration (or an
//! administrator) made in a later boot is never taken: start clears every intent after a
//! reboot, and only the boot that wrote an intent honours it. A create that fails clears its
//! intent, so an instance someone else already holds at the placement (the usual cause of
//! that failure) is never adopted by a retry. What remains is the same narrow window as for
//! prepare's `PrepareStarted` rollback: an administrator who creates an identical instance at
//! that placement in the same boot, after the crash and before the restart, has it taken
//! (and destroyed at unprepare) as cleave's.

use std::collections::{BTreeMap, BTreeSet};

use super::apply::ApplyPath;
use super::{NodeDriver, PrepareError, device_uuid, store::State};
use crate::backend::BackendError;
use crate::checkpoint::{CheckpointData, ClaimRecord, ClaimState, MigRecord};
use crate::model::NodeInventory;
use crate::sharing::{GpuFacts, SharingDevice, legacy_shared_daemon_key, shared_daemon_key};

/// Forgets the IDs of every MIG instance of a record, and any recreation intent (after a
/// reboot none of them exists).
pub(super) fn forget_instances_of(record: &mut ClaimRecord) {
    for m in record.devices.iter_mut().filter_map(|d| d.mig.as_mut()) {
        m.uuid = None;
        m.gi_id = None;
        m.ci_id = None;
        m.creating_in_boot = None;
    }
}

/// UUIDs of the MIG instances recorded for any claim, `record` (the copy being recreated)
/// included: an instance among them is never adopted by a recreation.
/// What sharing reconciliation must keep: the UIDs of the live claims (not waiting for
/// recreation) and the shared daemons of the devices they hold shares of.
pub(super) fn live_sharing(data: &CheckpointData) -> BTreeSet<String> {
    let live = data
        .claims
        .values()
        .filter(|r| r.state != ClaimState::NeedsRecreate);
    let mut keys = BTreeSet::new();
    for r in live {
        keys.insert(r.uid.clone());
        for d in r.devices.iter().filter(|d| d.share.is_some()) {
            keys.insert(shared_daemon_key(&d.name, &r.namespace));
            // A daemon an earlier release started for every namespace's shares of the
            // device stays while any share of it does.
            keys.insert(legacy_shared_daemon_key(&d.name));
        }
    }
    keys
}

/// The claims whose CDI specs follow the sharing `restarted` by reconciliation: the claims
/// named, and every live claim with a share of a device whose shared daemon was restarted.
pub(super) fn claims_of_restarted(
    data: &CheckpointData,
    restarted: &BTreeSet<String>,
) -> BTreeSet<String> {
    data.claims
        .values()
        .filter(|r| r.state != ClaimState::NeedsRecreate)
        .filter(|r| {
            restarted.contains(&r.uid)
                || r.devices.iter().any(|d| {
                    d.share.is_some()
                        && (restarted.contains(&shared_daemon_key(&d.name, &r.namespace))
                            || restarted.contains(&legacy_shared_daemon_key(&d.name)))
                })
        })
        .map(|r| r.uid.clone())
        .collect()
}

impl NodeDriver {
    /// The sharing devices of a record, from the effective configs it recorded, with the
    /// facts of their GPUs from `inventory` (see [`Self::gpu_facts`]).
    pub(super) fn recorded_sharing(
        &self,
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
                    gpu: self.gpu_facts(inventory, &r.gpu_uuid, &r.name),
                    sharing,
                })
            })
            .collect()
    }

    /// The facts of GPU `gpu_uuid` for `device`, from `inventory`. A GPU the inventory lacks
    /// (at start it is not discovered yet) is looked for in a fresh discovery, which then
    /// replaces `inventory`; `None` when it is not there either.
    pub(super) fn gpu_facts(
        &self,
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
        match self.backend.inventory() {
            Ok(fresh) => *inventory = fresh,
            Err(e) => tracing::warn!(error = %e, "rediscovering GPUs for sharing"),
        }
        find(inventory)
    }

    /// Start's recovery, in order: after a reboot forgets every instance ID and marks the
    /// prepared claims `NeedsRecreate`, else checks recorded instances still exist; stores
    /// the new boot ID; rolls back interrupted prepares; recreates `NeedsRecreate` claims
    /// (best effort, errors returned by claim UID); sweeps CDI files of unrecorded claims;
    /// reconciles sharing of the live claims.
    pub(super) fn recover_at_start(
        &self,
        data: &mut CheckpointData,
        boot_id: String,
    ) -> Result<BTreeMap<String, String>, PrepareError> {
        // Discovered only if sharing needs GPU facts; start discovers again at its end.
        let mut inventory = State::empty().inventory;
        let rebooted = !data.boot_id.is_empty() && data.boot_id != boot_id;
        if rebooted {
            // MIG instances, MPS daemons and time slices do not survive a reboot, and the CDI
            // root is usually a tmpfs. Instances present now were made by someone else (e.g.
            // a boot-time MIG config), possibly with the recorded IDs: forget every ID.
            tracing::info!(
                claims = data.claims.len(),
                old = %data.boot_id,
                new = %boot_id,
                "boot ID changed since the checkpoint was written; recreating the hardware state of prepared claims"
            );
            for record in data.claims.values_mut() {
                match record.state {
                    ClaimState::PrepareStarted => {
                        // Nothing of it exists; its rollback must destroy nothing.
                        for d in &mut record.devices {
                            if d.mig.as_ref().is_some_and(|m| m.created_by_cleave) {
                                d.mig = None;
                            }
                        }
                    }
                    ClaimState::Prepared | ClaimState::NeedsRecreate => {
                        forget_instances_of(record);
                        record.state = ClaimState::NeedsRecreate;
                    }
                }
            }
        } else {
            self.mark_vanished(data);
        }
        data.boot_id = boot_id;
        self.claims.store(data)?;

        let half_done: Vec<String> = data
            .claims
            .values()
            .filter(|r| r.state == ClaimState::PrepareStarted)
            .map(|r| r.uid.clone())
            .collect();
        for uid in half_done {
            let Some(record) = data.claims.get(&uid).cloned() else {
                continue;
            };
            tracing::info!(claim = %uid, "rolling back an interrupted prepare");
            match self.release_record(&record, data) {
                Ok(()) => {
                    crate::fault::point("start.after_rollback");
                    data.claims.remove(&uid);
                }
                // Keep serving: the record stays (its devices count as busy) and the next
                // prepare or unprepare of the claim retries the rollback.
                Err(e) => tracing::error!(claim = %uid, error = %e, "rollback failed; kept"),
            }
        }
        self.claims.store(data)?;

        let pending: Vec<String> = data
            .claims
            .values()
            .filter(|r| r.state == ClaimState::NeedsRecreate)
            .map(|r| r.uid.clone())
            .collect();
        let mut recreate_errors = BTreeMap::new();
        for uid in pending {
            match self.recreate(&uid, data, &mut inventory) {
                Ok(()) => {
                    tracing::info!(claim = %uid, "recreated the hardware state of a prepared claim")
                }
                Err(e) => {
                    tracing::error!(claim = %uid, error = %e, "recreating a prepared claim failed; retried at its next prepare");
                    recreate_errors.insert(uid, e.to_string());
                }
            }
        }

        super::files::sweep_cdi_root(&self.config.cdi_root, data);
        let live = live_sharing(data);
        let restarted = self.sharing.reconcile(&live);
        for uid in claims_of_restarted(data, &restarted) {
            if let Err(e) = self.refresh_sharing(&uid, data, &mut inventory) {
                tracing::error!(claim = %uid, error = %e, "rewriting the CDI spec of a claim whose sharing was restarted");
            }
        }
        Ok(recreate_errors)
    }

    /// Checks the sharing set-up of the recorded claims now, as at start: MPS daemons of
    /// live claims that died are started again (and their CDI specs rewritten), daemons of
    /// claims that are gone are stopped. Returns the claims whose sharing was restarted.
    /// Call it like prepare: under the node lock, from a blocking thread.
    pub fn reconcile_sharing(&self) -> Result<BTreeSet<String>, PrepareError> {
        let mut state = self.lock_synced()?;
        let live = live_sharing(&state.data);
        let restarted = claims_of_restarted(&state.data, &self.sharing.reconcile(&live));
        for uid in &restarted {
            let state = &mut *state;
            if let Err(e) = self.refresh_sharing(uid, &mut state.data, &mut state.inventory) {
                tracing::error!(claim = %uid, error = %e, "rewriting the CDI spec of a claim whose sharing was restarted");
            }
        }
        Ok(restarted)
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

    /// Marks `Prepared` claims whose recorded MIG instances no longer exist as
    /// `NeedsRecreate` and forgets the vanished instances' IDs (one `list_mig` per GPU).
    pub(super) fn mark_vanished(&self, data: &mut CheckpointData) {
        let mut listed: BTreeMap<String, Option<Vec<crate::model::MigInstance>>> = BTreeMap::new();
        let boot_id = data.boot_id.clone();
        for record in data
            .claims
            .values_mut()
            .filter(|r| r.state == ClaimState::Prepared)
        {
            let mut vanished = Vec::new();
            for d in &mut record.devices {
                let Some(mig) = d.mig.as_mut() else { continue };
                let Some(uuid) = mig.uuid.clone() else {
                    continue;
                };
                let list = listed.entry(d.gpu_uuid.clone()).or_insert_with(|| {
                    match self.backend.list_mig(&d.gpu_uuid) {
                        Ok(list) => Some(list),
                        Err(e) => {
                            tracing::warn!(gpu = %d.gpu_uuid, error = %e, "listing MIG devices to check prepared claims; not checked");
                            None
                        }
                    }
                });
                let Some(list) = list else { continue };
                if !list.iter().any(|i| i.uuid == uuid) {
                    // Half destroyed by us (a crash between the compute-instance and the
                    // GPU-instance destroy): the GPU instance with the recorded id, profile
                    // and placement is still there, bare. It is ours; destroy it now, or its
                    // placement stays refused while the pool says it is free.
                    // If that fails, an intent of this boot makes recreation and
                    // unprepare look for it by placement and try again.
                    if mig.created_by_cleave
                        && let Some(gi_id) = mig.gi_id
                        && !self
                            .mig
                            .destroy_recorded_bare(&d.gpu_uuid, gi_id, mig, &d.name)
                    {
                        mig.creating_in_boot = Some(boot_id.clone());
                    }
                    vanished.push(d.name.clone());
                    mig.uuid = None;
                    mig.gi_id = None;
                    mig.ci_id = None;
                }
            }
            if !vanished.is_empty() {
                tracing::warn!(claim = %record.uid, devices = ?vanished, "MIG devices of a prepared claim vanished; recreating them");
                record.state = ClaimState::NeedsRecreate;
            }
        }
    }

    /// Recreates the hardware state of the `NeedsRecreate` claim `uid` (see the module
    /// docs) and records it `Prepared`. On failure the claim stays `NeedsRecreate` with what
    /// was created recorded, and its CDI spec is removed.
    pub(super) fn recreate(
        &self,
        uid: &str,
        data: &mut CheckpointData,
        inventory: &mut NodeInventory,
    ) -> Result<(), PrepareError> {
        let Some(mut record) = data.claims.get(uid).cloned() else {
            return Ok(());
        };
        let result = self.recreate_record(&mut record, data, inventory);
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

    pub(super) fn recreate_record(
        &self,
        record: &mut ClaimRecord,
        data: &mut CheckpointData,
        inventory: &mut NodeInventory,
    ) -> Result<(), PrepareError> {
        self.apply(&ApplyPath::Recreate, record, data, inventory)
    }

    /// Finds, or creates again, the MIG instance of each of the record's MIG devices and
    /// records its IDs; an instance of ours that changed is recorded at once, so that
    /// unprepare or a retry finds it by UUID.
    pub(super) fn recreate_migs(
        &self,
        record: &mut ClaimRecord,
        data: &mut CheckpointData,
    ) -> Result<(), PrepareError> {
        let label = format!("{}/{}", record.namespace, record.name);
        let mut listed: BTreeMap<String, Vec<crate::model::MigInstance>> = BTreeMap::new();
        for i in 0..record.devices.len() {
            let d = &record.devices[i];
            let Some(mig) = d.mig.clone() else { continue };
            let gpu = d.gpu_uuid.clone();
            if !listed.contains_key(&gpu) {
                let list = self
                    .backend
                    .list_mig(&gpu)
                    .map_err(|e| recreate_error(&label, &d.name, &mig, e))?;
                listed.insert(gpu.clone(), list);
            }
            let list = listed.entry(gpu).or_default();
            let inst = self.mig_instance_for(record, i, &mig, data, list, &label)?;
            let changed = mig.uuid.as_deref() != Some(inst.uuid.as_str())
                || record.devices[i]
                    .mig
                    .as_ref()
                    .is_some_and(|m| m.creating_in_boot.is_some());
            if let Some(m) = record.devices[i].mig.as_mut() {
                m.uuid = Some(inst.uuid.clone());
                m.gi_id = Some(inst.gi_id);
                m.ci_id = Some(inst.ci_id);
                m.creating_in_boot = None;
            }
            if changed && mig.created_by_cleave {
                data.claims.insert(record.uid.clone(), record.clone());
                self.claims.store(data)?;
            }
        }
        Ok(())
    }

    /// The instance that serves device `i` of `record` (recorded as `mig`) in this boot:
    /// the recorded one if it still exists, another share's of the device, one of ours
    /// adopted or created again, or the static instance at the recorded placement.
    fn mig_instance_for(
        &self,
        record: &mut ClaimRecord,
        i: usize,
        mig: &MigRecord,
        data: &mut CheckpointData,
        list: &mut Vec<crate::model::MigInstance>,
        label: &str,
    ) -> Result<crate::model::MigInstance, PrepareError> {
        let name = record.devices[i].name.clone();
        // An instance recorded in this boot that still exists is kept.
        let kept = mig
            .uuid
            .as_ref()
            .and_then(|u| list.iter().find(|i| &i.uuid == u))
            .cloned();
        // Another share of this device, prepared or recreated in this boot, holds the
        // instance again: it serves this share too (one instance per device).
        let co_owned = if kept.is_none() && record.devices[i].share.is_some() {
            data.claims
                .values()
                .filter(|c| c.uid != record.uid && c.state == ClaimState::Prepared)
                .flat_map(|c| &c.devices)
                .filter(|o| o.name == name && o.share.is_some())
                .filter_map(|o| o.mig.as_ref()?.uuid.as_deref())
                .find_map(|u| list.iter().find(|i| i.uuid == u))
                .cloned()
        } else {
            None
        };
        if let Some(inst) = &co_owned {
            tracing::info!(device = %name, mig = %inst.uuid, "MIG device of another share of the device kept for this one");
        }
        match kept.or(co_owned) {
            Some(inst) => Ok(inst),
            None if mig.created_by_cleave => {
                self.create_mig_again(record, i, mig, data, list, label)
            }
            None => list
                .iter()
                .find(|i| i.profile_id == mig.profile_id && i.placement == mig.placement)
                .cloned()
                .ok_or_else(|| PrepareError::StaticMigMissing {
                    claim: label.to_owned(),
                    device: name,
                    profile: mig.profile_name.clone(),
                    placement: mig.placement,
                }),
        }
    }

    /// An instance of ours that is gone: adopts the one an interrupted recreation of this
    /// boot made, or records the intent durably and creates it again (pushed on `list`).
    fn create_mig_again(
        &self,
        record: &mut ClaimRecord,
        i: usize,
        mig: &MigRecord,
        data: &mut CheckpointData,
        list: &mut Vec<crate::model::MigInstance>,
        label: &str,
    ) -> Result<crate::model::MigInstance, PrepareError> {
        let uid = record.uid.clone();
        let (gpu, name) = (
            record.devices[i].gpu_uuid.clone(),
            record.devices[i].name.clone(),
        );
        let intent_of_this_boot = mig.creating_in_boot.as_deref() == Some(data.boot_id.as_str());
        if intent_of_this_boot {
            // A crash of this boot came between our create and its record: the instance at
            // exactly this profile and placement, recorded for nothing else, is ours.
            let taken = data.mig_uuids_with(record);
            let adopted = list
                .iter()
                .find(|i| {
                    i.profile_id == mig.profile_id
                        && i.placement == mig.placement
                        && !taken.contains(&i.uuid)
                })
                .cloned();
            if let Some(inst) = adopted {
                tracing::info!(device = %name, mig = %inst.uuid, gi = inst.gi_id, ci = inst.ci_id, "adopted the MIG device an interrupted recreation created");
                return Ok(inst);
            }
            // An intent of this boot without an instance: a crash (or a failed rollback)
            // between the GPU instance and its compute instance may have left the GPU
            // instance bare. It is ours.
            self.mig.destroy_bare(&uid, &record.devices[i], mig)?;
        } else {
            // Intent first, so that a crash after the create leaves an instance the next
            // attempt recognises as ours.
            if let Some(m) = record.devices[i].mig.as_mut() {
                m.creating_in_boot = Some(data.boot_id.clone());
            }
            data.claims.insert(uid.clone(), record.clone());
            if let Err(e) = self.claims.store(data) {
                // Not recorded and nothing created: no intent either.
                if let Some(m) = data
                    .claims
                    .get_mut(&uid)
                    .and_then(|r| r.devices.get_mut(i))
                    .and_then(|d| d.mig.as_mut())
                {
                    m.creating_in_boot = None;
                }
                return Err(e.into());
            }
            crate::fault::point("recreate.after_intent");
        }
        let inst = match self.backend.create_mig(&gpu, mig.profile_id, mig.placement) {
            Ok(inst) => inst,
            Err(e) => {
                // Nothing was created: drop the intent, so that a later attempt never takes
                // an instance someone else made at this placement (the usual cause of this
                // failure). If our own rollback left the GPU instance bare, keep it: the next
                // attempt destroys that instance first.
                let left_bare = matches!(e, BackendError::LeftBare { .. });
                if !left_bare && let Some(m) = record.devices[i].mig.as_mut() {
                    m.creating_in_boot = None;
                }
                data.claims.insert(uid.clone(), record.clone());
                if let Err(store_err) = self.claims.store(data) {
                    tracing::warn!(claim = %uid, error = %store_err, "recording a failed recreation");
                }
                return Err(recreate_error(label, &name, mig, e));
            }
        };
        crate::fault::point("recreate.after_mig_create");
        tracing::info!(device = %name, mig = %inst.uuid, gi = inst.gi_id, ci = inst.ci_id, "recreated MIG device");
        list.push(inst.clone());
        Ok(inst)
    }
}

/// The error of a MIG device that could not be found or created again.
fn recreate_error(
    label: &str,
    device: &str,
    mig: &MigRecord,
    source: BackendError,
) -> PrepareError {
    PrepareError::MigRecreate {
        claim: label.to_owned(),
        device: device.to_owned(),
        profile: mig.profile_name.clone(),
        placement: mig.placement,
        source: Box::new(source),
    }
}
