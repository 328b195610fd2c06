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

pub mod sharing;
#[cfg(any(test, feature = "testing"))]
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
use crate::driver_root::{DriverFiles, DriverRootConfig, DriverRootError};
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
}

/// The node side of the driver: prepare/unprepare with durable state.
pub struct NodeDriver {
    config: DriverConfig,
    backend: Arc<dyn GpuBackend>,
    sharing: Arc<dyn SharingHandler>,
    files: DriverFiles,
    cdi: CdiStore,
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
    /// half-done prepares (and drops everything recorded in an earlier boot), removes CDI
    /// files of unrecorded claims, and discovers the inventory.
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
        let files = DriverFiles::discover(&config.driver_root)?;
        let cdi = CdiStore::new(&config.cdi_root, files.common_edits());
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
            files,
            cdi,
            checkpoint,
            state: Mutex::new(State {
                inventory: NodeInventory {
                    driver_version: String::new(),
                    driver_semver: String::new(),
                    cuda_driver_semver: String::new(),
                    gpus: Vec::new(),
                },
                data: CheckpointData::default(),
            }),
        };

        if !data.boot_id.is_empty() && data.boot_id != boot_id {
            // MIG instances do not survive a reboot and /var/run/cdi is a tmpfs: what the
            // records describe is gone. Instances present now were made by someone else
            // (e.g. a boot-time MIG config) and must not be touched.
            tracing::info!(
                claims = data.claims.len(),
                "boot ID changed since the checkpoint was written; forgetting prepared claims"
            );
            for uid in data.claims.keys() {
                if let Err(e) = driver.cdi.remove_claim_spec(uid) {
                    tracing::warn!(claim = %uid, error = %e, "removing CDI spec of a previous boot");
                }
            }
            data.claims.clear();
        }
        data.boot_id = boot_id;

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
            match driver.release_record(&record) {
                Ok(()) => {
                    data.claims.remove(&uid);
                }
                // Keep serving: the record stays (its devices count as busy) and the next
                // prepare or unprepare of the claim retries the rollback.
                Err(e) => tracing::error!(claim = %uid, error = %e, "rollback failed; kept"),
            }
        }
        driver.checkpoint.store(&data)?;
        driver.sweep_cdi_root(&data);
        let live: BTreeSet<String> = data.claims.keys().cloned().collect();
        driver.sharing.reconcile(&live);

        let inventory = driver
            .backend
            .inventory()
            .map_err(PrepareError::Discovery)?;
        {
            let mut state = driver.lock();
            state.inventory = inventory;
            state.data = data;
        }
        Ok(driver)
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
        let Ok(entries) = std::fs::read_dir(self.cdi.root()) else {
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
        if let Some(record) = state.data.claims.get(uid) {
            match record.state {
                ClaimState::Prepared => return Ok(answer(record)),
                ClaimState::PrepareStarted => {
                    // Only left behind when a rollback failed; try it again first.
                    let record = record.clone();
                    self.release_record(&record)?;
                    Self::forget_instances(&mut state.inventory, &record);
                    state.data.claims.remove(uid);
                    self.checkpoint.store(&state.data)?;
                }
            }
        }

        let plan = self.plan(claim, &label, uid, &state)?;
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
                match self.release_record(&record) {
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
            let inst = self
                .backend
                .create_mig(&d.gpu.uuid, mig.profile_id, mig.placement)
                .map_err(|source| PrepareError::MigCreate {
                    claim: label.to_owned(),
                    device: d.name.clone(),
                    source,
                })?;
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
            let edits = self.sharing.apply(&claim, &shared)?;
            record.sharing = Some(edits.state.clone().unwrap_or(serde_json::json!({})));
            edits
        };

        // CDI spec.
        let devices: Vec<CdiDevice> = record
            .devices
            .iter()
            .map(|r| {
                let mut device_edits = match (&r.mig, r.kind) {
                    (Some(m), _) => cdi::mig_device_edits(
                        &self.files,
                        &r.name,
                        &device_uuid(r),
                        r.gpu_minor,
                        m.gi_id.unwrap_or_default(),
                        m.ci_id.unwrap_or_default(),
                    ),
                    (None, _) => {
                        cdi::gpu_device_edits(&self.files, &r.name, &r.gpu_uuid, r.gpu_minor)
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
        self.cdi
            .write_claim_spec(uid, &devices, &edits.claim_edits)
            .map_err(|source| PrepareError::Cdi {
                claim: uid.to_owned(),
                source,
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

    /// Undoes everything a record describes, except the checkpoint entry: sharing, MIG
    /// instances cleave created (verified against NVML first), the CDI spec. Idempotent.
    fn release_record(&self, record: &ClaimRecord) -> Result<(), PrepareError> {
        if record.sharing.is_some() {
            self.sharing.release(&record.uid, record.sharing.as_ref())?;
        }
        for d in record.devices.iter().rev() {
            let Some(mig) = d.mig.as_ref().filter(|m| m.created_by_cleave) else {
                continue;
            };
            self.destroy_owned(&record.uid, d, mig)?;
        }
        self.cdi
            .remove_claim_spec(&record.uid)
            .map_err(|source| PrepareError::Cdi {
                claim: record.uid.clone(),
                source,
            })?;
        Ok(())
    }

    /// Destroys the instance cleave created for `device`, if it still exists. It is found by
    /// its UUID, or (when prepare was interrupted before the UUID was recorded) by profile
    /// and placement; an instance that is not ours (different UUID) is left alone.
    fn destroy_owned(
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
        let existing = match self.backend.list_mig(&device.gpu_uuid) {
            Ok(list) => list,
            // The GPU is gone (or NVML lost it): nothing of ours can be left on it.
            Err(BackendError::GpuNotFound(_)) => return Ok(()),
            Err(e) => return Err(err(e)),
        };
        let target = existing.iter().find(|i| match &mig.uuid {
            Some(uuid) => &i.uuid == uuid,
            None => i.profile_id == mig.profile_id && i.placement == mig.placement,
        });
        let Some(inst) = target else {
            tracing::info!(device = %device.name, "MIG device already gone");
            return Ok(());
        };
        self.backend
            .destroy_mig(&device.gpu_uuid, inst.gi_id, inst.ci_id)
            .map_err(err)?;
        tracing::info!(device = %device.name, mig = %inst.uuid, "destroyed MIG device");
        Ok(())
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
            self.cdi
                .remove_claim_spec(claim_uid)
                .map_err(|source| PrepareError::Cdi {
                    claim: claim_uid.to_owned(),
                    source,
                })?;
            return Ok(());
        };
        self.release_record(&record)?;
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

    /// The driver files found at start.
    pub fn driver_files(&self) -> &DriverFiles {
        &self.files
    }

    /// The settings the driver runs with.
    pub fn config(&self) -> &DriverConfig {
        &self.config
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
