//! The exported NVML C functions.
//!
//! Handles are addresses of small leaked allocations, one per object (GPU index, GI or CI
//! creation, MIG device, event set), kept in a process-wide registry; the registry maps an
//! address back to the object, so the library never dereferences a handle it did not hand
//! out. Every query re-reads the state file, so changes made by other processes are seen.
//! No panic crosses the FFI boundary (`entry` catches them and returns NVML_ERROR_UNKNOWN).
#![allow(unsafe_code)]
#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]

use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong};
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nvml_wrapper_sys::bindings::{
    nvmlBrandType_t, nvmlComputeInstance_t, nvmlComputeInstanceInfo_t,
    nvmlComputeInstancePlacement_t, nvmlComputeInstanceProfileInfo_t,
    nvmlComputeInstanceProfileInfo_v2_t, nvmlComputeInstanceProfileInfo_v3_t, nvmlComputeMode_t,
    nvmlDevice_t, nvmlDeviceArchitecture_t, nvmlDeviceAttributes_t, nvmlEnableState_t,
    nvmlEventData_t, nvmlEventSet_t, nvmlGpmMetric_t, nvmlGpmMetricsGet_t, nvmlGpmSample_t,
    nvmlGpmSupport_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t,
    nvmlGpuInstanceProfileInfo_t, nvmlGpuInstanceProfileInfo_v2_t, nvmlGpuInstanceProfileInfo_v3_t,
    nvmlMemory_t, nvmlMemory_v2_t, nvmlPciInfo_t, nvmlProcessInfo_t,
    nvmlProcessUtilizationSample_t, nvmlReturn_t, nvmlUtilization_t,
};

use crate::fixtures::{self, CiProfile, GiProfile, GpuSpec, NodeConfig};
use crate::hooks::{self, FailRule, Hooks, Process};
use crate::rc;
use crate::state::{self, CiState, GiState, GpuState, State, StateStore};

type R<T> = Result<T, nvmlReturn_t>;

const MIB: u64 = 1024 * 1024;
/// Maximum MIG devices per GPU (7 on every modelled part).
const MAX_MIG_DEVICES: u32 = 7;
/// Event types the mock reports as supported: single/double-bit ECC, PState, Xid, clock.
const SUPPORTED_EVENTS: u64 = 0x1 | 0x2 | 0x4 | 0x8 | 0x10;
const EVENT_XID: u64 = 0x8;

const fn struct_version(size: usize, ver: u32) -> u32 {
    size as u32 | (ver << 24)
}
const MEMORY_V2: u32 = struct_version(size_of::<nvmlMemory_v2_t>(), 2);
const GIP_V2: u32 = struct_version(size_of::<nvmlGpuInstanceProfileInfo_v2_t>(), 2);
const GIP_V3: u32 = struct_version(size_of::<nvmlGpuInstanceProfileInfo_v3_t>(), 3);
const CIP_V2: u32 = struct_version(size_of::<nvmlComputeInstanceProfileInfo_v2_t>(), 2);
const CIP_V3: u32 = struct_version(size_of::<nvmlComputeInstanceProfileInfo_v3_t>(), 3);
// Layout checks against nvml.h sizes (NVML constants, docs/hardware-sources.md).
const _: () = assert!(MEMORY_V2 == 0x0200_0028);
const _: () = assert!(GIP_V2 == 0x0200_0098);
const _: () = assert!(GIP_V3 == 0x0300_0098);
const _: () = assert!(size_of::<nvmlGpuInstanceProfileInfo_t>() == 48);
const _: () = assert!(size_of::<nvmlDeviceAttributes_t>() == 40);
const _: () = assert!(size_of::<nvmlPciInfo_t>() == 68);
const _: () = assert!(size_of::<nvmlEventData_t>() == 32);

// ---------------------------------------------------------------------------------------
// Runtime (what nvmlInit captured from the environment)

struct Runtime {
    cfg: NodeConfig,
    store: StateStore,
    env_fails: Vec<FailRule>,
    control: Option<PathBuf>,
    events: Option<PathBuf>,
}

fn env_nonempty(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl Runtime {
    fn from_env() -> Result<Self, String> {
        let mig_override = match env_nonempty("MOCK_NVML_MIG").as_deref() {
            None => None,
            Some("on" | "1" | "true" | "enabled") => Some(true),
            Some("off" | "0" | "false" | "disabled") => Some(false),
            Some(v) => return Err(format!("MOCK_NVML_MIG={v:?}: expected on or off")),
        };
        let cfg = if let Some(path) = env_nonempty("MOCK_NVML_CONFIG") {
            let path = PathBuf::from(path);
            let default_name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "config".to_string());
            fixtures::ConfigFile::load(&path)
                .and_then(|c| c.resolve(&default_name, mig_override))
                .map_err(|e| e.to_string())?
        } else {
            let name = env_nonempty("MOCK_NVML_PROFILE")
                .unwrap_or_else(|| fixtures::DEFAULT_PROFILE.to_string());
            fixtures::node_profile(&name, mig_override).map_err(|e| e.to_string())?
        };
        let path = env_nonempty("MOCK_NVML_STATE")
            .map(PathBuf::from)
            .unwrap_or_else(|| state::default_state_path(&cfg.name));
        let store = StateStore::new(path, &cfg, state::current_boot_id());
        Ok(Self {
            env_fails: hooks::parse_fail_list(&env_nonempty("MOCK_NVML_FAIL").unwrap_or_default()),
            control: env_nonempty("MOCK_NVML_CONTROL").map(PathBuf::from),
            events: env_nonempty("MOCK_NVML_EVENTS").map(PathBuf::from),
            cfg,
            store,
        })
    }
}

struct Global {
    refcount: u32,
    runtime: Option<Arc<Runtime>>,
}

static GLOBAL: Mutex<Global> = Mutex::new(Global {
    refcount: 0,
    runtime: None,
});

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

// ---------------------------------------------------------------------------------------
// Handle registry

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Obj {
    Gpu(u32),
    Mig {
        gpu: u32,
        gi: u32,
        ci: u32,
        nonce: u64,
    },
    Gi {
        gpu: u32,
        gi: u32,
        nonce: u64,
    },
    Ci {
        gpu: u32,
        gi: u32,
        ci: u32,
        nonce: u64,
    },
    EventSet(u64),
}

#[derive(Default)]
struct Registry {
    by_ptr: HashMap<usize, Obj>,
    by_obj: HashMap<Obj, usize>,
    next_set: u64,
}

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(|| Mutex::new(Registry::default()));

fn handle_of(obj: Obj) -> usize {
    let mut reg = lock(&REGISTRY);
    if let Some(p) = reg.by_obj.get(&obj) {
        return *p;
    }
    // Leaked on purpose: handles stay valid addresses for the life of the process.
    let p = Box::into_raw(Box::new(0u64)) as usize;
    reg.by_ptr.insert(p, obj);
    reg.by_obj.insert(obj, p);
    p
}

fn resolve(p: usize) -> Option<Obj> {
    lock(&REGISTRY).by_ptr.get(&p).copied()
}

// ---------------------------------------------------------------------------------------
// Event sets

#[derive(Default)]
struct EventSet {
    registered: HashMap<u32, u64>,
    delivered: HashSet<String>,
}

static EVENT_SETS: LazyLock<Mutex<HashMap<u64, EventSet>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

// ---------------------------------------------------------------------------------------
// Pointer helpers. All raw pointers come from C callers; the NVML API contract is that
// they are null or valid for the access, and null is rejected here.

fn put<T>(p: *mut T, v: T) -> R<()> {
    if p.is_null() {
        return Err(rc::INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and by the NVML contract valid and aligned for a write of T.
    unsafe { p.write(v) };
    Ok(())
}

fn put_str(p: *mut c_char, len: c_uint, s: &str) -> R<()> {
    if p.is_null() {
        return Err(rc::INVALID_ARGUMENT);
    }
    let b = s.as_bytes();
    if b.len() + 1 > len as usize {
        return Err(rc::INSUFFICIENT_SIZE);
    }
    // SAFETY: non-null and, by the NVML contract, valid for `len` bytes; we write
    // b.len() + 1 <= len bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(b.as_ptr(), p.cast::<u8>(), b.len());
        p.add(b.len()).write(0);
    }
    Ok(())
}

fn get_str(p: *const c_char) -> R<String> {
    if p.is_null() {
        return Err(rc::INVALID_ARGUMENT);
    }
    // SAFETY: non-null and, by the NVML contract, a NUL-terminated string.
    let s = unsafe { CStr::from_ptr(p) };
    Ok(s.to_string_lossy().into_owned())
}

fn read_u32(p: *const u32) -> R<u32> {
    if p.is_null() {
        return Err(rc::INVALID_ARGUMENT);
    }
    // SAFETY: non-null and, by the NVML contract, valid for reads.
    Ok(unsafe { p.read() })
}

fn name_buf<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (o, b) in out.iter_mut().zip(s.bytes().take(N - 1)) {
        *o = b as c_char;
    }
    out
}

/// Runs one entry point; a panic becomes `NVML_ERROR_UNKNOWN`, as a C library would not
/// unwind into its caller (in a `panic = "abort"` build, the workspace's release profile,
/// it ends the process instead).
fn entry(f: impl FnOnce() -> R<()>) -> nvmlReturn_t {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => rc::SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => rc::UNKNOWN,
    }
}

