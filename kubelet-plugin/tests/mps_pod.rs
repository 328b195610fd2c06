//! MPS daemons in pods of their own (`run --mps-launcher=pod`), end to end: the real plugin
//! binary, the API server stand-in, a fake kubelet that runs the daemon pods as local
//! processes (`tests/common/kubelet.rs`), and the fake `nvidia-cuda-mps-control` and
//! `nvidia-smi` (of `cleave-fakes`, played by this test binary itself: the shipped plugin
//! plays no fake tool, so the tool wrappers run `<this test> __fake <tool> <args>...`).
//!
//! Built with `harness = false`: `main` is the test kit's runner, which first plays a fake
//! tool when asked to, then runs the tests below one by one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;
use std::time::Duration;

use cleave_apiserver_standin::StandIn;
use cleave_kubelet_plugin::proto::dra::v1;
use cleave_testkit::runner::block_on;
use common::kubelet::{FakeKubelet, KubeletOptions, NAMESPACE, PodWorld, eventually};
use common::node::*;
use common::*;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::DeviceAllocationConfiguration;
use serde_json::json;

fn mps_config(pct: u8, limit: &str) -> DeviceAllocationConfiguration {
    serde_json::from_value(json!({
        "source": "FromClaim",
        "requests": ["gpu"],
        "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": pct,
                "pinnedMemoryLimit": {"default": limit}}}}}
    }))
    .unwrap()
}

/// The MPS claim `mps-<name>` (UID `uid-<name>`) on `device` with these limits.
fn put_mps_claim(standin: &StandIn, name: &str, device: &str, pct: u8, limit: &str) {
    put_claim(
        standin,
        &format!("mps-{name}"),
        &format!("uid-{name}"),
        &[("gpu", device)],
        &[mps_config(pct, limit)],
    );
}

type World = PodWorld;

impl PodWorld {
    fn plugin_options(&self) -> PluginOptions {
        self.pod_plugin_options(&[])
    }
    fn kubelet(&self, standin: &StandIn, options: KubeletOptions) -> FakeKubelet {
        self.start_kubelet(standin, options)
    }
    fn mps_dir(&self, uid: &str) -> PathBuf {
        self.dirs.state_dir().join("mps").join(uid)
    }
}

fn env_of(pod: &Pod, name: &str) -> Option<String> {
    pod.spec.as_ref()?.containers[0]
        .env
        .as_ref()?
        .iter()
        .find(|e| e.name == name)?
        .value
        .clone()
}

