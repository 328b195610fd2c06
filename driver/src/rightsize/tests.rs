#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::model::{GpuInfo, MigState, NodeInventory};
use crate::prepare::testing::h100_profiles;
use crate::usage::{
    Activity, ActivitySource, Allocation, ClaimDevice, ClaimRef, DeviceSample, Holding,
    MemorySource, MigRef, SharingStrategy,
};
use cleave_api::pool::ConsumableCapacity;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
const H100_MIB: u64 = 81559;

/// GPU `minor` (UUID `GPU-<minor>`), an H100 with MIG on or off.
fn gpu(minor: u32, mig_on: bool) -> GpuInfo {
    let mig = if mig_on {
        MigState::Enabled {
            profiles: h100_profiles(),
            instances: Vec::new(),
            memory_slices: 8,
        }
    } else {
        MigState::Disabled {
            profiles: h100_profiles(),
        }
    };
    GpuInfo {
        uuid: format!("GPU-{minor}"),
        pci_bus_id: format!("0000:{minor:02x}:00.0"),
        ..crate::prepare::testing::h100_gpu(minor, mig)
    }
}

/// GPU 0 with MIG off, GPU 1 with MIG on.
fn node() -> NodeInventory {
    NodeInventory {
        driver_version: "570.148.08".into(),
        driver_semver: "570.148.8".into(),
        cuda_driver_semver: "12.8.0".into(),
        gpus: vec![gpu(0, false), gpu(1, true)],
    }
}

const MIG_NODE: NodeModes = NodeModes {
    dynamic_mig: true,
    consumable_capacity: ConsumableCapacity::Off,
};

fn claim(uid: &str) -> ClaimRef {
    ClaimRef {
        uid: uid.into(),
        namespace: "team-a".into(),
        name: format!("claim-{uid}"),
    }
}

fn whole(uid: &str) -> ClaimDevice {
    ClaimDevice {
        claim: claim(uid),
        device: "gpu-0".into(),
        kind: Holding::Whole,
        sharing: None,
        share_id: None,
        gpu_uuid: "GPU-0".into(),
        mig: None,
        allocated: Allocation {
            memory_bytes: H100_MIB * MIB,
            sms: Some(132),
            mig_profile: None,
        },
        pids: Vec::new(),
        pods: Vec::new(),
    }
}

fn mig(uid: &str, profile: &str, mib: u64, sms: u32) -> ClaimDevice {
    ClaimDevice {
        device: format!("gpu-1-mig-{}-0", profile.replace('.', "")),
        kind: Holding::Mig,
        gpu_uuid: "GPU-1".into(),
        mig: Some(MigRef {
            uuid: format!("MIG-{uid}"),
            gi: 1,
            ci: 0,
        }),
        allocated: Allocation {
            memory_bytes: mib * MIB,
            sms: Some(sms),
            mig_profile: Some(profile.into()),
        },
        ..whole(uid)
    }
}

fn mps(uid: &str, pids: &[u32]) -> ClaimDevice {
    ClaimDevice {
        kind: Holding::Mps,
        sharing: Some(SharingStrategy::Mps),
        pids: pids.to_vec(),
        pods: Vec::new(),
        ..whole(uid)
    }
}

fn share(uid: &str, pids: &[u32], gib: u64, sms: u32) -> ClaimDevice {
    ClaimDevice {
        kind: Holding::Share,
        sharing: Some(SharingStrategy::Mps),
        share_id: Some(format!("share-{uid}")),
        pids: pids.to_vec(),
        pods: Vec::new(),
        allocated: Allocation {
            memory_bytes: gib * GIB,
            sms: Some(sms),
            mig_profile: None,
        },
        ..whole(uid)
    }
}

/// One round's sample as the sampler would give it.
fn sample(d: &ClaimDevice, used: Option<u64>, activity: Option<f64>) -> DeviceSample {
    let attributable = !(matches!(d.kind, Holding::Mps | Holding::Share)
        && d.pids.is_empty()
        && d.pods.is_empty());
    let source = match d.kind {
        Holding::Mps | Holding::Share => ActivitySource::ProcessSmUtilization,
        _ => ActivitySource::GpmSmActivity,
    };
    DeviceSample {
        device: d.clone(),
        memory_used: if attributable { used } else { None },
        memory_total: Some(d.allocated.memory_bytes),
        memory_source: if attributable {
            MemorySource::Device
        } else {
            MemorySource::NotAttributable
        },
        activity: match (attributable, activity) {
            (false, _) => Activity::NotAttributable,
            (true, Some(percent)) => Activity::Measured { percent, source },
            (true, None) => Activity::Unavailable,
        },
        sm_occupancy: None,
        errors: Vec::new(),
    }
}

