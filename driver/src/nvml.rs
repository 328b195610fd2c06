//! The real [`GpuBackend`] over NVML: discovery of GPUs and their MIG state, and MIG
//! instance create/destroy.
//!
//! nvml-wrapper covers the plain device queries; the MIG calls it lacks (or gets wrong)
//! go through the small raw layer in [`ffi`]. Anything NVML cannot tell (whole-GPU SM
//! counts, PCIe root complex) comes from a table by PCI device id and from sysfs.
//! Static facts (profile tables) are read once per GPU and cached; prepare-time calls
//! (`create_mig`, `destroy_mig`, `list_mig`) only touch what changes.

mod events;
mod ffi;
mod usage;

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1, NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX,
    NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME, NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1,
    NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME, NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX,
    NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME, NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1,
    NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX, NVML_GPU_INSTANCE_PROFILE_COUNT,
};

use crate::backend::{BackendError, GpuBackend};
use crate::model::{
    BareGpuInstance, GpuInfo, MigInstance, MigProfile, MigState, NodeInventory, Placement,
};

/// The NVML library loaded when no path is given (the runtime soname, present without
/// the development package).
pub(crate) const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";
/// Where sysfs is mounted by default (the PCIe root is read from it).
pub const DEFAULT_SYSFS_ROOT: &str = "/sys";

/// Where NVML is looked for under a driver root, in order: `libnvidia-ml.so.1` in each of
/// the root's library directories ([`crate::driver_root::LIBRARY_DIRS`]), then the bare
/// soname for the system's loader (which a distroless plugin image cannot satisfy, so it
/// comes last).
pub(crate) fn library_candidates(driver_root: &Path) -> Vec<PathBuf> {
    crate::driver_root::LIBRARY_DIRS
        .iter()
        .map(|dir| driver_root.join(dir).join(DEFAULT_LIBRARY))
        .chain(std::iter::once(PathBuf::from(DEFAULT_LIBRARY)))
        .collect()
}

/// `NVML_DEVICE_MIG_ENABLE`.
const MIG_ENABLE: u32 = 1;
/// Bytes in a MiB.
const MIB: u64 = 1 << 20;

/// The NVML-backed [`GpuBackend`]. Cheap to share behind an `Arc`; NVML itself is
/// thread-safe, and MIG mutations are serialised inside.
pub struct NvmlBackend {
    /// Shared with the event and usage sources it hands out: one NVML handle per process.
    nvml: Arc<Nvml>,
    lib_path: PathBuf,
    sysfs_root: PathBuf,
    /// Profile tables by GPU UUID: read once, they never change while the driver runs.
    profiles: Mutex<HashMap<String, Vec<MigProfile>>>,
    /// Serialises create/destroy so that "find the new MIG device" sees only our change.
    mutate: Mutex<()>,
}

impl fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NvmlBackend")
            .field("lib_path", &self.lib_path)
            .field("sysfs_root", &self.sysfs_root)
            .finish_non_exhaustive()
    }
}

impl NvmlBackend {
    /// Loads and initialises NVML: [`DEFAULT_LIBRARY`] through the system's loader, or the
    /// library at `lib_path` (the mock, in tests and kind). A missing library or a failed
    /// `nvmlInit` is [`BackendError::Unavailable`] with the reason.
    pub fn open(lib_path: Option<&Path>) -> Result<Self, BackendError> {
        let path = lib_path.map_or_else(|| PathBuf::from(DEFAULT_LIBRARY), Path::to_path_buf);
        Self::open_exact(&path)
    }

    /// Loads NVML for the driver installed under `driver_root` (as this process sees it):
    /// `lib_path` when given (an override), else the first of [`library_candidates`] that
    /// loads: `libnvidia-ml.so.1` in the root's library directories, then the system's
    /// loader. The error lists every path tried and why each failed.
    pub fn open_in_driver_root(
        driver_root: &Path,
        lib_path: Option<&Path>,
    ) -> Result<Self, BackendError> {
        if let Some(path) = lib_path {
            return Self::open_exact(path);
        }
        let mut tried = Vec::new();
        for candidate in library_candidates(driver_root) {
            // An absolute candidate that is not there is not worth a dlopen; the bare
            // soname goes to the system's loader.
            if candidate.is_absolute() && !candidate.exists() {
                tried.push(format!("{}: not found", candidate.display()));
                continue;
            }
            match Self::open_exact(&candidate) {
                Ok(backend) => {
                    tracing::info!(library = %candidate.display(), driver_root = %driver_root.display(), "loaded NVML");
                    return Ok(backend);
                }
                Err(BackendError::Unavailable(reason)) => {
                    let shown = if candidate.is_absolute() {
                        candidate.display().to_string()
                    } else {
                        format!("{} (system loader)", candidate.display())
                    };
                    tried.push(format!("{shown}: {reason}"));
                }
                Err(other) => return Err(other),
            }
        }
        Err(BackendError::Unavailable(format!(
            "no loadable {DEFAULT_LIBRARY} for driver root {}; tried {}. Point --driver-root \
             (NVIDIA_DRIVER_ROOT) at the driver installation as this container sees it (host \
             install: the host's / mounted in; GPU Operator: /run/nvidia/driver), or name the \
             library with --nvml-lib",
            driver_root.display(),
            tried.join("; ")
        )))
    }

    fn open_exact(path: &Path) -> Result<Self, BackendError> {
        let nvml = Nvml::builder()
            .lib_path(OsStr::new(path.as_os_str()))
            .init()
            .map_err(|e| match e {
                NvmlError::LibloadingError(e) => BackendError::Unavailable(format!(
                    "cannot load NVML library {}: {e}",
                    path.display()
                )),
                NvmlError::FailedToLoadSymbol(s) => BackendError::Unavailable(format!(
                    "NVML library {} lacks a required function: {s}",
                    path.display()
                )),
                e => BackendError::Unavailable(format!(
                    "nvmlInit_v2 failed for {}: {e}",
                    path.display()
                )),
            })?;
        Ok(Self {
            nvml: Arc::new(nvml),
            lib_path: path.to_path_buf(),
            sysfs_root: PathBuf::from(DEFAULT_SYSFS_ROOT),
            profiles: Mutex::new(HashMap::new()),
            mutate: Mutex::new(()),
        })
    }

