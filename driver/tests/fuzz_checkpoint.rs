//! Fuzzing what reaches the node from outside (proptest, bounded so CI stays fast):
//!
//! - the checkpoint loader: arbitrary bytes, damaged valid files, and arbitrary JSON in a
//!   correctly checksummed envelope (what a hand edit that recomputed the checksum makes):
//!   never a panic, every rejection names the file;
//! - names that reach file paths: claim UIDs (from the kubelet, the API server or a
//!   checkpoint) and device names, with `..`, `/`, NUL, very long and non-ASCII strings,
//!   never produce a path outside the CDI root or the MPS state directory; what is refused
//!   is refused with a message naming the bad value.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Component, Path};

use cleave_driver::cdi::{self, CdiDevice, CdiError, CdiStore, ContainerEdits};
use cleave_driver::checkpoint::{
    self, CheckpointData, CheckpointError, ClaimRecord, ClaimState, DeviceKind, DeviceRecord,
    MigRecord,
};
use cleave_driver::model::Placement;
use cleave_driver::sharing::{SharingBinaries, SharingConfig, SharingFailure, SharingManager};
use proptest::prelude::*;
use serde_json::{Value, json};

const PATH: &str = "/var/lib/kubelet/plugins/gpu.cleave.dev/checkpoint.json";

