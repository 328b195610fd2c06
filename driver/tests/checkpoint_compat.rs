//! Checkpoint compatibility: the v1 file committed in `tests/fixtures/checkpoint-v1.json`
//! must load in this and every later release, and a file from a newer release that added
//! fields must load here.
//!
//! The fixture was generated once by this code (`CLEAVE_REGENERATE_FIXTURES=1 cargo test -p
//! cleave-driver --test checkpoint_compat`); never regenerate it to make a failing test
//! pass: a failure means the release broke the previous release's checkpoint.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use cleave_api::config::{SharingStrategy, TimeSliceInterval};
use cleave_driver::checkpoint::{
    self, CheckpointData, CheckpointError, CheckpointStore, ClaimRecord, ClaimState, DeviceKind,
    DeviceRecord, MigRecord, ShareRecord,
};
use cleave_driver::model::Placement;
use cleave_driver::sharing::{
    DaemonHandle, DaemonPod, DaemonSpec, MpsRecord, PinnedLimit, SharingState, TimeSliceSetting,
};
use serde_json::json;

fn fixture_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoint-v1.json")
}

const GPU0: &str = "GPU-00000000-1111-4222-8333-444444444444";
const GPU1: &str = "GPU-00000001-1111-4222-8333-444444444444";
const WHOLE: &str = "0a4b2c1d-0000-4000-8000-00000000000a";
const ON_DEMAND: &str = "0b4b2c1d-0000-4000-8000-00000000000b";
const STATIC: &str = "0c4b2c1d-0000-4000-8000-00000000000c";
const STARTED: &str = "0d4b2c1d-0000-4000-8000-00000000000d";

