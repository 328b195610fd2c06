//! Per-claim MPS control daemons: how they are launched ([`DaemonLauncher`], with the
//! process launcher [`ProcessLauncher`]) and what is recorded about them ([`MpsRecord`]).
//!
//! Layout under the state directory (`<plugins dir>/<driver>`), one directory per claim:
//!
//! ```text
//! mps/<claim UID>/            0700: no other host user reaches into it
//! mps/<claim UID>/daemon.json the record: devices, limits, PID + start time + boot ID
//! mps/<claim UID>/pipe/       0711: CUDA_MPS_PIPE_DIRECTORY, bind-mounted into the claim's
//!                             containers only (they run as any user and may traverse it;
//!                             only root lists or changes it); with a pipe root it is
//!                             `<pipe root, 0711>/<16 hex digits>` instead
//! mps/<claim UID>/log/        1777: CUDA_MPS_LOG_DIRECTORY (control.log, server.log)
//! mps/shared-<device>-<hash>/ the same for the daemon the shares of one device and one
//!                             namespace use (consumable capacity); its pipe goes to those
//!                             shares' containers only
//! ```
//!
//! The record is written before the daemon is launched and again once its PID is known, so
//! a crash at any point leaves enough on disk to find and stop the daemon. The daemon is not
//! a child that dies with the plugin: `nvidia-cuda-mps-control -d` daemonizes itself, and it
//! is launched in its own process group, so restarting or upgrading the plugin never stops
//! the MPS clients of running pods.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::SharingFailure;
use super::process::{self, RunFailure};
use crate::checkpoint::{read_boot_id, write_file_atomic};

/// The first 32 hex digits of SHA-256 over `parts`, each followed by a 0 byte: names of
/// daemon pods and labels that must be unique per node and daemon yet fit 63 bytes.
pub fn name_hash(parts: &[&str]) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0]);
    }
    let mut digest = hex::encode(h.finalize());
    digest.truncate(32);
    digest
}

/// Pid file the control daemon writes into its pipe directory.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// The record of a claim's daemon, in the claim's MPS directory.
pub const RECORD_FILE: &str = "daemon.json";
/// Directory under the state directory holding one directory per MPS claim.
pub const MPS_DIR: &str = "mps";
/// Where containers see the pipe directory (and what their `CUDA_MPS_PIPE_DIRECTORY` says).
pub const DEFAULT_CONTAINER_PIPE_DIR: &str = "/tmp/nvidia-mps";

/// What a daemon serves: the claim, its directories and its devices (in ordinal order).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DaemonSpec {
    /// Claim UID.
    pub claim_uid: String,
    /// `CUDA_MPS_PIPE_DIRECTORY` of the daemon (as this process sees it).
    pub pipe_dir: PathBuf,
    /// `CUDA_MPS_LOG_DIRECTORY` of the daemon.
    pub log_dir: PathBuf,
    /// `CUDA_VISIBLE_DEVICES`: device UUIDs (`GPU-…`, `MIG-…`); position = CUDA ordinal.
    pub visible_devices: Vec<String>,
    /// Start the daemon in multi-user mode (`-d -M`, the switch NVIDIA's DRA driver passes:
    /// kubernetes-sigs/dra-driver-nvidia-gpu `templates/mps-control-daemon.tmpl.yaml`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub multi_user: bool,
}

impl DaemonSpec {
    /// The arguments that start the daemon: `-d`, and `-M` in multi-user mode.
    pub fn start_args(&self) -> &'static [&'static str] {
        if self.multi_user {
            &["-d", "-M"]
        } else {
            &["-d"]
        }
    }
}

