//! Seed 003: the cost of one free-space-tree update (add or remove, one per delayed
//! ref that allocates or frees an extent) with the format flag cached in the block
//! group, against the baseline that looks the format up in the group's
//! FREE_SPACE_INFO item on every update (`info_lookup` below, installed through
//! `TestHooks::fst_format_lookup`).
//!
//! Workload (the kernel change's fs_mark run, scaled to one process): `--files` empty
//! files with fs_mark-style 40-byte names, round-robin over `--dirs` directories (the
//! kernel script used one directory per thread), through the library on a fresh
//! `mkfs.btrfs` image, committing by the policy of `common` (every `--commit-every`
//! files or every `--commit-secs` seconds, and at the end). Every add/remove call is
//! timed (`TestHooks::fst_timings`). Each variant runs on its own fresh image; variants
//! alternate over `--runs` rounds. Reported twice: all samples pooled, and the
//! per-update minimum over rounds (the workload is deterministic, so update i is the
//! same in every round; the minimum filters out preemptions and interrupts, which on a
//! shared 2-core machine dominate the mean). Both variants must leave identical
//! free-space trees (checked every round).
//!
//!     cargo run --release -p ubtrfs-bench --bin seed003 -- [--files N] [--runs R]

#[path = "common/mod.rs"]
pub mod common;

use clap::Parser;
use common::{
    create_files, print_table, summarize, CommitPolicy, Image, Workload, FS_TREE, ROOT_DIR,
};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::space::free_space_tree::FstFormatFn;
use ubtrfs_core::transaction::Transaction;
use ubtrfs_core::FsWriter;
use ubtrfs_core::OpenOptions;
use ubtrfs_format::key::{FREE_SPACE_INFO_KEY, FREE_SPACE_TREE_OBJECTID};
use ubtrfs_format::structs::FREE_SPACE_USING_BITMAPS;
use ubtrfs_format::{Corrupt, CorruptWhere, Key};

#[derive(Parser, Debug)]
#[command(about = "seed 003: free-space-tree update cost, cached format flag vs INFO lookup")]
pub struct Args {
    /// Empty files to create per variant and round.
    #[arg(long, default_value_t = 100_000)]
    pub files: u64,
    /// Directories the files are spread over (round-robin).
    #[arg(long, default_value_t = 2)]
    pub dirs: u64,
    /// Commit after this many files.
    #[arg(long, default_value_t = 1000)]
    pub commit_every: u64,
    /// Commit after this many seconds of work, if that comes first (the kernel's commit=30).
    #[arg(long, default_value_t = 30)]
    pub commit_secs: u64,
    /// Rounds; each runs both variants on fresh images, in alternating order.
    #[arg(long, default_value_t = 5)]
    pub runs: u32,
    /// Image size in GiB (sparse file).
    #[arg(long, default_value_t = 3)]
    pub size_gib: u64,
    /// Where the images go.
    #[arg(long, default_value = "/var/tmp/ubtrfs-bench/seed003")]
    pub workdir: PathBuf,
}

/// What one variant run produced.
pub struct VariantRun {
    /// Nanoseconds of every add/remove on the free-space tree, in call order.
    pub timings: Vec<u32>,
    pub wall: Duration,
    pub commits: u64,
    /// The whole free-space tree after the final commit.
    pub fst: Vec<(Key, Vec<u8>)>,
}

/// The baseline: a group's format read from its FREE_SPACE_INFO item on every update,
/// as the kernel did before it cached the flag in the block group
/// (`btrfs_search_free_space_info` and the item's flags, in every add and remove).
///
/// # Errors
/// Read failures; `Corrupt` when the group has no INFO item.
pub fn info_lookup(w: &mut Transaction, start: u64, len: u64) -> ubtrfs_core::Result<bool> {
    let key = Key::new(start, FREE_SPACE_INFO_KEY, len);
    let root = w.root(FREE_SPACE_TREE_OBJECTID)?;
    match w.first_item_ge(&root, &key)? {
        Some((k, d)) if k == key => {
            let flags = d[4..8].try_into().expect("size checked by the tree checker");
            Ok(u32::from_le_bytes(flags) & FREE_SPACE_USING_BITMAPS != 0)
        }
        _ => Err(Corrupt::new(
            CorruptWhere::Item,
            format!("free space info for block group {start} missing"),
        )
        .root(FREE_SPACE_TREE_OBJECTID)
        .into()),
    }
}

