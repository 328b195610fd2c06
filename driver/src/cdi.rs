//! CDI spec files: one per prepared claim, in the CDI root the container runtime scans.
//!
//! File `<root>/k8s.gpu.cleave.dev-claim_<claim UID>.json`, kind `k8s.gpu.cleave.dev/claim`,
//! one CDI device per claim device named `<claim UID>-<device name>` (the claim UID makes the
//! name unique over time, so a runtime's spec cache never serves a stale device). The IDs the
//! kubelet receives are `k8s.gpu.cleave.dev/claim=<claim UID>-<device name>`.
//!
//! Environment, and why it looks the way it does: a container may get devices of several
//! claims, and CDI env entries are set, not appended, so the same variable coming from two
//! specs silently keeps only one value. Therefore:
//! - every variable a device sets is named after the device (`CLEAVE_DEVICE_GPU_0_UUID`,
//!   `CLEAVE_DEVICE_GPU_0_MIG_1G10GB_3_UUID`), and a device is prepared for one claim at a
//!   time, so these never clash;
//! - `NVIDIA_VISIBLE_DEVICES=void` (the same value in every spec, so no clash) tells an NVIDIA
//!   runtime hook, where one is configured, to inject nothing: CDI alone decides what the
//!   container sees;
//! - `CUDA_VISIBLE_DEVICES` is not set: a container with devices from two claims would see
//!   only one claim's list. CUDA enumerates the device nodes the container was given.
//!
//! Spec-level `containerEdits` (applied when any device of the claim is injected) hold the
//! common driver edits of [`crate::driver_root`] plus claim-level edits from the sharing
//! strategy. Files are written atomically and checked before they are written by the rules a
//! runtime's CDI library applies to the fields cleave emits (CDI `specs-go/config.go`,
//! `pkg/cdi/container-edits.go`); tests hold these checks and the version rule against the
//! `container-device-interface` crate's full validation.

use std::io;
use std::path::{Path, PathBuf};

use cleave_api::limits::MAX_DNS_LABEL_LENGTH;
use cleave_api::names::{CDI_CLASS, CDI_KIND, CDI_VENDOR, is_dns_label};

use crate::checkpoint::write_file_atomic;
pub use crate::container_edits::{ContainerEdits, Mount};
use crate::driver_root::DriverFiles;

/// Default CDI root for generated specs (the runtime's dynamic, highest-priority directory).
pub const DEFAULT_CDI_ROOT: &str = "/var/run/cdi";

/// A CDI failure, naming the claim or file.
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    /// A claim UID that cannot be used in a file or device name.
    #[error(
        "invalid claim UID {uid:?}: only a-z, 0-9 and '-', starting and ending with a letter or digit, at most 63 characters"
    )]
    InvalidClaimUid {
        /// The UID.
        uid: String,
    },
    /// A device name that is not a DNS label.
    #[error("invalid device name {name:?}: not a DNS label")]
    InvalidDeviceName {
        /// The name.
        name: String,
    },
    /// The generated spec failed CDI validation (a bug, or a driver file with an odd name).
    #[error("CDI spec {path} is invalid: {message}")]
    Validate {
        /// Target file.
        path: PathBuf,
        /// The validator's message chain.
        message: String,
    },
    /// Writing the spec file failed.
    #[error("writing CDI spec {path}: {source}")]
    Write {
        /// Target file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// Removing the spec file failed.
    #[error("removing CDI spec {path}: {source}")]
    Remove {
        /// Target file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
}

/// One device of a claim spec: the cleave device name and its own edits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdiDevice {
    /// Device name in the pool (`gpu-0`, `gpu-0-mig-1g10gb-3`).
    pub device_name: String,
    /// Edits applied when this device is injected.
    pub edits: ContainerEdits,
}

/// Checks that a claim UID is safe in a file name and a CDI device name.
pub fn validate_claim_uid(uid: &str) -> Result<(), CdiError> {
    if is_dns_label(uid) {
        Ok(())
    } else {
        Err(CdiError::InvalidClaimUid {
            uid: uid.to_owned(),
        })
    }
}

/// Checks that a device name is a DNS label (`[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63).
pub fn validate_device_name(name: &str) -> Result<(), CdiError> {
    if is_dns_label(name) {
        Ok(())
    } else {
        Err(CdiError::InvalidDeviceName {
            name: name.to_owned(),
        })
    }
}