/// Identity of a running daemon: PID, start time (clock ticks since boot, from
/// `/proc/<pid>/stat`) and boot ID, so that a reused PID is never taken for the daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DaemonHandle {
    /// PID of the control daemon.
    pub pid: u32,
    /// Start time of that PID.
    pub start_time: u64,
    /// Kernel boot ID when it was started (empty when unknown).
    #[serde(default)]
    pub boot_id: String,
    /// The pod the daemon runs in (pod launcher); `pid` and `start_time` are then 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<DaemonPod>,
    /// The daemon's `/dev/shm` as the host sees it, when it has one of its own: mounted at
    /// `/dev/shm` into the claim's containers, since MPS clients and server share memory
    /// there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm_host_dir: Option<PathBuf>,
}

impl DaemonHandle {
    /// A handle of a host process.
    pub fn process(pid: u32, start_time: u64, boot_id: String) -> Self {
        Self {
            pid,
            start_time,
            boot_id,
            pod: None,
            shm_host_dir: None,
        }
    }

    /// What logs name the daemon by: `pod <ns>/<name>` or `PID <pid>`.
    pub fn describe(&self) -> String {
        match &self.pod {
            Some(p) => format!("pod {}/{}", p.namespace, p.name),
            None => format!("PID {}", self.pid),
        }
    }
}

/// The pod a daemon runs in; the UID tells a re-created pod of the same name apart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DaemonPod {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
}

/// Starts, talks to and stops MPS control daemons. [`ProcessLauncher`] runs them as host
/// processes; the kubelet plugin's pod launcher runs each in a pod of its own (with a
/// per-claim `/dev/shm` shared with the claim's containers).
///
/// All methods are bounded by the timeouts given and safe to call again after a failure.
pub trait DaemonLauncher: Send + Sync {
    /// Starts the daemon of `spec` (its directories exist) and returns its identity once it
    /// is known; the daemon may not answer commands yet.
    fn start(&self, spec: &DaemonSpec, timeout: Duration) -> Result<DaemonHandle, SharingFailure>;

    /// Sends `input` (commands, one per line) to the daemon of `spec` and returns what it
    /// answered.
    fn control(
        &self,
        spec: &DaemonSpec,
        input: &str,
        timeout: Duration,
    ) -> Result<String, SharingFailure>;

    /// Finds a daemon serving `spec` that was started but not recorded (crash right after
    /// the start).
    fn find(&self, spec: &DaemonSpec) -> Option<DaemonHandle>;

    /// True if the daemon `handle` still runs.
    fn is_running(&self, handle: &DaemonHandle) -> bool;

    /// Stops the daemon by force (it did not obey `quit`): waits up to `grace` after a
    /// polite signal, then kills it.
    fn kill(&self, handle: &DaemonHandle, grace: Duration) -> Result<(), SharingFailure>;

    /// Removes what is left of a stopped daemon (its pod). Called after every stop.
    fn cleanup(&self, _spec: &DaemonSpec, _handle: &DaemonHandle) -> Result<(), SharingFailure> {
        Ok(())
    }

    /// Stops daemons this launcher started for claims not in `keep` that no record on disk
    /// names any more (e.g. after the state directory was reset). Returns the claim UIDs
    /// stopped.
    fn sweep(&self, _keep: &std::collections::BTreeSet<String>) -> Vec<String> {
        Vec::new()
    }
}

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
pub fn start_refused(spec: &DaemonSpec, status: &std::process::ExitStatus) -> String {
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

/// One memory limit of a daemon: device ordinal, its UUID, and the limit in the control
/// daemon's syntax (`<n>M` or `<n>G`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PinnedLimit {
    /// CUDA ordinal of the device within the daemon (and within the claim's containers).
    pub ordinal: u32,
    /// Device UUID.
    pub uuid: String,
    /// `8192M`, `10G`.
    pub limit: String,
}