/// Every `containerEdits` of a CDI spec: the spec's own and each device's.
fn edits_of(spec: &serde_json::Value) -> impl Iterator<Item = &serde_json::Value> {
    std::iter::once(&spec["containerEdits"]).chain(
        spec["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| &d["containerEdits"]),
    )
}

fn mounts_of(spec: &serde_json::Value) -> Vec<(String, String)> {
    edits_of(spec)
        .flat_map(|e| e["mounts"].as_array().into_iter().flatten())
        .map(|m| {
            (
                m["containerPath"].as_str().unwrap_or_default().to_owned(),
                m["hostPath"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

fn all_env(spec: &serde_json::Value) -> Vec<String> {
    edits_of(spec)
        .flat_map(|e| e["env"].as_array().into_iter().flatten())
        .map(|v| v.as_str().unwrap_or_default().to_owned())
        .collect()
}

async fn claims_get_own_daemon_pods_which_outlive_plugin_restarts() {
    let world = World::new();
    let standin = start_standin(&world.dirs).await;
    let kubelet = world.kubelet(&standin, KubeletOptions::default());
    put_mps_claim(&standin, "a", "gpu-0", 25, "10Gi");
    put_mps_claim(&standin, "b", "gpu-1", 50, "20Gi");
    put_mps_claim(&standin, "c", "gpu-2", 75, "1Gi");
    put_mps_claim(&standin, "d", "gpu-3", 30, "2Gi");
    let plugin = Plugin::start(&world.dirs, &world.plugin_options());
    let mut dra = dra_v1(&plugin.dra_socket).await;

    let first = prepare(
        &mut dra,
        vec![
            claim("mps-a", "uid-a"),
            claim("mps-b", "uid-b"),
            claim("mps-c", "uid-c"),
            claim("mps-d", "uid-d"),
        ],
    )
    .await;
    for uid in ["uid-a", "uid-b", "uid-c", "uid-d"] {
        assert_eq!(first.claims[uid].error, "", "{uid}\n{}", world.logs());
    }

    // One pod per claim, bound to this node, owned by the Node (no POD_NAME given), each
    // limited to its claim's GPU.
    let pod_a = world.pod(&standin, "uid-a").expect("pod of claim a");
    let pod_b = world.pod(&standin, "uid-b").expect("pod of claim b");
    assert_eq!(
        pod_a.spec.as_ref().unwrap().node_name.as_deref(),
        Some(NODE)
    );
    // In the host PID namespace: an MPS server in a PID namespace of its own cannot start.
    for pod in [&pod_a, &pod_b] {
        assert_eq!(pod.spec.as_ref().unwrap().host_pid, Some(true));
    }
    let owner = &pod_a.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!((owner.kind.as_str(), owner.name.as_str()), ("Node", NODE));
    let dev_a = env_of(&pod_a, "CUDA_VISIBLE_DEVICES").unwrap();
    let dev_b = env_of(&pod_b, "CUDA_VISIBLE_DEVICES").unwrap();
    assert!(dev_a.starts_with("GPU-") && dev_b.starts_with("GPU-") && dev_a != dev_b);
    assert_eq!(kubelet.started.lock().unwrap().len(), 4);

    // The daemons got their own limits, told over their own pipes.
    let pipe_a = world.dirs.mps_pipe_dir("uid-a").display().to_string();
    let pipe_b = world.dirs.mps_pipe_dir("uid-b").display().to_string();
    let record = world.record();
    let has = |pipe: &str, what: &str| {
        record
            .iter()
            .any(|l| l.contains(&format!("pipe={pipe}")) && l.contains(what))
    };
    assert!(
        has(&pipe_a, &format!("devices={dev_a}")),
        "{}",
        world.logs()
    );
    assert!(
        has(&pipe_a, "set_default_active_thread_percentage 25"),
        "{}",
        world.logs()
    );
    assert!(
        has(&pipe_a, "set_default_device_pinned_mem_limit 0 10G"),
        "{}",
        world.logs()
    );
    // ... and read back (the control UI exits 0 even when it rejects a value).
    assert!(
        has(&pipe_a, "get_default_device_pinned_mem_limit 0"),
        "{}",
        world.logs()
    );
    assert!(
        has(&pipe_b, "set_default_active_thread_percentage 50"),
        "{}",
        world.logs()
    );
    assert!(
        has(&pipe_b, "set_default_device_pinned_mem_limit 0 20G"),
        "{}",
        world.logs()
    );

    // CDI: the claim's pipe directory, the daemon pod's memory emptyDir as /dev/shm, and
    // the client environment.
    let spec_a = world.cdi_spec("uid-a");
    let mounts = mounts_of(&spec_a);
    assert!(
        mounts.contains(&("/tmp/nvidia-mps".into(), pipe_a.clone())),
        "{mounts:?}"
    );
    let shm_a = world
        .kubelet_root()
        .join("pods")
        .join(pod_a.metadata.uid.as_deref().unwrap())
        .join("volumes/kubernetes.io~empty-dir/shm");
    assert!(shm_a.is_dir(), "the fake kubelet made the emptyDir");
    assert!(
        mounts.contains(&("/dev/shm".into(), shm_a.display().to_string())),
        "{mounts:?}"
    );
    let env = all_env(&spec_a);
    for want in [
        "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10G",
    ] {
        assert!(env.iter().any(|e| e == want), "{want} not in {env:?}");
    }

    // Repeating prepare changes nothing: same pods, no new start.
    let again = prepare(&mut dra, vec![claim("mps-a", "uid-a")]).await;
    assert_eq!(again.claims["uid-a"], first.claims["uid-a"]);
    assert_eq!(
        world.pod(&standin, "uid-a").unwrap().metadata.uid,
        pod_a.metadata.uid
    );
    assert_eq!(kubelet.started.lock().unwrap().len(), 4);

    // The pod ran the image's `mps-daemon`, which started the daemon.
    let started = kubelet.started.lock().unwrap().clone();
    let a = started
        .iter()
        .find(|s| s.name == world.pod_name("uid-a"))
        .unwrap();
    assert_eq!(a.argv[1], "mps-daemon");
    assert_eq!(
        a.env["CUDA_MPS_PIPE_DIRECTORY"], pipe_a,
        "pipe mount resolved"
    );
    assert!(
        world.logs().contains("MPS control daemon started"),
        "{}",
        world.logs()
    );

    // Unprepare: the daemon quits, its pod and directories go; the others stay.
    let un = unprepare(&mut dra, vec![claim("mps-a", "uid-a")]).await;
    assert_eq!(un.claims["uid-a"].error, "", "{}", world.logs());
    assert!(world.pod(&standin, "uid-a").is_none());
    assert!(!world.mps_dir("uid-a").exists());
    assert!(
        world
            .record()
            .iter()
            .any(|l| l.contains(&format!("pipe={pipe_a}")) && l.contains("quit"))
    );
    assert!(world.pod(&standin, "uid-b").is_some());

    // The plugin goes away: the daemons keep running for their clients.
    drop(dra);
    let status = plugin.terminate();
    assert!(status.success(), "{status}");
    let pod_b_uid = pod_b.metadata.uid.clone();
    assert_eq!(
        world.pod(&standin, "uid-b").unwrap().metadata.uid,
        pod_b_uid
    );
    let quits_before = world.record().iter().filter(|l| l.contains("quit")).count();

    // Claim c is deleted while the plugin is down; the restarted plugin stops its daemon
    // and keeps b's. d's daemon pod is deleted (say, evicted): the restarted plugin starts
    // it again and points d's CDI spec at the new pod's /dev/shm.
    standin.delete("resourceclaims", "default", "mps-c");
    let old_d = world.pod(&standin, "uid-d").unwrap().metadata.uid.unwrap();
    standin.delete("pods", NAMESPACE, &world.pod_name("uid-d"));
    let plugin = Plugin::start(&world.dirs, &world.plugin_options());
    eventually(
        "the daemon pod of the deleted claim is gone",
        &world,
        || world.pod(&standin, "uid-c").is_none(),
    )
    .await;
    assert!(!world.mps_dir("uid-c").exists(), "{}", world.logs());
    assert_eq!(
        world.pod(&standin, "uid-b").unwrap().metadata.uid,
        pod_b_uid,
        "the live claim's daemon pod was kept"
    );
    eventually("d's daemon pod is started again", &world, || {
        world
            .pod(&standin, "uid-d")
            .is_some_and(|p| p.metadata.uid.as_deref() != Some(old_d.as_str()))
    })
    .await;
    let new_d = world.pod(&standin, "uid-d").unwrap().metadata.uid.unwrap();
    let shm_d = |uid: &str| {
        world
            .kubelet_root()
            .join("pods")
            .join(uid)
            .join("volumes/kubernetes.io~empty-dir/shm")
            .display()
            .to_string()
    };
    eventually("d's CDI spec names the new /dev/shm", &world, || {
        mounts_of(&world.cdi_spec("uid-d")).contains(&("/dev/shm".into(), shm_d(&new_d)))
    })
    .await;
    assert!(!mounts_of(&world.cdi_spec("uid-d")).contains(&("/dev/shm".into(), shm_d(&old_d))));
    assert_eq!(
        kubelet.started.lock().unwrap().len(),
        5,
        "only d's daemon started again"
    );
    assert!(
        !world
            .record()
            .iter()
            .filter(|l| l.contains("quit"))
            .any(|l| l.contains(&pipe_b)),
        "b's daemon was not told to quit\n{}",
        world.logs()
    );
    assert!(world.record().iter().filter(|l| l.contains("quit")).count() > quits_before);

    // And b's daemon still answers through the new plugin: prepare again is a no-op.
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let b = prepare(&mut dra, vec![claim("mps-b", "uid-b")]).await;
    assert_eq!(b.claims["uid-b"].error, "", "{}", world.logs());
    assert_eq!(
        world.pod(&standin, "uid-b").unwrap().metadata.uid,
        pod_b_uid
    );

    let un = unprepare(
        &mut dra,
        vec![claim("mps-b", "uid-b"), claim("mps-d", "uid-d")],
    )
    .await;
    assert_eq!(un.claims["uid-b"].error, "", "{}", world.logs());
    assert_eq!(un.claims["uid-d"].error, "", "{}", world.logs());
    let pods: Vec<Pod> = standin.list_as("pods");
    assert!(
        pods.is_empty(),
        "pods left: {:?}",
        pods.iter().map(|p| &p.metadata.name).collect::<Vec<_>>()
    );
    let left: Vec<_> = std::fs::read_dir(world.dirs.state_dir().join("mps"))
        .map(|rd| rd.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "MPS directories left: {left:?}");
    // Every daemon that started also exited.
    let record = world.record();
    let starts = record.iter().filter(|l| l.starts_with("start")).count();
    let exits = record.iter().filter(|l| l.starts_with("exit")).count();
    eventually("every fake daemon exited", &world, || {
        let r = world.record();
        r.iter().filter(|l| l.starts_with("exit")).count() >= starts
    })
    .await;
    assert!(starts >= 5 && exits <= starts);
    drop(kubelet);
}

async fn daemon_pod_that_fails_or_never_runs_fails_the_claim_and_leaves_nothing() {
    let world = World::new();
    let standin = start_standin(&world.dirs).await;
    put_claim(
        &standin,
        "bad",
        "uid-bad",
        &[("gpu", "gpu-0")],
        &[mps_config(25, "10Gi")],
    );
    // A plugin pod that cannot be read is no reason not to start (the Node owns the
    // daemon pods then).
    let mut options = world.plugin_options();
    options.env.push(("POD_NAME", "no-such-pod".into()));
    let plugin = Plugin::start(&world.dirs, &options);
    assert!(
        world.dirs.log().contains("cannot read this plugin's pod"),
        "{}",
        world.logs()
    );
    let mut dra = dra_v1(&plugin.dra_socket).await;

    // The daemon cannot start: the container exits 1, the pod fails.
    {
        let _kubelet = world.kubelet(
            &standin,
            KubeletOptions {
                env: vec![("FAKE_MPS_FAIL_START".into(), "1".into())],
                ..Default::default()
            },
        );
        let r = prepare(&mut dra, vec![claim("bad", "uid-bad")]).await;
        let error = &r.claims["uid-bad"].error;
        assert!(
            error.contains(&world.pod_name("uid-bad")),
            "{error}\n{}",
            world.logs()
        );
        assert!(error.contains("failed"), "{error}");
        assert!(
            world.pod(&standin, "uid-bad").is_none(),
            "failed pod removed"
        );
        assert!(!world.mps_dir("uid-bad").exists());
        assert!(
            world.dirs.cdi_files().is_empty(),
            "{:?}",
            world.dirs.cdi_files()
        );
    }

    // The image cannot be pulled: the pod never runs; the claim fails with that reason
    // once the start deadline passes.
    {
        let _kubelet = world.kubelet(
            &standin,
            KubeletOptions {
                image_pull_error: Some("ImagePullBackOff".into()),
                ..Default::default()
            },
        );
        let r = prepare(&mut dra, vec![claim("bad", "uid-bad")]).await;
        let error = &r.claims["uid-bad"].error;
        assert!(
            error.contains("ImagePullBackOff"),
            "{error}\n{}",
            world.logs()
        );
        assert!(world.pod(&standin, "uid-bad").is_none());
        assert!(!world.mps_dir("uid-bad").exists());
        assert!(world.dirs.cdi_files().is_empty());
    }
    drop(dra);
    assert!(plugin.terminate().success());
}

async fn daemon_pods_belong_to_the_plugins_daemonset_and_use_its_pull_secrets() {
    let world = World::new();
    let standin = start_standin(&world.dirs).await;
    // The plugin's own pod, as the DaemonSet controller creates it.
    let me: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "cleave-kubelet-plugin-x7k2p", "namespace": NAMESPACE,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                "name": "cleave-kubelet-plugin", "uid": "ds-uid-1", "controller": true,
                "blockOwnerDeletion": true}]},
        "spec": {"nodeName": "elsewhere", "imagePullSecrets": [{"name": "regcred"}],
            "containers": [{"name": "plugin", "image": "cleave:test"}]}
    }))
    .unwrap();
    standin.put(&me).unwrap();
    // Daemon pods no claim directory names (the state directory was reset): the one on
    // this node is deleted at start, the one on another node is not this plugin's.
    // The pod of another node carries this node's name for its key and this node's labels:
    // still never this plugin's to delete.
    for (key, node) in [("uid-orphan", NODE), ("uid-other", "node-b")] {
        let orphan: Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": world.pod_name(key), "namespace": NAMESPACE, "labels": {
                "app.kubernetes.io/name": "cleave-mps",
                "gpu.cleave.dev/node": NODE,
                "gpu.cleave.dev/claim-uid": key}},
            "spec": {"nodeName": node, "containers": [{"name": "mps-control-daemon",
                "image": "cleave:test", "command": ["sleep", "30"]}]}
        }))
        .unwrap();
        standin.put(&orphan).unwrap();
    }
    let _kubelet = world.kubelet(&standin, KubeletOptions::default());
    put_mps_claim(&standin, "a", "gpu-0", 25, "10Gi");
    let mut options = world.plugin_options();
    options
        .env
        .push(("POD_NAME", "cleave-kubelet-plugin-x7k2p".into()));
    options.env.push(("MPS_CHECK_INTERVAL_SECS", "1".into()));
    let plugin = Plugin::start(&world.dirs, &options);
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let r = prepare(&mut dra, vec![claim("mps-a", "uid-a")]).await;
    assert_eq!(r.claims["uid-a"].error, "", "{}", world.logs());
    assert!(
        world.pod(&standin, "uid-orphan").is_none(),
        "{}",
        world.logs()
    );
    assert!(world.pod(&standin, "uid-other").is_some());

    let pod = world.pod(&standin, "uid-a").unwrap();
    let owners = pod.metadata.owner_references.clone().unwrap();
    assert_eq!(owners.len(), 1);
    assert_eq!(
        (
            owners[0].kind.as_str(),
            owners[0].name.as_str(),
            owners[0].uid.as_str()
        ),
        ("DaemonSet", "cleave-kubelet-plugin", "ds-uid-1")
    );
    // Not the controller: the DaemonSet must not adopt (and then release) the pod.
    assert_eq!(owners[0].controller, None);
    let secrets = pod.spec.unwrap().image_pull_secrets.unwrap();
    assert_eq!(secrets[0].name, "regcred");

    // The daemon pod is evicted while the plugin runs: the periodic check starts it again
    // and points the claim's CDI spec at the new pod's /dev/shm.
    let old_uid = pod.metadata.uid.clone().unwrap();
    standin.delete("pods", NAMESPACE, &world.pod_name("uid-a"));
    eventually("the evicted daemon pod is started again", &world, || {
        world
            .pod(&standin, "uid-a")
            .is_some_and(|p| p.metadata.uid.as_deref() != Some(old_uid.as_str()))
    })
    .await;
    let new_uid = world.pod(&standin, "uid-a").unwrap().metadata.uid.unwrap();
    let shm = world
        .kubelet_root()
        .join("pods")
        .join(&new_uid)
        .join("volumes/kubernetes.io~empty-dir/shm")
        .display()
        .to_string();
    eventually("the CDI spec names the new /dev/shm", &world, || {
        mounts_of(&world.cdi_spec("uid-a")).contains(&("/dev/shm".into(), shm.clone()))
    })
    .await;
    // The new daemon got the claim's limits again.
    let pipe = world.dirs.mps_pipe_dir("uid-a").display().to_string();
    let limits = world
        .record()
        .iter()
        .filter(|l| {
            l.contains(&format!("pipe={pipe}"))
                && l.contains("set_default_active_thread_percentage 25")
        })
        .count();
    assert_eq!(limits, 2, "{}", world.logs());
    // And says so on the claim: its running clients lost their server.
    eventually("a MPSDaemonRestarted Event on the claim", &world, || {
        standin.list("events.events.k8s.io").iter().any(|e| {
            e["reason"] == "MPSDaemonRestarted"
                && e["regarding"]["name"] == "mps-a"
                && e["regarding"]["kind"] == "ResourceClaim"
        })
    })
    .await;

    let un = unprepare(&mut dra, vec![claim("mps-a", "uid-a")]).await;
    assert_eq!(un.claims["uid-a"].error, "", "{}", world.logs());
    assert!(world.pod(&standin, "uid-a").is_none());
    drop(dra);
    assert!(plugin.terminate().success());
}

