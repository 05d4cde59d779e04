//! The seed 003 benchmark in tiny form (2,000 files, one round), through the same
//! library code the `seed003` binary runs, so it never rots. Asserts what must hold
//! whatever the timings: both variants run the same workload, time the same number
//! of free-space-tree updates and leave identical free-space trees, and the image
//! passes `btrfs check`. Timings are not asserted.

#[allow(dead_code)]
#[path = "../src/bin/seed003.rs"]
mod seed003;

use ubtrfs_format::key::{FREE_SPACE_BITMAP_KEY, FREE_SPACE_EXTENT_KEY, FREE_SPACE_INFO_KEY};

#[test]
fn seed003_tiny_variants_agree() {
    if !seed003::common::have("mkfs.btrfs") {
        eprintln!("skipped: mkfs.btrfs not installed");
        return;
    }
    let dir = std::env::temp_dir().join(format!("ubtrfs-seed003-tiny-{}", std::process::id()));
    let wl = seed003::workload(2000, 2, 500, 30);
    let (cached, forced) = seed003::run_both(&dir, 1 << 30, 1, &wl, |m| eprintln!("{m}"))
        .expect("both variants run and agree");
    let (c, f) = (&cached[0], &forced[0]);
    assert!(!c.timings.is_empty(), "the cached variant timed no free-space-tree updates");
    assert_eq!(c.timings.len(), f.timings.len(), "both variants make the same number of updates");
    assert_eq!(c.commits, f.commits, "both variants commit the same number of times");
    // run_both already compared the trees; check the kept one is a real free-space tree.
    let infos = c.fst.iter().filter(|(k, _)| k.type_ == FREE_SPACE_INFO_KEY).count();
    let free = c
        .fst
        .iter()
        .filter(|(k, _)| k.type_ == FREE_SPACE_EXTENT_KEY || k.type_ == FREE_SPACE_BITMAP_KEY)
        .count();
    assert!(infos >= 3, "at least system, metadata and data groups: {infos} INFO items");
    assert!(free >= infos, "free space items: {free}");
    // The same workload on a fresh image must also satisfy btrfs check.
    if seed003::common::have("btrfs") {
        let img = seed003::common::Image::mkfs(&dir, "check.img", 1 << 30).unwrap();
        seed003::run_variant(&img.path, false, &wl).unwrap();
        img.check().unwrap_or_else(|e| panic!("btrfs check after the tiny workload: {e}"));
    }
    std::fs::remove_dir_all(&dir).ok();
}
