//! Running against the mock NVML library (`hack/mock-nvml`) instead of real GPUs: for
//! `inspect --mock`, the demo, kind clusters and tests.
//!
//! The mock reads its configuration from the environment when NVML is initialised, so
//! the profile is passed as `MOCK_NVML_PROFILE`, set before any thread starts.
#![allow(unsafe_code)]

use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// File name of the built mock library.
pub const MOCK_LIBRARY: &str = "libmock_nvml.so";

/// Finds the mock library: `$MOCK_NVML_LIB` if it names a file, else the newest
/// `libmock_nvml.so` (or cargo's hashed `libmock_nvml-*.so`) next to `exe` or in a
/// `deps/` directory at most two levels above it (the cargo target layout).
pub fn find_library(exe: &Path) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MOCK_NVML_LIB").map(PathBuf::from)
        && p.is_file()
    {
        return Some(p);
    }
    let mut found: Vec<(SystemTime, PathBuf)> = Vec::new();
    for dir in exe.ancestors().skip(1).take(3) {
        for d in [dir.to_path_buf(), dir.join("deps")] {
            let Ok(entries) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let hit = name == MOCK_LIBRARY
                    || (name.starts_with("libmock_nvml-") && name.ends_with(".so"));
                if let (true, Ok(meta)) = (hit, e.metadata())
                    && let Ok(t) = meta.modified()
                {
                    found.push((t, e.path()));
                }
            }
        }
    }
    found.sort();
    found.pop().map(|(_, p)| p)
}

/// Sets an environment variable for the mock library.
///
/// Call only while the process is single-threaded (before the tokio runtime starts).
pub fn set_env(key: &str, value: &str) {
    // SAFETY: called from `main` before any other thread exists, so no thread can be
    // reading the environment concurrently.
    unsafe { std::env::set_var(key, value) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_newest_library_in_deps() {
        let dir = tempfile::tempdir().unwrap();
        let deps = dir.path().join("debug/deps");
        std::fs::create_dir_all(&deps).unwrap();
        let exe = dir.path().join("debug/cleave-kubelet-plugin");
        std::fs::write(&exe, b"").unwrap();
        assert_eq!(
            find_library(&exe).filter(|p| p.starts_with(dir.path())),
            None
        );
        std::fs::write(deps.join("libmock_nvml-abc.so"), b"").unwrap();
        assert_eq!(
            find_library(&exe).filter(|p| p.starts_with(dir.path())),
            Some(deps.join("libmock_nvml-abc.so"))
        );
    }
}
