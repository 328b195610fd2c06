//! Faults from outside, against the mock NVML library (one child process per scenario, see
//! `common`): NVML calls failing at each mutating step, a CDI root that cannot be written,
//! a full disk, a damaged checkpoint. Each test checks the behaviour documented in
//! `docs/faults.md`: a clear error naming the object, and no partial state (or, where a
//! retry must finish the work, exactly the record that lets it).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cleave_driver::backend::GpuBackend;
use cleave_driver::cdi;
use cleave_driver::checkpoint::{CheckpointError, CheckpointStore, ClaimState};
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::prepare::{DriverConfig, NodeDriver, PrepareError};
use k8s_openapi::api::resource::v1::ResourceClaim;

use cleave_driver::prepare::testing::node_claim;
use common::{child_tmp, mock_lib, run_child, scenario};

const UID: &str = "f0000001-0000-4000-8000-000000000001";
const MIG_DEVICE: &str = "gpu-0-mig-1g10gb-0";

fn config(dir: &Path) -> DriverConfig {
    let boot_id_path = dir.join("boot_id");
    if !boot_id_path.exists() {
        std::fs::write(&boot_id_path, "boot-1\n").unwrap();
    }
    common::node_config(dir, dir.join("state"))
}

fn claim(uid: &str, device: &str) -> ResourceClaim {
    node_claim(uid, &[("r", device)])
}

fn backend() -> Arc<NvmlBackend> {
    Arc::new(NvmlBackend::open(Some(&mock_lib())).unwrap())
}

/// The node's directory: shared by two children when `FAULTS_DIR` is given, else private.
fn node_dir() -> PathBuf {
    std::env::var("FAULTS_DIR").map_or_else(|_| child_tmp(), PathBuf::from)
}

/// MIG devices on every GPU.
fn instances(nvml: &NvmlBackend) -> usize {
    let inv = nvml.inventory().unwrap();
    inv.gpus
        .iter()
        .map(|g| nvml.list_mig(&g.uuid).unwrap().len())
        .sum()
}

/// GPU instances without a compute instance, on every GPU.
fn bare_gis(nvml: &NvmlBackend) -> usize {
    let inv = nvml.inventory().unwrap();
    inv.gpus
        .iter()
        .map(|g| nvml.list_bare_gpu_instances(&g.uuid).unwrap().len())
        .sum()
}

