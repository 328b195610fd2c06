//! Right-sizing in the plugin: the usage windows of the prepared claims (kept across
//! restarts in `<state dir>/usage-windows.json`), a recommendation per claim device after
//! every sampling round, the node's savings figure, and the claims that turned oversized
//! (for `ClaimOversized` Events, `--rightsize-events`). The logic is
//! `cleave_driver::rightsize`; this module feeds it rounds and wall-clock time.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::SystemTime;

use cleave_driver::model::NodeInventory;
use cleave_driver::rightsize::{
    Advice, Change, Merge, NodeModes, Recommendation, RightsizePolicy, Savings, WindowConfig,
    WindowKey, WindowStats, WindowStore, merges, recommend, savings,
};
use cleave_driver::usage::{ClaimDevice, ClaimRef, DeviceSample};
use tracing::warn;

/// Event reason: a claim's recommendation is smaller than what it holds, or release.
pub(crate) const REASON_CLAIM_OVERSIZED: &str = "ClaimOversized";

/// How right-sizing runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RightsizeConfig {
    /// Window length and idle threshold.
    pub window: WindowConfig,
    /// Headroom and idle threshold.
    pub policy: RightsizePolicy,
    /// What the node serves.
    pub modes: NodeModes,
}

/// One claim device's window and recommendation after a round.
#[derive(Debug, Clone)]
pub struct RightsizeEntry {
    /// The claim device.
    pub device: ClaimDevice,
    /// Its window.
    pub stats: WindowStats,
    /// Its recommendation.
    pub recommendation: Recommendation,
}

/// A claim whose recommendation turned smaller than what it holds (or release).
#[derive(Debug, Clone, PartialEq)]
pub struct OversizedNotice {
    /// The claim.
    pub claim: ClaimRef,
    /// The Event's note: the device, the recommendation and its reason.
    pub note: String,
}

/// The outcome of one round.
#[derive(Debug, Clone, Default)]
pub struct RightsizeOutcome {
    /// One entry per claim device, in round order.
    pub entries: Vec<RightsizeEntry>,
    /// GPUs held against GPUs needed.
    pub savings: Savings,
    /// Capacity shares and MPS claims that would fit on fewer GPUs, per product.
    pub merges: Vec<Merge>,
    /// Claims that turned oversized in this round (once per window per change).
    pub newly_oversized: Vec<OversizedNotice>,
}

/// Windows, recommendations and the Event bookkeeping.
#[derive(Debug)]
pub struct Rightsizer {
    config: RightsizeConfig,
    store: WindowStore,
    /// Per claim device: what was last told, and when (Unix seconds).
    told: BTreeMap<WindowKey, (String, u64)>,
}

