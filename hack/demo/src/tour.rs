//! The tour: the whole plugin in one process on a simulated node.
//!
//! The mock NVML library plays an 8-GPU node (MIG on GPUs 0-5, off on 6-7), the API
//! server stand-in plays the cluster, this very binary (`cleave-demo`) plays `nvidia-cuda-mps-control` and
//! `nvidia-smi` (the fakes of `cleave-fakes`, behind the hidden first argument `__fake`),
//! and the demo plays the kubelet: it talks to the plugin over its unix sockets exactly as
//! the kubelet would. Every step is checked; any failure makes the exit code non-zero, and
//! no MPS daemon outlives the demo whatever happens.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use cleave_apiserver_standin::{StandIn, StandInOptions, fixtures};
use cleave_driver::model::MigState;
use k8s_openapi::api::resource::v1::ResourceSlice;

use cleave_kubelet_plugin::args::{DriverArgs, KubeletArgs, NvmlArgs, RunArgs};
use cleave_kubelet_plugin::connect_unix;
use cleave_kubelet_plugin::proto::dra::v1;
use cleave_kubelet_plugin::proto::registration::{InfoRequest, RegistrationStatus};

/// What the demo simulates.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Mock node profile.
    #[arg(long, default_value = "h100-80gb-x8")]
    pub profile: String,
}

/// Node (and pool) name of the simulated node.
const NODE: &str = "demo-node";
/// Namespace of the example claims.
const NAMESPACE: &str = "default";

/// GPUs of the demo node whose MIG mode starts disabled (the others have MIG on).
const PLAIN_GPUS: u32 = 2;
/// Seconds after which a forgotten fake MPS daemon exits by itself (a last resort: the
/// demo stops every daemon it started on every path).
const FAKE_DAEMON_IDLE_EXIT_SECS: &str = "60";

/// One example claim: what a pod would ask for, and the device the scheduler picked.
struct Example {
    title: &'static str,
    name: &'static str,
    uid: &'static str,
    request: &'static str,
    device: &'static str,
    /// Whether the claim carries the MPS `GpuConfig` of [`mps_config`].
    mps: bool,
}

const EXAMPLES: [Example; 4] = [
    Example {
        title: "a whole GPU",
        name: "whole-gpu",
        uid: "5d2f0c1e-0000-4000-8000-000000000001",
        request: "gpu",
        device: "gpu-6",
        mps: false,
    },
    Example {
        title: "an on-demand MIG 1g.10gb",
        name: "mig-small",
        uid: "5d2f0c1e-0000-4000-8000-000000000002",
        request: "mig",
        device: "gpu-1-mig-1g10gb-0",
        mps: false,
    },
    Example {
        title: "an on-demand MIG 3g.40gb",
        name: "mig-medium",
        uid: "5d2f0c1e-0000-4000-8000-000000000003",
        request: "mig",
        device: "gpu-1-mig-3g40gb-4",
        mps: false,
    },
    Example {
        title: "a whole GPU shared with MPS, 25% of the SMs, 10Gi pinned memory",
        name: "mps-shared",
        uid: "5d2f0c1e-0000-4000-8000-000000000004",
        request: "gpu",
        device: "gpu-7",
        mps: true,
    },
];

/// The opaque `GpuConfig` of the MPS example, as a user writes it in the claim.
fn mps_config() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": cleave_api::names::CONFIG_API_VERSION,
        "kind": cleave_api::names::KIND_GPU_CONFIG,
        "sharing": {
            "strategy": "MPS",
            "mps": {
                "activeThreadPercentage": 25,
                "pinnedMemoryLimit": {"default": "10Gi"},
            },
        },
    })
}

