//! The `demo` subcommand runs its whole tour and passes every check.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

#[test]
fn demo_passes_all_checks() {
    let lib = mock_nvml::locate::cdylib_path().expect("mock NVML library not built");
    let out = Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .arg("demo")
        .env("MOCK_NVML_LIB", lib)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
    assert!(!stdout.contains("FAIL"), "{stdout}");
    for step in [
        "[1/6]",
        "[6/6]",
        "gpu-1-mig-1g10gb-0",
        "gpu-1-mig-3g40gb-4",
        "MIG devices on the node: 0",
    ] {
        assert!(stdout.contains(step), "missing {step:?} in:\n{stdout}");
    }
}
