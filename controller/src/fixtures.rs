//! Synthetic pools for tests and benchmarks (no hardware): an H100/H200-like GPU with
//! on-demand MIG (one counter set per GPU, 26 devices) and plain whole GPUs.
//! Behind the `testing` feature (never in the shipped library), so that integration tests,
//! benchmarks and other crates' tests share one shape.

use std::collections::BTreeMap;

use cleave_api::names::{attr, cap};
use cleave_api::pool::{DeviceGroup, PoolDevices};
use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceCounterConsumption,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// H100-style MIG profiles: (name, compact name, compute slices, memory slices, starts,
/// GiB, multiprocessors, decoders, jpeg engines, ofa engines).
type Profile = (
    &'static str,
    &'static str,
    u32,
    u32,
    &'static [u32],
    u64,
    u64,
    u64,
    u64,
    u64,
);
const PROFILES: &[Profile] = &[
    (
        "1g.10gb",
        "1g10gb",
        1,
        1,
        &[0, 1, 2, 3, 4, 5, 6],
        10,
        16,
        1,
        0,
        0,
    ),
    (
        "1g.10gb+me",
        "1g10gbme",
        1,
        1,
        &[0, 1, 2, 3, 4, 5, 6],
        10,
        16,
        1,
        1,
        1,
    ),
    ("1g.20gb", "1g20gb", 1, 2, &[0, 2, 4, 6], 20, 16, 1, 0, 0),
    ("2g.20gb", "2g20gb", 2, 2, &[0, 2, 4], 20, 32, 2, 0, 0),
    ("3g.40gb", "3g40gb", 3, 4, &[0, 4], 40, 60, 3, 0, 0),
    ("4g.40gb", "4g40gb", 4, 4, &[0], 40, 64, 4, 0, 0),
    ("7g.80gb", "7g80gb", 7, 8, &[0], 80, 132, 7, 1, 1),
];
const MEMORY_SLICES: u32 = 8;
const COMPUTE_SLICES: u64 = 7;

fn q(v: u64) -> Counter {
    Counter {
        value: Quantity(v.to_string()),
    }
}

fn string_attr(s: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.to_owned()),
        ..DeviceAttribute::default()
    }
}

fn int_attr(i: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(i),
        ..DeviceAttribute::default()
    }
}

fn capacity(v: String) -> DeviceCapacity {
    DeviceCapacity {
        value: Quantity(v),
        ..DeviceCapacity::default()
    }
}

/// Name of GPU `minor`'s counter set.
pub fn counter_set_name(minor: u32) -> String {
    format!("gpu-{minor}-counters")
}

/// One GPU's counter set: `memory-slice-0..7`, `compute-slices`, `decoders`,
/// `jpeg-engines`, `ofa-engines` (12 counters).
pub fn gpu_counter_set(minor: u32) -> CounterSet {
    let mut counters = BTreeMap::new();
    for i in 0..MEMORY_SLICES {
        counters.insert(format!("memory-slice-{i}"), q(1));
    }
    counters.insert("compute-slices".to_owned(), q(COMPUTE_SLICES));
    counters.insert("decoders".to_owned(), q(7));
    counters.insert("jpeg-engines".to_owned(), q(1));
    counters.insert("ofa-engines".to_owned(), q(1));
    CounterSet {
        name: counter_set_name(minor),
        counters,
    }
}

fn gpu_uuid(minor: u32, salt: u32) -> String {
    format!("GPU-{minor:08x}-{salt:04x}-4000-8000-000000000000")
}

/// A whole-GPU device (optionally consuming every counter of its GPU's set).
pub fn whole_gpu_device(minor: u32, consume_all: Option<&CounterSet>) -> Device {
    let mut attributes = BTreeMap::new();
    attributes.insert(attr::TYPE.to_owned(), string_attr("gpu"));
    attributes.insert(attr::UUID.to_owned(), string_attr(&gpu_uuid(minor, 0)));
    attributes.insert(
        attr::PRODUCT_NAME.to_owned(),
        string_attr("NVIDIA H100 80GB HBM3"),
    );
    attributes.insert(attr::ARCHITECTURE.to_owned(), string_attr("Hopper"));
    attributes.insert(
        attr::MIG_CAPABLE.to_owned(),
        DeviceAttribute {
            bool: Some(true),
            ..DeviceAttribute::default()
        },
    );
    attributes.insert(
        attr::CUDA_COMPUTE_CAPABILITY.to_owned(),
        DeviceAttribute {
            version: Some("9.0.0".to_owned()),
            ..DeviceAttribute::default()
        },
    );
    let mut cap_map = BTreeMap::new();
    cap_map.insert(cap::MEMORY.to_owned(), capacity("80Gi".to_owned()));
    cap_map.insert(cap::MULTIPROCESSORS.to_owned(), capacity("132".to_owned()));
    Device {
        name: format!("gpu-{minor}"),
        attributes: Some(attributes),
        capacity: Some(cap_map),
        consumes_counters: consume_all.map(|set| {
            vec![DeviceCounterConsumption {
                counter_set: set.name.clone(),
                counters: set.counters.clone(),
            }]
        }),
        ..Device::default()
    }
}

