//! Files on the node that coordinate plugin instances and operators: the instance lock
//! (held by every running plugin from the moment it has read the checkpoint), the node
//! lock's name, and `checkpoint reset`, the one recovery from an unreadable checkpoint
//! ([`reset_checkpoint`]; the plugin never resets it by itself, since pods may still use
//! its claims).

use std::path::Path;

use anyhow::Context as _;
use cleave_driver::checkpoint::CHECKPOINT_FILE;
use cleave_driver::prepare::ResetError;

/// The recovery command, as printed in logs and Events.
pub(crate) fn reset_command(plugins_dir: &Path, driver_name: &str) -> String {
    format!(
        "cleave-kubelet-plugin checkpoint reset --plugins-dir {} --driver-name {driver_name}",
        plugins_dir.display()
    )
}

pub(crate) use cleave_driver::prepare::short_reason;

/// The lock every running plugin instance holds (shared) from the moment it has loaded
/// the checkpoint until it exits, so that `checkpoint reset` can tell a running plugin
/// from one that waits for a readable checkpoint: `<state dir>/instances.lock`.
pub(crate) const INSTANCE_LOCK_FILE: &str = "instances.lock";

/// The node lock every prepare and unprepare batch holds: `<state dir>/serialize.lock`
/// (see [`crate::node::node_lock`]).
pub(crate) const NODE_LOCK_FILE: &str = "serialize.lock";

/// Takes the shared instance lock in `state_dir` (see [`INSTANCE_LOCK_FILE`]); the lock
/// lasts as long as the returned file is open. Instances of a rolling update share it.
pub(crate) fn hold_instance_lock(state_dir: &Path) -> std::io::Result<std::fs::File> {
    let file = open_lock(&state_dir.join(INSTANCE_LOCK_FILE))?;
    file.lock_shared()?;
    Ok(file)
}

fn open_lock(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
}

/// Takes `path` exclusively without waiting; `Ok(None)` when someone else holds it.
fn try_lock_exclusive(path: &Path) -> anyhow::Result<Option<std::fs::File>> {
    let file = open_lock(path).with_context(|| format!("opening lock file {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("locking {}", path.display()))
        }
    }
}

pub(crate) use cleave_driver::prepare::{ResetOptions, ResetOutcome};

