//! The MPS daemon life cycle both MPS strategies share (`per_claim`,
//! `shared`): directories, start (or find running), readiness, limits, stop, and the
//! client mounts of a daemon's pipe directory. Strategies plan the daemon ([`MpsRecord`]);
//! this module runs it through the [`super::DaemonLauncher`].

use std::path::{Path, PathBuf};
use std::sync::PoisonError;
use std::time::{Duration, Instant};

use super::mps::{self, DaemonHandle, DaemonSpec, MpsRecord, MpsTimings};
use super::process;
use super::timeslice::ComputeMode;
use super::{MASK_SOURCE, PIPE_ROOT_MODE, SHM_DIR, SharingFailure, SharingManager, pipe_dir_under};
use crate::cdi::Mount;

impl SharingManager {
    /// `<state dir>/mps/<claim UID>`.
    pub fn claim_dir(&self, claim_uid: &str) -> PathBuf {
        self.config.mps_dir().join(claim_uid)
    }

    /// The short pipe directory of the daemon `key` under the pipe root, if one is set: its
    /// name is the first 16 hex digits of SHA-256 over the state directory and the key, so
    /// two drivers on one node never meet.
    pub(crate) fn short_pipe_dir(&self, key: &str) -> Option<PathBuf> {
        let root = self.config.pipe_root.as_ref()?;
        Some(pipe_dir_under(root, &self.config.state_dir, key))
    }

