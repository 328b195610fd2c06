//! The hand-over between the node side (`cleave-driver`) and the publisher
//! (`cleave-controller`): plain resource.k8s.io/v1 values, no client.

use k8s_openapi::api::resource::v1::{CounterSet, Device};

use crate::config::SharingStrategy;

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

/// Whether devices are published for sharing by capacity (`DRAConsumableCapacity`):
/// `--consumable-capacity=off|mps|time-slicing`. Publishing is the same for both sharing
/// modes; prepare reads the mode to decide how shares are enforced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum ConsumableCapacity {
    /// Every device goes to one claim at a time (as before consumable capacity).
    #[default]
    Off,
    /// Shares of a device are enforced with one MPS control daemon per device and client
    /// limits from each share's consumed capacity.
    Mps,
    /// Shares are scheduled by capacity and time-sliced, not enforced.
    TimeSlicing,
}

impl ConsumableCapacity {
    /// Every mode, in the order the flag lists them.
    pub const ALL: [ConsumableCapacity; 3] = [Self::Off, Self::Mps, Self::TimeSlicing];

    /// The flag value (`off`, `mps`, `time-slicing`).
    pub fn as_str(self) -> &'static str {
        self.sharing().map_or("off", SharingStrategy::label)
    }

    /// How shares of a device are shared in this mode; `None` when there are no shares.
    pub fn sharing(self) -> Option<SharingStrategy> {
        match self {
            Self::Off => None,
            Self::Mps => Some(SharingStrategy::Mps),
            Self::TimeSlicing => Some(SharingStrategy::TimeSlicing),
        }
    }

    /// True unless `Off`: devices are published with `allowMultipleAllocations`.
    pub fn is_on(self) -> bool {
        self != Self::Off
    }
}

impl std::fmt::Display for ConsumableCapacity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `--consumable-capacity` value that is none of `off`, `mps`, `time-slicing`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown consumable-capacity mode {0:?}: use one of off, mps, time-slicing")]
pub struct UnknownConsumableCapacity(pub String);

impl std::str::FromStr for ConsumableCapacity {
    type Err = UnknownConsumableCapacity;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| UnknownConsumableCapacity(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumable_capacity_modes_round_trip_and_bad_names_say_what_is_allowed() {
        for m in ConsumableCapacity::ALL {
            assert_eq!(m.as_str().parse::<ConsumableCapacity>(), Ok(m));
        }
        assert_eq!(ConsumableCapacity::default(), ConsumableCapacity::Off);
        assert!(!ConsumableCapacity::Off.is_on() && ConsumableCapacity::Mps.is_on());
        let e = "MPS".parse::<ConsumableCapacity>().unwrap_err().to_string();
        assert!(
            e.contains("\"MPS\"") && e.contains("off, mps, time-slicing"),
            "{e}"
        );
    }
}
