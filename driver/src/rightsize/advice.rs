//! A recommendation per claim device from its usage window: the smallest shape that would
//! have held what it used, with headroom, among the shapes this node can serve.
//!
//! Shapes, from the GPU's own MIG profile table ([`MigState`] of the device's GPU, so only
//! profiles of the same product): a MIG profile, a capacity share (`memory` in 1 MiB steps,
//! `multiprocessors` in steps of 1, as published), or a whole GPU. What a claim needs is
//! `peak memory x (1 + headroom)` and `p95 SM activity x SMs x (1 + headroom)`, rounded up.
//! Which shape comes first depends on what the claim holds: a whole GPU or MIG device is
//! offered MIG profiles first (hardware isolation, like what it had), then a share, then a
//! whole GPU; an MPS claim or a share is offered a share first. Profiles with media
//! extensions (`+me`) are never offered (one per GPU; a claim that needs the engines asks
//! for them by name). A whole-GPU claim is never offered the GPU-sized profile.
//!
//! A shape the node's mode cannot serve is not recommended; the recommendation names it and
//! what the node would need, and falls back to the next shape the node serves.

use std::fmt::Write as _;

use cleave_api::pool::ConsumableCapacity;

use crate::model::{GpuInfo, MigProfile, MigState, NodeInventory};
use crate::pool::MEMORY_STEP_BYTES;
use crate::usage::{ActivitySource, ClaimDevice, Holding};

use super::window::{BUCKETS, MIN_SEEN_BUCKETS, WindowStats};

const MIB: u64 = 1 << 20;

/// Default headroom over the peak memory and the p95 SM activity: 20 %.
pub const DEFAULT_HEADROOM: f64 = 0.20;

/// A claim is recommended for release when at least this fraction of its rounds with an
/// activity figure were below the idle threshold (its p95 SM activity is below it).
pub const RELEASE_IDLE_FRACTION: f64 = 0.95;

/// What the node serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeModes {
    /// On-demand MIG (`--dynamic-mig`).
    pub dynamic_mig: bool,
    /// Capacity sharing (`--consumable-capacity`).
    pub consumable_capacity: ConsumableCapacity,
}

/// How recommendations are made.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RightsizePolicy {
    /// Headroom over peak memory and p95 SMs (0.2 = 20 %).
    pub headroom: f64,
    /// Activity below this (percent) counts as idle.
    pub idle_threshold_percent: f64,
}

impl Default for RightsizePolicy {
    fn default() -> Self {
        Self {
            headroom: DEFAULT_HEADROOM,
            idle_threshold_percent: 5.0,
        }
    }
}

/// A shape a claim could ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shape {
    /// A MIG device of this profile on a GPU of the same product.
    Mig {
        /// Profile name (`1g.10gb`).
        profile: String,
        /// The profile's memory, bytes.
        memory_bytes: u64,
        /// The profile's SMs.
        sms: u32,
    },
    /// A capacity share of a GPU of the same product.
    Share {
        /// `memory` to request, bytes (a whole number of 1 MiB steps).
        memory_bytes: u64,
        /// `multiprocessors` to request.
        sms: u32,
    },
    /// A whole GPU.
    WholeGpu {
        /// The GPU's memory, bytes.
        memory_bytes: u64,
        /// The GPU's SMs, where known.
        sms: Option<u32>,
    },
}

impl Shape {
    /// `mig`, `share` or `gpu` (the `recommendation` label).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Mig { .. } => "mig",
            Self::Share { .. } => "share",
            Self::WholeGpu { .. } => "gpu",
        }
    }

    /// Memory of the shape, bytes.
    pub fn memory_bytes(&self) -> u64 {
        match self {
            Self::Mig { memory_bytes, .. }
            | Self::Share { memory_bytes, .. }
            | Self::WholeGpu { memory_bytes, .. } => *memory_bytes,
        }
    }

    /// SMs of the shape, where known.
    pub fn sms(&self) -> Option<u32> {
        match self {
            Self::Mig { sms, .. } | Self::Share { sms, .. } => Some(*sms),
            Self::WholeGpu { sms, .. } => *sms,
        }
    }

    /// The MIG profile, for MIG shapes.
    pub fn profile(&self) -> Option<&str> {
        match self {
            Self::Mig { profile, .. } => Some(profile),
            _ => None,
        }
    }

    /// Short words: `1g.10gb`, `share of 6.0 GiB and 20 SMs`, `whole GPU`.
    pub fn describe(&self) -> String {
        match self {
            Self::Mig {
                profile,
                memory_bytes,
                sms,
            } => format!("{profile} ({}, {sms} SMs)", gib(*memory_bytes)),
            Self::Share { memory_bytes, sms } => {
                format!(
                    "a share of {} ({} MiB) and {sms} SMs",
                    gib(*memory_bytes),
                    memory_bytes / MIB
                )
            }
            Self::WholeGpu { .. } => "a whole GPU".into(),
        }
    }
}

