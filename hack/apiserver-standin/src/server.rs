//! HTTP layer: routing, the CRUD verbs, watch streams, request records and fault injection.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::error::ApiError;
use crate::resources::{ResourceDef, find_by_path};
use crate::select::{Selector, parse_query};
use crate::store::{Filter, Preconditions, Store, WatchStart, meta_str, translate};
use crate::{KubeVersion, RequestRecord, validate};

pub(crate) type Body = UnsyncBoxBody<Bytes, Infallible>;

/// A pending injected failure.
#[derive(Debug, Clone)]
pub(crate) struct Fault {
    pub method: String,
    pub resource: String,
    pub remaining: usize,
    pub status: u16,
}

pub(crate) struct Rec {
    pub rec: RequestRecord,
    pub stream_bytes: Option<Arc<AtomicUsize>>,
}

/// State shared by the server tasks and the test-control handle.
pub(crate) struct Shared {
    pub store: Store,
    pub version: KubeVersion,
    pub bookmark_interval: Duration,
    /// Divides every watch's `timeoutSeconds` (1: as asked), see
    /// [`crate::StandInOptions::watch_time_scale`].
    pub watch_time_scale: u32,
    pub validate: bool,
    pub records: Mutex<Vec<Rec>>,
    pub faults: Mutex<Vec<Fault>>,
    pub latency_ms: AtomicU64,
    pub unavailable: AtomicBool,
    /// The `DRAPartitionableDevices` gate; off, counters are dropped on write.
    pub partitionable_devices: AtomicBool,
    pub shutdown: watch::Receiver<bool>,
    /// Bumped to end every open watch stream.
    pub watch_epoch: watch::Sender<u64>,
    /// What TokenReviews and SubjectAccessReviews answer.
    pub reviews: Mutex<Reviews>,
}

/// The stand-in's authentication and authorization: bearer tokens by user name, and the
/// (user, non-resource path, verb) triples allowed.
#[derive(Debug, Default)]
pub(crate) struct Reviews {
    pub tokens: std::collections::HashMap<String, String>,
    pub allowed: std::collections::HashSet<(String, String, String)>,
}

/// Answers a TokenReview (`spec.token` known: authenticated as its user, in group
/// `system:authenticated`) or a SubjectAccessReview (`spec.user` allowed the
/// `spec.nonResourceAttributes` path and verb), echoing the spec with a status.
fn review(shared: &Shared, res: &ResourceDef, body: &[u8]) -> Result<Reply, ApiError> {
    let mut obj: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("decoding the review: {e}")))?;
    let reviews = lock(&shared.reviews);
    let status = if res.plural == "tokenreviews" {
        let token = obj["spec"]["token"].as_str().unwrap_or_default();
        match reviews.tokens.get(token) {
            Some(user) => json!({
                "authenticated": true,
                "user": {"username": user, "uid": format!("uid-{user}"), "groups": ["system:authenticated"]},
            }),
            None => json!({"authenticated": false, "error": "invalid bearer token"}),
        }
    } else {
        let user = obj["spec"]["user"].as_str().unwrap_or_default().to_owned();
        let attrs = &obj["spec"]["nonResourceAttributes"];
        let path = attrs["path"].as_str().unwrap_or_default().to_owned();
        let verb = attrs["verb"].as_str().unwrap_or_default().to_owned();
        let allowed = reviews.allowed.contains(&(user, path, verb));
        json!({"allowed": allowed})
    };
    obj["status"] = status;
    Ok(Reply::Json(StatusCode::CREATED, obj))
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether a record/fault pattern (`method`, `resource`) matches a request.
pub(crate) fn pattern_matches(
    method_pat: &str,
    res_pat: &str,
    method: &str,
    verb: &str,
    resource: &str,
) -> bool {
    // Upper case names an HTTP method (`GET` = get+list+watch), lower case a verb.
    let m =
        method_pat.is_empty() || method_pat == "*" || method_pat == method || method_pat == verb;
    let r = res_pat.is_empty() || res_pat == "*" || res_pat == resource || {
        // `resourceslices.resource.k8s.io` matches `resourceslices` records too.
        res_pat
            .split_once('.')
            .is_some_and(|(plural, _)| plural == resource)
    };
    m && r
}

