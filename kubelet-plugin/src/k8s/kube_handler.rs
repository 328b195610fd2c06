//! The real [`ClaimHandler`]: reads each ResourceClaim from the API server and hands it
//! to the node driver (`cleave_driver::prepare::NodeDriver`).
//!
//! Claim GETs run concurrently ([`READ_CONCURRENCY`] at a time) and outside the node lock
//! (as the Go helper does); the driver calls of a batch then run on one blocking thread
//! under the [`NodeLock`], so two plugin instances on a node (rolling update) never
//! prepare at the same time.
//!
//! Each claim is read once per prepare: the object read goes with the claim's status report
//! to the [`ClaimStatusWriter`], whose write starts from it (see `claim_status`). Unprepare
//! reads nothing.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use cleave_driver::prepare::NodeDriver;
use cleave_driver::usage::SamplingGate;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use tracing::{debug, info, info_span, warn};

use crate::k8s::claim_status::ClaimStatusWriter;
use crate::k8s::events::{EventReporter, Severity};
use crate::kubelet::handler::{
    ClaimError, ClaimHandler, ClaimRef, PrepareResult, PreparedShare, UnprepareResult,
};
use crate::node::device_health::DeviceHealth;
use crate::node::node_lock::NodeLock;

/// What the handler reports after its batches; the metrics implement it, so this side
/// never imports them.
pub(crate) trait PrepareObserver: Send + Sync {
    /// The prepared claims as they are now (after every batch that reached the driver).
    fn prepared(&self, summary: &cleave_driver::prepare::CheckpointSummary);
    /// A prepare refused for `refusal`.
    fn refused(&self, refusal: cleave_driver::prepare::Refusal);
}

/// Claim reads of one batch in flight at once: a batch of thousands of claims must not
/// open thousands of requests at once (10,000 claims unbounded: 262 MiB).
pub(crate) const READ_CONCURRENCY: usize = 16;

/// Runs `reads` at most [`READ_CONCURRENCY`] at a time and returns their results in order.
pub(crate) async fn bounded_in_order<F: std::future::Future>(
    reads: impl IntoIterator<Item = F>,
) -> Vec<F::Output> {
    use futures::StreamExt as _;
    futures::stream::iter(reads)
        .buffered(READ_CONCURRENCY)
        .collect()
        .await
}

/// Prepares claims by reading them from the API server and calling the node driver.
#[derive(Clone)]
pub(crate) struct KubeClaimHandler {
    client: kube::Client,
    driver: Arc<NodeDriver>,
    node_lock: NodeLock,
    /// Device health: claims of unhealthy devices are refused (see [`Self::with_health`]).
    health: Option<(Arc<DeviceHealth>, String)>,
    /// Warning Events on claims whose prepare failed for a reason the user can act on.
    events: Option<EventReporter>,
    /// Metrics whose `mps_daemons_running` is refreshed after every batch.
    metrics: Option<Arc<dyn PrepareObserver>>,
    /// Writes the claims' `status.devices` in the background (see [`Self::with_status`]).
    status: Option<ClaimStatusWriter>,
    /// Held for every batch: usage sampling waits meanwhile (see [`Self::with_sampling_gate`]).
    sampling_gate: Option<SamplingGate>,
}

impl std::fmt::Debug for KubeClaimHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeClaimHandler")
            .field("driver", &self.driver)
            .field("node_lock", &self.node_lock)
            .finish_non_exhaustive()
    }
}

impl KubeClaimHandler {
    /// A handler reading claims with `client`, preparing with `driver`, serialised by
    /// `node_lock` (shared with every other user of the driver in this process).
    pub(crate) fn new(client: kube::Client, driver: Arc<NodeDriver>, node_lock: NodeLock) -> Self {
        Self {
            client,
            driver,
            node_lock,
            health: None,
            events: None,
            metrics: None,
            status: None,
            sampling_gate: None,
        }
    }

