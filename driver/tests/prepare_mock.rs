//! Prepare/unprepare through the real NVML code path (`NvmlBackend` over the mock NVML
//! library): on-demand MIG create/destroy for every profile and placement of every
//! MIG-capable mock product, refusals by the "hardware" surfacing as clear errors, and
//! crash recovery against persistent mock state. One child process per scenario (the mock
//! reads its environment at init; see `common`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::sync::Arc;

use cleave_api::names::{DRIVER_NAME, DeviceName};
use cleave_driver::backend::GpuBackend;
use cleave_driver::checkpoint::{
    CheckpointStore, ClaimRecord, ClaimState, DeviceKind, DeviceRecord, MigRecord,
};
use cleave_driver::model::{MigState, Placement};
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::prepare::{DriverConfig, NodeDriver, PrepareError};
use k8s_openapi::api::resource::v1::ResourceClaim;

use cleave_driver::prepare::testing::node_claim;
use common::{child_tmp, mock_lib, run_child, scenario};

const MIG_PRODUCTS: [&str; 4] = [
    "a100-40gb-x8",
    "a100-80gb-x4",
    "h100-80gb-x8",
    "h200-141gb-x8",
];

fn config(dir: &Path, dynamic_mig: bool) -> DriverConfig {
    let boot_id_path = dir.join("boot_id");
    if !boot_id_path.exists() {
        std::fs::write(&boot_id_path, "boot-1\n").unwrap();
    }
    DriverConfig {
        dynamic_mig,
        ..common::node_config(dir, dir.join("plugins").join(DRIVER_NAME))
    }
}

fn backend() -> Arc<NvmlBackend> {
    Arc::new(NvmlBackend::open(Some(&mock_lib())).expect("mock NVML opens"))
}

fn claim(uid: &str, devices: &[(&str, &str)]) -> ResourceClaim {
    node_claim(uid, devices)
}

fn uid(n: usize) -> String {
    format!("{n:08x}-0000-4000-8000-000000000000")
}

fn for_each_product(test: &str, products: &[&str]) {
    for product in products {
        run_child(test, product, &[("MOCK_NVML_PROFILE", product)]);
    }
}

/// Every profile at every placement of GPU 0, and the whole GPU 1 as a full-size instance:
/// prepare creates exactly the allocated instance, unprepare destroys it.
#[test]
fn on_demand_mig_for_every_profile_and_placement() {
    let Some(product) = scenario() else {
        return for_each_product(
            "on_demand_mig_for_every_profile_and_placement",
            &MIG_PRODUCTS,
        );
    };
    let dir = child_tmp();
    let nvml = backend();
    let driver = NodeDriver::start(config(&dir, true), nvml.clone()).unwrap();
    let inv = driver.inventory();
    let gpu0 = inv.gpus.iter().find(|g| g.minor == 0).unwrap().clone();
    let MigState::Enabled { profiles, .. } = &gpu0.mig else {
        panic!("{product}: MIG not enabled on GPU 0");
    };
    let mut n = 0;
    for profile in profiles {
        for placement in &profile.placements {
            n += 1;
            let device = DeviceName::mig(0, &profile.name, placement.start).to_string();
            let uid = uid(n);
            let prepared = driver.prepare(&claim(&uid, &[("mig", &device)])).unwrap();
            assert_eq!(prepared.devices[0].device_name, device);
            let now = nvml.list_mig(&gpu0.uuid).unwrap();
            assert_eq!(now.len(), 1, "{product} {device}: {now:?}");
            assert_eq!(
                (now[0].profile_id, now[0].placement),
                (profile.id, *placement),
                "{product} {device}"
            );
            assert_eq!(driver.owned_mig_uuids(), [now[0].uuid.clone()].into());
            let spec = std::fs::read_to_string(
                dir.join("cdi")
                    .join(format!("k8s.gpu.cleave.dev-claim_{uid}.json")),
            )
            .unwrap();
            assert!(spec.contains(&now[0].uuid), "{spec}");
            driver.unprepare(&uid).unwrap();
            assert_eq!(nvml.list_mig(&gpu0.uuid).unwrap(), [], "{product} {device}");
        }
    }
    assert!(n >= 25, "{product}: only {n} placements");

    let gpu1 = inv.gpus.iter().find(|g| g.minor == 1).unwrap();
    driver
        .prepare(&claim(&uid(999), &[("gpu", "gpu-1")]))
        .unwrap();
    let full = nvml.list_mig(&gpu1.uuid).unwrap();
    assert_eq!(full.len(), 1);
    assert_eq!(full[0].placement, Placement { start: 0, size: 8 });
    assert!(full[0].profile_name.starts_with("7g."), "{:?}", full[0]);
    driver.unprepare(&uid(999)).unwrap();
    assert_eq!(nvml.list_mig(&gpu1.uuid).unwrap(), []);
}

