//! Command line: `run` (the daemon), `inspect` (print the discovered devices), `checkpoint
//! reset` and `mps-daemon`.
//!
//! Every node-facing flag can also be set through the environment (the DaemonSet sets
//! `NODE_NAME` and `POD_UID` through the downward API).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::server::PluginConfig;
use crate::telemetry::LogFormat;

/// cleave's kubelet plugin: a DRA driver for NVIDIA GPUs.
#[derive(Debug, Parser)]
#[command(name = "cleave-kubelet-plugin", version, about, long_about = None)]
pub struct Cli {
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
pub enum Command {
    /// Run the node daemon: publish devices, register with the kubelet, serve DRA.
    Run(RunArgs),
    /// Print the GPUs and the devices this node would publish.
    Inspect(InspectArgs),
    /// Checkpoint maintenance (recovery from an unreadable checkpoint).
    #[command(subcommand)]
    Checkpoint(CheckpointCommand),
    /// Entry point of a per-claim MPS daemon pod (started by `run --mps-launcher=pod`):
    /// starts the MPS control daemon, streams its log, and quits it on SIGTERM.
    MpsDaemon(MpsDaemonArgs),
}

/// How claims' MPS control daemons are run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MpsLauncherKind {
    /// As detached host processes of the plugin (local runs, tests).
    Process,
    /// Each in a pod of its own on this node, created through the API (clusters).
    Pod,
}

/// Where and how per-claim MPS daemons run.
#[derive(Debug, Clone, Args)]
pub struct MpsArgs {
    /// Run MPS control daemons as host processes or in pods of their own.
    #[arg(long, env = "MPS_LAUNCHER", value_enum, default_value_t = MpsLauncherKind::Process)]
    pub mps_launcher: MpsLauncherKind,
    /// Image of the MPS daemon pods (holds this binary; the chart passes the plugin image).
    #[arg(long, env = "MPS_DAEMON_IMAGE")]
    pub mps_daemon_image: Option<String>,
    /// Pull policy of the MPS daemon pods' image.
    #[arg(
        long,
        env = "MPS_DAEMON_IMAGE_PULL_POLICY",
        default_value = "IfNotPresent"
    )]
    pub mps_daemon_image_pull_policy: String,
    /// Priority class of the MPS daemon pods (none: the namespace default).
    #[arg(long, env = "MPS_DAEMON_PRIORITY_CLASS")]
    pub mps_daemon_priority_class: Option<String>,
    /// Service account of the MPS daemon pods (none: the namespace's default; they call
    /// no API).
    #[arg(long, env = "MPS_DAEMON_SERVICE_ACCOUNT")]
    pub mps_daemon_service_account: Option<String>,
    /// Namespace of this plugin's pod; MPS daemon pods are created there.
    #[arg(long, env = "POD_NAMESPACE")]
    pub namespace: Option<String>,
    /// Name of this plugin's pod: its controller (the DaemonSet) owns the MPS daemon pods,
    /// so uninstalling removes them. Without it the Node owns them.
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// The kubelet's root directory on the host: a daemon pod's `/dev/shm` (a memory
    /// emptyDir) lies under it and is mounted into the claim's containers.
    #[arg(long, env = "KUBELET_ROOT_DIR", default_value = "/var/lib/kubelet")]
    pub kubelet_root_dir: PathBuf,
    /// Seconds between checks that the MPS daemons of prepared claims run (dead ones are
    /// started again, with their claims' CDI specs rewritten); 0: only at start.
    #[arg(long, env = "MPS_CHECK_INTERVAL_SECS", default_value_t = 30)]
    pub mps_check_interval_secs: u64,
}

impl Default for MpsArgs {
    /// Host processes; the flag defaults otherwise.
    fn default() -> Self {
        Self {
            mps_launcher: MpsLauncherKind::Process,
            mps_daemon_image: None,
            mps_daemon_image_pull_policy: "IfNotPresent".to_owned(),
            mps_daemon_priority_class: None,
            mps_daemon_service_account: None,
            namespace: None,
            pod_name: None,
            kubelet_root_dir: PathBuf::from("/var/lib/kubelet"),
            mps_check_interval_secs: 30,
        }
    }
}

