//! How prepare and unprepare fail: [`PrepareError`], whose message names the claim and the
//! object, and [`Refusal`], the kind of a refusal that the plugin turns into a metric label
//! and, for what the claim's owner can fix, an Event.

use std::path::PathBuf;

use super::plan;
use crate::backend::BackendError;
use crate::cdi::CdiError;
use crate::checkpoint::CheckpointError;
use crate::driver_root::DriverRootError;
use crate::sharing::SharingFailure;

/// A prepare or unprepare failure; the message names the claim and the object.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The claim has no UID or one unusable in file names.
    #[error("claim {claim}: {reason}")]
    InvalidClaim {
        /// `namespace/name` or UID.
        claim: String,
        /// What is wrong.
        reason: String,
    },
    /// The claim has no allocation.
    #[error("claim {claim} is not allocated")]
    NotAllocated {
        /// `namespace/name`.
        claim: String,
    },
    /// The allocation has no device of this driver in this node's pool.
    #[error(
        "claim {claim} has no device allocated from driver {driver} in pool {pool} (allocated: {allocated})"
    )]
    NotForThisNode {
        /// `namespace/name`.
        claim: String,
        /// This driver.
        driver: String,
        /// This pool.
        pool: String,
        /// `driver/pool/device` of what is allocated.
        allocated: String,
    },
    /// An allocated device is not known on this node.
    #[error("claim {claim}: device {device} in pool {pool} is not known on this node: {reason}")]
    UnknownDevice {
        /// `namespace/name`.
        claim: String,
        /// Device name.
        device: String,
        /// Pool name.
        pool: String,
        /// Why.
        reason: String,
    },
    /// An opaque config for this driver is invalid or does not fit the device.
    #[error("claim {claim}: invalid config: {message}")]
    InvalidConfig {
        /// `namespace/name`.
        claim: String,
        /// The config API's message, naming the config entry.
        message: String,
    },
    /// The device is prepared for another claim. The message names only the requesting
    /// claim's objects (the other claim may be another tenant's); `other` is for logs.
    #[error("claim {claim}: device {device} is already prepared for another claim; {hint}")]
    DeviceBusy {
        /// `namespace/name`.
        claim: String,
        /// Device name.
        device: String,
        /// UID of the other claim (not in the message).
        other: String,
        /// What may have caused it.
        hint: String,
    },
    /// The allocation exceeds its device: a share beyond it, shares summing past it, a
    /// device prepared for another claim in another way, or an on-demand MIG placement
    /// overlapping one prepared on the same GPU (the scheduler over-committed it).
    #[error(
        "claim {claim}: device {device}: over-commit: {what}; {}",
        plan::OVER_COMMIT_HINT
    )]
    OverCommit {
        /// `namespace/name`.
        claim: String,
        /// Device name.
        device: String,
        /// What exceeds what, with the figures.
        what: String,
    },
    /// A share (consumable capacity) cannot be prepared as allocated.
    #[error("claim {claim}: device {device}: {reason}")]
    ShareRefused {
        /// `namespace/name`.
        claim: String,
        /// Device name.
        device: String,
        /// Why, and what to do.
        reason: String,
    },
    /// Creating an on-demand MIG instance failed.
    #[error("claim {claim}: creating MIG device {device}: {source}")]
    MigCreate {
        /// `namespace/name`.
        claim: String,
        /// Device name.
        device: String,
        /// The backend error (with the NVML return code).
        source: BackendError,
    },
    /// Destroying a MIG instance the claim created failed.
    #[error("claim {claim}: destroying MIG device {device}: {source}")]
    MigDestroy {
        /// Claim UID or name.
        claim: String,
        /// Device name.
        device: String,
        /// The backend error.
        source: BackendError,
    },
    /// GPU discovery failed.
    #[error("GPU discovery: {0}")]
    Discovery(#[source] BackendError),
    /// Recreating a MIG instance of a prepared claim (after a reboot, or after it vanished)
    /// failed.
    #[error(
        "claim {claim}: recreating MIG device {device} (profile {profile}, placement start {} size {}) after a reboot or loss: {source}",
        placement.start, placement.size
    )]
    MigRecreate {
        /// `namespace/name`.
        claim: String,
        /// Device name.
        device: String,
        /// Profile name.
        profile: String,
        /// The recorded placement.
        placement: crate::model::Placement,
        /// The backend error.
        source: Box<BackendError>,
    },
    /// A static MIG device (not created by cleave) of a prepared claim does not exist after a
    /// reboot or loss.
    #[error(
        "claim {claim}: MIG device {device} (profile {profile}, placement start {} size {}) was not created by cleave and does not exist any more (node rebooted or instance destroyed); create it again (nvidia-smi mig -cgi) or unprepare the claim",
        placement.start, placement.size
    )]
    StaticMigMissing {
        /// `namespace/name`.
        claim: String,
        /// Device name.
        device: String,
        /// Profile name.
        profile: String,
        /// The recorded placement.
        placement: crate::model::Placement,
    },
    /// Setting up or releasing sharing failed.
    #[error(transparent)]
    Sharing(#[from] SharingFailure),
    /// Writing or removing the CDI spec failed (the error names the path).
    #[error("claim {claim}: {source}")]
    Cdi {
        /// Claim UID.
        claim: String,
        /// The CDI error.
        source: CdiError,
    },
    /// Removing a claim's device metadata failed (the error names the path).
    #[error("claim {claim}: {source}")]
    Metadata {
        /// Claim UID.
        claim: String,
        /// The metadata error.
        source: crate::metadata::MetadataError,
    },
    /// Loading or writing the checkpoint failed (the error names the path).
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Reading the driver root failed.
    #[error("driver root: {0}")]
    DriverRoot(#[from] DriverRootError),
    /// The claim's containers would lack a device node or the CUDA library: it is not
    /// prepared, so that no pod starts without its GPU.
    #[error(
        "claim {claim}: its containers would lack {} (driver root {}, device nodes looked for in {}); check that --driver-root (NVIDIA_DRIVER_ROOT) is where the NVIDIA driver is installed and that its kernel modules are loaded",
        missing.join(", "), root.display(), dev_dir.display()
    )]
    MissingDriverFiles {
        /// `namespace/name`.
        claim: String,
        /// The driver root as the plugin sees it.
        root: PathBuf,
        /// Where device nodes were looked for.
        dev_dir: PathBuf,
        /// What is missing, as container paths.
        missing: Vec<String>,
    },
    /// NVML sees GPUs but the driver root holds no driver files at all.
    #[error(
        "NVML sees {gpus} GPU(s) but driver root {} holds no NVIDIA driver files (no /dev/nvidiactl or /dev/nvidia<N> under {}, no libcuda.so.* in its library directories); set --driver-root (NVIDIA_DRIVER_ROOT) to the driver installation as this container sees it (host install: the host's / mounted in; GPU Operator: /run/nvidia/driver), or wait for the driver container to finish",
        root.display(), dev_dir.display()
    )]
    NoDriverFiles {
        /// The driver root as the plugin sees it.
        root: PathBuf,
        /// Where device nodes were looked for.
        dev_dir: PathBuf,
        /// GPUs NVML found.
        gpus: usize,
    },
    /// A directory the driver needs could not be created.
    #[error("creating directory {path}: {source}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The boot ID could not be read.
    #[error("reading boot ID from {path}: {source}")]
    BootId {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Why a prepare was refused, as a type: the plugin takes its metric label and whether the
/// claim's owner gets an Event from it, never from the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// The allocation exceeds its device ([`PrepareError::OverCommit`],
    /// [`PrepareError::DeviceBusy`]): an old or buggy scheduler, or a mode changed under
    /// prepared claims.
    OverCommit,
    /// The claim itself: no usable UID, an unknown device.
    Claim,
    /// The claim is not allocated, or nothing of it to this node.
    Allocation,
    /// An opaque config, or a share the device cannot serve as configured.
    Config,
    /// The driver root lacks a device node or library the claim's containers need.
    DriverFiles,
    /// The driver root holds no driver at all, or cannot be read: the node's setup.
    DriverRoot,
    /// Creating, destroying or recreating a MIG instance.
    Mig,
    /// Starting or stopping sharing (MPS daemons, time-slicing).
    Sharing,
    /// The node's own state: GPU discovery, CDI files, metadata, the checkpoint,
    /// directories, the boot ID.
    Node,
}