/// What to do with a claim device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Advice {
    /// Too little of the window seen yet.
    Pending,
    /// Idle: release it.
    Release,
    /// Its usage cannot be attributed to it; nothing is guessed.
    NotAttributable,
    /// Ask for this shape.
    Shape(Shape),
}

impl Advice {
    /// The `recommendation` label: `pending`, `release`, `not_attributable`, `mig`, `share`,
    /// `gpu`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Release => "release",
            Self::NotAttributable => "not_attributable",
            Self::Shape(s) => s.kind(),
        }
    }

    /// The shape, if one is recommended.
    pub fn shape(&self) -> Option<&Shape> {
        match self {
            Self::Shape(s) => Some(s),
            _ => None,
        }
    }
}

/// The recommendation against what the claim holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Less than it holds.
    Smaller,
    /// What it holds.
    Same,
    /// More than it holds (it ran near its limit).
    Larger,
    /// Release it.
    Release,
    /// No recommendation (pending, not attributable).
    Unknown,
}

impl Change {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Smaller => "smaller",
            Self::Same => "same",
            Self::Larger => "larger",
            Self::Release => "release",
            Self::Unknown => "unknown",
        }
    }
}

/// A recommendation for one claim device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recommendation {
    /// What to do.
    pub advice: Advice,
    /// Against what it holds.
    pub change: Change,
    /// False only when no shape that would hold the claim is served by this node; then
    /// `needs` says what the node would need.
    pub served: bool,
    /// The reason, in words, with the figures.
    pub reason: String,
    /// A better shape this node cannot serve and what it would need, if any.
    pub needs: Option<String>,
}

/// `3.8 GiB`.
pub fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn span(seconds: u64) -> String {
    match seconds {
        s if s >= 3600 && s % 3600 == 0 => format!("{}h", s / 3600),
        s if s >= 3600 => format!("{:.1}h", s as f64 / 3600.0),
        s if s >= 60 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

fn sources(st: &WindowStats) -> String {
    let s: Vec<&str> = st
        .sources
        .iter()
        .filter(|s| **s != ActivitySource::GpmSmOccupancy)
        .map(|s| s.as_str())
        .collect();
    if s.is_empty() {
        "no source".into()
    } else {
        s.join(", ")
    }
}

/// The figures of a window in words: `peak 3.8 GiB of 40.0 GiB (p95 3.1 GiB), SM p95 6%
/// mean 2.1% (gpm_sm_activity), idle 40% of 8640 samples over 24h`.
pub fn figures(device: &ClaimDevice, st: &WindowStats) -> String {
    let mut out = String::new();
    match st.peak_memory {
        Some(peak) => {
            let _ = write!(
                out,
                "peak {} of {}",
                gib(peak),
                gib(device.allocated.memory_bytes)
            );
            if let Some(p95) = st.p95_memory {
                let _ = write!(out, " (p95 {})", gib(p95));
            }
        }
        None => out.push_str("memory not measured"),
    }
    match (st.p95_activity, st.mean_activity) {
        (Some(p95), Some(mean)) => {
            let _ = write!(out, ", SM p95 {p95:.0}% mean {mean:.1}% ({})", sources(st));
        }
        _ => out.push_str(", SM activity not measured"),
    }
    if let Some(idle) = st.idle_fraction {
        let _ = write!(out, ", idle {:.0}%", idle * 100.0);
    }
    let _ = write!(
        out,
        " of {} samples over {}",
        st.samples,
        span(st.seen_seconds())
    );
    if st.memory_rising {
        out.push_str("; memory still rising");
    }
    out
}

/// Why a claim device's usage is not attributable to it, for the cases the usage sampler
/// leaves unattributed (`crate::usage`, "Which process is whose" in the usage docs).
fn not_attributable_reason(device: &ClaimDevice, st: &WindowStats) -> String {
    let by_process = matches!(device.kind, Holding::Mps | Holding::Share);
    let what = match device.kind {
        Holding::Share => "a capacity share",
        _ => "an MPS claim",
    };
    if by_process && device.pids.is_empty() && device.pods.is_empty() {
        return format!(
            "not attributable: {what} with no host PID and no consuming pod known on this node, so no GPU process can be tied to it (NVML does not say which claim an MPS client serves)"
        );
    }
    if by_process && device.mig.is_some() {
        return format!(
            "not attributable: {what} on a MIG device; NVML reports no per-process SM utilization on MIG-enabled GPUs, so its activity cannot be told apart (its memory is attributed)"
        );
    }
    if by_process && device.pids.is_empty() && st.memory_not_attributable > 0 {
        return format!(
            "not attributable: {what} known by its pods only, and the plugin could not read the cgroup of any process on the device (it needs the host's PID namespace)"
        );
    }
    if by_process {
        return format!(
            "not attributable: the activity of {what}: NVML's per-process SM samples named only the MPS server, not its MPS clients, or the driver gave no per-process utilization; its memory is attributed"
        );
    }
    "not attributable: NVML gives no figure that belongs to this claim alone".into()
}

/// The GPU a device is on.
fn gpu_of<'a>(inventory: &'a NodeInventory, device: &ClaimDevice) -> Option<&'a GpuInfo> {
    inventory.gpus.iter().find(|g| g.uuid == device.gpu_uuid)
}

