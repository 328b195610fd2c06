//! GPU fixtures built from the mock NVML library's product tables (identity and MIG
//! profiles with their sources), so that no test writes a product table of its own.

use cleave_driver::model::{GpuInfo, MigInstance, MigProfile, MigState, NodeInventory, Placement};
use mock_nvml::fixtures::{MEMORY_SLICES, Product};

/// The H100 80GB HBM3 (`NVIDIA H100 80GB HBM3`).
pub const H100: &str = "h100-80gb";
/// The A100-SXM4-40GB.
pub const A100_40GB: &str = "a100-40gb";
/// The A100-SXM4-80GB.
pub const A100_80GB: &str = "a100-80gb";
/// The H200 141GB.
pub const H200: &str = "h200-141gb";
/// The L4 (no MIG).
pub const L4: &str = "l4";

/// The mock's built-in node profiles (`h100-80gb-x8`, ...).
pub use mock_nvml::fixtures::PROFILE_NAMES as NODE_PROFILES;

/// The mock's product `key` (one of the constants above); panics for an unknown one.
pub fn product(key: &str) -> &'static Product {
    mock_nvml::fixtures::product(key).unwrap_or_else(|| panic!("no mock product {key}"))
}

/// The product and GPU count of the mock's built-in node profile `profile` (one product
/// per node).
pub fn node_product(profile: &str) -> (&'static Product, usize) {
    let node = mock_nvml::fixtures::node_profile(profile, None)
        .unwrap_or_else(|e| panic!("mock node profile {profile}: {e}"));
    (node.gpus[0].product, node.gpus.len())
}

/// The architecture name discovery reports for `product`.
pub use cleave_driver::prepare::testing::architecture_name as architecture;

/// The GPU-instance profiles of product `key` as the driver models them.
pub fn mig_profiles(key: &str) -> Vec<MigProfile> {
    cleave_driver::prepare::testing::mock_profiles(key)
}

/// The GPU-instance profile `name` (`1g.10gb`) of product `key`.
pub fn mig_profile_named(key: &str, name: &str) -> MigProfile {
    mig_profiles(key)
        .into_iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("{key} has no profile {name}"))
}

/// MIG mode of a fixture GPU.
#[derive(Debug, Clone, PartialEq)]
pub enum Mig {
    /// MIG off (`NotCapable` for a product without MIG).
    Off,
    /// MIG on with these instances.
    On(Vec<MigInstance>),
}

/// UUID of fixture GPU `minor`.
pub fn gpu_uuid(minor: u32) -> String {
    cleave_driver::prepare::testing::gpu_uuid(minor)
}

/// GPU `minor` (UUID [`gpu_uuid`], PCI bus `0000:<minor + 1>:00.0`) of product `key`, as
/// discovery over NVML describes it.
pub fn gpu(key: &str, minor: u32, mig: Mig) -> GpuInfo {
    let mig = match mig {
        _ if !product(key).mig_capable() => MigState::NotCapable,
        Mig::Off => MigState::Disabled {
            profiles: mig_profiles(key),
        },
        Mig::On(instances) => MigState::Enabled {
            profiles: mig_profiles(key),
            instances,
            memory_slices: MEMORY_SLICES,
        },
    };
    cleave_driver::prepare::testing::mock_gpu(key, minor, mig)
}

/// An H100 `minor` with MIG off.
pub fn h100(minor: u32) -> GpuInfo {
    gpu(H100, minor, Mig::Off)
}

/// An H100 `minor` with MIG on and these instances.
pub fn h100_mig(minor: u32, instances: Vec<MigInstance>) -> GpuInfo {
    gpu(H100, minor, Mig::On(instances))
}

/// A node of these GPUs (the mock's default driver, R570 with CUDA 12.8).
pub fn inventory(gpus: Vec<GpuInfo>) -> NodeInventory {
    cleave_driver::prepare::testing::inventory(gpus)
}

/// MIG instance `gi_id` (compute instance 0) of profile `name` of product `key` at
/// placement `start`.
pub fn mig_instance(key: &str, name: &str, gi_id: u32, start: u32) -> MigInstance {
    let profile = mig_profile_named(key, name);
    MigInstance {
        uuid: format!("MIG-{gi_id:08x}-0000-4000-8000-{start:012x}"),
        profile_id: profile.id,
        profile_name: profile.name,
        gi_id,
        ci_id: 0,
        placement: Placement {
            start,
            size: profile.placements[0].size,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_become_gpus_as_discovery_sees_them() {
        let g = h100(3);
        assert_eq!(g.product_name, "NVIDIA H100 80GB HBM3");
        assert_eq!(g.pci_bus_id, "0000:04:00.0");
        assert_eq!(g.cuda_compute_capability, (9, 0));
        assert!(matches!(g.mig, MigState::Disabled { ref profiles } if profiles.len() == 7));
        assert_eq!(gpu(L4, 0, Mig::On(Vec::new())).mig, MigState::NotCapable);
        let one = mig_profile_named(H100, "1g.10gb");
        assert_eq!(
            (one.id, one.memory_mib, one.placements.len()),
            (19, 9984, 7)
        );
        let i = mig_instance(H100, "3g.40gb", 2, 4);
        assert_eq!((i.profile_id, i.placement.size), (9, 4));
    }
}
