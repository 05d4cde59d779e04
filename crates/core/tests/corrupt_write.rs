//! Damaged images on the write path: bytes the tree checker accepts but that contradict
//! each other (two file extents naming one extent with two lengths, a file extent aimed
//! at a tree block, a block group fuller than its length, a device item using all of its
//! device, a free-space tree that calls a block in use free, counts that overflow) must
//! give a `Corrupt` error naming the object, never a panic; the failing change aborts
//! the writer to read-only, and nothing reaches the image.
//!
//! Each case makes a fresh `mkfs.btrfs` image (btrfs-progs' layout: one leaf per tree),
//! sets the scene through `FsWriter` and a commit where it can, damages one item by
//! patching its bytes on every copy with the checksum recomputed, then runs the write
//! operation that meets the damage and checks: an `Err` (not a panic) whose message
//! names the object, the writer read-only afterwards (naming the original failure), and
//! the image byte-identical to before.

mod common;
#[path = "../../../fuzz/src/walk.rs"]
mod walk;
#[path = "common/write.rs"]
mod write_common;

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use ubtrfs_core::disk_io::FsInfo;
use ubtrfs_core::inode::filesystem::InodeId;
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FsWriter;
use ubtrfs_core::TreeView;
use ubtrfs_core::{Error, OpenOptions, PosixKind};
use ubtrfs_format::key::*;
use ubtrfs_format::node::{HEADER_SIZE, ITEM_SIZE};
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;
use write_common::{Scratch, MIB};

