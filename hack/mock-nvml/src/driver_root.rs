//! Driver roots laid out like real GPU hosts, for tests, benches and the demo.
//!
//! A host with the NVIDIA driver installed has, under its root: character device nodes
//! (`/dev/nvidiactl` 195:255, `/dev/nvidia<minor>` 195:<minor>, `/dev/nvidia-modeset`
//! 195:254, `/dev/nvidia-uvm` and `-tools` on the dynamic `nvidia-uvm` major, minors 0 and
//! 1; NVIDIA/open-gpu-kernel-modules `kernel-open/common/inc/nv.h`, `nv-linux.h`), the
//! user-space libraries as one versioned file each plus their soname links
//! (`libcuda.so.1 -> libcuda.so.550.163.01`), the tools in `usr/bin`, GSP firmware under
//! `lib/firmware/nvidia/<version>/`, and the persistence daemon's socket. Ubuntu puts the
//! libraries in `usr/lib/x86_64-linux-gnu`, RHEL in `usr/lib64` (with `lib64 -> usr/lib64`).
//!
//! Nodes are real character devices when this process may create them (root); otherwise
//! empty regular files at the same paths (the driver then describes them by the kernel
//! module's numbering). `proc/devices` and `proc/driver/nvidia-caps/mig-minors` inside the
//! root stand in for the kernel's, which a machine without the modules lacks.

use std::fmt::Write as _;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

/// Driver version of the laid-out libraries (a current production branch).
pub const DRIVER_VERSION: &str = "550.163.01";
/// `nvidia-caps` major written to the root's `proc/devices` (dynamic on real hosts).
pub const CAPS_MAJOR: u32 = 236;
/// `nvidia-uvm` major written to the root's `proc/devices` (dynamic on real hosts).
pub const UVM_MAJOR: u32 = 510;
/// Char major of the GPU and control nodes (`NV_MAJOR_DEVICE_NUMBER`).
pub const NVIDIA_MAJOR: u32 = 195;

/// Where the distribution puts the driver's libraries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostLayout {
    /// Debian/Ubuntu: `usr/lib/x86_64-linux-gnu`.
    Ubuntu,
    /// RHEL/Rocky/Amazon Linux: `usr/lib64`, with `lib64 -> usr/lib64`.
    Rhel,
}

impl HostLayout {
    /// The library directory, relative to the root.
    pub fn lib_dir(self) -> &'static str {
        match self {
            Self::Ubuntu => "usr/lib/x86_64-linux-gnu",
            Self::Rhel => "usr/lib64",
        }
    }
}

/// Driver libraries with their sonames, as the driver's installer lays them out
/// (`<name>.so.<version>` plus a `<soname>` link; `None`: the soname is the versioned name).
pub const LIBRARIES: &[(&str, Option<&str>)] = &[
    ("libnvidia-ml", Some("libnvidia-ml.so.1")),
    ("libcuda", Some("libcuda.so.1")),
    ("libcudadebugger", Some("libcudadebugger.so.1")),
    (
        "libnvidia-ptxjitcompiler",
        Some("libnvidia-ptxjitcompiler.so.1"),
    ),
    ("libnvidia-nvvm", Some("libnvidia-nvvm.so.4")),
    ("libnvidia-opencl", Some("libnvidia-opencl.so.1")),
    ("libnvidia-allocator", Some("libnvidia-allocator.so.1")),
    ("libnvidia-cfg", Some("libnvidia-cfg.so.1")),
    ("libnvidia-gpucomp", None),
    // Graphics, video and optical-flow libraries every desktop-capable install carries.
    ("libnvidia-glcore", None),
    ("libnvidia-eglcore", None),
    ("libnvidia-tls", None),
    ("libnvidia-encode", Some("libnvidia-encode.so.1")),
    ("libnvcuvid", Some("libnvcuvid.so.1")),
    ("libnvidia-opticalflow", Some("libnvidia-opticalflow.so.1")),
    ("libGLX_nvidia", Some("libGLX_nvidia.so.0")),
    ("libEGL_nvidia", Some("libEGL_nvidia.so.0")),
];

/// A library of an older driver that the upgrade left behind (no link names it).
pub const STALE_LIBRARY: &str = "libnvidia-ml.so.535.54.03";

/// Tools in `usr/bin`.
pub const TOOLS: &[&str] = &[
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
];

/// What to lay out.
#[derive(Debug, Clone)]
pub struct DriverRootFixture {
    /// Library directory convention.
    pub layout: HostLayout,
    /// Minors of the GPUs (`/dev/nvidia<minor>`).
    pub gpu_minors: Vec<u32>,
    /// The NVML library to install as `libnvidia-ml.so.<version>` (hard link, or a copy
    /// across file systems), e.g. the built mock; `None`: an empty file.
    pub nvml: Option<PathBuf>,
    /// Write placeholder tools into `usr/bin` (each exits 1 naming itself) where no file
    /// of that name exists yet (a test's own fakes stay).
    pub tools: bool,
}