fn unix(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Rightsizer {
    /// Windows kept in memory only.
    pub fn in_memory(config: RightsizeConfig) -> Self {
        Self {
            store: WindowStore::in_memory(config.window),
            config,
            told: BTreeMap::new(),
        }
    }

    /// Windows kept in `path` (read now; an unusable file is logged and replaced).
    pub fn open(config: RightsizeConfig, path: &Path) -> Self {
        let (store, warning) = WindowStore::open(path, config.window);
        if let Some(w) = warning {
            warn!(path = %path.display(), problem = %w, "usage windows not restored");
        }
        Self {
            store,
            config,
            told: BTreeMap::new(),
        }
    }

    /// The windows.
    pub fn store(&self) -> &WindowStore {
        &self.store
    }

    /// Feeds one round (`devices`, their `samples`) taken at `wall`; returns every claim
    /// device's recommendation, the node's savings and the claims newly oversized. Writes
    /// the state file when due (a failure is logged; the windows stay in memory).
    pub fn round(
        &mut self,
        devices: &[ClaimDevice],
        samples: &[DeviceSample],
        inventory: &NodeInventory,
        wall: SystemTime,
    ) -> RightsizeOutcome {
        self.round_paced(devices, samples, inventory, wall, &mut || {})
    }

    /// [`Self::round`], calling `pace` before writing the windows and before each
    /// device's recommendation (the monitor lets prepare go first there).
    pub(crate) fn round_paced(
        &mut self,
        devices: &[ClaimDevice],
        samples: &[DeviceSample],
        inventory: &NodeInventory,
        wall: SystemTime,
        pace: &mut dyn FnMut(),
    ) -> RightsizeOutcome {
        let now = unix(wall);
        self.store.observe(now, devices, samples);
        pace();
        if let Err(e) = self.store.persist(now, false) {
            warn!(error = %e, "usage windows not written; kept in memory");
        }
        let entries: Vec<RightsizeEntry> = devices
            .iter()
            .map(|d| {
                pace();
                let stats = self.store.stats(&WindowKey::of(d), now);
                let recommendation =
                    recommend(d, &stats, inventory, self.config.modes, &self.config.policy);
                RightsizeEntry {
                    device: d.clone(),
                    stats,
                    recommendation,
                }
            })
            .collect();
        let recs: Vec<Recommendation> = entries.iter().map(|e| e.recommendation.clone()).collect();
        let savings = savings(inventory, devices, &recs);
        let merges = merges(inventory, devices, &recs);
        let window = self.config.window.window_seconds;
        let mut newly_oversized = Vec::new();
        self.told
            .retain(|k, _| devices.iter().any(|d| WindowKey::of(d) == *k));
        for e in &entries {
            let r = &e.recommendation;
            if !matches!(r.change, Change::Smaller | Change::Release) || !r.served {
                continue;
            }
            let what = match &r.advice {
                Advice::Shape(s) => s.describe(),
                a => a.kind().to_owned(),
            };
            let key = WindowKey::of(&e.device);
            let due = match self.told.get(&key) {
                Some((last, at)) => *last != what || now.saturating_sub(*at) >= window,
                None => true,
            };
            if due {
                self.told.insert(key, (what.clone(), now));
                newly_oversized.push(OversizedNotice {
                    claim: e.device.claim.clone(),
                    note: format!(
                        "device {}: recommended {what}: {}",
                        e.device.device, r.reason
                    ),
                });
            }
        }
        RightsizeOutcome {
            entries,
            savings,
            merges,
            newly_oversized,
        }
    }

    /// Writes whatever changed (at shutdown).
    pub fn flush(&mut self, wall: SystemTime) {
        if let Err(e) = self.store.persist(unix(wall), true) {
            warn!(error = %e, "usage windows not written at shutdown");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cleave_driver::model::{GpuInfo, MigState};
    use cleave_driver::usage::{Activity, ActivitySource, Allocation, Holding, MemorySource};
    use std::time::Duration;

    /// One H100 (the mock library's table) with MIG off, as `GPU-0`.
    fn inventory() -> NodeInventory {
        let gpu = GpuInfo {
            uuid: "GPU-0".into(),
            ..cleave_driver::prepare::testing::h100_gpu(0, MigState::NotCapable)
        };
        cleave_driver::prepare::testing::inventory(vec![gpu])
    }

    fn device(uid: &str) -> ClaimDevice {
        ClaimDevice {
            claim: ClaimRef {
                uid: uid.into(),
                namespace: "ns".into(),
                name: format!("c-{uid}"),
            },
            device: "gpu-0".into(),
            kind: Holding::Whole,
            sharing: None,
            share_id: None,
            gpu_uuid: "GPU-0".into(),
            mig: None,
            allocated: Allocation {
                memory_bytes: 80 << 30,
                sms: Some(132),
                mig_profile: None,
            },
            pids: Vec::new(),
            pods: Vec::new(),
        }
    }

    fn sample(d: &ClaimDevice, percent: f64) -> DeviceSample {
        DeviceSample {
            device: d.clone(),
            memory_used: Some(1 << 30),
            memory_total: Some(80 << 30),
            memory_source: MemorySource::Device,
            activity: Activity::Measured {
                percent,
                source: ActivitySource::GpmSmActivity,
            },
            sm_occupancy: None,
            errors: Vec::new(),
        }
    }

    fn config(window_seconds: u64) -> RightsizeConfig {
        RightsizeConfig {
            window: WindowConfig {
                window_seconds,
                idle_threshold_percent: 5.0,
            },
            policy: RightsizePolicy::default(),
            modes: NodeModes::default(),
        }
    }

    #[test]
    fn oversized_claims_are_told_once_per_window_per_change() {
        let mut r = Rightsizer::in_memory(config(2400));
        let inv = inventory();
        let d = [device("a")];
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut told = Vec::new();
        for s in (0..2400).step_by(50) {
            let out = r.round(&d, &[sample(&d[0], 0.5)], &inv, at(s));
            told.extend(out.newly_oversized);
        }
        assert_eq!(told.len(), 1, "{told:?}");
        assert!(
            told[0].note.contains("recommended release"),
            "{}",
            told[0].note
        );
        assert!(told[0].note.contains("idle: release"), "{}", told[0].note);
        // One window later, still idle: told again.
        let mut again = Vec::new();
        for s in (2400..4850).step_by(50) {
            again.extend(
                r.round(&d, &[sample(&d[0], 0.5)], &inv, at(s))
                    .newly_oversized,
            );
        }
        assert_eq!(again.len(), 1, "{again:?}");
        // Unprepared: forgotten, its window too.
        let out = r.round(&[], &[], &inv, at(5000));
        assert!(out.entries.is_empty() && r.store().is_empty());
    }

    #[test]
    fn a_restart_of_the_rounds_keeps_the_window_in_the_state_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(cleave_driver::rightsize::STATE_FILE);
        let inv = inventory();
        let d = [device("a")];
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut first = Rightsizer::open(config(2400), &path);
        for s in (0..1300).step_by(50) {
            first.round(&d, &[sample(&d[0], 30.0)], &inv, at(s));
        }
        first.flush(at(1300));
        drop(first);
        let mut second = Rightsizer::open(config(2400), &path);
        let out = second.round(&d, &[sample(&d[0], 30.0)], &inv, at(1300));
        // 13 buckets seen across the restart: enough for a recommendation.
        assert_eq!(out.entries[0].stats.seen_buckets, 14);
        assert_eq!(out.entries[0].stats.samples, 27);
        assert_ne!(out.entries[0].recommendation.advice, Advice::Pending);
    }

    #[test]
    fn series_are_exactly_the_rightsize_metric_names() {
        let m = crate::metrics::Metrics::new();
        let mut r = Rightsizer::in_memory(config(2400));
        let inv = inventory();
        let d = [device("a"), device("b")];
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let mut out = RightsizeOutcome::default();
        for s in (0..2400).step_by(100) {
            out = r.round(
                &d,
                &[sample(&d[0], 30.0), sample(&d[1], 0.0)],
                &inv,
                t0 + Duration::from_secs(s),
            );
        }
        // A merge advice, so that its series is among them (present only where fewer GPUs
        // would do).
        out.merges.push(cleave_driver::rightsize::Merge {
            product: "NVIDIA H100 80GB HBM3".into(),
            gpus: vec!["gpu-0".into(), "gpu-1".into()],
            needed: 1,
        });
        m.rightsize.apply("n1", &out);
        let text = m.encode();
        let exported: std::collections::BTreeSet<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split(['{', ' ']).next())
            .filter(|n| {
                cleave_driver::rightsize::RIGHTSIZE_METRIC_NAMES
                    .iter()
                    .any(|r| n.starts_with(r))
            })
            .collect();
        let names: std::collections::BTreeSet<&str> =
            cleave_driver::rightsize::RIGHTSIZE_METRIC_NAMES
                .iter()
                .copied()
                .collect();
        assert_eq!(exported, names, "{text}");
        assert!(
            text.contains(r#"cleave_kubelet_plugin_claim_recommendation_info{namespace="ns",claim="c-b",device="gpu-0",gpu="GPU-0",kind="gpu",sharing="exclusive",pool="n1",share="",recommendation="release",profile="",change="release",served="true"} 1"#),
            "{text}"
        );
        // Claim b unprepared: its series go.
        let out = r.round(
            &d[..1],
            &[sample(&d[0], 30.0)],
            &inv,
            t0 + Duration::from_secs(2400),
        );
        m.rightsize.apply("n1", &out);
        let text = m.encode();
        assert!(!text.contains("c-b"), "{text}");
        assert!(!text.contains("node_share_merge_gpus{"), "{text}");
    }
}
