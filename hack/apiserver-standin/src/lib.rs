//! cleave-apiserver-standin: an in-process Kubernetes API server stand-in for tests and the
//! demo. It speaks real HTTP/1.1 (and h2c) and JSON on `127.0.0.1:<ephemeral port>`, so an
//! unmodified `kube::Client` talks to it. It serves `resource.k8s.io/v1` ResourceSlices and
//! ResourceClaims (plus DeviceClasses, ResourceClaimTemplates), core Nodes, Pods, Namespaces
//! and Events, `events.k8s.io/v1` Events and Leases, with resourceVersion, conflict, watch
//! (bookmarks, streaming lists, 410 on expired versions) and ResourceSlice validation
//! semantics, plus test controls: request records, fault injection and direct store access.
//!
//! Test controls on [`StandIn`]: [`StandIn::requests`]/[`StandIn::count`] (request records),
//! [`StandIn::fail_next`], [`StandIn::set_unavailable`], [`StandIn::set_latency`] (faults),
//! [`StandIn::put`]/[`StandIn::get`]/[`StandIn::list`]/[`StandIn::delete`] (foreign writes that
//! watchers see), [`StandIn::wait_for`], [`StandIn::close_watches`]/[`StandIn::expire_watches`],
//! [`StandIn::write_kubeconfig`] (for child processes) and [`StandIn::start_detached`].
//!
//! ResourceClaim updates (the `status` subresource included) have `status.devices` checked
//! as KEP-4817 states it ([`claim_status`]: entries must be allocated devices, at most 8
//! conditions, `data` a JSON object of at most 10 KiB), and lose it when the allocation goes.
//!
//! Known differences from a real API server: no authentication, RBAC, admission or
//! namespace checks; deletes are immediate (finalizers and grace periods are ignored); lists
//! ignore `resourceVersion`/`resourceVersionMatch` and return the current state; server-side
//! apply is approximated by a merge patch (creating a missing object); JSON patch answers 415;
//! core and `events.k8s.io` Events are stored separately; field selectors accept any dotted
//! path; 1.35+ cross-slice counter references are not checked per request (see
//! [`validate_pools`]); taint keys are only checked for presence. Quantities are read by the
//! stand-in's own parser ([`quantity`]), not cleave's.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use cleave_apiserver_standin::{StandIn, StandInOptions};
//! let server = StandIn::start(StandInOptions::default()).await?;
//! let slices: kube::Api<k8s_openapi::api::resource::v1::ResourceSlice> = kube::Api::all(server.client());
//! let _ = slices.list(&Default::default()).await?;
//! assert_eq!(server.count("list", "resourceslices"), 1);
//! # Ok(()) }
//! ```

pub mod claim_status;
mod error;
pub mod fixtures;
pub mod limits;
pub mod quantity;
mod rand;
mod resources;
mod select;
mod server;
mod store;
pub mod validate;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use error::{ApiError, StandInError};
pub use resources::{RESOURCES, ResourceDef};
pub use validate::{
    FieldError, FieldErrorKind, validate_pools, validate_resource_slice,
    validate_resource_slice_typed,
};

use resources::{find_by_name, find_by_type};
use server::{Fault, Shared, lock};
use store::{Preconditions, Store, meta_str};

/// Kubernetes version the stand-in pretends to be (major is always 1). It selects the
/// ResourceSlice validation rules and what `GET /version` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KubeVersion {
    /// Minor version (34 for 1.34).
    pub minor: u32,
    /// Patch version.
    pub patch: u32,
}

impl KubeVersion {
    /// Kubernetes 1.34.1.
    pub const V1_34: KubeVersion = KubeVersion {
        minor: 34,
        patch: 1,
    };
    /// Kubernetes 1.35.0.
    pub const V1_35: KubeVersion = KubeVersion {
        minor: 35,
        patch: 0,
    };
    /// Kubernetes 1.36.0.
    pub const V1_36: KubeVersion = KubeVersion {
        minor: 36,
        patch: 0,
    };

    /// `1.<minor>.<patch>`.
    pub const fn new(minor: u32, patch: u32) -> Self {
        KubeVersion { minor, patch }
    }

    /// `v1.<minor>.<patch>`.
    pub fn git_version(&self) -> String {
        format!("v1.{}.{}", self.minor, self.patch)
    }

