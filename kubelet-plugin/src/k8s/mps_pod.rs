//! MPS control daemons in pods of their own ([`PodLauncher`]); what runs inside such a pod
//! is [`crate::mps_daemon`].
//!
//! For each MPS daemon (a claim's, or the shared daemon of a device and namespace) the plugin
//! creates the pod `cleave-mps-<32 hex digits of SHA-256(node name, 0, daemon key, 0)>` in
//! its own namespace, so that the daemons of two nodes never share a name, labelled with the
//! daemon key and this node, bound to this node (`spec.nodeName`, so no scheduler is
//! involved), running this image's `mps-daemon` with the claim's devices in
//! `CUDA_VISIBLE_DEVICES`. Its
//! volumes: the claim's pipe and log directories (host paths under the plugin's state
//! directory) at the paths the claim's containers use, a memory `emptyDir` as `/dev/shm`
//! (its host path under the kubelet's root is mounted at `/dev/shm` into the claim's
//! containers, since MPS clients and server share memory there), and the driver root. The
//! plugin's DaemonSet owns the pod (the Node when the plugin runs outside a pod), so
//! uninstalling cleans up; the plugin deletes it at unprepare and re-finds it by name after
//! a restart. Take-over, finding, sweeping and deleting act only on pods whose
//! `spec.nodeName` is this node (deletes also only on the pod UID recorded or just read), so
//! one node's plugin never touches another node's daemons. The plugin talks to the daemon as
//! before: `nvidia-cuda-mps-control` on the pipe directory it shares with the pod.
//!
//! Daemon pod state comes from one watch ([`PodWatch`]) on the pods of this node
//! (`spec.nodeName`) labelled `app.kubernetes.io/name=cleave-mps`, with a server-side timeout
//! spread by the node's name: waits for a pod to run or to go, the periodic check, finding and
//! sweeping read its map, never a LIST or a polling GET. Only a name conflict at create
//! reads the pod once (it may be another node's, which the watch does not see). With usage
//! sampling on, the plugin already watches every pod of this node
//! ([`crate::k8s::node_pods::NodePods`]); the daemon pods' map then takes its events from that
//! watch ([`DaemonPodSink`]), so the node holds one pod watch, not two.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use cleave_driver::sharing::mps::{PID_FILE, name_hash};
use cleave_driver::sharing::{
    DaemonHandle, DaemonLauncher, DaemonPod, DaemonSpec, ProcessLauncher, SHM_DIR, SharingFailure,
};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, EnvVar, HostPathVolumeSource, Pod, PodSpec,
    ResourceRequirements, SecurityContext, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use kube::runtime::{WatchStreamExt as _, watcher};
use tokio::runtime::Handle;

/// API calls of the pod launcher, in the plugin's namespace (a Role in the chart):
/// `(apiGroup, resource, verbs)`. `get` also reads the plugin's own pod for its owner.
/// Read by `hack/tests/test_deployments.py`, which checks the chart's Role against it.
#[allow(dead_code)]
pub(crate) const MPS_POD_RBAC_RULES: &[(&str, &str, &[&str])] =
    &[("", "pods", &["get", "list", "watch", "create", "delete"])];

/// `app.kubernetes.io/name` of every daemon pod.
pub(crate) const APP_NAME: &str = "cleave-mps";
/// Label naming the daemon a pod runs: the claim UID, or the shared daemon's key.
pub(crate) const CLAIM_LABEL: &str = "gpu.cleave.dev/claim-uid";
/// Label naming the node a daemon pod is bound to: the node name, or `sha256-<32 hex
/// digits>` of it when it does not fit a label value (63 bytes).
pub(crate) const NODE_LABEL: &str = "gpu.cleave.dev/node";
/// Annotation listing the devices a daemon pod serves (for people).
pub(crate) const DEVICES_ANNOTATION: &str = "gpu.cleave.dev/devices";
/// Name of the daemon's container.
pub(crate) const CONTAINER_NAME: &str = "mps-control-daemon";
/// Where the daemon's log directory is in its pod.
pub(crate) const POD_LOG_DIR: &str = "/var/log/nvidia-mps";
/// Where the driver root is in the daemon pod.
pub(crate) const POD_DRIVER_ROOT: &str = "/driver-root";
/// Scratch directory (an emptyDir) of the daemon pod; the library links go below it.
pub(crate) const POD_SCRATCH_DIR: &str = "/run/cleave-mps";
/// Volume name of the daemon's `/dev/shm`.
pub(crate) const SHM_VOLUME: &str = "shm";

/// Name of the daemon pod of the daemon `key` (claim UID or shared daemon key) on `node`:
/// `cleave-mps-<32 hex digits>` (43 bytes for any node name), unique per node and daemon.
pub(crate) fn pod_name(node: &str, key: &str) -> String {
    format!("cleave-mps-{}", name_hash(&[node, key]))
}

/// The name an earlier release gave the daemon pod of `key`, on every node alike.
fn legacy_pod_name(key: &str) -> String {
    format!("cleave-mps-{key}")
}

/// The value of [`NODE_LABEL`] for `node`: its name when it fits a label value, else a hash.
pub(crate) fn node_label_value(node: &str) -> String {
    if node.len() <= 63 {
        node.to_owned()
    } else {
        format!("sha256-{}", name_hash(&[node]))
    }
}

/// True when `pod` is bound to `node`.
fn on_node(pod: &Pod, node: &str) -> bool {
    pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
}

/// Host path of a pod's memory emptyDir volume `volume` under the kubelet root.
pub(crate) fn empty_dir_host_path(kubelet_root: &Path, pod_uid: &str, volume: &str) -> PathBuf {
    kubelet_root
        .join("pods")
        .join(pod_uid)
        .join("volumes/kubernetes.io~empty-dir")
        .join(volume)
}