// Aligned to the hour, so a day of rounds fills exactly the 24 one-hour buckets.
const T0: u64 = 1_699_999_200;
const ROUND: u64 = 600;
const DAY: u64 = 24 * 3600;

/// Feeds `rounds` rounds `ROUND` seconds apart from `T0`; `f(i)` gives round i's memory
/// (bytes) and activity (percent).
fn trace(
    store: &mut WindowStore,
    d: &ClaimDevice,
    from: u64,
    rounds: u64,
    f: impl Fn(u64) -> (Option<u64>, Option<f64>),
) -> u64 {
    let mut t = T0;
    for i in from..from + rounds {
        t = T0 + i * ROUND;
        let (m, a) = f(i);
        store.observe(t, std::slice::from_ref(d), &[sample(d, m, a)]);
    }
    t
}

fn advise(
    d: &ClaimDevice,
    f: impl Fn(u64) -> (Option<u64>, Option<f64>),
    modes: NodeModes,
) -> (WindowStats, Recommendation) {
    let mut store = WindowStore::in_memory(WindowConfig::default());
    let end = trace(&mut store, d, 0, DAY / ROUND, f);
    let st = store.stats(&WindowKey::of(d), end);
    let r = recommend(d, &st, &node(), modes, &RightsizePolicy::default());
    (st, r)
}

fn has(r: &Recommendation, parts: &[&str]) {
    for p in parts {
        assert!(r.reason.contains(p), "{p:?} missing in {:?}", r.reason);
    }
}

#[test]
fn steady_whole_gpu_gets_the_smallest_mig_profile_that_holds_it() {
    let (st, r) = advise(&whole("s"), |_| (Some(12 * GIB), Some(10.0)), MIG_NODE);
    assert_eq!(st.samples, 144);
    assert_eq!(st.peak_memory, Some(12 * GIB));
    assert_eq!(st.p95_activity, Some(10.0));
    // 12 GiB x 1.2 = 14.4 GiB, 10 % x 132 x 1.2 = 16 SMs: 1g.10gb is too small, 1g.20gb holds it.
    assert_eq!(r.advice.shape().and_then(Shape::profile), Some("1g.20gb"));
    assert_eq!(r.change, Change::Smaller);
    assert!(r.served && r.needs.is_none());
    has(
        &r,
        &[
            "oversized: 1g.20gb",
            "peak 12.0 GiB of 79.6 GiB",
            "SM p95 10%",
            "gpm_sm_activity",
            "20% headroom",
            "144 samples",
        ],
    );
}

#[test]
fn bursty_whole_gpu_needs_the_whole_gpu() {
    // 30 GiB; 5 % most of the time, 90 % one round in ten: p95 is the burst.
    let (st, r) = advise(
        &whole("b"),
        |i| (Some(30 * GIB), Some(if i % 10 == 0 { 90.0 } else { 5.0 })),
        MIG_NODE,
    );
    assert_eq!(st.p95_activity, Some(90.0));
    assert!((st.mean_activity.unwrap() - 13.75).abs() < 0.5, "{st:?}");
    assert_eq!(r.advice.kind(), "gpu");
    assert_eq!(r.change, Change::Same);
    has(&r, &["whole GPU needed", "132 SMs", "SM p95 90%"]);
}

#[test]
fn idle_claims_are_told_to_release() {
    let d = mig("i", "3g.40gb", 40448, 60);
    let (st, r) = advise(&d, |i| (Some(2 * GIB), Some((i % 3) as f64)), MIG_NODE);
    assert_eq!(st.idle_fraction, Some(1.0));
    assert_eq!(r.advice, Advice::Release);
    assert_eq!(r.change, Change::Release);
    has(
        &r,
        &["idle: release", "below 5%", "peak 2.0 GiB of 39.5 GiB"],
    );
}

