//! ValidatingAdmissionPolicies evaluated with CEL as the API server does on a CREATE
//! (admissionregistration.k8s.io/v1): the resource rules pick the policy, `matchConditions`
//! must all hold, `variables` are evaluated in order (each sees the ones before it as
//! `variables.<name>`), and the first validation that is false denies, with its
//! `messageExpression` (else `message`, else the expression) as the message. An error in an
//! expression counts as a denial under `failurePolicy: Fail` (the default) and is ignored
//! under `Ignore`. Policies with `paramKind` are refused (none is modelled).

use std::sync::Arc;

use cel::Value;
use serde_json::Value as Json;

use crate::cel_env::{self, CelError, Programs};

/// A denial: the policy's name and the message the API server would return.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    pub policy: String,
    pub message: String,
}

/// Why a policy cannot be evaluated here.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("policy {0}: paramKind is not modelled")]
    Params(String),
    #[error("policy {policy}: {source}")]
    Cel {
        policy: String,
        #[source]
        source: CelError,
    },
}

/// Whether `policy` applies to a CREATE of `resource` in `group`.
fn matches(policy: &Json, group: &str, resource: &str) -> bool {
    let rules = policy["spec"]["matchConstraints"]["resourceRules"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let has = |list: &Json, want: &str| {
        list.as_array()
            .is_some_and(|l| l.iter().any(|v| v == want || v == "*"))
    };
    rules.iter().any(|r| {
        has(&r["apiGroups"], group)
            && has(&r["resources"], resource)
            && has(&r["operations"], "CREATE")
    })
}

/// Evaluates `policies` on a CREATE of `object` (`group`/`resource`); the first denial.
pub fn admit(
    policies: &[Json],
    group: &str,
    resource: &str,
    object: &Json,
) -> Result<Option<Denial>, PolicyError> {
    let env = cel_env::env();
    let mut programs = Programs::default();
    for p in policies.iter().filter(|p| matches(p, group, resource)) {
        let name = p["metadata"]["name"].as_str().unwrap_or("?").to_owned();
        if !p["spec"]["paramKind"].is_null() {
            return Err(PolicyError::Params(name));
        }
        let fail_closed = p["spec"]["failurePolicy"].as_str() != Some("Ignore");
        let cel_err = |source| PolicyError::Cel {
            policy: name.clone(),
            source,
        };
        let mut ctx = cel_env::context(&env);
        ctx.add_variable_from_value("object", cel_env::json_value(object));
        ctx.add_variable_from_value("oldObject", Value::Null);
        // An error while evaluating: a denial under Fail, the policy skipped under Ignore.
        let failed = |e: CelError| -> Option<Denial> {
            fail_closed.then(|| Denial {
                policy: name.clone(),
                message: format!("policy evaluation failed: {e}"),
            })
        };
        let mut skip = false;
        for c in p["spec"]["matchConditions"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let expr = c["expression"].as_str().unwrap_or_default();
            let prog = programs.get(&env, expr).map_err(cel_err)?;
            match cel_env::eval_bool(&prog, &ctx, expr) {
                Ok(true) => {}
                Ok(false) => skip = true,
                Err(e) => match failed(e) {
                    Some(d) => return Ok(Some(d)),
                    None => skip = true,
                },
            }
        }
        if skip {
            continue;
        }
        let mut vars: Vec<(String, Value)> = Vec::new();
        let mut broken = None;
        for v in p["spec"]["variables"].as_array().into_iter().flatten() {
            let expr = v["expression"].as_str().unwrap_or_default();
            let prog = programs.get(&env, expr).map_err(cel_err)?;
            ctx.add_variable_from_value("variables", cel_env::map(vars.clone()));
            match cel_env::eval(&prog, &ctx, expr) {
                Ok(val) => vars.push((v["name"].as_str().unwrap_or("?").to_owned(), val)),
                // Upstream evaluates variables lazily; an error counts where it is used.
                Err(e) => {
                    broken.get_or_insert(e);
                }
            }
        }
        ctx.add_variable_from_value("variables", cel_env::map(vars));
        for v in p["spec"]["validations"].as_array().into_iter().flatten() {
            let expr = v["expression"].as_str().unwrap_or_default();
            let prog = programs.get(&env, expr).map_err(cel_err)?;
            let ok = match cel_env::eval_bool(&prog, &ctx, expr) {
                Ok(ok) => ok,
                Err(e) => match failed(broken.take().unwrap_or(e)) {
                    Some(d) => return Ok(Some(d)),
                    None => continue,
                },
            };
            if ok {
                continue;
            }
            let message = match v["messageExpression"].as_str() {
                Some(m) => {
                    let prog = programs.get(&env, m).map_err(cel_err)?;
                    match cel_env::eval(&prog, &ctx, m) {
                        Ok(Value::String(s)) => Some(Arc::unwrap_or_clone(s)),
                        _ => None,
                    }
                }
                None => None,
            }
            .or_else(|| v["message"].as_str().map(str::to_owned))
            .unwrap_or_else(|| format!("failed expression: {expr}"));
            return Ok(Some(Denial {
                policy: name,
                message,
            }));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy() -> Json {
        json!({
            "metadata": {"name": "p"},
            "spec": {
                "matchConstraints": {"resourceRules": [{"apiGroups": ["resource.k8s.io"], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["resourceclaims"]}]},
                "matchConditions": [{"name": "ours", "expression": "has(object.metadata.labels) && 'x' in object.metadata.labels"}],
                "variables": [
                    {"name": "n", "expression": "size(object.spec.devices.requests)"},
                    {"name": "many", "expression": "variables.n > 1"}
                ],
                "validations": [{"expression": "!variables.many", "messageExpression": "'too many: ' + string(variables.n)"}]
            }
        })
    }

    fn claim(n: usize, label: bool) -> Json {
        let reqs: Vec<Json> = (0..n).map(|i| json!({"name": format!("r{i}")})).collect();
        let mut c = json!({"metadata": {"name": "c"}, "spec": {"devices": {"requests": reqs}}});
        if label {
            c["metadata"]["labels"] = json!({"x": "y"});
        }
        c
    }

    #[test]
    fn variables_in_order_and_the_message_expression() {
        let d = admit(
            &[policy()],
            "resource.k8s.io",
            "resourceclaims",
            &claim(2, true),
        )
        .unwrap()
        .unwrap();
        assert_eq!(d.message, "too many: 2");
        assert_eq!(d.policy, "p");
        assert!(
            admit(
                &[policy()],
                "resource.k8s.io",
                "resourceclaims",
                &claim(1, true)
            )
            .unwrap()
            .is_none()
        );
    }

    #[test]
    fn match_conditions_and_resources_select_the_policy() {
        assert!(
            admit(
                &[policy()],
                "resource.k8s.io",
                "resourceclaims",
                &claim(2, false)
            )
            .unwrap()
            .is_none()
        );
        assert!(
            admit(&[policy()], "resource.k8s.io", "pods", &claim(2, true))
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn an_error_denies_under_fail_and_is_ignored_under_ignore() {
        let mut p = policy();
        p["spec"]["validations"][0]["expression"] = json!("object.spec.nothing == 1");
        let d = admit(
            &[p.clone()],
            "resource.k8s.io",
            "resourceclaims",
            &claim(1, true),
        )
        .unwrap();
        assert!(d.is_some_and(|d| d.message.contains("failed")));
        p["spec"]["failurePolicy"] = json!("Ignore");
        assert!(
            admit(&[p], "resource.k8s.io", "resourceclaims", &claim(1, true))
                .unwrap()
                .is_none()
        );
    }
}
