//! Phase 1 of prepare: plan. Reads the claim's allocation results for this driver and
//! pool, checks that every device is known here and not prepared for another claim,
//! resolves and validates the opaque configs (class then claim, per request) and decides per
//! device what exists and what must be created. Nothing on the node changes here.

use std::collections::BTreeMap;

use cleave_api::merge::{ResolvedConfig, resolve_claim_configs};
use cleave_api::names::{DeviceName, profile_label};
use k8s_openapi::api::resource::v1::ResourceClaim;

use cleave_api::config::SharingStrategy;
use cleave_api::pool::ConsumableCapacity;

use super::{DriverConfig, PrepareError, State};
use crate::checkpoint::{DeviceKind, MigRecord, ShareRecord};
use crate::model::{GpuInfo, MigState, Placement};
use crate::sharing::{Capacity, takes_whole_device};

/// What prepare will do for one device, decided before anything changes.
pub(super) struct PlannedDevice {
    pub(super) name: String,
    pub(super) kind: DeviceKind,
    /// Allocated with admin access: prepared beside other claims, nothing applied.
    pub(super) admin_access: bool,
    pub(super) request_names: Vec<String>,
    pub(super) gpu: GpuInfo,
    /// The MIG instance behind the device and what prepare does about it.
    pub(super) mig: Option<MigPlan>,
    pub(super) config: Option<ResolvedConfig>,
    /// The share of the device the claim gets (an allocation result with a `shareID`);
    /// `None`: the claim has the device alone.
    pub(super) share: Option<ShareRecord>,
}

/// What prepare does for the MIG instance of a device, decided once by the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum MigPlan {
    /// An instance that existed before cleave prepared the device (static): used, never
    /// destroyed.
    Existing(MigRecord),
    /// An on-demand instance this prepare creates (and unprepare destroys).
    Create {
        /// GPU-instance profile id.
        profile_id: u32,
        /// Profile name (`1g.10gb`).
        profile_name: String,
        /// Placement of the GPU instance.
        placement: Placement,
    },
    /// The instance another share of the device holds (static or on demand): it serves
    /// this share too; nothing is created.
    Join(MigRecord),
}

impl MigPlan {
    /// Placement of the GPU instance.
    pub(super) fn placement(&self) -> Placement {
        match self {
            Self::Existing(m) | Self::Join(m) => m.placement,
            Self::Create { placement, .. } => *placement,
        }
    }

    /// The instance is cleave's (created for this or another share of the device):
    /// prepare records an intent before it touches anything.
    pub(super) fn is_cleaves(&self) -> bool {
        match self {
            Self::Create { .. } => true,
            Self::Existing(_) => false,
            Self::Join(m) => m.is_cleaves(),
        }
    }

    /// The durable record of the instance as prepare first writes it: the one place where
    /// the plan's shapes become the checkpoint's flags (`createdByCleave`, no UUID yet).
    pub(super) fn record(&self) -> MigRecord {
        match self {
            Self::Existing(m) | Self::Join(m) => m.clone(),
            Self::Create {
                profile_id,
                profile_name,
                placement,
            } => MigRecord {
                profile_id: *profile_id,
                profile_name: profile_name.clone(),
                placement: *placement,
                uuid: None,
                gi_id: None,
                ci_id: None,
                created_by_cleave: true,
                creating_in_boot: None,
            },
        }
    }
}

/// The share an allocation result describes, from its `shareID` and `consumedCapacity`.
fn share_of(
    r: &k8s_openapi::api::resource::v1::DeviceRequestAllocationResult,
) -> Result<Option<ShareRecord>, String> {
    let Some(id) = r.share_id.as_deref() else {
        return Ok(None);
    };
    let valid = !id.is_empty()
        && id.len() <= 63
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !valid {
        return Err(format!(
            "shareID {id:?} is not a lower-case UUID (the scheduler writes one); it cannot name a CDI device"
        ));
    }
    let consumed = |name: &str| -> Result<Option<u64>, String> {
        let Some(q) = r.consumed_capacity.as_ref().and_then(|c| c.get(name)) else {
            return Ok(None);
        };
        let parsed = cleave_api::quantity::Quantity::parse(&q.0)
            .map_err(|e| format!("consumedCapacity.{name} {:?}: {e}", q.0))?;
        u64::try_from(parsed.value())
            .map(Some)
            .map_err(|_| format!("consumedCapacity.{name} {:?} is negative", q.0))
    };
    let memory_bytes = consumed(cleave_api::names::cap::MEMORY)?;
    let multiprocessors = consumed(cleave_api::names::cap::MULTIPROCESSORS)?
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX));
    Ok(Some(ShareRecord {
        share_id: id.to_owned(),
        memory_bytes,
        multiprocessors,
        ..ShareRecord::default()
    }))
}

/// What the refusal of an over-committing allocation tells the operator.
pub(super) const OVER_COMMIT_HINT: &str = "the scheduler allocated more of this device than it has (kube-scheduler 1.36.0 and 1.36.1 over-commit shared MIG devices; use 1.36.2 or newer), or the node's mode changed under prepared claims";

/// Everything the allocation results of one claim say about one device of this pool.
struct Allocated {
    device: String,
    request_names: Vec<String>,
    /// The device's shares in this claim, summed into one record (`None`: held whole).
    share: Option<ShareRecord>,
    /// Every result for the device has admin access.
    admin: bool,
}

