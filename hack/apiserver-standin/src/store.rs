//! Object storage with a global resourceVersion counter, a bounded change history and a
//! broadcast of changes for watches. Objects are plain `serde_json::Value`s keyed by
//! (resource, namespace, name); every mutation happens under one lock and is published
//! while that lock is held, so a watch that snapshots and subscribes under the same lock
//! sees every later change exactly once.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

use crate::error::ApiError;
use crate::resources::ResourceDef;
use crate::select::Selector;

/// The longest `generateName` prefix the API server keeps (its names are 63 characters at
/// most: the prefix and 5 random characters).
const MAX_GENERATED_NAME_PREFIX: usize = 58;

/// What happened to an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    /// Created.
    Added,
    /// Updated.
    Modified,
    /// Deleted.
    Deleted,
}

impl ChangeKind {
    /// Watch event type string.
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeKind::Added => "ADDED",
            ChangeKind::Modified => "MODIFIED",
            ChangeKind::Deleted => "DELETED",
        }
    }
}

/// One committed change.
#[derive(Debug)]
pub struct Change {
    /// resourceVersion of the change.
    pub rv: u64,
    /// Resource of the object.
    pub res: &'static ResourceDef,
    /// Namespace ("" for cluster-scoped).
    pub namespace: String,
    /// What happened.
    pub kind: ChangeKind,
    /// The object after the change (for deletes: the last state, with the deletion rv).
    pub object: Value,
    /// The object before the change (updates only).
    pub prev: Option<Value>,
}

type Key = (&'static str, String, String);

fn key(res: &'static ResourceDef, ns: &str, name: &str) -> Key {
    // `qualified()` allocates; the static plural+group pair is unique, use the def address.
    (res_id(res), ns.to_string(), name.to_string())
}

fn res_id(res: &'static ResourceDef) -> &'static str {
    // Distinct defs may share a plural (core and events.k8s.io events); disambiguate by group.
    if res.group == "events.k8s.io" {
        "events.events.k8s.io"
    } else {
        res.plural
    }
}

struct Inner {
    rv: u64,
    /// Changes with rv > `compacted` are all in `history`.
    compacted: u64,
    history: VecDeque<Arc<Change>>,
    history_limit: usize,
    objects: BTreeMap<Key, Value>,
}

/// The object store.
pub struct Store {
    inner: Mutex<Inner>,
    tx: broadcast::Sender<Arc<Change>>,
}

/// How a watch starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchStart {
    /// Synthetic ADDED events for the current state, then changes (rv "" or "0").
    CurrentState,
    /// Like `CurrentState` followed by a bookmark marking the end of the initial events.
    InitialEvents,
    /// Changes after this resourceVersion.
    From(u64),
}

/// What a new watch gets: initial events, the live receiver, and the rv it starts at.
pub struct WatchSetup {
    /// Events to send first (type, object).
    pub initial: Vec<(ChangeKind, Value)>,
    /// Live changes after `start_rv`.
    pub rx: broadcast::Receiver<Arc<Change>>,
    /// resourceVersion the watcher is at after `initial`.
    pub start_rv: u64,
}

/// Object filter for lists and watches.
pub struct Filter<'a> {
    /// Resource.
    pub res: &'static ResourceDef,
    /// Namespace, `None` for all.
    pub namespace: Option<&'a str>,
    /// Field selector.
    pub fields: &'a Selector,
    /// Label selector.
    pub labels: &'a Selector,
}

impl Filter<'_> {
    /// Whether `obj` (of resource `res` in namespace `ns`) passes.
    pub fn matches(&self, res: &'static ResourceDef, ns: &str, obj: &Value) -> bool {
        std::ptr::eq(res, self.res)
            && self.namespace.is_none_or(|want| want == ns)
            && self.fields.matches_fields(obj)
            && self.labels.matches_labels(obj)
    }
}

/// Preconditions for delete (from `DeleteOptions.preconditions`).
#[derive(Debug, Default, Clone)]
pub struct Preconditions {
    /// Required uid.
    pub uid: Option<String>,
    /// Required resourceVersion.
    pub resource_version: Option<String>,
}

