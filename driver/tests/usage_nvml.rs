//! The usage sampler over the NVML backend and the mock library: usage scripted in the
//! mock's control file shows up under each claim device within two rounds, with its
//! source named; Ampere falls back to utilization and has nothing on MIG devices.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use cleave_driver::backend::GpuBackend as _;
use cleave_driver::model::Placement;
use cleave_driver::nvml::NvmlBackend;
use cleave_driver::usage::{
    Activity, ActivitySource, Allocation, ClaimDevice, ClaimRef, Holding, MemorySource, MigRef,
    SharingStrategy, UsageSampler,
};
use common::{mock_lib, run_child, scenario};

const MIB: u64 = 1 << 20;

fn node(product: &str) -> String {
    format!(
        "name: usage-{product}\ngpus:\n  - product: {product}\n    count: 1\n    migEnabled: false\n  \
         - product: {product}\n    count: 1\n    migEnabled: true\n  - product: {product}\n    count: 1\n    migEnabled: false\n"
    )
}

fn device(uid: &str, kind: Holding, gpu: &str, mig: Option<MigRef>, pids: &[u32]) -> ClaimDevice {
    ClaimDevice {
        claim: ClaimRef {
            uid: uid.into(),
            namespace: "ml".into(),
            name: format!("claim-{uid}"),
        },
        device: format!("dev-{uid}"),
        kind,
        sharing: match kind {
            Holding::Share => Some(SharingStrategy::TimeSlicing),
            Holding::Mps => Some(SharingStrategy::Mps),
            _ => None,
        },
        share_id: (kind == Holding::Share).then(|| format!("s-{uid}")),
        gpu_uuid: gpu.into(),
        mig,
        allocated: Allocation::default(),
        pids: pids.to_vec(),
        pods: Vec::new(),
    }
}

/// Opens the backend, makes a 1g MIG device on GPU 1 and returns the claim devices:
/// whole GPU 0, the MIG device, two shares of GPU 2 (one with known processes).
fn setup() -> (NvmlBackend, Vec<ClaimDevice>, std::path::PathBuf) {
    let control = std::path::PathBuf::from(std::env::var("MOCK_NVML_CONTROL").unwrap());
    let backend = NvmlBackend::open(Some(&mock_lib())).unwrap();
    let inv = backend.inventory().unwrap();
    let uuid = |i: usize| inv.gpus[i].uuid.clone();
    let mig = backend
        .create_mig(&uuid(1), 19, Placement { start: 0, size: 1 })
        .unwrap();
    let devices = vec![
        device("whole", Holding::Whole, &uuid(0), None, &[]),
        device(
            "mig",
            Holding::Mig,
            &uuid(1),
            Some(MigRef {
                uuid: mig.uuid.clone(),
                gi: mig.gi_id,
                ci: mig.ci_id,
            }),
            &[],
        ),
        device("share-a", Holding::Share, &uuid(2), None, &[100, 200]),
        device("share-b", Holding::Share, &uuid(2), None, &[]),
    ];
    (backend, devices, control)
}

fn scripted(control: &std::path::Path, gpm_whole: f64, gi: u32) {
    std::fs::write(
        control,
        format!(
            "memory 0 40960\ngpm 0 {gpm_whole} 10\nutil 0 99\nmemory 1 {gi} 0 2048\ngpm 1 {gi} 12 6\n\
             process 2 100 1024 20\nprocess 2 200 3072 15\nprocess 2 300 512 50\n"
        ),
    )
    .unwrap();
}

