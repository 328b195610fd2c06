//! One usage sampling round for 8 GPUs x 7 MIG instances (56 claim devices, H100, GPM)
//! over the mock NVML library: per-round time (p50, p99, mean), the cost per device, the
//! NVML queries per round, and the process's resident memory before and after. Prints
//! figures; asserts nothing.
//!
//! `cargo bench -p cleave-driver --bench usage` (or `-- <rounds>`). The mock reads its
//! environment at `nvmlInit`, so the binary re-runs itself with the mock's variables set.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::process::Command;
use std::time::{Duration, Instant};

use cleave_driver::backend::GpuBackend as _;
use cleave_driver::model::Placement;
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::usage::{Allocation, ClaimDevice, ClaimRef, Holding, MigRef, UsageSampler};

const CHILD: &str = "CLEAVE_USAGE_BENCH_CHILD";
const GPUS: usize = 8;
const PER_GPU: u32 = 7;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = args
        .iter()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(200);
    let lib = mock_nvml::locate::cdylib_path().expect("libmock_nvml.so built beside the bench");
    if std::env::var_os(CHILD).is_none() {
        let tmp = tempfile::tempdir().unwrap();
        let status = Command::new(std::env::current_exe().unwrap())
            .arg(rounds.to_string())
            .env(CHILD, "1")
            .env("MOCK_NVML_PROFILE", "h100-80gb-x8")
            .env("MOCK_NVML_MIG", "on")
            .env("MOCK_NVML_STATE", tmp.path().join("state.json"))
            .env("MOCK_NVML_CONTROL", tmp.path().join("control"))
            .env_remove("MOCK_NVML_CONFIG")
            .env_remove("MOCK_NVML_FAIL")
            .status()
            .unwrap();
        std::process::exit(status.code().unwrap_or(1));
    }
    let control = std::env::var("MOCK_NVML_CONTROL").unwrap();
    let rss_start = rss_kib();
    let backend = NvmlBackend::open(Some(&lib)).unwrap();
    let inv = backend.inventory().unwrap();
    assert_eq!(inv.gpus.len(), GPUS);
    let mut devices = Vec::new();
    let mut script = String::new();
    for (g, gpu) in inv.gpus.iter().enumerate() {
        for start in 0..PER_GPU {
            let mig = backend
                .create_mig(&gpu.uuid, 19, Placement { start, size: 1 })
                .unwrap();
            script.push_str(&format!(
                "memory {g} {gi} 0 {mib}\ngpm {g} {gi} {act} 3\n",
                gi = mig.gi_id,
                mib = 512 + start * 100,
                act = 5 + start * 10,
            ));
            devices.push(ClaimDevice {
                claim: ClaimRef {
                    uid: format!("uid-{g}-{start}"),
                    namespace: format!("team-{}", start % 3),
                    name: format!("claim-{g}-{start}"),
                },
                device: format!("gpu-{g}-mig-1g.10gb-{start}"),
                kind: Holding::Mig,
                sharing: None,
                share_id: None,
                gpu_uuid: gpu.uuid.clone(),
                mig: Some(MigRef {
                    uuid: mig.uuid.clone(),
                    gi: mig.gi_id,
                    ci: mig.ci_id,
                }),
                allocated: Allocation {
                    memory_bytes: 9984 << 20,
                    sms: Some(16),
                    mig_profile: Some("1g.10gb".into()),
                },
                pids: Vec::new(),
                pods: Vec::new(),
            });
        }
    }
    std::fs::write(&control, script).unwrap();
    let rss_ready = rss_kib();
    let mut sampler = UsageSampler::new(backend.usage_source().unwrap());
    // Warming round (first GPM sample of every instance).
    let warm = Instant::now();
    let first = sampler.sample(&devices);
    let warm = warm.elapsed();
    let mut times = Vec::with_capacity(rounds);
    let mut queries = 0;
    let mut measured = 0;
    for _ in 0..rounds {
        let t = Instant::now();
        let r = sampler.sample(&devices);
        times.push(t.elapsed());
        queries = r.queries;
        measured = r
            .samples
            .iter()
            .filter(|s| s.activity.percent().is_some())
            .count();
    }
    let rss_end = rss_kib();
    times.sort();
    let mean = times.iter().sum::<Duration>() / rounds.max(1) as u32;
    let p50 = pct(&times, 0.5);
    println!(
        "usage sampling, {} claim devices ({GPUS} GPUs x {PER_GPU} MIG 1g.10gb, H100 mock), {rounds} rounds:",
        devices.len()
    );
    println!(
        "  warming round {:.2} ms ({} errors)",
        warm.as_secs_f64() * 1e3,
        first.samples.iter().map(|s| s.errors.len()).sum::<usize>()
    );
    println!(
        "  round p50 {:.2} ms, p99 {:.2} ms, mean {:.2} ms; {:.1} us per device (p50); p99/p50 {:.2}",
        p50.as_secs_f64() * 1e3,
        pct(&times, 0.99).as_secs_f64() * 1e3,
        mean.as_secs_f64() * 1e3,
        p50.as_secs_f64() * 1e6 / devices.len() as f64,
        pct(&times, 0.99).as_secs_f64() / p50.as_secs_f64().max(1e-9),
    );
    println!(
        "  NVML queries per round {queries} ({:.1} per device); devices with a measured activity {measured}/{}",
        queries as f64 / devices.len() as f64,
        devices.len()
    );
    println!(
        "  resident memory: start {rss_start} KiB, after setup {rss_ready} KiB, after {rounds} rounds {rss_end} KiB (+{} KiB over the rounds)",
        rss_end.saturating_sub(rss_ready)
    );
}
