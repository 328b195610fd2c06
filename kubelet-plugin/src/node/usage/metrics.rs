//! Per-claim usage series (`cleave_kubelet_plugin_claim_*`, `gpu_*`,
//! `usage_sample_duration_seconds`; exactly `cleave_driver::usage::USAGE_METRIC_NAMES`).
//!
//! The usage monitor ([`crate::node::usage`]) writes them after each sampling round with
//! [`UsageMetrics::apply_round`]; a scrape only encodes what the last round left, so it never
//! calls NVML. Series of claims no longer in the round (unprepared) are removed, so the
//! number of series follows the prepared claims.

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::SystemTime;

use cleave_api::config::sharing_label;
use cleave_driver::usage::Activity;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// A gauge of a float.
type FloatGauge = Gauge<f64, AtomicU64>;

/// Labels of every `claim_*` series of one claim device.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ClaimDeviceLabels {
    /// Claim namespace.
    pub namespace: String,
    /// Claim name.
    pub claim: String,
    /// Published device name.
    pub device: String,
    /// UUID of the (parent) GPU.
    pub gpu: String,
    /// `gpu`, `mig`, `mps` or `share`.
    pub kind: &'static str,
    /// `exclusive`, `time-slicing` or `mps`.
    pub sharing: &'static str,
    /// Pool (the node name).
    pub pool: String,
    /// `shareID` of a capacity share; empty otherwise.
    pub share: String,
    /// `label_<key>` per `--claim-pod-labels` key: the consuming pods' label (see
    /// [`ClaimPodLabels`]); none without the flag.
    #[prometheus(flatten)]
    pub pod: Vec<(String, String)>,
}

/// Where the `label_<key>` values of a claim come from (the node's pod index).
pub(crate) trait PodLabelSource: Send + Sync {
    /// The values of `keys` for the claim `name` in `namespace`, in order ("" when unknown).
    fn values(&self, namespace: &str, name: &str, keys: &[String]) -> Vec<String>;
    /// The metric label name of the pod label `key` (`label_<key>`, sanitised).
    fn label_name(&self, key: &str) -> String;
}

/// The `--claim-pod-labels` keys and the source of their values.
type KeysAndSource = (Vec<String>, std::sync::Arc<dyn PodLabelSource>);

/// The `--claim-pod-labels` keys and where their values come from; empty: no extra labels.
#[derive(Default)]
pub(crate) struct ClaimPodLabels {
    inner: std::sync::RwLock<Option<KeysAndSource>>,
}

impl std::fmt::Debug for ClaimPodLabels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimPodLabels").finish_non_exhaustive()
    }
}

impl ClaimPodLabels {
    /// Labels claim series with `keys` from `source` from now on.
    pub(crate) fn set(&self, keys: Vec<String>, source: std::sync::Arc<dyn PodLabelSource>) {
        *self
            .inner
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((keys, source));
    }

    /// `(label_<key>, value)` of every key for `claim`; empty without keys.
    pub(crate) fn of(&self, claim: &cleave_driver::model::ClaimRef) -> Vec<(String, String)> {
        let inner = self
            .inner
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some((keys, source)) = inner.as_ref() else {
            return Vec::new();
        };
        if keys.is_empty() {
            return Vec::new();
        }
        let values = source.values(&claim.namespace, &claim.name, keys);
        keys.iter()
            .zip(values.into_iter().chain(std::iter::repeat(String::new())))
            .map(|(k, v)| (source.label_name(k), v))
            .collect()
    }
}

/// The `namespace` and `claim` label values of `claim`: its namespace and name, or (with
/// `uid_only`, `--metrics-claim-labels=uid-only`) an empty namespace and its UID, so that a
/// scrape does not list the tenants' namespaces and claim names.
pub(crate) fn claim_label_values(
    claim: &cleave_driver::model::ClaimRef,
    uid_only: bool,
) -> (String, String) {
    if uid_only {
        (String::new(), claim.uid.clone())
    } else {
        (claim.namespace.clone(), claim.name.clone())
    }
}

impl ClaimDeviceLabels {
    /// The labels of claim device `d` in `pool` (see [`claim_label_values`] for `uid_only`).
    pub(crate) fn of(pool: &str, d: &cleave_driver::usage::ClaimDevice, uid_only: bool) -> Self {
        let (namespace, claim) = claim_label_values(&d.claim, uid_only);
        Self {
            namespace,
            claim,
            device: d.device.clone(),
            gpu: d.gpu_uuid.clone(),
            kind: d.kind.as_str(),
            sharing: sharing_label(d.sharing),
            pool: pool.to_owned(),
            share: d.share_id.clone().unwrap_or_default(),
            pod: Vec::new(),
        }
    }

