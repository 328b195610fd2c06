//! The seam between the gRPC shell and the driver logic.
//!
//! The DRA services validate requests, call a [`ClaimHandler`] with well-formed claim
//! references and turn its per-claim results into the kubelet's response map. The real
//! implementation is `KubeClaimHandler` (module `kube_handler`); tests use fakes.

use std::collections::BTreeMap;

/// Identity of a ResourceClaim as the kubelet names it. All fields are non-empty when a
/// handler sees them.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClaimRef {
    /// Namespace of the claim.
    pub namespace: String,
    /// Name of the claim.
    pub name: String,
    /// UID of the claim object the kubelet means (a claim recreated under the same
    /// name has a different UID).
    pub uid: String,
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} ({})", self.namespace, self.name, self.uid)
    }
}

/// One device made ready for a claim, as reported back to the kubelet.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PreparedDevice {
    /// Requests of the claim this device satisfies.
    pub request_names: Vec<String>,
    /// Pool the device was published in.
    pub pool_name: String,
    /// Device name within the pool.
    pub device_name: String,
    /// Fully qualified CDI device IDs the container runtime injects.
    pub cdi_device_ids: Vec<String>,
    /// Share identifier for consumable-capacity allocations (sent on v1 only).
    pub share_id: Option<String>,
}

/// Result of preparing one claim: its devices, or a message for the kubelet.
pub type PrepareResult = Result<Vec<PreparedDevice>, String>;
/// Result of unpreparing one claim.
pub type UnprepareResult = Result<(), String>;

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
