//! Realistic documents, written as users and the API server write them (YAML), decoded the
//! way the driver sees them: raw JSON inside k8s-openapi objects.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use cleave_api::config::DeviceKey;
use cleave_api::names::{DRIVER_NAME, DeviceName};
use cleave_api::{
    ConfigSource, DeviceConfig, DeviceKind, SharingStrategy, TimeSliceInterval, decode_config,
    resolve_claim_configs,
};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use serde::Deserialize;

fn yaml<T: serde::de::DeserializeOwned>(text: &str) -> T {
    let value: serde_json::Value = serde_yaml::from_str(text).unwrap();
    serde_json::from_value(value).unwrap()
}

const ISSUE_EXAMPLE: &str = r#"
apiVersion: gpu.cleave.dev/v1alpha1
kind: GpuConfig
sharing:
  strategy: MPS
  mps:
    activeThreadPercentage: 25
    pinnedMemoryLimit:
      default: 10Gi
      perDevice:
        GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0: 20Gi
        "1": 5Gi
"#;

#[test]
fn issue_example_decodes_and_resolves_per_device_limits() {
    let raw: serde_json::Value = serde_yaml::from_str(ISSUE_EXAMPLE).unwrap();
    let c = decode_config(&raw).unwrap();
    let sharing = c.sharing_for(DeviceKind::Gpu).unwrap().unwrap();
    assert_eq!(sharing.strategy, SharingStrategy::Mps);
    let mps = sharing.mps.as_ref().unwrap();
    assert_eq!(mps.active_thread_percentage_or_default(), 25);
    let limits = mps.pinned_memory_limit.as_ref().unwrap();
    let gib = 1i64 << 30;
    let uuid = "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
    assert_eq!(limits.limit_for(uuid, 0).unwrap().value(), 20 * gib);
    assert_eq!(
        limits
            .limit_for("GPU-11111111-2222-3333-4444-555555555555", 1)
            .unwrap()
            .value(),
        5 * gib
    );
    assert_eq!(
        limits
            .limit_for("GPU-11111111-2222-3333-4444-555555555555", 2)
            .unwrap()
            .value(),
        10 * gib
    );
    // Serialising gives back the document (quantities as written).
    assert_eq!(serde_json::to_value(&c).unwrap(), raw);
}

#[test]
fn device_class_default_config_decodes() {
    let class: DeviceClass = yaml(
        r#"
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: mps.gpu.cleave.dev
spec:
  selectors:
    - cel:
        expression: device.driver == "gpu.cleave.dev" && device.attributes["gpu.cleave.dev"].type == "gpu"
  config:
    - opaque:
        driver: gpu.cleave.dev
        parameters:
          apiVersion: gpu.cleave.dev/v1alpha1
          kind: GpuConfig
          sharing:
            strategy: MPS
            mps:
              pinnedMemoryLimit:
                default: 1e9
"#,
    );
    let config = class.spec.config.unwrap();
    let c = decode_config(&config[0].opaque.as_ref().unwrap().parameters.0).unwrap();
    let mps = c.sharing().unwrap().mps.as_ref().unwrap();
    // Defaulted: the class did not say.
    assert_eq!(mps.active_thread_percentage, Some(100));
    // YAML `1e9` is a float in JSON; it is still exactly 10^9 bytes.
    let limit = mps
        .pinned_memory_limit
        .as_ref()
        .unwrap()
        .default
        .as_ref()
        .unwrap();
    assert_eq!(limit.value(), 1_000_000_000);
}

/// An allocated claim as the API server returns it: class config for one request, claim
/// config for all, a config of another driver, a prioritized-list request (`mig/small`).
const ALLOCATED_CLAIM: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: train
  namespace: team-a
  uid: 4c9f6b1e-8d2a-4f3b-9e7c-1a2b3c4d5e6f
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: mps.gpu.cleave.dev
      - name: mig
        firstAvailable:
          - name: small
            deviceClassName: mig.cleave.dev
      - name: nic
        exactly:
          deviceClassName: nic.example.com
    config:
      - requests: ["gpu"]
        opaque:
          driver: gpu.cleave.dev
          parameters:
            apiVersion: gpu.cleave.dev/v1alpha1
            kind: GpuConfig
            sharing:
              strategy: MPS
              mps:
                activeThreadPercentage: 50
      - requests: ["mig"]
        opaque:
          driver: gpu.cleave.dev
          parameters:
            apiVersion: gpu.cleave.dev/v1alpha1
            kind: MigConfig
            sharing:
              strategy: TimeSlicing
status:
  allocation:
    devices:
      results:
        - request: gpu
          driver: gpu.cleave.dev
          pool: node-1
          device: gpu-0
        - request: mig/small
          driver: gpu.cleave.dev
          pool: node-1
          device: gpu-1-mig-1g10gb-3
        - request: nic
          driver: nic.example.com
          pool: node-1
          device: eth1
      config:
        - source: FromClass
          requests: ["gpu"]
          opaque:
            driver: gpu.cleave.dev
            parameters:
              apiVersion: gpu.cleave.dev/v1alpha1
              kind: GpuConfig
              sharing:
                strategy: MPS
                mps:
                  activeThreadPercentage: 10
                  pinnedMemoryLimit:
                    default: 4Gi
        - source: FromClass
          requests: ["nic"]
          opaque:
            driver: nic.example.com
            parameters:
              mtu: 9000
        - source: FromClaim
          requests: ["gpu"]
          opaque:
            driver: gpu.cleave.dev
            parameters:
              apiVersion: gpu.cleave.dev/v1alpha1
              kind: GpuConfig
              sharing:
                strategy: MPS
                mps:
                  activeThreadPercentage: 50
        - source: FromClaim
          requests: ["mig"]
          opaque:
            driver: gpu.cleave.dev
            parameters:
              apiVersion: gpu.cleave.dev/v1alpha1
              kind: MigConfig
              sharing:
                strategy: TimeSlicing
