//! The checker against ground truth: every kernel-made fixture is clean; images
//! corrupted on purpose (one field each, block checksums recomputed so the damage
//! reaches the checker instead of the tree checker) report the specific finding, and
//! `btrfs check --readonly` agrees that they are damaged; the btrfs-progs corrupt-image
//! corpus runs without panics or hangs, with agreement numbers printed.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;
use ubtrfs_core::volumes::device::{BlockDevice, MemDevice};
use ubtrfs_core::TreeView;
use ubtrfs_core::{Expect, FsInfo, RootInfo};
use ubtrfs_format::key::*;
use ubtrfs_format::node::{HEADER_SIZE, ITEM_SIZE};
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;
use ubtrfs_tools::check::{check, codes, CheckOptions, CheckReport, Code};

fn open_files(paths: &[PathBuf]) -> FsInfo {
    let mut o = ubtrfs_core::OpenOptions::new(&paths[0]);
    o.devices = paths.to_vec();
    FsInfo::open(&o).expect("open fixture")
}

#[test]
fn fixtures_are_clean() {
    for name in common::fixture_names() {
        let paths = common::fixture_images(&name);
        if name == "sprout" {
            // A sprout over a seed device is refused at open, by name.
            let mut o = ubtrfs_core::OpenOptions::new(&paths[0]);
            o.devices = paths.to_vec();
            let e = FsInfo::open(&o).err().expect("a sprout is refused");
            assert!(e.to_string().contains("seed devices are not supported"), "{e}");
            continue;
        }
        let fs = open_files(&paths);
        let r = check(&fs, &CheckOptions { check_data_csum: true, ..CheckOptions::default() })
            .expect("check runs");
        for n in &r.notes {
            eprintln!("{name}: note: {n}");
        }
        for f in &r.findings {
            eprintln!("{name}: {f}");
        }
        assert!(r.is_clean(), "{name}: {} problems", r.problems());
        // What mkfs.btrfs itself leaves (stale free-space-tree items below the first
        // block group) is no note either; only the log tree gets one, and a missing
        // free space tree (btrfs-convert makes none).
        let no_fst = fs.super_copy().compat_ro_flags.get()
            & ubtrfs_format::features::COMPAT_RO_FREE_SPACE_TREE
            == 0;
        let expected_notes = usize::from(fs.super_copy().log_root.get() != 0) + usize::from(no_fst);
        assert_eq!(r.notes.len(), expected_notes, "{name}: unexpected notes {:?}", r.notes);
        assert!(
            r.stats.tree_blocks > 0 && r.stats.inodes > 0,
            "{name}: nothing checked: {}",
            r.summary()
        );
        assert!(r.stats.data_bytes_verified > 0, "{name}: no data verified");
    }
}

/// An image held in memory, edited block by block.
struct Img {
    name: String,
    devs: Vec<Vec<u8>>,
}

/// Which tree an edit targets.
fn tree_root(fs: &FsInfo, tree: u64) -> RootInfo {
    match tree {
        ROOT_TREE_OBJECTID => fs.tree_root(),
        CHUNK_TREE_OBJECTID => fs.chunk_root(),
        id => fs.read_root(id).expect("tree exists").0,
    }
}

impl Img {
    fn load(name: &str) -> Img {
        Img::from_files(name, &common::fixture_images(name))
    }

    fn from_files(name: &str, paths: &[PathBuf]) -> Img {
        let devs = paths.iter().map(|p| std::fs::read(p).expect("read image")).collect();
        Img { name: name.to_string(), devs }
    }

