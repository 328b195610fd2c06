//! The container root, and every file operation the hook does in it.
//!
//! The hook runs as host root over an image a tenant controls, while other processes of the
//! same pod may already be changing a shared volume. So no path inside the root is ever
//! handed to the kernel as a host path: the root is opened once as a directory handle and
//! every lookup goes through `pathrs` (libpathrs), which resolves with
//! `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)` on Linux 5.6 and later — symlinks,
//! absolute targets and `..` are confined to the root by the kernel, during the lookup
//! itself — and with a user-space walk of `O_PATH` handles verified through procfs on older
//! kernels. Files are created, renamed and linked relative to the handle of their resolved
//! parent directory (mkdirat/openat(O_EXCL)/symlinkat/renameat), and read only when the
//! opened inode is a regular file of bounded size.

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::fs::{File, Permissions};
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use pathrs::flags::{OpenFlags, RenameFlags};
use pathrs::{Handle, InodeType, Root, RootRef};

use crate::error::{HookError, Result};

/// Every file the hook reads: close-on-exec (the hook runs `ldconfig`) and non-blocking, so a
/// FIFO can never block the hook should a type check before the open ever be wrong.
const READ_FLAGS: OpenFlags = OpenFlags::O_RDONLY
    .union(OpenFlags::O_NONBLOCK)
    .union(OpenFlags::O_CLOEXEC);
/// A directory the hook lists.
const LIST_FLAGS: OpenFlags = OpenFlags::O_RDONLY
    .union(OpenFlags::O_DIRECTORY)
    .union(OpenFlags::O_CLOEXEC);
/// The temporary file a write creates: it must be new (never one planted at its name).
const CREATE_FLAGS: OpenFlags = OpenFlags::O_WRONLY
    .union(OpenFlags::O_EXCL)
    .union(OpenFlags::O_CLOEXEC);

/// Linux gives up after 40 symlinks in one lookup; so does the directory walk.
const MAX_SYMLINKS: usize = 40;

/// The most the hook reads of any one file of the image (ld.so.conf, a drop-in, the musl
/// path file): they are a few hundred bytes; anything larger is refused, not truncated.
pub const MAX_READ: u64 = 1 << 20;

/// A container's root filesystem on the host, opened as a directory handle.
#[derive(Debug)]
pub struct ContainerRoot {
    host: PathBuf,
    root: Root,
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

/// The text of `p` for one line of a config file: UTF-8 without control characters, since
/// a `\n` in a folder name would add a line of the image's choosing to the file.
pub fn config_line(p: &Path) -> Result<&str> {
    match p.to_str() {
        Some(s) if !s.chars().any(char::is_control) => Ok(s),
        Some(_) => Err(HookError::Refused {
            path: escaped(p.as_os_str()),
            reason: "holds control characters; refusing to write it into a config file".into(),
        }),
        None => Err(HookError::Refused {
            path: escaped(p.as_os_str()),
            reason: "is not UTF-8; refusing to write it into a config file".into(),
        }),
    }
}

/// `s` with control characters and invalid UTF-8 escaped, for messages naming image paths.
pub fn escaped(s: &OsStr) -> String {
    s.to_string_lossy().escape_debug().to_string()
}

/// Whether a pathrs error means "no such file" (a missing component or a dangling symlink).
fn is_not_found(e: &pathrs::error::Error) -> bool {
    e.kind() == pathrs::error::ErrorKind::OsError(Some(libc::ENOENT))
}

/// The metadata of the inode behind a handle, read through the handle (fstat), never by
/// path.
pub fn metadata_of(h: &impl AsFd, shown: &Path) -> Result<std::fs::Metadata> {
    let fd: OwnedFd = h
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| HookError::io("inspecting", shown, e))?;
    File::from(fd)
        .metadata()
        .map_err(|e| HookError::io("inspecting", shown, e))
}

/// The target of the symlink a handle (`O_PATH|O_NOFOLLOW`) holds: `readlinkat(fd, "")`
/// reads that very inode, whatever the name now points at.
fn readlink_handle(h: &impl AsFd, shown: &Path) -> Result<PathBuf> {
    let target = rustix::fs::readlinkat(h, c"", Vec::new())
        .map_err(|e| HookError::io("reading the symlink", shown, e.into()))?;
    Ok(PathBuf::from(OsStr::from_bytes(target.as_bytes())))
}

/// Reads a regular file opened from `h`, at most [`MAX_READ`] bytes, as UTF-8.
fn read_handle(h: &Handle, shown: &Path) -> Result<String> {
    let meta = metadata_of(h, shown)?;
    if !meta.is_file() {
        return Err(HookError::Refused {
            path: escaped(shown.as_os_str()),
            reason: format!(
                "is not a regular file ({}); refusing to read it",
                kind_name(&meta)
            ),
        });
    }
    // A regular file of the kernel's (procfs, sysfs and the like, mounted in the root by the
    // runtime before the hook runs) would be read as host root: /proc/kcore, root-only sysfs
    // files. None of them is an ld.so.conf.
    let fs = rustix::fs::fstatfs(h).map_err(|e| HookError::io("inspecting", shown, e.into()))?;
    if is_kernel_fs(fs.f_type) {
        return Err(HookError::Refused {
            path: escaped(shown.as_os_str()),
            reason: "is on a kernel pseudo file system (proc, sys, ...); refusing to read it"
                .into(),
        });
    }
    // The handle pins the inode checked above; O_NONBLOCK in case the type check is ever
    // wrong, so a FIFO can never block the hook.
    let f = h
        .reopen(READ_FLAGS)
        .map_err(|e| HookError::pathrs("opening", shown, e))?;
    let mut buf = Vec::new();
    f.take(MAX_READ + 1)
        .read_to_end(&mut buf)
        .map_err(|e| HookError::io("reading", shown, e))?;
    if buf.len() as u64 > MAX_READ {
        return Err(HookError::Refused {
            path: escaped(shown.as_os_str()),
            reason: format!("is larger than {MAX_READ} bytes; refusing to read it"),
        });
    }
    String::from_utf8(buf).map_err(|_| HookError::Refused {
        path: escaped(shown.as_os_str()),
        reason: "is not UTF-8 text".into(),
    })
}