"#;

#[test]
fn allocated_claim_resolves_per_request_and_per_device() {
    let claim: ResourceClaim = yaml(ALLOCATED_CLAIM);
    let resolved = resolve_claim_configs(&claim, DRIVER_NAME).unwrap();
    // Only this driver's requests, with their result names.
    assert_eq!(resolved.keys().collect::<Vec<_>>(), ["gpu", "mig/small"]);

    let gpu = resolved["gpu"].as_ref().unwrap();
    assert_eq!((gpu.index, gpu.source), (2, ConfigSource::FromClaim));
    // The claim's config replaces the class's as a whole: no pinned limit any more.
    let mps = gpu
        .sharing_for(DeviceKind::Gpu)
        .unwrap()
        .unwrap()
        .mps
        .clone()
        .unwrap();
    assert_eq!(mps.active_thread_percentage, Some(50));
    assert_eq!(mps.pinned_memory_limit, None);

    let mig = resolved["mig/small"].as_ref().unwrap();
    assert_eq!((mig.index, mig.source), (3, ConfigSource::FromClaim));
    // Each allocated device takes the config of its request, checked against its kind.
    for result in claim
        .status
        .as_ref()
        .unwrap()
        .allocation
        .as_ref()
        .unwrap()
        .devices
        .as_ref()
        .unwrap()
        .results
        .as_ref()
        .unwrap()
    {
        if result.driver != DRIVER_NAME {
            continue;
        }
        let device: DeviceName = result.device.parse().unwrap();
        let config = resolved[&result.request].as_ref().unwrap();
        let sharing = config
            .sharing_for(DeviceKind::from(&device))
            .unwrap()
            .unwrap();
        match &config.config {
            DeviceConfig::Gpu(_) => assert_eq!(sharing.strategy, SharingStrategy::Mps),
            DeviceConfig::Mig(_) => assert_eq!(
                sharing.time_slicing.as_ref().unwrap().interval,
                Some(TimeSliceInterval::Default)
            ),
        }
    }
    // The same GpuConfig on the MIG device would be refused, naming the entry.
    assert_eq!(
        gpu.sharing_for(DeviceKind::from(
            &"gpu-1-mig-1g10gb-3".parse::<DeviceName>().unwrap()
        ))
        .unwrap_err()
        .to_string(),
        "config entry 2 (FromClaim): GpuConfig cannot be applied to a MIG device"
    );
}

#[test]
fn bad_claim_config_names_entry_and_field() {
    let text = ALLOCATED_CLAIM.replace(
        "activeThreadPercentage: 50",
        "activeThreadPercentage: fifty",
    );
    let claim: ResourceClaim = yaml(&text);
    assert_eq!(
        resolve_claim_configs(&claim, DRIVER_NAME)
            .unwrap_err()
            .to_string(),
        "config entry 2 (FromClaim): sharing.mps.activeThreadPercentage: invalid type: string \"fifty\", expected u8"
    );
    let text = ALLOCATED_CLAIM.replace("                    default: 4Gi", "                    default: 4Gi\n                    perDevice:\n                      GPU-1: 1Gi");
    let claim: ResourceClaim = yaml(&text);
    assert_eq!(
        resolve_claim_configs(&claim, DRIVER_NAME)
            .unwrap_err()
            .to_string(),
        "config entry 0 (FromClass): sharing.mps.pinnedMemoryLimit.perDevice: invalid device key \"GPU-1\", expected GPU-<uuid>, MIG-<uuid> or a decimal index"
    );
    // Another driver's config is never decoded by us, however odd.
    let text = ALLOCATED_CLAIM.replace("mtu: 9000", "mtu: [9000]");
    let claim: ResourceClaim = yaml(&text);
    assert!(resolve_claim_configs(&claim, DRIVER_NAME).is_ok());
}

/// Documents of the shipped examples: every opaque config for this driver must decode.
#[test]
fn shipped_examples_decode() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deployments/examples");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        eprintln!("no examples at {}", dir.display());
        return;
    };
    let mut decoded = 0;
    for entry in entries {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value = serde_json::Value::deserialize(doc).unwrap();
            let configs = match value["kind"].as_str() {
                Some("ResourceClaim") => &value["spec"]["devices"]["config"],
                Some("ResourceClaimTemplate") => &value["spec"]["spec"]["devices"]["config"],
                Some("DeviceClass") => &value["spec"]["config"],
                _ => continue,
            };
            for c in configs.as_array().into_iter().flatten() {
                if c["opaque"]["driver"] == DRIVER_NAME {
                    decode_config(&c["opaque"]["parameters"])
                        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                    decoded += 1;
                }
            }
        }
    }
    eprintln!("decoded {decoded} example configs from {}", dir.display());
    assert!(decoded > 0, "no cleave configs found in {}", dir.display());
}

#[test]
fn device_keys_accept_nvml_uuid_forms() {
    // As `nvidia-smi -L` prints them.
    for key in [
        "GPU-5e3f8a2c-1b4d-4e6f-9a8b-7c6d5e4f3a2b",
        "MIG-a1b2c3d4-e5f6-5a7b-8c9d-0e1f2a3b4c5d",
    ] {
        assert!(
            matches!(DeviceKey::parse(key), Some(DeviceKey::Uuid(_))),
            "{key}"
        );
    }
}
