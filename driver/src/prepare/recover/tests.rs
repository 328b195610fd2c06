//! Unit tests of [`Recovery`] alone: over the recording fake backend (through [`MigOps`])
//! and a [`ClaimStore`] in a temporary directory, with no node driver, sharing or CDI.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};

use super::*;
use crate::backend::GpuBackend;
use crate::checkpoint::{CheckpointStore, DeviceKind, DeviceRecord};
use crate::model::{NodeInventory, Placement};
use crate::prepare::store::State;
use crate::prepare::testing::{
    Call, FakeBackend, NVML_INSUFFICIENT_RESOURCES, checkpoint_claim, gpu_uuid, inventory, mig_gpu,
};

const BOOT: &str = "boot-1";
/// A100 40GB profile 19 (`1g.5gb`) at slice `start`.
const P_1G: u32 = 19;
/// A100 40GB profile 9 (`3g.20gb`), placements 0 and 4.
const P_3G: u32 = 9;
const AT_4: Placement = Placement { start: 4, size: 4 };

fn at(start: u32) -> Placement {
    Placement { start, size: 1 }
}

/// The fake, with every create first reading the checkpoint file: what was durable at the
/// moment of each create.
struct Watched {
    fake: Arc<FakeBackend>,
    file: CheckpointStore,
    at_create: Mutex<Vec<CheckpointData>>,
}

impl GpuBackend for Watched {
    fn inventory(&self) -> Result<NodeInventory, BackendError> {
        self.fake.inventory()
    }

    fn create_mig(
        &self,
        gpu_uuid: &str,
        profile_id: u32,
        placement: Placement,
    ) -> Result<MigInstance, BackendError> {
        self.at_create
            .lock()
            .unwrap()
            .push(self.file.load().unwrap());
        self.fake.create_mig(gpu_uuid, profile_id, placement)
    }

    fn destroy_mig(&self, gpu_uuid: &str, gi_id: u32, ci_id: u32) -> Result<(), BackendError> {
        self.fake.destroy_mig(gpu_uuid, gi_id, ci_id)
    }

    fn list_mig(&self, gpu_uuid: &str) -> Result<Vec<MigInstance>, BackendError> {
        self.fake.list_mig(gpu_uuid)
    }
}

/// One A100 40GB with MIG on, the MIG operations over it and a claim store.
struct Rig {
    _dir: tempfile::TempDir,
    fake: Arc<FakeBackend>,
    watched: Arc<Watched>,
    mig: MigOps,
    claims: ClaimStore,
}

impl Rig {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let fake = Arc::new(FakeBackend::new(inventory(vec![mig_gpu(0)])));
        let watched = Arc::new(Watched {
            fake: fake.clone(),
            file: CheckpointStore::in_dir(dir.path()),
            at_create: Mutex::new(Vec::new()),
        });
        Self {
            mig: MigOps::new(watched.clone()),
            claims: ClaimStore::new(CheckpointStore::in_dir(dir.path()), State::empty()),
            _dir: dir,
            fake,
            watched,
        }
    }

    fn recovery(&self) -> Recovery<'_> {
        Recovery::new(&self.mig, &self.claims)
    }

    /// What the checkpoint file holds now (empty when never written).
    fn file(&self) -> CheckpointData {
        self.claims.load().unwrap()
    }

    /// What the file held at each create.
    fn at_create(&self) -> Vec<CheckpointData> {
        self.watched.at_create.lock().unwrap().clone()
    }

    /// An instance someone made, without a recorded call.
    fn add(&self, profile_id: u32, placement: Placement) -> MigInstance {
        self.fake
            .add_instance(&gpu_uuid(0), profile_id, placement)
            .unwrap()
    }

    fn lists(&self) -> usize {
        self.fake
            .calls()
            .iter()
            .filter(|c| matches!(c, Call::ListMig { .. }))
            .count()
    }
}

/// A MIG device of GPU 0 with profile `profile_id` at `placement`, cleave's or static, with
/// the IDs of `instance` when it is recorded as existing.
fn device(
    profile_id: u32,
    placement: Placement,
    ours: bool,
    instance: Option<&MigInstance>,
) -> DeviceRecord {
    let name = format!("gpu-0-mig-p{profile_id}-{}", placement.start);
    DeviceRecord {
        name,
        pool: "node-a".into(),
        request_names: vec!["r".into()],
        kind: DeviceKind::Mig,
        admin_access: false,
        gpu_uuid: gpu_uuid(0),
        gpu_minor: 0,
        mig: Some(MigRecord {
            profile_id,
            profile_name: format!("p{profile_id}"),
            placement,
            uuid: instance.map(|i| i.uuid.clone()),
            gi_id: instance.map(|i| i.gi_id),
            ci_id: instance.map(|i| i.ci_id),
            created_by_cleave: ours,
            creating_in_boot: None,
        }),
        config: None,
        cdi_device_ids: Vec::new(),
        share: None,
    }
}

