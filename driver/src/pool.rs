//! Turns the device model into the devices the node publishes (resource.k8s.io/v1
//! `Device` and `CounterSet` values, grouped per GPU for the controller).
//!
//! Per GPU:
//! - no MIG (not capable, or MIG mode off): one whole-GPU device `gpu-<minor>`;
//! - MIG on, static: one device per existing MIG instance, `gpu-<minor>-mig-<profile>-<start>`;
//! - MIG on, on-demand: the whole GPU plus one device per valid placement of every profile,
//!   all consuming one counter set `gpu-<minor>-counters`, so that the scheduler never
//!   hands out two placements that cannot exist together.
//!
//! Counters of the set (each device consumes exactly what its instance would take):
//! - `memory-slice-<i>` (value 1) for every memory slice: overlapping placements share one;
//! - `compute-slices` (value 7 on A100/H100/H200): the `g` numbers add up;
//! - `instances-<profile>` for profiles that allow fewer instances than placements
//!   (e.g. one `1g.10gb+me` per GPU: the single optical-flow engine).
//!   Engine totals need no counter of their own: the profile tables never let memory and
//!   compute slices fit a combination whose engines would not.
//!
//! Instances that someone else made (not in [`PoolOptions::owned_instances`]) are taken:
//! their memory-slice counters are 0 and their compute slices and instance counts are
//! removed from the totals, so no overlapping placement can be allocated. Instances cleave
//! made for claims keep their counters: the allocations of those claims consume them.

#[cfg(any(test, feature = "testing"))]
mod limit_check;
mod order;

use std::collections::{BTreeMap, BTreeSet};

use cleave_api::limits;
use cleave_api::names::{DeviceName, attr, cap, device_type, profile_label};
use cleave_api::pool::{ConsumableCapacity, DeviceGroup, PoolDevices};
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Counter, CounterSet, Device,
    DeviceAttribute, DeviceCapacity, DeviceCounterConsumption,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::model::{
    BareGpuInstance, GpuInfo, MigInstance, MigProfile, MigState, NodeInventory, Placement,
};
#[cfg(any(test, feature = "testing"))]
pub use limit_check::limit_violations;
pub use order::PlacementOrder;

/// How to publish the node's devices.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolOptions {
    /// Publish every valid placement of MIG-enabled GPUs (created on prepare) instead of
    /// the instances that exist (`--dynamic-mig`; needs partitionable devices).
    pub dynamic_mig: bool,
    /// MIG device UUIDs that cleave created for claims. In on-demand mode every other
    /// existing instance is published as taken.
    pub owned_instances: BTreeSet<String>,
    /// GPU instances without a compute instance, by GPU UUID (see [`BareGpuInstance`]).
    /// In on-demand mode their placements are published as taken: NVML refuses them until
    /// the driver has destroyed them.
    pub bare_gpu_instances: BTreeMap<String, Vec<BareGpuInstance>>,
    /// Publish devices for sharing by capacity (`--consumable-capacity`): whole GPUs and
    /// MIG devices with `allowMultipleAllocations` and request policies (see
    /// [`shared_capacity`]). Prepare reads the same value to enforce the shares.
    pub consumable_capacity: ConsumableCapacity,
    /// With consumable capacity on, also publish devices that consume shared counters
    /// (on-demand MIG placements, and whole GPUs of on-demand MIG GPUs) as shareable. Off by
    /// default: the upstream allocator (dynamic-resource-allocation v0.36.2) does not give
    /// back the counters of a shareable device it backtracks over, so some claims that fit
    /// are refused, and kube-scheduler 1.36.0/1.36.1 over-commit such devices.
    pub share_on_demand_mig: bool,
}

/// Step (and minimum) of a share's `memory` request: 1Mi, the unit of MPS's pinned-memory
/// limit (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<ordinal>=<n>M`). The API requires the policy's
/// default and max to be a whole number of steps from the minimum (kubernetes
/// `pkg/apis/resource/validation/validation.go`, `validateRequestPolicyRange`), so a device
/// memory that is not a multiple is rounded down.
pub(crate) const MEMORY_STEP_BYTES: u64 = 1 << 20;

/// Name of the counter set of the GPU with this minor number.
pub fn counter_set_name(minor: u32) -> String {
    format!("gpu-{minor}-counters")
}

/// Name of the counter of memory slice `i`.
pub(crate) fn memory_slice_counter(i: u32) -> String {
    format!("memory-slice-{i}")
}

/// Name of the compute-slice counter.
pub(crate) const COMPUTE_SLICES_COUNTER: &str = "compute-slices";

/// Name of the instance-limit counter of a profile (`instances-1g10gbme`).
pub(crate) fn instances_counter(profile_name: &str) -> String {
    format!("instances-{}", profile_label(profile_name))
}

/// Builds everything the node publishes: one [`DeviceGroup`] per GPU, GPUs by minor number.
/// Pure and deterministic: the same inventory and options give the same value.
pub fn build_pool(inv: &NodeInventory, opts: &PoolOptions) -> PoolDevices {
    let mut gpus: Vec<&GpuInfo> = inv.gpus.iter().collect();
    gpus.sort_by_key(|g| (g.minor, g.index));
    let groups = gpus
        .into_iter()
        .map(|gpu| gpu_group(inv, gpu, opts))
        .filter(|g| !g.devices.is_empty())
        .collect();
    PoolDevices { groups }
}

/// A GPU that publishes no device at all, and why (for the log, a Node Event and
/// `inspect`: a silent empty pool is the worst answer an operator can get).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SilentGpu {
    /// Whole-GPU device name (`gpu-<minor>`).
    pub name: String,
    /// GPU UUID.
    pub uuid: String,
    /// Why nothing is published, and what to do.
    pub reason: SilentReason,
}

/// Why a GPU publishes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SilentReason {
    /// MIG mode is on, the GPU has no MIG instance, and on-demand MIG is off.
    MigWithoutInstances,
    /// MIG mode is on but NVML answers no MIG profile (nothing can be named or created).
    MigWithoutProfiles,
}

impl std::fmt::Display for SilentReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::MigWithoutInstances => {
                "MIG is enabled and no MIG instance exists, and on-demand MIG is off: create instances (nvidia-smi mig -cgi <profiles> -C), or run with --dynamic-mig (chart: dynamicMig=true, needs DRAPartitionableDevices), or disable MIG (nvidia-smi -mig 0) to publish the whole GPU"
            }
            Self::MigWithoutProfiles => {
                "MIG is enabled but NVML answers no MIG profile (nvmlDeviceGetGpuInstanceProfileInfo), so no MIG device can be named or created; check the driver version supports MIG on this GPU"
            }
        })
    }
}