/// Arguments of `mps-daemon` (set by the pod the plugin creates, not by hand).
#[derive(Debug, Clone, Args)]
pub struct MpsDaemonArgs {
    /// The NVIDIA driver root as mounted in this container.
    #[arg(long, env = "NVIDIA_DRIVER_ROOT", default_value = "/driver-root")]
    pub driver_root: PathBuf,
    /// `nvidia-cuda-mps-control` to run (default: under --driver-root).
    #[arg(long, env = "MPS_CONTROL_BIN")]
    pub mps_control_bin: Option<PathBuf>,
    /// Scratch directory for links to the driver's libraries (the tool loads them from
    /// there, never the host's C library).
    #[arg(long, default_value = "/run/cleave-mps/lib")]
    pub lib_dir: PathBuf,
    /// Start the daemon in multi-user mode (`-d -M`; the claim's `mps.multiUser`).
    #[arg(long)]
    pub multi_user: bool,
    /// How long the daemon may take to start (seconds).
    #[arg(long, default_value_t = 30)]
    pub start_timeout_secs: u64,
    /// How long the daemon may take to exit after `quit` before it is killed (seconds).
    #[arg(long, default_value_t = 20)]
    pub stop_timeout_secs: u64,
}

/// `checkpoint` subcommands.
#[derive(Debug, Subcommand)]
pub enum CheckpointCommand {
    /// Move an unreadable checkpoint aside (`checkpoint.json.corrupt-<unix seconds>`); the
    /// plugin then starts with no prepared claims. Refuses while a plugin instance runs on
    /// the node, and refuses a checkpoint that reads and verifies unless `--force` (which
    /// lists the claims it abandons). Make sure no pod on the node uses a claim of this
    /// driver first.
    Reset(CheckpointResetArgs),
}

/// Arguments of `checkpoint reset`.
#[derive(Debug, Clone, Args)]
pub struct CheckpointResetArgs {
    /// Kubelet plugins directory (the checkpoint is `<this>/<driver name>/checkpoint.json`).
    #[arg(
        long = "plugins-dir",
        env = "KUBELET_PLUGINS_DIRECTORY_PATH",
        default_value = "/var/lib/kubelet/plugins"
    )]
    pub plugins_dir: PathBuf,
    /// DRA driver name.
    #[arg(long, env = "DRIVER_NAME", default_value = cleave_api::names::DRIVER_NAME)]
    pub driver_name: String,
    /// Reset even a checkpoint that reads and verifies (or one written by a newer
    /// release), abandoning the claims it holds; they are listed.
    #[arg(long)]
    pub force: bool,
    /// Also delete the CDI spec files of the abandoned claims (under `--cdi-root`).
    #[arg(long)]
    pub remove_cdi_specs: bool,
    /// CDI spec directory the plugin writes claim specs to.
    #[arg(long, env = "CDI_ROOT", default_value = cleave_driver::cdi::DEFAULT_CDI_ROOT)]
    pub cdi_root: PathBuf,
}

/// Start-up retries and what counts as a usable node.
#[derive(Debug, Clone, Args)]
pub struct LifecycleArgs {
    /// First wait (ms) before retrying a start-up blocked by a missing NVIDIA driver or an
    /// unreadable checkpoint; doubled per failure.
    #[arg(long, env = "RETRY_INITIAL_MS", default_value_t = 1000)]
    pub retry_initial_ms: u64,
    /// Longest wait (ms) between those retries.
    #[arg(long, env = "RETRY_MAX_MS", default_value_t = 30000)]
    pub retry_max_ms: u64,
    /// Start (and publish an empty pool) when NVML loads but finds no GPU; without it, zero
    /// GPUs is treated as "driver not ready" and retried.
    #[arg(long, env = "ALLOW_NO_GPUS")]
    pub allow_no_gpus: bool,
    /// While the API server drops shared counters (feature gate DRAPartitionableDevices
    /// off) and the devices that need them are withheld, how often (seconds) to ask it
    /// again with a dry-run create.
    #[arg(long, env = "COUNTER_PROBE_INTERVAL_SECS", default_value_t = 60)]
    pub counter_probe_interval_secs: u64,
}

impl Default for LifecycleArgs {
    fn default() -> Self {
        Self {
            retry_initial_ms: 1000,
            retry_max_ms: 30000,
            allow_no_gpus: false,
            counter_probe_interval_secs: 60,
        }
    }
}

/// Log format and level.
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Log line format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    /// Log filter (`info`, `debug`, `cleave_kubelet_plugin=debug,info`, ...).
    #[arg(long, env = "RUST_LOG", global = true)]
    pub log_level: Option<String>,
}

