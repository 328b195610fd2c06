//! SlicePublisher against the in-process API server stand-in (real HTTP + JSON, watch,
//! resourceVersion conflicts, ResourceSlice validation per Kubernetes version).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_api::pool::PoolDevices;
use cleave_apiserver_standin::{
    KubeVersion, StandIn, StandInOptions, validate_resource_slice_typed,
};
use cleave_controller::fixtures::{on_demand_mig_group, on_demand_mig_pool, whole_gpu_pool};
use cleave_controller::{
    ApiStats, BackoffConfig, PublisherConfig, SliceLayout, SlicePublisher, plan_slices,
};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, DeleteParams, ListParams};

const DRIVER: &str = "gpu.cleave.dev";
const NODE: &str = "node-a";
const WAIT: Duration = Duration::from_secs(5);

async fn standin(version: KubeVersion) -> StandIn {
    let s = StandIn::start(StandInOptions::with_version(version))
        .await
        .unwrap();
    s.put(&cleave_apiserver_standin::fixtures::node(NODE))
        .unwrap();
    s
}

fn config(stats: &Arc<ApiStats>) -> PublisherConfig {
    PublisherConfig {
        observer: Some(stats.observer()),
        backoff: BackoffConfig {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(400),
            conflict_retries: 5,
        },
        ..PublisherConfig::new(DRIVER, NODE)
    }
}

/// Our slices in the store, sorted by name.
fn slices(s: &StandIn) -> Vec<ResourceSlice> {
    let mut v: Vec<ResourceSlice> = s
        .list_as::<ResourceSlice>("resourceslices")
        .into_iter()
        .filter(|x| x.spec.driver == DRIVER && x.spec.node_name.as_deref() == Some(NODE))
        .collect();
    v.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    v
}

fn device_names(slices: &[ResourceSlice]) -> BTreeSet<String> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten().map(|d| d.name.clone()))
        .collect()
}

/// Creates, updates and deletes of slices; dry runs change nothing and do not count.
fn writes(s: &StandIn) -> usize {
    s.count("create", "resourceslices") - s.count_dry_runs("create", "resourceslices")
        + s.count("update", "resourceslices")
        + s.count("delete", "resourceslices")
}

/// Polls `cond` every 10 ms for at most `WAIT`.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < WAIT, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    start.elapsed()
}

/// Whether the store holds exactly the planned state for `pool` (content and count).
fn matches_plan(s: &StandIn, pool: &PoolDevices, layout: SliceLayout) -> bool {
    let want = plan_slices(pool, layout).unwrap();
    let have = slices(s);
    have.len() == want.len()
        && device_names(&have) == pool.devices().map(|d| d.name.clone()).collect()
        && have.iter().all(|h| {
            h.spec.pool.resource_slice_count == want.len() as i64
                && h.spec.pool.generation == have[0].spec.pool.generation
        })
        && want.iter().all(|w| {
            have.iter().any(|h| {
                h.spec.devices.clone().unwrap_or_default() == w.devices
                    && h.spec.shared_counters.clone().unwrap_or_default() == w.shared_counters
            })
        })
}

/// Proves that the publisher has handled every watch event the server sent before now and
/// run every sync those events made due: a foreign edit, which the watch stream delivers
/// after them, must be seen and reverted. Costs exactly one update, which callers count.
async fn marker_edit_reverted(
    s: &StandIn,
    p: &SlicePublisher,
    pool: &PoolDevices,
    layout: SliceLayout,
) {
    let syncs = p.status().borrow().syncs;
    let mut victim = slices(s)
        .into_iter()
        .find(|x| x.spec.devices.as_ref().is_some_and(|d| d.len() > 1))
        .unwrap();
    victim.spec.devices.as_mut().unwrap().truncate(1);
    s.put(&victim).unwrap();
    eventually("the marker edit reverted", || {
        let st = p.status().borrow().clone();
        st.published && st.syncs > syncs && matches_plan(s, pool, layout)
    })
    .await;
}