/// Paths of a laid-out root that tests look at.
#[derive(Debug, Clone)]
pub struct LaidOut {
    /// The root.
    pub root: PathBuf,
    /// The library directory (absolute).
    pub lib_dir: PathBuf,
    /// Whether the device nodes are real character devices.
    pub char_devices: bool,
}

impl DriverRootFixture {
    /// A host with the GPUs of a built-in mock profile (`h100-80gb-x8`: minors 0..7).
    pub fn for_profile(profile: &str) -> Option<Self> {
        let config = crate::fixtures::profile(profile)?;
        let node = config.resolve(profile, None).ok()?;
        Some(Self {
            layout: HostLayout::Ubuntu,
            gpu_minors: node.gpus.iter().map(|g| g.minor).collect(),
            nvml: None,
            tools: true,
        })
    }

    /// A host with GPUs of these minors.
    pub fn with_minors(minors: impl IntoIterator<Item = u32>) -> Self {
        Self {
            layout: HostLayout::Ubuntu,
            gpu_minors: minors.into_iter().collect(),
            nvml: None,
            tools: true,
        }
    }

    /// Lays the root out under `root` (created if missing).
    pub fn lay_out(&self, root: &Path) -> io::Result<LaidOut> {
        fs::create_dir_all(root)?;
        let mut char_devices = true;
        let mut node = |rel: String, major: u32, minor: u32| -> io::Result<()> {
            let path = root.join(rel);
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent)?;
            }
            if char_devices && mknod_char(&path, major, minor).is_ok() {
                return Ok(());
            }
            char_devices = false;
            write(&path, "")
        };
        node("dev/nvidiactl".into(), NVIDIA_MAJOR, 255)?;
        node("dev/nvidia-modeset".into(), NVIDIA_MAJOR, 254)?;
        node("dev/nvidia-uvm".into(), UVM_MAJOR, 0)?;
        node("dev/nvidia-uvm-tools".into(), UVM_MAJOR, 1)?;
        for &minor in &self.gpu_minors {
            node(format!("dev/nvidia{minor}"), NVIDIA_MAJOR, minor)?;
        }
        node("dev/nvidia-caps/nvidia-cap1".into(), CAPS_MAJOR, 1)?;
        node("dev/nvidia-caps/nvidia-cap2".into(), CAPS_MAJOR, 2)?;

        let lib_dir = root.join(self.layout.lib_dir());
        fs::create_dir_all(&lib_dir)?;
        if self.layout == HostLayout::Rhel {
            symlink_fresh(Path::new("usr/lib64"), &root.join("lib64"))?;
        }
        for (name, soname) in LIBRARIES {
            let file = format!("{name}.so.{DRIVER_VERSION}");
            let path = lib_dir.join(&file);
            match (&self.nvml, *name) {
                (Some(src), "libnvidia-ml") => link_or_copy(src, &path)?,
                _ => write(&path, "")?,
            }
            if let Some(soname) = soname {
                symlink_fresh(Path::new(&file), &lib_dir.join(soname))?;
            }
        }
        // The development link some hosts have, and libraries that are not the driver's.
        symlink_fresh(Path::new("libcuda.so.1"), &lib_dir.join("libcuda.so"))?;
        for other in [
            "libc.so.6",
            "libm.so.6",
            "libcudart.so.12",
            "libnvidia-mlx.so.1",
            STALE_LIBRARY,
        ] {
            write(&lib_dir.join(other), "")?;
        }

        if self.tools {
            for tool in TOOLS {
                let path = root.join("usr/bin").join(tool);
                if path.exists() {
                    continue;
                }
                write(
                    &path,
                    &format!(
                        "#!/bin/sh\necho '{tool}: placeholder of a test driver root' >&2\nexit 1\n"
                    ),
                )?;
                fs::set_permissions(&path, fs::Permissions::from_mode(0o755))?;
            }
        }
        for fw in ["gsp_ga10x.bin", "gsp_tu10x.bin"] {
            write(
                &root
                    .join("lib/firmware/nvidia")
                    .join(DRIVER_VERSION)
                    .join(fw),
                "",
            )?;
        }
        let socket_dir = root.join("run/nvidia-persistenced");
        fs::create_dir_all(&socket_dir)?;
        let socket = socket_dir.join("socket");
        if !socket.exists() {
            drop(std::os::unix::net::UnixListener::bind(&socket)?);
        }

        write(
            &root.join("proc/devices"),
            &format!(
                "Character devices:\n  1 mem\n  4 tty\n{NVIDIA_MAJOR} nvidia-frontend\n\
                 {CAPS_MAJOR} nvidia-caps\n{} nvidia-caps-imex-channels\n{UVM_MAJOR} nvidia-uvm\n\n\
                 Block devices:\n  8 sd\n",
                CAPS_MAJOR + 1
            ),
        )?;
        let mut minors = String::from("config 1\nmonitor 2\n");
        for &gpu in &self.gpu_minors {
            for gi in 0..15u32 {
                let _ = writeln!(minors, "gpu{gpu}/gi{gi}/access {}", 3 + 135 * gpu + 9 * gi);
                for ci in 0..8u32 {
                    let _ = writeln!(
                        minors,
                        "gpu{gpu}/gi{gi}/ci{ci}/access {}",
                        4 + 135 * gpu + 9 * gi + ci
                    );
                }
            }
        }
        write(&root.join("proc/driver/nvidia-caps/mig-minors"), &minors)?;
        write(
            &root.join("proc/driver/nvidia/version"),
            &format!(
                "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {DRIVER_VERSION}  Release Build\n"
            ),
        )?;
        Ok(LaidOut {
            root: root.to_owned(),
            lib_dir,
            char_devices,
        })
    }
}