/// The GPUs of `inv` that [`build_pool`] publishes nothing for, with the reason.
pub fn silent_gpus(inv: &NodeInventory, opts: &PoolOptions) -> Vec<SilentGpu> {
    let mut gpus: Vec<&GpuInfo> = inv.gpus.iter().collect();
    gpus.sort_by_key(|g| (g.minor, g.index));
    gpus.into_iter()
        .filter(|gpu| gpu_group(inv, gpu, opts).devices.is_empty())
        .filter_map(|gpu| {
            let reason = match &gpu.mig {
                MigState::Enabled { profiles, .. } if profiles.is_empty() => {
                    SilentReason::MigWithoutProfiles
                }
                MigState::Enabled { .. } => SilentReason::MigWithoutInstances,
                _ => return None,
            };
            Some(SilentGpu {
                name: DeviceName::gpu(gpu.minor).to_string(),
                uuid: gpu.uuid.clone(),
                reason,
            })
        })
        .collect()
}

fn gpu_group(inv: &NodeInventory, gpu: &GpuInfo, opts: &PoolOptions) -> DeviceGroup {
    let mut group = unshared_group(inv, gpu, opts);
    if opts.consumable_capacity.is_on() {
        group
            .devices
            .iter_mut()
            .filter(|d| opts.share_on_demand_mig || d.consumes_counters.is_none())
            .for_each(shared_capacity);
    }
    group
}

/// Makes `device` shareable by capacity: `allowMultipleAllocations: true`, and on every
/// capacity a request policy whose default is the whole of it for `memory` and
/// `multiprocessors` (so a claim that asks for no capacity still gets the device alone) and
/// zero for the MIG engine counts (engines are shared by every process in the instance,
/// not divided). Ranges: `memory` from 1Mi in 1Mi steps, rounded down to the step
/// ([`MEMORY_STEP_BYTES`]); `multiprocessors` from 1 in steps of 1.
///
/// MIG devices are shared too: the allocator (k8s.io/dynamic-resource-allocation
/// `structured/internal/incubating/allocator_incubating.go`, `allocateDevice`) checks and
/// consumes a device's counters for its first share only (`skipCounterCheck` once capacity
/// is in use) and frees them when the last share goes, so an on-demand placement shared by
/// several claims blocks its overlapping placements exactly once.
pub fn shared_capacity(device: &mut Device) {
    let Some(caps) = device.capacity.as_mut() else {
        return;
    };
    for (name, c) in caps.iter_mut() {
        let Ok(value) = cleave_api::quantity::Quantity::parse(&c.value.0).map(|q| q.value()) else {
            continue;
        };
        let value = u64::try_from(value).unwrap_or(0);
        c.request_policy = Some(match name.as_str() {
            cap::MEMORY if value >= 2 * MEMORY_STEP_BYTES => {
                let whole = bytes_quantity(value - value % MEMORY_STEP_BYTES);
                policy(
                    whole.clone(),
                    bytes_quantity(MEMORY_STEP_BYTES),
                    whole,
                    bytes_quantity(MEMORY_STEP_BYTES),
                )
            }
            cap::MULTIPROCESSORS if value >= 2 => {
                let whole = count_quantity(value);
                policy(whole.clone(), count_quantity(1), whole, count_quantity(1))
            }
            cap::MEMORY | cap::MULTIPROCESSORS => continue,
            _ => CapacityRequestPolicy {
                default: Some(count_quantity(0)),
                valid_range: Some(CapacityRequestPolicyRange {
                    min: count_quantity(0),
                    ..Default::default()
                }),
                valid_values: None,
            },
        });
    }
    device.allow_multiple_allocations = Some(true);
}

fn policy(
    default: Quantity,
    min: Quantity,
    max: Quantity,
    step: Quantity,
) -> CapacityRequestPolicy {
    CapacityRequestPolicy {
        default: Some(default),
        valid_range: Some(CapacityRequestPolicyRange {
            min,
            max: Some(max),
            step: Some(step),
        }),
        valid_values: None,
    }
}

fn unshared_group(inv: &NodeInventory, gpu: &GpuInfo, opts: &PoolOptions) -> DeviceGroup {
    match &gpu.mig {
        MigState::NotCapable | MigState::Disabled { .. } => DeviceGroup {
            counter_sets: Vec::new(),
            devices: vec![whole_gpu_device(inv, gpu, None)],
        },
        MigState::Enabled {
            profiles,
            instances,
            ..
        } if !opts.dynamic_mig => DeviceGroup {
            counter_sets: Vec::new(),
            devices: static_mig_devices(inv, gpu, profiles, instances),
        },
        MigState::Enabled {
            profiles,
            instances,
            memory_slices,
        } => on_demand_group(inv, gpu, profiles, instances, *memory_slices, opts),
    }
}

/// The publishing order of MIG profiles: smallest first (compute slices, then memory),
/// then by name (so `1g.10gb` comes before `1g.10gb+me`). The allocator gives a request
/// the first matching device whose counters fit, in publish order (k8s.io/dynamic-resource-
/// allocation `structured/internal/incubating/allocator_incubating.go`). A request that
/// names a profile never matches another profile's devices, so the profile order changes
/// nothing for it; a request that selects by capacity (`memory >= 20Gi`, or the MIG class
/// alone) gets the smallest profile that satisfies it instead of the 7g.
pub(crate) fn order_profiles(profiles: &mut [&MigProfile]) {
    profiles.sort_by(|a, b| {
        a.slice_count
            .cmp(&b.slice_count)
            .then(a.memory_mib.cmp(&b.memory_mib))
            .then(a.name.cmp(&b.name))
            .then(a.id.cmp(&b.id))
    });
}

/// The publishing order of one profile's placements: [`PlacementOrder::DEFAULT`], the
/// candidate that admits the most requests when the scheduler takes the first fitting
/// device (simulated against the exact optimum in `hack/packing`).
pub fn order_placements(profile: &MigProfile, placements: &mut [Placement]) {
    PlacementOrder::DEFAULT.sort(profile, placements);
}

