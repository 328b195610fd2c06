//! Start-up that waits instead of crashing: a late NVIDIA driver, an unreadable checkpoint.
//!
//! `run` serves `/healthz`, `/readyz` and `/metrics` first, then calls
//! [`start_when_possible`], which retries with a bounded exponential backoff
//! (`--retry-initial-ms` .. `--retry-max-ms`, default 1 s .. 30 s) while:
//! - NVML cannot be loaded or initialised, or finds no GPU (the driver is not installed
//!   yet). Zero GPUs counts as "driver not ready" unless `--allow-no-gpus` (a node that has
//!   the library but no GPU then publishes an empty pool);
//! - the checkpoint cannot be read (corrupt, bad checksum, unknown layout version, I/O
//!   error). The plugin never resets it by itself, since pods may still use its claims: it
//!   logs the path and reason, sets `cleave_kubelet_plugin_checkpoint_healthy` to 0, counts
//!   `cleave_kubelet_plugin_checkpoint_errors_total`, posts a Warning Event
//!   `CheckpointUnreadable` on the Node naming the one recovery command
//!   (`cleave-kubelet-plugin checkpoint reset`, see [`reset_checkpoint`]), and reads the file
//!   again on every retry, so an operator's fix is picked up without a restart.
//!
//! Meanwhile nothing is registered with the kubelet (no prepare can arrive), no slice is
//! published (an empty pool would tell the scheduler the node has no GPUs), `/readyz`
//! answers 503 with the reason, and `/healthz` stays 200 (the process works; a restart would
//! not help).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use cleave_driver::backend::GpuBackend;
use cleave_driver::checkpoint::{CHECKPOINT_FILE, CheckpointError, decode};
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::prepare::PrepareError;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::cli::RunArgs;
use crate::daemon::RunningPlugin;
use crate::events::{EventReporter, Severity};
use crate::metrics::Metrics;

/// Event reason: the checkpoint cannot be read.
pub const REASON_CHECKPOINT_UNREADABLE: &str = "CheckpointUnreadable";
/// Event reason: NVML cannot be loaded, sees no GPU, or the driver root holds no driver.
pub const REASON_DRIVER_NOT_READY: &str = "NVIDIADriverNotReady";

/// The recovery command, as printed in logs and Events.
pub fn reset_command(plugins_dir: &Path, driver_name: &str) -> String {
    format!(
        "cleave-kubelet-plugin checkpoint reset --plugins-dir {} --driver-name {driver_name}",
        plugins_dir.display()
    )
}

/// A bounded exponential backoff: `initial`, doubled per failure, at most `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// Starts at `initial`; never waits longer than `max`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        let initial = initial.min(max);
        Self {
            initial,
            max,
            next: initial,
        }
    }

    /// The wait before the next attempt (and doubles the one after).
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }

    /// Back to `initial` (after a success).
    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

/// Start-up metrics (registered into the plugin's registry by [`Metrics::new`]).
#[derive(Debug, Default)]
pub struct LifecycleMetrics {
    /// 1 when NVML loaded and found GPUs (or `--allow-no-gpus`).
    pub nvml_available: Gauge,
    /// 0 while the checkpoint cannot be read.
    pub checkpoint_healthy: Gauge,
    /// Failed checkpoint reads at start.
    pub checkpoint_errors: Counter,
}

impl LifecycleMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        m.checkpoint_healthy.set(1);
        registry.register(
            "nvml_available",
            "1 when NVML loaded and found GPUs; 0 while waiting for the NVIDIA driver",
            m.nvml_available.clone(),
        );
        registry.register(
            "checkpoint_healthy",
            "0 while the checkpoint file cannot be read (see the CheckpointUnreadable Event)",
            m.checkpoint_healthy.clone(),
        );
        registry.register(
            "checkpoint_errors",
            "Failed reads of the checkpoint file at start",
            m.checkpoint_errors.clone(),
        );
        m
    }
}

/// Liveness: the time of the last beat of the runtime's heartbeat task.
#[derive(Debug)]
pub struct Heartbeat {
    origin: Instant,
    last_ms: AtomicU64,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }
}

