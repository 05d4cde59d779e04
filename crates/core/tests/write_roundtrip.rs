//! Round trips through the oracle: images made by `mkfs.btrfs` (as root) or copies of
//! the kernel-made fixtures are written by `FsWriter`, committed, and then must pass
//! `btrfs check --readonly --check-data-csum`, show exactly the expected tree through
//! a kernel mount and through ubtrfs's reader, survive the kernel writing to them
//! (create, delete, append, link; `btrfs check` again; ubtrfs reads the kernel's
//! changes), and take a second round of ubtrfs writes on top of the kernel's.
//! After every ubtrfs commit `check_invariants` runs on the fs, extent, csum,
//! free-space, root, dev and chunk trees.
//!
//! Coverage: every checksum type and nodesize 4K/16K/64K; images without no-holes;
//! the kernel-made fixtures (default with its snapshots, compressed files, reflinks,
//! prealloc, sparse files, extrefs, a 3100-entry directory); new data and metadata
//! chunks; unlink with space freed and reused; extent splits with two references;
//! inline files growing regular; thousands of entries in one directory and deleting
//! most of them again; name hash collisions; snapshot-shared and relocated trees.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::collections::HashMap;
use ubtrfs_core::inode::filesystem::{ExtentKind, Filesystem, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FileRead;
use ubtrfs_core::FsRead;
use ubtrfs_core::FsWriter;
use ubtrfs_core::{Error, OpenOptions, PosixKind};
use ubtrfs_format::items;
use ubtrfs_format::key::*;
use ubtrfs_format::Key;
use write_common::*;

/// One ubtrfs round: open, change, commit, check tree invariants, close, then compare
/// ubtrfs's reader (and as root `btrfs check` and a kernel mount) with the model.
fn ubtrfs_round(
    img: &Scratch,
    m: &mut Model,
    kernel: bool,
    trees: &[u64],
    what: &str,
    f: impl FnOnce(&mut Model, &mut FsWriter),
) {
    let mut w = img.writer();
    f(m, &mut w);
    w.commit().unwrap_or_else(|e| panic!("{what}: commit: {e}"));
    check_trees(&mut w, trees, what);
    drop(w);
    verify_all(&img.path, m, kernel, what);
}

/// One kernel round: mount read-write, change, unmount, `btrfs check`, then both walks.
fn kernel_round(img: &Scratch, m: &mut Model, what: &str, f: impl FnOnce(&mut Model, &Mount)) {
    let mnt = Mount::new(&img.path, true);
    f(m, &mnt);
    mnt.umount();
    assert_check(&img.path, what);
    m.resolve_ids(&img.path);
    verify_kernel(&img.path, m, what);
    verify_ubtrfs(&img.path, m, what);
}

/// The image for a test: fresh mkfs as root, else a fixture copy, else None (skip).
fn image(tag: &str, size: u64, args: &[&str], fixture: Option<&str>) -> Option<(Scratch, bool)> {
    if common::kernel_available(tag) {
        return Some((Scratch::mkfs(tag, size, args), true));
    }
    match fixture {
        Some(f) => Some((Scratch::fixture(f, tag), false)),
        None => {
            eprintln!("{tag}: skipped: needs mkfs.btrfs as root and no fixture matches {args:?}");
            None
        }
    }
}

fn path(base: &str, rel: &str) -> String {
    if base.is_empty() {
        rel.to_string()
    } else {
        format!("{base}/{rel}")
    }
}

/// The standard workload, under directory `base` of tree 5: every size around the
/// inline limit, hard links (enough with long names to overflow into INODE_EXTREF),
/// then overwrites, appends, unlinks and rmdir; then the kernel's changes; then ours
/// on top of the kernel's.
fn standard_scenario(img: &Scratch, kernel: bool, base: &str, seed: u64) {
    let mut m = Model::load(&img.path);
    let mut rng = Rng::new(seed);
    let p = |r: &str| path(base, r);
    let nodesize = img.reader().info.nodesize as usize;
    let extref_links = nodesize / 4 / 190 + 8;
    ubtrfs_round(img, &mut m, kernel, &[5], "standard: first commit", |m, w| {
        if !base.is_empty() {
            m.w_mkdir(w, base, 0o755);
        }
        for d in ["sub", "sub/deeper", "empty", "x"] {
            m.w_mkdir(w, &p(d), 0o750);
        }
        for size in [0u64, 1, 100, 2047, 2048, 2049, 4095, 4096, 4097, 300 * KIB, MIB + 3] {
            m.w_create(w, &p(&format!("f{size}")), 0o644, &rng.bytes(size as usize));
        }
        m.w_create(w, &p("big"), 0o600, &rng.bytes(2 * MIB as usize));
        m.w_create(w, &p("sub/deeper/inline"), 0o644, b"tiny inline file\n");
        m.w_link(w, &p("f100"), &p("sub/hl2"));
        m.w_link(w, &p("f100"), &p("sub/deeper/hl3"));
        m.w_create(w, &p("x/base"), 0o644, b"many names\n");
        for i in 0..extref_links {
            m.w_link(w, &p("x/base"), &p(&format!("x/{}-{i:03}", "n".repeat(176))));
        }
    });
    ubtrfs_round(img, &mut m, kernel, &[5], "standard: second commit", |m, w| {
        // Middle of a big extent: two references to one extent.
        m.w_write(w, &p("big"), 700_000, &rng.bytes(10_000));
        // Head and tail trims, and a write that straddles extents.
        m.w_write(w, &p(&format!("f{}", MIB + 3)), 0, &rng.bytes(5000));
        m.w_write(w, &p(&format!("f{}", MIB + 3)), MIB - 4096, &rng.bytes(4099));
        m.w_write(w, &p("big"), 650_000, &rng.bytes(100_000));
        // Inline grows to regular; empty grows to inline; past EOF leaves a hole.
        m.w_write(w, &p("f2047"), 2047, &rng.bytes(3000));
        m.w_write(w, &p("f0"), 0, &rng.bytes(100));
        m.w_write(w, &p("f4097"), 70_000, &rng.bytes(5000));
        m.w_write(w, &p("f1"), 1, b"a");
        m.w_unlink(w, &p("f4096"));
        m.w_unlink(w, &p("sub/hl2"));
        m.w_unlink(w, &p("empty"));
        m.w_unlink(w, &p(&format!("x/{}-{:03}", "n".repeat(176), extref_links - 1)));
        m.w_unlink(w, &p(&format!("x/{}-{:03}", "n".repeat(176), 0)));
        m.w_create(w, &p("sub/after"), 0o644, &rng.bytes(50_000));
    });
    if kernel {
        kernel_round(img, &mut m, "standard: kernel changes", |m, k| {
            m.k_mkdir(k, &p("k"));
            m.k_create(k, &p("k/small"), b"kernel small\n");
            m.k_create(k, &p("k/mid"), &rng.bytes(20_000));
            m.k_create(k, &p("k/big"), &rng.bytes(700_000));
            m.k_link(k, &p(&format!("f{}", 300 * KIB)), &p("k/link300k"));
            m.k_write(k, &p("big"), 500_000, &rng.bytes(10_000));
            m.k_write(k, &p("f2049"), 2049, &rng.bytes(10_000));
            m.k_unlink(k, &p("f4095"));
            m.k_unlink(k, &p("sub/deeper/hl3"));
            m.k_unlink(k, &p(&format!("x/{}-{:03}", "n".repeat(176), 3)));
        });
        ubtrfs_round(img, &mut m, kernel, &[5], "standard: ubtrfs on top of the kernel", |m, w| {
            m.w_write(w, &p("k/big"), 300_000, &rng.bytes(20_000));
            m.w_write(w, &p("k/mid"), 20_000, &rng.bytes(3000));
            m.w_unlink(w, &p("k/small"));
            m.w_unlink(w, &p(&format!("f{}", 300 * KIB)));
            m.w_unlink(w, &p("k/link300k"));
            m.w_write(w, &p("big"), 495_000, &rng.bytes(20_000));
            m.w_create(w, &p("k/ours"), 0o644, &rng.bytes(123_457));
            m.w_link(w, &p("k/mid"), &p("k/mid-link"));
            m.w_unlink(w, &p(&format!("x/{}-{:03}", "n".repeat(176), 4)));
        });
    }
}

macro_rules! matrix {
    ($($name:ident: $csum:literal, $nodesize:literal, $fixture:expr;)*) => {$(
        #[test]
        fn $name() {
            let tag = stringify!($name);
            let Some((img, kernel)) = image(tag, 512 * MIB, &["--csum", $csum, "-n", $nodesize], $fixture) else { return };
            standard_scenario(&img, kernel, if kernel { "" } else { "u" }, 7);
        }
    )*};
}

matrix! {
    matrix_crc32c_4k: "crc32c", "4096", None;
    matrix_crc32c_16k: "crc32c", "16384", Some("default");
    matrix_crc32c_64k: "crc32c", "65536", None;
    matrix_xxhash_4k: "xxhash", "4096", Some("nodesize4k-xxhash");
    matrix_xxhash_16k: "xxhash", "16384", None;
    matrix_xxhash_64k: "xxhash", "65536", None;
    matrix_sha256_4k: "sha256", "4096", None;
    matrix_sha256_16k: "sha256", "16384", None;
    matrix_sha256_64k: "sha256", "65536", Some("sha256-64k");
    matrix_blake2_4k: "blake2", "4096", None;
    matrix_blake2_16k: "blake2", "16384", Some("blake2");
    matrix_blake2_64k: "blake2", "65536", None;
}

/// Without no-holes every gap is an explicit hole extent that `btrfs check` verifies.
#[test]
fn without_no_holes() {
    let Some((img, kernel)) = image("without_no_holes", 256 * MIB, &["-O", "^no-holes"], None)
    else {
        return;
    };
    standard_scenario(&img, kernel, "", 11);
}

/// Fixtures the kernel made (compressed files, DUP data), written under a new directory
/// of tree 5.
#[test]
fn fixtures_take_the_standard_workload() {
    let kernel = common::kernel_available("fixtures_take_the_standard_workload");
    for (i, f) in
        ["blake2", "nodesize4k-xxhash", "sha256-64k", "zstd", "lzo", "dup-data"].iter().enumerate()
    {
        let img = Scratch::fixture(f, &format!("fixture-std-{f}"));
        standard_scenario(&img, kernel, "ubtrfs", 100 + i as u64);
    }
}

/// Compressed files made by the kernel (zlib, lzo, zstd; regular and inline extents,
/// partial overwrites, clones): overwrites split and trim compressed extents, inline
/// compressed files are rewritten uncompressed, clones drop their references.
#[test]
fn compressed_fixtures() {
    let kernel = common::kernel_available("compressed_fixtures");
    for (i, f) in ["zlib", "lzo", "zstd"].iter().enumerate() {
        let img = Scratch::fixture(f, &format!("compressed-{f}"));
        let mut m = Model::load(&img.path);
        let mut rng = Rng::new(90 + i as u64);
        ubtrfs_round(
            &img,
            &mut m,
            kernel,
            &[5],
            &format!("{f}: compressed files changed"),
            |m, w| {
                m.w_write(w, "c/text-1.5m", 700_001, &rng.bytes(5000));
                m.w_write(w, "c/text-1.5m", 0, &rng.bytes(100));
                m.w_write(w, "c/inline-3000", 0, b"x");
                m.w_write(w, "c/inline-1000", 1000, &rng.bytes(500));
                m.w_write(w, "c/small-uncompressible", 10, &rng.bytes(10));
                m.w_unlink(w, "c/text-300k-clone");
                m.w_write(w, "c/partial-clone", 100_000, &rng.bytes(30_000));
                m.w_write(w, "c/sparse", 3 * MIB + 5, &rng.bytes(70_000));
                m.w_write(w, "c/overwritten", MIB - 10, &rng.bytes(20));
                m.w_unlink(w, "c/repetitive-5m");
            },
        );
        if kernel {
            kernel_round(&img, &mut m, &format!("{f}: kernel changes"), |m, k| {
                m.k_write(k, "c/text-1.5m", 702_000, &rng.bytes(3000));
                m.k_unlink(k, "c/mixed");
            });
            ubtrfs_round(
                &img,
                &mut m,
                kernel,
                &[5],
                &format!("{f}: ubtrfs after the kernel"),
                |m, w| {
                    m.w_write(w, "c/text-1.5m", 701_000, &rng.bytes(3000));
                    m.w_unlink(w, "c/text-300k");
                },
            );
        }
    }
}

fn fs_tree_level(img: &Scratch, tree: u64) -> u8 {
    img.reader().fs_root(tree).unwrap_or_else(|e| panic!("tree {tree}: {e}")).level
}

/// The default fixture: tree 5 holds a 3100-entry directory, extrefs, reflinks,
/// prealloc and sparse files and the snapshot `snap` of `subvol`. Changing tree 5
/// (which no snapshot shares) must work, on kernel-made layouts too.
#[test]
fn default_fixture_outside_snapshots() {
    let kernel = common::kernel_available("default_fixture_outside_snapshots");
    let img = Scratch::fixture("default", "default-fixture");
    let mut m = Model::load(&img.path);
    let mut rng = Rng::new(21);
    ubtrfs_round(&img, &mut m, kernel, &[5], "default: kernel-made files changed", |m, w| {
        m.w_write(w, "files/random-3m", MIB + 12_345, &rng.bytes(70_000));
        m.w_write(w, "files/text-200k", 0, &rng.bytes(10));
        m.w_unlink(w, "files/size-4097");
        m.w_write(w, "files/size-2048", 2048, &rng.bytes(1));
        // Shared extents: the clones and the source change independently.
        m.w_write(w, "reflink/src", 100_000, &rng.bytes(8192));
        m.w_unlink(w, "reflink/full-clone");
        m.w_write(w, "reflink/partial", 0, &rng.bytes(4096));
        m.w_write(w, "reflink/from-subvol", 60_000, &rng.bytes(100));
        // Prealloc and holes.
        m.w_write(w, "prealloc/falloc-1m", 300_000, &rng.bytes(9000));
        m.w_write(w, "prealloc/falloc-keep-size", 0, &rng.bytes(100));
        m.w_write(w, "sparse/holes-20m", 10 * MIB - 100, &rng.bytes(300));
        m.w_write(w, "sparse/only-hole", MIB, &rng.bytes(4096));
        m.w_unlink(w, "sparse/punched");
        // Names: extrefs and links made by the kernel, symlinks, specials, xattrs.
        m.w_link(w, "hardlinks/a/three", "hardlinks/b/four");
        let extref = m
            .paths()
            .into_iter()
            .map(|(p, _)| p)
            .find(|p| p.starts_with("hardlinks/extref/nnn") && p.ends_with("-005"))
            .expect("extref name");
        m.w_unlink(w, &extref);
        m.w_unlink(w, "hardlinks/c/pair-1");
        m.w_unlink(w, "symlinks/long-1000");
        m.w_unlink(w, "special/fifo");
        m.w_unlink(w, "special/big-dev");
        m.w_unlink(w, "xattrs/many");
        m.w_unlink(w, "xattrs/dir");
        m.w_unlink(w, "names/dîr ✓/inner");
        m.w_unlink(w, "names/dîr ✓");
        m.w_create(w, "names/new ✓", 0o600, &rng.bytes(3000));
    });
    ubtrfs_round(&img, &mut m, kernel, &[5], "default: bigdir shrinks and grows", |m, w| {
        let names: Vec<String> =
            m.paths().into_iter().map(|(p, _)| p).filter(|p| p.starts_with("bigdir/")).collect();
        for (i, p) in names.iter().enumerate() {
            if i % 7 != 0 {
                m.w_unlink(w, p);
            }
        }
        for i in 0..200 {
            m.w_create(w, &format!("bigdir/new-{i:04}"), 0o644, &rng.bytes(i * 37 % 5000));
        }
    });
    if kernel {
        kernel_round(&img, &mut m, "default: kernel changes", |m, k| {
            m.k_create(k, "files/kernel-new", &rng.bytes(123_456));
            m.k_unlink(k, "bigdir/new-0007");
            m.k_write(k, "reflink/src", 0, &rng.bytes(5000));
            m.k_unlink(k, "names/new ✓");
        });
        ubtrfs_round(&img, &mut m, kernel, &[5], "default: ubtrfs on top of the kernel", |m, w| {
            m.w_write(w, "files/kernel-new", 4096, &rng.bytes(4096));
            m.w_unlink(w, "bigdir/new-0008");
            m.w_unlink(w, "reflink/src");
        });
    }
}

/// Trees whose root is a leaf are never shared with a snapshot (the snapshot copied
/// the root), so writing into `subvol`, its snapshot `snap` and the nested `inner`
/// of the default fixture works and must pass the oracle.
#[test]
fn default_fixture_snapshot_leaf_trees() {
    let kernel = common::kernel_available("default_fixture_snapshot_leaf_trees");
    let img = Scratch::fixture("default", "default-snap-leaves");
    let mut m = Model::load(&img.path);
    for p in ["subvol", "snap", "subvol/inner"] {
        let id = m.id(p);
        assert_eq!(
            fs_tree_level(&img, id.root),
            0,
            "{p}: the fixture's tree is expected to be a single leaf"
        );
    }
    let trees = [m.id("subvol").root, m.id("snap").root, m.id("subvol/inner").root];
    let mut rng = Rng::new(22);
    ubtrfs_round(
        &img,
        &mut m,
        kernel,
        &trees,
        "default: writes into leaf-rooted subvolume trees",
        |m, w| {
            m.w_create(w, "subvol/new", 0o644, &rng.bytes(40_000));
            m.w_write(w, "subvol/file2", 10, &rng.bytes(10));
            m.w_write(w, "snap/file2", 70_000, &rng.bytes(5000));
            m.w_unlink(w, "snap/added-after");
            m.w_create(w, "subvol/inner/x", 0o644, b"x");
        },
    );
}

fn btrfs_cmd(args: &[&str], dir: &std::path::Path) {
    let o = std::process::Command::new("btrfs").args(args).arg(dir).output().expect("run btrfs");
    assert!(
        o.status.success(),
        "btrfs {args:?} {}: {}",
        dir.display(),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `btrfs subvolume snapshot` of `src` as `dst` on a kernel mount.
fn kernel_snapshot(mnt: &Mount, src: &str, dst: &str) {
    let o = std::process::Command::new("btrfs")
        .args(["subvolume", "snapshot"])
        .arg(mnt.path(src))
        .arg(mnt.path(dst))
        .output()
        .expect("btrfs");
    assert!(o.status.success(), "snapshot {src} {dst}: {}", String::from_utf8_lossy(&o.stderr));
}

/// Random changes spread over several trees that share blocks: overwrites (splitting
/// shared data extents), appends, creates, unlinks and mkdirs, all in one transaction.
fn random_shared_changes(
    m: &mut Model,
    w: &mut FsWriter,
    rng: &mut Rng,
    dirs: &[&str],
    n: usize,
    tag: &str,
) {
    for i in 0..n {
        let dir = *rng.pick(dirs);
        let prefix = if dir.is_empty() { String::new() } else { format!("{dir}/") };
        let files: Vec<String> = m
            .paths()
            .into_iter()
            .filter(|(p, h)| p.starts_with(&prefix) && m.node(*h).kind == 'f')
            .map(|(p, _)| p)
            .collect();
        match rng.below(10) {
            0..=3 if !files.is_empty() => {
                let f = rng.pick(&files).clone();
                let len = m.data(&f).len() as u64;
                let off = rng.below(len + 1);
                let n = rng.range(1, 9000) as usize;
                let data = rng.bytes(n);
                m.w_write(w, &f, off, &data);
            }
            4..=5 if !files.is_empty() => {
                let f = rng.pick(&files).clone();
                m.w_unlink(w, &f);
            }
            6 => {
                m.w_mkdir(w, &path(dir, &format!("{tag}-d{i}")), 0o755);
            }
            _ => {
                let size = *rng.pick(&[0usize, 100, 2000, 5000, 70_000]);
                let data = rng.bytes(size);
                m.w_create(w, &path(dir, &format!("{tag}-{i}")), 0o644, &data);
            }
        }
    }
}

/// (tree blocks with FULL_BACKREF, shared block backrefs, shared data backrefs) in the
/// extent tree, inline or keyed.
fn shared_backrefs(img: &Scratch) -> (usize, usize, usize) {
    let mut w = img.writer();
    let all = w.items_in_range(EXTENT_TREE_OBJECTID, &Key::MIN, &Key::MAX).expect("extent tree");
    let (mut full, mut sblock, mut sdata) = (0, 0, 0);
    for (k, d) in all {
        match k.type_ {
            METADATA_ITEM_KEY | EXTENT_ITEM_KEY => {
                let v = items::extent_item(&d, k.type_ == METADATA_ITEM_KEY).expect("extent item");
                full += usize::from(v.flags & ubtrfs_format::structs::BLOCK_FLAG_FULL_BACKREF != 0);
                for r in v.inline_refs {
                    match r {
                        items::InlineRef::SharedBlock { .. } => sblock += 1,
                        items::InlineRef::SharedData { .. } => sdata += 1,
                        _ => {}
                    }
                }
            }
            SHARED_BLOCK_REF_KEY => sblock += 1,
            SHARED_DATA_REF_KEY => sdata += 1,
            _ => {}
        }
    }
    (full, sblock, sdata)
}

/// A kernel-made 4K-node image: subvolume `sv` with `files` small files and 12 of
/// 200 KB, its snapshot `snap` and `snap2` of `snap`; with `quota`, quotas on and a
/// level-1 qgroup 1/100 over the three.
fn snapshot_image(tag: &str, files: usize, quota: bool) -> Scratch {
    let img = Scratch::mkfs(tag, 256 * MIB, &["-n", "4096"]);
    let mnt = Mount::new(&img.path, true);
    if quota {
        btrfs_cmd(&["quota", "enable"], &mnt.dir);
    }
    btrfs_cmd(&["subvolume", "create"], &mnt.path("sv"));
    for i in 0..files {
        std::fs::write(
            mnt.path(&format!("sv/file-{i:04}")),
            format!("content {i}\n").repeat(i % 7 + 1),
        )
        .expect("write");
    }
    let mut rng = Rng::new(5);
    for i in 0..12 {
        std::fs::write(mnt.path(&format!("sv/big-{i}")), rng.bytes(200_000)).expect("write");
    }
    kernel_snapshot(&mnt, "sv", "snap");
    kernel_snapshot(&mnt, "snap", "snap2");
    if quota {
        btrfs_cmd(&["qgroup", "create", "1/100"], &mnt.dir);
        for q in ["0/256", "0/257", "0/258"] {
            let _ = std::process::Command::new("btrfs")
                .args(["qgroup", "assign", "--no-rescan", q, "1/100"])
                .arg(&mnt.dir)
                .output()
                .expect("btrfs");
        }
        btrfs_cmd(&["quota", "rescan", "-w"], &mnt.dir);
    }
    mnt.umount();
    assert_check(&img.path, &format!("{tag}: kernel-made snapshot image"));
    img
}

/// Soak (does nothing unless UBTRFS_SNAPSHOT_SOAK=N): N seeds, each on a fresh
/// snapshot image (quotas on for odd seeds), UBTRFS_SNAPSHOT_ROUNDS (default 12)
/// rounds of random changes over `sv`, `snap` and `snap2`, each verified by `btrfs
/// check`, `ubtrfs check`, a kernel mount and the reader; every fourth round the kernel
/// writes too; at the end the kernel deletes `snap` and the image must stay clean.
#[test]
fn snapshot_soak() {
    let Some(seeds) =
        std::env::var("UBTRFS_SNAPSHOT_SOAK").ok().and_then(|v| v.parse::<u64>().ok())
    else {
        return;
    };
    if !common::kernel_available("snapshot_soak") {
        return;
    }
    let rounds: usize =
        std::env::var("UBTRFS_SNAPSHOT_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(12);
    for seed in 0..seeds {
        let quota = seed % 2 == 1;
        let img = snapshot_image(&format!("snapshot-soak-{seed}"), 1500, quota);
        let mut m = Model::load(&img.path);
        let trees = [5, m.id("sv").root, m.id("snap").root, m.id("snap2").root];
        let mut rng = Rng::new(1000 + seed);
        for round in 0..rounds {
            let what = format!("soak seed {seed} (quota {quota}) round {round}");
            ubtrfs_round(&img, &mut m, true, &trees, &what, |m, w| {
                let n = rng.range(50, 400) as usize;
                random_shared_changes(
                    m,
                    w,
                    &mut rng,
                    &["sv", "snap", "snap2", ""],
                    n,
                    &format!("s{seed}r{round}"),
                );
            });
            if round % 4 == 3 {
                kernel_round(&img, &mut m, &format!("{what}: kernel"), |m, k| {
                    let files: Vec<String> = m
                        .paths()
                        .into_iter()
                        .filter(|(_, h)| m.node(*h).kind == 'f')
                        .map(|(p, _)| p)
                        .collect();
                    for _ in 0..30 {
                        let f = rng.pick(&files).clone();
                        let len = m.data(&f).len() as u64;
                        let off = rng.below(len + 1);
                        m.k_write(k, &f, off, b"kernel was here");
                    }
                });
            }
        }
        {
            let mnt = Mount::new(&img.path, true);
            btrfs_cmd(&["subvolume", "delete"], &mnt.path("snap"));
            btrfs_cmd(&["subvolume", "sync"], &mnt.dir);
            mnt.umount();
        }
        m.record_unlink("snap");
        verify_all(
            &img.path,
            &m,
            true,
            &format!("soak seed {seed}: after the kernel dropped snap"),
        );
        eprintln!("snapshot_soak: seed {seed} (quota {quota}): {rounds} rounds clean");
    }
}

/// A kernel-made subvolume deep enough to have interior nodes, a snapshot of it and a
/// snapshot of the snapshot: every tree shares blocks and data extents with the others.
/// ubtrfs changes all three (COW of shared blocks turns them FULL_BACKREF or hands
/// their references over, as the kernel does); the oracle checks every round, the
/// kernel writes on top, and finally the kernel deletes a snapshot: its cleaner drops
/// the tree by walking the references ubtrfs wrote, and `btrfs check` must stay clean.
#[test]
fn snapshot_shared_trees_are_written() {
    if !common::kernel_available("snapshot_shared_trees_are_written") {
        return;
    }
    let img = snapshot_image("snapshot-shared", 3000, false);
    let mut m = Model::load(&img.path);
    let (sv, snap, snap2) = (m.id("sv").root, m.id("snap").root, m.id("snap2").root);
    assert!(
        fs_tree_level(&img, sv) >= 2,
        "the subvolume needs two levels of interior nodes for this test"
    );
    let trees = [5, sv, snap, snap2];
    let mut rng = Rng::new(23);
    // Each tree changes a different part of the shared tree, so blocks stay shared
    // (FULL_BACKREF, parent-named refs) after this round.
    ubtrfs_round(&img, &mut m, true, &trees, "snapshots: first writes to shared trees", |m, w| {
        m.w_write(w, "sv/file-0123", 0, b"changed");
        m.w_unlink(w, "sv/file-0124");
        m.w_write(w, "sv/big-5", 4096, &rng.bytes(100));
        m.w_write(w, "snap/file-2900", 3, b"changed");
        m.w_write(w, "snap/big-3", 100_000, &rng.bytes(8192));
        m.w_write(w, "snap2/file-1500", 0, &rng.bytes(70_000));
    });
    let (full, sblock, sdata) = shared_backrefs(&img);
    eprintln!("after the first writes: {full} FULL_BACKREF blocks, {sblock} shared block refs, {sdata} shared data refs");
    assert!(
        full > 0 && sblock > 0 && sdata > 0,
        "COW of shared blocks should have left FULL_BACKREF blocks with shared refs"
    );
    for round in 0..3 {
        ubtrfs_round(
            &img,
            &mut m,
            true,
            &trees,
            &format!("snapshots: random round {round}"),
            |m, w| {
                random_shared_changes(
                    m,
                    w,
                    &mut rng,
                    &["sv", "snap", "snap2"],
                    400,
                    &format!("r{round}"),
                );
            },
        );
    }
    kernel_round(&img, &mut m, "snapshots: the kernel writes on top", |m, k| {
        for i in (1..3000).step_by(41) {
            for d in ["sv", "snap", "snap2"] {
                let p = format!("{d}/file-{i:04}");
                if m.lookup(&p).is_some() {
                    m.k_write(k, &p, 1, b"kernel");
                }
            }
        }
        m.k_create(k, "snap/by-kernel", b"kernel file\n");
    });
    ubtrfs_round(&img, &mut m, true, &trees, "snapshots: ubtrfs after the kernel", |m, w| {
        random_shared_changes(m, w, &mut rng, &["sv", "snap", "snap2"], 300, "after");
    });
    // The kernel drops a snapshot: its cleaner walks every reference of the tree.
    {
        let mnt = Mount::new(&img.path, true);
        btrfs_cmd(&["subvolume", "delete"], &mnt.path("snap"));
        btrfs_cmd(&["subvolume", "sync"], &mnt.dir);
        mnt.umount();
    }
    m.record_unlink("snap");
    assert_check(&img.path, "snapshots: after the kernel deleted one");
    verify_all(&img.path, &m, true, "snapshots: after the kernel deleted one");
    ubtrfs_round(
        &img,
        &mut m,
        true,
        &[5, sv, snap2],
        "snapshots: writes after the drop",
        |m, w| {
            random_shared_changes(m, w, &mut rng, &["sv", "snap2"], 300, "last");
        },
    );
}

/// The `snapshots` fixture (kernel-made, quotas on): `sv` with two levels of interior
/// nodes, `snap` of it and `snap2` of `snap`, all sharing. Runs without root too, so
/// the COW of shared blocks and the quota recount are checked by `ubtrfs check` and
/// the reader everywhere, and as root by `btrfs check` and the kernel as well.
#[test]
fn snapshot_fixture_writes() {
    let kernel = common::kernel_available("snapshot_fixture_writes");
    let img = Scratch::fixture("snapshots", "snapshot-fixture");
    let mut m = Model::load(&img.path);
    let trees = [5, m.id("sv").root, m.id("snap").root, m.id("snap2").root];
    assert!(
        fs_tree_level(&img, trees[1]) >= 2,
        "the fixture's sv needs two levels of interior nodes"
    );
    let mut rng = Rng::new(51);
    ubtrfs_round(
        &img,
        &mut m,
        kernel,
        &trees,
        "snapshot fixture: separate corners of the shared trees",
        |m, w| {
            m.w_write(w, "sv/file-0100", 0, b"changed in sv");
            m.w_write(w, "sv/big-5", 4096, &rng.bytes(100));
            m.w_write(w, "snap/file-2400", 5, b"changed in snap");
            m.w_write(w, "snap/big-3", 50_000, &rng.bytes(8192));
            m.w_unlink(w, "snap2/file-1200");
        },
    );
    let (full, sblock, sdata) = shared_backrefs(&img);
    assert!(
        full > 0 && sblock > 0 && sdata > 0,
        "expected FULL_BACKREF blocks with shared refs: {full} {sblock} {sdata}"
    );
    for round in 0..3 {
        ubtrfs_round(
            &img,
            &mut m,
            kernel,
            &trees,
            &format!("snapshot fixture: random round {round}"),
            |m, w| {
                random_shared_changes(
                    m,
                    w,
                    &mut rng,
                    &["sv", "snap", "snap2", ""],
                    250,
                    &format!("f{round}"),
                );
            },
        );
    }
    if kernel {
        kernel_rescan_agrees(&img);
    }
}

/// `btrfs qgroup show --raw` as (qgroupid, referenced, exclusive) rows.
fn kernel_qgroups(dir: &std::path::Path) -> Vec<(String, u64, u64)> {
    let o = std::process::Command::new("btrfs")
        .args(["qgroup", "show", "--raw"])
        .arg(dir)
        .output()
        .expect("btrfs qgroup show");
    assert!(o.status.success(), "qgroup show: {}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    let rows: Vec<(String, u64, u64)> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            match f.as_slice() {
                [id, r, e, ..] if id.contains('/') => {
                    Some((id.to_string(), r.parse().ok()?, e.parse().ok()?))
                }
                _ => None,
            }
        })
        .collect();
    assert!(!rows.is_empty(), "no qgroups in: {text}");
    rows
}

/// Mount `img`, read the qgroup numbers ubtrfs stored, let the kernel rescan, and
/// require the very same numbers; returns them.
fn kernel_rescan_agrees(img: &Scratch) -> Vec<(String, u64, u64)> {
    let mnt = Mount::new(&img.path, true);
    let ours = kernel_qgroups(&mnt.dir);
    btrfs_cmd(&["quota", "rescan", "-w"], &mnt.dir);
    let rescanned = kernel_qgroups(&mnt.dir);
    mnt.umount();
    assert_eq!(ours, rescanned, "the kernel's rescan disagrees with the numbers ubtrfs stored");
    ours
}

/// Quotas on, with a subvolume, its snapshot and a level-1 qgroup over both: every
/// ubtrfs commit leaves the qgroup numbers exact. `btrfs check` verifies them after
/// each round (it fails on any difference), the kernel mounts without marking them
/// inconsistent, and a kernel rescan finds the very numbers ubtrfs stored.
#[test]
fn quota_groups_stay_exact() {
    if !common::kernel_available("quota_groups_stay_exact") {
        return;
    }
    let img = Scratch::mkfs("quota", 256 * MIB, &["-n", "4096"]);
    {
        let mnt = Mount::new(&img.path, true);
        btrfs_cmd(&["quota", "enable"], &mnt.dir);
        btrfs_cmd(&["subvolume", "create"], &mnt.path("sv"));
        let mut rng = Rng::new(31);
        for i in 0..800 {
            std::fs::write(mnt.path(&format!("sv/f{i}")), rng.bytes(i * 131 % 20_000))
                .expect("write");
        }
        kernel_snapshot(&mnt, "sv", "snap");
        btrfs_cmd(&["qgroup", "create", "1/100"], &mnt.dir);
        for q in ["0/256", "0/257"] {
            let o = std::process::Command::new("btrfs")
                .args(["qgroup", "assign", "--no-rescan", q, "1/100"])
                .arg(&mnt.dir)
                .output()
                .expect("btrfs");
            assert!(
                o.status.success() || o.status.code() == Some(1),
                "qgroup assign: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        btrfs_cmd(&["quota", "rescan", "-w"], &mnt.dir);
        mnt.umount();
    }
    assert_check(&img.path, "quota: kernel-made image");
    let mut m = Model::load(&img.path);
    let (sv, snap) = (m.id("sv").root, m.id("snap").root);
    let mut rng = Rng::new(32);
    for round in 0..3 {
        ubtrfs_round(
            &img,
            &mut m,
            true,
            &[5, sv, snap],
            &format!("quota: round {round}"),
            |m, w| {
                random_shared_changes(
                    m,
                    w,
                    &mut rng,
                    &["sv", "snap", ""],
                    150,
                    &format!("q{round}"),
                );
            },
        );
    }
    let ours = kernel_rescan_agrees(&img);
    assert!(
        ours.iter().any(|(id, r, e)| id == "0/256" && r > e && *e > 0),
        "sv should share with snap and own some: {ours:?}"
    );
}

/// After `btrfs balance` the kernel's relocation marks tree 5 as snapshotted
/// (last_snapshot) and leaves relocated and FULL_BACKREF blocks behind. ubtrfs writes
/// every file and changes names at once, the oracle agrees, the kernel writes on top,
/// and ubtrfs again.
#[test]
fn balanced_filesystem() {
    if !common::kernel_available("balanced_filesystem") {
        return;
    }
    let img = Scratch::mkfs("balanced", 256 * MIB, &["-n", "4096"]);
    {
        let mnt = Mount::new(&img.path, true);
        for i in 0..600 {
            std::fs::write(
                mnt.path(&format!("file-{i:04}")),
                format!("content {i}\n").repeat(i % 9 + 1),
            )
            .expect("write");
        }
        std::fs::write(mnt.path("big"), vec![7u8; 3 << 20]).expect("write");
        btrfs_cmd(&["balance", "start", "--full-balance"], &mnt.dir);
        mnt.umount();
    }
    assert_check(&img.path, "after balance");
    let mut m = Model::load(&img.path);
    ubtrfs_round(&img, &mut m, true, &[5], "balanced: ubtrfs writes every file", |m, w| {
        for i in 0..600 {
            m.w_write(w, &format!("file-{i:04}"), 3, b"ubtrfs");
        }
        m.w_write(w, "big", 1 << 20, b"in the middle of a relocated extent");
    });
    ubtrfs_round(&img, &mut m, true, &[5], "balanced: names change", |m, w| {
        m.w_unlink(w, "file-0001");
        m.w_create(w, "new", 0o644, b"new\n");
    });
    kernel_round(&img, &mut m, "balanced: the kernel rewrites", |m, k| {
        for i in (2..600).step_by(5) {
            m.k_write(k, &format!("file-{i:04}"), 0, b"rewritten by the kernel");
        }
    });
    let mut rng = Rng::new(99);
    ubtrfs_round(&img, &mut m, true, &[5], "balanced: ubtrfs after the kernel", |m, w| {
        random_shared_changes(m, w, &mut rng, &[""], 300, "b");
    });
}

/// Filling the device is an error, not a panic. Data: the write that finds no space
/// fails with NoSpace mid-change, the writer turns read-only, the image keeps its last
/// commit (clean), and a new writer frees space and writes again. Metadata: operations
/// that add items are refused before they begin once only the reserve kept for
/// deletions and commits is left, so the writer stays usable, and deleting (which
/// needs tree blocks to COW) still works on the full filesystem.
#[test]
fn enospc_is_an_error() {
    let Some((img, kernel)) = image("enospc", 160 * MIB, &[], Some("blake2")) else { return };
    let base = if kernel { "" } else { "u" };
    let p = |r: &str| path(base, r);
    let mut m = Model::load(&img.path);
    let mut rng = Rng::new(81);
    ubtrfs_round(&img, &mut m, kernel, &[5], "enospc: baseline", |m, w| {
        if !base.is_empty() {
            m.w_mkdir(w, base, 0o755);
        }
        for i in 0..20 {
            m.w_create(w, &p(&format!("keep-{i}")), 0o644, &rng.bytes(100_000));
        }
    });
    // Fill in committed steps until a write fails.
    let mut err = None;
    'fill: for round in 0..1000 {
        let mut w = img.writer();
        let mut m2 = m.clone();
        for i in 0..4 {
            let name = p(&format!("fill-{round}-{i}"));
            let dir = m2.id(base);
            let ino = match w.create_file(
                dir.root,
                dir.ino,
                split_name(&name).as_bytes(),
                &InodeAttrs::new(0o644),
            ) {
                Ok(ino) => ino,
                Err(e) => {
                    err = Some((e, w));
                    break 'fill;
                }
            };
            let data = rng.bytes(4 * MIB as usize);
            if let Err(e) = w.write_file(dir.root, ino, 0, &data) {
                // The file was made; its data did not fit and was not written.
                m2.record_file(
                    &name,
                    0o644,
                    Vec::new(),
                    ubtrfs_core::inode::filesystem::InodeId { root: dir.root, ino },
                );
                m = m2;
                err = Some((e, w));
                break 'fill;
            }
            m2.record_file(
                &name,
                0o644,
                data,
                ubtrfs_core::inode::filesystem::InodeId { root: dir.root, ino },
            );
        }
        match w.commit() {
            Ok(_) => m = m2,
            Err(e) => {
                err = Some((e, w));
                break;
            }
        }
    }
    let (e, mut w) = err.expect("the device filled up");
    eprintln!("enospc: {e}");
    assert_eq!(e.posix_kind(), Some(PosixKind::NoSpace), "expected NoSpace, got {e}");
    // The data space is found before a write changes anything: the refused write left
    // nothing half done, the writer goes on, and what came before it commits.
    w.check_writable().expect("a write refused for space does not abort the writer");
    w.commit().expect("commit what fit");
    drop(w);
    verify_all(&img.path, &m, kernel, "enospc: after the failure");
    // Free space, and once the deletion is committed (freed extents stay pinned until
    // then, as in the kernel), write again.
    ubtrfs_round(&img, &mut m, kernel, &[5], "enospc: free", |m, w| {
        let fills: Vec<String> =
            m.paths().into_iter().map(|(q, _)| q).filter(|q| q.contains("fill-")).collect();
        for q in &fills[..fills.len() / 2] {
            m.w_unlink(w, q);
        }
    });
    ubtrfs_round(&img, &mut m, kernel, &[5], "enospc: recover", |m, w| {
        m.w_create(w, &p("after"), 0o644, &rng.bytes(3 * MIB as usize));
    });
    // Metadata runs out too: with the device full of data chunks, inline files (which
    // take only metadata) are refused once metadata is down to its reserve.
    let mut w = img.writer();
    let dir = m.id(base);
    let mut filled = false;
    for i in 0..20 {
        let Ok(ino) = w.create_file(
            dir.root,
            dir.ino,
            format!("data-{i}").as_bytes(),
            &InodeAttrs::new(0o644),
        ) else {
            break;
        };
        if w.write_file(dir.root, ino, 0, &rng.bytes(8 * MIB as usize)).is_err() {
            filled = true;
            break;
        }
    }
    assert!(filled, "data space filled again");
    drop(w);
    let mut refused = None;
    'meta: for round in 0..10_000 {
        let mut w = img.writer();
        for i in 0..500 {
            let name = p(&format!("meta-{round}-{i}"));
            let ino = match w.create_file(
                dir.root,
                dir.ino,
                split_name(&name).as_bytes(),
                &InodeAttrs::new(0o644),
            ) {
                Ok(ino) => ino,
                Err(e) => {
                    refused = Some((e, w));
                    break 'meta;
                }
            };
            let h = m.record_file(
                &name,
                0o644,
                Vec::new(),
                ubtrfs_core::inode::filesystem::InodeId { root: dir.root, ino },
            );
            let data = rng.bytes(2048);
            if let Err(e) = w.write_file(dir.root, ino, 0, &data) {
                refused = Some((e, w));
                break 'meta;
            }
            m.node_mut(h).data = data;
        }
        w.commit()
            .unwrap_or_else(|e| panic!("round {round}: commit with metadata nearly full: {e}"));
    }
    let (e, mut w) = refused.expect("metadata filled up");
    eprintln!("enospc (metadata): {e}");
    assert_eq!(e.posix_kind(), Some(PosixKind::NoSpace), "expected NoSpace, got {e}");
    // Operations that add items are refused before they begin once only the reserve is
    // left, so the writer stays usable and what it did so far commits.
    w.check_writable().expect("a refused operation does not abort the writer");
    w.commit().expect("commit what fit");
    drop(w);
    verify_all(&img.path, &m, kernel, "enospc: after metadata ran out");
    // Deleting still works (it COWs paths, from the reserve), in transactions small
    // enough for it; once committed, the freed space takes new files again.
    let metas: Vec<String> =
        m.paths().into_iter().map(|(q, _)| q).filter(|q| q.contains("meta-")).collect();
    for (n, batch) in metas.chunks(60).take(4).enumerate() {
        ubtrfs_round(
            &img,
            &mut m,
            kernel,
            &[5],
            &format!("enospc: delete batch {n} with metadata full"),
            |m, w| {
                for q in batch {
                    m.w_unlink(w, q);
                }
            },
        );
    }
    ubtrfs_round(&img, &mut m, kernel, &[5], "enospc: create after deleting", |m, w| {
        m.w_create(w, &p("after-meta"), 0o644, b"fits again\n");
    });
}

fn split_name(p: &str) -> &str {
    p.rsplit('/').next().expect("name")
}

/// Count chunks per type.
fn chunk_counts(img: &Scratch) -> HashMap<u64, usize> {
    let fs = img.reader();
    let mut c = HashMap::new();
    for ch in fs.info.chunk_map.iter() {
        *c.entry(ch.type_ & ubtrfs_format::structs::BLOCK_GROUP_TYPE_MASK).or_insert(0) += 1;
    }
    c
}

/// 310 MiB of data (one file larger than the largest extent and any data chunk) and
/// 24000 inline files of 2048 bytes (about 60 MiB of 4K leaves) in a 1 GiB image: new
/// data chunks and a new metadata chunk, all committed in one transaction; then the
/// kernel frees and fills space and ubtrfs reuses it.
#[test]
fn new_data_and_metadata_chunks() {
    use ubtrfs_format::structs::{BLOCK_GROUP_DATA, BLOCK_GROUP_METADATA};
    let Some((img, kernel)) = image("new_chunks", 1024 * MIB, &["-n", "4096"], None) else {
        return;
    };
    let before = chunk_counts(&img);
    let mut m = Model::load(&img.path);
    let mut rng = Rng::new(31);
    ubtrfs_round(&img, &mut m, kernel, &[5], "chunks: data and metadata", |m, w| {
        m.w_create(w, "huge", 0o644, &rng.bytes(200 * MIB as usize));
        m.w_create(w, "large", 0o644, &rng.bytes(70 * MIB as usize));
        m.w_create(w, "medium", 0o644, &rng.bytes(40 * MIB as usize + 4097));
        for d in 0..24 {
            m.w_mkdir(w, &format!("d{d}"), 0o755);
            for i in 0..1000 {
                let data = rng.bytes(2048);
                m.w_create(w, &format!("d{d}/f{i:04}"), 0o644, &data);
            }
        }
    });
    let after = chunk_counts(&img);
    assert!(
        after[&BLOCK_GROUP_DATA] > before[&BLOCK_GROUP_DATA] + 1,
        "data chunks before {before:?} after {after:?}"
    );
    assert!(
        after[&BLOCK_GROUP_METADATA] > before[&BLOCK_GROUP_METADATA],
        "metadata chunks before {before:?} after {after:?}"
    );
    if kernel {
        kernel_round(&img, &mut m, "chunks: kernel frees and adds", |m, k| {
            m.k_unlink(k, "huge");
            for i in 0..300 {
                m.k_unlink(k, &format!("d3/f{i:04}"));
            }
            m.k_create(k, "kernel-data", &rng.bytes(30 * MIB as usize));
        });
    }
    ubtrfs_round(&img, &mut m, kernel, &[5], "chunks: ubtrfs reuses space", |m, w| {
        m.w_create(w, "again", 0o644, &rng.bytes(150 * MIB as usize));
        for i in 0..500 {
            m.w_unlink(w, &format!("d5/f{i:04}"));
        }
        m.w_create(w, "d5/after", 0o644, &rng.bytes(10_000));
    });
}

fn regular_extents(fs: &Filesystem, p: &str) -> Vec<(u64, u64, u64, u64, u64)> {
    let v = fs.resolve(&format!("/{p}"), false).unwrap_or_else(|e| panic!("/{p}: {e}"));
    let v = fs.load_inode(v.id, Load::ALL).expect("load");
    v.extents
        .iter()
        .filter_map(|e| match e.kind {
            ExtentKind::Regular { disk_bytenr, disk_num_bytes, offset, num_bytes, .. }
                if disk_bytenr != 0 =>
            {
                Some((e.file_offset, disk_bytenr, disk_num_bytes, offset, num_bytes))
            }
            _ => None,
        })
        .collect()
}

fn is_inline(fs: &Filesystem, p: &str) -> bool {
    let v = fs.resolve(&format!("/{p}"), false).unwrap_or_else(|e| panic!("/{p}: {e}"));
    matches!(v.extents.as_slice(), [e] if matches!(e.kind, ExtentKind::Inline { .. }))
}

/// The refs and data backrefs of a data extent (None if there is no extent item).
fn extent_refs(w: &mut FsWriter, bytenr: u64, len: u64) -> Option<(u64, Vec<items::InlineRef>)> {
    let k = Key::new(bytenr, EXTENT_ITEM_KEY, len);
    let found = w.items_in_range(EXTENT_TREE_OBJECTID, &k, &k).expect("extent tree");
    found.first().map(|(_, d)| {
        let v = items::extent_item(d, false).expect("extent item");
        (v.refs, v.inline_refs)
    })
}

fn csum_covered(fs: &Filesystem, bytenr: u64, len: u64) -> (usize, usize) {
    let run = fs.lookup_csums(bytenr, len).expect("csum lookup");
    let n = run.present.iter().filter(|&&p| p).count();
    (n, run.present.len())
}

/// (used, length) summed over the data block groups.
fn data_space(img: &Scratch) -> (u64, u64) {
    let bgs = img.reader().info.block_groups().expect("block groups");
    let data = bgs.iter().filter(|g| g.flags & ubtrfs_format::structs::BLOCK_GROUP_DATA != 0);
    data.fold((0, 0), |(u, l), g| (u + g.used, l + g.length))
}

/// Write files of 64 KiB under `dir` until more than the free data space of the
/// existing block groups is used: every free range, freed ones included, gets used.
fn fill_data_space(img: &Scratch, m: &mut Model, w: &mut FsWriter, dir: &str, rng: &mut Rng) {
    let (used, len) = data_space(img);
    let want = len - used + MIB;
    m.w_mkdir(w, dir, 0o755);
    for i in 0..want.div_ceil(64 * KIB) {
        m.w_create(w, &format!("{dir}/fill-{i}"), 0o644, &rng.bytes(64 * KIB as usize));
    }
}

/// Does some regular extent of a file under `dir` overlap [bytenr, +len)?
fn dir_reuses(img: &Scratch, m: &Model, dir: &str, bytenr: u64, len: u64) -> bool {
    let fs = img.reader();
    m.paths().into_iter().filter(|(p, _)| p.starts_with(&format!("{dir}/"))).any(|(p, _)| {
        regular_extents(&fs, &p).iter().any(|e| e.1 < bytenr + len && bytenr < e.1 + e.2)
    })
}

/// A write into the middle of a big file splits its extent into two references of the
/// same extent (refs 2, one backref with count 2); trimming both pieces keeps it;
/// removing the file frees it with its csums, and a later transaction reuses the space.
#[test]
fn split_extent_then_free_and_reuse() {
    let Some((img, kernel)) = image("split_extent", 256 * MIB, &[], Some("blake2")) else { return };
    let base = if kernel { "" } else { "u" };
    let p = |r: &str| path(base, r);
    let mut m = Model::load(&img.path);
    let mut rng = Rng::new(41);
    ubtrfs_round(&img, &mut m, kernel, &[5], "split: write", |m, w| {
        if !base.is_empty() {
            m.w_mkdir(w, base, 0o755);
        }
        m.w_create(w, &p("big"), 0o644, &rng.bytes(MIB as usize));
        m.w_create(w, &p("other"), 0o644, &rng.bytes(256 * KIB as usize));
    });
    let fs = img.reader();
    let ext = regular_extents(&fs, &p("big"));
    assert_eq!(ext.len(), 1, "one extent: {ext:?}");
    let (_, bytenr, len, _, _) = ext[0];
    drop(fs);
    let used0 = data_space(&img).0;
    ubtrfs_round(&img, &mut m, kernel, &[5], "split: middle write", |m, w| {
        m.w_write(w, &p("big"), 400 * KIB, &rng.bytes(8 * KIB as usize));
    });
    let fs = img.reader();
    let ext = regular_extents(&fs, &p("big"));
    assert_eq!(ext.len(), 3, "head, new, tail: {ext:?}");
    assert_eq!((ext[0].1, ext[0].3, ext[0].4), (bytenr, 0, 400 * KIB));
    assert_eq!(
        (ext[2].0, ext[2].1, ext[2].3, ext[2].4),
        (408 * KIB, bytenr, 408 * KIB, len - 408 * KIB)
    );
    drop(fs);
    let mut w = img.writer();
    let (refs, inline) = extent_refs(&mut w, bytenr, len).expect("split extent still allocated");
    assert_eq!(refs, 2, "two file extents point into it");
    assert!(
        matches!(inline.as_slice(), [items::InlineRef::ExtentData { count: 2, offset: 0, .. }]),
        "one data backref with count 2: {inline:?}"
    );
    drop(w);
    ubtrfs_round(&img, &mut m, kernel, &[5], "split: trim both pieces", |m, w| {
        m.w_write(w, &p("big"), 0, &rng.bytes(4096));
        m.w_write(w, &p("big"), MIB - 8192, &rng.bytes(8192));
    });
    let mut w = img.writer();
    assert_eq!(
        extent_refs(&mut w, bytenr, len).map(|r| r.0),
        Some(2),
        "trims keep both references"
    );
    drop(w);
    ubtrfs_round(&img, &mut m, kernel, &[5], "split: unlink", |m, w| {
        m.w_unlink(w, &p("big"));
    });
    let mut w = img.writer();
    assert!(extent_refs(&mut w, bytenr, len).is_none(), "the extent is gone with the file");
    drop(w);
    let fs = img.reader();
    assert_eq!(csum_covered(&fs, bytenr, len).0, 0, "its csums are gone too");
    drop(fs);
    let used1 = data_space(&img).0;
    assert_eq!(
        used1,
        used0 - len,
        "data block groups account the freed extent (and every piece written over it)"
    );
    // A later transaction reuses the space: fill every free range of the data groups.
    ubtrfs_round(&img, &mut m, kernel, &[5], "split: reuse", |m, w| {
        fill_data_space(&img, m, w, &p("fill"), &mut rng);
    });
    assert!(
        dir_reuses(&img, &m, &p("fill"), bytenr, len),
        "freed range [{bytenr}, +{len}) not reused"
    );
    let fs = img.reader();
    let (have, all) = csum_covered(&fs, bytenr, len);
    assert_eq!(have, all, "csums of the reused range");
}

/// Rewriting a file in the transaction that created it frees the first extent before
/// it ever reaches the extent tree; its csums must go with it, and the space must be
/// reusable by the next transaction (the model found this).
#[test]
fn rewrite_in_same_transaction_drops_csums() {
    let Some((img, kernel)) = image("rewrite_same_txn", 256 * MIB, &[], Some("blake2")) else {
        return;
    };
    let base = if kernel { "" } else { "u" };
    let p = |r: &str| path(base, r);
    let mut m = Model::load(&img.path);
    let mut rng = Rng::new(51);
    let mut first = (0, 0);
    ubtrfs_round(&img, &mut m, kernel, &[5], "same txn: write twice", |m, w| {
        if !base.is_empty() {
            m.w_mkdir(w, base, 0o755);
        }
        m.w_create(w, &p("a"), 0o644, &rng.bytes(300_000));
        m.w_create(w, &p("b"), 0o644, &rng.bytes(100_000));
        let id = m.id(&p("a"));
        first = regular_extent_of(w, id.root, id.ino);
        m.w_write(w, &p("a"), 0, &rng.bytes(300_000));
        m.w_write(w, &p("b"), 4096, &rng.bytes(8192));
    });
    let fs = img.reader();
    assert_eq!(
        csum_covered(&fs, first.0, first.1).0,
        0,
        "csums of the extent dropped in its own transaction"
    );
    drop(fs);
    // The next transaction allocates the dropped extent's space again: inserting its
    // new csums used to hit the stale ones.
    ubtrfs_round(&img, &mut m, kernel, &[5], "same txn: reuse", |m, w| {
        fill_data_space(&img, m, w, &p("fill"), &mut rng);
    });
    assert!(
        dir_reuses(&img, &m, &p("fill"), first.0, first.1),
        "space of the dropped extent reused"
    );
}

/// (disk_bytenr, disk_num_bytes) of the first regular extent of an inode, as the
/// running transaction sees it.
fn regular_extent_of(w: &mut FsWriter, root: u64, ino: u64) -> (u64, u64) {
    let items = w
        .items_in_range(
            root,
            &Key::new(ino, EXTENT_DATA_KEY, 0),
            &Key::new(ino, EXTENT_DATA_KEY, u64::MAX),
        )
        .expect("extents");
    for (_, d) in items {
        if let Ok(items::FileExtent::Regular { disk_bytenr, disk_num_bytes, .. }) =
            items::file_extent(&d)
        {
            if disk_bytenr != 0 {
                return (disk_bytenr, disk_num_bytes);
            }
        }
    }
    panic!("root={root} ino={ino} has no regular extent");
}

/// A file larger than the largest extent (128 MiB as root; with the fixture, larger than
/// any chunk the small image can make): the writer settles for shorter extents, making
/// chunks as needed, instead of failing with NoSpace while space is free.
#[test]
fn file_larger_than_a_chunk() {
    let Some((img, kernel)) = image("larger_than_chunk", 1024 * MIB, &[], Some("blake2")) else {
        return;
    };
    let base = if kernel { "" } else { "u" };
    let p = |r: &str| path(base, r);
    let size = if kernel { 140 * MIB } else { 40 * MIB };
    let mut m = Model::load(&img.path);
    let mut rng = Rng::new(111);
    ubtrfs_round(&img, &mut m, kernel, &[5], "larger than a chunk", |m, w| {
        if !base.is_empty() {
            m.w_mkdir(w, base, 0o755);
        }
        m.w_create(w, &p("big"), 0o644, &rng.bytes(size as usize + 4097));
    });
    let fs = img.reader();
    let ext = regular_extents(&fs, &p("big"));
    assert!(ext.len() >= 2, "split into several extents: {ext:?}");
    assert!(ext.iter().all(|e| e.2 <= 128 * MIB), "no extent above 128 MiB: {ext:?}");
}

/// Groups whose free space is kept as bitmaps, next to a group that ends free, reload
/// correctly when a writer opens the image (a run was once carried across the group
/// boundary, and every later open failed; seeds 2 and 4 of the model found it).
#[test]
fn free_space_bitmaps_reload() {
    let Some((img, kernel)) =
        image("fst_bitmaps_reload", 256 * MIB, &["-n", "4096"], Some("nodesize4k-xxhash"))
    else {
        return;
    };
    let base = if kernel { "" } else { "u" };
    let p = |r: &str| path(base, r);
    let mut m = Model::load(&img.path);
    let mut rng = Rng::new(121);
    for round in 0..6 {
        let mut w = img.writer();
        // Every group converts to bitmaps at its first change, and never back.
        w.hooks.fst_thresholds_override = Some((0, 0));
        if round == 0 && !base.is_empty() {
            m.w_mkdir(&mut w, base, 0o755);
        }
        for i in 0..40 {
            let n = rng.range(1, 20_000) as usize;
            m.w_create(&mut w, &p(&format!("r{round}-{i}")), 0o644, &rng.bytes(n));
        }
        if round > 0 {
            for i in (0..40).step_by(2) {
                m.w_unlink(&mut w, &p(&format!("r{}-{i}", round - 1)));
            }
        }
        w.commit().unwrap_or_else(|e| panic!("round {round}: commit: {e}"));
        check_trees(&mut w, &[5], "fst bitmaps reload");
        drop(w);
        verify_all(&img.path, &m, kernel, &format!("fst bitmaps reload round {round}"));
    }
    // Some group must really be in bitmaps with its first sector free for this to test
    // anything; count the bitmap items at least.
    let mut w = img.writer();
    let items =
        w.items_in_range(FREE_SPACE_TREE_OBJECTID, &Key::MIN, &Key::MAX).expect("free space tree");
    assert!(items.iter().any(|(k, _)| k.type_ == FREE_SPACE_BITMAP_KEY), "no bitmaps were written");
}

/// Sizes around the inline limit: at most 2048 bytes (and below a sector) stay inline;
/// growing past it rewrites the file as a regular extent from offset 0.
#[test]
fn inline_limit_and_growth() {
    let Some((img, kernel)) =
        image("inline_limit", 256 * MIB, &["-n", "4096"], Some("nodesize4k-xxhash"))
    else {
        return;
    };
    let base = if kernel { "" } else { "u" };
    let p = |r: &str| path(base, r);
    let mut m = Model::load(&img.path);
    let mut rng = Rng::new(61);
    let sizes = [1u64, 2047, 2048, 2049, 4095, 4096];
    ubtrfs_round(&img, &mut m, kernel, &[5], "inline: create", |m, w| {
        if !base.is_empty() {
            m.w_mkdir(w, base, 0o755);
        }
        for s in sizes {
            m.w_create(w, &p(&format!("s{s}")), 0o644, &rng.bytes(s as usize));
        }
        // Built up by appends: 0 -> 1000 -> 2048 -> 2049.
        m.w_create(w, &p("grow"), 0o644, b"");
        m.w_write(w, &p("grow"), 0, &rng.bytes(1000));
        m.w_write(w, &p("grow"), 1000, &rng.bytes(1048));
    });
    let fs = img.reader();
    for s in sizes {
        assert_eq!(is_inline(&fs, &p(&format!("s{s}"))), s <= 2048, "size {s}");
    }
    assert!(is_inline(&fs, &p("grow")), "2048 bytes written in two pieces stay inline");
    drop(fs);
    ubtrfs_round(&img, &mut m, kernel, &[5], "inline: grow", |m, w| {
        m.w_write(w, &p("grow"), 2048, b"!");
        m.w_write(w, &p("s1"), 100_000, &rng.bytes(10));
        m.w_write(w, &p("s2047"), 1000, &rng.bytes(500));
    });
    let fs = img.reader();
    assert!(!is_inline(&fs, &p("grow")), "2049 bytes are regular");
    assert!(!is_inline(&fs, &p("s1")), "a write far past a 1-byte file");
    assert!(is_inline(&fs, &p("s2047")), "an overwrite inside an inline file keeps it inline");
}

/// Thousands of entries in one directory on 4K nodes: leaf splits, pushes and node
/// splits as it grows; deleting most of them in random order: merges, emptied leaves
/// and root collapse. Invariants and the oracle after each commit.
#[test]
fn big_directory_grows_and_shrinks() {
    let Some((img, kernel)) =
        image("big_directory", 256 * MIB, &["-n", "4096"], Some("nodesize4k-xxhash"))
    else {
        return;
    };
    let base = if kernel { "dir" } else { "u" };
    let mut m = Model::load(&img.path);
    let mut rng = Rng::new(71);
    let n = 5000;
    let level0 = fs_tree_level(&img, 5);
    ubtrfs_round(&img, &mut m, kernel, &[5], "bigdir: create", |m, w| {
        m.w_mkdir(w, base, 0o755);
        for i in 0..n {
            let size = [0usize, 10, 200, 3000][i % 4];
            m.w_create(
                w,
                &format!("{base}/entry-{i:05}-{}", "x".repeat(i % 40)),
                0o644,
                &rng.bytes(size),
            );
        }
    });
    let level1 = fs_tree_level(&img, 5);
    assert!(level1 >= 2 && level1 > level0, "the fs tree grew to level {level1} (from {level0})");
    let mut names: Vec<String> = m
        .paths()
        .into_iter()
        .map(|(p, _)| p)
        .filter(|p| p.starts_with(&format!("{base}/")))
        .collect();
    for i in (1..names.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        names.swap(i, j);
    }
    let keep = 40;
    for (round, chunk) in names[..names.len() - keep].chunks(1200).enumerate() {
        ubtrfs_round(
            &img,
            &mut m,
            kernel,
            &[5],
            &format!("bigdir: delete round {round}"),
            |m, w| {
                for p in chunk {
                    m.w_unlink(w, p);
                }
            },
        );
    }
    let level2 = fs_tree_level(&img, 5);
    assert!(level2 < level1, "the fs tree shrank back (level {level1} -> {level2})");
    if kernel {
        kernel_round(&img, &mut m, "bigdir: kernel adds", |m, k| {
            for i in 0..50 {
                m.k_create(k, &format!("{base}/k{i}"), b"k");
            }
        });
    }
    ubtrfs_round(&img, &mut m, kernel, &[5], "bigdir: delete the rest", |m, w| {
        let rest: Vec<String> = m
            .paths()
            .into_iter()
            .map(|(p, _)| p)
            .filter(|p| p.starts_with(&format!("{base}/")))
            .collect();
        for p in rest {
            m.w_unlink(w, &p);
        }
        m.w_unlink(w, base);
    });
}

/// Names whose DIR_ITEM keys collide share one item: add both, remove one, re-add.
#[test]
fn dir_item_hash_collision() {
    let Some((img, kernel)) = image("hash_collision", 256 * MIB, &[], Some("blake2")) else {
        return;
    };
    let base = if kernel { "" } else { "u" };
    let p = |r: &str| path(base, r);
    // Birthday search for two names with the same crc32c name hash.
    let mut seen: HashMap<u64, String> = HashMap::new();
    let (a, b) = (0u64..)
        .find_map(|i| {
            let n = format!("c{i}");
            let h = ubtrfs_format::hash::name_hash(n.as_bytes());
            seen.insert(h, n.clone()).map(|prev| (prev, n))
        })
        .expect("a collision");
    let mut m = Model::load(&img.path);
    ubtrfs_round(&img, &mut m, kernel, &[5], "collision: both names", |m, w| {
        if !base.is_empty() {
            m.w_mkdir(w, base, 0o755);
        }
        m.w_create(w, &p(&a), 0o644, b"first");
        m.w_create(w, &p(&b), 0o644, b"second");
        let dir = m.id(base);
        let k = Key::new(dir.ino, DIR_ITEM_KEY, ubtrfs_format::hash::name_hash(a.as_bytes()));
        let found = w.items_in_range(dir.root, &k, &k).expect("dir items");
        assert_eq!(items::dir_entries(&found[0].1).count(), 2, "{a} and {b} share one DIR_ITEM");
    });
    ubtrfs_round(&img, &mut m, kernel, &[5], "collision: remove the first", |m, w| {
        m.w_unlink(w, &p(&a));
    });
    ubtrfs_round(&img, &mut m, kernel, &[5], "collision: re-add", |m, w| {
        m.w_create(w, &p(&a), 0o644, b"again");
        m.w_unlink(w, &p(&b));
    });
}

/// A name that exists, or a bad name, is refused before anything changes: no orphan
/// inode is left behind and the writer stays usable.
#[test]
fn refused_names_leave_nothing_behind() {
    let Some((img, kernel)) = image("refused_names", 256 * MIB, &[], Some("blake2")) else {
        return;
    };
    let mut m = Model::load(&img.path);
    ubtrfs_round(&img, &mut m, kernel, &[5], "refused names", |m, w| {
        m.w_create(w, "exists", 0o644, b"x");
        let root = m.id("");
        let f = m.id("exists");
        let err = w
            .create_file(root.root, root.ino, b"exists", &InodeAttrs::new(0o644))
            .expect_err("duplicate name");
        assert_eq!(err.posix_kind(), Some(PosixKind::Exists));
        let err = w
            .mkdir(root.root, root.ino, b"exists", &InodeAttrs::new(0o755))
            .expect_err("duplicate name");
        assert_eq!(err.posix_kind(), Some(PosixKind::Exists));
        let err = w.mkdir(root.root, root.ino, b"a/b", &InodeAttrs::new(0o755)).expect_err("slash");
        assert_eq!(err.posix_kind(), Some(PosixKind::Invalid));
        let err = w
            .create_file(root.root, root.ino, &[b'n'; 256], &InodeAttrs::new(0o644))
            .expect_err("too long");
        assert_eq!(err.posix_kind(), Some(PosixKind::NameTooLong));
        let err = w
            .create_file(f.root, f.ino, b"inside-a-file", &InodeAttrs::new(0o644))
            .expect_err("not a directory");
        assert_eq!(err.posix_kind(), Some(PosixKind::NotDir));
        let err = w.unlink(root.root, root.ino, b"missing").expect_err("missing");
        assert_eq!(err.posix_kind(), Some(PosixKind::NotFound));
        w.check_writable().expect("refusals do not abort the writer");
        m.w_create(w, "after", 0o644, b"still writable");
    });
    assert_no_orphans(&img, &m, 5);
}

/// Every INODE_ITEM of tree `root` belongs to an inode the model can reach.
fn assert_no_orphans(img: &Scratch, m: &Model, root: u64) {
    let reachable: std::collections::HashSet<u64> = m
        .inodes
        .iter()
        .flatten()
        .filter_map(|n| n.id)
        .filter(|id| id.root == root)
        .map(|id| id.ino)
        .collect();
    let mut w = FsWriter::open(&OpenOptions::new(&img.path)).expect("open");
    let items = w
        .items_in_range(
            root,
            &Key::new(FIRST_FREE_OBJECTID, INODE_ITEM_KEY, 0),
            &Key::new(LAST_FREE_OBJECTID, INODE_ITEM_KEY, 0),
        )
        .expect("fs tree");
    for (k, _) in items {
        if k.type_ == INODE_ITEM_KEY {
            assert!(
                reachable.contains(&k.objectid),
                "tree {root}: inode {} has no name",
                k.objectid
            );
        }
    }
}

/// Images the writer does not support are refused at open, before anything changes:
/// RAID images with a device missing (RAID1 given one of two devices, RAID10 three of
/// four) when degraded writes were not asked for. (A log tree is replayed: tree_log.rs.)
#[test]
fn unsupported_images_are_refused() {
    for (f, given) in [("raid1", 1), ("raid10", 3)] {
        let imgs = common::fixture_images(f);
        let copies: Vec<Scratch> = imgs
            .iter()
            .enumerate()
            .map(|(i, _)| Scratch::fixture_device(f, i, &format!("refuse-{f}-{i}")))
            .collect();
        let before: Vec<String> = copies.iter().map(|c| c.sha256()).collect();
        let opts = OpenOptions {
            devices: copies.iter().take(given).map(|c| c.path.clone()).collect(),
            cache_bytes: 16 << 20,
            writable: true,
            sources: Default::default(),
            degraded: false,
            no_log_replay: false,
        };
        match FsWriter::open(&opts) {
            Err(Error::Incompatible(msg)) => {
                eprintln!("{f}: refused: {msg}");
                if given < copies.len() {
                    assert!(
                        msg.contains(&format!(
                            "has {} devices and {given} were given",
                            copies.len()
                        )),
                        "{f}: {msg}"
                    );
                }
            }
            Err(e) => panic!("{f}: expected Incompatible, got {e}"),
            Ok(_) => panic!("{f}: opened for writing"),
        }
        let after: Vec<String> = copies.iter().map(|c| c.sha256()).collect();
        assert_eq!(before, after, "{f}: refusing changed the image");
    }
}

/// Inode flags set with `chattr` on a kernel mount: new files in a NODATACOW
/// directory inherit NODATACOW and NODATASUM (no csums for their data), immutable
/// inodes and directories refuse every change, append-only ones refuse removal and
/// writes anywhere but at the end; each refusal is EPERM with the image unchanged.
#[test]
fn inode_flags_are_honoured() {
    if !common::kernel_available_with(
        "inode_flags_are_honoured",
        &["/usr/bin/chattr", "/usr/bin/lsattr"],
    ) {
        return;
    }
    let img = Scratch::mkfs("iflags", 256 * MIB, &[]);
    let chattr = |flag: &str, p: &std::path::Path| {
        let o = std::process::Command::new("chattr").arg(flag).arg(p).output().expect("chattr");
        assert!(
            o.status.success(),
            "chattr {flag} {}: {}",
            p.display(),
            String::from_utf8_lossy(&o.stderr)
        );
    };
    {
        let mnt = Mount::new(&img.path, true);
        for d in ["nocow", "frozen", "logs"] {
            std::fs::create_dir(mnt.path(d)).expect("mkdir");
        }
        chattr("+C", &mnt.path("nocow"));
        std::fs::write(mnt.path("frozen/f"), b"frozen\n").expect("write");
        std::fs::write(mnt.path("logs/log"), b"line 1\n").expect("write");
        std::fs::write(mnt.path("immutable"), b"keep me\n").expect("write");
        chattr("+i", &mnt.path("frozen"));
        chattr("+a", &mnt.path("logs"));
        chattr("+a", &mnt.path("logs/log"));
        chattr("+i", &mnt.path("immutable"));
        mnt.umount();
    }
    let mut m = Model::load(&img.path);
    let mut rng = Rng::new(41);
    let data = rng.bytes(200_000);
    ubtrfs_round(
        &img,
        &mut m,
        true,
        &[5],
        "iflags: file in a NODATACOW directory, append to an append-only file",
        |m, w| {
            m.w_create(w, "nocow/vm.img", 0o644, &data);
            m.w_write(w, "logs/log", 7, b"line 2\n");
            m.w_create(w, "logs/new", 0o644, b"appended name\n");
        },
    );
    let mut w = img.writer();
    let f = m.id("nocow/vm.img");
    let ii = w.live().load_inode(f, Load::ITEM).expect("inode").item;
    use ubtrfs_format::structs::{INODE_NODATACOW, INODE_NODATASUM};
    assert_eq!(
        ii.flags.get() & (INODE_NODATACOW | INODE_NODATASUM),
        INODE_NODATACOW | INODE_NODATASUM,
        "flags {:#x}",
        ii.flags.get()
    );
    let (bytenr, len) = regular_extent_of(&mut w, f.root, f.ino);
    let csums = w
        .items_in_range(
            CSUM_TREE_OBJECTID,
            &Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, 0),
            &Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, u64::MAX),
        )
        .expect("csum tree");
    assert!(
        !csums.iter().any(
            |(k, d)| k.offset < bytenr + len && k.offset + (d.len() as u64 / 4) * 4096 > bytenr
        ),
        "NODATASUM data got checksums"
    );
    drop(w);
    {
        let mnt = Mount::new(&img.path, false);
        let o = std::process::Command::new("lsattr")
            .arg("-d")
            .arg(mnt.path("nocow/vm.img"))
            .output()
            .expect("lsattr");
        let attrs = String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string();
        assert!(attrs.contains('C'), "the kernel does not see NODATACOW: {attrs}");
        mnt.umount();
    }
    type Attempt = Box<dyn Fn(&mut FsWriter, &Model) -> ubtrfs_core::Result<()>>;
    let refusals: [(&str, Attempt); 6] = [
        ("unlink an immutable file", Box::new(|w, m| w.unlink(5, m.id("").ino, b"immutable"))),
        (
            "write an immutable file",
            Box::new(|w, m| w.write_file(5, m.id("immutable").ino, 0, b"x")),
        ),
        (
            "create in an immutable directory",
            Box::new(|w, m| {
                w.create_file(5, m.id("frozen").ino, b"new", &InodeAttrs::new(0o644)).map(|_| ())
            }),
        ),
        (
            "unlink in an immutable directory",
            Box::new(|w, m| w.unlink(5, m.id("frozen").ino, b"f")),
        ),
        (
            "unlink in an append-only directory",
            Box::new(|w, m| w.unlink(5, m.id("logs").ino, b"new")),
        ),
        (
            "overwrite inside an append-only file",
            Box::new(|w, m| w.write_file(5, m.id("logs/log").ino, 0, b"LINE")),
        ),
    ];
    for (what, f) in &refusals {
        let before = img.sha256();
        let mut w = img.writer();
        match f(&mut w, &m) {
            Err(e) => assert_eq!(e.posix_kind(), Some(PosixKind::NotPermitted), "{what}: {e}"),
            Ok(()) => panic!("{what}: allowed"),
        }
        w.commit()
            .unwrap_or_else(|e| panic!("{what}: the writer stays usable after a refusal: {e}"));
        drop(w);
        assert_eq!(before, img.sha256(), "{what}: the image changed");
    }
    verify_all(&img.path, &m, true, "iflags: after the refusals");
}

