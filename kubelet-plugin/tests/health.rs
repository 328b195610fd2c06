//! Device health end to end: the real binary with the mock NVML; Xid events and lost GPUs
//! injected through the mock's control file reach the kubelet's health stream (v1alpha1
//! and v1), the published ResourceSlices (taint or removal) and `/metrics`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cleave_kubelet_plugin::proto::health::{v1 as hv1, v1alpha1 as hv1alpha1};
use cleave_kubelet_plugin::proto::registration::{InfoRequest, RegistrationStatus};
use cleave_kubelet_plugin::{HEALTH_V1, HEALTH_V1ALPHA1};
use common::node::*;
use common::*;
use serde_json::Value;

/// One sample of the text exposition: metric name, labels, value.
type Sample = (String, BTreeMap<String, String>, f64);

/// A strict parser of the Prometheus/OpenMetrics text format as prometheus-client writes
/// it: `# HELP`, `# TYPE`, `# UNIT`, `# EOF` and `name{label="value",...} number` lines.
fn parse_exposition(text: &str) -> Vec<Sample> {
    let mut samples = Vec::new();
    let mut saw_eof = false;
    for line in text.lines() {
        assert!(!saw_eof, "content after # EOF: {line:?}");
        if line == "# EOF" {
            saw_eof = true;
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let kind = parts.next().unwrap();
            assert!(
                matches!(kind, "HELP" | "TYPE" | "UNIT"),
                "bad comment {line:?}"
            );
            let name = parts.next().expect("metric name");
            assert!(valid_name(name), "bad name in {line:?}");
            if kind == "TYPE" {
                let t = parts.next().expect("type");
                assert!(
                    matches!(
                        t,
                        "counter" | "gauge" | "histogram" | "summary" | "unknown" | "info"
                    ),
                    "bad type in {line:?}"
                );
            }
            continue;
        }
        let (head, value) = line.rsplit_once(' ').expect("sample without value");
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad value in {line:?}")),
        };
        let (name, labels) = match head.split_once('{') {
            None => (head, BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').expect("unclosed labels");
                let mut labels = BTreeMap::new();
                let mut rest = body;
                while !rest.is_empty() {
                    let (k, v) = rest.split_once("=\"").expect("label without =\"");
                    assert!(valid_name(k), "bad label name {k:?}");
                    let end = v.find('"').expect("unterminated label value");
                    labels.insert(k.to_owned(), v[..end].to_owned());
                    rest = v[end + 1..].strip_prefix(',').unwrap_or(&v[end + 1..]);
                }
                (name, labels)
            }
        };
        assert!(valid_name(name), "bad metric name in {line:?}");
        samples.push((name.to_owned(), labels, value));
    }
    assert!(saw_eof, "no # EOF");
    samples
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        && !n.starts_with(|c: char| c.is_ascii_digit())
}

fn sample(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.2)
}

fn scrape(port: u16) -> Vec<Sample> {
    let (status, text) = http_get(port, "/metrics").unwrap();
    assert_eq!(status, 200);
    parse_exposition(&text)
}

