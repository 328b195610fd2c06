//! Limits the API server enforces on resource.k8s.io/v1 ResourceSlices, per Kubernetes
//! version (sources: `k8s.io/api/resource/v1/types.go` and
//! `pkg/apis/resource/validation/validation.go`, see shared API limits, docs/hardware-sources.md). The publisher
//! keeps to the strictest rule among supported versions unless it says otherwise.

/// Devices per slice (all versions).
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// Devices per slice when any device has taints or consumes counters (1.35+).
pub const MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS: usize = 64;
/// Attributes plus capacities per device.
pub const MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE: usize = 32;
/// Bytes of a string or version attribute value.
pub const MAX_ATTRIBUTE_VALUE_LENGTH: usize = 64;
/// Length of the domain part of a qualified attribute name.
pub const MAX_ATTRIBUTE_DOMAIN_LENGTH: usize = 63;
/// Length of the identifier part of a qualified attribute name.
pub const MAX_ATTRIBUTE_ID_LENGTH: usize = 32;
/// Taints per device on 1.34 (16 from 1.35).
pub const MAX_TAINTS_PER_DEVICE: usize = 4;
/// Counters over all counter sets of one slice (1.34).
pub const MAX_SHARED_COUNTERS_PER_SLICE: usize = 32;
/// Counter sets per slice (1.35+).
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
/// Counters per counter set (1.35+).
pub const MAX_COUNTERS_PER_COUNTER_SET: usize = 32;
/// Counters one device consumes, over all its consumptions (1.34).
pub const MAX_COUNTERS_PER_DEVICE: usize = 32;
/// Counter consumptions (`consumesCounters` entries) per device (1.35+).
pub const MAX_COUNTER_CONSUMPTIONS_PER_DEVICE: usize = 2;
/// Counters consumed by all devices of one slice together (1.34).
pub const MAX_DEVICE_COUNTERS_PER_SLICE: usize = 1024;
/// DNS label length (device, counter, counter-set names).
pub const MAX_DNS_LABEL_LENGTH: usize = 63;
/// Driver name length.
pub const MAX_DRIVER_NAME_LENGTH: usize = 63;
/// Pool name length.
pub const MAX_POOL_NAME_LENGTH: usize = 253;
/// Bytes of opaque config parameters.
pub const MAX_OPAQUE_PARAMETERS_LENGTH: usize = 10 * 1024;
/// Device results per allocation.
pub const MAX_ALLOCATION_RESULTS: usize = 32;
