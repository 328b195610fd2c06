//! Time-slicing and compute modes through `nvidia-smi`, and which claims need a time slice.
//!
//! `nvidia-smi compute-policy -i <uuid> --set-timeslice <0..3>` sets the scheduler's slice of
//! a whole GPU (Default=0, Short=1, Medium=2, Long=3). The value is a separate argument, as
//! NVIDIA's DRA driver passes it on hardware (kubernetes-sigs/dra-driver-nvidia-gpu
//! `cmd/gpu-kubelet-plugin/nvlib.go`, `setTimeSlice`); whether the tool also takes
//! `--set-timeslice=<n>` is unverified. A GPU without compute-policy support (Pascal, e.g.
//! Tesla P4) answers `... : Not Supported` with exit status 3: that is an error of the claim
//! naming the GPU, except for `Default`, which such a GPU already runs (nothing to set).
//! Neither setting survives a reboot; the driver sets them again for prepared claims. It is not supported on MIG devices,
//! which run in their parent GPU's slice: a MIG device with `interval: Default` needs
//! nothing (no call), any other interval is an error (the config API rejects it already;
//! this is the second line). The interval a GPU needs is derived from the checkpoint (the
//! effective config recorded with every prepared device, handed in by the prepare state
//! machine as [`TimeSliceNeed`]s), never from memory, so that a restart does not lose count:
//! at release the default is restored only when no other recorded claim on that GPU still
//! needs a non-default interval.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use cleave_api::config::{DeviceKind, TimeSliceInterval};
use serde::{Deserialize, Serialize};

use super::process;
use super::{SharingDevice, SharingFailure, SharingManager, TimeSliceNeed};

/// GPU compute modes cleave sets (`nvidia-smi -c`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeMode {
    /// Many processes per GPU.
    Default,
    /// One process (the MPS server) per GPU.
    ExclusiveProcess,
}

impl ComputeMode {
    fn arg(self) -> &'static str {
        match self {
            Self::Default => "DEFAULT",
            Self::ExclusiveProcess => "EXCLUSIVE_PROCESS",
        }
    }
}

/// Runs `nvidia-smi` with a deadline; failures name the arguments and what it printed.
#[derive(Debug, Clone)]
pub struct NvidiaSmi {
    bin: PathBuf,
    extra_env: Vec<(String, String)>,
    timeout: Duration,
}

impl NvidiaSmi {
    /// `bin` run with `extra_env` added, killed after `timeout`.
    pub fn new(
        bin: impl Into<PathBuf>,
        extra_env: Vec<(String, String)>,
        timeout: Duration,
    ) -> Self {
        Self {
            bin: bin.into(),
            extra_env,
            timeout,
        }
    }

    fn run(&self, args: &[&str]) -> Result<(), SharingFailure> {
        self.output(args).and_then(|o| o.into_result())
    }

    /// Runs `nvidia-smi args` and returns what it did; `Err` only when it did not finish.
    fn output(&self, args: &[&str]) -> Result<SmiOutput, SharingFailure> {
        let mut cmd = Command::new(&self.bin);
        cmd.args(args)
            .envs(self.extra_env.iter().map(|(k, v)| (k, v)));
        let failure = |message: String| SharingFailure::Tool {
            tool: self.bin.clone(),
            args: args.join(" "),
            message,
        };
        let out = process::run_with_input(&mut cmd, "", self.timeout)
            .map_err(|e| failure(e.to_string()))?;
        // Where the tool prints its errors (stdout or stderr) is not documented: both count.
        let text = [out.stdout.trim(), out.stderr.trim()]
            .into_iter()
            .filter(|t| !t.is_empty())
            .collect::<Vec<_>>()
            .join("\n")
            .replace('\n', " | ");
        let failure =
            (!out.status.success()).then(|| failure(format!("exited with {}: {text}", out.status)));
        Ok(SmiOutput {
            code: out.status.code(),
            text,
            failure,
        })
    }

    /// `nvidia-smi -i <gpu> -c <mode>`.
    pub fn set_compute_mode(
        &self,
        gpu_uuid: &str,
        mode: ComputeMode,
    ) -> Result<(), SharingFailure> {
        self.run(&["-i", gpu_uuid, "-c", mode.arg()])
    }

    /// `nvidia-smi compute-policy -i <gpu> --set-timeslice <n>`. Exit status 3 or `Not
    /// Supported` in the output: [`SharingFailure::TimeSliceNotSupported`], except for
    /// `Default` (logged; the GPU runs its default slice anyway).
    pub(crate) fn set_timeslice(
        &self,
        gpu_uuid: &str,
        interval: TimeSliceInterval,
    ) -> Result<(), SharingFailure> {
        let value = interval.timeslice_value().to_string();
        let out = self.output(&["compute-policy", "-i", gpu_uuid, "--set-timeslice", &value])?;
        if out.failure.is_some() && out.not_supported() {
            if interval == TimeSliceInterval::Default {
                tracing::warn!(gpu = %gpu_uuid, output = %out.text, "GPU does not support compute-policy time slices; it keeps its default slice");
                return Ok(());
            }
            return Err(SharingFailure::TimeSliceNotSupported {
                gpu: gpu_uuid.to_owned(),
                interval,
                output: out.text,
            });
        }
        out.into_result()
    }
}

/// What one `nvidia-smi` call did.
struct SmiOutput {
    /// Exit status (`None`: killed by a signal).
    code: Option<i32>,
    /// stdout and stderr, trimmed, joined by ` | `.
    text: String,
    /// The failure to report when the exit status was not 0.
    failure: Option<SharingFailure>,
}

