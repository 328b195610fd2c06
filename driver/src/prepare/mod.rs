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
//! [`NodeDriver`] is a façade: each part below is its own type with its own tests, and the
//! façade runs the sequences over them. The code is split by phase:
//! - `mod.rs`: the types, [`NodeDriver`] with its start (the recovery sequence: `Recovery`,
//!   the rollback of interrupted prepares, recreation, the CDI sweep, sharing reconciliation,
//!   also run later by [`NodeDriver::reconcile_sharing`]) and its read-only accessors;
//! - `store`: the claim store: the checkpoint file and the locked in-memory state, with
//!   record writes that put memory back when the file cannot be written;
//! - `plan`: the `Planner`, which holds only the settings it reads: decode the allocation,
//!   merge and validate configs, decide what to create (no backend, no I/O; a MIG device's
//!   instance is decided once as a `MigPlan`: existing, to create, or joined from another
//!   share of the device);
//! - `mig`: `MigOps`, every MIG call (list, create, destroy, bare-instance cleanup) over the
//!   backend;
//! - `recover`: `Recovery`, the MIG side of recovery over `MigOps` and the claim store alone:
//!   what a reboot does to the records, vanished instances, finding, adopting or creating
//!   again a record's instances (its module docs give the whole discipline);
//! - `apply`: the one apply step (MIG instances, sharing, CDI spec, device metadata, the
//!   `Prepared` record) that prepare, recreation and the refresh of restarted sharing run,
//!   each as an `ApplyPath`; it creates prepare's on-demand MIG instances and applies the
//!   claim's sharing and shares itself;
//! - `cdi_spec`: what the apply step writes besides the hardware state: the claim's CDI spec
//!   and its device metadata (called from `apply` only, and `cdi_name` from `execute`);
//! - `execute`: prepare (intent record, then the apply step), rollback, unprepare; it calls
//!   `apply`, never the other way round;
//! - `files`: the driver files and the CDI store on their common edits, looked at again when
//!   a claim needs a missing file; the sweep of CDI specs of unrecorded claims;
//! - `summary`: read-only views of the checkpoint for metrics and status
//!   ([`CheckpointReader`], [`NodeDriver::checkpoint_summary`]).

mod apply;
mod cdi_spec;
mod execute;
mod files;
mod mig;
mod plan;
mod recover;
mod reset;
mod shares;
mod status;
mod store;
mod summary;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, MutexGuard};

use cleave_api::pool::ConsumableCapacity;

use crate::backend::{BackendError, GpuBackend};
use crate::cdi::CdiError;
use crate::checkpoint::{
    self, CheckpointData, CheckpointError, CheckpointStore, ClaimState, DeviceRecord, MigRecord,
};
use crate::driver_root::{DeviceNeed, DriverFiles, DriverRootConfig, DriverRootError};
use crate::model::NodeInventory;
use crate::sharing::{NoopSharing, SharingFailure, SharingHandler};

