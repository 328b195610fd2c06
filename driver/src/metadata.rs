//! Device metadata files (KEP-5304, `keps/sig-node/5304-dra-attributes-downward-api`):
//! per claim request, a JSON file the workload reads at a well-known path, mounted through
//! a CDI spec of its own. This module reproduces what the Go helper of
//! kubernetes/dynamic-resource-allocation produces (`kubeletplugin/metadata.go`,
//! `api/metadata/`), where the KEP's text and that code differ, the code:
//!
//! - host file `<plugin data dir>/dra-device-metadata/<namespace>_<claim>/<request>/metadata.json`
//!   (mode 0644, directories 0755), `<request>` without a `/<subrequest>` suffix;
//! - container file `/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json`,
//!   or `…/resourceclaimtemplates/<pod claim name>/…` for a claim made from a template
//!   (annotation `resource.kubernetes.io/pod-claim-name`);
//! - CDI spec `<cdi root>/<driver>_metadata_<claim uid>_<request>.json`, kind
//!   `<driver>/metadata`, one device `<claim uid>_<request>` whose edits bind-mount the file
//!   read-only; its ID goes to the first device of the request in the kubelet answer;
//! - content: the `metadata.resource.k8s.io/v1alpha1` `DeviceMetadata` object, as a JSON
//!   stream (one pretty-printed object per version, newest first, each followed by a
//!   newline; there is only one version), `generation` 1 on the first write, plus one per
//!   rewrite.
//!
//! Files are written atomically (temp file, fsync, rename), removed with the claim, and
//! [`MetadataStore::sweep`] removes those of claims no longer recorded. No Kubernetes client
//! here: the caller passes the claim's identity and the devices' attributes.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};

use k8s_openapi::api::resource::v1::DeviceAttribute;
use serde::Serialize;

use crate::cdi;
use crate::checkpoint::{write_file_atomic, write_file_atomic_mode};

/// Directory under the plugin data directory holding the metadata files.
pub(crate) const HOST_DIR: &str = "dra-device-metadata";
/// Host file name in a request's directory.
pub(crate) const HOST_FILE: &str = "metadata.json";
/// Root of the metadata files inside a container.
pub(crate) const CONTAINER_ROOT: &str = "/var/run/kubernetes.io/dra-device-attributes";
/// API version of the content.
pub(crate) const API_VERSION: &str = "metadata.resource.k8s.io/v1alpha1";
/// Kind of the content.
pub(crate) const KIND: &str = "DeviceMetadata";
/// Annotation of a claim made from a template: the pod's name for the claim.
pub(crate) const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";
/// CDI version of the metadata specs (what the Go helper writes).
pub(crate) const CDI_VERSION: &str = "0.5.0";

/// A metadata failure, naming the file or the bad name.
#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    /// A name that cannot be used in a path (empty, `.`/`..`, a `/`, or not lowercase DNS).
    #[error("device metadata: invalid {what} {value:?}")]
    InvalidName {
        /// Which name.
        what: &'static str,
        /// The name.
        value: String,
    },
    /// Writing a file or creating its directory failed.
    #[error("writing device metadata {path}: {source}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// Reading an existing file (for its generation) failed.
    #[error("reading device metadata {path}: {message}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// Removing a file or directory failed.
    #[error("removing device metadata {path}: {source}")]
    Remove {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// Encoding the content failed.
    #[error("encoding device metadata: {0}")]
    Encode(#[from] serde_json::Error),
}

/// The claim a metadata file describes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ClaimRef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
    /// The value of [`POD_CLAIM_NAME_ANNOTATION`] for a claim made from a template.
    pub pod_claim_name: Option<String>,
}

/// One device of a request, as the metadata file lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct MetadataDevice {
    /// Driver name.
    pub driver: String,
    /// Pool name.
    pub pool: String,
    /// Device name.
    pub name: String,
    /// Attributes by qualified name (`gpu.cleave.dev/uuid`); unqualified names given to
    /// [`MetadataDevice::new`] are put in the driver's domain.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, DeviceAttribute>,
}

