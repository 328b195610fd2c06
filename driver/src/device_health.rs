//! Device health as published state, with no I/O: which published devices an NVML
//! [`HealthEvent`] concerns, the conditions that make devices unhealthy, their expiry, and
//! how they change the pool to publish. The kubelet plugin keeps the stream, the service
//! and the wiring around it.
//!
//! Which devices an event concerns: a GPU-wide event (no GPU/compute instance id) makes
//! every published device of that GPU unhealthy (`gpu-<minor>` and all its MIG devices or
//! on-demand placements); an event attributed to a GPU/compute instance only the MIG device
//! with those ids (all devices of the GPU when the ids match no known instance).
//!
//! Recovery: a lost GPU is healthy again as soon as it answers (a `Recovered` event). Xid
//! and ECC conditions stay, or until their duration runs out when one is given.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cleave_api::names::DeviceName;
use cleave_api::pool::PoolDevices;
use k8s_openapi::api::resource::v1::DeviceTaint;
use tracing::warn;

use crate::health::{HealthEvent, HealthEventKind};
use crate::model::{MigState, NodeInventory};

/// Taint key of a device marked unhealthy by a fatal Xid (value: the Xid number).
pub const TAINT_XID: &str = "gpu.cleave.dev/xid";
/// Taint key of a device marked unhealthy otherwise (value: the event kind).
pub(crate) const TAINT_UNHEALTHY: &str = "gpu.cleave.dev/unhealthy";
/// Longest condition message (the health stream and Events carry it).
pub(crate) const MAX_MESSAGE: usize = 1024;

/// Why a device is unhealthy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    /// What happened (kind and, for Xids, the number).
    pub kind: HealthEventKind,
    /// The Xid number for Xid conditions.
    pub xid: Option<u64>,
    /// UUID of the GPU the condition came from.
    pub gpu_uuid: String,
    /// Human-readable reason.
    pub message: String,
    /// When the mark clears by itself (Xid/ECC with a duration), if ever.
    pub expires: Option<Instant>,
}

impl Condition {
    /// The NoSchedule taint this condition publishes.
    pub fn taint(&self) -> DeviceTaint {
        let (key, value) = match (self.kind, self.xid) {
            (HealthEventKind::Xid, Some(xid)) => (TAINT_XID, xid.to_string()),
            (kind, _) => (TAINT_UNHEALTHY, kind.as_str().to_owned()),
        };
        DeviceTaint {
            key: key.to_owned(),
            value: Some(value),
            effect: "NoSchedule".to_owned(),
            time_added: None,
        }
    }
}

/// One device as the health stream reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceStatus {
    /// Device name in the pool.
    pub device: String,
    /// False when a condition holds.
    pub healthy: bool,
    /// Reason (empty when healthy).
    pub message: String,
}

/// The published devices and the conditions that hold on them: the pure part of the
/// health state machine (the caller serialises access and tells subscribers).
#[derive(Debug, Clone, Default)]
pub struct DeviceConditions {
    /// Devices of the published pool, in pool order.
    devices: Vec<String>,
    /// Conditions by device name.
    conditions: BTreeMap<String, Condition>,
}

impl DeviceConditions {
    /// Every device of `pool` healthy.
    pub fn new(pool: &PoolDevices) -> Self {
        Self {
            devices: pool.devices().map(|d| d.name.clone()).collect(),
            conditions: BTreeMap::new(),
        }
    }

    /// Follows a new pool (its devices, in order); conditions are kept.
    pub fn set_pool(&mut self, pool: &PoolDevices) {
        self.devices = pool.devices().map(|d| d.name.clone()).collect();
    }

    /// Devices of the published pool, in pool order.
    pub fn devices(&self) -> &[String] {
        &self.devices
    }

    /// Applies one event at `now`: a `Recovered` event clears the `Lost` condition of the
    /// devices it concerns, any other one sets its condition on them (expiring after
    /// `xid_duration` unless it is a lost GPU). Returns the devices whose state changed.
    pub fn apply(
        &mut self,
        event: &HealthEvent,
        inventory: &NodeInventory,
        xid_duration: Option<Duration>,
        now: Instant,
    ) -> Vec<String> {
        let targets = affected_devices(event, inventory, &self.devices);
        let mut changed = Vec::new();
        for device in &targets {
            if event.kind == HealthEventKind::Recovered {
                let was_lost = self
                    .conditions
                    .get(device)
                    .is_some_and(|c| c.kind == HealthEventKind::Lost);
                if was_lost {
                    self.conditions.remove(device);
                    changed.push(device.clone());
                }
                continue;
            }
            let condition = Condition {
                kind: event.kind,
                xid: event.xid,
                gpu_uuid: event.gpu_uuid.clone(),
                message: truncate(event.describe()),
                expires: match event.kind {
                    HealthEventKind::Lost => None,
                    _ => xid_duration.map(|d| now + d),
                },
            };
            if self.conditions.get(device) != Some(&condition) {
                self.conditions.insert(device.clone(), condition);
                changed.push(device.clone());
            }
        }
        changed
    }

    /// Drops the conditions whose duration ran out by `now`; returns their devices.
    pub fn expire(&mut self, now: Instant) -> Vec<String> {
        let gone: Vec<String> = self
            .conditions
            .iter()
            .filter(|(_, c)| c.expires.is_some_and(|e| e <= now))
            .map(|(d, _)| d.clone())
            .collect();
        for d in &gone {
            self.conditions.remove(d);
        }
        gone
    }

