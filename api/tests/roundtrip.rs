//! Property tests: every valid config survives JSON (and YAML) round trips unchanged, and
//! quantities evaluate to the exact integer their text denotes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use cleave_api::{
    DeviceConfig, GpuConfig, MigConfig, MpsConfig, PinnedMemoryLimit, Quantity, Sharing,
    SharingStrategy, TimeSliceInterval, TimeSlicingConfig, decode_config, parse_config,
};
use proptest::prelude::*;

/// Positive quantities in the forms users write: plain, decimal and binary suffixes,
/// exponents, and fractions that are whole after scaling.
fn positive_quantity() -> impl Strategy<Value = Quantity> {
    let suffixed = (
        1u32..100_000,
        prop::sample::select(vec![
            "", "k", "M", "G", "T", "Ki", "Mi", "Gi", "Ti", "e3", "e6", "E2",
        ]),
    )
        .prop_map(|(n, s)| format!("{n}{s}"));
    let fractional = (
        0u32..64,
        prop::sample::select(vec!["5", "25", "125", "75"]),
        prop::sample::select(vec!["Ki", "Mi", "Gi"]),
    )
        .prop_map(|(i, f, s)| format!("{i}.{f}{s}"));
    prop_oneof![suffixed, fractional].prop_filter_map("zero", |t| {
        Quantity::parse(&t).ok().filter(Quantity::is_positive)
    })
}

fn device_key() -> impl Strategy<Value = String> {
    let uuid = (prop::bool::ANY, prop::array::uniform16(any::<u8>())).prop_map(|(mig, b)| {
        let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
        format!(
            "{}-{}-{}-{}-{}-{}",
            if mig { "MIG" } else { "GPU" },
            &h[0..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..32]
        )
    });
    prop_oneof![uuid, any::<u32>().prop_map(|i| i.to_string())]
}

fn mps() -> impl Strategy<Value = MpsConfig> {
    let limit = (
        prop::option::of(positive_quantity()),
        prop::collection::btree_map(device_key(), positive_quantity(), 0..4),
    )
        .prop_map(
            |(default, per_device): (_, BTreeMap<_, _>)| PinnedMemoryLimit {
                default,
                per_device,
            },
        );
    (
        prop::option::of(1u8..=100),
        prop::option::of(limit),
        prop::option::of(any::<bool>()),
    )
        .prop_map(|(a, p, m)| MpsConfig {
            active_thread_percentage: a,
            pinned_memory_limit: p,
            multi_user: m,
        })
}

fn sharing(mig: bool) -> impl Strategy<Value = Option<Sharing>> {
    let interval = if mig {
        Just(TimeSliceInterval::Default).boxed()
    } else {
        prop::sample::select(vec![
            TimeSliceInterval::Default,
            TimeSliceInterval::Short,
            TimeSliceInterval::Medium,
            TimeSliceInterval::Long,
        ])
        .boxed()
    };
    let ts = prop::option::of(
        prop::option::of(interval).prop_map(|interval| TimeSlicingConfig { interval }),
    )
    .prop_map(|time_slicing| Sharing {
        strategy: SharingStrategy::TimeSlicing,
        time_slicing,
        mps: None,
    });
    let mps = prop::option::of(mps()).prop_map(|mps| Sharing {
        strategy: SharingStrategy::Mps,
        time_slicing: None,
        mps,
    });
    prop::option::of(prop_oneof![ts, mps])
}

fn config() -> impl Strategy<Value = DeviceConfig> {
    prop_oneof![
        sharing(false).prop_map(|sharing| DeviceConfig::Gpu(GpuConfig { sharing })),
        sharing(true).prop_map(|sharing| DeviceConfig::Mig(MigConfig { sharing })),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn valid_configs_round_trip_through_json(c in config()) {
        prop_assert_eq!(c.validate(), Ok(()));
        let json = serde_json::to_value(&c).unwrap();
        prop_assert_eq!(&parse_config(&json).unwrap(), &c);
        // Through text too, as the API server stores it.
        let text = serde_json::to_string(&c).unwrap();
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        prop_assert_eq!(&parse_config(&back).unwrap(), &c);
        // With defaults applied, the full pipeline is the identity.
        let mut defaulted = c.clone();
        defaulted.apply_defaults();
        let json = serde_json::to_value(&defaulted).unwrap();
        prop_assert_eq!(decode_config(&json).unwrap(), defaulted);
    }

    #[test]
    fn valid_configs_round_trip_through_yaml(c in config()) {
        let yaml = serde_yaml::to_string(&c).unwrap();
        let back: serde_json::Value = serde_yaml::from_str(&yaml).unwrap();
        prop_assert_eq!(parse_config(&back).unwrap(), c);
    }

    #[test]
    fn defaulting_is_idempotent(c in config()) {
        let mut once = c.clone();
        once.apply_defaults();
        let mut twice = once.clone();
        twice.apply_defaults();
        prop_assert_eq!(once, twice);
    }

    #[test]
    fn integer_quantities_are_exact(n in -1_000_000i64..1_000_000, s in 0usize..10) {
        let (suffix, mult): (&str, i64) = [
            ("", 1), ("k", 1_000), ("M", 1_000_000), ("G", 1_000_000_000), ("T", 1_000_000_000_000),
            ("Ki", 1 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30), ("Ti", 1 << 40), ("e4", 10_000),
        ][s];
        let q = Quantity::parse(&format!("{n}{suffix}")).unwrap();
        prop_assert_eq!(q.value(), n * mult);
    }

    #[test]
    fn fractional_binary_quantities_are_exact_or_rejected(i in 0i64..1000, f in 0u32..1000) {
        // i.f Ki = (i * 1000 + f) * 1024 / 1000 bytes: whole exactly when 125 divides f.
        let text = format!("{i}.{f:03}Ki");
        let numerator = (i * 1000 + i64::from(f)) * 1024;
        match Quantity::parse(&text) {
            Ok(q) => {
                prop_assert_eq!(numerator % 1000, 0);
                prop_assert_eq!(q.value(), numerator / 1000);
            }
            Err(e) => {
                prop_assert_ne!(numerator % 1000, 0);
                prop_assert_eq!(e.to_string(), format!("invalid quantity {text:?}: not a whole number of bytes"));
            }
        }
    }
}