/// Where the kubelet looks for the plugin.
#[derive(Debug, Clone, Args)]
pub struct KubeletArgs {
    /// DRA driver name.
    #[arg(long, env = "DRIVER_NAME", default_value = cleave_api::names::DRIVER_NAME)]
    pub driver_name: String,
    /// Kubelet plugin registration directory.
    #[arg(
        long,
        env = "KUBELET_REGISTRAR_DIRECTORY_PATH",
        default_value = "/var/lib/kubelet/plugins_registry"
    )]
    pub kubelet_registrar_directory_path: PathBuf,
    /// Kubelet plugins directory; the driver keeps its sockets and state in
    /// `<this>/<driver name>/`.
    #[arg(
        long,
        env = "KUBELET_PLUGINS_DIRECTORY_PATH",
        default_value = "/var/lib/kubelet/plugins"
    )]
    pub kubelet_plugins_directory_path: PathBuf,
    /// UID of this plugin's pod; socket names carry it so that a new pod can register
    /// beside the old one during a rolling update.
    #[arg(long, env = "POD_UID")]
    pub pod_uid: Option<String>,
}

impl KubeletArgs {
    /// The socket and state layout these flags describe.
    pub fn plugin_config(&self) -> PluginConfig {
        PluginConfig::new(
            self.driver_name.clone(),
            self.kubelet_registrar_directory_path.clone(),
            self.kubelet_plugins_directory_path.clone(),
        )
        .with_pod_uid(self.pod_uid.clone())
    }
}

/// Which NVML library to load.
#[derive(Debug, Clone, Args)]
pub struct NvmlArgs {
    /// NVML library to load (default: the system's libnvidia-ml.so.1).
    #[arg(long, env = "NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,
    /// Node profile for the mock NVML library (given with --nvml-lib, or installed in the
    /// driver root as its libnvidia-ml.so.1); real NVML ignores it.
    #[arg(long, env = "MOCK_NVML_PROFILE")]
    pub mock_profile: Option<String>,
    /// Use the mock NVML library found next to this executable, with this node profile
    /// (e.g. h100-80gb-x8).
    #[arg(long, conflicts_with_all = ["nvml_lib", "mock_profile"])]
    pub mock: Option<String>,
}

/// How the driver prepares devices.
#[derive(Debug, Clone, Args)]
pub struct DriverArgs {
    /// Directory for the claims' CDI spec files.
    #[arg(long, env = "CDI_ROOT", default_value = "/var/run/cdi")]
    pub cdi_root: PathBuf,
    /// Where the NVIDIA driver's files are mounted (libraries, binaries, device nodes).
    #[arg(long, env = "NVIDIA_DRIVER_ROOT", default_value = "/")]
    pub driver_root: PathBuf,
    /// The driver root as the host (the container runtime) sees it, when it differs from
    /// --driver-root (e.g. `/run/nvidia/driver` mounted at `/driver-root`); CDI mount
    /// sources start here.
    #[arg(long, env = "HOST_DRIVER_ROOT")]
    pub host_driver_root: Option<PathBuf>,
    /// `nvidia-cuda-mps-control` to run for MPS claims (default: under the driver root).
    #[arg(long, env = "MPS_CONTROL_BIN")]
    pub mps_control_bin: Option<PathBuf>,
    /// `nvidia-smi` for time-slicing and compute mode (default: under the driver root).
    #[arg(long, env = "NVIDIA_SMI_BIN")]
    pub nvidia_smi_bin: Option<PathBuf>,
    /// Publish every MIG placement and create MIG instances on prepare (needs the
    /// cluster's partitionable-devices support).
    #[arg(long, env = "DYNAMIC_MIG")]
    pub dynamic_mig: bool,
    /// cleave's CDI hook binary to install on the node and name in every CDI spec
    /// (default: `cleave-cdi-hook` beside this executable).
    #[arg(long, env = "CDI_HOOK_SOURCE")]
    pub cdi_hook_source: Option<PathBuf>,
    /// Write CDI specs without hooks (no soname links, no ld cache update in containers).
    #[arg(long, env = "DISABLE_CDI_HOOKS")]
    pub disable_cdi_hooks: bool,
}

/// Arguments of `run`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Name of this node (pool name and `spec.nodeName` of the slices); a Kubernetes node
    /// name, checked before anything starts.
    #[arg(long, env = "NODE_NAME", value_parser = parse_node_name)]
    pub node_name: String,
    /// Kubelet layout.
    #[command(flatten)]
    pub kubelet: KubeletArgs,
    /// Driver behaviour.
    #[command(flatten)]
    pub driver: DriverArgs,
    /// NVML library.
    #[command(flatten)]
    pub nvml: NvmlArgs,
    /// Device health checks.
    #[command(flatten)]
    pub health: crate::health::HealthArgs,
    /// Start-up retries.
    #[command(flatten)]
    pub lifecycle: LifecycleArgs,
    /// MPS daemons.
    #[command(flatten)]
    pub mps: MpsArgs,
    /// Kubeconfig file (default: in-cluster configuration, then ~/.kube/config).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Address for `/metrics` (Prometheus), `/healthz` and `/readyz`; none: not served.
    #[arg(long, env = "METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Delete this node's ResourceSlices of this driver and exit.
    #[arg(long)]
    pub uninstall: bool,
}

