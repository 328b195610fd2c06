//! Prepare/unprepare latency through the real NVML path on an 8-GPU mock node, printed
//! next to the floor measured in the same run (two durable small-file writes: the CDI spec
//! and the checkpoint). A measurement, not a timed test: it asserts only correctness.
//!
//! Run: `cargo test -p cleave-driver --release --test prepare_latency -- --ignored --nocapture`

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_api::names::DRIVER_NAME;
use cleave_driver::checkpoint::write_file_atomic;
use cleave_driver::driver_root::DriverRootConfig;
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::prepare::{DriverConfig, NodeDriver};
use k8s_openapi::api::resource::v1::ResourceClaim;

use cleave_driver::prepare::testing::node_claim;
use common::{CHILD_TIMEOUT, SCENARIO_ENV, child_tmp, mock_lib, scenario};

const ROUNDS: usize = 300;

fn claim(uid: &str, device: &str) -> ResourceClaim {
    node_claim(uid, &[("gpu", device)])
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn report(label: &str, mut samples: Vec<Duration>, floor_p50: Duration) {
    samples.sort();
    let p50 = percentile(&samples, 0.5);
    let p99 = percentile(&samples, 0.99);
    println!(
        "{label:<34} p50 {:>8.3} ms  p99 {:>8.3} ms  p50/floor {:>5.2}  p99/floor {:>5.2}",
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
        p50.as_secs_f64() / floor_p50.as_secs_f64(),
        p99.as_secs_f64() / floor_p50.as_secs_f64(),
    );
}

fn run(dir: &Path, dynamic: bool, device_for: impl Fn(usize) -> String, label: &str) {
    common::lay_out_driver_root(&dir.join("root"));
    let cfg = DriverConfig {
        driver_name: DRIVER_NAME.into(),
        pool_name: "node-a".into(),
        state_dir: dir.join(label).join("state"),
        cdi_root: dir.join(label).join("cdi"),
        driver_root: DriverRootConfig {
            root: dir.join("root"),
            host_root: None,
            dev_root: Some(dir.join("root")),
            proc_root: dir.join("proc"),
        },
        dynamic_mig: dynamic,
        boot_id_path: dir.join("boot_id"),
        cdi_hook: None,
        consumable_capacity: Default::default(),
    };
    let backend = Arc::new(NvmlBackend::open(Some(&mock_lib())).unwrap());
    let driver = NodeDriver::start(cfg.clone(), backend).unwrap();

    // Floor: the two durable writes of a prepare, with the sizes prepare writes.
    driver
        .prepare(&claim(
            "00000000-0000-4000-8000-000000000000",
            &device_for(0),
        ))
        .unwrap();
    let spec = std::fs::read(
        cfg.cdi_root
            .join("k8s.gpu.cleave.dev-claim_00000000-0000-4000-8000-000000000000.json"),
    )
    .unwrap();
    let ckpt = std::fs::read(cfg.state_dir.join("checkpoint.json")).unwrap();
    driver
        .unprepare("00000000-0000-4000-8000-000000000000")
        .unwrap();
    let floor_dir = dir.join(label).join("floor");
    std::fs::create_dir_all(&floor_dir).unwrap();
    let mut floor = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let t = Instant::now();
        write_file_atomic(&floor_dir.join("spec.json"), &spec).unwrap();
        write_file_atomic(&floor_dir.join("checkpoint.json"), &ckpt).unwrap();
        floor.push(t.elapsed());
    }
    floor.sort();
    let floor_p50 = percentile(&floor, 0.5);

    let mut prep = Vec::with_capacity(ROUNDS);
    let mut unprep = Vec::with_capacity(ROUNDS);
    for i in 1..=ROUNDS {
        let uid = format!("{i:08x}-0000-4000-8000-000000000000");
        let c = claim(&uid, &device_for(i));
        let t = Instant::now();
        let prepared = driver.prepare(&c).unwrap();
        prep.push(t.elapsed());
        assert_eq!(prepared.devices.len(), 1);
        let t = Instant::now();
        driver.unprepare(&uid).unwrap();
        unprep.push(t.elapsed());
    }
    assert!(driver.prepared_claims().is_empty());
    report(
        &format!("{label}: floor (2 durable writes)"),
        floor,
        floor_p50,
    );
    report(&format!("{label}: prepare"), prep, floor_p50);
    report(&format!("{label}: unprepare"), unprep, floor_p50);
}

/// Runs the measurement in a child (the mock reads its environment once) with `--ignored`,
/// bounded by [`CHILD_TIMEOUT`]; returns its stdout.
fn child(name: &str, mig: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "prepare_latency",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SCENARIO_ENV, name)
        .env("MOCK_NVML_LIB", mock_lib())
        .env("MOCK_NVML_STATE", dir.path().join("state.json"))
        .env("MOCK_NVML_PROFILE", "h100-80gb-x8")
        .env("MOCK_NVML_MIG", mig)
        .env("CLEAVE_TEST_TMP", dir.path())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut pipe = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut pipe, &mut s).unwrap();
        s
    });
    let status = cleave_testkit::process::wait_or_kill(
        &mut child,
        CHILD_TIMEOUT,
        &format!("measurement {name}"),
    );
    let out = reader.join().unwrap();
    assert!(
        status.success() && out.contains("1 passed"),
        "{name}:\n{out}"
    );
    out
}

#[test]
#[ignore = "measurement; run with --ignored --nocapture"]
fn prepare_latency() {
    let Some(which) = scenario() else {
        for (name, mig) in [("whole-gpu", "off"), ("on-demand-mig", "on")] {
            for line in child(name, mig).lines().filter(|l| l.contains(" p50 ")) {
                println!("{line}");
            }
        }
        return;
    };
    let dir = child_tmp();
    std::fs::write(dir.join("boot_id"), "bench\n").unwrap();
    match which.as_str() {
        "whole-gpu" => run(&dir, false, |i| format!("gpu-{}", i % 8), "whole GPU"),
        _ => run(
            &dir,
            true,
            |i| format!("gpu-{}-mig-1g10gb-{}", i % 8, i % 7),
            "on-demand MIG 1g",
        ),
    }
}
