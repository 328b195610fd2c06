//! Plugin registration: the kubelet plugin watcher's `Registration` service, which tells
//! the kubelet who we are and where the DRA socket is, and hears its verdict.

use std::sync::Arc;

use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::{debug, info, warn};

use super::dra::{DRA_PLUGIN_V1, DRA_PLUGIN_V1BETA1};
use super::proto::registration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
    registration_server::{Registration, RegistrationServer},
};

/// Plugin type the kubelet's DRA handler registers (`PluginInfo.type`).
pub(crate) const DRA_PLUGIN_TYPE: &str = "DRAPlugin";

/// What the kubelet last said about our registration.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum RegistrationState {
    /// The kubelet has not reported yet.
    #[default]
    Pending,
    /// The kubelet accepted the plugin.
    Registered,
    /// The kubelet rejected the plugin, with its reason.
    Failed(String),
}

/// The plugin registration service: identity for the kubelet, and its verdict.
#[derive(Debug, Clone)]
pub(crate) struct RegistrationService {
    info: PluginInfo,
    state: Arc<watch::Sender<RegistrationState>>,
}

impl RegistrationService {
    /// A DRA plugin named `driver_name` whose DRA socket is `endpoint` (absolute path).
    pub(crate) fn new(driver_name: &str, endpoint: &std::path::Path) -> Self {
        let info = PluginInfo {
            r#type: DRA_PLUGIN_TYPE.to_owned(),
            name: driver_name.to_owned(),
            endpoint: endpoint.display().to_string(),
            supported_versions: vec![DRA_PLUGIN_V1.to_owned(), DRA_PLUGIN_V1BETA1.to_owned()],
        };
        Self {
            info,
            state: Arc::new(watch::channel(RegistrationState::Pending).0),
        }
    }

    /// Advertises one more service version (after those already listed).
    pub(crate) fn with_supported_version(mut self, version: &str) -> Self {
        self.info.supported_versions.push(version.to_owned());
        self
    }

    /// Follows the kubelet's registration verdicts.
    pub(crate) fn state(&self) -> watch::Receiver<RegistrationState> {
        self.state.subscribe()
    }

    /// The tonic service.
    pub(crate) fn svc(&self) -> RegistrationServer<Self> {
        RegistrationServer::new(self.clone())
    }
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        debug!("GetInfo");
        Ok(Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            info!(driver = %self.info.name, "registered with the kubelet");
            self.state.send_replace(RegistrationState::Registered);
            Ok(Response::new(RegistrationStatusResponse {}))
        } else {
            warn!(driver = %self.info.name, error = %status.error, "kubelet rejected registration");
            self.state
                .send_replace(RegistrationState::Failed(status.error.clone()));
            Err(Status::unknown(format!(
                "failed registration process: {}",
                status.error
            )))
        }
    }
}
