//! What nodes cost the API server: `NODES` (default 20) real plugin processes (the binary
//! under test, or `BASELINE_PLUGIN`'s) against one API server stand-in, every node with its
//! Node, its plugin Pod in the release namespace and the chart's MPS launcher (`pod`); one in
//! four nodes has MIG-enabled GPUs with on-demand MIG. Counts requests by verb and resource,
//! the objects each LIST (or watch's initial list) walks in the API server's watch cache
//! (every object of the resource in the request's scope, or only one node's when a
//! `spec.nodeName` field selector on pods or ResourceSlices is served from the cache's field
//! index), and the seats API Priority and Fairness charges each request (a list: one per
//! 100 objects of the resource stored cluster-wide, index or not, clamped to [1, 10]).
//!
//! Measured in one run: each start (nodes started one after another, so later starts see
//! more of the cluster), the steady state of all nodes at rest over `STEADY_SECS` (default
//! 60) real seconds with watch time compressed `TIME_SCALE` (default 120) times by the
//! stand-in (a watch asking for 960 s ends after 8 s; counts are scaled back to real
//! hours), a whole-GPU and an on-demand MIG claim's prepare and unprepare, and a restart
//! with a claim prepared; then, on the third node (which runs the fake MPS tools of the
//! tests, played by this bench binary, and the chart's `consumableCapacity: mps`), with a
//! fake kubelet running its daemon pods, a per-claim MPS claim's and a capacity share's
//! prepare and unprepare (the fake kubelet's own requests are not counted). Projected
//! (computed from the measured per-node figures): 1,000 and 5,000 nodes, beside NVIDIA's GPU
//! plugin (0.0022 requests/s per idle node, 1 GET per claim).
//!
//! Run: `cargo bench -p cleave-kubelet-plugin --bench control_plane` (`NODES`, `TIME_SCALE`,
//! `STEADY_SECS` to change). Prints PASS/FAIL per target; asserts nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/cost_world/mod.rs"]
mod cost_world;

use std::time::{Duration, Instant};

use cost_world::{Kind, Tally, World};

const NVIDIA_IDLE_PER_S: f64 = 0.0022;

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn verdict(ok: bool) -> &'static str {
    if ok { "PASS" } else { "FAIL" }
}

fn main() {
    // The fake MPS tools' wrappers run this binary (`<bench> __fake <tool> ...`).
    let args: Vec<String> = std::env::args().collect();
    if let Some(code) = cleave_testkit::runner::play_fake_tool(&args) {
        std::process::exit(code);
    }
    let nodes = env_num("NODES", 20).max(3) as usize;
    let scale = env_num("TIME_SCALE", 120).max(1) as u32;
    let steady = Duration::from_secs(env_num("STEADY_SECS", 60).max(1));
    let bin = std::env::var_os("BASELINE_PLUGIN").map_or_else(
        || std::path::PathBuf::from(env!("CARGO_BIN_EXE_cleave-kubelet-plugin")),
        std::path::PathBuf::from,
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(&bin, nodes, scale, steady));
}

