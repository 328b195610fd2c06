//! ResourceSlice validation as the API server does it (kubernetes
//! `pkg/apis/resource/validation/validation.go`, limits from the stand-in's own upstream
//! table in [`crate::limits`]), for 1.34 and 1.35+ rules. Messages follow apimachinery's field errors:
//! `spec.devices[3].name: Invalid value: "X": a lowercase RFC 1123 label must ...`.

use std::collections::{BTreeMap, BTreeSet};

use crate::limits;
use serde_json::{Map, Value};

use crate::KubeVersion;

/// Kind of a field error, as in apimachinery's `field.ErrorType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldErrorKind {
    /// `Required value`.
    Required,
    /// `Invalid value`.
    Invalid,
    /// `Duplicate value`.
    Duplicate,
    /// `Too many`.
    TooMany,
    /// `Too long`.
    TooLong,
    /// `Forbidden`.
    Forbidden,
    /// `Unsupported value`.
    NotSupported,
}

impl FieldErrorKind {
    /// `Status.details.causes[].reason`.
    pub fn reason(self) -> &'static str {
        match self {
            FieldErrorKind::Required => "FieldValueRequired",
            FieldErrorKind::Invalid => "FieldValueInvalid",
            FieldErrorKind::Duplicate => "FieldValueDuplicate",
            FieldErrorKind::TooMany => "FieldValueTooMany",
            FieldErrorKind::TooLong => "FieldValueTooLong",
            FieldErrorKind::Forbidden => "FieldValueForbidden",
            FieldErrorKind::NotSupported => "FieldValueNotSupported",
        }
    }

    fn label(self) -> &'static str {
        match self {
            FieldErrorKind::Required => "Required value",
            FieldErrorKind::Invalid => "Invalid value",
            FieldErrorKind::Duplicate => "Duplicate value",
            FieldErrorKind::TooMany => "Too many",
            FieldErrorKind::TooLong => "Too long",
            FieldErrorKind::Forbidden => "Forbidden",
            FieldErrorKind::NotSupported => "Unsupported value",
        }
    }
}

/// One validation error on a field path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Field path, e.g. `spec.devices[3].name`.
    pub field: String,
    /// Error kind.
    pub kind: FieldErrorKind,
    /// Offending value rendered as the Go server would (`"x"`, `129`), if shown.
    pub value: Option<String>,
    /// Explanation.
    pub detail: String,
}

impl FieldError {
    /// `Required value`.
    pub fn required(field: &str, detail: &str) -> Self {
        FieldError {
            field: field.into(),
            kind: FieldErrorKind::Required,
            value: None,
            detail: detail.into(),
        }
    }

    /// `Invalid value: <value>: detail`.
    pub fn invalid(field: &str, value: String, detail: &str) -> Self {
        FieldError {
            field: field.into(),
            kind: FieldErrorKind::Invalid,
            value: Some(value),
            detail: detail.into(),
        }
    }

    /// The message without the field path (`Invalid value: "x": ...`).
    pub fn message(&self) -> String {
        let mut s = self.kind.label().to_string();
        if let Some(v) = &self.value {
            s.push_str(": ");
            s.push_str(v);
        }
        if !self.detail.is_empty() {
            s.push_str(": ");
            s.push_str(&self.detail);
        }
        s
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message())
    }
}

const DNS_LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const DNS_SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const C_IDENTIFIER_MSG: &str = "a valid C identifier must start with alphabetic character or '_', followed by a string of alphanumeric characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used for validation is '[A-Za-z_][A-Za-z0-9_]*')";
const SEMVER_MSG: &str = "must be a string compatible with semver.org spec 2.0.0";
const NODE_FIELDS: &str =
    "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required";
const DEVICE_NODE_FIELDS: &str = "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when `perDeviceNodeSelection` is set to true in the ResourceSlice spec";
const MAX_BINDING_CONDITIONS: usize = limits::BINDING_CONDITIONS_MAX_SIZE;
const MAX_ATTRIBUTE_VALUES_PER_DEVICE_1_36: usize =
    limits::RESOURCE_SLICE_MAX_ATTRIBUTE_VALUES_PER_DEVICE_1_36;
const MAX_TAINTS_PER_DEVICE_1_35: usize = limits::DEVICE_TAINTS_MAX_LENGTH_1_35;
const DNS_SUBDOMAIN_MAX: usize = limits::DNS1123_SUBDOMAIN_MAX_LENGTH;

/// Go `%q`-like rendering of a string value.
fn q(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\""))
}

fn is_dns_label_chars(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub fn is_dns_label(s: &str) -> bool {
    s.len() <= limits::DNS1123_LABEL_MAX_LENGTH && is_dns_label_chars(s)
}

/// RFC 1123 subdomain, at most 253 characters.
pub fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= DNS_SUBDOMAIN_MAX && s.split('.').all(is_dns_label_chars)
}

fn is_c_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn is_numeric_identifier(s: &str) -> bool {
    s == "0" || (!s.is_empty() && !s.starts_with('0') && s.bytes().all(|c| c.is_ascii_digit()))
}

/// semver.org 2.0.0 as the API server's `semverRe` checks it.
pub fn is_semver(s: &str) -> bool {
    let (rest, build) = match s.split_once('+') {
        Some((r, b)) => (r, Some(b)),
        None => (s, None),
    };
    let (core, pre) = match rest.split_once('-') {
        Some((c, p)) => (c, Some(p)),
        None => (rest, None),
    };
    let parts: Vec<&str> = core.split('.').collect();
    let ident =
        |p: &str| !p.is_empty() && p.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-');
    parts.len() == 3
        && parts.iter().all(|p| is_numeric_identifier(p))
        && pre.is_none_or(|p| {
            p.split('.').all(|id| {
                ident(id)
                    && (is_numeric_identifier(id)
                        || id.bytes().any(|c| c.is_ascii_alphabetic() || c == b'-'))
            })
        })
        && build.is_none_or(|b| b.split('.').all(ident))
}

struct Checker {
    version: KubeVersion,
    errs: Vec<FieldError>,
}

impl Checker {
    fn push(&mut self, field: &str, kind: FieldErrorKind, value: Option<String>, detail: &str) {
        self.errs.push(FieldError {
            field: field.to_string(),
            kind,
            value,
            detail: detail.to_string(),
        });
    }
    fn required(&mut self, field: &str, detail: &str) {
        self.push(field, FieldErrorKind::Required, None, detail);
    }
    fn invalid(&mut self, field: &str, value: String, detail: &str) {
        self.push(field, FieldErrorKind::Invalid, Some(value), detail);
    }
    fn too_many(&mut self, field: &str, n: usize, max: usize) {
        self.push(
            field,
            FieldErrorKind::TooMany,
            Some(n.to_string()),
            &format!("must have at most {max} items"),
        );
    }
    fn too_long(&mut self, field: &str, max: usize) {
        self.push(
            field,
            FieldErrorKind::TooLong,
            None,
            &format!("may not be more than {max} bytes"),
        );
    }
    fn duplicate(&mut self, field: &str, value: &str) {
        self.push(field, FieldErrorKind::Duplicate, Some(q(value)), "");
    }

