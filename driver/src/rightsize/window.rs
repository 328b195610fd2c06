//! Usage windows: per claim device, what a sliding window of sampling rounds saw, in a
//! bounded amount of memory.
//!
//! The window (`--rightsize-window`, default 24 h) is cut into [`BUCKETS`] buckets of
//! equal length aligned to Unix time; a bucket holds the counts of its rounds and two
//! sparse histograms (memory used, SM activity). The window is the current bucket and the
//! 23 before it, so it spans between 23/24 of `--rightsize-window` and all of it (it
//! slides in bucket steps); older buckets are dropped. Memory is bounded: at most
//! [`BUCKETS`] buckets, each with at most 101 activity bins and (for memory up to 2 TiB)
//! 736 memory bins; a steady workload fills a handful of bins per bucket.
//!
//! **Quantile estimator.** Fixed-bin histograms, merged over the window's buckets; a
//! quantile is the nearest-rank sample (`ceil(q * n)`-th smallest) read off the
//! histogram as the upper edge of the bin that holds it, capped at the exact maximum:
//! - memory: logarithmic bins, bin `i` holds `(γ^(i-1), γ^i]` MiB with `γ = 1.02`
//!   (everything up to 1 MiB in bin 0), so the reported quantile is never below the true
//!   nearest-rank quantile and at most 2 % above it (or 1 MiB, below 1 MiB);
//! - SM activity: bins of one percentage point (`(i-1, i]` %), so the reported quantile is
//!   never below the true one and less than one point above it.
//!
//! Peak memory, the mean of SM activity, the idle fraction and the sample counts are exact.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::usage::{Activity, ActivitySource, DeviceSample, MemorySource};

/// Buckets per window.
pub const BUCKETS: u32 = 24;

/// A recommendation needs samples in at least this many of the window's buckets (half
/// the window).
pub(crate) const MIN_SEEN_BUCKETS: u32 = BUCKETS / 2;

/// Growth factor of the memory histogram's bins (relative error bound of a memory
/// quantile: `MEMORY_BIN_GROWTH - 1`).
pub(crate) const MEMORY_BIN_GROWTH: f64 = 1.02;

const MIB: u64 = 1 << 20;

/// Memory histogram bin of `bytes`.
fn memory_bin(bytes: u64) -> u16 {
    if bytes <= MIB {
        return 0;
    }
    let x = (bytes as f64 / MIB as f64).ln() / MEMORY_BIN_GROWTH.ln();
    let bin = x.ceil();
    if bin >= f64::from(u16::MAX) {
        u16::MAX
    } else {
        // ceil of a positive finite figure below u16::MAX
        bin as u16
    }
}

/// Upper edge of memory bin `bin`, bytes.
fn memory_bin_upper(bin: u16) -> u64 {
    let v = MIB as f64 * MEMORY_BIN_GROWTH.powi(i32::from(bin));
    if v >= u64::MAX as f64 {
        u64::MAX
    } else {
        v.ceil() as u64
    }
}

/// SM activity histogram bin of `percent` (0 to 100).
fn activity_bin(percent: f64) -> u8 {
    if percent.is_nan() || percent <= 0.0 {
        0
    } else if percent >= 100.0 {
        100
    } else {
        percent.ceil() as u8
    }
}

/// A sparse histogram: `(bin, count)` sorted by bin.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
struct Hist<K: Ord + Copy>(Vec<(K, u32)>);

impl<K: Ord + Copy> Hist<K> {
    fn add(&mut self, bin: K) {
        match self.0.binary_search_by(|(k, _)| k.cmp(&bin)) {
            Ok(i) => self.0[i].1 = self.0[i].1.saturating_add(1),
            Err(i) => self.0.insert(i, (bin, 1)),
        }
    }

    fn bytes(&self) -> usize {
        self.0.capacity() * std::mem::size_of::<(K, u32)>()
    }
}