    /// These labels with the claim's `label_<key>` labels.
    pub(crate) fn with_pod(mut self, pod: Vec<(String, String)>) -> Self {
        self.pod = pod;
        self
    }
}

/// [`ClaimDeviceLabels`] and what was given as labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct AllocatedInfoLabels {
    /// The claim device.
    #[prometheus(flatten)]
    pub device: ClaimDeviceLabels,
    /// MIG profile (`1g.10gb`); empty for whole GPUs.
    pub mig_profile: String,
}

/// [`ClaimDeviceLabels`] and where the activity figure comes from.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ActivityLabels {
    /// The claim device.
    #[prometheus(flatten)]
    pub device: ClaimDeviceLabels,
    /// `gpm_sm_activity`, `gpm_sm_occupancy`, `gpu_utilization` or `process_sm_utilization`.
    pub source: &'static str,
}

/// Labels of the per-claim idle series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct IdleLabels {
    /// Claim namespace.
    pub namespace: String,
    /// Claim name.
    pub claim: String,
    /// `label_<key>` per `--claim-pod-labels` key.
    #[prometheus(flatten)]
    pub pod: Vec<(String, String)>,
}

/// Labels of the per-GPU series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct GpuLabels {
    /// GPU UUID.
    pub gpu: String,
}

/// Label sets written by the last round, to remove the ones the next round lacks.
#[derive(Debug, Default)]
struct Written {
    devices: HashSet<ClaimDeviceLabels>,
    info: HashSet<AllocatedInfoLabels>,
    used: HashSet<ClaimDeviceLabels>,
    sms: HashSet<ClaimDeviceLabels>,
    activity: HashSet<ActivityLabels>,
    idle: HashSet<IdleLabels>,
    idle_since: HashSet<IdleLabels>,
}

/// The usage series, registered in the plugin's registry by [`crate::metrics::Metrics::new`].
#[derive(Debug, Default)]
pub struct UsageMetrics {
    allocated_memory: Family<ClaimDeviceLabels, Gauge>,
    allocated_sms: Family<ClaimDeviceLabels, Gauge>,
    allocated_info: Family<AllocatedInfoLabels, Gauge>,
    used_memory: Family<ClaimDeviceLabels, Gauge>,
    activity: Family<ActivityLabels, FloatGauge>,
    attributable: Family<ClaimDeviceLabels, Gauge>,
    idle: Family<IdleLabels, Gauge>,
    idle_since: Family<IdleLabels, FloatGauge>,
    gpu_memory: Family<GpuLabels, Gauge>,
    gpu_sms: Family<GpuLabels, Gauge>,
    sample_duration: FloatGauge,
    written: Mutex<Written>,
    /// Claims are labelled by UID only (`--metrics-claim-labels=uid-only`).
    uid_only: std::sync::atomic::AtomicBool,
    /// `label_<key>` labels of the claim series (`--claim-pod-labels`).
    pub(crate) pod_labels: std::sync::Arc<ClaimPodLabels>,
}