/// What daemon pods look like and where they go.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PodLauncherConfig {
    /// Namespace of the daemon pods (the plugin's).
    pub namespace: String,
    /// This node.
    pub node_name: String,
    /// Image holding this binary.
    pub image: String,
    /// Its pull policy.
    pub image_pull_policy: String,
    /// Priority class, if any.
    pub priority_class: Option<String>,
    /// Service account, if not the default.
    pub service_account: Option<String>,
    /// Owner of every daemon pod.
    pub owner: OwnerReference,
    /// Pull secrets of the image (the plugin pod's own, so a private registry works).
    pub image_pull_secrets: Vec<String>,
    /// `nvidia-cuda-mps-control` for `mps-daemon` when given explicitly (a path in the
    /// image, or under `/driver-root`, where both the plugin and the daemon pod see the
    /// driver root); `None`: found under the driver root.
    pub control_bin: Option<PathBuf>,
    /// The plugin's state directory as this process sees it.
    pub state_dir: PathBuf,
    /// The same directory as the host sees it.
    pub host_state_dir: PathBuf,
    /// The driver root as the host sees it.
    pub host_driver_root: PathBuf,
    /// The kubelet's root directory on the host.
    pub kubelet_root: PathBuf,
    /// Entry point in the image: this binary and its `mps-daemon` subcommand.
    pub command: Vec<String>,
    /// Where claims' containers (and so the daemon) see the pipe directory.
    pub container_pipe_dir: String,
    /// Deadline of one API call.
    pub api_timeout: Duration,
    /// Pause between looks for the pid file of a daemon whose pod runs (a local file; the
    /// pod's state itself comes from the watch).
    pub poll: Duration,
}

impl PodLauncherConfig {
    /// The host path of a path under the state directory.
    fn host_path(&self, path: &Path) -> PathBuf {
        match path.strip_prefix(&self.state_dir) {
            Ok(rest) => self.host_state_dir.join(rest),
            Err(_) => path.to_owned(),
        }
    }
}

fn host_path_volume(name: &str, path: &Path, kind: &str) -> Volume {
    Volume {
        name: name.into(),
        host_path: Some(HostPathVolumeSource {
            path: path.display().to_string(),
            type_: Some(kind.into()),
        }),
        ..Default::default()
    }
}

fn empty_dir_volume(name: &str, medium: Option<&str>) -> Volume {
    Volume {
        name: name.into(),
        empty_dir: Some(EmptyDirVolumeSource {
            medium: medium.map(str::to_owned),
            size_limit: None,
        }),
        ..Default::default()
    }
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: read_only.then_some(true),
        ..Default::default()
    }
}

fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        value_from: None,
    }
}

