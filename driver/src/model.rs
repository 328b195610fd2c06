//! The node's device model: what discovery finds (GPUs, MIG capability, profiles,
//! placements, existing instances). Plain data; built by `discovery`, consumed by the
//! pool builder, the prepare state machine and `inspect`.

use serde::{Deserialize, Serialize};

/// Which ResourceClaim: the one identity the kubelet, the prepare state machine, the
/// checkpoint summary and usage sampling share. A claim recreated under the same name has
/// another UID, so all three fields matter.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClaimRef {
    /// Namespace of the claim.
    pub namespace: String,
    /// Name of the claim.
    pub name: String,
    /// UID of the claim object.
    pub uid: String,
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} ({})", self.namespace, self.name, self.uid)
    }
}

/// Everything discovered on the node at one moment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeInventory {
    /// Kernel driver version as NVML reports it, e.g. `570.148.08`.
    pub driver_version: String,
    /// Kernel driver version as a semantic version, e.g. `570.148.8`.
    pub driver_semver: String,
    /// CUDA driver API version as a semantic version, e.g. `12.8.0`.
    pub cuda_driver_semver: String,
    /// GPUs in order of their minor number.
    pub gpus: Vec<GpuInfo>,
}

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// NVML index (unstable across reboots; never published).
    pub index: u32,
    /// Minor number of `/dev/nvidia<minor>`; names the device (`gpu-<minor>`).
    pub minor: u32,
    /// `GPU-...` UUID.
    pub uuid: String,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub product_name: String,
    /// Brand name, e.g. `Nvidia`, `Tesla`.
    pub brand: String,
    /// Architecture name, e.g. `Ampere`, `Hopper`, `Ada`.
    pub architecture: String,
    /// CUDA compute capability (major, minor).
    pub cuda_compute_capability: (u32, u32),
    /// Total memory in bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessors of the whole GPU, when known.
    pub multiprocessors: Option<u32>,
    /// PCI bus ID in the canonical lowercase form `0000:53:00.0`.
    pub pci_bus_id: String,
    /// PCIe root complex (`pci0000:50`), when it can be resolved from sysfs.
    pub pcie_root: Option<String>,
    /// NUMA node of the GPU's PCI device from sysfs (`numa_node`); `None` when sysfs says
    /// `-1` (no affinity) or does not have it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// MIG capability and state.
    pub mig: MigState,
}

/// MIG capability and state of a GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "camelCase")]
pub enum MigState {
    /// The GPU cannot do MIG.
    NotCapable,
    /// MIG capable but MIG mode is off; `profiles` still lists what it could do.
    Disabled {
        /// Supported GPU-instance profiles.
        profiles: Vec<MigProfile>,
    },
    /// MIG mode is on.
    Enabled {
        /// Supported GPU-instance profiles with their placements.
        profiles: Vec<MigProfile>,
        /// MIG devices that exist now (GPU instance + compute instance).
        instances: Vec<MigInstance>,
        /// Number of memory slices of the GPU (8 on A100/H100/H200).
        memory_slices: u32,
    },
}

impl MigState {
    /// True if MIG mode is enabled.
    pub fn is_enabled(&self) -> bool {
        matches!(self, Self::Enabled { .. })
    }

    /// True if the GPU supports MIG: it answers its MIG mode, and with MIG enabled its
    /// profiles can be read (a MIG-enabled GPU whose profile queries all fail is not offered
    /// as MIG-capable). With MIG off, NVML may answer no profile at all (nvml.h: the
    /// versioned profile query is "not supported if device doesn't have MIG mode enabled").
    pub fn is_capable(&self) -> bool {
        match self {
            Self::NotCapable => false,
            Self::Disabled { .. } => true,
            Self::Enabled { profiles, .. } => !profiles.is_empty(),
        }
    }
}

/// One GPU-instance profile as NVML describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigProfile {
    /// NVML profile id (`info.id`, the ID `nvidia-smi mig -lgip` prints: 19, 15, 14, 9, 5, 0 ...).
    pub id: u32,
    /// Profile name, e.g. `1g.10gb`, `1g.10gb+me`.
    pub name: String,
    /// GPU (compute) slices, the `g` number.
    pub slice_count: u32,
    /// Maximum number of instances of this profile.
    pub instance_count: u32,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Copy engines.
    pub copy_engines: u32,
    /// Video decoders.
    pub decoders: u32,
    /// Video encoders.
    pub encoders: u32,
    /// JPEG engines.
    pub jpeg_engines: u32,
    /// Optical-flow engines.
    pub ofa_engines: u32,
    /// Valid placements in memory slices.
    pub placements: Vec<Placement>,
}

/// A MIG placement: `size` memory slices starting at `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Placement {
    /// First memory slice.
    pub start: u32,
    /// Number of memory slices.
    pub size: u32,
}

impl Placement {
    /// True if the two placements share a memory slice.
    pub fn overlaps(&self, other: &Placement) -> bool {
        self.start < other.start + other.size && other.start < self.start + self.size
    }
}

/// A GPU instance without any compute instance: no MIG device, yet its placement is
/// taken on the GPU (NVML refuses another instance there with insufficient resources).
/// Left by a crash or a failed rollback between `nvmlDeviceCreateGpuInstanceWithPlacement`
/// and `nvmlGpuInstanceCreateComputeInstance`, or between the two destroys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BareGpuInstance {
    /// GPU instance id.
    pub gi_id: u32,
    /// NVML profile id of the GPU instance.
    pub profile_id: u32,
    /// Placement of the GPU instance.
    pub placement: Placement,
}

/// An existing MIG device: a GPU instance with one compute instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigInstance {
    /// `MIG-...` UUID of the MIG device.
    pub uuid: String,
    /// NVML profile id of the GPU instance.
    pub profile_id: u32,
    /// Profile name.
    pub profile_name: String,
    /// GPU instance id.
    pub gi_id: u32,
    /// Compute instance id.
    pub ci_id: u32,
    /// Placement of the GPU instance.
    pub placement: Placement,
}