    /// Uses another sysfs mount for the PCIe-root lookup (tests, containers that mount
    /// the host's `/sys` elsewhere).
    pub fn with_sysfs_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.sysfs_root = root.into();
        self
    }

    /// The library this backend loaded.
    pub fn lib_path(&self) -> &Path {
        &self.lib_path
    }

    fn device_by_uuid(&self, uuid: &str) -> Result<Device<'_>, BackendError> {
        self.nvml.device_by_uuid(uuid).map_err(|e| match e {
            NvmlError::NotFound | NvmlError::InvalidArg => BackendError::GpuNotFound(uuid.into()),
            e => wrapper_err("nvmlDeviceGetHandleByUUID", uuid, e),
        })
    }

    /// Discovers one GPU; any failed query fails the whole GPU.
    fn discover_gpu(&self, index: u32) -> Result<GpuInfo, BackendError> {
        let target = format!("GPU index {index}");
        let device = self
            .nvml
            .device_by_index(index)
            .map_err(|e| wrapper_err("nvmlDeviceGetHandleByIndex", &target, e))?;
        let uuid = device
            .uuid()
            .map_err(|e| wrapper_err("nvmlDeviceGetUUID", &target, e))?;
        let q = |call: &'static str| {
            let uuid = uuid.clone();
            move |e: NvmlError| wrapper_err(call, &uuid, e)
        };
        let product_name = device.name().map_err(q("nvmlDeviceGetName"))?;
        let minor = device
            .minor_number()
            .map_err(q("nvmlDeviceGetMinorNumber"))?;
        let pci = device.pci_info().map_err(q("nvmlDeviceGetPciInfo"))?;
        let memory_bytes = device
            .memory_info()
            .map_err(q("nvmlDeviceGetMemoryInfo_v2"))?
            .total;
        let brand = format!("{:?}", device.brand().map_err(q("nvmlDeviceGetBrand"))?);
        let architecture = device
            .architecture()
            .map_err(q("nvmlDeviceGetArchitecture"))?
            .to_string();
        let cc = device
            .cuda_compute_capability()
            .map_err(q("nvmlDeviceGetCudaComputeCapability"))?;
        let cuda_compute_capability = (
            u32::try_from(cc.major).map_err(|_| bad_cc(&uuid, cc.major, cc.minor))?,
            u32::try_from(cc.minor).map_err(|_| bad_cc(&uuid, cc.major, cc.minor))?,
        );
        let pci_bus_id = canonical_pci_bus_id(&pci.bus_id)
            .unwrap_or_else(|| format!("{:04x}:{:02x}:{:02x}.0", pci.domain, pci.bus, pci.device));
        let pcie_root = pcie_root(&self.sysfs_root, &pci_bus_id);
        let numa_node = crate::numa::numa_node(&self.sysfs_root, &pci_bus_id);
        let multiprocessors = whole_gpu_sms(
            &uuid,
            device.num_cores(),
            cuda_compute_capability,
            &architecture,
            pci.pci_device_id,
        );

        let mig = match device.mig_mode() {
            Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => MigState::NotCapable,
            Err(e) => return Err(wrapper_err("nvmlDeviceGetMigMode", &uuid, e)),
            Ok(mode) => {
                let (profiles, unsupported) = self.profiles_cached(&device, &uuid, memory_bytes)?;
                if profiles.is_empty() {
                    let code = unsupported.map_or(ffi::ERROR_NOT_SUPPORTED, |e| e.code);
                    if mode.current == MIG_ENABLE {
                        tracing::error!(gpu = %uuid, nvml_return_code = code, "MIG mode is on but NVML answers no GPU-instance profile (nvmlDeviceGetGpuInstanceProfileInfo); no MIG placement or instance of this GPU can be published, and it is not published as migCapable");
                    } else {
                        tracing::debug!(gpu = %uuid, nvml_return_code = code, "no GPU-instance profile while MIG mode is off");
                    }
                }
                if mode.current == MIG_ENABLE {
                    let instances = self.instances(&device, &uuid, &profiles)?;
                    let memory_slices = memory_slices(&profiles);
                    MigState::Enabled {
                        profiles,
                        instances,
                        memory_slices,
                    }
                } else {
                    MigState::Disabled { profiles }
                }
            }
        };

        Ok(GpuInfo {
            index,
            minor,
            uuid,
            product_name,
            brand,
            architecture,
            cuda_compute_capability,
            memory_bytes,
            multiprocessors,
            pci_bus_id,
            pcie_root,
            numa_node,
            mig,
        })
    }

    /// Profile table of a GPU, from the cache or read now, with the last "not supported"
    /// answer when the table came out empty.
    fn profiles_cached(
        &self,
        device: &Device<'_>,
        uuid: &str,
        memory_bytes: u64,
    ) -> Result<(Vec<MigProfile>, Option<ffi::RawError>), BackendError> {
        let mut cache = self.profiles.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = cache.get(uuid) {
            return Ok((p.clone(), None));
        }
        let (profiles, unsupported) = read_profiles(device, uuid, memory_bytes)?;
        // An empty table may just mean "MIG mode off" (some drivers answer NOT_SUPPORTED
        // then); read it again once MIG is on.
        if !profiles.is_empty() {
            cache.insert(uuid.to_owned(), profiles.clone());
        }
        Ok((profiles, unsupported))
    }

    /// The GPU `uuid` and its profile table when its MIG mode is on; `None` when it is off
    /// or the GPU cannot do MIG (then it has no MIG instance of any kind).
    fn mig_enabled_device(
        &self,
        uuid: &str,
    ) -> Result<Option<(Device<'_>, Vec<MigProfile>)>, BackendError> {
        let device = self.device_by_uuid(uuid)?;
        match device.mig_mode() {
            Ok(m) if m.current == MIG_ENABLE => {}
            Ok(_) | Err(NvmlError::NotSupported) => return Ok(None),
            Err(e) => return Err(wrapper_err("nvmlDeviceGetMigMode", uuid, e)),
        }
        let profiles = self.profiles_for(&device, uuid)?;
        Ok(Some((device, profiles)))
    }

    /// Profile table of the GPU `uuid` (for naming new instances).
    fn profiles_for(
        &self,
        device: &Device<'_>,
        uuid: &str,
    ) -> Result<Vec<MigProfile>, BackendError> {
        if let Some(p) = self
            .profiles
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(uuid)
        {
            return Ok(p.clone());
        }
        let total = device
            .memory_info()
            .map_err(|e| wrapper_err("nvmlDeviceGetMemoryInfo_v2", uuid, e))?
            .total;
        Ok(self.profiles_cached(device, uuid, total)?.0)
    }

    /// The MIG devices (GPU instance + compute instance) that exist on a MIG-enabled GPU.
    fn instances(
        &self,
        device: &Device<'_>,
        uuid: &str,
        profiles: &[MigProfile],
    ) -> Result<Vec<MigInstance>, BackendError> {
        let (instances, bare) = self.instances_and_bare(device, uuid, profiles)?;
        for b in &bare {
            tracing::warn!(
                gpu = uuid,
                gi_id = b.gi_id,
                placement_start = b.placement.start,
                placement_size = b.placement.size,
                "GPU instance has no compute instance; it is not listed as a MIG device"
            );
        }
        Ok(instances)
    }

    /// The MIG devices (GPU instance + compute instance) and the GPU instances without a
    /// compute instance.
    fn instances_and_bare(
        &self,
        device: &Device<'_>,
        uuid: &str,
        profiles: &[MigProfile],
    ) -> Result<(Vec<MigInstance>, Vec<BareGpuInstance>), BackendError> {
        let nvml = &self.nvml;
        let raw = |e: ffi::RawError| raw_err(uuid, e);

        // GPU instances per profile: id -> info.
        let mut gis: BTreeMap<u32, ffi::GpuInstanceInfo> = BTreeMap::new();
        for p in profiles {
            let handles = match ffi::gpu_instances(device, p.id, p.instance_count) {
                Ok(h) => h,
                Err(e) if e.is_unsupported() => continue,
                Err(e) => return Err(raw(e)),
            };
            for gi in handles {
                let info = gi.info(nvml).map_err(raw)?;
                gis.insert(info.id, info);
            }
        }

        // MIG device handles give the (GI, CI) pair and the MIG UUID.
        let max = device
            .mig_device_count()
            .map_err(|e| wrapper_err("nvmlDeviceGetMaxMigDeviceCount", uuid, e))?;
        let mut out = Vec::new();
        let mut seen_gis = Vec::new();
        for i in 0..max {
            let mig = match device.mig_device_by_index(i) {
                Ok(m) => m,
                Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
                Err(e) => return Err(wrapper_err("nvmlDeviceGetMigDeviceHandleByIndex", uuid, e)),
            };
            let gi_id = ffi::mig_gpu_instance_id(&mig).map_err(raw)?;
            let ci_id = ffi::mig_compute_instance_id(&mig).map_err(raw)?;
            let mig_uuid = mig
                .uuid()
                .map_err(|e| wrapper_err("nvmlDeviceGetUUID", uuid, e))?;
            let info = match gis.get(&gi_id) {
                Some(info) => *info,
                None => ffi::gpu_instance_by_id(device, gi_id)
                    .and_then(|gi| gi.info(nvml))
                    .map_err(raw)?,
            };
            seen_gis.push(gi_id);
            out.push(MigInstance {
                uuid: mig_uuid,
                profile_id: info.profile_id,
                profile_name: profile_name_of(profiles, info.profile_id),
                gi_id,
                ci_id,
                placement: Placement {
                    start: info.start,
                    size: info.size,
                },
            });
        }
        let bare: Vec<BareGpuInstance> = gis
            .iter()
            .filter(|(id, _)| !seen_gis.contains(id))
            .map(|(id, info)| BareGpuInstance {
                gi_id: *id,
                profile_id: info.profile_id,
                placement: Placement {
                    start: info.start,
                    size: info.size,
                },
            })
            .collect();
        out.sort_by_key(|m| (m.placement.start, m.gi_id, m.ci_id));
        Ok((out, bare))
    }

    /// Finds the MIG device UUID of (gi, ci).
    fn mig_uuid(
        &self,
        device: &Device<'_>,
        uuid: &str,
        gi: u32,
        ci: u32,
    ) -> Result<String, BackendError> {
        let max = device
            .mig_device_count()
            .map_err(|e| wrapper_err("nvmlDeviceGetMaxMigDeviceCount", uuid, e))?;
        for i in 0..max {
            let mig = match device.mig_device_by_index(i) {
                Ok(m) => m,
                Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
                Err(e) => return Err(wrapper_err("nvmlDeviceGetMigDeviceHandleByIndex", uuid, e)),
            };
            let g = ffi::mig_gpu_instance_id(&mig).map_err(|e| raw_err(uuid, e))?;
            let c = ffi::mig_compute_instance_id(&mig).map_err(|e| raw_err(uuid, e))?;
            if (g, c) == (gi, ci) {
                return mig
                    .uuid()
                    .map_err(|e| wrapper_err("nvmlDeviceGetUUID", uuid, e));
            }
        }
        Err(BackendError::Other(format!(
            "GPU {uuid}: no MIG device for GPU instance {gi} / compute instance {ci}"
        )))
    }

    /// Creates CI inside `gi` and resolves ids and UUID; the caller cleans up on error.
    fn finish_mig<'n>(
        &'n self,
        device: &Device<'n>,
        uuid: &str,
        gi: ffi::GpuInstance<'n>,
        created_ci: &mut Option<ffi::ComputeInstance<'n>>,
    ) -> Result<(u32, u32, String), BackendError> {
        let nvml = &self.nvml;
        let ci_profile = full_compute_profile(nvml, gi).map_err(|e| raw_err(uuid, e))?;
        let ci = gi
            .create_compute_instance(nvml, ci_profile)
            .map_err(|e| raw_err(uuid, e))?;
        *created_ci = Some(ci);
        crate::fault::point("nvml.after_ci_create");
        let gi_id = gi.info(nvml).map_err(|e| raw_err(uuid, e))?.id;
        let ci_id = ci.id(nvml).map_err(|e| raw_err(uuid, e))?;
        let mig_uuid = self.mig_uuid(device, uuid, gi_id, ci_id)?;
        Ok((gi_id, ci_id, mig_uuid))
    }
}