/// The daemon pod of `spec`.
pub(crate) fn daemon_pod(config: &PodLauncherConfig, spec: &DaemonSpec) -> Pod {
    let labels = [
        ("app.kubernetes.io/name", APP_NAME),
        ("app.kubernetes.io/managed-by", "cleave-kubelet-plugin"),
        (CLAIM_LABEL, spec.claim_uid.as_str()),
        (NODE_LABEL, node_label_value(&config.node_name).as_str()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let container = Container {
        name: CONTAINER_NAME.into(),
        image: Some(config.image.clone()),
        image_pull_policy: Some(config.image_pull_policy.clone()),
        command: Some(config.command.clone()),
        args: Some(
            [
                format!("--driver-root={POD_DRIVER_ROOT}"),
                format!("--lib-dir={POD_SCRATCH_DIR}/lib"),
            ]
            .into_iter()
            .chain(
                config
                    .control_bin
                    .as_ref()
                    .map(|b| format!("--mps-control-bin={}", b.display())),
            )
            .chain(spec.multi_user.then(|| "--multi-user".to_owned()))
            .collect(),
        ),
        env: Some(vec![
            env("CUDA_VISIBLE_DEVICES", spec.visible_devices.join(",")),
            env("CUDA_MPS_PIPE_DIRECTORY", config.container_pipe_dir.clone()),
            env("CUDA_MPS_LOG_DIRECTORY", POD_LOG_DIR),
            env("CLEAVE_CLAIM_UID", spec.claim_uid.clone()),
        ]),
        // All GPUs' device nodes and the MIG capability nodes; CUDA_VISIBLE_DEVICES keeps
        // the daemon to the claim's devices.
        security_context: Some(SecurityContext {
            privileged: Some(true),
            ..Default::default()
        }),
        resources: Some(ResourceRequirements {
            requests: Some(
                [
                    ("cpu".to_owned(), Quantity("10m".into())),
                    ("memory".to_owned(), Quantity("32Mi".into())),
                ]
                .into(),
            ),
            ..Default::default()
        }),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        volume_mounts: Some(vec![
            mount("pipe", &config.container_pipe_dir, false),
            mount("log", POD_LOG_DIR, false),
            mount(SHM_VOLUME, SHM_DIR, false),
            mount("driver-root", POD_DRIVER_ROOT, true),
            mount("scratch", POD_SCRATCH_DIR, false),
        ]),
        ..Default::default()
    };
    Pod {
        metadata: ObjectMeta {
            name: Some(pod_name(&config.node_name, &spec.claim_uid)),
            namespace: Some(config.namespace.clone()),
            labels: Some(labels),
            annotations: Some(
                [(
                    DEVICES_ANNOTATION.to_owned(),
                    spec.visible_devices.join(","),
                )]
                .into(),
            ),
            owner_references: Some(vec![config.owner.clone()]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(config.node_name.clone()),
            // The host's PID namespace: an MPS server started in a PID namespace of its own
            // cannot find its own PID through /proc/self and fails to start (NVIDIA's DRA
            // driver had to add this, kubernetes-sigs/dra-driver-nvidia-gpu#115; the device
            // plugin and the GPU Operator did the same). `terminate_client` and `ps` also take
            // PIDs as the daemon sees them.
            host_pid: Some(true),
            restart_policy: Some("Never".into()),
            priority_class_name: config.priority_class.clone(),
            service_account_name: config.service_account.clone(),
            automount_service_account_token: Some(false),
            image_pull_secrets: (!config.image_pull_secrets.is_empty()).then(|| {
                config
                    .image_pull_secrets
                    .iter()
                    .map(|name| k8s_openapi::api::core::v1::LocalObjectReference {
                        name: name.clone(),
                    })
                    .collect()
            }),
            enable_service_links: Some(false),
            termination_grace_period_seconds: Some(30),
            // Wherever the plugin runs, its daemons must run too.
            tolerations: Some(vec![Toleration {
                operator: Some("Exists".into()),
                ..Default::default()
            }]),
            containers: vec![container],
            volumes: Some(vec![
                host_path_volume("pipe", &config.host_path(&spec.pipe_dir), "Directory"),
                host_path_volume("log", &config.host_path(&spec.log_dir), "Directory"),
                empty_dir_volume(SHM_VOLUME, Some("Memory")),
                host_path_volume("driver-root", &config.host_driver_root, "Directory"),
                empty_dir_volume("scratch", None),
            ]),
            ..Default::default()
        }),
        status: None,
    }
}

/// What a pod is doing, as far as the launcher cares.
#[derive(Debug, Clone, PartialEq, Eq)]
enum PodState {
    /// Created, not running yet (scheduling onto the node, pulling, starting).
    Pending(String),
    /// Its container runs.
    Running,
    /// It ended (the daemon exited or failed); the text says how.
    Ended(String),
    /// Being deleted.
    Deleting,
}

fn pod_state(pod: &Pod) -> PodState {
    if pod.metadata.deletion_timestamp.is_some() {
        return PodState::Deleting;
    }
    let status = pod.status.clone().unwrap_or_default();
    let container = status
        .container_statuses
        .as_ref()
        .and_then(|c| c.iter().find(|c| c.name == CONTAINER_NAME))
        .and_then(|c| c.state.clone());
    let detail = || {
        let mut parts = Vec::new();
        if let Some(state) = &container {
            if let Some(w) = &state.waiting {
                parts.extend(w.reason.clone());
                parts.extend(w.message.clone());
            }
            if let Some(t) = &state.terminated {
                parts.push(format!("exit code {}", t.exit_code));
                parts.extend(t.reason.clone());
                parts.extend(t.message.as_ref().map(|m| m.trim().replace('\n', " | ")));
            }
        }
        parts.extend(status.reason.clone());
        parts.extend(status.message.clone());
        parts.join(": ")
    };
    match status.phase.as_deref() {
        Some("Running") => PodState::Running,
        Some("Succeeded") => PodState::Ended(format!("succeeded {}", detail())),
        Some("Failed") => PodState::Ended(format!("failed {}", detail())),
        phase => PodState::Pending(format!("{} {}", phase.unwrap_or("no phase"), detail())),
    }
}

/// How many UIDs of deleted pods [`PodWatch`] remembers, so that a wait can tell a pod that
/// went from one the watch has not seen yet.
const GONE_KEPT: usize = 1024;

/// This node's daemon pods as the watch last saw them.
#[derive(Debug, Default)]
struct PodMap {
    /// By pod name.
    pods: BTreeMap<String, Pod>,
    /// UIDs of pods seen deleted, newest last.
    gone: VecDeque<String>,
    /// The watch's initial list has arrived.
    synced: bool,
}

impl PodMap {
    fn forget(&mut self, uid: Option<String>) {
        if let Some(uid) = uid {
            if self.gone.len() >= GONE_KEPT {
                self.gone.pop_front();
            }
            self.gone.push_back(uid);
        }
    }
}

/// This node's daemon pods (label `app.kubernetes.io/name=cleave-mps`, field `spec.nodeName`)
/// as a watch shows them, kept in a map that blocking callers read and wait on.
#[derive(Debug, Default)]
struct PodWatch {
    map: Mutex<PodMap>,
    changed: Condvar,
}

/// What a wait on [`PodWatch`] found about one pod.
#[derive(Debug)]
enum Seen {
    /// The watch has the pod with that UID.
    Pod(Box<Pod>),
    /// The pod with that UID was deleted, or another pod has its name now.
    Gone,
    /// Not seen yet (or the watch has not listed yet).
    Unknown,
}

impl PodWatch {
    fn lock(&self) -> MutexGuard<'_, PodMap> {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Applies one watch event and wakes every waiter.
    fn apply(&self, event: watcher::Event<Pod>, init: &mut Option<BTreeMap<String, Pod>>) {
        let name_of = |p: &Pod| p.metadata.name.clone().unwrap_or_default();
        let strip = |mut p: Pod| {
            p.metadata.managed_fields = None;
            p
        };
        let mut map = self.lock();
        match event {
            watcher::Event::Init => *init = Some(BTreeMap::new()),
            watcher::Event::InitApply(p) => {
                init.get_or_insert_with(BTreeMap::new)
                    .insert(name_of(&p), strip(p));
            }
            watcher::Event::InitDone => {
                let fresh = init.take().unwrap_or_default();
                let old = std::mem::replace(&mut map.pods, fresh);
                for (name, pod) in old {
                    if map.pods.get(&name).and_then(|p| p.metadata.uid.as_ref())
                        != pod.metadata.uid.as_ref()
                    {
                        map.forget(pod.metadata.uid);
                    }
                }
                map.synced = true;
            }
            watcher::Event::Apply(p) => {
                let name = name_of(&p);
                if let Some(old) = map.pods.get(&name)
                    && old.metadata.uid != p.metadata.uid
                {
                    let uid = old.metadata.uid.clone();
                    map.forget(uid);
                }
                map.pods.insert(name, strip(p));
            }
            watcher::Event::Delete(p) => {
                let name = name_of(&p);
                if map.pods.get(&name).map(|o| &o.metadata.uid) == Some(&p.metadata.uid) {
                    map.pods.remove(&name);
                }
                map.forget(p.metadata.uid);
            }
        }
        drop(map);
        self.changed.notify_all();
    }

    /// The pod `name` with `uid` as the map has it.
    fn seen(map: &PodMap, name: &str, uid: &str) -> Seen {
        match map.pods.get(name) {
            Some(p) if p.metadata.uid.as_deref() == Some(uid) => Seen::Pod(Box::new(p.clone())),
            _ if map.gone.iter().any(|g| g == uid) => Seen::Gone,
            Some(_) if map.synced => Seen::Gone,
            _ => Seen::Unknown,
        }
    }

    /// Waits until `done` says yes on the map, at most until `deadline` (waking at least
    /// every `tick`, for conditions outside the map): what `done` gave, `None` at the deadline.
    fn wait_until<T>(
        &self,
        deadline: Instant,
        tick: Duration,
        mut done: impl FnMut(&PodMap) -> Option<T>,
    ) -> Option<T> {
        let mut map = self.lock();
        loop {
            if let Some(t) = done(&map) {
                return Some(t);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            map = self
                .changed
                .wait_timeout(map, left.min(tick))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// The map once the initial list arrived; `None` when it did not within `timeout`.
    fn synced(&self, timeout: Duration) -> Option<MutexGuard<'_, PodMap>> {
        let deadline = Instant::now() + timeout;
        let mut map = self.lock();
        while !map.synced {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            map = self
                .changed
                .wait_timeout(map, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        Some(map)
    }

    /// Runs the watch until aborted: kube's watcher lists, watches, resumes and relists
    /// with backoff on errors; each event updates the map.
    async fn run(self: Arc<Self>, pods: Api<Pod>, node: String) {
        let config = watcher::Config::default()
            .labels(&format!("app.kubernetes.io/name={APP_NAME}"))
            .fields(&format!("spec.nodeName={node}"))
            .timeout(cleave_controller::publisher::watch_timeout_secs(&node));
        let mut events = watcher(pods, config).default_backoff().boxed();
        let mut init = None;
        while let Some(event) = events.next().await {
            match event {
                Ok(event) => self.apply(event, &mut init),
                Err(e) => tracing::warn!(error = %e, "watching MPS daemon pods"),
            }
        }
    }
}

/// The daemon pods' share of the node pod watch: it passes on the events of pods in the
/// release namespace labelled `app.kubernetes.io/name=cleave-mps`, what the launcher's own
/// watch would select.
struct DaemonPodSink {
    watch: Arc<PodWatch>,
    namespace: String,
    /// The initial list being received.
    init: Mutex<Option<BTreeMap<String, Pod>>>,
}

impl DaemonPodSink {
    fn selects(&self, pod: &Pod) -> bool {
        pod.metadata.namespace.as_deref() == Some(self.namespace.as_str())
            && pod
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("app.kubernetes.io/name"))
                .is_some_and(|v| v == APP_NAME)
    }
}

impl crate::k8s::node_pods::PodEventSink for DaemonPodSink {
    fn event(&self, event: &watcher::Event<Pod>) {
        if let watcher::Event::InitApply(p) | watcher::Event::Apply(p) | watcher::Event::Delete(p) =
            event
            && !self.selects(p)
        {
            return;
        }
        let mut init = self
            .init
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.watch.apply(event.clone(), &mut init);
    }
}

/// Where the daemon pods' map gets its events.
enum WatchSource {
    /// A watch of the launcher's own (namespace, label and node), started on first use.
    Own(OnceLock<tokio::task::AbortHandle>),
    /// The node pod watch of usage sampling, which feeds the map through a [`DaemonPodSink`].
    Node(Arc<crate::k8s::node_pods::NodePods>),
}

/// Runs each claim's MPS control daemon in a pod of its own (see the module docs). The
/// [`DaemonLauncher`] calls block on `runtime`, so they must come from a blocking thread
/// (the driver runs them under the node lock in `spawn_blocking`).
pub(crate) struct PodLauncher {
    config: PodLauncherConfig,
    pods: Api<Pod>,
    runtime: Handle,
    control: ProcessLauncher,
    /// This node's daemon pods, from one watch.
    watch: Arc<PodWatch>,
    /// The watch that feeds it.
    source: WatchSource,
}

impl Drop for PodLauncher {
    fn drop(&mut self) {
        if let WatchSource::Own(task) = &self.source
            && let Some(task) = task.get()
        {
            task.abort();
        }
    }
}

impl std::fmt::Debug for PodLauncher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodLauncher")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl PodLauncher {
    /// A launcher creating pods through `client`; `control` runs the control tool here to
    /// talk to the daemons over their pipe directories. With `node_pods` (the node pod watch
    /// of usage sampling) the daemon pods are learned from that watch instead of one of
    /// their own.
    pub(crate) fn new(
        config: PodLauncherConfig,
        client: kube::Client,
        runtime: Handle,
        control: ProcessLauncher,
        node_pods: Option<Arc<crate::k8s::node_pods::NodePods>>,
    ) -> Self {
        let watch = Arc::<PodWatch>::default();
        let source = match node_pods {
            Some(node_pods) => {
                node_pods.add_sink(Arc::new(DaemonPodSink {
                    watch: Arc::clone(&watch),
                    namespace: config.namespace.clone(),
                    init: Mutex::new(None),
                }));
                WatchSource::Node(node_pods)
            }
            None => WatchSource::Own(OnceLock::new()),
        };
        Self {
            pods: Api::namespaced(client, &config.namespace),
            config,
            runtime,
            control,
            watch,
            source,
        }
    }

    /// The map of this node's daemon pods, its watch started on first use.
    fn watch(&self) -> &PodWatch {
        match &self.source {
            WatchSource::Own(task) => {
                task.get_or_init(|| {
                    let task = self.runtime.spawn(
                        Arc::clone(&self.watch)
                            .run(self.pods.clone(), self.config.node_name.clone()),
                    );
                    task.abort_handle()
                });
            }
            WatchSource::Node(node_pods) => node_pods.start(),
        }
        &self.watch
    }

    /// The map once the watch listed, waiting at most one API call's deadline for it.
    fn synced_map(&self) -> Result<MutexGuard<'_, PodMap>, String> {
        self.watch().synced(self.config.api_timeout).ok_or_else(|| {
            format!(
                "no list of MPS daemon pods from the API server within {:?}",
                self.config.api_timeout
            )
        })
    }

    fn block_on<F: std::future::Future>(&self, fut: F) -> Result<F::Output, String> {
        let timeout = self.config.api_timeout;
        self.runtime
            .block_on(async { tokio::time::timeout(timeout, fut).await })
            .map_err(|_| format!("no answer from the API server within {timeout:?}"))
    }

    /// The pod now; `Ok(None)` when there is none.
    fn get(&self, name: &str) -> Result<Option<Pod>, String> {
        self.block_on(self.pods.get_opt(name))?
            .map_err(|e| format!("reading pod {}/{name}: {e}", self.config.namespace))
    }

    fn delete(&self, name: &str, uid: &str, grace: Option<u32>) -> Result<(), String> {
        let params = DeleteParams {
            grace_period_seconds: grace,
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: None,
            }),
            ..Default::default()
        };
        match self.block_on(self.pods.delete(name, &params))? {
            Ok(_) => Ok(()),
            // Gone already, or replaced by another pod of that name (not ours to delete).
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
            Err(e) => Err(format!(
                "deleting pod {}/{name}: {e}",
                self.config.namespace
            )),
        }
    }

    /// Waits until the watch shows the pod `name` with `uid` gone; false when `timeout`
    /// passed first.
    fn wait_gone(&self, name: &str, uid: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        self.watch()
            .wait_until(deadline, timeout, |map| {
                (map.synced && !matches!(PodWatch::seen(map, name, uid), Seen::Pod(_)))
                    .then_some(())
            })
            .is_some()
    }

    fn handle(&self, pod: &Pod) -> Option<DaemonHandle> {
        let uid = pod.metadata.uid.clone()?;
        Some(DaemonHandle {
            pid: 0,
            start_time: 0,
            boot_id: String::new(),
            shm_host_dir: Some(empty_dir_host_path(
                &self.config.kubelet_root,
                &uid,
                SHM_VOLUME,
            )),
            pod: Some(DaemonPod {
                namespace: self.config.namespace.clone(),
                name: pod.metadata.name.clone().unwrap_or_default(),
                uid,
            }),
        })
    }

    fn start_failure(&self, spec: &DaemonSpec, message: String) -> SharingFailure {
        SharingFailure::DaemonStart {
            claim: spec.claim_uid.clone(),
            tool: PathBuf::from(format!(
                "in pod {}/{}",
                self.config.namespace,
                pod_name(&self.config.node_name, &spec.claim_uid)
            )),
            message,
        }
    }

    /// Creates the pod of `spec`, taking over one of the same daemon on this node that still
    /// runs and replacing one that ended; a pod of that name on another node is left alone.
    fn create(&self, spec: &DaemonSpec, deadline: Instant) -> Result<Pod, String> {
        let name = pod_name(&self.config.node_name, &spec.claim_uid);
        let pod = daemon_pod(&self.config, spec);
        loop {
            if Instant::now() >= deadline {
                return Err(format!("pod {name} could not be created in time"));
            }
            // A pid file left by an earlier daemon must not be taken for the new one's (a
            // pod that is taken over below keeps its daemon's).
            let _ = std::fs::remove_file(spec.pipe_dir.join(PID_FILE));
            match self.block_on(self.pods.create(&PostParams::default(), &pod))? {
                Ok(created) => {
                    tracing::info!(pod = %name, claim = %spec.claim_uid, "created MPS daemon pod");
                    return Ok(created);
                }
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => {
                    return Err(format!(
                        "creating pod {}/{name}: {e}",
                        self.config.namespace
                    ));
                }
            }
            // Read once: a pod of another node with this name is not in the watch.
            let Some(existing) = self.get(&name)? else {
                continue;
            };
            let uid = existing.metadata.uid.clone().unwrap_or_default();
            if !on_node(&existing, &self.config.node_name) {
                return Err(format!(
                    "pod {}/{name} exists and is bound to another node ({}); it is not this node's to take over or delete",
                    self.config.namespace,
                    existing
                        .spec
                        .as_ref()
                        .and_then(|s| s.node_name.as_deref())
                        .unwrap_or("none")
                ));
            }
            let same_claim = existing
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(CLAIM_LABEL))
                == Some(&spec.claim_uid);
            let state = pod_state(&existing);
            if same_claim && matches!(state, PodState::Pending(_) | PodState::Running) {
                tracing::info!(pod = %name, "taking over the existing MPS daemon pod");
                return Ok(existing);
            }
            tracing::info!(pod = %name, state = ?state, "replacing a leftover MPS daemon pod");
            self.delete(&name, &uid, Some(0))?;
            let left = deadline.saturating_duration_since(Instant::now());
            if !self.wait_gone(&name, &uid, left) {
                return Err(format!("leftover pod {name} did not go away"));
            }
        }
    }
}