// ---------------------------------------------------------------------------------------
// Per-call context

#[derive(Debug, Clone, Copy)]
enum Dev {
    Gpu(u32),
    Mig {
        gpu: u32,
        gi: u32,
        ci: u32,
        nonce: u64,
    },
}

impl Dev {
    fn gpu(self) -> u32 {
        match self {
            Dev::Gpu(g) | Dev::Mig { gpu: g, .. } => g,
        }
    }
}

struct Call {
    name: &'static str,
    rt: Arc<Runtime>,
    hooks: Arc<Hooks>,
}

impl Call {
    fn begin(name: &'static str) -> R<Self> {
        let rt = lock(&GLOBAL).runtime.clone().ok_or(rc::UNINITIALIZED)?;
        let hooks = rt
            .control
            .as_deref()
            .map(|p| hooks::read(p, false))
            .unwrap_or_default();
        if let Some(d) = hooks.delay_of(name) {
            std::thread::sleep(d);
        }
        let call = Self { name, rt, hooks };
        let unscoped = call.rules().filter(|r| r.device.is_none());
        if let Some(code) = hooks::fail_code(unscoped, name, None) {
            return Err(code);
        }
        Ok(call)
    }

    fn rules(&self) -> impl Iterator<Item = &FailRule> {
        self.rt.env_fails.iter().chain(self.hooks.fails.iter())
    }

    fn cfg(&self) -> &NodeConfig {
        &self.rt.cfg
    }

    fn spec(&self, gpu: u32) -> R<&GpuSpec> {
        self.rt
            .cfg
            .gpus
            .get(gpu as usize)
            .ok_or(rc::INVALID_ARGUMENT)
    }

    /// Applies `@index` fail rules and lost GPUs for a call about GPU `gpu`.
    fn about(&self, gpu: u32) -> R<()> {
        let scoped = self.rules().filter(|r| r.device.is_some());
        if let Some(code) = hooks::fail_code(scoped, self.name, Some(gpu)) {
            return Err(code);
        }
        if self.hooks.lost.contains(&gpu) {
            return Err(rc::GPU_IS_LOST);
        }
        Ok(())
    }

    fn state(&self) -> R<Arc<State>> {
        self.rt.store.read().map_err(|e| {
            eprintln!("mock-nvml: {e}");
            rc::UNKNOWN
        })
    }

    fn modify<T>(&self, f: impl FnOnce(&mut State) -> R<T>) -> R<T> {
        self.rt.store.modify(f).map_err(|e| {
            eprintln!("mock-nvml: {e}");
            rc::UNKNOWN
        })?
    }

    fn dev(&self, h: nvmlDevice_t) -> R<Dev> {
        let d = match resolve(h as usize) {
            Some(Obj::Gpu(g)) => Dev::Gpu(g),
            Some(Obj::Mig { gpu, gi, ci, nonce }) => Dev::Mig { gpu, gi, ci, nonce },
            _ => return Err(rc::INVALID_ARGUMENT),
        };
        self.spec(d.gpu())?;
        self.about(d.gpu())?;
        Ok(d)
    }

    /// A full-GPU handle (MIG device handles are rejected with `mig_code`).
    fn gpu(&self, h: nvmlDevice_t, mig_code: nvmlReturn_t) -> R<u32> {
        match self.dev(h)? {
            Dev::Gpu(g) => Ok(g),
            Dev::Mig { .. } => Err(mig_code),
        }
    }

    fn gi(&self, h: nvmlGpuInstance_t) -> R<(u32, u32, u64)> {
        match resolve(h as usize) {
            Some(Obj::Gi { gpu, gi, nonce }) => {
                self.spec(gpu)?;
                self.about(gpu)?;
                Ok((gpu, gi, nonce))
            }
            _ => Err(rc::INVALID_ARGUMENT),
        }
    }

    fn ci(&self, h: nvmlComputeInstance_t) -> R<(u32, u32, u32, u64)> {
        match resolve(h as usize) {
            Some(Obj::Ci { gpu, gi, ci, nonce }) => {
                self.spec(gpu)?;
                self.about(gpu)?;
                Ok((gpu, gi, ci, nonce))
            }
            _ => Err(rc::INVALID_ARGUMENT),
        }
    }
}

fn gpu_state(st: &State, gpu: u32) -> R<&GpuState> {
    st.gpus.get(gpu as usize).ok_or(rc::INVALID_ARGUMENT)
}

fn gpu_state_mut(st: &mut State, gpu: u32) -> R<&mut GpuState> {
    st.gpus.get_mut(gpu as usize).ok_or(rc::INVALID_ARGUMENT)
}

fn find_gi(gs: &GpuState, gi: u32, nonce: u64) -> R<&GiState> {
    gs.gpu_instances
        .iter()
        .find(|g| g.id == gi && g.nonce == nonce)
        .ok_or(rc::INVALID_ARGUMENT)
}

fn find_mig(gs: &GpuState, gi: u32, ci: u32, nonce: u64) -> R<(&GiState, &CiState)> {
    let g = gs
        .gpu_instances
        .iter()
        .find(|g| g.id == gi)
        .ok_or(rc::INVALID_ARGUMENT)?;
    let c = g
        .compute_instances
        .iter()
        .find(|c| c.id == ci && c.nonce == nonce)
        .ok_or(rc::INVALID_ARGUMENT)?;
    Ok((g, c))
}

fn gip(spec: &GpuSpec, id: u32) -> R<&'static GiProfile> {
    spec.product.profile_by_id(id).ok_or(rc::UNKNOWN)
}

fn mig_handle(gpu: u32, gi: &GiState, ci: &CiState) -> nvmlDevice_t {
    handle_of(Obj::Mig {
        gpu,
        gi: gi.id,
        ci: ci.id,
        nonce: ci.nonce,
    }) as nvmlDevice_t
}

fn gi_handle(gpu: u32, gi: &GiState) -> nvmlGpuInstance_t {
    handle_of(Obj::Gi {
        gpu,
        gi: gi.id,
        nonce: gi.nonce,
    }) as nvmlGpuInstance_t
}

fn ci_handle(gpu: u32, gi: &GiState, ci: &CiState) -> nvmlComputeInstance_t {
    handle_of(Obj::Ci {
        gpu,
        gi: gi.id,
        ci: ci.id,
        nonce: ci.nonce,
    }) as nvmlComputeInstance_t
}

fn gpu_handle(gpu: u32) -> nvmlDevice_t {
    handle_of(Obj::Gpu(gpu)) as nvmlDevice_t
}

// ---------------------------------------------------------------------------------------
// Init / shutdown / system

fn do_init(name: &'static str) -> nvmlReturn_t {
    entry(|| {
        if env_nonempty("MOCK_NVML_DRIVER_MISSING").is_some_and(|v| v != "0") {
            return Err(rc::DRIVER_NOT_LOADED);
        }
        let env_rules = hooks::parse_fail_list(&env_nonempty("MOCK_NVML_FAIL").unwrap_or_default());
        let ctl = env_nonempty("MOCK_NVML_CONTROL")
            .map(|p| hooks::read(std::path::Path::new(&p), false))
            .unwrap_or_default();
        if let Some(code) = hooks::fail_code(env_rules.iter().chain(&ctl.fails), name, None) {
            return Err(code);
        }
        let mut g = lock(&GLOBAL);
        if g.refcount == 0 || g.runtime.is_none() {
            let rt = Runtime::from_env().map_err(|e| {
                eprintln!("mock-nvml: {e}");
                rc::UNKNOWN
            })?;
            g.runtime = Some(Arc::new(rt));
        }
        g.refcount += 1;
        Ok(())
    })
}

/// `nvmlInit_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    do_init("nvmlInit_v2")
}

/// `nvmlInit` (v1).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit() -> nvmlReturn_t {
    do_init("nvmlInit")
}

/// `nvmlInitWithFlags`; flags are accepted and ignored.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    do_init("nvmlInitWithFlags")
}

/// `nvmlShutdown`: drops one init reference. Handles stay valid addresses.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    entry(|| {
        let _call = Call::begin("nvmlShutdown")?;
        let mut g = lock(&GLOBAL);
        if g.refcount == 0 {
            return Err(rc::UNINITIALIZED);
        }
        g.refcount -= 1;
        if g.refcount == 0 {
            g.runtime = None;
        }
        Ok(())
    })
}

/// `nvmlErrorString`: a static string for every return code.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    rc::message(result).as_ptr()
}

/// `nvmlSystemGetDriverVersion`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlSystemGetDriverVersion")?;
        put_str(version, length, &c.cfg().driver_version)
    })
}

/// `nvmlSystemGetNVMLVersion`: `<CUDA major>.<driver version>`, e.g. `12.570.148.08`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlSystemGetNVMLVersion")?;
        let v = format!(
            "{}.{}",
            c.cfg().cuda_driver_version / 1000,
            c.cfg().driver_version
        );
        put_str(version, length, &v)
    })
}

fn cuda_version(name: &'static str, out: *mut c_int) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin(name)?;
        put(out, c.cfg().cuda_driver_version)
    })
}

/// `nvmlSystemGetCudaDriverVersion`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(v: *mut c_int) -> nvmlReturn_t {
    cuda_version("nvmlSystemGetCudaDriverVersion", v)
}

