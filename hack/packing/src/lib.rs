//! How well the scheduler packs on-demand MIG devices, and which publishing order packs best.
//!
//! **Scheduler model.** In on-demand mode (see `cleave_driver::pool`) every placement of every
//! profile of a GPU is a device, all consuming one counter set: a counter per memory slice
//! (overlapping placements share one), `compute-slices` (7) and an instance counter for
//! profiles that allow fewer instances than placements (`+me`: one per GPU). The DRA
//! allocator walks the pool's devices in published order (one group per GPU, GPUs by minor
//! number, so GPU by GPU) and gives a request the first device that matches its selector
//! (here: the profile name) and whose counters still fit. So a request takes the first free
//! placement of its profile on the lowest GPU that has one. The order of *profiles* does
//! not matter for such requests (other profiles' devices never match); the order of each
//! profile's *placements* does: it decides which slices stay free for later requests.
//!
//! **Simulation** ([`compare`]): a node of `gpus` identical GPUs (8 in the bench) and
//! random streams of requests drawn from a [`Mix`] (weights per profile kind), each
//! admitted by first fit in published order or rejected. Three [`Mode`]s:
//! - *fill*: arrivals only, until the first rejection; reference: the longest prefix of the
//!   stream that fits on the node at once (exact). Measures fragmentation alone.
//! - *count*: arrivals only, the whole stream (compute demand 1.5x the node), rejected
//!   requests skipped; reference: the most requests of the stream that fit at once (exact,
//!   the offline optimum for the same multiset). It rewards rejecting big requests, so it
//!   is reported but does not choose the order.
//! - *churn*: random lifetimes, offered load about 1.2x the node; compute slices admitted
//!   against a **repacking oracle** that admits whenever the live requests plus the new one
//!   fit when re-placed from scratch (as if instances could move). Not an optimum over
//!   time (admitting greedily can block later requests).
//!
//! The order is chosen by [`selection_score`] (fill and churn, A100-40GB and H100, three
//! mixes, among them the 40/30/20/10 % 1g/2g/3g/4g stream) and published by `cleave_driver::pool::order_placements` as [`PlacementOrder::DEFAULT`];
//! a unit test fails if another candidate scores higher. On these tables the lower half
//! (slices 0-3) is mirror-symmetric for every profile that fits in it, so orders that
//! differ only by that mirror (descending start and upper-half-first) score the same.
//!
//! **Exact optimum.** All valid placement sets of one GPU are enumerated (include or skip
//! each of the 25 devices, pruned by the counters) and reduced to the maximal vectors of
//! instance counts per profile ([`GpuShape::configurations`]; 44 on A100/H100/H200). Whether a multiset of
//! requests fits on `n` GPUs ([`GpuShape::fits`]) is an exhaustive depth-first search that
//! gives one GPU a configuration at a time, memoised on (GPUs left, demand left) and pruned
//! by compute and memory totals: exact, because every packing of a GPU is covered by some
//! maximal configuration. The maximum ([`GpuShape::optimum`]) uses a dominance chain that
//! [`GpuShape::new`] checks on the table: unlimited profiles sorted by compute slices form a
//! chain where each profile's every placement contains a placement of the one before, with
//! no more compute (1g < 1g.2x < 2g < 3g < 4g < 7g on A100/H100/H200). Swapping a larger
//! request for a smaller one at the same place keeps a packing valid, so for a fixed number
//! of each limited profile (`+me`, tried exhaustively) some optimum takes the k smallest
//! unlimited requests, and k is found by binary search (fitting is monotone in k).
//! Unit tests compare both against a brute force over request-to-placement assignments.

pub mod capacity;
pub mod constraints;

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

use cleave_driver::model::{MigProfile, Placement};
use cleave_driver::pool::PlacementOrder;

/// Most profiles per GPU the simulation handles (A100/H100/H200 have 7): demand vectors
/// are packed one byte per profile into a `u64`.
const MAX_PROFILES: usize = 8;

/// Why a profile table cannot be simulated.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PackingError {
    /// More memory slices than the bit masks hold, or none.
    #[error("GPU with {0} memory slices cannot be simulated (1..=32)")]
    MemorySlices(u32),
    /// No profile, or more than 8 (counts are packed one byte per profile).
    #[error("{0} profiles cannot be simulated (1..=8)")]
    ProfileCount(usize),
    /// A placement reaches past the last memory slice.
    #[error("profile {profile}: placement {start}+{size} is outside the GPU")]
    Placement {
        /// Profile name.
        profile: String,
        /// First slice.
        start: u32,
        /// Slices.
        size: u32,
    },
    /// Unlimited profiles do not form a dominance chain, so the fast exact optimum does not apply.
    #[error("profiles {smaller} and {larger} form no dominance chain")]
    NoChain {
        /// The profile that should fit wherever `larger` does.
        smaller: String,
        /// The larger profile.
        larger: String,
    },
}

/// How the allocator moves from one GPU to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodeWalk {
    /// Every device of GPU 0, then GPU 1, ... (what one group per GPU publishes).
    GpuMajor,
    /// Placement by placement across all GPUs (spreads load; not publishable as one group
    /// per GPU, measured for comparison).
    Interleaved,
}

impl NodeWalk {
    /// Short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            Self::GpuMajor => "gpu-major",
            Self::Interleaved => "interleaved",
        }
    }
}

#[derive(Debug, Clone)]
struct ProfileShape {
    name: String,
    compute: u32,
    size: u32,
    /// Instance counter, when the profile allows fewer instances than placements.
    limit: Option<u32>,
    placements: Vec<Placement>,
}

/// One GPU's MIG geometry as the published counters express it.
#[derive(Debug, Clone)]
pub struct GpuShape {
    profiles: Vec<ProfileShape>,
    memory_slices: u32,
    compute: u32,
    configs: Vec<Vec<u8>>,
    /// `configs`, packed (see [`pack`]).
    packed: Vec<u64>,
    /// Unlimited profiles, smallest first (a dominance chain).
    chain: Vec<usize>,
}

fn mask(p: Placement) -> u32 {
    (((1u64 << p.size) - 1) << p.start) as u32
}