impl Shared {
    fn take_fault(&self, method: &str, verb: &str, resource: &str) -> Option<u16> {
        let mut faults = lock(&self.faults);
        let pos = faults.iter().position(|f| {
            f.remaining > 0 && pattern_matches(&f.method, &f.resource, method, verb, resource)
        })?;
        let fault = &mut faults[pos];
        fault.remaining -= 1;
        let status = fault.status;
        if fault.remaining == 0 {
            faults.remove(pos);
        }
        Some(status)
    }
}

/// Accepts connections until shutdown; connection tasks die with this task.
pub(crate) async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                conns.spawn(async move {
                    let svc = service_fn(move |req| handle(shared.clone(), req));
                    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    if let Err(e) = builder.serve_connection(TokioIo::new(stream), svc).await {
                        tracing::debug!(error = %e, "stand-in connection ended");
                    }
                });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    conns.abort_all();
    while conns.join_next().await.is_some() {}
}

/// A parsed API path.
#[derive(Debug)]
struct Route {
    res: &'static ResourceDef,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

enum Target {
    Version,
    Health,
    Api(Route),
    Unknown,
}

fn parse_path(path: &str) -> Target {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["version"] => return Target::Version,
        ["healthz" | "readyz" | "livez"] => return Target::Health,
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Target::Unknown,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, plural, tail @ ..] if *plural != "status" && *plural != "finalize" => {
            (Some((*ns).to_string()), [&[*plural][..], tail].concat())
        }
        other => (None, other.to_vec()),
    };
    let Some(plural) = rest.first() else {
        return Target::Unknown;
    };
    let Some(res) = find_by_path(group, version, plural) else {
        return Target::Unknown;
    };
    if rest.len() > 3 || (namespace.is_some() && !res.namespaced) {
        return Target::Unknown;
    }
    Target::Api(Route {
        res,
        namespace,
        name: rest.get(1).map(|s| (*s).to_string()),
        subresource: rest.get(2).map(|s| (*s).to_string()),
    })
}

fn verb_of(method: &Method, route: &Route, watch: bool) -> &'static str {
    match (method.as_str(), route.name.is_some()) {
        ("GET", true) => "get",
        ("GET", false) if watch => "watch",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => "unknown",
    }
}

enum Reply {
    Json(StatusCode, Value),
    Stream(Body, Arc<AtomicUsize>),
}

fn full(bytes: Vec<u8>) -> Body {
    Full::new(Bytes::from(bytes)).boxed_unsync()
}

fn json_response(status: StatusCode, v: &Value) -> (Response<Body>, usize) {
    let bytes = serde_json::to_vec(v).unwrap_or_default();
    let n = bytes.len();
    let mut resp = Response::new(full(bytes));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    (resp, n)
}

struct Params {
    pairs: Vec<(String, String)>,
    /// `Accept: ...;as=PartialObjectMetadata...`: answer with metadata only.
    meta_only: bool,
}

/// `PartialObjectMetadata` view of an object.
fn partial(obj: &Value) -> Value {
    json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
           "metadata": obj.get("metadata").cloned().unwrap_or_else(|| json!({}))})
}

