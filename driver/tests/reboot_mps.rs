//! Sharing after a node reboot, through `NodeDriver` with the real `SharingManager` and the
//! fake tools of `cleave-fakes`: MPS daemons of prepared claims are started again (for a MIG
//! device with the recreated instance's new UUID), compute modes and time slices are set
//! again, the CDI specs come back with the same device IDs, and the replayed prepare starts
//! nothing twice.
//!
//! The fakes run as this very executable (`main` asks `cleave_fakes::dispatch` first), as in
//! `tests/sharing.rs`. A reboot is simulated by killing the daemons (a real reboot ends every
//! process), a new boot ID (the fake `nvidia-smi` then forgets the settings of the old
//! boot, as the hardware does), an empty CDI root, and a GPU
//! backend whose instances are gone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cleave_api::names::DRIVER_NAME;
use cleave_driver::backend::{BackendError, GpuBackend};
use cleave_driver::checkpoint::{CheckpointStore, ClaimState};
use cleave_driver::model::{GpuInfo, MigInstance, MigProfile, MigState, NodeInventory, Placement};
use cleave_driver::prepare::{DriverConfig, NodeDriver, PreparedClaim};
use cleave_driver::sharing::{SharingBinaries, SharingConfig, SharingManager, SharingState};
use common::harness::{alive, wait_dead};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;

const GPU_A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000001";
const GPU_B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000002";
const GPU_MIG: &str = "GPU-dddddddd-0000-0000-0000-000000000004";
const MPS_WHOLE: &str = "0f1e2d3c-0000-4000-8000-0000000000a1";
const MPS_MIG: &str = "0f1e2d3c-0000-4000-8000-0000000000a2";
const SLICED: &str = "0f1e2d3c-0000-4000-8000-0000000000a3";
const MIG_DEVICE: &str = "gpu-2-mig-1g10gb-3";
const GIB: u64 = 1 << 30;

fn main() {
    let tests: &[(&str, fn())] = &[(
        "reboot_restarts_mps_daemons_and_sets_time_slices_again",
        reboot_restarts_mps_daemons_and_sets_time_slices_again,
    )];
    common::harness::main(tests);
}

/// A node in a temp dir: state dir, CDI root, fake tools, record files, boot ID.
struct World {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    state: PathBuf,
    mps_record: PathBuf,
    smi_record: PathBuf,
    smi_state: PathBuf,
}

