//! Well-known names of cleave: driver, attributes, capacities, device classes, CDI kind,
//! and the device-name grammar (`gpu-<minor>`, `gpu-<minor>-mig-<profile>-<start>`).

use std::fmt;
use std::str::FromStr;

use crate::limits::MAX_DNS_LABEL_LENGTH;

/// Default DRA driver name (also the attribute domain and the opaque config API group).
pub const DRIVER_NAME: &str = "gpu.cleave.dev";
/// API version of the opaque config objects.
pub const CONFIG_API_VERSION: &str = "gpu.cleave.dev/v1alpha1";
/// Opaque config kind for whole GPUs.
pub const KIND_GPU_CONFIG: &str = "GpuConfig";
/// Opaque config kind for MIG devices.
pub const KIND_MIG_CONFIG: &str = "MigConfig";

/// DeviceClass for whole GPUs.
pub const DEVICE_CLASS_GPU: &str = "gpu.cleave.dev";
/// DeviceClass for MIG devices (static and on-demand).
pub const DEVICE_CLASS_MIG: &str = "mig.cleave.dev";
/// Example DeviceClass that carries a default MPS sharing config.
pub const DEVICE_CLASS_MPS: &str = "mps.gpu.cleave.dev";
/// DeviceClass for GPUs shared by capacity (`--consumable-capacity`): devices published
/// with `allowMultipleAllocations`, claims asking `capacity.requests`.
pub const DEVICE_CLASS_SHARED: &str = "shared.gpu.cleave.dev";

/// CDI vendor part of the kind.
pub const CDI_VENDOR: &str = "k8s.gpu.cleave.dev";
/// CDI class part of the kind.
pub const CDI_CLASS: &str = "claim";
/// Full CDI kind (`vendor/class`) of the per-claim spec files.
pub const CDI_KIND: &str = "k8s.gpu.cleave.dev/claim";

/// Device attribute names (unqualified: they live in the driver's domain).
pub mod attr {
    /// `gpu` or `mig`.
    pub const TYPE: &str = "type";
    /// GPU or MIG device UUID.
    pub const UUID: &str = "uuid";
    /// UUID of the parent GPU of a MIG device.
    pub const PARENT_UUID: &str = "parentUUID";
    /// Marketing product name as NVML reports it.
    pub const PRODUCT_NAME: &str = "productName";
    /// NVML brand, e.g. `Nvidia`, `Tesla`.
    pub const BRAND: &str = "brand";
    /// Architecture, e.g. `Ampere`, `Hopper`.
    pub const ARCHITECTURE: &str = "architecture";
    /// CUDA compute capability as a semantic version.
    pub const CUDA_COMPUTE_CAPABILITY: &str = "cudaComputeCapability";
    /// Kernel driver version as a semantic version.
    pub const DRIVER_VERSION: &str = "driverVersion";
    /// CUDA driver API version as a semantic version.
    pub const CUDA_DRIVER_VERSION: &str = "cudaDriverVersion";
    /// Standard PCI bus ID attribute, shared with other drivers.
    pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
    /// Standard PCIe root attribute, used to align GPUs with NICs.
    pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
    /// NUMA node of the GPU's PCI device (int; KEP-6072), omitted when unknown.
    pub const NUMA_NODE: &str = "resource.kubernetes.io/numaNode";
    /// Whether the GPU supports MIG.
    pub const MIG_CAPABLE: &str = "migCapable";
    /// MIG profile name, e.g. `1g.10gb`.
    pub const PROFILE: &str = "profile";
    /// First memory slice of a MIG placement.
    pub const PLACEMENT_START: &str = "placementStart";
    /// Number of memory slices of a MIG placement.
    pub const PLACEMENT_SIZE: &str = "placementSize";
}

/// Device capacity names.
pub mod cap {
    /// Device memory in bytes.
    pub const MEMORY: &str = "memory";
    /// Streaming multiprocessors.
    pub const MULTIPROCESSORS: &str = "multiprocessors";
    /// MIG copy engines.
    pub const COPY_ENGINES: &str = "copyEngines";
    /// MIG video decoders.
    pub const DECODERS: &str = "decoders";
    /// MIG video encoders.
    pub const ENCODERS: &str = "encoders";
    /// MIG JPEG engines.
    pub const JPEG_ENGINES: &str = "jpegEngines";
    /// MIG optical-flow engines.
    pub const OFA_ENGINES: &str = "ofaEngines";
}