/// Where the plugin and its tests find a shared daemon's name (the sharing seam defines it).
pub use crate::sharing::shared_daemon_key;
use recover::{Recovery, claims_in, claims_of_restarted, live_sharing};
pub use reset::{ResetError, ResetOptions, ResetOutcome, reset_checkpoint, short_reason};
pub use shares::{share_holders, time_slice_needs};
pub use status::{
    ClaimStatusReport, DeviceStatusData, DeviceStatusEntry, MigStatus, MpsStatus,
    STATUS_API_VERSION, STATUS_KIND, ShareStatus,
};
use store::{ClaimStore, State};
pub use summary::{CheckpointReader, CheckpointSummary, RecordedClaim, RecordedState};

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
    /// Consumable capacity (`--consumable-capacity`): how shares of one device (allocation
    /// results with a `shareID`) are prepared; `Off` refuses them.
    pub consumable_capacity: ConsumableCapacity,
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
    /// The device is prepared for another claim. The message names only the requesting
    /// claim's objects (the other claim may be another tenant's); `other` is for logs.
    #[error("claim {claim}: device {device} is already prepared for another claim; {hint}")]
    DeviceBusy {
        /// `namespace/name`.
        claim: String,
        /// Device name.
        device: String,
        /// UID of the other claim (not in the message).
        other: String,
        /// What may have caused it.
        hint: String,
    },
    /// The allocation exceeds its device: a share beyond it, shares summing past it, a
    /// device prepared for another claim in another way, or an on-demand MIG placement
    /// overlapping one prepared on the same GPU (the scheduler over-committed it).
    #[error(
        "claim {claim}: device {device}: over-commit: {what}; {}",
        plan::OVER_COMMIT_HINT
    )]
    OverCommit {
        /// `namespace/name`.
        claim: String,
        /// Device name.
        device: String,
        /// What exceeds what, with the figures.
        what: String,
    },
    /// A share (consumable capacity) cannot be prepared as allocated.
    #[error("claim {claim}: device {device}: {reason}")]
    ShareRefused {
        /// `namespace/name`.
        claim: String,
        /// Device name.
        device: String,
        /// Why, and what to do.
        reason: String,
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
    Sharing(#[from] SharingFailure),
    /// Writing or removing the CDI spec failed (the error names the path).
    #[error("claim {claim}: {source}")]
    Cdi {
        /// Claim UID.
        claim: String,
        /// The CDI error.
        source: CdiError,
    },
    /// Removing a claim's device metadata failed (the error names the path).
    #[error("claim {claim}: {source}")]
    Metadata {
        /// Claim UID.
        claim: String,
        /// The metadata error.
        source: crate::metadata::MetadataError,
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

/// Why a prepare was refused, as a type: the plugin takes its metric label and whether the
/// claim's owner gets an Event from it, never from the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// The allocation exceeds its device ([`PrepareError::OverCommit`],
    /// [`PrepareError::DeviceBusy`]): an old or buggy scheduler, or a mode changed under
    /// prepared claims.
    OverCommit,
    /// The claim itself: no usable UID, an unknown device.
    Claim,
    /// The claim is not allocated, or nothing of it to this node.
    Allocation,
    /// An opaque config, or a share the device cannot serve as configured.
    Config,
    /// The driver root lacks a device node or library the claim's containers need.
    DriverFiles,
    /// The driver root holds no driver at all, or cannot be read: the node's setup.
    DriverRoot,
    /// Creating, destroying or recreating a MIG instance.
    Mig,
    /// Starting or stopping sharing (MPS daemons, time-slicing).
    Sharing,
    /// The node's own state: GPU discovery, CDI files, metadata, the checkpoint,
    /// directories, the boot ID.
    Node,
}

impl Refusal {
    /// The `reason` label of the plugin's `prepare_refusals` metric.
    pub fn label(self) -> &'static str {
        match self {
            Self::OverCommit => "over_commit",
            Self::Claim => "claim",
            Self::Allocation => "allocation",
            Self::Config => "config",
            Self::DriverFiles => "driver_files",
            Self::DriverRoot => "driver_root",
            Self::Mig => "mig",
            Self::Sharing => "sharing",
            Self::Node => "node",
        }
    }

    /// Whether the claim's owner can act on it (fix the config or the claim, ask for
    /// another device) and so gets a Warning Event on the claim.
    pub fn actionable(self) -> bool {
        matches!(
            self,
            Self::OverCommit | Self::Claim | Self::Config | Self::DriverFiles
        )
    }
}

impl PrepareError {
    /// What kind of refusal this is.
    pub fn refusal(&self) -> Refusal {
        match self {
            Self::OverCommit { .. } | Self::DeviceBusy { .. } => Refusal::OverCommit,
            Self::InvalidClaim { .. } | Self::UnknownDevice { .. } => Refusal::Claim,
            Self::NotAllocated { .. } | Self::NotForThisNode { .. } => Refusal::Allocation,
            Self::InvalidConfig { .. } | Self::ShareRefused { .. } => Refusal::Config,
            Self::MissingDriverFiles { .. } => Refusal::DriverFiles,
            Self::NoDriverFiles { .. } | Self::DriverRoot(_) => Refusal::DriverRoot,
            Self::MigCreate { .. }
            | Self::MigDestroy { .. }
            | Self::MigRecreate { .. }
            | Self::StaticMigMissing { .. } => Refusal::Mig,
            Self::Sharing(_) => Refusal::Sharing,
            Self::Discovery(_)
            | Self::Cdi { .. }
            | Self::Metadata { .. }
            | Self::Checkpoint(_)
            | Self::CreateDir { .. }
            | Self::BootId { .. } => Refusal::Node,
        }
    }
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
    /// The allocation's `shareID` when the device was prepared as a share.
    pub share_id: Option<String>,
}

pub use crate::model::ClaimRef;

/// A claim whose hardware state is waiting to be recreated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRecreate {
    /// The claim.
    pub claim: ClaimRef,
    /// The last recreation error seen by this process, if any attempt failed.
    pub error: Option<String>,
}

