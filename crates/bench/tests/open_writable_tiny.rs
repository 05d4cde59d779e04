//! The open-time benchmark in tiny form (an 8 GiB image, 2,048 preallocated extents,
//! one round), through the same library code the `open_writable` binary runs, so it
//! never rots. Asserts what must hold whatever the timings: the image has several data
//! groups, some in bitmaps, and passes `btrfs check`; the lazy open caches no group and
//! the eager one caches all of them. Root only (a kernel loop mount makes the image).

#[allow(dead_code)]
#[path = "../src/bin/open_writable.rs"]
mod open_writable;

#[test]
fn open_writable_tiny() {
    if !open_writable::common::is_root()
        || !open_writable::common::have("xfs_io")
        || !open_writable::common::have("mkfs.btrfs")
    {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "open_writable_tiny: needs root, xfs_io and mkfs.btrfs, and CI=true forbids skipping"
        );
        eprintln!("open_writable_tiny: skipped: needs root, xfs_io and mkfs.btrfs");
        return;
    }
    let dir =
        std::env::temp_dir().join(format!("ubtrfs-open-writable-tiny-{}", std::process::id()));
    let (img, l) = open_writable::make_image(&dir, 8 << 30, 2048, 2).expect("image");
    assert!(l.data_groups >= 3, "{} data groups", l.data_groups);
    assert!(
        l.bitmap_groups >= 1 && l.fst_bitmaps >= 1,
        "groups in bitmaps: {}, bitmap items: {}",
        l.bitmap_groups,
        l.fst_bitmaps
    );
    assert!(l.fst_extents >= 200, "{} free-space extents", l.fst_extents);
    let (lazy, eager) = open_writable::run_both(&img.path, l.groups, 1).expect("both variants");
    assert_eq!((lazy.len(), eager.len()), (1, 1), "one sample each");
    drop(img);
    let _ = std::fs::remove_dir_all(&dir);
}
