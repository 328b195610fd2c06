//! The one error of the sharing strategies: each variant names the operation that failed and
//! carries the claim, device, file or tool involved, so callers classify by variant.

use std::path::PathBuf;
use std::time::Duration;

use cleave_api::config::TimeSliceInterval;

/// A sharing set-up or tear-down failed; the message names the claim, device or GPU, and the
/// file or tool involved.
#[derive(Debug, thiserror::Error)]
pub enum SharingFailure {
    /// The GPU is not in the driver's inventory.
    #[error("GPU {gpu} is not known on this node")]
    UnknownGpu {
        /// GPU UUID.
        gpu: String,
    },
    /// The GPU cannot run MPS with limits.
    #[error(
        "device {device}: MPS is not supported on GPU {gpu} ({product}, compute capability {major}.{minor}); thread and memory limits need compute capability 7.0 (Volta) or newer"
    )]
    MpsUnsupported {
        /// Device name.
        device: String,
        /// GPU UUID.
        gpu: String,
        /// Product name.
        product: String,
        /// Compute capability major.
        major: u32,
        /// Compute capability minor.
        minor: u32,
    },
    /// Multi-user MPS was asked for on a GPU that cannot do it.
    #[error(
        "device {device}: mps.multiUser was requested but multi-user MPS is not supported on GPU {gpu} ({product}, compute capability {major}.{minor}); it needs compute capability 7.0 (Volta) or newer (on Pascal, clients of other users fail with CUDA_ERROR_NOT_PERMITTED)"
    )]
    MultiUserUnsupported {
        /// Device name.
        device: String,
        /// GPU UUID.
        gpu: String,
        /// Product name.
        product: String,
        /// Compute capability major.
        major: u32,
        /// Compute capability minor.
        minor: u32,
    },
    /// A share under `--consumable-capacity mps` on a GPU without multi-user MPS.
    #[error(
        "device {device}: --consumable-capacity mps needs multi-user MPS (shares of different pods may run as different users, and a single-user MPS server makes a client of another user wait without an error), which needs compute capability 7.0 (Volta) or newer; GPU {gpu} ({product}) has compute capability {major}.{minor}; run this node with --consumable-capacity time-slicing or off"
    )]
    ShareNeedsMultiUser {
        /// Device name.
        device: String,
        /// GPU UUID.
        gpu: String,
        /// Product name.
        product: String,
        /// Compute capability major.
        major: u32,
        /// Compute capability minor.
        minor: u32,
    },
    /// Devices of one claim ask for different MPS thread percentages or multi-user modes
    /// (one daemon per claim).
    #[error(
        "claim {claim}: its MPS devices ask for different {field} values ({values}); a claim has one MPS daemon, so they must agree"
    )]
    MixedMpsSettings {
        /// Claim UID.
        claim: String,
        /// `activeThreadPercentage` or `multiUser`.
        field: &'static str,
        /// The values found.
        values: String,
    },
    /// A claim mixes MPS with time-slicing.
    #[error(
        "claim {claim}: mixes strategy MPS with TimeSlicing; every container of the claim gets the MPS client settings, so use one claim per strategy"
    )]
    MixedStrategies {
        /// Claim UID.
        claim: String,
    },
    /// A pinned memory limit exceeds the device's memory.
    #[error(
        "device {device} ({uuid}): pinned memory limit {limit} ({bytes} bytes) is larger than the device's memory ({memory} bytes)"
    )]
    LimitTooLarge {
        /// Device name.
        device: String,
        /// Device UUID.
        uuid: String,
        /// The limit as written.
        limit: String,
        /// The limit in bytes.
        bytes: u64,
        /// The device's memory in bytes.
        memory: u64,
    },
    /// A pinned memory limit below 1 MiB (the control daemon's unit).
    #[error(
        "device {device} ({uuid}): pinned memory limit {limit} is below 1Mi, the smallest limit MPS takes"
    )]
    LimitTooSmall {
        /// Device name.
        device: String,
        /// Device UUID.
        uuid: String,
        /// The limit as written.
        limit: String,
    },
    /// Another recorded claim needs a different time slice on the same GPU.
    #[error(
        "GPU {gpu}: claim {claim} asks for time slice {interval}, but another claim on the same GPU needs {other_interval}"
    )]
    TimeSliceConflict {
        /// GPU UUID.
        gpu: String,
        /// Claim UID.
        claim: String,
        /// Interval asked for.
        interval: TimeSliceInterval,
        /// The other claim's UID (not in the message: it may be another tenant's).
        other_claim: String,
        /// Its interval.
        other_interval: TimeSliceInterval,
    },
    /// The GPU does not support compute-policy time slices (`nvidia-smi` said `Not
    /// Supported`, exit status 3; Pascal GPUs such as the Tesla P4 do this).
    #[error(
        "GPU {gpu}: time slice {interval} is not supported on this GPU (nvidia-smi compute-policy: {output}); use a GPU that supports compute-policy time slices, or timeSlicing.interval Default"
    )]
    TimeSliceNotSupported {
        /// GPU UUID.
        gpu: String,
        /// The interval asked for.
        interval: TimeSliceInterval,
        /// What `nvidia-smi` printed.
        output: String,
    },
    /// `nvidia-smi` failed.
    #[error("{} {args}: {message}", tool.display())]
    Tool {
        /// The tool run.
        tool: PathBuf,
        /// Its arguments.
        args: String,
        /// Exit status and output.
        message: String,
    },
    /// Starting a claim's MPS control daemon failed.
    #[error("claim {claim}: starting MPS control daemon {}: {message}", tool.display())]
    DaemonStart {
        /// Claim UID.
        claim: String,
        /// The control tool.
        tool: PathBuf,
        /// What failed.
        message: String,
    },
    /// The daemon did not answer in time after it started.
    #[error("claim {claim}: MPS control daemon did not answer within {waited:?} (last: {last})")]
    DaemonNotReady {
        /// Claim UID.
        claim: String,
        /// How long it was given.
        waited: Duration,
        /// The last failure.
        last: String,
    },
    /// A command to a daemon failed.
    #[error("claim {claim}: MPS control command `{command}`: {message}")]
    DaemonControl {
        /// Claim UID.
        claim: String,
        /// The command(s) sent.
        command: String,
        /// What failed.
        message: String,
    },
    /// The daemon did not take the limits: a value read back differs from what was set, or
    /// a set was rejected (the control UI still exits 0 then).
    #[error("claim {claim}: the MPS control daemon did not take the claim's limits: {problem}")]
    DaemonRejected {
        /// Claim UID.
        claim: String,
        /// Which value differs, with the daemon's answers.
        problem: String,
    },
    /// A daemon could not be stopped.
    #[error("stopping MPS control daemon {daemon}: {message}")]
    DaemonStop {
        /// Which daemon: `PID <pid>` or `pod <namespace>/<name>`.
        daemon: String,
        /// What failed.
        message: String,
    },
    /// The claim's MPS control socket path does not fit in a unix socket address.
    #[error(
        "claim {claim}: MPS control socket {} would be {len} bytes, longer than the {max} a unix socket path may have; use a shorter state (kubelet plugins) directory", path.display()
    )]
    PipeDirTooLong {
        /// Claim UID.
        claim: String,
        /// The socket path.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
        /// The longest a unix socket path may be.
        max: usize,
    },
    /// A file operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// `creating`, `reading`, …
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A daemon record does not encode (a bug).
    #[error("MPS daemon record {path}: {source}")]
    Record {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        source: serde_json::Error,
    },
    /// A daemon record does not decode. It is the one record of the daemon (its identity and
    /// the compute modes to restore), so nothing is stopped or removed on a guess.
    #[error(
        "MPS daemon record {} does not decode ({source}); it is the only record of that daemon and of the GPUs it set to EXCLUSIVE_PROCESS, so nothing is stopped on a guess. To fix: restore the file; or set each whole GPU of the claim back with `nvidia-smi -i <GPU UUID> -c DEFAULT`, then delete the file: the next attempt (the kubelet retries unprepare) stops the daemon the launcher still finds and removes its directories", path.display()
    )]
    RecordUnreadable {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        source: serde_json::Error,
    },
    /// A live claim's daemon directory holds no record.
    #[error("MPS daemon record {path}: missing for a live claim")]
    RecordMissing {
        /// The file.
        path: PathBuf,
    },
    /// A claim UID that cannot name a directory (it would leave the MPS directory).
    #[error(transparent)]
    InvalidClaim(#[from] crate::cdi::CdiError),
    /// Setting up sharing for a claim failed (what [`super::SharingHandler::apply`] and
    /// [`super::SharingHandler::apply_shares`] return).
    #[error("setting up sharing for claim {claim}: {source}")]
    Apply {
        /// Claim UID.
        claim: String,
        /// What failed.
        #[source]
        source: Box<SharingFailure>,
    },
    /// Tearing a claim's sharing down failed (what [`super::SharingHandler::release`] and
    /// [`super::SharingHandler::release_shares`] return).
    #[error("releasing sharing of claim {claim}: {source}")]
    Release {
        /// Claim UID.
        claim: String,
        /// What failed.
        #[source]
        source: Box<SharingFailure>,
    },
}

impl SharingFailure {
    /// Wraps `self` as the failure to set up sharing for `claim`.
    pub fn applying(self, claim: &str) -> Self {
        Self::Apply {
            claim: claim.to_owned(),
            source: Box::new(self),
        }
    }

    /// Wraps `self` as the failure to release the sharing of `claim`.
    pub fn releasing(self, claim: &str) -> Self {
        Self::Release {
            claim: claim.to_owned(),
            source: Box::new(self),
        }
    }
}
