//! `docs/config.md` documents every field and value the opaque config accepts.
//!
//! The accepted names are not listed by hand here: a fully-populated `GpuConfig` and
//! `MigConfig` (every optional field set) are serialised and their keys walked; at every
//! object of the schema one extra key is added and strict decoding must refuse it, and the
//! refusal's "expected one of ..." list must equal the keys found there (so a field that
//! serialisation skips cannot hide). Enum values come from serde's "unknown variant"
//! message the same way. Each name must appear backticked in the first cell of a table row
//! of the page (fields as dotted paths, `sharing.mps.activeThreadPercentage`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use cleave_api::{
    ConfigError, DeviceConfig, GpuConfig, MigConfig, MpsConfig, PinnedMemoryLimit, Quantity,
    Sharing, SharingStrategy, TimeSliceInterval, TimeSlicingConfig, parse_config,
};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// Objects whose keys are user data, not schema fields.
const FREE_FORM_MAPS: &[&str] = &["sharing.mps.pinnedMemoryLimit.perDevice"];

/// A key no release accepts.
const EXTRA_KEY: &str = "notAFieldOfTheSchema";

fn page() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/config.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Backticked names in the first cell of every table row of `text`.
fn documented_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines().map(str::trim) {
        let Some(row) = line.strip_prefix('|') else {
            continue;
        };
        let first = row.split('|').next().unwrap_or("");
        names.extend(backticked(first));
    }
    names
}

/// Every `...` token of `s`.
fn backticked(s: &str) -> Vec<String> {
    s.split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, t)| t.to_owned())
        .collect()
}

fn full_sharing() -> Sharing {
    let mut per_device = BTreeMap::new();
    per_device.insert("0".to_owned(), Quantity::parse("1Gi").unwrap());
    Sharing {
        strategy: SharingStrategy::Mps,
        // Both blocks at once: serialisation does not validate, and the walk needs both.
        time_slicing: Some(TimeSlicingConfig {
            interval: Some(TimeSliceInterval::Long),
        }),
        mps: Some(MpsConfig {
            active_thread_percentage: Some(50),
            pinned_memory_limit: Some(PinnedMemoryLimit {
                default: Some(Quantity::parse("2Gi").unwrap()),
                per_device,
            }),
            multi_user: Some(true),
        }),
    }
}

fn full_configs() -> Vec<(&'static str, Value)> {
    let gpu = DeviceConfig::Gpu(GpuConfig {
        sharing: Some(full_sharing()),
    });
    let mig = DeviceConfig::Mig(MigConfig {
        sharing: Some(full_sharing()),
    });
    vec![
        ("GpuConfig", serde_json::to_value(&gpu).unwrap()),
        ("MigConfig", serde_json::to_value(&mig).unwrap()),
    ]
}

/// Dotted paths of the schema objects of `v` (`""` for the top level) with their keys.
fn objects(v: &Value, path: &str, out: &mut BTreeMap<String, BTreeSet<String>>) {
    let Value::Object(map) = v else { return };
    if FREE_FORM_MAPS.contains(&path) {
        return;
    }
    out.insert(path.to_owned(), map.keys().cloned().collect());
    for (k, child) in map {
        objects(child, &join(path, k), out);
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

fn object_at<'a>(v: &'a mut Value, path: &str) -> &'a mut serde_json::Map<String, Value> {
    let mut cur = v;
    if !path.is_empty() {
        for part in path.split('.') {
            cur = cur.get_mut(part).unwrap();
        }
    }
    cur.as_object_mut().unwrap()
}

/// The names serde lists after "expected" in an unknown-field or unknown-variant message.
fn expected_list(message: &str) -> BTreeSet<String> {
    let (_, tail) = message
        .split_once("expected")
        .unwrap_or_else(|| panic!("no expected list in {message:?}"));
    backticked(tail).into_iter().collect()
}

/// Every accepted value of an enum, from the error for a value none accepts.
fn variants<T: DeserializeOwned + std::fmt::Debug>() -> BTreeSet<String> {
    match serde_json::from_value::<T>(json!(EXTRA_KEY)) {
        Ok(v) => panic!("{EXTRA_KEY:?} decoded as {v:?}"),
        Err(e) => {
            let message = e.to_string();
            assert!(message.contains("unknown variant"), "{message}");
            expected_list(&message)
        }
    }
}

/// Every accepted field path, proven against strict decoding.
fn accepted_fields() -> BTreeSet<String> {
    let mut fields = BTreeSet::new();
    for (kind, full) in full_configs() {
        parse_config(&full).unwrap_or_else(|e| panic!("full {kind} does not decode: {e}"));
        let mut objs = BTreeMap::new();
        objects(&full, "", &mut objs);
        assert!(objs.len() >= 5, "{kind}: walk found only {objs:?}");
        for (path, keys) in &objs {
            let mut extra = full.clone();
            object_at(&mut extra, path).insert(EXTRA_KEY.to_owned(), json!(1));
            match parse_config(&extra) {
                Err(ConfigError::Decode { message, .. }) if message.contains("unknown field") => {
                    assert_eq!(
                        &expected_list(&message),
                        keys,
                        "{kind}: fields accepted at {path:?} differ from what serialisation wrote"
                    );
                }
                other => panic!("{kind}: an extra key at {path:?} was not refused: {other:?}"),
            }
            fields.extend(keys.iter().map(|k| join(path, k)));
        }
    }
    fields
}

#[test]
fn every_accepted_field_is_documented() {
    let documented = documented_names(&page());
    let fields = accepted_fields();
    let missing: Vec<&String> = fields.iter().filter(|f| !documented.contains(*f)).collect();
    assert!(
        missing.is_empty(),
        "docs/config.md has no table row for {missing:?} (write the dotted path backticked in the first cell)"
    );
}

#[test]
fn every_kind_and_enum_value_is_documented() {
    let documented = documented_names(&page());
    let mut names: BTreeSet<String> = ["GpuConfig", "MigConfig"].map(String::from).into();
    names.extend(variants::<SharingStrategy>());
    names.extend(variants::<TimeSliceInterval>());
    assert!(names.len() >= 8, "{names:?}");
    let missing: Vec<&String> = names.iter().filter(|n| !documented.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "docs/config.md has no table row for {missing:?}"
    );
}

#[test]
fn the_walk_sees_every_nesting_level() {
    // Guards the test itself: a walk that stopped early would document nothing.
    let fields = accepted_fields();
    for f in [
        "apiVersion",
        "kind",
        "sharing.strategy",
        "sharing.timeSlicing.interval",
        "sharing.mps.pinnedMemoryLimit.perDevice",
        "sharing.mps.pinnedMemoryLimit.default",
    ] {
        assert!(fields.contains(f), "{f} not found in {fields:?}");
    }
    assert_eq!(
        documented_names("| `a` and `b` | `c` |\n`d`\n| x |"),
        ["a", "b"].map(String::from).into()
    );
}