impl GpuBackend for NvmlBackend {
    fn event_source(&self) -> Option<Arc<dyn crate::backend::EventSource>> {
        Some(Arc::new(events::NvmlEvents::new(Arc::clone(&self.nvml))))
    }

    fn usage_source(&self) -> Option<Arc<dyn crate::backend::UsageSource>> {
        Some(Arc::new(usage::NvmlUsage::new(Arc::clone(&self.nvml))))
    }

    fn nvml_library(&self) -> Option<PathBuf> {
        Some(self.lib_path.clone())
    }

    fn inventory(&self) -> Result<NodeInventory, BackendError> {
        let driver_version = self
            .nvml
            .sys_driver_version()
            .map_err(|e| wrapper_err("nvmlSystemGetDriverVersion", "system", e))?;
        let driver_semver = driver_semver(&driver_version)?;
        let cuda = self
            .nvml
            .sys_cuda_driver_version()
            .map_err(|e| wrapper_err("nvmlSystemGetCudaDriverVersion_v2", "system", e))?;
        let cuda_driver_semver = cuda_semver(cuda)?;
        let count = self
            .nvml
            .device_count()
            .map_err(|e| wrapper_err("nvmlDeviceGetCount_v2", "system", e))?;
        let mut gpus = Vec::with_capacity(count as usize);
        for index in 0..count {
            match self.discover_gpu(index) {
                Ok(gpu) => gpus.push(gpu),
                Err(error) => tracing::warn!(
                    gpu_index = index,
                    %error,
                    "skipping GPU that failed discovery"
                ),
            }
        }
        gpus.sort_by_key(|g| (g.minor, g.index));
        Ok(NodeInventory {
            driver_version,
            driver_semver,
            cuda_driver_semver,
            gpus,
        })
    }