/// Environment the mock library and the fake tools need, set by `main` before any thread
/// starts. The node description itself ([`NODE_FILE`]) is written by [`run`], before the
/// library is loaded.
pub fn mock_env(args: &DemoArgs, dir: &Path) -> Vec<(&'static str, String)> {
    let path = |name: &str| dir.join(name).display().to_string();
    vec![
        ("MOCK_NVML_PROFILE", args.profile.clone()),
        ("MOCK_NVML_CONFIG", path(NODE_FILE)),
        ("MOCK_NVML_STATE", path("mock-nvml-state.json")),
        (cleave_fakes::mps_control::ENV_RECORD, path(MPS_RECORD)),
        (
            cleave_fakes::mps_control::ENV_IDLE_EXIT_SECS,
            FAKE_DAEMON_IDLE_EXIT_SECS.to_owned(),
        ),
        (cleave_fakes::nvidia_smi::ENV_RECORD, path(SMI_RECORD)),
        (cleave_fakes::nvidia_smi::ENV_STATE, path(SMI_STATE)),
    ]
}

/// The mock node description in the demo directory.
const NODE_FILE: &str = "node.yaml";
/// What the fake `nvidia-cuda-mps-control` was told (daemon starts, commands, exits).
const MPS_RECORD: &str = "fake-mps-record.log";
/// What the fake `nvidia-smi` was told.
const SMI_RECORD: &str = "fake-nvidia-smi-record.log";
/// The settings the fake `nvidia-smi` left on each GPU.
const SMI_STATE: &str = "fake-nvidia-smi-state";

/// The demo node as a mock NVML YAML: the profile's GPUs, MIG enabled on all but the last
/// [`PLAIN_GPUS`]. `h100-80gb-x8` -> product `h100-80gb`, 8 GPUs.
fn node_yaml(profile: &str) -> anyhow::Result<String> {
    let (product, count) = profile
        .rsplit_once("-x")
        .and_then(|(p, n)| Some((p, n.parse::<u32>().ok()?)))
        .with_context(|| format!("profile {profile:?} is not <product>-x<count>"))?;
    ensure!(
        count > PLAIN_GPUS,
        "profile {profile:?}: the demo needs more than {PLAIN_GPUS} GPUs"
    );
    Ok(format!(
        "name: demo-{profile}\ngpus:\n  - product: {product}\n    count: {}\n    migEnabled: true\n  - product: {product}\n    count: {PLAIN_GPUS}\n    migEnabled: false\n",
        count - PLAIN_GPUS
    ))
}

/// PIDs of the MPS daemons the fake tool started, from its record.
fn started_daemons(record: &Path) -> Vec<(u32, String)> {
    std::fs::read_to_string(record)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("start pid=")?;
            let (pid, rest) = rest.split_once(' ')?;
            let pipe = rest.strip_prefix("pipe=")?.split(' ').next()?;
            Some((pid.parse().ok()?, pipe.to_owned()))
        })
        .collect()
}

/// Running and not a zombie.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let state = s.rsplit_once(')')?.1.split_whitespace().next()?.to_owned();
            Some(state != "Z" && state != "X")
        })
        .unwrap_or(false)
}

