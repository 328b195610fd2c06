//! A fake kubelet for pods the plugin creates (MPS daemon pods): it watches the stand-in for
//! pods bound to the node, "runs" each one's container as a local process (the image is
//! this crate's binary; volume mounts are emulated by rewriting paths in the arguments and
//! environment to the host paths behind them; memory emptyDirs are plain directories under
//! the kubelet root, where the real kubelet has them), reports the pod's phase in its
//! status, and stops the process (SIGTERM, then SIGKILL) when the pod is deleted.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;

/// The label selector of the fake kubelet's pod LISTs: the MPS daemon pods.
pub const KUBELET_LABEL_SELECTOR: &str = "app.kubernetes.io/name=cleave-mps";

/// The plugin image's binary path, as the pod spec names it.
pub const IMAGE_BINARY: &str = "/usr/bin/cleave-kubelet-plugin";

/// How the fake kubelet behaves.
#[derive(Debug, Clone, Default)]
pub struct KubeletOptions {
    /// Environment added to every container (the fakes' knobs).
    pub env: Vec<(String, String)>,
    /// When set, no container starts: pods stay Pending with this waiting reason.
    pub image_pull_error: Option<String>,
    /// A command prefix every container runs under (e.g. `nsenter --mount=...` to run it in
    /// its node's mount namespace).
    pub wrap: Vec<String>,
}

struct Running {
    name: String,
    child: Child,
    dirs: Vec<PathBuf>,
    log: PathBuf,
}

/// A pod the fake kubelet started: its name, UID and the command line it ran.
#[derive(Debug, Clone)]
pub struct Started {
    pub name: String,
    pub uid: String,
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
}

/// The running fake kubelet; stops its pods' processes on drop.
pub struct FakeKubelet {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Every pod started so far.
    pub started: Arc<Mutex<Vec<Started>>>,
}

impl FakeKubelet {
    /// Starts serving pods of `node` from the stand-in at `config`; containers run `exe`
    /// for [`IMAGE_BINARY`]; emptyDirs go under `kubelet_root`; container output goes to
    /// files in `log_dir`.
    pub fn start(
        config: kube::Config,
        node: &str,
        kubelet_root: &Path,
        exe: &Path,
        log_dir: &Path,
        options: KubeletOptions,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let started = Arc::new(Mutex::new(Vec::new()));
        let ctx = Ctx {
            node: node.to_owned(),
            kubelet_root: kubelet_root.to_owned(),
            exe: exe.to_owned(),
            log_dir: log_dir.to_owned(),
            options,
            started: Arc::clone(&started),
        };
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(ctx.serve(config, &stop));
            })
        };
        Self {
            stop,
            thread: Some(thread),
            started,
        }
    }
}

impl Drop for FakeKubelet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Ctx {
    node: String,
    kubelet_root: PathBuf,
    exe: PathBuf,
    log_dir: PathBuf,
    options: KubeletOptions,
    started: Arc<Mutex<Vec<Started>>>,
}

