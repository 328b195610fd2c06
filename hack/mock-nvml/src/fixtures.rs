//! Product tables (identity and MIG profiles) and node fixtures (which GPUs exist).
//!
//! Every number comes from a public source; the comments name the topic of
//! `docs/hardware-sources.md` (repository root) that lists the capture or document behind it.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// `NVML_DEVICE_ARCH_AMPERE` (NVML constants, docs/hardware-sources.md).
pub const ARCH_AMPERE: u32 = 7;
/// `NVML_DEVICE_ARCH_ADA` (NVML constants, docs/hardware-sources.md).
pub const ARCH_ADA: u32 = 8;
/// `NVML_DEVICE_ARCH_HOPPER` (NVML constants, docs/hardware-sources.md).
pub const ARCH_HOPPER: u32 = 9;
/// `NVML_BRAND_NVIDIA` (NVML constants, docs/hardware-sources.md; QX captures report brand NVIDIA).
pub const BRAND_NVIDIA: u32 = 14;

/// Driver version reported by default (the QX A100 capture's driver, device identity, docs/hardware-sources.md).
pub const DEFAULT_DRIVER_VERSION: &str = "570.148.08";
/// CUDA driver version reported by default (12.8, the CUDA version of the R570 branch).
pub const DEFAULT_CUDA_DRIVER_VERSION: i32 = 12080;
/// Built-in node profile used when neither `MOCK_NVML_PROFILE` nor `MOCK_NVML_CONFIG` is set.
pub const DEFAULT_PROFILE: &str = "h100-80gb-x8";
/// Names of the built-in node profiles.
pub const PROFILE_NAMES: &[&str] = &[
    "a100-40gb-x8",
    "a100-80gb-x4",
    "h100-80gb-x8",
    "h200-141gb-x8",
    "l4-x2",
];

/// Number of memory slices on every MIG-capable part modelled here (MIG profile tables, docs/hardware-sources.md).
pub const MEMORY_SLICES: u32 = 8;
/// `NVML_GPU_INSTANCE_PROFILE_COUNT` as in nvml-wrapper-sys 0.10 / nvml.h 13.0 (0x11).
pub const GPU_INSTANCE_PROFILE_COUNT: u32 = 0x11;
/// `NVML_COMPUTE_INSTANCE_PROFILE_COUNT` as in nvml-wrapper-sys 0.10 / nvml.h 13.0 (0x8).
pub const COMPUTE_INSTANCE_PROFILE_COUNT: u32 = 0x8;

/// One GPU-instance profile row of `nvidia-smi mig -lgip` plus its `-lgipp` placements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GiProfile {
    /// `NVML_GPU_INSTANCE_PROFILE_*` enum used to query it.
    pub enum_index: u32,
    /// The lgip ID (`info.id`), which `nvmlDeviceCreateGpuInstance` takes.
    pub id: u32,
    /// Profile name as nvidia-smi prints it without the `MIG ` prefix.
    pub name: &'static str,
    /// Compute slices (`sliceCount`, the `g` number).
    pub slice_count: u32,
    /// Maximum simultaneous instances (`instanceCount`).
    pub instance_count: u32,
    /// `multiprocessorCount`.
    pub sm: u32,
    /// `copyEngineCount`.
    pub ce: u32,
    /// `decoderCount`.
    pub dec: u32,
    /// `encoderCount`.
    pub enc: u32,
    /// `jpegCount`.
    pub jpg: u32,
    /// `ofaCount`.
    pub ofa: u32,
    /// `memorySizeMB` (MiB).
    pub memory_mib: u64,
    /// Memory slices a placement occupies (`placement.size`).
    pub placement_size: u32,
    /// Valid placement starts (memory slice index).
    pub starts: &'static [u32],
}

