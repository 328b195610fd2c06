//! End to end: the real plugin binary on a simulated node (mock NVML library, API server
//! stand-in), with the test acting as the kubelet over the unix sockets.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::PermissionsExt;

use cleave_apiserver_standin::fixtures;
use cleave_kubelet_plugin::proto::dra::v1beta1;
use cleave_kubelet_plugin::proto::registration::{InfoRequest, RegistrationStatus};
use common::node::*;
use common::*;
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::json;

async fn wait_for_slices(standin: &cleave_apiserver_standin::StandIn) -> Vec<ResourceSlice> {
    let started = std::time::Instant::now();
    loop {
        let slices: Vec<ResourceSlice> = standin.list_as("resourceslices");
        if !slices.is_empty() {
            return slices;
        }
        assert!(started.elapsed() < TIMEOUT, "no ResourceSlices published");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_registers_publishes_and_sigterm_removes_only_its_sockets() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            pod_uid: Some("0f1e2d3c"),
            ..PluginOptions::default()
        },
    );
    assert_eq!(
        plugin.registration_socket,
        dirs.registrar().join("gpu.cleave.dev-0f1e2d3c-reg.sock")
    );
    for sock in [&plugin.registration_socket, &plugin.dra_socket] {
        let mode = std::fs::symlink_metadata(sock)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{}", sock.display());
    }
    let mode = std::fs::metadata(dirs.state_dir())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700);

    let mut reg = registration(&plugin.registration_socket).await;
    let info = reg.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, DRIVER);
    assert_eq!(info.endpoint, plugin.dra_socket.display().to_string());
    // DRA versions first, then the device health stream's.
    assert_eq!(
        info.supported_versions,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth",
            "v1.DRAResourceHealth"
        ]
    );
    reg.notify_registration_status(RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await
    .unwrap();

    let slices = wait_for_slices(&standin).await;
    let devices: usize = slices
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    assert_eq!(devices, 8, "eight whole H100s");
    assert!(
        slices
            .iter()
            .all(|s| s.spec.node_name.as_deref() == Some(NODE))
    );

    // A socket of another instance (say the next pod of a rolling update) must survive.
    let other = dirs.registrar().join("gpu.cleave.dev-other-reg.sock");
    let _other_listener = std::os::unix::net::UnixListener::bind(&other).unwrap();

    let (reg_sock, dra_sock) = (
        plugin.registration_socket.clone(),
        plugin.dra_socket.clone(),
    );
    let status = plugin.terminate();
    assert!(status.success(), "{status}");
    assert!(!reg_sock.exists());
    assert!(!dra_sock.exists());
    assert!(other.exists());
    // Slices stay on shutdown: a restarted plugin takes them over.
    assert_eq!(
        standin.list_as::<ResourceSlice>("resourceslices").len(),
        slices.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_gpu_prepare_writes_cdi_is_idempotent_and_unprepare_cleans_up() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(&standin, "one-gpu", "uid-one", &[("gpu", "gpu-0")], &[]);
    put_claim(
        &standin,
        "two-gpus",
        "uid-two",
        &[("a", "gpu-1"), ("b", "gpu-2")],
        &[],
    );
    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let mut dra = dra_v1(&plugin.dra_socket).await;

    let first = prepare(
        &mut dra,
        vec![claim("one-gpu", "uid-one"), claim("two-gpus", "uid-two")],
    )
    .await;
    assert_eq!(first.claims.len(), 2);
    let one = &first.claims["uid-one"];
    assert_eq!(one.error, "");
    assert_eq!(one.devices.len(), 1);
    assert_eq!(one.devices[0].device_name, "gpu-0");
    assert_eq!(one.devices[0].pool_name, NODE);
    assert_eq!(one.devices[0].request_names, ["gpu"]);
    assert_eq!(
        one.devices[0].cdi_device_ids,
        ["k8s.gpu.cleave.dev/claim=uid-one-gpu-0"]
    );
    let two = &first.claims["uid-two"];
    assert_eq!(two.error, "");
    let names: Vec<_> = two.devices.iter().map(|d| d.device_name.as_str()).collect();
    assert_eq!(names, ["gpu-1", "gpu-2"]);
    assert_eq!(dirs.cdi_files().len(), 2, "{:?}", dirs.cdi_files());
    let spec = std::fs::read_to_string(dirs.cdi_root().join(&dirs.cdi_files()[0])).unwrap();
    assert!(spec.contains("k8s.gpu.cleave.dev/claim"), "{spec}");

    // The kubelet repeats prepare after restarts: same answer, nothing new.
    let again = prepare(&mut dra, vec![claim("one-gpu", "uid-one")]).await;
    assert_eq!(again.claims["uid-one"], first.claims["uid-one"]);
    assert_eq!(dirs.cdi_files().len(), 2);

    // v1beta1 sees the same prepared claim.
    let mut beta = dra_v1beta1(&plugin.dra_socket).await;
    let b = beta
        .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
            claims: vec![v1beta1::Claim {
                namespace: "default".into(),
                name: "one-gpu".into(),
                uid: "uid-one".into(),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        b.claims["uid-one"].devices[0].cdi_device_ids,
        one.devices[0].cdi_device_ids
    );

    let done = unprepare(
        &mut dra,
        vec![claim("one-gpu", "uid-one"), claim("two-gpus", "uid-two")],
    )
    .await;
    assert_eq!(done.claims.len(), 2);
    assert!(done.claims.values().all(|r| r.error.is_empty()), "{done:?}");
    assert!(dirs.cdi_files().is_empty(), "{:?}", dirs.cdi_files());
    // Unprepare is idempotent, also for claims never seen.
    let done = unprepare(
        &mut dra,
        vec![claim("one-gpu", "uid-one"), claim("never", "uid-never")],
    )
    .await;
    assert!(done.claims.values().all(|r| r.error.is_empty()), "{done:?}");
    let checkpoint = std::fs::read_to_string(dirs.checkpoint()).unwrap();
    assert!(!checkpoint.contains("uid-one"), "{checkpoint}");
    assert!(plugin.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_claims_each_get_a_clear_error_and_do_not_block_good_ones() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(&standin, "good", "uid-good", &[("gpu", "gpu-3")], &[]);
    put_claim(&standin, "replaced", "uid-new", &[("gpu", "gpu-4")], &[]);
    put_claim_in(
        &standin,
        "other-driver",
        "uid-drv",
        "other.example.com",
        NODE,
        &[("gpu", "gpu-5")],
        &[],
    );
    put_claim_in(
        &standin,
        "other-pool",
        "uid-pool",
        DRIVER,
        "node-b",
        &[("gpu", "gpu-5")],
        &[],
    );
    put_claim(
        &standin,
        "unknown-device",
        "uid-unknown",
        &[("gpu", "gpu-42")],
        &[],
    );
    let bad_config = fixtures::opaque_config(
        "FromClaim",
        &[],
        DRIVER,
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "Sideways"}}),
    );
    put_claim(
        &standin,
        "bad-config",
        "uid-config",
        &[("gpu", "gpu-6")],
        &[bad_config],
    );
    let mut unallocated = fixtures::resource_claim(
        "default",
        "unallocated",
        "uid-unalloc",
        DRIVER,
        NODE,
        &[],
        &[],
    );
    unallocated.status = None;
    standin.put(&unallocated).unwrap();

    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let resp = prepare(
        &mut dra,
        vec![
            claim("good", "uid-good"),
            claim("missing", "uid-missing"),
            claim("replaced", "uid-old"),
            claim("unallocated", "uid-unalloc"),
            claim("other-driver", "uid-drv"),
            claim("other-pool", "uid-pool"),
            claim("unknown-device", "uid-unknown"),
            claim("bad-config", "uid-config"),
        ],
    )
    .await;
    assert_eq!(resp.claims.len(), 8);
    let err = |uid: &str| resp.claims[uid].error.clone();
    assert_eq!(err("uid-good"), "");
    assert_eq!(resp.claims["uid-good"].devices[0].device_name, "gpu-3");
    assert!(
        err("uid-missing").contains("default/missing not found"),
        "{}",
        err("uid-missing")
    );
    assert_eq!(
        err("uid-old"),
        "claim default/replaced was replaced: UID uid-old != uid-new"
    );
    assert!(
        err("uid-unalloc").contains("not allocated"),
        "{}",
        err("uid-unalloc")
    );
    for uid in ["uid-drv", "uid-pool"] {
        assert!(
            err(uid).contains("no device allocated from driver gpu.cleave.dev in pool node-a"),
            "{}",
            err(uid)
        );
    }
    assert!(
        err("uid-unknown").contains("gpu-42"),
        "{}",
        err("uid-unknown")
    );
    assert!(
        err("uid-config").contains("invalid config"),
        "{}",
        err("uid-config")
    );
    assert!(
        err("uid-config").contains("Sideways"),
        "{}",
        err("uid-config")
    );
    for (uid, r) in &resp.claims {
        if uid != "uid-good" {
            assert!(r.devices.is_empty(), "{uid}");
        }
    }
    // Only the good claim left a CDI spec behind.
    assert_eq!(dirs.cdi_files().len(), 1, "{:?}", dirs.cdi_files());
    assert!(plugin.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unwritable_cdi_root_fails_the_claim_and_leaves_no_record() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(&standin, "c", "uid-c", &[("gpu", "gpu-0")], &[]);
    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    // Replace the CDI root by a file: every spec write fails (even as root).
    std::fs::remove_dir_all(dirs.cdi_root()).unwrap();
    std::fs::write(dirs.cdi_root(), b"not a directory").unwrap();
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let resp = prepare(&mut dra, vec![claim("c", "uid-c")]).await;
    let error = &resp.claims["uid-c"].error;
    assert!(
        error.contains(&dirs.cdi_root().display().to_string()),
        "{error}"
    );
    let checkpoint = std::fs::read_to_string(dirs.checkpoint()).unwrap();
    assert!(!checkpoint.contains("uid-c"), "{checkpoint}");

    // Once the root is back, the same claim prepares.
    std::fs::remove_file(dirs.cdi_root()).unwrap();
    std::fs::create_dir(dirs.cdi_root()).unwrap();
    let resp = prepare(&mut dra, vec![claim("c", "uid-c")]).await;
    assert_eq!(resp.claims["uid-c"].error, "");
    assert!(plugin.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_releases_claims_deleted_while_down() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(&standin, "kept", "uid-kept", &[("gpu", "gpu-0")], &[]);
    put_claim(&standin, "gone", "uid-gone", &[("gpu", "gpu-1")], &[]);
    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let resp = prepare(
        &mut dra,
        vec![claim("kept", "uid-kept"), claim("gone", "uid-gone")],
    )
    .await;
    assert!(resp.claims.values().all(|r| r.error.is_empty()), "{resp:?}");
    assert!(plugin.terminate().success());
    assert_eq!(dirs.cdi_files().len(), 2);

    standin.delete("resourceclaims", "default", "gone").unwrap();
    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let files = dirs.cdi_files();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(files[0].contains("uid-kept"), "{files:?}");
    let checkpoint = std::fs::read_to_string(dirs.checkpoint()).unwrap();
    assert!(
        checkpoint.contains("uid-kept") && !checkpoint.contains("uid-gone"),
        "{checkpoint}"
    );
    assert!(plugin.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_update_two_instances_share_the_node_state() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    for (name, uid, device) in [
        ("a", "uid-a", "gpu-0"),
        ("b", "uid-b", "gpu-1"),
        ("c", "uid-c", "gpu-2"),
        ("d", "uid-d", "gpu-1"),
    ] {
        put_claim(&standin, name, uid, &[("gpu", device)], &[]);
    }
    let old = Plugin::start(
        &dirs,
        &PluginOptions {
            pod_uid: Some("old"),
            ..PluginOptions::default()
        },
    );
    let new = Plugin::start(
        &dirs,
        &PluginOptions {
            pod_uid: Some("new"),
            ..PluginOptions::default()
        },
    );
    let mut old_dra = dra_v1(&old.dra_socket).await;
    let mut new_dra = dra_v1(&new.dra_socket).await;

    // Both instances prepare at the same time; the node lock serialises them.
    let (ra, rb) = tokio::join!(
        prepare(&mut old_dra, vec![claim("a", "uid-a")]),
        prepare(&mut new_dra, vec![claim("b", "uid-b")]),
    );
    assert_eq!(ra.claims["uid-a"].error, "");
    assert_eq!(rb.claims["uid-b"].error, "");
    let rc = prepare(&mut old_dra, vec![claim("c", "uid-c")]).await;
    assert_eq!(rc.claims["uid-c"].error, "");
    // The old instance knows that the new one gave gpu-1 to claim b.
    let rd = prepare(&mut old_dra, vec![claim("d", "uid-d")]).await;
    assert!(
        rd.claims["uid-d"]
            .error
            .contains("already prepared for another claim"),
        "{:?}",
        rd.claims["uid-d"]
    );

    // Unprepare may reach the other instance than the prepare did.
    let ua = unprepare(&mut new_dra, vec![claim("a", "uid-a")]).await;
    assert_eq!(ua.claims["uid-a"].error, "");
    let checkpoint = std::fs::read_to_string(dirs.checkpoint()).unwrap();
    assert!(!checkpoint.contains("uid-a"), "{checkpoint}");
    assert!(
        checkpoint.contains("uid-b") && checkpoint.contains("uid-c"),
        "{checkpoint}"
    );
    assert_eq!(dirs.cdi_files().len(), 2, "{:?}", dirs.cdi_files());

    // The old pod goes away; the new one keeps serving and can release everything.
    let (old_reg, old_dra_sock) = (old.registration_socket.clone(), old.dra_socket.clone());
    assert!(old.terminate().success());
    assert!(!old_reg.exists() && !old_dra_sock.exists());
    assert!(new.registration_socket.exists() && new.dra_socket.exists());
    let done = unprepare(&mut new_dra, vec![claim("b", "uid-b"), claim("c", "uid-c")]).await;
    assert!(done.claims.values().all(|r| r.error.is_empty()), "{done:?}");
    assert!(dirs.cdi_files().is_empty(), "{:?}", dirs.cdi_files());
    assert!(new.terminate().success());
}

/// A second instance with the same socket names (no pod UID) must not take the sockets of
/// the one that runs: it exits with an error naming it, and the first keeps answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_instance_on_the_same_sockets_exits_and_leaves_the_first_answering() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(&standin, "a", "uid-a", &[("gpu", "gpu-0")], &[]);
    let first = Plugin::start(&dirs, &PluginOptions::default());
    let pid = first.child.id();
    let inodes = |p: &std::path::Path| {
        use std::os::unix::fs::MetadataExt;
        std::fs::symlink_metadata(p).unwrap().ino()
    };
    let (reg_ino, dra_ino) = (
        inodes(&first.registration_socket),
        inodes(&first.dra_socket),
    );

    let status = Plugin::run_to_exit(&dirs, &PluginOptions::default());
    assert!(!status.success(), "the second instance must fail: {status}");
    let log = dirs.log();
    assert!(
        log.contains(&format!("is served by process {pid}")) && log.contains("POD_UID"),
        "the error names the running instance and the fix:\n{log}"
    );
    assert!(!log.contains("removing stale socket"), "{log}");

    // The same socket files, still answering.
    assert_eq!(inodes(&first.registration_socket), reg_ino);
    assert_eq!(inodes(&first.dra_socket), dra_ino);
    let mut reg = registration(&first.registration_socket).await;
    let info = reg.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.endpoint, first.dra_socket.display().to_string());
    let mut dra = dra_v1(&first.dra_socket).await;
    let r = prepare(&mut dra, vec![claim("a", "uid-a")]).await;
    assert_eq!(r.claims["uid-a"].error, "");
    assert!(first.terminate().success());
}

/// `checkpoint reset` against a healthy checkpoint holding a Prepared claim: refused while
/// the plugin runs (even with --force), refused without --force once it stopped (the file
/// byte for byte as it was), and a forced reset names the claim and removes its CDI spec
/// only when asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_reset_keeps_a_healthy_checkpoint() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(&standin, "a", "uid-a", &[("gpu", "gpu-0")], &[]);
    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let r = prepare(&mut dra, vec![claim("a", "uid-a")]).await;
    assert_eq!(r.claims["uid-a"].error, "");
    let reset = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
            .args(["checkpoint", "reset", "--plugins-dir"])
            .arg(dirs.plugins())
            .args(["--driver-name", DRIVER, "--cdi-root"])
            .arg(dirs.cdi_root())
            .args(extra)
            .env_clear()
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!text.contains("checkpoint reset"), "{text}");
        (out.status.success(), text)
    };
    let before = std::fs::read(dirs.checkpoint()).unwrap();
    for extra in [&[][..], &["--force"][..]] {
        let (ok, text) = reset(extra);
        assert!(!ok, "{text}");
        assert!(text.contains("is running on this node"), "{text}");
        assert_eq!(std::fs::read(dirs.checkpoint()).unwrap(), before);
    }
    assert!(plugin.terminate().success());

    let before = std::fs::read(dirs.checkpoint()).unwrap();
    let (ok, text) = reset(&[]);
    assert!(!ok, "{text}");
    assert!(text.contains("reads and verifies"), "{text}");
    assert!(text.contains("uid uid-a"), "{text}");
    assert_eq!(std::fs::read(dirs.checkpoint()).unwrap(), before);
    assert_eq!(dirs.cdi_files().len(), 1);

    let (ok, text) = reset(&["--force", "--remove-cdi-specs"]);
    assert!(ok, "{text}");
    assert!(
        text.contains("abandoned claim: default/a uid uid-a"),
        "{text}"
    );
    assert!(text.contains("removed CDI spec"), "{text}");
    assert!(!dirs.checkpoint().exists());
    assert!(dirs.cdi_files().is_empty(), "{:?}", dirs.cdi_files());
}

