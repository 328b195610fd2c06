//! The inside of an MPS daemon pod: start `nvidia-cuda-mps-control -d` for one claim, stay
//! up while it runs (streaming its `control.log`), and on request make it `quit`.
//!
//! The pod runs the plugin image, not the host's root, so the tool (a host binary under the
//! driver root) must not load the host's C library through the image's loader or the other
//! way round. [`link_libraries`] puts links to the driver's own libraries (`libcuda`,
//! `libnvidia-ml`, ...; never libc) into a scratch directory, and the tool runs with only
//! that directory on `LD_LIBRARY_PATH` and the driver root's tool directories first on
//! `PATH` (the control daemon starts `nvidia-cuda-mps-server` from there).

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::error::SharingFailure;
use super::mps::PID_FILE;
use super::process;
use crate::driver_root::{BINARY_DIRS, DriverFiles, DriverRootConfig};

/// Log file of the control daemon in its log directory.
pub const CONTROL_LOG: &str = "control.log";

/// What the supervisor runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SuperviseConfig {
    /// UID of the claim the daemon serves (for messages).
    pub claim_uid: String,
    /// `nvidia-cuda-mps-control`.
    pub control_bin: PathBuf,
    /// The driver root as this process sees it (libraries and tools).
    pub driver_root: PathBuf,
    /// Scratch directory for the library links; `None`: no links, environment unchanged.
    pub lib_dir: Option<PathBuf>,
    /// `CUDA_MPS_PIPE_DIRECTORY`.
    pub pipe_dir: PathBuf,
    /// `CUDA_MPS_LOG_DIRECTORY`.
    pub log_dir: PathBuf,
    /// More environment for the tool (`CUDA_VISIBLE_DEVICES`, ...).
    pub env: Vec<(String, String)>,
    /// Start the daemon in multi-user mode (`-d -M`).
    pub multi_user: bool,
    /// How long the daemon may take to write its pid file.
    pub start_timeout: Duration,
    /// How long it may take to exit after `quit` (then after SIGTERM) before SIGKILL.
    pub stop_timeout: Duration,
    /// Pause between checks.
    pub poll: Duration,
    /// Reap exited children of any parent (set when this process is PID 1 of a container:
    /// the daemonized tool becomes its child).
    pub reap_orphans: bool,
}

/// How supervision ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SuperviseOutcome {
    /// Stop was requested; the daemon was told to quit and is gone.
    Stopped,
    /// The daemon exited by itself (e.g. the plugin sent `quit`).
    Exited,
}

/// Links the NVIDIA libraries under `driver_root` into `lib_dir` (first found per file name,
/// absolute link targets resolved inside the driver root) and returns how many it linked.
pub(crate) fn link_libraries(driver_root: &Path, lib_dir: &Path) -> Result<usize, SharingFailure> {
    let io = |op: &'static str, path: &Path| {
        let path = path.to_owned();
        move |source| SharingFailure::Io { op, path, source }
    };
    let files = DriverFiles::discover(&DriverRootConfig::at(driver_root)).map_err(|e| {
        SharingFailure::Io {
            op: "scanning",
            path: driver_root.to_owned(),
            source: std::io::Error::other(e.to_string()),
        }
    })?;
    std::fs::create_dir_all(lib_dir).map_err(io("creating", lib_dir))?;
    let mut linked = 0;
    // Soname links too: the tool loads `libnvidia-ml.so.1`, not the versioned file.
    for lib in files
        .libraries
        .iter()
        .chain(files.library_links.iter().map(|l| &l.link))
    {
        let Some(name) = lib.relative.file_name() else {
            continue;
        };
        let link = lib_dir.join(name);
        if link.symlink_metadata().is_ok() {
            continue;
        }
        let source = driver_root.join(&lib.relative);
        let target = match std::fs::read_link(&source) {
            Ok(t) if t.is_absolute() => driver_root.join(t.strip_prefix("/").unwrap_or(&t)),
            _ => source,
        };
        std::os::unix::fs::symlink(&target, &link).map_err(io("linking", &link))?;
        linked += 1;
    }
    Ok(linked)
}

fn tool_command(config: &SuperviseConfig) -> Command {
    let mut cmd = Command::new(&config.control_bin);
    cmd.envs(config.env.iter().map(|(k, v)| (k, v)))
        .env("CUDA_MPS_PIPE_DIRECTORY", &config.pipe_dir)
        .env("CUDA_MPS_LOG_DIRECTORY", &config.log_dir);
    if let Some(lib_dir) = &config.lib_dir {
        cmd.env("LD_LIBRARY_PATH", lib_dir);
        let mut path: Vec<PathBuf> = BINARY_DIRS
            .iter()
            .map(|d| config.driver_root.join(d))
            .collect();
        if let Some(old) = std::env::var_os("PATH") {
            path.extend(std::env::split_paths(&old));
        }
        if let Ok(joined) = std::env::join_paths(path) {
            cmd.env("PATH", joined);
        }
    }
    cmd
}

fn failure(config: &SuperviseConfig, message: String) -> SharingFailure {
    SharingFailure::DaemonStart {
        claim: config.claim_uid.clone(),
        tool: config.control_bin.clone(),
        message,
    }
}