/// NUMA node the sysfs fixture gives GPU `index` of `count`: the first half on node 0, the
/// rest on node 1, and the last GPU of three or more `-1` (the platform reports no
/// affinity), so that tests see both a published and an omitted `numaNode`.
pub fn fixture_numa_node(index: usize, count: usize) -> i32 {
    if count >= 3 && index + 1 == count {
        -1
    } else {
        i32::from(index * 2 >= count)
    }
}

/// Lays out the part of sysfs the plugin reads for the GPUs of mock `profile` under
/// `<root>/sys` (pass `<root>/sys` as the plugin's `--sysfs-root`): per GPU
/// `devices/pci0000:<bus>/<bus id>/numa_node` ([`fixture_numa_node`]) and the
/// `bus/pci/devices/<bus id>` link to it, as a host has them (the link also gives the PCIe
/// root). Returns `(bus id, numa_node)` per GPU in NVML order; `None` for an unknown profile.
pub fn lay_out_sysfs(root: &Path, profile: &str) -> io::Result<Option<Vec<(String, i32)>>> {
    let Some(config) = crate::fixtures::profile(profile) else {
        return Ok(None);
    };
    let Ok(node) = config.resolve(profile, None) else {
        return Ok(None);
    };
    let sys = root.join("sys");
    let count = node.gpus.len();
    let mut out = Vec::new();
    for (i, gpu) in node.gpus.iter().enumerate() {
        let bus_id = gpu.bus_id().to_ascii_lowercase();
        // NVML's `%08X` domain, sysfs's 4-digit one.
        let bus_id = bus_id.get(4..).unwrap_or(&bus_id).to_owned();
        let numa = fixture_numa_node(i, count);
        let root_complex = format!(
            "pci{}:{:02x}",
            &bus_id[..4.min(bus_id.len())],
            gpu.pci.1 & 0xf0
        );
        let dev = sys.join("devices").join(&root_complex).join(&bus_id);
        write(&dev.join("numa_node"), &format!("{numa}\n"))?;
        let links = sys.join("bus/pci/devices");
        fs::create_dir_all(&links)?;
        symlink_fresh(
            &Path::new("../../../devices")
                .join(&root_complex)
                .join(&bus_id),
            &links.join(&bus_id),
        )?;
        out.push((bus_id, numa));
    }
    Ok(Some(out))
}

fn write(path: &Path, text: &str) -> io::Result<()> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)?;
    }
    fs::write(path, text)
}

fn symlink_fresh(target: &Path, link: &Path) -> io::Result<()> {
    match fs::remove_file(link) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::os::unix::fs::symlink(target, link)
}

fn link_or_copy(src: &Path, dst: &Path) -> io::Result<()> {
    let _ = fs::remove_file(dst);
    if fs::hard_link(src, dst).is_err() {
        fs::copy(src, dst)?;
    }
    Ok(())
}

#[allow(unsafe_code)]
fn mknod_char(path: &Path, major: u32, minor: u32) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    let _ = fs::remove_file(path);
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let dev = libc::makedev(major, minor);
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call; mknod only reads it.
    let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, dev) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lays_out_an_ubuntu_host() {
        let dir = tempfile::tempdir().unwrap();
        let out = DriverRootFixture::with_minors([0, 3])
            .lay_out(dir.path())
            .unwrap();
        let lib = out.lib_dir.join("libcuda.so.1");
        assert_eq!(
            fs::read_link(&lib).unwrap(),
            Path::new("libcuda.so.550.163.01")
        );
        assert!(dir.path().join("dev/nvidia3").exists());
        assert!(!dir.path().join("dev/nvidia1").exists());
        if out.char_devices {
            use std::os::unix::fs::FileTypeExt as _;
            let meta = fs::metadata(dir.path().join("dev/nvidiactl")).unwrap();
            assert!(meta.file_type().is_char_device());
        }
        // Laying out twice (a restarted test world) works.
        DriverRootFixture::with_minors([0, 3])
            .lay_out(dir.path())
            .unwrap();
    }

    #[test]
    fn rhel_has_lib64_link() {
        let dir = tempfile::tempdir().unwrap();
        let fixture = DriverRootFixture {
            layout: HostLayout::Rhel,
            ..DriverRootFixture::for_profile("l4-x2").unwrap()
        };
        fixture.lay_out(dir.path()).unwrap();
        assert!(dir.path().join("lib64/libcuda.so.1").exists());
        assert!(dir.path().join("dev/nvidia1").exists());
    }
}