impl DaemonLauncher for PodLauncher {
    fn start(&self, spec: &DaemonSpec, timeout: Duration) -> Result<DaemonHandle, SharingFailure> {
        let deadline = Instant::now() + timeout;
        let name = pod_name(&self.config.node_name, &spec.claim_uid);
        let pod = self
            .create(spec, deadline)
            .map_err(|m| self.start_failure(spec, m))?;
        let handle = self
            .handle(&pod)
            .ok_or_else(|| self.start_failure(spec, "the created pod has no UID".into()))?;
        let uid = handle
            .pod
            .as_ref()
            .map(|p| p.uid.clone())
            .unwrap_or_default();
        // Up when the pod runs and the daemon wrote its pid file into the shared pipe
        // directory; the driver then waits until it answers. The pod's state comes from the
        // watch; the pid file is looked at every `poll` once the pod runs.
        let mut last = String::from("not seen by the watch yet");
        let pid_file = spec.pipe_dir.join(PID_FILE);
        let outcome = self
            .watch()
            .wait_until(deadline, self.config.poll, |map| {
                match PodWatch::seen(map, &name, &uid) {
                    Seen::Pod(p) => match pod_state(&p) {
                        PodState::Running if pid_file.exists() => Some(Ok(())),
                        PodState::Running => {
                            last = "running, no pid file yet".into();
                            None
                        }
                        PodState::Pending(s) => {
                            last = s;
                            None
                        }
                        PodState::Ended(s) => Some(Err(format!("the pod {s}"))),
                        PodState::Deleting => Some(Err("the pod is being deleted".into())),
                    },
                    Seen::Gone => Some(Err("the pod was deleted".into())),
                    Seen::Unknown => None,
                }
            })
            .unwrap_or_else(|| Err(format!("not running within {timeout:?}: {}", last.trim())));
        match outcome {
            Ok(()) => Ok(handle),
            Err(message) => {
                // Nothing left behind: the pod goes with the failure.
                if let Err(e) = self.delete(&name, &uid, Some(0)) {
                    tracing::warn!(pod = %name, error = %e, "removing a failed MPS daemon pod");
                }
                Err(self.start_failure(spec, message))
            }
        }
    }