/// Counter state of one GPU.
#[derive(Debug, Clone, Copy, Default)]
struct GpuState {
    mem: u32,
    compute: u32,
    limited: [u8; MAX_PROFILES],
}

impl GpuState {
    fn fits(&self, shape: &GpuShape, p: usize, m: u32) -> bool {
        let ps = &shape.profiles[p];
        self.mem & m == 0
            && self.compute + ps.compute <= shape.compute
            && ps.limit.is_none_or(|l| u32::from(self.limited[p]) < l)
    }

    fn take(&mut self, shape: &GpuShape, p: usize, m: u32) {
        self.mem |= m;
        self.compute += shape.profiles[p].compute;
        self.limited[p] += 1;
    }

    fn release(&mut self, shape: &GpuShape, p: usize, m: u32) {
        self.mem &= !m;
        self.compute -= shape.profiles[p].compute;
        self.limited[p] -= 1;
    }
}

impl GpuShape {
    /// The geometry of a GPU with these profiles and `memory_slices` memory slices.
    pub fn new(profiles: &[MigProfile], memory_slices: u32) -> Result<Self, PackingError> {
        if memory_slices == 0 || memory_slices > 32 {
            return Err(PackingError::MemorySlices(memory_slices));
        }
        if profiles.is_empty() || profiles.len() > MAX_PROFILES {
            return Err(PackingError::ProfileCount(profiles.len()));
        }
        let mut shapes = Vec::new();
        for p in profiles {
            for pl in &p.placements {
                if pl.size == 0 || pl.start + pl.size > memory_slices {
                    return Err(PackingError::Placement {
                        profile: p.name.clone(),
                        start: pl.start,
                        size: pl.size,
                    });
                }
            }
            shapes.push(ProfileShape {
                name: p.name.clone(),
                compute: p.slice_count,
                size: p.placements.first().map_or(0, |pl| pl.size),
                limit: ((p.instance_count as usize) < p.placements.len())
                    .then_some(p.instance_count),
                placements: p.placements.clone(),
            });
        }
        let mut shape = GpuShape {
            compute: profiles.iter().map(|p| p.slice_count).max().unwrap_or(0),
            profiles: shapes,
            memory_slices,
            configs: Vec::new(),
            packed: Vec::new(),
            chain: Vec::new(),
        };
        shape.configs = shape.enumerate_configs();
        shape.packed = shape.configs.iter().map(|c| pack(c)).collect();
        shape.chain = shape.dominance_chain()?;
        Ok(shape)
    }

    /// Profile names, in the order count vectors and mixes use.
    pub fn profile_names(&self) -> Vec<&str> {
        self.profiles.iter().map(|p| p.name.as_str()).collect()
    }

    /// The maximal vectors of instance counts (per profile) one GPU can hold at once.
    pub fn configurations(&self) -> &[Vec<u8>] {
        &self.configs
    }

    fn enumerate_configs(&self) -> Vec<Vec<u8>> {
        let devices: Vec<(usize, u32)> = self
            .profiles
            .iter()
            .enumerate()
            .flat_map(|(i, p)| p.placements.iter().map(move |pl| (i, mask(*pl))))
            .collect();
        let mut seen = HashSet::new();
        let mut counts = vec![0u8; self.profiles.len()];
        self.walk_configs(&devices, 0, GpuState::default(), &mut counts, &mut seen);
        let all: Vec<Vec<u8>> = seen.into_iter().collect();
        let mut maximal: Vec<Vec<u8>> = all
            .iter()
            .filter(|c| {
                !all.iter()
                    .any(|o| o != *c && o.iter().zip(c.iter()).all(|(x, y)| x >= y))
            })
            .cloned()
            .collect();
        // Largest first: the fitting search finds packings sooner.
        maximal.sort_by(|a, b| {
            let w = |c: &Vec<u8>| -> u32 {
                c.iter()
                    .zip(&self.profiles)
                    .map(|(n, p)| u32::from(*n) * p.compute * p.size)
                    .sum()
            };
            w(b).cmp(&w(a)).then(b.cmp(a))
        });
        maximal
    }

    fn walk_configs(
        &self,
        devices: &[(usize, u32)],
        i: usize,
        st: GpuState,
        counts: &mut Vec<u8>,
        seen: &mut HashSet<Vec<u8>>,
    ) {
        let Some(&(p, m)) = devices.get(i) else {
            seen.insert(counts.clone());
            return;
        };
        self.walk_configs(devices, i + 1, st, counts, seen);
        if st.fits(self, p, m) {
            let mut next = st;
            next.take(self, p, m);
            counts[p] += 1;
            self.walk_configs(devices, i + 1, next, counts, seen);
            counts[p] -= 1;
        }
    }

    fn dominance_chain(&self) -> Result<Vec<usize>, PackingError> {
        let mut chain: Vec<usize> = (0..self.profiles.len())
            .filter(|&i| self.profiles[i].limit.is_none())
            .collect();
        chain.sort_by_key(|&i| (self.profiles[i].compute, self.profiles[i].size, i));
        for w in chain.windows(2) {
            let (small, large) = (&self.profiles[w[0]], &self.profiles[w[1]]);
            let contained = large.placements.iter().all(|lp| {
                small
                    .placements
                    .iter()
                    .any(|sp| mask(*sp) & !mask(*lp) == 0)
            });
            if !contained || small.compute > large.compute {
                return Err(PackingError::NoChain {
                    smaller: small.name.clone(),
                    larger: large.name.clone(),
                });
            }
        }
        Ok(chain)
    }

    /// True if requests with these counts per profile can all exist on `gpus` GPUs at once.
    /// `memo` caches answers for this shape (pass the same map to repeated calls).
    pub fn fits(&self, demand: &[u8], gpus: usize, memo: &mut FitMemo) -> bool {
        self.fits_packed(pack(demand), gpus, memo)
    }

