//! Test support: a recording fake [`GpuBackend`] with MIG placement rules, inventory and
//! claim builders, and node configurations over a driver root laid out like a real host.
//! Built for this crate's unit tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::Mutex;

use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult,
    DeviceRequestAllocationResult, OpaqueDeviceConfiguration, ResourceClaim, ResourceClaimStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;

use crate::backend::{BackendError, GpuBackend};
use crate::driver_root::DriverRootConfig;
use crate::model::{GpuInfo, MigInstance, MigProfile, MigState, NodeInventory, Placement};
use crate::prepare::DriverConfig;

/// NVML_ERROR_INVALID_ARGUMENT.
pub const NVML_INVALID_ARGUMENT: u32 = 2;
/// NVML_ERROR_NOT_SUPPORTED.
pub const NVML_NOT_SUPPORTED: u32 = 3;
/// NVML_ERROR_INSUFFICIENT_RESOURCES (what NVML answers for an occupied placement).
pub const NVML_INSUFFICIENT_RESOURCES: u32 = 23;

/// One call the fake received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// `inventory()`.
    Inventory,
    /// `create_mig(gpu, profile, placement)`.
    CreateMig {
        /// GPU UUID.
        gpu_uuid: String,
        /// Profile id.
        profile_id: u32,
        /// Placement.
        placement: Placement,
    },
    /// `destroy_mig(gpu, gi, ci)`.
    DestroyMig {
        /// GPU UUID.
        gpu_uuid: String,
        /// GPU instance id.
        gi_id: u32,
        /// Compute instance id.
        ci_id: u32,
    },
    /// `list_mig(gpu)`.
    ListMig {
        /// GPU UUID.
        gpu_uuid: String,
    },
}

impl Call {
    /// True for calls that change the hardware.
    pub(crate) fn is_mutation(&self) -> bool {
        matches!(self, Self::CreateMig { .. } | Self::DestroyMig { .. })
    }
}

#[derive(Debug)]
struct FakeState {
    inventory: NodeInventory,
    calls: Vec<Call>,
    fail_next_create: Option<BackendError>,
    fail_destroy: Option<BackendError>,
    created: u32,
}

/// A GPU backend in memory that records every call and enforces MIG placement rules
/// (profile and placement must exist, placements must not overlap).
#[derive(Debug)]
pub struct FakeBackend {
    state: Mutex<FakeState>,
}

fn nvml_err(call: &'static str, target: &str, message: &str, code: u32) -> BackendError {
    BackendError::Nvml {
        call,
        target: target.to_owned(),
        message: message.to_owned(),
        code,
    }
}

