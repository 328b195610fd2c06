//! A node for end-to-end tests: the real plugin binary against the mock NVML library and
//! the in-process API server stand-in, with the test acting as the kubelet.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use cleave_apiserver_standin::{StandIn, fixtures};
use cleave_kubelet_plugin::proto::dra::v1;
use k8s_openapi::api::resource::v1::{DeviceAllocationConfiguration, ResourceClaim};

use super::TIMEOUT;

pub const NODE: &str = "node-a";
pub const DRIVER: &str = "gpu.cleave.dev";

/// Files and directories of one simulated node.
pub struct NodeDirs {
    pub tmp: tempfile::TempDir,
}

impl NodeDirs {
    pub fn new() -> Self {
        Self {
            tmp: tempfile::tempdir().unwrap(),
        }
    }
    pub fn path(&self) -> &Path {
        self.tmp.path()
    }
    pub fn registrar(&self) -> PathBuf {
        self.path().join("plugins_registry")
    }
    pub fn plugins(&self) -> PathBuf {
        self.path().join("plugins")
    }
    pub fn state_dir(&self) -> PathBuf {
        self.plugins().join(DRIVER)
    }
    /// The MPS pipe root the plugin runs with (`--mps-pipe-root`), inside the test's dir.
    pub fn mps_pipe_root(&self) -> PathBuf {
        self.path().join("run")
    }
    /// The pipe directory of MPS daemon `key` (a claim UID or `shared-<device>`).
    pub fn mps_pipe_dir(&self, key: &str) -> PathBuf {
        cleave_driver::sharing::pipe_dir_under(&self.mps_pipe_root(), &self.state_dir(), key)
    }
    pub fn cdi_root(&self) -> PathBuf {
        self.path().join("cdi")
    }
    pub fn driver_root(&self) -> PathBuf {
        self.path().join("driver-root")
    }

    /// Lays the driver root out like an Ubuntu host with the GPUs of a mock `profile`
    /// (device nodes, libraries and soname links, tools, `proc/devices`); idempotent, and
    /// fakes a test put into `usr/bin` stay.
    pub fn lay_out_driver_root(&self, profile: &str) {
        cleave_testkit::driver_root::lay_out_profile(&self.driver_root(), profile, None);
    }

    /// [`Self::lay_out_driver_root`] with the mock library as the root's NVML.
    pub fn lay_out_driver_root_with_nvml(&self, profile: &str) {
        cleave_testkit::driver_root::lay_out_profile(
            &self.driver_root(),
            profile,
            Some(mock_lib()),
        );
    }

    /// Installs the fake NVIDIA tools under the driver root (wrappers running this test
    /// binary) and returns their knobs (record files in this node's directory), for the
    /// plugin's environment.
    pub fn install_fake_tools(&self) -> Vec<(&'static str, String)> {
        cleave_testkit::fake_tools::install_wrappers(&self.driver_root().join("usr/bin")).unwrap();
        cleave_testkit::fake_tools::FakeFiles::in_dir(self.path()).env()
    }
    pub fn mock_state(&self) -> PathBuf {
        self.path().join("mock-nvml-state.json")
    }
    pub fn kubeconfig(&self) -> PathBuf {
        self.path().join("kubeconfig")
    }
    pub fn checkpoint(&self) -> PathBuf {
        self.state_dir().join("checkpoint.json")
    }
    /// What the plugin processes logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.path().join("plugin.log")).unwrap_or_default()
    }
    /// CDI spec files present now.
    pub fn cdi_files(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.cdi_root())
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }
}

/// The plugin's stderr: appended to `plugin.log` in the node's directory (restarts
/// append), printed by assertions that fail.
fn log_file(dirs: &NodeDirs) -> std::fs::File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dirs.path().join("plugin.log"))
        .unwrap()
}

/// The stand-in with a Node object, and a kubeconfig file pointing at it.
pub async fn start_standin(dirs: &NodeDirs) -> StandIn {
    cleave_testkit::standin::start_with_node(NODE, &dirs.kubeconfig()).await
}

pub use cleave_testkit::mock_lib;