/// One product (GPU model) with identity values and, for MIG parts, its profile table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Product {
    /// Key used in YAML fixtures (`product:`).
    pub key: &'static str,
    /// `nvmlDeviceGetName`.
    pub name: &'static str,
    /// `pciDeviceId` (device << 16 | vendor).
    pub pci_device_id: u32,
    /// `pciSubSystemId`.
    pub pci_subsystem_id: u32,
    /// Total memory as the v2 memory info reports it (MiB).
    pub memory_mib: u64,
    /// Reserved memory (v2 `reserved`, MiB).
    pub reserved_mib: u64,
    /// Full-GPU streaming multiprocessors (CUDA deviceQuery).
    pub sm_count: u32,
    /// CUDA cores per SM (for `nvmlDeviceGetNumGpuCores`).
    pub cores_per_sm: u32,
    /// CUDA compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// `nvmlDeviceArchitecture_t`.
    pub architecture: u32,
    /// `nvmlBrandType_t`.
    pub brand: u32,
    /// MIG GPU-instance profiles; empty for parts without MIG.
    pub mig_profiles: &'static [GiProfile],
}

impl Product {
    /// True when the part supports MIG.
    pub fn mig_capable(&self) -> bool {
        !self.mig_profiles.is_empty()
    }

    /// The GPU-instance profile with lgip ID `id`.
    pub fn profile_by_id(&self, id: u32) -> Option<&'static GiProfile> {
        self.mig_profiles.iter().find(|p| p.id == id)
    }

    /// The GPU-instance profile queried with `NVML_GPU_INSTANCE_PROFILE_*` value `e`.
    pub fn profile_by_enum(&self, e: u32) -> Option<&'static GiProfile> {
        self.mig_profiles.iter().find(|p| p.enum_index == e)
    }
}

const S1: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const S2Q: &[u32] = &[0, 2, 4, 6];
const S2: &[u32] = &[0, 2, 4];
const S3: &[u32] = &[0, 4];
const S0: &[u32] = &[0];

#[allow(clippy::too_many_arguments)]
const fn gi(
    enum_index: u32,
    id: u32,
    name: &'static str,
    slice_count: u32,
    instance_count: u32,
    memory_mib: u64,
    sm: u32,
    engines: [u32; 5],
    placement_size: u32,
    starts: &'static [u32],
) -> GiProfile {
    GiProfile {
        enum_index,
        id,
        name,
        slice_count,
        instance_count,
        sm,
        ce: engines[0],
        dec: engines[1],
        enc: engines[2],
        jpg: engines[3],
        ofa: engines[4],
        memory_mib,
        placement_size,
        starts,
    }
}

// Enum -> lgip ID mapping 0->19, 7->20, 9->15, 1->14, 2->9, 3->5, 4->0: MIG profile naming, docs/hardware-sources.md.
// Placements {0..6}:1, {0,2,4,6}:2, {0,2,4}:2, {0,4}:4, {0}:4, {0}:8: MIG profile tables, docs/hardware-sources.md.
// Engine arrays are [CE, DEC, ENC, JPG, OFA].

/// A100-SXM4-40GB, MIG profile tables, docs/hardware-sources.md. Memory column: the newer-driver set from go-nvml
/// b72647c (driver 550.54.15): 4864/4864/9856/9856/19968/19968/40192 MiB, chosen because
/// the mock advertises an R570 driver.
const A100_40GB_PROFILES: &[GiProfile] = &[
    gi(0, 19, "1g.5gb", 1, 7, 4864, 14, [1, 0, 0, 0, 0], 1, S1),
    gi(7, 20, "1g.5gb+me", 1, 1, 4864, 14, [1, 1, 0, 1, 1], 1, S1),
    gi(9, 15, "1g.10gb", 1, 4, 9856, 14, [1, 1, 0, 0, 0], 2, S2Q),
    gi(1, 14, "2g.10gb", 2, 3, 9856, 28, [2, 1, 0, 0, 0], 2, S2),
    gi(2, 9, "3g.20gb", 3, 2, 19968, 42, [3, 2, 0, 0, 0], 4, S3),
    gi(3, 5, "4g.20gb", 4, 1, 19968, 56, [4, 2, 0, 0, 0], 4, S0),
    gi(4, 0, "7g.40gb", 7, 1, 40192, 98, [7, 5, 0, 1, 1], 8, S0),
];

