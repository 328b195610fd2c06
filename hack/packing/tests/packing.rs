//! The packing simulation's first fit is what the published pool makes the scheduler do: a
//! small allocator over the real `build_pool` output (devices in published order, counters
//! from the counter sets, the first matching device whose counters fit) picks the same
//! GPU and placement as `cleave_packing::FirstFit` for random streams with departures.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use cleave_api::names::attr;
use cleave_api::pool::PoolDevices;
use cleave_driver::model::NodeInventory;
use cleave_driver::pool::{PlacementOrder, PoolOptions, build_pool};
use cleave_packing::{FirstFit, GpuShape, NodeWalk, Product, Rng};
use cleave_testkit::gpu::{Mig, gpu, inventory};

fn node(product: Product, gpus: u32) -> NodeInventory {
    inventory(
        (0..gpus)
            .map(|minor| gpu(product.key(), minor, Mig::On(Vec::new())))
            .collect(),
    )
}

/// The scheduler as the packing module models it, over published objects: counters
/// left per counter set, devices walked in published order.
struct Scheduler<'a> {
    pool: &'a PoolDevices,
    left: BTreeMap<(String, String), i64>,
}

impl<'a> Scheduler<'a> {
    fn new(pool: &'a PoolDevices) -> Self {
        let mut left = BTreeMap::new();
        for g in &pool.groups {
            for set in &g.counter_sets {
                for (k, c) in &set.counters {
                    left.insert((set.name.clone(), k.clone()), c.value.0.parse().unwrap());
                }
            }
        }
        Self { pool, left }
    }

    fn consumption(d: &k8s_openapi::api::resource::v1::Device) -> Vec<((String, String), i64)> {
        d.consumes_counters
            .iter()
            .flatten()
            .flat_map(|c| {
                c.counters.iter().map(|(k, v)| {
                    (
                        (c.counter_set.clone(), k.clone()),
                        v.value.0.parse::<i64>().unwrap(),
                    )
                })
            })
            .collect()
    }

    /// (group index, placement start) of the first device of `profile` that fits.
    fn allocate(&mut self, profile: &str) -> Option<(usize, u32)> {
        for (gi, g) in self.pool.groups.iter().enumerate() {
            for d in &g.devices {
                let attrs = d.attributes.as_ref().unwrap();
                if attrs.get(attr::PROFILE).and_then(|a| a.string.as_deref()) != Some(profile) {
                    continue;
                }
                let need = Self::consumption(d);
                if need.iter().all(|(k, n)| self.left[k] >= *n) {
                    for (k, n) in need {
                        *self.left.get_mut(&k).unwrap() -= n;
                    }
                    let start = attrs[attr::PLACEMENT_START].int.unwrap();
                    return Some((gi, u32::try_from(start).unwrap()));
                }
            }
        }
        None
    }

    fn release(&mut self, profile: &str, (gi, start): (usize, u32)) {
        let d = self.pool.groups[gi]
            .devices
            .iter()
            .find(|d| {
                let a = d.attributes.as_ref().unwrap();
                a.get(attr::PROFILE).and_then(|a| a.string.as_deref()) == Some(profile)
                    && a[attr::PLACEMENT_START].int == Some(i64::from(start))
            })
            .unwrap();
        for (k, n) in Self::consumption(d) {
            *self.left.get_mut(&k).unwrap() += n;
        }
    }
}

#[test]
fn simulated_first_fit_is_the_published_pool_first_fit() {
    for product in [Product::A100_40GB, Product::H100, Product::H200] {
        let gpus = 3;
        let inv = node(product, gpus);
        let pool = build_pool(
            &inv,
            &PoolOptions {
                dynamic_mig: true,
                ..Default::default()
            },
        );
        let profiles = product.profiles();
        let shape = GpuShape::new(&profiles, 8).unwrap();
        let mut sim = FirstFit::new(
            &shape,
            &profiles,
            PlacementOrder::DEFAULT,
            NodeWalk::GpuMajor,
            gpus as usize,
        );
        let mut sched = Scheduler::new(&pool);
        let mut rng = Rng::new(11);
        let mut live: Vec<(usize, (usize, u32))> = Vec::new();
        let (mut admitted, mut rejected) = (0, 0);
        for step in 0..600 {
            if !live.is_empty() && rng.unit() < 0.35 {
                let (p, at) = live.swap_remove(rng.weighted(&vec![1.0; live.len()]));
                sched.release(&profiles[p].name, at);
                sim.release(
                    p,
                    (at.0, ((1u32 << profiles[p].placements[0].size) - 1) << at.1),
                );
                continue;
            }
            let p = rng.weighted(&[4.0, 1.0, 2.0, 2.0, 2.0, 1.0, 1.0]);
            let published = sched.allocate(&profiles[p].name);
            let simulated = sim.allocate(p).map(|(g, m)| (g, m.trailing_zeros()));
            assert_eq!(
                published,
                simulated,
                "{} step {step}: {}",
                product.name(),
                profiles[p].name
            );
            match published {
                Some(at) => {
                    live.push((p, at));
                    admitted += 1;
                }
                None => rejected += 1,
            }
        }
        // The stream fills the node and frees it again: both outcomes occur often.
        assert!(admitted > 100 && rejected > 50, "{admitted} {rejected}");
    }
}
