//! The resource types the stand-in serves (group, version, plural, kind, scope) and their
//! look-ups by URL, by name and by object type.

/// One resource type the stand-in serves.
#[derive(Debug, PartialEq, Eq)]
pub struct ResourceDef {
    /// API group ("" for core).
    pub group: &'static str,
    /// API version.
    pub version: &'static str,
    /// Plural resource name used in URLs.
    pub plural: &'static str,
    /// Kind of a single object.
    pub kind: &'static str,
    /// Whether objects live in namespaces.
    pub namespaced: bool,
    /// Whether the resource has a `status` subresource (main updates keep the stored status).
    pub status_subresource: bool,
}

impl ResourceDef {
    /// `apiVersion` of objects of this resource.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `plural` for core resources, `plural.group` otherwise (as in error messages).
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// `Kind.group` as used in validation messages.
    pub fn qualified_kind(&self) -> String {
        if self.group.is_empty() {
            self.kind.to_string()
        } else {
            format!("{}.{}", self.kind, self.group)
        }
    }
}

const fn def(
    group: &'static str,
    version: &'static str,
    plural: &'static str,
    kind: &'static str,
    namespaced: bool,
    status_subresource: bool,
) -> ResourceDef {
    ResourceDef {
        group,
        version,
        plural,
        kind,
        namespaced,
        status_subresource,
    }
}

/// Every resource the stand-in serves.
pub static RESOURCES: &[ResourceDef] = &[
    def(
        "resource.k8s.io",
        "v1",
        "resourceslices",
        "ResourceSlice",
        false,
        false,
    ),
    def(
        "resource.k8s.io",
        "v1",
        "resourceclaims",
        "ResourceClaim",
        true,
        true,
    ),
    def(
        "resource.k8s.io",
        "v1",
        "resourceclaimtemplates",
        "ResourceClaimTemplate",
        true,
        false,
    ),
    def(
        "resource.k8s.io",
        "v1",
        "deviceclasses",
        "DeviceClass",
        false,
        false,
    ),
    def("", "v1", "nodes", "Node", false, true),
    def("", "v1", "pods", "Pod", true, true),
    def("", "v1", "namespaces", "Namespace", false, true),
    def("", "v1", "events", "Event", true, false),
    def("events.k8s.io", "v1", "events", "Event", true, false),
    def("coordination.k8s.io", "v1", "leases", "Lease", true, false),
    // Create-only reviews, answered from `StandIn::add_token` / `StandIn::allow` and never
    // stored.
    def(
        "authentication.k8s.io",
        "v1",
        "tokenreviews",
        "TokenReview",
        false,
        false,
    ),
    def(
        "authorization.k8s.io",
        "v1",
        "subjectaccessreviews",
        "SubjectAccessReview",
        false,
        false,
    ),
];

/// Finds a resource by URL parts.
pub fn find_by_path(group: &str, version: &str, plural: &str) -> Option<&'static ResourceDef> {
    RESOURCES
        .iter()
        .find(|d| d.group == group && d.version == version && d.plural == plural)
}

/// Finds a resource by a name as tests write it: `resourceslices`, `resourceslices.resource.k8s.io`,
/// `ResourceSlice`, or `events.events.k8s.io` (plain `events` is the core one).
pub fn find_by_name(name: &str) -> Option<&'static ResourceDef> {
    RESOURCES
        .iter()
        .find(|d| d.qualified() == name)
        .or_else(|| {
            RESOURCES
                .iter()
                .find(|d| d.plural == name || d.kind == name)
        })
}

/// Finds a resource by an object's `apiVersion` and `kind`.
pub fn find_by_type(api_version: &str, kind: &str) -> Option<&'static ResourceDef> {
    RESOURCES
        .iter()
        .find(|d| d.api_version() == api_version && d.kind == kind)
}
