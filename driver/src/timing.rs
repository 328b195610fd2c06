//! Timing of the driver's steps (MIG create/destroy, CDI write, checkpoint write, sharing
//! apply): each is logged at debug level with `elapsed_ms` and handed to a process-wide
//! observer, which the plugin points at its Prometheus histogram.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Receives `(step, elapsed)` for every finished step.
pub(crate) type StepObserver = Box<dyn Fn(&'static str, Duration) + Send + Sync>;

static OBSERVER: OnceLock<StepObserver> = OnceLock::new();

/// Installs the observer; only the first call of a process takes effect (returns false
/// otherwise).
pub fn set_observer(observer: StepObserver) -> bool {
    OBSERVER.set(observer).is_ok()
}

/// Step names.
pub mod step {
    /// Creating an on-demand MIG instance.
    pub const MIG_CREATE: &str = "mig_create";
    /// Destroying a MIG instance cleave created.
    pub const MIG_DESTROY: &str = "mig_destroy";
    /// Writing a claim's CDI spec.
    pub const CDI_WRITE: &str = "cdi_write";
    /// Writing the checkpoint.
    pub(crate) const CHECKPOINT_WRITE: &str = "checkpoint_write";
    /// Applying sharing (MPS, time-slicing).
    pub const SHARING_APPLY: &str = "sharing_apply";
}

/// Records that `step`, started at `started`, finished successfully.
pub fn record(step: &'static str, started: Instant) {
    let elapsed = started.elapsed();
    tracing::debug!(step, elapsed_ms = elapsed.as_secs_f64() * 1e3, "step done");
    if let Some(o) = OBSERVER.get() {
        o(step, elapsed);
    }
}

/// Runs `f`, recording `step` if it succeeds.
pub fn timed<T, E>(step: &'static str, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    let started = Instant::now();
    let r = f();
    if r.is_ok() {
        record(step, started);
    }
    r
}