impl World {
    fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_owned();
        let bin = root.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let exe = std::env::current_exe().unwrap();
        for tool in ["nvidia-cuda-mps-control", "nvidia-smi"] {
            std::os::unix::fs::symlink(&exe, bin.join(tool)).unwrap();
        }
        std::fs::write(root.join("boot_id"), "boot-1\n").unwrap();
        let state = root.join("state");
        std::fs::create_dir_all(&state).unwrap();
        common::lay_out_driver_root(&root.join("driver-root"));
        World {
            mps_record: root.join("mps-record.log"),
            smi_record: root.join("smi-record.log"),
            smi_state: root.join("smi-state"),
            state,
            root,
            _tmp: tmp,
        }
    }

    fn sharing_config(&self) -> SharingConfig {
        let binaries = SharingBinaries::under_driver_root(Path::new("/nonexistent"))
            .with_overrides(
                Some(self.root.join("bin/nvidia-cuda-mps-control")),
                Some(self.root.join("bin/nvidia-smi")),
            );
        let mut config = SharingConfig::new(&self.state, binaries);
        config.boot_id_path = self.root.join("boot_id");
        config.ready_timeout = Duration::from_secs(10);
        config.stop_timeout = Duration::from_secs(3);
        config.extra_env = [
            ("FAKE_MPS_RECORD", self.mps_record.to_str().unwrap()),
            ("FAKE_NVIDIA_SMI_RECORD", self.smi_record.to_str().unwrap()),
            ("FAKE_NVIDIA_SMI_STATE", self.smi_state.to_str().unwrap()),
            (
                "FAKE_NVIDIA_SMI_BOOT_ID_FILE",
                self.root.join("boot_id").to_str().unwrap(),
            ),
            ("FAKE_MPS_IDLE_EXIT_SECS", "120"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        config
    }

    fn driver_config(&self) -> DriverConfig {
        common::node_config(&self.root, self.state.clone())
    }

    fn start(&self, backend: &Arc<RebootBackend>) -> NodeDriver {
        let manager = Arc::new(SharingManager::new(self.sharing_config()));
        NodeDriver::start_with_sharing(self.driver_config(), backend.clone(), manager).unwrap()
    }

    /// PIDs of every daemon the fake started in this world.
    fn started_pids(&self) -> Vec<u32> {
        common::harness::started_pids(&self.mps_record)
    }

    /// The setting the GPU has now (none after a reboot until it is set again).
    fn smi_setting(&self, gpu: &str, key: &str) -> Option<String> {
        cleave_fakes::nvidia_smi::read_state_in_boot(
            &self.smi_state,
            Some(&self.root.join("boot_id")),
        )
        .get(&(gpu.to_owned(), key.to_owned()))
        .cloned()
    }

    fn sharing_state(&self, uid: &str) -> SharingState {
        let data = CheckpointStore::in_dir(&self.state).load().unwrap();
        serde_json::from_value(data.claims[uid].sharing.clone().unwrap()).unwrap()
    }

    fn daemon_pid(&self, uid: &str) -> u32 {
        self.sharing_state(uid).mps.unwrap().daemon.unwrap().pid
    }

    fn spec_path(&self, uid: &str) -> PathBuf {
        self.root
            .join("cdi")
            .join(cleave_driver::cdi::spec_file_name(uid))
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // Whatever happened, no fake daemon outlives its test.
        for pid in self.started_pids() {
            if alive(pid) {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
    }
}

fn gpu(uuid: &str, minor: u32, mig: MigState) -> GpuInfo {
    GpuInfo {
        index: minor,
        minor,
        uuid: uuid.into(),
        product_name: "NVIDIA H100 80GB HBM3".into(),
        brand: "Tesla".into(),
        architecture: "Hopper".into(),
        cuda_compute_capability: (9, 0),
        memory_bytes: 80 * GIB,
        multiprocessors: Some(132),
        pci_bus_id: format!("0000:{:02x}:00.0", minor + 1),
        pcie_root: None,
        numa_node: None,
        mig,
    }
}

/// Two whole GPUs and one MIG GPU whose instances live in memory; `reboot` drops them.
struct RebootBackend {
    instances: Mutex<Vec<MigInstance>>,
    created: Mutex<u32>,
}

impl RebootBackend {
    fn new() -> Self {
        Self {
            instances: Mutex::new(Vec::new()),
            created: Mutex::new(0),
        }
    }

    fn reboot(&self) {
        self.instances.lock().unwrap().clear();
    }

    fn profile() -> MigProfile {
        MigProfile {
            id: 19,
            name: "1g.10gb".into(),
            slice_count: 1,
            instance_count: 7,
            memory_mib: 9856,
            multiprocessors: 16,
            copy_engines: 1,
            decoders: 1,
            encoders: 0,
            jpeg_engines: 1,
            ofa_engines: 0,
            placements: (0..7).map(|start| Placement { start, size: 1 }).collect(),
        }
    }
}

impl GpuBackend for RebootBackend {
    fn inventory(&self) -> Result<NodeInventory, BackendError> {
        Ok(NodeInventory {
            driver_version: "570.148.08".into(),
            driver_semver: "570.148.8".into(),
            cuda_driver_semver: "12.8.0".into(),
            gpus: vec![
                gpu(GPU_A, 0, MigState::NotCapable),
                gpu(GPU_B, 1, MigState::NotCapable),
                gpu(
                    GPU_MIG,
                    2,
                    MigState::Enabled {
                        profiles: vec![Self::profile()],
                        instances: self.instances.lock().unwrap().clone(),
                        memory_slices: 8,
                    },
                ),
            ],
        })
    }

    fn create_mig(
        &self,
        gpu: &str,
        profile_id: u32,
        placement: Placement,
    ) -> Result<MigInstance, BackendError> {
        assert_eq!((gpu, profile_id), (GPU_MIG, 19));
        let mut instances = self.instances.lock().unwrap();
        if instances.iter().any(|i| i.placement.overlaps(&placement)) {
            return Err(BackendError::Other("placement taken".into()));
        }
        let mut n = self.created.lock().unwrap();
        *n += 1;
        let inst = MigInstance {
            uuid: format!("MIG-{:08x}-0000-4000-8000-000000000000", *n),
            profile_id,
            profile_name: "1g.10gb".into(),
            gi_id: placement.start + 7,
            ci_id: 0,
            placement,
        };
        instances.push(inst.clone());
        Ok(inst)
    }

    fn destroy_mig(&self, _: &str, gi_id: u32, ci_id: u32) -> Result<(), BackendError> {
        self.instances
            .lock()
            .unwrap()
            .retain(|i| !(i.gi_id == gi_id && i.ci_id == ci_id));
        Ok(())
    }

    fn list_mig(&self, gpu: &str) -> Result<Vec<MigInstance>, BackendError> {
        Ok(if gpu == GPU_MIG {
            self.instances.lock().unwrap().clone()
        } else {
            Vec::new()
        })
    }
}

fn claim(uid: &str, device: &str, parameters: serde_json::Value) -> ResourceClaim {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": format!("claim-{uid}"), "namespace": "default", "uid": uid},
        "spec": {"devices": {}},
        "status": {"allocation": {"devices": {
            "results": [{"request": "gpu", "driver": DRIVER_NAME, "pool": "node-a", "device": device}],
            "config": [{"source": "FromClaim", "requests": ["gpu"], "opaque": {
                "driver": DRIVER_NAME, "parameters": parameters}}]
        }}}
    }))
    .unwrap()
}

