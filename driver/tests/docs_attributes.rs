//! `docs/attributes.md` documents every attribute and capacity the node publishes.
//!
//! For every mock node profile the pool is built the three ways a node publishes it
//! (on-demand MIG, static MIG with an instance of every profile, static without
//! instances) and every attribute and capacity name of every device must appear
//! backticked in the first cell of a table row of the page. Removing a row from the page,
//! or publishing a new name without one, fails this test.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;

use cleave_driver::backend::GpuBackend;
use cleave_driver::model::MigState;
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::pool::{PoolOptions, build_pool};

use common::{PROFILES, gpu, mock_lib, run_child, scenario};

fn page() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/attributes.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Backticked names in the first cell of every table row of `text`.
fn documented_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines().map(str::trim) {
        let Some(row) = line.strip_prefix('|') else {
            continue;
        };
        let first = row.split('|').next().unwrap_or("");
        names.extend(
            first
                .split('`')
                .enumerate()
                .filter(|(i, _)| i % 2 == 1)
                .map(|(_, t)| t.to_owned()),
        );
    }
    names
}

/// Attribute and capacity names of the pools this (child) process's mock node publishes.
fn published_names() -> (BTreeSet<String>, BTreeSet<String>) {
    let backend = NvmlBackend::open(Some(&mock_lib())).expect("mock NVML opens");
    let mut pools = Vec::new();
    let inv = backend.inventory().unwrap();
    pools.push(build_pool(
        &inv,
        &PoolOptions {
            dynamic_mig: true,
            ..Default::default()
        },
    ));
    pools.push(build_pool(&inv, &PoolOptions::default()));
    // Static MIG: one instance of every profile that still fits on GPU 0, at its first
    // free placement, so that existing instances (with their UUID) are published too.
    let g0 = gpu(&inv, 0);
    if let MigState::Enabled { profiles, .. } = &g0.mig {
        let uuid = g0.uuid.clone();
        let mut made = 0;
        for p in profiles {
            for placement in &p.placements {
                if backend.create_mig(&uuid, p.id, *placement).is_ok() {
                    made += 1;
                    break;
                }
            }
        }
        assert!(made > 0, "no MIG instance could be created on GPU 0");
        let inv = backend.inventory().unwrap();
        let stat = build_pool(&inv, &PoolOptions::default());
        assert!(stat.device_count() > 0);
        pools.push(stat);
    }
    let mut attributes = BTreeSet::new();
    let mut capacities = BTreeSet::new();
    for pool in &pools {
        for d in pool.devices() {
            attributes.extend(d.attributes.iter().flatten().map(|(k, _)| k.clone()));
            capacities.extend(d.capacity.iter().flatten().map(|(k, _)| k.clone()));
        }
    }
    (attributes, capacities)
}

#[test]
fn every_published_name_is_documented() {
    if let Some(profile) = scenario() {
        let documented = documented_names(&page());
        let (attributes, capacities) = published_names();
        assert!(
            attributes.contains("uuid") && capacities.contains("memory"),
            "{profile}: nothing published? {attributes:?} {capacities:?}"
        );
        let missing: Vec<&String> = attributes
            .iter()
            .chain(&capacities)
            .filter(|n| !documented.contains(*n))
            .collect();
        assert!(
            missing.is_empty(),
            "{profile}: docs/attributes.md has no table row for {missing:?} (write the name backticked in the first cell)"
        );
        println!(
            "{profile}: {} attributes, {} capacities documented",
            attributes.len(),
            capacities.len()
        );
        return;
    }
    std::thread::scope(|s| {
        for profile in PROFILES {
            s.spawn(move || {
                run_child(
                    "every_published_name_is_documented",
                    profile,
                    &[("MOCK_NVML_PROFILE", profile)],
                )
            });
        }
    });
}

#[test]
fn documented_names_reads_first_cells_only() {
    assert_eq!(
        documented_names("| `a`, `b` | `c` |\n`d`\n| x | `e` |"),
        ["a", "b"].map(String::from).into()
    );
}
