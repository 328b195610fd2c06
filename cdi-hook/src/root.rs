//! Paths inside the container root, resolved the way the container will see them: symlinks
//! in the image are followed, but an absolute target restarts at the container root and `..`
//! stops at it, so nothing the image contains can send a write onto the host.
//!
//! The resolution is done in user space, component by component. It is not race-free against
//! a process changing the tree at the same time; a createContainer hook runs before any
//! process of the container has started, which is what makes that acceptable here.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use crate::error::{HookError, Result};

/// Linux gives up after 40 symlinks in one lookup; so do we.
const MAX_SYMLINKS: usize = 40;

/// A container's root filesystem on the host.
#[derive(Debug, Clone)]
pub struct ContainerRoot {
    host: PathBuf,
}

/// Splits `p` into normal components, refusing any `..` that would climb above the root.
/// Used for paths given on the command line, which must not point outside the container.
pub fn clean_in_root(p: &Path) -> Result<PathBuf> {
    let mut out = PathBuf::from("/");
    for c in p.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Prefix(_) => {}
            Component::ParentDir => {
                if !out.pop() {
                    return Err(HookError::BadPath {
                        path: p.to_owned(),
                        reason: "climbs above the container root".into(),
                    });
                }
            }
            Component::Normal(n) => out.push(n),
        }
    }
    Ok(out)
}

impl ContainerRoot {
    /// Opens the root at `host` (made absolute and canonical); refuses `/` and non-directories.
    pub fn new(host: &Path) -> Result<Self> {
        let canon = std::fs::canonicalize(host).map_err(|e| HookError::BadRoot {
            path: host.to_owned(),
            reason: e.to_string(),
        })?;
        if canon == Path::new("/") {
            return Err(HookError::BadRoot {
                path: host.to_owned(),
                reason: "is the host's / (refusing to modify the host)".into(),
            });
        }
        let meta = std::fs::metadata(&canon).map_err(|e| HookError::BadRoot {
            path: host.to_owned(),
            reason: e.to_string(),
        })?;
        if !meta.is_dir() {
            return Err(HookError::BadRoot {
                path: host.to_owned(),
                reason: "is not a directory".into(),
            });
        }
        Ok(Self { host: canon })
    }

    /// The root's host path.
    pub fn host_path(&self) -> &Path {
        &self.host
    }

    /// Resolves `p` (absolute or relative to the root, as the container sees it) to a host path.
    /// Symlinks are followed inside the root, the last component's only when `follow_last`.
    /// Missing components are kept as they are, so the result can name something to create.
    pub fn resolve(&self, p: &Path, follow_last: bool) -> Result<PathBuf> {
        Ok(self.host_of(&self.resolve_in_root(p, follow_last)?))
    }

    /// The host path of an already resolved container path. `Path::join` with an absolute
    /// path would replace the root, so the leading `/` is dropped first.
    pub fn host_of(&self, in_root: &Path) -> PathBuf {
        self.host.join(in_root.strip_prefix("/").unwrap_or(in_root))
    }

    /// As [`resolve`](Self::resolve), but returns the path as the container sees it
    /// (absolute, starting at the container's `/`).
    pub fn resolve_in_root(&self, p: &Path, follow_last: bool) -> Result<PathBuf> {
        let mut queue: VecDeque<OsString> = components(p);
        let mut resolved: Vec<OsString> = Vec::new();
        let mut hops = 0;
        let mut missing = false;
        while let Some(c) = queue.pop_front() {
            if c == ".." {
                resolved.pop();
                continue;
            }
            if missing {
                resolved.push(c);
                continue;
            }
            let candidate = self
                .host
                .join(resolved.iter().collect::<PathBuf>())
                .join(&c);
            let is_last = queue.is_empty();
            match std::fs::symlink_metadata(&candidate) {
                Ok(m) if m.file_type().is_symlink() && (follow_last || !is_last) => {
                    hops += 1;
                    if hops > MAX_SYMLINKS {
                        return Err(HookError::BadPath {
                            path: p.to_owned(),
                            reason: format!("more than {MAX_SYMLINKS} symlinks"),
                        });
                    }
                    let target = std::fs::read_link(&candidate)
                        .map_err(|e| HookError::io("reading the symlink", &candidate, e))?;
                    if target.is_absolute() {
                        resolved.clear();
                    }
                    for t in components(&target).into_iter().rev() {
                        queue.push_front(t);
                    }
                }
                Ok(_) => resolved.push(c),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    missing = true;
                    resolved.push(c);
                }
                Err(e) => return Err(HookError::io("inspecting", candidate, e)),
            }
        }
        let mut out = PathBuf::from("/");
        out.extend(resolved);
        Ok(out)
    }

    /// Creates directory `dir` (a container path) and its missing parents inside the root;
    /// returns its host path.
    pub fn mkdir_all(&self, dir: &Path) -> Result<PathBuf> {
        let host = self.resolve(dir, true)?;
        std::fs::create_dir_all(&host)
            .map_err(|e| HookError::io("creating directory", &host, e))?;
        Ok(host)
    }

    /// Writes `contents` to the container file `file`, world-readable (0644), replacing what
    /// is there: a temporary file created exclusively, then renamed over the name, so an
    /// existing symlink at that name is replaced rather than followed.
    pub fn write_file(&self, file: &Path, contents: &[u8]) -> Result<PathBuf> {
        let (dir, name) = split_parent(file)?;
        let host_dir = self.mkdir_all(&dir)?;
        let host_file = host_dir.join(&name);
        let mut tmp_name = OsString::from(".");
        tmp_name.push(&name);
        tmp_name.push(format!(".cleave-tmp-{}", std::process::id()));
        let tmp = host_dir.join(tmp_name);
        let _ = std::fs::remove_file(&tmp);
        let write = || -> io::Result<()> {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)?;
            f.write_all(contents)?;
            f.set_permissions(std::fs::Permissions::from_mode(0o644))?;
            std::fs::rename(&tmp, &host_file)
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            HookError::io("writing", &host_file, e)
        })?;
        Ok(host_file)
    }

    /// Creates `file` (a container path) with `contents` only if nothing is at that name;
    /// returns whether it did.
    pub fn create_if_missing(&self, file: &Path, contents: &[u8]) -> Result<bool> {
        let host = self.resolve(file, false)?;
        if std::fs::symlink_metadata(&host).is_ok() {
            return Ok(false);
        }
        self.write_file(file, contents)?;
        Ok(true)
    }
}