#[test]
fn usage_over_the_mock() {
    match scenario().as_deref() {
        Some("h100") => {
            let (backend, devices, control) = setup();
            let gi = devices[1].mig.as_ref().unwrap().gi;
            scripted(&control, 30.0, gi);
            let mut sampler = UsageSampler::new(backend.usage_source().unwrap());
            let r = sampler.sample(&devices);
            let s = &r.samples;
            assert!(s.iter().all(|s| s.errors.is_empty()), "{s:?}");
            assert_eq!(
                (s[0].memory_used, s[0].activity),
                (Some(40960 * MIB), Activity::Warming)
            );
            assert_eq!(
                (s[1].memory_used, s[1].activity),
                (Some(2048 * MIB), Activity::Warming)
            );
            assert_eq!(s[1].memory_total, Some(9984 * MIB));
            assert_eq!(
                (s[2].memory_used, s[2].memory_source),
                (Some(4096 * MIB), MemorySource::Processes)
            );
            assert_eq!(
                s[2].activity,
                Activity::Measured {
                    percent: 35.0,
                    source: ActivitySource::ProcessSmUtilization
                }
            );
            assert_eq!(
                (s[3].activity, s[3].memory_source),
                (Activity::NotAttributable, MemorySource::NotAttributable)
            );
            // Second round: GPM figures (the ones in effect at the second sample).
            scripted(&control, 55.0, gi);
            let r = sampler.sample(&devices);
            let s = &r.samples;
            assert_eq!(
                s[0].activity_series(),
                [
                    (ActivitySource::GpmSmActivity, 55.0),
                    (ActivitySource::GpmSmOccupancy, 10.0)
                ],
                "GPM, not the 99 % duty cycle"
            );
            assert_eq!(s[1].activity.percent(), Some(12.0));
            assert_eq!(s[1].sm_occupancy, Some(6.0));
            // Each GPU/device is asked once per round: 3 memory, 2 GPM, 2 process lists
            // (compute and MPS), 1 per-process utilization.
            assert_eq!(r.queries, 8, "{r:?}");
        }
        Some("a100") => {
            let (backend, devices, control) = setup();
            let gi = devices[1].mig.as_ref().unwrap().gi;
            scripted(&control, 30.0, gi);
            let mut sampler = UsageSampler::new(backend.usage_source().unwrap());
            for _ in 0..2 {
                let r = sampler.sample(&devices[..2]);
                assert_eq!(
                    r.samples[0].activity,
                    Activity::Measured {
                        percent: 99.0,
                        source: ActivitySource::GpuUtilization
                    }
                );
                assert_eq!(r.samples[1].activity, Activity::Unavailable);
                assert_eq!(r.samples[1].memory_used, Some(2048 * MIB));
            }
        }
        Some(other) => panic!("unknown scenario {other}"),
        None => {
            for (scenario, product) in [("h100", "h100-80gb"), ("a100", "a100-40gb")] {
                let dir = tempfile::tempdir().unwrap();
                let config = dir.path().join("node.yaml");
                std::fs::write(&config, node(product)).unwrap();
                let control = dir.path().join("control");
                std::fs::write(&control, "").unwrap();
                run_child(
                    "usage_over_the_mock",
                    scenario,
                    &[
                        ("MOCK_NVML_CONFIG", config.to_str().unwrap()),
                        ("MOCK_NVML_CONTROL", control.to_str().unwrap()),
                    ],
                );
            }
        }
    }
}

const POD_A: &str = "0f6b2c1e-7a3d-4c55-9e21-8b1d2f3a4c5d";
const POD_B: &str = "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d";
const POD_C: &str = "4d3c2b1a-0f9e-4d8c-b7a6-5f4e3d2c1b0a";

/// A proc root whose PIDs run in the given pods (systemd cgroup driver), or on the host.
fn proc_root(dir: &std::path::Path, pids: &[(u32, Option<&str>)]) {
    for (pid, pod) in pids {
        let p = dir.join(pid.to_string());
        std::fs::create_dir_all(&p).unwrap();
        let line = match pod {
            Some(uid) => format!(
                "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{pid:064}.scope\n",
                uid.replace('-', "_")
            ),
            None => "0::/system.slice/containerd.service\n".to_owned(),
        };
        std::fs::write(p.join("cgroup"), line).unwrap();
    }
}

fn of_pods(mut d: ClaimDevice, namespace: &str, pods: &[&str]) -> ClaimDevice {
    d.claim.namespace = namespace.into();
    d.pods = pods.iter().map(|p| (*p).to_owned()).collect();
    d
}