    fn create_mig(
        &self,
        gpu_uuid: &str,
        profile_id: u32,
        placement: Placement,
    ) -> Result<MigInstance, BackendError> {
        let _guard = self.mutate.lock().unwrap_or_else(PoisonError::into_inner);
        let device = self.device_by_uuid(gpu_uuid)?;
        let profiles = self.profiles_for(&device, gpu_uuid)?;
        let gi = ffi::create_gpu_instance_with_placement(
            &device,
            profile_id,
            placement.start,
            placement.size,
        )
        .map_err(|e| raw_err(gpu_uuid, e))?;
        // The GPU instance exists, its compute instance not yet: a crash here leaves a bare
        // GPU instance, which the driver finds by the placement it recorded beforehand.
        crate::fault::point("nvml.after_gi_create");
        let mut created_ci = None;
        match self.finish_mig(&device, gpu_uuid, gi, &mut created_ci) {
            Ok((gi_id, ci_id, uuid)) => {
                tracing::info!(
                    gpu = gpu_uuid,
                    profile_id,
                    placement_start = placement.start,
                    gi_id,
                    ci_id,
                    mig = %uuid,
                    "created MIG device"
                );
                Ok(MigInstance {
                    uuid,
                    profile_id,
                    profile_name: profile_name_of(&profiles, profile_id),
                    gi_id,
                    ci_id,
                    placement,
                })
            }
            Err(error) => {
                // Leave nothing behind: the compute instance (if any), then the GPU instance.
                if let Some(ci) = created_ci
                    && let Err(e) = ci.destroy(&self.nvml)
                {
                    tracing::error!(gpu = gpu_uuid, error = ?e, "rollback: destroying compute instance failed");
                }
                if let Err(e) = gi.destroy(&self.nvml) {
                    // Left bare: the caller's rollback finds it by the recorded placement
                    // (list_bare_gpu_instances) and destroys it, retrying until it goes.
                    let gi_id = gi.info(&self.nvml).ok().map(|i| i.id);
                    tracing::error!(
                        gpu = gpu_uuid,
                        profile_id,
                        placement_start = placement.start,
                        gi_id,
                        error = ?e,
                        "rollback: destroying GPU instance failed; a bare GPU instance is left for the next rollback"
                    );
                    return Err(BackendError::LeftBare {
                        gi_id,
                        source: Box::new(error),
                    });
                }
                Err(error)
            }
        }
    }

    fn destroy_mig(&self, gpu_uuid: &str, gi_id: u32, ci_id: u32) -> Result<(), BackendError> {
        let _guard = self.mutate.lock().unwrap_or_else(PoisonError::into_inner);
        let device = self.device_by_uuid(gpu_uuid)?;
        let gi = match ffi::gpu_instance_by_id(&device, gi_id) {
            Ok(gi) => gi,
            Err(e) if e.is_gone() => return Ok(()),
            Err(e) => return Err(raw_err(gpu_uuid, e)),
        };
        match gi.compute_instance_by_id(&self.nvml, ci_id) {
            Ok(ci) => match ci.destroy(&self.nvml) {
                Ok(()) => crate::fault::point("nvml.after_ci_destroy"),
                Err(e) if e.is_gone() => {}
                Err(e) => return Err(raw_err(gpu_uuid, e)),
            },
            Err(e) if e.is_gone() => {}
            Err(e) => return Err(raw_err(gpu_uuid, e)),
        }
        match gi.destroy(&self.nvml) {
            Ok(()) => crate::fault::point("nvml.after_gi_destroy"),
            Err(e) if e.is_gone() => {}
            Err(e) => return Err(raw_err(gpu_uuid, e)),
        }
        tracing::info!(gpu = gpu_uuid, gi_id, ci_id, "destroyed MIG device");
        Ok(())
    }

