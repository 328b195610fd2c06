//! Node reboots against the mock NVML library: after a new boot ID (the mock drops every
//! instance and keeps MIG mode; the driver reads the same ID from its boot-ID file) start
//! recreates the MIG instances of prepared claims at their recorded placements, rewrites the
//! CDI specs with the same device IDs, and a replayed prepare answers the same IDs without
//! creating anything twice. Failed recreations keep the claim waiting, prepare fails with a
//! clear error until the hardware takes it, and nothing is ever destroyed by an ID of the
//! previous boot.
//!
//! Each scenario is a sequence of phases; each phase is a child process (the mock reads its
//! boot ID and failure knobs at init), all sharing one temp dir and one mock state file.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cleave_api::names::DRIVER_NAME;
use cleave_driver::backend::GpuBackend;
use cleave_driver::checkpoint::{CheckpointStore, ClaimState};
use cleave_driver::model::{MigInstance, Placement};
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::prepare::{DriverConfig, NodeDriver, PrepareError};
use k8s_openapi::api::resource::v1::ResourceClaim;

use cleave_driver::prepare::testing::node_claim;
use common::{cdi_ids, child_tmp, log_to_stderr, mock_lib, run_child, scenario};

const PRODUCT: &str = "a100-80gb-x4";
const MIG_CLAIM: &str = "0000000a-0000-4000-8000-000000000000";
const WHOLE_CLAIM: &str = "0000000b-0000-4000-8000-000000000000";
/// On-demand 2g.20gb at memory slices 2..4 of GPU 0 (lgip profile 14).
const MIG_DEVICE: &str = "gpu-0-mig-2g20gb-2";
const MIG_PLACEMENT: Placement = Placement { start: 2, size: 2 };
const CREATE_GI: &str = "nvmlDeviceCreateGpuInstanceWithPlacement";

/// One phase: its name, the boot ID, extra environment.
type Phase<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)]);

/// Runs the phases of `test` in order, each in a child process with boot ID `boot` and the
/// extra environment, all sharing one temp dir and mock state file. `between` runs in the
/// parent after each phase (index given).
fn run_phases(test: &str, phases: &[Phase<'_>], mut between: impl FnMut(usize, &Path)) {
    let shared = tempfile::tempdir().unwrap();
    let tmp = shared.path().to_str().unwrap().to_owned();
    let state = shared.path().join("mock-nvml-state.json");
    let state = state.to_str().unwrap().to_owned();
    for (i, (phase, boot, extra)) in phases.iter().enumerate() {
        let mut env: Vec<(&str, &str)> = vec![
            ("MOCK_NVML_PROFILE", PRODUCT),
            ("MOCK_NVML_STATE", &state),
            ("MOCK_NVML_BOOT_ID", boot),
            ("CLEAVE_TEST_TMP", &tmp),
        ];
        env.extend_from_slice(extra);
        run_child(test, phase, &env);
        between(i, shared.path());
    }
}

/// Driver settings in `dir`; the boot-ID file says what the mock was told.
fn config(dir: &Path) -> DriverConfig {
    let boot = std::env::var("MOCK_NVML_BOOT_ID").unwrap();
    std::fs::write(dir.join("boot_id"), format!("{boot}\n")).unwrap();
    common::node_config(dir, dir.join("plugins").join(DRIVER_NAME))
}

fn backend() -> Arc<NvmlBackend> {
    Arc::new(NvmlBackend::open(Some(&mock_lib())).expect("mock NVML opens"))
}

fn claim(uid: &str, request: &str, device: &str) -> ResourceClaim {
    node_claim(uid, &[(request, device)])
}

fn mig_claim() -> ResourceClaim {
    claim(MIG_CLAIM, "mig", MIG_DEVICE)
}

fn whole_claim() -> ResourceClaim {
    claim(WHOLE_CLAIM, "gpu", "gpu-1")
}

fn gpu_uuid(nvml: &NvmlBackend, minor: u32) -> String {
    nvml.inventory()
        .unwrap()
        .gpus
        .into_iter()
        .find(|g| g.minor == minor)
        .unwrap()
        .uuid
}

fn spec_path(dir: &Path, uid: &str) -> PathBuf {
    dir.join("cdi")
        .join(cleave_driver::cdi::spec_file_name(uid))
}

/// CDI device names of a claim's spec file.
fn spec_device_names(dir: &Path, uid: &str) -> Vec<String> {
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(spec_path(dir, uid)).unwrap()).unwrap();
    spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap().to_owned())
        .collect()
}