/// `nvmlSystemGetCudaDriverVersion_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(v: *mut c_int) -> nvmlReturn_t {
    cuda_version("nvmlSystemGetCudaDriverVersion_v2", v)
}

// ---------------------------------------------------------------------------------------
// Device enumeration and identity

fn device_count(name: &'static str, out: *mut c_uint) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin(name)?;
        put(out, c.cfg().gpus.len() as c_uint)
    })
}

/// `nvmlDeviceGetCount_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    device_count("nvmlDeviceGetCount_v2", count)
}

/// `nvmlDeviceGetCount` (v1).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount(count: *mut c_uint) -> nvmlReturn_t {
    device_count("nvmlDeviceGetCount", count)
}

fn handle_by_index(name: &'static str, index: c_uint, out: *mut nvmlDevice_t) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin(name)?;
        c.spec(index)?;
        c.about(index)?;
        put(out, gpu_handle(index))
    })
}

/// `nvmlDeviceGetHandleByIndex_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    handle_by_index("nvmlDeviceGetHandleByIndex_v2", index, device)
}

/// `nvmlDeviceGetHandleByIndex` (v1).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    handle_by_index("nvmlDeviceGetHandleByIndex", index, device)
}

/// `nvmlDeviceGetHandleByUUID`: `GPU-...` or `MIG-...` UUIDs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetHandleByUUID")?;
        let u = get_str(uuid)?;
        if device.is_null() {
            return Err(rc::INVALID_ARGUMENT);
        }
        if let Some(g) = c.cfg().gpus.iter().find(|g| g.uuid == u) {
            c.about(g.index)?;
            return put(device, gpu_handle(g.index));
        }
        if u.starts_with("MIG-") {
            let st = c.state()?;
            for (i, gs) in st.gpus.iter().enumerate() {
                for (gi, ci) in state::mig_devices(gs) {
                    if ci.uuid == u {
                        c.about(i as u32)?;
                        return put(device, mig_handle(i as u32, gi, ci));
                    }
                }
            }
        }
        Err(rc::NOT_FOUND)
    })
}

fn handle_by_bus(name: &'static str, bus: *const c_char, out: *mut nvmlDevice_t) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin(name)?;
        let s = get_str(bus)?;
        if out.is_null() {
            return Err(rc::INVALID_ARGUMENT);
        }
        let want = fixtures::normalize_bus_id(&s).ok_or(rc::NOT_FOUND)?;
        let g = c
            .cfg()
            .gpus
            .iter()
            .find(|g| g.bus_id() == want)
            .ok_or(rc::NOT_FOUND)?;
        c.about(g.index)?;
        put(out, gpu_handle(g.index))
    })
}

/// `nvmlDeviceGetHandleByPciBusId_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    bus: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    handle_by_bus("nvmlDeviceGetHandleByPciBusId_v2", bus, device)
}

/// `nvmlDeviceGetHandleByPciBusId` (v1).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId(
    bus: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    handle_by_bus("nvmlDeviceGetHandleByPciBusId", bus, device)
}

/// `nvmlDeviceGetHandleBySerial`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleBySerial(
    serial: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetHandleBySerial")?;
        let s = get_str(serial)?;
        if device.is_null() {
            return Err(rc::INVALID_ARGUMENT);
        }
        let g = c
            .cfg()
            .gpus
            .iter()
            .find(|g| g.serial == s)
            .ok_or(rc::NOT_FOUND)?;
        c.about(g.index)?;
        put(device, gpu_handle(g.index))
    })
}

/// `nvmlDeviceGetIndex` (NOT_SUPPORTED on MIG device handles).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetIndex")?;
        let g = c.gpu(device, rc::NOT_SUPPORTED)?;
        put(index, g)
    })
}

/// `nvmlDeviceGetName`; MIG handles: `<GPU name> MIG <profile>`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetName")?;
        match c.dev(device)? {
            Dev::Gpu(g) => put_str(name, length, &c.spec(g)?.name),
            Dev::Mig { gpu, gi, ci, nonce } => {
                let st = c.state()?;
                let (g, _) = find_mig(gpu_state(&st, gpu)?, gi, ci, nonce)?;
                let spec = c.spec(gpu)?;
                let p = gip(spec, g.profile_id)?;
                put_str(name, length, &format!("{} MIG {}", spec.name, p.name))
            }
        }
    })
}

/// `nvmlDeviceGetUUID`: `GPU-...` or, for MIG device handles, `MIG-...`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetUUID")?;
        match c.dev(device)? {
            Dev::Gpu(g) => put_str(uuid, length, &c.spec(g)?.uuid),
            Dev::Mig { gpu, gi, ci, nonce } => {
                let st = c.state()?;
                let (_, ci) = find_mig(gpu_state(&st, gpu)?, gi, ci, nonce)?;
                put_str(uuid, length, &ci.uuid)
            }
        }
    })
}

/// `nvmlDeviceGetSerial` (NOT_SUPPORTED on MIG device handles).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSerial(
    device: nvmlDevice_t,
    serial: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetSerial")?;
        let g = c.gpu(device, rc::NOT_SUPPORTED)?;
        put_str(serial, length, &c.spec(g)?.serial)
    })
}

/// `nvmlDeviceGetMinorNumber` (NOT_SUPPORTED on MIG device handles).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minor: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetMinorNumber")?;
        let g = c.gpu(device, rc::NOT_SUPPORTED)?;
        put(minor, c.spec(g)?.minor)
    })
}

fn pci_info(name: &'static str, device: nvmlDevice_t, pci: *mut nvmlPciInfo_t) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin(name)?;
        let d = c.dev(device)?;
        let s = c.spec(d.gpu())?;
        put(
            pci,
            nvmlPciInfo_t {
                busIdLegacy: name_buf(&s.bus_id_legacy()),
                domain: s.pci.0,
                bus: s.pci.1,
                device: s.pci.2,
                pciDeviceId: s.product.pci_device_id,
                pciSubSystemId: s.product.pci_subsystem_id,
                busId: name_buf(&s.bus_id()),
            },
        )
    })
}

/// `nvmlDeviceGetPciInfo_v3` (MIG handles report the parent's PCI info).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    pci_info("nvmlDeviceGetPciInfo_v3", device, pci)
}

/// `nvmlDeviceGetPciInfo_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v2(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    pci_info("nvmlDeviceGetPciInfo_v2", device, pci)
}

/// `nvmlDeviceGetPciInfo` (v1).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    pci_info("nvmlDeviceGetPciInfo", device, pci)
}

/// (total, reserved) bytes of a device.
fn memory_of(c: &Call, d: Dev) -> R<(u64, u64)> {
    match d {
        Dev::Gpu(g) => {
            let s = c.spec(g)?;
            Ok((s.memory_mib * MIB, s.product.reserved_mib * MIB))
        }
        Dev::Mig { gpu, gi, ci, nonce } => {
            let st = c.state()?;
            let (g, _) = find_mig(gpu_state(&st, gpu)?, gi, ci, nonce)?;
            Ok((gip(c.spec(gpu)?, g.profile_id)?.memory_mib * MIB, 0))
        }
    }
}

/// Scripted memory in use of a device, bytes (control-file `memory`/`process` lines),
/// at most `limit`.
fn scripted_used(c: &Call, d: Dev, limit: u64) -> u64 {
    let mib = match d {
        Dev::Gpu(g) => c.hooks.usage.memory_mib(g, None),
        Dev::Mig { gpu, gi, ci, .. } => c.hooks.usage.memory_mib(gpu, Some((gi, ci))),
    };
    (mib * MIB).min(limit)
}

/// `nvmlDeviceGetMemoryInfo` (v1: used = reserved + the scripted use).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetMemoryInfo")?;
        let d = c.dev(device)?;
        let (total, reserved) = memory_of(&c, d)?;
        let used = reserved + scripted_used(&c, d, total - reserved);
        put(
            memory,
            nvmlMemory_t {
                total,
                free: total - used,
                used,
            },
        )
    })
}

/// `nvmlDeviceGetMemoryInfo_v2` (checks `version` = nvmlMemory_v2; `used` is the scripted
/// use, `reserved` apart).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetMemoryInfo_v2")?;
        let d = c.dev(device)?;
        if read_u32(memory.cast::<u32>())? != MEMORY_V2 {
            return Err(rc::ARGUMENT_VERSION_MISMATCH);
        }
        let (total, reserved) = memory_of(&c, d)?;
        let used = scripted_used(&c, d, total - reserved);
        put(
            memory,
            nvmlMemory_v2_t {
                version: MEMORY_V2,
                total,
                reserved,
                free: total - reserved - used,
                used,
            },
        )
    })
}

/// `nvmlDeviceGetBrand`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBrand(
    device: nvmlDevice_t,
    brand: *mut nvmlBrandType_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetBrand")?;
        let d = c.dev(device)?;
        put(brand, c.spec(d.gpu())?.product.brand)
    })
}

/// `nvmlDeviceGetArchitecture`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    device: nvmlDevice_t,
    arch: *mut nvmlDeviceArchitecture_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetArchitecture")?;
        let d = c.dev(device)?;
        put(arch, c.spec(d.gpu())?.product.architecture)
    })
}

