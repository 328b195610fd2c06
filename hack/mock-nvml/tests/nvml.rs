//! Loads the built mock library through nvml-wrapper, as the driver does.
//!
//! The mock reads its environment at `nvmlInit`, and the environment is process-wide, so
//! every scenario runs in a child process: the test re-executes this test binary with
//! `--ignored --exact worker` and `MOCK_NVML_TEST_ACTION=<scenario>` plus the scenario's
//! `MOCK_NVML_*` variables. Children print `RESULT key=value` lines the parent checks.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::mem;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use mock_nvml::fixtures;
use mock_nvml::rc;
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::Brand;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings::*;

// ---------------------------------------------------------------------------------------
// Child-process plumbing

fn lib_path() -> PathBuf {
    mock_nvml::locate::cdylib_path().expect("built libmock_nvml.so next to the test binary")
}

fn spawn(action: &str, env: &[(&str, &str)]) -> std::process::Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--ignored",
        "--exact",
        "worker",
        "--nocapture",
        "--test-threads=1",
    ]);
    for (k, _) in std::env::vars() {
        if k.starts_with("MOCK_NVML_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("MOCK_NVML_TEST_ACTION", action);
    cmd.env("MOCK_NVML_LIB", lib_path());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdout(std::process::Stdio::piped());
    cmd.stderr(std::process::Stdio::piped());
    cmd.spawn().unwrap()
}

fn results(out: &Output) -> HashMap<String, String> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .filter_map(|l| l.find("RESULT ").map(|i| &l[i + 7..]))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn run(action: &str, env: &[(&str, &str)]) -> HashMap<String, String> {
    results(&spawn(action, env).wait_with_output().unwrap())
}

fn report(k: &str, v: impl std::fmt::Display) {
    println!("RESULT {k}={v}");
}

fn nvml() -> Nvml {
    let p = lib_path();
    Nvml::builder().lib_path(p.as_os_str()).init().unwrap()
}

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_default()
}