impl FakeBackend {
    /// A fake node with this inventory.
    pub fn new(inventory: NodeInventory) -> Self {
        Self {
            state: Mutex::new(FakeState {
                inventory,
                calls: Vec::new(),
                fail_next_create: None,
                fail_destroy: None,
                created: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.state.lock().unwrap()
    }

    /// Calls received so far.
    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// Mutating calls received so far.
    pub fn mutations(&self) -> Vec<Call> {
        self.calls().into_iter().filter(Call::is_mutation).collect()
    }

    /// Forgets the recorded calls.
    pub fn clear_calls(&self) {
        self.lock().calls.clear();
    }

    /// Makes the next `create_mig` fail with `err` (after recording the call).
    pub fn fail_next_create(&self, err: BackendError) {
        self.lock().fail_next_create = Some(err);
    }

    /// Makes every `destroy_mig` fail with `err` until set to `None`.
    pub fn fail_destroy(&self, err: Option<BackendError>) {
        self.lock().fail_destroy = err;
    }

    /// MIG devices on a GPU now.
    pub fn instances(&self, gpu_uuid: &str) -> Vec<MigInstance> {
        let state = self.lock();
        state
            .inventory
            .gpus
            .iter()
            .find(|g| g.uuid == gpu_uuid)
            .map(|g| match &g.mig {
                MigState::Enabled { instances, .. } => instances.clone(),
                _ => Vec::new(),
            })
            .unwrap_or_default()
    }

    /// Forgets every MIG instance, as a reboot does (MIG mode stays on).
    pub fn reboot(&self) {
        for gpu in &mut self.lock().inventory.gpus {
            if let MigState::Enabled { instances, .. } = &mut gpu.mig {
                instances.clear();
            }
        }
    }

    /// Creates an instance without recording a call (as an administrator would).
    pub fn add_instance(
        &self,
        gpu_uuid: &str,
        profile_id: u32,
        placement: Placement,
    ) -> Result<MigInstance, BackendError> {
        self.create(gpu_uuid, profile_id, placement)
    }

    fn create(
        &self,
        gpu_uuid: &str,
        profile_id: u32,
        placement: Placement,
    ) -> Result<MigInstance, BackendError> {
        let mut state = self.lock();
        state.created += 1;
        let n = state.created;
        let gpu = state
            .inventory
            .gpus
            .iter_mut()
            .find(|g| g.uuid == gpu_uuid)
            .ok_or_else(|| BackendError::GpuNotFound(gpu_uuid.to_owned()))?;
        let MigState::Enabled {
            profiles,
            instances,
            ..
        } = &mut gpu.mig
        else {
            return Err(nvml_err(
                "nvmlDeviceCreateGpuInstanceWithPlacement",
                gpu_uuid,
                "Not Supported",
                NVML_NOT_SUPPORTED,
            ));
        };
        let profile = profiles
            .iter()
            .find(|p| p.id == profile_id && p.placements.contains(&placement))
            .ok_or_else(|| {
                nvml_err(
                    "nvmlDeviceCreateGpuInstanceWithPlacement",
                    gpu_uuid,
                    "Invalid Argument",
                    NVML_INVALID_ARGUMENT,
                )
            })?;
        if instances.iter().any(|i| i.placement.overlaps(&placement)) {
            return Err(nvml_err(
                "nvmlDeviceCreateGpuInstanceWithPlacement",
                gpu_uuid,
                "Insufficient Resources",
                NVML_INSUFFICIENT_RESOURCES,
            ));
        }
        let gi_id = (1..)
            .find(|id| !instances.iter().any(|i| i.gi_id == *id))
            .unwrap();
        let inst = MigInstance {
            uuid: format!("MIG-{n:08x}-0000-4000-8000-{:012x}", gi_id),
            profile_id,
            profile_name: profile.name.clone(),
            gi_id,
            ci_id: 0,
            placement,
        };
        instances.push(inst.clone());
        Ok(inst)
    }
}

impl GpuBackend for FakeBackend {
    fn inventory(&self) -> Result<NodeInventory, BackendError> {
        let mut state = self.lock();
        state.calls.push(Call::Inventory);
        Ok(state.inventory.clone())
    }

    fn create_mig(
        &self,
        gpu_uuid: &str,
        profile_id: u32,
        placement: Placement,
    ) -> Result<MigInstance, BackendError> {
        {
            let mut state = self.lock();
            state.calls.push(Call::CreateMig {
                gpu_uuid: gpu_uuid.to_owned(),
                profile_id,
                placement,
            });
            if let Some(e) = state.fail_next_create.take() {
                return Err(e);
            }
        }
        self.create(gpu_uuid, profile_id, placement)
    }

    fn destroy_mig(&self, gpu_uuid: &str, gi_id: u32, ci_id: u32) -> Result<(), BackendError> {
        let mut state = self.lock();
        state.calls.push(Call::DestroyMig {
            gpu_uuid: gpu_uuid.to_owned(),
            gi_id,
            ci_id,
        });
        if let Some(e) = state.fail_destroy.clone() {
            return Err(e);
        }
        let gpu = state
            .inventory
            .gpus
            .iter_mut()
            .find(|g| g.uuid == gpu_uuid)
            .ok_or_else(|| BackendError::GpuNotFound(gpu_uuid.to_owned()))?;
        if let MigState::Enabled { instances, .. } = &mut gpu.mig {
            instances.retain(|i| !(i.gi_id == gi_id && i.ci_id == ci_id));
        }
        Ok(())
    }

    fn list_mig(&self, gpu_uuid: &str) -> Result<Vec<MigInstance>, BackendError> {
        self.lock().calls.push(Call::ListMig {
            gpu_uuid: gpu_uuid.to_owned(),
        });
        if !self
            .lock()
            .inventory
            .gpus
            .iter()
            .any(|g| g.uuid == gpu_uuid)
        {
            return Err(BackendError::GpuNotFound(gpu_uuid.to_owned()));
        }
        Ok(self.instances(gpu_uuid))
    }
}

/// UUID of fake GPU `minor`.
pub fn gpu_uuid(minor: u32) -> String {
    format!("GPU-{minor:08x}-1111-4222-8333-444444444444")
}

/// A whole GPU without MIG.
pub fn plain_gpu(minor: u32) -> GpuInfo {
    GpuInfo {
        index: minor,
        minor,
        uuid: gpu_uuid(minor),
        product_name: "NVIDIA L4".into(),
        brand: "Nvidia".into(),
        architecture: "Ada".into(),
        cuda_compute_capability: (8, 9),
        memory_bytes: 24 << 30,
        multiprocessors: Some(58),
        pci_bus_id: format!("0000:{:02x}:00.0", minor + 1),
        pcie_root: None,
        numa_node: None,
        mig: MigState::NotCapable,
    }
}

#[allow(clippy::too_many_arguments)]
fn profile(
    id: u32,
    name: &str,
    slices: u32,
    count: u32,
    mem: u64,
    sms: u32,
    size: u32,
    starts: &[u32],
) -> MigProfile {
    MigProfile {
        id,
        name: name.into(),
        slice_count: slices,
        instance_count: count,
        memory_mib: mem,
        multiprocessors: sms,
        copy_engines: slices,
        decoders: 0,
        encoders: 0,
        jpeg_engines: 0,
        ofa_engines: 0,
        placements: starts
            .iter()
            .map(|&start| Placement { start, size })
            .collect(),
    }
}

/// The A100-SXM4-40GB GPU-instance profiles (docs/hardware-sources.md, "MIG profile tables").
pub(crate) fn a100_40gb_profiles() -> Vec<MigProfile> {
    vec![
        profile(19, "1g.5gb", 1, 7, 4864, 14, 1, &[0, 1, 2, 3, 4, 5, 6]),
        profile(20, "1g.5gb+me", 1, 1, 4864, 14, 1, &[0, 1, 2, 3, 4, 5, 6]),
        profile(15, "1g.10gb", 1, 4, 9856, 14, 2, &[0, 2, 4, 6]),
        profile(14, "2g.10gb", 2, 3, 9856, 28, 2, &[0, 2, 4]),
        profile(9, "3g.20gb", 3, 2, 19968, 42, 4, &[0, 4]),
        profile(5, "4g.20gb", 4, 1, 19968, 56, 4, &[0]),
        profile(0, "7g.40gb", 7, 1, 40192, 98, 8, &[0]),
    ]
}

/// An A100 40GB with MIG enabled and no instances.
pub fn mig_gpu(minor: u32) -> GpuInfo {
    GpuInfo {
        product_name: "NVIDIA A100-SXM4-40GB".into(),
        architecture: "Ampere".into(),
        cuda_compute_capability: (8, 0),
        memory_bytes: 40 << 30,
        multiprocessors: Some(108),
        mig: MigState::Enabled {
            profiles: a100_40gb_profiles(),
            instances: Vec::new(),
            memory_slices: 8,
        },
        ..plain_gpu(minor)
    }
}

/// The mock NVML library's product `key` (`h100-80gb`, `a100-40gb`, `l4`, ...).
pub(crate) fn mock_product(key: &str) -> &'static mock_nvml::fixtures::Product {
    mock_nvml::fixtures::product(key).unwrap_or_else(|| panic!("no mock product {key}"))
}

/// The architecture name discovery reports for a mock product.
pub fn architecture_name(product: &mock_nvml::fixtures::Product) -> &'static str {
    match product.architecture {
        mock_nvml::fixtures::ARCH_AMPERE => "Ampere",
        mock_nvml::fixtures::ARCH_HOPPER => "Hopper",
        mock_nvml::fixtures::ARCH_ADA => "Ada",
        other => panic!("architecture {other} has no name here"),
    }
}

/// The GPU-instance profiles of the mock NVML library's product `key` as discovery models
/// them: one table for every test.
pub fn mock_profiles(key: &str) -> Vec<MigProfile> {
    mock_product(key)
        .mig_profiles
        .iter()
        .map(|p| MigProfile {
            id: p.id,
            name: p.name.into(),
            slice_count: p.slice_count,
            instance_count: p.instance_count,
            memory_mib: p.memory_mib,
            multiprocessors: p.sm,
            copy_engines: p.ce,
            decoders: p.dec,
            encoders: p.enc,
            jpeg_engines: p.jpg,
            ofa_engines: p.ofa,
            placements: p
                .starts
                .iter()
                .map(|&start| Placement {
                    start,
                    size: p.placement_size,
                })
                .collect(),
        })
        .collect()
}

/// GPU `minor` (UUID [`gpu_uuid`], PCI bus `0000:<minor + 1>:00.0`) of the mock's product
/// `key` with this MIG state, with the identity discovery reads from the mock library.
pub fn mock_gpu(key: &str, minor: u32, mig: MigState) -> GpuInfo {
    let p = mock_product(key);
    let (major, minor_cc) = p.compute_capability;
    GpuInfo {
        product_name: p.name.into(),
        architecture: architecture_name(p).into(),
        cuda_compute_capability: (major.unsigned_abs(), minor_cc.unsigned_abs()),
        memory_bytes: p.memory_mib << 20,
        multiprocessors: Some(p.sm_count),
        mig,
        ..plain_gpu(minor)
    }
}

/// The H100 80GB HBM3 GPU-instance profiles (the mock library's table).
pub fn h100_profiles() -> Vec<MigProfile> {
    mock_profiles("h100-80gb")
}

/// An H100 80GB HBM3 with this MIG state.
pub fn h100_gpu(minor: u32, mig: MigState) -> GpuInfo {
    mock_gpu("h100-80gb", minor, mig)
}

/// An inventory of these GPUs.
pub fn inventory(gpus: Vec<GpuInfo>) -> NodeInventory {
    NodeInventory {
        driver_version: "570.148.08".into(),
        driver_semver: "570.148.8".into(),
        cuda_driver_semver: "12.8.0".into(),
        gpus,
    }
}

/// A node driver configuration with every path inside `dir` and a driver root laid out
/// like an Ubuntu host with GPUs of minors 0..8 (device nodes, libraries, soname links).
#[cfg(test)]
pub(crate) fn config_in(dir: &Path, dynamic_mig: bool) -> DriverConfig {
    let config = config_with_empty_root(dir, dynamic_mig);
    mock_nvml::driver_root::DriverRootFixture::with_minors(0..8)
        .lay_out(&config.driver_root.root)
        .expect("laying out the test driver root");
    config
}

/// [`config_in`] with an empty driver root (a node whose `--driver-root` is wrong).
pub fn config_with_empty_root(dir: &Path, dynamic_mig: bool) -> DriverConfig {
    let boot_id_path = dir.join("boot_id");
    if !boot_id_path.exists() {
        std::fs::write(&boot_id_path, "11111111-2222-3333-4444-555555555555\n").unwrap();
    }
    DriverConfig {
        driver_name: cleave_api::names::DRIVER_NAME.into(),
        pool_name: "node-a".into(),
        state_dir: dir.join("plugins").join(cleave_api::names::DRIVER_NAME),
        cdi_root: dir.join("cdi"),
        driver_root: DriverRootConfig {
            root: dir.join("driver-root"),
            host_root: None,
            dev_root: Some(dir.join("driver-root")),
            proc_root: dir.join("proc"),
        },
        dynamic_mig,
        boot_id_path,
        cdi_hook: None,
        consumable_capacity: Default::default(),
    }
}

/// An allocated claim; `results` are `(request, driver, pool, device)`.
pub fn claim(uid: &str, results: &[(&str, &str, &str, &str)]) -> ResourceClaim {
    ResourceClaim {
        metadata: ObjectMeta {
            name: Some(format!("claim-{}", &uid[..uid.len().min(8)])),
            namespace: Some("default".into()),
            uid: Some(uid.into()),
            ..ObjectMeta::default()
        },
        status: Some(ResourceClaimStatus {
            allocation: Some(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    config: None,
                    results: Some(
                        results
                            .iter()
                            .map(
                                |(request, driver, pool, device)| DeviceRequestAllocationResult {
                                    request: (*request).into(),
                                    driver: (*driver).into(),
                                    pool: (*pool).into(),
                                    device: (*device).into(),
                                    ..DeviceRequestAllocationResult::default()
                                },
                            )
                            .collect(),
                    ),
                }),
                ..AllocationResult::default()
            }),
            ..ResourceClaimStatus::default()
        }),
        ..ResourceClaim::default()
    }
}

