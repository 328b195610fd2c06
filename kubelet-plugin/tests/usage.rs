//! Per-claim usage end to end: the real binary over the mock NVML library with usage
//! scripted in the mock's control file. A MIG claim and an MPS claim show the scripted
//! memory and activity under their own labels, their series go at unprepare, and a claim
//! scripted idle is exported idle and gets a `ClaimIdle` Event. Every wait polls with a
//! deadline.
//!
//! Built with `harness = false`, like `mps_pod`: the MPS claim needs the fake
//! `nvidia-cuda-mps-control` and `nvidia-smi` of `cleave-fakes`, played by this test binary
//! itself through wrappers in the driver root (`<this test> __fake <tool> <args>...`), since
//! the shipped plugin plays no fake tool.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;

use std::time::{Duration, Instant};

use cleave_kubelet_plugin::usage::{Sample, parse_exposition};
use cleave_testkit::runner::block_on;
use common::node::*;
use common::prom::*;
use common::*;

const P: &str = "cleave_kubelet_plugin_";

/// GPU 0 in MIG mode (on-demand MIG), GPUs 1 and 2 whole.
const MIXED: &str = "name: usage-mixed\ngpus:\n  - product: h100-80gb\n    migEnabled: true\n  - product: h100-80gb\n    migEnabled: false\n  - product: h100-80gb\n    migEnabled: false\n";

fn scrape(port: u16) -> Vec<Sample> {
    let (status, text) = http_get(port, "/metrics").unwrap();
    assert_eq!(status, 200);
    parse_exposition(&text).unwrap()
}