    /// The `version.Info` JSON served at `/version`.
    pub fn info(&self) -> Value {
        json!({
            "major": "1",
            "minor": self.minor.to_string(),
            "emulationMajor": "1",
            "emulationMinor": self.minor.to_string(),
            "minCompatibilityMajor": "1",
            "minCompatibilityMinor": self.minor.saturating_sub(1).to_string(),
            "gitVersion": self.git_version(),
            "gitCommit": "0000000000000000000000000000000000000000",
            "gitTreeState": "clean",
            "buildDate": "2025-09-09T00:00:00Z",
            "goVersion": "go1.24.6",
            "compiler": "gc",
            "platform": "linux/amd64",
        })
    }
}

impl Default for KubeVersion {
    fn default() -> Self {
        KubeVersion::V1_34
    }
}

impl std::fmt::Display for KubeVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "1.{}.{}", self.minor, self.patch)
    }
}

/// How to start the stand-in.
#[derive(Debug, Clone)]
pub struct StandInOptions {
    /// Version to report and validate for (default 1.34.1).
    pub version: KubeVersion,
    /// How often a watch with `allowWatchBookmarks=true` gets a BOOKMARK (default 1 s).
    pub bookmark_interval: Duration,
    /// Changes kept for watch resumption; older resourceVersions get 410 Gone (default 4096).
    pub history_limit: usize,
    /// Validate ResourceSlices on create/update (default true).
    pub validate: bool,
    /// Loopback port to listen on; 0 (default) picks a free one.
    pub port: u16,
    /// Compresses time for watches: each watch ends after its `timeoutSeconds` divided by
    /// this (default 1, as asked), so a bench sees an hour of watch renewals in a minute
    /// and scales the counts back. Bookmarks keep `bookmark_interval`.
    pub watch_time_scale: u32,
    /// The `DRAPartitionableDevices` feature gate (default on). Off, the stand-in drops
    /// `sharedCounters` and `consumesCounters` from ResourceSlices on create and update
    /// (dry runs too), as a gate-off API server does; see [`StandIn::set_partitionable_devices`].
    pub partitionable_devices: bool,
}

impl Default for StandInOptions {
    fn default() -> Self {
        StandInOptions {
            version: KubeVersion::default(),
            bookmark_interval: Duration::from_secs(1),
            history_limit: 4096,
            validate: true,
            port: 0,
            watch_time_scale: 1,
            partitionable_devices: true,
        }
    }
}

impl StandInOptions {
    /// Default options for `version`.
    pub fn with_version(version: KubeVersion) -> Self {
        StandInOptions {
            version,
            ..Default::default()
        }
    }
}

/// One served request, recorded when its response started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    /// HTTP method (`GET`, `POST`, ...).
    pub method: String,
    /// URL path.
    pub path: String,
    /// Raw query string.
    pub query: String,
    /// Kubernetes verb: get, list, watch, create, update, patch, delete, deletecollection
    /// (`unknown` for unrouted paths).
    pub verb: String,
    /// Plural resource (`resourceslices`, `nodes`, `version`, ...; empty if unrouted).
    pub resource: String,
    /// Response status code.
    pub status: u16,
    /// Request body bytes.
    pub bytes_in: usize,
    /// Response body bytes (for a watch: streamed so far).
    pub bytes_out: usize,
    /// Stored objects the request walks in the watch cache: for a LIST or a WATCH starting
    /// from the current state, every object of the resource in the request's scope
    /// (namespace or cluster), or only those of one node when its field selector pins
    /// `spec.nodeName` of pods or ResourceSlices (the upstream field index); 0 for anything else.
    pub scanned: usize,
    /// Seats API Priority and Fairness charges it: for a LIST or a WATCH starting from the
    /// current state, ceil(cluster-wide stored objects of the resource / 100) clamped to
    /// [1, 10], index or not; 1 for anything else.
    pub seats: u32,
}

/// A running stand-in. Dropping it stops the server and every connection and watch task.
pub struct StandIn {
    shared: Arc<Shared>,
    addr: SocketAddr,
    client: kube::Client,
    shutdown_tx: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
    /// Own runtime of a [`StandIn::start_detached`] server.
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for StandIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StandIn")
            .field("addr", &self.addr)
            .field("version", &self.shared.version)
            .finish()
    }
}

fn resource(name: &str) -> Result<&'static ResourceDef, StandInError> {
    find_by_name(name).ok_or_else(|| StandInError::UnknownResource(name.to_string()))
}