/// Capacity shares of two namespaces on one GPU and a per-claim MPS claim beside them, all
/// served as MPS clients, and two shares inside a MIG device: each gets its own memory and
/// activity from the pods' cgroups; a host process on the GPU is nobody's.
#[test]
fn shares_by_pod_over_the_mock() {
    match scenario().as_deref() {
        Some("h100") => {
            let (backend, devices, control) = setup();
            let mig = devices[1].mig.clone().unwrap();
            let gpu2 = devices[2].gpu_uuid.clone();
            let gpu1 = devices[1].gpu_uuid.clone();
            std::fs::write(
                &control,
                format!(
                    "process 2 100 1024 20 mps\nprocess 2 200 3072 15 mps\nprocess 2 500 2048 40 mps\n\
                     process 2 900 64 0\nprocess 2 300 512 50\n\
                     process 1 {gi} {ci} 600 256 0 mps\nprocess 1 {gi} {ci} 700 512 0 mps\n",
                    gi = mig.gi,
                    ci = mig.ci
                ),
            )
            .unwrap();
            let root = tempfile::tempdir().unwrap();
            proc_root(
                root.path(),
                &[
                    (100, Some(POD_A)),
                    (600, Some(POD_A)),
                    (200, Some(POD_B)),
                    (700, Some(POD_B)),
                    (500, Some(POD_C)),
                    (900, None),
                    (300, None),
                ],
            );
            let on_mig = |uid| device(uid, Holding::Share, &gpu1, Some(mig.clone()), &[]);
            let claims = vec![
                of_pods(
                    device("a", Holding::Share, &gpu2, None, &[]),
                    "team-a",
                    &[POD_A],
                ),
                of_pods(
                    device("b", Holding::Share, &gpu2, None, &[]),
                    "team-b",
                    &[POD_B],
                ),
                of_pods(
                    device("mps", Holding::Mps, &gpu2, None, &[900]),
                    "team-c",
                    &[POD_C],
                ),
                of_pods(on_mig("mig-a"), "team-a", &[POD_A]),
                of_pods(on_mig("mig-b"), "team-b", &[POD_B]),
            ];
            let mut sampler = UsageSampler::new(backend.usage_source().unwrap())
                .with_proc_root(root.path().to_path_buf());
            let r = sampler.sample(&claims);
            let s = &r.samples;
            assert!(s.iter().all(|s| s.errors.is_empty()), "{s:?}");
            let got: Vec<_> = s
                .iter()
                .map(|s| (s.memory_used, s.memory_source, s.activity))
                .collect();
            let measured = |percent| Activity::Measured {
                percent,
                source: ActivitySource::ProcessSmUtilization,
            };
            assert_eq!(
                got,
                [
                    (Some(1024 * MIB), MemorySource::MpsClients, measured(20.0)),
                    (Some(3072 * MIB), MemorySource::MpsClients, measured(15.0)),
                    // The claim's own server (by PID) and its client (by pod).
                    (Some(2112 * MIB), MemorySource::MpsClients, measured(40.0)),
                    // No per-process utilization in MIG mode.
                    (
                        Some(256 * MIB),
                        MemorySource::MpsClients,
                        Activity::NotAttributable
                    ),
                    (
                        Some(512 * MIB),
                        MemorySource::MpsClients,
                        Activity::NotAttributable
                    ),
                ]
            );
            // Nobody got the host process 300 (512 MiB, 50 %).
            let total: u64 = s.iter().take(3).filter_map(|s| s.memory_used).sum();
            assert_eq!(total, (1024 + 3072 + 2112) * MIB);
            // Per device: memory, compute list, MPS list; per GPU: per-process utilization.
            assert_eq!(r.queries, 7, "{r:?}");
        }
        Some(other) => panic!("unknown scenario {other}"),
        None => {
            let dir = tempfile::tempdir().unwrap();
            let config = dir.path().join("node.yaml");
            std::fs::write(&config, node("h100-80gb")).unwrap();
            let control = dir.path().join("control");
            std::fs::write(&control, "").unwrap();
            run_child(
                "shares_by_pod_over_the_mock",
                "h100",
                &[
                    ("MOCK_NVML_CONFIG", config.to_str().unwrap()),
                    ("MOCK_NVML_CONTROL", control.to_str().unwrap()),
                ],
            );
        }
    }
}
