//! `demo`: the whole plugin in one process on a simulated node, as a guided tour.
//!
//! The mock NVML library plays an 8-GPU node, the API server stand-in plays the
//! cluster, and the demo plays the kubelet: it talks to the plugin over its unix sockets
//! exactly as the kubelet would. Every step is checked; any failure makes the exit code
//! non-zero.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use cleave_apiserver_standin::{StandIn, StandInOptions, fixtures};
use k8s_openapi::api::resource::v1::ResourceSlice;

use crate::cli::{DemoArgs, DriverArgs, KubeletArgs, NvmlArgs, RunArgs};
use crate::proto::dra::v1;
use crate::proto::registration::{InfoRequest, RegistrationStatus};
use crate::server::connect_unix;

/// Node (and pool) name of the simulated node.
const NODE: &str = "demo-node";
/// Namespace of the example claims.
const NAMESPACE: &str = "default";

/// One example claim: what a pod would ask for, and the device the scheduler picked.
struct Example {
    title: &'static str,
    name: &'static str,
    uid: &'static str,
    request: &'static str,
    device: &'static str,
}

const EXAMPLES: [Example; 3] = [
    Example {
        title: "a whole GPU",
        name: "whole-gpu",
        uid: "5d2f0c1e-0000-4000-8000-000000000001",
        request: "gpu",
        device: "gpu-0",
    },
    Example {
        title: "an on-demand MIG 1g.10gb",
        name: "mig-small",
        uid: "5d2f0c1e-0000-4000-8000-000000000002",
        request: "mig",
        device: "gpu-1-mig-1g10gb-0",
    },
    Example {
        title: "an on-demand MIG 3g.40gb",
        name: "mig-medium",
        uid: "5d2f0c1e-0000-4000-8000-000000000003",
        request: "mig",
        device: "gpu-1-mig-3g40gb-4",
    },
];

/// Environment the mock library needs, set by `main` before any thread starts.
pub fn mock_env(args: &DemoArgs, dir: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("MOCK_NVML_PROFILE", args.profile.clone()),
        ("MOCK_NVML_MIG", "on".to_owned()),
        (
            "MOCK_NVML_STATE",
            dir.join("mock-nvml-state.json").display().to_string(),
        ),
    ]
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
    println!(
        "cleave demo: mock node {:?} with MIG on, on-demand MIG, in-process API server stand-in",
        args.profile
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
            host_driver_root: None,
            mps_control_bin: None,
            nvidia_smi_bin: None,
        },
        nvml: NvmlArgs {
            nvml_lib: Some(nvml_lib),
            mock_profile: Some(args.profile.clone()),
            mock: None,
        },
        lifecycle: Default::default(),
        kubeconfig: None,
        metrics_addr: None,
        health: Default::default(),
        uninstall: false,
    };
    fake_driver_root(&run_args.driver.driver_root)?;
    let t = Instant::now();
    let plugin = crate::daemon::start(&run_args, standin.client()).await?;
    let reg_socket = plugin.server.registration_socket().to_owned();
    let dra_socket = plugin.server.dra_socket().to_owned();
    println!("  registration socket  {}", reg_socket.display());
    println!("  DRA socket           {}", dra_socket.display());

    // The kubelet's side of registration.
    let mut reg = crate::proto::registration::registration_client::RegistrationClient::new(
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
    print!("{}", slice_table(&slices));
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
    let inventory = plugin.driver.inventory();
    let gpu1 = inventory
        .gpus
        .iter()
        .find(|g| g.minor == 1)
        .context("the mock node has no GPU with minor 1")?
        .uuid
        .clone();

    // 3. Prepare.
    tour.heading("Prepare three claims over gRPC, as the kubelet does before a pod starts");
    for e in &EXAMPLES {
        let claim = fixtures::resource_claim(
            NAMESPACE,
            e.name,
            e.uid,
            cleave_api::names::DRIVER_NAME,
            NODE,
            &[(e.request, e.device)],
            &[],
        );
        standin.put(&claim)?;
    }
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
            "3 claims prepared in {} ms; GPU 1 has the two MIG devices asked for",
            elapsed.as_millis()
        ),
    );

    // 4. CDI.
    tour.heading("What each container gets (the claims' CDI specs)");
    let cdi_root = run_args.driver.cdi_root.clone();
    for (i, e) in EXAMPLES.iter().enumerate() {
        match describe_cdi(&cdi_root, e.uid, i == 0) {
            Ok(text) => {
                println!("  {NAMESPACE}/{}:", e.name);
                print!("{text}");
            }
            Err(err) => tour.check(false, &format!("{NAMESPACE}/{}: {err:#}", e.name)),
        }
    }
    let files = cdi_files(&cdi_root);
    tour.check(
        files.len() == 3,
        &format!("{} CDI spec files in {}", files.len(), cdi_root.display()),
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
        errors.is_empty() && unprepared.claims.len() == 3,
        &if errors.is_empty() {
            format!("3 claims unprepared in {} ms", t.elapsed().as_millis())
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

    plugin.shutdown().await?;
    standin.shutdown().await;
    let sockets_gone = !reg_socket.exists() && !dra_socket.exists();
    tour.check(sockets_gone, "plugin stopped; its sockets are removed");

    println!();
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

/// A driver root that looks like an installed NVIDIA driver (empty files in the right
/// places), so the CDI specs show the device nodes and mounts a real node would get.
fn fake_driver_root(root: &Path) -> anyhow::Result<()> {
    let mut files: Vec<String> = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]
        .iter()
        .map(|n| format!("dev/{n}"))
        .collect();
    files.extend((0..8).map(|i| format!("dev/nvidia{i}")));
    files.extend(
        ["libnvidia-ml.so.570.148.08", "libcuda.so.570.148.08"]
            .iter()
            .map(|l| format!("usr/lib/x86_64-linux-gnu/{l}")),
    );
    files.push("usr/bin/nvidia-smi".to_owned());
    for f in files {
        let path = root.join(f);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, b"")?;
    }
    Ok(())
}

