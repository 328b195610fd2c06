//! Recovery: what brings the node back in line with the checkpoint after a crash, a
//! restart or a reboot, and later whenever something recorded is found missing. The
//! façade ([`NodeDriver::start`], and prepare of a `NeedsRecreate` claim) runs the sequence:
//! the rollback of interrupted prepares and the CDI sweep at start, recreation through the
//! apply step, the reconciliation of sharing (MPS daemons that died). [`Recovery`] owns its
//! MIG side over [`MigOps`] and the [`ClaimStore`] alone (no sharing, no CDI): what a reboot
//! does to the records, the vanished-instance check, and finding, adopting or creating
//! again each MIG instance of a record. The pure parts (the reboot's effect on the records,
//! what sharing reconciliation keeps) are plain functions.
//!
//! # Reboots and vanished instances
//!
//! The checkpoint records the kernel boot ID (`DriverConfig::boot_id_path`) of the boot its
//! hardware state belongs to, for the whole file. When [`NodeDriver::start`] finds another
//! boot ID, nothing the records describe exists any more (MIG instances, MPS daemons, time
//! slices, and usually the CDI specs, which live on a tmpfs), and nothing is assumed to
//! ([`after_reboot`]):
//! - every MIG record loses its UUID and GPU/compute-instance IDs (those IDs may now belong
//!   to someone else's instance; nothing is ever destroyed by them);
//! - `Prepared` claims become [`ClaimState::NeedsRecreate`]; `PrepareStarted` claims are
//!   rolled back without any MIG destroy (their MIG records are dropped): sharing released,
//!   CDI spec removed, record dropped;
//! - the new boot ID is stored before anything is created.
//!
//! Start without a new boot checks once, cheaply, that the instances recorded for `Prepared`
//! claims still exist ([`Recovery::mark_vanished`]: one `list_mig` per GPU that has any); a
//! claim whose instance vanished (someone destroyed it) loses that instance's IDs and becomes
//! `NeedsRecreate` too. A GPU that cannot be listed is skipped with a warning.
//!
//! Recreation (eagerly at start, best effort and logged per claim; and again on every
//! prepare of a `NeedsRecreate` claim, which the kubelet replays after a reboot):
//! 1. per MIG device in record order ([`Recovery::recreate_migs`]): an instance recorded in
//!    this boot that still exists is kept; an instance cleave created is created again with
//!    exactly the recorded profile and placement (`create_mig`) and recorded at once, after
//!    its intent (`MigRecord::creating_in_boot` = this boot ID) was recorded durably; a static
//!    instance (not created by cleave) must exist again with the recorded profile and
//!    placement, else the claim fails with [`PrepareError::StaticMigMissing`] naming the
//!    device;
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
//!
//! [`NodeDriver::start`]: super::NodeDriver::start
//! [`NodeDriver::claims_needing_recreate`]: super::NodeDriver::claims_needing_recreate
//! [`SharingHandler::apply`]: crate::sharing::SharingHandler::apply
//! [`SharingHandler::reconcile`]: crate::sharing::SharingHandler::reconcile

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};

use super::PrepareError;
use super::mig::MigOps;
use super::store::ClaimStore;
use crate::backend::BackendError;
use crate::checkpoint::{CheckpointData, ClaimRecord, ClaimState, MigRecord};
use crate::model::MigInstance;
use crate::sharing::{legacy_shared_daemon_key, shared_daemon_key};

/// The MIG side of recovery, over the MIG operations and the claim store it is given.
pub(super) struct Recovery<'a> {
    mig: &'a MigOps,
    claims: &'a ClaimStore,
}

impl<'a> Recovery<'a> {
    /// Recovery over `mig` and `claims`.
    pub(super) fn new(mig: &'a MigOps, claims: &'a ClaimStore) -> Self {
        Self { mig, claims }
    }

    /// Start's first step: after a reboot (another boot ID than `data` records) forgets every
    /// instance and marks the prepared claims `NeedsRecreate` ([`after_reboot`]), else
    /// checks the recorded instances still exist ([`Self::mark_vanished`]); then stores
    /// `data` with `boot_id`, before anything is created.
    pub(super) fn at_start(
        &self,
        data: &mut CheckpointData,
        boot_id: String,
    ) -> Result<(), PrepareError> {
        if rebooted(data, &boot_id) {
            after_reboot(data, &boot_id);
        } else {
            self.mark_vanished(data);
        }
        data.boot_id = boot_id;
        self.claims.store(data)?;
        Ok(())
    }

