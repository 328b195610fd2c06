//! How well the scheduler packs shares of whole GPUs published with consumable capacity.
//!
//! **Scheduler model.** With `--consumable-capacity` every whole GPU allows multiple
//! allocations and publishes `memory` and `multiprocessors` with request policies (see
//! `cleave_driver::pool::shared_capacity`). The allocator walks devices in a fixed order
//! (slices by name, devices in slice order) and gives a claim the first device whose
//! remaining capacity holds what the claim asks (k8s.io/dynamic-resource-allocation
//! `structured/internal/incubating/allocator_incubating.go`, `CmpRequestOverCapacity` in
//! `consumable_capacity.go`): first fit, one claim at a time, in arrival order.
//!
//! **References.** Whole-GPU allocation takes one GPU per claim. The offline optimum is
//! the fewest GPUs that hold every claim at once (two-dimensional bin packing): exact by
//! branch and bound for small streams ([`optimum`]), and otherwise the lower bound
//! `max(⌈Σ memory / GPU memory⌉, ⌈Σ SMs / GPU SMs⌉)` ([`lower_bound`]), so a ratio against it
//! is an upper bound of the true ratio.

use crate::Rng;

/// One claim's request (what its share consumes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Share {
    /// Memory in MiB (the policy's step is 1Mi).
    pub memory_mib: u64,
    /// Streaming multiprocessors.
    pub sms: u64,
}

/// A GPU's capacities as published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gpu {
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Streaming multiprocessors.
    pub sms: u64,
}

impl Gpu {
    /// H100 80GB HBM3: 81559 MiB, 132 SMs.
    pub const H100: Gpu = Gpu {
        memory_mib: 81559,
        sms: 132,
    };
}

/// A realistic inference mix: memory uniform in 5..=40 GiB (whole GiB), SM share uniform in
/// 10..=50 % of the GPU (rounded up to whole SMs), `n` claims from `seed`.
pub fn inference_mix(gpu: Gpu, n: usize, seed: u64) -> Vec<Share> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| {
            let gib = 5 + rng.next_u64() % 36;
            let pct = 10 + rng.next_u64() % 41;
            Share {
                memory_mib: gib * 1024,
                sms: (pct * gpu.sms).div_ceil(100),
            }
        })
        .collect()
}

/// GPUs used when each claim takes the first GPU (in a fixed order) with room for it.
pub fn first_fit(gpu: Gpu, shares: &[Share]) -> usize {
    let mut used: Vec<(u64, u64)> = Vec::new();
    for s in shares {
        match used
            .iter_mut()
            .find(|(m, c)| m + s.memory_mib <= gpu.memory_mib && c + s.sms <= gpu.sms)
        {
            Some((m, c)) => {
                *m += s.memory_mib;
                *c += s.sms;
            }
            None => used.push((s.memory_mib, s.sms)),
        }
    }
    used.len()
}

/// `max(⌈Σ memory / GPU memory⌉, ⌈Σ SMs / GPU SMs⌉)`: no packing uses fewer GPUs.
pub fn lower_bound(gpu: Gpu, shares: &[Share]) -> usize {
    let mem: u64 = shares.iter().map(|s| s.memory_mib).sum();
    let sms: u64 = shares.iter().map(|s| s.sms).sum();
    mem.div_ceil(gpu.memory_mib).max(sms.div_ceil(gpu.sms)) as usize
}

/// The fewest GPUs that hold every share at once: exact (depth-first over assignments of
/// the shares, largest first, to open GPUs or one new GPU, pruned by the best found and the
/// lower bound of what is left). Exponential: for streams of up to about 16 shares.
pub fn optimum(gpu: Gpu, shares: &[Share]) -> usize {
    let mut sorted = shares.to_vec();
    sorted.sort_by(|a, b| {
        let key = |s: &Share| s.memory_mib * gpu.sms + s.sms * gpu.memory_mib;
        key(b).cmp(&key(a))
    });
    let mut best = first_fit(gpu, &sorted);
    let bound = lower_bound(gpu, &sorted);
    let mut bins: Vec<(u64, u64)> = Vec::new();
    search(gpu, &sorted, 0, &mut bins, &mut best, bound);
    best
}