fn save<T: serde::Serialize>(dir: &Path, name: &str, value: &T) {
    std::fs::write(dir.join(name), serde_json::to_vec(value).unwrap()).unwrap();
}

fn load<T: serde::de::DeserializeOwned>(dir: &Path, name: &str) -> T {
    serde_json::from_slice(&std::fs::read(dir.join(name)).unwrap()).unwrap()
}

fn only_instance(nvml: &NvmlBackend, gpu: &str) -> MigInstance {
    let list = nvml.list_mig(gpu).unwrap();
    assert_eq!(list.len(), 1, "{list:?}");
    list[0].clone()
}

/// Empties the CDI root, as a reboot does to its tmpfs.
fn empty_cdi_root(dir: &Path) {
    for e in std::fs::read_dir(dir.join("cdi")).unwrap() {
        std::fs::remove_file(e.unwrap().path()).unwrap();
    }
}

/// Phase of every scenario: prepare the claims in boot 1 and note what was answered.
fn prepare_before_reboot(with_whole: bool) {
    let dir = child_tmp();
    let nvml = backend();
    let driver = NodeDriver::start(config(&dir), nvml.clone()).unwrap();
    let mig = driver.prepare(&mig_claim()).unwrap();
    save(&dir, "mig-ids.json", &cdi_ids(&mig));
    let inst = only_instance(&nvml, &gpu_uuid(&nvml, 0));
    assert_eq!(inst.placement, MIG_PLACEMENT);
    save(&dir, "mig-before.json", &(inst.uuid, inst.gi_id));
    if with_whole {
        let whole = driver.prepare(&whole_claim()).unwrap();
        save(&dir, "whole-ids.json", &cdi_ids(&whole));
        let full = only_instance(&nvml, &gpu_uuid(&nvml, 1));
        save(&dir, "whole-before.json", &full.uuid);
    }
}

