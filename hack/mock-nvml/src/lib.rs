//! A drop-in mock of `libnvidia-ml.so.1`.
//!
//! Built as a cdylib it exports the NVML C functions the driver calls (same symbol names
//! and struct layouts as the real library, via `nvml-wrapper-sys` types), so the real
//! NVML code path (nvml-wrapper over dlopen) runs without a GPU. A fixture (built-in node
//! profile or YAML file) says which GPUs exist; MIG state persists in a locked state file
//! shared between processes; test hooks inject errors, Xid events and lost GPUs. See
//! `README.md` for the environment variables.
//!
//! The rlib side offers the fixture tables, the state file and [`locate`] for tests.

pub mod driver_root;
pub mod fixtures;
pub mod hooks;
pub mod locate;
pub mod state;

mod ffi;

/// NVML return codes (`nvmlReturn_t`, NVML constants, docs/hardware-sources.md) and their messages.
pub mod rc {
    use std::ffi::CStr;

    /// NVML_SUCCESS.
    pub const SUCCESS: u32 = 0;
    /// NVML_ERROR_UNINITIALIZED.
    pub const UNINITIALIZED: u32 = 1;
    /// NVML_ERROR_INVALID_ARGUMENT.
    pub const INVALID_ARGUMENT: u32 = 2;
    /// NVML_ERROR_NOT_SUPPORTED.
    pub const NOT_SUPPORTED: u32 = 3;
    /// NVML_ERROR_NO_PERMISSION.
    pub const NO_PERMISSION: u32 = 4;
    /// NVML_ERROR_NOT_FOUND.
    pub const NOT_FOUND: u32 = 6;
    /// NVML_ERROR_INSUFFICIENT_SIZE.
    pub const INSUFFICIENT_SIZE: u32 = 7;
    /// NVML_ERROR_DRIVER_NOT_LOADED.
    pub const DRIVER_NOT_LOADED: u32 = 9;
    /// NVML_ERROR_TIMEOUT.
    pub const TIMEOUT: u32 = 10;
    /// NVML_ERROR_GPU_IS_LOST.
    pub const GPU_IS_LOST: u32 = 15;
    /// NVML_ERROR_IN_USE.
    pub const IN_USE: u32 = 19;
    /// NVML_ERROR_INSUFFICIENT_RESOURCES.
    pub const INSUFFICIENT_RESOURCES: u32 = 23;
    /// NVML_ERROR_ARGUMENT_VERSION_MISMATCH.
    pub const ARGUMENT_VERSION_MISMATCH: u32 = 25;
    /// NVML_ERROR_UNKNOWN.
    pub const UNKNOWN: u32 = 999;

    /// `nvmlErrorString` text for a code.
    pub fn message(code: u32) -> &'static CStr {
        match code {
            0 => c"Success",
            1 => c"Uninitialized",
            2 => c"Invalid Argument",
            3 => c"Not Supported",
            4 => c"Insufficient Permissions",
            5 => c"Already Initialized",
            6 => c"Not Found",
            7 => c"Insufficient Size",
            8 => c"Insufficient External Power",
            9 => c"Driver Not Loaded",
            10 => c"Timeout",
            11 => c"Interrupt request issue",
            12 => c"NVML Shared Library Not Found",
            13 => c"Function Not Found",
            14 => c"Corrupted infoROM",
            15 => c"GPU is lost",
            16 => c"GPU requires restart",
            17 => c"The operating system has blocked the request.",
            18 => c"RM has detected an NVML/RM version mismatch.",
            19 => c"In use by another client",
            20 => c"Insufficient Memory",
            21 => c"No data",
            22 => c"The requested vgpu operation is not available on target device, becasue ECC is enabled",
            23 => c"Insufficient resources for request",
            24 => c"Frequency not supported",
            25 => c"Argument version mismatch",
            26 => c"Deprecated",
            27 => c"Not Ready",
            28 => c"GPU not found",
            29 => c"Invalid state",
            30 => c"Reset type not supported",
            _ => c"Unknown Error",
        }
    }
}
