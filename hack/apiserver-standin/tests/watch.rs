//! Watch semantics with kube-runtime's `watcher` and raw `Api::watch`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use cleave_apiserver_standin::{StandIn, StandInOptions};
use common::slice;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, PostParams, WatchEvent, WatchParams};
use kube::runtime::watcher;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(5);

async fn start() -> StandIn {
    StandIn::start(StandInOptions {
        bookmark_interval: Duration::from_millis(100),
        ..Default::default()
    })
    .await
    .unwrap()
}

async fn next_event<S>(stream: &mut S) -> watcher::Event<ResourceSlice>
where
    S: futures::Stream<Item = Result<watcher::Event<ResourceSlice>, watcher::Error>> + Unpin,
{
    timeout(WAIT, stream.next())
        .await
        .expect("watch event in time")
        .unwrap()
        .unwrap()
}

fn name(obj: &ResourceSlice) -> &str {
    obj.metadata.name.as_deref().unwrap()
}

async fn watcher_sees_changes(cfg: watcher::Config) {
    let s = start().await;
    let api: Api<ResourceSlice> = Api::all(s.client());
    api.create(&PostParams::default(), &slice("before", "n1", 1))
        .await
        .unwrap();
    let mut stream = watcher(api.clone(), cfg).boxed();
    assert!(matches!(
        next_event(&mut stream).await,
        watcher::Event::Init
    ));
    match next_event(&mut stream).await {
        watcher::Event::InitApply(o) => assert_eq!(name(&o), "before"),
        other => panic!("expected InitApply, got {other:?}"),
    }
    assert!(matches!(
        next_event(&mut stream).await,
        watcher::Event::InitDone
    ));

    let created = api
        .create(&PostParams::default(), &slice("a", "n1", 1))
        .await
        .unwrap();
    match next_event(&mut stream).await {
        watcher::Event::Apply(o) => assert_eq!(
            o.metadata.resource_version,
            created.metadata.resource_version
        ),
        other => panic!("expected Apply(a), got {other:?}"),
    }
    let mut changed = created.clone();
    changed.spec.pool.generation = 7;
    api.replace("a", &PostParams::default(), &changed)
        .await
        .unwrap();
    match next_event(&mut stream).await {
        watcher::Event::Apply(o) => assert_eq!(o.spec.pool.generation, 7),
        other => panic!("expected Apply(modified), got {other:?}"),
    }
    // A foreign deletion through the store reaches the watcher.
    assert!(s.delete("resourceslices", "", "a").is_some());
    match next_event(&mut stream).await {
        watcher::Event::Delete(o) => assert_eq!(name(&o), "a"),
        other => panic!("expected Delete(a), got {other:?}"),
    }
    // And a foreign put.
    s.put(&slice("b", "n2", 1)).unwrap();
    match next_event(&mut stream).await {
        watcher::Event::Apply(o) => assert_eq!(name(&o), "b"),
        other => panic!("expected Apply(b), got {other:?}"),
    }
}

#[tokio::test]
async fn watcher_list_watch() {
    watcher_sees_changes(watcher::Config::default()).await;
}

#[tokio::test]
async fn watcher_streaming_list() {
    watcher_sees_changes(watcher::Config::default().streaming_lists()).await;
}