/// How to start the plugin binary.
pub struct PluginOptions {
    pub profile: &'static str,
    pub mig: &'static str,
    pub dynamic_mig: bool,
    pub pod_uid: Option<&'static str>,
    /// Serve metrics and health on 127.0.0.1 at this port.
    pub metrics_port: Option<u16>,
    /// More environment variables (e.g. `MOCK_NVML_CONTROL`, `DEVICE_TAINTS`).
    pub env: Vec<(&'static str, String)>,
    /// Install the mock library in the driver root as `libnvidia-ml.so.<version>` with its
    /// soname link, and pass no `NVML_LIB`: the plugin finds NVML as on a real host.
    pub nvml_from_driver_root: bool,
    /// Leave the driver root as the test laid it out (start lays it out otherwise).
    pub driver_root_as_is: bool,
}

impl Default for PluginOptions {
    fn default() -> Self {
        Self {
            profile: "h100-80gb-x8",
            mig: "off",
            dynamic_mig: false,
            pod_uid: None,
            metrics_port: None,
            env: Vec::new(),
            nvml_from_driver_root: false,
            driver_root_as_is: false,
        }
    }
}

/// The running plugin binary; killed on drop if still running.
pub struct Plugin {
    pub child: Child,
    pub registration_socket: PathBuf,
    pub dra_socket: PathBuf,
}

impl Plugin {
    pub fn start(dirs: &NodeDirs, opts: &PluginOptions) -> Self {
        let (cmd, reg, dra) = Self::command(dirs, opts);
        Self::spawn(dirs, cmd, reg, dra)
    }

    /// [`Plugin::start`] for options that move the plugins directory
    /// (`KUBELET_PLUGINS_DIRECTORY_PATH`): the DRA socket is in `state_dir`.
    #[allow(dead_code)]
    pub fn start_with_state_dir(dirs: &NodeDirs, opts: &PluginOptions, state_dir: &Path) -> Self {
        let (cmd, reg, dra) = Self::command(dirs, opts);
        let dra = state_dir.join(dra.file_name().unwrap());
        Self::spawn(dirs, cmd, reg, dra)
    }