fn slice_table(slices: &[ResourceSlice]) -> String {
    let mut rows: Vec<[String; 4]> = slices
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
            [
                s.metadata.name.clone().unwrap_or_default(),
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
            ]
        })
        .collect();
    rows.sort();
    let header = ["SLICE", "DEVICES", "RANGE", "COUNTER SETS"].map(String::from);
    let mut widths = header.clone().map(|h| h.len());
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = String::new();
    for r in std::iter::once(&header).chain(&rows) {
        let _ = writeln!(
            out,
            "  {:<w0$}  {:>w1$}  {:<w2$}  {}",
            r[0],
            r[1],
            r[2],
            r[3],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2]
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

/// The CDI edits of one claim, readable: devices with their nodes and environment, and
/// how many common edits (driver files) every device of the claim gets.
fn describe_cdi(root: &Path, uid: &str, with_common: bool) -> anyhow::Result<String> {
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
        let edits = &d["containerEdits"];
        for n in edits["deviceNodes"].as_array().into_iter().flatten() {
            let _ = writeln!(
                out,
                "      device node {}",
                n["path"].as_str().unwrap_or("?")
            );
        }
        for e in edits["env"].as_array().into_iter().flatten() {
            let _ = writeln!(out, "      env {}", e.as_str().unwrap_or("?"));
        }
    }
    let common = &spec["containerEdits"];
    let count = |k: &str| common[k].as_array().map_or(0, Vec::len);
    if !with_common {
        let _ = writeln!(
            out,
            "    common edits: the driver's {} device nodes and {} mounts, as above",
            count("deviceNodes"),
            count("mounts")
        );
        return Ok(out);
    }
    let _ = writeln!(
        out,
        "    common edits: {} env, {} device nodes, {} mounts, {} hooks",
        count("env"),
        count("deviceNodes"),
        count("mounts"),
        count("hooks")
    );
    for e in common["env"].as_array().into_iter().flatten() {
        let _ = writeln!(out, "      env {}", e.as_str().unwrap_or("?"));
    }
    for n in common["deviceNodes"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "      device node {}",
            n["path"].as_str().unwrap_or("?")
        );
    }
    for m in common["mounts"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "      mount {}",
            m["containerPath"].as_str().unwrap_or("?")
        );
    }
    Ok(out)
}
