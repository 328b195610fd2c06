//! Many simulated nodes against one API server stand-in, for counting what each node costs
//! the control plane: each node is a real plugin process (the binary under test, or another
//! build's) with a directory of its own (sockets, CDI root, checkpoint, driver root, mock
//! NVML state), its Node object, and a plugin Pod in the release namespace as its DaemonSet
//! would have. Shared by `tests/control_plane.rs` and `benches/control_plane.rs`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    dead_code,
    unreachable_pub
)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cleave_apiserver_standin::{RequestRecord, StandIn, StandInOptions, fixtures};
use cleave_kubelet_plugin::proto::dra::v1;
use tonic::transport::Channel;

/// The release namespace: the plugin pods and the MPS daemon pods live here.
pub const NAMESPACE: &str = "cleave-system";
/// Bound of every wait.
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// A node's name: fixed width, so no node's name is a substring of another's.
pub fn node_name(i: usize) -> String {
    format!("cost-node-{i:04}")
}

/// What a node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Whole GPUs (8 mock H100s, MIG off).
    Whole,
    /// MIG-enabled GPUs with on-demand MIG (`--dynamic-mig`).
    Mig,
}

/// The stand-in and the nodes.
pub struct World {
    pub standin: StandIn,
    pub bin: PathBuf,
    pub dir: tempfile::TempDir,
    pub nodes: Vec<Node>,
    /// Watches end after their `timeoutSeconds` divided by this.
    pub time_scale: u32,
    /// Whether a start also waits for the daemon pod watch (the pod launcher of this
    /// build; an older build has none).
    pub pod_watch: bool,
}

/// One simulated node: its plugin process and directories.
pub struct Node {
    pub name: String,
    pub kind: Kind,
    pub root: PathBuf,
    pub child: Option<Child>,
    pub claims: usize,
    /// More environment for its plugin (e.g. the fake MPS tools' knobs).
    pub env: Vec<(String, String)>,
}

impl Node {
    pub fn dra_socket(&self) -> PathBuf {
        self.root
            .join("plugins")
            .join(cleave_api::names::DRIVER_NAME)
            .join("dra.sock")
    }
    fn registration_socket(&self) -> PathBuf {
        self.root
            .join("registry")
            .join(format!("{}-reg.sock", cleave_api::names::DRIVER_NAME))
    }
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.root.join("plugin.log")).unwrap_or_default()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            stop(n);
        }
    }
}

