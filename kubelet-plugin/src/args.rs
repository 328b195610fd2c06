//! Every flag of every subcommand, as plain data (clap derive): what the command line parses
//! and the rest of the crate reads. No behaviour lives here beyond parsing and defaults.
//!
//! Every node-facing flag can also be set through the environment (the DaemonSet sets
//! `NODE_NAME` and `POD_UID` through the downward API).

use clap::Args;
use std::net::SocketAddr;
use std::path::PathBuf;

use crate::telemetry::LogFormat;

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
    /// started again, with their claims' CDI specs rewritten), spread by ±10 % per node; 0:
    /// only at start.
    #[arg(long, env = "MPS_CHECK_INTERVAL_SECS", default_value_t = 30)]
    pub mps_check_interval_secs: u64,
    /// Directory holding each MPS daemon's pipe directory (`<root>/<16 hex digits>`), at the
    /// same path on the host and in the plugin's pod: short, so that the daemons' control
    /// sockets fit a unix socket address whatever the kubelet root (k0s, MicroK8s).
    #[arg(long, env = "MPS_PIPE_ROOT", default_value = "/run/cleave")]
    pub mps_pipe_root: PathBuf,
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
            mps_pipe_root: PathBuf::from("/run/cleave"),
        }
    }
}

/// Arguments of `mps-daemon` (set by the pod the plugin creates, not by hand).
#[derive(Debug, Clone, Args)]
pub(crate) struct MpsDaemonArgs {
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

/// Arguments of `checkpoint reset`.
#[derive(Debug, Clone, Args)]
pub(crate) struct CheckpointResetArgs {
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

/// Bounds of the `/metrics`, `/healthz` and `/readyz` server against floods and slow
/// clients (flags of `run`); see the metrics server in `docs/usage-metrics.md`.
#[derive(Debug, Clone, Args)]
pub struct MetricsServerArgs {
    /// Connections served at once; a connection over it is closed at once (counted in
    /// `metrics_connections_refused_total{reason="total"}`).
    #[arg(long, env = "METRICS_MAX_CONNECTIONS", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub metrics_max_connections: u32,
    /// Connections served at once from one client address (so that one pod cannot take
    /// every slot from the kubelet's probes and Prometheus); over it: closed at once.
    #[arg(long, env = "METRICS_MAX_CONNECTIONS_PER_CLIENT", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub metrics_max_connections_per_client: u32,
    /// Time a client has to send a request's headers (`5s`, `500ms`); a connection that
    /// sends them slower, or not at all, is closed.
    #[arg(long, env = "METRICS_HEADER_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub metrics_header_timeout: std::time::Duration,
    /// Longest life of one connection, keep-alive included (`60s`); then it is closed
    /// after the response in flight, if any.
    #[arg(long, env = "METRICS_CONNECTION_LIFETIME", default_value = "60s", value_parser = parse_duration)]
    pub metrics_connection_lifetime: std::time::Duration,
    /// What identifies a claim in the per-claim series: `names` (labels `namespace` and
    /// `claim`, as the Grafana dashboard expects) or `uid-only` (label `claim_uid` only, so
    /// a scrape does not list the tenants' namespaces and claim names).
    #[arg(long, env = "METRICS_CLAIM_LABELS", default_value = "names")]
    pub(crate) metrics_claim_labels: ClaimLabelMode,
    /// Who may scrape `/metrics`: `none` (anyone who reaches the port) or `kubernetes` (a
    /// bearer token the API server authenticates, TokenReview, whose user may `get` the
    /// non-resource URL `/metrics`, SubjectAccessReview; needs `tokenreviews` and
    /// `subjectaccessreviews` `create`). `/healthz` and `/readyz` stay open.
    #[arg(long, env = "METRICS_AUTH", default_value = "none")]
    pub(crate) metrics_auth: MetricsAuth,
}

/// Who may scrape `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum MetricsAuth {
    /// Anyone who reaches the port.
    #[default]
    None,
    /// Bearer tokens reviewed by the API server (TokenReview + SubjectAccessReview).
    Kubernetes,
}

impl Default for MetricsServerArgs {
    fn default() -> Self {
        Self {
            metrics_max_connections: 64,
            metrics_max_connections_per_client: 8,
            metrics_header_timeout: std::time::Duration::from_secs(5),
            metrics_connection_lifetime: std::time::Duration::from_secs(60),
            metrics_claim_labels: ClaimLabelMode::Names,
            metrics_auth: MetricsAuth::None,
        }
    }
}

/// What identifies a claim in the per-claim metric series.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ClaimLabelMode {
    /// `namespace` and `claim` labels (the claim's namespace and name).
    #[default]
    Names,
    /// A `claim_uid` label only: no tenant names in a scrape.
    UidOnly,
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

/// Which NVML library to load.
#[derive(Debug, Clone, Args)]
pub struct NvmlArgs {
    /// NVML library to load (default: the system's libnvidia-ml.so.1).
    #[arg(long, env = "NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,
    /// Node profile for the mock NVML library (given with --nvml-lib, or installed in the
    /// driver root as its libnvidia-ml.so.1); real NVML ignores it. Development build only.
    #[cfg(feature = "mock")]
    #[arg(long, env = "MOCK_NVML_PROFILE")]
    pub mock_profile: Option<String>,
    /// Use the mock NVML library found next to this executable, with this node profile
    /// (e.g. h100-80gb-x8). Development build only.
    #[cfg(feature = "mock")]
    #[arg(long, conflicts_with_all = ["nvml_lib", "mock_profile"])]
    pub mock: Option<String>,
    /// The host's sysfs as mounted here: each GPU's PCIe root and NUMA node
    /// (`bus/pci/devices/<bus id>/numa_node`) are read under it.
    #[arg(long, env = "SYSFS_ROOT", default_value = cleave_driver::nvml::DEFAULT_SYSFS_ROOT)]
    pub sysfs_root: PathBuf,
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
    /// Publish GPUs for sharing by capacity (needs DRAConsumableCapacity): `mps` enforces
    /// each share's memory and SMs with MPS, `time-slicing` only schedules them.
    #[arg(long, env = "CONSUMABLE_CAPACITY", default_value = "off")]
    pub consumable_capacity: cleave_api::pool::ConsumableCapacity,
    /// With --consumable-capacity and --dynamic-mig, publish on-demand MIG placements (and
    /// whole GPUs of on-demand MIG GPUs) as shareable too. Needs kube-scheduler 1.36.2 or
    /// newer; the upstream allocator still refuses some claims that fit (docs/sharing.md).
    #[arg(long, env = "SHARE_ON_DEMAND_MIG")]
    pub share_on_demand_mig: bool,
    /// cleave's CDI hook binary to install on the node and name in every CDI spec
    /// (default: `cleave-cdi-hook` beside this executable).
    #[arg(long, env = "CDI_HOOK_SOURCE")]
    pub cdi_hook_source: Option<PathBuf>,
    /// Write CDI specs without hooks (no soname links, no ld cache update in containers).
    #[arg(long, env = "DISABLE_CDI_HOOKS")]
    pub disable_cdi_hooks: bool,
}

/// How unhealthy devices appear in the published ResourceSlices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub(crate) enum TaintMode {
    /// Publish them with a `NoSchedule` device taint (needs the `DRADeviceTaints`
    /// feature gate; the API server drops the field without it).
    On,
    /// Remove them from the published pool (works on every cluster).
    #[default]
    Off,
    /// Taint them, check that the stored ResourceSlice kept the taint, and remove
    /// unhealthy devices instead when the API server dropped it (feature gate off).
    Auto,
}

