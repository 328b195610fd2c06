//! `checkpoint reset`'s driver side: moves an unreadable (or, forced, any) checkpoint
//! aside so the next start has no prepared claims, says what its claims leave behind on
//! the node, and removes their CDI specs when asked. The caller makes sure no plugin
//! instance runs (the node-local locks are the shell's).

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::checkpoint::{CHECKPOINT_FILE, CheckpointData, CheckpointError, decode};

/// How [`reset_checkpoint`] may proceed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResetOptions {
    /// Reset even a checkpoint that reads and verifies (abandoning its claims), or one
    /// written by a newer release.
    pub force: bool,
    /// Also delete the CDI spec files of the abandoned claims from this CDI root.
    pub remove_cdi_specs_in: Option<PathBuf>,
}

/// What [`reset_checkpoint`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResetOutcome {
    /// No checkpoint file: nothing to do.
    Missing,
    /// The file was moved to `moved_to`.
    MovedAside {
        /// The new name, `checkpoint.json.corrupt-<unix seconds>`.
        moved_to: PathBuf,
        /// What the file held when it could be decoded (claims), else why it could not.
        held: String,
        /// The claims the plugin forgets (`namespace/name uid`), when the file decoded.
        abandoned: Vec<String>,
        /// What those claims leave on the node that nothing cleans up any more: MIG
        /// instances cleave created for them, MPS state, CDI specs not removed.
        left_behind: Vec<String>,
        /// CDI spec files removed (with [`ResetOptions::remove_cdi_specs_in`]).
        removed_specs: Vec<PathBuf>,
    },
}

/// Why [`reset_checkpoint`] changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum ResetError {
    /// The file reads and verifies and the reset was not forced.
    #[error("{} reads and verifies ({held}): it is not corrupt", path.display())]
    NotCorrupt {
        /// The checkpoint file.
        path: PathBuf,
        /// What it holds.
        held: String,
        /// How many claims it records.
        claims: usize,
    },
    /// The file was written by a newer release and the reset was not forced.
    #[error("{} was written by a newer release (layout version {version}; this release reads up to {})", path.display(), crate::checkpoint::FORMAT_VERSION)]
    NewerRelease {
        /// The checkpoint file.
        path: PathBuf,
        /// Its layout version.
        version: u64,
    },
    /// Reading or moving the file failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done (`reading`, `moving aside`).
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// The path and what is wrong, without the long recovery text of the error's message.
pub fn short_reason(e: &CheckpointError) -> String {
    match e {
        CheckpointError::Corrupt { path, reason } => {
            format!("{} is corrupt: {reason}", path.display())
        }
        CheckpointError::UnsupportedVersion { path, version } => format!(
            "{} has layout version {version}, this release reads up to {}",
            path.display(),
            crate::checkpoint::FORMAT_VERSION
        ),
        CheckpointError::Read { path, source } => {
            format!("{} cannot be read: {source}", path.display())
        }
        other => other.to_string(),
    }
}

/// Moves `<state_dir>/checkpoint.json` aside to `checkpoint.json.corrupt-<unix seconds>`
/// so the driver starts with no prepared claims. Unless [`ResetOptions::force`], refuses
/// (the file untouched) when the file reads and verifies or was written by a newer
/// release. Lists the claims it abandons and what they leave behind, and removes their
/// CDI spec files only when asked. The caller must hold off every driver instance.
pub fn reset_checkpoint(
    state_dir: &Path,
    options: &ResetOptions,
) -> Result<ResetOutcome, ResetError> {
    let path = state_dir.join(CHECKPOINT_FILE);
    let io = |action, path: &Path| {
        let path = path.to_path_buf();
        move |source| ResetError::Io {
            action,
            path,
            source,
        }
    };
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(ResetOutcome::Missing),
        Err(e) => return Err(io("reading", &path)(e)),
    };
    let decoded = decode(&path, &bytes);
    let (held, abandoned, mut left_behind, uids) = match &decoded {
        Ok(data) => describe(data),
        Err(e) => (
            format!("unreadable: {}", short_reason(e)),
            vec![],
            vec![],
            vec![],
        ),
    };
    match &decoded {
        Ok(data) if !options.force => {
            return Err(ResetError::NotCorrupt {
                path,
                held,
                claims: data.claims.len(),
            });
        }
        Err(CheckpointError::UnsupportedVersion { version, .. }) if !options.force => {
            return Err(ResetError::NewerRelease {
                path,
                version: *version,
            });
        }
        _ => {}
    }
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut moved_to = state_dir.join(format!("{CHECKPOINT_FILE}.corrupt-{secs}"));
    let mut n = 1;
    while moved_to.exists() {
        moved_to = state_dir.join(format!("{CHECKPOINT_FILE}.corrupt-{secs}-{n}"));
        n += 1;
    }
    std::fs::rename(&path, &moved_to).map_err(io("moving aside", &path))?;
    if let Ok(dir) = std::fs::File::open(state_dir) {
        let _ = dir.sync_all();
    }
    let mut removed_specs = Vec::new();
    for uid in &uids {
        // A UID that cannot name a file never had a spec written.
        if crate::cdi::validate_claim_uid(uid).is_err() {
            continue;
        }
        let file = crate::cdi::spec_file_name(uid);
        match &options.remove_cdi_specs_in {
            Some(root) => {
                let spec = root.join(&file);
                match std::fs::remove_file(&spec) {
                    Ok(()) => removed_specs.push(spec),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => left_behind.push(format!(
                        "CDI spec {} (could not remove it: {e})",
                        spec.display()
                    )),
                }
            }
            None => left_behind.push(format!(
                "CDI spec {file} (kept; pods of the claim may still be starting with it)"
            )),
        }
    }
    Ok(ResetOutcome::MovedAside {
        moved_to,
        held,
        abandoned,
        left_behind,
        removed_specs,
    })
}

/// A summary of `data`, the claims it names, what they leave behind, and their UIDs.
fn describe(data: &CheckpointData) -> (String, Vec<String>, Vec<String>, Vec<String>) {
    let mut held = format!("{} claim(s), boot ID {:?}", data.claims.len(), data.boot_id);
    let mut abandoned = Vec::new();
    let mut left = Vec::new();
    for c in data.claims.values() {
        let devices: Vec<&str> = c.devices.iter().map(|d| d.name.as_str()).collect();
        held.push_str(&format!(
            "\n  claim {}/{} uid {} state {:?} devices {}",
            c.namespace,
            c.name,
            c.uid,
            c.state,
            devices.join(",")
        ));
        abandoned.push(format!("{}/{} uid {}", c.namespace, c.name, c.uid));
        for d in &c.devices {
            if let Some(m) = d.mig.as_ref().filter(|m| m.is_cleaves()) {
                left.push(format!(
                    "MIG instance {} {} at placement {} on GPU {} (GI {}, CI {}): destroy it with nvidia-smi once unused",
                    m.uuid.as_deref().unwrap_or("(no UUID recorded)"),
                    m.profile_name,
                    m.placement.start,
                    d.gpu_uuid,
                    m.gi_id.map_or("?".to_owned(), |v| v.to_string()),
                    m.ci_id.map_or("?".to_owned(), |v| v.to_string()),
                ));
            }
        }
        if c.sharing.is_some() {
            left.push(format!(
                "sharing state (MPS daemon) of claim {}/{}",
                c.namespace, c.name
            ));
        }
    }
    let uids = data.claims.values().map(|c| c.uid.clone()).collect();
    (held, abandoned, left, uids)
}
