//! `--device-taints=auto`: the stored slices are read back from the API server stand-in;
//! when the tainted device came back without its taint (the `DRADeviceTaints` gate is
//! off), unhealthy devices are removed from the pool instead; when it kept it, taints stay.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use clap::Parser as _;
use cleave_api::pool::{DeviceGroup, PoolDevices};
use cleave_apiserver_standin::{StandIn, StandInOptions};
use cleave_controller::PublisherStatus;
use cleave_driver::device_health::TAINT_XID;
use cleave_driver::health::{HealthEvent, HealthEventKind};
use cleave_kubelet_plugin::DeviceHealth;
use cleave_kubelet_plugin::args::HealthArgs;
use cleave_testkit::gpu::{gpu_uuid, h100, inventory};
use k8s_openapi::api::resource::v1::{Device, DeviceTaint, ResourceSlice};
use serde_json::json;

#[derive(clap::Parser)]
struct Flags {
    #[command(flatten)]
    health: HealthArgs,
}

fn pool() -> PoolDevices {
    PoolDevices {
        groups: vec![DeviceGroup {
            counter_sets: Vec::new(),
            devices: ["gpu-0", "gpu-1"]
                .iter()
                .map(|n| Device {
                    name: (*n).into(),
                    ..Default::default()
                })
                .collect(),
        }],
    }
}

fn stored_slice(taints: Option<Vec<DeviceTaint>>) -> ResourceSlice {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "n1-gpu.cleave.dev-abc"},
        "spec": {
            "driver": "gpu.cleave.dev",
            "nodeName": "n1",
            "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {"name": "gpu-0"},
                {"name": "gpu-1", "taints": taints},
            ],
        },
    }))
    .unwrap()
}

async fn run(taints: Option<Vec<DeviceTaint>>) -> (Arc<DeviceHealth>, Option<bool>) {
    cleave_kubelet_plugin::install_crypto_provider();
    let standin = StandIn::start(StandInOptions::default()).await.unwrap();
    standin.put(&stored_slice(taints)).unwrap();
    let args = Flags::try_parse_from(["x", "--device-taints", "auto"])
        .unwrap()
        .health;
    let health = Arc::new(DeviceHealth::new("n1", pool(), &args));
    let inv = inventory(vec![h100(0), h100(1)]);
    assert!(!health.needs_taint_check(), "nothing tainted yet");
    health.apply(
        &HealthEvent {
            gpu_uuid: gpu_uuid(1),
            gi: None,
            ci: None,
            kind: HealthEventKind::Xid,
            xid: Some(79),
            fatal: true,
        },
        &inv,
    );
    assert!(health.needs_taint_check());
    // Auto publishes with the taint first.
    let first = health.pool_to_publish();
    assert_eq!(first.device_count(), 2);
    let status = tokio::sync::watch::channel(PublisherStatus {
        published: true,
        published_version: 3,
        ..PublisherStatus::default()
    })
    .1;
    let verdict = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        Arc::clone(&health).verify_taints(standin.client(), "gpu.cleave.dev".into(), 3, status),
    )
    .await
    .unwrap();
    (health, verdict)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_taints_fall_back_to_removal() {
    let (health, verdict) = run(None).await;
    assert_eq!(verdict, Some(false));
    let mut changes = health.subscribe();
    assert!(changes.has_changed().is_ok());
    let names: Vec<String> = health
        .pool_to_publish()
        .devices()
        .map(|d| d.name.clone())
        .collect();
    assert_eq!(names, ["gpu-0"]);
    assert!(!health.needs_taint_check());
    changes.mark_unchanged();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_taints_stay() {
    let taint = DeviceTaint {
        key: TAINT_XID.into(),
        value: Some("79".into()),
        effect: "NoSchedule".into(),
        time_added: None,
    };
    let (health, verdict) = run(Some(vec![taint])).await;
    assert_eq!(verdict, Some(true));
    let pool = health.pool_to_publish();
    let d: Vec<&Device> = pool.devices().collect();
    assert_eq!(d.len(), 2);
    assert_eq!(d[1].taints.as_ref().unwrap()[0].key, TAINT_XID);
    assert!(!health.needs_taint_check());
}