fn on_demand_group(
    inv: &NodeInventory,
    gpu: &GpuInfo,
    profiles: &[MigProfile],
    instances: &[MigInstance],
    memory_slices: u32,
    opts: &PoolOptions,
) -> DeviceGroup {
    let set = counter_set_name(gpu.minor);
    let compute_total = profiles.iter().map(|p| p.slice_count).max().unwrap_or(0);
    let limited: Vec<&MigProfile> = profiles
        .iter()
        .filter(|p| (p.instance_count as usize) < p.placements.len())
        .collect();

    // Totals, then what foreign instances take away.
    let mut mem_free = vec![1i64; memory_slices as usize];
    let mut compute_free = i64::from(compute_total);
    let mut limit_free: BTreeMap<u32, i64> = limited
        .iter()
        .map(|p| (p.id, i64::from(p.instance_count)))
        .collect();
    let foreign = instances
        .iter()
        .filter(|i| !opts.owned_instances.contains(&i.uuid))
        .map(|i| (i.profile_id, i.placement));
    let bare = opts
        .bare_gpu_instances
        .get(&gpu.uuid)
        .into_iter()
        .flatten()
        .map(|b| (b.profile_id, b.placement));
    for (profile_id, placement) in foreign.chain(bare) {
        for s in slices(placement) {
            if let Some(c) = mem_free.get_mut(s as usize) {
                *c = 0;
            }
        }
        let taken = profiles
            .iter()
            .find(|p| p.id == profile_id)
            .map_or(placement.size.min(compute_total), |p| p.slice_count);
        compute_free = (compute_free - i64::from(taken)).max(0);
        if let Some(c) = limit_free.get_mut(&profile_id) {
            *c = (*c - 1).max(0);
        }
    }

    let mut counters = BTreeMap::new();
    for (i, free) in mem_free.iter().enumerate() {
        counters.insert(memory_slice_counter(i as u32), counter(*free));
    }
    counters.insert(COMPUTE_SLICES_COUNTER.to_owned(), counter(compute_free));
    for p in &limited {
        let free = limit_free.get(&p.id).copied().unwrap_or(0);
        counters.insert(instances_counter(&p.name), counter(free));
    }
    let counter_sets = vec![CounterSet {
        name: set.clone(),
        counters,
    }];

    // The whole GPU takes every memory and compute slice.
    let mut whole = BTreeMap::new();
    for i in 0..memory_slices {
        whole.insert(memory_slice_counter(i), counter(1));
    }
    whole.insert(
        COMPUTE_SLICES_COUNTER.to_owned(),
        counter(i64::from(compute_total)),
    );
    let mut devices = vec![whole_gpu_device(
        inv,
        gpu,
        Some(DeviceCounterConsumption {
            counter_set: set.clone(),
            counters: whole,
        }),
    )];

    let mut ordered: Vec<&MigProfile> = profiles.iter().collect();
    order_profiles(&mut ordered);
    for p in ordered {
        let mut placements = p.placements.clone();
        order_placements(p, &mut placements);
        for pl in placements {
            let mut used = BTreeMap::new();
            for s in slices(pl) {
                used.insert(memory_slice_counter(s), counter(1));
            }
            used.insert(
                COMPUTE_SLICES_COUNTER.to_owned(),
                counter(i64::from(p.slice_count)),
            );
            if limited.iter().any(|l| l.id == p.id) {
                used.insert(instances_counter(&p.name), counter(1));
            }
            let consumption = DeviceCounterConsumption {
                counter_set: set.clone(),
                counters: used,
            };
            if let Some(d) = mig_device(inv, gpu, p, pl, None, Some(consumption)) {
                devices.push(d);
            }
        }
    }
    DeviceGroup {
        counter_sets,
        devices,
    }
}

fn static_mig_devices(
    inv: &NodeInventory,
    gpu: &GpuInfo,
    profiles: &[MigProfile],
    instances: &[MigInstance],
) -> Vec<Device> {
    let mut ordered: Vec<&MigProfile> = profiles.iter().collect();
    order_profiles(&mut ordered);
    let rank = |id: u32| {
        ordered
            .iter()
            .position(|p| p.id == id)
            .unwrap_or(usize::MAX)
    };
    let mut insts: Vec<&MigInstance> = instances.iter().collect();
    insts.sort_by(|a, b| {
        rank(a.profile_id)
            .cmp(&rank(b.profile_id))
            .then(b.placement.start.cmp(&a.placement.start))
            .then(a.uuid.cmp(&b.uuid))
    });
    let mut names = BTreeSet::new();
    let mut out = Vec::new();
    for inst in insts {
        let Some(profile) = profiles.iter().find(|p| p.id == inst.profile_id) else {
            tracing::warn!(
                gpu = %gpu.uuid,
                mig = %inst.uuid,
                profile_id = inst.profile_id,
                "MIG instance of an unknown profile is not published"
            );
            continue;
        };
        let Some(d) = mig_device(inv, gpu, profile, inst.placement, Some(inst), None) else {
            continue;
        };
        // Several compute instances in one GPU instance share its placement (and name).
        if !names.insert(d.name.clone()) {
            tracing::warn!(
                gpu = %gpu.uuid,
                mig = %inst.uuid,
                device = %d.name,
                "more than one MIG device in one GPU instance; publishing only the first"
            );
            continue;
        }
        out.push(d);
    }
    out
}

/// Memory slices a placement covers.
fn slices(p: Placement) -> std::ops::Range<u32> {
    p.start..p.start.saturating_add(p.size)
}

fn counter(value: i64) -> Counter {
    Counter {
        value: Quantity(value.to_string()),
    }
}

/// Attributes every device of a GPU carries (the GPU's own, or a MIG device's parent's).
/// Bytes of an attribute's string or version value, what the API server limits (0 for
/// other values).
fn attribute_value_len(v: &DeviceAttribute) -> usize {
    v.string
        .as_deref()
        .or(v.version.as_deref())
        .map_or(0, str::len)
}

fn common_attributes(inv: &NodeInventory, gpu: &GpuInfo) -> Vec<(&'static str, DeviceAttribute)> {
    let mut a = vec![
        (attr::PRODUCT_NAME, string(&gpu.product_name)),
        (attr::BRAND, string(&gpu.brand)),
        (attr::ARCHITECTURE, string(&gpu.architecture)),
        (
            attr::CUDA_COMPUTE_CAPABILITY,
            version(&format!(
                "{}.{}.0",
                gpu.cuda_compute_capability.0, gpu.cuda_compute_capability.1
            )),
        ),
        (attr::DRIVER_VERSION, version(&inv.driver_semver)),
        (attr::CUDA_DRIVER_VERSION, version(&inv.cuda_driver_semver)),
        (attr::PCI_BUS_ID, string(&gpu.pci_bus_id)),
    ];
    if let Some(root) = &gpu.pcie_root {
        a.push((attr::PCIE_ROOT, string(root)));
    }
    // Scalar form only (KEP-6072); unknown (`-1` in sysfs) is left out, never published as 0.
    if let Some(node) = gpu.numa_node {
        a.push((attr::NUMA_NODE, int(node)));
    }
    a
}

