//! The claim spec files cleave writes are valid CDI: checked against the JSON schema the
//! `container-device-interface` crate embeds (v1.1.0), against a newer upstream schema when
//! `CLEAVE_CDI_SCHEMA_DIR` names a directory holding its `schema.json` and `defs.json` (from
//! cncf-tags/container-device-interface `schema/`), and by loading
//! them the way a runtime does (`read_spec`: strict decoding plus semantic validation).
//! Without `CLEAVE_CDI_SCHEMA_DIR` the upstream check is reported as skipped, never as
//! passed, and under CI (which points it at the project's copy) it fails.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use cleave_driver::cdi::{self, CdiDevice, CdiStore, ContainerEdits};
use cleave_driver::driver_root::{DriverFiles, DriverRootConfig};

fn main() -> std::process::ExitCode {
    cleave_testkit::runner::main(&[
        (
            "spec_validates_against_the_embedded_schema_and_loads_like_a_runtime",
            spec_validates_against_the_embedded_schema_and_loads_like_a_runtime,
        ),
        (
            "spec_validates_against_the_upstream_schema_copy",
            spec_validates_against_the_upstream_schema_copy,
        ),
    ])
}

/// Set where the upstream schema copy must be checked: a missing one is then a failure.
const REQUIRE_ENV: &str = "CLEAVE_REQUIRE_CDI_SCHEMA";

const UID: &str = "5e0c7f1a-9b2d-4c3e-8f4a-0b1c2d3e4f5a";

fn fake_root(dir: &Path) -> DriverRootConfig {
    let root = dir.join("driver");
    for f in [
        "dev/nvidiactl",
        "dev/nvidia-uvm",
        "dev/nvidia-uvm-tools",
        "dev/nvidia-modeset",
        "dev/nvidia0",
        "dev/nvidia1",
        "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.570.148.08",
        "usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.1",
        "usr/bin/nvidia-smi",
        "usr/bin/nvidia-cuda-mps-control",
        "usr/bin/nvidia-cuda-mps-server",
    ] {
        let p = root.join(f);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"").unwrap();
    }
    let proc_root = dir.join("proc");
    std::fs::create_dir_all(&proc_root).unwrap();
    std::fs::write(
        proc_root.join("devices"),
        "Character devices:\n  1 mem\n195 nvidia-frontend\n237 nvidia-caps\n",
    )
    .unwrap();
    DriverRootConfig {
        root,
        host_root: Some(PathBuf::from("/run/nvidia/driver")),
        dev_root: None,
        proc_root,
    }
}

fn written_spec(dir: &Path) -> (PathBuf, Vec<u8>) {
    let files = DriverFiles::discover(&fake_root(dir)).unwrap();
    let cdi_root = dir.join("cdi");
    std::fs::create_dir_all(&cdi_root).unwrap();
    let store = CdiStore::new(&cdi_root, files.common_edits(None));
    let devices = [
        CdiDevice {
            device_name: "gpu-0".into(),
            edits: cdi::gpu_device_edits(
                &files,
                "gpu-0",
                "GPU-00000000-1111-4222-8333-444444444444",
                0,
            ),
        },
        CdiDevice {
            device_name: "gpu-1-mig-1g10gb-3".into(),
            edits: cdi::mig_device_edits(
                &files,
                "gpu-1-mig-1g10gb-3",
                "MIG-5c8a3f11-2d4e-4b6a-9c0d-1e2f3a4b5c6d",
                1,
                10,
                0,
            ),
        },
    ];
    let claim_edits = ContainerEdits {
        env: vec!["CUDA_MPS_PIPE_DIRECTORY=/var/run/cleave/mps".into()],
        ..ContainerEdits::default()
    };
    let path = store.write_claim_spec(UID, &devices, &claim_edits).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    (path, bytes)
}

fn spec_validates_against_the_embedded_schema_and_loads_like_a_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let (path, bytes) = written_spec(dir.path());
    container_device_interface::schema::validate_builtin(&bytes).unwrap();
    let spec = container_device_interface::spec::read_spec(&path, 0).unwrap();
    let names: Vec<String> = spec.get_devices().keys().cloned().collect();
    assert_eq!(
        names,
        [format!("{UID}-gpu-0"), format!("{UID}-gpu-1-mig-1g10gb-3")]
    );
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    // Driver-root prefix stripped in the container, host path kept for the runtime.
    let mounts = v["containerEdits"]["mounts"].as_array().unwrap();
    assert_eq!(mounts.len(), 7);
    assert_eq!(
        mounts[0]["hostPath"],
        "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    );
    assert_eq!(
        mounts[0]["containerPath"],
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    );
    assert_eq!(
        v["containerEdits"]["deviceNodes"].as_array().unwrap().len(),
        4
    );
    let mig_nodes = v["devices"][1]["containerEdits"]["deviceNodes"]
        .as_array()
        .unwrap();
    let paths: Vec<&str> = mig_nodes
        .iter()
        .map(|n| n["path"].as_str().unwrap())
        .collect();
    // gpu1/gi10/access = 3 + 135 + 90, ci0 = +1.
    assert_eq!(
        paths,
        [
            "/dev/nvidia1",
            "/dev/nvidia-caps/nvidia-cap228",
            "/dev/nvidia-caps/nvidia-cap229"
        ]
    );
    assert_eq!(mig_nodes[1]["major"], 237);
}

fn spec_validates_against_the_upstream_schema_copy() {
    let Some(shared) = std::env::var_os("CLEAVE_CDI_SCHEMA_DIR").map(PathBuf::from) else {
        cleave_testkit::runner::tool_missing(
            "the upstream CDI schema copy",
            REQUIRE_ENV,
            "CLEAVE_CDI_SCHEMA_DIR is not set (name a directory holding the upstream schema.json and defs.json)",
        );
        return;
    };
    let (Ok(schema), Ok(defs)) = (
        std::fs::read(shared.join("schema.json")),
        std::fs::read(shared.join("defs.json")),
    ) else {
        panic!(
            "CLEAVE_CDI_SCHEMA_DIR={}: schema.json and defs.json must both be readable there",
            shared.display()
        );
    };
    let validator = container_device_interface::schema::compile_cdi_schema(&schema, &defs).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (_, bytes) = written_spec(dir.path());
    container_device_interface::schema::validate_cdi(&validator, &bytes).unwrap();
    // The validator is not vacuous: a device without containerEdits is rejected.
    let mut broken: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    broken["devices"][0]
        .as_object_mut()
        .unwrap()
        .remove("containerEdits");
    let broken = serde_json::to_vec(&broken).unwrap();
    assert!(container_device_interface::schema::validate_cdi(&validator, &broken).is_err());
}
