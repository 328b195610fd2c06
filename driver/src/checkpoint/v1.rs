//! Checkpoint layout 1, where it differs from layout 2: a claim's sharing state held the whole
//! record of its MPS daemon (`sharing.mps`, an [`MpsRecord`]: spec, limits, pipe directory,
//! PID) where layout 2 names the daemon by its key (`sharing.mpsDaemon`). A layout-1 file
//! loads as layout 2, the record becoming its `spec.claimUid`; the daemon's own record,
//! `mps/<key>/daemon.json`, which layout 1 kept as well, is the one that counts.

use serde::Deserialize;
use serde_json::Value;

use super::CheckpointData;
use crate::sharing::{MpsRecord, SharingState, TimeSliceSetting};

/// A claim's sharing state as layout 1 wrote it.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SharingStateV1 {
    #[serde(default)]
    mps: Option<MpsRecord>,
    #[serde(default)]
    time_slicing: Vec<TimeSliceSetting>,
}

impl From<SharingStateV1> for SharingState {
    fn from(v1: SharingStateV1) -> Self {
        Self {
            mps_daemon: v1.mps.map(|r| r.spec.claim_uid),
            time_slicing: v1.time_slicing,
        }
    }
}

/// Decodes the `data` of a layout-1 file (its checksum already verified) as layout 2. A
/// sharing state that does not decode as layout 1 wrote it is left out with a warning, as
/// layout 1 itself did with one a later release wrote.
pub(super) fn upgrade(data: &str) -> Result<CheckpointData, serde_json::Error> {
    let mut value: Value = serde_json::from_str(data)?;
    if let Some(claims) = value.get_mut("claims").and_then(Value::as_object_mut) {
        for (uid, claim) in claims.iter_mut() {
            let Some(sharing) = claim.get_mut("sharing").filter(|s| !s.is_null()) else {
                continue;
            };
            *sharing = match serde_json::from_value::<SharingStateV1>(sharing.take()) {
                Ok(v1) => serde_json::to_value(SharingState::from(v1))?,
                Err(e) => {
                    tracing::warn!(claim = %uid, error = %e, "a layout-1 sharing state this release cannot read is left out");
                    Value::Null
                }
            };
        }
    }
    serde_json::from_value(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Layout 1's MPS record becomes the key of its daemon; time slices stay; a state that
    /// does not decode is left out, the claim kept.
    #[test]
    fn layout_1_sharing_states_load_as_layout_2() {
        let data = serde_json::json!({
            "bootId": "b",
            "claims": {
                "a": {"uid": "a", "state": "Prepared", "sharing": {"mps": {
                    "spec": {"claimUid": "a", "pipeDir": "/p", "logDir": "/l",
                             "visibleDevices": ["GPU-0"]},
                    "hostPipeDir": "/p", "activeThreadPercentage": 20,
                    "daemon": {"pid": 7, "startTime": 1, "bootId": "b"}}}},
                "t": {"uid": "t", "state": "Prepared", "sharing": {"timeSlicing": [
                    {"gpuUuid": "GPU-1", "interval": "Long"}]}},
                "n": {"uid": "n", "state": "PrepareStarted", "sharing": null},
                "x": {"uid": "x", "state": "Prepared", "sharing": {"mps": {"spec": 5}}}
            }
        });
        let got = upgrade(&data.to_string()).unwrap();
        let sharing = |uid: &str| got.claims[uid].sharing.clone();
        assert_eq!(
            sharing("a"),
            Some(SharingState {
                mps_daemon: Some("a".into()),
                time_slicing: Vec::new(),
            })
        );
        let t = sharing("t").unwrap();
        assert_eq!((t.mps_daemon, t.time_slicing.len()), (None, 1));
        assert_eq!(t.time_slicing[0].gpu_uuid, "GPU-1");
        assert_eq!(sharing("n"), None);
        assert_eq!(sharing("x"), None);
        assert_eq!(got.claims.len(), 4);
    }
}
