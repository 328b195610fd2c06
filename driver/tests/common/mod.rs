//! Test support for driver integration tests that run against the mock NVML library.
//!
//! The mock reads its configuration (`MOCK_NVML_PROFILE`, `MOCK_NVML_STATE`,
//! `MOCK_NVML_FAIL`, ...) from the process environment when NVML is initialised, and the
//! environment is process-global. So each scenario runs in a child process: the test
//! re-executes its own binary with `--exact <test name>` and [`SCENARIO_ENV`] set, and the
//! child (seeing the variable) runs the scenario body instead of spawning.

#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cleave_api::names::DRIVER_NAME;
use cleave_driver::driver_root::DriverRootConfig;
use cleave_driver::model::{GpuInfo, NodeInventory};
use cleave_driver::prepare::DriverConfig;

pub mod harness;

/// Names the scenario a child process runs.
pub const SCENARIO_ENV: &str = "CLEAVE_TEST_SCENARIO";

/// The built-in node profiles of the mock.
pub const PROFILES: [&str; 5] = [
    "a100-40gb-x8",
    "a100-80gb-x4",
    "h100-80gb-x8",
    "h200-141gb-x8",
    "l4-x2",
];

/// Longest a scenario child may run.
pub const CHILD_TIMEOUT: Duration = Duration::from_secs(120);

/// Lays out a driver root like an Ubuntu host with 8 GPUs (minors 0..7): device nodes,
/// libraries with soname links, tools, `proc/devices` and `mig-minors`. Idempotent.
pub fn lay_out_driver_root(root: &Path) {
    mock_nvml::driver_root::DriverRootFixture::with_minors(0..8)
        .lay_out(root)
        .expect("laying out the test driver root");
}

/// Driver settings of a simulated node in `root` (pool `node-a`, dynamic MIG): driver and
/// dev root `root/driver-root`, proc root `root/proc`, CDI specs in `root/cdi`, boot ID
/// read from `root/boot_id` (the caller writes it), state in `state_dir`.
pub fn node_config(root: &Path, state_dir: PathBuf) -> DriverConfig {
    let driver_root = root.join("driver-root");
    lay_out_driver_root(&driver_root);
    DriverConfig {
        driver_name: DRIVER_NAME.into(),
        pool_name: "node-a".into(),
        state_dir,
        cdi_root: root.join("cdi"),
        driver_root: DriverRootConfig {
            root: driver_root.clone(),
            host_root: None,
            dev_root: Some(driver_root),
            proc_root: root.join("proc"),
        },
        dynamic_mig: true,
        boot_id_path: root.join("boot_id"),
        cdi_hook: None,
        consumable_capacity: Default::default(),
    }
}

/// The scenario this process must run, if it is a child.
pub fn scenario() -> Option<String> {
    std::env::var(SCENARIO_ENV).ok()
}

/// Path of the built mock NVML library (`libmock_nvml*.so` next to the test binary).
pub fn mock_lib() -> PathBuf {
    mock_nvml::locate::cdylib_path()
        .expect("mock NVML library not built (it is a dev-dependency of cleave-driver)")
}

/// Output of a finished child.
#[derive(Debug)]
pub struct ChildOutput {
    /// Exit success.
    pub success: bool,
    /// Standard output.
    pub stdout: String,
    /// Standard error (tracing logs go here).
    pub stderr: String,
}

/// Runs test `test_name` of this binary in a child process with `scenario` and the given
/// environment (plus a private state file unless `MOCK_NVML_STATE` is given), waits at most
/// [`CHILD_TIMEOUT`], and panics with the child's output if it failed.
pub fn run_child(test_name: &str, scenario: &str, env: &[(&str, &str)]) -> ChildOutput {
    let out = try_run_child(test_name, scenario, env);
    assert!(
        out.success,
        "scenario {scenario:?} of {test_name} failed\n--- stdout\n{}\n--- stderr\n{}",
        out.stdout, out.stderr
    );
    out
}

