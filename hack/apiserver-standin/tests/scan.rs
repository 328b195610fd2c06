//! Request records say how many objects each request walks, as API Priority and Fairness
//! charges it; watch time can be compressed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use cleave_apiserver_standin::{StandIn, StandInOptions};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, WatchParams};
use serde_json::json;

fn pod(ns: &str, name: &str, node: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": ns},
           "spec": {"nodeName": node, "containers": [{"name": "c", "image": "i"}]}})
}

#[tokio::test]
async fn lists_walk_their_whole_scope_whatever_the_selector() {
    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    for i in 0..5 {
        s.put(&pod("a", &format!("p{i}"), &format!("node-{i}")))
            .unwrap();
    }
    s.put(&pod("b", "q", "node-0")).unwrap();
    let in_a: Api<Pod> = Api::namespaced(s.client(), "a");
    let all: Api<Pod> = Api::all(s.client());
    let one = in_a
        .list(&ListParams::default().fields("spec.nodeName=node-0"))
        .await
        .unwrap();
    assert_eq!(one.items.len(), 1);
    all.list(&ListParams::default().fields("spec.nodeName=node-0"))
        .await
        .unwrap();
    in_a.get("p1").await.unwrap();
    let rv = one.metadata.resource_version.clone().unwrap();
    let mut from_rv = in_a
        .watch(&WatchParams::default().timeout(1), &rv)
        .await
        .unwrap()
        .boxed();
    let _ = from_rv.next().await;
    let scanned: Vec<(String, usize)> = s
        .requests()
        .into_iter()
        .map(|r| (format!("{} {}", r.verb, r.path), r.scanned))
        .collect();
    assert_eq!(
        scanned,
        [
            ("list /api/v1/namespaces/a/pods".to_owned(), 5),
            ("list /api/v1/pods".to_owned(), 6),
            ("get /api/v1/namespaces/a/pods/p1".to_owned(), 0),
            ("watch /api/v1/namespaces/a/pods".to_owned(), 0),
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