/// `nvmlDeviceGetCudaComputeCapability`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetCudaComputeCapability")?;
        let d = c.dev(device)?;
        let (a, b) = c.spec(d.gpu())?.compute_capability;
        if major.is_null() || minor.is_null() {
            return Err(rc::INVALID_ARGUMENT);
        }
        put(major, a)?;
        put(minor, b)
    })
}

/// `nvmlDeviceGetNumGpuCores` (SMs x cores per SM; the CI's SMs for MIG devices).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumGpuCores(
    device: nvmlDevice_t,
    cores: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetNumGpuCores")?;
        let d = c.dev(device)?;
        let spec = c.spec(d.gpu())?;
        let sms = match d {
            Dev::Gpu(_) => spec.product.sm_count,
            Dev::Mig { gpu, gi, ci, nonce } => {
                let st = c.state()?;
                let (g, ci) = find_mig(gpu_state(&st, gpu)?, gi, ci, nonce)?;
                let p = gip(spec, g.profile_id)?;
                fixtures::ci_profile(p, ci.profile_id)
                    .ok_or(rc::UNKNOWN)?
                    .sm
            }
        };
        put(cores, sms * spec.product.cores_per_sm)
    })
}

/// `nvmlDeviceGetPersistenceMode` (always enabled).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPersistenceMode(
    device: nvmlDevice_t,
    mode: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetPersistenceMode")?;
        c.gpu(device, rc::NOT_SUPPORTED)?;
        put(mode, 1)
    })
}

/// `nvmlDeviceGetComputeMode` (persisted in the state file).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(
    device: nvmlDevice_t,
    mode: *mut nvmlComputeMode_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetComputeMode")?;
        let g = c.dev(device)?.gpu();
        let st = c.state()?;
        put(mode, gpu_state(&st, g)?.compute_mode)
    })
}

/// `nvmlDeviceSetComputeMode` (0..=3).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetComputeMode(
    device: nvmlDevice_t,
    mode: nvmlComputeMode_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceSetComputeMode")?;
        let g = c.gpu(device, rc::NOT_SUPPORTED)?;
        if mode > 3 {
            return Err(rc::INVALID_ARGUMENT);
        }
        c.modify(|st| {
            gpu_state_mut(st, g)?.compute_mode = mode;
            Ok(())
        })
    })
}

// ---------------------------------------------------------------------------------------
// MIG mode and MIG devices

/// `nvmlDeviceGetMigMode`: NOT_SUPPORTED on parts without MIG (MIG profile tables, docs/hardware-sources.md).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetMigMode")?;
        let g = c.gpu(device, rc::NOT_SUPPORTED)?;
        if !c.spec(g)?.mig_capable {
            return Err(rc::NOT_SUPPORTED);
        }
        if current.is_null() || pending.is_null() {
            return Err(rc::INVALID_ARGUMENT);
        }
        let st = c.state()?;
        let m = c_uint::from(gpu_state(&st, g)?.mig_enabled);
        put(current, m)?;
        put(pending, m)
    })
}

/// `nvmlDeviceSetMigMode`: applies at once (no reset needed); disabling with GPU
/// instances present returns IN_USE.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMigMode(
    device: nvmlDevice_t,
    mode: c_uint,
    activation_status: *mut nvmlReturn_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceSetMigMode")?;
        let g = c.gpu(device, rc::NOT_SUPPORTED)?;
        if !c.spec(g)?.mig_capable {
            return Err(rc::NOT_SUPPORTED);
        }
        if mode > 1 || activation_status.is_null() {
            return Err(rc::INVALID_ARGUMENT);
        }
        c.modify(|st| {
            let gs = gpu_state_mut(st, g)?;
            if mode == 0 && !gs.gpu_instances.is_empty() {
                return Err(rc::IN_USE);
            }
            gs.mig_enabled = mode == 1;
            Ok(())
        })?;
        put(activation_status, rc::SUCCESS)
    })
}

/// `nvmlDeviceGetMaxMigDeviceCount`: 7 with MIG enabled, else 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetMaxMigDeviceCount")?;
        let g = c.gpu(device, rc::INVALID_ARGUMENT)?;
        let st = c.state()?;
        let on = c.spec(g)?.mig_capable && gpu_state(&st, g)?.mig_enabled;
        put(count, if on { MAX_MIG_DEVICES } else { 0 })
    })
}

/// `nvmlDeviceGetMigDeviceHandleByIndex`: MIG devices ordered by GI ID then CI ID;
/// NOT_FOUND past the last one, INVALID_ARGUMENT past the maximum count.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetMigDeviceHandleByIndex")?;
        let g = c.gpu(device, rc::INVALID_ARGUMENT)?;
        let st = c.state()?;
        let gs = gpu_state(&st, g)?;
        state::require_mig(c.spec(g)?, gs)?;
        if mig.is_null() || index >= MAX_MIG_DEVICES {
            return Err(rc::INVALID_ARGUMENT);
        }
        let devs = state::mig_devices(gs);
        let (gi, ci) = devs.get(index as usize).ok_or(rc::NOT_FOUND)?;
        put(mig, mig_handle(g, gi, ci))
    })
}

/// `nvmlDeviceGetDeviceHandleFromMigDeviceHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")?;
        match c.dev(mig)? {
            Dev::Gpu(_) => Err(rc::INVALID_ARGUMENT),
            Dev::Mig { gpu, gi, ci, nonce } => {
                let st = c.state()?;
                find_mig(gpu_state(&st, gpu)?, gi, ci, nonce)?;
                put(device, gpu_handle(gpu))
            }
        }
    })
}

/// `nvmlDeviceIsMigDeviceHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    is_mig: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceIsMigDeviceHandle")?;
        let v = matches!(c.dev(device)?, Dev::Mig { .. });
        put(is_mig, c_uint::from(v))
    })
}

fn mig_ids(
    name: &'static str,
    device: nvmlDevice_t,
    out: *mut c_uint,
    want_ci: bool,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin(name)?;
        match c.dev(device)? {
            Dev::Gpu(_) => Err(rc::NOT_SUPPORTED),
            Dev::Mig { gpu, gi, ci, nonce } => {
                let st = c.state()?;
                let (g, ci) = find_mig(gpu_state(&st, gpu)?, gi, ci, nonce)?;
                put(out, if want_ci { ci.id } else { g.id })
            }
        }
    })
}

/// `nvmlDeviceGetGpuInstanceId` (MIG device handles only).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    mig_ids("nvmlDeviceGetGpuInstanceId", device, id, false)
}

/// `nvmlDeviceGetComputeInstanceId` (MIG device handles only).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    mig_ids("nvmlDeviceGetComputeInstanceId", device, id, true)
}

/// `nvmlDeviceGetAttributes_v2`: MIG device handles only (as nvml.h says).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nvmlDevice_t,
    attributes: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetAttributes_v2")?;
        match c.dev(device)? {
            Dev::Gpu(_) => Err(rc::NOT_SUPPORTED),
            Dev::Mig { gpu, gi, ci, nonce } => {
                let st = c.state()?;
                let (g, ci) = find_mig(gpu_state(&st, gpu)?, gi, ci, nonce)?;
                let p = gip(c.spec(gpu)?, g.profile_id)?;
                let cp = fixtures::ci_profile(p, ci.profile_id).ok_or(rc::UNKNOWN)?;
                put(
                    attributes,
                    nvmlDeviceAttributes_t {
                        multiprocessorCount: cp.sm,
                        sharedCopyEngineCount: p.ce,
                        sharedDecoderCount: p.dec,
                        sharedEncoderCount: p.enc,
                        sharedJpegCount: p.jpg,
                        sharedOfaCount: p.ofa,
                        gpuInstanceSliceCount: p.slice_count,
                        computeInstanceSliceCount: cp.slice_count,
                        memorySizeMB: p.memory_mib,
                    },
                )
            }
        }
    })
}

// ---------------------------------------------------------------------------------------
// GPU-instance profiles and placements

/// Profile lookup by `NVML_GPU_INSTANCE_PROFILE_*` enum: NOT_SUPPORTED without MIG or
/// for enums this part lacks, INVALID_ARGUMENT at or past the COUNT.
fn profile_by_enum(c: &Call, device: nvmlDevice_t, e: c_uint) -> R<&'static GiProfile> {
    let g = c.gpu(device, rc::INVALID_ARGUMENT)?;
    let st = c.state()?;
    state::require_mig(c.spec(g)?, gpu_state(&st, g)?)?;
    if e >= fixtures::GPU_INSTANCE_PROFILE_COUNT {
        return Err(rc::INVALID_ARGUMENT);
    }
    c.spec(g)?
        .product
        .profile_by_enum(e)
        .ok_or(rc::NOT_SUPPORTED)
}

fn gip_v1(p: &GiProfile) -> nvmlGpuInstanceProfileInfo_t {
    nvmlGpuInstanceProfileInfo_t {
        id: p.id,
        isP2pSupported: 0,
        sliceCount: p.slice_count,
        instanceCount: p.instance_count,
        multiprocessorCount: p.sm,
        copyEngineCount: p.ce,
        decoderCount: p.dec,
        encoderCount: p.enc,
        jpegCount: p.jpg,
        ofaCount: p.ofa,
        memorySizeMB: p.memory_mib,
    }
}