/// `(name, spec)` of each slice: what the publisher decides, without the resourceVersion.
fn contents(slices: &[ResourceSlice]) -> Vec<(Option<String>, String)> {
    slices
        .iter()
        .map(|x| {
            (
                x.metadata.name.clone(),
                serde_json::to_string(&x.spec).unwrap(),
            )
        })
        .collect()
}

async fn publish_and_wait(s: &StandIn, stats: &Arc<ApiStats>, pool: PoolDevices) -> SlicePublisher {
    let p = SlicePublisher::start(s.client(), config(stats));
    p.publish(pool);
    let st = p
        .wait_published(WAIT)
        .await
        .unwrap_or_else(|e| panic!("{e}: {:?}", p.status().borrow()));
    assert!(st.published);
    p
}

#[tokio::test]
async fn first_publish_of_an_8_gpu_mig_node_is_valid_in_both_layouts() {
    for (version, layout, expected, probes) in [
        (KubeVersion::V1_34, SliceLayout::CountersWithDevices, 8, 1),
        (KubeVersion::V1_35, SliceLayout::SeparateCounterSlices, 9, 2),
    ] {
        let s = standin(version).await;
        let stats = ApiStats::new();
        let pool = on_demand_mig_pool(8);
        let p = publish_and_wait(&s, &stats, pool.clone()).await;
        let st = p.status().borrow().clone();
        assert_eq!(st.layout, Some(layout), "layout from /version");
        assert_eq!((st.generation, st.slices), (1, expected));
        let have = slices(&s);
        assert_eq!(have.len(), expected);
        assert!(matches_plan(&s, &pool, layout));
        let node_uid = s
            .get_as::<Node>("nodes", "", NODE)
            .unwrap()
            .metadata
            .uid
            .unwrap();
        for slice in &have {
            validate_resource_slice_typed(slice, version).unwrap();
            assert!(
                slice
                    .metadata
                    .name
                    .as_ref()
                    .unwrap()
                    .starts_with("node-a-gpu.cleave.dev-")
            );
            let owner = &slice.metadata.owner_references.as_ref().unwrap()[0];
            assert_eq!(
                (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
                ("Node", NODE, node_uid.as_str())
            );
            assert_eq!(owner.controller, Some(true));
        }
        // Minimum: /version + node GET + list + one create per slice (+ the watch), and
        // before them the dry-run creates asking whether counters are kept: one slice with
        // counter sets, one with counter-consuming devices (the same slice on 1.34).
        assert_eq!(
            s.count("create", "resourceslices") - s.count_dry_runs("create", "resourceslices"),
            expected
        );
        assert_eq!(s.count_dry_runs("create", "resourceslices"), probes);
        assert_eq!(st.counters, cleave_controller::CounterSupport::Kept);
        assert_eq!(st.withdrawn_devices, 0);
        assert_eq!(
            s.count("update", "resourceslices") + s.count("delete", "resourceslices"),
            0
        );
        assert_eq!(s.count("get", "nodes"), 1);
        assert_eq!(s.count("list", "resourceslices"), 1);
        assert_eq!(stats.get("create", "ok"), expected as u64);
        p.shutdown().await;
    }
}

/// The slice watch asks the server for this node's own timeout (960–1199 s by its name), not
/// kube's fixed 290 s that keeps plugins started together renewing in step.
#[tokio::test]
async fn slice_watch_uses_the_nodes_jittered_timeout() {
    let s = standin(KubeVersion::V1_35).await;
    let stats = ApiStats::new();
    let p = publish_and_wait(&s, &stats, on_demand_mig_pool(1)).await;
    let want = format!(
        "timeoutSeconds={}",
        cleave_controller::publisher::watch_timeout_secs(NODE)
    );
    eventually("a slice watch", || {
        s.requests()
            .iter()
            .any(|r| r.verb == "watch" && r.resource == "resourceslices")
    })
    .await;
    let watches: Vec<String> = s
        .requests()
        .into_iter()
        .filter(|r| r.verb == "watch" && r.resource == "resourceslices")
        .map(|r| r.query)
        .collect();
    assert!(
        watches.iter().all(|q| q.contains(&want)),
        "{want} missing from {watches:?}"
    );
    assert_ne!(want, "timeoutSeconds=290");
    p.shutdown().await;
}

#[tokio::test]
async fn restart_with_nothing_changed_makes_zero_writes() {
    let s = standin(KubeVersion::V1_35).await;
    let stats = ApiStats::new();
    let pool = on_demand_mig_pool(8);
    publish_and_wait(&s, &stats, pool.clone())
        .await
        .shutdown()
        .await;
    let before = slices(&s);
    s.reset_counts();
    let stats2 = ApiStats::new();
    let p = publish_and_wait(&s, &stats2, pool.clone()).await;
    // Stray watch events (the echo of the first publisher's writes, the relist) had their
    // chance to cause (wrong) writes once a later foreign edit is seen: its revert is the
    // only write.
    marker_edit_reverted(&s, &p, &pool, SliceLayout::SeparateCounterSlices).await;
    assert_eq!(writes(&s), 1, "{:?}", s.requests());
    assert_eq!(
        s.count("update", "resourceslices"),
        1,
        "the marker's revert"
    );
    assert_eq!(stats2.writes(), 1);
    assert_eq!(s.count("get", "nodes"), 0, "no node GET without creates");
    assert_eq!(contents(&slices(&s)), contents(&before));
    p.shutdown().await;
}

#[tokio::test]
async fn one_gpu_mig_change_updates_one_slice() {
    for version in [KubeVersion::V1_34, KubeVersion::V1_35] {
        let s = standin(version).await;
        let stats = ApiStats::new();
        let p = publish_and_wait(&s, &stats, on_demand_mig_pool(8)).await;
        // The echoes of the first publish are handled before the counting starts.
        let layout = match version {
            KubeVersion::V1_34 => SliceLayout::CountersWithDevices,
            _ => SliceLayout::SeparateCounterSlices,
        };
        marker_edit_reverted(&s, &p, &on_demand_mig_pool(8), layout).await;
        s.reset_counts();
        let mut pool = on_demand_mig_pool(8);
        pool.groups[3] = on_demand_mig_group(3, 9);
        p.publish(pool);
        let st = p.wait_published(WAIT).await.unwrap();
        assert_eq!(st.generation, 1, "one changed slice keeps the generation");
        assert_eq!(s.count("update", "resourceslices"), 1, "{version}");
        assert_eq!(
            s.count("create", "resourceslices") + s.count("delete", "resourceslices"),
            0
        );
        p.shutdown().await;
    }
}

#[tokio::test]
async fn gpu_disappearing_bumps_generation_once() {
    let s = standin(KubeVersion::V1_34).await;
    let stats = ApiStats::new();
    let p = publish_and_wait(&s, &stats, on_demand_mig_pool(8)).await;
    s.reset_counts();
    let mut pool = on_demand_mig_pool(8);
    pool.groups.remove(5);
    p.publish(pool.clone());
    let st = p.wait_published(WAIT).await.unwrap();
    assert_eq!((st.generation, st.slices), (2, 7));
    assert_eq!(s.count("delete", "resourceslices"), 1);
    assert_eq!(
        s.count("update", "resourceslices"),
        7,
        "the others carry the new generation"
    );
    assert_eq!(s.count("create", "resourceslices"), 0);
    assert!(matches_plan(&s, &pool, SliceLayout::CountersWithDevices));
    assert!(slices(&s).iter().all(|x| x.spec.pool.generation == 2));
    p.shutdown().await;
}

#[tokio::test]
async fn foreign_edit_and_deletion_are_restored() {
    let s = standin(KubeVersion::V1_35).await;
    let stats = ApiStats::new();
    let pool = on_demand_mig_pool(4);
    let p = publish_and_wait(&s, &stats, pool.clone()).await;
    let layout = SliceLayout::SeparateCounterSlices;

    let mut victim = slices(&s)
        .into_iter()
        .find(|x| x.spec.devices.is_some())
        .unwrap();
    victim.spec.devices.as_mut().unwrap().truncate(3);
    s.put(&victim).unwrap();
    let took = eventually("edit reverted", || matches_plan(&s, &pool, layout)).await;
    eprintln!("foreign edit reverted in {took:?}");

    // A second edit is seen after everything the first one caused: two updates in all.
    marker_edit_reverted(&s, &p, &pool, layout).await;
    assert_eq!(
        s.count("update", "resourceslices"),
        2,
        "an edit costs one update: {:?}",
        s.requests()
    );
    let name = slices(&s)[0].metadata.name.clone().unwrap();
    s.reset_counts();
    s.delete("resourceslices", "", &name).unwrap();
    let took = eventually("deleted slice recreated", || {
        matches_plan(&s, &pool, layout)
    })
    .await;
    eprintln!("foreign deletion repaired in {took:?}");
    marker_edit_reverted(&s, &p, &pool, layout).await;
    assert_eq!(
        (
            s.count("create", "resourceslices") - s.count_dry_runs("create", "resourceslices"),
            s.count("update", "resourceslices"),
            s.count("delete", "resourceslices")
        ),
        (1, 1, 0),
        "a restore is one create (and the marker's revert one update): {:?}",
        s.requests()
    );
    assert!(slices(&s).iter().all(|x| x.spec.pool.generation == 1));
    assert!(
        slices(&s)
            .iter()
            .all(|x| x.metadata.name.as_deref() != Some(name.as_str()))
    );
    p.shutdown().await;
}

#[tokio::test]
async fn kubelet_wipe_is_republished_promptly() {
    let s = standin(KubeVersion::V1_34).await;
    let stats = ApiStats::new();
    let pool = on_demand_mig_pool(8);
    let p = publish_and_wait(&s, &stats, pool.clone()).await;
    // What the kubelet does: DeleteCollection with a field selector.
    let api: Api<ResourceSlice> = Api::all(s.client());
    api.delete_collection(
        &DeleteParams::default(),
        &ListParams::default().fields(&format!("spec.nodeName={NODE}")),
    )
    .await
    .unwrap();
    // The publisher has no periodic resync (only the counter probe, every 60 s), so a
    // restore within 30 s is the watch's doing, however loaded the machine; the time it
    // took is printed, not asserted (a timed test fails under load).
    let start = Instant::now();
    while !matches_plan(&s, &pool, SliceLayout::CountersWithDevices) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "not republished 30 s after a kubelet wipe"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!("republished after a kubelet wipe in {:?}", start.elapsed());
    let gens: BTreeSet<i64> = slices(&s).iter().map(|x| x.spec.pool.generation).collect();
    assert_eq!(gens, BTreeSet::from([2]), "generation never goes back");
    p.shutdown().await;
}

#[tokio::test]
async fn conflict_is_reread_and_retried() {
    let s = standin(KubeVersion::V1_34).await;
    let stats = ApiStats::new();
    let p = publish_and_wait(&s, &stats, on_demand_mig_pool(2)).await;
    s.reset_counts();
    s.fail_next("update", "resourceslices", 1, 409);
    let mut pool = on_demand_mig_pool(2);
    pool.groups[0] = on_demand_mig_group(0, 5);
    p.publish(pool.clone());
    p.wait_published(WAIT).await.unwrap();
    assert_eq!(s.count("update", "resourceslices"), 2);
    assert_eq!(
        s.count("get", "resourceslices"),
        1,
        "re-read after the conflict"
    );
    assert_eq!(stats.get("update", "conflict"), 1);
    assert!(matches_plan(&s, &pool, SliceLayout::CountersWithDevices));
    p.shutdown().await;
}

/// The most requests on `resourceslices` a backed-off publisher can make in `elapsed`: its
/// own attempts (20 ms doubling up to 400 ms, each delay at least 75 % of that with
/// jitter), each a dry-run probe of the counters plus the write, plus the slice watcher's
/// (kube-runtime's default backoff starts at 800 ms), each with its first attempt.
fn most_requests(elapsed: Duration) -> usize {
    let mut publisher = 1;
    let mut waited = Duration::ZERO;
    let mut delay = Duration::from_millis(20);
    loop {
        waited += delay.mul_f64(0.75);
        if waited > elapsed {
            break;
        }
        publisher += 1;
        delay = (delay * 2).min(Duration::from_millis(400));
    }
    let watcher = 2 + usize::try_from(elapsed.as_millis() / 800).unwrap_or(usize::MAX);
    2 * publisher + watcher
}

#[tokio::test]
async fn unavailable_server_is_backed_off_then_recovered() {
    let s = standin(KubeVersion::V1_35).await;
    let stats = ApiStats::new();
    let client = s.client_without_retry().unwrap();
    let p = SlicePublisher::start(client, config(&stats));
    p.publish(whole_gpu_pool(2));
    p.wait_published(WAIT).await.unwrap();

    s.set_unavailable(true);
    s.reset_counts();
    let started = std::time::Instant::now();
    p.publish(on_demand_mig_pool(2));
    // Several backed-off attempts (20, 40, 80 ms …) have failed.
    eventually("four failed attempts", || p.status().borrow().syncs >= 5).await;
    let st = p.status().borrow().clone();
    assert!(!st.published);
    assert!(
        st.last_error.as_deref().unwrap_or_default().contains("503"),
        "{st:?}"
    );
    let attempts = s.count("", "resourceslices");
    // Measured after counting, so the window is never underestimated: on a loaded machine
    // the wait can last much longer, and the bound must follow the real time.
    let elapsed = started.elapsed();
    // Attempts of two requests each, spaced by the backoff: never a busy loop.
    let most = most_requests(elapsed);
    assert!(
        (2..=most).contains(&attempts),
        "{attempts} requests in {elapsed:?} (at most {most} with backoff)"
    );

    s.set_unavailable(false);
    let st = p.wait_published(WAIT).await.unwrap();
    assert!(st.last_error.is_none());
    assert!(matches_plan(
        &s,
        &on_demand_mig_pool(2),
        SliceLayout::SeparateCounterSlices
    ));
    p.shutdown().await;
}

#[tokio::test]
async fn uninstall_removes_only_our_slices() {
    let s = standin(KubeVersion::V1_34).await;
    let stats = ApiStats::new();
    let p = publish_and_wait(&s, &stats, on_demand_mig_pool(3)).await;
    // Another driver on this node and this driver on another node.
    let mut other = slices(&s)[0].clone();
    other.metadata = Default::default();
    other.metadata.name = Some("other-driver".into());
    other.spec.driver = "other.example.com".into();
    s.put(&other).unwrap();
    let mut elsewhere = other.clone();
    elsewhere.metadata.name = Some("other-node".into());
    elsewhere.spec.driver = DRIVER.into();
    elsewhere.spec.node_name = Some("node-b".into());
    s.put(&elsewhere).unwrap();

    assert_eq!(p.uninstall().await.unwrap(), 3);
    assert!(slices(&s).is_empty());
    assert_eq!(s.list("resourceslices").len(), 2);
}

/// The watch selects the node only: other drivers' slices on the node are offered after
/// the first list and kept current, never written; other nodes' slices are not seen.
#[tokio::test]
async fn other_drivers_slices_on_the_node_are_offered_and_left_alone() {
    let s = standin(KubeVersion::V1_34).await;
    let mut other = ResourceSlice {
        metadata: Default::default(),
        spec: Default::default(),
    };
    other.metadata.name = Some("other-driver".into());
    other.spec.driver = "other.example.com".into();
    other.spec.node_name = Some(NODE.into());
    other.spec.pool.name = NODE.into();
    other.spec.pool.resource_slice_count = 1;
    s.put(&other).unwrap();
    let mut elsewhere = other.clone();
    elsewhere.metadata.name = Some("other-node".into());
    elsewhere.spec.node_name = Some("node-b".into());
    s.put(&elsewhere).unwrap();

    let stats = ApiStats::new();
    let p = SlicePublisher::start(s.client(), config(&stats));
    let mut others = p.other_drivers();
    let first = tokio::time::timeout(WAIT, others.wait_for(Option::is_some))
        .await
        .unwrap()
        .unwrap()
        .clone()
        .unwrap();
    let names: Vec<_> = first
        .iter()
        .filter_map(|x| x.metadata.name.clone())
        .collect();
    assert_eq!(names, ["other-driver"]);
    p.publish(whole_gpu_pool(8));
    p.wait_published(WAIT).await.unwrap();
    assert_eq!(s.list("resourceslices").len(), 3);
    assert!(
        s.requests()
            .iter()
            .filter(|r| r.resource == "resourceslices" && r.verb == "list")
            .all(|r| r.query.contains("spec.nodeName%3Dnode-a")
                && !r.query.contains("spec.driver")),
        "{:?}",
        s.requests()
    );
    // Its deletion is seen on the watch; our slices are not disturbed.
    let writes_before = writes(&s);
    let api: Api<ResourceSlice> = Api::all(s.client());
    api.delete("other-driver", &DeleteParams::default())
        .await
        .unwrap();
    tokio::time::timeout(
        WAIT,
        others.wait_for(|o| o.as_ref().is_some_and(|v| v.is_empty())),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(writes(&s), writes_before + 1, "only the test's delete");
    assert_eq!(slices(&s).len(), 1);
    p.shutdown().await;
}

#[tokio::test]
async fn shutdown_keeps_slices() {
    let s = standin(KubeVersion::V1_34).await;
    let stats = ApiStats::new();
    publish_and_wait(&s, &stats, whole_gpu_pool(8))
        .await
        .shutdown()
        .await;
    assert_eq!(slices(&s).len(), 1);
    assert_eq!(device_names(&slices(&s)).len(), 8);
}

#[tokio::test]
async fn wrong_layout_is_rejected_and_reported() {
    // Each layout is invalid on the other version: 1.35 forbids devices and counters in
    // one slice, 1.34 needs consumers beside their counter set.
    for (version, layout) in [
        (KubeVersion::V1_35, SliceLayout::CountersWithDevices),
        (KubeVersion::V1_34, SliceLayout::SeparateCounterSlices),
    ] {
        let s = standin(version).await;
        let stats = ApiStats::new();
        let p = SlicePublisher::start(
            s.client(),
            PublisherConfig {
                layout: Some(layout),
                ..config(&stats)
            },
        );
        p.publish(on_demand_mig_pool(1));
        let mut rx = p.status();
        let st = tokio::time::timeout(WAIT, rx.wait_for(|st| st.last_error.is_some()))
            .await
            .unwrap()
            .unwrap()
            .clone();
        assert!(!st.published);
        assert!(st.last_error.unwrap().contains("creating"), "{version}");
        assert_eq!(
            s.count("get", "version"),
            0,
            "an explicit layout skips /version"
        );
        p.shutdown().await;
    }
}

#[tokio::test]
async fn unpublishable_pool_is_reported_without_writes() {
    let s = standin(KubeVersion::V1_35).await;
    let stats = ApiStats::new();
    let p = SlicePublisher::start(s.client(), config(&stats));
    let mut pool = whole_gpu_pool(1);
    pool.groups[0].devices[0].name = "Not_A_Label".into();
    p.publish(pool);
    let mut rx = p.status();
    let st = tokio::time::timeout(WAIT, rx.wait_for(|st| st.last_error.is_some()))
        .await
        .unwrap()
        .unwrap()
        .clone();
    assert!(st.last_error.unwrap().contains("planning"));
    assert_eq!(writes(&s), 0);
    // A good pool afterwards is published, and its sync is the second: the plan error
    // waited for it (a retry loop, 20 ms at first, would have synced in between).
    p.publish(whole_gpu_pool(1));
    let st = p.wait_published(WAIT).await.unwrap();
    assert_eq!(
        st.syncs, 2,
        "a plan error waits for the next publish, no retry loop"
    );
    p.shutdown().await;
}

/// A server without `DRAPartitionableDevices` drops counters on write: nothing that
/// depends on them is ever stored (the dry run tells before the first write), what is safe
/// is published, the status says so, nothing is rewritten in a loop; once the server keeps
/// counters, the full pool is published.
#[tokio::test]
async fn counters_dropped_by_the_server_withhold_what_depends_on_them() {
    for version in [KubeVersion::V1_34, KubeVersion::V1_35] {
        let s = StandIn::start(StandInOptions {
            partitionable_devices: false,
            ..StandInOptions::with_version(version)
        })
        .await
        .unwrap();
        s.put(&cleave_apiserver_standin::fixtures::node(NODE))
            .unwrap();
        let stats = ApiStats::new();
        // Two on-demand MIG GPUs plus two whole GPUs without counters.
        let mut pool = on_demand_mig_pool(2);
        pool.groups
            .extend(whole_gpu_pool(2).groups.into_iter().map(|mut g| {
                for d in &mut g.devices {
                    d.name = format!("{}-plain", d.name);
                }
                g
            }));
        let (safe, withdrawn) = cleave_controller::without_counters(&pool);
        assert_eq!(safe.device_count(), 2);
        assert_eq!(withdrawn, pool.device_count() - 2);
        let p = SlicePublisher::start(
            s.client(),
            PublisherConfig {
                counter_probe_interval: Duration::from_millis(200),
                ..config(&stats)
            },
        );
        p.publish(pool.clone());
        let st = p.wait_published(WAIT).await.unwrap();
        assert_eq!(st.counters, cleave_controller::CounterSupport::Dropped);
        assert_eq!(st.withdrawn_devices, withdrawn);
        let have = slices(&s);
        assert_eq!(
            device_names(&have),
            safe.devices().map(|d| d.name.clone()).collect(),
            "{version}"
        );
        assert!(have.iter().all(|x| x.spec.shared_counters.is_none()));
        assert_eq!(
            s.count("create", "resourceslices") - s.count_dry_runs("create", "resourceslices"),
            have.len(),
            "only the safe slices were ever written"
        );
        // No rewrite loop: probes only (dry runs), no writes, for a while.
        let before = writes(&s);
        let probes = s.count_dry_runs("create", "resourceslices");
        eventually("two more counter probes", || {
            s.count_dry_runs("create", "resourceslices") >= probes + 2
        })
        .await;
        assert_eq!(writes(&s), before, "{:?}", s.requests());

        // The gate comes on: the next probe sees counters kept and the full pool goes out.
        s.set_partitionable_devices(true);
        eventually("the full pool", || {
            let st = p.status().borrow().clone();
            st.counters == cleave_controller::CounterSupport::Kept && st.published
        })
        .await;
        let st = p.status().borrow().clone();
        assert_eq!(st.withdrawn_devices, 0);
        eventually("all devices stored", || {
            device_names(&slices(&s)) == pool.devices().map(|d| d.name.clone()).collect()
        })
        .await;
        p.shutdown().await;
    }
}