impl Params {
    fn get(&self, k: &str) -> Option<&str> {
        self.pairs
            .iter()
            .rev()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
    }
    fn flag(&self, k: &str) -> bool {
        matches!(self.get(k), Some("true" | "1"))
    }
    fn selector(&self, k: &str) -> Result<Selector, ApiError> {
        Selector::parse(self.get(k).unwrap_or_default())
            .map_err(|e| ApiError::bad_request(format!("unable to parse requirement: {e}")))
    }
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or_default().to_string();
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let meta_only = req
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("as=PartialObjectMetadata"));
    let body = match req.into_body().collect().await {
        Ok(c) => c.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let params = Params {
        pairs: parse_query(&query),
        meta_only,
    };
    let target = parse_path(&path);
    let (verb, resource) = match &target {
        Target::Api(r) => (verb_of(&method, r, params.flag("watch")), r.res.plural),
        Target::Version => ("get", "version"),
        Target::Health => ("get", "healthz"),
        Target::Unknown => ("unknown", ""),
    };

    let (scanned, seats) = match &target {
        Target::Api(route) => (
            scanned_by(&shared, verb, route, &params),
            seats_of(&shared, verb, route, &params),
        ),
        _ => (0, 1),
    };

    let latency = shared.latency_ms.load(Ordering::Relaxed);
    if latency > 0 {
        tokio::time::sleep(Duration::from_millis(latency)).await;
    }
    let reply = if shared.unavailable.load(Ordering::Relaxed) {
        Err(ApiError::injected(503))
    } else if let Some(code) = shared.take_fault(method.as_str(), verb, resource) {
        Err(ApiError::injected(code))
    } else {
        match target {
            Target::Version => Ok(Reply::Json(StatusCode::OK, shared.version.info())),
            Target::Health => Ok(Reply::Json(StatusCode::OK, json!("ok"))),
            Target::Unknown => Err(ApiError::no_route(&path)),
            Target::Api(route) => dispatch(
                &shared,
                &method,
                verb,
                &route,
                &params,
                &content_type,
                &body,
            ),
        }
    };
    let (resp, status, bytes_out, stream) = match reply {
        Ok(Reply::Json(status, v)) => {
            let (resp, n) = json_response(status, &v);
            (resp, status, n, None)
        }
        Ok(Reply::Stream(body, counter)) => {
            let mut resp = Response::new(body);
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            (resp, StatusCode::OK, 0, Some(counter))
        }
        Err(e) => {
            let status = StatusCode::from_u16(e.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let (resp, n) = json_response(status, &e.to_status());
            (resp, status, n, None)
        }
    };
    tracing::debug!(%method, %path, %query, status = status.as_u16(), "stand-in request");
    lock(&shared.records).push(Rec {
        rec: RequestRecord {
            method: method.to_string(),
            path,
            query,
            verb: verb.to_string(),
            resource: resource.to_string(),
            status: status.as_u16(),
            bytes_in: body.len(),
            bytes_out,
            scanned,
            seats,
        },
        stream_bytes: stream,
    });
    Ok(resp)
}

/// Resources whose watch cache keeps a field index, and the indexed field. Upstream:
/// kubernetes `pkg/registry/core/pod/strategy.go` (`Indexers()` =
/// `storage.FieldIndex("spec.nodeName")`, `MatchPod`'s `IndexFields`) and
/// `pkg/registry/resource/resourceslice/strategy.go` (`Indexers()` =
/// `storage.FieldIndex(resource.ResourceSliceSelectorNodeName)`, `Match`'s `IndexFields`).
const FIELD_INDEXES: &[(&str, &str)] = &[
    ("pods", "spec.nodeName"),
    ("resourceslices", "spec.nodeName"),
];

/// Objects per seat and the default maximum seats of API Priority and Fairness's list work
/// estimator (k8s.io/apiserver/pkg/util/flowcontrol/request/config.go: `objectsPerSeat`,
/// `maximumListSeatsDefault`; the minimum is 1).
const OBJECTS_PER_SEAT: usize = 100;
const MAXIMUM_LIST_SEATS: u32 = 10;

/// Whether the request starts from the current state: a LIST, or a WATCH with no
/// `resourceVersion`, `0`, or `sendInitialEvents=true`.
fn initial_state(verb: &str, params: &Params) -> bool {
    match verb {
        "list" => true,
        "watch" => {
            params.flag("sendInitialEvents")
                || matches!(params.get("resourceVersion").unwrap_or_default(), "" | "0")
        }
        _ => false,
    }
}

/// Objects a request walks in the API server's watch cache: a LIST, or a WATCH that starts
/// with the current state, walks every object of its resource in its scope (namespace or
/// cluster), except when its field selector pins an indexed field (`spec.nodeName` of pods
/// and ResourceSlices, [`FIELD_INDEXES`]): the cacher then serves it from that index
/// (k8s.io/apiserver/pkg/storage/cacher: `pred.MatcherIndex` -> `watchCache.ByIndex`) and
/// it walks only the objects with that value in the scope. A GET or a WATCH from a
/// resourceVersion walks none.
fn scanned_by(shared: &Shared, verb: &str, route: &Route, params: &Params) -> usize {
    if !initial_state(verb, params) {
        return 0;
    }
    let namespace = route.namespace.as_deref();
    let indexed = FIELD_INDEXES
        .iter()
        .find(|(res, _)| *res == route.res.plural)
        .and_then(|(_, field)| {
            let fields = Selector::parse(params.get("fieldSelector").unwrap_or_default()).ok()?;
            fields.required_value(field).map(|v| (*field, v.to_owned()))
        });
    match indexed {
        Some((field, value)) => shared
            .store
            .count_in_scope_with(route.res, namespace, field, &value),
        None => shared.store.count_in_scope(route.res, namespace),
    }
}

/// Seats API Priority and Fairness charges the request, as its list work estimator does for
/// a list served from the watch cache (k8s.io/apiserver/pkg/util/flowcontrol/request/
/// list_work_estimator.go, `seatsBasedOnObjectCount`): ceil(stored objects of the resource,
/// cluster-wide, / 100), clamped to [1, 10], whatever the selectors or an index (upstream:
/// "TODO: For resources that implement indexes at the watchcache level, we need to adjust
/// the cost accordingly"). Lists and watches starting from the current state; 1 for
/// anything else.
fn seats_of(shared: &Shared, verb: &str, route: &Route, params: &Params) -> u32 {
    if !initial_state(verb, params) {
        return 1;
    }
    let stored = shared.store.count_in_scope(route.res, None);
    let seats = stored.div_ceil(OBJECTS_PER_SEAT);
    u32::try_from(seats)
        .unwrap_or(u32::MAX)
        .clamp(1, MAXIMUM_LIST_SEATS)
}

fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("the body of the request could not be decoded: {e}"))
    })?;
    if !v.is_object() {
        return Err(ApiError::bad_request(
            "the body of the request must be a JSON object".into(),
        ));
    }
    Ok(v)
}