    fn since(&self, minor: u32) -> bool {
        self.version.minor >= minor
    }

    fn dns_label(&mut self, field: &str, s: &str) {
        if s.len() > limits::DNS1123_LABEL_MAX_LENGTH {
            self.invalid(
                field,
                q(s),
                &format!(
                    "must be no more than {} characters",
                    limits::DNS1123_LABEL_MAX_LENGTH
                ),
            );
        }
        if !is_dns_label_chars(s) {
            self.invalid(field, q(s), DNS_LABEL_MSG);
        }
    }

    fn required_dns_label(&mut self, field: &str, s: Option<&str>) {
        match s {
            None | Some("") => self.required(field, ""),
            Some(s) => self.dns_label(field, s),
        }
    }

    fn dns_subdomain(&mut self, field: &str, s: &str) {
        if s.len() > DNS_SUBDOMAIN_MAX {
            self.invalid(
                field,
                q(s),
                &format!("must be no more than {DNS_SUBDOMAIN_MAX} characters"),
            );
        }
        if !s.split('.').all(is_dns_label_chars) {
            self.invalid(field, q(s), DNS_SUBDOMAIN_MSG);
        }
    }

    fn driver_name(&mut self, field: &str, name: Option<&str>) {
        let Some(name) = name.filter(|n| !n.is_empty()) else {
            return self.required(field, "");
        };
        if name.len() > limits::DRIVER_NAME_MAX_LENGTH {
            self.too_long(field, limits::DRIVER_NAME_MAX_LENGTH);
        }
        if !is_dns_subdomain(&name.to_lowercase()) {
            self.invalid(field, q(name), DNS_SUBDOMAIN_MSG);
        }
    }

    fn pool(&mut self, pool: Option<&Value>) {
        let Some(pool) = pool.filter(|p| p.is_object()) else {
            return self.required("spec.pool", "");
        };
        match pool.get("name").and_then(Value::as_str) {
            None | Some("") => self.required("spec.pool.name", ""),
            Some(name) => {
                if name.len() > limits::POOL_NAME_MAX_LENGTH {
                    self.too_long("spec.pool.name", limits::POOL_NAME_MAX_LENGTH);
                }
                for part in name.split('/') {
                    if !is_dns_subdomain(part) {
                        self.invalid("spec.pool.name", q(part), DNS_SUBDOMAIN_MSG);
                    }
                }
            }
        }
        let count = pool
            .get("resourceSliceCount")
            .and_then(Value::as_i64)
            .unwrap_or(0);
        if count <= 0 {
            self.invalid(
                "spec.pool.resourceSliceCount",
                count.to_string(),
                "must be greater than zero",
            );
        }
        let generation = pool.get("generation").and_then(Value::as_i64).unwrap_or(0);
        if generation < 0 {
            self.invalid(
                "spec.pool.generation",
                generation.to_string(),
                "must be greater than or equal to zero",
            );
        }
    }

    fn node_selector(&mut self, field: &str, sel: &Value, exactly_one_term: bool) {
        let terms = sel.get("nodeSelectorTerms").and_then(Value::as_array);
        match terms {
            None => self.required(
                &format!("{field}.nodeSelectorTerms"),
                "must have at least one node selector term",
            ),
            Some(t) if exactly_one_term && t.len() != 1 => self.invalid(
                &format!("{field}.nodeSelectorTerms"),
                Value::Array(t.clone()).to_string(),
                "must have exactly one node selector term",
            ),
            Some(_) => {}
        }
    }

    /// Exactly-one-of node selection; `prefix` is `spec` (`slice_level`) or `spec.devices[i]`.
    fn node_selection(&mut self, prefix: &str, obj: &Map<String, Value>, slice_level: bool) {
        let mut set = Vec::new();
        if let Some(v) = obj.get("nodeName").filter(|v| !v.is_null()) {
            match v.as_str() {
                Some("") | None => {
                    let detail = if slice_level {
                        "must be either unset or set to a non-empty string"
                    } else {
                        "must not be empty"
                    };
                    self.invalid(
                        &format!("{prefix}.nodeName"),
                        q(v.as_str().unwrap_or_default()),
                        detail,
                    );
                }
                Some(name) => {
                    set.push("`nodeName`");
                    if !is_dns_subdomain(name) {
                        self.invalid(&format!("{prefix}.nodeName"), q(name), DNS_SUBDOMAIN_MSG);
                    }
                }
            }
        }
        if let Some(sel) = obj.get("nodeSelector").filter(|v| !v.is_null()) {
            set.push("`nodeSelector`");
            self.node_selector(&format!("{prefix}.nodeSelector"), sel, slice_level);
        }
        let flag =
            |this: &mut Self, key: &str, label: &'static str, set: &mut Vec<&'static str>| {
                if let Some(v) = obj.get(key).filter(|v| !v.is_null()) {
                    if v.as_bool() == Some(true) {
                        set.push(label);
                    } else {
                        this.invalid(
                            &format!("{prefix}.{key}"),
                            v.to_string(),
                            "must be either unset or set to true",
                        );
                    }
                }
            };
        flag(self, "allNodes", "`allNodes`", &mut set);
        if slice_level {
            flag(
                self,
                "perDeviceNodeSelection",
                "`perDeviceNodeSelection`",
                &mut set,
            );
        }
        let what = if slice_level {
            NODE_FIELDS
        } else {
            DEVICE_NODE_FIELDS
        };
        match set.len() {
            0 => self.required(prefix, what),
            1 => {}
            _ => {
                let detail = if slice_level {
                    format!("{what}, but multiple fields are set")
                } else {
                    what.to_string()
                };
                self.invalid(prefix, q(&format!("{{{}}}", set.join(", "))), &detail);
            }
        }
    }

    fn qualified_name(&mut self, field: &str, key: &str) {
        let (domain, id) = match key.split_once('/') {
            Some((d, i)) => (Some(d), i),
            None => (None, key),
        };
        if let Some(domain) = domain {
            if domain.is_empty() {
                self.required(field, "the domain must not be empty");
            } else {
                if domain.len() > limits::DEVICE_MAX_DOMAIN_LENGTH {
                    self.too_long(field, limits::DEVICE_MAX_DOMAIN_LENGTH);
                }
                if !is_dns_subdomain(&domain.to_lowercase()) {
                    self.invalid(field, q(domain), DNS_SUBDOMAIN_MSG);
                }
            }
        }
        if id.is_empty() {
            self.required(field, "the name must not be empty");
        } else {
            if id.len() > limits::DEVICE_MAX_ID_LENGTH {
                self.too_long(field, limits::DEVICE_MAX_ID_LENGTH);
            }
            if !is_c_identifier(id) {
                self.invalid(field, q(id), C_IDENTIFIER_MSG);
            }
        }
    }

    fn string_value(&mut self, field: &str, v: &Value) {
        match v.as_str() {
            Some(s) if s.len() > limits::DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH => {
                self.too_long(field, limits::DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH)
            }
            Some(_) => {}
            None => self.invalid(field, v.to_string(), "must be a string"),
        }
    }