/// The nearest-rank `q` quantile's bin over merged counts.
fn quantile_bin<K: Ord + Copy>(merged: &BTreeMap<K, u64>, q: f64) -> Option<K> {
    let n: u64 = merged.values().sum();
    if n == 0 {
        return None;
    }
    let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
    let mut seen = 0;
    for (bin, count) in merged {
        seen += count;
        if seen >= rank {
            return Some(*bin);
        }
    }
    merged.keys().next_back().copied()
}

fn source_bit(s: ActivitySource) -> u8 {
    match s {
        ActivitySource::GpmSmActivity => 1,
        ActivitySource::GpmSmOccupancy => 2,
        ActivitySource::GpuUtilization => 4,
        ActivitySource::ProcessSmUtilization => 8,
    }
}

const SOURCES: [ActivitySource; 4] = [
    ActivitySource::GpmSmActivity,
    ActivitySource::GpmSmOccupancy,
    ActivitySource::GpuUtilization,
    ActivitySource::ProcessSmUtilization,
];

/// One bucket of a window.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Bucket {
    /// `unix seconds / bucket seconds`.
    index: u64,
    /// Rounds that sampled the device (warming rounds excluded).
    samples: u32,
    /// Rounds with a memory figure.
    memory_samples: u32,
    /// Rounds whose memory was not attributable to the claim.
    memory_not_attributable: u32,
    /// The highest memory figure, bytes.
    memory_max: u64,
    memory: Hist<u16>,
    /// Rounds with an activity figure.
    activity_samples: u32,
    /// Rounds whose activity was not attributable to the claim.
    activity_not_attributable: u32,
    /// Rounds without any activity figure for the device (NVML has none, or failed).
    activity_unavailable: u32,
    /// Sum of the activity figures (for the mean).
    activity_sum: f64,
    /// The highest activity figure, percent.
    activity_max: f64,
    /// Rounds with activity below the idle threshold.
    idle: u32,
    activity: Hist<u8>,
    /// Sources of the activity figures (bit set).
    sources: u8,
}

/// What a window saw, for a recommendation and the metrics.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WindowStats {
    /// Rounds that sampled the device (warming rounds excluded).
    pub samples: u64,
    /// Buckets with at least one sample, of [`BUCKETS`].
    pub seen_buckets: u32,
    /// Length of one bucket, seconds.
    pub bucket_seconds: u64,
    /// Rounds with a memory figure.
    pub memory_samples: u64,
    /// Rounds whose memory was not attributable.
    pub memory_not_attributable: u64,
    /// The highest memory used, bytes (exact).
    pub peak_memory: Option<u64>,
    /// 95th percentile of memory used, bytes (see the module doc for the bound).
    pub p95_memory: Option<u64>,
    /// Rounds with an activity figure.
    pub activity_samples: u64,
    /// Rounds whose activity was not attributable.
    pub activity_not_attributable: u64,
    /// Rounds without an activity figure.
    pub activity_unavailable: u64,
    /// 95th percentile of SM activity, percent (see the module doc for the bound).
    pub p95_activity: Option<f64>,
    /// Mean SM activity, percent (exact).
    pub mean_activity: Option<f64>,
    /// Highest SM activity, percent (exact).
    pub max_activity: Option<f64>,
    /// Fraction of the rounds with an activity figure that were below the idle threshold.
    pub idle_fraction: Option<f64>,
    /// Sources of the activity figures.
    pub sources: Vec<ActivitySource>,
    /// Memory rose over the window: the newest quarter's peak is above 1.5 times the
    /// oldest quarter's.
    pub memory_rising: bool,
}

impl WindowStats {
    /// The time the window's samples span, at most, seconds (seen buckets x bucket length).
    pub(crate) fn seen_seconds(&self) -> u64 {
        u64::from(self.seen_buckets) * self.bucket_seconds
    }
}

/// The usage window of one claim device.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct UsageWindow {
    buckets: Vec<Bucket>,
}

/// How a window cuts time and what counts as idle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowConfig {
    /// Window length, seconds (at least [`BUCKETS`]).
    pub window_seconds: u64,
    /// Activity below this (percent) counts as idle.
    pub idle_threshold_percent: f64,
}

