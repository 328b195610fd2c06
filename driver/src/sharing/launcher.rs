//! [`ProcessLauncher`]: MPS control daemons as detached host processes (local runs, tests).
//! The daemon is not a child that dies with the plugin: `nvidia-cuda-mps-control -d`
//! daemonizes itself and is launched in its own process group.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::error::SharingFailure;
use super::mps::{
    DaemonHandle, DaemonLauncher, DaemonSpec, LONGEST_SOCKET, MAX_SOCKET_PATH, PID_FILE,
    closed_parent, socket_path_too_long,
};
use super::process::{self, RunFailure};
use crate::durable::read_boot_id;

/// Runs `nvidia-cuda-mps-control` as a host process: `-d` to start (the tool daemonizes and
/// writes its PID into the pipe directory), no argument with commands on stdin to control.
#[derive(Debug, Clone)]
pub struct ProcessLauncher {
    control_bin: PathBuf,
    extra_env: Vec<(String, String)>,
    boot_id_path: PathBuf,
}

impl ProcessLauncher {
    /// A launcher running `control_bin`, with `extra_env` added to the environment of every
    /// call (tests pass the fakes' knobs this way), reading the boot ID from `boot_id_path`.
    pub fn new(
        control_bin: impl Into<PathBuf>,
        extra_env: Vec<(String, String)>,
        boot_id_path: impl Into<PathBuf>,
    ) -> Self {
        Self {
            control_bin: control_bin.into(),
            extra_env,
            boot_id_path: boot_id_path.into(),
        }
    }

    fn command(&self, spec: &DaemonSpec) -> Command {
        let mut cmd = Command::new(&self.control_bin);
        cmd.envs(self.extra_env.iter().map(|(k, v)| (k, v)))
            .env("CUDA_MPS_PIPE_DIRECTORY", &spec.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &spec.log_dir);
        cmd
    }

    fn boot_id(&self) -> String {
        read_boot_id(&self.boot_id_path).unwrap_or_default()
    }

    fn start_failure(&self, spec: &DaemonSpec, message: String) -> SharingFailure {
        let log = fs::read_to_string(spec.log_dir.join(LAUNCH_LOG)).unwrap_or_default();
        let tail: String = log.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
        SharingFailure::DaemonStart {
            claim: spec.claim_uid.clone(),
            tool: self.control_bin.clone(),
            message: if tail.is_empty() {
                message
            } else {
                format!("{message}; output: {tail}")
            },
        }
    }
}

/// Why a `-d` call that exited non-zero failed, with a hint for multi-user mode (a release
/// whose control daemon has no `-M` refuses it; the 550 binary carries no such switch).
pub(super) fn start_refused(spec: &DaemonSpec, status: &std::process::ExitStatus) -> String {
    let args = spec.start_args().join(" ");
    if spec.multi_user {
        format!(
            "`{args}` exited with {status}: multi-user mode (mps.multiUser) was refused; this driver's nvidia-cuda-mps-control may not support `-M`: upgrade the driver or drop mps.multiUser"
        )
    } else {
        format!("`{args}` exited with {status}")
    }
}

/// File in the log directory receiving the output of the `-d` call.
const LAUNCH_LOG: &str = "launch.log";

