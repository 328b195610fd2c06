//! cleave-kubelet-plugin: the node daemon, the product only (the demo and the test rig
//! live in `hack/`).
//!
//! What each module owns, by role. The entry point: [`cli`] parses the command line into
//! the plain flag data of [`args`] and runs a subcommand; [`daemon`] is `run`'s loop
//! (signals, readiness, republishing, periodic checks, each a named handler); [`start`]
//! brings the node up in order (NVML, driver, publisher, servers) and decides, through its
//! typed `StartError`, what start-up waits for.
//!
//! - [`kubelet`]: the gRPC shell the kubelet talks to (protos, the DRA service generic over
//!   [`kubelet::handler::ClaimHandler`], registration, the health service, the unix-socket
//!   server).
//! - [`k8s`]: the API server side: [`k8s::kube_handler`] is the real claim handler (claims
//!   from the API server, the driver's prepare under the node lock), Events, claim status,
//!   MPS daemon pods, other GPU managers on the node.
//! - [`node`]: node-local state: the node lock, the instance lock and `checkpoint reset`
//!   ([`node::lifecycle`]), device health (the pure mapping is the driver's
//!   `device_health`), usage sampling and the `usage` command, the CDI hook binary.
//! - [`metrics`] owns the whole Prometheus registry and the HTTP endpoints; the gRPC and
//!   health code report into it through observer traits they define.
//! - Small tools: [`inspect`], [`mps_daemon`] (the program inside an MPS daemon pod),
//!   [`telemetry`] (logging), and `mock` (loading the mock NVML library for `--mock`; the
//!   development build's `mock` feature only).

pub mod args;
pub mod cli;
pub mod daemon;
pub mod inspect;
pub mod k8s;
pub mod kubelet;
pub mod metrics;
#[cfg(feature = "mock")]
pub mod mock;
pub mod mps_daemon;
pub mod node;
pub mod start;
pub mod telemetry;

pub use kubelet::handler::{ClaimError, ClaimHandler, ClaimRef, PreparedDevice, PreparedShare};
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