/// Entry point of child processes (does nothing unless started by `spawn`).
#[test]
#[ignore = "runs scenarios inside child processes started by the other tests"]
fn worker() {
    match env("MOCK_NVML_TEST_ACTION").as_str() {
        "profile" => child_profile(),
        "lifecycle" => child_lifecycle(),
        "create1g" => child_create_1g(),
        "list" => child_list(),
        "fail" => child_fail(),
        "missing" => child_missing(),
        "events" => child_events(),
        "usage" => child_usage(),
        "usage-ampere" => child_usage_ampere(),
        other => panic!("unknown action {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Raw NVML helpers (nvml-wrapper has no GI/CI API)

fn code(r: nvmlReturn_t) -> u32 {
    r
}

unsafe fn create_gi(
    n: &Nvml,
    dev: nvmlDevice_t,
    profile: u32,
    at: Option<(u32, u32)>,
) -> (u32, nvmlGpuInstance_t) {
    let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
    let r = match at {
        Some((start, size)) => {
            let p = nvmlGpuInstancePlacement_t { start, size };
            unsafe {
                n.lib()
                    .nvmlDeviceCreateGpuInstanceWithPlacement(dev, profile, &p, &mut gi)
            }
        }
        None => unsafe { n.lib().nvmlDeviceCreateGpuInstance(dev, profile, &mut gi) },
    };
    (code(r), gi)
}

unsafe fn gi_info(n: &Nvml, gi: nvmlGpuInstance_t) -> nvmlGpuInstanceInfo_t {
    let mut info: nvmlGpuInstanceInfo_t = unsafe { mem::zeroed() };
    assert_eq!(unsafe { n.lib().nvmlGpuInstanceGetInfo(gi, &mut info) }, 0);
    info
}

unsafe fn placements(n: &Nvml, dev: nvmlDevice_t, profile: u32) -> Vec<(u32, u32)> {
    let mut count = 0u32;
    let r = unsafe {
        n.lib().nvmlDeviceGetGpuInstancePossiblePlacements_v2(
            dev,
            profile,
            std::ptr::null_mut(),
            &mut count,
        )
    };
    assert_eq!(r, 0);
    let mut v = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
    let r = unsafe {
        n.lib().nvmlDeviceGetGpuInstancePossiblePlacements_v2(
            dev,
            profile,
            v.as_mut_ptr(),
            &mut count,
        )
    };
    assert_eq!(r, 0);
    v.iter().map(|p| (p.start, p.size)).collect()
}

// ---------------------------------------------------------------------------------------
// Profiles

/// (enum, id, name, slices, instances, memory MiB, SM, CE, DEC, ENC, JPG, OFA, placement
/// size, starts): H100 80GB HBM3 lgip/lgipp, MIG profile tables, docs/hardware-sources.md, written out independently of
/// the fixture code.
type Row = (
    u32,
    u32,
    &'static str,
    u32,
    u32,
    u64,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    &'static [u32],
);
const H100_ROWS: &[Row] = &[
    (
        0,
        19,
        "1g.10gb",
        1,
        7,
        9984,
        16,
        1,
        1,
        0,
        1,
        0,
        1,
        &[0, 1, 2, 3, 4, 5, 6],
    ),
    (
        7,
        20,
        "1g.10gb+me",
        1,
        1,
        9984,
        16,
        1,
        1,
        0,
        1,
        1,
        1,
        &[0, 1, 2, 3, 4, 5, 6],
    ),
    (
        9,
        15,
        "1g.20gb",
        1,
        4,
        20096,
        26,
        1,
        1,
        0,
        1,
        0,
        2,
        &[0, 2, 4, 6],
    ),
    (
        1,
        14,
        "2g.20gb",
        2,
        3,
        20096,
        32,
        2,
        2,
        0,
        2,
        0,
        2,
        &[0, 2, 4],
    ),
    (2, 9, "3g.40gb", 3, 2, 40448, 60, 3, 3, 0, 3, 0, 4, &[0, 4]),
    (3, 5, "4g.40gb", 4, 1, 40448, 64, 4, 4, 0, 4, 0, 4, &[0]),
    (4, 0, "7g.80gb", 7, 1, 81152, 132, 8, 7, 0, 7, 1, 8, &[0]),
];

fn child_profile() {
    let name = env("MOCK_NVML_PROFILE");
    let node = fixtures::node_profile(&name, None).unwrap();
    let n = nvml();
    assert_eq!(n.sys_driver_version().unwrap(), "570.148.08");
    assert_eq!(n.sys_cuda_driver_version().unwrap(), 12080);
    assert_eq!(n.sys_nvml_version().unwrap(), "12.570.148.08");
    assert_eq!(n.device_count().unwrap() as usize, node.gpus.len());
    for spec in &node.gpus {
        let d = n.device_by_index(spec.index).unwrap();
        let p = spec.product;
        assert_eq!(d.name().unwrap(), p.name);
        assert_eq!(d.uuid().unwrap(), spec.uuid);
        assert_eq!(d.index().unwrap(), spec.index);
        assert_eq!(d.minor_number().unwrap(), spec.minor);
        assert_eq!(d.serial().unwrap(), spec.serial);
        let mem = d.memory_info().unwrap();
        assert_eq!(mem.total, p.memory_mib << 20);
        assert_eq!(mem.free + mem.reserved + mem.used, mem.total);
        let pci = d.pci_info().unwrap();
        assert_eq!(pci.bus_id, spec.bus_id());
        assert_eq!(pci.pci_device_id, p.pci_device_id);
        assert_eq!(pci.pci_sub_system_id, Some(p.pci_subsystem_id));
        assert_eq!(
            n.device_by_pci_bus_id(spec.bus_id())
                .unwrap()
                .index()
                .unwrap(),
            spec.index
        );
        assert_eq!(
            n.device_by_uuid(spec.uuid.as_str())
                .unwrap()
                .index()
                .unwrap(),
            spec.index
        );
        assert_eq!(d.brand().unwrap(), Brand::Nvidia);
        let cc = d.cuda_compute_capability().unwrap();
        assert_eq!((cc.major, cc.minor), p.compute_capability);
        assert!(!d.mig_is_mig_device_handle().unwrap());
        assert_eq!(d.num_cores().unwrap(), p.sm_count * p.cores_per_sm);
        if !p.mig_capable() {
            assert!(matches!(d.mig_mode(), Err(NvmlError::NotSupported)));
            assert!(matches!(d.profile_info(0), Err(NvmlError::NotSupported)));
            assert_eq!(d.mig_device_count().unwrap(), 0);
            continue;
        }
        let mode = d.mig_mode().unwrap();
        assert_eq!((mode.current, mode.pending), (1, 1));
        assert_eq!(d.mig_device_count().unwrap(), 7);
        let mut seen = Vec::new();
        for e in 0..fixtures::GPU_INSTANCE_PROFILE_COUNT {
            match d.profile_info(e) {
                Ok(info) => {
                    let row = p.profile_by_enum(e).unwrap();
                    assert_eq!(info.id, row.id);
                    assert_eq!(info.slice_count, row.slice_count);
                    assert_eq!(info.instance_count, row.instance_count);
                    assert_eq!(info.memory_size_mb, row.memory_mib);
                    assert_eq!(info.multiprocessor_count, row.sm);
                    assert_eq!(
                        (
                            info.copy_engine_count,
                            info.decoder_count,
                            info.encoder_count,
                            info.jpeg_count,
                            info.ofa_count
                        ),
                        (row.ce, row.dec, row.enc, row.jpg, row.ofa)
                    );
                    assert!(!info.is_p2p_supported);
                    let pl = unsafe { placements(&n, d.handle(), info.id) };
                    let want: Vec<_> = row
                        .starts
                        .iter()
                        .map(|s| (*s, row.placement_size))
                        .collect();
                    assert_eq!(pl, want);
                    seen.push((e, info.id));
                }
                Err(NvmlError::NotSupported) => {}
                Err(other) => panic!("enum {e}: {other:?}"),
            }
        }
        assert_eq!(
            seen,
            vec![(0, 19), (1, 14), (2, 9), (3, 5), (4, 0), (7, 20), (9, 15)]
        );
        assert!(matches!(
            d.profile_info(fixtures::GPU_INSTANCE_PROFILE_COUNT),
            Err(NvmlError::InvalidArg)
        ));
    }
    let d0 = n.device_by_index(0).unwrap();
    report("arch", format!("{:?}", d0.architecture().unwrap()));
    report("name0", d0.name().unwrap());
    if let Ok(i) = d0.profile_info(0) {
        report("mem_1g", i.memory_size_mb);
    }
    if let Ok(i) = d0.profile_info(4) {
        report("mem_7g", i.memory_size_mb);
    }
    // v2 and v3 profile infos carry the plain profile name.
    if d0.mig_mode().is_ok() {
        unsafe {
            let mut v2: nvmlGpuInstanceProfileInfo_v2_t = mem::zeroed();
            v2.version = 0x0200_0098;
            assert_eq!(
                n.lib()
                    .nvmlDeviceGetGpuInstanceProfileInfoV(d0.handle(), 0, &mut v2),
                0
            );
            let name = std::ffi::CStr::from_ptr(v2.name.as_ptr())
                .to_str()
                .unwrap()
                .to_string();
            report("name_1g", &name);
            let mut v3: nvmlGpuInstanceProfileInfo_v3_t = mem::zeroed();
            v3.version = 0x0300_0098;
            let p3 = (&mut v3 as *mut nvmlGpuInstanceProfileInfo_v3_t).cast();
            assert_eq!(
                n.lib()
                    .nvmlDeviceGetGpuInstanceProfileInfoV(d0.handle(), 4, p3),
                0
            );
            assert_eq!(v3.id, 0);
            assert_eq!(v3.sliceCount, 7);
            v2.version = 1;
            assert_eq!(
                n.lib()
                    .nvmlDeviceGetGpuInstanceProfileInfoV(d0.handle(), 0, &mut v2),
                rc::ARGUMENT_VERSION_MISMATCH
            );
        }
    }
    report("ok", 1);
}

#[test]
fn every_builtin_profile_matches_its_product_table() {
    let dir = tempfile::tempdir().unwrap();
    type Expect<'a> = (&'a str, &'a str, Option<(&'a str, &'a str, &'a str)>);
    let mut expect: HashMap<&str, Expect> = HashMap::new();
    // (architecture, GPU name, (1g name, 1g MiB, 7g MiB)): device identity, docs/hardware-sources.md.
    expect.insert(
        "a100-40gb-x8",
        (
            "Ampere",
            "NVIDIA A100-SXM4-40GB",
            Some(("1g.5gb", "4864", "40192")),
        ),
    );
    expect.insert(
        "a100-80gb-x4",
        (
            "Ampere",
            "NVIDIA A100-SXM4-80GB",
            Some(("1g.10gb", "9728", "81152")),
        ),
    );
    expect.insert(
        "h100-80gb-x8",
        (
            "Hopper",
            "NVIDIA H100 80GB HBM3",
            Some(("1g.10gb", "9984", "81152")),
        ),
    );
    expect.insert(
        "h200-141gb-x8",
        (
            "Hopper",
            "NVIDIA H200",
            Some(("1g.18gb", "16384", "143104")),
        ),
    );
    expect.insert("l4-x2", ("Ada", "NVIDIA L4", None));
    assert_eq!(expect.len(), fixtures::PROFILE_NAMES.len());
    let children: Vec<_> = fixtures::PROFILE_NAMES
        .iter()
        .map(|p| {
            let state = dir.path().join(format!("{p}.json"));
            (
                p,
                spawn(
                    "profile",
                    &[
                        ("MOCK_NVML_PROFILE", p),
                        ("MOCK_NVML_STATE", state.to_str().unwrap()),
                    ],
                ),
            )
        })
        .collect();
    for (p, child) in children {
        let r = results(&child.wait_with_output().unwrap());
        let (arch, name, mig) = expect[*p];
        assert_eq!(r["arch"], arch, "{p}");
        assert_eq!(r["name0"], name, "{p}");
        match mig {
            Some((n1, m1, m7)) => {
                assert_eq!(r["name_1g"], n1, "{p}");
                assert_eq!(r["mem_1g"], m1, "{p}");
                assert_eq!(r["mem_7g"], m7, "{p}");
            }
            None => assert!(!r.contains_key("mem_1g"), "{p}"),
        }
    }
}

#[test]
fn h100_table_is_the_lgip_capture() {
    let p = fixtures::product("h100-80gb").unwrap();
    assert_eq!(p.mig_profiles.len(), H100_ROWS.len());
    for r in H100_ROWS {
        let g = p.profile_by_enum(r.0).unwrap();
        let got = (
            g.enum_index,
            g.id,
            g.name,
            g.slice_count,
            g.instance_count,
            g.memory_mib,
            g.sm,
        );
        assert_eq!(got, (r.0, r.1, r.2, r.3, r.4, r.5, r.6));
        let got = (g.ce, g.dec, g.enc, g.jpg, g.ofa, g.placement_size, g.starts);
        assert_eq!(got, (r.7, r.8, r.9, r.10, r.11, r.12, r.13));
    }
}

// ---------------------------------------------------------------------------------------
// GI / CI lifecycle

fn child_lifecycle() {
    let n = nvml();
    let d = n.device_by_index(0).unwrap();
    let h = unsafe { d.handle() };
    unsafe {
        // Invalid placements: wrong start, wrong size, unknown profile.
        assert_eq!(create_gi(&n, h, 9, Some((2, 4))).0, rc::INVALID_ARGUMENT);
        assert_eq!(create_gi(&n, h, 9, Some((0, 3))).0, rc::INVALID_ARGUMENT);
        assert_eq!(create_gi(&n, h, 42, None).0, rc::INVALID_ARGUMENT);
        // 3g at 4:4 -> GI 2.
        let (r, gi3) = create_gi(&n, h, 9, Some((4, 4)));
        assert_eq!(r, 0);
        let info = gi_info(&n, gi3);
        assert_eq!(
            (
                info.id,
                info.profileId,
                info.placement.start,
                info.placement.size
            ),
            (2, 9, 4, 4)
        );
        assert_eq!(info.device, h);
        // Overlaps / exhaustion.
        assert_eq!(
            create_gi(&n, h, 19, Some((5, 1))).0,
            rc::INSUFFICIENT_RESOURCES
        );
        assert_eq!(create_gi(&n, h, 0, None).0, rc::INSUFFICIENT_RESOURCES);
        assert_eq!(create_gi(&n, h, 5, Some((0, 4))).0, 0);
        assert_eq!(create_gi(&n, h, 19, None).0, rc::INSUFFICIENT_RESOURCES);
        let mut cap = 9u32;
        assert_eq!(
            n.lib()
                .nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19, &mut cap),
            0
        );
        assert_eq!(cap, 0);
        // Destroy the 4g (GI 1) again.
        let mut gi4: nvmlGpuInstance_t = std::ptr::null_mut();
        assert_eq!(n.lib().nvmlDeviceGetGpuInstanceById(h, 1, &mut gi4), 0);
        assert_eq!(n.lib().nvmlGpuInstanceDestroy(gi4), 0);
        assert_eq!(
            n.lib().nvmlGpuInstanceGetInfo(gi4, &mut mem::zeroed()),
            rc::INVALID_ARGUMENT
        );
        assert_eq!(
            n.lib().nvmlDeviceGetGpuInstanceById(h, 1, &mut gi4),
            rc::NOT_FOUND
        );
        assert_eq!(
            n.lib()
                .nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19, &mut cap),
            0
        );
        assert_eq!(cap, 4);
        // 1g without placement -> lowest free start 0 -> GI 7.
        let (r, gi1) = create_gi(&n, h, 19, None);
        assert_eq!(r, 0);
        assert_eq!(gi_info(&n, gi1).id, 7);

        // No MIG device before a CI exists.
        assert!(matches!(d.mig_device_by_index(0), Err(NvmlError::NotFound)));
        // CI profile info and creation in the 3g GI.
        let mut cip: nvmlComputeInstanceProfileInfo_t = mem::zeroed();
        assert_eq!(
            n.lib()
                .nvmlGpuInstanceGetComputeInstanceProfileInfo(gi3, 2, 0, &mut cip),
            0
        );
        assert_eq!(
            (
                cip.id,
                cip.sliceCount,
                cip.instanceCount,
                cip.multiprocessorCount
            ),
            (2, 3, 1, 60)
        );
        assert_eq!(
            n.lib()
                .nvmlGpuInstanceGetComputeInstanceProfileInfo(gi3, 4, 0, &mut cip),
            rc::NOT_SUPPORTED
        );
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        assert_eq!(
            n.lib()
                .nvmlGpuInstanceCreateComputeInstance(gi3, 2, &mut ci),
            0
        );
        let mut ci2: nvmlComputeInstance_t = std::ptr::null_mut();
        assert_eq!(
            n.lib()
                .nvmlGpuInstanceCreateComputeInstance(gi3, 2, &mut ci2),
            rc::INSUFFICIENT_RESOURCES
        );
        let mut cinfo: nvmlComputeInstanceInfo_t = mem::zeroed();
        assert_eq!(n.lib().nvmlComputeInstanceGetInfo_v2(ci, &mut cinfo), 0);
        assert_eq!(
            (
                cinfo.id,
                cinfo.profileId,
                cinfo.placement.start,
                cinfo.placement.size
            ),
            (0, 2, 0, 3)
        );
        assert_eq!(cinfo.device, h);
        assert_eq!(cinfo.gpuInstance, gi3);

        // The MIG device.
        let mig = d.mig_device_by_index(0).unwrap();
        assert!(matches!(d.mig_device_by_index(1), Err(NvmlError::NotFound)));
        assert!(mig.mig_is_mig_device_handle().unwrap());
        let uuid = mig.uuid().unwrap();
        assert!(uuid.starts_with("MIG-") && uuid.len() == 40, "{uuid}");
        assert_eq!(mig.name().unwrap(), "NVIDIA H100 80GB HBM3 MIG 3g.40gb");
        assert_eq!(mig.memory_info().unwrap().total, 40448 << 20);
        let a = mig.attributes().unwrap();
        assert_eq!(a.multiprocessor_count, 60);
        assert_eq!(a.shared_copy_engine_count, 3);
        assert_eq!(a.shared_decoder_count, 3);
        assert_eq!(a.shared_jpeg_count, 3);
        assert_eq!(a.gpu_instance_slice_count, 3);
        assert_eq!(a.compute_instance_slice_count, 3);
        assert_eq!(a.memory_size_mb, 40448);
        assert!(matches!(d.attributes(), Err(NvmlError::NotSupported)));
        assert_eq!(
            mig.mig_parent_device().unwrap().uuid().unwrap(),
            d.uuid().unwrap()
        );
        assert!(matches!(mig.minor_number(), Err(NvmlError::NotSupported)));
        let (mut gid, mut cid) = (99u32, 99u32);
        assert_eq!(
            n.lib().nvmlDeviceGetGpuInstanceId(mig.handle(), &mut gid),
            0
        );
        assert_eq!(
            n.lib()
                .nvmlDeviceGetComputeInstanceId(mig.handle(), &mut cid),
            0
        );
        assert_eq!((gid, cid), (2, 0));
        assert_eq!(
            n.device_by_uuid(uuid.as_str()).unwrap().uuid().unwrap(),
            uuid
        );

        // Enumeration.
        let mut gis = [std::ptr::null_mut(); 7];
        let mut count = 0u32;
        assert_eq!(
            n.lib()
                .nvmlDeviceGetGpuInstances(h, 19, gis.as_mut_ptr(), &mut count),
            0
        );
        assert_eq!(count, 1);
        assert_eq!(gis[0], gi1);
        let mut cis = [std::ptr::null_mut(); 8];
        assert_eq!(
            n.lib()
                .nvmlGpuInstanceGetComputeInstances(gi3, 2, cis.as_mut_ptr(), &mut count),
            0
        );
        assert_eq!((count, cis[0]), (1, ci));

        // MIG mode cannot be turned off while instances exist.
        assert!(matches!(d.set_mig_mode(false), Err(NvmlError::InUse)));
        // GI with a live CI is in use; destroy CI then GI.
        assert_eq!(n.lib().nvmlGpuInstanceDestroy(gi3), rc::IN_USE);
        assert_eq!(n.lib().nvmlComputeInstanceDestroy(ci), 0);
        assert_eq!(n.lib().nvmlComputeInstanceDestroy(ci), rc::INVALID_ARGUMENT);
        assert!(matches!(mig.uuid(), Err(NvmlError::InvalidArg)));
        assert_eq!(n.lib().nvmlGpuInstanceDestroy(gi3), 0);
        assert!(matches!(d.mig_device_by_index(0), Err(NvmlError::NotFound)));

        // Re-creating the same GI/CI yields a new MIG UUID.
        let (r, gi3b) = create_gi(&n, h, 9, Some((4, 4)));
        assert_eq!(r, 0);
        assert_eq!(
            n.lib()
                .nvmlGpuInstanceCreateComputeInstance(gi3b, 2, &mut ci),
            0
        );
        let uuid2 = d.mig_device_by_index(0).unwrap().uuid().unwrap();
        assert_ne!(uuid, uuid2);
        assert_eq!(n.lib().nvmlComputeInstanceDestroy(ci), 0);
        assert_eq!(n.lib().nvmlGpuInstanceDestroy(gi3b), 0);
        assert_eq!(n.lib().nvmlGpuInstanceDestroy(gi1), 0);

        // MIG off: GI creation not supported, mode reads back.
        assert_eq!(d.set_mig_mode(false).unwrap(), 0);
        assert_eq!(d.mig_mode().unwrap().current, 0);
        assert_eq!(create_gi(&n, h, 19, None).0, rc::NOT_SUPPORTED);
        assert!(matches!(d.profile_info(0), Err(NvmlError::NotSupported)));
        assert_eq!(d.mig_device_count().unwrap(), 0);
        assert_eq!(placements(&n, h, 19).len(), 7);
        assert_eq!(d.set_mig_mode(true).unwrap(), 0);
    }
    report("ok", 1);
}