    /// Marks `Prepared` claims whose recorded MIG instances no longer exist as
    /// `NeedsRecreate` and forgets the vanished instances' IDs (one list per GPU).
    pub(super) fn mark_vanished(&self, data: &mut CheckpointData) {
        let mut listed: BTreeMap<String, Option<Vec<MigInstance>>> = BTreeMap::new();
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
                    match self.mig.list(&d.gpu_uuid) {
                        Ok(list) => Some(list),
                        Err(e) => {
                            tracing::warn!(gpu = %d.gpu_uuid, error = %e, "listing MIG devices to check prepared claims; not checked");
                            None
                        }
                    }
                });
                let Some(list) = list else { continue };
                if list.iter().any(|i| i.uuid == uuid) {
                    continue;
                }
                // Half destroyed by us (a crash between the compute-instance and the
                // GPU-instance destroy): the GPU instance with the recorded id, profile and
                // placement is still there, bare. It is ours; destroy it now, or its
                // placement stays refused while the pool says it is free.
                // If that fails, an intent of this boot makes recreation and unprepare look
                // for it by placement and try again.
                if mig.is_cleaves()
                    && let Some(gi_id) = mig.gi_id
                    && !self
                        .mig
                        .destroy_recorded_bare(&d.gpu_uuid, gi_id, mig, &d.name)
                {
                    mig.record_intent(&boot_id);
                }
                vanished.push(d.name.clone());
                mig.forget_instance();
            }
            if !vanished.is_empty() {
                tracing::warn!(claim = %record.uid, devices = ?vanished, "MIG devices of a prepared claim vanished; recreating them");
                record.state = ClaimState::NeedsRecreate;
            }
        }
    }

    /// Finds, or creates again, the MIG instance of each of the record's MIG devices and
    /// records its IDs in `record`; an instance of ours that changed is recorded in `data`
    /// and stored at once, so that unprepare or a retry finds it by UUID.
    pub(super) fn recreate_migs(
        &self,
        record: &mut ClaimRecord,
        data: &mut CheckpointData,
    ) -> Result<(), PrepareError> {
        let label = format!("{}/{}", record.namespace, record.name);
        let mut listed: BTreeMap<String, Vec<MigInstance>> = BTreeMap::new();
        for i in 0..record.devices.len() {
            let d = &record.devices[i];
            let Some(mig) = d.mig.clone() else { continue };
            let list = match listed.entry(d.gpu_uuid.clone()) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => e.insert(
                    self.mig
                        .list(&d.gpu_uuid)
                        .map_err(|err| recreate_error(&label, &d.name, &mig, err))?,
                ),
            };
            let inst = self.mig_instance_for(record, i, &mig, data, list, &label)?;
            let changed = mig.uuid.as_deref() != Some(inst.uuid.as_str())
                || record.devices[i]
                    .mig
                    .as_ref()
                    .is_some_and(MigRecord::has_intent);
            if let Some(m) = record.devices[i].mig.as_mut() {
                m.record_instance(&inst);
            }
            if changed && mig.is_cleaves() {
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
        list: &mut Vec<MigInstance>,
        label: &str,
    ) -> Result<MigInstance, PrepareError> {
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
            None if mig.is_cleaves() => self.create_mig_again(record, i, mig, data, list, label),
            None => list
                .iter()
                .find(|i| mig.is_at(i.profile_id, i.placement))
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
        list: &mut Vec<MigInstance>,
        label: &str,
    ) -> Result<MigInstance, PrepareError> {
        let uid = record.uid.clone();
        let (gpu, name) = (
            record.devices[i].gpu_uuid.clone(),
            record.devices[i].name.clone(),
        );
        if mig.intent_of(&data.boot_id) {
            // A crash of this boot came between our create and its record: the instance at
            // exactly this profile and placement, recorded for nothing else, is ours.
            let taken = data.mig_uuids_with(record);
            let adopted = list
                .iter()
                .find(|i| mig.is_at(i.profile_id, i.placement) && !taken.contains(&i.uuid))
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
                m.record_intent(&data.boot_id);
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
                    m.clear_intent();
                }
                return Err(e.into());
            }
            crate::fault::point("recreate.after_intent");
        }
        let inst = match self.mig.create(&gpu, mig.profile_id, mig.placement) {
            Ok(inst) => inst,
            Err(e) => {
                // Nothing was created: drop the intent, so that a later attempt never takes
                // an instance someone else made at this placement (the usual cause of this
                // failure). If our own rollback left the GPU instance bare, keep it: the next
                // attempt destroys that instance first.
                let left_bare = matches!(e, BackendError::LeftBare { .. });
                if !left_bare && let Some(m) = record.devices[i].mig.as_mut() {
                    m.clear_intent();
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

/// Whether `data` belongs to another boot than `boot_id` (a checkpoint without a boot ID
/// belongs to none: it is taken as this boot's).
pub(super) fn rebooted(data: &CheckpointData, boot_id: &str) -> bool {
    !data.boot_id.is_empty() && data.boot_id != boot_id
}

/// What a reboot does to the records (see the module docs): every MIG instance is
/// forgotten with its intent, `Prepared` (and `NeedsRecreate`) claims become
/// `NeedsRecreate`, and `PrepareStarted` claims lose the MIG records of instances cleave
/// created, so that their rollback destroys nothing. The boot ID is left to the caller.
pub(super) fn after_reboot(data: &mut CheckpointData, boot_id: &str) {
    // MIG instances, MPS daemons and time slices do not survive a reboot, and the CDI root
    // is usually a tmpfs. Instances present now were made by someone else (e.g. a boot-time
    // MIG config), possibly with the recorded IDs: forget every ID.
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
                    if d.mig.as_ref().is_some_and(MigRecord::is_cleaves) {
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
}

/// Forgets the IDs of every MIG instance of a record, and any recreation intent (after a
/// reboot none of them exists).
pub(super) fn forget_instances_of(record: &mut ClaimRecord) {
    for m in record.devices.iter_mut().filter_map(|d| d.mig.as_mut()) {
        m.forget_instance();
        m.clear_intent();
    }
}

/// The UIDs of the claims recorded in `state`, in UID order.
pub(super) fn claims_in(data: &CheckpointData, state: ClaimState) -> Vec<String> {
    data.claims
        .values()
        .filter(|r| r.state == state)
        .map(|r| r.uid.clone())
        .collect()
}

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

#[cfg(test)]
mod tests;