    /// Writes each prepared claim's `status.devices` entries through `writer` (after the
    /// kubelet's answer, never before, and once the node has settled) and removes them at
    /// unprepare.
    pub(crate) fn with_status(mut self, writer: Option<ClaimStatusWriter>) -> Self {
        self.status = writer;
        self
    }

    /// Holds `gate` for every prepare and unprepare batch, from the claims' fetch to the
    /// answer, so that usage sampling stands aside meanwhile.
    pub(crate) fn with_sampling_gate(mut self, gate: SamplingGate) -> Self {
        self.sampling_gate = Some(gate);
        self
    }

    /// Updates `mps_daemons_running` of `metrics` from the driver's prepared claims after
    /// every prepare and unprepare batch that reached the driver.
    pub(crate) fn with_metrics(mut self, metrics: Option<Arc<dyn PrepareObserver>>) -> Self {
        self.metrics = metrics;
        self
    }

    fn refresh_metrics(&self) {
        if let Some(m) = &self.metrics {
            m.prepared(&self.driver.prepared_summary());
        }
    }

    /// Refuses to prepare a claim (not prepared before) that has a device of `driver_name`
    /// that `health` reports unhealthy.
    pub(crate) fn with_health(
        mut self,
        health: Option<Arc<DeviceHealth>>,
        driver_name: &str,
    ) -> Self {
        self.health = health.map(|h| (h, driver_name.to_owned()));
        self
    }

    /// Publishes a Warning Event `PrepareFailed` on the claim when a prepare fails for a
    /// reason its owner can act on (invalid config, unknown or unhealthy device).
    pub(crate) fn with_events(mut self, events: EventReporter) -> Self {
        self.events = Some(events);
        self
    }

    /// The first allocated device of this driver and pool that is unhealthy, with why.
    fn unhealthy_device(&self, object: &ResourceClaim) -> Option<(String, String)> {
        let (health, driver) = self.health.as_ref()?;
        let results = object
            .status
            .as_ref()?
            .allocation
            .as_ref()?
            .devices
            .as_ref()?
            .results
            .as_ref()?;
        results
            .iter()
            .filter(|r| &r.driver == driver && r.pool == health.pool_name())
            .find_map(|r| {
                health
                    .condition(&r.device)
                    .map(|c| (r.device.clone(), c.message))
            })
    }

    fn report(&self, object: &ResourceClaim, note: String) {
        if let Some(events) = self.events.clone() {
            let regarding = crate::k8s::events::object_reference(object);
            tokio::spawn(async move {
                events
                    .publish(
                        &regarding,
                        Severity::Warning,
                        "PrepareFailed",
                        "Prepare",
                        &note,
                    )
                    .await;
            });
        }
    }

    /// Reads the claim and checks that it is the object the kubelet means (same UID) and
    /// that it is allocated.
    async fn fetch(&self, claim: &ClaimRef) -> Result<ResourceClaim, ClaimError> {
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &claim.namespace);
        let got = api
            .get_opt(&claim.name)
            .await
            .map_err(|e| ClaimError::Read {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                reason: e.to_string(),
            })?;
        let Some(object) = got else {
            return Err(ClaimError::NotFound {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                uid: claim.uid.clone(),
            });
        };
        let current = object.metadata.uid.as_deref().unwrap_or_default();
        if current != claim.uid {
            return Err(ClaimError::Replaced {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                uid: claim.uid.clone(),
                current: current.to_owned(),
            });
        }
        if object
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .is_none()
        {
            return Err(ClaimError::NotAllocated {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
            });
        }
        Ok(object)
    }
}