#[test]
fn gpu_and_compute_instances_follow_nvml_rules() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state.json");
    let r = run("lifecycle", &[("MOCK_NVML_STATE", state.to_str().unwrap())]);
    assert_eq!(r["ok"], "1");
}

// ---------------------------------------------------------------------------------------
// Several processes, one state file

fn child_create_1g() {
    let n = nvml();
    let d = n
        .device_by_index(env("MOCK_NVML_TEST_GPU").parse().unwrap())
        .unwrap();
    unsafe {
        let (r, gi) = create_gi(&n, d.handle(), 19, None);
        assert_eq!(r, 0);
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        assert_eq!(
            n.lib().nvmlGpuInstanceCreateComputeInstance(gi, 0, &mut ci),
            0
        );
        report("gi", gi_info(&n, gi).id);
    }
}

fn child_list() {
    let n = nvml();
    let d = n
        .device_by_index(env("MOCK_NVML_TEST_GPU").parse().unwrap())
        .unwrap();
    let mut out = Vec::new();
    for i in 0..d.mig_device_count().unwrap() {
        match d.mig_device_by_index(i) {
            Ok(m) => out.push(m.uuid().unwrap()),
            Err(NvmlError::NotFound) => {}
            Err(e) => panic!("{e:?}"),
        }
    }
    report("mig", out.join(","));
    report("name", d.name().unwrap());
    match d.mig_mode() {
        Ok(m) => report("mode", m.current),
        Err(NvmlError::NotSupported) => report("mode", "unsupported"),
        Err(e) => panic!("{e:?}"),
    }
}

