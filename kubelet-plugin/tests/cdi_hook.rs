//! The built hook run against fake bundles, one temp dir per test.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod hook_bundle;

use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::PathBuf;

use hook_bundle::*;

// ---- reading the OCI state ----

#[test]
fn bad_stdin_is_a_clear_error() {
    let e = fails(&run_with_stdin(
        &["create-symlinks", "--link", "a::/b"],
        "this is not json",
    ));
    assert!(
        e.contains("parsing the OCI container state from stdin"),
        "{e}"
    );
}

#[test]
fn missing_config_json_is_named() {
    let b = Bundle::debian();
    std::fs::remove_file(b.bundle().join("config.json")).unwrap();
    let e = fails(&b.run(&["create-symlinks", "--link", "a::/b"]));
    let config = b.bundle().join("config.json");
    assert!(
        e.contains(&format!(
            "reading the OCI bundle config {}",
            config.display()
        )),
        "{e}"
    );
}

#[test]
fn config_without_root_is_named() {
    let b = Bundle::debian();
    std::fs::write(b.bundle().join("config.json"), r#"{"ociVersion":"1.0.2"}"#).unwrap();
    let e = fails(&b.run(&["create-symlinks", "--link", "a::/b"]));
    assert!(e.contains("config.json has no root.path"), "{e}");
}

#[test]
fn missing_rootfs_is_named() {
    let b = Bundle::empty();
    std::fs::remove_dir(b.rootfs()).unwrap();
    let e = fails(&b.run(&["create-symlinks", "--link", "a::/b"]));
    assert!(e.contains(&b.rootfs().display().to_string()), "{e}");
}

#[test]
fn container_spec_file_replaces_stdin() {
    let b = Bundle::debian();
    let state = b.tmp.path().join("state.json");
    std::fs::write(&state, b.state()).unwrap();
    ok(&run_with_stdin(
        &[
            "create-symlinks",
            "--container-spec",
            state.to_str().unwrap(),
            "--link",
            "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so",
        ],
        "",
    ));
    assert_eq!(
        b.link("/usr/lib/x86_64-linux-gnu/libcuda.so"),
        PathBuf::from("libcuda.so.1")
    );
}

#[test]
fn unknown_hook_is_ignored_like_nvidia() {
    let o = run_with_stdin(&["update-application-profile", "--egl", "x"], "");
    let e = ok(&o);
    assert!(
        e.contains("unsupported hook \"update-application-profile\""),
        "{e}"
    );
}

#[test]
fn unknown_flag_on_a_known_hook_fails() {
    fails(&run_with_stdin(&["create-symlinks", "--nope"], ""));
}

// ---- create-symlinks ----

#[test]
fn creates_the_driver_symlinks() {
    let b = Bundle::debian();
    let e = ok(&b.run(&[
        "create-symlinks",
        "--link",
        "libcuda.so.550.163.01::/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "--link",
        "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so",
        // Through the image's usrmerge symlink /lib -> usr/lib.
        "--link",
        "libnvidia-ml.so.550.163.01::/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        // Parents are created.
        "--link",
        "../libnvidia-ml.so.1::/usr/lib/x86_64-linux-gnu/nvidia/current/libnvidia-ml.so",
    ]));
    let dir = "/usr/lib/x86_64-linux-gnu";
    assert_eq!(
        b.link(&format!("{dir}/libcuda.so.1")),
        PathBuf::from("libcuda.so.550.163.01")
    );
    assert_eq!(
        b.link(&format!("{dir}/libcuda.so")),
        PathBuf::from("libcuda.so.1")
    );
    assert_eq!(
        b.link(&format!("{dir}/libnvidia-ml.so.1")),
        PathBuf::from("libnvidia-ml.so.550.163.01")
    );
    assert!(
        std::fs::symlink_metadata(b.rootfs().join("lib"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(
        b.link(&format!("{dir}/nvidia/current/libnvidia-ml.so")),
        PathBuf::from("../libnvidia-ml.so.1")
    );
    assert_eq!(
        e.lines()
            .filter(|l| l.starts_with("cleave-cdi-hook create-symlinks:"))
            .count(),
        4,
        "{e}"
    );
    assert!(
        e.contains("/usr/lib/x86_64-linux-gnu/libcuda.so -> libcuda.so.1"),
        "{e}"
    );
}

#[test]
fn existing_links_are_kept_or_replaced_like_nvidia() {
    let b = Bundle::debian();
    let dir = b.rootfs().join(LIBDIR);
    symlink("libcuda.so.1", dir.join("libcuda.so")).unwrap();
    symlink("libnvidia-ml.so.535.1.1", dir.join("libnvidia-ml.so.1")).unwrap();
    std::fs::write(dir.join("libcuda.so.1"), "stub from the image").unwrap();
    let e = ok(&b.run(&[
        "create-symlinks",
        "--link",
        "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so",
        "--link",
        "libnvidia-ml.so.550.163.01::/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "--link",
        "libcuda.so.550.163.01::/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "--link",
        "libcuda.so.550.163.01::/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    ]));
    assert!(
        e.contains("libcuda.so -> libcuda.so.1 already exists"),
        "{e}"
    );
    assert_eq!(
        b.link("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"),
        PathBuf::from("libnvidia-ml.so.550.163.01")
    );
    assert_eq!(
        b.link("/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
        PathBuf::from("libcuda.so.550.163.01")
    );
    // No temporary names left behind.
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("cleave-tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_directory_in_the_way_is_an_error_naming_it() {
    let b = Bundle::debian();
    std::fs::create_dir(b.rootfs().join(LIBDIR).join("libcuda.so")).unwrap();
    let e = fails(&b.run(&[
        "create-symlinks",
        "--link",
        "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so",
    ]));
    assert!(e.contains("/usr/lib/x86_64-linux-gnu/libcuda.so"), "{e}");
    assert!(e.contains("is a directory"), "{e}");
}

#[test]
fn links_climbing_out_of_the_root_are_refused() {
    let b = Bundle::debian();
    let e = fails(&b.run(&["create-symlinks", "--link", "x::/../../escaped"]));
    assert!(e.contains("climbs above the container root"), "{e}");
    assert!(!b.tmp.path().join("escaped").exists());
    assert!(std::fs::symlink_metadata(b.tmp.path().join("escaped")).is_err());
}

#[test]
fn image_symlinks_cannot_send_links_to_the_host() {
    let b = Bundle::debian();
    let outside = b.tmp.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    // A relative symlink that climbs far up, and an absolute one naming a host directory.
    symlink(
        "../../../../../../../../outside",
        b.rootfs().join(LIBDIR).join("up"),
    )
    .unwrap();
    symlink(&outside, b.rootfs().join("opt")).unwrap();
    ok(&b.run(&[
        "create-symlinks",
        "--link",
        "t1::/usr/lib/x86_64-linux-gnu/up/l1",
        "--link",
        "t2::/opt/l2",
    ]));
    assert_eq!(
        std::fs::read_dir(&outside).unwrap().count(),
        0,
        "host dir touched"
    );
    // Both land where the container would see them: inside the root.
    assert_eq!(b.link("/outside/l1"), PathBuf::from("t1"));
    let host_path_in_root = outside.strip_prefix("/").unwrap().join("l2");
    assert_eq!(
        std::fs::read_link(b.rootfs().join(host_path_in_root)).unwrap(),
        PathBuf::from("t2")
    );
}

#[test]
fn malformed_link_argument_is_named() {
    let b = Bundle::debian();
    let e = fails(&b.run(&["create-symlinks", "--link", "no-separator"]));
    assert!(e.contains("\"no-separator\""), "{e}");
}

// ---- update-ldcache ----

fn ldcache_args<'a>(b: &'a Bundle, ldconfig: &'a str, folders: &[&'a str]) -> Vec<&'a str> {
    let _ = b;
    let mut v = vec!["update-ldcache", "--ldconfig-path", ldconfig];
    for f in folders {
        v.extend(["--folder", f]);
    }
    v
}

#[test]
fn update_ldcache_writes_the_drop_ins_and_runs_the_host_ldconfig() {
    let b = Bundle::debian();
    let ldconfig = b.host_ldconfig();
    let e = ok(&b.run(&ldcache_args(
        &b,
        ldconfig.to_str().unwrap(),
        &[
            "/usr/lib/x86_64-linux-gnu", // a system directory: not repeated
            "/usr/lib/x86_64-linux-gnu/nvidia",
            "/opt/nvidia/lib",
            "/usr/local/lib", // already in libc.conf: not repeated
            "/opt/nvidia/lib",
        ],
    )));
    assert_eq!(
        b.read("/etc/ld.so.conf.d/00-nvcr-cleave.conf"),
        "/usr/lib/x86_64-linux-gnu/nvidia\n/opt/nvidia/lib\n"
    );
    assert_eq!(
        b.read("/etc/ld.so.conf.d/zz-nvcr-cleave.conf"),
        "/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n/lib\n/usr/lib\n"
    );
    let mode = std::fs::metadata(b.rootfs().join("etc/ld.so.conf.d/00-nvcr-cleave.conf"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o644);
    // `-r` names the hook's own handle of the root (inherited by ldconfig), not a path that
    // could be resolved again; the log names the root.
    let args = b.ldconfig_args().unwrap();
    assert_eq!(args[0], "-r");
    assert!(args[1].starts_with("/proc/self/fd/"), "{args:?}");
    assert_eq!(
        args[2..],
        ["-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache"]
    );
    let root = b.rootfs_canonical();
    assert!(e.contains(&format!("(the root {})", root.display())), "{e}");
    // The drop-ins were in place when ldconfig ran.
    assert_eq!(
        b.ldconfig_saw(),
        vec![
            "00-nvcr-cleave.conf",
            "libc.conf",
            "x86_64-linux-gnu.conf",
            "zz-nvcr-cleave.conf"
        ]
    );
    assert!(!b.container_ldconfig_ran(), "the image's ldconfig ran");
    assert_eq!(
        b.read("/etc/ld.so.conf"),
        "include /etc/ld.so.conf.d/*.conf\n\n"
    );
    assert!(e.contains("running "), "{e}");
}

#[test]
fn update_ldcache_twice_gives_the_same_files() {
    let b = Bundle::debian();
    let ldconfig = b.host_ldconfig();
    let args = ldcache_args(&b, ldconfig.to_str().unwrap(), &["/opt/nvidia/lib"]);
    ok(&b.run(&args));
    ok(&b.run(&args));
    assert_eq!(
        b.read("/etc/ld.so.conf.d/00-nvcr-cleave.conf"),
        "/opt/nvidia/lib\n"
    );
}

#[test]
fn update_ldcache_in_an_image_without_ldconfig_or_ld_so_conf() {
    // NVIDIA's hook runs the host's ldconfig, so an image without one (distroless) is fine;
    // a missing /etc/ld.so.conf is created with the usual include.
    let b = Bundle::empty();
    let ldconfig = b.host_ldconfig();
    ok(&b.run(&ldcache_args(
        &b,
        ldconfig.to_str().unwrap(),
        &["/usr/lib64"],
    )));
    assert_eq!(
        b.read("/etc/ld.so.conf"),
        "include /etc/ld.so.conf.d/*.conf\n"
    );
    // Not Debian-like: /usr/lib64 is a system directory, so no driver drop-in.
    assert!(
        !b.rootfs()
            .join("etc/ld.so.conf.d/00-nvcr-cleave.conf")
            .exists()
    );
    let sys = b.read("/etc/ld.so.conf.d/zz-nvcr-cleave.conf");
    assert!(
        sys.starts_with("/lib\n/usr/lib\n/lib64\n/usr/lib64\n"),
        "{sys}"
    );
    assert!(b.ldconfig_args().is_some());
}

#[test]
fn update_ldcache_without_a_host_ldconfig_fails_naming_it() {
    let b = Bundle::debian();
    let missing = b.tmp.path().join("host/sbin/no-ldconfig");
    let e = fails(&b.run(&ldcache_args(
        &b,
        missing.to_str().unwrap(),
        &["/opt/nvidia/lib"],
    )));
    assert!(e.contains(&missing.display().to_string()), "{e}");
    assert!(b.ldconfig_args().is_none());
}

#[test]
fn update_ldcache_prefers_ldconfig_real() {
    let b = Bundle::debian();
    let real = b.tmp.path().join("host/sbin/ldconfig.real");
    std::fs::rename(b.host_ldconfig(), &real).unwrap();
    script(&b.host_ldconfig(), "exit 42\n");
    let ldconfig = b.host_ldconfig();
    ok(&b.run(&ldcache_args(
        &b,
        ldconfig.to_str().unwrap(),
        &["/opt/nvidia/lib"],
    )));
    assert!(b.ldconfig_args().is_some());
}

#[test]
fn update_ldcache_reports_a_failing_ldconfig() {
    let b = Bundle::debian();
    b.fake_host_ldconfig(3);
    let ldconfig = b.host_ldconfig();
    let e = fails(&b.run(&ldcache_args(
        &b,
        ldconfig.to_str().unwrap(),
        &["/opt/nvidia/lib"],
    )));
    assert!(e.contains(&ldconfig.display().to_string()), "{e}");
    assert!(e.contains("exit status: 3"), "{e}");
}

#[test]
fn update_ldcache_drop_ins_stay_inside_the_root() {
    // An image whose /etc/ld.so.conf.d is an absolute symlink naming a host directory, and
    // whose drop-in name is already a symlink to a host file.
    let b = Bundle::debian();
    let host_dir = b.tmp.path().join("host-etc");
    std::fs::create_dir(&host_dir).unwrap();
    std::fs::write(host_dir.join("victim"), "keep").unwrap();
    let r = b.rootfs();
    std::fs::rename(r.join("etc/ld.so.conf.d"), r.join("etc/real.d")).unwrap();
    symlink(&host_dir, r.join("etc/ld.so.conf.d")).unwrap();
    let in_root = r.join(host_dir.strip_prefix("/").unwrap());
    std::fs::create_dir_all(&in_root).unwrap();
    symlink(host_dir.join("victim"), in_root.join("00-nvcr-cleave.conf")).unwrap();
    let ldconfig = b.host_ldconfig();
    ok(&b.run(&ldcache_args(
        &b,
        ldconfig.to_str().unwrap(),
        &["/opt/nvidia/lib"],
    )));
    assert_eq!(
        std::fs::read_to_string(host_dir.join("victim")).unwrap(),
        "keep"
    );
    assert_eq!(
        std::fs::read_dir(&host_dir).unwrap().count(),
        1,
        "host dir written"
    );
    assert_eq!(
        std::fs::read_to_string(in_root.join("00-nvcr-cleave.conf")).unwrap(),
        "/opt/nvidia/lib\n"
    );
}

#[test]
fn update_ldcache_on_alpine_writes_the_musl_path_file() {
    let b = Bundle::empty();
    std::fs::create_dir_all(b.rootfs().join("etc")).unwrap();
    std::fs::write(b.rootfs().join("etc/alpine-release"), "3.20.0\n").unwrap();
    let ldconfig = b.host_ldconfig();
    let args = ldcache_args(&b, ldconfig.to_str().unwrap(), &["/opt/nvidia/lib"]);
    ok(&b.run(&args));
    ok(&b.run(&args));
    let arch = if cfg!(target_arch = "aarch64") {
        "aarch64"
    } else {
        "x86_64"
    };
    let path = b.read(&format!("/etc/ld-musl-{arch}.path"));
    assert!(
        path.starts_with("/opt/nvidia/lib\n/lib\n/usr/lib\n"),
        "{path}"
    );
    assert_eq!(path.matches("/opt/nvidia/lib").count(), 1, "{path}");
}

#[test]
fn update_ldcache_with_a_real_ldconfig_builds_the_container_cache() {
    // Needs root (ldconfig -r chroots) and the host's glibc ldconfig and zlib.
    let lib = PathBuf::from("/usr/lib/x86_64-linux-gnu/libz.so.1.2.13");
    let ldconfig = PathBuf::from("/sbin/ldconfig");
    if !lib.exists() || !ldconfig.exists() || !can_mount() {
        eprintln!("skipped: needs root, /sbin/ldconfig and {}", lib.display());
        return;
    }
    let b = Bundle::debian();
    std::fs::remove_file(b.rootfs().join("sbin/ldconfig")).unwrap();
    std::fs::create_dir_all(b.rootfs().join("opt/drv")).unwrap();
    std::fs::copy(&lib, b.rootfs().join("opt/drv/libz.so.1.2.13")).unwrap();
    let host_cache = std::fs::metadata("/etc/ld.so.cache")
        .ok()
        .map(|m| m.modified().unwrap());
    ok(&b.run(&[
        "update-ldcache",
        "--ldconfig-path",
        "/sbin/ldconfig",
        "--folder",
        "/opt/drv",
    ]));
    assert_eq!(
        b.link("/opt/drv/libz.so.1"),
        PathBuf::from("libz.so.1.2.13")
    );
    let cache = std::fs::read(b.rootfs().join("etc/ld.so.cache")).unwrap();
    let needle = b"/opt/drv/libz.so.1";
    assert!(
        cache.windows(needle.len()).any(|w| w == needle),
        "cache lacks /opt/drv"
    );
    assert_eq!(
        std::fs::metadata("/etc/ld.so.cache")
            .ok()
            .map(|m| m.modified().unwrap()),
        host_cache,
        "the host's cache changed"
    );
}

// ---- enable-cuda-compat ----

fn compat_bundle(lib_version: &str, contents: &[u8]) -> Bundle {
    let b = Bundle::debian();
    let compat = b.rootfs().join("usr/local/cuda-12.8/compat");
    std::fs::create_dir_all(&compat).unwrap();
    symlink("cuda-12.8", b.rootfs().join("usr/local/cuda")).unwrap();
    std::fs::write(compat.join(format!("libcuda.so.{lib_version}")), contents).unwrap();
    symlink(
        format!("libcuda.so.{lib_version}"),
        compat.join("libcuda.so.1"),
    )
    .unwrap();
    b
}

const COMPAT_DROP_IN: &str = "/etc/ld.so.conf.d/00-compat-cleave.conf";

#[test]
fn a_newer_compat_lib_is_put_first() {
    let b = compat_bundle("575.57.08", b"not an elf");
    let e = ok(&b.run(&[
        "enable-cuda-compat",
        &format!("--host-driver-version={DRIVER}"),
    ]));
    // The folder as the container sees it, its /usr/local/cuda symlink resolved.
    assert_eq!(b.read(COMPAT_DROP_IN), "/usr/local/cuda-12.8/compat\n");
    assert!(
        e.contains("is newer than the host driver 550.163.01"),
        "{e}"
    );
}

#[test]
fn an_older_or_same_branch_compat_lib_is_ignored() {
    for v in ["535.230.02", "550.200.01"] {
        let b = compat_bundle(v, b"");
        let e = ok(&b.run(&[
            "enable-cuda-compat",
            &format!("--host-driver-version={DRIVER}"),
        ]));
        assert!(!b.rootfs().join(&COMPAT_DROP_IN[1..]).exists(), "{v}: {e}");
        assert!(e.contains("not used"), "{e}");
    }
}

#[test]
fn the_compat_note_in_the_library_decides() {
    let note = r#"{"Format":1,"CUDA Version":"12.9","Driver":[535,550,570,575],"Device":[]}"#;
    let b = compat_bundle("575.57.08", &elf_with_note(note));
    ok(&b.run(&["enable-cuda-compat", "--host-driver-version=590.44.01"]));
    assert!(
        !b.rootfs().join(&COMPAT_DROP_IN[1..]).exists(),
        "590 is not a listed branch"
    );
    ok(&b.run(&["enable-cuda-compat", "--host-driver-version=550.163.01"]));
    assert_eq!(b.read(COMPAT_DROP_IN), "/usr/local/cuda-12.8/compat\n");
}

#[test]
fn compat_without_versions_or_libraries_does_nothing() {
    // No version: not even stdin is read.
    ok(&run_with_stdin(&["enable-cuda-compat"], "not json"));
    let b = Bundle::debian();
    ok(&b.run(&["enable-cuda-compat", "--host-driver-version=550.163.01"]));
    assert!(!b.rootfs().join(&COMPAT_DROP_IN[1..]).exists());
}

#[test]
fn compat_then_ldcache_orders_compat_before_the_driver() {
    let b = compat_bundle("575.57.08", b"");
    ok(&b.run(&["enable-cuda-compat", "--host-driver-version=550.163.01"]));
    let ldconfig = b.host_ldconfig();
    ok(&b.run(&ldcache_args(
        &b,
        ldconfig.to_str().unwrap(),
        &["/opt/nvidia/lib"],
    )));
    assert_eq!(
        b.ldconfig_saw(),
        vec![
            "00-compat-cleave.conf",
            "00-nvcr-cleave.conf",
            "libc.conf",
            "x86_64-linux-gnu.conf",
            "zz-nvcr-cleave.conf"
        ]
    );
    // The compat folder listed by our own drop-in is still not repeated in the driver's.
    assert_eq!(
        b.read("/etc/ld.so.conf.d/00-nvcr-cleave.conf"),
        "/opt/nvidia/lib\n"
    );
}

/// A minimal 64-bit little-endian ELF with `.note.cuda.fwd_compatibility` holding `json`.
fn elf_with_note(json: &str) -> Vec<u8> {
    let name = b"NVIDIA Corporation\0";
    let pad = |v: &mut Vec<u8>| {
        while !v.len().is_multiple_of(4) {
            v.push(0);
        }
    };
    let mut note = Vec::new();
    note.extend((name.len() as u32).to_le_bytes());
    note.extend((json.len() as u32).to_le_bytes());
    note.extend(1u32.to_le_bytes());
    note.extend(name);
    pad(&mut note);
    note.extend(json.as_bytes());
    pad(&mut note);
    let strtab = b"\0.shstrtab\0.note.cuda.fwd_compatibility\0".to_vec();
    let note_off = 64u64;
    let str_off = note_off + note.len() as u64;
    let sh_off = str_off + strtab.len() as u64;
    let mut out = vec![0u8; 64];
    out[..4].copy_from_slice(b"\x7fELF");
    out[4] = 2;
    out[5] = 1;
    out[6] = 1;
    out[0x28..0x30].copy_from_slice(&sh_off.to_le_bytes());
    out[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
    out[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
    out[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
    out.extend(&note);
    out.extend(&strtab);
    let sh = |name: u32, kind: u32, off: u64, size: u64, align: u64| {
        let mut s = vec![0u8; 64];
        s[0..4].copy_from_slice(&name.to_le_bytes());
        s[4..8].copy_from_slice(&kind.to_le_bytes());
        s[0x18..0x20].copy_from_slice(&off.to_le_bytes());
        s[0x20..0x28].copy_from_slice(&size.to_le_bytes());
        s[0x30..0x38].copy_from_slice(&align.to_le_bytes());
        s
    };
    out.extend(sh(0, 0, 0, 0, 0));
    out.extend(sh(1, 3, str_off, strtab.len() as u64, 1));
    out.extend(sh(11, 7, note_off, note.len() as u64, 4));
    out
}

// ---- disable-device-node-modification ----

const HOST_PARAMS: &str = "ResmanDebugLevel: 4294967295\nModifyDeviceFiles: 1\nDeviceFileUID: 0\nDeviceFileGID: 0\nDeviceFileMode: 438\n";

fn params_bundle(host: &str) -> (Bundle, PathBuf) {
    let b = Bundle::debian();
    let host_params = b.tmp.path().join("host-params");
    std::fs::write(&host_params, host).unwrap();
    let proc = b.rootfs().join("proc/driver/nvidia");
    std::fs::create_dir_all(&proc).unwrap();
    std::fs::write(proc.join("params"), host).unwrap();
    (b, host_params)
}

#[test]
fn params_already_off_or_absent_is_nothing_to_do() {
    let (b, host) =
        params_bundle(&HOST_PARAMS.replace("ModifyDeviceFiles: 1", "ModifyDeviceFiles: 0"));
    let e = ok(&b.run(&[
        "disable-device-node-modification",
        "--host-params-path",
        host.to_str().unwrap(),
    ]));
    assert!(e.contains("nothing to do"), "{e}");
    assert!(!b.rootfs().join("run").exists());
    let absent = b.tmp.path().join("no-params");
    ok(&run_with_stdin(
        &[
            "disable-device-node-modification",
            "--host-params-path",
            absent.to_str().unwrap(),
        ],
        "not json: never read",
    ));
}

#[test]
fn params_missing_in_the_container_is_an_error_naming_it() {
    let (b, host) = params_bundle(HOST_PARAMS);
    std::fs::remove_dir_all(b.rootfs().join("proc")).unwrap();
    let e = fails(&b.run(&[
        "disable-device-node-modification",
        "--host-params-path",
        host.to_str().unwrap(),
    ]));
    assert!(e.contains("proc/driver/nvidia/params"), "{e}");
}

#[test]
fn params_copy_is_bind_mounted_read_only() {
    if !can_mount() {
        eprintln!("skipped: needs root and unshare to make a private mount namespace");
        return;
    }
    let (b, host) = params_bundle(HOST_PARAMS);
    let target = b.rootfs().join("proc/driver/nvidia/params");
    let state = b.tmp.path().join("state.json");
    std::fs::write(&state, b.state()).unwrap();
    // The hook and the checks run in one throwaway mount namespace, as runc runs a
    // createContainer hook in the container's.
    let sh = format!(
        "'{hook}' disable-device-node-modification --host-params-path '{host}' < '{state}' || exit 9\n\
         echo ---; cat '{target}'; echo ---\n\
         if (echo x >> '{target}') 2>/dev/null; then echo WRITABLE; else echo READONLY; fi\n\
         ls -A '{run}'\n",
        hook = HOOK,
        host = host.display(),
        state = state.display(),
        target = target.display(),
        run = b.rootfs().join("run").display(),
    );
    let out = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &sh])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let shown = stdout.split("---\n").nth(1).unwrap();
    assert_eq!(
        shown,
        HOST_PARAMS.replace("ModifyDeviceFiles: 1", "ModifyDeviceFiles: 0")
    );
    assert!(stdout.contains("READONLY"), "{stdout}");
    // The scratch tmpfs is gone from the container's /run.
    assert!(stdout.trim_end().ends_with("READONLY"), "{stdout}");
    assert!(
        stderr.contains("mounted a copy with ModifyDeviceFiles: 0"),
        "{stderr}"
    );
    // Outside that namespace the file is untouched.
    assert_eq!(std::fs::read_to_string(&target).unwrap(), HOST_PARAMS);
}
