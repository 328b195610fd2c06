//! Kubernetes Events from the plugin, about any object (the Node, a ResourceClaim, ...).
//!
//! [`EventReporter`] wraps kube's `events.k8s.io/v1` [`Recorder`] (repeats of the same
//! reason on the same object become one Event with a series count). Publishing never fails
//! the caller: an Event that cannot be written is logged and dropped, because an Event is a
//! report, not state. RBAC: `events.k8s.io` `events` `create` and `patch` (the patch
//! updates a series).

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use kube::Resource as _;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tracing::{debug, warn};

/// The `reportingController` of cleave's node Events.
pub(crate) const REPORTING_CONTROLLER: &str = "gpu.cleave.dev/kubelet-plugin";

/// Events longer than this are cut (the API server rejects notes above 1 kB).
pub(crate) const MAX_NOTE_BYTES: usize = 1024;

/// The API server rejects an Event whose `reportingInstance` is longer than this
/// (`ReportingInstanceLengthLimit` in Kubernetes' `pkg/apis/core/validation/events.go`).
pub(crate) const MAX_REPORTING_INSTANCE: usize = 128;

/// The longest object name kube's [`Recorder`] can name an Event after: it names each Event
/// `<regarding name>.<nanoseconds in hex>` (16 hex digits), and an Event name is a DNS
/// subdomain of at most 253 characters.
const MAX_RECORDED_NAME: usize = 253 - 17;

/// Publishes Events about any object; cheap to clone.
#[derive(Clone)]
pub(crate) struct EventReporter {
    recorder: std::sync::Arc<Recorder>,
    /// For Events about objects whose names are too long for the recorder's naming.
    client: kube::Client,
    reporter: Reporter,
}

/// `instance` as a `reportingInstance`: itself when it fits [`MAX_REPORTING_INSTANCE`]
/// (any node name up to 128 characters), else its first 95 characters and a hash of the
/// whole, so that two long node names still report apart.
pub(crate) fn reporting_instance(instance: &str) -> String {
    if instance.len() <= MAX_REPORTING_INSTANCE {
        return instance.to_owned();
    }
    let hash = cleave_driver::sharing::mps::name_hash(&[instance]);
    let mut end = MAX_REPORTING_INSTANCE - hash.len() - 1;
    while !instance.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}-{hash}", &instance[..end])
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
    pub(crate) fn new(client: kube::Client, instance: impl Into<String>) -> Self {
        let reporter = Reporter {
            controller: REPORTING_CONTROLLER.to_owned(),
            instance: Some(reporting_instance(&instance.into())),
        };
        Self {
            recorder: std::sync::Arc::new(Recorder::new(client.clone(), reporter.clone())),
            client,
            reporter,
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
        let long = regarding
            .name
            .as_ref()
            .is_some_and(|n| n.len() > MAX_RECORDED_NAME);
        let published = if long {
            self.create_named(&event, regarding).await
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
    /// Creates `event` about `regarding` (whose name is too long for the recorder's Event
    /// names) as a new Event named `<first 236 characters of the name>.<nanoseconds in
    /// hex>`; no series (a repeat is another Event).
    async fn create_named(
        &self,
        event: &Event,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        use k8s_openapi::api::events::v1::Event as K8sEvent;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
        let now = k8s_openapi::jiff::Timestamp::now();
        let name = regarding.name.as_deref().unwrap_or_default();
        let mut end = MAX_RECORDED_NAME.min(name.len());
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        // The cut keeps the name a DNS subdomain when it does not end in a dot.
        let stem = name[..end].trim_end_matches(['.', '-']);
        let obj = K8sEvent {
            action: Some(event.action.clone()),
            reason: Some(event.reason.clone()),
            note: event.note.clone(),
            type_: Some(
                match event.type_ {
                    EventType::Normal => "Normal",
                    EventType::Warning => "Warning",
                }
                .to_owned(),
            ),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(self.reporter.controller.clone()),
            reporting_instance: self.reporter.instance.clone(),
            metadata: ObjectMeta {
                namespace: Some(
                    regarding
                        .namespace
                        .clone()
                        .unwrap_or_else(|| "default".to_owned()),
                ),
                name: Some(format!("{stem}.{:x}", now.as_nanosecond())),
                ..ObjectMeta::default()
            },
            ..K8sEvent::default()
        };
        let api: kube::Api<K8sEvent> = kube::Api::namespaced(
            self.client.clone(),
            obj.metadata.namespace.as_deref().unwrap_or("default"),
        );
        api.create(&kube::api::PostParams::default(), &obj)
            .await
            .map(|_| ())
    }
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

/// A reference to any object already read (e.g. a `ResourceClaim`).
pub(crate) fn object_reference<K: kube::Resource<DynamicType = ()>>(obj: &K) -> ObjectReference {
    obj.object_ref(&())
}

/// `s` with every control character (newlines, ESC of terminal sequences, C1 controls)
/// written as its Rust escape (`\n`, `\u{1b}`): messages that carry user input (a claim's
/// config keys, names) then cannot forge lines or terminal sequences where they are shown.
pub(crate) fn escape_control(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
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

    #[test]
    fn reporting_instances_fit_the_api_servers_limit_and_stay_apart() {
        assert_eq!(reporting_instance("node-a"), "node-a");
        let long = |c: char| format!("node.{}", c.to_string().repeat(248));
        let (a, b) = (
            reporting_instance(&long('a')),
            reporting_instance(&long('b')),
        );
        assert_eq!(a.len(), MAX_REPORTING_INSTANCE);
        assert_ne!(a, b);
        assert!(a.starts_with("node.aaa"), "{a}");
    }

    /// A node name of 253 characters (a valid DNS subdomain): the Event about the Node gets
    /// a name within 253 characters and a reporting instance within 128.
    #[tokio::test]
    async fn events_about_a_node_of_the_longest_name_are_valid() {
        crate::install_crypto_provider();
        let standin = cleave_apiserver_standin::StandIn::start(Default::default())
            .await
            .unwrap();
        let l = |c: char, n: usize| c.to_string().repeat(n);
        let name = format!(
            "{}.{}.{}.{}",
            l('a', 63),
            l('b', 63),
            l('c', 63),
            l('d', 61)
        );
        assert_eq!(name.len(), 253);
        standin
            .put(&cleave_apiserver_standin::fixtures::node(&name))
            .unwrap();
        let client = standin.client();
        let node = node_reference(&client, &name).await;
        let reporter = EventReporter::new(client, name.clone());
        reporter
            .publish(&node, Severity::Warning, "Testing", "Start", "hello")
            .await;
        let events = standin.list("events.events.k8s.io");
        assert_eq!(events.len(), 1, "{events:?}");
        let ev = &events[0];
        let ev_name = ev["metadata"]["name"].as_str().unwrap();
        assert!(ev_name.len() <= 253, "{ev_name}");
        assert!(
            ev_name
                .split('.')
                .all(|l| !l.is_empty() && l.len() <= 63 && !l.ends_with('-')),
            "{ev_name}"
        );
        assert_eq!(ev["regarding"]["name"], name.as_str());
        assert_eq!(ev["regarding"]["kind"], "Node");
        assert_eq!(ev["reason"], "Testing");
        assert_eq!(ev["note"], "hello");
        assert!(ev["reportingInstance"].as_str().unwrap().len() <= 128);
        assert_eq!(ev["reportingController"], REPORTING_CONTROLLER);
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
}
