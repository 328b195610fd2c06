//! The composition matrix: every DeviceClass the chart ships and every example claim, on
//! every node mode (consumable capacity off / mps / time-slicing × static / on-demand MIG),
//! in every allocation shape the kube-scheduler's allocator produces for cleave's devices
//! (one device, `count: 2`, `allocationMode: All`, capacity requests, two requests on one
//! device, admin access beside another claim). Each shape is allocated by a small model of
//! the upstream allocator over exactly what the node publishes ([`build_pool`]):
//!
//! - the first free device in publish order that the class selects;
//! - a device with `allowMultipleAllocations` is always allocated as a share: a `shareID` and
//!   what it consumed, each capacity's request rounded up to its policy's step from `min`, or
//!   the policy's default (the whole device) when the claim asks none; refused above the
//!   policy's `max` or what is left of the device;
//! - shared counters: taken by an exclusive device, and by a shareable device's first share
//!   only; a device whose counters are not free is not free;
//! - class configs attached as `FromClass`, claim configs as `FromClaim`;
//! - admin access: any device the class selects, free or not, consuming nothing.
//!
//! Whatever the model allocates must prepare, with the CDI spec and MPS limits the cell of
//! the sharing model says; what it cannot allocate is counted as unallocatable, with the
//! reason. The chart's claim-shape admission policy (`sharingShapes`) is mirrored by
//! [`denied_at_admission`] and evaluated on the same shapes by the deployment checks.
//!
//! Built with `harness = false`: the binary plays the fake MPS and `nvidia-smi` tools.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cleave_api::names::DRIVER_NAME;
use cleave_api::pool::{ConsumableCapacity, PoolDevices};
use cleave_driver::model::Placement;
use cleave_driver::pool::{PoolOptions, build_pool};
use cleave_driver::prepare::testing::{FakeBackend, inventory, mig_gpu, plain_gpu};
use cleave_driver::prepare::{DriverConfig, NodeDriver};
use cleave_driver::sharing::SharingManager;
use cleave_testkit::fake_tools::NodeTools;
use k8s_openapi::api::resource::v1::{Device, ResourceClaim};
use serde_json::{Value, json};

fn main() -> std::process::ExitCode {
    cleave_testkit::runner::main(&[(
        "every_shipped_class_and_example_prepares_in_every_node_mode",
        every_shipped_class_and_example_prepares_in_every_node_mode,
    )])
}

// ---------------------------------------------------------------------------------------
// What the chart ships

