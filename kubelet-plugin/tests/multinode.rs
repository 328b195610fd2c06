//! A multi-node world: one API server stand-in, three real plugin processes (the
//! `cleave-kubelet-plugin` binary), each a node of its own with its own mock NVML state,
//! driver root, kubelet directories, CDI root, state directory and MPS pipe root, a fake
//! kubelet per node (`tests/common/kubelet.rs`) that runs only the daemon pods bound to its
//! node, and a small scheduler that spreads replicas round-robin over the nodes, allocating
//! from what each node published in its ResourceSlices (read back from the stand-in).
//!
//! The node names are a short one, one of 63 characters (the longest DNS label) and one of
//! 253 (the longest DNS subdomain): every name the plugins derive from them must stay valid.
//!
//! **The same paths a real node has.** As root, with `unshare --mount` working, each node
//! gets a private mount namespace (held by a small `sh` process) in which its own
//! directories are bind-mounted at the SAME absolute paths on every node, as on real nodes:
//! `/var/lib/kubelet` (registrar, plugins and pods), `/var/run/cdi`, `/run/cleave` (the MPS
//! pipe root) and `/run/nvidia/driver` (fresh tmpfs mounts on `/var/lib` and `/run` first,
//! so nothing of the host is written or hidden outside the namespace). The plugin and its
//! daemons (the process launcher's children, the fake kubelet's containers through
//! `nsenter`) run in that namespace, so a path shared between nodes that the plugin should
//! keep per node (a pipe directory, a socket, a lock) would collide only if the namespaces
//! leaked, and every pipe directory has the same path on every node, as in a real cluster.
//! The test reads each node's files through the bind sources. Without root or `unshare` (or
//! with `CLEAVE_MULTINODE_NAMESPACES=0`), the nodes fall back to per-node temporary
//! directories and the test says so on stderr; under CI (or `CLEAVE_REQUIRE_MOUNT_NS=1`)
//! that fallback is a failure.
//!
//! Built with `harness = false`: `main` is the test kit's runner, which first plays a fake
//! tool (MPS control, `nvidia-smi`) when asked to, then runs the tests below one by one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::BufRead as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cleave_apiserver_standin::{StandIn, fixtures};
use cleave_kubelet_plugin::proto::dra::v1;
use cleave_testkit::fake_tools::FakeFiles;
use cleave_testkit::runner::block_on;
use common::dra_v1;
use common::kubelet::{FakeKubelet, KubeletOptions, NAMESPACE, daemon_pod_name};
use common::node::{DRIVER, mock_lib};
use common::prom::{
    chart_pod_monitor_honor_labels, dashboard_queries, operator_scrape_job, prom_query,
    prometheus_found, start_prometheus, wait_for_series,
};
use k8s_openapi::api::resource::v1::DeviceAllocationConfiguration;
use serde_json::{Value, json};

/// GPU 0 in MIG mode, GPUs 1–3 whole (MIG off): room for a MIG claim, a share, a per-claim
/// MPS claim and a whole GPU on one node.
const GPUS: &str = "name: multinode\ngpus:\n  - product: h100-80gb\n    migEnabled: true\n  - product: h100-80gb\n    migEnabled: false\n  - product: h100-80gb\n    migEnabled: false\n  - product: h100-80gb\n    migEnabled: false\n";

/// Where a node's plugin finds its directories inside its mount namespace.
const NS_KUBELET: &str = "/var/lib/kubelet";
const NS_CDI: &str = "/var/run/cdi";
const NS_PIPES: &str = "/run/cleave";
const NS_DRIVER: &str = "/run/nvidia/driver";

/// Bound for waits on the world (a prepare of several claims on a busy 2-core machine).
const WAIT: Duration = Duration::from_secs(30);

/// The node names: short, 63 characters and 253 characters (valid DNS subdomains).
fn node_names() -> Vec<String> {
    let label = |prefix: &str, len: usize| format!("{prefix}{}", "x".repeat(len - prefix.len()));
    let n63 = label("node-63-", 63);
    let n253 = format!(
        "{}.{}.{}.{}",
        label("node-253-", 63),
        label("b", 63),
        label("c", 63),
        label("d", 61)
    );
    assert_eq!((n63.len(), n253.len()), (63, 253));
    vec!["node-a".to_owned(), n63, n253]
}

/// A private mount namespace, held by a shell that waits on its stdin (it ends with the
/// test process, even one that panicked).
struct Namespace {
    holder: Child,
}

