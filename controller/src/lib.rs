//! cleave-controller: publishes a node's GPU pool as resource.k8s.io/v1 ResourceSlices
//! and keeps the API server in step with it.
//!
//! - [`plan`]: pure desired state, `PoolDevices` -> slices within the API server's
//!   limits, for the 1.34 or the 1.35+ counter layout;
//! - [`diff`]: pure comparison of existing and desired slices (matching, pool generation);
//! - [`publisher`]: the [`SlicePublisher`] background task (list+watch, minimal writes,
//!   backoff, status for readiness, uninstall);
//! - [`stats`]: API request counting for metrics;
//! - `fixtures` (feature `testing`, for tests and benchmarks only): synthetic pools.
//!
//! No NVML and no `cleave-driver` here: the driver hands over plain `PoolDevices`.

pub mod backoff;
pub mod diff;
#[cfg(any(test, feature = "testing"))]
pub mod fixtures;
pub mod plan;
pub mod publisher;
pub mod stats;
pub mod yaml;

pub use backoff::BackoffConfig;
pub use plan::{PlanError, SliceLayout, SliceSpec, plan_slices};
pub use publisher::{
    CounterSupport, Error, OtherDrivers, PARTITIONABLE_DEVICES_GATE, PublisherConfig,
    PublisherStatus, SlicePublisher, slices_yaml, uninstall_slices, without_counters,
};
pub use stats::{ApiObserver, ApiStats};

/// Kubernetes API calls the publisher makes: `(apiGroup, resource, verbs)`. The Helm
/// ClusterRole must grant at least these (see `controller/RBAC.md`).
pub const PUBLISHER_RBAC_RULES: &[(&str, &str, &[&str])] = &[
    (
        "resource.k8s.io",
        "resourceslices",
        &["get", "list", "watch", "create", "update", "delete"],
    ),
    ("", "nodes", &["get"]),
];

/// Everything the node plugin needs: the publisher's rules plus reading ResourceClaims
/// in prepare and writing their `status.devices` entries (a PUT of the status
/// subresource; `resourceclaims/driver` is the synthetic subresource that Kubernetes 1.36+
/// authorizes per driver name, `associated-node:<verb>` for a node's own claims). Compared
/// with the Helm ClusterRole by a test.
pub const RBAC_RULES: &[(&str, &str, &[&str])] = &[
    (
        "resource.k8s.io",
        "resourceslices",
        &["get", "list", "watch", "create", "update", "delete"],
    ),
    ("resource.k8s.io", "resourceclaims", &["get"]),
    ("resource.k8s.io", "resourceclaims/status", &["update"]),
    (
        "resource.k8s.io",
        "resourceclaims/driver",
        &["associated-node:update"],
    ),
    ("", "nodes", &["get"]),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rbac_rules_cover_the_publisher() {
        for (group, resource, verbs) in PUBLISHER_RBAC_RULES {
            let rule = RBAC_RULES
                .iter()
                .find(|(g, r, _)| g == group && r == resource)
                .unwrap();
            assert!(verbs.iter().all(|v| rule.2.contains(v)), "{resource}");
        }
    }
}