pub fn workload(files: u64, dirs: u64, commit_every: u64, commit_secs: u64) -> Workload {
    Workload {
        files,
        dirs,
        round_robin: true,
        policy: CommitPolicy { every_files: commit_every, every: Duration::from_secs(commit_secs) },
        seed: 0x5eed_0003,
    }
}

/// Run the workload on `image` with the cached flag (`force_info_lookup = false`) or
/// the INFO lookup on every update.
///
/// # Errors
/// Library errors, as text.
pub fn run_variant(
    image: &Path,
    force_info_lookup: bool,
    wl: &Workload,
) -> Result<VariantRun, String> {
    let t = Instant::now();
    let mut w = FsWriter::open(&OpenOptions::new(image))
        .map_err(|e| format!("open {}: {e}", image.display()))?;
    w.hooks.fst_format_lookup = force_info_lookup.then_some(info_lookup as FstFormatFn);
    w.hooks.fst_timings = Some(Vec::with_capacity(1 << 20));
    let dirs: Vec<u64> = (0..wl.dirs)
        .map(|i| {
            w.mkdir(FS_TREE, ROOT_DIR, format!("d{}", i + 1).as_bytes(), &InodeAttrs::new(0o755))
                .map_err(|e| format!("mkdir: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let st = create_files(&mut w, &dirs, wl)?;
    let wall = t.elapsed();
    let timings = w.hooks.fst_timings.take().unwrap_or_default();
    let fst = w
        .items_in_range(
            FREE_SPACE_TREE_OBJECTID,
            &Key::new(0, 0, 0),
            &Key::new(u64::MAX, u8::MAX, u64::MAX),
        )
        .map_err(|e| format!("read free-space tree: {e}"))?;
    Ok(VariantRun { timings, wall, commits: st.commits, fst })
}

/// Run both variants `runs` times on fresh images; returns (cached, forced) runs.
///
/// # Errors
/// Image creation or library errors, or variants whose free-space trees differ.
pub fn run_both(
    workdir: &Path,
    size: u64,
    runs: u32,
    wl: &Workload,
    mut progress: impl FnMut(&str),
) -> Result<(Vec<VariantRun>, Vec<VariantRun>), String> {
    let mut cached = Vec::new();
    let mut forced = Vec::new();
    for r in 0..runs {
        let order = if r % 2 == 0 { [false, true] } else { [true, false] };
        let mut fsts: Vec<Vec<(Key, Vec<u8>)>> = Vec::new();
        for force in order {
            let img = Image::mkfs(
                workdir,
                &format!("seed003-{}.img", if force { "forced" } else { "cached" }),
                size,
            )?;
            let mut v = run_variant(&img.path, force, wl)?;
            progress(&format!(
                "round {} {}: {} updates, {:.2} s, {} commits",
                r + 1,
                if force { "forced INFO lookup" } else { "cached flag" },
                v.timings.len(),
                v.wall.as_secs_f64(),
                v.commits
            ));
            fsts.push(std::mem::take(&mut v.fst));
            if force {
                forced.push(v);
            } else {
                cached.push(v);
            }
        }
        if fsts[0] != fsts[1] {
            let diff = fsts[0]
                .iter()
                .zip(&fsts[1])
                .position(|(a, b)| a != b)
                .unwrap_or(fsts[0].len().min(fsts[1].len()));
            return Err(format!("round {}: the variants left different free-space trees ({} vs {} items, first difference at item {diff})", r + 1, fsts[0].len(), fsts[1].len()));
        }
        // Keep the last round's tree for the caller to inspect.
        if let Some(v) = cached.last_mut() {
            v.fst = fsts.swap_remove(0);
        }
    }
    Ok((cached, forced))
}

/// Per-update minimum over rounds: every round makes the same updates in the same
/// order (the workload is deterministic), so position i is the same update in each;
/// its minimum drops the rounds where a preemption or an interrupt landed in it.
/// None if the rounds disagree on the number of updates.
pub fn min_over_rounds(v: &[VariantRun]) -> Option<Vec<u32>> {
    let n = v.first()?.timings.len();
    if v.iter().any(|r| r.timings.len() != n) {
        return None;
    }
    Some(
        (0..n).map(|i| v.iter().map(|r| r.timings[i]).min().expect("at least one round")).collect(),
    )
}

fn main() {
    let a = Args::parse();
    if !common::have("mkfs.btrfs") {
        eprintln!("seed003: mkfs.btrfs not found; install btrfs-progs");
        std::process::exit(2);
    }
    let wl = workload(a.files, a.dirs, a.commit_every, a.commit_secs);
    let res = run_both(&a.workdir, a.size_gib << 30, a.runs, &wl, |m| eprintln!("seed003: {m}"));
    let (cached, forced) = match res {
        Ok(v) => v,
        Err(e) => {
            eprintln!("seed003: {e}");
            std::process::exit(1);
        }
    };
    let pool = |v: &[VariantRun]| -> Vec<u32> {
        v.iter().flat_map(|r| r.timings.iter().copied()).collect()
    };
    let wall = |v: &[VariantRun]| {
        common::median(&v.iter().map(|r| r.wall.as_secs_f64()).collect::<Vec<_>>())
    };
    println!("## seed 003: free-space-tree update cost per delayed ref (ns)\n");
    println!(
        "{} empty files in {} dirs, commit every {} files or {} s; {} round(s) per variant, each on a fresh {} GiB mkfs.btrfs image, variants alternating; identical free-space trees in every round: yes; {} updates per round\n",
        a.files,
        a.dirs,
        a.commit_every,
        a.commit_secs,
        a.runs,
        a.size_gib,
        cached.first().map_or(0, |r| r.timings.len())
    );
    let ratio = |x: f64, y: f64| format!("{:.3}", x / y);
    let mut rows = Vec::new();
    let mut gains = Vec::new();
    type Pair = Option<(Vec<u32>, Vec<u32>)>;
    let estimators: [(&str, Pair); 2] = [
        ("all samples pooled", Some((pool(&cached), pool(&forced)))),
        ("per-update min over rounds", min_over_rounds(&cached).zip(min_over_rounds(&forced))),
    ];
    for (est, samples) in estimators {
        let Some((cs, fs)) = samples else { continue };
        let (c, f) = (summarize(&cs), summarize(&fs));
        let slow = |v: &[u32]| v.iter().filter(|&&x| x > 100_000).count().to_string();
        let row = |name: &str, s: &common::Summary, v: &[u32]| -> Vec<String> {
            vec![
                est.into(),
                name.into(),
                s.n.to_string(),
                format!("{:.0}", s.mean),
                format!("{:.0}", s.median),
                format!("{:.0}", s.p90),
                format!("{:.0}", s.p99),
                format!("{:.0}", s.max),
                slow(v),
            ]
        };
        rows.push(row("cached flag", &c, &cs));
        rows.push(row("INFO lookup (baseline)", &f, &fs));
        rows.push(vec![
            est.into(),
            "ratio baseline/cached".into(),
            String::new(),
            ratio(f.mean, c.mean),
            ratio(f.median, c.median),
            ratio(f.p90, c.p90),
            ratio(f.p99, c.p99),
            String::new(),
            String::new(),
        ]);
        gains.push((est, 1.0 - c.mean / f.mean, 1.0 - c.median / f.median));
    }
    print_table(
        &["samples", "variant", "updates", "mean", "median", "p90", "p99", "max", "> 100 us"],
        &rows,
    );
    println!(
        "\nwall time per round (median): cached {:.2} s, baseline {:.2} s",
        wall(&cached),
        wall(&forced)
    );
    for (est, g_mean, g_median) in gains {
        println!("{est}: cached flag mean {:.1}% below the baseline, median {:.1}% below (target: at least 10%)", g_mean * 100.0, g_median * 100.0);
    }
}