#[test]
fn processes_share_state_and_it_survives_restart_but_not_reboot() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state.json");
    let s = state.to_str().unwrap();
    let base = [
        ("MOCK_NVML_STATE", s),
        ("MOCK_NVML_BOOT_ID", "boot-1"),
        ("MOCK_NVML_TEST_GPU", "3"),
    ];
    let r = run("create1g", &base);
    assert_eq!(r["gi"], "7");
    let first = run("list", &base)["mig"].clone();
    assert!(first.starts_with("MIG-"));
    // Six concurrent processes each create one 1g instance on the same GPU.
    let kids: Vec<_> = (0..6).map(|_| spawn("create1g", &base)).collect();
    let mut ids: Vec<u32> = kids
        .into_iter()
        .map(|k| {
            results(&k.wait_with_output().unwrap())["gi"]
                .parse()
                .unwrap()
        })
        .collect();
    ids.sort();
    assert_eq!(ids, vec![8, 9, 10, 11, 12, 13]);
    // The GPU is full now; a restart (new process) sees all seven, the first unchanged.
    let k = spawn("create1g", &base).wait_with_output().unwrap();
    assert!(!k.status.success());
    let after = run("list", &base)["mig"].clone();
    assert_eq!(after.split(',').count(), 7);
    assert!(after.starts_with(&first));
    // Another GPU is untouched.
    let other = [
        ("MOCK_NVML_STATE", s),
        ("MOCK_NVML_BOOT_ID", "boot-1"),
        ("MOCK_NVML_TEST_GPU", "2"),
    ];
    assert_eq!(run("list", &other)["mig"], "");
    // A reboot clears instances but keeps MIG mode.
    let reboot = [
        ("MOCK_NVML_STATE", s),
        ("MOCK_NVML_BOOT_ID", "boot-2"),
        ("MOCK_NVML_TEST_GPU", "3"),
    ];
    let r = run("list", &reboot);
    assert_eq!((r["mig"].as_str(), r["mode"].as_str()), ("", "1"));
    // Deleting the state file is a reboot too; MOCK_NVML_MIG=off starts with MIG off.
    std::fs::remove_file(&state).unwrap();
    let mut off = reboot.to_vec();
    off.push(("MOCK_NVML_MIG", "off"));
    assert_eq!(run("list", &off)["mode"], "0");
}

