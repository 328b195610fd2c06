//! The `DRAResourceHealth` gRPC service (v1alpha1 and v1) over [`DeviceHealth`]'s stream.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tonic::{Request, Response, Status};

use super::proto::health::{v1 as hv1, v1alpha1 as hv1alpha1};
use crate::node::device_health::DeviceHealth;
use cleave_driver::device_health::DeviceStatus;

/// Advertised token of the v1alpha1 health service (kubelet 1.34+).
pub const HEALTH_V1ALPHA1: &str = "v1alpha1.DRAResourceHealth";
/// Advertised token of the v1 health service (kubelet 1.37+).
pub const HEALTH_V1: &str = "v1.DRAResourceHealth";
/// `health_check_timeout_seconds` sent with every device (well above the resend interval).
pub(crate) const HEALTH_TIMEOUT_SECONDS: i64 = 30;

fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

macro_rules! health_version {
    ($m:ident, $svc:ident) => {
        fn $svc(pool: &str, statuses: &[DeviceStatus]) -> $m::NodeWatchResourcesResponse {
            let now = now_unix();
            $m::NodeWatchResourcesResponse {
                devices: statuses
                    .iter()
                    .map(|s| $m::DeviceHealth {
                        device: Some($m::DeviceIdentifier {
                            pool_name: pool.to_owned(),
                            device_name: s.device.clone(),
                        }),
                        health: if s.healthy {
                            $m::HealthStatus::Healthy as i32
                        } else {
                            $m::HealthStatus::Unhealthy as i32
                        },
                        last_updated_time: now,
                        health_check_timeout_seconds: HEALTH_TIMEOUT_SECONDS,
                        message: s.message.clone(),
                    })
                    .collect(),
            }
        }

        #[tonic::async_trait]
        impl $m::dra_resource_health_server::DraResourceHealth for HealthService {
            type NodeWatchResourcesStream = Pin<
                Box<
                    dyn futures::Stream<Item = Result<$m::NodeWatchResourcesResponse, Status>>
                        + Send,
                >,
            >;

            async fn node_watch_resources(
                &self,
                _request: Request<$m::NodeWatchResourcesRequest>,
            ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
                Ok(Response::new(self.0.stream($svc)))
            }
        }
    };
}

/// The `DRAResourceHealth` gRPC service (both versions) over a [`DeviceHealth`].
#[derive(Debug, Clone)]
pub(crate) struct HealthService(pub Arc<DeviceHealth>);

health_version!(hv1alpha1, to_v1alpha1);
health_version!(hv1, to_v1);

impl HealthService {
    /// The v1alpha1 tonic service.
    pub(crate) fn v1alpha1_svc(
        &self,
    ) -> hv1alpha1::dra_resource_health_server::DraResourceHealthServer<Self> {
        hv1alpha1::dra_resource_health_server::DraResourceHealthServer::new(self.clone())
    }

    /// The v1 tonic service.
    pub(crate) fn v1_svc(&self) -> hv1::dra_resource_health_server::DraResourceHealthServer<Self> {
        hv1::dra_resource_health_server::DraResourceHealthServer::new(self.clone())
    }
}
