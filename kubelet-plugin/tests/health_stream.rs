//! The health stream served in-process: the complete list is re-sent at the resend
//! interval without any change, several watchers get the same list, and shutdown ends
//! every stream promptly (the DRA server can stop).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser as _;
use cleave_api::pool::{DeviceGroup, PoolDevices};
use cleave_kubelet_plugin::DeviceHealth;
use cleave_kubelet_plugin::PluginServer;
use cleave_kubelet_plugin::args::HealthArgs;
use cleave_kubelet_plugin::proto::health::{v1 as hv1, v1alpha1 as hv1alpha1};
use common::*;
use k8s_openapi::api::resource::v1::Device;

#[derive(clap::Parser)]
struct Flags {
    #[command(flatten)]
    health: HealthArgs,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_resends_complete_list_and_ends_on_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let pool = PoolDevices {
        groups: vec![DeviceGroup {
            counter_sets: Vec::new(),
            devices: ["gpu-0", "gpu-1", "gpu-1-mig-1g10gb-0"]
                .iter()
                .map(|n| Device {
                    name: (*n).into(),
                    ..Default::default()
                })
                .collect(),
        }],
    };
    let args = Flags::try_parse_from(["x"]).unwrap().health;
    let health = Arc::new(
        DeviceHealth::new("node-a", pool, &args).with_resend_interval(Duration::from_millis(100)),
    );
    let server = PluginServer::start_with_health(
        &config(dir.path()),
        Arc::new(FakeHandler::default()),
        None,
        Some(Arc::clone(&health)),
    )
    .await
    .unwrap();

    // The stream's own clock starts when the server takes the call, so the three messages
    // below (start and two resends) are timed from before the call: from after it, a slow
    // call would eat into the 200 ms.
    let started = Instant::now();
    let mut a = hv1alpha1::dra_resource_health_client::DraResourceHealthClient::new(
        channel(server.dra_socket()).await,
    )
    .node_watch_resources(hv1alpha1::NodeWatchResourcesRequest {})
    .await
    .unwrap()
    .into_inner();
    let mut b = hv1::dra_resource_health_client::DraResourceHealthClient::new(
        channel(server.dra_socket()).await,
    )
    .node_watch_resources(hv1::NodeWatchResourcesRequest {})
    .await
    .unwrap()
    .into_inner();

    // Three messages in a row on v1alpha1 without any change: start + resends.
    for _ in 0..3 {
        let m = tokio::time::timeout(TIMEOUT, a.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let names: Vec<_> = m
            .devices
            .iter()
            .map(|d| d.device.as_ref().unwrap().device_name.as_str())
            .collect();
        assert_eq!(names, ["gpu-0", "gpu-1", "gpu-1-mig-1g10gb-0"]);
        assert!(m.devices.iter().all(|d| {
            d.health == hv1alpha1::HealthStatus::Healthy as i32
                && d.device.as_ref().unwrap().pool_name == "node-a"
                && d.health_check_timeout_seconds == 30
        }));
    }
    assert!(started.elapsed() >= Duration::from_millis(190));
    let first = tokio::time::timeout(TIMEOUT, b.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.devices.len(), 3);

    // Shutdown ends both streams and returns well inside the server's grace period.
    let t = Instant::now();
    server.shutdown().await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let drain_a = tokio::time::timeout(TIMEOUT, async {
        while let Ok(Some(_)) = a.message().await {}
    });
    let drain_b = tokio::time::timeout(TIMEOUT, async {
        while let Ok(Some(_)) = b.message().await {}
    });
    assert!(drain_a.await.is_ok() && drain_b.await.is_ok());
}