// ---------------------------------------------------------------------------------------
// Hooks

fn child_fail() {
    let n = nvml();
    let d1 = n.device_by_index(1).unwrap();
    let d2 = n.device_by_index(2).unwrap();
    assert!(d1.uuid().is_ok());
    assert!(matches!(d2.uuid(), Err(NvmlError::Unknown)));
    unsafe {
        assert_eq!(
            create_gi(&n, d1.handle(), 19, Some((0, 1))).0,
            rc::INSUFFICIENT_RESOURCES
        );
        assert_eq!(create_gi(&n, d1.handle(), 19, None).0, 0);
    }
    // The control file is re-read on every call.
    let ctl = PathBuf::from(env("MOCK_NVML_CONTROL"));
    assert!(d1.name().is_ok());
    std::fs::write(&ctl, "# injected\nfail nvmlDeviceGetName@1=15\n").unwrap();
    assert!(matches!(d1.name(), Err(NvmlError::GpuLost)));
    assert!(d2.name().is_ok());
    std::fs::write(&ctl, "lost 2\n").unwrap();
    assert!(d1.name().is_ok());
    assert!(matches!(d2.name(), Err(NvmlError::GpuLost)));
    std::fs::write(&ctl, "").unwrap();
    assert!(d2.name().is_ok());

    // A process attached to a compute instance: its destroy is IN_USE (nvml.h), and so
    // is its GPU instance's (compute instances exist); detached, both go.
    unsafe {
        // (GI creation with a placement fails by MOCK_NVML_FAIL here: the lowest free 3g.)
        let (r, gi) = create_gi(&n, d1.handle(), 9, None);
        assert_eq!(r, 0);
        let gi_id = gi_info(&n, gi).id;
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        // NO_PERMISSION (4) injected like any code, from the control file.
        std::fs::write(&ctl, "nvmlGpuInstanceCreateComputeInstance=4\n").unwrap();
        assert_eq!(
            n.lib().nvmlGpuInstanceCreateComputeInstance(gi, 2, &mut ci),
            rc::NO_PERMISSION
        );
        // Creation latency: the call takes at least the configured time.
        std::fs::write(&ctl, "delay nvmlGpuInstanceCreateComputeInstance 200\n").unwrap();
        let started = std::time::Instant::now();
        assert_eq!(
            n.lib().nvmlGpuInstanceCreateComputeInstance(gi, 2, &mut ci),
            0
        );
        assert!(started.elapsed() >= std::time::Duration::from_millis(200));
        let mut info: nvmlComputeInstanceInfo_t = mem::zeroed();
        assert_eq!(n.lib().nvmlComputeInstanceGetInfo_v2(ci, &mut info), 0);
        std::fs::write(&ctl, format!("attach 1 {gi_id} {}\n", info.id)).unwrap();
        assert_eq!(n.lib().nvmlComputeInstanceDestroy(ci), rc::IN_USE);
        assert_eq!(n.lib().nvmlGpuInstanceDestroy(gi), rc::IN_USE);
        std::fs::write(&ctl, format!("attach 1 {gi_id} {}\n", info.id + 1)).unwrap();
        assert_eq!(n.lib().nvmlComputeInstanceDestroy(ci), 0);
        assert_eq!(n.lib().nvmlGpuInstanceDestroy(gi), 0);
        std::fs::write(&ctl, "").unwrap();
    }
    report("ok", 1);
}

