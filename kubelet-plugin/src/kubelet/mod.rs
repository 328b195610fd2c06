//! The kubelet-facing shell: generated protos, the DRA node service (generic over
//! [`crate::kubelet::handler::ClaimHandler`]), plugin registration, the device health service, and
//! serving them on the kubelet's unix sockets. Nothing here knows the driver; what it
//! reports goes to observer traits ([`dra::DraObserver`]) that the metrics registry
//! implements.

pub(crate) mod dra;
pub(crate) mod handler;
pub mod proto;
pub(crate) mod registration;
pub(crate) mod resource_health;
pub(crate) mod server;
