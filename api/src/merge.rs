//! Which config applies to which request of one allocated claim.
//!
//! The API server copies every config that may matter into
//! `status.allocation.devices.config[]`: the DeviceClass configs (`FromClass`) and the claim's
//! own (`FromClaim`), for all drivers. For one driver the rule is:
//!
//! - only opaque configs whose `driver` is this driver count;
//! - class configs come before claim configs; within each, the API server's order is kept;
//! - an entry applies to the requests it names, or to all requests when it names none; a
//!   name `req` also covers the subrequest results `req/<sub>`;
//! - the last entry that applies wins, as a whole (fields are not merged across entries).
//!
//! [`merge_configs`] applies the rule to decoded entries; [`decode_allocation_configs`],
//! [`resolve_allocation_configs`] and [`resolve_claim_configs`] start from the k8s-openapi
//! objects. Whether the winning config fits the allocated device (a `GpuConfig` on a MIG
//! device is an error) is checked when applying it: [`ResolvedConfig::sharing_for`].

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{DeviceAllocationConfiguration, ResourceClaim};
use serde::{Deserialize, Serialize};

use crate::config::{
    ApplyError, ConfigError, ConfigSource, DeviceConfig, DeviceKind, Sharing, decode_config,
};

/// One decoded config entry of an allocation, for this driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigEntry {
    /// Position in `status.allocation.devices.config` (all drivers counted), reported back
    /// in [`ResolvedConfig::index`] and in errors.
    pub index: usize,
    /// Class or claim.
    pub source: ConfigSource,
    /// Requests it applies to; empty means all.
    pub requests: Vec<String>,
    /// The decoded (defaulted, validated) config.
    pub config: DeviceConfig,
}

impl ConfigEntry {
    /// Whether this entry applies to the allocation result of `request` (`req` or `req/sub`).
    pub fn applies_to(&self, request: &str) -> bool {
        self.requests.is_empty()
            || self
                .requests
                .iter()
                .any(|named| request_matches(named, request))
    }
}

/// `named` covers `request` when equal, or when `named` is a main request and `request`
/// one of its subrequests.
fn request_matches(named: &str, request: &str) -> bool {
    named == request
        || (!named.contains('/')
            && request
                .strip_prefix(named)
                .is_some_and(|rest| rest.starts_with('/')))
}

/// The main request of an allocation result's request name: `req/sub` -> `req`.
pub fn base_request(request: &str) -> &str {
    request.split_once('/').map_or(request, |(main, _)| main)
}

/// The config that won for one request, and which entry it came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolvedConfig {
    /// Position of the winning entry in `status.allocation.devices.config`.
    pub index: usize,
    /// Where the winning entry came from.
    pub source: ConfigSource,
    /// The config to apply.
    pub config: DeviceConfig,
}

impl ResolvedConfig {
    /// The sharing to apply to a device of `kind` (`None`: exclusive); an error names the
    /// entry when the config is for the other device kind.
    pub fn sharing_for(&self, kind: DeviceKind) -> Result<Option<&Sharing>, ApplyError> {
        self.config
            .sharing_for(kind)
            .map_err(|_| ApplyError::EntryKindMismatch {
                index: self.index,
                from: self.source,
                config_kind: self.config.kind_name(),
                device_kind: kind,
            })
    }
}

/// Why the configs of an allocation could not be resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimConfigError {
    /// An entry for this driver failed to decode or validate.
    #[error("config entry {index} ({from}): {error}")]
    DecodeEntry {
        /// Position in `status.allocation.devices.config`.
        index: usize,
        /// Class or claim.
        from: ConfigSource,
        /// What was wrong.
        error: ConfigError,
    },
    /// An entry for this driver has a source this version does not know.
    #[error("config entry {index}: unknown source {value:?}, expected FromClass or FromClaim")]
    UnknownSource {
        /// Position in `status.allocation.devices.config`.
        index: usize,
        /// The source given.
        value: String,
    },
    /// The claim has no allocation.
    #[error("claim {claim} is not allocated")]
    NotAllocated {
        /// `namespace/name`.
        claim: String,
    },
}

/// The winning entry for one request, or `None` when no entry applies.
pub fn config_for_request(entries: &[ConfigEntry], request: &str) -> Option<ResolvedConfig> {
    // Claim entries outrank class entries; within a source the later entry wins.
    [ConfigSource::FromClaim, ConfigSource::FromClass]
        .into_iter()
        .find_map(|source| {
            entries
                .iter()
                .rev()
                .find(|e| e.source == source && e.applies_to(request))
        })
        .map(|e| ResolvedConfig {
            index: e.index,
            source: e.source,
            config: e.config.clone(),
        })
}

