//! `cleave-kubelet-plugin usage --recommend`: per claim device what it holds, what it used
//! over the window, the recommended shape and why, and the node's GPUs held against the
//! GPUs the recommendations would need. From a running plugin's `/metrics` (the reason is
//! rebuilt from the window series and the recommendation's labels); the development
//! build's `--mock PROFILE` try renders its scripted day with the same table
//! (`crate::mock`).

use std::collections::BTreeMap;
use std::fmt::Write as _;

#[cfg(feature = "mock")]
use cleave_driver::rightsize::Advice;
use cleave_driver::rightsize::advice::gib;
#[cfg(feature = "mock")]
use cleave_driver::usage::ClaimDevice;

use super::command::Sample;
#[cfg(feature = "mock")]
use super::recommend::RightsizeOutcome;

const P: &str = "cleave_kubelet_plugin_";

/// One row of the table.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Row {
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
pub(crate) fn table(rows: &[Row], savings: &[(String, u64, u64)]) -> String {
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
    let mut out = super::command::columns(&cells);
    for (pool, held, needed) in savings {
        let _ = writeln!(
            out,
            "\nnode {pool}: the claims hold {held} GPU(s); their recommended shapes would need {needed} (packed first fit): {} freed",
            held.saturating_sub(*needed)
        );
    }
    out
}

/// The node's "merge into fewer GPUs" lines, under the table (from an in-process round:
/// the GPUs' capacity is not among the exported series).
pub(crate) fn merge_lines(pool: &str, merges: &[cleave_driver::rightsize::Merge]) -> String {
    let mut out = String::new();
    for m in merges {
        let _ = writeln!(out, "node {pool}: {} ({})", m.describe(), m.product);
    }
    out
}

#[cfg(feature = "mock")]
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

#[cfg(feature = "mock")]
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

