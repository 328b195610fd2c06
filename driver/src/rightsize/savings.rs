//! What the recommendations would save on a node: the GPUs its claims hold now against the
//! GPUs the recommended shapes would need, packed the way the scheduler allocates them.
//!
//! Packing model (the one `hack/packing` measures against the optimum): one claim device
//! at a time, in the order given, each takes the first GPU with room for it.
//! - MIG profiles: GPUs of the same product in MIG mode, each placement of the profile in
//!   the table's order, the first whose memory slices are free and whose compute slices
//!   and per-profile instance count still fit;
//! - shares: GPUs of the same product with MIG off, the first whose remaining `memory` and
//!   `multiprocessors` hold the share;
//! - whole GPUs: one each; released claims: none.
//!
//! A claim without a recommendation (pending, not attributable) counts as the shape it
//! holds, so the figure never claims savings that were not measured.
//!
//! [`merges`] packs the capacity shares and MPS claims alone, the same way, and names the
//! GPUs they are on where their right-sized shapes would fit on fewer.

use std::collections::BTreeMap;

use crate::model::{MigProfile, MigState, NodeInventory};
use crate::usage::{ClaimDevice, Holding};

use super::advice::{Advice, Recommendation, Shape};

/// GPUs held and GPUs needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Savings {
    /// Distinct GPUs the prepared claims hold (a GPU with any claim device on it counts).
    pub held: usize,
    /// GPUs the recommended shapes need when packed first fit.
    pub needed: usize,
}

#[derive(Default)]
struct MigGpu {
    /// Memory slices taken (bit per slice).
    slices: u32,
    /// Compute slices taken.
    compute: u32,
    /// Instances per profile name.
    count: BTreeMap<String, u32>,
}

fn mask(start: u32, size: u32) -> u32 {
    if size >= 32 {
        u32::MAX
    } else {
        ((1u32 << size) - 1) << start.min(31)
    }
}

/// A shape to pack, per product.
enum Item {
    Whole,
    Mig(MigProfile),
    Share {
        memory: u64,
        sms: u64,
    },
    /// Something that cannot be packed with the table (unknown profile): a GPU of its own.
    Alone,
}

/// Packs the recommendations (`devices[i]` with `recs[i]`) of the node's claims.
pub fn savings(
    inventory: &NodeInventory,
    devices: &[ClaimDevice],
    recs: &[Recommendation],
) -> Savings {
    let mut held: Vec<&str> = devices.iter().map(|d| d.gpu_uuid.as_str()).collect();
    held.sort_unstable();
    held.dedup();
    let mut by_product: BTreeMap<&str, Vec<Item>> = BTreeMap::new();
    for (d, r) in devices.iter().zip(recs) {
        let Some(gpu) = inventory.gpus.iter().find(|g| g.uuid == d.gpu_uuid) else {
            by_product.entry("").or_default().push(Item::Alone);
            continue;
        };
        let table: &[MigProfile] = super::advice::profiles(inventory, gpu);
        let profile = |name: &str| {
            table
                .iter()
                .find(|p| p.name == name)
                .cloned()
                .map_or(Item::Alone, Item::Mig)
        };
        let item = match &r.advice {
            Advice::Release => continue,
            Advice::Shape(Shape::WholeGpu { .. }) => Item::Whole,
            Advice::Shape(Shape::Mig { profile: p, .. }) => profile(p),
            Advice::Shape(Shape::Share { memory_bytes, sms }) => Item::Share {
                memory: *memory_bytes,
                sms: u64::from(*sms),
            },
            Advice::Pending | Advice::NotAttributable => match d.kind {
                Holding::Whole => Item::Whole,
                Holding::Mig => d
                    .allocated
                    .mig_profile
                    .as_deref()
                    .map_or(Item::Alone, profile),
                Holding::Mps | Holding::Share if d.mig.is_some() => Item::Alone,
                Holding::Mps | Holding::Share => Item::Share {
                    memory: d.allocated.memory_bytes,
                    sms: u64::from(d.allocated.sms.or(gpu.multiprocessors).unwrap_or(0)),
                },
            },
        };
        by_product
            .entry(gpu.product_name.as_str())
            .or_default()
            .push(item);
    }
    let mut needed = 0;
    for (product, items) in by_product {
        let gpu = inventory.gpus.iter().find(|g| g.product_name == product);
        let (gpu_memory, gpu_sms) = gpu.map_or((0, 0), |g| {
            (g.memory_bytes, u64::from(g.multiprocessors.unwrap_or(0)))
        });
        let compute_slices = gpu
            .map(|g| {
                super::advice::profiles(inventory, g)
                    .iter()
                    .map(|p| p.slice_count)
                    .max()
                    .unwrap_or(0)
            })
            .unwrap_or(0);
        let mut migs: Vec<MigGpu> = Vec::new();
        let mut shares: Vec<(u64, u64)> = Vec::new();
        for item in items {
            match item {
                Item::Whole | Item::Alone => needed += 1,
                Item::Share { memory, sms } => {
                    place_share(&mut shares, memory, sms, gpu_memory, gpu_sms);
                }
                Item::Mig(p) => {
                    let fits = |g: &MigGpu| {
                        if g.compute + p.slice_count > compute_slices
                            || g.count.get(&p.name).copied().unwrap_or(0) >= p.instance_count
                        {
                            return None;
                        }
                        p.placements
                            .iter()
                            .map(|pl| mask(pl.start, pl.size))
                            .find(|m| g.slices & m == 0)
                    };
                    let slot = migs.iter().position(|g| fits(g).is_some());
                    let g = match slot {
                        Some(i) => &mut migs[i],
                        None => {
                            migs.push(MigGpu::default());
                            let last = migs.len() - 1;
                            &mut migs[last]
                        }
                    };
                    // A table without placements fits no empty GPU either.
                    if let Some(m) = fits(g) {
                        g.slices |= m;
                        g.compute += p.slice_count;
                        *g.count.entry(p.name.clone()).or_default() += 1;
                    }
                }
            }
        }
        needed += migs.len() + shares.len();
    }
    Savings {
        held: held.len(),
        needed,
    }
}

