//! Installing cleave's CDI hook on the node.
//!
//! The hooks in a claim's CDI spec are run by the container runtime on the host, so the
//! program must exist at a host path: the plugin copies the `cleave-cdi-hook` binary that
//! ships beside it (the image's `/usr/bin/cleave-cdi-hook`) into its state directory
//! (`<plugins dir>/<driver>/bin/`, a hostPath seen at the same path on the host, as NVIDIA's
//! plugin copies `nvidia-cdi-hook`). The copy is atomic and replaced only when its bytes
//! differ, so a runtime never executes a half-written file.

use std::path::{Path, PathBuf};

use cleave_driver::driver_root::CDI_HOOK_NAME;
use tracing::info;

/// Why the CDI hook could not be installed; each message says how to fix it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CdiHookError {
    /// The running executable's path is unknown, so the hook beside it cannot be found.
    #[error(
        "finding this executable (to find the CDI hook beside it); name the hook with --cdi-hook-source"
    )]
    CurrentExe(#[source] std::io::Error),
    /// The running executable's path has no directory.
    #[error("{0} has no directory; name the CDI hook with --cdi-hook-source")]
    NoDirectory(PathBuf),
    /// The hook's source cannot be read.
    #[error(
        "reading the CDI hook {path}: it ships beside the plugin binary (the image's /usr/bin/{CDI_HOOK_NAME}; `cargo build -p cleave-kubelet-plugin` builds both); name it with --cdi-hook-source, or pass --disable-cdi-hooks to write CDI specs without hooks (containers then depend on their image's loader cache)"
    )]
    Read {
        /// The hook's source path.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The hook's directory in the state directory cannot be created.
    #[error("creating {path}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The hook cannot be written to the state directory.
    #[error("installing the CDI hook at {path}")]
    Write {
        /// The installed path.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
}

/// The hook's source: `configured` (`--cdi-hook-source`), else the hook beside the running
/// executable (see [`default_source`]).
pub(crate) fn source_path(configured: Option<&Path>) -> Result<PathBuf, CdiHookError> {
    if let Some(s) = configured {
        return Ok(s.to_path_buf());
    }
    let exe = std::env::current_exe().map_err(CdiHookError::CurrentExe)?;
    default_source(&exe).ok_or(CdiHookError::NoDirectory(exe))
}

/// The hook binary shipped beside `exe` (the running plugin), or one directory up when
/// `exe` is a cargo test or bench binary in `target/<profile>/deps`.
pub(crate) fn default_source(exe: &Path) -> Option<PathBuf> {
    let dir = exe.parent()?;
    let beside = dir.join(CDI_HOOK_NAME);
    if !beside.exists()
        && dir.file_name().is_some_and(|n| n == "deps")
        && let Some(up) = dir.parent().map(|p| p.join(CDI_HOOK_NAME))
        && up.exists()
    {
        return Some(up);
    }
    Some(beside)
}

/// Copies the hook `source` to `<state_dir>/bin/cleave-cdi-hook` (mode 0755) unless an
/// identical copy is there, and returns the installed path (also its host path).
pub(crate) fn install(source: &Path, state_dir: &Path) -> Result<PathBuf, CdiHookError> {
    let bytes = std::fs::read(source).map_err(|e| CdiHookError::Read {
        path: source.to_path_buf(),
        source: e,
    })?;
    let dir = state_dir.join("bin");
    let target = dir.join(CDI_HOOK_NAME);
    if std::fs::read(&target).is_ok_and(|old| old == bytes) {
        return Ok(target);
    }
    std::fs::create_dir_all(&dir).map_err(|e| CdiHookError::CreateDir {
        path: dir.clone(),
        source: e,
    })?;
    cleave_driver::checkpoint::write_file_atomic_mode(&target, &bytes, 0o755).map_err(|e| {
        CdiHookError::Write {
            path: target.clone(),
            source: e,
        }
    })?;
    info!(source = %source.display(), path = %target.display(), bytes = bytes.len(), "installed the CDI hook");
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn installs_once_and_replaces_a_changed_copy() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("hook-src");
        std::fs::write(&source, b"v1").unwrap();
        let state = dir.path().join("state");
        let path = install(&source, &state).unwrap();
        assert_eq!(path, state.join("bin/cleave-cdi-hook"));
        assert_eq!(std::fs::read(&path).unwrap(), b"v1");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o755);
        let before = std::fs::metadata(&path).unwrap().modified().unwrap();
        install(&source, &state).unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().modified().unwrap(),
            before
        );
        std::fs::write(&source, b"v2").unwrap();
        install(&source, &state).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"v2");
        let e = install(&dir.path().join("missing"), &state).unwrap_err();
        assert!(format!("{e:#}").contains("--disable-cdi-hooks"), "{e:#}");
    }
}
