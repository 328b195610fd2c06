//! Test support shared by cleave's crates, so that no crate writes its own: driver roots
//! laid out like a real host ([`driver_root`]), GPU fixtures built from the mock NVML
//! library's product tables ([`gpu`]), the fake NVIDIA tools played by a test binary
//! ([`fake_tools`]), the API server stand-in with a node ([`standin`]), the runner of
//! harness-less tests ([`runner`]), scenario child processes ([`child`]) and process checks
//! ([`process`]).
//!
//! A dev-dependency only: no shipped crate depends on it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod admission;
pub mod allocator;
pub mod cel_env;
pub mod child;
pub mod driver_root;
pub mod fake_tools;
pub mod gpu;
pub mod process;
pub mod runner;
pub mod standin;

use std::path::PathBuf;

/// Finds the built mock NVML library (`libmock_nvml.so`) from a test binary.
pub use mock_nvml::locate;

/// Path of the built mock NVML library; panics when it was not built (a crate whose tests
/// load it lists `cleave-mock-nvml` as a dev-dependency, which builds it).
pub fn mock_lib() -> PathBuf {
    locate::cdylib_path()
        .expect("mock NVML library not built (add cleave-mock-nvml as a dev-dependency)")
}

/// Sets an environment variable of this process. Only for the start of a test or bench
/// binary's `main`, before it starts any thread (nothing may read the environment meanwhile).
#[allow(unsafe_code)]
pub fn set_env(key: &str, value: &str) {
    // SAFETY: the caller runs before any other thread exists, so no thread can be reading
    // the environment concurrently.
    unsafe { std::env::set_var(key, value) };
}
