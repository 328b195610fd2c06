//! What one sampling round yields: the samples, the idle view and, with right-sizing, the
//! windows and recommendations (its own module, so the metrics that read it and the rounds
//! that make it do not import each other).

use std::time::Duration;

use cleave_driver::usage::{ClaimRef, DeviceSample, IdleState};

use super::recommend;

/// A claim that turned idle: the subject and text of its `ClaimIdle` Event.
#[derive(Debug, Clone, PartialEq)]
pub struct IdleNotice {
    /// The claim.
    pub claim: ClaimRef,
    /// The Event's note (threshold, window and figures).
    pub note: String,
}

/// The outcome of one round.
#[derive(Debug, Clone)]
pub struct RoundOutcome {
    /// One sample per claim device.
    pub samples: Vec<DeviceSample>,
    /// The idle view of every claim in the round.
    pub idle: Vec<IdleState>,
    /// Claims that turned idle in this round (each once per idle period).
    pub newly_idle: Vec<IdleNotice>,
    /// How long the sampling took, waits at the gate not counted.
    pub took: Duration,
    /// How long the round waited for prepare and unprepare batches.
    pub waited: Duration,
    /// Windows and recommendations, when right-sizing runs and an inventory was given.
    pub rightsize: Option<recommend::RightsizeOutcome>,
}
