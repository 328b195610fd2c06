//! Persistent "hardware" state: MIG mode, GPU and compute instances.
//!
//! The state lives in one JSON file shared by every process that loads the mock with
//! the same `MOCK_NVML_STATE`. Every read takes a shared lock and every
//! read-modify-write an exclusive lock on `<state>.lock`; a write is one `pwrite` of the
//! whole (small) file, so a killed process practically never leaves half a file; an
//! unreadable state file is treated like a fresh boot.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::fixtures::{self, GiProfile, GpuSpec, NodeConfig};
use crate::rc;

/// Format version of the state file.
pub const STATE_VERSION: u32 = 1;

/// Whole-node state as stored in the state file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    /// `STATE_VERSION`.
    pub version: u32,
    /// Fixture fingerprint the state belongs to.
    pub fixture: String,
    /// Boot ID the GI/CI state belongs to; a different boot clears instances.
    pub boot_id: String,
    /// Per-GPU state, by NVML index.
    pub gpus: Vec<GpuState>,
}

/// State of one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuState {
    /// MIG mode (current = pending; the mock applies mode changes at once).
    pub mig_enabled: bool,
    /// `nvmlComputeMode_t`.
    pub compute_mode: u32,
    /// GPU instances.
    pub gpu_instances: Vec<GiState>,
}

/// One GPU instance.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GiState {
    /// GI ID.
    pub id: u32,
    /// lgip profile ID (19, 14, ...).
    pub profile_id: u32,
    /// First memory slice.
    pub start: u32,
    /// Memory slices.
    pub size: u32,
    /// Random creation tag: handles of a destroyed GI stay invalid after re-creation.
    pub nonce: u64,
    /// Compute instances.
    pub compute_instances: Vec<CiState>,
}

/// One compute instance (= one MIG device).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CiState {
    /// CI ID within the GI.
    pub id: u32,
    /// `NVML_COMPUTE_INSTANCE_PROFILE_*` value.
    pub profile_id: u32,
    /// First compute slice.
    pub start: u32,
    /// Compute slices.
    pub size: u32,
    /// `MIG-...` UUID, new on every creation.
    pub uuid: String,
    /// Random creation tag.
    pub nonce: u64,
}

/// Failure to access the state file.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Opening or locking the lock file failed.
    #[error("locking {path}: {source}")]
    Lock {
        /// Lock file path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Reading the state file failed.
    #[error("reading {path}: {source}")]
    Read {
        /// State file path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Writing the state file failed.
    #[error("writing {path}: {source}")]
    Write {
        /// State file path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
}

/// Default state path: `<tmpdir>/cleave-mock-nvml-<fixture name>.json`.
pub fn default_state_path(fixture_name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("cleave-mock-nvml-{fixture_name}.json"))
}

/// Current boot ID: `MOCK_NVML_BOOT_ID`, else the kernel's boot ID, else "boot".
pub fn current_boot_id() -> String {
    if let Ok(b) = std::env::var("MOCK_NVML_BOOT_ID") {
        return b;
    }
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "boot".to_string())
}

/// The state file of one fixture, with its defaults.
#[derive(Debug)]
pub struct StateStore {
    path: PathBuf,
    lock_path: PathBuf,
    fresh: State,
    /// The last file text read and what it parsed to: every call re-reads the file (a
    /// change by another process shows at once) but parses it only when the text changed.
    /// Real NVML answers a query with an ioctl, not by parsing; re-parsing on every call made
    /// a usage round over 56 MIG devices cost ~40 ms of CPU.
    parsed: std::sync::Mutex<Option<(String, std::sync::Arc<State>)>>,
}

impl StateStore {
    /// A store at `path` for `cfg`, in boot `boot_id`.
    pub fn new(path: PathBuf, cfg: &NodeConfig, boot_id: String) -> Self {
        let mut lock_path = path.clone().into_os_string();
        lock_path.push(".lock");
        let fresh = State {
            version: STATE_VERSION,
            fixture: cfg.fingerprint(),
            boot_id,
            gpus: cfg
                .gpus
                .iter()
                .map(|g| GpuState {
                    mig_enabled: g.mig_enabled_initially,
                    compute_mode: 0,
                    gpu_instances: Vec::new(),
                })
                .collect(),
        };
        Self {
            path,
            lock_path: PathBuf::from(lock_path),
            fresh,
            parsed: std::sync::Mutex::new(None),
        }
    }