/// Reads `metadata.<field>` as a string.
pub fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

fn meta_mut(obj: &mut Value) -> Result<&mut Map<String, Value>, ApiError> {
    let map = obj
        .as_object_mut()
        .ok_or_else(|| ApiError::bad_request("object must be a JSON object".into()))?;
    let meta = map.entry("metadata").or_insert_with(|| json!({}));
    if meta.is_null() {
        *meta = json!({});
    }
    meta.as_object_mut()
        .ok_or_else(|| ApiError::bad_request("metadata must be a JSON object".into()))
}

fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

impl Store {
    /// An empty store whose first change gets rv `first_rv + 1`.
    pub fn new(history_limit: usize) -> Self {
        let first_rv = 1000;
        let (tx, _) = broadcast::channel(history_limit.clamp(64, 65536));
        Store {
            inner: Mutex::new(Inner {
                rv: first_rv,
                compacted: first_rv,
                history: VecDeque::new(),
                history_limit: history_limit.max(1),
                objects: BTreeMap::new(),
            }),
            tx,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent data (all writes are single inserts).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A receiver of every later change.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Change>> {
        self.tx.subscribe()
    }

    /// Advances the resourceVersion without a change and forgets the history, so a watch
    /// from any earlier resourceVersion gets 410 Gone.
    pub fn expire(&self) {
        let mut inner = self.lock();
        inner.rv += 1;
        inner.history.clear();
        inner.compacted = inner.rv;
    }

    /// Current resourceVersion.
    pub fn current_rv(&self) -> u64 {
        self.lock().rv
    }

    fn commit(
        &self,
        inner: &mut Inner,
        res: &'static ResourceDef,
        ns: &str,
        kind: ChangeKind,
        object: Value,
        prev: Option<Value>,
    ) {
        let change = Arc::new(Change {
            rv: inner.rv,
            res,
            namespace: ns.to_string(),
            kind,
            object,
            prev,
        });
        inner.history.push_back(change.clone());
        while inner.history.len() > inner.history_limit {
            if let Some(old) = inner.history.pop_front() {
                inner.compacted = old.rv;
            }
        }
        // No receivers is fine.
        let _ = self.tx.send(change);
    }

    /// Gets one object.
    pub fn get(&self, res: &'static ResourceDef, ns: &str, name: &str) -> Option<Value> {
        self.lock().objects.get(&key(res, ns, name)).cloned()
    }

    /// Lists objects passing `filter`, sorted by namespace and name, with the list rv.
    pub fn list(&self, filter: &Filter<'_>) -> (Vec<Value>, u64) {
        let inner = self.lock();
        let id = res_id(filter.res);
        let items = inner
            .objects
            .iter()
            .filter(|((r, ns, _), obj)| *r == id && filter.matches(filter.res, ns, obj))
            .map(|(_, obj)| obj.clone())
            .collect();
        (items, inner.rv)
    }

    /// How many objects of `res` are stored in `namespace` (`None`: in every namespace),
    /// whatever their labels and fields: what a LIST of that scope walks.
    pub fn count_in_scope(&self, res: &'static ResourceDef, namespace: Option<&str>) -> usize {
        let inner = self.lock();
        let id = res_id(res);
        inner
            .objects
            .keys()
            .filter(|(r, ns, _)| *r == id && namespace.is_none_or(|want| want == ns))
            .count()
    }

    /// How many objects of `res` in `namespace` (`None`: every namespace) have the string
    /// `value` at the dotted `field` path: what a LIST served from a field index walks.
    pub fn count_in_scope_with(
        &self,
        res: &'static ResourceDef,
        namespace: Option<&str>,
        field: &str,
        value: &str,
    ) -> usize {
        let inner = self.lock();
        let id = res_id(res);
        inner
            .objects
            .iter()
            .filter(|((r, ns, _), obj)| {
                *r == id
                    && namespace.is_none_or(|want| want == ns)
                    && field
                        .split('.')
                        .try_fold(*obj, |cur, seg| cur.get(seg))
                        .and_then(Value::as_str)
                        == Some(value)
            })
            .count()
    }

    /// Creates an object. Fills name from generateName (cut as the API server cuts it), uid, resourceVersion,
    /// creationTimestamp and generation.
    pub fn create(
        &self,
        res: &'static ResourceDef,
        ns: &str,
        mut obj: Value,
    ) -> Result<Value, ApiError> {
        set_type(res, &mut obj)?;
        let mut inner = self.lock();
        {
            let meta = meta_mut(&mut obj)?;
            let name = meta
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            let name = if name.is_empty() {
                let prefix = meta
                    .get("generateName")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                if prefix.is_empty() {
                    return Err(ApiError::invalid(
                        res,
                        "",
                        vec![crate::validate::FieldError::required(
                            "metadata.name",
                            "name or generateName is required",
                        )],
                    ));
                }
                // The API server keeps at most 58 characters of the prefix (63 less the
                // 5 random ones; k8s.io/apiserver/pkg/storage/names/generate.go).
                let mut cut = prefix.len().min(MAX_GENERATED_NAME_PREFIX);
                while !prefix.is_char_boundary(cut) {
                    cut -= 1;
                }
                let prefix = &prefix[..cut];
                let mut candidate = String::new();
                for _ in 0..16 {
                    candidate = format!("{prefix}{}", crate::rand::suffix(5));
                    if !inner.objects.contains_key(&key(res, ns, &candidate)) {
                        break;
                    }
                }
                candidate
            } else {
                name
            };
            meta.insert("name".into(), Value::String(name));
            if res.namespaced {
                meta.insert("namespace".into(), Value::String(ns.to_string()));
            } else {
                meta.remove("namespace");
            }
        }
        let name = meta_str(&obj, "name").unwrap_or_default().to_string();
        let k = key(res, ns, &name);
        if inner.objects.contains_key(&k) {
            return Err(ApiError::already_exists(res, &name));
        }
        // The real ResourceClaim strategy resets status on create (allocation is written
        // through the status subresource); tests store allocated claims with `put`.
        if res.kind == "ResourceClaim"
            && let Some(map) = obj.as_object_mut()
        {
            map.remove("status");
        }
        inner.rv += 1;
        let rv = inner.rv;
        {
            let meta = meta_mut(&mut obj)?;
            meta.insert("uid".into(), Value::String(crate::rand::uuid()));
            meta.insert("resourceVersion".into(), Value::String(rv.to_string()));
            meta.insert("creationTimestamp".into(), Value::String(now_rfc3339()));
            meta.remove("deletionTimestamp");
            meta.insert("generation".into(), json!(1));
        }
        inner.objects.insert(k, obj.clone());
        self.commit(&mut inner, res, ns, ChangeKind::Added, obj.clone(), None);
        Ok(obj)
    }

    /// Replaces an object (PUT). `check(old, new)` validates the update. With `status_only`
    /// only `status` is taken from `obj`; otherwise a resource with a status subresource
    /// keeps its stored status.
    pub fn replace(
        &self,
        res: &'static ResourceDef,
        ns: &str,
        name: &str,
        mut obj: Value,
        status_only: bool,
        check: &dyn Fn(&Value, &Value) -> Result<(), ApiError>,
    ) -> Result<Value, ApiError> {
        set_type(res, &mut obj)?;
        let mut inner = self.lock();
        let k = key(res, ns, name);
        let old = inner
            .objects
            .get(&k)
            .cloned()
            .ok_or_else(|| ApiError::not_found(res, name))?;
        let body_name = meta_str(&obj, "name").unwrap_or_default();
        if !body_name.is_empty() && body_name != name {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({name})"
            )));
        }
        let want_rv = meta_str(&obj, "resourceVersion")
            .unwrap_or_default()
            .to_string();
        let old_rv = meta_str(&old, "resourceVersion")
            .unwrap_or_default()
            .to_string();
        if !want_rv.is_empty() && want_rv != old_rv {
            return Err(ApiError::conflict_modified(res, name));
        }
        let want_uid = meta_str(&obj, "uid").unwrap_or_default().to_string();
        let old_uid = meta_str(&old, "uid").unwrap_or_default().to_string();
        if !want_uid.is_empty() && want_uid != old_uid {
            return Err(ApiError::conflict(
                res,
                name,
                format!(
                    "Precondition failed: UID in precondition: {want_uid}, UID in object meta: {old_uid}"
                ),
            ));
        }
        let mut new = if status_only {
            let mut new = old.clone();
            if let (Some(map), Some(status)) = (new.as_object_mut(), obj.get("status")) {
                map.insert("status".into(), status.clone());
            }
            new
        } else {
            if res.status_subresource
                && let Some(map) = obj.as_object_mut()
            {
                match old.get("status") {
                    Some(s) => map.insert("status".into(), s.clone()),
                    None => map.remove("status"),
                };
            }
            obj
        };
        {
            let old_meta = old.get("metadata").cloned().unwrap_or_else(|| json!({}));
            let meta = meta_mut(&mut new)?;
            meta.insert("name".into(), Value::String(name.to_string()));
            if res.namespaced {
                meta.insert("namespace".into(), Value::String(ns.to_string()));
            }
            for kept in [
                "uid",
                "creationTimestamp",
                "generation",
                "deletionTimestamp",
            ] {
                match old_meta.get(kept) {
                    Some(v) => meta.insert(kept.into(), v.clone()),
                    None => meta.remove(kept),
                };
            }
            meta.insert("resourceVersion".into(), Value::String(old_rv.clone()));
        }
        if new.get("spec") != old.get("spec") {
            let generation = old
                .get("metadata")
                .and_then(|m| m.get("generation"))
                .and_then(Value::as_i64)
                .unwrap_or(0);
            meta_mut(&mut new)?.insert("generation".into(), json!(generation + 1));
        }
        check(&old, &new)?;
        if new == old {
            // No-op update: the real API server neither bumps the rv nor emits an event.
            return Ok(old);
        }
        inner.rv += 1;
        let rv = inner.rv;
        meta_mut(&mut new)?.insert("resourceVersion".into(), Value::String(rv.to_string()));
        inner.objects.insert(k, new.clone());
        self.commit(
            &mut inner,
            res,
            ns,
            ChangeKind::Modified,
            new.clone(),
            Some(old),
        );
        Ok(new)
    }

    /// Deletes an object, honouring preconditions.
    pub fn delete(
        &self,
        res: &'static ResourceDef,
        ns: &str,
        name: &str,
        pre: &Preconditions,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let k = key(res, ns, name);
        let old = inner
            .objects
            .get(&k)
            .ok_or_else(|| ApiError::not_found(res, name))?;
        if let Some(uid) = pre.uid.as_deref() {
            let have = meta_str(old, "uid").unwrap_or_default();
            if uid != have {
                return Err(ApiError::conflict(
                    res,
                    name,
                    format!(
                        "Precondition failed: UID in precondition: {uid}, UID in object meta: {have}"
                    ),
                ));
            }
        }
        if let Some(rv) = pre.resource_version.as_deref() {
            let have = meta_str(old, "resourceVersion").unwrap_or_default();
            if rv != have {
                return Err(ApiError::conflict(
                    res,
                    name,
                    format!(
                        "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {have}"
                    ),
                ));
            }
        }
        let mut gone = inner.objects.remove(&k).unwrap_or(Value::Null);
        inner.rv += 1;
        let rv = inner.rv;
        meta_mut(&mut gone)?.insert("resourceVersion".into(), Value::String(rv.to_string()));
        self.commit(&mut inner, res, ns, ChangeKind::Deleted, gone.clone(), None);
        Ok(gone)
    }

    /// Stores `obj` unconditionally (create or overwrite), as a foreign writer would.
    /// Keeps the given uid/creationTimestamp if set, else fills them; always assigns a new rv.
    pub fn put(&self, res: &'static ResourceDef, mut obj: Value) -> Result<Value, ApiError> {
        set_type(res, &mut obj)?;
        let ns = if res.namespaced {
            meta_str(&obj, "namespace").unwrap_or("default").to_string()
        } else {
            String::new()
        };
        let name = meta_str(&obj, "name").unwrap_or_default().to_string();
        if name.is_empty() {
            return Err(ApiError::bad_request(
                "put: metadata.name is required".into(),
            ));
        }
        let mut inner = self.lock();
        let k = key(res, &ns, &name);
        let old = inner.objects.get(&k).cloned();
        inner.rv += 1;
        let rv = inner.rv;
        {
            let meta = meta_mut(&mut obj)?;
            if res.namespaced {
                meta.insert("namespace".into(), Value::String(ns.clone()));
            }
            let old_meta = old.as_ref().and_then(|o| o.get("metadata"));
            for (field, fresh) in [
                ("uid", Value::String(crate::rand::uuid())),
                ("creationTimestamp", Value::String(now_rfc3339())),
                ("generation", json!(1)),
            ] {
                if meta.get(field).is_none_or(Value::is_null) {
                    let v = old_meta
                        .and_then(|m| m.get(field))
                        .cloned()
                        .unwrap_or(fresh);
                    meta.insert(field.into(), v);
                }
            }
            meta.insert("resourceVersion".into(), Value::String(rv.to_string()));
        }
        inner.objects.insert(k, obj.clone());
        let kind = if old.is_some() {
            ChangeKind::Modified
        } else {
            ChangeKind::Added
        };
        self.commit(&mut inner, res, &ns, kind, obj.clone(), old);
        Ok(obj)
    }

    /// Sets up a watch atomically with respect to concurrent changes.
    pub fn watch(&self, filter: &Filter<'_>, start: WatchStart) -> Result<WatchSetup, ApiError> {
        let inner = self.lock();
        let rx = self.tx.subscribe();
        let id = res_id(filter.res);
        match start {
            WatchStart::CurrentState | WatchStart::InitialEvents => {
                let initial = inner
                    .objects
                    .iter()
                    .filter(|((r, ns, _), obj)| *r == id && filter.matches(filter.res, ns, obj))
                    .map(|(_, obj)| (ChangeKind::Added, obj.clone()))
                    .collect();
                Ok(WatchSetup {
                    initial,
                    rx,
                    start_rv: inner.rv,
                })
            }
            WatchStart::From(from) => {
                if from < inner.compacted {
                    return Err(ApiError::gone(format!(
                        "too old resource version: {from} ({})",
                        inner.compacted + 1
                    )));
                }
                let mut initial = Vec::new();
                for change in inner.history.iter().filter(|c| c.rv > from) {
                    if let Some(ev) = translate(filter, change) {
                        initial.push(ev);
                    }
                }
                Ok(WatchSetup {
                    initial,
                    rx,
                    start_rv: inner.rv.max(from),
                })
            }
        }
    }
}

