//! Test support: a recording fake handler and kubelet-side clients over unix sockets.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use cleave_kubelet_plugin::proto::dra::{v1, v1beta1};
use cleave_kubelet_plugin::proto::registration::registration_client::RegistrationClient;
use cleave_kubelet_plugin::{
    ClaimError, ClaimHandler, ClaimRef, PluginConfig, PreparedDevice, PreparedShare, connect_unix,
};
use cleave_kubelet_plugin::{PrepareResult, UnprepareResult};
use tonic::transport::Channel;

/// Bound for every wait in these tests.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// Records every batch; claims named `bad*` fail, the rest get one device each.
#[derive(Debug, Default)]
pub struct FakeHandler {
    pub prepared: Mutex<Vec<Vec<ClaimRef>>>,
    pub unprepared: Mutex<Vec<Vec<ClaimRef>>>,
    /// When set, the handler leaves out results for claims named `lost*`.
    pub forget_lost: bool,
}

impl FakeHandler {
    pub fn prepare_batches(&self) -> Vec<Vec<ClaimRef>> {
        self.prepared.lock().unwrap().clone()
    }
    pub fn unprepare_batches(&self) -> Vec<Vec<ClaimRef>> {
        self.unprepared.lock().unwrap().clone()
    }
}

#[tonic::async_trait]
impl ClaimHandler for FakeHandler {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, PrepareResult> {
        self.prepared.lock().unwrap().push(claims.clone());
        claims
            .into_iter()
            .filter(|c| !(self.forget_lost && c.name.starts_with("lost")))
            .map(|c| {
                let result = if c.name.starts_with("bad") {
                    Err(ClaimError::Other(format!(
                        "claim {}/{} is bad",
                        c.namespace, c.name
                    )))
                } else {
                    Ok(vec![PreparedShare {
                        device: PreparedDevice {
                            request_names: vec!["gpu".into()],
                            pool_name: "node-a".into(),
                            device_name: "gpu-0".into(),
                            cdi_device_ids: vec![format!(
                                "k8s.gpu.cleave.dev/claim={}-gpu-0",
                                c.uid
                            )],
                            share_id: None,
                        },
                        share_id: Some("share-1".into()),
                    }])
                };
                (c.uid, result)
            })
            .collect()
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, UnprepareResult> {
        self.unprepared.lock().unwrap().push(claims.clone());
        claims
            .into_iter()
            .map(|c| {
                let r = if c.name.starts_with("bad") {
                    Err(ClaimError::Other(format!("cannot unprepare {}", c.name)))
                } else {
                    Ok(())
                };
                (c.uid, r)
            })
            .collect()
    }
}

/// A plugin layout in a fresh temp dir.
pub fn config(dir: &Path) -> PluginConfig {
    PluginConfig::new(
        "gpu.cleave.dev",
        dir.join("plugins_registry"),
        dir.join("plugins"),
    )
}

pub async fn channel(path: impl Into<PathBuf>) -> Channel {
    tokio::time::timeout(TIMEOUT, connect_unix(path))
        .await
        .expect("connect timed out")
        .expect("connect failed")
}

pub async fn registration(path: &Path) -> RegistrationClient<Channel> {
    RegistrationClient::new(channel(path).await)
}

pub async fn dra_v1(path: &Path) -> v1::dra_plugin_client::DraPluginClient<Channel> {
    v1::dra_plugin_client::DraPluginClient::new(channel(path).await)
}

pub async fn dra_v1beta1(path: &Path) -> v1beta1::dra_plugin_client::DraPluginClient<Channel> {
    v1beta1::dra_plugin_client::DraPluginClient::new(channel(path).await)
}

pub fn v1_claim(ns: &str, name: &str, uid: &str) -> v1::Claim {
    v1::Claim {
        namespace: ns.into(),
        name: name.into(),
        uid: uid.into(),
    }
}

pub fn v1beta1_claim(ns: &str, name: &str, uid: &str) -> v1beta1::Claim {
    v1beta1::Claim {
        namespace: ns.into(),
        name: name.into(),
        uid: uid.into(),
    }
}

pub fn claim_ref(ns: &str, name: &str, uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: ns.into(),
        name: name.into(),
        uid: uid.into(),
    }
}

pub mod kubelet;
pub mod node;
pub mod prom;