    fn fits_packed(&self, demand: u64, gpus: usize, memo: &mut FitMemo) -> bool {
        if demand == 0 {
            return true;
        }
        if gpus == 0 {
            return false;
        }
        let (mut compute, mut mem) = (0u64, 0u64);
        for (i, p) in self.profiles.iter().enumerate() {
            let d = lane(demand, i);
            compute += d * u64::from(p.compute);
            mem += d * u64::from(p.size);
            if p.limit.is_some_and(|l| d > u64::from(l) * gpus as u64) {
                return false;
            }
        }
        if compute > u64::from(self.compute) * gpus as u64
            || mem > u64::from(self.memory_slices) * gpus as u64
        {
            return false;
        }
        if let Some(&r) = memo.0.get(&(gpus, demand)) {
            return r;
        }
        let mut ok = false;
        for &c in &self.packed {
            // Configurations that leave the same rest meet in the memo.
            let rest = sub_saturating(demand, c, self.profiles.len());
            if rest == demand {
                continue;
            }
            if self.fits_packed(rest, gpus - 1, memo) {
                ok = true;
                break;
            }
        }
        memo.0.insert((gpus, demand), ok);
        ok
    }

    /// The largest number of these requests (counts per profile) that can exist together
    /// on `gpus` GPUs: exact (see the module doc).
    pub fn optimum(&self, demand: &[u8], gpus: usize, memo: &mut FitMemo) -> usize {
        let limited: Vec<usize> = (0..self.profiles.len())
            .filter(|&i| self.profiles[i].limit.is_some())
            .collect();
        // Every combination of limited-profile counts (one `+me` profile: up to gpus + 1).
        let caps: Vec<u8> = limited
            .iter()
            .map(|&i| {
                let l = self.profiles[i].limit.unwrap_or(0) as usize * gpus;
                demand[i].min(u8::try_from(l).unwrap_or(u8::MAX))
            })
            .collect();
        let mut best = 0;
        let mut pick = vec![0u8; limited.len()];
        loop {
            let mut base = vec![0u8; demand.len()];
            for (k, &i) in limited.iter().enumerate() {
                base[i] = pick[k];
            }
            if self.fits(&base, gpus, memo) {
                let total_unlimited: usize =
                    self.chain.iter().map(|&i| usize::from(demand[i])).sum();
                // Largest k such that base + the k smallest unlimited requests fit.
                let (mut lo, mut hi) = (0usize, total_unlimited);
                while lo < hi {
                    let mid = (lo + hi).div_ceil(2);
                    if self.fits(&self.prefix(&base, demand, mid), gpus, memo) {
                        lo = mid;
                    } else {
                        hi = mid - 1;
                    }
                }
                let taken: usize = pick.iter().map(|n| usize::from(*n)).sum();
                best = best.max(taken + lo);
            }
            // Next combination (odometer).
            let mut k = 0;
            while k < pick.len() && pick[k] == caps[k] {
                pick[k] = 0;
                k += 1;
            }
            if k == pick.len() {
                break;
            }
            pick[k] += 1;
        }
        best
    }

    /// `base` plus the `k` smallest unlimited requests of `demand` (chain order).
    fn prefix(&self, base: &[u8], demand: &[u8], mut k: usize) -> Vec<u8> {
        let mut out = base.to_vec();
        for &i in &self.chain {
            let n = usize::from(demand[i]).min(k);
            out[i] = n as u8;
            k -= n;
        }
        out
    }

    /// Each profile's placements in publishing order under `order`, as bit masks.
    fn ordered_masks(&self, order: PlacementOrder, profiles: &[MigProfile]) -> Vec<Vec<u32>> {
        profiles
            .iter()
            .map(|p| {
                let mut pls = p.placements.clone();
                order.sort(p, &mut pls);
                pls.into_iter().map(mask).collect()
            })
            .collect()
    }
}

/// Memo of [`GpuShape::fits`] answers, keyed by (GPUs, packed demand). One per shape.
#[derive(Debug, Default)]
pub struct FitMemo(HashMap<(usize, u64), bool, BuildHasherDefault<MixHasher>>);

/// A multiply-xor hasher for the memo's small integer keys (SipHash dominates the search
/// time otherwise; the keys are not attacker-controlled).
#[derive(Debug, Default)]
struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// A count vector (at most [`MAX_PROFILES`] entries) as one byte per profile.
fn pack(counts: &[u8]) -> u64 {
    counts
        .iter()
        .take(MAX_PROFILES)
        .enumerate()
        .fold(0, |acc, (i, n)| acc | (u64::from(*n) << (8 * i)))
}

/// Entry `i` of a packed count vector.
fn lane(packed: u64, i: usize) -> u64 {
    (packed >> (8 * i)) & 0xff
}

/// `a - b` per entry, at least 0, over `n` entries.
fn sub_saturating(a: u64, b: u64, n: usize) -> u64 {
    const HIGH: u64 = 0x8080_8080_8080_8080;
    if (a | b) & HIGH == 0 {
        // Every entry below 128: subtract all lanes at once. Each lane computes
        // 128 + a - b (no borrow crosses lanes); its high bit says a >= b.
        let d = (a | HIGH) - b;
        let keep = d & HIGH;
        return d & (keep - (keep >> 7));
    }
    (0..n).fold(0, |acc, i| {
        acc | (lane(a, i).saturating_sub(lane(b, i)) << (8 * i))
    })
}

impl FitMemo {
    fn bound(&mut self) {
        if self.0.len() > 2_000_000 {
            self.0.clear();
        }
    }
}

/// The first-fit allocator over a node of identical GPUs, devices in published order.
#[derive(Debug, Clone)]
pub struct FirstFit<'a> {
    shape: &'a GpuShape,
    /// Per profile: placement masks in published order.
    masks: Vec<Vec<u32>>,
    walk: NodeWalk,
    gpus: Vec<GpuState>,
}

impl<'a> FirstFit<'a> {
    /// An empty node of `gpus` GPUs of `shape` (built from `profiles`), publishing
    /// placements in `order`.
    pub fn new(
        shape: &'a GpuShape,
        profiles: &[MigProfile],
        order: PlacementOrder,
        walk: NodeWalk,
        gpus: usize,
    ) -> Self {
        Self {
            masks: shape.ordered_masks(order, profiles),
            shape,
            walk,
            gpus: vec![GpuState::default(); gpus],
        }
    }

