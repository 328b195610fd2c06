//! Detects other managers of this node's GPUs: the NVIDIA device plugin (extended resources
//! `nvidia.com/gpu`, `nvidia.com/mig-*` on the Node) and other DRA drivers (ResourceSlices of
//! this node, of another driver, whose devices carry one of our GPU UUIDs in a `uuid`
//! attribute of any domain).
//!
//! Findings are warnings in the log and Warning Events on the Node
//! (`GPUsSharedWithDevicePlugin`, `GPUsSharedWithOtherDriver`); the plugin never refuses to
//! start, because a disjoint split (the device plugin limited to other GPUs) is legitimate
//! and not visible from here. Checked once after start-up, from what start-up already read:
//! the Node as read once when the process started ([`StartNode`]; resources a device plugin
//! registers later are not seen until the next start) and the other drivers' slices the slice
//! publisher's watch brings with its first list (it selects the node only,
//! [`cleave_controller::SlicePublisher::other_drivers`]), so the check sends no request of
//! its own but its Events. RBAC: `nodes` `get`, `resourceslices` `list`/`watch` (the
//! publisher's), events.

use std::collections::BTreeSet;

use cleave_controller::OtherDrivers;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use tracing::{info, warn};

use crate::k8s::events::{EventReporter, Severity, StartNode};

/// Event reason: the Node advertises NVIDIA device-plugin resources.
pub(crate) const REASON_DEVICE_PLUGIN: &str = "GPUsSharedWithDevicePlugin";
/// Event reason: another DRA driver publishes devices with our GPU UUIDs.
pub(crate) const REASON_OTHER_DRIVER: &str = "GPUsSharedWithOtherDriver";

/// One other manager of this node's GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Finding {
    /// Extended resources of the NVIDIA device plugin on the Node (name=quantity).
    DevicePlugin(Vec<String>),
    /// Another DRA driver publishes these of our GPU UUIDs.
    OtherDriver {
        /// The other driver's name.
        driver: String,
        /// Our GPU UUIDs it publishes.
        uuids: Vec<String>,
    },
}

impl Finding {
    /// The Event reason.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Self::DevicePlugin(_) => REASON_DEVICE_PLUGIN,
            Self::OtherDriver { .. } => REASON_OTHER_DRIVER,
        }
    }

    /// The human-readable warning.
    pub(crate) fn message(&self, our_driver: &str) -> String {
        match self {
            Self::DevicePlugin(resources) => format!(
                "the Node advertises NVIDIA device plugin resources ({}) while {our_driver} manages this node's GPUs; a GPU given out by both is used twice. Run the device plugin only on other GPUs (NVIDIA_VISIBLE_DEVICES) or other nodes (node labels), or not at all",
                resources.join(", ")
            ),
            Self::OtherDriver { driver, uuids } => format!(
                "DRA driver {driver} publishes GPUs {} that {our_driver} also publishes; a GPU allocated through both is used twice. Let only one driver manage each GPU",
                uuids.join(", ")
            ),
        }
    }
}

/// NVIDIA device-plugin resources in a Node's capacity or allocatable (non-zero).
pub(crate) fn device_plugin_resources(node: &Node) -> Vec<String> {
    let mut found = BTreeSet::new();
    let Some(status) = &node.status else {
        return Vec::new();
    };
    for map in [&status.capacity, &status.allocatable]
        .into_iter()
        .flatten()
    {
        for (name, q) in map {
            let nvidia = name == "nvidia.com/gpu"
                || name.starts_with("nvidia.com/mig-")
                || name.starts_with("nvidia.com/gpu.");
            if nvidia && q.0 != "0" {
                found.insert(format!("{name}={}", q.0));
            }
        }
    }
    found.into_iter().collect()
}

/// Other drivers' slices (on this node) that carry one of `uuids` in a `uuid` attribute.
pub(crate) fn other_drivers(
    slices: &[ResourceSlice],
    our_driver: &str,
    uuids: &[String],
) -> Vec<Finding> {
    let ours: BTreeSet<&str> = uuids.iter().map(String::as_str).collect();
    let mut by_driver: std::collections::BTreeMap<String, BTreeSet<String>> = Default::default();
    for s in slices {
        if s.spec.driver == our_driver {
            continue;
        }
        for d in s.spec.devices.iter().flatten() {
            for (key, attr) in d.attributes.iter().flatten() {
                let name = key.rsplit('/').next().unwrap_or(key);
                if !name.eq_ignore_ascii_case("uuid") {
                    continue;
                }
                if let Some(v) = &attr.string
                    && ours.contains(v.as_str())
                {
                    by_driver
                        .entry(s.spec.driver.clone())
                        .or_default()
                        .insert(v.clone());
                }
            }
        }
    }
    by_driver
        .into_iter()
        .map(|(driver, uuids)| Finding::OtherDriver {
            driver,
            uuids: uuids.into_iter().collect(),
        })
        .collect()
}

