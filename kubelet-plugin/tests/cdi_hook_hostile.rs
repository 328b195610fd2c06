//! The built hook against hostile images: symlinked files and parent directories pointing at
//! a host "secret" outside the root (absolute and relative), FIFOs and device nodes where
//! the hook reads, names with newlines, include cycles, a host ldconfig that never ends, and
//! a thread swapping directories for symlinks while the hook runs 200 times. Nothing may
//! appear outside the root, nothing host-private inside, and the hook always returns.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod hook_bundle;

use std::io::Write;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hook_bundle::*;

const SECRET: &str = "HOST SECRET: root:$6$not-for-tenants";
/// No hostile image may hold the hook longer than this.
const BOUND: Duration = Duration::from_secs(30);

fn musl_path() -> &'static str {
    if cfg!(target_arch = "aarch64") {
        "etc/ld-musl-aarch64.path"
    } else {
        "etc/ld-musl-x86_64.path"
    }
}

/// A bundle plus a host directory beside it holding a secret file.
struct Hostile {
    b: Bundle,
}

impl Hostile {
    fn debian() -> Self {
        Self::with(Bundle::debian())
    }

    fn alpine() -> Self {
        let b = Bundle::empty();
        std::fs::create_dir_all(b.rootfs().join("etc")).unwrap();
        std::fs::write(b.rootfs().join("etc/alpine-release"), "3.20.0\n").unwrap();
        Self::with(b)
    }

    fn with(b: Bundle) -> Self {
        let host = b.tmp.path().join("host-private");
        std::fs::create_dir_all(&host).unwrap();
        std::fs::write(host.join("shadow"), SECRET).unwrap();
        Self { b }
    }

    fn host(&self) -> PathBuf {
        self.b.tmp.path().join("host-private")
    }

    fn secret(&self) -> PathBuf {
        self.host().join("shadow")
    }

    /// A relative symlink target that climbs far above any directory of the root and then
    /// names `host_path`.
    fn climbing(host_path: &Path) -> String {
        format!("{}{}", "../".repeat(16), host_path.display())
    }

    fn ldcache(&self, extra: &[&str]) -> Output {
        let ldconfig = self.b.host_ldconfig();
        let mut args = vec![
            "update-ldcache",
            "--ldconfig-path",
            ldconfig.to_str().unwrap(),
            "--folder",
            "/opt/nvidia/lib",
        ];
        args.extend_from_slice(extra);
        bounded(&args, &self.b.state())
    }

    /// The host directory is as the test made it, and the secret is nowhere in the root.
    fn assert_contained(&self) {
        let names: Vec<_> = std::fs::read_dir(self.host())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec!["shadow"], "the host directory was written");
        assert_eq!(std::fs::read_to_string(self.secret()).unwrap(), SECRET);
        for (path, text) in files_under(&self.b.rootfs()) {
            assert!(
                !text.contains("HOST SECRET"),
                "host secret copied into {}",
                path.display()
            );
        }
        let top: Vec<_> = std::fs::read_dir(self.b.tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with("ldconfig."))
            .collect();
        let mut top = top;
        top.sort();
        assert_eq!(
            top,
            vec!["bundle", "host", "host-private"],
            "written beside the root"
        );
    }
}

/// Every regular file under `dir` (symlinks not followed) with its contents.
fn files_under(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                let bytes = std::fs::read(e.path()).unwrap_or_default();
                out.push((e.path(), String::from_utf8_lossy(&bytes).into_owned()));
            }
        }
    }
    out
}

/// The hook under test: the one built with these tests, or `CLEAVE_CDI_HOOK_UNDER_TEST`
/// (to run this suite against another build, e.g. an older one, which should fail it).
fn hook() -> String {
    std::env::var("CLEAVE_CDI_HOOK_UNDER_TEST").unwrap_or_else(|_| HOOK.to_owned())
}