/// Rows from an in-process round (`usage --recommend --mock`).
#[cfg(feature = "mock")]
pub(crate) fn rows_of(outcome: &RightsizeOutcome) -> Vec<Row> {
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

/// One claim device's series in a scrape, gathered by [`rows_of_scrape`].
#[derive(Default)]
struct ScrapedClaim {
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

impl ScrapedClaim {
    /// The table row of the device `device` of claim `ns/claim`.
    fn into_row(self, ns: String, claim: String, device: String) -> Row {
        let a = self;
        let g = |b: f64| gib(b as u64);
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
            a.p95
                .as_ref()
                .map_or("n/a".into(), |(_, p)| format!("{p:.0}%")),
            a.p95
                .as_ref()
                .map_or("no source".into(), |(s, _)| s.clone()),
            a.idle
                .map_or("n/a".into(), |i| format!("{:.0}%", i * 100.0)),
            a.samples.unwrap_or(0.0)
        );
        let why = match (r("recommendation").as_str(), r("change").as_str()) {
            ("pending", _) => "pending: less than half the window seen".into(),
            // The series do not say which case it was; the memory figure narrows it.
            ("not_attributable", _) => match (a.kind.as_str(), a.peak) {
                ("mps" | "share", Some(_)) => "not attributable: its activity (on a MIG device NVML reports no per-process SM utilization; elsewhere its per-process samples named only the MPS server); its memory is attributed".into(),
                ("mps" | "share", None) => "not attributable: no process on the device could be tied to it (no host PID or consuming pod known on this node, or the plugin could not read the processes' cgroups)".into(),
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
    }
}

/// Rows and node figures from one scrape of a running plugin.
pub(crate) fn rows_of_scrape(samples: &[Sample]) -> (Vec<Row>, Vec<(String, u64, u64)>) {
    type Key = (String, String, String);
    let mut acc: BTreeMap<Key, ScrapedClaim> = BTreeMap::new();
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
    let rows = acc
        .into_iter()
        .filter(|(_, a)| a.rec.is_some())
        .map(|((ns, claim, device), a)| a.into_row(ns, claim, device))
        .collect();
    let nodes = nodes.into_iter().map(|(p, (h, n))| (p, h, n)).collect();
    (rows, nodes)
}

/// `usage --recommend` against the running plugin.
pub(crate) fn run_live(addr: &str) -> anyhow::Result<String> {
    let text = super::command::scrape(addr)?;
    let samples = super::command::parse_exposition(&text)?;
    let (rows, nodes) = rows_of_scrape(&samples);
    let mut out = table(&rows, &nodes);
    out.push_str(&merges_of_scrape(&samples));
    Ok(out)
}

/// The "merge into fewer GPUs" lines of a scrape (`node_share_merge_gpus`), as
/// [`merge_lines`] prints them from an in-process round.
pub(crate) fn merges_of_scrape(samples: &[Sample]) -> String {
    let mut out = String::new();
    for (name, l, v) in samples {
        if name.strip_prefix(P) != Some("node_share_merge_gpus") {
            continue;
        }
        let get = |k: &str| l.get(k).cloned().unwrap_or_default();
        let merge = cleave_driver::rightsize::Merge {
            product: get("product"),
            gpus: get("gpus").split(',').map(str::to_owned).collect(),
            needed: *v as usize,
        };
        out.push_str(&merge_lines(&get("pool"), &[merge]));
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use cleave_driver::rightsize::Merge;

    #[test]
    fn a_running_plugins_merge_advice_reaches_the_live_table_and_goes() {
        let metrics = crate::metrics::Metrics::new();
        let merge = Merge {
            product: "NVIDIA H100 80GB HBM3".into(),
            gpus: vec!["gpu-0".into(), "gpu-2".into()],
            needed: 1,
        };
        let outcome = RightsizeOutcome {
            merges: vec![merge.clone()],
            ..RightsizeOutcome::default()
        };
        metrics.rightsize.apply("node-a", &outcome);
        let samples = super::super::command::parse_exposition(&metrics.encode()).unwrap();
        assert_eq!(merges_of_scrape(&samples), merge_lines("node-a", &[merge]));
        metrics
            .rightsize
            .apply("node-a", &RightsizeOutcome::default());
        let samples = super::super::command::parse_exposition(&metrics.encode()).unwrap();
        assert_eq!(merges_of_scrape(&samples), "");
    }

    #[test]
    fn the_recommend_table_names_shares_to_merge() {
        let m = Merge {
            product: "NVIDIA H100 80GB HBM3".into(),
            gpus: vec!["gpu-0".into(), "gpu-1".into(), "gpu-2".into()],
            needed: 1,
        };
        assert_eq!(
            merge_lines("node-a", &[m]),
            "node node-a: shares on gpu-0, gpu-1, gpu-2 would fit on 1 GPU after right-sizing (NVIDIA H100 80GB HBM3)\n"
        );
        assert_eq!(merge_lines("node-a", &[]), "");
    }

    /// From a scrape, a not attributable share's reason follows what the series tell.
    #[test]
    fn scraped_unattributable_shares_say_what_is_missing() {
        let labels = |claim: &str, extra: &[(&str, &str)]| {
            let mut l: BTreeMap<String, String> = [
                ("namespace", "team-a"),
                ("claim", claim),
                ("device", "gpu-0"),
                ("kind", "share"),
            ]
            .into_iter()
            .chain(extra.iter().copied())
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
            l.remove("");
            l
        };
        let rec = [
            ("recommendation", "not_attributable"),
            ("change", "unknown"),
        ];
        let samples: Vec<Sample> = vec![
            (
                format!("{P}claim_allocated_info"),
                labels("known-memory", &[]),
                1.0,
            ),
            (
                format!("{P}claim_recommendation_info"),
                labels("known-memory", &rec),
                1.0,
            ),
            (
                format!("{P}claim_window_peak_memory_bytes"),
                labels("known-memory", &[]),
                4.0 * 1024.0 * 1024.0 * 1024.0,
            ),
            (
                format!("{P}claim_allocated_info"),
                labels("blind", &[]),
                1.0,
            ),
            (
                format!("{P}claim_recommendation_info"),
                labels("blind", &rec),
                1.0,
            ),
        ];
        let (rows, _) = rows_of_scrape(&samples);
        let why = |claim: &str| {
            rows.iter()
                .find(|r| r.claim == format!("team-a/{claim}"))
                .map(|r| r.why.clone())
                .unwrap()
        };
        assert!(why("known-memory").contains("its memory is attributed"));
        assert!(why("blind").contains("no host PID or consuming pod"));
    }
}