fn require_name(route: &Route) -> Result<&str, ApiError> {
    route
        .name
        .as_deref()
        .ok_or_else(|| ApiError::method_not_allowed("a name is required"))
}

fn ns_of(route: &Route) -> Result<String, ApiError> {
    match (&route.namespace, route.res.namespaced) {
        (Some(ns), true) => Ok(ns.clone()),
        (None, false) => Ok(String::new()),
        (None, true) => Err(ApiError::no_route(&format!(
            "{} requires a namespace",
            route.res.plural
        ))),
        (Some(_), false) => Err(ApiError::no_route(
            "cluster-scoped resource in a namespace path",
        )),
    }
}

/// What a server with `DRAPartitionableDevices` off does to a ResourceSlice on write: it
/// drops `spec.sharedCounters` and every device's `consumesCounters` (kubernetes
/// pkg/registry/resource/resourceslice/strategy.go, `dropDisabledFields`, called from
/// `PrepareForCreate` and `PrepareForUpdate`, so dry runs see it too), without an error.
/// `perDeviceNodeSelection` and per-device node fields, gated the same way, are not
/// written by cleave and not modelled.
fn drop_disabled_fields(shared: &Shared, res: &ResourceDef, mut obj: Value) -> Value {
    if res.kind == "ResourceClaim" {
        crate::claim_status::drop_deallocated(&mut obj);
        return obj;
    }
    if res.kind != "ResourceSlice" || shared.partitionable_devices.load(Ordering::Relaxed) {
        return obj;
    }
    if let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) {
        spec.remove("sharedCounters");
        if let Some(devices) = spec.get_mut("devices").and_then(Value::as_array_mut) {
            for d in devices.iter_mut().filter_map(Value::as_object_mut) {
                d.remove("consumesCounters");
            }
        }
    }
    obj
}