    fn open(&self) -> FsInfo {
        let devs: Vec<Arc<dyn BlockDevice>> = self
            .devs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                Arc::new(MemDevice::new(d.clone(), i.to_string())) as Arc<dyn BlockDevice>
            })
            .collect();
        FsInfo::open_devices(devs, 64 << 20).expect("open edited image")
    }

    fn check(&self) -> CheckReport {
        check(&self.open(), &CheckOptions::default()).expect("check runs")
    }

    /// Rewrite tree block `bytenr` in every copy, fixing its checksum.
    fn edit_block(&mut self, fs: &FsInfo, bytenr: u64, f: impl FnOnce(&mut Vec<u8>)) {
        let eb = fs.read_tree_block(bytenr, &Expect::default()).expect("block reads");
        let mut buf = eb.bytes().to_vec();
        f(&mut buf);
        let sum = fs.csum_type.compute(&buf[CSUM_SIZE..]);
        buf[..fs.csum_type.size()].copy_from_slice(&sum[..fs.csum_type.size()]);
        let chunk = fs.chunk_map.lookup(ubtrfs_core::ids::Logical(bytenr)).expect("mapped").clone();
        for m in 0..chunk.num_copies() {
            let (idx, phys, contig) = chunk.map(bytenr, m);
            assert!(contig >= buf.len() as u64, "tree block split across stripes");
            let devid = chunk.stripes[idx].0;
            let name = fs.devices.get(devid).expect("device").dev.name().to_string();
            let d: usize = name.parse().expect("device index name");
            self.devs[d][phys as usize..phys as usize + buf.len()].copy_from_slice(&buf);
        }
    }

    /// The leaf and slot holding `key` in `tree`.
    fn find(&self, fs: &FsInfo, tree: u64, key: Key) -> (u64, usize) {
        let search = fs.search_slot(&tree_root(fs, tree), &key).expect("search");
        assert!(search.found(), "{}: key {key} not found in tree {tree}", self.name);
        let path = search.into_path();
        (path.leaf().bytenr, path.slot())
    }

    /// Edit the body of item `key` in `tree` in place.
    fn edit_item(&mut self, fs: &FsInfo, tree: u64, key: Key, f: impl FnOnce(&mut [u8])) {
        let (leaf, slot) = self.find(fs, tree, key);
        self.edit_block(fs, leaf, |buf| {
            let (off, size) = item_loc(buf, slot);
            f(&mut buf[HEADER_SIZE + off..HEADER_SIZE + off + size]);
        });
    }

    /// Rebuild the leaf holding `key` from its (key, body) list after `f` edits it.
    fn repack_leaf(
        &mut self,
        fs: &FsInfo,
        tree: u64,
        key: Key,
        f: impl FnOnce(&mut Vec<(Key, Vec<u8>)>),
    ) {
        let (leaf, _) = self.find(fs, tree, key);
        self.edit_block(fs, leaf, |buf| {
            let n = nritems(buf);
            let mut items: Vec<(Key, Vec<u8>)> = (0..n)
                .map(|s| {
                    let (off, size) = item_loc(buf, s);
                    (item_key(buf, s), buf[HEADER_SIZE + off..HEADER_SIZE + off + size].to_vec())
                })
                .collect();
            f(&mut items);
            let ns = buf.len();
            buf[HEADER_SIZE..].fill(0);
            buf[HEADER_SIZE - 5..HEADER_SIZE - 1]
                .copy_from_slice(&(items.len() as u32).to_le_bytes());
            let mut end = ns - HEADER_SIZE;
            for (i, (k, d)) in items.iter().enumerate() {
                end -= d.len();
                let h = HEADER_SIZE + i * ITEM_SIZE;
                buf[h..h + 8].copy_from_slice(&k.objectid.to_le_bytes());
                buf[h + 8] = k.type_;
                buf[h + 9..h + 17].copy_from_slice(&k.offset.to_le_bytes());
                buf[h + 17..h + 21].copy_from_slice(&(end as u32).to_le_bytes());
                buf[h + 21..h + 25].copy_from_slice(&(d.len() as u32).to_le_bytes());
                buf[HEADER_SIZE + end..HEADER_SIZE + end + d.len()].copy_from_slice(d);
            }
        });
    }

    /// Edit the superblock (every copy on the first device), fixing its checksum.
    fn edit_super(&mut self, fs: &FsInfo, f: impl Fn(&mut [u8])) {
        for m in 0..SUPER_MIRROR_MAX {
            let off = sb_offset(m) as usize;
            if off + SUPER_INFO_SIZE > self.devs[0].len() {
                break;
            }
            let sb = &mut self.devs[0][off..off + SUPER_INFO_SIZE];
            f(sb);
            let sum = fs.csum_type.compute(&sb[CSUM_SIZE..]);
            sb[..fs.csum_type.size()].copy_from_slice(&sum[..fs.csum_type.size()]);
        }
    }

    /// Write the devices to temp files (sparse) for btrfs-progs.
    fn write_temp(&self, tag: &str) -> Vec<PathBuf> {
        use std::io::{Seek, SeekFrom, Write};
        // One shared directory; the files carry the pid and are removed after use.
        let dir = std::env::temp_dir().join("ubtrfs-check");
        std::fs::create_dir_all(&dir).expect("temp dir");
        self.devs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let p = dir.join(format!("{}-{tag}-{}.{i}.img", self.name, std::process::id()));
                let mut f = std::fs::File::create(&p).expect("create temp image");
                for (k, c) in d.chunks(4096).enumerate() {
                    if c.iter().any(|&b| b != 0) {
                        f.seek(SeekFrom::Start(k as u64 * 4096)).expect("seek");
                        f.write_all(c).expect("write");
                    }
                }
                f.set_len(d.len() as u64).expect("set_len");
                p
            })
            .collect()
    }
}

fn nritems(buf: &[u8]) -> usize {
    u32::from_le_bytes(buf[HEADER_SIZE - 5..HEADER_SIZE - 1].try_into().unwrap()) as usize
}

fn item_key(buf: &[u8], slot: usize) -> Key {
    let h = HEADER_SIZE + slot * ITEM_SIZE;
    Key::new(
        u64::from_le_bytes(buf[h..h + 8].try_into().unwrap()),
        buf[h + 8],
        u64::from_le_bytes(buf[h + 9..h + 17].try_into().unwrap()),
    )
}

