//! A fake OCI bundle laid out like a container image, and a way to run the hook on it.

#![allow(dead_code)]

use std::io::Write;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

pub const HOOK: &str = env!("CARGO_BIN_EXE_cleave-cdi-hook");
pub const DRIVER: &str = "550.163.01";
pub const LIBDIR: &str = "usr/lib/x86_64-linux-gnu";

/// A temp dir holding `bundle/` (config.json + rootfs/) and `host/` (a fake host ldconfig).
pub struct Bundle {
    pub tmp: tempfile::TempDir,
}

impl Bundle {
    /// A Debian-like image: usrmerge `lib -> usr/lib`, ld.so.conf including ld.so.conf.d,
    /// the image's own (fake) ldconfig, and the driver's libraries as plain files.
    pub fn debian() -> Self {
        let b = Self::empty();
        let r = b.rootfs();
        for d in [LIBDIR, "etc/ld.so.conf.d", "sbin", "usr/local/lib"] {
            std::fs::create_dir_all(r.join(d)).unwrap();
        }
        symlink("usr/lib", r.join("lib")).unwrap();
        std::fs::write(r.join("etc/debian_version"), "12.8\n").unwrap();
        std::fs::write(
            r.join("etc/ld.so.conf"),
            "include /etc/ld.so.conf.d/*.conf\n\n",
        )
        .unwrap();
        std::fs::write(
            r.join("etc/ld.so.conf.d/x86_64-linux-gnu.conf"),
            "# Multiarch support\n/usr/local/lib/x86_64-linux-gnu\n/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n",
        )
        .unwrap();
        std::fs::write(r.join("etc/ld.so.conf.d/libc.conf"), "/usr/local/lib\n").unwrap();
        // The image's ldconfig: must never run (it would run with the runtime's privileges).
        let marker = b.tmp.path().join("container-ldconfig-ran");
        script(
            &r.join("sbin/ldconfig"),
            &format!("touch '{}'\n", marker.display()),
        );
        for lib in [
            "libcuda.so",
            "libnvidia-ml.so",
            "libnvidia-ptxjitcompiler.so",
        ] {
            std::fs::write(r.join(LIBDIR).join(format!("{lib}.{DRIVER}")), "ELF?").unwrap();
        }
        b
    }

    /// A bundle whose rootfs is an empty directory (a distroless-like image).
    pub fn empty() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let bundle = tmp.path().join("bundle");
        std::fs::create_dir_all(bundle.join("rootfs")).unwrap();
        std::fs::write(
            bundle.join("config.json"),
            r#"{"ociVersion":"1.0.2","root":{"path":"rootfs"}}"#,
        )
        .unwrap();
        std::fs::create_dir_all(tmp.path().join("host/sbin")).unwrap();
        let b = Self { tmp };
        b.fake_host_ldconfig(0);
        b
    }

    pub fn bundle(&self) -> PathBuf {
        self.tmp.path().join("bundle")
    }

    pub fn rootfs(&self) -> PathBuf {
        self.bundle().join("rootfs")
    }

    /// The rootfs path as the hook sees it (canonical), for comparing ldconfig's `-r`.
    pub fn rootfs_canonical(&self) -> PathBuf {
        std::fs::canonicalize(self.rootfs()).unwrap()
    }

    pub fn host_ldconfig(&self) -> PathBuf {
        self.tmp.path().join("host/sbin/ldconfig")
    }

    /// Replaces the host's fake ldconfig with one that records its arguments (one per line)
    /// and the drop-ins present when it ran, then exits with `code`.
    pub fn fake_host_ldconfig(&self, code: i32) {
        let args = self.tmp.path().join("ldconfig.args");
        let seen = self.tmp.path().join("ldconfig.saw");
        script(
            &self.host_ldconfig(),
            &format!(
                "for a in \"$@\"; do echo \"$a\"; done > '{}'\nls \"$2/etc/ld.so.conf.d\" > '{}' 2>&1\nexit {code}\n",
                args.display(),
                seen.display()
            ),
        );
    }

    /// The arguments the fake host ldconfig got, or `None` if it did not run.
    pub fn ldconfig_args(&self) -> Option<Vec<String>> {
        let text = std::fs::read_to_string(self.tmp.path().join("ldconfig.args")).ok()?;
        Some(text.lines().map(str::to_owned).collect())
    }

    /// The ld.so.conf.d listing at the time the fake host ldconfig ran.
    pub fn ldconfig_saw(&self) -> Vec<String> {
        std::fs::read_to_string(self.tmp.path().join("ldconfig.saw"))
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    pub fn container_ldconfig_ran(&self) -> bool {
        self.tmp.path().join("container-ldconfig-ran").exists()
    }

    /// The OCI state a runtime writes to the hook's stdin.
    pub fn state(&self) -> String {
        format!(
            r#"{{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":1234,"bundle":"{}"}}"#,
            self.bundle().display()
        )
    }

    /// Runs the hook with `args` and this bundle's state on stdin.
    pub fn run(&self, args: &[&str]) -> Output {
        run_with_stdin(args, &self.state())
    }

    pub fn read(&self, in_root: &str) -> String {
        std::fs::read_to_string(self.rootfs().join(in_root.trim_start_matches('/')))
            .unwrap_or_else(|e| panic!("{in_root}: {e}"))
    }

    pub fn link(&self, in_root: &str) -> PathBuf {
        std::fs::read_link(self.rootfs().join(in_root.trim_start_matches('/')))
            .unwrap_or_else(|e| panic!("{in_root}: {e}"))
    }
}

/// Runs the hook with `args`, writing `stdin` to it.
pub fn run_with_stdin(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(HOOK)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    // The hook may exit before reading stdin (nothing to do); a broken pipe is fine.
    let _ = input.write_all(stdin.as_bytes());
    drop(input);
    child.wait_with_output().unwrap()
}

/// Writes an executable shell script.
pub fn script(path: &Path, body: &str) {
    std::fs::write(path, format!("#!/bin/sh\n{body}")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts success and returns stderr.
#[track_caller]
pub fn ok(o: &Output) -> String {
    let e = stderr(o);
    assert!(o.status.success(), "hook failed: {e}");
    e
}

/// Asserts failure and returns stderr.
#[track_caller]
pub fn fails(o: &Output) -> String {
    let e = stderr(o);
    assert!(!o.status.success(), "hook unexpectedly succeeded: {e}");
    e
}

/// Whether this process may mount (root, and `unshare` can make a private mount namespace).
pub fn can_mount() -> bool {
    Command::new("unshare")
        .args(["--mount", "--propagation", "private", "true"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}
