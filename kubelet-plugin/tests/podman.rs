//! The plugin's CDI specs under a real container runtime. Debian's podman resolves CDI
//! device names with the Go `container-device-interface` library that containerd and CRI-O
//! use too, and runs the specs' hooks through a real OCI runtime (crun). The real plugin
//! binary prepares claims over the mock NVML library and a driver root with real character
//! device nodes (the test runs as root); then a busybox container started with
//! `podman run --device <the CDI ID prepare returned>` prints what it sees: the GPU's node,
//! the control and UVM nodes, the `libcuda.so.1` link the hook's `create-symlinks` made, the
//! loader cache its `update-ldcache` wrote, the environment; for an MPS claim also the
//! daemon's pipe directory (its control socket) and its `/dev/shm`. A hostile image (Alpine's
//! musl path file a symlink to a host file) must not get the host file copied in by the
//! hook. Once the claim is unprepared, podman can no longer resolve the device.
//!
//! The image is made with `podman import` from a rootfs holding the host's statically linked
//! busybox (Debian's `busybox-static`): nothing is pulled. Everything podman keeps lives in
//! the test's temp dir (vfs storage, run root, libpod tmp dir, its own `containers.conf` and
//! `storage.conf`), and every podman command runs in a mount namespace of its own
//! (`unshare -m`) in which:
//! - tmpfs hides the host's `/run` and `/var/lib` (podman and crun write run-time state and a
//!   blob cache there), and `/run/cdi` is the plugin's CDI directory: podman 4.3 reads specs
//!   only from `/etc/cdi` (hidden too when present) and `/var/run/cdi` (so the temp dirs
//!   must not be under `/run` or `/var/lib`);
//! - `/sys/fs/cgroup/unified` is unmounted: with cgroup v1 and v2 both mounted crun refuses
//!   the "hybrid mode", and podman runs with `--cgroups=disabled`;
//! - `default_ulimits` keeps the container's rlimits within this process's (podman's
//!   defaults exceed what a sandbox allows).
//!
//! Skipped, with a loud message, only where podman cannot run at all: not root, no podman,
//! `unshare` or `tar`, no statically linked busybox, or a plain container that does not
//! start. `CLEAVE_REQUIRE_PODMAN=1` (`.ci/run` sets it once podman is installed) turns a
//! skip into a failure.
//!
//! Built with `harness = false`, like `mps_pod`: the MPS claim's daemon runs in a pod of the
//! fake kubelet (`tests/common/kubelet.rs`) as the fake `nvidia-cuda-mps-control` of
//! `cleave-fakes`, played by this test binary itself.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use cleave_apiserver_standin::StandIn;
use common::kubelet::{FakeKubelet, KubeletOptions, NAMESPACE, PodWorld};
use common::node::*;
use common::*;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::DeviceAllocationConfiguration;
use mock_nvml::driver_root::{DRIVER_VERSION, NVIDIA_MAJOR, UVM_MAJOR};
use serde_json::json;

const IMAGE: &str = "localhost/cleave-podman-test:busybox";
/// The busybox applets the container's scripts use.
const APPLETS: &[&str] = &["sh", "ls", "cat", "readlink", "env", "stat", "test", "echo"];
/// Where the mock driver root keeps its libraries (an Ubuntu host), in the container too.
const LIB_DIR: &str = "/usr/lib/x86_64-linux-gnu";
/// Set (to anything but `0`) where podman must run: a skip is then a failure.
const REQUIRE_ENV: &str = "CLEAVE_REQUIRE_PODMAN";

/// Each podman command's set-up inside its own mount namespace (see the file's header).
const NAMESPACE_SETUP: &str = r#"set -e
umount /sys/fs/cgroup/unified 2>/dev/null || true
mount -t tmpfs -o mode=0755 cleave-run /run
mkdir /run/cdi
mount --bind "$CLEAVE_CDI_DIR" /run/cdi
if [ -d /etc/cdi ]; then mount -t tmpfs -o mode=0755 cleave-etc-cdi /etc/cdi; fi
mount -t tmpfs -o mode=0755 cleave-var-lib /var/lib
exec podman "$@"
"#;

/// Podman with all its state in a temp dir of its own.
struct Podman {
    tmp: tempfile::TempDir,
    cdi_dir: PathBuf,
}