/// The node side of the driver: prepare/unprepare with durable state.
pub struct NodeDriver {
    config: DriverConfig,
    /// Decides what a prepare does, from the claim and the recorded state.
    planner: plan::Planner,
    /// MIG create, destroy and bare-instance cleanup.
    mig: mig::MigOps,
    backend: Arc<dyn GpuBackend>,
    sharing: Arc<dyn SharingHandler>,
    /// Driver files and the CDI store built on their common edits; replaced when a claim
    /// needs a file that was missing (a driver installed after start).
    files: files::Files,
    /// The checkpoint and the in-memory state under its lock.
    claims: ClaimStore,
    /// Device metadata files (`--device-metadata`): set once by
    /// [`NodeDriver::enable_device_metadata`], before the first prepare.
    metadata: std::sync::OnceLock<MetadataSettings>,
}

/// Where device metadata goes and how the pool (whose attributes it copies) is built.
#[derive(Debug)]
pub(super) struct MetadataSettings {
    pub(super) store: crate::metadata::MetadataStore,
    pub(super) pool: crate::pool::PoolOptions,
}

impl std::fmt::Debug for NodeDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeDriver")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
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
        let files = files::Files::discover(&config)?;
        let checkpoint = CheckpointStore::in_dir(&config.state_dir);
        let boot_id = checkpoint::read_boot_id(&config.boot_id_path).map_err(|source| {
            PrepareError::BootId {
                path: config.boot_id_path.clone(),
                source,
            }
        })?;
        let mut data = checkpoint.load()?;

        let driver = Self {
            planner: plan::Planner::new(&config),
            mig: mig::MigOps::new(Arc::clone(&backend)),
            config,
            backend,
            sharing,
            files,
            claims: ClaimStore::new(checkpoint, State::empty()),
            metadata: std::sync::OnceLock::new(),
        };

        let recreate_errors = driver.recover_at_start(&mut data, boot_id)?;

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

    /// Start's recovery, in order: brings the records in line with this boot and stores
    /// the boot ID ([`Recovery::at_start`]); rolls back interrupted prepares; recreates
    /// `NeedsRecreate` claims (best effort, errors returned by claim UID); sweeps CDI files
    /// of unrecorded claims; reconciles sharing of the live claims.
    fn recover_at_start(
        &self,
        data: &mut CheckpointData,
        boot_id: String,
    ) -> Result<BTreeMap<String, String>, PrepareError> {
        // Discovered only if sharing needs GPU facts; start discovers again at its end.
        let mut inventory = State::empty().inventory;
        Recovery::new(&self.mig, &self.claims).at_start(data, boot_id)?;

        for uid in claims_in(data, ClaimState::PrepareStarted) {
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

        let mut recreate_errors = BTreeMap::new();
        for uid in claims_in(data, ClaimState::NeedsRecreate) {
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

        files::sweep_cdi_root(&self.config.cdi_root, data);
        let restarted = self.sharing.reconcile(&live_sharing(data));
        self.refresh_restarted(&restarted, data, &mut inventory);
        Ok(recreate_errors)
    }

    /// Rewrites the CDI specs of the claims that use the sharing `restarted` by
    /// reconciliation, then tells the sharing handler which of those set-ups have every
    /// client refreshed (a set-up with a failed claim is reported again next time). Returns
    /// the claims refreshed.
    fn refresh_restarted(
        &self,
        restarted: &BTreeSet<String>,
        data: &mut CheckpointData,
        inventory: &mut NodeInventory,
    ) -> BTreeSet<String> {
        let claims = claims_of_restarted(data, restarted);
        let mut failed = BTreeSet::new();
        for uid in &claims {
            if let Err(e) = self.refresh_sharing(uid, data, inventory) {
                tracing::error!(claim = %uid, error = %e, "rewriting the CDI spec of a claim whose sharing was restarted; retried at the next check");
                failed.insert(uid.clone());
            }
        }
        let done: BTreeSet<String> = restarted
            .iter()
            .filter(|key| {
                let one = BTreeSet::from([(*key).clone()]);
                claims_of_restarted(data, &one).is_disjoint(&failed)
            })
            .cloned()
            .collect();
        self.sharing.clients_refreshed(&done);
        claims
    }

    /// Checks the sharing set-up of the recorded claims now, as at start: MPS daemons of
    /// live claims that died are started again (and their CDI specs rewritten), daemons of
    /// claims that are gone are stopped. Returns the claims whose sharing was restarted.
    /// Call it like prepare: under the node lock, from a blocking thread.
    pub fn reconcile_sharing(&self) -> Result<BTreeSet<String>, PrepareError> {
        let mut state = self.lock_synced()?;
        let live = live_sharing(&state.data);
        let restarted = self.sharing.reconcile(&live);
        let state = &mut *state;
        Ok(self.refresh_restarted(&restarted, &mut state.data, &mut state.inventory))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.claims.lock()
    }

    /// [`ClaimStore::lock_synced`]; when the file changed under us, the inventory is
    /// rediscovered too (the other instance may have created or destroyed MIG devices).
    fn lock_synced(&self) -> Result<MutexGuard<'_, State>, PrepareError> {
        let (mut state, changed) = self.claims.lock_synced()?;
        if changed {
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
                claim: ClaimRef {
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
    pub fn prepared_claims(&self) -> Vec<ClaimRef> {
        self.lock_for_view()
            .data
            .claims
            .values()
            .map(|r| ClaimRef {
                uid: r.uid.clone(),
                namespace: r.namespace.clone(),
                name: r.name.clone(),
            })
            .collect()
    }

    /// The device metadata store of this driver's state directory and CDI root.
    pub(super) fn metadata_store(&self) -> crate::metadata::MetadataStore {
        crate::metadata::MetadataStore::new(
            &self.config.driver_name,
            &self.config.state_dir,
            &self.config.cdi_root,
        )
    }

    /// Turns on device metadata files (KEP-5304, [`crate::metadata`]): every later prepare
    /// writes one per request, with the attributes the pool built with `pool` publishes,
    /// under the state directory, and adds its CDI ID to the request's first device.
    /// Removes the metadata of claims the checkpoint does not hold (a crash between the
    /// write and the record, or a claim unprepared while the flag was off). A second call
    /// changes nothing.
    pub fn enable_device_metadata(&self, pool: crate::pool::PoolOptions) {
        let store = self.metadata_store();
        let recorded: Vec<(String, String, String)> = self
            .lock_for_view()
            .data
            .claims
            .values()
            .map(|r| (r.namespace.clone(), r.name.clone(), r.uid.clone()))
            .collect();
        match store.sweep(&recorded) {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                removed = n,
                "removed device metadata of claims no longer prepared"
            ),
            Err(e) => tracing::warn!(error = %e, "sweeping device metadata"),
        }
        let _ = self.metadata.set(MetadataSettings { store, pool });
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
            .filter(|m| m.is_cleaves())
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
        Arc::clone(&self.files.view().files)
    }

    /// When NVML sees GPUs but the driver root holds no driver files at all (a wrong
    /// `--driver-root`, or a driver container still installing): the error saying so.
    /// Claims are refused meanwhile (naming the files); the shell keeps the node from
    /// being offered.
    pub fn missing_driver(&self) -> Option<PrepareError> {
        let gpus = self.lock_for_view().inventory.gpus.len();
        self.files.missing_driver(gpus)
    }

    /// Looks at the driver root again (for [`Self::missing_driver`] to clear once the
    /// driver is installed).
    pub fn rediscover_driver_files(&self) -> Result<(), PrepareError> {
        self.files.rediscover().map(drop)
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

#[cfg(test)]
mod tests;
