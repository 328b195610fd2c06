//! What a claim got, in the claim, end to end: the real binary over the mock NVML library and
//! the API server stand-in (which checks `status.devices` as KEP-4817 states it). After a
//! prepare, `status.devices` holds this driver's entries for a whole GPU, an on-demand MIG
//! device, a per-claim MPS claim and a capacity share, each with its data and `Ready` /
//! `Healthy` conditions; an Xid 79 on the whole GPU turns its `Healthy` false; unprepare
//! removes the entries. With `--claim-device-status=false` nothing is written.
//!
//! Built with `harness = false`, like `usage`: the MPS claim and the share need the fake
//! `nvidia-cuda-mps-control` and `nvidia-smi` of `cleave-fakes`, played by this test binary
//! itself through wrappers in the driver root.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use cleave_apiserver_standin::StandIn;
use cleave_testkit::runner::block_on;
use common::node::*;
use common::*;
use serde_json::{Value, json};

/// GPU 0 in MIG mode (on-demand MIG), GPUs 1–3 whole.
const MIXED: &str = "name: status-mixed\ngpus:\n  - product: h100-80gb\n    migEnabled: true\n  - product: h100-80gb\n    migEnabled: false\n  - product: h100-80gb\n    migEnabled: false\n  - product: h100-80gb\n    migEnabled: false\n";
const SHARE_ID: &str = "5a000000-0000-4000-8000-00000000000a";

fn put_claims(standin: &StandIn) {
    put_claim(
        standin,
        "mig",
        "uid-mig",
        &[("mig", "gpu-0-mig-3g40gb-4")],
        &[],
    );
    let mps = cleave_apiserver_standin::fixtures::opaque_config(
        "FromClaim",
        &["gpu"],
        DRIVER,
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50}}}),
    );
    put_claim(standin, "mps", "uid-mps", &[("gpu", "gpu-1")], &[mps]);
    put_claim(standin, "whole", "uid-whole", &[("gpu", "gpu-2")], &[]);
    let mut share = cleave_apiserver_standin::fixtures::resource_claim(
        "default",
        "share",
        "uid-share",
        DRIVER,
        NODE,
        &[("gpu", "gpu-3")],
        &[],
    );
    for r in share
        .status
        .as_mut()
        .and_then(|s| s.allocation.as_mut())
        .and_then(|a| a.devices.as_mut())
        .and_then(|d| d.results.as_mut())
        .unwrap()
    {
        r.share_id = Some(SHARE_ID.into());
        r.consumed_capacity = Some(
            serde_json::from_value(json!({"memory": "20Gi", "multiprocessors": "44"})).unwrap(),
        );
    }
    standin.put(&share).unwrap();
}

const CLAIMS: [(&str, &str); 4] = [
    ("mig", "uid-mig"),
    ("mps", "uid-mps"),
    ("whole", "uid-whole"),
    ("share", "uid-share"),
];

/// `status.devices` of claim `name` in the stand-in.
fn entries(standin: &StandIn, name: &str) -> Vec<Value> {
    standin
        .get("resourceclaims", "default", name)
        .and_then(|c| c["status"]["devices"].as_array().cloned())
        .unwrap_or_default()
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

fn condition<'a>(entry: &'a Value, type_: &str) -> &'a Value {
    entry["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("no {type_} condition in {entry}"))
}

