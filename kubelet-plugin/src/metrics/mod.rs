//! Prometheus metrics and the health endpoints (`/metrics`, `/healthz`, `/readyz`) on
//! `--metrics-addr`.
//!
//! `/healthz` (liveness) answers 200 while the process serves HTTP and the runtime's
//! heartbeat task beat within [`HEARTBEAT_STALE`] (503 otherwise: a runtime that stopped
//! scheduling tasks). It stays 200 while start-up waits for the NVIDIA driver or a readable
//! checkpoint, because a restart would not help. `/readyz` answers 200 only when nothing
//! blocks start-up (the start module), the kubelet confirmed the registration
//! (NotifyRegistrationStatus registered=true) and the node's ResourceSlices were published
//! at least once; 503 with the reason before, so a rolling update waits for the new pod to
//! be useful.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Response, StatusCode};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tracing::warn;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use cleave_driver::health::HealthEvent;

use crate::kubelet::dra::DraObserver;
use crate::kubelet::registration::RegistrationState;
use crate::node::device_health::DeviceHealthObserver;

pub(crate) mod auth;
pub(crate) mod observability;
pub(crate) mod server;
use crate::node::usage::{metrics as usage, rightsize_metrics as rightsize};

/// `/healthz` fails when the heartbeat is older than this.
pub(crate) const HEARTBEAT_STALE: Duration = Duration::from_secs(30);

/// Labels of per-claim results.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ClaimLabels {
    /// `prepare` or `unprepare`.
    pub operation: &'static str,
    /// `ok` or `error`.
    pub result: &'static str,
}

/// Labels of gRPC batch durations.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OperationLabels {
    /// `prepare` or `unprepare`.
    pub operation: &'static str,
}

fn duration_histogram() -> Histogram {
    // 0.5 ms .. ~16 s.
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// The plugin's metrics, prefixed `cleave_kubelet_plugin_`.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    claims: Family<ClaimLabels, Counter>,
    durations: Family<OperationLabels, Histogram, fn() -> Histogram>,
    registered: Gauge,
    slices_published: Gauge,
    devices_withheld: Gauge,
    /// Device health events and unhealthy devices (reported through [`DeviceHealthObserver`]).
    pub(crate) health: DeviceHealthMetrics,
    /// Call latency by result, API requests, published devices (see [`observability`]).
    pub(crate) observability: observability::ObservabilityMetrics,
    /// Start-up state: NVML availability, checkpoint health (set by start-up).
    pub(crate) lifecycle: LifecycleMetrics,
    /// Per-claim usage, written by the usage monitor after each round (see [`usage`]).
    pub usage: Arc<usage::UsageMetrics>,
    /// Usage windows and recommendations (see [`rightsize`]).
    pub rightsize: Arc<rightsize::RightsizeMetrics>,
    /// Claim `status.devices` writes by result (see `crate::k8s::claim_status`).
    pub(crate) claim_status: StatusWriteMetrics,
    /// The metrics server's open and refused connections (see [`server`]).
    pub(crate) server: server::ServerMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers all metrics.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("cleave_kubelet_plugin");
        let claims = Family::<ClaimLabels, Counter>::default();
        registry.register(
            "claims",
            "Claims handled by NodePrepareResources / NodeUnprepareResources, by result",
            claims.clone(),
        );
        let durations: Family<OperationLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(duration_histogram);
        registry.register(
            "request_duration_seconds",
            "Duration of NodePrepareResources / NodeUnprepareResources calls",
            durations.clone(),
        );
        let registered = Gauge::default();
        registry.register(
            "registered",
            "1 when the kubelet accepted the plugin's registration",
            registered.clone(),
        );
        let slices_published = Gauge::default();
        registry.register(
            "slices_published",
            "ResourceSlices of this node as last published (0 before the first publish)",
            slices_published.clone(),
        );
        let devices_withheld = Gauge::default();
        registry.register(
            "devices_withheld",
            "Devices not published because the API server drops shared counters (feature gate DRAPartitionableDevices off); 0 normally",
            devices_withheld.clone(),
        );
        let health = DeviceHealthMetrics::register(&mut registry);
        let observability = observability::ObservabilityMetrics::register(&mut registry);
        let lifecycle = LifecycleMetrics::register(&mut registry);
        let usage = Arc::new(usage::UsageMetrics::register(&mut registry));
        let rightsize = Arc::new(rightsize::RightsizeMetrics::register(&mut registry));
        let claim_status = StatusWriteMetrics::register(&mut registry);
        let server = server::ServerMetrics::register(&mut registry);
        Self {
            registry,
            claims,
            durations,
            registered,
            slices_published,
            devices_withheld,
            health,
            observability,
            lifecycle,
            usage,
            rightsize,
            claim_status,
            server,
        }
    }

    /// Labels the per-claim usage and right-sizing series by claim UID only (`namespace`
    /// empty, `claim` the UID), so that a scrape lists no tenant names.
    pub(crate) fn set_claim_labels(&self, mode: crate::args::ClaimLabelMode) {
        let uid_only = mode == crate::args::ClaimLabelMode::UidOnly;
        self.usage.set_uid_only(uid_only);
        self.rightsize.set_uid_only(uid_only);
    }

    /// Records one gRPC batch: its duration and each claim's result.
    pub(crate) fn record_batch(
        &self,
        operation: &'static str,
        elapsed: Duration,
        ok: usize,
        failed: usize,
    ) {
        self.durations
            .get_or_create(&OperationLabels { operation })
            .observe(elapsed.as_secs_f64());
        self.observability.observe_call(operation, elapsed, failed);
        for (result, n) in [("ok", ok), ("error", failed)] {
            if n > 0 {
                self.claims
                    .get_or_create(&ClaimLabels { operation, result })
                    .inc_by(n as u64);
            }
        }
    }

    /// Sets the registration gauge.
    pub(crate) fn set_registered(&self, registered: bool) {
        self.registered.set(i64::from(registered));
    }

    /// Sets the published-slices gauge.
    pub(crate) fn set_slices_published(&self, slices: usize) {
        self.slices_published
            .set(i64::try_from(slices).unwrap_or(i64::MAX));
    }

    /// Sets the withheld-devices gauge.
    pub(crate) fn set_devices_withheld(&self, devices: usize) {
        self.devices_withheld
            .set(i64::try_from(devices).unwrap_or(i64::MAX));
    }

    /// The metrics in Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            warn!(error = %e, "encoding metrics");
        }
        out
    }
}

