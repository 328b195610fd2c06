//! Crash consistency: the driver is killed (SIGKILL, a real crash) at every fault point of
//! prepare, unprepare, start-up rollback and post-reboot recreation, restarted, and the
//! kubelet's call is replayed (shares of one GPU under `--consumable-capacity mps` too: two
//! and three shares served by one MPS daemon, and the unprepare of one share while the
//! others stay; two shares of one on-demand MIG placement, which share one instance and one
//! daemon, prepared, the creating one unprepared, and recreated after a reboot; a whole GPU
//! and per-claim MPS under `off`; two time-sliced shares of one GPU under `time-slicing`,
//! prepared, unprepared and recreated after a reboot; all on an on-demand MIG node); then the
//! hardware (mock NVML state file), the MPS daemons, compute modes and time slices (fake
//! tools), the CDI root and the checkpoint must agree with each other and with the set of
//! claims that should be prepared: nothing orphaned, nothing lost. Every recovered state
//! is then unprepared and must leave nothing behind.
//!
//! Points are not hard-coded: each scenario runs once with `CLEAVE_FAULT_LIST` set, and every
//! `(point, n-th hit)` it reports becomes one kill run (`CLEAVE_FAULT_KILL_AT=point#n`). One
//! "world" (temp dir: state dir, CDI root, mock NVML state, fake tools) per kill run; children
//! are this executable (roles chosen by `CRASH_ROLE`), which also plays the fake
//! `nvidia-cuda-mps-control` and `nvidia-smi` (`cleave_fakes::dispatch`). Prints
//! `kill points exercised: N, invariants checked: M`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cleave_api::names::DRIVER_NAME;
use cleave_api::pool::ConsumableCapacity;
use cleave_driver::cdi;
use cleave_driver::checkpoint::{CheckpointStore, ClaimState, ShareRecord};
use cleave_driver::fault;
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::prepare::{DriverConfig, NodeDriver, shared_daemon_key};
use cleave_driver::sharing::{SharingConfig, SharingManager, SharingState};
use cleave_fakes::mps_control::ENV_IDLE_EXIT_SECS;
use cleave_testkit::fake_tools::NodeTools;
use cleave_testkit::process::{alive, wait_dead};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;

const ROLE_ENV: &str = "CRASH_ROLE";
const WORLD_ENV: &str = "CRASH_WORLD";
const SCENARIO_ENV: &str = "CRASH_SCENARIO";
const PROFILE: &str = "h100-80gb-x8";
const CHILD_TIMEOUT: Duration = Duration::from_secs(60);
const WORKERS: usize = 3;

/// The mock NVML library, copied once into the harness's temp dir (so a rebuild of the
/// original during the run does not disturb it).
static MOCK_LIB: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

const WHOLE: &str = "c0000001-0000-4000-8000-000000000001";
const MIG: &str = "c0000002-0000-4000-8000-000000000002";
const MPS: &str = "c0000003-0000-4000-8000-000000000003";
const MPS_WHOLE: &str = "c0000004-0000-4000-8000-000000000004";
const SHARE_A: &str = "c0000005-0000-4000-8000-000000000005";
const SHARE_B: &str = "c0000006-0000-4000-8000-000000000006";
const SHARE_C: &str = "c0000007-0000-4000-8000-000000000007";
/// The GPU the shares are of (on a node without MIG).
const SHARED_GPU: &str = "gpu-4";
const MIG_SHARE_A: &str = "c0000008-0000-4000-8000-000000000008";
const MIG_SHARE_B: &str = "c0000009-0000-4000-8000-000000000009";
/// A whole-device share with an MPS config (the MPS class on an `mps` node): a daemon of
/// its own, as on a node without consumable capacity.
const WHOLE_SHARE_MPS: &str = "c000000a-0000-4000-8000-00000000000a";
/// Two requests placed on one GPU: one CDI device with the summed limits.
const TWO_IN_ONE: &str = "c000000b-0000-4000-8000-00000000000b";
/// Admin access to the GPU of MPS_WHOLE: prepared beside it, nothing applied.
const ADMIN: &str = "c000000c-0000-4000-8000-00000000000c";
/// The on-demand MIG placement the MIG shares are of (3g.40gb: 60 SMs, so 20 SMs is 33 %).
const SHARED_MIG: &str = "gpu-5-mig-3g40gb-4";
/// Two shares of SHARED_GPU on a `time-slicing` node, each asking the `Long` slice: no
/// daemon, the GPU's slice set while either is prepared.
const SLICE_A: &str = "c000000d-0000-4000-8000-00000000000d";
const SLICE_B: &str = "c000000e-0000-4000-8000-00000000000e";
/// The value `nvidia-smi compute-policy --set-timeslice` takes for `Long`.
const LONG_SLICE: &str = "3";

// ---------------------------------------------------------------------------------------
// Scenarios

/// A claim: UID, (request, device) pairs, opaque parameters (one config for all requests).
struct ClaimDef {
    uid: &'static str,
    devices: &'static [(&'static str, &'static str)],
    mps: bool,
    /// The allocation's shareID (consumable capacity: what [`share_consumed`] says).
    share: Option<&'static str>,
    /// The share consumed the whole device (a claim that asked no capacity).
    whole: bool,
    /// A second request the allocator placed on the same device, with this shareID.
    second_share: Option<&'static str>,
    /// Allocated with admin access.
    admin: bool,
    /// Carries a time-slicing config (interval `Long`), applied on a `time-slicing` node.
    timeslice: bool,
}