async fn run(bin: &std::path::Path, n: usize, scale: u32, steady: Duration) {
    println!(
        "control-plane cost: {n} plugin processes ({}), one stand-in, watch time compressed {scale}x",
        bin.display()
    );
    let mut w = World::new(bin, scale);
    // Another build (the previous release) may have no daemon pod watch to wait for.
    w.pod_watch = std::env::var_os("BASELINE_PLUGIN").is_none();
    for i in 0..n {
        w.add_node(if i % 4 == 3 { Kind::Mig } else { Kind::Whole });
    }
    // The third node can run MPS daemons: the fake tools under its driver root, their
    // knobs, and capacity shares as the chart publishes them.
    let fakes = cleave_testkit::fake_tools::FakeFiles::in_dir(&w.nodes[MPS_NODE].root);
    cleave_testkit::fake_tools::install_wrappers(
        &w.nodes[MPS_NODE].root.join("driver-root/usr/bin"),
    )
    .unwrap();
    let tool_env: Vec<(String, String)> = fakes
        .env()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    w.nodes[MPS_NODE].env = tool_env.clone();
    w.nodes[MPS_NODE]
        .env
        .push(("CONSUMABLE_CAPACITY".into(), "mps".into()));

    // Starts, one after another.
    let mut starts = Vec::new();
    let t0 = Instant::now();
    for i in 0..n {
        let mark = w.standin.requests().len();
        w.start(i);
        starts.push(Tally::of(&w.of_node(mark, i)));
    }
    println!("started {n} nodes in {:.1} s", t0.elapsed().as_secs_f64());
    println!("at start, per node (first, middle, last started):");
    for i in [0, n / 2, n - 1] {
        println!(
            "  {} ({:?}): {}",
            w.nodes[i].name,
            w.nodes[i].kind,
            starts[i].line()
        );
    }
    let first_scan = starts[0].scanned;
    let last_scan = starts[n - 1].scanned;
    let start_seats = starts.iter().map(|t| t.max_seats).max().unwrap_or(0);
    println!(
        "  objects walked: {first_scan} by the first node started, {} by the {}th, {last_scan} by the {n}th; most APF seats of one request: {start_seats}",
        starts[n / 2].scanned,
        n / 2 + 1
    );
    // APF's estimate of a start LIST at a larger cluster: this run's objects per node of
    // each listed resource, times the nodes, one seat per 100, at most 10.
    let per_node: Vec<f64> = ["resourceslices", "pods"]
        .iter()
        .map(|r| w.standin.list(r).len() as f64 / n as f64)
        .collect();
    let seats_at = |nodes: f64| {
        per_node
            .iter()
            .map(|p| ((p * nodes / 100.0).ceil() as u32).clamp(1, 10))
            .max()
            .unwrap_or(1)
    };
    let (seats_1000, seats_5000) = (seats_at(1000.0), seats_at(5000.0));

    // Steady state: everything at rest.
    let mark = w.standin.requests().len();
    let t = Instant::now();
    tokio::time::sleep(steady).await;
    let real = t.elapsed().as_secs_f64();
    let at_rest = Tally::of(&w.since(mark));
    let virtual_hours = real * f64::from(scale) / 3600.0;
    // Watch renewals ran on compressed time, anything else (a periodic LIST or GET of an
    // older build) on the wall clock.
    let watches: usize = at_rest
        .by_kind
        .iter()
        .filter(|(k, _)| k.starts_with("watch "))
        .map(|(_, n)| n)
        .sum();
    let real_hours = real / 3600.0;
    let per_node_hour =
        (watches as f64 / virtual_hours + (at_rest.total - watches) as f64 / real_hours) / n as f64;
    let per_node_s = per_node_hour / 3600.0;
    println!(
        "at rest, {real:.0} s real = {:.2} h of watch time (other requests scaled by the wall clock), all {n} nodes: {}",
        virtual_hours,
        at_rest.line()
    );
    println!(
        "  per node: {per_node_hour:.2} requests/h ({per_node_s:.5}/s); watch renewals only: {}",
        at_rest.by_kind.keys().all(|k| k.starts_with("watch "))
    );
    let mut by_node: Vec<f64> = (0..n)
        .map(|i| {
            let name = &w.nodes[i].name;
            let recs = w.since(mark);
            let mine = recs.iter().filter(|r| cost_world::names_node(r, name));
            let (watch, other): (Vec<_>, Vec<_>) = mine.partition(|r| r.verb == "watch");
            watch.len() as f64 / virtual_hours + other.len() as f64 / real_hours
        })
        .collect();
    by_node.sort_by(f64::total_cmp);
    println!(
        "  per node, least and most: {:.2} and {:.2} requests/h",
        by_node[0],
        by_node[n - 1]
    );

    // Per claim, whole and MIG.
    let mut claims = Vec::new();
    for i in [0, 3.min(n - 1)] {
        let mut dra = cost_world::dra(&w.nodes[i]).await;
        let claim = w.new_claim(i);
        let mark = w.standin.requests().len();
        cost_world::prepare(&mut dra, &claim).await;
        settle(&w, mark, &claim.name, true);
        let prep = Tally::of(claim_requests(&w.of_node(mark, i)));
        let mark = w.standin.requests().len();
        cost_world::unprepare(&mut dra, &claim).await;
        settle(&w, mark, &claim.name, false);
        let unprep = Tally::of(claim_requests(&w.of_node(mark, i)));
        println!("{:?} claim on {}:", w.nodes[i].kind, w.nodes[i].name);
        println!("  prepare:   {}", prep.line());
        println!("  unprepare: {}", unprep.line());
        claims.push((prep, unprep));
    }

    // Restart with a claim prepared.
    let mut dra = cost_world::dra(&w.nodes[1]).await;
    let claim = w.new_claim(1);
    let mark = w.standin.requests().len();
    cost_world::prepare(&mut dra, &claim).await;
    settle(&w, mark, &claim.name, true);
    drop(dra);
    w.stop(1);
    let mark = w.standin.requests().len();
    w.start(1);
    let restart = Tally::of(&w.of_node(mark, 1));
    println!(
        "restart of {} with one claim prepared: {}",
        w.nodes[1].name,
        restart.line()
    );
    let mut dra = cost_world::dra(&w.nodes[1]).await;
    let mark = w.standin.requests().len();
    cost_world::unprepare(&mut dra, &claim).await;
    settle(&w, mark, &claim.name, false);
    println!(
        "  unprepare after the restart: {}",
        Tally::of(claim_requests(&w.of_node(mark, 1))).line()
    );

    // Per-claim MPS and a capacity share, with the pod launcher.
    let sharing = sharing_claims(&mut w, &tool_env).await;
    // Whatever fake MPS daemon a stopped pod left behind.
    fakes.kill_started();

    // Projection and targets.
    println!("projection (per-node figures above x nodes):");
    println!("  {:<34} {:>14} {:>14}", "", "1,000 nodes", "5,000 nodes");
    println!(
        "  {:<34} {:>12.2}/s {:>12.2}/s",
        "cleave at rest (measured)",
        per_node_s * 1000.0,
        per_node_s * 5000.0
    );
    println!(
        "  {:<34} {:>12.2}/s {:>12.2}/s",
        "NVIDIA GPU plugin at rest",
        NVIDIA_IDLE_PER_S * 1000.0,
        NVIDIA_IDLE_PER_S * 5000.0
    );
    println!(
        "  {:<34} {:>14} {:>14}",
        "objects walked by one start",
        format!("~{}", project_scan(first_scan, last_scan, n, 1000)),
        format!("~{}", project_scan(first_scan, last_scan, n, 5000))
    );
    println!(
        "  {:<34} {:>14} {:>14}",
        "APF seats of one start LIST (est.)", seats_1000, seats_5000
    );
    println!("targets:");
    let only_watches = at_rest.by_kind.keys().all(|k| k.starts_with("watch "));
    println!(
        "  {} steady state per node <= NVIDIA's {NVIDIA_IDLE_PER_S}/s, watch renewals only: {per_node_s:.5}/s (most renewing node {:.5}/s)",
        verdict(per_node_s <= NVIDIA_IDLE_PER_S && only_watches),
        by_node[n - 1] / 3600.0
    );
    let claim_reads_ok = claims.iter().all(|(p, u)| {
        p.reads("resourceclaims") <= 1
            && p.get("update resourceclaims") + p.get("patch resourceclaims") <= 1
            && p.total
                == p.reads("resourceclaims")
                    + p.get("update resourceclaims")
                    + p.get("patch resourceclaims")
            && u.reads("resourceclaims") == 0
    });
    println!(
        "  {} per claim at most 1 read and 1 status write at prepare, no read at unprepare",
        verdict(claim_reads_ok)
    );
    let sharing_ok = !sharing.is_empty()
        && sharing.iter().all(|(_, p, u)| {
            p.reads("resourceclaims") <= 1
                && p.get("update resourceclaims") + p.get("patch resourceclaims") <= 1
                && p.get("create pods") <= 1
                && p.get("list pods") + p.get("get pods") == 0
                && u.reads("resourceclaims") == 0
                && u.get("delete pods") <= 1
                && p.scanned + u.scanned == 0
        });
    println!(
        "  {} per-claim MPS and share (pod launcher): at most 1 claim read, 1 status write and 1 daemon pod create at prepare, 1 pod delete and no read at unprepare, no LIST or pod GET",
        verdict(sharing_ok)
    );
    let no_growth_steady =
        at_rest.scanned == 0 && claims.iter().all(|(p, u)| p.scanned + u.scanned == 0);
    println!(
        "  {} no request walking the cluster at rest or per claim (objects walked: {})",
        verdict(no_growth_steady),
        at_rest.scanned
            + claims
                .iter()
                .map(|(p, u)| p.scanned + u.scanned)
                .sum::<usize>()
    );
    let restart_seats = restart.max_seats;
    println!(
        "  {} no request whose cost grows with the cluster at start: the first node's start walked {first_scan} objects, the {n}th's {last_scan}; at most {} APF seats per request (maximum 10)",
        verdict(last_scan <= first_scan && start_seats.max(restart_seats) <= 10),
        start_seats.max(restart_seats)
    );
}