#[tonic::async_trait]
impl ClaimHandler for KubeClaimHandler {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, PrepareResult> {
        let _sampling_waits = self.sampling_gate.as_ref().map(SamplingGate::hold);
        // Status writes wait until the batch is answered and the node has settled.
        let _status_waits = self.status.as_ref().map(ClaimStatusWriter::batch);
        // Collected first: a closure held across the await is not `Send` for every lifetime.
        let reads: Vec<_> = claims.iter().map(|c| self.fetch(c)).collect();
        let fetched = bounded_in_order(reads).await;
        let mut results = BTreeMap::new();
        let mut work = Vec::new();
        let prepared: std::collections::BTreeSet<String> = if self.health.is_some() {
            self.driver
                .prepared_claims()
                .into_iter()
                .map(|r| r.uid)
                .collect()
        } else {
            Default::default()
        };
        for (claim, object) in claims.into_iter().zip(fetched) {
            match object {
                Ok(object) => {
                    // A claim prepared before stays prepared (idempotent repeats after a
                    // kubelet restart); new claims of an unhealthy device are refused.
                    if !prepared.contains(&claim.uid)
                        && let Some((device, why)) = self.unhealthy_device(&object)
                    {
                        let e = ClaimError::Unhealthy {
                            namespace: claim.namespace.clone(),
                            name: claim.name.clone(),
                            device,
                            why,
                        };
                        warn!(namespace = %claim.namespace, name = %claim.name, uid = %claim.uid, error = %e, "prepare refused");
                        self.report(&object, e.kubelet_message());
                        results.insert(claim.uid, Err(e));
                        continue;
                    }
                    work.push((claim, object));
                }
                Err(e) => {
                    warn!(namespace = %claim.namespace, name = %claim.name, uid = %claim.uid, error = %e, "prepare failed");
                    results.insert(claim.uid, Err(e));
                }
            }
        }
        if work.is_empty() {
            return results;
        }
        let driver = Arc::clone(&self.driver);
        let uids: Vec<String> = work.iter().map(|(c, _)| c.uid.clone()).collect();
        let parent = tracing::Span::current();
        let want_status = self.status.is_some();
        let batch = self
            .node_lock
            .run(move || {
                work.into_iter()
                    .map(|(claim, object)| {
                        let span = info_span!(parent: &parent, "prepare_claim", namespace = %claim.namespace, name = %claim.name, uid = %claim.uid);
                        let _enter = span.enter();
                        let started = Instant::now();
                        let result = driver
                            .prepare(&object)
                            .map(|prepared| {
                                prepared
                                    .devices
                                    .into_iter()
                                    .map(PreparedShare::from)
                                    .collect::<Vec<_>>()
                            })
                            .map_err(|e| ClaimError::Prepare {
                                message: e.to_string(),
                                refusal: e.refusal(),
                            });
                        match &result {
                            Ok(devices) => info!(devices = devices.len(), elapsed_ms = started.elapsed().as_secs_f64() * 1e3, "prepared"),
                            Err(e) => warn!(error = %e, "prepare failed"),
                        }
                        let report = (want_status && result.is_ok())
                            .then(|| driver.claim_status(&claim.uid))
                            .flatten();
                        (claim.uid, (result, report, object))
                    })
                    .collect::<Vec<_>>()
            })
            .await;
        match batch {
            Ok(done) => {
                for (uid, (result, report, object)) in done {
                    if let Err(ClaimError::Prepare { message, refusal }) = &result {
                        if let Some(m) = &self.metrics {
                            m.refused(*refusal);
                        }
                        if refusal.actionable() {
                            self.report(&object, message.clone());
                        }
                    }
                    // The write starts from the object just read: no second GET.
                    if let (Some(writer), Some(report)) = (&self.status, report) {
                        writer.prepared(report, Some(object));
                    }
                    results.insert(uid, result);
                }
            }
            Err(e) => {
                let err = ClaimError::Batch {
                    operation: "preparing",
                    reason: e.to_string(),
                };
                warn!(error = %err, "prepare batch failed");
                results.extend(uids.into_iter().map(|u| (u, Err(err.clone()))));
            }
        }
        self.refresh_metrics();
        results
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, UnprepareResult> {
        let _sampling_waits = self.sampling_gate.as_ref().map(SamplingGate::hold);
        let _status_waits = self.status.as_ref().map(ClaimStatusWriter::batch);
        let driver = Arc::clone(&self.driver);
        let uids: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
        let parent = tracing::Span::current();
        let batch = self
            .node_lock
            .run(move || {
                claims
                    .into_iter()
                    .map(|claim| {
                        let span = info_span!(parent: &parent, "unprepare_claim", namespace = %claim.namespace, name = %claim.name, uid = %claim.uid);
                        let _enter = span.enter();
                        let result = driver
                            .unprepare(&claim.uid)
                            .map_err(|e| ClaimError::Unprepare(e.to_string()));
                        if let Err(e) = &result {
                            warn!(error = %e, "unprepare failed");
                        }
                        (claim, result)
                    })
                    .collect::<Vec<_>>()
            })
            .await;
        let results = match batch {
            Ok(done) => done
                .into_iter()
                .map(|(claim, result)| {
                    if let (Some(writer), Ok(())) = (&self.status, &result) {
                        writer.unprepared(claim.clone());
                    }
                    (claim.uid, result)
                })
                .collect(),
            Err(e) => {
                let err = ClaimError::Batch {
                    operation: "unpreparing",
                    reason: e.to_string(),
                };
                warn!(error = %err, "unprepare batch failed");
                uids.into_iter().map(|u| (u, Err(err.clone()))).collect()
            }
        };
        self.refresh_metrics();
        results
    }
}

/// Unprepares checkpointed claims that the API server no longer has (deleted, or
/// recreated with another UID) while the plugin was down. Claims whose GET fails for
/// another reason are kept. Returns the UIDs unprepared.
pub(crate) async fn release_orphaned_claims(
    client: &kube::Client,
    driver: &Arc<NodeDriver>,
    node_lock: &NodeLock,
) -> Vec<String> {
    let mut orphans = Vec::new();
    for record in driver.prepared_claims() {
        let api: Api<ResourceClaim> = Api::namespaced(client.clone(), &record.namespace);
        match api.get_opt(&record.name).await {
            Ok(Some(c)) if c.metadata.uid.as_deref() == Some(record.uid.as_str()) => {
                debug!(namespace = %record.namespace, name = %record.name, uid = %record.uid, "prepared claim still exists");
            }
            Ok(_) => orphans.push(record),
            Err(e) => {
                warn!(namespace = %record.namespace, name = %record.name, uid = %record.uid, error = %e, "cannot check prepared claim; keeping it");
            }
        }
    }
    let mut released = Vec::new();
    for record in orphans {
        let d = Arc::clone(driver);
        let uid = record.uid.clone();
        match node_lock
            .run(move || d.unprepare(&uid).map_err(|e| e.to_string()))
            .await
        {
            Ok(Ok(())) => {
                info!(namespace = %record.namespace, name = %record.name, uid = %record.uid, "released claim deleted while the plugin was down");
                released.push(record.uid);
            }
            Ok(Err(e)) => {
                warn!(uid = %record.uid, error = %e, "releasing orphaned claim failed");
            }
            Err(e) => warn!(uid = %record.uid, error = %e, "releasing orphaned claim failed"),
        }
    }
    released
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A batch's claim reads run at most [`READ_CONCURRENCY`] at a time, results in order.
    #[tokio::test]
    async fn claim_reads_are_bounded_and_ordered() {
        let in_flight = AtomicUsize::new(0);
        let most = AtomicUsize::new(0);
        let reads = (0..200usize).map(|i| {
            let (in_flight, most) = (&in_flight, &most);
            async move {
                let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                in_flight.fetch_sub(1, Ordering::SeqCst);
                i
            }
        });
        let out = bounded_in_order(reads).await;
        assert_eq!(out, (0..200).collect::<Vec<_>>());
        let most = most.load(Ordering::SeqCst);
        assert!(most <= READ_CONCURRENCY, "{most} reads at once");
        assert!(most > 1, "reads ran one at a time");
    }
}