/// Relocation trees left by an interrupted balance must be merged by the kernel (its
/// COW hooks keep them in step with the fs trees): the writer refuses such an image by
/// name, unchanged, while the reader still reads it. The image is made by giving a
/// fixture a relocation tree root.
#[test]
fn interrupted_balance_is_refused() {
    let img = Scratch::fixture("blake2", "reloc-refused");
    let m = Model::load(&img.path);
    let mut w = img.writer();
    // A relocation tree's root item names the subvolume it relocates in its key offset
    // (the kernel's tree checker refuses any other): one sharing tree 5's root.
    let fs_root = Key::new(FS_TREE_OBJECTID, ROOT_ITEM_KEY, 0);
    let (leaf, slot) = w
        .raw_tree()
        .lookup_for_update(ROOT_TREE_OBJECTID, &fs_root, 0)
        .expect("lookup")
        .expect("tree 5's root item");
    let item = w.raw_tree().item_data_mut(leaf, slot).to_vec();
    w.raw_tree()
        .insert_item(
            ROOT_TREE_OBJECTID,
            &Key::new(TREE_RELOC_OBJECTID, ROOT_ITEM_KEY, FS_TREE_OBJECTID),
            &item,
        )
        .expect("a relocation tree root");
    w.commit().expect("commit");
    drop(w);
    let before = img.sha256();
    match FsWriter::open(&OpenOptions {
        devices: vec![img.path.clone()],
        cache_bytes: 16 << 20,
        writable: true,
        sources: Default::default(),
        degraded: false,
        no_log_replay: false,
    }) {
        Err(Error::Incompatible(msg)) => {
            assert!(msg.contains("interrupted balance"), "unclear refusal: {msg}")
        }
        Err(e) => panic!("expected Incompatible, got {e}"),
        Ok(_) => panic!("opened for writing with relocation trees present"),
    }
    assert_eq!(before, img.sha256(), "refusing changed the image");
    assert_same(&m.expect(), &walk_ubtrfs(&img.path), "the reader still reads the image");
}