fn i64_of(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Removes from `family` the label sets of `before` not in `now`, and returns `now`.
fn retire<S, M, C>(family: &Family<S, M, C>, before: &HashSet<S>, now: &HashSet<S>)
where
    S: Clone + std::hash::Hash + Eq,
    C: prometheus_client::metrics::family::MetricConstructor<M>,
{
    for gone in before.difference(now) {
        family.remove(gone);
    }
}

impl UsageMetrics {
    /// Creates the series and registers them in `registry` (prefix `cleave_kubelet_plugin`).
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "claim_allocated_memory_bytes",
            "Memory given to the claim device: the GPU's or MIG device's, or the share's",
            m.allocated_memory.clone(),
        );
        registry.register(
            "claim_allocated_sms",
            "Streaming multiprocessors given to the claim device, where known",
            m.allocated_sms.clone(),
        );
        registry.register(
            "claim_allocated_info",
            "What the claim device was given, as labels (always 1)",
            m.allocated_info.clone(),
        );
        registry.register(
            "claim_used_memory_bytes",
            "Memory the claim device uses; absent where NVML cannot attribute it",
            m.used_memory.clone(),
        );
        registry.register(
            "claim_compute_activity_percent",
            "Compute activity of the claim device, 0 to 100, by source (gpm_sm_activity and gpm_sm_occupancy on Hopper and newer, gpu_utilization (duty cycle) only where GPM does not exist, process_sm_utilization for MPS claims and shares)",
            m.activity.clone(),
        );
        registry.register(
            "claim_activity_attributable",
            "0 where NVML cannot tell this claim device's activity apart from its neighbours' (or has none), 1 otherwise",
            m.attributable.clone(),
        );
        registry.register(
            "claim_idle",
            "1 when every device of the claim stayed below --idle-threshold for --idle-after",
            m.idle.clone(),
        );
        registry.register(
            "claim_idle_since_timestamp_seconds",
            "Unix time since which every device of the claim has been below --idle-threshold",
            m.idle_since.clone(),
        );
        registry.register(
            "gpu_memory_total_bytes",
            "Total memory of each GPU of the node (for share fill)",
            m.gpu_memory.clone(),
        );
        registry.register(
            "gpu_sms",
            "Streaming multiprocessors of each GPU of the node, where known (for MIG fill)",
            m.gpu_sms.clone(),
        );
        registry.register(
            "usage_sample_duration_seconds",
            "Duration of the last usage sampling round",
            m.sample_duration.clone(),
        );
        m
    }

    /// Labels claims by UID only from now on (`--metrics-claim-labels=uid-only`).
    pub(crate) fn set_uid_only(&self, uid_only: bool) {
        self.uid_only
            .store(uid_only, std::sync::atomic::Ordering::Relaxed);
    }

    /// Writes one round (the samples of every prepared claim device, the idle state of every
    /// claim, its duration) and `gpus` (UUID, total memory, SMs); removes the series of
    /// claims not in it. `now` and `wall` are the same moment (for `idle_since`).
    pub fn apply_round(
        &self,
        pool: &str,
        round: &super::round::RoundOutcome,
        gpus: &[(String, u64, Option<u32>)],
        now: std::time::Instant,
        wall: SystemTime,
    ) {
        let (samples, idle, took) = (&round.samples, &round.idle, round.took);
        let uid_only = self.uid_only.load(std::sync::atomic::Ordering::Relaxed);
        let mut next = Written::default();
        for s in samples {
            let d = &s.device;
            let labels =
                ClaimDeviceLabels::of(pool, d, uid_only).with_pod(self.pod_labels.of(&d.claim));
            self.allocated_memory
                .get_or_create(&labels)
                .set(i64_of(d.allocated.memory_bytes));
            if let Some(sms) = d.allocated.sms {
                self.allocated_sms
                    .get_or_create(&labels)
                    .set(i64::from(sms));
                next.sms.insert(labels.clone());
            }
            let info = AllocatedInfoLabels {
                device: labels.clone(),
                mig_profile: d.allocated.mig_profile.clone().unwrap_or_default(),
            };
            self.allocated_info.get_or_create(&info).set(1);
            next.info.insert(info);
            if let Some(used) = s.memory_used {
                self.used_memory.get_or_create(&labels).set(i64_of(used));
                next.used.insert(labels.clone());
            }
            for (source, percent) in s.activity_series() {
                let l = ActivityLabels {
                    device: labels.clone(),
                    source: source.as_str(),
                };
                self.activity.get_or_create(&l).set(percent);
                next.activity.insert(l);
            }
            let attributable = !matches!(
                s.activity,
                Activity::NotAttributable | Activity::Unavailable
            );
            self.attributable
                .get_or_create(&labels)
                .set(i64::from(attributable));
            next.devices.insert(labels);
        }
        for st in idle {
            let (namespace, claim) = claim_label_values(&st.claim, uid_only);
            let l = IdleLabels {
                namespace,
                claim,
                pod: self.pod_labels.of(&st.claim),
            };
            self.idle.get_or_create(&l).set(i64::from(st.idle));
            if let Some(since) = st.below_since {
                let at = wall
                    .checked_sub(now.saturating_duration_since(since))
                    .unwrap_or(wall);
                let secs = at
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                self.idle_since.get_or_create(&l).set(secs);
                next.idle_since.insert(l.clone());
            }
            next.idle.insert(l);
        }
        for (uuid, memory, sms) in gpus {
            let l = GpuLabels { gpu: uuid.clone() };
            self.gpu_memory.get_or_create(&l).set(i64_of(*memory));
            if let Some(sms) = sms {
                self.gpu_sms.get_or_create(&l).set(i64::from(*sms));
            }
        }
        self.sample_duration.set(took.as_secs_f64());
        let mut written = self
            .written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        retire(&self.allocated_memory, &written.devices, &next.devices);
        retire(&self.attributable, &written.devices, &next.devices);
        retire(&self.allocated_sms, &written.sms, &next.sms);
        retire(&self.allocated_info, &written.info, &next.info);
        retire(&self.used_memory, &written.used, &next.used);
        retire(&self.activity, &written.activity, &next.activity);
        retire(&self.idle, &written.idle, &next.idle);
        retire(&self.idle_since, &written.idle_since, &next.idle_since);
        *written = next;
    }
}