fn item_loc(buf: &[u8], slot: usize) -> (usize, usize) {
    let h = HEADER_SIZE + slot * ITEM_SIZE;
    (
        u32::from_le_bytes(buf[h + 17..h + 21].try_into().unwrap()) as usize,
        u32::from_le_bytes(buf[h + 21..h + 25].try_into().unwrap()) as usize,
    )
}

fn le64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
}
fn put64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}
fn put32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

/// All (key, body) items of a tree.
fn items(fs: &FsInfo, tree: u64) -> Vec<(Key, Vec<u8>)> {
    let mut it = fs.iter(&tree_root(fs, tree), Key::MIN).expect("iter");
    let mut v = Vec::new();
    while let Some(i) = it.next_item().expect("item") {
        v.push((i.key(), i.data().to_vec()));
    }
    v
}

// Byte offsets inside an INODE_ITEM.
const II_SIZE: usize = 16;
const II_NBYTES: usize = 24;
const II_NLINK: usize = 40;
const II_MODE: usize = 52;

fn inode_mode(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[II_MODE..II_MODE + 4].try_into().unwrap())
}

/// Can btrfs-progs judge our images? Root is not needed for `check` on a file, but the
/// brief ties agreement to root + progs; CI=true turns a skip into a failure.
fn progs_available() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { geteuid() } == 0;
    let progs = Command::new("btrfs")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if root && progs {
        return true;
    }
    let why =
        format!("btrfs check agreement skipped: needs root ({root}) and btrfs-progs ({progs})");
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{why}, and CI=true forbids skipping");
    }
    eprintln!("{why}");
    false
}

extern "C" {
    fn geteuid() -> u32;
}

/// Run `btrfs check --readonly` on the first device; (exit success, output).
fn progs_check(paths: &[PathBuf]) -> (bool, String) {
    let out = Command::new("btrfs")
        .args(["check", "--readonly"])
        .arg(&paths[0])
        .output()
        .expect("run btrfs check");
    (
        out.status.success(),
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
    )
}

/// Assert the edited image reports `code`, and that btrfs check also calls it damaged
/// (unless `progs_sees` is false: a rule btrfs-progs 6.2 does not check).
fn expect_finding(img: &Img, tag: &str, code: Code, progs_sees: bool) {
    let r = img.check();
    for f in &r.findings {
        eprintln!("{}/{tag}: {f}", img.name);
    }
    assert!(
        r.has(code),
        "{}/{tag}: expected {code}, got: {}",
        img.name,
        r.findings.iter().map(|f| f.to_string()).collect::<Vec<_>>().join("\n")
    );
    if !progs_sees {
        eprintln!(
            "{}/{tag}: btrfs-progs 6.2 does not check this rule; agreement not asserted",
            img.name
        );
        return;
    }
    if progs_available() {
        let paths = img.write_temp(tag);
        let (ok, out) = progs_check(&paths);
        for p in &paths {
            let _ = std::fs::remove_file(p);
        }
        assert!(!ok, "{}/{tag}: btrfs check found nothing wrong:\n{out}", img.name);
    }
}

/// The first fs-tree (5) inode whose INODE_ITEM satisfies `pred`.
fn find_inode(fs: &FsInfo, pred: impl Fn(Key, &[u8]) -> bool) -> Key {
    items(fs, FS_TREE_OBJECTID)
        .into_iter()
        .find(|(k, d)| k.type_ == INODE_ITEM_KEY && k.objectid >= 257 && pred(*k, d))
        .expect("matching inode")
        .0
}

#[test]
fn corrupt_block_group_used() {
    let mut img = Img::load("default");
    let fs = img.open();
    let (k, _) = items(&fs, EXTENT_TREE_OBJECTID)
        .into_iter()
        .find(|(k, d)| {
            k.type_ == BLOCK_GROUP_ITEM_KEY
                && le64(d, 16) & BLOCK_GROUP_DATA != 0
                && le64(d, 0) + 4096 <= k.offset
        })
        .expect("data block group");
    img.edit_item(&fs, EXTENT_TREE_OBJECTID, k, |b| put64(b, 0, le64(b, 0) + 4096));
    expect_finding(&img, "bg-used", codes::BG_USED_MISMATCH, true);
}

#[test]
fn corrupt_extent_refs() {
    let mut img = Img::load("default");
    let fs = img.open();
    let (k, _) = items(&fs, EXTENT_TREE_OBJECTID)
        .into_iter()
        .find(|(k, d)| {
            k.type_ == EXTENT_ITEM_KEY && le64(d, 16) & EXTENT_FLAG_DATA != 0 && le64(d, 0) == 1
        })
        .expect("data extent with refs 1");
    img.edit_item(&fs, EXTENT_TREE_OBJECTID, k, |b| put64(b, 0, 2));
    expect_finding(&img, "extent-refs", codes::EXTENT_REFS_MISMATCH, true);
}

