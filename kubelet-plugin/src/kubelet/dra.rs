//! The DRA node service (v1 and v1beta1), generic over one [`ClaimHandler`]; each batch is
//! reported to a [`DraObserver`] (the metrics registry implements it).
//!
//! Request problems that concern one claim (an empty UID, namespace or name, a namespace,
//! name or UID that is not a Kubernetes name, a UID listed twice with different names)
//! become that claim's error in the response map, before any API request; the other
//! claims of the batch are still handled. Every requested UID gets an entry.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tonic::{Request, Response, Status};
use tracing::{Instrument, debug, info_span, warn};

use super::proto::dra::{v1, v1beta1};
use crate::kubelet::handler::{ClaimError, ClaimHandler, ClaimRef, PreparedShare};

/// Advertised token for the v1 DRA service.
pub(crate) const DRA_PLUGIN_V1: &str = "v1.DRAPlugin";
/// Advertised token for the v1beta1 DRA service.
pub(crate) const DRA_PLUGIN_V1BETA1: &str = "v1beta1.DRAPlugin";

/// Where the DRA service reports each finished batch.
pub trait DraObserver: Send + Sync + std::fmt::Debug {
    /// `operation` (`prepare` or `unprepare`) answered `succeeded` + `failed` claims in
    /// `elapsed`.
    fn batch_done(
        &self,
        operation: &'static str,
        elapsed: std::time::Duration,
        succeeded: usize,
        failed: usize,
    );
}

/// The DRA node service, generic over the driver logic. Cheap to clone.
#[derive(Debug)]
pub(crate) struct DraService<H> {
    handler: Arc<H>,
    requests: Arc<AtomicU64>,
    observer: Option<Arc<dyn DraObserver>>,
}

impl<H> Clone for DraService<H> {
    fn clone(&self) -> Self {
        Self {
            handler: Arc::clone(&self.handler),
            requests: Arc::clone(&self.requests),
            observer: self.observer.clone(),
        }
    }
}

impl<H: ClaimHandler> DraService<H> {
    /// A service calling `handler` for every batch.
    pub(crate) fn new(handler: Arc<H>) -> Self {
        Self {
            handler,
            requests: Arc::new(AtomicU64::new(0)),
            observer: None,
        }
    }

    /// Reports every batch to `observer`.
    pub(crate) fn with_observer(mut self, observer: Option<Arc<dyn DraObserver>>) -> Self {
        self.observer = observer;
        self
    }

    /// The tonic service for `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`.
    pub(crate) fn v1_svc(&self) -> v1::dra_plugin_server::DraPluginServer<Self> {
        v1::dra_plugin_server::DraPluginServer::new(self.clone())
    }

    /// The tonic service for `k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`.
    pub(crate) fn v1beta1_svc(
        &self,
    ) -> v1beta1::dra_plugin_server::DraPluginServer<DraServiceV1beta1<H>> {
        v1beta1::dra_plugin_server::DraPluginServer::new(DraServiceV1beta1(self.clone()))
    }