#[tokio::test]
async fn raw_watch_gets_bookmarks_and_field_selected_events() {
    let s = start().await;
    let api: Api<ResourceSlice> = Api::all(s.client());
    let rv = api
        .list(&Default::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let wp = WatchParams::default()
        .fields("spec.nodeName=n1")
        .timeout(30);
    let mut stream = api.watch(&wp, &rv).await.unwrap().boxed();
    api.create(&PostParams::default(), &slice("other", "n2", 1))
        .await
        .unwrap();
    api.create(&PostParams::default(), &slice("mine", "n1", 1))
        .await
        .unwrap();
    let mut saw_added = false;
    let mut bookmarks = 0;
    while !(saw_added && bookmarks >= 2) {
        match timeout(WAIT, stream.try_next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            WatchEvent::Added(o) => {
                assert_eq!(name(&o), "mine", "field selector must filter");
                saw_added = true;
            }
            WatchEvent::Bookmark(b) => {
                assert!(
                    b.metadata.resource_version.parse::<u64>().unwrap()
                        >= rv.parse::<u64>().unwrap()
                );
                bookmarks += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(
        s.requests()
            .iter()
            .any(|r| r.verb == "watch" && r.bytes_out > 0)
    );
}

#[tokio::test]
async fn watch_resumes_from_history_and_honours_timeout() {
    let s = start().await;
    let api: Api<ResourceSlice> = Api::all(s.client());
    let rv = s.resource_version().to_string();
    api.create(&PostParams::default(), &slice("a", "n1", 1))
        .await
        .unwrap();
    api.create(&PostParams::default(), &slice("b", "n1", 1))
        .await
        .unwrap();
    // Watching from an older rv replays what happened since.
    let wp = WatchParams::default().disable_bookmarks().timeout(1);
    let events: Vec<_> = timeout(
        WAIT,
        api.watch(&wp, &rv).await.unwrap().try_collect::<Vec<_>>(),
    )
    .await
    .expect("timeoutSeconds=1 ends the stream")
    .unwrap();
    let names: Vec<_> = events
        .iter()
        .map(|e| match e {
            WatchEvent::Added(o) => name(o).to_string(),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(names, ["a", "b"]);
}

#[tokio::test]
async fn expired_resource_version_gets_410() {
    let s = StandIn::start(StandInOptions {
        history_limit: 2,
        ..Default::default()
    })
    .await
    .unwrap();
    let api: Api<ResourceSlice> = Api::all(s.client());
    let rv = s.resource_version().to_string();
    for n in ["a", "b", "c", "d"] {
        api.create(&PostParams::default(), &slice(n, "n1", 1))
            .await
            .unwrap();
    }
    let mut stream = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    match timeout(WAIT, stream.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        WatchEvent::Error(e) => assert_eq!(e.code, 410),
        other => panic!("expected 410 ERROR, got {other:?}"),
    }
    // The watcher recovers by relisting.
    let mut w = watcher(api.clone(), watcher::Config::default()).boxed();
    let mut seen = 0;
    while seen < 4 {
        if let watcher::Event::InitApply(_) = next_event(&mut w).await {
            seen += 1;
        }
    }
}

#[tokio::test]
async fn wait_for_wakes_on_changes_and_times_out() {
    let s = start().await;
    let api: Api<ResourceSlice> = Api::all(s.client());
    let waiter = s.wait_for("resourceslices", WAIT, |items| items.len() == 2);
    let writer = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        api.create(&PostParams::default(), &slice("a", "n1", 1))
            .await
            .unwrap();
        api.create(&PostParams::default(), &slice("b", "n1", 1))
            .await
            .unwrap();
    };
    let (got, ()) = tokio::join!(waiter, writer);
    assert_eq!(got.unwrap().len(), 2);
    let t = std::time::Instant::now();
    let missed = s
        .wait_for("resourceslices", Duration::from_millis(100), |items| {
            items.len() == 3
        })
        .await;
    assert_eq!(missed.unwrap_err().len(), 2);
    assert!(t.elapsed() >= Duration::from_millis(100));
}

#[tokio::test]
async fn close_watches_resumes_and_expire_watches_forces_relist() {
    let s = start().await;
    let api: Api<ResourceSlice> = Api::all(s.client());
    s.put(&slice("a", "n1", 1)).unwrap();
    let mut w = watcher(api.clone(), watcher::Config::default()).boxed();
    let mut inits = 0;
    // An object put during a relist arrives as InitApply.
    let wait_for_apply = async |w: &mut _, want: &str, inits: &mut usize| loop {
        match next_event(w).await {
            watcher::Event::Apply(o) | watcher::Event::InitApply(o) if name(&o) == want => return,
            watcher::Event::Init => *inits += 1,
            _ => {}
        }
    };
    // Initial list.
    while !matches!(next_event(&mut w).await, watcher::Event::InitDone) {}
    // Closed streams are resumed without a relist. The watcher reconnects only when polled,
    // so "b" is stored while no watch is open: only a resume from the last resourceVersion
    // delivers it without an Init.
    s.close_watches();
    s.put(&slice("b", "n1", 1)).unwrap();
    wait_for_apply(&mut w, "b", &mut inits).await;
    assert_eq!(inits, 0, "resume must not relist");
    // Expired history forces a relist (Init again), and the new object still arrives.
    s.expire_watches();
    let mut saw_init = false;
    while !saw_init {
        match timeout(WAIT, w.next())
            .await
            .expect("event in time")
            .unwrap()
        {
            Ok(watcher::Event::Init) => saw_init = true,
            Ok(_) => {}
            Err(watcher::Error::WatchError(e)) => assert_eq!(e.code, 410),
            Err(e) => panic!("unexpected watcher error {e:?}"),
        }
    }
    s.put(&slice("c", "n1", 1)).unwrap();
    wait_for_apply(&mut w, "c", &mut inits).await;
}