/// A100-SXM4-80GB, MIG profile tables, docs/hardware-sources.md. Memory column: the newer driver (mig-parted#97:
/// 9728/9728/19968, 3g 39.25 GiB = 40192); 4g uses 40192 like 3g (UNVERIFIED), 1g.20gb
/// uses 19968 like 2g (UNVERIFIED), 7g 81152 (only capture, MLSysOps/MIGProfiler).
const A100_80GB_PROFILES: &[GiProfile] = &[
    gi(0, 19, "1g.10gb", 1, 7, 9728, 14, [1, 0, 0, 0, 0], 1, S1),
    gi(7, 20, "1g.10gb+me", 1, 1, 9728, 14, [1, 1, 0, 1, 1], 1, S1),
    gi(9, 15, "1g.20gb", 1, 4, 19968, 14, [1, 1, 0, 0, 0], 2, S2Q),
    gi(1, 14, "2g.20gb", 2, 3, 19968, 28, [2, 1, 0, 0, 0], 2, S2),
    gi(2, 9, "3g.40gb", 3, 2, 40192, 42, [3, 2, 0, 0, 0], 4, S3),
    gi(3, 5, "4g.40gb", 4, 1, 40192, 56, [4, 2, 0, 0, 0], 4, S0),
    gi(4, 0, "7g.80gb", 7, 1, 81152, 98, [7, 5, 0, 1, 1], 8, S0),
];

/// H100 80GB HBM3, MIG profile tables, docs/hardware-sources.md (nvidia-smi -lgip/-lgipp on real H100, one column).
const H100_80GB_PROFILES: &[GiProfile] = &[
    gi(0, 19, "1g.10gb", 1, 7, 9984, 16, [1, 1, 0, 1, 0], 1, S1),
    gi(7, 20, "1g.10gb+me", 1, 1, 9984, 16, [1, 1, 0, 1, 1], 1, S1),
    gi(9, 15, "1g.20gb", 1, 4, 20096, 26, [1, 1, 0, 1, 0], 2, S2Q),
    gi(1, 14, "2g.20gb", 2, 3, 20096, 32, [2, 2, 0, 2, 0], 2, S2),
    gi(2, 9, "3g.40gb", 3, 2, 40448, 60, [3, 3, 0, 3, 0], 4, S3),
    gi(3, 5, "4g.40gb", 4, 1, 40448, 64, [4, 4, 0, 4, 0], 4, S0),
    gi(4, 0, "7g.80gb", 7, 1, 81152, 132, [8, 7, 0, 7, 1], 8, S0),
];

/// H200 141GB, MIG profile tables, docs/hardware-sources.md (lgip from NVIDIA/mig-parted#120; placements = H100,
/// UNVERIFIED).
const H200_141GB_PROFILES: &[GiProfile] = &[
    gi(0, 19, "1g.18gb", 1, 7, 16384, 16, [1, 1, 0, 1, 0], 1, S1),
    gi(7, 20, "1g.18gb+me", 1, 1, 16384, 16, [1, 1, 0, 1, 1], 1, S1),
    gi(9, 15, "1g.35gb", 1, 4, 33024, 26, [1, 1, 0, 1, 0], 2, S2Q),
    gi(1, 14, "2g.35gb", 2, 3, 33024, 32, [2, 2, 0, 2, 0], 2, S2),
    gi(2, 9, "3g.71gb", 3, 2, 71168, 60, [3, 3, 0, 3, 0], 4, S3),
    gi(3, 5, "4g.71gb", 4, 1, 71168, 64, [4, 4, 0, 4, 0], 4, S0),
    gi(4, 0, "7g.141gb", 7, 1, 143104, 132, [8, 7, 0, 7, 1], 8, S0),
];