/// One on-demand MIG group: the GPU's counter set, the whole GPU and 25 MIG placements
/// (26 devices, each consuming one counter set). `salt` changes the UUIDs, which
/// stands for "this GPU's state changed".
pub fn on_demand_mig_group(minor: u32, salt: u32) -> DeviceGroup {
    let set = gpu_counter_set(minor);
    let mut devices = vec![whole_gpu_device(minor, Some(&set))];
    for &(profile, compact, compute, mem, starts, gib, sms, dec, jpeg, ofa) in PROFILES {
        for &start in starts {
            let mut counters = BTreeMap::new();
            for s in start..start + mem {
                counters.insert(format!("memory-slice-{s}"), q(1));
            }
            counters.insert("compute-slices".to_owned(), q(u64::from(compute)));
            counters.insert("decoders".to_owned(), q(dec));
            if jpeg > 0 {
                counters.insert("jpeg-engines".to_owned(), q(jpeg));
            }
            if ofa > 0 {
                counters.insert("ofa-engines".to_owned(), q(ofa));
            }
            let mut attributes = BTreeMap::new();
            attributes.insert(attr::TYPE.to_owned(), string_attr("mig"));
            attributes.insert(
                attr::PARENT_UUID.to_owned(),
                string_attr(&gpu_uuid(minor, salt)),
            );
            attributes.insert(
                attr::PRODUCT_NAME.to_owned(),
                string_attr("NVIDIA H100 80GB HBM3"),
            );
            attributes.insert(attr::PROFILE.to_owned(), string_attr(profile));
            attributes.insert(attr::PLACEMENT_START.to_owned(), int_attr(i64::from(start)));
            attributes.insert(attr::PLACEMENT_SIZE.to_owned(), int_attr(i64::from(mem)));
            let mut cap_map = BTreeMap::new();
            cap_map.insert(cap::MEMORY.to_owned(), capacity(format!("{gib}Gi")));
            cap_map.insert(cap::MULTIPROCESSORS.to_owned(), capacity(sms.to_string()));
            cap_map.insert(
                cap::COPY_ENGINES.to_owned(),
                capacity(u64::from(compute).to_string()),
            );
            cap_map.insert(cap::DECODERS.to_owned(), capacity(dec.to_string()));
            cap_map.insert(cap::ENCODERS.to_owned(), capacity("0".to_owned()));
            cap_map.insert(cap::JPEG_ENGINES.to_owned(), capacity(jpeg.to_string()));
            cap_map.insert(cap::OFA_ENGINES.to_owned(), capacity(ofa.to_string()));
            devices.push(Device {
                name: format!("gpu-{minor}-mig-{compact}-{start}"),
                attributes: Some(attributes),
                capacity: Some(cap_map),
                consumes_counters: Some(vec![DeviceCounterConsumption {
                    counter_set: set.name.clone(),
                    counters,
                }]),
                ..Device::default()
            });
        }
    }
    DeviceGroup {
        counter_sets: vec![set],
        devices,
    }
}

/// A node of `gpus` H100-like GPUs with on-demand MIG (26 devices and one 12-counter set
/// per GPU).
pub fn on_demand_mig_pool(gpus: u32) -> PoolDevices {
    PoolDevices {
        groups: (0..gpus).map(|m| on_demand_mig_group(m, 0)).collect(),
    }
}

/// A node of `gpus` whole GPUs, no counters.
pub fn whole_gpu_pool(gpus: u32) -> PoolDevices {
    PoolDevices {
        groups: (0..gpus)
            .map(|m| DeviceGroup {
                counter_sets: Vec::new(),
                devices: vec![whole_gpu_device(m, None)],
            })
            .collect(),
    }
}