/// Writes a v2 or v3 profile info according to the caller's `version` field. The `name`
/// field holds the plain profile name (`1g.10gb`); what real NVML writes there is
/// UNVERIFIED (MIG profile naming, docs/hardware-sources.md).
fn put_gip_versioned(info: *mut nvmlGpuInstanceProfileInfo_v2_t, p: &GiProfile) -> R<()> {
    match read_u32(info.cast::<u32>())? {
        GIP_V2 => put(
            info,
            nvmlGpuInstanceProfileInfo_v2_t {
                version: GIP_V2,
                id: p.id,
                isP2pSupported: 0,
                sliceCount: p.slice_count,
                instanceCount: p.instance_count,
                multiprocessorCount: p.sm,
                copyEngineCount: p.ce,
                decoderCount: p.dec,
                encoderCount: p.enc,
                jpegCount: p.jpg,
                ofaCount: p.ofa,
                memorySizeMB: p.memory_mib,
                name: name_buf(p.name),
            },
        ),
        GIP_V3 => put(
            info.cast::<nvmlGpuInstanceProfileInfo_v3_t>(),
            nvmlGpuInstanceProfileInfo_v3_t {
                version: GIP_V3,
                id: p.id,
                sliceCount: p.slice_count,
                instanceCount: p.instance_count,
                multiprocessorCount: p.sm,
                copyEngineCount: p.ce,
                decoderCount: p.dec,
                encoderCount: p.enc,
                jpegCount: p.jpg,
                ofaCount: p.ofa,
                memorySizeMB: p.memory_mib,
                name: name_buf(p.name),
                capabilities: 0,
            },
        ),
        _ => Err(rc::ARGUMENT_VERSION_MISMATCH),
    }
}

/// `nvmlDeviceGetGpuInstanceProfileInfo` (v1 struct; `profile` is the enum).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetGpuInstanceProfileInfo")?;
        let p = profile_by_enum(&c, device, profile)?;
        put(info, gip_v1(p))
    })
}

/// `nvmlDeviceGetGpuInstanceProfileInfoV` (v2 or v3 by `info->version`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetGpuInstanceProfileInfoV")?;
        let p = profile_by_enum(&c, device, profile)?;
        put_gip_versioned(info, p)
    })
}

/// `nvmlDeviceGetGpuInstanceProfileInfoByIdV` (`profile_id` is the lgip ID).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoByIdV(
    device: nvmlDevice_t,
    profile_id: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetGpuInstanceProfileInfoByIdV")?;
        let g = c.gpu(device, rc::INVALID_ARGUMENT)?;
        let st = c.state()?;
        state::require_mig(c.spec(g)?, gpu_state(&st, g)?)?;
        let p = c
            .spec(g)?
            .product
            .profile_by_id(profile_id)
            .ok_or(rc::NOT_SUPPORTED)?;
        put_gip_versioned(info, p)
    })
}

/// Writes up to `n` items to a caller array with the NVML count protocol: a null array
/// returns the count, a short array INSUFFICIENT_SIZE (with the needed count).
fn put_array<T: Copy>(out: *mut T, count: *mut c_uint, items: &[T]) -> R<()> {
    let n = items.len() as c_uint;
    if out.is_null() {
        return put(count, n);
    }
    let cap = read_u32(count)?;
    if cap < n {
        put(count, n)?;
        return Err(rc::INSUFFICIENT_SIZE);
    }
    for (i, it) in items.iter().enumerate() {
        // SAFETY: `out` is non-null and, by the NVML contract, holds `*count` >= n items.
        put(unsafe { out.add(i) }, *it)?;
    }
    put(count, n)
}

/// Writes the items to an array the caller sized by the profile's instance count (the
/// GetGpuInstances / GetComputeInstances convention: `count` is output only).
fn put_instances<T: Copy>(out: *mut T, count: *mut c_uint, items: &[T]) -> R<()> {
    if out.is_null() || count.is_null() {
        return Err(rc::INVALID_ARGUMENT);
    }
    for (i, it) in items.iter().enumerate() {
        // SAFETY: `out` is non-null and, by the NVML contract, sized for the profile's
        // instanceCount, which bounds `items`.
        put(unsafe { out.add(i) }, *it)?;
    }
    put(count, items.len() as c_uint)
}

/// `nvmlDeviceGetGpuInstancePossiblePlacements_v2`: all placements of the profile,
/// whether MIG is enabled or not (nvml.h).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetGpuInstancePossiblePlacements_v2")?;
        let g = c.gpu(device, rc::INVALID_ARGUMENT)?;
        let spec = c.spec(g)?;
        if !spec.mig_capable {
            return Err(rc::NOT_SUPPORTED);
        }
        let p = spec
            .product
            .profile_by_id(profile_id)
            .ok_or(rc::INVALID_ARGUMENT)?;
        let items: Vec<_> = p
            .starts
            .iter()
            .map(|&start| nvmlGpuInstancePlacement_t {
                start,
                size: p.placement_size,
            })
            .collect();
        put_array(placements, count, &items)
    })
}

/// `nvmlDeviceGetGpuInstanceRemainingCapacity`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceRemainingCapacity(
    device: nvmlDevice_t,
    profile_id: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetGpuInstanceRemainingCapacity")?;
        let g = c.gpu(device, rc::INVALID_ARGUMENT)?;
        let st = c.state()?;
        let gs = gpu_state(&st, g)?;
        let spec = c.spec(g)?;
        state::require_mig(spec, gs)?;
        let p = spec
            .product
            .profile_by_id(profile_id)
            .ok_or(rc::INVALID_ARGUMENT)?;
        put(count, state::gi_remaining(p, gs))
    })
}

// ---------------------------------------------------------------------------------------
// GPU instances

fn create_gi(
    name: &'static str,
    device: nvmlDevice_t,
    profile_id: c_uint,
    placement: Option<*const nvmlGpuInstancePlacement_t>,
    out: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin(name)?;
        let g = c.gpu(device, rc::INVALID_ARGUMENT)?;
        if out.is_null() {
            return Err(rc::INVALID_ARGUMENT);
        }
        let want = match placement {
            None => None,
            Some(p) => {
                let p = p.cast::<u32>();
                // SAFETY: `p` points to an nvmlGpuInstancePlacement_t (two u32) by the
                // NVML contract; read_u32 rejects null, and `start` is checked first.
                let start = read_u32(p)?;
                let size = read_u32(unsafe { p.add(1) })?;
                Some((start, size))
            }
        };
        let spec = c.spec(g)?;
        let h = c.modify(|st| {
            let gs = gpu_state_mut(st, g)?;
            let i = state::create_gi(spec, gs, profile_id, want)?;
            Ok(gi_handle(g, &gs.gpu_instances[i]))
        })?;
        put(out, h)
    })
}

/// `nvmlDeviceCreateGpuInstance`: lowest free valid placement.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstance(
    device: nvmlDevice_t,
    profile_id: c_uint,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    create_gi(
        "nvmlDeviceCreateGpuInstance",
        device,
        profile_id,
        None,
        gpu_instance,
    )
}

/// `nvmlDeviceCreateGpuInstanceWithPlacement`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placement: *const nvmlGpuInstancePlacement_t,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    create_gi(
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        device,
        profile_id,
        Some(placement),
        gpu_instance,
    )
}

/// `nvmlDeviceGetGpuInstances`: the GIs of one lgip profile.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: nvmlDevice_t,
    profile_id: c_uint,
    gpu_instances: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetGpuInstances")?;
        let g = c.gpu(device, rc::INVALID_ARGUMENT)?;
        let st = c.state()?;
        let gs = gpu_state(&st, g)?;
        let spec = c.spec(g)?;
        state::require_mig(spec, gs)?;
        spec.product
            .profile_by_id(profile_id)
            .ok_or(rc::INVALID_ARGUMENT)?;
        let items: Vec<_> = gs
            .gpu_instances
            .iter()
            .filter(|x| x.profile_id == profile_id)
            .map(|x| gi_handle(g, x))
            .collect();
        put_instances(gpu_instances, count, &items)
    })
}

/// `nvmlDeviceGetGpuInstanceById`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: nvmlDevice_t,
    id: c_uint,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetGpuInstanceById")?;
        let g = c.gpu(device, rc::INVALID_ARGUMENT)?;
        let st = c.state()?;
        let gs = gpu_state(&st, g)?;
        state::require_mig(c.spec(g)?, gs)?;
        if gpu_instance.is_null() {
            return Err(rc::INVALID_ARGUMENT);
        }
        let gi = gs
            .gpu_instances
            .iter()
            .find(|x| x.id == id)
            .ok_or(rc::NOT_FOUND)?;
        put(gpu_instance, gi_handle(g, gi))
    })
}

/// `nvmlGpuInstanceGetInfo` (`profileId` = lgip ID, as DRA expects; NVML constants, docs/hardware-sources.md).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gpu_instance: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlGpuInstanceGetInfo")?;
        let (g, gi, nonce) = c.gi(gpu_instance)?;
        let st = c.state()?;
        let x = find_gi(gpu_state(&st, g)?, gi, nonce)?;
        put(
            info,
            nvmlGpuInstanceInfo_t {
                device: gpu_handle(g),
                id: x.id,
                profileId: x.profile_id,
                placement: nvmlGpuInstancePlacement_t {
                    start: x.start,
                    size: x.size,
                },
            },
        )
    })
}