fn claims() -> [ResourceClaim; 3] {
    let mps = json!({"strategy": "MPS", "mps": {"activeThreadPercentage": 25}});
    [
        claim(
            MPS_WHOLE,
            "gpu-0",
            json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig", "sharing": mps}),
        ),
        claim(
            MPS_MIG,
            MIG_DEVICE,
            json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "MigConfig", "sharing": mps}),
        ),
        claim(
            SLICED,
            "gpu-1",
            json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
                   "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}}),
        ),
    ]
}

fn cdi_ids(prepared: &PreparedClaim) -> Vec<String> {
    prepared
        .devices
        .iter()
        .flat_map(|d| d.cdi_device_ids.clone())
        .collect()
}

fn reboot_restarts_mps_daemons_and_sets_time_slices_again() {
    let world = World::new();
    let backend = Arc::new(RebootBackend::new());
    let driver = world.start(&backend);
    let before: Vec<Vec<String>> = claims()
        .iter()
        .map(|c| cdi_ids(&driver.prepare(c).unwrap()))
        .collect();
    let old_mig = backend.instances.lock().unwrap()[0].clone();
    let old_pids = [world.daemon_pid(MPS_WHOLE), world.daemon_pid(MPS_MIG)];
    assert_eq!(
        world.smi_setting(GPU_A, "computeMode").as_deref(),
        Some("EXCLUSIVE_PROCESS")
    );
    assert_eq!(world.smi_setting(GPU_B, "timeslice").as_deref(), Some("3"));

    // The reboot: every process ends, GPU settings reset, instances and CDI specs are gone.
    drop(driver);
    for pid in old_pids {
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        assert!(wait_dead(pid, Duration::from_secs(5)), "daemon {pid}");
    }
    std::fs::write(world.root.join("boot_id"), "boot-2\n").unwrap();
    // The fake nvidia-smi forgets the settings of boot-1: compute modes and time slices
    // are gone until the driver sets them again.
    assert_eq!(world.smi_setting(GPU_A, "computeMode"), None);
    assert_eq!(world.smi_setting(GPU_B, "timeslice"), None);
    backend.reboot();
    for e in std::fs::read_dir(world.root.join("cdi")).unwrap() {
        std::fs::remove_file(e.unwrap().path()).unwrap();
    }

    let driver = world.start(&backend);
    assert!(driver.claims_needing_recreate().is_empty());
    let data = CheckpointStore::in_dir(&world.state).load().unwrap();
    assert_eq!(data.boot_id, "boot-2");
    assert!(
        data.claims
            .values()
            .all(|c| c.state == ClaimState::Prepared)
    );

    // The MIG instance is back at its placement, with a new UUID.
    let new_mig = backend.instances.lock().unwrap()[0].clone();
    assert_eq!(new_mig.placement, old_mig.placement);
    assert_ne!(new_mig.uuid, old_mig.uuid);

    // New daemons run; the MIG claim's daemon serves the new instance.
    let new_pids = [world.daemon_pid(MPS_WHOLE), world.daemon_pid(MPS_MIG)];
    for (old, new) in old_pids.iter().zip(&new_pids) {
        assert_ne!(old, new);
        assert!(alive(*new), "daemon {new} not running");
    }
    let mig_daemon = world.sharing_state(MPS_MIG).mps.unwrap();
    assert_eq!(
        mig_daemon.spec.visible_devices,
        std::slice::from_ref(&new_mig.uuid)
    );
    assert_eq!(mig_daemon.daemon.unwrap().boot_id, "boot-2");
    assert_eq!(
        world.smi_setting(GPU_A, "computeMode").as_deref(),
        Some("EXCLUSIVE_PROCESS")
    );
    assert_eq!(world.smi_setting(GPU_B, "timeslice").as_deref(), Some("3"));

    // The specs are back; the MIG claim's spec names the new instance and the pipe mount.
    for uid in [MPS_WHOLE, MPS_MIG, SLICED] {
        assert!(world.spec_path(uid).exists(), "{uid}");
    }
    let text = std::fs::read_to_string(world.spec_path(MPS_MIG)).unwrap();
    assert!(
        text.contains(&new_mig.uuid) && !text.contains(&old_mig.uuid),
        "{text}"
    );
    assert!(
        text.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"),
        "{text}"
    );

    // The replayed prepares answer the same IDs and start nothing.
    let started = world.started_pids().len();
    let after: Vec<Vec<String>> = claims()
        .iter()
        .map(|c| cdi_ids(&driver.prepare(c).unwrap()))
        .collect();
    assert_eq!(after, before);
    assert_eq!(world.started_pids().len(), started);

    // Unprepare stops everything and restores the settings.
    for uid in [MPS_WHOLE, MPS_MIG, SLICED] {
        driver.unprepare(uid).unwrap();
    }
    for pid in new_pids {
        assert!(wait_dead(pid, Duration::from_secs(5)), "daemon {pid}");
    }
    assert_eq!(
        world.smi_setting(GPU_A, "computeMode").as_deref(),
        Some("DEFAULT")
    );
    assert_eq!(world.smi_setting(GPU_B, "timeslice").as_deref(), Some("0"));
    assert!(backend.instances.lock().unwrap().is_empty());
    let left: Vec<_> = std::fs::read_dir(world.state.join("mps"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left behind: {left:?}");
}
