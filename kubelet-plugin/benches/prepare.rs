//! Prepare/unprepare latency of a whole-GPU claim over the DRA socket, against the floor
//! measured in the same run: one claim GET from the API server stand-in plus two durable
//! small-file writes (write, fsync, rename, fsync directory), which is the I/O a whole-GPU
//! prepare cannot avoid (CDI spec + checkpoint).
//!
//! Then the same for an on-demand MIG claim (a 1g.10gb placement created at prepare and
//! destroyed at unprepare, `--dynamic-mig` on MIG-enabled GPUs): its floor is the same
//! claim GET and two durable writes plus the mock's NVML time for creating the instance,
//! measured inside the same prepare (the driver's `mig_create` step). `MIG_LATENCY_MS`
//! gives GPU- and compute-instance creation that much extra latency each (the mock's
//! `delay` control lines; default 0, the mock's own speed).
//!
//! Run: `cargo bench -p cleave-kubelet-plugin --bench prepare` (ITERATIONS env to change
//! the sample count). Prints p50/p99 and the ratios; asserts nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::io::Write as _;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cleave_apiserver_standin::{StandIn, StandInOptions, fixtures};
use cleave_kubelet_plugin::args::{DriverArgs, KubeletArgs, NvmlArgs, RunArgs};
use cleave_kubelet_plugin::proto::dra::v1;
use k8s_openapi::api::resource::v1::ResourceClaim;

const NODE: &str = "bench-node";
const MIG_NODE: &str = "bench-mig-node";

/// Durations of the driver's `mig_create` steps since the last take.
static MIG_CREATES: Mutex<Vec<Duration>> = Mutex::new(Vec::new());

fn take_mig_creates() -> Duration {
    std::mem::take(&mut *MIG_CREATES.lock().unwrap())
        .into_iter()
        .sum()
}

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let idx = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[idx]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn durable_write(dir: &Path, name: &str, bytes: &[u8]) {
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = std::fs::File::create(&tmp).unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
    std::fs::File::open(dir).unwrap().sync_all().unwrap();
}

/// Sizes of what the prepare of `uid` wrote durably: its CDI spec and the checkpoint
/// (read while the claim is prepared, outside the timed part).
fn written_sizes(args: &RunArgs, uid: &str) -> (usize, usize) {
    let spec = args
        .driver
        .cdi_root
        .join(cleave_driver::cdi::spec_file_name(uid));
    let checkpoint = args
        .kubelet
        .kubelet_plugins_directory_path
        .join(&args.kubelet.driver_name)
        .join(cleave_driver::checkpoint::CHECKPOINT_FILE);
    let len = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len() as usize);
    (len(&spec), len(&checkpoint))
}

/// The floor of one prepare: the claim GET and two durable writes of the sizes the prepare
/// wrote (`sizes`, see [`written_sizes`]). Returns the time and the claim's body (for
/// further writes of the same kind).
async fn floor_once(
    client: &kube::Client,
    name: &str,
    floor_dir: &Path,
    sizes: (usize, usize),
) -> (Duration, Vec<u8>) {
    let t = Instant::now();
    let api: kube::Api<ResourceClaim> = kube::Api::namespaced(client.clone(), "default");
    let got = api.get(name).await.unwrap();
    let body = serde_json::to_vec(&got.metadata.uid).unwrap();
    let padded = |len: usize| {
        let mut bytes = body.clone();
        bytes.resize(len.max(body.len()), b' ');
        bytes
    };
    durable_write(floor_dir, "spec.json", &padded(sizes.0));
    durable_write(floor_dir, "checkpoint.json", &padded(sizes.1));
    (t.elapsed(), body)
}

