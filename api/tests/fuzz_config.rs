//! Fuzzing the opaque config decoder (proptest, bounded so CI stays fast): arbitrary JSON
//! values and mutations of valid configs (fields dropped, replaced by arbitrary values,
//! unknown fields added, strings and numbers changed). The decoder never panics, a value it
//! accepts re-encodes and decodes to itself, and every rejection carries a message that
//! names a field path or the reason.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use cleave_api::config::{ConfigError, decode_config};
use proptest::prelude::*;
use serde_json::{Value, json};

/// Arbitrary JSON, nested a few levels, with the strings the decoder looks for mixed in.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        any::<u64>().prop_map(|n| json!(n)),
        ".{0,24}".prop_map(Value::String),
        prop_oneof![
            Just("gpu.cleave.dev/v1alpha1"),
            Just("GpuConfig"),
            Just("MigConfig"),
            Just("MPS"),
            Just("TimeSlicing"),
            Just("Long"),
            Just("10Gi"),
            Just("-1Gi"),
            Just("1e400"),
            Just("GPU-00000000-0000-0000-0000-000000000000"),
        ]
        .prop_map(|s| Value::String(s.into())),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(key(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        prop_oneof![
            Just("apiVersion"),
            Just("kind"),
            Just("sharing"),
            Just("strategy"),
            Just("mps"),
            Just("timeSlicing"),
            Just("interval"),
            Just("activeThreadPercentage"),
            Just("pinnedMemoryLimit"),
            Just("default"),
            Just("perDevice"),
        ]
        .prop_map(str::to_owned),
        "[a-zA-Z0-9._-]{0,12}",
    ]
}

fn valid_configs() -> Vec<Value> {
    vec![
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig"}),
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "MigConfig"}),
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
               "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}}),
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
               "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 25,
                 "pinnedMemoryLimit": {"default": "10Gi",
                   "perDevice": {"0": "4Gi", "GPU-00000000-0000-0000-0000-000000000000": "1Gi"}}}}}),
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "MigConfig",
               "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 100}}}),
    ]
}

/// Every object path (`["sharing", "mps"]`) in `v`.
fn paths(v: &Value, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    if let Value::Object(m) = v {
        for (k, child) in m {
            prefix.push(k.clone());
            out.push(prefix.clone());
            paths(child, prefix, out);
            prefix.pop();
        }
    }
}

fn at_mut<'a>(v: &'a mut Value, path: &[String]) -> Option<&'a mut Value> {
    path.iter().try_fold(v, |v, k| v.get_mut(k))
}

#[derive(Debug, Clone)]
enum Mutation {
    Drop,
    Replace(Value),
    AddField(String, Value),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        Just(Mutation::Drop),
        any_json().prop_map(Mutation::Replace),
        (key(), any_json()).prop_map(|(k, v)| Mutation::AddField(k, v)),
    ]
}

/// Decodes and checks the contract: no panic (the test would fail), an accepted config
/// round-trips, a rejection has a useful message.
fn check(raw: &Value) -> Result<(), TestCaseError> {
    match decode_config(raw) {
        Ok(config) => {
            let again = serde_json::to_value(&config).unwrap();
            let decoded = decode_config(&again);
            prop_assert_eq!(
                decoded.as_ref().ok(),
                Some(&config),
                "re-encoded: {}",
                again
            );
        }
        Err(e) => {
            let msg = e.to_string();
            prop_assert!(!msg.trim().is_empty(), "empty message for {raw}");
            match &e {
                ConfigError::Decode { path, message } => {
                    // The reason is always there; the path is empty (or `.`) at the top
                    // level, where the message names the field.
                    prop_assert!(!message.trim().is_empty(), "{raw}: {e:?}");
                    if path.is_empty() || path == "." {
                        prop_assert!(msg == *message, "{msg}");
                    } else {
                        prop_assert!(msg.starts_with(path.as_str()), "{msg}");
                    }
                }
                ConfigError::NotAnObject { .. } => prop_assert!(!raw.is_object()),
                ConfigError::Invalid(_) => {
                    // Validation messages start with the field path.
                    prop_assert!(msg.contains(':'), "{msg}");
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_json_never_panics_and_errors_explain(raw in any_json()) {
        check(&raw)?;
    }

    #[test]
    fn mutated_valid_configs_never_panic_and_errors_explain(
        which in 0usize..5,
        muts in prop::collection::vec((any::<prop::sample::Index>(), mutation()), 1..4),
    ) {
        let mut raw = valid_configs()[which].clone();
        for (index, m) in muts {
            let mut all = Vec::new();
            paths(&raw, &mut Vec::new(), &mut all);
            if all.is_empty() {
                break;
            }
            let path = index.get(&all).clone();
            let (last, parent) = path.split_last().unwrap();
            match m {
                Mutation::Drop => {
                    if let Some(Value::Object(o)) = at_mut(&mut raw, parent) {
                        o.remove(last);
                    }
                }
                Mutation::Replace(v) => {
                    if let Some(slot) = at_mut(&mut raw, &path) {
                        *slot = v;
                    }
                }
                Mutation::AddField(k, v) => {
                    if let Some(Value::Object(o)) = at_mut(&mut raw, parent) {
                        o.insert(k, v);
                    }
                }
            }
        }
        check(&raw)?;
    }
}

/// The valid seeds decode (so the mutation test starts from accepted configs).
#[test]
fn seeds_are_valid() {
    for raw in valid_configs() {
        decode_config(&raw).unwrap();
    }
}

/// Deep nesting and huge inputs are rejected quickly, not by stack overflow.
#[test]
fn deep_and_large_inputs_are_rejected_quickly() {
    let mut deep = json!(1);
    for _ in 0..100 {
        deep = json!({"sharing": deep});
    }
    let raw =
        json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig", "sharing": deep});
    let started = std::time::Instant::now();
    let e = decode_config(&raw).unwrap_err();
    assert!(e.to_string().contains("sharing"), "{e}");
    let big = json!({"apiVersion": "gpu.cleave.dev/v1alpha1", "kind": "GpuConfig",
                     "x": "a".repeat(1 << 20)});
    let e = decode_config(&big).unwrap_err();
    assert!(e.to_string().contains('x'), "{e}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
}
