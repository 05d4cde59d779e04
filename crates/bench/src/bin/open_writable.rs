//! The open time of a writable engine on an image with many block groups: caching each
//! group's free space on first use (the kernel's caching, what `FsWriter::open` does)
//! against loading every group's free space at open (the old open, kept as the test
//! hook `cache_all_block_groups_eagerly`), both measured in one run.
//!
//! Image (root only; made once per run): a sparse `--size-gib` image from `mkfs.btrfs`;
//! on a kernel loop mount, `--extents` preallocated extents of 1 MiB in one file with
//! every other one punched out (fragmented free space in every data group, about 512
//! free extents per 1 GiB group); then, through the library, every `--bitmap-every`th
//! data group converted to free-space bitmaps and committed; `btrfs check` once.
//! Rounds alternate the two variants on the same image (page cache warm for both after
//! a warm-up pair); each times a fresh `FsWriter::open` (plus, for the eager variant,
//! the eager load), then drops the writer unchanged.
//!
//!     cargo build --release -p ubtrfs-bench && target/release/open_writable [--runs 15]

#[path = "common/mod.rs"]
pub mod common;

use clap::Parser;
use common::{median, print_table, run_cmd, Image};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use ubtrfs_core::FsWriter;
use ubtrfs_core::OpenOptions;
use ubtrfs_format::key::{FREE_SPACE_BITMAP_KEY, FREE_SPACE_EXTENT_KEY, FREE_SPACE_TREE_OBJECTID};
use ubtrfs_format::structs::BLOCK_GROUP_DATA;
use ubtrfs_format::Key;

#[derive(Parser, Debug)]
#[command(
    about = "writable open on many block groups: free space cached per group on first use vs loaded for every group at open"
)]
pub struct Args {
    /// Image size in GiB (sparse file).
    #[arg(long, default_value_t = 64)]
    pub size_gib: u64,
    /// Preallocated 1 MiB extents (every other one punched out afterwards).
    #[arg(long, default_value_t = 40_960)]
    pub extents: u64,
    /// Convert every Nth data group to free-space bitmaps (0: none).
    #[arg(long, default_value_t = 2)]
    pub bitmap_every: usize,
    /// Timed rounds per variant.
    #[arg(long, default_value_t = 15)]
    pub runs: u32,
    /// Where the image and its mount point go.
    #[arg(long, default_value = "/var/tmp/ubtrfs-bench/open_writable")]
    pub workdir: PathBuf,
}

/// What the image holds.
pub struct Layout {
    pub groups: usize,
    pub data_groups: usize,
    pub bitmap_groups: usize,
    pub fst_extents: usize,
    pub fst_bitmaps: usize,
}

/// Make the fragmented many-group image in `dir`.
///
/// # Errors
/// mkfs, mount, xfs_io, the library or `btrfs check` failing.
pub fn make_image(
    dir: &Path,
    size: u64,
    extents: u64,
    bitmap_every: usize,
) -> Result<(Image, Layout), String> {
    let img = Image::mkfs(dir, "many-groups.img", size)?;
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).map_err(|e| format!("{}: {e}", mnt.display()))?;
    run_cmd(Command::new("mount").args(["-t", "btrfs", "-o", "loop"]).arg(&img.path).arg(&mnt))?;
    let file = mnt.join("prealloc");
    let falloc: Vec<String> =
        (0..extents).flat_map(|i| ["-c".to_string(), format!("falloc {i}m 1m")]).collect();
    let punch: Vec<String> = (0..extents)
        .step_by(2)
        .flat_map(|i| ["-c".to_string(), format!("fpunch {i}m 1m")])
        .collect();
    let r = run_cmd(Command::new("xfs_io").arg("-f").args(&falloc).arg(&file))
        .and_then(|_| run_cmd(Command::new("xfs_io").args(&punch).arg(&file)));
    let u = run_cmd(Command::new("umount").arg(&mnt));
    r?;
    u?;
    let mut w = FsWriter::open(&OpenOptions::new(&img.path)).map_err(|e| format!("open: {e}"))?;
    let all = w.info.block_groups().map_err(|e| format!("block groups: {e}"))?;
    let data: Vec<_> = all.iter().filter(|g| g.flags & BLOCK_GROUP_DATA != 0).collect();
    let mut bitmap_groups = 0;
    if bitmap_every > 0 {
        let mut h =
            ubtrfs_core::transaction::Transaction::join_transaction(&mut w, "convert to bitmaps")
                .map_err(|e| format!("start a handle: {e}"))?;
        for g in data.iter().skip(1).step_by(bitmap_every) {
            ubtrfs_core::space::free_space_tree::convert_to_bitmaps(&mut h, g.start, g.length)
                .map_err(|e| format!("convert group {}: {e}", g.start))?;
            bitmap_groups += 1;
        }
        h.end().map_err(|e| format!("end the handle: {e}"))?;
    }
    w.commit().map_err(|e| format!("commit: {e}"))?;
    let items = w
        .items_in_range(FREE_SPACE_TREE_OBJECTID, &Key::MIN, &Key::MAX)
        .map_err(|e| format!("free-space tree: {e}"))?;
    let layout = Layout {
        groups: all.len(),
        data_groups: data.len(),
        bitmap_groups,
        fst_extents: items.iter().filter(|(k, _)| k.type_ == FREE_SPACE_EXTENT_KEY).count(),
        fst_bitmaps: items.iter().filter(|(k, _)| k.type_ == FREE_SPACE_BITMAP_KEY).count(),
    };
    drop(w);
    img.check()?;
    Ok((img, layout))
}

