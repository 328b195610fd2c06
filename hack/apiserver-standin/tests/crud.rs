//! CRUD, list, conflict and delete semantics through an unmodified `kube::Client`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use cleave_apiserver_standin::{KubeVersion, StandIn, StandInOptions, fixtures};
use common::{DRIVER, slice};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};

async fn start() -> StandIn {
    StandIn::start(StandInOptions::default()).await.unwrap()
}

fn api_status(e: kube::Error) -> kube::core::Status {
    match e {
        kube::Error::Api(s) => *s,
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn version_is_served() {
    let s = StandIn::start(StandInOptions::with_version(KubeVersion::V1_35))
        .await
        .unwrap();
    let info = s.client().apiserver_version().await.unwrap();
    assert_eq!((info.major.as_str(), info.minor.as_str()), ("1", "35"));
    assert_eq!(info.git_version, "v1.35.0");
    let d = start().await;
    assert_eq!(
        d.client().apiserver_version().await.unwrap().git_version,
        "v1.34.1"
    );
}

#[tokio::test]
async fn create_get_list_replace_delete_slice() {
    let s = start().await;
    let api: Api<ResourceSlice> = Api::all(s.client());
    let created = api
        .create(&PostParams::default(), &slice("a", "node-1", 2))
        .await
        .unwrap();
    let rv1: u64 = created
        .metadata
        .resource_version
        .clone()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        created
            .metadata
            .uid
            .as_deref()
            .is_some_and(|u| u.len() == 36)
    );
    assert!(created.metadata.creation_timestamp.is_some());
    assert_eq!(created.metadata.generation, Some(1));

    let got = api.get("a").await.unwrap();
    assert_eq!(got.metadata.uid, created.metadata.uid);
    assert_eq!(got.spec.devices.as_ref().unwrap().len(), 2);
    assert!(api.get_opt("missing").await.unwrap().is_none());

    let mut changed = got.clone();
    changed.spec.devices.as_mut().unwrap().pop();
    let replaced = api
        .replace("a", &PostParams::default(), &changed)
        .await
        .unwrap();
    let rv2: u64 = replaced
        .metadata
        .resource_version
        .clone()
        .unwrap()
        .parse()
        .unwrap();
    assert!(rv2 > rv1, "resourceVersion must grow: {rv1} -> {rv2}");
    assert_eq!(replaced.metadata.generation, Some(2));
    assert_eq!(replaced.metadata.uid, created.metadata.uid);

    // A no-op replace keeps the resourceVersion.
    let same = api
        .replace("a", &PostParams::default(), &replaced)
        .await
        .unwrap();
    assert_eq!(
        same.metadata.resource_version,
        replaced.metadata.resource_version
    );

    let list = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.items.len(), 1);
    assert!(
        list.metadata
            .resource_version
            .unwrap()
            .parse::<u64>()
            .unwrap()
            >= rv2
    );

    api.delete("a", &DeleteParams::default()).await.unwrap();
    assert!(api.get_opt("a").await.unwrap().is_none());
    let err = api_status(api.delete("a", &DeleteParams::default()).await.unwrap_err());
    assert_eq!((err.code, err.reason.as_str()), (404, "NotFound"));
    assert!(s.get("resourceslices", "", "a").is_none());
}

#[tokio::test]
async fn stale_resource_version_conflicts() {
    let s = start().await;
    let api: Api<ResourceSlice> = Api::all(s.client());
    let first = api
        .create(&PostParams::default(), &slice("a", "node-1", 1))
        .await
        .unwrap();
    let mut newer = first.clone();
    newer.spec.pool.generation = 2;
    api.replace("a", &PostParams::default(), &newer)
        .await
        .unwrap();
    let mut stale = first.clone();
    stale.spec.pool.generation = 3;
    let err = api_status(
        api.replace("a", &PostParams::default(), &stale)
            .await
            .unwrap_err(),
    );
    assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));
    assert!(
        err.message.contains("the object has been modified"),
        "{}",
        err.message
    );

    let dup = api_status(
        api.create(&PostParams::default(), &slice("a", "node-1", 1))
            .await
            .unwrap_err(),
    );
    assert_eq!((dup.code, dup.reason.as_str()), (409, "AlreadyExists"));

    // Delete preconditions.
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: first.metadata.resource_version.clone(),
            uid: None,
        }),
        ..Default::default()
    };
    let err = api_status(api.delete("a", &dp).await.unwrap_err());
    assert_eq!(err.code, 409);
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some("00000000-0000-4000-8000-000000000000".into()),
            resource_version: None,
        }),
        ..Default::default()
    };
    assert_eq!(
        api_status(api.delete("a", &dp).await.unwrap_err()).code,
        409
    );
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid: first.metadata.uid.clone(),
            resource_version: None,
        }),
        ..Default::default()
    };
    api.delete("a", &dp).await.unwrap();
}

