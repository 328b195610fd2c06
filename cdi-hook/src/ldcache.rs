//! `update-ldcache`: make the injected driver libraries findable by the container's dynamic
//! linker, after NVIDIA/nvidia-container-toolkit cmd/nvidia-cdi-hook/update-ldcache and
//! internal/ldconfig.
//!
//! The folders go to an ld.so.conf.d drop-in inside the container, the container's system
//! directories to a second drop-in sorted last, and then the *host's* ldconfig rebuilds the
//! container's `/etc/ld.so.cache` with `-r <root>` (ldconfig chroots into the root first).
//! The image's own ldconfig is never run: the hook has the runtime's privileges, and a binary
//! from the image must not run with them.

use std::collections::HashSet;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::error::{HookError, Result};
use crate::log;
use crate::root::{ContainerRoot, clean_in_root, config_line, escaped};

/// Top-level ld.so.conf inside the container.
pub const LD_SO_CONF: &str = "/etc/ld.so.conf";
/// The cache ldconfig writes inside the container.
pub const LD_SO_CACHE: &str = "/etc/ld.so.cache";
/// Drop-in with the driver library folders. The `00-nvcr-` prefix is NVIDIA's: it sorts
/// before the distribution's files (the folders win) but after `00-compat-*` and
/// `00-cuda-compat*` (the CUDA forward-compat libraries win over the host driver).
pub const DRIVER_DROP_IN: &str = "/etc/ld.so.conf.d/00-nvcr-cleave.conf";
/// Drop-in with the container's system directories, sorted last: the host's ldconfig has
/// the host's built-in directories, which may not be the image's (Debian vs RHEL layouts).
pub const SYSTEM_DROP_IN: &str = "/etc/ld.so.conf.d/zz-nvcr-cleave.conf";
/// Where NVIDIA's hook looks for ldconfig on the host by default.
pub const DEFAULT_LDCONFIG: &str = "/sbin/ldconfig";

/// What `update-ldcache` was asked to do.
#[derive(Debug)]
pub struct Options {
    /// Container folders holding injected libraries.
    pub folders: Vec<PathBuf>,
    /// The host's ldconfig (before `.real` normalization).
    pub ldconfig: PathBuf,
    /// How long ldconfig may run before it is killed.
    pub timeout: Duration,
}

/// On Debian and Ubuntu `/sbin/ldconfig` is a shell wrapper around `/sbin/ldconfig.real`;
/// like NVIDIA, use the `.real` binary when it exists.
pub fn normalize_ldconfig(p: &Path) -> PathBuf {
    let s = p.as_os_str().to_string_lossy();
    let base = s.strip_suffix(".real").unwrap_or(&s);
    let real = PathBuf::from(format!("{base}.real"));
    if real.exists() {
        real
    } else {
        PathBuf::from(base)
    }
}

/// The directories glibc's ldconfig searches without being told, for the image's layout.
pub fn system_search_paths(debian_like: bool) -> Vec<PathBuf> {
    let arch: &[&str] = if cfg!(target_arch = "aarch64") {
        if debian_like {
            &["/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu"]
        } else {
            &["/lib64", "/usr/lib64"]
        }
    } else if debian_like {
        &["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu"]
    } else {
        &["/lib64", "/usr/lib64", "/libx32", "/usr/libx32"]
    };
    let generic = ["/lib", "/usr/lib"];
    let ordered: Vec<&str> = if debian_like {
        arch.iter().chain(generic.iter()).copied().collect()
    } else {
        generic.iter().chain(arch.iter()).copied().collect()
    };
    ordered.into_iter().map(PathBuf::from).collect()
}

/// The musl loader's search-path file, which Alpine uses instead of an ld cache.
fn musl_path_file() -> &'static str {
    if cfg!(target_arch = "aarch64") {
        "/etc/ld-musl-aarch64.path"
    } else {
        "/etc/ld-musl-x86_64.path"
    }
}

/// One parsed ld.so.conf: directories listed and `include` patterns.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ConfFile {
    pub dirs: Vec<PathBuf>,
    pub includes: Vec<String>,
}

/// Parses ld.so.conf syntax: `#` comments, `include <pattern>...`, `hwcap` lines (ignored),
/// otherwise one directory per line, optionally followed by `=<type>`.
pub fn parse_conf(text: &str) -> ConfFile {
    let mut out = ConfFile::default();
    for raw in text.lines() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("include")
            && rest.starts_with([' ', '\t'])
        {
            out.includes
                .extend(rest.split_whitespace().map(str::to_owned));
            continue;
        }
        if line.starts_with("hwcap") && line[5..].starts_with([' ', '\t']) {
            continue;
        }
        let dir = line.split('=').next().unwrap_or("").trim();
        let dir = dir.trim_end_matches('/');
        out.dirs
            .push(PathBuf::from(if dir.is_empty() { "/" } else { dir }));
    }
    out
}