/// A DeviceClass as the allocator model evaluates it.
#[derive(Debug, Clone)]
struct Class {
    name: String,
    device_type: String,
    shareable_only: bool,
    config: Option<Value>,
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The chart's DeviceClasses (fixture kept equal to the rendering by the deployment checks).
fn shipped_classes() -> Vec<Class> {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deviceclasses.yaml"),
    )
    .unwrap();
    let mut out = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v: Value = serde::Deserialize::deserialize(doc).unwrap();
        if v.is_null() {
            continue;
        }
        let expr = v["spec"]["selectors"][0]["cel"]["expression"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        let device_type = expr
            .split(".type == \"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap()
            .to_owned();
        out.push(Class {
            name: v["metadata"]["name"].as_str().unwrap().to_owned(),
            device_type,
            shareable_only: expr.contains("allowMultipleAllocations == true"),
            config: v["spec"]["config"][0]["opaque"].get("parameters").cloned(),
        });
    }
    assert_eq!(out.len(), 4, "the chart ships four DeviceClasses");
    out
}

/// One request of a claim shape.
#[derive(Debug, Clone)]
struct Request {
    name: String,
    class: String,
    /// `None`: `allocationMode: All`.
    count: Option<u32>,
    /// Capacity requests (`memory`, `multiprocessors`) as quantities.
    capacity: BTreeMap<String, String>,
    admin: bool,
}

/// A claim shape: requests, claim configs (`requests`, parameters), and a constraint that
/// puts every request on one device (`matchAttribute: gpu.cleave.dev/uuid`).
#[derive(Debug, Clone)]
struct Shape {
    label: String,
    requests: Vec<Request>,
    configs: Vec<(Vec<String>, Value)>,
    same_device: bool,
}

fn request(name: &str, class: &str, count: Option<u32>, capacity: &[(&str, &str)]) -> Request {
    Request {
        name: name.into(),
        class: class.into(),
        count,
        capacity: capacity
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect(),
        admin: false,
    }
}

/// The claims of the examples (templates and claims; their CEL selectors narrow which
/// device, not the shape, and are evaluated by the deployment checks).
fn example_shapes() -> Vec<Shape> {
    let dir = repo().join("deployments/examples");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v: Value = serde::Deserialize::deserialize(doc).unwrap();
            let spec = match v["kind"].as_str() {
                Some("ResourceClaimTemplate") => &v["spec"]["spec"],
                Some("ResourceClaim") => &v["spec"],
                _ => continue,
            };
            let mut requests = Vec::new();
            for r in spec["devices"]["requests"].as_array().unwrap() {
                let exactly = &r["exactly"];
                let capacity = exactly["capacity"]["requests"]
                    .as_object()
                    .map(|m| {
                        m.iter()
                            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                            .collect()
                    })
                    .unwrap_or_default();
                requests.push(Request {
                    name: r["name"].as_str().unwrap().into(),
                    class: exactly["deviceClassName"].as_str().unwrap().into(),
                    count: match exactly["allocationMode"].as_str() {
                        Some("All") => None,
                        _ => Some(exactly["count"].as_u64().unwrap_or(1) as u32),
                    },
                    capacity,
                    admin: exactly["adminAccess"].as_bool().unwrap_or(false),
                });
            }
            let configs = spec["devices"]["config"]
                .as_array()
                .map(|cs| {
                    cs.iter()
                        .map(|c| {
                            (
                                c["requests"]
                                    .as_array()
                                    .map(|a| {
                                        a.iter().map(|r| r.as_str().unwrap().to_owned()).collect()
                                    })
                                    .unwrap_or_default(),
                                c["opaque"]["parameters"].clone(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push(Shape {
                label: format!(
                    "example {}/{}",
                    file.file_name().unwrap().to_string_lossy(),
                    v["metadata"]["name"].as_str().unwrap_or("?")
                ),
                requests,
                configs,
                same_device: false,
            });
        }
    }
    assert!(out.len() >= 6, "examples: {out:?}");
    out
}

/// Shapes per class: the allocation shapes the upstream allocator produces for shareable and exclusive devices.
fn class_shapes(class: &Class) -> Vec<Shape> {
    let c = class.name.as_str();
    let shape = |label: &str, requests: Vec<Request>, same_device: bool| Shape {
        label: format!("{c}: {label}"),
        requests,
        configs: Vec::new(),
        same_device,
    };
    let mut admin = request("watch", c, Some(1), &[]);
    admin.admin = true;
    vec![
        shape("one device", vec![request("r", c, Some(1), &[])], false),
        shape("count: 2", vec![request("r", c, Some(2), &[])], false),
        shape(
            "allocationMode: All",
            vec![request("r", c, None, &[])],
            false,
        ),
        shape(
            "a capacity request",
            vec![request(
                "r",
                c,
                Some(1),
                &[("memory", "4Gi"), ("multiprocessors", "10")],
            )],
            false,
        ),
        shape(
            "two capacity requests on one device",
            vec![
                request(
                    "a",
                    c,
                    Some(1),
                    &[("memory", "4Gi"), ("multiprocessors", "10")],
                ),
                request(
                    "b",
                    c,
                    Some(1),
                    &[("memory", "2Gi"), ("multiprocessors", "5")],
                ),
            ],
            true,
        ),
        shape(
            "count: 2 asking capacity on one device",
            vec![request(
                "r",
                c,
                Some(2),
                &[("memory", "2Gi"), ("multiprocessors", "5")],
            )],
            true,
        ),
        shape(
            "count: 2 asking capacity, unconstrained",
            vec![request(
                "r",
                c,
                Some(2),
                &[("memory", "2Gi"), ("multiprocessors", "5")],
            )],
            false,
        ),
        shape("admin access beside a claim", vec![admin], false),
    ]
}

/// Mirrors the chart's claim-shape admission policy (on with `consumableCapacity: mps`):
/// partial MPS shares of several devices in one claim cannot reach their daemons from one
/// container, so a claim whose requests ask capacity either asks it in one request of one
/// device, or puts them on one device with `matchAttribute: gpu.cleave.dev/uuid`; and a
/// request through the per-claim MPS class cannot sit beside one that asks capacity.
fn denied_at_admission(shape: &Shape, mode: ConsumableCapacity) -> Option<&'static str> {
    if mode != ConsumableCapacity::Mps {
        return None;
    }
    let asking: Vec<&Request> = shape
        .requests
        .iter()
        .filter(|r| !r.capacity.is_empty() && !r.admin)
        .collect();
    let several = asking.len() > 1 || asking.iter().any(|r| r.count != Some(1));
    if several && !shape.same_device {
        return Some(
            "capacity asked for several devices without matchAttribute gpu.cleave.dev/uuid",
        );
    }
    if !asking.is_empty()
        && shape
            .requests
            .iter()
            .any(|r| r.class == "mps.gpu.cleave.dev" && r.capacity.is_empty())
    {
        return Some("a per-claim MPS request beside a capacity request");
    }
    None
}

// ---------------------------------------------------------------------------------------
// The allocator model

fn qty(s: &str) -> u64 {
    u64::try_from(cleave_api::quantity::Quantity::parse(s).unwrap().value()).unwrap()
}

fn attr_str(d: &Device, name: &str) -> Option<String> {
    d.attributes.as_ref()?.get(name)?.string.clone()
}

/// What is allocated on the node so far.
#[derive(Default)]
struct Taken {
    exclusive: Vec<String>,
    /// Shareable devices in use: what is left of each capacity.
    left: BTreeMap<String, BTreeMap<String, u64>>,
    /// Counters used, by (counter set, counter).
    counters: BTreeMap<(String, String), u64>,
}

struct Model<'a> {
    pool: &'a PoolDevices,
    taken: Taken,
    shares: u32,
}

/// One allocation result.
#[derive(Debug, Clone)]
struct Result_ {
    request: String,
    device: String,
    share: Option<(String, BTreeMap<String, u64>)>,
    admin: bool,
}

impl<'a> Model<'a> {
    fn new(pool: &'a PoolDevices) -> Self {
        Model {
            pool,
            taken: Taken::default(),
            shares: 0,
        }
    }

    fn devices(&self) -> impl Iterator<Item = (&'a Device, &'a cleave_api::pool::DeviceGroup)> {
        self.pool
            .groups
            .iter()
            .flat_map(|g| g.devices.iter().map(move |d| (d, g)))
    }

    fn selects(class: &Class, d: &Device) -> bool {
        attr_str(d, "type").as_deref() == Some(class.device_type.as_str())
            && (!class.shareable_only || d.allow_multiple_allocations == Some(true))
    }

    fn counters_free(&self, d: &Device, g: &cleave_api::pool::DeviceGroup) -> bool {
        let Some(consumes) = &d.consumes_counters else {
            return true;
        };
        consumes.iter().all(|c| {
            let set = g
                .counter_sets
                .iter()
                .find(|s| s.name == c.counter_set)
                .unwrap();
            c.counters.iter().all(|(name, v)| {
                let total = qty(&set.counters[name].value.0);
                let used = self
                    .taken
                    .counters
                    .get(&(c.counter_set.clone(), name.clone()))
                    .copied()
                    .unwrap_or(0);
                used + qty(&v.value.0) <= total
            })
        })
    }

    fn take_counters(&mut self, d: &Device) {
        for c in d.consumes_counters.iter().flatten() {
            for (name, v) in &c.counters {
                *self
                    .taken
                    .counters
                    .entry((c.counter_set.clone(), name.clone()))
                    .or_default() += qty(&v.value.0);
            }
        }
    }

    /// What a share of `d` consumes for `asked`, or why it cannot.
    fn consumption(d: &Device, asked: &BTreeMap<String, String>) -> Option<BTreeMap<String, u64>> {
        let mut out = BTreeMap::new();
        for (name, c) in d.capacity.as_ref()? {
            let Some(p) = &c.request_policy else {
                if asked.contains_key(name) {
                    return None;
                }
                continue;
            };
            let value = match asked.get(name) {
                None => qty(&p.default.as_ref()?.0),
                Some(a) => {
                    let a = qty(a);
                    let r = p.valid_range.as_ref()?;
                    let min = qty(&r.min.0);
                    let step = r.step.as_ref().map_or(1, |s| qty(&s.0)).max(1);
                    let v = if a <= min {
                        min
                    } else {
                        min + (a - min).div_ceil(step) * step
                    };
                    if r.max.as_ref().is_some_and(|m| v > qty(&m.0)) {
                        return None;
                    }
                    v
                }
            };
            out.insert(name.clone(), value);
        }
        // A capacity the device does not publish is refused.
        if asked
            .keys()
            .any(|k| !d.capacity.as_ref().is_some_and(|c| c.contains_key(k)))
        {
            return None;
        }
        Some(out)
    }

    /// Allocates one device for `r` (not one of `skip`, or `only` when given).
    fn allocate_one(
        &mut self,
        class: &Class,
        r: &Request,
        skip: &[String],
        only: Option<&str>,
    ) -> Option<Result_> {
        let candidates: Vec<(&'a Device, &'a cleave_api::pool::DeviceGroup)> = self
            .devices()
            .filter(|(d, _)| Self::selects(class, d))
            .filter(|(d, _)| only.is_none_or(|o| o == d.name))
            .collect();
        if r.admin {
            let (d, _) = candidates.first()?;
            return Some(Result_ {
                request: r.name.clone(),
                device: d.name.clone(),
                share: None,
                admin: true,
            });
        }
        for (d, g) in candidates {
            if self.taken.exclusive.contains(&d.name) {
                continue;
            }
            if d.allow_multiple_allocations == Some(true) {
                let Some(consumed) = Self::consumption(d, &r.capacity) else {
                    continue;
                };
                let first = !self.taken.left.contains_key(&d.name);
                if first && !self.counters_free(d, g) {
                    continue;
                }
                let left = self.taken.left.entry(d.name.clone()).or_insert_with(|| {
                    d.capacity
                        .as_ref()
                        .unwrap()
                        .iter()
                        .map(|(k, c)| (k.clone(), qty(&c.value.0)))
                        .collect()
                });
                if consumed
                    .iter()
                    .any(|(k, v)| left.get(k).is_some_and(|l| v > l))
                {
                    if first {
                        self.taken.left.remove(&d.name);
                    }
                    continue;
                }
                for (k, v) in &consumed {
                    if let Some(l) = left.get_mut(k) {
                        *l -= v;
                    }
                }
                if first {
                    self.take_counters(d);
                }
                self.shares += 1;
                let id = format!("{:08x}-0000-4000-8000-{:012x}", self.shares, self.shares);
                return Some(Result_ {
                    request: r.name.clone(),
                    device: d.name.clone(),
                    share: Some((id, consumed)),
                    admin: false,
                });
            }
            if skip.contains(&d.name) || self.taken.left.contains_key(&d.name) {
                continue;
            }
            // A non-shareable device must hold what the request asks.
            let fits = r.capacity.iter().all(|(k, a)| {
                d.capacity
                    .as_ref()
                    .and_then(|c| c.get(k))
                    .is_some_and(|c| qty(a) <= qty(&c.value.0))
            });
            if !fits || !self.counters_free(d, g) {
                continue;
            }
            self.take_counters(d);
            self.taken.exclusive.push(d.name.clone());
            return Some(Result_ {
                request: r.name.clone(),
                device: d.name.clone(),
                share: None,
                admin: false,
            });
        }
        None
    }

    /// Allocates a claim shape, or says why it cannot.
    fn allocate(&mut self, classes: &[Class], shape: &Shape) -> Result<Vec<Result_>, String> {
        let mut out: Vec<Result_> = Vec::new();
        for r in &shape.requests {
            let class = classes
                .iter()
                .find(|c| c.name == r.class)
                .ok_or_else(|| format!("class {} is not shipped", r.class))?;
            match r.count {
                Some(n) => {
                    for _ in 0..n {
                        let only = if shape.same_device {
                            out.first().map(|x| x.device.clone())
                        } else {
                            None
                        };
                        let skip: Vec<String> = out.iter().map(|x| x.device.clone()).collect();
                        let got = self
                            .allocate_one(class, r, &skip, only.as_deref())
                            .ok_or_else(|| {
                                format!("no free device of class {} for {}", class.name, r.name)
                            })?;
                        out.push(got);
                    }
                }
                None => {
                    // All: every selected device, each free.
                    let names: Vec<String> = self
                        .devices()
                        .filter(|(d, _)| Self::selects(class, d))
                        .map(|(d, _)| d.name.clone())
                        .collect();
                    if names.is_empty() {
                        return Err(format!("class {} selects no device", class.name));
                    }
                    for name in names {
                        let got = self
                            .allocate_one(class, r, &[], Some(&name))
                            .ok_or_else(|| format!("allocationMode All: {name} is not free"))?;
                        out.push(got);
                    }
                }
            }
        }
        Ok(out)
    }
}

/// The ResourceClaim the scheduler would write for `results`.
fn claim(uid: &str, shape: &Shape, classes: &[Class], results: &[Result_]) -> ResourceClaim {
    let results: Vec<Value> = results
        .iter()
        .map(|x| {
            let mut r = json!({"request": x.request, "driver": DRIVER_NAME, "pool": "node-a", "device": x.device});
            if let Some((id, consumed)) = &x.share {
                r["shareID"] = json!(id);
                r["consumedCapacity"] = consumed
                    .iter()
                    .map(|(k, v)| (k.clone(), json!(v.to_string())))
                    .collect::<serde_json::Map<_, _>>()
                    .into();
            }
            if x.admin {
                r["adminAccess"] = json!(true);
            }
            r
        })
        .collect();
    let mut config = Vec::new();
    for r in &shape.requests {
        let class = classes.iter().find(|c| c.name == r.class).unwrap();
        if let Some(p) = &class.config {
            config.push(json!({"source": "FromClass", "requests": [r.name], "opaque": {"driver": DRIVER_NAME, "parameters": p}}));
        }
    }
    for (requests, p) in &shape.configs {
        config.push(json!({"source": "FromClaim", "requests": requests, "opaque": {"driver": DRIVER_NAME, "parameters": p}}));
    }
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": format!("claim-{}", &uid[..8]), "namespace": "default", "uid": uid},
        "spec": {"devices": {}},
        "status": {"allocation": {"devices": {"results": results, "config": config}}}
    }))
    .unwrap()
}