/// Run one change in a transaction handle of its own.
fn in_handle<T>(
    w: &mut ubtrfs_core::FsWriter,
    f: impl FnOnce(&mut ubtrfs_core::transaction::TransHandle<'_>) -> ubtrfs_core::Result<T>,
) -> ubtrfs_core::Result<T> {
    let mut h = ubtrfs_core::transaction::Transaction::join_transaction(w, "free-space tree test")?;
    let r = f(&mut h);
    h.end_with(r)
}

const FS: u64 = FS_TREE_OBJECTID;
const ROOT_DIR: u64 = FIRST_FREE_OBJECTID;

fn fresh(tag: &str, args: &[&str]) -> Scratch {
    Scratch::mkfs(&format!("corrupt-write-{tag}"), 256 * MIB, args)
}

/// Where a leaf item sits: the block, its slot, and its copies (devid, physical).
struct Found {
    leaf: u64,
    slot: usize,
    key: Key,
    data: Vec<u8>,
    copies: Vec<(u64, u64)>,
    leaf_is_root: bool,
}

/// The leaf items of tree `root` for which `pred(key)` holds, in key order.
fn find_items(img: &Path, root: u64, pred: impl Fn(&Key) -> bool) -> Vec<Found> {
    let info = FsInfo::open(&OpenOptions::new(img)).expect("open image");
    let mut out = Vec::new();
    for b in walk::tree_blocks(&info)
        .expect("tree blocks")
        .into_iter()
        .filter(|b| b.level == 0 && b.root == root)
    {
        let eb = info.read_tree_block(b.bytenr, &Default::default()).expect("leaf");
        let n = eb.node();
        for slot in 0..n.nritems() {
            let key = n.key(slot);
            if pred(&key) {
                out.push(Found {
                    leaf: b.bytenr,
                    slot,
                    key,
                    data: n.item_data(slot).to_vec(),
                    copies: b.copies.clone(),
                    leaf_is_root: b.parent.is_none(),
                });
            }
        }
    }
    out.sort_by_key(|f| f.key);
    out
}

fn find_item(img: &Path, root: u64, key: Key) -> Found {
    find_items(img, root, |k| *k == key)
        .pop()
        .unwrap_or_else(|| panic!("tree {root} has no item {key}"))
}

/// Rewrite the leaf holding `f` on every copy: `edit(block, slot)` changes its bytes,
/// then the checksum is recomputed.
fn patch_leaf(img: &Path, f: &Found, edit: impl Fn(&mut [u8], usize)) {
    let (csum, nodesize) = {
        let info = FsInfo::open(&OpenOptions::new(img)).expect("open image");
        (info.csum_type, info.nodesize as usize)
    };
    let mut file =
        std::fs::OpenOptions::new().read(true).write(true).open(img).expect("open image file");
    for &(devid, phys) in &f.copies {
        assert_eq!(devid, 1, "single-device images only");
        let mut blk = vec![0u8; nodesize];
        file.seek(SeekFrom::Start(phys))
            .and_then(|_| file.read_exact(&mut blk))
            .expect("read leaf");
        edit(&mut blk, f.slot);
        walk::fix_block_csum(&mut blk, csum);
        file.seek(SeekFrom::Start(phys)).and_then(|_| file.write_all(&blk)).expect("write leaf");
    }
    file.sync_all().expect("sync image");
}

/// Byte offset of slot `slot`'s data inside its leaf.
fn body_at(blk: &[u8], slot: usize) -> usize {
    let at = HEADER_SIZE + slot * ITEM_SIZE + 17;
    HEADER_SIZE + u32::from_le_bytes(blk[at..at + 4].try_into().unwrap()) as usize
}

/// Overwrite `bytes` at `off` in the body of `f`'s item.
fn patch_body(img: &Path, f: &Found, off: usize, bytes: &[u8]) {
    patch_leaf(img, f, |blk, slot| {
        let b = body_at(blk, slot) + off;
        blk[b..b + bytes.len()].copy_from_slice(bytes);
    });
}

/// Give `f`'s item the key (objectid, its type, offset); the caller keeps keys sorted.
fn patch_key(img: &Path, f: &Found, objectid: u64, offset: u64) {
    assert!(
        f.leaf_is_root || f.slot > 0,
        "changing a first key would need the parent's key changed too"
    );
    patch_leaf(img, f, |blk, slot| {
        let at = HEADER_SIZE + slot * ITEM_SIZE;
        blk[at..at + 8].copy_from_slice(&objectid.to_le_bytes());
        blk[at + 9..at + 17].copy_from_slice(&offset.to_le_bytes());
    });
}

fn le64(d: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(d[at..at + 8].try_into().unwrap())
}

/// A regular file of `len` bytes in the top directory, committed; returns its ino.
fn file_with_data(w: &mut FsWriter, name: &str, len: usize, seed: u8) -> u64 {
    let ino =
        w.create_file(FS, ROOT_DIR, name.as_bytes(), &InodeAttrs::new(0o644)).expect("create file");
    let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    w.write_file(FS, ino, 0, &data).expect("write file");
    ino
}

/// (disk_bytenr, disk_num_bytes) of a regular file extent body.
fn extent_of(d: &[u8]) -> (u64, u64) {
    assert_eq!(d.len(), FILE_EXTENT_REG_SIZE, "a regular (not inline) file extent");
    assert_eq!(d[20], FILE_EXTENT_REG, "a regular file extent");
    (le64(d, 21), le64(d, 29))
}

/// The outcome of the operation that met the damage: an error, not a panic, that is
/// `Corrupt` (directly or under context) and contains every `needle`.
fn assert_corrupt(what: &str, r: Result<impl std::fmt::Debug, Error>, needles: &[&str]) -> String {
    let e = match r {
        Ok(v) => panic!("{what}: succeeded on a damaged image: {v:?}"),
        Err(e) => e,
    };
    let msg = e.to_string();
    eprintln!("{what}: {msg}");
    assert!(e.is_corrupt(), "{what}: not a Corrupt error: {msg}");
    for n in needles {
        assert!(msg.contains(n), "{what}: error does not name {n:?}: {msg}");
    }
    msg
}

/// After the failure: the writer is read-only, says why, and refuses the next change.
fn assert_aborted(what: &str, w: &mut FsWriter, original: &str) {
    let e = w.check_writable().expect_err("aborted writer still writable");
    assert_eq!(e.posix_kind(), Some(PosixKind::ReadOnly), "{what}: {e}");
    let msg = e.to_string();
    assert!(
        msg.contains(original),
        "{what}: the read-only error does not name the original failure {original:?}: {msg}"
    );
    let e = w
        .mkdir(FS, ROOT_DIR, b"after-the-abort", &InodeAttrs::new(0o755))
        .expect_err("a change after the abort");
    assert_eq!(e.posix_kind(), Some(PosixKind::ReadOnly), "{what}: a change after the abort: {e}");
    let e = w.commit().expect_err("a commit after the abort");
    assert_eq!(e.posix_kind(), Some(PosixKind::ReadOnly), "{what}: a commit after the abort: {e}");
}

/// Two files whose extents are then made to name one extent: file "a" (8 KiB) and
/// file "b" (4 KiB). Returns (a, b, a's extent, b's file extent item).
fn two_files(img: &Scratch) -> (u64, u64, (u64, u64), Found) {
    let mut w = img.writer();
    let a = file_with_data(&mut w, "a", 8192, 1);
    let b = file_with_data(&mut w, "b", 4096, 2);
    w.commit().expect("commit");
    drop(w);
    let fa = find_item(&img.path, FS, Key::new(a, EXTENT_DATA_KEY, 0));
    let fb = find_item(&img.path, FS, Key::new(b, EXTENT_DATA_KEY, 0));
    let ea = extent_of(&fa.data);
    assert_eq!(ea.1, 8192);
    assert_eq!(extent_of(&fb.data).1, 4096);
    (a, b, ea, fb)
}

/// Two file extents name one disk_bytenr with different disk_num_bytes: dropping both
/// in one transaction met `assert_eq!(h.num_bytes, num_bytes)` in `DelayedRefs::head`.
#[test]
fn one_extent_with_two_lengths() {
    let img = fresh("two-lengths", &[]);
    let (a, b, (bytenr, _), fb) = two_files(&img);
    patch_body(&img.path, &fb, 21, &bytenr.to_le_bytes());
    let before = img.sha256();
    let mut w = img.writer();
    w.drop_extents(InodeId { root: FS, ino: a }, 0, 8192).expect("drop the first reference");
    let r = w.drop_extents(InodeId { root: FS, ino: b }, 0, 4096);
    let msg = assert_corrupt(
        "drop the second reference",
        r,
        &[&format!("root=5 ino={b}"), &format!("extent {bytenr} ")],
    );
    assert!(msg.contains("4096") && msg.contains("8192"), "the two lengths: {msg}");
    assert_aborted("two lengths", &mut w, &msg);
    drop(w);
    assert_eq!(img.sha256(), before, "the image changed");
}

/// A file extent aimed at the leaf that holds it: dropping it COWs that leaf (a tree
/// reference change) and then drops a data reference to the same bytenr, which met
/// `assert_eq!(h.is_data, is_data)` in `DelayedRefs::head`.
#[test]
fn file_extent_aimed_at_a_tree_block() {
    let img = fresh("at-tree-block", &[]);
    let (_, b, _, fb) = two_files(&img);
    assert!(fb.leaf_is_root, "a fresh image's fs tree is one leaf");
    let leaf = fb.leaf;
    let nodesize = u64::from(FsInfo::open(&OpenOptions::new(&img.path)).expect("open").nodesize);
    patch_body(&img.path, &fb, 21, &[leaf.to_le_bytes(), nodesize.to_le_bytes()].concat());
    let before = img.sha256();
    let mut w = img.writer();
    let r = w.drop_extents(InodeId { root: FS, ino: b }, 0, 4096);
    let msg = assert_corrupt(
        "drop the file extent",
        r,
        &[&format!("root=5 ino={b}"), &format!("extent {leaf} "), "tree block"],
    );
    assert_aborted("file extent at a tree block", &mut w, &msg);
    drop(w);
    assert_eq!(img.sha256(), before, "the image changed");
}

/// The METADATA block group's item says it is full (used == length, which the tree
/// checker allows) while the free-space tree has room: the commit that inserts the
/// new blocks' extent items met `assert!(g.used <= g.length)` in `update_used`.
#[test]
fn block_group_fuller_than_its_length() {
    let img = fresh("bg-full", &[]);
    let items = find_items(&img.path, EXTENT_TREE_OBJECTID, |k| k.type_ == BLOCK_GROUP_ITEM_KEY);
    let bg = items
        .iter()
        .find(|f| le64(&f.data, 16) & BLOCK_GROUP_METADATA != 0)
        .expect("a metadata block group item");
    let (start, length) = (bg.key.objectid, bg.key.offset);
    patch_body(&img.path, bg, 0, &length.to_le_bytes());
    let before = img.sha256();
    let mut w = img.writer();
    // Enough new directories that the fs tree grows by several leaves: the commit
    // allocates more tree blocks than it frees.
    for i in 0..300 {
        w.mkdir(FS, ROOT_DIR, format!("d{i:04}").as_bytes(), &InodeAttrs::new(0o755))
            .expect("mkdir");
    }
    let r = w.commit();
    let msg = assert_corrupt(
        "commit",
        r,
        &[&format!("block group {start} "), &format!("length {length}"), "BLOCK_GROUP_ITEM"],
    );
    assert_aborted("block group full", &mut w, &msg);
    drop(w);
    assert_eq!(img.sha256(), before, "the image changed");
}

/// The device item says every byte of the device is allocated (bytes_used ==
/// total_bytes, allowed), but the dev tree has holes: a new chunk makes bytes_used
/// exceed total_bytes, which the write-time tree checker refuses, and that was
/// `panic!("about to write an invalid tree block")` in `write_dirty_blocks`.
#[test]
fn write_time_check_refuses_a_device_item_past_its_device() {
    let img = fresh("dev-item-full", &[]);
    let dev =
        find_item(&img.path, CHUNK_TREE_OBJECTID, Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, 1));
    let total = le64(&dev.data, 8);
    patch_body(&img.path, &dev, 16, &total.to_le_bytes());
    let before = img.sha256();
    let mut w = img.writer();
    w.mkdir(FS, ROOT_DIR, b"d", &InodeAttrs::new(0o755)).expect("mkdir");
    in_handle(&mut w, |h| ubtrfs_core::space::chunk_alloc::alloc_chunk(h, BLOCK_GROUP_METADATA))
        .expect("allocate a chunk");
    let r = w.commit();
    let msg = assert_corrupt(
        "commit",
        r,
        &["write time tree block corruption detected", "root=3", "DEV_ITEM", "bytes used"],
    );
    assert_aborted("device item past its device", &mut w, &msg);
    drop(w);
    assert_eq!(img.sha256(), before, "the image changed: a block or a superblock was written");
}