/// File name of a claim's spec: `k8s.gpu.cleave.dev-claim_<uid>.json`.
pub fn spec_file_name(claim_uid: &str) -> String {
    format!("{CDI_VENDOR}-{CDI_CLASS}_{claim_uid}.json")
}

/// CDI device name (unqualified) of a claim device: `<uid>-<device name>`.
pub(crate) fn cdi_device_name(claim_uid: &str, device_name: &str) -> String {
    format!("{claim_uid}-{device_name}")
}

/// Device part of the CDI name of a share (consumable capacity):
/// `<device name>-share-<shareID>`, cut to 63 bytes (a DNS label, as every CDI device name
/// here). A claim holds at most one share of a device, so the claim UID and the device name
/// already make it unique; the share ID says which allocation it is.
pub fn share_device_name(device_name: &str, share_id: &str) -> String {
    let mut name = format!("{device_name}-share-{share_id}");
    name.truncate(MAX_DNS_LABEL_LENGTH);
    while name.ends_with('-') {
        name.pop();
    }
    name
}

/// Fully-qualified CDI device ID the kubelet hands to the runtime.
pub fn qualified_device_id(claim_uid: &str, device_name: &str) -> String {
    format!("{CDI_KIND}={}", cdi_device_name(claim_uid, device_name))
}

/// Env variable name carrying the UUID of a device: `CLEAVE_DEVICE_<NAME>_UUID`.
pub(crate) fn device_uuid_env(device_name: &str) -> String {
    let name: String = device_name
        .chars()
        .map(|c| match c {
            '-' => '_',
            c => c.to_ascii_uppercase(),
        })
        .collect();
    format!("CLEAVE_DEVICE_{name}_UUID")
}

/// Edits of a whole GPU: its device node (when present on the node) and its UUID env.
pub fn gpu_device_edits(
    files: &DriverFiles,
    device_name: &str,
    uuid: &str,
    minor: u32,
) -> ContainerEdits {
    ContainerEdits {
        env: vec![format!("{}={uuid}", device_uuid_env(device_name))],
        device_nodes: files.gpu_node(minor).into_iter().collect(),
        ..ContainerEdits::default()
    }
}

/// Edits of a MIG device: the parent GPU node, the GI and CI capability nodes, its UUID env.
pub fn mig_device_edits(
    files: &DriverFiles,
    device_name: &str,
    uuid: &str,
    gpu_minor: u32,
    gi: u32,
    ci: u32,
) -> ContainerEdits {
    ContainerEdits {
        env: vec![format!("{}={uuid}", device_uuid_env(device_name))],
        device_nodes: files.mig_nodes(gpu_minor, gi, ci),
        ..ContainerEdits::default()
    }
}

/// Writes and removes claim spec files in one CDI root.
#[derive(Debug, Clone)]
pub struct CdiStore {
    root: PathBuf,
    common: ContainerEdits,
    /// The common edits checked once, and whether they need CDI 0.5.0; the same for every
    /// claim, so never checked per prepare.
    common_check: std::sync::OnceLock<Result<bool, String>>,
}

/// CDI version of a spec using only what cleave emits (env, device nodes, bind mounts
/// without `type`, hooks, no annotations).
pub(crate) const CDI_VERSION_BASE: &str = "0.3.0";
/// CDI version needed once a device node has `hostPath` or a device name does not start
/// with a letter (CDI `specs-go/version.go`, `requiresV050`).
pub(crate) const CDI_VERSION_HOST_PATH: &str = "0.5.0";

/// Hook names a CDI spec may use (CDI `specs-go/config.go`, the OCI hook points).
const CDI_HOOK_NAMES: [&str; 6] = [
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
];

/// A CDI spec document of `devices` and spec-level `edits` (none when empty).
fn spec_doc(
    version: &str,
    devices: &[serde_json::Value],
    edits: &ContainerEdits,
) -> Result<serde_json::Value, String> {
    let mut doc = serde_json::json!({
        "cdiVersion": version,
        "kind": CDI_KIND,
        "devices": devices,
    });
    if !edits.is_empty() {
        doc["containerEdits"] =
            serde_json::to_value(edits).map_err(|e| format!("serialising edits: {e}"))?;
    }
    Ok(doc)
}