/// A seed device is read-only by design: `btrfstune -S 1` marks it, and the writer
/// refuses it by name with the image unchanged.
#[test]
fn seed_device_is_refused() {
    let have = std::process::Command::new("btrfstune").arg("--help").output().is_ok();
    if !have {
        assert!(
            std::env::var_os("CI").is_none(),
            "seed_device_is_refused: btrfstune is missing in CI"
        );
        eprintln!("seed_device_is_refused: skipped: btrfstune (btrfs-progs) is not installed");
        return;
    }
    let img = Scratch::fixture("blake2", "seed-refused");
    let o = std::process::Command::new("btrfstune")
        .args(["-S", "1"])
        .arg(&img.path)
        .output()
        .expect("btrfstune");
    assert!(o.status.success(), "btrfstune -S 1: {}", String::from_utf8_lossy(&o.stderr));
    let before = img.sha256();
    match FsWriter::open(&OpenOptions {
        devices: vec![img.path.clone()],
        cache_bytes: 16 << 20,
        writable: true,
        sources: Default::default(),
        degraded: false,
        no_log_replay: false,
    }) {
        Err(Error::Incompatible(msg)) => assert!(msg.contains("SEEDING"), "unclear refusal: {msg}"),
        Err(e) => panic!("expected Incompatible, got {e}"),
        Ok(_) => panic!("a seed device opened for writing"),
    }
    assert_eq!(before, img.sha256(), "refusing changed the image");
}