    fn spawn(dirs: &NodeDirs, mut cmd: Command, reg: PathBuf, dra: PathBuf) -> Self {
        let mut child = cmd.spawn().unwrap();
        let started = Instant::now();
        // Connectable, not merely present: a plugin that was killed leaves its socket files
        // behind. The DRA socket is served before the registration socket.
        while std::os::unix::net::UnixStream::connect(&reg).is_err() {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("plugin exited early with {status}:\n{}", dirs.log());
            }
            assert!(
                started.elapsed() < TIMEOUT,
                "plugin did not create {}",
                reg.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Self {
            child,
            registration_socket: reg,
            dra_socket: dra,
        }
    }

    /// Runs the plugin binary with `opts` and waits (at most [`TIMEOUT`]) for it to exit by
    /// itself, as a misconfigured instance must; its log goes to the node's log file.
    pub fn run_to_exit(dirs: &NodeDirs, opts: &PluginOptions) -> ExitStatus {
        let (mut cmd, _, _) = Self::command(dirs, opts);
        let mut child = cmd.spawn().unwrap();
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if started.elapsed() > TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                panic!("plugin did not exit by itself:\n{}", dirs.log());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The command that runs the plugin binary, with its registration and DRA socket paths.
    fn command(dirs: &NodeDirs, opts: &PluginOptions) -> (Command, PathBuf, PathBuf) {
        if opts.driver_root_as_is {
        } else if opts.nvml_from_driver_root {
            dirs.lay_out_driver_root_with_nvml(opts.profile);
        } else {
            dirs.lay_out_driver_root(opts.profile);
        }
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"));
        cmd.arg("run")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("NODE_NAME", NODE)
            .env("KUBECONFIG", dirs.kubeconfig())
            .env("MOCK_NVML_PROFILE", opts.profile)
            .env("MOCK_NVML_MIG", opts.mig)
            .env("MOCK_NVML_STATE", dirs.mock_state())
            .env("KUBELET_REGISTRAR_DIRECTORY_PATH", dirs.registrar())
            .env("KUBELET_PLUGINS_DIRECTORY_PATH", dirs.plugins())
            .env("CDI_ROOT", dirs.cdi_root())
            .env("MPS_PIPE_ROOT", dirs.mps_pipe_root())
            .env("NVIDIA_DRIVER_ROOT", dirs.driver_root())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stderr(log_file(dirs));
        if !opts.nvml_from_driver_root {
            cmd.env("NVML_LIB", mock_lib());
        }
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        if opts.dynamic_mig {
            cmd.arg("--dynamic-mig");
        }
        if let Some(port) = opts.metrics_port {
            cmd.arg(format!("--metrics-addr=127.0.0.1:{port}"));
        }
        let (reg, dra) = match opts.pod_uid {
            Some(uid) => {
                cmd.env("POD_UID", uid);
                (
                    dirs.registrar().join(format!("{DRIVER}-{uid}-reg.sock")),
                    dirs.state_dir().join(format!("dra-{uid}.sock")),
                )
            }
            None => (
                dirs.registrar().join(format!("{DRIVER}-reg.sock")),
                dirs.state_dir().join("dra.sock"),
            ),
        };
        (cmd, reg, dra)
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(mut self) -> ExitStatus {
        let pid = self.child.id().to_string();
        let ok = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(ok.success());
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                started.elapsed() < TIMEOUT,
                "plugin did not stop after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// An allocated claim in the stand-in; `results` are `(request, device)` pairs.
pub fn put_claim(
    standin: &StandIn,
    name: &str,
    uid: &str,
    results: &[(&str, &str)],
    configs: &[DeviceAllocationConfiguration],
) -> ResourceClaim {
    put_claim_in(standin, name, uid, DRIVER, NODE, results, configs)
}

pub fn put_claim_in(
    standin: &StandIn,
    name: &str,
    uid: &str,
    driver: &str,
    pool: &str,
    results: &[(&str, &str)],
    configs: &[DeviceAllocationConfiguration],
) -> ResourceClaim {
    let claim = fixtures::resource_claim("default", name, uid, driver, pool, results, configs);
    standin.put(&claim).unwrap();
    claim
}

pub fn claim(name: &str, uid: &str) -> v1::Claim {
    v1::Claim {
        namespace: "default".into(),
        name: name.into(),
        uid: uid.into(),
    }
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A plain HTTP/1.1 GET; returns (status code, body, a chunked body decoded), or None if
/// nothing listens yet.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .replace(' ', "")
            .starts_with("transfer-encoding:chunked")
    });
    if !chunked {
        return Some((status, body.to_owned()));
    }
    // Chunks: a hex size line, that many bytes, CRLF; a zero size ends the body.
    let mut rest = body;
    let mut out = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some((status, out));
        }
        out.push_str(after.get(..size)?);
        rest = after.get(size..)?.strip_prefix("\r\n")?;
    }
}

/// Bound of one DRA call: longer than any start deadline inside it (the kubelet allows 45 s).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// NodePrepareResources over v1; panics on a transport error or after [`CALL_TIMEOUT`].
pub async fn prepare(
    dra: &mut v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel>,
    claims: Vec<v1::Claim>,
) -> v1::NodePrepareResourcesResponse {
    tokio::time::timeout(
        CALL_TIMEOUT,
        dra.node_prepare_resources(v1::NodePrepareResourcesRequest { claims }),
    )
    .await
    .unwrap()
    .unwrap()
    .into_inner()
}

/// NodeUnprepareResources over v1; panics on a transport error or after [`CALL_TIMEOUT`].
pub async fn unprepare(
    dra: &mut v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel>,
    claims: Vec<v1::Claim>,
) -> v1::NodeUnprepareResourcesResponse {
    tokio::time::timeout(
        CALL_TIMEOUT,
        dra.node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims }),
    )
    .await
    .unwrap()
    .unwrap()
    .into_inner()
}

/// The first Event with `reason` the stand-in holds, waiting up to [`TIMEOUT`] for one.
pub async fn wait_event(standin: &StandIn, reason: &str) -> serde_json::Value {
    let found = standin
        .wait_for("events.events.k8s.io", TIMEOUT, |evs| {
            evs.iter().any(|e| e["reason"] == reason)
        })
        .await
        .unwrap_or_else(|evs| panic!("no {reason} Event; events: {evs:?}"));
    found.into_iter().find(|e| e["reason"] == reason).unwrap()
}