/// Whether `f_type` (statfs) is one of the kernel's pseudo file systems, whose files show
/// kernel or host state (magic numbers from Linux `include/uapi/linux/magic.h`).
#[allow(clippy::unnecessary_cast)]
fn is_kernel_fs(f_type: impl TryInto<i64>) -> bool {
    let Ok(t) = f_type.try_into() else {
        return false;
    };
    const CONFIGFS_MAGIC: i64 = 0x6265_6570;
    const EFIVARFS_MAGIC: i64 = 0xde5e_81e4;
    const PSTOREFS_MAGIC: i64 = 0x6165_676c;
    const BINFMTFS_MAGIC: i64 = 0x4249_4e4d;
    [
        libc::PROC_SUPER_MAGIC as i64,
        libc::SYSFS_MAGIC as i64,
        libc::DEBUGFS_MAGIC as i64,
        libc::TRACEFS_MAGIC as i64,
        libc::SECURITYFS_MAGIC as i64,
        libc::CGROUP_SUPER_MAGIC as i64,
        libc::CGROUP2_SUPER_MAGIC as i64,
        libc::BPF_FS_MAGIC as i64,
        libc::SELINUX_MAGIC as i64,
        libc::SMACK_MAGIC as i64,
        libc::DEVPTS_SUPER_MAGIC as i64,
        libc::NSFS_MAGIC as i64,
        libc::RDTGROUP_SUPER_MAGIC as i64,
        CONFIGFS_MAGIC,
        EFIVARFS_MAGIC,
        PSTOREFS_MAGIC,
        BINFMTFS_MAGIC,
    ]
    .contains(&t)
}

/// A word for the kind of inode, for refusals.
fn kind_name(m: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_symlink() {
        "a symlink"
    } else {
        "not a regular file"
    }
}

/// A name for a temporary file next to `name`, unique to this process.
fn tmp_name(name: &OsStr) -> OsString {
    let mut t = OsString::from(".");
    t.push(name);
    t.push(format!(".cleave-tmp-{}", std::process::id()));
    t
}

/// One name inside a directory: no `/`, not `.` or `..`, not empty.
fn check_name(name: &OsStr, shown: &Path) -> Result<()> {
    let b = name.as_bytes();
    if b.is_empty() || b == b"." || b == b".." || b.contains(&b'/') {
        return Err(HookError::BadPath {
            path: shown.to_owned(),
            reason: "is not a single file name".into(),
        });
    }
    Ok(())
}

/// A directory handle inside the root with the operations the hook does in it. Names are
/// single components looked up without following a trailing symlink, so every operation
/// stays in this very directory (the `*at` system calls on its handle).
pub struct Dir {
    handle: Handle,
    /// The directory as the container sees it (for messages and config files).
    pub in_root: PathBuf,
    /// The directory's host path (for messages).
    pub host: PathBuf,
}

impl std::fmt::Debug for Dir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dir")
            .field("in_root", &self.in_root)
            .finish()
    }
}