/// `nvmlGpuInstanceDestroy`: IN_USE while compute instances exist.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceDestroy(gpu_instance: nvmlGpuInstance_t) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlGpuInstanceDestroy")?;
        let (g, gi, nonce) = c.gi(gpu_instance)?;
        c.modify(|st| {
            let gs = gpu_state_mut(st, g)?;
            find_gi(gs, gi, nonce)?;
            state::destroy_gi(gs, gi)
        })
    })
}

// ---------------------------------------------------------------------------------------
// Compute instances

/// The GI behind a handle and its profile, from a fresh state read.
fn gi_ctx(c: &Call, h: nvmlGpuInstance_t) -> R<(u32, GiState, &'static GiProfile)> {
    let (g, gi, nonce) = c.gi(h)?;
    let st = c.state()?;
    let x = find_gi(gpu_state(&st, g)?, gi, nonce)?.clone();
    let p = gip(c.spec(g)?, x.profile_id)?;
    Ok((g, x, p))
}

fn ci_by_enum(p: &GiProfile, profile: c_uint, eng: c_uint) -> R<CiProfile> {
    if profile >= fixtures::COMPUTE_INSTANCE_PROFILE_COUNT || eng != 0 {
        return Err(rc::INVALID_ARGUMENT);
    }
    fixtures::ci_profile(p, profile).ok_or(rc::NOT_SUPPORTED)
}

/// `nvmlGpuInstanceGetComputeInstanceProfileInfo` (v1; engine profile must be SHARED=0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlGpuInstanceGetComputeInstanceProfileInfo")?;
        let (_, _, p) = gi_ctx(&c, gpu_instance)?;
        let cp = ci_by_enum(p, profile, eng_profile)?;
        put(
            info,
            nvmlComputeInstanceProfileInfo_t {
                id: cp.id,
                sliceCount: cp.slice_count,
                instanceCount: cp.instance_count,
                multiprocessorCount: cp.sm,
                sharedCopyEngineCount: p.ce,
                sharedDecoderCount: p.dec,
                sharedEncoderCount: p.enc,
                sharedJpegCount: p.jpg,
                sharedOfaCount: p.ofa,
            },
        )
    })
}

/// `nvmlGpuInstanceGetComputeInstanceProfileInfoV` (v2 or v3 by `info->version`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlGpuInstanceGetComputeInstanceProfileInfoV")?;
        let (_, _, p) = gi_ctx(&c, gpu_instance)?;
        let cp = ci_by_enum(p, profile, eng_profile)?;
        let name = name_buf(&fixtures::ci_profile_name(p, &cp));
        match read_u32(info.cast::<u32>())? {
            CIP_V2 => put(
                info,
                nvmlComputeInstanceProfileInfo_v2_t {
                    version: CIP_V2,
                    id: cp.id,
                    sliceCount: cp.slice_count,
                    instanceCount: cp.instance_count,
                    multiprocessorCount: cp.sm,
                    sharedCopyEngineCount: p.ce,
                    sharedDecoderCount: p.dec,
                    sharedEncoderCount: p.enc,
                    sharedJpegCount: p.jpg,
                    sharedOfaCount: p.ofa,
                    name,
                },
            ),
            CIP_V3 => put(
                info.cast::<nvmlComputeInstanceProfileInfo_v3_t>(),
                nvmlComputeInstanceProfileInfo_v3_t {
                    version: CIP_V3,
                    id: cp.id,
                    sliceCount: cp.slice_count,
                    instanceCount: cp.instance_count,
                    multiprocessorCount: cp.sm,
                    sharedCopyEngineCount: p.ce,
                    sharedDecoderCount: p.dec,
                    sharedEncoderCount: p.enc,
                    sharedJpegCount: p.jpg,
                    sharedOfaCount: p.ofa,
                    name,
                    capabilities: 0,
                },
            ),
            _ => Err(rc::ARGUMENT_VERSION_MISMATCH),
        }
    })
}

/// `nvmlGpuInstanceGetComputeInstanceRemainingCapacity`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlGpuInstanceGetComputeInstanceRemainingCapacity")?;
        let (_, x, p) = gi_ctx(&c, gpu_instance)?;
        let cp = ci_by_enum(p, profile_id, 0).map_err(|_| rc::INVALID_ARGUMENT)?;
        let n = state::ci_free_placements(&x, cp.slice_count, cp.instance_count).len();
        put(count, n as c_uint)
    })
}

/// `nvmlGpuInstanceGetComputeInstancePossiblePlacements` (compute-slice placements).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstancePossiblePlacements(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    placements: *mut nvmlComputeInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlGpuInstanceGetComputeInstancePossiblePlacements")?;
        let (_, _, p) = gi_ctx(&c, gpu_instance)?;
        let cp = ci_by_enum(p, profile_id, 0).map_err(|_| rc::INVALID_ARGUMENT)?;
        let items: Vec<_> = (0..cp.instance_count)
            .map(|k| nvmlComputeInstancePlacement_t {
                start: k * cp.slice_count,
                size: cp.slice_count,
            })
            .collect();
        put_array(placements, count, &items)
    })
}

fn create_ci(
    name: &'static str,
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    placement: Option<*const nvmlComputeInstancePlacement_t>,
    out: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin(name)?;
        let (g, gi, nonce) = c.gi(gpu_instance)?;
        if out.is_null() {
            return Err(rc::INVALID_ARGUMENT);
        }
        let want = match placement {
            None => None,
            Some(p) => {
                let p = p.cast::<u32>();
                // SAFETY: `p` points to an nvmlComputeInstancePlacement_t (two u32) by the
                // NVML contract; read_u32 rejects null, and `start` is checked first.
                let start = read_u32(p)?;
                let size = read_u32(unsafe { p.add(1) })?;
                Some((start, size))
            }
        };
        let spec = c.spec(g)?;
        let h = c.modify(|st| {
            let gs = gpu_state_mut(st, g)?;
            find_gi(gs, gi, nonce)?;
            let x = gs
                .gpu_instances
                .iter_mut()
                .find(|x| x.id == gi)
                .ok_or(rc::INVALID_ARGUMENT)?;
            let i = state::create_ci(spec, x, profile_id, want)?;
            Ok(ci_handle(g, x, &x.compute_instances[i]))
        })?;
        put(out, h)
    })
}

/// `nvmlGpuInstanceCreateComputeInstance`: CI IDs from 0, a fresh MIG UUID each time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    create_ci(
        "nvmlGpuInstanceCreateComputeInstance",
        gpu_instance,
        profile_id,
        None,
        compute_instance,
    )
}

/// `nvmlGpuInstanceCreateComputeInstanceWithPlacement`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstanceWithPlacement(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    placement: *const nvmlComputeInstancePlacement_t,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    create_ci(
        "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
        gpu_instance,
        profile_id,
        Some(placement),
        compute_instance,
    )
}

/// `nvmlGpuInstanceGetComputeInstances`: the CIs of one CI profile.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instances: *mut nvmlComputeInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlGpuInstanceGetComputeInstances")?;
        let (g, x, p) = gi_ctx(&c, gpu_instance)?;
        ci_by_enum(p, profile_id, 0).map_err(|_| rc::INVALID_ARGUMENT)?;
        let items: Vec<_> = x
            .compute_instances
            .iter()
            .filter(|ci| ci.profile_id == profile_id)
            .map(|ci| ci_handle(g, &x, ci))
            .collect();
        put_instances(compute_instances, count, &items)
    })
}

/// `nvmlGpuInstanceGetComputeInstanceById`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceById(
    gpu_instance: nvmlGpuInstance_t,
    id: c_uint,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlGpuInstanceGetComputeInstanceById")?;
        let (g, x, _) = gi_ctx(&c, gpu_instance)?;
        if compute_instance.is_null() {
            return Err(rc::INVALID_ARGUMENT);
        }
        let ci = x
            .compute_instances
            .iter()
            .find(|ci| ci.id == id)
            .ok_or(rc::NOT_FOUND)?;
        put(compute_instance, ci_handle(g, &x, ci))
    })
}

/// `nvmlComputeInstanceGetInfo_v2` (`device` is the parent GPU handle).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    compute_instance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlComputeInstanceGetInfo_v2")?;
        let (g, gi, ci, nonce) = c.ci(compute_instance)?;
        let st = c.state()?;
        let (x, y) = find_mig(gpu_state(&st, g)?, gi, ci, nonce)?;
        put(
            info,
            nvmlComputeInstanceInfo_t {
                device: gpu_handle(g),
                gpuInstance: gi_handle(g, x),
                id: y.id,
                profileId: y.profile_id,
                placement: nvmlComputeInstancePlacement_t {
                    start: y.start,
                    size: y.size,
                },
            },
        )
    })
}

/// `nvmlComputeInstanceDestroy`: IN_USE while a process is attached (control file
/// `attach <gpu> <gi> <ci>`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceDestroy(
    compute_instance: nvmlComputeInstance_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlComputeInstanceDestroy")?;
        let (g, gi, ci, nonce) = c.ci(compute_instance)?;
        // nvml.h: IN_USE "if there are compute processes running on the compute instance".
        if c.hooks.is_attached(g, gi, Some(ci)) {
            return Err(rc::IN_USE);
        }
        c.modify(|st| {
            let gs = gpu_state_mut(st, g)?;
            find_mig(gs, gi, ci, nonce)?;
            let x = gs
                .gpu_instances
                .iter_mut()
                .find(|x| x.id == gi)
                .ok_or(rc::INVALID_ARGUMENT)?;
            x.compute_instances.retain(|y| y.id != ci);
            Ok(())
        })
    })
}

