//! Prepare/unprepare latency of a whole-GPU claim over the DRA socket, against the floor
//! measured in the same run: one claim GET from the API server stand-in plus two durable
//! small-file writes (write, fsync, rename, fsync directory), which is the I/O a whole-GPU
//! prepare cannot avoid (CDI spec + checkpoint).
//!
//! Run: `cargo bench -p cleave-kubelet-plugin --bench prepare` (ITERATIONS env to change
//! the sample count). Prints p50/p99 and the ratios; asserts nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use cleave_apiserver_standin::{StandIn, StandInOptions, fixtures};
use cleave_kubelet_plugin::cli::{DriverArgs, KubeletArgs, NvmlArgs, RunArgs};
use cleave_kubelet_plugin::proto::dra::v1;
use k8s_openapi::api::resource::v1::ResourceClaim;

const NODE: &str = "bench-node";

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
            host_driver_root: None,
            mps_control_bin: None,
            nvidia_smi_bin: None,
        },
        nvml: NvmlArgs {
            nvml_lib: Some(lib),
            mock_profile: None,
            mock: None,
        },
        kubeconfig: None,
        metrics_addr: None,
        uninstall: false,
    };
    std::fs::create_dir_all(&args.driver.driver_root).unwrap();
    let plugin = cleave_kubelet_plugin::daemon::start(&args, standin.client())
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

        // The floor: claim GET + two durable small-file writes.
        let t = Instant::now();
        let api: kube::Api<ResourceClaim> = kube::Api::namespaced(client.clone(), "default");
        let got = api.get(&name).await.unwrap();
        let body = serde_json::to_vec(&got.metadata.uid).unwrap();
        durable_write(
            &floor_dir,
            "spec.json",
            &[&body[..], &[b' '; 1500]].concat(),
        );
        durable_write(
            &floor_dir,
            "checkpoint.json",
            &[&body[..], &[b' '; 800]].concat(),
        );
        let fl = t.elapsed();

        if i >= warmup {
            prepare.push(prep);
            unprepare.push(unprep);
            floor.push(fl);
        }
    }
    plugin.shutdown().await.unwrap();
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
}
