//! Safe wrappers over the raw NVML MIG functions that nvml-wrapper 0.13 does not wrap (or
//! wraps wrongly: its `possible_placements` never sets the vector length).
//!
//! Every function resolves its symbol through the `Result` field of `NvmlLib` (never the
//! panicking method of the same name), so a library that lacks a function yields
//! `NVML_ERROR_FUNCTION_NOT_FOUND` instead of a panic. Handles of GPU and compute instances
//! only ever come from NVML and carry the lifetime of the `Nvml` they belong to.

#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::mem;
use std::os::raw::c_uint;

use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, nvmlComputeInstance_t, nvmlComputeInstanceInfo_t,
    nvmlComputeInstanceProfileInfo_t, nvmlDevice_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t,
    nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_t, nvmlGpuInstanceProfileInfo_v2_t,
    nvmlReturn_t,
};

/// `NVML_SUCCESS`.
pub(super) const SUCCESS: u32 = 0;
/// `NVML_ERROR_INVALID_ARGUMENT`.
pub(crate) const ERROR_INVALID_ARGUMENT: u32 = 2;
/// `NVML_ERROR_NOT_SUPPORTED`.
pub(crate) const ERROR_NOT_SUPPORTED: u32 = 3;
/// `NVML_ERROR_NOT_FOUND`.
pub(crate) const ERROR_NOT_FOUND: u32 = 6;
/// `NVML_ERROR_INSUFFICIENT_SIZE`.
pub(crate) const ERROR_INSUFFICIENT_SIZE: u32 = 7;
/// `NVML_ERROR_FUNCTION_NOT_FOUND`.
pub(crate) const ERROR_FUNCTION_NOT_FOUND: u32 = 13;

/// `NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 2)`.
const GPU_INSTANCE_PROFILE_INFO_V2: c_uint =
    (mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as c_uint) | (2 << 24);

/// A raw NVML failure: the function and its return code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawError {
    /// NVML function name.
    pub call: &'static str,
    /// `nvmlReturn_t` value.
    pub code: u32,
}

impl RawError {
    /// True for the codes NVML uses for "no such thing" (the object is gone).
    pub(crate) fn is_gone(&self) -> bool {
        self.code == ERROR_NOT_FOUND || self.code == ERROR_INVALID_ARGUMENT
    }

    /// True for "this profile / feature does not exist here".
    pub(crate) fn is_unsupported(&self) -> bool {
        self.code == ERROR_NOT_SUPPORTED || self.code == ERROR_INVALID_ARGUMENT
    }
}

/// Result of a raw call.
pub(crate) type RawResult<T> = Result<T, RawError>;

fn check(call: &'static str, code: nvmlReturn_t) -> RawResult<()> {
    if code == SUCCESS {
        Ok(())
    } else {
        Err(RawError { call, code })
    }
}

/// Resolves a symbol field of `NvmlLib`, mapping a missing symbol to FUNCTION_NOT_FOUND.
macro_rules! sym {
    ($nvml:expr, $name:ident) => {
        match $nvml.lib().$name.as_ref() {
            Ok(f) => *f,
            Err(_) => {
                return Err(RawError {
                    call: stringify!($name),
                    code: ERROR_FUNCTION_NOT_FOUND,
                });
            }
        }
    };
}

/// True if the library exports `nvmlDeviceGetGpuInstanceProfileInfoV`.
pub(crate) fn has_profile_info_v(nvml: &Nvml) -> bool {
    nvml.lib().nvmlDeviceGetGpuInstanceProfileInfoV.is_ok()
}

fn raw_device(device: &Device<'_>) -> nvmlDevice_t {
    // SAFETY: the handle is only passed back to NVML functions of the same library while
    // `device` (and thus its `Nvml`) is borrowed; it is never dereferenced here.
    unsafe { device.handle() }
}

/// A GPU instance handle obtained from NVML, valid while its `Nvml` lives (NVML reports
/// NOT_FOUND/INVALID_ARGUMENT for a handle whose instance was destroyed).
#[derive(Debug, Clone, Copy)]
pub(crate) struct GpuInstance<'nvml> {
    raw: nvmlGpuInstance_t,
    _nvml: PhantomData<&'nvml Nvml>,
}

