//! The free-space cache loads per block group on first use (the kernel's caching),
//! not for every group at open.
//!
//! The images are made at test time by `mkfs.btrfs` and the kernel (root only): a
//! sparse 32 GiB image on which the kernel preallocates 12,288 extents of 1 MiB in one
//! file and punches every other one out, leaving about 13 data block groups with a
//! free-space tree of thousands of extents. Against them: a writable open caches
//! nothing, one small write caches only the groups it touched and the image passes
//! `btrfs check` and mounts; a group cached on first use holds exactly what the old
//! eager open loaded, in both free-space-tree formats; damage in a group nothing uses
//! does not fail the open or the writes, and is reported when the group is cached.

mod common;
#[path = "../../../fuzz/src/walk.rs"]
mod walk;
#[path = "common/write.rs"]
mod write_common;

use std::io::{Read, Seek, SeekFrom, Write};
use std::process::Command;
use ubtrfs_core::disk_io::FsInfo;
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::space::allocator::{cache_block_group, CachingState};
use ubtrfs_core::space::free_space_tree::convert_to_bitmaps;
use ubtrfs_core::FsWriter;
use ubtrfs_core::OpenOptions;
use ubtrfs_format::key::*;
use ubtrfs_format::node::{HEADER_SIZE, ITEM_SIZE};
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;
use write_common::{Mount, Scratch, MIB};

/// Run one free-space-tree change in a transaction handle of its own.
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
const GIB: u64 = 1 << 30;

/// The kernel's fragmented many-group image (see the module comment).
fn many_groups(tag: &str) -> Scratch {
    let img = Scratch::mkfs(&format!("caching-{tag}"), 32 * GIB, &[]);
    let m = Mount::new(&img.path, true);
    let file = m.path("prealloc");
    let mut falloc: Vec<String> = Vec::new();
    for i in 0..12_288u64 {
        falloc.extend(["-c".into(), format!("falloc {}m 1m", i)]);
    }
    let mut punch: Vec<String> = Vec::new();
    for i in (0..12_288u64).step_by(2) {
        punch.extend(["-c".into(), format!("fpunch {}m 1m", i)]);
    }
    for (what, args) in [("falloc", &falloc), ("fpunch", &punch)] {
        let out =
            Command::new("xfs_io").arg("-f").args(args).arg(&file).output().expect("run xfs_io");
        assert!(out.status.success(), "xfs_io {what}: {}", String::from_utf8_lossy(&out.stderr));
    }
    m.umount();
    img
}

/// Every block group: (start, length, flags).
fn groups(img: &Scratch) -> Vec<(u64, u64, u64)> {
    let info = FsInfo::open(&OpenOptions::new(&img.path)).expect("open");
    info.block_groups()
        .expect("block groups")
        .into_iter()
        .map(|g| (g.start, g.length, g.flags))
        .collect()
}

fn data_groups(img: &Scratch) -> Vec<(u64, u64)> {
    groups(img).into_iter().filter(|g| g.2 & BLOCK_GROUP_DATA != 0).map(|g| (g.0, g.1)).collect()
}

/// The disk_bytenr of the first file extent of `ino`.
fn first_extent(w: &mut FsWriter, ino: u64) -> u64 {
    let items = w
        .items_in_range(
            FS,
            &Key::new(ino, EXTENT_DATA_KEY, 0),
            &Key::new(ino, EXTENT_DATA_KEY, u64::MAX),
        )
        .expect("file extents");
    let (_, d) = items.first().expect("a file extent");
    assert_eq!(d[20], FILE_EXTENT_REG, "a regular extent");
    u64::from_le_bytes(d[21..29].try_into().unwrap())
}