#[tokio::test]
async fn generate_name_gets_suffix() {
    let s = start().await;
    let api: Api<ResourceSlice> = Api::all(s.client());
    let mut obj = slice("", "node-1", 1);
    obj.metadata.name = None;
    obj.metadata.generate_name = Some("node-1-gpu.cleave.dev-".into());
    let a = api.create(&PostParams::default(), &obj).await.unwrap();
    let b = api.create(&PostParams::default(), &obj).await.unwrap();
    let (na, nb) = (a.metadata.name.unwrap(), b.metadata.name.unwrap());
    assert_ne!(na, nb);
    let suffix = na.strip_prefix("node-1-gpu.cleave.dev-").unwrap();
    assert_eq!(suffix.len(), 5);
    assert!(
        suffix
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
    );
}

#[tokio::test]
async fn field_selector_list_and_deletecollection() {
    let s = start().await;
    let api: Api<ResourceSlice> = Api::all(s.client());
    for (name, node) in [("a", "n1"), ("b", "n1"), ("c", "n2")] {
        api.create(&PostParams::default(), &slice(name, node, 1))
            .await
            .unwrap();
    }
    let mut other = slice("d", "n1", 1);
    other.spec.driver = "other.example.com".into();
    api.create(&PostParams::default(), &other).await.unwrap();

    let names = |l: kube::core::ObjectList<ResourceSlice>| -> Vec<String> {
        l.items
            .into_iter()
            .map(|s| s.metadata.name.unwrap())
            .collect()
    };
    let n1 = api
        .list(&ListParams::default().fields("spec.nodeName=n1"))
        .await
        .unwrap();
    assert_eq!(names(n1), ["a", "b", "d"]);
    let sel = format!("spec.nodeName=n1,spec.driver={DRIVER}");
    let mine = api.list(&ListParams::default().fields(&sel)).await.unwrap();
    assert_eq!(names(mine), ["a", "b"]);

    // Pagination.
    let page = api.list(&ListParams::default().limit(3)).await.unwrap();
    assert_eq!(page.items.len(), 3);
    let token = page.metadata.continue_.clone().unwrap();
    let rest = api
        .list(&ListParams::default().limit(3).continue_token(&token))
        .await
        .unwrap();
    assert_eq!(names(rest), ["d"]);

    // As the kubelet wipes a node's slices of one driver.
    api.delete_collection(
        &DeleteParams::default(),
        &ListParams::default().fields(&sel),
    )
    .await
    .unwrap();
    let left = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(names(left), ["c", "d"]);
    assert_eq!(s.count("deletecollection", "resourceslices"), 1);
}

