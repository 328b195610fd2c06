//! Lifecycle end to end, on the real binary: a late NVIDIA driver, an unreadable
//! checkpoint and its one-command recovery, checkpoints of the previous and the next
//! release, and other managers of the node's GPUs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cleave_apiserver_standin::StandIn;
use cleave_kubelet_plugin::proto::dra::v1;
use cleave_kubelet_plugin::proto::registration::RegistrationStatus;
use common::node::*;
use common::*;
use k8s_openapi::api::resource::v1::ResourceSlice;

/// Fast retries for the tests.
const RETRY: [(&str, &str); 2] = [("RETRY_INITIAL_MS", "50"), ("RETRY_MAX_MS", "200")];

/// The plugin binary, started without waiting for its sockets; killed on drop.
struct Spawned {
    child: Child,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn spawn(dirs: &NodeDirs, nvml_lib: &Path, port: u16) -> Spawned {
    Spawned {
        child: command(dirs, nvml_lib, port).spawn().unwrap(),
    }
}

/// The plugin's command line on this node, serving metrics on `port`.
fn command(dirs: &NodeDirs, nvml_lib: &Path, port: u16) -> Command {
    dirs.lay_out_driver_root("h100-80gb-x8");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dirs.path().join("plugin.log"))
        .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"));
    cmd.arg("run")
        .arg(format!("--metrics-addr=127.0.0.1:{port}"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("NODE_NAME", NODE)
        .env("KUBECONFIG", dirs.kubeconfig())
        .env("NVML_LIB", nvml_lib)
        .env("MOCK_NVML_PROFILE", "h100-80gb-x8")
        .env("MOCK_NVML_MIG", "off")
        .env("MOCK_NVML_STATE", dirs.mock_state())
        .env("KUBELET_REGISTRAR_DIRECTORY_PATH", dirs.registrar())
        .env("KUBELET_PLUGINS_DIRECTORY_PATH", dirs.plugins())
        .env("CDI_ROOT", dirs.cdi_root())
        .env("MPS_PIPE_ROOT", dirs.mps_pipe_root())
        .env("NVIDIA_DRIVER_ROOT", dirs.driver_root())
        .env("RUST_LOG", "info")
        .envs(RETRY)
        .stdin(Stdio::null())
        .stderr(log);
    cmd
}

fn reg_socket(dirs: &NodeDirs) -> PathBuf {
    dirs.registrar().join(format!("{DRIVER}-reg.sock"))
}

/// Polls `f` until it returns Some, at most `TIMEOUT`.
async fn wait_some<T>(what: &str, dirs: &NodeDirs, mut f: impl FnMut() -> Option<T>) -> T {
    let started = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            started.elapsed() < TIMEOUT,
            "timed out waiting for {what}\n{}",
            dirs.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the plugin has logged `n` retries of its wait for the NVIDIA driver: proof
/// that the decisions before them (not registering, not publishing) were taken.
async fn wait_retries(dirs: &NodeDirs, n: usize) {
    wait_some("retries of the wait for the driver", dirs, || {
        (dirs.log().matches("waiting for the NVIDIA driver").count() >= n).then_some(())
    })
    .await;
}

fn metric(port: u16, name: &str) -> Option<f64> {
    let (_, text) = http_get(port, "/metrics")?;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} "))?.trim().parse().ok())
}

/// Acts as the kubelet: confirms the registration, then waits for /readyz 200.
async fn register_and_wait_ready(dirs: &NodeDirs, port: u16) {
    let sock = reg_socket(dirs);
    wait_some("the registration socket", dirs, || {
        sock.exists().then_some(())
    })
    .await;
    let mut reg = registration(&sock).await;
    reg.notify_registration_status(RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await
    .unwrap();
    wait_some("readyz 200", dirs, || {
        http_get(port, "/readyz").and_then(|(s, _)| (s == 200).then_some(()))
    })
    .await;
}

fn slices(standin: &StandIn) -> Vec<ResourceSlice> {
    standin.list_as("resourceslices")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_nvidia_driver_is_waited_for_then_published() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    let lib_dir = dirs.path().join("driver-lib");
    let lib = lib_dir.join("libnvidia-ml.so.1");
    let port = free_port();
    let mut plugin = spawn(&dirs, &lib, port);

    let body = wait_some("readyz 503 naming the driver", &dirs, || {
        http_get(port, "/readyz")
            .and_then(|(s, b)| (s == 503 && b.contains("NVIDIA driver not ready")).then_some(b))
    })
    .await;
    assert!(body.contains("libnvidia-ml.so.1"), "{body}");
    assert_eq!(
        http_get(port, "/healthz").unwrap().0,
        200,
        "liveness stays OK"
    );
    assert_eq!(
        metric(port, "cleave_kubelet_plugin_nvml_available"),
        Some(0.0)
    );
    // Several retries later (each logs that it waits): still alive, not registered,
    // nothing published.
    wait_retries(&dirs, 3).await;
    assert!(
        plugin.child.try_wait().unwrap().is_none(),
        "crashed:\n{}",
        dirs.log()
    );
    assert!(
        !reg_socket(&dirs).exists(),
        "registered before the driver was there"
    );
    assert!(slices(&standin).is_empty(), "published without a driver");
    assert!(
        dirs.log().contains("waiting for the NVIDIA driver"),
        "{}",
        dirs.log()
    );

    // The driver arrives.
    std::fs::create_dir_all(&lib_dir).unwrap();
    std::os::unix::fs::symlink(mock_lib(), &lib).unwrap();
    register_and_wait_ready(&dirs, port).await;
    let devices: usize = slices(&standin)
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    assert_eq!(devices, 8);
    assert_eq!(
        metric(port, "cleave_kubelet_plugin_nvml_available"),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_checkpoint_blocks_start_until_reset() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    std::fs::create_dir_all(dirs.state_dir()).unwrap();
    std::fs::write(
        dirs.checkpoint(),
        b"{\"version\":1,\"checksum\":\"sha256:00\",\"data\":{}}",
    )
    .unwrap();
    let port = free_port();
    let mut plugin = spawn(&dirs, &mock_lib(), port);

    let body = wait_some("readyz 503 naming the checkpoint", &dirs, || {
        http_get(port, "/readyz")
            .and_then(|(s, b)| (s == 503 && b.contains("checkpoint unreadable")).then_some(b))
    })
    .await;
    assert!(body.contains("checksum mismatch"), "{body}");
    assert_eq!(http_get(port, "/healthz").unwrap().0, 200);
    let event = wait_event(&standin, "CheckpointUnreadable").await;
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["regarding"]["kind"], "Node");
    assert_eq!(event["regarding"]["name"], NODE);
    let note = event["note"].as_str().unwrap();
    assert!(
        note.contains(&dirs.checkpoint().display().to_string()),
        "{note}"
    );
    assert!(note.contains("checksum mismatch"), "{note}");
    assert!(
        note.contains("cleave-kubelet-plugin checkpoint reset --plugins-dir"),
        "{note}"
    );
    assert_eq!(
        metric(port, "cleave_kubelet_plugin_checkpoint_healthy"),
        Some(0.0)
    );
    wait_some("two failed reads", &dirs, || {
        metric(port, "cleave_kubelet_plugin_checkpoint_errors_total").filter(|n| *n >= 2.0)
    })
    .await;
    assert!(
        !reg_socket(&dirs).exists(),
        "registered with an unreadable checkpoint"
    );
    assert!(slices(&standin).is_empty());
    assert!(plugin.child.try_wait().unwrap().is_none());
    // The file is kept as it was.
    assert!(
        std::fs::read(dirs.checkpoint())
            .unwrap()
            .starts_with(b"{\"version\":1")
    );

    // The documented recovery: one command.
    let out = Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .args(["checkpoint", "reset", "--plugins-dir"])
        .arg(dirs.plugins())
        .args(["--driver-name", DRIVER])
        .env_clear()
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("unreadable") && stdout.contains("moved to"),
        "{stdout}"
    );
    // It never recommends itself.
    assert!(!stdout.contains("checkpoint reset"), "{stdout}");
    assert!(!dirs.checkpoint().exists());
    let aside: Vec<_> = std::fs::read_dir(dirs.state_dir())
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("checkpoint.json.corrupt-")
        })
        .collect();
    assert_eq!(aside.len(), 1);