// ---------------------------------------------------------------------------------------
// The node

#[derive(Debug, Clone, Copy)]
struct NodeMode {
    capacity: ConsumableCapacity,
    dynamic_mig: bool,
}

impl std::fmt::Display for NodeMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "consumable capacity {}, {} MIG",
            self.capacity.as_str(),
            if self.dynamic_mig {
                "on-demand"
            } else {
                "static"
            }
        )
    }
}

struct Node {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    driver: NodeDriver,
    tools: NodeTools,
    state: PathBuf,
}

impl Node {
    /// Two GPUs without MIG and one A100 40GB with MIG on (static mode: a 3g.20gb instance
    /// made by the administrator).
    fn new(mode: NodeMode) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_owned();
        let tools = NodeTools::install(&root);
        let state = root.join("state");
        let backend = Arc::new(FakeBackend::new(inventory(vec![
            plain_gpu(0),
            plain_gpu(1),
            mig_gpu(2),
        ])));
        if !mode.dynamic_mig {
            backend
                .add_instance(
                    &cleave_driver::prepare::testing::gpu_uuid(2),
                    9,
                    Placement { start: 0, size: 4 },
                )
                .unwrap();
        }
        let mut sharing = tools.sharing_config(&state, &[]);
        sharing.pipe_root = Some(root.join("run"));
        let config = DriverConfig {
            dynamic_mig: mode.dynamic_mig,
            consumable_capacity: mode.capacity,
            ..common::node_config(&root, state.clone())
        };
        let driver =
            NodeDriver::start_with_sharing(config, backend, Arc::new(SharingManager::new(sharing)))
                .unwrap();
        Node {
            _tmp: tmp,
            root,
            driver,
            tools,
            state,
        }
    }

    fn pool(&self, mode: NodeMode) -> PoolDevices {
        build_pool(
            &self.driver.inventory(),
            &PoolOptions {
                dynamic_mig: mode.dynamic_mig,
                owned_instances: self.driver.owned_mig_uuids(),
                consumable_capacity: mode.capacity,
                ..PoolOptions::default()
            },
        )
    }

    fn cdi(&self, uid: &str) -> String {
        std::fs::read_to_string(
            self.root
                .join("cdi")
                .join(cleave_driver::cdi::spec_file_name(uid)),
        )
        .unwrap_or_default()
    }

    fn assert_nothing_left(&self, ctx: &str) {
        for pid in self.tools.files.started_pids() {
            assert!(
                cleave_testkit::process::wait_dead(pid, std::time::Duration::from_secs(5)),
                "{ctx}: daemon {pid} still runs"
            );
        }
        let left: Vec<_> = std::fs::read_dir(self.state.join("mps"))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{ctx}: left behind {left:?}");
        let pipes: Vec<_> = std::fs::read_dir(self.root.join("run"))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(pipes.is_empty(), "{ctx}: pipe directories left {pipes:?}");
        assert!(self.driver.prepared_claims().is_empty(), "{ctx}");
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.tools.files.kill_started();
    }
}

