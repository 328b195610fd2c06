//! The seams between node logic and the GPU hardware (NVML): [`GpuBackend`] (discovery and
//! MIG changes), [`EventSource`] (health events) and [`UsageSource`] (usage sampling). The
//! real implementations live in `nvml` and share one NVML handle; tests use fakes.

use std::sync::Arc;
use std::time::Duration;

use crate::model::{BareGpuInstance, MigInstance, NodeInventory, Placement};

/// An NVML failure, with the NVML return code where there is one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// The NVML library could not be loaded or initialised (driver not installed yet?).
    #[error("NVML unavailable: {0}")]
    Unavailable(String),
    /// An NVML call returned an error code.
    #[error("{call} failed on {target}: {message} (NVML return code {code})")]
    Nvml {
        /// NVML function or wrapper operation.
        call: &'static str,
        /// GPU UUID or other object the call was about.
        target: String,
        /// NVML's error string.
        message: String,
        /// nvmlReturn_t value.
        code: u32,
    },
    /// Creating a MIG device failed after its GPU instance had been made, and destroying
    /// that GPU instance failed too: it is left without compute instance (see
    /// [`GpuBackend::list_bare_gpu_instances`]). Every other error of
    /// [`GpuBackend::create_mig`] leaves nothing behind.
    #[error("{source}; the GPU instance it created ({}) could not be destroyed and is left without a compute instance", gi_id.map_or("id unknown".to_owned(), |id| format!("id {id}")))]
    LeftBare {
        /// Its GPU-instance id, when NVML could still tell it.
        gi_id: Option<u32>,
        /// Why the MIG device could not be made.
        source: Box<BackendError>,
    },
    /// A GPU with this UUID is not present.
    #[error("GPU {0} not found")]
    GpuNotFound(String),
    /// Anything else (unparsable version strings, inconsistent answers).
    #[error("{0}")]
    Other(String),
}

/// Hardware operations the node logic needs. Implementations must be safe to call from
/// several threads; callers serialise mutations of one GPU themselves.
pub trait GpuBackend: Send + Sync {
    /// Discovers all GPUs and their MIG state now. GPUs that fail a query are skipped
    /// with a logged warning.
    fn inventory(&self) -> Result<NodeInventory, BackendError>;

    /// Creates a GPU instance of `profile_id` at exactly `placement` on the GPU with
    /// `gpu_uuid`, plus its full-size compute instance, and returns the new MIG device.
    /// On failure nothing is left behind, except where the rollback itself fails:
    /// [`BackendError::LeftBare`].
    fn create_mig(
        &self,
        gpu_uuid: &str,
        profile_id: u32,
        placement: Placement,
    ) -> Result<MigInstance, BackendError>;

    /// Destroys the compute instance and then the GPU instance. Destroying something
    /// that no longer exists succeeds (idempotent).
    fn destroy_mig(&self, gpu_uuid: &str, gi_id: u32, ci_id: u32) -> Result<(), BackendError>;

    /// Lists the MIG devices that exist on the GPU now.
    fn list_mig(&self, gpu_uuid: &str) -> Result<Vec<MigInstance>, BackendError>;

    /// The NVML library this backend loaded, when it is one.
    fn nvml_library(&self) -> Option<std::path::PathBuf> {
        None
    }

    /// Health events over this backend's own NVML handle, when it has one (see
    /// [`crate::health::HealthWatcher::start`]).
    fn event_source(&self) -> Option<Arc<dyn EventSource>> {
        None
    }

    /// Usage sampling over this backend's own NVML handle, when it has one (see
    /// [`crate::usage::UsageSampler`]). Each call returns a new source with its own GPM
    /// samples: take it once.
    fn usage_source(&self) -> Option<Arc<dyn UsageSource>> {
        None
    }

