//! The HTTP server of `/metrics`, `/healthz` and `/readyz`, bounded so that no client (any
//! pod can reach the port) can exhaust the plugin: a cap on connections in total and per
//! client address (over it a connection is closed at once), a time limit on a request's
//! headers and on a connection's whole life, at most [`MAX_HEADER_BYTES`] of headers, and
//! only `GET`/`HEAD` without a body are served.
//!
//! Without these bounds 9,000 half-open connections took the plugin from 11 to 145 MiB
//! (each holds hyper's read buffer and a task), over the chart's 128Mi memory limit. The
//! header timeout is hyper's `http1::Builder::header_read_timeout`, which acts only with a
//! timer set (`hyper_util::rt::TokioTimer`; hyper 1.x `server::conn::http1` docs).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Body as _;
use hyper::{Method, Request, Response, StatusCode};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{debug, warn};

use super::ProbeState;

/// Largest request head (request line and headers) read; hyper answers 431 above it. Its
/// read buffer is capped at the same size (hyper's minimum buffer is 8 KiB).
pub(crate) const MAX_HEADER_BYTES: usize = 16 * 1024;

/// Time a connection is given to finish its response when its lifetime ends.
const GRACE: Duration = Duration::from_secs(5);

/// Bounds of the server (from `run`'s `--metrics-*` flags).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ServerLimits {
    /// Connections served at once.
    pub max_connections: usize,
    /// Connections served at once from one client address.
    pub max_per_client: usize,
    /// Time to receive a request's headers.
    pub header_timeout: Duration,
    /// Longest life of a connection (keep-alive included).
    pub connection_lifetime: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self::from(&crate::args::MetricsServerArgs::default())
    }
}

impl From<&crate::args::MetricsServerArgs> for ServerLimits {
    fn from(a: &crate::args::MetricsServerArgs) -> Self {
        Self {
            max_connections: a.metrics_max_connections as usize,
            max_per_client: a.metrics_max_connections_per_client as usize,
            header_timeout: a.metrics_header_timeout,
            connection_lifetime: a.metrics_connection_lifetime,
        }
    }
}

/// Labels of `metrics_connections_refused_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RefusedLabels {
    /// `total` (the server's cap) or `per_client` (one address's cap).
    pub reason: &'static str,
}

/// The server's own metrics: open connections and connections refused by a cap.
#[derive(Debug, Clone, Default)]
pub(crate) struct ServerMetrics {
    open: Gauge,
    refused: Family<RefusedLabels, Counter>,
}

impl ServerMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "metrics_connections_open",
            "Connections to the metrics and health server being served",
            m.open.clone(),
        );
        registry.register(
            "metrics_connections_refused",
            "Connections to the metrics and health server closed at once because a cap was reached (reason: total or per_client)",
            m.refused.clone(),
        );
        m
    }
}

/// Connections open per client address; an entry leaves with its last connection.
#[derive(Debug, Default)]
struct PerClient(Mutex<HashMap<IpAddr, usize>>);

/// One connection's place in [`PerClient`]; given back on drop.
struct ClientSlot {
    table: Arc<PerClient>,
    ip: IpAddr,
}

impl PerClient {
    fn take(self: &Arc<Self>, ip: IpAddr, max: usize) -> Option<ClientSlot> {
        let mut t = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = t.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(ClientSlot {
            table: Arc::clone(self),
            ip,
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut t = self.table.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = t.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                t.remove(&self.ip);
            }
        }
    }
}

fn plain(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r
}

/// The answer to a request that is not served: not `GET`/`HEAD`, or with a body.
fn refusal(req: &Request<hyper::body::Incoming>) -> Option<Response<Full<Bytes>>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "only GET is served\n");
        r.headers_mut().insert(
            hyper::header::ALLOW,
            hyper::header::HeaderValue::from_static("GET, HEAD"),
        );
        return Some(r);
    }
    if req.body().size_hint().lower() > 0 || !req.body().is_end_stream() {
        // The body is never read: hyper closes the connection after this answer.
        return Some(plain(
            StatusCode::PAYLOAD_TOO_LARGE,
            "requests with a body are not served\n",
        ));
    }
    None
}

/// Answers one request: only `GET` and `HEAD` without a body reach the endpoints, and
/// `/metrics` only past the scrape review when one is configured.
async fn answer(state: &ProbeState, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    if let Some(r) = refusal(&req) {
        return r;
    }
    let path = req.uri().path();
    if path == "/metrics"
        && let Some(auth) = &state.auth
        && let Err((status, why)) = auth.check(req.headers()).await
    {
        return plain(status, why);
    }
    super::handle(state, path)
}

/// Serves the endpoints on `listener` within `limits` until the task is aborted.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    state: ProbeState,
    limits: ServerLimits,
) {
    let total = Arc::new(Semaphore::new(limits.max_connections));
    let per_client = Arc::new(PerClient::default());
    let metrics = state.metrics.server.clone();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(MAX_HEADER_BYTES)
        .max_headers(64);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors and the like: wait instead of spinning.
                warn!(error = %e, "accepting a metrics connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(slot) = per_client.take(peer.ip(), limits.max_per_client) else {
            metrics
                .refused
                .get_or_create(&RefusedLabels {
                    reason: "per_client",
                })
                .inc();
            debug!(%peer, "metrics connection refused: per-client cap");
            drop(stream);
            continue;
        };
        let permit: OwnedSemaphorePermit = match Arc::clone(&total).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                metrics
                    .refused
                    .get_or_create(&RefusedLabels { reason: "total" })
                    .inc();
                debug!(%peer, "metrics connection refused: connection cap");
                drop(stream);
                continue;
            }
        };
        let state = state.clone();
        let builder = builder.clone();
        let open = metrics.open.clone();
        open.inc();
        tokio::spawn(async move {
            let _held = (slot, permit);
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let state = state.clone();
                async move { Ok::<_, std::convert::Infallible>(answer(&state, req).await) }
            });
            let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => Some(r),
                () = tokio::time::sleep(limits.connection_lifetime) => None,
            };
            let result = match ended {
                Some(r) => r,
                None => {
                    // Lifetime over: finish the response in flight, if any, then close.
                    conn.as_mut().graceful_shutdown();
                    match tokio::time::timeout(GRACE, conn.as_mut()).await {
                        Ok(r) => r,
                        Err(_) => Ok(()),
                    }
                }
            };
            if let Err(e) = result {
                debug!(%peer, error = %e, "metrics connection ended");
            }
            open.dec();
        });
    }
}