/// A claim of this node's devices (`(request, device)`), driver `gpu.cleave.dev`, pool `node-a`.
pub fn node_claim(uid: &str, devices: &[(&str, &str)]) -> ResourceClaim {
    let results: Vec<(&str, &str, &str, &str)> = devices
        .iter()
        .map(|(r, d)| (*r, cleave_api::names::DRIVER_NAME, "node-a", *d))
        .collect();
    claim(uid, &results)
}

/// Adds an opaque config entry for `driver` (`source` `FromClass` or `FromClaim`).
pub fn with_config(
    mut claim: ResourceClaim,
    source: &str,
    driver: &str,
    requests: &[&str],
    parameters: serde_json::Value,
) -> ResourceClaim {
    let devices = claim
        .status
        .as_mut()
        .and_then(|s| s.allocation.as_mut())
        .and_then(|a| a.devices.as_mut())
        .expect("claim is allocated");
    devices
        .config
        .get_or_insert_with(Vec::new)
        .push(DeviceAllocationConfiguration {
            opaque: Some(OpaqueDeviceConfiguration {
                driver: driver.into(),
                parameters: RawExtension(parameters),
            }),
            requests: if requests.is_empty() {
                None
            } else {
                Some(requests.iter().map(|r| (*r).to_owned()).collect())
            },
            source: source.into(),
        });
    claim
}

