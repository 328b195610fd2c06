//! Load: 400 claims prepared and unprepared concurrently by 6 client threads in a seeded
//! random order, through two `NodeDriver` instances on one state directory (a rolling
//! update: both serialised by one lock, as the plugin shell's node lock does), on an
//! 8-GPU H100 mock node with on-demand MIG (whole GPUs, 1g and 3g placements; each device
//! held by at most one live claim at a time). At the end the hardware, the CDI root and the
//! checkpoint hold exactly the claims still live. Prints p50/p99 latency of prepare and
//! unprepare (service time under the lock, and with queueing).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cleave_driver::backend::GpuBackend;
use cleave_driver::cdi;
use cleave_driver::checkpoint::{CheckpointStore, ClaimState};
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::prepare::{DriverConfig, NodeDriver};
use k8s_openapi::api::resource::v1::ResourceClaim;

use cleave_driver::prepare::testing::node_claim;
use common::{child_tmp, mock_lib, run_child, scenario};

const CLAIMS: usize = 400;
const CLIENTS: usize = 6;
const SEED: u64 = 0x5eed_c1ea_0e00_0001;

fn config(dir: &Path) -> DriverConfig {
    std::fs::write(dir.join("boot_id"), "boot-1\n").unwrap();
    common::node_config(dir, dir.join("state"))
}

fn claim(uid: &str, device: &str) -> ResourceClaim {
    node_claim(uid, &[("r", device)])
}