    /// State file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self, exclusive: bool) -> Result<File, StateError> {
        if let Some(dir) = self.lock_path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir).map_err(|source| StateError::Lock {
                path: self.lock_path.clone(),
                source,
            })?;
        }
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&self.lock_path)
            .map_err(|source| StateError::Lock {
                path: self.lock_path.clone(),
                source,
            })?;
        let r = if exclusive { f.lock() } else { f.lock_shared() };
        r.map_err(|source| StateError::Lock {
            path: self.lock_path.clone(),
            source,
        })?;
        Ok(f)
    }

    fn read_unlocked(&self) -> Result<std::sync::Arc<State>, StateError> {
        let mut text = String::new();
        match File::open(&self.path) {
            Ok(mut f) => {
                f.read_to_string(&mut text)
                    .map_err(|source| StateError::Read {
                        path: self.path.clone(),
                        source,
                    })?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(std::sync::Arc::new(self.fresh.clone()));
            }
            Err(source) => {
                return Err(StateError::Read {
                    path: self.path.clone(),
                    source,
                });
            }
        }
        let mut parsed = self
            .parsed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((seen, st)) = parsed.as_ref()
            && *seen == text
        {
            return Ok(std::sync::Arc::clone(st));
        }
        let st = std::sync::Arc::new(self.parse(&text));
        *parsed = Some((text, std::sync::Arc::clone(&st)));
        Ok(st)
    }

    /// The state a state file's text stands for (fresh where it is unreadable or belongs
    /// to another fixture; without instances after a reboot).
    fn parse(&self, text: &str) -> State {
        let Ok(mut st) = serde_json::from_str::<State>(text) else {
            eprintln!(
                "mock-nvml: state file {} unreadable, starting fresh",
                self.path.display()
            );
            return self.fresh.clone();
        };
        if st.version != STATE_VERSION
            || st.fixture != self.fresh.fixture
            || st.gpus.len() != self.fresh.gpus.len()
        {
            return self.fresh.clone();
        }
        if st.boot_id != self.fresh.boot_id {
            // A reboot: instances are gone, MIG mode persists (as on hardware).
            st.boot_id.clone_from(&self.fresh.boot_id);
            for g in &mut st.gpus {
                g.gpu_instances.clear();
            }
        }
        st
    }

    /// Reads the current state (shared lock).
    pub fn read(&self) -> Result<std::sync::Arc<State>, StateError> {
        let _lock = self.lock(false)?;
        self.read_unlocked()
    }

    /// Read-modify-write under the exclusive lock. The state is written back only when
    /// `f` returns `Ok` and changed something.
    pub fn modify<T, E>(
        &self,
        f: impl FnOnce(&mut State) -> Result<T, E>,
    ) -> Result<Result<T, E>, StateError> {
        let _lock = self.lock(true)?;
        let before = self.read_unlocked()?;
        let mut st = State::clone(&before);
        let out = f(&mut st);
        if out.is_ok() && (st != *before || !self.path.exists()) {
            self.write_unlocked(&st)?;
        }
        Ok(out)
    }

    /// Overwrites the state file in place with one write, padded with spaces (valid
    /// trailing JSON whitespace) to at least the old length. A temp-file-and-rename would
    /// survive more kinds of crash, but ext4 flushes data on rename-over (auto_da_alloc),
    /// which made each MIG change cost milliseconds of disk I/O.
    fn write_unlocked(&self, st: &State) -> Result<(), StateError> {
        use std::os::unix::fs::FileExt;
        let err = |source| StateError::Write {
            path: self.path.clone(),
            source,
        };
        let mut text = serde_json::to_vec(st).map_err(|e| err(std::io::Error::other(e)))?;
        text.push(b'\n');
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&self.path)
            .map_err(err)?;
        let old = f.metadata().map_err(err)?.len() as usize;
        if old > text.len() && old - text.len() <= 64 * 1024 {
            text.resize(old, b' ');
        }
        f.write_all_at(&text, 0).map_err(err)?;
        if old > text.len() {
            f.set_len(text.len() as u64).map_err(err)?;
        }
        Ok(())
    }
}

