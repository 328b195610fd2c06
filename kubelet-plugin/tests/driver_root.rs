//! The plugin binary over driver roots laid out like real hosts: NVML found in the root's
//! library directories (no `--nvml-lib`, as the chart runs it), claims refused when their
//! containers would lack the GPU's node or the CUDA library, a root without any driver
//! reported as not ready, and a bad node name refused before anything starts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cleave_apiserver_standin::StandIn;
use cleave_kubelet_plugin::proto::dra::v1;
use common::node::*;
use common::*;
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::Value;

fn device_count(standin: &StandIn) -> usize {
    standin
        .list_as::<ResourceSlice>("resourceslices")
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum()
}

async fn wait_devices(standin: &StandIn, dirs: &NodeDirs, want: usize) {
    let started = Instant::now();
    while device_count(standin) != want {
        assert!(
            started.elapsed() < TIMEOUT,
            "{} devices published, want {want}:\n{}",
            device_count(standin),
            dirs.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Puts a whole-GPU claim on gpu-0 and an on-demand MIG claim on it, prepares both and
/// checks that each fails naming every one of `names` and none of `present`.
async fn both_claims_refused_naming(
    standin: &StandIn,
    plugin: &Plugin,
    names: &[&str],
    present: &[&str],
) -> v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel> {
    put_claim(standin, "whole", "uid-whole", &[("gpu", "gpu-0")], &[]);
    put_claim(
        standin,
        "slice",
        "uid-slice",
        &[("mig", "gpu-0-mig-3g40gb-4")],
        &[],
    );
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let resp = prepare(
        &mut dra,
        vec![claim("whole", "uid-whole"), claim("slice", "uid-slice")],
    )
    .await;
    for uid in ["uid-whole", "uid-slice"] {
        let error = &resp.claims[uid].error;
        for name in names {
            assert!(error.contains(name), "{uid}: {name} not named: {error}");
        }
        for name in present {
            assert!(!error.contains(name), "{uid}: {name} is there: {error}");
        }
    }
    dra
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvml_is_loaded_from_the_driver_root_and_every_gpu_is_published() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            nvml_from_driver_root: true,
            ..PluginOptions::default()
        },
    );
    wait_devices(&standin, &dirs, 8).await;
    let log = dirs.log();
    let lib = dirs
        .driver_root()
        .join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
    assert!(
        log.contains(&format!("library={}", lib.display())),
        "the log names the library loaded:\n{log}"
    );
    assert!(plugin.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvml_is_found_in_a_rhel_style_root_too() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    mock_nvml::driver_root::DriverRootFixture {
        layout: mock_nvml::driver_root::HostLayout::Rhel,
        nvml: Some(mock_lib()),
        ..mock_nvml::driver_root::DriverRootFixture::for_profile("l4-x2").unwrap()
    }
    .lay_out(&dirs.driver_root())
    .unwrap();
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            profile: "l4-x2",
            nvml_from_driver_root: true,
            driver_root_as_is: true,
            ..PluginOptions::default()
        },
    );
    wait_devices(&standin, &dirs, 2).await;
    assert!(plugin.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_without_a_driver_is_not_ready_naming_every_path_tried() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    std::fs::create_dir_all(dirs.driver_root()).unwrap();
    let port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .arg("run")
        .arg(format!("--metrics-addr=127.0.0.1:{port}"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("NODE_NAME", NODE)
        .env("KUBECONFIG", dirs.kubeconfig())
        .env("KUBELET_REGISTRAR_DIRECTORY_PATH", dirs.registrar())
        .env("KUBELET_PLUGINS_DIRECTORY_PATH", dirs.plugins())
        .env("CDI_ROOT", dirs.cdi_root())
        .env("NVIDIA_DRIVER_ROOT", dirs.driver_root())
        .env("RETRY_INITIAL_MS", "50")
        .env("RETRY_MAX_MS", "200")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let body = loop {
        if let Some((503, body)) = http_get(port, "/readyz")
            && body.contains("NVIDIA driver not ready")
        {
            break body;
        }
        assert!(started.elapsed() < TIMEOUT, "never not-ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    for dir in ["usr/lib/x86_64-linux-gnu", "usr/lib64"] {
        let tried = dirs.driver_root().join(dir).join("libnvidia-ml.so.1");
        assert!(
            body.contains(&format!("{}: not found", tried.display())),
            "{body}"
        );
    }
    assert!(body.contains("--driver-root"), "{body}");
    let event = wait_event(&standin, "NVIDIADriverNotReady").await;
    let note = event["note"].as_str().unwrap_or_default();
    assert!(note.contains("libnvidia-ml.so.1"), "{note}");
    assert_eq!(event["type"], "Warning");
    assert_eq!(device_count(&standin), 0, "nothing published while waiting");
    child.kill().unwrap();
    child.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_whose_containers_would_lack_files_fail_naming_them_until_the_files_appear() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    // Lay the root out, then take away GPU 0's node and the CUDA library.
    dirs.lay_out_driver_root_with_nvml("h100-80gb-x8");
    let root = dirs.driver_root();
    std::fs::remove_file(root.join("dev/nvidia0")).unwrap();
    let lib_dir = root.join("usr/lib/x86_64-linux-gnu");
    for entry in std::fs::read_dir(&lib_dir).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name().to_string_lossy().starts_with("libcuda.") {
            std::fs::remove_file(entry.path()).unwrap();
        }
    }
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            mig: "on",
            dynamic_mig: true,
            nvml_from_driver_root: true,
            driver_root_as_is: true,
            ..PluginOptions::default()
        },
    );
    let root_name = root.display().to_string();
    let mut dra = both_claims_refused_naming(
        &standin,
        &plugin,
        &["/dev/nvidia0", "libcuda.so.1", &root_name],
        &["/dev/nvidiactl,"],
    )
    .await;
    assert!(dirs.cdi_files().is_empty(), "no spec for a refused claim");
    // The claim's owner sees why, on the claim.
    let event = wait_event(&standin, "PrepareFailed").await;
    let note = event["note"].as_str().unwrap_or_default();
    assert!(note.contains("/dev/nvidia0"), "{note}");

    // The driver finishes installing: the same claims prepare, no restart needed (one
    // after the other: a whole GPU and a MIG slice of it never coexist).
    dirs.lay_out_driver_root_with_nvml("h100-80gb-x8");
    let resp = prepare(&mut dra, vec![claim("slice", "uid-slice")]).await;
    assert_eq!(resp.claims["uid-slice"].error, "");
    let resp = unprepare(&mut dra, vec![claim("slice", "uid-slice")]).await;
    assert_eq!(resp.claims["uid-slice"].error, "");
    let resp = prepare(&mut dra, vec![claim("whole", "uid-whole")]).await;
    assert_eq!(resp.claims["uid-whole"].error, "");
    let spec: Value = serde_json::from_slice(
        &std::fs::read(
            dirs.cdi_root()
                .join("k8s.gpu.cleave.dev-claim_uid-whole.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let node = &spec["devices"][0]["containerEdits"]["deviceNodes"][0];
    assert_eq!(node["path"], "/dev/nvidia0");
    assert_eq!(
        (node["type"].clone(), node["major"].clone()),
        ("c".into(), 195.into())
    );
    let common: Vec<&str> = spec["containerEdits"]["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap())
        .collect();
    assert!(common.contains(&"/dev/nvidiactl") && common.contains(&"/dev/nvidia-uvm"));
    assert!(plugin.terminate().success());
}

#[test]
fn a_bad_node_name_is_refused_at_once_naming_the_flag() {
    for bad in ["Node_A", ""] {
        let started = Instant::now();
        let out = Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
            .args(["run", "--node-name", bad])
            .env_clear()
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("--node-name"), "{stderr}");
        assert!(stderr.contains("not a Kubernetes node name"), "{stderr}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }
    let long = "a".repeat(300);
    let out = Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .arg("run")
        .env_clear()
        .env("NODE_NAME", &long)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("300 characters"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_enabled_without_instances_in_static_mode_is_a_warning_event() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            mig: "on",
            dynamic_mig: false,
            ..PluginOptions::default()
        },
    );
    let event = wait_event(&standin, "MIGEnabledWithoutInstances").await;
    let note = event["note"].as_str().unwrap_or_default();
    assert_eq!(event["type"], "Warning");
    for needle in [
        "MIG is enabled",
        "gpu-0",
        "gpu-7",
        "--dynamic-mig",
        "nvidia-smi mig -cgi",
    ] {
        assert!(note.contains(needle), "{needle} not in {note}");
    }
    assert!(dirs.log().contains("publish no device"), "{}", dirs.log());
    assert_eq!(device_count(&standin), 0);
    assert!(plugin.terminate().success());
}

#[test]
fn inspect_says_why_a_gpu_publishes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .args(["inspect", "--mock", "h100-80gb-x8"])
        .env_clear()
        .env("MOCK_NVML_STATE", dir.path().join("state"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("0 devices published"), "{text}");
    assert!(
        text.contains("no devices published: MIG is enabled and no MIG instance exists"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_without_driver_files_publishes_nothing_refuses_claims_and_recovers() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    std::fs::create_dir_all(dirs.driver_root()).unwrap();
    let port = free_port();
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            mig: "on",
            dynamic_mig: true,
            driver_root_as_is: true,
            metrics_port: Some(port),
            env: vec![("RETRY_MAX_MS", "200".to_owned())],
            ..PluginOptions::default()
        },
    );
    let started = Instant::now();
    let body = loop {
        if let Some((503, body)) = http_get(port, "/readyz")
            && body.contains("holds no NVIDIA driver files")
        {
            break body;
        }
        assert!(
            started.elapsed() < TIMEOUT,
            "never not-ready:\n{}",
            dirs.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(body.contains("NVML sees 8 GPU(s)"), "{body}");
    let event = wait_event(&standin, "NVIDIADriverNotReady").await;
    assert!(
        event["note"]
            .as_str()
            .unwrap_or_default()
            .contains("holds no NVIDIA driver files")
    );

    let mut dra = both_claims_refused_naming(
        &standin,
        &plugin,
        &[
            "/dev/nvidia0",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "libcuda.so.1",
        ],
        &[],
    )
    .await;
    assert_eq!(
        device_count(&standin),
        0,
        "nothing offered without a driver"
    );

    // The driver container finishes: the plugin notices without a restart and publishes.
    dirs.lay_out_driver_root("h100-80gb-x8");
    let started = Instant::now();
    while device_count(&standin) == 0 {
        assert!(
            started.elapsed() < TIMEOUT,
            "never published:\n{}",
            dirs.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let resp = prepare(&mut dra, vec![claim("slice", "uid-slice")]).await;
    assert_eq!(resp.claims["uid-slice"].error, "");
    assert!(plugin.terminate().success());
}
