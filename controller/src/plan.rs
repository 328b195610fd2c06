//! Desired state: how a node's [`PoolDevices`] is cut into ResourceSlices.
//!
//! Pure and synchronous: no client, no I/O. [`plan_slices`] never returns a slice the
//! API server of the chosen [`SliceLayout`] would reject (limits of
//! `cleave_api::limits` plus the few defined here, see shared API limits, docs/hardware-sources.md); what cannot be
//! published at all is a [`PlanError`] naming the offending device, group or counter set.
//!
//! Packing policy (so that a change on one GPU touches one slice):
//! - a group with counter sets gets slices of its own: on 1.34 one slice holding its
//!   counter sets and all its devices (they must share a slice); on 1.35+ its devices go
//!   to device-only slices (split at the device limit if needed) and its counter sets to
//!   counter-only slices packed in pool order;
//! - groups without counter sets are packed together in order, a group is split only
//!   when it alone exceeds the device limit;
//! - device order inside a slice is the pool order; an empty pool is one empty slice
//!   (an empty pool is not the same as no pool).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use cleave_api::limits::{
    MAX_ATTRIBUTE_VALUE_LENGTH, MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE,
    MAX_COUNTER_CONSUMPTIONS_PER_DEVICE, MAX_COUNTER_SETS_PER_SLICE, MAX_COUNTERS_PER_COUNTER_SET,
    MAX_COUNTERS_PER_DEVICE, MAX_DEVICE_COUNTERS_PER_SLICE, MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS, MAX_SHARED_COUNTERS_PER_SLICE,
    MAX_TAINTS_PER_DEVICE,
};
use cleave_api::names::is_dns_label;
use cleave_api::pool::{DeviceGroup, PoolDevices};
use k8s_openapi::api::resource::v1::{CounterSet, Device, ResourcePool, ResourceSliceSpec};

/// Counters named in one `consumesCounters` entry (1.35+ `ResourceSliceMaxCountersPerDeviceCounterConsumption`).
pub const MAX_COUNTERS_PER_COUNTER_CONSUMPTION: usize = 32;

/// How counter sets and their consumers are laid out over slices; the two Kubernetes
/// rules contradict each other, so the layout follows the server version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SliceLayout {
    /// Kubernetes 1.34: a counter set and the devices consuming it share one slice.
    CountersWithDevices,
    /// Kubernetes 1.35+: a slice holds devices or counter sets, never both; counter
    /// sets live in their own slices of the same pool.
    SeparateCounterSlices,
}

impl SliceLayout {
    /// Layout for a server reporting `major`/`minor` as in `/version` (`"1"`, `"35+"`).
    /// Unparsable versions get the 1.35+ layout (newer servers are the likelier case).
    pub fn for_server_version(major: &str, minor: &str) -> Self {
        let digits = |s: &str| -> Option<u32> {
            let d: String = s.chars().take_while(char::is_ascii_digit).collect();
            d.parse().ok()
        };
        match (digits(major), digits(minor)) {
            (Some(1), Some(minor)) if minor <= 34 => Self::CountersWithDevices,
            (Some(0), Some(_)) => Self::CountersWithDevices,
            _ => Self::SeparateCounterSlices,
        }
    }
}

impl fmt::Display for SliceLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::CountersWithDevices => "counters-with-devices (1.34)",
            Self::SeparateCounterSlices => "separate-counter-slices (1.35+)",
        })
    }
}

/// Content of one desired slice, without driver, node and pool bookkeeping.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SliceSpec {
    /// Devices in publishing order.
    pub devices: Vec<Device>,
    /// Counter sets published in this slice.
    pub shared_counters: Vec<CounterSet>,
}

impl SliceSpec {
    /// The API object spec for this slice in pool `pool` of `driver` on `node`.
    /// A slice that only carries counter sets omits `devices` (required on 1.35+).
    pub fn to_spec(&self, driver: &str, node: &str, pool: ResourcePool) -> ResourceSliceSpec {
        let counters_only = self.devices.is_empty() && !self.shared_counters.is_empty();
        ResourceSliceSpec {
            driver: driver.to_owned(),
            node_name: Some(node.to_owned()),
            pool,
            devices: (!counters_only).then(|| self.devices.clone()),
            shared_counters: (!self.shared_counters.is_empty())
                .then(|| self.shared_counters.clone()),
            ..ResourceSliceSpec::default()
        }
    }

