//! Device metadata files (KEP-5304) through the real binary over the mock NVML library and
//! the API server stand-in: with `--device-metadata` (`DEVICE_METADATA=true`) a prepare
//! writes the request's metadata file and its CDI spec and adds the spec's ID to the
//! request's first device; unprepare removes both. Without the flag nothing is written and
//! the answer has only the claim's own CDI IDs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::node::*;
use common::*;
use serde_json::Value;

const UID: &str = "uid-meta";

async fn prepare_one(env: Vec<(&'static str, String)>) -> (NodeDirs, Plugin, Vec<String>) {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(&standin, "meta", UID, &[("gpu", "gpu-2")], &[]);
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            env,
            ..PluginOptions::default()
        },
    );
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let r = prepare(&mut dra, vec![claim("meta", UID)]).await;
    let c = &r.claims[UID];
    assert_eq!(c.error, "", "{}", dirs.log());
    assert_eq!(c.devices.len(), 1);
    let ids = c.devices[0].cdi_device_ids.clone();
    (dirs, plugin, ids)
}

fn metadata_file(dirs: &NodeDirs) -> std::path::PathBuf {
    dirs.state_dir()
        .join("dra-device-metadata/default_meta/gpu/metadata.json")
}

fn metadata_spec(dirs: &NodeDirs) -> std::path::PathBuf {
    dirs.cdi_root()
        .join(format!("{DRIVER}_metadata_{UID}_gpu.json"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_flag_the_file_and_spec_are_written_and_removed() {
    let (dirs, plugin, ids) = prepare_one(vec![("DEVICE_METADATA", "true".into())]).await;
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert_eq!(ids[1], format!("{DRIVER}/metadata={UID}_gpu"));
    let text = std::fs::read_to_string(metadata_file(&dirs)).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(doc["apiVersion"], "metadata.resource.k8s.io/v1alpha1");
    assert_eq!(doc["kind"], "DeviceMetadata");
    assert_eq!(doc["metadata"]["name"], "meta");
    assert_eq!(doc["metadata"]["namespace"], "default");
    assert_eq!(doc["metadata"]["uid"], UID);
    assert_eq!(doc["metadata"]["generation"], 1);
    let request = &doc["requests"][0];
    assert_eq!(request["name"], "gpu");
    let device = &request["devices"][0];
    assert_eq!(device["driver"], DRIVER);
    assert_eq!(device["pool"], NODE);
    assert_eq!(device["name"], "gpu-2");
    let uuid = device["attributes"][format!("{DRIVER}/uuid")]["string"]
        .as_str()
        .unwrap();
    assert!(uuid.starts_with("GPU-"), "{device}");
    assert_eq!(
        device["attributes"][format!("{DRIVER}/type")]["string"],
        "gpu"
    );
    let spec: Value =
        serde_json::from_slice(&std::fs::read(metadata_spec(&dirs)).unwrap()).unwrap();
    assert_eq!(spec["kind"], format!("{DRIVER}/metadata"));
    assert_eq!(spec["devices"][0]["name"], format!("{UID}_gpu"));
    let mount = &spec["devices"][0]["containerEdits"]["mounts"][0];
    assert_eq!(
        mount["hostPath"],
        metadata_file(&dirs).display().to_string()
    );
    assert_eq!(
        mount["containerPath"],
        format!(
            "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/meta/gpu/{DRIVER}-metadata.json"
        )
    );

    let mut dra = dra_v1(&plugin.dra_socket).await;
    let u = unprepare(&mut dra, vec![claim("meta", UID)]).await;
    assert_eq!(u.claims[UID].error, "");
    assert!(!metadata_file(&dirs).exists() && !metadata_spec(&dirs).exists());
    assert!(plugin.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_flag_nothing_is_written() {
    let (dirs, plugin, ids) = prepare_one(Vec::new()).await;
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert!(!ids[0].contains("/metadata="));
    assert!(!dirs.state_dir().join("dra-device-metadata").exists());
    assert!(!metadata_spec(&dirs).exists());
    assert!(plugin.terminate().success());
}