async fn plugin_killed_while_starting_a_daemon_pod_leaves_nothing_after_restart() {
    for point in [
        "mps.after_launch",
        "mps.after_ready",
        "prepare.after_sharing_apply",
    ] {
        let world = World::new();
        let standin = start_standin(&world.dirs).await;
        let kubelet = world.kubelet(&standin, KubeletOptions::default());
        put_mps_claim(&standin, "a", "gpu-0", 25, "10Gi");
        let mut options = world.plugin_options();
        options.env.push(("CLEAVE_FAULT_KILL_AT", point.into()));
        let mut plugin = Plugin::start(&world.dirs, &options);
        let mut dra = dra_v1(&plugin.dra_socket).await;
        // The plugin dies in the middle of the call.
        let call = tokio::time::timeout(
            Duration::from_secs(60),
            dra.node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: vec![claim("mps-a", "uid-a")],
            }),
        )
        .await
        .unwrap();
        assert!(call.is_err(), "{point}: prepare answered {call:?}");
        let status = plugin.child.wait().unwrap();
        assert!(!status.success(), "{point}: {status}");
        assert!(
            world.pod(&standin, "uid-a").is_some(),
            "{point}: the pod was created"
        );
        drop(dra);

        // The restarted plugin rolls the interrupted prepare back: no daemon pod, no MPS
        // directory, no CDI spec; the kubelet's retry then succeeds.
        let plugin = Plugin::start(&world.dirs, &world.plugin_options());
        eventually(
            "the interrupted claim's daemon pod and directory are gone",
            &world,
            || world.pod(&standin, "uid-a").is_none() && !world.mps_dir("uid-a").exists(),
        )
        .await;
        assert!(world.dirs.cdi_files().is_empty(), "{point}");
        let mut dra = dra_v1(&plugin.dra_socket).await;
        let r = prepare(&mut dra, vec![claim("mps-a", "uid-a")]).await;
        assert_eq!(r.claims["uid-a"].error, "", "{point}\n{}", world.logs());
        assert!(world.pod(&standin, "uid-a").is_some());
        let un = unprepare(&mut dra, vec![claim("mps-a", "uid-a")]).await;
        assert_eq!(un.claims["uid-a"].error, "", "{point}");
        assert!(standin.list_as::<Pod>("pods").is_empty(), "{point}");
        drop(dra);
        assert!(plugin.terminate().success());
        drop(kubelet);
    }
}

