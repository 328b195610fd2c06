//! Scenarios in child processes. The mock NVML library reads its configuration
//! (`MOCK_NVML_PROFILE`, `MOCK_NVML_STATE`, `MOCK_NVML_FAIL`, ...) from the process
//! environment when NVML is initialised, and the environment is process-global. So each
//! scenario runs in a child: the test re-executes its own binary with `--exact <test name>`
//! and [`SCENARIO_ENV`] set, and the child (seeing the variable) runs the scenario body
//! instead of spawning.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Names the scenario a child process runs.
pub const SCENARIO_ENV: &str = "CLEAVE_TEST_SCENARIO";

/// Longest a scenario child may run.
pub const CHILD_TIMEOUT: Duration = Duration::from_secs(120);

/// The scenario this process must run, if it is a child.
pub fn scenario() -> Option<String> {
    std::env::var(SCENARIO_ENV).ok()
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
        .env("MOCK_NVML_LIB", crate::mock_lib())
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
    let status = crate::process::wait_or_kill(
        &mut child,
        CHILD_TIMEOUT,
        &format!("scenario {scenario:?} of {test_name}"),
    );
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