/// Overlapping placements (which the scheduler's counters should prevent) are refused by
/// the mock as NVML would, and the refusal reaches the caller with the NVML code; nothing
/// of the refused claim is left.
#[test]
fn overlapping_placements_are_refused_with_the_nvml_code() {
    let Some(_) = scenario() else {
        return for_each_product(
            "overlapping_placements_are_refused_with_the_nvml_code",
            &["h100-80gb-x8"],
        );
    };
    let dir = child_tmp();
    let nvml = backend();
    let driver = NodeDriver::start(config(&dir, true), nvml.clone()).unwrap();
    let gpu0 = driver.inventory().gpus[0].uuid.clone();
    // An instance made behind cleave's back (3g.40gb, profile 9, at 0): NVML refuses the
    // overlapping placements with its own code.
    let outside = nvml
        .create_mig(&gpu0, 9, Placement { start: 0, size: 4 })
        .unwrap();
    let e = driver
        .prepare(&claim(&uid(2), &[("mig", "gpu-0-mig-2g20gb-2")]))
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PrepareError::MigCreate { .. }), "{msg}");
    assert!(
        msg.contains("gpu-0-mig-2g20gb-2") && msg.contains("NVML return code 23"),
        "{msg}"
    );
    // Whole GPU on a GPU with an instance: refused too.
    let e = driver
        .prepare(&claim(&uid(3), &[("gpu", "gpu-0")]))
        .unwrap_err();
    assert!(matches!(e, PrepareError::MigCreate { .. }), "{e}");
    assert_eq!(nvml.list_mig(&gpu0).unwrap().len(), 1);
    assert!(driver.prepared_claims().is_empty());
    nvml.destroy_mig(&gpu0, outside.gi_id, outside.ci_id)
        .unwrap();
    // An overlap with a placement prepared for another claim never reaches NVML: prepare
    // refuses it as an over-commit first.
    driver
        .prepare(&claim(&uid(1), &[("mig", "gpu-0-mig-3g40gb-0")]))
        .unwrap();
    let e = driver
        .prepare(&claim(&uid(2), &[("mig", "gpu-0-mig-2g20gb-2")]))
        .unwrap_err();
    assert!(e.to_string().contains("over-commit"), "{e}");
    assert_eq!(driver.prepared_claims().len(), 1);
    let cdi: Vec<_> = std::fs::read_dir(dir.join("cdi")).unwrap().collect();
    assert_eq!(cdi.len(), 1);
    driver.unprepare(&uid(1)).unwrap();
    assert_eq!(nvml.list_mig(&gpu0).unwrap(), []);
}

/// An injected NVML failure of the GI creation reaches the caller with its code.
#[test]
fn injected_create_failure_surfaces() {
    let Some(_) = scenario() else {
        run_child(
            "injected_create_failure_surfaces",
            "a100-40gb-x8",
            &[
                ("MOCK_NVML_PROFILE", "a100-40gb-x8"),
                (
                    "MOCK_NVML_FAIL",
                    "nvmlDeviceCreateGpuInstanceWithPlacement=999",
                ),
            ],
        );
        return;
    };
    let dir = child_tmp();
    let driver = NodeDriver::start(config(&dir, true), backend()).unwrap();
    let e = driver
        .prepare(&claim(&uid(1), &[("mig", "gpu-0-mig-1g5gb-0")]))
        .unwrap_err();
    assert!(e.to_string().contains("NVML return code 999"), "{e}");
    assert!(driver.prepared_claims().is_empty());
}