    /// Prepares a batch and answers with one entry per requested UID.
    pub(crate) async fn prepare(&self, claims: Vec<v1::Claim>) -> v1::NodePrepareResourcesResponse {
        let id = self.requests.fetch_add(1, Ordering::Relaxed) + 1;
        let span = info_span!("prepare", request = id, claims = claims.len());
        let started = std::time::Instant::now();
        async {
            let (valid, mut out) = validate(claims, |error| v1::NodePrepareResourceResponse {
                devices: Vec::new(),
                error,
            });
            let uids: Vec<String> = valid.iter().map(|c| c.uid.clone()).collect();
            debug!(claims = ?valid, "NodePrepareResources");
            let mut results = if valid.is_empty() {
                BTreeMap::new()
            } else {
                self.handler.prepare(valid).await
            };
            for uid in uids {
                let entry = match results.remove(&uid) {
                    Some(Ok(devices)) => v1::NodePrepareResourceResponse {
                        devices: devices.into_iter().map(device_to_v1).collect(),
                        error: String::new(),
                    },
                    Some(Err(error)) => v1::NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error: error.kubelet_message(),
                    },
                    None => v1::NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error: ClaimError::NoResult { uid: uid.clone() }.kubelet_message(),
                    },
                };
                out.insert(uid, entry);
            }
            let failed = out.values().filter(|r| !r.error.is_empty()).count();
            if let Some(o) = &self.observer {
                o.batch_done("prepare", started.elapsed(), out.len() - failed, failed);
            }
            if failed > 0 {
                warn!(failed, "NodePrepareResources finished with errors");
            } else {
                debug!("NodePrepareResources finished");
            }
            v1::NodePrepareResourcesResponse {
                claims: out.into_iter().collect(),
            }
        }
        .instrument(span)
        .await
    }

    /// Unprepares a batch and answers with one entry per requested UID.
    pub(crate) async fn unprepare(
        &self,
        claims: Vec<v1::Claim>,
    ) -> v1::NodeUnprepareResourcesResponse {
        let id = self.requests.fetch_add(1, Ordering::Relaxed) + 1;
        let span = info_span!("unprepare", request = id, claims = claims.len());
        let started = std::time::Instant::now();
        async {
            let (valid, mut out) =
                validate(claims, |error| v1::NodeUnprepareResourceResponse { error });
            let uids: Vec<String> = valid.iter().map(|c| c.uid.clone()).collect();
            debug!(claims = ?valid, "NodeUnprepareResources");
            let mut results = if valid.is_empty() {
                BTreeMap::new()
            } else {
                self.handler.unprepare(valid).await
            };
            for uid in uids {
                let error = match results.remove(&uid) {
                    Some(Ok(())) => String::new(),
                    Some(Err(e)) => e.kubelet_message(),
                    None => ClaimError::NoResult { uid: uid.clone() }.kubelet_message(),
                };
                out.insert(uid, v1::NodeUnprepareResourceResponse { error });
            }
            let failed = out.values().filter(|r| !r.error.is_empty()).count();
            if let Some(o) = &self.observer {
                o.batch_done("unprepare", started.elapsed(), out.len() - failed, failed);
            }
            if failed > 0 {
                warn!(failed, "NodeUnprepareResources finished with errors");
            }
            v1::NodeUnprepareResourcesResponse {
                claims: out.into_iter().collect(),
            }
        }
        .instrument(span)
        .await
    }
}

/// Claims of one request handled; the kubelet sends one request per pod and driver, so a
/// request past this is not a real pod's, and its further claims each get an error instead
/// of costing memory and API requests.
pub(crate) const MAX_BATCH_CLAIMS: usize = 1024;

/// Longest value of a field quoted back in an error (a bad field may be long).
const QUOTED_MAX: usize = 80;

/// `value` quoted with control characters escaped, cut to [`QUOTED_MAX`] characters.
fn quoted(value: &str) -> String {
    let cut: String = value.chars().take(QUOTED_MAX).collect();
    let more = if cut.len() < value.len() { "..." } else { "" };
    format!("{cut:?}{more}")
}

/// Why `claim`'s namespace, name or UID is not a Kubernetes name, naming the field; checked
/// before any of them goes into an API URL (they come from the kubelet's request). The
/// namespace must be a DNS-1123 label, the name a DNS-1123 subdomain (as the API server
/// checks them), the UID a DNS-1123 label (the driver's claim-UID check: it names files and
/// CDI devices).
fn name_problem(claim: &v1::Claim) -> Option<String> {
    if !cleave_api::names::is_dns_label(&claim.namespace) {
        return Some(format!(
            "claim UID {}: namespace {} is not a Kubernetes namespace name (a DNS-1123 label: lowercase letters, digits and '-', at most 63)",
            quoted(&claim.uid),
            quoted(&claim.namespace)
        ));
    }
    if let Some(why) = cleave_api::names::node_name_problem(&claim.name) {
        return Some(format!(
            "claim UID {}: name {} is not a Kubernetes object name (a DNS-1123 subdomain): {why}",
            quoted(&claim.uid),
            quoted(&claim.name)
        ));
    }
    if cleave_driver::cdi::validate_claim_uid(&claim.uid).is_err() {
        return Some(format!(
            "claim {}/{}: uid {} is not a claim UID (lowercase letters, digits and '-', at most 63)",
            claim.namespace,
            claim.name,
            quoted(&claim.uid)
        ));
    }
    None
}