/// What release 1 wrote: every kind of record it produces.
fn v1_data() -> CheckpointData {
    let cdi = |uid: &str, dev: &str| vec![format!("k8s.gpu.cleave.dev/claim={uid}-{dev}")];
    let mut claims = BTreeMap::new();
    claims.insert(
        WHOLE.to_owned(),
        ClaimRecord {
            uid: WHOLE.into(),
            namespace: "team-a".into(),
            name: "whole-gpu".into(),
            state: ClaimState::Prepared,
            devices: vec![DeviceRecord {
                name: "gpu-1".into(),
                pool: "node-a".into(),
                request_names: vec!["gpu".into()],
                kind: DeviceKind::Gpu,
                admin_access: false,
                gpu_uuid: GPU1.into(),
                gpu_minor: 1,
                mig: None,
                config: Some(
                    serde_json::from_value(json!({
                        "index": 0,
                        "source": "FromClass",
                        "config": {"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
                                   "sharing": {"strategy": "TimeSlicing",
                                               "timeSlicing": {"interval": "Default"}}}
                    }))
                    .unwrap(),
                ),
                cdi_device_ids: cdi(WHOLE, "gpu-1"),
                share: None,
            }],
            sharing: Some(SharingState::default()),
        },
    );
    claims.insert(
        ON_DEMAND.to_owned(),
        ClaimRecord {
            uid: ON_DEMAND.into(),
            namespace: "team-b".into(),
            name: "mig-slice".into(),
            state: ClaimState::Prepared,
            devices: vec![DeviceRecord {
                name: "gpu-0-mig-1g10gb-3".into(),
                pool: "node-a".into(),
                request_names: vec!["mig/small".into()],
                kind: DeviceKind::Mig,
                admin_access: false,
                gpu_uuid: GPU0.into(),
                gpu_minor: 0,
                mig: Some(MigRecord {
                    profile_id: 19,
                    profile_name: "1g.10gb".into(),
                    placement: Placement { start: 3, size: 1 },
                    uuid: Some("MIG-5c8a3f11-2d4e-4b6a-9c0d-1e2f3a4b5c6d".into()),
                    gi_id: Some(10),
                    ci_id: Some(0),
                    created_by_cleave: true,
                    creating_in_boot: None,
                }),
                config: None,
                cdi_device_ids: cdi(ON_DEMAND, "gpu-0-mig-1g10gb-3"),
                share: None,
            }],
            sharing: None,
        },
    );
    claims.insert(
        STATIC.to_owned(),
        ClaimRecord {
            uid: STATIC.into(),
            namespace: "team-b".into(),
            name: "static-mig".into(),
            state: ClaimState::Prepared,
            devices: vec![DeviceRecord {
                name: "gpu-0-mig-3g40gb-4".into(),
                pool: "node-a".into(),
                request_names: vec!["mig".into()],
                kind: DeviceKind::Mig,
                admin_access: false,
                gpu_uuid: GPU0.into(),
                gpu_minor: 0,
                mig: Some(MigRecord {
                    profile_id: 9,
                    profile_name: "3g.40gb".into(),
                    placement: Placement { start: 4, size: 4 },
                    uuid: Some("MIG-6d9b4a22-3e5f-4c7b-8d1e-2f3a4b5c6d7e".into()),
                    gi_id: Some(2),
                    ci_id: Some(0),
                    created_by_cleave: false,
                    creating_in_boot: None,
                }),
                config: None,
                cdi_device_ids: cdi(STATIC, "gpu-0-mig-3g40gb-4"),
                share: None,
            }],
            sharing: None,
        },
    );
    claims.insert(
        STARTED.to_owned(),
        ClaimRecord {
            uid: STARTED.into(),
            namespace: "team-c".into(),
            name: "interrupted".into(),
            state: ClaimState::PrepareStarted,
            devices: vec![DeviceRecord {
                name: "gpu-0-mig-1g10gb-2".into(),
                pool: "node-a".into(),
                request_names: vec!["mig".into()],
                kind: DeviceKind::Mig,
                admin_access: false,
                gpu_uuid: GPU0.into(),
                gpu_minor: 0,
                mig: Some(MigRecord {
                    profile_id: 19,
                    profile_name: "1g.10gb".into(),
                    placement: Placement { start: 2, size: 1 },
                    uuid: None,
                    gi_id: None,
                    ci_id: None,
                    created_by_cleave: true,
                    creating_in_boot: None,
                }),
                config: None,
                cdi_device_ids: cdi(STARTED, "gpu-0-mig-1g10gb-2"),
                share: None,
            }],
            sharing: None,
        },
    );
    CheckpointData {
        boot_id: "3f0c6a5e-8d1b-4f7a-9e2c-5b4d3a2f1e0d".into(),
        claims,
    }
}

