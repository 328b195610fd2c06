//! Human-readable views of the device model and the published pool (the plugin's
//! `inspect` command, logs on start). The YAML of real ResourceSlices comes from the
//! controller crate; this module only renders tables.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use cleave_api::names::{DeviceName, attr, cap};
use cleave_api::pool::PoolDevices;
use k8s_openapi::api::resource::v1::{CounterSet, Device};

use crate::model::{GpuInfo, MigState, NodeInventory};

/// Renders the node as aligned text: a summary line, one row per GPU, then per GPU the
/// devices published for it (name, type, profile, placement, memory, SMs, UUID) and the
/// state of its counters (on-demand MIG).
pub fn render_table(inv: &NodeInventory, pool: &PoolDevices) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "NVIDIA driver {} (CUDA {}), {} GPU{}, {} device{} published",
        inv.driver_version,
        inv.cuda_driver_semver,
        inv.gpus.len(),
        plural(inv.gpus.len()),
        pool.device_count(),
        plural(pool.device_count()),
    );
    if inv.gpus.is_empty() {
        return out;
    }

    // Devices and counter sets by GPU minor.
    let mut devices: BTreeMap<u32, Vec<&Device>> = BTreeMap::new();
    let mut sets: BTreeMap<u32, Vec<&CounterSet>> = BTreeMap::new();
    for group in &pool.groups {
        for d in &group.devices {
            if let Ok(n) = d.name.parse::<DeviceName>() {
                devices.entry(n.minor()).or_default().push(d);
            }
        }
        if let Some(minor) = group
            .devices
            .first()
            .and_then(|d| d.name.parse::<DeviceName>().ok())
            .map(|n| n.minor())
        {
            sets.entry(minor)
                .or_default()
                .extend(group.counter_sets.iter());
        }
    }

    let mut rows = vec![row([
        "GPU", "PRODUCT", "MEMORY", "SMS", "MIG", "PCI BUS", "UUID", "DEVICES",
    ])];
    for gpu in &inv.gpus {
        rows.push(vec![
            gpu.minor.to_string(),
            gpu.product_name.clone(),
            human_bytes(gpu.memory_bytes),
            gpu.multiprocessors
                .map_or_else(|| "-".into(), |s| s.to_string()),
            mig_mode(gpu),
            gpu.pci_bus_id.clone(),
            gpu.uuid.clone(),
            devices.get(&gpu.minor).map_or(0, Vec::len).to_string(),
        ]);
    }
    out.push('\n');
    write_rows(&mut out, &rows, "");

    for gpu in &inv.gpus {
        let _ = writeln!(out, "\ngpu-{} ({}):", gpu.minor, gpu.product_name);
        let Some(devs) = devices.get(&gpu.minor) else {
            // Only a MIG-enabled GPU can publish nothing; say why and what to do.
            let reason = match &gpu.mig {
                MigState::Enabled { profiles, .. } if profiles.is_empty() => {
                    Some(crate::pool::SilentReason::MigWithoutProfiles)
                }
                MigState::Enabled { .. } => Some(crate::pool::SilentReason::MigWithoutInstances),
                _ => None,
            };
            match reason {
                Some(r) => {
                    let _ = writeln!(out, "  no devices published: {r}");
                }
                None => {
                    let _ = writeln!(out, "  no devices published");
                }
            }
            continue;
        };
        let gpu_sets = sets.get(&gpu.minor).map(Vec::as_slice).unwrap_or(&[]);
        let mut rows = vec![row([
            "DEVICE", "TYPE", "PROFILE", "SLICES", "MEMORY", "SMS", "STATE", "UUID",
        ])];
        for d in devs {
            let state = if d.consumes_counters.is_none() {
                if string_attr(d, attr::TYPE).as_deref() == Some("mig") {
                    "exists"
                } else {
                    "-"
                }
            } else if is_taken(d, gpu_sets) {
                "blocked"
            } else {
                "on demand"
            };
            rows.push(vec![
                d.name.clone(),
                string_attr(d, attr::TYPE).unwrap_or_else(|| "-".into()),
                string_attr(d, attr::PROFILE).unwrap_or_else(|| "-".into()),
                placement(d),
                capacity(d, cap::MEMORY)
                    .and_then(|q| parse_quantity(&q))
                    .map_or_else(|| "-".into(), human_bytes),
                capacity(d, cap::MULTIPROCESSORS).unwrap_or_else(|| "-".into()),
                state.to_owned(),
                string_attr(d, attr::UUID).unwrap_or_else(|| "-".into()),
            ]);
        }
        write_rows(&mut out, &rows, "  ");
        for set in gpu_sets {
            let _ = writeln!(out, "  counters {}: {}", set.name, counters_summary(set));
        }
    }
    out
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