#[test]
fn growing_memory_is_sized_by_its_peak_and_flagged() {
    let (st, r) = advise(
        &whole("g"),
        |i| (Some(2 * GIB + i * (28 * GIB) / 143), Some(30.0)),
        MIG_NODE,
    );
    assert_eq!(st.peak_memory, Some(30 * GIB));
    assert!(st.memory_rising);
    // 36 GiB and 48 SMs: 3g.40gb.
    assert_eq!(r.advice.shape().and_then(Shape::profile), Some("3g.40gb"));
    has(&r, &["memory still rising", "peak 30.0 GiB"]);
}

#[test]
fn memory_near_the_limit_asks_for_more() {
    let d = mig("n", "1g.10gb", 9984, 16);
    let (_, r) = advise(&d, |_| (Some(9500 * MIB), Some(50.0)), MIG_NODE);
    // 9500 MiB x 1.2 = 11400 MiB > 9984 MiB: 1g.20gb.
    assert_eq!(r.advice.shape().and_then(Shape::profile), Some("1g.20gb"));
    assert_eq!(r.change, Change::Larger);
    has(&r, &["too tight", "peak 9.3 GiB of 9.8 GiB"]);
}

#[test]
fn mig_claims_step_down_within_the_products_table() {
    let d = mig("m", "3g.40gb", 40448, 60);
    let (_, r) = advise(&d, |_| (Some(6 * GIB), Some(20.0)), MIG_NODE);
    // 7.2 GiB, 20 % of 60 SMs x 1.2 = 15 SMs: 1g.10gb (16 SMs).
    assert_eq!(r.advice.shape().and_then(Shape::profile), Some("1g.10gb"));
    assert_eq!(r.change, Change::Smaller);
    has(&r, &["oversized: 1g.10gb (9.8 GiB, 16 SMs)", "SM p95 20%"]);
}

#[test]
fn mps_claims_get_a_share_where_the_node_serves_one_and_say_so_where_not() {
    let d = mps("p", &[4242]);
    let f = |_| (Some(8 * GIB), Some(25.0));
    // Shares served: 9.6 GiB (9831 MiB) and 40 SMs.
    let (_, r) = advise(
        &d,
        f,
        NodeModes {
            dynamic_mig: true,
            consumable_capacity: ConsumableCapacity::Mps,
        },
    );
    assert_eq!(
        r.advice,
        Advice::Shape(Shape::Share {
            memory_bytes: 9831 * MIB,
            sms: 40
        })
    );
    has(
        &r,
        &[
            "a share of 9.6 GiB (9831 MiB) and 40 SMs",
            "process_sm_utilization",
        ],
    );
    // No capacity sharing: the smallest MIG profile with 40 SMs, naming what a share needs.
    let (_, r) = advise(&d, f, MIG_NODE);
    assert_eq!(r.advice.shape().and_then(Shape::profile), Some("3g.40gb"));
    assert!(r.served);
    let needs = r.needs.as_deref().unwrap();
    assert!(needs.contains("--consumable-capacity"), "{needs}");
    // Neither its daemon's PID nor its pods known: not attributable, nothing guessed.
    let (_, r) = advise(&mps("q", &[]), f, MIG_NODE);
    assert_eq!(r.advice, Advice::NotAttributable);
    has(
        &r,
        &[
            "not attributable: an MPS claim",
            "no host PID and no consuming pod",
        ],
    );
    // Its daemon in a pod, its pods known: sized like any other.
    let by_pod = ClaimDevice {
        pods: vec!["pod-q".into()],
        ..mps("q", &[])
    };
    let (_, r) = advise(&by_pod, f, MIG_NODE);
    assert_eq!(r.advice.shape().and_then(Shape::profile), Some("3g.40gb"));
}

#[test]
fn shares_are_resized_when_attributable_and_not_guessed_otherwise() {
    let modes = NodeModes {
        dynamic_mig: false,
        consumable_capacity: ConsumableCapacity::Mps,
    };
    let (_, r) = advise(
        &share("a", &[7], 20, 66),
        |_| (Some(4 * GIB), Some(10.0)),
        modes,
    );
    assert_eq!(
        r.advice,
        Advice::Shape(Shape::Share {
            memory_bytes: 4916 * MIB,
            sms: 16
        })
    );
    assert_eq!(r.change, Change::Smaller);
    let (st, r) = advise(
        &share("b", &[], 20, 66),
        |_| (Some(4 * GIB), Some(10.0)),
        modes,
    );
    assert_eq!(st.memory_samples, 0);
    assert_eq!(r.advice, Advice::NotAttributable);
    has(
        &r,
        &[
            "a capacity share",
            "no host PID and no consuming pod known on this node",
        ],
    );
}