/// The claim's devices in this driver and pool, in allocation order. Several shares of one
/// device (requests the scheduler placed on the same device) become one share with the
/// summed consumption; a device both whole and in shares cannot come from one allocation.
fn allocated_devices(
    results: &[k8s_openapi::api::resource::v1::DeviceRequestAllocationResult],
    driver: &str,
    pool: &str,
) -> Result<Vec<Allocated>, (String, String)> {
    let mut out: Vec<Allocated> = Vec::new();
    let mut whole: BTreeMap<String, bool> = BTreeMap::new();
    for r in results
        .iter()
        .filter(|r| r.driver == driver && r.pool == pool)
    {
        let share = share_of(r).map_err(|reason| (r.device.clone(), reason))?;
        let admin = r.admin_access == Some(true);
        let i = match out.iter().position(|a| a.device == r.device) {
            Some(i) => i,
            None => {
                out.push(Allocated {
                    device: r.device.clone(),
                    request_names: Vec::new(),
                    share: None,
                    admin,
                });
                out.len() - 1
            }
        };
        let a = &mut out[i];
        a.admin &= admin;
        if !a.request_names.contains(&r.request) {
            a.request_names.push(r.request.clone());
        }
        let seen_whole = whole.insert(r.device.clone(), share.is_none());
        if seen_whole.is_some_and(|w| w != share.is_none()) {
            return Err((
                r.device.clone(),
                "the claim holds the device both whole (no shareID) and as a share; the allocator never writes that, so the allocation was edited: allocate the claim again".into(),
            ));
        }
        match (a.share.as_mut(), share) {
            (_, None) => {}
            (None, Some(s)) => a.share = Some(s),
            (Some(mine), Some(s)) => {
                if mine.share_id != s.share_id && !mine.more_share_ids.contains(&s.share_id) {
                    mine.more_share_ids.push(s.share_id.clone());
                    mine.memory_bytes = sum_opt(mine.memory_bytes, s.memory_bytes);
                    mine.multiprocessors = sum_opt(
                        mine.multiprocessors.map(u64::from),
                        s.multiprocessors.map(u64::from),
                    )
                    .map(|n| u32::try_from(n).unwrap_or(u32::MAX));
                }
            }
        }
    }
    Ok(out)
}

fn sum_opt(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
    }
}

/// What a device offers to shares: its memory as published (rounded down to 1Mi) and its
/// SMs, when known.
pub(super) struct DeviceCapacity {
    device: String,
    memory_bytes: Option<u64>,
    multiprocessors: Option<u32>,
}

impl DeviceCapacity {
    pub(super) fn of(gpu: &GpuInfo, device: &str) -> Self {
        let facts = crate::sharing::GpuFacts::of(gpu, device);
        Self {
            device: device.to_owned(),
            memory_bytes: facts.device_memory_bytes.map(|b| (b >> 20) << 20),
            multiprocessors: crate::sharing::device_multiprocessors(gpu, device),
        }
    }

    /// The share consumed all of the device (what a claim asking no capacity gets).
    fn taken_whole_by(&self, s: &ShareRecord) -> bool {
        let device = Capacity {
            memory_bytes: self.memory_bytes,
            multiprocessors: self.multiprocessors,
        };
        takes_whole_device(Capacity::consumed_by(s), device)
    }

    /// Refuses a share that alone exceeds the device.
    fn check_share(&self, s: &ShareRecord) -> Result<(), String> {
        self.check(
            s.memory_bytes.unwrap_or(0),
            u64::from(s.multiprocessors.unwrap_or(0)),
            &format!("share {} consumed", s.share_id),
        )
    }

    /// Refuses shares whose sum (this one and those prepared) exceeds the device.
    fn check_sum(&self, memory: u64, multiprocessors: u64) -> Result<(), String> {
        self.check(
            memory,
            multiprocessors,
            "the shares prepared on it with this one add up to",
        )
    }

    fn check(&self, memory: u64, multiprocessors: u64, what: &str) -> Result<(), String> {
        let mut over = Vec::new();
        if let Some(total) = self.memory_bytes
            && memory > total
        {
            over.push(format!("memory {}Mi of {}Mi", memory >> 20, total >> 20));
        }
        if let Some(total) = self.multiprocessors
            && multiprocessors > u64::from(total)
        {
            over.push(format!("multiprocessors {multiprocessors} of {total}"));
        }
        if over.is_empty() {
            return Ok(());
        }
        Err(format!(
            "{what} {} on device {}",
            over.join(" and "),
            self.device
        ))
    }
}

/// Refuses an on-demand MIG placement that overlaps a MIG device prepared for another
/// claim, or planned earlier in this claim, on the same GPU (NVML would refuse it later, after
/// the scheduler over-committed the GPU's counters).
fn check_placement_free(
    uid: &str,
    device: &str,
    gpu: &GpuInfo,
    placement: Placement,
    planned: &[PlannedDevice],
    state: &State,
) -> Result<(), String> {
    let others = state
        .data
        .claims
        .values()
        .filter(|c| c.uid != uid)
        .flat_map(|c| {
            c.devices
                .iter()
                .map(move |d| (("another claim".to_owned(), c.uid.as_str()), d))
        })
        .filter(|(_, d)| !d.admin_access && d.gpu_uuid == gpu.uuid && d.name != device)
        .filter_map(|(who, d)| d.mig.as_ref().map(|m| (who, d.name.clone(), m.placement)));
    // The refusal names only this claim's objects: the other claim may be another tenant's
    // (its UID is logged at debug level).
    let mine = planned
        .iter()
        .filter(|d| d.gpu.uuid == gpu.uuid && d.name != device)
        .filter_map(|d| {
            d.mig.as_ref().map(|m| {
                (
                    ("this claim".to_owned(), uid),
                    d.name.clone(),
                    m.placement(),
                )
            })
        });
    for ((who, holder), other, held) in others.chain(mine) {
        if held.overlaps(&placement) {
            tracing::debug!(device, holder, "MIG placement held by a claim");
            return Err(format!(
                "placement start {} size {} overlaps MIG device {other} prepared for {who} on GPU {}",
                placement.start, placement.size, gpu.uuid
            ));
        }
    }
    Ok(())
}

/// Whether `gpu` (as discovered, with the instances prepare made since) has the MIG
/// device `uuid`.
fn gpu_has_instance(gpu: &GpuInfo, uuid: &str) -> bool {
    matches!(&gpu.mig, MigState::Enabled { instances, .. } if instances.iter().any(|i| i.uuid == uuid))
}

