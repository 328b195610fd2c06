//! The claim devices the mock tries describe, as prepare would record them: one builder
//! for both tries, naming devices by the published grammar.

use cleave_api::names::DeviceName;
use cleave_driver::model::{GpuInfo, MigInstance, MigProfile};
use cleave_driver::usage::{Allocation, ClaimDevice, ClaimRef, Holding, MigRef, SharingStrategy};

/// A scripted claim: `namespace/name`, UID `uid-<name>`, held as `kind`; `pids` are its
/// MPS daemon's host PIDs (none for a daemon run in a pod).
pub(super) struct MockClaim<'a> {
    pub(super) namespace: &'a str,
    pub(super) name: &'a str,
    pub(super) kind: Holding,
    pub(super) pids: Vec<u32>,
}

impl MockClaim<'_> {
    fn device(
        self,
        device: String,
        gpu: &GpuInfo,
        mig: Option<MigRef>,
        allocated: Allocation,
    ) -> ClaimDevice {
        ClaimDevice {
            claim: ClaimRef {
                uid: format!("uid-{}", self.name),
                namespace: self.namespace.into(),
                name: self.name.into(),
            },
            device,
            kind: self.kind,
            sharing: (self.kind == Holding::Mps).then_some(SharingStrategy::Mps),
            share_id: None,
            gpu_uuid: gpu.uuid.clone(),
            mig,
            allocated,
            pids: self.pids,
            pods: Vec::new(),
        }
    }

    /// The claim on the MIG device `mig` of `gpu`, made with `profile`.
    pub(super) fn on_mig(
        self,
        gpu: &GpuInfo,
        profile: &MigProfile,
        mig: &MigInstance,
    ) -> ClaimDevice {
        let name = DeviceName::mig(gpu.minor, &profile.name, mig.placement.start).to_string();
        let mig_ref = MigRef {
            uuid: mig.uuid.clone(),
            gi: mig.gi_id,
            ci: mig.ci_id,
        };
        let allocated = Allocation {
            memory_bytes: profile.memory_mib << 20,
            sms: Some(profile.multiprocessors),
            mig_profile: Some(profile.name.clone()),
        };
        self.device(name, gpu, Some(mig_ref), allocated)
    }

    /// The claim on the whole GPU `gpu`.
    pub(super) fn on_gpu(self, gpu: &GpuInfo) -> ClaimDevice {
        let allocated = Allocation {
            memory_bytes: gpu.memory_bytes,
            sms: gpu.multiprocessors,
            mig_profile: None,
        };
        self.device(DeviceName::gpu(gpu.minor).to_string(), gpu, None, allocated)
    }
}
