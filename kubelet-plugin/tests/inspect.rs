//! `inspect` against the mock NVML library: table and ResourceSlice YAML.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn inspect(args: &[&str], state: &std::path::Path) -> String {
    let lib = mock_nvml::locate::cdylib_path().expect("mock NVML library not built");
    let out = Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .arg("inspect")
        .arg("--nvml-lib")
        .arg(lib)
        .args(args)
        .env("MOCK_NVML_STATE", state)
        .env_remove("NODE_NAME")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn table_lists_the_mock_gpus() {
    let dir = tempfile::tempdir().unwrap();
    let out = inspect(&["--mock-profile", "l4-x2"], &dir.path().join("state.json"));
    assert!(out.contains("2 GPUs, 2 devices published"), "{out}");
    assert!(out.contains("NVIDIA L4"), "{out}");
    assert!(out.contains("gpu-1"), "{out}");
}

#[test]
fn yaml_is_resourceslices_for_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let out = inspect(
        &["--mock-profile", "l4-x2", "--yaml", "--node-name", "n7"],
        &dir.path().join("state.json"),
    );
    let docs: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(&out)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    assert!(!docs.is_empty(), "{out}");
    for d in &docs {
        assert_eq!(d["kind"], "ResourceSlice");
        assert_eq!(d["spec"]["nodeName"], "n7");
        assert_eq!(d["spec"]["driver"], "gpu.cleave.dev");
    }
    let names: Vec<&str> = docs
        .iter()
        .flat_map(|d| d["spec"]["devices"].as_sequence().into_iter().flatten())
        .map(|dev| dev["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["gpu-0", "gpu-1"]);
}

/// A MIG-enabled GPU without instances publishes nothing in static mode; with `--yaml` the
/// empty device list comes with a note on stderr naming each such GPU and the ways out.
#[test]
fn yaml_names_gpus_that_publish_nothing_on_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let lib = mock_nvml::locate::cdylib_path().expect("mock NVML library not built");
    let out = Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .args(["inspect", "--nvml-lib"])
        .arg(lib)
        .args([
            "--mock-profile",
            "h100-80gb-x8",
            "--yaml",
            "--node-name",
            "n7",
        ])
        .env("MOCK_NVML_STATE", dir.path().join("state.json"))
        .env("MOCK_NVML_MIG", "on")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let notes: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("note: gpu-"))
        .collect();
    assert_eq!(notes.len(), 8, "{stderr}");
    assert!(
        notes[0].contains("MIG is enabled and no MIG instance exists"),
        "{stderr}"
    );
    assert!(notes[0].contains("--dynamic-mig"), "{stderr}");
    // The slices themselves stay valid YAML on stdout, with no device.
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("devices: []"), "{text}");
}

/// The shipped binary plays no fake NVIDIA tool (the demo binary does): `__fake` is an
/// unknown subcommand.
#[test]
fn plugin_plays_no_fake_tool() {
    let out = Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .args(["__fake", "nvidia-smi", "-L"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("unrecognized subcommand"), "{stderr}");
}

/// `--mock` loads the mock library from beside the binary; without one there, the error
/// says how to build it.
#[test]
fn mock_without_library_says_how_to_build_it() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let bin = dir.path().join("a/b");
    std::fs::create_dir_all(&bin).unwrap();
    let exe = bin.join("cleave-kubelet-plugin");
    std::fs::hard_link(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"), &exe).unwrap();
    let out = Command::new(&exe)
        .args(["inspect", "--mock", "h100-80gb-x8"])
        .env_remove("MOCK_NVML_LIB")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("libmock_nvml.so"), "{stderr}");
    assert!(
        stderr.contains("cargo build -p cleave-mock-nvml"),
        "{stderr}"
    );
}

/// `--consumable-capacity mps`: every whole GPU allows multiple allocations, and its
/// `memory` and `multiprocessors` request policies default to the whole device; the slices
/// pass the stand-in's API-server validation on every supported version.
#[test]
fn consumable_capacity_publishes_shareable_whole_gpus() {
    let dir = tempfile::tempdir().unwrap();
    let lib = mock_nvml::locate::cdylib_path().expect("mock NVML library not built");
    let out = Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .args(["inspect", "--nvml-lib"])
        .arg(lib)
        .args([
            "--mock-profile",
            "h100-80gb-x8",
            "--consumable-capacity",
            "mps",
        ])
        .args(["--yaml", "--node-name", "n7"])
        .env("MOCK_NVML_STATE", dir.path().join("state.json"))
        .env("MOCK_NVML_MIG", "off")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let docs: Vec<serde_json::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    let mut gpus = 0;
    for doc in &docs {
        for v in [
            cleave_apiserver_standin::KubeVersion::V1_34,
            cleave_apiserver_standin::KubeVersion::V1_36,
        ] {
            let r = cleave_apiserver_standin::validate::validate_resource_slice(doc, v);
            assert!(r.is_ok(), "{v}: {r:?}");
        }
        for dev in doc["spec"]["devices"].as_array().unwrap() {
            gpus += 1;
            assert_eq!(dev["allowMultipleAllocations"], true, "{dev}");
            for cap in ["memory", "multiprocessors"] {
                let c = &dev["capacity"][cap];
                assert_eq!(c["requestPolicy"]["default"], c["value"], "{dev}");
                assert_eq!(c["requestPolicy"]["validRange"]["max"], c["value"], "{dev}");
            }
        }
    }
    assert_eq!(gpus, 8, "{text}");

    // Off (the default) publishes no policy.
    let plain = inspect(
        &[
            "--mock-profile",
            "l4-x2",
            "--yaml",
            "--consumable-capacity",
            "off",
        ],
        &dir.path().join("state2.json"),
    );
    assert!(!plain.contains("allowMultipleAllocations") && !plain.contains("requestPolicy"));
    // A wrong mode names the valid ones.
    let bad = Command::new(env!("CARGO_BIN_EXE_cleave-kubelet-plugin"))
        .args(["inspect", "--consumable-capacity", "MPS"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("off, mps, time-slicing"), "{err}");
}