impl MetadataDevice {
    /// A device with `attributes` as published in the ResourceSlice (names without a
    /// domain are the driver's).
    pub(crate) fn new(
        driver: &str,
        pool: &str,
        name: &str,
        attributes: impl IntoIterator<Item = (String, DeviceAttribute)>,
    ) -> Self {
        let attributes = attributes
            .into_iter()
            .map(|(k, v)| {
                let k = if k.contains('/') {
                    k
                } else {
                    format!("{driver}/{k}")
                };
                (k, v)
            })
            .collect();
        Self {
            driver: driver.to_owned(),
            pool: pool.to_owned(),
            name: name.to_owned(),
            attributes,
        }
    }
}

/// One request's metadata: its name (`<request>` or `<request>/<subrequest>`) and devices.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct RequestMetadata {
    /// The request name as allocated.
    pub name: String,
    /// Its devices of this driver.
    pub devices: Vec<MetadataDevice>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ObjectMeta<'a> {
    name: &'a str,
    namespace: &'a str,
    uid: &'a str,
    generation: i64,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Document<'a> {
    kind: &'static str,
    api_version: &'static str,
    metadata: ObjectMeta<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pod_claim_name: Option<&'a str>,
    requests: [&'a RequestMetadata; 1],
}

#[derive(serde::Deserialize)]
struct GenerationOnly {
    metadata: GenerationMeta,
}

#[derive(serde::Deserialize)]
struct GenerationMeta {
    #[serde(default)]
    generation: i64,
}

/// A path that is not there, or under something that is not a directory: nothing to remove.
fn gone(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
    )
}

/// `<request>` of `<request>/<subrequest>`.
pub(crate) fn base_request(request: &str) -> &str {
    request.split_once('/').map_or(request, |(base, _)| base)
}

/// A lowercase DNS name or label (what namespaces, claim and request names are): usable as
/// one path component.
fn check_name(what: &'static str, value: &str) -> Result<(), MetadataError> {
    let ok = !value.is_empty()
        && value.len() <= 253
        && value != "."
        && value != ".."
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && value.as_bytes()[0].is_ascii_alphanumeric();
    if ok {
        Ok(())
    } else {
        Err(MetadataError::InvalidName {
            what,
            value: value.to_owned(),
        })
    }
}

fn check_claim(claim: &ClaimRef) -> Result<(), MetadataError> {
    check_name("namespace", &claim.namespace)?;
    check_name("claim name", &claim.name)?;
    cdi::validate_claim_uid(&claim.uid).map_err(|_| MetadataError::InvalidName {
        what: "claim UID",
        value: claim.uid.clone(),
    })?;
    if let Some(p) = &claim.pod_claim_name {
        check_name("pod claim name", p)?;
    }
    Ok(())
}

/// Writes and removes metadata files and their CDI specs.
#[derive(Debug, Clone)]
pub(crate) struct MetadataStore {
    driver_name: String,
    data_dir: PathBuf,
    cdi_root: PathBuf,
}

impl MetadataStore {
    /// A store for `driver_name`, with host files under `<data_dir>/dra-device-metadata` and
    /// specs in `cdi_root`.
    pub(crate) fn new(
        driver_name: impl Into<String>,
        data_dir: impl Into<PathBuf>,
        cdi_root: impl Into<PathBuf>,
    ) -> Self {
        Self {
            driver_name: driver_name.into(),
            data_dir: data_dir.into(),
            cdi_root: cdi_root.into(),
        }
    }

    /// `<data dir>/dra-device-metadata`.
    pub(crate) fn host_root(&self) -> PathBuf {
        self.data_dir.join(HOST_DIR)
    }