/// This plugin's requests on pods from `from` on, as `(path, verb, query)`: those in the
/// release namespace and its node pod watch at `/api/v1/pods`. The fake kubelet's are left
/// out: its LISTs there carry the daemon label selector, and it writes only `.../status`.
fn plugin_pod_requests(standin: &StandIn, from: usize) -> Vec<(String, String)> {
    plugin_pod_requests_at(standin, from)
        .into_iter()
        .map(|(_, v, q)| (v, q))
        .collect()
}

fn plugin_pod_requests_at(standin: &StandIn, from: usize) -> Vec<(String, String, String)> {
    let prefix = format!("/api/v1/namespaces/{NAMESPACE}/pods");
    standin.requests()[from..]
        .iter()
        .filter(|r| {
            (r.path.starts_with(&prefix) && !r.path.ends_with("/status"))
                || (r.path == "/api/v1/pods"
                    && !r.query.contains(&format!(
                        "labelSelector={}",
                        urlencoding(common::kubelet::KUBELET_LABEL_SELECTOR)
                    )))
        })
        .map(|r| (r.path.clone(), r.verb.clone(), r.query.clone()))
        .collect()
}

/// `s` as a query value (the characters a label selector has).
fn urlencoding(s: &str) -> String {
    s.replace('/', "%2F").replace('=', "%3D")
}

