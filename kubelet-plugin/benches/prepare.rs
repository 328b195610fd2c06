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
//! Then the cost of per-claim usage sampling (in a child process of its own, on a mock
//! node of 8 MIG-enabled H100s with 7 1g.10gb instances each and one whole H100): whole-GPU
//! prepare p50/p99 with sampling off and with the 56 MIG devices sampled every 100 ms in
//! the background over the plugin's own NVML handle, in the same run; the cost of one
//! sampling round and of one `/metrics` encoding (a scrape) with those 56 claim devices;
//! and the process's resident memory before and after sampling.
//!
//! Then whole-GPU prepare p50/p99 with the claim status writer off and on, in the same run,
//! and how long after the answer the claim's `status.devices` entry is stored.
//!
//! Then the plugin binary as a separate process: start-up, 100 whole-GPU cycles over its
//! socket and its resident memory. `BASELINE_PLUGIN=<another build's
//! target/release/cleave-kubelet-plugin>` runs that build too, alternating with this one
//! for three rounds (`BINARY_ROUNDS`), and prints this build's ratios to it.
//!
//! Run: `cargo bench -p cleave-kubelet-plugin --bench prepare` (`PHASES=whole,usage` to run
//! some phases only, for a profile; ITERATIONS env to change
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

/// Whether the phase `name` runs: `PHASES` lists them (`whole` always runs; `status`,
/// `mig`, `binary`, `usage`), all when unset.
fn phase(name: &str) -> bool {
    std::env::var("PHASES").map_or(true, |v| v.split(',').any(|p| p.trim() == name))
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
    if std::env::var_os(USAGE_CHILD).is_some() {
        usage_child(iterations);
        return;
    }
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

/// The plugin's flags for a bench node in `dir`: mock NVML from `lib`, whole GPUs only,
/// usage sampling off.
fn run_args(node: &str, dir: &Path, lib: std::path::PathBuf) -> RunArgs {
    RunArgs {
        node_name: node.into(),
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
            share_on_demand_mig: false,
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
            sysfs_root: cleave_driver::nvml::DEFAULT_SYSFS_ROOT.into(),
        },
        lifecycle: Default::default(),
        // MPS pipe directories in the run's own directory, not the host's /run/cleave.
        mps: cleave_kubelet_plugin::args::MpsArgs {
            mps_pipe_root: dir.join("run"),
            ..Default::default()
        },
        usage: cleave_kubelet_plugin::args::UsageArgs {
            usage_interval: Duration::ZERO,
            ..Default::default()
        },
        kubeconfig: None,
        metrics_addr: None,
        metrics: Default::default(),
        health: Default::default(),
        claim_info: Default::default(),
        uninstall: false,
    }
}

async fn bench(iterations: usize, dir: &Path, lib: std::path::PathBuf) {
    let standin = StandIn::start(StandInOptions::default()).await.unwrap();
    standin.put(&fixtures::node(NODE)).unwrap();
    // Sampling is off: these phases measure prepare alone; the usage phase turns it on.
    let args = run_args(NODE, dir, lib);
    mock_nvml::driver_root::DriverRootFixture::with_minors(0..8)
        .lay_out(&args.driver.driver_root)
        .unwrap();
    let plugin = cleave_kubelet_plugin::start(&args, standin.client())
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
    let status = if phase("status") {
        Some(
            status_phase(
                &standin,
                dir,
                iterations,
                &args.nvml.nvml_lib.clone().unwrap(),
            )
            .await,
        )
    } else {
        None
    };
    let mig = if phase("mig") {
        Some(mig_phase(&standin, dir, iterations, &args).await)
    } else {
        None
    };
    let binaries = if phase("binary") {
        Some(binary_rounds(&standin, dir).await)
    } else {
        None
    };
    standin.shutdown().await;
    if phase("usage") {
        let usage_status = std::process::Command::new(std::env::current_exe().unwrap())
            .env(USAGE_CHILD, "1")
            .env("ITERATIONS", iterations.to_string())
            .status()
            .unwrap();
        assert!(usage_status.success(), "usage phase failed");
    }

    let (p50, p99) = (
        percentile(&mut prepare, 0.5),
        percentile(&mut prepare, 0.99),
    );
    let (u50, u99) = (
        percentile(&mut unprepare, 0.5),
        percentile(&mut unprepare, 0.99),
    );
    let (f50, f99) = (percentile(&mut floor, 0.5), percentile(&mut floor, 0.99));
    if let Some((so, son, sa)) = status {
        println!(
            "whole-GPU prepare with claim status writes off and on (--claim-device-status), {iterations} samples each"
        );
        println!("  {:<44} {:>9} {:>9}", "", "p50 ms", "p99 ms");
        for (label, (a, b)) in [
            ("prepare, status writes off", so),
            ("prepare, status writes on", son),
            ("status entry stored, after the answer", sa),
        ] {
            println!("  {label:<44} {:>9.3} {:>9.3}", ms(a), ms(b));
        }
        println!(
            "  ratio on/off: p50 {:.2}x, p99 {:.2}x (the write runs after the answer)",
            ms(son.0) / ms(so.0),
            ms(son.1) / ms(so.1)
        );
    }
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
    if let Some(mig) = mig {
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
    }
    if let Some(runs) = binaries {
        print_binary_rounds(&runs);
    }
}