/// The one config of a device: every request it serves must resolve to the same one (a
/// class's config attached to each of its requests agrees with itself), valid for the
/// device's kind.
fn device_config(
    configs: &BTreeMap<String, Option<ResolvedConfig>>,
    request_names: &[String],
    name: &DeviceName,
    device: &str,
    label: &str,
) -> Result<Option<ResolvedConfig>, PrepareError> {
    let mut config: Option<ResolvedConfig> = None;
    for request in request_names {
        let resolved = configs.get(request).cloned().flatten();
        if let Some(r) = &resolved {
            r.sharing_for(DeviceKind::from(name))
                .map_err(|e| PrepareError::InvalidConfig {
                    claim: label.to_owned(),
                    message: format!("device {device}: {e}"),
                })?;
        }
        if config.is_some()
            && config.as_ref().map(|c| &c.config) != resolved.as_ref().map(|c| &c.config)
        {
            return Err(PrepareError::InvalidConfig {
                claim: label.to_owned(),
                message: format!(
                    "device {device} is allocated for requests {request_names:?} with different configs"
                ),
            });
        }
        config = resolved;
    }
    Ok(config)
}

pub(super) fn claim_label(claim: &ResourceClaim) -> String {
    format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    )
}

/// The planning of prepare: decodes a claim's allocation against the recorded state and
/// decides per device what to do. Holds only the settings it reads; no backend, no I/O.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Planner {
    /// DRA driver name: the allocation results that are ours.
    driver_name: String,
    /// Pool name (the node): the allocation results that are this node's.
    pool_name: String,
    /// How shares of one device are prepared (`Off` refuses them).
    consumable_capacity: ConsumableCapacity,
    /// Whether on-demand MIG placements may be created.
    dynamic_mig: bool,
}

impl Planner {
    /// The planner of a driver running with `config`.
    pub(super) fn new(config: &DriverConfig) -> Self {
        Self {
            driver_name: config.driver_name.clone(),
            pool_name: config.pool_name.clone(),
            consumable_capacity: config.consumable_capacity,
            dynamic_mig: config.dynamic_mig,
        }
    }
}

impl Planner {
    /// Checks the allocation and decides per device what to do; changes nothing.
    ///
    /// Every allocation is one cell of the sharing model (docs/sharing.md): a device is held
    /// exclusively (no `shareID`, or a share that consumed the whole device), as a part of
    /// it (a partial share), or with admin access; its sharing config is honoured on
    /// exclusive devices, folded into the share's client limits (MPS on an `mps` node) or
    /// reported as not applicable. The scheduler is not trusted to add up: a share beyond its
    /// device, shares whose sum exceeds it, and overlapping MIG placements are refused here,
    /// before anything changes.
    pub(super) fn plan(
        &self,
        claim: &ResourceClaim,
        label: &str,
        uid: &str,
        state: &State,
    ) -> Result<Vec<PlannedDevice>, PrepareError> {
        let allocated = self.allocated_here(claim, label)?;
        let configs = self.effective_configs(claim, label)?;
        let mut plan: Vec<PlannedDevice> = Vec::with_capacity(allocated.len());
        for a in allocated {
            let device = self.plan_allocated(a, &configs, label, uid, state, &plan)?;
            plan.push(device);
        }
        self.check_one_mps_daemon(&plan, label)?;
        Ok(plan)
    }

    /// The claim's devices in this driver and pool; refused when the claim is not
    /// allocated, or allocated nothing here.
    fn allocated_here(
        &self,
        claim: &ResourceClaim,
        label: &str,
    ) -> Result<Vec<Allocated>, PrepareError> {
        let results = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref())
            .ok_or_else(|| PrepareError::NotAllocated {
                claim: label.to_owned(),
            })?;
        let driver = &self.driver_name;
        let pool = &self.pool_name;
        let allocated = allocated_devices(results, driver, pool).map_err(|(device, reason)| {
            PrepareError::ShareRefused {
                claim: label.to_owned(),
                device,
                reason,
            }
        })?;
        if allocated.is_empty() {
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
        Ok(allocated)
    }

    /// Plans one allocated device of the claim; `planned` are the claim's devices planned
    /// before it.
    fn plan_allocated(
        &self,
        a: Allocated,
        configs: &BTreeMap<String, Option<ResolvedConfig>>,
        label: &str,
        uid: &str,
        state: &State,
        planned: &[PlannedDevice],
    ) -> Result<PlannedDevice, PrepareError> {
        let device = a.device;
        let unknown = |device: &str, reason: String| PrepareError::UnknownDevice {
            claim: label.to_owned(),
            device: device.to_owned(),
            pool: self.pool_name.clone(),
            reason,
        };
        let over_commit = |what| PrepareError::OverCommit {
            claim: label.to_owned(),
            device: device.clone(),
            what,
        };
        let name: DeviceName = device
            .parse()
            .map_err(|e: cleave_api::names::NameError| unknown(&device, e.to_string()))?;
        let gpu = state
            .inventory
            .gpus
            .iter()
            .find(|g| g.minor == name.minor())
            .ok_or_else(|| unknown(&device, format!("no GPU with minor {}", name.minor())))?;

        let mut share = a.share;
        if let Some(s) = &share
            && !a.admin
            && self.consumable_capacity == ConsumableCapacity::Off
        {
            return Err(PrepareError::ShareRefused {
                claim: label.to_owned(),
                device: device.clone(),
                reason: format!(
                    "allocated as share {} (consumable capacity), but this node runs with --consumable-capacity off and publishes no shareable device; start the plugin with --consumable-capacity mps or time-slicing, or allocate the device whole",
                    s.share_id
                ),
            });
        }
        let capacity = DeviceCapacity::of(gpu, &device);
        if let Some(s) = share.as_mut() {
            s.whole = a.admin || capacity.taken_whole_by(s);
        }
        let config = device_config(configs, &a.request_names, &name, &device, label)?;

        if a.admin {
            return self.plan_admin(label, &device, &name, gpu, a.request_names, config, share);
        }

        if let Some(s) = ShareRecord::partial(share.as_ref()) {
            capacity.check_share(s).map_err(over_commit)?;
        }
        let joined = self.check_against_prepared(
            label,
            uid,
            &device,
            share.as_ref(),
            gpu,
            &capacity,
            state,
        )?;

        let (kind, mig) = self
            .plan_device(&name, gpu)
            .map_err(|r| unknown(&device, r))?;
        let mig = joined.map(MigPlan::Join).or(mig);
        if let Some(MigPlan::Create { placement, .. }) = &mig {
            check_placement_free(uid, &device, gpu, *placement, planned, state)
                .map_err(over_commit)?;
        }

        let partial = ShareRecord::partial(share.as_ref()).is_some();
        let config = match config {
            Some(c) if partial && c.config.sharing().is_some() => {
                self.fold_share_config(&device, gpu, c, share.as_mut(), uid, state)
            }
            c => c,
        };

        Ok(PlannedDevice {
            name: device,
            kind,
            admin_access: false,
            request_names: a.request_names,
            gpu: gpu.clone(),
            mig,
            config,
            share,
        })
    }