impl SmiOutput {
    /// Exit status 3 ("operation not available on target device") or `Not Supported`.
    fn not_supported(&self) -> bool {
        self.code == Some(EXIT_NOT_SUPPORTED) || self.text.contains("Not Supported")
    }

    fn into_result(self) -> Result<(), SharingFailure> {
        self.failure.map_or(Ok(()), Err)
    }
}

/// `nvidia-smi` exit status for "operation not available on target device" (man page,
/// RETURN VALUE).
pub(super) const EXIT_NOT_SUPPORTED: i32 = 3;

/// A time slice set on a whole GPU for a claim (kept in the claim's sharing state).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TimeSliceSetting {
    /// GPU UUID.
    pub gpu_uuid: String,
    /// The interval set.
    pub interval: TimeSliceInterval,
}

impl SharingManager {
    /// Sets the time slices the claim's time-sliced `devices` ask for (each with its
    /// interval), after checking all of them; on failure the ones already set are restored.
    /// Returns what was set, for the claim's state.
    pub(super) fn apply_timeslices(
        &self,
        claim_uid: &str,
        devices: &[(&SharingDevice, TimeSliceInterval)],
        needs: &[TimeSliceNeed],
    ) -> Result<Vec<TimeSliceSetting>, SharingFailure> {
        let plan = self.plan_timeslices(claim_uid, devices, needs)?;
        for (i, setting) in plan.iter().enumerate() {
            if let Err(e) = self.smi.set_timeslice(&setting.gpu_uuid, setting.interval) {
                self.restore_timeslices(claim_uid, &plan[..i], needs);
                return Err(e);
            }
        }
        Ok(plan)
    }

    /// Restores the time slices of the claim: those its state records, plus those its
    /// recorded configs ask for (`needs`), each unless another claim still needs it.
    pub(super) fn release_timeslices(
        &self,
        claim_uid: &str,
        mut set: Vec<TimeSliceSetting>,
        needs: &[TimeSliceNeed],
    ) -> Result<(), SharingFailure> {
        for need in needs {
            if need.claim_uid == claim_uid && !set.iter().any(|s| s.gpu_uuid == need.gpu_uuid) {
                set.push(TimeSliceSetting {
                    gpu_uuid: need.gpu_uuid.clone(),
                    interval: need.interval,
                });
            }
        }
        let mut first_error = None;
        for s in &set {
            if let Err(e) = self.restore_timeslice(claim_uid, s, needs) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn plan_timeslices(
        &self,
        claim_uid: &str,
        devices: &[(&SharingDevice, TimeSliceInterval)],
        needs: &[TimeSliceNeed],
    ) -> Result<Vec<TimeSliceSetting>, SharingFailure> {
        let mut plan: Vec<TimeSliceSetting> = Vec::new();
        if devices.is_empty() {
            return Ok(plan);
        }
        for (d, interval) in devices {
            if d.kind == DeviceKind::Mig || d.uuid.starts_with("MIG-") {
                // nvidia-smi compute-policy does not support MIG: a MIG device runs in its
                // parent GPU's time slice. The claim is served; the interval is not applied.
                if *interval == TimeSliceInterval::Default {
                    tracing::debug!(device = %d.device_name, "MIG device keeps its parent GPU's time slice");
                } else {
                    tracing::warn!(device = %d.device_name, uuid = %d.uuid, interval = %interval, "time slice not applied: a MIG device runs in its parent GPU's time slice (nvidia-smi compute-policy does not support MIG)");
                }
                continue;
            }
            if let Some(other) = needs.iter().find(|n| {
                n.claim_uid != claim_uid && n.gpu_uuid == d.uuid && n.interval != *interval
            }) {
                return Err(SharingFailure::TimeSliceConflict {
                    gpu: d.uuid.clone(),
                    claim: claim_uid.to_owned(),
                    interval: *interval,
                    other_claim: other.claim_uid.clone(),
                    other_interval: other.interval,
                });
            }
            if !plan.iter().any(|s| s.gpu_uuid == d.uuid) {
                plan.push(TimeSliceSetting {
                    gpu_uuid: d.uuid.clone(),
                    interval: *interval,
                });
            }
        }
        Ok(plan)
    }

    /// Restores the default slice on `setting`'s GPU unless another claim of `needs` still
    /// needs a non-default one there.
    fn restore_timeslice(
        &self,
        claim_uid: &str,
        setting: &TimeSliceSetting,
        needs: &[TimeSliceNeed],
    ) -> Result<(), SharingFailure> {
        if setting.interval == TimeSliceInterval::Default {
            return Ok(());
        }
        let still_needed = needs.iter().find(|n| {
            n.claim_uid != claim_uid
                && n.gpu_uuid == setting.gpu_uuid
                && n.interval != TimeSliceInterval::Default
        });
        if let Some(n) = still_needed {
            tracing::info!(gpu = %setting.gpu_uuid, other = %n.claim_uid, "time slice still needed by another claim; kept");
            return Ok(());
        }
        self.smi
            .set_timeslice(&setting.gpu_uuid, TimeSliceInterval::Default)
    }

    /// Best-effort rollback of time slices set by a failing apply.
    fn restore_timeslices(
        &self,
        claim_uid: &str,
        settings: &[TimeSliceSetting],
        needs: &[TimeSliceNeed],
    ) {
        for s in settings {
            if let Err(e) = self.restore_timeslice(claim_uid, s, needs) {
                tracing::error!(gpu = %s.gpu_uuid, error = %e, "rolling back a time slice");
            }
        }
    }
}
