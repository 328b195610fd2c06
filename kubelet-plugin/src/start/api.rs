//! The API server side of start: the client, the pool built from what discovery found, the
//! slice publisher, and the Events about GPUs that publish nothing.

use std::collections::BTreeMap;
use std::path::Path;

use cleave_api::pool::PoolDevices;
use cleave_controller::{PublisherConfig, SlicePublisher};
use cleave_driver::model::{BareGpuInstance, NodeInventory};
use cleave_driver::pool::{PoolOptions, build_pool};
use cleave_driver::prepare::NodeDriver;
use tracing::{info, warn};

use super::{StartError, StartInputs};
use crate::k8s::events::{EventReporter, Severity, StartNode};

/// Builds a Kubernetes client from a kubeconfig file, or the in-cluster / default
/// configuration when none is given.
pub(crate) async fn kube_client(kubeconfig: Option<&Path>) -> Result<kube::Client, StartError> {
    let config = match kubeconfig {
        Some(path) => {
            let bad = |source| StartError::Kubeconfig {
                path: path.to_path_buf(),
                source,
            };
            let file = kube::config::Kubeconfig::read_from(path).map_err(bad)?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(bad)?
        }
        None => kube::Config::infer()
            .await
            .map_err(StartError::NoClusterConfig)?,
    };
    kube::Client::try_from(config).map_err(StartError::Client)
}

/// Event reason: MIG-enabled GPUs without instances publish nothing (on-demand MIG off).
pub(crate) const REASON_MIG_WITHOUT_INSTANCES: &str = "MIGEnabledWithoutInstances";

/// Event reason: MIG-enabled GPUs whose MIG profiles NVML does not answer.
pub(crate) const REASON_MIG_PROFILES_UNREADABLE: &str = "MIGProfilesUnreadable";

/// Warns, in the log and with a Warning Event on the Node, about GPUs that publish no
/// device at all, naming them and what to do; an empty pool must never be silent.
async fn report_silent_gpus(
    client: &kube::Client,
    events: &EventReporter,
    start_node: &StartNode,
    inventory: &cleave_driver::model::NodeInventory,
    dynamic_mig: bool,
    driver: &NodeDriver,
) {
    use cleave_driver::pool::{SilentReason, silent_gpus};
    let silent = silent_gpus(
        inventory,
        &PoolOptions {
            dynamic_mig,
            owned_instances: driver.owned_mig_uuids(),
            ..PoolOptions::default()
        },
    );
    for (reason, event_reason) in [
        (
            SilentReason::MigWithoutInstances,
            REASON_MIG_WITHOUT_INSTANCES,
        ),
        (
            SilentReason::MigWithoutProfiles,
            REASON_MIG_PROFILES_UNREADABLE,
        ),
    ] {
        let gpus: Vec<String> = silent
            .iter()
            .filter(|s| s.reason == reason)
            .map(|s| format!("{} ({})", s.name, s.uuid))
            .collect();
        if gpus.is_empty() {
            continue;
        }
        let note = format!(
            "{} GPU(s) publish no device: {}. {reason}",
            gpus.len(),
            gpus.join(", ")
        );
        warn!(gpus = %gpus.join(", "), "{note}");
        let node = start_node.reference(client).await;
        events
            .publish(&node, Severity::Warning, event_reason, "Publish", &note)
            .await;
    }
}

/// What discovery found: the inventory, the GPU instances left without compute instance,
/// and the pool built from them.
pub(super) struct Discovered {
    pub(super) inventory: NodeInventory,
    pub(super) bare_gpu_instances: BTreeMap<String, Vec<BareGpuInstance>>,
    pub(super) pool: PoolDevices,
}

