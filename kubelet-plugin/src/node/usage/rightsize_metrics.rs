//! Right-sizing series (`cleave_kubelet_plugin_claim_recommended_*`,
//! `claim_recommendation_info`, `claim_window_*`, `node_gpus_*`; exactly
//! `cleave_driver::rightsize::RIGHTSIZE_METRIC_NAMES`), labelled as the usage series are.
//!
//! The usage monitor writes them after each round with [`RightsizeMetrics::apply`]; series
//! of claim devices no longer prepared are removed.

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::metrics::ClaimDeviceLabels;
use crate::node::usage::recommend::RightsizeOutcome;

type FloatGauge = Gauge<f64, AtomicU64>;

/// [`ClaimDeviceLabels`] and the recommendation as labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RecommendationLabels {
    /// The claim device.
    #[prometheus(flatten)]
    pub device: ClaimDeviceLabels,
    /// `mig`, `share`, `gpu`, `release`, `not_attributable` or `pending`.
    pub recommendation: &'static str,
    /// The recommended MIG profile; empty otherwise.
    pub profile: String,
    /// `smaller`, `same`, `larger`, `release` or `unknown`.
    pub change: &'static str,
    /// `false` when no shape that holds the claim is served by this node.
    pub served: &'static str,
}

/// [`ClaimDeviceLabels`] and the activity source.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct WindowActivityLabels {
    /// The claim device.
    #[prometheus(flatten)]
    pub device: ClaimDeviceLabels,
    /// Sources of the window's figures, `+`-joined (`gpm_sm_activity`).
    pub source: String,
}

/// Labels of the per-node series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct NodeLabels {
    /// Pool (the node name).
    pub pool: String,
}

/// Labels of a "merge into fewer GPUs" series: the shares' GPUs now, by published name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct MergeLabels {
    /// Pool (the node name).
    pub pool: String,
    /// The GPU product.
    pub product: String,
    /// The GPUs the shares are on now, comma-separated (at most the node's GPUs).
    pub gpus: String,
}

#[derive(Debug, Default)]
struct Written {
    devices: HashSet<ClaimDeviceLabels>,
    memory: HashSet<ClaimDeviceLabels>,
    sms: HashSet<ClaimDeviceLabels>,
    info: HashSet<RecommendationLabels>,
    peak: HashSet<ClaimDeviceLabels>,
    p95_memory: HashSet<ClaimDeviceLabels>,
    activity: HashSet<WindowActivityLabels>,
    idle: HashSet<ClaimDeviceLabels>,
    merges: HashSet<MergeLabels>,
}

/// The right-sizing series.
#[derive(Debug, Default)]
pub struct RightsizeMetrics {
    recommended_memory: Family<ClaimDeviceLabels, Gauge>,
    recommended_sms: Family<ClaimDeviceLabels, Gauge>,
    info: Family<RecommendationLabels, Gauge>,
    peak_memory: Family<ClaimDeviceLabels, Gauge>,
    p95_memory: Family<ClaimDeviceLabels, Gauge>,
    p95_activity: Family<WindowActivityLabels, FloatGauge>,
    mean_activity: Family<WindowActivityLabels, FloatGauge>,
    idle_ratio: Family<ClaimDeviceLabels, FloatGauge>,
    samples: Family<ClaimDeviceLabels, Gauge>,
    gpus_held: Family<NodeLabels, Gauge>,
    gpus_recommended: Family<NodeLabels, Gauge>,
    share_merges: Family<MergeLabels, Gauge>,
    written: Mutex<Written>,
    /// Claims are labelled by UID only (`--metrics-claim-labels=uid-only`).
    uid_only: std::sync::atomic::AtomicBool,
    /// `label_<key>` labels of the claim series (`--claim-pod-labels`).
    pub(crate) pod_labels: std::sync::Arc<super::metrics::ClaimPodLabels>,
}

