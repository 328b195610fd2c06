//! Read-only views of the checkpoint for the shell (metrics, status), so that nothing
//! outside `prepare` decodes the checkpoint file or the sharing state inside it.
//!
//! [`CheckpointReader`] reads the file by state directory without the node driver's lock
//! (the file is written atomically, so any read sees a whole version); the same summary
//! comes from [`NodeDriver::checkpoint_summary`]. A read error is the checkpoint's health:
//! it names the file and says what is wrong ([`CheckpointError`]). What an MPS daemon is now
//! (its PID, limits) is not in the checkpoint, which names it by key: it is read from the
//! daemon's own record through the sharing seam ([`crate::sharing::daemon_record`]).

use std::collections::BTreeMap;
use std::path::Path;

use super::NodeDriver;
use cleave_api::SharingStrategy;

use crate::checkpoint::{
    CheckpointData, CheckpointError, CheckpointStore, ClaimState, DeviceKind, MigRecord,
};
use crate::sharing::{Capacity, MpsRecord, SharingState, daemon_record, takes_whole_device};

/// Where a recorded claim is in its life on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordedState {
    /// Prepare began and is not answered (rolled back at the next start).
    PrepareStarted,
    /// Prepared and answered.
    Prepared,
    /// Prepared once; its hardware state is gone and waits to be recreated.
    NeedsRecreate,
}

/// One claim the checkpoint records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedClaim {
    /// Claim UID.
    pub uid: String,
    /// Claim namespace.
    pub namespace: String,
    /// Claim name.
    pub name: String,
    /// Its state.
    pub state: RecordedState,
    /// Its device names on this node, in allocation order.
    pub devices: Vec<String>,
    /// The sharing its recorded sharing state shows set up (an MPS daemon of its own, or
    /// time slices on whole GPUs); `None` when it has none, or a state this release does not
    /// read.
    pub sharing: Option<SharingStrategy>,
    /// Its devices held with admin access (prepared beside other claims, nothing applied).
    pub admin_access_devices: usize,
}

/// What the checkpoint records, by claim UID.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckpointSummary {
    /// The recorded claims, ordered by UID.
    pub claims: Vec<RecordedClaim>,
}

impl CheckpointSummary {
    /// MPS daemons of prepared claims: claims in state `Prepared` whose sharing state holds
    /// an MPS record (claims being prepared or waiting for recreation are not counted).
    pub fn mps_daemons(&self) -> usize {
        self.claims
            .iter()
            .filter(|c| {
                c.state == RecordedState::Prepared && c.sharing == Some(SharingStrategy::Mps)
            })
            .count()
    }

    /// Devices of prepared claims held with admin access.
    pub fn admin_access_devices(&self) -> usize {
        self.claims
            .iter()
            .filter(|c| c.state == RecordedState::Prepared)
            .map(|c| c.admin_access_devices)
            .sum()
    }
}

/// The summary of decoded checkpoint data.
pub(crate) fn summarize(data: &CheckpointData) -> CheckpointSummary {
    CheckpointSummary {
        claims: data
            .claims
            .values()
            .map(|r| RecordedClaim {
                uid: r.uid.clone(),
                namespace: r.namespace.clone(),
                name: r.name.clone(),
                state: match r.state {
                    ClaimState::PrepareStarted => RecordedState::PrepareStarted,
                    ClaimState::Prepared => RecordedState::Prepared,
                    ClaimState::NeedsRecreate => RecordedState::NeedsRecreate,
                },
                devices: r.devices.iter().map(|d| d.name.clone()).collect(),
                admin_access_devices: r.devices.iter().filter(|d| d.admin_access).count(),
                sharing: r.sharing.as_ref().and_then(SharingState::strategy),
            })
            .collect(),
    }
}

/// Reads the checkpoint of a state directory, read-only.
#[derive(Debug)]
pub struct CheckpointReader {
    store: CheckpointStore,
}