/// Reads a state file as stored (under the shared lock, without applying fixture or boot
/// checks), for tests that check what is left on the "hardware". `Ok(None)` when the file
/// does not exist.
pub fn read_state_file(path: &Path) -> Result<Option<State>, StateError> {
    let mut lock_path = path.to_path_buf().into_os_string();
    lock_path.push(".lock");
    let lock_path = PathBuf::from(lock_path);
    let lock_err = |source| StateError::Lock {
        path: lock_path.clone(),
        source,
    };
    let _lock = match File::open(&lock_path) {
        Ok(f) => {
            f.lock_shared().map_err(lock_err)?;
            Some(f)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(lock_err(e)),
    };
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(StateError::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| StateError::Read {
            path: path.to_path_buf(),
            source: std::io::Error::other(e),
        })
}

/// A random u64 (creation tags).
pub fn random_u64() -> u64 {
    let b = uuid::Uuid::new_v4();
    let (hi, lo) = b.as_u64_pair();
    hi ^ lo
}

/// A fresh MIG device UUID, `MIG-<8-4-4-4-12>`.
pub fn new_mig_uuid() -> String {
    format!("MIG-{}", uuid::Uuid::new_v4())
}

fn overlaps(a_start: u32, a_size: u32, b_start: u32, b_size: u32) -> bool {
    a_start < b_start + b_size && b_start < a_start + a_size
}

/// NVML return code of a failed operation.
pub type Code = u32;

fn gip_of(spec: &GpuSpec, id: u32) -> Result<&'static GiProfile, Code> {
    spec.product.profile_by_id(id).ok_or(rc::INVALID_ARGUMENT)
}

/// Requires MIG support and MIG mode on.
pub fn require_mig(spec: &GpuSpec, gs: &GpuState) -> Result<(), Code> {
    if !spec.mig_capable || !gs.mig_enabled {
        return Err(rc::NOT_SUPPORTED);
    }
    Ok(())
}

/// Free placements of profile `gip` given the GIs that exist.
pub fn free_placements(gip: &GiProfile, gs: &GpuState) -> Vec<u32> {
    gip.starts
        .iter()
        .copied()
        .filter(|&s| {
            !gs.gpu_instances
                .iter()
                .any(|g| overlaps(s, gip.placement_size, g.start, g.size))
        })
        .collect()
}

/// How many more GIs of `gip` fit now (`nvmlDeviceGetGpuInstanceRemainingCapacity`).
pub fn gi_remaining(gip: &GiProfile, gs: &GpuState) -> u32 {
    let existing = gs
        .gpu_instances
        .iter()
        .filter(|g| g.profile_id == gip.id)
        .count() as u32;
    let free = free_placements(gip, gs).len() as u32;
    free.min(gip.instance_count.saturating_sub(existing))
}

/// Creates a GI of lgip profile `profile_id`, at `placement` (start, size) or at the
/// lowest free valid placement. Returns the index of the new GI in `gpu_instances`.
///
/// Codes as nvml.h documents: NOT_SUPPORTED without MIG mode, INVALID_ARGUMENT for an
/// unknown profile or a placement not in the profile's list, INSUFFICIENT_RESOURCES for
/// overlaps or exhausted instance counts.
pub fn create_gi(
    spec: &GpuSpec,
    gs: &mut GpuState,
    profile_id: u32,
    placement: Option<(u32, u32)>,
) -> Result<usize, Code> {
    require_mig(spec, gs)?;
    let gip = gip_of(spec, profile_id)?;
    let start = match placement {
        Some((start, size)) => {
            if size != gip.placement_size || !gip.starts.contains(&start) {
                return Err(rc::INVALID_ARGUMENT);
            }
            if gi_remaining(gip, gs) == 0 || !free_placements(gip, gs).contains(&start) {
                return Err(rc::INSUFFICIENT_RESOURCES);
            }
            start
        }
        None => {
            if gi_remaining(gip, gs) == 0 {
                return Err(rc::INSUFFICIENT_RESOURCES);
            }
            *free_placements(gip, gs)
                .first()
                .ok_or(rc::INSUFFICIENT_RESOURCES)?
        }
    };
    gs.gpu_instances.push(GiState {
        id: fixtures::gi_id_for_placement(start, gip.placement_size),
        profile_id,
        start,
        size: gip.placement_size,
        nonce: random_u64(),
        compute_instances: Vec::new(),
    });
    gs.gpu_instances.sort_by_key(|g| g.id);
    gs.gpu_instances
        .iter()
        .position(|g| g.start == start && g.profile_id == profile_id)
        .ok_or(rc::UNKNOWN)
}

/// Destroys GI `gi_id`; IN_USE while it has compute instances.
pub fn destroy_gi(gs: &mut GpuState, gi_id: u32) -> Result<(), Code> {
    let pos = gs
        .gpu_instances
        .iter()
        .position(|g| g.id == gi_id)
        .ok_or(rc::INVALID_ARGUMENT)?;
    if !gs.gpu_instances[pos].compute_instances.is_empty() {
        return Err(rc::IN_USE);
    }
    gs.gpu_instances.remove(pos);
    Ok(())
}