fn i64_of(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn retire<S, M, C>(family: &Family<S, M, C>, before: &HashSet<S>, now: &HashSet<S>)
where
    S: Clone + std::hash::Hash + Eq,
    C: prometheus_client::metrics::family::MetricConstructor<M>,
{
    for gone in before.difference(now) {
        family.remove(gone);
    }
}

impl RightsizeMetrics {
    /// Creates the series and registers them in `registry` (prefix `cleave_kubelet_plugin`).
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "claim_recommended_memory_bytes",
            "Memory of the shape recommended for the claim device (0: release); absent while pending or not attributable",
            m.recommended_memory.clone(),
        );
        registry.register(
            "claim_recommended_multiprocessors",
            "SMs of the shape recommended for the claim device (0: release); absent while pending or not attributable",
            m.recommended_sms.clone(),
        );
        registry.register(
            "claim_recommendation_info",
            "The recommendation for the claim device as labels (always 1)",
            m.info.clone(),
        );
        registry.register(
            "claim_window_peak_memory_bytes",
            "Highest memory used by the claim device over --rightsize-window",
            m.peak_memory.clone(),
        );
        registry.register(
            "claim_window_p95_memory_bytes",
            "95th percentile of memory used over --rightsize-window (histogram estimate, at most 2 % high)",
            m.p95_memory.clone(),
        );
        registry.register(
            "claim_window_p95_activity_percent",
            "95th percentile of SM activity over --rightsize-window (histogram estimate, less than 1 point high)",
            m.p95_activity.clone(),
        );
        registry.register(
            "claim_window_mean_activity_percent",
            "Mean SM activity over --rightsize-window",
            m.mean_activity.clone(),
        );
        registry.register(
            "claim_window_idle_ratio",
            "Fraction of the window's samples with SM activity below --idle-threshold",
            m.idle_ratio.clone(),
        );
        registry.register(
            "claim_window_samples",
            "Sampling rounds in the claim device's window",
            m.samples.clone(),
        );
        registry.register(
            "node_gpus_held",
            "GPUs the node's prepared claims hold",
            m.gpus_held.clone(),
        );
        registry.register(
            "node_gpus_recommended",
            "GPUs the node's claims would need in their recommended shapes, packed first fit",
            m.gpus_recommended.clone(),
        );
        registry.register(
            "node_share_merge_gpus",
            "GPUs the right-sized capacity shares and MPS claims now on the GPUs of label gpus would fit on, packed first fit (only where fewer)",
            m.share_merges.clone(),
        );
        m
    }

    /// Labels claims by UID only from now on (`--metrics-claim-labels=uid-only`).
    pub(crate) fn set_uid_only(&self, uid_only: bool) {
        self.uid_only
            .store(uid_only, std::sync::atomic::Ordering::Relaxed);
    }

    /// Writes one round's recommendations; removes the series of claim devices not in it.
    pub fn apply(&self, pool: &str, outcome: &RightsizeOutcome) {
        let mut next = Written::default();
        let uid_only = self.uid_only.load(std::sync::atomic::Ordering::Relaxed);
        for e in &outcome.entries {
            let labels = super::metrics::ClaimDeviceLabels::of(pool, &e.device, uid_only)
                .with_pod(self.pod_labels.of(&e.device.claim));
            let st = &e.stats;
            let rec = &e.recommendation;
            let shape = rec.advice.shape();
            let release = rec.advice == cleave_driver::rightsize::Advice::Release;
            if shape.is_some() || release {
                let mem = shape.map_or(0, |s| s.memory_bytes());
                self.recommended_memory
                    .get_or_create(&labels)
                    .set(i64_of(mem));
                next.memory.insert(labels.clone());
                if let Some(sms) = shape.map_or(Some(0), |s| s.sms()) {
                    self.recommended_sms
                        .get_or_create(&labels)
                        .set(i64::from(sms));
                    next.sms.insert(labels.clone());
                }
            }
            let info = RecommendationLabels {
                device: labels.clone(),
                recommendation: rec.advice.kind(),
                profile: shape
                    .and_then(|s| s.profile())
                    .unwrap_or_default()
                    .to_owned(),
                change: rec.change.as_str(),
                served: if rec.served { "true" } else { "false" },
            };
            self.info.get_or_create(&info).set(1);
            next.info.insert(info);
            if let Some(p) = st.peak_memory {
                self.peak_memory.get_or_create(&labels).set(i64_of(p));
                next.peak.insert(labels.clone());
            }
            if let Some(p) = st.p95_memory {
                self.p95_memory.get_or_create(&labels).set(i64_of(p));
                next.p95_memory.insert(labels.clone());
            }
            if let (Some(p95), Some(mean)) = (st.p95_activity, st.mean_activity) {
                let l = WindowActivityLabels {
                    device: labels.clone(),
                    source: st
                        .sources
                        .iter()
                        .filter(|s| **s != cleave_driver::usage::ActivitySource::GpmSmOccupancy)
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join("+"),
                };
                self.p95_activity.get_or_create(&l).set(p95);
                self.mean_activity.get_or_create(&l).set(mean);
                next.activity.insert(l);
            }
            if let Some(idle) = st.idle_fraction {
                self.idle_ratio.get_or_create(&labels).set(idle);
                next.idle.insert(labels.clone());
            }
            self.samples.get_or_create(&labels).set(i64_of(st.samples));
            next.devices.insert(labels);
        }
        let node = NodeLabels {
            pool: pool.to_owned(),
        };
        self.gpus_held
            .get_or_create(&node)
            .set(i64_of(outcome.savings.held as u64));
        self.gpus_recommended
            .get_or_create(&node)
            .set(i64_of(outcome.savings.needed as u64));
        for merge in &outcome.merges {
            let l = MergeLabels {
                pool: pool.to_owned(),
                product: merge.product.clone(),
                gpus: merge.gpus.join(","),
            };
            self.share_merges
                .get_or_create(&l)
                .set(i64_of(merge.needed as u64));
            next.merges.insert(l);
        }
        let mut w = self
            .written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        retire(&self.recommended_memory, &w.memory, &next.memory);
        retire(&self.recommended_sms, &w.sms, &next.sms);
        retire(&self.info, &w.info, &next.info);
        retire(&self.peak_memory, &w.peak, &next.peak);
        retire(&self.p95_memory, &w.p95_memory, &next.p95_memory);
        retire(&self.p95_activity, &w.activity, &next.activity);
        retire(&self.mean_activity, &w.activity, &next.activity);
        retire(&self.idle_ratio, &w.idle, &next.idle);
        retire(&self.samples, &w.devices, &next.devices);
        retire(&self.share_merges, &w.merges, &next.merges);
        *w = next;
    }
}