/// One timed open: lazy (`eager == false`) or with every group's free space loaded.
/// Returns seconds and the number of cached groups afterwards.
///
/// # Errors
/// The open or the eager load failing.
pub fn time_open(path: &Path, eager: bool) -> Result<(f64, usize), String> {
    let t0 = Instant::now();
    let mut w = FsWriter::open(&OpenOptions::new(path)).map_err(|e| format!("open: {e}"))?;
    if eager {
        w.cache_all_block_groups_eagerly().map_err(|e| format!("eager load: {e}"))?;
    }
    let s = t0.elapsed().as_secs_f64();
    let cached = w.cached_block_groups().len();
    drop(w);
    Ok((s, cached))
}

/// Alternate the variants over `runs` rounds after one warm-up pair; returns the
/// (lazy, eager) samples in seconds.
///
/// # Errors
/// As `time_open`; a lazy open that cached a group, or an eager one that missed one.
pub fn run_both(path: &Path, groups: usize, runs: u32) -> Result<(Vec<f64>, Vec<f64>), String> {
    time_open(path, false)?;
    time_open(path, true)?;
    let (mut lazy, mut eager) = (Vec::new(), Vec::new());
    for r in 0..runs {
        for e in if r % 2 == 0 { [false, true] } else { [true, false] } {
            let (s, cached) = time_open(path, e)?;
            let want = if e { groups } else { 0 };
            if cached != want {
                return Err(format!(
                    "{} open cached {cached} groups, {want} expected",
                    if e { "eager" } else { "lazy" }
                ));
            }
            if e { &mut eager } else { &mut lazy }.push(s);
        }
    }
    Ok((lazy, eager))
}

fn main() {
    let a = Args::parse();
    if !common::is_root() {
        eprintln!("open_writable: needs root (a kernel loop mount makes the image)");
        std::process::exit(2);
    }
    let (img, l) = match make_image(&a.workdir, a.size_gib << 30, a.extents, a.bitmap_every) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("open_writable: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "image: {} GiB, {} block groups ({} data, {} of them in bitmaps), free-space tree: {} extent items, {} bitmap items",
        a.size_gib, l.groups, l.data_groups, l.bitmap_groups, l.fst_extents, l.fst_bitmaps
    );
    let (lazy, eager) = match run_both(&img.path, l.groups, a.runs) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("open_writable: {e}");
            std::process::exit(1);
        }
    };
    let fmt =
        |v: &[f64]| v.iter().map(|s| format!("{:.2}", s * 1e3)).collect::<Vec<_>>().join(", ");
    let row = |name: &str, v: &[f64]| {
        let min = v.iter().copied().fold(f64::INFINITY, f64::min);
        vec![
            name.to_string(),
            format!("{:.2}", median(v) * 1e3),
            format!("{:.2}", min * 1e3),
            fmt(v),
        ]
    };
    print_table(
        &["variant", "median ms", "min ms", "runs (ms)"],
        &[row("cached per group on first use", &lazy), row("every group loaded at open", &eager)],
    );
    println!("\nratio (eager / lazy, medians): {:.2}", median(&eager) / median(&lazy));
}