/// The products the mock knows (identity values: device identity, docs/hardware-sources.md).
pub const PRODUCTS: &[Product] = &[
    Product {
        key: "a100-40gb",
        name: "NVIDIA A100-SXM4-40GB",
        pci_device_id: 0x20B0_10DE,
        pci_subsystem_id: 0x134F_10DE,
        memory_mib: 40960,
        reserved_mib: 518,
        sm_count: 108,
        cores_per_sm: 64,
        compute_capability: (8, 0),
        architecture: ARCH_AMPERE,
        brand: BRAND_NVIDIA,
        mig_profiles: A100_40GB_PROFILES,
    },
    Product {
        key: "a100-80gb",
        name: "NVIDIA A100-SXM4-80GB",
        pci_device_id: 0x20B2_10DE,
        pci_subsystem_id: 0x1463_10DE,
        memory_mib: 81920,
        // Reserved memory for this SKU: UNVERIFIED; the A100-40GB value is reused.
        reserved_mib: 518,
        sm_count: 108,
        cores_per_sm: 64,
        compute_capability: (8, 0),
        architecture: ARCH_AMPERE,
        brand: BRAND_NVIDIA,
        mig_profiles: A100_80GB_PROFILES,
    },
    Product {
        key: "h100-80gb",
        name: "NVIDIA H100 80GB HBM3",
        pci_device_id: 0x2330_10DE,
        pci_subsystem_id: 0x16C1_10DE,
        memory_mib: 81559,
        reserved_mib: 480,
        sm_count: 132,
        cores_per_sm: 128,
        compute_capability: (9, 0),
        architecture: ARCH_HOPPER,
        brand: BRAND_NVIDIA,
        mig_profiles: H100_80GB_PROFILES,
    },
    Product {
        key: "h200-141gb",
        name: "NVIDIA H200",
        pci_device_id: 0x2335_10DE,
        pci_subsystem_id: 0x18BE_10DE,
        memory_mib: 143_771,
        // Reserved memory and brand for H200: UNVERIFIED (H100 values reused).
        reserved_mib: 480,
        sm_count: 132,
        cores_per_sm: 128,
        compute_capability: (9, 0),
        architecture: ARCH_HOPPER,
        brand: BRAND_NVIDIA,
        mig_profiles: H200_141GB_PROFILES,
    },
    Product {
        key: "l4",
        name: "NVIDIA L4",
        pci_device_id: 0x27B8_10DE,
        pci_subsystem_id: 0x16CA_10DE,
        memory_mib: 23034,
        // Reserved memory and brand for L4: UNVERIFIED.
        reserved_mib: 0,
        sm_count: 58,
        cores_per_sm: 128,
        compute_capability: (8, 9),
        architecture: ARCH_ADA,
        brand: BRAND_NVIDIA,
        mig_profiles: &[],
    },
];

/// Looks up a product by its fixture key (`h100-80gb`, ...).
pub fn product(key: &str) -> Option<&'static Product> {
    PRODUCTS.iter().find(|p| p.key == key)
}

/// One CI profile available inside a GI (compute-instance profiles, docs/hardware-sources.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CiProfile {
    /// `NVML_COMPUTE_INSTANCE_PROFILE_*` value, also the returned `id`.
    pub id: u32,
    /// Compute slices.
    pub slice_count: u32,
    /// Maximum instances inside the GI.
    pub instance_count: u32,
    /// SMs of one such CI.
    pub sm: u32,
}

/// Compute slices of each `NVML_COMPUTE_INSTANCE_PROFILE_*` value (1,2,3,4,7,8,6 slices).
const CI_SLICES: [u32; 7] = [1, 2, 3, 4, 7, 8, 6];

/// The CI profile `ci_enum` inside a GI of profile `gip`, if that GI offers it.
///
/// Rule (compute-instance profiles, docs/hardware-sources.md, A100 lcip): a GI of `g` compute slices offers `c`-slice CIs for
/// c in {1,2,3,4,7}, c <= g, except 3c inside 4g; `floor(g/c)` of them. The full-size CI
/// has the GI's SM count; smaller ones get `sm * c / g` (exact for A100's 14 SM/slice,
/// UNVERIFIED on Hopper).
pub fn ci_profile(gip: &GiProfile, ci_enum: u32) -> Option<CiProfile> {
    let c = *CI_SLICES.get(usize::try_from(ci_enum).ok()?)?;
    let g = gip.slice_count;
    if !matches!(c, 1 | 2 | 3 | 4 | 7) || c > g || (g == 4 && c == 3) {
        return None;
    }
    let sm = if c == g { gip.sm } else { gip.sm * c / g };
    Some(CiProfile {
        id: ci_enum,
        slice_count: c,
        instance_count: g / c,
        sm,
    })
}

/// The full-size CI profile of a GI (the one `nvidia-smi mig -cgi ... -C` creates).
pub fn full_ci_profile(gip: &GiProfile) -> Option<CiProfile> {
    (0..7)
        .filter_map(|e| ci_profile(gip, e))
        .find(|c| c.slice_count == gip.slice_count)
}