    fn version_value(&mut self, field: &str, v: &Value) {
        match v.as_str() {
            Some(s) => {
                if !is_semver(s) {
                    self.invalid(field, q(s), SEMVER_MSG);
                }
                if s.len() > limits::DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH {
                    self.too_long(field, limits::DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH);
                }
            }
            None => self.invalid(field, v.to_string(), "must be a string"),
        }
    }

    /// Validates one attribute; returns how many values it holds.
    fn attribute(&mut self, field: &str, attr: &Value) -> usize {
        let Some(attr) = attr.as_object() else {
            self.invalid(field, attr.to_string(), "must be an object");
            return 0;
        };
        let present = |k: &str| attr.get(k).filter(|v| !v.is_null());
        let mut fields = 0;
        let mut values = 0;
        if let Some(v) = present("bool") {
            fields += 1;
            values += 1;
            if !v.is_boolean() {
                self.invalid(&format!("{field}.bool"), v.to_string(), "must be a boolean");
            }
        }
        if let Some(v) = present("int") {
            fields += 1;
            values += 1;
            if !v.is_i64() {
                self.invalid(
                    &format!("{field}.int"),
                    v.to_string(),
                    "must be a 64-bit integer",
                );
            }
        }
        if let Some(v) = present("string") {
            fields += 1;
            values += 1;
            self.string_value(&format!("{field}.string"), v);
        }
        if let Some(v) = present("version") {
            fields += 1;
            values += 1;
            self.version_value(&format!("{field}.version"), v);
        }
        if self.since(36) {
            for list in ["bools", "ints", "strings", "versions"] {
                if let Some(v) = present(list) {
                    fields += 1;
                    let items = v.as_array().map(Vec::as_slice).unwrap_or_default();
                    values += items.len();
                    if items.is_empty() {
                        self.invalid(
                            &format!("{field}.{list}"),
                            v.to_string(),
                            "must not be empty if specified",
                        );
                    }
                    for (i, item) in items.iter().enumerate() {
                        match list {
                            "strings" => self.string_value(&format!("{field}.{list}[{i}]"), item),
                            "versions" => self.version_value(&format!("{field}.{list}[{i}]"), item),
                            _ => {}
                        }
                    }
                }
            }
        }
        match fields {
            0 if !self.since(35) => self.required(field, "exactly one value must be specified"),
            0 => self.invalid(field, q(""), "exactly one value must be specified"),
            1 => {}
            _ => self.invalid(
                field,
                Value::Object(attr.clone()).to_string(),
                "exactly one value must be specified",
            ),
        }
        values
    }

    fn counters_map(
        &mut self,
        field: &str,
        counters: Option<&Value>,
        max: Option<usize>,
    ) -> Vec<String> {
        let Some(map) = counters
            .and_then(Value::as_object)
            .filter(|m| !m.is_empty())
        else {
            self.required(field, "");
            return Vec::new();
        };
        if let Some(max) = max
            && map.len() > max
        {
            self.too_many(field, map.len(), max);
        }
        for (name, counter) in map {
            let path = format!("{field}[{name}]");
            if !is_dns_label(name) {
                self.invalid(&path, q(name), DNS_LABEL_MSG);
            }
            if counter
                .get("value")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
            {
                self.required(&format!("{path}.value"), "");
            }
        }
        map.keys().cloned().collect()
    }