/// A share known by its pods only (the plugin's usual case).
fn pod_share(uid: &str, gib: u64, sms: u32) -> ClaimDevice {
    ClaimDevice {
        pods: vec![format!("pod-{uid}")],
        ..share(uid, &[], gib, sms)
    }
}

const SHARE_NODE: NodeModes = NodeModes {
    dynamic_mig: false,
    consumable_capacity: ConsumableCapacity::Mps,
};

#[test]
fn shares_known_by_their_pods_get_shares_in_published_steps_or_release() {
    let (_, r) = advise(
        &pod_share("a", 20, 66),
        |_| (Some(4 * GIB), Some(10.0)),
        SHARE_NODE,
    );
    // 4 GiB x 1.2 = 4915.2 MiB, up to the next 1 MiB step; 10% of 132 SMs x 1.2 = 15.84.
    let Advice::Shape(Shape::Share { memory_bytes, sms }) = r.advice else {
        panic!("{r:?}");
    };
    assert_eq!(memory_bytes % crate::pool::MEMORY_STEP_BYTES, 0);
    assert_eq!((memory_bytes, sms), (4916 * MIB, 16));
    assert_eq!(r.change, Change::Smaller);
    has(&r, &["oversized", "process_sm_utilization"]);
    let (_, r) = advise(
        &pod_share("idle", 20, 66),
        |_| (Some(GIB), Some(0.0)),
        SHARE_NODE,
    );
    assert_eq!(r.advice, Advice::Release);
    assert_eq!(r.change, Change::Release);
}

/// A day of rounds of `d`, each sample made by `f`.
fn advise_samples(d: &ClaimDevice, f: impl Fn(&ClaimDevice) -> DeviceSample) -> Recommendation {
    let mut store = WindowStore::in_memory(WindowConfig::default());
    let mut end = T0;
    for i in 0..DAY / ROUND {
        end = T0 + i * ROUND;
        store.observe(end, std::slice::from_ref(d), &[f(d)]);
    }
    let st = store.stats(&WindowKey::of(d), end);
    recommend(d, &st, &node(), SHARE_NODE, &RightsizePolicy::default())
}

#[test]
fn what_stays_unattributable_says_why() {
    // Known by its pods, but no process's cgroup readable: memory and activity unknown.
    let r = advise_samples(&pod_share("blind", 20, 66), |d| DeviceSample {
        memory_used: None,
        memory_source: MemorySource::NotAttributable,
        activity: Activity::NotAttributable,
        ..sample(d, None, None)
    });
    assert_eq!(r.advice, Advice::NotAttributable);
    has(&r, &["known by its pods only", "could not read the cgroup"]);
    // Per-process samples naming only the MPS server: activity unknown, memory known.
    let r = advise_samples(&pod_share("server", 20, 66), |d| DeviceSample {
        activity: Activity::NotAttributable,
        ..sample(d, Some(4 * GIB), None)
    });
    assert_eq!(r.advice, Advice::NotAttributable);
    has(
        &r,
        &["named only the MPS server", "its memory is attributed"],
    );
    // On a MIG device: no per-process utilization there.
    let on_mig = ClaimDevice {
        gpu_uuid: "GPU-1".into(),
        mig: Some(MigRef {
            uuid: "MIG-s".into(),
            gi: 1,
            ci: 0,
        }),
        ..pod_share("mig", 10, 16)
    };
    let r = advise_samples(&on_mig, |d| DeviceSample {
        activity: Activity::NotAttributable,
        ..sample(d, Some(GIB), None)
    });
    assert_eq!(r.advice, Advice::NotAttributable);
    has(&r, &["on a MIG device", "MIG-enabled GPUs"]);
}