#[test]
fn v1_fixture_still_loads() {
    let path = fixture_path();
    if std::env::var_os("CLEAVE_REGENERATE_FIXTURES").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, checkpoint::encode(&v1_data()).unwrap()).unwrap();
    }
    let bytes = std::fs::read(&path).unwrap();
    let text = std::str::from_utf8(&bytes).unwrap();
    assert!(
        text.starts_with("{\"version\":1,\"checksum\":\"sha256:"),
        "{text}"
    );
    let data = checkpoint::decode(&path, &bytes).unwrap();

    // Asserted field by field (not by equality with v1_data()) so that fields added later
    // with defaults do not need this test to change.
    assert_eq!(data.boot_id, "3f0c6a5e-8d1b-4f7a-9e2c-5b4d3a2f1e0d");
    assert_eq!(data.claims.len(), 4);
    let whole = &data.claims[WHOLE];
    assert_eq!(
        (whole.namespace.as_str(), whole.name.as_str(), whole.state),
        ("team-a", "whole-gpu", ClaimState::Prepared)
    );
    let d = &whole.devices[0];
    assert_eq!(
        (d.name.as_str(), d.kind, d.gpu_minor),
        ("gpu-1", DeviceKind::Gpu, 1)
    );
    assert_eq!(d.gpu_uuid, GPU1);
    assert_eq!(d.mig, None);
    assert_eq!(
        d.config
            .as_ref()
            .unwrap()
            .config
            .sharing()
            .unwrap()
            .strategy,
        SharingStrategy::TimeSlicing
    );
    assert_eq!(
        d.cdi_device_ids,
        [format!("k8s.gpu.cleave.dev/claim={WHOLE}-gpu-1")]
    );
    assert_eq!(whole.sharing, Some(SharingState::default()));

    let od = &data.claims[ON_DEMAND].devices[0];
    assert_eq!(od.request_names, ["mig/small"]);
    let m = od.mig.as_ref().unwrap();
    assert!(m.created_by_cleave);
    assert_eq!(
        (
            m.profile_id,
            m.profile_name.as_str(),
            m.placement,
            m.gi_id,
            m.ci_id
        ),
        (
            19,
            "1g.10gb",
            Placement { start: 3, size: 1 },
            Some(10),
            Some(0)
        )
    );
    assert_eq!(
        m.uuid.as_deref(),
        Some("MIG-5c8a3f11-2d4e-4b6a-9c0d-1e2f3a4b5c6d")
    );

    let st = data.claims[STATIC].devices[0].mig.as_ref().unwrap();
    assert!(!st.created_by_cleave);
    assert_eq!(st.gi_id, Some(2));

    let started = &data.claims[STARTED];
    assert_eq!(started.state, ClaimState::PrepareStarted);
    let m = started.devices[0].mig.as_ref().unwrap();
    assert_eq!((m.uuid.as_ref(), m.gi_id), (None, None));
    assert_eq!(m.placement, Placement { start: 2, size: 1 });

    // And this release reads exactly what it wrote then.
    assert_eq!(data, v1_data());
}

#[test]
fn checkpoint_of_a_newer_release_with_extra_fields_loads() {
    let dir = tempfile::tempdir().unwrap();
    let store = CheckpointStore::in_dir(dir.path());
    let mut value = serde_json::to_value(v1_data()).unwrap();
    value["futureTopLevel"] = json!({"anything": [1, 2]});
    value["claims"][WHOLE]["futureClaimField"] = json!("x");
    value["claims"][WHOLE]["devices"][0]["futureDeviceField"] = json!(42);
    value["claims"][ON_DEMAND]["devices"][0]["mig"]["futureMigField"] = json!(true);
    // The newer release checksums the bytes it wrote; the format of those bytes is its own.
    let data_bytes = serde_json::to_vec(&value).unwrap();
    std::fs::write(store.path(), checkpoint::wrap(&data_bytes)).unwrap();
    assert_eq!(store.load().unwrap(), v1_data());
}

/// A config field or a sharing state shape this release does not know (a later release
/// wrote them) leaves that value out and loads everything else: the file is never refused
/// for it, as it was not before configs were typed.
#[test]
fn a_later_releases_config_or_sharing_state_is_left_out_not_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let store = CheckpointStore::in_dir(dir.path());
    let data = v1_data();
    let mut value = serde_json::to_value(&data).unwrap();
    let (with_config, device) = data
        .claims
        .iter()
        .find_map(|(uid, c)| {
            let i = c.devices.iter().position(|d| d.config.is_some())?;
            Some((uid.clone(), i))
        })
        .expect("a fixture claim with a config");
    let with_sharing = data
        .claims
        .iter()
        .find(|(_, c)| c.sharing.is_some())
        .map(|(uid, _)| uid.clone())
        .expect("a fixture claim with sharing state");
    value["claims"][&with_config]["devices"][device]["config"]["config"]["futureConfigField"] =
        json!(1);
    value["claims"][&with_sharing]["sharing"] = json!(["a", "later", "shape"]);
    let data_bytes = serde_json::to_vec(&value).unwrap();
    std::fs::write(store.path(), checkpoint::wrap(&data_bytes)).unwrap();

    let loaded = store.load().unwrap();
    let mut expected = data.clone();
    expected.claims.get_mut(&with_config).unwrap().devices[device].config = None;
    expected.claims.get_mut(&with_sharing).unwrap().sharing = None;
    assert_eq!(loaded, expected);
}