/// Everything known about a claim's MPS daemon; kept in `daemon.json` and in the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsRecord {
    /// What the daemon serves.
    pub spec: DaemonSpec,
    /// Pipe directory as the container runtime on the host sees it (CDI mount source).
    pub host_pipe_dir: PathBuf,
    /// Default active thread percentage set in the daemon.
    pub active_thread_percentage: u8,
    /// Default pinned memory limits set in the daemon.
    #[serde(default)]
    pub pinned_limits: Vec<PinnedLimit>,
    /// Whole GPUs switched to `EXCLUSIVE_PROCESS` for the daemon (restored to `DEFAULT`).
    #[serde(default)]
    pub exclusive_gpus: Vec<String>,
    /// The daemon, once started.
    #[serde(default)]
    pub daemon: Option<DaemonHandle>,
}

impl MpsRecord {
    /// True if `other` asks for the same daemon (devices and limits).
    pub fn same_settings(&self, other: &MpsRecord) -> bool {
        self.spec == other.spec
            && self.host_pipe_dir == other.host_pipe_dir
            && self.active_thread_percentage == other.active_thread_percentage
            && self.pinned_limits == other.pinned_limits
            && self.exclusive_gpus == other.exclusive_gpus
    }

    /// The commands that set the limits, followed by one query per value set
    /// (`get_default_active_thread_percentage`, then `get_default_device_pinned_mem_limit
    /// <ordinal>` per limit, keyed by ordinal as they were set). The control UI exits 0 even
    /// when it rejects a command, and what a set prints on success is unverified, so the
    /// values are read back and compared ([`Self::check_limit_answer`]), never assumed.
    pub fn limit_commands(&self) -> String {
        let mut input = format!(
            "set_default_active_thread_percentage {}\n",
            self.active_thread_percentage
        );
        for l in &self.pinned_limits {
            input.push_str(&format!(
                "set_default_device_pinned_mem_limit {} {}\n",
                l.ordinal, l.limit
            ));
        }
        input.push_str(READY_QUERY);
        for l in &self.pinned_limits {
            input.push_str(&format!(
                "get_default_device_pinned_mem_limit {}\n",
                l.ordinal
            ));
        }
        input
    }

