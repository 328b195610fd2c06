//! Driver roots laid out like a real host (device nodes, libraries with soname links, tools,
//! `proc/devices`, `mig-minors`), and node driver settings over one.

use std::path::{Path, PathBuf};

use cleave_driver::prepare::DriverConfig;
use mock_nvml::driver_root::DriverRootFixture;

/// Lays out a driver root like an Ubuntu host with 8 GPUs (minors 0..7). Idempotent.
pub fn lay_out(root: &Path) {
    DriverRootFixture::with_minors(0..8)
        .lay_out(root)
        .expect("laying out the test driver root");
}

/// Lays out a driver root like an Ubuntu host with the GPUs of a built-in mock `profile`
/// (8 GPUs for an unknown one), with `nvml` installed as the root's NVML library
/// (`libnvidia-ml.so.<version>` and its soname link) or an empty file. Idempotent, and
/// fakes a test put into `usr/bin` stay.
pub fn lay_out_profile(root: &Path, profile: &str, nvml: Option<PathBuf>) {
    DriverRootFixture {
        nvml,
        ..DriverRootFixture::for_profile(profile)
            .unwrap_or_else(|| DriverRootFixture::with_minors(0..8))
    }
    .lay_out(root)
    .expect("laying out the test driver root");
}

/// Driver settings of a simulated node in `root` (pool `node-a`, dynamic MIG): driver and
/// dev root `root/driver-root` laid out by [`lay_out`], proc root `root/proc`, CDI specs in
/// `root/cdi`, boot ID read from `root/boot_id`, state in `state_dir`.
pub fn node_config(root: &Path, state_dir: PathBuf) -> DriverConfig {
    let config = cleave_driver::prepare::testing::config_with_empty_root(root, true);
    lay_out(&config.driver_root.root);
    DriverConfig {
        state_dir,
        ..config
    }
}