fn main() {
    let iterations: usize = std::env::var("ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let lib = cleave_kubelet_plugin::mock::find_library(&std::env::current_exe().unwrap())
        .expect("mock NVML library not built (cargo build -p cleave-mock-nvml)");
    let dir = tempfile::tempdir().unwrap();
    // Single-threaded still: safe to set the mock's environment.
    cleave_kubelet_plugin::mock::set_env("MOCK_NVML_PROFILE", "h100-80gb-x8");
    cleave_kubelet_plugin::mock::set_env("MOCK_NVML_MIG", "off");
    cleave_kubelet_plugin::mock::set_env(
        "MOCK_NVML_STATE",
        &dir.path().join("mock.json").display().to_string(),
    );
    let control = dir.path().join("mock-control");
    std::fs::write(&control, "").unwrap();
    cleave_kubelet_plugin::mock::set_env("MOCK_NVML_CONTROL", &control.display().to_string());
    cleave_driver::timing::set_observer(Box::new(|step, elapsed| {
        if step == cleave_driver::timing::step::MIG_CREATE {
            MIG_CREATES.lock().unwrap().push(elapsed);
        }
    }));
    cleave_kubelet_plugin::install_crypto_provider();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(bench(iterations, dir.path(), lib));
}

async fn bench(iterations: usize, dir: &Path, lib: std::path::PathBuf) {
    let standin = StandIn::start(StandInOptions::default()).await.unwrap();
    standin.put(&fixtures::node(NODE)).unwrap();
    let args = RunArgs {
        node_name: NODE.into(),
        kubelet: KubeletArgs {
            driver_name: cleave_api::names::DRIVER_NAME.into(),
            kubelet_registrar_directory_path: dir.join("registry"),
            kubelet_plugins_directory_path: dir.join("plugins"),
            pod_uid: None,
        },
        driver: DriverArgs {
            cdi_root: dir.join("cdi"),
            driver_root: dir.join("driver-root"),
            dynamic_mig: false,
            consumable_capacity: cleave_api::pool::ConsumableCapacity::Off,
            cdi_hook_source: None,
            disable_cdi_hooks: false,
            host_driver_root: None,
            mps_control_bin: None,
            nvidia_smi_bin: None,
        },
        nvml: NvmlArgs {
            nvml_lib: Some(lib),
            mock_profile: None,
            mock: None,
        },
        lifecycle: Default::default(),
        mps: Default::default(),
        kubeconfig: None,
        metrics_addr: None,
        health: Default::default(),
        uninstall: false,
    };
    mock_nvml::driver_root::DriverRootFixture::with_minors(0..8)
        .lay_out(&args.driver.driver_root)
        .unwrap();
    let plugin = cleave_kubelet_plugin::start::start(&args, standin.client())
        .await
        .unwrap();
    let channel = cleave_kubelet_plugin::connect_unix(plugin.server.dra_socket())
        .await
        .unwrap();
    let mut dra = v1::dra_plugin_client::DraPluginClient::new(channel);
    let client = standin.client();
    let floor_dir = dir.join("plugins").join("floor");
    std::fs::create_dir_all(&floor_dir).unwrap();

    let mut prepare = Vec::with_capacity(iterations);
    let mut unprepare = Vec::with_capacity(iterations);
    let mut floor = Vec::with_capacity(iterations);
    let warmup = 10;
    for i in 0..iterations + warmup {
        let uid = format!("00000000-0000-4000-8000-{i:012}");
        let name = format!("claim-{i}");
        let device = format!("gpu-{}", i % 8);
        let claim = fixtures::resource_claim(
            "default",
            &name,
            &uid,
            cleave_api::names::DRIVER_NAME,
            NODE,
            &[("gpu", device.as_str())],
            &[],
        );
        standin.put(&claim).unwrap();
        let request = v1::Claim {
            namespace: "default".into(),
            name: name.clone(),
            uid: uid.clone(),
        };

        let t = Instant::now();
        let resp = dra
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: vec![request.clone()],
            })
            .await
            .unwrap()
            .into_inner();
        let prep = t.elapsed();
        assert_eq!(resp.claims[&uid].error, "", "prepare failed");
        let sizes = written_sizes(&args, &uid);

        let t = Instant::now();
        let resp = dra
            .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                claims: vec![request],
            })
            .await
            .unwrap()
            .into_inner();
        let unprep = t.elapsed();
        assert_eq!(resp.claims[&uid].error, "", "unprepare failed");

        // The floor: claim GET + two durable small-file writes of the sizes prepare wrote.
        let (fl, _) = floor_once(&client, &name, &floor_dir, sizes).await;

        if i >= warmup {
            prepare.push(prep);
            unprepare.push(unprep);
            floor.push(fl);
        }
    }
    plugin.shutdown().await.unwrap();
    let mig = mig_phase(&standin, dir, iterations, &args).await;
    let startup = startup_and_memory(&standin, dir).await;
    standin.shutdown().await;

    let (p50, p99) = (
        percentile(&mut prepare, 0.5),
        percentile(&mut prepare, 0.99),
    );
    let (u50, u99) = (
        percentile(&mut unprepare, 0.5),
        percentile(&mut unprepare, 0.99),
    );
    let (f50, f99) = (percentile(&mut floor, 0.5), percentile(&mut floor, 0.99));
    println!(
        "whole-GPU claim over the DRA socket, {iterations} samples (h100-80gb-x8 mock, stand-in)"
    );
    println!("  {:<44} {:>9} {:>9}", "", "p50 ms", "p99 ms");
    println!(
        "  {:<44} {:>9.3} {:>9.3}",
        "prepare (NodePrepareResources)",
        ms(p50),
        ms(p99)
    );
    println!(
        "  {:<44} {:>9.3} {:>9.3}",
        "unprepare (NodeUnprepareResources)",
        ms(u50),
        ms(u99)
    );
    println!(
        "  {:<44} {:>9.3} {:>9.3}",
        "floor (claim GET + 2 durable writes)",
        ms(f50),
        ms(f99)
    );
    println!(
        "  ratio prepare/floor: p50 {:.2}x, p99 {:.2}x (target: p50 <= 5 ms, p99 <= 1.5x floor)",
        p50.as_secs_f64() / f50.as_secs_f64(),
        p99.as_secs_f64() / f99.as_secs_f64()
    );
    let (m50, m99) = (
        percentile(&mut mig.prepare.clone(), 0.5),
        percentile(&mut mig.prepare.clone(), 0.99),
    );
    let (mu50, mu99) = (
        percentile(&mut mig.unprepare.clone(), 0.5),
        percentile(&mut mig.unprepare.clone(), 0.99),
    );
    let (n50, n99) = (
        percentile(&mut mig.nvml.clone(), 0.5),
        percentile(&mut mig.nvml.clone(), 0.99),
    );
    let (mf50, mf99) = (
        percentile(&mut mig.floor.clone(), 0.5),
        percentile(&mut mig.floor.clone(), 0.99),
    );
    println!(
        "on-demand MIG claim (1g.10gb placement created at prepare) over the DRA socket, {iterations} samples, extra mock latency per GI/CI create {} ms",
        mig.latency_ms
    );
    println!("  {:<44} {:>9} {:>9}", "", "p50 ms", "p99 ms");
    println!(
        "  {:<44} {:>9.3} {:>9.3}",
        "prepare (NodePrepareResources)",
        ms(m50),
        ms(m99)
    );
    println!(
        "  {:<44} {:>9.3} {:>9.3}",
        "unprepare (NodeUnprepareResources)",
        ms(mu50),
        ms(mu99)
    );
    println!(
        "  {:<44} {:>9.3} {:>9.3}",
        "  of prepare: NVML create (mock, mig_create)",
        ms(n50),
        ms(n99)
    );
    println!(
        "  {:<44} {:>9.3} {:>9.3}",
        "floor (claim GET + 2 durable writes + NVML)",
        ms(mf50),
        ms(mf99)
    );
    let (mi50, mi99) = (
        percentile(&mut mig.floor_with_intent.clone(), 0.5),
        percentile(&mut mig.floor_with_intent.clone(), 0.99),
    );
    println!(
        "  {:<44} {:>9.3} {:>9.3}",
        "floor + intent record (3 durable writes)",
        ms(mi50),
        ms(mi99)
    );
    println!(
        "  ratio prepare/floor: p50 {:.2}x, p99 {:.2}x; with the intent write: p50 {:.2}x, p99 {:.2}x (target: the floor plus the NVML calls, nothing more)",
        m50.as_secs_f64() / mf50.as_secs_f64(),
        m99.as_secs_f64() / mf99.as_secs_f64(),
        m50.as_secs_f64() / mi50.as_secs_f64(),
        m99.as_secs_f64() / mi99.as_secs_f64()
    );
    println!("plugin binary (separate process, same mock node and stand-in)");
    println!(
        "  start -> registration socket {:.1} ms, -> first ResourceSlices {:.1} ms (target: 200 ms)",
        ms(startup.registered),
        ms(startup.published)
    );
    println!(
        "  resident memory: {} KiB after start, {} KiB after {} prepare/unprepare cycles (target: 15 MiB)",
        startup.rss_start_kib, startup.rss_after_kib, startup.cycles
    );
    println!(
        "    of which: after start {}, after the cycles {}",
        startup.split_start, startup.split_after
    );
}