#[test]
fn corrupt_data_ref_count() {
    let mut img = Img::load("default");
    let fs = img.open();
    // refs 1 with one inline EXTENT_DATA_REF (24-byte header, type byte, 28-byte ref).
    let (k, _) = items(&fs, EXTENT_TREE_OBJECTID)
        .into_iter()
        .find(|(k, d)| {
            k.type_ == EXTENT_ITEM_KEY
                && le64(d, 16) & EXTENT_FLAG_DATA != 0
                && le64(d, 0) == 1
                && d.len() == 24 + 29
                && d[24] == EXTENT_DATA_REF_KEY
        })
        .expect("data extent with one inline ref");
    img.edit_item(&fs, EXTENT_TREE_OBJECTID, k, |b| {
        put64(b, 0, 2);
        put32(b, 24 + 1 + 24, 2);
    });
    expect_finding(&img, "data-ref-count", codes::DATA_REF_COUNT, true);
}

#[test]
fn corrupt_inline_ref_order() {
    let mut img = Img::load("default");
    let fs = img.open();
    // A reflinked extent with two inline EXTENT_DATA_REFs: swap them.
    let (k, _) = items(&fs, EXTENT_TREE_OBJECTID)
        .into_iter()
        .find(|(k, d)| {
            k.type_ == EXTENT_ITEM_KEY
                && d.len() == 24 + 2 * 29
                && d[24] == EXTENT_DATA_REF_KEY
                && d[24 + 29] == EXTENT_DATA_REF_KEY
        })
        .expect("extent with two inline data refs");
    img.edit_item(&fs, EXTENT_TREE_OBJECTID, k, |b| {
        let (a, c) = (b[24..53].to_vec(), b[53..82].to_vec());
        b[24..53].copy_from_slice(&c);
        b[53..82].copy_from_slice(&a);
    });
    // The kernel's tree checker refuses the leaf (check_extent_item), and so does
    // ours: the extent tree leaf is unreadable. btrfs-progs 6.2 does not check the
    // order (6.6+ does: fsck test 061).
    expect_finding(&img, "inline-order", codes::TREE_BLOCK_INVALID, false);
    let r = img.check();
    assert!(
        r.findings.iter().any(|f| f.to_string().contains("inline ref out-of-order")),
        "no finding names the order"
    );
}

#[test]
fn corrupt_nlink() {
    let mut img = Img::load("default");
    let fs = img.open();
    let k = find_inode(&fs, |_, d| {
        inode_mode(d) & S_IFMT == S_IFREG
            && u32::from_le_bytes(d[II_NLINK..II_NLINK + 4].try_into().unwrap()) == 1
    });
    img.edit_item(&fs, FS_TREE_OBJECTID, k, |b| put32(b, II_NLINK, 2));
    expect_finding(&img, "nlink", codes::NLINK_MISMATCH, true);
}

#[test]
fn corrupt_dir_size() {
    let mut img = Img::load("default");
    let fs = img.open();
    let k = find_inode(&fs, |_, d| inode_mode(d) & S_IFMT == S_IFDIR && le64(d, II_SIZE) > 0);
    img.edit_item(&fs, FS_TREE_OBJECTID, k, |b| put64(b, II_SIZE, le64(b, II_SIZE) + 2));
    expect_finding(&img, "dir-size", codes::DIR_SIZE, true);
}

#[test]
fn corrupt_nbytes() {
    let mut img = Img::load("default");
    let fs = img.open();
    let k = find_inode(&fs, |_, d| inode_mode(d) & S_IFMT == S_IFREG && le64(d, II_NBYTES) > 0);
    img.edit_item(&fs, FS_TREE_OBJECTID, k, |b| put64(b, II_NBYTES, le64(b, II_NBYTES) + 4096));
    expect_finding(&img, "nbytes", codes::NBYTES_MISMATCH, true);
}

#[test]
fn corrupt_missing_csum() {
    let mut img = Img::load("default");
    let fs = img.open();
    // Drop the last csum of an item that covers more than one sector.
    let csize = fs.csum_type.size();
    let (k, _) = items(&fs, CSUM_TREE_OBJECTID)
        .into_iter()
        .find(|(k, d)| k.type_ == EXTENT_CSUM_KEY && d.len() > csize)
        .expect("csum item");
    img.repack_leaf(&fs, CSUM_TREE_OBJECTID, k, |items| {
        let it = items.iter_mut().find(|(ik, _)| *ik == k).expect("item in leaf");
        let n = it.1.len() - csize;
        it.1.truncate(n);
    });
    expect_finding(&img, "csum", codes::CSUM_MISSING, true);
}

