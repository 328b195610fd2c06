//! The opaque config objects users put in `ResourceClaim.spec.devices.config[].opaque.parameters`
//! and `DeviceClass.spec.config[]`, and the three steps that turn raw JSON into a config the
//! driver can apply:
//!
//! 1. **decode** ([`parse_config`]): strict. `apiVersion` must be [`CONFIG_API_VERSION`],
//!    `kind` [`KIND_GPU_CONFIG`] or [`KIND_MIG_CONFIG`]; unknown fields and wrong types are
//!    errors that name the field path (`sharing.mps.activeThreadPercentage: invalid type: …`).
//! 2. **default** ([`DeviceConfig::apply_defaults`]): fills what the user left out; see
//!    the method for the values.
//! 3. **validate** ([`DeviceConfig::validate`]): rules across fields and ranges; every
//!    [`ValidationError`] names the field path and the bad value.
//!
//! [`decode_config`] runs all three. Serialising a config gives back the same camelCase
//! JSON (quantities keep their original text), so configs round-trip.
//!
//! ```yaml
//! apiVersion: gpu.cleave.dev/v1alpha1
//! kind: GpuConfig
//! sharing:
//!   strategy: MPS
//!   mps:
//!     activeThreadPercentage: 25
//!     multiUser: false
//!     pinnedMemoryLimit:
//!       default: 10Gi
//!       perDevice:
//!         GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0: 20Gi
//!         "1": 5Gi
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::names::{CONFIG_API_VERSION, DeviceName, KIND_GPU_CONFIG, KIND_MIG_CONFIG};
use crate::quantity::Quantity;

/// Active thread percentage an MPS config gets when it does not say (no restriction,
/// which is also what the MPS control daemon does without a setting).
pub const DEFAULT_ACTIVE_THREAD_PERCENTAGE: u8 = 100;

/// Why raw JSON is not an acceptable config: decoding failed or a rule was broken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The parameters are not a JSON object.
    #[error("opaque parameters must be a JSON object, got {found}")]
    NotAnObject {
        /// What was found instead (`array`, `string`, …).
        found: &'static str,
    },
    /// Strict decoding failed at `path` (`.` for the top level).
    #[error("{}", render_path_message(path, message))]
    Decode {
        /// Dotted field path, e.g. `sharing.mps.activeThreadPercentage`.
        path: String,
        /// What was wrong there.
        message: String,
    },
    /// Decoding succeeded but a validation rule failed.
    #[error(transparent)]
    Invalid(#[from] ValidationError),
}

fn render_path_message(path: &str, message: &str) -> String {
    if path.is_empty() || path == "." {
        message.to_owned()
    } else {
        format!("{path}: {message}")
    }
}

/// A broken validation rule; the message names the field path and the bad value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    /// `mps.activeThreadPercentage` outside 1–100.
    #[error("{field}: must be between 1 and 100, got {value}")]
    ThreadPercentageOutOfRange {
        /// Field path.
        field: String,
        /// The value given.
        value: u8,
    },
    /// A pinned memory limit that is zero or negative.
    #[error("{field}: must be a positive quantity, got {value:?}")]
    MemoryLimitNotPositive {
        /// Field path.
        field: String,
        /// The quantity as written.
        value: String,
    },
    /// Settings of the other strategy were given (`strategy: MPS` with `timeSlicing`, or
    /// `strategy: TimeSlicing` with `mps`).
    #[error("{field}: must not be set when sharing.strategy is {strategy}")]
    ConflictingStrategy {
        /// Field path of the block that must go.
        field: String,
        /// The strategy chosen.
        strategy: SharingStrategy,
    },
    /// A `perDevice` key that is neither a device UUID nor a decimal index.
    #[error(
        "{field}: invalid device key {key:?}, expected GPU-<uuid>, MIG-<uuid> or a decimal index"
    )]
    InvalidDeviceKey {
        /// Field path of the map.
        field: String,
        /// The key given.
        key: String,
    },
    /// A MIG device cannot have its own time slice: it runs in its parent GPU's.
    #[error(
        "{field}: MIG devices use their parent GPU's time slice, only Default is allowed, got {value}"
    )]
    MigTimeSliceInterval {
        /// Field path.
        field: String,
        /// The interval given.
        value: TimeSliceInterval,
    },
}

/// A config was resolved for a device of the other kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// `GpuConfig` on a MIG device or `MigConfig` on a whole GPU.
    #[error("{config_kind} cannot be applied to a {device_kind} device")]
    KindMismatch {
        /// `GpuConfig` or `MigConfig`.
        config_kind: &'static str,
        /// The kind of the allocated device.
        device_kind: DeviceKind,
    },
    /// Same, for a config resolved from an allocation: names the winning entry.
    #[error(
        "config entry {index} ({from}): {config_kind} cannot be applied to a {device_kind} device"
    )]
    EntryKindMismatch {
        /// Index of the entry in `status.allocation.devices.config`.
        index: usize,
        /// Where the entry came from.
        from: ConfigSource,
        /// `GpuConfig` or `MigConfig`.
        config_kind: &'static str,
        /// The kind of the allocated device.
        device_kind: DeviceKind,
    },
}

/// Where a config entry came from (`DeviceAllocationConfiguration.source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ConfigSource {
    /// Set by the DeviceClass (`FromClass`), i.e. by the cluster admin.
    FromClass,
    /// Set in the claim (`FromClaim`), i.e. by the user.
    FromClaim,
}

impl ConfigSource {
    /// The API value, `FromClass` or `FromClaim`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::FromClass => "FromClass",
            Self::FromClaim => "FromClaim",
        }
    }
}

impl fmt::Display for ConfigSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ConfigSource {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "FromClass" => Ok(Self::FromClass),
            "FromClaim" => Ok(Self::FromClaim),
            _ => Err(()),
        }
    }
}

