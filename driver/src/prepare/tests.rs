//! Unit tests of the prepare state machine against the recording fake backend.

use std::sync::{Arc, Mutex};

use serde_json::json;

use super::plan::tests::{as_admin, as_share};
use super::recover::forget_instances_of;
use super::testing::{
    Call, FakeBackend, config_in, config_with_empty_root, gpu_uuid, inventory, mig_gpu, node_claim,
    plain_gpu, with_config,
};
use super::*;
use crate::backend::BackendError;
use crate::cdi;
use crate::checkpoint::{CHECKPOINT_FILE, CheckpointData, ClaimRecord, DeviceKind};
use crate::model::{GpuInfo, MigState, Placement};
use crate::sharing::{
    SharingClaim, SharingDevice, SharingEdits, SharingFailure, SharingHandler, SharingState,
    TimeSliceNeed,
};
use cleave_api::config::SharingStrategy;
use k8s_openapi::api::resource::v1::ResourceClaim;

const UID_A: &str = "aaaaaaaa-0000-4000-8000-000000000001";
const UID_B: &str = "bbbbbbbb-0000-4000-8000-000000000002";
const UID_C: &str = "cccccccc-0000-4000-8000-000000000003";
const DRIVER: &str = cleave_api::names::DRIVER_NAME;

struct Node {
    dir: tempfile::TempDir,
    fake: Arc<FakeBackend>,
    driver: NodeDriver,
}

impl Node {
    fn new(dynamic: bool, gpus: Vec<GpuInfo>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let fake = Arc::new(FakeBackend::new(inventory(gpus)));
        let driver = NodeDriver::start(config_in(dir.path(), dynamic), fake.clone()).unwrap();
        fake.clear_calls();
        Self { dir, fake, driver }
    }

    fn restart(self) -> Self {
        let Node { dir, fake, driver } = self;
        let config = driver.config().clone();
        drop(driver);
        let driver = NodeDriver::start(config, fake.clone()).unwrap();
        Node { dir, fake, driver }
    }

    fn cdi_path(&self, uid: &str) -> PathBuf {
        self.driver.config().cdi_root.join(cdi::spec_file_name(uid))
    }

    fn checkpoint_path(&self) -> PathBuf {
        self.driver.config().state_dir.join(CHECKPOINT_FILE)
    }

    fn checkpoint(&self) -> CheckpointData {
        CheckpointStore::in_dir(&self.driver.config().state_dir)
            .load()
            .unwrap()
    }

    fn cdi_files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.driver.config().cdi_root)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }
}

fn cdi_json(path: &std::path::Path) -> serde_json::Value {
    let bytes = std::fs::read(path).unwrap();
    container_device_interface::schema::validate_builtin(&bytes).unwrap();
    container_device_interface::spec::read_spec(&path.to_path_buf(), 0).unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

#[test]
fn whole_gpu_prepare_writes_spec_and_checkpoint() {
    let node = Node::new(false, vec![plain_gpu(0), plain_gpu(1)]);
    let claim = node_claim(UID_A, &[("gpu", "gpu-1")]);
    let prepared = node.driver.prepare(&claim).unwrap();
    assert_eq!(
        prepared,
        PreparedClaim {
            devices: vec![PreparedDevice {
                request_names: vec!["gpu".into()],
                pool_name: "node-a".into(),
                device_name: "gpu-1".into(),
                cdi_device_ids: vec![format!("k8s.gpu.cleave.dev/claim={UID_A}-gpu-1")],
                share_id: None,
            }]
        }
    );
    let spec = cdi_json(&node.cdi_path(UID_A));
    assert_eq!(spec["kind"], "k8s.gpu.cleave.dev/claim");
    assert_eq!(spec["devices"][0]["name"], format!("{UID_A}-gpu-1"));
    assert_eq!(
        spec["devices"][0]["containerEdits"]["env"][0],
        format!("CLEAVE_DEVICE_GPU_1_UUID={}", gpu_uuid(1))
    );
    let data = node.checkpoint();
    let record = &data.claims[UID_A];
    assert_eq!(record.state, ClaimState::Prepared);
    assert_eq!(
        (record.namespace.as_str(), record.devices.len()),
        ("default", 1)
    );
    assert_eq!(record.devices[0].kind, DeviceKind::Gpu);
    assert_eq!(record.devices[0].gpu_uuid, gpu_uuid(1));
    assert_eq!(record.devices[0].mig, None);
    assert_eq!(data.boot_id, "11111111-2222-3333-4444-555555555555");
    // A whole GPU without MIG needs no NVML call at all.
    assert_eq!(node.fake.calls(), []);
    assert_eq!(node.driver.prepared_claims().len(), 1);
}

#[test]
fn device_nodes_from_the_driver_root_reach_the_spec() {
    let dir = tempfile::tempdir().unwrap();
    let config = config_in(dir.path(), false);
    let fake = Arc::new(FakeBackend::new(inventory(vec![plain_gpu(0)])));
    let driver = NodeDriver::start(config, fake).unwrap();
    driver
        .prepare(&node_claim(UID_A, &[("gpu", "gpu-0")]))
        .unwrap();
    let spec = cdi_json(&driver.config().cdi_root.join(cdi::spec_file_name(UID_A)));
    let node = &spec["devices"][0]["containerEdits"]["deviceNodes"][0];
    assert_eq!(node["path"], "/dev/nvidia0");
    // Described fully, so the runtime creates the node without looking at the host.
    assert_eq!(node["type"], "c");
    assert_eq!(node["major"], 195);
    assert_eq!(node["minor"], 0);
    let common = &spec["containerEdits"]["deviceNodes"];
    assert_eq!(common[0]["path"], "/dev/nvidiactl");
    assert_eq!(common[0]["minor"], 255);
    let uvm = common
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["path"] == "/dev/nvidia-uvm")
        .expect("nvidia-uvm in the common edits");
    assert_eq!(uvm["major"], mock_nvml::driver_root::UVM_MAJOR);
    let mounts: Vec<&str> = spec["containerEdits"]["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["containerPath"].as_str().unwrap())
        .collect();
    assert!(
        mounts.contains(&"/usr/lib/x86_64-linux-gnu/libcuda.so.550.163.01"),
        "{mounts:?}"
    );
}

#[test]
fn claims_are_refused_while_the_driver_root_lacks_what_containers_need() {
    let dir = tempfile::tempdir().unwrap();
    let config = config_with_empty_root(dir.path(), true);
    let root = config.driver_root.root.clone();
    let fake = Arc::new(FakeBackend::new(inventory(vec![plain_gpu(0), mig_gpu(1)])));
    // NVML sees GPUs but the root holds no driver: said so, and claims are refused.
    let driver = NodeDriver::start(config.clone(), fake.clone()).unwrap();
    let e = driver.missing_driver().expect("no driver files");
    assert!(
        matches!(e, PrepareError::NoDriverFiles { gpus: 2, .. }),
        "{e}"
    );
    assert!(e.to_string().contains(&root.display().to_string()), "{e}");
    let e = driver
        .prepare(&node_claim(UID_A, &[("gpu", "gpu-0")]))
        .unwrap_err();
    assert!(e.to_string().contains("/dev/nvidiactl"), "{e}");

    // Half a driver (no GPU nodes, no libcuda): no longer "no driver", but claims fail
    // naming each missing file.
    std::fs::create_dir_all(root.join("dev")).unwrap();
    std::fs::write(root.join("dev/nvidiactl"), "").unwrap();
    driver.rediscover_driver_files().unwrap();
    assert!(driver.missing_driver().is_none());
    let e = driver
        .prepare(&node_claim(UID_A, &[("gpu", "gpu-0")]))
        .unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(e, PrepareError::MissingDriverFiles { .. }),
        "{text}"
    );
    for name in ["/dev/nvidia0", "/dev/nvidia-uvm", "libcuda.so.1"] {
        assert!(text.contains(name), "{name} not named: {text}");
    }
    assert!(!text.contains("/dev/nvidiactl,"), "{text}");
    assert!(text.contains(&root.display().to_string()), "{text}");
    let e = driver
        .prepare(&node_claim(UID_B, &[("mig", "gpu-1-mig-3g20gb-4")]))
        .unwrap_err();
    let text = e.to_string();
    assert!(text.contains("/dev/nvidia1"), "{text}");
    assert!(text.contains("nvidia-caps"), "{text}");
    // Nothing was created or written for the refused claims.
    assert!(fake.mutations().is_empty(), "{:?}", fake.mutations());
    assert!(driver.prepared_claims().is_empty());
    assert!(
        !driver
            .config()
            .cdi_root
            .join(cdi::spec_file_name(UID_A))
            .exists()
    );

    // The driver finishes installing: the next prepare looks again and succeeds.
    mock_nvml::driver_root::DriverRootFixture::with_minors(0..2)
        .lay_out(&root)
        .unwrap();
    driver
        .prepare(&node_claim(UID_A, &[("gpu", "gpu-0")]))
        .unwrap();
    driver
        .prepare(&node_claim(UID_B, &[("mig", "gpu-1-mig-3g20gb-4")]))
        .unwrap();
    let spec = cdi_json(&driver.config().cdi_root.join(cdi::spec_file_name(UID_B)));
    let nodes = spec["devices"][0]["containerEdits"]["deviceNodes"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(nodes, 3, "parent node and both capability nodes");
}

#[test]
fn repeat_prepare_changes_nothing() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    let claim = node_claim(UID_A, &[("mig", "gpu-0-mig-3g20gb-4")]);
    let first = node.driver.prepare(&claim).unwrap();
    let meta = |p: &std::path::Path| {
        let m = std::fs::metadata(p).unwrap();
        (m.modified().unwrap(), m.ino_compat())
    };
    let before = (meta(&node.cdi_path(UID_A)), meta(&node.checkpoint_path()));
    node.fake.clear_calls();
    let second = node.driver.prepare(&claim).unwrap();
    assert_eq!(first, second);
    assert_eq!(node.fake.calls(), []);
    assert_eq!(
        before,
        (meta(&node.cdi_path(UID_A)), meta(&node.checkpoint_path()))
    );
}

