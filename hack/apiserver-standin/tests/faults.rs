//! Request records and fault injection.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use cleave_apiserver_standin::{StandIn, StandInOptions};
use common::slice;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, ListParams, PostParams};

fn code(e: kube::Error) -> u16 {
    match e {
        kube::Error::Api(s) => s.code,
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn requests_are_counted() {
    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    let api: Api<ResourceSlice> = Api::all(s.client());
    api.create(&PostParams::default(), &slice("a", "n1", 1))
        .await
        .unwrap();
    api.get("a").await.unwrap();
    api.list(&ListParams::default().fields("spec.nodeName=n1"))
        .await
        .unwrap();
    assert_eq!(s.count("POST", "resourceslices"), 1);
    assert_eq!(s.count("create", "resourceslices"), 1);
    assert_eq!(s.count("GET", "resourceslices"), 2);
    assert_eq!(s.count("list", "resourceslices.resource.k8s.io"), 1);
    assert_eq!(s.count("*", "*"), 3);
    let reqs = s.requests();
    assert_eq!(reqs[0].status, 201);
    assert!(reqs[0].bytes_in > 0 && reqs[0].bytes_out > 0);
    assert_eq!(reqs[2].path, "/apis/resource.k8s.io/v1/resourceslices");
    assert!(
        reqs[2].query.contains("fieldSelector=spec.nodeName%3Dn1"),
        "{}",
        reqs[2].query
    );
    s.reset_counts();
    assert!(s.requests().is_empty());
}

#[tokio::test]
async fn fail_next_hits_matching_requests_only() {
    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    let api: Api<ResourceSlice> = Api::all(s.client());
    s.fail_next("POST", "resourceslices", 1, 500);
    // Other verbs are not affected.
    api.list(&ListParams::default()).await.unwrap();
    assert_eq!(
        code(
            api.create(&PostParams::default(), &slice("a", "n1", 1))
                .await
                .unwrap_err()
        ),
        500
    );
    api.create(&PostParams::default(), &slice("a", "n1", 1))
        .await
        .unwrap();
    assert_eq!(s.count("create", "resourceslices"), 2);

    // kube's client retries 503 by itself; the default client gets through after one failure.
    s.fail_next("get", "resourceslices", 1, 503);
    api.get("a").await.unwrap();
    assert_eq!(
        s.requests()
            .iter()
            .filter(|r| r.verb == "get" && r.status == 503)
            .count(),
        1
    );
    assert_eq!(s.count("get", "resourceslices"), 2);
}

#[tokio::test]
async fn unavailable_answers_503() {
    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    let api: Api<ResourceSlice> = Api::all(s.client_without_retry().unwrap());
    s.set_unavailable(true);
    assert_eq!(
        code(api.list(&ListParams::default()).await.unwrap_err()),
        503
    );
    s.set_unavailable(false);
    api.list(&ListParams::default()).await.unwrap();
}

#[tokio::test]
async fn latency_delays_requests() {
    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    let api: Api<ResourceSlice> = Api::all(s.client());
    api.list(&ListParams::default()).await.unwrap();
    s.set_latency(Duration::from_millis(200));
    let t = Instant::now();
    api.list(&ListParams::default()).await.unwrap();
    assert!(
        t.elapsed() >= Duration::from_millis(200),
        "{:?}",
        t.elapsed()
    );
}

#[tokio::test]
async fn shutdown_and_drop_stop_serving() {
    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    let client = s.client_without_retry().unwrap();
    let api: Api<ResourceSlice> = Api::all(client);
    api.list(&ListParams::default()).await.unwrap();
    let addr = s.addr();
    s.shutdown().await;
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "listener closed"
    );
    let res = tokio::time::timeout(Duration::from_secs(5), api.list(&ListParams::default()))
        .await
        .unwrap();
    assert!(res.is_err());

    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    let addr = s.addr();
    drop(s);
    tokio::task::yield_now().await;
    let mut closed = false;
    for _ in 0..50 {
        if tokio::net::TcpStream::connect(addr).await.is_err() {
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(closed, "listener closed after drop");
}

#[tokio::test]
async fn dropping_the_server_ends_open_watches() {
    use futures::StreamExt;
    use kube::api::WatchParams;
    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    let api: Api<ResourceSlice> = Api::all(s.client_without_retry().unwrap());
    let mut stream = api
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    s.put(&slice("a", "n1", 1)).unwrap();
    assert!(
        tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .unwrap()
            .is_some()
    );
    drop(s);
    // The stream ends (or errors) instead of hanging.
    loop {
        match tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .expect("watch ended after drop")
        {
            None | Some(Err(_)) => break,
            Some(Ok(_)) => {}
        }
    }
}
