//! Incremental qgroup accounting (`extent::qgroup`, `extent::backref`) against the full
//! recount. With quotas on, a commit accounts only the extents whose references
//! changed; here every commit is also recounted from scratch (the verification hook)
//! and must agree, the numbers are read back from the QGROUP_INFO items and checked by
//! `ubtrfs check` (its own count) and at the end by `btrfs check`. A second test shows
//! a small commit on an image with thousands of files reads a few blocks, where the
//! recount reads every block of the subvolume trees.

mod common;
#[path = "common/write.rs"]
mod write_common;

use ubtrfs_core::compression::CompressPolicy;
use ubtrfs_core::inode::attr::SetAttr;
use ubtrfs_core::inode::filesystem::InodeId;
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FsRead;
use ubtrfs_core::FsWriter;
use ubtrfs_core::TreeView;
use ubtrfs_format::key::*;
use write_common::*;

const LEVEL1: u64 = 1 << 48 | 1;

/// `ubtrfs check` (which counts the qgroups its own way) finds the image clean.
fn ubtrfs_check(img: &Scratch, what: &str) {
    let fs = img.reader();
    let rep = ubtrfs_tools::check::check(&fs.info, &ubtrfs_tools::check::CheckOptions::default())
        .unwrap_or_else(|e| panic!("{what}: ubtrfs check: {e}"));
    let problems: Vec<String> = rep.findings.iter().take(10).map(|f| f.to_string()).collect();
    assert!(
        rep.is_clean(),
        "{what}: ubtrfs check found {} problems:\n{}",
        rep.problems(),
        problems.join("\n")
    );
}

/// `btrfs check --readonly --check-data-csum` (which verifies the qgroup numbers), or a
/// printed reason when btrfs-progs is missing (never under CI).
fn progs_check(img: &Scratch, what: &str) {
    if have_btrfs_check() {
        assert_check(&img.path, what);
    } else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{what}: btrfs-progs is required under CI"
        );
        eprintln!("{what}: btrfs check skipped: btrfs-progs is not installed");
    }
}

/// One file of the model: where it lives and what it holds.
struct File {
    root: u64,
    name: Vec<u8>,
    ino: u64,
    size: u64,
}

/// Random creates, writes, overwrites, truncates, unlinks and compressed writes in
/// three subvolumes (two of them under a level-1 qgroup), committed every few
/// operations: every commit is accounted incrementally (no recount once the relations
/// are counted) and equals the full recount, and the stored numbers follow.
#[test]
fn random_operations_match_the_recount() {
    for seed in [1u64, 2, 3] {
        run_model(seed, 300);
    }
}