/// Arguments of `inspect`.
#[derive(Debug, Clone, Args)]
pub struct InspectArgs {
    /// NVML library.
    #[command(flatten)]
    pub nvml: NvmlArgs,
    /// Where the NVIDIA driver is installed; NVML is loaded from its library directories
    /// first (unless --nvml-lib or --mock names a library).
    #[arg(long, env = "NVIDIA_DRIVER_ROOT", default_value = "/")]
    pub driver_root: PathBuf,
    /// Show on-demand MIG placements instead of existing instances.
    #[arg(long, env = "DYNAMIC_MIG")]
    pub dynamic_mig: bool,
    /// Print ResourceSlice YAML instead of a table.
    #[arg(long)]
    pub yaml: bool,
    /// Node (and pool) name for the YAML (default: this host's name).
    #[arg(long, env = "NODE_NAME", value_parser = parse_node_name)]
    pub node_name: Option<String>,
    /// DRA driver name for the YAML.
    #[arg(long, env = "DRIVER_NAME", default_value = cleave_api::names::DRIVER_NAME)]
    pub driver_name: String,
    /// Kubernetes minor version whose slice layout the YAML follows (34: counter sets
    /// beside their devices; 35+: counter sets in their own slices).
    #[arg(long, default_value_t = 35)]
    pub kubernetes_minor: u32,
}

impl NvmlArgs {
    /// Resolves `--mock` to a library path and applies the mock profile to the
    /// environment. Call before any thread starts.
    pub fn resolve_mock(&mut self) -> anyhow::Result<()> {
        if let Some(profile) = self.mock.take() {
            let exe = std::env::current_exe()?;
            let lib = crate::mock::find_library(&exe).ok_or_else(|| {
                anyhow::anyhow!(
                    "--mock: no {} next to {} (build it with `cargo build -p cleave-mock-nvml`)",
                    crate::mock::MOCK_LIBRARY,
                    exe.display()
                )
            })?;
            self.nvml_lib = Some(lib);
            self.mock_profile = Some(profile);
        }
        if let Some(profile) = &self.mock_profile {
            crate::mock::set_env("MOCK_NVML_PROFILE", profile);
        }
        Ok(())
    }
}

/// Accepts a Kubernetes node name; clap names the flag (`--node-name`, or `NODE_NAME`) in
/// the error, so a typo fails at once instead of in every API call.
fn parse_node_name(value: &str) -> Result<String, String> {
    match cleave_api::names::node_name_problem(value) {
        None => Ok(value.to_owned()),
        Some(problem) => Err(format!(
            "not a Kubernetes node name: {problem} (set it to the Node object's name, e.g. from the downward API's spec.nodeName)"
        )),
    }
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

fn run(cli: &mut Cli) -> anyhow::Result<ExitCode> {
    // Environment changes must happen while the process is single-threaded.
    match &mut cli.command {
        Command::Run(a) => a.nvml.resolve_mock()?,
        Command::Inspect(a) => a.nvml.resolve_mock()?,
        Command::Checkpoint(_) | Command::MpsDaemon(_) => {}
    }
    crate::telemetry::init(
        cli.log.log_format,
        Some(cli.log.log_level.as_deref().unwrap_or("info")),
    )
    .map_err(anyhow::Error::msg)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match &cli.command {
        Command::Run(args) => runtime.block_on(crate::daemon::run(args.clone())),
        Command::Inspect(args) => crate::inspect::run(args),
        Command::Checkpoint(CheckpointCommand::Reset(args)) => checkpoint_reset(args),
        Command::MpsDaemon(args) => runtime.block_on(crate::mps_pod::run_daemon(args.clone())),
    }
}

fn checkpoint_reset(args: &CheckpointResetArgs) -> anyhow::Result<ExitCode> {
    let state_dir = args.plugins_dir.join(&args.driver_name);
    let options = crate::lifecycle::ResetOptions {
        force: args.force,
        remove_cdi_specs_in: args.remove_cdi_specs.then(|| args.cdi_root.clone()),
    };
    match crate::lifecycle::reset_checkpoint(&state_dir, &options)? {
        crate::lifecycle::ResetOutcome::Missing => {
            println!("no checkpoint in {}: nothing to reset", state_dir.display());
        }
        crate::lifecycle::ResetOutcome::MovedAside {
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
        let c = a.kubelet.plugin_config();
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