/// What the probe endpoints (`/healthz` liveness, `/readyz` readiness) and `/metrics` look at.
#[derive(Debug, Clone)]
pub(crate) struct ProbeState {
    /// The metrics to serve.
    pub metrics: Arc<Metrics>,
    /// The kubelet's registration verdicts.
    pub registration: watch::Receiver<RegistrationState>,
    /// True once the node's slices were published at least once.
    pub published: watch::Receiver<bool>,
    /// What blocks start-up (missing NVIDIA driver, unreadable checkpoint); None: nothing.
    pub blocker: watch::Receiver<Option<String>>,
    /// What a ready plugin does not serve and why (devices withheld because the API server
    /// drops counters); shown in the `/readyz` body, which stays 200.
    pub degraded: watch::Receiver<Option<String>>,
    /// Beats while the runtime schedules tasks.
    pub heartbeat: Arc<Heartbeat>,
    /// Reviews `/metrics` scrapes (`--metrics-auth=kubernetes`); None: open.
    pub auth: Option<Arc<auth::ScrapeAuth>>,
}

fn respond(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r
}

fn handle(state: &ProbeState, path: &str) -> Response<Full<Bytes>> {
    match path {
        "/healthz" => {
            let age = state.heartbeat.age();
            if age <= HEARTBEAT_STALE {
                respond(StatusCode::OK, "ok\n".into())
            } else {
                respond(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("unhealthy: runtime heartbeat {} s old\n", age.as_secs()),
                )
            }
        }
        "/readyz" => {
            let published = *state.published.borrow();
            let registration = state.registration.borrow().clone();
            let blocker = state.blocker.borrow().clone();
            let unavailable = |why: String| {
                respond(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("not ready: {why}\n"),
                )
            };
            if let Some(why) = blocker {
                unavailable(why)
            } else if registration != RegistrationState::Registered {
                unavailable(format!(
                    "the kubelet has not confirmed the registration (registration: {registration:?})"
                ))
            } else if !published {
                unavailable("ResourceSlices not published yet".into())
            } else {
                let mut body = format!("ready (registration: {registration:?})\n");
                if let Some(why) = state.degraded.borrow().as_deref() {
                    body.push_str(&format!("degraded: {why}\n"));
                }
                respond(StatusCode::OK, body)
            }
        }
        "/metrics" => {
            let mut r = respond(StatusCode::OK, state.metrics.encode());
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            r
        }
        _ => respond(StatusCode::NOT_FOUND, "not found\n".into()),
    }
}

