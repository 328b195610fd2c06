//! `usage --recommend --mock`: a scripted day over the mock NVML library, the reason as
//! the plugin words it.
//!
//! The try makes half the profile's GPUs MIG-enabled and leaves the others whole,
//! creates MIG devices for its MIG claims as an administrator would, describes the claims
//! prepare would record (notebooks, a training job, an inference server, MPS claims), and
//! scripts a day of their usage in the mock's control file, one sampling round every 10
//! minutes of scripted time, each round read through NVML like the plugin's.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use cleave_driver::backend::GpuBackend as _;
use cleave_driver::model::{MigState, NodeInventory, Placement};
use cleave_driver::rightsize::{NodeModes, RightsizePolicy, WindowConfig};
use cleave_driver::usage::{ClaimDevice, Holding, IdlePolicy};

use super::claims::MockClaim;
use crate::metrics::Metrics;
use crate::node::usage::UsageRounds;
use crate::node::usage::recommend::{RightsizeConfig, Rightsizer};
use crate::node::usage::recommend_command::{merge_lines, rows_of, table};

/// The mock node's YAML: the profile's product, half its GPUs in MIG mode.
pub(crate) fn mixed_node(profile: &str) -> anyhow::Result<String> {
    let (product, count) = profile
        .rsplit_once("-x")
        .and_then(|(p, n)| n.parse::<u32>().ok().map(|n| (p, n)))
        .filter(|(_, n)| *n >= 4)
        .with_context(|| {
            format!("usage --recommend --mock: {profile:?} is not <product>-x<count> with 4 or more GPUs (e.g. h100-80gb-x8)")
        })?;
    let mig = count / 2;
    Ok(format!(
        "name: usage-recommend\ngpus:\n  - product: {product}\n    count: {mig}\n    migEnabled: true\n  - product: {product}\n    count: {}\n    migEnabled: false\n",
        count - mig
    ))
}

/// Modes of the mock node: on-demand MIG on, capacity sharing off.
const MOCK_MODES: NodeModes = NodeModes {
    dynamic_mig: true,
    consumable_capacity: cleave_api::pool::ConsumableCapacity::Off,
};

/// A scripted claim: who, where, and its usage at round `i` of 144 (memory MiB, activity
/// percent).
struct Scripted {
    ns: &'static str,
    name: &'static str,
    /// `Some(profile)`: a MIG device of that profile on the first MIG GPU with room.
    mig: Option<&'static str>,
    kind: Holding,
    usage: fn(u64) -> (u64, f64),
}

const SCRIPT: &[Scripted] = &[
    Scripted {
        ns: "team-a",
        name: "notebook",
        mig: Some("3g.40gb"),
        kind: Holding::Mig,
        usage: |i| (3900, if i % 6 == 0 { 9.0 } else { 5.5 }),
    },
    Scripted {
        ns: "team-a",
        name: "notebook-idle",
        mig: Some("1g.10gb"),
        kind: Holding::Mig,
        usage: |_| (300, 0.5),
    },
    Scripted {
        ns: "team-b",
        name: "finetune",
        mig: Some("1g.10gb"),
        kind: Holding::Mig,
        usage: |i| (3000 + i * 45, 60.0),
    },
    Scripted {
        ns: "team-b",
        name: "training",
        mig: None,
        kind: Holding::Whole,
        usage: |i| (61_000, if i % 8 == 0 { 97.0 } else { 70.0 }),
    },
    Scripted {
        ns: "team-c",
        name: "inference",
        mig: None,
        kind: Holding::Whole,
        usage: |i| (12_288, 8.0 + (i % 5) as f64),
    },
    Scripted {
        ns: "team-c",
        name: "embeddings-mps",
        mig: None,
        kind: Holding::Mps,
        usage: |_| (8192, 25.0),
    },
    Scripted {
        ns: "team-d",
        name: "batch-mps-pod",
        mig: None,
        kind: Holding::Mps,
        usage: |_| (4096, 30.0),
    },
];

/// Rounds of scripted time in the mock try (one day, 10 minutes apart).
const MOCK_ROUNDS: u64 = 144;
const MOCK_ROUND_SECONDS: u64 = 600;

