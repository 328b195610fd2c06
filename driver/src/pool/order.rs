//! Publishing orders of one MIG profile's placements. The scheduler takes the first free
//! device in publish order, so this order decides which memory slices stay free for later
//! requests. The candidates are compared against the exact optimum by the packing
//! simulator in `hack/packing` (`cargo bench -p cleave-packing --bench packing`), whose
//! tests fail when another candidate beats [`PlacementOrder::DEFAULT`].

use crate::model::{MigProfile, Placement};

/// A publishing order of one profile's placements (candidates compared by simulation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PlacementOrder {
    /// Highest start first: small instances fill the GPU from the top, keeping the low
    /// slices (where `4g` and `7g` must start) free longest.
    DescendingStart,
    /// Lowest start first (the order NVML lists them).
    AscendingStart,
    /// Profiles of up to two memory slices from the top, larger ones from the bottom
    /// (small and big requests grow towards each other).
    SmallHighBigLow,
    /// A fixed preference in the spirit of NVIDIA's packing advice: first the placements
    /// that no larger profile of the same compute width can use (`1g` at 6, `1g.2x` at 6),
    /// then the upper half, then the lower half, each from its low end.
    UpperHalfFirst,
    /// The top slot first, then the lower half from its top, then the rest of the upper
    /// half: keeps slices 4-7 whole for a `3g` at 4 (the only `3g` left once the lower
    /// half is used), at the price of the `4g`/`7g` start at 0.
    TopThenLowerHalf,
    /// Small instances (under half the GPU) fill the lower half from slice 0 up, then the
    /// top slot (6, which only a small instance or a `3g` at 4 can use), then the rest of
    /// the upper half; half-GPU and larger profiles from the highest start (`3g` at 4
    /// first). Keeps slices 4-7 whole for a `3g` at 4 the longest, giving up the `4g`/`7g`
    /// start at 0 sooner.
    LowHalfFirst,
}

impl PlacementOrder {
    /// Every candidate, in a fixed order (the default wins ties by being first).
    pub const ALL: [PlacementOrder; 6] = [
        PlacementOrder::DescendingStart,
        PlacementOrder::AscendingStart,
        PlacementOrder::SmallHighBigLow,
        PlacementOrder::UpperHalfFirst,
        PlacementOrder::TopThenLowerHalf,
        PlacementOrder::LowHalfFirst,
    ];

    /// The order [`crate::pool::order_placements`] publishes: the candidate with the best
    /// selection score in `hack/packing` (its test re-runs the comparison and fails if
    /// another candidate wins).
    pub const DEFAULT: PlacementOrder = PlacementOrder::LowHalfFirst;

    /// Short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            Self::DescendingStart => "descending-start",
            Self::AscendingStart => "ascending-start",
            Self::SmallHighBigLow => "small-high-big-low",
            Self::UpperHalfFirst => "upper-half-first",
            Self::TopThenLowerHalf => "top-then-lower-half",
            Self::LowHalfFirst => "low-half-first",
        }
    }

    /// Sorts `placements` of `profile` into this order (stable for equal keys).
    pub fn sort(self, profile: &MigProfile, placements: &mut [Placement]) {
        let _ = profile;
        match self {
            Self::DescendingStart => {
                placements.sort_by(|a, b| b.start.cmp(&a.start).then(a.size.cmp(&b.size)));
            }
            Self::AscendingStart => {
                placements.sort_by(|a, b| a.start.cmp(&b.start).then(a.size.cmp(&b.size)));
            }
            Self::SmallHighBigLow => placements.sort_by(|a, b| {
                if a.size.max(b.size) <= 2 {
                    b.start.cmp(&a.start)
                } else {
                    a.start.cmp(&b.start)
                }
                .then(a.size.cmp(&b.size))
            }),
            Self::UpperHalfFirst => {
                // Memory slices of these GPUs: 8, halves of 4. Rank: the top slot (6),
                // then the upper half ascending, then the lower half ascending.
                let half = 4;
                let rank = |p: &Placement| {
                    if p.start + p.size >= 2 * half - 1 && p.size < half {
                        (0, p.start)
                    } else if p.start >= half {
                        (1, p.start)
                    } else {
                        (2, p.start)
                    }
                };
                placements.sort_by(|a, b| rank(a).cmp(&rank(b)).then(a.size.cmp(&b.size)));
            }
            Self::TopThenLowerHalf => {
                let half = 4;
                let rank = |p: &Placement| {
                    if p.size >= half {
                        (0, u32::MAX - p.start)
                    } else if p.start + p.size >= 2 * half - 1 {
                        (0, 0)
                    } else if p.start < half {
                        (1, u32::MAX - p.start)
                    } else {
                        (2, u32::MAX - p.start)
                    }
                };
                placements.sort_by(|a, b| rank(a).cmp(&rank(b)).then(a.size.cmp(&b.size)));
            }
            Self::LowHalfFirst => {
                let half = 4;
                let rank = |p: &Placement| {
                    if p.size >= half {
                        (0, u32::MAX - p.start)
                    } else if p.start + p.size <= half {
                        (0, p.start)
                    } else if p.start + p.size >= 2 * half - 1 {
                        (1, 0)
                    } else {
                        (2, p.start)
                    }
                };
                placements.sort_by(|a, b| rank(a).cmp(&rank(b)).then(a.size.cmp(&b.size)));
            }
        }
    }
}