fn child_missing() {
    let p = lib_path();
    let r = Nvml::builder().lib_path(p.as_os_str()).init();
    report("init", format!("{:?}", r.err()));
}

#[test]
fn injected_errors_return_the_chosen_codes() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state.json");
    let ctl = dir.path().join("control");
    let r = run(
        "fail",
        &[
            ("MOCK_NVML_STATE", state.to_str().unwrap()),
            ("MOCK_NVML_CONTROL", ctl.to_str().unwrap()),
            (
                "MOCK_NVML_FAIL",
                "nvmlDeviceCreateGpuInstanceWithPlacement=23,nvmlDeviceGetUUID@2=999",
            ),
        ],
    );
    assert_eq!(r["ok"], "1");
    let r = run("missing", &[("MOCK_NVML_DRIVER_MISSING", "1")]);
    assert_eq!(r["init"], "Some(DriverNotLoaded)");
    let r = run("missing", &[("MOCK_NVML_FAIL", "nvmlInit_v2=18")]);
    assert_eq!(r["init"], "Some(LibRmVersionMismatch)");
    let r = run("missing", &[("MOCK_NVML_PROFILE", "no-such-profile")]);
    assert_eq!(r["init"], "Some(Unknown)");
}

fn wait_raw(n: &Nvml, set: nvmlEventSet_t, ms: u32) -> Result<nvmlEventData_t, u32> {
    let mut data: nvmlEventData_t = unsafe { mem::zeroed() };
    match unsafe { n.lib().nvmlEventSetWait_v2(set, &mut data, ms) } {
        0 => Ok(data),
        c => Err(c),
    }
}

fn child_events() {
    let n = nvml();
    let ctl = PathBuf::from(env("MOCK_NVML_CONTROL"));
    let events = PathBuf::from(env("MOCK_NVML_EVENTS"));
    let d0 = n.device_by_index(0).unwrap();
    let d1 = n.device_by_index(1).unwrap();
    let want = EventTypes::CRITICAL_XID_ERROR
        | EventTypes::SINGLE_BIT_ECC_ERROR
        | EventTypes::DOUBLE_BIT_ECC_ERROR;
    assert!(d0.supported_event_types().unwrap().contains(want));
    let set = n.create_event_set().unwrap();
    let set = d0.register_events(want, set).unwrap();
    let set = d1.register_events(want, set).unwrap();
    // Nothing injected: timeout after roughly the requested time.
    let t = Instant::now();
    assert!(matches!(set.wait(100), Err(NvmlError::Timeout)));
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(100) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    // Xid from the control file, with GI/CI IDs.
    std::fs::write(&ctl, "xid 1 79 7 0\n").unwrap();
    let h = unsafe { set.handle() };
    let e = wait_raw(&n, h, 1000).unwrap();
    assert_eq!(e.device, unsafe { d1.handle() });
    assert_eq!(
        (
            e.eventType,
            e.eventData,
            e.gpuInstanceId,
            e.computeInstanceId
        ),
        (8, 79, 7, 0)
    );
    // Delivered once per set.
    assert_eq!(wait_raw(&n, h, 50).err(), Some(rc::TIMEOUT));
    // A second set gets it too; a GPU the set did not register is not delivered.
    let set2 = n.create_event_set().unwrap();
    let set2 = d0.register_events(want, set2).unwrap();
    assert!(matches!(set2.wait(50), Err(NvmlError::Timeout)));
    let set2 = d1.register_events(want, set2).unwrap();
    let e = set2.wait(1000).unwrap();
    assert_eq!(e.device.uuid().unwrap(), d1.uuid().unwrap());
    assert_eq!(format!("{:?}", e.event_data), "Some(Value(79))");
    // Events file (written while a wait is pending), no GI/CI -> 0xFFFFFFFF.
    let writer = {
        let events = events.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            std::fs::write(&events, "0 48\n").unwrap();
        })
    };
    let e = wait_raw(&n, h, 5000).unwrap();
    writer.join().unwrap();
    assert_eq!(
        (e.eventData, e.gpuInstanceId, e.computeInstanceId),
        (48, u32::MAX, u32::MAX)
    );
    assert_eq!(e.device, unsafe { d0.handle() });
    // A lost GPU makes Wait fail with GPU_IS_LOST.
    std::fs::write(&ctl, "xid 1 79 7 0\nlost 1\n").unwrap();
    assert_eq!(wait_raw(&n, h, 50).err(), Some(rc::GPU_IS_LOST));
    drop(set2);
    set.release_events().unwrap();
    report("ok", 1);
}