fn cdi_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir.join("cdi"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Nothing of any claim anywhere: hardware, CDI root, checkpoint.
fn assert_clean(dir: &Path, nvml: &NvmlBackend, ctx: &str) {
    assert_eq!(instances(nvml), 0, "{ctx}: MIG devices left");
    assert_eq!(
        bare_gis(nvml),
        0,
        "{ctx}: GPU instances without compute instance left"
    );
    assert_eq!(
        cdi_files(dir),
        Vec::<String>::new(),
        "{ctx}: CDI files left"
    );
    let data = CheckpointStore::in_dir(&dir.join("state")).load().unwrap();
    assert!(data.claims.is_empty(), "{ctx}: records left {data:?}");
}

fn run(test: &str, scenario: &str, env: &[(&str, &str)]) {
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control");
    std::fs::write(&control, "").unwrap();
    let control = control.display().to_string();
    let mut all = vec![
        ("MOCK_NVML_PROFILE", "h100-80gb-x8"),
        ("MOCK_NVML_CONTROL", control.as_str()),
        ("MOCK_NVML_BOOT_ID", "boot-1"),
    ];
    all.extend_from_slice(env);
    run_child(test, scenario, &all);
    drop(dir);
}

/// NVML calls made while creating a MIG device (GI with placement, CI profile, CI, IDs,
/// UUID): a failure at any of them fails prepare with the call and code, and leaves no
/// instance, no CDI spec and no record; the same claim prepares once the fault is gone.
#[test]
fn nvml_failure_at_each_create_step_leaves_nothing() {
    const CALLS: [&str; 8] = [
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceGetComputeInstanceProfileInfo",
        "nvmlGpuInstanceCreateComputeInstance",
        "nvmlGpuInstanceGetInfo",
        "nvmlComputeInstanceGetInfo_v2",
        "nvmlDeviceGetMigDeviceHandleByIndex",
        "nvmlDeviceGetComputeInstanceId",
        "nvmlDeviceGetUUID",
    ];
    let Some(call) = scenario() else {
        for call in CALLS {
            run("nvml_failure_at_each_create_step_leaves_nothing", call, &[]);
        }
        return;
    };
    let dir = node_dir();
    let control = PathBuf::from(std::env::var("MOCK_NVML_CONTROL").unwrap());
    let nvml = backend();
    let driver = NodeDriver::start(config(&dir), nvml.clone()).unwrap();
    std::fs::write(&control, format!("{call}=999\n")).unwrap();
    let e = driver.prepare(&claim(UID, MIG_DEVICE)).unwrap_err();
    let msg = e.to_string();
    std::fs::write(&control, "").unwrap();
    assert!(matches!(e, PrepareError::MigCreate { .. }), "{call}: {msg}");
    assert!(
        msg.contains(MIG_DEVICE) && msg.contains("999"),
        "{call}: {msg}"
    );
    let data = CheckpointStore::in_dir(&dir.join("state")).load().unwrap();
    match data.claims.get(UID) {
        // Rollback finished: nothing at all.
        None => assert_clean(&dir, &nvml, &call),
        // The rollback itself needed the failing call (listing instances by UUID): the record
        // is kept as PrepareStarted so that the next prepare or start finishes it.
        Some(r) => assert_eq!(r.state, ClaimState::PrepareStarted, "{call}"),
    }
    // The kubelet retries: prepared now, then unprepared without residue.
    driver.prepare(&claim(UID, MIG_DEVICE)).unwrap();
    assert_eq!(instances(&nvml), 1, "{call}");
    driver.unprepare(UID).unwrap();
    assert_clean(&dir, &nvml, &call);
}

/// Destroying fails (CI or GI destroy): unprepare fails naming the device and the code, the
/// record and CDI spec stay so that the kubelet's retry finishes; after the retry nothing is
/// left.
#[test]
fn nvml_failure_at_each_destroy_step_keeps_the_record_for_retry() {
    const CALLS: [&str; 3] = [
        "nvmlComputeInstanceDestroy",
        "nvmlGpuInstanceDestroy",
        "nvmlDeviceGetGpuInstanceById",
    ];
    let Some(call) = scenario() else {
        for call in CALLS {
            run(
                "nvml_failure_at_each_destroy_step_keeps_the_record_for_retry",
                call,
                &[],
            );
        }
        return;
    };
    let dir = node_dir();
    let control = PathBuf::from(std::env::var("MOCK_NVML_CONTROL").unwrap());
    let nvml = backend();
    let driver = NodeDriver::start(config(&dir), nvml.clone()).unwrap();
    driver.prepare(&claim(UID, MIG_DEVICE)).unwrap();
    std::fs::write(&control, format!("{call}=999\n")).unwrap();
    let e = driver.unprepare(UID).unwrap_err();
    std::fs::write(&control, "").unwrap();
    let msg = e.to_string();
    assert!(
        matches!(e, PrepareError::MigDestroy { .. }),
        "{call}: {msg}"
    );
    assert!(msg.contains(MIG_DEVICE) && msg.contains("999"), "{msg}");
    let data = CheckpointStore::in_dir(&dir.join("state")).load().unwrap();
    assert_eq!(data.claims[UID].state, ClaimState::Prepared, "{call}");
    assert_eq!(cdi_files(&dir), [cdi::spec_file_name(UID)], "{call}");
    driver.unprepare(UID).unwrap();
    assert_clean(&dir, &nvml, &call);
}

/// A teardown NVML refuses, then allows: creating the compute instance fails and so does the
/// rollback's GPU-instance destroy, leaving a bare GPU instance at the allocated 3g
/// placement. The claim fails and stays recorded (`PrepareStarted`); a restart while
/// destroying still fails keeps it; once NVML works again, the next prepare of that
/// placement (the same claim, and after it another claim) destroys the bare instance first
/// and prepares, and the GPU holds exactly one GPU instance with one compute instance.
#[test]
fn failing_ci_create_and_gi_destroy_leave_nothing_once_nvml_works() {
    const DEVICE: &str = "gpu-0-mig-3g40gb-4";
    const OTHER: &str = "f0000002-0000-4000-8000-000000000002";
    if scenario().is_none() {
        run(
            "failing_ci_create_and_gi_destroy_leave_nothing_once_nvml_works",
            "one",
            &[],
        );
        return;
    }
    let dir = node_dir();
    let control = PathBuf::from(std::env::var("MOCK_NVML_CONTROL").unwrap());
    let nvml = backend();
    let gpu0 = nvml.inventory().unwrap().gpus[0].uuid.clone();
    let driver = NodeDriver::start(config(&dir), nvml.clone()).unwrap();
    std::fs::write(
        &control,
        "nvmlGpuInstanceCreateComputeInstance=999\nnvmlGpuInstanceDestroy=999\n",
    )
    .unwrap();
    let e = driver.prepare(&claim(UID, DEVICE)).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PrepareError::MigCreate { .. }), "{msg}");
    assert!(msg.contains(DEVICE) && msg.contains("999"), "{msg}");
    // The GPU instance is left bare, and the claim is kept so that it gets destroyed.
    let bare = nvml.list_bare_gpu_instances(&gpu0).unwrap();
    assert_eq!(bare.len(), 1, "{bare:?}");
    assert_eq!(bare[0].placement.start, 4);
    let data = CheckpointStore::in_dir(&dir.join("state")).load().unwrap();
    assert_eq!(data.claims[UID].state, ClaimState::PrepareStarted);
    assert!(cdi_files(&dir).is_empty(), "{:?}", cdi_files(&dir));

    // A restart while destroying still fails: start works, the record stays.
    drop(driver);
    let driver = NodeDriver::start(config(&dir), nvml.clone()).unwrap();
    let data = CheckpointStore::in_dir(&dir.join("state")).load().unwrap();
    assert_eq!(data.claims[UID].state, ClaimState::PrepareStarted);
    assert_eq!(bare_gis(&nvml), 1);
    // Meanwhile the pool publishes the placement as taken, never as free.
    let bare = driver.bare_gpu_instances();
    assert_eq!(bare[&gpu0].len(), 1, "{bare:?}");
    let pool = cleave_driver::pool::build_pool(
        &driver.inventory(),
        &cleave_driver::pool::PoolOptions {
            dynamic_mig: true,
            owned_instances: driver.owned_mig_uuids(),
            bare_gpu_instances: bare,
            ..Default::default()
        },
    );
    let set = pool
        .groups
        .iter()
        .flat_map(|g| &g.counter_sets)
        .find(|c| c.name == "gpu-0-counters")
        .unwrap();
    for i in 0..8 {
        let expected = if i >= 4 { "0" } else { "1" };
        assert_eq!(
            set.counters[&format!("memory-slice-{i}")].value.0,
            expected,
            "slice {i}"
        );
    }

    // NVML works again: the kubelet's retry of the claim prepares the same placement.
    std::fs::write(&control, "").unwrap();
    let prepared = driver.prepare(&claim(UID, DEVICE)).unwrap();
    assert_eq!(prepared.devices.len(), 1);
    let list = nvml.list_mig(&gpu0).unwrap();
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0].placement.start, 4);
    assert_eq!(bare_gis(&nvml), 0);
    driver.unprepare(UID).unwrap();
    assert_clean(&dir, &nvml, "after the retry");

    // Once more, with another claim for the placement after the failure: its prepare
    // finishes the failed claim's rollback first.
    std::fs::write(
        &control,
        "nvmlGpuInstanceCreateComputeInstance=999\nnvmlGpuInstanceDestroy=999\n",
    )
    .unwrap();
    driver.prepare(&claim(UID, DEVICE)).unwrap_err();
    assert_eq!(bare_gis(&nvml), 1);
    std::fs::write(&control, "").unwrap();
    driver.prepare(&claim(OTHER, DEVICE)).unwrap();
    let list = nvml.list_mig(&gpu0).unwrap();
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(bare_gis(&nvml), 0);
    let data = CheckpointStore::in_dir(&dir.join("state")).load().unwrap();
    assert!(!data.claims.contains_key(UID), "{data:?}");
    assert_eq!(data.claims[OTHER].state, ClaimState::Prepared);
    driver.unprepare(OTHER).unwrap();
    assert_clean(&dir, &nvml, "after another claim");
}