/// Waits (bounded) until `pid` is gone.
async fn wait_gone(pid: u32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while alive(pid) {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// Kills every MPS daemon the fake tool started that still runs, when dropped: the demo
/// leaves no process behind, whichever step failed or returned early.
struct Reaper {
    record: PathBuf,
}

impl Drop for Reaper {
    fn drop(&mut self) {
        for (pid, _) in started_daemons(&self.record) {
            if alive(pid) {
                eprintln!("demo: killing MPS daemon {pid} left by a failed step");
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
    }
}

struct Tour {
    started: Instant,
    step: usize,
    steps: usize,
    failures: usize,
}

impl Tour {
    fn heading(&mut self, what: &str) {
        self.step += 1;
        println!("\n[{}/{}] {what}", self.step, self.steps);
    }

    fn check(&mut self, ok: bool, what: &str) {
        if ok {
            println!("  ok    {what}");
        } else {
            self.failures += 1;
            println!("  FAIL  {what}");
        }
    }
}

/// Runs the demo in `dir` (a fresh temporary directory) with the mock library `nvml_lib`.
pub async fn run(args: &DemoArgs, dir: &Path, nvml_lib: PathBuf) -> anyhow::Result<ExitCode> {
    let mut tour = Tour {
        started: Instant::now(),
        step: 0,
        steps: 6,
        failures: 0,
    };
    let reaper = Reaper {
        record: dir.join(MPS_RECORD),
    };
    std::fs::write(dir.join(NODE_FILE), node_yaml(&args.profile)?)
        .context("writing the mock node description")?;
    println!(
        "cleave demo: mock node {:?} (MIG on, off on the last {PLAIN_GPUS} GPUs), on-demand MIG, \
         MPS, in-process API server stand-in",
        args.profile,
    );
    println!("  working directory {}", dir.display());

    // 1. Cluster and plugin.
    tour.heading("Start the API server stand-in and the plugin");
    let standin = StandIn::start(StandInOptions::default())
        .await
        .context("starting the API server stand-in")?;
    standin
        .put(&fixtures::node(NODE))
        .context("creating the Node")?;
    let run_args = RunArgs {
        node_name: NODE.to_owned(),
        kubelet: KubeletArgs {
            driver_name: cleave_api::names::DRIVER_NAME.to_owned(),
            kubelet_registrar_directory_path: dir.join("plugins_registry"),
            kubelet_plugins_directory_path: dir.join("plugins"),
            pod_uid: None,
        },
        driver: DriverArgs {
            cdi_root: dir.join("cdi"),
            driver_root: dir.join("driver-root"),
            dynamic_mig: true,
            consumable_capacity: cleave_api::pool::ConsumableCapacity::Off,
            share_on_demand_mig: false,
            host_driver_root: None,
            mps_control_bin: None,
            nvidia_smi_bin: None,
            // This binary, which is also the hook (main.rs): a fresh `cargo run -p cleave-demo`
            // builds no `cleave-cdi-hook` beside it.
            cdi_hook_source: Some(
                std::env::current_exe().context("finding the demo binary (the demo's CDI hook)")?,
            ),
            disable_cdi_hooks: false,
        },
        nvml: NvmlArgs {
            nvml_lib: Some(nvml_lib),
            mock_profile: Some(args.profile.clone()),
            mock: None,
            sysfs_root: cleave_driver::nvml::DEFAULT_SYSFS_ROOT.into(),
        },
        lifecycle: Default::default(),
        // MPS pipe directories in the run's own directory, not the host's /run/cleave.
        mps: cleave_kubelet_plugin::args::MpsArgs {
            mps_pipe_root: dir.join("run"),
            ..Default::default()
        },
        usage: Default::default(),
        kubeconfig: None,
        metrics_addr: None,
        metrics: Default::default(),
        health: Default::default(),
        claim_info: Default::default(),
        uninstall: false,
    };
    fake_driver_root(&run_args.driver.driver_root)?;
    println!(
        "  driver root          {} (device nodes, libraries, nvidia-caps major {CAPS_MAJOR}, \
         fake nvidia-smi and nvidia-cuda-mps-control)",
        run_args.driver.driver_root.display()
    );
    let t = Instant::now();
    let plugin = cleave_kubelet_plugin::start(&run_args, standin.client()).await?;
    let reg_socket = plugin.server.registration_socket().to_owned();
    let dra_socket = plugin.server.dra_socket().to_owned();
    println!("  registration socket  {}", reg_socket.display());
    println!("  DRA socket           {}", dra_socket.display());

    // The kubelet's side of registration.
    let mut reg =
        cleave_kubelet_plugin::proto::registration::registration_client::RegistrationClient::new(
            connect_unix(&reg_socket).await?,
        );
    let info = reg.get_info(InfoRequest {}).await?.into_inner();
    println!(
        "  GetInfo              {} {:?} at {} ({})",
        info.r#type,
        info.name,
        info.endpoint,
        info.supported_versions.join(", ")
    );
    reg.notify_registration_status(RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await?;
    tour.check(
        info.endpoint == dra_socket.display().to_string(),
        &format!("registered in {} ms", t.elapsed().as_millis()),
    );

    // 2. Slices.
    tour.heading("Publish the node's devices as ResourceSlices");
    let status = plugin
        .publisher
        .wait_published(Duration::from_secs(10))
        .await
        .context("waiting for ResourceSlices")?;
    let slices: Vec<ResourceSlice> = standin.list_as("resourceslices");
    let inventory = plugin.driver.inventory();
    let mig_modes: BTreeMap<String, &str> = inventory
        .gpus
        .iter()
        .map(|g| {
            let mode = match g.mig {
                MigState::NotCapable => "-",
                MigState::Disabled { .. } => "off",
                _ => "on",
            };
            (format!("gpu-{}", g.minor), mode)
        })
        .collect();
    print!("{}", slice_table(&slices, &mig_modes));
    let devices: usize = slices
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    tour.check(
        status.published
            && devices > 0
            && standin
                .validate_pools(cleave_api::names::DRIVER_NAME, None)
                .is_ok(),
        &format!(
            "{} slices, {devices} devices, generation {}, accepted by the stand-in's validation",
            slices.len(),
            status.generation
        ),
    );
    let gpu1 = inventory
        .gpus
        .iter()
        .find(|g| g.minor == 1)
        .context("the mock node has no GPU with minor 1")?
        .uuid
        .clone();

    // 3. Prepare.
    tour.heading("Prepare four claims over gRPC, as the kubelet does before a pod starts");
    for e in &EXAMPLES {
        let configs = if e.mps {
            vec![fixtures::opaque_config(
                "FromClaim",
                &[],
                cleave_api::names::DRIVER_NAME,
                mps_config(),
            )]
        } else {
            Vec::new()
        };
        let claim = fixtures::resource_claim(
            NAMESPACE,
            e.name,
            e.uid,
            cleave_api::names::DRIVER_NAME,
            NODE,
            &[(e.request, e.device)],
            &configs,
        );
        standin.put(&claim)?;
    }
    println!("  default/mps-shared carries: {}", mps_config()["sharing"]);
    let mut dra = v1::dra_plugin_client::DraPluginClient::new(connect_unix(&dra_socket).await?);
    let claims: Vec<v1::Claim> = EXAMPLES
        .iter()
        .map(|e| v1::Claim {
            namespace: NAMESPACE.to_owned(),
            name: e.name.to_owned(),
            uid: e.uid.to_owned(),
        })
        .collect();
    let t = Instant::now();
    let prepared = dra
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: claims.clone(),
        })
        .await?
        .into_inner();
    let elapsed = t.elapsed();
    for e in &EXAMPLES {
        match prepared.claims.get(e.uid) {
            Some(r) if r.error.is_empty() => {
                let ids: Vec<&str> = r
                    .devices
                    .iter()
                    .flat_map(|d| d.cdi_device_ids.iter().map(String::as_str))
                    .collect();
                tour.check(
                    r.devices.len() == 1 && r.devices[0].device_name == e.device,
                    &format!(
                        "{NAMESPACE}/{} ({}): {} -> {}",
                        e.name,
                        e.title,
                        e.device,
                        ids.join(", ")
                    ),
                );
            }
            Some(r) => tour.check(false, &format!("{NAMESPACE}/{}: {}", e.name, r.error)),
            None => tour.check(false, &format!("{NAMESPACE}/{}: no answer", e.name)),
        }
    }
    let mut on_gpu1 = 0;
    for g in &inventory.gpus {
        for m in plugin.backend.list_mig(&g.uuid).unwrap_or_default() {
            on_gpu1 += usize::from(g.uuid == gpu1);
            println!(
                "  MIG device on GPU {}: {} {} (GPU instance {}, compute instance {}, slices {}-{})",
                g.minor,
                m.profile_name,
                m.uuid,
                m.gi_id,
                m.ci_id,
                m.placement.start,
                m.placement.start + m.placement.size - 1
            );
        }
    }
    tour.check(
        on_gpu1 == 2,
        &format!(
            "{} claims prepared in {} ms; GPU 1 has the two MIG devices asked for",
            EXAMPLES.len(),
            elapsed.as_millis()
        ),
    );
    let daemons = started_daemons(&reaper.record);
    let told: Vec<String> = std::fs::read_to_string(&reaper.record)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            l.strip_prefix("cmd ")?
                .split_once(' ')
                .map(|(_, c)| c.to_owned())
        })
        .filter(|c| c.starts_with("set_"))
        .collect();
    for (pid, pipe) in &daemons {
        println!("  MPS control daemon pid {pid}, pipe directory {pipe}");
    }
    for c in &told {
        println!("    told: {c}");
    }
    let smi = std::fs::read_to_string(dir.join(SMI_RECORD)).unwrap_or_default();
    for l in smi.lines() {
        println!("  nvidia-smi {l}");
    }
    tour.check(
        daemons.len() == 1
            && daemons.iter().all(|(pid, _)| alive(*pid))
            && told.contains(&"set_default_active_thread_percentage 25".to_owned())
            && told
                .iter()
                .any(|c| c.starts_with("set_default_device_pinned_mem_limit 0 10G")),
        "MPS daemon runs for default/mps-shared with 25% of the SMs and 10G pinned memory",
    );

    // 4. CDI.
    tour.heading("What each container gets (the claims' CDI specs)");
    let cdi_root = run_args.driver.cdi_root.clone();
    let mut common = None;
    let mut all_edits = String::new();
    for e in &EXAMPLES {
        match describe_cdi(&cdi_root, e.uid, &mut common) {
            Ok(text) => {
                println!("  {NAMESPACE}/{}:", e.name);
                print!("{text}");
                all_edits.push_str(&text);
            }
            Err(err) => tour.check(false, &format!("{NAMESPACE}/{}: {err:#}", e.name)),
        }
    }
    let files = cdi_files(&cdi_root);
    tour.check(
        files.len() == EXAMPLES.len(),
        &format!("{} CDI spec files in {}", files.len(), cdi_root.display()),
    );
    let cap_nodes = all_edits.matches("/dev/nvidia-caps/nvidia-cap").count();
    tour.check(
        cap_nodes == 4,
        &format!(
            "the MIG devices get their GPU and compute instance capability nodes ({cap_nodes})"
        ),
    );
    tour.check(
        all_edits.contains("CUDA_MPS_PIPE_DIRECTORY=")
            && all_edits.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25")
            && all_edits.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10G")
            && daemons
                .iter()
                .all(|(_, pipe)| all_edits.contains(&format!("mount {pipe} "))),
        "the MPS claim's containers get the daemon's pipe directory and its limits",
    );

    // 5. Unprepare.
    tour.heading("Unprepare the claims, as the kubelet does after the pods are gone");
    let t = Instant::now();
    let unprepared = dra
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims })
        .await?
        .into_inner();
    let errors: Vec<String> = unprepared
        .claims
        .iter()
        .filter(|(_, r)| !r.error.is_empty())
        .map(|(uid, r)| format!("{uid}: {}", r.error))
        .collect();
    tour.check(
        errors.is_empty() && unprepared.claims.len() == EXAMPLES.len(),
        &if errors.is_empty() {
            format!(
                "{} claims unprepared in {} ms",
                EXAMPLES.len(),
                t.elapsed().as_millis()
            )
        } else {
            errors.join("; ")
        },
    );

    // 6. Nothing left.
    tour.heading("Nothing is left behind");
    let files = cdi_files(&cdi_root);
    tour.check(
        files.is_empty(),
        &format!("CDI spec files: {}", files.len()),
    );
    let recorded = plugin.driver.prepared_claims().len();
    tour.check(
        recorded == 0,
        &format!("claims in the checkpoint: {recorded}"),
    );
    let mut instances = 0;
    for g in &inventory.gpus {
        instances += plugin
            .backend
            .list_mig(&g.uuid)
            .map(|v| v.len())
            .unwrap_or(0);
    }
    tour.check(
        instances == 0,
        &format!("MIG devices on the node: {instances}"),
    );
    for (pid, pipe) in &daemons {
        let gone = wait_gone(*pid, Duration::from_secs(5)).await;
        let pipe_gone = !Path::new(pipe).exists();
        tour.check(
            gone && pipe_gone,
            &format!(
                "MPS daemon {pid}: {}; its pipe directory: {}",
                if gone { "exited" } else { "STILL RUNS" },
                if pipe_gone { "removed" } else { "STILL THERE" }
            ),
        );
    }
    let mps_dir = plugin.driver.config().state_dir.join("mps");
    let mps_left = cdi_files(&mps_dir);
    tour.check(
        mps_left.is_empty(),
        &format!("MPS claim directories: {}", mps_left.len()),
    );
    let modes: Vec<String> = cleave_fakes::nvidia_smi::read_state(&dir.join(SMI_STATE))
        .into_iter()
        .filter(|((_, key), _)| key == "computeMode")
        .map(|((gpu, _), mode)| format!("{gpu} {mode}"))
        .collect();
    tour.check(
        !modes.is_empty() && modes.iter().all(|m| m.ends_with(" DEFAULT")),
        &format!("compute mode back to DEFAULT: {}", modes.join(", ")),
    );

    plugin.shutdown().await?;
    standin.shutdown().await;
    let sockets_gone = !reg_socket.exists() && !dra_socket.exists();
    tour.check(sockets_gone, "plugin stopped; its sockets are removed");

    println!();
    drop(reaper);
    if tour.failures == 0 {
        println!(
            "demo finished in {} ms: all checks passed",
            tour.started.elapsed().as_millis()
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!("demo finished: {} check(s) FAILED", tour.failures);
        Ok(ExitCode::FAILURE)
    }
}