/// A compute instance handle obtained from NVML.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ComputeInstance<'nvml> {
    raw: nvmlComputeInstance_t,
    _nvml: PhantomData<&'nvml Nvml>,
}

/// What `nvmlGpuInstanceGetInfo` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GpuInstanceInfo {
    /// GPU instance id.
    pub id: u32,
    /// Profile id (`info.id` of the profile, e.g. 19).
    pub profile_id: u32,
    /// Placement in memory slices.
    pub start: u32,
    /// Memory slices.
    pub size: u32,
}

/// GPU-instance profile info, v1 layout (no name).
pub(crate) fn gpu_instance_profile_info(
    device: &Device<'_>,
    profile: u32,
) -> RawResult<nvmlGpuInstanceProfileInfo_t> {
    let f = sym!(device.nvml(), nvmlDeviceGetGpuInstanceProfileInfo);
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { mem::zeroed() };
    // SAFETY: valid device handle, `info` is a live, correctly sized out-parameter.
    let code = unsafe { f(raw_device(device), profile, &mut info) };
    check("nvmlDeviceGetGpuInstanceProfileInfo", code)?;
    Ok(info)
}

/// GPU-instance profile info, v2 layout (with `name`), through `...ProfileInfoV`.
pub(crate) fn gpu_instance_profile_info_v2(
    device: &Device<'_>,
    profile: u32,
) -> RawResult<nvmlGpuInstanceProfileInfo_v2_t> {
    let f = sym!(device.nvml(), nvmlDeviceGetGpuInstanceProfileInfoV);
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut info: nvmlGpuInstanceProfileInfo_v2_t = unsafe { mem::zeroed() };
    info.version = GPU_INSTANCE_PROFILE_INFO_V2;
    // SAFETY: valid device handle; `info` is a versioned out-parameter of the declared size.
    let code = unsafe { f(raw_device(device), profile, &mut info) };
    check("nvmlDeviceGetGpuInstanceProfileInfoV", code)?;
    Ok(info)
}

/// Decodes a fixed-size NUL-terminated C string field; `None` if empty or not UTF-8.
pub(crate) fn c_name(buf: &[std::os::raw::c_char]) -> Option<String> {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    let s = String::from_utf8(bytes).ok()?;
    (!s.is_empty()).then_some(s)
}

/// All placements of the profile with NVML id `profile_id` (`..._PossiblePlacements_v2`),
/// whether or not MIG is enabled.
pub(crate) fn possible_placements(
    device: &Device<'_>,
    profile_id: u32,
) -> RawResult<Vec<(u32, u32)>> {
    const CALL: &str = "nvmlDeviceGetGpuInstancePossiblePlacements_v2";
    let f = sym!(device.nvml(), nvmlDeviceGetGpuInstancePossiblePlacements_v2);
    let mut count: c_uint = 0;
    // SAFETY: a NULL placements array asks NVML for the count only (documented in nvml.h).
    let code = unsafe {
        f(
            raw_device(device),
            profile_id,
            std::ptr::null_mut(),
            &mut count,
        )
    };
    if code != SUCCESS && code != ERROR_INSUFFICIENT_SIZE {
        return Err(RawError { call: CALL, code });
    }
    if count == 0 {
        return Ok(Vec::new());
    }
    let mut buf = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
    let mut n = count;
    // SAFETY: `buf` holds `n` elements; NVML writes at most `n` and updates `n`.
    let code = unsafe { f(raw_device(device), profile_id, buf.as_mut_ptr(), &mut n) };
    check(CALL, code)?;
    buf.truncate(n.min(count) as usize);
    Ok(buf.into_iter().map(|p| (p.start, p.size)).collect())
}