fn start_plugin(dirs: &NodeDirs, control: &Path, extra: &[(&'static str, String)]) -> Plugin {
    let config = dirs.path().join("mixed.yaml");
    std::fs::write(&config, MIXED).unwrap();
    let mut env = vec![
        ("MOCK_NVML_CONFIG", config.display().to_string()),
        ("MOCK_NVML_MIG", String::new()),
        ("MOCK_NVML_CONTROL", control.display().to_string()),
        ("CONSUMABLE_CAPACITY", "mps".into()),
        ("USAGE_INTERVAL", "0".into()),
    ];
    env.extend(dirs.install_fake_tools());
    env.extend(extra.iter().cloned());
    Plugin::start(
        dirs,
        &PluginOptions {
            dynamic_mig: true,
            env,
            ..PluginOptions::default()
        },
    )
}

async fn entries_follow_prepare_health_and_unprepare() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claims(&standin);
    let control = dirs.path().join("control");
    std::fs::write(&control, "").unwrap();
    let plugin = start_plugin(&dirs, &control, &[]);
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let r = prepare(&mut dra, CLAIMS.iter().map(|(n, u)| claim(n, u)).collect()).await;
    for (_, uid) in CLAIMS {
        assert_eq!(r.claims[uid].error, "", "{uid}: {}", dirs.log());
    }
    wait_until("every claim's status entries", &dirs, || {
        CLAIMS.iter().all(|(n, _)| !entries(&standin, n).is_empty())
    })
    .await;

    for (name, _) in CLAIMS {
        let e = entries(&standin, name);
        assert_eq!(e.len(), 1, "{name}: {e:?}");
        let e = &e[0];
        assert_eq!(e["driver"], DRIVER);
        assert_eq!(e["pool"], NODE);
        assert_eq!(e["data"]["apiVersion"], "gpu.cleave.dev/v1alpha1");
        assert_eq!(e["data"]["kind"], "DeviceStatus");
        assert_eq!(condition(e, "Ready")["status"], "True", "{name}: {e}");
        assert_eq!(condition(e, "Healthy")["status"], "True", "{name}: {e}");
    }
    let whole = &entries(&standin, "whole")[0];
    assert_eq!(whole["device"], "gpu-2");
    assert!(
        whole["data"]["uuid"].as_str().unwrap().starts_with("GPU-"),
        "{whole}"
    );
    assert_eq!(whole["data"]["uuid"], whole["data"]["gpuUUID"]);

    let mig = &entries(&standin, "mig")[0];
    assert_eq!(mig["device"], "gpu-0-mig-3g40gb-4");
    let m = &mig["data"]["mig"];
    assert!(
        mig["data"]["uuid"].as_str().unwrap().starts_with("MIG-"),
        "{mig}"
    );
    assert_eq!(m["uuid"], mig["data"]["uuid"]);
    assert_eq!(m["profile"], "3g.40gb");
    assert_eq!(m["placementStart"], 4);
    assert_eq!(m["placementSize"], 4);
    assert!(
        m["gpuInstanceID"].is_u64() && m["computeInstanceID"].is_u64(),
        "{mig}"
    );
    assert_eq!(m["createdForClaim"], true);

    let mps = &entries(&standin, "mps")[0];
    assert_eq!(mps["data"]["mps"]["activeThreadPercentage"], 50);
    assert!(
        mps["data"]["mps"]["daemon"]
            .as_str()
            .unwrap()
            .starts_with("PID "),
        "{mps}"
    );

    let share = &entries(&standin, "share")[0];
    assert_eq!(share["shareID"], SHARE_ID);
    let s = &share["data"]["share"];
    assert_eq!(s["shareID"], SHARE_ID);
    assert_eq!(s["consumedMemoryBytes"], 20u64 << 30);
    assert_eq!(s["consumedMultiprocessors"], 44);
    // 44 of the H100's 132 SMs: a third of the threads, the consumed memory pinned.
    assert_eq!(s["clientActiveThreadPercentage"], 33);
    assert_eq!(s["clientPinnedMemoryLimitMib"], 20 * 1024);
    assert_eq!(
        s["daemon"],
        cleave_driver::prepare::shared_daemon_key("gpu-3", "default")
    );

    // A fatal Xid on the whole GPU: its claim's Healthy turns False, naming the Xid; the
    // others stay healthy.
    std::fs::write(&control, "xid 2 79\n").unwrap();
    wait_until("Healthy=False on the whole GPU's claim", &dirs, || {
        entries(&standin, "whole")
            .first()
            .is_some_and(|e| condition(e, "Healthy")["status"] == "False")
    })
    .await;
    let whole = &entries(&standin, "whole")[0];
    let healthy = condition(whole, "Healthy");
    assert_eq!(healthy["reason"], "Xid");
    assert!(
        healthy["message"].as_str().unwrap().contains("79"),
        "{healthy}"
    );
    assert_eq!(condition(whole, "Ready")["status"], "True");
    assert_eq!(
        condition(&entries(&standin, "mig")[0], "Healthy")["status"],
        "True"
    );

    // Unprepare clears every entry.
    let u = unprepare(&mut dra, CLAIMS.iter().map(|(n, u)| claim(n, u)).collect()).await;
    for (_, uid) in CLAIMS {
        assert_eq!(u.claims[uid].error, "", "{uid}: {}", dirs.log());
    }
    wait_until("every claim's entries removed", &dirs, || {
        CLAIMS.iter().all(|(n, _)| entries(&standin, n).is_empty())
    })
    .await;
    assert!(plugin.terminate().success());
}

async fn nothing_is_written_when_turned_off() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claims(&standin);
    let control = dirs.path().join("control");
    std::fs::write(&control, "").unwrap();
    let plugin = start_plugin(&dirs, &control, &[("CLAIM_DEVICE_STATUS", "false".into())]);
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let r = prepare(&mut dra, vec![claim("whole", "uid-whole")]).await;
    assert_eq!(r.claims["uid-whole"].error, "");
    // A writer flushes what it holds at shutdown (`pending_writes_are_written_at_shutdown`):
    // once the plugin has exited, a write that was to come would be there.
    drop(dra);
    assert!(plugin.terminate().success());
    assert!(entries(&standin, "whole").is_empty());
    assert_eq!(standin.count("update", "resourceclaims"), 0);
}

