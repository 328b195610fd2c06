//! Prepare latency of the sharing model's cells against their equivalents on a node without
//! consumable capacity, measured in the same run with the same fake tools: a whole-device
//! share with an MPS config (the MPS class on an `mps` node) against a per-claim MPS claim
//! on an `off` node, and a whole-device share without config against a whole GPU. Prints
//! p50/p99 and the ratios; asserts nothing.
//!
//! `cargo bench -p cleave-driver --bench composition` (or `-- <rounds>`, default 40). The
//! binary plays the fake MPS and `nvidia-smi` tools itself (dispatch on `argv[0]`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_api::names::DRIVER_NAME;
use cleave_api::pool::ConsumableCapacity;
use cleave_driver::driver_root::DriverRootConfig;
use cleave_driver::prepare::testing::{FakeBackend, inventory, plain_gpu};
use cleave_driver::prepare::{DriverConfig, NodeDriver};
use cleave_driver::sharing::{SharingBinaries, SharingConfig, SharingManager};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;

fn node(root: &Path, mode: ConsumableCapacity) -> NodeDriver {
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let exe = std::env::current_exe().unwrap();
    for tool in ["nvidia-cuda-mps-control", "nvidia-smi"] {
        std::os::unix::fs::symlink(&exe, bin.join(tool)).unwrap();
    }
    std::fs::write(root.join("boot_id"), "bench\n").unwrap();
    let driver_root = root.join("driver-root");
    mock_nvml::driver_root::DriverRootFixture::with_minors(0..8)
        .lay_out(&driver_root)
        .unwrap();
    let state: PathBuf = root.join("state");
    let binaries = SharingBinaries::under_driver_root(Path::new("/nonexistent")).with_overrides(
        Some(bin.join("nvidia-cuda-mps-control")),
        Some(bin.join("nvidia-smi")),
    );
    let mut sharing = SharingConfig::new(&state, binaries);
    sharing.boot_id_path = root.join("boot_id");
    sharing.pipe_root = Some(root.join("run"));
    sharing.extra_env = vec![
        ("FAKE_MPS_IDLE_EXIT_SECS".into(), "60".into()),
        (
            "FAKE_NVIDIA_SMI_STATE".into(),
            root.join("smi-state").display().to_string(),
        ),
    ];
    let config = DriverConfig {
        driver_name: DRIVER_NAME.into(),
        pool_name: "node-a".into(),
        state_dir: state,
        cdi_root: root.join("cdi"),
        driver_root: DriverRootConfig {
            root: driver_root.clone(),
            host_root: None,
            dev_root: Some(driver_root),
            proc_root: root.join("proc"),
        },
        dynamic_mig: false,
        boot_id_path: root.join("boot_id"),
        cdi_hook: None,
        consumable_capacity: mode,
    };
    let backend = Arc::new(FakeBackend::new(inventory(vec![plain_gpu(0)])));
    NodeDriver::start_with_sharing(config, backend, Arc::new(SharingManager::new(sharing))).unwrap()
}

/// A claim of `gpu-0`: a whole-device share when `share`, with the MPS class's config when
/// `mps`.
fn claim(uid: &str, share: bool, mps: bool) -> ResourceClaim {
    let mut r =
        json!({"request": "gpu", "driver": DRIVER_NAME, "pool": "node-a", "device": "gpu-0"});
    if share {
        // What the fake L4 publishes whole: 24Gi, 58 SMs.
        r["shareID"] = json!("aaaaaaaa-0000-4000-8000-00000000000a");
        r["consumedCapacity"] = json!({"memory": "24Gi", "multiprocessors": "58"});
    }
    let config = if mps {
        json!([{"source": "FromClass", "requests": ["gpu"], "opaque": {"driver": DRIVER_NAME, "parameters": {
            "apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50, "pinnedMemoryLimit": {"default": "10Gi"}}}}}}])
    } else {
        json!([])
    };
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default", "uid": uid},
        "spec": {"devices": {}},
        "status": {"allocation": {"devices": {"results": [r], "config": config}}}
    }))
    .unwrap()
}

/// Prepare latencies of `rounds` prepare/unprepare cycles of one claim shape.
fn measure(driver: &NodeDriver, rounds: usize, share: bool, mps: bool) -> Vec<Duration> {
    let mut out = Vec::with_capacity(rounds);
    for i in 0..rounds {
        let uid = format!("{i:08x}-0000-4000-8000-000000000001");
        let c = claim(&uid, share, mps);
        let started = Instant::now();
        driver.prepare(&c).unwrap();
        out.push(started.elapsed());
        driver.unprepare(&uid).unwrap();
    }
    out
}

fn pct(values: &[Duration], p: f64) -> Duration {
    let mut v = values.to_vec();
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(code) = cleave_fakes::dispatch(&args) {
        std::process::exit(code);
    }
    let rounds: usize = args
        .iter()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(40);
    let off_dir = tempfile::tempdir().unwrap();
    let mps_dir = tempfile::tempdir().unwrap();
    let off = node(off_dir.path(), ConsumableCapacity::Off);
    let shared = node(mps_dir.path(), ConsumableCapacity::Mps);
    // Warm up both, then alternate the pairs so that load hits them alike.
    measure(&off, 3, false, true);
    measure(&shared, 3, true, true);
    let (mut a, mut b, mut c, mut d) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds.div_ceil(10) {
        a.extend(measure(&off, 10, false, true));
        b.extend(measure(&shared, 10, true, true));
        c.extend(measure(&off, 10, false, false));
        d.extend(measure(&shared, 10, true, false));
    }
    let line = |what: &str, base: &[Duration], cell: &[Duration]| {
        let (b50, b99, c50, c99) = (
            pct(base, 0.5),
            pct(base, 0.99),
            pct(cell, 0.5),
            pct(cell, 0.99),
        );
        println!(
            "{what}: off node p50 {:.2} ms p99 {:.2} ms | mps node p50 {:.2} ms p99 {:.2} ms | ratio p50 {:.2}x p99 {:.2}x ({} samples each)",
            b50.as_secs_f64() * 1e3,
            b99.as_secs_f64() * 1e3,
            c50.as_secs_f64() * 1e3,
            c99.as_secs_f64() * 1e3,
            c50.as_secs_f64() / b50.as_secs_f64(),
            c99.as_secs_f64() / b99.as_secs_f64(),
            base.len()
        );
    };
    line(
        "per-claim MPS (MPS class): whole GPU vs whole-device share",
        &a,
        &b,
    );
    line("no sharing: whole GPU vs whole-device share", &c, &d);
}