const CLAIMS: [ClaimDef; 14] = [
    ClaimDef {
        uid: WHOLE,
        devices: &[("gpu", "gpu-0")],
        mps: false,
        share: None,
        whole: false,
        second_share: None,
        admin: false,
        timeslice: false,
    },
    ClaimDef {
        uid: MIG,
        devices: &[
            ("small", "gpu-1-mig-1g10gb-0"),
            ("big", "gpu-1-mig-3g40gb-4"),
        ],
        mps: false,
        share: None,
        whole: false,
        second_share: None,
        admin: false,
        timeslice: false,
    },
    ClaimDef {
        uid: MPS,
        devices: &[("gpu", "gpu-2-mig-2g20gb-2")],
        mps: true,
        share: None,
        whole: false,
        second_share: None,
        admin: false,
        timeslice: false,
    },
    // On a node without MIG: MPS on a whole GPU switches its compute mode.
    ClaimDef {
        uid: MPS_WHOLE,
        devices: &[("gpu", "gpu-3")],
        mps: true,
        share: None,
        whole: false,
        second_share: None,
        admin: false,
        timeslice: false,
    },
    ClaimDef {
        uid: SHARE_A,
        devices: &[("gpu", SHARED_GPU)],
        mps: false,
        share: Some("5a000000-0000-4000-8000-00000000000a"),
        whole: false,
        second_share: None,
        admin: false,
        timeslice: false,
    },
    ClaimDef {
        uid: SHARE_B,
        devices: &[("gpu", SHARED_GPU)],
        mps: false,
        share: Some("5b000000-0000-4000-8000-00000000000b"),
        whole: false,
        second_share: None,
        admin: false,
        timeslice: false,
    },
    ClaimDef {
        uid: SHARE_C,
        devices: &[("gpu", SHARED_GPU)],
        mps: false,
        share: Some("5c000000-0000-4000-8000-00000000000c"),
        whole: false,
        second_share: None,
        admin: false,
        timeslice: false,
    },
    ClaimDef {
        uid: MIG_SHARE_A,
        devices: &[("gpu", SHARED_MIG)],
        mps: false,
        share: Some("5d000000-0000-4000-8000-00000000000d"),
        whole: false,
        second_share: None,
        admin: false,
        timeslice: false,
    },
    ClaimDef {
        uid: MIG_SHARE_B,
        devices: &[("gpu", SHARED_MIG)],
        mps: false,
        share: Some("5e000000-0000-4000-8000-00000000000e"),
        whole: false,
        second_share: None,
        admin: false,
        timeslice: false,
    },
    ClaimDef {
        uid: WHOLE_SHARE_MPS,
        devices: &[("gpu", "gpu-6")],
        mps: true,
        share: Some("5f000000-0000-4000-8000-00000000000f"),
        whole: true,
        second_share: None,
        admin: false,
        timeslice: false,
    },
    ClaimDef {
        uid: TWO_IN_ONE,
        devices: &[("gpu", SHARED_GPU)],
        mps: false,
        share: Some("60000000-0000-4000-8000-000000000010"),
        whole: false,
        second_share: Some("61000000-0000-4000-8000-000000000011"),
        admin: false,
        timeslice: false,
    },
    ClaimDef {
        uid: ADMIN,
        devices: &[("watch", "gpu-3")],
        mps: false,
        share: None,
        whole: false,
        second_share: None,
        admin: true,
        timeslice: false,
    },
    ClaimDef {
        uid: SLICE_A,
        devices: &[("gpu", SHARED_GPU)],
        mps: false,
        share: Some("62000000-0000-4000-8000-000000000012"),
        whole: false,
        second_share: None,
        admin: false,
        timeslice: true,
    },
    ClaimDef {
        uid: SLICE_B,
        devices: &[("gpu", SHARED_GPU)],
        mps: false,
        share: Some("63000000-0000-4000-8000-000000000013"),
        whole: false,
        second_share: None,
        admin: false,
        timeslice: true,
    },
];

/// What a share consumed (memory, SMs): two shares of the 3g.40gb (40448Mi, 60 SMs) fit it,
/// three of the H100 (132 SMs) fit it.
fn share_consumed(def: &ClaimDef) -> (&'static str, u32, u64) {
    if def.whole {
        // The mock H100 80GB HBM3: 81559Mi, 132 SMs (the request policies' defaults).
        ("81559Mi", 132, 81559)
    } else if def.devices[0].1 == SHARED_MIG {
        ("16Gi", 20, 16384)
    } else {
        ("20Gi", 44, 20480)
    }
}

/// The thread percentage a share's CDI spec must carry: its SMs of its device's.
fn share_percentage(def: &ClaimDef) -> u32 {
    let (_, mut sms, _) = share_consumed(def);
    if def.second_share.is_some() {
        sms *= 2;
    }
    if def.devices[0].1 == SHARED_MIG {
        sms * 100 / 60
    } else {
        sms * 100 / 132
    }
}

/// The CDI device name (device part) of a claim's device.
fn cdi_device(def: &ClaimDef, device: &str) -> String {
    match def.share {
        Some(share) => cdi::share_device_name(device, share),
        None => device.to_owned(),
    }
}

fn claim_def(uid: &str) -> &'static ClaimDef {
    CLAIMS.iter().find(|c| c.uid == uid).unwrap()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Prepare,
    Unprepare,
    /// Node rebooted after `setup`; the kubelet replays prepare.
    PrepareAfterReboot,
    /// `setup` was killed in the middle of prepare; the restart must roll it back (and may
    /// crash while doing so), then the kubelet replays prepare.
    PrepareAfterCrash,
    /// All claims prepared by `setup`; the first one is unprepared, the others stay.
    UnprepareFirst,
    /// All claims prepared by `setup`, then every MPS daemon killed: start restarts them
    /// and refreshes the claims (the refresh apply path), then the kubelet replays prepare.
    PrepareAfterDaemonsDied,
}