/// Copies what was appended to the control log since `offset` to `out`.
fn stream_log(path: &Path, offset: &mut u64, out: &mut dyn Write) {
    let Ok(mut f) = std::fs::File::open(path) else {
        return;
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    if len < *offset {
        *offset = 0; // truncated or replaced
    }
    if len == *offset || f.seek(SeekFrom::Start(*offset)).is_err() {
        return;
    }
    let mut buf = Vec::new();
    if let Ok(n) = f.take(1 << 20).read_to_end(&mut buf) {
        *offset += n as u64;
        let _ = out.write_all(&buf);
        let _ = out.flush();
    }
}

/// Starts the daemon and supervises it until it exits or `stop` is set (then `quit`, and
/// signals if it does not exit in time). Every wait is bounded by the configured timeouts.
pub fn supervise(
    config: &SuperviseConfig,
    stop: &AtomicBool,
    out: &mut dyn Write,
) -> Result<SuperviseOutcome, SharingFailure> {
    if let Some(lib_dir) = &config.lib_dir {
        let n = link_libraries(&config.driver_root, lib_dir)?;
        tracing::info!(libraries = n, dir = %lib_dir.display(), "linked the driver's libraries");
    }
    let _ = std::fs::remove_file(config.pipe_dir.join(PID_FILE));
    for dir in [&config.pipe_dir, &config.log_dir] {
        if let Some(closed) = super::mps::closed_parent(dir) {
            tracing::warn!(
                dir = %dir.display(),
                closed = %closed.display(),
                "MPS servers for non-root clients cannot traverse a parent of this directory; only root clients will be served"
            );
        }
    }
    let started = Instant::now();
    // Output goes where ours goes (the pod's log): the daemon it forks keeps those
    // descriptors, so a pipe here would never see its end.
    let start_args: &[&str] = if config.multi_user {
        &["-d", "-M"]
    } else {
        &["-d"]
    };
    let mut child = tool_command(config)
        .args(start_args)
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| failure(config, format!("could not run it: {e}")))?;
    let status = process::wait_child(&mut child, config.start_timeout)
        .map_err(|e| failure(config, format!("`-d` {e}")))?;
    if !status.success() {
        let hint = if config.multi_user {
            ": multi-user mode (mps.multiUser) was refused; this driver's nvidia-cuda-mps-control may not support `-M`: upgrade the driver or drop mps.multiUser"
        } else {
            ""
        };
        return Err(failure(
            config,
            format!("`{}` exited with {status}{hint}", start_args.join(" ")),
        ));
    }
    let pid = process::poll_until(config.start_timeout, || {
        std::fs::read_to_string(config.pipe_dir.join(PID_FILE))
            .ok()?
            .trim()
            .parse::<u32>()
            .ok()
    })
    .ok_or_else(|| {
        failure(
            config,
            format!("no pid file within {:?}", config.start_timeout),
        )
    })?;
    let start_time = process::start_time(pid)
        .ok_or_else(|| failure(config, format!("daemon PID {pid} exited right after start")))?;
    tracing::info!(pid, elapsed = ?started.elapsed(), "MPS control daemon started");

    let log = config.log_dir.join(CONTROL_LOG);
    let mut offset = 0;
    let alive = || {
        if config.reap_orphans {
            process::reap_children();
        }
        process::is_alive(pid, Some(start_time))
    };
    loop {
        stream_log(&log, &mut offset, out);
        if !alive() {
            tracing::info!(pid, "MPS control daemon exited");
            return Ok(SuperviseOutcome::Exited);
        }
        if stop.load(Ordering::SeqCst) {
            break;
        }
        std::thread::sleep(config.poll);
    }

    tracing::info!(pid, "stopping the MPS control daemon");
    match process::run_with_input(&mut tool_command(config), "quit\n", config.stop_timeout) {
        Ok(o) if o.status.success() => {}
        Ok(o) => tracing::warn!(status = %o.status, output = %o.stdout.trim(), "quit was refused"),
        Err(e) => tracing::warn!(error = %e, "quit failed"),
    }
    for (signal, wait) in [
        (None, config.stop_timeout),
        (Some(libc::SIGTERM), config.stop_timeout),
        (Some(libc::SIGKILL), Duration::from_secs(2)),
    ] {
        if let Some(signal) = signal {
            tracing::warn!(pid, signal, "MPS control daemon still runs; signalling it");
            let _ = process::signal(pid, Some(start_time), signal);
        }
        if process::poll_until(wait, || (!alive()).then_some(())).is_some() {
            stream_log(&log, &mut offset, out);
            return Ok(SuperviseOutcome::Stopped);
        }
    }
    Err(SharingFailure::DaemonStop {
        daemon: format!("PID {pid}"),
        message: "still running after SIGKILL".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_driver_libraries_are_linked_and_absolute_links_stay_in_the_root() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let libs = root.join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&libs).unwrap();
        std::fs::write(libs.join("libcuda.so.550.54"), "cuda").unwrap();
        std::os::unix::fs::symlink("libcuda.so.550.54", libs.join("libcuda.so.1")).unwrap();
        std::fs::write(libs.join("libnvidia-ml.so.550.54"), "nvml").unwrap();
        // An absolute link means a path in the driver root, not in this container.
        std::os::unix::fs::symlink(
            "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54",
            libs.join("libnvidia-ml.so.1"),
        )
        .unwrap();
        std::fs::write(libs.join("libc.so.6"), "host libc").unwrap();
        let lib_dir = tmp.path().join("lib");

        assert_eq!(link_libraries(&root, &lib_dir).unwrap(), 4);
        let read = |name: &str| std::fs::read_to_string(lib_dir.join(name)).unwrap();
        assert_eq!(read("libcuda.so.1"), "cuda");
        assert_eq!(read("libnvidia-ml.so.1"), "nvml");
        assert_eq!(
            std::fs::read_link(lib_dir.join("libnvidia-ml.so.1")).unwrap(),
            libs.join("libnvidia-ml.so.550.54")
        );
        assert!(
            !lib_dir.join("libc.so.6").exists(),
            "never the host's C library"
        );
        // Again (container restart with the same scratch dir): nothing new, no error.
        assert_eq!(link_libraries(&root, &lib_dir).unwrap(), 0);
    }
}