/// Values of the `type` attribute.
pub mod device_type {
    /// A whole GPU.
    pub const GPU: &str = "gpu";
    /// A MIG device (existing or on-demand placement).
    pub const MIG: &str = "mig";
}

/// Whether `s` is a DNS-1123 label (`[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 bytes), as
/// device, counter-set and counter names and claim UIDs in CDI names must be.
pub fn is_dns_label(s: &str) -> bool {
    let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let b = s.as_bytes();
    b.len() <= MAX_DNS_LABEL_LENGTH
        && b.first().is_some_and(alnum)
        && b.last().is_some_and(alnum)
        && b.iter().all(|c| alnum(c) || *c == b'-')
}

/// Maximum length of a DNS subdomain (node names, pool names).
pub const DNS_SUBDOMAIN_MAX: usize = 253;

/// Why `name` is not a Kubernetes node name (a DNS subdomain, RFC 1123: lowercase letters,
/// digits, `-` and `.`, at most 253 characters, every dot-separated part starting and ending
/// with a letter or digit), as the API server's `IsDNS1123Subdomain` checks it; `None` when
/// it is one.
pub fn node_name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        return Some("it is empty".to_owned());
    }
    if name.len() > DNS_SUBDOMAIN_MAX {
        return Some(format!(
            "it has {} characters, at most {DNS_SUBDOMAIN_MAX} are allowed",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-' || *c == '.'))
    {
        return Some(format!(
            "it contains {c:?}: only lowercase letters, digits, '-' and '.' are allowed"
        ));
    }
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    for part in name.split('.') {
        let bytes = part.as_bytes();
        match (bytes.first(), bytes.last()) {
            (Some(&f), Some(&l)) if alnum(f) && alnum(l) => {}
            _ => {
                return Some(format!(
                    "its part {part:?} does not start and end with a letter or digit"
                ));
            }
        }
    }
    None
}

/// Error parsing a device or profile name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// The string is not a cleave device name.
    #[error("invalid device name {name:?}: {reason}")]
    InvalidDeviceName {
        /// The offending name.
        name: String,
        /// Why it was rejected.
        reason: &'static str,
    },
}

/// The name of one published device: a whole GPU or a MIG device at a placement.
///
/// The same name is used whether a MIG instance exists (static) or is created on prepare.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceName {
    /// `gpu-<minor>`: a whole GPU by its `/dev/nvidia<minor>` number.
    Gpu {
        /// Device minor number of the GPU.
        minor: u32,
    },
    /// `gpu-<minor>-mig-<profile>-<start>`.
    Mig {
        /// Device minor number of the parent GPU.
        minor: u32,
        /// Profile name with `.` and `+` removed, e.g. `1g10gbme`.
        profile: String,
        /// Placement start (first memory slice).
        start: u32,
    },
}

/// Turns a MIG profile name into the form used in device names: `1g.10gb+me` -> `1g10gbme`.
pub fn profile_label(profile_name: &str) -> String {
    profile_name
        .chars()
        .filter(|c| *c != '.' && *c != '+')
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

impl DeviceName {
    /// Builds the name of a whole GPU.
    pub fn gpu(minor: u32) -> Self {
        Self::Gpu { minor }
    }

    /// Builds the name of a MIG device from the full profile name (`1g.10gb`) and placement start.
    pub fn mig(minor: u32, profile_name: &str, start: u32) -> Self {
        Self::Mig {
            minor,
            profile: profile_label(profile_name),
            start,
        }
    }

    /// The minor number of the GPU (parent GPU for MIG devices).
    pub fn minor(&self) -> u32 {
        match self {
            Self::Gpu { minor } | Self::Mig { minor, .. } => *minor,
        }
    }

    /// True for MIG device names.
    pub fn is_mig(&self) -> bool {
        matches!(self, Self::Mig { .. })
    }
}

impl fmt::Display for DeviceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Gpu { minor } => write!(f, "gpu-{minor}"),
            Self::Mig {
                minor,
                profile,
                start,
            } => write!(f, "gpu-{minor}-mig-{profile}-{start}"),
        }
    }
}

fn parse_u32(s: &str) -> Option<u32> {
    // Reject signs, leading zeros (except "0") and empty strings so that names round-trip.
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0'))
    {
        return None;
    }
    s.parse().ok()
}

