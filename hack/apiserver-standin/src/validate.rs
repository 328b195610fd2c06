//! ResourceSlice validation (placeholder; full rules follow).

use serde_json::Value;

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

/// Validates a ResourceSlice (JSON) for `version`; returns the field errors.
pub fn slice_errors(_slice: &Value, _version: KubeVersion) -> Vec<FieldError> {
    Vec::new()
}

/// Checks the fields that may not change on update.
pub fn slice_update_errors(_old: &Value, _new: &Value) -> Vec<FieldError> {
    Vec::new()
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