trait InoCompat {
    fn ino_compat(&self) -> u64;
}

impl InoCompat for std::fs::Metadata {
    fn ino_compat(&self) -> u64 {
        std::os::unix::fs::MetadataExt::ino(self)
    }
}

#[test]
fn unprepare_removes_everything_and_is_idempotent() {
    let node = Node::new(false, vec![plain_gpu(0)]);
    node.driver
        .prepare(&node_claim(UID_A, &[("gpu", "gpu-0")]))
        .unwrap();
    assert!(node.cdi_path(UID_A).exists());
    node.driver.unprepare(UID_A).unwrap();
    assert!(!node.cdi_path(UID_A).exists());
    assert!(node.checkpoint().claims.is_empty());
    node.driver.unprepare(UID_A).unwrap();
    node.driver.unprepare(UID_B).unwrap();
    assert!(node.driver.prepared_claims().is_empty());
    let e = node.driver.unprepare("../etc").unwrap_err();
    assert!(matches!(e, PrepareError::InvalidClaim { .. }), "{e}");
}

#[test]
fn unknown_devices_are_rejected_by_name() {
    let node = Node::new(false, vec![plain_gpu(0), mig_gpu(1)]);
    for (device, want) in [
        ("gpu-9", "no GPU with minor 9"),
        ("nvidia0", "must start with"),
        ("gpu-0-mig-1g5gb-0", "does not have MIG enabled"),
        ("gpu-1-mig-9g99gb-0", "no MIG profile 9g99gb"),
        ("gpu-1-mig-3g20gb-2", "no placement starting at 2"),
        ("gpu-1-mig-3g20gb-4", "on-demand MIG is off"),
        ("gpu-1", "MIG enabled and on-demand MIG is off"),
    ] {
        let e = node
            .driver
            .prepare(&node_claim(UID_A, &[("gpu", device)]))
            .unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, PrepareError::UnknownDevice { .. }), "{msg}");
        assert!(msg.contains(device) && msg.contains(want), "{msg}");
    }
    assert!(node.cdi_files().is_empty());
    assert!(node.checkpoint().claims.is_empty());
    assert_eq!(node.fake.mutations(), []);
}

#[test]
fn claims_for_other_drivers_or_pools_are_refused() {
    let node = Node::new(false, vec![plain_gpu(0)]);
    let claim = testing::claim(
        UID_A,
        &[
            ("gpu", "other.example.com", "node-a", "gpu-0"),
            ("gpu", DRIVER, "node-b", "gpu-0"),
        ],
    );
    let e = node.driver.prepare(&claim).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PrepareError::NotForThisNode { .. }), "{msg}");
    assert!(msg.contains("other.example.com/node-a/gpu-0"), "{msg}");

    let mut unallocated = node_claim(UID_A, &[]);
    unallocated.status = None;
    let e = node.driver.prepare(&unallocated).unwrap_err();
    assert!(matches!(e, PrepareError::NotAllocated { .. }), "{e}");

    let mut no_uid = node_claim(UID_A, &[("gpu", "gpu-0")]);
    no_uid.metadata.uid = None;
    assert!(matches!(
        node.driver.prepare(&no_uid).unwrap_err(),
        PrepareError::InvalidClaim { .. }
    ));
}

#[test]
fn invalid_configs_fail_the_claim_and_change_nothing() {
    let node = Node::new(false, vec![plain_gpu(0)]);
    let base = node_claim(UID_A, &[("gpu", "gpu-0")]);
    let unknown_field = with_config(
        base.clone(),
        "FromClaim",
        DRIVER,
        &[],
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig", "bogus": 1}),
    );
    let e = node.driver.prepare(&unknown_field).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PrepareError::InvalidConfig { .. }), "{msg}");
    assert!(msg.contains("config entry 0"), "{msg}");

    let wrong_kind = with_config(
        base.clone(),
        "FromClass",
        DRIVER,
        &["gpu"],
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "MigConfig"}),
    );
    let e = node.driver.prepare(&wrong_kind).unwrap_err();
    assert!(
        e.to_string()
            .contains("MigConfig cannot be applied to a GPU device"),
        "{e}"
    );

    // Another driver's config is not ours to judge.
    let foreign = with_config(
        base,
        "FromClaim",
        "other.example.com",
        &[],
        json!({"whatever": true}),
    );
    assert!(node.cdi_files().is_empty());
    node.driver.prepare(&foreign).unwrap();
}

/// The state [`RecordingSharing`] hands back: a time slice on a GPU no test has.
fn recording_state() -> SharingState {
    SharingState {
        mps_daemon: None,
        time_slicing: vec![crate::sharing::TimeSliceSetting {
            gpu_uuid: "GPU-recorded".into(),
            interval: cleave_api::config::TimeSliceInterval::Short,
        }],
    }
}

#[derive(Default)]
struct RecordingSharing {
    applied: Mutex<Vec<(String, Vec<String>)>>,
    released: Mutex<Vec<(String, Option<SharingState>)>>,
}

impl SharingHandler for RecordingSharing {
    fn apply(
        &self,
        claim: &SharingClaim<'_>,
        devices: &[SharingDevice],
        _needs: &[TimeSliceNeed],
    ) -> Result<SharingEdits, SharingFailure> {
        self.applied.lock().unwrap().push((
            claim.uid.to_owned(),
            devices.iter().map(|d| d.uuid.clone()).collect(),
        ));
        let mut edits = SharingEdits {
            state: Some(recording_state()),
            ..SharingEdits::default()
        };
        edits
            .claim_edits
            .env
            .push("CUDA_MPS_PIPE_DIRECTORY=/mps/pipe".into());
        Ok(edits)
    }

    fn release(
        &self,
        claim_uid: &str,
        state: Option<&SharingState>,
        _needs: &[TimeSliceNeed],
    ) -> Result<(), SharingFailure> {
        self.released
            .lock()
            .unwrap()
            .push((claim_uid.to_owned(), state.cloned()));
        Ok(())
    }
}

#[test]
fn sharing_configs_are_merged_recorded_and_handed_to_the_handler() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::new(inventory(vec![
        plain_gpu(0),
        plain_gpu(1),
    ])));
    let sharing = Arc::new(RecordingSharing::default());
    let driver =
        NodeDriver::start_with_sharing(config_in(dir.path(), false), fake, sharing.clone())
            .unwrap();
    let claim = node_claim(UID_A, &[("shared", "gpu-0"), ("solo", "gpu-1")]);
    let claim = with_config(
        claim,
        "FromClass",
        DRIVER,
        &[],
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
               "sharing": {"strategy": "TimeSlicing"}}),
    );
    let claim = with_config(
        claim,
        "FromClaim",
        DRIVER,
        &["shared"],
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
               "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50}}}),
    );
    driver.prepare(&claim).unwrap();
    assert_eq!(
        *sharing.applied.lock().unwrap(),
        [(UID_A.to_owned(), vec![gpu_uuid(0), gpu_uuid(1)])]
    );
    let spec = cdi_json(&driver.config().cdi_root.join(cdi::spec_file_name(UID_A)));
    let env = spec["containerEdits"]["env"].as_array().unwrap();
    assert!(
        env.contains(&json!("CUDA_MPS_PIPE_DIRECTORY=/mps/pipe")),
        "{env:?}"
    );

    let data = CheckpointStore::in_dir(&driver.config().state_dir)
        .load()
        .unwrap();
    let record = &data.claims[UID_A];
    assert_eq!(record.sharing, Some(recording_state()));
    let shared = record.devices[0].config.as_ref().unwrap();
    assert_eq!(shared.source, cleave_api::config::ConfigSource::FromClaim);
    assert_eq!(
        shared.config.sharing().unwrap().strategy,
        SharingStrategy::Mps
    );
    let solo = record.devices[1].config.as_ref().unwrap();
    assert_eq!(
        solo.config.sharing().unwrap().strategy,
        SharingStrategy::TimeSlicing
    );

    driver.unprepare(UID_A).unwrap();
    assert_eq!(
        *sharing.released.lock().unwrap(),
        [(UID_A.to_owned(), Some(recording_state()))]
    );
}

