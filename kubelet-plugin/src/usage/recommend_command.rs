//! `cleave-kubelet-plugin usage --recommend`: per claim device what it holds, what it used
//! over the window, the recommended shape and why, and the node's GPUs held against the
//! GPUs the recommendations would need. From a running plugin's `/metrics` (the reason is
//! rebuilt from the window series and the recommendation's labels), or from a scripted
//! day over the mock NVML library (`--mock PROFILE`, the reason as the plugin words it).
//!
//! The mock try makes half the profile's GPUs MIG-enabled and leaves the others whole,
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
use cleave_driver::rightsize::advice::gib;
use cleave_driver::rightsize::{Advice, NodeModes, RightsizePolicy, WindowConfig};
use cleave_driver::usage::{
    Allocation, ClaimDevice, ClaimRef, Holding, IdlePolicy, MigRef, SharingStrategy,
};

use super::UsageRounds;
use super::command::Sample;
use super::recommend::{RightsizeConfig, RightsizeOutcome, Rightsizer};
use crate::metrics::Metrics;

const P: &str = "cleave_kubelet_plugin_";

/// One row of the table.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Row {
    /// `namespace/claim`.
    pub claim: String,
    /// Device name.
    pub device: String,
    /// What it holds.
    pub holds: String,
    /// What it used over the window.
    pub used: String,
    /// The recommendation.
    pub recommends: String,
    /// Why.
    pub why: String,
}

