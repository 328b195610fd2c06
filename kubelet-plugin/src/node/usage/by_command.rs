//! `cleave-kubelet-plugin usage --by LABEL`: GPUs held, used and recommended per namespace
//! or per copied pod label, from the running plugin's claim series, with the definitions of
//! the chart's spend recording rules (docs/usage-metrics.md, "GPU spend per namespace and
//! team"): a claim device holds its memory over its GPU's; it uses that times its compute
//! activity (a capacity share: the activity alone, already a share of the GPU); its
//! recommendation needs the recommended memory over the GPU's. Read from the last scrape.

use std::collections::BTreeMap;

use super::command::{Sample, columns};

const P: &str = "cleave_kubelet_plugin_";

/// The series label `--by` names: `namespace` as is; a pod label key (`team`, or already
/// `label_team`) as the plugin writes it, `label_` and the key with every character outside
/// `[a-zA-Z0-9_]` made `_`.
pub(crate) fn series_label(by: &str) -> String {
    if by == "namespace" || by.starts_with("label_") {
        return by.to_owned();
    }
    let key: String = by
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("label_{key}")
}

#[derive(Default)]
struct Group {
    devices: usize,
    held: f64,
    used: f64,
    /// Devices with an activity figure (the others count as no use).
    measured: usize,
    recommended: f64,
    /// Devices with a recommendation.
    advised: usize,
    memory: f64,
}

/// One claim device in one scrape.
#[derive(Default)]
struct Device {
    group: String,
    gpu: String,
    share: bool,
    memory: Option<f64>,
    activity: Option<f64>,
    recommended: Option<f64>,
}