/// Health check flags of `run`.
#[derive(Debug, Clone, clap::Args)]
pub struct HealthArgs {
    /// Turn off NVML health checks (every device stays healthy).
    #[arg(long, env = "DISABLE_HEALTH_CHECKS")]
    pub disable_health_checks: bool,
    /// Xids to ignore besides the application Xids 13, 31, 43, 45, 68, 109 (comma list).
    #[arg(long, env = "ADDITIONAL_XIDS_TO_IGNORE", value_delimiter = ',')]
    pub additional_xids_to_ignore: Vec<u64>,
    /// Xids that mark a device unhealthy even though they are ignored by default
    /// (comma list; wins over the ignore lists).
    #[arg(long, env = "XIDS_TO_CHECK", value_delimiter = ',')]
    pub xids_to_check: Vec<u64>,
    /// How unhealthy devices are published: `on` = NoSchedule taint, `off` = removed,
    /// `auto` = taint, falling back to removal when the API server drops device taints.
    #[arg(long, env = "DEVICE_TAINTS", value_enum, default_value_t = TaintMode::Off)]
    pub(crate) device_taints: TaintMode,
    /// Seconds after which an Xid or ECC mark clears by itself; 0 = until restart.
    #[arg(long, env = "XID_UNHEALTHY_DURATION", default_value_t = 0)]
    pub xid_unhealthy_duration: u64,
    /// Seconds between checks for GPUs that disappeared.
    #[arg(long, env = "LOST_GPU_CHECK_INTERVAL", default_value_t = 5)]
    pub lost_gpu_check_interval: u64,
}

