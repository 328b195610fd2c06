//! Driver files under the driver root, found once at start and never per claim.
//!
//! The NVIDIA user-space driver lives either on the host (`/`) or in a driver container
//! (`/run/nvidia/driver`). At start the plugin looks there for control device nodes,
//! compute libraries and tools, and reads the MIG capability minors and the `nvidia-caps`
//! character major. The result, [`DriverFiles`], yields the common CDI container edits that
//! every claim device gets and the device nodes of each GPU and MIG device.
//!
//! Device nodes are described fully (type `c`, major, minor): the numbers come from the node
//! itself when it is a character device, else from the kernel module's fixed numbering
//! (`NV_MAJOR_DEVICE_NUMBER` 195 in `kernel-open/common/inc/nv.h`, `NV_CONTROL_DEVICE_MINOR`
//! 255 in `nv-linux.h`, modeset 254, `nvidia-uvm` minors 0 and 1 on the major that
//! `/proc/devices` lists; NVIDIA/open-gpu-kernel-modules), so a runtime never has to stat a
//! node it was told about.
//!
//! Discovery itself never fails on a missing file; [`DriverFiles::missing_for`] says what a
//! claim's containers would lack (the GPU's node, `nvidiactl`, `nvidia-uvm`, `libcuda`), and
//! prepare refuses such a claim, naming each file and the driver root.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::container_edits::{ContainerEdits, DeviceNode, Hook, Mount};

/// Control device nodes every CUDA container needs, as names under `/dev`.
pub const CONTROL_NODES: &[&str] = &[
    "nvidiactl",
    "nvidia-uvm",
    "nvidia-uvm-tools",
    "nvidia-modeset",
];

/// Prefixes of the user-space libraries mounted into containers (each matched as `<prefix>.so.*`).
pub const LIBRARIES: &[&str] = &[
    "libnvidia-ml",
    "libcuda",
    "libcudadebugger",
    "libnvidia-ptxjitcompiler",
    "libnvidia-nvvm",
    "libnvidia-opencl",
    "libnvidia-allocator",
    "libnvidia-cfg",
    "libnvidia-gpucomp",
    "libnvidia-pkcs11",
    "libnvidia-pkcs11-openssl3",
    "libnvidia-nvvm70",
];

/// Library directories searched under the driver root, in order.
pub const LIBRARY_DIRS: &[&str] = &[
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib64",
    "usr/lib",
    "lib",
];

/// Tools mounted into containers when present.
pub const BINARIES: &[&str] = &[
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
];

/// Binary directories searched under the driver root, in order.
pub const BINARY_DIRS: &[&str] = &["usr/bin", "bin"];

/// Mount options of the read-only bind mounts of libraries and binaries.
const MOUNT_OPTIONS: &[&str] = &["ro", "nosuid", "nodev", "bind"];

/// Char major of `/dev/nvidia<minor>` and `/dev/nvidiactl` (fixed by the kernel module).
pub const NVIDIA_MAJOR: u32 = 195;
/// Minor of `/dev/nvidiactl` (`NV_CONTROL_DEVICE_MINOR`).
pub const NVIDIACTL_MINOR: u32 = 255;
/// Minor of `/dev/nvidia-modeset`.
pub const NVIDIA_MODESET_MINOR: u32 = 254;
/// The CUDA driver library's prefix; a claim without it cannot run CUDA.
pub const LIBCUDA: &str = "libcuda";

/// Where to look for the driver, as this process sees it and as the container runtime on the
/// host sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverRootConfig {
    /// The driver root as this process sees it (`/`, or where `/run/nvidia/driver` is mounted).
    pub root: PathBuf,
    /// The same directory as the host (the container runtime) sees it; CDI host paths start
    /// here. `None`: same as `root`.
    pub host_root: Option<PathBuf>,
    /// Root under which `dev/` holds the device nodes. `None`: `root` if `<root>/dev/nvidiactl`
    /// exists, else `/` (a driver container usually creates the nodes in the host's `/dev`).
    pub dev_root: Option<PathBuf>,
    /// The kernel's `/proc` (`/proc/devices`, `/proc/driver/nvidia-caps/mig-minors`).
    pub proc_root: PathBuf,
}

impl DriverRootConfig {
    /// Driver installed on the host: root `/`, nodes in `/dev`, kernel info in `/proc`.
    pub fn host() -> Self {
        Self::at("/")
    }

    /// Driver under `root` (seen at the same path on the host), `/proc` as usual.
    pub fn at(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            host_root: None,
            dev_root: None,
            proc_root: PathBuf::from("/proc"),
        }
    }
}

impl Default for DriverRootConfig {
    fn default() -> Self {
        Self::host()
    }
}

/// A failure reading the driver root. Missing files are not failures; unreadable ones are.
#[derive(Debug, thiserror::Error)]
pub enum DriverRootError {
    /// A directory or file exists but could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The path that failed.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
}

/// A file found under the driver root: where this process saw it and where the host and the
/// container see it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct FoundFile {
    /// Path relative to the root it was found under (no leading `/`).
    pub relative: PathBuf,
    /// Path on the host (host root joined with `relative`).
    pub host_path: PathBuf,
}