fn check_new(shared: &Shared, res: &'static ResourceDef, obj: &Value) -> Result<(), ApiError> {
    if shared.validate && matches!(res.kind, "Event" | "Pod") {
        let errs = validate::new_object_errors(res.kind, obj);
        if !errs.is_empty() {
            let name = meta_str(obj, "name").unwrap_or_default();
            return Err(ApiError::invalid(res, name, errs));
        }
    }
    if shared.validate && res.kind == "ResourceSlice" {
        let errs = validate::slice_errors(obj, shared.version);
        if !errs.is_empty() {
            let name = meta_str(obj, "name").unwrap_or_default();
            return Err(ApiError::invalid(res, name, errs));
        }
    }
    Ok(())
}

fn check_update(
    shared: &Shared,
    res: &'static ResourceDef,
    old: &Value,
    new: &Value,
) -> Result<(), ApiError> {
    if shared.validate && res.kind == "ResourceClaim" {
        let errs = crate::claim_status::status_devices_errors(new);
        if !errs.is_empty() {
            let name = meta_str(new, "name").unwrap_or_default();
            return Err(ApiError::invalid(res, name, errs));
        }
    }
    if shared.validate && res.kind == "ResourceSlice" {
        let mut errs = validate::slice_update_errors(old, new);
        errs.extend(validate::slice_errors(new, shared.version));
        if !errs.is_empty() {
            let name = meta_str(new, "name").unwrap_or_default();
            return Err(ApiError::invalid(res, name, errs));
        }
    }
    Ok(())
}

fn list_kind(res: &ResourceDef) -> String {
    format!("{}List", res.kind)
}