    /// A container reaches one MPS daemon (one CUDA_MPS_PIPE_DIRECTORY): a claim's MPS
    /// shares of several devices, or an MPS share beside a device with its own daemon,
    /// cannot be served to one container.
    fn check_one_mps_daemon(
        &self,
        plan: &[PlannedDevice],
        label: &str,
    ) -> Result<(), PrepareError> {
        if self.consumable_capacity != ConsumableCapacity::Mps {
            return Ok(());
        }
        let refuse = |device: &str, reason: String| PrepareError::ShareRefused {
            claim: label.to_owned(),
            device: device.to_owned(),
            reason,
        };
        let shared: Vec<&str> = plan
            .iter()
            .filter(|d| ShareRecord::partial(d.share.as_ref()).is_some())
            .map(|d| d.name.as_str())
            .collect();
        let own_mps = plan.iter().find(|d| {
            d.config
                .as_ref()
                .and_then(|c| c.config.sharing())
                .is_some_and(|s| s.strategy == SharingStrategy::Mps)
        });
        if shared.len() > 1 {
            return Err(refuse(
                shared[1],
                format!(
                    "the claim holds partial MPS shares of several devices ({}); each device has its own MPS daemon and a container can reach only one, so request a share of one device per claim (whole devices, count: N, are served)",
                    shared.join(", ")
                ),
            ));
        }
        if let (Some(s), Some(own)) = (shared.first(), own_mps) {
            return Err(refuse(
                s,
                format!(
                    "the claim holds an MPS share and device {} with its own MPS daemon (sharing strategy MPS); a container can reach only one MPS daemon, so use separate claims",
                    own.name
                ),
            ));
        }
        Ok(())
    }

    /// Plans a device allocated with admin access: no exclusivity check, no sharing, nothing
    /// created. A whole GPU is handed over by its own device node (also when MIG is on); a
    /// MIG device must exist (static, or created by the claim that holds it).
    #[allow(clippy::too_many_arguments)]
    fn plan_admin(
        &self,
        label: &str,
        device: &str,
        name: &DeviceName,
        gpu: &GpuInfo,
        request_names: Vec<String>,
        config: Option<ResolvedConfig>,
        share: Option<ShareRecord>,
    ) -> Result<PlannedDevice, PrepareError> {
        if config.as_ref().and_then(|c| c.config.sharing()).is_some() {
            tracing::warn!(claim = %label, device, "admin access: the config's sharing block is not applied");
        }
        let mig = match name {
            DeviceName::Gpu { .. } => None,
            DeviceName::Mig { .. } => {
                let (_, mig) =
                    self.plan_device(name, gpu)
                        .map_err(|reason| PrepareError::UnknownDevice {
                            claim: label.to_owned(),
                            device: device.to_owned(),
                            pool: self.pool_name.clone(),
                            reason,
                        })?;
                match mig {
                    Some(m @ MigPlan::Existing(_)) => Some(m),
                    _ => {
                        return Err(PrepareError::ShareRefused {
                            claim: label.to_owned(),
                            device: device.to_owned(),
                            reason: "admin access to an on-demand MIG placement that no claim has created: there is no MIG device to reach (admin access never creates one); ask admin access to the parent GPU (class gpu.cleave.dev) to watch all its MIG devices".into(),
                        });
                    }
                }
            }
        };
        tracing::info!(claim = %label, device, "admin access: prepared beside the device's other claims, without sharing or MIG creation");
        Ok(PlannedDevice {
            name: device.to_owned(),
            kind: match name {
                DeviceName::Gpu { .. } => DeviceKind::Gpu,
                DeviceName::Mig { .. } => DeviceKind::Mig,
            },
            admin_access: true,
            request_names,
            gpu: gpu.clone(),
            mig,
            config: None,
            share,
        })
    }