impl StandIn {
    /// Binds `127.0.0.1:<opts.port>` (0: a free port) and serves in a task of the current
    /// tokio runtime (so the test's runtime must keep running while it is used).
    pub async fn start(opts: StandInOptions) -> Result<StandIn, StandInError> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", opts.port))
            .await
            .map_err(StandInError::Bind)?;
        let addr = listener.local_addr().map_err(StandInError::Bind)?;
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let shared = Arc::new(Shared {
            store: Store::new(opts.history_limit),
            version: opts.version,
            bookmark_interval: opts.bookmark_interval,
            watch_time_scale: opts.watch_time_scale,
            validate: opts.validate,
            records: Mutex::new(Vec::new()),
            faults: Mutex::new(Vec::new()),
            latency_ms: AtomicU64::new(0),
            unavailable: AtomicBool::new(false),
            partitionable_devices: AtomicBool::new(opts.partitionable_devices),
            shutdown: shutdown_rx.clone(),
            watch_epoch: watch::channel(0).0,
            reviews: Mutex::new(Default::default()),
        });
        let url = format!("http://{addr}");
        let client =
            kube::Client::try_from(config_for(&url)?).map_err(|source| StandInError::Client {
                url: url.clone(),
                source,
            })?;
        let task = tokio::spawn(server::serve(listener, shared.clone(), shutdown_rx));
        tracing::debug!(%url, version = %opts.version, "API server stand-in started");
        Ok(StandIn {
            shared,
            addr,
            client,
            shutdown_tx,
            task: Some(task),
            runtime: None,
        })
    }

    /// Starts a server on its own two-thread runtime, so it keeps serving while the caller
    /// blocks (waiting on a child process, a current-thread test runtime doing blocking work)
    /// and can be used from sync code. Callable from inside or outside a runtime.
    pub fn start_detached(opts: StandInOptions) -> Result<StandIn, StandInError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("apiserver-standin")
            .enable_all()
            .build()
            .map_err(StandInError::Runtime)?;
        // block_on may not run on a thread that is already inside a runtime.
        let starter = std::thread::spawn(move || {
            let started = rt.block_on(StandIn::start(opts));
            (started, rt)
        });
        let (started, rt) = starter.join().map_err(|_| {
            StandInError::Runtime(std::io::Error::other("stand-in start thread panicked"))
        })?;
        match started {
            Ok(mut standin) => {
                standin.runtime = Some(rt);
                Ok(standin)
            }
            Err(e) => {
                rt.shutdown_background();
                Err(e)
            }
        }
    }

    /// Writes a kubeconfig pointing at this server (context `standin`, namespace `default`,
    /// no credentials), for child processes that use `kube::Client::try_default()` with
    /// `KUBECONFIG` set to `path`.
    pub fn write_kubeconfig(&self, path: &std::path::Path) -> Result<(), StandInError> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: standin\n  cluster:\n    server: {}\n\
             contexts:\n- name: standin\n  context:\n    cluster: standin\n    user: standin\n    namespace: default\n\
             current-context: standin\nusers:\n- name: standin\n  user: {{}}\n",
            self.url()
        );
        std::fs::write(path, text).map_err(|source| StandInError::Write {
            path: path.to_path_buf(),
            source,
        })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The version the server reports and validates for.
    pub fn version(&self) -> KubeVersion {
        self.shared.version
    }

    /// A `kube::Config` for this server (default namespace `default`, kube's default retry
    /// policy on: 429/503/504 are retried up to 15 times with backoff).
    pub fn config(&self) -> kube::Config {
        // The URL is built from a SocketAddr and always parses.
        config_for(&self.url())
            .unwrap_or_else(|_| kube::Config::new(http::Uri::from_static("http://127.0.0.1")))
    }

    /// A `kube::Client` for this server (a clone of one built at start).
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// A `kube::Client` with kube's automatic retry of 429/503/504 turned off, to observe
    /// injected failures directly.
    pub fn client_without_retry(&self) -> Result<kube::Client, StandInError> {
        let mut config = self.config();
        config.default_retry = false;
        kube::Client::try_from(config).map_err(|source| StandInError::Client {
            url: self.url(),
            source,
        })
    }

    /// TokenReviews of `token` answer: authenticated as `user` (group
    /// `system:authenticated`); other tokens are not authenticated.
    pub fn add_token(&self, token: &str, user: &str) {
        lock(&self.shared.reviews)
            .tokens
            .insert(token.to_owned(), user.to_owned());
    }

    /// SubjectAccessReviews of `user` for the non-resource URL `path` and `verb` answer
    /// allowed; every other review is denied.
    pub fn allow(&self, user: &str, path: &str, verb: &str) {
        lock(&self.shared.reviews).allowed.insert((
            user.to_owned(),
            path.to_owned(),
            verb.to_owned(),
        ));
    }

    /// Every request served since start or the last [`StandIn::reset_counts`].
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.shared.records)
            .iter()
            .map(|r| {
                let mut rec = r.rec.clone();
                if let Some(n) = &r.stream_bytes {
                    rec.bytes_out = n.load(Ordering::Relaxed);
                }
                rec
            })
            .collect()
    }

    /// Requests matching `method` and `resource`. `method` is an upper-case HTTP method
    /// (`GET` counts get+list+watch, `DELETE` delete+deletecollection) or a lower-case verb
    /// (`get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, `deletecollection`);
    /// `resource` is a plural (`resourceslices`) or `plural.group`; `""` or `"*"` match anything.
    pub fn count(&self, method: &str, resource: &str) -> usize {
        lock(&self.shared.records)
            .iter()
            .filter(|r| {
                server::pattern_matches(
                    method,
                    resource,
                    &r.rec.method,
                    &r.rec.verb,
                    &r.rec.resource,
                )
            })
            .count()
    }

    /// Like [`StandIn::count`], only requests with `dryRun=All` (which change nothing).
    pub fn count_dry_runs(&self, method: &str, resource: &str) -> usize {
        lock(&self.shared.records)
            .iter()
            .filter(|r| {
                r.rec.query.split('&').any(|kv| kv == "dryRun=All")
                    && server::pattern_matches(
                        method,
                        resource,
                        &r.rec.method,
                        &r.rec.verb,
                        &r.rec.resource,
                    )
            })
            .count()
    }

    /// Forgets recorded requests.
    pub fn reset_counts(&self) {
        lock(&self.shared.records).clear();
    }

    /// Makes the next `n` requests matching `method`/`resource` (patterns as in
    /// [`StandIn::count`]) fail with `status` and a `Status` body, before they reach the store.
    pub fn fail_next(&self, method: &str, resource: &str, n: usize, status: u16) {
        if n > 0 {
            lock(&self.shared.faults).push(Fault {
                method: method.to_string(),
                resource: resource.to_string(),
                remaining: n,
                status,
            });
        }
    }

    /// Drops pending injected failures.
    pub fn clear_faults(&self) {
        lock(&self.shared.faults).clear();
    }

    /// Delays every request by `latency` before it is handled.
    pub fn set_latency(&self, latency: Duration) {
        let ms = u64::try_from(latency.as_millis()).unwrap_or(u64::MAX);
        self.shared.latency_ms.store(ms, Ordering::Relaxed);
    }

    /// Turns the `DRAPartitionableDevices` gate on or off from now on (an upgrade of the
    /// API server); what is stored stays as it is.
    pub fn set_partitionable_devices(&self, on: bool) {
        self.shared
            .partitionable_devices
            .store(on, Ordering::Relaxed);
    }

    /// While on, every request is answered 503 ServiceUnavailable.
    pub fn set_unavailable(&self, unavailable: bool) {
        self.shared
            .unavailable
            .store(unavailable, Ordering::Relaxed);
    }

    /// Stores `obj` unconditionally as a foreign writer would (create or overwrite; a new
    /// resourceVersion; uid/creationTimestamp kept if set), emitting ADDED/MODIFIED to
    /// watchers. The resource comes from `apiVersion`/`kind` (k8s-openapi types set them).
    /// No validation. Returns the stored object.
    pub fn put<T: Serialize>(&self, obj: &T) -> Result<Value, StandInError> {
        let v = serde_json::to_value(obj).map_err(StandInError::Serialize)?;
        let api_version = v
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let kind = v.get("kind").and_then(Value::as_str).unwrap_or_default();
        let res = find_by_type(api_version, kind)
            .ok_or_else(|| StandInError::UnknownResource(format!("{api_version}/{kind}")))?;
        Ok(self.shared.store.put(res, v)?)
    }

    /// One stored object (`namespace` is ignored for cluster-scoped resources).
    pub fn get(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let res = find_by_name(resource)?;
        let ns = if res.namespaced { namespace } else { "" };
        self.shared.store.get(res, ns, name)
    }

    /// One stored object, deserialized.
    pub fn get_as<K: DeserializeOwned>(
        &self,
        resource: &str,
        namespace: &str,
        name: &str,
    ) -> Option<K> {
        serde_json::from_value(self.get(resource, namespace, name)?).ok()
    }

    /// All stored objects of a resource (all namespaces), sorted by namespace and name.
    pub fn list(&self, resource: &str) -> Vec<Value> {
        let Some(res) = find_by_name(resource) else {
            return Vec::new();
        };
        let everything = select::Selector::default();
        let filter = store::Filter {
            res,
            namespace: None,
            fields: &everything,
            labels: &everything,
        };
        self.shared.store.list(&filter).0
    }

    /// All stored objects of a resource, deserialized (objects that do not parse are skipped).
    pub fn list_as<K: DeserializeOwned>(&self, resource: &str) -> Vec<K> {
        self.list(resource)
            .into_iter()
            .filter_map(|v| serde_json::from_value(v).ok())
            .collect()
    }

    /// Deletes an object as a foreign writer would (emits DELETED). Returns it, if it existed.
    pub fn delete(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let res = find_by_name(resource)?;
        let ns = if res.namespaced { namespace } else { "" };
        self.shared
            .store
            .delete(res, ns, name, &Preconditions::default())
            .ok()
    }

    /// Creates an object through the same path as a POST (generateName, validation), without
    /// HTTP and without a request record.
    pub fn create<T: Serialize>(
        &self,
        resource_name: &str,
        obj: &T,
    ) -> Result<Value, StandInError> {
        let res = resource(resource_name)?;
        let v = serde_json::to_value(obj).map_err(StandInError::Serialize)?;
        if self.shared.validate && res.kind == "ResourceSlice" {
            let errs = validate::slice_errors(&v, self.shared.version);
            if !errs.is_empty() {
                let name = meta_str(&v, "name").unwrap_or_default().to_string();
                return Err(ApiError::invalid(res, &name, errs).into());
            }
        }
        let ns = if res.namespaced {
            meta_str(&v, "namespace").unwrap_or("default").to_string()
        } else {
            String::new()
        };
        Ok(self.shared.store.create(res, &ns, v)?)
    }

    /// [`validate_pools`] over the stored ResourceSlices of `driver` (all pools if `pool` is
    /// `None`): complete pools, unique device and counter-set names, counter references.
    pub fn validate_pools(&self, driver: &str, pool: Option<&str>) -> Result<(), Vec<String>> {
        let slices: Vec<Value> = self
            .list("resourceslices")
            .into_iter()
            .filter(|s| s.pointer("/spec/driver").and_then(Value::as_str) == Some(driver))
            .filter(|s| {
                pool.is_none_or(|p| s.pointer("/spec/pool/name").and_then(Value::as_str) == Some(p))
            })
            .collect();
        validate_pools(&slices)
    }

    /// Waits until `pred` holds for the stored objects of `resource` (checked now and after
    /// every change), at most `timeout`. Returns the objects it held for, or the last ones seen.
    pub async fn wait_for(
        &self,
        resource: &str,
        timeout: Duration,
        mut pred: impl FnMut(&[Value]) -> bool,
    ) -> Result<Vec<Value>, Vec<Value>> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut rx = self.shared.store.subscribe();
        loop {
            let items = self.list(resource);
            if pred(&items) {
                return Ok(items);
            }
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Err(_) | Ok(Err(tokio::sync::broadcast::error::RecvError::Closed)) => {
                    let items = self.list(resource);
                    return if pred(&items) { Ok(items) } else { Err(items) };
                }
                Ok(_) => {}
            }
        }
    }

    /// Ends every open watch stream (as an API server restart or a watch timeout would);
    /// clients resume from their last resourceVersion without relisting.
    pub fn close_watches(&self) {
        self.shared.watch_epoch.send_modify(|e| *e += 1);
    }

    /// Compacts the change history past the current resourceVersion and ends every open
    /// watch: each watcher's resume gets `410 Gone` and it must relist (as after etcd
    /// compaction while it was disconnected).
    pub fn expire_watches(&self) {
        self.shared.store.expire();
        self.close_watches();
    }

    /// The current (latest) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.store.current_rv()
    }

    /// Stops the server and waits for the accept loop and connections to end.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown_tx.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        let _ = self.shutdown_tx.send(true);
        if let Some(task) = self.task.take() {
            task.abort();
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Installs rustls' ring provider for the process unless one is installed already. kube
/// asks rustls for the process default, and when a workspace build enables both of
/// rustls' providers (the CDI crate's jsonschema pulls in aws-lc-rs beside kube's ring)
/// rustls cannot pick one by itself and building a client panics.
pub fn ensure_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn config_for(url: &str) -> Result<kube::Config, StandInError> {
    ensure_crypto_provider();
    let uri: http::Uri = url
        .parse()
        .map_err(|_| StandInError::Url(url.to_string()))?;
    Ok(kube::Config::new(uri))
}