impl FoundFile {
    /// Path in the container: `/` joined with the relative path.
    pub fn container_path(&self) -> PathBuf {
        Path::new("/").join(&self.relative)
    }
}

/// A soname link of a driver library, relative to the root, and the file it names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct LibraryLink {
    /// The link (`usr/lib64/libcuda.so.1`).
    pub link: FoundFile,
    /// Its target, a file name in the same directory (`libcuda.so.550.163.01`).
    pub target: String,
}

/// IPC sockets of the driver's daemons, relative to the root, that CUDA applications use
/// when present (NVIDIA/nvidia-container-toolkit `internal/discover/ipc.go` mounts the
/// same ones; the host-wide MPS pipe directory is left out: cleave's MPS daemons are per
/// claim and mounted by the sharing code).
pub const SOCKETS: &[&str] = &[
    "run/nvidia-persistenced/socket",
    "run/nvidia-fabricmanager/socket",
    "var/run/nvidia-persistenced/socket",
    "var/run/nvidia-fabricmanager/socket",
];

/// Mount options of the IPC sockets (the toolkit's `ipcMountOptions`).
const SOCKET_MOUNT_OPTIONS: &[&str] = &["nosuid", "nodev", "rbind", "rprivate", "noexec"];

/// Program name of cleave's CDI hook (`args[0]` of every hook entry).
pub const CDI_HOOK_NAME: &str = "cleave-cdi-hook";

/// A device node found under the dev root, with the numbers the container's node gets.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct FoundNode {
    /// Where it was found.
    pub file: FoundFile,
    /// Char major and minor: the node's own when it is a character device, else the
    /// kernel module's fixed numbering; `None` when neither is known.
    pub numbers: Option<(u32, u32)>,
}

impl FoundNode {
    /// The CDI device node: type, major and minor when known, else path only.
    pub fn device_node(&self) -> DeviceNode {
        match self.numbers {
            Some((major, minor)) => DeviceNode {
                path: self.file.container_path().display().to_string(),
                host_path: Some(self.file.host_path.display().to_string()),
                r#type: Some("c".to_owned()),
                major: Some(i64::from(major)),
                minor: Some(i64::from(minor)),
            },
            None => DeviceNode::path(self.file.container_path(), &self.file.host_path),
        }
    }
}

/// What a claim device needs from the driver root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceNeed {
    /// A whole GPU: its node `/dev/nvidia<minor>`.
    Gpu {
        /// Device minor of the GPU.
        minor: u32,
    },
    /// A MIG device: the parent's node and the GI and CI capability nodes. Without the
    /// IDs (an instance still to be created) the `nvidia-caps` major must be known, so
    /// that the nodes can be described whatever their minors.
    Mig {
        /// Device minor of the parent GPU.
        gpu_minor: u32,
        /// GPU and compute instance IDs, once known.
        ids: Option<(u32, u32)>,
    },
}

/// Driver files and numbers found at start (and again when a claim needs a file that was
/// missing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverFiles {
    /// The driver root as this process sees it.
    pub root: PathBuf,
    /// Where device nodes were looked for (`<dev root>/dev`).
    pub dev_dir: PathBuf,
    /// Control device nodes that exist (`/dev/nvidiactl`, ...).
    pub control_nodes: Vec<FoundNode>,
    /// GPU device nodes `/dev/nvidia<minor>` that exist, by minor.
    pub gpu_nodes: BTreeMap<u32, FoundNode>,
    /// User-space driver libraries to mount: the files (not their soname links) matching
    /// `<prefix>.so.*`.
    pub libraries: Vec<FoundFile>,
    /// Soname links of those libraries (`libcuda.so.1 -> libcuda.so.550.163.01`), made in
    /// the container by the CDI hook rather than mounted, as NVIDIA's toolkit does.
    pub library_links: Vec<LibraryLink>,
    /// IPC sockets of the driver's daemons found under the root (persistenced, fabric
    /// manager), mounted into containers.
    pub sockets: Vec<FoundFile>,
    /// Driver version from the CUDA library's file name (`libcuda.so.550.163.01`).
    pub driver_version: Option<String>,
    /// Driver tools (`nvidia-smi`, ...).
    pub binaries: Vec<FoundFile>,
    /// Char major of `nvidia-caps` from `/proc/devices`, when the module is loaded.
    pub caps_major: Option<u32>,
    /// Char major of `nvidia-uvm` from `/proc/devices`, when the module is loaded.
    pub uvm_major: Option<u32>,
    /// Entries of `mig-minors` (`gpu0/gi1/access` -> minor), empty when the file is absent.
    pub mig_minors: BTreeMap<String, u32>,
    /// Host path of the dev root (`/` normally); cap nodes are `<this>/dev/nvidia-caps/...`.
    pub host_dev_root: PathBuf,
}

fn read_dir_names(dir: &Path) -> Result<Vec<String>, DriverRootError> {
    match fs::read_dir(dir) {
        Ok(entries) => {
            let mut names = Vec::new();
            for entry in entries {
                let entry = entry.map_err(|source| DriverRootError::Read {
                    path: dir.to_owned(),
                    source,
                })?;
                if let Some(name) = entry.file_name().to_str() {
                    names.push(name.to_owned());
                }
            }
            names.sort();
            Ok(names)
        }
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
            ) =>
        {
            Ok(Vec::new())
        }
        Err(source) => Err(DriverRootError::Read {
            path: dir.to_owned(),
            source,
        }),
    }
}

