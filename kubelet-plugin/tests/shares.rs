//! Shares of one GPU (`--consumable-capacity mps`), end to end: the real plugin binary over
//! the mock NVML library and the API server stand-in, MPS daemons in pods run by a fake
//! kubelet (`tests/common/kubelet.rs`), and the fake `nvidia-cuda-mps-control` and
//! `nvidia-smi` (of `cleave-fakes`, played by this test binary itself, as in
//! `tests/mps_pod.rs`).
//!
//! Three claims hold shares of `gpu-0` (20Gi and 44 of the H100's 132 SMs each, as the
//! scheduler allocates them: `shareID` and `consumedCapacity` in the allocation result):
//! three CDI devices, one multi-user MPS daemon, each share's spec with
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=33` and a 20Gi pinned memory limit; the daemon lives
//! until the last share is unprepared; an exclusive claim on another GPU works as before.
//!
//! Built with `harness = false`: `main` is the test kit's runner, which first plays a fake
//! tool when asked to, then runs the tests below one by one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use cleave_apiserver_standin::{StandIn, fixtures};
use cleave_testkit::runner::block_on;
use common::kubelet::{FakeKubelet, KubeletOptions, PodWorld, eventually};
use common::node::*;
use common::*;
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

/// The shared daemon of `device` for the claims of namespace `default` (its directory and
/// pod are named after it).
fn shared(device: &str) -> String {
    cleave_driver::prepare::shared_daemon_key(device, "default")
}
const SHARES: [(&str, &str); 3] = [
    ("uid-share-a", "5a000000-0000-4000-8000-00000000000a"),
    ("uid-share-b", "5b000000-0000-4000-8000-00000000000b"),
    ("uid-share-c", "5c000000-0000-4000-8000-00000000000c"),
];

/// Stores claim `name` (UID `uid`) allocated `device`, as a share when `share` is given.
fn put_share_claim(standin: &StandIn, name: &str, uid: &str, device: &str, share: Option<&str>) {
    put_share_claim_in(standin, "default", name, uid, device, share);
}

/// [`put_share_claim`] in `namespace`.
fn put_share_claim_in(
    standin: &StandIn,
    namespace: &str,
    name: &str,
    uid: &str,
    device: &str,
    share: Option<&str>,
) {
    let mut claim =
        fixtures::resource_claim(namespace, name, uid, DRIVER, NODE, &[("gpu", device)], &[]);
    if let Some(share) = share {
        let results = claim
            .status
            .as_mut()
            .and_then(|s| s.allocation.as_mut())
            .and_then(|a| a.devices.as_mut())
            .and_then(|d| d.results.as_mut())
            .unwrap();
        for r in results {
            r.share_id = Some(share.to_owned());
            r.consumed_capacity = Some(
                serde_json::from_value(json!({"memory": "20Gi", "multiprocessors": "44"})).unwrap(),
            );
        }
    }
    standin.put(&claim).unwrap();
}

type World = PodWorld;

impl PodWorld {
    fn plugin_options(&self) -> PluginOptions {
        self.pod_plugin_options(&[("CONSUMABLE_CAPACITY", "mps".into())])
    }
    fn kubelet(&self, standin: &StandIn) -> FakeKubelet {
        self.start_kubelet(standin, KubeletOptions::default())
    }
}

/// One CDI device: name, env, mounts as (container path, host path).
type CdiDeviceView = (String, Vec<String>, Vec<(String, String)>);

/// Every CDI device of a spec.
fn devices_of(spec: &serde_json::Value) -> Vec<CdiDeviceView> {
    spec["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            let e = &d["containerEdits"];
            let env = e["env"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect();
            let mounts = e["mounts"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|m| {
                    (
                        m["containerPath"].as_str().unwrap_or_default().to_owned(),
                        m["hostPath"].as_str().unwrap_or_default().to_owned(),
                    )
                })
                .collect();
            (
                d["name"].as_str().unwrap_or_default().to_owned(),
                env,
                mounts,
            )
        })
        .collect()
}

async fn three_shares_of_one_gpu_use_one_daemon_until_the_last_is_unprepared() {
    let world = World::new();
    let standin = start_standin(&world.dirs).await;
    let kubelet = world.kubelet(&standin);
    for (i, (uid, share)) in SHARES.iter().enumerate() {
        put_share_claim(&standin, &format!("share-{i}"), uid, "gpu-0", Some(share));
    }
    put_share_claim(&standin, "whole", "uid-whole", "gpu-1", None);
    let plugin = Plugin::start(&world.dirs, &world.plugin_options());
    let mut dra = dra_v1(&plugin.dra_socket).await;

    let claims: Vec<_> = (0..3)
        .map(|i| claim(&format!("share-{i}"), SHARES[i].0))
        .chain([claim("whole", "uid-whole")])
        .collect();
    let answer = prepare(&mut dra, claims).await;
    for (uid, share) in SHARES {
        let c = &answer.claims[uid];
        assert_eq!(c.error, "", "{uid}\n{}", world.logs());
        // One CDI device per share, named with the claim and the share.
        assert_eq!(c.devices.len(), 1);
        assert_eq!(c.devices[0].device_name, "gpu-0");
        assert_eq!(
            c.devices[0].cdi_device_ids,
            [format!(
                "k8s.gpu.cleave.dev/claim={uid}-gpu-0-share-{share}"
            )]
        );
        assert_eq!(c.devices[0].share_id.as_deref(), Some(share));
    }
    assert_eq!(answer.claims["uid-whole"].error, "", "{}", world.logs());

    // One MPS daemon (one pod) for the three shares, multi-user, limited to gpu-0.
    let pod = world
        .pod(&standin, &shared("gpu-0"))
        .expect("the shared daemon's pod");
    assert_eq!(kubelet.started.lock().unwrap().len(), 1, "{}", world.logs());
    let record = world.record();
    let starts: Vec<&String> = record.iter().filter(|l| l.starts_with("start")).collect();
    assert_eq!(starts.len(), 1, "{}", world.logs());
    assert!(starts[0].contains("multiUser=1"), "{}", world.logs());
    let pipe = world
        .dirs
        .mps_pipe_dir(&shared("gpu-0"))
        .display()
        .to_string();
    assert!(
        record.iter().any(|l| l.contains(&format!("pipe={pipe}"))
            && l.contains("set_default_active_thread_percentage 100")),
        "daemon defaults are unlimited\n{}",
        world.logs()
    );
    let shm = world
        .kubelet_root()
        .join("pods")
        .join(pod.metadata.uid.as_deref().unwrap())
        .join("volumes/kubernetes.io~empty-dir/shm")
        .display()
        .to_string();

    // Each share's spec: its own limits, the shared pipe and /dev/shm.
    for (uid, share) in SHARES {
        let devices = devices_of(&world.cdi_spec(uid));
        assert_eq!(devices.len(), 1, "{devices:?}");
        let (name, env, mounts) = &devices[0];
        assert_eq!(name, &format!("{uid}-gpu-0-share-{share}"));
        for want in [
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=33",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M",
            "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        ] {
            assert!(
                env.iter().any(|e| e == want),
                "{uid}: {want} not in {env:?}"
            );
        }
        assert!(
            mounts.contains(&("/tmp/nvidia-mps".into(), pipe.clone())),
            "{mounts:?}"
        );
        assert!(
            mounts.contains(&("/dev/shm".into(), shm.clone())),
            "{mounts:?}"
        );
    }
    // The exclusive claim on another GPU: as before, no MPS.
    let whole = devices_of(&world.cdi_spec("uid-whole"));
    assert_eq!(whole[0].0, "uid-whole-gpu-1");
    assert!(!whole[0].1.iter().any(|e| e.starts_with("CUDA_MPS")));

    // Unprepare two shares: the daemon stays for the third.
    for (i, (uid, _)) in SHARES.iter().enumerate().take(2) {
        let un = unprepare(&mut dra, vec![claim(&format!("share-{i}"), uid)]).await;
        assert_eq!(un.claims[*uid].error, "", "{}", world.logs());
        assert_eq!(
            world
                .pod(&standin, &shared("gpu-0"))
                .and_then(|p| p.metadata.uid),
            pod.metadata.uid,
            "the shared daemon's pod was kept after share {i}"
        );
    }
    assert!(
        !world.record().iter().any(|l| l.contains("quit")),
        "{}",
        world.logs()
    );

    // The last share stops it.
    let un = unprepare(&mut dra, vec![claim("share-2", SHARES[2].0)]).await;
    assert_eq!(un.claims[SHARES[2].0].error, "", "{}", world.logs());
    assert!(
        world.pod(&standin, &shared("gpu-0")).is_none(),
        "{}",
        world.logs()
    );
    assert!(
        !world
            .dirs
            .state_dir()
            .join("mps")
            .join(shared("gpu-0"))
            .exists()
    );
    eventually("the shared daemon exited", &world, || {
        world.record().iter().any(|l| l.starts_with("exit"))
    })
    .await;
    let un = unprepare(&mut dra, vec![claim("whole", "uid-whole")]).await;
    assert_eq!(un.claims["uid-whole"].error, "", "{}", world.logs());
    drop(dra);
    assert!(plugin.terminate().success());
    drop(kubelet);
}

/// Shares of namespaces `team-a` (two) and `team-b` (one) on `gpu-0`: a daemon pod per
/// namespace, each namespace's specs with its own pipe directory and `/dev/shm` (the
/// daemon pod's emptyDir), the privileged socket masked in every spec; unprepare of
/// `team-a`'s last share removes only its daemon's pod.
async fn shares_of_two_namespaces_on_one_gpu_get_own_daemons_pipes_and_shm() {
    let world = World::new();
    let standin = start_standin(&world.dirs).await;
    let kubelet = world.kubelet(&standin);
    let claims = [
        ("team-a", "share-a1", SHARES[0]),
        ("team-a", "share-a2", SHARES[1]),
        ("team-b", "share-b1", SHARES[2]),
    ];
    for (ns, name, (uid, share)) in claims {
        put_share_claim_in(&standin, ns, name, uid, "gpu-0", Some(share));
    }
    let plugin = Plugin::start(&world.dirs, &world.plugin_options());
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let dra_claim = |ns: &str, name: &str, uid: &str| {
        let mut c = claim(name, uid);
        c.namespace = ns.to_owned();
        c
    };
    let answer = prepare(
        &mut dra,
        claims
            .iter()
            .map(|(ns, name, (uid, _))| dra_claim(ns, name, uid))
            .collect(),
    )
    .await;
    for (_, _, (uid, _)) in claims {
        assert_eq!(answer.claims[uid].error, "", "{uid}\n{}", world.logs());
    }
    let key_a = cleave_driver::prepare::shared_daemon_key("gpu-0", "team-a");
    let key_b = cleave_driver::prepare::shared_daemon_key("gpu-0", "team-b");
    let pod_a = world.pod(&standin, &key_a).expect("team-a's daemon pod");
    let pod_b = world.pod(&standin, &key_b).expect("team-b's daemon pod");
    assert_eq!(kubelet.started.lock().unwrap().len(), 2, "{}", world.logs());
    let shm_of = |pod: &Pod| {
        world
            .kubelet_root()
            .join("pods")
            .join(pod.metadata.uid.as_deref().unwrap())
            .join("volumes/kubernetes.io~empty-dir/shm")
            .display()
            .to_string()
    };
    let views: Vec<(String, String)> = claims
        .iter()
        .map(|(_, _, (uid, _))| {
            let devices = devices_of(&world.cdi_spec(uid));
            let mounts = &devices[0].2;
            let at = |path: &str| {
                mounts
                    .iter()
                    .find(|(c, _)| c == path)
                    .map(|(_, h)| h.clone())
                    .unwrap_or_else(|| panic!("{uid}: nothing at {path}: {mounts:?}"))
            };
            assert_eq!(at("/tmp/nvidia-mps/control_privileged"), "/dev/null");
            assert!(
                !mounts
                    .iter()
                    .any(|(_, h)| h.ends_with("control_privileged")),
                "{uid}: {mounts:?}"
            );
            (at("/tmp/nvidia-mps"), at("/dev/shm"))
        })
        .collect();
    let pipe = |key: &str| world.dirs.mps_pipe_dir(key).display().to_string();
    assert_eq!(views[0], (pipe(&key_a), shm_of(&pod_a)));
    assert_eq!(views[1], views[0]);
    assert_eq!(views[2], (pipe(&key_b), shm_of(&pod_b)));
    assert_ne!(views[0].0, views[2].0);
    assert_ne!(views[0].1, views[2].1);

    // team-a's last share goes: its pod only.
    for (ns, name, (uid, _)) in &claims[..2] {
        let un = unprepare(&mut dra, vec![dra_claim(ns, name, uid)]).await;
        assert_eq!(un.claims[*uid].error, "", "{}", world.logs());
    }
    assert!(world.pod(&standin, &key_a).is_none(), "{}", world.logs());
    assert_eq!(
        world.pod(&standin, &key_b).and_then(|p| p.metadata.uid),
        pod_b.metadata.uid,
        "team-b's daemon pod was not kept"
    );
    let (ns, name, (uid, _)) = claims[2];
    let un = unprepare(&mut dra, vec![dra_claim(ns, name, uid)]).await;
    assert_eq!(un.claims[uid].error, "", "{}", world.logs());
    assert!(world.pod(&standin, &key_b).is_none(), "{}", world.logs());
    drop(dra);
    assert!(plugin.terminate().success());
    drop(kubelet);
}

async fn whole_claim_on_a_shared_gpu_is_refused_clearly() {
    let world = World::new();
    let standin = start_standin(&world.dirs).await;
    let kubelet = world.kubelet(&standin);
    put_share_claim(&standin, "share", SHARES[0].0, "gpu-0", Some(SHARES[0].1));
    put_share_claim(&standin, "whole", "uid-whole", "gpu-0", None);
    let port = free_port();
    let plugin = Plugin::start(
        &world.dirs,
        &PluginOptions {
            metrics_port: Some(port),
            ..world.plugin_options()
        },
    );
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let a = prepare(&mut dra, vec![claim("share", SHARES[0].0)]).await;
    assert_eq!(a.claims[SHARES[0].0].error, "", "{}", world.logs());
    let b = prepare(&mut dra, vec![claim("whole", "uid-whole")]).await;
    let err = &b.claims["uid-whole"].error;
    assert!(
        err.contains("gpu-0") && err.contains("over-commit: allocated whole"),
        "{err}"
    );
    // The refusal reaches the claim as an Event naming the figures and the likely cause.
    let event = wait_event(&standin, "PrepareFailed").await;
    let note = event["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("over-commit") && note.contains("1.36.2"),
        "{event}"
    );
    // Counted under the refusal's type, not read back from its message.
    let (_, metrics) = http_get(port, "/metrics").expect("metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l == r#"cleave_kubelet_plugin_prepare_refusals_total{reason="over_commit"} 1"#),
        "{metrics}"
    );
    let un = unprepare(&mut dra, vec![claim("share", SHARES[0].0)]).await;
    assert_eq!(un.claims[SHARES[0].0].error, "", "{}", world.logs());
    assert!(world.pod(&standin, &shared("gpu-0")).is_none());
    drop(dra);
    assert!(plugin.terminate().success());
    drop(kubelet);
}

async fn process_launcher_serves_shares_with_one_daemon_too() {
    let world = World::new();
    let standin = start_standin(&world.dirs).await;
    for (i, (uid, share)) in SHARES.iter().enumerate() {
        put_share_claim(&standin, &format!("share-{i}"), uid, "gpu-0", Some(share));
    }
    let mut options = world.plugin_options();
    options
        .env
        .retain(|(k, _)| !matches!(*k, "MPS_LAUNCHER" | "MPS_DAEMON_IMAGE"));
    options.env.push(("MPS_LAUNCHER", "process".into()));
    let plugin = Plugin::start(&world.dirs, &options);
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let claims: Vec<_> = SHARES
        .iter()
        .enumerate()
        .map(|(i, (uid, _))| claim(&format!("share-{i}"), uid))
        .collect();
    let answer = prepare(&mut dra, claims.clone()).await;
    for (uid, _) in SHARES {
        assert_eq!(answer.claims[uid].error, "", "{uid}\n{}", world.logs());
        let devices = devices_of(&world.cdi_spec(uid));
        assert!(
            devices[0]
                .1
                .iter()
                .any(|e| e == "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=33"),
            "{devices:?}"
        );
    }
    let starts = |w: &World| w.record().iter().filter(|l| l.starts_with("start")).count();
    assert_eq!(starts(&world), 1, "{}", world.logs());
    assert!(standin.list_as::<Pod>("pods").is_empty());
    let un = unprepare(&mut dra, claims[..2].to_vec()).await;
    assert!(
        un.claims.values().all(|c| c.error.is_empty()),
        "{}",
        world.logs()
    );
    assert!(!world.record().iter().any(|l| l.starts_with("exit")));
    let un = unprepare(&mut dra, claims[2..].to_vec()).await;
    assert!(
        un.claims.values().all(|c| c.error.is_empty()),
        "{}",
        world.logs()
    );
    eventually("the shared daemon exited", &world, || {
        world.record().iter().any(|l| l.starts_with("exit"))
    })
    .await;
    assert!(
        !world
            .dirs
            .state_dir()
            .join("mps")
            .join(shared("gpu-0"))
            .exists()
    );
    drop(dra);
    assert!(plugin.terminate().success());
}

/// One allocation result: `(request, device, shareID, memory, SMs, admin access)`.
type Allocation<'a> = (&'a str, &'a str, Option<&'a str>, &'a str, &'a str, bool);

/// Stores claim `name` with `results` as the allocator writes them on an `mps` node, with
/// `configs` (allocation config).
fn put_allocated(
    standin: &StandIn,
    name: &str,
    uid: &str,
    results: &[Allocation<'_>],
    configs: serde_json::Value,
) {
    let results: Vec<serde_json::Value> = results
        .iter()
        .map(|(request, device, share, memory, sms, admin)| {
            let mut r =
                json!({"request": request, "driver": DRIVER, "pool": NODE, "device": device});
            if let Some(share) = share {
                r["shareID"] = json!(share);
                r["consumedCapacity"] = json!({"memory": memory, "multiprocessors": sms});
            }
            if *admin {
                r["adminAccess"] = json!(true);
            }
            r
        })
        .collect();
    let requests: Vec<serde_json::Value> = results
        .iter()
        .map(|r| json!({"name": r["request"], "exactly": {"deviceClassName": "gpu.cleave.dev"}}))
        .collect();
    let claim: serde_json::Value = json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {"devices": {"requests": requests}},
        "status": {
            "allocation": {"devices": {"results": results, "config": configs}},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-uid"}]
        }
    });
    let claim: k8s_openapi::api::resource::v1::ResourceClaim =
        serde_json::from_value(claim).unwrap();
    standin.put(&claim).unwrap();
}

/// The chart's `mps.gpu.cleave.dev` config, as the allocator attaches it (FromClass).
fn mps_class_config(requests: &[&str]) -> serde_json::Value {
    json!([{"source": "FromClass", "requests": requests, "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50, "pinnedMemoryLimit": {"default": "10Gi"}}}}}}])
}

/// What the H100 mock publishes as a whole device's capacity (81559Mi, 132 SMs).
const WHOLE: (&str, &str) = ("81559Mi", "132");

/// The cases of a mixed cluster that prepare used to refuse after scheduling, through the
/// real binary on an `mps` node: the MPS class (a whole-device share with the class's
/// config), `count: 2` of the exclusive class, two requests the allocator placed on one
/// GPU, admin access to a GPU another claim holds; and an over-committing share refused.
async fn allocations_of_a_mixed_cluster_prepare_through_the_binary() {
    let world = World::new();
    let standin = start_standin(&world.dirs).await;
    let kubelet = world.kubelet(&standin);
    let s = |n: u32| format!("{n:08x}-0000-4000-8000-00000000000{n}");
    let (s1, s2, s3, s4, s5, s6) = (s(1), s(2), s(3), s(4), s(5), s(6));
    put_allocated(
        &standin,
        "mps-class",
        "uid-mps-class",
        &[("gpu", "gpu-0", Some(s1.as_str()), WHOLE.0, WHOLE.1, false)],
        mps_class_config(&["gpu"]),
    );
    put_allocated(
        &standin,
        "count-two",
        "uid-count-two",
        &[
            ("gpu", "gpu-1", Some(s2.as_str()), WHOLE.0, WHOLE.1, false),
            ("gpu", "gpu-2", Some(s3.as_str()), WHOLE.0, WHOLE.1, false),
        ],
        json!([]),
    );
    put_allocated(
        &standin,
        "two-requests",
        "uid-two-requests",
        &[
            ("big", "gpu-3", Some(s4.as_str()), "20Gi", "44", false),
            ("small", "gpu-3", Some(s5.as_str()), "10Gi", "22", false),
        ],
        json!([]),
    );
    put_allocated(
        &standin,
        "monitor",
        "uid-monitor",
        &[("watch", "gpu-0", None, "", "", true)],
        json!([]),
    );
    put_allocated(
        &standin,
        "too-big",
        "uid-too-big",
        &[("gpu", "gpu-4", Some(s6.as_str()), "200Gi", "44", false)],
        json!([]),
    );
    let plugin = Plugin::start(&world.dirs, &world.plugin_options());
    let mut dra = dra_v1(&plugin.dra_socket).await;

    let answer = prepare(
        &mut dra,
        vec![
            claim("mps-class", "uid-mps-class"),
            claim("count-two", "uid-count-two"),
            claim("two-requests", "uid-two-requests"),
        ],
    )
    .await;
    for uid in ["uid-mps-class", "uid-count-two", "uid-two-requests"] {
        assert_eq!(answer.claims[uid].error, "", "{uid}\n{}", world.logs());
    }
    // The MPS class: its own daemon pod with the class's limits, not the shared daemon.
    assert!(
        world.pod(&standin, "uid-mps-class").is_some(),
        "{}",
        world.logs()
    );
    assert!(world.pod(&standin, &shared("gpu-0")).is_none());
    // A per-claim daemon's edits are the claim's (every container of the claim).
    let spec = world.cdi_spec("uid-mps-class");
    let env: Vec<String> = spec["containerEdits"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    let mounts: Vec<(String, String)> = spec["containerEdits"]["mounts"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| {
            (
                m["containerPath"].as_str().unwrap_or_default().to_owned(),
                m["hostPath"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert!(
        env.iter()
            .any(|e| e == "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50"),
        "{env:?}"
    );
    assert!(
        env.iter()
            .any(|e| e == "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10G"),
        "{env:?}"
    );
    let own_pipe = world
        .dirs
        .mps_pipe_dir("uid-mps-class")
        .display()
        .to_string();
    assert!(
        mounts.contains(&("/tmp/nvidia-mps".into(), own_pipe)),
        "{mounts:?}"
    );
    assert_eq!(
        answer.claims["uid-mps-class"].devices[0]
            .share_id
            .as_deref(),
        Some(s1.as_str())
    );
    // count: 2: two whole GPUs, no MPS.
    let two = &answer.claims["uid-count-two"].devices;
    assert_eq!(two.len(), 2);
    for (_, env, _) in devices_of(&world.cdi_spec("uid-count-two")) {
        assert!(!env.iter().any(|e| e.starts_with("CUDA_MPS")), "{env:?}");
    }
    // Two requests on one GPU: one CDI device, summed limits (30Gi; 66 of 132 SMs = 50 %),
    // one answer entry per shareID.
    let both = &answer.claims["uid-two-requests"].devices;
    assert_eq!(both.len(), 2, "{both:?}");
    assert_eq!(both[0].cdi_device_ids, both[1].cdi_device_ids);
    let ids: Vec<_> = both.iter().map(|d| d.share_id.clone().unwrap()).collect();
    assert_eq!(ids, [s4.clone(), s5.clone()]);
    let (_, env, _) = devices_of(&world.cdi_spec("uid-two-requests")).remove(0);
    for want in [
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=30720M",
    ] {
        assert!(env.iter().any(|e| e == want), "{want} not in {env:?}");
    }

    // Admin access to gpu-0, held by the MPS-class claim: served, nothing of MPS.
    let monitor = prepare(&mut dra, vec![claim("monitor", "uid-monitor")]).await;
    assert_eq!(monitor.claims["uid-monitor"].error, "", "{}", world.logs());
    let (_, env, _) = devices_of(&world.cdi_spec("uid-monitor")).remove(0);
    assert!(!env.iter().any(|e| e.starts_with("CUDA_MPS")), "{env:?}");
    assert!(
        world.dirs.log().contains("admin access"),
        "{}",
        world.logs()
    );
    let un = unprepare(&mut dra, vec![claim("monitor", "uid-monitor")]).await;
    assert_eq!(un.claims["uid-monitor"].error, "");
    assert!(
        world.pod(&standin, "uid-mps-class").is_some(),
        "admin unprepare stopped another claim's daemon"
    );

    // A share beyond its device: refused before anything changes, with the figures.
    let too_big = prepare(&mut dra, vec![claim("too-big", "uid-too-big")]).await;
    let err = &too_big.claims["uid-too-big"].error;
    assert!(
        err.contains("over-commit") && err.contains("204800Mi of 81559Mi"),
        "{err}"
    );
    assert!(world.pod(&standin, &shared("gpu-4")).is_none());
    assert!(
        !world
            .dirs
            .cdi_files()
            .iter()
            .any(|f| f.contains("uid-too-big"))
    );

    let un = unprepare(
        &mut dra,
        vec![
            claim("mps-class", "uid-mps-class"),
            claim("count-two", "uid-count-two"),
            claim("two-requests", "uid-two-requests"),
        ],
    )
    .await;
    for (uid, c) in &un.claims {
        assert_eq!(c.error, "", "{uid}");
    }
    eventually("the daemon pods are gone", &world, || {
        world.pod(&standin, "uid-mps-class").is_none()
            && world.pod(&standin, &shared("gpu-3")).is_none()
    })
    .await;
    assert!(
        world.dirs.cdi_files().is_empty(),
        "{:?}",
        world.dirs.cdi_files()
    );
    drop(dra);
    assert!(plugin.terminate().success());
    drop(kubelet);
}

/// A node whose kubelet keeps its plugins under a long root (k0s: `/var/lib/k0s/kubelet`;
/// here longer still): the per-claim daemon's sockets live under the short pipe root, so
/// the claim prepares where the old layout (pipe directory inside the state directory)
/// would need more than the 107 bytes of a unix socket path.
async fn per_claim_mps_works_under_a_long_kubelet_root() {
    let world = World::new();
    let standin = start_standin(&world.dirs).await;
    let kubelet = world.kubelet(&standin);
    let long_root = world.dirs.path().join("var/lib/k0s/kubelet");
    let plugins = long_root.join("plugins");
    let uid = "0b6f4a5c-1c1e-4f5e-9d2a-3c4b5a6d7e8f";
    let old_layout = plugins
        .join(DRIVER)
        .join("mps")
        .join(uid)
        .join("pipe/control_privileged");
    assert!(
        old_layout.as_os_str().len() > 107,
        "the test root is too short to show anything: {}",
        old_layout.display()
    );
    put_allocated(
        &standin,
        "mps-class",
        uid,
        &[("gpu", "gpu-0", None, "", "", false)],
        mps_class_config(&["gpu"]),
    );
    let mut options = world.plugin_options();
    options.env.push((
        "KUBELET_PLUGINS_DIRECTORY_PATH",
        plugins.display().to_string(),
    ));
    let plugin = Plugin::start_with_state_dir(&world.dirs, &options, &plugins.join(DRIVER));
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let answer = prepare(&mut dra, vec![claim("mps-class", uid)]).await;
    assert_eq!(answer.claims[uid].error, "", "{}", world.logs());
    let pipe = cleave_driver::sharing::pipe_dir_under(
        &world.dirs.mps_pipe_root(),
        &plugins.join(DRIVER),
        uid,
    );
    assert!(pipe.join("control_privileged").as_os_str().len() <= 107);
    let un = unprepare(&mut dra, vec![claim("mps-class", uid)]).await;
    assert_eq!(un.claims[uid].error, "", "{}", world.logs());
    assert!(!pipe.exists(), "pipe directory left: {}", pipe.display());
    drop(dra);
    assert!(plugin.terminate().success());
    drop(kubelet);
}

/// A pod of `namespace` on this node consuming claim `claim` directly, labelled `team`.
fn consumer_pod(namespace: &str, name: &str, uid: &str, claim: &str, team: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "labels": {"team": team}},
        "spec": {"nodeName": NODE, "containers": [{"name": "app"}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}]},
    }))
    .unwrap()
}

/// Writes `<proc>/<pid>/cgroup` as a container of pod `pod_uid` has it on a cgroup v2 node
/// with the systemd driver (the pod UID's dashes as underscores in the slice name).
fn container_cgroup(proc: &std::path::Path, pid: u32, pod_uid: &str) {
    let dir = proc.join(pid.to_string());
    std::fs::create_dir_all(&dir).unwrap();
    let slice = pod_uid.replace('-', "_");
    std::fs::write(
        dir.join("cgroup"),
        format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{slice}.slice/cri-containerd-{pid:064x}.scope\n"
        ),
    )
    .unwrap();
}

/// Capacity shares of two namespaces on one GPU and a per-claim MPS claim beside them,
/// measured through the binary: each share's memory and activity come from its own MPS
/// clients (NVML's MPS-client list, tied to the claim by the client's pod cgroup and the
/// pod's claims), the pods' team labels are on the series, the idle share gets `ClaimIdle`
/// while its busy neighbour does not, and `usage` and `usage --by team` show them apart.
async fn shares_and_an_mps_claim_are_measured_by_their_pods() {
    let world = World::new();
    let standin = start_standin(&world.dirs).await;
    let (a, b) = (SHARES[0], SHARES[1]);
    put_share_claim_in(&standin, "team-a", "share-a", a.0, "gpu-0", Some(a.1));
    put_share_claim_in(&standin, "team-b", "share-b", b.0, "gpu-0", Some(b.1));
    put_allocated(
        &standin,
        "mps-class",
        "uid-mps-class",
        &[("gpu", "gpu-1", Some(SHARES[2].1), WHOLE.0, WHOLE.1, false)],
        mps_class_config(&["gpu"]),
    );
    let pods = [
        (
            "team-a",
            "trainer",
            "aaaaaaaa-0000-4000-8000-000000000001",
            "share-a",
            "alpha",
            4101,
        ),
        (
            "team-b",
            "notebook",
            "bbbbbbbb-0000-4000-8000-000000000002",
            "share-b",
            "beta",
            4102,
        ),
        (
            "default",
            "server",
            "cccccccc-0000-4000-8000-000000000003",
            "mps-class",
            "gamma",
            4103,
        ),
    ];
    let proc = world.dirs.path().join("proc");
    for (ns, name, uid, claim, team, pid) in pods {
        standin
            .put(&consumer_pod(ns, name, uid, claim, team))
            .unwrap();
        container_cgroup(&proc, pid, uid);
    }
    // A host process on GPU 0 that no pod runs: nobody's.
    std::fs::create_dir_all(proc.join("4200")).unwrap();
    std::fs::write(proc.join("4200/cgroup"), "0::/system.slice/sshd.service\n").unwrap();
    // The busy share's client: 3 GiB at 40 %; the idle one's: 1 GiB at 0 %; the MPS
    // claim's: 2 GiB at 25 %, all MPS clients; the host process 5 GiB at 90 %.
    let control = world.dirs.path().join("mock-control");
    std::fs::write(
        &control,
        "process 0 4101 3072 40 mps\nprocess 0 4102 1024 0 mps\nprocess 1 4103 2048 25 mps\nprocess 0 4200 5120 90\n",
    )
    .unwrap();
    let port = free_port();
    let mut options = world.plugin_options();
    options
        .env
        .retain(|(k, _)| !matches!(*k, "MPS_LAUNCHER" | "MPS_DAEMON_IMAGE"));
    options.env.extend([
        ("MPS_LAUNCHER", "process".into()),
        ("MOCK_NVML_CONTROL", control.display().to_string()),
        ("PROC_ROOT", proc.display().to_string()),
        ("USAGE_INTERVAL", "200ms".into()),
        ("IDLE_THRESHOLD", "5".into()),
        ("IDLE_AFTER", "1s".into()),
        ("IDLE_EVENTS", "true".into()),
        ("CLAIM_POD_LABELS", "team".into()),
    ]);
    options.metrics_port = Some(port);
    let plugin = Plugin::start(&world.dirs, &options);
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let in_ns = |ns: &str, name: &str, uid: &str| {
        let mut c = claim(name, uid);
        c.namespace = ns.to_owned();
        c
    };
    let claims = vec![
        in_ns("team-a", "share-a", a.0),
        in_ns("team-b", "share-b", b.0),
        claim("mps-class", "uid-mps-class"),
    ];
    let answer = prepare(&mut dra, claims.clone()).await;
    for c in &claims {
        assert_eq!(
            answer.claims[&c.uid].error,
            "",
            "{}\n{}",
            c.uid,
            world.logs()
        );
    }
    const GIB: f64 = 1073741824.0;
    type Samples = Vec<cleave_kubelet_plugin::usage::Sample>;
    let scrape = || -> Samples {
        let (status, text) = http_get(port, "/metrics").unwrap();
        assert_eq!(status, 200);
        cleave_kubelet_plugin::usage::parse_exposition(&text).unwrap()
    };
    let find = |s: &Samples, name: &str, labels: &[(&str, &str)]| {
        let full = format!("cleave_kubelet_plugin_{name}");
        s.iter()
            .find(|(n, l, _)| {
                *n == full
                    && labels
                        .iter()
                        .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|x| x.2)
    };
    let want = |s: &Samples| {
        find(
            s,
            "claim_used_memory_bytes",
            &[
                ("claim", "share-a"),
                ("namespace", "team-a"),
                ("label_team", "alpha"),
            ],
        ) == Some(3.0 * GIB)
            && find(
                s,
                "claim_used_memory_bytes",
                &[
                    ("claim", "share-b"),
                    ("namespace", "team-b"),
                    ("label_team", "beta"),
                ],
            ) == Some(GIB)
            && find(
                s,
                "claim_used_memory_bytes",
                &[("claim", "mps-class"), ("label_team", "gamma")],
            ) == Some(2.0 * GIB)
            && find(
                s,
                "claim_compute_activity_percent",
                &[("claim", "share-a"), ("source", "process_sm_utilization")],
            ) == Some(40.0)
            && find(
                s,
                "claim_compute_activity_percent",
                &[("claim", "share-b"), ("source", "process_sm_utilization")],
            ) == Some(0.0)
            && find(s, "claim_idle", &[("claim", "share-b")]) == Some(1.0)
    };
    let started = std::time::Instant::now();
    let mut last = scrape();
    while !want(&last) {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "shares not measured apart after 60 s; last scrape:\n{}\n{}",
            last.iter()
                .filter(|(n, _, _)| n.contains("_claim_"))
                .map(|(n, l, v)| format!("{n}{l:?} {v}"))
                .collect::<Vec<_>>()
                .join("\n"),
            world.logs()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        last = scrape();
    }
    // The busy share is not idle; the host process counted for no claim.
    assert_eq!(
        find(&last, "claim_idle", &[("claim", "share-a")]),
        Some(0.0)
    );
    assert_eq!(
        find(
            &last,
            "claim_activity_attributable",
            &[("claim", "share-a")]
        ),
        Some(1.0)
    );
    let found = standin
        .wait_for(
            "events.events.k8s.io",
            std::time::Duration::from_secs(30),
            |evs| {
                evs.iter()
                    .any(|e| e["reason"] == "ClaimIdle" && e["regarding"]["name"] == "share-b")
            },
        )
        .await
        .unwrap_or_else(|evs| panic!("no ClaimIdle Event for share-b: {evs:?}\n{}", world.logs()));
    assert!(
        !found
            .iter()
            .any(|e| e["reason"] == "ClaimIdle" && e["regarding"]["name"] == "share-a"),
        "{found:?}"
    );
    // `usage` shows each share's own memory; `usage --by team` each team apart.
    let usage = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
            .args([
                "usage",
                "--scrapes",
                "1",
                "--metrics-addr",
                &format!("127.0.0.1:{port}"),
            ])
            .args(extra)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    let table = usage(&[]);
    let row = |text: &str, first: &str| {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(first))
            .unwrap_or_else(|| panic!("no {first} row in\n{text}"))
            .to_owned()
    };
    assert!(
        row(&table, "team-a/share-a").contains("3.0 GiB, 40.0% process_sm_utilization"),
        "{table}"
    );
    assert!(
        row(&table, "team-b/share-b").contains("1.0 GiB, 0.0% process_sm_utilization"),
        "{table}"
    );
    assert!(
        row(&table, "default/mps-class").contains("2.0 GiB, 25.0% process_sm_utilization"),
        "{table}"
    );
    let by_team = usage(&["--by", "team"]);
    for (team, used) in [("alpha", "0.40"), ("beta", "0.00")] {
        let r = row(&by_team, team);
        let cols: Vec<&str> = r.split_whitespace().collect();
        assert_eq!((cols[1], cols[3]), ("1", used), "{by_team}");
    }
    drop(dra);
    assert!(plugin.terminate().success());
}

const TESTS: [cleave_testkit::runner::Test; 7] = [
    ("shares_and_an_mps_claim_are_measured_by_their_pods", || {
        block_on(shares_and_an_mps_claim_are_measured_by_their_pods())
    }),
    (
        "three_shares_of_one_gpu_use_one_daemon_until_the_last_is_unprepared",
        || block_on(three_shares_of_one_gpu_use_one_daemon_until_the_last_is_unprepared()),
    ),
    ("whole_claim_on_a_shared_gpu_is_refused_clearly", || {
        block_on(whole_claim_on_a_shared_gpu_is_refused_clearly())
    }),
    ("process_launcher_serves_shares_with_one_daemon_too", || {
        block_on(process_launcher_serves_shares_with_one_daemon_too())
    }),
    (
        "allocations_of_a_mixed_cluster_prepare_through_the_binary",
        || block_on(allocations_of_a_mixed_cluster_prepare_through_the_binary()),
    ),
    (
        "shares_of_two_namespaces_on_one_gpu_get_own_daemons_pipes_and_shm",
        || block_on(shares_of_two_namespaces_on_one_gpu_get_own_daemons_pipes_and_shm()),
    ),
    ("per_claim_mps_works_under_a_long_kubelet_root", || {
        block_on(per_claim_mps_works_under_a_long_kubelet_root())
    }),
];

fn main() -> std::process::ExitCode {
    cleave_testkit::runner::main(&TESTS)
}