#[test]
fn device_busy_does_not_name_the_other_claim() {
    let node = Node::new(false, vec![plain_gpu(0)]);
    node.driver
        .prepare(&node_claim(UID_A, &[("gpu", "gpu-0")]))
        .unwrap();
    let e = node
        .driver
        .prepare(&node_claim(UID_B, &[("gpu", "gpu-0")]))
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PrepareError::DeviceBusy { .. }), "{msg}");
    // The holder may be another tenant's claim: only the requesting claim's objects.
    assert!(
        msg.contains("gpu-0") && msg.contains("another claim"),
        "{msg}"
    );
    assert!(!msg.contains(UID_A), "{msg}");
    assert!(!node.cdi_path(UID_B).exists());
}

#[test]
fn on_demand_mig_is_created_at_prepare_and_destroyed_at_unprepare() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    let claim = node_claim(UID_A, &[("mig", "gpu-0-mig-1g5gb-3")]);
    let prepared = node.driver.prepare(&claim).unwrap();
    assert_eq!(
        prepared.devices[0].cdi_device_ids,
        [format!(
            "k8s.gpu.cleave.dev/claim={UID_A}-gpu-0-mig-1g5gb-3"
        )]
    );
    assert_eq!(
        node.fake.mutations(),
        [Call::CreateMig {
            gpu_uuid: gpu_uuid(0),
            profile_id: 19,
            placement: Placement { start: 3, size: 1 },
        }]
    );
    let inst = node.fake.instances(&gpu_uuid(0))[0].clone();
    let record = node.checkpoint().claims[UID_A].clone();
    let mig = record.devices[0].mig.clone().unwrap();
    assert!(mig.created_by_cleave);
    assert_eq!(
        (mig.uuid.as_deref(), mig.gi_id, mig.ci_id),
        (Some(inst.uuid.as_str()), Some(inst.gi_id), Some(inst.ci_id))
    );
    assert_eq!(node.driver.owned_mig_uuids(), [inst.uuid.clone()].into());
    // The cached inventory shows the new instance without another NVML inventory call.
    assert!(matches!(
        &node.driver.inventory().gpus[0].mig,
        MigState::Enabled { instances, .. } if instances.len() == 1
    ));
    let spec = cdi_json(&node.cdi_path(UID_A));
    assert_eq!(
        spec["devices"][0]["containerEdits"]["env"][0],
        format!("CLEAVE_DEVICE_GPU_0_MIG_1G5GB_3_UUID={}", inst.uuid)
    );

    node.fake.clear_calls();
    node.driver.unprepare(UID_A).unwrap();
    assert_eq!(
        node.fake.mutations(),
        [Call::DestroyMig {
            gpu_uuid: gpu_uuid(0),
            gi_id: inst.gi_id,
            ci_id: inst.ci_id,
        }]
    );
    assert!(node.fake.instances(&gpu_uuid(0)).is_empty());
    assert!(node.driver.owned_mig_uuids().is_empty());
    assert!(!node.cdi_path(UID_A).exists());
}

#[test]
fn whole_mig_gpu_on_demand_gets_the_full_size_instance() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    node.driver
        .prepare(&node_claim(UID_A, &[("gpu", "gpu-0")]))
        .unwrap();
    assert_eq!(
        node.fake.mutations(),
        [Call::CreateMig {
            gpu_uuid: gpu_uuid(0),
            profile_id: 0,
            placement: Placement { start: 0, size: 8 },
        }]
    );
    let record = &node.checkpoint().claims[UID_A];
    assert_eq!(record.devices[0].kind, DeviceKind::Gpu);
    node.driver.unprepare(UID_A).unwrap();
    assert!(node.fake.instances(&gpu_uuid(0)).is_empty());
}

#[test]
fn static_mig_devices_are_used_as_they_are_and_never_destroyed() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::new(inventory(vec![mig_gpu(0)])));
    let admin = fake
        .add_instance(&gpu_uuid(0), 9, Placement { start: 4, size: 4 })
        .unwrap();
    for dynamic in [false, true] {
        let driver = NodeDriver::start(config_in(dir.path(), dynamic), fake.clone()).unwrap();
        fake.clear_calls();
        driver
            .prepare(&node_claim(UID_A, &[("mig", "gpu-0-mig-3g20gb-4")]))
            .unwrap();
        let record = CheckpointStore::in_dir(&driver.config().state_dir)
            .load()
            .unwrap()
            .claims[UID_A]
            .clone();
        let mig = record.devices[0].mig.clone().unwrap();
        assert!(!mig.created_by_cleave);
        assert_eq!(mig.uuid.as_deref(), Some(admin.uuid.as_str()));
        assert!(driver.owned_mig_uuids().is_empty());
        driver.unprepare(UID_A).unwrap();
        assert_eq!(fake.mutations(), []);
        assert_eq!(fake.instances(&gpu_uuid(0)), std::slice::from_ref(&admin));
    }
}

#[test]
fn failed_create_rolls_back_earlier_instances() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    // The second device overlaps an instance an administrator made behind the plugin's
    // back: the fake refuses it as NVML would.
    let outside = node
        .fake
        .add_instance(&gpu_uuid(0), 19, Placement { start: 1, size: 1 })
        .unwrap();
    let claim = node_claim(
        UID_A,
        &[("a", "gpu-0-mig-1g5gb-6"), ("b", "gpu-0-mig-2g10gb-0")],
    );
    let e = node.driver.prepare(&claim).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PrepareError::MigCreate { .. }), "{msg}");
    assert!(
        msg.contains("gpu-0-mig-2g10gb-0") && msg.contains("return code 23"),
        "{msg}"
    );
    let mutations = node.fake.mutations();
    assert_eq!(mutations.len(), 3, "{mutations:?}");
    assert!(matches!(mutations[2], Call::DestroyMig { .. }));
    assert_eq!(node.fake.instances(&gpu_uuid(0)), [outside]);
    assert!(node.cdi_files().is_empty());
    assert!(node.checkpoint().claims.is_empty());
    assert!(node.driver.owned_mig_uuids().is_empty());
}

#[test]
fn overlapping_placements_are_refused_before_anything_is_created() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    // Within one claim (an allocator that over-committed the GPU's counters).
    let claim = node_claim(
        UID_A,
        &[("a", "gpu-0-mig-1g5gb-0"), ("b", "gpu-0-mig-2g10gb-0")],
    );
    let msg = node.driver.prepare(&claim).unwrap_err().to_string();
    assert!(
        msg.contains("over-commit") && msg.contains("overlaps MIG device gpu-0-mig-1g5gb-0"),
        "{msg}"
    );
    assert_eq!(node.fake.mutations(), []);
    // Across claims, and a whole GPU over a MIG device of another claim.
    node.driver
        .prepare(&node_claim(UID_A, &[("a", "gpu-0-mig-3g20gb-4")]))
        .unwrap();
    node.fake.clear_calls();
    for (uid, device) in [(UID_B, "gpu-0-mig-2g10gb-4"), (UID_C, "gpu-0")] {
        let msg = node
            .driver
            .prepare(&node_claim(uid, &[("x", device)]))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("over-commit")
                && msg.contains("gpu-0-mig-3g20gb-4")
                && msg.contains("1.36.2"),
            "{device}: {msg}"
        );
    }
    assert_eq!(node.fake.mutations(), []);
    assert_eq!(node.checkpoint().claims.len(), 1);
}

#[test]
fn failed_cdi_write_rolls_back_the_instance_and_names_the_path() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    let cdi_root = node.driver.config().cdi_root.clone();
    std::fs::remove_dir(&cdi_root).unwrap();
    std::fs::write(&cdi_root, b"not a directory").unwrap();
    let e = node
        .driver
        .prepare(&node_claim(UID_A, &[("mig", "gpu-0-mig-1g5gb-3")]))
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PrepareError::Cdi { .. }), "{msg}");
    assert!(msg.contains(&cdi_root.display().to_string()), "{msg}");
    assert!(node.fake.instances(&gpu_uuid(0)).is_empty());
    assert!(node.checkpoint().claims.is_empty());
}

#[test]
fn failed_checkpoint_write_rolls_back_and_names_the_path() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    node.driver
        .prepare(&node_claim(UID_A, &[("mig", "gpu-0-mig-1g5gb-0")]))
        .unwrap();
    // Renaming over a non-empty directory fails: the next checkpoint write cannot land.
    let path = node.checkpoint_path();
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir(&path).unwrap();
    std::fs::write(path.join("keep"), b"").unwrap();
    let e = node
        .driver
        .prepare(&node_claim(UID_B, &[("mig", "gpu-0-mig-1g5gb-1")]))
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PrepareError::Checkpoint(_)), "{msg}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    // B's instance is gone, A's is untouched, no spec for B.
    assert_eq!(node.fake.instances(&gpu_uuid(0)).len(), 1);
    assert!(!node.cdi_path(UID_B).exists());
    assert!(node.cdi_path(UID_A).exists());
}