fn dispatch(
    shared: &Arc<Shared>,
    method: &Method,
    verb: &str,
    route: &Route,
    params: &Params,
    content_type: &str,
    body: &[u8],
) -> Result<Reply, ApiError> {
    let res = route.res;
    let status_only = match route.subresource.as_deref() {
        None => false,
        Some("status") if res.status_subresource && matches!(verb, "get" | "update" | "patch") => {
            true
        }
        Some(sub) => {
            return Err(ApiError::no_route(&format!(
                "subresource {sub} of {}",
                res.plural
            )));
        }
    };
    let _ = method;
    if verb == "create" && matches!(res.plural, "tokenreviews" | "subjectaccessreviews") {
        return review(shared, res, body);
    }
    match verb {
        "get" => {
            let ns = ns_of(route)?;
            let name = require_name(route)?;
            let obj = shared
                .store
                .get(res, &ns, name)
                .ok_or_else(|| ApiError::not_found(res, name))?;
            let obj = if params.meta_only { partial(&obj) } else { obj };
            Ok(Reply::Json(StatusCode::OK, obj))
        }
        "list" => list(shared, route, params),
        "watch" => start_watch(shared, route, params),
        "create" => {
            let ns = ns_of(route)?;
            let obj = parse_body(body)?;
            if let Some(body_ns) = meta_str(&obj, "namespace")
                && res.namespaced
                && !body_ns.is_empty()
                && body_ns != ns
            {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request".into(),
                ));
            }
            let obj = drop_disabled_fields(shared, res, obj);
            check_new(shared, res, &obj)?;
            if params
                .pairs
                .iter()
                .any(|(k, v)| k == "dryRun" && v == "All")
            {
                // Dry run: everything a create does (field dropping, validation, a
                // generated name) except storing it.
                let mut obj = obj;
                if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut)
                    && !meta.contains_key("name")
                    && let Some(prefix) = meta.get("generateName").and_then(Value::as_str)
                {
                    let name = format!("{prefix}dryrun");
                    meta.insert("name".into(), json!(name));
                }
                return Ok(Reply::Json(StatusCode::CREATED, obj));
            }
            let created = shared.store.create(res, &ns, obj)?;
            Ok(Reply::Json(StatusCode::CREATED, created))
        }
        "update" => {
            let ns = ns_of(route)?;
            let name = require_name(route)?;
            let obj = drop_disabled_fields(shared, res, parse_body(body)?);
            let updated = shared
                .store
                .replace(res, &ns, name, obj, status_only, &|old, new| {
                    check_update(shared, res, old, new)
                })?;
            Ok(Reply::Json(StatusCode::OK, updated))
        }
        "patch" => patch(shared, route, status_only, content_type, body),
        "delete" => {
            let ns = ns_of(route)?;
            let name = require_name(route)?;
            let pre = preconditions(body)?;
            let gone = shared.store.delete(res, &ns, name, &pre)?;
            Ok(Reply::Json(StatusCode::OK, gone))
        }
        "deletecollection" => {
            let fields = params.selector("fieldSelector")?;
            let labels = params.selector("labelSelector")?;
            let filter = Filter {
                res,
                namespace: route.namespace.as_deref(),
                fields: &fields,
                labels: &labels,
            };
            let (items, _) = shared.store.list(&filter);
            let mut deleted = Vec::new();
            for obj in items {
                let ns = meta_str(&obj, "namespace").unwrap_or_default().to_string();
                let name = meta_str(&obj, "name").unwrap_or_default().to_string();
                match shared
                    .store
                    .delete(res, &ns, &name, &Preconditions::default())
                {
                    Ok(gone) => deleted.push(gone),
                    Err(e) if e.code == 404 => {}
                    Err(e) => return Err(e),
                }
            }
            let rv = shared.store.current_rv();
            Ok(Reply::Json(
                StatusCode::OK,
                json!({"kind": list_kind(res), "apiVersion": res.api_version(),
                       "metadata": {"resourceVersion": rv.to_string()}, "items": deleted}),
            ))
        }
        _ => Err(ApiError::method_not_allowed(method.as_str())),
    }
}

fn preconditions(body: &[u8]) -> Result<Preconditions, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Preconditions::default());
    }
    let opts = parse_body(body)?;
    let pre = opts.get("preconditions");
    let field = |k: &str| {
        pre.and_then(|p| p.get(k))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    Ok(Preconditions {
        uid: field("uid"),
        resource_version: field("resourceVersion"),
    })
}

fn list(shared: &Shared, route: &Route, params: &Params) -> Result<Reply, ApiError> {
    let res = route.res;
    let fields = params.selector("fieldSelector")?;
    let labels = params.selector("labelSelector")?;
    let filter = Filter {
        res,
        namespace: route.namespace.as_deref(),
        fields: &fields,
        labels: &labels,
    };
    let (items, rv) = shared.store.list(&filter);
    // Pagination: the continue token is "<rv>/<namespace>/<name>" of the last item returned.
    let (start_after, rv) = match params.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            let mut parts = token.splitn(3, '/');
            let rv = parts.next().and_then(|r| r.parse::<u64>().ok());
            let (Some(rv), Some(ns), Some(name)) = (rv, parts.next(), parts.next()) else {
                return Err(ApiError::bad_request(format!(
                    "invalid continue token {token:?}"
                )));
            };
            (Some((ns.to_string(), name.to_string())), rv)
        }
        None => (None, rv),
    };
    let mut items: Vec<Value> = items
        .into_iter()
        .filter(|o| {
            start_after.as_ref().is_none_or(|(ns, name)| {
                let key = (
                    meta_str(o, "namespace").unwrap_or_default(),
                    meta_str(o, "name").unwrap_or_default(),
                );
                key > (ns.as_str(), name.as_str())
            })
        })
        .collect();
    let limit = params
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0);
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if let Some(limit) = limit
        && items.len() > limit
    {
        items.truncate(limit);
        if let Some(last) = items.last() {
            let token = format!(
                "{rv}/{}/{}",
                meta_str(last, "namespace").unwrap_or_default(),
                meta_str(last, "name").unwrap_or_default()
            );
            meta["continue"] = Value::String(token);
        }
    }
    Ok(Reply::Json(
        StatusCode::OK,
        if params.meta_only {
            let items: Vec<Value> = items.iter().map(partial).collect();
            json!({"kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1",
                   "metadata": meta, "items": items})
        } else {
            json!({"kind": list_kind(res), "apiVersion": res.api_version(), "metadata": meta, "items": items})
        },
    ))
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            if let Some(t) = target.as_object_mut() {
                for (k, v) in p {
                    if v.is_null() {
                        t.remove(k);
                    } else {
                        merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
        }
        other => *target = other.clone(),
    }
}

