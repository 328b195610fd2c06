//! CDI container edits: the values both the common driver edits ([`crate::driver_root`])
//! and the per-claim spec files ([`crate::cdi`]) are made of, serialised with the CDI field
//! names.

use std::path::Path;

use serde::Serialize;

/// CDI container edits (the subset cleave emits), serialised with the CDI field names.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// `NAME=VALUE` entries.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    /// Bind mounts.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    /// OCI hooks (cleave's CDI hook: soname links, ld cache, CUDA compat).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
}

impl ContainerEdits {
    /// True if the edits change nothing.
    pub fn is_empty(&self) -> bool {
        self.env.is_empty()
            && self.device_nodes.is_empty()
            && self.mounts.is_empty()
            && self.hooks.is_empty()
    }

    /// Appends `other`'s edits.
    pub fn extend(&mut self, other: &ContainerEdits) {
        self.env.extend(other.env.iter().cloned());
        self.device_nodes.extend(other.device_nodes.iter().cloned());
        self.mounts.extend(other.mounts.iter().cloned());
        self.hooks.extend(other.hooks.iter().cloned());
    }
}

/// A CDI (OCI) hook.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Hook {
    /// `createContainer` for every hook cleave emits: it runs after the container's mounts
    /// exist and before its process starts.
    pub hook_name: String,
    /// The program, as a path on the host (the runtime resolves it in its own namespace).
    pub path: String,
    /// Arguments, `args[0]` being the program name (OCI convention).
    pub args: Vec<String>,
}

/// A CDI device node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// Path in the container.
    pub path: String,
    /// Path on the host.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// `c` for a character device, when given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub r#type: Option<String>,
    /// Major number, when given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    /// Minor number, when given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
}

impl DeviceNode {
    /// A node the runtime stats on the host to learn type and numbers.
    pub fn path(container: impl AsRef<Path>, host: impl AsRef<Path>) -> Self {
        Self {
            path: container.as_ref().display().to_string(),
            host_path: Some(host.as_ref().display().to_string()),
            r#type: None,
            major: None,
            minor: None,
        }
    }
}

/// A CDI bind mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    /// Source on the host.
    pub host_path: String,
    /// Target in the container.
    pub container_path: String,
    /// Mount options (`ro`, `bind`, ...).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}