/// Prints the binary phase: per build, start-up, prepare/unprepare over the socket and
/// resident memory, and with a baseline build the ratios of this build to it.
fn print_binary_rounds(runs: &[(String, Vec<Startup>)]) {
    let rounds = runs.first().map_or(0, |(_, r)| r.len());
    println!(
        "plugin binary (separate process, same mock node and stand-in), {rounds} round(s) alternating {}",
        runs.iter()
            .map(|(label, _)| label.as_str())
            .collect::<Vec<_>>()
            .join(" / ")
    );
    let mut summary = Vec::new();
    for (label, rs) in runs {
        let mut prepare: Vec<Duration> = rs.iter().flat_map(|r| r.prepare.clone()).collect();
        let mut unprepare: Vec<Duration> = rs.iter().flat_map(|r| r.unprepare.clone()).collect();
        let (p50, p99) = (
            percentile(&mut prepare, 0.5),
            percentile(&mut prepare, 0.99),
        );
        let (u50, u99) = (
            percentile(&mut unprepare, 0.5),
            percentile(&mut unprepare, 0.99),
        );
        let rss_after = rs.iter().map(|r| r.rss_after_kib).max().unwrap_or(0);
        let last = rs.last().expect("at least one round");
        println!("  {label}: {}", last.binary.display());
        println!(
            "    start -> registration socket {:.1} ms, -> first ResourceSlices {:.1} ms (target: 200 ms)",
            ms(last.registered),
            ms(last.published)
        );
        println!(
            "    whole-GPU prepare p50 {:.3} ms p99 {:.3} ms, unprepare p50 {:.3} ms p99 {:.3} ms ({} cycles)",
            ms(p50),
            ms(p99),
            ms(u50),
            ms(u99),
            prepare.len()
        );
        println!(
            "    resident memory: {} KiB after start, {} KiB after {} prepare/unprepare cycles (the most of {} rounds; target: 12 MiB = 12288 KiB)",
            last.rss_start_kib,
            rss_after,
            last.cycles,
            rs.len()
        );
        println!(
            "      of which: after start {}, after the cycles {}",
            last.split_start, last.split_after
        );
        println!("    binary file {} KiB", last.binary_kib);
        summary.push((p50, p99, u50, u99, rss_after));
    }
    if let [current, baseline] = summary.as_slice() {
        let r = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
        println!(
            "  this build / baseline: prepare p50 {:.2}x p99 {:.2}x, unprepare p50 {:.2}x p99 {:.2}x, resident memory {:.2}x",
            r(current.0, baseline.0),
            r(current.1, baseline.1),
            r(current.2, baseline.2),
            r(current.3, baseline.3),
            current.4 as f64 / baseline.4.max(1) as f64
        );
    }
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
    let plugin = cleave_kubelet_plugin::start(&args, standin.client())
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
    /// Each cycle's prepare and unprepare over the DRA socket.
    prepare: Vec<Duration>,
    unprepare: Vec<Duration>,
    binary: std::path::PathBuf,
    binary_kib: u64,
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

/// The binary phase: this build's plugin binary, and the build `BASELINE_PLUGIN` names
/// (another commit's `target/release/cleave-kubelet-plugin`, e.g.) when set, alternating for
/// `BINARY_ROUNDS` rounds (default 3 with a baseline, else 1) over the same stand-in.
async fn binary_rounds(standin: &StandIn, dir: &Path) -> Vec<(String, Vec<Startup>)> {
    let current = std::path::PathBuf::from(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"));
    let baseline = std::env::var_os("BASELINE_PLUGIN").map(std::path::PathBuf::from);
    let rounds: usize = std::env::var("BINARY_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if baseline.is_some() { 3 } else { 1 });
    let mut runs = vec![("this build".to_owned(), Vec::new())];
    if baseline.is_some() {
        runs.push(("baseline".to_owned(), Vec::new()));
    }
    let mut n = 0;
    for _ in 0..rounds {
        for (i, bin) in std::iter::once(&current).chain(baseline.iter()).enumerate() {
            n += 1;
            let run = startup_and_memory(standin, dir, bin, n).await;
            runs[i].1.push(run);
        }
    }
    runs
}

/// Starts the plugin binary `bin` against the same stand-in (a node of its own, run `n`)
/// and measures how long registration and the first publish take, 100 whole-GPU
/// prepare/unprepare cycles over its socket, and its resident memory.
async fn startup_and_memory(standin: &StandIn, dir: &Path, bin: &Path, n: usize) -> Startup {
    let node2 = format!("bench-node-bin-{n}");
    let node2 = node2.as_str();
    let root = dir.join(format!("binary-{n}"));
    mock_nvml::driver_root::DriverRootFixture::with_minors(0..8)
        .lay_out(&root.join("driver-root"))
        .unwrap();
    standin.put(&fixtures::node(node2)).unwrap();
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
    let mut child = std::process::Command::new(bin)
        .arg("run")
        .env_clear()
        .env("NODE_NAME", node2)
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
                .any(|s| s.spec.node_name.as_deref() == Some(node2))
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
    let mut prepare = Vec::with_capacity(cycles);
    let mut unprepare = Vec::with_capacity(cycles);
    for i in 0..cycles {
        let uid = format!("11111111-0000-4000-{n:04}-{i:012}");
        let name = format!("mem-{i}");
        let device = format!("gpu-{}", i % 8);
        standin
            .put(&fixtures::resource_claim(
                "default",
                &name,
                &uid,
                cleave_api::names::DRIVER_NAME,
                node2,
                &[("gpu", device.as_str())],
                &[],
            ))
            .unwrap();
        let c = v1::Claim {
            namespace: "default".into(),
            name,
            uid: uid.clone(),
        };
        let t = Instant::now();
        let r = dra
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: vec![c.clone()],
            })
            .await
            .unwrap()
            .into_inner();
        prepare.push(t.elapsed());
        assert_eq!(r.claims[&uid].error, "");
        let t = Instant::now();
        dra.node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims: vec![c] })
            .await
            .unwrap();
        unprepare.push(t.elapsed());
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
        prepare,
        unprepare,
        binary: bin.to_path_buf(),
        binary_kib: std::fs::metadata(bin).map_or(0, |m| m.len() / 1024),
    }
}