#[test]
fn small_write_caches_only_the_groups_it_touches() {
    if !common::kernel_available("small_write_caches_only_the_groups_it_touches") {
        return;
    }
    let img = many_groups("small-write");
    let all = groups(&img);
    let data = data_groups(&img);
    assert!(data.len() >= 12, "{} data groups, 12 or more expected", data.len());
    let mut w = img.writer();
    assert!(w.cached_block_groups().is_empty(), "the open cached {:?}", w.cached_block_groups());
    for &(s, _, _) in &all {
        assert_eq!(
            w.block_group(s).expect("group").caching_state(),
            CachingState::No,
            "group {s} at open"
        );
    }
    let body: Vec<u8> = (0..64 * 1024u32).map(|i| (i % 251) as u8).collect();
    let ino = w.create_file(FS, ROOT_DIR, b"small", &InodeAttrs::new(0o644)).expect("create");
    w.write_file(FS, ino, 0, &body).expect("write");
    w.commit().expect("commit");
    w.check_allocator();
    let bytenr = first_extent(&mut w, ino);
    let cached = w.cached_block_groups();
    eprintln!("{} groups, cached after one write: {cached:?}", all.len());
    // The first data group has free space, so the data extent is there and no other
    // data group was needed; the tree blocks come from the metadata group.
    assert!(
        bytenr >= data[0].0 && bytenr < data[0].0 + data[0].1,
        "extent {bytenr} outside the first data group {:?}",
        data[0]
    );
    let cached_data: Vec<u64> =
        cached.iter().copied().filter(|s| data.iter().any(|d| d.0 == *s)).collect();
    assert_eq!(cached_data, vec![data[0].0], "cached data groups");
    for s in &cached {
        let flags = all.iter().find(|g| g.0 == *s).expect("a group").2;
        assert!(
            flags & BLOCK_GROUP_DATA != 0 || flags & BLOCK_GROUP_METADATA != 0,
            "group {s} ({flags:#x}) cached"
        );
    }
    assert!(cached.len() <= 2, "cached {cached:?}");
    for &(s, _) in &data[1..] {
        assert_eq!(
            w.block_group(s).expect("group").caching_state(),
            CachingState::No,
            "data group {s} after the write"
        );
    }
    drop(w);
    write_common::assert_check(&img.path, "after one small write");
    let m = Mount::new(&img.path, false);
    assert_eq!(
        std::fs::read(m.path("small")).expect("read through the kernel"),
        body,
        "the kernel reads the file"
    );
    m.umount();
}

#[test]
fn lazy_cache_equals_the_eager_load() {
    if !common::kernel_available("lazy_cache_equals_the_eager_load") {
        return;
    }
    let img = many_groups("lazy-vs-eager");
    let all = groups(&img);
    let data = data_groups(&img);
    // Every third data group in bitmaps, the others in extents.
    let mut w = img.writer();
    for &(s, l) in data.iter().skip(1).step_by(3) {
        in_handle(&mut w, |h| convert_to_bitmaps(h, s, l)).expect("convert to bitmaps");
    }
    w.commit().expect("commit");
    drop(w);
    write_common::assert_check(&img.path, "after converting groups to bitmaps");
    // The eager load's caches, then one group after another cached lazily in a second
    // writer (one writer at a time holds the image).
    type Snapshot =
        (Vec<(u64, u64)>, Vec<ubtrfs_core::space::free_space_cache::EntryInfo>, u64, u64, u64);
    let snap = |c: &ubtrfs_core::space::free_space_cache::FreeSpaceCtl| -> Snapshot {
        (c.free_ranges(), c.entries(), c.free_space(), c.free_extents(), c.total_bitmaps())
    };
    let eager: Vec<Snapshot> = {
        let mut w = img.writer();
        w.cache_all_block_groups_eagerly().expect("eager load");
        w.check_allocator();
        all.iter()
            .map(|g| snap(w.block_group(g.0).expect("group").ctl().expect("cached eagerly")))
            .collect()
    };
    let mut lazy = img.writer();
    let mut formats = [0usize; 2];
    for (i, &(s, l, _)) in all.iter().enumerate() {
        let counted = lazy.block_group(s).expect("group").free_space();
        cache_block_group(&mut lazy, s).expect("cache the group");
        for (j, &(o, _, _)) in all.iter().enumerate() {
            let want = if j <= i { CachingState::Finished } else { CachingState::No };
            assert_eq!(
                lazy.block_group(o).expect("group").caching_state(),
                want,
                "group {o} after caching {s}"
            );
        }
        lazy.check_allocator();
        let got = snap(lazy.block_group(s).expect("group").ctl().expect("cached"));
        let want = &eager[i];
        assert_eq!(got.0, want.0, "group {s}: free ranges");
        assert_eq!(got.1, want.1, "group {s}: cache entries");
        assert_eq!(
            (got.2, got.3, got.4),
            (want.2, want.3, want.4),
            "group {s}: free space, extent entries, bitmap entries"
        );
        // The counters an uncached group answers with agree with its cache.
        assert_eq!(counted, got.2, "group {s}: free space counted before caching");
        let info = lazy
            .items_in_range(
                FREE_SPACE_TREE_OBJECTID,
                &Key::new(s, FREE_SPACE_INFO_KEY, l),
                &Key::new(s, FREE_SPACE_INFO_KEY, l),
            )
            .expect("INFO");
        let bitmaps =
            u32::from_le_bytes(info[0].1[4..8].try_into().unwrap()) & FREE_SPACE_USING_BITMAPS != 0;
        assert_eq!(
            lazy.fst_cached_bitmaps(s),
            Some(bitmaps),
            "group {s}: format flag filled by caching"
        );
        if got.0.len() > 1 {
            formats[usize::from(bitmaps)] += 1;
        }
    }
    eprintln!("{} groups compared; fragmented in extents, in bitmaps: {formats:?}", all.len());
    assert!(
        formats[0] >= 2 && formats[1] >= 2,
        "fragmented groups compared (extents, bitmaps): {formats:?}"
    );
}

