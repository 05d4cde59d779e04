//! The COW-amplification benchmark in tiny form (10 handles of 64 creates per
//! variant), through the same code the `cow_amp` binary runs, so it never rots.
//! Asserts what must hold whatever the timings: both variants create every file and
//! check clean; with inhibition the handles COW fewer blocks than without, and no
//! search COWs more blocks than without. Timings are not asserted.

#[allow(dead_code)]
#[path = "../src/bin/cow_amp.rs"]
mod cow_amp;

#[test]
fn cow_amp_tiny_inhibition_bounds_the_cows() {
    let tools = std::process::Command::new("mkfs.btrfs")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !tools {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "cow_amp_tiny: needs mkfs.btrfs, and CI=true forbids skipping"
        );
        eprintln!("cow_amp_tiny: skipped: needs mkfs.btrfs and btrfs-progs");
        return;
    }
    let a = cow_amp::Args {
        handles: 10,
        ops: 64,
        runs: 1,
        workdir: std::env::temp_dir().join(format!("ubtrfs-cow-amp-tiny-{}", std::process::id())),
    };
    let with = cow_amp::round(&a, true, true).expect("round with inhibition");
    let without = cow_amp::round(&a, false, true).expect("round without inhibition");
    assert!(
        with.stats.searches >= 10 * 64 * 4 && without.stats.searches >= 10 * 64 * 4,
        "{} / {} searches",
        with.stats.searches,
        without.stats.searches
    );
    assert!(
        with.stats.cows * 4 < without.stats.cows,
        "COWs: {} with inhibition, {} without",
        with.stats.cows,
        without.stats.cows
    );
    assert!(with.stats.max_per_search <= without.stats.max_per_search);
    let _ = std::fs::remove_dir_all(&a.workdir);
}