fn own_profiles(gpu: &GpuInfo) -> &[MigProfile] {
    match &gpu.mig {
        MigState::Enabled { profiles, .. } | MigState::Disabled { profiles } => profiles,
        MigState::NotCapable => &[],
    }
}

/// The MIG profile table of `gpu`: its own, or where NVML answers none for it (MIG mode
/// off), the table of a GPU of the same product on the node.
pub fn profiles<'a>(inventory: &'a NodeInventory, gpu: &'a GpuInfo) -> &'a [MigProfile] {
    let own = own_profiles(gpu);
    if !own.is_empty() || matches!(gpu.mig, MigState::NotCapable) {
        return own;
    }
    inventory
        .gpus
        .iter()
        .filter(|g| g.product_name == gpu.product_name)
        .map(own_profiles)
        .find(|t| !t.is_empty())
        .unwrap_or(own)
}

/// What the node would need to serve `shape` on a GPU of `product`; `None` when it serves it.
fn unserved(
    shape: &Shape,
    product: &str,
    device: &ClaimDevice,
    inventory: &NodeInventory,
    modes: NodeModes,
) -> Option<String> {
    let of_product = || inventory.gpus.iter().filter(|g| g.product_name == product);
    let mig_on = of_product().any(|g| g.mig.is_enabled());
    let mig_off = of_product().any(|g| !g.mig.is_enabled());
    match shape {
        Shape::Mig { profile, .. } => match (mig_on, modes.dynamic_mig) {
            (true, true) => None,
            (true, false) => Some(format!(
                "on-demand MIG (--dynamic-mig), or an administrator-created {profile} instance"
            )),
            (false, _) => Some(format!(
                "MIG mode on a {product} GPU (an administrator's step) and on-demand MIG (--dynamic-mig), or an administrator-created {profile} instance"
            )),
        },
        Shape::Share { .. } => match (modes.consumable_capacity.is_on(), mig_off) {
            (true, true) => None,
            (false, _) => Some(
                "capacity sharing (--consumable-capacity=mps or time-slicing, and the cluster's DRAConsumableCapacity)".into(),
            ),
            (true, false) => Some(format!("a {product} GPU with MIG mode off")),
        },
        Shape::WholeGpu { .. } => {
            if mig_off || device.kind == Holding::Whole {
                None
            } else {
                Some(format!("a {product} GPU with MIG mode off"))
            }
        }
    }
}

/// What a device needs, from its window with the policy's headroom.
struct Need {
    /// Bytes: the peak with headroom.
    memory: u64,
    /// SMs: the p95 activity with headroom, when there is an activity figure.
    sms: Option<u32>,
    /// SMs no shape may have fewer of (`sms`, else the SMs the device has).
    sms_floor: u32,
}

impl Need {
    fn of(device: &ClaimDevice, st: &WindowStats, gpu: &GpuInfo, policy: &RightsizePolicy) -> Self {
        let h = 1.0 + policy.headroom.max(0.0);
        let peak = st.peak_memory.unwrap_or(0);
        let memory = (peak as f64 * h).ceil() as u64;
        // SMs the activity figure is a share of: the share's GPU, else the device given.
        let basis = match device.kind {
            Holding::Share => gpu.multiprocessors,
            _ => device.allocated.sms.or(gpu.multiprocessors),
        };
        let sms: Option<u32> = match (st.p95_activity, basis) {
            (Some(p95), Some(b)) if st.activity_samples > 0 => {
                Some(((p95 / 100.0 * f64::from(b) * h).ceil() as u32).clamp(1, b.max(1)))
            }
            _ => None,
        };
        // Without an activity figure the SMs it has are kept.
        let sms_floor = sms.or(device.allocated.sms).unwrap_or(0);
        Self {
            memory,
            sms,
            sms_floor,
        }
    }