fn run_model(seed: u64, ops: usize) {
    let what = format!("seed {seed}");
    let img =
        Scratch::mkfs(&format!("qgroup-model-{seed}"), 256 * MIB, &["-R", "quota", "-n", "4096"]);
    let mut w = img.writer();
    w.set_qgroup_verify(true);
    let top = w.live().root_dir();
    let a = w.create_subvol(top.root, top.ino, b"a", &InodeAttrs::new(0o755)).expect("subvol a");
    let b = w.create_subvol(top.root, top.ino, b"b", &InodeAttrs::new(0o755)).expect("subvol b");
    w.commit().expect("commit subvolumes");
    let st = w.qgroup_stats().expect("quotas are on");
    assert_eq!(st.recount, None, "{what}: new subvolumes are accounted incrementally");
    assert!(
        qgroup_counts(&mut w).contains_key(&a) && qgroup_counts(&mut w).contains_key(&b),
        "{what}: new subvolumes get qgroups"
    );
    assert_eq!(
        qgroup_counts(&mut w)[&a],
        (4096, 4096),
        "{what}: a new subvolume's root leaf counts for its qgroup"
    );
    w.qgroup_create(LEVEL1).expect("qgroup 1/1");
    w.qgroup_assign(a, LEVEL1).expect("assign a");
    w.qgroup_assign(b, LEVEL1).expect("assign b");
    w.commit().expect("commit relations");
    assert!(
        w.qgroup_stats().unwrap().recount.is_some_and(|r| r.contains("assigned")),
        "{what}: a relation change recounts"
    );
    let s = qgroup_counts(&mut w);
    assert_eq!(
        s[&LEVEL1],
        (s[&a].0 + s[&b].0, s[&a].1 + s[&b].1),
        "{what}: 1/1 holds a and b, which share nothing"
    );

    let mut rng = Rng::new(seed);
    let mut files: Vec<File> = Vec::new();
    let mut roots = vec![FS_TREE_OBJECTID, a, b];
    let mut names = 0u64;
    let mut commits = 0;
    for op in 0..ops {
        let root = *rng.pick(&roots);
        let choice = rng.below(100);
        if choice < 30 || files.is_empty() {
            names += 1;
            let name = format!("f{names}").into_bytes();
            let ino = w
                .create_file(root, FIRST_FREE_OBJECTID, &name, &InodeAttrs::new(0o644))
                .expect("create");
            let size = *rng.pick(&[0, 100, 3000, 4096, 5000, 70_000, 300_000]);
            if size > 0 {
                w.write_file(root, ino, 0, &rng.bytes(size as usize)).expect("write");
            }
            files.push(File { root, name, ino, size });
        } else if choice < 55 {
            let i = rng.below(files.len() as u64) as usize;
            let f = &mut files[i];
            let off = rng.below(f.size + 20_000);
            let len = rng.range(1, 150_000) as usize;
            w.write_file(f.root, f.ino, off, &rng.bytes(len)).expect("overwrite");
            f.size = f.size.max(off + len as u64);
        } else if choice < 65 {
            // Compressible data through zstd or zlib, then compression off again.
            let i = rng.below(files.len() as u64) as usize;
            let f = &mut files[i];
            let alg = if rng.chance(50) { "zstd" } else { "zlib" };
            w.set_compress(CompressPolicy::parse(alg, false).expect("policy"));
            let len = rng.range(5000, 400_000) as usize;
            let data: Vec<u8> = (0..len).map(|i| b"qgroup extent "[i % 14]).collect();
            let off = rng.below(f.size + 1);
            w.write_file(f.root, f.ino, off, &data).expect("compressed write");
            w.set_compress(CompressPolicy::default());
            f.size = f.size.max(off + len as u64);
        } else if choice < 80 {
            let i = rng.below(files.len() as u64) as usize;
            let f = &mut files[i];
            let size = rng.below(f.size + 1);
            w.setattr(
                InodeId { root: f.root, ino: f.ino },
                &SetAttr { size: Some(size), ..Default::default() },
            )
            .expect("truncate");
            f.size = size;
        } else if choice < 95 {
            let f = files.swap_remove(rng.below(files.len() as u64) as usize);
            w.unlink(f.root, FIRST_FREE_OBJECTID, &f.name).expect("unlink");
        } else if roots.len() < 5 {
            names += 1;
            let id = w
                .create_subvol(
                    top.root,
                    top.ino,
                    format!("s{names}").as_bytes(),
                    &InodeAttrs::new(0o755),
                )
                .expect("subvol");
            roots.push(id);
        }
        if rng.chance(12) || op + 1 == ops {
            w.commit().unwrap_or_else(|e| panic!("{what}: commit after op {op}: {e}"));
            commits += 1;
            let st = w.qgroup_stats().unwrap();
            assert_eq!(st.recount, None, "{what}: commit after op {op} recounted");
            let s = qgroup_counts(&mut w);
            assert_eq!(
                s[&LEVEL1].0,
                s[&a].0 + s[&b].0,
                "{what}: op {op}: 1/1 references what a and b do"
            );
            assert_eq!(
                s[&LEVEL1].1,
                s[&a].1 + s[&b].1,
                "{what}: op {op}: 1/1 holds exclusively what a and b do"
            );
            for &r in &roots {
                assert!(
                    s[&r].0 >= s[&r].1 && s[&r].1 >= 4096,
                    "{what}: op {op}: qgroup 0/{r} {:?}",
                    s[&r]
                );
            }
            if commits % 8 == 0 {
                drop(w);
                ubtrfs_check(&img, &format!("{what} after op {op}"));
                w = img.writer();
                w.set_qgroup_verify(true);
            }
        }
    }
    drop(w);
    ubtrfs_check(&img, &format!("{what}: final image"));
    progs_check(&img, &format!("{what}: final image"));
}

