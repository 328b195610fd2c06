//! Finding the built mock library from tests of any workspace crate.
//!
//! Cargo names libraries with a `cdylib` crate type without the metadata hash, so the file
//! is always `libmock_nvml.so`: `cargo build -p cleave-mock-nvml` writes
//! `target/<profile>/libmock_nvml.so` and `target/<profile>/deps/libmock_nvml.so`, and a
//! crate that lists `cleave-mock-nvml` as a dev-dependency gets
//! `target/<profile>/deps/libmock_nvml.so` rebuilt before its tests (checked with
//! `cargo test -p cleave-driver --no-run`). [`cdylib_path`] finds it starting from the
//! running test binary (which lives in `target/<profile>/deps`); hashed names are accepted
//! too in case cargo changes this.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// File name of the cdylib on this platform.
pub const CDYLIB_NAME: &str = "libmock_nvml.so";

fn candidates(dir: &Path) -> Vec<(SystemTime, PathBuf)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let hit =
                name == CDYLIB_NAME || (name.starts_with("libmock_nvml-") && name.ends_with(".so"));
            if !hit {
                return None;
            }
            let t = e.metadata().ok()?.modified().ok()?;
            Some((t, e.path()))
        })
        .collect()
}

/// The newest built mock library next to the current executable (`target/<profile>/deps`
/// and `target/<profile>`), or in `$MOCK_NVML_LIB` when that names a file.
pub fn cdylib_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MOCK_NVML_LIB").map(PathBuf::from)
        && p.is_file()
    {
        return Some(p);
    }
    cdylib_near(&std::env::current_exe().ok()?)
}

/// The newest built mock library next to `exe` or in a `deps/` directory at most two
/// levels above it (the cargo target layout).
pub fn cdylib_near(exe: &Path) -> Option<PathBuf> {
    let mut found = Vec::new();
    for dir in exe.ancestors().skip(1).take(3) {
        found.extend(candidates(dir));
        found.extend(candidates(&dir.join("deps")));
    }
    found.sort();
    found.pop().map(|(_, p)| p)
}
