//! Request records say how many objects each request walks in the watch cache (a
//! `spec.nodeName` field selector on pods and ResourceSlices is served from the field index)
//! and how many seats API Priority and Fairness charges it; watch time can be compressed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use cleave_apiserver_standin::{StandIn, StandInOptions};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, ListParams, WatchParams};
use serde_json::json;

fn pod(ns: &str, name: &str, node: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": ns},
           "spec": {"nodeName": node, "containers": [{"name": "c", "image": "i"}]}})
}

fn slice(name: &str, node: &str, driver: &str) -> serde_json::Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
           "metadata": {"name": name},
           "spec": {"driver": driver, "nodeName": node,
                    "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                    "devices": []}})
}

/// (verb path, walked, seats) of every recorded request.
fn walks(s: &StandIn) -> Vec<(String, usize, u32)> {
    s.requests()
        .into_iter()
        .map(|r| (format!("{} {}", r.verb, r.path), r.scanned, r.seats))
        .collect()
}

#[tokio::test]
async fn lists_walk_their_whole_scope_unless_an_index_serves_them() {
    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    for i in 0..5 {
        s.put(&pod("a", &format!("p{i}"), &format!("node-{i}")))
            .unwrap();
    }
    s.put(&pod("a", "p0-bis", "node-0")).unwrap();
    s.put(&pod("b", "q", "node-0")).unwrap();
    let in_a: Api<Pod> = Api::namespaced(s.client(), "a");
    let all: Api<Pod> = Api::all(s.client());
    // Pinned spec.nodeName: the field index, per scope.
    let one = in_a
        .list(&ListParams::default().fields("spec.nodeName=node-0"))
        .await
        .unwrap();
    assert_eq!(one.items.len(), 2);
    all.list(&ListParams::default().fields("spec.nodeName=node-0"))
        .await
        .unwrap();
    // Not pinned (a label selector, an inequality, no selector): the whole scope.
    in_a.list(&ListParams::default().labels("app=x"))
        .await
        .unwrap();
    in_a.list(&ListParams::default().fields("spec.nodeName!=node-0"))
        .await
        .unwrap();
    all.list(&ListParams::default()).await.unwrap();
    in_a.get("p1").await.unwrap();
    // A watch from the current state is served like a list; from a resourceVersion, no walk.
    let mut initial = in_a
        .watch(
            &WatchParams::default()
                .fields("spec.nodeName=node-1")
                .timeout(1),
            "0",
        )
        .await
        .unwrap()
        .boxed();
    let _ = initial.next().await;
    let rv = one.metadata.resource_version.clone().unwrap();
    let mut from_rv = in_a
        .watch(&WatchParams::default().timeout(1), &rv)
        .await
        .unwrap()
        .boxed();
    let _ = from_rv.next().await;
    assert_eq!(
        walks(&s),
        [
            ("list /api/v1/namespaces/a/pods".to_owned(), 2, 1),
            ("list /api/v1/pods".to_owned(), 3, 1),
            ("list /api/v1/namespaces/a/pods".to_owned(), 6, 1),
            ("list /api/v1/namespaces/a/pods".to_owned(), 6, 1),
            ("list /api/v1/pods".to_owned(), 7, 1),
            ("get /api/v1/namespaces/a/pods/p1".to_owned(), 0, 1),
            ("watch /api/v1/namespaces/a/pods".to_owned(), 1, 1),
            ("watch /api/v1/namespaces/a/pods".to_owned(), 0, 1),
        ]
    );
}

#[tokio::test]
async fn slice_lists_by_node_walk_that_nodes_slices_of_every_driver() {
    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    for n in 0..4 {
        s.put(&slice(&format!("gpu-{n}"), &format!("node-{n}"), "gpu.x"))
            .unwrap();
    }
    s.put(&slice("other-1", "node-1", "other.y")).unwrap();
    let slices: Api<ResourceSlice> = Api::all(s.client());
    let by_node_and_driver = slices
        .list(&ListParams::default().fields("spec.nodeName=node-1,spec.driver=gpu.x"))
        .await
        .unwrap();
    assert_eq!(by_node_and_driver.items.len(), 1);
    slices
        .list(&ListParams::default().fields("spec.driver=gpu.x"))
        .await
        .unwrap();
    assert_eq!(
        walks(&s),
        [
            (
                "list /apis/resource.k8s.io/v1/resourceslices".to_owned(),
                2,
                1
            ),
            (
                "list /apis/resource.k8s.io/v1/resourceslices".to_owned(),
                5,
                1
            ),
        ]
    );
}

#[tokio::test]
async fn seats_count_every_stored_object_of_the_resource_and_stop_at_ten() {
    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    let in_a: Api<Pod> = Api::namespaced(s.client(), "a");
    let by_node = ListParams::default().fields("spec.nodeName=node-0");
    in_a.list(&by_node).await.unwrap();
    // 201 pods, one on node-0, most in another namespace: 3 seats, 1 object walked.
    s.put(&pod("a", "p", "node-0")).unwrap();
    for i in 0..200 {
        s.put(&pod("b", &format!("q{i}"), &format!("node-{}", i + 1)))
            .unwrap();
    }
    in_a.list(&by_node).await.unwrap();
    in_a.get("p").await.unwrap();
    // 1,101 pods: the estimate would be 12 seats, clamped to the maximum of 10.
    for i in 200..1100 {
        s.put(&pod("b", &format!("q{i}"), &format!("node-{}", i + 1)))
            .unwrap();
    }
    in_a.list(&by_node).await.unwrap();
    assert_eq!(
        walks(&s),
        [
            ("list /api/v1/namespaces/a/pods".to_owned(), 0, 1),
            ("list /api/v1/namespaces/a/pods".to_owned(), 1, 3),
            ("get /api/v1/namespaces/a/pods/p".to_owned(), 0, 1),
            ("list /api/v1/namespaces/a/pods".to_owned(), 1, 10),
        ]
    );
}

#[tokio::test]
async fn watches_end_time_scale_times_sooner() {
    let s = StandIn::start(StandInOptions {
        watch_time_scale: 100,
        ..Default::default()
    })
    .await
    .unwrap();
    let pods: Api<Pod> = Api::namespaced(s.client(), "a");
    let started = Instant::now();
    let mut stream = pods
        .watch(&WatchParams::default().timeout(100), "0")
        .await
        .unwrap()
        .boxed();
    // Asked for 100 s, ended after about 1 s.
    let ended = tokio::time::timeout(Duration::from_secs(30), async {
        while stream.next().await.is_some() {}
    })
    .await;
    assert!(ended.is_ok(), "the watch did not end");
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
}