/// Applies the merge rule (module docs) for every request name of the allocation results
/// (`req` or `req/sub`). Every request appears in the answer, with `None` when no entry
/// applies (no config: exclusive use).
pub fn merge_configs<I, S>(
    entries: &[ConfigEntry],
    requests: I,
) -> BTreeMap<String, Option<ResolvedConfig>>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    requests
        .into_iter()
        .map(|r| {
            let r = r.as_ref();
            (r.to_owned(), config_for_request(entries, r))
        })
        .collect()
}

/// Keeps the opaque entries for `driver` and decodes them with
/// [`decode_config`], in the API server's order; other
/// drivers' entries and non-opaque entries are skipped. The first bad entry is the error.
pub fn decode_allocation_configs(
    driver: &str,
    configs: &[DeviceAllocationConfiguration],
) -> Result<Vec<ConfigEntry>, ClaimConfigError> {
    let mut entries = Vec::new();
    for (index, c) in configs.iter().enumerate() {
        let Some(opaque) = c.opaque.as_ref().filter(|o| o.driver == driver) else {
            continue;
        };
        let source: ConfigSource =
            c.source
                .parse()
                .map_err(|()| ClaimConfigError::UnknownSource {
                    index,
                    value: c.source.clone(),
                })?;
        let config =
            decode_config(&opaque.parameters.0).map_err(|error| ClaimConfigError::DecodeEntry {
                index,
                from: source,
                error,
            })?;
        entries.push(ConfigEntry {
            index,
            source,
            requests: c.requests.clone().unwrap_or_default(),
            config,
        });
    }
    Ok(entries)
}

/// [`decode_allocation_configs`] then [`merge_configs`].
pub fn resolve_allocation_configs<I, S>(
    driver: &str,
    configs: &[DeviceAllocationConfiguration],
    requests: I,
) -> Result<BTreeMap<String, Option<ResolvedConfig>>, ClaimConfigError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let entries = decode_allocation_configs(driver, configs)?;
    Ok(merge_configs(&entries, requests))
}