#[test]
fn what_the_node_cannot_serve_is_named_not_recommended() {
    // No MIG-enabled GPU, no on-demand MIG, no capacity sharing: only whole GPUs.
    let mut inv = node();
    inv.gpus[1] = gpu(1, false);
    let d = whole("w");
    let mut store = WindowStore::in_memory(WindowConfig::default());
    let end = trace(&mut store, &d, 0, 144, |_| (Some(4 * GIB), Some(6.0)));
    let r = recommend(
        &d,
        &store.stats(&WindowKey::of(&d), end),
        &inv,
        NodeModes::default(),
        &RightsizePolicy::default(),
    );
    assert_eq!(r.advice.kind(), "gpu");
    assert!(r.served);
    let needs = r.needs.unwrap();
    assert!(needs.starts_with("1g.10gb"), "{needs}");
    assert!(
        needs.contains("MIG mode on a NVIDIA H100 80GB HBM3 GPU"),
        "{needs}"
    );
    assert!(r.reason.contains("this node would need"), "{}", r.reason);
    // A MIG claim needing more than the GPU on a node whose GPUs are all in MIG mode.
    let mut inv = node();
    inv.gpus[0] = gpu(0, true);
    let d = mig("x", "7g.80gb", 81152, 132);
    let end = trace(&mut store, &d, 0, 144, |_| (Some(75 * GIB), Some(80.0)));
    let r = recommend(
        &d,
        &store.stats(&WindowKey::of(&d), end),
        &inv,
        MIG_NODE,
        &RightsizePolicy::default(),
    );
    assert_eq!(r.advice.kind(), "gpu");
    assert!(!r.served);
    assert!(
        r.reason.contains("this node cannot serve it"),
        "{}",
        r.reason
    );
    assert!(r.needs.unwrap().contains("MIG mode off"));
}

#[test]
fn no_recommendation_before_half_the_window() {
    let d = whole("early");
    let mut store = WindowStore::in_memory(WindowConfig::default());
    // 11 hours: 11 or 12 buckets depending on alignment; 10 hours is surely short.
    let end = trace(&mut store, &d, 0, 10 * 6, |_| (Some(GIB), Some(50.0)));
    let st = store.stats(&WindowKey::of(&d), end);
    let r = recommend(&d, &st, &node(), MIG_NODE, &RightsizePolicy::default());
    assert_eq!(r.advice, Advice::Pending);
    has(&r, &["pending", "of the window's 24 buckets", "12 needed"]);
}

#[test]
fn headroom_changes_what_fits() {
    let d = mig("h", "3g.40gb", 40448, 60);
    let mut store = WindowStore::in_memory(WindowConfig::default());
    let end = trace(&mut store, &d, 0, 144, |_| (Some(8 * GIB), Some(20.0)));
    let st = store.stats(&WindowKey::of(&d), end);
    let with = |headroom| {
        recommend(
            &d,
            &st,
            &node(),
            MIG_NODE,
            &RightsizePolicy {
                headroom,
                ..RightsizePolicy::default()
            },
        )
        .advice
    };
    // 8 GiB x 1.1 fits 1g.10gb (9984 MiB); x 1.3 = 10.4 GiB does not.
    assert_eq!(with(0.1).shape().and_then(Shape::profile), Some("1g.10gb"));
    assert_eq!(with(0.3).shape().and_then(Shape::profile), Some("1g.20gb"));
}

#[test]
fn a_restart_mid_window_keeps_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(STATE_FILE);
    let d = whole("r");
    let f = |i: u64| (Some((2 + i % 5) * GIB), Some((i % 40) as f64));
    let mut straight = WindowStore::in_memory(WindowConfig::default());
    let end = trace(&mut straight, &d, 0, 144, f);
    // The same trace, with a restart after 12 hours.
    let (mut first, warning) = WindowStore::open(&path, WindowConfig::default());
    assert!(warning.is_none());
    let half = trace(&mut first, &d, 0, 72, f);
    assert!(first.persist(half, true).unwrap());
    drop(first);
    let (mut second, warning) = WindowStore::open(&path, WindowConfig::default());
    assert!(warning.is_none(), "{warning:?}");
    assert_eq!(second.len(), 1);
    trace(&mut second, &d, 72, 72, f);
    let key = WindowKey::of(&d);
    assert_eq!(second.stats(&key, end), straight.stats(&key, end));
    // Unprepared: the window goes, and the file with it at the next write.
    second.observe(end + 1, &[], &[]);
    assert!(second.persist(end + 1, false).unwrap());
    let (third, _) = WindowStore::open(&path, WindowConfig::default());
    assert!(third.is_empty());
}

