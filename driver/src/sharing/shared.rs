//! Capacity shares served by MPS (`--consumable-capacity mps`): one multi-user daemon per
//! shared device and claim namespace ([`shared_daemon_key`]), unlimited itself, compute mode
//! left at `DEFAULT` so that the servers of several namespaces run on the GPU side by side;
//! started by the namespace's first share of the device and stopped after its last, counted
//! from the checkpoint by the caller ([`ShareHolder`]). Each share's device gets client
//! limits from what it consumed. Tenants of different namespaces never share an MPS server,
//! pipe directory or `/dev/shm`.

use super::mps::{self, DaemonHandle, MpsRecord};
use super::{
    MPS_MIN_COMPUTE_CAPABILITY, ShareDevice, ShareHolder, SharingEdits, SharingFailure,
    SharingManager,
};
use crate::cdi::ContainerEdits;

/// Name of the MPS daemon shared by the shares of the device `device_name` whose claims are
/// in `namespace`: `shared-<device name, cut to 45 bytes>-<10 hex digits of SHA-256(device
/// name, 0, namespace)>`, a DNS label of at most 63 bytes that names directories and pods.
/// One daemon per device and namespace keeps tenants of different namespaces from sharing
/// an MPS server, its pipe directory and its `/dev/shm`.
pub fn shared_daemon_key(device_name: &str, namespace: &str) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(device_name.as_bytes());
    h.update([0]);
    h.update(namespace.as_bytes());
    let digest = hex::encode(h.finalize());
    let mut device = device_name.to_owned();
    device.truncate(45);
    while device.ends_with('-') {
        device.pop();
    }
    format!("shared-{device}-{}", &digest[..10])
}

/// The name earlier releases gave the one MPS daemon of every share of `device_name`, of
/// any namespace: `shared-<device name>` (cut to 63 bytes). Such a daemon, recorded before
/// an upgrade, is kept while any share of the device remains and stopped after the last.
pub fn legacy_shared_daemon_key(device_name: &str) -> String {
    let mut key = format!("shared-{device_name}");
    key.truncate(63);
    while key.ends_with('-') {
        key.pop();
    }
    key
}

impl SharingManager {
    /// Enforces the claim's `shares` (consumable capacity, mode `mps`): the shared daemon of
    /// each device and the claim's `namespace` (multi-user, defaults unlimited) runs, started
    /// by the namespace's first share or found running, and each share's device gets its
    /// client limits. On failure nothing this
    /// call started is left running (a daemon other shares were using was not answering, so
    /// it is started again or stopped). `holders`: every recorded share (for the log).
    pub(crate) fn apply_shares_of(
        &self,
        claim_uid: &str,
        namespace: &str,
        shares: &[ShareDevice],
        holders: &[ShareHolder],
    ) -> Result<SharingEdits, SharingFailure> {
        crate::cdi::validate_claim_uid(claim_uid)?;
        let _ops = self.serialise();
        let mut edits = SharingEdits::default();
        for share in shares {
            let planned = self.plan_shared(share, namespace)?;
            let others = holders
                .iter()
                .filter(|h| {
                    h.claim_uid != claim_uid
                        && h.device_name == share.device_name
                        && h.namespace == namespace
                })
                .count();
            let record = self.start_mps(planned)?;
            tracing::info!(
                claim = claim_uid,
                device = %share.device_name,
                share = %share.share_id,
                other_shares = others,
                daemon = %record.daemon.as_ref().map(DaemonHandle::describe).unwrap_or_default(),
                "share served by the device's MPS daemon"
            );
            edits
                .device_edits
                .insert(share.device_name.clone(), self.share_edits(&record, share));
        }
        Ok(edits)
    }

    /// Undoes [`Self::apply_shares_of`] for the claim: the shared daemon of a device and
    /// the claim's `namespace` is stopped (directory removed) only when no other claim of
    /// that namespace in `holders` holds a share of the device. A daemon an earlier release
    /// started for the shares of every namespace ([`legacy_shared_daemon_key`]) is stopped
    /// with the last share of the device. Idempotent.
    pub(crate) fn release_shares_of(
        &self,
        claim_uid: &str,
        namespace: &str,
        shares: &[ShareDevice],
        holders: &[ShareHolder],
    ) -> Result<(), SharingFailure> {
        crate::cdi::validate_claim_uid(claim_uid)?;
        let _ops = self.serialise();
        for share in shares {
            let others: Vec<&ShareHolder> = holders
                .iter()
                .filter(|h| h.claim_uid != claim_uid && h.device_name == share.device_name)
                .collect();
            let same_namespace: Vec<&str> = others
                .iter()
                .filter(|h| h.namespace == namespace)
                .map(|h| h.claim_uid.as_str())
                .collect();
            if same_namespace.is_empty() {
                let key = shared_daemon_key(&share.device_name, namespace);
                self.release_shared_daemon(&key)?;
                tracing::info!(claim = claim_uid, device = %share.device_name, namespace, "last share of the device in its namespace released; the namespace's MPS daemon is stopped");
            } else {
                tracing::info!(claim = claim_uid, device = %share.device_name, others = ?same_namespace, "other shares of the namespace still use its MPS daemon of the device; kept");
            }
            if others.is_empty() {
                self.release_shared_daemon(&legacy_shared_daemon_key(&share.device_name))?;
            }
        }
        Ok(())
    }

