//! `ResourceClaim.status.devices` on update (KEP-4817), as the stand-in checks it: written
//! from kubernetes `pkg/apis/resource/validation/validation.go` (`validateDeviceStatus`,
//! `validateRawExtension`, `validateResourceClaimStatusUpdate`) and
//! `pkg/registry/resource/resourceclaim/strategy.go` (`dropDeallocatedStatusDevices`), with
//! the limits of [`crate::limits`]. Not checked: authorization (`resourceclaims/driver`
//! with `associated-node:` verbs needs identities the stand-in does not have), and
//! `networkData.ips` CIDR syntax beyond its count.

use serde_json::Value;

use crate::limits;
use crate::validate::{FieldError, FieldErrorKind};

/// Entries of a claim whose allocation is gone are dropped before validation, as the API
/// server's status strategy does; returns true when it dropped any.
pub fn drop_deallocated(new: &mut Value) -> bool {
    let Some(status) = new.get_mut("status").and_then(Value::as_object_mut) else {
        return false;
    };
    let allocated = status.get("allocation").is_some_and(|a| !a.is_null());
    if !allocated && status.get("devices").is_some_and(|d| !d.is_null()) {
        status.remove("devices");
        return true;
    }
    false
}

/// Errors of `status.devices` of `claim`, as a status update would get them.
pub fn status_devices_errors(claim: &Value) -> Vec<FieldError> {
    let mut errs = Vec::new();
    let Some(devices) = claim.pointer("/status/devices").and_then(Value::as_array) else {
        return errs;
    };
    let allocated: Vec<(String, String, String, Option<String>)> = claim
        .pointer("/status/allocation/devices/results")
        .and_then(Value::as_array)
        .map(|results| results.iter().map(key).collect())
        .unwrap_or_default();
    let mut seen = Vec::new();
    for (i, d) in devices.iter().enumerate() {
        let path = format!("status.devices[{i}]");
        for field in ["driver", "pool", "device"] {
            if d.get(field)
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
            {
                errs.push(FieldError::required(&format!("{path}.{field}"), ""));
            }
        }
        if let Some(share) = d.get("shareID").and_then(Value::as_str)
            && !is_uuid(share)
        {
            errs.push(FieldError::invalid(
                &format!("{path}.shareID"),
                format!("{share:?}"),
                "must be a lowercase UUID in 8-4-4-4-12 format",
            ));
        }
        let k = key(d);
        if seen.contains(&k) {
            errs.push(FieldError {
                field: path.clone(),
                kind: FieldErrorKind::Duplicate,
                value: Some(format!("{k:?}")),
                detail: String::new(),
            });
        } else if !allocated.contains(&k) {
            errs.push(FieldError::invalid(
                &path,
                format!("{k:?}"),
                "must be an allocated device in the claim",
            ));
        }
        seen.push(k);
        errs.extend(condition_errors(&path, d.get("conditions")));
        if let Some(data) = d.get("data").filter(|v| !v.is_null()) {
            let field = format!("{path}.data");
            match data.as_object() {
                Some(o) if !o.is_empty() => {
                    let len = serde_json::to_string(data).map_or(0, |s| s.len());
                    if len > limits::ALLOCATED_DEVICE_STATUS_DATA_MAX_LENGTH {
                        errs.push(FieldError {
                            field,
                            kind: FieldErrorKind::TooLong,
                            value: None,
                            detail: format!(
                                "may not be longer than {} bytes",
                                limits::ALLOCATED_DEVICE_STATUS_DATA_MAX_LENGTH
                            ),
                        });
                    }
                }
                _ => errs.push(FieldError::invalid(
                    &field,
                    "<value omitted>".into(),
                    "parameters must be a valid JSON object",
                )),
            }
        }
        errs.extend(network_errors(&path, d.get("networkData")));
    }
    errs
}

fn key(v: &Value) -> (String, String, String, Option<String>) {
    let s = |f: &str| {
        v.get(f)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    (
        s("driver"),
        s("pool"),
        s("device"),
        v.get("shareID").and_then(Value::as_str).map(str::to_owned),
    )
}

fn is_uuid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')))
}

fn condition_errors(path: &str, conditions: Option<&Value>) -> Vec<FieldError> {
    let mut errs = Vec::new();
    let Some(list) = conditions.and_then(Value::as_array) else {
        return errs;
    };
    let field = format!("{path}.conditions");
    if list.len() > limits::ALLOCATED_DEVICE_STATUS_MAX_CONDITIONS {
        errs.push(FieldError {
            field: field.clone(),
            kind: FieldErrorKind::TooMany,
            value: Some(list.len().to_string()),
            detail: format!(
                "must have at most {} items",
                limits::ALLOCATED_DEVICE_STATUS_MAX_CONDITIONS
            ),
        });
    }
    let mut types = Vec::new();
    for (j, c) in list.iter().enumerate() {
        let f = |name: &str| format!("{field}[{j}].{name}");
        let text = |name: &str| c.get(name).and_then(Value::as_str).unwrap_or_default();
        let type_ = text("type");
        if type_.is_empty() {
            errs.push(FieldError::required(&f("type"), ""));
        } else if types.contains(&type_) {
            errs.push(FieldError {
                field: f("type"),
                kind: FieldErrorKind::Duplicate,
                value: Some(format!("{type_:?}")),
                detail: String::new(),
            });
        }
        types.push(type_);
        if !matches!(text("status"), "True" | "False" | "Unknown") {
            errs.push(FieldError {
                field: f("status"),
                kind: FieldErrorKind::NotSupported,
                value: Some(format!("{:?}", text("status"))),
                detail: "supported values: \"False\", \"True\", \"Unknown\"".into(),
            });
        }
        let reason = text("reason");
        if reason.is_empty() {
            errs.push(FieldError::required(
                &f("reason"),
                "reason must be non-empty",
            ));
        } else if !is_reason(reason) {
            errs.push(FieldError::invalid(
                &f("reason"),
                format!("{reason:?}"),
                "a condition reason must start with alphabetic character, optionally followed by a string of alphanumeric characters or '_,:', and must end with an alphanumeric character or '_'",
            ));
        }
        if text("lastTransitionTime").is_empty() {
            errs.push(FieldError::required(
                &f("lastTransitionTime"),
                "must be set",
            ));
        }
        if text("message").len() > 32768 {
            errs.push(FieldError {
                field: f("message"),
                kind: FieldErrorKind::TooLong,
                value: None,
                detail: "may not be more than 32768 bytes".into(),
            });
        }
    }
    errs
}

