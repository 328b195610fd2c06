//! [`SharingManager`]: the one type prepare holds. It serialises calls, splits a claim's
//! devices by strategy and hands each to its module (`per_claim`,
//! `shared`, `timeslice`); it decides nothing of its own.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};

use cleave_api::config::SharingStrategy;

use super::launcher::ProcessLauncher;
use super::mps::MpsTimings;
use super::per_claim::PlannedMps;
use super::timeslice::NvidiaSmi;
use super::{
    DaemonLauncher, ShareDevice, ShareHolder, SharingClaim, SharingConfig, SharingDevice,
    SharingEdits, SharingFailure, SharingHandler, SharingState, TimeSliceNeed,
};

/// Applies and releases sharing for claims; see the module docs. Calls are serialised.
pub struct SharingManager {
    pub(super) config: SharingConfig,
    pub(super) launcher: Arc<dyn DaemonLauncher>,
    pub(super) smi: NvidiaSmi,
    ops: Mutex<()>,
    pub(super) last_timings: Mutex<Option<MpsTimings>>,
}

impl std::fmt::Debug for SharingManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharingManager")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SharingManager {
    /// A manager launching daemons as host processes ([`ProcessLauncher`]).
    pub fn new(config: SharingConfig) -> Self {
        let launcher = ProcessLauncher::new(
            &config.binaries.mps_control,
            config.extra_env.clone(),
            &config.boot_id_path,
        );
        Self::with_launcher(config, Arc::new(launcher))
    }

    /// A manager with its own daemon launcher.
    pub fn with_launcher(config: SharingConfig, launcher: Arc<dyn DaemonLauncher>) -> Self {
        let smi = NvidiaSmi::new(
            &config.binaries.nvidia_smi,
            config.extra_env.clone(),
            config.command_timeout,
        );
        Self {
            config,
            launcher,
            smi,
            ops: Mutex::new(()),
            last_timings: Mutex::new(None),
        }
    }

    /// The settings.
    pub fn config(&self) -> &SharingConfig {
        &self.config
    }

    /// Where the time of the last successful MPS start went.
    pub fn last_mps_timings(&self) -> Option<MpsTimings> {
        *lock(&self.last_timings)
    }

    /// Holds the lock that serialises every sharing operation.
    pub(super) fn serialise(&self) -> MutexGuard<'_, ()> {
        lock(&self.ops)
    }

    /// Sets up sharing for the claim's `devices` and returns the CDI edits and the state to
    /// record ([`SharingState`]). A claim uses one strategy: its MPS devices go to
    /// `per_claim`, its time-sliced ones to `timeslice`. Everything is
    /// checked before anything changes; on failure nothing of this call is left behind.
    /// Calling it again with the same devices and settings while the daemon runs changes
    /// nothing and returns the same edits. `needs`: the time slices the recorded claims ask
    /// for (a conflict with another claim's is refused).
    pub fn apply_claim(
        &self,
        claim_uid: &str,
        devices: &[SharingDevice],
        needs: &[TimeSliceNeed],
    ) -> Result<SharingEdits, SharingFailure> {
        crate::cdi::validate_claim_uid(claim_uid)?;
        let _ops = self.serialise();
        let mut mps_devices = Vec::new();
        let mut ts_devices = Vec::new();
        for d in devices {
            match d.sharing.strategy {
                SharingStrategy::Mps => mps_devices.push(PlannedMps {
                    device: d,
                    config: d.sharing.mps.clone().unwrap_or_default(),
                }),
                SharingStrategy::TimeSlicing => ts_devices.push((
                    d,
                    d.sharing
                        .time_slicing
                        .as_ref()
                        .map(|t| t.interval_or_default())
                        .unwrap_or_default(),
                )),
            }
        }
        if !mps_devices.is_empty() && !ts_devices.is_empty() {
            return Err(SharingFailure::MixedStrategies {
                claim: claim_uid.to_owned(),
            });
        }
        let mut state = SharingState::default();
        let mut edits = SharingEdits::default();
        if mps_devices.is_empty() {
            state.time_slicing = self.apply_timeslices(claim_uid, &ts_devices, needs)?;
        } else {
            let record = self.apply_mps(claim_uid, &mps_devices)?;
            edits.claim_edits = self.client_edits(&record);
            // Only the key: the daemon's record is its `daemon.json`, kept current there.
            state.mps_daemon = Some(record.spec.claim_uid);
        }
        edits.state = Some(state);
        Ok(edits)
    }

    /// Undoes [`Self::apply_claim`]: stops the claim's daemon (as its `daemon.json` records
    /// it), restores compute modes and time slices no other recorded claim needs, removes the
    /// claim's MPS directory. Idempotent; works from the files on disk and the recorded
    /// `needs` when `state` is missing (a prepare interrupted before its state was recorded).
    /// A daemon record that does not decode fails the release and changes nothing
    /// ([`SharingFailure::RecordUnreadable`]).
    pub fn release_claim(
        &self,
        claim_uid: &str,
        state: Option<&SharingState>,
        needs: &[TimeSliceNeed],
    ) -> Result<(), SharingFailure> {
        crate::cdi::validate_claim_uid(claim_uid)?;
        let _ops = self.serialise();
        let state = state.cloned().unwrap_or_default();
        // A per-claim daemon's key is the claim UID. It is looked for when the state names
        // it (a missing record then leaves what the launcher finds), or when its directory
        // exists (an interrupted prepare, or a claim whose state was not recorded).
        if state.mps_daemon.is_some() || self.claim_dir(claim_uid).exists() {
            self.release_daemon(claim_uid)?;
        }
        self.release_timeslices(claim_uid, state.time_slicing, needs)
    }
}

