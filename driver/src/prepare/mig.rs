//! MIG operations over the backend: list a GPU's instances, create an instance, destroy the
//! instance a claim created (found by UUID, else by profile and placement), and clean up GPU
//! instances left without their compute instance. Every MIG call of prepare, unprepare and
//! recovery goes through [`MigOps`]; it reads no checkpoint and changes no record: the caller
//! decides from the records what to create or destroy.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::PrepareError;
use crate::backend::{BackendError, GpuBackend};
use crate::checkpoint::{DeviceRecord, MigRecord};
use crate::model::{MigInstance, Placement};

/// MIG create, destroy and bare-instance cleanup over one backend.
pub(super) struct MigOps {
    backend: Arc<dyn GpuBackend>,
}

impl MigOps {
    /// Operations over `backend`.
    pub(super) fn new(backend: Arc<dyn GpuBackend>) -> Self {
        Self { backend }
    }

    /// The MIG devices on `gpu` now.
    pub(super) fn list(&self, gpu: &str) -> Result<Vec<MigInstance>, BackendError> {
        self.backend.list_mig(gpu)
    }

    /// Creates a MIG device (GPU instance and compute instance) with profile `profile_id` at
    /// `placement` on `gpu`, timed as the `mig_create` step.
    pub(super) fn create(
        &self,
        gpu: &str,
        profile_id: u32,
        placement: Placement,
    ) -> Result<MigInstance, BackendError> {
        crate::timing::timed(crate::timing::step::MIG_CREATE, || {
            self.backend.create_mig(gpu, profile_id, placement)
        })
    }

    /// Destroys the instance cleave created for `device`, if it still exists. It is found by
    /// its UUID, or (when prepare or recreation was interrupted before the UUID was recorded)
    /// by profile and placement, never among `taken` (UUIDs recorded for claims); an instance
    /// that is not ours (different UUID) is left alone.
    pub(super) fn destroy_owned(
        &self,
        claim: &str,
        device: &DeviceRecord,
        mig: &MigRecord,
        taken: &BTreeSet<String>,
    ) -> Result<(), PrepareError> {
        let err = |source| PrepareError::MigDestroy {
            claim: claim.to_owned(),
            device: device.name.clone(),
            source,
        };
        let existing = match self.backend.list_mig(&device.gpu_uuid) {
            Ok(list) => list,
            // The GPU is gone (or NVML lost it): nothing of ours can be left on it.
            Err(BackendError::GpuNotFound(_)) => return Ok(()),
            Err(e) => return Err(err(e)),
        };
        let target = existing.iter().find(|i| match &mig.uuid {
            Some(uuid) => &i.uuid == uuid,
            None => mig.is_at(i.profile_id, i.placement) && !taken.contains(&i.uuid),
        });
        let Some(inst) = target else {
            return self.destroy_bare(claim, device, mig);
        };
        crate::timing::timed(crate::timing::step::MIG_DESTROY, || {
            self.backend
                .destroy_mig(&device.gpu_uuid, inst.gi_id, inst.ci_id)
        })
        .map_err(err)?;
        crate::fault::point("release.after_mig_destroy");
        tracing::info!(device = %device.name, mig = %inst.uuid, "destroyed MIG device");
        Ok(())
    }

    /// The second half of [`Self::destroy_owned`]: no MIG device of ours is left, but the
    /// GPU instance may be, without its compute instance (a crash or a failed rollback
    /// between the two creates, or between the two destroys). It is ours when it has the
    /// recorded profile and placement and, if an id was recorded, that GPU-instance id; it
    /// is destroyed, and an error keeps the record so that the next prepare, unprepare or
    /// start tries again.
    pub(super) fn destroy_bare(
        &self,
        claim: &str,
        device: &DeviceRecord,
        mig: &MigRecord,
    ) -> Result<(), PrepareError> {
        let err = |source| PrepareError::MigDestroy {
            claim: claim.to_owned(),
            device: device.name.clone(),
            source,
        };
        let bare = match self.backend.list_bare_gpu_instances(&device.gpu_uuid) {
            Ok(list) => list,
            Err(BackendError::GpuNotFound(_)) => return Ok(()),
            Err(e) => return Err(err(e)),
        };
        let Some(gi) = bare.iter().find(|b| {
            mig.is_at(b.profile_id, b.placement) && mig.gi_id.is_none_or(|id| id == b.gi_id)
        }) else {
            tracing::info!(device = %device.name, "MIG device already gone");
            return Ok(());
        };
        tracing::warn!(
            device = %device.name,
            gi = gi.gi_id,
            placement_start = gi.placement.start,
            "found a GPU instance of ours without compute instance; destroying it"
        );
        crate::timing::timed(crate::timing::step::MIG_DESTROY, || {
            self.backend
                .destroy_gpu_instance(&device.gpu_uuid, gi.gi_id)
        })
        .map_err(err)?;
        crate::fault::point("release.after_mig_destroy");
        tracing::info!(device = %device.name, gi = gi.gi_id, "destroyed bare GPU instance");
        Ok(())
    }

    /// Destroys the bare GPU instance `gi_id` if it is there with `mig`'s profile and
    /// placement. False when one is there and could not be destroyed (logged).
    pub(super) fn destroy_recorded_bare(
        &self,
        gpu: &str,
        gi_id: u32,
        mig: &MigRecord,
        device: &str,
    ) -> bool {
        if !self.bare_at(gpu, mig).contains(&gi_id) {
            return true;
        }
        tracing::warn!(
            device,
            gi = gi_id,
            "a MIG device of ours lost its compute instance; destroying its GPU instance"
        );
        match self.backend.destroy_gpu_instance(gpu, gi_id) {
            Ok(()) => {
                crate::fault::point("release.after_mig_destroy");
                true
            }
            Err(e) => {
                tracing::error!(device, gi = gi_id, error = %e, "destroying a GPU instance without compute instance");
                false
            }
        }
    }