impl WindowConfig {
    /// Length of a bucket, seconds (at least 1).
    pub(crate) fn bucket_seconds(&self) -> u64 {
        (self.window_seconds / u64::from(BUCKETS)).max(1)
    }
}

impl Default for WindowConfig {
    fn default() -> Self {
        Self {
            window_seconds: 24 * 3600,
            idle_threshold_percent: 5.0,
        }
    }
}

impl UsageWindow {
    /// Adds the sample of one round taken at `unix_seconds`. A warming round adds nothing.
    /// Returns true when the sample opened a new bucket.
    pub fn observe(&mut self, config: &WindowConfig, unix_seconds: u64, s: &DeviceSample) -> bool {
        if matches!(s.activity, Activity::Warming) && s.memory_used.is_none() {
            return false;
        }
        let index = unix_seconds / config.bucket_seconds();
        let opened = self.buckets.last().is_none_or(|b| b.index < index);
        if opened {
            self.buckets.push(Bucket {
                index,
                ..Bucket::default()
            });
        }
        self.expire(config, unix_seconds);
        let Some(b) = self.buckets.iter_mut().rev().find(|b| b.index == index) else {
            // A clock that went back: the sample belongs to a closed bucket; drop it.
            return false;
        };
        b.samples = b.samples.saturating_add(1);
        match (s.memory_source, s.memory_used) {
            (MemorySource::NotAttributable, _) => {
                b.memory_not_attributable = b.memory_not_attributable.saturating_add(1);
            }
            (_, Some(used)) => {
                b.memory_samples = b.memory_samples.saturating_add(1);
                b.memory_max = b.memory_max.max(used);
                b.memory.add(memory_bin(used));
            }
            (_, None) => {}
        }
        match s.activity {
            Activity::Measured { percent, source } => {
                let percent = percent.clamp(0.0, 100.0);
                b.activity_samples = b.activity_samples.saturating_add(1);
                b.activity_sum += percent;
                b.activity_max = b.activity_max.max(percent);
                if percent < config.idle_threshold_percent {
                    b.idle = b.idle.saturating_add(1);
                }
                b.activity.add(activity_bin(percent));
                b.sources |= source_bit(source);
            }
            Activity::NotAttributable => {
                b.activity_not_attributable = b.activity_not_attributable.saturating_add(1);
            }
            Activity::Unavailable => {
                b.activity_unavailable = b.activity_unavailable.saturating_add(1);
            }
            Activity::Warming => {}
        }
        opened
    }

    /// Drops the buckets that fell out of the window at `unix_seconds`.
    pub fn expire(&mut self, config: &WindowConfig, unix_seconds: u64) {
        let current = unix_seconds / config.bucket_seconds();
        let oldest = current.saturating_sub(u64::from(BUCKETS) - 1);
        self.buckets
            .retain(|b| b.index >= oldest && b.index <= current);
    }

