//! MPS daemons and time-slicing against the fake tools of `cleave-fakes`.
//!
//! The fakes run as this very executable: `main` first asks `cleave_fakes::dispatch` whether
//! `argv[0]` names a tool, and each test links the tool names to the executable in a temp
//! dir. So `cargo test -p cleave-driver` needs no prebuilt binaries. Every test records what
//! the tools were told (files named by the fakes' environment knobs) and checks that nothing
//! is left running; the fake daemons also exit by themselves after two idle minutes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_api::config::{DeviceKind, Sharing};
use cleave_api::names::DRIVER_NAME;
use cleave_api::pool::ConsumableCapacity;
use cleave_driver::checkpoint::{
    CheckpointData, CheckpointStore, ClaimRecord, ClaimState, DeviceKind as RecordKind,
    DeviceRecord,
};
use cleave_driver::model::{GpuInfo, MigInstance, MigProfile, MigState, NodeInventory, Placement};
use cleave_driver::prepare::testing::{Call, FakeBackend, node_claim, with_config};
use cleave_driver::prepare::{DriverConfig, NodeDriver, PrepareError, Refusal, time_slice_needs};
use cleave_driver::sharing::supervise::{SuperviseConfig, SuperviseOutcome, supervise};
use cleave_driver::sharing::{
    GpuFacts, MpsRecord, SharingConfig, SharingDevice, SharingEdits, SharingFailure,
    SharingManager, SharingState, TimeSliceNeed, legacy_shared_daemon_key,
};
use cleave_testkit::fake_tools::ToolNode;
use cleave_testkit::process::{alive, wait_dead};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};

const GPU_A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000001";
const GPU_B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000002";
const GPU_OLD: &str = "GPU-cccccccc-0000-0000-0000-000000000003";
const GPU_MIG: &str = "GPU-dddddddd-0000-0000-0000-000000000004";
const MIG_1: &str = "MIG-eeeeeeee-0000-0000-0000-000000000005";
const GIB: u64 = 1 << 30;

// ---------------------------------------------------------------------------------------
// Harness

fn main() -> std::process::ExitCode {
    let tests: &[cleave_testkit::runner::Test] = &[
        (
            "supervisor_quits_the_daemon_on_stop_and_notices_its_exit",
            supervisor_quits_the_daemon_on_stop_and_notices_its_exit,
        ),
        (
            "supervisor_reports_a_daemon_that_cannot_start",
            supervisor_reports_a_daemon_that_cannot_start,
        ),
        (
            "two_claims_get_own_daemons_limits_and_edits",
            two_claims_get_own_daemons_limits_and_edits,
        ),
        (
            "repeated_apply_is_idempotent_and_changed_settings_restart",
            repeated_apply_is_idempotent_and_changed_settings_restart,
        ),
        (
            "restart_refinds_live_daemons_and_stops_gone_claims",
            restart_refinds_live_daemons_and_stops_gone_claims,
        ),
        (
            "a_restart_is_reported_until_its_clients_are_refreshed",
            a_restart_is_reported_until_its_clients_are_refreshed,
        ),
        ("failed_start_leaves_nothing", failed_start_leaves_nothing),
        (
            "multi_user_mode_starts_with_m_and_fails_clearly_where_unsupported",
            multi_user_mode_starts_with_m_and_fails_clearly_where_unsupported,
        ),
        (
            "limits_are_read_back_and_a_daemon_that_drops_them_fails_the_claim",
            limits_are_read_back_and_a_daemon_that_drops_them_fails_the_claim,
        ),
        (
            "silent_daemon_times_out_and_is_removed",
            silent_daemon_times_out_and_is_removed,
        ),
        (
            "daemon_ignoring_quit_is_killed",
            daemon_ignoring_quit_is_killed,
        ),
        (
            "compute_mode_failure_names_the_gpu_and_leaves_nothing",
            compute_mode_failure_names_the_gpu_and_leaves_nothing,
        ),
        (
            "invalid_limits_and_unsupported_gpus_fail_before_anything_runs",
            invalid_limits_and_unsupported_gpus_fail_before_anything_runs,
        ),
        (
            "mig_device_gets_mps_without_compute_mode",
            mig_device_gets_mps_without_compute_mode,
        ),
        (
            "release_without_state_finds_the_daemon_on_disk",
            release_without_state_finds_the_daemon_on_disk,
        ),
        (
            "release_with_a_missing_record_stops_what_the_launcher_finds",
            release_with_a_missing_record_stops_what_the_launcher_finds,
        ),
        (
            "unprepare_with_an_undecodable_record_fails_and_changes_nothing",
            unprepare_with_an_undecodable_record_fails_and_changes_nothing,
        ),
        (
            "checkpoint_names_the_daemon_and_a_restarted_one_is_seen_at_once",
            checkpoint_names_the_daemon_and_a_restarted_one_is_seen_at_once,
        ),
        (
            "time_slicing_set_and_restored_with_refcount_from_checkpoint",
            time_slicing_set_and_restored_with_refcount_from_checkpoint,
        ),
        (
            "time_slicing_on_mig_and_conflicts",
            time_slicing_on_mig_and_conflicts,
        ),
        (
            "node_driver_prepares_and_unprepares_mps_claims",
            node_driver_prepares_and_unprepares_mps_claims,
        ),
        (
            "shares_of_one_gpu_use_one_daemon_until_the_last_is_unprepared",
            shares_of_one_gpu_use_one_daemon_until_the_last_is_unprepared,
        ),
        (
            "shares_of_two_namespaces_on_one_gpu_never_meet",
            shares_of_two_namespaces_on_one_gpu_never_meet,
        ),
        (
            "shared_daemon_of_an_earlier_release_lives_until_the_last_share",
            shared_daemon_of_an_earlier_release_lives_until_the_last_share,
        ),
        (
            "shares_are_refused_clearly_where_they_cannot_be_served",
            shares_are_refused_clearly_where_they_cannot_be_served,
        ),
        (
            "time_slicing_shares_are_scheduled_not_enforced",
            time_slicing_shares_are_scheduled_not_enforced,
        ),
        (
            "shares_of_an_on_demand_mig_device_use_one_instance_and_one_daemon",
            shares_of_an_on_demand_mig_device_use_one_instance_and_one_daemon,
        ),
        (
            "shares_of_a_static_mig_instance_use_one_daemon_and_keep_the_instance",
            shares_of_a_static_mig_instance_use_one_daemon_and_keep_the_instance,
        ),
        (
            "whole_device_shares_are_exclusive_devices_with_their_class_config",
            whole_device_shares_are_exclusive_devices_with_their_class_config,
        ),
        (
            "shares_in_one_claim_and_configs_on_partial_shares_are_served",
            shares_in_one_claim_and_configs_on_partial_shares_are_served,
        ),
        (
            "over_committing_allocations_are_refused_naming_the_figures",
            over_committing_allocations_are_refused_naming_the_figures,
        ),
        (
            "admin_access_is_prepared_beside_other_claims_and_touches_nothing",
            admin_access_is_prepared_beside_other_claims_and_touches_nothing,
        ),
    ];
    cleave_testkit::runner::main(tests)
}

/// A node in a temp dir (state dir, fake tools, record files, boot ID) and the fakes' files.
struct World {
    node: ToolNode,
    mps_record: PathBuf,
    smi_record: PathBuf,
    smi_state: PathBuf,
}

impl std::ops::Deref for World {
    type Target = ToolNode;
    fn deref(&self) -> &ToolNode {
        &self.node
    }
}

impl World {
    fn new() -> Self {
        let node = ToolNode::new();
        World {
            mps_record: node.tools.files.mps_record(),
            smi_record: node.tools.files.smi_record(),
            smi_state: node.tools.files.smi_state(),
            node,
        }
    }

    fn config(&self, knobs: &[(&str, &str)]) -> SharingConfig {
        self.tools.sharing_config(&self.state, knobs)
    }

    fn manager_with(&self, config: SharingConfig) -> SharingManager {
        SharingManager::new(config)
    }

    /// The time slices the checkpoint in the state directory records (what the node driver
    /// hands the manager with every call).
    fn needs(&self) -> Vec<TimeSliceNeed> {
        time_slice_needs(&CheckpointStore::in_dir(&self.state).load().unwrap())
    }

    fn manager(&self, knobs: &[(&str, &str)]) -> SharingManager {
        self.manager_with(self.config(knobs))
    }

    fn mps_lines(&self) -> Vec<String> {
        read_lines(&self.mps_record)
    }

    fn smi_lines(&self) -> Vec<String> {
        read_lines(&self.smi_record)
    }

    /// Commands the daemon of `claim` received.
    fn commands(&self, claim: &str) -> Vec<String> {
        let pipe = format!(
            "pipe={} ",
            self.state.join("mps").join(claim).join("pipe").display()
        );
        self.mps_lines()
            .iter()
            .filter_map(|l| {
                l.strip_prefix("cmd ")?
                    .strip_prefix(&pipe)
                    .map(str::to_owned)
            })
            .collect()
    }

    /// PIDs of every daemon the fake started in this world.
    fn started_pids(&self) -> Vec<u32> {
        cleave_testkit::process::started_pids(&self.mps_record)
    }

    fn smi_setting(&self, gpu: &str, key: &str) -> Option<String> {
        cleave_fakes::nvidia_smi::read_state(&self.smi_state)
            .get(&(gpu.to_owned(), key.to_owned()))
            .cloned()
    }

    fn claim_dir(&self, claim: &str) -> PathBuf {
        self.state.join("mps").join(claim)
    }

    /// The record of the daemon a claim's sharing state names (by key), read where it is
    /// kept: its `daemon.json`.
    fn daemon(&self, edits: &SharingEdits) -> MpsRecord {
        let key = state_of(edits).mps_daemon.unwrap();
        cleave_driver::sharing::daemon_record(&self.state, &key)
            .unwrap()
            .unwrap()
    }

    fn daemon_pid(&self, edits: &SharingEdits) -> u32 {
        self.daemon(edits).daemon.unwrap().pid
    }

    /// The PID its record gives the daemon `key`.
    fn daemon_pid_of(&self, key: &str) -> u32 {
        cleave_driver::sharing::daemon_record(&self.state, key)
            .unwrap()
            .unwrap()
            .daemon
            .unwrap()
            .pid
    }

    fn assert_nothing_left(&self) {
        for pid in self.started_pids() {
            assert!(
                wait_dead(pid, Duration::from_secs(5)),
                "daemon {pid} still runs"
            );
        }
        let left: Vec<_> = std::fs::read_dir(self.state.join("mps"))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "left behind: {left:?}");
    }
}

fn read_lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// An H100 of the test kit as `uuid`, with this compute capability (a Pascal part below
/// 7.0), memory and MIG state.
fn gpu(uuid: &str, minor: u32, cc: (u32, u32), memory: u64, mig: MigState) -> GpuInfo {
    let h100 = cleave_testkit::gpu::h100(minor);
    let (product_name, architecture) = if cc.0 < 7 {
        ("Tesla P100-PCIE-16GB".into(), "Pascal".into())
    } else {
        (h100.product_name.clone(), h100.architecture.clone())
    };
    GpuInfo {
        uuid: uuid.into(),
        product_name,
        architecture,
        cuda_compute_capability: cc,
        memory_bytes: memory,
        mig,
        ..h100
    }
}

/// GPUs A and B (H100), an old GPU without MPS support, and an H100 in MIG mode offering
/// one 1g.10gb placement (at slice 0, 9856 MiB).
fn inventory() -> NodeInventory {
    let profile = MigProfile {
        memory_mib: 9856,
        placements: vec![Placement { start: 0, size: 1 }],
        ..cleave_testkit::gpu::mig_profile_named(cleave_testkit::gpu::H100, "1g.10gb")
    };
    cleave_testkit::gpu::inventory(vec![
        gpu(GPU_A, 0, (9, 0), 80 * GIB, MigState::NotCapable),
        gpu(GPU_B, 1, (9, 0), 80 * GIB, MigState::NotCapable),
        gpu(GPU_OLD, 2, (6, 0), 16 * GIB, MigState::NotCapable),
        gpu(
            GPU_MIG,
            3,
            (9, 0),
            80 * GIB,
            MigState::Enabled {
                profiles: vec![profile],
                instances: vec![],
                memory_slices: 8,
            },
        ),
    ])
}

fn sharing(value: serde_json::Value) -> Sharing {
    let mut s: Sharing = serde_json::from_value(value).unwrap();
    s.apply_defaults();
    s
}

fn mps(pct: u8, default: Option<&str>, per_device: serde_json::Value) -> Sharing {
    let mut limit = json!({"perDevice": per_device});
    if let Some(d) = default {
        limit["default"] = json!(d);
    }
    sharing(
        json!({"strategy": "MPS", "mps": {"activeThreadPercentage": pct, "pinnedMemoryLimit": limit}}),
    )
}

