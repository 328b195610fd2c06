//! Command line: `run` (the daemon), `inspect` (print the discovered devices), `usage`
//! (what each claim was given and uses), `checkpoint reset` and `mps-daemon`; the flags
//! themselves are in [`crate::args`].

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::args::{
    CheckpointResetArgs, InspectArgs, LogArgs, MpsDaemonArgs, RunArgs, UsageCommandArgs,
};

/// cleave's kubelet plugin: a DRA driver for NVIDIA GPUs.
#[derive(Debug, Parser)]
#[command(name = "cleave-kubelet-plugin", version, about, long_about = None)]
pub(crate) struct Cli {
    /// Logging flags, accepted before or after the subcommand.
    #[command(flatten)]
    pub log: LogArgs,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
// Parsed once per process; boxing the large variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the node daemon: publish devices, register with the kubelet, serve DRA.
    Run(RunArgs),
    /// Print the GPUs and the devices this node would publish.
    Inspect(InspectArgs),
    /// Print, per prepared claim device, what it was given and what it uses (from the
    /// running plugin's metrics endpoint; a development build takes `--mock PROFILE` for a try).
    Usage(UsageCommandArgs),
    /// Checkpoint maintenance (recovery from an unreadable checkpoint).
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
    /// Entry point of a per-claim MPS daemon pod (started by `run --mps-launcher=pod`):
    /// starts the MPS control daemon, streams its log, and quits it on SIGTERM.
    MpsDaemon(MpsDaemonArgs),
}

/// `checkpoint` subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum CheckpointCommand {
    /// Move an unreadable checkpoint aside (`checkpoint.json.corrupt-<unix seconds>`); the
    /// plugin then starts with no prepared claims. Refuses while a plugin instance runs on
    /// the node, and refuses a checkpoint that reads and verifies unless `--force` (which
    /// lists the claims it abandons). Make sure no pod on the node uses a claim of this
    /// driver first.
    Reset(CheckpointResetArgs),
}