/// The oracle is not vacuous: a flipped data byte fails `btrfs check --check-data-csum`
/// and ubtrfs's verified read, and a model that differs from the image is reported.
#[test]
fn oracle_detects_damage() {
    let Some((img, kernel)) = image("oracle_damage", 256 * MIB, &[], Some("blake2")) else {
        return;
    };
    let base = if kernel { "" } else { "u" };
    let p = |r: &str| path(base, r);
    let mut m = Model::load(&img.path);
    let mut rng = Rng::new(99);
    ubtrfs_round(&img, &mut m, kernel, &[5], "oracle: baseline", |m, w| {
        if !base.is_empty() {
            m.w_mkdir(w, base, 0o755);
        }
        m.w_create(w, &p("data"), 0o644, &rng.bytes(100_000));
    });
    let mut other = m.clone();
    let h = other.handle(&p("data"));
    other.node_mut(h).data[5] ^= 1;
    assert!(
        !diff_trees(&other.expect(), &walk_ubtrfs(&img.path), 5).is_empty(),
        "a changed byte in the model is a difference"
    );
    let fs = img.reader();
    let (_, bytenr, _, _, _) = regular_extents(&fs, &p("data"))[0];
    let chunk = fs.info.chunk_map.lookup(ubtrfs_core::ids::Logical(bytenr)).expect("chunk").clone();
    drop(fs);
    for mirror in 0..chunk.num_copies() {
        let (_, phys, _) = chunk.map(bytenr + 8192, mirror);
        use std::os::unix::fs::FileExt;
        let f =
            std::fs::OpenOptions::new().read(true).write(true).open(&img.path).expect("open image");
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, phys).expect("read");
        b[0] ^= 0x40;
        f.write_all_at(&b, phys).expect("write");
    }
    let fs = img.reader();
    let v = fs.resolve(&format!("/{}", p("data")), false).expect("resolve");
    let mut buf = vec![0u8; 100_000];
    assert!(fs.read_at(&v, 0, &mut buf).is_err(), "ubtrfs reads verify data csums");
    if kernel {
        assert!(
            btrfs_check(&img.path).is_err(),
            "btrfs check --check-data-csum sees the flipped byte"
        );
    }
}