/// The node that runs MPS daemons (a whole-GPU node).
const MPS_NODE: usize = 2;

/// Whether `r` is the fake kubelet's (its pod LIST across namespaces, selected by the daemon
/// label, which the plugin's node pod watch never is; its pod status patches), not the
/// plugin's.
fn kubelet_request(r: &cleave_apiserver_standin::RequestRecord) -> bool {
    r.resource == "pods"
        && ((r.path == "/api/v1/pods" && r.query.contains("labelSelector="))
            || r.path.ends_with("/status"))
}

/// Prepares and unprepares a per-claim MPS claim and a capacity share on [`MPS_NODE`], with a
/// fake kubelet running their daemon pods, and prints each one's requests. Empty when one
/// failed (printed).
async fn sharing_claims(
    w: &mut World,
    tool_env: &[(String, String)],
) -> Vec<(String, Tally, Tally)> {
    use cleave_apiserver_standin::fixtures;
    let i = MPS_NODE;
    let name = w.nodes[i].name.clone();
    let root = w.nodes[i].root.clone();
    std::fs::create_dir_all(root.join("pod-logs")).unwrap();
    let _kubelet = common::kubelet::FakeKubelet::start(
        w.standin.config(),
        &name,
        &root.join("kubelet"),
        std::path::Path::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin")),
        &root.join("pod-logs"),
        common::kubelet::KubeletOptions {
            env: tool_env.to_vec(),
            ..Default::default()
        },
    );
    let driver = cleave_api::names::DRIVER_NAME;
    let mps = fixtures::opaque_config(
        "FromClaim",
        &["gpu"],
        driver,
        serde_json::json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50}}}),
    );
    let mut out = Vec::new();
    for (what, device, share) in [
        ("per-claim MPS claim", "gpu-5", false),
        (
            "capacity share (the namespace's first of the GPU)",
            "gpu-6",
            true,
        ),
    ] {
        let claim_name = format!("{}-{name}", if share { "share" } else { "mps" });
        let uid = format!(
            "00000000-0000-4000-8000-0000000000{}",
            if share { "b2" } else { "a1" }
        );
        let configs = if share { Vec::new() } else { vec![mps.clone()] };
        let mut claim = fixtures::resource_claim(
            "default",
            &claim_name,
            &uid,
            driver,
            &name,
            &[("gpu", device)],
            &configs,
        );
        if share {
            for r in claim
                .status
                .as_mut()
                .and_then(|s| s.allocation.as_mut())
                .and_then(|a| a.devices.as_mut())
                .and_then(|d| d.results.as_mut())
                .unwrap()
            {
                r.share_id = Some("5a000000-0000-4000-8000-00000000000a".into());
                r.consumed_capacity = Some(
                    serde_json::from_value(
                        serde_json::json!({"memory": "20Gi", "multiprocessors": "44"}),
                    )
                    .unwrap(),
                );
            }
        }
        w.standin.put(&claim).unwrap();
        let c = cleave_kubelet_plugin::proto::dra::v1::Claim {
            namespace: "default".into(),
            name: claim_name.clone(),
            uid: uid.clone(),
        };
        let mut dra = cost_world::dra(&w.nodes[i]).await;
        let mark = w.standin.requests().len();
        let r = dra
            .node_prepare_resources(
                cleave_kubelet_plugin::proto::dra::v1::NodePrepareResourcesRequest {
                    claims: vec![c.clone()],
                },
            )
            .await;
        let error = answer_error(&r, |a| a.claims.get(&uid).map(|c| c.error.clone()));
        if !error.is_empty() {
            println!("{what} on {name}: prepare failed: {error}");
            return Vec::new();
        }
        settle(w, mark, &claim_name, true);
        let prep = Tally::of(claim_requests(&w.of_node(mark, i)).filter(|r| !kubelet_request(r)));
        let mark = w.standin.requests().len();
        let r = dra
            .node_unprepare_resources(
                cleave_kubelet_plugin::proto::dra::v1::NodeUnprepareResourcesRequest {
                    claims: vec![c],
                },
            )
            .await;
        let error = answer_error(&r, |a| a.claims.get(&uid).map(|c| c.error.clone()));
        if !error.is_empty() {
            println!("{what} on {name}: unprepare failed: {error}");
            return Vec::new();
        }
        settle(w, mark, &claim_name, false);
        let unprep = Tally::of(claim_requests(&w.of_node(mark, i)).filter(|r| !kubelet_request(r)));
        println!("{what} on {name} (pod launcher):");
        println!("  prepare:   {}", prep.line());
        println!("  unprepare: {}", unprep.line());
        out.push((what.to_owned(), prep, unprep));
    }
    out
}

