//! `cleave-demo` runs its whole tour, passes every check and leaves no process behind.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

/// Running and not a zombie.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let state = s.rsplit_once(')')?.1.split_whitespace().next()?.to_owned();
            Some(state != "Z" && state != "X")
        })
        .unwrap_or(false)
}

/// Runs the demo binary at `demo` over the mock library; asserts it passed every check and
/// returns what it printed.
fn run_passing_demo(demo: &std::path::Path) -> String {
    let lib = mock_nvml::locate::cdylib_path().expect("mock NVML library not built");
    let out = Command::new(demo)
        .env("MOCK_NVML_LIB", lib)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
    stdout
}

#[test]
fn demo_passes_all_checks() {
    let stdout = run_passing_demo(std::path::Path::new(env!("CARGO_BIN_EXE_cleave-demo")));
    assert!(!stdout.contains("FAIL"), "{stdout}");
    for line in [
        "[1/6]",
        "[6/6]",
        // Whole GPU on a GPU with MIG off, on-demand MIG on GPU 1.
        "default/whole-gpu (a whole GPU): gpu-6 ->",
        "gpu-1-mig-1g10gb-0",
        "gpu-1-mig-3g40gb-4",
        // MIG devices get their GI and CI access capability nodes (minors by the driver's fixed numbering, docs/hardware-sources.md:
        // gpu1/gi7 = 3 + 135 + 63 = 201, its ci0 = 202).
        "device node /dev/nvidia-caps/nvidia-cap201 (char 236:201)",
        "device node /dev/nvidia-caps/nvidia-cap202 (char 236:202)",
        "ok    the MIG devices get their GPU and compute instance capability nodes (4)",
        // The MPS claim: prepared, its daemon told the limits, its containers get them.
        "ok    default/mps-shared (a whole GPU shared with MPS",
        "told: set_default_active_thread_percentage 25",
        "told: set_default_device_pinned_mem_limit 0 10G",
        "env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
        "env CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10G",
        "-> /tmp/nvidia-mps",
        "ok    MPS daemon runs for default/mps-shared",
        // Nothing left behind.
        "ok    CDI spec files: 0",
        "ok    claims in the checkpoint: 0",
        "ok    MIG devices on the node: 0",
        "ok    MPS claim directories: 0",
        "ok    compute mode back to DEFAULT: GPU-",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in:\n{stdout}");
    }
    // The daemon's pid as the demo printed it: gone now, and the demo said so.
    let pid: u32 = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("MPS control daemon pid "))
        .and_then(|rest| rest.split(',').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no MPS daemon pid in:\n{stdout}"));
    assert!(
        stdout.contains(&format!(
            "ok    MPS daemon {pid}: exited; its pipe directory: removed"
        )),
        "{stdout}"
    );
    assert!(!alive(pid), "MPS daemon {pid} outlived the demo");
}

/// A step that fails (here: `nvidia-smi` cannot restore the compute mode, so unprepare
/// of the MPS claim fails) makes the exit code non-zero, and still no MPS daemon is left.
#[test]
fn failed_step_fails_the_demo_and_leaves_no_daemon() {
    let lib = mock_nvml::locate::cdylib_path().expect("mock NVML library not built");
    let out = Command::new(env!("CARGO_BIN_EXE_cleave-demo"))
        .env("MOCK_NVML_LIB", lib)
        .env("FAKE_NVIDIA_SMI_FAIL", "-c DEFAULT")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(stdout.contains("check(s) FAILED"), "{stdout}");
    assert!(
        stdout.contains("FAIL  5d2f0c1e-0000-4000-8000-000000000004: releasing sharing"),
        "{stdout}"
    );
    let pid: u32 = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("MPS control daemon pid "))
        .and_then(|rest| rest.split(',').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no MPS daemon pid in:\n{stdout}"));
    assert!(!alive(pid), "MPS daemon {pid} outlived the failed demo");
}

#[test]
fn fake_tool_argument_is_hidden_from_help() {
    let out = Command::new(env!("CARGO_BIN_EXE_cleave-demo"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    assert!(help.contains("demo"), "{help}");
    assert!(!help.contains("__fake"), "{help}");
}

/// A fresh `cargo run -p cleave-demo` builds no `cleave-cdi-hook` beside the demo: the demo
/// alone in a directory, with only the mock library named, still passes every check.
#[test]
fn demo_needs_no_hook_binary_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let demo = dir.path().join("cleave-demo");
    std::fs::copy(env!("CARGO_BIN_EXE_cleave-demo"), &demo).unwrap();
    assert!(!dir.path().join("cleave-cdi-hook").exists());
    run_passing_demo(&demo);
}

/// Started under the hook's name, as the runtime runs the copy the plugin installed, the
/// demo binary is the real hook.
#[test]
fn demo_binary_is_the_hook_under_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let hook = dir.path().join("cleave-cdi-hook");
    std::fs::copy(env!("CARGO_BIN_EXE_cleave-demo"), &hook).unwrap();
    let out = Command::new(&hook).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    assert!(help.contains("OCI createContainer hook"), "{help}");
    assert!(help.contains("update-ldcache"), "{help}");
    // A hostile-looking unknown subcommand is ignored by the hook, as NVIDIA's is.
    let out = Command::new(&hook).arg("no-such-hook").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unsupported hook"));
}