fn find(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let full = format!("{P}{name}");
    samples
        .iter()
        .find(|(n, l, _)| {
            *n == full
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.2)
}

fn claim_series(samples: &[Sample], claim: &str) -> usize {
    samples
        .iter()
        .filter(|(n, l, _)| {
            n.starts_with(&format!("{P}claim_"))
                && l.get("claim").map(String::as_str) == Some(claim)
        })
        .count()
}

async fn wait_until(what: &str, dirs: &NodeDirs, port: u16, mut f: impl FnMut(&[Sample]) -> bool) {
    let started = Instant::now();
    loop {
        let s = scrape(port);
        if f(&s) {
            return;
        }
        assert!(
            started.elapsed() < TIMEOUT,
            "timed out waiting for {what}\nlast scrape:\n{}\n{}",
            s.iter()
                .filter(|(n, _, _)| n.starts_with(&format!("{P}claim_")))
                .map(|(n, l, v)| format!("{n}{l:?} {v}"))
                .collect::<Vec<_>>()
                .join("\n"),
            dirs.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The checkpoint's record of `uid` (the `data` of the envelope).
fn recorded(dirs: &NodeDirs, uid: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(dirs.checkpoint()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["data"]["claims"][uid].clone()
}

/// The PID of the MPS daemon the claim's checkpoint entry names (by key), from the
/// daemon's own record (`mps/<key>/daemon.json`).
fn daemon_pid(dirs: &NodeDirs, uid: &str) -> u32 {
    let key = recorded(dirs, uid)["sharing"]["mpsDaemon"]
        .as_str()
        .map(str::to_owned)
        .expect("the MPS claim's daemon key");
    cleave_driver::sharing::daemon_record(&dirs.state_dir(), &key)
        .unwrap()
        .and_then(|r| r.daemon)
        .expect("the MPS claim's daemon PID")
        .pid
}

fn mps_config() -> k8s_openapi::api::resource::v1::DeviceAllocationConfiguration {
    cleave_apiserver_standin::fixtures::opaque_config(
        "FromClaim",
        &["gpu"],
        DRIVER,
        serde_json::json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50}}}),
    )
}

async fn claims_show_their_scripted_usage_go_at_unprepare_and_idle_ones_are_told() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    let tools = dirs.install_fake_tools();
    let config = dirs.path().join("mixed.yaml");
    std::fs::write(&config, MIXED).unwrap();
    let control = dirs.path().join("control");
    // The idle claim's GPU from the start; the others once their ids are known.
    let idle_lines = "gpm 2 0.5 0.2\nmemory 2 1024\n";
    std::fs::write(&control, idle_lines).unwrap();
    let port = free_port();
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            dynamic_mig: true,
            metrics_port: Some(port),
            env: vec![
                ("MOCK_NVML_CONFIG", config.display().to_string()),
                // Each GPU's own MIG mode from the file, not one for all.
                ("MOCK_NVML_MIG", String::new()),
                ("MOCK_NVML_CONTROL", control.display().to_string()),
                ("USAGE_INTERVAL", "200ms".into()),
                ("IDLE_THRESHOLD", "5".into()),
                ("IDLE_AFTER", "1s".into()),
                ("IDLE_EVENTS", "true".into()),
            ]
            .into_iter()
            .chain(tools)
            .collect(),
            ..PluginOptions::default()
        },
    );
    put_claim(
        &standin,
        "mig",
        "uid-mig",
        &[("mig", "gpu-0-mig-3g40gb-4")],
        &[],
    );
    put_claim(
        &standin,
        "mps",
        "uid-mps",
        &[("gpu", "gpu-1")],
        &[mps_config()],
    );
    put_claim(&standin, "idle", "uid-idle", &[("gpu", "gpu-2")], &[]);
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let r = prepare(
        &mut dra,
        vec![
            claim("mig", "uid-mig"),
            claim("mps", "uid-mps"),
            claim("idle", "uid-idle"),
        ],
    )
    .await;
    for uid in ["uid-mig", "uid-mps", "uid-idle"] {
        assert_eq!(r.claims[uid].error, "", "{uid}: {}", dirs.log());
    }
    let gi = recorded(&dirs, "uid-mig")["devices"][0]["mig"]["giId"]
        .as_u64()
        .expect("the MIG claim's GPU instance id");
    let daemon = daemon_pid(&dirs, "uid-mps");
    std::fs::write(
        &control,
        format!(
            "{idle_lines}memory 0 {gi} 0 5120\ngpm 0 {gi} 42.5 20\nprocess 1 {daemon} 3072 45\n"
        ),
    )
    .unwrap();

    let mig = [
        ("namespace", "default"),
        ("claim", "mig"),
        ("device", "gpu-0-mig-3g40gb-4"),
    ];
    let mps = [
        ("namespace", "default"),
        ("claim", "mps"),
        ("device", "gpu-1"),
    ];
    wait_until("the scripted MIG and MPS usage", &dirs, port, |s| {
        find(s, "claim_used_memory_bytes", &mig) == Some(5120.0 * 1048576.0)
            && find(
                s,
                "claim_compute_activity_percent",
                &[&mig[..], &[("source", "gpm_sm_activity")]].concat(),
            ) == Some(42.5)
            && find(s, "claim_used_memory_bytes", &mps) == Some(3072.0 * 1048576.0)
            && find(
                s,
                "claim_compute_activity_percent",
                &[&mps[..], &[("source", "process_sm_utilization")]].concat(),
            ) == Some(45.0)
    })
    .await;
    let s = scrape(port);
    // What was given, under the claim's own labels.
    assert_eq!(
        find(
            &s,
            "claim_allocated_info",
            &[
                &mig[..],
                &[("kind", "mig"), ("mig_profile", "3g.40gb"), ("pool", NODE)]
            ]
            .concat()
        ),
        Some(1.0)
    );
    assert_eq!(
        find(
            &s,
            "claim_allocated_info",
            &[&mps[..], &[("kind", "mps"), ("sharing", "mps")]].concat()
        ),
        Some(1.0)
    );
    assert_eq!(
        find(&s, "claim_allocated_memory_bytes", &mps),
        Some(81559.0 * 1048576.0),
        "an H100 80GB's memory (81559 MiB)"
    );
    assert_eq!(
        find(
            &s,
            "claim_compute_activity_percent",
            &[&mig[..], &[("source", "gpm_sm_occupancy")]].concat()
        ),
        Some(20.0)
    );
    assert_eq!(find(&s, "claim_activity_attributable", &mps), Some(1.0));
    // Busy claims are not idle.
    assert_eq!(find(&s, "claim_idle", &[("claim", "mig")]), Some(0.0));

    // The idle claim: exported idle, and one ClaimIdle Event on its ResourceClaim.
    wait_until("the idle claim", &dirs, port, |s| {
        find(
            s,
            "claim_idle",
            &[("namespace", "default"), ("claim", "idle")],
        ) == Some(1.0)
    })
    .await;
    assert!(
        find(
            &scrape(port),
            "claim_idle_since_timestamp_seconds",
            &[("claim", "idle")]
        )
        .is_some()
    );
    let found = standin
        .wait_for("events.events.k8s.io", TIMEOUT, |evs| {
            evs.iter()
                .any(|e| e["reason"] == "ClaimIdle" && e["regarding"]["name"] == "idle")
        })
        .await
        .unwrap_or_else(|evs| panic!("no ClaimIdle Event for claim idle: {evs:?}\n{}", dirs.log()));
    let ev = found
        .iter()
        .find(|e| e["reason"] == "ClaimIdle" && e["regarding"]["name"] == "idle")
        .unwrap();
    assert_eq!(ev["type"], "Warning");
    assert_eq!(ev["regarding"]["kind"], "ResourceClaim");
    assert_eq!(ev["regarding"]["uid"], "uid-idle");
    let note = ev["note"].as_str().unwrap();
    assert!(
        note.contains("default/idle")
            && note.contains("below 5%")
            && note.contains("gpm_sm_activity"),
        "{note}"
    );
    assert!(
        !found
            .iter()
            .any(|e| e["reason"] == "ClaimIdle" && e["regarding"]["name"] == "mps"),
        "a busy MPS claim got a ClaimIdle Event: {found:?}"
    );

    // Unprepare: the claims' series go; the other claim's stay.
    let u = unprepare(
        &mut dra,
        vec![claim("mig", "uid-mig"), claim("mps", "uid-mps")],
    )
    .await;
    assert_eq!(u.claims["uid-mig"].error, "");
    assert_eq!(u.claims["uid-mps"].error, "");
    wait_until("the unprepared claims' series to go", &dirs, port, |s| {
        claim_series(s, "mig") == 0 && claim_series(s, "mps") == 0
    })
    .await;
    let s = scrape(port);
    assert!(claim_series(&s, "idle") > 0);
    let mut names: BTreeMap<&str, usize> = BTreeMap::new();
    for (n, _, _) in &s {
        *names.entry(n.as_str()).or_default() += 1;
    }
    assert!(names.contains_key("cleave_kubelet_plugin_usage_sample_duration_seconds"));
    assert!(plugin.terminate().success());
}

