//! The seam between node logic and the GPU hardware (NVML). The real implementation
//! lives in `nvml`; tests of the prepare state machine use a recording fake.

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

    /// The NVML library this backend loaded, when it is one (the health watcher opens the
    /// same file for its event set).
    fn nvml_library(&self) -> Option<std::path::PathBuf> {
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