#[test]
fn fixture_with_a_flipped_byte_is_reported_corrupt() {
    let bytes = std::fs::read(fixture_path()).unwrap();
    let text = String::from_utf8(bytes).unwrap();
    let damaged = text.replacen("team-a", "team-b", 1);
    let e = checkpoint::decode(&fixture_path(), damaged.as_bytes()).unwrap_err();
    assert!(matches!(e, CheckpointError::Corrupt { .. }), "{e}");
    assert!(e.to_string().contains("checksum mismatch"), "{e}");
}

fn shares_fixture_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoint-v1-shares.json")
}

const SHARE_A: &str = "0e4b2c1d-0000-4000-8000-00000000000e";
const SHARE_B: &str = "0f4b2c1d-0000-4000-8000-00000000000f";

/// What the first release with shares (consumable capacity) writes: two claims holding
/// shares of one GPU.
fn shares_data() -> CheckpointData {
    let mut data = v1_data();
    for (uid, share, name) in [
        (SHARE_A, "5a000000-0000-4000-8000-00000000000a", "share-a"),
        (SHARE_B, "5b000000-0000-4000-8000-00000000000b", "share-b"),
    ] {
        data.claims.insert(
            uid.to_owned(),
            ClaimRecord {
                uid: uid.into(),
                namespace: "team-b".into(),
                name: name.into(),
                state: ClaimState::Prepared,
                devices: vec![DeviceRecord {
                    name: "gpu-0".into(),
                    pool: "node-a".into(),
                    request_names: vec!["gpu".into()],
                    kind: DeviceKind::Gpu,
                    admin_access: false,
                    gpu_uuid: GPU0.into(),
                    gpu_minor: 0,
                    mig: None,
                    config: None,
                    cdi_device_ids: vec![format!(
                        "k8s.gpu.cleave.dev/claim={uid}-gpu-0-share-{share}"
                    )],
                    share: Some(ShareRecord {
                        share_id: share.into(),
                        memory_bytes: Some(20 << 30),
                        multiprocessors: Some(44),
                        ..Default::default()
                    }),
                }],
                sharing: None,
            },
        );
    }
    data
}

#[test]
fn shares_fixture_still_loads_and_v1_records_have_no_share() {
    let path = shares_fixture_path();
    if std::env::var_os("CLEAVE_REGENERATE_FIXTURES").is_some() {
        std::fs::write(&path, checkpoint::encode(&shares_data()).unwrap()).unwrap();
    }
    let bytes = std::fs::read(&path).unwrap();
    let data = checkpoint::decode(&path, &bytes).unwrap();
    let d = &data.claims[SHARE_A].devices[0];
    let share = d.share.as_ref().unwrap();
    assert_eq!(share.share_id, "5a000000-0000-4000-8000-00000000000a");
    assert_eq!(
        (share.memory_bytes, share.multiprocessors),
        (Some(20 << 30), Some(44))
    );
    assert!(
        std::str::from_utf8(&bytes)
            .unwrap()
            .contains("\"shareID\": \"5b000000-0000-4000-8000-00000000000b\"")
    );
    // Records without a share (all of release 1's) stay exclusive, and write no field.
    assert!(data.claims[WHOLE].devices[0].share.is_none());
    let v1 = std::fs::read_to_string(fixture_path()).unwrap();
    assert!(!v1.contains("share"));
    assert_eq!(data, shares_data());
}

/// The typed claim state (effective configs, sharing state) encodes to exactly the JSON each
/// fixture holds: decoding a fixture and encoding it again gives the same `data` value. (Key
/// order may differ: the untyped fields were written in sorted order, the typed ones follow
/// their declarations; the checksum covers the bytes as written, so either order verifies.)
#[test]
fn fixtures_encode_back_to_the_same_json() {
    for path in [fixture_path(), shares_fixture_path()] {
        let bytes = std::fs::read(&path).unwrap();
        let data = checkpoint::decode(&path, &bytes).unwrap();
        let file: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            serde_json::to_value(&data).unwrap(),
            file["data"],
            "{}",
            path.display()
        );
    }
}

