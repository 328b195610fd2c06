//! The prepare/unprepare state machine of one node.
//!
//! [`NodeDriver`] owns the device inventory, the checkpoint, the CDI store and the driver
//! files found at start. The gRPC shell calls [`NodeDriver::prepare`] and
//! [`NodeDriver::unprepare`] (blocking; from `spawn_blocking`, under the whole-node file lock
//! the shell takes so two plugin instances never interleave).
//!
//! Prepare of one claim:
//! 1. take the allocation results for this driver and pool; check every device is known
//!    here and not prepared for another claim; resolve the opaque configs (class then claim,
//!    per request); nothing is changed until all of this passed;
//! 2. if the claim will create something that outlives a crash (a MIG instance, a sharing
//!    set-up), record it as `PrepareStarted` in the checkpoint first;
//! 3. create on-demand MIG instances, apply sharing, write the claim's CDI spec;
//! 4. record the claim as `Prepared` (with instance IDs, configs, CDI IDs) and answer.
//!
//! A failure rolls back what this claim created. A crash leaves either a `PrepareStarted`
//! record (rolled back by [`NodeDriver::start`]) or at most a CDI file of an unrecorded claim
//! (removed by start's sweep). Preparing a `Prepared` claim again answers from the record
//! and changes nothing. Unprepare destroys the MIG instances the claim created (checked by
//! UUID first, so a reused GPU-instance ID is never destroyed by mistake), deletes the CDI
//! spec and drops the record; an unknown claim succeeds.
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
//! publishes its placement as taken ([`NodeDriver::bare_gpu_instances`]).

pub mod sharing;
#[cfg(test)]
pub mod testing;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use cleave_api::config::DeviceKind as ConfigKind;
use cleave_api::merge::{ResolvedConfig, base_request, resolve_claim_configs};
use cleave_api::names::{DeviceName, profile_label};
use k8s_openapi::api::resource::v1::ResourceClaim;

use crate::backend::{BackendError, GpuBackend};
use crate::cdi::{self, CdiDevice, CdiError, CdiStore};
use crate::checkpoint::{
    self, CheckpointData, CheckpointError, CheckpointStore, ClaimRecord, ClaimState, DeviceKind,
    DeviceRecord, MigRecord,
};
use crate::driver_root::{DeviceNeed, DriverFiles, DriverRootConfig, DriverRootError};
use crate::model::{GpuInfo, MigState, NodeInventory};

pub use sharing::{
    NoopSharing, SharingClaim, SharingDevice, SharingEdits, SharingError, SharingHandler,
};

/// Node driver settings (from the plugin's flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverConfig {
    /// DRA driver name (`gpu.cleave.dev`).
    pub driver_name: String,
    /// Pool name: the node name.
    pub pool_name: String,
    /// State directory, `<plugins dir>/<driver name>`; holds `checkpoint.json`.
    pub state_dir: PathBuf,
    /// CDI root the runtime scans (`/var/run/cdi`).
    pub cdi_root: PathBuf,
    /// Where the NVIDIA driver files are.
    pub driver_root: DriverRootConfig,
    /// On-demand MIG: create the allocated instance at prepare, destroy it at unprepare.
    pub dynamic_mig: bool,
    /// File with the kernel boot ID (`/proc/sys/kernel/random/boot_id`).
    pub boot_id_path: PathBuf,
    /// cleave's CDI hook as a path on the host, named in every claim's spec (soname
    /// links, ld cache, CUDA compat); `None`: specs without hooks.
    pub cdi_hook: Option<PathBuf>,
}

/// A prepare or unprepare failure; the message names the claim and the object.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The claim has no UID or one unusable in file names.
    #[error("claim {claim}: {reason}")]
    InvalidClaim {
        /// `namespace/name` or UID.
        claim: String,
        /// What is wrong.
        reason: String,
    },
    /// The claim has no allocation.
    #[error("claim {claim} is not allocated")]
    NotAllocated {
        /// `namespace/name`.
        claim: String,
    },
    /// The allocation has no device of this driver in this node's pool.
    #[error(
        "claim {claim} has no device allocated from driver {driver} in pool {pool} (allocated: {allocated})"
    )]
    NotForThisNode {
        /// `namespace/name`.
        claim: String,
        /// This driver.
        driver: String,
        /// This pool.
        pool: String,
        /// `driver/pool/device` of what is allocated.
        allocated: String,
    },
    /// An allocated device is not known on this node.
    #[error("claim {claim}: device {device} in pool {pool} is not known on this node: {reason}")]
    UnknownDevice {
        /// `namespace/name`.
        claim: String,
        /// Device name.
        device: String,
        /// Pool name.
        pool: String,
        /// Why.
        reason: String,
    },
    /// An opaque config for this driver is invalid or does not fit the device.
    #[error("claim {claim}: invalid config: {message}")]
    InvalidConfig {
        /// `namespace/name`.
        claim: String,
        /// The config API's message, naming the config entry.
        message: String,
    },
    /// The device is prepared for another claim.
    #[error("claim {claim}: device {device} is already prepared for claim {other}")]
    DeviceBusy {
        /// `namespace/name`.
        claim: String,
        /// Device name.
        device: String,
        /// `namespace/name (uid)` of the other claim.
        other: String,
    },
    /// Creating an on-demand MIG instance failed.
    #[error("claim {claim}: creating MIG device {device}: {source}")]
    MigCreate {
        /// `namespace/name`.
        claim: String,
        /// Device name.
        device: String,
        /// The backend error (with the NVML return code).
        source: BackendError,
    },
    /// Destroying a MIG instance the claim created failed.
    #[error("claim {claim}: destroying MIG device {device}: {source}")]
    MigDestroy {
        /// Claim UID or name.
        claim: String,
        /// Device name.
        device: String,
        /// The backend error.
        source: BackendError,
    },
    /// GPU discovery failed.
    #[error("GPU discovery: {0}")]
    Discovery(#[source] BackendError),
    /// Recreating a MIG instance of a prepared claim (after a reboot, or after it vanished)
    /// failed.
    #[error(
        "claim {claim}: recreating MIG device {device} (profile {profile}, placement start {} size {}) after a reboot or loss: {source}",
        placement.start, placement.size
    )]
    MigRecreate {
        /// `namespace/name`.
        claim: String,
        /// Device name.
        device: String,
        /// Profile name.
        profile: String,
        /// The recorded placement.
        placement: crate::model::Placement,
        /// The backend error.
        source: Box<BackendError>,
    },
    /// A static MIG device (not created by cleave) of a prepared claim does not exist after a
    /// reboot or loss.
    #[error(
        "claim {claim}: MIG device {device} (profile {profile}, placement start {} size {}) was not created by cleave and does not exist any more (node rebooted or instance destroyed); create it again (nvidia-smi mig -cgi) or unprepare the claim",
        placement.start, placement.size
    )]
    StaticMigMissing {
        /// `namespace/name`.
        claim: String,
        /// Device name.
        device: String,
        /// Profile name.
        profile: String,
        /// The recorded placement.
        placement: crate::model::Placement,
    },
    /// Setting up or releasing sharing failed.
    #[error(transparent)]
    Sharing(#[from] SharingError),
    /// Writing or removing the CDI spec failed (the error names the path).
    #[error("claim {claim}: {source}")]
    Cdi {
        /// Claim UID.
        claim: String,
        /// The CDI error.
        source: CdiError,
    },
    /// Loading or writing the checkpoint failed (the error names the path).
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Reading the driver root failed.
    #[error("driver root: {0}")]
    DriverRoot(#[from] DriverRootError),
    /// The claim's containers would lack a device node or the CUDA library: it is not
    /// prepared, so that no pod starts without its GPU.
    #[error(
        "claim {claim}: its containers would lack {} (driver root {}, device nodes looked for in {}); check that --driver-root (NVIDIA_DRIVER_ROOT) is where the NVIDIA driver is installed and that its kernel modules are loaded",
        missing.join(", "), root.display(), dev_dir.display()
    )]
    MissingDriverFiles {
        /// `namespace/name`.
        claim: String,
        /// The driver root as the plugin sees it.
        root: PathBuf,
        /// Where device nodes were looked for.
        dev_dir: PathBuf,
        /// What is missing, as container paths.
        missing: Vec<String>,
    },
    /// NVML sees GPUs but the driver root holds no driver files at all.
    #[error(
        "NVML sees {gpus} GPU(s) but driver root {} holds no NVIDIA driver files (no /dev/nvidiactl or /dev/nvidia<N> under {}, no libcuda.so.* in its library directories); set --driver-root (NVIDIA_DRIVER_ROOT) to the driver installation as this container sees it (host install: the host's / mounted in; GPU Operator: /run/nvidia/driver), or wait for the driver container to finish",
        root.display(), dev_dir.display()
    )]
    NoDriverFiles {
        /// The driver root as the plugin sees it.
        root: PathBuf,
        /// Where device nodes were looked for.
        dev_dir: PathBuf,
        /// GPUs NVML found.
        gpus: usize,
    },
    /// A directory the driver needs could not be created.
    #[error("creating directory {path}: {source}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The boot ID could not be read.
    #[error("reading boot ID from {path}: {source}")]
    BootId {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// The answer for one prepared claim, as the kubelet wants it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedClaim {
    /// One entry per prepared device, in allocation order.
    pub devices: Vec<PreparedDevice>,
}