/// A write far past the end of a small (inline-sized) file reserves the data space it
/// writes, not the hole before it: one byte at 1 GiB into an empty file fits on a
/// 256 MiB image (it used to ask for 1 GiB and fail with ENOSPC), and the kernel reads
/// the hole as zeros and the byte.
#[test]
fn a_write_far_past_eof_reserves_only_what_it_writes() {
    if !common::kernel_available("a_write_far_past_eof_reserves_only_what_it_writes") {
        return;
    }
    let img = Scratch::mkfs("far-write", 256 * MIB, &[]);
    let mut w = img.writer();
    let top = w.live().root_dir();
    for (name, first) in [(&b"empty"[..], &b""[..]), (b"small", b"a few inline bytes")] {
        let ino = w.create_file(top.root, top.ino, name, &InodeAttrs::new(0o644)).expect("create");
        if !first.is_empty() {
            w.write_file(top.root, ino, 0, first).expect("small write");
        }
        w.write_file(top.root, ino, 1 << 30, b"!").expect("one byte at 1 GiB");
    }
    w.commit().expect("commit");
    drop(w);
    assert_check(&img.path, "after writes far past EOF");
    let m = Mount::new(&img.path, false);
    for (name, first) in [("empty", &b""[..]), ("small", b"a few inline bytes")] {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open(m.path(name)).expect("open");
        assert_eq!(f.metadata().unwrap().len(), (1 << 30) + 1, "{name}: size");
        let mut head = vec![0u8; 4096];
        f.read_exact_at(&mut head, 0).unwrap();
        assert_eq!(&head[..first.len()], first, "{name}: its first bytes");
        assert!(head[first.len()..].iter().all(|&b| b == 0), "{name}: the hole reads as zeros");
        let mut last = [0u8; 1];
        f.read_exact_at(&mut last, 1 << 30).unwrap();
        assert_eq!(&last, b"!", "{name}: the byte at 1 GiB");
    }
    m.umount();
}