/// Shell-style match of one file name against `*` and `?` (glibc's glob does not let a
/// leading `*` match a leading dot, and neither does this).
pub fn glob_match(pattern: &str, name: &str) -> bool {
    if name.starts_with('.') && !pattern.starts_with('.') {
        return false;
    }
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// The deepest chain of `include`s followed, and the most files read, before the image is
/// refused: glibc's own ld.so.conf files nest two deep and list a few dozen files.
pub const MAX_INCLUDE_DEPTH: usize = 16;
pub const MAX_CONF_FILES: usize = 1024;
/// How long the host's ldconfig may run before it is killed (the hook's default).
pub const LDCONFIG_TIMEOUT: Duration = Duration::from_secs(30);

/// Expands an include pattern inside the root. Wildcards are honoured in the last component
/// only, which covers `include /etc/ld.so.conf.d/*.conf` and its variants. Relative
/// patterns are relative to the including file's directory, as in glibc. The directory is
/// opened inside the root (the kernel confines every symlink and `..` to it).
fn expand_include(root: &ContainerRoot, pattern: &str, from_dir: &Path) -> Result<Vec<PathBuf>> {
    let path = if Path::new(pattern).is_absolute() {
        PathBuf::from(pattern)
    } else {
        from_dir.join(pattern)
    };
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Ok(Vec::new());
    };
    let name = name.to_string_lossy();
    if !name.contains(['*', '?']) {
        return Ok(vec![path]);
    }
    let Some(handle) = root.open_dir(dir)? else {
        return Ok(Vec::new());
    };
    Ok(handle
        .list()?
        .into_iter()
        .filter(|(n, _)| glob_match(&name, &n.to_string_lossy()))
        .map(|(n, _)| dir.join(n))
        .collect())
}

/// Every directory the container's ld.so.conf already lists (following includes), except
/// what this hook's own drop-ins list, so that running the hook twice gives the same files.
/// A file already read (same inode, whatever the path) is not read again, so include cycles
/// end; chains deeper than [`MAX_INCLUDE_DEPTH`] or more than [`MAX_CONF_FILES`] files are
/// refused, as are includes that are not regular files (a FIFO would block the hook).
pub fn configured_dirs(root: &ContainerRoot) -> Result<HashSet<PathBuf>> {
    let own: HashSet<PathBuf> = [DRIVER_DROP_IN, SYSTEM_DROP_IN, crate::compat::DROP_IN]
        .iter()
        .map(PathBuf::from)
        .collect();
    let mut dirs = HashSet::new();
    let mut seen_inodes = HashSet::new();
    let mut reads = 0usize;
    let mut queue = vec![(PathBuf::from(LD_SO_CONF), 0usize)];
    while let Some((file, depth)) = queue.pop() {
        if own.contains(&file) {
            continue;
        }
        let refuse = |reason: String| HookError::Refused {
            path: escaped(file.as_os_str()),
            reason,
        };
        if depth > MAX_INCLUDE_DEPTH {
            return Err(refuse(format!(
                "is included more than {MAX_INCLUDE_DEPTH} levels deep"
            )));
        }
        reads += 1;
        if reads > MAX_CONF_FILES {
            return Err(refuse(format!(
                "ld.so.conf includes more than {MAX_CONF_FILES} files"
            )));
        }
        let Some((id, text)) = root.read_config_id(&file)? else {
            continue;
        };
        if !seen_inodes.insert(id) {
            continue;
        }
        let conf = parse_conf(&text);
        dirs.extend(conf.dirs);
        let from_dir = file.parent().unwrap_or(Path::new("/")).to_owned();
        for inc in &conf.includes {
            for f in expand_include(root, inc, &from_dir)? {
                queue.push((f, depth + 1));
            }
        }
    }
    Ok(dirs)
}

fn list(dirs: &[PathBuf]) -> Result<String> {
    let mut out = String::new();
    for d in dirs {
        out.push_str(config_line(d)?);
        out.push('\n');
    }
    Ok(out)
}

