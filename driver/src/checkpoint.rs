//! The checkpoint: the durable record of what this node prepared, for which claim.
//!
//! File `<state dir>/checkpoint.json` (state dir = `<plugins dir>/<driver name>`):
//!
//! ```text
//! {"version":2,"checksum":"sha256:<hex>","data":{ ... }}
//! ```
//!
//! The checksum covers the exact bytes of `data` as they were written, not a re-encoding of
//! the decoded value. A later release that adds a field writes it into `data` and checksums
//! what it wrote, and an older release verifies the same bytes and then ignores the field it
//! does not know; new fields are `#[serde(default)]` so a newer release reads an older file.
//! `version` changes only for incompatible layouts; a version this code does not know (0, or
//! above [`FORMAT_VERSION`]) is an error rather than a guess. Writes are atomic: temp file in
//! the same directory, fsync, rename, fsync of the directory.
//!
//! Layouts this release reads (it writes layout 2):
//! - **1**: a claim's sharing state held the whole record of its MPS daemon (`sharing.mps`:
//!   spec, limits, pipe directory, PID), a copy of the daemon's `daemon.json` that drifted
//!   from it when reconciliation restarted the daemon. It loads as layout 2 (the record
//!   becomes its daemon's key, `spec.claimUid`; `v1`); the next write is layout 2.
//! - **2**: the sharing state names the daemon by key only (`sharing.mpsDaemon`, the claim
//!   UID); the daemon's one record is `mps/<key>/daemon.json` ([`crate::sharing::mps`]).
//!   A release that reads only layout 1 refuses a layout-2 file as a newer layout
//!   ([`CheckpointError::UnsupportedVersion`]); docs/install.md says how to downgrade.
//!
//! Additions to the layouts since their first release (old files read unchanged): the claim
//! state `NeedsRecreate` (a prepared claim whose hardware state is gone after a reboot or a
//! vanished instance, see [`crate::prepare`]). A release from before it rejects a file that
//! holds a claim in that state as corrupt (unknown variant); such a claim exists only between
//! a reboot and a successful recreation, so a downgrade in that window needs that claim
//! unprepared first.
//! The MIG record field `creatingInBoot` (recreation intent, written only while an instance
//! is being recreated, omitted otherwise); older releases ignore it.
//! The device record field `share` (the share of a device a claim holds under consumable
//! capacity: the allocation's `shareID` and what it consumed; omitted for exclusive
//! devices). An older release ignores it and would take the share for an exclusive device,
//! so a downgrade needs the node's shares unprepared first.
//!
//! The device record's `config` (the effective config, as the config API encodes it) and the
//! claim's `sharing` (the sharing state the sharing seam defines) are decoded with the file
//! as typed values; their JSON is what the layout always held (`checkpoint_compat` decodes
//! the fixtures and encodes them back to the same value), only the order of their keys may
//! differ from what earlier releases wrote, which the checksum (over the bytes as written)
//! does not mind. A recorded config this release cannot decode (configs refuse unknown
//! fields, so one a later release wrote with a field this one does not know), or a sharing
//! state with a value it does not know, is left out with a warning and the rest of the file
//! loads, as earlier releases dropped that claim's sharing; the next write of the file then
//! no longer holds it. Unknown fields of the sharing state are ignored.
//!
//! Recovery from a damaged file (bad checksum, truncated, not JSON, unknown version): the
//! error names the path. Make sure no pod on the node still uses a claim of this driver (or
//! accept that their devices are unprepared by hand), then run
//! `cleave-kubelet-plugin checkpoint reset`, which moves the file aside (by hand:
//! `mv checkpoint.json checkpoint.json.corrupt`); the waiting plugin picks that up and starts
//! with no prepared claims. MIG instances cleave created for old claims then look like instances an
//! administrator made: remove them with `nvidia-smi mig -dci` / `-dgi` if they are not in use.

mod v1;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use cleave_api::merge::ResolvedConfig;

pub use crate::durable::{
    DEFAULT_BOOT_ID_PATH, read_boot_id, write_file_atomic, write_file_atomic_mode,
};
use crate::model::Placement;
pub use crate::sharing::ShareRecord;
use crate::sharing::SharingState;

/// File name of the checkpoint in the state directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.json";
/// Layout version written by this release (it reads 1 and 2; see the module docs).
pub const FORMAT_VERSION: u32 = 2;

