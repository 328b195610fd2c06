//! The fake `nvidia-cuda-mps-control` and `nvidia-smi` of `cleave-fakes`, played by the test
//! binary itself (see [`crate::runner`]): installed under a driver root or a `bin`
//! directory, with the files they record into.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use cleave_driver::sharing::{SharingBinaries, SharingConfig};
use cleave_fakes::{mps_control, nvidia_smi};

/// The tools a node runs for MPS and time-slicing.
pub const TOOLS: [&str; 2] = [mps_control::TOOL, nvidia_smi::TOOL];

/// Writes shell wrappers for [`TOOLS`] into `bin` that run this executable as
/// `<exe> __fake <tool path> <args>...`: for processes that run the tools by path from a
/// driver root (the plugin binary, containers), where a symlink would not be followed.
pub fn install_wrappers(bin: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(bin)?;
    let exe = std::env::current_exe()?;
    let exe = exe.display().to_string().replace('\'', r"'\''");
    for tool in TOOLS {
        let path = bin.join(tool);
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\nexec '{exe}' {} \"$0\" \"$@\"\n",
                crate::runner::FAKE_TOOL_ARG
            ),
        )?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}

/// Symlinks [`TOOLS`] in `bin` to this executable, which plays the tool its `argv[0]` names.
pub fn install_links(bin: &Path) {
    std::fs::create_dir_all(bin).unwrap();
    let exe = std::env::current_exe().unwrap();
    for tool in TOOLS {
        std::os::unix::fs::symlink(&exe, bin.join(tool)).unwrap();
    }
}

/// The files the fakes record into and keep their state in, all in one directory.
#[derive(Debug, Clone)]
pub struct FakeFiles {
    dir: PathBuf,
}

impl FakeFiles {
    /// The fakes' files in `dir` (a test's own temporary directory).
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
        }
    }

    /// What the fake MPS control recorded (`FAKE_MPS_RECORD`).
    pub fn mps_record(&self) -> PathBuf {
        self.dir.join("fake-mps-record.log")
    }

    /// What the fake `nvidia-smi` recorded (`FAKE_NVIDIA_SMI_RECORD`).
    pub fn smi_record(&self) -> PathBuf {
        self.dir.join("fake-smi-record.log")
    }

    /// The GPU settings the fake `nvidia-smi` made (`FAKE_NVIDIA_SMI_STATE`).
    pub fn smi_state(&self) -> PathBuf {
        self.dir.join("fake-smi-state")
    }

    /// The fakes' environment, for the process that runs them and every container: record
    /// and state files, and an idle exit after 60 s so that a daemon a failed test leaves
    /// behind ends by itself.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        self.env_with_idle_exit(60)
    }

    /// [`Self::env`] with the daemons' idle exit after `secs` seconds.
    pub fn env_with_idle_exit(&self, secs: u32) -> Vec<(&'static str, String)> {
        let s = |p: PathBuf| p.display().to_string();
        vec![
            (mps_control::ENV_RECORD, s(self.mps_record())),
            (mps_control::ENV_IDLE_EXIT_SECS, secs.to_string()),
            (nvidia_smi::ENV_RECORD, s(self.smi_record())),
            (nvidia_smi::ENV_STATE, s(self.smi_state())),
        ]
    }

    /// The lines the fake MPS control recorded so far.
    pub fn mps_lines(&self) -> Vec<String> {
        std::fs::read_to_string(self.mps_record())
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// PIDs of every MPS daemon the fake started.
    pub fn started_pids(&self) -> Vec<u32> {
        crate::process::started_pids(&self.mps_record())
    }

    /// Kills every MPS daemon the fake started that still runs (for a test's `Drop`).
    pub fn kill_started(&self) {
        for pid in self.started_pids() {
            crate::process::kill(pid);
        }
    }
}

/// The fake tools of a node the driver's sharing manager runs in a test: links to this
/// test binary in `<root>/bin`, the fakes' files in `root`, a boot ID file `<root>/boot_id`.
#[derive(Debug, Clone)]
pub struct NodeTools {
    root: PathBuf,
    /// The files the fakes record into.
    pub files: FakeFiles,
}

impl NodeTools {
    /// Installs the tools under `root` and writes the boot ID `boot-1`.
    pub fn install(root: &Path) -> Self {
        install_links(&root.join("bin"));
        std::fs::write(root.join("boot_id"), "boot-1\n").unwrap();
        Self::at(root)
    }

    /// The tools [`Self::install`] put under `root` (for another process of the test).
    pub fn at(root: &Path) -> Self {
        Self {
            root: root.to_owned(),
            files: FakeFiles::in_dir(root),
        }
    }

    /// The fake `nvidia-cuda-mps-control`.
    pub fn mps_control(&self) -> PathBuf {
        self.root.join("bin").join(mps_control::TOOL)
    }

    /// The fake `nvidia-smi`.
    pub fn nvidia_smi(&self) -> PathBuf {
        self.root.join("bin").join(nvidia_smi::TOOL)
    }

    /// The kernel boot ID file.
    pub fn boot_id(&self) -> PathBuf {
        self.root.join("boot_id")
    }

    /// Sharing settings that run these tools with state in `state` and the boot ID of
    /// [`Self::boot_id`]: a daemon is ready within 10 s and stops within 3 s; the fakes'
    /// environment (daemons exit after 120 s idle) and then `knobs` (which win).
    pub fn sharing_config(&self, state: &Path, knobs: &[(&str, &str)]) -> SharingConfig {
        let binaries = SharingBinaries::under_driver_root(Path::new("/nonexistent"))
            .with_overrides(Some(self.mps_control()), Some(self.nvidia_smi()));
        let mut config = SharingConfig::new(state, binaries);
        config.boot_id_path = self.boot_id();
        config.ready_timeout = std::time::Duration::from_secs(10);
        config.stop_timeout = std::time::Duration::from_secs(3);
        config.extra_env = self
            .files
            .env_with_idle_exit(120)
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .chain(
                knobs
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
            )
            .collect();
        config
    }
}

/// A node in a temporary directory of its own whose sharing manager runs the fake tools:
/// [`NodeTools`] under `root`, state in `root/state`. No fake daemon outlives it.
#[derive(Debug)]
pub struct ToolNode {
    _tmp: tempfile::TempDir,
    /// The node's directory.
    pub root: PathBuf,
    /// The driver's state directory (created).
    pub state: PathBuf,
    /// The fake tools and their files.
    pub tools: NodeTools,
}

impl ToolNode {
    /// A fresh node.
    pub fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_owned();
        let tools = NodeTools::install(&root);
        let state = root.join("state");
        std::fs::create_dir_all(&state).unwrap();
        Self {
            _tmp: tmp,
            root,
            state,
            tools,
        }
    }
}

impl Default for ToolNode {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for ToolNode {
    fn drop(&mut self) {
        // Whatever happened, no fake daemon outlives its test.
        self.tools.files.kill_started();
    }
}