// ---------------------------------------------------------------------------------------
// Fake health events and fake usage (the `EventSource` / `UsageSource` seams).

/// A scripted [`crate::backend::EventSource`]: events are pushed by the test and handed
/// out by the subscription's bounded wait; lost GPUs are a set the test edits.
pub struct FakeEvents {
    tx: Mutex<std::sync::mpsc::Sender<crate::backend::EventWait>>,
    rx: Mutex<Option<std::sync::mpsc::Receiver<crate::backend::EventWait>>>,
    lost: Mutex<std::collections::BTreeSet<String>>,
    /// GPUs whose registration fails.
    pub failing: std::collections::BTreeSet<String>,
    subscribed: Mutex<Vec<String>>,
    released: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Default for FakeEvents {
    fn default() -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        Self {
            tx: Mutex::new(tx),
            rx: Mutex::new(Some(rx)),
            lost: Mutex::new(std::collections::BTreeSet::new()),
            failing: std::collections::BTreeSet::new(),
            subscribed: Mutex::new(Vec::new()),
            released: std::sync::Arc::default(),
        }
    }
}

impl FakeEvents {
    /// Queues what the next wait returns.
    pub fn push(&self, w: crate::backend::EventWait) {
        self.tx.lock().unwrap().send(w).unwrap();
    }