impl Podman {
    /// Podman over `cdi_dir` (the plugin's CDI directory); writes its configuration files.
    fn new(cdi_dir: &Path) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().canonicalize().unwrap();
        assert!(
            !real.starts_with("/run") && !real.starts_with("/var/lib"),
            "temp dirs under {} would be hidden from podman: set TMPDIR elsewhere",
            real.display()
        );
        let p = |n: &str| tmp.path().join(n).display().to_string();
        for d in ["storage", "run", "libpod", "networks", "image-tmp"] {
            std::fs::create_dir_all(tmp.path().join(d)).unwrap();
        }
        let (nofile, nproc) = (
            within_limit(libc::RLIMIT_NOFILE, 1024),
            within_limit(libc::RLIMIT_NPROC, 1024),
        );
        std::fs::write(
            tmp.path().join("containers.conf"),
            format!(
                "[containers]\ndefault_ulimits = [\"nofile={nofile}:{nofile}\", \"nproc={nproc}:{nproc}\"]\n\
                 [engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"none\"\ntmp_dir = \"{}\"\n\
                 [network]\nnetwork_config_dir = \"{}\"\n",
                p("libpod"),
                p("networks"),
            ),
        )
        .unwrap();
        std::fs::write(
            tmp.path().join("storage.conf"),
            format!(
                "[storage]\ndriver = \"vfs\"\ngraphroot = \"{}\"\nrunroot = \"{}\"\n",
                p("storage"),
                p("run")
            ),
        )
        .unwrap();
        Self {
            tmp,
            cdi_dir: cdi_dir.to_owned(),
        }
    }

    /// Runs `podman <args>` in a mount namespace of its own.
    fn run(&self, args: &[&str]) -> Output {
        let conf = |n: &str| self.tmp.path().join(n);
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(NAMESPACE_SETUP)
            .arg("sh")
            .args(args)
            .env("CONTAINERS_CONF", conf("containers.conf"))
            .env("CONTAINERS_STORAGE_CONF", conf("storage.conf"))
            .env("CONTAINERS_REGISTRIES_CONF", conf("registries.conf"))
            .env("TMPDIR", conf("image-tmp"))
            .env("CLEAVE_CDI_DIR", &self.cdi_dir)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// Imports the busybox image; Err says why podman cannot be used here.
    fn import_image(&self, busybox: &Path) -> Result<(), String> {
        self.import_rootfs(busybox, "rootfs", IMAGE, |_| {})?;
        // A container without devices: podman runs at all.
        let out = self.container(&[], "echo podman-runs");
        if !out.status.success() || !String::from_utf8_lossy(&out.stdout).contains("podman-runs") {
            return Err(format!(
                "a plain busybox container did not run: {}",
                text(&out)
            ));
        }
        Ok(())
    }

    /// Imports a busybox rootfs made in `<tmp>/<dir>`, changed by `extra`, as `image`.
    fn import_rootfs(
        &self,
        busybox: &Path,
        dir: &str,
        image: &str,
        extra: impl FnOnce(&Path),
    ) -> Result<(), String> {
        let rootfs = self.tmp.path().join(dir);
        std::fs::create_dir_all(rootfs.join("bin")).unwrap();
        for d in ["dev", "proc", "sys", "tmp", "etc"] {
            std::fs::create_dir_all(rootfs.join(d)).unwrap();
        }
        std::fs::copy(busybox, rootfs.join("bin/busybox")).unwrap();
        std::fs::set_permissions(
            rootfs.join("bin/busybox"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        for applet in APPLETS {
            std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
        }
        extra(&rootfs);
        let tar = self.tmp.path().join(format!("{dir}.tar"));
        let out = Command::new("tar")
            .arg("-C")
            .arg(&rootfs)
            .arg("-cf")
            .arg(&tar)
            .arg(".")
            .output()
            .unwrap();
        if !out.status.success() {
            return Err(format!("tar failed: {}", text(&out)));
        }
        let out = self.run(&["import", tar.to_str().unwrap(), image]);
        if !out.status.success() {
            return Err(format!("podman import failed: {}", text(&out)));
        }
        Ok(())
    }

    /// `podman run` of the busybox image with these CDI devices, running `script`.
    fn container(&self, devices: &[&str], script: &str) -> Output {
        self.container_of(IMAGE, devices, script)
    }

    /// `podman run` of `image` with these CDI devices, running `script`.
    fn container_of(&self, image: &str, devices: &[&str], script: &str) -> Output {
        let mut args = vec!["run", "--rm", "--cgroups=disabled", "--network=none"];
        for d in devices {
            args.extend(["--device", d]);
        }
        args.extend([image, "/bin/sh", "-c", script]);
        self.run(&args)
    }

    /// Removes every container and image, and checks that nothing is left.
    fn clean_up(&self) {
        for args in [
            &["rm", "--all", "--force"][..],
            &["rmi", "--all", "--force"][..],
        ] {
            let out = self.run(args);
            assert!(out.status.success(), "podman {args:?}: {}", text(&out));
        }
        for (what, args) in [
            ("containers", &["ps", "--all", "--quiet"][..]),
            ("images", &["images", "--quiet"][..]),
        ] {
            let out = self.run(args);
            assert!(out.status.success(), "podman {args:?}: {}", text(&out));
            assert!(
                out.stdout.trim_ascii().is_empty(),
                "{what} left: {}",
                text(&out)
            );
        }
    }
}

/// `want`, or this process's hard limit of `resource` where that is lower.
fn within_limit(resource: libc::__rlimit_resource_t, want: u64) -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit for the duration of the call.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::getrlimit(resource, &mut limit) };
    if rc == 0 {
        want.min(limit.rlim_max)
    } else {
        want
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn on_path(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether `path` is an ELF executable without a program interpreter (statically linked).
fn is_static_elf(path: &Path) -> bool {
    let Ok(bytes) = std::fs::read(path) else {
        return false;
    };
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 || bytes[5] != 1 {
        return false; // Only 64-bit little-endian ELF is read here.
    }
    let u16_at = |o: usize| usize::from(u16::from_le_bytes([bytes[o], bytes[o + 1]]));
    let ph_off = u64::from_le_bytes(bytes[0x20..0x28].try_into().unwrap());
    let Ok(ph_off) = usize::try_from(ph_off) else {
        return false;
    };
    let (ph_size, ph_num) = (u16_at(0x36), u16_at(0x38));
    (0..ph_num).all(|i| {
        let at = ph_off + i * ph_size;
        // PT_INTERP (3) names the dynamic loader.
        bytes
            .get(at..at + 4)
            .is_some_and(|t| u32::from_le_bytes(t.try_into().unwrap()) != 3)
    })
}

/// The statically linked busybox to build the image from, or why there is none.
fn static_busybox() -> Result<PathBuf, String> {
    for candidate in ["/bin/busybox", "/usr/bin/busybox"] {
        let path = PathBuf::from(candidate);
        if is_static_elf(&path) {
            return Ok(path);
        }
    }
    Err(
        "no statically linked busybox at /bin/busybox (Debian: apt-get install busybox-static)"
            .into(),
    )
}

/// Why podman cannot run on this machine, if it cannot.
fn cannot_run_podman() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    #[allow(unsafe_code)]
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Some("not root (device nodes and a rootful podman need it)".into());
    }
    for tool in ["podman", "unshare", "tar"] {
        if !on_path(tool) {
            return Some(format!(
                "no `{tool}` on PATH (Debian: apt-get install podman)"
            ));
        }
    }
    None
}

/// Skips the test loudly (returns false: it did not run), or fails it where podman is
/// required.
fn skip(why: &str) -> bool {
    // Reported `ignored`, never `ok`; a failure where podman is required (or under CI).
    cleave_testkit::runner::tool_missing(
        "podman",
        REQUIRE_ENV,
        &format!("{why} (the plugin's CDI specs were NOT checked under a real container runtime)"),
    );
    false
}

fn mps_config() -> DeviceAllocationConfiguration {
    serde_json::from_value(json!({
        "source": "FromClaim",
        "requests": ["gpu"],
        "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50}}}}
    }))
    .unwrap()
}

type World = PodWorld;

impl PodWorld {
    /// The plugin's options; `CLEAVE_CDI_HOOK_UNDER_TEST` names another build of the CDI
    /// hook for the plugin to install (to check that an older hook fails the hostile case).
    fn plugin_options(&self) -> PluginOptions {
        let mut opts = self.pod_plugin_options(&[]);
        if let Ok(hook) = std::env::var("CLEAVE_CDI_HOOK_UNDER_TEST") {
            opts.env.push(("CDI_HOOK_SOURCE", hook));
        }
        opts
    }
    fn kubelet(&self, standin: &StandIn) -> FakeKubelet {
        self.start_kubelet(standin, KubeletOptions::default())
    }
}

/// Every `env` entry of a CDI spec: the spec's own edits and each device's.
fn spec_env(spec: &serde_json::Value) -> Vec<String> {
    std::iter::once(&spec["containerEdits"])
        .chain(
            spec["devices"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|d| &d["containerEdits"]),
        )
        .flat_map(|e| e["env"].as_array().into_iter().flatten())
        .map(|v| v.as_str().unwrap_or_default().to_owned())
        .collect()
}

/// The container's report: each device node's type and numbers (`stat`), where the CUDA
/// library's links point and whether their target is a file, and the environment.
fn report_script(gpu_minor: u32, extra: &str) -> String {
    format!(
        "for n in /dev/nvidia{gpu_minor} /dev/nvidiactl /dev/nvidia-uvm; do \
           if test -e $n; then stat -c 'node %n %F %t:%T' $n; else echo \"node $n missing\"; fi; \
         done; \
         for n in /dev/nvidia[0-9]*; do \
           if test -e $n && test $n != /dev/nvidia{gpu_minor}; then echo \"other GPU node $n\"; fi; \
         done; \
         for l in {LIB_DIR}/libcuda.so.1 {LIB_DIR}/libcuda.so; do \
           echo \"link $l -> $(readlink $l)\"; \
         done; \
         if test -f {LIB_DIR}/libcuda.so.1; then echo 'libcuda.so.1 resolves to a file'; fi; \
         if test -s /etc/ld.so.cache; then echo 'ld cache written'; fi; \
         cat /etc/ld.so.conf.d/*.conf | while read -r line; do echo \"ld.so.conf $line\"; done; \
         {extra} \
         env | while read -r line; do echo \"env $line\"; done"
    )
}

/// Runs the container with the claim's CDI device and checks what every claim's container
/// must see: its GPU's node, the control and UVM nodes, the CUDA library links, and the
/// spec's environment. Returns the container's output.
fn assert_container_sees_its_claim(
    podman: &Podman,
    world: &World,
    uid: &str,
    cdi_id: &str,
    gpu_minor: u32,
    extra: &str,
) -> String {
    let out = podman.container(&[cdi_id], &report_script(gpu_minor, extra));
    assert!(
        out.status.success(),
        "the container with {cdi_id} did not run:\n{}\nCDI spec:\n{:#}\n{}",
        text(&out),
        world.cdi_spec(uid),
        world.logs()
    );
    let seen = String::from_utf8_lossy(&out.stdout).into_owned();
    let context = || {
        format!(
            "container output:\n{seen}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    };
    // stat prints major and minor in hex.
    for (node, major, minor) in [
        (format!("/dev/nvidia{gpu_minor}"), NVIDIA_MAJOR, gpu_minor),
        ("/dev/nvidiactl".to_owned(), NVIDIA_MAJOR, 255),
        ("/dev/nvidia-uvm".to_owned(), UVM_MAJOR, 0),
    ] {
        let want = format!("node {node} character special file {major:x}:{minor:x}");
        assert!(
            seen.lines().any(|l| l == want),
            "{want:?} not seen\n{}",
            context()
        );
    }
    // Only this claim's GPU: no other GPU's node.
    assert!(
        !seen.lines().any(|l| l.starts_with("other GPU node")),
        "another claim's GPU is in the container\n{}",
        context()
    );
    for want in [
        format!("link {LIB_DIR}/libcuda.so.1 -> libcuda.so.{DRIVER_VERSION}"),
        format!("link {LIB_DIR}/libcuda.so -> libcuda.so.1"),
        "libcuda.so.1 resolves to a file".to_owned(),
    ] {
        assert!(
            seen.lines().any(|l| l == want),
            "{want:?} not seen (made by cleave-cdi-hook create-symlinks)\n{}",
            context()
        );
    }
    for want in [
        "ld cache written".to_owned(),
        format!("ld.so.conf {LIB_DIR}"),
    ] {
        assert!(
            seen.lines().any(|l| l == want),
            "{want:?} not seen (made by cleave-cdi-hook update-ldcache)\n{}",
            context()
        );
    }
    let env = spec_env(&world.cdi_spec(uid));
    assert!(
        env.iter().any(|e| e == "NVIDIA_VISIBLE_DEVICES=void"),
        "{env:?}"
    );
    for want in &env {
        assert!(
            seen.lines().any(|l| l == format!("env {want}")),
            "the spec's {want:?} is not in the container's environment\n{}",
            context()
        );
    }
    seen
}

/// A hostile image under the real runtime: Alpine's musl path file as a symlink to a host
/// file outside the container. `update-ldcache` once read it by letting the kernel follow
/// the link as host root and copied the host file into the container; now the link is
/// followed inside the container root only (where it names nothing), and the container
/// sees the driver's folders, not the host's file.
fn hostile_image_reads_no_host_file(podman: &Podman, busybox: &Path, world: &World, cdi_id: &str) {
    const HOSTILE: &str = "localhost/cleave-podman-test:hostile";
    let musl = if cfg!(target_arch = "aarch64") {
        "etc/ld-musl-aarch64.path"
    } else {
        "etc/ld-musl-x86_64.path"
    };
    let secret = podman.tmp.path().join("host-secret");
    std::fs::write(&secret, "HOST SECRET\n").unwrap();
    podman
        .import_rootfs(busybox, "hostile-rootfs", HOSTILE, |rootfs| {
            std::fs::write(rootfs.join("etc/alpine-release"), "3.20.0\n").unwrap();
            std::os::unix::fs::symlink(&secret, rootfs.join(musl)).unwrap();
        })
        .unwrap();
    let out = podman.container_of(HOSTILE, &[cdi_id], &format!("cat /{musl}"));
    let seen = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the hostile image's container did not run:\n{}\n{}",
        text(&out),
        world.logs()
    );
    assert!(
        !seen.contains("HOST SECRET"),
        "a host file was copied in:\n{seen}"
    );
    assert!(
        seen.lines().any(|l| l == LIB_DIR),
        "the musl path file lacks the driver's folder:\n{seen}"
    );
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "HOST SECRET\n");
}

/// The test; false when it was skipped.
async fn containers_under_podman_see_what_prepare_gave_them() -> bool {
    if let Some(why) = cannot_run_podman() {
        return skip(&why);
    }
    let busybox = match static_busybox() {
        Ok(path) => path,
        Err(why) => return skip(&why),
    };
    let world = World::new();
    std::fs::create_dir_all(world.dirs.cdi_root()).unwrap();
    let podman = Podman::new(&world.dirs.cdi_root());
    if let Err(why) = podman.import_image(&busybox) {
        return skip(&why);
    }

    let standin = start_standin(&world.dirs).await;
    let kubelet = world.kubelet(&standin);
    put_claim(&standin, "whole", "uid-whole", &[("gpu", "gpu-0")], &[]);
    put_claim(
        &standin,
        "mps",
        "uid-mps",
        &[("gpu", "gpu-1")],
        &[mps_config()],
    );
    let plugin = Plugin::start(&world.dirs, &world.plugin_options());
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let claims = vec![claim("whole", "uid-whole"), claim("mps", "uid-mps")];
    let answer = prepare(&mut dra, claims.clone()).await;
    let cdi_id = |uid: &str| {
        let c = &answer.claims[uid];
        assert_eq!(c.error, "", "{uid}\n{}", world.logs());
        assert_eq!(c.devices.len(), 1, "{uid}: {:?}", c.devices);
        assert_eq!(c.devices[0].cdi_device_ids.len(), 1, "{:?}", c.devices[0]);
        c.devices[0].cdi_device_ids[0].clone()
    };
    let (whole_id, mps_id) = (cdi_id("uid-whole"), cdi_id("uid-mps"));

    // A whole GPU; without --device-metadata, no metadata file and no mount of one.
    let seen = assert_container_sees_its_claim(
        &podman,
        &world,
        "uid-whole",
        &whole_id,
        0,
        &format!(
            "if test -e {METADATA_ROOT} || grep -q dra-device-attributes /proc/mounts; \
             then echo 'metadata present'; else echo 'no metadata'; fi;"
        ),
    );
    assert!(
        seen.lines().any(|l| l == "no metadata"),
        "a metadata file or mount without --device-metadata:\n{seen}"
    );

    hostile_image_reads_no_host_file(&podman, &busybox, &world, &whole_id);

    // An MPS claim: also the daemon's pipe directory (its control socket) and the daemon
    // pod's memory emptyDir as /dev/shm (a file put there on the host is seen inside).
    let pod: Pod = standin
        .get_as(
            "pods",
            NAMESPACE,
            &common::kubelet::daemon_pod_name(NODE, "uid-mps"),
        )
        .expect("the MPS daemon's pod");
    let shm = world
        .kubelet_root()
        .join("pods")
        .join(pod.metadata.uid.as_deref().unwrap())
        .join("volumes/kubernetes.io~empty-dir/shm");
    std::fs::write(shm.join("cleave-podman-marker"), "from the daemon's shm\n").unwrap();
    let seen = assert_container_sees_its_claim(
        &podman,
        &world,
        "uid-mps",
        &mps_id,
        1,
        "if test -S /tmp/nvidia-mps/control; then echo 'mps control socket'; fi; \
         echo \"shm $(cat /dev/shm/cleave-podman-marker)\";",
    );
    for want in [
        "mps control socket",
        "shm from the daemon's shm",
        "env CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        "env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
    ] {
        assert!(
            seen.lines().any(|l| l == want),
            "{want:?} not seen in the MPS claim's container:\n{seen}"
        );
    }

    let un = unprepare(&mut dra, claims).await;
    assert!(
        un.claims.values().all(|c| c.error.is_empty()),
        "{:?}\n{}",
        un.claims,
        world.logs()
    );
    // Once unprepared, the runtime can no longer resolve the claim's device.
    let out = podman.container(&[whole_id.as_str()], "true");
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&whole_id),
        "{}",
        text(&out)
    );
    drop(dra);
    assert!(plugin.terminate().success());

    // With --device-metadata: the container reads the request's metadata file, which names
    // the GPU by the UUID the claim's own spec gives the container.
    put_claim(&standin, "meta", "uid-meta", &[("gpu", "gpu-2")], &[]);
    let mut options = world.plugin_options();
    options.env.push(("DEVICE_METADATA", "true".into()));
    let plugin = Plugin::start(&world.dirs, &options);
    let mut dra = dra_v1(&plugin.dra_socket).await;
    let answer = prepare(&mut dra, vec![claim("meta", "uid-meta")]).await;
    let c = &answer.claims["uid-meta"];
    assert_eq!(c.error, "", "{}", world.logs());
    let ids: Vec<&str> = c.devices[0]
        .cdi_device_ids
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert_eq!(ids[1], format!("{DRIVER}/metadata=uid-meta_gpu"));
    let uuid_env = spec_env(&world.cdi_spec("uid-meta"))
        .into_iter()
        .find_map(|e| {
            e.strip_prefix("CLEAVE_DEVICE_GPU_2_UUID=")
                .map(str::to_owned)
        })
        .expect("the claim's spec names the GPU's UUID");
    let file = format!("{METADATA_ROOT}/resourceclaims/meta/gpu/{DRIVER}-metadata.json");
    let out = podman.container(
        &ids,
        &format!("cat {file}; grep dra-device-attributes /proc/mounts"),
    );
    let seen = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{}\n{}", text(&out), world.logs());
    let json_end = seen.rfind("}\n").map_or(seen.len(), |i| i + 2);
    let doc: serde_json::Value = serde_json::from_str(&seen[..json_end])
        .unwrap_or_else(|e| panic!("{e}: the metadata file as the container reads it:\n{seen}"));
    assert_eq!(doc["kind"], "DeviceMetadata", "{seen}");
    let device = &doc["requests"][0]["devices"][0];
    assert_eq!(device["name"], "gpu-2", "{seen}");
    assert_eq!(
        device["attributes"][format!("{DRIVER}/uuid")]["string"],
        uuid_env.as_str(),
        "{seen}"
    );
    assert_eq!(
        device["attributes"][format!("{DRIVER}/type")]["string"],
        "gpu",
        "{seen}"
    );
    assert!(seen[json_end..].contains(&file), "the mount:\n{seen}");
    let un = unprepare(&mut dra, vec![claim("meta", "uid-meta")]).await;
    assert_eq!(un.claims["uid-meta"].error, "", "{}", world.logs());
    drop(dra);
    assert!(plugin.terminate().success());

    drop(kubelet);
    podman.clean_up();
    true
}

/// Root of the device metadata files in a container (KEP-5304).
const METADATA_ROOT: &str = "/var/run/kubernetes.io/dra-device-attributes";

fn main() -> std::process::ExitCode {
    cleave_testkit::runner::main(
        &[("containers_under_podman_see_what_prepare_gave_them", || {
            if !cleave_testkit::runner::block_on(
                containers_under_podman_see_what_prepare_gave_them(),
            ) {
                cleave_testkit::runner::skip("skipped: podman cannot run here");
            }
        })],
    )
}