/// How to recover from a damaged checkpoint; part of every corruption error.
pub const RECOVERY: &str = "to recover: make sure no pod on this node still uses a claim of this driver, then run `cleave-kubelet-plugin checkpoint reset` (it moves the file aside; by hand: mv checkpoint.json checkpoint.json.corrupt); the plugin picks that up and starts with no prepared claims, and MIG instances it created for old claims must be removed with nvidia-smi if unused";

/// A checkpoint failure, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading the file failed.
    #[error("reading checkpoint {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// The file is damaged: not JSON, truncated, or the checksum does not match.
    #[error("checkpoint {path} is corrupt: {reason}; {RECOVERY}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The file was written by a release with an incompatible layout.
    #[error(
        "checkpoint {path} has layout version {version}, this release reads up to {FORMAT_VERSION}; {RECOVERY}"
    )]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version found.
        version: u64,
    },
    /// Encoding the checkpoint failed (a bug).
    #[error("encoding checkpoint {path}: {source}")]
    Encode {
        /// The file.
        path: PathBuf,
        /// The serde error.
        source: serde_json::Error,
    },
    /// Writing the file failed.
    #[error("writing checkpoint {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
}

/// Everything the checkpoint records.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointData {
    /// Boot ID of the kernel when this was written; a different boot means all MIG instances,
    /// MPS daemons, time slices and CDI files of the records are gone (start then marks the
    /// prepared claims [`ClaimState::NeedsRecreate`] and recreates them).
    #[serde(default)]
    pub boot_id: String,
    /// Claims by UID.
    #[serde(default)]
    pub claims: BTreeMap<String, ClaimRecord>,
}

impl CheckpointData {
    /// UUIDs of the MIG instances the records hold, with `record` in place of the recorded
    /// claim of the same UID.
    pub(crate) fn mig_uuids_with(&self, record: &ClaimRecord) -> BTreeSet<String> {
        self.claims
            .values()
            .filter(|r| r.uid != record.uid)
            .chain(std::iter::once(record))
            .flat_map(|r| &r.devices)
            .filter_map(|d| d.mig.as_ref()?.uuid.clone())
            .collect()
    }
}

/// Where a claim is in its life on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClaimState {
    /// Prepare began and may have created MIG instances; not yet answered. Found at start,
    /// the claim is rolled back.
    PrepareStarted,
    /// Prepared and answered; stays until unprepare.
    Prepared,
    /// Prepared and answered once, but its hardware state (MIG instances, MPS daemon, time
    /// slices, CDI spec) is gone: the node rebooted, or an instance vanished. Start and every
    /// prepare of the claim recreate it at the recorded placements; until that succeeds,
    /// prepare fails. The MIG records of such a claim carry a UUID only for instances
    /// created (or found, for static ones) in the current boot. Written by releases that
    /// recreate after a reboot; older releases do not read a file holding this state.
    NeedsRecreate,
}

/// One claim prepared (or being prepared) on this node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimRecord {
    /// Claim UID.
    pub uid: String,
    /// Claim namespace.
    #[serde(default)]
    pub namespace: String,
    /// Claim name.
    #[serde(default)]
    pub name: String,
    /// Life-cycle state.
    pub state: ClaimState,
    /// The claim's devices on this node.
    #[serde(default)]
    pub devices: Vec<DeviceRecord>,
    /// State of the claim's sharing strategy (e.g. MPS daemon), owned by the sharing handler;
    /// `Some` (possibly empty) once sharing was applied.
    #[serde(
        default,
        deserialize_with = "lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub sharing: Option<SharingState>,
}

/// Kind of a prepared device (recorded as `gpu` / `mig`).
pub use cleave_api::DeviceKind;

/// One device of a claim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceRecord {
    /// Device name in the pool (`gpu-0`, `gpu-0-mig-1g10gb-3`).
    pub name: String,
    /// Pool the device belongs to.
    #[serde(default)]
    pub pool: String,
    /// Request names of the allocation results (`req` or `req/subrequest`).
    #[serde(default)]
    pub request_names: Vec<String>,
    /// Whole GPU or MIG device.
    pub kind: DeviceKind,
    /// Allocated with admin access (`adminAccess: true`, for monitoring): prepared beside the
    /// device's other claims, with no sharing applied and nothing created or destroyed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub admin_access: bool,
    /// UUID of the (parent) GPU.
    pub gpu_uuid: String,
    /// Minor number of the (parent) GPU.
    pub gpu_minor: u32,
    /// The MIG instance behind the device, for MIG devices and for whole GPUs served by a
    /// full-size instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigRecord>,
    /// Effective opaque config applied to the device (as the config API encodes it).
    #[serde(
        default,
        deserialize_with = "lenient",
        skip_serializing_if = "Option::is_none"
    )]
    pub config: Option<ResolvedConfig>,
    /// CDI device IDs handed to the kubelet.
    #[serde(default)]
    pub cdi_device_ids: Vec<String>,
    /// The share of the device this claim holds (consumable capacity); `None`: the claim has
    /// the device alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<ShareRecord>,
}