    /// The condition of `device`, if it is unhealthy.
    pub fn condition(&self, device: &str) -> Option<&Condition> {
        self.conditions.get(device)
    }

    /// Unhealthy devices with their conditions, by name.
    pub fn conditions(&self) -> impl Iterator<Item = (&String, &Condition)> {
        self.conditions.iter()
    }

    /// How many devices are unhealthy.
    pub fn unhealthy(&self) -> usize {
        self.conditions.len()
    }

    /// Every device with its state, in pool order (the stream's complete list).
    pub fn statuses(&self) -> Vec<DeviceStatus> {
        self.devices
            .iter()
            .map(|d| match self.conditions.get(d) {
                Some(c) => DeviceStatus {
                    device: d.clone(),
                    healthy: false,
                    message: c.message.clone(),
                },
                None => DeviceStatus {
                    device: d.clone(),
                    healthy: true,
                    message: String::new(),
                },
            })
            .collect()
    }

    /// `pool` with the unhealthy devices tainted (`taints`) or removed.
    pub fn apply_to_pool(&self, mut pool: PoolDevices, taints: bool) -> PoolDevices {
        for group in &mut pool.groups {
            if taints {
                for d in &mut group.devices {
                    if let Some(c) = self.conditions.get(&d.name) {
                        let taint = c.taint();
                        let taints = d.taints.get_or_insert_with(Vec::new);
                        if !taints.iter().any(|t| t.key == taint.key) {
                            taints.push(taint);
                        }
                    }
                }
            } else {
                group
                    .devices
                    .retain(|d| !self.conditions.contains_key(&d.name));
            }
        }
        pool
    }
}

/// Cuts `s` to at most [`MAX_MESSAGE`] bytes (on a character boundary, ending in `...`).
pub fn truncate(mut s: String) -> String {
    if s.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE - 3;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

/// The published devices an event concerns (see the module doc).
pub(crate) fn affected_devices(
    event: &HealthEvent,
    inventory: &NodeInventory,
    published: &[String],
) -> Vec<String> {
    let Some(gpu) = inventory.gpus.iter().find(|g| g.uuid == event.gpu_uuid) else {
        warn!(gpu = %event.gpu_uuid, "health event for an unknown GPU");
        return Vec::new();
    };
    let of_gpu: Vec<String> = published
        .iter()
        .filter(|n| {
            n.parse::<DeviceName>()
                .is_ok_and(|d| d.minor() == gpu.minor)
        })
        .cloned()
        .collect();
    let Some(gi) = event.gi else {
        return of_gpu;
    };
    if let MigState::Enabled { instances, .. } = &gpu.mig {
        let names: Vec<String> = instances
            .iter()
            .filter(|i| i.gi_id == gi && event.ci.is_none_or(|ci| i.ci_id == ci))
            .map(|i| DeviceName::mig(gpu.minor, &i.profile_name, i.placement.start).to_string())
            .filter(|n| published.contains(n))
            .collect();
        if !names.is_empty() {
            return names;
        }
    }
    warn!(gpu = %event.gpu_uuid, gi, ci = ?event.ci, "no published MIG device has these ids; marking the whole GPU");
    of_gpu
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{GpuInfo, MigInstance};
    use crate::prepare::testing::{mig_instance as inst, xid_event as ev};

    /// An H100 `GPU-<minor>`, with MIG on when it has instances.
    fn gpu(minor: u32, instances: Vec<MigInstance>) -> GpuInfo {
        let mig = if instances.is_empty() {
            MigState::NotCapable
        } else {
            MigState::Enabled {
                profiles: crate::prepare::testing::h100_profiles(),
                instances,
                memory_slices: 8,
            }
        };
        GpuInfo {
            uuid: format!("GPU-{minor}"),
            ..crate::prepare::testing::h100_gpu(minor, mig)
        }
    }

    #[test]
    fn gpu_wide_and_instance_events_map_to_devices() {
        let inv = NodeInventory {
            driver_version: String::new(),
            driver_semver: String::new(),
            cuda_driver_semver: String::new(),
            gpus: vec![
                gpu(0, vec![inst(7, 0, "1g.10gb", 0), inst(8, 0, "1g.10gb", 1)]),
                gpu(1, Vec::new()),
            ],
        };
        let names = [
            "gpu-0",
            "gpu-0-mig-1g10gb-0",
            "gpu-0-mig-1g10gb-1",
            "gpu-0-mig-2g20gb-2",
            "gpu-1",
        ];
        let published: Vec<String> = names.iter().map(|s| (*s).to_owned()).collect();
        assert_eq!(
            affected_devices(&ev("GPU-0", None, None, 79, true), &inv, &published),
            &names[..4]
        );
        assert_eq!(
            affected_devices(&ev("GPU-0", Some(8), Some(0), 79, true), &inv, &published),
            ["gpu-0-mig-1g10gb-1"]
        );
        // Unknown ids: the whole GPU.
        assert_eq!(
            affected_devices(&ev("GPU-0", Some(3), Some(0), 79, true), &inv, &published).len(),
            4
        );
        assert!(affected_devices(&ev("GPU-9", None, None, 79, true), &inv, &published).is_empty());
    }

    #[test]
    fn long_messages_are_truncated() {
        let s = truncate("é".repeat(2000));
        assert!(s.len() <= MAX_MESSAGE && s.ends_with("..."));
    }
}