impl CheckpointReader {
    /// A reader of `<state_dir>/checkpoint.json`.
    pub fn in_dir(state_dir: &Path) -> Self {
        Self {
            store: CheckpointStore::in_dir(state_dir),
        }
    }

    /// Reads and verifies the file (decoding only when its bytes changed since the last
    /// read); a missing file is an empty checkpoint.
    pub fn summary(&self) -> Result<CheckpointSummary, CheckpointError> {
        self.store.load().map(|d| summarize(&d))
    }
}

impl NodeDriver {
    /// What the checkpoint file records now (read without the state lock, so it never
    /// waits for a prepare in flight), or why it cannot be read.
    pub fn checkpoint_summary(&self) -> Result<CheckpointSummary, CheckpointError> {
        self.claims.load().map(|d| summarize(&d))
    }

    /// What this driver's state records now, kept in memory (no file read): what the
    /// shell needs after a prepare or unprepare batch. Waits for a batch in flight.
    pub fn prepared_summary(&self) -> CheckpointSummary {
        summarize(&self.lock().data)
    }

    /// The devices of the claims prepared by this instance, as the usage sampler needs
    /// them: identity, hardware, what was given, and for MPS claims the host PID of their
    /// control daemon as its record says now (started as a host process; a daemon in a pod
    /// has no host PID here, so its activity stays not attributable). A capacity share
    /// carries its `shareID` and what it consumed. Reads the cached state, never the
    /// checkpoint file (the sampler calls this every round); only the daemon records of MPS
    /// claims are read.
    pub fn claim_devices(&self) -> Vec<crate::usage::ClaimDevice> {
        // The daemon records are read without the node lock, so that a prepare never
        // waits on them; a claim prepared in between is sampled without its daemon's PID
        // this round.
        let keys: Vec<String> = self
            .lock()
            .data
            .claims
            .values()
            .filter(|r| r.state == ClaimState::Prepared)
            .filter_map(|r| r.sharing.as_ref()?.mps_daemon.clone())
            .collect();
        let daemons = keys
            .into_iter()
            .filter_map(|key| Some((key.clone(), self.mps_daemon(&key)?)))
            .collect();
        let state = self.lock();
        claim_devices(
            &state.data,
            &daemons,
            &state.inventory,
            self.config.consumable_capacity,
        )
    }

    /// The record of the MPS daemon `key` as it is now (`mps/<key>/daemon.json` under the
    /// state directory); `None`, logged, when there is none or it cannot be read.
    pub(super) fn mps_daemon(&self, key: &str) -> Option<MpsRecord> {
        match daemon_record(&self.config.state_dir, key) {
            Ok(Some(record)) => Some(record),
            Ok(None) => {
                tracing::debug!(
                    daemon = key,
                    "MPS daemon named by the checkpoint has no record"
                );
                None
            }
            Err(e) => {
                tracing::debug!(daemon = key, error = %e, "reading the record of an MPS daemon");
                None
            }
        }
    }
}