/// One prepared device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDevice {
    /// Base request names (`req`, never `req/sub`) the device was allocated for.
    pub request_names: Vec<String>,
    /// Pool of the device (the node name).
    pub pool_name: String,
    /// Device name.
    pub device_name: String,
    /// Fully qualified CDI device IDs.
    pub cdi_device_ids: Vec<String>,
}

/// Identity of a prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClaimRecordSummary {
    /// Claim UID.
    pub uid: String,
    /// Claim namespace.
    pub namespace: String,
    /// Claim name.
    pub name: String,
}

struct State {
    inventory: NodeInventory,
    data: CheckpointData,
    /// Last recreation error of `NeedsRecreate` claims, by UID (this process only).
    recreate_errors: BTreeMap<String, String>,
}

/// A claim whose hardware state is waiting to be recreated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRecreate {
    /// The claim.
    pub claim: ClaimRecordSummary,
    /// The last recreation error seen by this process, if any attempt failed.
    pub error: Option<String>,
}

/// The node side of the driver: prepare/unprepare with durable state.
pub struct NodeDriver {
    config: DriverConfig,
    backend: Arc<dyn GpuBackend>,
    sharing: Arc<dyn SharingHandler>,
    /// Driver files and the CDI store built on their common edits; replaced when a claim
    /// needs a file that was missing (a driver installed after start).
    files: std::sync::RwLock<Arc<DriverView>>,
    checkpoint: CheckpointStore,
    state: Mutex<State>,
}

impl std::fmt::Debug for NodeDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeDriver")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The driver files found last and the CDI store that adds their common edits.
#[derive(Debug)]
struct DriverView {
    files: Arc<DriverFiles>,
    cdi: CdiStore,
}

impl DriverView {
    fn new(files: DriverFiles, config: &DriverConfig) -> Self {
        let cdi = CdiStore::new(
            &config.cdi_root,
            files.common_edits(config.cdi_hook.as_deref()),
        );
        Self {
            files: Arc::new(files),
            cdi,
        }
    }
}

/// What prepare will do for one device, decided before anything changes.
struct PlannedDevice {
    name: String,
    kind: DeviceKind,
    request_names: Vec<String>,
    gpu: GpuInfo,
    /// Instance to use (static) or to create (on demand), if the device is a MIG instance.
    mig: Option<MigRecord>,
    config: Option<ResolvedConfig>,
}

fn claim_label(claim: &ResourceClaim) -> String {
    format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    )
}

impl NodeDriver {
    /// Starts the node side with no sharing strategy ([`NoopSharing`]).
    pub fn start(config: DriverConfig, backend: Arc<dyn GpuBackend>) -> Result<Self, PrepareError> {
        Self::start_with_sharing(config, backend, Arc::new(NoopSharing))
    }

