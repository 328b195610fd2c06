//! Kubernetes Events from the plugin, about any object (the Node, a ResourceClaim, ...).
//!
//! [`EventReporter`] wraps kube's `events.k8s.io/v1` [`Recorder`] (repeats of the same
//! reason on the same object become one Event with a series count). Publishing never fails
//! the caller: an Event that cannot be written is logged and dropped, because an Event is a
//! report, not state. RBAC: `events.k8s.io` `events` `create` and `patch` (the patch
//! updates a series).
//!
//! Names that fit any node: the API server validates an Event's `metadata.name` as a DNS
//! subdomain (at most 253 characters) and its `reportingInstance` at most 128 characters
//! (kubernetes pkg/apis/core/validation/events.go, `ValidateEventCreate`). kube's recorder
//! names an Event `<regarding name>.<nanoseconds in hex>` (as client-go does), which a node
//! name near 253 characters overflows, so Events about such long names are created here with
//! the regarding name cut to fit (without series counting), and a node name over 128
//! characters is reported as its first 95 characters and a hash.

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use k8s_openapi::api::events::v1::Event as K8sEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Resource as _;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tracing::{debug, warn};

use crate::kubelet::handler::escape_control;

/// The `reportingController` of cleave's node Events.
pub(crate) const REPORTING_CONTROLLER: &str = "gpu.cleave.dev/kubelet-plugin";

/// Events longer than this are cut (the API server rejects notes above 1 kB).
pub(crate) const MAX_NOTE_BYTES: usize = 1024;

/// The API server's limit on `reportingInstance`.
const MAX_REPORTING_INSTANCE: usize = 128;

/// The API server's limit on an object name (a DNS subdomain).
const MAX_NAME: usize = 253;

/// What the recorder appends to the regarding object's name: `.` and up to 16 hex digits.
const NAME_SUFFIX: usize = 17;

/// Publishes Events about any object; cheap to clone.
#[derive(Clone)]
pub(crate) struct EventReporter {
    recorder: std::sync::Arc<Recorder>,
    client: kube::Client,
    instance: String,
}

impl std::fmt::Debug for EventReporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventReporter").finish_non_exhaustive()
    }
}

/// Whether an Event reports trouble.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Severity {
    /// Informational.
    Normal,
    /// Something needs attention.
    Warning,
}

impl EventReporter {
    /// A reporter whose Events name `instance` (e.g. the node name or pod name) as the
    /// reporting instance.
    /// An `instance` over 128 characters is shortened to fit (see the module doc).
    pub(crate) fn new(client: kube::Client, instance: impl Into<String>) -> Self {
        let instance = reporting_instance(&instance.into());
        let reporter = Reporter {
            controller: REPORTING_CONTROLLER.to_owned(),
            instance: Some(instance.clone()),
        };
        Self {
            recorder: std::sync::Arc::new(Recorder::new(client.clone(), reporter)),
            client,
            instance,
        }
    }

    /// Publishes one Event about `regarding`; `reason` is PascalCase, `action` a short
    /// PascalCase verb (e.g. `Start`, `Prepare`), `note` the human-readable message (control
    /// characters escaped, cut to [`MAX_NOTE_BYTES`]). Failures are logged, never returned.
    pub(crate) async fn publish(
        &self,
        regarding: &ObjectReference,
        severity: Severity,
        reason: &str,
        action: &str,
        note: &str,
    ) {
        let event = Event {
            type_: match severity {
                Severity::Normal => EventType::Normal,
                Severity::Warning => EventType::Warning,
            },
            reason: reason.to_owned(),
            note: Some(truncate(&escape_control(note), MAX_NOTE_BYTES)),
            action: action.to_owned(),
            secondary: None,
        };
        let published = if regarding.name.as_ref().map_or(0, String::len) + NAME_SUFFIX > MAX_NAME {
            self.create_with_short_name(&event, regarding).await
        } else {
            self.recorder.publish(&event, regarding).await
        };
        match published {
            Ok(()) => debug!(reason, object = ?regarding.name, "published Event"),
            Err(e) => warn!(
                reason,
                kind = ?regarding.kind,
                object = ?regarding.name,
                error = %e,
                "could not publish Event"
            ),
        }
    }
}