struct MigSamples {
    prepare: Vec<Duration>,
    unprepare: Vec<Duration>,
    /// NVML time of each prepare (the driver's `mig_create` step).
    nvml: Vec<Duration>,
    /// Claim GET + two durable writes, measured after each prepare, plus its NVML time.
    floor: Vec<Duration>,
    /// The same plus a third durable write (the intent record).
    floor_with_intent: Vec<Duration>,
    latency_ms: u64,
}

/// On-demand MIG prepare/unprepare over the socket of an in-process plugin: the mock's
/// GPUs are put in MIG mode (`nvmlDeviceSetMigMode`, as `nvidia-smi -mig 1` would, while no
/// plugin runs), and each sample prepares a 1g.10gb placement of one GPU and releases it.
async fn mig_phase(
    standin: &StandIn,
    dir: &Path,
    iterations: usize,
    whole: &RunArgs,
) -> MigSamples {
    {
        let lib =
            cleave_kubelet_plugin::mock::find_library(&std::env::current_exe().unwrap()).unwrap();
        let nvml = nvml_wrapper::Nvml::builder()
            .lib_path(lib.as_os_str())
            .init()
            .unwrap();
        for i in 0..nvml.device_count().unwrap() {
            let gpu = nvml.device_by_index(i).unwrap();
            gpu.set_mig_mode(true).unwrap();
        }
    }
    let latency_ms: u64 = std::env::var("MIG_LATENCY_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if latency_ms > 0 {
        std::fs::write(
            dir.join("mock-control"),
            format!(
                "delay nvmlDeviceCreateGpuInstanceWithPlacement {latency_ms}\ndelay nvmlGpuInstanceCreateComputeInstance {latency_ms}\n"
            ),
        )
        .unwrap();
    }
    standin.put(&fixtures::node(MIG_NODE)).unwrap();
    let root = dir.join("mig");
    let mut args = whole.clone();
    args.node_name = MIG_NODE.into();
    args.kubelet.kubelet_registrar_directory_path = root.join("registry");
    args.kubelet.kubelet_plugins_directory_path = root.join("plugins");
    args.driver.cdi_root = root.join("cdi");
    args.driver.dynamic_mig = true;
    let plugin = cleave_kubelet_plugin::start::start(&args, standin.client())
        .await
        .unwrap();
    let mut dra = v1::dra_plugin_client::DraPluginClient::new(
        cleave_kubelet_plugin::connect_unix(plugin.server.dra_socket())
            .await
            .unwrap(),
    );
    let client = standin.client();
    let floor_dir = root.join("floor");
    std::fs::create_dir_all(&floor_dir).unwrap();
    let mut out = MigSamples {
        prepare: Vec::new(),
        unprepare: Vec::new(),
        nvml: Vec::new(),
        floor: Vec::new(),
        floor_with_intent: Vec::new(),
        latency_ms,
    };
    let warmup = 10;
    for i in 0..iterations + warmup {
        let uid = format!("22222222-0000-4000-8000-{i:012}");
        let name = format!("mig-{i}");
        let device = format!("gpu-{}-mig-1g10gb-{}", i % 8, (i / 8) % 7);
        standin
            .put(&fixtures::resource_claim(
                "default",
                &name,
                &uid,
                cleave_api::names::DRIVER_NAME,
                MIG_NODE,
                &[("mig", device.as_str())],
                &[],
            ))
            .unwrap();
        let request = v1::Claim {
            namespace: "default".into(),
            name: name.clone(),
            uid: uid.clone(),
        };
        take_mig_creates();
        let t = Instant::now();
        let resp = dra
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: vec![request.clone()],
            })
            .await
            .unwrap()
            .into_inner();
        let prep = t.elapsed();
        assert_eq!(resp.claims[&uid].error, "", "MIG prepare failed");
        let sizes = written_sizes(&args, &uid);
        let nvml = take_mig_creates();

        let t = Instant::now();
        let resp = dra
            .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                claims: vec![request],
            })
            .await
            .unwrap()
            .into_inner();
        let unprep = t.elapsed();
        assert_eq!(resp.claims[&uid].error, "", "MIG unprepare failed");

        let (fl, body) = floor_once(&client, &name, &floor_dir, sizes).await;
        let fl = fl + nvml;
        // The third durable write an on-demand prepare cannot avoid either: the intent
        // record (PrepareStarted) before the instance exists.
        let t = Instant::now();
        durable_write(
            &floor_dir,
            "intent.json",
            &[&body[..], &[b' '; 800]].concat(),
        );
        let fl3 = fl + t.elapsed();
        if i >= warmup {
            out.prepare.push(prep);
            out.unprepare.push(unprep);
            out.nvml.push(nvml);
            out.floor.push(fl);
            out.floor_with_intent.push(fl3);
        }
    }
    plugin.shutdown().await.unwrap();
    out
}