    /// Device names, in order.
    pub fn device_names(&self) -> impl Iterator<Item = &str> {
        self.devices.iter().map(|d| d.name.as_str())
    }

    /// Counter-set names, in order.
    pub fn counter_set_names(&self) -> impl Iterator<Item = &str> {
        self.shared_counters.iter().map(|c| c.name.as_str())
    }
}

/// Why a pool cannot be published.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// One device alone breaks a per-device limit.
    #[error("device {device}: {what} is {count}, the API server allows at most {limit}")]
    DeviceOverLimit {
        /// Device name.
        device: String,
        /// What was counted.
        what: &'static str,
        /// How many it has.
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// A group (one GPU) cannot fit into a single slice although its layout needs that.
    #[error(
        "device group {group} (first device {first:?}): {what} is {count}, one slice allows at most {limit}"
    )]
    GroupOverLimit {
        /// Index of the group in the pool.
        group: usize,
        /// Its first device (or counter set) name, to identify it.
        first: String,
        /// What was counted.
        what: &'static str,
        /// How many it has.
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// A counter set alone has too many counters.
    #[error("counter set {counter_set}: {count} counters, at most {limit} allowed")]
    CounterSetOverLimit {
        /// Counter-set name.
        counter_set: String,
        /// How many counters it has.
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// Two devices of the pool share a name.
    #[error("device name {0} appears twice in the pool")]
    DuplicateDevice(String),
    /// Two counter sets of the pool share a name.
    #[error("counter set name {0} appears twice in the pool")]
    DuplicateCounterSet(String),
    /// A device consumes a counter set that its group does not have.
    #[error("device {device} consumes counter set {counter_set}, which its group does not publish")]
    UnknownCounterSet {
        /// Device name.
        device: String,
        /// Referenced counter set.
        counter_set: String,
    },
    /// A device consumes a counter that the counter set does not have.
    #[error(
        "device {device} consumes counter {counter} of counter set {counter_set}, which does not exist"
    )]
    UnknownCounter {
        /// Device name.
        device: String,
        /// Counter set.
        counter_set: String,
        /// Referenced counter.
        counter: String,
    },
    /// A device, counter set or counter name is not a DNS label.
    #[error(
        "{kind} name {name:?} is not a DNS label (lowercase alphanumerics and '-', at most 63)"
    )]
    InvalidName {
        /// Device, counter set or counter.
        kind: &'static str,
        /// The name.
        name: String,
    },
}

fn check_label(kind: &'static str, name: &str) -> Result<(), PlanError> {
    if is_dns_label(name) {
        Ok(())
    } else {
        Err(PlanError::InvalidName {
            kind,
            name: name.to_owned(),
        })
    }
}

/// Counters a device consumes over all its consumptions.
fn device_counters(d: &Device) -> usize {
    d.consumes_counters
        .iter()
        .flatten()
        .map(|c| c.counters.len())
        .sum()
}

fn device_needs_small_slice(d: &Device) -> bool {
    d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
        || d.taints.as_ref().is_some_and(|t| !t.is_empty())
}

fn over(device: &Device, what: &'static str, count: usize, limit: usize) -> Result<(), PlanError> {
    if count > limit {
        Err(PlanError::DeviceOverLimit {
            device: device.name.clone(),
            what,
            count,
            limit,
        })
    } else {
        Ok(())
    }
}