#[test]
fn interrupted_prepare_is_rolled_back_at_start() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    // What a crash after create_mig and before the Prepared record leaves behind: a
    // PrepareStarted record with the intended placement (no UUID yet), the instance, and
    // possibly a spec file. Another, admin-made instance must survive.
    let ours = node
        .fake
        .add_instance(&gpu_uuid(0), 14, Placement { start: 2, size: 2 })
        .unwrap();
    let admin = node
        .fake
        .add_instance(&gpu_uuid(0), 9, Placement { start: 4, size: 4 })
        .unwrap();
    let mut data = node.checkpoint();
    data.claims.insert(
        UID_C.into(),
        ClaimRecord {
            uid: UID_C.into(),
            namespace: "default".into(),
            name: "crashed".into(),
            state: ClaimState::PrepareStarted,
            devices: vec![DeviceRecord {
                name: "gpu-0-mig-2g10gb-2".into(),
                pool: "node-a".into(),
                request_names: vec!["mig".into()],
                kind: DeviceKind::Mig,
                admin_access: false,
                gpu_uuid: gpu_uuid(0),
                gpu_minor: 0,
                mig: Some(MigRecord {
                    profile_id: 14,
                    profile_name: "2g.10gb".into(),
                    placement: Placement { start: 2, size: 2 },
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
    CheckpointStore::in_dir(&node.driver.config().state_dir)
        .store(&data)
        .unwrap();
    std::fs::write(node.cdi_path(UID_C), b"{}").unwrap();
    // A spec of a claim nobody recorded (crash between CDI write and record), and a temp file.
    std::fs::write(node.cdi_path(UID_B), b"{}").unwrap();
    let tmp = node
        .driver
        .config()
        .cdi_root
        .join(format!(".{}.tmp", cdi::spec_file_name(UID_B)));
    std::fs::write(&tmp, b"{").unwrap();
    let unrelated = node.driver.config().cdi_root.join("nvidia.com-gpu.yaml");
    std::fs::write(&unrelated, b"").unwrap();

    let node = node.restart();
    assert_eq!(node.fake.instances(&gpu_uuid(0)), [admin]);
    assert!(node.fake.mutations().contains(&Call::DestroyMig {
        gpu_uuid: gpu_uuid(0),
        gi_id: ours.gi_id,
        ci_id: ours.ci_id,
    }));
    assert!(node.checkpoint().claims.is_empty());
    assert_eq!(node.cdi_files(), ["nvidia.com-gpu.yaml"]);
}

#[test]
fn prepared_claims_survive_restart_and_a_new_boot_recreates_them() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    let claim = node_claim(UID_A, &[("mig", "gpu-0-mig-1g5gb-3")]);
    let first = node.driver.prepare(&claim).unwrap();
    let node = node.restart();
    assert_eq!(node.driver.prepared_claims().len(), 1);
    assert_eq!(node.driver.owned_mig_uuids().len(), 1);
    node.fake.clear_calls();
    // Idempotent across a restart too.
    node.driver.prepare(&claim).unwrap();
    assert_eq!(node.fake.calls(), []);

    let old = simulate_reboot(&node);
    // After the reboot an administrator's instance gets the old GI id.
    let admin = node
        .fake
        .add_instance(&gpu_uuid(0), 19, Placement { start: 5, size: 1 })
        .unwrap();
    assert_eq!(admin.gi_id, old[0].gi_id);
    let node = node.restart();
    // Recreated at exactly the recorded profile and placement; nothing destroyed.
    assert_eq!(
        node.fake.mutations(),
        [Call::CreateMig {
            gpu_uuid: gpu_uuid(0),
            profile_id: 19,
            placement: Placement { start: 3, size: 1 },
        }]
    );
    let now = node.fake.instances(&gpu_uuid(0));
    let ours = now.iter().find(|i| i.placement.start == 3).unwrap().clone();
    assert_ne!(ours.uuid, old[0].uuid);
    assert!(now.contains(&admin));
    let data = node.checkpoint();
    assert_eq!(data.boot_id, "new-boot");
    let record = &data.claims[UID_A];
    assert_eq!(record.state, ClaimState::Prepared);
    let mig = record.devices[0].mig.as_ref().unwrap();
    assert_eq!(
        (mig.uuid.as_deref(), mig.gi_id, mig.ci_id),
        (Some(ours.uuid.as_str()), Some(ours.gi_id), Some(ours.ci_id))
    );
    assert_eq!(node.driver.owned_mig_uuids(), [ours.uuid.clone()].into());
    // The CDI spec is back with the same device names, pointing at the new instance.
    let spec = cdi_json(&node.cdi_path(UID_A));
    assert_eq!(
        spec["devices"][0]["name"],
        format!("{UID_A}-gpu-0-mig-1g5gb-3")
    );
    let text = spec.to_string();
    assert!(
        text.contains(&ours.uuid) && !text.contains(&old[0].uuid),
        "{text}"
    );
    assert!(node.driver.claims_needing_recreate().is_empty());

    // The replayed prepare answers the same IDs and creates nothing.
    node.fake.clear_calls();
    assert_eq!(node.driver.prepare(&claim).unwrap(), first);
    assert_eq!(node.fake.calls(), []);
    // Unprepare destroys ours (by its new IDs) and never the administrator's.
    node.driver.unprepare(UID_A).unwrap();
    assert_eq!(node.fake.instances(&gpu_uuid(0)), [admin]);
}

/// What a reboot does to the fake hardware: every instance is gone, the boot ID is new.
/// Returns the instances that existed.
fn simulate_reboot(node: &Node) -> Vec<crate::model::MigInstance> {
    let mut old = Vec::new();
    for gpu in node.fake.inventory().unwrap().gpus {
        for inst in node.fake.instances(&gpu.uuid) {
            node.fake
                .destroy_mig(&gpu.uuid, inst.gi_id, inst.ci_id)
                .unwrap();
            old.push(inst);
        }
    }
    std::fs::write(&node.driver.config().boot_id_path, "new-boot\n").unwrap();
    for f in node.cdi_files() {
        std::fs::remove_file(node.driver.config().cdi_root.join(f)).unwrap();
    }
    node.fake.clear_calls();
    old
}

#[test]
fn failed_recreation_keeps_the_claim_and_prepare_retries_it() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    let claim = node_claim(UID_A, &[("mig", "gpu-0-mig-2g10gb-2")]);
    let first = node.driver.prepare(&claim).unwrap();
    simulate_reboot(&node);
    node.fake.fail_next_create(BackendError::Nvml {
        call: "nvmlDeviceCreateGpuInstanceWithPlacement",
        target: gpu_uuid(0),
        message: "Insufficient Resources".into(),
        code: 23,
    });
    let node = node.restart();
    assert_eq!(node.fake.instances(&gpu_uuid(0)), []);
    let pending = node.driver.claims_needing_recreate();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].claim.uid, UID_A);
    let error = pending[0].error.clone().unwrap();
    assert!(
        error.contains("gpu-0-mig-2g10gb-2") && error.contains("23"),
        "{error}"
    );
    assert_eq!(
        node.checkpoint().claims[UID_A].state,
        ClaimState::NeedsRecreate
    );
    assert!(!node.cdi_path(UID_A).exists());
    // Still recorded as prepared: its device is busy for other claims.
    assert_eq!(node.driver.prepared_claims().len(), 1);

    // A replayed prepare while the hardware refuses: a clear error, never an answer.
    node.fake.fail_next_create(BackendError::Nvml {
        call: "nvmlDeviceCreateGpuInstanceWithPlacement",
        target: gpu_uuid(0),
        message: "Insufficient Resources".into(),
        code: 23,
    });
    let e = node.driver.prepare(&claim).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PrepareError::MigRecreate { .. }), "{msg}");
    assert!(
        msg.contains("gpu-0-mig-2g10gb-2") && msg.contains("after a reboot"),
        "{msg}"
    );
    assert!(!node.cdi_path(UID_A).exists());
    // Once the hardware takes it, the replayed prepare recreates and answers the same IDs.
    node.fake.clear_calls();
    assert_eq!(node.driver.prepare(&claim).unwrap(), first);
    assert_eq!(
        node.fake.mutations(),
        [Call::CreateMig {
            gpu_uuid: gpu_uuid(0),
            profile_id: 14,
            placement: Placement { start: 2, size: 2 },
        }]
    );
    assert!(node.cdi_path(UID_A).exists());
    assert_eq!(node.checkpoint().claims[UID_A].state, ClaimState::Prepared);
    assert!(node.driver.claims_needing_recreate().is_empty());
    node.fake.clear_calls();
    node.driver.prepare(&claim).unwrap();
    assert_eq!(node.fake.calls(), []);
}