    fn claim_dir(&self, namespace: &str, name: &str) -> PathBuf {
        self.host_root().join(format!("{namespace}_{name}"))
    }

    /// The host file of a request.
    pub(crate) fn host_file(&self, claim: &ClaimRef, request: &str) -> PathBuf {
        self.claim_dir(&claim.namespace, &claim.name)
            .join(base_request(request))
            .join(HOST_FILE)
    }

    /// The file's path inside the container.
    pub(crate) fn container_file(&self, claim: &ClaimRef, request: &str) -> String {
        let (kind, name) = match &claim.pod_claim_name {
            Some(p) => ("resourceclaimtemplates", p.as_str()),
            None => ("resourceclaims", claim.name.as_str()),
        };
        format!(
            "{CONTAINER_ROOT}/{kind}/{name}/{}/{}-metadata.json",
            base_request(request),
            self.driver_name
        )
    }

    fn spec_prefix(&self, uid: &str) -> String {
        format!("{}_metadata_{uid}_", self.driver_name)
    }

    /// The CDI spec of a request.
    pub(crate) fn cdi_spec_path(&self, uid: &str, request: &str) -> PathBuf {
        self.cdi_root.join(format!(
            "{}{}.json",
            self.spec_prefix(uid),
            base_request(request)
        ))
    }

    /// The CDI device ID of a request's metadata (`<driver>/metadata=<uid>_<request>`).
    pub(crate) fn cdi_device_id(&self, uid: &str, request: &str) -> String {
        format!(
            "{}/metadata={uid}_{}",
            self.driver_name,
            base_request(request)
        )
    }