/// A GPU instance without compute instance that cleave did not make (an administrator's
/// `nvidia-smi mig -cgi` without `-C`, made after the pool was published) at the allocated
/// placement: creation fails with NVML's insufficient resources, and the rollback leaves
/// that instance alone.
#[test]
fn someone_elses_bare_gpu_instance_is_never_destroyed() {
    const DEVICE: &str = "gpu-0-mig-3g40gb-4";
    if scenario().is_none() {
        run(
            "someone_elses_bare_gpu_instance_is_never_destroyed",
            "one",
            &[],
        );
        return;
    }
    let dir = node_dir();
    let control = PathBuf::from(std::env::var("MOCK_NVML_CONTROL").unwrap());
    let nvml = backend();
    let gpu0 = nvml.inventory().unwrap().gpus[0].uuid.clone();
    let driver = NodeDriver::start(config(&dir), nvml.clone()).unwrap();
    // The foreign bare instance, made behind the driver's back.
    std::fs::write(
        &control,
        "nvmlGpuInstanceCreateComputeInstance=999\nnvmlGpuInstanceDestroy=999\n",
    )
    .unwrap();
    let placement = cleave_driver::model::Placement { start: 4, size: 4 };
    let e = nvml.create_mig(&gpu0, 9, placement).unwrap_err();
    assert!(
        matches!(
            e,
            cleave_driver::backend::BackendError::LeftBare { gi_id: Some(_), .. }
        ),
        "{e}"
    );
    std::fs::write(&control, "").unwrap();
    assert_eq!(bare_gis(&nvml), 1);

    let e = driver.prepare(&claim(UID, DEVICE)).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("return code 23"), "{msg}");
    assert_eq!(bare_gis(&nvml), 1, "the foreign instance was destroyed");
    let data = CheckpointStore::in_dir(&dir.join("state")).load().unwrap();
    assert!(data.claims.is_empty(), "{data:?}");
    // Another prepare does not take it either.
    driver.prepare(&claim(UID, DEVICE)).unwrap_err();
    assert_eq!(bare_gis(&nvml), 1);
}