#[test]
fn xid_events_are_delivered_once_per_event_set() {
    let dir = tempfile::tempdir().unwrap();
    let p = |f: &str| dir.path().join(f).to_str().unwrap().to_string();
    let r = run(
        "events",
        &[
            ("MOCK_NVML_STATE", &p("state.json")),
            ("MOCK_NVML_CONTROL", &p("control")),
            ("MOCK_NVML_EVENTS", &p("events")),
        ],
    );
    assert_eq!(r["ok"], "1");
}

#[test]
fn yaml_config_describes_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("node.yaml");
    std::fs::write(
        &cfg,
        "name: mixed\ndriverVersion: 570.148.08\ngpus:\n  - product: h100-80gb\n    count: 1\n  - product: l4\n",
    )
    .unwrap();
    let state = dir.path().join("s.json");
    let r = run(
        "list",
        &[
            ("MOCK_NVML_CONFIG", cfg.to_str().unwrap()),
            ("MOCK_NVML_STATE", state.to_str().unwrap()),
            ("MOCK_NVML_TEST_GPU", "0"),
        ],
    );
    assert_eq!((r["mig"].as_str(), r["mode"].as_str()), ("", "1"));
    assert_eq!(r["name"], "NVIDIA H100 80GB HBM3");
    let r = run(
        "list",
        &[
            ("MOCK_NVML_CONFIG", cfg.to_str().unwrap()),
            ("MOCK_NVML_STATE", state.to_str().unwrap()),
            ("MOCK_NVML_TEST_GPU", "1"),
        ],
    );
    assert_eq!((r["mig"].as_str(), r["mode"].as_str()), ("", "unsupported"));
    assert_eq!(r["name"], "NVIDIA L4");
}

const MIB: u64 = 1 << 20;

fn gpm_pair<'n>(
    n: &'n Nvml,
    ctl: &std::path::Path,
    lines: &str,
    take: impl Fn() -> Result<nvml_wrapper::GpmSample<'n>, NvmlError>,
) -> Vec<Result<f64, NvmlError>> {
    use nvml_wrapper::enums::gpm::GpmMetricId;
    let s1 = take().unwrap();
    std::fs::write(ctl, lines).unwrap();
    let s2 = take().unwrap();
    nvml_wrapper::gpm::gpm_metrics_get(
        n,
        &s1,
        &s2,
        &[
            GpmMetricId::SmUtil,
            GpmMetricId::SmOccupancy,
            GpmMetricId::DramBwUtil,
        ],
    )
    .unwrap()
    .into_iter()
    .map(|r| r.map(|m| m.value))
    .collect()
}