    /// Like [`FirstFit::new`], with each profile's placement starts in an explicit order
    /// (`starts[p]`, one entry per placement of profile `p`): for searching orders that
    /// no [`PlacementOrder`] names yet.
    pub fn with_starts(
        shape: &'a GpuShape,
        starts: &[Vec<u32>],
        walk: NodeWalk,
        gpus: usize,
    ) -> Self {
        let masks = shape
            .profiles
            .iter()
            .zip(starts)
            .map(|(p, st)| {
                st.iter()
                    .map(|&start| {
                        mask(Placement {
                            start,
                            size: p.size,
                        })
                    })
                    .collect()
            })
            .collect();
        Self {
            masks,
            shape,
            walk,
            gpus: vec![GpuState::default(); gpus],
        }
    }

    /// Allocates the first fitting device for a request of profile `p` (index into the
    /// profile table); returns (GPU, placement mask) or `None` when rejected.
    pub fn allocate(&mut self, p: usize) -> Option<(usize, u32)> {
        let masks = self.masks.get(p)?;
        let found = match self.walk {
            NodeWalk::GpuMajor => (0..self.gpus.len()).find_map(|g| {
                masks
                    .iter()
                    .find(|m| self.gpus[g].fits(self.shape, p, **m))
                    .map(|m| (g, *m))
            }),
            NodeWalk::Interleaved => masks.iter().find_map(|m| {
                (0..self.gpus.len())
                    .find(|g| self.gpus[*g].fits(self.shape, p, *m))
                    .map(|g| (g, *m))
            }),
        };
        if let Some((g, m)) = found {
            self.gpus[g].take(self.shape, p, m);
        }
        found
    }

    /// Releases what [`FirstFit::allocate`] returned for profile `p`.
    pub fn release(&mut self, p: usize, (g, m): (usize, u32)) {
        self.gpus[g].release(self.shape, p, m);
    }
}

/// Request weights per profile kind.
#[derive(Debug, Clone, PartialEq)]
pub struct Mix {
    /// Name for tables.
    pub name: &'static str,
    /// Weights of `[1g, 1g+me, 1g with 2 slices, 2g, 3g, 4g, 7g]`.
    pub weights: [f64; 7],
}

impl Mix {
    /// Every profile equally likely.
    pub const UNIFORM: Mix = Mix {
        name: "uniform",
        weights: [1.0; 7],
    };
    /// Mostly the smallest instances (inference and notebooks).
    pub const SMALL_HEAVY: Mix = Mix {
        name: "small-heavy",
        weights: [12.0, 1.0, 3.0, 2.0, 1.0, 0.5, 0.5],
    };

    /// A mixed MIG stream: 40/30/20/10 % of 1g/2g/3g/4g requests, each selecting
    /// its profile (the one-slice 1g, not `+me` or the two-slice 1g).
    pub const MIG_STREAM: Mix = Mix {
        name: "1g/2g/3g/4g 40/30/20/10",
        weights: [4.0, 0.0, 0.0, 3.0, 2.0, 1.0, 0.0],
    };

    /// A guessed realistic mix for a product (more memory per slice: smaller requests).
    /// Invented weights, not measured demand: they only make the comparison less uniform.
    pub fn realistic(product: Product) -> Mix {
        let weights = match product {
            Product::A100_40GB => [3.0, 0.5, 2.0, 3.0, 3.0, 1.0, 2.0],
            Product::A100_80GB | Product::H100 => [5.0, 1.0, 3.0, 2.0, 2.0, 1.0, 1.0],
            Product::H200 => [6.0, 1.0, 2.0, 2.0, 2.0, 0.5, 1.0],
        };
        Mix {
            name: "realistic",
            weights,
        }
    }

    /// The four mixes the comparison averages over.
    pub fn all(product: Product) -> [Mix; 4] {
        [
            Self::UNIFORM,
            Self::SMALL_HEAVY,
            Self::realistic(product),
            Self::MIG_STREAM,
        ]
    }

    /// Weight per profile of `shape` (0 for a profile of no known kind).
    fn per_profile(&self, shape: &GpuShape) -> Vec<f64> {
        shape
            .profiles
            .iter()
            .map(|p| {
                let kind = match (p.compute, p.size, p.limit.is_some()) {
                    (1, 1, false) => 0,
                    (1, 1, true) => 1,
                    (1, 2, _) => 2,
                    (2, _, _) => 3,
                    (3, _, _) => 4,
                    (4, _, _) => 5,
                    (7, _, _) => 6,
                    _ => return 0.0,
                };
                self.weights[kind]
            })
            .collect()
    }
}

/// A deterministic xorshift64* generator: reproducible streams without a dependency.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value; 0 is remapped).
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// An index drawn with these weights.
    pub fn weighted(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let mut x = self.unit() * total;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len().saturating_sub(1)
    }
}

/// What a simulated stream looks like and what it is compared against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Arrivals only, until first fit rejects one: requests admitted before that, against
    /// the longest prefix of the stream that fits together (exact). Measures fragmentation
    /// alone: both sides take the same requests in the same order.
    Fill,
    /// Arrivals only, the whole stream (compute demand 1.5x the node), rejected requests
    /// skipped: requests admitted against the largest number of the stream's requests that
    /// fit together (exact). The optimum takes the smallest requests, so a placement that
    /// blocks big requests early scores *higher* here: reported, not used to choose.
    Count,
    /// Arrivals with random lifetimes (offered load about 1.2x the node): compute slices
    /// admitted against the repacking oracle (admits whenever the live requests plus the new
    /// one fit when re-placed from scratch). An upper reference, not an optimum over time.
    Churn,
}

impl Mode {
    /// Every mode.
    pub const ALL: [Mode; 3] = [Mode::Fill, Mode::Count, Mode::Churn];

    /// Short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fill => "fill until first rejection",
            Self::Count => "whole stream, requests admitted",
            Self::Churn => "churn, compute slices admitted",
        }
    }

    /// What the reference of this mode is.
    pub fn reference(self) -> &'static str {
        match self {
            Self::Fill => "exact: longest prefix that fits",
            Self::Count => "exact: most requests that fit",
            Self::Churn => "repacking oracle",
        }
    }
}