    /// Lists the GPU instances that have no compute instance (see [`BareGpuInstance`]);
    /// [`GpuBackend::list_mig`] does not show them. A backend that never leaves one (a
    /// test fake whose `create_mig` is atomic) keeps the default: none.
    fn list_bare_gpu_instances(
        &self,
        gpu_uuid: &str,
    ) -> Result<Vec<BareGpuInstance>, BackendError> {
        let _ = gpu_uuid;
        Ok(Vec::new())
    }

    /// Destroys a GPU instance that has no compute instance. Destroying one that no longer
    /// exists succeeds (idempotent). The default delegates to [`GpuBackend::destroy_mig`]
    /// with a compute instance id no GPU instance has, which destroys only the GPU instance.
    fn destroy_gpu_instance(&self, gpu_uuid: &str, gi_id: u32) -> Result<(), BackendError> {
        self.destroy_mig(gpu_uuid, gi_id, u32::MAX)
    }
}

/// `nvmlEventType_t` bits the health watcher registers for (nvml.h
/// `nvmlEventTypeCriticalXidError`, `nvmlEventTypeDoubleBitEccError`).
pub const EVENT_XID: u64 = 0x8;
/// See [`EVENT_XID`].
pub(crate) const EVENT_DOUBLE_BIT_ECC: u64 = 0x2;

/// One raw event from NVML's event set (`nvmlEventData_t`, with the GPU as its UUID).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawEvent {
    /// UUID of the GPU the event is about; `None` when NVML's handle had no UUID.
    pub gpu_uuid: Option<String>,
    /// `eventType` bits.
    pub event_type: u64,
    /// `eventData` (the Xid number for Xid events).
    pub event_data: u64,
    /// `gpuInstanceId` (`0xFFFFFFFF`: none).
    pub gi: u32,
    /// `computeInstanceId` (`0xFFFFFFFF`: none).
    pub ci: u32,
}

/// What one bounded wait for an event gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventWait {
    /// An event arrived.
    Event(RawEvent),
    /// Nothing within the timeout (`NVML_ERROR_TIMEOUT`).
    Timeout,
    /// A registered GPU fell off the bus (`NVML_ERROR_GPU_IS_LOST`); waiting again returns
    /// at once, so the caller paces itself.
    GpuLost,
    /// Any other NVML return code.
    Failed(u32),
}

/// A registration for Xid and double-bit ECC events on a set of GPUs. Dropping it releases
/// the event set.
pub trait EventSubscription {
    /// Waits at most `timeout` for the next event.
    fn wait(&mut self, timeout: Duration) -> EventWait;
    /// GPUs whose registration failed (still checked for loss by the watcher).
    fn unregistered(&self) -> &[String];
}

/// Health events from the hardware: the NVML event set and the lost-GPU check, over the
/// same NVML handle as the [`GpuBackend`] that hands it out.
pub trait EventSource: Send + Sync {
    /// Creates an event set and registers Xid and double-bit ECC events (those of them
    /// the GPU supports) on each GPU in `gpu_uuids`. A GPU whose registration fails is
    /// listed in [`EventSubscription::unregistered`]; only a failure to create the set
    /// is an error.
    fn subscribe<'s>(
        &'s self,
        gpu_uuids: &[String],
    ) -> Result<Box<dyn EventSubscription + 's>, BackendError>;

    /// True if the GPU can no longer be reached (lookup by UUID fails, or its queries
    /// return `GPU_IS_LOST`).
    fn is_lost(&self, gpu_uuid: &str) -> bool;
}

/// Framebuffer memory of a GPU or MIG device (`nvmlDeviceGetMemoryInfo_v2`), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryUse {
    /// Used (includes reserved memory, as `_v2` reports it).
    pub used: u64,
    /// Total.
    pub total: u64,
}

/// One compute process on a device (`nvmlDeviceGetComputeRunningProcesses_v3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessMemory {
    /// Host PID.
    pub pid: u32,
    /// Framebuffer memory the process uses; `None` where NVML reports it unavailable.
    pub used: Option<u64>,
    /// GPU instance id, in MIG mode.
    pub gi: Option<u32>,
    /// Compute instance id, in MIG mode.
    pub ci: Option<u32>,
}