    /// Marks a GPU lost or reachable.
    pub fn set_lost(&self, uuid: &str, lost: bool) {
        let mut set = self.lost.lock().unwrap();
        if lost {
            set.insert(uuid.to_owned());
        } else {
            set.remove(uuid);
        }
    }

    /// The GPUs the subscription was asked for.
    pub fn subscribed(&self) -> Vec<String> {
        self.subscribed.lock().unwrap().clone()
    }

    /// True once the subscription was dropped (the event set released).
    pub fn released(&self) -> bool {
        self.released.load(std::sync::atomic::Ordering::SeqCst)
    }
}

struct FakeSubscription {
    rx: std::sync::mpsc::Receiver<crate::backend::EventWait>,
    unregistered: Vec<String>,
    released: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl crate::backend::EventSubscription for FakeSubscription {
    fn wait(&mut self, timeout: std::time::Duration) -> crate::backend::EventWait {
        self.rx
            .recv_timeout(timeout)
            .unwrap_or(crate::backend::EventWait::Timeout)
    }

    fn unregistered(&self) -> &[String] {
        &self.unregistered
    }
}

impl Drop for FakeSubscription {
    fn drop(&mut self) {
        self.released
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl crate::backend::EventSource for FakeEvents {
    fn subscribe<'s>(
        &'s self,
        gpu_uuids: &[String],
    ) -> Result<Box<dyn crate::backend::EventSubscription + 's>, BackendError> {
        *self.subscribed.lock().unwrap() = gpu_uuids.to_vec();
        let rx = self
            .rx
            .lock()
            .unwrap()
            .take()
            .ok_or_else(|| BackendError::Other("FakeEvents: subscribed twice".into()))?;
        Ok(Box::new(FakeSubscription {
            rx,
            unregistered: gpu_uuids
                .iter()
                .filter(|u| self.failing.contains(*u))
                .cloned()
                .collect(),
            released: std::sync::Arc::clone(&self.released),
        }))
    }

