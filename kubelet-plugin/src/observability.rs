//! Metrics beside the DRA call counters of [`crate::metrics`]: call latency by result,
//! Kubernetes API requests of the slice publisher by verb and result, and published
//! devices by type. Registered into the plugin's registry by [`crate::metrics::Metrics::new`].

use std::time::Duration;

use cleave_api::names::DeviceName;
use cleave_api::pool::PoolDevices;
use cleave_controller::ApiObserver;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of `operation_duration_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationResultLabels {
    /// `prepare` or `unprepare`.
    pub operation: &'static str,
    /// `ok` when every claim of the call succeeded, else `error`.
    pub result: &'static str,
}

/// Labels of `api_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabels {
    /// `get`, `list`, `watch`, `create`, `update`, `delete`, ...
    pub verb: &'static str,
    /// `ok`, `conflict`, `not_found` or `error`.
    pub result: &'static str,
}

/// Labels of `devices_published`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeviceType {
    /// `gpu` or `mig`.
    pub r#type: &'static str,
}

fn histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// The metrics of this module.
#[derive(Debug, Clone)]
pub struct ObservabilityMetrics {
    durations: Family<OperationResultLabels, Histogram, fn() -> Histogram>,
    api: Family<ApiLabels, Counter>,
    published: Family<DeviceType, Gauge>,
    steps: Family<StepLabels, Histogram, fn() -> Histogram>,
}

/// Labels of `driver_step_duration_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabels {
    /// `mig_create`, `mig_destroy`, `cdi_write`, `checkpoint_write` or `sharing_apply`
    /// ([`cleave_driver::timing::step`]).
    pub step: &'static str,
}

impl ObservabilityMetrics {
    /// Creates and registers `operation_duration_seconds`, `api_requests` and
    /// `devices_published`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            durations: Family::new_with_constructor(histogram),
            api: Family::default(),
            published: Family::default(),
            steps: Family::new_with_constructor(histogram),
        };
        registry.register(
            "driver_step_duration_seconds",
            "Duration of successful driver steps: MIG instances created (mig_create) and destroyed (mig_destroy), CDI and checkpoint writes, sharing setup",
            m.steps.clone(),
        );
        registry.register(
            "operation_duration_seconds",
            "Duration of NodePrepareResources / NodeUnprepareResources calls by result",
            m.durations.clone(),
        );
        registry.register(
            "api_requests",
            "Kubernetes API requests of the ResourceSlice publisher by verb and result",
            m.api.clone(),
        );
        registry.register(
            "devices_published",
            "Devices in the published pool by type (unhealthy devices removed with --device-taints=off are not counted)",
            m.published.clone(),
        );
        m
    }

    /// Records one DRA call.
    pub fn observe_call(&self, operation: &'static str, elapsed: Duration, failed: usize) {
        let result = if failed == 0 { "ok" } else { "error" };
        self.durations
            .get_or_create(&OperationResultLabels { operation, result })
            .observe(elapsed.as_secs_f64());
    }

    /// Points the driver's step timing ([`cleave_driver::timing`]) at
    /// `driver_step_duration_seconds`; the first call in a process wins.
    pub fn install_driver_observer(&self) -> bool {
        let steps = self.steps.clone();
        cleave_driver::timing::set_observer(Box::new(move |step, elapsed| {
            steps
                .get_or_create(&StepLabels { step })
                .observe(elapsed.as_secs_f64());
        }))
    }

    /// An observer for [`cleave_controller::PublisherConfig::observer`].
    pub fn api_observer(&self) -> ApiObserver {
        let api = self.api.clone();
        std::sync::Arc::new(move |verb, result| {
            api.get_or_create(&ApiLabels { verb, result }).inc();
        })
    }

    /// Sets the published-devices gauges from `pool`.
    pub fn set_published(&self, pool: &PoolDevices) {
        let (mut gpu, mut mig) = (0i64, 0i64);
        for d in pool.devices() {
            match d.name.parse::<DeviceName>() {
                Ok(n) if n.is_mig() => mig += 1,
                _ => gpu += 1,
            }
        }
        self.published
            .get_or_create(&DeviceType { r#type: "gpu" })
            .set(gpu);
        self.published
            .get_or_create(&DeviceType { r#type: "mig" })
            .set(mig);
    }
}