/// One per-process utilization sample (`nvmlDeviceGetProcessUtilization`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessUtilization {
    /// Host PID.
    pub pid: u32,
    /// CPU timestamp of the sample, microseconds.
    pub timestamp_us: u64,
    /// SM (3D/compute) utilization, percent.
    pub sm_percent: u32,
}

/// Which GPM sample a reading is about: a whole GPU (`nvmlGpmSampleGet`) or one GPU
/// instance of a MIG-enabled GPU (`nvmlGpmMigSampleGet`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GpmTarget {
    /// UUID of the (parent) GPU.
    pub gpu_uuid: String,
    /// GPU instance id for a MIG device.
    pub gi: Option<u32>,
}

/// GPM metrics between two samples, percent (nvml.h `NVML_GPM_METRIC_SM_UTIL`: SMs busy,
/// `NVML_GPM_METRIC_SM_OCCUPANCY`: warps active of the theoretical maximum).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpmActivity {
    /// SM activity (`NVML_GPM_METRIC_SM_UTIL`).
    pub sm_activity: f64,
    /// SM occupancy (`NVML_GPM_METRIC_SM_OCCUPANCY`); `None` when that metric failed.
    pub sm_occupancy: Option<f64>,
}

/// The answer of [`UsageSource::gpm`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GpmReading {
    /// The device has no GPM (before Hopper; `nvmlGpmQueryDeviceSupport`).
    Unsupported,
    /// First sample taken; metrics come with the next call.
    Warming,
    /// Metrics over the interval since the previous call for this target.
    Ready(GpmActivity),
}

/// Usage sampling calls, over the same NVML handle as the [`GpuBackend`] that hands it
/// out. Devices are named by UUID (`GPU-...` or `MIG-...`). "Not supported" is an answer
/// (`None`, [`GpmReading::Unsupported`]), not an error.
pub trait UsageSource: Send + Sync {
    /// Memory of a GPU or MIG device.
    fn memory(&self, device_uuid: &str) -> Result<MemoryUse, BackendError>;

    /// `nvmlDeviceGetUtilizationRates().gpu` of a whole GPU, percent; `None` where NVML
    /// does not support it (MIG-enabled GPUs).
    fn gpu_utilization(&self, gpu_uuid: &str) -> Result<Option<u32>, BackendError>;

    /// GPM SM activity and occupancy since the previous call for `target`. The source
    /// keeps one sample per target between calls; [`UsageSource::gpm_retain`] frees the
    /// others.
    fn gpm(&self, target: &GpmTarget) -> Result<GpmReading, BackendError>;

    /// Drops the kept GPM samples of every target not in `live`.
    fn gpm_retain(&self, live: &[GpmTarget]);

    /// Compute processes on a GPU or MIG device with their memory.
    fn processes(&self, device_uuid: &str) -> Result<Vec<ProcessMemory>, BackendError>;

    /// Processes with an MPS compute context on a GPU or MIG device (the CUDA clients of
    /// an MPS server, which the compute-process list does not show: it lists the server),
    /// `nvmlDeviceGetMPSComputeRunningProcesses_v3`. Sources that know no MPS clients
    /// answer an empty list.
    fn mps_processes(&self, device_uuid: &str) -> Result<Vec<ProcessMemory>, BackendError> {
        let _ = device_uuid;
        Ok(Vec::new())
    }

    /// Per-process SM utilization samples newer than `since_us` on a whole GPU; `None`
    /// where NVML does not support it (MIG-enabled GPUs, before Maxwell).
    fn process_utilization(
        &self,
        gpu_uuid: &str,
        since_us: u64,
    ) -> Result<Option<Vec<ProcessUtilization>>, BackendError>;
}
