//! Fakes of the NVIDIA tools cleave runs on a node, for tests, benchmarks and kind:
//!
//! - [`mps_control`]: `nvidia-cuda-mps-control` (`-d` starts a detached control daemon per
//!   pipe directory; without arguments it forwards stdin commands to that daemon). The same
//!   module holds a fake CUDA client (`fake-mps-client`) that connects to such a
//!   daemon as an MPS client would (one server per UID, queueing, shared `/dev/shm`);
//! - [`nvidia_smi`]: `nvidia-smi` (`-i <id> -c <mode>`, `compute-policy -i <id>
//!   --set-timeslice <n>`, `compute-policy -l`, `-L`).
//!
//! Both record what they were asked into files named by environment variables, so tests can
//! check exactly what the driver did. The logic lives in this library so that a test or
//! benchmark binary can play the tools itself: [`dispatch`] looks at `argv[0]` and runs the
//! matching fake, which lets a harness-less test symlink its own executable under the tool
//! names (the `[[bin]]` targets are thin wrappers for kind and manual use).

pub mod mps_control;
pub mod nvidia_smi;

use std::io::Write;
use std::path::Path;

/// Runs the fake named by the file name of `args[0]` (`nvidia-cuda-mps-control`,
/// `fake-mps-client` or `nvidia-smi`) and returns its exit code; `None` when `args[0]` names neither.
pub fn dispatch(args: &[String]) -> Option<i32> {
    let name = args
        .first()
        .and_then(|a| Path::new(a).file_name())
        .and_then(|n| n.to_str())?;
    match name {
        mps_control::TOOL => Some(mps_control::run(args)),
        mps_control::CLIENT_TOOL => Some(mps_control::client_main(args)),
        nvidia_smi::TOOL => Some(nvidia_smi::run(args)),
        _ => None,
    }
}

/// Appends one line to `path` (one `write` call with `O_APPEND`, so lines of concurrent
/// writers do not interleave). Errors are ignored: recording must never change behaviour.
pub(crate) fn append_line(path: &Path, line: &str) {
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let mut buf = line.to_owned();
        buf.push('\n');
        let _ = f.write_all(buf.as_bytes());
    }
}
