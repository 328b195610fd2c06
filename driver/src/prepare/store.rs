//! The claim store: the checkpoint file and the in-memory state it backs.
//!
//! [`ClaimStore`] owns the [`CheckpointStore`] and the lock over [`State`] (checkpoint data,
//! inventory, recreation errors). Its record operations write the file and keep the
//! in-memory map equal to it: when a write fails, the map is put back as it was, so memory
//! never holds a record the file lacks (or the reverse). It does no GPU work; the façade
//! rediscovers the inventory when [`ClaimStore::lock_synced`] reports a reload.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use crate::checkpoint::{CheckpointData, CheckpointError, CheckpointStore, ClaimRecord};
use crate::model::NodeInventory;

/// What the driver keeps in memory under its lock.
pub(super) struct State {
    pub(super) inventory: NodeInventory,
    pub(super) data: CheckpointData,
    /// Last recreation error of `NeedsRecreate` claims, by UID (this process only).
    pub(super) recreate_errors: BTreeMap<String, String>,
}

impl State {
    /// A state with no claim and no GPU (before start's recovery and first discovery).
    pub(super) fn empty() -> Self {
        Self {
            inventory: NodeInventory {
                driver_version: String::new(),
                driver_semver: String::new(),
                cuda_driver_semver: String::new(),
                gpus: Vec::new(),
            },
            data: CheckpointData::default(),
            recreate_errors: BTreeMap::new(),
        }
    }
}

/// The checkpoint file and the locked state it backs.
pub(super) struct ClaimStore {
    checkpoint: CheckpointStore,
    state: Mutex<State>,
}

impl ClaimStore {
    /// A store over `checkpoint`, holding `state` in memory.
    pub(super) fn new(checkpoint: CheckpointStore, state: State) -> Self {
        Self {
            checkpoint,
            state: Mutex::new(state),
        }
    }

    /// Takes the lock without reading the file.
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the state as consistent as the checkpoint.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the lock and re-reads the checkpoint, so that a second plugin instance on the
    /// node (serialised with this one by the shell's node lock) never has its records
    /// overwritten from a stale copy. True when the file's claims differed from memory and
    /// were taken (the caller rediscovers the inventory then). A read costs no fsync.
    pub(super) fn lock_synced(&self) -> Result<(MutexGuard<'_, State>, bool), CheckpointError> {
        let mut state = self.lock();
        let on_disk = self.checkpoint.load()?;
        let changed = on_disk.claims != state.data.claims;
        if changed {
            tracing::info!("checkpoint changed by another plugin instance; reloading");
            state.data.claims = on_disk.claims;
        }
        Ok((state, changed))
    }

    /// Reads the checkpoint file (without the lock).
    pub(super) fn load(&self) -> Result<CheckpointData, CheckpointError> {
        self.checkpoint.load()
    }

    /// Writes `data` as it is.
    pub(super) fn store(&self, data: &CheckpointData) -> Result<(), CheckpointError> {
        self.checkpoint.store(data)
    }

    /// Records `record` (replacing the claim's entry) and writes the file; on a failed
    /// write the entry is put back as it was.
    pub(super) fn put(
        &self,
        data: &mut CheckpointData,
        record: ClaimRecord,
    ) -> Result<(), CheckpointError> {
        let uid = record.uid.clone();
        let previous = data.claims.insert(uid.clone(), record);
        self.store(data).inspect_err(|_| {
            match previous {
                Some(p) => data.claims.insert(uid, p),
                None => data.claims.remove(&uid),
            };
        })
    }

    /// Drops the claim `uid` and writes the file; on a failed write the entry is put back.
    /// An unknown claim writes nothing.
    pub(super) fn remove(
        &self,
        data: &mut CheckpointData,
        uid: &str,
    ) -> Result<(), CheckpointError> {
        let Some(previous) = data.claims.remove(uid) else {
            return Ok(());
        };
        self.store(data).inspect_err(|_| {
            data.claims.insert(uid.to_owned(), previous);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::ClaimState;

    fn record(uid: &str, state: ClaimState) -> ClaimRecord {
        ClaimRecord {
            uid: uid.to_owned(),
            namespace: "ns".into(),
            name: format!("claim-{uid}"),
            state,
            devices: Vec::new(),
            sharing: None,
        }
    }

    /// A store whose writes fail: its file would lie under a regular file.
    fn failing_store(dir: &tempfile::TempDir) -> ClaimStore {
        let blocker = dir.path().join("not-a-dir");
        std::fs::write(&blocker, b"").unwrap();
        ClaimStore::new(CheckpointStore::in_dir(&blocker), State::empty())
    }

    #[test]
    fn a_failed_put_leaves_memory_as_the_file_is() {
        let dir = tempfile::tempdir().unwrap();
        let store = failing_store(&dir);
        let mut data = CheckpointData::default();
        data.claims
            .insert("a".into(), record("a", ClaimState::PrepareStarted));
        let before = data.clone();

        assert!(
            store
                .put(&mut data, record("b", ClaimState::Prepared))
                .is_err()
        );
        assert_eq!(data, before, "a new record is dropped again");
        assert!(
            store
                .put(&mut data, record("a", ClaimState::Prepared))
                .is_err()
        );
        assert_eq!(data, before, "a replaced record is put back");
    }

    #[test]
    fn a_failed_remove_keeps_the_record() {
        let dir = tempfile::tempdir().unwrap();
        let store = failing_store(&dir);
        let mut data = CheckpointData::default();
        data.claims
            .insert("a".into(), record("a", ClaimState::Prepared));
        let before = data.clone();

        assert!(store.remove(&mut data, "a").is_err());
        assert_eq!(data, before);
        store.remove(&mut data, "unknown").unwrap();
    }

    #[test]
    fn put_and_remove_write_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = ClaimStore::new(CheckpointStore::in_dir(dir.path()), State::empty());
        let mut data = CheckpointData::default();
        store
            .put(&mut data, record("a", ClaimState::Prepared))
            .unwrap();
        assert!(store.load().unwrap().claims.contains_key("a"));
        store.remove(&mut data, "a").unwrap();
        assert!(store.load().unwrap().claims.is_empty());
        assert!(data.claims.is_empty());
    }

    #[test]
    fn a_file_changed_by_another_instance_is_seen_after_lock_synced() {
        let dir = tempfile::tempdir().unwrap();
        let ours = ClaimStore::new(CheckpointStore::in_dir(dir.path()), State::empty());
        let theirs = ClaimStore::new(CheckpointStore::in_dir(dir.path()), State::empty());

        let (state, changed) = ours.lock_synced().unwrap();
        assert!(!changed && state.data.claims.is_empty());
        drop(state);

        let mut data = theirs.load().unwrap();
        theirs
            .put(&mut data, record("x", ClaimState::Prepared))
            .unwrap();

        assert!(
            ours.lock().data.claims.is_empty(),
            "the cached copy is stale"
        );
        let (state, changed) = ours.lock_synced().unwrap();
        assert!(changed);
        assert_eq!(state.data.claims["x"].state, ClaimState::Prepared);
        drop(state);
        let (_state, changed) = ours.lock_synced().unwrap();
        assert!(!changed, "a second read finds nothing new");
    }
}
