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

use std::collections::BTreeMap;

use crate::model::{MigProfile, NodeInventory};
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
                    match shares
                        .iter_mut()
                        .find(|(m, s)| m + memory <= gpu_memory && s + sms <= gpu_sms)
                    {
                        Some((m, s)) => {
                            *m += memory;
                            *s += sms;
                        }
                        None => shares.push((memory, sms)),
                    }
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
