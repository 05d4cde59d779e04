//! ubtrfs-bench: reproducible measurements that put a ubtrfs algorithm and its baseline
//! side by side in one process. One module per benchmark, named after the seed that
//! motivates it; each has a full form (the `ubtrfs-bench <name>` subcommand) and a tiny
//! form that `cargo test` runs so the benchmark never rots.
//!
//! Neighbours: `ubtrfs-core` (the code measured); `docs/benchmarks.md` (where results
//! are recorded by hand).

pub mod seed000;
pub mod stats;
