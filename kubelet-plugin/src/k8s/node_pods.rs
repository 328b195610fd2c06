//! Which pods of this node consume which ResourceClaims, and their labels: the index behind
//! a claim device's `pods` (the driver attributes a share's or MPS claim's processes by the
//! pod UID in their cgroups) and the `label_<key>` labels of the claim metrics
//! (`--claim-pod-labels`).
//!
//! A pod's claims are `spec.resourceClaims[].resourceClaimName` (a claim named directly) and
//! `status.resourceClaimStatuses[].resourceClaimName` (a claim the ResourceClaim controller
//! made from `spec.resourceClaims[].resourceClaimTemplateName`), both in the pod's namespace
//! (Kubernetes API reference, core/v1 PodSpec and PodStatus, 1.34). The index comes from one
//! watch on the pods of this node (field `spec.nodeName`, served from the API server's field
//! index, so its cost does not grow with the number of nodes), started on first need. With
//! the pod launcher, the same watch also feeds the MPS daemon pods' map ([`PodEventSink`]), so
//! a node holds one pod watch, not two.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::{WatchStreamExt as _, watcher};
use tokio::runtime::Handle;

/// API calls of the pod index, cluster-wide but selected by `spec.nodeName` (the chart's
/// ClusterRole, with usage sampling on): `(apiGroup, resource, verbs)`. Read by
/// `hack/tests/test_deployments.py`, which checks the chart against it.
#[allow(dead_code)]
pub(crate) const NODE_PODS_RBAC_RULES: &[(&str, &str, &[&str])] =
    &[("", "pods", &["list", "watch"])];

/// What the index keeps of one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PodEntry {
    /// Namespace.
    pub namespace: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Names of the ResourceClaims it consumes (in its namespace).
    pub claims: BTreeSet<String>,
}

impl PodEntry {
    /// The entry of `pod`; `None` without a UID.
    fn of(pod: &Pod) -> Option<(String, Self)> {
        let uid = pod.metadata.uid.clone()?;
        let mut claims = BTreeSet::new();
        if let Some(spec) = &pod.spec {
            for c in spec.resource_claims.iter().flatten() {
                claims.extend(c.resource_claim_name.clone());
            }
        }
        if let Some(status) = &pod.status {
            for c in status.resource_claim_statuses.iter().flatten() {
                claims.extend(c.resource_claim_name.clone());
            }
        }
        Some((
            uid,
            Self {
                namespace: pod.metadata.namespace.clone().unwrap_or_default(),
                labels: pod.metadata.labels.clone().unwrap_or_default(),
                claims,
            },
        ))
    }
}

/// The pods of one node by UID, from list and watch events.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct PodIndex {
    /// By pod UID.
    pods: BTreeMap<String, PodEntry>,
    /// This node: pods bound elsewhere are ignored.
    node: String,
}

impl PodIndex {
    /// An empty index of `node`'s pods.
    pub(crate) fn new(node: &str) -> Self {
        Self {
            pods: BTreeMap::new(),
            node: node.to_owned(),
        }
    }

    /// Adds or replaces `pod` (dropped when it is bound to another node).
    pub(crate) fn apply(&mut self, pod: &Pod) {
        let on_node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&self.node);
        match PodEntry::of(pod) {
            Some((uid, entry)) if on_node => {
                self.pods.insert(uid, entry);
            }
            Some((uid, _)) => {
                self.pods.remove(&uid);
            }
            None => {}
        }
    }

    /// Removes `pod`.
    pub(crate) fn delete(&mut self, pod: &Pod) {
        if let Some(uid) = &pod.metadata.uid {
            self.pods.remove(uid);
        }
    }

    /// Replaces everything with `pods` (a fresh list).
    pub(crate) fn reset(&mut self, pods: &[Pod]) {
        self.pods.clear();
        for p in pods {
            self.apply(p);
        }
    }

    /// UIDs, in order, of the pods consuming the claim `name` in `namespace`.
    pub(crate) fn consumers(&self, namespace: &str, name: &str) -> Vec<String> {
        self.pods
            .iter()
            .filter(|(_, p)| p.namespace == namespace && p.claims.contains(name))
            .map(|(uid, _)| uid.clone())
            .collect()
    }

    /// The values of `keys` on the first consuming pod (by UID) of the claim `name` in
    /// `namespace`; "" for a key it lacks, and for every key when no pod consumes it.
    pub(crate) fn label_values(&self, namespace: &str, name: &str, keys: &[String]) -> Vec<String> {
        let first = self
            .pods
            .values()
            .find(|p| p.namespace == namespace && p.claims.contains(name));
        keys.iter()
            .map(|k| {
                first
                    .and_then(|p| p.labels.get(k).cloned())
                    .unwrap_or_default()
            })
            .collect()
    }

    /// Number of pods indexed.
    pub(crate) fn len(&self) -> usize {
        self.pods.len()
    }
}

