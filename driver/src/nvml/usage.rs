//! [`UsageSource`] over the backend's NVML handle, through nvml-wrapper's safe calls.
//!
//! The one thing the wrapper cannot do safely is keep a GPM sample past the borrow of the
//! `Nvml` it came from, which the usage sampler needs (GPM metrics are computed between two
//! samples taken one sampling interval apart). Samples are therefore kept as raw handles
//! (`GpmSample::into_handle`) and rebuilt with `GpmSample::from_handle` over the same
//! `Nvml`, which this source owns a share of, so they never outlive it.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::gpm::{GpmSample, gpm_metrics_get};
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::nvmlGpmSample_t;

use crate::backend::{
    BackendError, GpmActivity, GpmReading, GpmTarget, MemoryUse, ProcessMemory, ProcessUtilization,
    UsageSource,
};

/// A GPM sample handle allocated by `nvmlGpmSampleAlloc` of [`NvmlUsage::nvml`], owned
/// by the map that holds it.
struct HeldSample(nvmlGpmSample_t);

// SAFETY: the handle is an opaque NVML allocation that is only used under the `samples`
// mutex (one thread at a time); NVML itself is thread-safe.
unsafe impl Send for HeldSample {}

/// The NVML usage source.
pub(super) struct NvmlUsage {
    nvml: Arc<Nvml>,
    /// The previous GPM sample per target.
    samples: Mutex<HashMap<GpmTarget, HeldSample>>,
    /// `nvmlGpmQueryDeviceSupport` per GPU UUID (it does not change while the driver runs).
    gpm_support: Mutex<HashMap<String, bool>>,
}

impl NvmlUsage {
    pub(super) fn new(nvml: Arc<Nvml>) -> Self {
        Self {
            nvml,
            samples: Mutex::new(HashMap::new()),
            gpm_support: Mutex::new(HashMap::new()),
        }
    }

    fn device(&self, uuid: &str) -> Result<Device<'_>, BackendError> {
        self.nvml.device_by_uuid(uuid).map_err(|e| match e {
            NvmlError::NotFound | NvmlError::InvalidArg => BackendError::GpuNotFound(uuid.into()),
            e => super::wrapper_err("nvmlDeviceGetHandleByUUID", uuid, e),
        })
    }

    /// Takes ownership of a held sample again, to use or free it.
    fn rebuild(&self, held: HeldSample) -> GpmSample<'_> {
        // SAFETY: every `HeldSample` comes from `GpmSample::into_handle` of a sample of
        // `self.nvml` and is removed from the map before it is rebuilt, so it is freed once.
        unsafe { GpmSample::from_handle(&self.nvml, held.0) }
    }

    fn supports_gpm(&self, gpu_uuid: &str, device: &Device<'_>) -> bool {
        let mut cache = self
            .gpm_support
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *cache
            .entry(gpu_uuid.to_owned())
            .or_insert_with(|| device.gpm_support().unwrap_or(false))
    }
}

impl Drop for NvmlUsage {
    fn drop(&mut self) {
        let held: Vec<HeldSample> = self
            .samples
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .map(|(_, s)| s)
            .collect();
        for s in held {
            drop(self.rebuild(s));
        }
    }
}

fn unsupported(e: &NvmlError) -> bool {
    matches!(e, NvmlError::NotSupported)
}

impl UsageSource for NvmlUsage {
    fn memory(&self, device_uuid: &str) -> Result<MemoryUse, BackendError> {
        let m = self
            .device(device_uuid)?
            .memory_info()
            .map_err(|e| super::wrapper_err("nvmlDeviceGetMemoryInfo_v2", device_uuid, e))?;
        Ok(MemoryUse {
            used: m.used,
            total: m.total,
        })
    }

    fn gpu_utilization(&self, gpu_uuid: &str) -> Result<Option<u32>, BackendError> {
        match self.device(gpu_uuid)?.utilization_rates() {
            Ok(u) => Ok(Some(u.gpu)),
            Err(e) if unsupported(&e) => Ok(None),
            Err(e) => Err(super::wrapper_err(
                "nvmlDeviceGetUtilizationRates",
                gpu_uuid,
                e,
            )),
        }
    }

