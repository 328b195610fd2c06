//! cleave-driver: everything that happens on a node, without a Kubernetes client or gRPC.

pub mod backend;
pub mod model;
