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
//! backend whose instances are gone (the driver's fake, rebooted).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use cleave_api::names::DRIVER_NAME;
use cleave_driver::checkpoint::{CheckpointStore, ClaimState};
use cleave_driver::model::GpuInfo;
use cleave_driver::prepare::testing::{FakeBackend, node_claim, with_config};
use cleave_driver::prepare::{DriverConfig, NodeDriver};
use cleave_driver::sharing::{MpsRecord, SharingConfig, SharingManager, SharingState};
use cleave_testkit::fake_tools::ToolNode;
use cleave_testkit::gpu::{h100, h100_mig, inventory};
use cleave_testkit::process::{alive, wait_dead};
use common::cdi_ids;
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;

const GPU_A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000001";
const GPU_B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000002";
const GPU_MIG: &str = "GPU-dddddddd-0000-0000-0000-000000000004";
const MPS_WHOLE: &str = "0f1e2d3c-0000-4000-8000-0000000000a1";
const MPS_MIG: &str = "0f1e2d3c-0000-4000-8000-0000000000a2";
const SLICED: &str = "0f1e2d3c-0000-4000-8000-0000000000a3";
const MIG_DEVICE: &str = "gpu-2-mig-1g10gb-3";

fn main() -> std::process::ExitCode {
    let tests: &[cleave_testkit::runner::Test] = &[(
        "reboot_restarts_mps_daemons_and_sets_time_slices_again",
        reboot_restarts_mps_daemons_and_sets_time_slices_again,
    )];
    cleave_testkit::runner::main(tests)
}

/// A node in a temp dir: state dir, CDI root, fake tools, record files, boot ID.
struct World(ToolNode);

impl std::ops::Deref for World {
    type Target = ToolNode;
    fn deref(&self) -> &ToolNode {
        &self.0
    }
}

impl World {
    fn new() -> Self {
        let node = ToolNode::new();
        common::lay_out_driver_root(&node.root.join("driver-root"));
        World(node)
    }

    fn sharing_config(&self) -> SharingConfig {
        let boot_id = self.tools.boot_id();
        self.tools.sharing_config(
            &self.state,
            &[(
                cleave_fakes::nvidia_smi::ENV_BOOT_ID_FILE,
                boot_id.to_str().unwrap(),
            )],
        )
    }

    fn driver_config(&self) -> DriverConfig {
        common::node_config(&self.root, self.state.clone())
    }

    fn start(&self, backend: &Arc<FakeBackend>) -> NodeDriver {
        let manager = Arc::new(SharingManager::new(self.sharing_config()));
        NodeDriver::start_with_sharing(self.driver_config(), backend.clone(), manager).unwrap()
    }

    /// PIDs of every daemon the fake started in this world.
    fn started_pids(&self) -> Vec<u32> {
        self.tools.files.started_pids()
    }

    /// The setting the GPU has now (none after a reboot until it is set again).
    fn smi_setting(&self, gpu: &str, key: &str) -> Option<String> {
        cleave_fakes::nvidia_smi::read_state_in_boot(
            &self.tools.files.smi_state(),
            Some(&self.tools.boot_id()),
        )
        .get(&(gpu.to_owned(), key.to_owned()))
        .cloned()
    }

    fn sharing_state(&self, uid: &str) -> SharingState {
        let data = CheckpointStore::in_dir(&self.state).load().unwrap();
        data.claims[uid].sharing.clone().unwrap()
    }

    /// The record of the daemon the claim's sharing state names (by key): its `daemon.json`.
    fn daemon(&self, uid: &str) -> MpsRecord {
        let key = self.sharing_state(uid).mps_daemon.unwrap();
        cleave_driver::sharing::daemon_record(&self.state, &key)
            .unwrap()
            .unwrap()
    }

    fn daemon_pid(&self, uid: &str) -> u32 {
        self.daemon(uid).daemon.unwrap().pid
    }

    fn spec_path(&self, uid: &str) -> PathBuf {
        self.root
            .join("cdi")
            .join(cleave_driver::cdi::spec_file_name(uid))
    }
}

/// Two whole H100s and one with MIG on whose instances live in memory (a reboot drops them).
fn backend() -> FakeBackend {
    FakeBackend::new(inventory(vec![
        GpuInfo {
            uuid: GPU_A.into(),
            ..h100(0)
        },
        GpuInfo {
            uuid: GPU_B.into(),
            ..h100(1)
        },
        GpuInfo {
            uuid: GPU_MIG.into(),
            ..h100_mig(2, Vec::new())
        },
    ]))
}

fn claim(uid: &str, device: &str, parameters: serde_json::Value) -> ResourceClaim {
    with_config(
        node_claim(uid, &[("gpu", device)]),
        "FromClaim",
        DRIVER_NAME,
        &["gpu"],
        parameters,
    )
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

fn reboot_restarts_mps_daemons_and_sets_time_slices_again() {
    let world = World::new();
    let backend = Arc::new(backend());
    let driver = world.start(&backend);
    let before: Vec<Vec<String>> = claims()
        .iter()
        .map(|c| cdi_ids(&driver.prepare(c).unwrap()))
        .collect();
    let old_mig = backend.instances(GPU_MIG)[0].clone();
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
    let new_mig = backend.instances(GPU_MIG)[0].clone();
    assert_eq!(new_mig.placement, old_mig.placement);
    assert_ne!(new_mig.uuid, old_mig.uuid);

    // New daemons run; the MIG claim's daemon serves the new instance.
    let new_pids = [world.daemon_pid(MPS_WHOLE), world.daemon_pid(MPS_MIG)];
    for (old, new) in old_pids.iter().zip(&new_pids) {
        assert_ne!(old, new);
        assert!(alive(*new), "daemon {new} not running");
    }
    let mig_daemon = world.daemon(MPS_MIG);
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
    assert!(backend.instances(GPU_MIG).is_empty());
    let left: Vec<_> = std::fs::read_dir(world.state.join("mps"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left behind: {left:?}");
}
