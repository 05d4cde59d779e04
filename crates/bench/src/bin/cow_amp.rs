//! Seed 002, COW amplification: blocks COWed per search under background writeback
//! inside long transaction handles, with the handles' writeback inhibition and
//! without it (`TestHooks::no_writeback_inhibition`), as the inhibition series
//! measured with bpftrace (max COWs per search 35 -> 5, about twice the operations).
//!
//! Workload: `--handles` handles, each creating `--ops` files with fs_mark-style
//! 40-byte names in one directory (four items each; the leaves split often, and a
//! split makes its search start over). The memory pressure is injected: a dirty limit
//! of two blocks, and background writeback before every search of the handle
//! (`TestHooks::writeback_before_search`), where the kernel's flusher may run between
//! two searches of one handle. Without inhibition that writeback seals the blocks the
//! handle just COWed, and the next search COWs them again. Printed per variant: searches, COWs,
//! mean and max COWs per search, restarted searches, blocks written before their commit,
//! and creates per second; medians over `--runs` alternating rounds on fresh images.
//! Each round ends with a commit, and the first of each variant is checked with
//! `btrfs check --readonly --check-data-csum`.
//!
//!     cargo run --release -p ubtrfs-bench --bin cow_amp -- [--handles H] [--ops N] [--runs R]

#[path = "common/mod.rs"]
pub mod common;

use clap::Parser;
use common::{median, print_table, Image, Names};
use std::path::PathBuf;
use std::time::Instant;
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::transaction::CowStats;
use ubtrfs_core::FsWriter;
use ubtrfs_core::OpenOptions;

#[derive(Parser, Debug)]
#[command(
    about = "seed 002: COWs per search under background writeback, with and without writeback inhibition"
)]
pub struct Args {
    /// Handles per round.
    #[arg(long, default_value_t = 200)]
    pub handles: u64,
    /// Creates per handle.
    #[arg(long, default_value_t = 64)]
    pub ops: u64,
    /// Rounds; each runs both variants on fresh images, in alternating order.
    #[arg(long, default_value_t = 5)]
    pub runs: u32,
    /// Where the images go.
    #[arg(long, default_value = "/var/tmp/ubtrfs-bench/cow_amp")]
    pub workdir: PathBuf,
}

/// One round's figures.
pub struct Round {
    pub stats: CowStats,
    pub written_early: u64,
    pub creates_per_sec: f64,
}

/// One round on a fresh image; `inhibit`: the handles inhibit writeback of their blocks.
///
/// # Errors
/// Image and engine failures, as text.
pub fn round(a: &Args, inhibit: bool, check: bool) -> Result<Round, String> {
    let img = Image::mkfs(&a.workdir, if inhibit { "inhibit.img" } else { "none.img" }, 2 << 30)?;
    let mut w = FsWriter::open(&OpenOptions::new(&img.path)).map_err(|e| format!("open: {e}"))?;
    let dir = w.mkdir(5, 256, b"d", &InodeAttrs::new(0o755)).map_err(|e| e.to_string())?;
    w.commit().map_err(|e| e.to_string())?;
    let limit = 2 * w.nodesize() as usize;
    w.set_dirty_metadata_limit(limit);
    w.hooks.no_writeback_inhibition = !inhibit;
    w.hooks.writeback_before_search = true;
    w.hooks.cow_stats = Some(CowStats::default());
    let early = w.blocks_written_early();
    let mut names = Names::new(7);
    let t = Instant::now();
    for _ in 0..a.handles {
        w.transaction("cow_amp", a.ops * 4, |w| {
            for _ in 0..a.ops {
                let n = names.next_name();
                w.create_file(5, dir, n.as_bytes(), &InodeAttrs::new(0o644))?;
                w.background_writeback()?;
            }
            Ok(())
        })
        .map_err(|e| format!("handle: {e}"))?;
    }
    let secs = t.elapsed().as_secs_f64();
    let stats = w.hooks.cow_stats.take().unwrap_or_default();
    let written_early = w.blocks_written_early() - early;
    w.commit().map_err(|e| e.to_string())?;
    drop(w);
    if check {
        img.check()?;
    }
    Ok(Round { stats, written_early, creates_per_sec: (a.handles * a.ops) as f64 / secs })
}

fn main() {
    let a = Args::parse();
    let mut by: [Vec<Round>; 2] = [Vec::new(), Vec::new()];
    for r in 0..a.runs {
        let order = if r % 2 == 0 { [true, false] } else { [false, true] };
        for inhibit in order {
            let x = round(&a, inhibit, r < 2)
                .unwrap_or_else(|e| panic!("round {r} (inhibit {inhibit}): {e}"));
            eprintln!(
                "round {r} {}: {} searches, {} COWs, max {} per search, {} written early, {:.0} creates/s",
                if inhibit { "inhibit" } else { "none" },
                x.stats.searches,
                x.stats.cows,
                x.stats.max_per_search,
                x.written_early,
                x.creates_per_sec
            );
            by[usize::from(!inhibit)].push(x);
        }
    }
    let med = |v: &[Round], f: &dyn Fn(&Round) -> f64| median(&v.iter().map(f).collect::<Vec<_>>());
    let mut rows = Vec::new();
    for (i, name) in ["inhibition (ours)", "no inhibition"].iter().enumerate() {
        let v = &by[i];
        rows.push(vec![
            name.to_string(),
            format!("{:.0}", med(v, &|r| r.stats.searches as f64)),
            format!("{:.0}", med(v, &|r| r.stats.cows as f64)),
            format!("{:.3}", med(v, &|r| r.stats.cows as f64 / r.stats.searches.max(1) as f64)),
            format!("{:.0}", med(v, &|r| r.stats.max_per_search as f64)),
            format!("{:.0}", med(v, &|r| r.stats.restarted as f64)),
            format!("{:.0}", med(v, &|r| r.written_early as f64)),
            format!("{:.0}", med(v, &|r| r.creates_per_sec)),
        ]);
    }
    print_table(
        &[
            "variant",
            "searches",
            "COWs",
            "COWs/search",
            "max COWs/search",
            "restarted searches",
            "written early",
            "creates/s",
        ],
        &rows,
    );
    let ratio = med(&by[0], &|r| r.creates_per_sec) / med(&by[1], &|r| r.creates_per_sec);
    let cow_ratio =
        med(&by[1], &|r| r.stats.cows as f64) / med(&by[0], &|r| r.stats.cows as f64).max(1.0);
    println!("creates/s with inhibition / without: {ratio:.2}x; COWs without / with: {cow_ratio:.2}x ({} rounds, medians)", a.runs);
}