/// Like [`run_child`] but returns failures instead of panicking.
pub fn try_run_child(test_name: &str, scenario: &str, env: &[(&str, &str)]) -> ChildOutput {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("mock-nvml-state.json");
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test_name, "--nocapture", "--test-threads=1"])
        .env(SCENARIO_ENV, scenario)
        .env("MOCK_NVML_LIB", mock_lib())
        .env("MOCK_NVML_STATE", &state)
        .env("CLEAVE_TEST_TMP", dir.path())
        .env_remove("MOCK_NVML_PROFILE")
        .env_remove("MOCK_NVML_CONFIG")
        .env_remove("MOCK_NVML_FAIL")
        .env_remove("MOCK_NVML_CONTROL")
        .env_remove("MOCK_NVML_MIG")
        .env_remove("MOCK_NVML_DRIVER_MISSING")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut stdout_pipe = child.stdout.take().unwrap();
    let mut stderr_pipe = child.stderr.take().unwrap();
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout_pipe.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr_pipe.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + CHILD_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("scenario {scenario:?} of {test_name} timed out after {CHILD_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = out_t.join().unwrap();
    let stderr = err_t.join().unwrap();
    // Make sure the child really ran the test (not "0 tests" because of a wrong name).
    assert!(
        stdout.contains("1 passed") || stdout.contains("1 failed") || !status.success(),
        "child of {test_name} ran no test:\n{stdout}"
    );
    ChildOutput {
        success: status.success(),
        stdout,
        stderr,
    }
}

/// Private temp dir of this child (removed by the parent).
pub fn child_tmp() -> PathBuf {
    PathBuf::from(std::env::var("CLEAVE_TEST_TMP").unwrap())
}

/// Sends `tracing` output of this (child) process to stderr without colours, so that the
/// parent can check the warnings.
pub fn log_to_stderr() {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .try_init();
}

/// Expected identity of one product (device identity, docs/hardware-sources.md).
#[derive(Debug, Clone, Copy)]
pub struct ProductFacts {
    /// `nvmlDeviceGetName`.
    pub name: &'static str,
    /// Total memory (MiB).
    pub memory_mib: u64,
    /// Whole-GPU SMs.
    pub sms: u32,
    /// Compute capability.
    pub cc: (u32, u32),
    /// Architecture name.
    pub arch: &'static str,
    /// MIG profile rows.
    pub profiles: &'static [ProfileFacts],
}

/// One expected MIG profile (MIG profile tables, docs/hardware-sources.md): name, lgip id, slices, instances, memory MiB
/// (`None` where the source marks it driver-specific/UNVERIFIED), SMs, [CE, DEC, ENC, JPG,
/// OFA], placement starts, placement size.
#[derive(Debug, Clone, Copy)]
pub struct ProfileFacts {
    pub name: &'static str,
    pub id: u32,
    pub slices: u32,
    pub instances: u32,
    pub memory_mib: Option<u64>,
    pub sms: u32,
    pub engines: [u32; 5],
    pub starts: &'static [u32],
    pub size: u32,
}

const S1: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const S2Q: &[u32] = &[0, 2, 4, 6];
const S2: &[u32] = &[0, 2, 4];
const S3: &[u32] = &[0, 4];
const S0: &[u32] = &[0];

#[allow(clippy::too_many_arguments)]
const fn p(
    name: &'static str,
    id: u32,
    slices: u32,
    instances: u32,
    memory_mib: Option<u64>,
    sms: u32,
    engines: [u32; 5],
    starts: &'static [u32],
    size: u32,
) -> ProfileFacts {
    ProfileFacts {
        name,
        id,
        slices,
        instances,
        memory_mib,
        sms,
        engines,
        starts,
        size,
    }
}

/// A100-SXM4-40GB (MIG profile tables; memory differs between driver branches, so unchecked).
pub const A100_40GB: &[ProfileFacts] = &[
    p("1g.5gb", 19, 1, 7, None, 14, [1, 0, 0, 0, 0], S1, 1),
    p("1g.5gb+me", 20, 1, 1, None, 14, [1, 1, 0, 1, 1], S1, 1),
    p("1g.10gb", 15, 1, 4, None, 14, [1, 1, 0, 0, 0], S2Q, 2),
    p("2g.10gb", 14, 2, 3, None, 28, [2, 1, 0, 0, 0], S2, 2),
    p("3g.20gb", 9, 3, 2, None, 42, [3, 2, 0, 0, 0], S3, 4),
    p("4g.20gb", 5, 4, 1, None, 56, [4, 2, 0, 0, 0], S0, 4),
    p("7g.40gb", 0, 7, 1, None, 98, [7, 5, 0, 1, 1], S0, 8),
];

/// A100-SXM4-80GB (MIG profile tables; 1g.20gb engines as on 40GB, memory unchecked).
pub const A100_80GB: &[ProfileFacts] = &[
    p("1g.10gb", 19, 1, 7, Some(9728), 14, [1, 0, 0, 0, 0], S1, 1),
    p(
        "1g.10gb+me",
        20,
        1,
        1,
        Some(9728),
        14,
        [1, 1, 0, 1, 1],
        S1,
        1,
    ),
    p("1g.20gb", 15, 1, 4, None, 14, [1, 1, 0, 0, 0], S2Q, 2),
    p("2g.20gb", 14, 2, 3, Some(19968), 28, [2, 1, 0, 0, 0], S2, 2),
    p("3g.40gb", 9, 3, 2, None, 42, [3, 2, 0, 0, 0], S3, 4),
    p("4g.40gb", 5, 4, 1, None, 56, [4, 2, 0, 0, 0], S0, 4),
    p("7g.80gb", 0, 7, 1, Some(81152), 98, [7, 5, 0, 1, 1], S0, 8),
];