/// Free CI placements (compute-slice starts) of a `c`-slice CI profile in a GI.
pub fn ci_free_placements(gi: &GiState, slices: u32, count: u32) -> Vec<u32> {
    (0..count)
        .map(|k| k * slices)
        .filter(|&s| {
            !gi.compute_instances
                .iter()
                .any(|c| overlaps(s, slices, c.start, c.size))
        })
        .collect()
}

/// Creates a CI of `NVML_COMPUTE_INSTANCE_PROFILE_*` value `ci_profile` in GI `gi`
/// (lowest free placement unless `placement` is given). CI IDs: lowest free from 0.
pub fn create_ci(
    spec: &GpuSpec,
    gi: &mut GiState,
    ci_profile: u32,
    placement: Option<(u32, u32)>,
) -> Result<usize, Code> {
    let gip = gip_of(spec, gi.profile_id)?;
    let cip = fixtures::ci_profile(gip, ci_profile).ok_or(rc::INVALID_ARGUMENT)?;
    let free = ci_free_placements(gi, cip.slice_count, cip.instance_count);
    let start = match placement {
        Some((start, size)) => {
            if size != cip.slice_count
                || start % cip.slice_count != 0
                || start / cip.slice_count >= cip.instance_count
            {
                return Err(rc::INVALID_ARGUMENT);
            }
            if !free.contains(&start) {
                return Err(rc::INSUFFICIENT_RESOURCES);
            }
            start
        }
        None => *free.first().ok_or(rc::INSUFFICIENT_RESOURCES)?,
    };
    let id = (0..8u32)
        .find(|i| !gi.compute_instances.iter().any(|c| c.id == *i))
        .ok_or(rc::INSUFFICIENT_RESOURCES)?;
    gi.compute_instances.push(CiState {
        id,
        profile_id: ci_profile,
        start,
        size: cip.slice_count,
        uuid: new_mig_uuid(),
        nonce: random_u64(),
    });
    gi.compute_instances.sort_by_key(|c| c.id);
    gi.compute_instances
        .iter()
        .position(|c| c.id == id)
        .ok_or(rc::UNKNOWN)
}