    // The plugin picks it up on its next retry.
    register_and_wait_ready(&dirs, port).await;
    assert!(!slices(&standin).is_empty());
    assert_eq!(
        metric(port, "cleave_kubelet_plugin_checkpoint_healthy"),
        Some(1.0)
    );
}

const FIXTURE_UID: &str = "0a4b2c1d-0000-4000-8000-00000000000a";

/// Seeds the checkpoint with `fixture` (a claim on gpu-1 written by another release, of
/// an earlier boot), starts the plugin and checks the claim is prepared and unprepares.
async fn checkpoint_fixture_loads(fixture: &str) {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(&standin, "whole-gpu", FIXTURE_UID, &[("gpu", "gpu-1")], &[]);
    std::fs::create_dir_all(dirs.state_dir()).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(fixture);
    std::fs::copy(&src, dirs.checkpoint()).unwrap();
    let fixture_text = std::fs::read_to_string(&src).unwrap();
    let gpu1 = mock_nvml::fixtures::gpu_uuid("h100-80gb-x8", 1);
    assert!(
        fixture_text.contains(&gpu1),
        "fixture UUID drifted from the mock: {gpu1}"
    );

    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    // Recreated after the "reboot" (other boot ID): its CDI spec is written again.
    wait_some("the claim's CDI spec", &dirs, || {
        dirs.cdi_files()
            .iter()
            .any(|f| f.contains(FIXTURE_UID))
            .then_some(())
    })
    .await;
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let r = prepare(&mut dra, vec![claim("whole-gpu", FIXTURE_UID)]).await;
    let result = &r.claims[FIXTURE_UID];
    assert_eq!(result.error, "", "{}", dirs.log());
    assert_eq!(result.devices.len(), 1);
    assert_eq!(result.devices[0].device_name, "gpu-1");
    assert_eq!(
        result.devices[0].cdi_device_ids,
        [format!("k8s.gpu.cleave.dev/claim={FIXTURE_UID}-gpu-1")]
    );
    // Another claim cannot take gpu-1: the record holds it.
    put_claim(&standin, "thief", "uid-thief", &[("gpu", "gpu-1")], &[]);
    let r = prepare(&mut dra, vec![claim("thief", "uid-thief")]).await;
    assert_ne!(r.claims["uid-thief"].error, "", "gpu-1 prepared twice");

    let r = tokio::time::timeout(
        TIMEOUT,
        dra.node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![claim("whole-gpu", FIXTURE_UID)],
        }),
    )
    .await
    .unwrap()
    .unwrap()
    .into_inner();
    assert_eq!(r.claims[FIXTURE_UID].error, "");
    assert!(!dirs.cdi_files().iter().any(|f| f.contains(FIXTURE_UID)));
    let text = std::fs::read_to_string(dirs.checkpoint()).unwrap();
    assert!(!text.contains(FIXTURE_UID), "{text}");
    assert!(plugin.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_of_the_previous_release_loads() {
    checkpoint_fixture_loads("checkpoint-v1-node-a.json").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_with_fields_of_a_newer_release_loads() {
    checkpoint_fixture_loads("checkpoint-v1-future-fields.json").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_plugin_and_other_driver_on_the_same_gpus_are_reported() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    let mut node = cleave_apiserver_standin::fixtures::node(NODE);
    let status = node.status.get_or_insert_with(Default::default);
    status.capacity = Some(
        [(
            "nvidia.com/gpu".to_owned(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity("8".into()),
        )]
        .into(),
    );
    standin.put(&node).unwrap();
    let gpu0 = mock_nvml::fixtures::gpu_uuid("h100-80gb-x8", 0);
    let foreign: ResourceSlice = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-gpu.nvidia.com"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", "attributes": {"uuid": {"string": gpu0}}}]
        }
    }))
    .unwrap();
    standin.put(&foreign).unwrap();

    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let dp = wait_event(&standin, "GPUsSharedWithDevicePlugin").await;
    assert_eq!(dp["type"], "Warning");
    assert!(
        dp["note"].as_str().unwrap().contains("nvidia.com/gpu=8"),
        "{dp}"
    );
    let other = wait_event(&standin, "GPUsSharedWithOtherDriver").await;
    let note = other["note"].as_str().unwrap();
    assert!(
        note.contains("gpu.nvidia.com") && note.contains(&gpu0),
        "{note}"
    );
    // A warning, not a refusal: the plugin runs and publishes.
    let started = Instant::now();
    while !slices(&standin).iter().any(|s| s.spec.driver == DRIVER) {
        assert!(started.elapsed() < TIMEOUT, "{}", dirs.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(plugin.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mps_on_a_gpu_that_cannot_do_it_fails_that_claim_only() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    // gpu-0: a Pascal-era part (compute capability 6.1), gpu-1: an L4 (8.9).
    let config = dirs.path().join("old-gpu.yaml");
    std::fs::write(
        &config,
        "name: old-gpu\ngpus:\n  - product: l4\n    name: Tesla P4\n    computeCapability: \"6.1\"\n  - product: l4\n",
    )
    .unwrap();
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            env: vec![("MOCK_NVML_CONFIG", config.display().to_string())],
            ..PluginOptions::default()
        },
    );
    let mps = cleave_apiserver_standin::fixtures::opaque_config(
        "FromClaim",
        &["gpu"],
        DRIVER,
        serde_json::json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50}}}),
    );
    put_claim(
        &standin,
        "mps-old",
        "uid-mps-old",
        &[("gpu", "gpu-0")],
        &[mps],
    );
    put_claim(&standin, "plain", "uid-plain", &[("gpu", "gpu-1")], &[]);
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let r = prepare(
        &mut dra,
        vec![claim("mps-old", "uid-mps-old"), claim("plain", "uid-plain")],
    )
    .await;
    let err = &r.claims["uid-mps-old"].error;
    assert!(err.contains("MPS is not supported"), "{err}");
    assert!(err.contains("compute capability 6.1"), "{err}");
    assert!(
        err.contains("Tesla P4") && err.contains("GPU-"),
        "names the GPU: {err}"
    );
    assert_eq!(
        r.claims["uid-plain"].error, "",
        "the other claim is unaffected"
    );
    // Nothing of the failed claim stays: gpu-0 is free for a plain claim.
    assert!(!dirs.cdi_files().iter().any(|f| f.contains("uid-mps-old")));
    put_claim(&standin, "plain0", "uid-plain0", &[("gpu", "gpu-0")], &[]);
    let r = prepare(&mut dra, vec![claim("plain0", "uid-plain0")]).await;
    assert_eq!(r.claims["uid-plain0"].error, "", "{}", dirs.log());
    assert!(plugin.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_gpus_waits_unless_allowed() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    let config = dirs.path().join("empty.yaml");
    std::fs::write(&config, "name: empty\ngpus: []\n").unwrap();
    let port = free_port();
    let spawn_with = |allow: bool| {
        let mut cmd = command(&dirs, &mock_lib(), port);
        cmd.env("MOCK_NVML_CONFIG", &config);
        if allow {
            cmd.arg("--allow-no-gpus");
        }
        Spawned {
            child: cmd.spawn().unwrap(),
        }
    };

    let plugin = spawn_with(false);
    let body = wait_some("readyz 503: no GPU", &dirs, || {
        http_get(port, "/readyz")
            .and_then(|(s, b)| (s == 503 && b.contains("NVML found no GPU")).then_some(b))
    })
    .await;
    assert!(body.contains("--allow-no-gpus"), "{body}");
    wait_retries(&dirs, 3).await;
    assert!(!reg_socket(&dirs).exists());
    assert!(slices(&standin).is_empty(), "an empty pool was published");
    // SIGTERM while waiting ends the process cleanly.
    let mut plugin = plugin;
    let pid = plugin.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = wait_some("exit after SIGTERM", &dirs, || {
        plugin.child.try_wait().unwrap()
    })
    .await;
    assert!(status.success(), "{status}");

    let _plugin = spawn_with(true);
    register_and_wait_ready(&dirs, port).await;
    let devices: usize = slices(&standin)
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    assert_eq!(devices, 0);
}