/// Rewrite the leaf holding FREE_SPACE_TREE item `key` on every copy with its key's
/// offset set to `offset` (the checksum recomputed).
fn patch_fst_key_offset(img: &Scratch, key: Key, offset: u64) {
    let info = FsInfo::open(&OpenOptions::new(&img.path)).expect("open");
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&img.path)
        .expect("open image file");
    let mut done = false;
    for b in walk::tree_blocks(&info)
        .expect("tree blocks")
        .into_iter()
        .filter(|b| b.level == 0 && b.root == FREE_SPACE_TREE_OBJECTID)
    {
        let eb = info.read_tree_block(b.bytenr, &Default::default()).expect("leaf");
        let n = eb.node();
        let Some(slot) = (0..n.nritems()).find(|&i| n.key(i) == key) else { continue };
        assert!(
            slot > 0 || b.parent.is_none(),
            "changing a first key would need the parent's key changed too"
        );
        for &(devid, phys) in &b.copies {
            assert_eq!(devid, 1, "single-device images only");
            let mut blk = vec![0u8; info.nodesize as usize];
            file.seek(SeekFrom::Start(phys))
                .and_then(|_| file.read_exact(&mut blk))
                .expect("read leaf");
            let at = HEADER_SIZE + slot * ITEM_SIZE + 9;
            blk[at..at + 8].copy_from_slice(&offset.to_le_bytes());
            walk::fix_block_csum(&mut blk, info.csum_type);
            file.seek(SeekFrom::Start(phys))
                .and_then(|_| file.write_all(&blk))
                .expect("write leaf");
        }
        done = true;
    }
    assert!(done, "no leaf holds {key}");
    file.sync_all().expect("sync image");
}

