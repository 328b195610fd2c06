//! MPS control daemons: what one is ([`DaemonSpec`], [`DaemonHandle`]), how it is launched
//! ([`DaemonLauncher`]; the host-process launcher is [`super::ProcessLauncher`]) and what is
//! recorded about it ([`MpsRecord`]).
//!
//! Layout under the state directory (`<plugins dir>/<driver>`), one directory per daemon:
//!
//! ```text
//! mps/<claim UID>/            0700: no other host user reaches into it
//! mps/<claim UID>/daemon.json the daemon's one record: devices, limits, pipe directory,
//!                             GPUs in EXCLUSIVE_PROCESS, PID + start time + boot ID (or pod)
//! mps/<claim UID>/pipe/       0711: CUDA_MPS_PIPE_DIRECTORY, bind-mounted into the claim's
//!                             containers only (they run as any user and may traverse it;
//!                             only root lists or changes it); with a pipe root it is
//!                             `<pipe root, 0711>/<16 hex digits>` instead
//! mps/<claim UID>/log/        1777: CUDA_MPS_LOG_DIRECTORY (control.log, server.log)
//! mps/<claim UID>/clients-stale  from a restart by reconciliation until the driver has
//!                             rewritten the CDI specs of the daemon's clients
//! mps/shared-<device>-<hash>/ the same for the daemon the shares of one device and one
//!                             namespace use (consumable capacity); its pipe goes to those
//!                             shares' containers only
//! ```
//!
//! What is recorded where: `daemon.json` is the only record of a daemon. The checkpoint's
//! sharing state of a per-claim MPS claim names the daemon by its key (the claim UID) and
//! nothing more; whoever wants its PID, limits or pipe directory (usage attribution, the
//! claim's status, unprepare) reads `daemon.json` ([`daemon_record`]), so a daemon that
//! reconciliation started again is seen with its new PID at once. Shared daemons are named
//! by no checkpoint entry at all: their key follows from the device and namespace.
//!
//! The record is written before the daemon is launched and again once its PID is known, so
//! a crash at any point leaves enough on disk to find and stop the daemon. The daemon is not
//! a child that dies with the plugin: `nvidia-cuda-mps-control -d` daemonizes itself, and it
//! is launched in its own process group, so restarting or upgrading the plugin never stops
//! the MPS clients of running pods.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::error::SharingFailure;
use crate::durable::write_file_atomic;

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
/// Present in a daemon's directory from the moment reconciliation starts the daemon again
/// until the driver has rewritten the CDI specs of its clients (a restarted daemon pod has
/// a new `/dev/shm`): a crash in between leaves it, and the next reconciliation reports
/// the daemon as restarted again.
pub(crate) const CLIENTS_STALE_FILE: &str = "clients-stale";
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
    pub(crate) fn start_args(&self) -> &'static [&'static str] {
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

/// Starts, talks to and stops MPS control daemons. [`super::ProcessLauncher`] runs them as host
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

/// Where the time of the last MPS start went (for benchmarks and metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MpsTimings {
    /// Directories, record and compute modes.
    pub setup: Duration,
    /// Launching the daemon until its PID is known.
    pub launch: Duration,
    /// From the PID until the daemon answered.
    pub ready: Duration,
    /// Setting and checking the limits, writing the record.
    pub limits: Duration,
    /// The whole start.
    pub total: Duration,
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

/// Everything known about an MPS daemon: its one record, `daemon.json` in its directory.
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
    pub(crate) fn same_settings(&self, other: &MpsRecord) -> bool {
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
    pub(crate) fn limit_commands(&self) -> String {
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
        input.push_str(&self.limit_queries());
        input
    }

    /// The queries of [`Self::limit_commands`] alone: what a running daemon is asked to
    /// show that it still holds the recorded limits (one set before a crash may be missing).
    pub(crate) fn limit_queries(&self) -> String {
        let mut input = String::from(READY_QUERY);
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
    pub(crate) fn check_limit_answer(&self, answer: &str) -> Result<(), String> {
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
    pub(crate) fn client_memory_limit(&self) -> Option<String> {
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
pub(crate) fn format_limit(bytes: u64) -> Option<String> {
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
pub(crate) fn parse_limit(text: &str) -> Option<u64> {
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
pub(super) fn limit_matches(set: &str, got: &str) -> bool {
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
pub(crate) fn socket_path_too_long(pipe_dir: &Path, socket: &str) -> Option<usize> {
    let len = pipe_dir.join(socket).as_os_str().len();
    (len > MAX_SOCKET_PATH).then_some(len)
}

/// The first directory from `/` down to `dir` that a UID other than its owner cannot search
/// (no `x` for others): an MPS server started for a non-root client runs with that client's
/// UID and must traverse every parent of the pipe directory, else it fails to start and the
/// client waits (bottlerocket-os/bottlerocket#4673). `None` when all are traversable.
pub(crate) fn closed_parent(dir: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let mut chain: Vec<&Path> = dir.ancestors().collect();
    chain.reverse();
    chain
        .into_iter()
        .find(|d| fs::metadata(d).is_ok_and(|m| m.mode() & 0o001 == 0))
        .map(Path::to_path_buf)
}

/// Reads a daemon's record from its directory; `None` when there is none.
/// [`SharingFailure::RecordUnreadable`] when it does not decode.
pub fn load_record(claim_dir: &Path) -> Result<Option<MpsRecord>, SharingFailure> {
    let path = claim_dir.join(RECORD_FILE);
    match fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| SharingFailure::RecordUnreadable { path, source }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(SharingFailure::Io {
            op: "reading",
            path,
            source,
        }),
    }
}

/// The record of daemon `key` (what a checkpoint's sharing state names: the claim UID of a
/// per-claim daemon) under the state directory `state_dir`: `mps/<key>/daemon.json`, as it is
/// now. `None` when there is none; a key that cannot name a directory is refused.
pub fn daemon_record(state_dir: &Path, key: &str) -> Result<Option<MpsRecord>, SharingFailure> {
    crate::cdi::validate_claim_uid(key)?;
    load_record(&state_dir.join(MPS_DIR).join(key))
}

/// Writes a claim's record atomically.
pub(crate) fn store_record(claim_dir: &Path, record: &MpsRecord) -> Result<(), SharingFailure> {
    let path = claim_dir.join(RECORD_FILE);
    let bytes = serde_json::to_vec_pretty(record).map_err(|source| SharingFailure::Record {
        path: path.clone(),
        source,
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