/// The CDI root turns into something that is not a writable directory (here: a regular
/// file in its place, ENOTDIR, which stops root too) or the file system refuses the write
/// (injected EROFS): prepare fails naming the spec path, the MIG instance it created is
/// destroyed and nothing is recorded.
#[test]
fn unwritable_cdi_root_fails_prepare_cleanly() {
    let Some(case) = scenario() else {
        run(
            "unwritable_cdi_root_fails_prepare_cleanly",
            "not-a-directory",
            &[],
        );
        run(
            "unwritable_cdi_root_fails_prepare_cleanly",
            "read-only",
            &[("CLEAVE_FAULT_ERROR_AT", "cdi.write=EROFS")],
        );
        return;
    };
    let dir = node_dir();
    let nvml = backend();
    let driver = NodeDriver::start(config(&dir), nvml.clone()).unwrap();
    if case == "not-a-directory" {
        std::fs::remove_dir(dir.join("cdi")).unwrap();
        std::fs::write(dir.join("cdi"), "in the way").unwrap();
    }
    let e = driver.prepare(&claim(UID, MIG_DEVICE)).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PrepareError::Cdi { .. }), "{case}: {msg}");
    let path = dir.join("cdi").join(cdi::spec_file_name(UID));
    assert!(msg.contains(&path.display().to_string()), "{case}: {msg}");
    let want = if case == "read-only" {
        "Read-only file system"
    } else {
        "Not a directory"
    };
    assert!(msg.contains(want), "{case}: {msg}");
    assert_eq!(instances(&nvml), 0, "{case}");
    let data = CheckpointStore::in_dir(&dir.join("state")).load().unwrap();
    assert!(data.claims.is_empty(), "{case}: {data:?}");

    // A CDI root that is not a directory at start: start refuses, naming it.
    if case == "not-a-directory" {
        drop(driver);
        let e = NodeDriver::start(config(&dir), nvml).unwrap_err();
        assert!(
            matches!(e, PrepareError::CreateDir { ref path, .. } if *path == dir.join("cdi")),
            "{e}"
        );
    }
}

