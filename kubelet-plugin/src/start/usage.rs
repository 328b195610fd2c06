//! Usage sampling's ties to the API server: the pod watch answers which pods consume a
//! claim and their labels, and idle and oversized notices become Events. Node-local
//! sampling (`crate::node::usage`) defines what it needs as traits; they are met here, so
//! that it never imports the API server side.

use cleave_driver::usage::{ClaimDevice, ClaimRef};
use k8s_openapi::api::core::v1::ObjectReference;

use crate::k8s::events::{EventReporter, Severity};
use crate::k8s::node_pods::{NodePods, fill_pods, metric_label_name};
use crate::node::usage::metrics::PodLabelSource;
use crate::node::usage::recommend::{OversizedNotice, REASON_CLAIM_OVERSIZED};
use crate::node::usage::round::IdleNotice;
use crate::node::usage::{ClaimConsumers, REASON_CLAIM_IDLE};

impl ClaimConsumers for NodePods {
    fn fill_pods(&self, devices: &mut [ClaimDevice]) {
        fill_pods(devices, &self.index());
    }
}

impl PodLabelSource for NodePods {
    fn values(&self, namespace: &str, name: &str, keys: &[String]) -> Vec<String> {
        self.index().label_values(namespace, name, keys)
    }
    fn label_name(&self, key: &str) -> String {
        metric_label_name(key)
    }
}

/// The ResourceClaim a notice is about, as an Event's `regarding`.
fn claim_reference(claim: &ClaimRef) -> ObjectReference {
    ObjectReference {
        api_version: Some("resource.k8s.io/v1".into()),
        kind: Some("ResourceClaim".into()),
        namespace: Some(claim.namespace.clone()),
        name: Some(claim.name.clone()),
        uid: Some(claim.uid.clone()),
        ..Default::default()
    }
}

/// Posts a Warning `ClaimIdle` Event for every notice until the monitor stops.
pub(crate) fn spawn_idle_events(
    events: EventReporter,
    mut notices: tokio::sync::mpsc::UnboundedReceiver<IdleNotice>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(n) = notices.recv().await {
            events
                .publish(
                    &claim_reference(&n.claim),
                    Severity::Warning,
                    REASON_CLAIM_IDLE,
                    "Monitor",
                    &n.note,
                )
                .await;
        }
    })
}

/// Posts a Normal `ClaimOversized` Event for every notice until the monitor stops.
pub(crate) fn spawn_oversized_events(
    events: EventReporter,
    mut notices: tokio::sync::mpsc::UnboundedReceiver<OversizedNotice>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(n) = notices.recv().await {
            events
                .publish(
                    &claim_reference(&n.claim),
                    Severity::Normal,
                    REASON_CLAIM_OVERSIZED,
                    "Recommend",
                    &n.note,
                )
                .await;
        }
    })
}