    /// A quantity field as an exact integer (the API server's `Quantity.Value()`); `None`
    /// when absent, an `Invalid` error (and `None`) when it does not parse.
    fn quantity(&mut self, field: &str, v: Option<&Value>) -> Option<(i64, String)> {
        let v = v.filter(|v| !v.is_null())?;
        let text = v
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| v.to_string());
        match crate::quantity::value(&text) {
            Ok(value) => Some((value, text)),
            Err(e) => {
                self.invalid(field, q(&text), &e.to_string());
                None
            }
        }
    }

    /// `validateRequestPolicy` of a capacity of a device with `allowMultipleAllocations`
    /// (validation.go): one of `validValues` and `validRange`, a `default` that the
    /// policy allows, bounds within the capacity, `default` and `max` on a step from `min`.
    fn request_policy(&mut self, field: &str, cap: &Value, policy: &Value) {
        let Some((capacity, cap_text)) = self.quantity(&format!("{field}.value"), cap.get("value"))
        else {
            return;
        };
        let values = policy
            .get("validValues")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let range = policy.get("validRange").filter(|r| !r.is_null());
        if !values.is_empty() && range.is_some() {
            self.push(
                field,
                FieldErrorKind::Forbidden,
                None,
                r#"exactly one policy can be specified, cannot specify "validValues" and "validRange" at the same time"#,
            );
            return;
        }
        let default = self.quantity(&format!("{field}.default"), policy.get("default"));
        if !values.is_empty() {
            let Some((default, default_text)) = default else {
                if policy.get("default").is_none_or(Value::is_null) {
                    self.required(
                        &format!("{field}.default"),
                        "required when validValues is defined",
                    );
                }
                return;
            };
            let vpath = format!("{field}.validValues");
            let parsed: Vec<Option<(i64, String)>> = values
                .iter()
                .enumerate()
                .map(|(i, v)| self.quantity(&format!("{vpath}[{i}]"), Some(v)))
                .collect();
            for (i, w) in parsed.windows(2).enumerate() {
                if let (Some(a), Some(b)) = (&w[0], &w[1])
                    && a.0 > b.0
                {
                    self.invalid(
                        &format!("{vpath}[{}]", i + 1),
                        q(&b.1),
                        "values must be sorted in ascending order",
                    );
                }
            }
            if values.len() > limits::CAPACITY_REQUEST_POLICY_DISCRETE_MAX_OPTIONS {
                self.too_many(
                    &vpath,
                    values.len(),
                    limits::CAPACITY_REQUEST_POLICY_DISCRETE_MAX_OPTIONS,
                );
                return;
            }
            let mut seen = BTreeSet::new();
            for (i, (v, text)) in parsed
                .iter()
                .enumerate()
                .filter_map(|(i, p)| p.as_ref().map(|p| (i, p)))
            {
                if *v > capacity {
                    self.invalid(
                        &format!("{vpath}[{i}]"),
                        q(text),
                        &format!("option is larger than capacity value: {cap_text}"),
                    );
                }
                if !seen.insert(*v) {
                    self.duplicate(&format!("{vpath}[{i}]"), &v.to_string());
                }
            }
            if !parsed.iter().flatten().any(|(v, _)| *v == default) {
                self.invalid(
                    &vpath,
                    q(&default_text),
                    "default value is not valid according to the requestPolicy",
                );
            }
            return;
        }
        let Some(range) = range else {
            return;
        };
        let rpath = format!("{field}.validRange");
        let Some((default, default_text)) = default else {
            if policy.get("default").is_none_or(Value::is_null) {
                self.required(
                    &format!("{field}.default"),
                    "required when validRange is defined",
                );
            }
            return;
        };
        let Some((min, min_text)) = self.quantity(&format!("{rpath}.min"), range.get("min")) else {
            if range.get("min").is_none_or(Value::is_null) {
                self.required(
                    &format!("{rpath}.min"),
                    "required when validRange is defined",
                );
            }
            return;
        };
        if min > capacity {
            self.invalid(
                &format!("{rpath}.min"),
                q(&min_text),
                &format!("min is larger than capacity value: {cap_text}"),
            );
        }
        if default < min {
            self.invalid(
                &format!("{rpath}.min"),
                q(&default_text),
                &format!("default is less than min: {min_text}"),
            );
        }
        let max = self.quantity(&format!("{rpath}.max"), range.get("max"));
        if let Some((max, max_text)) = &max {
            if min > *max {
                self.invalid(
                    &format!("{rpath}.max"),
                    q(&min_text),
                    &format!("min is larger than max: {max_text}"),
                );
            }
            if *max > capacity {
                self.invalid(
                    &format!("{rpath}.max"),
                    q(max_text),
                    &format!("max is larger than capacity value: {cap_text}"),
                );
            }
            if default > *max {
                self.invalid(
                    &format!("{rpath}.max"),
                    q(&default_text),
                    &format!("default is more than max: {max_text}"),
                );
            }
        }
        let Some((step, step_text)) = self.quantity(&format!("{rpath}.step"), range.get("step"))
        else {
            return;
        };
        let spath = format!("{rpath}.step");
        if step <= 0 {
            // The API server divides by the step; a stand-in answer instead of a crash.
            self.invalid(&spath, q(&step_text), "must be greater than zero");
            return;
        }
        if min.saturating_add(step) > capacity {
            self.invalid(
                &spath,
                q(&step_text),
                &format!(
                    "one step {} is larger than capacity value: {cap_text}",
                    min.saturating_add(step)
                ),
            );
        }
        let mut on_step = |value: i64, text: &str| {
            if (value - min) % step != 0 {
                self.invalid(
                    &spath,
                    q(text),
                    &format!(
                        "value is not a multiple of a given step ({step_text}) from ({min_text})"
                    ),
                );
            }
        };
        on_step(default, &default_text);
        if let Some((max, max_text)) = &max {
            on_step(*max, max_text);
        }
    }

    fn taints(&mut self, field: &str, taints: &[Value]) {
        let max = if self.since(35) {
            MAX_TAINTS_PER_DEVICE_1_35
        } else {
            limits::DEVICE_TAINTS_MAX_LENGTH_1_34
        };
        if taints.len() > max {
            self.too_many(field, taints.len(), max);
        }
        let mut effects = vec!["NoExecute", "NoSchedule"];
        if self.since(35) {
            effects.insert(0, "None");
        }
        for (i, t) in taints.iter().enumerate() {
            let path = format!("{field}[{i}]");
            if t.get("key")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
            {
                self.invalid(&format!("{path}.key"), q(""), "name part must be non-empty");
            }
            match t.get("effect").and_then(Value::as_str) {
                None | Some("") => self.required(&format!("{path}.effect"), ""),
                Some(e) if !effects.contains(&e) => {
                    let supported: Vec<String> = effects.iter().map(|e| q(e)).collect();
                    self.push(
                        &format!("{path}.effect"),
                        FieldErrorKind::NotSupported,
                        Some(q(e)),
                        &format!("supported values: {}", supported.join(", ")),
                    );
                }
                Some(_) => {}
            }
        }
    }

    /// Validates one device; returns the number of counters it consumes.
    fn device(
        &mut self,
        i: usize,
        dev: &Value,
        per_device_nodes: bool,
        counter_sets: &BTreeMap<String, BTreeSet<String>>,
    ) -> usize {
        let path = format!("spec.devices[{i}]");
        let Some(obj) = dev.as_object() else {
            self.invalid(&path, dev.to_string(), "must be an object");
            return 0;
        };
        self.required_dns_label(
            &format!("{path}.name"),
            obj.get("name").and_then(Value::as_str),
        );
        let attrs = obj.get("attributes").and_then(Value::as_object);
        let caps = obj.get("capacity").and_then(Value::as_object);
        let n = attrs.map_or(0, Map::len) + caps.map_or(0, Map::len);
        if n > limits::RESOURCE_SLICE_MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE {
            self.invalid(
                &path,
                n.to_string(),
                &format!(
                    "the total number of attributes and capacities must not exceed {}",
                    limits::RESOURCE_SLICE_MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE
                ),
            );
        }
        let mut values = 0;
        for (key, attr) in attrs.into_iter().flatten() {
            let field = format!("{path}.attributes[{key}]");
            self.qualified_name(&field, key);
            values += self.attribute(&field, attr);
        }
        if self.since(36) && values > MAX_ATTRIBUTE_VALUES_PER_DEVICE_1_36 {
            self.invalid(
                &path,
                values.to_string(),
                &format!("the total number of attribute values must not exceed {MAX_ATTRIBUTE_VALUES_PER_DEVICE_1_36}"),
            );
        }
        let multi = obj.get("allowMultipleAllocations").and_then(Value::as_bool) == Some(true);
        for (key, cap) in caps.into_iter().flatten() {
            let field = format!("{path}.capacity[{key}]");
            self.qualified_name(&field, key);
            if cap
                .get("value")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
            {
                self.required(&format!("{field}.value"), "");
            }
            if let Some(policy) = cap.get("requestPolicy").filter(|p| !p.is_null()) {
                if multi {
                    self.request_policy(&format!("{field}.requestPolicy"), cap, policy);
                } else {
                    self.push(
                        &format!("{field}.requestPolicy"),
                        FieldErrorKind::Forbidden,
                        None,
                        "allowMultipleAllocations must be true",
                    );
                }
            }
        }
        if let Some(taints) = obj.get("taints").and_then(Value::as_array) {
            self.taints(&format!("{path}.taints"), taints);
        }
        let consumptions = obj
            .get("consumesCounters")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let cc_path = format!("{path}.consumesCounters");
        if self.since(35)
            && consumptions.len()
                > limits::RESOURCE_SLICE_MAX_DEVICE_COUNTER_CONSUMPTIONS_PER_DEVICE
        {
            self.too_many(
                &cc_path,
                consumptions.len(),
                limits::RESOURCE_SLICE_MAX_DEVICE_COUNTER_CONSUMPTIONS_PER_DEVICE,
            );
        }
        let mut total = 0;
        let mut seen_sets = BTreeSet::new();
        for (j, c) in consumptions.iter().enumerate() {
            let cpath = format!("{cc_path}[{j}]");
            let set = c
                .get("counterSet")
                .and_then(Value::as_str)
                .unwrap_or_default();
            self.required_dns_label(&format!("{cpath}.counterSet"), Some(set));
            if self.since(35) && !set.is_empty() && !seen_sets.insert(set.to_string()) {
                self.duplicate(&format!("{cpath}.counterSet"), set);
            }
            let max = self
                .since(35)
                .then_some(limits::RESOURCE_SLICE_MAX_COUNTERS_PER_DEVICE_COUNTER_CONSUMPTION);
            let names = self.counters_map(&format!("{cpath}.counters"), c.get("counters"), max);
            total += names.len();
            if !self.since(35) {
                match counter_sets.get(set) {
                    None => self.invalid(
                        &format!("{cpath}.counterSet"),
                        q(set),
                        "must reference a counterSet defined in the ResourceSlice sharedCounters",
                    ),
                    Some(defined) => {
                        for name in names.iter().filter(|n| !defined.contains(*n)) {
                            self.invalid(
                                &format!("{cpath}.counters"),
                                q(name),
                                "must reference a counter defined in the ResourceSlice sharedCounters",
                            );
                        }
                    }
                }
            }
        }
        if !self.since(35) && total > limits::RESOURCE_SLICE_MAX_COUNTERS_PER_DEVICE_1_34 {
            self.invalid(
                &path,
                total.to_string(),
                &format!(
                    "the total number of counters must not exceed {}",
                    limits::RESOURCE_SLICE_MAX_COUNTERS_PER_DEVICE_1_34
                ),
            );
        }
        let has_node_fields = ["nodeName", "nodeSelector", "allNodes"]
            .iter()
            .any(|k| obj.get(*k).is_some_and(|v| !v.is_null()));
        if per_device_nodes {
            self.node_selection(&path, obj, false);
        } else if has_node_fields {
            self.invalid(
                &path,
                "null".into(),
                "`nodeName`, `nodeSelector` and `allNodes` can only be set if `perDeviceNodeSelection` is set to true in the ResourceSlice spec",
            );
        }
        for key in ["bindingConditions", "bindingFailureConditions"] {
            if let Some(list) = obj.get(key).and_then(Value::as_array)
                && list.len() > MAX_BINDING_CONDITIONS
            {
                self.too_many(&format!("{path}.{key}"), list.len(), MAX_BINDING_CONDITIONS);
            }
        }
        total
    }
}