fn claim(uid: &str, state: ClaimState, devices: Vec<DeviceRecord>) -> ClaimRecord {
    ClaimRecord {
        devices,
        ..checkpoint_claim(uid, state, None)
    }
}

fn data_of(claims: Vec<ClaimRecord>) -> CheckpointData {
    CheckpointData {
        boot_id: BOOT.into(),
        claims: claims.into_iter().map(|c| (c.uid.clone(), c)).collect(),
    }
}

fn mig(record: &ClaimRecord, i: usize) -> &MigRecord {
    record.devices[i].mig.as_ref().unwrap()
}

fn with_intent(mut device: DeviceRecord, boot: &str) -> DeviceRecord {
    device.mig.as_mut().unwrap().record_intent(boot);
    device
}

#[test]
fn a_reboot_forgets_every_id_and_intent_and_marks_prepared_claims() {
    let rig = Rig::new();
    let (i0, i1) = (rig.add(P_1G, at(0)), rig.add(P_1G, at(1)));
    let prepared = claim(
        "a",
        ClaimState::Prepared,
        vec![
            device(P_1G, at(0), true, Some(&i0)),
            device(P_1G, at(1), false, Some(&i1)),
        ],
    );
    let waiting = claim(
        "b",
        ClaimState::NeedsRecreate,
        vec![with_intent(device(P_1G, at(2), true, None), BOOT)],
    );
    let started = claim(
        "c",
        ClaimState::PrepareStarted,
        vec![
            device(P_1G, at(3), true, None),
            device(P_1G, at(1), false, Some(&i1)),
        ],
    );
    let mut data = data_of(vec![prepared, waiting, started.clone()]);
    rig.fake.clear_calls();

    rig.recovery().at_start(&mut data, "boot-2".into()).unwrap();

    assert!(rig.fake.calls().is_empty(), "a reboot lists nothing");
    for uid in ["a", "b"] {
        let r = &data.claims[uid];
        assert_eq!(r.state, ClaimState::NeedsRecreate, "{uid}");
        for d in &r.devices {
            let m = d.mig.as_ref().unwrap();
            assert_eq!((&m.uuid, m.gi_id, m.ci_id), (&None, None, None), "{uid}");
            assert!(!m.has_intent(), "{uid}");
        }
    }
    // The interrupted prepare keeps its state; its rollback destroys nothing of ours.
    let c = &data.claims["c"];
    assert_eq!(c.state, ClaimState::PrepareStarted);
    assert_eq!(c.devices[0].mig, None);
    assert_eq!(c.devices[1], started.devices[1]);
    // Stored with the new boot ID, before anything is created.
    assert_eq!(rig.file(), data);
    assert_eq!(rig.file().boot_id, "boot-2");
}

#[test]
fn the_first_start_of_a_checkpoint_without_a_boot_id_is_no_reboot() {
    let rig = Rig::new();
    let i0 = rig.add(P_1G, at(0));
    let mut data = data_of(vec![claim(
        "a",
        ClaimState::Prepared,
        vec![device(P_1G, at(0), true, Some(&i0))],
    )]);
    data.boot_id.clear();
    let before = data.claims.clone();
    rig.recovery().at_start(&mut data, BOOT.into()).unwrap();
    assert_eq!(data.claims, before);
    assert_eq!(rig.lists(), 1, "the recorded instances were checked");
    assert_eq!(rig.file().boot_id, BOOT);
}

#[test]
fn a_vanished_instance_marks_the_claim_and_forgets_only_that_instance() {
    let rig = Rig::new();
    let (i0, i1) = (rig.add(P_1G, at(0)), rig.add(P_1G, at(1)));
    let (i2, i3) = (rig.add(P_1G, at(2)), rig.add(P_1G, at(3)));
    let mut data = data_of(vec![
        claim(
            "a",
            ClaimState::Prepared,
            vec![
                device(P_1G, at(0), true, Some(&i0)),
                device(P_1G, at(1), true, Some(&i1)),
            ],
        ),
        claim(
            "b",
            ClaimState::Prepared,
            vec![
                device(P_1G, at(2), true, Some(&i2)),
                device(P_1G, at(3), false, Some(&i3)),
            ],
        ),
    ]);
    rig.fake
        .destroy_mig(&gpu_uuid(0), i1.gi_id, i1.ci_id)
        .unwrap();
    let b_before = data.claims["b"].clone();
    rig.fake.clear_calls();

    rig.recovery().mark_vanished(&mut data);

    let a = &data.claims["a"];
    assert_eq!(a.state, ClaimState::NeedsRecreate);
    assert_eq!(
        mig(a, 0).instance().map(|i| i.uuid),
        Some(i0.uuid.clone()),
        "the instance that exists keeps its IDs"
    );
    assert_eq!(mig(a, 1).instance(), None);
    assert_eq!((mig(a, 1).gi_id, mig(a, 1).ci_id), (None, None));
    assert!(!mig(a, 1).has_intent(), "no bare GPU instance was left");
    assert_eq!(data.claims["b"], b_before);
    assert!(rig.fake.mutations().is_empty());
    assert_eq!(rig.lists(), 1, "one list per GPU");
}