    fn is_lost(&self, gpu_uuid: &str) -> bool {
        self.lost.lock().unwrap().contains(gpu_uuid)
    }
}

/// What [`FakeUsage`] answers for one GPU or MIG device.
#[derive(Debug, Clone, Default)]
pub struct FakeUsageDevice {
    /// Used memory, bytes.
    pub used: u64,
    /// Total memory, bytes.
    pub total: u64,
    /// `nvmlDeviceGetUtilizationRates().gpu`; `None`: not supported.
    pub utilization: Option<u32>,
    /// Whole-GPU GPM figures; `None`: no GPM (before Hopper).
    pub gpm: Option<crate::backend::GpmActivity>,
    /// Compute processes `(pid, used bytes)`.
    pub processes: Vec<(u32, u64)>,
    /// MPS clients `(pid, bytes)` (`nvmlDeviceGetMPSComputeRunningProcesses_v3`).
    pub mps_processes: Vec<(u32, u64)>,
    /// Per-process SM utilization `(pid, percent)`, all stamped 1000 µs; `None`: not
    /// supported.
    pub process_util: Option<Vec<(u32, u32)>>,
}

/// A scripted [`crate::backend::UsageSource`] that logs its calls; GPM warms up like
/// NVML's (the first call per target gives no figure).
#[derive(Default)]
pub struct FakeUsage {
    devices: Mutex<std::collections::HashMap<String, FakeUsageDevice>>,
    mig_gpm: Mutex<std::collections::HashMap<(String, u32), f64>>,
    kept: Mutex<std::collections::BTreeSet<crate::backend::GpmTarget>>,
    calls: Mutex<Vec<String>>,
}

impl FakeUsage {
    /// Sets the answers for a device UUID.
    pub fn set(&self, uuid: &str, d: FakeUsageDevice) {
        self.devices.lock().unwrap().insert(uuid.to_owned(), d);
    }