/// Checks edits as a runtime's CDI library does when it loads the spec: `NAME=VALUE` env
/// entries with a name, device nodes with a path and a known type, hooks at a known point
/// with a path, mounts with both paths. Returns whether they need CDI 0.5.0 (a non-empty
/// `hostPath`).
fn check_edits(edits: &ContainerEdits) -> Result<bool, String> {
    for entry in &edits.env {
        if entry.find('=').is_none_or(|at| at == 0) {
            return Err(format!("env entry {entry:?} is not NAME=VALUE"));
        }
    }
    for node in &edits.device_nodes {
        if node.path.is_empty() {
            return Err("a device node has an empty path".into());
        }
        if let Some(t) = &node.r#type
            && !matches!(t.as_str(), "" | "b" | "c" | "u" | "p")
        {
            return Err(format!(
                "device node {}: type {t:?} is not b, c, u or p",
                node.path
            ));
        }
    }
    for hook in &edits.hooks {
        if !CDI_HOOK_NAMES.contains(&hook.hook_name.as_str()) {
            return Err(format!(
                "hook {:?}: hook name {:?} is not one of {}",
                hook.path,
                hook.hook_name,
                CDI_HOOK_NAMES.join(", ")
            ));
        }
        if hook.path.is_empty() {
            return Err(format!("{} hook with an empty path", hook.hook_name));
        }
    }
    for mount in &edits.mounts {
        if mount.host_path.is_empty() || mount.container_path.is_empty() {
            return Err(format!(
                "mount {:?} -> {:?}: both paths are required",
                mount.host_path, mount.container_path
            ));
        }
    }
    Ok(edits
        .device_nodes
        .iter()
        .any(|n| n.host_path.as_deref().is_some_and(|h| !h.is_empty())))
}

impl CdiStore {
    /// A store writing to `root`, adding `common` edits (from the driver root) to every spec.
    pub fn new(root: impl Into<PathBuf>, common: ContainerEdits) -> Self {
        Self {
            root: root.into(),
            common,
            common_check: std::sync::OnceLock::new(),
        }
    }

    /// The CDI root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Path of a claim's spec file; the UID is validated so the path stays in the root.
    pub fn spec_path(&self, claim_uid: &str) -> Result<PathBuf, CdiError> {
        validate_claim_uid(claim_uid)?;
        Ok(self.root.join(spec_file_name(claim_uid)))
    }

    /// Builds and validates a claim's spec document and returns its bytes (JSON). The
    /// common edits are validated once per store and the claim's part on every call; the
    /// checks look at each edit on its own, so the two together equal a check of the whole.
    pub fn render(
        &self,
        claim_uid: &str,
        devices: &[CdiDevice],
        claim_edits: &ContainerEdits,
    ) -> Result<Vec<u8>, CdiError> {
        let path = self.spec_path(claim_uid)?;
        let invalid = |message: String| CdiError::Validate {
            path: path.clone(),
            message,
        };
        let common_needs_v050 = self
            .common_check
            .get_or_init(|| {
                check_edits(&self.common).map_err(|e| format!("the driver's common edits: {e}"))
            })
            .clone()
            .map_err(&invalid)?;
        let claim_needs_v050 =
            check_edits(claim_edits).map_err(|e| invalid(format!("the claim's edits: {e}")))?;
        let mut needs_v050 = common_needs_v050 || claim_needs_v050;
        if devices.is_empty() {
            return Err(invalid("a spec needs at least one device".into()));
        }
        let mut device_values = Vec::with_capacity(devices.len());
        for device in devices {
            validate_device_name(&device.device_name)?;
            let name = cdi_device_name(claim_uid, &device.device_name);
            if device.edits.is_empty() {
                return Err(invalid(format!(
                    "device {name}: no container edits (a CDI device must change the container)"
                )));
            }
            let device_needs_v050 =
                check_edits(&device.edits).map_err(|e| invalid(format!("device {name}: {e}")))?;
            needs_v050 |= device_needs_v050 || !name.starts_with(|c: char| c.is_ascii_alphabetic());
            if device_values
                .iter()
                .any(|v: &serde_json::Value| v["name"] == name.as_str())
            {
                return Err(invalid(format!("device {name} is listed twice")));
            }
            device_values.push(serde_json::json!({
                "name": name,
                "containerEdits": device.edits,
            }));
        }
        // The lowest version that carries the fields used: the widest runtime support.
        let version = if needs_v050 {
            CDI_VERSION_HOST_PATH
        } else {
            CDI_VERSION_BASE
        };
        let mut spec_edits = self.common.clone();
        spec_edits.extend(claim_edits);
        let doc = spec_doc(version, &device_values, &spec_edits).map_err(&invalid)?;
        serde_json::to_vec(&doc).map_err(|e| invalid(e.to_string()))
    }