/// A reboot: start recreates both claims' instances at their placements (new UUIDs), the
/// CDI specs come back with the same device names, the replayed prepare answers the same
/// IDs and creates nothing; a later start changes nothing; unprepare destroys them.
#[test]
fn reboot_recreates_instances_at_their_placements_with_the_same_cdi_ids() {
    const TEST: &str = "reboot_recreates_instances_at_their_placements_with_the_same_cdi_ids";
    let Some(phase) = scenario() else {
        return run_phases(
            TEST,
            &[
                ("before", "boot-1", &[]),
                ("after", "boot-2", &[]),
                ("again", "boot-2", &[]),
            ],
            |i, dir| match i {
                0 => empty_cdi_root(dir),
                1 => {
                    // The "hardware" holds exactly the recreated instances, in boot 2.
                    let state =
                        mock_nvml::state::read_state_file(&dir.join("mock-nvml-state.json"))
                            .unwrap()
                            .unwrap();
                    assert_eq!(state.boot_id, "boot-2");
                    let gis = &state.gpus[0].gpu_instances;
                    assert_eq!(gis.len(), 1, "{gis:?}");
                    assert_eq!(
                        (gis[0].profile_id, gis[0].start, gis[0].size),
                        (14, MIG_PLACEMENT.start, MIG_PLACEMENT.size)
                    );
                    let full = &state.gpus[1].gpu_instances;
                    assert_eq!(full.len(), 1, "{full:?}");
                    assert_eq!((full[0].start, full[0].size), (0, 8));
                }
                _ => {}
            },
        );
    };
    log_to_stderr();
    let dir = child_tmp();
    match phase.as_str() {
        "before" => prepare_before_reboot(true),
        "after" => {
            let nvml = backend();
            let gpu0 = gpu_uuid(&nvml, 0);
            let gpu1 = gpu_uuid(&nvml, 1);
            // The mock rebooted: nothing from boot 1 exists, and no CDI spec either.
            assert_eq!(nvml.list_mig(&gpu0).unwrap(), []);
            assert_eq!(nvml.list_mig(&gpu1).unwrap(), []);
            assert!(!spec_path(&dir, MIG_CLAIM).exists());

            let driver = NodeDriver::start(config(&dir), nvml.clone()).unwrap();
            assert!(driver.claims_needing_recreate().is_empty());
            let (old_uuid, _old_gi): (String, u32) = load(&dir, "mig-before.json");
            let inst = only_instance(&nvml, &gpu0);
            assert_eq!(inst.placement, MIG_PLACEMENT);
            assert_eq!(inst.profile_id, 14);
            assert_ne!(inst.uuid, old_uuid);
            let full = only_instance(&nvml, &gpu1);
            assert_eq!(full.placement, Placement { start: 0, size: 8 });
            let old_full: String = load(&dir, "whole-before.json");
            assert_ne!(full.uuid, old_full);

            // The specs are back: same device names, the new instance's UUID.
            assert_eq!(
                spec_device_names(&dir, MIG_CLAIM),
                [format!("{MIG_CLAIM}-{MIG_DEVICE}")]
            );
            assert_eq!(
                spec_device_names(&dir, WHOLE_CLAIM),
                [format!("{WHOLE_CLAIM}-gpu-1")]
            );
            let text = std::fs::read_to_string(spec_path(&dir, MIG_CLAIM)).unwrap();
            assert!(
                text.contains(&inst.uuid) && !text.contains(&old_uuid),
                "{text}"
            );

            // The kubelet replays prepare: same IDs, nothing created twice.
            let mig_ids: Vec<String> = load(&dir, "mig-ids.json");
            let whole_ids: Vec<String> = load(&dir, "whole-ids.json");
            assert_eq!(cdi_ids(&driver.prepare(&mig_claim()).unwrap()), mig_ids);
            assert_eq!(cdi_ids(&driver.prepare(&whole_claim()).unwrap()), whole_ids);
            assert_eq!(nvml.list_mig(&gpu0).unwrap(), std::slice::from_ref(&inst));
            assert_eq!(nvml.list_mig(&gpu1).unwrap(), std::slice::from_ref(&full));

            let data = CheckpointStore::in_dir(&driver.config().state_dir)
                .load()
                .unwrap();
            assert_eq!(data.boot_id, "boot-2");
            let record = &data.claims[MIG_CLAIM];
            assert_eq!(record.state, ClaimState::Prepared);
            let m = record.devices[0].mig.as_ref().unwrap();
            assert_eq!(m.uuid.as_deref(), Some(inst.uuid.as_str()));
            assert_eq!((m.gi_id, m.ci_id), (Some(inst.gi_id), Some(inst.ci_id)));
            save(&dir, "mig-after.json", &inst.uuid);
        }
        "again" => {
            // A plain restart in the same boot finds everything in place.
            let nvml = backend();
            let gpu0 = gpu_uuid(&nvml, 0);
            let after: String = load(&dir, "mig-after.json");
            let driver = NodeDriver::start(config(&dir), nvml.clone()).unwrap();
            assert_eq!(only_instance(&nvml, &gpu0).uuid, after);
            let mig_ids: Vec<String> = load(&dir, "mig-ids.json");
            assert_eq!(cdi_ids(&driver.prepare(&mig_claim()).unwrap()), mig_ids);
            driver.unprepare(MIG_CLAIM).unwrap();
            driver.unprepare(WHOLE_CLAIM).unwrap();
            assert_eq!(nvml.list_mig(&gpu0).unwrap(), []);
            assert_eq!(nvml.list_mig(&gpu_uuid(&nvml, 1)).unwrap(), []);
            assert!(driver.prepared_claims().is_empty());
        }
        other => panic!("unknown phase {other}"),
    }
}

