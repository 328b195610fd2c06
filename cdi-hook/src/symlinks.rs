//! `create-symlinks`: the driver's `libcuda.so -> libcuda.so.1`-style links inside the
//! container, as NVIDIA/nvidia-container-toolkit cmd/nvidia-cdi-hook/create-symlinks does.

use std::collections::HashSet;
use std::path::PathBuf;

use crate::error::{HookError, Result};
use crate::log;
use crate::root::{ContainerRoot, split_parent};

/// One `--link <target>::<link>` argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkSpec {
    /// What the symlink points to, written as given (resolved later, by the container).
    pub target: PathBuf,
    /// Where the symlink goes, as a container path.
    pub link: PathBuf,
}

/// Parses `<target>::<link>`; exactly one `::`, both sides non-empty.
pub fn parse_link(arg: &str) -> Result<LinkSpec> {
    let bad = |reason: &str| HookError::BadArg {
        arg: arg.to_owned(),
        reason: reason.to_owned(),
    };
    let mut parts = arg.split("::");
    let (Some(target), Some(link), None) = (parts.next(), parts.next(), parts.next()) else {
        return Err(bad("expected <target>::<link>"));
    };
    if target.is_empty() || link.is_empty() {
        return Err(bad("empty target or link"));
    }
    Ok(LinkSpec {
        target: PathBuf::from(target),
        link: PathBuf::from(link),
    })
}

/// Creates every link, skipping repeated arguments.
pub fn run(root: &ContainerRoot, links: &[String]) -> Result<()> {
    let mut seen = HashSet::new();
    for arg in links {
        if !seen.insert(arg.as_str()) {
            continue;
        }
        let spec = parse_link(arg)?;
        create(root, &spec)?;
    }
    Ok(())
}

/// Creates one link. An existing symlink with the same target is left alone; anything else
/// at that name (another symlink, a file) is replaced, as NVIDIA does. A directory there
/// is an error. Parents are resolved inside the root and created when missing.
pub fn create(root: &ContainerRoot, spec: &LinkSpec) -> Result<()> {
    let (dir, name) = split_parent(&spec.link)?;
    let dir = root.mkdir_all(&dir)?;
    let shown = dir.shown(&name);
    if dir.readlink(&name)?.as_deref() == Some(spec.target.as_path()) {
        log::line(
            "create-symlinks",
            format_args!(
                "{} -> {} already exists",
                shown.display(),
                spec.target.display()
            ),
        );
        return Ok(());
    }
    dir.symlink(&name, &spec.target)?;
    log::line(
        "create-symlinks",
        format_args!("{} -> {}", shown.display(), spec.target.display()),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_target_and_link() {
        assert_eq!(
            parse_link("libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so").unwrap(),
            LinkSpec {
                target: "libcuda.so.1".into(),
                link: "/usr/lib/x86_64-linux-gnu/libcuda.so".into(),
            }
        );
    }

    #[test]
    fn rejects_malformed_links() {
        for bad in ["nolink", "a::b::c", "::/x", "x::", ""] {
            assert!(parse_link(bad).is_err(), "{bad}");
        }
    }
}