#[test]
fn unprepare_before_recreation_destroys_nothing() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    node.driver
        .prepare(&node_claim(UID_A, &[("mig", "gpu-0-mig-1g5gb-0")]))
        .unwrap();
    // An interrupted prepare of the old boot, too.
    let mut data = node.checkpoint();
    let mut started = data.claims[UID_A].clone();
    started.uid = UID_B.into();
    started.state = ClaimState::PrepareStarted;
    started.devices[0].name = "gpu-0-mig-1g5gb-1".into();
    started.devices[0].mig.as_mut().unwrap().placement = Placement { start: 1, size: 1 };
    data.claims.insert(UID_B.into(), started);
    CheckpointStore::in_dir(&node.driver.config().state_dir)
        .store(&data)
        .unwrap();
    simulate_reboot(&node);
    node.fake
        .fail_next_create(BackendError::GpuNotFound(gpu_uuid(0)));
    let node = node.restart();
    // The interrupted prepare is dropped without destroying anything.
    assert_eq!(node.driver.prepared_claims().len(), 1);
    assert_eq!(
        node.checkpoint().claims[UID_A].state,
        ClaimState::NeedsRecreate
    );
    // Someone now creates instances exactly at both recorded placements.
    let theirs = node
        .fake
        .add_instance(&gpu_uuid(0), 19, Placement { start: 0, size: 1 })
        .unwrap();
    let theirs_b = node
        .fake
        .add_instance(&gpu_uuid(0), 19, Placement { start: 1, size: 1 })
        .unwrap();
    node.fake.clear_calls();
    node.driver.unprepare(UID_A).unwrap();
    assert_eq!(node.fake.mutations(), []);
    assert_eq!(node.fake.instances(&gpu_uuid(0)), [theirs, theirs_b]);
    assert!(node.checkpoint().claims.is_empty());
    assert!(node.driver.claims_needing_recreate().is_empty());
}

/// What a crash of the recreation after a reboot leaves behind between `create_mig` and its
/// record: the claim `NeedsRecreate` with the intent naming `intent_boot`, no UUID, and the
/// instance on the hardware. Returns that instance.
fn crash_inside_recreation(node: &Node, intent_boot: &str) -> crate::model::MigInstance {
    let mut data = node.checkpoint();
    data.boot_id = "new-boot".into();
    let record = data.claims.get_mut(UID_A).unwrap();
    record.state = ClaimState::NeedsRecreate;
    forget_instances_of(record);
    let mig = record.devices[0].mig.as_mut().unwrap();
    mig.creating_in_boot = Some(intent_boot.into());
    let (profile_id, placement) = (mig.profile_id, mig.placement);
    CheckpointStore::in_dir(&node.driver.config().state_dir)
        .store(&data)
        .unwrap();
    node.fake
        .add_instance(&gpu_uuid(0), profile_id, placement)
        .unwrap()
}

#[test]
fn an_instance_of_an_interrupted_recreation_is_adopted_not_created_again() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    let claim = node_claim(UID_A, &[("mig", "gpu-0-mig-1g5gb-3")]);
    let first = node.driver.prepare(&claim).unwrap();
    simulate_reboot(&node);
    let orphan = crash_inside_recreation(&node, "new-boot");
    let node = node.restart();
    // Adopted: nothing created (that would fail at the taken placement), nothing destroyed.
    assert_eq!(node.fake.mutations(), []);
    assert!(node.driver.claims_needing_recreate().is_empty());
    let record = node.checkpoint().claims[UID_A].clone();
    assert_eq!(record.state, ClaimState::Prepared);
    let mig = record.devices[0].mig.clone().unwrap();
    assert_eq!(
        (
            mig.uuid.as_deref(),
            mig.gi_id,
            mig.ci_id,
            mig.creating_in_boot
        ),
        (
            Some(orphan.uuid.as_str()),
            Some(orphan.gi_id),
            Some(orphan.ci_id),
            None
        )
    );
    assert!(
        cdi_json(&node.cdi_path(UID_A))
            .to_string()
            .contains(&orphan.uuid)
    );
    assert_eq!(node.driver.prepare(&claim).unwrap(), first);
    node.driver.unprepare(UID_A).unwrap();
    assert_eq!(node.fake.instances(&gpu_uuid(0)), []);
}

#[test]
fn an_intent_of_another_boot_never_adopts_an_instance() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    let claim = node_claim(UID_A, &[("mig", "gpu-0-mig-1g5gb-3")]);
    node.driver.prepare(&claim).unwrap();
    simulate_reboot(&node);
    // The instance at the placement is someone else's (e.g. a boot-time MIG config).
    let theirs = crash_inside_recreation(&node, "old-boot");
    let node = node.restart();
    assert_eq!(
        node.fake.mutations(),
        [Call::CreateMig {
            gpu_uuid: gpu_uuid(0),
            profile_id: 19,
            placement: Placement { start: 3, size: 1 },
        }]
    );
    assert_eq!(node.driver.claims_needing_recreate().len(), 1);
    let record = node.checkpoint().claims[UID_A].clone();
    assert_eq!(record.state, ClaimState::NeedsRecreate);
    assert_eq!(record.devices[0].mig.as_ref().unwrap().uuid, None);
    node.fake.clear_calls();
    node.driver.unprepare(UID_A).unwrap();
    assert_eq!(node.fake.mutations(), []);
    assert_eq!(node.fake.instances(&gpu_uuid(0)), [theirs]);
}

#[test]
fn a_failed_recreation_drops_its_intent_so_a_retry_never_adopts_another_instance() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    let claim = node_claim(UID_A, &[("mig", "gpu-0-mig-1g5gb-3")]);
    node.driver.prepare(&claim).unwrap();
    simulate_reboot(&node);
    node.fake.fail_next_create(BackendError::Nvml {
        call: "nvmlDeviceCreateGpuInstanceWithPlacement",
        target: gpu_uuid(0),
        message: "Insufficient Resources".into(),
        code: 23,
    });
    let node = node.restart();
    let record = node.checkpoint().claims[UID_A].clone();
    assert_eq!(record.state, ClaimState::NeedsRecreate);
    assert_eq!(
        record.devices[0].mig.as_ref().unwrap().creating_in_boot,
        None
    );
    // An administrator now creates an identical instance at the placement.
    let theirs = node
        .fake
        .add_instance(&gpu_uuid(0), 19, Placement { start: 3, size: 1 })
        .unwrap();
    node.fake.clear_calls();
    let e = node.driver.prepare(&claim).unwrap_err();
    assert!(matches!(e, PrepareError::MigRecreate { .. }), "{e}");
    assert_eq!(
        node.checkpoint().claims[UID_A].devices[0]
            .mig
            .as_ref()
            .unwrap()
            .uuid,
        None
    );
    node.driver.unprepare(UID_A).unwrap();
    assert_eq!(node.fake.instances(&gpu_uuid(0)), [theirs]);
}

#[test]
fn a_vanished_instance_is_recreated_at_start() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    node.driver
        .prepare(&node_claim(
            UID_A,
            &[("a", "gpu-0-mig-1g5gb-0"), ("b", "gpu-0-mig-1g5gb-1")],
        ))
        .unwrap();
    let before = node.fake.instances(&gpu_uuid(0));
    // Someone destroys one of them; the other stays.
    node.fake
        .destroy_mig(&gpu_uuid(0), before[1].gi_id, before[1].ci_id)
        .unwrap();
    node.fake.clear_calls();
    let node = node.restart();
    assert_eq!(
        node.fake.mutations(),
        [Call::CreateMig {
            gpu_uuid: gpu_uuid(0),
            profile_id: 19,
            placement: Placement { start: 1, size: 1 },
        }]
    );
    let now = node.fake.instances(&gpu_uuid(0));
    assert_eq!(now.len(), 2);
    assert_eq!(now[0], before[0]);
    let record = node.checkpoint().claims[UID_A].clone();
    assert_eq!(record.state, ClaimState::Prepared);
    assert_eq!(
        record.devices[1].mig.as_ref().unwrap().uuid.as_deref(),
        Some(now[1].uuid.as_str())
    );
    // A start with everything in place only lists (once per GPU) and creates nothing.
    node.fake.clear_calls();
    let node = node.restart();
    assert_eq!(node.fake.mutations(), []);
    let lists = node
        .fake
        .calls()
        .iter()
        .filter(|c| matches!(c, Call::ListMig { .. }))
        .count();
    assert_eq!(lists, 1);
}