/// An item the tree API accepted but the tree checker does not (an inode item of the
/// wrong size): the commit refuses to write it, as the kernel's write-time checker
/// does, instead of panicking.
#[test]
fn write_time_check_refuses_a_bad_item_from_the_tree_api() {
    let img = fresh("bad-item", &[]);
    let before = img.sha256();
    let mut w = img.writer();
    w.mkdir(FS, ROOT_DIR, b"d", &InodeAttrs::new(0o755)).expect("mkdir");
    w.raw_tree()
        .insert_item(FS, &Key::new(100_000, INODE_ITEM_KEY, 0), &[0u8; 10])
        .expect("insert a short inode item");
    let r = w.commit();
    let msg = assert_corrupt(
        "commit",
        r,
        &["write time tree block corruption detected", "root=5", "(100000 INODE_ITEM 0)", "inode"],
    );
    assert_aborted("bad item", &mut w, &msg);
    drop(w);
    assert_eq!(img.sha256(), before, "the image changed: a block or a superblock was written");
}

/// The metadata group's free-space-tree INFO says its bitmaps (or extents) hold more
/// free runs than they do: converting them met `assert_eq!(count, runs.len())` in
/// `convert_to_extents`. Now the group's caching refuses the count first, as the
/// kernel's load does (the conversions keep their own check).
#[test]
fn free_space_extent_count_disagrees_with_the_tree() {
    for to_bitmaps in [false, true] {
        let what = if to_bitmaps { "convert to bitmaps" } else { "convert to extents" };
        let img = fresh(if to_bitmaps { "fst-count-bitmaps" } else { "fst-count-extents" }, &[]);
        let items =
            find_items(&img.path, EXTENT_TREE_OBJECTID, |k| k.type_ == BLOCK_GROUP_ITEM_KEY);
        let bg = items
            .iter()
            .find(|f| le64(&f.data, 16) & BLOCK_GROUP_METADATA != 0)
            .expect("a metadata block group item");
        let (start, length) = (bg.key.objectid, bg.key.offset);
        if !to_bitmaps {
            let mut w = img.writer();
            in_handle(&mut w, |h| {
                ubtrfs_core::space::free_space_tree::convert_to_bitmaps(h, start, length)
            })
            .expect("convert to bitmaps");
            w.commit().expect("commit");
        }
        let info = find_item(
            &img.path,
            FREE_SPACE_TREE_OBJECTID,
            Key::new(start, FREE_SPACE_INFO_KEY, length),
        );
        let count = u32::from_le_bytes(info.data[0..4].try_into().unwrap());
        let flags = u32::from_le_bytes(info.data[4..8].try_into().unwrap());
        assert_eq!(flags & FREE_SPACE_USING_BITMAPS != 0, !to_bitmaps, "{what}: format before");
        patch_body(&img.path, &info, 0, &(count + 7).to_le_bytes());
        let before = img.sha256();
        let mut w = img.writer();
        // Convert at the next change of the group's extent count.
        w.hooks.fst_thresholds_override =
            Some(if to_bitmaps { (0, 0) } else { (u32::MAX, u32::MAX) });
        for i in 0..50 {
            w.mkdir(FS, ROOT_DIR, format!("d{i}").as_bytes(), &InodeAttrs::new(0o755))
                .expect("mkdir");
        }
        let r = w.commit();
        let msg = assert_corrupt(
            what,
            r,
            &[
                &format!("block group {start}"),
                "root=10",
                "incorrect extent count",
                "FREE_SPACE_INFO",
            ],
        );
        assert_aborted(what, &mut w, &msg);
        drop(w);
        assert_eq!(img.sha256(), before, "{what}: the image changed");
    }
}

