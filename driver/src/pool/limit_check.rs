//! Test support: every ResourceSlice limit a built pool would break, so that tests of the
//! pool builder prove what they build publishes. The controller's slice planner enforces
//! the limits at run time; this list only names the breakage for assertions.

use std::collections::{BTreeMap, BTreeSet};

use cleave_api::limits;
use cleave_api::names::{DeviceName, is_dns_label};
use cleave_api::pool::PoolDevices;
use k8s_openapi::api::resource::v1::Device;

/// Every way `pool` breaks the API server's ResourceSlice limits (strictest supported
/// version) if each group is published in its own slice; empty when it publishes.
pub fn limit_violations(pool: &PoolDevices) -> Vec<String> {
    let mut out = Vec::new();
    for (gi, group) in pool.groups.iter().enumerate() {
        let with_counters = group
            .devices
            .iter()
            .any(|d| d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty()));
        let max_devices = if with_counters {
            limits::MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS
        } else {
            limits::MAX_DEVICES_PER_SLICE
        };
        if group.devices.len() > max_devices {
            out.push(format!(
                "group {gi}: {} devices > {max_devices}",
                group.devices.len()
            ));
        }
        if group.counter_sets.len() > limits::MAX_COUNTER_SETS_PER_SLICE {
            out.push(format!("group {gi}: too many counter sets"));
        }
        let shared: usize = group.counter_sets.iter().map(|s| s.counters.len()).sum();
        if shared > limits::MAX_SHARED_COUNTERS_PER_SLICE {
            out.push(format!("group {gi}: {shared} shared counters"));
        }
        let set_names: BTreeSet<&str> =
            group.counter_sets.iter().map(|s| s.name.as_str()).collect();
        for set in &group.counter_sets {
            if set.counters.len() > limits::MAX_COUNTERS_PER_COUNTER_SET {
                out.push(format!("counter set {}: too many counters", set.name));
            }
            for name in std::iter::once(&set.name).chain(set.counters.keys()) {
                if !is_dns_label(name) {
                    out.push(format!(
                        "counter set {}: {name:?} is not a DNS label",
                        set.name
                    ));
                }
            }
        }
        let mut device_counters = 0;
        let mut names = BTreeSet::new();
        for d in &group.devices {
            if !names.insert(d.name.as_str()) {
                out.push(format!("{}: duplicate device name", d.name));
            }
            device_counters += device_violations(d, group, &set_names, &mut out);
        }
        if device_counters > limits::MAX_DEVICE_COUNTERS_PER_SLICE {
            out.push(format!(
                "group {gi}: devices consume {device_counters} counters"
            ));
        }
    }
    out
}

/// Every way the device `d` of `group` breaks a limit, pushed on `out`; the counters it
/// consumes.
fn device_violations(
    d: &Device,
    group: &cleave_api::pool::DeviceGroup,
    set_names: &BTreeSet<&str>,
    out: &mut Vec<String>,
) -> usize {
    if d.name.parse::<DeviceName>().is_err() || !is_dns_label(&d.name) {
        out.push(format!("{}: not a valid device name", d.name));
    }
    let attrs = d.attributes.as_ref().map_or(0, BTreeMap::len);
    let caps = d.capacity.as_ref().map_or(0, BTreeMap::len);
    if attrs + caps > limits::MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE {
        out.push(format!(
            "{}: {} attributes and capacities",
            d.name,
            attrs + caps
        ));
    }
    for (k, v) in d.attributes.iter().flatten() {
        let set = [
            v.bool.is_some(),
            v.int.is_some(),
            v.string.is_some(),
            v.version.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count();
        if set != 1 {
            out.push(format!("{}: attribute {k} has {set} values", d.name));
        }
        let len = v
            .string
            .as_deref()
            .or(v.version.as_deref())
            .map_or(0, str::len);
        if len > limits::MAX_ATTRIBUTE_VALUE_LENGTH {
            out.push(format!("{}: attribute {k} is {len} bytes", d.name));
        }
        let id = k.rsplit('/').next().unwrap_or(k);
        if id.len() > limits::MAX_ATTRIBUTE_ID_LENGTH {
            out.push(format!("{}: attribute name {k} too long", d.name));
        }
    }
    let consumptions = d.consumes_counters.as_deref().unwrap_or(&[]);
    if consumptions.len() > limits::MAX_COUNTER_CONSUMPTIONS_PER_DEVICE {
        out.push(format!(
            "{}: {} counter consumptions",
            d.name,
            consumptions.len()
        ));
    }
    let n: usize = consumptions.iter().map(|c| c.counters.len()).sum();
    if n > limits::MAX_COUNTERS_PER_DEVICE {
        out.push(format!("{}: consumes {n} counters", d.name));
    }
    for c in consumptions {
        if !set_names.contains(c.counter_set.as_str()) {
            out.push(format!(
                "{}: counter set {} not in its group",
                d.name, c.counter_set
            ));
            continue;
        }
        let Some(set) = group.counter_sets.iter().find(|s| s.name == c.counter_set) else {
            continue;
        };
        for k in c.counters.keys() {
            if !set.counters.contains_key(k) {
                out.push(format!("{}: counter {k} not in set {}", d.name, set.name));
            }
        }
    }
    n
}