/// Turns a change into the event a watcher with `filter` sees, if any: an update that moves
/// an object into (out of) the selection is ADDED (DELETED), as in the real API server.
pub fn translate(filter: &Filter<'_>, change: &Change) -> Option<(ChangeKind, Value)> {
    let now = filter.matches(change.res, &change.namespace, &change.object);
    match change.kind {
        ChangeKind::Modified => {
            let before = change
                .prev
                .as_ref()
                .is_some_and(|p| filter.matches(change.res, &change.namespace, p));
            match (before, now) {
                (true, true) => Some((ChangeKind::Modified, change.object.clone())),
                (false, true) => Some((ChangeKind::Added, change.object.clone())),
                (true, false) => Some((ChangeKind::Deleted, change.object.clone())),
                (false, false) => None,
            }
        }
        kind => now.then(|| (kind, change.object.clone())),
    }
}

fn set_type(res: &'static ResourceDef, obj: &mut Value) -> Result<(), ApiError> {
    let map = obj
        .as_object_mut()
        .ok_or_else(|| ApiError::bad_request("object must be a JSON object".into()))?;
    if let Some(kind) = map.get("kind").and_then(Value::as_str)
        && !kind.is_empty()
        && kind != res.kind
    {
        return Err(ApiError::bad_request(format!(
            "the kind of the object ({kind}) does not match the resource ({})",
            res.kind
        )));
    }
    map.insert("apiVersion".into(), Value::String(res.api_version()));
    map.insert("kind".into(), Value::String(res.kind.to_string()));
    Ok(())
}