fn count(requests: &[(String, String)], verb: &str) -> usize {
    requests.iter().filter(|(v, _)| v == verb).count()
}

/// Daemon pod state comes from one node-selected watch: a prepare costs one create and no
/// GET loop, the periodic check reads nothing from the API server, a daemon pod deleted
/// behind the plugin's back is noticed and started again, and unprepare costs one delete.
async fn daemon_pods_are_learned_from_one_watch_not_lists_or_polls(sampling_off: bool) {
    let world = World::new();
    let standin = start_standin(&world.dirs).await;
    let kubelet = world.kubelet(&standin, KubeletOptions::default());
    put_mps_claim(&standin, "a", "gpu-0", 25, "10Gi");
    let mut env = vec![("MPS_CHECK_INTERVAL_SECS", "1".into())];
    if sampling_off {
        env.push(("USAGE_INTERVAL", "0".into()));
    }
    let options = world.pod_plugin_options(&env);
    let plugin = Plugin::start(&world.dirs, &options);
    let mut dra = dra_v1(&plugin.dra_socket).await;

    let mark = standin.requests().len();
    let r = prepare(&mut dra, vec![claim("mps-a", "uid-a")]).await;
    assert_eq!(r.claims["uid-a"].error, "", "{}", world.logs());
    let pod = world.pod(&standin, "uid-a").expect("daemon pod");
    let at_prepare = plugin_pod_requests(&standin, mark);
    assert_eq!(count(&at_prepare, "create"), 1, "{at_prepare:?}");
    assert!(count(&at_prepare, "get") <= 1, "a GET loop: {at_prepare:?}");
    assert_eq!(count(&at_prepare, "list"), 0, "{at_prepare:?}");

    // One watch, with this node's own server-side timeout: with usage sampling on (the
    // default), the node pod watch of usage sampling (every namespace, selected by node),
    // which feeds the daemon pods too; with it off, the launcher's own (the release
    // namespace, selected by node and label).
    let at = plugin_pod_requests_at(&standin, 0);
    let all = plugin_pod_requests(&standin, 0);
    let watches: Vec<(&String, &String)> = at
        .iter()
        .filter(|(_, v, _)| v == "watch")
        .map(|(p, _, q)| (p, q))
        .collect();
    assert!(!watches.is_empty(), "no pod watch: {all:?}");
    let timeout = format!(
        "timeoutSeconds={}",
        cleave_controller::publisher::watch_timeout_secs(NODE)
    );
    let node_watch = !sampling_off;
    for (path, q) in &watches {
        assert!(q.contains(&timeout), "{q} lacks {timeout}");
        assert!(q.contains("fieldSelector=spec.nodeName%3D"), "{q}");
        if node_watch {
            assert_eq!(path.as_str(), "/api/v1/pods", "{q}");
            assert!(!q.contains("labelSelector"), "{q}");
        } else {
            assert_eq!(
                path.as_str(),
                format!("/api/v1/namespaces/{NAMESPACE}/pods"),
                "{q}"
            );
            assert!(
                q.contains("labelSelector=app.kubernetes.io%2Fname%3Dcleave-mps"),
                "{q}"
            );
        }
    }
    // At most the watch's own initial list, ever.
    assert!(count(&all, "list") <= 1, "{all:?}");

    // Left alone for several check intervals (each asks the daemon whether it answers):
    // nothing but the watch reaches the API server.
    let pipe_a = world.dirs.mps_pipe_dir("uid-a").display().to_string();
    let checks = || {
        world
            .record()
            .iter()
            .filter(|l| {
                l.contains(&format!("pipe={pipe_a}"))
                    && l.contains("get_default_active_thread_percentage")
            })
            .count()
    };
    let mark = standin.requests().len();
    let before = checks();
    eventually("three periodic checks ran", &world, || {
        checks() >= before + 3
    })
    .await;
    let steady = plugin_pod_requests(&standin, mark);
    assert!(
        steady.iter().all(|(v, _)| v == "watch"),
        "steady state: {steady:?}"
    );

    // Deleted behind the plugin's back: the watch tells, the check starts it again.
    let old = pod.metadata.uid.clone().unwrap();
    standin.delete("pods", NAMESPACE, &world.pod_name("uid-a"));
    eventually("the daemon pod is started again", &world, || {
        world
            .pod(&standin, "uid-a")
            .is_some_and(|p| p.metadata.uid.as_deref() != Some(old.as_str()))
    })
    .await;
    eventually("the claim's CDI spec names the new pod", &world, || {
        let new = world.pod(&standin, "uid-a").and_then(|p| p.metadata.uid);
        new.is_some_and(|uid| {
            mounts_of(&world.cdi_spec("uid-a"))
                .iter()
                .any(|(c, h)| c == "/dev/shm" && h.contains(&uid))
        })
    })
    .await;
    let restarted = plugin_pod_requests(&standin, mark);
    assert_eq!(count(&restarted, "create"), 1, "{restarted:?}");
    assert_eq!(count(&restarted, "list"), 0, "{restarted:?}");
    assert!(count(&restarted, "get") <= 1, "{restarted:?}");

    // Unprepare: one delete, no reads.
    let mark = standin.requests().len();
    let un = unprepare(&mut dra, vec![claim("mps-a", "uid-a")]).await;
    assert_eq!(un.claims["uid-a"].error, "", "{}", world.logs());
    assert!(world.pod(&standin, "uid-a").is_none());
    let at_unprepare = plugin_pod_requests(&standin, mark);
    assert_eq!(count(&at_unprepare, "delete"), 1, "{at_unprepare:?}");
    assert_eq!(count(&at_unprepare, "get"), 0, "{at_unprepare:?}");
    assert_eq!(count(&at_unprepare, "list"), 0, "{at_unprepare:?}");
    drop(dra);
    assert!(plugin.terminate().success());
    drop(kubelet);
}

