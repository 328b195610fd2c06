//! `usage --mock`: two sampling rounds over the mock NVML library.
//!
//! The try does not run the driver's prepare (that needs a driver root holding the
//! NVIDIA driver's files): it creates MIG devices on the mock as an administrator would,
//! describes the claims prepare would record on them (two notebooks, a training job, an
//! MPS claim), scripts their usage in the mock's control file, and renders the rounds
//! through the plugin's own metrics registry, so both ways print from the same exposition.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use cleave_driver::backend::GpuBackend as _;
use cleave_driver::model::Placement;
use cleave_driver::usage::{ClaimDevice, Holding, IdlePolicy};

use super::claims::MockClaim;
use super::set_env;
use crate::metrics::Metrics;
use crate::node::usage::UsageRounds;
use crate::node::usage::command::{Sample, parse_exposition, render};

/// The mock try's scratch files; the mock's environment must be set (by
/// [`UsageTry::prepare_env`]) while the process is single-threaded.
#[derive(Debug)]
pub(crate) struct UsageTry {
    dir: tempfile::TempDir,
    library: PathBuf,
}

impl UsageTry {
    /// Finds the mock library next to this executable and points the mock at scratch
    /// state with `profile` in MIG mode; for `--recommend`, half the profile's GPUs in MIG
    /// mode and the others whole (see [`super::recommend_try::mixed_node`]). Call before
    /// any thread starts.
    pub(crate) fn prepare_env(profile: &str, recommend: bool) -> anyhow::Result<Self> {
        let library = super::library_for("usage --mock")?;
        let dir = tempfile::tempdir().context("creating a scratch directory for the mock")?;
        let path = |name: &str| dir.path().join(name).display().to_string();
        std::fs::write(dir.path().join("control"), "")?;
        set_env("MOCK_NVML_PROFILE", profile);
        set_env("MOCK_NVML_MIG", "on");
        if recommend {
            let node = dir.path().join("node.yaml");
            std::fs::write(&node, super::recommend_try::mixed_node(profile)?)?;
            set_env("MOCK_NVML_CONFIG", &node.display().to_string());
            // Each GPU's own MIG mode from the file.
            set_env("MOCK_NVML_MIG", "");
        }
        set_env("MOCK_NVML_STATE", &path("state.json"));
        set_env("MOCK_NVML_CONTROL", &path("control"));
        Ok(Self { dir, library })
    }

    fn control(&self) -> PathBuf {
        self.dir.path().join("control")
    }

    /// The try's table: the scripted day's recommendations with `recommend`, else two
    /// rounds 200 ms apart, per claim device or grouped by `by`.
    pub(crate) fn run(&self, recommend: bool, by: Option<&str>) -> anyhow::Result<String> {
        if recommend {
            return super::recommend_try::run(&self.library, &self.control());
        }
        let scrapes = self.rounds(Duration::from_millis(200))?;
        Ok(match by {
            Some(by) => crate::node::usage::by_command::render(&scrapes, by),
            None => render(&scrapes, SystemTime::now()),
        })
    }

    /// Creates the MIG devices, scripts usage, takes two rounds `interval` apart and
    /// returns their expositions, parsed.
    fn rounds(&self, interval: Duration) -> anyhow::Result<Vec<Vec<Sample>>> {
        let backend = cleave_driver::nvml::NvmlBackend::open(Some(&self.library))
            .context("loading the mock NVML library")?;
        let inventory = backend.inventory().context("reading the mock's GPUs")?;
        anyhow::ensure!(
            inventory.gpus.len() >= 2,
            "usage --mock needs a profile with at least two MIG-capable GPUs (e.g. h100-80gb-x8)"
        );
        let source = backend
            .usage_source()
            .context("the mock backend has no usage source")?;
        let (devices, script) = mock_claims(&backend, &inventory)?;
        std::fs::write(self.control(), script)
            .with_context(|| format!("writing {}", self.control().display()))?;
        let metrics = Metrics::new();
        let gpus: Vec<(String, u64, Option<u32>)> = inventory
            .gpus
            .iter()
            .map(|g| (g.uuid.clone(), g.memory_bytes, g.multiprocessors))
            .collect();
        // Idle at once below 5 %: two rounds cannot show a longer window.
        let policy = IdlePolicy {
            threshold_percent: 5.0,
            window: Duration::ZERO,
        };
        let mut rounds = UsageRounds::new(source, policy);
        let mut scrapes = Vec::new();
        let start = Instant::now();
        for n in 0..2u32 {
            let now = start + interval * n;
            if n > 0 {
                std::thread::sleep(now.saturating_duration_since(Instant::now()));
            }
            let r = rounds.round(&devices, now);
            metrics
                .usage
                .apply_round("mock-node", &r, &gpus, now, SystemTime::now());
            scrapes.push(parse_exposition(&metrics.encode())?);
        }
        Ok(scrapes)
    }
}

/// The mock try's claims on MIG devices created for them, and the control-file lines that
/// script their usage.
fn mock_claims(
    backend: &cleave_driver::nvml::NvmlBackend,
    inventory: &cleave_driver::model::NodeInventory,
) -> anyhow::Result<(Vec<ClaimDevice>, String)> {
    use cleave_driver::model::MigState;
    let mut devices = Vec::new();
    let mut script = String::new();
    // (namespace, claim, GPU index, kind, scripted lines per (gpu, gi))
    let plan: [(&str, &str, usize, Holding); 4] = [
        ("team-a", "notebook-1", 0, Holding::Mig),
        ("team-a", "notebook-2", 0, Holding::Mig),
        ("team-b", "training", 1, Holding::Mig),
        ("team-b", "inference-mps", 1, Holding::Mps),
    ];
    let mut next_start: BTreeMap<usize, u32> = BTreeMap::new();
    for (n, (ns, name, g, kind)) in plan.into_iter().enumerate() {
        let gpu = &inventory.gpus[g];
        let MigState::Enabled { profiles, .. } = &gpu.mig else {
            anyhow::bail!("usage --mock: GPU {} is not in MIG mode", gpu.uuid);
        };
        let profile = profiles
            .iter()
            .min_by_key(|p| p.slice_count)
            .context("usage --mock: the GPU lists no MIG profile")?;
        let start = next_start.entry(g).or_insert(0);
        let mig = backend
            .create_mig(
                &gpu.uuid,
                profile.id,
                Placement {
                    start: *start,
                    size: profile.slice_count,
                },
            )
            .with_context(|| format!("creating a {} instance on the mock", profile.name))?;
        *start += profile.slice_count;
        let pid = 4000 + n as u32;
        let (mib, act) = [(6144, 62.5), (300, 0.5), (9000, 91.0), (2048, 0.0)][n];
        match kind {
            Holding::Mps => {
                let _ = writeln!(script, "process {g} {} 0 {pid} {mib} 40", mig.gi_id);
            }
            _ => {
                let _ = writeln!(script, "memory {g} {} 0 {mib}", mig.gi_id);
                let _ = writeln!(script, "gpm {g} {} {act} {}", mig.gi_id, act / 2.0);
            }
        }
        let claim = MockClaim {
            namespace: ns,
            name,
            kind,
            pids: if kind == Holding::Mps {
                vec![pid]
            } else {
                Vec::new()
            },
        };
        devices.push(claim.on_mig(gpu, profile, &mig));
    }
    Ok((devices, script))
}