impl Heartbeat {
    /// Records a beat now.
    pub fn beat(&self) {
        let ms = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// Time since the last beat.
    pub fn age(&self) -> Duration {
        let now = self.origin.elapsed();
        now.saturating_sub(Duration::from_millis(self.last_ms.load(Ordering::Relaxed)))
    }

    /// Beats every second on the current runtime until the task is aborted; a runtime whose
    /// workers are all blocked stops beating, and `/healthz` then fails.
    pub fn spawn(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                me.beat();
            }
        })
    }
}

/// Why the plugin is not ready yet (None: nothing blocks start-up); `/readyz` shows it.
pub type Blocker = watch::Sender<Option<String>>;

/// The checkpoint error inside a start failure, if that is what failed.
pub fn checkpoint_error(e: &anyhow::Error) -> Option<&CheckpointError> {
    e.chain().find_map(|c| {
        c.downcast_ref::<CheckpointError>().or_else(|| {
            c.downcast_ref::<PrepareError>().and_then(|p| match p {
                PrepareError::Checkpoint(ce) => Some(ce),
                _ => None,
            })
        })
    })
}

/// The path and what is wrong, without the long recovery text of the error's message.
fn short_reason(e: &CheckpointError) -> String {
    match e {
        CheckpointError::Corrupt { path, reason } => {
            format!("{} is corrupt: {reason}", path.display())
        }
        CheckpointError::UnsupportedVersion { path, version } => format!(
            "{} has layout version {version}, this release reads up to {}",
            path.display(),
            cleave_driver::checkpoint::FORMAT_VERSION
        ),
        CheckpointError::Read { path, source } => {
            format!("{} cannot be read: {source}", path.display())
        }
        other => other.to_string(),
    }
}

/// Loads NVML for the driver under `driver_root` (the root's libraries first, then the
/// system's, or `nvml_lib` when given) and checks it sees GPUs; the error says why the
/// driver is not usable yet, naming every library path tried.
pub async fn open_backend(
    driver_root: PathBuf,
    nvml_lib: Option<PathBuf>,
    allow_no_gpus: bool,
) -> anyhow::Result<Arc<dyn GpuBackend>> {
    tokio::task::spawn_blocking(move || -> anyhow::Result<Arc<dyn GpuBackend>> {
        let backend = NvmlBackend::open_in_driver_root(&driver_root, nvml_lib.as_deref())
            .context("loading NVML")?;
        let inventory = backend.inventory().context("listing GPUs through NVML")?;
        if inventory.gpus.is_empty() && !allow_no_gpus {
            anyhow::bail!(
                "NVML found no GPU (driver not ready, or a node without GPUs: then pass --allow-no-gpus)"
            );
        }
        Ok(Arc::new(backend))
    })
    .await?
}

/// What [`start_when_possible`] reports to.
#[derive(Clone)]
pub struct StartContext {
    /// The kube client (Events, claims, slices).
    pub client: kube::Client,
    /// Metrics, when served.
    pub metrics: Option<Arc<Metrics>>,
    /// Not-ready reason for `/readyz`.
    pub blocker: Arc<Blocker>,
    /// Events about the Node.
    pub events: EventReporter,
}

impl std::fmt::Debug for StartContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StartContext")
            .field("blocker", &*self.blocker.borrow())
            .finish_non_exhaustive()
    }
}