    /// Checks the daemon's answer to [`Self::limit_commands`]. Each query answers one line,
    /// so the answers are the last `1 + limits` non-empty lines; anything before them is
    /// what the set commands printed (nothing, an acknowledgement, or an error such as
    /// `Invalid percentage, expected between (0.0, 100.0]`). `Err` says which value does not
    /// match, in the daemon's own words, with whatever the sets printed.
    pub fn check_limit_answer(&self, answer: &str) -> Result<(), String> {
        let lines: Vec<&str> = answer
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        let queries = 1 + self.pinned_limits.len();
        let set_output = lines[..lines.len().saturating_sub(queries)].join(" | ");
        let with_sets = |problem: String| {
            if set_output.is_empty() {
                problem
            } else {
                format!("{problem}; the set commands answered: {set_output}")
            }
        };
        if lines.len() < queries {
            return Err(with_sets(format!(
                "expected {queries} answers to the read-back queries, got: {}",
                lines.join(" | ")
            )));
        }
        let answers = &lines[lines.len() - queries..];
        let mut problems = Vec::new();
        let want = f64::from(self.active_thread_percentage);
        match answers[0].parse::<f64>() {
            Ok(got) if (got - want).abs() < 0.05 => {}
            _ => problems.push(format!(
                "active thread percentage: set {}, get_default_active_thread_percentage answered `{}`",
                self.active_thread_percentage, answers[0]
            )),
        }
        for (l, got) in self.pinned_limits.iter().zip(&answers[1..]) {
            if !limit_matches(&l.limit, got) {
                problems.push(format!(
                    "pinned memory limit of device {} ({}): set {}, get_default_device_pinned_mem_limit {} answered `{got}`",
                    l.ordinal, l.uuid, l.limit, l.ordinal
                ));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(with_sets(problems.join("; ")))
        }
    }

    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` for the clients: `0=8192M,1=10G`; `None` without
    /// limits.
    pub fn client_memory_limit(&self) -> Option<String> {
        (!self.pinned_limits.is_empty()).then(|| {
            self.pinned_limits
                .iter()
                .map(|l| format!("{}={}", l.ordinal, l.limit))
                .collect::<Vec<_>>()
                .join(",")
        })
    }
}

/// The query used to see that a daemon answers (and, after the limits, that they hold).
pub const READY_QUERY: &str = "get_default_active_thread_percentage\n";

/// Parses the answer to [`READY_QUERY`]: the last non-empty line as a number.
pub fn parse_percentage(answer: &str) -> Option<f64> {
    answer
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())?
        .parse()
        .ok()
}

/// Formats a limit in bytes the way the control daemon takes it: whole GiB as `<n>G`,
/// otherwise whole MiB (rounded down, never above what was asked) as `<n>M`; `None` below
/// 1 MiB.
pub fn format_limit(bytes: u64) -> Option<String> {
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    if bytes < MIB {
        None
    } else if bytes.is_multiple_of(GIB) {
        Some(format!("{}G", bytes / GIB))
    } else {
        Some(format!("{}M", bytes / MIB))
    }
}

/// Bytes of a limit in the control daemon's syntax (`<n>G`, `<n>M`).
pub fn parse_limit(text: &str) -> Option<u64> {
    let (number, shift) = if let Some(n) = text.strip_suffix('G') {
        (n, 30)
    } else {
        (text.strip_suffix('M')?, 20)
    };
    if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    number.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// True if the read-back `got` is the limit `set`: the same bytes, or (for a limit of 1 GiB
/// or more set in MiB) whole GiB rounded down, as driver 595 was reported to print it
/// (third-party report, unverified).
fn limit_matches(set: &str, got: &str) -> bool {
    const GIB: u64 = 1 << 30;
    match (parse_limit(set), parse_limit(got)) {
        (Some(s), Some(g)) if s == g => true,
        (Some(s), Some(g)) => got.ends_with('G') && s >= GIB && g == s / GIB * GIB,
        _ => false,
    }
}

/// Longest unix socket path Linux takes: `sun_path` holds 108 bytes with the trailing NUL
/// (unix(7)).
pub const MAX_SOCKET_PATH: usize = 107;
/// The control socket the UI connects to, in the pipe directory.
pub const CONTROL_SOCKET: &str = "control";
/// The daemon's privileged socket in the pipe directory (the 550 binary's format string is
/// `%s/control_privileged`); never given to clients.
pub const PRIVILEGED_SOCKET: &str = "control_privileged";
/// The longest socket name the control daemon binds in its pipe directory (the 550 binary's
/// format strings are `%s/control` and `%s/control_privileged`).
pub const LONGEST_SOCKET: &str = PRIVILEGED_SOCKET;
/// Mode of a pipe directory: clients of any UID (and servers started with their UID) must
/// traverse it to reach `control` and `log` (bottlerocket-os/bottlerocket#4673), but only the
/// daemon (root) creates, removes or lists its entries.
pub const PIPE_DIR_MODE: u32 = 0o711;
/// Mode of a daemon's state directory (record, log directory): root only.
pub const CLAIM_DIR_MODE: u32 = 0o700;

/// `Some(length)` when `<pipe_dir>/<socket>` is too long to be a unix socket path.
pub fn socket_path_too_long(pipe_dir: &Path, socket: &str) -> Option<usize> {
    let len = pipe_dir.join(socket).as_os_str().len();
    (len > MAX_SOCKET_PATH).then_some(len)
}

/// The first directory from `/` down to `dir` that a UID other than its owner cannot search
/// (no `x` for others): an MPS server started for a non-root client runs with that client's
/// UID and must traverse every parent of the pipe directory, else it fails to start and the
/// client waits (bottlerocket-os/bottlerocket#4673). `None` when all are traversable.
pub fn closed_parent(dir: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let mut chain: Vec<&Path> = dir.ancestors().collect();
    chain.reverse();
    chain
        .into_iter()
        .find(|d| fs::metadata(d).is_ok_and(|m| m.mode() & 0o001 == 0))
        .map(Path::to_path_buf)
}

/// Reads a claim's record; `None` when there is none.
pub fn load_record(claim_dir: &Path) -> Result<Option<MpsRecord>, SharingFailure> {
    let path = claim_dir.join(RECORD_FILE);
    match fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| SharingFailure::Record {
                path,
                message: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(SharingFailure::Io {
            op: "reading",
            path,
            source,
        }),
    }
}

/// Writes a claim's record atomically.
pub fn store_record(claim_dir: &Path, record: &MpsRecord) -> Result<(), SharingFailure> {
    let path = claim_dir.join(RECORD_FILE);
    let bytes = serde_json::to_vec_pretty(record).map_err(|e| SharingFailure::Record {
        path: path.clone(),
        message: e.to_string(),
    })?;
    write_file_atomic(&path, &bytes).map_err(|source| SharingFailure::Io {
        op: "writing",
        path,
        source,
    })
}

/// Creates the claim directory (0700) with its pipe (0711) and log (1777) directories.
pub fn create_dirs(claim_dir: &Path, spec: &DaemonSpec) -> Result<(), SharingFailure> {
    for (dir, mode) in [
        (claim_dir, CLAIM_DIR_MODE),
        (spec.pipe_dir.as_path(), PIPE_DIR_MODE),
        // Sticky and open to all: MPS servers run with their clients' UIDs and log here
        // (in a daemon pod it is mounted directly; on the host the 0700 claim directory
        // keeps other users out).
        (spec.log_dir.as_path(), 0o1777),
    ] {
        let io = |op, source| SharingFailure::Io {
            op,
            path: dir.to_owned(),
            source,
        };
        fs::create_dir_all(dir).map_err(|e| io("creating", e))?;
        // Explicitly, since the process umask applies to create_dir.
        fs::set_permissions(dir, fs::Permissions::from_mode(mode))
            .map_err(|e| io("setting permissions of", e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_use_whole_gib_or_mib_rounded_down() {
        assert_eq!(format_limit(10 << 30).as_deref(), Some("10G"));
        assert_eq!(format_limit(8192 << 20).as_deref(), Some("8G"));
        assert_eq!(format_limit(1536 << 20).as_deref(), Some("1536M"));
        assert_eq!(format_limit((5 << 20) + 123).as_deref(), Some("5M"));
        assert_eq!(format_limit(1_000_000_000).as_deref(), Some("953M"));
        assert_eq!(format_limit((1 << 20) - 1), None);
    }

    #[test]
    fn socket_paths_must_fit_a_unix_socket_address() {
        let dir = PathBuf::from(format!("/{}", "d".repeat(94)));
        assert_eq!(socket_path_too_long(&dir, CONTROL_SOCKET), None);
        assert_eq!(socket_path_too_long(&dir, LONGEST_SOCKET), Some(114));
        let dir = PathBuf::from(format!("/{}", "d".repeat(87)));
        assert_eq!(
            socket_path_too_long(&dir, LONGEST_SOCKET),
            None,
            "107 bytes fit"
        );
        let dir = PathBuf::from(format!("/{}", "d".repeat(88)));
        assert_eq!(socket_path_too_long(&dir, LONGEST_SOCKET), Some(108));
    }

    #[test]
    fn closed_parents_of_the_pipe_directory_are_found() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let open = tmp.path().join("open");
        let closed = open.join("closed");
        let pipe = closed.join("pipe");
        fs::create_dir_all(&pipe).unwrap();
        let set =
            |p: &Path, mode| fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
        set(tmp.path(), 0o711);
        set(&open, 0o755);
        set(&closed, 0o700);
        set(&pipe, 0o777);
        assert_eq!(closed_parent(&pipe), Some(closed.clone()));
        set(&closed, 0o711);
        assert_eq!(closed_parent(&pipe), None);
    }

    #[test]
    fn limits_read_back_in_either_unit() {
        assert_eq!(parse_limit("1536M"), Some(1536 << 20));
        assert_eq!(parse_limit("10G"), Some(10 << 30));
        assert_eq!(parse_limit("1.5G"), None);
        assert_eq!(parse_limit("G"), None);
        assert!(limit_matches("8G", "8192M"));
        assert!(limit_matches("1536M", "1536M"));
        // Driver 595 as reported: whole GiB rounded down.
        assert!(limit_matches("1536M", "1G"));
        assert!(!limit_matches("1536M", "2G"));
        assert!(!limit_matches("512M", "0G"));
        assert!(!limit_matches(
            "10G",
            "No default pinned memory limit set for the device!"
        ));
    }

    #[test]
    fn percentage_answer_takes_the_last_line() {
        assert_eq!(parse_percentage("100.0\n"), Some(100.0));
        assert_eq!(parse_percentage("\n25.0\n\n"), Some(25.0));
        assert_eq!(parse_percentage("Invalid device 3\n25.0\n"), Some(25.0));
        assert_eq!(
            parse_percentage("Cannot find MPS control daemon process"),
            None
        );
        assert_eq!(parse_percentage(""), None);
    }

    #[test]
    fn commands_and_client_env_use_ordinals() {
        let record = MpsRecord {
            spec: DaemonSpec {
                claim_uid: "u".into(),
                pipe_dir: "/s/mps/u/pipe".into(),
                log_dir: "/s/mps/u/log".into(),
                visible_devices: vec!["GPU-a".into(), "MIG-b".into()],
                multi_user: false,
            },
            host_pipe_dir: "/s/mps/u/pipe".into(),
            active_thread_percentage: 25,
            pinned_limits: vec![
                PinnedLimit {
                    ordinal: 0,
                    uuid: "GPU-a".into(),
                    limit: "10G".into(),
                },
                PinnedLimit {
                    ordinal: 1,
                    uuid: "MIG-b".into(),
                    limit: "512M".into(),
                },
            ],
            exclusive_gpus: vec!["GPU-a".into()],
            daemon: None,
        };
        assert_eq!(
            record.limit_commands(),
            "set_default_active_thread_percentage 25\n\
             set_default_device_pinned_mem_limit 0 10G\n\
             set_default_device_pinned_mem_limit 1 512M\n\
             get_default_active_thread_percentage\n\
             get_default_device_pinned_mem_limit 0\n\
             get_default_device_pinned_mem_limit 1\n"
        );
        // Read back: each value as set.
        assert_eq!(record.check_limit_answer("25.0\n10G\n512M\n"), Ok(()));
        // Sets that print an acknowledgement: still the last lines count.
        assert_eq!(
            record.check_limit_answer("ok\nok\nok\n25.0\n10G\n512M\n"),
            Ok(())
        );
        // A rejected set (exit status 0, error on stdout): the daemon's words come back.
        let err = record
            .check_limit_answer(
                "Invalid percentage, expected between (0.0, 100.0]\n100.0\n10G\n512M\n",
            )
            .unwrap_err();
        assert!(
            err.contains("active thread percentage: set 25")
                && err.contains("answered `100.0`")
                && err.contains("Invalid percentage, expected between (0.0, 100.0]"),
            "{err}"
        );
        let err = record
            .check_limit_answer("25.0\nNo default pinned memory limit set for the device!\n512M\n")
            .unwrap_err();
        assert!(
            err.contains("device 0 (GPU-a): set 10G")
                && err.contains("No default pinned memory limit set for the device!"),
            "{err}"
        );
        assert!(record.check_limit_answer("25.0\n").is_err());
        assert_eq!(
            record.client_memory_limit().as_deref(),
            Some("0=10G,1=512M")
        );
        let json = serde_json::to_value(&record).unwrap();
        assert_eq!(serde_json::from_value::<MpsRecord>(json).unwrap(), record);
    }
}