impl Default for HealthArgs {
    fn default() -> Self {
        Self {
            disable_health_checks: false,
            additional_xids_to_ignore: Vec::new(),
            xids_to_check: Vec::new(),
            device_taints: TaintMode::Off,
            xid_unhealthy_duration: 0,
            lost_gpu_check_interval: 5,
        }
    }
}

impl HealthArgs {
    /// The Xid policy the flags describe.
    pub fn policy(&self) -> cleave_driver::health::XidPolicy {
        cleave_driver::health::XidPolicy::new(&self.additional_xids_to_ignore, &self.xids_to_check)
    }
}

/// Per-claim usage sampling and idle claims (flags of `run`).
#[derive(Debug, Clone, clap::Args)]
pub struct UsageArgs {
    /// How often the prepared claims' devices are sampled through NVML for the
    /// `claim_*` usage metrics (`10s`, `500ms`, `1m`; a bare number is seconds); `0` turns
    /// sampling off. Scrapes read the last round and never call NVML.
    #[arg(long, env = "USAGE_INTERVAL", default_value = "10s", value_parser = parse_duration)]
    pub usage_interval: std::time::Duration,
    /// A claim whose devices all stay below this compute activity (percent) for
    /// `--idle-after` is idle.
    #[arg(long, env = "IDLE_THRESHOLD", default_value_t = 5.0, value_parser = parse_percent)]
    pub idle_threshold: f64,
    /// How long a claim must stay below `--idle-threshold` to be idle (`30m`, `1h`, `90s`).
    #[arg(long, env = "IDLE_AFTER", default_value = "30m", value_parser = parse_duration)]
    pub idle_after: std::time::Duration,
    /// Post a Warning Event `ClaimIdle` on the ResourceClaim, once per idle period, naming
    /// the figures.
    #[arg(long, env = "IDLE_EVENTS")]
    pub idle_events: bool,
    /// Length of the per-claim usage window behind the right-sizing recommendations
    /// (`24h`, `168h`, `30m`; at least 24s); a recommendation needs half of it seen.
    #[arg(long, env = "RIGHTSIZE_WINDOW", default_value = "24h", value_parser = parse_window)]
    pub rightsize_window: std::time::Duration,
    /// Headroom (percent) over a claim's peak memory and p95 SM activity that the
    /// recommended shape must hold; `0` turns recommendations into a bare fit.
    #[arg(long, env = "RIGHTSIZE_HEADROOM", default_value_t = 20.0, value_parser = parse_headroom)]
    pub rightsize_headroom: f64,
    /// Post a Normal Event `ClaimOversized` on the ResourceClaim when its recommendation is
    /// smaller than what it holds (or release), once per window per change.
    #[arg(long, env = "RIGHTSIZE_EVENTS")]
    pub rightsize_events: bool,
    /// Pod label keys (comma-separated, at most 8, e.g. `team,model`) copied onto every
    /// `claim_*` series as `label_<key>` (characters outside `[a-zA-Z0-9_]` as `_`), valued
    /// from the pods consuming the claim (the first by UID when they disagree); empty: none.
    #[arg(long, env = "CLAIM_POD_LABELS", default_value = "", value_parser = parse_pod_label_keys)]
    pub claim_pod_labels: PodLabelKeys,
    /// The host's process tree, read to tie GPU processes to pods (their cgroups) and MPS
    /// daemons to their servers: the host's `/proc`, as the plugin runs in the host PID
    /// namespace. Tests point it at a tree of their own.
    #[arg(long, env = "PROC_ROOT", default_value = "/proc", hide = true)]
    pub proc_root: std::path::PathBuf,
}