fn stop(n: &mut Node) {
    if let Some(mut child) = n.child.take() {
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let started = Instant::now();
        while child.try_wait().ok().flatten().is_none() {
            if started.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Whether `rec` names node `name` (its path or query: a node-selected watch, a claim of the
/// node, the Node itself).
pub fn names_node(rec: &RequestRecord, name: &str) -> bool {
    rec.path.contains(name) || rec.query.contains(name)
}

/// Requests counted by `verb resource`, with the objects the LISTs among them walked (the
/// stand-in serves a `spec.nodeName` LIST of pods or slices from the field index, as the API
/// server's watch cache does) and the most seats API Priority and Fairness would charge one
/// of them.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Tally {
    pub by_kind: BTreeMap<String, usize>,
    pub scanned: usize,
    pub total: usize,
    pub max_seats: u32,
}

impl Tally {
    pub fn of<'a>(recs: impl IntoIterator<Item = &'a RequestRecord>) -> Self {
        let mut t = Tally::default();
        for r in recs {
            *t.by_kind
                .entry(format!("{} {}", r.verb, r.resource))
                .or_default() += 1;
            t.scanned += r.scanned;
            t.total += 1;
            t.max_seats = t.max_seats.max(r.seats);
        }
        t
    }
    pub fn get(&self, kind: &str) -> usize {
        self.by_kind.get(kind).copied().unwrap_or(0)
    }
    /// Reads: GETs and LISTs (a WATCH is counted apart).
    pub fn reads(&self, resource: &str) -> usize {
        self.get(&format!("get {resource}")) + self.get(&format!("list {resource}"))
    }
    pub fn line(&self) -> String {
        let parts: Vec<String> = self
            .by_kind
            .iter()
            .map(|(k, n)| format!("{n} {k}"))
            .collect();
        if parts.is_empty() {
            "none".into()
        } else {
            format!(
                "{} (objects walked: {}; most APF seats of one request: {})",
                parts.join(", "),
                self.scanned,
                self.max_seats
            )
        }
    }
}

impl World {
    /// A stand-in whose watches end `time_scale` times sooner than asked, no nodes yet.
    pub fn new(bin: &Path, time_scale: u32) -> World {
        let standin = StandIn::start_detached(StandInOptions {
            watch_time_scale: time_scale,
            ..Default::default()
        })
        .unwrap();
        World {
            standin,
            bin: bin.to_path_buf(),
            dir: tempfile::tempdir().unwrap(),
            nodes: Vec::new(),
            time_scale,
            pod_watch: true,
        }
    }

    /// Adds a node (its Node object and plugin Pod; the plugin not started yet).
    pub fn add_node(&mut self, kind: Kind) -> usize {
        let i = self.nodes.len();
        let name = node_name(i);
        let root = self.dir.path().join(&name);
        std::fs::create_dir_all(&root).unwrap();
        cleave_testkit::driver_root::lay_out_profile(
            &root.join("driver-root"),
            "h100-80gb-x8",
            None,
        );
        self.standin.put(&fixtures::node(&name)).unwrap();
        let pod = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("cleave-kubelet-plugin-{i:04}"), "namespace": NAMESPACE,
                         "labels": {"app.kubernetes.io/name": "cleave-kubelet-plugin"}},
            "spec": {"nodeName": name, "containers": [{"name": "plugin", "image": "cleave:test"}]},
        });
        self.standin.put(&pod).unwrap();
        std::fs::write(
            root.join("kubeconfig"),
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: s\n  cluster:\n    server: {}\nusers:\n- name: u\n  user: {{}}\ncontexts:\n- name: c\n  context:\n    cluster: s\n    user: u\ncurrent-context: c\n",
                self.standin.url()
            ),
        )
        .unwrap();
        self.nodes.push(Node {
            name,
            kind,
            root,
            child: None,
            claims: 0,
            env: Vec::new(),
        });
        i
    }

    /// Starts node `i`'s plugin with the chart's MPS launcher (`pod`), and waits until it
    /// registered, published its slices and holds its watches.
    pub fn start(&mut self, i: usize) {
        let n = &self.nodes[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(n.root.join("plugin.log"))
            .unwrap();
        let mut cmd = Command::new(&self.bin);
        cmd.arg("run")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("NODE_NAME", &n.name)
            .env("KUBECONFIG", n.root.join("kubeconfig"))
            .env("NVML_LIB", cleave_testkit::mock_lib())
            .env("MOCK_NVML_PROFILE", "h100-80gb-x8")
            .env(
                "MOCK_NVML_MIG",
                if n.kind == Kind::Mig { "on" } else { "off" },
            )
            .env("MOCK_NVML_STATE", n.root.join("mock.json"))
            .env("KUBELET_REGISTRAR_DIRECTORY_PATH", n.root.join("registry"))
            .env("KUBELET_PLUGINS_DIRECTORY_PATH", n.root.join("plugins"))
            .env("CDI_ROOT", n.root.join("cdi"))
            .env("MPS_PIPE_ROOT", n.root.join("run"))
            .env("NVIDIA_DRIVER_ROOT", n.root.join("driver-root"))
            .env("MPS_LAUNCHER", "pod")
            .env("MPS_DAEMON_IMAGE", "cleave:test")
            .env("POD_NAMESPACE", NAMESPACE)
            .env("KUBELET_ROOT_DIR", n.root.join("kubelet"))
            // The chart's default: usage sampling on, so one pod watch of the node serves
            // the usage pod index and the MPS daemon pods.
            .env("USAGE_INTERVAL", "10s")
            // CDI specs without hooks: an older build looks for its hook binary beside it.
            .env("DISABLE_CDI_HOOKS", "true")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        if n.kind == Kind::Mig {
            cmd.env("DYNAMIC_MIG", "true");
        }
        cmd.envs(n.env.iter().map(|(k, v)| (k, v)));
        let _ = std::fs::remove_file(n.registration_socket());
        let mark = self.standin.requests().len();
        let had_slices = self.published(&n.name);
        let n = &mut self.nodes[i];
        n.child = Some(cmd.spawn().unwrap());
        let name = n.name.clone();
        let reg = n.registration_socket();
        let started = Instant::now();
        loop {
            let child = self.nodes[i].child.as_mut().unwrap();
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "plugin of {name} exited with {status}:\n{}",
                    self.nodes[i].log()
                );
            }
            let registered = std::os::unix::net::UnixStream::connect(&reg).is_ok();
            let recs = self.standin.requests();
            // This start's watches (a restart's old ones do not count).
            let watching = |res: &str| {
                recs[mark.min(recs.len())..]
                    .iter()
                    .any(|r| r.verb == "watch" && r.resource == res && names_node(r, &name))
            };
            // A first start counts until its slice creates are recorded (a record follows
            // the store's change); a restart finds its slices there already.
            let creates = recs[mark.min(recs.len())..]
                .iter()
                .filter(|r| {
                    r.verb == "create"
                        && r.resource == "resourceslices"
                        && !r.query.contains("dryRun")
                })
                .count();
            let created = had_slices || creates >= self.slice_count(&name);
            let pods = !self.pod_watch || watching("pods");
            if registered && watching("resourceslices") && pods && self.published(&name) && created
            {
                return;
            }
            assert!(
                started.elapsed() < TIMEOUT,
                "{name} did not start:\n{}",
                self.nodes[i].log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// How many slices of node `name` the stand-in holds.
    pub fn slice_count(&self, name: &str) -> usize {
        self.standin
            .list("resourceslices")
            .iter()
            .filter(|s| s.pointer("/spec/nodeName").and_then(|n| n.as_str()) == Some(name))
            .count()
    }

    /// Whether node `name`'s pool is complete in the stand-in: as many slices as each says
    /// the pool has (`spec.pool.resourceSliceCount`).
    pub fn published(&self, name: &str) -> bool {
        let slices: Vec<serde_json::Value> = self
            .standin
            .list("resourceslices")
            .into_iter()
            .filter(|s| s.pointer("/spec/nodeName").and_then(|n| n.as_str()) == Some(name))
            .collect();
        !slices.is_empty()
            && slices.iter().all(|s| {
                s.pointer("/spec/pool/resourceSliceCount")
                    .and_then(serde_json::Value::as_u64)
                    == Some(slices.len() as u64)
            })
    }

    /// Stops node `i`'s plugin (SIGTERM, as the kubelet does).
    pub fn stop(&mut self, i: usize) {
        stop(&mut self.nodes[i]);
    }

    /// A new claim of node `i`, allocated a device fitting its kind, stored in the stand-in.
    pub fn new_claim(&mut self, i: usize) -> v1::Claim {
        let n = &mut self.nodes[i];
        let k = n.claims;
        n.claims += 1;
        let name = format!("c-{}-{k}", n.name);
        let uid = format!("00000000-0000-4000-8000-{:06}{:06}", i, k);
        let device = match n.kind {
            Kind::Whole => format!("gpu-{}", k % 8),
            Kind::Mig => format!("gpu-{}-mig-1g10gb-{}", k % 8, (k / 8) % 7),
        };
        self.standin
            .put(&fixtures::resource_claim(
                "default",
                &name,
                &uid,
                cleave_api::names::DRIVER_NAME,
                &n.name,
                &[("gpu", device.as_str())],
                &[],
            ))
            .unwrap();
        v1::Claim {
            namespace: "default".into(),
            name,
            uid,
        }
    }

    /// Waits until claim `name`'s `status.devices` is present (`want`) or absent, and the
    /// write that made it so is among the request records since `mark`.
    pub fn wait_status(&self, mark: usize, name: &str, want: bool) {
        assert!(
            self.wait_status_for(mark, name, want, TIMEOUT),
            "claim {name}: status entry never {}",
            if want { "written" } else { "removed" }
        );
    }

    /// [`World::wait_status`] for at most `limit`: false when it did not happen (a build
    /// that writes no claim status).
    pub fn wait_status_for(&self, mark: usize, name: &str, want: bool, limit: Duration) -> bool {
        let started = Instant::now();
        loop {
            let recorded = self.since(mark).iter().any(|r| {
                r.verb != "get" && r.resource == "resourceclaims" && r.path.contains(name)
            });
            let has = self
                .standin
                .get("resourceclaims", "default", name)
                .and_then(|c| {
                    c.pointer("/status/devices")
                        .and_then(|d| d.as_array())
                        .map(|d| !d.is_empty())
                })
                .unwrap_or(false);
            if has == want && recorded {
                return true;
            }
            if started.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// The requests served since `mark` (an index into [`StandIn::requests`]).
    pub fn since(&self, mark: usize) -> Vec<RequestRecord> {
        self.standin.requests().split_off(mark)
    }

    /// The requests since `mark` that node `i` made: those naming it, and those naming no
    /// node at all (which only the node under test makes while the others idle).
    pub fn of_node(&self, mark: usize, i: usize) -> Vec<RequestRecord> {
        let others: Vec<&str> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, n)| n.name.as_str())
            .collect();
        let me = &self.nodes[i].name;
        self.since(mark)
            .into_iter()
            .filter(|r| names_node(r, me) || !others.iter().any(|o| names_node(r, o)))
            .collect()
    }

    /// The objects of `resource` that belong to no other node than `i` (for the rule that a
    /// node's LIST must not walk other nodes' objects): all of them minus the others'.
    pub fn objects(&self, resource: &str) -> usize {
        self.standin.list(resource).len()
    }
}

/// A DRA client of node `n`.
pub async fn dra(n: &Node) -> v1::dra_plugin_client::DraPluginClient<Channel> {
    v1::dra_plugin_client::DraPluginClient::new(
        cleave_kubelet_plugin::connect_unix(n.dra_socket())
            .await
            .unwrap(),
    )
}

/// Prepares `claim` over `dra`, panicking on an error.
pub async fn prepare(dra: &mut v1::dra_plugin_client::DraPluginClient<Channel>, claim: &v1::Claim) {
    let r = dra
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![claim.clone()],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims[&claim.uid].error, "", "prepare of {}", claim.name);
}

/// Unprepares `claim` over `dra`, panicking on an error.
pub async fn unprepare(
    dra: &mut v1::dra_plugin_client::DraPluginClient<Channel>,
    claim: &v1::Claim,
) {
    let r = dra
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![claim.clone()],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        r.claims[&claim.uid].error, "",
        "unprepare of {}",
        claim.name
    );
}