/// The GPU instances of profile `profile_id` that exist now; `max` bounds the buffer
/// (the profile's instance count).
pub(super) fn gpu_instances<'n>(
    device: &Device<'n>,
    profile_id: u32,
    max: u32,
) -> RawResult<Vec<GpuInstance<'n>>> {
    let f = sym!(device.nvml(), nvmlDeviceGetGpuInstances);
    let cap = max.max(1);
    let mut buf: Vec<nvmlGpuInstance_t> = vec![std::ptr::null_mut(); cap as usize];
    let mut n: c_uint = cap;
    // SAFETY: `buf` has room for `n` handles; NVML writes at most that many and sets `n`.
    let code = unsafe { f(raw_device(device), profile_id, buf.as_mut_ptr(), &mut n) };
    check("nvmlDeviceGetGpuInstances", code)?;
    buf.truncate(n.min(cap) as usize);
    Ok(buf
        .into_iter()
        .map(|raw| GpuInstance {
            raw,
            _nvml: PhantomData,
        })
        .collect())
}

/// The GPU instance with id `gi_id`.
pub(crate) fn gpu_instance_by_id<'n>(
    device: &Device<'n>,
    gi_id: u32,
) -> RawResult<GpuInstance<'n>> {
    let f = sym!(device.nvml(), nvmlDeviceGetGpuInstanceById);
    let mut raw: nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: valid device handle and a live out-parameter.
    let code = unsafe { f(raw_device(device), gi_id, &mut raw) };
    check("nvmlDeviceGetGpuInstanceById", code)?;
    Ok(GpuInstance {
        raw,
        _nvml: PhantomData,
    })
}

/// Creates a GPU instance of `profile_id` at exactly `start`/`size`.
pub(crate) fn create_gpu_instance_with_placement<'n>(
    device: &Device<'n>,
    profile_id: u32,
    start: u32,
    size: u32,
) -> RawResult<GpuInstance<'n>> {
    let f = sym!(device.nvml(), nvmlDeviceCreateGpuInstanceWithPlacement);
    let placement = nvmlGpuInstancePlacement_t { start, size };
    let mut raw: nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: valid device handle; `placement` is read-only input, `raw` a live out-parameter.
    let code = unsafe { f(raw_device(device), profile_id, &placement, &mut raw) };
    check("nvmlDeviceCreateGpuInstanceWithPlacement", code)?;
    Ok(GpuInstance {
        raw,
        _nvml: PhantomData,
    })
}

impl<'n> GpuInstance<'n> {
    /// `nvmlGpuInstanceGetInfo`.
    pub(super) fn info(&self, nvml: &'n Nvml) -> RawResult<GpuInstanceInfo> {
        let f = sym!(nvml, nvmlGpuInstanceGetInfo);
        // SAFETY: all-zero is a valid value of this plain C struct (null device pointer).
        let mut info: nvmlGpuInstanceInfo_t = unsafe { mem::zeroed() };
        // SAFETY: the handle came from NVML; `info` is a live out-parameter.
        let code = unsafe { f(self.raw, &mut info) };
        check("nvmlGpuInstanceGetInfo", code)?;
        Ok(GpuInstanceInfo {
            id: info.id,
            profile_id: info.profileId,
            start: info.placement.start,
            size: info.placement.size,
        })
    }

    /// `nvmlGpuInstanceDestroy`.
    pub(super) fn destroy(self, nvml: &'n Nvml) -> RawResult<()> {
        let f = sym!(nvml, nvmlGpuInstanceDestroy);
        // SAFETY: the handle came from NVML; NVML validates it and reports stale handles.
        let code = unsafe { f(self.raw) };
        check("nvmlGpuInstanceDestroy", code)
    }

    /// Compute-instance profile info for the `NVML_COMPUTE_INSTANCE_PROFILE_*` value
    /// `profile` (shared engines).
    pub(crate) fn compute_instance_profile_info(
        &self,
        nvml: &'n Nvml,
        profile: u32,
    ) -> RawResult<nvmlComputeInstanceProfileInfo_t> {
        let f = sym!(nvml, nvmlGpuInstanceGetComputeInstanceProfileInfo);
        // SAFETY: all-zero is a valid value of this plain C struct.
        let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { mem::zeroed() };
        // SAFETY: the handle came from NVML; `info` is a live out-parameter.
        let code = unsafe {
            f(
                self.raw,
                profile,
                NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                &mut info,
            )
        };
        check("nvmlGpuInstanceGetComputeInstanceProfileInfo", code)?;
        Ok(info)
    }

