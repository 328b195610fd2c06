//! [`EventSource`] over the backend's NVML handle: one event set per subscription, Xid and
//! double-bit ECC events, and the lost-GPU check.
//!
//! Two calls go around nvml-wrapper, each for a stated reason: `nvmlDeviceRegisterEvents`
//! (the wrapper's `register_events` frees the whole set on any error, which would drop the
//! GPUs registered before) and `nvmlEventSetWait_v2` (the wrapper's `EventData` drops the
//! GPU and compute instance ids).

#![allow(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{EventSet, Nvml};
use nvml_wrapper_sys::bindings::nvmlEventData_t;
use tracing::{debug, warn};

use crate::backend::{
    BackendError, EVENT_DOUBLE_BIT_ECC, EVENT_XID, EventSource, EventSubscription, EventWait,
    RawEvent,
};

/// `NVML_ERROR_TIMEOUT`.
const ERROR_TIMEOUT: u32 = 10;
/// `NVML_ERROR_GPU_IS_LOST`.
const ERROR_GPU_IS_LOST: u32 = 15;
/// `NVML_ERROR_FUNCTION_NOT_FOUND`.
const ERROR_FUNCTION_NOT_FOUND: u32 = 13;

/// The NVML event source; holds the backend's handle.
pub(super) struct NvmlEvents {
    nvml: Arc<Nvml>,
}

impl NvmlEvents {
    pub(super) fn new(nvml: Arc<Nvml>) -> Self {
        Self { nvml }
    }
}

struct NvmlSubscription<'n> {
    nvml: &'n Nvml,
    set: Option<EventSet<'n>>,
    unregistered: Vec<String>,
}

impl EventSource for NvmlEvents {
    fn subscribe<'s>(
        &'s self,
        gpu_uuids: &[String],
    ) -> Result<Box<dyn EventSubscription + 's>, BackendError> {
        let nvml: &Nvml = &self.nvml;
        let set = nvml
            .create_event_set()
            .map_err(|e| super::wrapper_err("nvmlEventSetCreate", "event set", e))?;
        let wanted = EventTypes::from_bits_truncate(EVENT_XID | EVENT_DOUBLE_BIT_ECC);
        let mut unregistered = Vec::new();
        for uuid in gpu_uuids {
            let device = match nvml.device_by_uuid(uuid.as_str()) {
                Ok(d) => d,
                Err(e) => {
                    warn!(gpu = %uuid, error = %e, "no handle for health events");
                    unregistered.push(uuid.clone());
                    continue;
                }
            };
            let types = device
                .supported_event_types()
                .map_or(wanted, |s| s & wanted);
            let Ok(register) = nvml.lib().nvmlDeviceRegisterEvents.as_ref() else {
                warn!("NVML lacks nvmlDeviceRegisterEvents; only lost GPUs are detected");
                unregistered.push(uuid.clone());
                continue;
            };
            // SAFETY: both handles come from this `Nvml` and outlive the call.
            let code = unsafe { register(device.handle(), types.bits(), set.handle()) };
            if code != 0 {
                warn!(gpu = %uuid, code, "cannot register health events (too old a GPU or driver?)");
                unregistered.push(uuid.clone());
            }
        }
        Ok(Box::new(NvmlSubscription {
            nvml,
            set: Some(set),
            unregistered,
        }))
    }

    fn is_lost(&self, gpu_uuid: &str) -> bool {
        match self.nvml.device_by_uuid(gpu_uuid) {
            Ok(d) => matches!(d.uuid(), Err(NvmlError::GpuLost)),
            Err(_) => true,
        }
    }
}

impl EventSubscription for NvmlSubscription<'_> {
    fn wait(&mut self, timeout: Duration) -> EventWait {
        let Some(set) = self.set.as_ref() else {
            return EventWait::Failed(ERROR_FUNCTION_NOT_FOUND);
        };
        let Ok(wait) = self.nvml.lib().nvmlEventSetWait_v2.as_ref() else {
            return EventWait::Failed(ERROR_FUNCTION_NOT_FOUND);
        };
        let timeout_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        // SAFETY: `data` is a plain C struct NVML fills in; zeroed is a valid initial value.
        let mut data: nvmlEventData_t = unsafe { std::mem::zeroed() };
        // SAFETY: the set handle comes from this `Nvml` and lives while `set` is borrowed;
        // `data` is a valid, exclusively borrowed out-pointer.
        let code = unsafe { wait(set.handle(), &mut data, timeout_ms) };
        match code {
            0 => {
                // SAFETY: the handle comes from NVML's event data for this library instance.
                let device = unsafe { nvml_wrapper::Device::new(data.device, self.nvml) };
                EventWait::Event(RawEvent {
                    gpu_uuid: device.uuid().ok(),
                    event_type: data.eventType,
                    event_data: data.eventData,
                    gi: data.gpuInstanceId,
                    ci: data.computeInstanceId,
                })
            }
            ERROR_TIMEOUT => EventWait::Timeout,
            ERROR_GPU_IS_LOST => EventWait::GpuLost,
            c => EventWait::Failed(c),
        }
    }

    fn unregistered(&self) -> &[String] {
        &self.unregistered
    }
}

impl Drop for NvmlSubscription<'_> {
    fn drop(&mut self) {
        if let Some(set) = self.set.take()
            && let Err(e) = set.release_events()
        {
            debug!(error = %e, "releasing the event set");
        }
    }
}