    /// How the reason words it.
    fn words(&self) -> String {
        match self.sms {
            Some(s) => format!("{} and {s} SMs", gib(self.memory)),
            None => format!(
                "{} (SMs kept at {}: no SM activity figure for this device)",
                gib(self.memory),
                self.sms_floor
            ),
        }
    }
}

/// The advice that needs no shape: too few samples, figures not attributable, or idle.
fn advice_without_shape(
    device: &ClaimDevice,
    st: &WindowStats,
    policy: &RightsizePolicy,
) -> Option<Recommendation> {
    let plain = |advice: Advice, change: Change, reason: String| Recommendation {
        advice,
        change,
        served: true,
        reason,
        needs: None,
    };
    if st.seen_buckets < MIN_SEEN_BUCKETS {
        return Some(plain(
            Advice::Pending,
            Change::Unknown,
            format!(
                "pending: samples in {} of the window's {BUCKETS} buckets, {MIN_SEEN_BUCKETS} needed (half the window of {})",
                st.seen_buckets,
                span(st.bucket_seconds * u64::from(BUCKETS))
            ),
        ));
    }
    let memory_unknown = st.memory_samples == 0 || st.memory_not_attributable > st.memory_samples;
    let activity_unknown = st.activity_not_attributable > st.activity_samples;
    if memory_unknown || activity_unknown {
        let reason = if st.memory_not_attributable > 0 || st.activity_not_attributable > 0 {
            not_attributable_reason(device, st)
        } else {
            "not attributable: NVML answered no memory figure for the device in the window".into()
        };
        return Some(plain(Advice::NotAttributable, Change::Unknown, reason));
    }
    if st.idle_fraction.is_some_and(|f| f >= RELEASE_IDLE_FRACTION) {
        return Some(plain(
            Advice::Release,
            Change::Release,
            format!(
                "idle: release: SM activity below {}% in {:.0}% of the samples; {}",
                policy.idle_threshold_percent,
                st.idle_fraction.unwrap_or(0.0) * 100.0,
                figures(device, st)
            ),
        ));
    }
    None
}

/// The shapes that hold `need` on `gpu`, in the order the device's kind prefers them: the
/// smallest MIG profile, a capacity share, the whole GPU.
fn fitting_shapes(
    device: &ClaimDevice,
    need: &Need,
    inventory: &NodeInventory,
    gpu: &GpuInfo,
) -> Vec<Shape> {
    let gpu_memory = gpu.memory_bytes;
    let table = profiles(inventory, gpu);
    let full = table.iter().map(|p| p.slice_count).max().unwrap_or(0);
    let mig = table
        .iter()
        .filter(|p| !p.name.contains('+'))
        .filter(|p| !(device.kind == Holding::Whole && p.slice_count == full))
        .filter(|p| (p.memory_mib << 20) >= need.memory && p.multiprocessors >= need.sms_floor)
        .min_by_key(|p| (p.memory_mib, p.multiprocessors, p.slice_count))
        .map(|p| Shape::Mig {
            profile: p.name.clone(),
            memory_bytes: p.memory_mib << 20,
            sms: p.multiprocessors,
        });
    let share_memory = need.memory.div_ceil(MEMORY_STEP_BYTES).max(1) * MEMORY_STEP_BYTES;
    // A share that needs every SM is a whole GPU in all but name: not offered.
    let share = (share_memory <= gpu_memory - gpu_memory % MEMORY_STEP_BYTES
        && gpu.multiprocessors.is_some_and(|g| need.sms_floor < g))
    .then_some(Shape::Share {
        memory_bytes: share_memory,
        sms: need.sms_floor.max(1),
    });
    let whole = Shape::WholeGpu {
        memory_bytes: gpu_memory,
        sms: gpu.multiprocessors,
    };
    let order: Vec<Option<Shape>> = match device.kind {
        Holding::Whole | Holding::Mig => vec![mig, share, Some(whole)],
        Holding::Mps | Holding::Share => vec![share, mig, Some(whole)],
    };
    order.into_iter().flatten().collect()
}