#[test]
fn static_mig_missing_after_reboot_is_a_clear_error_until_it_exists_again() {
    let node = Node::new(false, vec![mig_gpu(0)]);
    node.fake
        .add_instance(&gpu_uuid(0), 9, Placement { start: 4, size: 4 })
        .unwrap();
    node.driver.refresh_inventory().unwrap();
    let claim = node_claim(UID_A, &[("mig", "gpu-0-mig-3g20gb-4")]);
    let first = node.driver.prepare(&claim).unwrap();
    simulate_reboot(&node);
    let node = node.restart();
    assert_eq!(node.fake.mutations(), []);
    let e = node.driver.prepare(&claim).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PrepareError::StaticMigMissing { .. }), "{msg}");
    assert!(
        msg.contains("gpu-0-mig-3g20gb-4") && msg.contains("not created by cleave"),
        "{msg}"
    );
    // The administrator's boot-time configuration makes it again.
    let again = node
        .fake
        .add_instance(&gpu_uuid(0), 9, Placement { start: 4, size: 4 })
        .unwrap();
    node.fake.clear_calls();
    assert_eq!(node.driver.prepare(&claim).unwrap(), first);
    assert_eq!(node.fake.mutations(), []);
    let record = node.checkpoint().claims[UID_A].clone();
    assert_eq!(
        record.devices[0].mig.as_ref().unwrap().uuid.as_deref(),
        Some(again.uuid.as_str())
    );
    node.driver.unprepare(UID_A).unwrap();
    assert_eq!(node.fake.instances(&gpu_uuid(0)), [again]);
}

#[test]
fn sharing_is_applied_again_after_a_reboot_with_the_new_uuids() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::new(inventory(vec![mig_gpu(0), plain_gpu(1)])));
    let sharing = Arc::new(RecordingSharing::default());
    let config = config_in(dir.path(), true);
    let driver =
        NodeDriver::start_with_sharing(config.clone(), fake.clone(), sharing.clone()).unwrap();
    let mps = json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "MigConfig",
               "sharing": {"strategy": "MPS"}});
    let claim = with_config(
        node_claim(UID_A, &[("mig", "gpu-0-mig-1g5gb-6")]),
        "FromClaim",
        DRIVER,
        &[],
        mps,
    );
    let first = driver.prepare(&claim).unwrap();
    let old = fake.instances(&gpu_uuid(0))[0].clone();
    drop(driver);
    fake.destroy_mig(&gpu_uuid(0), old.gi_id, old.ci_id)
        .unwrap();
    std::fs::write(&config.boot_id_path, "new-boot\n").unwrap();
    let driver =
        NodeDriver::start_with_sharing(config.clone(), fake.clone(), sharing.clone()).unwrap();
    let new = fake.instances(&gpu_uuid(0))[0].clone();
    assert_ne!(new.uuid, old.uuid);
    assert_eq!(
        *sharing.applied.lock().unwrap(),
        [
            (UID_A.to_owned(), vec![old.uuid.clone()]),
            (UID_A.to_owned(), vec![new.uuid.clone()])
        ]
    );
    let spec = cdi_json(&config.cdi_root.join(cdi::spec_file_name(UID_A)));
    let env = spec["containerEdits"]["env"].as_array().unwrap();
    assert!(
        env.contains(&json!("CUDA_MPS_PIPE_DIRECTORY=/mps/pipe")),
        "{env:?}"
    );
    assert_eq!(driver.prepare(&claim).unwrap(), first);
    assert_eq!(sharing.applied.lock().unwrap().len(), 2);
}

#[test]
fn unprepare_never_destroys_a_reused_instance_id() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    node.driver
        .prepare(&node_claim(UID_A, &[("mig", "gpu-0-mig-1g5gb-0")]))
        .unwrap();
    let ours = node.fake.instances(&gpu_uuid(0))[0].clone();
    // Someone destroys our instance and creates another one with the same GI id.
    node.fake
        .destroy_mig(&gpu_uuid(0), ours.gi_id, ours.ci_id)
        .unwrap();
    let theirs = node
        .fake
        .add_instance(&gpu_uuid(0), 19, Placement { start: 0, size: 1 })
        .unwrap();
    assert_eq!(theirs.gi_id, ours.gi_id);
    node.fake.clear_calls();
    node.driver.unprepare(UID_A).unwrap();
    assert_eq!(node.fake.mutations(), []);
    assert_eq!(node.fake.instances(&gpu_uuid(0)), [theirs]);
}

#[test]
fn failed_destroy_keeps_the_claim_for_a_retry() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    node.driver
        .prepare(&node_claim(UID_A, &[("mig", "gpu-0-mig-1g5gb-0")]))
        .unwrap();
    node.fake.fail_destroy(Some(BackendError::Nvml {
        call: "nvmlGpuInstanceDestroy",
        target: gpu_uuid(0),
        message: "In use by another client".into(),
        code: 19,
    }));
    let e = node.driver.unprepare(UID_A).unwrap_err();
    assert!(matches!(e, PrepareError::MigDestroy { .. }), "{e}");
    assert!(e.to_string().contains("return code 19"), "{e}");
    assert_eq!(node.driver.prepared_claims().len(), 1);
    node.fake.fail_destroy(None);
    node.driver.unprepare(UID_A).unwrap();
    assert!(node.driver.prepared_claims().is_empty());
    assert!(node.fake.instances(&gpu_uuid(0)).is_empty());
}

#[test]
fn several_claims_share_a_gpu_in_any_order() {
    let devices = [
        (UID_A, "gpu-0-mig-3g20gb-4"),
        (UID_B, "gpu-0-mig-2g10gb-0"),
        (UID_C, "gpu-0-mig-1g5gb-2"),
    ];
    let orders: [[usize; 3]; 6] = [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ];
    for prepare_order in orders {
        for unprepare_order in [[0, 1, 2], [2, 1, 0], [1, 0, 2]] {
            let node = Node::new(true, vec![mig_gpu(0)]);
            for &i in &prepare_order {
                let (uid, device) = devices[i];
                node.driver
                    .prepare(&node_claim(uid, &[("mig", device)]))
                    .unwrap();
            }
            assert_eq!(node.fake.instances(&gpu_uuid(0)).len(), 3);
            assert_eq!(node.driver.owned_mig_uuids().len(), 3);
            assert_eq!(node.cdi_files().len(), 3);
            for (n, &i) in unprepare_order.iter().enumerate() {
                node.driver.unprepare(devices[i].0).unwrap();
                assert_eq!(node.fake.instances(&gpu_uuid(0)).len(), 2 - n);
            }
            assert!(node.cdi_files().is_empty());
            assert!(node.checkpoint().claims.is_empty());
        }
    }
}

#[test]
fn subrequests_answer_with_base_request_names() {
    let node = Node::new(false, vec![plain_gpu(0), plain_gpu(1)]);
    let claim = node_claim(UID_A, &[("gpus/small", "gpu-0"), ("gpus/big", "gpu-1")]);
    let prepared = node.driver.prepare(&claim).unwrap();
    assert_eq!(prepared.devices.len(), 2);
    assert!(prepared.devices.iter().all(|d| d.request_names == ["gpus"]));
    let record = &node.checkpoint().claims[UID_A];
    assert_eq!(record.devices[0].request_names, ["gpus/small"]);
}

#[test]
fn failed_rollback_at_start_keeps_serving_and_retries_later() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    node.driver
        .prepare(&node_claim(UID_A, &[("mig", "gpu-0-mig-1g5gb-0")]))
        .unwrap();
    // Turn A's record into an interrupted one, then make destroys fail for the restart.
    let mut data = node.checkpoint();
    data.claims.get_mut(UID_A).unwrap().state = ClaimState::PrepareStarted;
    CheckpointStore::in_dir(&node.driver.config().state_dir)
        .store(&data)
        .unwrap();
    node.fake.fail_destroy(Some(BackendError::Nvml {
        call: "nvmlGpuInstanceDestroy",
        target: gpu_uuid(0),
        message: "In use by another client".into(),
        code: 19,
    }));
    let node = node.restart();
    assert_eq!(node.driver.prepared_claims().len(), 1);
    assert_eq!(node.fake.instances(&gpu_uuid(0)).len(), 1);
    // Its device stays busy for others.
    let e = node
        .driver
        .prepare(&node_claim(UID_B, &[("mig", "gpu-0-mig-1g5gb-0")]))
        .unwrap_err();
    assert!(matches!(e, PrepareError::DeviceBusy { .. }), "{e}");
    node.fake.fail_destroy(None);
    node.driver.unprepare(UID_A).unwrap();
    assert!(node.fake.instances(&gpu_uuid(0)).is_empty());
    assert!(node.driver.prepared_claims().is_empty());
}

#[test]
fn one_device_for_two_requests_needs_one_config() {
    let node = Node::new(false, vec![plain_gpu(0)]);
    let both = node_claim(UID_A, &[("a", "gpu-0"), ("b", "gpu-0")]);
    let ts = json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
                    "sharing": {"strategy": "TimeSlicing"}});
    let e = node
        .driver
        .prepare(&with_config(
            both.clone(),
            "FromClaim",
            DRIVER,
            &["a"],
            ts.clone(),
        ))
        .unwrap_err();
    assert!(e.to_string().contains("different configs"), "{e}");
    // The same config for both requests is fine, and the device is answered once.
    let prepared = node
        .driver
        .prepare(&with_config(both, "FromClaim", DRIVER, &[], ts))
        .unwrap();
    assert_eq!(prepared.devices.len(), 1);
    assert_eq!(prepared.devices[0].request_names, ["a", "b"]);
}