/// `nvidia-caps` major of the simulated node (the fixture's `proc/devices`).
const CAPS_MAJOR: u32 = mock_nvml::driver_root::CAPS_MAJOR;

/// A driver root laid out like an Ubuntu host with the driver installed (character device
/// nodes where this process may create them, else empty files; libraries with their soname
/// links; `proc/devices` with the `nvidia-caps` and `nvidia-uvm` majors;
/// `proc/driver/nvidia-caps/mig-minors`), so the CDI specs show what a real node's would,
/// and the MPS and time-slicing tools as wrappers that run this binary as the fakes of
/// `cleave-fakes`.
fn fake_driver_root(root: &Path) -> anyhow::Result<()> {
    mock_nvml::driver_root::DriverRootFixture::with_minors(0..8)
        .lay_out(root)
        .with_context(|| format!("laying out the simulated driver root {}", root.display()))?;
    cleave_testkit::fake_tools::install_wrappers(&root.join("usr/bin"))
        .context("writing the fake tools' wrappers")?;
    Ok(())
}

/// One row per slice, in GPU order, with the MIG mode of its GPU (from `mig_modes`, keyed
/// by the whole-GPU device name).
fn slice_table(slices: &[ResourceSlice], mig_modes: &BTreeMap<String, &str>) -> String {
    let mut rows: Vec<(u32, [String; 5])> = slices
        .iter()
        .map(|s| {
            let devices = s.spec.devices.as_deref().unwrap_or_default();
            let first = devices.first().map(|d| d.name.as_str()).unwrap_or("-");
            let last = devices.last().map(|d| d.name.as_str()).unwrap_or("-");
            let counters = s
                .spec
                .shared_counters
                .as_deref()
                .unwrap_or_default()
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(",");
            let order = first
                .strip_prefix("gpu-")
                .and_then(|n| n.split('-').next()?.parse().ok())
                .unwrap_or(u32::MAX);
            let mig = mig_modes.get(first).copied().unwrap_or("-");
            (
                order,
                [
                    s.metadata.name.clone().unwrap_or_default(),
                    mig.to_owned(),
                    devices.len().to_string(),
                    if devices.is_empty() {
                        "-".into()
                    } else {
                        format!("{first} .. {last}")
                    },
                    if counters.is_empty() {
                        "-".into()
                    } else {
                        counters
                    },
                ],
            )
        })
        .collect();
    rows.sort();
    let header = ["SLICE", "MIG", "DEVICES", "RANGE", "COUNTER SETS"].map(String::from);
    let mut widths = header.clone().map(|h| h.len());
    for (_, r) in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = String::new();
    for r in std::iter::once(&header).chain(rows.iter().map(|(_, r)| r)) {
        let _ = writeln!(
            out,
            "  {:<w0$}  {:<w1$}  {:>w2$}  {:<w3$}  {}",
            r[0],
            r[1],
            r[2],
            r[3],
            r[4],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2],
            w3 = widths[3]
        );
    }
    out
}

