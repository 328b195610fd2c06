//! cleave-kubelet-plugin: the node daemon.
//!
//! The shell around the driver: [`server`] serves [`grpc`]'s DRA and registration
//! services on the kubelet's unix sockets; the DRA services call a
//! [`handler::ClaimHandler`]; [`serialize`] keeps prepare and unprepare batches of all
//! plugin instances on a node one at a time. [`cli`] and [`daemon`] wire it to the
//! driver (`cleave-driver`) and the slice publisher (`cleave-controller`).

pub mod cli;
pub mod daemon;
pub mod grpc;
pub mod handler;
pub mod inspect;
pub mod mock;
pub mod proto;
pub mod serialize;
pub mod server;
pub mod telemetry;

pub use grpc::RegistrationState;
pub use handler::{ClaimHandler, ClaimRef, PreparedDevice};
pub use server::{PluginConfig, PluginServer, ServerError, connect_unix};