fn present<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

/// Validates a ResourceSlice (JSON) for `version`; returns the field errors in order.
pub fn slice_errors(slice: &Value, version: KubeVersion) -> Vec<FieldError> {
    let mut c = Checker {
        version,
        errs: Vec::new(),
    };
    let meta = slice.get("metadata");
    match meta
        .and_then(|m| m.get("name"))
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
    {
        Some(name) => c.dns_subdomain("metadata.name", name),
        None => match meta
            .and_then(|m| m.get("generateName"))
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
        {
            Some(prefix) => c.dns_subdomain("metadata.generateName", &format!("{prefix}x")),
            None => c.required("metadata.name", "name or generateName is required"),
        },
    }
    let Some(spec) = slice.get("spec").and_then(Value::as_object) else {
        c.required("spec", "");
        return c.errs;
    };
    c.driver_name("spec.driver", spec.get("driver").and_then(Value::as_str));
    c.pool(spec.get("pool"));
    c.node_selection("spec", spec, true);
    let per_device_nodes =
        spec.get("perDeviceNodeSelection").and_then(Value::as_bool) == Some(true);

    let devices = present(spec, "devices");
    let shared = present(spec, "sharedCounters");
    if version.minor >= 35 && devices.is_some() && shared.is_some() {
        c.invalid(
            "spec",
            q(""),
            "only one of `sharedCounters` or `devices` is allowed",
        );
    }

    // Counter sets.
    let sets = shared
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut counter_sets: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut total_shared = 0;
    if version.minor >= 35 && sets.len() > limits::RESOURCE_SLICE_MAX_COUNTER_SETS {
        c.too_many(
            "spec.sharedCounters",
            sets.len(),
            limits::RESOURCE_SLICE_MAX_COUNTER_SETS,
        );
    }
    for (i, set) in sets.iter().enumerate() {
        let path = format!("spec.sharedCounters[{i}]");
        let name = set.get("name").and_then(Value::as_str).unwrap_or_default();
        c.required_dns_label(&format!("{path}.name"), Some(name));
        if !name.is_empty() && counter_sets.contains_key(name) {
            c.duplicate(&format!("{path}.name"), name);
        }
        let max =
            (version.minor >= 35).then_some(limits::RESOURCE_SLICE_MAX_COUNTERS_PER_COUNTER_SET);
        let names = c.counters_map(&format!("{path}.counters"), set.get("counters"), max);
        total_shared += names.len();
        counter_sets
            .entry(name.to_string())
            .or_default()
            .extend(names);
    }
    if version.minor < 35 && total_shared > limits::RESOURCE_SLICE_MAX_SHARED_COUNTERS_1_34 {
        c.invalid(
            "spec.sharedCounters",
            total_shared.to_string(),
            &format!(
                "the total number of shared counters must not exceed {}",
                limits::RESOURCE_SLICE_MAX_SHARED_COUNTERS_1_34
            ),
        );
    }

    // Devices.
    let devs = devices
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let advanced = devs.iter().any(|d| {
        let nonempty = |k: &str| {
            d.get(k)
                .and_then(Value::as_array)
                .is_some_and(|a| !a.is_empty())
        };
        let list_attrs = version.minor >= 36
            && d.get("attributes")
                .and_then(Value::as_object)
                .is_some_and(|m| {
                    m.values().any(|a| {
                        ["bools", "ints", "strings", "versions"]
                            .iter()
                            .any(|k| a.get(*k).is_some_and(|v| !v.is_null()))
                    })
                });
        nonempty("taints") || nonempty("consumesCounters") || list_attrs
    });
    let max_devices = if version.minor >= 35 && advanced {
        limits::RESOURCE_SLICE_MAX_DEVICES_WITH_TAINTS_OR_CONSUMES_COUNTERS
    } else {
        limits::RESOURCE_SLICE_MAX_DEVICES
    };
    if devs.len() > max_devices {
        c.too_many("spec.devices", devs.len(), max_devices);
    }
    let mut names = BTreeSet::new();
    let mut total_counters = 0;
    for (i, dev) in devs.iter().enumerate() {
        total_counters += c.device(i, dev, per_device_nodes, &counter_sets);
        if let Some(name) = dev
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            && !names.insert(name)
        {
            c.duplicate(&format!("spec.devices[{i}].name"), name);
        }
    }
    if version.minor < 35
        && total_counters > limits::RESOURCE_SLICE_MAX_DEVICE_COUNTERS_PER_SLICE_1_34
    {
        c.invalid(
            "spec.devices",
            total_counters.to_string(),
            &format!(
                "the total number of counters in devices must not exceed {}",
                limits::RESOURCE_SLICE_MAX_DEVICE_COUNTERS_PER_SLICE_1_34
            ),
        );
    }
    c.errs
}

/// Checks the fields that may not change on update (`spec.driver`, `spec.pool.name`,
/// `spec.nodeName`).
pub fn slice_update_errors(old: &Value, new: &Value) -> Vec<FieldError> {
    let mut errs = Vec::new();
    for (path, ptr) in [
        ("spec.pool.name", "/spec/pool/name"),
        ("spec.driver", "/spec/driver"),
        ("spec.nodeName", "/spec/nodeName"),
    ] {
        let (a, b) = (
            old.pointer(ptr).filter(|v| !v.is_null()),
            new.pointer(ptr).filter(|v| !v.is_null()),
        );
        if a != b {
            let shown = b.map_or_else(|| "null".to_string(), Value::to_string);
            errs.push(FieldError::invalid(path, shown, "field is immutable"));
        }
    }
    errs
}