fn cdi_files(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The CDI edits of one claim, readable: each device's nodes, environment and mounts, and
/// the claim-wide edits. The driver's common edits (control nodes, libraries, tools) are
/// listed in full for the first claim (`common` is `None`) and summed up afterwards; what
/// a claim adds beyond them (an MPS pipe directory, its limits) is always listed.
fn describe_cdi(
    root: &Path,
    uid: &str,
    common: &mut Option<Vec<String>>,
) -> anyhow::Result<String> {
    let path = root.join(cleave_driver::cdi::spec_file_name(uid));
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let spec: serde_json::Value = serde_json::from_str(&text)?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "    spec {} (kind {})",
        path.display(),
        spec["kind"].as_str().unwrap_or("?")
    );
    let Some(devices) = spec["devices"].as_array() else {
        bail!("{} has no devices", path.display());
    };
    ensure!(!devices.is_empty(), "{} has no devices", path.display());
    for d in devices {
        let _ = writeln!(out, "    device {}", d["name"].as_str().unwrap_or("?"));
        for line in edit_lines(&d["containerEdits"]) {
            let _ = writeln!(out, "      {line}");
        }
    }
    let lines = edit_lines(&spec["containerEdits"]);
    match common {
        None => {
            let _ = writeln!(out, "    claim-wide edits ({}):", lines.len());
            for line in &lines {
                let _ = writeln!(out, "      {line}");
            }
            *common = Some(lines);
        }
        Some(known) => {
            let (shared, own): (Vec<&String>, Vec<&String>) =
                lines.iter().partition(|l| known.contains(l));
            let _ = writeln!(
                out,
                "    claim-wide edits: the driver's {} as above{}",
                shared.len(),
                if own.is_empty() { "" } else { ", and:" }
            );
            for line in own {
                let _ = writeln!(out, "      {line}");
            }
        }
    }
    Ok(out)
}

