//! The seam where a sharing strategy (time-slicing, MPS) plugs into prepare and unprepare.
//!
//! Prepare decodes and merges the claim's configs; for the devices whose effective config
//! has a `sharing` block it calls [`SharingHandler::apply`] after any MIG instance exists and
//! before the CDI spec is written, and puts the returned edits into the spec. Unprepare (and
//! the rollback of a failed or interrupted prepare) calls [`SharingHandler::release`] with the
//! state `apply` returned, as recorded in the checkpoint. [`NoopSharing`] accepts every
//! strategy and sets nothing up: devices are then used exclusively by the claim's containers
//! (which still share the device through the GPU's default scheduler).

use std::collections::{BTreeMap, BTreeSet};

use cleave_api::config::{DeviceKind, Sharing};

use crate::cdi::ContainerEdits;

/// The claim whose devices are being shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharingClaim<'a> {
    /// Claim UID.
    pub uid: &'a str,
    /// Claim namespace.
    pub namespace: &'a str,
    /// Claim name.
    pub name: &'a str,
}

/// One device of the claim with a sharing config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharingDevice {
    /// Device name in the pool.
    pub device_name: String,
    /// Whole GPU or MIG device.
    pub kind: DeviceKind,
    /// UUID of the device (`GPU-…` or `MIG-…`).
    pub uuid: String,
    /// UUID of the (parent) GPU.
    pub gpu_uuid: String,
    /// The effective sharing block (defaults applied, validated).
    pub sharing: Sharing,
}

/// What a sharing strategy adds to the claim's CDI spec and records in the checkpoint.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SharingEdits {
    /// Edits for every container that gets any device of the claim (e.g. the MPS pipe
    /// directory mount and client env).
    pub claim_edits: ContainerEdits,
    /// Extra edits per device name.
    pub device_edits: BTreeMap<String, ContainerEdits>,
    /// State to keep in the checkpoint and hand back to [`SharingHandler::release`].
    pub state: Option<serde_json::Value>,
}

/// A sharing strategy failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SharingError {
    /// Setting up sharing failed.
    #[error("setting up sharing for claim {claim}: {message}")]
    Apply {
        /// Claim UID.
        claim: String,
        /// What failed.
        message: String,
    },
    /// Tearing sharing down failed.
    #[error("releasing sharing of claim {claim}: {message}")]
    Release {
        /// Claim UID.
        claim: String,
        /// What failed.
        message: String,
    },
}

/// A sharing strategy implementation (time-slicing settings, per-claim MPS daemons).
///
/// Calls come with the node driver's lock held, one at a time. Both methods must be
/// idempotent: after a crash, `release` may be called for a claim whose `apply` never
/// finished (with `state` `None`), and `apply` may run again for the same claim.
pub trait SharingHandler: Send + Sync {
    /// Sets up sharing for `devices` (each with its effective sharing config) of `claim`.
    fn apply(
        &self,
        claim: &SharingClaim<'_>,
        devices: &[SharingDevice],
    ) -> Result<SharingEdits, SharingError>;

    /// Undoes [`apply`](Self::apply) for the claim; `state` is what `apply` returned.
    fn release(
        &self,
        claim_uid: &str,
        state: Option<&serde_json::Value>,
    ) -> Result<(), SharingError>;

    /// Called once at start, after interrupted prepares were rolled back, with the UIDs of
    /// the claims the checkpoint still holds: re-find what outlived the previous plugin
    /// process (MPS daemons), start again what died for live claims, stop what belongs to
    /// claims that are gone. Failures are logged, never fatal. Returns the live claims whose
    /// sharing was started again (their CDI edits may differ: the driver applies and writes
    /// them anew). Default: nothing to do.
    fn reconcile(&self, _live_claims: &BTreeSet<String>) -> BTreeSet<String> {
        BTreeSet::new()
    }
}

/// Accepts every sharing config and sets nothing up (until the strategies are implemented).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoopSharing;

impl SharingHandler for NoopSharing {
    fn apply(
        &self,
        claim: &SharingClaim<'_>,
        devices: &[SharingDevice],
    ) -> Result<SharingEdits, SharingError> {
        for d in devices {
            tracing::warn!(
                claim = claim.uid,
                device = %d.device_name,
                strategy = %d.sharing.strategy,
                "sharing strategy accepted but not applied by this release; the device is used without it"
            );
        }
        Ok(SharingEdits::default())
    }

    fn release(
        &self,
        _claim_uid: &str,
        _state: Option<&serde_json::Value>,
    ) -> Result<(), SharingError> {
        Ok(())
    }
}