    /// Ids of the GPU instances without compute instance at exactly `mig`'s profile and
    /// placement on `gpu` (none when they cannot be listed).
    pub(super) fn bare_at(&self, gpu: &str, mig: &MigRecord) -> Vec<u32> {
        match self.backend.list_bare_gpu_instances(gpu) {
            Ok(list) => list
                .iter()
                .filter(|b| mig.is_at(b.profile_id, b.placement))
                .map(|b| b.gi_id)
                .collect(),
            Err(e) => {
                tracing::warn!(gpu, error = %e, "listing GPU instances without compute instance");
                Vec::new()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::DeviceKind;
    use crate::prepare::testing::{Call, FakeBackend, gpu_uuid, inventory, mig_gpu};

    const AT_0: Placement = Placement { start: 0, size: 4 };
    const AT_4: Placement = Placement { start: 4, size: 4 };

    fn ops() -> (Arc<FakeBackend>, MigOps) {
        let fake = Arc::new(FakeBackend::new(inventory(vec![mig_gpu(0)])));
        (fake.clone(), MigOps::new(fake))
    }

    /// The record of a device cleave created at `placement`, with `uuid` if it was recorded.
    fn owned(placement: Placement, uuid: Option<&str>) -> (DeviceRecord, MigRecord) {
        let mig = MigRecord {
            profile_id: 9,
            profile_name: "3g.20gb".into(),
            placement,
            uuid: uuid.map(str::to_owned),
            gi_id: None,
            ci_id: None,
            created_by_cleave: true,
            creating_in_boot: None,
        };
        let device = DeviceRecord {
            name: format!("gpu-0-mig-3g20gb-{}", placement.start),
            pool: "node-a".into(),
            request_names: vec!["r".into()],
            kind: DeviceKind::Mig,
            admin_access: false,
            gpu_uuid: gpu_uuid(0),
            gpu_minor: 0,
            mig: Some(mig.clone()),
            config: None,
            cdi_device_ids: Vec::new(),
            share: None,
        };
        (device, mig)
    }

    #[test]
    fn a_created_instance_is_destroyed_by_its_uuid() {
        let (fake, ops) = ops();
        let inst = ops.create(&gpu_uuid(0), 9, AT_4).unwrap();
        assert_eq!(fake.instances(&gpu_uuid(0)), vec![inst.clone()]);
        let (device, mig) = owned(AT_4, Some(&inst.uuid));
        ops.destroy_owned("c", &device, &mig, &BTreeSet::new())
            .unwrap();
        assert!(fake.instances(&gpu_uuid(0)).is_empty());
        assert!(fake.calls().contains(&Call::DestroyMig {
            gpu_uuid: gpu_uuid(0),
            gi_id: inst.gi_id,
            ci_id: inst.ci_id,
        }));
    }

    #[test]
    fn an_instance_with_another_uuid_is_left_alone() {
        let (fake, ops) = ops();
        let theirs = fake.add_instance(&gpu_uuid(0), 9, AT_4).unwrap();
        let (device, mig) = owned(AT_4, Some("MIG-not-there"));
        ops.destroy_owned("c", &device, &mig, &BTreeSet::new())
            .unwrap();
        assert_eq!(fake.instances(&gpu_uuid(0)), vec![theirs]);
        assert!(fake.mutations().is_empty());
    }

    #[test]
    fn without_a_uuid_the_instance_is_found_by_placement_but_never_among_taken() {
        let (fake, ops) = ops();
        let at_0 = fake.add_instance(&gpu_uuid(0), 9, AT_0).unwrap();
        let at_4 = fake.add_instance(&gpu_uuid(0), 9, AT_4).unwrap();
        let (device, mig) = owned(AT_4, None);
        let taken = BTreeSet::from([at_4.uuid.clone()]);
        ops.destroy_owned("c", &device, &mig, &taken).unwrap();
        assert_eq!(fake.instances(&gpu_uuid(0)), vec![at_0.clone(), at_4]);
        ops.destroy_owned("c", &device, &mig, &BTreeSet::new())
            .unwrap();
        assert_eq!(fake.instances(&gpu_uuid(0)), vec![at_0]);
    }

    #[test]
    fn nothing_is_left_to_destroy_on_a_gpu_that_is_gone() {
        let (fake, ops) = ops();
        let (mut device, mig) = owned(AT_4, Some("MIG-x"));
        device.gpu_uuid = gpu_uuid(7);
        ops.destroy_owned("c", &device, &mig, &BTreeSet::new())
            .unwrap();
        assert!(fake.mutations().is_empty());
        assert!(ops.bare_at(&gpu_uuid(0), &mig).is_empty());
        assert!(ops.destroy_recorded_bare(&gpu_uuid(0), 1, &mig, &device.name));
    }

    #[test]
    fn a_failed_destroy_names_the_claim_and_the_device() {
        let (fake, ops) = ops();
        let inst = ops.create(&gpu_uuid(0), 9, AT_0).unwrap();
        fake.fail_destroy(Some(BackendError::Unavailable("busy".into())));
        let (device, mig) = owned(AT_0, Some(&inst.uuid));
        let e = ops
            .destroy_owned("ns/c", &device, &mig, &BTreeSet::new())
            .unwrap_err();
        assert!(
            matches!(&e, PrepareError::MigDestroy { claim, device: d, .. }
                if claim == "ns/c" && d == &device.name),
            "{e}"
        );
    }
}