/// Splits a request into well-formed claims (deduplicated by UID, in request order) and
/// ready-made error entries for malformed ones.
fn validate<R>(
    claims: Vec<v1::Claim>,
    error_entry: impl Fn(String) -> R,
) -> (Vec<ClaimRef>, BTreeMap<String, R>) {
    let mut valid: Vec<ClaimRef> = Vec::with_capacity(claims.len());
    let mut errors: BTreeMap<String, R> = BTreeMap::new();
    for claim in claims {
        let problem = if claim.uid.is_empty() {
            Some(format!(
                "claim {}/{}: uid must not be empty",
                quoted(&claim.namespace),
                quoted(&claim.name)
            ))
        } else if claim.namespace.is_empty() {
            Some(format!("claim {}: namespace must not be empty", claim.uid))
        } else if claim.name.is_empty() {
            Some(format!("claim {}: name must not be empty", claim.uid))
        } else {
            name_problem(&claim)
        };
        if let Some(problem) = problem {
            valid.retain(|c| c.uid != claim.uid);
            errors.insert(claim.uid, error_entry(problem));
            continue;
        }
        if errors.contains_key(&claim.uid) {
            continue;
        }
        if let Some(seen) = valid.iter().find(|c| c.uid == claim.uid) {
            if seen.namespace != claim.namespace || seen.name != claim.name {
                let problem = format!(
                    "claim UID {} listed twice with different names: {}/{} and {}/{}",
                    claim.uid, seen.namespace, seen.name, claim.namespace, claim.name
                );
                valid.retain(|c| c.uid != claim.uid);
                errors.insert(claim.uid, error_entry(problem));
            }
            continue;
        }
        if valid.len() >= MAX_BATCH_CLAIMS {
            errors.insert(
                claim.uid,
                error_entry(format!(
                    "claim {}/{}: not handled: the request holds more than {MAX_BATCH_CLAIMS} claims",
                    claim.namespace, claim.name
                )),
            );
            continue;
        }
        valid.push(ClaimRef {
            namespace: claim.namespace,
            name: claim.name,
            uid: claim.uid,
        });
    }
    (valid, errors)
}

/// The driver's answer on the v1 wire (v1beta1 is converted from it, without the share).
fn device_to_v1(d: PreparedShare) -> v1::Device {
    v1::Device {
        request_names: d.device.request_names,
        pool_name: d.device.pool_name,
        device_name: d.device.device_name,
        cdi_device_ids: d.device.cdi_device_ids,
        share_id: d.share_id,
    }
}

#[tonic::async_trait]
impl<H: ClaimHandler> v1::dra_plugin_server::DraPlugin for DraService<H> {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        Ok(Response::new(
            self.prepare(request.into_inner().claims).await,
        ))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        Ok(Response::new(
            self.unprepare(request.into_inner().claims).await,
        ))
    }
}

/// The v1beta1 DRA service: converts to v1, runs the same handler, converts back.
#[derive(Debug)]
pub(crate) struct DraServiceV1beta1<H>(DraService<H>);

impl<H> Clone for DraServiceV1beta1<H> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

fn claims_from_v1beta1(claims: Vec<v1beta1::Claim>) -> Vec<v1::Claim> {
    claims
        .into_iter()
        .map(|c| v1::Claim {
            namespace: c.namespace,
            uid: c.uid,
            name: c.name,
        })
        .collect()
}

