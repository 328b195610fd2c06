//! cleave-kubelet-plugin: the node daemon.
//!
//! The shell around the driver: [`server`] serves [`grpc`]'s DRA and registration
//! services on the kubelet's unix sockets; the DRA services call a
//! [`handler::ClaimHandler`]; [`serialize`] keeps prepare and unprepare batches of all
//! plugin instances on a node one at a time. [`cli`] and [`daemon`] wire it to the
//! driver (`cleave-driver`) and the slice publisher (`cleave-controller`).

pub mod cdi_hook;
pub mod cli;
pub mod coexistence;
pub mod daemon;
pub mod events;
pub mod grpc;
pub mod handler;
pub mod health;
pub mod inspect;
pub mod kube_handler;
pub mod lifecycle;
pub mod metrics;
pub mod mock;
pub mod mps_pod;
pub mod observability;
pub mod proto;
pub mod serialize;
pub mod server;
pub mod telemetry;

pub use grpc::RegistrationState;

/// Selects rustls' ring crypto provider for the whole process.
///
/// kube is built with ring, but a dependency of the CDI crate enables rustls' aws-lc-rs
/// too; with both compiled in, rustls cannot pick one and building a Kubernetes client
/// panics. Call once before creating a client; later calls do nothing.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
pub use handler::{ClaimHandler, ClaimRef, PreparedDevice};
pub use server::{PluginConfig, PluginServer, ServerError, connect_unix};
