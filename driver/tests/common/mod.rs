//! Glue for the driver's integration tests over the test kit: scenarios in child processes
//! (the mock NVML library reads its configuration from the process environment), driver
//! roots and node settings, the mock library.

#![allow(dead_code, unused_imports)]

use cleave_driver::model::{GpuInfo, NodeInventory};
use cleave_driver::prepare::PreparedClaim;

pub use cleave_testkit::child::{
    CHILD_TIMEOUT, SCENARIO_ENV, child_tmp, log_to_stderr, run_child, scenario, try_run_child,
};
pub use cleave_testkit::driver_root::{lay_out as lay_out_driver_root, node_config};
pub use cleave_testkit::gpu::NODE_PROFILES as PROFILES;
pub use cleave_testkit::mock_lib;

/// The GPU with minor `minor`.
pub fn gpu(inv: &NodeInventory, minor: u32) -> &GpuInfo {
    inv.gpus
        .iter()
        .find(|g| g.minor == minor)
        .unwrap_or_else(|| panic!("no GPU with minor {minor}"))
}

/// The CDI device IDs a prepare answered, in order.
pub fn cdi_ids(prepared: &PreparedClaim) -> Vec<String> {
    prepared
        .devices
        .iter()
        .flat_map(|d| d.cdi_device_ids.clone())
        .collect()
}