/// The metric label name of the pod label `key`: `label_` and the key with every character
/// outside `[a-zA-Z0-9_]` as `_` (kube-state-metrics' convention for `kube_pod_labels`).
pub(crate) fn metric_label_name(key: &str) -> String {
    let mut out = String::from("label_");
    out.extend(key.chars().map(|c| {
        if c.is_ascii_alphanumeric() || c == '_' {
            c
        } else {
            '_'
        }
    }));
    out
}

/// The most pod label keys `--claim-pod-labels` takes (each adds a label to every claim
/// series).
pub(crate) const MAX_POD_LABEL_KEYS: usize = 8;

/// Checks one label key: an optional DNS subdomain prefix (at most 253 bytes) and `/`, then a
/// name of 1 to 63 characters of `[A-Za-z0-9._-]`, starting and ending alphanumeric
/// (Kubernetes "Labels and Selectors", syntax and character set).
pub(crate) fn check_label_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && alnum(name.chars().next())
        && alnum(name.chars().last());
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|part| {
                !part.is_empty()
                    && part.len() <= 63
                    && part
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                    && part
                        .chars()
                        .next()
                        .is_some_and(|c| c.is_ascii_alphanumeric())
                    && part
                        .chars()
                        .last()
                        .is_some_and(|c| c.is_ascii_alphanumeric())
            })
    });
    if name_ok && prefix_ok {
        Ok(())
    } else {
        Err(format!(
            "{key:?} is not a valid label key ([prefix/]name: name of 1 to 63 characters of [A-Za-z0-9._-] starting and ending alphanumeric, prefix a DNS subdomain)"
        ))
    }
}

/// Checks a `--claim-pod-labels` list: at most [`MAX_POD_LABEL_KEYS`] valid keys, no two
/// alike, and no two giving the same metric label name.
pub(crate) fn check_label_keys(keys: &[String]) -> Result<(), String> {
    if keys.len() > MAX_POD_LABEL_KEYS {
        return Err(format!(
            "{} pod label keys given; at most {MAX_POD_LABEL_KEYS} (each adds a label to every claim series)",
            keys.len()
        ));
    }
    let mut names = BTreeSet::new();
    for k in keys {
        check_label_key(k)?;
        if !names.insert(metric_label_name(k)) {
            return Err(format!(
                "pod label key {k:?} gives the metric label {} twice",
                metric_label_name(k)
            ));
        }
    }
    Ok(())
}

/// Another consumer of the node pod watch's events (the MPS daemon pods' map): it sees every
/// event, in order, before the index does.
pub(crate) trait PodEventSink: Send + Sync {
    /// One event of the watch (the initial list included).
    fn event(&self, event: &watcher::Event<Pod>);
}

/// This node's pod index, kept by one watch started on first use.
pub(crate) struct NodePods {
    index: Arc<Mutex<PodIndex>>,
    /// Where the watch lists from and runs (`None`: a fixed index, for tests).
    source: Option<(Api<Pod>, Handle)>,
    node: String,
    /// The other consumers of the watch.
    sinks: Arc<Mutex<Vec<Arc<dyn PodEventSink>>>>,
    /// The watch task, once started.
    task: Mutex<Option<tokio::task::AbortHandle>>,
}