/// Whether an allocated device is a whole GPU or a MIG device: the config kind it takes and
/// the kind the checkpoint records (serialized `gpu` / `mig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum DeviceKind {
    /// A whole GPU (takes [`GpuConfig`]; also one served by a full-size MIG instance on a
    /// MIG-enabled GPU).
    Gpu,
    /// A MIG device (takes [`MigConfig`]).
    Mig,
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Gpu => "GPU",
            Self::Mig => "MIG",
        })
    }
}

impl From<&DeviceName> for DeviceKind {
    fn from(name: &DeviceName) -> Self {
        if name.is_mig() { Self::Mig } else { Self::Gpu }
    }
}

/// A decoded config of either kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceConfig {
    /// `kind: GpuConfig`, for whole GPUs.
    Gpu(GpuConfig),
    /// `kind: MigConfig`, for MIG devices.
    Mig(MigConfig),
}

/// `kind: GpuConfig`: how a whole GPU is set up for the claim.
///
/// Its `Deserialize` checks `apiVersion`, `kind` and unknown fields, but (like every serde
/// derive) also takes a JSON array for an object; [`parse_config`] rejects that too.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "GpuConfigRepr", into = "GpuConfigRepr")]
pub struct GpuConfig {
    /// How the GPU is shared; `None` means exclusive (no sharing set up).
    pub sharing: Option<Sharing>,
}

/// `kind: MigConfig`: how a MIG device is set up for the claim.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "MigConfigRepr", into = "MigConfigRepr")]
pub struct MigConfig {
    /// How the MIG device is shared; `None` means exclusive.
    pub sharing: Option<Sharing>,
}

/// The `sharing` block: one strategy and, optionally, its settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Sharing {
    /// The strategy.
    pub strategy: SharingStrategy,
    /// Settings for `strategy: TimeSlicing` (must be absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_slicing: Option<TimeSlicingConfig>,
    /// Settings for `strategy: MPS` (must be absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<MpsConfig>,
}

/// How the containers of a claim share a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SharingStrategy {
    /// CUDA time-slicing between processes (the GPU's default scheduler).
    TimeSlicing,
    /// A per-claim MPS control daemon.
    #[serde(rename = "MPS")]
    Mps,
}

impl SharingStrategy {
    /// The lower-case label of metrics, `usage` output and `--consumable-capacity`
    /// (`time-slicing`, `mps`); [`sharing_label`] adds `exclusive` for no sharing.
    pub fn label(self) -> &'static str {
        match self {
            Self::TimeSlicing => "time-slicing",
            Self::Mps => "mps",
        }
    }
}

/// The label of how a device is shared: `exclusive` when it is not, else the strategy's.
pub fn sharing_label(sharing: Option<SharingStrategy>) -> &'static str {
    sharing.map_or("exclusive", SharingStrategy::label)
}

impl fmt::Display for SharingStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::TimeSlicing => "TimeSlicing",
            Self::Mps => "MPS",
        })
    }
}

/// `sharing.timeSlicing`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TimeSlicingConfig {
    /// Time slice length; defaulted to [`TimeSliceInterval::Default`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<TimeSliceInterval>,
}

impl TimeSlicingConfig {
    /// The interval, or [`TimeSliceInterval::Default`] when unset.
    pub fn interval_or_default(&self) -> TimeSliceInterval {
        self.interval.unwrap_or_default()
    }
}

/// Time slice lengths of the GPU scheduler (`nvidia-smi compute-policy --set-timeslice`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TimeSliceInterval {
    /// The driver's default.
    #[default]
    Default,
    /// Short slices.
    Short,
    /// Medium slices.
    Medium,
    /// Long slices.
    Long,
}

impl TimeSliceInterval {
    /// The value `nvidia-smi compute-policy --set-timeslice` takes (0–3).
    pub fn timeslice_value(self) -> u8 {
        match self {
            Self::Default => 0,
            Self::Short => 1,
            Self::Medium => 2,
            Self::Long => 3,
        }
    }
}

impl fmt::Display for TimeSliceInterval {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Default => "Default",
            Self::Short => "Short",
            Self::Medium => "Medium",
            Self::Long => "Long",
        })
    }
}

/// `sharing.mps`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MpsConfig {
    /// Share of the SMs each client may use (1–100, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`);
    /// defaulted to [`DEFAULT_ACTIVE_THREAD_PERCENTAGE`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_thread_percentage: Option<u8>,
    /// Device memory each client may pin (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`); none = no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_memory_limit: Option<PinnedMemoryLimit>,
    /// Start the claim's MPS control daemon in multi-user mode, so that containers running
    /// as different UIDs share one MPS server (they then also share its fault domain and
    /// log). Off by default: an MPS server serves one UID, and a client of another UID waits
    /// without an error until the first UID's clients are gone. Needs compute capability
    /// 7.0 (Volta) or newer and a driver whose `nvidia-cuda-mps-control` takes `-M`; the
    /// claim fails otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multi_user: Option<bool>,
}

impl MpsConfig {
    /// `multiUser`, false when unset.
    pub fn multi_user_or_default(&self) -> bool {
        self.multi_user.unwrap_or(false)
    }

    /// The thread percentage, or [`DEFAULT_ACTIVE_THREAD_PERCENTAGE`] when unset.
    pub fn active_thread_percentage_or_default(&self) -> u8 {
        self.active_thread_percentage
            .unwrap_or(DEFAULT_ACTIVE_THREAD_PERCENTAGE)
    }
}

/// `sharing.mps.pinnedMemoryLimit`: a default for every device of the claim, and overrides
/// keyed by device UUID (`GPU-…`, `MIG-…`) or by decimal index. The index is the CUDA device
/// ordinal inside the claim's MPS daemon: the position of the device among the claim's
/// devices served by that daemon, as in `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<ordinal>=<limit>`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PinnedMemoryLimit {
    /// Limit for every device without an override.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<Quantity>,
    /// Overrides by device UUID or index (validated by [`DeviceKey::parse`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub per_device: BTreeMap<String, Quantity>,
}

