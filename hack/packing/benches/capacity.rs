//! GPUs used by shares of whole GPUs (consumable capacity) when the scheduler packs a
//! realistic inference mix one claim at a time (first fit), against the offline optimum
//! and against whole-GPU allocation (see `cleave_packing::capacity`). Prints a table;
//! asserts nothing.
//!
//! `cargo bench -p cleave-packing --bench capacity` (or `-- <trials> [<seed>]`; default 100
//! streams per row).
#![allow(clippy::print_stdout)]

use std::time::Instant;

use cleave_packing::capacity::{Gpu, first_fit, inference_mix, lower_bound, optimum};

const SEED: u64 = 0x00C1_EA7E;

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let trials = args.first().map_or(100, |t| *t as usize);
    let seed = args.get(1).copied().unwrap_or(SEED);
    let started = Instant::now();
    let gpu = Gpu::H100;
    println!(
        "inference mix (memory 5-40Gi, SMs 10-50 %) on H100 80GB ({} MiB, {} SMs); {trials} streams per row, seed {seed:#x}",
        gpu.memory_mib, gpu.sms
    );
    println!(
        "  {:>6} {:<16} {:>10} {:>10} {:>10} {:>13} {:>12}",
        "claims", "reference", "first fit", "reference", "whole GPU", "ff/reference", "whole/ff"
    );
    for (n, exact) in [
        (8, true),
        (12, true),
        (16, true),
        (100, false),
        (1000, false),
    ] {
        let (mut ff, mut reference, mut whole) = (0usize, 0usize, 0usize);
        for t in 0..trials {
            let shares = inference_mix(gpu, n, seed.wrapping_add(t as u64));
            ff += first_fit(gpu, &shares);
            reference += if exact {
                optimum(gpu, &shares)
            } else {
                lower_bound(gpu, &shares)
            };
            whole += shares.len();
        }
        println!(
            "  {:>6} {:<16} {:>10} {:>10} {:>10} {:>13.3} {:>12.2}",
            n,
            if exact {
                "exact optimum"
            } else {
                "lower bound"
            },
            ff,
            reference,
            whole,
            ff as f64 / reference as f64,
            whole as f64 / ff as f64
        );
    }
    println!("(GPUs summed over the streams; against the lower bound the ratio is an upper bound)");
    println!("elapsed {:.1} s", started.elapsed().as_secs_f64());
}