impl std::fmt::Debug for NodePods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodePods")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl Drop for NodePods {
    fn drop(&mut self) {
        if let Some(t) = lock(&self.task).take() {
            t.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl NodePods {
    /// The pods of `node`, watched through `client` on `runtime` once [`Self::index`] or
    /// [`Self::start`] is first called.
    pub(crate) fn new(client: kube::Client, node: &str, runtime: Handle) -> Self {
        Self {
            index: Arc::new(Mutex::new(PodIndex::new(node))),
            source: Some((Api::all(client), runtime)),
            node: node.to_owned(),
            sinks: Arc::default(),
            task: Mutex::new(None),
        }
    }

    /// A fixed `index`, with no watch behind it.
    #[cfg(test)]
    pub(crate) fn fixed(index: PodIndex) -> Self {
        Self {
            node: index.node.clone(),
            index: Arc::new(Mutex::new(index)),
            source: None,
            sinks: Arc::default(),
            task: Mutex::new(None),
        }
    }

    /// Whether the watch was started.
    #[cfg(test)]
    pub(crate) fn started(&self) -> bool {
        lock(&self.task).is_some()
    }

    /// Adds `sink` to the watch's consumers. A watch already running starts over (one more
    /// initial list of this node's pods), so that the sink gets the initial list too.
    pub(crate) fn add_sink(&self, sink: Arc<dyn PodEventSink>) {
        lock(&self.sinks).push(sink);
        let running = lock(&self.task).take();
        if let Some(task) = running {
            task.abort();
            tracing::debug!("node pod watch restarted for a new consumer");
            self.start();
        }
    }

    /// Starts the watch unless it runs.
    pub(crate) fn start(&self) {
        let Some((pods, runtime)) = &self.source else {
            return;
        };
        let mut task = lock(&self.task);
        if task.is_none() {
            let handle = runtime.spawn(run(
                Arc::clone(&self.index),
                Arc::clone(&self.sinks),
                pods.clone(),
                self.node.clone(),
            ));
            *task = Some(handle.abort_handle());
        }
    }

    /// The index as the watch last left it (empty until its first list), starting the
    /// watch on the first call.
    pub(crate) fn index(&self) -> MutexGuard<'_, PodIndex> {
        self.start();
        lock(&self.index)
    }
}

/// Runs the watch until aborted (kube's watcher lists, watches, resumes and relists with
/// backoff); each event updates `index`.
async fn run(
    index: Arc<Mutex<PodIndex>>,
    sinks: Arc<Mutex<Vec<Arc<dyn PodEventSink>>>>,
    pods: Api<Pod>,
    node: String,
) {
    let config = watcher::Config::default()
        .fields(&format!("spec.nodeName={node}"))
        .timeout(cleave_controller::publisher::watch_timeout_secs(&node));
    let mut events = watcher(pods, config).default_backoff().boxed();
    let mut init: Option<Vec<Pod>> = None;
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(error = %e, "watching this node's pods");
                continue;
            }
        };
        let consumers = lock(&sinks).clone();
        for sink in &consumers {
            sink.event(&event);
        }
        let mut idx = lock(&index);
        match event {
            watcher::Event::Init => init = Some(Vec::new()),
            watcher::Event::InitApply(p) => init.get_or_insert_with(Vec::new).push(p),
            watcher::Event::InitDone => {
                idx.reset(&init.take().unwrap_or_default());
                tracing::debug!(pods = idx.len(), "listed this node's pods");
            }
            watcher::Event::Apply(p) => idx.apply(&p),
            watcher::Event::Delete(p) => idx.delete(&p),
        }
    }
}