/// A free-space extent of the last data group runs past the address space. Nothing
/// needs that group, so the open and the writes succeed and never read it (in the
/// kernel too: it loads a group's free space when it caches the group). Caching it
/// reports the damage naming the item and the group, the group keeps the error and is
/// never allocated from, and allocation goes on in the other groups.
#[test]
fn damage_in_an_unused_group() {
    if !common::kernel_available("damage_in_an_unused_group") {
        return;
    }
    let img = many_groups("damage");
    let data = data_groups(&img);
    let &(last, len) = data.last().expect("data groups");
    let key = {
        let mut w = img.writer();
        let items = w
            .items_in_range(
                FREE_SPACE_TREE_OBJECTID,
                &Key::new(last, 0, 0),
                &Key::new(last + len - 1, u8::MAX, u64::MAX),
            )
            .expect("items");
        // Not the first item of a leaf: patching its key would need the parent changed.
        items
            .iter()
            .filter(|(k, _)| k.type_ == FREE_SPACE_EXTENT_KEY)
            .nth(1)
            .expect("free extents in the last group")
            .0
    };
    patch_fst_key_offset(&img, key, u64::MAX - 4095);
    let mut w =
        FsWriter::open(&OpenOptions::new(&img.path)).expect("open with damage in an unused group");
    for i in 0..3u32 {
        let ino = w
            .create_file(FS, ROOT_DIR, format!("f{i}").as_bytes(), &InodeAttrs::new(0o644))
            .expect("create");
        w.write_file(FS, ino, 0, &vec![i as u8; 256 * 1024]).expect("write");
        w.commit().expect("commit");
    }
    assert_eq!(
        w.block_group(last).expect("group").caching_state(),
        CachingState::No,
        "the damaged group was not needed"
    );
    let e = cache_block_group(&mut w, last).expect_err("caching the damaged group");
    let msg = e.to_string();
    assert!(e.is_corrupt(), "not a Corrupt error: {msg}");
    for n in [
        "root=10",
        &format!("free space {} ", key.objectid),
        "runs past the end of the address space",
        &format!("caching block group {last}"),
    ] {
        assert!(msg.contains(n), "the error does not name {n:?}: {msg}");
    }
    let g = w.block_group(last).expect("group");
    assert_eq!(g.caching_state(), CachingState::Error, "the failure is kept");
    assert_eq!(g.free_space(), 0, "a group that failed to load offers no space");
    let again = cache_block_group(&mut w, last).expect_err("caching it again").to_string();
    assert_eq!(again, msg, "the same error again");
    // The other groups still take writes, and nothing aborted.
    let ino = w
        .create_file(FS, ROOT_DIR, b"after", &InodeAttrs::new(0o644))
        .expect("create after the caching error");
    w.write_file(FS, ino, 0, &[7u8; 128 * 1024]).expect("write after the caching error");
    w.commit().expect("commit after the caching error");
    w.check_writable().expect("still writable");
    assert!(bytenr_outside(&mut w, ino, last, len), "the extent avoided the damaged group");
}

fn bytenr_outside(w: &mut FsWriter, ino: u64, start: u64, len: u64) -> bool {
    let b = first_extent(w, ino);
    b < start || b >= start + len
}

/// Without the kernel: on a fresh `mkfs.btrfs` image the open caches nothing, a
/// `mkdir` caches only the metadata group, and the counted free space of the uncached
/// groups equals what their caches hold once loaded.
#[test]
fn open_caches_nothing() {
    let img = Scratch::mkfs("caching-fresh", 256 * MIB, &[]);
    let mut w = img.writer();
    assert!(w.cached_block_groups().is_empty(), "cached at open: {:?}", w.cached_block_groups());
    w.mkdir(FS, ROOT_DIR, b"d", &InodeAttrs::new(0o755)).expect("mkdir");
    let cached = w.cached_block_groups();
    assert_eq!(cached.len(), 1, "cached by a mkdir: {cached:?}");
    assert_eq!(
        w.block_group(cached[0]).expect("group").flags & BLOCK_GROUP_TYPE_MASK,
        BLOCK_GROUP_METADATA,
        "the metadata group"
    );
    w.commit().expect("commit");
    for (s, _, _) in groups(&img) {
        let counted = w.block_group(s).expect("group").free_space();
        cache_block_group(&mut w, s).expect("cache");
        assert_eq!(
            counted,
            w.block_group(s).expect("group").free_space(),
            "group {s}: counted vs cached free space"
        );
    }
    w.check_allocator();
    drop(w);
    if write_common::have_btrfs_check() {
        write_common::assert_check(&img.path, "after a mkdir");
    }
}
