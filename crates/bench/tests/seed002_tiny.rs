//! The seed 002 benchmark in tiny form (300 clones and 300 dedupes per variant),
//! through the same code the `seed002` binary runs, so it never rots. Asserts what must
//! hold whatever the timings: every operation of both library variants succeeds (the
//! clones read back, the dedupes find equal bytes), the images check clean, the inline
//! buffer never fills on these handles, and (as root) the kernel's ioctls do the same
//! work. Timings are not asserted.

#[allow(dead_code)]
#[path = "../src/bin/seed002.rs"]
mod seed002;

#[test]
fn seed002_tiny_every_variant_does_the_work() {
    let tools = std::process::Command::new("mkfs.btrfs")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !tools {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "seed002_tiny: needs mkfs.btrfs, and CI=true forbids skipping"
        );
        eprintln!("seed002_tiny: skipped: needs mkfs.btrfs and btrfs-progs");
        return;
    }
    let a = seed002::Args {
        ops: 300,
        runs: 1,
        size_gib: 1,
        no_kernel: false,
        workdir: std::env::temp_dir().join(format!("ubtrfs-seed002-tiny-{}", std::process::id())),
    };
    let bytes = seed002::data(a.ops);
    for map in [false, true] {
        let (r, per_handle, full) =
            seed002::library_round(&a, &bytes, map, true).expect("library round");
        assert_eq!((r.clone.len(), r.dedupe.len()), (300, 300));
        if !map {
            assert_eq!(full, 0, "a clone or dedupe handle filled the inline buffer");
            assert!(per_handle
                .iter()
                .all(|&n| usize::from(n) <= ubtrfs_core::transaction::handle::INHIBIT_SLOTS));
            assert!(
                per_handle.iter().any(|&n| n > 0),
                "the handles inhibited nothing: the test would prove nothing"
            );
        }
    }
    if seed002::common::is_root() {
        let r = seed002::kernel_round(&a, &bytes).expect("kernel round");
        assert_eq!((r.clone.len(), r.dedupe.len()), (300, 300));
    } else {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "seed002_tiny: the kernel side needs root, and CI=true forbids skipping"
        );
        eprintln!("seed002_tiny: the kernel side skipped: needs root");
    }
    let _ = std::fs::remove_dir_all(&a.workdir);
}