/// Per-device rules (the strictest of 1.34 and 1.35+, both layouts).
fn check_device(d: &Device) -> Result<(), PlanError> {
    check_label("device", &d.name)?;
    let attrs = d.attributes.as_ref().map_or(0, BTreeMap::len);
    let caps = d.capacity.as_ref().map_or(0, BTreeMap::len);
    over(
        d,
        "attributes + capacities",
        attrs + caps,
        MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE,
    )?;
    for a in d.attributes.iter().flat_map(BTreeMap::values) {
        let len = a
            .string
            .as_ref()
            .or(a.version.as_ref())
            .map_or(0, String::len);
        over(d, "attribute value length", len, MAX_ATTRIBUTE_VALUE_LENGTH)?;
    }
    over(
        d,
        "taints",
        d.taints.as_ref().map_or(0, Vec::len),
        MAX_TAINTS_PER_DEVICE,
    )?;
    let consumptions = d.consumes_counters.as_ref().map_or(0, Vec::len);
    over(
        d,
        "counter consumptions",
        consumptions,
        MAX_COUNTER_CONSUMPTIONS_PER_DEVICE,
    )?;
    for c in d.consumes_counters.iter().flatten() {
        over(
            d,
            "counters in one consumption",
            c.counters.len(),
            MAX_COUNTERS_PER_COUNTER_CONSUMPTION,
        )?;
    }
    over(
        d,
        "consumed counters",
        device_counters(d),
        MAX_COUNTERS_PER_DEVICE,
    )
}

fn check_counter_set(cs: &CounterSet) -> Result<(), PlanError> {
    check_label("counter set", &cs.name)?;
    for name in cs.counters.keys() {
        check_label("counter", name)?;
    }
    if cs.counters.len() > MAX_COUNTERS_PER_COUNTER_SET {
        return Err(PlanError::CounterSetOverLimit {
            counter_set: cs.name.clone(),
            count: cs.counters.len(),
            limit: MAX_COUNTERS_PER_COUNTER_SET,
        });
    }
    Ok(())
}

/// Pool-wide checks: names unique, every consumption resolves inside its group.
fn check_pool(pool: &PoolDevices) -> Result<(), PlanError> {
    let mut devices = BTreeSet::new();
    let mut sets = BTreeSet::new();
    for g in &pool.groups {
        for cs in &g.counter_sets {
            check_counter_set(cs)?;
            if !sets.insert(cs.name.as_str()) {
                return Err(PlanError::DuplicateCounterSet(cs.name.clone()));
            }
        }
        for d in &g.devices {
            check_device(d)?;
            if !devices.insert(d.name.as_str()) {
                return Err(PlanError::DuplicateDevice(d.name.clone()));
            }
            for c in d.consumes_counters.iter().flatten() {
                let Some(set) = g.counter_sets.iter().find(|s| s.name == c.counter_set) else {
                    return Err(PlanError::UnknownCounterSet {
                        device: d.name.clone(),
                        counter_set: c.counter_set.clone(),
                    });
                };
                if let Some(missing) = c.counters.keys().find(|k| !set.counters.contains_key(*k)) {
                    return Err(PlanError::UnknownCounter {
                        device: d.name.clone(),
                        counter_set: c.counter_set.clone(),
                        counter: missing.clone(),
                    });
                }
            }
        }
    }
    Ok(())
}

fn group_name(g: &DeviceGroup) -> String {
    g.devices
        .first()
        .map(|d| d.name.clone())
        .or_else(|| g.counter_sets.first().map(|c| c.name.clone()))
        .unwrap_or_default()
}

fn group_over(
    group: usize,
    g: &DeviceGroup,
    what: &'static str,
    count: usize,
    limit: usize,
) -> Result<(), PlanError> {
    if count > limit {
        Err(PlanError::GroupOverLimit {
            group,
            first: group_name(g),
            what,
            count,
            limit,
        })
    } else {
        Ok(())
    }
}

/// Accumulates devices into slices honouring the per-slice device limits.
#[derive(Default)]
struct DeviceBin {
    devices: Vec<Device>,
    small: bool,
    counters: usize,
}

impl DeviceBin {
    fn limit(small: bool) -> usize {
        if small {
            MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS
        } else {
            MAX_DEVICES_PER_SLICE
        }
    }

    /// Whether `extra` devices (with these properties) still fit.
    fn fits(&self, extra: usize, small: bool, counters: usize) -> bool {
        self.devices.len() + extra <= Self::limit(self.small || small)
            && self.counters + counters <= MAX_DEVICE_COUNTERS_PER_SLICE
    }

    fn push(&mut self, d: &Device) {
        self.small |= device_needs_small_slice(d);
        self.counters += device_counters(d);
        self.devices.push(d.clone());
    }