    /// The generation of an existing file, `None` when there is none.
    fn current_generation(path: &Path) -> Result<Option<i64>, MetadataError> {
        let text = match std::fs::read(path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(MetadataError::Read {
                    path: path.to_owned(),
                    message: e.to_string(),
                });
            }
        };
        // The first object of the stream is the newest version.
        let mut stream = serde_json::Deserializer::from_slice(&text).into_iter::<GenerationOnly>();
        match stream.next() {
            Some(Ok(doc)) => Ok(Some(doc.metadata.generation)),
            Some(Err(e)) => Err(MetadataError::Read {
                path: path.to_owned(),
                message: e.to_string(),
            }),
            None => Err(MetadataError::Read {
                path: path.to_owned(),
                message: "empty file".into(),
            }),
        }
    }

    /// The file's content for `generation`.
    pub(crate) fn render(
        claim: &ClaimRef,
        request: &RequestMetadata,
        generation: i64,
    ) -> Result<Vec<u8>, MetadataError> {
        let doc = Document {
            kind: KIND,
            api_version: API_VERSION,
            metadata: ObjectMeta {
                name: &claim.name,
                namespace: &claim.namespace,
                uid: &claim.uid,
                generation,
            },
            pod_claim_name: claim.pod_claim_name.as_deref(),
            requests: [request],
        };
        let mut out = serde_json::to_vec_pretty(&doc)?;
        out.push(b'\n');
        Ok(out)
    }

    /// Writes a request's metadata file (generation 1, or one more than the file already
    /// there) and then its CDI spec; returns the CDI device ID to add to the request's
    /// first device.
    pub(crate) fn write(
        &self,
        claim: &ClaimRef,
        request: &RequestMetadata,
    ) -> Result<String, MetadataError> {
        check_claim(claim)?;
        check_name("request name", base_request(&request.name))?;
        let file = self.host_file(claim, &request.name);
        let generation = Self::current_generation(&file)?.map_or(1, |g| g + 1);
        let bytes = Self::render(claim, request, generation)?;
        let dir = file.parent().unwrap_or(&self.data_dir).to_owned();
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(&dir)
                .map_err(|source| MetadataError::Write {
                    path: dir.clone(),
                    source,
                })?;
        }
        write_file_atomic_mode(&file, &bytes, 0o644).map_err(|source| MetadataError::Write {
            path: file.clone(),
            source,
        })?;
        let device = format!("{}_{}", claim.uid, base_request(&request.name));
        let spec = serde_json::json!({
            "cdiVersion": CDI_VERSION,
            "kind": format!("{}/metadata", self.driver_name),
            "devices": [{
                "name": device,
                "containerEdits": {
                    "mounts": [{
                        "hostPath": file,
                        "containerPath": self.container_file(claim, &request.name),
                        "options": ["ro", "bind"],
                    }],
                },
            }],
        });
        let spec_path = self.cdi_spec_path(&claim.uid, &request.name);
        std::fs::create_dir_all(&self.cdi_root).map_err(|source| MetadataError::Write {
            path: self.cdi_root.clone(),
            source,
        })?;
        let spec_bytes = serde_json::to_vec(&spec)?;
        write_file_atomic(&spec_path, &spec_bytes).map_err(|source| MetadataError::Write {
            path: spec_path,
            source,
        })?;
        Ok(self.cdi_device_id(&claim.uid, &request.name))
    }

    /// The `podClaimName` recorded in any of a claim's files (a claim made from a
    /// template), for a rewrite without the claim object (recreation after a reboot).
    pub(crate) fn pod_claim_name(&self, namespace: &str, name: &str) -> Option<String> {
        #[derive(serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct PodClaimName {
            pod_claim_name: Option<String>,
        }
        let dir = self.claim_dir(namespace, name);
        for entry in std::fs::read_dir(dir).ok()?.flatten() {
            let Ok(text) = std::fs::read(entry.path().join(HOST_FILE)) else {
                continue;
            };
            let mut stream =
                serde_json::Deserializer::from_slice(&text).into_iter::<PodClaimName>();
            if let Some(Ok(doc)) = stream.next() {
                return doc.pod_claim_name;
            }
        }
        None
    }

    /// Removes a claim's metadata: its directory and its CDI specs. Idempotent.
    pub(crate) fn remove_claim(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Result<(), MetadataError> {
        self.remove_specs(|u| u == uid)?;
        if namespace.is_empty() || name.is_empty() || name.contains('/') || namespace.contains('/')
        {
            return Ok(());
        }
        let dir = self.claim_dir(namespace, name);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if gone(&e) => Ok(()),
            Err(source) => Err(MetadataError::Remove { path: dir, source }),
        }
    }

    /// Removes the CDI specs of this driver's metadata whose claim UID `matches`.
    fn remove_specs(&self, matches: impl Fn(&str) -> bool) -> Result<usize, MetadataError> {
        let prefix = format!("{}_metadata_", self.driver_name);
        let entries = match std::fs::read_dir(&self.cdi_root) {
            Ok(e) => e,
            // A root that is missing or not a directory holds no spec either.
            Err(e) if gone(&e) => return Ok(0),
            Err(source) => {
                return Err(MetadataError::Remove {
                    path: self.cdi_root.clone(),
                    source,
                });
            }
        };
        let mut removed = 0;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let Some(rest) = name
                .strip_prefix(&prefix)
                .and_then(|r| r.strip_suffix(".json"))
            else {
                continue;
            };
            // `<uid>_<request>`: a UID has no '_'.
            let Some((uid, _)) = rest.split_once('_') else {
                continue;
            };
            if matches(uid) {
                let path = entry.path();
                match std::fs::remove_file(&path) {
                    Ok(()) => removed += 1,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(source) => return Err(MetadataError::Remove { path, source }),
                }
            }
        }
        Ok(removed)
    }

    /// At start: removes the metadata of every claim not in `recorded` (`(namespace, name,
    /// uid)` of the claims the checkpoint holds). Returns how many specs and directories went.
    pub(crate) fn sweep(
        &self,
        recorded: &[(String, String, String)],
    ) -> Result<usize, MetadataError> {
        let uids: BTreeSet<&str> = recorded.iter().map(|(_, _, u)| u.as_str()).collect();
        let dirs: BTreeSet<String> = recorded
            .iter()
            .map(|(ns, n, _)| format!("{ns}_{n}"))
            .collect();
        let mut removed = self.remove_specs(|u| !uids.contains(u))?;
        let root = self.host_root();
        let entries = match std::fs::read_dir(&root) {
            Ok(e) => e,
            Err(e) if gone(&e) => return Ok(removed),
            Err(source) => return Err(MetadataError::Remove { path: root, source }),
        };
        for entry in entries.flatten() {
            let keep = entry.file_name().to_str().is_some_and(|n| dirs.contains(n));
            if keep {
                continue;
            }
            let path = entry.path();
            let result = if entry.file_type().is_ok_and(|t| t.is_dir()) {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            match result {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(source) => return Err(MetadataError::Remove { path, source }),
            }
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0b6f3c6e-1111-4222-8333-944455556666";

    fn claim(pod_claim_name: Option<&str>) -> ClaimRef {
        ClaimRef {
            namespace: "team-a".into(),
            name: "train-gpu-x7k2p".into(),
            uid: UID.into(),
            pod_claim_name: pod_claim_name.map(str::to_owned),
        }
    }

    fn request(name: &str) -> RequestMetadata {
        RequestMetadata {
            name: name.into(),
            devices: vec![MetadataDevice::new(
                "gpu.cleave.dev",
                "node-1",
                "gpu-0",
                [
                    (
                        "uuid".to_owned(),
                        DeviceAttribute {
                            string: Some("GPU-aaaa".into()),
                            ..Default::default()
                        },
                    ),
                    (
                        "resource.kubernetes.io/numaNode".to_owned(),
                        DeviceAttribute {
                            int: Some(1),
                            ..Default::default()
                        },
                    ),
                ],
            )],
        }
    }

    fn store(dir: &Path) -> MetadataStore {
        MetadataStore::new("gpu.cleave.dev", dir.join("data"), dir.join("cdi"))
    }

    #[test]
    fn paths_follow_the_go_helper() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path());
        let c = claim(None);
        assert_eq!(
            s.host_file(&c, "gpu/big"),
            dir.path()
                .join("data/dra-device-metadata/team-a_train-gpu-x7k2p/gpu/metadata.json")
        );
        assert_eq!(
            s.container_file(&c, "gpu/big"),
            "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/train-gpu-x7k2p/gpu/gpu.cleave.dev-metadata.json"
        );
        assert_eq!(
            s.container_file(&claim(Some("trainer")), "gpu"),
            "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/trainer/gpu/gpu.cleave.dev-metadata.json"
        );
        assert_eq!(
            s.cdi_spec_path(UID, "gpu"),
            dir.path()
                .join(format!("cdi/gpu.cleave.dev_metadata_{UID}_gpu.json"))
        );
        assert_eq!(
            s.cdi_device_id(UID, "gpu/big"),
            format!("gpu.cleave.dev/metadata={UID}_gpu")
        );
    }

    #[test]
    fn write_makes_the_file_and_spec_and_counts_generations() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path());
        let c = claim(Some("trainer"));
        let id = s.write(&c, &request("gpu")).unwrap();
        assert_eq!(id, format!("gpu.cleave.dev/metadata={UID}_gpu"));
        let file = s.host_file(&c, "gpu");
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.ends_with("}\n"), "{text}");
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(doc["apiVersion"], API_VERSION);
        assert_eq!(doc["kind"], KIND);
        assert_eq!(doc["metadata"]["generation"], 1);
        assert_eq!(doc["metadata"]["uid"], UID);
        assert_eq!(doc["podClaimName"], "trainer");
        let dev = &doc["requests"][0]["devices"][0];
        assert_eq!(doc["requests"][0]["name"], "gpu");
        assert_eq!(dev["driver"], "gpu.cleave.dev");
        assert_eq!(dev["pool"], "node-1");
        assert_eq!(
            dev["attributes"]["gpu.cleave.dev/uuid"]["string"],
            "GPU-aaaa"
        );
        assert_eq!(
            dev["attributes"]["resource.kubernetes.io/numaNode"]["int"],
            1
        );
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode & 0o644, 0o644);
        }
        let spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(s.cdi_spec_path(UID, "gpu")).unwrap()).unwrap();
        assert_eq!(spec["cdiVersion"], "0.5.0");
        assert_eq!(spec["kind"], "gpu.cleave.dev/metadata");
        assert_eq!(spec["devices"][0]["name"], format!("{UID}_gpu"));
        let mount = &spec["devices"][0]["containerEdits"]["mounts"][0];
        assert_eq!(mount["hostPath"], file.to_str().unwrap());
        assert_eq!(mount["containerPath"], s.container_file(&c, "gpu"));
        assert_eq!(mount["options"], serde_json::json!(["ro", "bind"]));
        // A rewrite counts up.
        s.write(&c, &request("gpu")).unwrap();
        let doc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        assert_eq!(doc["metadata"]["generation"], 2);
    }

    #[test]
    fn pod_claim_name_is_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path());
        let c = claim(Some("trainer"));
        assert_eq!(s.pod_claim_name(&c.namespace, &c.name), None);
        s.write(&c, &request("gpu")).unwrap();
        assert_eq!(
            s.pod_claim_name(&c.namespace, &c.name).as_deref(),
            Some("trainer")
        );
        let mut d = claim(None);
        d.name = "direct".into();
        s.write(&d, &request("gpu")).unwrap();
        assert_eq!(s.pod_claim_name(&d.namespace, &d.name), None);
    }

    #[test]
    fn bad_names_never_become_paths() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path());
        let mut c = claim(None);
        c.namespace = "..".into();
        assert!(matches!(
            s.write(&c, &request("gpu")),
            Err(MetadataError::InvalidName { .. })
        ));
        assert!(matches!(
            s.write(&claim(None), &request("../x")),
            Err(MetadataError::InvalidName { .. })
        ));
        assert!(!s.host_root().exists());
    }

    #[test]
    fn remove_and_sweep_leave_only_recorded_claims() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path());
        let a = claim(None);
        let mut b = claim(None);
        b.name = "other".into();
        b.uid = "1b6f3c6e-1111-4222-8333-944455556666".into();
        s.write(&a, &request("gpu")).unwrap();
        s.write(&a, &request("mig")).unwrap();
        s.write(&b, &request("gpu")).unwrap();
        // A spec of another kind in the root is never touched.
        std::fs::write(
            dir.path().join(format!("cdi/gpu.cleave.dev_{UID}.json")),
            "{}",
        )
        .unwrap();

        s.remove_claim(&a.namespace, &a.name, &a.uid).unwrap();
        assert!(!s.cdi_spec_path(UID, "gpu").exists() && !s.cdi_spec_path(UID, "mig").exists());
        assert!(!s.host_file(&a, "gpu").exists());
        assert!(s.host_file(&b, "gpu").exists());
        s.remove_claim(&a.namespace, &a.name, &a.uid).unwrap();

        s.write(&a, &request("gpu")).unwrap();
        let recorded = vec![(b.namespace.clone(), b.name.clone(), b.uid.clone())];
        assert_eq!(s.sweep(&recorded).unwrap(), 2);
        assert!(!s.host_file(&a, "gpu").exists() && !s.cdi_spec_path(UID, "gpu").exists());
        assert!(s.host_file(&b, "gpu").exists() && s.cdi_spec_path(&b.uid, "gpu").exists());
        assert!(
            dir.path()
                .join(format!("cdi/gpu.cleave.dev_{UID}.json"))
                .exists()
        );
        assert_eq!(s.sweep(&recorded).unwrap(), 0);
    }
}