fn mps_fixture_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoint-v1-mps.json")
}

const MPS_PROCESS: &str = "1a4b2c1d-0000-4000-8000-00000000001a";
const MPS_POD: &str = "1b4b2c1d-0000-4000-8000-00000000001b";
const TIME_SLICED: &str = "1c4b2c1d-0000-4000-8000-00000000001c";
const MPS_STARTED: &str = "1d4b2c1d-0000-4000-8000-00000000001d";
const STATE_DIR: &str = "/var/lib/kubelet/plugins/gpu.cleave.dev";

/// The daemon record layout 1 kept in the checkpoint for a per-claim MPS claim.
fn v1_mps_record(
    uid: &str,
    pipe: &str,
    devices: &[&str],
    daemon: Option<DaemonHandle>,
) -> MpsRecord {
    MpsRecord {
        spec: DaemonSpec {
            claim_uid: uid.into(),
            pipe_dir: format!("/run/cleave/{pipe}").into(),
            log_dir: format!("{STATE_DIR}/mps/{uid}/log").into(),
            visible_devices: devices.iter().map(|d| (*d).to_owned()).collect(),
            multi_user: daemon.as_ref().is_some_and(|d| d.pod.is_some()),
        },
        host_pipe_dir: format!("/run/cleave/{pipe}").into(),
        active_thread_percentage: 25,
        pinned_limits: vec![PinnedLimit {
            ordinal: 0,
            uuid: devices[0].into(),
            limit: "10G".into(),
        }],
        exclusive_gpus: devices
            .iter()
            .filter(|d| d.starts_with("GPU-"))
            .map(|d| (*d).to_owned())
            .collect(),
        daemon,
    }
}