/// Puts a share of `memory` bytes and `sms` SMs on the first GPU (memory and SMs taken
/// so far) with room for it, or on a new one.
fn place_share(gpus: &mut Vec<(u64, u64)>, memory: u64, sms: u64, gpu_memory: u64, gpu_sms: u64) {
    match gpus
        .iter_mut()
        .find(|(m, s)| m + memory <= gpu_memory && s + sms <= gpu_sms)
    {
        Some((m, s)) => {
            *m += memory;
            *s += sms;
        }
        None => gpus.push((memory, sms)),
    }
}

/// Capacity shares and MPS claims of one GPU product that sit on more GPUs than their
/// right-sized shapes need: "merge into fewer GPUs".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Merge {
    /// The GPU product.
    pub product: String,
    /// Published names of the GPUs the shares are on now, sorted.
    pub gpus: Vec<String>,
    /// GPUs the right-sized shares would need, packed first fit (fewer than `gpus`).
    pub needed: usize,
}

impl Merge {
    /// `shares on gpu-0, gpu-1, gpu-2 would fit on 1 GPU after right-sizing`.
    pub fn describe(&self) -> String {
        let on = self.gpus.join(", ");
        match self.needed {
            1 => format!("shares on {on} would fit on 1 GPU after right-sizing"),
            n => format!("shares on {on} would fit on {n} GPUs after right-sizing"),
        }
    }
}

/// Per GPU product, the capacity shares and MPS claims on whole GPUs with MIG mode off
/// (`devices[i]` with `recs[i]`) that stay shares, packed first fit in their recommended
/// shapes; a [`Merge`] for each product where that takes fewer GPUs than they are on now.
///
/// Shares on MIG devices and GPUs in MIG mode are left out (a share is never moved onto a
/// MIG-mode GPU, nor a MIG device onto a share's GPU). A claim recommended a share takes
/// the share (an MPS claim, which holds its GPU, would ask for a capacity share instead);
/// a pending or not attributable one takes what it holds (nothing is saved that was not
/// measured). A released claim, and one recommended a MIG profile or a whole GPU, leaves
/// the group: its own advice says so, and the node's [`Savings`] counts it.
pub fn merges(
    inventory: &NodeInventory,
    devices: &[ClaimDevice],
    recs: &[Recommendation],
) -> Vec<Merge> {
    // Per product: the GPUs the shares are on, and the shapes to pack.
    type Group<'a> = (BTreeMap<&'a str, &'a str>, Vec<(u64, u64)>, u64, u64);
    let mut groups: BTreeMap<&str, Group<'_>> = BTreeMap::new();
    for (d, r) in devices.iter().zip(recs) {
        if !matches!(d.kind, Holding::Mps | Holding::Share) || d.mig.is_some() {
            continue;
        }
        let Some(gpu) = inventory.gpus.iter().find(|g| g.uuid == d.gpu_uuid) else {
            continue;
        };
        if matches!(gpu.mig, MigState::Enabled { .. }) {
            continue;
        }
        let gpu_sms = u64::from(gpu.multiprocessors.unwrap_or(0));
        let g = groups
            .entry(gpu.product_name.as_str())
            .or_insert_with(|| (BTreeMap::new(), Vec::new(), gpu.memory_bytes, gpu_sms));
        let shape = match &r.advice {
            Advice::Release | Advice::Shape(Shape::Mig { .. } | Shape::WholeGpu { .. }) => None,
            Advice::Shape(Shape::Share { memory_bytes, sms }) => {
                Some((*memory_bytes, u64::from(*sms)))
            }
            Advice::Pending | Advice::NotAttributable => Some((
                d.allocated.memory_bytes,
                u64::from(d.allocated.sms.or(gpu.multiprocessors).unwrap_or(0)),
            )),
        };
        if let Some(shape) = shape {
            g.0.entry(d.gpu_uuid.as_str()).or_insert(d.device.as_str());
            g.1.push(shape);
        }
    }
    groups
        .into_iter()
        .filter_map(|(product, (on, shapes, gpu_memory, gpu_sms))| {
            let mut packed = Vec::new();
            for (memory, sms) in shapes {
                place_share(&mut packed, memory, sms, gpu_memory, gpu_sms);
            }
            let mut gpus: Vec<String> = on.into_values().map(str::to_owned).collect();
            gpus.sort();
            (packed.len() < gpus.len()).then(|| Merge {
                product: product.to_owned(),
                gpus,
                needed: packed.len(),
            })
        })
        .collect()
}
