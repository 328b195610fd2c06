//! Discovery and MIG create/destroy through the real NVML code path (nvml-wrapper over
//! dlopen) against the mock NVML library, one child process per scenario (see
//! `common`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;

use cleave_driver::backend::{BackendError, GpuBackend};
use cleave_driver::model::{MigState, Placement};
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::pool::{PoolOptions, build_pool, limit_violations};

use cleave_testkit::gpu::{architecture, mig_profiles, node_product};
use common::{PROFILES, gpu, mock_lib, run_child, scenario};

fn open() -> NvmlBackend {
    NvmlBackend::open(Some(&mock_lib())).expect("mock NVML opens")
}

/// Every built-in profile with MIG on (the mock's default): identity, versions and the
/// profile tables of MIG profile tables, docs/hardware-sources.md.
#[test]
fn discovers_every_profile() {
    if let Some(profile) = scenario() {
        let (facts, count) = node_product(&profile);
        // A sysfs stand-in where GPU 0's bus ID links below root complex pci0000:50.
        let sysfs = tempfile::tempdir().unwrap();
        let devices = sysfs.path().join("bus/pci/devices");
        std::fs::create_dir_all(&devices).unwrap();
        let backend = open().with_sysfs_root(sysfs.path());
        let first = backend.inventory().unwrap();
        let bus0 = first.gpus[0].pci_bus_id.clone();
        std::os::unix::fs::symlink(
            format!("../../../devices/pci0000:50/0000:50:01.0/{bus0}"),
            devices.join(&bus0),
        )
        .unwrap();
        let t = std::time::Instant::now();
        let inv = backend.inventory().unwrap();
        println!(
            "{profile}: inventory of {count} GPUs took {:?} (profile tables cached)",
            t.elapsed()
        );
        assert_eq!(inv.gpus[0].pcie_root.as_deref(), Some("pci0000:50"));
        assert!(inv.gpus[1..].iter().all(|g| g.pcie_root.is_none()));
        assert_eq!(first.gpus[0].pcie_root, None);
        assert_eq!(first.gpus[1..], inv.gpus[1..]);
        assert_eq!(inv.driver_version, "570.148.08");
        assert_eq!(inv.driver_semver, "570.148.8");
        assert_eq!(inv.cuda_driver_semver, "12.8.0");
        assert_eq!(inv.gpus.len(), count);
        let minors: Vec<u32> = inv.gpus.iter().map(|g| g.minor).collect();
        assert_eq!(minors, (0..count as u32).collect::<Vec<_>>());
        let uuids: BTreeSet<&str> = inv.gpus.iter().map(|g| g.uuid.as_str()).collect();
        assert_eq!(uuids.len(), count, "GPU UUIDs must be unique");
        let buses: BTreeSet<&str> = inv.gpus.iter().map(|g| g.pci_bus_id.as_str()).collect();
        assert_eq!(buses.len(), count);
        for g in &inv.gpus {
            assert!(g.uuid.starts_with("GPU-"), "{}", g.uuid);
            let (major, minor) = facts.compute_capability;
            assert_eq!(g.product_name, facts.name);
            assert_eq!(g.brand, "Nvidia");
            assert_eq!(g.architecture, architecture(facts));
            assert_eq!(
                g.cuda_compute_capability,
                (major.unsigned_abs(), minor.unsigned_abs())
            );
            assert_eq!(g.memory_bytes, facts.memory_mib << 20);
            assert_eq!(g.multiprocessors, Some(facts.sm_count));
            let b = &g.pci_bus_id;
            assert!(
                b.len() == 12
                    && b.starts_with("0000:")
                    && b.ends_with(":00.0")
                    && *b == b.to_lowercase(),
                "{b}"
            );
            let expected = mig_profiles(facts.key);
            if expected.is_empty() {
                assert_eq!(g.mig, MigState::NotCapable);
                continue;
            }
            let MigState::Enabled {
                profiles,
                instances,
                memory_slices,
            } = &g.mig
            else {
                panic!("{}: MIG not enabled: {:?}", g.uuid, g.mig);
            };
            assert!(instances.is_empty());
            assert_eq!(*memory_slices, 8);
            assert_eq!(profiles.len(), expected.len());
            for f in expected {
                let mut p = profiles
                    .iter()
                    .find(|p| p.id == f.id)
                    .unwrap_or_else(|| panic!("{profile}: no profile id {}", f.id))
                    .clone();
                p.placements.sort();
                assert_eq!(p, f, "{profile} id {}", f.id);
            }
        }
        // Bus IDs of the HGX layout (device identity, docs/hardware-sources.md QX capture): minors 0..7 in bus order.
        if profile.starts_with("h100") {
            let expected = [0x53, 0x64, 0x75, 0x86, 0x97, 0xa8, 0xb9, 0xca];
            for (g, bus) in inv.gpus.iter().zip(expected) {
                assert_eq!(g.pci_bus_id, format!("0000:{bus:02x}:00.0"));
            }
        }
        return;
    }
    std::thread::scope(|s| {
        for profile in PROFILES {
            s.spawn(move || {
                run_child(
                    "discovers_every_profile",
                    profile,
                    &[("MOCK_NVML_PROFILE", profile)],
                )
            });
        }
    });
}