impl Dir {
    fn at(&self) -> RootRef<'_> {
        RootRef::from_fd(self.handle.as_fd())
    }

    /// The handle of the directory.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// The container path of `name` in this directory.
    pub fn shown(&self, name: &OsStr) -> PathBuf {
        self.in_root.join(name)
    }

    /// A handle to `name` itself (a symlink is not followed); `None` when absent.
    pub fn entry(&self, name: &OsStr) -> Result<Option<Handle>> {
        check_name(name, &self.shown(name))?;
        match self.at().resolve_nofollow(name) {
            Ok(h) => Ok(Some(h)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(HookError::pathrs("looking up", self.shown(name), e)),
        }
    }

    /// The target of the symlink `name`, or `None` when `name` is absent or not a symlink.
    pub fn readlink(&self, name: &OsStr) -> Result<Option<PathBuf>> {
        let Some(h) = self.entry(name)? else {
            return Ok(None);
        };
        if !metadata_of(&h, &self.shown(name))?.file_type().is_symlink() {
            return Ok(None);
        }
        readlink_handle(&h, &self.shown(name)).map(Some)
    }

    /// Creates the directory `name` (mode 0755) unless something of that name appeared
    /// since the caller looked (a race with the container's processes): the caller looks
    /// it up again. `shown` names it in errors.
    fn create_dir_if_absent(&self, name: &OsStr, shown: &Path) -> Result<()> {
        match self
            .at()
            .create(name, &InodeType::Directory(Permissions::from_mode(0o755)))
        {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == pathrs::error::ErrorKind::OsError(Some(libc::EEXIST)) => Ok(()),
            Err(e) => Err(HookError::pathrs("creating directory", shown, e)),
        }
    }

    /// The names in this directory with their types (a symlink is reported as a symlink).
    pub fn list(&self) -> Result<Vec<(OsString, std::fs::FileType)>> {
        let f = self
            .handle
            .reopen(LIST_FLAGS)
            .map_err(|e| HookError::pathrs("opening", &self.in_root, e))?;
        let dir = rustix::fs::Dir::read_from(&f)
            .map_err(|e| HookError::io("listing", &self.in_root, e.into()))?;
        let mut out = Vec::new();
        for entry in dir {
            let entry = entry.map_err(|e| HookError::io("listing", &self.in_root, e.into()))?;
            let name = OsStr::from_bytes(entry.file_name().to_bytes()).to_owned();
            if name == "." || name == ".." {
                continue;
            }
            let Some(h) = self.entry(&name)? else {
                continue;
            };
            out.push((
                name.clone(),
                metadata_of(&h, &self.shown(&name))?.file_type(),
            ));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Opens `name` for reading if it is a regular file (a symlink is not followed).
    pub fn open_regular(&self, name: &OsStr) -> Result<Option<File>> {
        let shown = self.shown(name);
        let Some(h) = self.entry(name)? else {
            return Ok(None);
        };
        if !metadata_of(&h, &shown)?.is_file() {
            return Ok(None);
        }
        h.reopen(READ_FLAGS)
            .map(Some)
            .map_err(|e| HookError::pathrs("opening", shown, e))
    }

    /// Writes `contents` to `name` with `mode`, replacing what is there: a temporary file
    /// created exclusively in this directory, then renamed over the name, so an existing
    /// symlink at that name is replaced rather than followed. Returns the host path.
    pub fn write(&self, name: &OsStr, contents: &[u8], mode: u32) -> Result<PathBuf> {
        let shown = self.shown(name);
        check_name(name, &shown)?;
        let tmp = tmp_name(name);
        let at = self.at();
        let _ = at.remove_file(&tmp);
        let result = (|| -> Result<()> {
            let mut f = at
                .create_file(&tmp, CREATE_FLAGS, &Permissions::from_mode(mode))
                .map_err(|e| HookError::pathrs("creating", &shown, e))?;
            f.write_all(contents)
                .map_err(|e| HookError::io("writing", &shown, e))?;
            f.set_permissions(Permissions::from_mode(mode))
                .map_err(|e| HookError::io("chmod", &shown, e))?;
            at.rename(&tmp, name, RenameFlags::empty())
                .map_err(|e| HookError::pathrs("renaming into place", &shown, e))
        })();
        if result.is_err() {
            let _ = at.remove_file(&tmp);
        }
        result.map(|()| self.host.join(name))
    }

    /// Makes `name` a symlink to `target`, replacing a file or symlink there (a temporary
    /// link renamed over it); a directory there is refused.
    pub fn symlink(&self, name: &OsStr, target: &Path) -> Result<()> {
        let shown = self.shown(name);
        check_name(name, &shown)?;
        if let Some(h) = self.entry(name)?
            && metadata_of(&h, &shown)?.is_dir()
        {
            return Err(HookError::BadPath {
                path: shown,
                reason: "is a directory; refusing to replace it with a symlink".into(),
            });
        }
        let tmp = tmp_name(name);
        let at = self.at();
        let _ = at.remove_file(&tmp);
        at.create(&tmp, &InodeType::Symlink(target.to_owned()))
            .map_err(|e| HookError::pathrs("creating symlink", &shown, e))?;
        at.rename(&tmp, name, RenameFlags::empty()).map_err(|e| {
            let _ = at.remove_file(&tmp);
            HookError::pathrs("creating symlink", &shown, e)
        })
    }

    /// Creates the directory `name` (0755) and returns it; it must not exist.
    pub fn create_dir(&self, name: &OsStr) -> Result<Dir> {
        let shown = self.shown(name);
        check_name(name, &shown)?;
        let at = self.at();
        at.create(name, &InodeType::Directory(Permissions::from_mode(0o755)))
            .map_err(|e| HookError::pathrs("creating directory", &shown, e))?;
        let handle = at
            .resolve_nofollow(name)
            .map_err(|e| HookError::pathrs("opening", &shown, e))?;
        if !metadata_of(&handle, &shown)?.is_dir() {
            return Err(HookError::Refused {
                path: escaped(shown.as_os_str()),
                reason: "was replaced while the hook created it".into(),
            });
        }
        Ok(Dir {
            handle,
            host: self.host.join(name),
            in_root: shown,
        })
    }

    /// Removes the empty directory `name`.
    pub fn remove_dir(&self, name: &OsStr) -> Result<()> {
        self.at()
            .remove_dir(name)
            .map_err(|e| HookError::pathrs("removing", self.shown(name), e))
    }
}

impl ContainerRoot {
    /// Opens the root at `host` (made absolute and canonical); refuses `/` and non-directories.
    pub fn new(host: &Path) -> Result<Self> {
        let bad = |reason: String| HookError::BadRoot {
            path: host.to_owned(),
            reason,
        };
        let canon = std::fs::canonicalize(host).map_err(|e| bad(e.to_string()))?;
        if canon == Path::new("/") {
            return Err(bad("is the host's / (refusing to modify the host)".into()));
        }
        let root = Root::open(&canon).map_err(|e| bad(e.to_string()))?;
        let meta = metadata_of(&root, host)?;
        if !meta.is_dir() {
            return Err(bad("is not a directory".into()));
        }
        Ok(Self { host: canon, root })
    }

    /// The root's host path.
    pub fn host_path(&self) -> &Path {
        &self.host
    }

    /// The host path of a container path (for messages only: never opened).
    pub fn host_of(&self, in_root: &Path) -> PathBuf {
        self.host.join(in_root.strip_prefix("/").unwrap_or(in_root))
    }

    /// A duplicate of the root's handle without close-on-exec, for a child process to reach
    /// the very directory opened here as `/proc/self/fd/<n>`.
    pub fn handle_for_child(&self) -> Result<OwnedFd> {
        rustix::io::dup(&self.root)
            .map_err(|e| HookError::io("duplicating the handle of", &self.host, e.into()))
    }

    /// Resolves `p` inside the root, following symlinks (the last one only when
    /// `follow_last`); `None` when something on the way is missing.
    pub fn lookup(&self, p: &Path, follow_last: bool) -> Result<Option<Handle>> {
        let r = if follow_last {
            self.root.resolve(p)
        } else {
            self.root.resolve_nofollow(p)
        };
        match r {
            Ok(h) => Ok(Some(h)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(HookError::pathrs("resolving", p, e)),
        }
    }

    /// The path, as the container sees it, of an inode reached through this root: the
    /// kernel's name for the handle (procfs), less the root's host path.
    pub fn path_in_root(&self, h: &impl AsFd, shown: &Path) -> Result<PathBuf> {
        let link = PathBuf::from(format!("/proc/self/fd/{}", h.as_fd().as_raw_fd()));
        let host = std::fs::read_link(&link).map_err(|e| HookError::io("naming", shown, e))?;
        if host == self.host {
            return Ok(PathBuf::from("/"));
        }
        match host.strip_prefix(&self.host) {
            Ok(rest) => Ok(Path::new("/").join(rest)),
            Err(_) => Err(HookError::Refused {
                path: escaped(shown.as_os_str()),
                reason: "resolved outside the container root".into(),
            }),
        }
    }

    /// Opens the directory `p` (symlinks followed inside the root); `None` when missing.
    pub fn open_dir(&self, p: &Path) -> Result<Option<Dir>> {
        let Some(handle) = self.lookup(p, true)? else {
            return Ok(None);
        };
        if !metadata_of(&handle, p)?.is_dir() {
            return Ok(None);
        }
        let in_root = self.path_in_root(&handle, p)?;
        Ok(Some(Dir {
            host: self.host_of(&in_root),
            in_root,
            handle,
        }))
    }

    /// Creates directory `dir` (a container path) and its missing parents inside the root.
    /// Symlinks on the way are followed inside the root, dangling ones too: the directory
    /// is created where the container will look for it (as this hook always did). The walk
    /// only chooses names; every lookup and `mkdirat` is confined to the root by pathrs, so
    /// a concurrent change of the tree can at worst move the directory elsewhere inside it.
    pub fn mkdir_all(&self, dir: &Path) -> Result<Dir> {
        let refuse = |reason: String| HookError::Refused {
            path: escaped(dir.as_os_str()),
            reason,
        };
        let mut queue: VecDeque<OsString> = components(dir);
        let mut current = PathBuf::from("/");
        let mut hops = 0;
        while let Some(c) = queue.pop_front() {
            if c == ".." {
                current.pop();
                continue;
            }
            let candidate = current.join(&c);
            match self.lookup(&candidate, false)? {
                None => {
                    let parent = self.open_dir(&current)?.ok_or_else(|| {
                        refuse(format!(
                            "{} changed while the hook walked it",
                            current.display()
                        ))
                    })?;
                    parent.create_dir_if_absent(&c, &candidate)?;
                    current = candidate;
                }
                Some(h) => {
                    let meta = metadata_of(&h, &candidate)?;
                    if meta.file_type().is_symlink() {
                        hops += 1;
                        if hops > MAX_SYMLINKS {
                            return Err(refuse(format!("more than {MAX_SYMLINKS} symlinks")));
                        }
                        let target = readlink_handle(&h, &candidate)?;
                        if target.is_absolute() {
                            current = PathBuf::from("/");
                        }
                        for t in components(&target).into_iter().rev() {
                            queue.push_front(t);
                        }
                    } else if meta.is_dir() {
                        current = candidate;
                    } else {
                        return Err(HookError::BadPath {
                            path: candidate,
                            reason: "is not a directory".into(),
                        });
                    }
                }
            }
        }
        self.open_dir(&current)?.ok_or_else(|| {
            refuse(format!(
                "{} changed while the hook created it",
                current.display()
            ))
        })
    }

    /// Writes `contents` to the container file `file`, world-readable (0644), replacing
    /// what is there (see [`Dir::write`]); returns its host path.
    pub fn write_file(&self, file: &Path, contents: &[u8]) -> Result<PathBuf> {
        let (dir, name) = split_parent(file)?;
        self.mkdir_all(&dir)?.write(&name, contents, 0o644)
    }

    /// Creates `file` (a container path) with `contents` only if nothing is at that name;
    /// returns whether it did.
    pub fn create_if_missing(&self, file: &Path, contents: &[u8]) -> Result<bool> {
        if self.lookup(file, false)?.is_some() {
            return Ok(false);
        }
        self.write_file(file, contents)?;
        Ok(true)
    }

    /// Reads the container file `file` (symlinks followed inside the root): `None` when it
    /// does not exist; refused when it is not a regular file or is over [`MAX_READ`].
    pub fn read_config(&self, file: &Path) -> Result<Option<String>> {
        match self.lookup(file, true)? {
            None => Ok(None),
            Some(h) => read_handle(&h, file).map(Some),
        }
    }

    /// As [`read_config`](Self::read_config), also returning the (device, inode) read, so
    /// that callers following includes can tell a file they already read.
    pub fn read_config_id(&self, file: &Path) -> Result<Option<((u64, u64), String)>> {
        use std::os::unix::fs::MetadataExt;
        match self.lookup(file, true)? {
            None => Ok(None),
            Some(h) => {
                let m = metadata_of(&h, file)?;
                Ok(Some(((m.dev(), m.ino()), read_handle(&h, file)?)))
            }
        }
    }

    /// Whether `p` resolves (inside the root) to a regular file.
    pub fn is_file(&self, p: &Path) -> bool {
        self.lookup(p, true)
            .ok()
            .flatten()
            .and_then(|h| metadata_of(&h, p).ok())
            .is_some_and(|m| m.is_file())
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

    fn in_root(r: &ContainerRoot, p: &str) -> PathBuf {
        let h = r.lookup(Path::new(p), true).unwrap().unwrap();
        r.path_in_root(&h, Path::new(p)).unwrap()
    }

    /// What the hook opens for reading is close-on-exec and non-blocking.
    #[test]
    fn read_handles_are_close_on_exec_and_non_blocking() {
        let (t, r) = root();
        std::fs::write(t.path().join("rootfs/usr/lib/f.conf"), "x").unwrap();
        let d = r.open_dir(Path::new("/usr/lib")).unwrap().unwrap();
        let f = d.open_regular(OsStr::new("f.conf")).unwrap().unwrap();
        let fd = rustix::io::fcntl_getfd(&f).unwrap();
        assert!(fd.contains(rustix::io::FdFlags::CLOEXEC), "{fd:?}");
        let fl = rustix::fs::fcntl_getfl(&f).unwrap();
        assert!(fl.contains(rustix::fs::OFlags::NONBLOCK), "{fl:?}");
        assert!(READ_FLAGS.contains(OpenFlags::O_NONBLOCK | OpenFlags::O_CLOEXEC));
        assert!(LIST_FLAGS.contains(OpenFlags::O_DIRECTORY | OpenFlags::O_CLOEXEC));
        assert!(CREATE_FLAGS.contains(OpenFlags::O_EXCL | OpenFlags::O_CLOEXEC));
    }

    /// Only a missing name is absent: a lookup that fails otherwise is an error.
    #[test]
    fn a_lookup_failing_for_another_reason_is_an_error() {
        let (_t, r) = root();
        let d = r.open_dir(Path::new("/usr/lib")).unwrap().unwrap();
        assert!(d.entry(OsStr::new("absent")).unwrap().is_none());
        let long = "a".repeat(300);
        match d.entry(OsStr::new(&long)) {
            Err(e) => assert!(e.to_string().contains("looking up"), "{e}"),
            Ok(h) => panic!("a 300-byte name was looked up as {h:?}"),
        }
    }

    /// A directory that appeared meanwhile is fine; any other failure to create is an error.
    #[test]
    fn creating_a_directory_tolerates_only_its_existence() {
        let (t, r) = root();
        let d = r.open_dir(Path::new("/usr")).unwrap().unwrap();
        let shown = Path::new("/usr/lib");
        d.create_dir_if_absent(OsStr::new("lib"), shown).unwrap();
        d.create_dir_if_absent(OsStr::new("new"), Path::new("/usr/new"))
            .unwrap();
        assert!(t.path().join("rootfs/usr/new").is_dir());
        // In a directory removed under the handle the kernel refuses with ENOENT.
        let gone = r.mkdir_all(Path::new("/usr/gone")).unwrap();
        std::fs::remove_dir(t.path().join("rootfs/usr/gone")).unwrap();
        let e = gone
            .create_dir_if_absent(OsStr::new("x"), Path::new("/usr/gone/x"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("creating directory") && e.contains("/usr/gone/x"),
            "{e}"
        );
    }

    /// A directory shows as its path in the root (the host path and handle stay out of logs).
    #[test]
    fn a_dir_debugs_as_its_path_in_the_root() {
        let (_t, r) = root();
        let d = r.open_dir(Path::new("/usr/lib")).unwrap().unwrap();
        assert_eq!(format!("{d:?}"), r#"Dir { in_root: "/usr/lib" }"#);
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
        std::fs::write(r.host_path().join("usr/lib/libcuda.so"), "x").unwrap();
        symlink("/usr/lib", r.host_path().join("lib")).unwrap();
        assert_eq!(
            in_root(&r, "/lib/libcuda.so"),
            PathBuf::from("/usr/lib/libcuda.so")
        );
    }

    #[test]
    fn relative_symlinks_stop_at_the_root() {
        let (t, r) = root();
        std::fs::create_dir(t.path().join("outside")).unwrap();
        std::fs::create_dir(r.host_path().join("outside")).unwrap();
        symlink(
            "../../../../../../outside",
            r.host_path().join("usr/lib/evil"),
        )
        .unwrap();
        assert_eq!(in_root(&r, "/usr/lib/evil"), PathBuf::from("/outside"));
    }

    #[test]
    fn symlink_loops_end() {
        let (_t, r) = root();
        symlink("b", r.host_path().join("a")).unwrap();
        symlink("a", r.host_path().join("b")).unwrap();
        assert!(r.lookup(Path::new("/a/x"), true).is_err());
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

    #[test]
    fn reads_follow_symlinks_inside_the_root_only() {
        let (t, r) = root();
        std::fs::write(t.path().join("secret"), "HOST SECRET").unwrap();
        std::fs::create_dir_all(r.host_path().join("etc")).unwrap();
        symlink(t.path().join("secret"), r.host_path().join("etc/a")).unwrap();
        let rel = format!("../..{}", t.path().join("secret").display());
        symlink(&rel, r.host_path().join("etc/b")).unwrap();
        assert_eq!(r.read_config(Path::new("/etc/a")).unwrap(), None);
        assert_eq!(r.read_config(Path::new("/etc/b")).unwrap(), None);
        let inside = r.host_of(&t.path().join("secret"));
        std::fs::create_dir_all(inside.parent().unwrap()).unwrap();
        std::fs::write(&inside, "image file").unwrap();
        assert_eq!(
            r.read_config(Path::new("/etc/a")).unwrap().as_deref(),
            Some("image file")
        );
    }

    #[test]
    fn fifos_and_big_files_are_refused_naming_them() {
        let (_t, r) = root();
        let etc = r.host_path().join("etc");
        std::fs::create_dir_all(&etc).unwrap();
        let fifo = std::ffi::CString::new(etc.join("fifo").as_os_str().as_bytes()).unwrap();
        rustix::fs::mkfifoat(rustix::fs::CWD, fifo.as_c_str(), rustix::fs::Mode::RWXU).unwrap();
        let e = r.read_config(Path::new("/etc/fifo")).unwrap_err();
        assert!(e.to_string().contains("/etc/fifo"), "{e}");
        assert!(e.to_string().contains("FIFO"), "{e}");
        std::fs::write(etc.join("big"), vec![b'a'; (MAX_READ + 1) as usize]).unwrap();
        let e = r.read_config(Path::new("/etc/big")).unwrap_err();
        assert!(e.to_string().contains("/etc/big"), "{e}");
    }

    #[test]
    fn kernel_files_are_refused() {
        // procfs and sysfs as the "root": their regular files are the kernel's, not an image's.
        for (root, file) in [("/proc", "/version"), ("/sys", "/kernel/uevent_seqnum")] {
            if root == "/sys" && !Path::new("/sys/kernel").exists() {
                eprintln!("SKIPPED for /sys: sysfs is not mounted here");
                continue;
            }
            let r = ContainerRoot::new(Path::new(root)).unwrap();
            let e = r.read_config(Path::new(file)).unwrap_err().to_string();
            assert!(e.contains("kernel pseudo file system"), "{e}");
            assert!(e.contains(file), "{e}");
        }
    }

    #[test]
    fn control_characters_are_refused_in_config_lines() {
        assert_eq!(config_line(Path::new("/opt/lib")).unwrap(), "/opt/lib");
        for bad in ["/a\n/etc/cron.d", "/a\rb", "/a\u{1b}[2J", "/a\0"] {
            let e = config_line(Path::new(bad)).unwrap_err().to_string();
            assert!(!e.contains('\n') && !e.contains('\r'), "{e:?}");
        }
    }

    #[test]
    fn inode_kinds_are_named() {
        use std::os::unix::fs::FileTypeExt;
        let (t, r) = root();
        let base = r.host_path();
        std::fs::write(base.join("file"), "x").unwrap();
        symlink("file", base.join("link")).unwrap();
        let fifo = std::ffi::CString::new(base.join("fifo").as_os_str().as_bytes()).unwrap();
        rustix::fs::mkfifoat(rustix::fs::CWD, fifo.as_c_str(), rustix::fs::Mode::RWXU).unwrap();
        let _socket = std::os::unix::net::UnixListener::bind(t.path().join("sock")).unwrap();
        let meta = |p: &Path| std::fs::symlink_metadata(p).unwrap();
        assert_eq!(kind_name(&meta(&base.join("usr"))), "a directory");
        assert_eq!(kind_name(&meta(&base.join("fifo"))), "a FIFO");
        assert_eq!(kind_name(&meta(&base.join("link"))), "a symlink");
        assert_eq!(kind_name(&meta(&t.path().join("sock"))), "a socket");
        assert_eq!(kind_name(&meta(&base.join("file"))), "not a regular file");
        let null = meta(Path::new("/dev/null"));
        if null.file_type().is_char_device() {
            assert_eq!(kind_name(&null), "a character device");
        }
        // Reading a directory is refused naming its kind.
        let e = r.read_config(Path::new("/usr")).unwrap_err().to_string();
        assert!(e.contains("a directory") && e.contains("/usr"), "{e}");
    }

    #[test]
    #[allow(clippy::unnecessary_cast)]
    fn kernel_file_systems_are_known_by_magic() {
        for magic in [
            libc::PROC_SUPER_MAGIC as i64,
            libc::SYSFS_MAGIC as i64,
            libc::DEBUGFS_MAGIC as i64,
            libc::TRACEFS_MAGIC as i64,
            libc::SECURITYFS_MAGIC as i64,
            libc::CGROUP_SUPER_MAGIC as i64,
            libc::CGROUP2_SUPER_MAGIC as i64,
            libc::BPF_FS_MAGIC as i64,
            libc::SELINUX_MAGIC as i64,
            libc::SMACK_MAGIC as i64,
            libc::DEVPTS_SUPER_MAGIC as i64,
            libc::NSFS_MAGIC as i64,
            libc::RDTGROUP_SUPER_MAGIC as i64,
            0x6265_6570,
            0xde5e_81e4,
            0x6165_676c,
            0x4249_4e4d,
        ] {
            assert!(is_kernel_fs(magic), "{magic:#x}");
        }
        // ext4, tmpfs, overlayfs, xfs: where images live.
        for magic in [0xef53_i64, 0x0102_1994, 0x794c_7630, 0x5846_5342] {
            assert!(!is_kernel_fs(magic), "{magic:#x}");
        }
        // A value that does not fit is no known magic.
        assert!(!is_kernel_fs(u64::MAX));
    }

    #[test]
    fn names_must_be_single_components() {
        let (_t, r) = root();
        let dir = r.open_dir(Path::new("/usr")).unwrap().unwrap();
        for bad in ["", ".", "..", "a/b", "/"] {
            let name = OsStr::new(bad);
            let e = dir.entry(name).unwrap_err().to_string();
            assert!(e.contains("not a single file name"), "{bad:?}: {e}");
            assert!(dir.write(name, b"x", 0o644).is_err(), "{bad:?}");
            assert!(dir.symlink(name, Path::new("t")).is_err(), "{bad:?}");
            assert!(dir.create_dir(name).is_err(), "{bad:?}");
        }
        for good in ["a", "..a", ".x", "a.."] {
            assert!(dir.entry(OsStr::new(good)).unwrap().is_none(), "{good:?}");
        }
        assert_eq!(
            tmp_name(OsStr::new("ld.so.conf")),
            OsString::from(format!(".ld.so.conf.cleave-tmp-{}", std::process::id()))
        );
    }

    #[test]
    fn paths_split_into_directory_and_name() {
        assert_eq!(
            split_parent(Path::new("/etc/./ld.so.conf.d/../x.conf")).unwrap(),
            (PathBuf::from("/etc"), OsString::from("x.conf"))
        );
        assert_eq!(
            split_parent(Path::new("a")).unwrap(),
            (PathBuf::from("/"), OsString::from("a"))
        );
        for p in ["/", "/a/..", "."] {
            let e = split_parent(Path::new(p)).unwrap_err().to_string();
            assert!(e.contains("names the container root itself"), "{p}: {e}");
        }
        assert_eq!(
            clean_in_root(Path::new("./a/./b")).unwrap(),
            Path::new("/a/b")
        );
        assert_eq!(clean_in_root(Path::new("/a/..")).unwrap(), Path::new("/"));
        assert_eq!(
            components(Path::new("/a/./../b/")),
            VecDeque::from([
                OsString::from("a"),
                OsString::from(".."),
                OsString::from("b")
            ])
        );
        assert_eq!(escaped(OsStr::new("a\nb")), "a\\nb");
        assert_eq!(escaped(OsStr::new("a\u{7}")), "a\\u{7}");
        let bad = OsStr::from_bytes(b"/opt/\xff");
        let e = config_line(Path::new(bad)).unwrap_err().to_string();
        assert!(e.contains("not UTF-8"), "{e}");
    }

    #[test]
    fn mkdir_all_follows_links_inside_and_refuses_what_is_not_a_directory() {
        let (_t, r) = root();
        let base = r.host_path().to_owned();
        // A dangling absolute link: the directory is made where the container will look.
        symlink("/opt/real", base.join("usr/lib/alias")).unwrap();
        let d = r.mkdir_all(Path::new("/usr/lib/alias/sub")).unwrap();
        assert_eq!(d.in_root, Path::new("/opt/real/sub"));
        assert_eq!(d.host, base.join("opt/real/sub"));
        assert!(base.join("opt/real/sub").is_dir());
        // A relative link with `..`.
        symlink("../opt", base.join("usr/up")).unwrap();
        let d = r
            .mkdir_all(Path::new("/usr/up/real/./sub/../more"))
            .unwrap();
        assert_eq!(d.in_root, Path::new("/opt/real/more"));
        // Existing directories are kept; the root itself is "/".
        assert_eq!(r.mkdir_all(Path::new("/")).unwrap().in_root, Path::new("/"));
        assert_eq!(
            r.mkdir_all(Path::new("/usr/..")).unwrap().in_root,
            Path::new("/")
        );
        // A file on the way.
        std::fs::write(base.join("usr/file"), "x").unwrap();
        let e = r
            .mkdir_all(Path::new("/usr/file/sub"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("is not a directory"), "{e}");
        // A chain of 41 links is refused; 40 are followed (Linux's limit).
        std::fs::create_dir(base.join("chain")).unwrap();
        for i in 0..41 {
            symlink(format!("l{}", i + 1), base.join(format!("chain/l{i}"))).unwrap();
        }
        let e = r.mkdir_all(Path::new("/chain/l0")).unwrap_err().to_string();
        assert!(e.contains("more than 40 symlinks"), "{e}");
        std::fs::remove_file(base.join("chain/l40")).unwrap();
        symlink("/target", base.join("chain/l40")).unwrap();
        assert!(r.mkdir_all(Path::new("/chain/l1")).is_ok());
        assert!(base.join("target").is_dir());
    }

    #[test]
    fn directory_operations_stay_in_their_directory() {
        use std::os::unix::fs::MetadataExt;
        let (_t, r) = root();
        let base = r.host_path().to_owned();
        let dir = r.mkdir_all(Path::new("/etc")).unwrap();
        assert_eq!(dir.shown(OsStr::new("x")), Path::new("/etc/x"));
        // write: the mode asked, the host path returned.
        let host = dir.write(OsStr::new("a.conf"), b"one\n", 0o600).unwrap();
        assert_eq!(host, base.join("etc/a.conf"));
        assert_eq!(std::fs::read_to_string(&host).unwrap(), "one\n");
        assert_eq!(std::fs::metadata(&host).unwrap().mode() & 0o777, 0o600);
        // No temporary file is left behind.
        let names: Vec<_> = dir.list().unwrap().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, [OsString::from("a.conf")]);
        // symlink: replaces a file, refuses a directory; readlink reads it back.
        dir.symlink(OsStr::new("a.conf"), Path::new("/lib/t"))
            .unwrap();
        assert_eq!(
            dir.readlink(OsStr::new("a.conf")).unwrap(),
            Some(PathBuf::from("/lib/t"))
        );
        dir.create_dir(OsStr::new("sub")).unwrap();
        let e = dir
            .symlink(OsStr::new("sub"), Path::new("/x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("is a directory"), "{e}");
        assert!(
            dir.create_dir(OsStr::new("sub")).is_err(),
            "it must not exist"
        );
        // readlink of a file or of nothing is None.
        dir.write(OsStr::new("plain"), b"p", 0o644).unwrap();
        assert_eq!(dir.readlink(OsStr::new("plain")).unwrap(), None);
        assert_eq!(dir.readlink(OsStr::new("absent")).unwrap(), None);
        // list: sorted, symlinks as symlinks.
        let listed: Vec<_> = dir
            .list()
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n.into_string().unwrap(), t.is_symlink(), t.is_dir()))
            .collect();
        assert_eq!(
            listed,
            [
                ("a.conf".to_owned(), true, false),
                ("plain".to_owned(), false, false),
                ("sub".to_owned(), false, true),
            ]
        );
        // open_regular: files only, a symlink is not followed.
        assert!(dir.open_regular(OsStr::new("plain")).unwrap().is_some());
        assert!(dir.open_regular(OsStr::new("sub")).unwrap().is_none());
        assert!(dir.open_regular(OsStr::new("a.conf")).unwrap().is_none());
        assert!(dir.open_regular(OsStr::new("absent")).unwrap().is_none());
        dir.remove_dir(OsStr::new("sub")).unwrap();
        assert!(!base.join("etc/sub").exists());
        assert!(dir.remove_dir(OsStr::new("sub")).is_err());
    }

    #[test]
    fn root_level_queries() {
        let (t, r) = root();
        let base = r.host_path().to_owned();
        assert_eq!(r.host_of(Path::new("/usr/lib")), base.join("usr/lib"));
        assert_eq!(r.host_of(Path::new("usr")), base.join("usr"));
        assert_eq!(in_root(&r, "/"), PathBuf::from("/"));
        assert_eq!(in_root(&r, "/usr/lib"), PathBuf::from("/usr/lib"));
        // Not a directory, or missing.
        std::fs::write(t.path().join("plain"), "x").unwrap();
        let e = ContainerRoot::new(&t.path().join("plain"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("plain"), "{e}");
        assert!(ContainerRoot::new(&t.path().join("missing")).is_err());
        // lookup: a trailing symlink is followed only when asked.
        symlink("/usr/lib", base.join("l")).unwrap();
        let followed = r.lookup(Path::new("/l"), true).unwrap().unwrap();
        assert!(metadata_of(&followed, Path::new("/l")).unwrap().is_dir());
        let not = r.lookup(Path::new("/l"), false).unwrap().unwrap();
        assert!(
            metadata_of(&not, Path::new("/l"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert!(r.lookup(Path::new("/missing/x"), true).unwrap().is_none());
        // open_dir: directories only.
        std::fs::write(base.join("usr/lib/f"), "x").unwrap();
        assert!(r.open_dir(Path::new("/usr/lib/f")).unwrap().is_none());
        assert!(r.open_dir(Path::new("/nope")).unwrap().is_none());
        assert_eq!(
            r.open_dir(Path::new("/l")).unwrap().unwrap().in_root,
            Path::new("/usr/lib")
        );
        // is_file, create_if_missing (a dangling link counts as something there).
        assert!(r.is_file(Path::new("/usr/lib/f")));
        assert!(!r.is_file(Path::new("/usr/lib")));
        assert!(!r.is_file(Path::new("/nope")));
        assert!(r.create_if_missing(Path::new("/etc/new"), b"n").unwrap());
        assert!(!r.create_if_missing(Path::new("/etc/new"), b"m").unwrap());
        assert_eq!(std::fs::read_to_string(base.join("etc/new")).unwrap(), "n");
        symlink("/gone", base.join("etc/dangling")).unwrap();
        assert!(
            !r.create_if_missing(Path::new("/etc/dangling"), b"d")
                .unwrap()
        );
        assert!(!base.join("gone").exists());
        // read_config_id: one file read through two names has one id.
        symlink("new", base.join("etc/alias")).unwrap();
        let (a, text) = r.read_config_id(Path::new("/etc/new")).unwrap().unwrap();
        let (b, _) = r.read_config_id(Path::new("/etc/alias")).unwrap().unwrap();
        assert_eq!((a, text.as_str()), (b, "n"));
        assert!(r.read_config_id(Path::new("/etc/none")).unwrap().is_none());
        // A file of exactly MAX_READ bytes is read; non-UTF-8 is refused.
        std::fs::write(base.join("etc/max"), vec![b'a'; MAX_READ as usize]).unwrap();
        assert_eq!(
            r.read_config(Path::new("/etc/max")).unwrap().unwrap().len() as u64,
            MAX_READ
        );
        std::fs::write(base.join("etc/bin"), [0xff_u8, 0xfe]).unwrap();
        let e = r
            .read_config(Path::new("/etc/bin"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not UTF-8"), "{e}");
        // A duplicated handle for a child names the same directory.
        let fd = r.handle_for_child().unwrap();
        let named = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
        assert_eq!(named, base);
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        /// One entry of a random image tree.
        #[derive(Debug, Clone)]
        enum Node {
            Dir,
            File,
            Link(String),
        }

        fn name() -> impl Strategy<Value = String> {
            prop::sample::select(vec!["a", "b", "etc", "lib", "x"]).prop_map(str::to_owned)
        }

        fn rel_path() -> impl Strategy<Value = String> {
            prop::collection::vec(
                prop_oneof![name(), Just("..".to_owned()), Just(".".to_owned())],
                1..5,
            )
            .prop_map(|v| v.join("/"))
        }

        fn link_target() -> impl Strategy<Value = String> {
            prop_oneof![
                rel_path(),
                rel_path().prop_map(|p| format!("/{p}")),
                // A host path: the test's "host" directory outside the root.
                Just("@HOST@".to_owned()),
                Just("@HOST@/secret".to_owned()),
                Just("../../../../../../@HOST@".to_owned()),
            ]
        }

        fn tree() -> impl Strategy<Value = Vec<(String, Node)>> {
            prop::collection::vec(
                (
                    prop::collection::vec(name(), 1..4).prop_map(|v| v.join("/")),
                    prop_oneof![
                        Just(Node::Dir),
                        Just(Node::File),
                        link_target().prop_map(Node::Link)
                    ],
                ),
                0..12,
            )
        }

        /// Every file under `dir` with its contents, skipping nothing.
        fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
            let mut out = Vec::new();
            let mut stack = vec![dir.to_owned()];
            while let Some(d) = stack.pop() {
                for e in std::fs::read_dir(&d).unwrap() {
                    let e = e.unwrap();
                    let t = e.file_type().unwrap();
                    if t.is_dir() {
                        stack.push(e.path());
                    } else if t.is_file() {
                        out.push((e.path(), std::fs::read(e.path()).unwrap()));
                    } else {
                        out.push((e.path(), Vec::new()));
                    }
                }
            }
            out.sort();
            out
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

            /// Random trees of directories, files and symlinks (relative, absolute, `..`,
            /// host paths); random writes, mkdirs and reads. Nothing outside the root
            /// changes, and no read returns the host's secret.
            #[test]
            fn writes_and_reads_stay_in_the_root(
                t in tree(),
                ops in prop::collection::vec((0u8..3, rel_path()), 1..8),
            ) {
                let tmp = tempfile::tempdir().unwrap();
                let host = tmp.path().join("host");
                std::fs::create_dir_all(&host).unwrap();
                std::fs::write(host.join("secret"), "HOST SECRET").unwrap();
                let rootfs = tmp.path().join("rootfs");
                std::fs::create_dir_all(&rootfs).unwrap();
                'entries: for (p, node) in &t {
                    let at = rootfs.join(p);
                    // Build the image without following its own symlinks.
                    let mut walk = rootfs.clone();
                    for c in Path::new(p).components() {
                        walk.push(c);
                        if std::fs::symlink_metadata(&walk).is_ok_and(|m| !m.is_dir()) {
                            continue 'entries;
                        }
                    }
                    if let Some(parent) = at.parent()
                        && std::fs::create_dir_all(parent).is_err()
                    {
                        continue;
                    }
                    let _ = match node {
                        Node::Dir => std::fs::create_dir_all(&at),
                        Node::File => std::fs::write(&at, "image"),
                        Node::Link(target) => {
                            let target = target.replace("@HOST@", host.to_str().unwrap());
                            symlink(target, &at)
                        }
                    };
                }
                let outside_before = snapshot(&host);
                let r = ContainerRoot::new(&rootfs).unwrap();
                for (op, p) in &ops {
                    let p = Path::new("/").join(p);
                    match op {
                        0 => { let _ = r.write_file(&p, b"written\n"); }
                        1 => { let _ = r.mkdir_all(&p); }
                        _ => {
                            if let Ok(Some(text)) = r.read_config(&p) {
                                prop_assert!(!text.contains("HOST SECRET"), "read {}", p.display());
                            }
                        }
                    }
                }
                prop_assert_eq!(snapshot(&host), outside_before);
                let top: Vec<_> = std::fs::read_dir(tmp.path()).unwrap()
                    .map(|e| e.unwrap().file_name()).collect();
                prop_assert_eq!(top.len(), 2, "{:?}", top);
            }
        }
    }
}