/// The `--claim-pod-labels` keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodLabelKeys(pub Vec<String>);

/// Parses `--claim-pod-labels`: comma-separated label keys, checked.
fn parse_pod_label_keys(value: &str) -> Result<PodLabelKeys, String> {
    let keys: Vec<String> = value
        .split(',')
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .map(str::to_owned)
        .collect();
    crate::k8s::node_pods::check_label_keys(&keys)?;
    Ok(PodLabelKeys(keys))
}

impl Default for UsageArgs {
    fn default() -> Self {
        Self {
            usage_interval: std::time::Duration::from_secs(10),
            idle_threshold: 5.0,
            idle_after: std::time::Duration::from_secs(30 * 60),
            idle_events: false,
            rightsize_window: std::time::Duration::from_secs(24 * 3600),
            rightsize_headroom: 20.0,
            rightsize_events: false,
            claim_pod_labels: PodLabelKeys::default(),
            proc_root: std::path::PathBuf::from("/proc"),
        }
    }
}

impl UsageArgs {
    /// The idle policy the flags describe.
    pub(crate) fn idle_policy(&self) -> cleave_driver::usage::IdlePolicy {
        cleave_driver::usage::IdlePolicy {
            threshold_percent: self.idle_threshold,
            window: self.idle_after,
        }
    }
}

/// Parses a `--rightsize-window`: a duration of at least 24 seconds (one per bucket).
fn parse_window(value: &str) -> Result<std::time::Duration, String> {
    let d = parse_duration(value)?;
    let least = u64::from(cleave_driver::rightsize::BUCKETS);
    if d.as_secs() < least {
        return Err(format!(
            "{value:?} is shorter than {least}s (the window has {least} buckets of at least a second)"
        ));
    }
    Ok(d)
}

/// Parses a headroom percentage, 0 to 1000.
fn parse_headroom(value: &str) -> Result<f64, String> {
    match value.trim().trim_end_matches('%').parse::<f64>() {
        Ok(p) if (0.0..=1000.0).contains(&p) => Ok(p),
        _ => Err(format!(
            "{value:?} is not a headroom percentage between 0 and 1000"
        )),
    }
}

impl UsageArgs {
    /// Right-sizing settings for a node serving `modes`.
    pub(crate) fn rightsize_config(
        &self,
        modes: cleave_driver::rightsize::NodeModes,
    ) -> crate::node::usage::recommend::RightsizeConfig {
        crate::node::usage::recommend::RightsizeConfig {
            window: cleave_driver::rightsize::WindowConfig {
                window_seconds: self.rightsize_window.as_secs(),
                idle_threshold_percent: self.idle_threshold,
            },
            policy: cleave_driver::rightsize::RightsizePolicy {
                headroom: self.rightsize_headroom / 100.0,
                idle_threshold_percent: self.idle_threshold,
            },
            modes,
        }
    }
}

/// Arguments of `usage`.
#[derive(Debug, Clone, Args)]
pub(crate) struct UsageCommandArgs {
    /// The running plugin's metrics endpoint (its `--metrics-addr`), `host:port` or an
    /// `http://` URL.
    #[arg(long, env = "METRICS_ADDR", default_value = "127.0.0.1:9400")]
    pub metrics_addr: String,
    /// Instead of asking a running plugin: prepare a few claims over the mock NVML
    /// library with this node profile (e.g. `h100-80gb-x8`) and scripted usage, take two
    /// sampling rounds and print them. Development build only.
    #[cfg(feature = "mock")]
    #[arg(long)]
    pub mock: Option<String>,
    /// Scrapes of the running plugin to take (the table's window spans them).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub scrapes: u32,
    /// Time between scrapes (at least the plugin's `--usage-interval` to see new rounds).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub every: std::time::Duration,
    /// Print the right-sizing table instead: per claim device what it holds, what it used
    /// over the window, the recommended shape and why, and the node's GPUs held against
    /// the GPUs the recommendations would need.
    #[arg(long)]
    pub recommend: bool,
    /// Print GPUs held, used and recommended per group instead: `namespace`, or a pod label
    /// key the plugin copies onto claim series (its allowlist; `team` reads `label_team`).
    #[arg(long, value_name = "LABEL", conflicts_with = "recommend")]
    pub by: Option<String>,
}

