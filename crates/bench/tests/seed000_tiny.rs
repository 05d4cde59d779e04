//! The tiny form of `ubtrfs-bench seed000`: both front-steal strategies must leave the
//! cache in the same state, and the workload must do what the benchmark claims (free
//! space in bitmaps before the delete, one front steal per unpinned extent). No timings.

use ubtrfs_bench::seed000::{run, Config, RunOptions, Strategy};

#[test]
fn tiny_forward_walk_and_word_scan_end_in_the_same_state() {
    for bits in [32768, 131072] {
        let cfg = Config::tiny(bits);
        let opts = RunOptions { probe: true, write: true };
        let walk = run(&cfg, Strategy::ForwardWalk, opts).unwrap();
        let word = run(&cfg, Strategy::WordScan, opts).unwrap();
        assert_eq!(walk.state, word.state, "bits={bits}");
        assert_eq!(walk.after_fragment, word.after_fragment);
        assert_eq!(walk.unpinned, word.unpinned);

        // Every bitmap position holds a bitmap and most free space is in them.
        let a = word.after_fragment;
        assert_eq!(a.total_bitmaps, cfg.spans, "bits={bits}");
        assert!(a.bitmap_bytes * 2 > a.free_space, "bits={bits}: {a:?}");
        // The delete unpins one range per file extent, each going through the steal path.
        assert_eq!(word.unpinned.ranges, cfg.file_extents());
        assert_eq!(word.unpinned.bytes, cfg.file_extents() * 4096);
        assert!(word.front_steal_ns.len() as u64 >= cfg.file_extents(), "bits={bits}");
        assert_eq!(walk.front_steal_ns.len(), word.front_steal_ns.len());
        assert_eq!(word.writes, cfg.write_bytes / cfg.write_request);
    }
}

#[test]
fn tiny_binary_runs() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ubtrfs-bench"))
        .args(["seed000", "--tiny"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("final state identical: yes"), "{stdout}");
    assert!(stdout.contains("word scan"), "{stdout}");
}