/// A commit after a one-file change on an image with 20000 files reads a few
/// blocks per changed extent (the backref walks), where the full recount reads every
/// block of the subvolume trees.
#[test]
fn a_small_commit_reads_few_blocks() {
    // UBTRFS_QGROUP_FILES makes the image bigger for a measurement.
    let files: u32 = std::env::var("UBTRFS_QGROUP_FILES")
        .map_or(20_000, |v| v.parse().expect("UBTRFS_QGROUP_FILES is a number"));
    let img = Scratch::mkfs(
        "qgroup-bounded",
        (256 * MIB).max(u64::from(files) * 16 * KIB + 128 * MIB),
        &["-R", "quota", "-n", "4096"],
    );
    let mut w = img.writer();
    w.set_qgroup_verify(false);
    let top = w.live().root_dir();
    let mut inos = Vec::new();
    for i in 0..files {
        let ino = w
            .create_file(top.root, top.ino, format!("file-{i}").as_bytes(), &InodeAttrs::new(0o644))
            .expect("create");
        w.write_file(top.root, ino, 0, &[i as u8; 5000]).expect("write");
        inos.push(ino);
        if i % 4000 == 3999 {
            w.commit().expect("commit");
        }
    }
    w.commit().expect("commit");
    let change = |w: &mut FsWriter, ino: u64, byte: u8| {
        w.write_file(top.root, ino, 0, &[byte; 5000]).expect("overwrite");
        w.commit().expect("commit");
        w.qgroup_stats().unwrap()
    };
    w.hooks.qgroup_full_recount = true;
    let full = change(&mut w, inos[inos.len() / 16], 1);
    assert!(full.recount.is_some(), "the hook recounts");
    w.hooks.qgroup_full_recount = false;
    w.set_qgroup_verify(true);
    let incr = change(&mut w, inos[inos.len() * 3 / 4], 2);
    assert_eq!(incr.recount, None, "a one-file change is accounted incrementally");
    let levels = u64::from(w.live().read_root(FS_TREE_OBJECTID).expect("fs tree").0.level) + 1;
    let extent_levels =
        u64::from(w.live().read_root(EXTENT_TREE_OBJECTID).expect("extent tree").0.level) + 1;
    eprintln!(
        "blocks read by the qgroup accounting of a one-file commit: full recount {} (dirty extents {}), incremental {} (dirty extents {}); fs tree {levels} levels, extent tree {extent_levels}",
        full.blocks_read, full.dirty_extents, incr.blocks_read, incr.dirty_extents
    );
    assert!(full.blocks_read > 2000, "the recount walks every block: {full:?}");
    assert!(
        incr.dirty_extents > 0 && incr.dirty_extents < 20,
        "a one-file change dirties a few extents: {incr:?}"
    );
    // Per dirty extent and state: its extent item (a search of the extent tree), a
    // search of its subvolume tree, then the same for each block above it.
    let bound = incr.dirty_extents * 2 * levels * (levels + extent_levels) + 4;
    assert!(
        incr.blocks_read <= bound,
        "incremental accounting read {} blocks, more than {bound}: {incr:?}",
        incr.blocks_read
    );
    assert!(incr.blocks_read * 10 < full.blocks_read, "incremental {incr:?} vs recount {full:?}");
    drop(w);
    ubtrfs_check(&img, "bounded");
}