/// Crash recovery against persistent mock state: an instance created for a claim whose
/// prepare never finished is destroyed at the next start; an administrator's instance is
/// used as a static device and survives unprepare.
#[test]
fn restart_rolls_back_interrupted_prepare_and_keeps_static_instances() {
    let Some(_) = scenario() else {
        return for_each_product(
            "restart_rolls_back_interrupted_prepare_and_keeps_static_instances",
            &["a100-80gb-x4"],
        );
    };
    let dir = child_tmp();
    let nvml = backend();
    let gpu0 = nvml.inventory().unwrap().gpus[0].clone();
    let MigState::Enabled { profiles, .. } = &gpu0.mig else {
        panic!("MIG off");
    };
    let p2g = profiles.iter().find(|p| p.slice_count == 2).unwrap();
    let p3g = profiles.iter().find(|p| p.slice_count == 3).unwrap();
    // The admin's instance, and the one a crashed prepare made.
    let admin = nvml
        .create_mig(&gpu0.uuid, p3g.id, Placement { start: 4, size: 4 })
        .unwrap();
    let orphan = nvml
        .create_mig(&gpu0.uuid, p2g.id, Placement { start: 0, size: 2 })
        .unwrap();
    let cfg = config(&dir, false);
    std::fs::create_dir_all(&cfg.state_dir).unwrap();
    let store = CheckpointStore::in_dir(&cfg.state_dir);
    let mut data = store.load().unwrap();
    data.boot_id = "boot-1".into();
    let crashed = uid(7);
    data.claims.insert(
        crashed.clone(),
        ClaimRecord {
            uid: crashed.clone(),
            namespace: "default".into(),
            name: "crashed".into(),
            state: ClaimState::PrepareStarted,
            devices: vec![DeviceRecord {
                name: DeviceName::mig(0, &p2g.name, 0).to_string(),
                pool: "node-a".into(),
                request_names: vec!["mig".into()],
                kind: DeviceKind::Mig,
                admin_access: false,
                gpu_uuid: gpu0.uuid.clone(),
                gpu_minor: 0,
                mig: Some(MigRecord {
                    profile_id: p2g.id,
                    profile_name: p2g.name.clone(),
                    placement: Placement { start: 0, size: 2 },
                    uuid: None,
                    gi_id: None,
                    ci_id: None,
                    created_by_cleave: true,
                    creating_in_boot: None,
                }),
                config: None,
                cdi_device_ids: vec![],
                share: None,
            }],
            sharing: None,
        },
    );
    store.store(&data).unwrap();

    // Static mode this time: the admin's instance is a device, placements are not.
    let driver = NodeDriver::start(cfg, nvml.clone()).unwrap();
    let left = nvml.list_mig(&gpu0.uuid).unwrap();
    assert_eq!(
        left,
        std::slice::from_ref(&admin),
        "orphan {orphan:?} not destroyed"
    );
    assert!(driver.prepared_claims().is_empty());

    let static_dev = DeviceName::mig(0, &p3g.name, 4).to_string();
    driver
        .prepare(&claim(&uid(8), &[("mig", &static_dev)]))
        .unwrap();
    assert!(driver.owned_mig_uuids().is_empty());
    let e = driver
        .prepare(&claim(
            &uid(9),
            &[("mig", &DeviceName::mig(0, &p2g.name, 0).to_string())],
        ))
        .unwrap_err();
    assert!(matches!(e, PrepareError::UnknownDevice { .. }), "{e}");
    driver.unprepare(&uid(8)).unwrap();
    assert_eq!(nvml.list_mig(&gpu0.uuid).unwrap(), [admin]);
}

/// A GPU without MIG: whole-GPU prepare needs no MIG call; MIG names are unknown.
#[test]
fn non_mig_gpus_prepare_whole() {
    let Some(_) = scenario() else {
        return for_each_product("non_mig_gpus_prepare_whole", &["l4-x2"]);
    };
    let dir = child_tmp();
    let driver = NodeDriver::start(config(&dir, true), backend()).unwrap();
    let prepared = driver
        .prepare(&claim(&uid(1), &[("a", "gpu-0"), ("b", "gpu-1")]))
        .unwrap();
    assert_eq!(prepared.devices.len(), 2);
    let e = driver
        .prepare(&claim(&uid(2), &[("mig", "gpu-0-mig-1g10gb-0")]))
        .unwrap_err();
    assert!(matches!(e, PrepareError::UnknownDevice { .. }), "{e}");
    driver.unprepare(&uid(1)).unwrap();
    assert!(driver.prepared_claims().is_empty());
}
