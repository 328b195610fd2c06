//! Right-sizing: per claim device, a usage window over the sampling rounds, and from it a
//! recommendation of the smallest shape that would have held the claim (a MIG profile of
//! the same product, a capacity share, a whole GPU, or release), with the GPUs the node's
//! recommendations would free. NVML-free and Kubernetes-free: it reads the usage
//! sampler's [`crate::usage::DeviceSample`]s and the node's inventory; the kubelet plugin
//! exports the results.
//!
//! - [`window`]: the bounded window per claim device and its estimator;
//! - [`advice`]: the recommendation and its reason in words;
//! - [`savings`]: GPUs held against GPUs needed, packed first fit, and the capacity shares
//!   that would fit on fewer GPUs ([`Merge`]);
//! - [`WindowStore`]: the windows of the prepared claims, kept across plugin restarts in a
//!   small versioned state file beside the checkpoint (written atomically; a claim's window
//!   goes when the claim is unprepared).
//!
//! Time is the caller's (Unix seconds), so tests script it and a restart continues the
//! same buckets.

pub mod advice;
pub mod savings;
pub mod window;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::usage::{ClaimDevice, DeviceSample};

pub use advice::{Advice, Change, NodeModes, Recommendation, RightsizePolicy, Shape, recommend};
pub use savings::{Merge, Savings, merges, savings};
pub use window::UsageWindow;
pub use window::{BUCKETS, WindowConfig, WindowStats};

/// Every right-sizing metric the kubelet plugin exports (full names as scraped).
pub const RIGHTSIZE_METRIC_NAMES: &[&str] = &[
    "cleave_kubelet_plugin_claim_recommended_memory_bytes",
    "cleave_kubelet_plugin_claim_recommended_multiprocessors",
    "cleave_kubelet_plugin_claim_recommendation_info",
    "cleave_kubelet_plugin_claim_window_peak_memory_bytes",
    "cleave_kubelet_plugin_claim_window_p95_memory_bytes",
    "cleave_kubelet_plugin_claim_window_p95_activity_percent",
    "cleave_kubelet_plugin_claim_window_mean_activity_percent",
    "cleave_kubelet_plugin_claim_window_idle_ratio",
    "cleave_kubelet_plugin_claim_window_samples",
    "cleave_kubelet_plugin_node_gpus_held",
    "cleave_kubelet_plugin_node_gpus_recommended",
    "cleave_kubelet_plugin_node_share_merge_gpus",
];

/// Name of the state file in the driver's state directory (beside `checkpoint.json`).
pub const STATE_FILE: &str = "usage-windows.json";

/// Layout version of the state file this release writes and reads.
pub const STATE_VERSION: u32 = 1;

/// The state file is rewritten at least this often while windows change (seconds), and
/// whenever a bucket closes or a claim's window is dropped.
pub(crate) const WRITE_EVERY_SECONDS: u64 = 300;

/// Errors of the right-sizing state.
#[derive(Debug, thiserror::Error)]
pub enum RightsizeError {
    /// Writing the state file failed.
    #[error("writing the usage-window state {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Encoding the state failed.
    #[error("encoding the usage-window state: {0}")]
    Encode(#[from] serde_json::Error),
}

/// Which claim device a window is about.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WindowKey {
    /// Claim UID.
    pub claim_uid: String,
    /// Published device name.
    pub device: String,
    /// `shareID` of a capacity share, empty otherwise.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub share: String,
}