    /// Starts the node side: finds the driver files, loads the checkpoint, rolls back
    /// half-done prepares, recreates the hardware state of prepared claims after a reboot or
    /// a vanished instance (see the module docs), removes CDI files of unrecorded claims,
    /// reconciles sharing, and discovers the inventory.
    pub fn start_with_sharing(
        config: DriverConfig,
        backend: Arc<dyn GpuBackend>,
        sharing: Arc<dyn SharingHandler>,
    ) -> Result<Self, PrepareError> {
        for dir in [&config.state_dir, &config.cdi_root] {
            std::fs::create_dir_all(dir).map_err(|source| PrepareError::CreateDir {
                path: dir.clone(),
                source,
            })?;
        }
        // The state directory (checkpoint, MPS records) is root's alone.
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&config.state_dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|source| PrepareError::CreateDir {
                    path: config.state_dir.clone(),
                    source,
                })?;
        }
        let files = DriverFiles::discover(&config.driver_root)?;
        let view = DriverView::new(files, &config);
        let checkpoint = CheckpointStore::in_dir(&config.state_dir);
        let boot_id = checkpoint::read_boot_id(&config.boot_id_path).map_err(|source| {
            PrepareError::BootId {
                path: config.boot_id_path.clone(),
                source,
            }
        })?;
        let mut data = checkpoint.load()?;

        let driver = Self {
            config,
            backend,
            sharing,
            files: std::sync::RwLock::new(Arc::new(view)),
            checkpoint,
            state: Mutex::new(State {
                inventory: NodeInventory {
                    driver_version: String::new(),
                    driver_semver: String::new(),
                    cuda_driver_semver: String::new(),
                    gpus: Vec::new(),
                },
                data: CheckpointData::default(),
                recreate_errors: BTreeMap::new(),
            }),
        };

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
            driver.mark_vanished(&mut data);
        }
        data.boot_id = boot_id;
        driver.checkpoint.store(&data)?;

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
            match driver.release_record(&record, &data) {
                Ok(()) => {
                    crate::fault::point("start.after_rollback");
                    data.claims.remove(&uid);
                }
                // Keep serving: the record stays (its devices count as busy) and the next
                // prepare or unprepare of the claim retries the rollback.
                Err(e) => tracing::error!(claim = %uid, error = %e, "rollback failed; kept"),
            }
        }
        driver.checkpoint.store(&data)?;

        let pending: Vec<String> = data
            .claims
            .values()
            .filter(|r| r.state == ClaimState::NeedsRecreate)
            .map(|r| r.uid.clone())
            .collect();
        let mut recreate_errors = BTreeMap::new();
        for uid in pending {
            match driver.recreate(&uid, &mut data) {
                Ok(()) => {
                    tracing::info!(claim = %uid, "recreated the hardware state of a prepared claim")
                }
                Err(e) => {
                    tracing::error!(claim = %uid, error = %e, "recreating a prepared claim failed; retried at its next prepare");
                    recreate_errors.insert(uid, e.to_string());
                }
            }
        }

        driver.sweep_cdi_root(&data);
        let live: BTreeSet<String> = data
            .claims
            .values()
            .filter(|r| r.state != ClaimState::NeedsRecreate)
            .map(|r| r.uid.clone())
            .collect();
        for uid in driver.sharing.reconcile(&live) {
            if let Err(e) = driver.refresh_sharing(&uid, &mut data) {
                tracing::error!(claim = %uid, error = %e, "rewriting the CDI spec of a claim whose sharing was restarted");
            }
        }

        let inventory = driver
            .backend
            .inventory()
            .map_err(PrepareError::Discovery)?;
        {
            let mut state = driver.lock();
            state.inventory = inventory;
            state.data = data;
            state.recreate_errors = recreate_errors;
        }
        Ok(driver)
    }

    fn view(&self) -> Arc<DriverView> {
        Arc::clone(
            &self
                .files
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// The driver files for a claim with these devices. When something they need is
    /// missing the driver root is looked at again (the driver may have been installed, or
    /// its nodes created, since the last look); what is still missing fails the claim.
    fn view_for(&self, claim: &str, needs: &[DeviceNeed]) -> Result<Arc<DriverView>, PrepareError> {
        let view = self.view();
        if view.files.missing_for(needs).is_empty() {
            return Ok(view);
        }
        let files = DriverFiles::discover(&self.config.driver_root)?;
        let missing = files.missing_for(needs);
        let fresh = Arc::new(DriverView::new(files, &self.config));
        *self
            .files
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::clone(&fresh);
        if missing.is_empty() {
            tracing::info!(root = %fresh.files.root.display(), "driver files a claim needs appeared since the driver root was last examined");
            return Ok(fresh);
        }
        Err(PrepareError::MissingDriverFiles {
            claim: claim.to_owned(),
            root: fresh.files.root.clone(),
            dev_dir: fresh.files.dev_dir.clone(),
            missing,
        })
    }

    /// When NVML sees GPUs but the driver root holds no driver files at all (a wrong
    /// `--driver-root`, or a driver container still installing): the error saying so.
    /// Claims are refused meanwhile (naming the files); the shell keeps the node from
    /// being offered.
    pub fn missing_driver(&self) -> Option<PrepareError> {
        let view = self.view();
        let gpus = self.lock_for_view().inventory.gpus.len();
        (gpus > 0 && view.files.holds_no_driver()).then(|| PrepareError::NoDriverFiles {
            root: view.files.root.clone(),
            dev_dir: view.files.dev_dir.clone(),
            gpus,
        })
    }

    /// Looks at the driver root again (for [`Self::missing_driver`] to clear once the
    /// driver is installed).
    pub fn rediscover_driver_files(&self) -> Result<(), PrepareError> {
        let files = DriverFiles::discover(&self.config.driver_root)?;
        *self
            .files
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Arc::new(DriverView::new(files, &self.config));
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the state as consistent as the checkpoint.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the lock and re-reads the checkpoint, so that a second plugin instance on the
    /// node (during a rolling update, both serialised by the shell's node lock) never has
    /// its records overwritten from a stale copy. A read costs no fsync; when the file
    /// changed under us, the inventory is rediscovered too (the other instance may have
    /// created or destroyed MIG devices).
    fn lock_synced(&self) -> Result<MutexGuard<'_, State>, PrepareError> {
        let mut state = self.lock();
        let on_disk = self.checkpoint.load()?;
        if on_disk.claims != state.data.claims {
            tracing::info!("checkpoint changed by another plugin instance; reloading");
            state.data.claims = on_disk.claims;
            match self.backend.inventory() {
                Ok(inventory) => state.inventory = inventory,
                Err(e) => tracing::warn!(error = %e, "rediscovering GPUs after reload"),
            }
        }
        Ok(state)
    }

    /// [`Self::lock_synced`] for read-only views: an unreadable checkpoint is logged and
    /// the cached state is used.
    fn lock_for_view(&self) -> MutexGuard<'_, State> {
        match self.lock_synced() {
            Ok(state) => state,
            Err(e) => {
                tracing::warn!(error = %e, "re-reading the checkpoint; using the cached state");
                self.lock()
            }
        }
    }

    /// Removes spec files (and temp files) of this driver's kind whose claim is not recorded.
    fn sweep_cdi_root(&self, data: &CheckpointData) {
        let prefix = cdi::spec_file_name("");
        let prefix = prefix.trim_end_matches(".json");
        let Ok(entries) = std::fs::read_dir(&self.config.cdi_root) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let stale = if let Some(uid) = name
                .strip_prefix(prefix)
                .and_then(|rest| rest.strip_suffix(".json"))
            {
                !data.claims.contains_key(uid)
            } else {
                name.starts_with(&format!(".{prefix}")) && name.ends_with(".tmp")
            };
            if stale {
                tracing::info!(file = %name, "removing CDI spec of an unrecorded claim");
                if let Err(e) = std::fs::remove_file(entry.path()) {
                    tracing::warn!(file = %name, error = %e, "removing stale CDI spec");
                }
            }
        }
    }

    /// Prepares a claim (see the module docs). Idempotent for a prepared claim.
    pub fn prepare(&self, claim: &ResourceClaim) -> Result<PreparedClaim, PrepareError> {
        let label = claim_label(claim);
        let uid = claim
            .metadata
            .uid
            .as_deref()
            .filter(|u| !u.is_empty())
            .ok_or_else(|| PrepareError::InvalidClaim {
                claim: label.clone(),
                reason: "no UID".into(),
            })?;
        cdi::validate_claim_uid(uid).map_err(|e| PrepareError::InvalidClaim {
            claim: label.clone(),
            reason: e.to_string(),
        })?;
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
        if let Some(record) = state.data.claims.get(uid) {
            match record.state {
                ClaimState::Prepared => return Ok(answer(record)),
                ClaimState::NeedsRecreate => {
                    // The kubelet replays prepare after a reboot: answer only once the
                    // hardware state exists again.
                    let state = &mut *state;
                    let result = self.recreate(uid, &mut state.data);
                    match self.backend.inventory() {
                        Ok(inventory) => state.inventory = inventory,
                        Err(e) => tracing::warn!(error = %e, "rediscovering GPUs after recreation"),
                    }
                    return match result {
                        Ok(()) => {
                            state.recreate_errors.remove(uid);
                            tracing::info!("recreated the hardware state of a prepared claim");
                            state.data.claims.get(uid).map(answer).ok_or_else(|| {
                                PrepareError::InvalidClaim {
                                    claim: label.clone(),
                                    reason: "record vanished during recreation".into(),
                                }
                            })
                        }
                        Err(e) => {
                            state.recreate_errors.insert(uid.to_owned(), e.to_string());
                            Err(e)
                        }
                    };
                }
                ClaimState::PrepareStarted => {
                    // Only left behind when a rollback failed; try it again first.
                    let record = record.clone();
                    self.release_record(&record, &state.data)?;
                    Self::forget_instances(&mut state.inventory, &record);
                    state.data.claims.remove(uid);
                    self.checkpoint.store(&state.data)?;
                }
            }
        }

        let plan = self.plan(claim, &label, uid, &state)?;
        let needs: Vec<DeviceNeed> = plan
            .iter()
            .map(|d| device_need(d.gpu.minor, d.mig.as_ref()))
            .collect();
        self.view_for(&label, &needs)?;
        let needs_intent = plan.iter().any(|d| {
            d.mig.as_ref().is_some_and(|m| m.created_by_cleave)
                || d.config
                    .as_ref()
                    .is_some_and(|c| c.config.sharing().is_some())
        });
        let mut record = ClaimRecord {
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
                    gpu_uuid: d.gpu.uuid.clone(),
                    gpu_minor: d.gpu.minor,
                    mig: d.mig.clone(),
                    config: d.config.as_ref().and_then(|c| serde_json::to_value(c).ok()),
                    cdi_device_ids: vec![cdi::qualified_device_id(uid, &d.name)],
                })
                .collect(),
            sharing: None,
        };
        if plan.iter().any(|d| {
            d.config
                .as_ref()
                .is_some_and(|c| c.config.sharing().is_some())
        }) {
            record.sharing = Some(serde_json::json!({}));
        }
        if needs_intent {
            state.data.claims.insert(uid.to_owned(), record.clone());
            if let Err(e) = self.checkpoint.store(&state.data) {
                state.data.claims.remove(uid);
                return Err(e.into());
            }
        }

        match self.execute(&label, uid, &plan, &mut record, &mut state) {
            Ok(()) => {
                tracing::info!(devices = record.devices.len(), "prepared");
                Ok(answer(&record))
            }
            Err(e) => {
                tracing::warn!(error = %e, "prepare failed; rolling back");
                match self.release_record(&record, &state.data) {
                    Ok(()) => {
                        Self::forget_instances(&mut state.inventory, &record);
                        if state.data.claims.remove(uid).is_some()
                            && let Err(store_err) = self.checkpoint.store(&state.data)
                        {
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
                        state.data.claims.insert(uid.to_owned(), record);
                        let _ = self.checkpoint.store(&state.data);
                    }
                }
                Err(e)
            }
        }
    }

    /// Checks the allocation and decides per device what to do; changes nothing.
    fn plan(
        &self,
        claim: &ResourceClaim,
        label: &str,
        uid: &str,
        state: &State,
    ) -> Result<Vec<PlannedDevice>, PrepareError> {
        let results = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref())
            .ok_or_else(|| PrepareError::NotAllocated {
                claim: label.to_owned(),
            })?;
        let driver = &self.config.driver_name;
        let pool = &self.config.pool_name;

        // Device name -> request names, in allocation order.
        let mut order: Vec<String> = Vec::new();
        let mut requests: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for r in results
            .iter()
            .filter(|r| &r.driver == driver && &r.pool == pool)
        {
            let entry = requests.entry(r.device.clone()).or_insert_with(|| {
                order.push(r.device.clone());
                Vec::new()
            });
            if !entry.contains(&r.request) {
                entry.push(r.request.clone());
            }
        }
        if order.is_empty() {
            let allocated = results
                .iter()
                .map(|r| format!("{}/{}/{}", r.driver, r.pool, r.device))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(PrepareError::NotForThisNode {
                claim: label.to_owned(),
                driver: driver.clone(),
                pool: pool.clone(),
                allocated: if allocated.is_empty() {
                    "nothing".into()
                } else {
                    allocated
                },
            });
        }

        let configs = self.effective_configs(claim, label)?;
        let unknown = |device: &str, reason: String| PrepareError::UnknownDevice {
            claim: label.to_owned(),
            device: device.to_owned(),
            pool: pool.clone(),
            reason,
        };

        let mut plan = Vec::with_capacity(order.len());
        for device in order {
            let request_names = requests.remove(&device).unwrap_or_default();
            let name: DeviceName = device
                .parse()
                .map_err(|e: cleave_api::names::NameError| unknown(&device, e.to_string()))?;
            let gpu = state
                .inventory
                .gpus
                .iter()
                .find(|g| g.minor == name.minor())
                .ok_or_else(|| unknown(&device, format!("no GPU with minor {}", name.minor())))?;

            // Last line of defence: the scheduler should never hand out a device twice.
            for other in state.data.claims.values().filter(|c| c.uid != uid) {
                if other.devices.iter().any(|d| d.name == device) {
                    return Err(PrepareError::DeviceBusy {
                        claim: label.to_owned(),
                        device,
                        other: format!("{}/{} ({})", other.namespace, other.name, other.uid),
                    });
                }
            }

            let (kind, mig) = self
                .plan_device(&name, gpu)
                .map_err(|r| unknown(&device, r))?;

            // One config per device: every request it serves must agree.
            let mut config: Option<ResolvedConfig> = None;
            for request in &request_names {
                let resolved = configs.get(request).cloned().flatten();
                if let Some(r) = &resolved {
                    r.sharing_for(ConfigKind::from(&name)).map_err(|e| {
                        PrepareError::InvalidConfig {
                            claim: label.to_owned(),
                            message: format!("device {device}: {e}"),
                        }
                    })?;
                }
                if config.is_some() && config != resolved {
                    return Err(PrepareError::InvalidConfig {
                        claim: label.to_owned(),
                        message: format!(
                            "device {device} is allocated for requests {request_names:?} with different configs"
                        ),
                    });
                }
                config = resolved;
            }

            plan.push(PlannedDevice {
                name: device,
                kind,
                request_names,
                gpu: gpu.clone(),
                mig,
                config,
            });
        }
        Ok(plan)
    }

    /// The kind of a device and the MIG instance behind it, or why it cannot be prepared.
    fn plan_device(
        &self,
        name: &DeviceName,
        gpu: &GpuInfo,
    ) -> Result<(DeviceKind, Option<MigRecord>), String> {
        match name {
            DeviceName::Gpu { .. } => match &gpu.mig {
                MigState::Enabled {
                    profiles,
                    memory_slices,
                    ..
                } => {
                    if !self.config.dynamic_mig {
                        return Err(
                            "the GPU has MIG enabled and on-demand MIG is off; use its MIG devices"
                                .into(),
                        );
                    }
                    let full = profiles
                        .iter()
                        .filter(|p| {
                            p.placements
                                .iter()
                                .any(|pl| pl.start == 0 && pl.size == *memory_slices)
                        })
                        .max_by_key(|p| (p.slice_count, p.memory_mib))
                        .ok_or("the GPU has MIG enabled but no full-size profile")?;
                    let placement = crate::model::Placement {
                        start: 0,
                        size: *memory_slices,
                    };
                    Ok((
                        DeviceKind::Gpu,
                        Some(MigRecord {
                            profile_id: full.id,
                            profile_name: full.name.clone(),
                            placement,
                            uuid: None,
                            gi_id: None,
                            ci_id: None,
                            created_by_cleave: true,
                            creating_in_boot: None,
                        }),
                    ))
                }
                _ => Ok((DeviceKind::Gpu, None)),
            },
            DeviceName::Mig { profile, start, .. } => {
                let MigState::Enabled {
                    profiles,
                    instances,
                    ..
                } = &gpu.mig
                else {
                    return Err("the GPU does not have MIG enabled".into());
                };
                let prof = profiles
                    .iter()
                    .find(|p| profile_label(&p.name) == *profile)
                    .ok_or_else(|| format!("the GPU has no MIG profile {profile}"))?;
                let placement = prof
                    .placements
                    .iter()
                    .find(|pl| pl.start == *start)
                    .copied()
                    .ok_or_else(|| {
                        format!("profile {} has no placement starting at {start}", prof.name)
                    })?;
                if let Some(inst) = instances
                    .iter()
                    .find(|i| i.profile_id == prof.id && i.placement == placement)
                {
                    return Ok((
                        DeviceKind::Mig,
                        Some(MigRecord {
                            profile_id: prof.id,
                            profile_name: prof.name.clone(),
                            placement,
                            uuid: Some(inst.uuid.clone()),
                            gi_id: Some(inst.gi_id),
                            ci_id: Some(inst.ci_id),
                            created_by_cleave: false,
                            creating_in_boot: None,
                        }),
                    ));
                }
                if !self.config.dynamic_mig {
                    return Err(
                        "no MIG instance exists at this placement and on-demand MIG is off".into(),
                    );
                }
                Ok((
                    DeviceKind::Mig,
                    Some(MigRecord {
                        profile_id: prof.id,
                        profile_name: prof.name.clone(),
                        placement,
                        uuid: None,
                        gi_id: None,
                        ci_id: None,
                        created_by_cleave: true,
                        creating_in_boot: None,
                    }),
                ))
            }
        }
    }

    /// Decodes, validates and merges the claim's opaque configs for this driver, per request
    /// name (`req` or `req/sub`) of the allocation results.
    fn effective_configs(
        &self,
        claim: &ResourceClaim,
        label: &str,
    ) -> Result<BTreeMap<String, Option<ResolvedConfig>>, PrepareError> {
        resolve_claim_configs(claim, &self.config.driver_name).map_err(|e| {
            PrepareError::InvalidConfig {
                claim: label.to_owned(),
                message: e.to_string(),
            }
        })
    }

    /// Steps 3 and 4 of prepare; on error the caller rolls back what `record` shows.
    fn execute(
        &self,
        label: &str,
        uid: &str,
        plan: &[PlannedDevice],
        record: &mut ClaimRecord,
        state: &mut State,
    ) -> Result<(), PrepareError> {
        // Create on-demand MIG instances.
        for (i, d) in plan.iter().enumerate() {
            let Some(mig) = d.mig.as_ref().filter(|m| m.created_by_cleave) else {
                continue;
            };
            let created = crate::timing::timed(crate::timing::step::MIG_CREATE, || {
                self.backend
                    .create_mig(&d.gpu.uuid, mig.profile_id, mig.placement)
            });
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
                m.uuid = Some(inst.uuid.clone());
                m.gi_id = Some(inst.gi_id);
                m.ci_id = Some(inst.ci_id);
            }
            tracing::info!(device = %d.name, mig = %inst.uuid, gi = inst.gi_id, ci = inst.ci_id, "created MIG device");
            if let Some(gpu) = state
                .inventory
                .gpus
                .iter_mut()
                .find(|g| g.uuid == d.gpu.uuid)
                && let MigState::Enabled { instances, .. } = &mut gpu.mig
            {
                instances.push(inst);
            }
        }

        // Sharing.
        let shared: Vec<SharingDevice> = plan
            .iter()
            .zip(&record.devices)
            .filter_map(|(d, r)| {
                let sharing = d.config.as_ref()?.config.sharing()?.clone();
                Some(SharingDevice {
                    device_name: d.name.clone(),
                    kind: if r.kind == DeviceKind::Mig {
                        ConfigKind::Mig
                    } else {
                        ConfigKind::Gpu
                    },
                    uuid: device_uuid(r),
                    gpu_uuid: r.gpu_uuid.clone(),
                    sharing,
                })
            })
            .collect();
        let edits = if shared.is_empty() {
            SharingEdits::default()
        } else {
            let claim = SharingClaim {
                uid,
                namespace: &record.namespace,
                name: &record.name,
            };
            let edits = crate::timing::timed(crate::timing::step::SHARING_APPLY, || {
                self.sharing.apply(&claim, &shared)
            })?;
            crate::fault::point("prepare.after_sharing_apply");
            record.sharing = Some(edits.state.clone().unwrap_or(serde_json::json!({})));
            edits
        };

        // CDI spec.
        crate::timing::timed(crate::timing::step::CDI_WRITE, || {
            self.write_cdi(uid, record, &edits)
        })?;

        // Durable record, then the answer.
        record.state = ClaimState::Prepared;
        let previous = state.data.claims.insert(uid.to_owned(), record.clone());
        if let Err(e) = self.checkpoint.store(&state.data) {
            match previous {
                Some(p) => state.data.claims.insert(uid.to_owned(), p),
                None => state.data.claims.remove(uid),
            };
            return Err(e.into());
        }
        Ok(())
    }

    /// Checks the sharing set-up of the recorded claims now, as at start: MPS daemons of
    /// live claims that died are started again (and their CDI specs rewritten), daemons of
    /// claims that are gone are stopped. Returns the claims whose sharing was restarted.
    /// Call it like prepare: under the node lock, from a blocking thread.
    pub fn reconcile_sharing(&self) -> Result<BTreeSet<String>, PrepareError> {
        let mut state = self.lock_synced()?;
        let live: BTreeSet<String> = state
            .data
            .claims
            .values()
            .filter(|r| r.state != ClaimState::NeedsRecreate)
            .map(|r| r.uid.clone())
            .collect();
        let restarted = self.sharing.reconcile(&live);
        for uid in &restarted {
            if let Err(e) = self.refresh_sharing(uid, &mut state.data) {
                tracing::error!(claim = %uid, error = %e, "rewriting the CDI spec of a claim whose sharing was restarted");
            }
        }
        Ok(restarted)
    }

    /// After the sharing of a prepared claim was started again (its MPS daemon had died):
    /// takes the sharing edits of now (a restarted daemon pod has a new `/dev/shm`), records
    /// them and rewrites the claim's CDI spec, so that containers started from now on use
    /// the new daemon.
    fn refresh_sharing(&self, uid: &str, data: &mut CheckpointData) -> Result<(), PrepareError> {
        let Some(mut record) = data.claims.get(uid).cloned() else {
            return Ok(());
        };
        let shared = recorded_sharing(&record);
        if shared.is_empty() {
            return Ok(());
        }
        let claim = SharingClaim {
            uid,
            namespace: &record.namespace,
            name: &record.name,
        };
        let edits = self.sharing.apply(&claim, &shared)?;
        record.sharing = Some(edits.state.clone().unwrap_or(serde_json::json!({})));
        self.write_cdi(uid, &record, &edits)?;
        data.claims.insert(uid.to_owned(), record);
        self.checkpoint.store(data)?;
        tracing::info!(claim = %uid, "rewrote the CDI spec of a claim whose sharing was restarted");
        Ok(())
    }

    /// Writes the claim's CDI spec from its record and the sharing edits.
    fn write_cdi(
        &self,
        uid: &str,
        record: &ClaimRecord,
        edits: &SharingEdits,
    ) -> Result<(), PrepareError> {
        let needs: Vec<DeviceNeed> = record
            .devices
            .iter()
            .map(|r| device_need(r.gpu_minor, r.mig.as_ref()))
            .collect();
        let label = format!("{}/{}", record.namespace, record.name);
        let view = self.view_for(&label, &needs)?;
        let devices: Vec<CdiDevice> = record
            .devices
            .iter()
            .map(|r| {
                let mut device_edits = match (&r.mig, r.kind) {
                    (Some(m), _) => cdi::mig_device_edits(
                        &view.files,
                        &r.name,
                        &device_uuid(r),
                        r.gpu_minor,
                        m.gi_id.unwrap_or_default(),
                        m.ci_id.unwrap_or_default(),
                    ),
                    (None, _) => {
                        cdi::gpu_device_edits(&view.files, &r.name, &r.gpu_uuid, r.gpu_minor)
                    }
                };
                if let Some(extra) = edits.device_edits.get(&r.name) {
                    device_edits.extend(extra);
                }
                CdiDevice {
                    device_name: r.name.clone(),
                    edits: device_edits,
                }
            })
            .collect();
        view.cdi
            .write_claim_spec(uid, &devices, &edits.claim_edits)
            .map_err(|source| PrepareError::Cdi {
                claim: uid.to_owned(),
                source,
            })?;
        Ok(())
    }

    /// Marks `Prepared` claims whose recorded MIG instances no longer exist as
    /// `NeedsRecreate` and forgets the vanished instances' IDs (one `list_mig` per GPU).
    fn mark_vanished(&self, data: &mut CheckpointData) {
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
                        && !self.destroy_recorded_bare(&d.gpu_uuid, gi_id, mig, &d.name)
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
    fn recreate(&self, uid: &str, data: &mut CheckpointData) -> Result<(), PrepareError> {
        let Some(mut record) = data.claims.get(uid).cloned() else {
            return Ok(());
        };
        let result = self.recreate_record(&mut record, data);
        if let Err(e) = &result {
            if let Some(r) = data.claims.get_mut(uid) {
                r.state = ClaimState::NeedsRecreate;
            }
            tracing::warn!(claim = %uid, error = %e, "recreation failed");
            if let Err(cdi_err) = self.view().cdi.remove_claim_spec(uid) {
                tracing::warn!(claim = %uid, error = %cdi_err, "removing the CDI spec of a claim waiting for recreation");
            }
        }
        result
    }

    fn recreate_record(
        &self,
        record: &mut ClaimRecord,
        data: &mut CheckpointData,
    ) -> Result<(), PrepareError> {
        let uid = record.uid.clone();
        let label = format!("{}/{}", record.namespace, record.name);
        let mut listed: BTreeMap<String, Vec<crate::model::MigInstance>> = BTreeMap::new();
        for i in 0..record.devices.len() {
            let d = &record.devices[i];
            let Some(mig) = d.mig.clone() else { continue };
            let (gpu, name) = (d.gpu_uuid.clone(), d.name.clone());
            let recreate_err = |source| PrepareError::MigRecreate {
                claim: label.clone(),
                device: name.clone(),
                profile: mig.profile_name.clone(),
                placement: mig.placement,
                source: Box::new(source),
            };
            if !listed.contains_key(&gpu) {
                let list = self.backend.list_mig(&gpu).map_err(recreate_err)?;
                listed.insert(gpu.clone(), list);
            }
            let list = listed.entry(gpu.clone()).or_default();
            // An instance recorded in this boot that still exists is kept.
            let kept = mig
                .uuid
                .as_ref()
                .and_then(|u| list.iter().find(|i| &i.uuid == u))
                .cloned();
            let inst = match kept {
                Some(inst) => inst,
                None if mig.created_by_cleave => {
                    let adopted = if mig.creating_in_boot.as_deref() == Some(data.boot_id.as_str())
                    {
                        // A crash of this boot came between our create and its record: the
                        // instance at exactly this profile and placement, recorded for nothing
                        // else, is ours.
                        let taken = recorded_uuids(data, record);
                        list.iter()
                            .find(|i| {
                                i.profile_id == mig.profile_id
                                    && i.placement == mig.placement
                                    && !taken.contains(&i.uuid)
                            })
                            .cloned()
                    } else {
                        None
                    };
                    match adopted {
                        Some(inst) => {
                            tracing::info!(device = %name, mig = %inst.uuid, gi = inst.gi_id, ci = inst.ci_id, "adopted the MIG device an interrupted recreation created");
                            inst
                        }
                        None => {
                            // Intent first, so that a crash after the create leaves an
                            // instance the next attempt recognises as ours.
                            if mig.creating_in_boot.as_deref() != Some(data.boot_id.as_str()) {
                                if let Some(m) = record.devices[i].mig.as_mut() {
                                    m.creating_in_boot = Some(data.boot_id.clone());
                                }
                                data.claims.insert(uid.clone(), record.clone());
                                if let Err(e) = self.checkpoint.store(data) {
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
                            } else {
                                // An intent of this boot without an instance: a crash (or a
                                // failed rollback) between the GPU instance and its compute
                                // instance may have left the GPU instance bare. It is ours.
                                let d = &record.devices[i];
                                self.destroy_bare(&uid, d, &mig)?;
                            }
                            let inst = match self.backend.create_mig(
                                &gpu,
                                mig.profile_id,
                                mig.placement,
                            ) {
                                Ok(inst) => inst,
                                Err(e) => {
                                    // Nothing was created: drop the intent, so that a later
                                    // attempt never takes an instance someone else made at
                                    // this placement (the usual cause of this failure). If
                                    // our own rollback left the GPU instance bare, keep it:
                                    // the next attempt destroys that instance first.
                                    let left_bare = matches!(e, BackendError::LeftBare { .. });
                                    if !left_bare && let Some(m) = record.devices[i].mig.as_mut() {
                                        m.creating_in_boot = None;
                                    }
                                    data.claims.insert(uid.clone(), record.clone());
                                    if let Err(store_err) = self.checkpoint.store(data) {
                                        tracing::warn!(claim = %uid, error = %store_err, "recording a failed recreation");
                                    }
                                    return Err(recreate_err(e));
                                }
                            };
                            crate::fault::point("recreate.after_mig_create");
                            tracing::info!(device = %name, mig = %inst.uuid, gi = inst.gi_id, ci = inst.ci_id, "recreated MIG device");
                            list.push(inst.clone());
                            inst
                        }
                    }
                }
                None => list
                    .iter()
                    .find(|i| i.profile_id == mig.profile_id && i.placement == mig.placement)
                    .cloned()
                    .ok_or_else(|| PrepareError::StaticMigMissing {
                        claim: label.clone(),
                        device: name.clone(),
                        profile: mig.profile_name.clone(),
                        placement: mig.placement,
                    })?,
            };
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
                // Recorded at once, so that unprepare or a retry finds it by UUID.
                data.claims.insert(uid.clone(), record.clone());
                self.checkpoint.store(data)?;
            }
        }

        let shared = recorded_sharing(record);
        let edits = if shared.is_empty() {
            SharingEdits::default()
        } else {
            let claim = SharingClaim {
                uid: &uid,
                namespace: &record.namespace,
                name: &record.name,
            };
            let edits = self.sharing.apply(&claim, &shared)?;
            crate::fault::point("recreate.after_sharing_apply");
            record.sharing = Some(edits.state.clone().unwrap_or(serde_json::json!({})));
            edits
        };
        self.write_cdi(&uid, record, &edits)?;

        record.state = ClaimState::Prepared;
        let previous = data.claims.insert(uid.clone(), record.clone());
        if let Err(e) = self.checkpoint.store(data) {
            if let Some(p) = previous {
                data.claims.insert(uid, p);
            }
            return Err(e.into());
        }
        Ok(())
    }

    /// Undoes everything a record describes, except the checkpoint entry: sharing, MIG
    /// instances cleave created (verified against NVML first), the CDI spec. Idempotent.
    /// An instance without a recorded UUID is looked for by profile and placement (skipping
    /// the UUIDs recorded in `data`) only for an interrupted prepare of this boot
    /// (`PrepareStarted`) or a recreation intent of this boot; never otherwise for a claim
    /// waiting for recreation, whose unrecorded instances do not exist.
    fn release_record(
        &self,
        record: &ClaimRecord,
        data: &CheckpointData,
    ) -> Result<(), PrepareError> {
        if record.sharing.is_some() {
            self.sharing.release(&record.uid, record.sharing.as_ref())?;
            crate::fault::point("release.after_sharing_release");
        }
        let taken = recorded_uuids(data, record);
        for d in record.devices.iter().rev() {
            let Some(mig) = d.mig.as_ref().filter(|m| m.created_by_cleave) else {
                continue;
            };
            let by_placement = record.state == ClaimState::PrepareStarted
                || mig.creating_in_boot.as_deref() == Some(data.boot_id.as_str());
            if mig.uuid.is_none() && !by_placement {
                continue;
            }
            self.destroy_owned(&record.uid, d, mig, &taken)?;
        }
        self.view()
            .cdi
            .remove_claim_spec(&record.uid)
            .map_err(|source| PrepareError::Cdi {
                claim: record.uid.clone(),
                source,
            })?;
        Ok(())
    }

    /// Destroys the instance cleave created for `device`, if it still exists. It is found by
    /// its UUID, or (when prepare or recreation was interrupted before the UUID was recorded)
    /// by profile and placement, never among `taken` (UUIDs recorded for claims); an instance
    /// that is not ours (different UUID) is left alone.
    fn destroy_owned(
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
            None => {
                i.profile_id == mig.profile_id
                    && i.placement == mig.placement
                    && !taken.contains(&i.uuid)
            }
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
    fn destroy_bare(
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
            b.profile_id == mig.profile_id
                && b.placement == mig.placement
                && mig.gi_id.is_none_or(|id| id == b.gi_id)
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
    fn destroy_recorded_bare(&self, gpu: &str, gi_id: u32, mig: &MigRecord, device: &str) -> bool {
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

    /// GPU instances without a compute instance on the MIG-enabled GPUs, by GPU UUID (the
    /// ones a failed destroy left; the pool publishes their placements as taken). A GPU
    /// that cannot be listed is skipped with a warning.
    pub fn bare_gpu_instances(&self) -> BTreeMap<String, Vec<crate::model::BareGpuInstance>> {
        let gpus: Vec<String> = self
            .lock_for_view()
            .inventory
            .gpus
            .iter()
            .filter(|g| g.mig.is_enabled())
            .map(|g| g.uuid.clone())
            .collect();
        let mut out = BTreeMap::new();
        for gpu in gpus {
            match self.backend.list_bare_gpu_instances(&gpu) {
                Ok(list) if !list.is_empty() => {
                    tracing::warn!(gpu = %gpu, bare = ?list, "GPU instances without compute instance; their placements are published as taken");
                    out.insert(gpu, list);
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(gpu = %gpu, error = %e, "listing GPU instances without compute instance")
                }
            }
        }
        out
    }

    /// Ids of the GPU instances without compute instance at exactly `mig`'s profile and
    /// placement on `gpu` (none when they cannot be listed).
    fn bare_at(&self, gpu: &str, mig: &MigRecord) -> Vec<u32> {
        match self.backend.list_bare_gpu_instances(gpu) {
            Ok(list) => list
                .iter()
                .filter(|b| b.profile_id == mig.profile_id && b.placement == mig.placement)
                .map(|b| b.gi_id)
                .collect(),
            Err(e) => {
                tracing::warn!(gpu, error = %e, "listing GPU instances without compute instance");
                Vec::new()
            }
        }
    }

    /// Finishes the rollbacks that failed before (records left `PrepareStarted` by another
    /// claim's prepare whose rollback could not destroy what it made, or by a crashed
    /// instance). Under the node lock no prepare is in flight, so every such record is a
    /// leftover. Their devices stay busy, and a bare GPU instance of theirs would make
    /// NVML refuse its placement to the next claim, so they are retried before every
    /// prepare; what still fails stays recorded and logged.
    fn retry_failed_rollbacks(&self, state: &mut State, except: &str) {
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
                    Self::forget_instances(&mut state.inventory, &record);
                    state.data.claims.remove(&record.uid);
                    match self.checkpoint.store(&state.data) {
                        Ok(()) => {
                            tracing::info!(claim = %record.uid, "finished an earlier rollback")
                        }
                        Err(e) => {
                            state.data.claims.insert(record.uid.clone(), record.clone());
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

    /// Removes the instances a record created from the cached inventory.
    fn forget_instances(inventory: &mut NodeInventory, record: &ClaimRecord) {
        for d in &record.devices {
            let Some(uuid) = d
                .mig
                .as_ref()
                .filter(|m| m.created_by_cleave)
                .and_then(|m| m.uuid.as_ref())
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
            self.view()
                .cdi
                .remove_claim_spec(claim_uid)
                .map_err(|source| PrepareError::Cdi {
                    claim: claim_uid.to_owned(),
                    source,
                })?;
            return Ok(());
        };
        self.release_record(&record, &state.data)?;
        Self::forget_instances(&mut state.inventory, &record);
        state.data.claims.remove(claim_uid);
        if let Err(e) = self.checkpoint.store(&state.data) {
            // Everything is released; keeping the record (now describing nothing that
            // exists) lets a retry finish the bookkeeping.
            state.data.claims.insert(claim_uid.to_owned(), record);
            return Err(e.into());
        }
        tracing::info!("unprepared");
        Ok(())
    }

    /// Claims whose hardware state is waiting to be recreated (after a reboot or a vanished
    /// instance), with the last recreation error of this process.
    pub fn claims_needing_recreate(&self) -> Vec<PendingRecreate> {
        let state = self.lock_for_view();
        state
            .data
            .claims
            .values()
            .filter(|r| r.state == ClaimState::NeedsRecreate)
            .map(|r| PendingRecreate {
                claim: ClaimRecordSummary {
                    uid: r.uid.clone(),
                    namespace: r.namespace.clone(),
                    name: r.name.clone(),
                },
                error: state.recreate_errors.get(&r.uid).cloned(),
            })
            .collect()
    }

    /// Claims recorded as prepared or being prepared (the shell unprepares those the API
    /// server no longer has).
    pub fn prepared_claims(&self) -> Vec<ClaimRecordSummary> {
        self.lock_for_view()
            .data
            .claims
            .values()
            .map(|r| ClaimRecordSummary {
                uid: r.uid.clone(),
                namespace: r.namespace.clone(),
                name: r.name.clone(),
            })
            .collect()
    }

    /// UUIDs of the MIG instances cleave created for claims (published as available
    /// placements, not as taken instances).
    pub fn owned_mig_uuids(&self) -> BTreeSet<String> {
        self.lock_for_view()
            .data
            .claims
            .values()
            .flat_map(|r| &r.devices)
            .filter_map(|d| d.mig.as_ref())
            .filter(|m| m.created_by_cleave)
            .filter_map(|m| m.uuid.clone())
            .collect()
    }

    /// The current inventory (updated by prepare/unprepare and [`Self::refresh_inventory`]).
    pub fn inventory(&self) -> NodeInventory {
        self.lock_for_view().inventory.clone()
    }

    /// Rediscovers the inventory through the backend.
    pub fn refresh_inventory(&self) -> Result<(), PrepareError> {
        let mut state = self.lock();
        state.inventory = self.backend.inventory().map_err(PrepareError::Discovery)?;
        Ok(())
    }

    /// The driver files found last (at start, or when a claim needed a missing one).
    pub fn driver_files(&self) -> Arc<DriverFiles> {
        Arc::clone(&self.view().files)
    }

    /// The settings the driver runs with.
    pub fn config(&self) -> &DriverConfig {
        &self.config
    }
}

/// What a device needs from the driver root: the GPU's node, or for a MIG device the
/// parent's node and the capability nodes of its (possibly not yet created) instance.
fn device_need(gpu_minor: u32, mig: Option<&MigRecord>) -> DeviceNeed {
    match mig {
        None => DeviceNeed::Gpu { minor: gpu_minor },
        Some(m) => DeviceNeed::Mig {
            gpu_minor,
            ids: m.gi_id.zip(m.ci_id),
        },
    }
}

/// UUID the container sees for a device: the MIG instance's, else the GPU's.
fn device_uuid(record: &DeviceRecord) -> String {
    record
        .mig
        .as_ref()
        .and_then(|m| m.uuid.clone())
        .unwrap_or_else(|| record.gpu_uuid.clone())
}

/// Forgets the IDs of every MIG instance of a record, and any recreation intent (after a
/// reboot none of them exists).
fn forget_instances_of(record: &mut ClaimRecord) {
    for m in record.devices.iter_mut().filter_map(|d| d.mig.as_mut()) {
        m.uuid = None;
        m.gi_id = None;
        m.ci_id = None;
        m.creating_in_boot = None;
    }
}

/// UUIDs of the MIG instances recorded for any claim, `record` (the copy being recreated)
/// included: an instance among them is never adopted by a recreation.
fn recorded_uuids(data: &CheckpointData, record: &ClaimRecord) -> BTreeSet<String> {
    data.claims
        .values()
        .filter(|r| r.uid != record.uid)
        .chain(std::iter::once(record))
        .flat_map(|r| &r.devices)
        .filter_map(|d| d.mig.as_ref()?.uuid.clone())
        .collect()
}

/// The sharing devices of a record, from the effective configs it recorded.
fn recorded_sharing(record: &ClaimRecord) -> Vec<SharingDevice> {
    record
        .devices
        .iter()
        .filter_map(|r| {
            let resolved: ResolvedConfig = match serde_json::from_value(r.config.clone()?) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(claim = %record.uid, device = %r.name, error = %e, "recorded config does not decode; no sharing");
                    return None;
                }
            };
            let sharing = resolved.config.sharing()?.clone();
            Some(SharingDevice {
                device_name: r.name.clone(),
                kind: if r.kind == DeviceKind::Mig {
                    ConfigKind::Mig
                } else {
                    ConfigKind::Gpu
                },
                uuid: device_uuid(r),
                gpu_uuid: r.gpu_uuid.clone(),
                sharing,
            })
        })
        .collect()
}

/// The kubelet answer for a recorded claim.
fn answer(record: &ClaimRecord) -> PreparedClaim {
    PreparedClaim {
        devices: record
            .devices
            .iter()
            .map(|d| {
                let mut request_names: Vec<String> = Vec::new();
                for r in &d.request_names {
                    let base = base_request(r).to_owned();
                    if !request_names.contains(&base) {
                        request_names.push(base);
                    }
                }
                PreparedDevice {
                    request_names,
                    pool_name: d.pool.clone(),
                    device_name: d.name.clone(),
                    cdi_device_ids: d.cdi_device_ids.clone(),
                }
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests;