    fn gpm(&self, target: &GpmTarget) -> Result<GpmReading, BackendError> {
        let device = self.device(&target.gpu_uuid)?;
        if !self.supports_gpm(&target.gpu_uuid, &device) {
            return Ok(GpmReading::Unsupported);
        }
        let (call, taken) = match target.gi {
            Some(gi) => ("nvmlGpmMigSampleGet", device.gpm_mig_sample(gi)),
            None => ("nvmlGpmSampleGet", device.gpm_sample()),
        };
        let fresh = match taken {
            Ok(s) => s,
            Err(e) if unsupported(&e) => return Ok(GpmReading::Unsupported),
            Err(e) => return Err(super::wrapper_err(call, &target.gpu_uuid, e)),
        };
        let previous = self
            .samples
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(target);
        let reading = match previous {
            None => GpmReading::Warming,
            Some(prev) => {
                let prev = self.rebuild(prev);
                let metrics = gpm_metrics_get(
                    &self.nvml,
                    &prev,
                    &fresh,
                    &[GpmMetricId::SmUtil, GpmMetricId::SmOccupancy],
                )
                .map_err(|e| super::wrapper_err("nvmlGpmMetricsGet", &target.gpu_uuid, e))?;
                let mut values = metrics.into_iter().map(|m| m.ok().map(|m| m.value));
                match values.next().flatten() {
                    Some(sm_activity) => GpmReading::Ready(GpmActivity {
                        sm_activity,
                        sm_occupancy: values.next().flatten(),
                    }),
                    None => GpmReading::Unsupported,
                }
            }
        };
        self.samples
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(target.clone(), HeldSample(fresh.into_handle()));
        Ok(reading)
    }

    fn gpm_retain(&self, live: &[GpmTarget]) {
        let dropped: Vec<HeldSample> = {
            let mut map = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
            let gone: Vec<GpmTarget> = map.keys().filter(|k| !live.contains(k)).cloned().collect();
            gone.iter().filter_map(|k| map.remove(k)).collect()
        };
        for s in dropped {
            drop(self.rebuild(s));
        }
    }

    fn processes(&self, device_uuid: &str) -> Result<Vec<ProcessMemory>, BackendError> {
        let list = self
            .device(device_uuid)?
            .running_compute_processes()
            .map_err(|e| {
                super::wrapper_err("nvmlDeviceGetComputeRunningProcesses_v3", device_uuid, e)
            })?;
        Ok(list.into_iter().map(process_memory).collect())
    }

    fn mps_processes(&self, device_uuid: &str) -> Result<Vec<ProcessMemory>, BackendError> {
        match self.device(device_uuid)?.mps_running_compute_processes() {
            Ok(list) => Ok(list.into_iter().map(process_memory).collect()),
            // A driver or device without the call has no MPS clients to tell apart.
            Err(e) if unsupported(&e) || matches!(e, NvmlError::FailedToLoadSymbol(_)) => {
                Ok(Vec::new())
            }
            Err(e) => Err(super::wrapper_err(
                "nvmlDeviceGetMPSComputeRunningProcesses_v3",
                device_uuid,
                e,
            )),
        }
    }

    fn process_utilization(
        &self,
        gpu_uuid: &str,
        since_us: u64,
    ) -> Result<Option<Vec<ProcessUtilization>>, BackendError> {
        match self.device(gpu_uuid)?.process_utilization_stats(since_us) {
            Ok(list) => Ok(Some(
                list.into_iter()
                    .map(|s| ProcessUtilization {
                        pid: s.pid,
                        timestamp_us: s.timestamp,
                        sm_percent: s.sm_util,
                    })
                    .collect(),
            )),
            // nvml.h: NOT_FOUND when no sample is newer than `since_us`.
            Err(NvmlError::NotFound) => Ok(Some(Vec::new())),
            Err(e) if unsupported(&e) => Ok(None),
            Err(e) => Err(super::wrapper_err(
                "nvmlDeviceGetProcessUtilization",
                gpu_uuid,
                e,
            )),
        }
    }
}

fn process_memory(p: nvml_wrapper::struct_wrappers::device::ProcessInfo) -> ProcessMemory {
    ProcessMemory {
        pid: p.pid,
        used: match p.used_gpu_memory {
            UsedGpuMemory::Used(b) => Some(b),
            UsedGpuMemory::Unavailable => None,
        },
        gi: p.gpu_instance_id,
        ci: p.compute_instance_id,
    }
}