/// The largest wait for prepare and unprepare batches the plugin's debug log shows for a
/// sampling round, in milliseconds.
fn longest_round_wait(log: &str) -> Option<u64> {
    log.lines()
        .filter(|l| l.contains("usage round"))
        .filter_map(|l| {
            let rest = l.split("waited_for_batches_ms=").nth(1)?;
            rest.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .max()
}

/// A sampling round stands aside while a prepare batch runs. With a whole-GPU claim being
/// sampled every second and the next claim's MIG create scripted to take 3 s, a round that
/// starts during that batch waits its whole budget (one interval), and the MIG claim
/// prepares as usual.
async fn sampling_waits_while_a_prepare_batch_runs() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    let config = dirs.path().join("mixed.yaml");
    std::fs::write(&config, MIXED).unwrap();
    let control = dirs.path().join("control");
    std::fs::write(&control, "gpm 1 40 20\nmemory 1 4096\n").unwrap();
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            dynamic_mig: true,
            env: vec![
                ("MOCK_NVML_CONFIG", config.display().to_string()),
                ("MOCK_NVML_MIG", String::new()),
                ("MOCK_NVML_CONTROL", control.display().to_string()),
                ("USAGE_INTERVAL", "1s".into()),
                (
                    "RUST_LOG",
                    "info,cleave_kubelet_plugin::node::usage=debug".into(),
                ),
            ],
            ..PluginOptions::default()
        },
    );
    put_claim(&standin, "whole", "uid-whole", &[("gpu", "gpu-1")], &[]);
    put_claim(
        &standin,
        "mig",
        "uid-mig",
        &[("mig", "gpu-0-mig-3g40gb-4")],
        &[],
    );
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let r = prepare(&mut dra, vec![claim("whole", "uid-whole")]).await;
    assert_eq!(r.claims["uid-whole"].error, "", "{}", dirs.log());
    let started = Instant::now();
    while longest_round_wait(&dirs.log()).is_none() {
        assert!(
            started.elapsed() < TIMEOUT,
            "no sampling round logged:\n{}",
            dirs.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = longest_round_wait(&dirs.log()).unwrap_or(0);
    assert!(
        before < 900,
        "no long batch ran yet, yet a round waited {before} ms:\n{}",
        dirs.log()
    );
    std::fs::write(
        &control,
        "gpm 1 40 20\nmemory 1 4096\ndelay nvmlDeviceCreateGpuInstanceWithPlacement 3000\n",
    )
    .unwrap();
    let batch = Instant::now();
    let r = prepare(&mut dra, vec![claim("mig", "uid-mig")]).await;
    assert_eq!(r.claims["uid-mig"].error, "", "{}", dirs.log());
    assert!(
        batch.elapsed() >= Duration::from_secs(3),
        "the scripted delay applied"
    );
    let started = Instant::now();
    loop {
        let waited = longest_round_wait(&dirs.log()).unwrap_or(0);
        if waited >= 900 {
            break;
        }
        assert!(
            started.elapsed() < TIMEOUT,
            "no round waited for the 3 s batch (longest wait {waited} ms):\n{}",
            dirs.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    std::fs::write(&control, "").unwrap();
    let u = unprepare(
        &mut dra,
        vec![claim("whole", "uid-whole"), claim("mig", "uid-mig")],
    )
    .await;
    for uid in ["uid-whole", "uid-mig"] {
        assert_eq!(u.claims[uid].error, "", "{uid}: {}", dirs.log());
    }
    drop(plugin);
}

/// `usage --mock` prints a table with every column and the scripted figures.
fn usage_mock_prints_a_table() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .args(["usage", "--mock", "h100-80gb-x8"])
        .env_remove("MOCK_NVML_CONFIG")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].contains("NAMESPACE/CLAIM") && lines[0].contains("IDLE SINCE"),
        "{text}"
    );
    for part in [
        "team-a/notebook-1",
        "62.5% gpm_sm_activity",
        "team-a/notebook-2",
        "idle for",
        "team-b/inference-mps",
        "activity not attributable",
        "1g.10gb",
    ] {
        assert!(text.contains(part), "{part} missing in\n{text}");
    }
    // Grouped by namespace: each of the two namespaces with its two claim devices.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .args(["usage", "--by", "namespace", "--mock", "h100-80gb-x8"])
        .env_remove("MOCK_NVML_CONFIG")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with("NAMESPACE") && lines[0].contains("GPUS HELD"),
        "{text}"
    );
    for ns in ["team-a", "team-b"] {
        let row: Vec<&str> = lines
            .iter()
            .find(|l| l.split_whitespace().next() == Some(ns))
            .unwrap_or_else(|| panic!("no {ns} row in\n{text}"))
            .split_whitespace()
            .collect();
        assert_eq!(row[1], "2", "{ns}: {text}");
    }
}