    fn take(&mut self) -> Option<SliceSpec> {
        if self.devices.is_empty() {
            return None;
        }
        let bin = std::mem::take(self);
        Some(SliceSpec {
            devices: bin.devices,
            shared_counters: Vec::new(),
        })
    }
}

/// Puts devices of one group into `bin`, keeping the group whole when it fits in an
/// empty slice, splitting it at the limits otherwise; full bins go to `out`.
fn pack_devices(bin: &mut DeviceBin, devices: &[Device], out: &mut Vec<SliceSpec>) {
    let small = devices.iter().any(device_needs_small_slice);
    let counters: usize = devices.iter().map(device_counters).sum();
    if !bin.fits(devices.len(), small, counters) {
        out.extend(bin.take());
    }
    for d in devices {
        if !bin.fits(1, device_needs_small_slice(d), device_counters(d)) {
            out.extend(bin.take());
        }
        bin.push(d);
    }
}

/// Cuts `pool` into slices for `layout` (see the module docs for the packing policy).
///
/// Errors when a device, counter set or group cannot be published under the limits of
/// that layout; the error names it.
pub fn plan_slices(pool: &PoolDevices, layout: SliceLayout) -> Result<Vec<SliceSpec>, PlanError> {
    check_pool(pool)?;
    let mut out = Vec::new();
    match layout {
        SliceLayout::CountersWithDevices => {
            let mut bin = DeviceBin::default();
            for (i, g) in pool.groups.iter().enumerate() {
                if g.counter_sets.is_empty() {
                    pack_devices(&mut bin, &g.devices, &mut out);
                    continue;
                }
                let shared: usize = g.counter_sets.iter().map(|c| c.counters.len()).sum();
                group_over(
                    i,
                    g,
                    "counters over its counter sets",
                    shared,
                    MAX_SHARED_COUNTERS_PER_SLICE,
                )?;
                let consumed: usize = g.devices.iter().map(device_counters).sum();
                group_over(
                    i,
                    g,
                    "counters consumed by its devices",
                    consumed,
                    MAX_DEVICE_COUNTERS_PER_SLICE,
                )?;
                let small = g.devices.iter().any(device_needs_small_slice);
                group_over(i, g, "devices", g.devices.len(), DeviceBin::limit(small))?;
                out.push(SliceSpec {
                    devices: g.devices.clone(),
                    shared_counters: g.counter_sets.clone(),
                });
            }
            out.extend(bin.take());
        }
        SliceLayout::SeparateCounterSlices => {
            let mut sets: Vec<CounterSet> = Vec::new();
            for g in &pool.groups {
                for cs in &g.counter_sets {
                    if sets.len() == MAX_COUNTER_SETS_PER_SLICE {
                        out.push(SliceSpec {
                            devices: Vec::new(),
                            shared_counters: std::mem::take(&mut sets),
                        });
                    }
                    sets.push(cs.clone());
                }
            }
            if !sets.is_empty() {
                out.push(SliceSpec {
                    devices: Vec::new(),
                    shared_counters: sets,
                });
            }
            let mut bin = DeviceBin::default();
            for g in &pool.groups {
                if g.counter_sets.is_empty() {
                    pack_devices(&mut bin, &g.devices, &mut out);
                } else {
                    // Own slice(s) for the group's devices.
                    let mut own = DeviceBin::default();
                    pack_devices(&mut own, &g.devices, &mut out);
                    out.extend(own.take());
                }
            }
            out.extend(bin.take());
        }
    }
    if out.is_empty() {
        out.push(SliceSpec::default());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{
        gpu_counter_set, on_demand_mig_group, on_demand_mig_pool, whole_gpu_device, whole_gpu_pool,
    };
    use k8s_openapi::api::resource::v1::{
        Counter, DeviceAttribute, DeviceCounterConsumption, DeviceTaint,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    const BOTH: [SliceLayout; 2] = [
        SliceLayout::CountersWithDevices,
        SliceLayout::SeparateCounterSlices,
    ];

    fn dev(name: &str) -> Device {
        Device {
            name: name.to_owned(),
            ..Device::default()
        }
    }

    fn plain_pool(n: usize) -> PoolDevices {
        PoolDevices {
            groups: vec![DeviceGroup {
                counter_sets: vec![],
                devices: (0..n).map(|i| dev(&format!("d-{i}"))).collect(),
            }],
        }
    }

    fn counters(prefix: &str, n: usize) -> BTreeMap<String, Counter> {
        (0..n)
            .map(|i| {
                (
                    format!("{prefix}-{i}"),
                    Counter {
                        value: Quantity("1".into()),
                    },
                )
            })
            .collect()
    }

    /// Every rule a server of `layout` applies to one slice.
    fn assert_valid(slices: &[SliceSpec], layout: SliceLayout) {
        for s in slices {
            let small = s.devices.iter().any(device_needs_small_slice);
            let max = if small {
                MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS
            } else {
                MAX_DEVICES_PER_SLICE
            };
            assert!(s.devices.len() <= max);
            let consumed: usize = s.devices.iter().map(device_counters).sum();
            match layout {
                SliceLayout::CountersWithDevices => {
                    let total: usize = s.shared_counters.iter().map(|c| c.counters.len()).sum();
                    assert!(total <= MAX_SHARED_COUNTERS_PER_SLICE);
                    assert!(consumed <= MAX_DEVICE_COUNTERS_PER_SLICE);
                    for d in &s.devices {
                        for c in d.consumes_counters.iter().flatten() {
                            assert!(
                                s.shared_counters.iter().any(|cs| cs.name == c.counter_set),
                                "consumer shares the slice"
                            );
                        }
                    }
                }
                SliceLayout::SeparateCounterSlices => {
                    assert!(
                        s.devices.is_empty() || s.shared_counters.is_empty(),
                        "only one of devices/sharedCounters"
                    );
                    assert!(s.shared_counters.len() <= MAX_COUNTER_SETS_PER_SLICE);
                    assert!(
                        s.shared_counters
                            .iter()
                            .all(|c| c.counters.len() <= MAX_COUNTERS_PER_COUNTER_SET)
                    );
                }
            }
            for d in &s.devices {
                check_device(d).unwrap();
            }
        }
    }

    fn all_devices(slices: &[SliceSpec]) -> Vec<String> {
        slices
            .iter()
            .flat_map(|s| s.device_names().map(str::to_owned))
            .collect()
    }

    #[test]
    fn layout_follows_server_version() {
        assert_eq!(
            SliceLayout::for_server_version("1", "34"),
            SliceLayout::CountersWithDevices
        );
        assert_eq!(
            SliceLayout::for_server_version("1", "34+"),
            SliceLayout::CountersWithDevices
        );
        assert_eq!(
            SliceLayout::for_server_version("1", "35"),
            SliceLayout::SeparateCounterSlices
        );
        assert_eq!(
            SliceLayout::for_server_version("1", "37+"),
            SliceLayout::SeparateCounterSlices
        );
        assert_eq!(
            SliceLayout::for_server_version("", ""),
            SliceLayout::SeparateCounterSlices
        );
    }

    #[test]
    fn eight_gpu_on_demand_mig_node_plans_in_both_layouts() {
        let pool = on_demand_mig_pool(8);
        assert_eq!(pool.device_count(), 8 * 26);
        assert_eq!(pool.groups[0].counter_sets[0].counters.len(), 12);
        let wanted: Vec<String> = pool.devices().map(|d| d.name.clone()).collect();
        let a = plan_slices(&pool, SliceLayout::CountersWithDevices).unwrap();
        assert_valid(&a, SliceLayout::CountersWithDevices);
        assert_eq!(a.len(), 8, "one slice per GPU");
        assert_eq!(all_devices(&a), wanted, "order kept");
        let b = plan_slices(&pool, SliceLayout::SeparateCounterSlices).unwrap();
        assert_valid(&b, SliceLayout::SeparateCounterSlices);
        assert_eq!(
            b.len(),
            9,
            "one counter slice (8 sets) + one device slice per GPU"
        );
        assert_eq!(b[0].shared_counters.len(), 8);
        assert_eq!(all_devices(&b), wanted);
    }

    #[test]
    fn empty_pool_is_one_empty_slice() {
        for layout in BOTH {
            assert_eq!(
                plan_slices(&PoolDevices::default(), layout).unwrap(),
                vec![SliceSpec::default()]
            );
        }
    }

    #[test]
    fn max_devices_per_slice() {
        for layout in BOTH {
            assert_eq!(
                plan_slices(&plain_pool(MAX_DEVICES_PER_SLICE), layout)
                    .unwrap()
                    .len(),
                1
            );
            let s = plan_slices(&plain_pool(MAX_DEVICES_PER_SLICE + 1), layout).unwrap();
            assert_eq!(
                s.iter().map(|s| s.devices.len()).collect::<Vec<_>>(),
                vec![MAX_DEVICES_PER_SLICE, 1]
            );
        }
    }

    #[test]
    fn whole_gpus_pack_into_one_slice() {
        for layout in BOTH {
            let s = plan_slices(&whole_gpu_pool(8), layout).unwrap();
            assert_eq!(s.len(), 1);
            assert_eq!(s[0].devices.len(), 8);
        }
    }

    #[test]
    fn max_devices_per_slice_with_taints() {
        let mut pool = plain_pool(MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS + 1);
        pool.groups[0].devices[0].taints = Some(vec![DeviceTaint {
            key: "k".into(),
            effect: "NoSchedule".into(),
            ..DeviceTaint::default()
        }]);
        for layout in BOTH {
            let s = plan_slices(&pool, layout).unwrap();
            assert_eq!(
                s[0].devices.len(),
                MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS
            );
            assert_valid(&s, layout);
        }
    }

    /// A group of `n` devices each consuming one counter of one set.
    fn counter_group(n: usize) -> DeviceGroup {
        let set = CounterSet {
            name: "set".into(),
            counters: counters("c", 1),
        };
        let devices = (0..n)
            .map(|i| Device {
                consumes_counters: Some(vec![DeviceCounterConsumption {
                    counter_set: "set".into(),
                    counters: counters("c", 1),
                }]),
                ..dev(&format!("d-{i}"))
            })
            .collect();
        DeviceGroup {
            counter_sets: vec![set],
            devices,
        }
    }

    #[test]
    fn max_devices_per_slice_with_counters() {
        let n = MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS;
        let ok = PoolDevices {
            groups: vec![counter_group(n)],
        };
        assert_eq!(
            plan_slices(&ok, SliceLayout::CountersWithDevices)
                .unwrap()
                .len(),
            1
        );
        let big = PoolDevices {
            groups: vec![counter_group(n + 1)],
        };
        // 1.34: the group must share a slice with its counter set: cannot be published.
        assert!(matches!(
            plan_slices(&big, SliceLayout::CountersWithDevices),
            Err(PlanError::GroupOverLimit { what: "devices", count, limit, .. }) if count == n + 1 && limit == n
        ));
        // 1.35+: consumers may be split over several device slices.
        let s = plan_slices(&big, SliceLayout::SeparateCounterSlices).unwrap();
        assert_eq!(
            s.iter().map(|s| s.devices.len()).collect::<Vec<_>>(),
            vec![0, n, 1]
        );
        assert_valid(&s, SliceLayout::SeparateCounterSlices);
    }

    #[test]
    fn max_attributes_and_capacities_per_device() {
        let mut d = dev("d-0");
        d.attributes = Some(
            (0..MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE)
                .map(|i| {
                    (
                        format!("a{i}"),
                        DeviceAttribute {
                            int: Some(1),
                            ..DeviceAttribute::default()
                        },
                    )
                })
                .collect(),
        );
        let mut pool = PoolDevices {
            groups: vec![DeviceGroup {
                counter_sets: vec![],
                devices: vec![d.clone()],
            }],
        };
        assert!(plan_slices(&pool, SliceLayout::CountersWithDevices).is_ok());
        d.capacity = Some(
            [("memory".to_owned(), Default::default())]
                .into_iter()
                .collect(),
        );
        pool.groups[0].devices[0] = d;
        assert!(matches!(
            plan_slices(&pool, SliceLayout::CountersWithDevices),
            Err(PlanError::DeviceOverLimit {
                what: "attributes + capacities",
                count: 33,
                limit: 32,
                ..
            })
        ));
    }

    #[test]
    fn max_attribute_value_length() {
        let mut d = dev("d-0");
        let long = "x".repeat(MAX_ATTRIBUTE_VALUE_LENGTH + 1);
        d.attributes = Some(
            [(
                "a".to_owned(),
                DeviceAttribute {
                    string: Some(long),
                    ..DeviceAttribute::default()
                },
            )]
            .into(),
        );
        let pool = PoolDevices {
            groups: vec![DeviceGroup {
                counter_sets: vec![],
                devices: vec![d],
            }],
        };
        assert!(matches!(
            plan_slices(&pool, SliceLayout::SeparateCounterSlices),
            Err(PlanError::DeviceOverLimit { .. })
        ));
    }

    #[test]
    fn max_taints_per_device() {
        let taint = DeviceTaint {
            key: "k".into(),
            effect: "NoSchedule".into(),
            ..DeviceTaint::default()
        };
        let mut d = dev("d-0");
        d.taints = Some(vec![taint; MAX_TAINTS_PER_DEVICE + 1]);
        let pool = PoolDevices {
            groups: vec![DeviceGroup {
                counter_sets: vec![],
                devices: vec![d],
            }],
        };
        assert!(matches!(
            plan_slices(&pool, SliceLayout::CountersWithDevices),
            Err(PlanError::DeviceOverLimit { what: "taints", .. })
        ));
    }

    #[test]
    fn max_shared_counters_per_slice_134() {
        let group = |n| DeviceGroup {
            counter_sets: vec![
                CounterSet {
                    name: "a".into(),
                    counters: counters("c", n),
                },
                CounterSet {
                    name: "b".into(),
                    counters: counters("c", MAX_SHARED_COUNTERS_PER_SLICE - n + 1),
                },
            ],
            devices: vec![dev("d")],
        };
        let pool = PoolDevices {
            groups: vec![group(16)],
        };
        assert!(matches!(
            plan_slices(&pool, SliceLayout::CountersWithDevices),
            Err(PlanError::GroupOverLimit {
                what: "counters over its counter sets",
                count: 33,
                limit: 32,
                ..
            })
        ));
        // 1.35+ puts the sets into a counter slice: fine.
        assert_valid(
            &plan_slices(&pool, SliceLayout::SeparateCounterSlices).unwrap(),
            SliceLayout::SeparateCounterSlices,
        );
    }

    #[test]
    fn max_counters_per_counter_set() {
        let pool = PoolDevices {
            groups: vec![DeviceGroup {
                counter_sets: vec![CounterSet {
                    name: "a".into(),
                    counters: counters("c", MAX_COUNTERS_PER_COUNTER_SET + 1),
                }],
                devices: vec![],
            }],
        };
        for layout in BOTH {
            assert!(matches!(
                plan_slices(&pool, layout),
                Err(PlanError::CounterSetOverLimit { count: 33, .. })
            ));
        }
    }

    #[test]
    fn max_counter_sets_per_slice_135() {
        let groups = (0..=MAX_COUNTER_SETS_PER_SLICE as u32)
            .map(|m| DeviceGroup {
                counter_sets: vec![gpu_counter_set(m)],
                devices: vec![],
            })
            .collect();
        let s = plan_slices(&PoolDevices { groups }, SliceLayout::SeparateCounterSlices).unwrap();
        assert_eq!(
            s.iter()
                .map(|s| s.shared_counters.len())
                .collect::<Vec<_>>(),
            vec![MAX_COUNTER_SETS_PER_SLICE, 1]
        );
    }

    #[test]
    fn max_counter_consumptions_and_counters_per_device() {
        let sets: Vec<CounterSet> = ["a", "b", "c"]
            .iter()
            .map(|n| CounterSet {
                name: (*n).into(),
                counters: counters("c", 32),
            })
            .collect();
        let consume = |set: &str, n| DeviceCounterConsumption {
            counter_set: set.into(),
            counters: counters("c", n),
        };
        let pool_with = |cc: Vec<DeviceCounterConsumption>| PoolDevices {
            groups: vec![DeviceGroup {
                counter_sets: sets.clone(),
                devices: vec![Device {
                    consumes_counters: Some(cc),
                    ..dev("d")
                }],
            }],
        };
        let ok = pool_with(vec![consume("a", 16), consume("b", 16)]);
        assert!(plan_slices(&ok, SliceLayout::SeparateCounterSlices).is_ok());
        let three = pool_with(vec![consume("a", 1), consume("b", 1), consume("c", 1)]);
        assert!(matches!(
            plan_slices(&three, SliceLayout::SeparateCounterSlices),
            Err(PlanError::DeviceOverLimit {
                what: "counter consumptions",
                count: 3,
                limit: 2,
                ..
            })
        ));
        let many = pool_with(vec![consume("a", 17), consume("b", 16)]);
        assert!(matches!(
            plan_slices(&many, SliceLayout::SeparateCounterSlices),
            Err(PlanError::DeviceOverLimit {
                what: "consumed counters",
                count: 33,
                limit: 32,
                ..
            })
        ));
    }

    #[test]
    fn max_device_counters_per_slice_134() {
        // 33 devices consuming 32 counters each: 1056 > 1024 in one slice.
        let set = CounterSet {
            name: "s".into(),
            counters: counters("c", 32),
        };
        let devices = (0..33)
            .map(|i| Device {
                consumes_counters: Some(vec![DeviceCounterConsumption {
                    counter_set: "s".into(),
                    counters: counters("c", 32),
                }]),
                ..dev(&format!("d-{i}"))
            })
            .collect::<Vec<_>>();
        let pool = PoolDevices {
            groups: vec![DeviceGroup {
                counter_sets: vec![set],
                devices,
            }],
        };
        assert!(matches!(
            plan_slices(&pool, SliceLayout::CountersWithDevices),
            Err(PlanError::GroupOverLimit {
                what: "counters consumed by its devices",
                count: 1056,
                limit: 1024,
                ..
            })
        ));
        let s = plan_slices(&pool, SliceLayout::SeparateCounterSlices).unwrap();
        assert_eq!(
            s.iter().map(|s| s.devices.len()).collect::<Vec<_>>(),
            vec![0, 32, 1]
        );
    }

    #[test]
    fn names_and_references_are_checked() {
        let mut pool = on_demand_mig_pool(2);
        pool.groups[1].devices.push(whole_gpu_device(0, None));
        assert_eq!(
            plan_slices(&pool, SliceLayout::CountersWithDevices),
            Err(PlanError::DuplicateDevice("gpu-0".into()))
        );
        let mut pool = on_demand_mig_pool(2);
        pool.groups[1].counter_sets[0].name = pool.groups[0].counter_sets[0].name.clone();
        assert!(matches!(
            plan_slices(&pool, SliceLayout::SeparateCounterSlices),
            Err(PlanError::DuplicateCounterSet(_))
        ));
        let mut pool = on_demand_mig_pool(2);
        let stray = pool.groups[0].devices[1].clone();
        pool.groups[1].devices[1] = Device {
            name: "stray".into(),
            ..stray
        };
        assert!(matches!(
            plan_slices(&pool, SliceLayout::SeparateCounterSlices),
            Err(PlanError::UnknownCounterSet { .. })
        ));
        let mut g = on_demand_mig_group(0, 0);
        g.counter_sets[0].counters.remove("ofa-engines");
        let pool = PoolDevices { groups: vec![g] };
        assert!(matches!(
            plan_slices(&pool, SliceLayout::CountersWithDevices),
            Err(PlanError::UnknownCounter { .. })
        ));
        let pool = PoolDevices {
            groups: vec![DeviceGroup {
                counter_sets: vec![],
                devices: vec![dev("GPU_0")],
            }],
        };
        assert!(matches!(
            plan_slices(&pool, SliceLayout::CountersWithDevices),
            Err(PlanError::InvalidName { .. })
        ));
    }

    #[test]
    fn counter_slices_omit_devices() {
        let s = plan_slices(&on_demand_mig_pool(1), SliceLayout::SeparateCounterSlices).unwrap();
        let spec = s[0].to_spec("d", "n", ResourcePool::default());
        assert!(spec.devices.is_none() && spec.shared_counters.is_some());
        let spec = s[1].to_spec("d", "n", ResourcePool::default());
        assert!(spec.devices.is_some() && spec.shared_counters.is_none());
        assert_eq!(spec.node_name.as_deref(), Some("n"));
    }
}