/// Writes the drop-ins and runs the host's ldconfig against the container root.
pub fn run(root: &ContainerRoot, opts: &Options) -> Result<()> {
    let ldconfig = normalize_ldconfig(&opts.ldconfig);
    match std::fs::metadata(&ldconfig) {
        Ok(m) if m.is_file() => {}
        Ok(_) => {
            return Err(HookError::Ldconfig {
                path: ldconfig,
                reason: "is not a file".into(),
            });
        }
        Err(e) => {
            return Err(HookError::Ldconfig {
                path: ldconfig,
                reason: format!("cannot use the host's ldconfig: {e}"),
            });
        }
    }

    let include = format!("include {}/*.conf\n", "/etc/ld.so.conf.d");
    if root.create_if_missing(Path::new(LD_SO_CONF), include.as_bytes())? {
        log::line(
            "update-ldcache",
            format_args!("created {LD_SO_CONF} (the image had none)"),
        );
    }

    let system = system_search_paths(root.is_file(Path::new("/etc/debian_version")));
    let mut known = configured_dirs(root)?;
    known.extend(system.iter().cloned());
    let mut folders = Vec::new();
    for f in &opts.folders {
        let clean = clean_in_root(f)?;
        config_line(&clean)?;
        if known.insert(clean.clone()) {
            folders.push(clean);
        }
    }

    if !folders.is_empty() {
        let host = root.write_file(Path::new(DRIVER_DROP_IN), list(&folders)?.as_bytes())?;
        log::line(
            "update-ldcache",
            format_args!("wrote {} with {:?}", host.display(), folders),
        );
    }
    root.write_file(Path::new(SYSTEM_DROP_IN), list(&system)?.as_bytes())?;

    if root.is_file(Path::new("/etc/alpine-release")) {
        // Read through the root handle: a symlink here is followed inside the container
        // only, and a FIFO, device or huge file is refused.
        let musl = Path::new(musl_path_file());
        let mut existing = root.read_config(musl)?.unwrap_or_default();
        let have: HashSet<String> = existing.lines().map(str::to_owned).collect();
        for d in folders.iter().chain(system.iter()) {
            let d = config_line(d)?;
            if !have.contains(d) {
                if !existing.is_empty() && !existing.ends_with('\n') {
                    existing.push('\n');
                }
                existing.push_str(d);
                existing.push('\n');
            }
        }
        root.write_file(musl, existing.as_bytes())?;
        log::line("update-ldcache", format_args!("updated {}", musl.display()));
    }

    // `-r /proc/self/fd/<n>`, a handle of the root opened by this hook and inherited by
    // ldconfig: running as root, ldconfig chroot(2)s into it before reading anything (the
    // kernel follows the magic link to that very directory, whatever its path now names),
    // and inside the chroot the kernel keeps the image's symlinks and `..` inside the root.
    let root_fd = root.handle_for_child()?;
    let root_arg = format!("/proc/self/fd/{}", root_fd.as_raw_fd());
    let mut cmd = Command::new(&ldconfig);
    cmd.arg("-r")
        .arg(&root_arg)
        .args(["-f", LD_SO_CONF, "-C", LD_SO_CACHE])
        .env_clear()
        .stdin(Stdio::null());
    log::line(
        "update-ldcache",
        format_args!(
            "running {} -r {root_arg} (the root {}) -f {LD_SO_CONF} -C {LD_SO_CACHE}",
            ldconfig.display(),
            root.host_path().display()
        ),
    );
    let status = run_bounded(cmd, opts.timeout).map_err(|reason| HookError::Ldconfig {
        path: ldconfig.clone(),
        reason,
    })?;
    drop(root_fd);
    if !status.success() {
        return Err(HookError::Ldconfig {
            path: ldconfig,
            reason: format!(
                "failed ({status}) on container root {}",
                root.host_path().display()
            ),
        });
    }
    Ok(())
}