#[test]
fn an_unusable_state_file_starts_empty_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(STATE_FILE);
    std::fs::write(&path, b"{not json").unwrap();
    let (s, w) = WindowStore::open(&path, WindowConfig::default());
    assert!(s.is_empty() && w.unwrap().contains("does not decode"));
    std::fs::write(
        &path,
        br#"{"version":9,"bucketSeconds":3600,"buckets":24,"windows":[]}"#,
    )
    .unwrap();
    let (_, w) = WindowStore::open(&path, WindowConfig::default());
    assert!(w.unwrap().contains("layout version 9"));
    std::fs::write(
        &path,
        br#"{"version":1,"bucketSeconds":60,"buckets":24,"windows":[],"later":1}"#,
    )
    .unwrap();
    let (_, w) = WindowStore::open(&path, WindowConfig::default());
    assert!(w.unwrap().contains("--rightsize-window"));
    // Writes are rare: not before WRITE_EVERY_SECONDS unless a bucket closed or a claim went.
    let (mut s, _) = WindowStore::open(
        &path,
        WindowConfig {
            window_seconds: 24 * 60,
            ..WindowConfig::default()
        },
    );
    let d = whole("w");
    s.observe(
        T0 - T0 % 60,
        std::slice::from_ref(&d),
        &[sample(&d, Some(GIB), Some(1.0))],
    );
    assert!(s.persist(T0, false).unwrap(), "first bucket");
    s.observe(
        T0 - T0 % 60 + 10,
        std::slice::from_ref(&d),
        &[sample(&d, Some(GIB), Some(1.0))],
    );
    assert!(!s.persist(T0 - T0 % 60 + 10, false).unwrap());
}

#[test]
fn windows_stay_bounded_and_estimates_stay_within_their_bound() {
    let d = whole("long");
    let mut store = WindowStore::in_memory(WindowConfig::default());
    // Ten days of 10-second rounds of pseudo-random figures.
    let mut x: u64 = 12345;
    let mut all = Vec::new();
    let rounds = 10 * DAY / 10;
    let mut t = T0;
    for i in 0..rounds {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let m = GIB + (x >> 20) % (60 * GIB);
        let a = ((x >> 8) % 10_000) as f64 / 100.0;
        t = T0 + i * 10;
        store.observe(t, std::slice::from_ref(&d), &[sample(&d, Some(m), Some(a))]);
        all.push((t, m, a));
    }
    let bytes = store.heap_bytes();
    assert!(bytes < 200 * 1024, "{bytes} bytes for one window");
    let st = store.stats(&WindowKey::of(&d), t);
    assert_eq!(st.seen_buckets, BUCKETS);
    // Exact nearest-rank p95 over the samples in the window's buckets.
    let oldest = (t / 3600 - 23) * 3600;
    let (mut m, mut a): (Vec<u64>, Vec<f64>) = all
        .iter()
        .filter(|(ts, _, _)| *ts >= oldest)
        .map(|(_, m, a)| (*m, *a))
        .unzip();
    let n = m.len();
    assert_eq!(st.samples as usize, n);
    m.sort_unstable();
    a.sort_by(f64::total_cmp);
    let rank = (0.95 * n as f64).ceil() as usize - 1;
    let (true_m, true_a) = (m[rank], a[rank]);
    let (est_m, est_a) = (st.p95_memory.unwrap(), st.p95_activity.unwrap());
    assert!(
        est_m >= true_m && est_m as f64 <= true_m as f64 * 1.02 + 1.0,
        "{est_m} vs {true_m}"
    );
    assert!(
        est_a >= true_a && est_a < true_a + 1.0,
        "{est_a} vs {true_a}"
    );
    assert_eq!(st.peak_memory, m.last().copied());
}