impl Discovered {
    /// Builds the pool as the flags say, logs it and sets the published and prepared gauges.
    pub(super) fn new(inputs: &StartInputs<'_>, driver: &NodeDriver) -> Self {
        let args = inputs.args;
        let inventory = driver.inventory();
        let bare_gpu_instances = driver.bare_gpu_instances();
        let pool = build_pool(
            &inventory,
            &PoolOptions {
                dynamic_mig: args.driver.dynamic_mig,
                owned_instances: driver.owned_mig_uuids(),
                bare_gpu_instances: bare_gpu_instances.clone(),
                consumable_capacity: args.driver.consumable_capacity,
                share_on_demand_mig: args.driver.share_on_demand_mig,
            },
        );
        info!(
            gpus = inventory.gpus.len(),
            devices = pool.device_count(),
            dynamic_mig = args.driver.dynamic_mig,
            "discovered devices"
        );
        if let Some(m) = inputs.metrics {
            m.observability.set_published(&pool);
            m.observability.set_prepared(&driver.prepared_summary());
        }
        Self {
            inventory,
            bare_gpu_instances,
            pool,
        }
    }
}

/// The started slice publisher and what start-up left to publish.
pub(super) struct Published {
    pub(super) publisher: SlicePublisher,
    /// Why devices are not published yet (the driver root holds no driver).
    pub(super) driver_wait: Option<String>,
    /// The pool to publish once the driver's files are there.
    pub(super) pending_pool: Option<PoolDevices>,
    pub(super) bare_gpu_instances: BTreeMap<String, Vec<BareGpuInstance>>,
    /// Events about the Node and its claims.
    pub(super) events: EventReporter,
}

/// Starts the slice publisher and publishes the pool, unless NVML sees GPUs but the driver
/// root holds no driver: then nothing is offered (every claim would fail) and prepares are
/// served anyway so that they fail naming the files. Then warns about silent GPUs.
pub(super) async fn publish(
    inputs: &StartInputs<'_>,
    driver: &NodeDriver,
    found: Discovered,
) -> Published {
    let args = inputs.args;
    let mut publisher_config =
        PublisherConfig::new(inputs.plugin.driver_name.clone(), args.node_name.clone());
    // The UID as read at start; the publisher reads the Node itself only without one.
    publisher_config.node_uid = inputs.node.uid();
    publisher_config.counter_probe_interval =
        std::time::Duration::from_secs(args.lifecycle.counter_probe_interval_secs.max(1));
    if let Some(m) = inputs.metrics {
        publisher_config.observer = Some(m.observability.api_observer());
    }
    let publisher = SlicePublisher::start(inputs.client.clone(), publisher_config);
    let driver_wait = driver.missing_driver().map(|e| e.to_string());
    let pending_pool = match &driver_wait {
        Some(reason) => {
            warn!(reason = %reason, "not publishing devices until the driver root holds the NVIDIA driver; claims are refused meanwhile");
            Some(found.pool)
        }
        None => {
            publisher.publish(found.pool);
            None
        }
    };
    let events = EventReporter::new(inputs.client.clone(), args.node_name.clone());
    report_silent_gpus(
        inputs.client,
        &events,
        inputs.node,
        &found.inventory,
        args.driver.dynamic_mig,
        driver,
    )
    .await;
    Published {
        publisher,
        driver_wait,
        pending_pool,
        bare_gpu_instances: found.bare_gpu_instances,
        events,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_unreadable_kubeconfig_is_a_typed_start_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        let Err(e) = kube_client(Some(&path)).await else {
            panic!("a missing kubeconfig built a client");
        };
        assert!(
            matches!(&e, StartError::Kubeconfig { path: p, .. } if *p == path),
            "{e:?}"
        );
        assert!(!e.is_retried());
        assert!(e.to_string().contains("--kubeconfig"), "{e}");
        std::fs::write(&path, "not: [a kubeconfig").unwrap();
        let Err(e) = kube_client(Some(&path)).await else {
            panic!("a broken kubeconfig built a client");
        };
        assert!(matches!(&e, StartError::Kubeconfig { .. }), "{e:?}");
    }
}