/// `usage --recommend --mock` prints a recommendation per scripted claim with its reason,
/// and the node's GPUs held against needed.
fn usage_recommend_mock_prints_a_plausible_table() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .args(["usage", "--recommend", "--mock", "h100-80gb-x8"])
        .env_remove("MOCK_NVML_CONFIG")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = |claim: &str| {
        text.lines()
            .find(|l| l.starts_with(claim))
            .unwrap_or_else(|| panic!("no row for {claim} in\n{text}"))
            .to_owned()
    };
    assert!(
        text.lines().next().unwrap().contains("RECOMMENDS"),
        "{text}"
    );
    for (claim, parts) in [
        (
            "team-a/notebook ",
            &[
                "3g.40gb",
                "1g.10gb",
                "oversized",
                "peak 3.8 GiB of 39.5 GiB",
            ][..],
        ),
        ("team-a/notebook-idle", &["idle: release"][..]),
        (
            "team-b/finetune",
            &["1g.20gb", "too tight", "memory still rising"][..],
        ),
        ("team-b/training", &["whole GPU needed", "SM p95 97%"][..]),
        ("team-c/inference", &["1g.20gb", "oversized"][..]),
        (
            "team-c/embeddings-mps",
            &["3g.40gb", "process_sm_utilization", "--consumable-capacity"][..],
        ),
        (
            "team-d/batch-mps-pod",
            &["not attributable", "no host PID and no consuming pod"][..],
        ),
    ] {
        let line = row(claim);
        for p in parts {
            assert!(line.contains(p), "{p} missing in {line}");
        }
    }
    assert!(
        text.contains("the claims hold 5 GPU(s); their recommended shapes would need 4"),
        "{text}"
    );
}

