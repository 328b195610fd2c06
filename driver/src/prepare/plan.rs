//! Phase 1 of prepare: plan. Reads the claim's allocation results for this driver and
//! pool, checks that every device is known here and not prepared for another claim,
//! resolves and validates the opaque configs (class then claim, per request) and decides per
//! device what exists and what must be created. Nothing on the node changes here.

use std::collections::BTreeMap;

use cleave_api::config::DeviceKind as ConfigKind;
use cleave_api::merge::{ResolvedConfig, resolve_claim_configs};
use cleave_api::names::{DeviceName, profile_label};
use k8s_openapi::api::resource::v1::ResourceClaim;

use cleave_api::config::SharingStrategy;
use cleave_api::pool::ConsumableCapacity;

use super::{NodeDriver, PrepareError, State};
use crate::checkpoint::{DeviceKind, MigRecord, ShareRecord};
use crate::model::{GpuInfo, MigState};

/// What prepare will do for one device, decided before anything changes.
pub(super) struct PlannedDevice {
    pub(super) name: String,
    pub(super) kind: DeviceKind,
    pub(super) request_names: Vec<String>,
    pub(super) gpu: GpuInfo,
    /// Instance to use (static) or to create (on demand), if the device is a MIG instance.
    pub(super) mig: Option<MigRecord>,
    pub(super) config: Option<ResolvedConfig>,
    /// The share of the device the claim gets (an allocation result with a `shareID`);
    /// `None`: the claim has the device alone.
    pub(super) share: Option<ShareRecord>,
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
    }))
}

/// Whether `gpu` (as discovered, with the instances prepare made since) has the MIG
/// device `uuid`.
fn gpu_has_instance(gpu: &GpuInfo, uuid: &str) -> bool {
    matches!(&gpu.mig, MigState::Enabled { instances, .. } if instances.iter().any(|i| i.uuid == uuid))
}

pub(super) fn claim_label(claim: &ResourceClaim) -> String {
    format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    )
}

impl NodeDriver {
    /// Checks the allocation and decides per device what to do; changes nothing.
    pub(super) fn plan(
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
        let mut shares: BTreeMap<String, ShareRecord> = BTreeMap::new();
        let refuse = |device: &str, reason: String| PrepareError::ShareRefused {
            claim: label.to_owned(),
            device: device.to_owned(),
            reason,
        };
        for r in results
            .iter()
            .filter(|r| &r.driver == driver && &r.pool == pool)
        {
            let first = !requests.contains_key(&r.device);
            let entry = requests.entry(r.device.clone()).or_insert_with(|| {
                order.push(r.device.clone());
                Vec::new()
            });
            if !entry.contains(&r.request) {
                entry.push(r.request.clone());
            }
            let share = share_of(r).map_err(|reason| refuse(&r.device, reason))?;
            let known = shares.get(&r.device);
            let same = match (&share, known) {
                (None, None) => true,
                (Some(s), Some(k)) => s.share_id == k.share_id,
                _ => first,
            };
            if !same {
                return Err(refuse(
                    &r.device,
                    "the claim holds two allocations of this device (several shares, or a share and the whole device); request it once per claim".into(),
                ));
            }
            if let Some(s) = share {
                shares.insert(r.device.clone(), s);
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

            let share = shares.remove(&device);
            if let Some(s) = &share
                && self.config.consumable_capacity == ConsumableCapacity::Off
            {
                return Err(refuse(
                    &device,
                    format!(
                        "allocated as share {} (consumable capacity), but this node runs with --consumable-capacity off and publishes no shareable device; start the plugin with --consumable-capacity mps or time-slicing, or allocate the device whole",
                        s.share_id
                    ),
                ));
            }

            // Last line of defence: the scheduler should never hand out a device twice, nor
            // a device both whole and in shares.
            let mut joined: Option<MigRecord> = None;
            for other in state.data.claims.values().filter(|c| c.uid != uid) {
                let Some(theirs) = other.devices.iter().find(|d| d.name == device) else {
                    continue;
                };
                let other_label = format!("{}/{} ({})", other.namespace, other.name, other.uid);
                match (&share, &theirs.share) {
                    (Some(_), Some(_)) => {
                        // The MIG instance behind another share of this device (on demand
                        // or static) serves this share too: one instance per device, not
                        // one per share.
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
                            device,
                            other: other_label,
                        });
                    }
                    (None, Some(s)) => {
                        return Err(refuse(
                            &device,
                            format!(
                                "allocated whole (no shareID), but it is prepared as share {} for claim {other_label}; a whole-device claim waits until every share of the device is unprepared",
                                s.share_id
                            ),
                        ));
                    }
                    (Some(s), None) => {
                        return Err(refuse(
                            &device,
                            format!(
                                "allocated as share {}, but it is prepared for claim {other_label} alone; a share waits until that claim is unprepared",
                                s.share_id
                            ),
                        ));
                    }
                }
            }

            let (kind, mig) = self
                .plan_device(&name, gpu)
                .map_err(|r| unknown(&device, r))?;
            let mig = joined.or(mig);

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
            if let (Some(s), Some(sharing)) =
                (&share, config.as_ref().and_then(|c| c.config.sharing()))
            {
                let allowed = self.config.consumable_capacity == ConsumableCapacity::TimeSlicing
                    && sharing.strategy == SharingStrategy::TimeSlicing;
                if !allowed {
                    return Err(refuse(
                        &device,
                        format!(
                            "share {} has a sharing config (strategy {}); under --consumable-capacity {} a share is {}, so drop the config's sharing block{}",
                            s.share_id,
                            sharing.strategy,
                            self.config.consumable_capacity.as_str(),
                            match self.config.consumable_capacity {
                                ConsumableCapacity::Mps => "limited by MPS from what it consumed",
                                _ => "time-sliced with the GPU's other shares",
                            },
                            match self.config.consumable_capacity {
                                ConsumableCapacity::TimeSlicing =>
                                    " (a TimeSlicing block may set the interval)",
                                _ => "",
                            }
                        ),
                    ));
                }
            }

            plan.push(PlannedDevice {
                name: device,
                kind,
                request_names,
                gpu: gpu.clone(),
                mig,
                config,
                share,
            });
        }
        // A container reaches one MPS daemon (one CUDA_MPS_PIPE_DIRECTORY): a claim's MPS
        // shares and per-claim MPS devices cannot be mixed.
        if self.config.consumable_capacity == ConsumableCapacity::Mps {
            let shared: Vec<&str> = plan
                .iter()
                .filter(|d| d.share.is_some())
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
                        "the claim holds MPS shares of several devices ({}); each device has its own MPS daemon and a container can reach only one, so request shares of one device per claim",
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
        }
        Ok(plan)
    }

    /// The kind of a device and the MIG instance behind it, or why it cannot be prepared.
    pub(super) fn plan_device(
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
    pub(super) fn effective_configs(
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
}