#[test]
fn savings_pack_recommendations_first_fit() {
    let inv = node();
    let policy = RightsizePolicy::default();
    // Seven whole GPUs each used like a 1g.10gb, one busy whole GPU, one idle MIG claim.
    let mut devices: Vec<ClaimDevice> = (0..7)
        .map(|i| ClaimDevice {
            gpu_uuid: format!("GPU-{}", i % 2),
            ..whole(&format!("small-{i}"))
        })
        .collect();
    devices.push(whole("busy"));
    devices.push(mig("idle", "3g.40gb", 40448, 60));
    let mut store = WindowStore::in_memory(WindowConfig::default());
    let mut end = T0;
    for i in 0..144 {
        end = T0 + i * ROUND;
        let samples: Vec<DeviceSample> = devices
            .iter()
            .map(|d| match d.claim.uid.as_str() {
                "busy" => sample(d, Some(70 * GIB), Some(95.0)),
                "idle" => sample(d, Some(GIB), Some(0.0)),
                _ => sample(d, Some(5 * GIB), Some(8.0)),
            })
            .collect();
        store.observe(end, &devices, &samples);
    }
    let recs: Vec<Recommendation> = devices
        .iter()
        .map(|d| {
            recommend(
                d,
                &store.stats(&WindowKey::of(d), end),
                &inv,
                MIG_NODE,
                &policy,
            )
        })
        .collect();
    assert!(
        recs[..7]
            .iter()
            .all(|r| r.advice.shape().and_then(Shape::profile) == Some("1g.10gb"))
    );
    assert_eq!(recs[8].advice, Advice::Release);
    // Held: GPU-0 and GPU-1 (the test's claims share them). Needed: seven 1g.10gb on one
    // GPU, one whole GPU.
    assert_eq!(
        savings(&inv, &devices, &recs),
        Savings { held: 2, needed: 2 }
    );
    // Eight 1g.10gb need two GPUs (seven placements each).
    let eight: Vec<ClaimDevice> = (0..8)
        .map(|i| ClaimDevice {
            gpu_uuid: "GPU-1".into(),
            ..whole(&format!("e{i}"))
        })
        .collect();
    let recs = vec![recs[0].clone(); 8];
    assert_eq!(savings(&inv, &eight, &recs).needed, 2);
    // Not attributable or pending: counted as held.
    let pending = Recommendation {
        advice: Advice::Pending,
        change: Change::Unknown,
        served: true,
        reason: String::new(),
        needs: None,
    };
    assert_eq!(savings(&inv, &eight, &vec![pending; 8]).needed, 8);
}

/// GPUs 0, 2 and 3 with MIG off, GPU 1 with MIG on.
fn share_node() -> NodeInventory {
    NodeInventory {
        gpus: vec![gpu(0, false), gpu(1, true), gpu(2, false), gpu(3, false)],
        ..node()
    }
}

/// A share on GPU `minor` and its recommendation.
fn share_on(minor: u32, advice: Advice) -> (ClaimDevice, Recommendation) {
    let d = ClaimDevice {
        gpu_uuid: format!("GPU-{minor}"),
        device: format!("gpu-{minor}"),
        ..pod_share(&format!("s{minor}-{}", advice.kind()), 40, 66)
    };
    let r = Recommendation {
        advice,
        change: Change::Smaller,
        served: true,
        reason: String::new(),
        needs: None,
    };
    (d, r)
}

fn small() -> Advice {
    Advice::Shape(Shape::Share {
        memory_bytes: 10 * GIB,
        sms: 20,
    })
}

fn split(v: Vec<(ClaimDevice, Recommendation)>) -> (Vec<ClaimDevice>, Vec<Recommendation>) {
    v.into_iter().unzip()
}

#[test]
fn shares_spread_over_gpus_are_merged_where_they_fit_on_fewer() {
    let inv = share_node();
    let (devices, recs) = split(vec![
        share_on(0, small()),
        share_on(2, small()),
        share_on(3, small()),
    ]);
    let m = merges(&inv, &devices, &recs);
    assert_eq!(
        m,
        vec![Merge {
            product: inv.gpus[0].product_name.clone(),
            gpus: vec!["gpu-0".into(), "gpu-2".into(), "gpu-3".into()],
            needed: 1,
        }]
    );
    assert_eq!(
        m[0].describe(),
        "shares on gpu-0, gpu-2, gpu-3 would fit on 1 GPU after right-sizing"
    );
    // Pending counts as what it holds (40 GiB, 66 SMs): two of them do not fit one H100
    // (79.6 GiB), so three shares need two GPUs.
    let (devices, recs) = split(vec![
        share_on(0, Advice::Pending),
        share_on(2, Advice::NotAttributable),
        share_on(3, small()),
    ]);
    assert_eq!(merges(&inv, &devices, &recs)[0].needed, 2);
    // A released share leaves the group (its own advice frees its GPU): the other two
    // still fit on one.
    let (devices, recs) = split(vec![
        share_on(0, Advice::Release),
        share_on(2, small()),
        share_on(3, small()),
    ]);
    let m = merges(&inv, &devices, &recs);
    assert_eq!(m[0].gpus, vec!["gpu-2".to_owned(), "gpu-3".to_owned()]);
    assert_eq!(m[0].needed, 1);
    // Released or moving to a MIG profile: nothing left to merge.
    let mig = Advice::Shape(Shape::Mig {
        profile: "1g.10gb".into(),
        memory_bytes: 9856 * MIB,
        sms: 16,
    });
    let (devices, recs) = split(vec![share_on(0, Advice::Release), share_on(2, mig)]);
    assert_eq!(merges(&inv, &devices, &recs), Vec::new());
}

