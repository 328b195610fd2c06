//! A real Prometheus in the tests: the scrape job the Prometheus Operator generates for the
//! chart's PodMonitor, the dashboard's queries, and instant queries.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::path::Path;
use std::time::Duration;

use super::node::http_get;

pub fn repo_file(rel: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

/// Percent-encodes a query for a URL.
pub fn url_encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Every PromQL query of the dashboard: targets' `expr`, and the metric of each
/// `label_values(metric, label)` variable query; `$namespace` becomes `namespace` (a regex),
/// `$by` (the spend panels' grouping) `namespace`.
pub fn dashboard_queries(namespace: &str) -> Vec<String> {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                        ("definition", serde_json::Value::String(d)) => {
                            if let Some(inner) = d
                                .strip_prefix("label_values(")
                                .and_then(|r| r.split(',').next())
                            {
                                out.push(inner.trim().to_owned());
                            }
                        }
                        _ => walk(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let text =
        std::fs::read_to_string(repo_file("deployments/grafana/cleave-dashboard.json")).unwrap();
    let mut out = Vec::new();
    walk(&serde_json::from_str(&text).unwrap(), &mut out);
    out.into_iter()
        .map(|q| {
            q.replace("$namespace", namespace)
                .replace("$__rate_interval", "1m")
                .replace("$by", "namespace")
        })
        .collect()
}

/// The release namespace of the plugin pods in the Prometheus Operator scrape below.
pub const RELEASE_NAMESPACE: &str = "cleave-system";

/// `honorLabels` of the chart's PodMonitor with default values: the literal in
/// templates/metrics.yaml, or the value it takes from values.yaml; absent, the operator's
/// default (false).
pub fn chart_pod_monitor_honor_labels() -> bool {
    let template =
        std::fs::read_to_string(repo_file("deployments/helm/cleave/templates/metrics.yaml"))
            .unwrap();
    let Some(line) = template
        .lines()
        .find(|l| l.trim_start().starts_with("honorLabels:"))
    else {
        return false;
    };
    let value = line.split_once(':').unwrap().1.trim();
    match value {
        "true" => true,
        "false" => false,
        v if v.contains(".Values.metrics.podMonitor.honorLabels") => {
            let values: serde_yaml::Value = serde_yaml::from_str(
                &std::fs::read_to_string(repo_file("deployments/helm/cleave/values.yaml")).unwrap(),
            )
            .unwrap();
            values["metrics"]["podMonitor"]["honorLabels"]
                .as_bool()
                .unwrap_or(false)
        }
        v => panic!("templates/metrics.yaml: honorLabels {v:?} is neither a literal nor the value"),
    }
}

/// The scrape job the Prometheus Operator generates for the chart's PodMonitor (release
/// `cleave` in `cleave-system`), after its generator for PodMonitors
/// (prometheus-operator `pkg/prometheus/promcfg.go`, `generatePodMonitorConfig`):
/// `honor_labels` from the endpoint's `honorLabels`; relabelling that keeps the pods the
/// selector's labels match and the container port named `metrics`, then sets the target
/// labels `namespace`, `container` and `pod` from the pod's metadata, `job` to
/// `<namespace>/<PodMonitor name>` and `endpoint` to the port name. Pod discovery
/// (`kubernetes_sd_configs`, role pod) is stood in for by a static target carrying the
/// `__meta_kubernetes_*` labels it would give the plugin pod.
pub fn operator_scrape_job(pods: &[(u16, &str)], honor_labels: bool) -> String {
    let ns = RELEASE_NAMESPACE;
    let targets: String = pods
        .iter()
        .map(|(port, pod)| {
            format!(
                r#"      - targets: ['127.0.0.1:{port}']
        labels:
          __meta_kubernetes_namespace: {ns}
          __meta_kubernetes_pod_name: {pod}
          __meta_kubernetes_pod_container_name: plugin
          __meta_kubernetes_pod_container_port_name: metrics
          __meta_kubernetes_pod_label_app_kubernetes_io_name: cleave
          __meta_kubernetes_pod_label_app_kubernetes_io_instance: cleave
          __meta_kubernetes_pod_label_app_kubernetes_io_component: kubelet-plugin
"#
            )
        })
        .collect();
    format!(
        r#"  - job_name: podMonitor/{ns}/cleave-kubelet-plugin/0
    honor_labels: {honor_labels}
    scrape_interval: 1s
    metrics_path: /metrics
    static_configs:
{targets}    relabel_configs:
      - source_labels: [job]
        target_label: __tmp_prometheus_job_name
      - action: keep
        source_labels: [__meta_kubernetes_pod_label_app_kubernetes_io_component]
        regex: kubelet-plugin
      - action: keep
        source_labels: [__meta_kubernetes_pod_label_app_kubernetes_io_instance]
        regex: cleave
      - action: keep
        source_labels: [__meta_kubernetes_pod_label_app_kubernetes_io_name]
        regex: cleave
      - action: keep
        source_labels: [__meta_kubernetes_pod_container_port_name]
        regex: metrics
      - source_labels: [__meta_kubernetes_namespace]
        target_label: namespace
      - source_labels: [__meta_kubernetes_pod_container_name]
        target_label: container
      - source_labels: [__meta_kubernetes_pod_name]
        target_label: pod
      - target_label: job
        replacement: {ns}/cleave-kubelet-plugin
      - target_label: endpoint
        replacement: metrics
"#
    )
}

/// A child process killed and reaped when dropped.
pub struct Reaped(pub std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Series a Prometheus at `port` returns for `query` (instant), or its error.
pub fn prom_query(port: u16, query: &str) -> Result<Vec<serde_json::Value>, String> {
    let (status, body) =
        http_get(port, &format!("/api/v1/query?query={}", url_encode(query))).ok_or("no answer")?;
    let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
    if status != 200 || v["status"] != "success" {
        return Err(format!("{status}: {body}"));
    }
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

/// Whether `prometheus` and `promtool` run here.
pub fn prometheus_found() -> bool {
    ["prometheus", "promtool"].iter().all(|tool| {
        std::process::Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Starts Prometheus on loopback in `dir` with `scrape_configs` (one or more jobs) and the
/// chart's recording rules, evaluated and scraped every second; its log is `dir/log`. The
/// spend rules' group interval (one minute, which their GPU-hours figures assume) is made
/// one second here, so that they answer within the test: their values are then not hours.
pub fn start_prometheus(dir: &Path, scrape_configs: &str) -> (Reaped, u16) {
    let rules = repo_file("deployments/helm/cleave/files/rightsizing-rules.yaml");
    std::fs::create_dir_all(dir).unwrap();
    let spend_text =
        std::fs::read_to_string(repo_file("deployments/helm/cleave/files/spend-rules.yaml"))
            .unwrap();
    assert!(spend_text.contains("    interval: 1m\n"), "{spend_text}");
    let spend = dir.join("spend-rules.yaml");
    std::fs::write(
        &spend,
        spend_text.replace("    interval: 1m\n", "    interval: 1s\n"),
    )
    .unwrap();
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\n  - {}\nscrape_configs:\n{scrape_configs}",
            rules.display(),
            spend.display()
        ),
    )
    .unwrap();
    let port = super::node::free_port();
    let log = std::fs::File::create(dir.join("log")).unwrap();
    let child = std::process::Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    (Reaped(child), port)
}

/// Waits (up to `deadline`) until every query of `queries` returns a series; the ones
/// that never did, with their errors, otherwise.
pub fn wait_for_series(port: u16, queries: &[String], deadline: Duration) -> Result<(), String> {
    let started = std::time::Instant::now();
    let mut missing: Vec<String> = queries.to_vec();
    loop {
        missing.retain(|q| !prom_query(port, q).is_ok_and(|r| !r.is_empty()));
        if missing.is_empty() {
            return Ok(());
        }
        if started.elapsed() > deadline {
            let errors: Vec<_> = missing.iter().map(|q| prom_query(port, q).err()).collect();
            return Err(format!(
                "queries without a series: {missing:#?}\nerrors: {errors:#?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}
