//! Phase 1 of prepare: plan. Reads the claim's allocation results for this driver and
//! pool, checks that every device is known here and not prepared for another claim,
//! resolves and validates the opaque configs (class then claim, per request) and decides per
//! device what exists and what must be created. Nothing on the node changes here.

use std::collections::BTreeMap;

use cleave_api::config::DeviceKind as ConfigKind;
use cleave_api::merge::{ResolvedConfig, resolve_claim_configs};
use cleave_api::names::{DeviceName, profile_label};
use k8s_openapi::api::resource::v1::ResourceClaim;

use super::{NodeDriver, PrepareError, State};
use crate::checkpoint::{DeviceKind, MigRecord};
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