/// The `snapshots` fixture (kernel-made): `sv`, its snapshot `snap` and `snap2` of
/// `snap` share tree blocks (FULL_BACKREF and keyed backrefs) and data extents, under
/// qgroup 1/100. Changes in each of the three COW shared blocks and split extents; every
/// commit is accounted incrementally and equals the full recount.
#[test]
fn shared_snapshots_are_accounted_incrementally() {
    let img = Scratch::fixture("snapshots", "qgroup-snapshots");
    let mut w = img.writer();
    w.set_qgroup_verify(true);
    let subvols = ["sv", "snap", "snap2"];
    let ids: Vec<u64> = subvols
        .iter()
        .map(|p| w.live().resolve_id(p, false).unwrap_or_else(|e| panic!("{p}: {e}")).root)
        .collect();
    let mut rng = Rng::new(7);
    let mut names = 0;
    for round in 0..10 {
        for _ in 0..6 {
            let k = rng.below(3) as usize;
            let (sub, root) = (subvols[k], ids[k]);
            match rng.below(4) {
                0 | 1 => {
                    let id = w
                        .live()
                        .resolve_id(&format!("{sub}/big-{}", rng.below(12)), false)
                        .expect("big file");
                    let (off, len) = (rng.below(120_000), rng.range(1, 60_000) as usize);
                    if rng.chance(50) {
                        w.write_file(root, id.ino, off, &rng.bytes(len)).expect("overwrite");
                    } else {
                        w.setattr(
                            InodeId { root, ino: id.ino },
                            &SetAttr { size: Some(off), ..Default::default() },
                        )
                        .expect("truncate");
                    }
                }
                2 => match w.unlink(
                    root,
                    FIRST_FREE_OBJECTID,
                    format!("file-{:04}", rng.below(2500)).as_bytes(),
                ) {
                    Err(e) if e.posix_kind() == Some(ubtrfs_core::PosixKind::NotFound) => {}
                    r => r.expect("unlink"),
                },
                _ => {
                    names += 1;
                    let ino = w
                        .create_file(
                            root,
                            FIRST_FREE_OBJECTID,
                            format!("new-{names}").as_bytes(),
                            &InodeAttrs::new(0o644),
                        )
                        .expect("create");
                    let len = rng.range(1, 50_000) as usize;
                    w.write_file(root, ino, 0, &rng.bytes(len)).expect("write");
                }
            }
        }
        w.commit().unwrap_or_else(|e| panic!("round {round}: commit: {e}"));
        let st = w.qgroup_stats().expect("quotas are on");
        assert_eq!(st.recount, None, "round {round}: shared blocks are accounted incrementally");
        let s = qgroup_counts(&mut w);
        let level1 = 1 << 48 | 100;
        assert!(
            s[&level1].0 >= s[&ids[0]].0,
            "round {round}: 1/100 references at least what sv does: {s:?}"
        );
    }
    drop(w);
    ubtrfs_check(&img, "snapshots");
    progs_check(&img, "snapshots");
}

/// More changed extents than are recorded: the records are dropped and the commit
/// recounts; with the limit back, the next commit is incremental again.
#[test]
fn too_many_changed_extents_recount() {
    let img = Scratch::mkfs("qgroup-overflow-records", 256 * MIB, &["-R", "quota", "-n", "4096"]);
    let mut w = img.writer();
    w.set_qgroup_verify(true);
    let top = w.live().root_dir();
    w.set_qgroup_record_limit(4);
    for i in 0..20u8 {
        let ino = w
            .create_file(top.root, top.ino, format!("f{i}").as_bytes(), &InodeAttrs::new(0o644))
            .expect("create");
        w.write_file(top.root, ino, 0, &[i; 8192]).expect("write");
    }
    w.commit().expect("commit");
    let st = w.qgroup_stats().expect("quotas are on");
    assert!(st.recount.as_deref().is_some_and(|r| r.contains("more extents changed")), "{st:?}");
    let after_recount = qgroup_counts(&mut w)[&FS_TREE_OBJECTID];
    assert!(after_recount.0 >= 20 * 8192, "the recount counts the new files: {after_recount:?}");
    w.set_qgroup_record_limit(ubtrfs_core::extent::delayed_ref::MAX_QGROUP_RECORDS);
    w.create_file(top.root, top.ino, b"one-more", &InodeAttrs::new(0o644)).expect("create");
    w.commit().expect("commit");
    assert_eq!(w.qgroup_stats().unwrap().recount, None, "back to incremental");
    drop(w);
    ubtrfs_check(&img, "after the record overflow");
}