fn is_reason(r: &str) -> bool {
    let mut chars = r.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && r.len() <= 1024
        && r.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | ',' | ':'))
        && r.chars()
            .last()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn network_errors(path: &str, data: Option<&Value>) -> Vec<FieldError> {
    let mut errs = Vec::new();
    let Some(n) = data.filter(|v| !v.is_null()) else {
        return errs;
    };
    let field = format!("{path}.networkData");
    let too_long = |name: &str, max: usize| {
        let v = n.get(name).and_then(Value::as_str).unwrap_or_default();
        (v.len() > max).then(|| FieldError {
            field: format!("{field}.{name}"),
            kind: FieldErrorKind::TooLong,
            value: None,
            detail: format!("may not be more than {max} bytes"),
        })
    };
    errs.extend(too_long(
        "interfaceName",
        limits::NETWORK_DEVICE_DATA_INTERFACE_NAME_MAX_LENGTH,
    ));
    errs.extend(too_long(
        "hardwareAddress",
        limits::NETWORK_DEVICE_DATA_HARDWARE_ADDRESS_MAX_LENGTH,
    ));
    if let Some(ips) = n.get("ips").and_then(Value::as_array)
        && ips.len() > limits::NETWORK_DEVICE_DATA_MAX_IPS
    {
        errs.push(FieldError {
            field: format!("{field}.ips"),
            kind: FieldErrorKind::TooMany,
            value: Some(ips.len().to_string()),
            detail: format!(
                "must have at most {} items",
                limits::NETWORK_DEVICE_DATA_MAX_IPS
            ),
        });
    }
    errs
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim(devices: Value) -> Value {
        json!({"status": {
            "allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "d", "pool": "p", "device": "gpu-0"},
                {"request": "s", "driver": "d", "pool": "p", "device": "gpu-1",
                 "shareID": "5a000000-0000-4000-8000-00000000000a"}]}},
            "devices": devices}})
    }

    fn cond(t: &str) -> Value {
        json!({"type": t, "status": "True", "reason": "Ok", "message": "",
               "lastTransitionTime": "2026-01-01T00:00:00Z"})
    }

    #[test]
    fn allocated_entries_with_valid_data_pass() {
        let c = claim(json!([
            {"driver": "d", "pool": "p", "device": "gpu-0", "conditions": [cond("Ready")],
             "data": {"uuid": "GPU-0"}},
            {"driver": "d", "pool": "p", "device": "gpu-1",
             "shareID": "5a000000-0000-4000-8000-00000000000a"},
        ]));
        assert_eq!(status_devices_errors(&c), Vec::<FieldError>::new());
    }

    #[test]
    fn unallocated_duplicate_and_oversized_entries_fail() {
        let nine: Vec<Value> = (0..9).map(|i| cond(&format!("C{i}"))).collect();
        let c = claim(json!([
            {"driver": "d", "pool": "p", "device": "gpu-7"},
            {"driver": "d", "pool": "p", "device": "gpu-0", "conditions": nine},
            {"driver": "d", "pool": "p", "device": "gpu-0", "data": [1]},
            {"driver": "d", "pool": "p", "device": "gpu-1", "shareID": "5a000000-0000-4000-8000-00000000000a",
             "data": {"x": "y".repeat(10 * 1024)}},
        ]));
        let errs: Vec<String> = status_devices_errors(&c)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert!(
            errs[0].contains("must be an allocated device in the claim"),
            "{errs:?}"
        );
        assert!(
            errs.iter().any(|e| e.contains("conditions: Too many")),
            "{errs:?}"
        );
        assert!(errs.iter().any(|e| e.contains("Duplicate")), "{errs:?}");
        assert!(errs.iter().any(|e| e.contains("JSON object")), "{errs:?}");
        assert!(
            errs.iter().any(|e| e.contains("data: Too long")),
            "{errs:?}"
        );
    }

    #[test]
    fn deallocated_claims_lose_their_entries() {
        let mut c = json!({"status": {"devices": [{"driver": "d"}]}});
        assert!(drop_deallocated(&mut c));
        assert!(c["status"].get("devices").is_none());
    }
}