/// Name of a CI profile: the GI name for the full-size CI, `<c>c.<gi name>` otherwise.
pub fn ci_profile_name(gip: &GiProfile, cip: &CiProfile) -> String {
    if cip.slice_count == gip.slice_count {
        gip.name.to_string()
    } else {
        format!("{}c.{}", cip.slice_count, gip.name)
    }
}

/// GI ID that the driver assigns to a GI at memory-slice placement `start:size`.
///
/// The "swizzle ID" rule: IDs enumerate the binary partition tree of the 8 memory slices
/// (0 = whole GPU, 1-2 = halves, 3-6 = quarters, 7-14 = eighths), so `id = 8/size - 1 +
/// start/size`. It matches every capture in instance IDs and capability nodes, docs/hardware-sources.md: 1g at start s -> 7+s (H100),
/// 3g at 0:4 -> 1 and 4:4 -> 2 (A100), and an A100 3g/2g/1g split with IDs 2, 3, 10; and
/// it yields gi0..gi14 as in mig-minors. One capture (4g as GI 2) disagrees.
pub fn gi_id_for_placement(start: u32, size: u32) -> u32 {
    let size = size.max(1);
    MEMORY_SLICES / size - 1 + start / size
}

/// YAML node fixture (the file `MOCK_NVML_CONFIG` points at).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConfigFile {
    /// Fixture name (used in the default state-file name).
    #[serde(default)]
    pub name: Option<String>,
    /// `nvmlSystemGetDriverVersion`.
    #[serde(default)]
    pub driver_version: Option<String>,
    /// `nvmlSystemGetCudaDriverVersion[_v2]`, e.g. 12080.
    #[serde(default)]
    pub cuda_driver_version: Option<i32>,
    /// GPUs in NVML index order.
    pub gpus: Vec<GpuEntry>,
}

/// One GPU (or `count` identical GPUs) of a YAML fixture.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuEntry {
    /// Product key (`a100-40gb`, `a100-80gb`, `h100-80gb`, `h200-141gb`, `l4`).
    pub product: String,
    /// Repeat this entry; `uuid`, `pciBusId`, `serial`, `minor` must then be unset.
    #[serde(default)]
    pub count: Option<u32>,
    /// Override of the product name.
    #[serde(default)]
    pub name: Option<String>,
    /// Override of total memory (MiB).
    #[serde(default)]
    pub memory_mib: Option<u64>,
    /// `GPU-...` UUID; default derived from fixture name and index.
    #[serde(default)]
    pub uuid: Option<String>,
    /// Board serial.
    #[serde(default)]
    pub serial: Option<String>,
    /// `00000000:BB:00.0`; default `00000000:<index+1>:00.0`.
    #[serde(default)]
    pub pci_bus_id: Option<String>,
    /// Device minor number; default = index.
    #[serde(default)]
    pub minor: Option<u32>,
    /// Override of the compute capability, `"9.0"`.
    #[serde(default)]
    pub compute_capability: Option<String>,
    /// Set false to hide MIG support on a MIG-capable product.
    #[serde(default)]
    pub mig_capable: Option<bool>,
    /// Initial MIG mode (default: enabled on MIG-capable GPUs).
    #[serde(default)]
    pub mig_enabled: Option<bool>,
}

/// One resolved GPU of a node fixture.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuSpec {
    /// NVML index.
    pub index: u32,
    /// Product tables.
    #[serde(serialize_with = "ser_product")]
    pub product: &'static Product,
    /// `nvmlDeviceGetName`.
    pub name: String,
    /// Total memory (MiB).
    pub memory_mib: u64,
    /// `GPU-...` UUID.
    pub uuid: String,
    /// Board serial.
    pub serial: String,
    /// PCI domain, bus, device.
    pub pci: (u32, u32, u32),
    /// `/dev/nvidia<minor>`.
    pub minor: u32,
    /// CUDA compute capability.
    pub compute_capability: (i32, i32),
    /// Whether MIG is supported.
    pub mig_capable: bool,
    /// MIG mode in a fresh state file.
    pub mig_enabled_initially: bool,
}

fn ser_product<S: serde::Serializer>(p: &&'static Product, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(p.key)
}

impl GpuSpec {
    /// `busId` as NVML formats it (`%08X:%02X:%02X.0`).
    pub fn bus_id(&self) -> String {
        format!("{:08X}:{:02X}:{:02X}.0", self.pci.0, self.pci.1, self.pci.2)
    }