    /// Stops the shared daemon `key` when its directory exists. A shared daemon never
    /// changes a compute mode, so one whose record cannot be read is stopped as the launcher
    /// finds it, with a warning, rather than failing the release. Idempotent.
    fn release_shared_daemon(&self, key: &str) -> Result<(), SharingFailure> {
        let dir = self.claim_dir(key);
        if !dir.exists() {
            return Ok(());
        }
        let record = mps::load_record(&dir).unwrap_or_else(|e| {
            tracing::warn!(daemon = key, error = %e, "shared daemon record unreadable; stopping what the launcher finds");
            None
        });
        match record {
            Some(record) => self.stop_mps(&record),
            None => self.stop_unrecorded(key),
        }
    }

    /// The shared daemon a share's device needs in `namespace`: multi-user, this device
    /// only, no limits of its own (each share's clients bring theirs), compute mode left
    /// alone. Several namespaces' servers then run on one GPU, which `EXCLUSIVE_PROCESS`
    /// would refuse to the second (NVIDIA recommends that mode precisely so that one MPS
    /// server is the single user of a GPU; the MPS docs, "GPU Compute Modes"); in `DEFAULT`
    /// the GPU time-slices between the servers' contexts (inferred, unverified on hardware).
    fn plan_shared(
        &self,
        share: &ShareDevice,
        namespace: &str,
    ) -> Result<MpsRecord, SharingFailure> {
        let gpu = share
            .gpu
            .as_ref()
            .ok_or_else(|| SharingFailure::UnknownGpu {
                gpu: share.gpu_uuid.clone(),
            })?;
        // Multi-user MPS (all clients served by one root server) is what lets pods of
        // different users share the daemon; Volta or newer (NVIDIA MPS docs, "Architecture"
        // and "Troubleshooting"; kubernetes-sigs/dra-driver-nvidia-gpu refuses it below 7.0).
        if gpu.compute_capability < MPS_MIN_COMPUTE_CAPABILITY {
            return Err(SharingFailure::ShareNeedsMultiUser {
                device: share.device_name.clone(),
                gpu: gpu.uuid.clone(),
                product: gpu.product_name.clone(),
                major: gpu.compute_capability.0,
                minor: gpu.compute_capability.1,
            });
        }
        let key = shared_daemon_key(&share.device_name, namespace);
        crate::cdi::validate_claim_uid(&key)?;
        let spec = self.checked_spec(&key, vec![share.uuid.clone()], true)?;
        Ok(MpsRecord {
            spec,
            host_pipe_dir: self.host_pipe_dir(&key),
            active_thread_percentage: 100,
            pinned_limits: Vec::new(),
            exclusive_gpus: Vec::new(),
            daemon: None,
        })
    }

    /// CDI edits of one share's device: the shared daemon's pipe directory (and `/dev/shm`)
    /// and the share's client limits. The memory limit is keyed by ordinal 0: the daemon
    /// runs with `CUDA_VISIBLE_DEVICES` = this device alone, so its clients enumerate it as
    /// device 0 (NVIDIA MPS docs, "Environment Variables": the daemon's
    /// `CUDA_VISIBLE_DEVICES` remaps the clients' devices), and NVIDIA's device plugin sets
    /// MPS memory limits by index because limits set by UUID were not applied
    /// (NVIDIA/k8s-device-plugin `CHANGELOG.md`, v0.15.0-rc.2).
    fn share_edits(&self, record: &MpsRecord, share: &ShareDevice) -> ContainerEdits {
        let pipe = &self.config.container_pipe_dir;
        let mut env = vec![
            format!("CUDA_MPS_PIPE_DIRECTORY={pipe}"),
            format!(
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={}",
                share.thread_percentage()
            ),
        ];
        if let Some(bytes) = share.memory_limit_bytes().filter(|b| *b >= 1 << 20) {
            env.push(format!(
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={}M",
                bytes >> 20
            ));
        }
        ContainerEdits {
            env,
            mounts: self.client_mounts(record),
            ..ContainerEdits::default()
        }
    }
}