    /// Writes a claim's spec atomically (temp file, fsync, rename, fsync of the directory),
    /// replacing any earlier spec of the claim. Returns the path.
    pub fn write_claim_spec(
        &self,
        claim_uid: &str,
        devices: &[CdiDevice],
        claim_edits: &ContainerEdits,
    ) -> Result<PathBuf, CdiError> {
        let bytes = self.render(claim_uid, devices, claim_edits)?;
        let path = self.spec_path(claim_uid)?;
        crate::fault::io_point("cdi.write")
            .and_then(|()| write_file_atomic(&path, &bytes))
            .map_err(|source| CdiError::Write {
                path: path.clone(),
                source,
            })?;
        crate::fault::point("cdi.after_write");
        Ok(path)
    }

    /// Removes a claim's spec; a spec that does not exist is not an error. Returns whether a
    /// file was removed.
    pub fn remove_claim_spec(&self, claim_uid: &str) -> Result<bool, CdiError> {
        let path = self.spec_path(claim_uid)?;
        match std::fs::remove_file(&path) {
            Ok(()) => {
                crate::fault::point("cdi.after_remove");
                Ok(true)
            }
            // A root that is missing or not a directory holds no spec either.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
                ) =>
            {
                Ok(false)
            }
            Err(source) => Err(CdiError::Remove { path, source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver_root::DriverRootConfig;

    const UID: &str = "6f1b2a4e-1c0d-4a8e-9f00-0123456789ab";

    fn files(dir: &Path) -> DriverFiles {
        for f in [
            "dev/nvidiactl",
            "dev/nvidia0",
            "usr/lib64/libcuda.so.1",
            "usr/bin/nvidia-smi",
        ] {
            let p = dir.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, b"").unwrap();
        }
        std::fs::create_dir_all(dir.join("proc")).unwrap();
        std::fs::write(
            dir.join("proc/devices"),
            "Character devices:\n236 nvidia-caps\n",
        )
        .unwrap();
        DriverFiles::discover(&DriverRootConfig {
            root: dir.to_owned(),
            host_root: None,
            dev_root: Some(dir.to_owned()),
            proc_root: dir.join("proc"),
        })
        .unwrap()
    }

    #[test]
    fn names() {
        assert_eq!(
            spec_file_name(UID),
            "k8s.gpu.cleave.dev-claim_6f1b2a4e-1c0d-4a8e-9f00-0123456789ab.json"
        );
        assert_eq!(
            qualified_device_id(UID, "gpu-0"),
            "k8s.gpu.cleave.dev/claim=6f1b2a4e-1c0d-4a8e-9f00-0123456789ab-gpu-0"
        );
        assert_eq!(
            device_uuid_env("gpu-1-mig-1g10gbme-6"),
            "CLEAVE_DEVICE_GPU_1_MIG_1G10GBME_6_UUID"
        );
    }

    #[test]
    fn unsafe_uids_and_names_are_rejected() {
        for bad in [
            "",
            "../x",
            "a/b",
            "A",
            "-a",
            "a-",
            "a.b",
            "a_b",
            &"a".repeat(64),
        ] {
            assert!(validate_claim_uid(bad).is_err(), "{bad:?}");
            assert!(validate_device_name(bad).is_err(), "{bad:?}");
        }
        validate_claim_uid(UID).unwrap();
        validate_device_name("gpu-0-mig-7g80gb-0").unwrap();
        let store = CdiStore::new("/nonexistent", ContainerEdits::default());
        let e = store.spec_path("../../etc").unwrap_err();
        assert!(e.to_string().contains("invalid claim UID"), "{e}");
    }

    #[test]
    fn written_spec_is_valid_and_carries_edits() {
        let dir = tempfile::tempdir().unwrap();
        let files = files(dir.path());
        let cdi_root = dir.path().join("cdi");
        std::fs::create_dir(&cdi_root).unwrap();
        let store = CdiStore::new(&cdi_root, files.common_edits(None));
        let devices = vec![
            CdiDevice {
                device_name: "gpu-0".into(),
                edits: gpu_device_edits(&files, "gpu-0", "GPU-aaaa", 0),
            },
            CdiDevice {
                device_name: "gpu-1-mig-1g10gb-0".into(),
                edits: mig_device_edits(&files, "gpu-1-mig-1g10gb-0", "MIG-bbbb", 1, 7, 0),
            },
        ];
        let path = store
            .write_claim_spec(UID, &devices, &ContainerEdits::default())
            .unwrap();
        assert_eq!(path, cdi_root.join(spec_file_name(UID)));
        let bytes = std::fs::read(&path).unwrap();
        container_device_interface::schema::validate_builtin(&bytes).unwrap();
        let spec = container_device_interface::spec::read_spec(&path, 0).unwrap();
        assert_eq!(spec.get_vendor(), CDI_VENDOR);
        assert_eq!(spec.get_class(), CDI_CLASS);
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        // hostPath and a device name starting with a digit both need 0.5.0.
        assert_eq!(v["cdiVersion"], "0.5.0");
        assert_eq!(v["devices"][0]["name"], format!("{UID}-gpu-0"));
        assert_eq!(
            v["devices"][0]["containerEdits"]["env"][0],
            "CLEAVE_DEVICE_GPU_0_UUID=GPU-aaaa"
        );
        assert_eq!(
            v["devices"][0]["containerEdits"]["deviceNodes"][0]["path"],
            "/dev/nvidia0"
        );
        // MIG: /dev/nvidia1 is absent on this fake node; the cap nodes are described by number.
        let mig_nodes = &v["devices"][1]["containerEdits"]["deviceNodes"];
        assert_eq!(mig_nodes.as_array().unwrap().len(), 2);
        assert_eq!(mig_nodes[0]["path"], "/dev/nvidia-caps/nvidia-cap201");
        assert_eq!(mig_nodes[0]["major"], 236);
        assert_eq!(mig_nodes[1]["minor"], 202);
        assert_eq!(v["containerEdits"]["env"][0], "NVIDIA_VISIBLE_DEVICES=void");
        assert_eq!(
            v["containerEdits"]["deviceNodes"][0]["path"],
            "/dev/nvidiactl"
        );
        assert_eq!(v["containerEdits"]["mounts"].as_array().unwrap().len(), 2);
        // No temp file left beside it.
        let names: Vec<_> = std::fs::read_dir(&cdi_root)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1);

        assert!(store.remove_claim_spec(UID).unwrap());
        assert!(!path.exists());
        assert!(!store.remove_claim_spec(UID).unwrap());
    }

    #[test]
    fn unwritable_root_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let not_a_dir = dir.path().join("file");
        std::fs::write(&not_a_dir, b"").unwrap();
        let store = CdiStore::new(&not_a_dir, ContainerEdits::default());
        let devices = [CdiDevice {
            device_name: "gpu-0".into(),
            edits: ContainerEdits {
                env: vec!["A=B".into()],
                ..Default::default()
            },
        }];
        let e = store
            .write_claim_spec(UID, &devices, &ContainerEdits::default())
            .unwrap_err();
        assert!(matches!(e, CdiError::Write { .. }));
        assert!(
            e.to_string().contains(&not_a_dir.display().to_string()),
            "{e}"
        );
    }