fn child_usage() {
    let n = nvml();
    let ctl = PathBuf::from(env("MOCK_NVML_CONTROL"));
    let base = "memory 0 30720\nutil 0 85 40\nprocess 0 4242 1024 60\nprocess 0 4343 2048 0\n";
    std::fs::write(&ctl, format!("{base}gpm 0 35.5 20\n")).unwrap();
    let d0 = n.device_by_index(0).unwrap();
    let d1 = n.device_by_index(1).unwrap();
    // Whole GPU, MIG off: memory, utilization, processes, per-process utilization.
    let m = d0.memory_info().unwrap();
    assert_eq!(m.used, 30720 * MIB);
    assert_eq!(m.free, m.total - m.reserved - m.used);
    let u = d0.utilization_rates().unwrap();
    assert_eq!((u.gpu, u.memory), (85, 40));
    let procs = d0.running_compute_processes().unwrap();
    assert_eq!(
        procs.iter().map(|p| p.pid).collect::<Vec<_>>(),
        [4242, 4343]
    );
    assert_eq!(
        format!("{:?}", procs[0].used_gpu_memory),
        format!("Used({})", 1024 * MIB)
    );
    assert_eq!(
        (procs[0].gpu_instance_id, procs[0].compute_instance_id),
        (None, None)
    );
    let pu = d0.process_utilization_stats(None).unwrap();
    assert_eq!(
        pu.len(),
        1,
        "only processes with non-zero utilization have samples"
    );
    assert_eq!((pu[0].pid, pu[0].sm_util), (4242, 60));
    assert!(matches!(
        d0.process_utilization_stats(u64::MAX),
        Err(NvmlError::NotFound)
    ));
    assert!(matches!(
        d1.process_utilization_stats(None),
        Err(NvmlError::NotFound)
    ));
    assert_eq!(d1.memory_info().unwrap().used, 0);
    assert!(d1.running_compute_processes().unwrap().is_empty());
    assert!(d0.mps_running_compute_processes().unwrap().is_empty());
    // MPS clients: listed by the MPS call only, same struct and INSUFFICIENT_SIZE protocol.
    std::fs::write(
        &ctl,
        format!("{base}process 0 5151 512 30 mps\nprocess 0 5252 256 0 mps\n"),
    )
    .unwrap();
    unsafe {
        let mut count = 0;
        let r = n.lib().nvmlDeviceGetMPSComputeRunningProcesses_v3(
            d0.handle(),
            &mut count,
            std::ptr::null_mut(),
        );
        assert_eq!((r, count), (rc::INSUFFICIENT_SIZE, 2));
        let mut infos: [nvmlProcessInfo_t; 2] = mem::zeroed();
        let mut count = 2;
        let r = n.lib().nvmlDeviceGetMPSComputeRunningProcesses_v3(
            d0.handle(),
            &mut count,
            infos.as_mut_ptr(),
        );
        assert_eq!((r, count), (0, 2));
        assert_eq!((infos[0].pid, infos[0].usedGpuMemory), (5151, 512 * MIB));
        assert_eq!(infos[1].gpuInstanceId, u32::MAX, "no GI outside MIG mode");
    }
    let clients = d0.mps_running_compute_processes().unwrap();
    assert_eq!(
        clients.iter().map(|p| p.pid).collect::<Vec<_>>(),
        [5151, 5252]
    );
    assert_eq!(
        d0.running_compute_processes()
            .unwrap()
            .iter()
            .map(|p| p.pid)
            .collect::<Vec<_>>(),
        [4242, 4343],
        "the plain list has no MPS client"
    );
    assert!(
        d0.process_utilization_stats(None)
            .unwrap()
            .iter()
            .any(|s| s.pid == 5151 && s.sm_util == 30),
        "clients have per-process samples"
    );
    std::fs::write(&ctl, format!("{base}gpm 0 35.5 20\n")).unwrap();
    // GPM on the whole GPU: the figures scripted at the second sample.
    assert!(d0.gpm_support().unwrap());
    let got = gpm_pair(&n, &ctl, &format!("{base}gpm 0 50 25\n"), || {
        d0.gpm_sample()
    });
    assert_eq!(got[0].as_ref().unwrap(), &50.0);
    assert_eq!(got[1].as_ref().unwrap(), &25.0);
    assert!(
        matches!(got[2], Err(NvmlError::NotSupported)),
        "{:?}",
        got[2]
    );
    // Samples of two devices do not mix; a freed sample is gone.
    let a = d0.gpm_sample().unwrap();
    let b = d1.gpm_sample().unwrap();
    assert!(matches!(
        nvml_wrapper::gpm::gpm_metrics_get(
            &n,
            &a,
            &b,
            &[nvml_wrapper::enums::gpm::GpmMetricId::SmUtil]
        ),
        Err(NvmlError::InvalidArg)
    ));
    let raw = a.into_handle();
    unsafe {
        assert_eq!(n.lib().nvmlGpmSampleFree(raw), 0);
        assert_eq!(n.lib().nvmlGpmSampleFree(raw), rc::INVALID_ARGUMENT);
    }
    // MIG on GPU 1 with one 1g device (GI 7, CI 0).
    let mig = unsafe {
        let mut status = 0;
        assert_eq!(n.lib().nvmlDeviceSetMigMode(d1.handle(), 1, &mut status), 0);
        let (r, gi) = create_gi(&n, d1.handle(), 19, Some((0, 1)));
        assert_eq!(r, 0);
        assert_eq!(gi_info(&n, gi).id, 7);
        let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
        assert_eq!(
            n.lib().nvmlGpuInstanceCreateComputeInstance(gi, 0, &mut ci),
            0
        );
        d1.mig_device_by_index(0).unwrap()
    };
    let mig_lines = format!("{base}memory 1 7 0 2048\nprocess 1 7 0 5555 512 10\ngpm 1 7 12 6\n");
    std::fs::write(&ctl, &mig_lines).unwrap();
    let mm = mig.memory_info().unwrap();
    assert_eq!(mm.used, 2048 * MIB);
    assert_eq!(mm.total, 9984 * MIB, "1g.10gb of the H100 capture");
    // nvml.h: no utilization rates, no per-process utilization on MIG-enabled GPUs.
    assert!(matches!(
        mig.utilization_rates(),
        Err(NvmlError::NotSupported)
    ));
    assert!(matches!(
        d1.utilization_rates(),
        Err(NvmlError::NotSupported)
    ));
    assert!(matches!(
        d1.process_utilization_stats(None),
        Err(NvmlError::NotSupported)
    ));
    assert!(matches!(
        mig.process_utilization_stats(None),
        Err(NvmlError::NotSupported)
    ));
    let p = mig.running_compute_processes().unwrap();
    assert_eq!(p.len(), 1);
    assert_eq!(
        (p[0].pid, p[0].gpu_instance_id, p[0].compute_instance_id),
        (5555, Some(7), Some(0))
    );
    assert_eq!(
        d1.running_compute_processes().unwrap().len(),
        1,
        "aggregate on the GPU handle"
    );
    // GPM per GPU instance, through the parent and through the MIG handle.
    assert!(mig.gpm_support().unwrap());
    let got = gpm_pair(&n, &ctl, &mig_lines, || d1.gpm_mig_sample(7));
    assert_eq!(
        (got[0].as_ref().unwrap(), got[1].as_ref().unwrap()),
        (&12.0, &6.0)
    );
    let got = gpm_pair(&n, &ctl, &mig_lines, || mig.gpm_sample());
    assert_eq!(got[0].as_ref().unwrap(), &12.0);
    assert!(matches!(d1.gpm_mig_sample(3), Err(NvmlError::InvalidArg)));
    assert!(
        matches!(d0.gpm_mig_sample(7), Err(NvmlError::InvalidArg)),
        "MIG off on GPU 0"
    );
    report("ok", 1);
}

fn child_usage_ampere() {
    let n = nvml();
    let d0 = n.device_by_index(0).unwrap();
    std::fs::write(env("MOCK_NVML_CONTROL"), "util 0 63\n").unwrap();
    assert!(!d0.gpm_support().unwrap());
    assert!(matches!(d0.gpm_sample(), Err(NvmlError::NotSupported)));
    assert_eq!(d0.utilization_rates().unwrap().gpu, 63);
    report("ok", 1);
}

#[test]
fn usage_calls_answer_the_scripted_figures_and_not_supported_where_nvml_does() {
    for (action, profile, mig) in [
        ("usage", "h100-80gb-x8", "off"),
        ("usage-ampere", "a100-40gb-x8", "off"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let p = |f: &str| dir.path().join(f).to_str().unwrap().to_string();
        let r = run(
            action,
            &[
                ("MOCK_NVML_PROFILE", profile),
                ("MOCK_NVML_MIG", mig),
                ("MOCK_NVML_STATE", &p("state.json")),
                ("MOCK_NVML_CONTROL", &p("control")),
            ],
        );
        assert_eq!(r["ok"], "1", "{action}");
    }
}