    /// Sets the GPM SM activity of GPU instance `gi` of `gpu` (whole GPU: `gi` None).
    pub fn set_gpm(&self, gpu: &str, gi: Option<u32>, sm_activity: f64) {
        match gi {
            Some(gi) => {
                self.mig_gpm
                    .lock()
                    .unwrap()
                    .insert((gpu.to_owned(), gi), sm_activity);
            }
            None => {
                let mut d = self.devices.lock().unwrap();
                d.entry(gpu.to_owned()).or_default().gpm = Some(crate::backend::GpmActivity {
                    sm_activity,
                    sm_occupancy: None,
                });
            }
        }
    }

    /// Calls so far, one line each.
    pub fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    /// GPM targets with a kept sample.
    pub fn kept_gpm(&self) -> Vec<crate::backend::GpmTarget> {
        self.kept.lock().unwrap().iter().cloned().collect()
    }

    fn device(&self, uuid: &str) -> Result<FakeUsageDevice, BackendError> {
        self.devices
            .lock()
            .unwrap()
            .get(uuid)
            .cloned()
            .ok_or_else(|| BackendError::GpuNotFound(uuid.to_owned()))
    }

    fn log(&self, line: String) {
        self.calls.lock().unwrap().push(line);
    }
}

impl crate::backend::UsageSource for FakeUsage {
    fn memory(&self, uuid: &str) -> Result<crate::backend::MemoryUse, BackendError> {
        self.log(format!("memory {uuid}"));
        let d = self.device(uuid)?;
        Ok(crate::backend::MemoryUse {
            used: d.used,
            total: d.total,
        })
    }

    fn gpu_utilization(&self, uuid: &str) -> Result<Option<u32>, BackendError> {
        self.log(format!("utilization {uuid}"));
        Ok(self.device(uuid)?.utilization)
    }

    fn gpm(
        &self,
        target: &crate::backend::GpmTarget,
    ) -> Result<crate::backend::GpmReading, BackendError> {
        self.log(format!("gpm {} {:?}", target.gpu_uuid, target.gi));
        let activity = match target.gi {
            None => self.device(&target.gpu_uuid)?.gpm,
            Some(gi) => self
                .mig_gpm
                .lock()
                .unwrap()
                .get(&(target.gpu_uuid.clone(), gi))
                .map(|&sm_activity| crate::backend::GpmActivity {
                    sm_activity,
                    sm_occupancy: None,
                }),
        };
        let Some(activity) = activity else {
            return Ok(crate::backend::GpmReading::Unsupported);
        };
        if self.kept.lock().unwrap().insert(target.clone()) {
            Ok(crate::backend::GpmReading::Warming)
        } else {
            Ok(crate::backend::GpmReading::Ready(activity))
        }
    }

    fn gpm_retain(&self, live: &[crate::backend::GpmTarget]) {
        self.kept.lock().unwrap().retain(|t| live.contains(t));
    }

    fn processes(&self, uuid: &str) -> Result<Vec<crate::backend::ProcessMemory>, BackendError> {
        self.log(format!("processes {uuid}"));
        Ok(process_memory(self.device(uuid)?.processes))
    }

    fn mps_processes(
        &self,
        uuid: &str,
    ) -> Result<Vec<crate::backend::ProcessMemory>, BackendError> {
        self.log(format!("mps_processes {uuid}"));
        Ok(process_memory(self.device(uuid)?.mps_processes))
    }