impl WindowKey {
    /// The key of `d`.
    pub fn of(d: &ClaimDevice) -> Self {
        Self {
            claim_uid: d.claim.uid.clone(),
            device: d.device.clone(),
            share: d.share_id.clone().unwrap_or_default(),
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Entry {
    #[serde(flatten)]
    key: WindowKey,
    window: UsageWindow,
}

/// The state file's content. Unknown fields are ignored, so a later release may add some.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StateFile {
    version: u32,
    bucket_seconds: u64,
    buckets: u32,
    windows: Vec<Entry>,
}

/// The windows of the prepared claims' devices.
#[derive(Debug)]
pub struct WindowStore {
    config: WindowConfig,
    windows: BTreeMap<WindowKey, UsageWindow>,
    path: Option<PathBuf>,
    last_write: Option<u64>,
    /// A change that must reach the file at the next [`WindowStore::persist`] (a dropped
    /// claim, a closed bucket).
    urgent: bool,
    dirty: bool,
}

impl WindowStore {
    /// An empty store that keeps nothing on disk.
    pub fn in_memory(config: WindowConfig) -> Self {
        Self {
            config,
            windows: BTreeMap::new(),
            path: None,
            last_write: None,
            urgent: false,
            dirty: false,
        }
    }

    /// The store kept in `path`, with what the file holds. A missing file is an empty
    /// store; a file that cannot be used (unreadable, not this layout, a newer version, or
    /// another bucket length because `--rightsize-window` changed) is an empty store and a
    /// warning, returned for the caller to log: windows are advice, never worth refusing
    /// to start over.
    pub fn open(path: &Path, config: WindowConfig) -> (Self, Option<String>) {
        let mut store = Self::in_memory(config);
        store.path = Some(path.to_owned());
        let text = match std::fs::read(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return (store, None),
            Err(e) => {
                return (
                    store,
                    Some(format!(
                        "{}: {e}; starting with empty windows",
                        path.display()
                    )),
                );
            }
        };
        let file: StateFile = match serde_json::from_slice(&text) {
            Ok(f) => f,
            Err(e) => {
                return (
                    store,
                    Some(format!(
                        "{} does not decode ({e}); starting with empty windows",
                        path.display()
                    )),
                );
            }
        };
        if file.version > STATE_VERSION {
            return (
                store,
                Some(format!(
                    "{} has layout version {}, this release reads up to {STATE_VERSION}; starting with empty windows",
                    path.display(),
                    file.version
                )),
            );
        }
        if file.bucket_seconds != config.bucket_seconds() || file.buckets != BUCKETS {
            return (
                store,
                Some(format!(
                    "{} holds {}s buckets, --rightsize-window now asks for {}s; starting with empty windows",
                    path.display(),
                    file.bucket_seconds,
                    config.bucket_seconds()
                )),
            );
        }
        store.windows = file
            .windows
            .into_iter()
            .map(|e| (e.key, e.window))
            .collect();
        (store, None)
    }

    /// The configuration.
    pub fn config(&self) -> &WindowConfig {
        &self.config
    }

    /// Adds one round taken at `unix_seconds`; the windows of claim devices not in the
    /// round (unprepared) are dropped. `devices` lists the prepared claim devices even when
    /// a round has no sample of them.
    pub fn observe(
        &mut self,
        unix_seconds: u64,
        devices: &[ClaimDevice],
        samples: &[DeviceSample],
    ) {
        let live: BTreeSet<WindowKey> = devices.iter().map(WindowKey::of).collect();
        let before = self.windows.len();
        self.windows.retain(|k, _| live.contains(k));
        if self.windows.len() != before {
            self.urgent = true;
        }
        for s in samples {
            let w = self.windows.entry(WindowKey::of(&s.device)).or_default();
            if w.observe(&self.config, unix_seconds, s) {
                self.urgent = true;
            }
            self.dirty = true;
        }
    }

    /// The statistics of `key` at `unix_seconds` (empty when it has no window).
    pub fn stats(&self, key: &WindowKey, unix_seconds: u64) -> WindowStats {
        self.windows.get(key).map_or_else(
            || WindowStats {
                bucket_seconds: self.config.bucket_seconds(),
                ..WindowStats::default()
            },
            |w| w.stats(&self.config, unix_seconds),
        )
    }

    /// Number of windows held.
    pub fn len(&self) -> usize {
        self.windows.len()
    }

    /// True when no window is held.
    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }

    /// Bytes the windows hold (for the bench).
    pub fn heap_bytes(&self) -> usize {
        self.windows
            .iter()
            .map(|(k, w)| {
                std::mem::size_of::<WindowKey>()
                    + k.claim_uid.capacity()
                    + k.device.capacity()
                    + k.share.capacity()
                    + w.heap_bytes()
            })
            .sum()
    }

    /// Writes the state file when something must reach it (a dropped claim, a closed
    /// bucket) or [`WRITE_EVERY_SECONDS`] passed since the last write with changes;
    /// `force` writes whatever changed (at shutdown). Returns whether it wrote.
    pub fn persist(&mut self, unix_seconds: u64, force: bool) -> Result<bool, RightsizeError> {
        let Some(path) = self.path.clone() else {
            return Ok(false);
        };
        let due = self.urgent
            || (self.dirty
                && (force
                    || self
                        .last_write
                        .is_none_or(|t| unix_seconds.saturating_sub(t) >= WRITE_EVERY_SECONDS)));
        if !due {
            return Ok(false);
        }
        for w in self.windows.values_mut() {
            w.expire(&self.config, unix_seconds);
        }
        let file = StateFile {
            version: STATE_VERSION,
            bucket_seconds: self.config.bucket_seconds(),
            buckets: BUCKETS,
            windows: self
                .windows
                .iter()
                .map(|(k, w)| Entry {
                    key: k.clone(),
                    window: w.clone(),
                })
                .collect(),
        };
        let bytes = serde_json::to_vec(&file)?;
        crate::checkpoint::write_file_atomic_mode(&path, &bytes, 0o600)
            .map_err(|source| RightsizeError::Write { path, source })?;
        self.last_write = Some(unix_seconds);
        self.urgent = false;
        self.dirty = false;
        Ok(true)
    }
}

#[cfg(test)]
mod tests;
