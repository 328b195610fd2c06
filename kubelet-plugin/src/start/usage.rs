//! Usage sampling's ties to the API server: the pod watch answers which pods consume a
//! claim and their labels, and idle and oversized notices become Events. Node-local
//! sampling (`crate::node::usage`) defines what it needs as traits; they are met here, so
//! that it never imports the API server side. [`start_usage`] starts the sampling thread.

use std::sync::Arc;

use cleave_driver::backend::GpuBackend;
use cleave_driver::prepare::NodeDriver;
use cleave_driver::usage::{ClaimDevice, ClaimRef};
use k8s_openapi::api::core::v1::ObjectReference;

use tracing::{info, warn};

use crate::args::RunArgs;
use crate::k8s::events::{EventReporter, Severity};
use crate::k8s::node_pods::{NodePods, fill_pods, metric_label_name};
use crate::metrics::Metrics;
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

/// What a claim Event is about and says: the claim and the note.
trait ClaimNotice: Send + 'static {
    fn parts(&self) -> (&ClaimRef, &str);
}

impl ClaimNotice for IdleNotice {
    fn parts(&self) -> (&ClaimRef, &str) {
        (&self.claim, &self.note)
    }
}

impl ClaimNotice for OversizedNotice {
    fn parts(&self) -> (&ClaimRef, &str) {
        (&self.claim, &self.note)
    }
}

/// Posts an Event (`severity`, `reason`, `action`) about each notice's claim until the
/// monitor stops: Warning `ClaimIdle` and Normal `ClaimOversized`.
fn spawn_claim_events<N: ClaimNotice>(
    events: EventReporter,
    mut notices: tokio::sync::mpsc::UnboundedReceiver<N>,
    severity: Severity,
    reason: &'static str,
    action: &'static str,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(n) = notices.recv().await {
            let (claim, note) = n.parts();
            events
                .publish(&claim_reference(claim), severity, reason, action, note)
                .await;
        }
    })
}

/// Starts per-claim usage sampling over the backend's usage source (the driver's NVML
/// handle) unless `--usage-interval=0`; claims that turn idle get a `ClaimIdle` Event with
/// `--idle-events`. Without `--metrics-addr` the rounds still feed idle detection.
pub(super) fn start_usage(
    args: &RunArgs,
    node_pods: Option<Arc<crate::k8s::node_pods::NodePods>>,
    backend: &dyn GpuBackend,
    driver: &Arc<NodeDriver>,
    metrics: Option<&Arc<Metrics>>,
    events: &EventReporter,
    gate: &cleave_driver::usage::SamplingGate,
) -> Option<crate::node::usage::UsageMonitor> {
    let Some(node_pods) = node_pods else {
        info!("per-claim usage sampling off (--usage-interval=0)");
        return None;
    };
    let Some(source) = backend.usage_source() else {
        warn!("per-claim usage sampling off: the GPU backend has no NVML usage source");
        return None;
    };
    let usage_metrics = metrics.map_or_else(
        || Arc::new(crate::node::usage::metrics::UsageMetrics::default()),
        |m| Arc::clone(&m.usage),
    );
    let idle = args.usage.idle_events.then(|| {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        spawn_claim_events(
            events.clone(),
            rx,
            Severity::Warning,
            REASON_CLAIM_IDLE,
            "Monitor",
        );
        tx
    });
    // This node's pods (`node_pods`): which consume each claim (a share's or MPS claim's
    // `pods`) and their `--claim-pod-labels`.
    let keys = args.usage.claim_pod_labels.0.clone();
    if !keys.is_empty() {
        let source: Arc<dyn crate::node::usage::metrics::PodLabelSource> =
            Arc::clone(&node_pods) as _;
        usage_metrics
            .pod_labels
            .set(keys.clone(), Arc::clone(&source));
        if let Some(m) = metrics {
            m.rightsize.pod_labels.set(keys.clone(), source);
        }
    }
    let inputs: Arc<dyn crate::node::usage::ClaimDevices> = Arc::new(
        crate::node::usage::WithPods::new(Arc::clone(driver) as _, node_pods, !keys.is_empty()),
    );
    match crate::node::usage::UsageMonitor::start(
        crate::node::usage::MonitorConfig {
            interval: args.usage.usage_interval,
            policy: args.usage.idle_policy(),
            pool: args.node_name.clone(),
            rightsize: Some(
                args.usage
                    .rightsize_config(cleave_driver::rightsize::NodeModes {
                        dynamic_mig: args.driver.dynamic_mig,
                        consumable_capacity: args.driver.consumable_capacity,
                    }),
            ),
            rightsize_state: Some(
                driver
                    .config()
                    .state_dir
                    .join(cleave_driver::rightsize::STATE_FILE),
            ),
            oversized: args.usage.rightsize_events.then(|| {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                spawn_claim_events(
                    events.clone(),
                    rx,
                    Severity::Normal,
                    REASON_CLAIM_OVERSIZED,
                    "Recommend",
                );
                tx
            }),
            rightsize_metrics: metrics.map(|m| Arc::clone(&m.rightsize)),
            gate: Some(gate.clone()),
            proc_root: args.usage.proc_root.clone(),
        },
        source,
        inputs,
        usage_metrics,
        idle,
    ) {
        Ok(m) => Some(m),
        Err(e) => {
            warn!(error = %e, "per-claim usage sampling not running: cannot start its thread");
            None
        }
    }
}