/// Looks at the Node (as read at start, else read now) and at the other drivers' slices on
/// this node (waits for the publisher's first list), and returns what shares our GPUs.
pub(crate) async fn check(
    client: &kube::Client,
    node: &StartNode,
    our_driver: &str,
    uuids: &[String],
    mut other_slices: tokio::sync::watch::Receiver<OtherDrivers>,
) -> Vec<Finding> {
    let mut findings = Vec::new();
    let node_name = node.name.as_str();
    let read = match &node.node {
        Some(n) => Ok(n.as_ref().clone()),
        None => {
            let nodes: kube::Api<Node> = kube::Api::all(client.clone());
            nodes.get(node_name).await
        }
    };
    match read {
        Ok(n) => {
            let r = device_plugin_resources(&n);
            if !r.is_empty() {
                findings.push(Finding::DevicePlugin(r));
            }
        }
        Err(e) => warn!(node = node_name, error = %e, "coexistence check: reading the Node"),
    }
    let listed = other_slices
        .wait_for(Option::is_some)
        .await
        .map(|s| s.clone().unwrap_or_default());
    match listed {
        Ok(slices) => findings.extend(other_drivers(&slices, our_driver, uuids)),
        Err(_) => warn!(
            node = node_name,
            "coexistence check: the slice publisher stopped before its first list"
        ),
    }
    findings
}

/// [`check`], then logs each finding and posts it as a Warning Event on the Node.
pub(crate) async fn check_and_report(
    client: kube::Client,
    start_node: StartNode,
    our_driver: String,
    uuids: Vec<String>,
    other_slices: tokio::sync::watch::Receiver<OtherDrivers>,
    events: EventReporter,
) {
    let findings = check(&client, &start_node, &our_driver, &uuids, other_slices).await;
    if findings.is_empty() {
        info!("no other manager of this node's GPUs found");
        return;
    }
    let node = start_node.reference(&client).await;
    for f in findings {
        let message = f.message(&our_driver);
        warn!(reason = f.reason(), "{message}");
        events
            .publish(&node, Severity::Warning, f.reason(), "Start", &message)
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, ResourceSliceSpec};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    #[test]
    fn device_plugin_resources_are_found_in_capacity() {
        let mut node = Node::default();
        assert!(device_plugin_resources(&node).is_empty());
        let status = node.status.get_or_insert_with(Default::default);
        status.capacity = Some(
            [
                ("cpu".to_owned(), Quantity("8".into())),
                ("nvidia.com/gpu".to_owned(), Quantity("8".into())),
                ("nvidia.com/mig-1g.10gb".to_owned(), Quantity("0".into())),
            ]
            .into(),
        );
        assert_eq!(device_plugin_resources(&node), ["nvidia.com/gpu=8"]);
    }

    fn slice(driver: &str, uuid_key: &str, uuid: &str) -> ResourceSlice {
        ResourceSlice {
            metadata: Default::default(),
            spec: ResourceSliceSpec {
                driver: driver.into(),
                devices: Some(vec![Device {
                    name: "d0".into(),
                    attributes: Some(
                        [(
                            uuid_key.to_owned(),
                            DeviceAttribute {
                                string: Some(uuid.into()),
                                ..Default::default()
                            },
                        )]
                        .into(),
                    ),
                    ..Default::default()
                }]),
                ..Default::default()
            },
        }
    }

    #[test]
    fn other_drivers_with_our_uuids_are_found() {
        let ours = vec!["GPU-a".to_owned(), "GPU-b".to_owned()];
        let slices = [
            slice("gpu.cleave.dev", "uuid", "GPU-a"),
            slice("gpu.nvidia.com", "uuid", "GPU-b"),
            slice("other.example.com", "example.com/uuid", "GPU-zzz"),
        ];
        let f = other_drivers(&slices, "gpu.cleave.dev", &ours);
        assert_eq!(
            f,
            [Finding::OtherDriver {
                driver: "gpu.nvidia.com".into(),
                uuids: vec!["GPU-b".into()],
            }]
        );
        assert!(f[0].message("gpu.cleave.dev").contains("GPU-b"));
    }
}