/// H100 80GB HBM3 (MIG profile tables).
pub const H100_80GB: &[ProfileFacts] = &[
    p("1g.10gb", 19, 1, 7, Some(9984), 16, [1, 1, 0, 1, 0], S1, 1),
    p(
        "1g.10gb+me",
        20,
        1,
        1,
        Some(9984),
        16,
        [1, 1, 0, 1, 1],
        S1,
        1,
    ),
    p(
        "1g.20gb",
        15,
        1,
        4,
        Some(20096),
        26,
        [1, 1, 0, 1, 0],
        S2Q,
        2,
    ),
    p("2g.20gb", 14, 2, 3, Some(20096), 32, [2, 2, 0, 2, 0], S2, 2),
    p("3g.40gb", 9, 3, 2, Some(40448), 60, [3, 3, 0, 3, 0], S3, 4),
    p("4g.40gb", 5, 4, 1, Some(40448), 64, [4, 4, 0, 4, 0], S0, 4),
    p("7g.80gb", 0, 7, 1, Some(81152), 132, [8, 7, 0, 7, 1], S0, 8),
];

/// H200 141GB (MIG profile tables).
pub const H200_141GB: &[ProfileFacts] = &[
    p("1g.18gb", 19, 1, 7, Some(16384), 16, [1, 1, 0, 1, 0], S1, 1),
    p(
        "1g.18gb+me",
        20,
        1,
        1,
        Some(16384),
        16,
        [1, 1, 0, 1, 1],
        S1,
        1,
    ),
    p(
        "1g.35gb",
        15,
        1,
        4,
        Some(33024),
        26,
        [1, 1, 0, 1, 0],
        S2Q,
        2,
    ),
    p("2g.35gb", 14, 2, 3, Some(33024), 32, [2, 2, 0, 2, 0], S2, 2),
    p("3g.71gb", 9, 3, 2, Some(71168), 60, [3, 3, 0, 3, 0], S3, 4),
    p("4g.71gb", 5, 4, 1, Some(71168), 64, [4, 4, 0, 4, 0], S0, 4),
    p(
        "7g.141gb",
        0,
        7,
        1,
        Some(143104),
        132,
        [8, 7, 0, 7, 1],
        S0,
        8,
    ),
];

/// Expected node for a built-in mock profile: product facts and GPU count.
pub fn profile_facts(profile: &str) -> (ProductFacts, usize) {
    match profile {
        "a100-40gb-x8" => (
            ProductFacts {
                name: "NVIDIA A100-SXM4-40GB",
                memory_mib: 40960,
                sms: 108,
                cc: (8, 0),
                arch: "Ampere",
                profiles: A100_40GB,
            },
            8,
        ),
        "a100-80gb-x4" => (
            ProductFacts {
                name: "NVIDIA A100-SXM4-80GB",
                memory_mib: 81920,
                sms: 108,
                cc: (8, 0),
                arch: "Ampere",
                profiles: A100_80GB,
            },
            4,
        ),
        "h100-80gb-x8" => (
            ProductFacts {
                name: "NVIDIA H100 80GB HBM3",
                memory_mib: 81559,
                sms: 132,
                cc: (9, 0),
                arch: "Hopper",
                profiles: H100_80GB,
            },
            8,
        ),
        "h200-141gb-x8" => (
            ProductFacts {
                name: "NVIDIA H200",
                memory_mib: 143_771,
                sms: 132,
                cc: (9, 0),
                arch: "Hopper",
                profiles: H200_141GB,
            },
            8,
        ),
        "l4-x2" => (
            ProductFacts {
                name: "NVIDIA L4",
                memory_mib: 23034,
                sms: 58,
                cc: (8, 9),
                arch: "Ada",
                profiles: &[],
            },
            2,
        ),
        other => panic!("unknown profile {other}"),
    }
}

/// The GPU with minor `minor`.
pub fn gpu(inv: &NodeInventory, minor: u32) -> &GpuInfo {
    inv.gpus
        .iter()
        .find(|g| g.minor == minor)
        .unwrap_or_else(|| panic!("no GPU with minor {minor}"))
}