#[test]
fn corrupt_free_space_extent() {
    let mut img = Img::load("default");
    let fs = img.open();
    let fst = items(&fs, FREE_SPACE_TREE_OBJECTID);
    // A free extent not first in its leaf (so no parent key changes), >= 2 sectors.
    let (k, _) = fst
        .iter()
        .skip(1)
        .find(|(k, _)| {
            k.type_ == FREE_SPACE_EXTENT_KEY && k.offset >= 8192 && k.objectid >= 13631488
        })
        .cloned()
        .expect("free extent");
    img.repack_leaf(&fs, FREE_SPACE_TREE_OBJECTID, k, |items| {
        let it = items.iter_mut().find(|(ik, _)| *ik == k).expect("item in leaf");
        it.0.offset -= 4096;
    });
    expect_finding(&img, "fst-extent", codes::FST_FREE_MISMATCH, true);
}

#[test]
fn corrupt_free_space_info_count() {
    let mut img = Img::load("default");
    let fs = img.open();
    let (k, _) = items(&fs, FREE_SPACE_TREE_OBJECTID)
        .into_iter()
        .find(|(k, _)| k.type_ == FREE_SPACE_INFO_KEY && k.objectid >= 13631488)
        .expect("free space info");
    img.edit_item(&fs, FREE_SPACE_TREE_OBJECTID, k, |b| {
        put32(b, 0, u32::from_le_bytes(b[0..4].try_into().unwrap()) + 1)
    });
    expect_finding(&img, "fst-count", codes::FST_EXTENT_COUNT, true);
}

#[test]
fn corrupt_dev_bytes_used() {
    let mut img = Img::load("default");
    let fs = img.open();
    let k = Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, 1);
    img.edit_item(&fs, CHUNK_TREE_OBJECTID, k, |b| put64(b, 16, le64(b, 16) - (1 << 20)));
    expect_finding(&img, "dev-used", codes::DEV_BYTES_USED, true);
}

#[test]
fn corrupt_super_bytes_used() {
    let mut img = Img::load("default");
    let fs = img.open();
    img.edit_super(&fs, |sb| put64(sb, 120, le64(sb, 120) + 4096));
    expect_finding(&img, "super-used", codes::SUPER_BYTES_USED, true);
}

#[test]
fn corrupt_missing_dir_index() {
    let mut img = Img::load("default");
    let fs = img.open();
    // A DIR_INDEX that is not first in its leaf.
    let all = items(&fs, FS_TREE_OBJECTID);
    let (leaf_first, k) = all
        .iter()
        .filter(|(k, _)| k.type_ == DIR_INDEX_KEY)
        .map(|(k, _)| {
            let path = fs.search_slot(&tree_root(&fs, FS_TREE_OBJECTID), k).unwrap().into_path();
            (path.slot() == 0, *k)
        })
        .find(|(first, _)| !first)
        .expect("dir index");
    assert!(!leaf_first);
    img.repack_leaf(&fs, FS_TREE_OBJECTID, k, |items| items.retain(|(ik, _)| *ik != k));
    expect_finding(&img, "dir-index", codes::NAME_NO_DIR_INDEX, true);
}

#[test]
fn corrupt_pointer_generation() {
    let mut img = Img::load("default");
    let fs = img.open();
    // The FS tree root is a node (level 1): bump one pointer's generation.
    let root = tree_root(&fs, FS_TREE_OBJECTID);
    assert!(root.level > 0, "default fixture's fs tree root is a node");
    img.edit_block(&fs, root.bytenr, |buf| {
        let gen_off = HEADER_SIZE + 17 + 8;
        let g = le64(buf, gen_off);
        put64(buf, gen_off, g - 1);
    });
    expect_finding(&img, "ptr-gen", codes::GENERATION_MISMATCH, true);
}

#[test]
fn corrupt_key_order_across_leaves() {
    let mut img = Img::load("nodesize4k-xxhash");
    let fs = img.open();
    // Find two adjacent leaves whose boundary lies inside one directory's DIR_INDEX
    // run, and give the left leaf's last index the right leaf's first index offset:
    // still sorted inside the leaf (and DIR_INDEX keys carry no hash), but not below
    // the right leaf's first key.
    let mut it = fs.iter(&tree_root(&fs, FS_TREE_OBJECTID), Key::MIN).unwrap();
    let mut prev: Option<(Key, u64, usize)> = None;
    let mut target = None;
    while let Some(i) = it.next_item().unwrap() {
        let k = i.key();
        if let Some((pk, pleaf, pslot)) = prev {
            if pleaf != i.eb.bytenr
                && pk.type_ == DIR_INDEX_KEY
                && k.type_ == DIR_INDEX_KEY
                && pk.objectid == k.objectid
            {
                target = Some((pleaf, pslot, k.offset));
                break;
            }
        }
        prev = Some((k, i.eb.bytenr, i.slot));
    }
    let (leaf, slot, off) = target.expect("a DIR_INDEX run across two leaves");
    img.edit_block(&fs, leaf, |buf| put64(buf, HEADER_SIZE + slot * ITEM_SIZE + 9, off));
    expect_finding(&img, "key-order", codes::KEY_ORDER, true);
}