impl Refusal {
    /// The `reason` label of the plugin's `prepare_refusals` metric.
    pub fn label(self) -> &'static str {
        match self {
            Self::OverCommit => "over_commit",
            Self::Claim => "claim",
            Self::Allocation => "allocation",
            Self::Config => "config",
            Self::DriverFiles => "driver_files",
            Self::DriverRoot => "driver_root",
            Self::Mig => "mig",
            Self::Sharing => "sharing",
            Self::Node => "node",
        }
    }

    /// Whether the claim's owner can act on it (fix the config or the claim, ask for
    /// another device) and so gets a Warning Event on the claim.
    pub fn actionable(self) -> bool {
        matches!(
            self,
            Self::OverCommit | Self::Claim | Self::Config | Self::DriverFiles
        )
    }
}

impl PrepareError {
    /// What kind of refusal this is.
    pub fn refusal(&self) -> Refusal {
        match self {
            Self::OverCommit { .. } | Self::DeviceBusy { .. } => Refusal::OverCommit,
            Self::InvalidClaim { .. } | Self::UnknownDevice { .. } => Refusal::Claim,
            Self::NotAllocated { .. } | Self::NotForThisNode { .. } => Refusal::Allocation,
            Self::InvalidConfig { .. } | Self::ShareRefused { .. } => Refusal::Config,
            Self::MissingDriverFiles { .. } => Refusal::DriverFiles,
            Self::NoDriverFiles { .. } | Self::DriverRoot(_) => Refusal::DriverRoot,
            Self::MigCreate { .. }
            | Self::MigDestroy { .. }
            | Self::MigRecreate { .. }
            | Self::StaticMigMissing { .. } => Refusal::Mig,
            Self::Sharing(_) => Refusal::Sharing,
            Self::Discovery(_)
            | Self::Cdi { .. }
            | Self::Metadata { .. }
            | Self::Checkpoint(_)
            | Self::CreateDir { .. }
            | Self::BootId { .. } => Refusal::Node,
        }
    }
}