/// A data group whose INFO extent count disagrees with its EXTENT items is refused
/// when it is cached, as the kernel's load refuses it, naming the group and the item;
/// nothing is written.
#[test]
fn caching_refuses_a_wrong_free_space_extent_count() {
    let img = fresh("fst-count-caching", &[]);
    let items = find_items(&img.path, EXTENT_TREE_OBJECTID, |k| k.type_ == BLOCK_GROUP_ITEM_KEY);
    let bg = items
        .iter()
        .find(|f| le64(&f.data, 16) & BLOCK_GROUP_DATA != 0)
        .expect("a data block group item");
    let (start, length) = (bg.key.objectid, bg.key.offset);
    let info = find_item(
        &img.path,
        FREE_SPACE_TREE_OBJECTID,
        Key::new(start, FREE_SPACE_INFO_KEY, length),
    );
    let count = u32::from_le_bytes(info.data[0..4].try_into().unwrap());
    patch_body(&img.path, &info, 0, &(count + 1).to_le_bytes());
    let before = img.sha256();
    let mut w = img.writer();
    let r = ubtrfs_core::space::allocator::cache_block_group(&mut w, start);
    assert_corrupt(
        "caching",
        r,
        &[
            &format!("incorrect extent count for block group {start}"),
            &format!("counted {count}, expected {}", count + 1),
            "FREE_SPACE_INFO",
        ],
    );
    drop(w);
    assert_eq!(img.sha256(), before, "the image changed");
}

