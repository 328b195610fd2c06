//! `disable-device-node-modification`: stop the NVIDIA user-space libraries (libnvidia-ml,
//! nvidia-smi) from creating or changing `/dev/nvidia*` nodes inside the container. They read
//! `ModifyDeviceFiles` from `/proc/driver/nvidia/params`; the hook bind-mounts a copy of the
//! host's file with `ModifyDeviceFiles: 0` over the container's. After
//! NVIDIA/nvidia-container-toolkit cmd/nvidia-cdi-hook/disable-device-node-modification.

use std::path::{Path, PathBuf};

use crate::error::{HookError, Result};
use crate::log;
use crate::root::ContainerRoot;

/// The driver's parameter file, on the host and in the container.
pub const PARAMS_PATH: &str = "/proc/driver/nvidia/params";
const HOOK: &str = "disable-device-node-modification";

/// The params file to show the container, or `None` when the host's already says
/// `ModifyDeviceFiles: 0` or does not say `ModifyDeviceFiles: 1` (nothing to change).
pub fn modified_params(host: &str) -> Option<String> {
    let mut out = String::with_capacity(host.len());
    let mut changed = false;
    for line in host.lines() {
        if line == "ModifyDeviceFiles: 0" {
            return None;
        }
        if line == "ModifyDeviceFiles: 1" {
            out.push_str("ModifyDeviceFiles: 0\n");
            changed = true;
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    changed.then_some(out)
}

/// Reads the host's params file and computes the container's; `Ok(None)` when there is no
/// such file (no NVIDIA driver loaded) or nothing to change.
pub fn plan(host_params: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(host_params) {
        Ok(text) => Ok(modified_params(&text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(HookError::io("reading", host_params, e)),
    }
}

/// Mounts `contents` over the container's params file; returns the host path mounted on.
pub fn apply(root: &ContainerRoot, contents: &str) -> Result<PathBuf> {
    let target =
        crate::mount::bind_file_contents(root, Path::new(PARAMS_PATH), contents.as_bytes())?;
    log::line(
        HOOK,
        format_args!(
            "mounted a copy with ModifyDeviceFiles: 0 read-only on {}",
            target.display()
        ),
    );
    Ok(target)
}

/// Logs why nothing is done.
pub fn log_nothing_to_do(host_params: &Path) {
    log::line(
        HOOK,
        format_args!(
            "{} is absent or does not say ModifyDeviceFiles: 1; nothing to do",
            host_params.display()
        ),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: &str = "ResmanDebugLevel: 4294967295\nModifyDeviceFiles: 1\nDeviceFileUID: 0\nDeviceFileMode: 438\n";

    #[test]
    fn flips_modify_device_files_only() {
        assert_eq!(
            modified_params(HOST).unwrap(),
            HOST.replace("ModifyDeviceFiles: 1", "ModifyDeviceFiles: 0")
        );
    }

    #[test]
    fn nothing_to_do_when_already_off_or_absent() {
        assert_eq!(modified_params(&HOST.replace(": 1\n", ": 0\n")), None);
        assert_eq!(modified_params("DeviceFileUID: 0\n"), None);
        assert_eq!(modified_params(""), None);
    }

    #[test]
    fn missing_host_file_is_nothing_to_do() {
        let t = tempfile::tempdir().unwrap();
        assert_eq!(plan(&t.path().join("params")).unwrap(), None);
    }
}