    fn list_bare_gpu_instances(
        &self,
        gpu_uuid: &str,
    ) -> Result<Vec<BareGpuInstance>, BackendError> {
        let Some((device, profiles)) = self.mig_enabled_device(gpu_uuid)? else {
            return Ok(Vec::new());
        };
        Ok(self.instances_and_bare(&device, gpu_uuid, &profiles)?.1)
    }

    fn destroy_gpu_instance(&self, gpu_uuid: &str, gi_id: u32) -> Result<(), BackendError> {
        let _guard = self.mutate.lock().unwrap_or_else(PoisonError::into_inner);
        let device = self.device_by_uuid(gpu_uuid)?;
        let gi = match ffi::gpu_instance_by_id(&device, gi_id) {
            Ok(gi) => gi,
            Err(e) if e.is_gone() => return Ok(()),
            Err(e) => return Err(raw_err(gpu_uuid, e)),
        };
        match gi.destroy(&self.nvml) {
            Ok(()) => crate::fault::point("nvml.after_gi_destroy"),
            Err(e) if e.is_gone() => {}
            Err(e) => return Err(raw_err(gpu_uuid, e)),
        }
        tracing::info!(
            gpu = gpu_uuid,
            gi_id,
            "destroyed GPU instance without compute instance"
        );
        Ok(())
    }

    fn list_mig(&self, gpu_uuid: &str) -> Result<Vec<MigInstance>, BackendError> {
        let Some((device, profiles)) = self.mig_enabled_device(gpu_uuid)? else {
            return Ok(Vec::new());
        };
        self.instances(&device, gpu_uuid, &profiles)
    }
}

/// The largest compute-instance profile a GPU instance supports (its full size), as
/// the CI profile id to create. The `+me`-style REV1 CI profile is used only if nothing
/// else exists.
fn full_compute_profile(nvml: &Nvml, gi: ffi::GpuInstance<'_>) -> ffi::RawResult<u32> {
    let mut best: Option<(bool, u32, u32)> = None; // (is not rev1, slices, id)
    let mut last_err = None;
    for p in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
        match gi.compute_instance_profile_info(nvml, p) {
            Ok(info) => {
                let key = (
                    p != NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1,
                    info.sliceCount,
                    info.id,
                );
                if best.is_none_or(|b| (key.0, key.1) > (b.0, b.1)) {
                    best = Some(key);
                }
            }
            Err(e) if e.is_unsupported() => {}
            Err(e) => last_err = Some(e),
        }
    }
    match (best, last_err) {
        (Some((_, _, id)), _) => Ok(id),
        (None, Some(e)) => Err(e),
        (None, None) => Err(ffi::RawError {
            call: "nvmlGpuInstanceGetComputeInstanceProfileInfo",
            code: ffi::ERROR_NOT_SUPPORTED,
        }),
    }
}

/// Reads all GPU-instance profiles of a MIG-capable GPU with their placements, and the
/// last "not supported" answer (for the log when none could be read).
fn read_profiles(
    device: &Device<'_>,
    uuid: &str,
    memory_bytes: u64,
) -> Result<(Vec<MigProfile>, Option<ffi::RawError>), BackendError> {
    let use_v = ffi::has_profile_info_v(device.nvml());
    let mut out = Vec::new();
    let mut unsupported = None;
    for p in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
        let info = match ffi::gpu_instance_profile_info(device, p) {
            Ok(i) => i,
            Err(e) if e.is_unsupported() => {
                unsupported = Some(e);
                continue;
            }
            Err(e) => return Err(raw_err(uuid, e)),
        };
        let reported = if use_v {
            ffi::gpu_instance_profile_info_v2(device, p)
                .ok()
                .and_then(|v2| ffi::c_name(&v2.name))
                .and_then(|n| clean_profile_name(&n))
        } else {
            None
        };
        let name = reported.unwrap_or_else(|| {
            computed_profile_name(p, info.sliceCount, info.memorySizeMB, memory_bytes)
        });
        let placements = ffi::possible_placements(device, info.id)
            .map_err(|e| raw_err(uuid, e))?
            .into_iter()
            .map(|(start, size)| Placement { start, size })
            .collect();
        out.push(MigProfile {
            id: info.id,
            name,
            slice_count: info.sliceCount,
            instance_count: info.instanceCount,
            memory_mib: info.memorySizeMB,
            multiprocessors: info.multiprocessorCount,
            copy_engines: info.copyEngineCount,
            decoders: info.decoderCount,
            encoders: info.encoderCount,
            jpeg_engines: info.jpegCount,
            ofa_engines: info.ofaCount,
            placements,
        });
    }
    Ok((out, unsupported))
}

/// Accepts a profile name NVML reported (`1g.10gb`, or `MIG 1g.10gb`), if it looks like one.
fn clean_profile_name(name: &str) -> Option<String> {
    let n = name.trim();
    let n = n.strip_prefix("MIG ").unwrap_or(n).trim();
    let mut chars = n.chars();
    let ok = chars.next().is_some_and(|c| c.is_ascii_digit())
        && n.contains('g')
        && n.is_ascii()
        && !n.contains(char::is_whitespace);
    ok.then(|| n.to_owned())
}