fn read_optional(path: &Path) -> Result<Option<String>, DriverRootError> {
    match fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
            ) =>
        {
            Ok(None)
        }
        Err(source) => Err(DriverRootError::Read {
            path: path.to_owned(),
            source,
        }),
    }
}

/// The suffix of `<prefix>.so.<suffix>` when it is a full driver version (`550.163.01`,
/// not a soname number such as `1`).
fn full_version_suffix<'a>(name: &'a str, prefix: &str) -> Option<&'a str> {
    let version = name.strip_prefix(prefix)?.strip_prefix(".so.")?;
    (version.contains('.') && version.bytes().all(|b| b.is_ascii_digit() || b == b'.'))
        .then_some(version)
}

/// The installed driver version: the one `libcuda.so.1` points at, else the only
/// versioned `libcuda.so.<version>` (a host keeps old versions' files after upgrades).
fn driver_version_of(root: &Path, libraries: &[FoundFile]) -> Option<String> {
    let name_of = |f: &FoundFile| f.relative.file_name()?.to_str().map(str::to_owned);
    let linked = libraries.iter().find_map(|f| {
        (name_of(f)? == format!("{LIBCUDA}.so.1")).then_some(())?;
        let target = fs::read_link(root.join(&f.relative)).ok()?;
        let target = target.file_name()?.to_str()?;
        full_version_suffix(target, LIBCUDA).map(str::to_owned)
    });
    if linked.is_some() {
        return linked;
    }
    let versions: BTreeSet<String> = libraries
        .iter()
        .filter_map(|f| full_version_suffix(&name_of(f)?, LIBCUDA).map(str::to_owned))
        .collect();
    (versions.len() == 1)
        .then(|| versions.into_iter().next())
        .flatten()
}

/// Symlinks in the directories of `libraries` whose target is the bare name of one of them.
fn links_to(
    root: &Path,
    host_root: &Path,
    libraries: &[FoundFile],
) -> Result<Vec<LibraryLink>, DriverRootError> {
    let mut by_dir: BTreeMap<PathBuf, BTreeSet<String>> = BTreeMap::new();
    for f in libraries {
        if let (Some(dir), Some(name)) = (
            f.relative.parent(),
            f.relative.file_name().and_then(|n| n.to_str()),
        ) {
            by_dir
                .entry(dir.to_path_buf())
                .or_default()
                .insert(name.to_owned());
        }
    }
    let mut out = Vec::new();
    for (dir, names) in by_dir {
        for entry in read_dir_names(&root.join(&dir))? {
            let relative = dir.join(&entry);
            let Ok(target) = fs::read_link(root.join(&relative)) else {
                continue;
            };
            let Some(target) = target.to_str() else {
                continue;
            };
            if names.contains(target) {
                out.push(LibraryLink {
                    link: FoundFile {
                        host_path: host_root.join(&relative),
                        relative,
                    },
                    target: target.to_owned(),
                });
            }
        }
    }
    Ok(out)
}

/// Splits found library names into files to mount and soname links: a symlink whose
/// target is a plain file name in the same directory that is itself a found library
/// (`libcuda.so.1 -> libcuda.so.550.163.01`) is a link the hook makes in the container;
/// anything else (regular files, links elsewhere) is mounted.
fn split_soname_links(root: &Path, found: Vec<FoundFile>) -> (Vec<FoundFile>, Vec<LibraryLink>) {
    let names: BTreeSet<PathBuf> = found.iter().map(|f| f.relative.clone()).collect();
    let mut files = Vec::new();
    let mut links = Vec::new();
    for f in found {
        let target = fs::read_link(root.join(&f.relative)).ok().and_then(|t| {
            let t = t.to_str()?.to_owned();
            let sibling = f.relative.with_file_name(&t);
            (!t.contains('/') && names.contains(&sibling)).then_some(t)
        });
        match target {
            Some(target) => links.push(LibraryLink { link: f, target }),
            None => files.push(f),
        }
    }
    (files, links)
}

/// Parses `/proc/devices` and returns the major of the character device `name`.
pub fn parse_char_major(proc_devices: &str, name: &str) -> Option<u32> {
    let mut in_char = false;
    for line in proc_devices.lines() {
        let line = line.trim();
        if line.ends_with(':') {
            in_char = line == "Character devices:";
            continue;
        }
        if !in_char {
            continue;
        }
        if let Some((major, dev)) = line.split_once(char::is_whitespace)
            && dev.trim() == name
        {
            return major.parse().ok();
        }
    }
    None
}

/// Parses `mig-minors` lines (`gpu0/gi1/ci0/access 13`).
pub fn parse_mig_minors(text: &str) -> BTreeMap<String, u32> {
    text.lines()
        .filter_map(|line| {
            let (key, minor) = line.trim().split_once(char::is_whitespace)?;
            Some((key.to_owned(), minor.trim().parse().ok()?))
        })
        .collect()
}