/// The table and the node's figure.
pub fn table(rows: &[Row], savings: &[(String, u64, u64)]) -> String {
    if rows.is_empty() {
        return "no prepared claims are sampled (none prepared, or --usage-interval=0)\n".into();
    }
    let mut cells = vec![[
        "NAMESPACE/CLAIM".to_owned(),
        "DEVICE".to_owned(),
        "HOLDS".to_owned(),
        "USED OVER WINDOW".to_owned(),
        "RECOMMENDS".to_owned(),
        "WHY".to_owned(),
    ]];
    for r in rows {
        cells.push([
            r.claim.clone(),
            r.device.clone(),
            r.holds.clone(),
            r.used.clone(),
            r.recommends.clone(),
            r.why.clone(),
        ]);
    }
    let mut widths = [0usize; 6];
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for row in &cells {
        let mut line = String::new();
        for (i, (w, c)) in widths.iter().zip(row).enumerate() {
            if i + 1 == row.len() {
                line.push_str(c);
            } else {
                let _ = write!(line, "{c:<w$}  ");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    for (pool, held, needed) in savings {
        let _ = writeln!(
            out,
            "\nnode {pool}: the claims hold {held} GPU(s); their recommended shapes would need {needed} (packed first fit): {} freed",
            held.saturating_sub(*needed)
        );
    }
    out
}

fn holds(d: &ClaimDevice) -> String {
    let mut s = gib(d.allocated.memory_bytes);
    if let Some(p) = &d.allocated.mig_profile {
        let _ = write!(s, ", {p}");
    }
    if let Some(sms) = d.allocated.sms {
        let _ = write!(s, ", {sms} SMs");
    }
    if let Some(sharing) = d.sharing {
        let _ = write!(s, ", {}", sharing.label());
    }
    s
}

fn recommends(advice: &Advice, served: bool) -> String {
    let mut s = match advice {
        Advice::Pending => "pending".to_owned(),
        Advice::Release => "idle: release".into(),
        Advice::NotAttributable => "not attributable".into(),
        Advice::Shape(cleave_driver::rightsize::Shape::Mig { profile, .. }) => profile.clone(),
        Advice::Shape(cleave_driver::rightsize::Shape::Share { memory_bytes, sms }) => {
            format!("share {} MiB, {sms} SMs", memory_bytes >> 20)
        }
        Advice::Shape(cleave_driver::rightsize::Shape::WholeGpu { .. }) => "whole GPU".into(),
    };
    if !served {
        s.push_str(" (not served here)");
    }
    s
}

/// Rows from an in-process round.
pub fn rows_of(outcome: &RightsizeOutcome) -> Vec<Row> {
    let mut rows: Vec<Row> = outcome
        .entries
        .iter()
        .map(|e| {
            let st = &e.stats;
            let used = match (st.peak_memory, st.p95_activity, st.mean_activity) {
                (Some(peak), Some(p95), Some(mean)) => format!(
                    "peak {} (p95 {}), SM p95 {p95:.0}% mean {mean:.1}%",
                    gib(peak),
                    gib(st.p95_memory.unwrap_or(peak))
                ),
                (Some(peak), _, _) => format!("peak {}, SM n/a", gib(peak)),
                _ => "not attributable".into(),
            };
            Row {
                claim: format!("{}/{}", e.device.claim.namespace, e.device.claim.name),
                device: e.device.device.clone(),
                holds: holds(&e.device),
                used,
                recommends: recommends(&e.recommendation.advice, e.recommendation.served),
                why: e.recommendation.reason.clone(),
            }
        })
        .collect();
    rows.sort_by(|a, b| (&a.claim, &a.device).cmp(&(&b.claim, &b.device)));
    rows
}

/// Rows and node figures from one scrape of a running plugin.
pub fn rows_of_scrape(samples: &[Sample]) -> (Vec<Row>, Vec<(String, u64, u64)>) {
    type Key = (String, String, String);
    #[derive(Default)]
    struct Acc {
        memory: Option<f64>,
        sms: Option<f64>,
        profile: String,
        sharing: String,
        kind: String,
        peak: Option<f64>,
        p95_memory: Option<f64>,
        p95: Option<(String, f64)>,
        mean: Option<f64>,
        idle: Option<f64>,
        samples: Option<f64>,
        rec: Option<BTreeMap<String, String>>,
        rec_memory: Option<f64>,
        rec_sms: Option<f64>,
    }
    let mut acc: BTreeMap<Key, Acc> = BTreeMap::new();
    let mut nodes: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for (name, l, v) in samples {
        let Some(short) = name.strip_prefix(P) else {
            continue;
        };
        let get = |k: &str| l.get(k).cloned().unwrap_or_default();
        match short {
            "node_gpus_held" => nodes.entry(get("pool")).or_default().0 = *v as u64,
            "node_gpus_recommended" => nodes.entry(get("pool")).or_default().1 = *v as u64,
            _ if short.starts_with("claim_") => {
                let a = acc
                    .entry((get("namespace"), get("claim"), get("device")))
                    .or_default();
                match short {
                    "claim_allocated_memory_bytes" => a.memory = Some(*v),
                    "claim_allocated_sms" => a.sms = Some(*v),
                    "claim_allocated_info" => {
                        a.profile = get("mig_profile");
                        a.sharing = get("sharing");
                        a.kind = get("kind");
                    }
                    "claim_window_peak_memory_bytes" => a.peak = Some(*v),
                    "claim_window_p95_memory_bytes" => a.p95_memory = Some(*v),
                    "claim_window_p95_activity_percent" => a.p95 = Some((get("source"), *v)),
                    "claim_window_mean_activity_percent" => a.mean = Some(*v),
                    "claim_window_idle_ratio" => a.idle = Some(*v),
                    "claim_window_samples" => a.samples = Some(*v),
                    "claim_recommendation_info" => a.rec = Some(l.clone()),
                    "claim_recommended_memory_bytes" => a.rec_memory = Some(*v),
                    "claim_recommended_multiprocessors" => a.rec_sms = Some(*v),
                    _ => {}
                }
            }
            _ => {}
        }
    }
    let g = |b: f64| gib(b as u64);
    let rows = acc
        .into_iter()
        .filter(|(_, a)| a.rec.is_some())
        .map(|((ns, claim, device), a)| {
            let mut holds = a.memory.map_or("?".into(), g);
            if !a.profile.is_empty() {
                let _ = write!(holds, ", {}", a.profile);
            }
            if let Some(s) = a.sms {
                let _ = write!(holds, ", {s} SMs");
            }
            if !a.sharing.is_empty() && a.sharing != "exclusive" {
                let _ = write!(holds, ", {}", a.sharing);
            }
            let used = match (a.peak, &a.p95, a.mean) {
                (Some(peak), Some((_, p95)), Some(mean)) => format!(
                    "peak {} (p95 {}), SM p95 {p95:.0}% mean {mean:.1}%",
                    g(peak),
                    g(a.p95_memory.unwrap_or(peak))
                ),
                (Some(peak), _, _) => format!("peak {}, SM n/a", g(peak)),
                _ => "not attributable".into(),
            };
            let rec = a.rec.unwrap_or_default();
            let r = |k: &str| rec.get(k).cloned().unwrap_or_default();
            let served = r("served") != "false";
            let mut recommends = match r("recommendation").as_str() {
                "mig" => r("profile"),
                "share" => format!(
                    "share {} MiB, {} SMs",
                    (a.rec_memory.unwrap_or(0.0) as u64) >> 20,
                    a.rec_sms.unwrap_or(0.0)
                ),
                "gpu" => "whole GPU".into(),
                "release" => "idle: release".into(),
                "not_attributable" => "not attributable".into(),
                other => other.to_owned(),
            };
            if !served {
                recommends.push_str(" (not served here)");
            }
            let figures = format!(
                "peak {} of {}, SM p95 {} ({}), idle {} of {} samples",
                a.peak.map_or("n/a".into(), g),
                a.memory.map_or("?".into(), g),
                a.p95.as_ref().map_or("n/a".into(), |(_, p)| format!("{p:.0}%")),
                a.p95.as_ref().map_or("no source".into(), |(s, _)| s.clone()),
                a.idle
                    .map_or("n/a".into(), |i| format!("{:.0}%", i * 100.0)),
                a.samples.unwrap_or(0.0)
            );
            let why = match (r("recommendation").as_str(), r("change").as_str()) {
                ("pending", _) => "pending: less than half the window seen".into(),
                ("not_attributable", _) => match a.kind.as_str() {
                    "mps" => "not attributable: the claim's MPS daemon runs in a pod; its processes are unknown on the host".into(),
                    "share" => "not attributable: NVML does not tell which share of the device a process belongs to".into(),
                    _ => "not attributable: NVML gives no figure that belongs to this claim alone".into(),
                },
                ("release", _) => format!("idle: release: {figures}"),
                ("gpu", "same") => format!("whole GPU needed: {figures}"),
                (_, "smaller") => format!("oversized: {figures}"),
                (_, "larger") => format!("too tight: {figures}"),
                _ => format!("fits: {figures}"),
            };
            Row {
                claim: format!("{ns}/{claim}"),
                device,
                holds,
                used,
                recommends,
                why,
            }
        })
        .collect();
    let nodes = nodes.into_iter().map(|(p, (h, n))| (p, h, n)).collect();
    (rows, nodes)
}

/// `usage --recommend` against the running plugin.
pub fn run_live(addr: &str) -> anyhow::Result<String> {
    let text = super::command::scrape(addr)?;
    let samples = super::command::parse_exposition(&text)?;
    let (rows, nodes) = rows_of_scrape(&samples);
    Ok(table(&rows, &nodes))
}

/// The mock node's YAML: the profile's product, half its GPUs in MIG mode.
pub fn mixed_node(profile: &str) -> anyhow::Result<String> {
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
pub const MOCK_MODES: NodeModes = NodeModes {
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
pub fn run_mock(library: &std::path::Path, control: &std::path::Path) -> anyhow::Result<String> {
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
                where_.push((g, Some(mig.gi_id), pid));
                devices.push(ClaimDevice {
                    claim: ClaimRef {
                        uid: format!("uid-{}", s.name),
                        namespace: s.ns.into(),
                        name: s.name.into(),
                    },
                    device: format!(
                        "gpu-{}-mig-{}-{}",
                        gpu.minor,
                        profile.name.replace(['.', '+'], ""),
                        placement.start
                    ),
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
                        memory_bytes: profile.memory_mib << 20,
                        sms: Some(profile.multiprocessors),
                        mig_profile: Some(profile.name.clone()),
                    },
                    pids: Vec::new(),
                });
            }
            None => {
                let &g = next_whole
                    .next()
                    .context("usage --recommend --mock: not enough whole GPUs")?;
                let gpu = &inventory.gpus[g];
                where_.push((g, None, pid));
                devices.push(ClaimDevice {
                    claim: ClaimRef {
                        uid: format!("uid-{}", s.name),
                        namespace: s.ns.into(),
                        name: s.name.into(),
                    },
                    device: format!("gpu-{}", gpu.minor),
                    kind: s.kind,
                    sharing: if s.kind == Holding::Mps {
                        Some(SharingStrategy::Mps)
                    } else {
                        None
                    },
                    share_id: None,
                    gpu_uuid: gpu.uuid.clone(),
                    mig: None,
                    allocated: Allocation {
                        memory_bytes: gpu.memory_bytes,
                        sms: gpu.multiprocessors,
                        mig_profile: None,
                    },
                    // The pod-run daemon has no host PID in the record.
                    pids: if s.kind == Holding::Mps && !s.name.ends_with("-pod") {
                        vec![pid]
                    } else {
                        Vec::new()
                    },
                });
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
        let mut script = String::new();
        for (s, (g, gi, pid)) in SCRIPT.iter().zip(&where_) {
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
        std::fs::write(control, script)
            .with_context(|| format!("writing {}", control.display()))?;
        let wall = day_ago + Duration::from_secs(i * MOCK_ROUND_SECONDS);
        let r = rounds.round_with(&devices, Instant::now(), wall, Some(&inventory));
        last = Some(r);
    }
    let last = last.context("no round")?;
    let outcome = last.rightsize.clone().unwrap_or_default();
    metrics.rightsize.apply("mock-node", &outcome);
    Ok(table(
        &rows_of(&outcome),
        &[(
            "mock-node".into(),
            outcome.savings.held as u64,
            outcome.savings.needed as u64,
        )],
    ))
}
