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

use cleave_api::config::TimeSliceInterval;
use serde::{Deserialize, Serialize};

use super::SharingFailure;
use super::process;
pub use crate::prepare::TimeSliceNeed;

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
    pub fn set_timeslice(
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
pub const EXIT_NOT_SUPPORTED: i32 = 3;

/// A time slice set on a whole GPU for a claim (kept in the claim's sharing state).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TimeSliceSetting {
    /// GPU UUID.
    pub gpu_uuid: String,
    /// The interval set.
    pub interval: TimeSliceInterval,
}
