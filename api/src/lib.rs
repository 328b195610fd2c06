//! cleave-api: what users write and what every part of cleave agrees on.
//!
//! - [`config`]: the opaque config objects (`GpuConfig`, `MigConfig`) of claims and classes:
//!   strict decoding, defaults, validation ([`decode_config`]).
//! - [`merge`]: which config applies to which request of an allocated claim
//!   ([`resolve_claim_configs`]).
//! - [`quantity`]: Kubernetes quantities as exact integers.
//! - [`names`]: driver, attribute, capacity, class and CDI names; the device-name grammar.
//! - [`limits`]: API server limits on ResourceSlices.
//! - [`pool`]: the plain-data pool handed from the node side to the slice publisher.
//!
//! No Kubernetes client, gRPC or NVML here: only data, parsing and rules.

pub mod config;
pub mod limits;
pub mod merge;
pub mod names;
pub mod pool;
pub mod quantity;

pub use config::{
    ApplyError, ConfigError, ConfigSource, DeviceConfig, DeviceKind, GpuConfig, MigConfig,
    MpsConfig, PinnedMemoryLimit, Sharing, SharingStrategy, TimeSliceInterval, TimeSlicingConfig,
    ValidationError, decode_config, parse_config,
};
pub use merge::{
    ClaimConfigError, ConfigEntry, ResolvedConfig, merge_configs, resolve_allocation_configs,
    resolve_claim_configs,
};
pub use names::DeviceName;
pub use quantity::{Quantity, QuantityError};