/// Simulation parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scenario {
    /// GPUs on the node.
    pub gpus: usize,
    /// Random streams simulated (each candidate sees the same streams).
    pub trials: usize,
    /// Seed of the first stream.
    pub seed: u64,
    /// Stream and reference.
    pub mode: Mode,
}

/// What each candidate and the reference admitted, summed over the trials (requests, or
/// compute slices under [`Mode::Churn`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Comparison {
    /// Admitted by the reference (see [`Mode`]).
    pub reference: u64,
    /// Admitted by first fit, one entry per candidate.
    pub admitted: Vec<u64>,
}

impl Comparison {
    /// Admitted fraction of candidate `i` against the reference.
    pub fn fraction(&self, i: usize) -> f64 {
        self.admitted[i] as f64 / self.reference.max(1) as f64
    }
}

/// Runs the same random streams through first fit under every candidate and through the
/// reference (see [`Mode`]). `profiles` must be the table `shape` was built from.
pub fn compare(
    shape: &GpuShape,
    profiles: &[MigProfile],
    mix: &Mix,
    scenario: &Scenario,
    candidates: &[(PlacementOrder, NodeWalk)],
) -> Comparison {
    let weights = mix.per_profile(shape);
    let mut memo = FitMemo::default();
    let mut out = Comparison {
        reference: 0,
        admitted: vec![0; candidates.len()],
    };
    let gpus = scenario.gpus;
    let node_compute = (shape.compute as usize * gpus) as f64;
    for t in 0..scenario.trials {
        memo.bound();
        let mut rng = Rng::new(scenario.seed.wrapping_add(t as u64));
        let fresh = |c: &(PlacementOrder, NodeWalk)| FirstFit::new(shape, profiles, c.0, c.1, gpus);
        match scenario.mode {
            Mode::Churn => {
                let stream = churn_stream(shape, &weights, node_compute, &mut rng);
                let mut oracle = Oracle::new(shape, gpus);
                out.reference += replay(shape, &stream, |live, p, arriving| {
                    if arriving {
                        oracle.admit(live, p, &mut memo)
                    } else {
                        oracle.depart(p);
                        true
                    }
                });
                for (c, cand) in candidates.iter().enumerate() {
                    let mut ff = fresh(cand);
                    let mut held: Vec<Option<(usize, u32)>> = vec![None; stream.len()];
                    let mut leaving: Vec<(usize, usize)> = Vec::new();
                    for (i, (p, life)) in stream.iter().enumerate() {
                        leaving.retain(|(end, j)| {
                            if *end > i {
                                return true;
                            }
                            if let Some(a) = held[*j].take() {
                                ff.release(stream[*j].0, a);
                            }
                            false
                        });
                        if let Some(a) = ff.allocate(*p) {
                            held[i] = Some(a);
                            leaving.push((i + life, i));
                            out.admitted[c] += u64::from(shape.profiles[*p].compute);
                        }
                    }
                }
            }
            Mode::Fill | Mode::Count => {
                let stream = arrival_stream(shape, &weights, 1.5 * node_compute, &mut rng);
                let counts = |reqs: &[usize]| {
                    let mut d = vec![0u8; shape.profiles.len()];
                    for p in reqs {
                        d[*p] = d[*p].saturating_add(1);
                    }
                    d
                };
                if scenario.mode == Mode::Count {
                    out.reference += shape.optimum(&counts(&stream), gpus, &mut memo) as u64;
                } else {
                    // Fitting is monotone in the prefix length: binary search.
                    let (mut lo, mut hi) = (0, stream.len());
                    while lo < hi {
                        let mid = (lo + hi).div_ceil(2);
                        if shape.fits(&counts(&stream[..mid]), gpus, &mut memo) {
                            lo = mid;
                        } else {
                            hi = mid - 1;
                        }
                    }
                    out.reference += lo as u64;
                }
                for (c, cand) in candidates.iter().enumerate() {
                    let mut ff = fresh(cand);
                    let mut admitted = 0;
                    for p in &stream {
                        if ff.allocate(*p).is_some() {
                            admitted += 1;
                        } else if scenario.mode == Mode::Fill {
                            break;
                        }
                    }
                    out.admitted[c] += admitted;
                }
            }
        }
    }
    out
}

/// Requests (profile indexes) until their compute demand reaches `compute`.
fn arrival_stream(shape: &GpuShape, weights: &[f64], compute: f64, rng: &mut Rng) -> Vec<usize> {
    let mut out = Vec::new();
    let mut sum = 0.0;
    while sum < compute && out.len() < 250 {
        let p = rng.weighted(weights);
        sum += f64::from(shape.profiles[p].compute);
        out.push(p);
    }
    out
}

/// Arrivals of `(profile, lifetime)`, one per step, offered load about 1.2x the node.
fn churn_stream(
    shape: &GpuShape,
    weights: &[f64],
    node_compute: f64,
    rng: &mut Rng,
) -> Vec<(usize, usize)> {
    let total: f64 = weights.iter().sum();
    let mean_compute: f64 = weights
        .iter()
        .zip(&shape.profiles)
        .map(|(w, p)| w / total * f64::from(p.compute))
        .sum();
    let mean_life = 1.2 * node_compute / mean_compute.max(1.0);
    (0..300)
        .map(|_| {
            let p = rng.weighted(weights);
            // Uniform lifetime in [1, 2 * mean].
            let life = 1 + (rng.unit() * 2.0 * mean_life) as usize;
            (p, life)
        })
        .collect()
}

/// Replays a churn stream through an admission test on the live counts per profile
/// (`admit(live, profile, true)`; departures are announced with `false`); returns the
/// compute slices admitted.
fn replay(
    shape: &GpuShape,
    stream: &[(usize, usize)],
    mut admit: impl FnMut(u64, usize, bool) -> bool,
) -> u64 {
    let mut live = 0u64;
    let mut leaving: Vec<(usize, usize)> = Vec::new();
    let mut admitted = 0;
    for (i, (p, life)) in stream.iter().enumerate() {
        leaving.retain(|(end, q)| {
            if *end > i {
                return true;
            }
            live -= 1 << (8 * q);
            admit(live, *q, false);
            false
        });
        if admit(live, *p, true) {
            live += 1 << (8 * p);
            leaving.push((i + life, *p));
            admitted += u64::from(shape.profiles[*p].compute);
        }
    }
    admitted
}