fn patch(
    shared: &Shared,
    route: &Route,
    status_only: bool,
    content_type: &str,
    body: &[u8],
) -> Result<Reply, ApiError> {
    let res = route.res;
    let ns = ns_of(route)?;
    let name = require_name(route)?;
    let ct = content_type.split(';').next().unwrap_or_default().trim();
    let apply = ct == "application/apply-patch+yaml";
    if !matches!(
        ct,
        "application/merge-patch+json" | "application/strategic-merge-patch+json"
    ) && !apply
    {
        return Err(ApiError::unsupported_media(ct));
    }
    let patch = parse_body(body)?;
    // Optimistic retry like the real server's GuaranteedUpdate; a resourceVersion inside the
    // patch survives the merge and is then checked against the stored one.
    for _ in 0..8 {
        let Some(old) = shared.store.get(res, &ns, name) else {
            if apply {
                check_new(shared, res, &patch)?;
                let created = shared.store.create(res, &ns, patch)?;
                return Ok(Reply::Json(StatusCode::CREATED, created));
            }
            return Err(ApiError::not_found(res, name));
        };
        let mut new = old.clone();
        merge_patch(&mut new, &patch);
        let patched_rv = meta_str(&patch, "resourceVersion").map(str::to_string);
        if patched_rv.is_none()
            && let Some(meta) = new.get_mut("metadata").and_then(Value::as_object_mut)
        {
            let rv = meta_str(&old, "resourceVersion")
                .unwrap_or_default()
                .to_string();
            meta.insert("resourceVersion".into(), Value::String(rv));
        }
        match shared
            .store
            .replace(res, &ns, name, new, status_only, &|old, new| {
                check_update(shared, res, old, new)
            }) {
            Err(e) if e.code == 409 && patched_rv.is_none() => continue,
            Err(e) => return Err(e),
            Ok(obj) => return Ok(Reply::Json(StatusCode::OK, obj)),
        }
    }
    Err(ApiError::conflict_modified(res, name))
}

/// A filter that owns its selectors, for the watch task.
struct OwnedFilter {
    res: &'static ResourceDef,
    namespace: Option<String>,
    fields: Selector,
    labels: Selector,
}

impl OwnedFilter {
    fn as_filter(&self) -> Filter<'_> {
        Filter {
            res: self.res,
            namespace: self.namespace.as_deref(),
            fields: &self.fields,
            labels: &self.labels,
        }
    }
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({"type": kind, "object": object})).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

fn bookmark_line(res: &ResourceDef, rv: u64, initial_end: bool) -> Bytes {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    event_line(
        "BOOKMARK",
        &json!({"kind": res.kind, "apiVersion": res.api_version(), "metadata": meta}),
    )
}

