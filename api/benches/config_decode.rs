//! Cost of turning opaque parameters into an applicable config: decode + default + validate
//! of a typical MPS config, and the per-request merge of 4 entries. Prints criterion's
//! figures (with throughput) and, measured in the same run, the ratio of the strict
//! pipeline to a plain (non-strict, no path tracking) serde decode of the same document.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use cleave_api::config::ConfigError;
use cleave_api::{
    ConfigEntry, ConfigSource, DeviceConfig, GpuConfig, decode_config, merge_configs,
};
use criterion::{Criterion, Throughput, criterion_group};
use serde::Deserialize;
use serde_json::{Value, json};

fn mps_config() -> Value {
    json!({
        "apiVersion": "gpu.cleave.dev/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "MPS",
            "mps": {
                "activeThreadPercentage": 25,
                "pinnedMemoryLimit": {
                    "default": "10Gi",
                    "perDevice": {"GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0": "20Gi", "1": "5Gi"}
                }
            }
        }
    })
}

fn entries() -> Vec<ConfigEntry> {
    let c = decode_config(&mps_config()).unwrap();
    let e = |index, source, requests: &[&str]| ConfigEntry {
        index,
        source,
        requests: requests.iter().map(|s| s.to_string()).collect(),
        config: c.clone(),
    };
    vec![
        e(0, ConfigSource::FromClass, &["gpu"]),
        e(1, ConfigSource::FromClass, &["mig"]),
        e(2, ConfigSource::FromClaim, &[]),
        e(3, ConfigSource::FromClaim, &["mig"]),
    ]
}

fn benches(c: &mut Criterion) {
    let raw = mps_config();
    let mut g = c.benchmark_group("config");
    g.throughput(Throughput::Elements(1));
    g.bench_function("decode_validate_mps", |b| {
        b.iter(|| decode_config(black_box(&raw)).unwrap())
    });
    g.bench_function("plain_serde_from_value_mps", |b| {
        b.iter(|| GpuConfig::deserialize(black_box(&raw)).unwrap())
    });
    let entries = entries();
    let requests = ["gpu", "mig/small", "nic"];
    g.bench_function("merge_4_entries_3_requests", |b| {
        b.iter(|| merge_configs(black_box(&entries), black_box(requests)))
    });
    g.finish();
}

/// Mean time per call over a fixed wall-clock budget.
fn per_call<T>(budget: Duration, mut f: impl FnMut() -> T) -> Duration {
    let start = Instant::now();
    let mut n: u32 = 0;
    while start.elapsed() < budget {
        for _ in 0..64 {
            black_box(f());
        }
        n += 64;
    }
    start.elapsed() / n
}

fn ratio() {
    let raw = mps_config();
    let budget = Duration::from_millis(300);
    let strict = per_call(budget, || -> Result<DeviceConfig, ConfigError> {
        decode_config(&raw)
    });
    let plain = per_call(budget, || GpuConfig::deserialize(&raw));
    let entries = entries();
    let merge = per_call(budget, || {
        merge_configs(&entries, ["gpu", "mig/small", "nic"])
    });
    println!(
        "decode+default+validate: {strict:?}/config ({:.0} configs/s); plain serde: {plain:?}; strict/plain = {:.2}",
        1.0 / strict.as_secs_f64(),
        strict.as_secs_f64() / plain.as_secs_f64()
    );
    println!(
        "merge of 4 entries for 3 requests: {merge:?} ({:.0} merges/s); merge/decode = {:.2}",
        1.0 / merge.as_secs_f64(),
        merge.as_secs_f64() / strict.as_secs_f64()
    );
}

criterion_group! {
    name = config_benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    targets = benches
}

fn main() {
    config_benches();
    ratio();
    Criterion::default().configure_from_args().final_summary();
}