/// Sets each claim device's `pods` from `index` by the claim's namespace and name.
pub(crate) fn fill_pods(devices: &mut [cleave_driver::usage::ClaimDevice], index: &PodIndex) {
    for d in devices {
        d.pods = index.consumers(&d.claim.namespace, &d.claim.name);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        PodResourceClaim, PodResourceClaimStatus, PodSpec, PodStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod(uid: &str, ns: &str, node: &str, direct: &[&str], templated: &[&str]) -> Pod {
        Pod {
            metadata: ObjectMeta {
                uid: Some(uid.into()),
                namespace: Some(ns.into()),
                name: Some(format!("pod-{uid}")),
                labels: Some([("team".to_owned(), format!("team-{uid}"))].into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some(node.into()),
                resource_claims: Some(
                    direct
                        .iter()
                        .map(|c| PodResourceClaim {
                            name: format!("ref-{c}"),
                            resource_claim_name: Some((*c).into()),
                            resource_claim_template_name: None,
                        })
                        .chain(templated.iter().map(|c| PodResourceClaim {
                            name: format!("ref-{c}"),
                            resource_claim_name: None,
                            resource_claim_template_name: Some("tmpl".into()),
                        }))
                        .collect(),
                ),
                ..Default::default()
            }),
            status: Some(PodStatus {
                resource_claim_statuses: Some(
                    templated
                        .iter()
                        .map(|c| PodResourceClaimStatus {
                            name: format!("ref-{c}"),
                            resource_claim_name: Some((*c).into()),
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn a_direct_claim_names_its_pod() {
        let mut idx = PodIndex::new("n1");
        idx.apply(&pod("u1", "a", "n1", &["c1"], &[]));
        assert_eq!(idx.consumers("a", "c1"), vec!["u1".to_owned()]);
        assert!(idx.consumers("b", "c1").is_empty(), "another namespace");
    }

    #[test]
    fn a_template_claim_is_found_through_the_pod_status() {
        let mut idx = PodIndex::new("n1");
        idx.apply(&pod("u2", "a", "n1", &[], &["made-1"]));
        assert_eq!(idx.consumers("a", "made-1"), vec!["u2".to_owned()]);
        assert!(idx.consumers("a", "ref-made-1").is_empty());
    }

    #[test]
    fn a_deleted_pod_is_gone_and_a_relist_replaces_everything() {
        let mut idx = PodIndex::new("n1");
        let p = pod("u1", "a", "n1", &["c1"], &[]);
        idx.apply(&p);
        idx.apply(&pod("u3", "a", "n1", &["c1"], &[]));
        assert_eq!(idx.consumers("a", "c1").len(), 2);
        idx.delete(&p);
        assert_eq!(idx.consumers("a", "c1"), vec!["u3".to_owned()]);
        idx.reset(&[]);
        assert!(idx.consumers("a", "c1").is_empty());
    }

    #[test]
    fn pods_of_another_node_are_ignored() {
        let mut idx = PodIndex::new("n1");
        idx.apply(&pod("u1", "a", "n2", &["c1"], &[]));
        assert!(idx.consumers("a", "c1").is_empty());
        // Bound here, then (as a new object) elsewhere: dropped.
        idx.apply(&pod("u4", "a", "n1", &["c1"], &[]));
        idx.apply(&pod("u4", "a", "n2", &["c1"], &[]));
        assert!(idx.consumers("a", "c1").is_empty());
    }

    #[test]
    fn label_values_come_from_the_first_pod_by_uid() {
        let mut idx = PodIndex::new("n1");
        idx.apply(&pod("u9", "a", "n1", &["c1"], &[]));
        idx.apply(&pod("u1", "a", "n1", &["c1"], &[]));
        let keys = vec!["team".to_owned(), "model".to_owned()];
        assert_eq!(
            idx.label_values("a", "c1", &keys),
            vec!["team-u1".to_owned(), String::new()]
        );
        assert_eq!(
            idx.label_values("a", "none", &keys),
            vec![String::new(), String::new()]
        );
    }

    #[test]
    fn label_keys_are_checked_and_named_like_kube_state_metrics() {
        assert_eq!(metric_label_name("team"), "label_team");
        assert_eq!(
            metric_label_name("app.kubernetes.io/name"),
            "label_app_kubernetes_io_name"
        );
        assert!(check_label_keys(&["team".into(), "example.com/model".into()]).is_ok());
        assert!(check_label_keys(&["-team".into()]).is_err());
        assert!(check_label_keys(&["Bad_Prefix/x".into()]).is_err());
        assert!(check_label_keys(&["a/b/c".into()]).is_err());
        assert!(check_label_keys(&["a.b".into(), "a-b".into()]).is_err());
        let nine: Vec<String> = (0..9).map(|i| format!("k{i}")).collect();
        assert!(check_label_keys(&nine).unwrap_err().contains("at most 8"));
    }
}