/// A full disk (ENOSPC injected at the write: the atomic writer removes a planted temp file
/// and creates its own, so `/dev/full` cannot stand in). Intent record, CDI spec, or final
/// record: prepare fails naming the file; nothing is left on the hardware; a record the
/// failure could not remove stays `PrepareStarted` and the next start rolls it back.
#[test]
fn disk_full_fails_prepare_without_residue() {
    let Some(case) = scenario() else {
        run(
            "disk_full_fails_prepare_without_residue",
            "intent-checkpoint-enospc",
            &[("CLEAVE_FAULT_ERROR_AT", "checkpoint.write#3=ENOSPC")],
        );
        run(
            "disk_full_fails_prepare_without_residue",
            "cdi-enospc",
            &[("CLEAVE_FAULT_ERROR_AT", "cdi.write=ENOSPC")],
        );
        // Start writes the checkpoint twice; the third write is prepare's intent record, the
        // fourth its final record. The second child (no injection: space is back) shares
        // the node's directory and "hardware".
        let node = tempfile::tempdir().unwrap();
        let dir = node.path().display().to_string();
        let state = node.path().join("nvml.json").display().to_string();
        let shared = [
            ("FAULTS_DIR", dir.as_str()),
            ("MOCK_NVML_STATE", state.as_str()),
        ];
        let mut env = shared.to_vec();
        env.push(("CLEAVE_FAULT_ERROR_AT", "checkpoint.write#4=ENOSPC"));
        run(
            "disk_full_fails_prepare_without_residue",
            "final-checkpoint-enospc",
            &env,
        );
        run(
            "disk_full_fails_prepare_without_residue",
            "restart-after-disk-full",
            &shared,
        );
        return;
    };
    let dir = node_dir();
    let nvml = backend();
    let cfg = config(&dir);
    let driver = NodeDriver::start(cfg.clone(), nvml.clone()).unwrap();
    if case == "restart-after-disk-full" {
        // Start rolled the interrupted prepare back.
        assert_clean(&dir, &nvml, &case);
        return;
    }
    let e = driver.prepare(&claim(UID, MIG_DEVICE)).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("No space left on device"), "{case}: {msg}");
    let named = if case == "cdi-enospc" {
        dir.join("cdi").join(cdi::spec_file_name(UID))
    } else {
        dir.join("state/checkpoint.json")
    };
    assert!(msg.contains(&named.display().to_string()), "{case}: {msg}");
    assert_eq!(instances(&nvml), 0, "{case}");
    assert_eq!(cdi_files(&dir), Vec::<String>::new(), "{case}");
    let data = CheckpointStore::in_dir(&cfg.state_dir).load().unwrap();
    if case == "final-checkpoint-enospc" {
        // The rollback's own checkpoint write failed too (the disk is still full).
        assert_eq!(
            data.claims[UID].state,
            ClaimState::PrepareStarted,
            "{data:?}"
        );
    } else {
        assert!(data.claims.is_empty(), "{case}: {data:?}");
    }
}

