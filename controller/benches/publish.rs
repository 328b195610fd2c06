//! Publishing cost of an 8-GPU on-demand-MIG node against the API server stand-in:
//! requests and bytes versus the minimum possible, and time to converge after changes.
//! Run: `cargo bench -p cleave-controller --bench publish`. Prints figures and ratios
//! measured in this run (nothing is asserted on time).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::{Duration, Instant};

use cleave_apiserver_standin::{KubeVersion, RequestRecord, StandIn, StandInOptions};
use cleave_controller::diff::{PoolTarget, diff};
use cleave_controller::fixtures::{on_demand_mig_group, on_demand_mig_pool};
use cleave_controller::{ApiStats, PublisherConfig, SliceLayout, SlicePublisher, plan_slices};
use k8s_openapi::api::resource::v1::{ResourcePool, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, PostParams};

const DRIVER: &str = "gpu.cleave.dev";
const NODE: &str = "node-a";
const WAIT: Duration = Duration::from_secs(10);
const ROUNDS: usize = 30;

fn summary(reqs: &[RequestRecord]) -> (usize, usize, usize, String) {
    let non_watch: Vec<_> = reqs.iter().filter(|r| r.verb != "watch").collect();
    let bytes_in = non_watch.iter().map(|r| r.bytes_in).sum();
    let bytes_out = non_watch.iter().map(|r| r.bytes_out).sum();
    let mut verbs = std::collections::BTreeMap::<String, usize>::new();
    for r in reqs {
        *verbs
            .entry(format!("{} {}", r.verb, r.resource))
            .or_default() += 1;
    }
    let verbs = verbs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ");
    (non_watch.len(), bytes_in, bytes_out, verbs)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Compact JSON size of the objects a fresh publish must send (the byte floor).
fn floor_bytes(layout: SliceLayout) -> usize {
    let specs = plan_slices(&on_demand_mig_pool(8), layout).unwrap();
    let pool = ResourcePool {
        name: NODE.into(),
        generation: 1,
        resource_slice_count: specs.len() as i64,
    };
    specs
        .iter()
        .map(|s| {
            let obj = ResourceSlice {
                metadata: Default::default(),
                spec: s.to_spec(DRIVER, NODE, pool.clone()),
            };
            serde_json::to_vec(&obj).unwrap().len()
        })
        .sum()
}

async fn wait_quiet(p: &SlicePublisher) {
    p.wait_published(WAIT).await.unwrap();
}

async fn bench(version: KubeVersion) {
    let s = StandIn::start(StandInOptions::with_version(version))
        .await
        .unwrap();
    s.put(&cleave_apiserver_standin::fixtures::node(NODE))
        .unwrap();
    let stats = ApiStats::new();
    let cfg = PublisherConfig {
        observer: Some(stats.observer()),
        ..PublisherConfig::new(DRIVER, NODE)
    };
    let layout = SliceLayout::for_server_version("1", &version.minor.to_string());
    let n = plan_slices(&on_demand_mig_pool(8), layout).unwrap().len();
    println!("\n== Kubernetes {version}: layout {layout}, {n} slices, 208 devices ==");

    // 1. First publish.
    let t = Instant::now();
    let p = SlicePublisher::start(s.client(), cfg.clone());
    p.publish(on_demand_mig_pool(8));
    wait_quiet(&p).await;
    let first = t.elapsed();
    let (reqs, bin, bout, verbs) = summary(&s.requests());
    let min = 3 + n; // GET /version + GET node + list + one create per slice
    let floor = floor_bytes(layout);
    println!("first publish: {first:.2?}; {reqs} requests (+1 watch) [{verbs}]");
    println!(
        "  minimum {min} requests (version GET + node GET + list + {n} creates): ratio {:.2}",
        reqs as f64 / min as f64
    );
    println!(
        "  bytes sent {bin} (floor = compact JSON of the {n} objects: {floor}, ratio {:.3}), bytes received {bout}",
        bin as f64 / floor as f64
    );
    p.shutdown().await;

    // Floor for a change: one PUT of a slice, same client, same server, no publisher.
    let api: Api<ResourceSlice> = Api::all(s.client());
    let mut obj = s.list_as::<ResourceSlice>("resourceslices").remove(0);
    let name = obj.metadata.name.clone().unwrap();
    let mut puts = Vec::new();
    for _ in 0..ROUNDS {
        let t = Instant::now();
        obj = api
            .replace(&name, &PostParams::default(), &obj)
            .await
            .unwrap();
        puts.push(t.elapsed());
    }
    puts.sort();
    let put_p50 = pct(&puts, 0.5);
    println!("floor: one slice PUT p50 {put_p50:.2?} (same client and server, no publisher)");

    // 2. Restart with nothing changed.
    s.reset_counts();
    let t = Instant::now();
    let p = SlicePublisher::start(s.client(), cfg.clone());
    p.publish(on_demand_mig_pool(8));
    wait_quiet(&p).await;
    let restart = t.elapsed();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (reqs, _, bout, verbs) = summary(&s.requests());
    println!(
        "restart, nothing changed: {restart:.2?}; {reqs} requests (+1 watch) [{verbs}]; {bout} bytes received; minimum 2 (version GET + list): ratio {:.2}",
        reqs as f64 / 2.0
    );

    // 3. One GPU's MIG state changes: publish() -> published.
    let mut times = Vec::new();
    s.reset_counts();
    for i in 0..ROUNDS {
        let mut pool = on_demand_mig_pool(8);
        pool.groups[3] = on_demand_mig_group(3, (i % 2) as u32 + 1);
        let t = Instant::now();
        p.publish(pool);
        wait_quiet(&p).await;
        times.push(t.elapsed());
    }
    times.sort();
    let floor = cfg.debounce + put_p50;
    println!(
        "  converge p50 / (debounce + PUT p50 = {floor:.2?}): ratio {:.2}",
        pct(&times, 0.5).as_secs_f64() / floor.as_secs_f64()
    );
    let (reqs, bin, _, verbs) = summary(&s.requests());
    println!(
        "one GPU's MIG state changes ({ROUNDS} rounds): p50 {:.2?}, p90 {:.2?}, max {:.2?} (includes the {:?} debounce); {:.2} requests/change [{verbs}], {} bytes sent/change; minimum 1 update: ratio {:.2}",
        pct(&times, 0.5),
        pct(&times, 0.9),
        times[times.len() - 1],
        cfg.debounce,
        reqs as f64 / ROUNDS as f64,
        bin / ROUNDS,
        reqs as f64 / ROUNDS as f64
    );

    // CPU of one sync without I/O: plan + diff against the stored state.
    let stored = s.list_as::<ResourceSlice>("resourceslices");
    let pool8 = on_demand_mig_pool(8);
    let target = PoolTarget {
        driver: DRIVER,
        node: NODE,
        min_generation: 0,
    };
    let t = Instant::now();
    for _ in 0..ROUNDS {
        std::hint::black_box(plan_slices(&pool8, layout).unwrap());
    }
    let plan_t = t.elapsed() / ROUNDS as u32;
    let desired = plan_slices(&pool8, layout).unwrap();
    let t = Instant::now();
    for _ in 0..ROUNDS {
        std::hint::black_box(diff(&stored, &desired, &target));
    }
    let diff_t = t.elapsed() / ROUNDS as u32;
    println!("  CPU per sync (no I/O): plan {plan_t:.2?} + diff {diff_t:.2?}");

    // 4. Foreign deletion of one slice -> restored.
    let mut times = Vec::new();
    s.reset_counts();
    for _ in 0..ROUNDS {
        let victim = s.list_as::<ResourceSlice>("resourceslices")[0]
            .metadata
            .name
            .clone()
            .unwrap();
        let mut rx = p.status();
        let t = Instant::now();
        s.delete("resourceslices", "", &victim).unwrap();
        rx.wait_for(|st| !st.published).await.unwrap();
        rx.wait_for(|st| st.published).await.unwrap();
        times.push(t.elapsed());
    }
    times.sort();
    let (reqs, _, _, verbs) = summary(&s.requests());
    println!(
        "foreign deletion of one slice -> restored ({ROUNDS} rounds): p50 {:.2?}, max {:.2?}; {:.2} requests/restore [{verbs}] (minimum 1 create)",
        pct(&times, 0.5),
        times[times.len() - 1],
        reqs as f64 / ROUNDS as f64
    );

    // 5. Kubelet-style wipe (deletecollection) -> all republished.
    let mut times = Vec::new();
    for _ in 0..5 {
        let mut rx = p.status();
        let t = Instant::now();
        api.delete_collection(
            &DeleteParams::default(),
            &ListParams::default().fields(&format!("spec.nodeName={NODE}")),
        )
        .await
        .unwrap();
        rx.wait_for(|st| !st.published).await.unwrap();
        rx.wait_for(|st| st.published).await.unwrap();
        times.push(t.elapsed());
    }
    times.sort();
    println!(
        "kubelet wipe -> {n} slices republished (5 rounds): p50 {:.2?}, max {:.2?}",
        pct(&times, 0.5),
        times[times.len() - 1]
    );
    println!("publisher's own request counts: {:?}", stats.snapshot());
    p.shutdown().await;
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        bench(KubeVersion::V1_34).await;
        bench(KubeVersion::V1_35).await;
    });
}