// ---------------------------------------------------------------------------------------
// The matrix

/// What the CDI spec of a prepared shape must say: MPS client limits for MPS shares, a
/// daemon of its own for a per-claim MPS config, nothing of MPS for admin access.
fn check_spec(
    ctx: &str,
    mode: NodeMode,
    shape: &Shape,
    classes: &[Class],
    results: &[Result_],
    spec: &str,
) {
    let partial = results.iter().any(|r| {
        r.share.as_ref().is_some_and(|(_, c)| {
            // A share of less than the whole device.
            c.get("multiprocessors").is_some_and(|&n| n < 58)
                || c.get("memory").is_some_and(|&m| m < 24 << 30)
        }) && !r.device.contains("-mig-")
    });
    let per_claim_mps = shape.requests.iter().any(|r| {
        classes.iter().any(|c| {
            c.name == r.class
                && c.config
                    .as_ref()
                    .is_some_and(|p| p["sharing"]["strategy"] == "MPS")
        })
    }) || shape
        .configs
        .iter()
        .any(|(_, p)| p["sharing"]["strategy"] == "MPS");
    let admin_only = shape.requests.iter().all(|r| r.admin);
    if admin_only {
        assert!(
            !spec.contains("CUDA_MPS"),
            "{ctx}: admin access got MPS edits: {spec}"
        );
    } else if mode.capacity == ConsumableCapacity::Mps && partial {
        assert!(
            spec.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=")
                && spec.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0="),
            "{ctx}: an MPS share without client limits: {spec}"
        );
    } else if per_claim_mps && !partial {
        assert!(
            spec.contains("CUDA_MPS_PIPE_DIRECTORY="),
            "{ctx}: per-claim MPS lacks its daemon: {spec}"
        );
    } else if !per_claim_mps && mode.capacity != ConsumableCapacity::Mps {
        assert!(
            !spec.contains("CUDA_MPS"),
            "{ctx}: MPS edits where none apply: {spec}"
        );
    }
    for r in results {
        assert!(
            spec.contains(&r.device),
            "{ctx}: spec lacks {}: {spec}",
            r.device
        );
    }
}

