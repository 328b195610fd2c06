//! The hook under a real runc, when the machine has one (and root): a rootfs made of the
//! host's `sh`, `cat`, glibc and static ldconfig, the hooks in `createContainer`, and the
//! container printing what it sees. Without runc (or root) it is reported as skipped,
//! never as passed; where it is required (`CLEAVE_REQUIRE_RUNC`, or CI, whose `.ci/run`
//! installs Debian's runc) a missing runc fails it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

const HOOK: &str = env!("CARGO_BIN_EXE_cleave-cdi-hook");
/// Set (to anything but `0`) where runc must run: a missing runc is then a failure.
const REQUIRE_ENV: &str = "CLEAVE_REQUIRE_RUNC";

fn main() -> std::process::ExitCode {
    cleave_testkit::runner::main(&[(
        "hooks_run_under_runc_and_the_container_sees_the_result",
        hooks_run_under_runc_and_the_container_sees_the_result,
    )])
}

fn runc() -> Option<PathBuf> {
    let out = Command::new("sh")
        .args(["-c", "command -v runc"])
        .output()
        .ok()?;
    let p = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (out.status.success() && !p.is_empty()).then(|| PathBuf::from(p))
}

fn copy_real(from: &str, to: &Path) -> bool {
    let Ok(real) = std::fs::canonicalize(from) else {
        return false;
    };
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    std::fs::copy(real, to).is_ok()
}

fn hooks_run_under_runc_and_the_container_sees_the_result() {
    use cleave_testkit::runner::tool_missing;
    let Some(runc) = runc() else {
        tool_missing(
            "runc",
            REQUIRE_ENV,
            "no runc on PATH (Debian: apt-get install runc)",
        );
        return;
    };
    // runc needs root for its namespaces.
    if !is_root() {
        tool_missing("runc", REQUIRE_ENV, "not root (runc's namespaces need it)");
        return;
    }
    // The host's zlib under its own versioned name (Debian 12: libz.so.1.2.13, 13: 1.3.1).
    let zlib_host = "/usr/lib/x86_64-linux-gnu/libz.so.1";
    let Some(zlib_name) = std::fs::canonicalize(zlib_host)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
    else {
        tool_missing(
            "runc",
            REQUIRE_ENV,
            &format!("this host has no {zlib_host} to build a rootfs from"),
        );
        return;
    };
    let t = tempfile::tempdir().unwrap();
    let bundle = t.path().join("bundle");
    let r = bundle.join("rootfs");
    let lib = "lib/x86_64-linux-gnu";
    let needed = [
        ("/bin/sh", "bin/sh".to_owned()),
        ("/bin/cat", "bin/cat".to_owned()),
        ("/sbin/ldconfig", "sbin/ldconfig".to_owned()),
        (
            "/lib64/ld-linux-x86-64.so.2",
            "lib64/ld-linux-x86-64.so.2".to_owned(),
        ),
        (
            "/lib/x86_64-linux-gnu/libc.so.6",
            format!("{lib}/libc.so.6"),
        ),
        (zlib_host, format!("opt/drv/{zlib_name}")),
        (
            "/lib/x86_64-linux-gnu/libm.so.6",
            "usr/local/cuda/compat/libcuda.so.575.57.08".to_owned(),
        ),
    ];
    for (from, to) in &needed {
        if !copy_real(from, &r.join(to)) {
            tool_missing(
                "runc",
                REQUIRE_ENV,
                &format!("this host has no {from} to build a rootfs from"),
            );
            return;
        }
    }
    for d in ["proc", "dev", "sys", "tmp", "etc"] {
        std::fs::create_dir_all(r.join(d)).unwrap();
    }
    std::fs::write(r.join("etc/debian_version"), "12.8\n").unwrap();

    let hook = |args: &[&str]| {
        let mut a = vec!["cleave-cdi-hook"];
        a.extend_from_slice(args);
        serde_json::json!({ "path": HOOK, "args": a })
    };
    let script = "cat /etc/ld.so.conf.d/00-compat-cleave.conf /etc/ld.so.conf.d/00-nvcr-cleave.conf; /sbin/ldconfig -p";
    let config = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": { "uid": 0, "gid": 0 },
            "args": ["/bin/sh", "-c", script],
            "env": ["PATH=/bin:/sbin"],
            "cwd": "/",
        },
        "root": { "path": "rootfs", "readonly": false },
        "mounts": [
            { "destination": "/proc", "type": "proc", "source": "proc" },
            { "destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"] },
        ],
        "hooks": { "createContainer": [
            hook(&["create-symlinks", "--link", "libz.so.1::/opt/drv/libz.so"]),
            hook(&["enable-cuda-compat", "--host-driver-version=550.163.01"]),
            hook(&["update-ldcache", "--folder", "/opt/drv"]),
            hook(&["disable-device-node-modification", "--host-params-path", "/nonexistent"]),
        ]},
        "linux": { "namespaces": [
            { "type": "pid" }, { "type": "ipc" }, { "type": "uts" }, { "type": "mount" },
        ]},
    });
    std::fs::write(bundle.join("config.json"), config.to_string()).unwrap();

    let id = format!("cleave-cdi-hook-test-{}", std::process::id());
    let out = Command::new(&runc)
        .args(["run", "--bundle"])
        .arg(&bundle)
        .arg(&id)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let _ = Command::new(&runc)
        .args(["delete", "--force", &id])
        .output();
    assert!(out.status.success(), "runc failed:\n{stdout}\n{stderr}");

    // Inside the container: both drop-ins, and a cache that finds the library by soname.
    assert!(
        stdout.starts_with("/usr/local/cuda/compat\n/opt/drv\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("libz.so.1 (libc6,x86-64) => /opt/drv/libz.so.1"),
        "{stdout}"
    );
    // On the host side of the rootfs: the symlinks the hook and ldconfig made.
    assert_eq!(
        std::fs::read_link(r.join("opt/drv/libz.so")).unwrap(),
        PathBuf::from("libz.so.1")
    );
    assert_eq!(
        std::fs::read_link(r.join("opt/drv/libz.so.1")).unwrap(),
        PathBuf::from(zlib_name)
    );
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            == Some("0")
    })
}
