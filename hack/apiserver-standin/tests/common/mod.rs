//! Shared fixtures for the stand-in integration tests.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCounterConsumption, ResourcePool,
    ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

pub const DRIVER: &str = "gpu.cleave.dev";

/// A device with one string attribute.
pub fn device(name: &str) -> Device {
    Device {
        name: name.to_string(),
        attributes: Some(BTreeMap::from([(
            "type".to_string(),
            DeviceAttribute {
                string: Some("gpu".into()),
                ..Default::default()
            },
        )])),
        ..Default::default()
    }
}

/// A node-local slice with `n` devices named `gpu-<i>`.
pub fn slice(name: &str, node: &str, n: usize) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER.into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation: 1,
                resource_slice_count: 1,
            },
            devices: Some((0..n).map(|i| device(&format!("gpu-{i}"))).collect()),
            ..Default::default()
        },
    }
}

/// A slice whose devices consume counters of one shared counter set in the same slice.
pub fn slice_with_counters(name: &str, node: &str, n: usize) -> ResourceSlice {
    let mut s = slice(name, node, n);
    s.spec.shared_counters = Some(vec![CounterSet {
        name: "gpu-0-counters".into(),
        counters: BTreeMap::from([(
            "memory".to_string(),
            Counter {
                value: Quantity("80Gi".into()),
            },
        )]),
    }]);
    for d in s.spec.devices.as_mut().unwrap() {
        d.consumes_counters = Some(vec![DeviceCounterConsumption {
            counter_set: "gpu-0-counters".into(),
            counters: BTreeMap::from([(
                "memory".to_string(),
                Counter {
                    value: Quantity("1Gi".into()),
                },
            )]),
        }]);
    }
    s
}