/// The repacking oracle of [`Mode::Churn`]: admits a request exactly when the live
/// requests plus it fit on the node. It keeps one packing of the live requests (counts per
/// GPU) as a witness: a request that fits into it is admitted at once, otherwise the
/// exact search decides and, when it fits, yields the new witness.
struct Oracle<'a> {
    shape: &'a GpuShape,
    /// Packed counts per GPU; each is at most some configuration.
    per_gpu: Vec<u64>,
}

impl<'a> Oracle<'a> {
    fn new(shape: &'a GpuShape, gpus: usize) -> Self {
        Self {
            shape,
            per_gpu: vec![0; gpus],
        }
    }

    fn admit(&mut self, live: u64, p: usize, memo: &mut FitMemo) -> bool {
        let one = 1u64 << (8 * p);
        let n = self.shape.profiles.len();
        let fits_one = |v: u64| {
            self.shape
                .packed
                .iter()
                .any(|c| sub_saturating(v, *c, n) == 0)
        };
        if let Some(g) = self.per_gpu.iter().position(|v| fits_one(v + one)) {
            self.per_gpu[g] += one;
            return true;
        }
        let demand = live + one;
        if !self.shape.fits_packed(demand, self.per_gpu.len(), memo) {
            return false;
        }
        // Walk the search again (memoised) to read off one configuration per GPU.
        let mut rest = demand;
        for g in 0..self.per_gpu.len() {
            let left = self.per_gpu.len() - g - 1;
            let pick = self.shape.packed.iter().find_map(|c| {
                let r = sub_saturating(rest, *c, n);
                self.shape.fits_packed(r, left, memo).then_some(r)
            });
            let r = pick.unwrap_or(rest);
            self.per_gpu[g] = rest - r;
            rest = r;
        }
        true
    }

    fn depart(&mut self, p: usize) {
        let one = 1u64 << (8 * p);
        if let Some(v) = self.per_gpu.iter_mut().find(|v| lane(**v, p) > 0) {
            *v -= one;
        }
    }
}

/// Products whose MIG tables the comparison covers (MIG profile tables, docs/hardware-sources.md).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Product {
    /// A100-SXM4-40GB / PCIe 40GB.
    A100_40GB,
    /// A100-SXM4-80GB.
    A100_80GB,
    /// H100 80GB HBM3.
    H100,
    /// H200 141GB.
    H200,
}

impl Product {
    /// Every product.
    pub const ALL: [Product; 4] = [
        Product::A100_40GB,
        Product::A100_80GB,
        Product::H100,
        Product::H200,
    ];

    /// Name for tables.
    pub fn name(self) -> &'static str {
        match self {
            Self::A100_40GB => "A100-40GB",
            Self::A100_80GB => "A100-80GB",
            Self::H100 => "H100-80GB",
            Self::H200 => "H200-141GB",
        }
    }

    /// Key of the product in the mock NVML library's tables (`h100-80gb`, ...).
    pub fn key(self) -> &'static str {
        match self {
            Self::A100_40GB => cleave_testkit::gpu::A100_40GB,
            Self::A100_80GB => cleave_testkit::gpu::A100_80GB,
            Self::H100 => cleave_testkit::gpu::H100,
            Self::H200 => cleave_testkit::gpu::H200,
        }
    }

    /// The GPU-instance profile table (ids, slices, instances, memory, SMs, engines,
    /// placements; 8 memory slices): the mock NVML library's, from MIG profile tables,
    /// docs/hardware-sources.md.
    pub fn profiles(self) -> Vec<MigProfile> {
        cleave_testkit::gpu::mig_profiles(self.key())
    }
}

/// Products the ordering is chosen on (A100 and H100 mixes).
pub const SELECTION_PRODUCTS: [Product; 2] = [Product::A100_40GB, Product::H100];

/// The score the default ordering is chosen by: the mean admitted fraction over
/// [`SELECTION_PRODUCTS`] x [`Mix::all`] x {[`Mode::Fill`], [`Mode::Churn`]} on 8 GPUs, GPU-major,
/// `trials` streams each from `seed`. One entry per [`PlacementOrder::ALL`].
pub fn selection_score(trials: usize, seed: u64) -> Vec<f64> {
    let candidates: Vec<(PlacementOrder, NodeWalk)> = PlacementOrder::ALL
        .iter()
        .map(|o| (*o, NodeWalk::GpuMajor))
        .collect();
    let mut sums = vec![0.0f64; candidates.len()];
    let mut n = 0.0f64;
    for product in SELECTION_PRODUCTS {
        let profiles = product.profiles();
        let Ok(shape) = GpuShape::new(&profiles, 8) else {
            continue;
        };
        for mix in Mix::all(product) {
            for mode in [Mode::Fill, Mode::Churn] {
                let sc = Scenario {
                    gpus: 8,
                    trials,
                    seed,
                    mode,
                };
                let cmp = compare(&shape, &profiles, &mix, &sc, &candidates);
                for (i, s) in sums.iter_mut().enumerate() {
                    *s += cmp.fraction(i);
                }
                n += 1.0;
            }
        }
    }
    sums.iter().map(|s| s / n.max(1.0)).collect()
}