#[test]
fn a_kept_instance_is_kept() {
    let rig = Rig::new();
    let (i0, i4) = (rig.add(P_1G, at(0)), rig.add(P_3G, AT_4));
    let devices = vec![
        device(P_1G, at(0), true, Some(&i0)),
        device(P_3G, AT_4, false, Some(&i4)),
    ];
    let mut data = data_of(vec![claim("a", ClaimState::Prepared, devices.clone())]);
    let before = data.clone();
    rig.recovery().mark_vanished(&mut data);
    assert_eq!(data, before);

    // Recreating a claim whose instances all exist creates nothing and writes nothing.
    let mut data = data_of(vec![claim("a", ClaimState::NeedsRecreate, devices)]);
    let mut record = data.claims["a"].clone();
    rig.fake.clear_calls();
    rig.recovery()
        .recreate_migs(&mut record, &mut data)
        .unwrap();
    assert!(rig.fake.mutations().is_empty());
    assert_eq!(mig(&record, 0).instance().unwrap().uuid, i0.uuid);
    assert_eq!(mig(&record, 1).instance().unwrap().uuid, i4.uuid);
    assert_eq!(rig.file(), CheckpointData::default());
}

#[test]
fn an_instance_of_ours_is_created_again_where_recorded_after_its_intent_is_durable() {
    let rig = Rig::new();
    let mut data = data_of(vec![claim(
        "a",
        ClaimState::NeedsRecreate,
        vec![device(P_3G, AT_4, true, None)],
    )]);
    let mut record = data.claims["a"].clone();

    rig.recovery()
        .recreate_migs(&mut record, &mut data)
        .unwrap();

    assert_eq!(
        rig.fake.mutations(),
        [Call::CreateMig {
            gpu_uuid: gpu_uuid(0),
            profile_id: P_3G,
            placement: AT_4,
        }]
    );
    let at_create = rig.at_create();
    assert_eq!(at_create.len(), 1);
    let durable = mig(&at_create[0].claims["a"], 0);
    assert!(
        durable.intent_of(BOOT),
        "the intent was in the file before the create"
    );
    assert_eq!(durable.uuid, None);
    let created = rig.fake.instances(&gpu_uuid(0));
    assert_eq!(created.len(), 1);
    let ids = mig(&record, 0).instance().unwrap();
    assert_eq!(
        (ids.uuid.as_str(), ids.gi_id),
        (created[0].uuid.as_str(), created[0].gi_id)
    );
    assert!(!mig(&record, 0).has_intent());
    // Recorded at once, intent fulfilled.
    assert_eq!(rig.file().claims["a"], record);
    assert_eq!(data.claims["a"], record);
}

#[test]
fn an_instance_an_interrupted_recreation_of_this_boot_made_is_adopted() {
    let rig = Rig::new();
    let orphan = rig.add(P_3G, AT_4);
    let mut data = data_of(vec![claim(
        "a",
        ClaimState::NeedsRecreate,
        vec![with_intent(device(P_3G, AT_4, true, None), BOOT)],
    )]);
    let mut record = data.claims["a"].clone();
    rig.fake.clear_calls();

    rig.recovery()
        .recreate_migs(&mut record, &mut data)
        .unwrap();

    assert!(
        rig.fake.mutations().is_empty(),
        "adopted, not created again"
    );
    let ids = mig(&record, 0).instance().unwrap();
    assert_eq!(
        (ids.uuid, ids.gi_id, ids.ci_id),
        (orphan.uuid, orphan.gi_id, orphan.ci_id)
    );
    assert!(!mig(&record, 0).has_intent());
    assert_eq!(rig.file().claims["a"], record);
}