fn sample() -> CheckpointData {
    let mut claims = BTreeMap::new();
    for (i, state) in [ClaimState::Prepared, ClaimState::PrepareStarted]
        .into_iter()
        .enumerate()
    {
        let uid = format!("0000000{i}-0000-4000-8000-000000000000");
        claims.insert(
            uid.clone(),
            ClaimRecord {
                uid: uid.clone(),
                namespace: "ns".into(),
                name: format!("claim-{i}"),
                state,
                devices: vec![DeviceRecord {
                    name: "gpu-0-mig-1g10gb-3".into(),
                    pool: "node-a".into(),
                    request_names: vec!["mig".into()],
                    kind: DeviceKind::Mig,
                    admin_access: false,
                    gpu_uuid: "GPU-1".into(),
                    gpu_minor: 0,
                    mig: Some(MigRecord {
                        profile_id: 19,
                        profile_name: "1g.10gb".into(),
                        placement: Placement { start: 3, size: 1 },
                        uuid: Some("MIG-1".into()),
                        gi_id: Some(10),
                        ci_id: Some(0),
                        created_by_cleave: true,
                        creating_in_boot: None,
                    }),
                    config: Some(
                        serde_json::from_value(json!({"index": 0, "source": "FromClaim",
                            "config": {"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "MigConfig"}}))
                        .unwrap(),
                    ),
                    cdi_device_ids: vec![cdi::qualified_device_id(&uid, "gpu-0-mig-1g10gb-3")],
                    share: None,
                }],
                sharing: Some(Default::default()),
            },
        );
    }
    CheckpointData {
        boot_id: "boot".into(),
        claims,
    }
}

/// The loader's contract for any input: decoded data, or an error naming the file.
fn check_decode(bytes: &[u8]) -> Result<Option<CheckpointData>, TestCaseError> {
    match checkpoint::decode(Path::new(PATH), bytes) {
        Ok(data) => Ok(Some(data)),
        Err(e) => {
            let msg = e.to_string();
            prop_assert!(msg.contains(PATH), "{msg}");
            prop_assert!(
                matches!(
                    e,
                    CheckpointError::Corrupt { .. } | CheckpointError::UnsupportedVersion { .. }
                ),
                "{msg}"
            );
            prop_assert!(msg.contains("to recover"), "{msg}");
            Ok(None)
        }
    }
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        ".{0,16}".prop_map(Value::String),
        prop_oneof![
            Just("Prepared"),
            Just("PrepareStarted"),
            Just("NeedsRecreate"),
            Just("gpu"),
            Just("mig"),
            Just("../../etc/passwd"),
        ]
        .prop_map(|s| Value::String(s.into())),
    ];
    leaf.prop_recursive(5, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("claims".to_owned()),
                    Just("bootId".to_owned()),
                    Just("uid".to_owned()),
                    Just("state".to_owned()),
                    Just("devices".to_owned()),
                    Just("mig".to_owned()),
                    Just("placement".to_owned()),
                    "[a-zA-Z]{0,8}",
                ],
                inner,
                0..5
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Strings that try to leave a directory.
fn hostile_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("..".to_owned()),
        Just("../x".to_owned()),
        Just("a/../../b".to_owned()),
        Just("/etc/passwd".to_owned()),
        Just("a\0b".to_owned()),
        Just(String::new()),
        Just("-a".to_owned()),
        Just("x".repeat(64)),
        Just("x".repeat(5000)),
        Just("ünï-cødé".to_owned()),
        Just("A-UPPER".to_owned()),
        "[a-z0-9./-]{0,70}",
        ".{0,80}",
        "\\PC{0,20}",
    ]
}

/// `path` is `dir/<one normal component>`.
fn directly_under(path: &Path, dir: &Path) -> bool {
    path.parent() == Some(dir)
        && path
            .components()
            .skip(dir.components().count())
            .all(|c| matches!(c, Component::Normal(_)))
        && path.file_name().is_some_and(|n| !n.is_empty())
}

fn edits() -> ContainerEdits {
    ContainerEdits {
        env: vec!["CLEAVE_DEVICE_X_UUID=GPU-1".into()],
        ..ContainerEdits::default()
    }
}

fn manager(state: &Path) -> SharingManager {
    SharingManager::new(SharingConfig::new(
        state,
        SharingBinaries::under_driver_root(Path::new("/nonexistent")),
    ))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        check_decode(&bytes)?;
    }

    #[test]
    fn damaged_valid_files_are_refused_with_the_path(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let good = checkpoint::encode(&sample()).unwrap();
        let mut bytes = good.clone();
        for (i, b) in edits {
            let i = i.index(bytes.len());
            bytes[i] = b;
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.index(bytes.len()));
        }
        if let Some(data) = check_decode(&bytes)? {
            // Only a change that leaves the data bytes intact can be accepted (the envelope's
            // trailing newline, or an edit that wrote the same byte back).
            prop_assert_eq!(data, sample());
        }
    }

    #[test]
    fn checksummed_arbitrary_data_never_panics(data in any_json()) {
        let bytes = checkpoint::wrap(&serde_json::to_vec(&data).unwrap());
        check_decode(&bytes)?;
    }

    #[test]
    fn claim_uids_never_leave_the_cdi_root_or_mps_dir(uid in hostile_name()) {
        let root = Path::new("/var/run/cdi");
        let store = CdiStore::new(root, ContainerEdits::default());
        match store.spec_path(&uid) {
            Ok(path) => {
                prop_assert!(directly_under(&path, root), "{uid:?} -> {path:?}");
                prop_assert!(cdi::validate_claim_uid(&uid).is_ok());
                // The same UID names the claim's MPS directory, also one level down.
                let mps = Path::new("/state/mps");
                let m = manager(Path::new("/state"));
                let dir = m.claim_dir(&uid);
                prop_assert!(directly_under(&dir, mps), "{uid:?} -> {dir:?}");
            }
            Err(e) => {
                prop_assert!(matches!(e, CdiError::InvalidClaimUid { .. }), "{e}");
                prop_assert!(e.to_string().contains(&format!("{uid:?}")), "{e}");
                // Every writer refuses it before touching a file.
                let state = tempfile::tempdir().unwrap();
                let m = manager(state.path());
                let refused = m.release_claim(&uid, None, &[]).unwrap_err();
                prop_assert!(matches!(refused, SharingFailure::InvalidClaim(_)), "{refused}");
                prop_assert!(m.apply_claim(&uid, &[], &[]).is_err());
                prop_assert!(store.remove_claim_spec(&uid).is_err());
                prop_assert!(store.write_claim_spec(&uid, &[], &ContainerEdits::default()).is_err());
            }
        }
    }

    #[test]
    fn device_names_are_refused_unless_dns_labels(name in hostile_name()) {
        let store = CdiStore::new("/var/run/cdi", ContainerEdits::default());
        let device = CdiDevice { device_name: name.clone(), edits: edits() };
        let uid = "00000001-0000-4000-8000-000000000000";
        let result = store.render(uid, &[device], &ContainerEdits::default());
        if cdi::validate_device_name(&name).is_ok() {
            prop_assert!(result.is_ok(), "{name:?}: {:?}", result.err());
        } else {
            let e = result.unwrap_err();
            prop_assert!(matches!(e, CdiError::InvalidDeviceName { .. }), "{name:?}: {e}");
            prop_assert!(e.to_string().contains(&format!("{name:?}")), "{e}");
        }
    }
}

/// Valid UIDs and names really are accepted (so the properties above are not vacuous).
#[test]
fn valid_names_pass() {
    let store = CdiStore::new("/var/run/cdi", ContainerEdits::default());
    let uid = "6f1b2a4e-1c0d-4a8e-9f00-0123456789ab";
    assert_eq!(
        store.spec_path(uid).unwrap(),
        Path::new(
            "/var/run/cdi/k8s.gpu.cleave.dev-claim_6f1b2a4e-1c0d-4a8e-9f00-0123456789ab.json"
        )
    );
    let device = CdiDevice {
        device_name: "gpu-0-mig-1g10gb-3".into(),
        edits: edits(),
    };
    store
        .render(uid, &[device], &ContainerEdits::default())
        .unwrap();
    assert!(checkpoint::decode(Path::new(PATH), &checkpoint::encode(&sample()).unwrap()).is_ok());
}