#[test]
fn corrupt_unreferenced_extent() {
    let mut img = Img::load("default");
    let fs = img.open();
    // Point a file extent one sector into its own extent: that address starts no
    // extent item, and the old extent loses its only reference.
    let fs_items = items(&fs, FS_TREE_OBJECTID);
    let refs1: std::collections::BTreeMap<u64, u64> = items(&fs, EXTENT_TREE_OBJECTID)
        .into_iter()
        .filter(|(k, d)| {
            k.type_ == EXTENT_ITEM_KEY && le64(d, 16) & EXTENT_FLAG_DATA != 0 && le64(d, 0) == 1
        })
        .map(|(k, _)| (k.objectid, k.offset))
        .collect();
    let (k, _) = fs_items
        .iter()
        .find(|(k, d)| {
            k.type_ == EXTENT_DATA_KEY
                && d.len() == 53
                && d[20] == FILE_EXTENT_REG
                && le64(d, 21) != 0
                && refs1.get(&le64(d, 21)).is_some_and(|&l| l > 4096)
        })
        .cloned()
        .expect("file extent of a multi-sector extent with one reference");
    img.edit_item(&fs, FS_TREE_OBJECTID, k, |b| {
        let d = le64(b, 21);
        put64(b, 21, d + 4096);
    });
    expect_finding(&img, "extent-ref", codes::EXTENT_ITEM_MISSING, true);
    let r = img.check();
    assert!(r.has(codes::EXTENT_UNREFERENCED), "old extent should be unreferenced");
}

