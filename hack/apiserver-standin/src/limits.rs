//! The API server's limits on resource.k8s.io objects, as the stand-in enforces them: its
//! own table, written from kubernetes `pkg/apis/resource/types.go` (the internal API
//! types: `ResourceSliceMaxDevices` and friends, one Go constant per entry, named the same
//! here) and `pkg/apis/resource/validation/validation.go` (which limit applies where), at
//! release-1.34 and release-1.35/1.36 where they differ. The product keeps its own copy in
//! `cleave_api::limits`; a unit test compares the two, so a wrong constant on either side
//! fails instead of passing on both.

/// `validation.DNS1123LabelMaxLength` (apimachinery): device, counter, counter-set names.
pub const DNS1123_LABEL_MAX_LENGTH: usize = 63;
/// `validation.DNS1123SubdomainMaxLength` (apimachinery): class names, pool name parts.
pub const DNS1123_SUBDOMAIN_MAX_LENGTH: usize = 253;
/// `DriverNameMaxLength` (same as a CSI driver name).
pub const DRIVER_NAME_MAX_LENGTH: usize = 63;
/// `PoolNameMaxLength` (= `DNS1123SubdomainMaxLength`).
pub const POOL_NAME_MAX_LENGTH: usize = 253;
/// `ResourceSliceMaxDevices`.
pub const RESOURCE_SLICE_MAX_DEVICES: usize = 128;
/// `ResourceSliceMaxDevicesWithTaintsOrConsumesCounters` (1.35+).
pub const RESOURCE_SLICE_MAX_DEVICES_WITH_TAINTS_OR_CONSUMES_COUNTERS: usize = 64;
/// `ResourceSliceMaxAttributesAndCapacitiesPerDevice`.
pub const RESOURCE_SLICE_MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE: usize = 32;
/// Attribute values per device, list entries counted (1.36, `DRAListTypeAttributes`).
pub const RESOURCE_SLICE_MAX_ATTRIBUTE_VALUES_PER_DEVICE_1_36: usize = 48;
/// `DeviceAttributeMaxValueLength`: bytes of a string or version attribute.
pub const DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH: usize = 64;
/// `DeviceMaxDomainLength`: the domain part of a qualified name.
pub const DEVICE_MAX_DOMAIN_LENGTH: usize = 63;
/// `DeviceMaxIDLength`: the identifier part of a qualified name.
pub const DEVICE_MAX_ID_LENGTH: usize = 32;
/// `DeviceTaintsMaxLength` on 1.34.
pub const DEVICE_TAINTS_MAX_LENGTH_1_34: usize = 4;
/// `DeviceTaintsMaxLength` from 1.35.
pub const DEVICE_TAINTS_MAX_LENGTH_1_35: usize = 16;
/// `BindingConditionsMaxSize` (and `BindingFailureConditionsMaxSize`).
pub const BINDING_CONDITIONS_MAX_SIZE: usize = 4;
/// `ResourceSliceMaxSharedCounters` on 1.34: counters over all counter sets of a slice.
pub const RESOURCE_SLICE_MAX_SHARED_COUNTERS_1_34: usize = 32;
/// `ResourceSliceMaxCountersPerDevice` on 1.34: counters one device consumes.
pub const RESOURCE_SLICE_MAX_COUNTERS_PER_DEVICE_1_34: usize = 32;
/// `ResourceSliceMaxDeviceCountersPerSlice` on 1.34: counters consumed by all devices.
pub const RESOURCE_SLICE_MAX_DEVICE_COUNTERS_PER_SLICE_1_34: usize = 1024;
/// `ResourceSliceMaxCounterSets` (1.35+).
pub const RESOURCE_SLICE_MAX_COUNTER_SETS: usize = 8;
/// `ResourceSliceMaxCountersPerCounterSet` (1.35+).
pub const RESOURCE_SLICE_MAX_COUNTERS_PER_COUNTER_SET: usize = 32;
/// `ResourceSliceMaxDeviceCounterConsumptionsPerDevice` (1.35+).
pub const RESOURCE_SLICE_MAX_DEVICE_COUNTER_CONSUMPTIONS_PER_DEVICE: usize = 2;
/// `ResourceSliceMaxCountersPerDeviceCounterConsumption` (1.35+).
pub const RESOURCE_SLICE_MAX_COUNTERS_PER_DEVICE_COUNTER_CONSUMPTION: usize = 32;
/// `CapacityRequestPolicyDiscreteMaxOptions`: entries of `requestPolicy.validValues`.
pub const CAPACITY_REQUEST_POLICY_DISCRETE_MAX_OPTIONS: usize = 10;
/// `OpaqueParametersMaxLength`: bytes of opaque config parameters.
pub const OPAQUE_PARAMETERS_MAX_LENGTH: usize = 10 * 1024;
/// `AllocationResultsMaxSize`: device results per allocation.
pub const ALLOCATION_RESULTS_MAX_SIZE: usize = 32;
/// `AllocatedDeviceStatusMaxConditions`: conditions of one `status.devices` entry
/// (KEP-4817; kubernetes/api `resource/v1/types.go`).
pub const ALLOCATED_DEVICE_STATUS_MAX_CONDITIONS: usize = 8;
/// `AllocatedDeviceStatusDataMaxLength`: bytes of one entry's raw `data` JSON.
pub const ALLOCATED_DEVICE_STATUS_DATA_MAX_LENGTH: usize = 10 * 1024;
/// `NetworkDeviceDataMaxIPs`: `networkData.ips` entries.
pub const NETWORK_DEVICE_DATA_MAX_IPS: usize = 16;
/// `NetworkDeviceDataInterfaceNameMaxLength`.
pub const NETWORK_DEVICE_DATA_INTERFACE_NAME_MAX_LENGTH: usize = 256;
/// `NetworkDeviceDataHardwareAddressMaxLength`.
pub const NETWORK_DEVICE_DATA_HARDWARE_ADDRESS_MAX_LENGTH: usize = 128;