    #[test]
    fn invalid_common_edits_are_caught_though_checked_once() {
        let common = ContainerEdits {
            env: vec!["=no-name".into()],
            ..ContainerEdits::default()
        };
        let store = CdiStore::new("/var/run/cdi", common);
        let devices = [CdiDevice {
            device_name: "gpu-0".into(),
            edits: ContainerEdits {
                env: vec!["A=B".into()],
                ..Default::default()
            },
        }];
        for _ in 0..2 {
            let e = store
                .render(UID, &devices, &ContainerEdits::default())
                .unwrap_err();
            assert!(e.to_string().contains("common edits"), "{e}");
        }
    }

    /// The driver's own checks and version rule agree with the `container-device-interface`
    /// crate's full validation (schema and semantics) over generated edits, the bad ones
    /// included: whatever the driver writes, a runtime's CDI library loads.
    mod against_the_cdi_crate {
        use super::*;
        use crate::container_edits::{DeviceNode, Hook};
        use proptest::prelude::*;

        fn text() -> impl Strategy<Value = String> {
            prop_oneof![
                Just(String::new()),
                Just("/dev/nvidia0".to_owned()),
                Just("/usr/lib/x86_64-linux-gnu/libcuda.so.1".to_owned()),
                "[a-z/._-]{1,12}",
            ]
        }

        fn env() -> impl Strategy<Value = String> {
            prop_oneof![
                Just("A=B".to_owned()),
                Just("=x".to_owned()),
                Just("NO_VALUE=".to_owned()),
                Just("NOEQUALS".to_owned()),
                "[A-Z_]{0,4}=?[a-z=]{0,4}",
            ]
        }

