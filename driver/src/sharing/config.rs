//! Settings of the sharing strategies: where the tools are, where daemons keep their state
//! and pipes, and how long they may take. Shared by every strategy, so kept out of each.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::durable::DEFAULT_BOOT_ID_PATH;

use super::mps;

/// File name of the MPS control tool.
pub const MPS_CONTROL_TOOL: &str = "nvidia-cuda-mps-control";
/// File name of `nvidia-smi`.
pub const NVIDIA_SMI_TOOL: &str = "nvidia-smi";
/// Where MPS clients and server share memory; a daemon with a `/dev/shm` of its own has it
/// mounted here in the claim's containers.
pub const SHM_DIR: &str = "/dev/shm";
/// The device whose bind mount masks a file in containers (as OCI runtimes mask paths:
/// runc `maskPath` binds `/dev/null` over files).
pub const MASK_SOURCE: &str = "/dev/null";
/// Mode of the pipe root: others may traverse it to their pipe directory, not list it.
pub const PIPE_ROOT_MODE: u32 = 0o711;
/// Lowest compute capability whose MPS honours thread and memory limits (Volta).
pub const MPS_MIN_COMPUTE_CAPABILITY: (u32, u32) = (7, 0);

/// Paths of the two tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharingBinaries {
    /// `nvidia-cuda-mps-control`.
    pub mps_control: PathBuf,
    /// `nvidia-smi`.
    pub nvidia_smi: PathBuf,
}

impl SharingBinaries {
    /// The tools under a driver root as this process sees it: the first of
    /// `usr/bin/<tool>`, `bin/<tool>` that exists (else the `usr/bin` path, so that an error
    /// names where the tool was expected).
    pub fn under_driver_root(root: &Path) -> Self {
        let find = |tool: &str| {
            crate::driver_root::BINARY_DIRS
                .iter()
                .map(|dir| root.join(dir).join(tool))
                .find(|p| p.is_file())
                .unwrap_or_else(|| root.join("usr/bin").join(tool))
        };
        Self {
            mps_control: find(MPS_CONTROL_TOOL),
            nvidia_smi: find(NVIDIA_SMI_TOOL),
        }
    }

    /// Replaces the tools given explicitly (`--mps-control-bin`, `--nvidia-smi-bin`).
    pub fn with_overrides(
        mut self,
        mps_control: Option<PathBuf>,
        nvidia_smi: Option<PathBuf>,
    ) -> Self {
        if let Some(p) = mps_control {
            self.mps_control = p;
        }
        if let Some(p) = nvidia_smi {
            self.nvidia_smi = p;
        }
        self
    }
}

/// Settings of the sharing manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharingConfig {
    /// State directory, `<plugins dir>/<driver name>` (holds `checkpoint.json` and `mps/`).
    pub state_dir: PathBuf,
    /// The same directory as the container runtime on the host sees it, when it differs
    /// (CDI mount sources are host paths). `None`: same as `state_dir`.
    pub host_state_dir: Option<PathBuf>,
    /// The tools.
    pub binaries: SharingBinaries,
    /// File with the kernel boot ID.
    pub boot_id_path: PathBuf,
    /// Where containers see the pipe directory.
    pub container_pipe_dir: String,
    /// Short directory under which each daemon's pipe directory lives
    /// (`<root>/<16 hex digits>`), seen at the same path by the host, the plugin and daemon
    /// pods, so that the control sockets' paths fit a unix socket address (107 bytes)
    /// whatever the kubelet root. `None`: `<state dir>/mps/<claim>/pipe` (tests, old layout).
    pub pipe_root: Option<PathBuf>,
    /// How long a new daemon may take to start and answer.
    pub ready_timeout: Duration,
    /// How long a daemon may take to exit after `quit` (then after SIGTERM) before it is killed.
    pub stop_timeout: Duration,
    /// Deadline of one `nvidia-smi` or control command.
    pub command_timeout: Duration,
    /// Environment added to every tool run (tests set the fakes' knobs here).
    pub extra_env: Vec<(String, String)>,
}

impl SharingConfig {
    /// Defaults: host boot ID, pipe directory `/tmp/nvidia-mps` in containers, 10 s to get
    /// ready, 5 s to stop, 10 s per command.
    pub fn new(state_dir: impl Into<PathBuf>, binaries: SharingBinaries) -> Self {
        Self {
            state_dir: state_dir.into(),
            host_state_dir: None,
            binaries,
            boot_id_path: PathBuf::from(DEFAULT_BOOT_ID_PATH),
            container_pipe_dir: mps::DEFAULT_CONTAINER_PIPE_DIR.to_owned(),
            pipe_root: None,
            ready_timeout: Duration::from_secs(10),
            stop_timeout: Duration::from_secs(5),
            command_timeout: Duration::from_secs(10),
            extra_env: Vec::new(),
        }
    }

    /// `<state dir>/mps`.
    pub fn mps_dir(&self) -> PathBuf {
        self.state_dir.join(mps::MPS_DIR)
    }
}

/// The pipe directory of daemon `key` of the driver whose state directory is `state_dir`,
/// under `pipe_root`: `<pipe_root>/<first 16 hex digits of SHA-256(state_dir, 0, key)>`.
pub fn pipe_dir_under(pipe_root: &Path, state_dir: &Path, key: &str) -> PathBuf {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(state_dir.as_os_str().as_encoded_bytes());
    h.update([0]);
    h.update(key.as_bytes());
    let digest = hex::encode(h.finalize());
    pipe_root.join(&digest[..16])
}
