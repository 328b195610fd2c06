//! The CDI spec of a whole-GPU claim over driver roots laid out like an Ubuntu and a RHEL
//! host, checked against what NVIDIA's container toolkit discovers for the same root
//! (NVIDIA/nvidia-container-toolkit `pkg/nvcdi/driver-nvml.go`: the libraries of the
//! driver's version, mounted as files with their soname links made by the hook; the tools;
//! `internal/discover/ipc.go`: the persistenced and fabric-manager sockets; the
//! `createContainer` hooks create-symlinks, enable-cuda-compat, update-ldcache,
//! disable-device-node-modification in that order; `NVIDIA_CTK_LIBCUDA_DIR`). Device nodes
//! are described by type and numbers. GSP firmware is deliberately not mounted: the kernel
//! module loads it, containers never do.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use cleave_driver::cdi::{self, CdiDevice, CdiStore, ContainerEdits};
use cleave_driver::driver_root::{DriverFiles, DriverRootConfig};
use mock_nvml::driver_root::{
    DRIVER_VERSION, DriverRootFixture, HostLayout, LIBRARIES, STALE_LIBRARY, TOOLS, UVM_MAJOR,
};
use serde_json::Value;

const UID: &str = "0c1d2e3f-4a5b-4c6d-8e7f-8091a2b3c4d5";
const HOOK: &str = "/var/lib/kubelet/plugins/gpu.cleave.dev/bin/cleave-cdi-hook";

fn spec_for(layout: HostLayout, dir: &Path) -> (Value, Vec<u8>) {
    let root = dir.join("root");
    DriverRootFixture {
        layout,
        ..DriverRootFixture::with_minors([0, 1])
    }
    .lay_out(&root)
    .unwrap();
    let files = DriverFiles::discover(&DriverRootConfig {
        root: root.clone(),
        host_root: None,
        dev_root: Some(root.clone()),
        proc_root: dir.join("no-kernel-proc"),
    })
    .unwrap();
    let cdi_root = dir.join("cdi");
    std::fs::create_dir_all(&cdi_root).unwrap();
    let store = CdiStore::new(&cdi_root, files.common_edits(Some(Path::new(HOOK))));
    let devices = [CdiDevice {
        device_name: "gpu-0".into(),
        edits: cdi::gpu_device_edits(&files, "gpu-0", "GPU-0000", 0),
    }];
    let path = store
        .write_claim_spec(UID, &devices, &ContainerEdits::default())
        .unwrap();
    let bytes = std::fs::read(&path).unwrap();
    (serde_json::from_slice(&bytes).unwrap(), bytes)
}

fn strings<'a>(v: &'a Value, key: &str) -> Vec<&'a str> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|m| m[key].as_str().unwrap())
        .collect()
}

