//! The one error type of the hook: every variant names the file it is about, because the
//! runtime shows only this message when container creation fails.

use std::io;
use std::path::PathBuf;

/// Why a hook failed.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error("reading the OCI container state from {source_name}: {source}")]
    StateRead {
        source_name: String,
        #[source]
        source: io::Error,
    },
    #[error("parsing the OCI container state from {source_name}: {source}")]
    StateParse {
        source_name: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("the OCI container state from {source_name} has no bundle and no root")]
    StateNoBundle { source_name: String },
    #[error("reading the OCI bundle config {path}: {source}")]
    ConfigRead {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("parsing the OCI bundle config {path}: {source}")]
    ConfigParse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("the OCI bundle config {path} has no root.path")]
    ConfigNoRoot { path: PathBuf },
    #[error("container root {path}: {reason}")]
    BadRoot { path: PathBuf, reason: String },
    #[error("{path} (in the container root): {reason}")]
    BadPath { path: PathBuf, reason: String },
    #[error("invalid argument {arg:?}: {reason}")]
    BadArg { arg: String, reason: String },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// An image (or a process of the pod) tried to lead the hook astray; the path is
    /// escaped so that it cannot forge lines in the runtime's log.
    #[error("{path} (in the container root): {reason}")]
    Refused { path: String, reason: String },
    #[error("{what} {path} (in the container root): {source}")]
    Pathrs {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: pathrs::error::Error,
    },
    #[error("the hook did not finish within {secs} s")]
    Deadline { secs: u64 },
    #[error("ldconfig {path}: {reason}")]
    Ldconfig { path: PathBuf, reason: String },
    #[error("mounting {what} on {path}: {source}")]
    Mount {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl HookError {
    /// Shorthand for an I/O failure on `path` while doing `what` ("creating", "reading", ...).
    pub fn io(what: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Io {
            what,
            path: path.into(),
            source,
        }
    }
}

impl HookError {
    /// Shorthand for a failed in-root operation (resolving, creating, renaming) on `path`.
    pub fn pathrs(
        what: &'static str,
        path: impl Into<PathBuf>,
        source: pathrs::error::Error,
    ) -> Self {
        Self::Pathrs {
            what,
            path: path.into(),
            source,
        }
    }
}

pub type Result<T> = std::result::Result<T, HookError>;