impl PinnedMemoryLimit {
    /// The limit for one device: its UUID key (ASCII case-insensitive), else its ordinal key,
    /// else the default; `None` means no limit.
    pub fn limit_for(&self, uuid: &str, ordinal: u32) -> Option<&Quantity> {
        let mut by_index = None;
        for (key, limit) in &self.per_device {
            match DeviceKey::parse(key) {
                Some(DeviceKey::Uuid(u)) if u.eq_ignore_ascii_case(uuid) => return Some(limit),
                Some(DeviceKey::Index(i)) if i == ordinal => by_index = Some(limit),
                _ => {}
            }
        }
        by_index.or(self.default.as_ref())
    }
}

/// A well-formed `perDevice` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKey<'a> {
    /// `GPU-<8-4-4-4-12 hex>` or `MIG-<8-4-4-4-12 hex>` (either hex case).
    Uuid(&'a str),
    /// A decimal index without sign or leading zeros.
    Index(u32),
}

impl<'a> DeviceKey<'a> {
    /// Parses a key; `None` when it is neither form.
    pub fn parse(key: &'a str) -> Option<Self> {
        if let Some(rest) = key
            .strip_prefix("GPU-")
            .or_else(|| key.strip_prefix("MIG-"))
        {
            return is_uuid(rest).then_some(Self::Uuid(key));
        }
        let canonical = !key.is_empty()
            && key.bytes().all(|b| b.is_ascii_digit())
            && (key.len() == 1 || !key.starts_with('0'));
        if !canonical {
            return None;
        }
        key.parse().ok().map(Self::Index)
    }
}

/// `8-4-4-4-12` hex digits.
fn is_uuid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

// ---------------------------------------------------------------------------------------
// Decoding

/// Decodes, defaults and validates raw opaque parameters: the one call the driver makes.
pub fn decode_config(raw: &Value) -> Result<DeviceConfig, ConfigError> {
    let mut config = parse_config(raw)?;
    config.apply_defaults();
    config.validate()?;
    Ok(config)
}

/// Strict decoding only (no defaults, no validation): checks `apiVersion` and `kind`,
/// then decodes the object of that kind, rejecting unknown fields.
pub fn parse_config(raw: &Value) -> Result<DeviceConfig, ConfigError> {
    let Value::Object(object) = raw else {
        return Err(ConfigError::NotAnObject {
            found: json_type(raw),
        });
    };
    check_string_field(object, "apiVersion", &[CONFIG_API_VERSION])?;
    let kind = check_string_field(object, "kind", &[KIND_GPU_CONFIG, KIND_MIG_CONFIG])?;
    let config = if kind == KIND_GPU_CONFIG {
        strict_decode(raw).map(DeviceConfig::Gpu)?
    } else {
        strict_decode(raw).map(DeviceConfig::Mig)?
    };
    // serde's derived structs also accept a JSON array of field values; no field of the
    // schema is a list, so any array that decoded must have stood for an object.
    if let Some(path) = first_array(raw, String::new()) {
        return Err(ConfigError::Decode {
            path,
            message: "invalid type: sequence, expected a map".to_owned(),
        });
    }
    Ok(config)
}

/// Dotted path of the first array in `v` (object keys in map order).
fn first_array(v: &Value, path: String) -> Option<String> {
    match v {
        Value::Array(_) => Some(path),
        Value::Object(map) => map.iter().find_map(|(k, v)| {
            let p = if path.is_empty() {
                k.clone()
            } else {
                format!("{path}.{k}")
            };
            first_array(v, p)
        }),
        _ => None,
    }
}

fn strict_decode<'de, T: Deserialize<'de>>(raw: &'de Value) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(raw).map_err(|e| ConfigError::Decode {
        path: e.path().to_string(),
        message: e.into_inner().to_string(),
    })
}

fn check_string_field<'a>(
    object: &'a serde_json::Map<String, Value>,
    name: &str,
    accepted: &[&str],
) -> Result<&'a str, ConfigError> {
    // Built only on the error path: decoding is on the prepare path.
    let expected = || {
        accepted
            .iter()
            .map(|a| format!("{a:?}"))
            .collect::<Vec<_>>()
            .join(" or ")
    };
    let decode = |path: &str, message: String| ConfigError::Decode {
        path: path.to_owned(),
        message,
    };
    match object.get(name) {
        None => Err(decode(".", format!("missing field `{name}`"))),
        Some(Value::String(s)) if accepted.contains(&s.as_str()) => Ok(s),
        Some(Value::String(s)) => Err(decode(
            name,
            format!("unsupported value {s:?}, expected {}", expected()),
        )),
        Some(other) => Err(decode(
            name,
            format!("invalid type: {}, expected {}", describe(other), expected()),
        )),
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Describes a JSON value the way serde's `invalid type` messages do.
fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => format!("boolean `{b}`"),
        Value::Number(n) if n.is_f64() => format!("floating point `{n}`"),
        Value::Number(n) => format!("integer `{n}`"),
        Value::String(s) => format!("string {s:?}"),
        Value::Array(_) => "sequence".to_owned(),
        Value::Object(_) => "map".to_owned(),
    }
}

/// A unit type that (de)serialises as exactly one string; used for `apiVersion` and `kind`
/// so that [`GpuConfig`] and [`MigConfig`] decode strictly on their own too.
macro_rules! string_tag {
    ($name:ident, $value:expr) => {
        #[derive(Debug, Clone, Copy, Default)]
        struct $name;

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str($value)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct TagVisitor;
                impl Visitor<'_> for TagVisitor {
                    type Value = $name;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        write!(f, "{:?}", $value)
                    }
                    fn visit_str<E: de::Error>(self, v: &str) -> Result<$name, E> {
                        if v == $value {
                            Ok($name)
                        } else {
                            Err(E::invalid_value(de::Unexpected::Str(v), &self))
                        }
                    }
                }
                deserializer.deserialize_str(TagVisitor)
            }
        }
    };
}