fn every_shipped_class_and_example_prepares_in_every_node_mode() {
    let classes = shipped_classes();
    let mut shapes: Vec<Shape> = classes.iter().flat_map(class_shapes).collect();
    shapes.extend(example_shapes());
    let mut prepared = 0;
    // Each cell's outcome, checked against the table at the end.
    let mut outcomes: BTreeMap<String, String> = BTreeMap::new();
    let mut unallocatable: Vec<String> = Vec::new();
    let mut denied: Vec<String> = Vec::new();
    let mut cells = 0;
    for capacity in [
        ConsumableCapacity::Off,
        ConsumableCapacity::Mps,
        ConsumableCapacity::TimeSlicing,
    ] {
        for dynamic_mig in [false, true] {
            let mode = NodeMode {
                capacity,
                dynamic_mig,
            };
            for (i, shape) in shapes.iter().enumerate() {
                cells += 1;
                let ctx = format!("[{mode}] {}", shape.label);
                if let Some(why) = denied_at_admission(shape, capacity) {
                    denied.push(format!("{ctx}: {why}"));
                    outcomes.insert(ctx, format!("denied: {why}"));
                    continue;
                }
                let node = Node::new(mode);
                let pool = node.pool(mode);
                let mut model = Model::new(&pool);
                // Admin access is tried beside a claim that holds the device.
                let mut background = None;
                if shape.requests.iter().any(|r| r.admin) {
                    let class = classes
                        .iter()
                        .find(|c| c.name == shape.requests[0].class)
                        .unwrap();
                    let holder = Shape {
                        label: "holder".into(),
                        requests: vec![request("r", &class.name, Some(1), &[])],
                        configs: Vec::new(),
                        same_device: false,
                    };
                    if let Ok(results) = model.allocate(&classes, &holder) {
                        let uid = "b0000000-0000-4000-8000-000000000000";
                        node.driver
                            .prepare(&claim(uid, &holder, &classes, &results))
                            .unwrap_or_else(|e| panic!("{ctx}: the holder: {e}"));
                        background = Some(uid);
                    }
                }
                let results = match model.allocate(&classes, shape) {
                    Ok(r) => r,
                    Err(why) => {
                        unallocatable.push(format!("{ctx}: {why}"));
                        outcomes.insert(ctx, format!("unallocatable: {why}"));
                        continue;
                    }
                };
                let uid = format!("{:08x}-0000-4000-8000-000000000001", i + 1);
                let c = claim(&uid, shape, &classes, &results);
                let answer = node.driver.prepare(&c).unwrap_or_else(|e| {
                    panic!("{ctx}: allocated {results:?} but prepare refused: {e}")
                });
                let want_entries = results.len();
                assert_eq!(
                    answer.devices.len(),
                    want_entries,
                    "{ctx}: one answer entry per allocation result"
                );
                check_spec(&ctx, mode, shape, &classes, &results, &node.cdi(&uid));
                // Idempotent, then unprepared without a trace.
                assert_eq!(node.driver.prepare(&c).unwrap(), answer, "{ctx}");
                node.driver.unprepare(&uid).unwrap();
                if let Some(b) = background {
                    assert!(
                        !node.cdi(b).is_empty(),
                        "{ctx}: admin unprepare touched the holder"
                    );
                    node.driver.unprepare(b).unwrap();
                }
                node.assert_nothing_left(&ctx);
                outcomes.insert(ctx, "prepared".to_owned());
                prepared += 1;
            }
        }
    }
    println!(
        "composition matrix: {cells} cells ({} classes and examples × 6 node modes): {prepared} prepared, {} unallocatable, {} denied at admission",
        shapes.len(),
        unallocatable.len(),
        denied.len()
    );
    for u in &unallocatable {
        println!("  unallocatable {u}");
    }
    for d in &denied {
        println!("  denied {d}");
    }
    assert_eq!(outcomes.len(), cells, "two cells share a name");
    check_expected(&outcomes);
}