/// Pool-level checks the API server does not do but a publisher must keep (and the 1.35+
/// kubelet-plugin helper checks client-side): among the slices of one pool at its highest
/// generation, the number of slices equals `resourceSliceCount`, device names and counter-set
/// names are unique, and every `consumesCounters` entry names a counter set and counter that
/// exists in the pool. `slices` may hold several pools (grouped by driver and pool name).
pub fn validate_pools(slices: &[Value]) -> Result<(), Vec<String>> {
    let mut pools: BTreeMap<(String, String), Vec<&Value>> = BTreeMap::new();
    for s in slices {
        let driver = s
            .pointer("/spec/driver")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let pool = s
            .pointer("/spec/pool/name")
            .and_then(Value::as_str)
            .unwrap_or_default();
        pools
            .entry((driver.to_string(), pool.to_string()))
            .or_default()
            .push(s);
    }
    let mut errs = Vec::new();
    for ((driver, pool), members) in pools {
        let generation_of = |s: &Value| {
            s.pointer("/spec/pool/generation")
                .and_then(Value::as_i64)
                .unwrap_or(0)
        };
        let top = members.iter().map(|s| generation_of(s)).max().unwrap_or(0);
        let current: Vec<&Value> = members
            .into_iter()
            .filter(|s| generation_of(s) == top)
            .collect();
        let slice_name = |s: &Value| {
            s.pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        let want: BTreeSet<i64> = current
            .iter()
            .map(|s| {
                s.pointer("/spec/pool/resourceSliceCount")
                    .and_then(Value::as_i64)
                    .unwrap_or(0)
            })
            .collect();
        if want.len() > 1 {
            errs.push(format!("pool {driver}/{pool} generation {top}: slices disagree on resourceSliceCount: {want:?}"));
        } else if let Some(n) = want.first()
            && usize::try_from(*n).ok() != Some(current.len())
        {
            errs.push(format!(
                "pool {driver}/{pool} generation {top}: resourceSliceCount is {n} but {} slices exist",
                current.len()
            ));
        }
        let mut device_owner: BTreeMap<String, String> = BTreeMap::new();
        let mut sets: BTreeMap<String, (String, BTreeSet<String>)> = BTreeMap::new();
        for s in &current {
            for set in s
                .pointer("/spec/sharedCounters")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let name = set
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                let counters: BTreeSet<String> = set
                    .get("counters")
                    .and_then(Value::as_object)
                    .map(|m| m.keys().cloned().collect())
                    .unwrap_or_default();
                if let Some((other, _)) = sets.get(&name) {
                    errs.push(format!(
                        "pool {driver}/{pool}: counter set {name:?} defined in slices {other:?} and {:?}",
                        slice_name(s)
                    ));
                } else {
                    sets.insert(name, (slice_name(s), counters));
                }
            }
        }
        for s in &current {
            for dev in s
                .pointer("/spec/devices")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let name = dev
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                if let Some(other) = device_owner.insert(name.clone(), slice_name(s)) {
                    errs.push(format!(
                        "pool {driver}/{pool}: device {name:?} in slices {other:?} and {:?}",
                        slice_name(s)
                    ));
                }
                for c in dev
                    .get("consumesCounters")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let set = c
                        .get("counterSet")
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    match sets.get(set) {
                        None => errs.push(format!(
                            "pool {driver}/{pool}: device {name:?} consumes counter set {set:?} which the pool does not define"
                        )),
                        Some((_, counters)) => {
                            for counter in c.get("counters").and_then(Value::as_object).into_iter().flatten().map(|(k, _)| k) {
                                if !counters.contains(counter) {
                                    errs.push(format!(
                                        "pool {driver}/{pool}: device {name:?} consumes counter {counter:?} not in counter set {set:?}"
                                    ));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    if errs.is_empty() { Ok(()) } else { Err(errs) }
}
/// Validates a ResourceSlice given as JSON against the API server rules of `version`.
/// Returns the error strings in the API server's `<field>: <type>: <detail>` form.
pub fn validate_resource_slice(slice: &Value, version: KubeVersion) -> Result<(), Vec<String>> {
    let errs = slice_errors(slice, version);
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.iter().map(FieldError::to_string).collect())
    }
}

/// [`validate_resource_slice`] for a typed k8s-openapi ResourceSlice.
pub fn validate_resource_slice_typed(
    slice: &k8s_openapi::api::resource::v1::ResourceSlice,
    version: KubeVersion,
) -> Result<(), Vec<String>> {
    let v = serde_json::to_value(slice).map_err(|e| vec![format!("serialize: {e}")])?;
    validate_resource_slice(&v, version)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn slice(n: usize) -> Value {
        let devices: Vec<Value> = (0..n)
            .map(|i| json!({"name": format!("gpu-{i}"), "attributes": {"type": {"string": "gpu"}, "driverVersion": {"version": "580.65.6"}}}))
            .collect();
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "node-1-gpu.cleave.dev-abcde"},
            "spec": {"driver": "gpu.cleave.dev", "nodeName": "node-1",
                     "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1},
                     "devices": devices}
        })
    }

    fn errors(v: &Value, version: KubeVersion) -> Vec<String> {
        validate_resource_slice(v, version)
            .err()
            .unwrap_or_default()
    }

    /// One whole GPU shared by capacity: 81559Mi memory and 132 SMs, each with a request
    /// policy whose default is the whole device.
    fn shared(memory_policy: Value) -> Value {
        let mut s = slice(1);
        let d = &mut s["spec"]["devices"][0];
        d["allowMultipleAllocations"] = json!(true);
        d["capacity"] = json!({
            "memory": {"value": "81559Mi", "requestPolicy": memory_policy},
            "multiprocessors": {"value": "132", "requestPolicy": {
                "default": "132", "validRange": {"min": "1", "max": "132", "step": "1"}}},
        });
        s
    }

    #[test]
    fn request_policies_are_checked_like_the_api_server() {
        let ok = json!({"default": "81559Mi", "validRange": {"min": "1Mi", "max": "81559Mi", "step": "1Mi"}});
        for v in [KubeVersion::V1_34, KubeVersion::V1_35, KubeVersion::V1_36] {
            assert_eq!(errors(&shared(ok.clone()), v), Vec::<String>::new(), "{v}");
        }
        // Discrete values are fine too when the default is one of them.
        let values = json!({"default": "40Gi", "validValues": ["10Gi", "20Gi", "40Gi"]});
        assert_eq!(
            errors(&shared(values), KubeVersion::V1_36),
            Vec::<String>::new()
        );

        let f = "spec.devices[0].capacity[memory].requestPolicy";
        let cases = [
            (
                json!({"default": "90Gi", "validRange": {"min": "1Mi", "max": "81559Mi", "step": "1Mi"}}),
                format!(
                    "{f}.validRange.max: Invalid value: \"90Gi\": default is more than max: 81559Mi"
                ),
            ),
            (
                json!({"default": "512Ki", "validRange": {"min": "1Mi", "step": "1Mi"}}),
                format!(
                    "{f}.validRange.min: Invalid value: \"512Ki\": default is less than min: 1Mi"
                ),
            ),
            (
                json!({"default": "81559Mi", "validRange": {"min": "1Gi", "step": "1Gi"}}),
                format!(
                    "{f}.validRange.step: Invalid value: \"81559Mi\": value is not a multiple of a given step (1Gi) from (1Gi)"
                ),
            ),
            (
                json!({"default": "1Gi", "validRange": {"min": "1Gi", "max": "90Gi", "step": "1Gi"}}),
                format!(
                    "{f}.validRange.max: Invalid value: \"90Gi\": max is larger than capacity value: 81559Mi"
                ),
            ),
            (
                json!({"validRange": {"min": "1Mi"}}),
                format!("{f}.default: Required value: required when validRange is defined"),
            ),
            (
                json!({"default": "1Gi", "validRange": {"step": "1Mi"}}),
                format!("{f}.validRange.min: Required value: required when validRange is defined"),
            ),
            (
                json!({"default": "1Gi", "validRange": {"min": "1Mi"}, "validValues": ["1Gi"]}),
                format!(
                    "{f}: Forbidden: exactly one policy can be specified, cannot specify \"validValues\" and \"validRange\" at the same time"
                ),
            ),
            (
                json!({"default": "30Gi", "validValues": ["20Gi", "10Gi"]}),
                format!(
                    "{f}.validValues[1]: Invalid value: \"10Gi\": values must be sorted in ascending order"
                ),
            ),
            (
                json!({"default": "30Gi", "validValues": ["10Gi", "20Gi"]}),
                format!(
                    "{f}.validValues: Invalid value: \"30Gi\": default value is not valid according to the requestPolicy"
                ),
            ),
            (
                json!({"default": "1Gi", "validValues": (1..=11).map(|i| format!("{i}Gi")).collect::<Vec<_>>()}),
                format!("{f}.validValues: Too many: 11: must have at most 10 items"),
            ),
        ];
        for (policy, want) in cases {
            let e = errors(&shared(policy.clone()), KubeVersion::V1_36);
            assert!(e.contains(&want), "{policy}: {e:#?}");
        }

        // A policy without allowMultipleAllocations is forbidden.
        let mut s = shared(ok);
        s["spec"]["devices"][0]["allowMultipleAllocations"] = json!(false);
        let e = errors(&s, KubeVersion::V1_36);
        assert!(
            e.contains(&format!(
                "{f}: Forbidden: allowMultipleAllocations must be true"
            )),
            "{e:#?}"
        );
    }

    #[test]
    fn valid_slice_passes_all_versions() {
        for v in [KubeVersion::V1_34, KubeVersion::V1_35, KubeVersion::V1_36] {
            assert_eq!(errors(&slice(128), v), Vec::<String>::new(), "{v}");
        }
    }

    #[test]
    fn too_many_devices() {
        let e = errors(&slice(129), KubeVersion::V1_34);
        assert_eq!(
            e,
            ["spec.devices: Too many: 129: must have at most 128 items"]
        );
    }

    #[test]
    fn device_name_and_duplicates() {
        let mut s = slice(4);
        s["spec"]["devices"][3]["name"] = json!("GPU_3");
        s["spec"]["devices"][2]["name"] = json!("gpu-0");
        let e = errors(&s, KubeVersion::V1_34);
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(
            e[0].starts_with("spec.devices[2].name: Duplicate value: \"gpu-0\""),
            "{e:?}"
        );
        assert!(
            e[1].starts_with(
                "spec.devices[3].name: Invalid value: \"GPU_3\": a lowercase RFC 1123 label"
            ),
            "{e:?}"
        );
    }

    #[test]
    fn attribute_rules() {
        let mut s = slice(1);
        let attrs = &mut s["spec"]["devices"][0]["attributes"];
        attrs["long"] = json!({"string": "x".repeat(65)});
        attrs["badVersion"] = json!({"version": "v1.2"});
        attrs["two"] = json!({"int": 1, "bool": true});
        attrs["bad/name/x"] = json!({"int": 1});
        let e = errors(&s, KubeVersion::V1_34);
        assert!(e.iter().any(|m| m == "spec.devices[0].attributes[long].string: Too long: may not be more than 64 bytes"), "{e:?}");
        assert!(e.iter().any(|m| m.starts_with("spec.devices[0].attributes[badVersion].version: Invalid value: \"v1.2\": must be a string compatible with semver")), "{e:?}");
        assert!(
            e.iter().any(
                |m| m.starts_with("spec.devices[0].attributes[two]: Invalid value:")
                    && m.ends_with("exactly one value must be specified")
            ),
            "{e:?}"
        );
        assert!(
            e.iter()
                .any(|m| m.starts_with("spec.devices[0].attributes[bad/name/x]")),
            "{e:?}"
        );

        let mut s = slice(1);
        for i in 0..31 {
            s["spec"]["devices"][0]["attributes"][format!("a{i}")] = json!({"int": i});
        }
        let e = errors(&s, KubeVersion::V1_34);
        assert_eq!(
            e,
            [
                "spec.devices[0]: Invalid value: 33: the total number of attributes and capacities must not exceed 32"
            ]
        );
    }

    #[test]
    fn semver() {
        for ok in [
            "1.2.3",
            "0.0.0",
            "1.2.3-rc.1",
            "1.2.3+build.5",
            "1.2.3-alpha-1+x",
        ] {
            assert!(is_semver(ok), "{ok}");
        }
        for bad in [
            "1.2", "01.2.3", "1.2.3-", "1.2.3-01", "v1.2.3", "1.2.3+", "",
        ] {
            assert!(!is_semver(bad), "{bad}");
        }
    }

    fn with_counters(n: usize, sets: usize, per_device: usize) -> Value {
        let mut s = slice(n);
        let counters: Map<String, Value> = (0..per_device)
            .map(|i| (format!("c{i}"), json!({"value": "1"})))
            .collect();
        s["spec"]["sharedCounters"] = Value::Array(
            (0..sets)
                .map(|i| json!({"name": format!("set-{i}"), "counters": counters.clone()}))
                .collect(),
        );
        for d in s["spec"]["devices"].as_array_mut().into_iter().flatten() {
            d["consumesCounters"] = json!([{"counterSet": "set-0", "counters": counters.clone()}]);
        }
        s
    }

    #[test]
    fn counters_1_34() {
        assert_eq!(
            errors(&with_counters(65, 1, 8), KubeVersion::V1_34),
            Vec::<String>::new()
        );
        // 1.34: at most 32 counters over all sets.
        let e = errors(&with_counters(1, 2, 17), KubeVersion::V1_34);
        assert_eq!(
            e,
            [
                "spec.sharedCounters: Invalid value: 34: the total number of shared counters must not exceed 32"
            ]
        );
        // 1.34: at most 1024 counters consumed per slice.
        let e = errors(&with_counters(128, 1, 9), KubeVersion::V1_34);
        assert_eq!(
            e,
            [
                "spec.devices: Invalid value: 1152: the total number of counters in devices must not exceed 1024"
            ]
        );
        // References must exist in the slice.
        let mut s = with_counters(1, 1, 1);
        s["spec"]["devices"][0]["consumesCounters"][0]["counterSet"] = json!("nope");
        let e = errors(&s, KubeVersion::V1_34);
        assert_eq!(
            e,
            [
                "spec.devices[0].consumesCounters[0].counterSet: Invalid value: \"nope\": must reference a counterSet defined in the ResourceSlice sharedCounters"
            ]
        );
    }

    #[test]
    fn counters_1_35() {
        // 65 devices with counters: over the 64 limit; also both devices and sharedCounters.
        let e = errors(&with_counters(65, 1, 1), KubeVersion::V1_35);
        assert!(
            e.contains(&"spec.devices: Too many: 65: must have at most 64 items".to_string()),
            "{e:?}"
        );
        assert!(
            e.contains(
                &"spec: Invalid value: \"\": only one of `sharedCounters` or `devices` is allowed"
                    .to_string()
            ),
            "{e:?}"
        );
        // Devices-only slice referencing a counter set elsewhere in the pool is fine.
        let mut s = with_counters(64, 0, 1);
        s["spec"].as_object_mut().unwrap().remove("sharedCounters");
        assert_eq!(errors(&s, KubeVersion::V1_35), Vec::<String>::new());
        let e = errors(&with_counters(1, 9, 1), KubeVersion::V1_35);
        assert!(
            e.contains(&"spec.sharedCounters: Too many: 9: must have at most 8 items".to_string()),
            "{e:?}"
        );
    }

    #[test]
    fn spec_rules() {
        let mut s = slice(1);
        s["spec"]["allNodes"] = json!(true);
        s["spec"]["pool"]["resourceSliceCount"] = json!(0);
        s["spec"]["pool"]["generation"] = json!(-1);
        s["spec"]["driver"] = json!("not a driver");
        s["spec"]["pool"]["name"] = json!("a/B");
        let e = errors(&s, KubeVersion::V1_34);
        assert_eq!(e.len(), 5, "{e:?}");
        assert!(
            e[0].starts_with("spec.driver: Invalid value: \"not a driver\""),
            "{e:?}"
        );
        assert!(
            e[1].starts_with("spec.pool.name: Invalid value: \"B\""),
            "{e:?}"
        );
        assert_eq!(
            e[2],
            "spec.pool.resourceSliceCount: Invalid value: 0: must be greater than zero"
        );
        assert_eq!(
            e[3],
            "spec.pool.generation: Invalid value: -1: must be greater than or equal to zero"
        );
        assert!(
            e[4].starts_with("spec: Invalid value: \"{`nodeName`, `allNodes`}\""),
            "{e:?}"
        );
        let mut s = slice(1);
        s["spec"].as_object_mut().unwrap().remove("nodeName");
        assert_eq!(
            errors(&s, KubeVersion::V1_34),
            [format!("spec: Required value: {NODE_FIELDS}")]
        );
    }

    #[test]
    fn immutable_fields() {
        let old = slice(1);
        let mut new = old.clone();
        new["spec"]["nodeName"] = json!("node-2");
        new["spec"]["driver"] = json!("other.example.com");
        let e: Vec<String> = slice_update_errors(&old, &new)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            e,
            [
                "spec.driver: Invalid value: \"other.example.com\": field is immutable",
                "spec.nodeName: Invalid value: \"node-2\": field is immutable",
            ]
        );
    }

    #[test]
    fn pools() {
        let mut a = slice(2);
        a["spec"]["pool"]["resourceSliceCount"] = json!(2);
        let mut b = a.clone();
        b["metadata"]["name"] = json!("b");
        b["spec"]["devices"] = json!([{"name": "gpu-1", "consumesCounters": [{"counterSet": "x", "counters": {"m": {"value": "1"}}}]}]);
        let e = validate_pools(&[a.clone(), b]).unwrap_err();
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e[0].contains("device \"gpu-1\" in slices"), "{e:?}");
        assert!(
            e[1].contains("counter set \"x\" which the pool does not define"),
            "{e:?}"
        );
        let e = validate_pools(&[a]).unwrap_err();
        assert!(
            e[0].contains("resourceSliceCount is 2 but 1 slices exist"),
            "{e:?}"
        );
    }
}