async fn wait_until(what: &str, dirs: &NodeDirs, mut f: impl FnMut() -> bool) {
    let started = Instant::now();
    while !f() {
        assert!(
            started.elapsed() < TIMEOUT,
            "timed out waiting for {what}\n{}",
            dirs.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Device name -> (healthy, message) from one stream message.
type Health = BTreeMap<String, (bool, String)>;

macro_rules! health_client {
    ($m:ident, $fn:ident) => {
        async fn $fn(socket: &std::path::Path) -> tonic::Streaming<$m::NodeWatchResourcesResponse> {
            let mut c =
                $m::dra_resource_health_client::DraResourceHealthClient::new(channel(socket).await);
            tokio::time::timeout(
                TIMEOUT,
                c.node_watch_resources($m::NodeWatchResourcesRequest {}),
            )
            .await
            .unwrap()
            .unwrap()
            .into_inner()
        }
    };
}
health_client!(hv1alpha1, watch_v1alpha1);
health_client!(hv1, watch_v1);

macro_rules! next_health {
    ($m:ident, $fn:ident) => {
        /// The next message of the stream (None when it ended).
        async fn $fn(s: &mut tonic::Streaming<$m::NodeWatchResourcesResponse>) -> Option<Health> {
            let msg = tokio::time::timeout(TIMEOUT, s.message())
                .await
                .expect("no health message in time")
                .ok()??;
            Some(
                msg.devices
                    .into_iter()
                    .map(|d| {
                        let id = d.device.unwrap();
                        assert_eq!(id.pool_name, NODE);
                        assert_eq!(d.health_check_timeout_seconds, 30);
                        assert!(d.last_updated_time > 0);
                        let healthy = d.health == $m::HealthStatus::Healthy as i32;
                        assert!(healthy || d.health == $m::HealthStatus::Unhealthy as i32);
                        (id.device_name, (healthy, d.message))
                    })
                    .collect(),
            )
        }
    };
}
next_health!(hv1alpha1, next_v1alpha1);
next_health!(hv1, next_v1);

fn slice_devices(standin: &cleave_apiserver_standin::StandIn) -> BTreeMap<String, Value> {
    standin
        .list("resourceslices")
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .map(|d| (d["name"].as_str().unwrap().to_owned(), d))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_marks_device_unhealthy_on_stream_slices_and_metrics() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(&standin, "m", "uid-m", &[("gpu", "gpu-0")], &[]);
    let control = dirs.path().join("nvml-control");
    std::fs::write(&control, "").unwrap();
    let port = free_port();
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            metrics_port: Some(port),
            env: vec![
                ("MOCK_NVML_CONTROL", control.display().to_string()),
                ("DEVICE_TAINTS", "on".into()),
            ],
            ..PluginOptions::default()
        },
    );

    // GetInfo advertises the health versions after the DRA versions.
    let mut reg = registration(&plugin.registration_socket).await;
    let info = reg.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(
        info.supported_versions,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            HEALTH_V1ALPHA1,
            HEALTH_V1
        ]
    );
    // Not ready before the kubelet confirmed the registration, ready after (slices published).
    wait_until("slices", &dirs, || slice_devices(&standin).len() == 8).await;
    let (status, body) = http_get(port, "/readyz").unwrap();
    assert_eq!(status, 503, "{body}");
    reg.notify_registration_status(RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await
    .unwrap();
    wait_until("readyz", &dirs, || {
        http_get(port, "/readyz").is_some_and(|(s, _)| s == 200)
    })
    .await;

    // Both stream versions start with the complete list, all healthy.
    let mut alpha = watch_v1alpha1(&plugin.dra_socket).await;
    let mut v1s = watch_v1(&plugin.dra_socket).await;
    let first = next_v1alpha1(&mut alpha).await.unwrap();
    assert_eq!(first.len(), 8);
    assert!(first.values().all(|(h, _)| *h), "{first:?}");
    assert_eq!(next_v1(&mut v1s).await.unwrap(), first);

    // A prepare moves the latency histogram.
    let before = scrape(port);
    let count = |s: &[Sample]| {
        sample(
            s,
            "cleave_kubelet_plugin_request_duration_seconds_count",
            &[("operation", "prepare")],
        )
        .unwrap_or(0.0)
    };
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let r = dra
        .node_prepare_resources(
            cleave_kubelet_plugin::proto::dra::v1::NodePrepareResourcesRequest {
                claims: vec![claim("m", "uid-m")],
            },
        )
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims["uid-m"].error, "");
    let after = scrape(port);
    assert_eq!(count(&after), count(&before) + 1.0);
    let by_result = |s: &[Sample]| {
        sample(
            s,
            "cleave_kubelet_plugin_operation_duration_seconds_count",
            &[("operation", "prepare"), ("result", "ok")],
        )
        .unwrap_or(0.0)
    };
    assert_eq!(by_result(&after), by_result(&before) + 1.0);
    // Driver steps: CDI and checkpoint writes of that prepare.
    for step in ["cdi_write", "checkpoint_write"] {
        assert!(
            sample(
                &after,
                "cleave_kubelet_plugin_driver_step_duration_seconds_count",
                &[("step", step)]
            )
            .is_some_and(|n| n >= 1.0),
            "{step}"
        );
    }
    // The publisher's API requests and the published devices by type.
    assert!(
        sample(
            &after,
            "cleave_kubelet_plugin_api_requests_total",
            &[("verb", "create"), ("result", "ok")]
        )
        .is_some_and(|n| n >= 1.0)
    );
    assert_eq!(
        sample(
            &after,
            "cleave_kubelet_plugin_devices_published",
            &[("type", "gpu")]
        ),
        Some(8.0)
    );

    // An application Xid (31) on GPU 1 is counted and changes nothing; a fatal one (79)
    // on GPU 2 marks gpu-2 unhealthy.
    std::fs::write(&control, "xid 1 31\n").unwrap();
    wait_until("Xid 31 counted", &dirs, || {
        sample(
            &scrape(port),
            "cleave_kubelet_plugin_health_events_total",
            &[("xid", "31"), ("fatal", "false")],
        ) == Some(1.0)
    })
    .await;
    std::fs::write(&control, "xid 1 31\nxid 2 79\n").unwrap();
    let changed = next_v1alpha1(&mut alpha).await.unwrap();
    assert_eq!(changed.len(), 8);
    let unhealthy: Vec<_> = changed.iter().filter(|(_, (h, _))| !h).collect();
    assert_eq!(unhealthy.len(), 1, "{changed:?}");
    assert_eq!(unhealthy[0].0, "gpu-2");
    assert!(unhealthy[0].1.1.contains("Xid 79"), "{changed:?}");
    assert_eq!(next_v1(&mut v1s).await.unwrap(), changed);

    // Published with a NoSchedule taint; gpu-1 untouched.
    wait_until("taint on gpu-2", &dirs, || {
        let d = slice_devices(&standin);
        d["gpu-2"]["taints"][0]["key"] == "gpu.cleave.dev/xid"
    })
    .await;
    let d = slice_devices(&standin);
    assert_eq!(d.len(), 8);
    assert_eq!(d["gpu-2"]["taints"][0]["value"], "79");
    assert_eq!(d["gpu-2"]["taints"][0]["effect"], "NoSchedule");
    assert!(d["gpu-1"].get("taints").is_none_or(Value::is_null), "{d:?}");

    // A new claim of the unhealthy device is refused, with a Warning Event on the claim;
    // the claim prepared before stays prepared.
    put_claim(&standin, "sick", "uid-sick", &[("gpu", "gpu-2")], &[]);
    let r = dra
        .node_prepare_resources(
            cleave_kubelet_plugin::proto::dra::v1::NodePrepareResourcesRequest {
                claims: vec![claim("sick", "uid-sick"), claim("m", "uid-m")],
            },
        )
        .await
        .unwrap()
        .into_inner();
    let e = &r.claims["uid-sick"].error;
    assert!(
        e.contains("gpu-2 is unhealthy") && e.contains("Xid 79"),
        "{e}"
    );
    assert_eq!(r.claims["uid-m"].error, "");
    let events = standin
        .wait_for("events.events.k8s.io", TIMEOUT, |items| {
            items.iter().any(|e| e["regarding"]["name"] == "sick")
        })
        .await
        .expect("no Event on the claim");
    let ev = events
        .iter()
        .find(|e| e["regarding"]["name"] == "sick")
        .unwrap();
    assert_eq!(ev["reason"], "PrepareFailed");
    assert_eq!(ev["type"], "Warning");
    assert_eq!(ev["regarding"]["kind"], "ResourceClaim");
    assert_eq!(ev["reportingController"], "gpu.cleave.dev/kubelet-plugin");
    assert_eq!(ev["reportingInstance"], NODE);
    assert!(ev["note"].as_str().unwrap().contains("unhealthy"));

    let s = scrape(port);
    assert_eq!(
        sample(
            &s,
            "cleave_kubelet_plugin_health_events_total",
            &[("kind", "xid"), ("xid", "79"), ("fatal", "true")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(&s, "cleave_kubelet_plugin_devices_unhealthy", &[]),
        Some(1.0)
    );

    // Shutdown ends the streams.
    let stopped = plugin.terminate();
    assert!(stopped.success(), "{}", dirs.log());
    let ended = tokio::time::timeout(TIMEOUT, async {
        while next_v1alpha1(&mut alpha).await.is_some() {}
    })
    .await;
    assert!(ended.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_gpu_is_removed_without_taints_and_comes_back() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    let control = dirs.path().join("nvml-control");
    std::fs::write(&control, "").unwrap();
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            env: vec![
                ("MOCK_NVML_CONTROL", control.display().to_string()),
                ("LOST_GPU_CHECK_INTERVAL", "1".into()),
            ],
            ..PluginOptions::default()
        },
    );
    wait_until("slices", &dirs, || slice_devices(&standin).len() == 8).await;
    let mut stream = watch_v1(&plugin.dra_socket).await;
    assert!(
        next_v1(&mut stream)
            .await
            .unwrap()
            .values()
            .all(|(h, _)| *h)
    );

    std::fs::write(&control, "lost 3\n").unwrap();
    let h = next_v1(&mut stream).await.unwrap();
    assert_eq!(h.len(), 8, "the stream still lists every device");
    assert!(!h["gpu-3"].0 && h["gpu-3"].1.contains("lost"), "{h:?}");
    wait_until("gpu-3 removed", &dirs, || {
        let d = slice_devices(&standin);
        d.len() == 7 && !d.contains_key("gpu-3")
    })
    .await;

    std::fs::write(&control, "").unwrap();
    let h = next_v1(&mut stream).await.unwrap();
    assert!(h.values().all(|(h, _)| *h), "{h:?}");
    wait_until("gpu-3 back", &dirs, || slice_devices(&standin).len() == 8).await;
    assert!(plugin.terminate().success(), "{}", dirs.log());
}

/// On-demand MIG: an Xid attributed to a created instance (GI/CI ids) marks only that MIG
/// device; a GPU-wide Xid marks the whole GPU and every placement of it. `/metrics` counts
/// the instance created at prepare and destroyed at unprepare.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_xid_marks_only_its_instance_gpu_wide_marks_all_placements() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(
        &standin,
        "mig",
        "uid-mig",
        &[("gpu", "gpu-0-mig-1g10gb-0")],
        &[],
    );
    let control = dirs.path().join("nvml-control");
    std::fs::write(&control, "").unwrap();
    let port = free_port();
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            mig: "on",
            dynamic_mig: true,
            metrics_port: Some(port),
            env: vec![("MOCK_NVML_CONTROL", control.display().to_string())],
            ..PluginOptions::default()
        },
    );
    wait_until("slices", &dirs, || slice_devices(&standin).len() > 8).await;
    const CREATED: &str = "cleave_kubelet_plugin_mig_instances_created_total";
    const DESTROYED: &str = "cleave_kubelet_plugin_mig_instances_destroyed_total";
    const MPS: &str = "cleave_kubelet_plugin_mps_daemons_running";
    let before = scrape(port);
    assert_eq!(sample(&before, CREATED, &[]), Some(0.0));
    assert_eq!(sample(&before, DESTROYED, &[]), Some(0.0));
    assert_eq!(sample(&before, MPS, &[]), Some(0.0));
    let mut stream = watch_v1(&plugin.dra_socket).await;
    let all = next_v1(&mut stream).await.unwrap();
    assert!(all.len() > 8 && all.values().all(|(h, _)| *h));

    let mut dra = dra_v1(&plugin.dra_socket).await;
    let r = dra
        .node_prepare_resources(
            cleave_kubelet_plugin::proto::dra::v1::NodePrepareResourcesRequest {
                claims: vec![claim("mig", "uid-mig")],
            },
        )
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims["uid-mig"].error, "", "{}", dirs.log());
    let prepared = scrape(port);
    assert_eq!(sample(&prepared, CREATED, &[]), Some(1.0));
    assert_eq!(sample(&prepared, DESTROYED, &[]), Some(0.0));
    // No MPS config on the claim: no daemon.
    assert_eq!(sample(&prepared, MPS, &[]), Some(0.0));
    // Placement 0 of a 1g profile is GPU instance 7 (docs/hardware-sources.md, GPU/compute instance IDs), compute instance 0.
    let unhealthy = |h: &Health| -> Vec<String> {
        h.iter()
            .filter(|(_, (ok, _))| !ok)
            .map(|(n, _)| n.clone())
            .collect()
    };
    std::fs::write(&control, "xid 0 79 7 0\n").unwrap();
    let h = loop {
        let h = next_v1(&mut stream).await.unwrap();
        if !unhealthy(&h).is_empty() {
            break h;
        }
    };
    assert_eq!(unhealthy(&h), ["gpu-0-mig-1g10gb-0"]);

    std::fs::write(&control, "xid 0 79 7 0\nxid 1 79\n").unwrap();
    let h = loop {
        let h = next_v1(&mut stream).await.unwrap();
        if unhealthy(&h).len() > 1 {
            break h;
        }
    };
    let gpu1: Vec<String> = all
        .keys()
        .filter(|n| *n == "gpu-1" || n.starts_with("gpu-1-"))
        .cloned()
        .collect();
    assert!(gpu1.len() > 1);
    let mut expected = gpu1;
    expected.push("gpu-0-mig-1g10gb-0".into());
    expected.sort();
    assert_eq!(unhealthy(&h), expected);
    // Removed from the published pool (default --device-taints=off).
    wait_until("gpu-1 removed", &dirs, || {
        let d = slice_devices(&standin);
        !d.keys().any(|n| n == "gpu-1" || n.starts_with("gpu-1-"))
            && !d.contains_key("gpu-0-mig-1g10gb-0")
            && d.contains_key("gpu-0")
    })
    .await;

    // Unprepare destroys the created instance (even though it is marked unhealthy).
    let r = dra
        .node_unprepare_resources(
            cleave_kubelet_plugin::proto::dra::v1::NodeUnprepareResourcesRequest {
                claims: vec![claim("mig", "uid-mig")],
            },
        )
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims["uid-mig"].error, "", "{}", dirs.log());
    let unprepared = scrape(port);
    assert_eq!(sample(&unprepared, CREATED, &[]), Some(1.0));
    assert_eq!(sample(&unprepared, DESTROYED, &[]), Some(1.0));
    assert!(plugin.terminate().success(), "{}", dirs.log());
}
