//! Running against the mock NVML library (`hack/mock-nvml`) instead of real GPUs, for
//! development only (the `mock` cargo feature; the shipped binary is built without it):
//! `--mock PROFILE` and `--mock-profile` of `run` and `inspect`, `usage --mock`, the demo,
//! the benches and the tests.
//!
//! The mock reads its configuration from the environment when NVML is initialised, so
//! the profile is passed as `MOCK_NVML_PROFILE`, set before any thread starts.
#![allow(unsafe_code)]

mod claims;
mod recommend_try;
mod usage_try;

use std::path::{Path, PathBuf};

use crate::args::NvmlArgs;

use mock_nvml::locate::CDYLIB_NAME as MOCK_LIBRARY;
pub(crate) use usage_try::UsageTry;

/// Finds the mock library: `$MOCK_NVML_LIB` if it names a file, else the newest
/// `libmock_nvml.so` next to `exe` or in the cargo target layout above it.
pub fn find_library(exe: &Path) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MOCK_NVML_LIB").map(PathBuf::from)
        && p.is_file()
    {
        return Some(p);
    }
    mock_nvml::locate::cdylib_near(exe)
}

/// Sets an environment variable for the mock library.
///
/// Call only while the process is single-threaded (before the tokio runtime starts).
pub fn set_env(key: &str, value: &str) {
    // SAFETY: called from `main` before any other thread exists, so no thread can be
    // reading the environment concurrently.
    unsafe { std::env::set_var(key, value) };
}

/// The mock library next to this executable, or an error saying how to build it.
fn library_for(flag: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    find_library(&exe).ok_or_else(|| {
        anyhow::anyhow!(
            "{flag}: no {MOCK_LIBRARY} next to {} (build it with `cargo build -p cleave-mock-nvml`)",
            exe.display()
        )
    })
}

/// Resolves `--mock` to a library path and applies the mock profile to the environment.
/// Call before any thread starts.
pub(crate) fn resolve_nvml(nvml: &mut NvmlArgs) -> anyhow::Result<()> {
    if let Some(profile) = nvml.mock.take() {
        nvml.nvml_lib = Some(library_for("--mock")?);
        nvml.mock_profile = Some(profile);
    }
    if let Some(profile) = &nvml.mock_profile {
        set_env("MOCK_NVML_PROFILE", profile);
    }
    Ok(())
}
