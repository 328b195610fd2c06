//! The DRA node service (v1 and v1beta1), generic over one [`ClaimHandler`]; each batch is
//! reported to a [`DraObserver`] (the metrics registry implements it).
//!
//! Request problems that concern one claim (an empty UID, namespace or name, a UID
//! listed twice with different names) become that claim's error in the response map;
//! the other claims of the batch are still handled. Every requested UID gets an entry.

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
                claim.namespace, claim.name
            ))
        } else if claim.namespace.is_empty() {
            Some(format!("claim {}: namespace must not be empty", claim.uid))
        } else if claim.name.is_empty() {
            Some(format!("claim {}: name must not be empty", claim.uid))
        } else {
            None
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
}