/// Major and minor of a character device node (`st_rdev`, in glibc's encoding); `None`
/// for anything else.
fn char_device_numbers(meta: &fs::Metadata) -> Option<(u32, u32)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    if !meta.file_type().is_char_device() {
        return None;
    }
    let rdev = meta.rdev();
    let major = ((rdev >> 32) & 0xffff_f000) | ((rdev >> 8) & 0x0000_0fff);
    let minor = ((rdev >> 12) & 0xffff_ff00) | (rdev & 0x0000_00ff);
    Some((u32::try_from(major).ok()?, u32::try_from(minor).ok()?))
}

/// Minor of `gpu<gpu>/gi<gi>/access` by the driver's fixed numbering (instance IDs and capability nodes, docs/hardware-sources.md).
pub fn gi_access_minor_formula(gpu_minor: u32, gi: u32) -> u32 {
    3 + 135 * gpu_minor + 9 * gi
}

/// Minor of `gpu<gpu>/gi<gi>/ci<ci>/access` by the driver's fixed numbering (instance IDs and capability nodes, docs/hardware-sources.md).
pub fn ci_access_minor_formula(gpu_minor: u32, gi: u32, ci: u32) -> u32 {
    4 + 135 * gpu_minor + 9 * gi + ci
}

/// Libraries found, their soname links, and the driver version they tell.
type FoundLibraries = (Vec<FoundFile>, Vec<LibraryLink>, Option<String>);

impl DriverFiles {
    /// Looks for the driver files. Missing files are skipped; unreadable directories fail.
    pub fn discover(config: &DriverRootConfig) -> Result<Self, DriverRootError> {
        let root = &config.root;
        let host_root = config.host_root.as_ref().unwrap_or(root);
        let (dev_root, host_dev_root) = match &config.dev_root {
            Some(d) => (d.clone(), d.clone()),
            None if root.join("dev/nvidiactl").exists() => (root.clone(), host_root.clone()),
            None => (PathBuf::from("/"), PathBuf::from("/")),
        };

        // The kernel's table first; a driver root that carries its own `proc/devices` (a
        // simulated node such as the plugin's `demo`) fills in when the kernel has no entry.
        let kernel_devices = read_optional(&config.proc_root.join("devices"))?;
        let root_devices = read_optional(&root.join("proc/devices"))?;
        let char_major = |name: &str| {
            kernel_devices
                .as_deref()
                .and_then(|t| parse_char_major(t, name))
                .or_else(|| {
                    root_devices
                        .as_deref()
                        .and_then(|t| parse_char_major(t, name))
                })
        };
        let caps_major = char_major("nvidia-caps");
        let uvm_major = char_major("nvidia-uvm");

        let found = |host_base: &Path, relative: PathBuf| FoundFile {
            host_path: host_base.join(&relative),
            relative,
        };
        let node = |relative: PathBuf, convention: Option<(u32, u32)>| -> Option<FoundNode> {
            let path = dev_root.join(&relative);
            let meta = fs::metadata(&path).ok()?;
            let numbers = char_device_numbers(&meta).or(convention);
            Some(FoundNode {
                file: found(&host_dev_root, relative),
                numbers,
            })
        };

        let mut control_nodes = Vec::new();
        for name in CONTROL_NODES {
            let convention = match *name {
                "nvidiactl" => Some((NVIDIA_MAJOR, NVIDIACTL_MINOR)),
                "nvidia-modeset" => Some((NVIDIA_MAJOR, NVIDIA_MODESET_MINOR)),
                "nvidia-uvm" => uvm_major.map(|m| (m, 0)),
                "nvidia-uvm-tools" => uvm_major.map(|m| (m, 1)),
                _ => None,
            };
            control_nodes.extend(node(Path::new("dev").join(name), convention));
        }

        let dev_dir = dev_root.join("dev");
        let mut gpu_nodes = BTreeMap::new();
        for name in read_dir_names(&dev_dir)? {
            if let Some(minor) = name
                .strip_prefix("nvidia")
                .filter(|m| !m.is_empty() && m.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|m| m.parse::<u32>().ok())
                && let Some(n) = node(Path::new("dev").join(&name), Some((NVIDIA_MAJOR, minor)))
            {
                gpu_nodes.insert(minor, n);
            }
        }

        let (libraries, library_links, version) = Self::find_libraries(root, host_root)?;
        let sockets = SOCKETS
            .iter()
            .filter(|rel| root.join(rel).exists())
            .map(|rel| found(host_root, PathBuf::from(rel)))
            .collect();
        let binaries = Self::scan(root, host_root, BINARY_DIRS, |name| {
            BINARIES.contains(&name)
        })?;

        let mig_minors_path = Path::new("proc/driver/nvidia-caps/mig-minors");
        let mig_minors = match read_optional(&root.join(mig_minors_path))? {
            Some(text) => Some(text),
            None => read_optional(&config.proc_root.join("driver/nvidia-caps/mig-minors"))?,
        }
        .map(|text| parse_mig_minors(&text))
        .unwrap_or_default();

        let driver_version = version;
        let files = Self {
            root: root.clone(),
            dev_dir,
            control_nodes,
            gpu_nodes,
            libraries,
            library_links,
            sockets,
            driver_version,
            binaries,
            caps_major,
            uvm_major,
            mig_minors,
            host_dev_root,
        };
        tracing::info!(
            root = %root.display(),
            control_nodes = files.control_nodes.len(),
            gpu_nodes = files.gpu_nodes.len(),
            libraries = files.libraries.len(),
            binaries = files.binaries.len(),
            caps_major = ?files.caps_major,
            uvm_major = ?files.uvm_major,
            mig_minors = files.mig_minors.len(),
            "found driver files"
        );
        Ok(files)
    }