/// Mark tree block `y` free in the free-space tree by widening the free extent that
/// starts after it down to it (every byte between must be in use). The widened extent
/// is the group's largest, so the allocator hands `y` out first.
fn mark_block_free(img: &Path, y: u64) {
    let free = find_items(img, FREE_SPACE_TREE_OBJECTID, |k| k.type_ == FREE_SPACE_EXTENT_KEY);
    let i = free.iter().position(|f| f.key.objectid > y).expect("a free extent after the block");
    if i > 0 {
        let p = &free[i - 1].key;
        assert!(p.objectid + p.offset <= y, "free extent {p} covers block {y} already");
    }
    let f = &free[i];
    let (b, l) = (f.key.objectid, f.key.offset);
    let infos = find_items(img, FREE_SPACE_TREE_OBJECTID, |k| {
        k.type_ == FREE_SPACE_INFO_KEY && k.objectid <= y && y < k.objectid + k.offset
    });
    let g = infos.first().expect("the block's group").key;
    assert!(b < g.objectid + g.offset, "free extent {} is in the block's group", f.key);
    let largest = free
        .iter()
        .filter(|e| e.key.objectid >= g.objectid && e.key.objectid < g.objectid + g.offset)
        .map(|e| e.key.offset)
        .max()
        .unwrap_or(0);
    assert_eq!(largest, l, "the free extent after block {y} is the group's largest");
    patch_key(img, f, y, l + (b - y));
}