#[test]
fn shares_that_need_their_gpus_are_not_merged() {
    let inv = share_node();
    let big = || {
        Advice::Shape(Shape::Share {
            memory_bytes: 50 * GIB,
            sms: 40,
        })
    };
    let (devices, recs) = split(vec![share_on(0, big()), share_on(2, big())]);
    assert_eq!(merges(&inv, &devices, &recs), Vec::new());
    // Room in memory but not in SMs: 3 x 50 SMs of 132.
    let busy = || {
        Advice::Shape(Shape::Share {
            memory_bytes: 5 * GIB,
            sms: 50,
        })
    };
    let (devices, recs) = split(vec![
        share_on(0, busy()),
        share_on(2, busy()),
        share_on(3, busy()),
    ]);
    assert_eq!(merges(&inv, &devices, &recs)[0].needed, 2);
    // Already on one GPU: nothing to merge.
    let (devices, recs) = split(vec![share_on(0, small()), share_on(0, small())]);
    assert_eq!(merges(&inv, &devices, &recs), Vec::new());
}

#[test]
fn shares_on_mig_gpus_are_not_mixed_with_shares_on_whole_gpus() {
    let inv = share_node();
    // A share on a MIG device of GPU 1 (MIG mode on), and one recorded on GPU 1 itself.
    let (on_mig, r1) = share_on(1, small());
    let on_mig = ClaimDevice {
        mig: Some(MigRef {
            uuid: "MIG-x".into(),
            gi: 1,
            ci: 0,
        }),
        ..on_mig
    };
    let (on_mig_gpu, r2) = share_on(1, small());
    let (a, ra) = share_on(0, small());
    let (b, rb) = share_on(2, small());
    let m = merges(&inv, &[on_mig, on_mig_gpu, a, b], &[r1, r2, ra, rb]);
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].gpus, vec!["gpu-0".to_owned(), "gpu-2".to_owned()]);
    assert_eq!(m[0].needed, 1);
    // Whole GPUs and MIG devices are never part of it.
    let (w, rw) = (whole("w"), share_on(0, small()).1);
    assert_eq!(merges(&inv, &[w], &[rw]), Vec::new());
}

/// From a day of samples: three shares known by their pods, each on its own GPU and using
/// a sliver of it, are recommended small shares that fit on one GPU.
#[test]
fn shares_sized_from_their_windows_are_merged() {
    let inv = share_node();
    let devices: Vec<ClaimDevice> = [0u32, 2, 3]
        .iter()
        .map(|&minor| ClaimDevice {
            gpu_uuid: format!("GPU-{minor}"),
            device: format!("gpu-{minor}"),
            ..pod_share(&format!("m{minor}"), 40, 66)
        })
        .collect();
    let mut store = WindowStore::in_memory(WindowConfig::default());
    let mut end = T0;
    for i in 0..DAY / ROUND {
        end = T0 + i * ROUND;
        let samples: Vec<DeviceSample> = devices
            .iter()
            .map(|d| sample(d, Some(4 * GIB), Some(10.0)))
            .collect();
        store.observe(end, &devices, &samples);
    }
    let policy = RightsizePolicy::default();
    let recs: Vec<Recommendation> = devices
        .iter()
        .map(|d| {
            recommend(
                d,
                &store.stats(&WindowKey::of(d), end),
                &inv,
                SHARE_NODE,
                &policy,
            )
        })
        .collect();
    assert!(recs.iter().all(|r| r.advice.kind() == "share"), "{recs:?}");
    let m = merges(&inv, &devices, &recs);
    assert_eq!(m.len(), 1);
    assert_eq!(
        m[0].describe(),
        "shares on gpu-0, gpu-2, gpu-3 would fit on 1 GPU after right-sizing"
    );
    assert_eq!(
        savings(&inv, &devices, &recs),
        Savings { held: 3, needed: 1 }
    );
}
