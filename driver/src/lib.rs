//! cleave-driver: everything that happens on a node, without a Kubernetes client or gRPC.
//!
//! - [`model`]: the discovered device model; [`backend`]: the hardware seam (`GpuBackend`);
//!   [`nvml`]: the real backend over NVML.
//! - [`pool`]: turns the model into published devices; [`inspect`]: human-readable views.
//! - [`prepare`]: the prepare/unprepare state machine; [`cdi`]: CDI spec files;
//!   [`container_edits`]: what CDI adds to a container; [`checkpoint`]: the durable record
//!   of prepared claims; [`driver_root`]: driver files.
//! - [`health`]: device health events; [`usage`]: per-claim usage sampling and idle claims.

#![warn(unreachable_pub)]

pub mod backend;
pub mod cdi;
pub mod checkpoint;
pub(crate) mod container_edits;
pub mod device_health;
pub mod driver_root;
pub(crate) mod durable;
pub mod fault;
pub mod health;
pub mod inspect;
pub(crate) mod metadata;
pub mod model;
pub(crate) mod numa;
pub mod nvml;
pub mod pool;
pub mod prepare;
pub mod rightsize;
pub mod sharing;
pub mod timing;
pub mod usage;
