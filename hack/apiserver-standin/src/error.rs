//! Errors: `ApiError` is what a request fails with (rendered as a `Status` object, as the
//! real API server does); `StandInError` is what the test-control API returns.

use serde_json::{Value, json};

use crate::resources::ResourceDef;
use crate::validate::FieldError;

/// A failed API request, rendered as a `meta/v1` `Status`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status code.
    pub code: u16,
    /// `Status.reason` (`NotFound`, `Conflict`, `Invalid`, ...).
    pub reason: String,
    /// `Status.message`.
    pub message: String,
    /// `Status.details`, if any.
    pub details: Option<Value>,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}

fn details(res: &ResourceDef, name: &str) -> Value {
    json!({"name": name, "group": res.group, "kind": res.plural})
}

impl ApiError {
    /// Any code/reason/message.
    pub fn new(code: u16, reason: &str, message: String) -> Self {
        ApiError {
            code,
            reason: reason.to_string(),
            message,
            details: None,
        }
    }

    /// 400 BadRequest.
    pub fn bad_request(message: String) -> Self {
        Self::new(400, "BadRequest", message)
    }

    /// 404 NotFound for an object.
    pub fn not_found(res: &ResourceDef, name: &str) -> Self {
        ApiError {
            code: 404,
            reason: "NotFound".into(),
            message: format!("{} \"{name}\" not found", res.qualified()),
            details: Some(details(res, name)),
        }
    }

    /// 404 for an unknown path.
    pub fn no_route(path: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        )
    }

    /// 405 MethodNotAllowed.
    pub fn method_not_allowed(method: &str) -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            format!("the server does not allow this method on the requested resource ({method})"),
        )
    }

    /// 409 AlreadyExists.
    pub fn already_exists(res: &ResourceDef, name: &str) -> Self {
        ApiError {
            code: 409,
            reason: "AlreadyExists".into(),
            message: format!("{} \"{name}\" already exists", res.qualified()),
            details: Some(details(res, name)),
        }
    }

    /// 409 Conflict with a custom message (preconditions).
    pub fn conflict(res: &ResourceDef, name: &str, why: String) -> Self {
        ApiError {
            code: 409,
            reason: "Conflict".into(),
            message: format!(
                "Operation cannot be fulfilled on {} \"{name}\": {why}",
                res.qualified()
            ),
            details: Some(details(res, name)),
        }
    }

    /// 409 Conflict for a stale resourceVersion.
    pub fn conflict_modified(res: &ResourceDef, name: &str) -> Self {
        Self::conflict(
            res,
            name,
            "the object has been modified; please apply your changes to the latest version and try again".into(),
        )
    }

    /// 410 Gone (expired resourceVersion).
    pub fn gone(message: String) -> Self {
        Self::new(410, "Expired", message)
    }

    /// 415 UnsupportedMediaType.
    pub fn unsupported_media(ct: &str) -> Self {
        Self::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json, application/merge-patch+json ({ct})"
            ),
        )
    }

    /// 422 Invalid with field causes, message like the real API server's.
    pub fn invalid(res: &ResourceDef, name: &str, errors: Vec<FieldError>) -> Self {
        let list = if errors.len() == 1 {
            errors.iter().map(FieldError::to_string).collect::<String>()
        } else {
            format!(
                "[{}]",
                errors
                    .iter()
                    .map(FieldError::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        let causes: Vec<Value> = errors
            .iter()
            .map(|e| json!({"reason": e.kind.reason(), "message": e.message(), "field": e.field}))
            .collect();
        ApiError {
            code: 422,
            reason: "Invalid".into(),
            message: format!("{} \"{name}\" is invalid: {list}", res.qualified_kind()),
            details: Some(
                json!({"name": name, "group": res.group, "kind": res.kind, "causes": causes}),
            ),
        }
    }

    /// 503 / other injected failures.
    pub fn injected(code: u16) -> Self {
        let reason = match code {
            400 => "BadRequest",
            401 => "Unauthorized",
            403 => "Forbidden",
            404 => "NotFound",
            409 => "Conflict",
            410 => "Expired",
            422 => "Invalid",
            429 => "TooManyRequests",
            500 => "InternalError",
            503 => "ServiceUnavailable",
            504 => "Timeout",
            _ => "Unknown",
        };
        Self::new(
            code,
            reason,
            format!("injected failure ({code} {reason}) by the API server stand-in"),
        )
    }

    /// The `Status` JSON object.
    pub fn to_status(&self) -> Value {
        let mut v = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let (Some(d), Some(map)) = (&self.details, v.as_object_mut()) {
            map.insert("details".into(), d.clone());
        }
        v
    }
}

/// Errors of the test-control API.
#[derive(Debug, thiserror::Error)]
pub enum StandInError {
    /// Binding the loopback listener failed.
    #[error("bind 127.0.0.1:0: {0}")]
    Bind(#[source] std::io::Error),
    /// Building the kube client failed.
    #[error("build kube client for {url}: {source}")]
    Client {
        /// Server URL.
        url: String,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// Building the runtime of a detached server failed.
    #[error("start stand-in runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// Writing a file failed.
    #[error("write {}: {source}", path.display())]
    Write {
        /// File.
        path: std::path::PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The server URL did not parse.
    #[error("parse url {0:?}")]
    Url(String),
    /// An object could not be serialized.
    #[error("serialize object: {0}")]
    Serialize(#[source] serde_json::Error),
    /// The resource is not served by the stand-in.
    #[error("unknown resource {0:?}")]
    UnknownResource(String),
    /// A store operation failed.
    #[error("store: {0}")]
    Api(#[from] ApiError),
}