string_tag!(ApiVersionTag, CONFIG_API_VERSION);
string_tag!(GpuKindTag, KIND_GPU_CONFIG);
string_tag!(MigKindTag, KIND_MIG_CONFIG);

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct GpuConfigRepr {
    api_version: ApiVersionTag,
    kind: GpuKindTag,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sharing: Option<Sharing>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct MigConfigRepr {
    api_version: ApiVersionTag,
    kind: MigKindTag,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sharing: Option<Sharing>,
}

impl From<GpuConfigRepr> for GpuConfig {
    fn from(r: GpuConfigRepr) -> Self {
        Self { sharing: r.sharing }
    }
}

impl From<GpuConfig> for GpuConfigRepr {
    fn from(c: GpuConfig) -> Self {
        Self {
            api_version: ApiVersionTag,
            kind: GpuKindTag,
            sharing: c.sharing,
        }
    }
}

impl From<MigConfigRepr> for MigConfig {
    fn from(r: MigConfigRepr) -> Self {
        Self { sharing: r.sharing }
    }
}

impl From<MigConfig> for MigConfigRepr {
    fn from(c: MigConfig) -> Self {
        Self {
            api_version: ApiVersionTag,
            kind: MigKindTag,
            sharing: c.sharing,
        }
    }
}

impl Serialize for DeviceConfig {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Gpu(c) => c.serialize(serializer),
            Self::Mig(c) => c.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for DeviceConfig {
    /// Strict decoding as [`parse_config`] (no defaults, no validation), dispatching on `kind`.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = Value::deserialize(deserializer)?;
        parse_config(&raw).map_err(de::Error::custom)
    }
}

// ---------------------------------------------------------------------------------------
// Defaults, validation, application

impl DeviceConfig {
    /// `GpuConfig` or `MigConfig`.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Self::Gpu(_) => KIND_GPU_CONFIG,
            Self::Mig(_) => KIND_MIG_CONFIG,
        }
    }

    /// The device kind this config is for.
    pub fn device_kind(&self) -> DeviceKind {
        match self {
            Self::Gpu(_) => DeviceKind::Gpu,
            Self::Mig(_) => DeviceKind::Mig,
        }
    }

    /// The sharing block, whatever the kind.
    pub fn sharing(&self) -> Option<&Sharing> {
        match self {
            Self::Gpu(c) => c.sharing.as_ref(),
            Self::Mig(c) => c.sharing.as_ref(),
        }
    }

    /// Fills unset fields; see [`Sharing::apply_defaults`].
    pub fn apply_defaults(&mut self) {
        match self {
            Self::Gpu(c) => c.apply_defaults(),
            Self::Mig(c) => c.apply_defaults(),
        }
    }

    /// Checks the rules; see [`GpuConfig::validate`] and [`MigConfig::validate`].
    pub fn validate(&self) -> Result<(), ValidationError> {
        match self {
            Self::Gpu(c) => c.validate(),
            Self::Mig(c) => c.validate(),
        }
    }

    /// The sharing to apply to a device of `kind` (`None`: exclusive). The driver calls
    /// this for every allocated device, since a `GpuConfig` on a MIG device or a
    /// `MigConfig` on a whole GPU can only be detected once the device is known.
    pub fn sharing_for(&self, kind: DeviceKind) -> Result<Option<&Sharing>, ApplyError> {
        if self.device_kind() != kind {
            return Err(ApplyError::KindMismatch {
                config_kind: self.kind_name(),
                device_kind: kind,
            });
        }
        Ok(self.sharing())
    }
}

impl GpuConfig {
    /// Fills unset fields; a missing `sharing` stays missing (exclusive use).
    pub fn apply_defaults(&mut self) {
        if let Some(s) = &mut self.sharing {
            s.apply_defaults();
        }
    }

    /// Checks the rules of [`Sharing::validate`].
    pub fn validate(&self) -> Result<(), ValidationError> {
        self.sharing.as_ref().map_or(Ok(()), |s| s.validate(false))
    }
}

impl MigConfig {
    /// Fills unset fields; a missing `sharing` stays missing (exclusive use).
    pub fn apply_defaults(&mut self) {
        if let Some(s) = &mut self.sharing {
            s.apply_defaults();
        }
    }

    /// Checks the rules of [`Sharing::validate`], plus: a MIG device runs in its parent
    /// GPU's time slice, so `timeSlicing.interval` can only be `Default`.
    pub fn validate(&self) -> Result<(), ValidationError> {
        self.sharing.as_ref().map_or(Ok(()), |s| s.validate(true))
    }
}

impl Sharing {
    /// Fills unset fields of the chosen strategy: `TimeSlicing` gets
    /// `timeSlicing.interval: Default`; `MPS` gets `mps.activeThreadPercentage: 100`
    /// ([`DEFAULT_ACTIVE_THREAD_PERCENTAGE`]) and no pinned memory limit. The other
    /// strategy's block is left alone, so that validation still sees a conflict.
    pub fn apply_defaults(&mut self) {
        match self.strategy {
            SharingStrategy::TimeSlicing => {
                let ts = self.time_slicing.get_or_insert_with(Default::default);
                ts.interval.get_or_insert(TimeSliceInterval::Default);
            }
            SharingStrategy::Mps => {
                let mps = self.mps.get_or_insert_with(Default::default);
                mps.active_thread_percentage
                    .get_or_insert(DEFAULT_ACTIVE_THREAD_PERCENTAGE);
            }
        }
    }

    /// Rules, checked in this order (the first failure is returned):
    /// the other strategy's block is absent; `activeThreadPercentage` is 1–100; the
    /// default pinned memory limit is positive; every `perDevice` key is a device UUID or
    /// a decimal index and its limit positive (in key order); on MIG devices
    /// (`mig = true`) the time-slice interval is `Default`.
    pub fn validate(&self, mig: bool) -> Result<(), ValidationError> {
        match self.strategy {
            SharingStrategy::Mps if self.time_slicing.is_some() => {
                return Err(ValidationError::ConflictingStrategy {
                    field: "sharing.timeSlicing".to_owned(),
                    strategy: self.strategy,
                });
            }
            SharingStrategy::TimeSlicing if self.mps.is_some() => {
                return Err(ValidationError::ConflictingStrategy {
                    field: "sharing.mps".to_owned(),
                    strategy: self.strategy,
                });
            }
            _ => {}
        }
        if let Some(mps) = &self.mps {
            validate_mps(mps)?;
        }
        if let Some(ts) = &self.time_slicing {
            match ts.interval {
                Some(value) if mig && value != TimeSliceInterval::Default => {
                    return Err(ValidationError::MigTimeSliceInterval {
                        field: "sharing.timeSlicing.interval".to_owned(),
                        value,
                    });
                }
                _ => {}
            }
        }
        Ok(())
    }
}