/// MIG mode off: capable GPUs are `Disabled` and publish one whole-GPU device each.
#[test]
fn mig_disabled_gpus_are_whole_devices() {
    if let Some(profile) = scenario() {
        let inv = open().inventory().unwrap();
        for g in &inv.gpus {
            assert!(
                matches!(g.mig, MigState::Disabled { .. }),
                "{}: {:?}",
                g.uuid,
                g.mig
            );
        }
        for dynamic_mig in [false, true] {
            let pool = build_pool(
                &inv,
                &PoolOptions {
                    dynamic_mig,
                    ..Default::default()
                },
            );
            assert_eq!(pool.device_count(), inv.gpus.len(), "{profile}");
            assert!(pool.groups.iter().all(|g| g.counter_sets.is_empty()));
            assert!(limit_violations(&pool).is_empty());
        }
        return;
    }
    for profile in ["a100-40gb-x8", "h100-80gb-x8"] {
        run_child(
            "mig_disabled_gpus_are_whole_devices",
            profile,
            &[("MOCK_NVML_PROFILE", profile), ("MOCK_NVML_MIG", "off")],
        );
    }
}

/// Create, list, survive a restart, refuse an overlap, roll back a failed compute
/// instance, destroy idempotently.
#[test]
fn create_and_destroy_mig() {
    if scenario().is_some() {
        let control = std::path::PathBuf::from(std::env::var("MOCK_NVML_CONTROL").unwrap());
        std::fs::write(&control, "").unwrap();
        let backend = open();
        let inv = backend.inventory().unwrap();
        let gpu0 = gpu(&inv, 0).uuid.clone();
        let gpu1 = gpu(&inv, 1).uuid.clone();

        // 3g.40gb at slices 4-7.
        let three = backend
            .create_mig(&gpu0, 9, Placement { start: 4, size: 4 })
            .unwrap();
        assert!(three.uuid.starts_with("MIG-"), "{}", three.uuid);
        assert_eq!(three.profile_id, 9);
        assert_eq!(three.profile_name, "3g.40gb");
        assert_eq!(three.placement, Placement { start: 4, size: 4 });
        assert_eq!(backend.list_mig(&gpu0).unwrap(), vec![three.clone()]);
        assert!(backend.list_mig(&gpu1).unwrap().is_empty());

        // The inventory shows it; a static pool publishes it under its placement name.
        let inv = backend.inventory().unwrap();
        let MigState::Enabled { instances, .. } = &gpu(&inv, 0).mig else {
            panic!("MIG off")
        };
        assert_eq!(instances, &vec![three.clone()]);
        let pool = build_pool(&inv, &PoolOptions::default());
        let names: Vec<&str> = pool.devices().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpu-0-mig-3g40gb-4"]);

        // State survives a plugin restart (new NVML session).
        drop(backend);
        let backend = open();
        assert_eq!(backend.list_mig(&gpu0).unwrap(), vec![three.clone()]);

        // An overlapping placement is refused and leaves nothing behind.
        let err = backend
            .create_mig(&gpu0, 14, Placement { start: 4, size: 2 })
            .unwrap_err();
        assert!(matches!(err, BackendError::Nvml { .. }), "{err:?}");
        assert_eq!(backend.list_mig(&gpu0).unwrap(), vec![three.clone()]);

        // Compute-instance creation fails: the GPU instance is destroyed again, so the
        // same placement is free afterwards.
        std::fs::write(&control, "nvmlGpuInstanceCreateComputeInstance=23\n").unwrap();
        let err = backend
            .create_mig(&gpu0, 19, Placement { start: 0, size: 1 })
            .unwrap_err();
        match &err {
            BackendError::Nvml { call, code, .. } => {
                assert_eq!(*call, "nvmlGpuInstanceCreateComputeInstance");
                assert_eq!(*code, 23);
            }
            other => panic!("unexpected {other:?}"),
        }
        std::fs::write(&control, "").unwrap();
        assert_eq!(backend.list_mig(&gpu0).unwrap(), vec![three.clone()]);
        let one = backend
            .create_mig(&gpu0, 19, Placement { start: 0, size: 1 })
            .unwrap();
        assert_eq!(one.profile_name, "1g.10gb");
        assert_eq!(backend.list_mig(&gpu0).unwrap().len(), 2);

        // On-demand pool: instances cleave owns keep their counters, others are taken.
        let inv = backend.inventory().unwrap();
        let opts = PoolOptions {
            dynamic_mig: true,
            owned_instances: [one.uuid.clone()].into(),
            ..PoolOptions::default()
        };
        let pool = build_pool(&inv, &opts);
        assert!(limit_violations(&pool).is_empty());
        let set = &pool.groups[0].counter_sets[0];
        assert_eq!(set.name, "gpu-0-counters");
        let value = |k: &str| set.counters[k].value.0.clone();
        assert_eq!(
            value("memory-slice-0"),
            "1",
            "owned instance keeps its slice"
        );
        assert_eq!(value("memory-slice-4"), "0", "foreign 3g takes slices 4-7");
        assert_eq!(value("memory-slice-7"), "0");
        assert_eq!(value("compute-slices"), "4");

        // Destroy: idempotent, by ids.
        backend
            .destroy_mig(&gpu0, three.gi_id, three.ci_id)
            .unwrap();
        backend
            .destroy_mig(&gpu0, three.gi_id, three.ci_id)
            .unwrap();
        backend.destroy_mig(&gpu0, one.gi_id, one.ci_id).unwrap();
        assert!(backend.list_mig(&gpu0).unwrap().is_empty());
        // Now the whole GPU is free again: the 7-slice instance fits.
        let seven = backend
            .create_mig(&gpu0, 0, Placement { start: 0, size: 8 })
            .unwrap();
        assert_eq!(seven.profile_name, "7g.80gb");
        backend
            .destroy_mig(&gpu0, seven.gi_id, seven.ci_id)
            .unwrap();

        // Unknown GPU.
        assert!(matches!(
            backend.create_mig("GPU-does-not-exist", 19, Placement { start: 0, size: 1 }),
            Err(BackendError::GpuNotFound(_))
        ));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control");
    let ctl = control.to_str().unwrap().to_owned();
    run_child(
        "create_and_destroy_mig",
        "h100",
        &[
            ("MOCK_NVML_PROFILE", "h100-80gb-x8"),
            ("MOCK_NVML_CONTROL", &ctl),
        ],
    );
}

/// A query failing for one GPU skips that GPU (with a warning naming it); the rest stay.
#[test]
fn failing_gpu_is_skipped_with_warning() {
    if let Some(s) = scenario() {
        common::log_to_stderr();
        let inv = open().inventory().unwrap();
        let (minor, total) = match s.as_str() {
            "uuid" | "profile-info" => (2, 8),
            "memory" => (0, 8),
            "placements" => (5, 8),
            other => panic!("{other}"),
        };
        assert_eq!(inv.gpus.len(), total - 1);
        assert!(inv.gpus.iter().all(|g| g.minor != minor));
        return;
    }
    for (scenario, fail, index) in [
        ("uuid", "nvmlDeviceGetUUID@2=999", 2),
        ("memory", "nvmlDeviceGetMemoryInfo_v2@0=15", 0),
        (
            "profile-info",
            "nvmlDeviceGetGpuInstanceProfileInfo@2=999",
            2,
        ),
        (
            "placements",
            "nvmlDeviceGetGpuInstancePossiblePlacements_v2@5=999",
            5,
        ),
    ] {
        let out = run_child(
            "failing_gpu_is_skipped_with_warning",
            scenario,
            &[
                ("MOCK_NVML_PROFILE", "h100-80gb-x8"),
                ("MOCK_NVML_FAIL", fail),
            ],
        );
        let warning = out
            .stderr
            .lines()
            .find(|l| l.contains("skipping GPU that failed discovery"))
            .unwrap_or_else(|| panic!("no warning for {scenario}:\n{}", out.stderr));
        assert!(warning.contains("WARN"), "{warning}");
        assert!(warning.contains(&format!("gpu_index={index}")), "{warning}");
    }
}

/// A MIG-enabled GPU whose profile queries all answer NOT_SUPPORTED is logged with the
/// return code, not offered as MIG-capable, publishes no placement, and is named among the
/// GPUs that publish nothing; the other GPUs are unaffected.
#[test]
fn mig_gpu_without_readable_profiles_is_logged_and_not_mig_capable() {
    if scenario().is_some() {
        common::log_to_stderr();
        let inv = open().inventory().unwrap();
        assert_eq!(inv.gpus.len(), 8);
        let gpu3 = inv.gpus.iter().find(|g| g.minor == 3).unwrap();
        assert!(!gpu3.mig.is_capable(), "{:?}", gpu3.mig);
        assert!(
            inv.gpus
                .iter()
                .filter(|g| g.minor != 3)
                .all(|g| g.mig.is_capable())
        );
        let options = cleave_driver::pool::PoolOptions {
            dynamic_mig: true,
            ..Default::default()
        };
        let pool = build_pool(&inv, &options);
        let names: Vec<String> = pool
            .groups
            .iter()
            .flat_map(|g| g.devices.iter().map(|d| d.name.clone()))
            .collect();
        assert!(
            names.iter().all(|n| !n.starts_with("gpu-3-mig-")),
            "{names:?}"
        );
        let silent = cleave_driver::pool::silent_gpus(&inv, &Default::default());
        assert!(silent.iter().any(|s| s.name == "gpu-3"
            && s.reason == cleave_driver::pool::SilentReason::MigWithoutProfiles));
        return;
    }
    let out = run_child(
        "mig_gpu_without_readable_profiles_is_logged_and_not_mig_capable",
        "unsupported",
        &[
            ("MOCK_NVML_PROFILE", "h100-80gb-x8"),
            ("MOCK_NVML_FAIL", "nvmlDeviceGetGpuInstanceProfileInfo@3=3"),
        ],
    );
    let line = out
        .stderr
        .lines()
        .find(|l| l.contains("NVML answers no GPU-instance profile"))
        .unwrap_or_else(|| panic!("not logged:\n{}", out.stderr));
    assert!(line.contains("nvml_return_code=3"), "{line}");
    assert!(line.contains("ERROR"), "{line}");
}

/// NVML that cannot initialise, or a missing library, is `Unavailable`, never a panic.
#[test]
fn init_failure_is_unavailable() {
    if let Some(s) = scenario() {
        let err = NvmlBackend::open(Some(&mock_lib())).unwrap_err();
        let BackendError::Unavailable(msg) = err else {
            panic!("{s}: expected Unavailable, got {err:?}");
        };
        assert!(msg.contains("nvmlInit_v2"), "{msg}");
        return;
    }
    run_child(
        "init_failure_is_unavailable",
        "driver-missing",
        &[("MOCK_NVML_DRIVER_MISSING", "1")],
    );
    run_child(
        "init_failure_is_unavailable",
        "init-fails",
        &[("MOCK_NVML_FAIL", "nvmlInit_v2=9")],
    );
    let err = NvmlBackend::open(Some(std::path::Path::new("/nonexistent/libnvidia-ml.so.1")))
        .unwrap_err();
    assert!(matches!(err, BackendError::Unavailable(_)), "{err:?}");
}

/// An unparsable driver version is a clear error from `inventory`.
#[test]
fn bad_driver_version_is_an_error() {
    if scenario().is_some() {
        let err = open().inventory().unwrap_err();
        assert!(
            err.to_string().contains("driver version \"r570-beta\""),
            "{err}"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("node.yaml");
    std::fs::write(
        &config,
        "driverVersion: r570-beta\ngpus:\n  - product: l4\n",
    )
    .unwrap();
    run_child(
        "bad_driver_version_is_an_error",
        "bad-version",
        &[("MOCK_NVML_CONFIG", config.to_str().unwrap())],
    );
}