/// `value` with a leading container path replaced by the host path behind it.
fn rewrite(value: &str, mounts: &[(String, PathBuf)]) -> String {
    for (container, host) in mounts {
        if value == container {
            return host.display().to_string();
        }
        if let Some(rest) = value.strip_prefix(&format!("{container}/")) {
            return host.join(rest).display().to_string();
        }
    }
    value.to_owned()
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// SIGTERM, up to 10 s, then SIGKILL.
fn stop_running(mut r: Running) {
    signal(r.child.id(), "-TERM");
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if r.child.try_wait().ok().flatten().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if r.child.try_wait().ok().flatten().is_none() {
        let _ = r.child.kill();
        let _ = r.child.wait();
    }
}

impl Ctx {
    async fn serve(self, config: kube::Config, stop: &AtomicBool) {
        let client = kube::Client::try_from(config).unwrap();
        let pods: Api<Pod> = Api::all(client.clone());
        let mut running: BTreeMap<String, Running> = BTreeMap::new();
        let mut volumes: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
        let mut seen: std::collections::BTreeSet<String> = Default::default();
        // Only the daemon pods (the pods it runs); the label also tells its LISTs from the
        // plugin's own node pod watch in the stand-in's request log.
        let params = ListParams::default()
            .fields(&format!("spec.nodeName={}", self.node))
            .labels(KUBELET_LABEL_SELECTOR);
        while !stop.load(Ordering::SeqCst) {
            let Ok(list) = pods.list(&params).await else {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            let present: BTreeMap<String, Pod> = list
                .items
                .into_iter()
                .filter_map(|p| Some((p.metadata.uid.clone()?, p)))
                .collect();
            // Deleted pods: stop their containers.
            let gone: Vec<String> = running
                .keys()
                .filter(|uid| !present.contains_key(*uid))
                .cloned()
                .collect();
            for uid in gone {
                if let Some(r) = running.remove(&uid) {
                    stop_running(r);
                }
            }
            // Volumes go with the pod, as the kubelet's do.
            let deleted: Vec<String> = volumes
                .keys()
                .filter(|uid| !present.contains_key(*uid))
                .cloned()
                .collect();
            for uid in deleted {
                for d in volumes.remove(&uid).unwrap_or_default() {
                    let _ = std::fs::remove_dir_all(d);
                }
            }
            // Exited containers: report the phase.
            let mut ended = Vec::new();
            for (uid, r) in running.iter_mut() {
                if let Ok(Some(status)) = r.child.try_wait() {
                    ended.push((uid.clone(), r.name.clone(), status.code().unwrap_or(137)));
                }
            }
            for (uid, name, code) in ended {
                if let Some(r) = running.remove(&uid) {
                    let tail = std::fs::read_to_string(&r.log).unwrap_or_default();
                    let tail: Vec<&str> = tail.lines().rev().take(3).collect();
                    let ns = present[&uid].metadata.namespace.clone().unwrap_or_default();
                    let phase = if code == 0 { "Succeeded" } else { "Failed" };
                    self.patch_status(&client, &ns, &name, json!({
                        "phase": phase,
                        "containerStatuses": [{"name": container_name(&present[&uid]),
                            "ready": false, "restartCount": 0, "image": "cleave:test", "imageID": "",
                            "state": {"terminated": {"exitCode": code,
                                "reason": if code == 0 { "Completed" } else { "Error" },
                                "message": tail.into_iter().rev().collect::<Vec<_>>().join("\n")}}}]
                    }))
                    .await;
                }
            }
            // New pods: start them.
            for (uid, pod) in &present {
                if seen.contains(uid) || pod.metadata.deletion_timestamp.is_some() {
                    continue;
                }
                seen.insert(uid.clone());
                let ns = pod.metadata.namespace.clone().unwrap_or_default();
                let name = pod.metadata.name.clone().unwrap_or_default();
                if let Some(reason) = &self.options.image_pull_error {
                    self.patch_status(&client, &ns, &name, json!({
                        "phase": "Pending",
                        "containerStatuses": [{"name": container_name(pod), "ready": false,
                            "restartCount": 0, "image": "cleave:test", "imageID": "",
                            "state": {"waiting": {"reason": reason, "message": "fake kubelet: cannot pull"}}}]
                    }))
                    .await;
                    continue;
                }
                let r = self.run(pod, uid);
                volumes.insert(uid.clone(), r.dirs.clone());
                self.patch_status(
                    &client,
                    &ns,
                    &name,
                    json!({
                        "phase": "Running",
                        "containerStatuses": [{"name": container_name(pod), "ready": true,
                            "restartCount": 0, "image": "cleave:test", "imageID": "",
                            "state": {"running": {}}}]
                    }),
                )
                .await;
                running.insert(uid.clone(), r);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for (_, r) in running {
            stop_running(r);
        }
        for d in volumes.into_values().flatten() {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    async fn patch_status(
        &self,
        client: &kube::Client,
        ns: &str,
        name: &str,
        status: serde_json::Value,
    ) {
        let api: Api<Pod> = Api::namespaced(client.clone(), ns);
        let _ = api
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": status})),
            )
            .await;
    }

    fn run(&self, pod: &Pod, uid: &str) -> Running {
        let spec = pod.spec.clone().unwrap();
        let container = &spec.containers[0];
        let mut dirs = Vec::new();
        let mut volumes: BTreeMap<String, PathBuf> = BTreeMap::new();
        for v in spec.volumes.unwrap_or_default() {
            if let Some(h) = &v.host_path {
                volumes.insert(v.name.clone(), PathBuf::from(&h.path));
            } else if v.empty_dir.is_some() {
                let dir = self
                    .kubelet_root
                    .join("pods")
                    .join(uid)
                    .join("volumes/kubernetes.io~empty-dir")
                    .join(&v.name);
                std::fs::create_dir_all(&dir).unwrap();
                dirs.push(self.kubelet_root.join("pods").join(uid));
                volumes.insert(v.name.clone(), dir);
            }
        }
        let mut mounts: Vec<(String, PathBuf)> = container
            .volume_mounts
            .clone()
            .unwrap_or_default()
            .into_iter()
            .filter_map(|m| Some((m.mount_path, volumes.get(&m.name)?.clone())))
            .collect();
        // Longest container path first, so nested mounts win.
        mounts.sort_by_key(|(c, _)| std::cmp::Reverse(c.len()));
        let mut argv: Vec<String> = container.command.clone().unwrap_or_default();
        argv.extend(container.args.clone().unwrap_or_default());
        let argv: Vec<String> = argv
            .into_iter()
            .map(|a| {
                if a == IMAGE_BINARY {
                    return self.exe.display().to_string();
                }
                match a.split_once('=') {
                    Some((flag, value)) if flag.starts_with("--") => {
                        format!("{flag}={}", rewrite(value, &mounts))
                    }
                    _ => rewrite(&a, &mounts),
                }
            })
            .collect();
        let env: BTreeMap<String, String> = container
            .env
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|e| {
                let v = rewrite(&e.value.unwrap_or_default(), &mounts);
                (e.name, v)
            })
            .chain(self.options.env.iter().cloned())
            .collect();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let log = self.log_dir.join(format!("{name}-{uid}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let mut cmd = match self.options.wrap.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).args(&argv);
                c
            }
            None => {
                let mut c = Command::new(&argv[0]);
                c.args(&argv[1..]);
                c
            }
        };
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("RUST_LOG", "info")
            .envs(&env)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        let child = cmd.spawn().unwrap();
        self.started.lock().unwrap().push(Started {
            name: name.clone(),
            uid: uid.to_owned(),
            argv,
            env,
        });
        Running {
            name,
            child,
            dirs,
            log,
        }
    }
}

fn container_name(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .map(|c| c.name.clone())
        .unwrap_or_default()
}

/// Namespace of the plugin's DaemonSet, where its MPS daemon pods go.
pub const NAMESPACE: &str = "cleave-system";

/// A node whose MPS daemons run in pods of the fake kubelet (`--mps-launcher=pod`): the
/// plugin's files, the fake tools under the driver root (wrappers running this test
/// binary) with their records, and the kubelet's root.
pub struct PodWorld {
    pub dirs: super::node::NodeDirs,
    pub fakes: cleave_testkit::fake_tools::FakeFiles,
}

impl PodWorld {
    pub fn new() -> Self {
        let dirs = super::node::NodeDirs::new();
        cleave_testkit::fake_tools::install_wrappers(&dirs.driver_root().join("usr/bin")).unwrap();
        std::fs::create_dir_all(dirs.path().join("pod-logs")).unwrap();
        let fakes = cleave_testkit::fake_tools::FakeFiles::in_dir(dirs.path());
        Self { dirs, fakes }
    }
    pub fn kubelet_root(&self) -> PathBuf {
        self.dirs.path().join("kubelet")
    }
    /// What the fake MPS control recorded so far.
    pub fn record(&self) -> Vec<String> {
        self.fakes.mps_lines()
    }
    /// The fakes' knobs, for the plugin and for every container.
    pub fn tool_env(&self) -> Vec<(String, String)> {
        self.fakes
            .env()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect()
    }
    /// The plugin launching MPS daemons as pods, with the fakes' knobs and `extra`.
    pub fn pod_plugin_options(
        &self,
        extra: &[(&'static str, String)],
    ) -> super::node::PluginOptions {
        let mut env: Vec<(&'static str, String)> = extra.to_vec();
        env.extend([
            ("MPS_LAUNCHER", "pod".into()),
            ("MPS_DAEMON_IMAGE", "cleave:test".into()),
            ("POD_NAMESPACE", NAMESPACE.into()),
            (
                "KUBELET_ROOT_DIR",
                self.kubelet_root().display().to_string(),
            ),
        ]);
        env.extend(self.fakes.env());
        super::node::PluginOptions {
            env,
            ..super::node::PluginOptions::default()
        }
    }
    /// The fake kubelet of this node, passing the fakes' knobs to every container.
    pub fn start_kubelet(
        &self,
        standin: &cleave_apiserver_standin::StandIn,
        mut options: KubeletOptions,
    ) -> FakeKubelet {
        options.env.extend(self.tool_env());
        FakeKubelet::start(
            standin.config(),
            super::node::NODE,
            &self.kubelet_root(),
            Path::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin")),
            &self.dirs.path().join("pod-logs"),
            options,
        )
    }
    /// The name of this node's daemon pod of `key` (claim UID or shared daemon key).
    pub fn pod_name(&self, key: &str) -> String {
        daemon_pod_name(super::node::NODE, key)
    }
    /// The stored daemon pod of `key` on this node.
    pub fn pod(&self, standin: &cleave_apiserver_standin::StandIn, key: &str) -> Option<Pod> {
        standin.get_as("pods", NAMESPACE, &self.pod_name(key))
    }
    /// The CDI spec of claim `uid` (not a device metadata spec).
    pub fn cdi_spec(&self, uid: &str) -> serde_json::Value {
        let name = self
            .dirs
            .cdi_files()
            .into_iter()
            // Not a device metadata spec (`<driver>_metadata_<uid>_<request>.json`).
            .find(|f| f.contains(uid) && !f.contains("_metadata_"))
            .unwrap_or_else(|| panic!("no CDI spec for {uid}: {:?}", self.dirs.cdi_files()));
        let text = std::fs::read_to_string(self.dirs.cdi_root().join(name)).unwrap();
        serde_json::from_str(&text)
            .or_else(|_| serde_yaml::from_str(&text))
            .unwrap()
    }
    /// Context for failed assertions: the plugin's log, the pods' logs, the MPS record.
    pub fn logs(&self) -> String {
        let mut out = format!("plugin log:\n{}\n", self.dirs.log());
        if let Ok(rd) = std::fs::read_dir(self.dirs.path().join("pod-logs")) {
            for e in rd.flatten() {
                out.push_str(&format!(
                    "--- {}:\n{}\n",
                    e.file_name().to_string_lossy(),
                    std::fs::read_to_string(e.path()).unwrap_or_default()
                ));
            }
        }
        out.push_str(&format!("fake MPS record:\n{}\n", self.record().join("\n")));
        out
    }
}

/// Waits (at most 20 s) until `done` holds; the failure shows the world's logs.
pub async fn eventually(what: &str, world: &PodWorld, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "timed out waiting until {what}\n{}",
            world.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The name the plugin of `node` gives the daemon pod of `key`:
/// `cleave-mps-<32 hex digits of SHA-256(node, 0, key, 0)>`.
pub fn daemon_pod_name(node: &str, key: &str) -> String {
    format!(
        "cleave-mps-{}",
        cleave_driver::sharing::mps::name_hash(&[node, key])
    )
}