/// The entries of a claim prepared just before SIGTERM are on the server when the plugin has
/// exited: shutdown flushes what the writer still holds (the flush itself, while a batch
/// still runs: the unit test `a_flush_writes_at_once_even_while_a_batch_runs`).
async fn pending_writes_are_written_at_shutdown() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(&standin, "whole", "uid-whole", &[("gpu", "gpu-0")], &[]);
    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let r = prepare(&mut dra, vec![claim("whole", "uid-whole")]).await;
    assert_eq!(r.claims["uid-whole"].error, "");
    drop(dra);
    assert!(plugin.terminate().success());
    let written = entries(&standin, "whole");
    assert_eq!(written.len(), 1, "{written:?}\n{}", dirs.log());
    assert_eq!(condition(&written[0], "Ready")["status"], "True");
}

/// `(claim GETs, claim status writes, 409 answers)` the stand-in served since its counts
/// were last reset.
fn claim_requests(standin: &StandIn) -> (usize, usize, usize) {
    let recs: Vec<_> = standin
        .requests()
        .into_iter()
        .filter(|r| r.resource == "resourceclaims")
        .collect();
    let gets = recs.iter().filter(|r| r.verb == "get").count();
    let writes = recs
        .iter()
        .filter(|r| matches!(r.verb.as_str(), "update" | "patch") && r.path.ends_with("/status"))
        .count();
    let conflicts = recs.iter().filter(|r| r.status == 409).count();
    (gets, writes, conflicts)
}

/// The DRA client of these tests.
type Dra = cleave_kubelet_plugin::proto::dra::v1::dra_plugin_client::DraPluginClient<
    tonic::transport::Channel,
>;

/// Prepares the whole-GPU claim `whole` and waits until its entries are written.
async fn prepare_whole(dra: &mut Dra, dirs: &NodeDirs, standin: &StandIn) {
    let r = prepare(dra, vec![claim("whole", "uid-whole")]).await;
    assert_eq!(r.claims["uid-whole"].error, "", "{}", dirs.log());
    wait_until("the claim's entries", dirs, || {
        !entries(standin, "whole").is_empty() && claim_requests(standin).1 >= 1
    })
    .await;
}

/// Unprepares the claim `whole` and waits until its entries are gone after at least
/// `writes` status writes.
async fn unprepare_whole(dra: &mut Dra, dirs: &NodeDirs, standin: &StandIn, writes: usize) {
    let u = unprepare(dra, vec![claim("whole", "uid-whole")]).await;
    assert_eq!(u.claims["uid-whole"].error, "", "{}", dirs.log());
    wait_until("the claim's entries removed", dirs, || {
        entries(standin, "whole").is_empty() && claim_requests(standin).1 >= writes
    })
    .await;
}