/// Parses `500ms`, `10s`, `5m`, `1h` or a bare number of seconds.
pub(crate) fn parse_duration(value: &str) -> Result<std::time::Duration, String> {
    let v = value.trim();
    let (number, unit) = match v.find(|c: char| !c.is_ascii_digit() && c != '.') {
        Some(i) => v.split_at(i),
        None => (v, "s"),
    };
    let n: f64 = number
        .parse()
        .map_err(|_| format!("{value:?} is not a duration (write e.g. 500ms, 10s, 5m or 1h)"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        other => {
            return Err(format!(
                "{value:?}: unknown unit {other:?} (use ms, s, m or h)"
            ));
        }
    };
    std::time::Duration::try_from_secs_f64(secs).map_err(|e| format!("{value:?}: {e}"))
}

/// Parses a percentage between 0 and 100.
fn parse_percent(value: &str) -> Result<f64, String> {
    match value.trim().trim_end_matches('%').parse::<f64>() {
        Ok(p) if (0.0..=100.0).contains(&p) => Ok(p),
        _ => Err(format!("{value:?} is not a percentage between 0 and 100")),
    }
}

/// What the plugin tells about prepared claims besides the CDI specs (flags of `run`).
#[derive(Debug, Clone, Args)]
pub struct ClaimInfoArgs {
    /// Write each prepared claim's `status.devices` entries (what it got, `Ready` and
    /// `Healthy` conditions) in the background; `--claim-device-status=false` turns it off.
    #[arg(long, env = "CLAIM_DEVICE_STATUS", default_value_t = true, action = clap::ArgAction::Set)]
    pub claim_device_status: bool,
    /// Write a device metadata file per claim request and mount it into the containers
    /// through CDI (KEP-5304, beta in Kubernetes 1.37): the devices' attributes and UUIDs at
    /// `/var/run/kubernetes.io/dra-device-attributes/…/<driver>-metadata.json`.
    #[arg(long, env = "DEVICE_METADATA")]
    pub device_metadata: bool,
}

impl Default for ClaimInfoArgs {
    fn default() -> Self {
        Self {
            claim_device_status: true,
            device_metadata: false,
        }
    }
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
    pub health: HealthArgs,
    /// Start-up retries.
    #[command(flatten)]
    pub lifecycle: LifecycleArgs,
    /// MPS daemons.
    #[command(flatten)]
    pub mps: MpsArgs,
    /// Usage sampling and idle claims.
    #[command(flatten)]
    pub usage: UsageArgs,
    /// Claim status and device metadata.
    #[command(flatten)]
    pub claim_info: ClaimInfoArgs,
    /// Kubeconfig file (default: in-cluster configuration, then ~/.kube/config).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Address for `/metrics` (Prometheus), `/healthz` and `/readyz`; none: not served.
    #[arg(long, env = "METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Bounds of the metrics server and the per-claim labels.
    #[command(flatten)]
    pub metrics: MetricsServerArgs,
    /// Delete this node's ResourceSlices of this driver and exit.
    #[arg(long)]
    pub uninstall: bool,
}

/// Arguments of `inspect`.
#[derive(Debug, Clone, Args)]
pub(crate) struct InspectArgs {
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
    /// Show devices as published for sharing by capacity (`off`, `mps`, `time-slicing`).
    #[arg(long, env = "CONSUMABLE_CAPACITY", default_value = "off")]
    pub consumable_capacity: cleave_api::pool::ConsumableCapacity,
    /// Show on-demand MIG placements as shareable too (as `run --share-on-demand-mig`).
    #[arg(long, env = "SHARE_ON_DEMAND_MIG")]
    pub share_on_demand_mig: bool,
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

/// Accepts a Kubernetes node name; clap names the flag (`--node-name`, or `NODE_NAME`) in
/// the error, so a typo fails at once instead of in every API call.
pub(crate) fn parse_node_name(value: &str) -> Result<String, String> {
    match cleave_api::names::node_name_problem(value) {
        None => Ok(value.to_owned()),
        Some(problem) => Err(format!(
            "not a Kubernetes node name: {problem} (set it to the Node object's name, e.g. from the downward API's spec.nodeName)"
        )),
    }
}
