//! The example claim that aligns GPUs on `resource.kubernetes.io/numaNode`
//! (`deployments/examples/numa-aligned.yaml`) placed by the constraint model over the real
//! `build_pool` output of a node whose GPUs sit on two NUMA nodes (and one GPU whose sysfs
//! says -1, so it has no `numaNode`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use cleave_driver::model::{GpuInfo, NodeInventory};
use cleave_driver::pool::{PoolOptions, build_pool};
use cleave_packing::constraints::{devices, place};
use cleave_testkit::gpu::{h100, inventory};
use k8s_openapi::serde::Deserialize as _;

/// GPUs 0-3 on NUMA node 0, 4-6 on node 1, 7 unknown.
fn node() -> NodeInventory {
    inventory(
        (0..8u32)
            .map(|minor| GpuInfo {
                numa_node: match minor {
                    0..4 => Some(0),
                    4..7 => Some(1),
                    _ => None,
                },
                ..h100(minor)
            })
            .collect(),
    )
}

/// The example's requests (the `type` each class selects) and the constrained attribute.
fn example() -> (Vec<&'static str>, String) {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../deployments/examples/numa-aligned.yaml"),
    )
    .unwrap();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v: serde_json::Value =
            serde_yaml::from_value(serde_yaml::Value::deserialize(doc).unwrap()).unwrap();
        if v["kind"] != "ResourceClaimTemplate" {
            continue;
        }
        let devices = &v["spec"]["spec"]["devices"];
        let requests = devices["requests"]
            .as_array()
            .unwrap()
            .iter()
            .map(
                |r| match r["exactly"]["deviceClassName"].as_str().unwrap() {
                    "gpu.cleave.dev" => "gpu",
                    "mig.cleave.dev" => "mig",
                    other => panic!("class {other} not modelled"),
                },
            )
            .collect();
        let attribute = devices["constraints"][0]["matchAttribute"]
            .as_str()
            .unwrap()
            .to_owned();
        return (requests, attribute);
    }
    panic!("no ResourceClaimTemplate in the example");
}

#[test]
fn the_numa_example_lands_on_one_numa_node_or_not_at_all() {
    let (requests, attribute) = example();
    assert_eq!(attribute, "resource.kubernetes.io/numaNode");
    assert_eq!(requests, ["gpu", "gpu"]);
    let pool = build_pool(&node(), &PoolOptions::default());
    let devs = devices(&pool, &attribute, cleave_api::names::DRIVER_NAME);
    assert_eq!(
        devs.iter().find(|d| d.name == "gpu-7").unwrap().value,
        None,
        "gpu-7 has no numaNode"
    );

    // A fresh node: the first two GPUs, both on node 0.
    let got = place(&devs, &BTreeSet::new(), &requests).unwrap();
    assert_eq!(got, ["gpu-0", "gpu-1"]);

    // Node 0 has one GPU left: first fit takes it, finds no partner, backtracks to node 1.
    let taken: BTreeSet<String> = ["gpu-0", "gpu-1", "gpu-2"].map(String::from).into();
    assert_eq!(place(&devs, &taken, &requests).unwrap(), ["gpu-4", "gpu-5"]);

    // One free GPU per NUMA node plus the unknown one: nothing fits (gpu-7 never matches).
    let taken: BTreeSet<String> = ["gpu-0", "gpu-1", "gpu-2", "gpu-4", "gpu-5"]
        .map(String::from)
        .into();
    assert_eq!(place(&devs, &taken, &requests), None);
}