/// The mock try: runs the scripted day and renders the table.
pub(crate) fn run(library: &std::path::Path, control: &std::path::Path) -> anyhow::Result<String> {
    let backend = cleave_driver::nvml::NvmlBackend::open(Some(library))
        .context("loading the mock NVML library")?;
    let inventory = backend.inventory().context("reading the mock's GPUs")?;
    let source = backend
        .usage_source()
        .context("the mock backend has no usage source")?;
    let mig_gpus: Vec<usize> = (0..inventory.gpus.len())
        .filter(|g| inventory.gpus[*g].mig.is_enabled())
        .collect();
    let whole_gpus: Vec<usize> = (0..inventory.gpus.len())
        .filter(|g| !inventory.gpus[*g].mig.is_enabled())
        .collect();
    anyhow::ensure!(
        mig_gpus.len() >= 2 && whole_gpus.len() >= 3,
        "usage --recommend --mock needs a MIG-capable profile of 6 or more GPUs (e.g. h100-80gb-x8)"
    );
    let mut devices = Vec::new();
    // (device index, GPU index, GI, pid)
    let mut where_: Vec<(usize, Option<u32>, u32)> = Vec::new();
    let mut next_whole = whole_gpus.iter();
    let mut taken: BTreeMap<usize, Vec<Placement>> = BTreeMap::new();
    for (n, s) in SCRIPT.iter().enumerate() {
        let pid = 5000 + n as u32;
        match s.mig {
            Some(want) => {
                let (g, gi, device) =
                    scripted_mig(&backend, &inventory, &mig_gpus, &mut taken, s, want)?;
                where_.push((g, Some(gi), pid));
                devices.push(device);
            }
            None => {
                let &g = next_whole
                    .next()
                    .context("usage --recommend --mock: not enough whole GPUs")?;
                where_.push((g, None, pid));
                devices.push(scripted_whole(&inventory.gpus[g], s, pid));
            }
        }
    }
    // The inventory with the instances just created.
    let inventory: NodeInventory = backend.inventory().context("reading the mock's GPUs")?;
    let config = RightsizeConfig {
        window: WindowConfig::default(),
        policy: RightsizePolicy::default(),
        modes: MOCK_MODES,
    };
    let mut rounds = UsageRounds::new(source, IdlePolicy::default())
        .with_rightsizer(Rightsizer::in_memory(config));
    let metrics = Metrics::new();
    let day_ago = SystemTime::now() - Duration::from_secs(MOCK_ROUNDS * MOCK_ROUND_SECONDS);
    let mut last = None;
    for i in 0..MOCK_ROUNDS {
        let script = round_script(i, &where_);
        std::fs::write(control, script)
            .with_context(|| format!("writing {}", control.display()))?;
        let wall = day_ago + Duration::from_secs(i * MOCK_ROUND_SECONDS);
        let r = rounds.round_with(&devices, Instant::now(), wall, Some(&inventory));
        last = Some(r);
    }
    let last = last.context("no round")?;
    let outcome = last.rightsize.clone().unwrap_or_default();
    metrics.rightsize.apply("mock-node", &outcome);
    let mut out = table(
        &rows_of(&outcome),
        &[(
            "mock-node".into(),
            outcome.savings.held as u64,
            outcome.savings.needed as u64,
        )],
    );
    out.push_str(&merge_lines("mock-node", &outcome.merges));
    Ok(out)
}

/// A MIG device for `s` (profile `want`) on the first MIG GPU with room, created on the
/// mock: its GPU index, GPU-instance id and claim device.
fn scripted_mig(
    backend: &cleave_driver::nvml::NvmlBackend,
    inventory: &NodeInventory,
    mig_gpus: &[usize],
    taken: &mut BTreeMap<usize, Vec<Placement>>,
    s: &Scripted,
    want: &str,
) -> anyhow::Result<(usize, u32, ClaimDevice)> {
    let (g, gpu, profile, placement) = mig_gpus
        .iter()
        .find_map(|&g| {
            let gpu = &inventory.gpus[g];
            let MigState::Enabled { profiles, .. } = &gpu.mig else {
                return None;
            };
            let p = profiles.iter().find(|p| p.name == want)?;
            let used = taken.get(&g).cloned().unwrap_or_default();
            let pl = p
                .placements
                .iter()
                .find(|pl| !used.iter().any(|u| u.overlaps(pl)))?;
            Some((g, gpu, p.clone(), *pl))
        })
        .with_context(|| format!("usage --recommend --mock: no room for {want}"))?;
    let mig = backend
        .create_mig(&gpu.uuid, profile.id, placement)
        .with_context(|| format!("creating a {want} instance on the mock"))?;
    taken.entry(g).or_default().push(placement);
    let claim = MockClaim {
        namespace: s.ns,
        name: s.name,
        kind: Holding::Mig,
        pids: Vec::new(),
    };
    Ok((g, mig.gi_id, claim.on_mig(gpu, &profile, &mig)))
}

/// A whole-GPU claim device for `s` on `gpu`; an MPS claim's daemon runs as `pid`, except
/// a pod-run one (no host PID in the record).
fn scripted_whole(gpu: &cleave_driver::model::GpuInfo, s: &Scripted, pid: u32) -> ClaimDevice {
    let pids = if s.kind == Holding::Mps && !s.name.ends_with("-pod") {
        vec![pid]
    } else {
        Vec::new()
    };
    MockClaim {
        namespace: s.ns,
        name: s.name,
        kind: s.kind,
        pids,
    }
    .on_gpu(gpu)
}

/// The mock control script of round `i`: every scripted claim's memory and activity.
fn round_script(i: u64, where_: &[(usize, Option<u32>, u32)]) -> String {
    let mut script = String::new();
    for (s, (g, gi, pid)) in SCRIPT.iter().zip(where_) {
        let (mib, act) = (s.usage)(i);
        match (s.kind, gi) {
            (Holding::Mps, _) => {
                let _ = writeln!(script, "process {g} {pid} {mib} {}", act as u32);
            }
            (_, Some(gi)) => {
                let _ = writeln!(script, "memory {g} {gi} 0 {mib}");
                let _ = writeln!(script, "gpm {g} {gi} {act} {}", act / 2.0);
            }
            (_, None) => {
                let _ = writeln!(script, "memory {g} {mib}");
                let _ = writeln!(script, "gpm {g} {act} {}", act / 2.0);
            }
        }
    }
    script
}