    /// Creates a compute instance of CI profile id `ci_profile_id` in this GPU instance.
    pub(crate) fn create_compute_instance(
        &self,
        nvml: &'n Nvml,
        ci_profile_id: u32,
    ) -> RawResult<ComputeInstance<'n>> {
        let f = sym!(nvml, nvmlGpuInstanceCreateComputeInstance);
        let mut raw: nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: the handle came from NVML; `raw` is a live out-parameter.
        let code = unsafe { f(self.raw, ci_profile_id, &mut raw) };
        check("nvmlGpuInstanceCreateComputeInstance", code)?;
        Ok(ComputeInstance {
            raw,
            _nvml: PhantomData,
        })
    }

    /// The compute instance with id `ci_id`.
    pub(crate) fn compute_instance_by_id(
        &self,
        nvml: &'n Nvml,
        ci_id: u32,
    ) -> RawResult<ComputeInstance<'n>> {
        let f = sym!(nvml, nvmlGpuInstanceGetComputeInstanceById);
        let mut raw: nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: the handle came from NVML; `raw` is a live out-parameter.
        let code = unsafe { f(self.raw, ci_id, &mut raw) };
        check("nvmlGpuInstanceGetComputeInstanceById", code)?;
        Ok(ComputeInstance {
            raw,
            _nvml: PhantomData,
        })
    }
}

impl<'n> ComputeInstance<'n> {
    /// The compute instance id (`nvmlComputeInstanceGetInfo_v2`).
    pub(super) fn id(&self, nvml: &'n Nvml) -> RawResult<u32> {
        let f = sym!(nvml, nvmlComputeInstanceGetInfo_v2);
        let call = "nvmlComputeInstanceGetInfo_v2";
        // SAFETY: all-zero is a valid value of this plain C struct (null pointers).
        let mut info: nvmlComputeInstanceInfo_t = unsafe { mem::zeroed() };
        // SAFETY: the handle came from NVML; `info` is a live out-parameter.
        let code = unsafe { f(self.raw, &mut info) };
        check(call, code)?;
        Ok(info.id)
    }

    /// `nvmlComputeInstanceDestroy`.
    pub(super) fn destroy(self, nvml: &'n Nvml) -> RawResult<()> {
        let f = sym!(nvml, nvmlComputeInstanceDestroy);
        // SAFETY: the handle came from NVML; NVML validates it and reports stale handles.
        let code = unsafe { f(self.raw) };
        check("nvmlComputeInstanceDestroy", code)
    }
}

/// GPU-instance id of a MIG device handle.
pub(crate) fn mig_gpu_instance_id(mig: &Device<'_>) -> RawResult<u32> {
    let f = sym!(mig.nvml(), nvmlDeviceGetGpuInstanceId);
    let mut id: c_uint = 0;
    // SAFETY: valid (MIG) device handle and a live out-parameter.
    let code = unsafe { f(raw_device(mig), &mut id) };
    check("nvmlDeviceGetGpuInstanceId", code)?;
    Ok(id)
}

/// Compute-instance id of a MIG device handle.
pub(crate) fn mig_compute_instance_id(mig: &Device<'_>) -> RawResult<u32> {
    let f = sym!(mig.nvml(), nvmlDeviceGetComputeInstanceId);
    let mut id: c_uint = 0;
    // SAFETY: valid (MIG) device handle and a live out-parameter.
    let code = unsafe { f(raw_device(mig), &mut id) };
    check("nvmlDeviceGetComputeInstanceId", code)?;
    Ok(id)
}

/// Human-readable text for an NVML return code, without calling into the library
/// (nvml-wrapper has no text for the codes newer than its enum, e.g. 23).
pub(crate) fn error_string(code: u32) -> String {
    let known = match code {
        19 => "in use by another client",
        20 => "insufficient memory",
        21 => "no data",
        23 => "insufficient resources for request",
        24 => "frequency not supported",
        25 => "argument version mismatch",
        26 => "deprecated",
        27 => "not ready",
        28 => "GPU not found",
        29 => "invalid state",
        _ => return nvml_wrapper::error::NvmlError::from(code).to_string(),
    };
    known.to_owned()
}
