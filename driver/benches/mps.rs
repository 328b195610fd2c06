//! Time from apply to ready for an MPS claim, with the fake tools of `cleave-fakes`, split
//! into the daemon start (launch until its PID is known, then until it answers) and the rest
//! (directories, record, compute mode, limits and their check). Prints figures; asserts
//! nothing.
//!
//! `cargo bench -p cleave-driver --bench mps` (or `-- <rounds>`). Like the sharing tests,
//! the binary plays the tools itself (dispatch on `argv[0]`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::path::Path;
use std::time::{Duration, Instant};

use cleave_api::config::{DeviceKind, Sharing};
use cleave_driver::model::{GpuInfo, MigState};
use cleave_driver::sharing::{
    GpuFacts, MpsTimings, SharingBinaries, SharingConfig, SharingDevice, SharingManager,
};

const GPU: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000001";

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(code) = cleave_fakes::dispatch(&args) {
        std::process::exit(code);
    }
    let rounds: usize = args
        .iter()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(30);

    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let exe = std::env::current_exe().unwrap();
    for tool in ["nvidia-cuda-mps-control", "nvidia-smi"] {
        std::os::unix::fs::symlink(&exe, bin.join(tool)).unwrap();
    }
    std::fs::write(root.join("boot_id"), "bench\n").unwrap();
    let binaries = SharingBinaries::under_driver_root(Path::new("/nonexistent")).with_overrides(
        Some(bin.join("nvidia-cuda-mps-control")),
        Some(bin.join("nvidia-smi")),
    );
    let mut config = SharingConfig::new(root.join("state"), binaries);
    config.boot_id_path = root.join("boot_id");
    config.extra_env = vec![("FAKE_MPS_IDLE_EXIT_SECS".into(), "60".into())];
    let manager = SharingManager::new(config);
    let gpu = GpuInfo {
        uuid: GPU.into(),
        ..cleave_driver::prepare::testing::h100_gpu(0, MigState::NotCapable)
    };
    let mut sharing: Sharing = serde_json::from_value(serde_json::json!({
        "strategy": "MPS",
        "mps": {"activeThreadPercentage": 25, "pinnedMemoryLimit": {"default": "10Gi"}}
    }))
    .unwrap();
    sharing.apply_defaults();
    let devices = [SharingDevice {
        device_name: "gpu-0".into(),
        kind: DeviceKind::Gpu,
        uuid: GPU.into(),
        gpu_uuid: GPU.into(),
        gpu: Some(GpuFacts::of(&gpu, "gpu-0")),
        sharing,
    }];

    let mut apply = Vec::with_capacity(rounds);
    let mut release = Vec::with_capacity(rounds);
    let mut parts: Vec<MpsTimings> = Vec::with_capacity(rounds);
    // One warm-up round (page cache, first exec of the binary).
    for round in 0..=rounds {
        let uid = format!("bench-{round}");
        let t = Instant::now();
        let edits = manager.apply_claim(&uid, &devices, &[]).unwrap();
        let a = t.elapsed();
        let timings = manager.last_mps_timings().unwrap();
        let t = Instant::now();
        manager
            .release_claim(&uid, edits.state.as_ref(), &[])
            .unwrap();
        let r = t.elapsed();
        if round > 0 {
            apply.push(a);
            release.push(r);
            parts.push(timings);
        }
    }

    let launch: Vec<Duration> = parts.iter().map(|p| p.launch).collect();
    let ready: Vec<Duration> = parts.iter().map(|p| p.ready).collect();
    let start: Vec<Duration> = parts.iter().map(|p| p.launch + p.ready).collect();
    let setup: Vec<Duration> = parts.iter().map(|p| p.setup).collect();
    let limits: Vec<Duration> = parts.iter().map(|p| p.limits).collect();
    let rest: Vec<Duration> = apply
        .iter()
        .zip(&start)
        .map(|(a, s)| a.saturating_sub(*s))
        .collect();

    println!("MPS claim apply -> ready, fake tools, {rounds} rounds (p50 / p90 / max)");
    for (name, values) in [
        ("apply total", &apply),
        ("  daemon start (launch+ready)", &start),
        ("    launch (-d until PID)", &launch),
        ("    ready (until it answers)", &ready),
        ("  rest (apply - daemon start)", &rest),
        ("    setup (dirs, record, compute mode)", &setup),
        ("    limits (set + check)", &limits),
        ("release (quit, wait, restore, rm)", &release),
    ] {
        let (p50, p90, max) = summary(values);
        println!("{name:<40} {p50:>10.2?} {p90:>10.2?} {max:>10.2?}");
    }
    let (a50, ..) = summary(&apply);
    let (s50, ..) = summary(&start);
    println!(
        "daemon start share of apply (p50): {:.0}%",
        100.0 * s50.as_secs_f64() / a50.as_secs_f64()
    );
}

fn summary(values: &[Duration]) -> (Duration, Duration, Duration) {
    let mut v = values.to_vec();
    v.sort();
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    (at(0.5), at(0.9), at(1.0))
}
