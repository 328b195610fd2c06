//! The seam between the gRPC shell and the driver logic.
//!
//! The DRA services validate requests, call a [`ClaimHandler`] with well-formed claim
//! references and turn its per-claim results into the kubelet's response map. The real
//! implementation is `KubeClaimHandler` (module `kube_handler`); tests use fakes.

use std::collections::BTreeMap;

/// Identity of a ResourceClaim as the kubelet names it (the driver's one claim identity).
/// All fields are non-empty when a handler sees them.
pub use cleave_driver::model::ClaimRef;

/// The driver's answer for one prepared device (requests, pool, device, CDI IDs); the
/// DRA service converts it once per protocol version.
pub use cleave_driver::prepare::PreparedDevice;

/// One device of a prepared claim as the kubelet is told: the driver's [`PreparedDevice`]
/// and, for a consumable-capacity allocation, its share (sent on v1 only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedShare {
    /// What the driver prepared.
    pub device: PreparedDevice,
    /// Share identifier of a consumable-capacity allocation.
    pub share_id: Option<String>,
}

impl From<PreparedDevice> for PreparedShare {
    /// The device with the share the driver prepared it as (none for a whole device).
    fn from(device: PreparedDevice) -> Self {
        Self {
            share_id: device.share_id.clone(),
            device,
        }
    }
}

/// Why one claim could not be prepared or unprepared; the variant names the step that
/// failed and `ClaimError::kubelet_message` is what the kubelet (and the pod's events)
/// show.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    /// Reading the ResourceClaim from the API server failed.
    #[error("getting claim {namespace}/{name}: {reason}")]
    Read {
        /// Claim namespace.
        namespace: String,
        /// Claim name.
        name: String,
        /// The API error.
        reason: String,
    },
    /// The claim no longer exists.
    #[error("claim {namespace}/{name} not found (UID {uid}): it was deleted")]
    NotFound {
        /// Claim namespace.
        namespace: String,
        /// Claim name.
        name: String,
        /// The UID the kubelet asked for.
        uid: String,
    },
    /// A claim of that name exists, but with another UID.
    #[error("claim {namespace}/{name} was replaced: UID {uid} != {current}")]
    Replaced {
        /// Claim namespace.
        namespace: String,
        /// Claim name.
        name: String,
        /// The UID the kubelet asked for.
        uid: String,
        /// The UID of the object now under that name.
        current: String,
    },
    /// The claim has no allocation.
    #[error("claim {namespace}/{name} is not allocated")]
    NotAllocated {
        /// Claim namespace.
        namespace: String,
        /// Claim name.
        name: String,
    },
    /// A new claim for a device that is unhealthy is refused.
    #[error("claim {namespace}/{name}: device {device} is unhealthy ({why}); not preparing it")]
    Unhealthy {
        /// Claim namespace.
        namespace: String,
        /// Claim name.
        name: String,
        /// The unhealthy device.
        device: String,
        /// Its condition.
        why: String,
    },
    /// The driver's prepare failed; its [`Refusal`](cleave_driver::prepare::Refusal) says
    /// why (the metric label) and whether the claim's owner can act on it (an Event).
    #[error("{message}")]
    Prepare {
        /// The driver's error.
        message: String,
        /// What kind of refusal it is.
        refusal: cleave_driver::prepare::Refusal,
    },
    /// The driver's unprepare failed.
    #[error("{0}")]
    Unprepare(String),
    /// The batch never ran (the node lock or its task failed).
    #[error("{operation} claims: {reason}")]
    Batch {
        /// `preparing` or `unpreparing`.
        operation: &'static str,
        /// What failed.
        reason: String,
    },
    /// The handler returned no result for a claim it was given.
    #[error("internal error: no result for claim {uid}")]
    NoResult {
        /// The claim UID.
        uid: String,
    },
    /// Another handler's failure, in its own words (fakes, wrappers).
    #[error("{0}")]
    Other(String),
}

impl ClaimError {
    /// The message the kubelet gets in the claim's response entry (and shows in the pod's
    /// events), control characters escaped: it may carry user input (config keys).
    pub(crate) fn kubelet_message(&self) -> String {
        escape_control(&self.to_string()).into_owned()
    }
}

/// Result of preparing one claim: its devices, or why not.
pub type PrepareResult = Result<Vec<PreparedShare>, ClaimError>;
/// Result of unpreparing one claim.
pub type UnprepareResult = Result<(), ClaimError>;

/// The driver logic behind the DRA services.
///
/// Contract (from the kubelet's DRA plugin API):
/// - Both calls are idempotent: the kubelet repeats them after restarts. Preparing a
///   prepared claim returns the same devices; unpreparing an unknown claim succeeds.
/// - Each claim succeeds or fails on its own; the returned map should hold an entry for
///   every claim UID passed in (the service fills missing ones with an error).
/// - Unprepare may run in a different process than the prepare it undoes, after the
///   claim object is gone: it must rely on persisted state keyed by UID.
/// - Calls may run concurrently; implementations serialise what needs it.
#[tonic::async_trait]
pub trait ClaimHandler: Send + Sync + 'static {
    /// Makes the devices allocated to each claim usable by containers.
    async fn prepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, PrepareResult>;
    /// Releases what [`ClaimHandler::prepare`] set up for each claim.
    async fn unprepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, UnprepareResult>;
}

#[tonic::async_trait]
impl<H: ClaimHandler + ?Sized> ClaimHandler for std::sync::Arc<H> {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, PrepareResult> {
        (**self).prepare(claims).await
    }
    async fn unprepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, UnprepareResult> {
        (**self).unprepare(claims).await
    }
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