/// Set (to anything but `0`) where Prometheus must run: a skip is then a failure.
const REQUIRE_PROMETHEUS: &str = "CLEAVE_REQUIRE_PROMETHEUS";

/// The chart's recording rules and the Grafana dashboard, from the repository.
/// The namespaces of the claims: all different from the release's, as on a cluster.
const CLAIM_NAMESPACES: [(&str, &str); 3] =
    [("mig", "team-a"), ("mps", "team-b"), ("idle", "default")];

/// A real Prometheus scrapes the plugin over the mock with scripted usage and loads the
/// chart's recording rules; every query of the dashboard returns a series for the claims
/// prepared, and so does every recording rule. It scrapes through the job the Prometheus
/// Operator generates for the chart's PodMonitor (with the chart's `honorLabels`), which
/// adds the plugin pod's `namespace` as a target label: each claim's series, the
/// per-namespace dashboard queries and the `namespace:*` rules still name the claim's own
/// namespace, never the release's, and no series has `exported_namespace`.
async fn prometheus_scrapes_the_plugin_and_every_dashboard_query_answers() {
    let found = |tool: &str| {
        std::process::Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !found("prometheus") || !found("promtool") {
        // Reported `ignored`, never `ok`; a failure where required (or under CI).
        cleave_testkit::runner::tool_missing(
            "prometheus",
            REQUIRE_PROMETHEUS,
            "prometheus and promtool are not installed (Debian: apt-get install prometheus)",
        );
        return;
    }
    let rules = repo_file("deployments/helm/cleave/files/rightsizing-rules.yaml");
    let check = std::process::Command::new("promtool")
        .arg("check")
        .arg("rules")
        .arg(&rules)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );

    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    let tools = dirs.install_fake_tools();
    let config = dirs.path().join("mixed.yaml");
    std::fs::write(&config, MIXED).unwrap();
    let control = dirs.path().join("control");
    let idle_lines = "gpm 2 0.5 0.2\nmemory 2 1024\n";
    std::fs::write(&control, idle_lines).unwrap();
    let port = free_port();
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            dynamic_mig: true,
            metrics_port: Some(port),
            env: vec![
                ("MOCK_NVML_CONFIG", config.display().to_string()),
                ("MOCK_NVML_MIG", String::new()),
                ("MOCK_NVML_CONTROL", control.display().to_string()),
                ("USAGE_INTERVAL", "200ms".into()),
                ("IDLE_THRESHOLD", "5".into()),
                ("IDLE_AFTER", "1s".into()),
                // 24 one-second buckets: a recommendation after 12 s.
                ("RIGHTSIZE_WINDOW", "24s".into()),
            ]
            .into_iter()
            .chain(tools)
            .collect(),
            ..PluginOptions::default()
        },
    );
    // Each claim in its own namespace, none the release's.
    let in_ns = |name: &str, uid: &str| {
        let (_, ns) = CLAIM_NAMESPACES.iter().find(|(c, _)| *c == name).unwrap();
        cleave_kubelet_plugin::proto::dra::v1::Claim {
            namespace: (*ns).into(),
            ..claim(name, uid)
        }
    };
    for (name, uid, results, configs) in [
        ("mig", "uid-mig", [("mig", "gpu-0-mig-3g40gb-4")], vec![]),
        ("mps", "uid-mps", [("gpu", "gpu-1")], vec![mps_config()]),
        ("idle", "uid-idle", [("gpu", "gpu-2")], vec![]),
    ] {
        let c = in_ns(name, uid);
        let object = cleave_apiserver_standin::fixtures::resource_claim(
            &c.namespace,
            name,
            uid,
            DRIVER,
            NODE,
            &results,
            &configs,
        );
        standin.put(&object).unwrap();
    }
    let all_claims = || {
        vec![
            in_ns("mig", "uid-mig"),
            in_ns("mps", "uid-mps"),
            in_ns("idle", "uid-idle"),
        ]
    };
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let r = prepare(&mut dra, all_claims()).await;
    for uid in ["uid-mig", "uid-mps", "uid-idle"] {
        assert_eq!(r.claims[uid].error, "", "{uid}: {}", dirs.log());
    }
    let gi = recorded(&dirs, "uid-mig")["devices"][0]["mig"]["giId"]
        .as_u64()
        .unwrap();
    let daemon = daemon_pid(&dirs, "uid-mps");
    std::fs::write(
        &control,
        format!(
            "{idle_lines}memory 0 {gi} 0 5120\ngpm 0 {gi} 42.5 20\nprocess 1 {daemon} 3072 45\n"
        ),
    )
    .unwrap();

    // Prometheus on loopback, scraping the plugin every second through the Prometheus
    // Operator's job for the chart's PodMonitor, with the chart's rules.
    let prom_dir = dirs.path().join("prometheus");
    let (_prometheus, prom_port) = start_prometheus(
        &prom_dir,
        &operator_scrape_job(
            &[(port, "cleave-kubelet-plugin-x7k2p")],
            chart_pod_monitor_honor_labels(),
        ),
    );
    let prom_failure = || {
        format!(
            "\nprometheus log:\n{}\nplugin log:\n{}",
            std::fs::read_to_string(prom_dir.join("log")).unwrap_or_default(),
            dirs.log()
        )
    };
    // Recommendations need half the 24 s window; the rules one evaluation more.
    let started = Instant::now();
    let mut queries = dashboard_queries(".*");
    assert!(queries.len() > 10, "{queries:?}");
    queries.extend(
        [
            "cleave:gpus_held:sum",
            "cleave:gpus_recommended:sum",
            "cleave:gpus_freed:sum",
            "namespace:cleave_claim_allocated_memory_bytes:sum",
            "namespace:cleave_claim_recommended_memory_bytes:sum",
            "namespace_recommendation_change:cleave_claim_devices:count",
            "namespace_labels:cleave_gpus_used:sum",
            "namespace_labels:cleave_gpu_hours_held:1d",
            "namespace_labels:cleave_gpu_hours_recommended:7d",
            // 5 GiB and 42.5 % of 60 SMs, with 20 % headroom: 6 GiB and 31 SMs.
            r#"cleave_kubelet_plugin_claim_recommendation_info{claim="mig",recommendation="mig",profile="2g.20gb",change="smaller"}"#,
            r#"cleave_kubelet_plugin_claim_recommendation_info{claim="idle",recommendation="release"}"#,
        ]
        .map(str::to_owned),
    );
    let mut missing: Vec<String> = queries.clone();
    while !missing.is_empty() {
        missing.retain(|q| !prom_query(prom_port, q).is_ok_and(|r| !r.is_empty()));
        if missing.is_empty() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "queries without a series after 60 s: {missing:#?}\nerrors: {:#?}{}",
            missing
                .iter()
                .map(|q| prom_query(prom_port, q).err())
                .collect::<Vec<_>>(),
            prom_failure()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Each claim's series carry its own namespace and the operator's target labels; the
    // plugin's own series (no namespace of theirs) the release namespace.
    for (claim_name, ns) in CLAIM_NAMESPACES {
        let series = prom_query(
            prom_port,
            &format!(
                r#"cleave_kubelet_plugin_claim_allocated_memory_bytes{{claim="{claim_name}"}}"#
            ),
        )
        .unwrap();
        assert!(
            !series.is_empty(),
            "{claim_name}: no series{}",
            prom_failure()
        );
        for s in &series {
            let m = &s["metric"];
            assert_eq!(m["namespace"], ns, "{claim_name}: {m}");
            assert_eq!(m["job"], "cleave-system/cleave-kubelet-plugin", "{m}");
            assert_eq!(m["endpoint"], "metrics", "{m}");
            assert_eq!(m["container"], "plugin", "{m}");
            assert_eq!(m["pod"], "cleave-kubelet-plugin-x7k2p", "{m}");
        }
    }
    let up = prom_query(prom_port, "up").unwrap();
    assert_eq!(up[0]["metric"]["namespace"], RELEASE_NAMESPACE, "{up:?}");
    let exported = prom_query(prom_port, r#"{exported_namespace!=""}"#).unwrap();
    assert!(
        exported.is_empty(),
        "series with exported_namespace: {exported:?}"
    );
    let namespaces = |query: &str| -> std::collections::BTreeSet<String> {
        prom_query(prom_port, query)
            .unwrap()
            .iter()
            .filter_map(|s| s["metric"]["namespace"].as_str().map(str::to_owned))
            .collect()
    };
    let claim_namespaces: std::collections::BTreeSet<String> = CLAIM_NAMESPACES
        .iter()
        .map(|(_, ns)| (*ns).to_owned())
        .collect();
    assert_eq!(
        namespaces("count by (namespace) (cleave_kubelet_plugin_claim_allocated_memory_bytes)"),
        claim_namespaces
    );
    for rule in [
        "namespace:cleave_claim_allocated_memory_bytes:sum",
        "namespace:cleave_claim_recommended_memory_bytes:sum",
        "namespace_recommendation_change:cleave_claim_devices:count",
        "namespace_labels:cleave_gpus_held:sum",
        "namespace_labels:cleave_gpu_hours_used:7d",
    ] {
        let got = namespaces(rule);
        assert!(
            !got.is_empty() && got.is_subset(&claim_namespaces),
            "{rule}: namespaces {got:?}, claims' {claim_namespaces:?}"
        );
    }
    // The dashboard filtered to one claim namespace: the per-namespace queries answer for
    // it (over the three namespaces, each query for some) and only with its series.
    let per_namespace: Vec<String> = dashboard_queries("\u{0}")
        .into_iter()
        .filter(|q| q.contains('\u{0}'))
        .collect();
    assert!(
        !per_namespace.is_empty(),
        "the dashboard has no $namespace query"
    );
    for q in &per_namespace {
        let mut answered = false;
        for ns in &claim_namespaces {
            let series = prom_query(prom_port, &q.replace('\u{0}', ns)).unwrap();
            answered |= !series.is_empty();
            for s in &series {
                let got = &s["metric"]["namespace"];
                assert!(got.is_null() || got == ns.as_str(), "{q} for {ns}: {s}");
            }
        }
        assert!(answered, "no claim namespace has a series for {q}");
    }
    // The MPS claim's window: its memory and activity are its processes'.
    let mps_peak = prom_query(
        prom_port,
        r#"cleave_kubelet_plugin_claim_window_peak_memory_bytes{claim="mps"}"#,
    )
    .unwrap();
    assert_eq!(mps_peak[0]["value"][1], "3221225472", "{mps_peak:?}");
    drop(_prometheus);
    let u = unprepare(&mut dra, all_claims()).await;
    assert!(u.claims.values().all(|c| c.error.is_empty()));
    // Unprepared: the windows leave the state file beside the checkpoint.
    let state = dirs.checkpoint().with_file_name("usage-windows.json");
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(&state).unwrap_or_default();
        if !text.contains("uid-mig") && text.contains("\"version\":1") {
            break;
        }
        assert!(started.elapsed() < TIMEOUT, "{}: {text}", state.display());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(plugin.terminate().success());
}

/// `usage` against nothing says what to do.
fn usage_without_a_plugin_names_the_flag() {
    let port = free_port();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .args([
            "usage",
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
            "--scrapes",
            "1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--metrics-addr") && err.contains("--mock"),
        "{err}"
    );
}

/// A pod in `default` on `node` consuming the claim `claim`: named directly, or (with
/// `templated`) made from a template and named in the pod's status.
fn claim_pod(
    name: &str,
    uid: &str,
    node: &str,
    claim: &str,
    templated: bool,
    team: &str,
) -> k8s_openapi::api::core::v1::Pod {
    use k8s_openapi::api::core::v1::{
        Container, Pod, PodResourceClaim, PodResourceClaimStatus, PodSpec, PodStatus,
    };
    Pod {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            uid: Some(uid.into()),
            labels: Some([("team".to_owned(), team.to_owned())].into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            containers: vec![Container {
                name: "app".into(),
                ..Default::default()
            }],
            resource_claims: Some(vec![PodResourceClaim {
                name: "gpu".into(),
                resource_claim_name: (!templated).then(|| claim.to_owned()),
                resource_claim_template_name: templated.then(|| "tmpl".to_owned()),
            }]),
            ..Default::default()
        }),
        status: templated.then(|| PodStatus {
            resource_claim_statuses: Some(vec![PodResourceClaimStatus {
                name: "gpu".into(),
                resource_claim_name: Some(claim.into()),
            }]),
            ..Default::default()
        }),
    }
}