// ---------------------------------------------------------------------------------------
// Events

/// `nvmlDeviceGetSupportedEventTypes`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    types: *mut c_ulonglong,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetSupportedEventTypes")?;
        c.dev(device)?;
        put(types, SUPPORTED_EVENTS)
    })
}

/// `nvmlEventSetCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    entry(|| {
        let _c = Call::begin("nvmlEventSetCreate")?;
        if set.is_null() {
            return Err(rc::INVALID_ARGUMENT);
        }
        let id = {
            let mut reg = lock(&REGISTRY);
            reg.next_set += 1;
            reg.next_set
        };
        lock(&EVENT_SETS).insert(id, EventSet::default());
        put(set, handle_of(Obj::EventSet(id)) as nvmlEventSet_t)
    })
}

fn event_set_id(set: nvmlEventSet_t) -> R<u64> {
    match resolve(set as usize) {
        Some(Obj::EventSet(id)) if lock(&EVENT_SETS).contains_key(&id) => Ok(id),
        _ => Err(rc::INVALID_ARGUMENT),
    }
}

/// `nvmlDeviceRegisterEvents` (full-GPU handles only; MIG handles: NOT_SUPPORTED, register
/// on the parent as the NVIDIA plugins do).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceRegisterEvents")?;
        let g = c.gpu(device, rc::NOT_SUPPORTED)?;
        let id = event_set_id(set)?;
        if types & !SUPPORTED_EVENTS != 0 {
            return Err(rc::NOT_SUPPORTED);
        }
        let mut sets = lock(&EVENT_SETS);
        let es = sets.get_mut(&id).ok_or(rc::INVALID_ARGUMENT)?;
        *es.registered.entry(g).or_insert(0) |= types;
        Ok(())
    })
}

fn event_wait(
    name: &'static str,
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    entry(|| {
        let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
        let id = event_set_id(set)?;
        if data.is_null() {
            return Err(rc::INVALID_ARGUMENT);
        }
        loop {
            let c = Call::begin(name)?;
            let mut xids = c.hooks.xids.clone();
            if let Some(p) = &c.rt.events {
                xids.extend(hooks::read(p, true).xids.iter().cloned());
            }
            {
                let mut sets = lock(&EVENT_SETS);
                let es = sets.get_mut(&id).ok_or(rc::INVALID_ARGUMENT)?;
                if c.hooks.lost.iter().any(|g| es.registered.contains_key(g)) {
                    return Err(rc::GPU_IS_LOST);
                }
                for x in xids {
                    let wanted = es
                        .registered
                        .get(&x.gpu)
                        .is_some_and(|m| m & EVENT_XID != 0);
                    if wanted && (x.gpu as usize) < c.cfg().gpus.len() && es.delivered.insert(x.key)
                    {
                        return put(
                            data,
                            nvmlEventData_t {
                                device: gpu_handle(x.gpu),
                                eventType: EVENT_XID,
                                eventData: x.xid,
                                gpuInstanceId: x.gi,
                                computeInstanceId: x.ci,
                            },
                        );
                    }
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(rc::TIMEOUT);
            }
            std::thread::sleep((deadline - now).min(Duration::from_millis(10)));
        }
    })
}

/// `nvmlEventSetWait_v2`: delivers each injected Xid once per event set; polls the
/// control and events files every 10 ms until `timeoutms`, then NVML_ERROR_TIMEOUT.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeoutms: c_uint,
) -> nvmlReturn_t {
    event_wait("nvmlEventSetWait_v2", set, data, timeoutms)
}

/// `nvmlEventSetWait` (v1, same behaviour).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeoutms: c_uint,
) -> nvmlReturn_t {
    event_wait("nvmlEventSetWait", set, data, timeoutms)
}

/// `nvmlEventSetFree`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    entry(|| {
        let _c = Call::begin("nvmlEventSetFree")?;
        let id = event_set_id(set)?;
        lock(&EVENT_SETS).remove(&id);
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------
// Usage: utilization, compute processes, per-process utilization, GPM. Values come from
// the control file (`memory`, `util`, `gpm`, `process` lines); what is NOT_SUPPORTED
// where follows nvml.h (NVIDIA/go-nvml gen/nvml/nvml.h).

/// `nvmlGpmMetricId_t` values the mock computes (nvml.h).
const GPM_GRAPHICS_UTIL: u32 = 1;
const GPM_SM_UTIL: u32 = 2;
const GPM_SM_OCCUPANCY: u32 = 3;
/// `NVML_GPM_METRIC_MAX` of the newest nvml.h (API 13); `numMetrics` above it is invalid.
const GPM_METRIC_MAX: u32 = 333;
/// `NVML_GPM_METRICS_GET_VERSION`, `NVML_GPM_SUPPORT_VERSION`.
const GPM_VERSION: u32 = 1;
/// `gpuInstanceId` / `computeInstanceId` outside MIG mode.
const NO_ID: u32 = 0xFFFF_FFFF;

/// True if MIG mode is on for GPU `gpu`.
fn mig_enabled(c: &Call, gpu: u32) -> R<bool> {
    let st = c.state()?;
    Ok(gpu_state(&st, gpu)?.mig_enabled)
}

/// GPM needs Hopper or newer (nvml.h "For Hopper or newer fully supported devices").
fn has_gpm(c: &Call, gpu: u32) -> R<bool> {
    Ok(c.spec(gpu)?.product.architecture >= fixtures::ARCH_HOPPER)
}

/// `nvmlDeviceGetUtilizationRates`: NOT_SUPPORTED on MIG device handles and on GPUs in
/// MIG mode (nvml.h: "On MIG-enabled GPUs, querying device utilization rates is not
/// currently supported").
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetUtilizationRates")?;
        let g = c.gpu(device, rc::NOT_SUPPORTED)?;
        if mig_enabled(&c, g)? {
            return Err(rc::NOT_SUPPORTED);
        }
        let (gpu, memory) = c.hooks.usage.util_of(g);
        put(utilization, nvmlUtilization_t { gpu, memory })
    })
}

/// The scripted processes a device handle sees: all of its GPU's for a GPU handle (nvml.h:
/// aggregate information in MIG mode), those of the MIG device for a MIG handle; MPS
/// clients (`mps`) or plain compute processes.
fn processes_of(c: &Call, d: Dev, mps: bool) -> Vec<Process> {
    let mig = match d {
        Dev::Gpu(_) => None,
        Dev::Mig { gi, ci, .. } => Some((gi, ci)),
    };
    c.hooks
        .usage
        .processes_on(d.gpu(), mig)
        .filter(|p| p.mps == mps)
        .copied()
        .collect()
}

/// Fills an `nvmlProcessInfo_t` list the way nvml.h says for
/// `nvmlDeviceGetComputeRunningProcesses_v3` and `nvmlDeviceGetMPSComputeRunningProcesses_v3`:
/// `*infoCount` too small (0 to ask) returns INSUFFICIENT_SIZE with the count needed,
/// SUCCESS when none run.
fn fill_processes(
    c: &Call,
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
    mps: bool,
) -> Result<(), nvmlReturn_t> {
    let d = c.dev(device)?;
    let room = read_u32(info_count)?;
    let list = processes_of(c, d, mps);
    let n = list.len() as u32;
    if room < n {
        put(info_count, n)?;
        return Err(rc::INSUFFICIENT_SIZE);
    }
    if n > 0 && infos.is_null() {
        return Err(rc::INVALID_ARGUMENT);
    }
    let mig_mode = mig_enabled(c, d.gpu())?;
    for (i, p) in list.iter().enumerate() {
        let (gi, ci) = match p.mig {
            Some(ids) if mig_mode => ids,
            _ => (NO_ID, NO_ID),
        };
        // SAFETY: `infos` is non-null and, by the NVML contract, valid for `room` >= n
        // entries.
        put(
            unsafe { infos.add(i) },
            nvmlProcessInfo_t {
                pid: p.pid,
                usedGpuMemory: p.used_mib * MIB,
                gpuInstanceId: gi,
                computeInstanceId: ci,
            },
        )?;
    }
    put(info_count, n)
}

/// `nvmlDeviceGetComputeRunningProcesses_v3`: the scripted plain compute processes
/// ([`fill_processes`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetComputeRunningProcesses_v3")?;
        fill_processes(&c, device, info_count, infos, false)
    })
}

