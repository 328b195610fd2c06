//! Metrics beside the DRA call counters of the parent module: call latency by result,
//! Kubernetes API requests of the slice publisher by verb and result, and published
//! devices by type, MIG instances created and destroyed, and MPS daemons of prepared claims.
//! Registered into the plugin's registry by [`super::Metrics::new`].

use std::time::Duration;

use cleave_api::names::DeviceName;
use cleave_api::pool::PoolDevices;
use cleave_controller::ApiObserver;
use cleave_driver::prepare::CheckpointSummary;
use cleave_driver::timing::step;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of `operation_duration_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OperationResultLabels {
    /// `prepare` or `unprepare`.
    pub operation: &'static str,
    /// `ok` when every claim of the call succeeded, else `error`.
    pub result: &'static str,
}

/// Labels of `api_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ApiLabels {
    /// `get`, `list`, `watch`, `create`, `update`, `delete`, ...
    pub verb: &'static str,
    /// `ok`, `conflict`, `not_found` or `error`.
    pub result: &'static str,
}

/// Labels of `devices_published`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DeviceType {
    /// `gpu` or `mig`.
    pub r#type: &'static str,
}

fn histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// The metrics of this module.
#[derive(Debug, Clone)]
pub(crate) struct ObservabilityMetrics {
    durations: Family<OperationResultLabels, Histogram, fn() -> Histogram>,
    api: Family<ApiLabels, Counter>,
    published: Family<DeviceType, Gauge>,
    steps: Family<StepLabels, Histogram, fn() -> Histogram>,
    mig_created: Counter,
    mig_destroyed: Counter,
    mps_daemons: Gauge,
    admin_access_devices: Gauge,
    refusals: Family<RefusalLabels, Counter>,
}

/// Labels of `prepare_refusals`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RefusalLabels {
    /// [`cleave_driver::prepare::Refusal::label`]: `over_commit` (the allocation exceeds
    /// its device: an old or buggy scheduler, or a mode changed under prepared claims),
    /// `claim`, `allocation`, `config`, `driver_files`, `driver_root`, `mig`, `sharing` or
    /// `node`.
    pub reason: &'static str,
}

/// Labels of `driver_step_duration_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StepLabels {
    /// `mig_create`, `mig_destroy`, `cdi_write`, `checkpoint_write` or `sharing_apply`
    /// ([`cleave_driver::timing::step`]).
    pub step: &'static str,
}

impl ObservabilityMetrics {
    /// Creates and registers `operation_duration_seconds`, `api_requests` and
    /// `devices_published`.
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let m = Self {
            durations: Family::new_with_constructor(histogram),
            api: Family::default(),
            published: Family::default(),
            steps: Family::new_with_constructor(histogram),
            mig_created: Counter::default(),
            mig_destroyed: Counter::default(),
            mps_daemons: Gauge::default(),
            admin_access_devices: Gauge::default(),
            refusals: Family::default(),
        };
        registry.register(
            "admin_access_devices",
            "Devices of prepared claims held with admin access (beside other claims, no sharing applied); updated with mps_daemons_running",
            m.admin_access_devices.clone(),
        );
        registry.register(
            "prepare_refusals",
            "Claims whose prepare was refused, by reason: over_commit (the allocation exceeds its device: shares beyond it or summing past it, overlapping MIG placements, a device held by another claim), claim (no usable UID, an unknown device), allocation (none, or none for this node), config (an invalid or unservable config), driver_files (the driver root lacks a device node or library the containers need), driver_root (no driver there at all), mig (creating or recreating a MIG instance), sharing (starting MPS or time-slicing), node (discovery, CDI, checkpoint)",
            m.refusals.clone(),
        );
        registry.register(
            "mig_instances_created",
            "On-demand MIG instances this process created successfully (prepare and recreation)",
            m.mig_created.clone(),
        );
        registry.register(
            "mig_instances_destroyed",
            "MIG instances created by cleave that this process destroyed successfully (unprepare and rollback)",
            m.mig_destroyed.clone(),
        );
        registry.register(
            "mps_daemons_running",
            "MPS control daemons recorded in the checkpoint for prepared claims (updated after start, every prepare/unprepare call and periodically)",
            m.mps_daemons.clone(),
        );
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
    pub(crate) fn observe_call(&self, operation: &'static str, elapsed: Duration, failed: usize) {
        let result = if failed == 0 { "ok" } else { "error" };
        self.durations
            .get_or_create(&OperationResultLabels { operation, result })
            .observe(elapsed.as_secs_f64());
    }

    /// Points the driver's step timing ([`cleave_driver::timing`]) at
    /// `driver_step_duration_seconds` and the MIG counters; the first call in a process wins.
    pub(crate) fn install_driver_observer(&self) -> bool {
        let m = self.clone();
        cleave_driver::timing::set_observer(Box::new(move |step, elapsed| {
            m.observe_step(step, elapsed);
        }))
    }