/// `--claim-pod-labels team,example.com/model`: the claim series carry `label_team` (from
/// this node's pod consuming the claim, directly or through a template; a pod of another
/// node consuming the same claim name is not seen) and `label_example_com_model` (""), and
/// the label follows the pod's deletion.
async fn claim_series_carry_the_consuming_pods_labels() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    let config = dirs.path().join("mixed.yaml");
    std::fs::write(&config, MIXED).unwrap();
    // The other node's pod sorts first by UID: seen, it would win.
    for pod in [
        claim_pod("elsewhere", "uid-pod-0", "node-b", "whole", false, "other"),
        claim_pod("direct", "uid-pod-1", NODE, "whole", false, "ml"),
        claim_pod("from-template", "uid-pod-2", NODE, "made", true, "infra"),
    ] {
        standin.put(&pod).unwrap();
    }
    let port = free_port();
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            metrics_port: Some(port),
            env: vec![
                ("MOCK_NVML_CONFIG", config.display().to_string()),
                ("MOCK_NVML_MIG", String::new()),
                ("USAGE_INTERVAL", "200ms".into()),
                ("CLAIM_POD_LABELS", "team,example.com/model".into()),
            ],
            ..PluginOptions::default()
        },
    );
    put_claim(&standin, "whole", "uid-whole", &[("gpu", "gpu-1")], &[]);
    put_claim(&standin, "made", "uid-made", &[("gpu", "gpu-2")], &[]);
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let r = prepare(
        &mut dra,
        vec![claim("whole", "uid-whole"), claim("made", "uid-made")],
    )
    .await;
    for uid in ["uid-whole", "uid-made"] {
        assert_eq!(r.claims[uid].error, "", "{uid}: {}", dirs.log());
    }
    wait_until("the pods' team labels", &dirs, port, |s| {
        find(
            s,
            "claim_allocated_info",
            &[
                ("claim", "whole"),
                ("label_team", "ml"),
                ("label_example_com_model", ""),
            ],
        ) == Some(1.0)
            && find(
                s,
                "claim_allocated_memory_bytes",
                &[("claim", "made"), ("label_team", "infra")],
            )
            .is_some()
            && find(s, "claim_idle", &[("claim", "whole"), ("label_team", "ml")]).is_some()
    })
    .await;
    // One LIST and watches of this node's pods (no kubelet runs here: all the plugin's),
    // all namespaces, selected by node.
    let pod_requests: Vec<_> = standin
        .requests()
        .into_iter()
        .filter(|r| r.path == "/api/v1/pods")
        .collect();
    assert_eq!(
        pod_requests.iter().filter(|r| r.verb == "list").count(),
        1,
        "{pod_requests:?}"
    );
    assert!(
        pod_requests.iter().all(|r| r
            .query
            .contains(&format!("fieldSelector=spec.nodeName%3D{NODE}"))),
        "{pod_requests:?}"
    );
    standin.delete("pods", "default", "direct").unwrap();
    wait_until("the label of the deleted pod to go", &dirs, port, |s| {
        find(
            s,
            "claim_allocated_info",
            &[("claim", "whole"), ("label_team", "")],
        ) == Some(1.0)
            && find(
                s,
                "claim_allocated_info",
                &[("claim", "whole"), ("label_team", "ml")],
            )
            .is_none()
    })
    .await;
    drop(dra);
    assert!(plugin.terminate().success());
}

fn main() -> std::process::ExitCode {
    cleave_testkit::runner::main(&[
        (
            "claims_show_their_scripted_usage_go_at_unprepare_and_idle_ones_are_told",
            || block_on(claims_show_their_scripted_usage_go_at_unprepare_and_idle_ones_are_told()),
        ),
        (
            "prometheus_scrapes_the_plugin_and_every_dashboard_query_answers",
            || block_on(prometheus_scrapes_the_plugin_and_every_dashboard_query_answers()),
        ),
        ("claim_series_carry_the_consuming_pods_labels", || {
            block_on(claim_series_carry_the_consuming_pods_labels())
        }),
        ("sampling_waits_while_a_prepare_batch_runs", || {
            block_on(sampling_waits_while_a_prepare_batch_runs())
        }),
        ("usage_mock_prints_a_table", usage_mock_prints_a_table),
        (
            "usage_recommend_mock_prints_a_plausible_table",
            usage_recommend_mock_prints_a_plausible_table,
        ),
        (
            "usage_without_a_plugin_names_the_flag",
            usage_without_a_plugin_names_the_flag,
        ),
    ])
}
