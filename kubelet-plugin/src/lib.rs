//! cleave-kubelet-plugin: the node daemon, the product only (the demo and the test rig
//! live in `hack/`).
//!
//! What each module owns, from the entry point down: [`cli`] parses the command line into
//! the plain flag data of [`args`] and runs a subcommand; [`daemon`] is `run`'s loop
//! (signals, readiness, republishing, periodic checks); [`start`] brings the node up in
//! order (NVML, driver, publisher, servers) and decides, through its typed `StartError`,
//! what start-up waits for; [`lifecycle`] holds the node-local locks and `checkpoint reset`.
//! [`kubelet`] is the gRPC shell the kubelet talks to (protos, the DRA service generic over
//! [`handler::ClaimHandler`], registration, the health service, the unix-socket server);
//! [`kube_handler`] is the real handler (claims from the API server, the driver's prepare,
//! [`node_lock`], [`events`]). [`health`] keeps device health (the pure mapping
//! is the driver's `device_health`); [`metrics`] owns the whole Prometheus registry and the
//! HTTP endpoints, and the gRPC and health code report into it through observer traits they
//! define. [`mps_pod`] launches claims' MPS daemons in pods, [`mps_daemon`] is the program
//! inside such a pod. [`usage`] samples the prepared claims' usage for the metrics, idle
//! claims and the `usage` command. The rest are small tools: [`inspect`], [`coexistence`] (other GPU
//! managers on the node), [`cdi_hook`] (installing the hook binary), `mock` (loading the
//! mock NVML library for `--mock`; the development build's `mock` feature only),
//! [`telemetry`] (logging).

pub mod args;
pub mod cdi_hook;
pub mod claim_status;
pub mod cli;
pub mod coexistence;
pub mod daemon;
pub mod events;
pub mod handler;
pub mod health;
pub mod inspect;
pub mod kube_handler;
pub mod kubelet;
pub mod lifecycle;
pub mod metrics;
#[cfg(feature = "mock")]
pub mod mock;
pub mod mps_daemon;
pub mod mps_pod;
pub mod node_lock;
pub mod start;
pub mod telemetry;
pub mod usage;

pub use handler::{ClaimError, ClaimHandler, ClaimRef, PreparedDevice, PreparedShare};
pub use kubelet::proto;
pub use kubelet::registration::RegistrationState;
pub use kubelet::server::{PluginConfig, PluginServer, ServerError, connect_unix};

/// Selects rustls' ring crypto provider for the whole process.
///
/// kube is built with ring, but a dependency of the CDI crate enables rustls' aws-lc-rs
/// too; with both compiled in, rustls cannot pick one and building a Kubernetes client
/// panics. Call once before creating a client; later calls do nothing.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