struct Startup {
    registered: Duration,
    published: Duration,
    rss_start_kib: u64,
    rss_after_kib: u64,
    split_start: String,
    split_after: String,
    cycles: usize,
}

/// Where the resident memory is: heap and stacks (anonymous) vs mapped files (the binary,
/// the NVML library), and the thread count, from `/proc/<pid>/status`.
fn rss_split(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_owned())
            .unwrap_or_default()
    };
    // Resident pages per mapped file, largest first.
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let mut per_file: std::collections::BTreeMap<String, u64> = Default::default();
    let mut current = String::new();
    for line in smaps.lines() {
        if let Some(kib) = line.strip_prefix("Rss:") {
            let kib: u64 = kib
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(0);
            if current.starts_with('/') {
                *per_file.entry(current.clone()).or_default() += kib;
            }
        } else if line
            .split_whitespace()
            .next()
            .is_some_and(|f| f.contains('-'))
        {
            current = line
                .split_whitespace()
                .nth(5)
                .unwrap_or_default()
                .to_owned();
        }
    }
    let mut files: Vec<(String, u64)> = per_file.into_iter().collect();
    files.sort_by_key(|(_, kib)| std::cmp::Reverse(*kib));
    let top: Vec<String> = files
        .iter()
        .take(3)
        .map(|(f, kib)| {
            let name = f.rsplit('/').next().unwrap_or(f);
            format!("{name} {kib} kB")
        })
        .collect();
    format!(
        "anonymous {}, files {} ({}), threads {}",
        field("RssAnon:"),
        field("RssFile:"),
        top.join(", "),
        field("Threads:")
    )
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Starts the real binary against the same stand-in (another node name) and measures
/// how long registration and the first publish take, and its resident memory.
async fn startup_and_memory(standin: &StandIn, dir: &Path) -> Startup {
    const NODE2: &str = "bench-node-2";
    let root = dir.join("binary");
    mock_nvml::driver_root::DriverRootFixture::with_minors(0..8)
        .lay_out(&root.join("driver-root"))
        .unwrap();
    standin.put(&fixtures::node(NODE2)).unwrap();
    let kubeconfig = root.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: s\n  cluster:\n    server: {}\nusers:\n- name: u\n  user: {{}}\ncontexts:\n- name: c\n  context:\n    cluster: s\n    user: u\ncurrent-context: c\n",
            standin.url()
        ),
    )
    .unwrap();
    let lib = cleave_kubelet_plugin::mock::find_library(&std::env::current_exe().unwrap()).unwrap();
    let reg = root.join("registry").join("gpu.cleave.dev-reg.sock");
    let dra_sock = root.join("plugins").join("gpu.cleave.dev").join("dra.sock");
    let started = Instant::now();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .arg("run")
        .env_clear()
        .env("NODE_NAME", NODE2)
        .env("KUBECONFIG", &kubeconfig)
        .env("NVML_LIB", &lib)
        .env("MOCK_NVML_PROFILE", "h100-80gb-x8")
        .env("MOCK_NVML_MIG", "off")
        .env("MOCK_NVML_STATE", root.join("mock.json"))
        .env("KUBELET_REGISTRAR_DIRECTORY_PATH", root.join("registry"))
        .env("KUBELET_PLUGINS_DIRECTORY_PATH", root.join("plugins"))
        .env("CDI_ROOT", root.join("cdi"))
        .env("NVIDIA_DRIVER_ROOT", root.join("driver-root"))
        .env("RUST_LOG", "warn")
        .spawn()
        .unwrap();
    let mut registered = None;
    let mut published = None;
    while published.is_none() || registered.is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "plugin did not start"
        );
        if registered.is_none() && reg.exists() {
            registered = Some(started.elapsed());
        }
        if published.is_none()
            && standin
                .list_as::<k8s_openapi::api::resource::v1::ResourceSlice>("resourceslices")
                .iter()
                .any(|s| s.spec.node_name.as_deref() == Some(NODE2))
        {
            published = Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
    let pid = child.id();
    let rss_start_kib = rss_kib(pid);
    let split_start = rss_split(pid);
    let mut dra = v1::dra_plugin_client::DraPluginClient::new(
        cleave_kubelet_plugin::connect_unix(&dra_sock)
            .await
            .unwrap(),
    );
    let cycles = 100;
    for i in 0..cycles {
        let uid = format!("11111111-0000-4000-8000-{i:012}");
        let name = format!("mem-{i}");
        let device = format!("gpu-{}", i % 8);
        standin
            .put(&fixtures::resource_claim(
                "default",
                &name,
                &uid,
                cleave_api::names::DRIVER_NAME,
                NODE2,
                &[("gpu", device.as_str())],
                &[],
            ))
            .unwrap();
        let c = v1::Claim {
            namespace: "default".into(),
            name,
            uid: uid.clone(),
        };
        let r = dra
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: vec![c.clone()],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.claims[&uid].error, "");
        dra.node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims: vec![c] })
            .await
            .unwrap();
    }
    let rss_after_kib = rss_kib(pid);
    let split_after = rss_split(pid);
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let _ = child.wait();
    Startup {
        registered: registered.unwrap_or_default(),
        published: published.unwrap_or_default(),
        rss_start_kib,
        rss_after_kib,
        split_start,
        split_after,
        cycles,
    }
}