    fn process_utilization(
        &self,
        uuid: &str,
        since_us: u64,
    ) -> Result<Option<Vec<crate::backend::ProcessUtilization>>, BackendError> {
        self.log(format!("process_util {uuid} since {since_us}"));
        Ok(self.device(uuid)?.process_util.map(|list| {
            list.into_iter()
                .map(|(pid, sm_percent)| crate::backend::ProcessUtilization {
                    pid,
                    timestamp_us: 1000,
                    sm_percent,
                })
                .filter(|p| p.timestamp_us > since_us)
                .collect()
        }))
    }
}

/// The record of claim `uid`'s own MPS daemon (its `daemon.json`): 50 % of the threads on
/// `GPU-0`, pipes under `/state/mps`, not started.
pub fn mps_record(uid: &str) -> crate::sharing::MpsRecord {
    crate::sharing::MpsRecord {
        spec: crate::sharing::DaemonSpec {
            claim_uid: uid.to_owned(),
            pipe_dir: "/state/mps/pipe".into(),
            log_dir: "/state/mps/log".into(),
            visible_devices: vec!["GPU-0".into()],
            multi_user: false,
        },
        host_pipe_dir: "/state/mps/pipe".into(),
        active_thread_percentage: 50,
        pinned_limits: Vec::new(),
        exclusive_gpus: Vec::new(),
        daemon: None,
    }
}

/// The sharing state a checkpoint records for a claim with its own MPS daemon: the daemon's
/// key, the claim UID.
pub fn mps_sharing_state(uid: &str) -> crate::sharing::SharingState {
    crate::sharing::SharingState {
        mps_daemon: Some(uid.to_owned()),
        time_slicing: Vec::new(),
    }
}

/// A checkpoint record of claim `uid` (namespace `ns`, named after its UID) without devices.
pub fn checkpoint_claim(
    uid: &str,
    state: crate::checkpoint::ClaimState,
    sharing: Option<crate::sharing::SharingState>,
) -> crate::checkpoint::ClaimRecord {
    crate::checkpoint::ClaimRecord {
        uid: uid.to_owned(),
        namespace: "ns".into(),
        name: uid.to_owned(),
        state,
        devices: Vec::new(),
        sharing,
    }
}

/// Checkpoint contents holding `claims` (boot ID `boot`).
pub fn checkpoint_data(
    claims: Vec<crate::checkpoint::ClaimRecord>,
) -> crate::checkpoint::CheckpointData {
    crate::checkpoint::CheckpointData {
        boot_id: "boot".into(),
        claims: claims.into_iter().map(|c| (c.uid.clone(), c)).collect(),
    }
}

/// A 1-slice MIG instance (profile ID 19) of GPU instance `gi` / compute instance `ci` at
/// slice `start`, named `MIG-<gi>-<ci>`.
pub fn mig_instance(gi: u32, ci: u32, profile: &str, start: u32) -> MigInstance {
    MigInstance {
        uuid: format!("MIG-{gi}-{ci}"),
        profile_id: 19,
        profile_name: profile.into(),
        gi_id: gi,
        ci_id: ci,
        placement: Placement { start, size: 1 },
    }
}

/// An Xid health event of `uuid` (of GPU instance `gi` / compute instance `ci` when given).
pub fn xid_event(
    uuid: &str,
    gi: Option<u32>,
    ci: Option<u32>,
    xid: u64,
    fatal: bool,
) -> crate::health::HealthEvent {
    crate::health::HealthEvent {
        gpu_uuid: uuid.into(),
        gi,
        ci,
        kind: crate::health::HealthEventKind::Xid,
        xid: Some(xid),
        fatal,
    }
}

/// `(pid, bytes)` pairs as NVML's process entries (no MIG instance).
fn process_memory(list: Vec<(u32, u64)>) -> Vec<crate::backend::ProcessMemory> {
    list.into_iter()
        .map(|(pid, used)| crate::backend::ProcessMemory {
            pid,
            used: Some(used),
            gi: None,
            ci: None,
        })
        .collect()
}