        fn node() -> impl Strategy<Value = DeviceNode> {
            (
                text(),
                proptest::option::of(text()),
                proptest::option::of(prop_oneof![
                    Just("c".to_owned()),
                    Just("b".to_owned()),
                    Just(String::new()),
                    Just("x".to_owned()),
                ]),
                proptest::option::of(0i64..300),
            )
                .prop_map(|(path, host_path, r#type, num)| DeviceNode {
                    path,
                    host_path,
                    r#type,
                    major: num,
                    minor: num,
                })
        }

        fn hook() -> impl Strategy<Value = Hook> {
            (
                prop_oneof![
                    Just("createContainer".to_owned()),
                    Just("prestart".to_owned()),
                    Just("poststop".to_owned()),
                    Just("create-container".to_owned()),
                    Just(String::new()),
                ],
                text(),
            )
                .prop_map(|(hook_name, path)| Hook {
                    hook_name,
                    args: vec![path.clone(), "create-symlinks".into()],
                    path,
                })
        }

        fn mount() -> impl Strategy<Value = Mount> {
            (
                text(),
                text(),
                proptest::collection::vec("ro|bind|nosuid", 0..3),
            )
                .prop_map(|(host_path, container_path, options)| Mount {
                    host_path,
                    container_path,
                    options,
                })
        }

        fn edits() -> impl Strategy<Value = ContainerEdits> {
            (
                proptest::collection::vec(env(), 0..3),
                proptest::collection::vec(node(), 0..3),
                proptest::collection::vec(mount(), 0..2),
                proptest::collection::vec(hook(), 0..2),
            )
                .prop_map(|(env, device_nodes, mounts, hooks)| ContainerEdits {
                    env,
                    device_nodes,
                    mounts,
                    hooks,
                })
        }

        /// The crate's verdict on `edits` used as spec-level, claim and device edits, and
        /// the version it requires.
        fn crate_verdict(
            uid: &str,
            device_name: &str,
            common: &ContainerEdits,
            claim: &ContainerEdits,
            device: &ContainerEdits,
        ) -> Result<String, String> {
            let mut spec_edits = common.clone();
            spec_edits.extend(claim);
            let doc = spec_doc(
                "1.1.0",
                &[serde_json::json!({
                    "name": cdi_device_name(uid, device_name),
                    "containerEdits": device,
                })],
                &spec_edits,
            )?;
            let bytes = serde_json::to_vec(&doc).map_err(|e| e.to_string())?;
            container_device_interface::schema::validate_builtin(&bytes)
                .map_err(|e| format!("{e:#}"))?;
            let raw: container_device_interface::specs::config::Spec =
                serde_json::from_value(doc.clone()).map_err(|e| e.to_string())?;
            let version = container_device_interface::version::minimum_required_version(&raw)
                .map_err(|e| format!("{e:#}"))?;
            container_device_interface::spec::new_spec(
                &raw,
                &PathBuf::from("/var/run/cdi/x.json"),
                0,
            )
            .map_err(|e| format!("{e:#}"))?;
            Ok(version.to_string())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(400))]
            #[test]
            fn same_verdict_and_version(
                common in edits(),
                claim in edits(),
                device in edits(),
                uid in prop_oneof![Just(UID), Just("a1b2c3d4-0000-4000-8000-000000000000")],
            ) {
                let store = CdiStore::new("/var/run/cdi", common.clone());
                let devices = [CdiDevice { device_name: "gpu-0".into(), edits: device.clone() }];
                let ours = store.render(uid, &devices, &claim);
                let theirs = crate_verdict(uid, "gpu-0", &common, &claim, &device);
                match (&ours, &theirs) {
                    (Ok(bytes), Ok(version)) => {
                        let v: serde_json::Value = serde_json::from_slice(bytes).unwrap();
                        prop_assert_eq!(v["cdiVersion"].as_str(), Some(version.as_str()));
                    }
                    (Err(_), Err(_)) => {}
                    _ => prop_assert!(false, "driver {:?} vs crate {:?}", ours.as_ref().map(|_| ()), theirs),
                }
            }
        }
    }

    #[test]
    fn device_without_edits_is_rejected_by_validation() {
        let store = CdiStore::new("/var/run/cdi", ContainerEdits::default());
        let devices = [CdiDevice {
            device_name: "gpu-0".into(),
            edits: ContainerEdits::default(),
        }];
        let e = store
            .render(UID, &devices, &ContainerEdits::default())
            .unwrap_err();
        assert!(matches!(e, CdiError::Validate { .. }), "{e}");
    }
}