/// Decodes a typed value that a later release may have written in a shape this one cannot
/// read (a config field or a sharing strategy it does not know) as `None`, with a warning,
/// so that the rest of the checkpoint, every other claim included, still loads. What this
/// release does with such a claim is what it does with one that has no config or sharing
/// state: it serves and unprepares its devices and leaves that sharing alone.
fn lenient<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::de::DeserializeOwned,
{
    let value = Option::<serde_json::Value>::deserialize(deserializer)?;
    Ok(value.and_then(|v| match serde_json::from_value::<T>(v) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!(
                error = %e,
                value = std::any::type_name::<T>(),
                "a checkpoint value this release cannot read (written by a later release?) is left out"
            );
            None
        }
    }))
}

/// The MIG instance of a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigRecord {
    /// GPU-instance profile id.
    pub profile_id: u32,
    /// Profile name (`1g.10gb`).
    #[serde(default)]
    pub profile_name: String,
    /// Placement of the GPU instance.
    pub placement: Placement,
    /// `MIG-...` UUID once the instance exists.
    #[serde(default)]
    pub uuid: Option<String>,
    /// GPU instance id once the instance exists.
    #[serde(default)]
    pub gi_id: Option<u32>,
    /// Compute instance id once the instance exists.
    #[serde(default)]
    pub ci_id: Option<u32>,
    /// True if cleave created the instance for this claim (and destroys it at unprepare);
    /// false for instances that existed before (never destroyed by cleave).
    pub created_by_cleave: bool,
    /// Intent of a recreation: the boot ID in which cleave was about to create this instance
    /// again (written durably before the create, cleared once the new IDs are recorded). An
    /// instance found at exactly this profile and placement in that same boot, recorded for
    /// no other claim, is the one a crash left unrecorded (see [`crate::prepare`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creating_in_boot: Option<String>,
}

/// The IDs of a MIG instance a record holds as existing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceIds {
    /// `MIG-...` UUID.
    pub uuid: String,
    /// GPU instance id.
    pub gi_id: u32,
    /// Compute instance id.
    pub ci_id: u32,
}

/// Typed reading of the record's flags, so that callers ask what a record means (ours? an
/// intent of this boot? at this placement?) rather than compare its fields.
impl MigRecord {
    /// The instance recorded as existing: its UUID and both IDs, once it was created or
    /// found in the boot the checkpoint names; `None` before that, or once forgotten.
    pub fn instance(&self) -> Option<InstanceIds> {
        Some(InstanceIds {
            uuid: self.uuid.clone()?,
            gi_id: self.gi_id?,
            ci_id: self.ci_id?,
        })
    }

    /// Whether cleave created the instance for the claim: it destroys it at unprepare and
    /// creates it again after a reboot. A static instance (false) is never touched.
    pub(crate) fn is_cleaves(&self) -> bool {
        self.created_by_cleave
    }

    /// Whether an instance of profile `profile_id` at `placement` is at exactly the
    /// recorded profile and placement.
    pub(crate) fn is_at(&self, profile_id: u32, placement: Placement) -> bool {
        self.profile_id == profile_id && self.placement == placement
    }

    /// Whether a recreation intent of boot `boot` is recorded: an unrecorded instance at the
    /// recorded profile and placement in that boot may be the one a crash left.
    pub(crate) fn intent_of(&self, boot: &str) -> bool {
        self.creating_in_boot.as_deref() == Some(boot)
    }

    /// Whether a recreation intent of any boot is recorded.
    pub(crate) fn has_intent(&self) -> bool {
        self.creating_in_boot.is_some()
    }

    /// Records the intent to create the instance again in boot `boot`.
    pub(crate) fn record_intent(&mut self, boot: &str) {
        self.creating_in_boot = Some(boot.to_owned());
    }

    /// Drops the recreation intent.
    pub(crate) fn clear_intent(&mut self) {
        self.creating_in_boot = None;
    }