#[tonic::async_trait]
impl<H: ClaimHandler> v1beta1::dra_plugin_server::DraPlugin for DraServiceV1beta1<H> {
    async fn node_prepare_resources(
        &self,
        request: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let resp = self
            .0
            .prepare(claims_from_v1beta1(request.into_inner().claims))
            .await;
        let claims = resp
            .claims
            .into_iter()
            .map(|(uid, r)| {
                let devices = r
                    .devices
                    .into_iter()
                    .map(|d| v1beta1::Device {
                        request_names: d.request_names,
                        pool_name: d.pool_name,
                        device_name: d.device_name,
                        cdi_device_ids: d.cdi_device_ids,
                    })
                    .collect();
                (
                    uid,
                    v1beta1::NodePrepareResourceResponse {
                        devices,
                        error: r.error,
                    },
                )
            })
            .collect();
        Ok(Response::new(v1beta1::NodePrepareResourcesResponse {
            claims,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let resp = self
            .0
            .unprepare(claims_from_v1beta1(request.into_inner().claims))
            .await;
        let claims = resp
            .claims
            .into_iter()
            .map(|(uid, r)| {
                (
                    uid,
                    v1beta1::NodeUnprepareResourceResponse { error: r.error },
                )
            })
            .collect();
        Ok(Response::new(v1beta1::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(ns: &str, name: &str, uid: &str) -> v1::Claim {
        v1::Claim {
            namespace: ns.into(),
            name: name.into(),
            uid: uid.into(),
        }
    }

    #[test]
    fn validate_splits_malformed_and_duplicate_claims() {
        let (valid, errors) = validate(
            vec![
                claim("ns", "a", "u1"),
                claim("", "b", "u2"),
                claim("ns", "", "u3"),
                claim("ns", "d", ""),
                claim("ns", "a", "u1"),
                claim("ns", "e", "u5"),
                claim("ns", "other", "u5"),
            ],
            |e| e,
        );
        assert_eq!(
            valid.iter().map(|c| c.uid.as_str()).collect::<Vec<_>>(),
            ["u1"]
        );
        assert!(errors["u2"].contains("namespace must not be empty"));
        assert!(errors["u3"].contains("name must not be empty"));
        assert!(errors[""].contains("uid must not be empty"));
        assert!(errors["u5"].contains("listed twice"));
        assert_eq!(errors.len(), 4);
    }

    /// A request past [`MAX_BATCH_CLAIMS`] claims: the first are handled, each further one
    /// gets its own error.
    #[test]
    fn validate_caps_the_claims_of_one_request() {
        let n = MAX_BATCH_CLAIMS + 10;
        let claims = (0..n)
            .map(|i| claim("ns", &format!("c{i}"), &format!("u{i}")))
            .collect();
        let (valid, errors) = validate(claims, |e| e);
        assert_eq!(valid.len(), MAX_BATCH_CLAIMS);
        assert_eq!(errors.len(), 10);
        let last = format!("u{}", n - 1);
        assert!(
            errors[&last].contains("more than 1024 claims"),
            "{}",
            errors[&last]
        );
    }

    /// Names from the kubelet go into API URLs: each field must be a Kubernetes name, and a
    /// bad one is that claim's error, naming the field, with control characters escaped.
    #[test]
    fn validate_refuses_fields_that_are_not_kubernetes_names() {
        let long_name = "a".repeat(254);
        let (valid, errors) = validate(
            vec![
                claim("ns", "ok.name-1", "u1"),
                claim("../kube-system", "a", "u2"),
                claim("ns", "a/../../secrets", "u3"),
                claim("ns", &long_name, "u4"),
                claim("Upper", "a", "u5"),
                claim("ns", "a", "../u6"),
                claim("ns\n\u{1b}[31m", "a", "u7"),
                claim(&"n".repeat(64), "a", "u8"),
            ],
            |e| e,
        );
        assert_eq!(
            valid.iter().map(|c| c.uid.as_str()).collect::<Vec<_>>(),
            ["u1"]
        );
        for uid in ["u2", "u5", "u7", "u8"] {
            assert!(errors[uid].contains("namespace"), "{uid}: {}", errors[uid]);
        }
        for uid in ["u3", "u4"] {
            assert!(errors[uid].contains(": name "), "{uid}: {}", errors[uid]);
        }
        assert!(errors["../u6"].contains("uid"), "{}", errors["../u6"]);
        for e in errors.values() {
            assert!(!e.chars().any(char::is_control), "{e:?}");
        }
        assert_eq!(errors.len(), 7);
    }
}
