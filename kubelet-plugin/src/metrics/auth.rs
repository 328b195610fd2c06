//! Optional authentication and authorization of `/metrics` scrapes
//! (`--metrics-auth=kubernetes`), the way controller-runtime's metrics filter
//! (`sigs.k8s.io/controller-runtime/pkg/metrics/filters`, `WithAuthenticationAndAuthorization`)
//! does it: the request's bearer token is reviewed by the API server (a TokenReview,
//! `authentication.k8s.io/v1`), then the user it names is checked for `get` on the
//! non-resource URL `/metrics` (a SubjectAccessReview, `authorization.k8s.io/v1`). Verdicts
//! are cached for [`CACHE_TTL`], at most [`CACHE_ENTRIES`] tokens, so that a scrape every
//! few seconds costs two API requests a minute. `/healthz` and `/readyz` stay open (the
//! kubelet's probes send no token). RBAC: `tokenreviews` `create` and
//! `subjectaccessreviews` `create`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hyper::StatusCode;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::PostParams;
use tracing::{debug, warn};

/// How long a verdict on a token is reused.
pub(crate) const CACHE_TTL: Duration = Duration::from_secs(60);
/// Tokens whose verdicts are kept; past it, expired entries go, then all.
pub(crate) const CACHE_ENTRIES: usize = 1024;
/// Bound of one review request.
const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest bearer token looked at (service account tokens are about 1 KiB).
const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// A verdict on one token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Allowed,
    Unauthenticated,
    Forbidden,
}

/// Reviews scrape tokens with the API server; cheap to share behind an `Arc`.
pub(crate) struct ScrapeAuth {
    client: kube::Client,
    cache: Mutex<HashMap<String, (Verdict, Instant)>>,
}

impl std::fmt::Debug for ScrapeAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScrapeAuth").finish_non_exhaustive()
    }
}

/// Why a scrape is not served: the status and the body.
pub(crate) type Refusal = (StatusCode, &'static str);

impl ScrapeAuth {
    /// Reviews with `client`.
    pub(crate) fn new(client: kube::Client) -> Self {
        Self {
            client,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Checks the request's `Authorization: Bearer` token: Ok when the API server
    /// authenticates it and allows its user `get` on `/metrics`.
    pub(crate) async fn check(&self, headers: &hyper::HeaderMap) -> Result<(), Refusal> {
        let token = headers
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty() && t.len() <= MAX_TOKEN_BYTES)
            .ok_or((
                StatusCode::UNAUTHORIZED,
                "Unauthorized: a bearer token is needed\n",
            ))?;
        let verdict = match self.cached(token) {
            Some(v) => v,
            None => {
                let v = self.review(token).await?;
                self.remember(token, v);
                v
            }
        };
        match verdict {
            Verdict::Allowed => Ok(()),
            Verdict::Unauthenticated => Err((StatusCode::UNAUTHORIZED, "Unauthorized\n")),
            Verdict::Forbidden => Err((
                StatusCode::FORBIDDEN,
                "Forbidden: get on the non-resource URL /metrics is not allowed\n",
            )),
        }
    }

    fn cached(&self, token: &str) -> Option<Verdict> {
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .get(token)
            .filter(|(_, at)| at.elapsed() < CACHE_TTL)
            .map(|(v, _)| *v)
    }

    fn remember(&self, token: &str, verdict: Verdict) {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= CACHE_ENTRIES {
            cache.retain(|_, (_, at)| at.elapsed() < CACHE_TTL);
            if cache.len() >= CACHE_ENTRIES {
                cache.clear();
            }
        }
        cache.insert(token.to_owned(), (verdict, Instant::now()));
    }

    /// The TokenReview, then the SubjectAccessReview; an API failure is a 500, not cached.
    async fn review(&self, token: &str) -> Result<Verdict, Refusal> {
        const FAILED: Refusal = (
            StatusCode::INTERNAL_SERVER_ERROR,
            "the scrape could not be authorized\n",
        );
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                audiences: None,
            },
            ..TokenReview::default()
        };
        let api: kube::Api<TokenReview> = kube::Api::all(self.client.clone());
        let reviewed =
            tokio::time::timeout(REVIEW_TIMEOUT, api.create(&PostParams::default(), &review))
                .await
                .map_err(|_| FAILED)?
                .map_err(|e| {
                    warn!(error = %e, "TokenReview of a metrics scrape failed");
                    FAILED
                })?;
        let status = reviewed.status.unwrap_or_default();
        let Some(user) = status.user.filter(|_| status.authenticated == Some(true)) else {
            debug!(error = ?status.error, "metrics scrape: token not authenticated");
            return Ok(Verdict::Unauthenticated);
        };
        let sar = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username.clone(),
                uid: user.uid,
                groups: user.groups,
                extra: user.extra,
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some("/metrics".into()),
                    verb: Some("get".into()),
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let api: kube::Api<SubjectAccessReview> = kube::Api::all(self.client.clone());
        let decided =
            tokio::time::timeout(REVIEW_TIMEOUT, api.create(&PostParams::default(), &sar))
                .await
                .map_err(|_| FAILED)?
                .map_err(|e| {
                    warn!(error = %e, "SubjectAccessReview of a metrics scrape failed");
                    FAILED
                })?;
        let allowed = decided.status.is_some_and(|s| s.allowed);
        debug!(user = ?user.username, allowed, "metrics scrape reviewed");
        Ok(if allowed {
            Verdict::Allowed
        } else {
            Verdict::Forbidden
        })
    }
}