/// Set in the child process that measures usage sampling (the mock reads its node at
/// `nvmlInit`, so another node needs another process).
const USAGE_CHILD: &str = "CLEAVE_PREPARE_BENCH_USAGE_CHILD";
const USAGE_NODE: &str = "bench-usage-node";

/// Capacity shares the attribution part samples.
const SHARES_SAMPLED: usize = 50;

/// 8 MIG-enabled H100s (sampled) and one whole H100 (prepared).
const USAGE_MOCK: &str = "name: bench-usage\ngpus:\n  - product: h100-80gb\n    count: 8\n    migEnabled: true\n  - product: h100-80gb\n    migEnabled: false\n";

/// The sampled claim devices: fixed, whatever is prepared (as if 56 MIG claims were).
struct Fixed {
    devices: Vec<cleave_driver::usage::ClaimDevice>,
    gpus: Vec<(String, u64, Option<u32>)>,
    inventory: cleave_driver::model::NodeInventory,
}

impl cleave_kubelet_plugin::usage::ClaimDevices for Fixed {
    fn claim_devices(&self) -> Vec<cleave_driver::usage::ClaimDevice> {
        self.devices.clone()
    }
    fn gpus(&self) -> Vec<(String, u64, Option<u32>)> {
        self.gpus.clone()
    }
    fn inventory(&self) -> Option<cleave_driver::model::NodeInventory> {
        Some(self.inventory.clone())
    }
}

/// CPU time of the calling thread.
#[allow(unsafe_code)]
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn own_rss_kib() -> u64 {
    rss_kib(std::process::id())
}