/// A claim's requests: those of the window less the node's watch renewals (counted at rest).
fn claim_requests(
    recs: &[cleave_apiserver_standin::RequestRecord],
) -> impl Iterator<Item = &cleave_apiserver_standin::RequestRecord> {
    recs.iter().filter(|r| r.verb != "watch")
}

/// Waits for the claim status write of a prepare (`want`) or unprepare; a build that
/// writes none gets a few seconds, then the count goes on without it.
fn settle(w: &World, mark: usize, name: &str, want: bool) {
    if !w.wait_status_for(mark, name, want, Duration::from_secs(3)) {
        println!("  (no claim status write seen for {name} within 3 s)");
    }
}

/// Objects one start walks at `nodes` nodes, by a straight line through the first and the
/// last of `n` measured starts.
fn project_scan(first: usize, last: usize, n: usize, nodes: usize) -> usize {
    let per_node = (last.saturating_sub(first)) as f64 / (n - 1) as f64;
    (first as f64 + per_node * (nodes - 1) as f64).round() as usize
}

/// The claim's error in a DRA answer (`error_of` picks it), or the call's own error.
fn answer_error<T>(
    r: &Result<tonic::Response<T>, tonic::Status>,
    error_of: impl Fn(&T) -> Option<String>,
) -> String {
    match r {
        Ok(r) => error_of(r.get_ref()).unwrap_or_default(),
        Err(e) => e.to_string(),
    }
}