/// [`NodeDriver::claim_devices`] over decoded data, the records of the daemons its MPS
/// claims name (by key) and an inventory.
pub(crate) fn claim_devices(
    data: &CheckpointData,
    daemons: &BTreeMap<String, MpsRecord>,
    inventory: &crate::model::NodeInventory,
    mode: cleave_api::pool::ConsumableCapacity,
) -> Vec<crate::usage::ClaimDevice> {
    use crate::model::MigState;
    use crate::usage::{Allocation, ClaimDevice, ClaimRef, Holding, MigRef};
    let mut out = Vec::new();
    for r in data
        .claims
        .values()
        .filter(|r| r.state == ClaimState::Prepared)
    {
        let mps = r.sharing.as_ref().and_then(|s| s.mps_daemon.as_deref());
        let pids: Vec<u32> = mps
            .and_then(|key| daemons.get(key)?.daemon.as_ref())
            .filter(|d| d.pod.is_none() && d.pid != 0)
            .map(|d| vec![d.pid])
            .unwrap_or_default();
        for d in &r.devices {
            let gpu = inventory.gpus.iter().find(|g| g.uuid == d.gpu_uuid);
            let mig = d
                .mig
                .as_ref()
                .and_then(MigRecord::instance)
                .map(|i| MigRef {
                    uuid: i.uuid,
                    gi: i.gi_id,
                    ci: i.ci_id,
                });
            let profile = d.mig.as_ref().and_then(|m| {
                let profiles = match &gpu?.mig {
                    MigState::Enabled { profiles, .. } | MigState::Disabled { profiles } => {
                        profiles
                    }
                    MigState::NotCapable => return None,
                };
                profiles.iter().find(|p| p.id == m.profile_id)
            });
            let is_mig = d.kind == DeviceKind::Mig;
            let allocated = match (is_mig, profile) {
                (true, Some(p)) => Allocation {
                    memory_bytes: p.memory_mib << 20,
                    sms: Some(p.multiprocessors),
                    mig_profile: Some(p.name.clone()),
                },
                (true, None) => Allocation {
                    memory_bytes: 0,
                    sms: None,
                    mig_profile: d.mig.as_ref().map(|m| m.profile_name.clone()),
                },
                (false, _) => Allocation {
                    memory_bytes: gpu.map_or(0, |g| g.memory_bytes),
                    sms: gpu.and_then(|g| g.multiprocessors),
                    mig_profile: None,
                },
            };
            let mut kind = match (mps.is_some(), is_mig) {
                (true, _) => Holding::Mps,
                (false, true) => Holding::Mig,
                (false, false) => Holding::Whole,
            };
            let mut sharing = r.sharing.as_ref().and_then(SharingState::strategy);
            let mut allocated = allocated;
            // A capacity share was given what it consumed. One that consumed the whole device
            // (a claim that asked for no capacity) is served like the device alone; the others
            // run beside other shares, whose processes NVML cannot tell apart per share.
            if let Some(share) = &d.share {
                let device = Capacity {
                    memory_bytes: Some(allocated.memory_bytes),
                    multiprocessors: allocated.sms,
                };
                let whole = takes_whole_device(Capacity::consumed_by(share), device);
                if let Some(m) = share.memory_bytes {
                    allocated.memory_bytes = m;
                }
                if share.multiprocessors.is_some() {
                    allocated.sms = share.multiprocessors;
                }
                if !whole {
                    kind = Holding::Share;
                    sharing = mode.sharing();
                }
            }
            out.push(ClaimDevice {
                claim: ClaimRef {
                    uid: r.uid.clone(),
                    namespace: r.namespace.clone(),
                    name: r.name.clone(),
                },
                device: d.name.clone(),
                kind,
                sharing,
                share_id: d.share.as_ref().map(|s| s.share_id.clone()),
                gpu_uuid: d.gpu_uuid.clone(),
                // A whole GPU served by a full-size instance is measured as that instance.
                mig,
                allocated,
                pids: if d.share.is_some() {
                    Vec::new()
                } else {
                    pids.clone()
                },
                pods: Vec::new(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prepare::testing::{
        checkpoint_claim, checkpoint_data, mps_record, mps_sharing_state,
    };
    use crate::sharing::TimeSliceSetting;

    #[test]
    fn claim_devices_of_prepared_claims_with_hardware_allocation_and_daemon_pid() {
        use crate::checkpoint::{DeviceRecord, MigRecord};
        use crate::prepare::testing::{gpu_uuid, inventory, mig_gpu, plain_gpu};
        use crate::usage::Holding;
        let device = |name: &str, minor: u32, mig: Option<MigRecord>| DeviceRecord {
            name: name.into(),
            pool: "node".into(),
            request_names: vec!["r".into()],
            kind: if mig.is_some() {
                DeviceKind::Mig
            } else {
                DeviceKind::Gpu
            },
            admin_access: false,
            gpu_uuid: gpu_uuid(minor),
            gpu_minor: minor,
            mig,
            config: None,
            cdi_device_ids: vec![],
            share: None,
        };
        let mut mig = checkpoint_claim("m", ClaimState::Prepared, None);
        mig.devices = vec![device(
            "gpu-0-mig-3g20gb-4",
            0,
            Some(MigRecord {
                profile_id: 9,
                profile_name: "3g.20gb".into(),
                placement: crate::model::Placement { start: 4, size: 4 },
                uuid: Some("MIG-x".into()),
                gi_id: Some(2),
                ci_id: Some(0),
                created_by_cleave: true,
                creating_in_boot: None,
            }),
        )];
        // The daemon's PID comes from its record, which the checkpoint names by key.
        let mut record = mps_record("p");
        record.daemon = Some(crate::sharing::DaemonHandle::process(
            4242,
            1,
            "boot".into(),
        ));
        let daemons = BTreeMap::from([("p".to_owned(), record)]);
        let mut mps = checkpoint_claim("p", ClaimState::Prepared, Some(mps_sharing_state("p")));
        mps.devices = vec![device("gpu-1", 1, None)];
        // Being prepared, or waiting for recreation: not sampled.
        let mut started = checkpoint_claim("s", ClaimState::PrepareStarted, None);
        started.devices = vec![device("gpu-1", 1, None)];
        let inv = inventory(vec![mig_gpu(0), plain_gpu(1)]);
        let data = checkpoint_data(vec![mig, mps, started]);
        let got = claim_devices(
            &data,
            &daemons,
            &inv,
            cleave_api::pool::ConsumableCapacity::Off,
        );
        assert_eq!(got.len(), 2, "{got:?}");
        let m = &got[0];
        assert_eq!(
            (m.claim.uid.as_str(), m.claim.namespace.as_str()),
            ("m", "ns")
        );
        assert_eq!(m.kind, Holding::Mig);
        assert_eq!(m.sharing, None);
        assert_eq!(m.device_uuid(), "MIG-x");
        assert_eq!(m.mig.as_ref().map(|x| (x.gi, x.ci)), Some((2, 0)));
        assert_eq!(m.allocated.memory_bytes, 19968 << 20);
        assert_eq!(m.allocated.sms, Some(42));
        assert_eq!(m.allocated.mig_profile.as_deref(), Some("3g.20gb"));
        let p = &got[1];
        assert_eq!(
            (p.kind, p.sharing),
            (Holding::Mps, Some(SharingStrategy::Mps))
        );
        assert_eq!(p.pids, [4242]);
        assert_eq!(p.allocated.memory_bytes, 24 << 30);
        assert_eq!(p.allocated.sms, Some(58));
        assert!(p.mig.is_none() && p.share_id.is_none());
        // No record of the daemon (or none readable): still an MPS claim, no PID to
        // attribute by.
        let got = claim_devices(
            &data,
            &BTreeMap::new(),
            &inv,
            cleave_api::pool::ConsumableCapacity::Off,
        );
        assert_eq!(
            (got[1].kind, got[1].pids.as_slice()),
            (Holding::Mps, &[][..])
        );

        // Capacity shares: given what they consumed; a share that consumed the whole device
        // (a claim that asked for no capacity) counts as the device alone.
        let share = |uid: &str, memory: u64, sms: u32| {
            let mut c = checkpoint_claim(uid, ClaimState::Prepared, None);
            let mut d = device("gpu-1", 1, None);
            d.share = Some(crate::checkpoint::ShareRecord {
                share_id: format!("share-{uid}"),
                memory_bytes: Some(memory),
                multiprocessors: Some(sms),
                ..Default::default()
            });
            c.devices = vec![d];
            c
        };
        let got = claim_devices(
            &checkpoint_data(vec![share("a", 10 << 30, 29), share("b", 24 << 30, 58)]),
            &BTreeMap::new(),
            &inv,
            cleave_api::pool::ConsumableCapacity::Mps,
        );
        assert_eq!(got.len(), 2, "{got:?}");
        let a = &got[0];
        assert_eq!(
            (a.kind, a.sharing),
            (Holding::Share, Some(SharingStrategy::Mps))
        );
        assert_eq!(a.share_id.as_deref(), Some("share-a"));
        assert_eq!(
            (a.allocated.memory_bytes, a.allocated.sms),
            (10 << 30, Some(29))
        );
        assert!(a.pids.is_empty());
        let b = &got[1];
        assert_eq!((b.kind, b.sharing), (Holding::Whole, None));
        assert_eq!(b.share_id.as_deref(), Some("share-b"));
    }

    #[test]
    fn mps_daemons_counts_prepared_claims_with_an_mps_record() {
        let d = checkpoint_data(vec![
            checkpoint_claim("a", ClaimState::Prepared, Some(mps_sharing_state("a"))),
            checkpoint_claim("b", ClaimState::Prepared, Some(mps_sharing_state("b"))),
            // Time-slicing only / no sharing: no daemon.
            checkpoint_claim("c", ClaimState::Prepared, Some(SharingState::default())),
            checkpoint_claim("d", ClaimState::Prepared, None),
            // Not prepared (rolled back at start) or waiting for recreation: not running.
            checkpoint_claim(
                "e",
                ClaimState::PrepareStarted,
                Some(mps_sharing_state("e")),
            ),
            checkpoint_claim("f", ClaimState::NeedsRecreate, Some(mps_sharing_state("f"))),
        ]);
        assert_eq!(summarize(&d).mps_daemons(), 2);
        assert_eq!(summarize(&CheckpointData::default()).mps_daemons(), 0);
    }

    #[test]
    fn summary_names_claims_states_devices_and_sharing() {
        let mut ts = checkpoint_claim(
            "t",
            ClaimState::NeedsRecreate,
            Some(SharingState {
                mps_daemon: None,
                time_slicing: vec![TimeSliceSetting {
                    gpu_uuid: "GPU-1".into(),
                    interval: cleave_api::config::TimeSliceInterval::Long,
                }],
            }),
        );
        ts.devices = [0, 1]
            .map(|minor| crate::checkpoint::DeviceRecord {
                name: format!("gpu-{minor}"),
                pool: "node".into(),
                request_names: vec!["gpu".into()],
                kind: DeviceKind::Gpu,
                admin_access: false,
                gpu_uuid: format!("GPU-{minor}"),
                gpu_minor: minor,
                mig: None,
                config: None,
                cdi_device_ids: vec![],
                share: None,
            })
            .to_vec();
        let s = summarize(&checkpoint_data(vec![
            checkpoint_claim("m", ClaimState::Prepared, Some(mps_sharing_state("m"))),
            ts,
            checkpoint_claim("n", ClaimState::PrepareStarted, None),
        ]));
        let got: Vec<_> = s
            .claims
            .iter()
            .map(|c| (c.uid.as_str(), c.state, c.devices.clone(), c.sharing))
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    "m",
                    RecordedState::Prepared,
                    vec![],
                    Some(SharingStrategy::Mps)
                ),
                ("n", RecordedState::PrepareStarted, vec![], None),
                (
                    "t",
                    RecordedState::NeedsRecreate,
                    vec!["gpu-0".to_owned(), "gpu-1".to_owned()],
                    Some(SharingStrategy::TimeSlicing)
                ),
            ]
        );
    }

    #[test]
    fn reader_sees_the_file_and_reports_damage_with_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let reader = CheckpointReader::in_dir(dir.path());
        assert_eq!(reader.summary().unwrap(), CheckpointSummary::default());
        let store = CheckpointStore::in_dir(dir.path());
        store
            .store(&checkpoint_data(vec![checkpoint_claim(
                "a",
                ClaimState::Prepared,
                Some(mps_sharing_state("a")),
            )]))
            .unwrap();
        assert_eq!(reader.summary().unwrap().mps_daemons(), 1);
        std::fs::write(store.path(), b"not a checkpoint").unwrap();
        let e = reader.summary().unwrap_err();
        assert!(matches!(e, CheckpointError::Corrupt { .. }), "{e}");
        assert!(
            e.to_string().contains(&store.path().display().to_string()),
            "{e}"
        );
    }
}