/// The value of counter `counter` of counter set `set` as published now.
fn published_counter(
    standin: &cleave_apiserver_standin::StandIn,
    set: &str,
    counter: &str,
) -> Option<String> {
    standin
        .list_as::<ResourceSlice>("resourceslices")
        .iter()
        .flat_map(|s| s.spec.shared_counters.iter().flatten())
        .find(|c| c.name == set)
        .and_then(|c| c.counters.get(counter))
        .map(|c| c.value.0.clone())
}

/// A GPU instance left without compute instance by a failed rollback while the plugin runs
/// (CI creation and GI destroy failing): its placement is published as taken within the
/// periodic check, and free again once the next prepare destroyed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bare_gpu_instance_is_published_as_taken_until_it_is_gone() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    let control = dirs.path().join("control");
    std::fs::write(&control, "").unwrap();
    put_claim(
        &standin,
        "m",
        "uid-m",
        &[("mig", "gpu-0-mig-3g40gb-4")],
        &[],
    );
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            mig: "on",
            dynamic_mig: true,
            env: vec![
                ("MOCK_NVML_CONTROL", control.display().to_string()),
                ("MPS_CHECK_INTERVAL_SECS", "1".to_owned()),
            ],
            ..PluginOptions::default()
        },
    );
    wait_for_slices(&standin).await;
    let slice4 = || published_counter(&standin, "gpu-0-counters", "memory-slice-4");
    let started = std::time::Instant::now();
    while slice4().as_deref() != Some("1") {
        assert!(started.elapsed() < TIMEOUT, "{:?}", slice4());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let mut dra = dra_v1(&plugin.dra_socket).await;
    std::fs::write(
        &control,
        "nvmlGpuInstanceCreateComputeInstance=999\nnvmlGpuInstanceDestroy=999\n",
    )
    .unwrap();
    let r = prepare(&mut dra, vec![claim("m", "uid-m")]).await;
    assert!(r.claims["uid-m"].error.contains("999"), "{:?}", r.claims);
    let started = std::time::Instant::now();
    while slice4().as_deref() != Some("0") {
        assert!(
            started.elapsed() < TIMEOUT,
            "the bare GPU instance's placement is still published as free: {:?}\n{}",
            slice4(),
            dirs.log()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // NVML works again: the kubelet's retry destroys the bare instance first and prepares.
    std::fs::write(&control, "").unwrap();
    let r = prepare(&mut dra, vec![claim("m", "uid-m")]).await;
    assert_eq!(r.claims["uid-m"].error, "");
    let u = unprepare(&mut dra, vec![claim("m", "uid-m")]).await;
    assert_eq!(u.claims["uid-m"].error, "");
    let started = std::time::Instant::now();
    while slice4().as_deref() != Some("1") {
        assert!(started.elapsed() < TIMEOUT, "{:?}", slice4());
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(plugin.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uninstall_removes_this_nodes_slices_and_exits() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let published = wait_for_slices(&standin).await.len();
    assert!(plugin.terminate().success());
    assert_eq!(
        standin.list_as::<ResourceSlice>("resourceslices").len(),
        published
    );

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .args(["run", "--uninstall"])
        .env("NODE_NAME", NODE)
        .env("KUBECONFIG", dirs.kubeconfig())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        standin
            .list_as::<ResourceSlice>("resourceslices")
            .is_empty()
    );
    // Nothing was served: no sockets created by the uninstall run.
    assert!(!dirs.registrar().join("gpu.cleave.dev-reg.sock").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_health_endpoints() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(&standin, "m", "uid-m", &[("gpu", "gpu-0")], &[]);
    let port = free_port();
    let plugin = Plugin::start(
        &dirs,
        &PluginOptions {
            metrics_port: Some(port),
            ..PluginOptions::default()
        },
    );
    // Ready needs the kubelet's confirmation of the registration (and a publish).
    let mut reg = registration(&plugin.registration_socket).await;
    reg.notify_registration_status(RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await
    .unwrap();
    let started = std::time::Instant::now();
    loop {
        match http_get(port, "/readyz") {
            Some((200, body)) => {
                assert!(body.contains("ready"), "{body}");
                break;
            }
            other => {
                assert!(
                    started.elapsed() < TIMEOUT,
                    "not ready: {other:?}\n{}",
                    dirs.log()
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    }
    assert_eq!(http_get(port, "/healthz").unwrap().0, 200);
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let r = prepare(
        &mut dra,
        vec![claim("m", "uid-m"), claim("missing", "uid-x")],
    )
    .await;
    assert_eq!(r.claims["uid-m"].error, "");
    let (status, metrics) = http_get(port, "/metrics").unwrap();
    assert_eq!(status, 200);
    for line in [
        r#"cleave_kubelet_plugin_claims_total{operation="prepare",result="ok"} 1"#,
        r#"cleave_kubelet_plugin_claims_total{operation="prepare",result="error"} 1"#,
        r#"cleave_kubelet_plugin_request_duration_seconds_count{operation="prepare"} 1"#,
    ] {
        assert!(metrics.contains(line), "missing {line} in\n{metrics}");
    }
    assert!(
        metrics.contains("cleave_kubelet_plugin_slices_published "),
        "{metrics}"
    );
    assert!(plugin.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_wiped_by_a_restarting_kubelet_come_back() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let before = wait_for_slices(&standin).await;
    // A kubelet that starts (or loses the plugin for 30 s) deletes the node's slices.
    for s in &before {
        standin
            .delete("resourceslices", "", s.metadata.name.as_deref().unwrap())
            .unwrap();
    }
    assert!(
        standin
            .list_as::<ResourceSlice>("resourceslices")
            .is_empty()
    );
    let after = wait_for_slices(&standin).await;
    let devices = |slices: &[ResourceSlice]| -> Vec<String> {
        let mut v: Vec<String> = slices
            .iter()
            .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
            .map(|d| d.name)
            .collect();
        v.sort();
        v
    };
    assert_eq!(devices(&after), devices(&before));
    assert!(plugin.terminate().success());
}