#[test]
fn two_plugin_instances_on_one_node_never_lose_each_others_records() {
    // A rolling update: old and new plugin run side by side on the same files and GPUs,
    // their calls serialised by the shell's node lock (here: sequential calls).
    let old = Node::new(true, vec![mig_gpu(0)]);
    let new = NodeDriver::start(old.driver.config().clone(), old.fake.clone()).unwrap();
    old.driver
        .prepare(&node_claim(UID_A, &[("mig", "gpu-0-mig-3g20gb-0")]))
        .unwrap();
    // Views of the new instance include what the old one did.
    assert_eq!(new.owned_mig_uuids(), old.driver.owned_mig_uuids());
    assert_eq!(new.prepared_claims().len(), 1);
    new.prepare(&node_claim(UID_B, &[("mig", "gpu-0-mig-3g20gb-4")]))
        .unwrap();
    let uids: Vec<String> = old.checkpoint().claims.into_keys().collect();
    assert_eq!(uids, [UID_A, UID_B]);
    // The new instance knows the old one's device is taken.
    let e = new
        .prepare(&node_claim(UID_C, &[("mig", "gpu-0-mig-3g20gb-0")]))
        .unwrap_err();
    assert!(matches!(e, PrepareError::DeviceBusy { .. }), "{e}");
    // The new instance can unprepare what the old one prepared, with its instance.
    new.unprepare(UID_A).unwrap();
    old.driver.unprepare(UID_B).unwrap();
    assert!(old.checkpoint().claims.is_empty());
    assert!(old.fake.instances(&gpu_uuid(0)).is_empty());
    assert!(old.cdi_files().is_empty());
}

#[test]
fn device_metadata_per_request_only_when_enabled_and_removed_with_the_claim() {
    let node = Node::new(false, vec![plain_gpu(0), plain_gpu(1)]);
    let metadata_root = node.driver.config().state_dir.join("dra-device-metadata");
    // Off: nothing written, one CDI ID per device.
    let plain = node_claim(UID_B, &[("gpu", "gpu-0")]);
    let prepared = node.driver.prepare(&plain).unwrap();
    assert_eq!(prepared.devices[0].cdi_device_ids.len(), 1);
    assert!(!metadata_root.exists());
    node.driver.unprepare(UID_B).unwrap();

    node.driver
        .enable_device_metadata(crate::pool::PoolOptions::default());
    let mut claim = node_claim(UID_A, &[("pair", "gpu-0"), ("pair", "gpu-1")]);
    claim.metadata.annotations = Some(
        [(
            crate::metadata::POD_CLAIM_NAME_ANNOTATION.to_owned(),
            "trainer".to_owned(),
        )]
        .into(),
    );
    let prepared = node.driver.prepare(&claim).unwrap();
    let id = format!("{DRIVER}/metadata={UID_A}_pair");
    assert_eq!(
        prepared.devices[0].cdi_device_ids,
        vec![
            format!("k8s.gpu.cleave.dev/claim={UID_A}-gpu-0"),
            id.clone()
        ]
    );
    assert_eq!(
        prepared.devices[1].cdi_device_ids,
        vec![format!("k8s.gpu.cleave.dev/claim={UID_A}-gpu-1")]
    );
    let file = metadata_root.join("default_claim-aaaaaaaa/pair/metadata.json");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(doc["podClaimName"], "trainer");
    assert_eq!(doc["metadata"]["generation"], 1);
    let devices = doc["requests"][0]["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    for (d, minor) in devices.iter().zip([0, 1]) {
        assert_eq!(
            d["attributes"][format!("{DRIVER}/uuid")]["string"],
            gpu_uuid(minor)
        );
        assert_eq!(d["attributes"][format!("{DRIVER}/type")]["string"], "gpu");
    }
    let spec_path = node
        .driver
        .config()
        .cdi_root
        .join(format!("{DRIVER}_metadata_{UID_A}_pair.json"));
    let spec = cdi_json(&spec_path);
    assert_eq!(
        spec["devices"][0]["containerEdits"]["mounts"][0]["containerPath"],
        format!(
            "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/trainer/pair/{DRIVER}-metadata.json"
        )
    );
    // The IDs are recorded: a replayed prepare answers the same.
    assert_eq!(node.driver.prepare(&claim).unwrap(), prepared);

    node.driver.unprepare(UID_A).unwrap();
    assert!(!file.exists() && !spec_path.exists());
    assert!(!metadata_root.join("default_claim-aaaaaaaa").exists());

    // A leftover of a claim no longer recorded goes at the next start.
    node.driver.prepare(&claim).unwrap();
    let mut data = node.checkpoint();
    data.claims.remove(UID_A);
    CheckpointStore::in_dir(&node.driver.config().state_dir)
        .store(&data)
        .unwrap();
    let node = node.restart();
    assert!(file.exists());
    node.driver
        .enable_device_metadata(crate::pool::PoolOptions::default());
    assert!(!file.exists() && !spec_path.exists());
}

#[test]
fn device_metadata_of_mig_devices_and_of_a_failed_prepare() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    node.driver
        .enable_device_metadata(crate::pool::PoolOptions {
            dynamic_mig: true,
            ..Default::default()
        });
    node.driver
        .prepare(&node_claim(UID_A, &[("mig", "gpu-0-mig-1g5gb-0")]))
        .unwrap();
    let root = node.driver.config().state_dir.join("dra-device-metadata");
    let a_file = root.join("default_claim-aaaaaaaa/mig/metadata.json");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&a_file).unwrap()).unwrap();
    let attrs = &doc["requests"][0]["devices"][0]["attributes"];
    // The MIG device created at prepare: its UUID and its GPU's.
    assert!(
        attrs[format!("{DRIVER}/uuid")]["string"]
            .as_str()
            .is_some_and(|u| u.starts_with("MIG-")),
        "{attrs}"
    );
    assert_eq!(attrs[format!("{DRIVER}/parentUUID")]["string"], gpu_uuid(0));

    // A prepare whose checkpoint write fails after the metadata write (a whole GPU: no
    // intent record first) takes its metadata with it.
    let node = Node::new(false, vec![plain_gpu(0), plain_gpu(1)]);
    node.driver
        .enable_device_metadata(crate::pool::PoolOptions::default());
    node.driver
        .prepare(&node_claim(UID_A, &[("gpu", "gpu-0")]))
        .unwrap();
    let path = node.checkpoint_path();
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir(&path).unwrap();
    std::fs::write(path.join("keep"), b"").unwrap();
    let e = node
        .driver
        .prepare(&node_claim(UID_B, &[("gpu", "gpu-1")]))
        .unwrap_err();
    assert!(matches!(e, PrepareError::Checkpoint(_)), "{e}");
    let root = node.driver.config().state_dir.join("dra-device-metadata");
    let cdi_root = &node.driver.config().cdi_root;
    assert!(!root.join("default_claim-bbbbbbbb").exists());
    assert!(
        !cdi_root
            .join(format!("{DRIVER}_metadata_{UID_B}_gpu.json"))
            .exists()
    );
    assert!(
        root.join("default_claim-aaaaaaaa/gpu/metadata.json")
            .exists()
    );
    assert!(
        cdi_root
            .join(format!("{DRIVER}_metadata_{UID_A}_gpu.json"))
            .exists()
    );
}

// ---------------------------------------------------------------------------------------
// Plan rules for shares, admin access and MIG placements (each kills mutants of plan.rs
// that the tests above let survive).

/// A node whose plugin runs with `--consumable-capacity mode`.
fn node_with_mode(dynamic: bool, gpus: Vec<GpuInfo>, mode: ConsumableCapacity) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::new(inventory(gpus)));
    let mut config = config_in(dir.path(), dynamic);
    config.consumable_capacity = mode;
    let driver = NodeDriver::start(config, fake.clone()).unwrap();
    fake.clear_calls();
    Node { dir, fake, driver }
}

/// The plan of `claim` against the node's state now (nothing is prepared).
fn plan_of(node: &Node, claim: &ResourceClaim) -> Planned {
    let uid = claim.metadata.uid.as_deref().unwrap();
    let state = node.driver.lock();
    Planned(
        node.driver
            .planner
            .plan(claim, &plan::claim_label(claim), uid, &state),
    )
}

/// A plan or its refusal ([`plan::PlannedDevice`] has no `Debug` for `Result::unwrap`).
struct Planned(Result<Vec<plan::PlannedDevice>, PrepareError>);

impl Planned {
    fn unwrap(self) -> Vec<plan::PlannedDevice> {
        self.0.unwrap_or_else(|e| panic!("refused: {e}"))
    }

    fn unwrap_err(self) -> PrepareError {
        match self.0 {
            Ok(plan) => panic!("planned {} devices", plan.len()),
            Err(e) => e,
        }
    }
}

