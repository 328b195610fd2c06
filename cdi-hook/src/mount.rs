//! The mount syscalls behind `disable-device-node-modification`; the only unsafe code of the
//! hook. A createContainer hook runs in the container's mount namespace before pivot_root,
//! so these mounts land in the container and not on the host.
#![allow(unsafe_code)]

use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{HookError, Result};
use crate::root::{ContainerRoot, Dir, metadata_of};

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

/// mount(2) with optional source, type and data.
fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let source = source.map(cstr).transpose()?;
    let target = cstr(target)?;
    let fstype = fstype
        .map(|s| CString::new(s).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e)))
        .transpose()?;
    let data = data
        .map(|s| CString::new(s).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e)))
        .transpose()?;
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is null or points to a NUL-terminated string owned by a local
    // CString that lives until after the call; mount(2) only reads them.
    let rc = unsafe {
        libc::mount(
            ptr(&source),
            target.as_ptr(),
            ptr(&fstype),
            flags,
            ptr(&data).cast(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// umount2(2) with MNT_DETACH.
fn umount_detach(target: &Path) -> io::Result<()> {
    let target = cstr(target)?;
    // SAFETY: `target` is a NUL-terminated string that outlives the call.
    let rc = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `/proc/self/fd/<n>` of a handle: mount(2) follows this magic link to the very inode the
/// handle holds, so nothing is resolved again by path.
fn fd_path(h: &impl AsFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", h.as_fd().as_raw_fd()))
}

/// Bind-mounts a read-only file holding `contents` over the container file `file`, which
/// must exist and be a regular file. The file lives on a small private tmpfs made in a
/// scratch directory under the container's `/run`; once the bind is in place the tmpfs is
/// detached from the scratch directory (the bind keeps it alive) and the directory removed,
/// so the container sees only the one mount. Every path is resolved inside the root and
/// every mount done on a handle (`/proc/self/fd/<n>`). Returns the host path mounted on.
pub fn bind_file_contents(root: &ContainerRoot, file: &Path, contents: &[u8]) -> Result<PathBuf> {
    // The handle pins the file that was resolved inside the root; the bind goes onto it.
    let handle = root.lookup(file, true)?.ok_or_else(|| HookError::BadPath {
        path: file.to_owned(),
        reason: "does not exist; nothing to mount over".into(),
    })?;
    if !metadata_of(&handle, file)?.is_file() {
        return Err(HookError::BadPath {
            path: file.to_owned(),
            reason: "is not a regular file; refusing to mount over it".into(),
        });
    }
    let target = root.host_of(&root.path_in_root(&handle, file)?);
    let target_fd = fd_path(&handle);

    let run = root.mkdir_all(Path::new("/run"))?;
    let name = OsString::from(format!("cleave-cdi-hook-{}", std::process::id()));
    let _ = run.remove_dir(&name);
    let scratch_dir = run.create_dir(&name)?;
    let scratch_dev = metadata_of(scratch_dir.handle(), &scratch_dir.in_root)
        .ok()
        .map(|m| m.dev());

    let result = mount_copy_over(
        root,
        file,
        contents,
        &scratch_dir,
        scratch_dev,
        &target_fd,
        &target,
    );

    // On failure, a tmpfs still on the scratch directory (the lookup reaches a file system
    // other than the directory's) is detached before the directory is removed.
    if result.is_err()
        && let Ok(Some(top)) = root.open_dir(&scratch_dir.in_root)
        && metadata_of(top.handle(), &scratch_dir.in_root)
            .is_ok_and(|m| Some(m.dev()) != scratch_dev)
    {
        let _ = umount_detach(&fd_path(top.handle()));
    }
    let _ = run.remove_dir(&name);
    result.map(|()| target)
}

/// The mounts of [`bind_file_contents`]: a tmpfs on the scratch directory, `contents` in it,
/// bound read-only over `file` (on `target_fd`, the handle of the file; `target` its host
/// path, for errors), and the tmpfs detached from the scratch directory.
fn mount_copy_over(
    root: &ContainerRoot,
    file: &Path,
    contents: &[u8],
    scratch_dir: &Dir,
    scratch_dev: Option<u64>,
    target_fd: &Path,
    target: &Path,
) -> Result<()> {
    let scratch = scratch_dir.host.clone();
    let scratch_fd = fd_path(scratch_dir.handle());
    let size = format!("size={},mode=0755", contents.len().max(1));
    mount(
        Some(Path::new("tmpfs")),
        &scratch_fd,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        Some(&size),
    )
    .map_err(|source| HookError::Mount {
        what: "a tmpfs",
        path: scratch.clone(),
        source,
    })?;
    // The tmpfs now sits on top of the scratch directory: look it up again (inside the
    // root) to reach its root, and check that it is not the directory itself.
    let tmpfs = root
        .open_dir(&scratch_dir.in_root)?
        .ok_or_else(|| HookError::BadPath {
            path: scratch_dir.in_root.clone(),
            reason: "vanished while the hook mounted on it".into(),
        })?;
    if Some(metadata_of(tmpfs.handle(), &tmpfs.in_root)?.dev()) == scratch_dev {
        return Err(HookError::Refused {
            path: tmpfs.in_root.display().to_string(),
            reason: "is not the tmpfs the hook mounted there".into(),
        });
    }
    let tmpfs_fd = fd_path(tmpfs.handle());
    mount(None, &tmpfs_fd, None, libc::MS_PRIVATE, None).map_err(|source| HookError::Mount {
        what: "private propagation",
        path: scratch.clone(),
        source,
    })?;
    let copy_name = OsStr::new("params");
    tmpfs.write(copy_name, contents, 0o444)?;
    let copy = tmpfs
        .open_regular(copy_name)?
        .ok_or_else(|| HookError::BadPath {
            path: tmpfs.shown(copy_name),
            reason: "vanished while the hook wrote it".into(),
        })?;
    let copy_meta = copy
        .metadata()
        .map_err(|e| HookError::io("inspecting", tmpfs.shown(copy_name), e))?;
    mount(Some(&fd_path(&copy)), target_fd, None, libc::MS_BIND, None).map_err(|source| {
        HookError::Mount {
            what: "the modified copy",
            path: target.to_owned(),
            source,
        }
    })?;
    // MS_RDONLY is ignored on the first bind mount; it takes a remount, on the mount
    // now on top of the file (looked up again, and checked to be the copy).
    let bound = root.lookup(file, true)?.ok_or_else(|| HookError::BadPath {
        path: file.to_owned(),
        reason: "vanished while the hook mounted on it".into(),
    })?;
    let bound_meta = metadata_of(&bound, file)?;
    if (bound_meta.dev(), bound_meta.ino()) != (copy_meta.dev(), copy_meta.ino()) {
        return Err(HookError::Refused {
            path: file.display().to_string(),
            reason: "was replaced while the hook mounted on it".into(),
        });
    }
    let ro = libc::MS_REMOUNT
        | libc::MS_BIND
        | libc::MS_RDONLY
        | libc::MS_NOSUID
        | libc::MS_NODEV
        | libc::MS_NOEXEC;
    if let Err(source) = mount(None, &fd_path(&bound), None, ro, None) {
        let _ = umount_detach(&fd_path(&bound));
        return Err(HookError::Mount {
            what: "read-only",
            path: target.to_owned(),
            source,
        });
    }
    // Detach the tmpfs from the scratch directory (the bind keeps it alive).
    let _ = umount_detach(&tmpfs_fd);
    Ok(())
}