/// The profile name as go-nvlib computes it (`%dg.%dgb` plus `+me` etc.): memory in GB
/// is the profile's share of the GPU rounded up to eighths, times the GPU's size in GiB
/// rounded up.
pub(crate) fn computed_profile_name(
    profile_enum: u32,
    slice_count: u32,
    profile_memory_mib: u64,
    gpu_memory_bytes: u64,
) -> String {
    let gb = if gpu_memory_bytes == 0 {
        profile_memory_mib.div_ceil(1024)
    } else {
        let share = (profile_memory_mib * MIB) as f64 / gpu_memory_bytes as f64;
        let eighths = (share * 8.0).ceil() / 8.0;
        let gpu_gib = gpu_memory_bytes.div_ceil(1 << 30) as f64;
        (eighths * gpu_gib).round() as u64
    };
    let suffix = match profile_enum {
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 | NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1 => "+me",
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME | NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME => {
            "+me.all"
        }
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX
        | NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX
        | NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX => "+gfx",
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME | NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME => "-me",
        _ => "",
    };
    format!("{slice_count}g.{gb}gb{suffix}")
}

fn profile_name_of(profiles: &[MigProfile], id: u32) -> String {
    profiles
        .iter()
        .find(|p| p.id == id)
        .map_or_else(|| format!("unknown-{id}"), |p| p.name.clone())
}

/// Memory slices of a GPU: the end of the furthest placement (8 on A100/H100/H200).
pub fn memory_slices(profiles: &[MigProfile]) -> u32 {
    profiles
        .iter()
        .flat_map(|p| p.placements.iter())
        .map(|pl| pl.start + pl.size)
        .max()
        .unwrap_or(0)
}

/// Kernel driver version as semver: `570.148.08` -> `570.148.8`, `550.54` -> `550.54.0`.
pub fn driver_semver(version: &str) -> Result<String, BackendError> {
    let err = || {
        BackendError::Other(format!(
            "driver version {version:?} is not of the form <major>.<minor>[.<patch>]"
        ))
    };
    let parts: Vec<&str> = version.trim().split('.').collect();
    if !(2..=3).contains(&parts.len()) {
        return Err(err());
    }
    let mut nums = [0u64; 3];
    for (slot, part) in nums.iter_mut().zip(&parts) {
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err());
        }
        *slot = part.parse().map_err(|_| err())?;
    }
    Ok(format!("{}.{}.{}", nums[0], nums[1], nums[2]))
}

/// CUDA driver API version (`nvmlSystemGetCudaDriverVersion`) as semver: 12080 -> `12.8.0`.
pub(crate) fn cuda_semver(version: i32) -> Result<String, BackendError> {
    if version <= 0 {
        return Err(BackendError::Other(format!(
            "CUDA driver version {version} is not a positive integer of the form 1000*major + 10*minor"
        )));
    }
    Ok(format!("{}.{}.0", version / 1000, (version % 1000) / 10))
}

/// Compute capability as semver: (9, 0) -> `9.0.0`.
pub fn compute_capability_semver((major, minor): (u32, u32)) -> String {
    format!("{major}.{minor}.0")
}

/// NVML's bus id (`00000000:53:00.0`) in the canonical lowercase form `0000:53:00.0`.
pub(crate) fn canonical_pci_bus_id(nvml_bus_id: &str) -> Option<String> {
    let (domain, rest) = nvml_bus_id.trim().split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (dev, func) = rest.split_once('.')?;
    let hex = |s: &str| u32::from_str_radix(s, 16).ok();
    Some(format!(
        "{:04x}:{:02x}:{:02x}.{:x}",
        hex(domain)?,
        hex(bus)?,
        hex(dev)?,
        hex(func)?
    ))
}

/// The PCIe root complex (`pci0000:50`) above `bus_id`, from the
/// `<sysfs>/bus/pci/devices/<bus id>` symlink; `None` when sysfs does not have it.
pub fn pcie_root(sysfs_root: &Path, bus_id: &str) -> Option<String> {
    let link = std::fs::read_link(sysfs_root.join("bus/pci/devices").join(bus_id)).ok()?;
    link.components()
        .filter_map(|c| c.as_os_str().to_str())
        .find(|s| s.starts_with("pci") && s.contains(':'))
        .map(str::to_owned)
}

/// CUDA cores per streaming multiprocessor by compute capability, as CUDA's own samples
/// tabulate them (NVIDIA/cuda-samples `Common/helper_cuda.h`, `_ConvertSMVer2Cores`);
/// `None` for a capability that table does not list (no guess).
pub fn cores_per_sm((major, minor): (u32, u32)) -> Option<u32> {
    match (major, minor) {
        (3, 0 | 2 | 5 | 7) => Some(192),
        (5, 0 | 2 | 3) | (6, 1 | 2) => Some(128),
        (6, 0) | (7, 0 | 2 | 5) | (8, 0) => Some(64),
        (8, 6 | 7 | 9) | (9, 0) | (10, 0 | 1 | 3) | (11, 0) | (12, 0 | 1) => Some(128),
        _ => None,
    }
}