/// Devices that never overlap: GPUs 0-1 whole, GPUs 2-7 as four 1g.10gb and one 3g.40gb.
fn devices() -> Vec<String> {
    let mut out = vec!["gpu-0".to_owned(), "gpu-1".to_owned()];
    for g in 2..8 {
        for s in 0..4 {
            out.push(format!("gpu-{g}-mig-1g10gb-{s}"));
        }
        out.push(format!("gpu-{g}-mig-3g40gb-4"));
    }
    out
}

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[derive(Default)]
struct Latencies {
    prepare_service: Vec<Duration>,
    prepare_total: Vec<Duration>,
    unprepare_service: Vec<Duration>,
    unprepare_total: Vec<Duration>,
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

#[test]
fn hundreds_of_claims_from_concurrent_clients_end_in_the_expected_state() {
    let Some(_) = scenario() else {
        let out = run_child(
            "hundreds_of_claims_from_concurrent_clients_end_in_the_expected_state",
            "h100",
            &[("MOCK_NVML_PROFILE", "h100-80gb-x8")],
        );
        // The child's first line follows libtest's "test ... " on the same line.
        for line in out
            .stdout
            .lines()
            .filter_map(|l| l.find("load:").map(|i| &l[i..]))
        {
            println!("{line}");
        }
        return;
    };
    let dir = child_tmp();
    let cfg = config(&dir);
    let open = || {
        Arc::new(
            NodeDriver::start(
                cfg.clone(),
                Arc::new(NvmlBackend::open(Some(&mock_lib())).unwrap()),
            )
            .unwrap(),
        )
    };
    // Two plugin instances on one node (rolling update), serialised like the shell does.
    let drivers = [open(), open()];
    let node_lock = Mutex::new(());
    let free = Mutex::new(devices());
    let next_claim = Mutex::new(0usize);
    let lat = Mutex::new(Latencies::default());
    let started = Instant::now();

    let live: Vec<BTreeMap<String, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..CLIENTS)
            .map(|client| {
                let (drivers, node_lock, free, next_claim, lat) =
                    (&drivers, &node_lock, &free, &next_claim, &lat);
                scope.spawn(move || {
                    let mut rng = Rng(SEED ^ (client as u64 + 1).wrapping_mul(0x9e37_79b9));
                    let mut mine: BTreeMap<String, String> = BTreeMap::new(); // uid -> device
                    let mut ops = 0;
                    loop {
                        ops += 1;
                        assert!(ops < 100_000, "client {client} made no progress");
                        let driver = &drivers[rng.below(2)];
                        // Prepare when a device is free (and the dice say so, or nothing is
                        // held); otherwise unprepare one of ours, so clients never all wait.
                        let device = if mine.is_empty() || rng.below(100) < 55 {
                            let mut f = free.lock().unwrap();
                            (!f.is_empty()).then(|| {
                                let i = rng.below(f.len());
                                f.swap_remove(i)
                            })
                        } else {
                            None
                        };
                        if device.is_none() && mine.is_empty() {
                            std::thread::sleep(Duration::from_millis(1));
                            continue;
                        }
                        if let Some(device) = device {
                            let n = {
                                let mut n = next_claim.lock().unwrap();
                                if *n >= CLAIMS {
                                    free.lock().unwrap().push(device);
                                    break;
                                }
                                *n += 1;
                                *n
                            };
                            let uid = format!("{n:08x}-0000-4000-8000-{client:012x}");
                            let t0 = Instant::now();
                            let _g = node_lock.lock().unwrap();
                            let t1 = Instant::now();
                            let answer = driver.prepare(&claim(&uid, &device)).unwrap();
                            let done = Instant::now();
                            drop(_g);
                            assert_eq!(
                                answer.devices[0].cdi_device_ids,
                                [cdi::qualified_device_id(&uid, &device)]
                            );
                            let mut l = lat.lock().unwrap();
                            l.prepare_service.push(done - t1);
                            l.prepare_total.push(done - t0);
                            mine.insert(uid, device);
                        } else {
                            let k = rng.below(mine.len());
                            let uid = mine.keys().nth(k).unwrap().clone();
                            let device = mine.remove(&uid).unwrap();
                            let t0 = Instant::now();
                            let _g = node_lock.lock().unwrap();
                            let t1 = Instant::now();
                            driver.unprepare(&uid).unwrap();
                            let done = Instant::now();
                            drop(_g);
                            let mut l = lat.lock().unwrap();
                            l.unprepare_service.push(done - t1);
                            l.unprepare_total.push(done - t0);
                            free.lock().unwrap().push(device);
                        }
                    }
                    // Leave up to two claims per client prepared, unprepare the rest.
                    while mine.len() > 2 {
                        let uid = mine.keys().next().unwrap().clone();
                        let device = mine.remove(&uid).unwrap();
                        let _g = node_lock.lock().unwrap();
                        drivers[rng.below(2)].unprepare(&uid).unwrap();
                        drop(_g);
                        free.lock().unwrap().push(device);
                    }
                    mine
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let elapsed = started.elapsed();
    let expected: BTreeMap<String, String> = live.into_iter().flatten().collect();
    assert!(!expected.is_empty());

    // Checkpoint: exactly the live claims, prepared, with their devices.
    let data = CheckpointStore::in_dir(&cfg.state_dir).load().unwrap();
    let recorded: BTreeMap<String, String> = data
        .claims
        .values()
        .map(|c| {
            assert_eq!(c.state, ClaimState::Prepared, "{}", c.uid);
            (c.uid.clone(), c.devices[0].name.clone())
        })
        .collect();
    assert_eq!(recorded, expected);
    // Both instances agree with the file.
    for d in &drivers {
        let uids: BTreeSet<String> = d.prepared_claims().into_iter().map(|c| c.uid).collect();
        assert_eq!(uids, expected.keys().cloned().collect());
    }

    // CDI root: one spec per live claim.
    let files: BTreeSet<String> = std::fs::read_dir(&cfg.cdi_root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let want: BTreeSet<String> = expected.keys().map(|u| cdi::spec_file_name(u)).collect();
    assert_eq!(files, want);

    // Hardware: exactly the live claims' instances (UUID and placement), nothing else.
    let nvml = NvmlBackend::open(Some(&mock_lib())).unwrap();
    let inv = nvml.inventory().unwrap();
    let mut on_hw = BTreeMap::new();
    for g in &inv.gpus {
        for i in nvml.list_mig(&g.uuid).unwrap() {
            on_hw.insert(
                i.uuid.clone(),
                (g.minor, i.placement.start, i.placement.size),
            );
        }
    }
    let mut in_record = BTreeMap::new();
    for c in data.claims.values() {
        let d = &c.devices[0];
        let m = d.mig.as_ref().unwrap();
        in_record.insert(
            m.uuid.clone().unwrap(),
            (d.gpu_minor, m.placement.start, m.placement.size),
        );
    }
    assert_eq!(on_hw, in_record);

    let mut l = lat.into_inner().unwrap();
    let ops = l.prepare_service.len() + l.unprepare_service.len();
    println!(
        "load: {CLAIMS} claims, {CLIENTS} clients, 2 driver instances, {ops} calls in {elapsed:.2?} ({:.0} calls/s); {} left prepared",
        ops as f64 / elapsed.as_secs_f64(),
        expected.len()
    );
    println!(
        "load: prepare   service p50 {:.2?} p99 {:.2?}; with queueing p50 {:.2?} p99 {:.2?}",
        pct(&mut l.prepare_service, 0.5),
        pct(&mut l.prepare_service, 0.99),
        pct(&mut l.prepare_total, 0.5),
        pct(&mut l.prepare_total, 0.99)
    );
    println!(
        "load: unprepare service p50 {:.2?} p99 {:.2?}; with queueing p50 {:.2?} p99 {:.2?}",
        pct(&mut l.unprepare_service, 0.5),
        pct(&mut l.unprepare_service, 0.99),
        pct(&mut l.unprepare_total, 0.5),
        pct(&mut l.unprepare_total, 0.99)
    );
}
