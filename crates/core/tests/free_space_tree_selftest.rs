//! The kernel's free-space-tree self-tests (fs/btrfs/tests/free-space-tree-tests.c,
//! reference §7.2), ported onto a writable copy of a kernel-made image, plus the
//! automatic format conversions at the real thresholds (§2.2, §2.4).
//!
//! Harness: an in-memory block group of 8a bytes at S (beyond every real chunk, so no
//! allocation or delayed ref touches it) with `NEEDS_FREE_SPACE` set, thresholds
//! overridden to (0, u32::MAX) so nothing converts on its own; add the group's free
//! space, convert to bitmaps for the bitmap format, run the operations, check the
//! expected free extents E in the current format and again after converting to the
//! other one, then remove all the group's free space and its INFO: no item of the
//! group may remain. Every case runs in both formats with a = sectorsize and
//! a = 2048 × 4096 (8 MiB: one full bitmap item per a). Each test then commits and,
//! when `btrfs` is installed, runs `btrfs check --readonly` on the image.

mod common;

use ubtrfs_core::space::free_space_tree::{
    add_block_group_free_space, add_to_free_space_tree, convert_to_bitmaps, convert_to_extents,
    free_runs, remove_from_free_space_tree, thresholds, FstFormatFn,
};
use ubtrfs_core::transaction::Transaction;
use ubtrfs_core::FsWriter;
use ubtrfs_core::OpenOptions;
use ubtrfs_format::key::{
    FREE_SPACE_BITMAP_KEY, FREE_SPACE_EXTENT_KEY, FREE_SPACE_INFO_KEY,
    FREE_SPACE_TREE_OBJECTID as FST,
};
use ubtrfs_format::structs::{BLOCK_GROUP_DATA, FREE_SPACE_BITMAP_BITS, FREE_SPACE_USING_BITMAPS};
use ubtrfs_format::Key;