/// Why `shape` (`change` against what the device holds) is advised.
fn shape_reason(
    shape: &Shape,
    change: Change,
    need: &Need,
    gpu: &GpuInfo,
    policy: &RightsizePolicy,
    figures: &str,
) -> String {
    let need_words = need.words();
    let head = format!("{:.0}% headroom", policy.headroom * 100.0);
    let product = gpu.product_name.as_str();
    match (shape, change) {
        (Shape::WholeGpu { .. }, _) if need.memory > gpu.memory_bytes => format!(
            "whole GPU needed: needs {need_words} with {head}, more than the GPU's {}; {figures}",
            gib(gpu.memory_bytes)
        ),
        (Shape::WholeGpu { .. }, _) => format!(
            "whole GPU needed: needs {need_words} with {head}, more than any smaller shape of the {product} holds; {figures}"
        ),
        (s, Change::Same) => format!(
            "fits: {} holds {need_words} with {head}; {figures}",
            s.describe()
        ),
        (s, Change::Larger) => format!(
            "too tight: needs {need_words} with {head}, more than it holds; {} would hold it; {figures}",
            s.describe()
        ),
        (s, _) => format!(
            "oversized: {} would hold {need_words} with {head}; {figures}",
            s.describe()
        ),
    }
}

/// The recommendation for `device` from `st`.
pub fn recommend(
    device: &ClaimDevice,
    st: &WindowStats,
    inventory: &NodeInventory,
    modes: NodeModes,
    policy: &RightsizePolicy,
) -> Recommendation {
    if let Some(r) = advice_without_shape(device, st, policy) {
        return r;
    }
    let Some(gpu) = gpu_of(inventory, device) else {
        return Recommendation {
            advice: Advice::NotAttributable,
            change: Change::Unknown,
            served: true,
            reason: format!(
                "not attributable: GPU {} is not in the node's inventory",
                device.gpu_uuid
            ),
            needs: None,
        };
    };
    let need = Need::of(device, st, gpu, policy);
    let fitting = fitting_shapes(device, &need, inventory, gpu);
    let product = gpu.product_name.as_str();
    let mut ideal_needs = None;
    let mut chosen = None;
    for (i, shape) in fitting.iter().enumerate() {
        match unserved(shape, product, device, inventory, modes) {
            None => {
                chosen = Some(shape.clone());
                break;
            }
            Some(n) if i == 0 => ideal_needs = Some((shape.clone(), n)),
            Some(_) => {}
        }
    }
    let served = chosen.is_some();
    let shape = match chosen {
        Some(s) => s,
        // Nothing the node serves holds it: say what would, and what that needs.
        None => fitting.first().cloned().unwrap_or(Shape::WholeGpu {
            memory_bytes: gpu.memory_bytes,
            sms: gpu.multiprocessors,
        }),
    };
    let change = change_of(device, &shape);
    let mut reason = shape_reason(&shape, change, &need, gpu, policy, &figures(device, st));
    if st.sources.contains(&ActivitySource::GpuUtilization) {
        reason.push_str(" (gpu_utilization is a duty cycle: it overstates the SMs needed)");
    }
    let needs = if !served {
        let n = unserved(&shape, product, device, inventory, modes).unwrap_or_default();
        let _ = write!(reason, "; this node cannot serve it: it would need {n}");
        Some(n)
    } else if let Some((ideal, n)) = ideal_needs {
        let _ = write!(
            reason,
            "; {} would hold it too, but this node would need {n}",
            ideal.describe()
        );
        Some(format!("{}: {n}", ideal.describe()))
    } else {
        None
    };
    Recommendation {
        advice: Advice::Shape(shape),
        change,
        served,
        reason,
        needs,
    }
}

/// `shape` against what `device` holds.
fn change_of(device: &ClaimDevice, shape: &Shape) -> Change {
    let held_mem = device.allocated.memory_bytes;
    let held_sms = device.allocated.sms;
    match (shape, device.kind) {
        (Shape::WholeGpu { .. }, Holding::Whole) => return Change::Same,
        (Shape::Mig { profile, .. }, Holding::Mig)
            if device.allocated.mig_profile.as_deref() == Some(profile) =>
        {
            return Change::Same;
        }
        _ => {}
    }
    let mem = shape.memory_bytes();
    let sms = shape.sms();
    let larger = mem > held_mem || matches!((sms, held_sms), (Some(s), Some(h)) if s > h);
    let smaller = (mem as f64) < held_mem as f64 * 0.9
        || matches!((sms, held_sms), (Some(s), Some(h)) if f64::from(s) < f64::from(h) * 0.9);
    match (larger, smaller) {
        (true, _) => Change::Larger,
        (false, true) => Change::Smaller,
        (false, false) => Change::Same,
    }
}
