//! Builders for test objects (k8s-openapi types) that the stand-in or a test stores.

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult, DeviceClaim,
    DeviceRequest, DeviceRequestAllocationResult, ExactDeviceRequest, OpaqueDeviceConfiguration,
    ResourceClaim, ResourceClaimConsumerReference, ResourceClaimSpec, ResourceClaimStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;

/// An allocated ResourceClaim: one `exactly` request of class `device_class` per distinct
/// request name in `results` (`(request, device)` pairs, all in `driver`/`pool`), and
/// `status.allocation.devices` with those results and `configs`. `uid` is set in metadata
/// (the store keeps a given uid when the claim is stored with [`crate::StandIn::put`]).
pub fn resource_claim(
    namespace: &str,
    name: &str,
    uid: &str,
    driver: &str,
    pool: &str,
    results: &[(&str, &str)],
    configs: &[DeviceAllocationConfiguration],
) -> ResourceClaim {
    let mut requests: Vec<DeviceRequest> = Vec::new();
    for (request, _) in results {
        // "req/sub" results belong to request "req".
        let top = request.split('/').next().unwrap_or(request);
        if !requests.iter().any(|r| r.name == top) {
            requests.push(DeviceRequest {
                name: top.to_string(),
                exactly: Some(ExactDeviceRequest {
                    device_class_name: cleave_api::names::DEVICE_CLASS_GPU.to_string(),
                    allocation_mode: Some("ExactCount".into()),
                    count: Some(1),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
    }
    let results = results
        .iter()
        .map(|(request, device)| DeviceRequestAllocationResult {
            request: (*request).to_string(),
            driver: driver.to_string(),
            pool: pool.to_string(),
            device: (*device).to_string(),
            ..Default::default()
        })
        .collect();
    ResourceClaim {
        metadata: ObjectMeta {
            namespace: Some(namespace.to_string()),
            name: Some(name.to_string()),
            uid: Some(uid.to_string()),
            ..Default::default()
        },
        spec: ResourceClaimSpec {
            devices: Some(DeviceClaim {
                requests: Some(requests),
                ..Default::default()
            }),
        },
        status: Some(ResourceClaimStatus {
            allocation: Some(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(results),
                    config: (!configs.is_empty()).then(|| configs.to_vec()),
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
    }
}

/// An opaque allocation config entry (`source` is `FromClass` or `FromClaim`; empty
/// `requests` means all requests).
pub fn opaque_config(
    source: &str,
    requests: &[&str],
    driver: &str,
    parameters: serde_json::Value,
) -> DeviceAllocationConfiguration {
    DeviceAllocationConfiguration {
        source: source.to_string(),
        requests: (!requests.is_empty())
            .then(|| requests.iter().map(|r| (*r).to_string()).collect()),
        opaque: Some(OpaqueDeviceConfiguration {
            driver: driver.to_string(),
            parameters: RawExtension(parameters),
        }),
    }
}

/// Adds a pod to `status.reservedFor` of a claim.
pub fn reserve_for_pod(claim: &mut ResourceClaim, pod_name: &str, pod_uid: &str) {
    let status = claim.status.get_or_insert_with(Default::default);
    status
        .reserved_for
        .get_or_insert_with(Vec::new)
        .push(ResourceClaimConsumerReference {
            api_group: None,
            resource: "pods".into(),
            name: pod_name.to_string(),
            uid: pod_uid.to_string(),
        });
}

/// A Node with only a name (the store assigns its uid on create/put).
pub fn node(name: &str) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..Default::default()
        },
        ..Default::default()
    }
}