/// `checkpoint reset`: moves `<state_dir>/checkpoint.json` aside to
/// `checkpoint.json.corrupt-<unix seconds>` so the plugin starts with no prepared claims
/// (the driver's [`cleave_driver::prepare::reset_checkpoint`]).
///
/// Refuses (an error, the file untouched) while a plugin instance runs on the node (it
/// holds the instance lock or the node lock), and, unless [`ResetOptions::force`], when
/// the file reads and verifies (it is not corrupt: resetting it only abandons its claims)
/// or was written by a newer release. A forced reset lists the claims it abandons and
/// what they leave behind, and removes their CDI spec files only when asked.
pub(crate) fn reset_checkpoint(
    state_dir: &Path,
    options: &ResetOptions,
) -> anyhow::Result<ResetOutcome> {
    let path = state_dir.join(CHECKPOINT_FILE);
    if let Err(e) = std::fs::symlink_metadata(&path) {
        if e.kind() == std::io::ErrorKind::NotFound {
            return Ok(ResetOutcome::Missing);
        }
        return Err(e).with_context(|| format!("reading {}", path.display()));
    }
    // The node lock first, as every batch takes it; while held, no instance can start
    // (instances take the instance lock under the node lock) or change the file.
    let node_lock = state_dir.join(NODE_LOCK_FILE);
    let Some(_node) = try_lock_exclusive(&node_lock)? else {
        anyhow::bail!(
            "a cleave-kubelet-plugin instance is preparing or unpreparing claims on this node right now (it holds the node lock {}); \
             nothing was changed. A running plugin's checkpoint is its live state: stop the plugin on this node first",
            node_lock.display()
        );
    };
    let instance_lock = state_dir.join(INSTANCE_LOCK_FILE);
    let Some(_instances) = try_lock_exclusive(&instance_lock)? else {
        anyhow::bail!(
            "a cleave-kubelet-plugin instance is running on this node (it holds {}) and uses {} as its live state; \
             nothing was changed. A plugin that cannot read its checkpoint does not hold this lock; one that runs has read it. \
             Stop the plugin on this node first (for example, take the node out of the DaemonSet's node selector)",
            instance_lock.display(),
            path.display()
        );
    };
    match cleave_driver::prepare::reset_checkpoint(state_dir, options) {
        Ok(outcome) => Ok(outcome),
        Err(e @ ResetError::NotCorrupt { claims, .. }) => anyhow::bail!(
            "{e}, and the plugin uses it as is; nothing was changed. \
             Moving it aside abandons its {claims} claim(s): pods that use them keep their GPUs while the plugin no longer knows, \
             and the scheduler may hand those devices out again. To do it anyway, once no pod on this node uses these claims, \
             add --force (and --remove-cdi-specs to delete their CDI spec files)"
        ),
        Err(e @ ResetError::NewerRelease { .. }) => anyhow::bail!(
            "{e}: it is not corrupt; nothing was changed. Run the release that wrote it; to discard it anyway add --force"
        ),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cleave_driver::checkpoint::CheckpointError;

    fn plain() -> ResetOptions {
        ResetOptions::default()
    }

    #[test]
    fn reset_moves_a_damaged_file_aside_and_says_what_it_held() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            reset_checkpoint(dir.path(), &plain()).unwrap(),
            ResetOutcome::Missing
        );
        std::fs::write(dir.path().join(CHECKPOINT_FILE), b"{not json").unwrap();
        let ResetOutcome::MovedAside { moved_to, held, .. } =
            reset_checkpoint(dir.path(), &plain()).unwrap()
        else {
            panic!("not moved")
        };
        assert!(held.starts_with("unreadable:"), "{held}");
        // The output of the reset never tells the operator to run the reset.
        assert!(!held.contains("checkpoint reset"), "{held}");
        assert!(!dir.path().join(CHECKPOINT_FILE).exists());
        assert_eq!(std::fs::read(&moved_to).unwrap(), b"{not json");
        let name = moved_to.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("checkpoint.json.corrupt-"), "{name}");
    }

    /// A checkpoint holding one Prepared claim with a MIG instance cleave created, and its
    /// CDI spec in `cdi`.
    fn healthy_checkpoint(state: &Path, cdi: &Path) -> Vec<u8> {
        use cleave_driver::checkpoint::*;
        let store = CheckpointStore::in_dir(state);
        let mut data = CheckpointData::default();
        data.claims.insert(
            "u1".into(),
            ClaimRecord {
                uid: "u1".into(),
                namespace: "ns".into(),
                name: "c".into(),
                state: ClaimState::Prepared,
                devices: vec![DeviceRecord {
                    name: "gpu-0-mig-3g40gb-4".into(),
                    pool: "node".into(),
                    request_names: vec!["r".into()],
                    kind: DeviceKind::Mig,
                    admin_access: false,
                    gpu_uuid: "GPU-0".into(),
                    gpu_minor: 0,
                    mig: Some(MigRecord {
                        profile_id: 9,
                        profile_name: "3g.40gb".into(),
                        placement: cleave_driver::model::Placement { start: 4, size: 4 },
                        uuid: Some("MIG-1".into()),
                        gi_id: Some(2),
                        ci_id: Some(0),
                        created_by_cleave: true,
                        creating_in_boot: None,
                    }),
                    config: None,
                    cdi_device_ids: vec![],
                    share: None,
                }],
                sharing: None,
            },
        );
        store.store(&data).unwrap();
        std::fs::create_dir_all(cdi).unwrap();
        std::fs::write(cdi.join(cleave_driver::cdi::spec_file_name("u1")), b"{}").unwrap();
        std::fs::read(state.join(CHECKPOINT_FILE)).unwrap()
    }

    #[test]
    fn a_healthy_checkpoint_is_kept_without_force() {
        let dir = tempfile::tempdir().unwrap();
        let cdi = dir.path().join("cdi");
        let bytes = healthy_checkpoint(dir.path(), &cdi);
        let err = reset_checkpoint(dir.path(), &plain()).unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("reads and verifies"), "{msg}");
        assert!(msg.contains("claim ns/c uid u1 state Prepared"), "{msg}");
        assert!(msg.contains("--force"), "{msg}");
        assert!(!msg.contains("checkpoint reset"), "{msg}");
        assert_eq!(
            std::fs::read(dir.path().join(CHECKPOINT_FILE)).unwrap(),
            bytes
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("corrupt"))
            .collect();
        assert!(names.is_empty(), "{names:?}");
    }

    #[test]
    fn a_running_plugin_blocks_every_reset_even_forced() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CHECKPOINT_FILE), b"{not json").unwrap();
        let forced = ResetOptions {
            force: true,
            remove_cdi_specs_in: None,
        };
        let instance = hold_instance_lock(dir.path()).unwrap();
        let msg = format!("{:#}", reset_checkpoint(dir.path(), &forced).unwrap_err());
        assert!(msg.contains("is running on this node"), "{msg}");
        assert!(msg.contains(INSTANCE_LOCK_FILE), "{msg}");
        assert!(!msg.contains("checkpoint reset"), "{msg}");
        drop(instance);
        // A batch in flight holds the node lock.
        let node = open_lock(&dir.path().join(NODE_LOCK_FILE)).unwrap();
        node.lock().unwrap();
        let msg = format!("{:#}", reset_checkpoint(dir.path(), &forced).unwrap_err());
        assert!(msg.contains("holds the node lock"), "{msg}");
        assert_eq!(
            std::fs::read(dir.path().join(CHECKPOINT_FILE)).unwrap(),
            b"{not json"
        );
        drop(node);
        assert!(matches!(
            reset_checkpoint(dir.path(), &forced).unwrap(),
            ResetOutcome::MovedAside { .. }
        ));
    }

    #[test]
    fn a_forced_reset_names_what_it_abandons_and_removes_specs_only_if_asked() {
        let dir = tempfile::tempdir().unwrap();
        let cdi = dir.path().join("cdi");
        let spec = cdi.join(cleave_driver::cdi::spec_file_name("u1"));
        healthy_checkpoint(dir.path(), &cdi);
        let forced = ResetOptions {
            force: true,
            remove_cdi_specs_in: None,
        };
        let ResetOutcome::MovedAside {
            held,
            abandoned,
            left_behind,
            removed_specs,
            ..
        } = reset_checkpoint(dir.path(), &forced).unwrap()
        else {
            panic!("not moved")
        };
        assert!(held.contains("claim ns/c uid u1 state Prepared"), "{held}");
        assert_eq!(abandoned, ["ns/c uid u1"]);
        assert!(removed_specs.is_empty());
        assert!(spec.exists(), "the spec stays unless asked");
        let text = left_behind.join("\n");
        assert!(
            text.contains("MIG instance MIG-1 3g.40gb at placement 4 on GPU GPU-0"),
            "{text}"
        );
        assert!(text.contains("CDI spec"), "{text}");
        assert!(!dir.path().join(CHECKPOINT_FILE).exists());

        healthy_checkpoint(dir.path(), &cdi);
        let forced = ResetOptions {
            force: true,
            remove_cdi_specs_in: Some(cdi.clone()),
        };
        let ResetOutcome::MovedAside { removed_specs, .. } =
            reset_checkpoint(dir.path(), &forced).unwrap()
        else {
            panic!("not moved")
        };
        assert_eq!(removed_specs, std::slice::from_ref(&spec));
        assert!(!spec.exists());
    }

    #[test]
    fn short_reasons_name_the_path_without_the_recovery_text() {
        let e = CheckpointError::UnsupportedVersion {
            path: "/s/checkpoint.json".into(),
            version: 7,
        };
        let r = short_reason(&e);
        assert_eq!(
            r,
            format!(
                "/s/checkpoint.json has layout version 7, this release reads up to {}",
                cleave_driver::checkpoint::FORMAT_VERSION
            )
        );
        assert!(!r.contains("mv "), "{r}");
    }
}