    fn control(
        &self,
        spec: &DaemonSpec,
        input: &str,
        timeout: Duration,
    ) -> Result<String, SharingFailure> {
        self.control.control(spec, input, timeout)
    }

    fn find(&self, spec: &DaemonSpec) -> Option<DaemonHandle> {
        // This release's name, then the name an earlier one gave the pod
        // (`cleave-mps-<key>`), in case it started one and crashed before recording it.
        let names = [
            pod_name(&self.config.node_name, &spec.claim_uid),
            legacy_pod_name(&spec.claim_uid),
        ];
        let map = match self.synced_map() {
            Ok(map) => map,
            Err(e) => {
                tracing::warn!(claim = %spec.claim_uid, error = %e, "looking for an MPS daemon pod");
                return None;
            }
        };
        names.iter().find_map(|name| {
            let pod = map.pods.get(name)?;
            (on_node(pod, &self.config.node_name)
                && pod
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(CLAIM_LABEL))
                    == Some(&spec.claim_uid))
            .then(|| self.handle(pod))
            .flatten()
        })
    }

    fn is_running(&self, handle: &DaemonHandle) -> bool {
        let Some(p) = &handle.pod else { return false };
        match self.synced_map() {
            Ok(map) => match PodWatch::seen(&map, &p.name, &p.uid) {
                Seen::Pod(pod) => {
                    matches!(pod_state(&pod), PodState::Pending(_) | PodState::Running)
                }
                Seen::Gone | Seen::Unknown => false,
            },
            Err(e) => {
                // Unknown is not gone: taking a running daemon for dead would restart it
                // under its clients. Whether it answers decides.
                tracing::warn!(pod = %p.name, error = %e, "cannot tell whether an MPS daemon pod runs");
                true
            }
        }
    }

    fn kill(&self, handle: &DaemonHandle, grace: Duration) -> Result<(), SharingFailure> {
        let Some(p) = &handle.pod else { return Ok(()) };
        let fail = |message: String| SharingFailure::DaemonStop {
            daemon: handle.describe(),
            message,
        };
        let secs = u32::try_from(grace.as_secs()).unwrap_or(u32::MAX);
        self.delete(&p.name, &p.uid, Some(secs)).map_err(fail)?;
        if self.wait_gone(&p.name, &p.uid, grace + Duration::from_secs(10)) {
            Ok(())
        } else {
            Err(fail(format!(
                "pod {}/{} still exists after deletion",
                p.namespace, p.name
            )))
        }
    }

    fn cleanup(&self, _spec: &DaemonSpec, handle: &DaemonHandle) -> Result<(), SharingFailure> {
        let Some(p) = &handle.pod else { return Ok(()) };
        self.delete(&p.name, &p.uid, None)
            .map_err(|message| SharingFailure::DaemonStop {
                daemon: handle.describe(),
                message,
            })?;
        if !self.wait_gone(&p.name, &p.uid, Duration::from_secs(10)) {
            tracing::warn!(pod = %p.name, "MPS daemon pod deleted but still listed; the kubelet finishes it");
        }
        Ok(())
    }

    fn sweep(&self, keep: &BTreeSet<String>) -> Vec<String> {
        // The watch's list: no LIST of its own.
        let pods: Vec<Pod> = match self.synced_map() {
            Ok(map) => map.pods.values().cloned().collect(),
            Err(e) => {
                tracing::warn!(error = %e, "listing MPS daemon pods");
                return Vec::new();
            }
        };
        let mut stopped = Vec::new();
        // The field selector already asks for this node's pods; checked again, since a pod
        // of another node must never be deleted here whatever its labels say.
        for pod in pods
            .into_iter()
            .filter(|p| on_node(p, &self.config.node_name))
        {
            let Some(claim) = pod
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(CLAIM_LABEL))
                .cloned()
            else {
                continue;
            };
            if keep.contains(&claim) {
                continue;
            }
            let name = pod.metadata.name.clone().unwrap_or_default();
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            tracing::info!(pod = %name, claim = %claim, "deleting the MPS daemon pod of a claim that is gone");
            match self.delete(&name, &uid, None) {
                Ok(()) => stopped.push(claim),
                Err(e) => {
                    tracing::warn!(pod = %name, error = %e, "deleting an orphaned MPS daemon pod")
                }
            }
        }
        stopped
    }
}