    /// Records `instance` as the device's instance; an intent is fulfilled by it.
    pub(crate) fn record_instance(&mut self, instance: &crate::model::MigInstance) {
        self.uuid = Some(instance.uuid.clone());
        self.gi_id = Some(instance.gi_id);
        self.ci_id = Some(instance.ci_id);
        self.creating_in_boot = None;
    }

    /// Forgets the instance's UUID and IDs (it is gone, or after a reboot they may name
    /// someone else's instance); the intent stays as it is.
    pub(crate) fn forget_instance(&mut self) {
        self.uuid = None;
        self.gi_id = None;
        self.ci_id = None;
    }
}

#[derive(Deserialize)]
struct Envelope<'a> {
    version: u64,
    checksum: String,
    #[serde(borrow)]
    data: &'a RawValue,
}

fn checksum(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Encodes `data` into the checkpoint file format.
pub fn encode(data: &CheckpointData) -> Result<Vec<u8>, serde_json::Error> {
    let body = serde_json::to_vec_pretty(data)?;
    Ok(wrap(&body))
}

/// Wraps already-encoded `data` bytes in the envelope with their checksum (also used by tests
/// to write files the way a newer release would).
pub fn wrap(data_bytes: &[u8]) -> Vec<u8> {
    let head = format!(
        "{{\"version\":{FORMAT_VERSION},\"checksum\":\"{}\",\"data\":",
        checksum(data_bytes)
    );
    let mut out = Vec::with_capacity(head.len() + data_bytes.len() + 2);
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(data_bytes);
    out.extend_from_slice(b"}\n");
    out
}

/// Decodes checkpoint file bytes; `path` is only used in errors.
pub fn decode(path: &Path, bytes: &[u8]) -> Result<CheckpointData, CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt {
        path: path.to_owned(),
        reason,
    };
    let envelope: Envelope<'_> =
        serde_json::from_slice(bytes).map_err(|e| corrupt(format!("not a checkpoint: {e}")))?;
    if envelope.version == 0 || envelope.version > u64::from(FORMAT_VERSION) {
        return Err(CheckpointError::UnsupportedVersion {
            path: path.to_owned(),
            version: envelope.version,
        });
    }
    let actual = checksum(envelope.data.get().as_bytes());
    if actual != envelope.checksum {
        return Err(corrupt(format!(
            "checksum mismatch: file says {}, data hashes to {actual}",
            envelope.checksum
        )));
    }
    let data = envelope.data.get();
    let decoded = match envelope.version {
        1 => v1::upgrade(data),
        _ => serde_json::from_str(data),
    };
    decoded.map_err(|e| corrupt(format!("data does not decode: {e}")))
}

/// Loads and stores the checkpoint file.
///
/// The file is read on every load (another plugin instance may have written it), but
/// decoded only when its bytes differ from the last ones this store read or wrote: prepare
/// re-reads it under the node lock on every call, and the decode with its checksum is most
/// of that cost.
#[derive(Debug)]
pub struct CheckpointStore {
    path: PathBuf,
    last: std::sync::Mutex<Option<(Vec<u8>, CheckpointData)>>,
}

impl Clone for CheckpointStore {
    fn clone(&self) -> Self {
        Self::at(self.path.clone())
    }
}

impl CheckpointStore {
    /// A store for `<state_dir>/checkpoint.json`.
    pub fn in_dir(state_dir: &Path) -> Self {
        Self::at(state_dir.join(CHECKPOINT_FILE))
    }

    fn at(path: PathBuf) -> Self {
        Self {
            path,
            last: std::sync::Mutex::new(None),
        }
    }