fn row<const N: usize>(cells: [&str; N]) -> Vec<String> {
    cells.iter().map(|s| (*s).to_owned()).collect()
}

/// Writes rows with columns padded to their widest cell (last column unpadded).
fn write_rows(out: &mut String, rows: &[Vec<String>], indent: &str) {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in rows {
        let mut line = String::from(indent);
        for (c, cell) in r.iter().enumerate() {
            if c + 1 == r.len() {
                line.push_str(cell);
            } else {
                let pad = widths[c] - cell.chars().count();
                line.push_str(cell);
                line.extend(std::iter::repeat_n(' ', pad + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

fn mig_mode(gpu: &GpuInfo) -> String {
    match &gpu.mig {
        MigState::NotCapable => "n/a".into(),
        MigState::Disabled { .. } => "disabled".into(),
        MigState::Enabled { instances, .. } => match instances.len() {
            0 => "enabled".into(),
            n => format!("enabled, {n} instance{}", plural(n)),
        },
    }
}

fn string_attr(d: &Device, name: &str) -> Option<String> {
    d.attributes.as_ref()?.get(name)?.string.clone()
}

fn int_attr(d: &Device, name: &str) -> Option<i64> {
    d.attributes.as_ref()?.get(name)?.int
}

fn capacity(d: &Device, name: &str) -> Option<String> {
    Some(d.capacity.as_ref()?.get(name)?.value.0.clone())
}

fn placement(d: &Device) -> String {
    match (
        int_attr(d, attr::PLACEMENT_START),
        int_attr(d, attr::PLACEMENT_SIZE),
    ) {
        (Some(start), Some(size)) if size > 1 => format!("{start}-{}", start + size - 1),
        (Some(start), Some(_)) => start.to_string(),
        _ => "all".into(),
    }
}

/// True if the device consumes a counter that has nothing left (someone else's instance).
fn is_taken(d: &Device, sets: &[&CounterSet]) -> bool {
    d.consumes_counters.iter().flatten().any(|c| {
        sets.iter().filter(|s| s.name == c.counter_set).any(|s| {
            c.counters.iter().any(|(k, need)| {
                let have = s.counters.get(k).and_then(|v| parse_quantity(&v.value.0));
                let need = parse_quantity(&need.value.0);
                matches!((have, need), (Some(h), Some(n)) if h < n)
            })
        })
    })
}

fn counters_summary(set: &CounterSet) -> String {
    let mut mem_total = 0;
    let mut mem_free = 0;
    let mut others = Vec::new();
    for (k, v) in &set.counters {
        let value = parse_quantity(&v.value.0).unwrap_or(0);
        if k.starts_with("memory-slice-") {
            mem_total += 1;
            if value > 0 {
                mem_free += 1;
            }
        } else {
            others.push(format!("{k} {value}"));
        }
    }
    let mut parts = vec![format!("memory slices free {mem_free}/{mem_total}")];
    parts.extend(others);
    parts.join(", ")
}

/// Parses the canonical quantities the pool builder writes (`81559Mi`, `40Gi`, `132`, `1k`).
fn parse_quantity(q: &str) -> Option<u64> {
    let split = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (num, suffix) = q.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// Bytes as GiB with one decimal (`79.6 GiB`), MiB below 1 GiB.
fn human_bytes(b: u64) -> String {
    const GIB: u64 = 1 << 30;
    if b >= GIB {
        format!("{:.1} GiB", b as f64 / GIB as f64)
    } else {
        format!("{} MiB", b >> 20)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{MigInstance, MigProfile, Placement};
    use crate::pool::{PoolOptions, build_pool};

    fn inventory() -> NodeInventory {
        let gpu = |minor: u32, mig: MigState| GpuInfo {
            uuid: format!("GPU-{minor}"),
            pci_bus_id: format!("0000:{:02x}:00.0", 0x53 + minor),
            ..crate::prepare::testing::h100_gpu(minor, mig)
        };
        // Two of the H100's profiles: 1g.10gb and 7g.80gb.
        let profiles: Vec<MigProfile> = crate::prepare::testing::h100_profiles()
            .into_iter()
            .filter(|p| p.id == 19 || p.id == 0)
            .collect();
        NodeInventory {
            driver_version: "580.105.08".into(),
            driver_semver: "580.105.8".into(),
            cuda_driver_semver: "13.0.0".into(),
            gpus: vec![
                gpu(0, MigState::NotCapable),
                gpu(
                    1,
                    MigState::Enabled {
                        profiles,
                        instances: vec![MigInstance {
                            uuid: "MIG-x".into(),
                            profile_id: 19,
                            profile_name: "1g.10gb".into(),
                            gi_id: 13,
                            ci_id: 0,
                            placement: Placement { start: 6, size: 1 },
                        }],
                        memory_slices: 8,
                    },
                ),
            ],
        }
    }

    #[test]
    fn table_shows_gpus_devices_and_counters() {
        let inv = inventory();
        let pool = build_pool(
            &inv,
            &PoolOptions {
                dynamic_mig: true,
                ..Default::default()
            },
        );
        let t = render_table(&inv, &pool);
        assert!(
            t.starts_with("NVIDIA driver 580.105.08 (CUDA 13.0.0), 2 GPUs, 10 devices published\n")
        );
        assert!(t.contains("\ngpu-1 (NVIDIA H100 80GB HBM3):\n"), "{t}");
        let line = |needle: &str| {
            t.lines()
                .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
                .find(|l| l.starts_with(needle))
                .unwrap_or_else(|| panic!("no line for {needle} in\n{t}"))
        };
        assert_eq!(
            line("0 "),
            "0 NVIDIA H100 80GB HBM3 79.6 GiB 132 n/a 0000:53:00.0 GPU-0 1"
        );
        assert_eq!(
            line("1 "),
            "1 NVIDIA H100 80GB HBM3 79.6 GiB 132 enabled, 1 instance 0000:54:00.0 GPU-1 9"
        );
        assert_eq!(line("gpu-0 gpu"), "gpu-0 gpu - all 79.6 GiB 132 - GPU-0");
        assert_eq!(
            line("gpu-1 gpu"),
            "gpu-1 gpu - all 79.6 GiB 132 blocked GPU-1"
        );
        assert_eq!(
            line("gpu-1-mig-7g80gb-0"),
            "gpu-1-mig-7g80gb-0 mig 7g.80gb 0-7 79.2 GiB 132 blocked -"
        );
        assert_eq!(
            line("gpu-1-mig-1g10gb-5"),
            "gpu-1-mig-1g10gb-5 mig 1g.10gb 5 9.8 GiB 16 on demand -"
        );
        assert_eq!(
            line("counters gpu-1-counters"),
            "counters gpu-1-counters: memory slices free 7/8, compute-slices 6"
        );
        let t_static = render_table(&inv, &build_pool(&inv, &PoolOptions::default()));
        let static_row = t_static
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .find(|l| l.starts_with("gpu-1-mig"))
            .unwrap();
        assert_eq!(
            static_row,
            "gpu-1-mig-1g10gb-6 mig 1g.10gb 6 9.8 GiB 16 exists MIG-x"
        );
        // Columns line up: every device row of gpu-1 has its TYPE at the same offset.
        let offsets: Vec<usize> = t
            .lines()
            .filter(|l| l.starts_with("  gpu-1"))
            .map(|l| l.find(" mig ").or_else(|| l.find(" gpu ")).unwrap())
            .collect();
        assert!(offsets.windows(2).all(|w| w[0] == w[1]), "{t}");
    }

    #[test]
    fn empty_node() {
        let inv = NodeInventory {
            driver_version: "570.148.08".into(),
            driver_semver: "570.148.8".into(),
            cuda_driver_semver: "12.8.0".into(),
            gpus: vec![],
        };
        assert_eq!(
            render_table(&inv, &PoolDevices::default()),
            "NVIDIA driver 570.148.08 (CUDA 12.8.0), 0 GPUs, 0 devices published\n"
        );
    }

    #[test]
    fn quantities_and_sizes() {
        assert_eq!(parse_quantity("81559Mi"), Some(81559 << 20));
        assert_eq!(parse_quantity("1k"), Some(1000));
        assert_eq!(parse_quantity("1.5Gi"), None);
        assert_eq!(human_bytes(9984 << 20), "9.8 GiB");
        assert_eq!(human_bytes(512 << 20), "512 MiB");
        assert_eq!(human_bytes(40 << 30), "40.0 GiB");
    }
}
