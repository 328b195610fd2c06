//! The mount syscalls behind `disable-device-node-modification`; the only unsafe code of the
//! hook. A createContainer hook runs in the container's mount namespace before pivot_root,
//! so these mounts land in the container and not on the host.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::{HookError, Result};
use crate::root::ContainerRoot;

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

/// Bind-mounts a read-only file holding `contents` over the container file `file`, which
/// must exist and be a regular file. The file lives on a small private tmpfs made in a
/// scratch directory under the container's `/run`; once the bind is in place the tmpfs is
/// detached from the scratch directory (the bind keeps it alive) and the directory removed,
/// so the container sees only the one mount. Returns the host path mounted on.
pub fn bind_file_contents(root: &ContainerRoot, file: &Path, contents: &[u8]) -> Result<PathBuf> {
    let target = root.resolve(file, true)?;
    // An O_PATH handle pins the file that was resolved; the bind goes onto that very file.
    let handle = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&target)
        .map_err(|e| HookError::io("opening the mount target", &target, e))?;
    let meta = handle
        .metadata()
        .map_err(|e| HookError::io("inspecting the mount target", &target, e))?;
    if !meta.is_file() {
        return Err(HookError::BadPath {
            path: file.to_owned(),
            reason: "is not a regular file; refusing to mount over it".into(),
        });
    }
    let target_fd = PathBuf::from(format!("/proc/self/fd/{}", handle.as_raw_fd()));

    let run = root.mkdir_all(Path::new("/run"))?;
    let scratch = run.join(format!("cleave-cdi-hook-{}", std::process::id()));
    let _ = std::fs::remove_dir(&scratch);
    std::fs::create_dir(&scratch).map_err(|e| HookError::io("creating directory", &scratch, e))?;

    let result = (|| -> Result<()> {
        let size = format!("size={},mode=0755", contents.len().max(1));
        mount(
            Some(Path::new("tmpfs")),
            &scratch,
            Some("tmpfs"),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            Some(&size),
        )
        .map_err(|source| HookError::Mount {
            what: "a tmpfs",
            path: scratch.clone(),
            source,
        })?;
        mount(None, &scratch, None, libc::MS_PRIVATE, None).map_err(|source| HookError::Mount {
            what: "private propagation",
            path: scratch.clone(),
            source,
        })?;
        let copy = scratch.join("params");
        std::fs::write(&copy, contents).map_err(|e| HookError::io("writing", &copy, e))?;
        std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o444))
            .map_err(|e| HookError::io("chmod", &copy, e))?;
        mount(Some(&copy), &target_fd, None, libc::MS_BIND, None).map_err(|source| {
            HookError::Mount {
                what: "the modified copy",
                path: target.clone(),
                source,
            }
        })?;
        // MS_RDONLY is ignored on the first bind mount; it takes a remount.
        let ro = libc::MS_REMOUNT
            | libc::MS_BIND
            | libc::MS_RDONLY
            | libc::MS_NOSUID
            | libc::MS_NODEV
            | libc::MS_NOEXEC;
        if let Err(source) = mount(None, &target, None, ro, None) {
            let _ = umount_detach(&target);
            return Err(HookError::Mount {
                what: "read-only",
                path: target.clone(),
                source,
            });
        }
        Ok(())
    })();

    let _ = umount_detach(&scratch);
    let _ = std::fs::remove_dir(&scratch);
    result.map(|()| target)
}