    fn remember(&self, bytes: Vec<u8>, data: &CheckpointData) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some((bytes, data.clone()));
    }

    /// The file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Loads the checkpoint; a missing file is an empty checkpoint.
    pub fn load(&self) -> Result<CheckpointData, CheckpointError> {
        match fs::read(&self.path) {
            Ok(bytes) => {
                if let Some((last, data)) = &*self.last.lock().unwrap_or_else(|p| p.into_inner())
                    && *last == bytes
                {
                    return Ok(data.clone());
                }
                let data = decode(&self.path, &bytes)?;
                self.remember(bytes, &data);
                Ok(data)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(CheckpointData::default()),
            Err(source) => Err(CheckpointError::Read {
                path: self.path.clone(),
                source,
            }),
        }
    }

    /// Stores the checkpoint durably, readable by root only (mode 0600).
    pub fn store(&self, data: &CheckpointData) -> Result<(), CheckpointError> {
        crate::timing::timed(crate::timing::step::CHECKPOINT_WRITE, || {
            self.store_untimed(data)
        })
    }

    fn store_untimed(&self, data: &CheckpointData) -> Result<(), CheckpointError> {
        let bytes = encode(data).map_err(|source| CheckpointError::Encode {
            path: self.path.clone(),
            source,
        })?;
        crate::fault::io_point("checkpoint.write")
            .and_then(|()| write_file_atomic_mode(&self.path, &bytes, 0o600))
            .map_err(|source| CheckpointError::Write {
                path: self.path.clone(),
                source,
            })?;
        self.remember(bytes, data);
        crate::fault::point("checkpoint.after_store");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mig_record_reads_as_what_it_means() {
        let mut m = MigRecord {
            profile_id: 19,
            profile_name: "1g.5gb".into(),
            placement: Placement { start: 3, size: 1 },
            uuid: None,
            gi_id: Some(9),
            ci_id: None,
            created_by_cleave: true,
            creating_in_boot: None,
        };
        assert!(m.is_cleaves());
        assert!(m.is_at(19, Placement { start: 3, size: 1 }));
        assert!(!m.is_at(19, Placement { start: 4, size: 1 }) && !m.is_at(20, m.placement));
        assert_eq!(m.instance(), None, "a bare GPU instance id is no instance");

        m.record_intent("boot-2");
        assert!(m.has_intent() && m.intent_of("boot-2") && !m.intent_of("boot-1"));
        let inst = crate::model::MigInstance {
            uuid: "MIG-x".into(),
            profile_id: 19,
            profile_name: "1g.5gb".into(),
            gi_id: 11,
            ci_id: 0,
            placement: m.placement,
        };
        m.record_instance(&inst);
        assert!(!m.has_intent(), "the instance fulfils the intent");
        assert_eq!(
            m.instance(),
            Some(InstanceIds {
                uuid: "MIG-x".into(),
                gi_id: 11,
                ci_id: 0
            })
        );

        m.record_intent("boot-2");
        m.forget_instance();
        assert_eq!((m.uuid.as_deref(), m.gi_id, m.ci_id), (None, None, None));
        assert!(
            m.intent_of("boot-2"),
            "forgetting the instance keeps the intent"
        );
        m.clear_intent();
        assert!(!m.has_intent());
    }

    /// Only a missing file is an empty checkpoint: a file that cannot be read is an error
    /// naming it, never a node with no claims (which would leak every prepared claim).
    #[test]
    fn an_unreadable_checkpoint_is_an_error_not_an_empty_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::in_dir(dir.path());
        assert_eq!(store.load().unwrap(), CheckpointData::default());
        // A directory where the file should be: the read fails with EISDIR.
        std::fs::create_dir(&store.path).unwrap();
        match store.load() {
            Err(CheckpointError::Read { path, .. }) => assert_eq!(path, store.path),
            other => panic!("expected a read error, got {other:?}"),
        }
    }

    #[test]
    fn load_decodes_only_changed_bytes_but_always_sees_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::in_dir(dir.path());
        let data = sample();
        store.store(&data).unwrap();
        // Same bytes: the remembered data, equal to a fresh decode.
        assert_eq!(store.load().unwrap(), data);
        assert_eq!(CheckpointStore::in_dir(dir.path()).load().unwrap(), data);
        // Another writer (another store on the same file) changes it: seen at once.
        let other = CheckpointStore::in_dir(dir.path());
        let mut changed = data.clone();
        changed.claims.clear();
        other.store(&changed).unwrap();
        assert_eq!(store.load().unwrap(), changed);
        // A corrupted file is an error, not the remembered data.
        std::fs::write(store.path(), b"{not json").unwrap();
        assert!(store.load().is_err());
        // Gone: empty, as before.
        std::fs::remove_file(store.path()).unwrap();
        assert_eq!(store.load().unwrap(), CheckpointData::default());
    }

    fn sample() -> CheckpointData {
        let mut claims = BTreeMap::new();
        claims.insert(
            "uid-1".to_owned(),
            ClaimRecord {
                uid: "uid-1".into(),
                namespace: "ns".into(),
                name: "claim".into(),
                state: ClaimState::Prepared,
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
                    config: None,
                    cdi_device_ids: vec![
                        "k8s.gpu.cleave.dev/claim=uid-1-gpu-0-mig-1g10gb-3".into(),
                    ],
                    share: None,
                }],
                sharing: None,
            },
        );
        CheckpointData {
            boot_id: "boot".into(),
            claims,
        }
    }

    #[test]
    fn round_trip_and_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::in_dir(dir.path());
        assert_eq!(store.load().unwrap(), CheckpointData::default());
        store.store(&sample()).unwrap();
        assert_eq!(store.load().unwrap(), sample());
        assert!(!dir.path().join(".checkpoint.json.tmp").exists());
    }

    #[test]
    fn damage_is_detected_with_path_and_recovery() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::in_dir(dir.path());
        store.store(&sample()).unwrap();
        let good = fs::read(store.path()).unwrap();
        let text = String::from_utf8(good.clone()).unwrap();

        let flipped = text.replace("\"claim\"", "\"clain\"").into_bytes();
        let truncated = good[..good.len() / 2].to_vec();
        let cases: [(&str, Vec<u8>); 3] = [
            ("checksum mismatch", flipped),
            ("not a checkpoint", truncated),
            ("not a checkpoint", b"garbage".to_vec()),
        ];
        for (want, bytes) in cases {
            fs::write(store.path(), &bytes).unwrap();
            let e = store.load().unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, CheckpointError::Corrupt { .. }), "{msg}");
            assert!(msg.contains(want), "{msg}");
            assert!(msg.contains(&store.path().display().to_string()), "{msg}");
            assert!(
                msg.contains("mv checkpoint.json checkpoint.json.corrupt"),
                "{msg}"
            );
        }

        // A later layout than this release writes: refused, although its checksum is right.
        let current = format!("\"version\":{FORMAT_VERSION}");
        assert!(text.starts_with(&format!("{{{current},")), "{text}");
        let later = FORMAT_VERSION + 1;
        let future = text.replacen(&current, &format!("\"version\":{later}"), 1);
        fs::write(store.path(), future).unwrap();
        let e = store.load().unwrap_err();
        assert!(
            matches!(e, CheckpointError::UnsupportedVersion { version, .. } if version == u64::from(later)),
            "{e}"
        );
        assert!(
            e.to_string().contains(&format!(
                "has layout version {later}, this release reads up to {FORMAT_VERSION}"
            )),
            "{e}"
        );
        // Version 0 never existed: refused as well, although its checksum is right.
        let zero = text.replacen(&current, "\"version\":0", 1);
        fs::write(store.path(), zero).unwrap();
        let e = store.load().unwrap_err();
        assert!(
            matches!(e, CheckpointError::UnsupportedVersion { version: 0, .. }),
            "{e}"
        );
    }

    #[test]
    fn checksum_covers_bytes_as_written_not_re_encoding() {
        // Same data, different formatting (as another serializer might write): still valid.
        let compact = serde_json::to_vec(&sample()).unwrap();
        let decoded = decode(Path::new("x"), &wrap(&compact)).unwrap();
        assert_eq!(decoded, sample());
    }

    proptest::proptest! {
        /// Any single changed byte of the file (up to the envelope's closing brace) is
        /// detected; the unchanged file decodes to what was encoded.
        #[test]
        fn any_changed_byte_is_detected(
            boot in "[a-z0-9-]{0,36}",
            n_claims in 0usize..4,
            pos in 0usize..100_000,
            delta in 1u8..=255,
        ) {
            let mut data = sample();
            data.boot_id = boot;
            let template = data.claims["uid-1"].clone();
            data.claims.clear();
            for i in 0..n_claims {
                let mut c = template.clone();
                c.uid = format!("uid-{i}");
                if i % 2 == 1 {
                    c.state = ClaimState::PrepareStarted;
                }
                data.claims.insert(c.uid.clone(), c);
            }
            let bytes = encode(&data).unwrap();
            proptest::prop_assert_eq!(decode(Path::new("x"), &bytes).unwrap(), data);
            let body_end = bytes.len() - 1; // the trailing newline is outside the envelope
            let mut damaged = bytes.clone();
            let i = pos % body_end;
            damaged[i] = damaged[i].wrapping_add(delta);
            proptest::prop_assert!(decode(Path::new("x"), &damaged).is_err());
        }
    }

    #[test]
    fn needs_recreate_round_trips_by_name() {
        let mut data = sample();
        if let Some(c) = data.claims.get_mut("uid-1") {
            c.state = ClaimState::NeedsRecreate;
        }
        let bytes = encode(&data).unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.contains("\"state\": \"NeedsRecreate\""), "{text}");
        assert_eq!(decode(Path::new("x"), &bytes).unwrap(), data);
    }

    #[test]
    fn write_atomic_fails_cleanly_in_missing_dir() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing/checkpoint.json");
        assert!(write_file_atomic(&path, b"x").is_err());
    }
}