const TESTS: [cleave_testkit::runner::Test; 6] = [
    (
        "claims_get_own_daemon_pods_which_outlive_plugin_restarts",
        || block_on(claims_get_own_daemon_pods_which_outlive_plugin_restarts()),
    ),
    (
        "daemon_pod_that_fails_or_never_runs_fails_the_claim_and_leaves_nothing",
        || block_on(daemon_pod_that_fails_or_never_runs_fails_the_claim_and_leaves_nothing()),
    ),
    (
        "daemon_pods_belong_to_the_plugins_daemonset_and_use_its_pull_secrets",
        || block_on(daemon_pods_belong_to_the_plugins_daemonset_and_use_its_pull_secrets()),
    ),
    (
        "plugin_killed_while_starting_a_daemon_pod_leaves_nothing_after_restart",
        || block_on(plugin_killed_while_starting_a_daemon_pod_leaves_nothing_after_restart()),
    ),
    (
        "daemon_pods_are_learned_from_the_node_pod_watch_not_lists_or_polls",
        || {
            block_on(daemon_pods_are_learned_from_one_watch_not_lists_or_polls(
                false,
            ))
        },
    ),
    (
        "daemon_pods_are_learned_from_one_watch_of_their_own_without_sampling",
        || {
            block_on(daemon_pods_are_learned_from_one_watch_not_lists_or_polls(
                true,
            ))
        },
    ),
];

fn main() -> std::process::ExitCode {
    cleave_testkit::runner::main(&TESTS)
}
