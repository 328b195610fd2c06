//! The pool builder over inventories discovered from the mock NVML library: every
//! profile, static and on-demand, within the API server's limits; and the on-demand
//! counters agree exactly with what the (mock) hardware lets you create.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;

use cleave_api::names::DeviceName;
use cleave_driver::backend::GpuBackend;
use cleave_driver::inspect::render_table;
use cleave_driver::model::{MigState, Placement};
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::pool::{PoolOptions, build_pool, limit_violations};
use k8s_openapi::api::resource::v1::Device;

use cleave_testkit::gpu::node_product;
use common::{PROFILES, gpu, mock_lib, run_child, scenario};

fn open() -> NvmlBackend {
    NvmlBackend::open(Some(&mock_lib())).expect("mock NVML opens")
}

/// Every profile, static and on-demand: limits hold, names parse, counts are right.
#[test]
fn pools_of_every_profile_pass_limits() {
    if let Some(profile) = scenario() {
        let (facts, count) = node_product(&profile);
        let backend = open();
        let inv = backend.inventory().unwrap();
        let mig = facts.mig_capable();

        // On demand: whole GPU + every placement (25 on these parts) per GPU.
        let on_demand = build_pool(
            &inv,
            &PoolOptions {
                dynamic_mig: true,
                ..Default::default()
            },
        );
        assert!(
            limit_violations(&on_demand).is_empty(),
            "{:?}",
            limit_violations(&on_demand)
        );
        assert_eq!(on_demand.groups.len(), count);
        let per_gpu = if mig {
            1 + facts
                .mig_profiles
                .iter()
                .map(|p| p.starts.len())
                .sum::<usize>()
        } else {
            1
        };
        if mig {
            assert_eq!(per_gpu, 26);
        }
        assert_eq!(on_demand.device_count(), count * per_gpu);
        for d in on_demand.devices() {
            d.name.parse::<DeviceName>().unwrap();
        }

        // Static with no instances: MIG GPUs publish nothing, others their whole GPU.
        let empty = build_pool(&inv, &PoolOptions::default());
        assert!(limit_violations(&empty).is_empty());
        assert_eq!(empty.device_count(), if mig { 0 } else { count });

        if mig {
            // A typical mixed layout on GPU 0: 3g@4, 2g@0, 1g@2, 1g+me@3 (ids from the tables).
            let id = |slices: u32, starts: usize, size: u32, me: bool| {
                facts
                    .mig_profiles
                    .iter()
                    .find(|p| {
                        p.slice_count == slices
                            && p.starts.len() == starts
                            && p.placement_size == size
                            && p.name.ends_with("+me") == me
                    })
                    .unwrap()
            };
            let uuid0 = gpu(&inv, 0).uuid.clone();
            let layout = [
                (id(3, 2, 4, false), 4),
                (id(2, 3, 2, false), 0),
                (id(1, 7, 1, false), 2),
                (id(1, 7, 1, true), 3),
            ];
            for (p, start) in layout {
                backend
                    .create_mig(
                        &uuid0,
                        p.id,
                        Placement {
                            start,
                            size: p.placement_size,
                        },
                    )
                    .unwrap();
            }
            let inv = backend.inventory().unwrap();
            let stat = build_pool(&inv, &PoolOptions::default());
            assert!(limit_violations(&stat).is_empty());
            let mut names: Vec<String> = stat.devices().map(|d| d.name.clone()).collect();
            names.sort();
            let mut expected: Vec<String> = layout
                .iter()
                .map(|(p, start)| DeviceName::mig(0, p.name, *start).to_string())
                .collect();
            expected.sort();
            assert_eq!(names, expected);
            for d in stat.devices() {
                let uuid = d.attributes.as_ref().unwrap()["uuid"]
                    .string
                    .clone()
                    .unwrap();
                assert!(uuid.starts_with("MIG-"));
            }
            let dynamic = build_pool(
                &inv,
                &PoolOptions {
                    dynamic_mig: true,
                    ..Default::default()
                },
            );
            assert!(limit_violations(&dynamic).is_empty());
            let set = &dynamic.groups[0].counter_sets[0].counters;
            // Slices 0-4 and 4-7 taken, i.e. all but none: 2g@0-1, 1g@2, 1g+me@3, 3g@4-7.
            assert!(
                set.iter()
                    .filter(|(k, _)| k.starts_with("memory-slice-"))
                    .all(|(_, v)| v.value.0 == "0")
            );
            assert_eq!(set["compute-slices"].value.0, "0");

            let table = render_table(&inv, &stat);
            for n in &names {
                assert!(table.contains(n.as_str()), "{n} missing from\n{table}");
            }
            println!("{table}");
        }
        return;
    }
    std::thread::scope(|s| {
        for profile in PROFILES {
            s.spawn(move || {
                run_child(
                    "pools_of_every_profile_pass_limits",
                    profile,
                    &[("MOCK_NVML_PROFILE", profile)],
                )
            });
        }
    });
}