fn validate_mps(mps: &MpsConfig) -> Result<(), ValidationError> {
    if let Some(value) = mps.active_thread_percentage
        && !(1..=100).contains(&value)
    {
        return Err(ValidationError::ThreadPercentageOutOfRange {
            field: "sharing.mps.activeThreadPercentage".to_owned(),
            value,
        });
    }
    let Some(limit) = &mps.pinned_memory_limit else {
        return Ok(());
    };
    let positive = |field: String, q: &Quantity| {
        if q.is_positive() {
            Ok(())
        } else {
            Err(ValidationError::MemoryLimitNotPositive {
                field,
                value: q.as_str().to_owned(),
            })
        }
    };
    if let Some(default) = &limit.default {
        positive("sharing.mps.pinnedMemoryLimit.default".to_owned(), default)?;
    }
    for (key, q) in &limit.per_device {
        if DeviceKey::parse(key).is_none() {
            return Err(ValidationError::InvalidDeviceKey {
                field: "sharing.mps.pinnedMemoryLimit.perDevice".to_owned(),
                key: key.clone(),
            });
        }
        positive(format!("sharing.mps.pinnedMemoryLimit.perDevice.{key}"), q)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const UUID: &str = "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
    const MIG_UUID: &str = "MIG-aabbccdd-eeff-0011-2233-445566778899";

    fn gpu(sharing: Value) -> Value {
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig", "sharing": sharing})
    }

    fn mig(sharing: Value) -> Value {
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "MigConfig", "sharing": sharing})
    }

    fn decode_err(raw: Value) -> String {
        match decode_config(&raw) {
            Ok(c) => panic!("accepted: {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn parse_err(raw: Value) -> String {
        match parse_config(&raw) {
            Ok(c) => panic!("accepted: {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    // --- decoding: every field ---

    #[test]
    fn decodes_full_mps_config() {
        let raw = gpu(json!({
            "strategy": "MPS",
            "mps": {
                "activeThreadPercentage": 25,
                "multiUser": true,
                "pinnedMemoryLimit": {"default": "10Gi", "perDevice": {UUID: "20Gi", "1": "5Gi"}}
            }
        }));
        let c = parse_config(&raw).unwrap();
        let expected = DeviceConfig::Gpu(GpuConfig {
            sharing: Some(Sharing {
                strategy: SharingStrategy::Mps,
                time_slicing: None,
                mps: Some(MpsConfig {
                    active_thread_percentage: Some(25),
                    pinned_memory_limit: Some(PinnedMemoryLimit {
                        default: Some(q("10Gi")),
                        per_device: [(UUID.to_owned(), q("20Gi")), ("1".to_owned(), q("5Gi"))]
                            .into_iter()
                            .collect(),
                    }),
                    multi_user: Some(true),
                }),
            }),
        });
        assert_eq!(c, expected);
        assert_eq!(decode_config(&raw).unwrap(), expected);
        assert_eq!(serde_json::to_value(&c).unwrap(), raw);
    }

    #[test]
    fn decodes_every_interval() {
        for (name, v) in [
            ("Default", TimeSliceInterval::Default),
            ("Short", TimeSliceInterval::Short),
            ("Medium", TimeSliceInterval::Medium),
            ("Long", TimeSliceInterval::Long),
        ] {
            let raw = gpu(json!({"strategy": "TimeSlicing", "timeSlicing": {"interval": name}}));
            let c = decode_config(&raw).unwrap();
            let ts = c.sharing().unwrap().time_slicing.as_ref().unwrap();
            assert_eq!(ts.interval, Some(v));
            assert_eq!(v.to_string(), name);
            assert_eq!(serde_json::to_value(&c).unwrap(), raw);
        }
        assert_eq!(TimeSliceInterval::Long.timeslice_value(), 3);
        assert_eq!(TimeSliceInterval::Default.timeslice_value(), 0);
    }

    #[test]
    fn decodes_minimal_configs_of_both_kinds() {
        let c =
            decode_config(&json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig"}))
                .unwrap();
        assert_eq!(c, DeviceConfig::Gpu(GpuConfig { sharing: None }));
        let c = decode_config(
            &json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "MigConfig", "sharing": null}),
        )
        .unwrap();
        assert_eq!(c, DeviceConfig::Mig(MigConfig { sharing: None }));
        assert_eq!(c.kind_name(), "MigConfig");
        assert_eq!(c.device_kind(), DeviceKind::Mig);
    }

    #[test]
    fn quantities_may_be_integers() {
        let c = decode_config(&gpu(
            json!({"strategy": "MPS", "mps": {"pinnedMemoryLimit": {"default": 1073741824}}}),
        ))
        .unwrap();
        let l = c
            .sharing()
            .unwrap()
            .mps
            .as_ref()
            .unwrap()
            .pinned_memory_limit
            .as_ref()
            .unwrap();
        assert_eq!(l.default.as_ref().unwrap().value(), 1 << 30);
    }

    // --- decoding: every error path ---

    #[test]
    fn top_level_errors() {
        assert_eq!(
            parse_err(json!([1])),
            "opaque parameters must be a JSON object, got array"
        );
        assert_eq!(
            parse_err(json!("GpuConfig")),
            "opaque parameters must be a JSON object, got string"
        );
        assert_eq!(
            parse_err(json!({"kind": "GpuConfig"})),
            "missing field `apiVersion`"
        );
        assert_eq!(
            parse_err(json!({"apiVersion": "gpu.cleave.dev/v1alpha1"})),
            "missing field `kind`"
        );
        assert_eq!(
            parse_err(json!({"apiVersion": "gpu.cleave.dev/v1", "kind": "GpuConfig"})),
            "apiVersion: unsupported value \"gpu.cleave.dev/v1\", expected \"gpu.cleave.dev/v1alpha1\""
        );
        assert_eq!(
            parse_err(json!({"apiVersion": 1, "kind": "GpuConfig"})),
            "apiVersion: invalid type: integer `1`, expected \"gpu.cleave.dev/v1alpha1\""
        );
        assert_eq!(
            parse_err(json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "TpuConfig"})),
            "kind: unsupported value \"TpuConfig\", expected \"GpuConfig\" or \"MigConfig\""
        );
        assert_eq!(
            parse_err(json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": null})),
            "kind: invalid type: null, expected \"GpuConfig\" or \"MigConfig\""
        );
        assert_eq!(
            parse_err(
                json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig", "shareing": {}})
            ),
            "shareing: unknown field `shareing`, expected one of `apiVersion`, `kind`, `sharing`"
        );
        assert_eq!(
            parse_err(
                json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "MigConfig", "sharing": 3})
            ),
            "sharing: invalid type: integer `3`, expected struct Sharing"
        );
    }

    #[test]
    fn sharing_errors() {
        assert_eq!(
            parse_err(gpu(json!({"strategy": 5}))),
            "sharing.strategy: invalid type: integer `5`, expected string or map"
        );
        assert_eq!(
            parse_err(gpu(
                json!({"strategy": "TimeSlicing", "timeSlicing": {"interval": 2}})
            )),
            "sharing.timeSlicing.interval: invalid type: integer `2`, expected string or map"
        );
        assert_eq!(
            parse_err(gpu(json!({}))),
            "sharing: missing field `strategy`"
        );
        assert_eq!(
            parse_err(gpu(json!({"strategy": "Mps"}))),
            "sharing.strategy: unknown variant `Mps`, expected `TimeSlicing` or `MPS`"
        );
        assert_eq!(
            parse_err(gpu(json!({"strategy": "MPS", "extra": 1}))),
            "sharing.extra: unknown field `extra`, expected one of `strategy`, `timeSlicing`, `mps`"
        );
        assert_eq!(
            parse_err(gpu(
                json!({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Huge"}})
            )),
            "sharing.timeSlicing.interval: unknown variant `Huge`, expected one of `Default`, `Short`, `Medium`, `Long`"
        );
        assert_eq!(
            parse_err(gpu(
                json!({"strategy": "TimeSlicing", "timeSlicing": {"intervall": "Long"}})
            )),
            "sharing.timeSlicing.intervall: unknown field `intervall`, expected `interval`"
        );
        assert_eq!(
            parse_err(gpu(json!({"strategy": "TimeSlicing", "timeSlicing": []}))),
            "sharing.timeSlicing: invalid type: sequence, expected a map"
        );
        assert_eq!(
            parse_err(gpu(json!(["MPS"]))),
            "sharing: invalid type: sequence, expected a map"
        );
    }

    #[test]
    fn mps_errors() {
        assert_eq!(
            parse_err(gpu(
                json!({"strategy": "MPS", "mps": {"activeThreadPercentage": "x"}})
            )),
            "sharing.mps.activeThreadPercentage: invalid type: string \"x\", expected u8"
        );
        assert_eq!(
            parse_err(gpu(
                json!({"strategy": "MPS", "mps": {"activeThreadPercentage": 300}})
            )),
            "sharing.mps.activeThreadPercentage: invalid value: integer `300`, expected u8"
        );
        assert_eq!(
            parse_err(gpu(
                json!({"strategy": "MPS", "mps": {"activeThreadPercentage": 2.5}})
            )),
            "sharing.mps.activeThreadPercentage: invalid type: floating point `2.5`, expected u8"
        );
        assert_eq!(
            parse_err(gpu(json!({"strategy": "MPS", "mps": {"threads": 5}}))),
            "sharing.mps.threads: unknown field `threads`, expected one of `activeThreadPercentage`, `pinnedMemoryLimit`, `multiUser`"
        );
        assert_eq!(
            parse_err(gpu(json!({"strategy": "MPS", "mps": {"multiUser": "yes"}}))),
            "sharing.mps.multiUser: invalid type: string \"yes\", expected a boolean"
        );
        let off = decode_config(&gpu(json!({"strategy": "MPS", "mps": {}}))).unwrap();
        assert!(
            !off.sharing()
                .and_then(|s| s.mps.as_ref())
                .is_some_and(MpsConfig::multi_user_or_default),
            "multiUser is off by default"
        );
        assert_eq!(
            parse_err(gpu(
                json!({"strategy": "MPS", "mps": {"pinnedMemoryLimit": "10Gi"}})
            )),
            "sharing.mps.pinnedMemoryLimit: invalid type: string \"10Gi\", expected struct PinnedMemoryLimit"
        );
        assert_eq!(
            parse_err(gpu(
                json!({"strategy": "MPS", "mps": {"pinnedMemoryLimit": {"default": "10GB"}}})
            )),
            "sharing.mps.pinnedMemoryLimit.default: invalid quantity \"10GB\": unknown suffix"
        );
        assert_eq!(
            parse_err(gpu(
                json!({"strategy": "MPS", "mps": {"pinnedMemoryLimit": {"default": "0.5"}}})
            )),
            "sharing.mps.pinnedMemoryLimit.default: invalid quantity \"0.5\": not a whole number of bytes"
        );
        assert_eq!(
            parse_err(gpu(
                json!({"strategy": "MPS", "mps": {"pinnedMemoryLimit": {"default": true}}})
            )),
            "sharing.mps.pinnedMemoryLimit.default: invalid type: boolean `true`, expected a Kubernetes quantity such as \"10Gi\""
        );
        assert_eq!(
            parse_err(gpu(
                json!({"strategy": "MPS", "mps": {"pinnedMemoryLimit": {"perDevice": {"1": "9Ei"}}}})
            )),
            "sharing.mps.pinnedMemoryLimit.perDevice.1: invalid quantity \"9Ei\": out of range"
        );
        assert_eq!(
            parse_err(gpu(
                json!({"strategy": "MPS", "mps": {"pinnedMemoryLimit": {"perDevice": ["1Gi"]}}})
            )),
            "sharing.mps.pinnedMemoryLimit.perDevice: invalid type: sequence, expected a map"
        );
        assert_eq!(
            parse_err(gpu(
                json!({"strategy": "MPS", "mps": {"pinnedMemoryLimit": {"max": "1Gi"}}})
            )),
            "sharing.mps.pinnedMemoryLimit.max: unknown field `max`, expected `default` or `perDevice`"
        );
    }

    // --- defaults ---

    #[test]
    fn defaults() {
        let mut c = parse_config(&gpu(json!({"strategy": "MPS"}))).unwrap();
        c.apply_defaults();
        let mps = c.sharing().unwrap().mps.clone().unwrap();
        assert_eq!(mps.active_thread_percentage, Some(100));
        assert_eq!(mps.pinned_memory_limit, None);

        let mut c = parse_config(&mig(json!({"strategy": "TimeSlicing"}))).unwrap();
        c.apply_defaults();
        let ts = c.sharing().unwrap().time_slicing.clone().unwrap();
        assert_eq!(ts.interval, Some(TimeSliceInterval::Default));

        let mut c =
            parse_config(&gpu(json!({"strategy": "TimeSlicing", "timeSlicing": {}}))).unwrap();
        c.apply_defaults();
        assert_eq!(
            c.sharing().unwrap().time_slicing.as_ref().unwrap().interval,
            Some(TimeSliceInterval::Default)
        );

        // Given values are kept; sharing absent stays absent (exclusive).
        let mut c = parse_config(&gpu(
            json!({"strategy": "MPS", "mps": {"activeThreadPercentage": 7}}),
        ))
        .unwrap();
        c.apply_defaults();
        assert_eq!(
            c.sharing()
                .unwrap()
                .mps
                .as_ref()
                .unwrap()
                .active_thread_percentage,
            Some(7)
        );
        let mut c = DeviceConfig::Gpu(GpuConfig::default());
        c.apply_defaults();
        assert_eq!(c, DeviceConfig::Gpu(GpuConfig { sharing: None }));

        // Defaulting does not hide the other strategy's block from validation.
        let mut c = parse_config(&gpu(json!({"strategy": "MPS", "timeSlicing": {}}))).unwrap();
        c.apply_defaults();
        assert!(c.sharing().unwrap().time_slicing.is_some());
        assert!(c.validate().is_err());

        // Accessors give the documented defaults without apply_defaults.
        assert_eq!(
            MpsConfig::default().active_thread_percentage_or_default(),
            100
        );
        assert_eq!(
            TimeSlicingConfig::default().interval_or_default(),
            TimeSliceInterval::Default
        );
    }

    // --- validation: one test per rule, exact messages ---

    #[test]
    fn rule_thread_percentage_range() {
        for bad in [0, 101, 255] {
            assert_eq!(
                decode_err(gpu(
                    json!({"strategy": "MPS", "mps": {"activeThreadPercentage": bad}})
                )),
                format!("sharing.mps.activeThreadPercentage: must be between 1 and 100, got {bad}")
            );
        }
        for good in [1, 50, 100] {
            decode_config(&gpu(
                json!({"strategy": "MPS", "mps": {"activeThreadPercentage": good}}),
            ))
            .unwrap();
        }
    }

    #[test]
    fn rule_memory_limits_positive() {
        assert_eq!(
            decode_err(gpu(
                json!({"strategy": "MPS", "mps": {"pinnedMemoryLimit": {"default": "0"}}})
            )),
            "sharing.mps.pinnedMemoryLimit.default: must be a positive quantity, got \"0\""
        );
        assert_eq!(
            decode_err(gpu(
                json!({"strategy": "MPS", "mps": {"pinnedMemoryLimit": {"default": "-1Gi"}}})
            )),
            "sharing.mps.pinnedMemoryLimit.default: must be a positive quantity, got \"-1Gi\""
        );
        assert_eq!(
            decode_err(gpu(
                json!({"strategy": "MPS", "mps": {"pinnedMemoryLimit": {"default": "1Gi", "perDevice": {UUID: "-5Mi"}}}})
            )),
            format!(
                "sharing.mps.pinnedMemoryLimit.perDevice.{UUID}: must be a positive quantity, got \"-5Mi\""
            )
        );
        assert_eq!(
            decode_err(gpu(
                json!({"strategy": "MPS", "mps": {"pinnedMemoryLimit": {"perDevice": {"0": 0}}}})
            )),
            "sharing.mps.pinnedMemoryLimit.perDevice.0: must be a positive quantity, got \"0\""
        );
    }

    #[test]
    fn rule_strategies_do_not_mix() {
        assert_eq!(
            decode_err(gpu(
                json!({"strategy": "MPS", "timeSlicing": {"interval": "Long"}})
            )),
            "sharing.timeSlicing: must not be set when sharing.strategy is MPS"
        );
        assert_eq!(
            decode_err(mig(
                json!({"strategy": "TimeSlicing", "mps": {"activeThreadPercentage": 10}})
            )),
            "sharing.mps: must not be set when sharing.strategy is TimeSlicing"
        );
    }

    #[test]
    fn rule_device_keys_well_formed() {
        for bad in [
            "gpu-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0",
            "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f",
            "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1fg",
            "GPU-0f1e2d3c4b5a-6978-8796-a5b4c3d2e1f0",
            "MIG-GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0/1/0",
            "01",
            "-1",
            "+1",
            "1.0",
            "",
            "4294967296",
            "gpu-0",
        ] {
            assert_eq!(
                decode_err(gpu(
                    json!({"strategy": "MPS", "mps": {"pinnedMemoryLimit": {"perDevice": {bad: "1Gi"}}}})
                )),
                format!(
                    "sharing.mps.pinnedMemoryLimit.perDevice: invalid device key {bad:?}, expected GPU-<uuid>, MIG-<uuid> or a decimal index"
                ),
                "{bad}"
            );
        }
        for good in [
            UUID,
            MIG_UUID,
            "GPU-0F1E2D3C-4B5A-6978-8796-A5B4C3D2E1F0",
            "0",
            "7",
            "4294967295",
        ] {
            decode_config(&gpu(json!({"strategy": "MPS", "mps": {"pinnedMemoryLimit": {"perDevice": {good: "1Gi"}}}})))
                .unwrap_or_else(|e| panic!("{good}: {e}"));
        }
    }

    #[test]
    fn rule_mig_interval_is_default() {
        assert_eq!(
            decode_err(mig(
                json!({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Short"}})
            )),
            "sharing.timeSlicing.interval: MIG devices use their parent GPU's time slice, only Default is allowed, got Short"
        );
        decode_config(&mig(
            json!({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Default"}}),
        ))
        .unwrap();
        decode_config(&gpu(
            json!({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Short"}}),
        ))
        .unwrap();
    }

    #[test]
    fn validation_reports_first_rule_in_documented_order() {
        // Conflict comes before ranges.
        assert_eq!(
            decode_err(gpu(
                json!({"strategy": "TimeSlicing", "mps": {"activeThreadPercentage": 0}})
            )),
            "sharing.mps: must not be set when sharing.strategy is TimeSlicing"
        );
        // Keys are checked in key order; "0" sorts before "GPU-".
        assert_eq!(
            decode_err(gpu(
                json!({"strategy": "MPS", "mps": {"pinnedMemoryLimit": {"perDevice": {"GPU-x": "1Gi", "0": "0"}}}})
            )),
            "sharing.mps.pinnedMemoryLimit.perDevice.0: must be a positive quantity, got \"0\""
        );
    }

    // --- application ---

    #[test]
    fn kind_mismatch_is_an_apply_error() {
        let g = decode_config(&gpu(json!({"strategy": "MPS"}))).unwrap();
        assert_eq!(
            g.sharing_for(DeviceKind::Gpu).unwrap().unwrap().strategy,
            SharingStrategy::Mps
        );
        assert_eq!(
            g.sharing_for(DeviceKind::Mig).unwrap_err().to_string(),
            "GpuConfig cannot be applied to a MIG device"
        );
        let m = decode_config(&mig(json!(null))).unwrap();
        assert_eq!(m.sharing_for(DeviceKind::Mig), Ok(None));
        assert_eq!(
            m.sharing_for(DeviceKind::Gpu).unwrap_err().to_string(),
            "MigConfig cannot be applied to a GPU device"
        );
        assert_eq!(DeviceKind::from(&DeviceName::gpu(0)), DeviceKind::Gpu);
        assert_eq!(
            DeviceKind::from(&DeviceName::mig(0, "1g.10gb", 0)),
            DeviceKind::Mig
        );
    }

    #[test]
    fn per_device_limit_lookup() {
        let l = PinnedMemoryLimit {
            default: Some(q("10Gi")),
            per_device: [(UUID.to_owned(), q("20Gi")), ("1".to_owned(), q("5Gi"))]
                .into_iter()
                .collect(),
        };
        // UUID wins over index, case-insensitively.
        assert_eq!(l.limit_for(&UUID.to_uppercase(), 1), Some(&q("20Gi")));
        assert_eq!(
            l.limit_for("GPU-ffffffff-ffff-ffff-ffff-ffffffffffff", 1),
            Some(&q("5Gi"))
        );
        assert_eq!(
            l.limit_for("GPU-ffffffff-ffff-ffff-ffff-ffffffffffff", 0),
            Some(&q("10Gi"))
        );
        let none = PinnedMemoryLimit::default();
        assert_eq!(none.limit_for(UUID, 0), None);
        assert_eq!(DeviceKey::parse("12"), Some(DeviceKey::Index(12)));
        assert_eq!(DeviceKey::parse(MIG_UUID), Some(DeviceKey::Uuid(MIG_UUID)));
    }

    #[test]
    fn device_config_deserialize_is_strict() {
        let c: DeviceConfig = serde_json::from_value(mig(json!({"strategy": "MPS"}))).unwrap();
        assert_eq!(c.kind_name(), "MigConfig");
        let e = serde_json::from_value::<DeviceConfig>(mig(json!({"strategy": "MPS", "x": 1})))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "sharing.x: unknown field `x`, expected one of `strategy`, `timeSlicing`, `mps`"
        );
        // A GpuConfig alone also checks its tags.
        let e = serde_json::from_value::<GpuConfig>(
            json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "MigConfig"}),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid value: string \"MigConfig\", expected \"GpuConfig\""
        );
    }

    #[test]
    fn sharing_labels_name_each_strategy_and_exclusive() {
        assert_eq!(sharing_label(None), "exclusive");
        assert_eq!(sharing_label(Some(SharingStrategy::Mps)), "mps");
        assert_eq!(
            sharing_label(Some(SharingStrategy::TimeSlicing)),
            "time-slicing"
        );
    }

    #[test]
    fn set_values_win_over_defaults() {
        let ts = TimeSlicingConfig {
            interval: Some(TimeSliceInterval::Long),
        };
        assert_eq!(ts.interval_or_default(), TimeSliceInterval::Long);
        assert_eq!(
            TimeSlicingConfig::default().interval_or_default(),
            TimeSliceInterval::Default
        );
        let mps = MpsConfig {
            multi_user: Some(true),
            ..MpsConfig::default()
        };
        assert!(mps.multi_user_or_default());
        assert!(!MpsConfig::default().multi_user_or_default());
    }

    #[test]
    fn values_are_described_as_serde_describes_them() {
        assert_eq!(describe(&json!(1.5)), "floating point `1.5`");
        assert_eq!(describe(&json!(7)), "integer `7`");
        assert_eq!(describe(&json!(true)), "boolean `true`");
        assert_eq!(describe(&json!("x")), "string \"x\"");
        assert_eq!(describe(&json!([1])), "sequence");
        assert_eq!(describe(&json!({})), "map");
        assert_eq!(describe(&Value::Null), "null");
    }
}