/// Who owns the daemon pods and which pull secrets they use, from the plugin's own pod.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct DaemonPodParent {
    /// The controller of the plugin's pod (its DaemonSet), else the Node.
    pub owner: OwnerReference,
    /// The plugin pod's image pull secrets.
    pub image_pull_secrets: Vec<String>,
}

/// Finds the owner of the daemon pods: the controller of the plugin's own pod (its
/// DaemonSet) when `pod_name` is given and has one, else the Node (its UID from `node_uid`,
/// the Node as read at start, or else one GET); and the plugin pod's image pull secrets.
pub(crate) async fn resolve_parent(
    client: &kube::Client,
    namespace: &str,
    pod_name: Option<&str>,
    node_name: &str,
    node_uid: Option<String>,
) -> anyhow::Result<DaemonPodParent> {
    let mut image_pull_secrets = Vec::new();
    let me = match pod_name {
        Some(name) => {
            let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
            match pods.get(name).await {
                Ok(me) => Some((name, me)),
                Err(e) => {
                    // Not fatal: whole-GPU and MIG claims do not need it, and MPS claims
                    // then get Node-owned daemon pods (or a clear error if pods are not
                    // allowed at all).
                    tracing::warn!(pod = %format!("{namespace}/{name}"), error = %e, "cannot read this plugin's pod; the Node owns MPS daemon pods");
                    None
                }
            }
        }
        None => None,
    };
    if let Some((name, me)) = me {
        image_pull_secrets = me
            .spec
            .as_ref()
            .and_then(|s| s.image_pull_secrets.clone())
            .unwrap_or_default()
            .into_iter()
            .map(|r| r.name)
            .filter(|n| !n.is_empty())
            .collect();
        if let Some(owner) = me
            .metadata
            .owner_references
            .unwrap_or_default()
            .into_iter()
            .find(|o| o.controller == Some(true))
        {
            // Not `controller`: the DaemonSet controller would take the pod for one of its
            // own and, since it does not match its selector, release it.
            return Ok(DaemonPodParent {
                owner: OwnerReference {
                    controller: None,
                    block_owner_deletion: None,
                    ..owner
                },
                image_pull_secrets,
            });
        }
        tracing::warn!(
            pod = name,
            "this plugin's pod has no controller; the Node owns MPS daemon pods"
        );
    }
    let uid = match node_uid {
        Some(uid) => uid,
        None => {
            let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
            let node = nodes
                .get(node_name)
                .await
                .with_context(|| format!("reading node {node_name}"))?;
            node.metadata.uid.unwrap_or_default()
        }
    };
    Ok(DaemonPodParent {
        owner: OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: node_name.to_owned(),
            uid,
            controller: None,
            block_owner_deletion: None,
        },
        image_pull_secrets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> PodLauncherConfig {
        PodLauncherConfig {
            namespace: "cleave-system".into(),
            node_name: "node-a".into(),
            image: "cleave:dev".into(),
            image_pull_policy: "IfNotPresent".into(),
            priority_class: Some("system-node-critical".into()),
            service_account: None,
            owner: OwnerReference {
                api_version: "apps/v1".into(),
                kind: "DaemonSet".into(),
                name: "cleave".into(),
                uid: "ds-uid".into(),
                ..Default::default()
            },
            image_pull_secrets: vec!["regcred".into()],
            control_bin: Some("/driver-root/opt/bin/nvidia-cuda-mps-control".into()),
            state_dir: "/plugin/state".into(),
            host_state_dir: "/var/lib/kubelet/plugins/gpu.cleave.dev".into(),
            host_driver_root: "/run/nvidia/driver".into(),
            kubelet_root: "/var/lib/kubelet".into(),
            command: vec!["/usr/bin/cleave-kubelet-plugin".into(), "mps-daemon".into()],
            container_pipe_dir: cleave_driver::sharing::mps::DEFAULT_CONTAINER_PIPE_DIR.into(),
            api_timeout: Duration::from_secs(5),
            poll: Duration::from_millis(10),
        }
    }

    fn spec() -> DaemonSpec {
        DaemonSpec {
            claim_uid: "0b7c1f4e-1111-2222-3333-444455556666".into(),
            pipe_dir: "/plugin/state/mps/0b7c1f4e-1111-2222-3333-444455556666/pipe".into(),
            log_dir: "/plugin/state/mps/0b7c1f4e-1111-2222-3333-444455556666/log".into(),
            visible_devices: vec!["GPU-a".into(), "MIG-b".into()],
            multi_user: false,
        }
    }

    #[test]
    fn daemon_pod_is_bound_owned_and_mounts_the_claims_directories() {
        let pod = daemon_pod(&config(), &spec());
        let v = serde_json::to_value(&pod).unwrap();
        assert_eq!(
            v["metadata"]["name"],
            pod_name("node-a", "0b7c1f4e-1111-2222-3333-444455556666")
        );
        assert_eq!(v["metadata"]["namespace"], "cleave-system");
        assert_eq!(
            v["metadata"]["labels"][CLAIM_LABEL],
            "0b7c1f4e-1111-2222-3333-444455556666"
        );
        assert_eq!(v["metadata"]["labels"][NODE_LABEL], "node-a");
        assert_eq!(v["metadata"]["ownerReferences"][0]["kind"], "DaemonSet");
        assert_eq!(v["spec"]["nodeName"], "node-a");
        assert_eq!(v["spec"]["restartPolicy"], "Never");
        assert_eq!(v["spec"]["priorityClassName"], "system-node-critical");
        assert_eq!(v["spec"]["automountServiceAccountToken"], false);
        assert_eq!(
            v["spec"]["hostPID"], true,
            "MPS servers need the host PID namespace"
        );
        let c = &v["spec"]["containers"][0];
        assert_eq!(c["image"], "cleave:dev");
        assert_eq!(c["command"][1], "mps-daemon");
        assert_eq!(
            c["args"][2],
            "--mps-control-bin=/driver-root/opt/bin/nvidia-cuda-mps-control"
        );
        assert_eq!(c["args"].as_array().unwrap().len(), 3, "no --multi-user");
        let mut multi = spec();
        multi.multi_user = true;
        let m = serde_json::to_value(daemon_pod(&config(), &multi)).unwrap();
        assert_eq!(m["spec"]["containers"][0]["args"][3], "--multi-user");
        assert_eq!(v["spec"]["imagePullSecrets"][0]["name"], "regcred");
        assert_eq!(v["spec"]["tolerations"][0]["operator"], "Exists");
        assert_eq!(c["securityContext"]["privileged"], true);
        let envs: Vec<(String, String)> = pod.spec.as_ref().unwrap().containers[0]
            .env
            .clone()
            .unwrap()
            .into_iter()
            .map(|e| (e.name, e.value.unwrap()))
            .collect();
        assert!(envs.contains(&("CUDA_VISIBLE_DEVICES".into(), "GPU-a,MIG-b".into())));
        assert!(envs.contains(&("CUDA_MPS_PIPE_DIRECTORY".into(), "/tmp/nvidia-mps".into())));
        // Host paths: the state dir as the host sees it, and the host driver root.
        let vols = pod.spec.unwrap().volumes.unwrap();
        let host = |name: &str| {
            vols.iter()
                .find(|v| v.name == name)
                .and_then(|v| v.host_path.clone())
                .map(|h| h.path)
        };
        assert_eq!(
            host("pipe").as_deref(),
            Some(
                "/var/lib/kubelet/plugins/gpu.cleave.dev/mps/0b7c1f4e-1111-2222-3333-444455556666/pipe"
            )
        );
        assert_eq!(host("driver-root").as_deref(), Some("/run/nvidia/driver"));
        let shm = vols.iter().find(|v| v.name == SHM_VOLUME).unwrap();
        assert_eq!(
            shm.empty_dir.as_ref().unwrap().medium.as_deref(),
            Some("Memory")
        );
    }

    /// A node name of 253 bytes, the most a DNS subdomain may have.
    fn longest_node() -> String {
        let label = |c: &str, n| c.repeat(n);
        format!(
            "{}.{}.{}.{}",
            label("a", 63),
            label("b", 63),
            label("c", 63),
            label("d", 61)
        )
    }

    #[test]
    fn pod_names_and_labels_are_unique_per_node_and_daemon_and_fit() {
        let long = longest_node();
        assert_eq!(long.len(), 253);
        let key = "shared-gpu-0-0123456789";
        let names = [
            pod_name("node-a", key),
            pod_name("node-b", key),
            pod_name(&long, key),
            pod_name("node-a", "shared-gpu-1-0123456789"),
        ];
        for (i, n) in names.iter().enumerate() {
            assert!(n.len() <= 63 && n.starts_with("cleave-mps-"), "{n}");
            assert!(names[..i].iter().all(|m| m != n), "{names:?}");
        }
        assert_eq!(node_label_value("node-a"), "node-a");
        let label = node_label_value(&long);
        assert!(label.len() <= 63 && label.starts_with("sha256-"), "{label}");
        assert_ne!(label, node_label_value(&format!("{}x", &long[..252])));
    }

    /// Two nodes' launchers over one API server create daemons for the same key without
    /// touching each other's pods; a pod of another node that carries this node's name and
    /// labels is never taken over, found, swept or deleted.
    #[test]
    fn launchers_of_two_nodes_never_touch_each_others_pods() {
        crate::install_crypto_provider();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let standin = rt
            .block_on(cleave_apiserver_standin::StandIn::start(Default::default()))
            .unwrap();
        let client = standin.client();
        let tmp = tempfile::tempdir().unwrap();
        let launcher = |node: &str| {
            let mut c = config();
            c.node_name = node.to_owned();
            PodLauncher::new(
                c,
                client.clone(),
                rt.handle().clone(),
                ProcessLauncher::new(tmp.path().join("none"), Vec::new(), tmp.path().join("b")),
                None,
            )
        };
        let long = longest_node();
        let (a, b) = (launcher("node-a"), launcher(&long));
        let spec_of = |key: &str| DaemonSpec {
            claim_uid: key.to_owned(),
            pipe_dir: tmp.path().join(key),
            log_dir: tmp.path().join("log"),
            visible_devices: vec!["GPU-a".into()],
            multi_user: true,
        };
        let spec = spec_of("shared-gpu-0-0123456789");
        let deadline = || Instant::now() + Duration::from_secs(10);
        let pa = a.create(&spec, deadline()).unwrap();
        let pb = b.create(&spec, deadline()).unwrap();
        assert_ne!(pa.metadata.name, pb.metadata.name);
        assert_eq!(
            pa.spec.as_ref().unwrap().node_name.as_deref(),
            Some("node-a")
        );
        assert_eq!(
            pb.spec.as_ref().unwrap().node_name.as_deref(),
            Some(long.as_str())
        );
        let label = |p: &Pod, k: &str| p.metadata.labels.as_ref().unwrap()[k].clone();
        assert_eq!(label(&pb, NODE_LABEL), node_label_value(&long));
        let uid = |p: &Pod| p.metadata.uid.clone().unwrap();
        let found = |l: &PodLauncher, s: &DaemonSpec| l.find(s).and_then(|h| h.pod).map(|p| p.uid);
        // `create` returns before the watch saw the pod (`start` waits for it).
        let seen = |l: &PodLauncher, name: &str| {
            l.watch()
                .wait_until(deadline(), Duration::from_secs(1), |m| {
                    m.pods.contains_key(name).then_some(())
                })
                .unwrap()
        };
        seen(&a, pa.metadata.name.as_deref().unwrap());
        seen(&b, pb.metadata.name.as_deref().unwrap());
        assert_eq!(found(&a, &spec), Some(uid(&pa)));
        assert_eq!(found(&b, &spec), Some(uid(&pb)));
        // Creating again takes over the node's own pod.
        assert_eq!(uid(&a.create(&spec, deadline()).unwrap()), uid(&pa));

        // A pod of node-b with the name and labels node-a's daemon would have.
        let other = spec_of("uid-other");
        let mut foreign = daemon_pod(&a.config, &other);
        foreign.spec.as_mut().unwrap().node_name = Some("node-b".into());
        standin.put(&foreign).unwrap();
        let name = pod_name("node-a", "uid-other");
        let err = a.create(&other, deadline()).unwrap_err();
        assert!(err.contains("another node"), "{err}");
        assert_eq!(found(&a, &other), None);

        // A pod an earlier release named `cleave-mps-<key>` on node-a is found by node-a
        // only.
        let old = spec_of("uid-old");
        let mut legacy = daemon_pod(&a.config, &old);
        legacy.metadata.name = Some(legacy_pod_name("uid-old"));
        let legacy = standin.put(&legacy).unwrap();
        seen(&a, &legacy_pod_name("uid-old"));
        assert_eq!(
            found(&a, &old).as_deref(),
            legacy["metadata"]["uid"].as_str()
        );
        assert_eq!(found(&b, &old), None);

        // Sweeping node-a deletes its own pods only.
        let swept: BTreeSet<String> = a.sweep(&BTreeSet::new()).into_iter().collect();
        assert_eq!(
            swept,
            BTreeSet::from([spec.claim_uid.clone(), "uid-old".to_owned()])
        );
        let exists = |n: &Option<String>| {
            standin
                .get("pods", "cleave-system", n.as_deref().unwrap())
                .is_some()
        };
        assert!(!exists(&pa.metadata.name));
        assert!(exists(&pb.metadata.name), "node-b's pod was deleted");
        assert!(exists(&Some(name)), "a foreign pod was deleted");
        drop((a, b));
        rt.shutdown_background();
    }

    #[test]
    fn shm_path_is_the_kubelets_empty_dir() {
        assert_eq!(
            empty_dir_host_path(Path::new("/var/lib/kubelet"), "u-1", "shm"),
            Path::new("/var/lib/kubelet/pods/u-1/volumes/kubernetes.io~empty-dir/shm")
        );
    }

    fn pod_with(phase: &str, deleting: bool) -> Pod {
        let mut pod = daemon_pod(&config(), &spec());
        pod.status = Some(k8s_openapi::api::core::v1::PodStatus {
            phase: Some(phase.into()),
            container_statuses: Some(vec![k8s_openapi::api::core::v1::ContainerStatus {
                name: CONTAINER_NAME.into(),
                state: Some(k8s_openapi::api::core::v1::ContainerState {
                    waiting: Some(k8s_openapi::api::core::v1::ContainerStateWaiting {
                        reason: Some("ImagePullBackOff".into()),
                        message: Some("pull access denied".into()),
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }]),
            ..Default::default()
        });
        if deleting {
            pod.metadata.deletion_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                ));
        }
        pod
    }

    /// The node pod watch's events reach the daemon map only for daemon pods of the release
    /// namespace: a tenant's pod, or a pod with the daemon label in another namespace, never.
    #[test]
    fn the_daemon_share_of_the_node_pod_watch_is_the_release_namespaces_daemon_pods() {
        use crate::k8s::node_pods::PodEventSink as _;
        let watch = Arc::new(PodWatch::default());
        let sink = DaemonPodSink {
            watch: Arc::clone(&watch),
            namespace: config().namespace,
            init: Mutex::new(None),
        };
        let with_uid = |mut p: Pod, name: &str, uid: &str| {
            p.metadata.name = Some(name.into());
            p.metadata.uid = Some(uid.into());
            p
        };
        let daemon = with_uid(pod_with("Running", false), "cleave-mps-a", "u1");
        let mut tenant = with_uid(pod_with("Running", false), "model", "u2");
        tenant.metadata.namespace = Some("team-a".into());
        tenant.metadata.labels = Some(BTreeMap::from([("app".into(), "model".into())]));
        let mut imposter = with_uid(pod_with("Running", false), "cleave-mps-b", "u3");
        imposter.metadata.namespace = Some("team-a".into());
        let mut unlabelled = with_uid(pod_with("Running", false), "other", "u4");
        unlabelled.metadata.labels = None;

        sink.event(&watcher::Event::Init);
        for p in [&daemon, &tenant, &imposter, &unlabelled] {
            sink.event(&watcher::Event::InitApply(p.clone()));
        }
        assert!(!watch.lock().synced);
        sink.event(&watcher::Event::InitDone);
        let names = |w: &PodWatch| w.lock().pods.keys().cloned().collect::<Vec<_>>();
        assert!(watch.lock().synced);
        assert_eq!(names(&watch), ["cleave-mps-a"]);

        sink.event(&watcher::Event::Apply(tenant.clone()));
        sink.event(&watcher::Event::Delete(imposter));
        assert_eq!(names(&watch), ["cleave-mps-a"]);
        assert!(watch.lock().gone.is_empty());

        sink.event(&watcher::Event::Delete(daemon));
        assert!(names(&watch).is_empty());
        assert!(matches!(
            PodWatch::seen(&watch.lock(), "cleave-mps-a", "u1"),
            Seen::Gone
        ));
    }

    #[test]
    fn pod_state_names_why_a_pod_is_not_running() {
        match pod_state(&pod_with("Pending", false)) {
            PodState::Pending(s) => {
                assert!(s.contains("ImagePullBackOff: pull access denied"), "{s}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(pod_state(&pod_with("Running", false)), PodState::Running);
        assert!(matches!(
            pod_state(&pod_with("Failed", false)),
            PodState::Ended(_)
        ));
        assert_eq!(pod_state(&pod_with("Running", true)), PodState::Deleting);
    }
}