fn usage_child(iterations: usize) {
    use cleave_driver::backend::GpuBackend as _;
    use cleave_driver::usage::{Allocation, ClaimDevice, ClaimRef, Holding, MigRef};
    let dir = tempfile::tempdir().unwrap();
    let lib = cleave_kubelet_plugin::mock::find_library(&std::env::current_exe().unwrap())
        .expect("mock NVML library not built");
    let config = dir.path().join("mock.yaml");
    std::fs::write(&config, USAGE_MOCK).unwrap();
    let control = dir.path().join("mock-control");
    // Single-threaded still.
    cleave_kubelet_plugin::mock::set_env("MOCK_NVML_CONFIG", &config.display().to_string());
    cleave_kubelet_plugin::mock::set_env("MOCK_NVML_PROFILE", "");
    cleave_kubelet_plugin::mock::set_env("MOCK_NVML_MIG", "");
    cleave_kubelet_plugin::mock::set_env(
        "MOCK_NVML_STATE",
        &dir.path().join("mock.json").display().to_string(),
    );
    cleave_kubelet_plugin::mock::set_env("MOCK_NVML_CONTROL", &control.display().to_string());
    // The 56 instances, created as an administrator would before the plugin starts.
    let mut devices = Vec::new();
    let mut script = String::new();
    let mut gpus = Vec::new();
    {
        let backend = cleave_driver::nvml::NvmlBackend::open(Some(&lib)).unwrap();
        let inv = backend.inventory().unwrap();
        for (g, gpu) in inv.gpus.iter().enumerate() {
            gpus.push((gpu.uuid.clone(), gpu.memory_bytes, gpu.multiprocessors));
            if !gpu.mig.is_enabled() {
                continue;
            }
            for start in 0..7u32 {
                let mig = backend
                    .create_mig(
                        &gpu.uuid,
                        19,
                        cleave_driver::model::Placement { start, size: 1 },
                    )
                    .unwrap();
                script.push_str(&format!(
                    "memory {g} {gi} 0 {mib}\ngpm {g} {gi} {act} 3\n",
                    gi = mig.gi_id,
                    mib = 512 + start * 100,
                    act = 5 + start * 10,
                ));
                devices.push(ClaimDevice {
                    claim: ClaimRef {
                        uid: format!("uid-{g}-{start}"),
                        namespace: format!("team-{}", start % 3),
                        name: format!("claim-{g}-{start}"),
                    },
                    device: format!("gpu-{g}-mig-1g10gb-{start}"),
                    kind: Holding::Mig,
                    sharing: None,
                    share_id: None,
                    gpu_uuid: gpu.uuid.clone(),
                    mig: Some(MigRef {
                        uuid: mig.uuid.clone(),
                        gi: mig.gi_id,
                        ci: mig.ci_id,
                    }),
                    allocated: Allocation {
                        memory_bytes: 9984 << 20,
                        sms: Some(16),
                        mig_profile: Some("1g.10gb".into()),
                    },
                    pids: Vec::new(),
                    pods: Vec::new(),
                });
            }
        }
    }
    // 50 capacity shares on the whole H100, each with one MPS client in a pod of its own
    // (a cgroup file under a process tree of the bench's, as a node with the systemd cgroup
    // driver has it): what attribution reads each round.
    let whole_index = gpus.len() - 1;
    let share_proc = dir.path().join("proc");
    let shares: Vec<ClaimDevice> = (0..SHARES_SAMPLED)
        .map(|n| {
            let pid = 50_000 + n as u32;
            let pod = format!("5e000000-0000-4000-8000-{n:012}");
            let cgroup = share_proc.join(pid.to_string());
            std::fs::create_dir_all(&cgroup).unwrap();
            std::fs::write(
                cgroup.join("cgroup"),
                format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{pid:064x}.scope\n",
                    pod.replace('-', "_")
                ),
            )
            .unwrap();
            script.push_str(&format!(
                "process {whole_index} {pid} {} {} mps\n",
                256 + n * 10,
                n % 40
            ));
            ClaimDevice {
                claim: ClaimRef {
                    uid: format!("uid-share-{n}"),
                    namespace: format!("team-{}", n % 5),
                    name: format!("share-{n}"),
                },
                device: format!("gpu-{whole_index}"),
                kind: Holding::Share,
                sharing: Some(cleave_driver::usage::SharingStrategy::Mps),
                share_id: Some(format!("5a000000-0000-4000-8000-{n:012}")),
                gpu_uuid: gpus[whole_index].0.clone(),
                mig: None,
                allocated: Allocation {
                    memory_bytes: 1 << 30,
                    sms: Some(2),
                    mig_profile: None,
                },
                pids: Vec::new(),
                pods: vec![pod],
            }
        })
        .collect();
    std::fs::write(&control, script).unwrap();
    let whole = format!("gpu-{}", gpus.len() - 1);
    cleave_kubelet_plugin::install_crypto_provider();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let standin = StandIn::start(StandInOptions::default()).await.unwrap();
        standin.put(&fixtures::node(USAGE_NODE)).unwrap();
        let d = dir.path();
        let args = run_args(USAGE_NODE, d, lib);
        mock_nvml::driver_root::DriverRootFixture::with_minors(0..9)
            .lay_out(&args.driver.driver_root)
            .unwrap();
        let plugin = cleave_kubelet_plugin::start(&args, standin.client())
            .await
            .unwrap();
        let mut dra = v1::dra_plugin_client::DraPluginClient::new(
            cleave_kubelet_plugin::connect_unix(plugin.server.dra_socket())
                .await
                .unwrap(),
        );
        let mut n = 0usize;
        let mut cycle = |dra: &mut v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel>| {
            n += 1;
            let uid = format!("00000000-0000-4000-9000-{n:012}");
            let name = format!("usage-claim-{n}");
            standin
                .put(&fixtures::resource_claim(
                    "default",
                    &name,
                    &uid,
                    cleave_api::names::DRIVER_NAME,
                    USAGE_NODE,
                    &[("gpu", whole.as_str())],
                    &[],
                ))
                .unwrap();
            let request = v1::Claim {
                namespace: "default".into(),
                name,
                uid: uid.clone(),
            };
            let mut dra = dra.clone();
            let standin = &standin;
            async move {
                let t = Instant::now();
                let r = dra
                    .node_prepare_resources(v1::NodePrepareResourcesRequest {
                        claims: vec![request.clone()],
                    })
                    .await
                    .unwrap()
                    .into_inner();
                let took = t.elapsed();
                assert_eq!(r.claims[&uid].error, "", "prepare failed");
                let r = dra
                    .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                        claims: vec![request.clone()],
                    })
                    .await
                    .unwrap()
                    .into_inner();
                assert_eq!(r.claims[&uid].error, "", "unprepare failed");
                // Gone, as after the pod: the bench's resident memory then shows the
                // plugin and the sampler, not a stand-in holding every claim ever made.
                standin.delete("resourceclaims", "default", &request.name);
                took
            }
        };
        for _ in 0..10 {
            cycle(&mut dra).await;
        }
        // One round and one scrape, measured alone.
        let metrics = std::sync::Arc::new(cleave_kubelet_plugin::Metrics::new());
        let source = plugin.backend.usage_source().unwrap();
        let mut rounds = cleave_kubelet_plugin::usage::UsageRounds::new(
            source,
            cleave_driver::usage::IdlePolicy::default(),
        );
        let rss_before = own_rss_kib();
        let mut round_times = Vec::new();
        let mut scrape_times = Vec::new();
        let mut scrape_bytes = 0;
        for i in 0..21 {
            let now = Instant::now();
            let r = rounds.round(&devices, now);
            metrics.usage.apply_round(USAGE_NODE, &r, &gpus,
                now,
                std::time::SystemTime::now(),
            );
            if i > 0 {
                round_times.push(now.elapsed());
            }
            let t = Instant::now();
            scrape_bytes = metrics.encode().len();
            scrape_times.push(t.elapsed());
        }
        drop(rounds);
        // Usage windows on: thread CPU time per round with and without them, and the
        // memory of the 56 windows after a scripted day (144 rounds 10 minutes apart).
        let inventory = plugin.driver.inventory();
        let rightsize = cleave_kubelet_plugin::usage::RightsizeConfig {
            window: cleave_driver::rightsize::WindowConfig::default(),
            policy: cleave_driver::rightsize::RightsizePolicy::default(),
            modes: cleave_driver::rightsize::NodeModes {
                dynamic_mig: true,
                consumable_capacity: Default::default(),
            },
        };
        let cpu_per_round = |windows: bool| {
            let mut rounds = cleave_kubelet_plugin::usage::UsageRounds::new(
                plugin.backend.usage_source().unwrap(),
                cleave_driver::usage::IdlePolicy::default(),
            );
            if windows {
                rounds = rounds.with_rightsizer(
                    cleave_kubelet_plugin::usage::Rightsizer::in_memory(rightsize),
                );
            }
            let day_ago = std::time::SystemTime::now() - Duration::from_secs(144 * 600);
            let mut cpu = Vec::new();
            for i in 0..144u64 {
                let t = thread_cpu();
                let r = rounds.round_with(
                    &devices,
                    Instant::now(),
                    day_ago + Duration::from_secs(i * 600),
                    Some(&inventory),
                );
                if let Some(rs) = &r.rightsize {
                    metrics.rightsize.apply(USAGE_NODE, rs);
                }
                if i > 0 {
                    cpu.push(thread_cpu() - t);
                }
            }
            let bytes = rounds
                .rightsizer()
                .map_or(0, |r| r.store().heap_bytes() / devices.len().max(1));
            (cpu, bytes)
        };
        let (mut cpu_off, _) = cpu_per_round(false);
        let (mut cpu_on, window_bytes) = cpu_per_round(true);
        // Prepare with the 56 devices sampled every 100 ms in the background: as SCHED_IDLE
        // with usage windows, without the sampling gate (the previous release) and with it
        // (this release), then sampling off again, all in this run.
        // `devices` sampled every 100 ms, at the gate or not, reading processes under `proc`.
        let monitor = |devices: &[ClaimDevice], gate: bool, proc: &Path| {
            cleave_kubelet_plugin::usage::UsageMonitor::start(
                cleave_kubelet_plugin::usage::MonitorConfig {
                    interval: Duration::from_millis(100),
                    policy: cleave_driver::usage::IdlePolicy::default(),
                    pool: USAGE_NODE.into(),
                    rightsize: Some(rightsize),
                    rightsize_state: None,
                    oversized: None,
                    rightsize_metrics: Some(std::sync::Arc::clone(&metrics.rightsize)),
                    gate: gate.then(|| plugin.sampling_gate.clone()),
                    proc_root: proc.to_path_buf(),
                },
                plugin.backend.usage_source().unwrap(),
                std::sync::Arc::new(Fixed {
                    devices: devices.to_vec(),
                    gpus: gpus.clone(),
                    inventory: inventory.clone(),
                }),
                std::sync::Arc::clone(&metrics.usage),
                None,
            )
            .unwrap()
        };
        let sampled = |gate: bool| monitor(&devices, gate, Path::new("/proc"));
        // Off, ungated, gated and off again alternate in blocks of ten cycles, so that
        // whatever else the machine does meanwhile falls on all alike; the two off sets
        // against each other show how far p99 moves with nothing changed.
        const BLOCK: usize = 10;
        let mut off = Vec::with_capacity(iterations);
        let mut off_again = Vec::with_capacity(iterations);
        let mut ungated = Vec::with_capacity(iterations);
        let mut on = Vec::with_capacity(iterations);
        while on.len() < iterations {
            for _ in 0..BLOCK {
                off.push(cycle(&mut dra).await);
            }
            let monitor = sampled(false);
            for _ in 0..BLOCK {
                ungated.push(cycle(&mut dra).await);
            }
            monitor.stop();
            let monitor = sampled(true);
            for _ in 0..BLOCK {
                on.push(cycle(&mut dra).await);
            }
            monitor.stop();
            for _ in 0..BLOCK {
                off_again.push(cycle(&mut dra).await);
            }
        }
        let rss_after = own_rss_kib();
        // Attribution: the 50 shares sampled every 100 ms (gated), without their pods (no
        // process is tied to them, nothing read under /proc) and with them (each round
        // reads the MPS-client list and the cgroup of each client), alternating in blocks.
        let without_pods: Vec<ClaimDevice> = shares
            .iter()
            .cloned()
            .map(|mut d| {
                d.pods.clear();
                d
            })
            .collect();
        let sampled_shares = |devices: &[ClaimDevice]| monitor(devices, true, &share_proc);
        let mut attr_off = Vec::with_capacity(iterations);
        let mut attr_on = Vec::with_capacity(iterations);
        while attr_on.len() < iterations {
            let monitor = sampled_shares(&without_pods);
            for _ in 0..BLOCK {
                attr_off.push(cycle(&mut dra).await);
            }
            monitor.stop();
            let monitor = sampled_shares(&shares);
            for _ in 0..BLOCK {
                attr_on.push(cycle(&mut dra).await);
            }
            monitor.stop();
        }
        let rss_shares = own_rss_kib();
        // One round over the 50 shares with attribution, and what it found.
        let mut share_rounds = cleave_kubelet_plugin::usage::UsageRounds::new(
            plugin.backend.usage_source().unwrap(),
            cleave_driver::usage::IdlePolicy::default(),
        )
        .with_proc_root(share_proc.clone());
        let mut share_round_times = Vec::new();
        let mut attributed = 0;
        for i in 0..21 {
            let t = Instant::now();
            let r = share_rounds.round(&shares, Instant::now());
            if i > 0 {
                share_round_times.push(t.elapsed());
            }
            attributed = r
                .samples
                .iter()
                .filter(|s| s.memory_used.is_some())
                .count();
        }
        plugin.shutdown().await.unwrap();
        standin.shutdown().await;
        let (o50, o99) = (percentile(&mut off, 0.5), percentile(&mut off, 0.99));
        let (a50, a99) = (
            percentile(&mut off_again, 0.5),
            percentile(&mut off_again, 0.99),
        );
        let (n50, n99) = (
            percentile(&mut ungated, 0.5),
            percentile(&mut ungated, 0.99),
        );
        let (s50, s99) = (percentile(&mut on, 0.5), percentile(&mut on, 0.99));
        println!(
            "usage sampling cost ({} claim devices: 8 H100 x 7 MIG 1g.10gb, mock; whole-GPU prepare on a 9th H100), {iterations} samples each",
            devices.len()
        );
        println!("  {:<52} {:>9} {:>9}", "", "p50 ms", "p99 ms");
        for (what, p50, p99) in [
            ("prepare, sampling off", o50, o99),
            ("prepare, sampling every 100 ms, no gate (before)", n50, n99),
            ("prepare, sampling every 100 ms, gated (this release)", s50, s99),
            ("prepare, sampling off (second set)", a50, a99),
        ] {
            println!("  {what:<52} {:>9.3} {:>9.3}", ms(p50), ms(p99));
        }
        // Both off sets together are the reference.
        let mut off_all: Vec<Duration> = off.iter().chain(&off_again).copied().collect();
        let (r50, r99) = (
            percentile(&mut off_all, 0.5).as_secs_f64(),
            percentile(&mut off_all, 0.99).as_secs_f64(),
        );
        println!(
            "  ratio on/off (alternating blocks of {BLOCK}; off = both off sets): p50 {:.2}x, p99 {:.2}x (target: p99 within 1.1x); without the gate: p99 {:.2}x",
            s50.as_secs_f64() / r50,
            s99.as_secs_f64() / r99,
            n99.as_secs_f64() / r99
        );
        println!(
            "  noise with nothing changed (off second set / first set): p50 {:.2}x, p99 {:.2}x",
            a50.as_secs_f64() / o50.as_secs_f64(),
            a99.as_secs_f64() / o99.as_secs_f64()
        );
        println!(
            "  {:<52} {:>9.3} {:>9.3}",
            "CPU per round, windows off (thread CPU)",
            ms(percentile(&mut cpu_off, 0.5)),
            ms(percentile(&mut cpu_off, 0.99))
        );
        println!(
            "  {:<52} {:>9.3} {:>9.3}",
            "CPU per round, windows on (thread CPU)",
            ms(percentile(&mut cpu_on, 0.5)),
            ms(percentile(&mut cpu_on, 0.99))
        );
        println!(
            "  memory per claim window after a scripted day (144 rounds): {window_bytes} bytes"
        );
        println!(
            "  {:<44} {:>9.3} {:>9.3}",
            "one sampling round (56 devices)",
            ms(percentile(&mut round_times, 0.5)),
            ms(percentile(&mut round_times, 0.99))
        );
        println!(
            "  {:<44} {:>9.3} {:>9.3}",
            format!("one scrape (encode, {scrape_bytes} bytes)"),
            ms(percentile(&mut scrape_times, 0.5)),
            ms(percentile(&mut scrape_times, 0.99))
        );
        println!(
            "  resident memory of the bench process (plugin, sampler, and the in-process stand-in, with its bounded change history of claim versions): {rss_before} KiB before sampling, {rss_after} KiB after {} prepare cycles with sampling (+{} KiB)",
            iterations,
            rss_after.saturating_sub(rss_before)
        );
        let (f50, f99) = (
            percentile(&mut attr_off, 0.5),
            percentile(&mut attr_off, 0.99),
        );
        let (t50, t99) = (percentile(&mut attr_on, 0.5), percentile(&mut attr_on, 0.99));
        println!(
            "attribution of {SHARES_SAMPLED} capacity shares (one MPS client each, by pod cgroup), sampled every 100 ms, gated; {iterations} samples each"
        );
        println!("  {:<52} {:>9} {:>9}", "", "p50 ms", "p99 ms");
        for (what, p50, p99) in [
            ("prepare, shares sampled without their pods", f50, f99),
            ("prepare, shares sampled with attribution", t50, t99),
        ] {
            println!("  {what:<52} {:>9.3} {:>9.3}", ms(p50), ms(p99));
        }
        println!(
            "  ratio with/without attribution (alternating blocks of {BLOCK}): p50 {:.2}x, p99 {:.2}x (target: within the sampler gate's budget, p99 within 1.1x)",
            t50.as_secs_f64() / f50.as_secs_f64(),
            t99.as_secs_f64() / f99.as_secs_f64()
        );
        println!(
            "  {:<52} {:>9.3} {:>9.3}",
            format!("one round over the {SHARES_SAMPLED} shares ({attributed} attributed)"),
            ms(percentile(&mut share_round_times, 0.5)),
            ms(percentile(&mut share_round_times, 0.99))
        );
        println!(
            "  resident memory after the attribution blocks: {rss_shares} KiB (+{} KiB over the MIG sampling above)",
            rss_shares.saturating_sub(rss_after)
        );
    });
}