/// Random bytes changed in random tree blocks (checksums fixed so the damage gets past
/// the checksum): the checker must finish without panicking, whatever it finds.
#[test]
fn random_damage_never_panics() {
    let base = Img::load("blake2");
    let fs = base.open();
    let nodesize = fs.nodesize as usize;
    let blocks: Vec<u64> = items(&fs, EXTENT_TREE_OBJECTID)
        .into_iter()
        .filter(|(k, _)| {
            k.type_ == METADATA_ITEM_KEY
                || k.type_ == EXTENT_ITEM_KEY && k.offset == nodesize as u64
        })
        .map(|(k, _)| k.objectid)
        .collect();
    drop(fs);
    let mut rng = 0x2545f4914f6cdd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    // UBTRFS_CHECK_FUZZ_ROUNDS raises the count for a longer local run.
    let rounds: usize =
        std::env::var("UBTRFS_CHECK_FUZZ_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(40);
    let mut damaged = 0;
    for round in 0..rounds {
        let mut img = Img { name: format!("blake2-r{round}"), devs: base.devs.clone() };
        let fs = img.open();
        let b = blocks[(next() % blocks.len() as u64) as usize];
        let n = 1 + next() % 4;
        let picks: Vec<(usize, u8)> =
            (0..n).map(|_| (32 + 16 + (next() as usize % (nodesize - 48)), next() as u8)).collect();
        img.edit_block(&fs, b, |buf| {
            for &(off, v) in &picks {
                buf[off] = v;
            }
        });
        drop(fs);
        let (tx, rx) = std::sync::mpsc::channel();
        let devs = img.devs.clone();
        std::thread::spawn(move || {
            let r = std::panic::catch_unwind(move || {
                let img = Img { name: String::new(), devs };
                let devs: Vec<Arc<dyn BlockDevice>> = img
                    .devs
                    .iter()
                    .enumerate()
                    .map(|(i, d)| {
                        Arc::new(MemDevice::new(d.clone(), i.to_string())) as Arc<dyn BlockDevice>
                    })
                    .collect();
                match FsInfo::open_devices(devs, 64 << 20) {
                    Ok(fs) => {
                        check(&fs, &CheckOptions::default()).map(|r| r.problems()).unwrap_or(1)
                    }
                    Err(_) => 1,
                }
            });
            let _ = tx.send(r);
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Ok(p)) => damaged += usize::from(p > 0),
            Ok(Err(_)) => panic!("round {round}: checker panicked on block {b} with {picks:?}"),
            Err(_) => panic!("round {round}: checker hung on block {b} with {picks:?}"),
        }
    }
    eprintln!("random damage: {damaged} of {rounds} rounds reported problems");
}

/// A loop mount, unmounted on drop (so a failing test does not leave it behind).
struct LoopMount(PathBuf);

impl LoopMount {
    fn new(img: &Path, dir: &Path) -> LoopMount {
        std::fs::create_dir_all(dir).expect("mount dir");
        let ok = Command::new("mount")
            .args(["-o", "loop"])
            .arg(img)
            .arg(dir)
            .status()
            .expect("run mount")
            .success();
        assert!(ok, "mount {} failed", img.display());
        LoopMount(dir.to_path_buf())
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// The fixtures have no free-space bitmaps; the kernel makes some when free space
/// fragments. Its image must be clean, and a flipped bitmap bit must be found.
#[test]
fn kernel_free_space_bitmaps() {
    if !common::kernel_available("kernel_free_space_bitmaps") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ubtrfs-check-bitmaps-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let img = dir.join("bitmaps.img");
    std::fs::File::create(&img).and_then(|f| f.set_len(1 << 30)).expect("image file");
    assert!(Command::new("mkfs.btrfs")
        .args(["-q", "-f"])
        .arg(&img)
        .output()
        .expect("mkfs")
        .status
        .success());
    {
        let m = LoopMount::new(&img, &dir.join("mnt"));
        let d = m.0.join("frag");
        std::fs::create_dir_all(&d).unwrap();
        let mut rng = 0x9e3779b97f4a7c15u64;
        for i in 0..600 {
            let block: Vec<u8> = (0..4096)
                .map(|_| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng as u8
                })
                .collect();
            std::fs::write(d.join(format!("f{i}")), block).unwrap();
        }
        assert!(Command::new("sync").status().unwrap().success());
        for i in (0..600).step_by(2) {
            std::fs::remove_file(d.join(format!("f{i}"))).unwrap();
        }
    }
    let fs = open_files(std::slice::from_ref(&img));
    let r = check(&fs, &CheckOptions { check_data_csum: true, ..CheckOptions::default() }).unwrap();
    for f in &r.findings {
        eprintln!("bitmaps: {f}");
    }
    assert!(r.is_clean(), "kernel-made bitmap image: {}", r.summary());
    let fst = items(&fs, FREE_SPACE_TREE_OBJECTID);
    let (bk, bits) = fst
        .iter()
        .find(|(k, d)| k.type_ == FREE_SPACE_BITMAP_KEY && d.iter().any(|&b| b != 0 && b != 0xff))
        .cloned()
        .expect("the kernel made a mixed bitmap");
    let mut edited = Img::from_files("bitmaps", std::slice::from_ref(&img));
    drop(fs);
    let fs = edited.open();
    let byte = bits.iter().position(|&b| b != 0 && b != 0xff).unwrap();
    edited.edit_item(&fs, FREE_SPACE_TREE_OBJECTID, bk, |b| {
        b[byte] ^= 1 << (b[byte].trailing_zeros().min(7))
    });
    expect_finding(&edited, "bitmap-bit", codes::FST_FREE_MISMATCH, true);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Quota groups: a kernel-made image with a snapshot sharing most extents and a
/// level-1 qgroup over both is clean; a changed `referenced` is found.
#[test]
fn kernel_quota_groups() {
    if !common::kernel_available("kernel_quota_groups") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ubtrfs-check-quota-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let img = dir.join("quota.img");
    std::fs::File::create(&img).and_then(|f| f.set_len(512 << 20)).expect("image file");
    assert!(Command::new("mkfs.btrfs")
        .args(["-q", "-f"])
        .arg(&img)
        .output()
        .expect("mkfs")
        .status
        .success());
    let run = |args: &[&str], m: &Path| {
        let out = Command::new("btrfs").args(args).arg(m).output().expect("run btrfs");
        assert!(out.status.success(), "btrfs {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    {
        let m = LoopMount::new(&img, &dir.join("mnt"));
        run(&["quota", "enable"], &m.0);
        run(&["subvolume", "create"], &m.0.join("sv"));
        for i in 0..200usize {
            std::fs::write(m.0.join("sv").join(format!("f{i}")), vec![i as u8; i * 97 % 9000 + 1])
                .unwrap();
        }
        assert!(Command::new("sync").status().unwrap().success());
        let out = Command::new("btrfs")
            .args(["subvolume", "snapshot"])
            .arg(m.0.join("sv"))
            .arg(m.0.join("snap"))
            .output()
            .unwrap();
        assert!(out.status.success());
        run(&["qgroup", "create", "1/100"], &m.0);
        for q in ["0/256", "0/257"] {
            let _ = Command::new("btrfs")
                .args(["qgroup", "assign", "--no-rescan", q, "1/100"])
                .arg(&m.0)
                .output();
        }
        run(&["quota", "rescan", "-w"], &m.0);
        for i in (0..200usize).step_by(7) {
            std::fs::write(m.0.join("sv").join(format!("f{i}")), vec![0xaa; 5000]).unwrap();
        }
        std::fs::remove_file(m.0.join("snap/f3")).unwrap();
    }
    let fs = open_files(std::slice::from_ref(&img));
    let r = check(&fs, &CheckOptions::default()).unwrap();
    for f in &r.findings {
        eprintln!("quota: {f}");
    }
    assert!(r.is_clean(), "kernel-made quota image: {}", r.summary());
    let (k, _) = items(&fs, QUOTA_TREE_OBJECTID)
        .into_iter()
        .find(|(k, _)| k.type_ == QGROUP_INFO_KEY && k.offset == 256)
        .expect("qgroup 0/256");
    let mut edited = Img::from_files("quota", std::slice::from_ref(&img));
    drop(fs);
    let fs = edited.open();
    edited.edit_item(&fs, QUOTA_TREE_OBJECTID, k, |b| put64(b, 8, le64(b, 8) + 4096));
    expect_finding(&edited, "qgroup", codes::QGROUP_MISMATCH, true);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Decompress or restore a corpus image into `dst` (cached).
fn corpus_image(src: &Path, dst: &Path) -> Option<()> {
    if dst.exists() {
        return Some(());
    }
    let name = src.file_name()?.to_str()?;
    let tmp = dst.with_extension("tmp");
    let ok = if name.ends_with(".raw.xz") {
        let out = std::fs::File::create(&tmp).ok()?;
        Command::new("xz").arg("-dc").arg(src).stdout(out).status().ok()?.success()
    } else if name.ends_with(".img.xz") {
        let img = dst.with_extension("meta");
        let out = std::fs::File::create(&img).ok()?;
        let ok = Command::new("xz").arg("-dc").arg(src).stdout(out).status().ok()?.success()
            && Command::new("btrfs-image")
                .arg("-r")
                .arg(&img)
                .arg(&tmp)
                .output()
                .ok()?
                .status
                .success();
        let _ = std::fs::remove_file(&img);
        ok
    } else if name.ends_with(".img") {
        Command::new("btrfs-image").arg("-r").arg(src).arg(&tmp).output().ok()?.status.success()
    } else {
        false
    };
    if !ok {
        let _ = std::fs::remove_file(&tmp);
        return None;
    }
    std::fs::rename(&tmp, dst).ok()
}

/// Informational: the btrfs-progs fsck corpus. Never fails on findings, only on a
/// panic or a hang of the checker.
#[test]
fn progs_corpus_no_panic() {
    let Some(dir) = common::corpus_dir().map(|d| d.join("fsck-images")) else {
        eprintln!("progs_corpus_no_panic: skipped: no btrfs-progs corpus");
        return;
    };
    let Ok(rd) = std::fs::read_dir(&dir) else {
        eprintln!("progs_corpus_no_panic: skipped: no {}", dir.display());
        return;
    };
    let cache = common::repo_root().join("target/check-corpus");
    std::fs::create_dir_all(&cache).expect("cache dir");
    let mut srcs: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    srcs.sort();
    let progs = progs_available();
    let (mut total, mut unusable) = (0, 0);
    let (mut both, mut progs_only, mut ours_only, mut neither) = (0, 0, 0, 0);
    let mut lines = Vec::new();
    for src in srcs {
        let name = src.file_name().unwrap().to_string_lossy().to_string();
        let stem = name.split('.').next().unwrap().to_string();
        if !(name.ends_with(".xz") || name.ends_with(".img")) || name.ends_with(".tar.xz") {
            continue;
        }
        total += 1;
        let raw = cache.join(format!("{stem}.raw"));
        if corpus_image(&src, &raw).is_none() {
            unusable += 1;
            lines.push(format!(
                "  ?   ?  {stem} (cannot decompress/restore: needs xz and btrfs-image)"
            ));
            continue;
        }
        // Run the checker on a thread so a hang is caught by a deadline.
        let (tx, rx) = std::sync::mpsc::channel();
        let p = raw.clone();
        std::thread::spawn(move || {
            let r = std::panic::catch_unwind(|| {
                match FsInfo::open(&ubtrfs_core::OpenOptions::new(&p)) {
                    Ok(fs) => match check(&fs, &CheckOptions::default()) {
                        Ok(r) => (
                            r.problems() > 0,
                            r.findings.first().map(|f| f.to_string()).unwrap_or_default(),
                        ),
                        Err(e) => (true, format!("check error: {e}")),
                    },
                    Err(e) => (true, format!("open error: {e}")),
                }
            });
            let _ = tx.send(r);
        });
        let ours = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(Ok(v)) => v,
            Ok(Err(_)) => panic!("{stem}: the checker panicked"),
            Err(_) => panic!("{stem}: the checker did not finish within 120 s"),
        };
        let theirs = if progs { Some(!progs_check(std::slice::from_ref(&raw)).0) } else { None };
        match (theirs, ours.0) {
            (Some(true), true) => both += 1,
            (Some(true), false) => progs_only += 1,
            (Some(false), true) => ours_only += 1,
            (Some(false), false) => neither += 1,
            (None, _) => {}
        }
        let t = match theirs {
            Some(true) => "bad",
            Some(false) => "ok ",
            None => " ? ",
        };
        lines.push(format!(
            "{t} {} {stem} {}",
            if ours.0 { "bad" } else { "ok " },
            ours.1.chars().take(110).collect::<String>()
        ));
    }
    eprintln!("btrfs check | ubtrfs check | image | first finding");
    for l in &lines {
        eprintln!("{l}");
    }
    eprintln!("corpus: {total} images, {unusable} unusable; btrfs check flags {} of which ubtrfs flags {both}; ubtrfs alone flags {ours_only}; both clean {neither}", both + progs_only);
}