#[tokio::test]
async fn nodes_claims_and_store_access() {
    let s = start().await;
    let nodes: Api<Node> = Api::all(s.client());
    let node = nodes
        .create(&PostParams::default(), &fixtures::node("node-1"))
        .await
        .unwrap();
    let uid = node.metadata.uid.clone().unwrap();
    assert_eq!(
        nodes.get("node-1").await.unwrap().metadata.uid.unwrap(),
        uid
    );
    assert_eq!(
        s.get_as::<Node>("nodes", "", "node-1")
            .unwrap()
            .metadata
            .uid
            .unwrap(),
        uid
    );

    let claim = fixtures::resource_claim(
        "ns1",
        "claim-1",
        "11111111-2222-4333-8444-555555555555",
        DRIVER,
        "node-1",
        &[("gpu", "gpu-0")],
        &[fixtures::opaque_config(
            "FromClaim",
            &[],
            DRIVER,
            serde_json::json!({"kind": "GpuConfig"}),
        )],
    );
    s.put(&claim).unwrap();
    let claims: Api<ResourceClaim> = Api::namespaced(s.client(), "ns1");
    let got = claims.get("claim-1").await.unwrap();
    assert_eq!(
        got.metadata.uid.as_deref(),
        Some("11111111-2222-4333-8444-555555555555")
    );
    let results = got
        .status
        .unwrap()
        .allocation
        .unwrap()
        .devices
        .unwrap()
        .results
        .unwrap();
    assert_eq!(
        (results[0].request.as_str(), results[0].device.as_str()),
        ("gpu", "gpu-0")
    );
    let other_ns: Api<ResourceClaim> = Api::namespaced(s.client(), "ns2");
    assert!(other_ns.get_opt("claim-1").await.unwrap().is_none());
    let all: Api<ResourceClaim> = Api::all(s.client());
    assert_eq!(
        all.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );

    // Merge patch of the status subresource changes only status.
    let patch = serde_json::json!({"status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}});
    let patched = claims
        .patch_status("claim-1", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    assert_eq!(patched.status.unwrap().reserved_for.unwrap()[0].name, "p");

    // Creating a claim through the API drops its status, as the real server does.
    let mut fresh = claim.clone();
    fresh.metadata.name = Some("claim-2".into());
    fresh.metadata.uid = None;
    let created = claims.create(&PostParams::default(), &fresh).await.unwrap();
    assert!(created.status.is_none());

    assert!(s.delete("resourceclaims", "ns1", "claim-1").is_some());
    assert!(claims.get_opt("claim-1").await.unwrap().is_none());
    assert_eq!(s.list("resourceclaims").len(), 1);
}

#[tokio::test]
async fn events_can_be_posted_in_both_groups() {
    use k8s_openapi::api::core::v1::{Event, ObjectReference};
    let s = start().await;
    let events: Api<Event> = Api::namespaced(s.client(), "ns1");
    let ev = Event {
        metadata: kube::api::ObjectMeta {
            generate_name: Some("claim-1.".into()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            name: Some("claim-1".into()),
            ..Default::default()
        },
        reason: Some("Prepared".into()),
        ..Default::default()
    };
    events.create(&PostParams::default(), &ev).await.unwrap();
    assert_eq!(
        events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );

    let new_events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(s.client(), "ns1");
    let ev2 = k8s_openapi::api::events::v1::Event {
        metadata: kube::api::ObjectMeta {
            name: Some("e2".into()),
            ..Default::default()
        },
        reason: Some("Failed".into()),
        ..Default::default()
    };
    new_events
        .create(&PostParams::default(), &ev2)
        .await
        .unwrap();
    assert_eq!(s.list("events.events.k8s.io").len(), 1);
    assert_eq!(s.list("events").len(), 1);
}

/// With `DRAPartitionableDevices` off the stand-in drops counters on create and update, as
/// a gate-off API server does, without an error; a dry-run create shows the same and
/// stores nothing; turned on, counters are kept.
#[tokio::test]
async fn partitionable_devices_gate_off_drops_counters_and_dry_run_stores_nothing() {
    let s = StandIn::start(StandInOptions {
        partitionable_devices: false,
        ..StandInOptions::default()
    })
    .await
    .unwrap();
    let api: Api<ResourceSlice> = Api::all(s.client());
    let with = common::slice_with_counters("a", "node-a", 2);
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let shown = api.create(&dry, &with).await.unwrap();
    assert!(shown.spec.shared_counters.is_none());
    assert!(
        api.get_opt("a").await.unwrap().is_none(),
        "a dry run stores nothing"
    );
    assert_eq!(s.count_dry_runs("create", "resourceslices"), 1);
    let stored = api.create(&PostParams::default(), &with).await.unwrap();
    assert!(stored.spec.shared_counters.is_none());
    assert!(
        stored
            .spec
            .devices
            .iter()
            .flatten()
            .all(|d| d.consumes_counters.is_none())
    );
    s.set_partitionable_devices(true);
    let mut again = with.clone();
    again.metadata.resource_version = stored.metadata.resource_version.clone();
    let kept = api
        .replace("a", &PostParams::default(), &again)
        .await
        .unwrap();
    assert_eq!(kept.spec.shared_counters, with.spec.shared_counters);
    assert_eq!(s.count_dry_runs("create", "resourceslices"), 1);
}