/// Starts the plugin, retrying with backoff while the NVIDIA driver is missing or the
/// checkpoint unreadable; other start errors are returned.
pub async fn start_when_possible(
    args: &RunArgs,
    ctx: &StartContext,
) -> anyhow::Result<RunningPlugin> {
    let mut backoff = Backoff::new(
        Duration::from_millis(args.lifecycle.retry_initial_ms),
        Duration::from_millis(args.lifecycle.retry_max_ms),
    );
    let lm = ctx.metrics.as_ref().map(|m| &m.lifecycle);
    let mut backend: Option<Arc<dyn GpuBackend>> = None;
    let mut last_checkpoint_reason: Option<String> = None;
    let mut last_driver_reason: Option<String> = None;
    loop {
        let b = match &backend {
            Some(b) => Arc::clone(b),
            None => {
                match open_backend(
                    args.driver.driver_root.clone(),
                    args.nvml.nvml_lib.clone(),
                    args.lifecycle.allow_no_gpus,
                )
                .await
                {
                    Ok(b) => {
                        info!("NVML loaded");
                        if let Some(m) = lm {
                            m.nvml_available.set(1);
                        }
                        backoff.reset();
                        backend = Some(Arc::clone(&b));
                        b
                    }
                    Err(e) => {
                        if let Some(m) = lm {
                            m.nvml_available.set(0);
                        }
                        let reason = format!("NVIDIA driver not ready: {e:#}");
                        let delay = backoff.next_delay();
                        warn!(reason = %reason, retry_in_ms = delay.as_millis() as u64, "waiting for the NVIDIA driver; not registering or publishing");
                        driver_not_ready_event(args, ctx, &reason, &mut last_driver_reason).await;
                        ctx.blocker.send_replace(Some(reason));
                        tokio::time::sleep(delay).await;
                        continue;
                    }
                }
            }
        };
        match crate::daemon::start_with_backend(args, ctx.client.clone(), ctx.metrics.clone(), b)
            .await
        {
            Ok(p) => {
                if let Some(m) = lm {
                    m.checkpoint_healthy.set(1);
                }
                if last_checkpoint_reason.is_some() {
                    info!("checkpoint readable again");
                }
                ctx.blocker.send_replace(None);
                return Ok(p);
            }
            Err(e) => {
                let Some(ce) = checkpoint_error(&e) else {
                    return Err(e);
                };
                let reason = short_reason(ce);
                if let Some(m) = lm {
                    m.checkpoint_healthy.set(0);
                    m.checkpoint_errors.inc();
                }
                let command = reset_command(
                    &args.kubelet.kubelet_plugins_directory_path,
                    &args.kubelet.driver_name,
                );
                let delay = backoff.next_delay();
                warn!(error = %ce, recovery = %command, retry_in_ms = delay.as_millis() as u64, "checkpoint unreadable; not registering, not serving prepares, retrying");
                if last_checkpoint_reason.as_deref() != Some(reason.as_str()) {
                    let node = crate::events::node_reference(&ctx.client, &args.node_name).await;
                    let note = format!(
                        "checkpoint {reason}. Recovery, after making sure no pod on this node uses a claim of this driver: {command} (the plugin stays not ready and picks the fix up on its next retry)"
                    );
                    ctx.events
                        .publish(
                            &node,
                            Severity::Warning,
                            REASON_CHECKPOINT_UNREADABLE,
                            "Start",
                            &note,
                        )
                        .await;
                    last_checkpoint_reason = Some(reason.clone());
                }
                ctx.blocker
                    .send_replace(Some(format!("checkpoint unreadable: {reason}")));
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Posts a Warning Event on the Node for a driver-not-ready reason, once per distinct
/// reason (a retry loop must not flood the Node's events).
pub(crate) async fn driver_not_ready_event(
    args: &RunArgs,
    ctx: &StartContext,
    reason: &str,
    last: &mut Option<String>,
) {
    if last.as_deref() == Some(reason) {
        return;
    }
    let node = crate::events::node_reference(&ctx.client, &args.node_name).await;
    let note = format!(
        "{reason} (the plugin stays not ready, registers nothing and retries with backoff)"
    );
    ctx.events
        .publish(
            &node,
            Severity::Warning,
            REASON_DRIVER_NOT_READY,
            "Start",
            &note,
        )
        .await;
    *last = Some(reason.to_owned());
}

/// What [`reset_checkpoint`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResetOutcome {
    /// No checkpoint file: nothing to do.
    Missing,
    /// The file was moved to `moved_to`.
    MovedAside {
        /// The new name, `checkpoint.json.corrupt-<unix seconds>`.
        moved_to: PathBuf,
        /// What the file held when it could be decoded (claims), else the decode error.
        held: String,
    },
}

/// `checkpoint reset`: moves `<state_dir>/checkpoint.json` aside to
/// `checkpoint.json.corrupt-<unix seconds>` so the plugin starts with no prepared claims.
pub fn reset_checkpoint(state_dir: &Path) -> anyhow::Result<ResetOutcome> {
    let path = state_dir.join(CHECKPOINT_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(ResetOutcome::Missing),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let held = match decode(&path, &bytes) {
        Ok(data) => {
            let mut s = format!("{} claim(s), boot ID {:?}", data.claims.len(), data.boot_id);
            for c in data.claims.values() {
                let devices: Vec<&str> = c.devices.iter().map(|d| d.name.as_str()).collect();
                s.push_str(&format!(
                    "\n  claim {}/{} uid {} state {:?} devices {}",
                    c.namespace,
                    c.name,
                    c.uid,
                    c.state,
                    devices.join(",")
                ));
            }
            s
        }
        Err(e) => format!("unreadable: {e}"),
    };
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut moved_to = state_dir.join(format!("{CHECKPOINT_FILE}.corrupt-{secs}"));
    let mut n = 1;
    while moved_to.exists() {
        moved_to = state_dir.join(format!("{CHECKPOINT_FILE}.corrupt-{secs}-{n}"));
        n += 1;
    }
    std::fs::rename(&path, &moved_to)
        .with_context(|| format!("moving {} to {}", path.display(), moved_to.display()))?;
    if let Ok(dir) = std::fs::File::open(state_dir) {
        let _ = dir.sync_all();
    }
    Ok(ResetOutcome::MovedAside { moved_to, held })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_bound_and_resets() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        let got: Vec<u64> = (0..7).map(|_| b.next_delay().as_secs()).collect();
        assert_eq!(got, [1, 2, 4, 8, 16, 30, 30]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_secs(1));
    }

    #[test]
    fn reset_moves_a_damaged_file_aside_and_says_what_it_held() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(reset_checkpoint(dir.path()).unwrap(), ResetOutcome::Missing);
        std::fs::write(dir.path().join(CHECKPOINT_FILE), b"{not json").unwrap();
        let ResetOutcome::MovedAside { moved_to, held } = reset_checkpoint(dir.path()).unwrap()
        else {
            panic!("not moved")
        };
        assert!(held.starts_with("unreadable:"), "{held}");
        assert!(!dir.path().join(CHECKPOINT_FILE).exists());
        assert_eq!(std::fs::read(&moved_to).unwrap(), b"{not json");
        let name = moved_to.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("checkpoint.json.corrupt-"), "{name}");
    }

    #[test]
    fn reset_prints_the_claims_of_a_readable_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = cleave_driver::checkpoint::CheckpointStore::in_dir(dir.path());
        let mut data = cleave_driver::checkpoint::CheckpointData::default();
        data.claims.insert(
            "u1".into(),
            cleave_driver::checkpoint::ClaimRecord {
                uid: "u1".into(),
                namespace: "ns".into(),
                name: "c".into(),
                state: cleave_driver::checkpoint::ClaimState::Prepared,
                devices: vec![],
                sharing: None,
            },
        );
        store.store(&data).unwrap();
        let ResetOutcome::MovedAside { held, .. } = reset_checkpoint(dir.path()).unwrap() else {
            panic!("not moved")
        };
        assert!(held.contains("claim ns/c uid u1 state Prepared"), "{held}");
    }

    #[test]
    fn short_reasons_name_the_path_without_the_recovery_text() {
        let e = CheckpointError::UnsupportedVersion {
            path: "/s/checkpoint.json".into(),
            version: 7,
        };
        let r = short_reason(&e);
        assert_eq!(
            r,
            "/s/checkpoint.json has layout version 7, this release reads up to 1"
        );
        assert!(!r.contains("mv "), "{r}");
    }

    #[test]
    fn checkpoint_errors_are_found_through_context() {
        let ce = CheckpointError::Corrupt {
            path: "/x/checkpoint.json".into(),
            reason: "bad".into(),
        };
        let e = anyhow::Error::from(PrepareError::from(ce)).context("starting the node driver");
        assert!(checkpoint_error(&e).is_some());
        assert!(checkpoint_error(&anyhow::anyhow!("other")).is_none());
    }
}