impl EventReporter {
    /// Creates `event` about `regarding`, whose name is too long for the recorder's naming,
    /// under a name made of the regarding name's start and the time.
    async fn create_with_short_name(
        &self,
        event: &Event,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let now = k8s_openapi::jiff::Timestamp::now();
        let name = format!(
            "{}.{:x}",
            name_prefix(regarding.name.as_deref().unwrap_or(REPORTING_CONTROLLER)),
            now.as_nanosecond()
        );
        let namespace = regarding.namespace.as_deref().unwrap_or("default");
        let object = K8sEvent {
            metadata: ObjectMeta {
                name: Some(name),
                namespace: Some(namespace.to_owned()),
                ..ObjectMeta::default()
            },
            action: Some(event.action.clone()),
            reason: Some(event.reason.clone()),
            note: event.note.clone(),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            related: event.secondary.clone(),
            reporting_controller: Some(REPORTING_CONTROLLER.to_owned()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(
                match event.type_ {
                    EventType::Normal => "Normal",
                    EventType::Warning => "Warning",
                }
                .to_owned(),
            ),
            ..K8sEvent::default()
        };
        let events: kube::Api<K8sEvent> = kube::Api::namespaced(self.client.clone(), namespace);
        events
            .create(&kube::api::PostParams::default(), &object)
            .await
            .map(|_| ())
    }
}

/// `instance` when it fits `reportingInstance`, else its first 95 characters (no trailing
/// `.` or `-`), `-` and a 32-hex hash of the whole: unique per node and at most 128.
pub(crate) fn reporting_instance(instance: &str) -> String {
    if instance.len() <= MAX_REPORTING_INSTANCE {
        return instance.to_owned();
    }
    let hash = cleave_driver::sharing::mps::name_hash(&[instance]);
    let keep = MAX_REPORTING_INSTANCE - 1 - hash.len();
    format!("{}-{hash}", trim_cut(instance, keep))
}

/// The start of `name` that leaves room for the recorder's `.<hex>` within a DNS subdomain.
fn name_prefix(name: &str) -> &str {
    trim_cut(name, MAX_NAME - NAME_SUFFIX)
}

/// `s` cut to at most `max` bytes on a character boundary, without trailing `.` or `-`
/// (a DNS subdomain's labels end alphanumeric).
fn trim_cut(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].trim_end_matches(['.', '-'])
}

/// A reference to the Node `name` (with its UID when the Node can be read, so
/// `kubectl describe node` lists the Event).
pub(crate) async fn node_reference(client: &kube::Client, name: &str) -> ObjectReference {
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    match nodes.get(name).await {
        Ok(node) => node.object_ref(&()),
        Err(e) => {
            debug!(node = name, error = %e, "reading the Node for an Event reference");
            ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(name.to_owned()),
                ..ObjectReference::default()
            }
        }
    }
}

/// This node's Node object, read once at start (one GET for everything start-up needs: the
/// slice publisher's owner UID, the daemon pods' owner, the coexistence check's capacity and
/// the reference of the Node's Events). `node` is `None` when that GET failed; each user
/// then reads the Node itself as it would without this (and fails or logs as before).
#[derive(Debug, Clone)]
pub(crate) struct StartNode {
    /// The node's name.
    pub name: String,
    /// The Node as read at start, if it could be read.
    pub node: Option<std::sync::Arc<Node>>,
}

impl StartNode {
    /// Reads the Node `name` (one GET); a failure is logged and leaves `node` empty.
    pub(crate) async fn read(client: &kube::Client, name: &str) -> Self {
        let nodes: kube::Api<Node> = kube::Api::all(client.clone());
        let node = match nodes.get(name).await {
            Ok(node) => Some(std::sync::Arc::new(node)),
            Err(e) => {
                warn!(node = name, error = %e, "reading this node's Node at start; each user reads it again");
                None
            }
        };
        Self {
            name: name.to_owned(),
            node,
        }
    }

    /// The Node's UID, if it was read and has one.
    pub(crate) fn uid(&self) -> Option<String> {
        self.node
            .as_ref()
            .and_then(|n| n.metadata.uid.clone())
            .filter(|u| !u.is_empty())
    }

    /// A reference to the Node for Events: from what was read, else [`node_reference`].
    pub(crate) async fn reference(&self, client: &kube::Client) -> ObjectReference {
        match &self.node {
            Some(node) => node.object_ref(&()),
            None => node_reference(client, &self.name).await,
        }
    }
}