/// The free-space tree calls the root tree's leaf free, and the first block this
/// transaction allocates is the copy of that very leaf: the COW was handed the block it
/// copies, so freeing the old block dropped the new one, and changing it met
/// `panic!("block {bytenr} modified without being COWed first")`.
#[test]
fn cow_handed_the_block_it_copies() {
    let img = fresh("cow-onto-itself", &[]);
    let root_leaf = FsInfo::open(&OpenOptions::new(&img.path)).expect("open").tree_root().bytenr;
    mark_block_free(&img.path, root_leaf);
    let before = img.sha256();
    let mut w = img.writer();
    w.set_subvol_readonly(FS, true).expect("flag the top subvolume read-only");
    let r = w.commit();
    let msg =
        assert_corrupt("commit", r, &[&format!("block={root_leaf}"), "root=1", "free space tree"]);
    assert_aborted("cow onto itself", &mut w, &msg);
    drop(w);
    assert_eq!(img.sha256(), before, "the image changed");
}

/// The free-space tree calls the root tree's leaf free and a COW of the fs tree gets
/// it; reading the root tree then finds our new block where the superblock says the
/// committed leaf is.
#[test]
fn block_in_use_allocated_again() {
    let img = fresh("in-use-again", &[]);
    let root_leaf = FsInfo::open(&OpenOptions::new(&img.path)).expect("open").tree_root().bytenr;
    mark_block_free(&img.path, root_leaf);
    let before = img.sha256();
    let mut w = img.writer();
    w.mkdir(FS, ROOT_DIR, b"d", &InodeAttrs::new(0o755)).expect("mkdir");
    let r = w.commit();
    let msg = assert_corrupt("commit", r, &[&format!("block={root_leaf}"), "free space tree"]);
    assert_aborted("in use, allocated again", &mut w, &msg);
    drop(w);
    assert_eq!(img.sha256(), before, "the image changed");
}

/// The free-space tree calls a leaf of a tree nothing touches (the data reloc tree)
/// free: the transaction never reads it, so the damage shows when the new block's
/// extent item is inserted where the old one still is.
#[test]
fn block_of_an_untouched_tree_allocated_again() {
    let img = fresh("untouched-again", &[]);
    let leaf = {
        let info = FsInfo::open(&OpenOptions::new(&img.path)).expect("open");
        info.read_root(DATA_RELOC_TREE_OBJECTID).expect("data reloc tree").0.bytenr
    };
    mark_block_free(&img.path, leaf);
    let before = img.sha256();
    let mut w = img.writer();
    w.mkdir(FS, ROOT_DIR, b"d", &InodeAttrs::new(0o755)).expect("mkdir");
    let r = w.commit();
    assert_corrupt("commit", r, &[&format!("{leaf}"), "free space tree"]);
    assert!(w.check_writable().is_err(), "aborted");
    drop(w);
    assert_eq!(img.sha256(), before, "the image changed");
}