/// The checked-in table of every cell's outcome (`<cell> => <outcome>`, one a line).
const EXPECTED: &str = "tests/composition-expected.txt";

/// Compares the cells' outcomes with [`EXPECTED`]: any cell that appeared, disappeared or
/// changed its outcome fails the test by name. `CLEAVE_UPDATE_EXPECTED=1` rewrites the table
/// (review its diff: each changed line is a behaviour change).
fn check_expected(outcomes: &BTreeMap<String, String>) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(EXPECTED);
    let now: String = outcomes
        .iter()
        .map(|(cell, outcome)| format!("{cell} => {outcome}\n"))
        .collect();
    if std::env::var_os("CLEAVE_UPDATE_EXPECTED").is_some_and(|v| v == "1") {
        std::fs::write(&path, &now).unwrap();
        println!("wrote {}", path.display());
        return;
    }
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let want: BTreeMap<&str, &str> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.split_once(" => ")
                .unwrap_or_else(|| panic!("{}: bad line {l:?}", path.display()))
        })
        .collect();
    let mut changed = Vec::new();
    for (cell, outcome) in outcomes {
        match want.get(cell.as_str()) {
            None => changed.push(format!("new cell {cell}: {outcome}")),
            Some(w) if *w != outcome => {
                changed.push(format!("{cell}: expected {w}, got {outcome}"));
            }
            Some(_) => {}
        }
    }
    for cell in want.keys() {
        if !outcomes.contains_key(*cell) {
            changed.push(format!("cell gone: {cell}"));
        }
    }
    assert!(
        changed.is_empty(),
        "{} cell(s) differ from {EXPECTED} (CLEAVE_UPDATE_EXPECTED=1 rewrites it after review):\n  {}",
        changed.len(),
        changed.join("\n  ")
    );
    println!(
        "composition matrix: all {} cells as in {EXPECTED}",
        outcomes.len()
    );
}
