//! The hand-over between the node side (`cleave-driver`) and the publisher
//! (`cleave-controller`): plain resource.k8s.io/v1 values, no client.

use k8s_openapi::api::resource::v1::{CounterSet, Device};

/// Devices that must be published in the same ResourceSlice as the counter sets they
/// consume (on Kubernetes 1.34 a counter set and its consumers share a slice).
/// The driver emits one group per GPU; groups without counter sets may be merged freely.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceGroup {
    /// Counter sets of this group (empty unless on-demand MIG is on).
    pub counter_sets: Vec<CounterSet>,
    /// Devices, in the order they should be published (the scheduler takes the first fit).
    pub devices: Vec<Device>,
}

/// Everything the node publishes for its pool (`<node name>`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PoolDevices {
    /// Groups in publishing order.
    pub groups: Vec<DeviceGroup>,
}

impl PoolDevices {
    /// Number of devices over all groups.
    pub fn device_count(&self) -> usize {
        self.groups.iter().map(|g| g.devices.len()).sum()
    }

    /// Iterates all devices in publishing order.
    pub fn devices(&self) -> impl Iterator<Item = &Device> {
        self.groups.iter().flat_map(|g| g.devices.iter())
    }
}
