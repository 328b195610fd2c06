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

/// Publishes Events about any object; cheap to clone.
#[derive(Clone)]
pub(crate) struct EventReporter {
    recorder: std::sync::Arc<Recorder>,
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
            instance: Some(instance.into()),
        };
        Self {
            recorder: std::sync::Arc::new(Recorder::new(client, reporter)),
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
        match self.recorder.publish(&event, regarding).await {
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
