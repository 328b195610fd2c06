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
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::error::{HookError, Result};
use crate::log;
use crate::root::{ContainerRoot, clean_in_root};

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

/// Expands an include pattern inside the root. Wildcards are honoured in the last component
/// only, which covers `include /etc/ld.so.conf.d/*.conf` and its variants. Relative
/// patterns are relative to the including file's directory, as in glibc.
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
    let host_dir = root.resolve(dir, true)?;
    let entries = match std::fs::read_dir(&host_dir) {
        Ok(e) => e,
        Err(_) => return Ok(Vec::new()),
    };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| glob_match(&name, &e.file_name().to_string_lossy()))
        .map(|e| dir.join(e.file_name()))
        .collect();
    found.sort();
    Ok(found)
}

/// Every directory the container's ld.so.conf already lists (following includes), except
/// what this hook's own drop-ins list, so that running the hook twice gives the same files.
pub fn configured_dirs(root: &ContainerRoot) -> Result<HashSet<PathBuf>> {
    let own: HashSet<PathBuf> = [DRIVER_DROP_IN, SYSTEM_DROP_IN, crate::compat::DROP_IN]
        .iter()
        .map(PathBuf::from)
        .collect();
    let mut dirs = HashSet::new();
    let mut seen = HashSet::new();
    let mut queue = vec![PathBuf::from(LD_SO_CONF)];
    while let Some(file) = queue.pop() {
        if !seen.insert(file.clone()) || own.contains(&file) {
            continue;
        }
        let host = root.resolve(&file, true)?;
        let text = match std::fs::read_to_string(&host) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(HookError::io("reading", host, e)),
        };
        let conf = parse_conf(&text);
        dirs.extend(conf.dirs);
        let from_dir = file.parent().unwrap_or(Path::new("/")).to_owned();
        for inc in &conf.includes {
            queue.extend(expand_include(root, inc, &from_dir)?);
        }
    }
    Ok(dirs)
}

fn is_file(root: &ContainerRoot, p: &str) -> bool {
    root.resolve(Path::new(p), true)
        .ok()
        .and_then(|h| std::fs::metadata(h).ok())
        .is_some_and(|m| m.is_file())
}

fn list(dirs: &[PathBuf]) -> String {
    dirs.iter().map(|d| format!("{}\n", d.display())).collect()
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

    let system = system_search_paths(is_file(root, "/etc/debian_version"));
    let mut known = configured_dirs(root)?;
    known.extend(system.iter().cloned());
    let mut folders = Vec::new();
    for f in &opts.folders {
        let clean = clean_in_root(f)?;
        if known.insert(clean.clone()) {
            folders.push(clean);
        }
    }

    if !folders.is_empty() {
        let host = root.write_file(Path::new(DRIVER_DROP_IN), list(&folders).as_bytes())?;
        log::line(
            "update-ldcache",
            format_args!("wrote {} with {:?}", host.display(), folders),
        );
    }
    root.write_file(Path::new(SYSTEM_DROP_IN), list(&system).as_bytes())?;

    if is_file(root, "/etc/alpine-release") {
        let musl = Path::new(musl_path_file());
        let host = root.resolve(musl, false)?;
        let mut existing = std::fs::read_to_string(&host).unwrap_or_default();
        let have: HashSet<String> = existing.lines().map(str::to_owned).collect();
        for d in folders.iter().chain(system.iter()) {
            let d = d.display().to_string();
            if !have.contains(&d) {
                if !existing.is_empty() && !existing.ends_with('\n') {
                    existing.push('\n');
                }
                existing.push_str(&d);
                existing.push('\n');
            }
        }
        root.write_file(musl, existing.as_bytes())?;
        log::line("update-ldcache", format_args!("updated {}", musl.display()));
    }

    let mut cmd = Command::new(&ldconfig);
    cmd.arg("-r")
        .arg(root.host_path())
        .args(["-f", LD_SO_CONF, "-C", LD_SO_CACHE])
        .env_clear()
        .stdin(Stdio::null());
    log::line(
        "update-ldcache",
        format_args!(
            "running {} -r {} -f {LD_SO_CONF} -C {LD_SO_CACHE}",
            ldconfig.display(),
            root.host_path().display()
        ),
    );
    let status = cmd.status().map_err(|e| HookError::Ldconfig {
        path: ldconfig.clone(),
        reason: format!("cannot run: {e}"),
    })?;
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
}