struct Scenario {
    name: &'static str,
    claims: &'static [&'static str],
    action: Action,
    /// Mock NVML settings of the node.
    env: &'static [(&'static str, &'static str)],
    /// The node's `--consumable-capacity` mode.
    capacity: ConsumableCapacity,
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "prepare-whole-gpu",
        claims: &[WHOLE],
        action: Action::Prepare,
        env: &[],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "prepare-mig-1g-3g",
        claims: &[MIG],
        action: Action::Prepare,
        env: &[],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "prepare-mps",
        claims: &[MPS],
        action: Action::Prepare,
        env: &[],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "unprepare-whole-gpu",
        claims: &[WHOLE],
        action: Action::Unprepare,
        env: &[],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "unprepare-mig-1g-3g",
        claims: &[MIG],
        action: Action::Unprepare,
        env: &[],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "unprepare-mps",
        claims: &[MPS],
        action: Action::Unprepare,
        env: &[],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "recreate-after-reboot",
        claims: &[MIG, MPS],
        action: Action::PrepareAfterReboot,
        env: &[],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "prepare-mps-whole-gpu-no-mig",
        claims: &[MPS_WHOLE],
        action: Action::Prepare,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "unprepare-mps-whole-gpu-no-mig",
        claims: &[MPS_WHOLE],
        action: Action::Unprepare,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "prepare-two-shares",
        claims: &[SHARE_A, SHARE_B],
        action: Action::Prepare,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "prepare-three-shares",
        claims: &[SHARE_A, SHARE_B, SHARE_C],
        action: Action::Prepare,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "unprepare-two-shares",
        claims: &[SHARE_A, SHARE_B],
        action: Action::Unprepare,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "unprepare-one-of-three-shares",
        claims: &[SHARE_A, SHARE_B, SHARE_C],
        action: Action::UnprepareFirst,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "recreate-shares-after-reboot",
        claims: &[SHARE_A, SHARE_B, SHARE_C],
        action: Action::PrepareAfterReboot,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Mps,
    },
    // Two shares of one on-demand MIG placement: one instance, one daemon for both.
    Scenario {
        name: "prepare-two-mig-shares",
        claims: &[MIG_SHARE_A, MIG_SHARE_B],
        action: Action::Prepare,
        env: &[],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "unprepare-first-of-two-mig-shares",
        claims: &[MIG_SHARE_A, MIG_SHARE_B],
        action: Action::UnprepareFirst,
        env: &[],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "recreate-mig-shares-after-reboot",
        claims: &[MIG_SHARE_A, MIG_SHARE_B],
        action: Action::PrepareAfterReboot,
        env: &[],
        capacity: ConsumableCapacity::Mps,
    },
    // Cells of the one sharing model.
    Scenario {
        name: "prepare-whole-share-with-mps-config",
        claims: &[WHOLE_SHARE_MPS],
        action: Action::Prepare,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "unprepare-whole-share-with-mps-config",
        claims: &[WHOLE_SHARE_MPS],
        action: Action::Unprepare,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "prepare-two-shares-in-one-claim-beside-a-share",
        claims: &[SHARE_A, TWO_IN_ONE],
        action: Action::Prepare,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "unprepare-share-beside-two-in-one-claim",
        claims: &[SHARE_A, TWO_IN_ONE],
        action: Action::UnprepareFirst,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "prepare-admin-access-beside-mps",
        claims: &[MPS_WHOLE, ADMIN],
        action: Action::Prepare,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "unprepare-admin-access-beside-mps",
        claims: &[ADMIN, MPS_WHOLE],
        action: Action::UnprepareFirst,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "refresh-mps-after-its-daemon-died",
        claims: &[MPS],
        action: Action::PrepareAfterDaemonsDied,
        env: &[],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "refresh-shares-after-their-daemon-died",
        claims: &[SHARE_A, SHARE_B],
        action: Action::PrepareAfterDaemonsDied,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Mps,
    },
    Scenario {
        name: "restart-after-crash-in-prepare",
        claims: &[MIG, MPS],
        action: Action::PrepareAfterCrash,
        env: &[],
        capacity: ConsumableCapacity::Mps,
    },
    // Consumable capacity off: devices go to one claim at a time; a per-claim MPS config
    // still gets a daemon of its own and the GPU's compute mode.
    Scenario {
        name: "prepare-whole-gpu-capacity-off",
        claims: &[WHOLE],
        action: Action::Prepare,
        env: &[],
        capacity: ConsumableCapacity::Off,
    },
    Scenario {
        name: "unprepare-whole-gpu-capacity-off",
        claims: &[WHOLE],
        action: Action::Unprepare,
        env: &[],
        capacity: ConsumableCapacity::Off,
    },
    Scenario {
        name: "prepare-mps-whole-gpu-capacity-off",
        claims: &[MPS_WHOLE],
        action: Action::Prepare,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Off,
    },
    Scenario {
        name: "unprepare-mps-whole-gpu-capacity-off",
        claims: &[MPS_WHOLE],
        action: Action::Unprepare,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::Off,
    },
    // Time-slicing: shares of one GPU run time-sliced, no daemon; their slice is the GPU's.
    Scenario {
        name: "prepare-two-time-sliced-shares",
        claims: &[SLICE_A, SLICE_B],
        action: Action::Prepare,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::TimeSlicing,
    },
    Scenario {
        name: "unprepare-two-time-sliced-shares",
        claims: &[SLICE_A, SLICE_B],
        action: Action::Unprepare,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::TimeSlicing,
    },
    Scenario {
        name: "unprepare-first-of-two-time-sliced-shares",
        claims: &[SLICE_A, SLICE_B],
        action: Action::UnprepareFirst,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::TimeSlicing,
    },
    Scenario {
        name: "recreate-time-sliced-shares-after-reboot",
        claims: &[SLICE_A, SLICE_B],
        action: Action::PrepareAfterReboot,
        env: &[("MOCK_NVML_MIG", "off")],
        capacity: ConsumableCapacity::TimeSlicing,
    },
];

fn scenario_index(s: &Scenario) -> usize {
    SCENARIOS.iter().position(|x| x.name == s.name).unwrap()
}

fn scenario(name: &str) -> &'static Scenario {
    SCENARIOS.iter().find(|s| s.name == name).unwrap()
}