/// The effective config of every request of an allocated claim that has results for
/// `driver`, keyed by the results' request names (`req` or `req/sub`).
///
/// How the driver finds the sharing to set up for one allocated device:
///
/// ```
/// use cleave_api::names::DRIVER_NAME;
/// use cleave_api::{DeviceKind, DeviceName, SharingStrategy, resolve_claim_configs};
/// use k8s_openapi::api::resource::v1::ResourceClaim;
///
/// let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
///     "metadata": {"name": "c", "namespace": "ns"},
///     "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.cleave.dev"}}]}},
///     "status": {"allocation": {"devices": {
///         "results": [{"request": "gpu", "driver": "gpu.cleave.dev", "pool": "node-1", "device": "gpu-0"}],
///         "config": [{"source": "FromClaim", "opaque": {"driver": "gpu.cleave.dev", "parameters": {
///             "apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
///             "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 25}}}}}]
///     }}}
/// }))?;
///
/// let configs = resolve_claim_configs(&claim, DRIVER_NAME)?; // decode + default + validate + merge
/// let device: DeviceName = "gpu-0".parse()?; // from the allocation result of request "gpu"
/// let sharing = match configs.get("gpu") {
///     Some(Some(resolved)) => resolved.sharing_for(DeviceKind::from(&device))?,
///     _ => None, // no config for this request: exclusive use
/// };
/// let mps = sharing.and_then(|s| s.mps.as_ref()).expect("MPS");
/// assert_eq!(sharing.map(|s| s.strategy), Some(SharingStrategy::Mps));
/// assert_eq!(mps.active_thread_percentage_or_default(), 25);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn resolve_claim_configs(
    claim: &ResourceClaim,
    driver: &str,
) -> Result<BTreeMap<String, Option<ResolvedConfig>>, ClaimConfigError> {
    let devices = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .ok_or_else(|| ClaimConfigError::NotAllocated {
            claim: format!(
                "{}/{}",
                claim.metadata.namespace.as_deref().unwrap_or_default(),
                claim.metadata.name.as_deref().unwrap_or_default()
            ),
        })?;
    let requests = devices
        .results
        .iter()
        .flatten()
        .filter(|r| r.driver == driver)
        .map(|r| r.request.as_str());
    resolve_allocation_configs(
        driver,
        devices.config.as_deref().unwrap_or_default(),
        requests,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{
        GpuConfig, MigConfig, SharingStrategy, TimeSliceInterval, TimeSlicingConfig,
    };
    use k8s_openapi::api::resource::v1::OpaqueDeviceConfiguration;
    use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
    use serde_json::json;

    fn ts(interval: TimeSliceInterval) -> DeviceConfig {
        DeviceConfig::Gpu(GpuConfig {
            sharing: Some(Sharing {
                strategy: SharingStrategy::TimeSlicing,
                time_slicing: Some(TimeSlicingConfig {
                    interval: Some(interval),
                }),
                mps: None,
            }),
        })
    }

    fn entry(
        index: usize,
        source: ConfigSource,
        requests: &[&str],
        c: DeviceConfig,
    ) -> ConfigEntry {
        ConfigEntry {
            index,
            source,
            requests: requests.iter().map(|s| s.to_string()).collect(),
            config: c,
        }
    }

    fn winner(m: &BTreeMap<String, Option<ResolvedConfig>>, r: &str) -> Option<usize> {
        m.get(r)
            .unwrap_or_else(|| panic!("{r} missing"))
            .as_ref()
            .map(|c| c.index)
    }

    #[test]
    fn claim_beats_class_whatever_the_order() {
        use ConfigSource::*;
        // A claim entry given before a class entry still wins.
        let entries = [
            entry(0, FromClaim, &[], ts(TimeSliceInterval::Long)),
            entry(1, FromClass, &["a"], ts(TimeSliceInterval::Short)),
        ];
        let m = merge_configs(&entries, ["a", "b"]);
        assert_eq!(winner(&m, "a"), Some(0));
        assert_eq!(winner(&m, "b"), Some(0));
        assert_eq!(m["a"].as_ref().unwrap().source, FromClaim);
    }

    #[test]
    fn later_wins_within_a_source_and_names_select() {
        use ConfigSource::*;
        let entries = [
            entry(0, FromClass, &["a"], ts(TimeSliceInterval::Short)),
            entry(1, FromClass, &["a", "b"], ts(TimeSliceInterval::Medium)),
            entry(2, FromClaim, &["b"], ts(TimeSliceInterval::Long)),
            entry(3, FromClaim, &["c"], ts(TimeSliceInterval::Default)),
            entry(4, FromClaim, &["c"], ts(TimeSliceInterval::Short)),
        ];
        let m = merge_configs(&entries, ["a", "b", "c", "d"]);
        assert_eq!(winner(&m, "a"), Some(1));
        assert_eq!(winner(&m, "b"), Some(2));
        assert_eq!(winner(&m, "c"), Some(4));
        assert_eq!(winner(&m, "d"), None);
        assert_eq!(m.len(), 4);
    }

    #[test]
    fn main_request_names_cover_subrequests() {
        use ConfigSource::*;
        let entries = [
            entry(0, FromClaim, &["gpu"], ts(TimeSliceInterval::Short)),
            entry(1, FromClass, &["mig/small"], ts(TimeSliceInterval::Long)),
        ];
        let m = merge_configs(
            &entries,
            ["gpu/big", "gpu", "gpus/x", "mig/small", "mig/large", "mig"],
        );
        assert_eq!(winner(&m, "gpu/big"), Some(0));
        assert_eq!(winner(&m, "gpu"), Some(0));
        assert_eq!(winner(&m, "gpus/x"), None);
        assert_eq!(winner(&m, "mig/small"), Some(1));
        assert_eq!(winner(&m, "mig/large"), None);
        assert_eq!(winner(&m, "mig"), None);
        assert_eq!(base_request("gpu/big"), "gpu");
        assert_eq!(base_request("gpu"), "gpu");
    }

    #[test]
    fn no_entries_means_no_config() {
        let m = merge_configs(&[], ["a"]);
        assert_eq!(m.get("a"), Some(&None));
    }

    fn alloc(
        source: &str,
        driver: &str,
        requests: Option<&[&str]>,
        params: serde_json::Value,
    ) -> DeviceAllocationConfiguration {
        DeviceAllocationConfiguration {
            opaque: Some(OpaqueDeviceConfiguration {
                driver: driver.to_owned(),
                parameters: RawExtension(params),
            }),
            requests: requests.map(|r| r.iter().map(|s| s.to_string()).collect()),
            source: source.to_owned(),
        }
    }

    fn mps(pct: u32) -> serde_json::Value {
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
               "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": pct}}})
    }

    #[test]
    fn k8s_entries_are_filtered_decoded_and_indexed() {
        let configs = [
            alloc(
                "FromClass",
                "other.example.com",
                None,
                json!({"anything": true}),
            ),
            alloc("FromClass", "gpu.cleave.dev", Some(&["a"]), mps(50)),
            DeviceAllocationConfiguration {
                opaque: None,
                requests: None,
                source: "FromClaim".to_owned(),
            },
            alloc("FromClaim", "gpu.cleave.dev", Some(&[]), mps(10)),
            alloc(
                "FromClaim",
                "other.example.com",
                None,
                json!("not even an object"),
            ),
        ];
        let entries = decode_allocation_configs("gpu.cleave.dev", &configs).unwrap();
        assert_eq!(
            entries
                .iter()
                .map(|e| (e.index, e.source))
                .collect::<Vec<_>>(),
            [(1, ConfigSource::FromClass), (3, ConfigSource::FromClaim)]
        );
        assert!(entries[1].requests.is_empty());
        let m = resolve_allocation_configs("gpu.cleave.dev", &configs, ["a", "b"]).unwrap();
        assert_eq!(winner(&m, "a"), Some(3));
        let s = m["b"]
            .as_ref()
            .unwrap()
            .sharing_for(DeviceKind::Gpu)
            .unwrap()
            .unwrap();
        assert_eq!(s.mps.as_ref().unwrap().active_thread_percentage, Some(10));
    }

    #[test]
    fn k8s_errors_name_the_entry() {
        let configs = [
            alloc("FromClass", "gpu.cleave.dev", None, mps(50)),
            alloc("FromClaim", "gpu.cleave.dev", None, mps(0)),
        ];
        assert_eq!(
            decode_allocation_configs("gpu.cleave.dev", &configs)
                .unwrap_err()
                .to_string(),
            "config entry 1 (FromClaim): sharing.mps.activeThreadPercentage: must be between 1 and 100, got 0"
        );
        let configs = [alloc(
            "FromClaim",
            "gpu.cleave.dev",
            None,
            json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": "x"}}}),
        )];
        assert_eq!(
            decode_allocation_configs("gpu.cleave.dev", &configs)
                .unwrap_err()
                .to_string(),
            "config entry 0 (FromClaim): sharing.mps.activeThreadPercentage: invalid type: string \"x\", expected u8"
        );
        let configs = [
            alloc("FromElsewhere", "other.example.com", None, mps(50)),
            alloc("FromElsewhere", "gpu.cleave.dev", None, mps(50)),
        ];
        assert_eq!(
            decode_allocation_configs("gpu.cleave.dev", &configs)
                .unwrap_err()
                .to_string(),
            "config entry 1: unknown source \"FromElsewhere\", expected FromClass or FromClaim"
        );
    }

    #[test]
    fn wrong_kind_for_device_is_an_error_naming_the_entry() {
        let r = ResolvedConfig {
            index: 2,
            source: ConfigSource::FromClass,
            config: DeviceConfig::Mig(MigConfig::default()),
        };
        assert_eq!(
            r.sharing_for(DeviceKind::Gpu).unwrap_err().to_string(),
            "config entry 2 (FromClass): MigConfig cannot be applied to a GPU device"
        );
        assert_eq!(r.sharing_for(DeviceKind::Mig), Ok(None));
    }

    #[test]
    fn unallocated_claim_is_an_error() {
        let mut claim = ResourceClaim::default();
        claim.metadata.namespace = Some("ns".into());
        claim.metadata.name = Some("c".into());
        assert_eq!(
            resolve_claim_configs(&claim, "gpu.cleave.dev")
                .unwrap_err()
                .to_string(),
            "claim ns/c is not allocated"
        );
    }

    #[test]
    fn source_strings_round_trip() {
        for s in [ConfigSource::FromClass, ConfigSource::FromClaim] {
            assert_eq!(s.as_str().parse::<ConfigSource>(), Ok(s));
            assert_eq!(serde_json::to_value(s).unwrap(), json!(s.as_str()));
        }
        assert_eq!("fromClass".parse::<ConfigSource>(), Err(()));
    }
}