fn timeslice(interval: &str) -> Sharing {
    sharing(json!({"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}))
}

/// The facts the node driver hands the manager for a device on `gpu` (none for a GPU the
/// inventory does not have).
fn facts(gpu: &str, device: &str) -> Option<GpuFacts> {
    inventory()
        .gpus
        .iter()
        .find(|g| g.uuid == gpu)
        .map(|g| GpuFacts::of(g, device))
}

fn whole(minor: u32, uuid: &str, s: Sharing) -> SharingDevice {
    SharingDevice {
        device_name: format!("gpu-{minor}"),
        kind: DeviceKind::Gpu,
        uuid: uuid.into(),
        gpu_uuid: uuid.into(),
        gpu: facts(uuid, &format!("gpu-{minor}")),
        sharing: s,
    }
}

fn mig_device(s: Sharing) -> SharingDevice {
    SharingDevice {
        device_name: "gpu-3-mig-1g10gb-0".into(),
        kind: DeviceKind::Mig,
        uuid: MIG_1.into(),
        gpu_uuid: GPU_MIG.into(),
        gpu: facts(GPU_MIG, "gpu-3-mig-1g10gb-0"),
        sharing: s,
    }
}

fn state_of(edits: &SharingEdits) -> SharingState {
    edits.state.clone().unwrap()
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn ts_config(interval: &str) -> serde_json::Value {
    json!({"index": 0, "source": "FromClaim", "config": {
        "apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}}})
}

fn record(uid: &str, gpu: &str, minor: u32, config: Option<serde_json::Value>) -> ClaimRecord {
    ClaimRecord {
        uid: uid.into(),
        namespace: "ns".into(),
        name: uid.into(),
        state: ClaimState::Prepared,
        devices: vec![DeviceRecord {
            name: format!("gpu-{minor}"),
            pool: "node".into(),
            request_names: vec!["gpu".into()],
            kind: RecordKind::Gpu,
            admin_access: false,
            gpu_uuid: gpu.into(),
            gpu_minor: minor,
            mig: None,
            config: config.map(|c| serde_json::from_value(c).unwrap()),
            cdi_device_ids: vec![],
            share: None,
        }],
        sharing: None,
    }
}

fn store_checkpoint(world: &World, records: Vec<ClaimRecord>) {
    let mut data = CheckpointData {
        boot_id: "boot-1".into(),
        ..CheckpointData::default()
    };
    for r in records {
        data.claims.insert(r.uid.clone(), r);
    }
    CheckpointStore::in_dir(&world.state).store(&data).unwrap();
}

// ---------------------------------------------------------------------------------------
// MPS

fn two_claims_get_own_daemons_limits_and_edits() {
    let world = World::new();
    let m = world.manager(&[]);
    let a = m
        .apply_claim(
            "claim-a",
            &[whole(0, GPU_A, mps(25, Some("10Gi"), json!({})))],
            &world.needs(),
        )
        .unwrap();
    let b = m
        .apply_claim(
            "claim-b",
            &[whole(
                1,
                GPU_B,
                mps(50, Some("8Gi"), json!({ "0": "1536Mi" })),
            )],
            &world.needs(),
        )
        .unwrap();

    // Two daemons, one per claim, each seeing only its claim's GPU.
    let (pa, pb) = (world.daemon_pid(&a), world.daemon_pid(&b));
    assert_ne!(pa, pb);
    assert!(alive(pa) && alive(pb));
    let starts: Vec<String> = world
        .mps_lines()
        .into_iter()
        .filter(|l| l.starts_with("start "))
        .collect();
    assert_eq!(starts.len(), 2, "{starts:?}");
    assert!(
        starts[0].ends_with(&format!("/claim-a/pipe devices={GPU_A}")),
        "{starts:?}"
    );
    assert!(
        starts[1].ends_with(&format!("/claim-b/pipe devices={GPU_B}")),
        "{starts:?}"
    );

    // Each daemon got its claim's limits (per-device override wins over the default).
    assert_eq!(
        world.commands("claim-a"),
        [
            "get_default_active_thread_percentage",
            "set_default_active_thread_percentage 25",
            "set_default_device_pinned_mem_limit 0 10G",
            "get_default_active_thread_percentage",
            "get_default_device_pinned_mem_limit 0",
        ]
    );
    assert_eq!(
        world.commands("claim-b")[1..3],
        [
            "set_default_active_thread_percentage 50".to_owned(),
            "set_default_device_pinned_mem_limit 0 1536M".to_owned(),
        ]
    );

    // CDI edits: the claim's own pipe dir, its privileged socket masked, and the client
    // env.
    let pipe_a = world.claim_dir("claim-a").join("pipe");
    assert_eq!(a.claim_edits.mounts.len(), 2, "{:?}", a.claim_edits.mounts);
    assert_eq!(
        (
            a.claim_edits.mounts[1].host_path.as_str(),
            a.claim_edits.mounts[1].container_path.as_str(),
            a.claim_edits.mounts[1].options[0].as_str()
        ),
        ("/dev/null", "/tmp/nvidia-mps/control_privileged", "ro")
    );
    assert_eq!(
        a.claim_edits.mounts[0].host_path,
        pipe_a.display().to_string()
    );
    assert_eq!(a.claim_edits.mounts[0].container_path, "/tmp/nvidia-mps");
    assert_eq!(
        a.claim_edits.env,
        [
            "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10G",
        ]
    );
    assert!(
        b.claim_edits
            .env
            .contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1536M".to_owned())
    );
    assert_ne!(
        a.claim_edits.mounts[0].host_path,
        b.claim_edits.mounts[0].host_path
    );
    assert!(a.device_edits.is_empty());

    // Directory modes: claim dir closed to other host users, pipe dir traversable by
    // clients of any UID, but only root may list or change its entries.
    assert_eq!(mode(&world.claim_dir("claim-a")), 0o700);
    assert_eq!(mode(&pipe_a), 0o711);
    let log_mode = std::fs::metadata(world.claim_dir("claim-a").join("log"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(log_mode & 0o7777, 0o1777);

    // Compute modes.
    assert_eq!(
        world.smi_setting(GPU_A, "computeMode").as_deref(),
        Some("EXCLUSIVE_PROCESS")
    );
    assert_eq!(
        world.smi_setting(GPU_B, "computeMode").as_deref(),
        Some("EXCLUSIVE_PROCESS")
    );
    let timings = m.last_mps_timings().unwrap();
    assert!(timings.launch > Duration::ZERO && timings.total >= timings.launch);

    // Release: daemon gone, directories gone, compute mode back to DEFAULT.
    m.release_claim("claim-a", a.state.as_ref(), &world.needs())
        .unwrap();
    assert!(wait_dead(pa, Duration::from_secs(5)));
    assert!(
        alive(pb),
        "releasing claim-a must not touch claim-b's daemon"
    );
    assert!(!world.claim_dir("claim-a").exists());
    assert_eq!(
        world.smi_setting(GPU_A, "computeMode").as_deref(),
        Some("DEFAULT")
    );
    assert!(world.commands("claim-a").last().unwrap() == "quit");
    m.release_claim("claim-b", b.state.as_ref(), &world.needs())
        .unwrap();
    world.assert_nothing_left();
    // Releasing again is a no-op.
    m.release_claim("claim-b", b.state.as_ref(), &world.needs())
        .unwrap();
}

fn repeated_apply_is_idempotent_and_changed_settings_restart() {
    let world = World::new();
    let m = world.manager(&[]);
    let devices = [whole(0, GPU_A, mps(40, None, json!({})))];
    let first = m.apply_claim("claim-a", &devices, &world.needs()).unwrap();
    let smi_calls = world.smi_lines().len();
    let second = m.apply_claim("claim-a", &devices, &world.needs()).unwrap();
    assert_eq!(first, second);
    assert_eq!(world.started_pids().len(), 1, "no second daemon");
    assert_eq!(world.smi_lines().len(), smi_calls, "no nvidia-smi call");
    assert_eq!(
        first.claim_edits.env,
        [
            "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40",
        ]
    );

    // Different settings for the same claim: the old daemon goes, a new one comes.
    let old = world.daemon_pid(&first);
    let changed = m
        .apply_claim(
            "claim-a",
            &[whole(0, GPU_A, mps(60, None, json!({})))],
            &world.needs(),
        )
        .unwrap();
    let new = world.daemon_pid(&changed);
    assert_ne!(old, new);
    assert!(wait_dead(old, Duration::from_secs(5)));
    assert!(alive(new));
    assert!(
        world
            .commands("claim-a")
            .contains(&"set_default_active_thread_percentage 60".to_owned())
    );
    m.release_claim("claim-a", changed.state.as_ref(), &world.needs())
        .unwrap();
    world.assert_nothing_left();
}

fn restart_refinds_live_daemons_and_stops_gone_claims() {
    let world = World::new();
    let (a, b) = {
        let m = world.manager(&[]);
        let a = m
            .apply_claim(
                "claim-a",
                &[whole(0, GPU_A, mps(30, Some("4Gi"), json!({})))],
                &world.needs(),
            )
            .unwrap();
        let b = m
            .apply_claim(
                "claim-b",
                &[whole(1, GPU_B, mps(30, None, json!({})))],
                &world.needs(),
            )
            .unwrap();
        (a, b)
        // The manager (the "plugin") goes away; the daemons must not.
    };
    let (pa, pb) = (world.daemon_pid(&a), world.daemon_pid(&b));
    assert!(alive(pa) && alive(pb), "daemons outlive the manager");

    let m = world.manager(&[]);
    let live: BTreeSet<String> = ["claim-a".to_owned()].into();
    let report = m.reconcile(&live);
    assert_eq!(report.kept, ["claim-a"]);
    assert_eq!(report.stopped, ["claim-b"]);
    assert!(
        report.restarted.is_empty() && report.failed.is_empty(),
        "{report:?}"
    );
    assert!(alive(pa));
    assert!(wait_dead(pb, Duration::from_secs(5)));
    assert!(!world.claim_dir("claim-b").exists());
    assert_eq!(
        world.smi_setting(GPU_B, "computeMode").as_deref(),
        Some("DEFAULT")
    );

    // The daemon of a live claim dies: the next reconcile starts it again with its limits.
    Command::new("kill")
        .args(["-9", &pa.to_string()])
        .status()
        .unwrap();
    assert!(wait_dead(pa, Duration::from_secs(5)));
    let report = m.reconcile(&live);
    assert_eq!(report.restarted, ["claim-a"], "{report:?}");
    let pids = world.started_pids();
    let restarted = *pids.last().unwrap();
    assert_ne!(restarted, pa);
    assert!(alive(restarted));
    let cmds = world.commands("claim-a");
    assert_eq!(
        cmds.iter()
            .filter(|c| *c == "set_default_device_pinned_mem_limit 0 4G")
            .count(),
        2,
        "{cmds:?}"
    );

    // Nothing live any more: everything goes.
    let report = m.reconcile(&BTreeSet::new());
    assert_eq!(report.stopped, ["claim-a"]);
    world.assert_nothing_left();
}

/// A daemon restarted by reconciliation stays reported as restarted (its clients' CDI
/// specs must be rewritten: a restarted daemon pod has a new `/dev/shm`) until the driver
/// says they were, so a crash between the restart and the rewrite loses nothing; it is
/// never launched a second time for that.
fn a_restart_is_reported_until_its_clients_are_refreshed() {
    let world = World::new();
    let m = world.manager(&[]);
    let a = m
        .apply_claim(
            "claim-a",
            &[whole(0, GPU_A, mps(30, Some("4Gi"), json!({})))],
            &world.needs(),
        )
        .unwrap();
    let first = world.daemon_pid(&a);
    Command::new("kill")
        .args(["-9", &first.to_string()])
        .status()
        .unwrap();
    assert!(wait_dead(first, Duration::from_secs(5)));
    let live: BTreeSet<String> = ["claim-a".to_owned()].into();
    let marker = world.claim_dir("claim-a").join("clients-stale");

    let report = m.reconcile(&live);
    assert_eq!(report.restarted, ["claim-a"], "{report:?}");
    assert!(marker.exists());
    let launched = world.started_pids().len();
    // The plugin died before it rewrote the claim's spec: the next check reports the
    // daemon again, and keeps it running as it is.
    let report = m.reconcile(&live);
    assert_eq!(report.restarted, ["claim-a"], "{report:?}");
    assert_eq!(
        world.started_pids().len(),
        launched,
        "relaunched a running daemon"
    );

    m.clients_refreshed(&live);
    assert!(!marker.exists());
    let report = m.reconcile(&live);
    assert_eq!(report.kept, ["claim-a"], "{report:?}");
    assert!(report.restarted.is_empty(), "{report:?}");
    m.release_claim("claim-a", a.state.as_ref(), &world.needs())
        .unwrap();
    world.assert_nothing_left();
}

fn failed_start_leaves_nothing() {
    let world = World::new();
    let m = world.manager(&[("FAKE_MPS_FAIL_START", "1")]);
    let err = m
        .apply_claim(
            "claim-a",
            &[whole(0, GPU_A, mps(50, None, json!({})))],
            &world.needs(),
        )
        .unwrap_err();
    assert!(matches!(err, SharingFailure::DaemonStart { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("claim-a") && msg.contains("start failure requested"),
        "{msg}"
    );
    assert!(!world.claim_dir("claim-a").exists());
    assert_eq!(
        world.smi_setting(GPU_A, "computeMode").as_deref(),
        Some("DEFAULT")
    );
    world.assert_nothing_left();
}

fn multi_user(on: bool) -> Sharing {
    sharing(json!({"strategy": "MPS", "mps": {"activeThreadPercentage": 40, "multiUser": on}}))
}

fn multi_user_mode_starts_with_m_and_fails_clearly_where_unsupported() {
    let world = World::new();
    let m = world.manager(&[]);
    let edits = m
        .apply_claim(
            "claim-a",
            &[whole(0, GPU_A, multi_user(true))],
            &world.needs(),
        )
        .unwrap();
    let record = world.daemon(&edits);
    assert!(record.spec.multi_user);
    assert!(
        world
            .mps_lines()
            .iter()
            .any(|l| l.starts_with("start ") && l.contains(" multiUser=1 ")),
        "{:?}",
        world.mps_lines()
    );
    m.release_claim("claim-a", edits.state.as_ref(), &world.needs())
        .unwrap();
    world.assert_nothing_left();
    // Off by default: a plain `-d`.
    let edits = m
        .apply_claim(
            "claim-b",
            &[whole(0, GPU_A, multi_user(false))],
            &world.needs(),
        )
        .unwrap();
    assert!(!world.daemon(&edits).spec.multi_user);
    assert!(
        !world
            .mps_lines()
            .iter()
            .rev()
            .find(|l| l.starts_with("start "))
            .unwrap()
            .contains("multiUser")
    );
    m.release_claim("claim-b", edits.state.as_ref(), &world.needs())
        .unwrap();

    // Below compute capability 7.0: refused before anything runs, naming multiUser.
    let err = m
        .apply_claim(
            "claim-c",
            &[whole(2, GPU_OLD, multi_user(true))],
            &world.needs(),
        )
        .unwrap_err();
    assert!(
        matches!(err, SharingFailure::MultiUserUnsupported { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("mps.multiUser") && err.to_string().contains("6.0"));
    // One daemon per claim: its devices must agree.
    let err = m
        .apply_claim(
            "claim-c",
            &[
                whole(0, GPU_A, multi_user(true)),
                whole(1, GPU_B, multi_user(false)),
            ],
            &world.needs(),
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("different multiUser values"),
        "{err}"
    );

    // A control daemon that refuses `-M`: the claim fails saying so, nothing is left.
    let refusing = world.manager(&[("FAKE_MPS_MULTIUSER", "refuse")]);
    let err = refusing
        .apply_claim(
            "claim-d",
            &[whole(0, GPU_A, multi_user(true))],
            &world.needs(),
        )
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, SharingFailure::DaemonStart { .. }), "{msg}");
    assert!(
        msg.contains("claim-d") && msg.contains("`-d -M`") && msg.contains("mps.multiUser"),
        "{msg}"
    );
    world.assert_nothing_left();
    assert_eq!(
        world.smi_setting(GPU_A, "computeMode").as_deref(),
        Some("DEFAULT")
    );
}

fn limits_are_read_back_and_a_daemon_that_drops_them_fails_the_claim() {
    let world = World::new();
    // A daemon that answers every set without taking it (exit status 0, as the real UI
    // has for rejected commands): the read-back shows it, and the claim fails with the
    // daemon's own answers.
    let m = world.manager(&[("FAKE_MPS_DROP_SETS", "1")]);
    let err = m
        .apply_claim(
            "claim-a",
            &[whole(0, GPU_A, mps(25, Some("1536Mi"), json!({})))],
            &world.needs(),
        )
        .unwrap_err();
    assert!(
        matches!(err, SharingFailure::DaemonRejected { .. }),
        "{err}"
    );
    let msg = err.to_string();
    for want in [
        "claim-a",
        "active thread percentage: set 25, get_default_active_thread_percentage answered `100.0`",
        "set 1536M, get_default_device_pinned_mem_limit 0 answered `No default pinned memory limit set for the device!`",
    ] {
        assert!(msg.contains(want), "{want:?} not in {msg}");
    }
    world.assert_nothing_left();
    assert_eq!(
        world.smi_setting(GPU_A, "computeMode").as_deref(),
        Some("DEFAULT")
    );

    // Sets that print an acknowledgement (what the real ones print is unverified), and a
    // limit read back in whole GiB (as reported for driver 595): both accepted.
    let m = world.manager(&[
        ("FAKE_MPS_SET_ECHO", "1"),
        ("FAKE_MPS_LIMIT_READBACK", "gib-floor"),
    ]);
    let edits = m
        .apply_claim(
            "claim-b",
            &[whole(0, GPU_A, mps(25, Some("1536Mi"), json!({})))],
            &world.needs(),
        )
        .unwrap();
    assert!(
        world
            .commands("claim-b")
            .ends_with(&["get_default_device_pinned_mem_limit 0".to_owned()])
    );
    m.release_claim("claim-b", edits.state.as_ref(), &world.needs())
        .unwrap();
    world.assert_nothing_left();
}

fn silent_daemon_times_out_and_is_removed() {
    let world = World::new();
    let mut config = world.config(&[("FAKE_MPS_NO_ANSWER", "1")]);
    config.ready_timeout = Duration::from_millis(800);
    config.command_timeout = Duration::from_millis(200);
    config.stop_timeout = Duration::from_millis(300);
    let m = world.manager_with(config);
    let started = Instant::now();
    let err = m
        .apply_claim(
            "claim-a",
            &[whole(0, GPU_A, mps(50, None, json!({})))],
            &world.needs(),
        )
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    assert!(
        matches!(err, SharingFailure::DaemonNotReady { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("did not answer within"), "{err}");
    assert_eq!(world.started_pids().len(), 1, "the daemon did start");
    world.assert_nothing_left();
    assert_eq!(
        world.smi_setting(GPU_A, "computeMode").as_deref(),
        Some("DEFAULT")
    );
}

fn daemon_ignoring_quit_is_killed() {
    let world = World::new();
    let mut config = world.config(&[("FAKE_MPS_IGNORE_QUIT", "1")]);
    config.stop_timeout = Duration::from_millis(300);
    let m = world.manager_with(config);
    let edits = m
        .apply_claim(
            "claim-a",
            &[whole(0, GPU_A, mps(50, None, json!({})))],
            &world.needs(),
        )
        .unwrap();
    let pid = world.daemon_pid(&edits);
    m.release_claim("claim-a", edits.state.as_ref(), &world.needs())
        .unwrap();
    assert!(world.commands("claim-a").contains(&"quit".to_owned()));
    assert!(!alive(pid));
    world.assert_nothing_left();
}

fn compute_mode_failure_names_the_gpu_and_leaves_nothing() {
    let world = World::new();
    let m = world.manager(&[("FAKE_NVIDIA_SMI_FAIL", "-c EXCLUSIVE_PROCESS")]);
    let err = m
        .apply_claim(
            "claim-a",
            &[whole(0, GPU_A, mps(50, None, json!({})))],
            &world.needs(),
        )
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, SharingFailure::Tool { .. }), "{msg}");
    assert!(
        msg.contains(GPU_A) && msg.contains("EXCLUSIVE_PROCESS"),
        "{msg}"
    );
    assert!(world.started_pids().is_empty());
    world.assert_nothing_left();
}

fn invalid_limits_and_unsupported_gpus_fail_before_anything_runs() {
    let world = World::new();
    let m = world.manager(&[]);
    let cases: Vec<(SharingDevice, &str)> = vec![
        (
            whole(0, GPU_A, mps(50, Some("100Gi"), json!({}))),
            "larger than the device's memory",
        ),
        (
            whole(0, GPU_A, mps(50, Some("1Gi"), json!({ GPU_A: "81Gi" }))),
            "81Gi",
        ),
        (
            whole(0, GPU_A, mps(50, Some("1000Ki"), json!({}))),
            "below 1Mi",
        ),
        (
            mig_device(mps(50, Some("10Gi"), json!({}))),
            "gpu-3-mig-1g10gb-0",
        ),
        (
            whole(2, GPU_OLD, mps(50, None, json!({}))),
            "MPS is not supported on GPU GPU-cccccccc",
        ),
    ];
    for (device, want) in cases {
        let err = m
            .apply_claim("claim-x", &[device], &world.needs())
            .unwrap_err();
        assert!(err.to_string().contains(want), "{err} (wanted {want:?})");
    }
    let mixed = m
        .apply_claim(
            "claim-x",
            &[
                whole(0, GPU_A, mps(50, None, json!({}))),
                whole(1, GPU_B, mps(60, None, json!({}))),
            ],
            &world.needs(),
        )
        .unwrap_err();
    assert!(
        matches!(mixed, SharingFailure::MixedMpsSettings { .. }),
        "{mixed}"
    );
    let unknown = m
        .apply_claim(
            "claim-x",
            &[whole(
                9,
                "GPU-99999999-0000-0000-0000-000000000009",
                mps(50, None, json!({})),
            )],
            &world.needs(),
        )
        .unwrap_err();
    assert!(
        matches!(unknown, SharingFailure::UnknownGpu { .. }),
        "{unknown}"
    );
    assert!(world.smi_lines().is_empty(), "{:?}", world.smi_lines());
    assert!(world.started_pids().is_empty());
    world.assert_nothing_left();
}

fn mig_device_gets_mps_without_compute_mode() {
    let world = World::new();
    let m = world.manager(&[]);
    let edits = m
        .apply_claim(
            "claim-m",
            &[mig_device(mps(20, Some("8Gi"), json!({})))],
            &world.needs(),
        )
        .unwrap();
    let starts: Vec<String> = world
        .mps_lines()
        .into_iter()
        .filter(|l| l.starts_with("start "))
        .collect();
    assert!(
        starts[0].ends_with(&format!("devices={MIG_1}")),
        "{starts:?}"
    );
    assert!(
        world
            .commands("claim-m")
            .contains(&"set_default_device_pinned_mem_limit 0 8G".to_owned())
    );
    assert!(
        world.smi_lines().is_empty(),
        "no compute mode for MIG: {:?}",
        world.smi_lines()
    );
    m.release_claim("claim-m", edits.state.as_ref(), &world.needs())
        .unwrap();
    world.assert_nothing_left();

    // A whole-GPU device on a MIG-enabled GPU: nvidia-smi refuses `-c` there ("not
    // supported on a MIG-enabled device"), so it is never asked.
    let m = world.manager(&[("FAKE_NVIDIA_SMI_GPUS", &format!("{GPU_MIG}:mig"))]);
    let edits = m
        .apply_claim(
            "claim-w",
            &[whole(3, GPU_MIG, mps(20, None, json!({})))],
            &world.needs(),
        )
        .unwrap();
    assert!(world.smi_lines().is_empty(), "{:?}", world.smi_lines());
    assert!(world.daemon(&edits).exclusive_gpus.is_empty());
    m.release_claim("claim-w", edits.state.as_ref(), &world.needs())
        .unwrap();
    world.assert_nothing_left();
}

fn release_without_state_finds_the_daemon_on_disk() {
    // A prepare interrupted after the daemon started but before its state reached the
    // checkpoint: release gets no state and must still stop the daemon.
    let world = World::new();
    let m = world.manager(&[]);
    let edits = m
        .apply_claim(
            "claim-a",
            &[whole(0, GPU_A, mps(50, None, json!({})))],
            &world.needs(),
        )
        .unwrap();
    let pid = world.daemon_pid(&edits);
    let m2 = world.manager(&[]);
    m2.release_claim("claim-a", None, &world.needs()).unwrap();
    assert!(wait_dead(pid, Duration::from_secs(5)));
    assert_eq!(
        world.smi_setting(GPU_A, "computeMode").as_deref(),
        Some("DEFAULT")
    );
    world.assert_nothing_left();

    // Only the directories exist (crash before the first record write), and a daemon was
    // started there by hand: it is found through its pid file and stopped.
    let dir = world.claim_dir("claim-b");
    std::fs::create_dir_all(dir.join("pipe")).unwrap();
    std::fs::create_dir_all(dir.join("log")).unwrap();
    let status = Command::new(world.root.join("bin/nvidia-cuda-mps-control"))
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", dir.join("pipe"))
        .env("CUDA_MPS_LOG_DIRECTORY", dir.join("log"))
        .env("FAKE_MPS_RECORD", &world.mps_record)
        .env("FAKE_MPS_IDLE_EXIT_SECS", "120")
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(5);
    while !dir.join("pipe/nvidia-cuda-mps-control.pid").exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    m2.release_claim("claim-b", None, &world.needs()).unwrap();
    world.assert_nothing_left();
}

fn release_with_a_missing_record_stops_what_the_launcher_finds() {
    // The checkpoint names the daemon, but its record (its one record) is gone: the daemon
    // the launcher finds through its pid file is stopped and its directories removed. The
    // compute mode it set was recorded nowhere else, so it is left as it is.
    let world = World::new();
    let m = world.manager(&[]);
    let edits = m
        .apply_claim(
            "claim-a",
            &[whole(0, GPU_A, mps(50, None, json!({})))],
            &world.needs(),
        )
        .unwrap();
    let pid = world.daemon_pid(&edits);
    std::fs::remove_file(world.claim_dir("claim-a").join("daemon.json")).unwrap();
    m.release_claim("claim-a", edits.state.as_ref(), &world.needs())
        .unwrap();
    assert!(wait_dead(pid, Duration::from_secs(5)));
    assert!(world.commands("claim-a").contains(&"quit".to_owned()));
    assert_eq!(
        world.smi_setting(GPU_A, "computeMode").as_deref(),
        Some("EXCLUSIVE_PROCESS")
    );
    world.assert_nothing_left();
    // Again: nothing left to find, nothing to do.
    m.release_claim("claim-a", edits.state.as_ref(), &world.needs())
        .unwrap();
}

fn unprepare_with_an_undecodable_record_fails_and_changes_nothing() {
    let world = World::new();
    let uid = "0f1e2d3c-0000-4000-8000-0000000000e1";
    let (driver, _manager) = start_driver(&world, &[]);
    driver
        .prepare(&mps_claim(uid, "gpu-0", 25, "10Gi"))
        .unwrap();
    let record = world.claim_dir(uid).join("daemon.json");
    let pid = world.daemon_pid_of(uid);
    std::fs::write(&record, b"{\"spec\": {\"claimUid\": ").unwrap();

    // Unprepare fails loudly, naming the file and the fix; the claim stays recorded (the
    // kubelet retries), the daemon runs, the GPU keeps its compute mode, the file is kept.
    let err = driver.unprepare(uid).unwrap_err();
    assert!(
        matches!(&err, PrepareError::Sharing(SharingFailure::Release { claim, source })
            if claim == uid
                && matches!(&**source, SharingFailure::RecordUnreadable { path, .. } if *path == record)),
        "{err:?}"
    );
    let msg = err.to_string();
    for want in [
        record.display().to_string().as_str(),
        "does not decode",
        "nvidia-smi -i <GPU UUID> -c DEFAULT",
        "delete the file",
    ] {
        assert!(msg.contains(want), "{want}: {msg}");
    }
    assert_eq!(err.refusal(), Refusal::Sharing);
    assert!(driver.prepared_claims().iter().any(|c| c.uid == uid));
    let data = CheckpointStore::in_dir(&world.state).load().unwrap();
    assert!(data.claims.contains_key(uid));
    assert!(alive(pid));
    assert_eq!(
        world.smi_setting(GPU_A, "computeMode").as_deref(),
        Some("EXCLUSIVE_PROCESS")
    );
    assert!(record.exists());
    assert!(!world.commands(uid).contains(&"quit".to_owned()));

    // The fix the message names: the compute mode set back by hand, the file deleted; the
    // retry stops the daemon and removes the rest.
    let config = world.config(&[]);
    cleave_driver::sharing::NvidiaSmi::new(
        &config.binaries.nvidia_smi,
        config.extra_env.clone(),
        Duration::from_secs(10),
    )
    .set_compute_mode(GPU_A, cleave_driver::sharing::ComputeMode::Default)
    .unwrap();
    std::fs::remove_file(&record).unwrap();
    driver.unprepare(uid).unwrap();
    assert!(wait_dead(pid, Duration::from_secs(5)));
    assert!(driver.prepared_claims().is_empty());
    assert_eq!(
        world.smi_setting(GPU_A, "computeMode").as_deref(),
        Some("DEFAULT")
    );
    world.assert_nothing_left();
}

fn checkpoint_names_the_daemon_and_a_restarted_one_is_seen_at_once() {
    let world = World::new();
    let uid = "0f1e2d3c-0000-4000-8000-0000000000d1";
    let (driver, manager) = start_driver(&world, &[]);
    driver
        .prepare(&mps_claim(uid, "gpu-0", 25, "10Gi"))
        .unwrap();

    // The checkpoint names the daemon by its key and holds nothing else of it: no PID,
    // pipe directory or limits (they are in the daemon's record alone).
    let path = world.state.join("checkpoint.json");
    let before = std::fs::read(&path).unwrap();
    let file: serde_json::Value = serde_json::from_slice(&before).unwrap();
    assert_eq!(file["version"], 2);
    assert_eq!(
        file["data"]["claims"][uid]["sharing"],
        json!({"mpsDaemon": uid})
    );
    let text = String::from_utf8(before.clone()).unwrap();
    let record = cleave_driver::sharing::daemon_record(&world.state, uid)
        .unwrap()
        .unwrap();
    let pipe = record.host_pipe_dir.display().to_string();
    for copy in [
        "\"pid\"",
        "startTime",
        "pipeDir",
        "pinnedLimits",
        "exclusiveGpus",
        "\"10G\"",
        pipe.as_str(),
    ] {
        assert!(!text.contains(copy), "checkpoint holds {copy}: {text}");
    }
    let pid = record.daemon.unwrap().pid;
    assert!(alive(pid));
    let status_daemon = |driver: &NodeDriver| {
        let report = driver.claim_status(uid).unwrap();
        let v = serde_json::to_value(&report.entries[0].data).unwrap();
        assert_eq!(v["mps"]["activeThreadPercentage"], 25, "{v}");
        assert_eq!(v["mps"]["pinnedMemoryLimit"], "10G", "{v}");
        v["mps"]["daemon"].as_str().unwrap().to_owned()
    };
    let usage_pids = |driver: &NodeDriver| {
        let devices = driver.claim_devices();
        let d = devices.iter().find(|d| d.claim.uid == uid).unwrap();
        d.pids.clone()
    };
    assert_eq!(status_daemon(&driver), format!("PID {pid}"));
    assert_eq!(usage_pids(&driver), [pid]);

    // The daemon dies; reconciliation alone starts it again (no refresh of the claim's
    // record in between: the checkpoint stays byte for byte). Usage attribution and the
    // status report see the new daemon at once.
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(wait_dead(pid, Duration::from_secs(5)));
    let report = manager.reconcile(&BTreeSet::from([uid.to_owned()]));
    assert_eq!(report.restarted, [uid], "{report:?}");
    assert_eq!(std::fs::read(&path).unwrap(), before);
    let new_pid = world.daemon_pid_of(uid);
    assert_ne!(new_pid, pid);
    assert!(alive(new_pid));
    assert_eq!(status_daemon(&driver), format!("PID {new_pid}"));
    assert_eq!(usage_pids(&driver), [new_pid]);

    driver.unprepare(uid).unwrap();
    assert!(wait_dead(new_pid, Duration::from_secs(5)));
    world.assert_nothing_left();
}

// ---------------------------------------------------------------------------------------
// Time-slicing

fn time_slicing_set_and_restored_with_refcount_from_checkpoint() {
    let world = World::new();
    let m = world.manager(&[]);
    let a = m
        .apply_claim(
            "claim-a",
            &[whole(0, GPU_A, timeslice("Long"))],
            &world.needs(),
        )
        .unwrap();
    assert_eq!(
        world.smi_lines(),
        [format!("compute-policy -i {GPU_A} --set-timeslice 3")]
    );
    assert!(a.claim_edits.is_empty());
    assert_eq!(state_of(&a).time_slicing.len(), 1);

    // Claims a and b both recorded as needing Long on GPU A (b prepared by an earlier run).
    store_checkpoint(
        &world,
        vec![
            record("claim-a", GPU_A, 0, Some(ts_config("Long"))),
            record("claim-b", GPU_A, 0, Some(ts_config("Long"))),
        ],
    );
    m.release_claim("claim-a", a.state.as_ref(), &world.needs())
        .unwrap();
    assert_eq!(world.smi_lines().len(), 1, "b still needs Long: no restore");
    assert_eq!(world.smi_setting(GPU_A, "timeslice").as_deref(), Some("3"));

    // a is gone from the checkpoint; releasing b (even without state, as after an
    // interrupted prepare) restores the default, found from b's recorded config.
    store_checkpoint(
        &world,
        vec![record("claim-b", GPU_A, 0, Some(ts_config("Long")))],
    );
    m.release_claim("claim-b", None, &world.needs()).unwrap();
    assert_eq!(
        world.smi_lines().last().unwrap(),
        &format!("compute-policy -i {GPU_A} --set-timeslice 0")
    );
    assert_eq!(world.smi_setting(GPU_A, "timeslice").as_deref(), Some("0"));

    // Default interval: set, and nothing to restore.
    let d = m
        .apply_claim(
            "claim-d",
            &[whole(1, GPU_B, timeslice("Default"))],
            &world.needs(),
        )
        .unwrap();
    let n = world.smi_lines().len();
    m.release_claim("claim-d", d.state.as_ref(), &world.needs())
        .unwrap();
    assert_eq!(world.smi_lines().len(), n);

    // nvidia-smi failing: a clear error naming the GPU, nothing recorded as set.
    let failing = world.manager(&[("FAKE_NVIDIA_SMI_FAIL", "1")]);
    let err = failing
        .apply_claim(
            "claim-e",
            &[whole(1, GPU_B, timeslice("Short"))],
            &world.needs(),
        )
        .unwrap_err();
    assert!(
        err.to_string().contains(GPU_B) && err.to_string().contains("--set-timeslice 1"),
        "{err}"
    );

    // A GPU without compute-policy support (Tesla P4: "Not Supported", exit status 3): the
    // claim fails with an error naming the GPU and the tool's words; nothing is recorded.
    let p4 = world.manager(&[(
        "FAKE_NVIDIA_SMI_GPUS",
        &format!("{GPU_A},{GPU_B}:no-timeslice"),
    )]);
    let before = world.smi_lines().len();
    let err = p4
        .apply_claim(
            "claim-f",
            &[whole(1, GPU_B, timeslice("Long"))],
            &world.needs(),
        )
        .unwrap_err();
    assert!(
        matches!(&err, SharingFailure::TimeSliceNotSupported { gpu, .. } if gpu == GPU_B),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains(GPU_B)
            && msg.contains(
                "Failed to set timeslice policy with value Long for GPU 1 : Not Supported"
            ),
        "{msg}"
    );
    assert_eq!(
        world.smi_lines()[before..],
        [format!("compute-policy -i {GPU_B} --set-timeslice 3")]
    );
    assert_eq!(world.smi_setting(GPU_B, "timeslice").as_deref(), Some("0"));
    // Default on such a GPU: it runs its default slice already; the claim prepares.
    let d = p4
        .apply_claim(
            "claim-g",
            &[whole(1, GPU_B, timeslice("Default"))],
            &world.needs(),
        )
        .unwrap();
    p4.release_claim("claim-g", d.state.as_ref(), &world.needs())
        .unwrap();
}

fn time_slicing_on_mig_and_conflicts() {
    let world = World::new();
    let m = world.manager(&[]);
    // MIG device with Default: nothing to do (it runs in the parent's slice).
    let edits = m
        .apply_claim(
            "claim-m",
            &[mig_device(timeslice("Default"))],
            &world.needs(),
        )
        .unwrap();
    assert!(world.smi_lines().is_empty());
    m.release_claim("claim-m", edits.state.as_ref(), &world.needs())
        .unwrap();
    assert!(world.smi_lines().is_empty());
    // MIG device with another interval: served, nothing set (MIG devices have no interval).
    let edits = m
        .apply_claim("claim-m", &[mig_device(timeslice("Long"))], &world.needs())
        .unwrap();
    assert!(world.smi_lines().is_empty());
    m.release_claim("claim-m", edits.state.as_ref(), &world.needs())
        .unwrap();

    // Another recorded claim needs a different slice on the GPU.
    store_checkpoint(
        &world,
        vec![record("claim-b", GPU_A, 0, Some(ts_config("Long")))],
    );
    let err = m
        .apply_claim(
            "claim-c",
            &[whole(0, GPU_A, timeslice("Short"))],
            &world.needs(),
        )
        .unwrap_err();
    let msg = err.to_string();
    // The other claim may be another tenant's: the refusal does not name it.
    assert!(
        msg.contains("another claim") && msg.contains("Long") && msg.contains("Short"),
        "{msg}"
    );
    assert!(!msg.contains("claim-b"), "{msg}");
    // The same slice is fine.
    m.apply_claim(
        "claim-c",
        &[whole(0, GPU_A, timeslice("Long"))],
        &world.needs(),
    )
    .unwrap();

    // Mixing strategies in one claim is refused.
    let err = m
        .apply_claim(
            "claim-x",
            &[
                whole(0, GPU_A, timeslice("Long")),
                whole(1, GPU_B, mps(50, None, json!({}))),
            ],
            &world.needs(),
        )
        .unwrap_err();
    assert!(
        matches!(err, SharingFailure::MixedStrategies { .. }),
        "{err}"
    );
    world.assert_nothing_left();
}

// ---------------------------------------------------------------------------------------
// Through the prepare state machine

/// Inventory only: the claims here need no MIG changes.
fn static_backend() -> Arc<FakeBackend> {
    Arc::new(FakeBackend::new(inventory()))
}

fn driver_config(world: &World) -> DriverConfig {
    common::lay_out_driver_root(&world.root.join("driver-root"));
    DriverConfig {
        dynamic_mig: false,
        ..common::node_config(&world.root, world.state.clone())
    }
}

fn mps_claim(uid: &str, device: &str, pct: u8, limit: &str) -> ResourceClaim {
    with_config(
        node_claim(uid, &[("gpu", device)]),
        "FromClaim",
        DRIVER_NAME,
        &["gpu"],
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": pct,
                "pinnedMemoryLimit": {"default": limit}}}}),
    )
}

fn start_driver(world: &World, knobs: &[(&str, &str)]) -> (NodeDriver, Arc<SharingManager>) {
    let manager = Arc::new(SharingManager::new(world.config(knobs)));
    let driver =
        NodeDriver::start_with_sharing(driver_config(world), static_backend(), manager.clone())
            .unwrap();
    (driver, manager)
}

fn node_driver_prepares_and_unprepares_mps_claims() {
    let world = World::new();
    let uid = "0f1e2d3c-0000-4000-8000-000000000001";
    let (driver, _manager) = start_driver(&world, &[]);
    let prepared = driver
        .prepare(&mps_claim(uid, "gpu-0", 25, "10Gi"))
        .unwrap();
    assert_eq!(prepared.devices.len(), 1);

    // The claim's CDI spec carries the pipe mount and the client env.
    let spec_path = world
        .root
        .join("cdi")
        .join(cleave_driver::cdi::spec_file_name(uid));
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&spec_path).unwrap()).unwrap();
    let text = spec.to_string();
    let pipe = world.claim_dir(uid).join("pipe");
    assert!(
        text.contains(&format!("\"hostPath\":\"{}\"", pipe.display())),
        "{text}"
    );
    assert!(
        text.contains("\"containerPath\":\"/tmp/nvidia-mps\""),
        "{text}"
    );
    assert!(
        text.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"),
        "{text}"
    );
    assert!(
        text.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10G"),
        "{text}"
    );

    // The checkpoint names the daemon; its record says which it is.
    let data = CheckpointStore::in_dir(&world.state).load().unwrap();
    let state = data.claims[uid].sharing.clone().unwrap();
    assert_eq!(state.mps_daemon.as_deref(), Some(uid));
    let pid = world.daemon_pid_of(uid);
    assert!(alive(pid));

    // A claim the checkpoint no longer holds (its record was lost), with a daemon running.
    let orphan = world.manager(&[]);
    let orphan_edits = orphan
        .apply_claim(
            "orphan-claim",
            &[whole(1, GPU_B, mps(50, None, json!({})))],
            &world.needs(),
        )
        .unwrap();
    let orphan_pid = world.daemon_pid(&orphan_edits);

    // Plugin restart: start reconciles by itself; the live claim's daemon is kept, the
    // orphan's stopped.
    drop(driver);
    let (driver, manager) = start_driver(&world, &[]);
    assert!(wait_dead(orphan_pid, Duration::from_secs(5)));
    assert!(!world.claim_dir("orphan-claim").exists());
    let live: BTreeSet<String> = driver
        .prepared_claims()
        .into_iter()
        .map(|c| c.uid)
        .collect();
    let report = manager.reconcile(&live);
    assert_eq!(report.kept, [uid], "{report:?}");
    assert!(alive(pid));
    // Nothing died: a check between prepares changes nothing.
    assert!(driver.reconcile_sharing().unwrap().is_empty());
    assert!(alive(pid));

    // The daemon dies between prepares: the check starts it again with the claim's limits
    // and records the new daemon.
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(wait_dead(pid, Duration::from_secs(5)));
    let restarted = driver.reconcile_sharing().unwrap();
    assert_eq!(restarted.into_iter().collect::<Vec<_>>(), [uid]);
    let new_pid = world.daemon_pid_of(uid);
    assert_ne!(new_pid, pid);
    assert!(alive(new_pid));
    assert_eq!(
        world
            .commands(uid)
            .iter()
            .filter(|c| *c == "set_default_active_thread_percentage 25")
            .count(),
        2
    );
    let pid = new_pid;

    driver.unprepare(uid).unwrap();
    assert!(wait_dead(pid, Duration::from_secs(5)));
    assert!(!spec_path.exists());
    assert_eq!(
        world.smi_setting(GPU_A, "computeMode").as_deref(),
        Some("DEFAULT")
    );
    world.assert_nothing_left();

    // A daemon that cannot start: prepare fails, nothing is left or recorded.
    let (driver, _manager) = start_driver(&world, &[("FAKE_MPS_FAIL_START", "1")]);
    let uid2 = "0f1e2d3c-0000-4000-8000-000000000002";
    let err = driver
        .prepare(&mps_claim(uid2, "gpu-1", 50, "1Gi"))
        .unwrap_err();
    assert!(
        err.to_string().contains("starting MPS control daemon"),
        "{err}"
    );
    // The failure keeps its type through the seam: the refusal label comes from it.
    assert!(
        matches!(&err, PrepareError::Sharing(SharingFailure::Apply { claim, source })
            if claim == uid2 && matches!(**source, SharingFailure::DaemonStart { .. })),
        "{err:?}"
    );
    assert_eq!(err.refusal(), Refusal::Sharing);
    assert!(driver.prepared_claims().is_empty());
    assert!(
        !world
            .root
            .join("cdi")
            .join(cleave_driver::cdi::spec_file_name(uid2))
            .exists()
    );
    world.assert_nothing_left();

    // A limit larger than the GPU: a clear error before anything starts.
    let err = driver
        .prepare(&mps_claim(uid2, "gpu-1", 50, "100Gi"))
        .unwrap_err();
    assert!(
        err.to_string().contains("larger than the device's memory"),
        "{err}"
    );
    assert!(
        matches!(&err, PrepareError::Sharing(SharingFailure::Apply { source, .. })
            if matches!(**source, SharingFailure::LimitTooLarge { .. })),
        "{err:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Shares (consumable capacity)

/// A claim allocated as a share of `device`: `shareID` and what it consumed; `config`: an
/// opaque GpuConfig's `sharing` block, if any.
fn share_claim(
    uid: &str,
    device: &str,
    share: Option<&str>,
    consumed: (&str, &str),
    sharing: Option<serde_json::Value>,
) -> ResourceClaim {
    let mut result =
        json!({"request": "gpu", "driver": DRIVER_NAME, "pool": "node-a", "device": device});
    if let Some(share) = share {
        result["shareID"] = json!(share);
        result["consumedCapacity"] = json!({"memory": consumed.0, "multiprocessors": consumed.1});
    }
    let config = match sharing {
        Some(s) => json!([{"source": "FromClaim", "requests": ["gpu"], "opaque": {
            "driver": DRIVER_NAME,
            "parameters": {"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig", "sharing": s}}}]),
        None => json!([]),
    };
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": format!("claim-{}", &uid[..8]), "namespace": "default", "uid": uid},
        "spec": {"devices": {}},
        "status": {"allocation": {"devices": {"results": [result], "config": config}}}
    }))
    .unwrap()
}

/// The shared daemon of `device` for the claims of namespace `default` (all of this file's).
fn shared_key(device: &str) -> String {
    cleave_driver::prepare::shared_daemon_key(device, "default")
}

fn start_share_driver(
    world: &World,
    mode: ConsumableCapacity,
    knobs: &[(&str, &str)],
) -> NodeDriver {
    let manager = Arc::new(SharingManager::new(world.config(knobs)));
    let config = DriverConfig {
        consumable_capacity: mode,
        ..driver_config(world)
    };
    NodeDriver::start_with_sharing(config, static_backend(), manager).unwrap()
}

fn cdi_text(world: &World, uid: &str) -> String {
    std::fs::read_to_string(
        world
            .root
            .join("cdi")
            .join(cleave_driver::cdi::spec_file_name(uid)),
    )
    .unwrap_or_default()
}

fn shares_of_one_gpu_use_one_daemon_until_the_last_is_unprepared() {
    let world = World::new();
    let driver = start_share_driver(&world, ConsumableCapacity::Mps, &[]);
    let uids = [
        "5a000000-0000-4000-8000-000000000001",
        "5b000000-0000-4000-8000-000000000002",
        "5c000000-0000-4000-8000-000000000003",
    ];
    let share_ids = [
        "aaaaaaaa-0000-4000-8000-00000000000a",
        "bbbbbbbb-0000-4000-8000-00000000000b",
        "cccccccc-0000-4000-8000-00000000000c",
    ];
    for (uid, share) in uids.iter().zip(share_ids) {
        let answer = driver
            .prepare(&share_claim(
                uid,
                "gpu-0",
                Some(share),
                ("20Gi", "44"),
                None,
            ))
            .unwrap();
        // One CDI device per share, named with the share.
        assert_eq!(
            answer.devices[0].cdi_device_ids,
            [cleave_driver::cdi::qualified_device_id(
                uid,
                &format!("gpu-0-share-{share}")
            )]
        );
        assert_eq!(answer.devices[0].device_name, "gpu-0");
        let text = cdi_text(&world, uid);
        // floor(44 * 100 / 132) = 33; 20Gi in MiB, keyed by ordinal 0.
        for want in [
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=33",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M",
            "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        ] {
            assert!(text.contains(want), "{uid} lacks {want}: {text}");
        }
        let pipe = world.claim_dir(&shared_key("gpu-0")).join("pipe");
        assert!(
            text.contains(&format!("\"hostPath\":\"{}\"", pipe.display())),
            "{text}"
        );
    }
    // One daemon for the three shares, multi-user, defaults unlimited.
    let started = world.started_pids();
    assert_eq!(started.len(), 1, "{:?}", world.mps_lines());
    let pid = started[0];
    assert!(alive(pid));
    assert!(
        world.mps_lines().iter().any(|l| l.contains("multiUser=1")),
        "not multi-user: {:?}",
        world.mps_lines()
    );
    assert!(
        world
            .commands(&shared_key("gpu-0"))
            .contains(&"set_default_active_thread_percentage 100".to_owned()),
        "{:?}",
        world.commands(&shared_key("gpu-0"))
    );
    // Compute mode left alone: the daemons of several namespaces may share the GPU.
    assert_eq!(world.smi_setting(GPU_A, "computeMode"), None);
    let data = CheckpointStore::in_dir(&world.state).load().unwrap();
    for (uid, share) in uids.iter().zip(share_ids) {
        let s = data.claims[*uid].devices[0].share.clone().unwrap();
        assert_eq!(s.share_id, share);
        assert_eq!(s.memory_bytes, Some(20 * GIB));
        assert_eq!(s.multiprocessors, Some(44));
    }

    // A whole-device claim on the shared GPU is refused; a share of an exclusively held
    // GPU too; an exclusive claim on another GPU works as before.
    let exclusive = "e0000000-0000-4000-8000-000000000001";
    let err = driver
        .prepare(&share_claim(exclusive, "gpu-0", None, ("", ""), None))
        .unwrap_err()
        .to_string();
    assert!(err.contains("over-commit: allocated whole"), "{err}");
    driver
        .prepare(&share_claim(exclusive, "gpu-1", None, ("", ""), None))
        .unwrap();
    assert!(!cdi_text(&world, exclusive).contains("CUDA_MPS"));
    let err = driver
        .prepare(&share_claim(
            "e0000000-0000-4000-8000-000000000002",
            "gpu-1",
            Some("dddddddd-0000-4000-8000-00000000000d"),
            ("20Gi", "44"),
            None,
        ))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("prepared for another claim") && err.contains("alone"),
        "{err}"
    );

    // Unprepare of one share leaves the others' daemon alone, across a restart too.
    driver.unprepare(uids[0]).unwrap();
    assert!(alive(pid));
    assert!(cdi_text(&world, uids[1]).contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=33"));
    drop(driver);
    let driver = start_share_driver(&world, ConsumableCapacity::Mps, &[]);
    assert!(alive(pid), "restart stopped the shared daemon");
    assert_eq!(world.started_pids().len(), 1);
    driver.unprepare(uids[1]).unwrap();
    assert!(alive(pid));

    // The daemon dies while a share remains: the check starts it again and rewrites the
    // share's spec.
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(wait_dead(pid, Duration::from_secs(5)));
    let restarted = driver.reconcile_sharing().unwrap();
    assert_eq!(restarted.into_iter().collect::<Vec<_>>(), [uids[2]]);
    let pids = world.started_pids();
    assert_eq!(pids.len(), 2);
    assert!(alive(pids[1]));

    // The last share stops it; the compute mode was never changed.
    driver.unprepare(uids[2]).unwrap();
    assert!(wait_dead(pids[1], Duration::from_secs(5)));
    assert_eq!(world.smi_setting(GPU_A, "computeMode"), None);
    driver.unprepare(exclusive).unwrap();
    world.assert_nothing_left();

    // A share that consumed all of a device (what a claim that asks for no capacity gets)
    // has it alone: no daemon, no limits, even on a GPU without multi-user MPS.
    let started = world.started_pids().len();
    for (device, consumed) in [("gpu-1", ("80Gi", "132")), ("gpu-2", ("16Gi", "132"))] {
        let all = "e0000000-0000-4000-8000-000000000003";
        let answer = driver
            .prepare(&share_claim(
                all,
                device,
                Some("eeeeeeee-0000-4000-8000-00000000000e"),
                consumed,
                None,
            ))
            .unwrap();
        assert_eq!(
            answer.devices[0].share_id.as_deref(),
            Some("eeeeeeee-0000-4000-8000-00000000000e")
        );
        assert!(!cdi_text(&world, all).contains("CUDA_MPS"), "{device}");
        driver.unprepare(all).unwrap();
    }
    assert_eq!(world.started_pids().len(), started);
    world.assert_nothing_left();
}

/// Mounts of a CDI spec (claim edits and every device's): (container path, host path,
/// options).
fn cdi_mounts(world: &World, uid: &str) -> Vec<(String, String, Vec<String>)> {
    let spec: serde_json::Value = serde_json::from_str(&cdi_text(world, uid)).unwrap();
    let devices = spec["devices"].as_array().cloned().unwrap_or_default();
    std::iter::once(spec["containerEdits"].clone())
        .chain(devices.iter().map(|d| d["containerEdits"].clone()))
        .flat_map(|e| e["mounts"].as_array().cloned().unwrap_or_default())
        .map(|m| {
            (
                m["containerPath"].as_str().unwrap_or_default().to_owned(),
                m["hostPath"].as_str().unwrap_or_default().to_owned(),
                m["options"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|o| o.as_str().map(str::to_owned))
                    .collect(),
            )
        })
        .collect()
}

/// The host directory mounted at the container's pipe directory in `uid`'s spec; checks
/// that the privileged socket is masked and never mounted from the host.
fn pipe_of(world: &World, uid: &str) -> String {
    let mounts = cdi_mounts(world, uid);
    let pipe = mounts
        .iter()
        .find(|(c, _, _)| c == "/tmp/nvidia-mps")
        .map(|(_, h, _)| h.clone())
        .unwrap_or_else(|| panic!("{uid}: no pipe mount in {mounts:?}"));
    assert!(
        mounts
            .iter()
            .any(|(c, h, o)| c == "/tmp/nvidia-mps/control_privileged"
                && h == "/dev/null"
                && o.contains(&"ro".to_owned())),
        "{uid}: control_privileged not masked: {mounts:?}"
    );
    assert!(
        !mounts
            .iter()
            .any(|(_, h, _)| h.ends_with("control_privileged")),
        "{uid}: mounts the privileged socket: {mounts:?}"
    );
    pipe
}

fn mode_of(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

/// Shares of namespaces `team-a` (two claims) and `team-b` on one GPU: one daemon per
/// namespace, with its own pipe directory (0711 under a 0711 pipe root, never the
/// privileged socket in a client's view); unprepare of `team-a`'s last share stops only
/// its daemon.
fn shares_of_two_namespaces_on_one_gpu_never_meet() {
    let world = World::new();
    let mut sharing = world.config(&[]);
    let run = world.root.join("run");
    sharing.pipe_root = Some(run.clone());
    let config = DriverConfig {
        consumable_capacity: ConsumableCapacity::Mps,
        ..driver_config(&world)
    };
    let driver = NodeDriver::start_with_sharing(
        config,
        static_backend(),
        Arc::new(SharingManager::new(sharing)),
    )
    .unwrap();
    let claims = [
        ("team-a", "5a000000-0000-4000-8000-0000000000a1"),
        ("team-a", "5a000000-0000-4000-8000-0000000000a2"),
        ("team-b", "5b000000-0000-4000-8000-0000000000b1"),
    ];
    for (i, (ns, uid)) in claims.iter().enumerate() {
        let mut claim = share_claim(
            uid,
            "gpu-0",
            Some(&format!("{i}aaaaaaa-0000-4000-8000-00000000000a")),
            ("20Gi", "44"),
            None,
        );
        claim.metadata.namespace = Some((*ns).to_owned());
        driver.prepare(&claim).unwrap();
    }
    let started = world.started_pids();
    assert_eq!(
        started.len(),
        2,
        "one daemon per namespace: {:?}",
        world.mps_lines()
    );
    let (pid_a, pid_b) = (started[0], started[1]);
    let key_a = cleave_driver::prepare::shared_daemon_key("gpu-0", "team-a");
    let key_b = cleave_driver::prepare::shared_daemon_key("gpu-0", "team-b");
    assert!(world.claim_dir(&key_a).is_dir() && world.claim_dir(&key_b).is_dir());
    let pipes: Vec<String> = claims.iter().map(|(_, uid)| pipe_of(&world, uid)).collect();
    assert_eq!(pipes[0], pipes[1], "one namespace, one daemon");
    assert_ne!(pipes[0], pipes[2], "namespaces share a pipe directory");
    // Least permissions: the root and each pipe directory may be traversed, not listed
    // or changed, by other users; the daemon's state directory is root's alone.
    assert_eq!(mode_of(&run), 0o711);
    for pipe in [&pipes[0], &pipes[2]] {
        assert_eq!(mode_of(Path::new(pipe)), 0o711, "{pipe}");
        assert!(Path::new(pipe).starts_with(&run));
    }
    assert_eq!(mode_of(&world.claim_dir(&key_a)), 0o700);
    // The compute mode is left alone: two MPS servers share the GPU.
    assert_eq!(world.smi_setting(GPU_A, "computeMode"), None);

    // team-a's first share goes: both daemons stay; its last: only team-a's stops.
    driver.unprepare(claims[0].1).unwrap();
    assert!(alive(pid_a) && alive(pid_b));
    driver.unprepare(claims[1].1).unwrap();
    assert!(wait_dead(pid_a, Duration::from_secs(5)));
    assert!(
        alive(pid_b),
        "team-b's daemon stopped with team-a's last share"
    );
    assert!(!world.claim_dir(&key_a).exists() && !Path::new(&pipes[0]).exists());
    assert!(world.claim_dir(&key_b).is_dir());
    // A restart keeps team-b's daemon.
    drop(driver);
    let driver = start_share_driver(&world, ConsumableCapacity::Mps, &[]);
    assert!(alive(pid_b));
    assert_eq!(world.started_pids().len(), 2);
    driver.unprepare(claims[2].1).unwrap();
    world.assert_nothing_left();
}

/// A share daemon an earlier release started for every namespace (`mps/shared-gpu-0`,
/// its record without a namespace in the key) survives the upgrade while a share of the
/// device remains, and is stopped, compute mode restored, with the last one.
fn shared_daemon_of_an_earlier_release_lives_until_the_last_share() {
    let world = World::new();
    let driver = start_share_driver(&world, ConsumableCapacity::Mps, &[]);
    let uid = "5a000000-0000-4000-8000-0000000000c1";
    driver
        .prepare(&share_claim(
            uid,
            "gpu-0",
            Some("caaaaaaa-0000-4000-8000-00000000000a"),
            ("20Gi", "44"),
            None,
        ))
        .unwrap();
    assert_eq!(world.started_pids().len(), 1);
    let new_pid = world.started_pids()[0];
    drop(driver);

    // The earlier release's daemon and record, as it wrote them.
    let legacy = legacy_shared_daemon_key("gpu-0");
    assert_eq!(legacy, "shared-gpu-0");
    let config = world.config(&[]);
    let dir = world.claim_dir(&legacy);
    let spec = cleave_driver::sharing::DaemonSpec {
        claim_uid: legacy.clone(),
        pipe_dir: dir.join("pipe"),
        log_dir: dir.join("log"),
        visible_devices: vec![GPU_A.to_owned()],
        multi_user: true,
    };
    cleave_driver::sharing::mps::create_dirs(&dir, &spec).unwrap();
    let launcher = cleave_driver::sharing::ProcessLauncher::new(
        &config.binaries.mps_control,
        config.extra_env.clone(),
        &config.boot_id_path,
    );
    use cleave_driver::sharing::DaemonLauncher as _;
    let handle = launcher.start(&spec, Duration::from_secs(10)).unwrap();
    let old_pid = handle.pid;
    let record = json!({
        "spec": {"claimUid": legacy, "pipeDir": dir.join("pipe"), "logDir": dir.join("log"),
            "visibleDevices": [GPU_A], "multiUser": true},
        "hostPipeDir": dir.join("pipe"),
        "activeThreadPercentage": 100,
        "pinnedLimits": [],
        "exclusiveGpus": [GPU_A],
        "daemon": {"pid": handle.pid, "startTime": handle.start_time, "bootId": handle.boot_id},
    });
    std::fs::write(
        dir.join("daemon.json"),
        serde_json::to_vec_pretty(&record).unwrap(),
    )
    .unwrap();
    // It set the GPU to EXCLUSIVE_PROCESS, as that release did.
    cleave_driver::sharing::NvidiaSmi::new(
        &config.binaries.nvidia_smi,
        config.extra_env.clone(),
        Duration::from_secs(10),
    )
    .set_compute_mode(GPU_A, cleave_driver::sharing::ComputeMode::ExclusiveProcess)
    .unwrap();

    // The upgraded driver starts: both daemons are kept while the share lives.
    let driver = start_share_driver(&world, ConsumableCapacity::Mps, &[]);
    assert!(
        alive(old_pid),
        "the earlier release's daemon was stopped at start"
    );
    assert!(alive(new_pid));
    assert!(dir.join("daemon.json").is_file());
    // The last share of the device stops both and restores what the old one set.
    driver.unprepare(uid).unwrap();
    assert!(wait_dead(old_pid, Duration::from_secs(5)));
    assert_eq!(
        world.smi_setting(GPU_A, "computeMode").as_deref(),
        Some("DEFAULT")
    );
    world.assert_nothing_left();
}

fn shares_are_refused_clearly_where_they_cannot_be_served() {
    let world = World::new();
    let share = Some("aaaaaaaa-0000-4000-8000-00000000000a");
    let uid = "5a000000-0000-4000-8000-000000000001";

    // Mode off: a share is refused naming the flag.
    let driver = start_share_driver(&world, ConsumableCapacity::Off, &[]);
    let err = driver
        .prepare(&share_claim(uid, "gpu-0", share, ("20Gi", "44"), None))
        .unwrap_err()
        .to_string();
    assert!(err.contains("--consumable-capacity off"), "{err}");
    drop(driver);

    let driver = start_share_driver(&world, ConsumableCapacity::Mps, &[]);
    // A GPU without multi-user MPS (compute capability 6.0): refused at prepare, naming
    // the GPU and why; nothing starts.
    let err = driver
        .prepare(&share_claim(uid, "gpu-2", share, ("4Gi", "10"), None))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(GPU_OLD) && err.contains("multi-user MPS") && err.contains("6.0"),
        "{err}"
    );
    assert!(world.started_pids().is_empty());
    // A shareID that cannot name a CDI device.
    let err = driver
        .prepare(&share_claim(
            uid,
            "gpu-0",
            Some("Not/A/UUID"),
            ("20Gi", "44"),
            None,
        ))
        .unwrap_err()
        .to_string();
    assert!(err.contains("shareID"), "{err}");
    // multi-user refused by the control daemon (a driver whose tool has no -M): clear error.
    drop(driver);
    let driver = start_share_driver(
        &world,
        ConsumableCapacity::Mps,
        &[("FAKE_MPS_MULTIUSER", "refuse")],
    );
    let err = driver
        .prepare(&share_claim(uid, "gpu-0", share, ("20Gi", "44"), None))
        .unwrap_err()
        .to_string();
    assert!(err.contains("multi-user"), "{err}");
    assert!(driver.prepared_claims().is_empty());
    world.assert_nothing_left();
}

fn time_slicing_shares_are_scheduled_not_enforced() {
    let world = World::new();
    let driver = start_share_driver(&world, ConsumableCapacity::TimeSlicing, &[]);
    let a = "5a000000-0000-4000-8000-000000000001";
    let b = "5b000000-0000-4000-8000-000000000002";
    let long = || Some(json!({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}));
    driver
        .prepare(&share_claim(
            a,
            "gpu-0",
            Some("aaaaaaaa-0000-4000-8000-00000000000a"),
            ("20Gi", "44"),
            long(),
        ))
        .unwrap();
    driver
        .prepare(&share_claim(
            b,
            "gpu-0",
            Some("bbbbbbbb-0000-4000-8000-00000000000b"),
            ("10Gi", "20"),
            long(),
        ))
        .unwrap();
    // The interval from the config is set; no daemon, no client limits.
    assert_eq!(world.smi_setting(GPU_A, "timeslice").as_deref(), Some("3"));
    assert!(world.started_pids().is_empty());
    assert!(!cdi_text(&world, a).contains("CUDA_MPS"));
    // A share asking for another interval on the same GPU is served with the GPU's interval
    // (the scheduler placed it; the interval belongs to the GPU, held by the first shares).
    let c = "5c000000-0000-4000-8000-000000000003";
    driver
        .prepare(&share_claim(
            c,
            "gpu-0",
            Some("cccccccc-0000-4000-8000-00000000000c"),
            ("10Gi", "20"),
            Some(json!({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Short"}})),
        ))
        .unwrap();
    assert_eq!(world.smi_setting(GPU_A, "timeslice").as_deref(), Some("3"));
    driver.unprepare(c).unwrap();
    driver.unprepare(a).unwrap();
    assert_eq!(world.smi_setting(GPU_A, "timeslice").as_deref(), Some("3"));
    driver.unprepare(b).unwrap();
    assert_eq!(world.smi_setting(GPU_A, "timeslice").as_deref(), Some("0"));
    world.assert_nothing_left();
}

// ---------------------------------------------------------------------------------------
// Shares of MIG devices

/// The MIG device the MIG share tests use: 1g.10gb at slice 0 of `GPU_MIG` (16 SMs,
/// 9856 MiB; its GPU has 132 SMs).
const MIG_SHARED: &str = "gpu-3-mig-1g10gb-0";

/// The driver's fake backend over `inventory()` with `instances` on `GPU_MIG`: MIG
/// instances are created and destroyed in memory, and the calls recorded (what NVML would be
/// asked).
fn mig_backend(instances: Vec<MigInstance>) -> Arc<FakeBackend> {
    let mut inv = inventory();
    for g in &mut inv.gpus {
        if let MigState::Enabled { instances: now, .. } = &mut g.mig
            && g.uuid == GPU_MIG
        {
            now.clone_from(&instances);
        }
    }
    Arc::new(FakeBackend::new(inv))
}

/// MIG instances the driver created so far.
fn creates(backend: &FakeBackend) -> usize {
    backend
        .mutations()
        .iter()
        .filter(|c| matches!(c, Call::CreateMig { .. }))
        .count()
}

/// MIG instances the driver destroyed so far.
fn destroys(backend: &FakeBackend) -> usize {
    backend
        .mutations()
        .iter()
        .filter(|c| matches!(c, Call::DestroyMig { .. }))
        .count()
}

fn start_mig_share_driver(world: &World, backend: &Arc<FakeBackend>, dynamic: bool) -> NodeDriver {
    let config = DriverConfig {
        consumable_capacity: ConsumableCapacity::Mps,
        dynamic_mig: dynamic,
        ..driver_config(world)
    };
    let manager = Arc::new(SharingManager::new(world.config(&[])));
    NodeDriver::start_with_sharing(config, backend.clone(), manager).unwrap()
}

/// Checks the MIG share `uid`'s CDI spec: the MIG device, its client limits, the shared
/// daemon's pipe directory.
fn assert_mig_share_spec(world: &World, uid: &str, mig: &str, pct: u32, mib: u64) {
    let text = cdi_text(world, uid);
    for want in [
        mig.to_owned(),
        format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={pct}"),
        format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={mib}M"),
        "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps".to_owned(),
        format!(
            "\"hostPath\":\"{}\"",
            world
                .claim_dir(&shared_key(MIG_SHARED))
                .join("pipe")
                .display()
        ),
    ] {
        assert!(text.contains(&want), "{uid} lacks {want}: {text}");
    }
}

/// The shared daemon of the MIG device: exactly one was started, for `mig`, multi-user,
/// with unlimited defaults; nvidia-smi was never asked anything (no compute mode on MIG).
fn assert_one_mig_daemon(world: &World, mig: &str) -> u32 {
    let starts: Vec<String> = world
        .mps_lines()
        .into_iter()
        .filter(|l| l.starts_with("start "))
        .collect();
    assert_eq!(starts.len(), 1, "{starts:?}");
    assert!(starts[0].ends_with(&format!("devices={mig}")), "{starts:?}");
    assert!(
        world.mps_lines().iter().any(|l| l.contains("multiUser=1")),
        "not multi-user: {:?}",
        world.mps_lines()
    );
    let commands = world.commands(&shared_key(MIG_SHARED));
    assert!(
        commands.contains(&"set_default_active_thread_percentage 100".to_owned()),
        "{commands:?}"
    );
    assert!(world.smi_lines().is_empty(), "{:?}", world.smi_lines());
    assert_eq!(world.smi_setting(GPU_MIG, "computeMode"), None);
    let pids = world.started_pids();
    assert_eq!(pids.len(), 1);
    assert!(alive(pids[0]));
    pids[0]
}

/// The MIG UUID and whether cleave created it, as the checkpoint records them for `uid`.
fn recorded_mig(world: &World, uid: &str) -> (String, bool) {
    let data = CheckpointStore::in_dir(&world.state).load().unwrap();
    let m = data.claims[uid].devices[0].mig.clone().unwrap();
    (m.uuid.unwrap(), m.created_by_cleave)
}

fn shares_of_an_on_demand_mig_device_use_one_instance_and_one_daemon() {
    let world = World::new();
    let backend = mig_backend(Vec::new());
    let driver = start_mig_share_driver(&world, &backend, true);
    let (a, b, c) = (
        "5a000000-0000-4000-8000-000000000001",
        "5b000000-0000-4000-8000-000000000002",
        "5c000000-0000-4000-8000-000000000003",
    );
    let share_a = "aaaaaaaa-0000-4000-8000-00000000000a";
    // 4 of the MIG device's 16 SMs: 25 % (of the parent GPU's 132 it would be 3 %).
    let answer = driver
        .prepare(&share_claim(
            a,
            MIG_SHARED,
            Some(share_a),
            ("4Gi", "4"),
            None,
        ))
        .unwrap();
    assert_eq!(
        answer.devices[0].cdi_device_ids,
        [cleave_driver::cdi::qualified_device_id(
            a,
            &format!("{MIG_SHARED}-share-{share_a}")
        )]
    );
    // 8 of 16 SMs: 50 %.
    driver
        .prepare(&share_claim(
            b,
            MIG_SHARED,
            Some("bbbbbbbb-0000-4000-8000-00000000000b"),
            ("5Gi", "8"),
            None,
        ))
        .unwrap();

    // One instance, created once, recorded for both shares as cleave's.
    assert_eq!(creates(&backend), 1);
    let instances = backend.instances(GPU_MIG);
    assert_eq!(instances.len(), 1);
    let mig = instances[0].uuid.clone();
    assert_eq!(recorded_mig(&world, a), (mig.clone(), true));
    assert_eq!(recorded_mig(&world, b), (mig.clone(), true));
    assert_mig_share_spec(&world, a, &mig, 25, 4096);
    assert_mig_share_spec(&world, b, &mig, 50, 5120);
    let pid = assert_one_mig_daemon(&world, &mig);

    // Unprepare of the share that created the instance keeps instance and daemon for
    // the other.
    driver.unprepare(a).unwrap();
    assert_eq!(destroys(&backend), 0);
    assert_eq!(backend.instances(GPU_MIG).len(), 1);
    assert!(alive(pid));
    assert!(cdi_text(&world, a).is_empty());
    assert_mig_share_spec(&world, b, &mig, 50, 5120);

    // A restart keeps them too, and a share prepared after it joins the same instance.
    drop(driver);
    let driver = start_mig_share_driver(&world, &backend, true);
    assert!(alive(pid), "restart stopped the shared daemon");
    driver
        .prepare(&share_claim(
            c,
            MIG_SHARED,
            Some("cccccccc-0000-4000-8000-00000000000c"),
            ("2Gi", "2"),
            None,
        ))
        .unwrap();
    assert_eq!(creates(&backend), 1);
    assert_eq!(recorded_mig(&world, c), (mig.clone(), true));
    assert_mig_share_spec(&world, c, &mig, 12, 2048);
    assert_eq!(world.started_pids(), [pid]);
    driver.unprepare(b).unwrap();
    assert_eq!(destroys(&backend), 0);
    assert!(alive(pid));

    // The last share stops the daemon and destroys the on-demand instance.
    driver.unprepare(c).unwrap();
    assert!(wait_dead(pid, Duration::from_secs(5)));
    assert_eq!(destroys(&backend), 1);
    assert!(backend.instances(GPU_MIG).is_empty());
    assert!(world.smi_lines().is_empty(), "{:?}", world.smi_lines());
    assert!(driver.prepared_claims().is_empty());
    world.assert_nothing_left();
}

fn shares_of_a_static_mig_instance_use_one_daemon_and_keep_the_instance() {
    let world = World::new();
    let backend = mig_backend(vec![MigInstance {
        uuid: MIG_1.into(),
        profile_id: 19,
        profile_name: "1g.10gb".into(),
        gi_id: 7,
        ci_id: 0,
        placement: Placement { start: 0, size: 1 },
    }]);
    let driver = start_mig_share_driver(&world, &backend, false);
    let (a, b) = (
        "5a000000-0000-4000-8000-000000000001",
        "5b000000-0000-4000-8000-000000000002",
    );
    for (uid, share, consumed) in [
        (a, "aaaaaaaa-0000-4000-8000-00000000000a", ("4Gi", "4")),
        (b, "bbbbbbbb-0000-4000-8000-00000000000b", ("5Gi", "8")),
    ] {
        driver
            .prepare(&share_claim(uid, MIG_SHARED, Some(share), consumed, None))
            .unwrap();
        assert_eq!(recorded_mig(&world, uid), (MIG_1.to_owned(), false));
    }
    assert_mig_share_spec(&world, a, MIG_1, 25, 4096);
    assert_mig_share_spec(&world, b, MIG_1, 50, 5120);
    let pid = assert_one_mig_daemon(&world, MIG_1);

    driver.unprepare(a).unwrap();
    assert!(alive(pid));
    assert_mig_share_spec(&world, b, MIG_1, 50, 5120);
    driver.unprepare(b).unwrap();
    assert!(wait_dead(pid, Duration::from_secs(5)));
    // The static instance is the administrator's: never created, never destroyed.
    assert_eq!((creates(&backend), destroys(&backend)), (0, 0));
    assert_eq!(backend.instances(GPU_MIG).len(), 1);
    assert!(world.smi_lines().is_empty(), "{:?}", world.smi_lines());
    world.assert_nothing_left();
}

// ---------------------------------------------------------------------------------------
// The inside of a daemon pod (`mps-daemon`): the supervisor.

fn supervise_config(world: &World, claim: &str, env: &[(&str, &str)]) -> SuperviseConfig {
    let dir = world.claim_dir(claim);
    for d in ["pipe", "log"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    let mut all: Vec<(String, String)> = world
        .config(&[])
        .extra_env
        .into_iter()
        .chain(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())))
        .collect();
    all.push(("CUDA_VISIBLE_DEVICES".into(), GPU_A.into()));
    SuperviseConfig {
        claim_uid: claim.into(),
        control_bin: world.root.join("bin/nvidia-cuda-mps-control"),
        driver_root: world.root.join("driver-root"),
        lib_dir: None,
        pipe_dir: dir.join("pipe"),
        log_dir: dir.join("log"),
        env: all,
        multi_user: false,
        start_timeout: Duration::from_secs(10),
        stop_timeout: Duration::from_secs(3),
        poll: Duration::from_millis(20),
        reap_orphans: false,
    }
}

/// Runs the supervisor on a thread; returns its outcome and what it streamed.
/// The supervisor's output, readable while it runs.
#[derive(Clone, Default)]
struct SharedOut(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for SharedOut {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl SharedOut {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// Appends `line` to the control daemon's log and waits until the running supervisor has
/// streamed it to its output: proof that the supervisor watches the daemon now.
fn log_line_streamed(log: &Path, out: &SharedOut, line: &str) {
    use std::io::Write as _;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    f.write_all(format!("{line}\n").as_bytes()).unwrap();
    let started = Instant::now();
    while !out.text().contains(line) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{line:?} never reached the supervisor's output: {:?}",
            out.text()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn spawn_supervisor(
    config: SuperviseConfig,
    stop: Arc<AtomicBool>,
) -> (
    std::thread::JoinHandle<Result<SuperviseOutcome, SharingFailure>>,
    SharedOut,
) {
    let out = SharedOut::default();
    let mut writer = out.clone();
    let handle = std::thread::spawn(move || supervise(&config, &stop, &mut writer));
    (handle, out)
}

fn supervisor_quits_the_daemon_on_stop_and_notices_its_exit() {
    let world = World::new();
    // Stop requested: the daemon is told to quit and the supervisor returns Stopped.
    let config = supervise_config(&world, "sup-a", &[]);
    let pipe = config.pipe_dir.clone();
    let log = config.log_dir.join("control.log");
    let stop = Arc::new(AtomicBool::new(false));
    let (handle, out) = spawn_supervisor(config, Arc::clone(&stop));
    let started = Instant::now();
    while world.started_pids().is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "daemon never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let pid = world.started_pids()[0];
    // What the daemon logs reaches the supervisor's output while the daemon runs.
    log_line_streamed(&log, &out, "[fake] control daemon log line");
    stop.store(true, Ordering::SeqCst);
    let outcome = handle.join().unwrap();
    assert_eq!(outcome.unwrap(), SuperviseOutcome::Stopped);
    assert!(wait_dead(pid, Duration::from_secs(5)));
    let pipe_cmds: Vec<String> = world
        .mps_lines()
        .into_iter()
        .filter(|l| l.contains(&format!("pipe={}", pipe.display())))
        .collect();
    assert!(
        pipe_cmds
            .iter()
            .any(|l| l.starts_with("cmd") && l.ends_with("quit")),
        "{pipe_cmds:?}"
    );
    assert!(
        pipe_cmds
            .iter()
            .any(|l| l.contains(&format!("devices={GPU_A}"))),
        "the daemon got CUDA_VISIBLE_DEVICES: {pipe_cmds:?}"
    );
    assert!(out.text().contains("control daemon log line"));

    // The daemon quits by itself (the plugin sent quit over the pipe): Exited.
    let config = supervise_config(&world, "sup-b", &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let tx_config = config.clone();
    let (handle, out) = spawn_supervisor(config, Arc::clone(&stop));
    let started = Instant::now();
    while !tx_config
        .pipe_dir
        .join("nvidia-cuda-mps-control.pid")
        .exists()
    {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "daemon b never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The supervisor has read the PID and watches the daemon before it quits.
    log_line_streamed(
        &tx_config.log_dir.join("control.log"),
        &out,
        "[fake] daemon b runs",
    );
    let quit = Command::new(&tx_config.control_bin)
        .env("CUDA_MPS_PIPE_DIRECTORY", &tx_config.pipe_dir)
        .envs(tx_config.env.iter().map(|(k, v)| (k, v)))
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write as _;
            c.stdin.take().unwrap().write_all(b"quit\n")?;
            c.wait()
        })
        .unwrap();
    assert!(quit.success());
    let outcome = handle.join().unwrap();
    assert_eq!(outcome.unwrap(), SuperviseOutcome::Exited);
    assert!(!stop.load(Ordering::SeqCst));
}

fn supervisor_reports_a_daemon_that_cannot_start() {
    let world = World::new();
    let config = supervise_config(&world, "sup-bad", &[("FAKE_MPS_FAIL_START", "1")]);
    let stop = Arc::new(AtomicBool::new(false));
    let (handle, _) = spawn_supervisor(config, stop);
    let outcome = handle.join().unwrap();
    let err = outcome.unwrap_err().to_string();
    assert!(
        err.contains("claim sup-bad") && err.contains("exited with"),
        "{err}"
    );
    assert!(world.started_pids().is_empty());
}

// ---------------------------------------------------------------------------------------
// One sharing model: allocations as the upstream allocator writes them on shareable nodes.

/// An allocation result of this node's pool: `(request, device, shareID, memory, SMs)`;
/// `shareID` `None` for a non-shareable device.
type Alloc<'a> = (&'a str, &'a str, Option<&'a str>, &'a str, &'a str);

/// A claim allocated `results`, with `configs` (allocation config entries) and admin access
/// on the requests named in `admin`.
fn alloc_claim(
    uid: &str,
    results: &[Alloc<'_>],
    configs: serde_json::Value,
    admin: &[&str],
) -> ResourceClaim {
    let results: Vec<serde_json::Value> = results
        .iter()
        .map(|(request, device, share, memory, sms)| {
            let mut r = json!({"request": request, "driver": DRIVER_NAME, "pool": "node-a", "device": device});
            if let Some(share) = share {
                r["shareID"] = json!(share);
                r["consumedCapacity"] = json!({"memory": memory, "multiprocessors": sms});
            }
            if admin.contains(request) {
                r["adminAccess"] = json!(true);
            }
            r
        })
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": format!("claim-{}", &uid[..8]), "namespace": "default", "uid": uid},
        "spec": {"devices": {}},
        "status": {"allocation": {"devices": {"results": results, "config": configs}}}
    }))
    .unwrap()
}

/// The chart's `mps.gpu.cleave.dev` class config (FromClass), for `requests`.
fn class_mps_config(requests: &[&str], pct: u8, limit: &str) -> serde_json::Value {
    json!([{"source": "FromClass", "requests": requests, "opaque": {
        "driver": DRIVER_NAME,
        "parameters": {"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": pct,
                "pinnedMemoryLimit": {"default": limit}}}}}}])
}

fn class_ts_config(requests: &[&str], interval: &str) -> serde_json::Value {
    json!([{"source": "FromClass", "requests": requests, "opaque": {
        "driver": DRIVER_NAME,
        "parameters": {"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}}}}])
}

/// What a claim that asks no capacity consumes of the test GPUs (80Gi, 132 SMs).
const WHOLE: (&str, &str) = ("80Gi", "132");

fn whole_device_shares_are_exclusive_devices_with_their_class_config() {
    for mode in [ConsumableCapacity::Mps, ConsumableCapacity::TimeSlicing] {
        let world = World::new();
        let driver = start_share_driver(&world, mode, &[]);
        // The MPS class on a shareable node: a whole-device share with the class's config
        // gets its own daemon with the class's limits, exactly as on a non-shareable node.
        let uid = "6a000000-0000-4000-8000-000000000001";
        let share = "aaaaaaaa-0000-4000-8000-00000000000a";
        let answer = driver
            .prepare(&alloc_claim(
                uid,
                &[("gpu", "gpu-0", Some(share), WHOLE.0, WHOLE.1)],
                class_mps_config(&["gpu"], 50, "10Gi"),
                &[],
            ))
            .unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        assert_eq!(answer.devices.len(), 1);
        assert_eq!(answer.devices[0].share_id.as_deref(), Some(share));
        let text = cdi_text(&world, uid);
        for want in [
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
            "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        ] {
            assert!(text.contains(want), "{mode:?}: lacks {want}: {text}");
        }
        assert!(
            world
                .commands(uid)
                .iter()
                .any(|c| c.contains("set_default_active_thread_percentage 50")),
            "{mode:?}: {:?}",
            world.commands(uid)
        );
        assert_eq!(world.started_pids().len(), 1, "{mode:?}");
        // The daemon is the claim's own, not a shared one.
        assert!(world.claim_dir(uid).exists());
        assert!(!world.claim_dir(&shared_key("gpu-0")).exists());

        // count: 2 through the exclusive class: two whole-device shares, two GPUs, no MPS.
        let two = "6b000000-0000-4000-8000-000000000002";
        let answer = driver
            .prepare(&alloc_claim(
                two,
                &[
                    (
                        "gpu",
                        "gpu-1",
                        Some("bbbbbbbb-0000-4000-8000-00000000000b"),
                        WHOLE.0,
                        WHOLE.1,
                    ),
                    (
                        "gpu",
                        "gpu-2",
                        Some("cccccccc-0000-4000-8000-00000000000c"),
                        "16Gi",
                        "132",
                    ),
                ],
                json!([]),
                &[],
            ))
            .unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        assert_eq!(answer.devices.len(), 2);
        assert!(!cdi_text(&world, two).contains("CUDA_MPS"), "{mode:?}");
        assert_eq!(world.started_pids().len(), 1, "{mode:?}");
        // A later partial share of a device held whole is an over-commit.
        let err = driver
            .prepare(&alloc_claim(
                "6c000000-0000-4000-8000-000000000003",
                &[(
                    "gpu",
                    "gpu-1",
                    Some("dddddddd-0000-4000-8000-00000000000d"),
                    "10Gi",
                    "10",
                )],
                json!([]),
                &[],
            ))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("over-commit") && err.contains("1.36.2"),
            "{err}"
        );
        driver.unprepare(two).unwrap();

        // The time-slicing class on a shareable node: the whole-device share's interval is set.
        let ts = "6d000000-0000-4000-8000-000000000004";
        driver
            .prepare(&alloc_claim(
                ts,
                &[(
                    "gpu",
                    "gpu-2",
                    Some("eeeeeeee-0000-4000-8000-00000000000e"),
                    "16Gi",
                    "132",
                )],
                class_ts_config(&["gpu"], "Long"),
                &[],
            ))
            .unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        assert!(
            world
                .smi_lines()
                .iter()
                .any(|l| l.contains("--set-timeslice") && l.contains("3")),
            "{mode:?}: {:?}",
            world.smi_lines()
        );

        for uid in [uid, ts] {
            driver.unprepare(uid).unwrap();
        }
        world.assert_nothing_left();
    }
}

fn shares_in_one_claim_and_configs_on_partial_shares_are_served() {
    let world = World::new();
    let driver = start_share_driver(&world, ConsumableCapacity::Mps, &[]);
    // Two requests the allocator placed on the same GPU: one CDI device, the limits of the
    // two shares summed (20Gi + 10Gi; 44 + 22 SMs of 132 = 50 %), one answer entry per shareID.
    let uid = "7a000000-0000-4000-8000-000000000001";
    let (s1, s2) = (
        "aaaaaaaa-0000-4000-8000-00000000000a",
        "bbbbbbbb-0000-4000-8000-00000000000b",
    );
    let answer = driver
        .prepare(&alloc_claim(
            uid,
            &[
                ("big", "gpu-0", Some(s1), "20Gi", "44"),
                ("small", "gpu-0", Some(s2), "10Gi", "22"),
            ],
            json!([]),
            &[],
        ))
        .unwrap();
    let ids: Vec<Option<&str>> = answer
        .devices
        .iter()
        .map(|d| d.share_id.as_deref())
        .collect();
    assert_eq!(ids, [Some(s1), Some(s2)]);
    assert_eq!(
        answer.devices[0].cdi_device_ids,
        answer.devices[1].cdi_device_ids
    );
    assert_eq!(answer.devices[0].request_names, ["big", "small"]);
    let text = cdi_text(&world, uid);
    for want in [
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=30720M",
    ] {
        assert!(text.contains(want), "lacks {want}: {text}");
    }
    // Preparing it again answers the same.
    assert_eq!(
        driver
            .prepare(&alloc_claim(
                uid,
                &[
                    ("big", "gpu-0", Some(s1), "20Gi", "44"),
                    ("small", "gpu-0", Some(s2), "10Gi", "22"),
                ],
                json!([]),
                &[],
            ))
            .unwrap(),
        answer
    );

    driver.unprepare(uid).unwrap();

    // The MPS class on a partial share: its limits bind the share's clients where stricter
    // than what the share consumed (25 % < 33 %; 8Gi < 20Gi), in the device's shared daemon.
    let strict = "7b000000-0000-4000-8000-000000000002";
    driver
        .prepare(&alloc_claim(
            strict,
            &[(
                "gpu",
                "gpu-0",
                Some("cccccccc-0000-4000-8000-00000000000c"),
                "20Gi",
                "44",
            )],
            class_mps_config(&["gpu"], 25, "8Gi"),
            &[],
        ))
        .unwrap();
    let text = cdi_text(&world, strict);
    for want in [
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M",
    ] {
        assert!(text.contains(want), "lacks {want}: {text}");
    }
    // A looser class limit does not raise what the share consumed.
    let loose = "7c000000-0000-4000-8000-000000000003";
    driver
        .prepare(&alloc_claim(
            loose,
            &[(
                "gpu",
                "gpu-0",
                Some("dddddddd-0000-4000-8000-00000000000d"),
                "10Gi",
                "22",
            )],
            class_mps_config(&["gpu"], 90, "40Gi"),
            &[],
        ))
        .unwrap();
    let text = cdi_text(&world, loose);
    assert!(
        text.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=16"),
        "{text}"
    );
    assert!(
        text.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M"),
        "{text}"
    );
    // A time-slicing block on a partial MPS share is not applied (logged): served by MPS.
    let ts = "7d000000-0000-4000-8000-000000000004";
    driver
        .prepare(&alloc_claim(
            ts,
            &[(
                "gpu",
                "gpu-0",
                Some("eeeeeeee-0000-4000-8000-00000000000e"),
                "4Gi",
                "10",
            )],
            class_ts_config(&["gpu"], "Long"),
            &[],
        ))
        .unwrap();
    assert!(cdi_text(&world, ts).contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=7"));
    assert!(
        !world
            .smi_lines()
            .iter()
            .any(|l| l.contains("--set-timeslice"))
    );
    // One daemon for the three shares (the first claim's stopped with its unprepare).
    assert_eq!(world.started_pids().len(), 2, "{:?}", world.mps_lines());
    for uid in [strict, loose, ts] {
        driver.unprepare(uid).unwrap();
    }
    world.assert_nothing_left();
}

fn over_committing_allocations_are_refused_naming_the_figures() {
    let world = World::new();
    let driver = start_share_driver(&world, ConsumableCapacity::Mps, &[]);
    // One share beyond its device.
    for (memory, sms, want) in [
        ("200Gi", "44", "memory 204800Mi of 81920Mi"),
        ("20Gi", "999", "multiprocessors 999 of 132"),
    ] {
        let err = driver
            .prepare(&alloc_claim(
                "8a000000-0000-4000-8000-000000000001",
                &[(
                    "gpu",
                    "gpu-0",
                    Some("aaaaaaaa-0000-4000-8000-00000000000a"),
                    memory,
                    sms,
                )],
                json!([]),
                &[],
            ))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("over-commit") && err.contains(want) && err.contains("gpu-0"),
            "{err}"
        );
    }
    assert!(world.started_pids().is_empty());
    // Shares whose sum exceeds the device: the second of two 50Gi shares.
    let first = "8b000000-0000-4000-8000-000000000002";
    driver
        .prepare(&alloc_claim(
            first,
            &[(
                "gpu",
                "gpu-0",
                Some("bbbbbbbb-0000-4000-8000-00000000000b"),
                "50Gi",
                "60",
            )],
            json!([]),
            &[],
        ))
        .unwrap();
    let second = "8c000000-0000-4000-8000-000000000003";
    let err = driver
        .prepare(&alloc_claim(
            second,
            &[(
                "gpu",
                "gpu-0",
                Some("cccccccc-0000-4000-8000-00000000000c"),
                "50Gi",
                "60",
            )],
            json!([]),
            &[],
        ))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("over-commit") && err.contains("memory 102400Mi of 81920Mi"),
        "{err}"
    );
    // Nothing of the refused claim is left: no record, no CDI spec; the first share runs on.
    assert!(cdi_text(&world, second).is_empty());
    let data = CheckpointStore::in_dir(&world.state).load().unwrap();
    assert!(!data.claims.contains_key(second));
    assert_eq!(world.started_pids().len(), 1);
    driver.unprepare(first).unwrap();
    world.assert_nothing_left();
}

fn admin_access_is_prepared_beside_other_claims_and_touches_nothing() {
    let world = World::new();
    let driver = start_share_driver(&world, ConsumableCapacity::Mps, &[]);
    // gpu-0 is held by an MPS claim of its own; gpu-1 by shares.
    let owner = "9a000000-0000-4000-8000-000000000001";
    driver
        .prepare(&mps_claim(owner, "gpu-0", 40, "8Gi"))
        .unwrap();
    let sharer = "9b000000-0000-4000-8000-000000000002";
    driver
        .prepare(&alloc_claim(
            sharer,
            &[(
                "gpu",
                "gpu-1",
                Some("aaaaaaaa-0000-4000-8000-00000000000a"),
                "20Gi",
                "44",
            )],
            json!([]),
            &[],
        ))
        .unwrap();
    let started = world.started_pids();
    assert_eq!(started.len(), 2);

    // A monitoring claim with admin access to both (and a sharing config it ignores).
    let monitor = "9c000000-0000-4000-8000-000000000003";
    let claim = alloc_claim(
        monitor,
        &[
            ("watch", "gpu-0", None, "", ""),
            (
                "watch",
                "gpu-1",
                Some("bbbbbbbb-0000-4000-8000-00000000000b"),
                "0",
                "0",
            ),
        ],
        class_mps_config(&["watch"], 10, "1Gi"),
        &["watch"],
    );
    let answer = driver.prepare(&claim).unwrap();
    assert_eq!(answer.devices.len(), 2);
    let text = cdi_text(&world, monitor);
    assert!(!text.contains("CUDA_MPS"), "{text}");
    assert!(
        text.contains("/dev/nvidia0") && text.contains("/dev/nvidia1"),
        "{text}"
    );
    let data = CheckpointStore::in_dir(&world.state).load().unwrap();
    assert!(data.claims[monitor].devices.iter().all(|d| d.admin_access));
    assert_eq!(
        world.started_pids(),
        started,
        "admin access started a daemon"
    );

    // Its unprepare touches none of the others' state.
    let owner_spec = cdi_text(&world, owner);
    driver.unprepare(monitor).unwrap();
    assert_eq!(cdi_text(&world, owner), owner_spec);
    for pid in &started {
        assert!(alive(*pid));
    }
    // And the others unprepare as ever.
    driver.unprepare(owner).unwrap();
    driver.unprepare(sharer).unwrap();
    world.assert_nothing_left();

    // An on-demand MIG placement nobody created is refused with the reason; one that
    // exists (static) is served.
    let err = driver
        .prepare(&alloc_claim(
            "9d000000-0000-4000-8000-000000000004",
            &[("watch", "gpu-3-mig-1g10gb-0", None, "", "")],
            json!([]),
            &["watch"],
        ))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("admin access") || err.contains("on-demand MIG is off"),
        "{err}"
    );
}