fn claim(def: &ClaimDef) -> ResourceClaim {
    let results: Vec<_> = def
        .devices
        .iter()
        .map(|(request, device)| {
            let mut r = json!({"request": request, "driver": DRIVER_NAME, "pool": "node-a", "device": device});
            if let Some(share) = def.share {
                r["shareID"] = json!(share);
                let (memory, sms, _) = share_consumed(def);
                r["consumedCapacity"] = json!({"memory": memory, "multiprocessors": sms.to_string()});
            }
            if def.admin {
                r["adminAccess"] = json!(true);
            }
            r
        })
        .collect();
    let mut results = results;
    if let Some(second) = def.second_share {
        let mut r = results[0].clone();
        r["request"] = json!("second");
        r["shareID"] = json!(second);
        results.push(r);
    }
    let requests: Vec<_> = def.devices.iter().map(|(r, _)| *r).collect();
    let kind = if def.devices[0].1.contains("-mig-") {
        "MigConfig"
    } else {
        "GpuConfig"
    };
    let config = if def.mps {
        json!([{"source": "FromClaim", "requests": requests, "opaque": {
            "driver": DRIVER_NAME, "parameters": {
                "apiVersion": "gpu.cleave.dev/v1alpha1", "kind": kind,
                "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 25}}}}}])
    } else if def.timeslice {
        json!([{"source": "FromClaim", "requests": requests, "opaque": {
            "driver": DRIVER_NAME, "parameters": {
                "apiVersion": "gpu.cleave.dev/v1alpha1", "kind": kind,
                "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}}}}])
    } else {
        json!([])
    };
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": format!("claim-{}", &def.uid[..8]), "namespace": "default", "uid": def.uid},
        "spec": {"devices": {}},
        "status": {"allocation": {"devices": {"results": results, "config": config}}}
    }))
    .unwrap()
}

// ---------------------------------------------------------------------------------------
// A world: one node in a temp dir

struct World {
    root: PathBuf,
    tools: NodeTools,
    /// The node's `--consumable-capacity` mode (its scenario's).
    capacity: ConsumableCapacity,
}

impl World {
    fn create(root: PathBuf, capacity: ConsumableCapacity) -> Self {
        let tools = NodeTools::install(&root);
        common::lay_out_driver_root(&root.join("driver-root"));
        World {
            root,
            tools,
            capacity,
        }
    }

    fn state(&self) -> PathBuf {
        self.root.join("state")
    }
    fn cdi(&self) -> PathBuf {
        self.root.join("cdi")
    }
    fn nvml_state(&self) -> PathBuf {
        self.root.join("nvml-state.json")
    }
    fn boot(&self) -> String {
        std::fs::read_to_string(self.root.join("boot_id"))
            .unwrap()
            .trim()
            .to_owned()
    }

    fn driver_config(&self) -> DriverConfig {
        DriverConfig {
            consumable_capacity: self.capacity,
            ..common::node_config(&self.root, self.state())
        }
    }

    fn sharing_config(&self) -> SharingConfig {
        let mut config = self
            .tools
            .sharing_config(&self.state(), &[(ENV_IDLE_EXIT_SECS, "60")]);
        config.pipe_root = Some(self.root.join("run"));
        config
    }

    /// PIDs of every daemon the fake started in this world.
    fn started_pids(&self) -> Vec<u32> {
        self.tools.files.started_pids()
    }

    fn kill_daemons(&self) {
        for pid in self.started_pids() {
            if alive(pid) {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
                wait_dead(pid, Duration::from_secs(5));
            }
        }
    }

    /// Simulates a reboot: processes end, GPU settings reset, MIG instances (new mock boot
    /// ID) and CDI specs (tmpfs) are gone, the kernel boot ID changes.
    fn reboot(&self) {
        self.kill_daemons();
        let _ = std::fs::remove_file(self.tools.files.smi_state());
        if let Ok(entries) = std::fs::read_dir(self.cdi()) {
            for e in entries.flatten() {
                std::fs::remove_file(e.path()).unwrap();
            }
        }
        std::fs::write(self.root.join("boot_id"), "boot-2\n").unwrap();
    }

    /// Runs this executable as `role` in this world; returns its exit status and output.
    fn run(&self, role: &str, scenario: &str, extra: &[(&str, String)]) -> (ExitStatus, String) {
        let log = self.root.join(format!("{role}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.env(ROLE_ENV, role)
            .env(WORLD_ENV, &self.root)
            .env(SCENARIO_ENV, scenario)
            .env("MOCK_NVML_LIB", MOCK_LIB.get().unwrap())
            .env("MOCK_NVML_STATE", self.nvml_state())
            .env("MOCK_NVML_PROFILE", PROFILE)
            .env("MOCK_NVML_BOOT_ID", self.boot())
            .env_remove("MOCK_NVML_CONFIG")
            .env_remove("MOCK_NVML_FAIL")
            .env_remove("MOCK_NVML_CONTROL")
            .env_remove("MOCK_NVML_MIG")
            .envs(self::scenario(scenario).env.iter().copied())
            .env_remove(fault::KILL_AT_ENV)
            .env_remove(fault::LIST_ENV)
            .env_remove(fault::ERROR_AT_ENV)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let status = cleave_testkit::process::wait_or_kill(
            &mut child,
            CHILD_TIMEOUT,
            &format!("{scenario} {role}"),
        );
        (status, std::fs::read_to_string(&log).unwrap_or_default())
    }

    fn run_ok(&self, role: &str, scenario: &str) {
        let (status, output) = self.run(role, scenario, &[]);
        assert!(
            status.success(),
            "{scenario}: {role} failed ({status})\n{output}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Child roles

fn child(role: &str) {
    let root = PathBuf::from(std::env::var(WORLD_ENV).unwrap());
    let scenario = scenario(&std::env::var(SCENARIO_ENV).unwrap());
    let world = World {
        tools: NodeTools::at(&root),
        root,
        capacity: scenario.capacity,
    };
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .try_init();
    let lib = PathBuf::from(std::env::var("MOCK_NVML_LIB").unwrap());
    let backend = Arc::new(NvmlBackend::open(Some(&lib)).unwrap());
    let manager = Arc::new(SharingManager::new(world.sharing_config()));
    let driver = NodeDriver::start_with_sharing(world.driver_config(), backend, manager).unwrap();
    let prepare_all = || {
        for uid in scenario.claims {
            let def = claim_def(uid);
            let answer = driver.prepare(&claim(def)).unwrap();
            let ids: Vec<String> = answer
                .devices
                .iter()
                .flat_map(|d| d.cdi_device_ids.clone())
                .collect();
            let mut want: Vec<String> = def
                .devices
                .iter()
                .map(|(_, d)| cdi::qualified_device_id(uid, &cdi_device(def, d)))
                .collect();
            // Two shares of one device: one entry per shareID, one CDI device.
            if def.second_share.is_some() {
                want.push(want[0].clone());
            }
            assert_eq!(ids, want, "{uid}");
        }
    };
    let unprepare_all = || {
        for uid in scenario.claims {
            driver.unprepare(uid).unwrap();
        }
    };
    match (role, scenario.action) {
        ("setup", _) => prepare_all(),
        (
            "act" | "replay",
            Action::Prepare
            | Action::PrepareAfterReboot
            | Action::PrepareAfterCrash
            | Action::PrepareAfterDaemonsDied,
        ) => prepare_all(),
        ("act" | "replay", Action::Unprepare) => unprepare_all(),
        ("act" | "replay", Action::UnprepareFirst) => {
            driver.unprepare(scenario.claims[0]).unwrap();
        }
        ("cleanup", _) => unprepare_all(),
        other => panic!("unknown role {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Invariants

/// PIDs of the daemons the fake started that later received a limit set on their pipe
/// directory (the fake records `start pid=<pid> pipe=<dir> ...` and `cmd pipe=<dir> <cmd>`).
fn configured_daemons(lines: &[String]) -> BTreeSet<u32> {
    let mut latest: BTreeMap<String, u32> = BTreeMap::new();
    let mut configured = BTreeSet::new();
    for line in lines {
        if let Some(rest) = line.strip_prefix("start pid=") {
            let mut fields = rest.split(' ');
            let pid = fields.next().and_then(|p| p.parse().ok());
            let pipe = fields.next().and_then(|p| p.strip_prefix("pipe="));
            if let (Some(pid), Some(pipe)) = (pid, pipe) {
                latest.insert(pipe.to_owned(), pid);
            }
        } else if let Some(rest) = line.strip_prefix("cmd pipe=")
            && let Some((pipe, cmd)) = rest.split_once(' ')
            && cmd.starts_with("set_default_active_thread_percentage ")
            && let Some(pid) = latest.get(pipe)
        {
            configured.insert(*pid);
        }
    }
    configured
}

/// Checks that hardware, daemons, CDI root and checkpoint agree with `expected` (claim
/// UIDs that must be prepared). Returns the number of invariants checked.
fn check_invariants(world: &World, expected: &BTreeSet<&str>, ctx: &str) -> usize {
    let mut checked = 0;
    let mut check = |ok: bool, what: String| {
        assert!(ok, "{ctx}: {what}");
        checked += 1;
    };

    // Checkpoint: exactly the expected claims, all prepared.
    let data = CheckpointStore::in_dir(&world.state()).load().unwrap();
    let recorded: BTreeSet<&str> = data.claims.keys().map(String::as_str).collect();
    check(
        &recorded == expected,
        format!("checkpoint claims {recorded:?} != expected {expected:?}"),
    );
    check(
        data.claims
            .values()
            .all(|c| c.state == ClaimState::Prepared),
        format!(
            "checkpoint states {:?}",
            data.claims
                .values()
                .map(|c| (&c.uid, c.state))
                .collect::<Vec<_>>()
        ),
    );

    // No recreation intent is left once every claim is prepared.
    let intents: Vec<&str> = data
        .claims
        .values()
        .filter(|c| {
            c.devices
                .iter()
                .any(|d| d.mig.as_ref().is_some_and(|m| m.creating_in_boot.is_some()))
        })
        .map(|c| c.uid.as_str())
        .collect();
    check(
        intents.is_empty(),
        format!("claims {intents:?} still record a recreation intent"),
    );

    // Hardware: every MIG device (compute instance) is one recorded by a claim, at the
    // recorded placement, and every recorded one exists; no GPU instance without its CI.
    let hw = mock_nvml::state::read_state_file(&world.nvml_state())
        .unwrap()
        .unwrap_or_default();
    let mut on_hw: BTreeMap<String, (u32, u32, u32)> = BTreeMap::new();
    let mut bare_gis = 0;
    // A state file of an older boot holds instances the "hardware" no longer has.
    let gpus = if hw.boot_id == world.boot() {
        hw.gpus.as_slice()
    } else {
        &[]
    };
    for (index, gpu) in gpus.iter().enumerate() {
        for gi in &gpu.gpu_instances {
            if gi.compute_instances.is_empty() {
                bare_gis += 1;
            }
            for ci in &gi.compute_instances {
                on_hw.insert(ci.uuid.clone(), (index as u32, gi.start, gi.size));
            }
        }
    }
    check(
        bare_gis == 0,
        format!("{bare_gis} GPU instances without a compute instance"),
    );
    let mut in_checkpoint: BTreeMap<String, (u32, u32, u32)> = BTreeMap::new();
    for c in data.claims.values() {
        for d in &c.devices {
            if let Some(m) = &d.mig {
                let uuid = m.uuid.clone().unwrap_or_default();
                in_checkpoint.insert(uuid, (d.gpu_minor, m.placement.start, m.placement.size));
            }
        }
    }
    check(
        on_hw == in_checkpoint,
        format!("MIG devices on the hardware {on_hw:?} != recorded {in_checkpoint:?}"),
    );
    // The shares of one MIG device record one instance between them.
    let mut share_instances: BTreeMap<&str, BTreeSet<Option<String>>> = BTreeMap::new();
    for c in data.claims.values() {
        for d in c
            .devices
            .iter()
            .filter(|d| ShareRecord::partial(d.share.as_ref()).is_some())
        {
            if let Some(m) = &d.mig {
                share_instances
                    .entry(d.name.as_str())
                    .or_default()
                    .insert(m.uuid.clone());
            }
        }
    }
    check(
        share_instances
            .values()
            .all(|u| u.len() == 1 && !u.contains(&None)),
        format!("shares of a MIG device record other than one instance: {share_instances:?}"),
    );

    // Admin access records say so, and a claim never records another's MIG instance as its own.
    for c in data.claims.values() {
        let admin = claim_def(&c.uid).admin;
        check(
            c.devices.iter().all(|d| d.admin_access == admin),
            format!("claim {} records admin access {} wrongly", c.uid, !admin),
        );
    }

    // CDI root: one spec per prepared claim, nothing else; each names the recorded UUIDs.
    let files: BTreeSet<String> = std::fs::read_dir(world.cdi())
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let want: BTreeSet<String> = expected.iter().map(|u| cdi::spec_file_name(u)).collect();
    check(files == want, format!("CDI files {files:?} != {want:?}"));
    for c in data.claims.values() {
        let text = std::fs::read_to_string(world.cdi().join(cdi::spec_file_name(&c.uid)))
            .unwrap_or_default();
        for d in &c.devices {
            let uuid = d
                .mig
                .as_ref()
                .and_then(|m| m.uuid.clone())
                .unwrap_or_else(|| d.gpu_uuid.clone());
            check(
                text.contains(&uuid),
                format!("CDI spec of {} lacks {uuid}", c.uid),
            );
        }
    }

    // MPS: a running daemon (and its directory) for each prepared MPS claim, nothing else.
    let mps_dirs: BTreeSet<String> = std::fs::read_dir(world.state().join("mps"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let own_mps: BTreeSet<String> = expected
        .iter()
        .filter(|u| claim_def(u).mps)
        .map(|u| (*u).to_owned())
        .collect();
    // One shared daemon per device that any expected claim holds a share of, on an `mps`
    // node only (time-sliced shares have none).
    let mps_shares = world.capacity == ConsumableCapacity::Mps;
    let shared: BTreeSet<String> = expected
        .iter()
        .map(|u| claim_def(u))
        .filter(|d| mps_shares && d.share.is_some() && !d.whole && !d.admin)
        .flat_map(|d| {
            d.devices
                .iter()
                .map(|(_, dev)| shared_daemon_key(dev, "default"))
        })
        .collect();
    let want_mps: BTreeSet<String> = own_mps.union(&shared).cloned().collect();
    check(
        mps_dirs == want_mps,
        format!("MPS directories {mps_dirs:?} != {want_mps:?}"),
    );
    // Their pipe directories under the short pipe root, nothing else.
    let pipes: BTreeSet<PathBuf> = std::fs::read_dir(world.root.join("run"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    let want_pipes: BTreeSet<PathBuf> = want_mps
        .iter()
        .map(|k| cleave_driver::sharing::pipe_dir_under(&world.root.join("run"), &world.state(), k))
        .collect();
    check(
        pipes == want_pipes,
        format!("MPS pipe directories {pipes:?} != {want_pipes:?}"),
    );
    // Every restarted daemon's clients had their specs rewritten: no marker is left.
    for key in &want_mps {
        let marker = world.state().join("mps").join(key).join("clients-stale");
        check(
            !marker.exists(),
            format!("clients of MPS daemon {key} never refreshed after its restart"),
        );
    }
    let mut recorded_pids = BTreeSet::new();
    // Daemons whose limits differ from the daemon's defaults (100 %, no pinned limit):
    // only a set gives them, so each must have received one.
    let mut limited_pids = BTreeSet::new();
    for uid in &own_mps {
        // The checkpoint names the claim's daemon (its key, the claim UID); the daemon's
        // record, its `daemon.json`, says which process it is.
        let sharing: SharingState = data.claims[uid].sharing.clone().unwrap();
        check(
            sharing.mps_daemon.as_deref() == Some(uid.as_str()),
            format!("claim {uid} names daemon {:?}", sharing.mps_daemon),
        );
        let record = cleave_driver::sharing::daemon_record(&world.state(), uid)
            .unwrap()
            .unwrap_or_else(|| panic!("{ctx}: daemon of claim {uid} has no record"));
        // Every per-claim MPS claim here asks 25 %.
        check(
            record.active_thread_percentage == 25,
            format!(
                "daemon of claim {uid} records {} %, not 25",
                record.active_thread_percentage
            ),
        );
        let pid = record.daemon.unwrap().pid;
        recorded_pids.insert(pid);
        limited_pids.insert(pid);
    }
    for key in &shared {
        let record = cleave_driver::sharing::mps::load_record(&world.state().join("mps").join(key))
            .unwrap()
            .unwrap_or_else(|| panic!("{ctx}: shared daemon {key} has no record"));
        check(
            record.spec.multi_user && record.active_thread_percentage == 100,
            format!("shared daemon {key} is not multi-user with unlimited defaults"),
        );
        recorded_pids.insert(record.daemon.unwrap().pid);
    }
    // Each share's CDI spec carries its own client limits (what it consumed of its device)
    // on an `mps` node; elsewhere a share's spec has nothing of MPS.
    for uid in expected
        .iter()
        .filter(|u| !mps_shares && claim_def(u).share.is_some() && !claim_def(u).mps)
    {
        let text =
            std::fs::read_to_string(world.cdi().join(cdi::spec_file_name(uid))).unwrap_or_default();
        check(
            !text.is_empty() && !text.contains("CUDA_MPS"),
            format!(
                "CDI spec of share {uid} on a {} node carries MPS edits",
                world.capacity.as_str()
            ),
        );
    }
    for uid in expected
        .iter()
        .filter(|u| mps_shares && claim_def(u).share.is_some() && !claim_def(u).whole)
    {
        let text =
            std::fs::read_to_string(world.cdi().join(cdi::spec_file_name(uid))).unwrap_or_default();
        let pct = share_percentage(claim_def(uid));
        let (_, _, mut mib) = share_consumed(claim_def(uid));
        if claim_def(uid).second_share.is_some() {
            mib *= 2;
        }
        check(
            text.contains(&format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={pct}\""))
                && text.contains(&format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={mib}M")),
            format!("CDI spec of share {uid} lacks its client limits ({pct} %, {mib}M)"),
        );
    }
    let running: BTreeSet<u32> = world
        .started_pids()
        .into_iter()
        .filter(|p| alive(*p))
        .collect();
    check(
        running == recorded_pids,
        format!("running MPS daemons {running:?} != recorded {recorded_pids:?}"),
    );
    // Every running daemon with limits of its own got them after it started: one a crash
    // left before its limits were set is never kept as it is. (A shared daemon runs with
    // the defaults, which an unconfigured daemon holds too.)
    let configured = configured_daemons(&world.tools.files.mps_lines());
    for pid in running.intersection(&limited_pids) {
        check(
            configured.contains(pid),
            format!("MPS daemon {pid} runs without ever having its limits set"),
        );
    }

    // Compute modes: EXCLUSIVE_PROCESS exactly on whole GPUs of prepared per-claim MPS
    // claims (shares leave it alone: several namespaces' daemons may share a GPU).
    let smi = cleave_fakes::nvidia_smi::read_state(&world.tools.files.smi_state());
    let exclusive: BTreeSet<String> = smi
        .iter()
        .filter(|((_, key), value)| key == "computeMode" && *value == "EXCLUSIVE_PROCESS")
        .map(|((gpu, _), _)| gpu.clone())
        .collect();
    let want_exclusive: BTreeSet<String> = data
        .claims
        .values()
        .filter(|c| claim_def(&c.uid).mps)
        .flat_map(|c| &c.devices)
        .filter(|d| d.mig.is_none())
        .map(|d| d.gpu_uuid.clone())
        .collect();
    check(
        exclusive == want_exclusive,
        format!("EXCLUSIVE_PROCESS GPUs {exclusive:?} != {want_exclusive:?}"),
    );

    // Time slices: a GPU runs a non-default slice exactly while a prepared claim records
    // one on it (restored to the default when its last such claim goes, set again after a
    // reboot), and every prepared claim with a time-slicing config records its GPU's.
    let slices: BTreeMap<String, String> = smi
        .iter()
        .filter(|((_, key), value)| key == "timeslice" && *value != "0")
        .map(|((gpu, _), value)| (gpu.clone(), value.clone()))
        .collect();
    let mut want_slices: BTreeMap<String, String> = BTreeMap::new();
    for c in data.claims.values() {
        let sharing: SharingState = c.sharing.clone().unwrap_or_default();
        for t in &sharing.time_slicing {
            want_slices.insert(t.gpu_uuid.clone(), t.interval.timeslice_value().to_string());
        }
        if claim_def(&c.uid).timeslice {
            let gpus: BTreeSet<&str> = c.devices.iter().map(|d| d.gpu_uuid.as_str()).collect();
            let set: BTreeSet<&str> = sharing
                .time_slicing
                .iter()
                .filter(|t| t.interval.timeslice_value().to_string() == LONG_SLICE)
                .map(|t| t.gpu_uuid.as_str())
                .collect();
            check(
                set == gpus,
                format!(
                    "claim {} records time slices on {set:?}, not {gpus:?}",
                    c.uid
                ),
            );
        }
    }
    check(
        slices == want_slices,
        format!("GPU time slices {slices:?} != recorded {want_slices:?}"),
    );
    checked
}

// ---------------------------------------------------------------------------------------
// Harness

struct Totals {
    kill_points: AtomicUsize,
    invariants: AtomicUsize,
    /// Invariants checked per scenario.
    per_scenario: Mutex<BTreeMap<&'static str, usize>>,
    failures: Mutex<Vec<String>>,
}

impl Totals {
    fn add_invariants(&self, s: &Scenario, n: usize) {
        self.invariants.fetch_add(n, Ordering::Relaxed);
        *self.per_scenario.lock().unwrap().entry(s.name).or_insert(0) += n;
    }
}

fn new_world(base: &Path, name: &str, s: &Scenario) -> World {
    World::create(base.join(name), s.capacity)
}

fn prepared_after(s: &Scenario) -> BTreeSet<&'static str> {
    match s.action {
        Action::Prepare
        | Action::PrepareAfterReboot
        | Action::PrepareAfterCrash
        | Action::PrepareAfterDaemonsDied => s.claims.iter().copied().collect(),
        Action::Unprepare => BTreeSet::new(),
        Action::UnprepareFirst => s.claims[1..].iter().copied().collect(),
    }
}

fn before_act(world: &World, s: &Scenario) {
    if matches!(
        s.action,
        Action::Unprepare
            | Action::UnprepareFirst
            | Action::PrepareAfterReboot
            | Action::PrepareAfterDaemonsDied
    ) {
        world.run_ok("setup", s.name);
    }
    if s.action == Action::PrepareAfterDaemonsDied {
        assert!(
            !world.started_pids().is_empty(),
            "{}: setup started no MPS daemon",
            s.name
        );
        world.kill_daemons();
    }
    if s.action == Action::PrepareAfterReboot {
        world.reboot();
    }
    if s.action == Action::PrepareAfterCrash {
        // Killed after its MPS daemon started, before the answer: the second claim's prepare
        // leaves a MIG device, a daemon and a PrepareStarted record.
        let (status, output) = world.run(
            "setup",
            s.name,
            &[(fault::KILL_AT_ENV, "prepare.after_sharing_apply".to_owned())],
        );
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "{}: setup not killed ({status})\n{output}",
            s.name
        );
    }
}

/// Runs the scenario once with the point list on; returns `(point, n)` for every hit.
fn discover(base: &Path, s: &Scenario, totals: &Totals) -> Vec<(String, u64)> {
    // Short names: the fake daemon's socket path (…/mps/<uid>/pipe/control) must fit the
    // 108 bytes of a unix socket address.
    let world = new_world(base, &format!("d{}", scenario_index(s)), s);
    before_act(&world, s);
    let list = world.root.join("points.txt");
    let (status, output) = world.run(
        "act",
        s.name,
        &[(fault::LIST_ENV, list.display().to_string())],
    );
    assert!(status.success(), "{}: act failed\n{output}", s.name);
    let n = check_invariants(
        &world,
        &prepared_after(s),
        &format!("{} (no crash)", s.name),
    );
    totals.add_invariants(s, n);
    world.run_ok("cleanup", s.name);
    let n = check_invariants(&world, &BTreeSet::new(), &format!("{} cleanup", s.name));
    totals.add_invariants(s, n);
    world.kill_daemons();
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    let mut order = Vec::new();
    for line in std::fs::read_to_string(&list).unwrap_or_default().lines() {
        let n = counts.entry(line.to_owned()).or_insert(0);
        *n += 1;
        order.push((line.to_owned(), *n));
    }
    order
}

/// Runs the scenario killed at `point#n`, restarts and replays, checks the invariants,
/// cleans up and checks again; returns the number of invariants checked. Every kill point,
/// recreation after a reboot included (an instance created but not yet recorded is adopted
/// through its recorded intent), must end with every claim prepared and nothing orphaned.
fn kill_run(base: &Path, s: &Scenario, point: &str, n: u64, idx: usize) -> usize {
    let world = new_world(base, &format!("k{idx}"), s);
    let ctx = format!("{} killed at {point}#{n}", s.name);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        before_act(&world, s);
        let (status, output) = world.run(
            "act",
            s.name,
            &[(fault::KILL_AT_ENV, format!("{point}#{n}"))],
        );
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "{ctx}: act was not killed ({status})\n{output}"
        );
        let (status, output) = world.run("replay", s.name, &[]);
        assert!(
            status.success(),
            "{ctx}: replay failed ({status})\n{output}"
        );
        let mut checked = check_invariants(&world, &prepared_after(s), &ctx);
        world.run_ok("cleanup", s.name);
        checked += check_invariants(&world, &BTreeSet::new(), &format!("{ctx}, then cleanup"));
        checked
    }));
    world.kill_daemons();
    match result {
        Ok(outcome) => {
            let _ = std::fs::remove_dir_all(&world.root);
            outcome
        }
        Err(e) => std::panic::resume_unwind(e),
    }
}

fn run_harness() -> bool {
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().to_owned();
    let lib = base.join("libmock_nvml.so");
    std::fs::copy(mock_nvml::locate::cdylib_path().unwrap(), &lib).unwrap();
    MOCK_LIB.set(lib).unwrap();
    let totals = Totals {
        kill_points: AtomicUsize::new(0),
        invariants: AtomicUsize::new(0),
        per_scenario: Mutex::new(BTreeMap::new()),
        failures: Mutex::new(Vec::new()),
    };
    let mut jobs: Vec<(&'static Scenario, String, u64)> = Vec::new();
    let mut distinct: BTreeSet<String> = BTreeSet::new();
    // Per scenario: the kill runs and the distinct fault points it reaches.
    let mut reached: BTreeMap<&'static str, (usize, BTreeSet<String>)> = BTreeMap::new();
    for s in SCENARIOS {
        let points = discover(&base, s, &totals);
        println!("{}: {} kill points", s.name, points.len());
        reached.insert(
            s.name,
            (
                points.len(),
                points.iter().map(|(p, _)| p.clone()).collect(),
            ),
        );
        for (p, n) in points {
            distinct.insert(p.clone());
            jobs.push((s, p, n));
        }
    }
    let queue = Mutex::new(jobs.into_iter().enumerate().collect::<Vec<_>>());
    std::thread::scope(|scope| {
        for _ in 0..WORKERS {
            scope.spawn(|| {
                loop {
                    let Some((idx, (s, point, n))) = queue.lock().unwrap().pop() else {
                        break;
                    };
                    match std::panic::catch_unwind(|| kill_run(&base, s, &point, n, idx)) {
                        Ok(checked) => {
                            totals.kill_points.fetch_add(1, Ordering::Relaxed);
                            totals.add_invariants(s, checked);
                        }
                        Err(e) => {
                            let msg = e
                                .downcast_ref::<String>()
                                .cloned()
                                .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                                .unwrap_or_default();
                            totals
                                .failures
                                .lock()
                                .unwrap()
                                .push(format!("{} {point}#{n}: {msg}", s.name));
                        }
                    }
                }
            });
        }
    });
    let failures = totals.failures.into_inner().unwrap();
    println!(
        "kill points exercised: {}, invariants checked: {} ({} distinct points: {}) in {:.1?}",
        totals.kill_points.load(Ordering::Relaxed),
        totals.invariants.load(Ordering::Relaxed),
        distinct.len(),
        distinct.iter().cloned().collect::<Vec<_>>().join(", "),
        started.elapsed()
    );
    for f in &failures {
        println!("FAILED: {f}");
    }
    // The crash window of recreation (instance created, not yet recorded) must have been
    // exercised, or the harness proves nothing about it.
    let required = [
        "recreate.after_intent",
        "recreate.after_mig_create",
        "prepare.after_share_apply",
        "release.after_share_release",
        "recreate.after_share_apply",
        "refresh.after_sharing_apply",
        "refresh.after_share_apply",
    ];
    let missing: Vec<&str> = required
        .iter()
        .copied()
        .filter(|p| !distinct.contains(*p))
        .collect();
    if !missing.is_empty() {
        println!("FAILED: recreation points never reached: {missing:?}");
    }
    let per_scenario = totals.per_scenario.into_inner().unwrap();
    let table_ok = check_expected(&reached, &per_scenario);
    failures.is_empty() && missing.is_empty() && table_ok
}

/// The checked-in table of what the harness covers: one line per scenario with its kill
/// runs, the fault points it reaches and a floor on the invariants it checks.
const EXPECTED: &str = "tests/crash-expected.txt";

/// Compares the run with [`EXPECTED`]: a scenario added or removed, a fault point no longer
/// (or newly) reached, a changed number of kill runs, or fewer invariants than the floor
/// fails by name. `CLEAVE_UPDATE_EXPECTED=1` rewrites the table (review its diff).
fn check_expected(
    reached: &BTreeMap<&'static str, (usize, BTreeSet<String>)>,
    invariants: &BTreeMap<&'static str, usize>,
) -> bool {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(EXPECTED);
    let line = |name: &str, kills: usize, points: &BTreeSet<String>, floor: usize| {
        let points: Vec<&str> = points.iter().map(String::as_str).collect();
        format!(
            "{name}: {kills} kill runs; points {}; invariants >= {floor}",
            points.join(" ")
        )
    };
    if std::env::var_os("CLEAVE_UPDATE_EXPECTED").is_some_and(|v| v == "1") {
        let text: String = reached
            .iter()
            .map(|(name, (kills, points))| {
                let floor = invariants.get(name).copied().unwrap_or(0);
                line(name, *kills, points, floor) + "\n"
            })
            .collect();
        std::fs::write(&path, text).unwrap();
        println!("wrote {}", path.display());
        return true;
    }
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut want: BTreeMap<&str, (&str, usize)> = BTreeMap::new();
    for l in text.lines().filter(|l| !l.trim().is_empty()) {
        let (name, _) = l
            .split_once(':')
            .unwrap_or_else(|| panic!("bad line {l:?}"));
        let (shape, floor) = l
            .rsplit_once("; invariants >= ")
            .unwrap_or_else(|| panic!("bad line {l:?}"));
        let floor = floor
            .parse()
            .unwrap_or_else(|_| panic!("bad floor in {l:?}"));
        want.insert(name, (shape, floor));
    }
    let mut problems = Vec::new();
    for (name, (kills, points)) in reached {
        let got = invariants.get(name).copied().unwrap_or(0);
        let now = line(name, *kills, points, got);
        let (shape_now, _) = now.rsplit_once("; invariants >= ").unwrap_or((&now, ""));
        match want.get(name) {
            None => problems.push(format!("new scenario: {now}")),
            Some((shape, floor)) => {
                if *shape != shape_now {
                    problems.push(format!("{name}: expected {shape}\n    got {shape_now}"));
                }
                if got < *floor {
                    problems.push(format!(
                        "{name}: {got} invariants checked, fewer than the floor {floor}"
                    ));
                }
            }
        }
    }
    for name in want.keys() {
        if !reached.contains_key(*name) {
            problems.push(format!("scenario gone: {name}"));
        }
    }
    for p in &problems {
        println!("FAILED: {p}");
    }
    if problems.is_empty() {
        println!(
            "crash harness: {} scenarios, their fault points and invariant floors as in {EXPECTED}",
            reached.len()
        );
    } else {
        println!(
            "FAILED: the run differs from {EXPECTED} (CLEAVE_UPDATE_EXPECTED=1 rewrites it after review)"
        );
    }
    problems.is_empty()
}

fn main() -> std::process::ExitCode {
    // A fake tool first: the tools this process spawns inherit the role variable.
    let args: Vec<String> = std::env::args().collect();
    if let Some(code) = cleave_testkit::runner::play_fake_tool(&args) {
        std::process::exit(code);
    }
    if let Ok(role) = std::env::var(ROLE_ENV) {
        child(&role);
        return std::process::ExitCode::SUCCESS;
    }
    cleave_testkit::runner::main(&[("crash_consistency_at_every_fault_point", || {
        assert!(run_harness(), "crash consistency failed (see above)");
    })])
}
