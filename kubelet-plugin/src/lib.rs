//! cleave-kubelet-plugin: the node daemon, the product only (the demo and the test rig
//! live in `hack/`).
//!
//! What each module owns, by role. The entry point: `cli` parses the command line into
//! the plain flag data of `args` and runs a subcommand; `daemon` is `run`'s loop
//! (signals, readiness, republishing, periodic checks, each a named handler); `start`
//! brings the node up in order (NVML, driver, publisher, servers, usage sampling; a file
//! under `start/` each) and decides, through its typed `StartError`, what start-up waits
//! for. It is the only module that wires the folders below together; they import one way
//! (`metrics` -> `k8s` -> `kubelet` -> `node`), checked by the testkit's import check.
//!
//! - `kubelet`: the gRPC shell the kubelet talks to (protos, the DRA service generic over
//!   `kubelet::handler::ClaimHandler`, registration, the `DRAResourceHealth` service, the unix-socket
//!   server).
//! - `k8s`: the API server side: `k8s::kube_handler` is the real claim handler (claims
//!   from the API server, the driver's prepare under the node lock), Events, claim status,
//!   MPS daemon pods, other GPU managers on the node.
//! - `node`: node-local state: the node lock, the instance lock and `checkpoint reset`
//!   (`node::lifecycle`), device health (`node::device_health`; the pure mapping is the driver's
//!   `device_health`), usage sampling and the `usage` command, the CDI hook binary.
//! - `metrics` owns the whole Prometheus registry and the HTTP endpoints (`/metrics`, the
//!   `/healthz` and `/readyz` probes); the gRPC, device health, claim handler and status
//!   code report into it through observer traits they define.
//! - Small tools: `inspect`, `mps_daemon` (the program inside an MPS daemon pod),
//!   `telemetry` (logging), and `mock` (loading the mock NVML library for `--mock`; the
//!   development build's `mock` feature only).

#![warn(unreachable_pub)]

pub mod args;
mod cli;
mod daemon;
mod inspect;
mod k8s;
mod kubelet;
mod metrics;
#[cfg(feature = "mock")]
pub mod mock;
mod mps_daemon;
mod node;
mod start;
mod telemetry;

// The public surface: what the binaries, the tests, the prepare bench and the demo use;
// everything else is crate-private.

/// The daemon binary's entry point: parses the command line and runs the subcommand.
pub use cli::main;
/// The claim handler the DRA service is generic over, and its request and result types.
pub use kubelet::handler::{
    ClaimError, ClaimHandler, ClaimRef, PrepareResult, PreparedDevice, PreparedShare,
    UnprepareResult,
};
/// The kubelet plugin's generated gRPC types (DRA, registration, health).
pub use kubelet::proto;
/// Whether the kubelet has registered the plugin.
pub use kubelet::registration::RegistrationState;
/// The gRPC service names of the two device health API versions.
pub use kubelet::resource_health::{HEALTH_V1, HEALTH_V1ALPHA1};
/// The unix-socket gRPC server, its configuration and errors, and a client connector.
pub use kubelet::server::{
    PluginConfig, PluginServer, ServerError, check_sockets_free, connect_unix,
};
/// The Prometheus registry of the whole daemon.
pub use metrics::Metrics;
/// Device health: the shared per-device health state the health service streams.
pub use node::device_health::DeviceHealth;
/// Brings the node up (NVML, driver, publisher, servers); the handle to the running plugin.
pub use start::{RunningPlugin, start};
/// Sets up logging; the log format flag's values.
pub use telemetry::{LogFormat, init as init_telemetry};

/// Usage sampling and rightsizing: the monitor, its configuration, and the exposition parser.
pub mod usage {
    pub use crate::node::usage::command::{Sample, parse_exposition};
    pub use crate::node::usage::recommend::{RightsizeConfig, Rightsizer};
    pub use crate::node::usage::{ClaimDevices, MonitorConfig, UsageMonitor, UsageRounds};
}

/// Selects rustls' ring crypto provider for the whole process.
///
/// kube is built with ring, but a dependency of the CDI crate enables rustls' aws-lc-rs
/// too; with both compiled in, rustls cannot pick one and building a Kubernetes client
/// panics. Call once before creating a client; later calls do nothing.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