    /// Records one successful driver step (the driver reports only successful ones): its
    /// duration, and for MIG create/destroy the instance counters.
    pub(crate) fn observe_step(&self, step: &'static str, elapsed: Duration) {
        self.steps
            .get_or_create(&StepLabels { step })
            .observe(elapsed.as_secs_f64());
        match step {
            step::MIG_CREATE => {
                self.mig_created.inc();
            }
            step::MIG_DESTROY => {
                self.mig_destroyed.inc();
            }
            _ => {}
        }
    }

    /// Sets `mps_daemons_running`.
    pub(crate) fn set_mps_daemons(&self, daemons: usize) {
        self.mps_daemons
            .set(i64::try_from(daemons).unwrap_or(i64::MAX));
    }

    /// Sets `mps_daemons_running` and `admin_access_devices` from the driver's summary
    /// of its prepared claims.
    pub(crate) fn set_prepared(&self, summary: &CheckpointSummary) {
        self.set_mps_daemons(summary.mps_daemons());
        self.admin_access_devices
            .set(i64::try_from(summary.admin_access_devices()).unwrap_or(i64::MAX));
    }

    /// Sets the gauges from the checkpoint file as the driver reads it (catching changes
    /// by another instance); on a read error they keep their values and the error is
    /// logged at debug level (start-up and the driver report checkpoint errors themselves).
    pub(crate) fn refresh_from_checkpoint(&self, driver: &cleave_driver::prepare::NodeDriver) {
        match driver.checkpoint_summary() {
            Ok(summary) => self.set_prepared(&summary),
            Err(e) => tracing::debug!(error = %e, "reading the checkpoint for mps_daemons_running"),
        }
    }

    /// Counts a refused prepare under its refusal's label.
    pub(crate) fn count_refusal(&self, refusal: cleave_driver::prepare::Refusal) {
        self.refusals
            .get_or_create(&RefusalLabels {
                reason: refusal.label(),
            })
            .inc();
    }

    /// An observer for [`cleave_controller::PublisherConfig::observer`].
    pub(crate) fn api_observer(&self) -> ApiObserver {
        let api = self.api.clone();
        std::sync::Arc::new(move |verb, result| {
            api.get_or_create(&ApiLabels { verb, result }).inc();
        })
    }

    /// Sets the published-devices gauges from `pool`.
    pub(crate) fn set_published(&self, pool: &PoolDevices) {
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

#[cfg(test)]
mod tests {
    use cleave_driver::checkpoint::{CheckpointStore, ClaimState};
    use cleave_driver::prepare::testing::{checkpoint_claim, checkpoint_data, mps_sharing_state};

    use super::*;

    fn registered() -> (Registry, ObservabilityMetrics) {
        let mut registry = Registry::with_prefix("cleave_kubelet_plugin");
        let m = ObservabilityMetrics::register(&mut registry);
        (registry, m)
    }

    fn encode(registry: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
        out
    }

    #[test]
    fn mig_counters_count_only_mig_steps() {
        let (registry, m) = registered();
        let text = encode(&registry);
        assert!(
            text.contains("cleave_kubelet_plugin_mig_instances_created_total 0"),
            "{text}"
        );
        assert!(
            text.contains("cleave_kubelet_plugin_mig_instances_destroyed_total 0"),
            "{text}"
        );
        let ms = Duration::from_millis(1);
        m.observe_step(step::MIG_CREATE, ms);
        m.observe_step(step::MIG_CREATE, ms);
        m.observe_step(step::MIG_DESTROY, ms);
        m.observe_step(step::CDI_WRITE, ms);
        m.observe_step(step::SHARING_APPLY, ms);
        let text = encode(&registry);
        for line in [
            "cleave_kubelet_plugin_mig_instances_created_total 2",
            "cleave_kubelet_plugin_mig_instances_destroyed_total 1",
            r#"cleave_kubelet_plugin_driver_step_duration_seconds_count{step="mig_create"} 2"#,
            r#"cleave_kubelet_plugin_driver_step_duration_seconds_count{step="cdi_write"} 1"#,
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn prepared_summary_sets_the_gauges() {
        let (registry, m) = registered();
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::in_dir(dir.path());
        let reader = cleave_driver::prepare::CheckpointReader::in_dir(dir.path());
        // No checkpoint yet: an empty one.
        m.set_mps_daemons(5);
        m.set_prepared(&reader.summary().unwrap());
        assert!(encode(&registry).contains("cleave_kubelet_plugin_mps_daemons_running 0"));

        store
            .store(&checkpoint_data(vec![
                checkpoint_claim("a", ClaimState::Prepared, Some(mps_sharing_state("a"))),
                checkpoint_claim("b", ClaimState::Prepared, Some(mps_sharing_state("b"))),
                checkpoint_claim("c", ClaimState::Prepared, None),
            ]))
            .unwrap();
        m.set_prepared(&reader.summary().unwrap());
        assert!(encode(&registry).contains("cleave_kubelet_plugin_mps_daemons_running 2"));

        store
            .store(&checkpoint_data(vec![checkpoint_claim(
                "a",
                ClaimState::Prepared,
                Some(mps_sharing_state("a")),
            )]))
            .unwrap();
        m.set_prepared(&reader.summary().unwrap());
        assert!(encode(&registry).contains("cleave_kubelet_plugin_mps_daemons_running 1"));
    }
}