    /// Creates the pipe root if it is missing and sets it to [`PIPE_ROOT_MODE`] (`0711`):
    /// an MPS server started with a client's UID must traverse it (bottlerocket-os/
    /// bottlerocket#4673), but no host user but root may list the daemons' pipe directories.
    /// The root is the plugin's own directory (`--mps-pipe-root`).
    pub(super) fn ensure_pipe_root(&self) -> Result<(), SharingFailure> {
        use std::os::unix::fs::PermissionsExt;
        let Some(root) = &self.config.pipe_root else {
            return Ok(());
        };
        let io = |op, source| SharingFailure::Io {
            op,
            path: root.clone(),
            source,
        };
        std::fs::create_dir_all(root).map_err(|e| io("creating", e))?;
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(PIPE_ROOT_MODE))
            .map_err(|e| io("setting permissions of", e))
    }

    /// Removes the daemon `key`'s directories: its state directory and its short pipe
    /// directory.
    pub(super) fn remove_daemon_dirs(&self, key: &str) -> Result<(), SharingFailure> {
        if let Some(pipe) = self.short_pipe_dir(key) {
            remove_dir(&pipe)?;
        }
        remove_dir(&self.claim_dir(key))
    }

    pub(super) fn spec(&self, claim_uid: &str, devices: Vec<String>) -> DaemonSpec {
        let dir = self.claim_dir(claim_uid);
        DaemonSpec {
            claim_uid: claim_uid.to_owned(),
            pipe_dir: self
                .short_pipe_dir(claim_uid)
                .unwrap_or_else(|| dir.join("pipe")),
            log_dir: dir.join("log"),
            visible_devices: devices,
            multi_user: false,
        }
    }

    pub(super) fn host_pipe_dir(&self, claim_uid: &str) -> PathBuf {
        if let Some(short) = self.short_pipe_dir(claim_uid) {
            return short;
        }
        let base = self
            .config
            .host_state_dir
            .as_ref()
            .unwrap_or(&self.config.state_dir);
        base.join(mps::MPS_DIR).join(claim_uid).join("pipe")
    }

    /// True if the daemon of `record` runs, answers right now and holds the recorded
    /// limits. A daemon that answers without them was launched by a start that crashed
    /// before it set them; it must not be kept as it is.
    pub(super) fn holds_limits(&self, record: &MpsRecord) -> bool {
        let Some(handle) = &record.daemon else {
            return false;
        };
        self.launcher.is_running(handle)
            && self
                .launcher
                .control(
                    &record.spec,
                    &record.limit_queries(),
                    self.config.command_timeout,
                )
                .is_ok_and(|a| record.check_limit_answer(&a).is_ok())
    }

    /// Starts (or finds running with the same settings) the daemon of `plan`.
    pub(super) fn start_mps(&self, mut record: MpsRecord) -> Result<MpsRecord, SharingFailure> {
        let started = Instant::now();
        let dir = self.claim_dir(&record.spec.claim_uid);
        if let Some(existing) = mps::load_record(&dir).ok().flatten() {
            if existing.same_settings(&record) && self.holds_limits(&existing) {
                tracing::debug!(claim = %record.spec.claim_uid, "MPS daemon already runs with these settings");
                return Ok(existing);
            }
            self.stop_mps(&existing)?;
        } else if dir.exists() {
            // Leftovers without a record.
            self.stop_unrecorded(&record.spec.claim_uid)?;
        }

        let result = (|| {
            self.ensure_pipe_root()?;
            mps::create_dirs(&dir, &record.spec)?;
            mps::store_record(&dir, &record)?;
            crate::fault::point("mps.after_record");
            for gpu in &record.exclusive_gpus {
                self.smi
                    .set_compute_mode(gpu, ComputeMode::ExclusiveProcess)?;
                crate::fault::point("mps.after_compute_mode");
            }
            let setup = started.elapsed();
            let mut timings = self.launch_and_configure(&dir, &mut record)?;
            timings.setup = setup;
            timings.total = started.elapsed();
            *self
                .last_timings
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(timings);
            Ok(())
        })();
        match result {
            Ok(()) => {
                tracing::info!(
                    claim = %record.spec.claim_uid,
                    daemon = %record.daemon.as_ref().map(DaemonHandle::describe).unwrap_or_default(),
                    devices = %record.spec.visible_devices.join(","),
                    "MPS control daemon ready"
                );
                Ok(record)
            }
            Err(e) => {
                if let Err(cleanup) = self.stop_mps(&record) {
                    tracing::error!(error = %cleanup, "cleaning up after a failed MPS start");
                }
                Err(e)
            }
        }
    }

    /// Launches the daemon of `record`, waits until it answers, sets and checks the limits,
    /// and records the daemon.
    pub(super) fn launch_and_configure(
        &self,
        dir: &Path,
        record: &mut MpsRecord,
    ) -> Result<MpsTimings, SharingFailure> {
        let claim = record.spec.claim_uid.clone();
        let t0 = Instant::now();
        let deadline = t0 + self.config.ready_timeout;
        let handle = self
            .launcher
            .start(&record.spec, self.config.ready_timeout)?;
        crate::fault::point("mps.after_launch");
        record.daemon = Some(handle);
        mps::store_record(dir, record)?;
        let launch = t0.elapsed();

        let t1 = Instant::now();
        let mut last = String::from("no attempt");
        let ready = process::poll_until(deadline.saturating_duration_since(Instant::now()), || {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            let timeout = left.min(self.config.command_timeout);
            match self
                .launcher
                .control(&record.spec, mps::READY_QUERY, timeout)
            {
                Ok(answer) if mps::parse_percentage(&answer).is_some() => Some(()),
                Ok(answer) => {
                    last = answer.trim().to_owned();
                    None
                }
                Err(e) => {
                    last = e.to_string();
                    None
                }
            }
        });
        if ready.is_none() {
            return Err(SharingFailure::DaemonNotReady {
                claim,
                waited: self.config.ready_timeout,
                last,
            });
        }
        let ready = t1.elapsed();
        crate::fault::point("mps.after_ready");

        let t2 = Instant::now();
        let answer = self.launcher.control(
            &record.spec,
            &record.limit_commands(),
            self.config.command_timeout,
        )?;
        record
            .check_limit_answer(&answer)
            .map_err(|problem| SharingFailure::DaemonRejected { claim, problem })?;
        tracing::debug!(claim = %record.spec.claim_uid, "MPS limits set and read back");
        Ok(MpsTimings {
            setup: Duration::ZERO,
            launch,
            ready,
            limits: t2.elapsed(),
            total: Duration::ZERO,
        })
    }

    /// Asks the daemon to quit, waits, kills it if it did not exit, then lets the launcher
    /// remove what is left (its pod).
    pub(super) fn stop_daemon(
        &self,
        spec: &DaemonSpec,
        handle: &DaemonHandle,
    ) -> Result<(), SharingFailure> {
        if self.launcher.is_running(handle) {
            self.quit_daemon(spec, handle)?;
        }
        self.launcher.cleanup(spec, handle)
    }

    pub(super) fn quit_daemon(
        &self,
        spec: &DaemonSpec,
        handle: &DaemonHandle,
    ) -> Result<(), SharingFailure> {
        if let Err(e) = self
            .launcher
            .control(spec, "quit\n", self.config.stop_timeout)
        {
            tracing::warn!(claim = %spec.claim_uid, error = %e, "MPS daemon did not take quit");
        }
        let gone = process::poll_until(self.config.stop_timeout, || {
            (!self.launcher.is_running(handle)).then_some(())
        });
        if gone.is_none() {
            tracing::warn!(claim = %spec.claim_uid, daemon = %handle.describe(), "MPS daemon did not exit after quit; killing it");
            self.launcher.kill(handle, self.config.stop_timeout)?;
        }
        Ok(())
    }

    /// Stops the daemon of `record`, restores compute modes, removes the claim directory.
    pub(super) fn stop_mps(&self, record: &MpsRecord) -> Result<(), SharingFailure> {
        let handle = record
            .daemon
            .clone()
            .or_else(|| self.launcher.find(&record.spec));
        if let Some(h) = handle {
            self.stop_daemon(&record.spec, &h)?;
            crate::fault::point("mps.after_stop");
        }
        for gpu in &record.exclusive_gpus {
            // Kept on failure: the directory (and record) stay so that a retry restores it.
            self.smi.set_compute_mode(gpu, ComputeMode::Default)?;
            crate::fault::point("mps.after_compute_mode_restore");
        }
        if record.spec.pipe_dir != self.claim_dir(&record.spec.claim_uid).join("pipe") {
            remove_dir(&record.spec.pipe_dir)?;
        }
        remove_dir(&self.claim_dir(&record.spec.claim_uid))
    }

    /// The spec of daemon `key` for `devices`, refused when its control socket's path would
    /// not fit a unix socket address.
    pub(super) fn checked_spec(
        &self,
        key: &str,
        devices: Vec<String>,
        multi_user: bool,
    ) -> Result<DaemonSpec, SharingFailure> {
        let mut spec = self.spec(key, devices);
        spec.multi_user = multi_user;
        if let Some(len) = mps::socket_path_too_long(&spec.pipe_dir, mps::CONTROL_SOCKET) {
            return Err(SharingFailure::PipeDirTooLong {
                claim: key.to_owned(),
                path: spec.pipe_dir.join(mps::CONTROL_SOCKET),
                len,
                max: mps::MAX_SOCKET_PATH,
            });
        }
        Ok(spec)
    }

    /// Stops the daemon of `key` found by the launcher alone (no record: a start interrupted
    /// before its first write, or a record deleted or unreadable) and removes its directories.
    pub(super) fn stop_unrecorded(&self, key: &str) -> Result<(), SharingFailure> {
        let spec = self.spec(key, Vec::new());
        if let Some(handle) = self.launcher.find(&spec) {
            self.stop_daemon(&spec, &handle)?;
        }
        self.remove_daemon_dirs(key)
    }

    /// Stops the daemon recorded under `mps/<key>` and removes its directories; with no
    /// record there, stops what the launcher finds of it ([`Self::stop_unrecorded`]). A record
    /// that does not decode fails the release ([`SharingFailure::RecordUnreadable`]): it is
    /// the only record of the compute modes to restore. Idempotent.
    pub(super) fn release_daemon(&self, key: &str) -> Result<(), SharingFailure> {
        match mps::load_record(&self.claim_dir(key))? {
            Some(record) => self.stop_mps(&record),
            None => self.stop_unrecorded(key),
        }
    }

    /// The pipe directory with its `control_privileged` socket masked, and the daemon's
    /// `/dev/shm` when it has one, for clients. The mask is a read-only bind of `/dev/null`
    /// over the socket inside the pipe directory's mount: the CDI library applies mounts
    /// sorted by the depth of their container path (container-device-interface
    /// `pkg/cdi/container-edits.go`, `sortMounts`), and they are listed in that order here
    /// too. A client then reaches the `control` socket and `log` FIFO it needs, never the
    /// socket through which a root peer would be the daemon's administrator.
    pub(super) fn client_mounts(&self, record: &MpsRecord) -> Vec<Mount> {
        let options = || vec!["rw".into(), "nosuid".into(), "nodev".into(), "bind".into()];
        let mut mounts = vec![
            Mount {
                host_path: record.host_pipe_dir.display().to_string(),
                container_path: self.config.container_pipe_dir.clone(),
                options: options(),
            },
            Mount {
                host_path: MASK_SOURCE.to_owned(),
                container_path: format!(
                    "{}/{}",
                    self.config.container_pipe_dir.trim_end_matches('/'),
                    mps::PRIVILEGED_SOCKET
                ),
                options: vec!["ro".into(), "nosuid".into(), "nodev".into(), "bind".into()],
            },
        ];
        if let Some(shm) = record.daemon.as_ref().and_then(|d| d.shm_host_dir.as_ref()) {
            mounts.push(Mount {
                host_path: shm.display().to_string(),
                container_path: SHM_DIR.to_owned(),
                options: options(),
            });
        }
        mounts
    }
}

pub(super) fn remove_dir(dir: &Path) -> Result<(), SharingFailure> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(SharingFailure::Io {
            op: "removing",
            path: dir.to_owned(),
            source,
        }),
    }
}