fn whole_gpu_device(
    inv: &NodeInventory,
    gpu: &GpuInfo,
    consumption: Option<DeviceCounterConsumption>,
) -> Device {
    let mut attrs = vec![
        (attr::TYPE, string(device_type::GPU)),
        (attr::UUID, string(&gpu.uuid)),
        (attr::MIG_CAPABLE, boolean(gpu.mig.is_capable())),
    ];
    attrs.extend(common_attributes(inv, gpu));
    let mut caps = vec![(cap::MEMORY, bytes_quantity(gpu.memory_bytes))];
    if let Some(sm) = gpu.multiprocessors {
        caps.push((cap::MULTIPROCESSORS, count_quantity(u64::from(sm))));
    }
    device(
        DeviceName::gpu(gpu.minor).to_string(),
        attrs,
        caps,
        consumption,
    )
}

fn mig_device(
    inv: &NodeInventory,
    gpu: &GpuInfo,
    profile: &MigProfile,
    placement: Placement,
    instance: Option<&MigInstance>,
    consumption: Option<DeviceCounterConsumption>,
) -> Option<Device> {
    let name = DeviceName::mig(gpu.minor, &profile.name, placement.start).to_string();
    if let Err(error) = name.parse::<DeviceName>() {
        tracing::warn!(
            gpu = %gpu.uuid,
            profile = %profile.name,
            %error,
            "MIG profile has no valid device name; not published"
        );
        return None;
    }
    let mut attrs = vec![(attr::TYPE, string(device_type::MIG))];
    if let Some(inst) = instance {
        attrs.push((attr::UUID, string(&inst.uuid)));
    }
    attrs.extend([
        (attr::PARENT_UUID, string(&gpu.uuid)),
        (attr::PROFILE, string(&profile.name)),
        (attr::PLACEMENT_START, int(placement.start)),
        (attr::PLACEMENT_SIZE, int(placement.size)),
    ]);
    attrs.extend(common_attributes(inv, gpu));
    let caps = vec![
        (
            cap::MEMORY,
            bytes_quantity(profile.memory_mib.saturating_mul(1 << 20)),
        ),
        (
            cap::MULTIPROCESSORS,
            count_quantity(u64::from(profile.multiprocessors)),
        ),
        (
            cap::COPY_ENGINES,
            count_quantity(u64::from(profile.copy_engines)),
        ),
        (cap::DECODERS, count_quantity(u64::from(profile.decoders))),
        (cap::ENCODERS, count_quantity(u64::from(profile.encoders))),
        (
            cap::JPEG_ENGINES,
            count_quantity(u64::from(profile.jpeg_engines)),
        ),
        (
            cap::OFA_ENGINES,
            count_quantity(u64::from(profile.ofa_engines)),
        ),
    ];
    Some(device(name, attrs, caps, consumption))
}

fn device(
    name: String,
    attrs: Vec<(&'static str, DeviceAttribute)>,
    caps: Vec<(&'static str, Quantity)>,
    consumption: Option<DeviceCounterConsumption>,
) -> Device {
    let mut attributes = BTreeMap::new();
    for (k, v) in attrs {
        let len = attribute_value_len(&v);
        if len > limits::MAX_ATTRIBUTE_VALUE_LENGTH {
            // The API server would reject the whole slice; drop the one value instead.
            tracing::warn!(device = %name, attribute = k, len, "attribute value too long; not published");
            continue;
        }
        attributes.insert(k.to_owned(), v);
    }
    let capacity = caps
        .into_iter()
        .map(|(k, value)| {
            (
                k.to_owned(),
                DeviceCapacity {
                    value,
                    ..Default::default()
                },
            )
        })
        .collect();
    Device {
        name,
        attributes: Some(attributes),
        capacity: Some(capacity),
        consumes_counters: consumption.map(|c| vec![c]),
        ..Default::default()
    }
}

fn string(s: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.to_owned()),
        ..Default::default()
    }
}

fn version(s: &str) -> DeviceAttribute {
    DeviceAttribute {
        version: Some(s.to_owned()),
        ..Default::default()
    }
}

fn int(v: u32) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(i64::from(v)),
        ..Default::default()
    }
}

fn boolean(v: bool) -> DeviceAttribute {
    DeviceAttribute {
        bool: Some(v),
        ..Default::default()
    }
}

/// A byte count in the canonical form the API server writes back (binary suffix with the
/// largest exact power of 1024: `85520809984` -> `81559Mi`, `42949672960` -> `40Gi`), so
/// that re-reading a published slice never looks like a change.
pub(crate) fn bytes_quantity(bytes: u64) -> Quantity {
    if bytes < 1024 {
        return count_quantity(bytes);
    }
    const SUFFIXES: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    let mut v = bytes;
    let mut e = 0;
    while e < SUFFIXES.len() - 1 && v.is_multiple_of(1024) {
        v /= 1024;
        e += 1;
    }
    Quantity(format!("{v}{}", SUFFIXES[e]))
}