fn start_watch(shared: &Arc<Shared>, route: &Route, params: &Params) -> Result<Reply, ApiError> {
    let filter = OwnedFilter {
        res: route.res,
        namespace: route.namespace.clone(),
        fields: params.selector("fieldSelector")?,
        labels: params.selector("labelSelector")?,
    };
    let send_initial = params.flag("sendInitialEvents");
    let bookmarks = params.flag("allowWatchBookmarks");
    let start = match params.get("resourceVersion").unwrap_or_default() {
        _ if send_initial => WatchStart::InitialEvents,
        "" | "0" => WatchStart::CurrentState,
        rv => WatchStart::From(
            rv.parse()
                .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {rv:?}")))?,
        ),
    };
    let timeout = params
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map_or(Duration::from_secs(1800), Duration::from_secs)
        / shared.watch_time_scale.max(1);
    let setup = match shared.store.watch(&filter.as_filter(), start) {
        Ok(setup) => setup,
        Err(e) if e.code == 410 => {
            // The real server answers an expired rv on watch with 200 and one ERROR event.
            let line = event_line("ERROR", &e.to_status());
            let counter = Arc::new(AtomicUsize::new(line.len()));
            return Ok(Reply::Stream(full(line.to_vec()), counter));
        }
        Err(e) => return Err(e),
    };
    let (tx, mut rx) = mpsc::channel::<Bytes>(256);
    let counter = Arc::new(AtomicUsize::new(0));
    let task = WatchTask {
        tx,
        filter,
        bookmarks,
        initial_end: start == WatchStart::InitialEvents,
        interval: shared.bookmark_interval,
        deadline: Instant::now() + timeout,
        shutdown: shared.shutdown.clone(),
        epoch: shared.watch_epoch.subscribe(),
        counter: counter.clone(),
        meta_only: params.meta_only,
    };
    tokio::spawn(task.run(setup));
    let stream = futures::stream::poll_fn(move |cx| {
        rx.poll_recv(cx)
            .map(|o| o.map(|b| Ok::<_, Infallible>(Frame::data(b))))
    });
    Ok(Reply::Stream(
        StreamBody::new(stream).boxed_unsync(),
        counter,
    ))
}

struct WatchTask {
    tx: mpsc::Sender<Bytes>,
    filter: OwnedFilter,
    bookmarks: bool,
    initial_end: bool,
    interval: Duration,
    deadline: Instant,
    shutdown: watch::Receiver<bool>,
    epoch: watch::Receiver<u64>,
    counter: Arc<AtomicUsize>,
    meta_only: bool,
}

impl WatchTask {
    async fn send(&self, line: Bytes) -> bool {
        self.counter.fetch_add(line.len(), Ordering::Relaxed);
        self.tx.send(line).await.is_ok()
    }

    fn line(&self, kind: crate::store::ChangeKind, obj: &Value) -> Bytes {
        if self.meta_only {
            event_line(kind.as_str(), &partial(obj))
        } else {
            event_line(kind.as_str(), obj)
        }
    }

    async fn run(mut self, setup: crate::store::WatchSetup) {
        let mut rx = setup.rx;
        let mut last_rv = setup.start_rv;
        for (kind, obj) in &setup.initial {
            if !self.send(self.line(*kind, obj)).await {
                return;
            }
        }
        if self.initial_end
            && !self
                .send(bookmark_line(self.filter.res, last_rv, true))
                .await
        {
            return;
        }
        let interval = self.interval.max(Duration::from_millis(10));
        let mut tick = tokio::time::interval_at(Instant::now() + interval, interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let line = tokio::select! {
                _ = self.shutdown.changed() => return,
                _ = self.epoch.changed() => return,
                _ = self.tx.closed() => return,
                _ = tokio::time::sleep_until(self.deadline) => return,
                r = rx.recv() => match r {
                    Ok(change) => {
                        if change.rv <= last_rv {
                            continue;
                        }
                        last_rv = change.rv;
                        match translate(&self.filter.as_filter(), &change) {
                            Some((kind, obj)) => self.line(kind, &obj),
                            None => continue,
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let e = ApiError::gone("watch fell behind; too old resource version".into());
                        let _ = self.send(event_line("ERROR", &e.to_status())).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = tick.tick(), if self.bookmarks => bookmark_line(self.filter.res, last_rv, false),
            };
            if !self.send(line).await {
                return;
            }
        }
    }
}