impl SharingHandler for SharingManager {
    fn apply(
        &self,
        claim: &SharingClaim<'_>,
        devices: &[SharingDevice],
        needs: &[TimeSliceNeed],
    ) -> Result<SharingEdits, SharingFailure> {
        self.apply_claim(claim.uid, devices, needs)
            .map_err(|e| e.applying(claim.uid))
    }

    fn release(
        &self,
        claim_uid: &str,
        state: Option<&SharingState>,
        needs: &[TimeSliceNeed],
    ) -> Result<(), SharingFailure> {
        self.release_claim(claim_uid, state, needs)
            .map_err(|e| e.releasing(claim_uid))
    }

    fn apply_shares(
        &self,
        claim: &SharingClaim<'_>,
        shares: &[ShareDevice],
        holders: &[ShareHolder],
    ) -> Result<SharingEdits, SharingFailure> {
        self.apply_shares_of(claim.uid, claim.namespace, shares, holders)
            .map_err(|e| e.applying(claim.uid))
    }

    fn release_shares(
        &self,
        claim: &SharingClaim<'_>,
        shares: &[ShareDevice],
        holders: &[ShareHolder],
    ) -> Result<(), SharingFailure> {
        self.release_shares_of(claim.uid, claim.namespace, shares, holders)
            .map_err(|e| e.releasing(claim.uid))
    }

    fn clients_refreshed(&self, keys: &BTreeSet<String>) {
        SharingManager::clients_refreshed(self, keys);
    }

    fn reconcile(&self, live_claims: &BTreeSet<String>) -> BTreeSet<String> {
        let report = SharingManager::reconcile(self, live_claims);
        if report.restarted.is_empty() && report.stopped.is_empty() && report.failed.is_empty() {
            tracing::debug!(kept = report.kept.len(), "MPS daemons checked");
        } else {
            tracing::info!(
                kept = report.kept.len(),
                restarted = report.restarted.len(),
                stopped = report.stopped.len(),
                failed = report.failed.len(),
                "reconciled MPS daemons"
            );
        }
        for (claim, error) in &report.failed {
            tracing::error!(claim = %claim, error = %error, "reconciling the MPS daemon failed");
        }
        report.restarted.into_iter().collect()
    }
}