#[test]
fn a_share_on_a_node_with_consumable_capacity_off_is_refused() {
    let claim = as_share(
        node_claim(UID_A, &[("part", "gpu-0")]),
        0,
        "s-1",
        &[("memory", "2Gi")],
    );
    let node = Node::new(false, vec![plain_gpu(0)]);
    let e = node.driver.prepare(&claim).unwrap_err();
    assert!(
        matches!(&e, PrepareError::ShareRefused { device, reason, .. }
            if device == "gpu-0" && reason.contains("allocated as share s-1")
                && reason.contains("--consumable-capacity off")),
        "{e}"
    );
    assert!(node.checkpoint().claims.is_empty());
    // With admin access the share is not refused (admin access never shares).
    plan_of(&node, &as_admin(claim.clone(), 0)).unwrap();
    // A node that shares plans it.
    let node = node_with_mode(false, vec![plain_gpu(0)], ConsumableCapacity::TimeSlicing);
    plan_of(&node, &claim).unwrap();
}

#[test]
fn on_demand_mig_placements_on_different_gpus_never_overlap() {
    let node = Node::new(true, vec![mig_gpu(0), mig_gpu(1)]);
    // The same placement on another GPU, held by another claim.
    node.driver
        .prepare(&node_claim(UID_A, &[("a", "gpu-0-mig-3g20gb-4")]))
        .unwrap();
    node.driver
        .prepare(&node_claim(UID_B, &[("b", "gpu-1-mig-3g20gb-4")]))
        .unwrap();
    // The same placement on two GPUs, in one claim.
    node.driver
        .prepare(&node_claim(
            UID_C,
            &[("a", "gpu-0-mig-1g5gb-0"), ("b", "gpu-1-mig-1g5gb-0")],
        ))
        .unwrap();
    assert_eq!(node.fake.mutations().len(), 4);
    assert_eq!(node.checkpoint().claims.len(), 3);
}

#[test]
fn admin_access_reaches_static_mig_devices_but_never_creates_one() {
    let node = Node::new(true, vec![mig_gpu(0)]);
    let stat = node
        .fake
        .add_instance(&gpu_uuid(0), 9, Placement { start: 4, size: 4 })
        .unwrap();
    let node = node.restart();
    let claim = as_admin(
        node_claim(
            UID_A,
            &[
                ("on-demand", "gpu-0-mig-1g5gb-0"),
                ("static", "gpu-0-mig-3g20gb-4"),
            ],
        ),
        0,
    );
    let e = plan_of(&node, &claim).unwrap_err();
    assert!(
        matches!(&e, PrepareError::ShareRefused { device, reason, .. }
            if device == "gpu-0-mig-1g5gb-0"
                && reason.contains("on-demand MIG placement that no claim has created")),
        "{e}"
    );
    let plan = plan_of(
        &node,
        &as_admin(node_claim(UID_A, &[("static", "gpu-0-mig-3g20gb-4")]), 0),
    )
    .unwrap();
    let Some(super::plan::MigPlan::Existing(mig)) = &plan[0].mig else {
        panic!("{:?}", plan[0].mig);
    };
    assert!(plan[0].admin_access && !mig.created_by_cleave);
    assert_eq!(mig.uuid.as_deref(), Some(stat.uuid.as_str()));
}

#[test]
fn shares_of_one_device_whose_sum_exceeds_it_are_refused() {
    let node = node_with_mode(false, vec![plain_gpu(0)], ConsumableCapacity::TimeSlicing);
    let share = |uid: &str, id: &str, consumed: &[(&str, &str)]| {
        as_share(node_claim(uid, &[("part", "gpu-0")]), 0, id, consumed)
    };
    // The L4 of the fixture: 24Gi, 58 multiprocessors.
    node.driver
        .prepare(&share(
            UID_A,
            "s-1",
            &[("memory", "16Gi"), ("multiprocessors", "40")],
        ))
        .unwrap();
    for (consumed, over) in [
        (
            &[("memory", "16Gi")][..],
            "add up to memory 32768Mi of 24576Mi",
        ),
        (
            &[("memory", "1Gi"), ("multiprocessors", "40")][..],
            "add up to multiprocessors 80 of 58",
        ),
    ] {
        let e = node
            .driver
            .prepare(&share(UID_B, "s-2", consumed))
            .unwrap_err();
        assert!(
            matches!(&e, PrepareError::OverCommit { device, what, .. }
                if device == "gpu-0" && what.contains(over)),
            "{e}"
        );
    }
    // What is left of the device is served.
    node.driver
        .prepare(&share(
            UID_B,
            "s-2",
            &[("memory", "8Gi"), ("multiprocessors", "18")],
        ))
        .unwrap();
    assert_eq!(node.checkpoint().claims.len(), 2);
}

#[test]
fn a_time_slice_interval_on_a_share_applies_unless_another_claim_holds_the_gpus() {
    let node = node_with_mode(
        false,
        vec![plain_gpu(0), plain_gpu(1)],
        ConsumableCapacity::TimeSlicing,
    );
    let share = |uid: &str, device: &str, interval: &str| {
        with_config(
            as_share(
                node_claim(uid, &[("part", device)]),
                0,
                "s-1",
                &[("memory", "1Gi")],
            ),
            "FromClaim",
            DRIVER,
            &["part"],
            json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
                   "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}}),
        )
    };
    let applied = |claim: &ResourceClaim| {
        plan_of(&node, claim).unwrap()[0].config.as_ref().map(|c| {
            serde_json::to_value(&c.config).unwrap()["sharing"]["timeSlicing"]["interval"].clone()
        })
    };
    // The first share to ask sets the GPU's interval.
    let first = share(UID_A, "gpu-0", "Long");
    assert_eq!(applied(&first), Some(json!("Long")));
    node.driver.prepare(&first).unwrap();
    // Another claim asking another interval on that GPU keeps the GPU's (not applied).
    assert_eq!(applied(&share(UID_B, "gpu-0", "Short")), None);
    // The same interval, or another GPU, is applied.
    assert_eq!(applied(&share(UID_B, "gpu-0", "Long")), Some(json!("Long")));
    assert_eq!(
        applied(&share(UID_B, "gpu-1", "Short")),
        Some(json!("Short"))
    );
    // The claim's own record never blocks it (a repeated plan of the same claim).
    assert_eq!(
        applied(&share(UID_A, "gpu-0", "Short")),
        Some(json!("Short"))
    );
}

#[test]
fn a_share_joins_the_mig_instance_of_another_share_of_its_device() {
    let node = node_with_mode(true, vec![mig_gpu(0)], ConsumableCapacity::TimeSlicing);
    let share = |uid: &str, id: &str| {
        as_share(
            node_claim(uid, &[("part", "gpu-0-mig-3g20gb-4")]),
            0,
            id,
            &[("memory", "1Gi")],
        )
    };
    node.driver.prepare(&share(UID_A, "s-1")).unwrap();
    let theirs = node.checkpoint().claims[UID_A].devices[0]
        .mig
        .clone()
        .unwrap();
    // Even while the other claim's record carries a recreation intent, the joining share
    // records none of its own (the intent is the other claim's).
    node.driver
        .lock()
        .data
        .claims
        .get_mut(UID_A)
        .unwrap()
        .devices[0]
        .mig
        .as_mut()
        .unwrap()
        .creating_in_boot = Some("11111111-2222-3333-4444-555555555555".into());
    let plan = plan_of(&node, &share(UID_B, "s-2")).unwrap();
    let Some(super::plan::MigPlan::Join(mig)) = &plan[0].mig else {
        panic!("{:?}", plan[0].mig);
    };
    assert_eq!(mig.uuid, theirs.uuid);
    assert_eq!(mig.creating_in_boot, None);
    // The instance serves both shares: nothing more is created.
    node.driver
        .lock()
        .data
        .claims
        .get_mut(UID_A)
        .unwrap()
        .devices[0]
        .mig
        .as_mut()
        .unwrap()
        .creating_in_boot = None;
    node.fake.clear_calls();
    node.driver.prepare(&share(UID_B, "s-2")).unwrap();
    assert_eq!(node.fake.mutations(), []);
    assert_eq!(
        node.checkpoint().claims[UID_B].devices[0]
            .mig
            .as_ref()
            .unwrap()
            .uuid,
        theirs.uuid
    );
}

#[test]
fn a_whole_mig_gpu_without_a_full_size_profile_is_refused() {
    let mut gpu = mig_gpu(0);
    if let MigState::Enabled { profiles, .. } = &mut gpu.mig {
        profiles.retain(|p| p.name != "7g.40gb");
    }
    let node = Node::new(true, vec![gpu]);
    let e = node
        .driver
        .prepare(&node_claim(UID_A, &[("gpu", "gpu-0")]))
        .unwrap_err();
    assert!(
        matches!(&e, PrepareError::UnknownDevice { device, reason, .. }
            if device == "gpu-0" && reason.contains("no full-size profile")),
        "{e}"
    );
    assert_eq!(node.fake.mutations(), []);
}