/// A free-space-tree extent whose length runs past the end of the address space: the
/// writer's open summed start and length (an overflow panic in debug builds). The item
/// is read when its group (the metadata group) is cached, as in the kernel, so the open
/// succeeds and the first tree-block allocation meets it; with no room for another
/// chunk, the damaged group was the only space, and its error is returned.
#[test]
fn free_space_extent_past_the_address_space() {
    let img = fresh("fst-overflow", &[]);
    let free =
        find_items(&img.path, FREE_SPACE_TREE_OBJECTID, |k| k.type_ == FREE_SPACE_EXTENT_KEY);
    let f = free.last().expect("a free extent");
    patch_key(&img.path, f, f.key.objectid, u64::MAX - 4095);
    let before = img.sha256();
    let mut w = FsWriter::open(&OpenOptions::new(&img.path))
        .expect("open for writing: no group is cached yet");
    w.hooks.refuse_chunk_alloc = true;
    let r = w.mkdir(FS, ROOT_DIR, b"d", &InodeAttrs::new(0o755));
    let msg = assert_corrupt(
        "first metadata allocation",
        r,
        &["root=10", &format!("free space {}", f.key.objectid), "caching block group"],
    );
    assert_aborted("first metadata allocation", &mut w, &msg);
    drop(w);
    assert_eq!(img.sha256(), before, "the image changed");
}

/// A dev extent whose length runs past the end of the address space: looking for room
/// for a new chunk summed offset and length (an overflow panic in debug builds).
#[test]
fn dev_extent_past_the_address_space() {
    let img = fresh("dev-extent-overflow", &[]);
    let de = find_items(&img.path, DEV_TREE_OBJECTID, |k| k.type_ == DEV_EXTENT_KEY);
    let f = de.last().expect("a dev extent");
    patch_body(&img.path, f, 24, &(u64::MAX - 4095).to_le_bytes());
    let before = img.sha256();
    let mut w = img.writer();
    let r = in_handle(&mut w, |h| {
        ubtrfs_core::space::chunk_alloc::alloc_chunk(h, BLOCK_GROUP_METADATA)
    });
    assert_corrupt("allocate a chunk", r, &["root=4", "DEV_EXTENT", &format!("{}", f.key.offset)]);
    drop(w);
    assert_eq!(img.sha256(), before, "the image changed");
}

/// A device item whose sizes sit at the top of the address space: adding a new chunk's
/// stripes to bytes_used overflowed (a panic in debug builds).
#[test]
fn device_bytes_used_overflow() {
    let img = fresh("dev-used-overflow", &[]);
    let dev =
        find_item(&img.path, CHUNK_TREE_OBJECTID, Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, 1));
    let huge = u64::MAX - 4095;
    patch_body(&img.path, &dev, 8, &[huge.to_le_bytes(), huge.to_le_bytes()].concat());
    let before = img.sha256();
    let mut w = img.writer();
    let r = in_handle(&mut w, |h| {
        ubtrfs_core::space::chunk_alloc::alloc_chunk(h, BLOCK_GROUP_METADATA)
    });
    assert_corrupt("allocate a chunk", r, &["root=3", "DEV_ITEM", "bytes used"]);
    drop(w);
    assert_eq!(img.sha256(), before, "the image changed");
}

/// An extent item whose reference count is i64::MAX: one more reference overflowed the
/// signed sum in `update_extent` (a panic in debug builds).
#[test]
fn extent_reference_count_overflow() {
    let img = fresh("refs-overflow", &[]);
    let mut w = img.writer();
    let a = file_with_data(&mut w, "a", 3 * 4096, 1);
    w.commit().expect("commit");
    drop(w);
    let (bytenr, len) = extent_of(&find_item(&img.path, FS, Key::new(a, EXTENT_DATA_KEY, 0)).data);
    let ei = find_item(&img.path, EXTENT_TREE_OBJECTID, Key::new(bytenr, EXTENT_ITEM_KEY, len));
    patch_body(&img.path, &ei, 0, &(i64::MAX as u64).to_le_bytes());
    let before = img.sha256();
    let mut w = img.writer();
    // Punching the middle out splits the file extent: the extent gains a reference.
    w.drop_extents(InodeId { root: FS, ino: a }, 4096, 8192).expect("punch a hole");
    let r = w.commit();
    let msg = assert_corrupt("commit", r, &[&format!("extent {bytenr}"), "reference"]);
    assert_aborted("reference count overflow", &mut w, &msg);
    drop(w);
    assert_eq!(img.sha256(), before, "the image changed");
}