    /// `busIdLegacy` (`%04X:%02X:%02X.0`).
    pub fn bus_id_legacy(&self) -> String {
        format!("{:04X}:{:02X}:{:02X}.0", self.pci.0, self.pci.1, self.pci.2)
    }
}

/// A resolved node: GPUs plus system-wide values.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeConfig {
    /// Fixture name (profile name or the YAML `name`).
    pub name: String,
    /// Driver version string.
    pub driver_version: String,
    /// CUDA driver version (e.g. 12080).
    pub cuda_driver_version: i32,
    /// GPUs in index order.
    pub gpus: Vec<GpuSpec>,
}

impl NodeConfig {
    /// A stable string identifying the fixture; a state file made for another fixture is
    /// discarded.
    pub fn fingerprint(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// Failure to build a node fixture.
#[derive(Debug, thiserror::Error)]
pub enum FixtureError {
    /// `MOCK_NVML_PROFILE` names no built-in profile.
    #[error("unknown mock NVML profile {0:?} (known: {known})", known = PROFILE_NAMES.join(", "))]
    UnknownProfile(String),
    /// The YAML fixture could not be read.
    #[error("reading mock NVML config {path}: {source}")]
    ReadConfig {
        /// Config path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The YAML fixture is malformed.
    #[error("parsing mock NVML config {path}: {source}")]
    ParseConfig {
        /// Config path.
        path: String,
        /// Cause.
        source: serde_yaml::Error,
    },
    /// A value in the YAML fixture is invalid.
    #[error("invalid mock NVML config: {0}")]
    Invalid(String),
}

/// Deterministic `GPU-...` UUID for GPU `index` of fixture `name` (UUID v5).
pub fn gpu_uuid(name: &str, index: u32) -> String {
    let ns = uuid::Uuid::NAMESPACE_URL;
    let u = uuid::Uuid::new_v5(&ns, format!("cleave-mock-nvml/{name}/{index}").as_bytes());
    format!("GPU-{u}")
}

fn entry(product: &str, count: u32, buses: &[u32]) -> Vec<GpuEntry> {
    (0..count)
        .map(|i| GpuEntry {
            product: product.to_string(),
            pci_bus_id: buses
                .get(i as usize)
                .map(|b| format!("00000000:{b:02X}:00.0")),
            ..GpuEntry::default()
        })
        .collect()
}

/// The YAML-equivalent description of a built-in node profile.
///
/// PCI bus IDs: H100 node = the QX capture (device identity, docs/hardware-sources.md notes: 53/64/75/86/97/A8/B9/CA,
/// minors 0..7); the H200 node reuses that HGX layout; the A100 node uses the DGX A100
/// layout 07/0F/47/4E/87/90/B7/BD (UNVERIFIED); the others are synthetic.
pub fn profile(name: &str) -> Option<ConfigFile> {
    const HGX: &[u32] = &[0x53, 0x64, 0x75, 0x86, 0x97, 0xA8, 0xB9, 0xCA];
    const DGX_A100: &[u32] = &[0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD];
    let gpus = match name {
        "a100-40gb-x8" => entry("a100-40gb", 8, DGX_A100),
        "a100-80gb-x4" => entry("a100-80gb", 4, &[0x01, 0x41, 0x81, 0xC1]),
        "h100-80gb-x8" => entry("h100-80gb", 8, HGX),
        "h200-141gb-x8" => entry("h200-141gb", 8, HGX),
        "l4-x2" => entry("l4", 2, &[0x01, 0x02]),
        _ => return None,
    };
    Some(ConfigFile {
        name: Some(name.to_string()),
        driver_version: None,
        cuda_driver_version: None,
        gpus,
    })
}

fn parse_bus_id(s: &str) -> Option<(u32, u32, u32)> {
    // "DDDDDDDD:BB:DD.F" or "DDDD:BB:DD.F"
    let mut it = s.trim().split(':');
    let dom = u32::from_str_radix(it.next()?, 16).ok()?;
    let bus = u32::from_str_radix(it.next()?, 16).ok()?;
    let rest = it.next()?;
    if it.next().is_some() {
        return None;
    }
    let dev = u32::from_str_radix(rest.split('.').next()?, 16).ok()?;
    Some((dom, bus, dev))
}

/// Normalises a PCI bus ID to NVML's `%08X:%02X:%02X.0` form.
pub fn normalize_bus_id(s: &str) -> Option<String> {
    parse_bus_id(s).map(|(d, b, v)| format!("{d:08X}:{b:02X}:{v:02X}.0"))
}

fn parse_cc(s: &str) -> Option<(i32, i32)> {
    let (a, b) = s.trim().split_once('.')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

impl ConfigFile {
    /// Reads a YAML fixture file.
    pub fn load(path: &Path) -> Result<Self, FixtureError> {
        let text = std::fs::read_to_string(path).map_err(|source| FixtureError::ReadConfig {
            path: path.display().to_string(),
            source,
        })?;
        serde_yaml::from_str(&text).map_err(|source| FixtureError::ParseConfig {
            path: path.display().to_string(),
            source,
        })
    }

    /// Resolves defaults. `mig_override` (from `MOCK_NVML_MIG`) replaces every GPU's
    /// initial MIG mode when set.
    pub fn resolve(
        &self,
        default_name: &str,
        mig_override: Option<bool>,
    ) -> Result<NodeConfig, FixtureError> {
        let name = self
            .name
            .clone()
            .unwrap_or_else(|| default_name.to_string());
        let mut gpus = Vec::new();
        for e in &self.gpus {
            let product = product(&e.product)
                .ok_or_else(|| FixtureError::Invalid(format!("unknown product {:?}", e.product)))?;
            let count = e.count.unwrap_or(1);
            if count != 1
                && (e.uuid.is_some()
                    || e.pci_bus_id.is_some()
                    || e.serial.is_some()
                    || e.minor.is_some())
            {
                return Err(FixtureError::Invalid(
                    "uuid/pciBusId/serial/minor need count 1".to_string(),
                ));
            }
            for _ in 0..count {
                let index = u32::try_from(gpus.len())
                    .map_err(|_| FixtureError::Invalid("too many GPUs".to_string()))?;
                let pci = match &e.pci_bus_id {
                    Some(s) => parse_bus_id(s)
                        .ok_or_else(|| FixtureError::Invalid(format!("bad pciBusId {s:?}")))?,
                    None => (0, index + 1, 0),
                };
                let compute_capability = match &e.compute_capability {
                    Some(s) => parse_cc(s).ok_or_else(|| {
                        FixtureError::Invalid(format!("bad computeCapability {s:?}"))
                    })?,
                    None => product.compute_capability,
                };
                let mig_capable = product.mig_capable() && e.mig_capable.unwrap_or(true);
                let mig_enabled_initially =
                    mig_capable && mig_override.or(e.mig_enabled).unwrap_or(true);
                gpus.push(GpuSpec {
                    index,
                    product,
                    name: e.name.clone().unwrap_or_else(|| product.name.to_string()),
                    memory_mib: e.memory_mib.unwrap_or(product.memory_mib),
                    uuid: e.uuid.clone().unwrap_or_else(|| gpu_uuid(&name, index)),
                    serial: e.serial.clone().unwrap_or_else(|| {
                        format!("{:013}", 1_650_000_000_000u64 + u64::from(index))
                    }),
                    pci,
                    minor: e.minor.unwrap_or(index),
                    compute_capability,
                    mig_capable,
                    mig_enabled_initially,
                });
            }
        }
        Ok(NodeConfig {
            name,
            driver_version: self
                .driver_version
                .clone()
                .unwrap_or_else(|| DEFAULT_DRIVER_VERSION.to_string()),
            cuda_driver_version: self
                .cuda_driver_version
                .unwrap_or(DEFAULT_CUDA_DRIVER_VERSION),
            gpus,
        })
    }
}

/// Resolves a built-in node profile with its defaults.
pub fn node_profile(name: &str, mig_override: Option<bool>) -> Result<NodeConfig, FixtureError> {
    profile(name)
        .ok_or_else(|| FixtureError::UnknownProfile(name.to_string()))?
        .resolve(name, mig_override)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// go-nvlib's MIG memory naming rule (MIG profile naming, docs/hardware-sources.md): the names in the tables must
    /// be what a consumer computes from memorySizeMB and the total memory.
    fn go_nvlib_gb(mem_mib: u64, total_mib: u64) -> u64 {
        let total_b = (total_mib * 1024 * 1024) as f64;
        let gib = 1024.0 * 1024.0 * 1024.0;
        let frac = ((mem_mib as f64 * 1024.0 * 1024.0 / total_b) * 8.0).ceil() / 8.0;
        (frac * (total_b / gib).ceil()).round() as u64
    }

    #[test]
    fn profile_names_match_go_nvlib_rule() {
        for p in PRODUCTS {
            for g in p.mig_profiles {
                let gb = go_nvlib_gb(g.memory_mib, p.memory_mib);
                let expect = format!("{}g.{}gb", g.slice_count, gb);
                assert!(
                    g.name.starts_with(&expect),
                    "{} {}: computed {expect}",
                    p.key,
                    g.name
                );
            }
        }
    }

    #[test]
    fn gi_ids_follow_observed_captures() {
        assert_eq!(gi_id_for_placement(0, 8), 0);
        assert_eq!(gi_id_for_placement(0, 4), 1);
        assert_eq!(gi_id_for_placement(4, 4), 2);
        assert_eq!(gi_id_for_placement(0, 2), 3);
        assert_eq!(gi_id_for_placement(3, 1), 10);
        for s in 0..7 {
            assert_eq!(gi_id_for_placement(s, 1), 7 + s);
        }
    }

    #[test]
    fn ci_profiles_follow_lcip() {
        let p = product("a100-40gb").unwrap();
        let g3 = p.profile_by_id(9).unwrap();
        let ids: Vec<_> = (0..8)
            .filter_map(|e| ci_profile(g3, e))
            .map(|c| (c.id, c.instance_count, c.sm))
            .collect();
        assert_eq!(ids, vec![(0, 3, 14), (1, 1, 28), (2, 1, 42)]);
        let g4 = p.profile_by_id(5).unwrap();
        assert!(ci_profile(g4, 2).is_none());
        assert_eq!(full_ci_profile(p.profile_by_id(0).unwrap()).unwrap().id, 4);
        assert_eq!(full_ci_profile(p.profile_by_id(20).unwrap()).unwrap().id, 0);
        assert_eq!(
            ci_profile_name(g3, &ci_profile(g3, 0).unwrap()),
            "1c.3g.20gb"
        );
    }

    #[test]
    fn profiles_resolve_with_distinct_identities() {
        for name in PROFILE_NAMES {
            let n = node_profile(name, None).unwrap();
            let mut uuids: Vec<_> = n.gpus.iter().map(|g| g.uuid.clone()).collect();
            uuids.sort();
            uuids.dedup();
            assert_eq!(uuids.len(), n.gpus.len());
            assert!(uuids.iter().all(|u| u.starts_with("GPU-") && u.len() == 40));
        }
        let h = node_profile("h100-80gb-x8", None).unwrap();
        assert_eq!(h.gpus[7].bus_id(), "00000000:CA:00.0");
        assert!(h.gpus.iter().all(|g| g.mig_enabled_initially));
        let off = node_profile("h100-80gb-x8", Some(false)).unwrap();
        assert!(off.gpus.iter().all(|g| !g.mig_enabled_initially));
        assert!(node_profile("nope", None).is_err());
    }

    #[test]
    fn yaml_fixture_resolves() {
        let y = "name: mine\ndriverVersion: 550.54.15\ngpus:\n  - product: a100-40gb\n    uuid: GPU-11111111-2222-3333-4444-555555555555\n    pciBusId: 0000:06:00.0\n    migEnabled: false\n  - product: l4\n    count: 2\n";
        let c: ConfigFile = serde_yaml::from_str(y).unwrap();
        let n = c.resolve("x", None).unwrap();
        assert_eq!(n.name, "mine");
        assert_eq!(n.gpus.len(), 3);
        assert_eq!(n.gpus[0].bus_id(), "00000000:06:00.0");
        assert!(!n.gpus[0].mig_enabled_initially);
        assert!(!n.gpus[1].mig_capable);
        assert_eq!(n.driver_version, "550.54.15");
        assert_eq!(
            normalize_bus_id("0000:ca:00.0").unwrap(),
            "00000000:CA:00.0"
        );
    }
}