/// Runs `cmd` and waits at most `timeout` for it; on timeout it is killed and reaped.
fn run_bounded(mut cmd: Command, timeout: Duration) -> std::result::Result<ExitStatus, String> {
    let mut child = cmd.spawn().map_err(|e| format!("cannot run: {e}"))?;
    crate::deadline::track_child(child.id());
    let start = Instant::now();
    let result = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if start.elapsed() >= timeout => {
                let _ = child.kill();
                let _ = child.wait();
                break Err(format!(
                    "did not finish within {} s; killed it",
                    timeout.as_secs()
                ));
            }
            // Polling: std has no wait with a timeout, and ldconfig takes milliseconds.
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => break Err(format!("waiting for it: {e}")),
        }
    };
    crate::deadline::track_child(0);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_conf_lines() {
        let c = parse_conf(
            "# comment\ninclude /etc/ld.so.conf.d/*.conf other.conf\n/opt/lib/ # trailing\nhwcap 1 x\n/usr/local/lib=libc6\n\n",
        );
        assert_eq!(
            c.includes,
            vec![
                "/etc/ld.so.conf.d/*.conf".to_owned(),
                "other.conf".to_owned()
            ]
        );
        assert_eq!(
            c.dirs,
            vec![PathBuf::from("/opt/lib"), PathBuf::from("/usr/local/lib")]
        );
    }

    #[test]
    fn globs_like_the_shell() {
        assert!(glob_match("*.conf", "libc.conf"));
        assert!(!glob_match("*.conf", "libc.conf.bak"));
        assert!(!glob_match("*.conf", ".00-nvcr-cleave.conf.cleave-tmp-1"));
        assert!(glob_match("x?.conf", "x1.conf"));
        assert!(glob_match("*", "a"));
        assert!(glob_match("a*b*c", "aXbYc"));
        assert!(!glob_match("a*b*c", "aXbY"));
    }

    #[test]
    fn system_paths_follow_the_image_layout() {
        let deb = system_search_paths(true);
        let rhel = system_search_paths(false);
        assert!(deb.contains(&PathBuf::from("/usr/lib")));
        assert!(rhel.contains(&PathBuf::from("/usr/lib64")));
        if cfg!(target_arch = "x86_64") {
            assert_eq!(deb[1], PathBuf::from("/usr/lib/x86_64-linux-gnu"));
        }
    }

    #[test]
    fn prefers_ldconfig_real() {
        let t = tempfile::tempdir().unwrap();
        let plain = t.path().join("ldconfig");
        std::fs::write(&plain, "").unwrap();
        assert_eq!(normalize_ldconfig(&plain), plain);
        std::fs::write(t.path().join("ldconfig.real"), "").unwrap();
        assert_eq!(normalize_ldconfig(&plain), t.path().join("ldconfig.real"));
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;
        use std::os::unix::fs::symlink;

        fn name() -> impl Strategy<Value = String> {
            prop::sample::select(vec!["a", "b", "c.conf", "d.conf", "sub", "..", "."])
                .prop_map(str::to_owned)
        }

        fn path() -> impl Strategy<Value = String> {
            prop::collection::vec(name(), 1..4).prop_map(|v| v.join("/"))
        }

        fn include() -> impl Strategy<Value = String> {
            prop_oneof![
                path(),
                path().prop_map(|p| format!("/etc/{p}")),
                path().prop_map(|p| format!("{p}/*.conf")),
                Just("@HOST@/*.conf".to_owned()),
                Just("/missing/../evil/*.conf".to_owned()),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

            /// Random include graphs (relative, absolute, globs, `..`, cycles) over files and
            /// symlinks, some naming a host directory whose file lists `/HOST`: reading the
            /// configuration ends, and never returns a directory listed only on the host.
            #[test]
            fn includes_end_and_stay_in_the_root(
                files in prop::collection::vec(
                    (path(), prop::collection::vec(include(), 0..3)),
                    1..8,
                ),
                links in prop::collection::vec((path(), prop_oneof![
                    Just("@HOST@".to_owned()),
                    path(),
                    Just("../../../../@HOST@".to_owned()),
                ]), 0..4),
            ) {
                let tmp = tempfile::tempdir().unwrap();
                let host = tmp.path().join("host");
                std::fs::create_dir_all(&host).unwrap();
                std::fs::write(host.join("x.conf"), "/HOST\n").unwrap();
                let rootfs = tmp.path().join("rootfs");
                std::fs::create_dir_all(rootfs.join("etc/sub")).unwrap();
                let fill = |s: &str| s.replace("@HOST@", host.to_str().unwrap());
                symlink(&host, rootfs.join("evil")).unwrap();
                for (link, target) in &links {
                    let _ = symlink(fill(target), rootfs.join("etc").join(link));
                }
                let mut first = true;
                for (file, includes) in &files {
                    let text: String = includes
                        .iter()
                        .map(|i| format!("include {}\n", fill(i)))
                        .chain(std::iter::once("/image/lib\n".to_owned()))
                        .collect();
                    let at = if first {
                        rootfs.join("etc/ld.so.conf")
                    } else {
                        rootfs.join("etc").join(file)
                    };
                    first = false;
                    // Only plain paths inside the image's /etc (the test's own writes must
                    // not follow the image's symlinks either).
                    if at.components().any(|c| c.as_os_str() == "..")
                        || std::fs::symlink_metadata(at.parent().unwrap())
                            .map(|m| !m.is_dir())
                            .unwrap_or(true)
                    {
                        continue;
                    }
                    let _ = std::fs::write(&at, text);
                }
                let r = ContainerRoot::new(&rootfs).unwrap();
                if let Ok(dirs) = configured_dirs(&r) {
                    prop_assert!(!dirs.contains(Path::new("/HOST")), "{:?}", dirs);
                }
            }
        }
    }
}