/// A whole-GPU claim costs one claim GET and one status write at prepare, and no GET and one
/// status write at unprepare: the write reuses the object the prepare read, the unprepare the
/// object that write returned.
async fn one_read_and_one_write_per_claim() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(&standin, "whole", "uid-whole", &[("gpu", "gpu-0")], &[]);
    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let mut dra = dra_v1(&plugin.dra_socket).await;
    standin.reset_counts();
    prepare_whole(&mut dra, &dirs, &standin).await;
    assert_eq!(claim_requests(&standin), (1, 1, 0), "prepare");

    standin.reset_counts();
    unprepare_whole(&mut dra, &dirs, &standin, 1).await;
    assert_eq!(claim_requests(&standin), (0, 1, 0), "unprepare");
    assert!(plugin.terminate().success());
}

/// Someone else changes the claim between prepare and unprepare (another pod reserves it):
/// the unprepare's write from the kept object is refused with 409, the plugin reads the
/// claim once and writes again, and the other pod's reservation survives while our entries
/// go.
async fn a_foreign_change_costs_one_read_and_is_kept() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(&standin, "whole", "uid-whole", &[("gpu", "gpu-0")], &[]);
    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let mut dra = dra_v1(&plugin.dra_socket).await;
    prepare_whole(&mut dra, &dirs, &standin).await;

    let mut stored = standin.get("resourceclaims", "default", "whole").unwrap();
    let status = &mut stored["status"];
    let mut reserved = status["reservedFor"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    reserved.push(json!({"resource": "pods", "name": "other", "uid": "pod-other"}));
    status["reservedFor"] = Value::Array(reserved);
    standin.put(&stored).unwrap();
    standin.reset_counts();

    unprepare_whole(&mut dra, &dirs, &standin, 2).await;
    assert_eq!(claim_requests(&standin), (1, 2, 1), "unprepare");
    let after = standin.get("resourceclaims", "default", "whole").unwrap();
    assert!(
        after["status"]["reservedFor"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["uid"] == "pod-other"),
        "{after}"
    );
    assert!(plugin.terminate().success());
}

/// A plugin restarted between prepare and unprepare has kept no object: its unprepare costs
/// one GET (and one write).
async fn a_restart_costs_one_read_at_unprepare() {
    let dirs = NodeDirs::new();
    let standin = start_standin(&dirs).await;
    put_claim(&standin, "whole", "uid-whole", &[("gpu", "gpu-0")], &[]);
    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let mut dra = dra_v1(&plugin.dra_socket).await;
    prepare_whole(&mut dra, &dirs, &standin).await;
    drop(dra);
    assert!(plugin.terminate().success());

    let plugin = Plugin::start(&dirs, &PluginOptions::default());
    let mut dra = dra_v1(&plugin.dra_socket).await;
    standin.reset_counts();
    unprepare_whole(&mut dra, &dirs, &standin, 1).await;
    assert_eq!(
        claim_requests(&standin),
        (1, 1, 0),
        "unprepare after a restart"
    );
    assert!(plugin.terminate().success());
}

fn main() -> std::process::ExitCode {
    cleave_testkit::runner::main(&[
        ("entries_follow_prepare_health_and_unprepare", || {
            block_on(entries_follow_prepare_health_and_unprepare())
        }),
        ("nothing_is_written_when_turned_off", || {
            block_on(nothing_is_written_when_turned_off())
        }),
        ("pending_writes_are_written_at_shutdown", || {
            block_on(pending_writes_are_written_at_shutdown())
        }),
        ("one_read_and_one_write_per_claim", || {
            block_on(one_read_and_one_write_per_claim())
        }),
        ("a_foreign_change_costs_one_read_and_is_kept", || {
            block_on(a_foreign_change_costs_one_read_and_is_kept())
        }),
        ("a_restart_costs_one_read_at_unprepare", || {
            block_on(a_restart_costs_one_read_at_unprepare())
        }),
    ])
}