/// Streaming multiprocessors of a whole GPU. NVML has no whole-GPU SM count (its profile
/// and attribute queries answer for MIG only); it has the CUDA core count
/// (`nvmlDeviceGetNumGpuCores`), which divided by the cores per SM of the compute
/// capability gives the SMs. Only when that is unavailable, the PCI-id table
/// ([`whole_gpu_multiprocessors`]) is used, and only if its architecture is the one NVML
/// reports (a board can carry another product's PCI id). `None`: unknown, published
/// without the `multiprocessors` capacity.
pub(crate) fn whole_gpu_sms(
    uuid: &str,
    cores: Result<u32, NvmlError>,
    compute_capability: (u32, u32),
    architecture: &str,
    pci_device_id: u32,
) -> Option<u32> {
    let (major, minor) = compute_capability;
    let from_cores = match (&cores, cores_per_sm(compute_capability)) {
        (Ok(c), Some(per)) if *c > 0 && c % per == 0 => Some(c / per),
        (Ok(c), Some(per)) => {
            tracing::warn!(gpu = %uuid, cores = c, cores_per_sm = per, "CUDA core count is not a multiple of the cores per SM of compute capability {major}.{minor}; not used");
            None
        }
        (Ok(_), None) => {
            tracing::warn!(gpu = %uuid, "no cores-per-SM figure for compute capability {major}.{minor}; the SM count cannot be derived from the core count");
            None
        }
        (Err(e), _) => {
            tracing::debug!(gpu = %uuid, error = %e, "nvmlDeviceGetNumGpuCores");
            None
        }
    };
    let from_table = whole_gpu_multiprocessors_entry(pci_device_id);
    match (from_cores, from_table) {
        (Some(sms), Some((table_sms, _))) if sms != table_sms => {
            tracing::warn!(gpu = %uuid, nvml = sms, table = table_sms, "SM count from NVML differs from the PCI-id table; using NVML's");
            Some(sms)
        }
        (Some(sms), _) => Some(sms),
        (None, Some((table_sms, arch))) if arch == architecture => Some(table_sms),
        (None, Some((_, arch))) => {
            tracing::warn!(gpu = %uuid, pci_device_id = format!("{pci_device_id:#010x}"), table_architecture = arch, nvml_architecture = architecture, "the PCI-id table's product does not match the architecture NVML reports; SM count unknown, multiprocessors not published");
            None
        }
        (None, None) => {
            tracing::warn!(gpu = %uuid, pci_device_id = format!("{pci_device_id:#010x}"), "SM count unknown (NVML gives no core count and the PCI id is not in the table); multiprocessors not published");
            None
        }
    }
}

/// Streaming multiprocessors of the whole GPU by PCI device id (`nvmlPciInfo_t.pciDeviceId`,
/// device << 16 | vendor): the fallback of [`whole_gpu_sms`]. Figures are CUDA deviceQuery
/// values (products and sources in docs/driver-root.md).
pub fn whole_gpu_multiprocessors(pci_device_id: u32) -> Option<u32> {
    whole_gpu_multiprocessors_entry(pci_device_id).map(|(sms, _)| sms)
}

/// The table entry: SMs and the architecture (as NVML names it) of the product.
fn whole_gpu_multiprocessors_entry(pci_device_id: u32) -> Option<(u32, &'static str)> {
    match pci_device_id >> 16 {
        0x20B0 | 0x20B2 => Some((108, "Ampere")), // A100-SXM4-40GB / 80GB
        0x2330 | 0x2335 => Some((132, "Hopper")), // H100 80GB HBM3 (SXM5), H200
        0x2331 => Some((114, "Hopper")),          // H100 PCIe
        0x27B8 => Some((58, "Ada")),              // L4
        0x1EB8 => Some((40, "Turing")),           // T4
        _ => None,
    }
}

fn bad_cc(uuid: &str, major: i32, minor: i32) -> BackendError {
    BackendError::Other(format!(
        "GPU {uuid}: CUDA compute capability {major}.{minor} is negative"
    ))
}

fn wrapper_err(call: &'static str, target: &str, e: NvmlError) -> BackendError {
    let message = e.to_string();
    let code = match e {
        NvmlError::FailedToLoadSymbol(_) => ffi::ERROR_FUNCTION_NOT_FOUND,
        e => e.into(),
    };
    BackendError::Nvml {
        call,
        target: target.to_owned(),
        message,
        code,
    }
}