/// Binds `addr` and serves the endpoints within `limits` in a background task.
pub(crate) async fn start(
    addr: SocketAddr,
    state: ProbeState,
    limits: server::ServerLimits,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((local, tokio::spawn(server::serve(listener, state, limits))))
}

impl DraObserver for Metrics {
    fn batch_done(
        &self,
        operation: &'static str,
        elapsed: Duration,
        succeeded: usize,
        failed: usize,
    ) {
        self.record_batch(operation, elapsed, succeeded, failed);
    }
}

impl DeviceHealthObserver for Metrics {
    fn health_event(&self, event: &HealthEvent) {
        self.health.record_event(event);
    }
    fn unhealthy_devices(&self, count: usize) {
        self.health.set_unhealthy(count);
    }
}

/// `claim_status_writes_total{result}`: finished status writes by result.
#[derive(Debug, Clone, Default)]
pub(crate) struct StatusWriteMetrics {
    writes: prometheus_client::metrics::family::Family<
        StatusWriteLabels,
        prometheus_client::metrics::counter::Counter,
    >,
}

/// Labels of `claim_status_writes_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub(crate) struct StatusWriteLabels {
    /// `ok`, `unchanged`, `gone`, `retry` or `failed`.
    pub result: &'static str,
}

impl StatusWriteMetrics {
    /// Creates the family and registers it.
    pub(crate) fn register(registry: &mut prometheus_client::registry::Registry) -> Self {
        let m = Self::default();
        registry.register(
            "claim_status_writes",
            "Writes of claims' status.devices entries by result (retry: a failed try that is retried; failed: given up, the claim stays prepared)",
            m.writes.clone(),
        );
        m
    }
}

impl crate::k8s::kube_handler::PrepareObserver for Metrics {
    fn prepared(&self, summary: &cleave_driver::prepare::CheckpointSummary) {
        self.observability.set_prepared(summary);
    }
    fn refused(&self, refusal: cleave_driver::prepare::Refusal) {
        self.observability.count_refusal(refusal);
    }
}

impl crate::k8s::claim_status::StatusObserver for Metrics {
    fn status_write(&self, result: &'static str) {
        self.claim_status
            .writes
            .get_or_create(&StatusWriteLabels { result })
            .inc();
    }
}

/// Health metrics, registered into the plugin's registry by [`Metrics::new`].
#[derive(Debug, Clone, Default)]
pub(crate) struct DeviceHealthMetrics {
    events: Family<HealthEventLabels, Counter>,
    unhealthy: Gauge,
}

/// Labels of `health_events_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct HealthEventLabels {
    /// `xid`, `ecc-dbe`, `gpu-lost` or `recovered`.
    pub kind: &'static str,
    /// The Xid number; empty for other kinds.
    pub xid: String,
    /// `true` if the event marks devices unhealthy.
    pub fatal: &'static str,
}

impl DeviceHealthMetrics {
    /// Registers `health_events` (counter by kind, Xid and fatality) and
    /// `devices_unhealthy` (gauge) in `registry`.
    pub(crate) fn register(registry: &mut prometheus_client::registry::Registry) -> Self {
        let m = Self::default();
        registry.register(
            "health_events",
            "Device health events from NVML (Xid, double-bit ECC, lost and recovered GPUs)",
            m.events.clone(),
        );
        registry.register(
            "devices_unhealthy",
            "Published devices currently marked unhealthy",
            m.unhealthy.clone(),
        );
        m
    }

    /// Counts one event.
    pub(crate) fn record_event(&self, event: &HealthEvent) {
        self.events
            .get_or_create(&HealthEventLabels {
                kind: event.kind.as_str(),
                xid: event.xid.map(|x| x.to_string()).unwrap_or_default(),
                fatal: if event.fatal { "true" } else { "false" },
            })
            .inc();
    }