/// `nvmlDeviceGetMPSComputeRunningProcesses_v3`: the scripted MPS clients (`process ...
/// mps` lines), same struct and protocol as the plain list ([`fill_processes`]).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetMPSComputeRunningProcesses_v3")?;
        fill_processes(&c, device, info_count, infos, true)
    })
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// `nvmlDeviceGetProcessUtilization`: one sample (stamped now) per scripted process of the
/// GPU with non-zero SM utilization; NOT_FOUND when there is none newer than
/// `lastSeenTimeStamp`; NOT_SUPPORTED on MIG handles and MIG-enabled GPUs (nvml.h: "On
/// MIG-enabled GPUs, querying process utilization is not currently supported"). A NULL
/// buffer or a too small count returns INSUFFICIENT_SIZE with the count needed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    utilization: *mut nvmlProcessUtilizationSample_t,
    samples_count: *mut c_uint,
    last_seen: c_ulonglong,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlDeviceGetProcessUtilization")?;
        let g = c.gpu(device, rc::NOT_SUPPORTED)?;
        if mig_enabled(&c, g)? {
            return Err(rc::NOT_SUPPORTED);
        }
        let room = read_u32(samples_count)?;
        let now = now_us();
        let list: Vec<Process> = c
            .hooks
            .usage
            .processes_on(g, None)
            .filter(|p| p.sm_percent > 0)
            .copied()
            .collect();
        if list.is_empty() || now <= last_seen {
            put(samples_count, 0)?;
            return Err(rc::NOT_FOUND);
        }
        let n = list.len() as u32;
        if utilization.is_null() || room < n {
            put(samples_count, n)?;
            return Err(rc::INSUFFICIENT_SIZE);
        }
        for (i, p) in list.iter().enumerate() {
            // SAFETY: non-null and, by the NVML contract, valid for `room` >= n entries.
            put(
                unsafe { utilization.add(i) },
                nvmlProcessUtilizationSample_t {
                    pid: p.pid,
                    timeStamp: now,
                    smUtil: p.sm_percent,
                    memUtil: 0,
                    encUtil: 0,
                    decUtil: 0,
                },
            )?;
        }
        put(samples_count, n)
    })
}

/// What a GPM sample holds: whose it is and the scripted figures when it was taken.
#[derive(Debug, Clone, Copy, PartialEq)]
struct GpmData {
    gpu: u32,
    gi: Option<u32>,
    sm_activity: f64,
    sm_occupancy: f64,
}

/// Allocated GPM samples by address; `None` until a sample is read into it.
static GPM_SAMPLES: LazyLock<Mutex<HashMap<usize, Option<GpmData>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// `nvmlGpmQueryDeviceSupport` (GPU or MIG handle; checks `version`): supported on Hopper
/// and newer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmQueryDeviceSupport(
    device: nvmlDevice_t,
    support: *mut nvmlGpmSupport_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlGpmQueryDeviceSupport")?;
        let d = c.dev(device)?;
        if read_u32(support.cast::<u32>())? != GPM_VERSION {
            return Err(rc::ARGUMENT_VERSION_MISMATCH);
        }
        put(
            support,
            nvmlGpmSupport_t {
                version: GPM_VERSION,
                isSupportedDevice: u32::from(has_gpm(&c, d.gpu())?),
            },
        )
    })
}

/// `nvmlGpmSampleAlloc`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleAlloc(sample: *mut nvmlGpmSample_t) -> nvmlReturn_t {
    entry(|| {
        let _c = Call::begin("nvmlGpmSampleAlloc")?;
        if sample.is_null() {
            return Err(rc::INVALID_ARGUMENT);
        }
        let p = Box::into_raw(Box::new(0u64)) as usize;
        lock(&GPM_SAMPLES).insert(p, None);
        put(sample, p as nvmlGpmSample_t)
    })
}

/// `nvmlGpmSampleFree`: INVALID_ARGUMENT for a handle not allocated (or already freed).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleFree(sample: nvmlGpmSample_t) -> nvmlReturn_t {
    entry(|| {
        let _c = Call::begin("nvmlGpmSampleFree")?;
        let p = sample as usize;
        if lock(&GPM_SAMPLES).remove(&p).is_none() {
            return Err(rc::INVALID_ARGUMENT);
        }
        // SAFETY: `p` came from `Box::into_raw` in `nvmlGpmSampleAlloc` and was still in
        // the registry, so it is freed exactly once.
        drop(unsafe { Box::from_raw(p as *mut u64) });
        Ok(())
    })
}

fn gpm_read(c: &Call, gpu: u32, gi: Option<u32>, sample: nvmlGpmSample_t) -> R<()> {
    if !has_gpm(c, gpu)? {
        return Err(rc::NOT_SUPPORTED);
    }
    let (sm_activity, sm_occupancy) = c.hooks.usage.gpm_of(gpu, gi);
    let mut samples = lock(&GPM_SAMPLES);
    let slot = samples
        .get_mut(&(sample as usize))
        .ok_or(rc::INVALID_ARGUMENT)?;
    *slot = Some(GpmData {
        gpu,
        gi,
        sm_activity,
        sm_occupancy,
    });
    Ok(())
}

/// `nvmlGpmSampleGet`: a GPU handle samples the GPU, a MIG device handle its GPU instance
/// (nvml.h: "This API supports the device handle and MIG device handle"); NOT_SUPPORTED
/// before Hopper.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleGet(
    device: nvmlDevice_t,
    sample: nvmlGpmSample_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlGpmSampleGet")?;
        match c.dev(device)? {
            Dev::Gpu(g) => gpm_read(&c, g, None, sample),
            Dev::Mig { gpu, gi, .. } => gpm_read(&c, gpu, Some(gi), sample),
        }
    })
}

/// `nvmlGpmMigSampleGet`: GPU instance `gi` of a MIG-enabled GPU (GPU handle). An unknown
/// GI or MIG off is INVALID_ARGUMENT (what real NVML returns there is unverified).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmMigSampleGet(
    device: nvmlDevice_t,
    gpu_instance_id: c_uint,
    sample: nvmlGpmSample_t,
) -> nvmlReturn_t {
    entry(|| {
        let c = Call::begin("nvmlGpmMigSampleGet")?;
        let g = c.gpu(device, rc::INVALID_ARGUMENT)?;
        if !has_gpm(&c, g)? {
            return Err(rc::NOT_SUPPORTED);
        }
        let st = c.state()?;
        let gs = gpu_state(&st, g)?;
        if !gs.mig_enabled || !gs.gpu_instances.iter().any(|x| x.id == gpu_instance_id) {
            return Err(rc::INVALID_ARGUMENT);
        }
        gpm_read(&c, g, Some(gpu_instance_id), sample)
    })
}

/// `nvmlGpmMetricsGet` (checks `version`): SM activity (`NVML_GPM_METRIC_SM_UTIL`, and
/// `GRAPHICS_UTIL` with the same figure), SM occupancy; any other metric id gets
/// NOT_SUPPORTED in its `nvmlReturn`. The figures are those scripted when `sample2` was
/// taken; both samples must be of the same device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmMetricsGet(metrics_get: *mut nvmlGpmMetricsGet_t) -> nvmlReturn_t {
    entry(|| {
        let _c = Call::begin("nvmlGpmMetricsGet")?;
        if metrics_get.is_null() {
            return Err(rc::INVALID_ARGUMENT);
        }
        // SAFETY: non-null and, by the NVML contract, a valid nvmlGpmMetricsGet_t header;
        // only the fields before `metrics` are read here.
        let (version, count, s1, s2) = unsafe {
            let m = &*metrics_get;
            (m.version, m.numMetrics, m.sample1, m.sample2)
        };
        if version != GPM_VERSION {
            return Err(rc::ARGUMENT_VERSION_MISMATCH);
        }
        if count > GPM_METRIC_MAX {
            return Err(rc::INVALID_ARGUMENT);
        }
        let samples = lock(&GPM_SAMPLES);
        let first = samples
            .get(&(s1 as usize))
            .copied()
            .flatten()
            .ok_or(rc::INVALID_ARGUMENT)?;
        let second = samples
            .get(&(s2 as usize))
            .copied()
            .flatten()
            .ok_or(rc::INVALID_ARGUMENT)?;
        drop(samples);
        if (first.gpu, first.gi) != (second.gpu, second.gi) {
            return Err(rc::INVALID_ARGUMENT);
        }
        // SAFETY: the caller's struct holds `numMetrics` entries from `metrics` on (a
        // header with a larger NVML_GPM_METRIC_MAX only adds room after them).
        let base =
            unsafe { std::ptr::addr_of_mut!((*metrics_get).metrics) }.cast::<nvmlGpmMetric_t>();
        for i in 0..count as usize {
            // SAFETY: i < numMetrics, see above.
            let m = unsafe { &mut *base.add(i) };
            let (value, name) = match m.metricId {
                GPM_SM_UTIL => (Some(second.sm_activity), c"sm_util"),
                GPM_GRAPHICS_UTIL => (Some(second.sm_activity), c"graphics_util"),
                GPM_SM_OCCUPANCY => (Some(second.sm_occupancy), c"sm_occupancy"),
                _ => (None, c""),
            };
            match value {
                Some(v) => {
                    m.nvmlReturn = rc::SUCCESS;
                    m.value = v;
                    m.metricInfo.shortName = name.as_ptr().cast_mut();
                    m.metricInfo.longName = name.as_ptr().cast_mut();
                    m.metricInfo.unit = c"%".as_ptr().cast_mut();
                }
                None => {
                    m.nvmlReturn = rc::NOT_SUPPORTED;
                    m.value = 0.0;
                    m.metricInfo.shortName = std::ptr::null_mut();
                    m.metricInfo.longName = std::ptr::null_mut();
                    m.metricInfo.unit = std::ptr::null_mut();
                }
            }
        }
        Ok(())
    })
}