    /// The driver's libraries under `root`, their soname links, and the driver version
    /// they tell.
    fn find_libraries(root: &Path, host_root: &Path) -> Result<FoundLibraries, DriverRootError> {
        let mut found_libraries = Self::scan(root, host_root, LIBRARY_DIRS, |name| {
            LIBRARIES.iter().any(|prefix| {
                name.strip_prefix(prefix)
                    .is_some_and(|rest| rest.starts_with(".so."))
            })
        })?;
        // Every library of the installed version too (`*.so.<version>`), as NVIDIA's
        // toolkit mounts them (its `nvcdi` `getVersionLibs`): graphics, video and ray-tracing
        // libraries a CUDA container may load, whose names no fixed list keeps up with.
        let version = driver_version_of(root, &found_libraries);
        if let Some(version) = &version {
            // Files of another driver version (left by an upgrade) are not this driver's.
            found_libraries.retain(|f| {
                let Some(name) = f.relative.file_name().and_then(|n| n.to_str()) else {
                    return true;
                };
                LIBRARIES
                    .iter()
                    .filter_map(|prefix| full_version_suffix(name, prefix))
                    .all(|v| v == version)
            });
            let suffix = format!(".so.{version}");
            let seen: BTreeSet<String> = found_libraries
                .iter()
                .filter_map(|f| f.relative.file_name()?.to_str().map(str::to_owned))
                .collect();
            found_libraries.extend(Self::scan(root, host_root, LIBRARY_DIRS, |name| {
                name.ends_with(&suffix) && !seen.contains(name)
            })?);
            found_libraries.sort();
        }
        let (libraries, mut library_links) = split_soname_links(root, found_libraries);
        // Soname links of libraries found by version (`libGLX_nvidia.so.0`) have names no
        // prefix list matches: any symlink beside a library file that names it is one.
        for link in links_to(root, host_root, &libraries)? {
            if !library_links
                .iter()
                .any(|l| l.link.relative == link.link.relative)
            {
                library_links.push(link);
            }
        }
        library_links.sort();
        Ok((libraries, library_links, version))
    }

    /// True when the root holds nothing of a driver: no control node, no GPU node and no
    /// CUDA library. With GPUs present this means `--driver-root` points at the wrong place
    /// (or the driver container has not finished installing).
    pub fn holds_no_driver(&self) -> bool {
        self.control_nodes.is_empty() && self.gpu_nodes.is_empty() && self.libcuda().is_none()
    }