    /// Checks `device` against the claims already prepared on it and returns the MIG
    /// instance another share of it holds (one instance per device, not per share). Admin
    /// access claims are not counted.
    #[allow(clippy::too_many_arguments)]
    fn check_against_prepared(
        &self,
        label: &str,
        uid: &str,
        device: &str,
        share: Option<&ShareRecord>,
        gpu: &GpuInfo,
        capacity: &DeviceCapacity,
        state: &State,
    ) -> Result<Option<MigRecord>, PrepareError> {
        let over_commit = |what: String| PrepareError::OverCommit {
            claim: label.to_owned(),
            device: device.to_owned(),
            what,
        };
        let mine = ShareRecord::partial(share);
        let mut joined: Option<MigRecord> = None;
        let mut sum = (
            mine.and_then(|s| s.memory_bytes).unwrap_or(0),
            u64::from(mine.and_then(|s| s.multiprocessors).unwrap_or(0)),
        );
        for other in state.data.claims.values().filter(|c| c.uid != uid) {
            let Some(theirs) = other
                .devices
                .iter()
                .find(|d| d.name == device && !d.admin_access)
            else {
                continue;
            };
            // Refusals name only this claim's objects: the other claim may be another
            // tenant's (its UID is logged at debug level).
            tracing::debug!(claim = %label, device, other = %other.uid, "device held by another claim");
            match (mine, ShareRecord::partial(theirs.share.as_ref())) {
                (Some(_), Some(t)) => {
                    sum.0 += t.memory_bytes.unwrap_or(0);
                    sum.1 += u64::from(t.multiprocessors.unwrap_or(0));
                    // The MIG instance behind another share of this device (on demand or
                    // static) serves this share too.
                    if let Some(m) = theirs.mig.as_ref()
                        && let Some(u) = m.uuid.as_deref()
                        && gpu_has_instance(gpu, u)
                    {
                        joined.get_or_insert_with(|| MigRecord {
                            creating_in_boot: None,
                            ..m.clone()
                        });
                    }
                }
                (None, None) => {
                    return Err(PrepareError::DeviceBusy {
                        claim: label.to_owned(),
                        device: device.to_owned(),
                        other: other.uid.clone(),
                        hint: OVER_COMMIT_HINT.to_owned(),
                    });
                }
                (None, Some(_)) => {
                    return Err(over_commit(
                        "allocated whole, but it is prepared as a share for another claim".into(),
                    ));
                }
                (Some(s), None) => {
                    return Err(over_commit(format!(
                        "allocated as share {}, but it is prepared for another claim alone",
                        s.share_id
                    )));
                }
            }
        }
        if mine.is_some() {
            capacity.check_sum(sum.0, sum.1).map_err(over_commit)?;
        }
        Ok(joined)
    }