impl FromStr for DeviceName {
    type Err = NameError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        let err = |reason| NameError::InvalidDeviceName {
            name: name.to_owned(),
            reason,
        };
        if name.len() > MAX_DNS_LABEL_LENGTH {
            return Err(err("longer than 63 characters"));
        }
        let rest = name
            .strip_prefix("gpu-")
            .ok_or_else(|| err("must start with \"gpu-\""))?;
        let Some((minor, mig)) = rest.split_once("-mig-") else {
            let minor = parse_u32(rest).ok_or_else(|| err("GPU minor must be a decimal number"))?;
            return Ok(Self::Gpu { minor });
        };
        let minor = parse_u32(minor).ok_or_else(|| err("GPU minor must be a decimal number"))?;
        let (profile, start) = mig
            .rsplit_once('-')
            .ok_or_else(|| err("MIG device name must end in -<placement start>"))?;
        let start =
            parse_u32(start).ok_or_else(|| err("placement start must be a decimal number"))?;
        if profile.is_empty()
            || !profile
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        {
            return Err(err("MIG profile must be lowercase letters and digits"));
        }
        Ok(Self::Mig {
            minor,
            profile: profile.to_owned(),
            start,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_labels() {
        assert!(is_dns_label("gpu-0-mig-1g10gb-3"));
        assert!(is_dns_label(&"a".repeat(63)));
        assert!(!is_dns_label(&"a".repeat(64)));
        assert!(!is_dns_label("-a"));
        assert!(!is_dns_label("a-"));
        assert!(!is_dns_label("A"));
        assert!(!is_dns_label("a_b"));
        assert!(!is_dns_label(""));
    }

    #[test]
    fn node_names_follow_dns_subdomain_rules() {
        for ok in [
            "n1",
            "node-a",
            "ip-10-0-0-1.ec2.internal",
            "a",
            &"a".repeat(253),
        ] {
            assert_eq!(node_name_problem(ok), None, "{ok}");
        }
        for (bad, why) in [
            ("", "empty"),
            ("Node_A", "'N'"),
            ("node_a", "'_'"),
            ("-a", "\"-a\""),
            ("a.", "\"\""),
            ("a..b", "\"\""),
            ("a.-b", "\"-b\""),
        ] {
            let problem = node_name_problem(bad).unwrap_or_default();
            assert!(problem.contains(why), "{bad}: {problem}");
        }
        assert!(
            node_name_problem(&"a".repeat(300))
                .unwrap_or_default()
                .contains("300")
        );
    }

    #[test]
    fn gpu_names_round_trip() {
        for minor in [0, 1, 7, 15, 255, u32::MAX] {
            let n = DeviceName::gpu(minor);
            assert_eq!(n.to_string().parse::<DeviceName>(), Ok(n));
        }
        assert_eq!(DeviceName::gpu(0).to_string(), "gpu-0");
    }

    #[test]
    fn mig_names_round_trip() {
        let n = DeviceName::mig(0, "1g.10gb", 3);
        assert_eq!(n.to_string(), "gpu-0-mig-1g10gb-3");
        assert_eq!("gpu-0-mig-1g10gb-3".parse::<DeviceName>(), Ok(n));
        let me = DeviceName::mig(7, "1g.10gb+me", 6);
        assert_eq!(me.to_string(), "gpu-7-mig-1g10gbme-6");
        assert_eq!(me.to_string().parse::<DeviceName>(), Ok(me));
        assert_eq!(profile_label("7g.141gb"), "7g141gb");
    }

    #[test]
    fn bad_names_are_rejected_with_reason() {
        for bad in [
            "",
            "gpu-",
            "gpu--1",
            "gpu-01",
            "gpu-x",
            "nvidia-0",
            "gpu-0-mig-",
            "gpu-0-mig-1g10gb",
            "gpu-0-mig-1g10gb-",
            "gpu-0-mig-1g.10gb-0",
            "gpu-0-mig--0",
            "gpu-0-mig-1G10GB-0",
        ] {
            assert!(bad.parse::<DeviceName>().is_err(), "{bad:?} accepted");
        }
        let e = "gpu-x".parse::<DeviceName>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid device name \"gpu-x\": GPU minor must be a decimal number"
        );
    }
}