/// The directory and file name of a container path.
pub fn split_parent(p: &Path) -> Result<(PathBuf, OsString)> {
    let clean = clean_in_root(p)?;
    match (clean.parent(), clean.file_name()) {
        (Some(d), Some(n)) => Ok((d.to_owned(), n.to_owned())),
        _ => Err(HookError::BadPath {
            path: p.to_owned(),
            reason: "names the container root itself".into(),
        }),
    }
}

fn components(p: &Path) -> VecDeque<OsString> {
    p.components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_owned()),
            Component::ParentDir => Some(OsString::from("..")),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn root() -> (tempfile::TempDir, ContainerRoot) {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t.path().join("rootfs/usr/lib")).unwrap();
        let r = ContainerRoot::new(&t.path().join("rootfs")).unwrap();
        (t, r)
    }

    #[test]
    fn clean_refuses_climbing_out() {
        assert_eq!(
            clean_in_root(Path::new("/usr/../lib/x")).unwrap(),
            PathBuf::from("/lib/x")
        );
        assert!(clean_in_root(Path::new("/usr/../../etc/passwd")).is_err());
        assert!(clean_in_root(Path::new("../x")).is_err());
    }

    #[test]
    fn absolute_symlinks_restart_at_the_root() {
        let (_t, r) = root();
        symlink("/usr/lib", r.host_path().join("lib")).unwrap();
        assert_eq!(
            r.resolve_in_root(Path::new("/lib/libcuda.so"), true)
                .unwrap(),
            PathBuf::from("/usr/lib/libcuda.so")
        );
    }

    #[test]
    fn relative_symlinks_stop_at_the_root() {
        let (_t, r) = root();
        symlink(
            "../../../../../../outside",
            r.host_path().join("usr/lib/evil"),
        )
        .unwrap();
        assert_eq!(
            r.resolve_in_root(Path::new("/usr/lib/evil/x"), true)
                .unwrap(),
            PathBuf::from("/outside/x")
        );
    }

    #[test]
    fn last_symlink_kept_unless_asked() {
        let (_t, r) = root();
        symlink("/etc/shadow", r.host_path().join("usr/lib/l")).unwrap();
        assert_eq!(
            r.resolve_in_root(Path::new("/usr/lib/l"), false).unwrap(),
            PathBuf::from("/usr/lib/l")
        );
        assert_eq!(
            r.resolve_in_root(Path::new("/usr/lib/l"), true).unwrap(),
            PathBuf::from("/etc/shadow")
        );
    }

    #[test]
    fn symlink_loops_end() {
        let (_t, r) = root();
        symlink("b", r.host_path().join("a")).unwrap();
        symlink("a", r.host_path().join("b")).unwrap();
        assert!(r.resolve(Path::new("/a/x"), true).is_err());
    }

    #[test]
    fn refuses_the_host_root() {
        assert!(ContainerRoot::new(Path::new("/")).is_err());
    }

    #[test]
    fn write_file_replaces_a_symlink_instead_of_following_it() {
        let (t, r) = root();
        std::fs::write(t.path().join("victim"), "keep").unwrap();
        std::fs::create_dir_all(r.host_path().join("etc")).unwrap();
        symlink(t.path().join("victim"), r.host_path().join("etc/f.conf")).unwrap();
        r.write_file(Path::new("/etc/f.conf"), b"new\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(t.path().join("victim")).unwrap(),
            "keep"
        );
        assert_eq!(
            std::fs::read_to_string(r.host_path().join("etc/f.conf")).unwrap(),
            "new\n"
        );
    }
}