/// Remaining counter values of one GPU's set.
type Counters = BTreeMap<String, i64>;

fn consumption(d: &Device) -> Counters {
    d.consumes_counters.as_ref().unwrap()[0]
        .counters
        .iter()
        .map(|(k, v)| (k.clone(), v.value.0.parse().unwrap()))
        .collect()
}

fn fits(free: &Counters, need: &Counters) -> bool {
    need.iter()
        .all(|(k, n)| free.get(k).is_some_and(|f| f >= n))
}

/// Deterministic pseudo-random numbers (no extra dependency; the seed is printed).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// Allocating on-demand devices the way the scheduler does (a device fits if every counter
/// it consumes has enough left) and creating their instances never fails, and at every
/// step exactly the devices that fit the counters can be created on the hardware.
#[test]
fn on_demand_counters_match_hardware() {
    if let Some(profile) = scenario() {
        let backend = open();
        let inv = backend.inventory().unwrap();
        let g0 = gpu(&inv, 0);
        let MigState::Enabled { profiles, .. } = &g0.mig else {
            panic!("MIG off")
        };
        let uuid = g0.uuid.clone();
        let pool = build_pool(
            &inv,
            &PoolOptions {
                dynamic_mig: true,
                ..Default::default()
            },
        );
        let group = &pool.groups[0];
        let initial: Counters = group.counter_sets[0]
            .counters
            .iter()
            .map(|(k, v)| (k.clone(), v.value.0.parse().unwrap()))
            .collect();
        // MIG devices with (profile id, placement, consumption).
        let devices: Vec<(String, u32, Placement, Counters)> = group
            .devices
            .iter()
            .filter(|d| d.name.contains("-mig-"))
            .map(|d| {
                let a = d.attributes.as_ref().unwrap();
                let name = a["profile"].string.clone().unwrap();
                let id = profiles.iter().find(|p| p.name == name).unwrap().id;
                let placement = Placement {
                    start: a["placementStart"].int.unwrap() as u32,
                    size: a["placementSize"].int.unwrap() as u32,
                };
                (d.name.clone(), id, placement, consumption(d))
            })
            .collect();
        assert_eq!(devices.len(), 25);

        let seed = 0x5eed_u64 + profile.len() as u64;
        println!("seed {seed}");
        let mut rng = Lcg(seed);
        let mut probes = 0;
        for round in 0..8 {
            let mut free = initial.clone();
            let mut made = Vec::new();
            // Allocate in random order until nothing fits.
            loop {
                let candidates: Vec<usize> = (0..devices.len())
                    .filter(|&i| fits(&free, &devices[i].3))
                    .filter(|&i| !made.iter().any(|(j, _)| *j == i))
                    .collect();
                // Probe: exactly the fitting devices can be created now.
                for (i, (name, id, placement, need)) in devices.iter().enumerate() {
                    if made.iter().any(|(j, _)| *j == i) {
                        continue;
                    }
                    let want = fits(&free, need);
                    let got = backend.create_mig(&uuid, *id, *placement);
                    probes += 1;
                    match (&got, want) {
                        (Ok(m), true) => backend.destroy_mig(&uuid, m.gi_id, m.ci_id).unwrap(),
                        (Err(_), false) => {}
                        (Ok(m), false) => {
                            backend.destroy_mig(&uuid, m.gi_id, m.ci_id).unwrap();
                            panic!(
                                "round {round}: counters reject {name} but the GPU creates it (made {made:?})"
                            );
                        }
                        (Err(e), true) => panic!(
                            "round {round}: counters allow {name} but creating it fails: {e} (made {made:?})"
                        ),
                    }
                }
                if candidates.is_empty() {
                    break;
                }
                let pick = candidates[rng.next(candidates.len())];
                let (_, id, placement, need) = &devices[pick];
                let m = backend.create_mig(&uuid, *id, *placement).unwrap();
                for (k, n) in need {
                    *free.get_mut(k).unwrap() -= n;
                }
                made.push((pick, m));
            }
            assert!(!made.is_empty());
            for (_, m) in made {
                backend.destroy_mig(&uuid, m.gi_id, m.ci_id).unwrap();
            }
            assert!(backend.list_mig(&uuid).unwrap().is_empty());
        }
        println!("{profile}: {probes} create probes agreed with the counters");
        return;
    }
    std::thread::scope(|s| {
        for profile in [
            "a100-40gb-x8",
            "h100-80gb-x8",
            "h200-141gb-x8",
            "a100-80gb-x4",
        ] {
            s.spawn(move || {
                run_child(
                    "on_demand_counters_match_hardware",
                    profile,
                    &[("MOCK_NVML_PROFILE", profile)],
                )
            });
        }
    });
}
