//! ResourceSlice validation over HTTP: 422 Invalid like the real API server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use cleave_apiserver_standin::{
    KubeVersion, StandIn, StandInOptions, validate_resource_slice_typed,
};
use common::{slice, slice_with_counters};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, PostParams};

fn api_status(e: kube::Error) -> kube::core::Status {
    match e {
        kube::Error::Api(s) => *s,
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn over_limit_slice_is_rejected_with_422() {
    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    let api: Api<ResourceSlice> = Api::all(s.client());
    let err = api_status(
        api.create(&PostParams::default(), &slice("big", "n1", 129))
            .await
            .unwrap_err(),
    );
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        err.message,
        "ResourceSlice.resource.k8s.io \"big\" is invalid: spec.devices: Too many: 129: must have at most 128 items"
    );
    let causes = err.details.unwrap().causes;
    assert_eq!(causes[0].field, "spec.devices");
    assert_eq!(causes[0].reason, "FieldValueTooMany");
    assert!(
        s.get("resourceslices", "", "big").is_none(),
        "nothing stored"
    );

    // 128 devices are fine, and so are 65 devices with counters in 1.34 mode.
    api.create(&PostParams::default(), &slice("ok", "n1", 128))
        .await
        .unwrap();
    api.create(
        &PostParams::default(),
        &slice_with_counters("ok2", "n1", 65),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn counters_limit_64_in_1_35_mode() {
    let s = StandIn::start(StandInOptions::with_version(KubeVersion::V1_35))
        .await
        .unwrap();
    let api: Api<ResourceSlice> = Api::all(s.client());
    // Devices consuming counters defined in another slice of the pool.
    let mut devices = slice_with_counters("devs", "n1", 65);
    let counters = devices.spec.shared_counters.take().unwrap();
    let err = api_status(
        api.create(&PostParams::default(), &devices)
            .await
            .unwrap_err(),
    );
    assert_eq!(err.code, 422);
    assert!(
        err.message
            .ends_with("spec.devices: Too many: 65: must have at most 64 items"),
        "{}",
        err.message
    );
    devices.spec.devices.as_mut().unwrap().truncate(64);
    api.create(&PostParams::default(), &devices).await.unwrap();

    // 1.35: a slice has devices or sharedCounters, not both.
    let both = slice_with_counters("both", "n1", 1);
    let err = api_status(api.create(&PostParams::default(), &both).await.unwrap_err());
    assert!(
        err.message
            .contains("only one of `sharedCounters` or `devices` is allowed"),
        "{}",
        err.message
    );

    let mut counter_slice = slice("counters", "n1", 0);
    counter_slice.spec.devices = None;
    counter_slice.spec.shared_counters = Some(counters);
    api.create(&PostParams::default(), &counter_slice)
        .await
        .unwrap();

    // Pool-level check over the stored slices (resourceSliceCount is 1 in the fixture).
    let errs = s.validate_pools(common::DRIVER, Some("n1")).unwrap_err();
    assert!(
        errs.iter()
            .any(|e| e.contains("resourceSliceCount is 1 but 2 slices exist")),
        "{errs:?}"
    );
}

#[tokio::test]
async fn immutable_fields_and_bad_names_on_update() {
    let s = StandIn::start(StandInOptions::default()).await.unwrap();
    let api: Api<ResourceSlice> = Api::all(s.client());
    let created = api
        .create(&PostParams::default(), &slice("a", "n1", 2))
        .await
        .unwrap();
    let mut moved = created.clone();
    moved.spec.node_name = Some("n2".into());
    let err = api_status(
        api.replace("a", &PostParams::default(), &moved)
            .await
            .unwrap_err(),
    );
    assert_eq!(err.code, 422);
    assert!(
        err.message
            .contains("spec.nodeName: Invalid value: \"n2\": field is immutable"),
        "{}",
        err.message
    );

    let mut bad = created.clone();
    bad.spec.devices.as_mut().unwrap()[1].name = "Bad_Name".into();
    let err = api_status(
        api.replace("a", &PostParams::default(), &bad)
            .await
            .unwrap_err(),
    );
    assert!(
        err.message.starts_with(
            "ResourceSlice.resource.k8s.io \"a\" is invalid: spec.devices[1].name: Invalid value: \"Bad_Name\": a lowercase RFC 1123 label"
        ),
        "{}",
        err.message
    );
    // Typed direct call agrees.
    assert!(validate_resource_slice_typed(&bad, KubeVersion::V1_34).is_err());
    assert!(validate_resource_slice_typed(&created, KubeVersion::V1_34).is_ok());
}

#[tokio::test]
async fn validation_can_be_turned_off() {
    let s = StandIn::start(StandInOptions {
        validate: false,
        ..Default::default()
    })
    .await
    .unwrap();
    let api: Api<ResourceSlice> = Api::all(s.client());
    api.create(&PostParams::default(), &slice("big", "n1", 200))
        .await
        .unwrap();
}
