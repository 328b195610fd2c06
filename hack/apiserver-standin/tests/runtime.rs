//! Detached servers, kubeconfig for child processes, metadata-only requests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use cleave_apiserver_standin::{StandIn, StandInOptions};
use common::slice;
use futures::StreamExt;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::PartialObjectMeta;
use kube::runtime::watcher;

#[test]
fn detached_server_serves_while_caller_blocks() {
    let s = StandIn::start_detached(StandInOptions::default()).unwrap();
    s.put(&slice("a", "n1", 1)).unwrap();
    // A separate runtime on this thread (as a test driving a child process would have).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let names = rt.block_on(async {
        let api: Api<ResourceSlice> = Api::all(s.client());
        api.list(&ListParams::default()).await.unwrap()
    });
    assert_eq!(names.items.len(), 1);
    // Blocking this thread does not stop the server: a request from another thread works.
    let url = s.url();
    let t = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let client = kube::Client::try_from(kube::Config::new(url.parse().unwrap())).unwrap();
            client.apiserver_version().await.unwrap().minor
        })
    });
    assert_eq!(t.join().unwrap(), "34");
    let addr = s.addr();
    drop(s);
    let mut closed = false;
    for _ in 0..50 {
        if std::net::TcpStream::connect(addr).is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(closed, "detached server stops on drop");
}

#[tokio::test]
async fn detached_server_can_start_inside_a_runtime() {
    let s = StandIn::start_detached(StandInOptions::default()).unwrap();
    let api: Api<ResourceSlice> = Api::all(s.client());
    api.create(&PostParams::default(), &slice("a", "n1", 1))
        .await
        .unwrap();
    assert!(s.get("resourceslices", "", "a").is_some());
    drop(s); // must not panic inside a runtime
}

#[tokio::test]
async fn kubeconfig_points_at_the_server() {
    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    s.write_kubeconfig(&path).unwrap();
    let kc = Kubeconfig::read_from(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    assert_eq!(config.default_namespace, "default");
    let client = kube::Client::try_from(config).unwrap();
    assert_eq!(
        client.apiserver_version().await.unwrap().git_version,
        "v1.34.1"
    );
}

#[tokio::test]
async fn metadata_only_get_list_and_watch() {
    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    let api: Api<ResourceSlice> = Api::all(s.client());
    let created = api
        .create(&PostParams::default(), &slice("a", "n1", 1))
        .await
        .unwrap();
    let meta = api.get_metadata("a").await.unwrap();
    assert_eq!(meta.metadata.uid, created.metadata.uid);
    let list = api.list_metadata(&ListParams::default()).await.unwrap();
    assert_eq!(list.items.len(), 1);
    let meta_api: Api<PartialObjectMeta<ResourceSlice>> = Api::all(s.client());
    let mut w = watcher(meta_api, watcher::Config::default()).boxed();
    let mut applied = 0;
    while applied < 1 {
        match tokio::time::timeout(Duration::from_secs(5), w.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            watcher::Event::InitApply(o) => {
                assert_eq!(o.metadata.name.as_deref(), Some("a"));
                applied += 1;
            }
            watcher::Event::Init | watcher::Event::InitDone => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    s.put(&slice("b", "n1", 1)).unwrap();
    loop {
        match tokio::time::timeout(Duration::from_secs(5), w.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            watcher::Event::Apply(o) => {
                assert_eq!(o.metadata.name.as_deref(), Some("b"));
                break;
            }
            watcher::Event::InitDone => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}