/// Runs the hook and fails the test if it does not return within [`BOUND`] (killing it).
fn bounded(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(hook())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let _ = input.write_all(stdin.as_bytes());
    drop(input);
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > BOUND {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "the hook did not return within {BOUND:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Makes a FIFO with the `mkfifo` tool (the test fails if it is missing).
fn mkfifo(p: &Path) {
    let st = Command::new("mkfifo").arg(p).status().expect("mkfifo");
    assert!(st.success(), "mkfifo {}", p.display());
}

/// Makes `p` a character device like /dev/zero; false (skipped loudly) when not root.
fn mknod_zero(p: &Path) -> bool {
    let st = Command::new("mknod").arg(p).args(["c", "1", "5"]).status();
    if st.is_ok_and(|s| s.success()) {
        true
    } else {
        eprintln!("SKIPPED: cannot mknod a character device here (needs root)");
        false
    }
}

// ---- the musl path file (finding 1) ----

#[test]
fn a_musl_path_symlinked_to_a_host_file_is_not_copied_in() {
    for relative in [false, true] {
        let h = Hostile::alpine();
        let target = if relative {
            Hostile::climbing(&h.secret())
        } else {
            h.secret().display().to_string()
        };
        symlink(&target, h.b.rootfs().join(musl_path())).unwrap();
        ok(&h.ldcache(&[]));
        let text = h.b.read(musl_path());
        assert!(!text.contains("HOST SECRET"), "{text}");
        assert!(text.starts_with("/opt/nvidia/lib\n"), "{text}");
        h.assert_contained();
    }
}

#[test]
fn a_musl_path_symlink_is_followed_inside_the_root() {
    let h = Hostile::alpine();
    // The symlink names the host's secret; inside the root that path is the image's own.
    let inside = h.b.rootfs().join(h.secret().strip_prefix("/").unwrap());
    std::fs::create_dir_all(inside.parent().unwrap()).unwrap();
    std::fs::write(&inside, "/image/lib\n").unwrap();
    symlink(h.secret(), h.b.rootfs().join(musl_path())).unwrap();
    ok(&h.ldcache(&[]));
    assert!(
        h.b.read(musl_path())
            .starts_with("/image/lib\n/opt/nvidia/lib\n")
    );
    h.assert_contained();
}

#[test]
fn a_musl_path_under_a_symlinked_etc_stays_in_the_root() {
    let h = Hostile::alpine();
    // /etc is a symlink to a host directory that holds a musl path file and alpine-release.
    let host_etc = h.host().join("etc");
    std::fs::create_dir(&host_etc).unwrap();
    std::fs::write(host_etc.join("alpine-release"), "3.20.0\n").unwrap();
    std::fs::write(
        host_etc.join(Path::new(musl_path()).file_name().unwrap()),
        SECRET,
    )
    .unwrap();
    let r = h.b.rootfs();
    std::fs::rename(r.join("etc"), r.join("etc.image")).unwrap();
    symlink(&host_etc, r.join("etc")).unwrap();
    let o = h.ldcache(&[]);
    assert!(o.status.code().is_some(), "{}", stderr(&o));
    // Whatever the hook made of it, the host's files are as they were.
    let mut names: Vec<_> = std::fs::read_dir(&host_etc)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names.len(), 2, "{names:?}");
    assert_eq!(
        std::fs::read_to_string(host_etc.join(Path::new(musl_path()).file_name().unwrap()))
            .unwrap(),
        SECRET
    );
    std::fs::remove_file(r.join("etc")).unwrap();
    std::fs::remove_dir_all(&host_etc).unwrap();
    h.assert_contained();
}

#[test]
fn a_fifo_or_device_where_the_hook_reads_is_refused_naming_it() {
    for what in ["fifo", "dev", "dev-via-symlink"] {
        let h = Hostile::alpine();
        let p = h.b.rootfs().join(musl_path());
        match what {
            "fifo" => mkfifo(&p),
            "dev" => {
                if !mknod_zero(&p) {
                    continue;
                }
            }
            _ => {
                std::fs::create_dir_all(h.b.rootfs().join("dev")).unwrap();
                if !mknod_zero(&h.b.rootfs().join("dev/zero")) {
                    continue;
                }
                symlink("/dev/zero", &p).unwrap();
            }
        }
        let e = fails(&h.ldcache(&[]));
        assert!(e.contains(musl_path()), "{what}: {e}");
        assert!(e.contains("not a regular file"), "{what}: {e}");
    }
}

#[test]
fn a_fifo_at_ld_so_conf_is_refused_naming_it() {
    let h = Hostile::debian();
    let conf = h.b.rootfs().join("etc/ld.so.conf");
    std::fs::remove_file(&conf).unwrap();
    mkfifo(&conf);
    let e = fails(&h.ldcache(&[]));
    assert!(e.contains("/etc/ld.so.conf"), "{e}");
    assert!(e.contains("FIFO"), "{e}");
    // A FIFO reached through an include is refused too.
    let h = Hostile::debian();
    mkfifo(&h.b.rootfs().join("etc/ld.so.conf.d/fifo.conf"));
    let e = fails(&h.ldcache(&[]));
    assert!(e.contains("/etc/ld.so.conf.d/fifo.conf"), "{e}");
}

#[test]
fn a_huge_ld_so_conf_is_refused_naming_it() {
    let h = Hostile::debian();
    let line = "/usr/lib\n".repeat((2 << 20) / 9);
    std::fs::write(h.b.rootfs().join("etc/ld.so.conf.d/big.conf"), line).unwrap();
    let e = fails(&h.ldcache(&[]));
    assert!(e.contains("/etc/ld.so.conf.d/big.conf"), "{e}");
    assert!(e.contains("larger than"), "{e}");
}

// ---- includes (finding 3) ----

#[test]
fn an_include_through_a_missing_dir_and_dotdot_stays_in_the_root() {
    let h = Hostile::debian();
    // On the host, the secret directory lists the driver folder: were it read, the hook
    // would think the folder configured and leave it out of its drop-in.
    std::fs::write(h.host().join("x.conf"), "/opt/nvidia/lib\n").unwrap();
    let r = h.b.rootfs();
    symlink(h.host(), r.join("evil")).unwrap();
    std::fs::write(
        r.join("etc/ld.so.conf"),
        "include /missing/../evil/*.conf\ninclude /etc/ld.so.conf.d/*.conf\n",
    )
    .unwrap();
    ok(&h.ldcache(&[]));
    assert_eq!(
        h.b.read("/etc/ld.so.conf.d/00-nvcr-cleave.conf"),
        "/opt/nvidia/lib\n"
    );
    std::fs::remove_file(h.host().join("x.conf")).unwrap();
    h.assert_contained();
}

#[test]
fn relative_include_cycles_end() {
    let h = Hostile::debian();
    let r = h.b.rootfs();
    std::fs::create_dir_all(r.join("etc/sub")).unwrap();
    // Each round names the same file by a longer path.
    std::fs::write(
        r.join("etc/ld.so.conf"),
        "include sub/../ld.so.conf\ninclude ld.so.conf.d/*.conf\n",
    )
    .unwrap();
    std::fs::write(r.join("etc/sub/loop.conf"), "include ../sub/loop.conf\n").unwrap();
    std::fs::write(
        r.join("etc/ld.so.conf.d/loop.conf"),
        "include ../sub/loop.conf\n",
    )
    .unwrap();
    ok(&h.ldcache(&[]));
    assert_eq!(
        h.b.read("/etc/ld.so.conf.d/00-nvcr-cleave.conf"),
        "/opt/nvidia/lib\n"
    );
}

#[test]
fn too_deep_an_include_chain_is_refused() {
    let h = Hostile::debian();
    let r = h.b.rootfs();
    std::fs::write(r.join("etc/ld.so.conf"), "include c0.conf\n").unwrap();
    for i in 0..40 {
        std::fs::write(
            r.join(format!("etc/c{i}.conf")),
            format!("include c{}.conf\n", i + 1),
        )
        .unwrap();
    }
    let e = fails(&h.ldcache(&[]));
    assert!(e.contains("levels deep"), "{e}");
}

// ---- names with newlines ----

#[test]
fn a_compat_folder_name_with_a_newline_is_refused_naming_it() {
    let b = Bundle::debian();
    let r = b.rootfs();
    let evil = "opt/x\n/etc/cron.d";
    std::fs::create_dir_all(r.join(evil)).unwrap();
    std::fs::write(r.join(evil).join("libcuda.so.575.57.08"), "ELF?").unwrap();
    std::fs::create_dir_all(r.join("usr/local/cuda")).unwrap();
    symlink(format!("/{evil}"), r.join("usr/local/cuda/compat")).unwrap();
    let h = Hostile::with(b);
    let o = bounded(
        &["enable-cuda-compat", "--host-driver-version", "550.163.01"],
        &h.b.state(),
    );
    let e = fails(&o);
    assert!(e.contains("control characters"), "{e}");
    assert!(e.contains("/opt/x\\n/etc/cron.d"), "{e}");
    assert_eq!(e.lines().filter(|l| l.contains("cron.d")).count(), 1, "{e}");
    assert!(
        !h.b.rootfs()
            .join("etc/ld.so.conf.d/00-compat-cleave.conf")
            .exists()
    );
    h.assert_contained();
}

#[test]
fn a_folder_argument_with_a_newline_is_refused() {
    let h = Hostile::debian();
    let e = fails(&h.ldcache(&["--folder", "/opt/a\n/etc/cron.d"]));
    assert!(e.contains("control characters"), "{e}");
    assert!(
        !h.b.rootfs()
            .join("etc/ld.so.conf.d/00-nvcr-cleave.conf")
            .exists()
    );
}

// ---- time bounds ----

#[test]
fn a_host_ldconfig_that_never_ends_is_killed() {
    let h = Hostile::debian();
    let pid_file = h.b.tmp.path().join("ldconfig.pid");
    script(
        &h.b.host_ldconfig(),
        &format!("echo $$ > '{}'\nexec sleep 600\n", pid_file.display()),
    );
    let start = Instant::now();
    let e = fails(&h.ldcache(&["--ldconfig-timeout-secs", "1"]));
    assert!(e.contains("did not finish within 1 s"), "{e}");
    assert!(start.elapsed() < BOUND);
    assert_gone(&pid_file);

    // The whole hook's deadline, when ldconfig's own timeout is longer.
    std::fs::remove_file(&pid_file).unwrap();
    let e = fails(&h.ldcache(&["--ldconfig-timeout-secs", "100", "--deadline-secs", "1"]));
    assert!(e.contains("did not finish within 1 s"), "{e}");
    assert_gone(&pid_file);
}

/// The process whose pid is in `pid_file` has ended (gone, or a zombie awaiting its new
/// parent), within a bound.
fn assert_gone(pid_file: &Path) {
    let pid = std::fs::read_to_string(pid_file).unwrap().trim().to_owned();
    let start = Instant::now();
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat.rsplit(')').next().unwrap_or("").trim_start();
        if stat.is_empty() || state.starts_with('Z') {
            return;
        }
        assert!(start.elapsed() < BOUND, "ldconfig {pid} still runs: {stat}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ---- races (finding 2) ----

/// Atomically exchanges two names (renameat2 RENAME_EXCHANGE): the attacker's best tool,
/// since the name is never missing and flips between a directory and a symlink.
#[allow(unsafe_code)]
fn exchange(a: &Path, b: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let (Ok(a), Ok(b)) = (
        std::ffi::CString::new(a.as_os_str().as_bytes()),
        std::ffi::CString::new(b.as_os_str().as_bytes()),
    ) else {
        return false;
    };
    // SAFETY: both pointers are NUL-terminated strings owned by locals that outlive the
    // call; renameat2(2) only reads them.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    rc == 0
}

/// A thread keeps exchanging `/etc/ld.so.conf.d` and the compat folder with symlinks to the
/// host directory (absolute and relative) while the hook runs 200 times each of
/// `update-ldcache` and `enable-cuda-compat`: the host directory is never written, no
/// secret is read in, every run returns.
#[test]
fn swapping_directories_for_symlinks_while_the_hook_runs_never_reaches_the_host() {
    let h = Hostile::debian();
    let r = h.b.rootfs();
    std::fs::create_dir_all(r.join("usr/local/cuda/compat")).unwrap();
    std::fs::write(r.join("usr/local/cuda/compat/libcuda.so.575.57.08"), "ELF?").unwrap();
    let dirs = ["etc/ld.so.conf.d", "usr/local/cuda/compat"];
    for dir in dirs {
        symlink(h.host(), r.join(format!("{dir}.abs"))).unwrap();
        symlink(Hostile::climbing(&h.host()), r.join(format!("{dir}.rel"))).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let stop = stop.clone();
        let r = r.clone();
        std::thread::spawn(move || {
            let mut swaps = 0u64;
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let kind = if i.is_multiple_of(2) { "abs" } else { "rel" };
                for dir in dirs {
                    let (d, s) = (r.join(dir), r.join(format!("{dir}.{kind}")));
                    // There and back: the name is a symlink between the two calls.
                    if exchange(&d, &s) {
                        swaps += 1;
                        exchange(&d, &s);
                    }
                }
                i += 1;
            }
            swaps
        })
    };
    let ldconfig = h.b.host_ldconfig();
    let mut failures = 0;
    for _ in 0..200 {
        let o = bounded(
            &[
                "update-ldcache",
                "--ldconfig-path",
                ldconfig.to_str().unwrap(),
                "--folder",
                "/opt/nvidia/lib",
            ],
            &h.b.state(),
        );
        let o2 = bounded(
            &["enable-cuda-compat", "--host-driver-version", "550.163.01"],
            &h.b.state(),
        );
        for out in [&o, &o2] {
            if !out.status.success() {
                failures += 1;
                if failures <= 3 {
                    eprintln!("refused under the race: {}", stderr(out).trim_end());
                }
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let swaps = swapper.join().unwrap();
    assert!(swaps > 0, "the swapper never ran");
    eprintln!("{swaps} swaps, {failures} of 400 hook runs refused or failed");
    h.assert_contained();
}