    /// True when no bucket is left.
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// Bytes this window holds (struct, buckets and histograms), for the bench.
    pub fn heap_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.buckets.capacity() * std::mem::size_of::<Bucket>()
            + self
                .buckets
                .iter()
                .map(|b| b.memory.bytes() + b.activity.bytes())
                .sum::<usize>()
    }

    /// What the window saw, as of `unix_seconds`.
    pub fn stats(&self, config: &WindowConfig, unix_seconds: u64) -> WindowStats {
        let current = unix_seconds / config.bucket_seconds();
        let oldest = current.saturating_sub(u64::from(BUCKETS) - 1);
        let live: Vec<&Bucket> = self
            .buckets
            .iter()
            .filter(|b| b.index >= oldest && b.index <= current)
            .collect();
        let mut st = WindowStats {
            bucket_seconds: config.bucket_seconds(),
            ..WindowStats::default()
        };
        let mut memory: BTreeMap<u16, u64> = BTreeMap::new();
        let mut activity: BTreeMap<u8, u64> = BTreeMap::new();
        let (mut sum, mut idle, mut sources, mut peak, mut amax) = (0.0, 0u64, 0u8, None, None);
        for b in &live {
            if b.samples > 0 {
                st.seen_buckets += 1;
            }
            st.samples += u64::from(b.samples);
            st.memory_samples += u64::from(b.memory_samples);
            st.memory_not_attributable += u64::from(b.memory_not_attributable);
            st.activity_samples += u64::from(b.activity_samples);
            st.activity_not_attributable += u64::from(b.activity_not_attributable);
            st.activity_unavailable += u64::from(b.activity_unavailable);
            sum += b.activity_sum;
            idle += u64::from(b.idle);
            sources |= b.sources;
            if b.memory_samples > 0 {
                peak = Some(peak.map_or(b.memory_max, |p: u64| p.max(b.memory_max)));
            }
            if b.activity_samples > 0 {
                amax = Some(amax.map_or(b.activity_max, |m: f64| m.max(b.activity_max)));
            }
            for (k, c) in &b.memory.0 {
                *memory.entry(*k).or_default() += u64::from(*c);
            }
            for (k, c) in &b.activity.0 {
                *activity.entry(*k).or_default() += u64::from(*c);
            }
        }
        st.peak_memory = peak;
        st.p95_memory = quantile_bin(&memory, 0.95)
            .map(|bin| memory_bin_upper(bin).min(peak.unwrap_or(u64::MAX)));
        st.max_activity = amax;
        st.p95_activity =
            quantile_bin(&activity, 0.95).map(|bin| f64::from(bin).min(amax.unwrap_or(100.0)));
        if st.activity_samples > 0 {
            st.mean_activity = Some(sum / st.activity_samples as f64);
            st.idle_fraction = Some(idle as f64 / st.activity_samples as f64);
        }
        st.sources = SOURCES
            .into_iter()
            .filter(|s| sources & source_bit(*s) != 0)
            .collect();
        // Rising: compare the peaks of the oldest and newest quarter of the seen buckets.
        let with_memory: Vec<u64> = live
            .iter()
            .filter(|b| b.memory_samples > 0)
            .map(|b| b.memory_max)
            .collect();
        if with_memory.len() >= 4 {
            let q = with_memory.len() / 4;
            let old = with_memory[..q].iter().copied().max().unwrap_or(0);
            let new = with_memory[with_memory.len() - q..]
                .iter()
                .copied()
                .max()
                .unwrap_or(0);
            st.memory_rising = new as f64 > 1.5 * old as f64 && new > old + 64 * MIB;
        }
        st
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn memory_bins_overstate_by_at_most_two_percent() {
        for mib in [2u64, 3, 10, 100, 1000, 4096, 40_448, 81_559, 143_104] {
            for extra in [0u64, 1, MIB / 2, MIB - 1] {
                let bytes = mib * MIB + extra;
                let upper = memory_bin_upper(memory_bin(bytes));
                assert!(upper >= bytes, "{bytes}: {upper}");
                assert!(
                    upper as f64 <= bytes as f64 * MEMORY_BIN_GROWTH + 1.0,
                    "{bytes}: {upper}"
                );
            }
        }
        assert_eq!(memory_bin_upper(memory_bin(0)), MIB);
        // All of u64 in 1542 bins.
        assert_eq!(memory_bin(u64::MAX), 1541);
    }

    #[test]
    fn quantiles_are_nearest_rank_within_the_bound() {
        // 100 samples 1..=100 %: nearest-rank p95 is the 95th, 95 %.
        let mut m = BTreeMap::new();
        for p in 1..=100u8 {
            *m.entry(activity_bin(f64::from(p) - 0.5)).or_default() += 1u64;
        }
        assert_eq!(quantile_bin(&m, 0.95), Some(95));
        assert_eq!(quantile_bin(&BTreeMap::<u8, u64>::new(), 0.95), None);
        assert_eq!(activity_bin(0.0), 0);
        assert_eq!(activity_bin(0.2), 1);
        assert_eq!(activity_bin(250.0), 100);
    }
}
