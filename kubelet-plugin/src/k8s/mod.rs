//! Talking to the Kubernetes API server: the claim handler the DRA service calls (claims
//! read from the API server, the driver's prepare under the node lock), Events, claims'
//! `status.devices`, the MPS daemon pods, and the other GPU managers seen on the node.

pub(crate) mod claim_status;
pub(crate) mod coexistence;
pub(crate) mod events;
pub(crate) mod kube_handler;
pub(crate) mod mps_pod;
pub(crate) mod node_pods;