/// A count in canonical decimal form (`132`, `1k` for 1000).
pub(crate) fn count_quantity(n: u64) -> Quantity {
    const SUFFIXES: [&str; 7] = ["", "k", "M", "G", "T", "P", "E"];
    let mut v = n;
    let mut e = 0;
    while v != 0 && e < SUFFIXES.len() - 1 && v.is_multiple_of(1000) {
        v /= 1000;
        e += 1;
    }
    Quantity(format!("{v}{}", SUFFIXES[e]))
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::prepare::testing::{h100_gpu, h100_profiles};

    /// GPU `minor` of an HGX H100 board as its tests see it (bus 53, root complex
    /// pci0000:50, NUMA node 1).
    fn h100(minor: u32, mig: MigState) -> GpuInfo {
        GpuInfo {
            uuid: format!("GPU-00000000-0000-0000-0000-00000000000{minor}"),
            pci_bus_id: "0000:53:00.0".into(),
            pcie_root: Some("pci0000:50".into()),
            numa_node: Some(1),
            ..h100_gpu(minor, mig)
        }
    }

    #[test]
    fn gpus_that_publish_nothing_are_named_with_the_reason() {
        let on = |instances| MigState::Enabled {
            profiles: h100_profiles(),
            instances,
            memory_slices: 8,
        };
        let node = inv(vec![
            h100(0, on(Vec::new())),
            h100(1, MigState::NotCapable),
            h100(
                2,
                MigState::Enabled {
                    profiles: Vec::new(),
                    instances: Vec::new(),
                    memory_slices: 0,
                },
            ),
        ]);
        let silent = silent_gpus(&node, &PoolOptions::default());
        let names: Vec<(&str, SilentReason)> =
            silent.iter().map(|s| (s.name.as_str(), s.reason)).collect();
        assert_eq!(
            names,
            [
                ("gpu-0", SilentReason::MigWithoutInstances),
                ("gpu-2", SilentReason::MigWithoutProfiles)
            ]
        );
        assert!(
            SilentReason::MigWithoutInstances
                .to_string()
                .contains("--dynamic-mig")
        );
        // On-demand MIG publishes placements: gpu-0 is not silent then.
        let dynamic = PoolOptions {
            dynamic_mig: true,
            ..PoolOptions::default()
        };
        assert!(
            silent_gpus(&node, &dynamic)
                .iter()
                .all(|s| s.name != "gpu-0")
        );
        // And a MIG-enabled GPU whose profiles are unreadable is not offered as MIG-capable.
        assert!(!node.gpus[2].mig.is_capable());
        assert!(node.gpus[0].mig.is_capable());
    }

    fn inv(gpus: Vec<GpuInfo>) -> NodeInventory {
        NodeInventory {
            driver_version: "580.105.08".into(),
            driver_semver: "580.105.8".into(),
            cuda_driver_semver: "13.0.0".into(),
            gpus,
        }
    }

    fn enabled(instances: Vec<MigInstance>) -> MigState {
        MigState::Enabled {
            profiles: h100_profiles(),
            instances,
            memory_slices: 8,
        }
    }

    fn on_demand() -> PoolOptions {
        PoolOptions {
            dynamic_mig: true,
            ..Default::default()
        }
    }

    fn instance(uuid: &str, profile_id: u32, name: &str, start: u32, size: u32) -> MigInstance {
        MigInstance {
            uuid: uuid.into(),
            profile_id,
            profile_name: name.into(),
            gi_id: start + 1,
            ci_id: 0,
            placement: Placement { start, size },
        }
    }

    fn attr_of<'a>(d: &'a Device, k: &str) -> &'a DeviceAttribute {
        d.attributes
            .as_ref()
            .unwrap()
            .get(k)
            .unwrap_or_else(|| panic!("{} lacks {k}", d.name))
    }

    fn cap_of(d: &Device, k: &str) -> String {
        d.capacity.as_ref().unwrap()[k].value.0.clone()
    }

    fn consumed(d: &Device) -> BTreeMap<String, String> {
        d.consumes_counters.as_ref().unwrap()[0]
            .counters
            .iter()
            .map(|(k, v)| (k.clone(), v.value.0.clone()))
            .collect()
    }

    fn shared(mode: ConsumableCapacity, dynamic_mig: bool) -> PoolOptions {
        PoolOptions {
            dynamic_mig,
            consumable_capacity: mode,
            ..Default::default()
        }
    }

    fn range_of(d: &Device, k: &str) -> (String, String, String, String) {
        let p = d.capacity.as_ref().unwrap()[k]
            .request_policy
            .clone()
            .unwrap();
        let r = p.valid_range.unwrap();
        let q = |q: Option<Quantity>| q.map_or_else(|| "-".into(), |q| q.0);
        (q(p.default), r.min.0, q(r.max), q(r.step))
    }

    #[test]
    fn shared_whole_gpu_defaults_to_the_whole_device() {
        let off = build_pool(
            &inv(vec![h100(0, MigState::NotCapable)]),
            &PoolOptions::default(),
        );
        for mode in [ConsumableCapacity::Mps, ConsumableCapacity::TimeSlicing] {
            let pool = build_pool(
                &inv(vec![h100(0, MigState::NotCapable)]),
                &shared(mode, false),
            );
            let d = &pool.groups[0].devices[0];
            assert_eq!(d.allow_multiple_allocations, Some(true));
            // The capacities themselves are unchanged; the policy default is all of each.
            assert_eq!(cap_of(d, "memory"), "81559Mi");
            assert_eq!(
                range_of(d, "memory"),
                (
                    "81559Mi".into(),
                    "1Mi".into(),
                    "81559Mi".into(),
                    "1Mi".into()
                )
            );
            assert_eq!(
                range_of(d, "multiprocessors"),
                ("132".into(), "1".into(), "132".into(), "1".into())
            );
            // Nothing else differs from the unshared device.
            let mut plain = d.clone();
            plain.allow_multiple_allocations = None;
            for c in plain.capacity.as_mut().unwrap().values_mut() {
                c.request_policy = None;
            }
            assert_eq!(plain, off.groups[0].devices[0]);
            assert!(
                limit_violations(&pool).is_empty(),
                "{:?}",
                limit_violations(&pool)
            );
        }
        // Off publishes no policy at all.
        let d = &off.groups[0].devices[0];
        assert_eq!(d.allow_multiple_allocations, None);
        assert!(
            d.capacity
                .as_ref()
                .unwrap()
                .values()
                .all(|c| c.request_policy.is_none())
        );
    }

    #[test]
    fn shared_memory_is_rounded_down_to_the_step() {
        let mut gpu = h100(0, MigState::NotCapable);
        // 40 GiB and a half MiB: the default and max drop the half MiB.
        gpu.memory_bytes = (40 << 30) + (1 << 19);
        let pool = build_pool(&inv(vec![gpu]), &shared(ConsumableCapacity::Mps, false));
        let d = &pool.groups[0].devices[0];
        assert_eq!(cap_of(d, "memory"), "41943552Ki");
        let (default, min, max, step) = range_of(d, "memory");
        assert_eq!((default.as_str(), max.as_str()), ("40Gi", "40Gi"));
        assert_eq!((min.as_str(), step.as_str()), ("1Mi", "1Mi"));
    }

    #[test]
    fn on_demand_mig_devices_are_shareable_only_when_asked() {
        // By default devices that consume counters stay exclusive under consumable capacity
        // (the upstream allocator's backtracking keeps a shareable device's counters).
        let pool = build_pool(
            &inv(vec![h100(0, enabled(vec![]))]),
            &shared(ConsumableCapacity::Mps, true),
        );
        for d in &pool.groups[0].devices {
            assert!(d.consumes_counters.is_some(), "{}", d.name);
            assert_eq!(d.allow_multiple_allocations, None, "{}", d.name);
        }
        // Non-MIG GPUs beside them are shareable.
        let pool = build_pool(
            &inv(vec![
                h100(0, enabled(vec![])),
                h100(
                    1,
                    MigState::Disabled {
                        profiles: h100_profiles(),
                    },
                ),
            ]),
            &shared(ConsumableCapacity::Mps, true),
        );
        let whole = pool.groups[1]
            .devices
            .iter()
            .find(|d| d.name == "gpu-1")
            .unwrap();
        assert_eq!(whole.allow_multiple_allocations, Some(true));
    }

    #[test]
    fn shared_mig_devices_keep_counters_and_share_no_engines() {
        let pool = build_pool(
            &inv(vec![h100(0, enabled(vec![]))]),
            &PoolOptions {
                share_on_demand_mig: true,
                ..shared(ConsumableCapacity::Mps, true)
            },
        );
        let g = &pool.groups[0];
        assert_eq!(g.devices.len(), 26);
        for d in &g.devices {
            assert_eq!(d.allow_multiple_allocations, Some(true), "{}", d.name);
            assert!(d.consumes_counters.is_some(), "{}", d.name);
            let (default, _, max, _) = range_of(d, "memory");
            assert_eq!(default, max, "{}", d.name);
            assert_eq!(default, cap_of(d, "memory"), "{}", d.name);
        }
        let mig = g
            .devices
            .iter()
            .find(|d| d.name == "gpu-0-mig-3g40gb-4")
            .unwrap();
        assert_eq!(range_of(mig, "multiprocessors").0, "60");
        assert_eq!(
            range_of(mig, "copyEngines"),
            ("0".into(), "0".into(), "-".into(), "-".into())
        );
        assert!(
            limit_violations(&pool).is_empty(),
            "{:?}",
            limit_violations(&pool)
        );
    }

    #[test]
    fn whole_h100_has_exact_attributes_and_capacities() {
        let pool = build_pool(
            &inv(vec![h100(
                0,
                MigState::Disabled {
                    profiles: h100_profiles(),
                },
            )]),
            &PoolOptions::default(),
        );
        assert_eq!(pool.groups.len(), 1);
        assert!(pool.groups[0].counter_sets.is_empty());
        let d = &pool.groups[0].devices[0];
        assert_eq!(d.name, "gpu-0");
        let s = |v: &str| string(v);
        let expected: BTreeMap<String, DeviceAttribute> = [
            ("type", s("gpu")),
            ("uuid", s("GPU-00000000-0000-0000-0000-000000000000")),
            ("migCapable", boolean(true)),
            ("productName", s("NVIDIA H100 80GB HBM3")),
            ("brand", s("Nvidia")),
            ("architecture", s("Hopper")),
            ("cudaComputeCapability", version("9.0.0")),
            ("driverVersion", version("580.105.8")),
            ("cudaDriverVersion", version("13.0.0")),
            ("resource.kubernetes.io/pciBusID", s("0000:53:00.0")),
            ("resource.kubernetes.io/pcieRoot", s("pci0000:50")),
            ("resource.kubernetes.io/numaNode", int(1)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        assert_eq!(d.attributes.as_ref().unwrap(), &expected);
        let caps: BTreeMap<String, String> = d
            .capacity
            .as_ref()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.value.0.clone()))
            .collect();
        assert_eq!(
            caps,
            BTreeMap::from([
                ("memory".to_owned(), "81559Mi".to_owned()),
                ("multiprocessors".to_owned(), "132".to_owned()),
            ])
        );
        assert!(d.consumes_counters.is_none());
        assert!(limit_violations(&pool).is_empty());
    }

    #[test]
    fn not_capable_gpu_without_pcie_root_or_sms() {
        let mut g = h100(3, MigState::NotCapable);
        g.pcie_root = None;
        g.numa_node = None;
        g.multiprocessors = None;
        let pool = build_pool(&inv(vec![g]), &on_demand());
        let d = &pool.groups[0].devices[0];
        assert_eq!(d.name, "gpu-3");
        assert_eq!(attr_of(d, "migCapable").bool, Some(false));
        assert!(!d.attributes.as_ref().unwrap().contains_key(attr::PCIE_ROOT));
        // sysfs said -1 (or nothing): no numaNode, never a 0 that would match other devices.
        assert!(!d.attributes.as_ref().unwrap().contains_key(attr::NUMA_NODE));
        assert!(
            !d.capacity
                .as_ref()
                .unwrap()
                .contains_key(cap::MULTIPROCESSORS)
        );
        assert!(pool.groups[0].counter_sets.is_empty());
    }

    #[test]
    fn on_demand_publishes_every_placement_plus_whole_gpu() {
        let pool = build_pool(&inv(vec![h100(0, enabled(vec![]))]), &on_demand());
        let g = &pool.groups[0];
        assert_eq!(g.devices.len(), 26);
        // Every MIG placement carries its GPU's NUMA node.
        assert!(
            g.devices
                .iter()
                .all(|d| attr_of(d, attr::NUMA_NODE).int == Some(1))
        );
        let count = |label: &str| {
            g.devices
                .iter()
                .filter(|d| d.name.starts_with(&format!("gpu-0-mig-{label}-")))
                .count()
        };
        assert_eq!(count("1g10gb"), 7);
        assert_eq!(count("1g10gbme"), 7);
        assert_eq!(count("1g20gb"), 4);
        assert_eq!(count("2g20gb"), 3);
        assert_eq!(count("3g40gb"), 2);
        assert_eq!(count("4g40gb"), 1);
        assert_eq!(count("7g80gb"), 1);
        // Order: whole GPU, then smaller profiles first, placements in the default order
        // (small ones from the bottom, then the top slot; 3g at 4 before 3g at 0).
        let names: Vec<&str> = g.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            &names[..9],
            [
                "gpu-0",
                "gpu-0-mig-1g10gb-0",
                "gpu-0-mig-1g10gb-1",
                "gpu-0-mig-1g10gb-2",
                "gpu-0-mig-1g10gb-3",
                "gpu-0-mig-1g10gb-6",
                "gpu-0-mig-1g10gb-4",
                "gpu-0-mig-1g10gb-5",
                "gpu-0-mig-1g10gbme-0",
            ]
        );
        assert_eq!(
            &names[19..],
            [
                "gpu-0-mig-2g20gb-0",
                "gpu-0-mig-2g20gb-2",
                "gpu-0-mig-2g20gb-4",
                "gpu-0-mig-3g40gb-4",
                "gpu-0-mig-3g40gb-0",
                "gpu-0-mig-4g40gb-0",
                "gpu-0-mig-7g80gb-0",
            ]
        );
        // A request that selects by capacity (memory >= 20Gi) gets the smallest fit: the
        // first such device in publish order is a 3g (1g.20gb and 2g.20gb have 19.6Gi).
        let first_20gi = g.devices[1..]
            .iter()
            .find(|d| {
                let q = cleave_api::quantity::Quantity::parse(&cap_of(d, "memory")).unwrap();
                q.value() >= 20 << 30
            })
            .unwrap();
        assert_eq!(first_20gi.name, "gpu-0-mig-3g40gb-4");
        for d in &g.devices {
            let parsed: DeviceName = d.name.parse().unwrap();
            assert_eq!(parsed.minor(), 0);
            assert_eq!(parsed.is_mig(), d.name != "gpu-0");
            assert_eq!(
                d.consumes_counters.as_ref().unwrap()[0].counter_set,
                "gpu-0-counters"
            );
        }
        let set = &g.counter_sets[0];
        assert_eq!(set.name, "gpu-0-counters");
        let keys: Vec<&str> = set.counters.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "compute-slices",
                "instances-1g10gbme",
                "memory-slice-0",
                "memory-slice-1",
                "memory-slice-2",
                "memory-slice-3",
                "memory-slice-4",
                "memory-slice-5",
                "memory-slice-6",
                "memory-slice-7",
            ]
        );
        assert_eq!(set.counters["compute-slices"].value.0, "7");
        assert_eq!(set.counters["instances-1g10gbme"].value.0, "1");
        assert!(
            limit_violations(&pool).is_empty(),
            "{:?}",
            limit_violations(&pool)
        );
    }

    #[test]
    fn mig_device_attributes_and_capacities() {
        let pool = build_pool(&inv(vec![h100(0, enabled(vec![]))]), &on_demand());
        let d = pool
            .devices()
            .find(|d| d.name == "gpu-0-mig-1g10gbme-6")
            .unwrap();
        assert_eq!(attr_of(d, "type").string.as_deref(), Some("mig"));
        assert_eq!(attr_of(d, "profile").string.as_deref(), Some("1g.10gb+me"));
        assert_eq!(attr_of(d, "placementStart").int, Some(6));
        assert_eq!(attr_of(d, "placementSize").int, Some(1));
        assert_eq!(
            attr_of(d, "parentUUID").string.as_deref(),
            Some("GPU-00000000-0000-0000-0000-000000000000")
        );
        // An on-demand placement has no UUID yet.
        assert!(!d.attributes.as_ref().unwrap().contains_key(attr::UUID));
        assert_eq!(cap_of(d, "memory"), "9984Mi");
        assert_eq!(cap_of(d, "multiprocessors"), "16");
        assert_eq!(cap_of(d, "ofaEngines"), "1");
        assert_eq!(cap_of(d, "copyEngines"), "1");
        assert_eq!(
            consumed(d),
            BTreeMap::from([
                ("compute-slices".to_owned(), "1".to_owned()),
                ("instances-1g10gbme".to_owned(), "1".to_owned()),
                ("memory-slice-6".to_owned(), "1".to_owned()),
            ])
        );
        let seven = pool
            .devices()
            .find(|d| d.name == "gpu-0-mig-7g80gb-0")
            .unwrap();
        assert_eq!(cap_of(seven, "memory"), "81152Mi");
        assert_eq!(consumed(seven).len(), 9);
    }

    #[test]
    fn overlapping_placements_share_counters() {
        let pool = build_pool(&inv(vec![h100(0, enabled(vec![]))]), &on_demand());
        let mem = |name: &str| -> BTreeSet<String> {
            let d = pool.devices().find(|d| d.name == name).unwrap();
            consumed(d)
                .into_keys()
                .filter(|k| k.starts_with("memory-slice-"))
                .collect()
        };
        let three = mem("gpu-0-mig-3g40gb-4");
        let two = mem("gpu-0-mig-2g20gb-4");
        let one = mem("gpu-0-mig-1g10gb-3");
        let whole = mem("gpu-0");
        assert!(!three.is_disjoint(&two));
        assert!(three.is_disjoint(&one));
        assert!(whole.is_superset(&three) && whole.len() == 8);
        // Every pair of placements overlaps exactly when their memory counters intersect.
        let devs: Vec<&Device> = pool
            .devices()
            .filter(|d| d.name.contains("-mig-"))
            .collect();
        for a in &devs {
            for b in &devs {
                let pa = Placement {
                    start: attr_of(a, "placementStart").int.unwrap() as u32,
                    size: attr_of(a, "placementSize").int.unwrap() as u32,
                };
                let pb = Placement {
                    start: attr_of(b, "placementStart").int.unwrap() as u32,
                    size: attr_of(b, "placementSize").int.unwrap() as u32,
                };
                assert_eq!(
                    pa.overlaps(&pb),
                    !mem(&a.name).is_disjoint(&mem(&b.name)),
                    "{} vs {}",
                    a.name,
                    b.name
                );
            }
        }
    }

    #[test]
    fn a_bare_gpu_instance_is_published_as_taken() {
        let node = inv(vec![h100(0, enabled(vec![]))]);
        let uuid = node.gpus[0].uuid.clone();
        let mut opts = on_demand();
        opts.bare_gpu_instances.insert(
            uuid,
            vec![BareGpuInstance {
                gi_id: 2,
                profile_id: 9,
                placement: Placement { start: 4, size: 4 },
            }],
        );
        let pool = build_pool(&node, &opts);
        let set = &pool.groups[0].counter_sets[0].counters;
        for i in 0..8 {
            let expected = if i >= 4 { "0" } else { "1" };
            assert_eq!(
                set[&format!("memory-slice-{i}")].value.0,
                expected,
                "slice {i}"
            );
        }
        assert_eq!(set["compute-slices"].value.0, "4");
        assert!(limit_violations(&pool).is_empty());
        // Without it, the same GPU is all free.
        let free = build_pool(&node, &on_demand());
        let set = &free.groups[0].counter_sets[0].counters;
        assert_eq!(set["memory-slice-4"].value.0, "1");
        assert_eq!(set["compute-slices"].value.0, "7");
    }

    #[test]
    fn foreign_instance_takes_its_slices_owned_keeps_them() {
        let foreign = instance("MIG-foreign", 9, "3g.40gb", 4, 4);
        let owned = instance("MIG-owned", 14, "2g.20gb", 0, 2);
        let mut opts = on_demand();
        opts.owned_instances.insert("MIG-owned".into());
        let pool = build_pool(&inv(vec![h100(0, enabled(vec![foreign, owned]))]), &opts);
        let set = &pool.groups[0].counter_sets[0].counters;
        for i in 0..8 {
            let expected = if i >= 4 { "0" } else { "1" };
            assert_eq!(
                set[&format!("memory-slice-{i}")].value.0,
                expected,
                "slice {i}"
            );
        }
        assert_eq!(set["compute-slices"].value.0, "4");
        // Devices stay published (stable list); the counters make the taken ones unallocatable.
        assert_eq!(pool.device_count(), 26);
        assert!(limit_violations(&pool).is_empty());

        // A foreign +me instance uses up the +me instance limit.
        let me = instance("MIG-me", 20, "1g.10gb+me", 0, 1);
        let pool = build_pool(&inv(vec![h100(0, enabled(vec![me]))]), &on_demand());
        let set = &pool.groups[0].counter_sets[0].counters;
        assert_eq!(set["instances-1g10gbme"].value.0, "0");
        assert_eq!(set["memory-slice-0"].value.0, "0");
        assert_eq!(set["compute-slices"].value.0, "6");
    }

    #[test]
    fn static_mode_publishes_existing_instances_only() {
        let insts = vec![
            instance("MIG-a", 19, "1g.10gb", 6, 1),
            instance("MIG-b", 9, "3g.40gb", 0, 4),
            instance("MIG-c", 19, "1g.10gb", 5, 1),
        ];
        let pool = build_pool(&inv(vec![h100(2, enabled(insts))]), &PoolOptions::default());
        let names: Vec<&str> = pool.devices().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "gpu-2-mig-1g10gb-6",
                "gpu-2-mig-1g10gb-5",
                "gpu-2-mig-3g40gb-0"
            ]
        );
        let d = pool.devices().nth(2).unwrap();
        assert_eq!(attr_of(d, "uuid").string.as_deref(), Some("MIG-b"));
        assert!(d.consumes_counters.is_none());
        assert!(pool.groups[0].counter_sets.is_empty());
        assert!(limit_violations(&pool).is_empty());
    }

    #[test]
    fn eight_gpus_in_groups_by_minor() {
        let gpus = (0..8).rev().map(|m| h100(m, enabled(vec![]))).collect();
        let pool = build_pool(&inv(gpus), &on_demand());
        assert_eq!(pool.groups.len(), 8);
        assert_eq!(pool.device_count(), 8 * 26);
        for (i, g) in pool.groups.iter().enumerate() {
            assert_eq!(g.devices[0].name, format!("gpu-{i}"));
            assert_eq!(g.counter_sets[0].name, format!("gpu-{i}-counters"));
        }
        assert!(limit_violations(&pool).is_empty());
        // Deterministic.
        let again = build_pool(
            &inv((0..8).map(|m| h100(m, enabled(vec![]))).collect()),
            &on_demand(),
        );
        assert_eq!(pool, again);
    }

    #[test]
    fn unnameable_profiles_are_skipped_and_long_values_dropped() {
        let mut profiles = h100_profiles();
        // A profile no name rule covers (an unknown `-me` variant at slice 0).
        profiles.push(MigProfile {
            id: 67,
            name: "1g.10gb-me".into(),
            decoders: 0,
            jpeg_engines: 0,
            placements: vec![Placement { start: 0, size: 1 }],
            ..profiles[0].clone()
        });
        let mut g = h100(
            0,
            MigState::Enabled {
                profiles,
                instances: vec![],
                memory_slices: 8,
            },
        );
        g.product_name = "x".repeat(65);
        let pool = build_pool(&inv(vec![g]), &on_demand());
        assert_eq!(pool.device_count(), 26);
        assert!(pool.devices().all(|d| {
            !d.attributes
                .as_ref()
                .unwrap()
                .contains_key(attr::PRODUCT_NAME)
        }));
        assert!(limit_violations(&pool).is_empty());
    }

    #[test]
    fn limit_violations_catches_breakage() {
        let mut pool = build_pool(&inv(vec![h100(0, enabled(vec![]))]), &on_demand());
        pool.groups[0].devices[1].name = "gpu-0".into();
        pool.groups[0].counter_sets[0]
            .counters
            .remove("compute-slices");
        let v = limit_violations(&pool);
        assert!(v.iter().any(|m| m.contains("duplicate")), "{v:?}");
        assert!(v.iter().any(|m| m.contains("compute-slices")), "{v:?}");
    }

    proptest::proptest! {
        /// Any non-overlapping mix of foreign and owned instances: limits hold, every
        /// device stays published, and exactly the foreign instances' slices are taken.
        #[test]
        fn random_instance_mixes(picks in proptest::collection::vec((0usize..7, 0usize..7, proptest::bool::ANY), 0..10)) {
            let profiles = h100_profiles();
            let mut insts: Vec<MigInstance> = Vec::new();
            let mut owned = BTreeSet::new();
            for (n, (pi, si, own)) in picks.into_iter().enumerate() {
                let p = &profiles[pi];
                let pl = p.placements[si % p.placements.len()];
                let same = insts.iter().filter(|i| i.profile_id == p.id).count();
                if insts.iter().any(|i| i.placement.overlaps(&pl)) || same >= p.instance_count as usize {
                    continue;
                }
                let uuid = format!("MIG-{n}");
                if own {
                    owned.insert(uuid.clone());
                }
                insts.push(instance(&uuid, p.id, &p.name, pl.start, pl.size));
            }
            let opts = PoolOptions { dynamic_mig: true, owned_instances: owned.clone(), ..PoolOptions::default() };
            let pool = build_pool(&inv(vec![h100(0, enabled(insts.clone()))]), &opts);
            proptest::prop_assert!(limit_violations(&pool).is_empty());
            proptest::prop_assert_eq!(pool.device_count(), 26);
            let set = &pool.groups[0].counter_sets[0].counters;
            let foreign: Vec<&MigInstance> = insts.iter().filter(|i| !owned.contains(&i.uuid)).collect();
            for s in 0..8u32 {
                let taken = foreign.iter().any(|i| slices(i.placement).contains(&s));
                let v = &set[&memory_slice_counter(s)].value.0;
                proptest::prop_assert_eq!(v.as_str(), if taken { "0" } else { "1" });
            }
            let used: u32 = foreign
                .iter()
                .map(|i| profiles.iter().find(|p| p.id == i.profile_id).unwrap().slice_count)
                .sum();
            proptest::prop_assert_eq!(&set[COMPUTE_SLICES_COUNTER].value.0, &(7 - used).to_string());
            // Static mode publishes every instance once.
            let stat = build_pool(&inv(vec![h100(0, enabled(insts.clone()))]), &PoolOptions::default());
            proptest::prop_assert_eq!(stat.device_count(), insts.len());
            proptest::prop_assert!(limit_violations(&stat).is_empty());
        }
    }

    #[test]
    fn quantities_are_canonical() {
        assert_eq!(bytes_quantity(81559 << 20).0, "81559Mi");
        assert_eq!(bytes_quantity(40 << 30).0, "40Gi");
        assert_eq!(bytes_quantity(1536).0, "1536");
        assert_eq!(bytes_quantity(1023).0, "1023");
        assert_eq!(bytes_quantity(2048).0, "2Ki");
        assert_eq!(count_quantity(132).0, "132");
        assert_eq!(count_quantity(0).0, "0");
        assert_eq!(count_quantity(1000).0, "1k");
    }
}