impl Namespace {
    /// A namespace with fresh tmpfs on `/var/lib` and `/run` and each `(host, inside)` bind
    /// mount; `Err` says why it could not be made.
    fn start(binds: &[(PathBuf, &str)]) -> Result<Self, String> {
        // What the namespace must still see of the host: the bind sources, this test
        // binary (the fake tools) and the plugin binary.
        let exe = std::env::current_exe().unwrap_or_default();
        let plugin = PathBuf::from(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"));
        for p in binds.iter().map(|(h, _)| h).chain([&exe, &plugin]) {
            let p = std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
            if ["/run", "/var/run", "/var/lib"]
                .iter()
                .any(|c| p.starts_with(c))
            {
                return Err(format!(
                    "{} is under a directory the namespace covers with a fresh tmpfs",
                    p.display()
                ));
            }
        }
        let mut script = String::from(
            "set -e\nmount -t tmpfs cleave-node /var/lib\nmount -t tmpfs cleave-node /run\n",
        );
        let var_run = std::fs::canonicalize("/var/run").unwrap_or_else(|_| "/var/run".into());
        if var_run != Path::new("/run") {
            script.push_str(&format!(
                "mount -t tmpfs cleave-node '{}'\n",
                var_run.display()
            ));
        }
        for (host, inside) in binds {
            script.push_str(&format!(
                "mkdir -p '{inside}'\nmount --bind '{}' '{inside}'\n",
                host.display()
            ));
        }
        script.push_str("echo ready\nexec cat >/dev/null\n");
        let mut holder = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run unshare: {e}"))?;
        let mut line = String::new();
        let stdout = holder.stdout.take().unwrap();
        let _ = std::io::BufReader::new(stdout).read_line(&mut line);
        if line.trim() != "ready" {
            drop(holder.stdin.take());
            let out = holder.wait_with_output().map_err(|e| e.to_string())?;
            return Err(format!(
                "unshare --mount failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Self { holder })
    }

    /// The command prefix that runs a program in this namespace.
    fn enter(&self) -> Vec<String> {
        vec![
            "nsenter".into(),
            format!("--mount=/proc/{}/ns/mnt", self.holder.id()),
            "--".into(),
        ]
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        drop(self.holder.stdin.take());
        let _ = self.holder.wait();
    }
}

/// How every node's plugin runs.
#[derive(Clone, Copy)]
struct Mode {
    /// `--consumable-capacity`: `mps` or `time-slicing`.
    capacity: &'static str,
    /// `--mps-launcher`: `pod` or `process`.
    launcher: &'static str,
    /// `--dynamic-mig` (on-demand MIG); otherwise a static MIG instance is made up front.
    dynamic_mig: bool,
}

/// One simulated node.
struct Node {
    name: String,
    tmp: tempfile::TempDir,
    ns: Option<Namespace>,
    fakes: FakeFiles,
    plugin: Option<Child>,
    kubelet: Option<FakeKubelet>,
    dra: Option<v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel>>,
    /// Serve metrics on 127.0.0.1 at this port, sampling usage every 500 ms.
    metrics_port: Option<u16>,
}

impl Node {
    fn new(name: &str, namespaced: bool) -> Result<Self, String> {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        for d in ["kubelet", "cdi", "pipes", "driver-root", "pod-logs"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        cleave_testkit::driver_root::lay_out_profile(
            &dir.join("driver-root"),
            "h100-80gb-x8",
            None,
        );
        cleave_testkit::fake_tools::install_wrappers(&dir.join("driver-root/usr/bin")).unwrap();
        std::fs::write(dir.join("gpus.yaml"), GPUS).unwrap();
        let ns = if namespaced {
            Some(Namespace::start(&[
                (dir.join("kubelet"), NS_KUBELET),
                (dir.join("cdi"), NS_CDI),
                (dir.join("pipes"), NS_PIPES),
                (dir.join("driver-root"), NS_DRIVER),
            ])?)
        } else {
            None
        };
        Ok(Self {
            name: name.to_owned(),
            fakes: FakeFiles::in_dir(dir),
            tmp,
            ns,
            plugin: None,
            kubelet: None,
            dra: None,
            metrics_port: None,
        })
    }

    fn host(&self, what: &str) -> PathBuf {
        self.tmp.path().join(what)
    }

    /// The path the plugin is given for its directory `what` (as it sees it).
    fn seen(&self, what: &str) -> PathBuf {
        if self.ns.is_none() {
            return self.host(what);
        }
        PathBuf::from(match what {
            "kubelet" => NS_KUBELET,
            "cdi" => NS_CDI,
            "pipes" => NS_PIPES,
            "driver-root" => NS_DRIVER,
            other => panic!("no namespace path for {other}"),
        })
    }

    fn state_dir(&self) -> PathBuf {
        self.host("kubelet/plugins").join(DRIVER)
    }

    fn mock_state(&self) -> PathBuf {
        self.host("mock-nvml-state.json")
    }

    fn wrap(&self) -> Vec<String> {
        self.ns.as_ref().map(Namespace::enter).unwrap_or_default()
    }

    fn log(&self) -> String {
        let mut out = format!(
            "=== node {} plugin log:\n{}\n",
            self.name,
            std::fs::read_to_string(self.host("plugin.log")).unwrap_or_default()
        );
        if let Ok(rd) = std::fs::read_dir(self.host("pod-logs")) {
            for e in rd.flatten() {
                out.push_str(&format!(
                    "--- {}:\n{}\n",
                    e.file_name().to_string_lossy(),
                    std::fs::read_to_string(e.path()).unwrap_or_default()
                ));
            }
        }
        out.push_str(&format!(
            "fake MPS record:\n{}\n",
            self.fakes.mps_lines().join("\n")
        ));
        out
    }

    /// Starts the plugin (in the node's namespace) and, for the pod launcher, its kubelet.
    async fn start(&mut self, standin: &StandIn, kubeconfig: &Path, mode: Mode) {
        let exe = env!("CARGO_BIN_EXE_cleave-kubelet-plugin");
        let wrap = self.wrap();
        let mut cmd = match wrap.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        let s = |p: PathBuf| p.display().to_string();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.host("plugin.log"))
            .unwrap();
        cmd.arg("run")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("NODE_NAME", &self.name)
            .env("KUBECONFIG", kubeconfig)
            .env("MOCK_NVML_CONFIG", self.host("gpus.yaml"))
            .env("MOCK_NVML_MIG", "")
            .env("MOCK_NVML_STATE", self.mock_state())
            .env("NVML_LIB", mock_lib())
            .env(
                "KUBELET_REGISTRAR_DIRECTORY_PATH",
                s(self.seen("kubelet").join("plugins_registry")),
            )
            .env(
                "KUBELET_PLUGINS_DIRECTORY_PATH",
                s(self.seen("kubelet").join("plugins")),
            )
            .env("KUBELET_ROOT_DIR", self.seen("kubelet"))
            .env("CDI_ROOT", self.seen("cdi"))
            .env("MPS_PIPE_ROOT", self.seen("pipes"))
            .env("NVIDIA_DRIVER_ROOT", self.seen("driver-root"))
            .env("CONSUMABLE_CAPACITY", mode.capacity)
            .env("MPS_LAUNCHER", mode.launcher)
            .env("MPS_DAEMON_IMAGE", "cleave:test")
            .env("POD_NAMESPACE", NAMESPACE)
            .env(
                "USAGE_INTERVAL",
                if self.metrics_port.is_some() {
                    "500ms"
                } else {
                    "0"
                },
            )
            .env("MPS_CHECK_INTERVAL_SECS", "1")
            .env("RUST_LOG", "info")
            .envs(self.fakes.env())
            .stdin(Stdio::null())
            .stderr(log);
        if mode.dynamic_mig {
            cmd.arg("--dynamic-mig");
        }
        if let Some(port) = self.metrics_port {
            // 24 one-second buckets: recommendations after 12 s.
            cmd.arg(format!("--metrics-addr=127.0.0.1:{port}"))
                .env("RIGHTSIZE_WINDOW", "24s");
        }
        let mut child = cmd.spawn().unwrap();
        let reg = self
            .host("kubelet/plugins_registry")
            .join(format!("{DRIVER}-reg.sock"));
        let started = Instant::now();
        while std::os::unix::net::UnixStream::connect(&reg).is_err() {
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "plugin of {} exited early with {status}:\n{}",
                    self.name,
                    self.log()
                );
            }
            assert!(
                started.elapsed() < WAIT,
                "plugin did not register\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.plugin = Some(child);
        self.dra = Some(dra_v1(&self.state_dir().join("dra.sock")).await);
        if mode.launcher == "pod" && self.kubelet.is_none() {
            let options = KubeletOptions {
                env: self
                    .fakes
                    .env()
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), v))
                    .collect(),
                wrap: self.wrap(),
                ..KubeletOptions::default()
            };
            self.kubelet = Some(FakeKubelet::start(
                standin.config(),
                &self.name,
                &self.host("kubelet"),
                Path::new(exe),
                &self.host("pod-logs"),
                options,
            ));
        }
    }

    /// SIGKILL to the plugin (a node lost), nothing else.
    fn kill_plugin(&mut self) {
        self.dra = None;
        if let Some(mut child) = self.plugin.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// SIGTERM to the plugin; it must exit cleanly.
    fn stop_plugin(&mut self) {
        self.dra = None;
        if let Some(mut child) = self.plugin.take() {
            let ok = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status()
                .unwrap();
            assert!(ok.success());
            let started = Instant::now();
            loop {
                if let Some(status) = child.try_wait().unwrap() {
                    assert!(status.success(), "{}: {status}\n{}", self.name, self.log());
                    break;
                }
                assert!(started.elapsed() < WAIT, "plugin did not stop");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    fn cdi_files(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.host("cdi"))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// Claim UIDs in the checkpoint.
    fn checkpoint_claims(&self) -> BTreeSet<String> {
        cleave_driver::checkpoint::CheckpointStore::in_dir(&self.state_dir())
            .load()
            .unwrap()
            .claims
            .into_keys()
            .collect()
    }

    /// Entries of the MPS pipe root.
    fn pipe_dirs(&self) -> Vec<String> {
        std::fs::read_dir(self.host("pipes"))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// MIG instances (GPU, GI profile, start) in the node's mock state.
    fn mig_instances(&self) -> Vec<(usize, u32, u32)> {
        let Some(state) = mock_nvml::state::read_state_file(&self.mock_state()).unwrap() else {
            return Vec::new();
        };
        state
            .gpus
            .iter()
            .enumerate()
            .flat_map(|(i, g)| {
                g.gpu_instances
                    .iter()
                    .map(move |gi| (i, gi.profile_id, gi.start))
            })
            .collect()
    }

    /// MPS daemons the fake control started and that have not exited.
    fn live_daemons(&self) -> usize {
        let lines = self.fakes.mps_lines();
        let starts = lines.iter().filter(|l| l.starts_with("start")).count();
        let exits = lines.iter().filter(|l| l.starts_with("exit")).count();
        starts.saturating_sub(exits)
    }

    /// Makes the administrator's MIG instance (3g, memory slices 4–7, on GPU 0) in the
    /// node's mock state, as `nvidia-smi mig -cgi 9 -C` would before the plugin starts.
    fn make_static_mig(&self) {
        use mock_nvml::{fixtures, state};
        let cfg = fixtures::ConfigFile::load(&self.host("gpus.yaml"))
            .unwrap()
            .resolve("multinode", None)
            .unwrap();
        let store = state::StateStore::new(self.mock_state(), &cfg, state::current_boot_id());
        let spec = cfg.gpus[0].clone();
        store
            .modify(|st| {
                let gs = &mut st.gpus[0];
                let gi = state::create_gi(&spec, gs, 9, Some((4, 4)))?;
                state::create_ci(&spec, &mut gs.gpu_instances[gi], 2, None)
            })
            .unwrap()
            .unwrap();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.dra = None;
        if let Some(mut child) = self.plugin.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.kubelet = None;
        self.fakes.kill_started();
    }
}

/// What a replica asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// A capacity share of a GPU (shareID, consumed capacity).
    Share,
    /// A whole GPU with a per-claim MPS config.
    Mps,
    /// A whole GPU.
    Whole,
    /// A MIG device (on-demand or static).
    Mig,
}

/// A claim placed on a node.
#[derive(Debug, Clone)]
struct Placed {
    node: usize,
    namespace: String,
    kind: Kind,
    name: String,
    uid: String,
    device: String,
}

impl Placed {
    fn claim(&self) -> v1::Claim {
        v1::Claim {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            uid: self.uid.clone(),
        }
    }
}

/// A valid label value: at most 63 characters of `[A-Za-z0-9._-]`, alphanumeric at both
/// ends (or empty).
fn is_label_value(v: &str) -> bool {
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    v.is_empty()
        || (v.len() <= 63
            && v.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
            && alnum(v.chars().next())
            && alnum(v.chars().last()))
}

fn attr<'a>(device: &'a Value, name: &str) -> Option<&'a str> {
    device["attributes"][name]["string"].as_str()
}

/// The devices `node` published, read back from the stand-in.
fn published(standin: &StandIn, node: &str) -> Vec<Value> {
    standin
        .list("resourceslices")
        .into_iter()
        .filter(|s| s["spec"]["nodeName"] == node)
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .collect()
}

/// The devices of `node` a replica of each kind gets: the first MIG device, and three
/// distinct GPUs that are not MIG parents for the share, the MPS claim and the whole GPU.
fn pick(devices: &[Value]) -> BTreeMap<Kind, String> {
    let migs: Vec<&Value> = devices
        .iter()
        .filter(|d| attr(d, "type") == Some("mig"))
        .collect();
    let parents: BTreeSet<&str> = migs.iter().filter_map(|d| attr(d, "parentUUID")).collect();
    let mut gpus: Vec<&str> = devices
        .iter()
        .filter(|d| attr(d, "type") == Some("gpu"))
        .filter(|d| attr(d, "uuid").is_none_or(|u| !parents.contains(u)))
        .filter_map(|d| d["name"].as_str())
        .collect();
    gpus.sort();
    let mut migs: Vec<&str> = migs.iter().filter_map(|d| d["name"].as_str()).collect();
    migs.sort();
    let mut out = BTreeMap::new();
    if let Some(m) = migs.first() {
        out.insert(Kind::Mig, (*m).to_owned());
    }
    for (kind, gpu) in [Kind::Share, Kind::Mps, Kind::Whole].into_iter().zip(gpus) {
        out.insert(kind, gpu.to_owned());
    }
    out
}

fn mps_config() -> DeviceAllocationConfiguration {
    fixtures::opaque_config(
        "FromClaim",
        &["gpu"],
        DRIVER,
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50}}}),
    )
}

