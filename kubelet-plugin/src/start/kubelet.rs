//! The kubelet side of start: the claim status writer, the claim handler over the driver,
//! and the DRA, registration and health gRPC servers.

use std::sync::Arc;

use cleave_driver::prepare::NodeDriver;
use cleave_driver::usage::SamplingGate;

use super::{StartError, StartInputs};
use crate::k8s::claim_status::ClaimStatusWriter;
use crate::k8s::events::EventReporter;
use crate::k8s::kube_handler::KubeClaimHandler;
use crate::kubelet::server::PluginServer;
use crate::node::device_health::DeviceHealth;
use crate::node::node_lock::NodeLock;

/// The started servers and the claim status writer (flushed at shutdown).
pub(super) struct Servers {
    pub(super) server: PluginServer,
    pub(super) status_writer: Option<ClaimStatusWriter>,
}

/// Starts the claim status writer (`--claim-device-status`), the claim handler and the
/// gRPC servers; registration with the kubelet follows from the servers.
pub(super) async fn start_servers(
    inputs: &StartInputs<'_>,
    driver: &Arc<NodeDriver>,
    node_lock: &NodeLock,
    health: Option<Arc<DeviceHealth>>,
    events: EventReporter,
    gate: &SamplingGate,
) -> Result<Servers, StartError> {
    let (args, plugin, metrics) = (inputs.args, inputs.plugin, inputs.metrics);
    let status_writer = args.claim_info.claim_device_status.then(|| {
        ClaimStatusWriter::start(
            inputs.client.clone(),
            crate::k8s::claim_status::WriterConfig {
                driver_name: plugin.driver_name.clone(),
                pool_name: args.node_name.clone(),
            },
            health.clone(),
            metrics
                .cloned()
                .map(|m| m as Arc<dyn crate::k8s::claim_status::StatusObserver>),
        )
    });
    let handler = Arc::new(
        KubeClaimHandler::new(inputs.client.clone(), Arc::clone(driver), node_lock.clone())
            .with_status(status_writer.clone())
            .with_health(health.clone(), &plugin.driver_name)
            .with_events(events)
            .with_metrics(
                metrics
                    .cloned()
                    .map(|m| m as Arc<dyn crate::k8s::kube_handler::PrepareObserver>),
            )
            .with_sampling_gate(gate.clone()),
    );
    let observer = metrics
        .cloned()
        .map(|m| m as Arc<dyn crate::kubelet::dra::DraObserver>);
    let server = PluginServer::start_with_health(plugin, handler, observer, health)
        .await
        .map_err(StartError::Servers)?;
    Ok(Servers {
        server,
        status_writer,
    })
}
