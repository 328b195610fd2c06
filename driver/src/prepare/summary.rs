//! Read-only views of the checkpoint for the shell (metrics, status), so that nothing
//! outside `prepare` decodes the checkpoint file or the sharing state inside it.
//!
//! [`CheckpointReader`] reads the file by state directory without the node driver's lock
//! (the file is written atomically, so any read sees a whole version); the same summary
//! comes from [`NodeDriver::checkpoint_summary`]. A read error is the checkpoint's health:
//! it names the file and says what is wrong ([`CheckpointError`]).

use std::path::Path;

use super::NodeDriver;
use crate::checkpoint::{CheckpointData, CheckpointError, CheckpointStore, ClaimState};
use crate::sharing::SharingState;

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

/// The sharing a recorded claim has set up, as its recorded sharing state says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharingKind {
    /// An MPS control daemon of its own.
    Mps,
    /// Time slices on whole GPUs.
    TimeSlicing,
    /// A sharing state without either (nothing applied, or a state this release does
    /// not read).
    Other,
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
    /// Its sharing set-up; `None` when it has no sharing.
    pub sharing: Option<SharingKind>,
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
            .filter(|c| c.state == RecordedState::Prepared && c.sharing == Some(SharingKind::Mps))
            .count()
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
                sharing: r.sharing.as_ref().map(|v| {
                    match serde_json::from_value::<SharingState>(v.clone()) {
                        Ok(s) if s.mps.is_some() => SharingKind::Mps,
                        Ok(s) if !s.time_slicing.is_empty() => SharingKind::TimeSlicing,
                        _ => SharingKind::Other,
                    }
                }),
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
        self.checkpoint.load().map(|d| summarize(&d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::ClaimRecord;
    use crate::sharing::{DaemonSpec, MpsRecord, TimeSliceSetting};

    fn mps_state(uid: &str) -> serde_json::Value {
        let record = MpsRecord {
            spec: DaemonSpec {
                claim_uid: uid.to_owned(),
                pipe_dir: "/state/mps/pipe".into(),
                log_dir: "/state/mps/log".into(),
                visible_devices: vec!["GPU-0".into()],
                multi_user: false,
            },
            host_pipe_dir: "/state/mps/pipe".into(),
            active_thread_percentage: 50,
            pinned_limits: Vec::new(),
            exclusive_gpus: Vec::new(),
            daemon: None,
        };
        serde_json::to_value(SharingState {
            mps: Some(record),
            time_slicing: Vec::new(),
        })
        .unwrap()
    }

    fn claim(uid: &str, state: ClaimState, sharing: Option<serde_json::Value>) -> ClaimRecord {
        ClaimRecord {
            uid: uid.to_owned(),
            namespace: "ns".into(),
            name: uid.to_owned(),
            state,
            devices: Vec::new(),
            sharing,
        }
    }

    fn data(claims: Vec<ClaimRecord>) -> CheckpointData {
        CheckpointData {
            boot_id: "boot".into(),
            claims: claims.into_iter().map(|c| (c.uid.clone(), c)).collect(),
        }
    }

    /// Moved from the plugin's metrics, with its assertions.
    #[test]
    fn mps_daemons_counts_prepared_claims_with_an_mps_record() {
        let d = data(vec![
            claim("a", ClaimState::Prepared, Some(mps_state("a"))),
            claim("b", ClaimState::Prepared, Some(mps_state("b"))),
            // Time-slicing only / no sharing: no daemon.
            claim(
                "c",
                ClaimState::Prepared,
                Some(serde_json::to_value(SharingState::default()).unwrap()),
            ),
            claim("d", ClaimState::Prepared, None),
            // Not prepared (rolled back at start) or waiting for recreation: not running.
            claim("e", ClaimState::PrepareStarted, Some(mps_state("e"))),
            claim("f", ClaimState::NeedsRecreate, Some(mps_state("f"))),
            // Unreadable sharing state: not counted.
            claim(
                "g",
                ClaimState::Prepared,
                Some(serde_json::json!({"mps": 7})),
            ),
        ]);
        assert_eq!(summarize(&d).mps_daemons(), 2);
        assert_eq!(summarize(&CheckpointData::default()).mps_daemons(), 0);
    }

    #[test]
    fn summary_names_claims_states_devices_and_sharing() {
        let mut ts = claim(
            "t",
            ClaimState::NeedsRecreate,
            Some(
                serde_json::to_value(SharingState {
                    mps: None,
                    time_slicing: vec![TimeSliceSetting {
                        gpu_uuid: "GPU-1".into(),
                        interval: cleave_api::config::TimeSliceInterval::Long,
                    }],
                })
                .unwrap(),
            ),
        );
        ts.devices = [0, 1]
            .map(|minor| crate::checkpoint::DeviceRecord {
                name: format!("gpu-{minor}"),
                pool: "node".into(),
                request_names: vec!["gpu".into()],
                kind: crate::checkpoint::DeviceKind::Gpu,
                gpu_uuid: format!("GPU-{minor}"),
                gpu_minor: minor,
                mig: None,
                config: None,
                cdi_device_ids: vec![],
                share: None,
            })
            .to_vec();
        let s = summarize(&data(vec![
            claim("m", ClaimState::Prepared, Some(mps_state("m"))),
            ts,
            claim("n", ClaimState::PrepareStarted, None),
        ]));
        let got: Vec<_> = s
            .claims
            .iter()
            .map(|c| (c.uid.as_str(), c.state, c.devices.clone(), c.sharing))
            .collect();
        assert_eq!(
            got,
            vec![
                ("m", RecordedState::Prepared, vec![], Some(SharingKind::Mps)),
                ("n", RecordedState::PrepareStarted, vec![], None),
                (
                    "t",
                    RecordedState::NeedsRecreate,
                    vec!["gpu-0".to_owned(), "gpu-1".to_owned()],
                    Some(SharingKind::TimeSlicing)
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
            .store(&data(vec![claim(
                "a",
                ClaimState::Prepared,
                Some(mps_state("a")),
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