/// What a release writing layout 1 records for MPS and time-slicing claims: the whole daemon
/// record of a per-claim MPS claim (a host process, a daemon pod, one not started yet), and
/// the time slices of a time-sliced claim.
fn v1_mps_data() -> CheckpointData {
    let cdi = |uid: &str, dev: &str| vec![format!("k8s.gpu.cleave.dev/claim={uid}-{dev}")];
    let config = |sharing: serde_json::Value| {
        Some(
            serde_json::from_value(json!({
                "index": 0,
                "source": "FromClaim",
                "config": {"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
                           "sharing": sharing}
            }))
            .unwrap(),
        )
    };
    let mps_config = json!({"strategy": "MPS", "mps": {"activeThreadPercentage": 25,
                                                        "pinnedMemoryLimit": {"default": "10Gi"}}});
    let gpu =
        |name: &str, uuid: &str, minor: u32, sharing: serde_json::Value, uid: &str| DeviceRecord {
            name: name.into(),
            pool: "node-a".into(),
            request_names: vec!["gpu".into()],
            kind: DeviceKind::Gpu,
            admin_access: false,
            gpu_uuid: uuid.into(),
            gpu_minor: minor,
            mig: None,
            config: config(sharing),
            cdi_device_ids: cdi(uid, name),
            share: None,
        };
    let claim = |uid: &str, name: &str, state, device, sharing| ClaimRecord {
        uid: uid.into(),
        namespace: "team-d".into(),
        name: name.into(),
        state,
        devices: vec![device],
        sharing: Some(sharing),
    };
    let mut claims = BTreeMap::new();
    claims.insert(
        MPS_PROCESS.to_owned(),
        claim(
            MPS_PROCESS,
            "mps-process",
            ClaimState::Prepared,
            gpu("gpu-0", GPU0, 0, mps_config.clone(), MPS_PROCESS),
            SharingState {
                mps: Some(v1_mps_record(
                    MPS_PROCESS,
                    "3f9a0c1b2d4e5f60",
                    &[GPU0],
                    Some(DaemonHandle::process(
                        4242,
                        987_654,
                        "3f0c6a5e-8d1b-4f7a-9e2c-5b4d3a2f1e0d".into(),
                    )),
                )),
                time_slicing: Vec::new(),
            },
        ),
    );
    let mig = "MIG-7e0c5b33-4f60-4d8c-9e2f-3a4b5c6d7e8f";
    let mut pod_daemon = DaemonHandle::process(0, 0, "3f0c6a5e-8d1b-4f7a-9e2c-5b4d3a2f1e0d".into());
    pod_daemon.pod = Some(DaemonPod {
        namespace: "cleave-system".into(),
        name: "cleave-mps-1b4b2c1d".into(),
        uid: "9a8b7c6d-0000-4000-8000-000000000099".into(),
    });
    pod_daemon.shm_host_dir =
        Some("/var/lib/kubelet/pods/9a8b7c6d-0000-4000-8000-000000000099/volumes/kubernetes.io~empty-dir/shm".into());
    claims.insert(
        MPS_POD.to_owned(),
        ClaimRecord {
            uid: MPS_POD.into(),
            namespace: "team-d".into(),
            name: "mps-pod".into(),
            state: ClaimState::Prepared,
            devices: vec![DeviceRecord {
                name: "gpu-1-mig-1g10gb-6".into(),
                pool: "node-a".into(),
                request_names: vec!["mig".into()],
                kind: DeviceKind::Mig,
                admin_access: false,
                gpu_uuid: GPU1.into(),
                gpu_minor: 1,
                mig: Some(MigRecord {
                    profile_id: 19,
                    profile_name: "1g.10gb".into(),
                    placement: Placement { start: 6, size: 1 },
                    uuid: Some(mig.into()),
                    gi_id: Some(13),
                    ci_id: Some(0),
                    created_by_cleave: true,
                    creating_in_boot: None,
                }),
                config: config(mps_config.clone()),
                cdi_device_ids: cdi(MPS_POD, "gpu-1-mig-1g10gb-6"),
                share: None,
            }],
            sharing: Some(SharingState {
                mps: Some(v1_mps_record(
                    MPS_POD,
                    "8c7d6e5f4a3b2c1d",
                    &[mig],
                    Some(pod_daemon),
                )),
                time_slicing: Vec::new(),
            }),
        },
    );
    claims.insert(
        TIME_SLICED.to_owned(),
        claim(
            TIME_SLICED,
            "time-sliced",
            ClaimState::Prepared,
            gpu(
                "gpu-2",
                "GPU-00000002-1111-4222-8333-444444444444",
                2,
                json!({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}),
                TIME_SLICED,
            ),
            SharingState {
                mps: None,
                time_slicing: vec![TimeSliceSetting {
                    gpu_uuid: "GPU-00000002-1111-4222-8333-444444444444".into(),
                    interval: TimeSliceInterval::Long,
                }],
            },
        ),
    );
    claims.insert(
        MPS_STARTED.to_owned(),
        claim(
            MPS_STARTED,
            "mps-restarting",
            ClaimState::NeedsRecreate,
            gpu(
                "gpu-3",
                "GPU-00000003-1111-4222-8333-444444444444",
                3,
                mps_config,
                MPS_STARTED,
            ),
            SharingState {
                mps: Some(v1_mps_record(
                    MPS_STARTED,
                    "0123456789abcdef",
                    &["GPU-00000003-1111-4222-8333-444444444444"],
                    None,
                )),
                time_slicing: Vec::new(),
            },
        ),
    );
    CheckpointData {
        boot_id: "3f0c6a5e-8d1b-4f7a-9e2c-5b4d3a2f1e0d".into(),
        claims,
    }
}

#[test]
fn v1_mps_fixture_loads() {
    let path = mps_fixture_path();
    if std::env::var_os("CLEAVE_REGENERATE_FIXTURES").is_some() {
        std::fs::write(&path, checkpoint::encode(&v1_mps_data()).unwrap()).unwrap();
    }
    let bytes = std::fs::read(&path).unwrap();
    let data = checkpoint::decode(&path, &bytes).unwrap();
    assert_eq!(data, v1_mps_data());
}