fn read_pid_file(pipe_dir: &Path) -> Option<u32> {
    fs::read_to_string(pipe_dir.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
}

impl DaemonLauncher for ProcessLauncher {
    fn start(&self, spec: &DaemonSpec, timeout: Duration) -> Result<DaemonHandle, SharingFailure> {
        let log_path = spec.log_dir.join(LAUNCH_LOG);
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|source| SharingFailure::Io {
                op: "opening",
                path: log_path.clone(),
                source,
            })?;
        let log2 = log.try_clone().map_err(|source| SharingFailure::Io {
            op: "opening",
            path: log_path.clone(),
            source,
        })?;
        // A stale pid file must not be mistaken for the new daemon's.
        let _ = fs::remove_file(spec.pipe_dir.join(PID_FILE));
        if let Some(len) = socket_path_too_long(&spec.pipe_dir, LONGEST_SOCKET) {
            return Err(self.start_failure(
                spec,
                format!(
                    "the daemon's socket {} would be {len} bytes, longer than the {MAX_SOCKET_PATH} a unix socket path may have; use a shorter state (kubelet plugins) directory",
                    spec.pipe_dir.join(LONGEST_SOCKET).display()
                ),
            ));
        }
        if let Some(closed) = closed_parent(&spec.pipe_dir) {
            tracing::warn!(
                claim = %spec.claim_uid,
                dir = %closed.display(),
                "MPS servers for non-root clients cannot traverse this parent of the pipe directory; only root clients will be served (the process launcher is for development; use the pod launcher)"
            );
        }
        let mut child = self
            .command(spec)
            .args(spec.start_args())
            .env("CUDA_VISIBLE_DEVICES", spec.visible_devices.join(","))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            // Own process group: signals to the plugin's group never reach the daemon.
            .process_group(0)
            .spawn()
            .map_err(|e| self.start_failure(spec, format!("could not run it: {e}")))?;
        let status = process::wait_child(&mut child, timeout)
            .map_err(|e| self.start_failure(spec, format!("`-d` {e}")))?;
        if !status.success() {
            return Err(self.start_failure(spec, start_refused(spec, &status)));
        }
        let pid =
            process::poll_until(timeout, || read_pid_file(&spec.pipe_dir)).ok_or_else(|| {
                self.start_failure(
                    spec,
                    format!(
                        "no pid file {} within {timeout:?}",
                        spec.pipe_dir.join(PID_FILE).display()
                    ),
                )
            })?;
        let start_time = process::start_time(pid).ok_or_else(|| {
            self.start_failure(spec, format!("daemon PID {pid} exited right after start"))
        })?;
        Ok(DaemonHandle::process(pid, start_time, self.boot_id()))
    }

    fn control(
        &self,
        spec: &DaemonSpec,
        input: &str,
        timeout: Duration,
    ) -> Result<String, SharingFailure> {
        let failure = |message: String| SharingFailure::DaemonControl {
            claim: spec.claim_uid.clone(),
            command: input.trim().replace('\n', "; "),
            message,
        };
        let out = process::run_with_input(&mut self.command(spec), input, timeout).map_err(
            |e| match e {
                RunFailure::Timeout => failure(format!("no answer within {timeout:?}")),
                other => failure(other.to_string()),
            },
        )?;
        if out.status.success() {
            Ok(out.stdout)
        } else {
            Err(failure(format!(
                "exited with {}: {}{}",
                out.status,
                out.stdout.trim(),
                out.stderr.trim()
            )))
        }
    }

    fn find(&self, spec: &DaemonSpec) -> Option<DaemonHandle> {
        let pid = read_pid_file(&spec.pipe_dir)?;
        // Without a recorded start time, only a process that is an MPS control daemon
        // counts: a stale pid file must never get an unrelated process killed.
        let is_mps = process::cmdline(pid).is_some_and(|c| c.contains("nvidia-cuda-mps-control"));
        if !is_mps || !process::is_alive(pid, None) {
            return None;
        }
        Some(DaemonHandle::process(
            pid,
            process::start_time(pid)?,
            self.boot_id(),
        ))
    }

    fn is_running(&self, handle: &DaemonHandle) -> bool {
        if !handle.boot_id.is_empty() {
            let now = self.boot_id();
            if !now.is_empty() && now != handle.boot_id {
                return false;
            }
        }
        process::is_alive(handle.pid, Some(handle.start_time))
    }

    fn kill(&self, handle: &DaemonHandle, grace: Duration) -> Result<(), SharingFailure> {
        let gone = || (!self.is_running(handle)).then_some(());
        let fail = |e: std::io::Error| SharingFailure::DaemonStop {
            daemon: handle.describe(),
            message: e.to_string(),
        };
        process::signal(handle.pid, Some(handle.start_time), libc::SIGTERM).map_err(fail)?;
        if process::poll_until(grace, gone).is_some() {
            return Ok(());
        }
        process::signal(handle.pid, Some(handle.start_time), libc::SIGKILL).map_err(fail)?;
        process::poll_until(Duration::from_secs(2), gone).ok_or(SharingFailure::DaemonStop {
            daemon: handle.describe(),
            message: "still running after SIGKILL".into(),
        })
    }
}
