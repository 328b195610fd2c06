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
//! - `mod.rs`: the types (errors apart), [`NodeDriver`] with its start (the recovery
//!   sequence: `Recovery`, the rollback of interrupted prepares, recreation, the CDI sweep,
//!   sharing reconciliation, also run later by [`NodeDriver::reconcile_sharing`]) and its
//!   read-only accessors;
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
//!   and its device metadata, written from `apply` only (`execute` uses just `cdi_name`, for
//!   the CDI IDs it records);
//! - `execute`: prepare (intent record, then the apply step), rollback, unprepare; it calls
//!   `apply`, never the other way round;
//! - `error`: [`PrepareError`] and [`Refusal`] (re-exported here);
//! - `files`: the driver files and the CDI store on their common edits, looked at again when
//!   a claim needs a missing file; the sweep of CDI specs of unrecorded claims;
//! - `summary`: read-only views of the checkpoint for metrics and status
//!   ([`CheckpointReader`], [`NodeDriver::checkpoint_summary`]).

mod apply;
mod cdi_spec;
mod error;
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

use crate::backend::GpuBackend;
use crate::checkpoint::{
    self, CheckpointData, CheckpointStore, ClaimState, DeviceRecord, MigRecord,
};
use crate::driver_root::{DeviceNeed, DriverFiles, DriverRootConfig};
use crate::model::NodeInventory;
use crate::sharing::{NoopSharing, SharingHandler};

/// Where the plugin and its tests find a shared daemon's name (the sharing seam defines it).
pub use crate::sharing::shared_daemon_key;
pub use error::{PrepareError, Refusal};
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