    /// Sets the unhealthy-devices gauge.
    pub(crate) fn set_unhealthy(&self, n: usize) {
        self.unhealthy.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

/// Start-up metrics (registered into the plugin's registry by [`Metrics::new`]).
#[derive(Debug, Default)]
pub(crate) struct LifecycleMetrics {
    /// 1 when NVML loaded and found GPUs (or `--allow-no-gpus`).
    pub nvml_available: Gauge,
    /// 0 while the checkpoint cannot be read.
    pub checkpoint_healthy: Gauge,
    /// Failed checkpoint reads at start.
    pub checkpoint_errors: Counter,
}

impl LifecycleMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub(crate) fn register(registry: &mut Registry) -> Self {
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
pub(crate) struct Heartbeat {
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
    pub(crate) fn beat(&self) {
        let ms = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// Time since the last beat.
    pub(crate) fn age(&self) -> Duration {
        let now = self.origin.elapsed();
        now.saturating_sub(Duration::from_millis(self.last_ms.load(Ordering::Relaxed)))
    }

    /// Beats every second on the current runtime until the task is aborted; a runtime whose
    /// workers are all blocked stops beating, and `/healthz` then fails.
    pub(crate) fn spawn(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_encode_batches() {
        let m = Metrics::new();
        m.record_batch("prepare", Duration::from_millis(3), 2, 1);
        m.set_registered(true);
        m.set_slices_published(4);
        let text = m.encode();
        assert!(
            text.contains(
                r#"cleave_kubelet_plugin_claims_total{operation="prepare",result="ok"} 2"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"cleave_kubelet_plugin_claims_total{operation="prepare",result="error"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "cleave_kubelet_plugin_request_duration_seconds_count{operation=\"prepare\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("cleave_kubelet_plugin_registered 1"),
            "{text}"
        );
        assert!(
            text.contains("cleave_kubelet_plugin_slices_published 4"),
            "{text}"
        );
    }

    fn body(r: Response<Full<Bytes>>) -> String {
        use http_body_util::BodyExt as _;
        let bytes = futures_executor_block_on(r.into_body().collect())
            .unwrap()
            .to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    fn futures_executor_block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn readyz_waits_for_start_registration_and_publish() {
        let (reg_tx, registration) = watch::channel(RegistrationState::Pending);
        let (pub_tx, published) = watch::channel(false);
        let (block_tx, blocker) = watch::channel(Some("NVIDIA driver not ready: x".to_owned()));
        let heartbeat = Arc::new(Heartbeat::default());
        heartbeat.beat();
        let (degraded_tx, degraded) = watch::channel(None);
        let state = ProbeState {
            metrics: Arc::new(Metrics::new()),
            registration,
            published,
            blocker,
            degraded,
            heartbeat,
            auth: None,
        };
        assert_eq!(handle(&state, "/healthz").status(), StatusCode::OK);
        let r = handle(&state, "/readyz");
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(body(r).contains("NVIDIA driver not ready"));
        block_tx.send_replace(None);
        pub_tx.send_replace(true);
        let r = handle(&state, "/readyz");
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(body(r).contains("registration"));
        reg_tx.send_replace(RegistrationState::Registered);
        assert_eq!(handle(&state, "/readyz").status(), StatusCode::OK);
        // Withheld devices are said, and the plugin stays ready for what it serves.
        degraded_tx.send_replace(Some("16 devices withheld: DRAPartitionableDevices".into()));
        let r = handle(&state, "/readyz");
        assert_eq!(r.status(), StatusCode::OK);
        let b = body(r);
        assert!(
            b.contains("degraded: 16 devices withheld: DRAPartitionableDevices"),
            "{b}"
        );
        state.metrics.set_devices_withheld(16);
        assert!(
            state
                .metrics
                .encode()
                .contains("cleave_kubelet_plugin_devices_withheld 16")
        );
        assert_eq!(handle(&state, "/nope").status(), StatusCode::NOT_FOUND);
    }

    #[test]
    fn lifecycle_metrics_are_exported() {
        let m = Metrics::new();
        m.lifecycle.nvml_available.set(1);
        m.lifecycle.checkpoint_errors.inc();
        let text = m.encode();
        for line in [
            "cleave_kubelet_plugin_nvml_available 1",
            "cleave_kubelet_plugin_checkpoint_healthy 1",
            "cleave_kubelet_plugin_checkpoint_errors_total 1",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }
}