/// MIG devices of a GPU in `nvmlDeviceGetMigDeviceHandleByIndex` order: by GI ID, then
/// CI ID.
pub fn mig_devices(gs: &GpuState) -> Vec<(&GiState, &CiState)> {
    let mut v: Vec<_> = gs
        .gpu_instances
        .iter()
        .flat_map(|g| g.compute_instances.iter().map(move |c| (g, c)))
        .collect();
    v.sort_by_key(|(g, c)| (g.id, c.id));
    v
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn h100() -> (NodeConfig, GpuState) {
        let n = fixtures::node_profile("h100-80gb-x8", None).unwrap();
        let gs = GpuState {
            mig_enabled: true,
            ..GpuState::default()
        };
        (n, gs)
    }

    #[test]
    fn placements_and_codes() {
        let (n, mut gs) = h100();
        let g = &n.gpus[0];
        // invalid placement start / size
        assert_eq!(
            create_gi(g, &mut gs, 9, Some((2, 4))),
            Err(rc::INVALID_ARGUMENT)
        );
        assert_eq!(
            create_gi(g, &mut gs, 9, Some((0, 2))),
            Err(rc::INVALID_ARGUMENT)
        );
        assert_eq!(create_gi(g, &mut gs, 99, None), Err(rc::INVALID_ARGUMENT));
        let i = create_gi(g, &mut gs, 9, Some((4, 4))).unwrap();
        assert_eq!(gs.gpu_instances[i].id, 2);
        // overlap
        assert_eq!(
            create_gi(g, &mut gs, 19, Some((5, 1))),
            Err(rc::INSUFFICIENT_RESOURCES)
        );
        assert_eq!(
            create_gi(g, &mut gs, 0, None),
            Err(rc::INSUFFICIENT_RESOURCES)
        );
        // auto placement picks the lowest free start
        let i = create_gi(g, &mut gs, 19, None).unwrap();
        assert_eq!((gs.gpu_instances[i].start, gs.gpu_instances[i].id), (0, 7));
        let gip = g.product.profile_by_id(19).unwrap();
        assert_eq!(gi_remaining(gip, &gs), 3);
        // +me: one instance only
        let me = g.product.profile_by_id(20).unwrap();
        assert_eq!(gi_remaining(me, &gs), 1);
        create_gi(g, &mut gs, 20, None).unwrap();
        assert_eq!(gi_remaining(me, &gs), 0);
        assert_eq!(
            create_gi(g, &mut gs, 20, None),
            Err(rc::INSUFFICIENT_RESOURCES)
        );
        // CI and destroy ordering
        let pos = gs.gpu_instances.iter().position(|x| x.id == 2).unwrap();
        let ci = create_ci(g, &mut gs.gpu_instances[pos], 2, None).unwrap();
        assert_eq!(gs.gpu_instances[pos].compute_instances[ci].id, 0);
        assert!(
            gs.gpu_instances[pos].compute_instances[ci]
                .uuid
                .starts_with("MIG-")
        );
        assert_eq!(
            create_ci(g, &mut gs.gpu_instances[pos], 2, None),
            Err(rc::INSUFFICIENT_RESOURCES)
        );
        assert_eq!(destroy_gi(&mut gs, 2), Err(rc::IN_USE));
        assert_eq!(mig_devices(&gs).len(), 1);
        gs.gpu_instances[pos].compute_instances.clear();
        destroy_gi(&mut gs, 2).unwrap();
        gs.mig_enabled = false;
        assert_eq!(create_gi(g, &mut gs, 19, None), Err(rc::NOT_SUPPORTED));
    }

    #[test]
    fn store_roundtrip_and_reboot() {
        let dir = tempfile::tempdir().unwrap();
        let n = fixtures::node_profile("a100-40gb-x8", Some(true)).unwrap();
        let path = dir.path().join("s.json");
        let store = StateStore::new(path.clone(), &n, "b1".into());
        let r = store
            .modify(|st| create_gi(&n.gpus[3], &mut st.gpus[3], 0, None))
            .unwrap();
        assert_eq!(r, Ok(0));
        let st = store.read().unwrap();
        assert_eq!(st.gpus[3].gpu_instances.len(), 1);
        assert_eq!(read_state_file(&path).unwrap().unwrap(), *st);
        assert!(
            read_state_file(&dir.path().join("none.json"))
                .unwrap()
                .is_none()
        );
        // failed op does not write
        let r = store
            .modify(|st| create_gi(&n.gpus[3], &mut st.gpus[3], 0, None))
            .unwrap();
        assert_eq!(r, Err(rc::INSUFFICIENT_RESOURCES));
        // new boot: instances gone, MIG mode kept
        store
            .modify(|st| {
                st.gpus[1].mig_enabled = false;
                Ok::<_, Code>(())
            })
            .unwrap()
            .unwrap();
        let reboot = StateStore::new(path.clone(), &n, "b2".into());
        let st = reboot.read().unwrap();
        assert!(st.gpus[3].gpu_instances.is_empty());
        assert!(!st.gpus[1].mig_enabled);
        // other fixture: fresh
        let other = fixtures::node_profile("a100-40gb-x8", Some(false)).unwrap();
        let st = StateStore::new(path, &other, "b1".into()).read().unwrap();
        assert!(
            st.gpus
                .iter()
                .all(|g| !g.mig_enabled && g.gpu_instances.is_empty())
        );
    }
    /// A change made through another store (another process) shows on the next read,
    /// though the text is parsed only when it changed and a write keeps the file's length.
    #[test]
    fn reads_see_another_stores_change_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let n = fixtures::node_profile("a100-40gb-x8", Some(true)).unwrap();
        let path = dir.path().join("s.json");
        let reader = StateStore::new(path.clone(), &n, "b1".into());
        let writer = StateStore::new(path.clone(), &n, "b1".into());
        writer
            .modify(|st| create_gi(&n.gpus[3], &mut st.gpus[3], 0, None))
            .unwrap()
            .unwrap();
        let first = reader.read().unwrap();
        assert_eq!(first.gpus[3].gpu_instances.len(), 1);
        assert!(
            std::sync::Arc::ptr_eq(&first, &reader.read().unwrap()),
            "unchanged text is not parsed again"
        );
        let len = std::fs::metadata(&path).unwrap().len();
        writer
            .modify(|st| {
                st.gpus[3].gpu_instances.clear();
                Ok::<_, ()>(())
            })
            .unwrap()
            .unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            len,
            "padded in place"
        );
        assert!(reader.read().unwrap().gpus[3].gpu_instances.is_empty());
    }
}