/// With quotas on, a commit that recounts every qgroup: two file extents each claiming
/// 2^63 bytes overflowed the sum (a panic in debug builds).
#[test]
fn qgroup_count_overflow() {
    let img = fresh("qgroup-overflow", &["-R", "quota"]);
    let mut w = img.writer();
    let a = file_with_data(&mut w, "a", 4096, 1);
    let b = file_with_data(&mut w, "b", 4096, 2);
    w.commit().expect("commit");
    drop(w);
    for ino in [a, b] {
        let f = find_item(&img.path, FS, Key::new(ino, EXTENT_DATA_KEY, 0));
        patch_body(&img.path, &f, 29, &(1u64 << 63).to_le_bytes());
    }
    let before = img.sha256();
    let mut w = img.writer();
    // The incremental accounting would not look at the untouched extents; the recount does.
    w.hooks.qgroup_full_recount = true;
    w.mkdir(FS, ROOT_DIR, b"d", &InodeAttrs::new(0o755)).expect("mkdir");
    let r = w.commit();
    let msg = assert_corrupt("commit", r, &["qgroup", "root=5"]);
    assert_aborted("qgroup overflow", &mut w, &msg);
    drop(w);
    assert_eq!(img.sha256(), before, "the image changed");
}

/// Set the generation of every superblock copy of `img` (checksums recomputed).
fn patch_super_generation(img: &Path, generation: u64) {
    let at = core::mem::offset_of!(Superblock, generation);
    let mut file =
        std::fs::OpenOptions::new().read(true).write(true).open(img).expect("open image file");
    let size = file.metadata().expect("image size").len();
    for m in 0..SUPER_MIRROR_MAX {
        let off = sb_offset(m);
        if off + SUPER_INFO_SIZE as u64 > size {
            break;
        }
        let mut sb = vec![0u8; SUPER_INFO_SIZE];
        file.seek(SeekFrom::Start(off))
            .and_then(|_| file.read_exact(&mut sb))
            .expect("read superblock");
        sb[at..at + 8].copy_from_slice(&generation.to_le_bytes());
        walk::fix_super_csum(&mut sb);
        file.seek(SeekFrom::Start(off))
            .and_then(|_| file.write_all(&sb))
            .expect("write superblock");
    }
    file.sync_all().expect("sync image");
}

/// A superblock at the last generation: no transaction can follow it (the writer's
/// next transid overflowed), and one before the last allows one commit, not two.
#[test]
fn generation_at_the_end_of_the_counter() {
    let img = fresh("last-generation", &[]);
    patch_super_generation(&img.path, u64::MAX);
    let r = FsWriter::open(&OpenOptions::new(&img.path));
    let e = r.map(|_| ()).expect_err("open for writing at the last generation");
    eprintln!("open for writing at generation {}: {e}", u64::MAX);
    assert!(e.to_string().contains(&u64::MAX.to_string()), "names the generation: {e}");
    // The root tree's leaf carries the superblock's generation: both move.
    let img = fresh("next-to-last-generation", &[]);
    let root_leaf =
        find_items(&img.path, ROOT_TREE_OBJECTID, |_| true).pop().expect("a root tree item");
    assert!(root_leaf.leaf_is_root, "a fresh image's root tree is one leaf");
    let at = core::mem::offset_of!(Header, generation);
    patch_leaf(&img.path, &root_leaf, |blk, _| {
        blk[at..at + 8].copy_from_slice(&(u64::MAX - 1).to_le_bytes())
    });
    patch_super_generation(&img.path, u64::MAX - 1);
    let mut w = img.writer();
    w.mkdir(FS, ROOT_DIR, b"d", &InodeAttrs::new(0o755)).expect("mkdir");
    let before = img.sha256();
    let r = w.commit();
    let e = r.expect_err("a commit that leaves no next generation");
    eprintln!("commit at generation {}: {e}", u64::MAX);
    assert!(e.to_string().contains(&u64::MAX.to_string()), "names the generation: {e}");
    assert_aborted("last generation", &mut w, &e.to_string());
    drop(w);
    assert_eq!(img.sha256(), before, "the image changed");
}
