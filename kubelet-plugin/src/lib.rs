//! cleave-kubelet-plugin: the node daemon.
//!
//! The shell around the driver: [`server`] serves [`grpc`]'s DRA and registration
//! services on the kubelet's unix sockets; the DRA services call a
//! [`handler::ClaimHandler`]; [`serialize`] keeps prepare and unprepare batches of all
//! plugin instances on a node one at a time.

pub mod grpc;
pub mod handler;
pub mod proto;
pub mod serialize;
pub mod server;

pub use grpc::RegistrationState;
pub use handler::{ClaimHandler, ClaimRef, PreparedDevice};
pub use server::{PluginConfig, PluginServer, ServerError, connect_unix};