/// A UUID-shaped string from two numbers (claim UIDs and share IDs).
fn uuid(a: u32, b: u32) -> String {
    format!("{a:08x}-0000-4000-8000-{b:012x}")
}

/// The world: the stand-in and its nodes.
struct World {
    standin: StandIn,
    nodes: Vec<Node>,
    kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
    mode: Mode,
    next: u32,
    /// Every claim scheduled so far.
    placed: Vec<Placed>,
    /// The namespaces claims are put in, in turn.
    namespaces: Vec<&'static str>,
}

impl World {
    async fn start(mode: Mode) -> Self {
        Self::start_with(mode, &["default"], false).await
    }

    /// A world whose claims go to `namespaces` in turn, and whose plugins serve metrics
    /// (each on a port of its own) when `metrics` is set.
    async fn start_with(mode: Mode, namespaces: &[&'static str], metrics: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        let names = node_names();
        let standin = cleave_testkit::standin::start_with_node(&names[0], &kubeconfig).await;
        for n in &names[1..] {
            standin.put(&fixtures::node(n)).unwrap();
        }
        let probe = if std::env::var("CLEAVE_MULTINODE_NAMESPACES").is_ok_and(|v| v == "0") {
            Err("CLEAVE_MULTINODE_NAMESPACES=0".to_owned())
        } else {
            Node::new("probe", true).map(drop)
        };
        let namespaced = match probe {
            Ok(()) => true,
            Err(why) => {
                assert!(
                    !cleave_testkit::runner::tool_required("CLEAVE_REQUIRE_MOUNT_NS"),
                    "private mount namespaces are required here (CLEAVE_REQUIRE_MOUNT_NS or CI \
                     is set) but cannot be made: {why}"
                );
                eprintln!(
                    "\n{bar}\nNOTE: no private mount namespace per node ({why}); the nodes \
                     use per-node temporary directories instead, so a path shared between \
                     nodes is not caught (run as root, or set CLEAVE_REQUIRE_MOUNT_NS=1 to \
                     make this a failure)\n{bar}\n",
                    bar = "!".repeat(78)
                );
                false
            }
        };
        let mut nodes: Vec<Node> = names
            .iter()
            .map(|n| Node::new(n, namespaced).unwrap())
            .collect();
        for node in &mut nodes {
            if metrics {
                node.metrics_port = Some(common::node::free_port());
            }
            if !mode.dynamic_mig {
                node.make_static_mig();
            }
            node.start(&standin, &kubeconfig, mode).await;
        }
        // Every node published its devices, MIG included.
        let names2 = names.clone();
        standin
            .wait_for("resourceslices", WAIT, |_| {
                names2
                    .iter()
                    .all(|n| pick(&published(&standin, n)).len() == 4)
            })
            .await
            .unwrap_or_else(|s| {
                panic!(
                    "not every node published a MIG device and three GPUs: {s:#?}\n{}",
                    nodes.iter().map(Node::log).collect::<String>()
                )
            });
        Self {
            standin,
            nodes,
            kubeconfig,
            _dir: dir,
            mode,
            next: 0,
            placed: Vec::new(),
            namespaces: namespaces.to_vec(),
        }
    }

    fn logs(&self) -> String {
        self.nodes.iter().map(Node::log).collect()
    }

    /// The scheduler: replicas of each kind in `kinds` go to the nodes round-robin (skipping
    /// `down`), each allocated the device its node published for that kind; the claims
    /// are stored allocated in the stand-in.
    fn schedule(&mut self, kinds: &[(Kind, usize)], down: &[usize]) -> Vec<Placed> {
        let up: Vec<usize> = (0..self.nodes.len())
            .filter(|i| !down.contains(i))
            .collect();
        let mut placed = Vec::new();
        let mut turn = 0;
        for &(kind, replicas) in kinds {
            for _ in 0..replicas {
                let node = up[turn % up.len()];
                turn += 1;
                self.next += 1;
                let n = self.next;
                let node_name = self.nodes[node].name.clone();
                let slices: Vec<Value> = self
                    .standin
                    .list("resourceslices")
                    .into_iter()
                    .filter(|s| s["spec"]["nodeName"] == node_name.as_str())
                    .collect();
                let pool = slices[0]["spec"]["pool"]["name"]
                    .as_str()
                    .unwrap()
                    .to_owned();
                let device = pick(&published(&self.standin, &node_name))[&kind].clone();
                let name = format!("{}-{n}", format!("{kind:?}").to_lowercase());
                let namespace =
                    self.namespaces[usize::try_from(n).unwrap() % self.namespaces.len()].to_owned();
                let uid = uuid(n, u32::try_from(node).unwrap() + 1);
                let configs = if kind == Kind::Mps {
                    vec![mps_config()]
                } else {
                    Vec::new()
                };
                let request = if kind == Kind::Mig { "mig" } else { "gpu" };
                let mut claim = fixtures::resource_claim(
                    &namespace,
                    &name,
                    &uid,
                    DRIVER,
                    &pool,
                    &[(request, device.as_str())],
                    &configs,
                );
                if kind == Kind::Share {
                    for r in claim
                        .status
                        .as_mut()
                        .and_then(|s| s.allocation.as_mut())
                        .and_then(|a| a.devices.as_mut())
                        .and_then(|d| d.results.as_mut())
                        .unwrap()
                    {
                        r.share_id = Some(uuid(0x5a00_0000 + n, 0xa));
                        r.consumed_capacity = Some(
                            serde_json::from_value(
                                json!({"memory": "20Gi", "multiprocessors": "44"}),
                            )
                            .unwrap(),
                        );
                    }
                }
                self.standin.put(&claim).unwrap();
                placed.push(Placed {
                    node,
                    namespace,
                    kind,
                    name,
                    uid,
                    device,
                });
            }
        }
        self.placed.extend(placed.iter().cloned());
        placed
    }

    /// Prepares (or unprepares) `claims` on all their nodes at once, one call per node, and
    /// asserts every claim succeeded.
    async fn call(&mut self, claims: &[Placed], unprepare: bool) {
        let mut by_node: BTreeMap<usize, Vec<v1::Claim>> = BTreeMap::new();
        for c in claims {
            by_node.entry(c.node).or_default().push(c.claim());
        }
        let mut calls = Vec::new();
        for (i, node) in self.nodes.iter_mut().enumerate() {
            let Some(list) = by_node.remove(&i) else {
                continue;
            };
            let mut dra = node.dra.clone().expect("node is up");
            calls.push(async move {
                let errors: Vec<(String, String)> = if unprepare {
                    let r = common::node::unprepare(&mut dra, list).await;
                    r.claims.into_iter().map(|(u, c)| (u, c.error)).collect()
                } else {
                    let r = common::node::prepare(&mut dra, list).await;
                    r.claims.into_iter().map(|(u, c)| (u, c.error)).collect()
                };
                (i, errors)
            });
        }
        for (i, errors) in futures::future::join_all(calls).await {
            for (uid, error) in errors {
                assert_eq!(
                    error,
                    "",
                    "{} of {uid} on {}:\n{}",
                    if unprepare { "unprepare" } else { "prepare" },
                    self.nodes[i].name,
                    self.logs()
                );
            }
        }
    }

    /// The MPS daemon keys `claims` need on `node`: the per-claim daemons' UIDs and the
    /// shared daemon of each shared GPU (capacity mode `mps` only).
    fn daemon_keys(&self, claims: &[Placed], node: usize) -> BTreeSet<String> {
        claims
            .iter()
            .filter(|c| c.node == node)
            .filter_map(|c| match c.kind {
                Kind::Mps => Some(c.uid.clone()),
                Kind::Share if self.mode.capacity == "mps" => Some(
                    cleave_driver::prepare::shared_daemon_key(&c.device, &c.namespace),
                ),
                _ => None,
            })
            .collect()
    }

    /// Daemon pods in the stand-in bound to `node`: name → UID.
    fn pods_of(&self, node: usize) -> BTreeMap<String, String> {
        let name = &self.nodes[node].name;
        self.standin
            .list("pods")
            .into_iter()
            .filter(|p| p["spec"]["nodeName"] == name.as_str())
            .map(|p| {
                (
                    p["metadata"]["name"].as_str().unwrap().to_owned(),
                    p["metadata"]["uid"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    }

    /// What `claims` (all prepared) leave on each node: their CDI specs and checkpoint
    /// entries and nothing of another node's claims; the node's own daemon pods (pod
    /// launcher), named and labelled for it; the MIG instance; the pipe directories.
    fn check_prepared(&self, claims: &[Placed]) {
        for (i, node) in self.nodes.iter().enumerate() {
            if node.plugin.is_none() {
                continue;
            }
            let mine: BTreeSet<&str> = claims
                .iter()
                .filter(|c| c.node == i)
                .map(|c| c.uid.as_str())
                .collect();
            let others: BTreeSet<&str> = claims
                .iter()
                .filter(|c| c.node != i)
                .map(|c| c.uid.as_str())
                .collect();
            let cdi = node.cdi_files();
            for uid in &mine {
                assert!(
                    cdi.iter().any(|f| f.contains(uid)),
                    "{}: no CDI spec of {uid}: {cdi:?}",
                    node.name
                );
            }
            for f in &cdi {
                assert!(
                    !others.iter().any(|u| f.contains(u)),
                    "{}: a CDI spec of another node's claim: {f}",
                    node.name
                );
            }
            let checkpoint = node.checkpoint_claims();
            let want: BTreeSet<String> = mine.iter().map(|u| (*u).to_owned()).collect();
            assert_eq!(checkpoint, want, "{}: checkpoint entries", node.name);
            let keys = self.daemon_keys(claims, i);
            if self.mode.launcher == "pod" {
                let want: BTreeSet<String> = keys
                    .iter()
                    .map(|k| daemon_pod_name(&node.name, k))
                    .collect();
                let pods: BTreeSet<String> = self.pods_of(i).into_keys().collect();
                assert_eq!(pods, want, "{}: daemon pods\n{}", node.name, self.logs());
            }
            assert_eq!(
                node.pipe_dirs().len(),
                keys.len(),
                "{}: pipe directories {:?}",
                node.name,
                node.pipe_dirs()
            );
            let migs = node.mig_instances();
            assert_eq!(migs.len(), 1, "{}: MIG instances {migs:?}", node.name);
        }
    }

    /// Every object in the stand-in has a valid name, unique per node: pods (DNS labels,
    /// bound to a node of this world, labelled with it), slices (DNS subdomains, each
    /// naming its node and pool), Events (DNS subdomains, a reporting instance within 128
    /// characters); and each node's fake kubelet ran only pods of its node.
    fn check_names(&self) {
        let names: Vec<&str> = self.nodes.iter().map(|n| n.name.as_str()).collect();
        let is_label = |s: &str| {
            !s.is_empty()
                && s.len() <= 63
                && s.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !s.starts_with('-')
                && !s.ends_with('-')
        };
        let is_subdomain = |s: &str| s.len() <= 253 && s.split('.').all(is_label);
        for pod in self.standin.list("pods") {
            let name = pod["metadata"]["name"].as_str().unwrap();
            assert!(is_label(name), "pod name {name:?}");
            let node = pod["spec"]["nodeName"].as_str().unwrap();
            assert!(names.contains(&node), "pod {name} on {node}");
            let label = pod["metadata"]["labels"]["gpu.cleave.dev/node"]
                .as_str()
                .unwrap_or_default();
            if node.len() <= 63 {
                assert_eq!(label, node, "pod {name}");
            } else {
                assert!(label.starts_with("sha256-") && label.len() <= 63, "{label}");
            }
            for (k, v) in pod["metadata"]["labels"].as_object().unwrap() {
                assert!(
                    v.as_str().is_some_and(is_label_value),
                    "pod {name}: label {k}={v}"
                );
            }
        }
        // Node labels of different nodes differ (the hash of a long name included).
        let labels: BTreeSet<String> = self
            .standin
            .list("pods")
            .iter()
            .map(|p| {
                format!(
                    "{}={}",
                    p["spec"]["nodeName"], p["metadata"]["labels"]["gpu.cleave.dev/node"]
                )
            })
            .collect();
        let distinct: BTreeSet<String> = labels
            .iter()
            .map(|l| l.split_once('=').unwrap().1.to_owned())
            .collect();
        assert_eq!(
            labels.len(),
            distinct.len(),
            "one node label per node: {labels:?}"
        );
        let slices = self.standin.list("resourceslices");
        for node in &names {
            assert!(
                slices.iter().any(|s| s["spec"]["nodeName"] == *node),
                "no slice of {node}"
            );
        }
        for s in &slices {
            let name = s["metadata"]["name"].as_str().unwrap();
            assert!(is_subdomain(name), "slice name {name:?}");
            let node = s["spec"]["nodeName"].as_str().unwrap();
            assert!(names.contains(&node), "slice {name} of {node}");
            assert_eq!(s["spec"]["pool"]["name"], node, "slice {name}");
        }
        for e in self.standin.list("events.events.k8s.io") {
            let name = e["metadata"]["name"].as_str().unwrap();
            assert!(is_subdomain(name), "Event name {name:?}");
            let instance = e["reportingInstance"].as_str().unwrap_or_default();
            assert!(
                !instance.is_empty() && instance.len() <= 128,
                "Event {name}: reportingInstance of {} characters",
                instance.len()
            );
            // It names exactly one node: the node itself, or (cut) the start of its name.
            let named = names
                .iter()
                .filter(|n| {
                    **n == instance || (instance.len() == 128 && n.starts_with(&instance[..95]))
                })
                .count();
            assert_eq!(named, 1, "Event {name}: reportingInstance {instance}");
        }
        for (i, node) in self.nodes.iter().enumerate() {
            let Some(kubelet) = &node.kubelet else {
                continue;
            };
            let own: BTreeSet<String> = self
                .daemon_keys(&self.placed, i)
                .iter()
                .map(|k| daemon_pod_name(&node.name, k))
                .collect();
            for s in kubelet.started.lock().unwrap().iter() {
                assert!(
                    own.contains(&s.name),
                    "{} ran pod {}, not one of its own {own:?}",
                    node.name,
                    s.name
                );
            }
        }
    }

    /// Nothing of `claims` is left on any node: no CDI spec, no checkpoint entry, no daemon
    /// pod, no pipe directory, no live daemon, and no MIG instance but the static one.
    async fn check_clean(&self) {
        let started = Instant::now();
        for node in &self.nodes {
            let static_migs = usize::from(!self.mode.dynamic_mig);
            loop {
                let cdi = node.cdi_files();
                let left = (
                    cdi.iter().any(|f| f.contains("-0000-4000-8000-")),
                    node.checkpoint_claims().len(),
                    self.standin
                        .list("pods")
                        .iter()
                        .filter(|p| p["spec"]["nodeName"] == node.name.as_str())
                        .count(),
                    node.pipe_dirs().len(),
                    node.live_daemons(),
                    node.mig_instances().len(),
                );
                if left == (false, 0, 0, 0, 0, static_migs) {
                    break;
                }
                assert!(
                    started.elapsed() < WAIT,
                    "{} is not clean (claim CDI specs, checkpoint entries, daemon pods, pipe \
                     dirs, live daemons, MIG instances) = {left:?}; CDI: {cdi:?}\n{}",
                    node.name,
                    self.logs()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    async fn stop(mut self) {
        for node in &mut self.nodes {
            node.stop_plugin();
        }
        self.nodes.clear();
    }
}

/// The replicas of one round: two shares, a per-claim MPS claim (capacity mode `mps`), a
/// whole GPU and a MIG device per node.
fn round(mode: Mode, nodes: usize) -> Vec<(Kind, usize)> {
    let mut kinds = vec![(Kind::Share, 2 * nodes)];
    if mode.capacity == "mps" {
        kinds.push((Kind::Mps, nodes));
    }
    kinds.extend([(Kind::Whole, nodes), (Kind::Mig, nodes)]);
    kinds
}

/// Every mode with replicas on every node at once, prepared together and unprepared, with
/// the names and per-node isolation checked while they are prepared.
async fn every_mode_on_every_node(mode: Mode) {
    let mut world = World::start(mode).await;
    let n = world.nodes.len();
    let claims = world.schedule(&round(mode, n), &[]);
    for i in 0..n {
        let kinds: BTreeSet<Kind> = claims
            .iter()
            .filter(|c| c.node == i)
            .map(|c| c.kind)
            .collect();
        assert_eq!(kinds.len(), round(mode, n).len(), "node {i} got every kind");
    }
    world.call(&claims, false).await;
    world.check_prepared(&claims);
    world.check_names();
    world.call(&claims, true).await;
    world.check_clean().await;
    world.check_names();
    world.stop().await;
}

async fn shares_mps_and_on_demand_mig_with_daemon_pods_on_every_node() {
    every_mode_on_every_node(Mode {
        capacity: "mps",
        launcher: "pod",
        dynamic_mig: true,
    })
    .await;
}

async fn shares_mps_and_on_demand_mig_with_daemon_processes_on_every_node() {
    every_mode_on_every_node(Mode {
        capacity: "mps",
        launcher: "process",
        dynamic_mig: true,
    })
    .await;
}

async fn time_slicing_shares_and_static_mig_on_every_node() {
    every_mode_on_every_node(Mode {
        capacity: "time-slicing",
        launcher: "pod",
        dynamic_mig: false,
    })
    .await;
}

/// A node lost mid-run (its plugin killed with SIGKILL, its pods deleted) disturbs no other
/// node: their claims stay prepared, their daemon pods stay (same UIDs), and they prepare
/// and unprepare more claims; the lost node, back, cleans up after itself.
async fn a_lost_node_disturbs_no_other() {
    let mode = Mode {
        capacity: "mps",
        launcher: "pod",
        dynamic_mig: true,
    };
    let mut world = World::start(mode).await;
    let n = world.nodes.len();
    let claims = world.schedule(&round(mode, n), &[]);
    world.call(&claims, false).await;
    world.check_prepared(&claims);
    let lost = n - 1; // the node of 253 characters
    let before: Vec<BTreeMap<String, String>> = (0..n).map(|i| world.pods_of(i)).collect();
    assert!(before.iter().all(|p| p.len() == 2), "{before:?}");

    world.nodes[lost].kill_plugin();
    for name in before[lost].keys() {
        world.standin.delete("pods", NAMESPACE, name);
    }
    // Its kubelet stopped the daemons of the deleted pods.
    let started = Instant::now();
    while world.nodes[lost].live_daemons() > 0 {
        assert!(started.elapsed() < WAIT, "{}", world.nodes[lost].log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The others: still prepared, same pods; a further round works.
    let survivors: Vec<Placed> = claims.iter().filter(|c| c.node != lost).cloned().collect();
    world.call(&survivors, false).await;
    let more = world.schedule(&[(Kind::Share, n - 1)], &[lost]);
    world.call(&more, false).await;
    world.check_prepared(&[survivors.clone(), more.clone()].concat());
    for i in (0..n).filter(|i| *i != lost) {
        let now = world.pods_of(i);
        for (name, uid) in &before[i] {
            assert_eq!(
                now.get(name),
                Some(uid),
                "{}: pod {name}",
                world.nodes[i].name
            );
        }
        assert_eq!(
            world.nodes[i].checkpoint_claims().len(),
            6,
            "{}",
            world.nodes[i].name
        );
    }
    world.call(&more, true).await;
    world.check_names();

    // The lost node comes back: it starts its claims' daemons again (their pods were
    // deleted) and unprepares them; nothing of it or the others is left.
    let kubeconfig = world.kubeconfig.clone();
    world.nodes[lost]
        .start(&world.standin, &kubeconfig, mode)
        .await;
    let started = Instant::now();
    while world.pods_of(lost).len() < 2 {
        assert!(started.elapsed() < WAIT, "{}", world.nodes[lost].log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // One of its daemon pods is evicted now: the periodic check starts it again and says
    // so in an Event on the claim, reported by this node (its name of 253 characters).
    let mps = claims
        .iter()
        .find(|c| c.node == lost && c.kind == Kind::Mps)
        .unwrap();
    world.standin.delete(
        "pods",
        NAMESPACE,
        &daemon_pod_name(&world.nodes[lost].name, &mps.uid),
    );
    let name = mps.name.clone();
    world
        .standin
        .wait_for("events.events.k8s.io", WAIT, |evs| {
            evs.iter().any(|e| {
                e["reason"] == "MPSDaemonRestarted" && e["regarding"]["name"] == name.as_str()
            })
        })
        .await
        .unwrap_or_else(|evs| panic!("no MPSDaemonRestarted Event: {evs:#?}\n{}", world.logs()));
    let all: Vec<Placed> = claims.to_vec();
    world.call(&all, true).await;
    world.check_clean().await;
    world.check_names();
    world.stop().await;
}

/// The operator walk of the docs on every node at once: a real Prometheus scrapes each
/// node's plugin pod through the job the Prometheus Operator generates for the chart's
/// PodMonitor (release namespace `cleave-system`, one target per plugin pod) while the
/// claims of two teams' namespaces are prepared on every node. Each claim's series names
/// its own namespace and its node's pod; the per-namespace counts, the `namespace:*`
/// recording rule and the dashboard's per-namespace queries add up both teams' claims
/// over all nodes, each under its own namespace, never the release's.
async fn the_operator_walk_sees_each_teams_claims_on_every_node() {
    if !prometheus_found() {
        cleave_testkit::runner::tool_missing(
            "prometheus",
            "CLEAVE_REQUIRE_PROMETHEUS",
            "prometheus and promtool are not installed (Debian: apt-get install prometheus)",
        );
        return;
    }
    let mode = Mode {
        capacity: "mps",
        launcher: "pod",
        dynamic_mig: true,
    };
    let teams = ["team-a", "team-b"];
    let mut world = World::start_with(mode, &teams, true).await;
    let n = world.nodes.len();
    let claims = world.schedule(&round(mode, n), &[]);
    world.call(&claims, false).await;
    let pods: Vec<(u16, String)> = world
        .nodes
        .iter()
        .enumerate()
        .map(|(i, node)| {
            (
                node.metrics_port.unwrap(),
                format!("cleave-kubelet-plugin-n{i}x7k"),
            )
        })
        .collect();
    let targets: Vec<(u16, &str)> = pods.iter().map(|(p, n)| (*p, n.as_str())).collect();
    let prom_dir = world._dir.path().join("prometheus");
    let (prometheus, port) = start_prometheus(
        &prom_dir,
        &operator_scrape_job(&targets, chart_pod_monitor_honor_labels()),
    );
    let failure = |world: &World| {
        format!(
            "\nprometheus log:\n{}\n{}",
            std::fs::read_to_string(prom_dir.join("log")).unwrap_or_default(),
            world.logs()
        )
    };
    let metric = "cleave_kubelet_plugin_claim_allocated_memory_bytes";
    let queries: Vec<String> = claims
        .iter()
        .map(|c| format!(r#"{metric}{{claim="{}"}}"#, c.name))
        .collect();
    if let Err(e) = wait_for_series(port, &queries, Duration::from_secs(90)) {
        panic!("{e}{}", failure(&world));
    }
    // Each claim: its own namespace, its node's plugin pod, the operator's job.
    for c in &claims {
        let series = prom_query(port, &format!(r#"{metric}{{claim="{}"}}"#, c.name)).unwrap();
        assert_eq!(series.len(), 1, "{}: {series:?}", c.name);
        let m = &series[0]["metric"];
        assert_eq!(m["namespace"], c.namespace.as_str(), "{}: {m}", c.name);
        assert_eq!(m["pod"], pods[c.node].1.as_str(), "{}: {m}", c.name);
        assert_eq!(m["job"], "cleave-system/cleave-kubelet-plugin", "{m}");
    }
    // Per namespace, over all nodes: as many series as claims, on every node's pod.
    let count = |query: &str| -> BTreeMap<String, String> {
        prom_query(port, query)
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s["metric"]["namespace"].as_str().unwrap_or("").to_owned(),
                    s["value"][1].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    };
    let mut want: BTreeMap<String, String> = BTreeMap::new();
    for t in teams {
        let k = claims.iter().filter(|c| c.namespace == t).count();
        assert!(k >= n, "{t}: {k} claims");
        want.insert(t.to_owned(), k.to_string());
    }
    assert_eq!(count(&format!("count by (namespace) ({metric})")), want);
    let spread: BTreeMap<String, String> = teams
        .iter()
        .map(|t| ((*t).to_owned(), n.to_string()))
        .collect();
    assert_eq!(
        count(&format!(
            "count by (namespace) (count by (namespace, pod) ({metric}))"
        )),
        spread,
        "each team's claims are on every node's pod"
    );
    // The recording rule (claims with a recommendation, after half the 24 s window): one
    // series per team, over all nodes, none for the release namespace.
    let started = Instant::now();
    loop {
        let rule = count("namespace:cleave_claim_allocated_memory_bytes:sum");
        if rule.keys().eq(teams.iter()) && rule.values().all(|v| v != "0") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "namespace:cleave_claim_allocated_memory_bytes:sum {rule:?}{}",
            failure(&world)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The dashboard filtered to one team: its per-namespace queries answer only with that
    // team's series, and each team gets an answer from some of them.
    let per_namespace: Vec<String> = dashboard_queries("\u{0}")
        .into_iter()
        .filter(|q| q.contains('\u{0}'))
        .collect();
    assert!(
        !per_namespace.is_empty(),
        "the dashboard has no $namespace query"
    );
    for t in teams {
        let mut answered = 0;
        for q in &per_namespace {
            let series = prom_query(port, &q.replace('\u{0}', t)).unwrap();
            answered += usize::from(!series.is_empty());
            for s in &series {
                let got = &s["metric"]["namespace"];
                assert!(got.is_null() || got == t, "{q} for {t}: {s}");
            }
        }
        assert!(answered > 0, "no per-namespace query answers for {t}");
    }
    let exported = prom_query(port, r#"{exported_namespace!=""}"#).unwrap();
    assert!(
        exported.is_empty(),
        "series with exported_namespace: {exported:?}"
    );
    drop(prometheus);
    world.call(&claims, true).await;
    world.check_clean().await;
    world.stop().await;
}

const TESTS: [cleave_testkit::runner::Test; 5] = [
    (
        "shares_mps_and_on_demand_mig_with_daemon_pods_on_every_node",
        || block_on(shares_mps_and_on_demand_mig_with_daemon_pods_on_every_node()),
    ),
    (
        "shares_mps_and_on_demand_mig_with_daemon_processes_on_every_node",
        || block_on(shares_mps_and_on_demand_mig_with_daemon_processes_on_every_node()),
    ),
    ("time_slicing_shares_and_static_mig_on_every_node", || {
        block_on(time_slicing_shares_and_static_mig_on_every_node())
    }),
    ("a_lost_node_disturbs_no_other", || {
        block_on(a_lost_node_disturbs_no_other())
    }),
    (
        "the_operator_walk_sees_each_teams_claims_on_every_node",
        || block_on(the_operator_walk_sees_each_teams_claims_on_every_node()),
    ),
];

fn main() -> std::process::ExitCode {
    cleave_testkit::runner::main(&TESTS)
}