fn raw_err(target: &str, e: ffi::RawError) -> BackendError {
    BackendError::Nvml {
        call: e.call,
        target: target.to_owned(),
        message: ffi::error_string(e.code),
        code: e.code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_convert_to_semver() {
        assert_eq!(driver_semver("570.148.08").unwrap(), "570.148.8");
        assert_eq!(driver_semver("580.105.08").unwrap(), "580.105.8");
        assert_eq!(driver_semver("550.54").unwrap(), "550.54.0");
        assert_eq!(cuda_semver(12080).unwrap(), "12.8.0");
        assert_eq!(cuda_semver(12020).unwrap(), "12.2.0");
        assert_eq!(cuda_semver(13000).unwrap(), "13.0.0");
        assert_eq!(compute_capability_semver((9, 0)), "9.0.0");
        assert_eq!(compute_capability_semver((8, 9)), "8.9.0");
    }

    #[test]
    fn bad_versions_are_clear_errors() {
        for bad in [
            "",
            "570",
            "570.x.08",
            "570..1",
            "1.2.3.4",
            "r570.1",
            "570.148.08-beta",
        ] {
            let e = driver_semver(bad).unwrap_err();
            assert!(e.to_string().contains("driver version"), "{bad:?}: {e}");
        }
        assert!(cuda_semver(0).is_err());
        assert!(
            cuda_semver(-1)
                .unwrap_err()
                .to_string()
                .contains("CUDA driver version")
        );
    }

    #[test]
    fn pci_bus_ids_are_canonical() {
        assert_eq!(
            canonical_pci_bus_id("00000000:53:00.0").unwrap(),
            "0000:53:00.0"
        );
        assert_eq!(
            canonical_pci_bus_id("00000000:CA:00.0").unwrap(),
            "0000:ca:00.0"
        );
        assert_eq!(
            canonical_pci_bus_id("0001:0A:1F.1").unwrap(),
            "0001:0a:1f.1"
        );
        assert_eq!(canonical_pci_bus_id("garbage"), None);
        assert_eq!(canonical_pci_bus_id("0000:zz:00.0"), None);
    }

    #[test]
    fn pcie_root_is_read_from_sysfs_link() {
        let dir = tempfile::tempdir().unwrap();
        let devices = dir.path().join("bus/pci/devices");
        std::fs::create_dir_all(&devices).unwrap();
        std::os::unix::fs::symlink(
            "../../../devices/pci0000:50/0000:50:01.0/0000:53:00.0",
            devices.join("0000:53:00.0"),
        )
        .unwrap();
        assert_eq!(
            pcie_root(dir.path(), "0000:53:00.0").as_deref(),
            Some("pci0000:50")
        );
        assert_eq!(pcie_root(dir.path(), "0000:64:00.0"), None);
        assert_eq!(
            pcie_root(Path::new("/nonexistent-sysfs"), "0000:53:00.0"),
            None
        );
    }

    #[test]
    fn multiprocessor_table() {
        assert_eq!(whole_gpu_multiprocessors(0x20B0_10DE), Some(108));
        assert_eq!(whole_gpu_multiprocessors(0x20B2_10DE), Some(108));
        assert_eq!(whole_gpu_multiprocessors(0x2330_10DE), Some(132));
        assert_eq!(whole_gpu_multiprocessors(0x2335_10DE), Some(132));
        assert_eq!(whole_gpu_multiprocessors(0x27B8_10DE), Some(58));
        assert_eq!(whole_gpu_multiprocessors(0x1EB8_10DE), Some(40));
        assert_eq!(whole_gpu_multiprocessors(0x1234_10DE), None);
    }

    #[test]
    fn sms_come_from_the_core_count_then_a_matching_table_entry() {
        let h100 = 0x2330_10DE;
        // NVML's core count wins: 16896 / 128 (CC 9.0).
        assert_eq!(
            whole_gpu_sms("g", Ok(16896), (9, 0), "Hopper", h100),
            Some(132)
        );
        // A B200 (CC 10.0) that no table lists: 18432 cores / 128.
        assert_eq!(
            whole_gpu_sms("g", Ok(18432), (10, 0), "Blackwell", 0x2901_10DE),
            Some(144)
        );
        // A100: 64 cores per SM.
        assert_eq!(
            whole_gpu_sms("g", Ok(6912), (8, 0), "Ampere", 0x20B0_10DE),
            Some(108)
        );
        // No core count: the table, when its architecture is NVML's.
        let unsupported = || Err(NvmlError::NotSupported);
        assert_eq!(
            whole_gpu_sms("g", unsupported(), (9, 0), "Hopper", h100),
            Some(132)
        );
        // A Blackwell board carrying an H100 PCI id: the table does not apply.
        assert_eq!(
            whole_gpu_sms("g", unsupported(), (10, 0), "Blackwell", h100),
            None
        );
        // Unknown product, no core count: unknown.
        assert_eq!(
            whole_gpu_sms("g", unsupported(), (10, 0), "Blackwell", 0x2901_10DE),
            None
        );
        // A core count that does not divide: not trusted.
        assert_eq!(
            whole_gpu_sms("g", Ok(1000), (10, 0), "Blackwell", 0x2901_10DE),
            None
        );
        assert_eq!(cores_per_sm((7, 5)), Some(64));
        assert_eq!(cores_per_sm((8, 9)), Some(128));
        assert_eq!(cores_per_sm((13, 0)), None);
    }

    #[test]
    fn profile_names_follow_go_nvlib() {
        let h100 = 81559 * MIB;
        assert_eq!(computed_profile_name(0, 1, 9984, h100), "1g.10gb");
        assert_eq!(computed_profile_name(7, 1, 9984, h100), "1g.10gb+me");
        assert_eq!(computed_profile_name(9, 1, 20096, h100), "1g.20gb");
        assert_eq!(computed_profile_name(1, 2, 20096, h100), "2g.20gb");
        assert_eq!(computed_profile_name(2, 3, 40448, h100), "3g.40gb");
        assert_eq!(computed_profile_name(3, 4, 40448, h100), "4g.40gb");
        assert_eq!(computed_profile_name(4, 7, 81152, h100), "7g.80gb");
        let a100 = 40960 * MIB;
        assert_eq!(computed_profile_name(0, 1, 4864, a100), "1g.5gb");
        assert_eq!(computed_profile_name(3, 4, 20096, a100), "4g.20gb");
        assert_eq!(computed_profile_name(4, 7, 40448, a100), "7g.40gb");
        let h200 = 143771 * MIB;
        assert_eq!(computed_profile_name(0, 1, 16384, h200), "1g.18gb");
        assert_eq!(computed_profile_name(9, 1, 33024, h200), "1g.35gb");
        assert_eq!(computed_profile_name(2, 3, 71168, h200), "3g.71gb");
        assert_eq!(computed_profile_name(4, 7, 143104, h200), "7g.141gb");
        assert_eq!(computed_profile_name(13, 1, 9984, h100), "1g.10gb-me");
    }

    #[test]
    fn reported_profile_names_are_cleaned() {
        assert_eq!(clean_profile_name("1g.10gb").as_deref(), Some("1g.10gb"));
        assert_eq!(
            clean_profile_name("MIG 1g.10gb+me").as_deref(),
            Some("1g.10gb+me")
        );
        assert_eq!(clean_profile_name(""), None);
        assert_eq!(clean_profile_name("MIG"), None);
        assert_eq!(clean_profile_name("one slice"), None);
    }

    #[test]
    fn memory_slices_is_furthest_placement_end() {
        let p = |placements: Vec<(u32, u32)>| MigProfile {
            id: 0,
            name: String::new(),
            slice_count: 1,
            instance_count: 1,
            memory_mib: 1,
            multiprocessors: 1,
            copy_engines: 1,
            decoders: 0,
            encoders: 0,
            jpeg_engines: 0,
            ofa_engines: 0,
            placements: placements
                .into_iter()
                .map(|(start, size)| Placement { start, size })
                .collect(),
        };
        assert_eq!(memory_slices(&[]), 0);
        assert_eq!(
            memory_slices(&[p(vec![(0, 1), (6, 1)]), p(vec![(0, 8)])]),
            8
        );
    }

    #[test]
    fn missing_library_is_unavailable() {
        let e = NvmlBackend::open(Some(Path::new("/nonexistent/libnvidia-ml.so.1"))).unwrap_err();
        match e {
            BackendError::Unavailable(msg) => assert!(msg.contains("/nonexistent"), "{msg}"),
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }
}