    /// A sharing config on a partial share: on an `mps` node an MPS block's limits become the
    /// share's client limits where stricter than what it consumed; any other block cannot
    /// apply to a part of a device and is dropped with a warning (the share is served as the
    /// node shares). The config returned is what is recorded and applied per claim.
    fn fold_share_config(
        &self,
        device: &str,
        gpu: &GpuInfo,
        config: ResolvedConfig,
        share: Option<&mut ShareRecord>,
        uid: &str,
        state: &State,
    ) -> Option<ResolvedConfig> {
        let sharing = config.config.sharing()?.clone();
        let mode = self.consumable_capacity;
        match (mode, sharing.strategy) {
            (ConsumableCapacity::TimeSlicing, SharingStrategy::TimeSlicing) => {
                // The interval is the GPU's: the first share that asks sets it; a share
                // asking another while it is held keeps the GPU's (warned), never refused.
                let wanted = sharing
                    .time_slicing
                    .as_ref()
                    .map(|t| t.interval_or_default())
                    .unwrap_or_default();
                let held = super::time_slice_needs(&state.data)
                    .into_iter()
                    .find(|n| n.gpu_uuid == gpu.uuid && n.claim_uid != uid && n.interval != wanted);
                match held {
                    Some(n) => {
                        tracing::warn!(
                            device,
                            wanted = ?wanted,
                            held = ?n.interval,
                            other = %n.claim_uid,
                            "time-slice interval of a share not applied: another claim holds the GPU's interval"
                        );
                        None
                    }
                    None => Some(config),
                }
            }
            (ConsumableCapacity::Mps, SharingStrategy::Mps) => {
                let mps = sharing.mps.clone().unwrap_or_default();
                if let Some(s) = share {
                    s.client_thread_percentage = mps.active_thread_percentage;
                    s.client_memory_bytes = mps
                        .pinned_memory_limit
                        .as_ref()
                        .and_then(|l| l.limit_for(&gpu.uuid, 0))
                        .and_then(|q| u64::try_from(q.value()).ok());
                }
                tracing::info!(
                    device,
                    "MPS config on a share: its limits apply to the share's clients in the device's MPS daemon"
                );
                None
            }
            (mode, strategy) => {
                tracing::warn!(
                    device,
                    %strategy,
                    mode = mode.as_str(),
                    "sharing config on a share is not applied: a part of a device is shared as the node shares ({})",
                    match mode {
                        ConsumableCapacity::Mps => "MPS with limits from what it consumed",
                        _ => "time-sliced with the device's other shares",
                    }
                );
                None
            }
        }
    }
    /// The kind of a device and the MIG instance behind it, or why it cannot be prepared.
    pub(super) fn plan_device(
        &self,
        name: &DeviceName,
        gpu: &GpuInfo,
    ) -> Result<(DeviceKind, Option<MigPlan>), String> {
        match name {
            DeviceName::Gpu { .. } => match &gpu.mig {
                MigState::Enabled {
                    profiles,
                    memory_slices,
                    ..
                } => {
                    if !self.dynamic_mig {
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
                        Some(MigPlan::Create {
                            profile_id: full.id,
                            profile_name: full.name.clone(),
                            placement,
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
                        Some(MigPlan::Existing(MigRecord {
                            profile_id: prof.id,
                            profile_name: prof.name.clone(),
                            placement,
                            uuid: Some(inst.uuid.clone()),
                            gi_id: Some(inst.gi_id),
                            ci_id: Some(inst.ci_id),
                            created_by_cleave: false,
                            creating_in_boot: None,
                        })),
                    ));
                }
                if !self.dynamic_mig {
                    return Err(
                        "no MIG instance exists at this placement and on-demand MIG is off".into(),
                    );
                }
                Ok((
                    DeviceKind::Mig,
                    Some(MigPlan::Create {
                        profile_id: prof.id,
                        profile_name: prof.name.clone(),
                        placement,
                    }),
                ))
            }
        }
    }

    /// Decodes, validates and merges the claim's opaque configs for this driver, per request
    /// name (`req` or `req/sub`) of the allocation results.
    pub(super) fn effective_configs(
        &self,
        claim: &ResourceClaim,
        label: &str,
    ) -> Result<BTreeMap<String, Option<ResolvedConfig>>, PrepareError> {
        resolve_claim_configs(claim, &self.driver_name).map_err(|e| PrepareError::InvalidConfig {
            claim: label.to_owned(),
            message: e.to_string(),
        })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::DeviceRequestAllocationResult;
    use serde_json::json;

    use crate::prepare::testing::{inventory, node_claim, plain_gpu, with_config};

    fn result(v: serde_json::Value) -> DeviceRequestAllocationResult {
        let mut base = json!({"request": "r", "driver": "d", "pool": "p", "device": "gpu-0"});
        base.as_object_mut()
            .unwrap()
            .extend(v.as_object().unwrap().clone());
        serde_json::from_value(base).unwrap()
    }

    fn share(id: &str, memory: Option<u64>, sms: Option<u32>) -> ShareRecord {
        ShareRecord {
            share_id: id.to_owned(),
            memory_bytes: memory,
            multiprocessors: sms,
            ..ShareRecord::default()
        }
    }

    #[test]
    fn shares_are_read_from_share_id_and_consumed_capacity() {
        assert_eq!(share_of(&result(json!({}))).unwrap(), None);
        let s = share_of(&result(json!({
            "shareID": "0f1e2d3c-4b5a",
            "consumedCapacity": {"memory": "2Gi", "multiprocessors": "20"}
        })))
        .unwrap()
        .unwrap();
        assert_eq!(s, share("0f1e2d3c-4b5a", Some(2 << 30), Some(20)));
        // Only what is named is recorded.
        let s = share_of(&result(
            json!({"shareID": "a", "consumedCapacity": {"memory": "1Mi"}}),
        ))
        .unwrap()
        .unwrap();
        assert_eq!(s, share("a", Some(1 << 20), None));
        // More multiprocessors than a u32 holds saturate.
        let s = share_of(&result(json!({
            "shareID": "a", "consumedCapacity": {"multiprocessors": "5000000000"}
        })))
        .unwrap()
        .unwrap();
        assert_eq!(s.multiprocessors, Some(u32::MAX));
        // A 63-character ID is the longest a CDI device name part takes.
        let longest = "a".repeat(63);
        assert!(share_of(&result(json!({"shareID": longest}))).is_ok());
        for bad in ["", "A", "a_b", "a.b", &"a".repeat(64)] {
            let e = share_of(&result(json!({"shareID": bad}))).unwrap_err();
            assert!(e.contains("is not a lower-case UUID"), "{bad:?}: {e}");
        }
        let e = share_of(&result(
            json!({"shareID": "a", "consumedCapacity": {"memory": "-1Gi"}}),
        ))
        .unwrap_err();
        assert!(
            e.contains("consumedCapacity.memory") && e.contains("negative"),
            "{e}"
        );
        let e = share_of(&result(
            json!({"shareID": "a", "consumedCapacity": {"memory": "lots"}}),
        ))
        .unwrap_err();
        assert!(e.contains("consumedCapacity.memory \"lots\""), "{e}");
    }

    #[test]
    fn several_shares_of_a_device_are_summed_once_each() {
        let results = [
            result(
                json!({"request": "a", "shareID": "s1", "consumedCapacity": {"memory": "1Gi", "multiprocessors": "10"}}),
            ),
            result(json!({"request": "b", "shareID": "s2", "consumedCapacity": {"memory": "2Gi"}})),
            // The same share again (another request naming it) is not counted twice.
            result(
                json!({"request": "b", "shareID": "s1", "consumedCapacity": {"memory": "1Gi", "multiprocessors": "10"}}),
            ),
            result(json!({"request": "a", "device": "gpu-1", "adminAccess": true})),
            // Other drivers and pools are not this plan's.
            result(json!({"driver": "other", "device": "gpu-2"})),
            result(json!({"pool": "other", "device": "gpu-3"})),
        ];
        let out = allocated_devices(&results, "d", "p").unwrap();
        assert_eq!(
            out.iter().map(|a| a.device.as_str()).collect::<Vec<_>>(),
            ["gpu-0", "gpu-1"]
        );
        assert_eq!(out[0].request_names, ["a", "b"]);
        let s = out[0].share.as_ref().unwrap();
        assert_eq!(s.share_id, "s1");
        assert_eq!(s.more_share_ids, ["s2"]);
        assert_eq!(s.memory_bytes, Some(3 << 30));
        assert_eq!(s.multiprocessors, Some(10));
        assert!(!out[0].admin);
        assert!(out[1].admin && out[1].share.is_none());
        // Admin access holds only when every result of the device has it.
        let mixed = [
            result(json!({"adminAccess": true})),
            result(json!({"request": "s", "adminAccess": false})),
        ];
        assert!(!allocated_devices(&mixed, "d", "p").unwrap()[0].admin);
        // Whole and shared at once was edited by hand.
        for pair in [
            [result(json!({})), result(json!({"shareID": "s1"}))],
            [result(json!({"shareID": "s1"})), result(json!({}))],
        ] {
            let (device, e) = allocated_devices(&pair, "d", "p").err().unwrap();
            assert_eq!(device, "gpu-0");
            assert!(e.contains("both whole"), "{e}");
        }
        // A bad share names its device.
        let (device, _) = allocated_devices(
            &[result(json!({"device": "gpu-7", "shareID": "A"}))],
            "d",
            "p",
        )
        .err()
        .unwrap();
        assert_eq!(device, "gpu-7");
    }

    #[test]
    fn sums_of_optional_consumption() {
        assert_eq!(sum_opt(None, None), None);
        assert_eq!(sum_opt(Some(2), None), Some(2));
        assert_eq!(sum_opt(None, Some(3)), Some(3));
        assert_eq!(sum_opt(Some(2), Some(3)), Some(5));
        assert_eq!(sum_opt(Some(u64::MAX), Some(3)), Some(u64::MAX));
    }

    #[test]
    fn claims_are_named_namespace_slash_name() {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"namespace": "team-a", "name": "train"},
            "spec": {}
        }))
        .unwrap();
        assert_eq!(claim_label(&claim), "team-a/train");
        assert_eq!(claim_label(&ResourceClaim::default()), "/");
    }

    #[test]
    fn capacity_is_the_published_memory_rounded_down_to_a_mebibyte() {
        let mut gpu = crate::prepare::testing::plain_gpu(0);
        gpu.memory_bytes = (24 << 30) + 12345;
        let cap = DeviceCapacity::of(&gpu, "gpu-0");
        assert_eq!(cap.memory_bytes, Some(24 << 30));
        assert_eq!(cap.device, "gpu-0");
        assert!(cap.check(24 << 30, 0, "x").is_ok());
        assert!(cap.check((24 << 30) + 1, 0, "x").is_err());
    }

    #[test]
    fn capacity_refuses_only_what_exceeds_the_device() {
        let cap = DeviceCapacity {
            device: "gpu-0".to_owned(),
            memory_bytes: Some(10 << 30),
            multiprocessors: Some(100),
        };
        // Exactly the device is allowed; one more byte or SM is not.
        assert!(cap.check(10 << 30, 100, "x").is_ok());
        let e = cap.check((10 << 30) + 1, 100, "x").unwrap_err();
        assert!(
            e.contains("memory 10240Mi of 10240Mi") && e.contains("device gpu-0"),
            "{e}"
        );
        assert!(!e.contains("multiprocessors"), "{e}");
        let e = cap.check(0, 101, "x").unwrap_err();
        assert!(
            e.contains("multiprocessors 101 of 100") && !e.contains("memory"),
            "{e}"
        );
        let e = cap.check(11 << 30, 101, "x").unwrap_err();
        assert!(
            e.contains("memory 11264Mi of 10240Mi and multiprocessors 101 of 100"),
            "{e}"
        );
        // The refusal built from it says over-commit and gives the hint, typed as such.
        let refused = PrepareError::OverCommit {
            claim: "ns/c".into(),
            device: "gpu-0".into(),
            what: e,
        };
        assert_eq!(refused.refusal(), super::super::Refusal::OverCommit);
        let text = refused.to_string();
        assert!(
            text.starts_with("claim ns/c: device gpu-0: over-commit: x memory 11264Mi")
                && text.ends_with(OVER_COMMIT_HINT),
            "{text}"
        );
        // check_share names the share; check_sum the sum.
        let e = cap
            .check_share(&share("s9", Some(11 << 30), None))
            .unwrap_err();
        assert!(e.contains("share s9 consumed memory"), "{e}");
        assert!(cap.check_share(&share("s9", None, Some(100))).is_ok());
        assert!(cap.check_share(&share("s9", None, Some(101))).is_err());
        let e = cap.check_sum(0, 200).unwrap_err();
        assert!(e.contains("add up to multiprocessors 200 of 100"), "{e}");
        assert!(cap.check_sum(10 << 30, 100).is_ok());
        // Unknown totals refuse nothing.
        let unknown = DeviceCapacity {
            device: "gpu-0".to_owned(),
            memory_bytes: None,
            multiprocessors: None,
        };
        assert!(unknown.check(u64::MAX, u64::MAX, "x").is_ok());
        // A share takes the device whole only when it consumed all of both.
        assert!(cap.taken_whole_by(&share("s", Some(10 << 30), Some(100))));
        assert!(cap.taken_whole_by(&share("s", Some(11 << 30), Some(101))));
        assert!(!cap.taken_whole_by(&share("s", Some((10 << 30) - 1), Some(100))));
        assert!(!cap.taken_whole_by(&share("s", Some(10 << 30), Some(99))));
        assert!(!cap.taken_whole_by(&share("s", None, Some(100))));
        assert!(!unknown.taken_whole_by(&share("s", Some(10 << 30), Some(100))));
    }

    #[test]
    fn a_gpu_has_only_the_mig_instances_it_lists() {
        use crate::backend::GpuBackend;
        use crate::prepare::testing::{FakeBackend, gpu_uuid, inventory, mig_gpu, plain_gpu};
        let fake = FakeBackend::new(inventory(vec![mig_gpu(0)]));
        let inst = fake
            .add_instance(
                &gpu_uuid(0),
                19,
                crate::model::Placement { start: 3, size: 1 },
            )
            .unwrap();
        let gpu = fake.inventory().unwrap().gpus[0].clone();
        assert!(gpu_has_instance(&gpu, &inst.uuid));
        assert!(!gpu_has_instance(
            &gpu,
            "MIG-00000000-0000-0000-0000-000000000000"
        ));
        assert!(!gpu_has_instance(&mig_gpu(0), &inst.uuid));
        assert!(!gpu_has_instance(&plain_gpu(0), &inst.uuid));
    }

    // Plans against a recorded state, on the planner alone.

    const UID_A: &str = "aaaaaaaa-0000-4000-8000-000000000001";
    const DRIVER: &str = cleave_api::names::DRIVER_NAME;
    const MPS_CONFIG: &str = r#"{"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 30}}}"#;

    /// A planner for node `node-a` in `mode` (no on-demand MIG) and a state with `gpus` and
    /// nothing prepared.
    fn planner_on(gpus: Vec<GpuInfo>, mode: ConsumableCapacity) -> (Planner, State) {
        let planner = Planner {
            driver_name: DRIVER.into(),
            pool_name: "node-a".into(),
            consumable_capacity: mode,
            dynamic_mig: false,
        };
        let state = State {
            inventory: inventory(gpus),
            ..State::empty()
        };
        (planner, state)
    }

    /// The plan of `claim` against `state`.
    fn plan_of(planner: &Planner, state: &State, claim: &ResourceClaim) -> Planned {
        let uid = claim.metadata.uid.as_deref().unwrap();
        Planned(planner.plan(claim, &claim_label(claim), uid, state))
    }

    /// A plan or its refusal ([`PlannedDevice`] has no `Debug` for `Result::unwrap`).
    struct Planned(Result<Vec<PlannedDevice>, PrepareError>);

    impl Planned {
        fn unwrap(self) -> Vec<PlannedDevice> {
            self.0.unwrap_or_else(|e| panic!("refused: {e}"))
        }

        fn unwrap_err(self) -> PrepareError {
            match self.0 {
                Ok(plan) => panic!("planned {} devices", plan.len()),
                Err(e) => e,
            }
        }
    }

    /// The claim's allocation result `index`, to edit.
    fn result_mut(
        claim: &mut ResourceClaim,
        index: usize,
    ) -> &mut k8s_openapi::api::resource::v1::DeviceRequestAllocationResult {
        &mut claim
            .status
            .as_mut()
            .and_then(|s| s.allocation.as_mut())
            .and_then(|a| a.devices.as_mut())
            .and_then(|d| d.results.as_mut())
            .unwrap()[index]
    }

    /// Makes allocation result `index` the share `id` that consumed `consumed` (capacity, quantity).
    pub(in crate::prepare) fn as_share(
        mut claim: ResourceClaim,
        index: usize,
        id: &str,
        consumed: &[(&str, &str)],
    ) -> ResourceClaim {
        let r = result_mut(&mut claim, index);
        r.share_id = Some(id.to_owned());
        r.consumed_capacity = Some(
            consumed
                .iter()
                .map(|(k, v)| {
                    (
                        (*k).to_owned(),
                        k8s_openapi::apimachinery::pkg::api::resource::Quantity((*v).to_owned()),
                    )
                })
                .collect(),
        );
        claim
    }

    /// Makes allocation result `index` one with admin access.
    pub(in crate::prepare) fn as_admin(mut claim: ResourceClaim, index: usize) -> ResourceClaim {
        result_mut(&mut claim, index).admin_access = Some(true);
        claim
    }

    #[test]
    fn a_share_that_consumed_the_whole_device_is_held_whole() {
        let (planner, state) = planner_on(vec![plain_gpu(0)], ConsumableCapacity::TimeSlicing);
        let claim = node_claim(UID_A, &[("part", "gpu-0")]);
        let all = as_share(
            claim.clone(),
            0,
            "s-1",
            &[("memory", "24Gi"), ("multiprocessors", "58")],
        );
        let plan = plan_of(&planner, &state, &all).unwrap();
        assert!(plan[0].share.as_ref().unwrap().whole);
        let part = as_share(
            claim,
            0,
            "s-1",
            &[("memory", "2Gi"), ("multiprocessors", "58")],
        );
        let plan = plan_of(&planner, &state, &part).unwrap();
        assert!(!plan[0].share.as_ref().unwrap().whole);
        // A share with admin access is held as the whole device.
        let plan = plan_of(&planner, &state, &as_admin(part, 0)).unwrap();
        assert!(plan[0].share.as_ref().unwrap().whole);
    }

    #[test]
    fn a_claim_with_partial_mps_shares_of_two_devices_is_refused() {
        let gpus = vec![plain_gpu(0), plain_gpu(1)];
        let (planner, state) = planner_on(gpus.clone(), ConsumableCapacity::Mps);
        let one = as_share(
            node_claim(UID_A, &[("a", "gpu-0"), ("b", "gpu-1")]),
            0,
            "s-1",
            &[("memory", "1Gi")],
        );
        // One partial share (beside a whole device) is served.
        let plan = plan_of(&planner, &state, &one).unwrap();
        assert_eq!(plan.len(), 2);
        let two = as_share(one, 1, "s-2", &[("memory", "1Gi")]);
        let e = plan_of(&planner, &state, &two).unwrap_err();
        assert!(
            matches!(&e, PrepareError::ShareRefused { device, reason, .. }
                if device == "gpu-1"
                    && reason.contains("partial MPS shares of several devices (gpu-0, gpu-1)")),
            "{e}"
        );
        // Shares that are not served by MPS daemons may span devices.
        let (planner, state) = planner_on(gpus, ConsumableCapacity::TimeSlicing);
        assert_eq!(plan_of(&planner, &state, &two).unwrap().len(), 2);
    }

    #[test]
    fn an_mps_share_beside_a_device_with_its_own_mps_daemon_is_refused() {
        let (planner, state) =
            planner_on(vec![plain_gpu(0), plain_gpu(1)], ConsumableCapacity::Mps);
        let claim = as_share(
            node_claim(UID_A, &[("part", "gpu-0"), ("solo", "gpu-1")]),
            0,
            "s-1",
            &[("memory", "1Gi")],
        );
        let mps = with_config(
            claim.clone(),
            "FromClaim",
            DRIVER,
            &["solo"],
            serde_json::from_str(MPS_CONFIG).unwrap(),
        );
        let e = plan_of(&planner, &state, &mps).unwrap_err();
        assert!(
            matches!(&e, PrepareError::ShareRefused { device, reason, .. }
                if device == "gpu-0"
                    && reason.contains("device gpu-1 with its own MPS daemon")),
            "{e}"
        );
        // A whole device time-sliced beside the share has no daemon of its own.
        let ts = with_config(
            claim,
            "FromClaim",
            DRIVER,
            &["solo"],
            json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
                   "sharing": {"strategy": "TimeSlicing"}}),
        );
        assert_eq!(plan_of(&planner, &state, &ts).unwrap().len(), 2);
    }

    #[test]
    fn an_mps_config_on_a_partial_share_becomes_its_client_limits() {
        let (planner, state) = planner_on(vec![plain_gpu(0)], ConsumableCapacity::Mps);
        let claim = with_config(
            as_share(
                node_claim(UID_A, &[("part", "gpu-0")]),
                0,
                "s-1",
                &[("memory", "2Gi")],
            ),
            "FromClaim",
            DRIVER,
            &["part"],
            serde_json::from_str(MPS_CONFIG).unwrap(),
        );
        let plan = plan_of(&planner, &state, &claim).unwrap();
        assert_eq!(
            plan[0].share.as_ref().unwrap().client_thread_percentage,
            Some(30)
        );
        // Folded into the share: not applied again as the device's own config.
        assert!(plan[0].config.is_none());
    }
}