/// The table of the last of `scrapes` (oldest first), grouped by `by` (a `--by` value).
pub(crate) fn render(scrapes: &[Vec<Sample>], by: &str) -> String {
    let label = series_label(by);
    let mut groups: BTreeMap<String, Group> = BTreeMap::new();
    let mut seen_label = false;
    if let Some(samples) = scrapes.last() {
        let mut gpu_memory: BTreeMap<&str, f64> = BTreeMap::new();
        let mut devices: BTreeMap<(&str, &str, &str), Device> = BTreeMap::new();
        for (name, l, v) in samples {
            let Some(short) = name.strip_prefix(P) else {
                continue;
            };
            let get = |k: &str| l.get(k).map_or("", String::as_str);
            if short == "gpu_memory_total_bytes" {
                gpu_memory.insert(get("gpu"), *v);
                continue;
            }
            if !matches!(
                short,
                "claim_allocated_memory_bytes"
                    | "claim_compute_activity_percent"
                    | "claim_recommended_memory_bytes"
            ) {
                continue;
            }
            seen_label |= l.contains_key(&label);
            let d = devices
                .entry((get("namespace"), get("claim"), get("device")))
                .or_default();
            d.group = get(&label).to_owned();
            d.gpu = get("gpu").to_owned();
            d.share = get("kind") == "share";
            match short {
                "claim_allocated_memory_bytes" => d.memory = Some(*v),
                "claim_compute_activity_percent" if get("source") != "gpm_sm_occupancy" => {
                    d.activity = Some(d.activity.map_or(*v, |a| a.max(*v)));
                }
                "claim_recommended_memory_bytes" => d.recommended = Some(*v),
                _ => {}
            }
        }
        for d in devices.into_values() {
            let (Some(memory), Some(total)) = (d.memory, gpu_memory.get(d.gpu.as_str())) else {
                continue;
            };
            if *total <= 0.0 {
                continue;
            }
            let held = memory / total;
            let g = groups.entry(d.group).or_default();
            g.devices += 1;
            g.held += held;
            g.memory += memory;
            if let Some(a) = d.activity {
                g.measured += 1;
                g.used += if d.share { a / 100.0 } else { held * a / 100.0 };
            }
            if let Some(r) = d.recommended {
                g.advised += 1;
                g.recommended += r / total;
            }
        }
    }
    if groups.is_empty() {
        return "no prepared claims are sampled (none prepared, or --usage-interval=0)\n".into();
    }
    let mut table = vec![[
        by.to_uppercase(),
        "CLAIM DEVICES".to_owned(),
        "GPUS HELD".to_owned(),
        "GPUS USED".to_owned(),
        "GPUS RECOMMENDED".to_owned(),
        "MEMORY HELD".to_owned(),
    ]];
    for (name, g) in &groups {
        let devices = g.devices;
        let name = if name.is_empty() {
            format!("({label} unset)")
        } else {
            name.clone()
        };
        let used = format!(
            "{:.2}{}",
            g.used,
            if g.measured < devices {
                format!(" ({} of {devices} measured)", g.measured)
            } else {
                String::new()
            }
        );
        let recommended = if g.advised == 0 {
            "pending".to_owned()
        } else if g.advised < devices {
            format!("{:.2} ({} of {devices})", g.recommended, g.advised)
        } else {
            format!("{:.2}", g.recommended)
        };
        table.push([
            name,
            devices.to_string(),
            format!("{:.2}", g.held),
            used,
            recommended,
            format!("{:.1} GiB", g.memory / f64::from(1u32 << 30)),
        ]);
    }
    let mut out = columns(&table);
    if !seen_label && label != "namespace" {
        out.push_str(&format!(
            "no claim series carries {label}: add the pod label key to the plugin's allowlist (chart usage.claimPodLabels)\n"
        ));
    }
    out.push_str(
        "GPU-hours over a day or a week: the chart's spend recording rules in Prometheus (docs/usage-metrics.md)\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(name: &str, labels: &[(&str, &str)], v: f64) -> Sample {
        (
            format!("{P}{name}"),
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            v,
        )
    }

    const GIB: f64 = 1073741824.0;

    /// Two teams: alpha with a 20 GiB share at 12.5 % and an idle 20 GiB share (two
    /// namespaces) on GPU-A, beta with a whole GPU-B at 50 %, recommended 40 GiB.
    fn day() -> Vec<Sample> {
        let share = |ns: &str, claim: &str, act: f64| {
            let l = [
                ("namespace", ns),
                ("claim", claim),
                ("device", "gpu-0"),
                ("gpu", "GPU-A"),
                ("kind", "share"),
                ("label_team", "alpha"),
            ];
            let mut a = l.to_vec();
            a.push(("source", "process_sm_utilization"));
            vec![
                sample("claim_allocated_memory_bytes", &l, 20.0 * GIB),
                sample("claim_compute_activity_percent", &a, act),
            ]
        };
        let mut out = share("team-a", "train", 12.5);
        out.extend(share("team-a-dev", "notebook", 0.0));
        let l = [
            ("namespace", "team-b"),
            ("claim", "infer"),
            ("device", "gpu-1"),
            ("gpu", "GPU-B"),
            ("kind", "gpu"),
            ("label_team", "beta"),
        ];
        let mut act = l.to_vec();
        act.push(("source", "gpm_sm_activity"));
        let mut occ = l.to_vec();
        occ.push(("source", "gpm_sm_occupancy"));
        out.extend([
            sample("claim_allocated_memory_bytes", &l, 80.0 * GIB),
            sample("claim_compute_activity_percent", &act, 50.0),
            sample("claim_compute_activity_percent", &occ, 90.0),
            sample("claim_recommended_memory_bytes", &l, 40.0 * GIB),
            sample("gpu_memory_total_bytes", &[("gpu", "GPU-A")], 80.0 * GIB),
            sample("gpu_memory_total_bytes", &[("gpu", "GPU-B")], 80.0 * GIB),
        ]);
        out
    }

    fn row<'a>(table: &'a str, first: &str) -> Vec<&'a str> {
        let line = table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(first))
            .unwrap_or_else(|| panic!("no {first} row in\n{table}"));
        line.split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .collect()
    }

    #[test]
    fn per_team_sums_both_namespaces_of_a_team() {
        let t = render(&[day(), day()], "team");
        assert_eq!(
            row(&t, "alpha"),
            ["alpha", "2", "0.50", "0.12", "pending", "40.0 GiB"],
            "{t}"
        );
        assert_eq!(
            row(&t, "beta"),
            ["beta", "1", "1.00", "0.50", "0.50", "80.0 GiB"],
            "{t}"
        );
        assert!(t.lines().next().unwrap().starts_with("TEAM"), "{t}");
        assert!(!t.contains("no claim series carries"), "{t}");
    }

    #[test]
    fn per_namespace_splits_a_team() {
        let t = render(&[day()], "namespace");
        assert_eq!(row(&t, "team-a")[2], "0.25", "{t}");
        assert_eq!(row(&t, "team-a")[3], "0.12", "{t}");
        assert_eq!(row(&t, "team-a-dev")[3], "0.00", "{t}");
        assert_eq!(row(&t, "team-b")[2], "1.00", "{t}");
    }

    #[test]
    fn a_label_no_series_carries_names_the_allowlist() {
        let t = render(&[day()], "model");
        assert!(t.contains("(label_model unset)"), "{t}");
        assert!(t.contains("add the pod label key"), "{t}");
        assert_eq!(
            series_label("app.kubernetes.io/team"),
            "label_app_kubernetes_io_team"
        );
        assert_eq!(series_label("label_team"), "label_team");
        assert!(render(&[], "team").contains("no prepared claims"));
    }
}