/// The hardware refuses the recreation (injected NVML 23): the claim waits, the replayed
/// prepare fails with a clear error and no CDI spec exists; once the failure is gone (the
/// mock's control file is re-read on every call) the replayed prepare recreates the
/// instance and answers the same IDs.
#[test]
fn failed_recreation_waits_and_prepare_retries_it() {
    const TEST: &str = "failed_recreation_waits_and_prepare_retries_it";
    let Some(phase) = scenario() else {
        let control = tempfile::tempdir().unwrap();
        let control = control.path().join("control");
        std::fs::write(&control, format!("fail {CREATE_GI}=23\n")).unwrap();
        let control_s = control.to_str().unwrap().to_owned();
        let fail = format!("{CREATE_GI}=23");
        return run_phases(
            TEST,
            &[
                ("before", "boot-1", &[]),
                ("refused", "boot-2", &[("MOCK_NVML_FAIL", &fail)]),
                ("retried", "boot-2", &[("MOCK_NVML_CONTROL", &control_s)]),
            ],
            |i, dir| {
                if i == 0 {
                    empty_cdi_root(dir);
                }
            },
        );
    };
    log_to_stderr();
    let dir = child_tmp();
    let expect_refusal = |driver: &NodeDriver| {
        let pending = driver.claims_needing_recreate();
        assert_eq!(pending.len(), 1, "{pending:?}");
        assert_eq!(pending[0].claim.uid, MIG_CLAIM);
        let error = pending[0].error.clone().unwrap();
        assert!(error.contains("NVML return code 23"), "{error}");
        let e = driver.prepare(&mig_claim()).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, PrepareError::MigRecreate { .. }), "{msg}");
        assert!(
            msg.contains(MIG_DEVICE)
                && msg.contains("after a reboot")
                && msg.contains("NVML return code 23"),
            "{msg}"
        );
        assert!(!spec_path(&dir, MIG_CLAIM).exists());
        // Still recorded: its device stays busy, the shell sees it.
        assert_eq!(driver.prepared_claims().len(), 1);
    };
    match phase.as_str() {
        "before" => prepare_before_reboot(false),
        "refused" => {
            let nvml = backend();
            let driver = NodeDriver::start(config(&dir), nvml.clone()).unwrap();
            expect_refusal(&driver);
            assert_eq!(nvml.list_mig(&gpu_uuid(&nvml, 0)).unwrap(), []);
            let data = CheckpointStore::in_dir(&driver.config().state_dir)
                .load()
                .unwrap();
            assert_eq!(data.claims[MIG_CLAIM].state, ClaimState::NeedsRecreate);
        }
        "retried" => {
            let nvml = backend();
            let driver = NodeDriver::start(config(&dir), nvml.clone()).unwrap();
            // Start retried and was refused again.
            expect_refusal(&driver);
            std::fs::write(std::env::var("MOCK_NVML_CONTROL").unwrap(), "").unwrap();
            let mig_ids: Vec<String> = load(&dir, "mig-ids.json");
            assert_eq!(cdi_ids(&driver.prepare(&mig_claim()).unwrap()), mig_ids);
            let inst = only_instance(&nvml, &gpu_uuid(&nvml, 0));
            assert_eq!((inst.profile_id, inst.placement), (14, MIG_PLACEMENT));
            assert_eq!(
                spec_device_names(&dir, MIG_CLAIM),
                [format!("{MIG_CLAIM}-{MIG_DEVICE}")]
            );
            assert!(driver.claims_needing_recreate().is_empty());
            // And again: nothing more is created.
            assert_eq!(cdi_ids(&driver.prepare(&mig_claim()).unwrap()), mig_ids);
            assert_eq!(nvml.list_mig(&gpu_uuid(&nvml, 0)).unwrap(), [inst]);
            driver.unprepare(MIG_CLAIM).unwrap();
            assert_eq!(nvml.list_mig(&gpu_uuid(&nvml, 0)).unwrap(), []);
        }
        other => panic!("unknown phase {other}"),
    }
}

/// After the reboot, before the plugin starts, an administrator's boot-time configuration
/// creates an instance at the claim's old placement: it gets the old GI ID. Recreation is
/// refused by the hardware, nothing is destroyed, and unpreparing the waiting claim cleans
/// up without touching the administrator's instance.
#[test]
fn reboot_never_destroys_by_old_ids() {
    const TEST: &str = "reboot_never_destroys_by_old_ids";
    let Some(phase) = scenario() else {
        return run_phases(
            TEST,
            &[("before", "boot-1", &[]), ("after", "boot-2", &[])],
            |i, dir| {
                if i == 0 {
                    empty_cdi_root(dir);
                }
            },
        );
    };
    log_to_stderr();
    let dir = child_tmp();
    match phase.as_str() {
        "before" => prepare_before_reboot(false),
        "after" => {
            let nvml = backend();
            let gpu0 = gpu_uuid(&nvml, 0);
            let (old_uuid, old_gi): (String, u32) = load(&dir, "mig-before.json");
            // lgip 15 (1g.20gb) spans the same two memory slices.
            let admin = nvml.create_mig(&gpu0, 15, MIG_PLACEMENT).unwrap();
            assert_eq!(admin.gi_id, old_gi, "the mock reuses GI IDs per placement");
            assert_ne!(admin.uuid, old_uuid);

            let driver = NodeDriver::start(config(&dir), nvml.clone()).unwrap();
            assert_eq!(nvml.list_mig(&gpu0).unwrap(), std::slice::from_ref(&admin));
            let e = driver.prepare(&mig_claim()).unwrap_err();
            assert!(
                e.to_string().contains(MIG_DEVICE) && e.to_string().contains("23"),
                "{e}"
            );
            assert!(driver.owned_mig_uuids().is_empty());
            driver.unprepare(MIG_CLAIM).unwrap();
            assert!(driver.prepared_claims().is_empty());
            assert!(!spec_path(&dir, MIG_CLAIM).exists());
            assert_eq!(nvml.list_mig(&gpu0).unwrap(), [admin]);
        }
        other => panic!("unknown phase {other}"),
    }
}
