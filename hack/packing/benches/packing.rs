//! How many MIG requests the scheduler's first-fit choice admits against the best possible
//! packing, per product, request mix and placement order (see `cleave_packing`).
//! Prints tables; asserts nothing.
//!
//! `cargo bench -p cleave-packing --bench packing` (or `-- <trials> [<seed>]`; default 200 streams
//! per row, 8 GPUs). Modes and references: `cleave_packing::Mode`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::Instant;

use cleave_driver::pool::PlacementOrder;
use cleave_packing::{GpuShape, Mix, Mode, NodeWalk, Product, Scenario, compare, selection_score};

const SEED: u64 = 0x00C1_EA7E;

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let trials = args.first().map_or(200, |t| *t as usize);
    let seed = args.get(1).copied().unwrap_or(SEED);
    let started = Instant::now();
    let mut candidates: Vec<(PlacementOrder, NodeWalk)> = PlacementOrder::ALL
        .iter()
        .map(|o| (*o, NodeWalk::GpuMajor))
        .collect();
    candidates.push((PlacementOrder::DEFAULT, NodeWalk::Interleaved));

    println!(
        "first fit in published order vs reference; 8 GPUs, {trials} streams per row, seed {seed:#x}"
    );
    println!(
        "(* = published default: {})",
        PlacementOrder::DEFAULT.name()
    );
    for product in [Product::A100_40GB, Product::H100, Product::H200] {
        let profiles = product.profiles();
        let shape = GpuShape::new(&profiles, 8).unwrap();
        for mode in Mode::ALL {
            println!();
            println!(
                "{} — {} (maximal configurations per GPU: {})",
                product.name(),
                mode.name(),
                shape.configurations().len()
            );
            println!(
                "  {:<12} {:<19} {:<11} {:>9} {:>9} {:>8}",
                "mix", "placement order", "walk", "admitted", "reference", "fraction"
            );
            for mix in Mix::all(product) {
                let sc = Scenario {
                    gpus: 8,
                    trials,
                    seed,
                    mode,
                };
                let cmp = compare(&shape, &profiles, &mix, &sc, &candidates);
                for (i, (order, walk)) in candidates.iter().enumerate() {
                    let mark = if *order == PlacementOrder::DEFAULT && *walk == NodeWalk::GpuMajor {
                        "*"
                    } else {
                        " "
                    };
                    println!(
                        "{mark} {:<12} {:<19} {:<11} {:>9} {:>9} {:>8.4}",
                        mix.name,
                        order.name(),
                        walk.name(),
                        cmp.admitted[i],
                        cmp.reference,
                        cmp.fraction(i)
                    );
                }
            }
            println!("  (reference: {})", mode.reference());
        }
    }
    println!();
    println!("selection score (mean fraction over A100-40GB and H100, 4 mixes, fill and churn):");
    let scores = selection_score(trials, seed);
    for (order, s) in PlacementOrder::ALL.iter().zip(&scores) {
        let mark = if *order == PlacementOrder::DEFAULT {
            "*"
        } else {
            " "
        };
        println!("{mark} {:<19} {s:.4}", order.name());
    }
    println!("elapsed {:.1} s", started.elapsed().as_secs_f64());
}
