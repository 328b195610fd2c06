//! `resource.kubernetes.io/numaNode` end to end: the real binary over the mock NVML library,
//! with `--sysfs-root` on the mock's sysfs fixture (`numa_node` per GPU, the last GPU `-1`).
//! GPUs and their MIG placements publish the node sysfs names; the GPU whose sysfs says `-1`
//! publishes no `numaNode` at all.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::node::*;
use common::*;
use serde_json::Value;

const NUMA: &str = "resource.kubernetes.io/numaNode";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numa_node_is_published_from_sysfs_and_omitted_for_minus_one() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    dirs.lay_out_driver_root("h100-80gb-x8");
    let sysfs = mock_nvml::driver_root::lay_out_sysfs(&dirs.driver_root(), "h100-80gb-x8")
        .unwrap()
        .expect("the profile is known");
    assert_eq!(sysfs.len(), 8);
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            mig: "on",
            dynamic_mig: true,
            driver_root_as_is: true,
            env: vec![(
                "SYSFS_ROOT",
                dirs.driver_root().join("sys").display().to_string(),
            )],
            ..PluginOptions::default()
        },
    );
    let started = Instant::now();
    let devices = loop {
        let devices: BTreeMap<String, Value> = standin
            .list("resourceslices")
            .iter()
            .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
            .map(|d| (d["name"].as_str().unwrap().to_owned(), d))
            .collect();
        if devices.contains_key("gpu-7") && devices.contains_key("gpu-0") {
            break devices;
        }
        assert!(started.elapsed() < TIMEOUT, "no slices\n{}", dirs.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let numa = |name: &str| devices[name]["attributes"].get(NUMA).cloned();
    for (minor, (_, want)) in sysfs.iter().enumerate() {
        let whole = format!("gpu-{minor}");
        let got = numa(&whole);
        if *want < 0 {
            assert_eq!(got, None, "{whole}: sysfs says -1");
        } else {
            assert_eq!(got, Some(serde_json::json!({"int": want})), "{whole}");
        }
        // Its MIG placements carry the same node (or none).
        for (name, d) in &devices {
            if name.starts_with(&format!("{whole}-mig-")) {
                assert_eq!(d["attributes"].get(NUMA).cloned(), got, "{name}");
            }
        }
    }
    // The PCIe root comes from the same fixture's links.
    assert!(
        devices["gpu-0"]["attributes"]["resource.kubernetes.io/pcieRoot"]["string"]
            .as_str()
            .unwrap()
            .starts_with("pci0000:"),
        "{}",
        devices["gpu-0"]
    );
    assert!(plugin.terminate().success());
}