#[cfg(test)]
mod tests {
    use super::*;
    use cleave_api::limits as product;

    /// Every limit the product publishes against equals the stand-in's upstream table: a
    /// typo in either table fails here rather than passing on both sides.
    #[test]
    fn product_limits_match_the_upstream_table() {
        let pairs = [
            (
                "MAX_DEVICES_PER_SLICE",
                product::MAX_DEVICES_PER_SLICE,
                RESOURCE_SLICE_MAX_DEVICES,
            ),
            (
                "MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS",
                product::MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS,
                RESOURCE_SLICE_MAX_DEVICES_WITH_TAINTS_OR_CONSUMES_COUNTERS,
            ),
            (
                "MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE",
                product::MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE,
                RESOURCE_SLICE_MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE,
            ),
            (
                "MAX_ATTRIBUTE_VALUE_LENGTH",
                product::MAX_ATTRIBUTE_VALUE_LENGTH,
                DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH,
            ),
            (
                "MAX_ATTRIBUTE_DOMAIN_LENGTH",
                product::MAX_ATTRIBUTE_DOMAIN_LENGTH,
                DEVICE_MAX_DOMAIN_LENGTH,
            ),
            (
                "MAX_ATTRIBUTE_ID_LENGTH",
                product::MAX_ATTRIBUTE_ID_LENGTH,
                DEVICE_MAX_ID_LENGTH,
            ),
            (
                "MAX_TAINTS_PER_DEVICE",
                product::MAX_TAINTS_PER_DEVICE,
                DEVICE_TAINTS_MAX_LENGTH_1_34,
            ),
            (
                "MAX_SHARED_COUNTERS_PER_SLICE",
                product::MAX_SHARED_COUNTERS_PER_SLICE,
                RESOURCE_SLICE_MAX_SHARED_COUNTERS_1_34,
            ),
            (
                "MAX_COUNTER_SETS_PER_SLICE",
                product::MAX_COUNTER_SETS_PER_SLICE,
                RESOURCE_SLICE_MAX_COUNTER_SETS,
            ),
            (
                "MAX_COUNTERS_PER_COUNTER_SET",
                product::MAX_COUNTERS_PER_COUNTER_SET,
                RESOURCE_SLICE_MAX_COUNTERS_PER_COUNTER_SET,
            ),
            (
                "MAX_COUNTERS_PER_DEVICE",
                product::MAX_COUNTERS_PER_DEVICE,
                RESOURCE_SLICE_MAX_COUNTERS_PER_DEVICE_1_34,
            ),
            (
                "MAX_COUNTER_CONSUMPTIONS_PER_DEVICE",
                product::MAX_COUNTER_CONSUMPTIONS_PER_DEVICE,
                RESOURCE_SLICE_MAX_DEVICE_COUNTER_CONSUMPTIONS_PER_DEVICE,
            ),
            (
                "MAX_DEVICE_COUNTERS_PER_SLICE",
                product::MAX_DEVICE_COUNTERS_PER_SLICE,
                RESOURCE_SLICE_MAX_DEVICE_COUNTERS_PER_SLICE_1_34,
            ),
            (
                "MAX_DNS_LABEL_LENGTH",
                product::MAX_DNS_LABEL_LENGTH,
                DNS1123_LABEL_MAX_LENGTH,
            ),
            (
                "MAX_DRIVER_NAME_LENGTH",
                product::MAX_DRIVER_NAME_LENGTH,
                DRIVER_NAME_MAX_LENGTH,
            ),
            (
                "MAX_POOL_NAME_LENGTH",
                product::MAX_POOL_NAME_LENGTH,
                POOL_NAME_MAX_LENGTH,
            ),
            (
                "MAX_OPAQUE_PARAMETERS_LENGTH",
                product::MAX_OPAQUE_PARAMETERS_LENGTH,
                OPAQUE_PARAMETERS_MAX_LENGTH,
            ),
            (
                "MAX_ALLOCATION_RESULTS",
                product::MAX_ALLOCATION_RESULTS,
                ALLOCATION_RESULTS_MAX_SIZE,
            ),
        ];
        let wrong: Vec<String> = pairs
            .iter()
            .filter(|(_, p, u)| p != u)
            .map(|(name, p, u)| format!("cleave_api::limits::{name} = {p}, upstream {u}"))
            .collect();
        assert!(wrong.is_empty(), "{wrong:#?}");
    }
}