/// On-demand MIG against an API server without `DRAPartitionableDevices` (it drops
/// counters on write): no MIG placement device is ever published, the Node gets a Warning
/// Event naming the gate and the fix, `/readyz` and a metric say how many devices are
/// withheld, and nothing is rewritten in a loop. Once the gate is on, the full pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_dropped_by_the_api_server_withhold_mig_devices_until_the_gate_is_on() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    standin.set_partitionable_devices(false);
    let port = free_port();
    let mut cmd = command(&dirs, &mock_lib(), port);
    cmd.arg("--dynamic-mig")
        .env("MOCK_NVML_MIG", "on")
        .env("COUNTER_PROBE_INTERVAL_SECS", "1");
    let mut plugin = Spawned {
        child: cmd.spawn().unwrap(),
    };
    register_and_wait_ready(&dirs, port).await;

    let event = wait_event(&standin, "PartitionableDevicesDisabled").await;
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["regarding"]["kind"], "Node");
    let note = event["note"].as_str().unwrap();
    assert!(
        note.contains("DRAPartitionableDevices") && note.contains("Fix: enable"),
        "{note}"
    );
    let devices = |standin: &StandIn| -> Vec<String> {
        slices(standin)
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten().map(|d| d.name.clone()))
            .collect()
    };
    let published = devices(&standin);
    assert!(
        published.iter().all(|d| !d.contains("-mig-")),
        "{published:?}"
    );
    assert!(
        slices(&standin)
            .iter()
            .all(|s| s.spec.shared_counters.is_none())
    );
    let withheld = metric(port, "cleave_kubelet_plugin_devices_withheld").unwrap();
    assert!(withheld > 8.0, "{withheld}");
    let (status, body) = http_get(port, "/readyz").unwrap();
    assert_eq!(status, 200);
    assert!(
        body.contains("devices withheld") && body.contains("DRAPartitionableDevices"),
        "{body}"
    );
    // No rewrite loop: the dry-run probes every second change nothing.
    let writes = |s: &StandIn| {
        s.count("create", "resourceslices") - s.count_dry_runs("create", "resourceslices")
            + s.count("update", "resourceslices")
            + s.count("delete", "resourceslices")
    };
    let before = writes(&standin);
    let probes = standin.count_dry_runs("create", "resourceslices");
    wait_some("two more counter probes", &dirs, || {
        (standin.count_dry_runs("create", "resourceslices") >= probes + 2).then_some(())
    })
    .await;
    assert_eq!(writes(&standin), before);
    assert!(plugin.child.try_wait().unwrap().is_none());

    // The gate comes on: the full pool, counters included, and the metric back at 0.
    standin.set_partitionable_devices(true);
    wait_some("MIG placement devices published", &dirs, || {
        devices(&standin)
            .iter()
            .any(|d| d.contains("-mig-"))
            .then_some(())
    })
    .await;
    wait_some("devices_withheld 0", &dirs, || {
        (metric(port, "cleave_kubelet_plugin_devices_withheld") == Some(0.0)).then_some(())
    })
    .await;
    let (_, body) = http_get(port, "/readyz").unwrap();
    assert!(!body.contains("withheld"), "{body}");
}