fn search(
    gpu: Gpu,
    shares: &[Share],
    i: usize,
    bins: &mut Vec<(u64, u64)>,
    best: &mut usize,
    bound: usize,
) {
    if *best == bound {
        return;
    }
    let Some(s) = shares.get(i) else {
        *best = (*best).min(bins.len());
        return;
    };
    // What is left must fit into the free room of the open GPUs plus new ones.
    let free_mem: u64 = bins.iter().map(|b| gpu.memory_mib - b.0).sum();
    let free_sms: u64 = bins.iter().map(|b| gpu.sms - b.1).sum();
    let rest_mem: u64 = shares[i..].iter().map(|s| s.memory_mib).sum();
    let rest_sms: u64 = shares[i..].iter().map(|s| s.sms).sum();
    let extra = rest_mem
        .saturating_sub(free_mem)
        .div_ceil(gpu.memory_mib)
        .max(rest_sms.saturating_sub(free_sms).div_ceil(gpu.sms)) as usize;
    if bins.len() + extra >= *best {
        return;
    }
    let mut tried: Vec<(u64, u64)> = Vec::new();
    for k in 0..bins.len() {
        let b = bins[k];
        if b.0 + s.memory_mib > gpu.memory_mib || b.1 + s.sms > gpu.sms || tried.contains(&b) {
            continue;
        }
        tried.push(b);
        bins[k] = (b.0 + s.memory_mib, b.1 + s.sms);
        search(gpu, shares, i + 1, bins, best, bound);
        bins[k] = b;
    }
    if bins.len() + 1 < *best {
        bins.push((s.memory_mib, s.sms));
        search(gpu, shares, i + 1, bins, best, bound);
        bins.pop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every assignment of shares to at most `n` GPUs: the independent check of `optimum`.
    fn brute(gpu: Gpu, shares: &[Share]) -> usize {
        fn fits(gpu: Gpu, shares: &[Share], bins: &mut Vec<(u64, u64)>, i: usize) -> bool {
            let Some(s) = shares.get(i) else {
                return true;
            };
            for k in 0..bins.len() {
                let b = bins[k];
                if b.0 + s.memory_mib <= gpu.memory_mib && b.1 + s.sms <= gpu.sms {
                    bins[k] = (b.0 + s.memory_mib, b.1 + s.sms);
                    if fits(gpu, shares, bins, i + 1) {
                        bins[k] = b;
                        return true;
                    }
                    bins[k] = b;
                }
            }
            false
        }
        (1..=shares.len())
            .find(|&n| fits(gpu, shares, &mut vec![(0, 0); n], 0))
            .unwrap_or(0)
    }

    #[test]
    fn optimum_matches_brute_force_and_bounds_hold() {
        let mut worse = 0;
        for seed in 0..40 {
            let shares = inference_mix(Gpu::H100, 7, seed);
            let opt = optimum(Gpu::H100, &shares);
            assert_eq!(opt, brute(Gpu::H100, &shares), "{shares:?}");
            let ff = first_fit(Gpu::H100, &shares);
            assert!(lower_bound(Gpu::H100, &shares) <= opt && opt <= ff && ff <= shares.len());
            worse += usize::from(ff > opt);
        }
        // The cases exercise first fit losing to the optimum at least once.
        assert!(worse > 0);
    }

    #[test]
    fn the_mix_stays_in_its_ranges_and_is_seeded() {
        let a = inference_mix(Gpu::H100, 500, 3);
        assert_eq!(a, inference_mix(Gpu::H100, 500, 3));
        assert_ne!(a, inference_mix(Gpu::H100, 500, 4));
        for s in &a {
            assert!((5 * 1024..=40 * 1024).contains(&s.memory_mib), "{s:?}");
            assert!((14..=66).contains(&s.sms), "{s:?}");
        }
        // Four 10Gi / 33-SM shares fill one H100's SMs exactly; a fifth needs a second GPU.
        let q = Share {
            memory_mib: 10 * 1024,
            sms: 33,
        };
        assert_eq!(first_fit(Gpu::H100, &[q; 4]), 1);
        assert_eq!(first_fit(Gpu::H100, &[q; 5]), 2);
    }
}