/// Event limits of kubernetes pkg/apis/core/validation/events.go (`ValidateEventCreate`).
const EVENT_REPORTING_INSTANCE_MAX: usize = 128;
const EVENT_NOTE_MAX: usize = 1024;
const EVENT_REASON_ACTION_MAX: usize = 128;

/// What the API server refuses in a new `events.k8s.io/v1` Event or Pod: a name that is
/// not a DNS subdomain (both), and for Events a `reportingInstance`, `reason` or `action`
/// over 128 characters or a `note` over 1 kB.
pub fn new_object_errors(kind: &str, obj: &Value) -> Vec<FieldError> {
    let mut errs = Vec::new();
    if let Some(name) = obj
        .get("metadata")
        .and_then(|m| m.get("name"))
        .and_then(Value::as_str)
        && !is_dns_subdomain(name)
    {
        errs.push(FieldError::invalid(
            "metadata.name",
            q(name),
            if name.len() > DNS_SUBDOMAIN_MAX {
                "must be no more than 253 characters"
            } else {
                DNS_SUBDOMAIN_MSG
            },
        ));
    }
    if kind == "Event" && obj.get("apiVersion").and_then(Value::as_str) == Some("events.k8s.io/v1")
    {
        let limits = [
            ("reportingInstance", EVENT_REPORTING_INSTANCE_MAX),
            ("reason", EVENT_REASON_ACTION_MAX),
            ("action", EVENT_REASON_ACTION_MAX),
            ("note", EVENT_NOTE_MAX),
        ];
        for (field, max) in limits {
            if let Some(v) = obj.get(field).and_then(Value::as_str)
                && v.len() > max
            {
                errs.push(FieldError::invalid(
                    field,
                    q(v),
                    &format!("can have at most {max} characters"),
                ));
            }
        }
    }
    errs
}

#[cfg(test)]
mod new_object_tests {
    use super::*;

    #[test]
    fn event_names_and_reporting_instances_are_bounded() {
        let ok = serde_json::json!({"apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"name": "node-a.18f"}, "reportingInstance": "node-a"});
        assert!(new_object_errors("Event", &ok).is_empty());
        let long = "a".repeat(250);
        let bad = serde_json::json!({"apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"name": format!("{long}.18f0")}, "reportingInstance": long});
        let errs = new_object_errors("Event", &bad);
        assert_eq!(errs.len(), 2, "{errs:?}");
        assert_eq!(errs[0].field, "metadata.name");
        assert_eq!(errs[1].field, "reportingInstance");
        let pod = serde_json::json!({"metadata": {"name": "Bad_Name"}});
        assert_eq!(new_object_errors("Pod", &pod).len(), 1);
    }
}