/// A damaged checkpoint (truncated, a flipped bit, a field edited without recomputing the
/// checksum, an unknown layout version): start refuses with the path and the recovery
/// steps, and touches no MIG device (the prepared claim's instance survives). Following the
/// recovery steps (file moved aside) starts with no claims.
#[test]
fn damaged_checkpoint_refuses_start_with_path_and_recovery() {
    let Some(case) = scenario() else {
        for case in ["truncated", "bit-flip", "edited", "future-version"] {
            run(
                "damaged_checkpoint_refuses_start_with_path_and_recovery",
                case,
                &[],
            );
        }
        return;
    };
    let dir = node_dir();
    let nvml = backend();
    let cfg = config(&dir);
    let driver = NodeDriver::start(cfg.clone(), nvml.clone()).unwrap();
    driver.prepare(&claim(UID, MIG_DEVICE)).unwrap();
    drop(driver);
    let path = cfg.state_dir.join("checkpoint.json");
    let good = std::fs::read(&path).unwrap();
    let text = String::from_utf8(good.clone()).unwrap();
    let damaged: Vec<u8> = match case.as_str() {
        "truncated" => good[..good.len() / 3].to_vec(),
        "bit-flip" => {
            let mut b = good.clone();
            let i = text.find("\"Prepared\"").unwrap() + 3;
            b[i] ^= 0x01;
            b
        }
        "edited" => text
            .replace("\"gpu-0-mig-1g10gb-0\"", "\"gpu-0-mig-1g10gb-1\"")
            .into_bytes(),
        "future-version" => text
            .replacen(
                &format!("\"version\":{}", cleave_driver::checkpoint::FORMAT_VERSION),
                "\"version\":9",
                1,
            )
            .into_bytes(),
        other => panic!("{other}"),
    };
    assert_ne!(damaged, good);
    std::fs::write(&path, &damaged).unwrap();
    let e = NodeDriver::start(cfg.clone(), nvml.clone()).unwrap_err();
    let msg = e.to_string();
    match &e {
        PrepareError::Checkpoint(CheckpointError::UnsupportedVersion { version: 9, .. }) => {
            assert_eq!(case, "future-version")
        }
        PrepareError::Checkpoint(CheckpointError::Corrupt { .. }) => {
            assert_ne!(case, "future-version")
        }
        other => panic!("{case}: unexpected {other}"),
    }
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(
        msg.contains("mv checkpoint.json checkpoint.json.corrupt"),
        "{msg}"
    );
    // The file is left as found (evidence), and the hardware untouched.
    assert_eq!(std::fs::read(&path).unwrap(), damaged);
    assert_eq!(instances(&nvml), 1, "{case}");

    // Recovery as documented.
    std::fs::rename(&path, cfg.state_dir.join("checkpoint.json.corrupt")).unwrap();
    let driver = NodeDriver::start(cfg, nvml).unwrap();
    assert!(driver.prepared_claims().is_empty());
}

/// Least privilege on disk: the state directory is 0700 and the checkpoint 0600 (root only);
/// CDI specs are 0644 (the runtime reads them). A temp-file name planted as a symlink is not
/// followed: the write replaces it and the target is untouched.
#[test]
fn state_is_root_only_and_planted_symlinks_are_not_followed() {
    use std::os::unix::fs::PermissionsExt;
    let Some(_) = scenario() else {
        run(
            "state_is_root_only_and_planted_symlinks_are_not_followed",
            "h100",
            &[],
        );
        return;
    };
    let dir = node_dir();
    let cfg = config(&dir);
    let victim = dir.join("victim");
    std::fs::write(&victim, "precious").unwrap();
    std::fs::create_dir_all(&cfg.cdi_root).unwrap();
    let planted = cfg
        .cdi_root
        .join(format!(".{}.tmp", cdi::spec_file_name(UID)));
    std::os::unix::fs::symlink(&victim, &planted).unwrap();
    let driver = NodeDriver::start(cfg.clone(), backend()).unwrap();
    // Start sweeps stray temp files of the CDI root; plant one again for prepare.
    let _ = std::fs::remove_file(&planted);
    std::os::unix::fs::symlink(&victim, &planted).unwrap();
    std::os::unix::fs::symlink(&victim, cfg.state_dir.join(".checkpoint.json.tmp")).unwrap();
    driver.prepare(&claim(UID, MIG_DEVICE)).unwrap();
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&cfg.state_dir), 0o700);
    assert_eq!(mode(&cfg.state_dir.join("checkpoint.json")), 0o600);
    let spec = mode(&cfg.cdi_root.join(cdi::spec_file_name(UID)));
    assert_eq!(spec & 0o022, 0, "spec writable by others: {spec:o}");
    assert!(!planted.exists() && std::fs::symlink_metadata(&planted).is_err());
    driver.unprepare(UID).unwrap();
}