/// Run one free-space-tree change in a transaction handle of its own.
fn in_handle<T>(
    w: &mut ubtrfs_core::FsWriter,
    f: impl FnOnce(&mut ubtrfs_core::transaction::TransHandle<'_>) -> ubtrfs_core::Result<T>,
) -> ubtrfs_core::Result<T> {
    let mut h = ubtrfs_core::transaction::Transaction::join_transaction(w, "free-space tree test")?;
    let r = f(&mut h);
    h.end_with(r)
}

/// A writable copy of the blake2 fixture, deleted on drop unless KEEP is set.
struct Image(std::path::PathBuf);

impl Image {
    fn new(tag: &str) -> Image {
        let src = &common::fixture_images("blake2")[0];
        let dst = std::env::temp_dir()
            .join(format!("ubtrfs-fst-selftest-{tag}-{}.img", std::process::id()));
        std::fs::copy(src, &dst).expect("copy fixture");
        Image(dst)
    }
    fn writer(&self) -> FsWriter {
        FsWriter::open(&OpenOptions::new(&self.0)).expect("open fixture for writing")
    }
    /// Commit and let btrfs-progs judge the result (skipped when it is not installed).
    fn commit_and_check(&self, mut w: FsWriter) {
        w.hooks.fst_thresholds_override = None;
        w.check_invariants(FST).expect("free-space tree invariants before commit");
        w.commit().expect("commit");
        drop(w);
        if let Ok(o) = std::process::Command::new("btrfs")
            .args(["check", "--readonly", "--check-data-csum"])
            .arg(&self.0)
            .output()
        {
            assert!(
                o.status.success(),
                "btrfs check failed:\n{}\n{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        if std::env::var_os("KEEP").is_none() {
            std::fs::remove_file(&self.0).ok();
        } else {
            eprintln!("kept {}", self.0.display());
        }
    }
}

/// A start for test groups past every real chunk, 1 GiB aligned.
fn test_group_base(w: &FsWriter) -> u64 {
    let end = w.info.chunk_map.iter().map(|c| c.logical + c.length).max().expect("chunks");
    ((end >> 30) + 1) << 30
}

/// Every free-space-tree item whose objectid lies in [start, start+len).
fn group_items(w: &mut FsWriter, start: u64, len: u64) -> Vec<(Key, Vec<u8>)> {
    w.items_in_range(FST, &Key::new(start, 0, 0), &Key::new(start + len - 1, u8::MAX, u64::MAX))
        .expect("read free-space tree")
}

/// (extent_count, flags) of the group's INFO item, which must be the first item.
fn info(w: &mut FsWriter, start: u64, len: u64) -> (u32, u32) {
    let items = group_items(w, start, len);
    let (k, d) = items.first().unwrap_or_else(|| panic!("group {start}: no items, INFO expected"));
    assert_eq!(*k, Key::new(start, FREE_SPACE_INFO_KEY, len), "group {start}: first item");
    assert_eq!(d.len(), 8, "INFO size");
    (
        u32::from_le_bytes(d[0..4].try_into().unwrap()),
        u32::from_le_bytes(d[4..8].try_into().unwrap()),
    )
}

/// Walk the group's BITMAP items bit by bit (independently of `free_runs`), checking
/// that they tile the group with exact sizes; returns the maximal free runs.
fn bitmap_runs(w: &mut FsWriter, start: u64, len: u64) -> Vec<(u64, u64)> {
    let ss = u64::from(w.sectorsize());
    let range = ss * FREE_SPACE_BITMAP_BITS;
    let items = group_items(w, start, len);
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut expect_at = start;
    for (k, d) in items.iter().skip(1) {
        assert_eq!(k.type_, FREE_SPACE_BITMAP_KEY, "group {start} in bitmap format holds {k}");
        assert_eq!(k.objectid, expect_at, "bitmap items must tile the group: {k}");
        assert_eq!(k.offset, range.min(start + len - k.objectid), "bitmap length of {k}");
        let bits = k.offset / ss;
        assert_eq!(d.len() as u64, bits.div_ceil(8), "bitmap item size of {k}");
        for b in 0..bits {
            if d[(b / 8) as usize] & (1 << (b % 8)) != 0 {
                let p = k.objectid + b * ss;
                match runs.last_mut() {
                    Some((s, l)) if *s + *l == p => *l += ss,
                    _ => runs.push((p, ss)),
                }
            }
        }
        // Bits past the end of a short last bitmap must be clear.
        for b in bits..d.len() as u64 * 8 {
            assert_eq!(d[(b / 8) as usize] & (1 << (b % 8)), 0, "padding bit {b} of {k} set");
        }
        expect_at = k.objectid + k.offset;
    }
    assert_eq!(expect_at, start + len, "bitmap items of group {start} stop early");
    runs
}

/// The kernel's `__check_free_space_extents` in the group's current format, plus the
/// seed 003 invariant: the cached format equals the INFO flag.
fn check_current(w: &mut FsWriter, start: u64, len: u64, e: &[(u64, u64)], what: &str) {
    let (count, flags) = info(w, start, len);
    let bitmaps = flags & FREE_SPACE_USING_BITMAPS != 0;
    assert_eq!(
        w.fst_cached_bitmaps(start),
        Some(bitmaps),
        "{what}: cached format vs INFO flags {flags:#x}"
    );
    assert_eq!(count as usize, e.len(), "{what}: INFO extent_count");
    if bitmaps {
        assert_eq!(bitmap_runs(w, start, len), e, "{what}: bitmap runs");
    } else {
        let items = group_items(w, start, len);
        let mut want = vec![Key::new(start, FREE_SPACE_INFO_KEY, len)];
        want.extend(e.iter().map(|&(s, l)| Key::new(s, FREE_SPACE_EXTENT_KEY, l)));
        let got: Vec<Key> = items.iter().map(|(k, _)| *k).collect();
        assert_eq!(got, want, "{what}: items (INFO + one EXTENT per expected extent)");
        assert!(
            items.iter().all(|(_, d)| d.is_empty() || d.len() == 8),
            "{what}: EXTENT items carry no data"
        );
    }
    assert_eq!(free_runs(w, start, len).unwrap(), e, "{what}: free_runs");
    w.check_invariants(FST).unwrap_or_else(|err| panic!("{what}: tree invariants: {err}"));
}

/// `check_free_space_extents`: check, convert to the other format, check again.
fn check_free_space_extents(w: &mut FsWriter, start: u64, len: u64, e: &[(u64, u64)], what: &str) {
    check_current(w, start, len, e, &format!("{what}, as built"));
    let (_, flags) = info(w, start, len);
    if flags & FREE_SPACE_USING_BITMAPS != 0 {
        in_handle(w, |h| convert_to_extents(h, start, len)).unwrap();
    } else {
        in_handle(w, |h| convert_to_bitmaps(h, start, len)).unwrap();
    }
    check_current(w, start, len, e, &format!("{what}, converted"));
}

/// Remove all the group's free space, then the group itself (the kernel's harness ends
/// with `remove_block_group_free_space` and an empty leaf): no EXTENT may survive the
/// removal, bitmaps may (all clear), and after the group removal nothing remains.
fn teardown(w: &mut FsWriter, start: u64, len: u64, what: &str) {
    for (s, l) in free_runs(w, start, len).unwrap() {
        in_handle(w, |h| remove_from_free_space_tree(h, s, l))
            .unwrap_or_else(|e| panic!("{what}: removing {s} +{l}: {e}"));
    }
    let (count, flags) = info(w, start, len);
    assert_eq!(count, 0, "{what}: extent_count after removing everything");
    let items = group_items(w, start, len);
    for (k, d) in items.iter().skip(1) {
        assert_eq!(
            k.type_, FREE_SPACE_BITMAP_KEY,
            "{what}: {k} left after removing all free space"
        );
        assert!(flags & FREE_SPACE_USING_BITMAPS != 0, "{what}: bitmap {k} in extent format");
        assert!(d.iter().all(|&b| b == 0), "{what}: bitmap {k} still has free bits");
    }
    for (k, _) in items {
        assert!(w.raw_tree().delete_item(FST, &k).unwrap(), "{what}: {k} vanished");
    }
    assert!(w.remove_test_group(start));
    assert!(group_items(w, start, len).is_empty(), "{what}: items left behind");
    w.check_invariants(FST).unwrap();
}

type Ops = fn(&mut FsWriter, u64, u64) -> Vec<(u64, u64)>;

/// Run one kernel test in both formats and both alignments on one image.
fn run(name: &str, ops: Ops) {
    let img = Image::new(name);
    let mut w = img.writer();
    w.hooks.fst_thresholds_override = Some((0, u32::MAX));
    let base = test_group_base(&w);
    let ss = u64::from(w.sectorsize());
    for a in [ss, 2048 * 4096] {
        for bitmaps in [false, true] {
            let what = format!("{name} a={a} {}", if bitmaps { "bitmaps" } else { "extents" });
            let s = base;
            let len = 8 * a;
            w.insert_test_group(s, len, BLOCK_GROUP_DATA).unwrap();
            in_handle(&mut w, |h| add_block_group_free_space(h, s)).unwrap();
            if bitmaps {
                in_handle(&mut w, |h| convert_to_bitmaps(h, s, len)).unwrap();
            }
            let e = ops(&mut w, s, a);
            check_free_space_extents(&mut w, s, len, &e, &what);
            teardown(&mut w, s, len, &what);
        }
    }
    img.commit_and_check(w);
}

fn rm(w: &mut FsWriter, s: u64, l: u64) {
    in_handle(w, |h| remove_from_free_space_tree(h, s, l))
        .unwrap_or_else(|e| panic!("remove {s} +{l}: {e}"));
}
fn add(w: &mut FsWriter, s: u64, l: u64) {
    in_handle(w, |h| add_to_free_space_tree(h, s, l))
        .unwrap_or_else(|e| panic!("add {s} +{l}: {e}"));
}

#[test]
fn empty_block_group() {
    run("empty_block_group", |_, s, a| vec![(s, 8 * a)]);
}

#[test]
fn remove_all() {
    run("remove_all", |w, s, a| {
        rm(w, s, 8 * a);
        vec![]
    });
}

#[test]
fn remove_beginning() {
    run("remove_beginning", |w, s, a| {
        rm(w, s, a);
        vec![(s + a, 7 * a)]
    });
}

#[test]
fn remove_end() {
    run("remove_end", |w, s, a| {
        rm(w, s + 7 * a, a);
        vec![(s, 7 * a)]
    });
}

#[test]
fn remove_middle() {
    run("remove_middle", |w, s, a| {
        rm(w, s + a, a);
        vec![(s, a), (s + 2 * a, 6 * a)]
    });
}

#[test]
fn merge_left() {
    run("merge_left", |w, s, a| {
        rm(w, s, 8 * a);
        add(w, s, a);
        add(w, s + a, a);
        vec![(s, 2 * a)]
    });
}

#[test]
fn merge_right() {
    run("merge_right", |w, s, a| {
        rm(w, s, 8 * a);
        add(w, s + 2 * a, a);
        add(w, s + a, a);
        vec![(s + a, 2 * a)]
    });
}

#[test]
fn merge_both() {
    run("merge_both", |w, s, a| {
        rm(w, s, 8 * a);
        add(w, s, a);
        add(w, s + 2 * a, a);
        add(w, s + a, a);
        vec![(s, 3 * a)]
    });
}

#[test]
fn merge_none() {
    run("merge_none", |w, s, a| {
        rm(w, s, 8 * a);
        add(w, s, a);
        add(w, s + 4 * a, a);
        add(w, s + 2 * a, a);
        vec![(s, a), (s + 2 * a, a), (s + 4 * a, a)]
    });
}

/// Maximal runs of a per-sector free map.
fn model_runs(free: &[bool], start: u64, ss: u64) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (i, &f) in free.iter().enumerate() {
        if f {
            let p = start + i as u64 * ss;
            match runs.last_mut() {
                Some((s, l)) if *s + *l == p => *l += ss,
                _ => runs.push((p, ss)),
            }
        }
    }
    runs
}

/// Fragment a group of `len` bytes with single-sector holes until it crosses `high`,
/// then free the holes again, checking after every update that the tree matches a
/// model, that the format flips exactly when the kernel's rule says (extents and
/// count > high → bitmaps; bitmaps and count < low → extents) and that the cached
/// format always equals the INFO flag. Returns the conversions seen as (step, to_bitmaps).
fn auto_convert(w: &mut FsWriter, s: u64, len: u64) -> Vec<(usize, bool)> {
    let ss = u64::from(w.sectorsize());
    let (low, high) = thresholds(len, w.sectorsize());
    w.insert_test_group(s, len, BLOCK_GROUP_DATA).unwrap();
    in_handle(w, |h| add_block_group_free_space(h, s)).unwrap();
    let mut free = vec![true; (len / ss) as usize];
    let mut bitmaps = false;
    let mut seen = Vec::new();
    let mut step = 0usize;
    let mut apply = |w: &mut FsWriter, free: &mut Vec<bool>, idx: usize, make_free: bool| {
        let p = s + idx as u64 * ss;
        if make_free {
            add(w, p, ss);
        } else {
            rm(w, p, ss);
        }
        free[idx] = make_free;
        let runs = model_runs(free, s, ss);
        let count = runs.len() as u32;
        let want = if !bitmaps && count > high {
            true
        } else if bitmaps && count < low {
            false
        } else {
            bitmaps
        };
        step += 1;
        if want != bitmaps {
            seen.push((step, want));
            bitmaps = want;
        }
        let (c, flags) = info(w, s, len);
        assert_eq!(c, count, "step {step}: extent_count");
        assert_eq!(
            flags & FREE_SPACE_USING_BITMAPS != 0,
            bitmaps,
            "step {step}: format after count {count} (low {low}, high {high})"
        );
        assert_eq!(w.fst_cached_bitmaps(s), Some(bitmaps), "step {step}: cached format vs INFO");
        let kinds: Vec<u8> = group_items(w, s, len).iter().skip(1).map(|(k, _)| k.type_).collect();
        let kind = if bitmaps { FREE_SPACE_BITMAP_KEY } else { FREE_SPACE_EXTENT_KEY };
        assert!(kinds.iter().all(|&t| t == kind), "step {step}: items of the wrong format");
        assert_eq!(free_runs(w, s, len).unwrap(), runs, "step {step}: free runs");
    };
    // Holes at sectors 1, 3, 5, ...: after k holes the group has k + 1 free runs.
    let holes: Vec<usize> = (0..=high as usize).map(|k| 2 * k + 1).collect();
    for &h in &holes {
        apply(w, &mut free, h, false);
    }
    for &h in holes.iter().rev() {
        apply(w, &mut free, h, true);
    }
    w.check_invariants(FST).unwrap();
    teardown(w, s, len, "auto_convert");
    seen
}

/// The group's format read from its INFO item on every update, in place of the cached
/// flag: with it the conversions must happen at the same steps, so the flags they
/// write in INFO agree with the format they leave.
fn info_lookup(w: &mut Transaction, start: u64, len: u64) -> ubtrfs_core::Result<bool> {
    let key = Key::new(start, FREE_SPACE_INFO_KEY, len);
    let root = w.root(FST)?;
    let (k, d) = w.first_item_ge(&root, &key)?.expect("an item at or after INFO");
    assert_eq!(k, key, "group {start}: INFO item");
    Ok(u32::from_le_bytes(d[4..8].try_into().unwrap()) & FREE_SPACE_USING_BITMAPS != 0)
}

#[test]
fn automatic_conversion_at_real_thresholds() {
    let img = Image::new("auto");
    let mut w = img.writer();
    let base = test_group_base(&w);
    for force in [false, true] {
        w.hooks.fst_format_lookup = force.then_some(info_lookup as FstFormatFn);
        // Step k (k = 1..=high+1) makes k+1 runs; step high+1+j (freeing) leaves
        // high+2-j. 8 MiB: (low, high) = (0, 11): bitmaps at 12 runs (step 11), never
        // back, since the count cannot drop below 0.
        assert_eq!(thresholds(8 << 20, 4096), (0, 11));
        let seen = auto_convert(&mut w, base, 8 << 20);
        assert_eq!(seen, vec![(11, true)], "8 MiB group conversions (force_info_lookup={force})");
        // 256 MiB: (259, 359): bitmaps at 360 runs (step 359); extents at 258 runs,
        // step 360 + (361 - 258) = 463.
        assert_eq!(thresholds(256 << 20, 4096), (259, 359));
        let seen = auto_convert(&mut w, base, 256 << 20);
        assert_eq!(
            seen,
            vec![(359, true), (463, false)],
            "256 MiB group conversions (force_info_lookup={force})"
        );
    }
    w.hooks.fst_format_lookup = None;
    img.commit_and_check(w);
}

/// The cache is filled on first use from the INFO item, whichever format the group is
/// in on disk: a fresh writer over a committed bitmap group must find it in bitmaps.
#[test]
fn cached_format_loaded_from_disk() {
    let img = Image::new("reload");
    let mut w = img.writer();
    // A real group converted to bitmaps and committed: the fresh writer's first update
    // must learn the format from INFO (no cache yet) and keep the tree consistent.
    let (start, len) = {
        let mut groups: Vec<(u64, u64)> = Vec::new();
        let items = w
            .items_in_range(FST, &Key::new(0, 0, 0), &Key::new(u64::MAX, u8::MAX, u64::MAX))
            .unwrap();
        for (k, _) in items {
            if k.type_ == FREE_SPACE_INFO_KEY
                && w.info
                    .chunk_map
                    .iter()
                    .any(|c| c.logical == k.objectid && c.type_ & BLOCK_GROUP_DATA != 0)
            {
                groups.push((k.objectid, k.offset));
            }
        }
        groups[0]
    };
    let before = free_runs(&mut w, start, len).unwrap();
    in_handle(&mut w, |h| convert_to_bitmaps(h, start, len)).unwrap();
    img.commit_and_check(w);
    let mut w = img.writer();
    assert_eq!(w.fst_cached_bitmaps(start), None, "nothing cached at open");
    assert_eq!(free_runs(&mut w, start, len).unwrap(), before);
    // Take one free sector out and put it back through the normal paths.
    let (fs, _) = before[0];
    let ss = u64::from(w.sectorsize());
    in_handle(&mut w, |h| remove_from_free_space_tree(h, fs, ss)).unwrap();
    assert_eq!(w.fst_cached_bitmaps(start), Some(true), "cache filled from INFO");
    in_handle(&mut w, |h| add_to_free_space_tree(h, fs, ss)).unwrap();
    assert_eq!(free_runs(&mut w, start, len).unwrap(), before);
    assert_eq!(info(&mut w, start, len).1 & FREE_SPACE_USING_BITMAPS, FREE_SPACE_USING_BITMAPS);
    img.commit_and_check(w);
}