/// One line per edit of a CDI `containerEdits` object.
fn edit_lines(edits: &serde_json::Value) -> Vec<String> {
    let list = |k: &str| edits[k].as_array().cloned().unwrap_or_default();
    let mut out = Vec::new();
    for n in list("deviceNodes") {
        let mut line = format!("device node {}", n["path"].as_str().unwrap_or("?"));
        if let (Some(major), Some(minor)) = (n["major"].as_u64(), n["minor"].as_u64()) {
            let _ = write!(line, " (char {major}:{minor})");
        }
        out.push(line);
    }
    for e in list("env") {
        out.push(format!("env {}", e.as_str().unwrap_or("?")));
    }
    for m in list("mounts") {
        out.push(format!(
            "mount {} -> {}",
            m["hostPath"].as_str().unwrap_or("?"),
            m["containerPath"].as_str().unwrap_or("?")
        ));
    }
    for h in list("hooks") {
        // args[0] is the program name; the rest says what the hook does.
        let args: Vec<&str> = h["args"]
            .as_array()
            .map(|a| a.iter().skip(1).filter_map(|v| v.as_str()).collect())
            .unwrap_or_default();
        out.push(format!(
            "hook {} {} {}",
            h["hookName"].as_str().unwrap_or("?"),
            h["path"].as_str().unwrap_or("?"),
            args.join(" ")
        ));
    }
    out
}