/// Entry point of the binary: parse, set up logging, run the subcommand.
pub fn main() -> ExitCode {
    let mut cli = Cli::parse();
    crate::install_crypto_provider();
    match run(&mut cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Applies the mock flags of `command` to the environment (before any thread starts);
/// for `usage --mock`, the try to run instead of asking a plugin.
#[cfg(feature = "mock")]
fn prepare_mock(command: &mut Command) -> anyhow::Result<Option<crate::mock::UsageTry>> {
    match command {
        Command::Run(a) => crate::mock::resolve_nvml(&mut a.nvml)?,
        Command::Inspect(a) => crate::mock::resolve_nvml(&mut a.nvml)?,
        Command::Usage(a) => {
            if let Some(profile) = &a.mock {
                return crate::mock::UsageTry::prepare_env(profile, a.recommend).map(Some);
            }
        }
        Command::Checkpoint(_) | Command::MpsDaemon(_) => {}
    }
    Ok(None)
}

fn run(cli: &mut Cli) -> anyhow::Result<ExitCode> {
    // Environment changes must happen while the process is single-threaded.
    #[cfg(feature = "mock")]
    let usage_mock = prepare_mock(&mut cli.command)?;
    // `usage` prints a table: only warnings go to the log unless asked for more.
    let default_level = match cli.command {
        Command::Usage(_) => "warn",
        _ => "info",
    };
    crate::telemetry::init(
        cli.log.log_format,
        Some(cli.log.log_level.as_deref().unwrap_or(default_level)),
    )
    .map_err(anyhow::Error::msg)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match &cli.command {
        Command::Run(args) => runtime.block_on(crate::daemon::run(args.clone())),
        Command::Inspect(args) => crate::inspect::run(args),
        Command::Usage(args) => {
            #[cfg(feature = "mock")]
            if let Some(m) = &usage_mock {
                print!("{}", m.run(args.recommend, args.by.as_deref())?);
                return Ok(ExitCode::SUCCESS);
            }
            print!("{}", crate::node::usage::run_command(args)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Checkpoint(CheckpointCommand::Reset(args)) => checkpoint_reset(args),
        Command::MpsDaemon(args) => runtime.block_on(crate::mps_daemon::run(args.clone())),
    }
}

fn checkpoint_reset(args: &CheckpointResetArgs) -> anyhow::Result<ExitCode> {
    let state_dir = args.plugins_dir.join(&args.driver_name);
    let options = crate::node::lifecycle::ResetOptions {
        force: args.force,
        remove_cdi_specs_in: args.remove_cdi_specs.then(|| args.cdi_root.clone()),
    };
    match crate::node::lifecycle::reset_checkpoint(&state_dir, &options)? {
        crate::node::lifecycle::ResetOutcome::Missing => {
            println!("no checkpoint in {}: nothing to reset", state_dir.display());
        }
        crate::node::lifecycle::ResetOutcome::MovedAside {
            moved_to,
            held,
            abandoned,
            left_behind,
            removed_specs,
        } => {
            println!("the checkpoint held: {held}");
            for claim in &abandoned {
                println!("abandoned claim: {claim}");
            }
            for spec in &removed_specs {
                println!("removed CDI spec: {}", spec.display());
            }
            for item in &left_behind {
                println!("left on the node: {item}");
            }
            println!(
                "moved to {}; the plugin starts with no prepared claims (it picks this up on its next retry)",
                moved_to.display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::{MpsArgs, MpsLauncherKind};
    use crate::telemetry::LogFormat;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn run_defaults_match_kubelet_layout() {
        let cli = Cli::try_parse_from(["x", "run", "--node-name", "n1"]).unwrap();
        let Command::Run(a) = cli.command else {
            panic!()
        };
        assert_eq!(a.node_name, "n1");
        let c = crate::start::plugin_config(&a.kubelet);
        assert_eq!(c.driver_name, "gpu.cleave.dev");
        assert_eq!(
            c.registration_socket(),
            std::path::Path::new("/var/lib/kubelet/plugins_registry/gpu.cleave.dev-reg.sock")
        );
        assert_eq!(
            c.dra_socket(),
            std::path::Path::new("/var/lib/kubelet/plugins/gpu.cleave.dev/dra.sock")
        );
        assert_eq!(a.driver.cdi_root, std::path::Path::new("/var/run/cdi"));
        assert_eq!(a.driver.driver_root, std::path::Path::new("/"));
        assert!(!a.driver.dynamic_mig && !a.uninstall);
    }

    #[test]
    fn mps_defaults_match_the_flags() {
        let cli = Cli::try_parse_from(["x", "run", "--node-name", "n1"]).unwrap();
        let Command::Run(a) = cli.command else {
            panic!()
        };
        let d = MpsArgs::default();
        assert_eq!(a.mps.mps_launcher, d.mps_launcher);
        assert_eq!(
            a.mps.mps_daemon_image_pull_policy,
            d.mps_daemon_image_pull_policy
        );
        assert_eq!(a.mps.kubelet_root_dir, d.kubelet_root_dir);
        assert_eq!(a.mps.mps_check_interval_secs, d.mps_check_interval_secs);
        let cli = Cli::try_parse_from(["x", "run", "--node-name", "n1", "--mps-launcher", "pod"])
            .unwrap();
        let Command::Run(a) = cli.command else {
            panic!()
        };
        assert_eq!(a.mps.mps_launcher, MpsLauncherKind::Pod);
        assert!(
            Cli::try_parse_from(["x", "run", "--node-name", "n1", "--mps-launcher", "x"]).is_err()
        );
        let cli = Cli::try_parse_from(["x", "mps-daemon"]).unwrap();
        let Command::MpsDaemon(a) = cli.command else {
            panic!()
        };
        assert_eq!(a.driver_root, std::path::Path::new("/driver-root"));
    }

    #[test]
    fn node_name_is_checked_at_parse_time() {
        for bad in ["Node_A", "", &"a".repeat(300)] {
            let e = Cli::try_parse_from(["x", "run", "--node-name", bad]).unwrap_err();
            let text = e.to_string();
            assert!(text.contains("--node-name"), "{text}");
            assert!(text.contains("not a Kubernetes node name"), "{text}");
        }
        assert!(Cli::try_parse_from(["x", "inspect", "--node-name", "Node_A"]).is_err());
        assert!(Cli::try_parse_from(["x", "run", "--node-name", "gpu-node-1.example"]).is_ok());
    }

    #[test]
    fn claim_pod_labels_parse_and_bad_keys_are_refused() {
        let run = |v: &str| {
            Cli::try_parse_from(["x", "run", "--node-name", "n1", "--claim-pod-labels", v])
        };
        let Command::Run(a) = run("team, example.com/model").unwrap().command else {
            panic!()
        };
        assert_eq!(
            a.usage.claim_pod_labels.0,
            vec!["team", "example.com/model"]
        );
        let Command::Run(a) = Cli::try_parse_from(["x", "run", "--node-name", "n1"])
            .unwrap()
            .command
        else {
            panic!()
        };
        assert!(a.usage.claim_pod_labels.0.is_empty());
        let err = run("team,-bad").unwrap_err().to_string();
        assert!(err.contains("\"-bad\" is not a valid label key"), "{err}");
        let err = run("a,b,c,d,e,f,g,h,i").unwrap_err().to_string();
        assert!(err.contains("at most 8"), "{err}");
    }

    #[test]
    fn usage_flags_parse_and_bad_ones_name_the_fix() {
        let cli = Cli::try_parse_from(["x", "run", "--node-name", "n1"]).unwrap();
        let Command::Run(a) = cli.command else {
            panic!()
        };
        assert_eq!(a.usage.usage_interval, std::time::Duration::from_secs(10));
        assert_eq!(a.usage.idle_after, std::time::Duration::from_secs(1800));
        assert!(!a.usage.idle_events);
        let cli = Cli::try_parse_from([
            "x",
            "run",
            "--node-name",
            "n1",
            "--usage-interval",
            "0",
            "--idle-after",
            "90s",
            "--idle-threshold",
            "2.5",
            "--idle-events",
        ])
        .unwrap();
        let Command::Run(a) = cli.command else {
            panic!()
        };
        assert!(a.usage.usage_interval.is_zero());
        let p = a.usage.idle_policy();
        assert_eq!((p.threshold_percent, p.window.as_secs()), (2.5, 90));
        assert!(a.usage.idle_events);
        assert_eq!(
            crate::args::parse_duration("500ms"),
            Ok(std::time::Duration::from_millis(500))
        );
        assert_eq!(
            crate::args::parse_duration("1h"),
            Ok(std::time::Duration::from_secs(3600))
        );
        for (flag, bad, says) in [
            ("--usage-interval", "10 parsecs", "unknown unit"),
            ("--usage-interval", "soon", "500ms, 10s, 5m or 1h"),
            ("--idle-threshold", "150", "between 0 and 100"),
        ] {
            let e = Cli::try_parse_from(["x", "run", "--node-name", "n1", flag, bad])
                .unwrap_err()
                .to_string();
            assert!(e.contains(flag) && e.contains(says), "{e}");
        }
        let cli = Cli::try_parse_from(["x", "usage"]).unwrap();
        let Command::Usage(u) = cli.command else {
            panic!()
        };
        assert_eq!(u.metrics_addr, "127.0.0.1:9400");
        assert_eq!(u.scrapes, 2);
        assert!(Cli::try_parse_from(["x", "usage", "--scrapes", "0"]).is_err());
    }

    #[cfg(feature = "mock")]
    #[test]
    fn mock_conflicts_with_nvml_lib() {
        let r = Cli::try_parse_from(["x", "inspect", "--mock", "a", "--nvml-lib", "/x.so"]);
        assert!(r.is_err());
        let r = Cli::try_parse_from(["x", "inspect", "--mock", "a", "--mock-profile", "b"]);
        assert!(r.is_err(), "--mock names its profile itself");
    }

    #[test]
    fn log_flags_are_global() {
        let cli = Cli::try_parse_from([
            "x",
            "inspect",
            "--log-format",
            "json",
            "--log-level",
            "debug",
        ])
        .unwrap();
        assert_eq!(cli.log.log_format, LogFormat::Json);
        assert_eq!(cli.log.log_level.as_deref(), Some("debug"));
    }
}
