//! Generated protobuf messages, tonic servers and tonic clients for the kubelet plugin APIs.
//!
//! The `.proto` files live in `kubelet-plugin/proto/`; module paths follow the proto
//! packages. Clients are generated too: tests and the demo act as the kubelet.
#![allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used
)]

/// `pluginregistration`: the kubelet plugin watcher's registration service.
pub mod registration {
    tonic::include_proto!("pluginregistration");
}

/// `k8s.io.kubelet.pkg.apis.dra.*`: the DRA node service the kubelet calls to prepare claims.
pub mod dra {
    /// Version v1 (kubelet 1.34+), advertised as `v1.DRAPlugin`.
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
    /// Version v1beta1 (kubelet 1.33+), advertised as `v1beta1.DRAPlugin`.
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
}

/// `DRAResourceHealth`: the device health stream (not served yet).
pub mod health {
    /// Package `v1alpha1` (kubelet 1.34+), advertised as `v1alpha1.DRAResourceHealth`.
    pub mod v1alpha1 {
        tonic::include_proto!("v1alpha1");
    }
    /// Package `v1` (kubelet 1.37+), advertised as `v1.DRAResourceHealth`.
    pub mod v1 {
        tonic::include_proto!("v1");
    }
}
