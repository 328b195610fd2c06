//! After a plugin restart: MPS daemons outlive the plugin, so the ones of live claims are
//! re-found (and started again when they died) and the ones of claims that are gone are
//! stopped. Works from the daemon directories (`mps/<key>`) and the launcher alone.

use std::collections::BTreeSet;
use std::path::Path;

use super::mps::{self, MpsRecord};
use super::timeslice::ComputeMode;
use super::{SharingFailure, SharingManager};
use crate::durable::write_file_atomic;

/// What [`SharingManager::reconcile`] did, by claim UID.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Live claims whose daemon runs and answers.
    pub kept: Vec<String>,
    /// Live claims whose daemon was gone and was started again.
    pub restarted: Vec<String>,
    /// Claims that are gone; their daemons were stopped and directories removed.
    pub stopped: Vec<String>,
    /// Claims where something failed, with the message.
    pub failed: Vec<(String, String)>,
}

impl SharingManager {
    /// After a restart: keeps the daemons of `live_claims` that run and answer, starts again
    /// those that died (with their recorded settings), and stops daemons of claims not in
    /// `live_claims`, removing their directories. Failures are reported per claim.
    pub fn reconcile(&self, live_claims: &BTreeSet<String>) -> ReconcileReport {
        let _ops = self.serialise();
        let mut report = ReconcileReport::default();
        let mut uids: Vec<String> = std::fs::read_dir(self.config.mps_dir())
            .map(|entries| {
                entries
                    .flatten()
                    .filter(|e| e.path().is_dir())
                    .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                    .filter(|uid| crate::cdi::validate_claim_uid(uid).is_ok())
                    .collect()
            })
            .unwrap_or_default();
        uids.sort();
        // Daemons no directory names any more (state directory reset): only the launcher
        // can still find them. Live claims and directories that failed to reconcile keep
        // theirs.
        let mut keep: BTreeSet<String> = live_claims.clone();
        keep.extend(uids.iter().cloned());
        for uid in self.launcher.sweep(&keep) {
            report.stopped.push(uid);
        }
        for uid in uids {
            let dir = self.claim_dir(&uid);
            let record = match mps::load_record(&dir) {
                Ok(r) => r,
                Err(e) => {
                    report.failed.push((uid, e.to_string()));
                    continue;
                }
            };
            let result = if live_claims.contains(&uid) {
                match record {
                    Some(record) => self.keep_or_restart(&dir, record).map(|restarted| {
                        // A daemon restarted by an earlier reconciliation whose clients'
                        // specs were never rewritten (a crash came between) counts as
                        // restarted until they are.
                        if restarted || dir.join(mps::CLIENTS_STALE_FILE).exists() {
                            report.restarted.push(uid.clone());
                        } else {
                            report.kept.push(uid.clone());
                        }
                    }),
                    None => Err(SharingFailure::RecordMissing {
                        path: dir.join(mps::RECORD_FILE),
                    }),
                }
            } else {
                let stopped = match record {
                    Some(record) => self.stop_mps(&record),
                    None => self.stop_unrecorded(&uid),
                };
                stopped.map(|()| report.stopped.push(uid.clone()))
            };
            if let Err(e) = result {
                tracing::warn!(claim = %uid, error = %e, "reconciling MPS daemon");
                report.failed.push((uid, e.to_string()));
            }
        }
        report
    }

    /// The CDI specs of every client of the daemons `keys` were rewritten after their
    /// restart: their [`mps::CLIENTS_STALE_FILE`] markers go.
    pub fn clients_refreshed(&self, keys: &BTreeSet<String>) {
        let _ops = self.serialise();
        for key in keys
            .iter()
            .filter(|k| crate::cdi::validate_claim_uid(k).is_ok())
        {
            let marker = self.claim_dir(key).join(mps::CLIENTS_STALE_FILE);
            match std::fs::remove_file(&marker) {
                Ok(()) => {
                    tracing::debug!(daemon = %key, "clients of a restarted MPS daemon refreshed")
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(file = %marker.display(), error = %e, "removing the marker of a refreshed MPS daemon; its clients are refreshed again at the next check")
                }
            }
        }
    }

    fn keep_or_restart(&self, dir: &Path, mut record: MpsRecord) -> Result<bool, SharingFailure> {
        if self.holds_limits(&record) {
            return Ok(false);
        }
        tracing::info!(claim = %record.spec.claim_uid, "MPS daemon of a live claim is gone or lacks its limits; starting it again");
        // Whatever still runs for this daemon is stopped first: the recorded one when it
        // runs without its limits, and one a restart launched before a crash kept its handle
        // from the record (found by the launcher: its pid file, its pod).
        let found = self.launcher.find(&record.spec);
        for handle in record.daemon.take().into_iter().chain(found) {
            self.stop_daemon(&record.spec, &handle)?;
        }
        self.ensure_pipe_root()?;
        mps::create_dirs(dir, &record.spec)?;
        let stale = dir.join(mps::CLIENTS_STALE_FILE);
        write_file_atomic(&stale, b"").map_err(|source| SharingFailure::Io {
            op: "writing",
            path: stale,
            source,
        })?;
        for gpu in &record.exclusive_gpus {
            self.smi
                .set_compute_mode(gpu, ComputeMode::ExclusiveProcess)?;
        }
        self.launch_and_configure(dir, &mut record)?;
        Ok(true)
    }
}