/// The candidate with the best [`selection_score`] (the first on ties).
pub fn best_order(trials: usize, seed: u64) -> PlacementOrder {
    let scores = selection_score(trials, seed);
    let mut best = 0;
    for (i, s) in scores.iter().enumerate() {
        if *s > scores[best] {
            best = i;
        }
    }
    PlacementOrder::ALL[best]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100() -> (Vec<MigProfile>, GpuShape) {
        let p = Product::H100.profiles();
        let s = GpuShape::new(&p, 8).unwrap();
        (p, s)
    }

    /// Every (GPU, placement) assignment of `requests` (profile indexes), straight from the
    /// counters: the independent check of `fits`.
    fn brute_fits(shape: &GpuShape, requests: &[usize], gpus: usize) -> bool {
        fn go(
            shape: &GpuShape,
            reqs: &[usize],
            i: usize,
            st: &mut Vec<GpuState>,
            prev: Option<(usize, usize)>,
        ) -> bool {
            let Some(&p) = reqs.get(i) else {
                return true;
            };
            // Equal requests take increasing (GPU, placement) pairs: no repeated orderings.
            let from = match prev {
                Some(pp) if i > 0 && reqs[i - 1] == p => Some(pp),
                _ => None,
            };
            for g in 0..st.len() {
                for (k, pl) in shape.profiles[p].placements.iter().enumerate() {
                    if from.is_some_and(|f| (g, k) <= f) {
                        continue;
                    }
                    let m = mask(*pl);
                    if st[g].fits(shape, p, m) {
                        st[g].take(shape, p, m);
                        let ok = go(shape, reqs, i + 1, st, Some((g, k)));
                        st[g].release(shape, p, m);
                        if ok {
                            return true;
                        }
                    }
                }
            }
            false
        }
        let mut sorted = requests.to_vec();
        sorted.sort_unstable();
        go(
            shape,
            &sorted,
            0,
            &mut vec![GpuState::default(); gpus],
            None,
        )
    }

    fn requests_of(demand: &[u8]) -> Vec<usize> {
        demand
            .iter()
            .enumerate()
            .flat_map(|(p, n)| std::iter::repeat_n(p, usize::from(*n)))
            .collect()
    }

    #[test]
    fn configurations_are_the_known_maximal_packings() {
        let (_, s) = h100();
        let names = s.profile_names();
        assert_eq!(names[0], "1g.10gb");
        let has = |v: [u8; 7]| s.configurations().iter().any(|c| c.as_slice() == v);
        // [1g, 1g+me, 1g.20gb, 2g, 3g, 4g, 7g]
        assert!(has([0, 0, 0, 0, 0, 0, 1]));
        assert!(has([7, 0, 0, 0, 0, 0, 0]));
        assert!(has([6, 1, 0, 0, 0, 0, 0]));
        assert!(has([0, 0, 4, 0, 0, 0, 0]));
        assert!(has([0, 0, 0, 0, 1, 1, 0]));
        assert!(has([0, 0, 0, 0, 2, 0, 0]));
        assert!(has([1, 0, 0, 3, 0, 0, 0]));
        assert!(has([0, 0, 2, 0, 0, 1, 0]));
        assert!(has([2, 0, 1, 0, 0, 1, 0]));
        // Never two +me, never more than 7 compute slices or 8 memory slices.
        for c in s.configurations() {
            assert!(c[1] <= 1, "{c:?}");
            let compute: u32 = c
                .iter()
                .zip(&s.profiles)
                .map(|(n, p)| u32::from(*n) * p.compute)
                .sum();
            let mem: u32 = c
                .iter()
                .zip(&s.profiles)
                .map(|(n, p)| u32::from(*n) * p.size)
                .sum();
            assert!(compute <= 7 && mem <= 8, "{c:?}");
            assert!(brute_fits(&s, &requests_of(c), 1), "{c:?}");
        }
        // 4g and 7g exclude each other; 3g+3g+1g does not fit (slice 7 only by 1g.20gb).
        assert!(!s.fits(&[0, 0, 0, 0, 0, 1, 1], 1, &mut FitMemo::default()));
        assert!(!s.fits(&[1, 0, 0, 0, 2, 0, 0], 1, &mut FitMemo::default()));
        assert!(s.fits(&[0, 0, 1, 0, 0, 1, 0], 1, &mut FitMemo::default()));
    }

    #[test]
    fn fits_and_optimum_match_brute_force() {
        for product in [Product::A100_40GB, Product::H100] {
            let p = product.profiles();
            let s = GpuShape::new(&p, 8).unwrap();
            let mut rng = Rng::new(7);
            let mut memo = FitMemo::default();
            let weights = Mix::UNIFORM.per_profile(&s);
            let mut infeasible = 0;
            for _ in 0..150 {
                let n = 1 + rng.weighted(&[1.0; 8]);
                let mut demand = vec![0u8; p.len()];
                for _ in 0..n {
                    demand[rng.weighted(&weights)] += 1;
                }
                let gpus = 1 + rng.weighted(&[1.0, 1.0]);
                let fit = brute_fits(&s, &requests_of(&demand), gpus);
                infeasible += usize::from(!fit);
                assert_eq!(
                    s.fits(&demand, gpus, &mut memo),
                    fit,
                    "{demand:?} on {gpus}"
                );
                // Optimum: the largest sub-multiset that fits, by brute force.
                let mut best = 0;
                let mut sub = vec![0u8; demand.len()];
                loop {
                    let size: usize = sub.iter().map(|x| usize::from(*x)).sum();
                    if size > best && brute_fits(&s, &requests_of(&sub), gpus) {
                        best = size;
                    }
                    let mut k = 0;
                    while k < sub.len() && sub[k] == demand[k] {
                        sub[k] = 0;
                        k += 1;
                    }
                    if k == sub.len() {
                        break;
                    }
                    sub[k] += 1;
                }
                assert_eq!(
                    s.optimum(&demand, gpus, &mut memo),
                    best,
                    "{demand:?} on {gpus}"
                );
            }
            // The instances exercise both answers.
            assert!(infeasible > 20 && infeasible < 130, "{infeasible}");
        }
    }

    #[test]
    fn every_product_has_a_dominance_chain_and_a_broken_one_is_refused() {
        for product in Product::ALL {
            let s = GpuShape::new(&product.profiles(), 8).unwrap();
            assert_eq!(s.chain.len(), 6, "{}", product.name());
        }
        let mut p = Product::H100.profiles();
        // 2g.20gb only at 6 (no 1g.20gb placement inside? there is: 6) -> make 1g.20gb miss it.
        p[2].placements = vec![Placement { start: 0, size: 2 }];
        assert!(matches!(
            GpuShape::new(&p, 8),
            Err(PackingError::NoChain { .. })
        ));
        assert_eq!(
            GpuShape::new(&p, 40).unwrap_err(),
            PackingError::MemorySlices(40)
        );
        assert!(matches!(
            GpuShape::new(&Product::H100.profiles(), 4),
            Err(PackingError::Placement { .. })
        ));
        assert_eq!(
            GpuShape::new(&[], 8).unwrap_err(),
            PackingError::ProfileCount(0)
        );
    }

    #[test]
    fn first_fit_takes_the_first_free_placement_gpu_by_gpu() {
        let (p, s) = h100();
        let mut ff = FirstFit::new(
            &s,
            &p,
            PlacementOrder::DescendingStart,
            NodeWalk::GpuMajor,
            2,
        );
        let start = |a: Option<(usize, u32)>| a.map(|(g, m)| (g, m.trailing_zeros()));
        assert_eq!(start(ff.allocate(0)), Some((0, 6)));
        assert_eq!(start(ff.allocate(0)), Some((0, 5)));
        assert_eq!(start(ff.allocate(1)), Some((0, 4)));
        // The +me limit: the next +me goes to GPU 1.
        assert_eq!(start(ff.allocate(1)), Some((1, 6)));
        assert_eq!(start(ff.allocate(5)), Some((0, 0)));
        // GPU 0: 4g@0 + three 1g = 7 compute slices: a 1g now goes to GPU 1.
        assert_eq!(start(ff.allocate(0)), Some((1, 5)));
        assert_eq!(start(ff.allocate(6)), None);
        let a = ff.allocate(4).unwrap();
        assert_eq!(start(Some(a)), Some((1, 0)));
        ff.release(4, a);
        assert_eq!(start(ff.allocate(4)), Some((1, 0)));

        let mut spread = FirstFit::new(
            &s,
            &p,
            PlacementOrder::DescendingStart,
            NodeWalk::Interleaved,
            2,
        );
        assert_eq!(start(spread.allocate(0)), Some((0, 6)));
        assert_eq!(start(spread.allocate(0)), Some((1, 6)));
        assert_eq!(start(spread.allocate(0)), Some((0, 5)));
    }

    #[test]
    fn orders_are_distinct_permutations() {
        let (p, _) = h100();
        let mut seen = HashSet::new();
        for o in PlacementOrder::ALL {
            let mut all = Vec::new();
            for prof in &p {
                let mut pls = prof.placements.clone();
                o.sort(prof, &mut pls);
                let mut sorted = pls.clone();
                sorted.sort();
                assert_eq!(sorted, prof.placements, "{}", o.name());
                all.push(pls);
            }
            assert!(seen.insert(all), "{} repeats another order", o.name());
        }
        let mut one = p[0].placements.clone();
        PlacementOrder::UpperHalfFirst.sort(&p[0], &mut one);
        let starts: Vec<u32> = one.iter().map(|x| x.start).collect();
        assert_eq!(starts, [6, 4, 5, 0, 1, 2, 3]);
    }

    #[test]
    fn packed_subtraction_matches_per_entry() {
        let mut r = Rng::new(3);
        for k in 0..20_000 {
            // Entries below 128 (the fast path) and, every tenth, any byte (the slow path).
            let m = if k % 10 == 0 {
                u64::MAX
            } else {
                0x7f7f_7f7f_7f7f_7f7f
            };
            let (a, b) = (r.next_u64() & m, r.next_u64() & m);
            let slow = (0..8).fold(0, |acc, i| {
                acc | (lane(a, i).saturating_sub(lane(b, i)) << (8 * i))
            });
            assert_eq!(sub_saturating(a, b, 8), slow, "{a:x} {b:x}");
        }
        assert_eq!(pack(&[1, 2, 3]), 0x03_02_01);
    }

    #[test]
    fn rng_is_reproducible() {
        let a: Vec<u64> = {
            let mut r = Rng::new(42);
            (0..4).map(|_| r.next_u64()).collect()
        };
        let mut r = Rng::new(42);
        assert_eq!(a, (0..4).map(|_| r.next_u64()).collect::<Vec<_>>());
        assert_ne!(a[0], Rng::new(43).next_u64());
        let mut counts = [0usize; 3];
        for _ in 0..3000 {
            counts[r.weighted(&[1.0, 2.0, 0.0])] += 1;
        }
        assert_eq!(counts[2], 0);
        assert!(counts[1] > counts[0] * 3 / 2, "{counts:?}");
    }

    #[test]
    fn first_fit_never_beats_the_optimum_and_sometimes_loses() {
        let (p, s) = h100();
        let cands: Vec<(PlacementOrder, NodeWalk)> = PlacementOrder::ALL
            .iter()
            .map(|o| (*o, NodeWalk::GpuMajor))
            .collect();
        for mode in [Mode::Fill, Mode::Count] {
            let sc = Scenario {
                gpus: 8,
                trials: 10,
                seed: 1,
                mode,
            };
            let c = compare(&s, &p, &Mix::UNIFORM, &sc, &cands);
            for i in 0..cands.len() {
                assert!(c.admitted[i] <= c.reference, "{mode:?} {c:?}");
                assert!(c.fraction(i) > 0.5, "{mode:?} {c:?}");
            }
            assert!(c.admitted.iter().any(|a| *a < c.reference), "{c:?}");
            // Same seed, same answer.
            assert_eq!(c, compare(&s, &p, &Mix::UNIFORM, &sc, &cands));
        }
    }

    /// The published default is the best candidate on a fixed seed: the choice is the
    /// simulation's, not a constant nobody checks.
    #[test]
    fn default_order_scores_best() {
        // 40 streams per scenario: the smallest count at which the ranking held on every
        // seed tried (with 12, `top-then-lower-half` wins on some seeds by < 0.3%).
        let scores = selection_score(40, 0x5EED);
        let d = PlacementOrder::ALL
            .iter()
            .position(|o| *o == PlacementOrder::DEFAULT)
            .unwrap();
        for (o, s) in PlacementOrder::ALL.iter().zip(&scores) {
            assert!(
                scores[d] >= *s,
                "{} {s} beats default {}",
                o.name(),
                scores[d]
            );
        }
        assert_eq!(best_order(40, 0x5EED), PlacementOrder::DEFAULT);
    }
}