/// Prepare latency with the claim status writer on and off (`--claim-device-status`), in
/// the same run: each a fresh plugin on its own directories against the same stand-in,
/// whole-GPU claims prepared and unprepared in turn. With it on, also how long after the
/// kubelet's answer the claim's `status.devices` entry is stored (polled every 0.2 ms): the
/// write runs after the answer, so it shows up there and not in the prepare figures.
/// Returns ((off p50, off p99), (on p50, on p99), (entry-after-answer p50, p99)).
#[allow(clippy::type_complexity)]
async fn status_phase(
    standin: &StandIn,
    dir: &Path,
    iterations: usize,
    lib: &Path,
) -> (
    (Duration, Duration),
    (Duration, Duration),
    (Duration, Duration),
) {
    let mut results = Vec::new();
    let mut after = Vec::new();
    for (round, on) in [(0, false), (1, true)] {
        let node_dir = dir.join(format!("status-{round}"));
        let mut args = run_args(NODE, &node_dir, lib.to_path_buf());
        args.claim_info.claim_device_status = on;
        mock_nvml::driver_root::DriverRootFixture::with_minors(0..8)
            .lay_out(&args.driver.driver_root)
            .unwrap();
        let plugin = cleave_kubelet_plugin::start(&args, standin.client())
            .await
            .unwrap();
        let channel = cleave_kubelet_plugin::connect_unix(plugin.server.dra_socket())
            .await
            .unwrap();
        let mut dra = v1::dra_plugin_client::DraPluginClient::new(channel);
        let mut prepare = Vec::with_capacity(iterations);
        let warmup = 10;
        for i in 0..iterations + warmup {
            let uid = format!("00000000-0000-4000-8{round:03}-{i:012}");
            let name = format!("status-{round}-{i}");
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
            if on {
                let deadline = Instant::now() + Duration::from_secs(10);
                while standin
                    .get("resourceclaims", "default", &name)
                    .is_none_or(|c| c["status"]["devices"].as_array().is_none_or(Vec::is_empty))
                {
                    assert!(Instant::now() < deadline, "no status entry for {name}");
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
                if i >= warmup {
                    after.push(t.elapsed().saturating_sub(prep));
                }
            }
            let resp = dra
                .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                    claims: vec![request],
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(resp.claims[&uid].error, "", "unprepare failed");
            if i >= warmup {
                prepare.push(prep);
            }
        }
        plugin.shutdown().await.unwrap();
        results.push((
            percentile(&mut prepare, 0.5),
            percentile(&mut prepare, 0.99),
        ));
    }
    (
        results[0],
        results[1],
        (percentile(&mut after, 0.5), percentile(&mut after, 0.99)),
    )
}