/// A reference to any object already read (e.g. a `ResourceClaim`).
pub(crate) fn object_reference<K: kube::Resource<DynamicType = ()>>(obj: &K) -> ObjectReference {
    obj.object_ref(&())
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max.saturating_sub(3);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_cut_on_char_boundaries() {
        assert_eq!(truncate("short", 10), "short");
        let long = "é".repeat(600);
        let cut = truncate(&long, MAX_NOTE_BYTES);
        assert!(cut.len() <= MAX_NOTE_BYTES, "{}", cut.len());
        assert!(cut.ends_with("..."));
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(escape_control("plain: ok"), "plain: ok");
        let forged = "key `a\n2026-01-01T00:00:00Z  INFO forged\u{1b}[31m\u{9b}x\r`";
        let e = escape_control(forged);
        assert!(!e.chars().any(char::is_control), "{e:?}");
        assert_eq!(
            e,
            "key `a\\n2026-01-01T00:00:00Z  INFO forged\\u{1b}[31m\\u{9b}x\\r`"
        );
    }

    #[tokio::test]
    async fn events_about_a_node_reach_the_api_server() {
        crate::install_crypto_provider();
        let standin = cleave_apiserver_standin::StandIn::start(Default::default())
            .await
            .unwrap();
        standin
            .put(&cleave_apiserver_standin::fixtures::node("n1"))
            .unwrap();
        let client = standin.client();
        let node = node_reference(&client, "n1").await;
        assert!(node.uid.is_some(), "{node:?}");
        let reporter = EventReporter::new(client, "n1");
        reporter
            .publish(&node, Severity::Warning, "Testing", "Start", "hello")
            .await;
        reporter
            .publish(
                &node,
                Severity::Warning,
                "Forged",
                "Start",
                "a\nb\u{1b}[31m",
            )
            .await;
        let events = standin.list("events.events.k8s.io");
        assert_eq!(events.len(), 2, "{events:?}");
        let ev = events.iter().find(|e| e["reason"] == "Testing").unwrap();
        assert_eq!(ev["type"], "Warning");
        assert_eq!(ev["regarding"]["kind"], "Node");
        assert_eq!(ev["note"], "hello");
        let forged = events.iter().find(|e| e["reason"] == "Forged").unwrap();
        assert_eq!(forged["note"], "a\\nb\\u{1b}[31m");
    }

    #[tokio::test]
    async fn the_node_is_read_once_and_its_reference_needs_no_other_read() {
        crate::install_crypto_provider();
        let standin = cleave_apiserver_standin::StandIn::start(Default::default())
            .await
            .unwrap();
        standin
            .put(&cleave_apiserver_standin::fixtures::node("n1"))
            .unwrap();
        let client = standin.client();
        let node = StartNode::read(&client, "n1").await;
        let uid = node.uid().unwrap();
        let reference = node.reference(&client).await;
        assert_eq!(reference.uid.as_deref(), Some(uid.as_str()));
        assert_eq!(reference.name.as_deref(), Some("n1"));
        assert_eq!(standin.count("get", "nodes"), 1);
        // A Node that cannot be read: no UID, and the reference reads it again.
        let missing = StartNode::read(&client, "n2").await;
        assert!(missing.node.is_none() && missing.uid().is_none());
        let reference = missing.reference(&client).await;
        assert_eq!(reference.name.as_deref(), Some("n2"));
        assert_eq!(reference.uid, None);
        assert_eq!(standin.count("get", "nodes"), 3);
    }

    /// A node name of 253 characters (the longest a Node may have).
    fn longest_node() -> String {
        let label = "a".repeat(63);
        format!("{label}.{label}.{label}.{}", "b".repeat(61))
    }

    #[test]
    fn reporting_instances_fit_and_stay_unique() {
        assert_eq!(reporting_instance("node-a"), "node-a");
        let long = longest_node();
        assert_eq!(long.len(), 253);
        let a = reporting_instance(&long);
        let b = reporting_instance(&format!("{}c", &long[..252]));
        assert!(a.len() <= 128 && b.len() <= 128, "{a} {b}");
        assert_ne!(a, b);
        assert!(a.starts_with(&long[..63]), "{a}");
        assert!(name_prefix(&long).len() + NAME_SUFFIX <= MAX_NAME);
        assert!(!name_prefix(&long).ends_with('.'));
    }

    /// The stand-in validates Event names and `reportingInstance` as the API server does, so
    /// both of a 253-character node's Events would be refused without the shortening.
    #[tokio::test]
    async fn events_about_a_node_with_the_longest_name_reach_the_api_server() {
        crate::install_crypto_provider();
        let standin = cleave_apiserver_standin::StandIn::start(Default::default())
            .await
            .unwrap();
        let long = longest_node();
        standin
            .put(&cleave_apiserver_standin::fixtures::node(&long))
            .unwrap();
        let client = standin.client();
        let node = node_reference(&client, &long).await;
        let reporter = EventReporter::new(client, long.clone());
        reporter
            .publish(&node, Severity::Normal, "Testing", "Start", "hello")
            .await;
        let events = standin.list("events.events.k8s.io");
        assert_eq!(events.len(), 1, "{events:?}");
        let ev = &events[0];
        assert_eq!(ev["regarding"]["name"], long.as_str());
        assert!(
            ev["metadata"]["name"].as_str().unwrap().len() <= 253,
            "{ev}"
        );
        assert_eq!(ev["reportingInstance"], reporting_instance(&long).as_str());
    }
}
