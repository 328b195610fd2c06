//! The driver files under the driver root and the CDI store built on their common edits:
//! found at start, looked at again when a claim needs a file that was missing (a driver
//! installed or its nodes created after start) and when the shell asks; and start's sweep of
//! the CDI specs of unrecorded claims.

use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};

use super::{DriverConfig, PrepareError};
use crate::cdi::{self, CdiStore};
use crate::checkpoint::CheckpointData;
use crate::driver_root::{DeviceNeed, DriverFiles, DriverRootConfig};

/// The driver files found last and the CDI store that adds their common edits.
#[derive(Debug)]
pub(super) struct DriverView {
    pub(super) files: Arc<DriverFiles>,
    pub(super) cdi: CdiStore,
}

/// The current [`DriverView`], replaced when the driver root is looked at again.
pub(super) struct Files {
    root: DriverRootConfig,
    cdi_root: PathBuf,
    cdi_hook: Option<PathBuf>,
    current: RwLock<Arc<DriverView>>,
}

impl Files {
    /// Finds the driver files under `config`'s driver root.
    pub(super) fn discover(config: &DriverConfig) -> Result<Self, PrepareError> {
        let found = DriverFiles::discover(&config.driver_root)?;
        let view = view_of(found, &config.cdi_root, config.cdi_hook.as_deref());
        Ok(Self {
            root: config.driver_root.clone(),
            cdi_root: config.cdi_root.clone(),
            cdi_hook: config.cdi_hook.clone(),
            current: RwLock::new(Arc::new(view)),
        })
    }

    /// The view found last.
    pub(super) fn view(&self) -> Arc<DriverView> {
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// The driver files for a claim with these devices. When something they need is
    /// missing the driver root is looked at again (the driver may have been installed, or
    /// its nodes created, since the last look); what is still missing fails the claim.
    pub(super) fn view_for(
        &self,
        claim: &str,
        needs: &[DeviceNeed],
    ) -> Result<Arc<DriverView>, PrepareError> {
        let view = self.view();
        if view.files.missing_for(needs).is_empty() {
            return Ok(view);
        }
        let fresh = self.rediscover()?;
        let missing = fresh.files.missing_for(needs);
        if missing.is_empty() {
            tracing::info!(root = %fresh.files.root.display(), "driver files a claim needs appeared since the driver root was last examined");
            return Ok(fresh);
        }
        Err(PrepareError::MissingDriverFiles {
            claim: claim.to_owned(),
            root: fresh.files.root.clone(),
            dev_dir: fresh.files.dev_dir.clone(),
            missing,
        })
    }

    /// Looks at the driver root again and keeps what it holds now.
    pub(super) fn rediscover(&self) -> Result<Arc<DriverView>, PrepareError> {
        let found = DriverFiles::discover(&self.root)?;
        let fresh = Arc::new(view_of(found, &self.cdi_root, self.cdi_hook.as_deref()));
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::clone(&fresh);
        Ok(fresh)
    }

    /// The error for a node whose NVML sees `gpus` GPUs while the driver root holds no
    /// driver files at all; `None` otherwise.
    pub(super) fn missing_driver(&self, gpus: usize) -> Option<PrepareError> {
        let view = self.view();
        (gpus > 0 && view.files.holds_no_driver()).then(|| PrepareError::NoDriverFiles {
            root: view.files.root.clone(),
            dev_dir: view.files.dev_dir.clone(),
            gpus,
        })
    }
}

/// The view of `files`, with a CDI store in `cdi_root` whose specs name `hook`.
fn view_of(files: DriverFiles, cdi_root: &Path, hook: Option<&Path>) -> DriverView {
    let cdi = CdiStore::new(cdi_root, files.common_edits(hook));
    DriverView {
        files: Arc::new(files),
        cdi,
    }
}

/// Removes the spec files (and temp files) of this driver's kind in `cdi_root` whose claim
/// `data` does not record.
pub(super) fn sweep_cdi_root(cdi_root: &Path, data: &CheckpointData) {
    let prefix = cdi::spec_file_name("");
    let prefix = prefix.trim_end_matches(".json");
    let Ok(entries) = std::fs::read_dir(cdi_root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let stale = if let Some(uid) = name
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_suffix(".json"))
        {
            !data.claims.contains_key(uid)
        } else {
            name.starts_with(&format!(".{prefix}")) && name.ends_with(".tmp")
        };
        if stale {
            tracing::info!(file = %name, "removing CDI spec of an unrecorded claim");
            if let Err(e) = std::fs::remove_file(entry.path()) {
                tracing::warn!(file = %name, error = %e, "removing stale CDI spec");
            }
        }
    }
}