#[test]
fn an_instance_another_claim_records_is_never_adopted() {
    let rig = Rig::new();
    let theirs = rig.add(P_3G, AT_4);
    let mut data = data_of(vec![
        claim(
            "a",
            ClaimState::NeedsRecreate,
            vec![with_intent(device(P_3G, AT_4, true, None), BOOT)],
        ),
        claim(
            "b",
            ClaimState::Prepared,
            vec![device(P_3G, AT_4, false, Some(&theirs))],
        ),
    ]);
    let mut record = data.claims["a"].clone();
    rig.fake.clear_calls();

    let e = rig
        .recovery()
        .recreate_migs(&mut record, &mut data)
        .unwrap_err();

    assert!(matches!(e, PrepareError::MigRecreate { .. }), "{e}");
    assert_eq!(mig(&record, 0).uuid, None);
    assert_eq!(rig.fake.instances(&gpu_uuid(0)), [theirs]);
    assert_eq!(
        rig.fake.mutations(),
        [Call::CreateMig {
            gpu_uuid: gpu_uuid(0),
            profile_id: P_3G,
            placement: AT_4,
        }],
        "tried to create (refused at the taken placement), destroyed nothing"
    );
}

#[test]
fn an_instance_under_an_intent_of_another_boot_is_never_adopted() {
    let rig = Rig::new();
    let theirs = rig.add(P_3G, AT_4);
    let mut data = data_of(vec![claim(
        "a",
        ClaimState::NeedsRecreate,
        vec![with_intent(device(P_3G, AT_4, true, None), "boot-0")],
    )]);
    let mut record = data.claims["a"].clone();
    rig.fake.clear_calls();

    let e = rig
        .recovery()
        .recreate_migs(&mut record, &mut data)
        .unwrap_err();

    assert!(matches!(e, PrepareError::MigRecreate { .. }), "{e}");
    assert_eq!(mig(&record, 0).uuid, None);
    assert_eq!(rig.fake.instances(&gpu_uuid(0)), [theirs]);
    // This boot's intent was recorded before the create, and dropped when it failed.
    assert!(mig(&rig.at_create()[0].claims["a"], 0).intent_of(BOOT));
    assert!(!mig(&rig.file().claims["a"], 0).has_intent());
}

#[test]
fn a_static_instance_missing_fails_with_static_mig_missing_and_is_found_again() {
    let rig = Rig::new();
    // Someone else's instance of another profile elsewhere is not it.
    rig.add(P_1G, at(0));
    let mut data = data_of(vec![claim(
        "a",
        ClaimState::NeedsRecreate,
        vec![device(P_3G, AT_4, false, None)],
    )]);
    let mut record = data.claims["a"].clone();
    rig.fake.clear_calls();

    let e = rig
        .recovery()
        .recreate_migs(&mut record, &mut data)
        .unwrap_err();

    assert!(
        matches!(&e, PrepareError::StaticMigMissing { claim, device, placement, .. }
            if claim == "ns/a" && device == &record.devices[0].name && *placement == AT_4),
        "{e}"
    );
    assert!(
        rig.fake.mutations().is_empty(),
        "a static instance is never created"
    );

    // The administrator makes it again: it is found and recorded.
    let again = rig.add(P_3G, AT_4);
    rig.recovery()
        .recreate_migs(&mut record, &mut data)
        .unwrap();
    assert_eq!(mig(&record, 0).instance().unwrap().uuid, again.uuid);
    assert!(rig.fake.mutations().is_empty());
}

#[test]
fn a_failed_create_clears_the_intent_unless_it_left_a_bare_gpu_instance() {
    let rig = Rig::new();
    let mut data = data_of(vec![claim(
        "a",
        ClaimState::NeedsRecreate,
        vec![device(P_3G, AT_4, true, None)],
    )]);
    let mut record = data.claims["a"].clone();
    let insufficient = BackendError::Nvml {
        call: "nvmlDeviceCreateGpuInstanceWithPlacement",
        target: gpu_uuid(0),
        message: "Insufficient Resources".into(),
        code: NVML_INSUFFICIENT_RESOURCES,
    };
    rig.fake.fail_next_create(insufficient.clone());

    let e = rig
        .recovery()
        .recreate_migs(&mut record, &mut data)
        .unwrap_err();

    assert!(matches!(e, PrepareError::MigRecreate { .. }), "{e}");
    assert!(mig(&rig.at_create()[0].claims["a"], 0).intent_of(BOOT));
    assert!(!mig(&record, 0).has_intent());
    assert!(!mig(&data.claims["a"], 0).has_intent());
    assert!(!mig(&rig.file().claims["a"], 0).has_intent());

    // Our own rollback left the GPU instance bare: the intent stays, so that the next
    // attempt looks for it by placement and destroys it first.
    let mut record = data.claims["a"].clone();
    rig.fake.fail_next_create(BackendError::LeftBare {
        gi_id: Some(2),
        source: Box::new(insufficient),
    });
    rig.recovery()
        .recreate_migs(&mut record, &mut data)
        .unwrap_err();
    assert!(mig(&record, 0).intent_of(BOOT));
    assert!(mig(&rig.file().claims["a"], 0).intent_of(BOOT));
    assert!(rig.fake.instances(&gpu_uuid(0)).is_empty());
}