fn check(layout: HostLayout, lib_dir: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (spec, bytes) = spec_for(layout, dir.path());
    let root = dir.path().join("root");
    container_device_interface::schema::validate_builtin(&bytes).unwrap();
    let edits = &spec["containerEdits"];

    // Device nodes, fully described.
    let nodes: Vec<(String, String, i64, i64)> = edits["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["path"].as_str().unwrap().to_owned(),
                n["type"].as_str().unwrap().to_owned(),
                n["major"].as_i64().unwrap(),
                n["minor"].as_i64().unwrap(),
            )
        })
        .collect();
    let uvm = i64::from(UVM_MAJOR);
    assert_eq!(
        nodes,
        [
            ("/dev/nvidiactl".into(), "c".into(), 195, 255),
            ("/dev/nvidia-uvm".into(), "c".into(), uvm, 0),
            ("/dev/nvidia-uvm-tools".into(), "c".into(), uvm, 1),
            ("/dev/nvidia-modeset".into(), "c".into(), 195, 254),
        ]
    );
    let gpu = &spec["devices"][0]["containerEdits"]["deviceNodes"][0];
    assert_eq!(
        (&gpu["path"], &gpu["type"], &gpu["major"], &gpu["minor"]),
        (
            &Value::from("/dev/nvidia0"),
            &Value::from("c"),
            &Value::from(195),
            &Value::from(0)
        )
    );

    // Mounts: every library of the driver's version as a file, the tools, the socket.
    let mounts = strings(&edits["mounts"], "containerPath");
    let host = strings(&edits["mounts"], "hostPath");
    for (name, _) in LIBRARIES {
        let want = format!("/{lib_dir}/{name}.so.{DRIVER_VERSION}");
        assert!(
            mounts.contains(&want.as_str()),
            "{want} not mounted: {mounts:?}"
        );
    }
    for tool in TOOLS {
        let want = format!("/usr/bin/{tool}");
        assert!(mounts.contains(&want.as_str()), "{want} not mounted");
    }
    assert!(mounts.contains(&"/run/nvidia-persistenced/socket"));
    for m in &mounts {
        let name = m.rsplit('/').next().unwrap();
        assert!(
            !name.ends_with(".so.1") && !name.ends_with(".so.0") && !name.ends_with(".so.4"),
            "a soname link is mounted instead of made by the hook: {m}"
        );
        assert!(!m.contains("firmware"), "firmware mounted: {m}");
        for foreign in [
            "libc.so.6",
            "libm.so.6",
            "libcudart",
            "libnvidia-mlx",
            STALE_LIBRARY,
        ] {
            assert!(!m.ends_with(foreign), "{m} is not this driver's");
        }
    }
    assert_eq!(
        mounts.len(),
        LIBRARIES.len() + TOOLS.len() + 1,
        "{mounts:?}"
    );
    for h in &host {
        assert!(h.starts_with(&root.display().to_string()), "{h}");
    }

    // Environment.
    let env = strings_plain(&edits["env"]);
    assert!(env.contains(&"NVIDIA_VISIBLE_DEVICES=void".to_owned()));
    assert!(
        env.contains(&format!("NVIDIA_CTK_LIBCUDA_DIR=/{lib_dir}")),
        "{env:?}"
    );

    // Hooks, in the toolkit's order, all createContainer, all cleave's hook.
    let hooks = edits["hooks"].as_array().unwrap();
    let args: Vec<Vec<String>> = hooks
        .iter()
        .map(|h| {
            assert_eq!(h["hookName"], "createContainer");
            assert_eq!(h["path"], HOOK);
            strings_plain(&h["args"])
        })
        .collect();
    let subcommands: Vec<&str> = args.iter().map(|a| a[1].as_str()).collect();
    assert_eq!(
        subcommands,
        [
            "create-symlinks",
            "enable-cuda-compat",
            "update-ldcache",
            "disable-device-node-modification"
        ]
    );
    assert!(args.iter().all(|a| a[0] == "cleave-cdi-hook"));
    let links = &args[0];
    for link in [
        format!("libnvidia-ml.so.{DRIVER_VERSION}::/{lib_dir}/libnvidia-ml.so.1"),
        format!("libcuda.so.{DRIVER_VERSION}::/{lib_dir}/libcuda.so.1"),
        format!("libnvidia-nvvm.so.{DRIVER_VERSION}::/{lib_dir}/libnvidia-nvvm.so.4"),
        format!("libGLX_nvidia.so.{DRIVER_VERSION}::/{lib_dir}/libGLX_nvidia.so.0"),
        format!("libcuda.so.1::/{lib_dir}/libcuda.so"),
    ] {
        let at = links.iter().position(|a| *a == link);
        assert!(
            at.is_some_and(|i| links[i - 1] == "--link"),
            "{link} not in {links:?}"
        );
    }
    assert_eq!(
        args[1],
        [
            "cleave-cdi-hook",
            "enable-cuda-compat",
            &format!("--host-driver-version={DRIVER_VERSION}")
        ]
    );
    assert_eq!(
        args[2],
        [
            "cleave-cdi-hook",
            "update-ldcache",
            "--folder",
            &format!("/{lib_dir}")
        ]
    );
}

fn strings_plain(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn ubuntu_host_spec_matches_the_toolkits_discovery() {
    check(HostLayout::Ubuntu, "usr/lib/x86_64-linux-gnu");
}

#[test]
fn rhel_host_spec_matches_the_toolkits_discovery() {
    check(HostLayout::Rhel, "usr/lib64");
}

#[test]
fn without_a_hook_path_the_spec_has_no_hooks_but_everything_else() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    DriverRootFixture::with_minors([0]).lay_out(&root).unwrap();
    let files = DriverFiles::discover(&DriverRootConfig::at(&root)).unwrap();
    let edits = files.common_edits(None);
    assert!(edits.hooks.is_empty());
    assert!(!edits.mounts.is_empty());
    assert_eq!(files.driver_version.as_deref(), Some(DRIVER_VERSION));
}