    /// The CUDA driver library (`libcuda.so.*`), when found.
    pub fn libcuda(&self) -> Option<&FoundFile> {
        self.libraries.iter().find(|f| {
            f.relative
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("{LIBCUDA}.so.")))
        })
    }

    fn control_node(&self, name: &str) -> Option<&FoundNode> {
        self.control_nodes
            .iter()
            .find(|n| n.file.relative == Path::new("dev").join(name))
    }

    /// What the containers of a claim with these devices would lack, as paths in the
    /// container (`/dev/nvidia0`, `libcuda.so.1`); empty when everything is there.
    pub fn missing_for(&self, needs: &[DeviceNeed]) -> Vec<String> {
        let mut missing = Vec::new();
        let mut push = |what: String| {
            if !missing.contains(&what) {
                missing.push(what);
            }
        };
        for need in needs {
            let gpu_minor = match *need {
                DeviceNeed::Gpu { minor } => minor,
                DeviceNeed::Mig { gpu_minor, .. } => gpu_minor,
            };
            if !self.gpu_nodes.contains_key(&gpu_minor) {
                push(format!("/dev/nvidia{gpu_minor}"));
            }
            match *need {
                DeviceNeed::Gpu { .. } => {}
                DeviceNeed::Mig {
                    gpu_minor,
                    ids: Some((gi, ci)),
                } => {
                    for minor in [
                        self.gi_access_minor(gpu_minor, gi),
                        self.ci_access_minor(gpu_minor, gi, ci),
                    ] {
                        if self.cap_node(minor).is_none() {
                            push(format!("/dev/nvidia-caps/nvidia-cap{minor}"));
                        }
                    }
                }
                DeviceNeed::Mig { ids: None, .. } => {
                    if self.caps_major.is_none() {
                        push(
                            "the nvidia-caps major in /proc/devices (MIG capability nodes)"
                                .to_owned(),
                        );
                    }
                }
            }
        }
        for name in ["nvidiactl", "nvidia-uvm"] {
            if self.control_node(name).is_none() {
                push(format!("/dev/{name}"));
            }
        }
        if self.libcuda().is_none() {
            push(format!("{LIBCUDA}.so.1"));
        }
        missing
    }

    /// Files in `dirs` under `root` whose name `matches`, one per distinct directory (a
    /// directory reached twice through a symlink such as `lib -> usr/lib` counts once).
    fn scan(
        root: &Path,
        host_root: &Path,
        dirs: &[&str],
        matches: impl Fn(&str) -> bool,
    ) -> Result<Vec<FoundFile>, DriverRootError> {
        let mut seen_dirs = BTreeSet::new();
        let mut seen_names = BTreeSet::new();
        let mut out = Vec::new();
        for dir in dirs {
            let abs = root.join(dir);
            let Ok(canonical) = fs::canonicalize(&abs) else {
                continue;
            };
            if !seen_dirs.insert(canonical) {
                continue;
            }
            for name in read_dir_names(&abs)? {
                // The same library in two directories (say lib64 and usr/lib) would be mounted
                // twice at different paths; the first directory in search order wins.
                if matches(&name) && seen_names.insert(name.clone()) {
                    let relative = Path::new(dir).join(&name);
                    out.push(FoundFile {
                        host_path: host_root.join(&relative),
                        relative,
                    });
                }
            }
        }
        Ok(out)
    }

    /// The container edits every claim device gets, as NVIDIA's container toolkit makes
    /// them for the same root (its `nvcdi` package): the control nodes; the library files,
    /// tools and IPC sockets as read-only bind mounts (firmware is not mounted: containers
    /// do not load it); `NVIDIA_CTK_LIBCUDA_DIR` (the CUDA library's directory in the
    /// container); `NVIDIA_VISIBLE_DEVICES=void`, so that an NVIDIA runtime hook, if one is
    /// configured, injects nothing on its own and CDI alone decides what the container
    /// sees; and, with `hook` (the CDI hook's path on the host), the `createContainer`
    /// hooks in the toolkit's order: soname links, CUDA forward compatibility, the ld
    /// cache over the library directories, and no device-node creation by the driver.
    pub fn common_edits(&self, hook: Option<&Path>) -> ContainerEdits {
        let mut edits = ContainerEdits {
            env: vec!["NVIDIA_VISIBLE_DEVICES=void".to_owned()],
            ..ContainerEdits::default()
        };
        let libcuda_dir = self
            .libcuda()
            .and_then(|f| f.container_path().parent().map(Path::to_path_buf));
        if let Some(dir) = &libcuda_dir {
            edits
                .env
                .push(format!("NVIDIA_CTK_LIBCUDA_DIR={}", dir.display()));
        }
        for node in &self.control_nodes {
            edits.device_nodes.push(node.device_node());
        }
        let mount = |file: &FoundFile, options: &[&str]| Mount {
            host_path: file.host_path.display().to_string(),
            container_path: file.container_path().display().to_string(),
            options: options.iter().map(|s| (*s).to_owned()).collect(),
        };
        for file in self.libraries.iter().chain(&self.binaries) {
            edits.mounts.push(mount(file, MOUNT_OPTIONS));
        }
        for socket in &self.sockets {
            edits.mounts.push(mount(socket, SOCKET_MOUNT_OPTIONS));
        }
        let Some(hook) = hook else {
            return edits;
        };
        let hook_entry = |args: Vec<String>| Hook {
            hook_name: "createContainer".to_owned(),
            path: hook.display().to_string(),
            args: std::iter::once(CDI_HOOK_NAME.to_owned())
                .chain(args)
                .collect(),
        };
        let mut links: Vec<String> = self
            .library_links
            .iter()
            .map(|l| format!("{}::{}", l.target, l.link.container_path().display()))
            .collect();
        if let Some(dir) = &libcuda_dir {
            // The development name, which some applications dlopen.
            links.push(format!(
                "{LIBCUDA}.so.1::{}",
                dir.join(format!("{LIBCUDA}.so")).display()
            ));
        }
        if !links.is_empty() {
            let mut args = vec!["create-symlinks".to_owned()];
            for link in links {
                args.push("--link".to_owned());
                args.push(link);
            }
            edits.hooks.push(hook_entry(args));
        }
        if let Some(version) = &self.driver_version {
            edits.hooks.push(hook_entry(vec![
                "enable-cuda-compat".to_owned(),
                format!("--host-driver-version={version}"),
            ]));
        }
        let mut folders: Vec<PathBuf> = Vec::new();
        for file in &self.libraries {
            if let Some(dir) = file.container_path().parent()
                && !folders.iter().any(|f| f == dir)
            {
                folders.push(dir.to_path_buf());
            }
        }
        if !folders.is_empty() {
            let mut args = vec!["update-ldcache".to_owned()];
            for folder in folders {
                args.push("--folder".to_owned());
                args.push(folder.display().to_string());
            }
            edits.hooks.push(hook_entry(args));
        }
        edits.hooks.push(hook_entry(vec![
            "disable-device-node-modification".to_owned(),
        ]));
        edits
    }

    /// Device node of the whole GPU `/dev/nvidia<minor>`, when it exists on the node.
    pub fn gpu_node(&self, minor: u32) -> Option<DeviceNode> {
        self.gpu_nodes.get(&minor).map(FoundNode::device_node)
    }

    /// Minor of the capability node of GPU instance `gi` on the GPU with `gpu_minor`.
    pub fn gi_access_minor(&self, gpu_minor: u32, gi: u32) -> u32 {
        self.mig_minors
            .get(&format!("gpu{gpu_minor}/gi{gi}/access"))
            .copied()
            .unwrap_or_else(|| gi_access_minor_formula(gpu_minor, gi))
    }

    /// Minor of the capability node of compute instance `ci` in GPU instance `gi`.
    pub fn ci_access_minor(&self, gpu_minor: u32, gi: u32, ci: u32) -> u32 {
        self.mig_minors
            .get(&format!("gpu{gpu_minor}/gi{gi}/ci{ci}/access"))
            .copied()
            .unwrap_or_else(|| ci_access_minor_formula(gpu_minor, gi, ci))
    }

    /// Capability device node `/dev/nvidia-caps/nvidia-cap<minor>`. With the `nvidia-caps`
    /// major known the node is described fully (type, major, minor), so the runtime can
    /// create it even where the host has not yet; without it only an existing node is used.
    pub fn cap_node(&self, minor: u32) -> Option<DeviceNode> {
        let relative = format!("dev/nvidia-caps/nvidia-cap{minor}");
        let container_path = Path::new("/").join(&relative);
        let host_path = self.host_dev_root.join(&relative);
        match self.caps_major {
            Some(major) => Some(DeviceNode {
                path: container_path.display().to_string(),
                host_path: Some(host_path.display().to_string()),
                r#type: Some("c".to_owned()),
                major: Some(i64::from(major)),
                minor: Some(i64::from(minor)),
            }),
            None if host_path.exists() => Some(DeviceNode::path(container_path, host_path)),
            None => None,
        }
    }

    /// Device nodes of a MIG device: the parent GPU node and the GI and CI access nodes.
    pub fn mig_nodes(&self, gpu_minor: u32, gi: u32, ci: u32) -> Vec<DeviceNode> {
        let mut nodes: Vec<DeviceNode> = self.gpu_node(gpu_minor).into_iter().collect();
        nodes.extend(self.cap_node(self.gi_access_minor(gpu_minor, gi)));
        nodes.extend(self.cap_node(self.ci_access_minor(gpu_minor, gi, ci)));
        nodes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(path: &Path) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, b"").unwrap();
    }

    #[test]
    fn formula_matches_published_minors() {
        assert_eq!(ci_access_minor_formula(3, 3, 3), 439);
        assert_eq!(ci_access_minor_formula(6, 11, 7), 920);
        assert_eq!(gi_access_minor_formula(0, 7), 66);
        assert_eq!(ci_access_minor_formula(0, 7, 0), 67);
        assert_eq!(gi_access_minor_formula(0, 9), 84);
        assert_eq!(gi_access_minor_formula(0, 2), 21);
        assert_eq!(ci_access_minor_formula(0, 3, 1), 32);
    }

    #[test]
    fn proc_devices_major() {
        let text = "Character devices:\n  1 mem\n195 nvidia-frontend\n236 nvidia-caps\n237 nvidia-caps-imex-channels\n\nBlock devices:\n236 nvidia-caps\n";
        assert_eq!(parse_char_major(text, "nvidia-caps"), Some(236));
        assert_eq!(
            parse_char_major(text, "nvidia-caps-imex-channels"),
            Some(237)
        );
        assert_eq!(parse_char_major(text, "nvidia-uvm"), None);
        let block_only = "Character devices:\n 1 mem\nBlock devices:\n 9 nvidia-caps\n";
        assert_eq!(parse_char_major(block_only, "nvidia-caps"), None);
    }

    #[test]
    fn fake_root_is_found_and_prefix_stripped() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("driver");
        let proc_root = dir.path().join("proc");
        for f in [
            "dev/nvidiactl",
            "dev/nvidia-uvm",
            "dev/nvidia0",
            "dev/nvidia3",
            "dev/nvidia-caps/nvidia-cap21",
            "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
            "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.570.148.08",
            "usr/lib/x86_64-linux-gnu/libnvidia-ml.so",
            "usr/lib/x86_64-linux-gnu/libcuda.so.1",
            "usr/lib/x86_64-linux-gnu/libcudart.so.12",
            "usr/lib/x86_64-linux-gnu/libnvidia-mlx.so.1",
            "usr/lib64/libcuda.so.1",
            "usr/lib64/libnvidia-opencl.so.1",
            "usr/bin/nvidia-smi",
            "usr/bin/nvidia-cuda-mps-control",
            "usr/bin/ls",
        ] {
            touch(&root.join(f));
        }
        fs::write(
            root.join("dev/nvidia-caps/nvidia-cap21"),
            b"not a device, but present",
        )
        .unwrap();
        fs::create_dir_all(&proc_root).unwrap();
        fs::write(
            proc_root.join("devices"),
            "Character devices:\n195 nvidia\n241 nvidia-caps\n",
        )
        .unwrap();
        touch(&root.join("proc/driver/nvidia-caps/mig-minors"));
        fs::write(
            root.join("proc/driver/nvidia-caps/mig-minors"),
            "config 1\nmonitor 2\ngpu0/gi2/access 21\ngpu0/gi2/ci0/access 1000\n",
        )
        .unwrap();

        let config = DriverRootConfig {
            root: root.clone(),
            host_root: Some(PathBuf::from("/run/nvidia/driver")),
            dev_root: None,
            proc_root,
        };
        let files = DriverFiles::discover(&config).unwrap();
        // <root>/dev/nvidiactl exists, so device nodes come from the driver root.
        let ctl = &files.control_nodes[0];
        assert_eq!(ctl.file.container_path(), Path::new("/dev/nvidiactl"));
        assert_eq!(
            ctl.file.host_path,
            Path::new("/run/nvidia/driver/dev/nvidiactl")
        );
        // Not a character device here: the kernel module's numbering describes it.
        assert_eq!(ctl.numbers, Some((NVIDIA_MAJOR, NVIDIACTL_MINOR)));
        assert_eq!(files.control_nodes.len(), 2);
        assert_eq!(files.gpu_nodes.keys().copied().collect::<Vec<_>>(), [0, 3]);
        let libs: Vec<String> = files
            .libraries
            .iter()
            .map(|f| f.container_path().display().to_string())
            .collect();
        assert_eq!(
            libs,
            [
                "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
                "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.570.148.08",
                "/usr/lib64/libnvidia-opencl.so.1",
            ]
        );
        assert_eq!(
            files.libraries[0].host_path,
            Path::new("/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.1")
        );
        let bins: Vec<String> = files
            .binaries
            .iter()
            .map(|f| f.container_path().display().to_string())
            .collect();
        assert_eq!(
            bins,
            ["/usr/bin/nvidia-cuda-mps-control", "/usr/bin/nvidia-smi"]
        );
        assert_eq!(files.caps_major, Some(241));
        // Listed minors win over the formula; unlisted fall back to it.
        assert_eq!(files.gi_access_minor(0, 2), 21);
        assert_eq!(files.ci_access_minor(0, 2, 0), 1000);
        assert_eq!(
            files.ci_access_minor(1, 3, 1),
            ci_access_minor_formula(1, 3, 1)
        );

        let edits = files.common_edits(None);
        assert_eq!(
            edits.env,
            [
                "NVIDIA_VISIBLE_DEVICES=void",
                "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu"
            ]
        );
        assert!(edits.hooks.is_empty(), "no hook path, no hooks");
        assert_eq!(edits.device_nodes.len(), 2);
        assert_eq!(edits.mounts.len(), 6);
        assert!(edits.mounts.iter().all(|m| m.options == MOUNT_OPTIONS));

        let mig = files.mig_nodes(0, 2, 0);
        assert_eq!(mig.len(), 3);
        assert_eq!(mig[0].path, "/dev/nvidia0");
        assert_eq!(mig[1].path, "/dev/nvidia-caps/nvidia-cap21");
        assert_eq!(mig[1].major, Some(241));
        assert_eq!(mig[2].minor, Some(1000));
    }

    #[test]
    fn empty_root_yields_only_env() {
        let dir = tempfile::tempdir().unwrap();
        let config = DriverRootConfig {
            root: dir.path().to_owned(),
            host_root: None,
            dev_root: Some(dir.path().to_owned()),
            proc_root: dir.path().join("proc"),
        };
        let files = DriverFiles::discover(&config).unwrap();
        let edits = files.common_edits(None);
        assert!(edits.device_nodes.is_empty() && edits.mounts.is_empty());
        assert_eq!(files.gpu_node(0), None);
        // No caps major and no node on disk: no cap node rather than a node the runtime cannot find.
        assert_eq!(files.cap_node(21), None);
        assert!(files.mig_nodes(0, 2, 0).is_empty());
    }

    #[test]
    fn symlinked_lib_dir_counts_once() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        touch(&root.join("usr/lib/x86_64-linux-gnu/libcuda.so.1"));
        std::os::unix::fs::symlink("usr/lib", root.join("lib")).unwrap();
        let config = DriverRootConfig {
            root: root.to_owned(),
            host_root: None,
            dev_root: Some(root.to_owned()),
            proc_root: root.join("proc"),
        };
        let files = DriverFiles::discover(&config).unwrap();
        assert_eq!(files.libraries.len(), 1);
        assert_eq!(
            files.libraries[0].host_path,
            root.join("usr/lib/x86_64-linux-gnu/libcuda.so.1")
        );
    }

    #[test]
    fn caps_major_from_the_kernel_first_then_the_driver_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let kernel = dir.path().join("kernel-proc");
        fs::create_dir_all(&kernel).unwrap();
        fs::write(kernel.join("devices"), "Character devices:\n  1 mem\n").unwrap();
        touch(&root.join("proc/devices"));
        fs::write(
            root.join("proc/devices"),
            "Character devices:\n236 nvidia-caps\n",
        )
        .unwrap();
        let config = DriverRootConfig {
            proc_root: kernel.clone(),
            ..DriverRootConfig::at(&root)
        };
        // The kernel has no nvidia-caps: the driver root's table fills in.
        assert_eq!(
            DriverFiles::discover(&config).unwrap().caps_major,
            Some(236)
        );
        // The kernel's entry wins when it has one.
        fs::write(
            kernel.join("devices"),
            "Character devices:\n241 nvidia-caps\n",
        )
        .unwrap();
        assert_eq!(
            DriverFiles::discover(&config).unwrap().caps_major,
            Some(241)
        );
    }
}
