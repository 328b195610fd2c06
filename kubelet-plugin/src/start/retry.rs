//! Waiting at start: retries with backoff while the NVIDIA driver is not ready or the
//! checkpoint unreadable, telling `/readyz`, the log, the metrics and the Node's Events why.

use std::sync::Arc;
use std::time::Duration;

use cleave_controller::backoff::{Backoff, BackoffConfig};
use cleave_driver::backend::GpuBackend;
use tokio::sync::watch;
use tracing::{info, warn};

use super::driver::open_backend;
use super::{RunningPlugin, StartError, start_with_backend};
use crate::args::RunArgs;
use crate::k8s::events::{EventReporter, Severity, StartNode};
use crate::metrics::Metrics;
use crate::node::lifecycle::reset_command;

/// Event reason: the checkpoint cannot be read.
pub(crate) const REASON_CHECKPOINT_UNREADABLE: &str = "CheckpointUnreadable";

/// Event reason: NVML cannot be loaded, sees no GPU, or the driver root holds no driver.
pub(crate) const REASON_DRIVER_NOT_READY: &str = "NVIDIADriverNotReady";

/// Why the plugin is not ready yet (None: nothing blocks start-up); `/readyz` shows it.
pub(crate) type Blocker = watch::Sender<Option<String>>;

/// What [`start_when_possible`] reports to.
#[derive(Clone)]
pub(crate) struct StartContext {
    /// The kube client (Events, claims, slices).
    pub client: kube::Client,
    /// Metrics, when served.
    pub metrics: Option<Arc<Metrics>>,
    /// Not-ready reason for `/readyz`.
    pub blocker: Arc<Blocker>,
    /// Events about the Node.
    pub events: EventReporter,
    /// The Node as read once at start.
    pub node: StartNode,
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
pub(crate) async fn start_when_possible(
    args: &RunArgs,
    ctx: &StartContext,
) -> Result<RunningPlugin, StartError> {
    let max = Duration::from_millis(args.lifecycle.retry_max_ms);
    let mut backoff = Backoff::new(BackoffConfig {
        initial: Duration::from_millis(args.lifecycle.retry_initial_ms).min(max),
        max,
        conflict_retries: 0,
    });
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
                    args.nvml.sysfs_root.clone(),
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
                    Err(e) if e.is_retried() => {
                        if let Some(m) = lm {
                            m.nvml_available.set(0);
                        }
                        let reason = e.chain();
                        let delay = backoff.next_delay();
                        warn!(reason = %reason, retry_in_ms = delay.as_millis() as u64, "waiting for the NVIDIA driver; not registering or publishing");
                        driver_not_ready_event(ctx, &reason, &mut last_driver_reason).await;
                        ctx.blocker.send_replace(Some(reason));
                        tokio::time::sleep(delay).await;
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        match start_with_backend(args, ctx.client.clone(), ctx.metrics.clone(), b, &ctx.node).await
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
                let StartError::CheckpointUnreadable { reason, error } = e else {
                    return Err(e);
                };
                if let Some(m) = lm {
                    m.checkpoint_healthy.set(0);
                    m.checkpoint_errors.inc();
                }
                let command = reset_command(
                    &args.kubelet.kubelet_plugins_directory_path,
                    &args.kubelet.driver_name,
                );
                let delay = backoff.next_delay();
                warn!(error = %error, recovery = %command, retry_in_ms = delay.as_millis() as u64, "checkpoint unreadable; not registering, not serving prepares, retrying");
                if last_checkpoint_reason.as_deref() != Some(reason.as_str()) {
                    let node = ctx.node.reference(&ctx.client).await;
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
    ctx: &StartContext,
    reason: &str,
    last: &mut Option<String>,
) {
    if last.as_deref() == Some(reason) {
        return;
    }
    let node = ctx.node.reference(&ctx.client).await;
    let note = format!(
        "{reason} (the plugin stays not ready and publishes no device until this is fixed; it looks again with backoff)"
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
