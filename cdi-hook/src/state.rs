//! Finding the container's root filesystem from the OCI state a runtime writes to a hook's
//! stdin: `bundle` → `<bundle>/config.json` → `root.path`, relative to the bundle unless
//! absolute.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{HookError, Result};

/// The fields of the OCI state the hooks need.
#[derive(Debug, Deserialize)]
pub struct State {
    #[serde(default)]
    pub bundle: PathBuf,
    /// Not in the OCI spec: crun adds the rootfs path here, and NVIDIA's hook prefers it
    /// because config.json may be unreadable under some user namespaces.
    #[serde(default)]
    pub root: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
struct MinimalConfig {
    root: Option<ConfigRoot>,
}

#[derive(Debug, Deserialize)]
struct ConfigRoot {
    #[serde(default)]
    path: PathBuf,
}

/// Reads the state from `spec` (a file), or from stdin when `spec` is absent or `-`.
pub fn load(spec: Option<&Path>) -> Result<State> {
    match spec {
        Some(p) if p != Path::new("-") => {
            let name = p.display().to_string();
            let file = std::fs::File::open(p).map_err(|source| HookError::StateRead {
                source_name: name.clone(),
                source,
            })?;
            parse(file, &name)
        }
        _ => parse(std::io::stdin().lock(), "stdin"),
    }
}

/// Parses one state document from `reader`; `source_name` is for messages.
pub fn parse(mut reader: impl Read, source_name: &str) -> Result<State> {
    let mut text = String::new();
    reader
        .read_to_string(&mut text)
        .map_err(|source| HookError::StateRead {
            source_name: source_name.to_owned(),
            source,
        })?;
    serde_json::from_str(&text).map_err(|source| HookError::StateParse {
        source_name: source_name.to_owned(),
        source,
    })
}

impl State {
    /// The container root as a host path (not yet checked to exist).
    pub fn container_root(&self, source_name: &str) -> Result<PathBuf> {
        if let Some(root) = self.root.as_ref().filter(|r| !r.as_os_str().is_empty()) {
            return Ok(self.bundle.join(root));
        }
        if self.bundle.as_os_str().is_empty() {
            return Err(HookError::StateNoBundle {
                source_name: source_name.to_owned(),
            });
        }
        let config = self.bundle.join("config.json");
        let text = std::fs::read_to_string(&config).map_err(|source| HookError::ConfigRead {
            path: config.clone(),
            source,
        })?;
        let parsed: MinimalConfig =
            serde_json::from_str(&text).map_err(|source| HookError::ConfigParse {
                path: config.clone(),
                source,
            })?;
        match parsed.root {
            Some(r) if !r.path.as_os_str().is_empty() => Ok(self.bundle.join(r.path)),
            _ => Err(HookError::ConfigNoRoot { path: config }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_runc_state() {
        let s = parse(
            br#"{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":1234,"bundle":"/b"}"#
                .as_slice(),
            "t",
        )
        .unwrap();
        assert_eq!(s.bundle, PathBuf::from("/b"));
        assert!(s.root.is_none());
    }

    #[test]
    fn crun_root_wins_and_absolute_root_is_kept() {
        let s = parse(br#"{"bundle":"/b","root":"/abs/rootfs"}"#.as_slice(), "t").unwrap();
        assert_eq!(s.container_root("t").unwrap(), PathBuf::from("/abs/rootfs"));
        let s = parse(br#"{"bundle":"/b","root":"rootfs"}"#.as_slice(), "t").unwrap();
        assert_eq!(s.container_root("t").unwrap(), PathBuf::from("/b/rootfs"));
    }

    #[test]
    fn garbage_names_the_source() {
        let e = parse(b"not json".as_slice(), "stdin").unwrap_err();
        assert!(e.to_string().contains("stdin"), "{e}");
    }

    #[test]
    fn no_bundle_is_an_error() {
        let s = parse(br#"{"id":"c1"}"#.as_slice(), "stdin").unwrap();
        assert!(matches!(
            s.container_root("stdin"),
            Err(HookError::StateNoBundle { .. })
        ));
    }
}
