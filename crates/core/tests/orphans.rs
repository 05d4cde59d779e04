//! Orphans: an inode unlinked while open lives on (nlink 0 plus an ORPHAN_ITEM) until
//! its last close; a crash before the close leaves the orphan for the next writable
//! open, which cleans it as the kernel's mount does. The oracles are the trees read
//! back from the image, `btrfs check --readonly --check-data-csum`, our checker (which
//! knows ORPHAN_ITEM_MISSING), and the kernel: it mounts our images, cleans our orphans,
//! and makes orphans of its own for us to clean.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::path::Path;
use std::process::Command;
use ubtrfs_core::engine::Engine;
use ubtrfs_core::inode::filesystem::{ExtentKind, Filesystem, InodeId, Load};
use ubtrfs_core::inode::orphan::orphan_key;
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FsWriter;
use ubtrfs_core::{Error, FsRead, OpenOptions, PosixKind, TreeView};
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;
use write_common::*;
use zerocopy::FromBytes;

/// A fresh filesystem: `mkfs.btrfs` as root, else a copy of the default fixture.
fn image(tag: &str) -> (Scratch, bool) {
    if common::kernel_available(tag) {
        (Scratch::mkfs(tag, 256 * MIB, &[]), true)
    } else {
        (Scratch::fixture("default", tag), false)
    }
}

/// A sparse copy of `img` (deleted on drop like any scratch image).
fn copy_image(img: &Path, tag: &str) -> Scratch {
    let copy = Scratch { path: img.with_file_name(format!("{tag}-{}.img", std::process::id())) };
    let ok = Command::new("cp")
        .arg("--sparse=always")
        .arg(img)
        .arg(&copy.path)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "copy {} to {}", img.display(), copy.path.display());
    copy
}

fn engine(img: &Scratch) -> Engine {
    Engine::open(&OpenOptions::new(&img.path))
        .unwrap_or_else(|e| panic!("{}: Engine::open: {e}", img.path.display()))
}

/// Items of tree `tree` with keys in [from, to], as committed in `img`.
fn committed_items(img: &Path, tree: u64, from: Key, to: Key) -> Vec<(Key, Vec<u8>)> {
    let fs = Filesystem::open(&OpenOptions::new(img)).expect("open reader");
    let root = fs.read_root(tree).unwrap_or_else(|e| panic!("tree {tree}: {e}")).0;
    fs.items_in_range(&root, &from, &to)
        .expect("items")
        .into_iter()
        .map(|i| (i.key(), i.data().to_vec()))
        .collect()
}

/// Every item of inode `id` (INODE_ITEM, refs, xattrs, EXTENT_DATA), as committed.
fn inode_items(img: &Path, id: InodeId) -> Vec<Key> {
    committed_items(img, id.root, Key::new(id.ino, 0, 0), Key::new(id.ino, u8::MAX, u64::MAX))
        .into_iter()
        .map(|(k, _)| k)
        .collect()
}

/// The committed INODE_ITEM of `id`, if any.
fn inode_item(img: &Path, id: InodeId) -> Option<InodeItem> {
    let k = Key::new(id.ino, INODE_ITEM_KEY, 0);
    committed_items(img, id.root, k, k)
        .first()
        .map(|(_, d)| InodeItem::read_from_bytes(d).expect("inode item size"))
}

/// Inode numbers with an orphan item in tree `root`, as committed.
fn committed_orphans(img: &Path, root: u64) -> Vec<u64> {
    committed_items(img, root, orphan_key(0), orphan_key(u64::MAX))
        .into_iter()
        .map(|(k, _)| k.offset)
        .collect()
}

/// Bytes used in data block groups, as committed.
fn data_used(img: &Path) -> u64 {
    let fs = Filesystem::open(&OpenOptions::new(img)).expect("open reader");
    let tree = if fs.read_root(BLOCK_GROUP_TREE_OBJECTID).is_ok() {
        BLOCK_GROUP_TREE_OBJECTID
    } else {
        EXTENT_TREE_OBJECTID
    };
    let root = fs.read_root(tree).expect("block group tree").0;
    let mut used = 0;
    for i in fs
        .items_in_range(
            &root,
            &Key::new(0, BLOCK_GROUP_ITEM_KEY, 0),
            &Key::new(u64::MAX, BLOCK_GROUP_ITEM_KEY, u64::MAX),
        )
        .expect("block groups")
    {
        if i.key().type_ != BLOCK_GROUP_ITEM_KEY {
            continue;
        }
        let bg = BlockGroupItem::read_from_bytes(i.data()).expect("block group item size");
        if bg.flags.get() & BLOCK_GROUP_DATA != 0 {
            used += bg.used.get();
        }
    }
    used
}

/// EXTENT_ITEMs at data extent `bytenr`, as committed.
fn extent_items_at(img: &Path, bytenr: u64) -> Vec<Key> {
    committed_items(
        img,
        EXTENT_TREE_OBJECTID,
        Key::new(bytenr, EXTENT_ITEM_KEY, 0),
        Key::new(bytenr, EXTENT_ITEM_KEY, u64::MAX),
    )
    .into_iter()
    .map(|(k, _)| k)
    .collect()
}

/// The data extents inode `id` references in the live view.
fn disk_extents(e: &Engine, id: InodeId) -> Vec<u64> {
    let v = e
        .read(|live| live.load_inode(id, Load { extents: true, ..Load::ITEM }))
        .expect("load inode");
    let mut out: Vec<u64> = v
        .extents
        .iter()
        .filter_map(|x| match x.kind {
            ExtentKind::Regular { disk_bytenr, .. } if disk_bytenr != 0 => Some(disk_bytenr),
            _ => None,
        })
        .collect();
    out.dedup();
    out
}

/// Read the whole of an open file.
fn read_all(f: &ubtrfs_core::engine::OpenFile<'_>, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len + 4096];
    let n = f.read_at(0, &mut buf).unwrap_or_else(|e| panic!("read {:?}: {e}", f.id()));
    buf.truncate(n);
    buf
}

/// Our checker on `img` finds nothing (it reports ORPHAN_ITEM_MISSING for nlink 0
/// without an orphan item).
fn assert_ubtrfs_check(img: &Path, what: &str) {
    let fs = Filesystem::open(&OpenOptions::new(img)).expect("open for check");
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

/// The state a crash leaves: a file with data unlinked while open, committed, then
/// the engine gone without the close. Returns the image, the model of what stays
/// visible, the orphan and its data extents, and the data bytes used without it.
struct Crashed {
    img: Scratch,
    kernel: bool,
    model: Model,
    victim: InodeId,
    extents: Vec<u64>,
    data_without: u64,
}

fn crash_with_an_orphan(tag: &str) -> Crashed {
    let (img, kernel) = image(tag);
    let mut model = Model::load(&img.path);
    let e = engine(&img);
    let mut rng = Rng::new(7);
    e.write(|w| {
        model.w_create(w, "keep", 0o644, &rng.bytes(300_000));
        Ok(())
    })
    .expect("create keep");
    e.commit().expect("commit");
    let data_without = data_used(&img.path);
    let top = model.id("");
    let victim = e
        .write(|w| {
            let ino = w.create_file(top.root, top.ino, b"victim", &InodeAttrs::new(0o600))?;
            w.write_file(top.root, ino, 0, &rng.bytes(700_000))?;
            Ok(InodeId { root: top.root, ino })
        })
        .expect("create victim");
    e.commit().expect("commit");
    let f = e.open_file(victim).expect("open victim");
    e.unlink(top, b"victim").expect("unlink victim");
    f.write_at(700_000, &rng.bytes(200_000)).expect("write through the handle");
    let extents = disk_extents(&e, victim);
    assert!(!extents.is_empty());
    e.commit().expect("commit with the orphan");
    // The crash: the handle is never closed and the engine goes away.
    #[allow(clippy::mem_forget)] // the crash: the handle is never closed
    std::mem::forget(f);
    drop(e);
    assert_eq!(
        committed_orphans(&img.path, victim.root),
        vec![victim.ino],
        "the crash leaves the orphan item"
    );
    assert_eq!(
        inode_item(&img.path, victim).map(|i| i.nlink.get()),
        Some(0),
        "and the inode with nlink 0"
    );
    assert_ubtrfs_check(&img.path, "crashed with an orphan");
    if kernel {
        assert_check(&img.path, "crashed with an orphan");
    }
    Crashed { img, kernel, model, victim, extents, data_without }
}

/// The orphan `victim` is gone from `img` with everything it owned.
fn assert_orphan_gone(img: &Path, victim: InodeId, extents: &[u64], data_without: u64, what: &str) {
    assert_eq!(inode_items(img, victim), Vec::<Key>::new(), "{what}: the inode's items are gone");
    assert_eq!(
        committed_orphans(img, victim.root),
        Vec::<u64>::new(),
        "{what}: the orphan item is gone"
    );
    for &b in extents {
        assert_eq!(extent_items_at(img, b), Vec::<Key>::new(), "{what}: data extent {b} is freed");
    }
    assert_eq!(data_used(img), data_without, "{what}: the data space is returned");
}

#[test]
fn unlinked_open_file_reads_back_its_writes_and_is_freed_at_last_close() {
    let (img, kernel) = image("orphan-open");
    let mut model = Model::load(&img.path);
    let e = engine(&img);
    let mut rng = Rng::new(1);
    e.write(|w| {
        model.w_create(w, "keep", 0o644, &rng.bytes(100_000));
        Ok(())
    })
    .expect("create keep");
    e.commit().expect("commit");
    let data_without = data_used(&img.path);
    let top = model.id("");
    let mut content = rng.bytes(1 << 20);
    let victim = e
        .write(|w| {
            let ino = w.create_file(top.root, top.ino, b"victim", &InodeAttrs::new(0o644))?;
            w.write_file(top.root, ino, 0, &content)?;
            Ok(InodeId { root: top.root, ino })
        })
        .expect("create victim");
    e.commit().expect("commit");

    let f = e.open_file(victim).expect("open");
    assert_eq!(e.inodes().lookup(victim).map(|i| i.open_count()), Some(1));
    e.unlink(top, b"victim").expect("unlink while open");
    // The name is gone, the inode stays with nlink 0 and an orphan item.
    e.read(|live| {
        assert!(live.lookup(top, b"victim")?.is_none(), "the name is gone");
        assert_eq!(live.load_inode(victim, Load::ITEM)?.nlink(), 0);
        Ok(())
    })
    .expect("live view");
    // Writes and reads through the handle still reach it.
    let tail = rng.bytes(256 << 10);
    f.write_at(content.len() as u64, &tail).expect("append through the handle");
    content.extend_from_slice(&tail);
    let patch = rng.bytes(10_000);
    f.write_at(4096 + 17, &patch).expect("overwrite through the handle");
    model_write(&mut content, 4096 + 17, &patch);
    assert!(read_all(&f, content.len()) == content, "the handle reads back what was written");
    let extents = disk_extents(&e, victim);
    assert!(!extents.is_empty());

    e.commit().expect("commit with the orphan");
    let item = inode_item(&img.path, victim).expect("the orphan's inode item is committed");
    assert_eq!(item.nlink.get(), 0);
    assert_eq!(item.size.get(), content.len() as u64);
    assert_eq!(
        committed_orphans(&img.path, victim.root),
        vec![victim.ino],
        "the orphan item is committed"
    );
    assert!(
        inode_items(&img.path, victim).iter().any(|k| k.type_ == EXTENT_DATA_KEY),
        "its extents stay"
    );
    assert!(
        inode_items(&img.path, victim)
            .iter()
            .all(|k| k.type_ != INODE_REF_KEY && k.type_ != INODE_EXTREF_KEY),
        "no name refers to it"
    );
    for &b in &extents {
        assert_eq!(extent_items_at(&img.path, b).len(), 1, "data extent {b} is still referenced");
    }
    assert!(data_used(&img.path) >= data_without + content.len() as u64);
    assert_ubtrfs_check(&img.path, "orphan committed");
    if kernel {
        assert_check(&img.path, "orphan committed");
    }
    assert!(read_all(&f, content.len()) == content, "the handle still reads after the commit");

    f.close().expect("close");
    assert!(e.inodes().lookup(victim).is_none(), "the closed orphan left the inode cache");
    e.read(|live| {
        let err = live.load_inode(victim, Load::ITEM).err().expect("the inode is gone");
        assert_eq!(err.posix_kind(), Some(PosixKind::NotFound));
        Ok(())
    })
    .expect("live view");
    e.commit().expect("commit after close");
    e.inodes().check_invariants();
    assert_orphan_gone(&img.path, victim, &extents, data_without, "after the last close");
    drop(e);
    verify_all(&img.path, &model, kernel, "after the last close");
}

#[test]
fn crash_before_close_leaves_an_orphan_our_next_open_cleans() {
    let c = crash_with_an_orphan("orphan-crash-ours");
    let mut w = c.img.writer();
    // Cleaned at open, in the running transaction.
    assert_eq!(w.orphans(c.victim.root).expect("orphans"), Vec::<u64>::new());
    let err = w
        .live()
        .load_inode(c.victim, Load::ITEM)
        .err()
        .expect("the orphan's inode is gone from the live view");
    assert_eq!(err.posix_kind(), Some(PosixKind::NotFound));
    // Nothing reaches the image before the commit.
    assert_eq!(
        committed_orphans(&c.img.path, c.victim.root),
        vec![c.victim.ino],
        "the cleanup lands with the next commit, not at open"
    );
    w.commit().expect("commit the cleanup");
    check_trees(&mut w, &[c.victim.root], "after our cleanup");
    drop(w);
    assert_orphan_gone(&c.img.path, c.victim, &c.extents, c.data_without, "after our cleanup");
    verify_all(&c.img.path, &c.model, c.kernel, "after our cleanup");
    // A second open finds nothing to do.
    let w = c.img.writer();
    assert_eq!(w.dirty_blocks(), 0, "a clean image opens without changes");
}

#[test]
fn crash_before_close_leaves_an_orphan_a_kernel_mount_cleans() {
    if !common::kernel_available("crash_before_close_leaves_an_orphan_a_kernel_mount_cleans") {
        return;
    }
    let c = crash_with_an_orphan("orphan-crash-kernel");
    let mnt = Mount::new(&c.img.path, true);
    mnt.umount();
    assert_orphan_gone(&c.img.path, c.victim, &c.extents, c.data_without, "after a kernel mount");
    verify_all(&c.img.path, &c.model, true, "after a kernel mount");
}

/// `fsfreeze` on a mount: the kernel commits and holds every further write.
fn fsfreeze(dir: &Path, freeze: bool) {
    let out = Command::new("fsfreeze")
        .arg(if freeze { "-f" } else { "-u" })
        .arg(dir)
        .output()
        .expect("run fsfreeze");
    assert!(
        out.status.success(),
        "fsfreeze {freeze} {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn kernel_made_orphan_is_cleaned_by_our_writable_open() {
    let tag = "kernel_made_orphan_is_cleaned_by_our_writable_open";
    if !common::kernel_available_with(tag, &["/usr/sbin/fsfreeze"]) {
        return;
    }
    let img = Scratch::mkfs("orphan-kernel-made", 256 * MIB, &[]);
    let mut model = Model::load(&img.path);
    let mut rng = Rng::new(3);
    let copy;
    {
        let mnt = Mount::new(&img.path, true);
        model.k_create(&mnt, "keep", &rng.bytes(123_456));
        model.k_create(&mnt, "victim", &rng.bytes(2 << 20));
        let sync = Command::new("sync").arg("-f").arg(mnt.path("keep")).status().expect("sync");
        assert!(sync.success());
        // Hold the file open (as a process would), unlink it, keep writing to it.
        let held = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(mnt.path("victim"))
            .expect("open victim");
        std::fs::remove_file(mnt.path("victim")).expect("unlink victim");
        model.record_unlink("victim");
        {
            use std::os::unix::fs::FileExt;
            held.write_all_at(&rng.bytes(300_000), 2 << 20).expect("write to the unlinked file");
        }
        // Freeze: the kernel commits, with the orphan, and writes nothing more while the
        // image is copied.
        fsfreeze(&mnt.dir, true);
        // Nothing may panic while frozen (the umount on the way out would wait forever).
        let copy_path =
            img.path.with_file_name(format!("orphan-kernel-made-copy-{}.img", std::process::id()));
        let copied =
            Command::new("cp").arg("--sparse=always").arg(&img.path).arg(&copy_path).status();
        fsfreeze(&mnt.dir, false);
        copy = Scratch { path: copy_path };
        assert!(copied.map(|s| s.success()).unwrap_or(false), "copy the frozen image");
        drop(held);
        mnt.umount();
    }
    // The copy holds the kernel's orphan: nlink 0 and an ORPHAN_ITEM.
    let orphans = committed_orphans(&copy.path, FS_TREE_OBJECTID);
    assert_eq!(orphans.len(), 1, "the kernel left one orphan item: {orphans:?}");
    let victim = InodeId { root: FS_TREE_OBJECTID, ino: orphans[0] };
    let item = inode_item(&copy.path, victim).expect("the kernel's orphan inode");
    assert_eq!(item.nlink.get(), 0);
    assert!(item.size.get() >= 2 << 20);
    assert!(
        inode_items(&copy.path, victim).iter().any(|k| k.type_ == EXTENT_DATA_KEY),
        "the kernel's orphan keeps its extents"
    );
    assert_check(&copy.path, "the kernel's orphan");
    assert_ubtrfs_check(&copy.path, "the kernel's orphan");
    let extents: Vec<u64> = {
        let fs = copy.reader();
        let v = fs
            .load_inode(victim, Load { extents: true, ..Load::ITEM })
            .expect("load the kernel's orphan");
        v.extents
            .iter()
            .filter_map(|x| match x.kind {
                ExtentKind::Regular { disk_bytenr, .. } if disk_bytenr != 0 => Some(disk_bytenr),
                _ => None,
            })
            .collect()
    };
    assert!(!extents.is_empty());

    let mut w = copy.writer();
    assert_eq!(
        w.orphans(FS_TREE_OBJECTID).expect("orphans"),
        Vec::<u64>::new(),
        "our writable open cleaned it"
    );
    w.commit().expect("commit the cleanup");
    drop(w);
    assert_eq!(inode_items(&copy.path, victim), Vec::<Key>::new(), "the kernel's orphan is gone");
    assert_eq!(committed_orphans(&copy.path, FS_TREE_OBJECTID), Vec::<u64>::new());
    for &b in &extents {
        assert_eq!(extent_items_at(&copy.path, b), Vec::<Key>::new(), "data extent {b} is freed");
    }
    model.resolve_ids(&copy.path);
    verify_all(&copy.path, &model, true, "the kernel's orphan after our cleanup");
}

#[test]
fn orphan_items_of_linked_or_missing_inodes_lose_only_the_item() {
    let (img, kernel) = image("orphan-linked");
    let mut model = Model::load(&img.path);
    let mut w = img.writer();
    let mut rng = Rng::new(4);
    model.w_create(&mut w, "linked", 0o644, &rng.bytes(50_000));
    let linked = model.id("linked");
    let missing = 0x7_0000;
    w.raw_tree()
        .insert_item(linked.root, &orphan_key(linked.ino), &[])
        .expect("orphan item for a linked inode");
    w.raw_tree()
        .insert_item(linked.root, &orphan_key(missing), &[])
        .expect("orphan item for no inode");
    w.commit().expect("commit");
    drop(w);
    assert_eq!(committed_orphans(&img.path, linked.root), vec![linked.ino, missing]);
    let before = inode_items(&img.path, linked);
    let copy = copy_image(&img.path, "orphan-linked-copy");

    let mut w = img.writer();
    w.commit().expect("commit the cleanup");
    drop(w);
    assert_eq!(
        committed_orphans(&img.path, linked.root),
        Vec::<u64>::new(),
        "both orphan items are gone"
    );
    assert_eq!(inode_items(&img.path, linked), before, "the linked inode keeps every item");
    verify_all(&img.path, &model, kernel, "after our cleanup");
    if kernel {
        // The kernel does the same with the same image.
        Mount::new(&copy.path, true).umount();
        assert_eq!(
            committed_orphans(&copy.path, linked.root),
            Vec::<u64>::new(),
            "the kernel deletes both orphan items too"
        );
        assert_eq!(
            inode_items(&copy.path, linked).len(),
            before.len(),
            "the kernel keeps the linked inode's items too"
        );
        verify_all(&copy.path, &model, kernel, "after the kernel's cleanup");
    }
}

/// `create_inode` makes an O_TMPFILE-like inode: committed before its first name, it
/// carries an orphan item (so `btrfs check` is clean and the next writable open frees
/// it); its first `link` removes the item.
#[test]
fn an_unnamed_inode_is_an_orphan_until_its_first_link() {
    let (img, kernel) = image("orphan-tmpfile");
    let mut model = Model::load(&img.path);
    let top = model.id("");
    let mut w = FsWriter::open(&OpenOptions::new(&img.path)).expect("writer");
    let named = w.create_inode(top.root, &InodeAttrs::new(S_IFREG | 0o640)).expect("create_inode");
    let lost = w.create_inode(top.root, &InodeAttrs::new(S_IFREG | 0o600)).expect("create_inode");
    w.commit().expect("commit");
    assert_eq!(
        committed_orphans(&img.path, top.root),
        vec![named, lost],
        "both unnamed inodes are orphans"
    );
    assert_ubtrfs_check(&img.path, "with two unnamed inodes");
    if kernel {
        assert_check(&img.path, "with two unnamed inodes");
    }
    w.link(top.root, top.ino, b"named", named, FT_REG_FILE).expect("link");
    w.commit().expect("commit");
    assert_eq!(
        committed_orphans(&img.path, top.root),
        vec![lost],
        "the first link ended the orphan"
    );
    drop(w);
    // The next writable open frees the one that never got a name.
    let mut w = FsWriter::open(&OpenOptions::new(&img.path)).expect("writer");
    w.commit().expect("commit the cleanup");
    drop(w);
    assert_eq!(
        inode_items(&img.path, InodeId { root: top.root, ino: lost }),
        Vec::<Key>::new(),
        "the unnamed inode was freed"
    );
    assert_eq!(committed_orphans(&img.path, top.root), Vec::<u64>::new());
    model.record_file("named", 0o640, Vec::new(), InodeId { root: top.root, ino: named });
    verify_all(&img.path, &model, kernel, "after the link and the cleanup");
}

/// The writer's own `unlink`, run inside `Engine::write`, sees the shared inode cache:
/// an open file's last name goes, the inode stays an orphan until the close.
#[test]
fn an_unlink_inside_a_change_keeps_an_open_file() {
    let (img, kernel) = image("orphan-unlink-in-write");
    let model = Model::load(&img.path);
    let e = engine(&img);
    let top = model.id("");
    let data = Rng::new(9).bytes(30_000);
    let id = e
        .write(|w| {
            let ino = w.create_file(top.root, top.ino, b"held", &InodeAttrs::new(0o644))?;
            w.write_file(top.root, ino, 0, &data)?;
            Ok(InodeId { root: top.root, ino })
        })
        .expect("create");
    let f = e.open_file(id).expect("open");
    e.write(|w| w.unlink(top.root, top.ino, b"held")).expect("unlink inside a change");
    assert!(read_all(&f, data.len()) == data, "the open file still reads after its unlink");
    e.commit().expect("commit");
    assert_eq!(
        committed_orphans(&img.path, id.root),
        vec![id.ino],
        "an orphan item while it is open"
    );
    f.close().expect("close");
    e.commit().expect("commit");
    assert_eq!(inode_items(&img.path, id), Vec::<Key>::new(), "freed at the close");
    assert_eq!(committed_orphans(&img.path, id.root), Vec::<u64>::new());
    drop(e);
    verify_all(&img.path, &model, kernel, "after the close");
}

#[test]
fn the_last_of_two_handles_frees_the_unlinked_file() {
    let (img, kernel) = image("orphan-two-handles");
    let model = Model::load(&img.path);
    let e = engine(&img);
    let top = model.id("");
    let data = Rng::new(5).bytes(40_000);
    let id = e
        .write(|w| {
            let ino = w.create_file(top.root, top.ino, b"twice", &InodeAttrs::new(0o644))?;
            w.write_file(top.root, ino, 0, &data)?;
            Ok(InodeId { root: top.root, ino })
        })
        .expect("create");
    let a = e.open_file(id).expect("open a");
    let b = e.open_file(id).expect("open b");
    e.unlink(top, b"twice").expect("unlink");
    a.close().expect("close a");
    assert!(read_all(&b, data.len()) == data, "the other handle still reads");
    // Opening the orphan again while it is in use is allowed (a FUSE open by inode).
    let c = e.open_file(id).expect("open c while in use");
    assert_eq!(e.inodes().lookup(id).map(|i| i.open_count()), Some(2));
    drop(c);
    e.commit().expect("commit");
    assert_eq!(committed_orphans(&img.path, id.root), vec![id.ino]);
    b.close().expect("close b");
    let err = e.open_file(id).expect_err("a freed inode cannot be opened");
    assert_eq!(err.posix_kind(), Some(PosixKind::NotFound));
    e.commit().expect("commit");
    assert_eq!(inode_items(&img.path, id), Vec::<Key>::new());
    assert_eq!(committed_orphans(&img.path, id.root), Vec::<u64>::new());
    assert_eq!(e.take_close_errors(), (Vec::new(), 0));
    drop(e);
    verify_all(&img.path, &model, kernel, "after both closes");
}

#[test]
fn a_dropped_handle_closes_and_its_error_is_recorded() {
    let (img, _) = image("orphan-drop");
    let model = Model::load(&img.path);
    let e = engine(&img);
    let top = model.id("");
    let mk = |name: &[u8]| {
        e.write(|w| {
            let ino = w.create_file(top.root, top.ino, name, &InodeAttrs::new(0o644))?;
            w.write_file(top.root, ino, 0, b"some bytes")?;
            Ok(InodeId { root: top.root, ino })
        })
        .expect("create")
    };
    // Dropped without close: closed all the same, the orphan is freed.
    let first = mk(b"first");
    let f = e.open_file(first).expect("open");
    e.unlink(top, b"first").expect("unlink");
    drop(f);
    assert_eq!(e.take_close_errors(), (Vec::new(), 0));
    e.read(|live| {
        assert_eq!(
            live.load_inode(first, Load::ITEM).err().and_then(|e| e.posix_kind()),
            Some(PosixKind::NotFound),
            "freed by the drop"
        );
        Ok(())
    })
    .expect("live view");
    // A drop whose close fails (the filesystem went read-only) records the error.
    let second = mk(b"second");
    let f = e.open_file(second).expect("open");
    e.unlink(top, b"second").expect("unlink");
    e.write(|w| {
        w.abort("test", &Error::posix(PosixKind::Invalid, "simulated failure"));
        Ok(())
    })
    .expect("abort");
    drop(f);
    let (errors, more) = e.take_close_errors();
    assert_eq!(more, 0);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains(&format!("close {second}")) && errors[0].contains("read-only"),
        "{errors:?}"
    );
    assert_eq!(
        e.inodes().lookup(second).map_or(0, |i| i.open_count()),
        0,
        "closed although the removal failed"
    );
    e.inodes().check_invariants();
}

#[test]
fn a_looked_up_inode_outlives_its_unlink_until_forget() {
    let (img, kernel) = image("orphan-lookup");
    let model = Model::load(&img.path);
    let e = engine(&img);
    let top = model.id("");
    let id = e
        .write(|w| {
            let ino = w.create_file(top.root, top.ino, b"looked", &InodeAttrs::new(0o644))?;
            w.write_file(top.root, ino, 0, &[7u8; 9000])?;
            Ok(InodeId { root: top.root, ino })
        })
        .expect("create");
    let entry = e.lookup(top, b"looked").expect("lookup").expect("found");
    assert_eq!(entry.target, id);
    e.lookup(top, b"looked").expect("lookup again");
    e.unlink(top, b"looked").expect("unlink");
    e.read(|live| {
        assert_eq!(live.load_inode(id, Load::ITEM)?.nlink(), 0, "kept while looked up");
        Ok(())
    })
    .expect("live view");
    e.forget(id, 1).expect("forget one");
    e.read(|live| {
        assert_eq!(live.load_inode(id, Load::ITEM)?.nlink(), 0, "one lookup left");
        Ok(())
    })
    .expect("live view");
    e.forget(id, 1).expect("forget the last");
    e.read(|live| {
        assert_eq!(
            live.load_inode(id, Load::ITEM).err().and_then(|e| e.posix_kind()),
            Some(PosixKind::NotFound),
            "freed at the last forget"
        );
        Ok(())
    })
    .expect("live view");
    // An unlink of a file nobody uses frees it at once and leaves no orphan item.
    let other = e
        .write(|w| {
            let ino = w.create_file(top.root, top.ino, b"plain", &InodeAttrs::new(0o644))?;
            w.write_file(top.root, ino, 0, &[1u8; 70_000])?;
            Ok(InodeId { root: top.root, ino })
        })
        .expect("create");
    e.unlink(top, b"plain").expect("unlink");
    e.write(|w| {
        assert_eq!(w.orphans(top.root)?, Vec::<u64>::new());
        Ok(())
    })
    .expect("orphans");
    e.commit().expect("commit");
    assert_eq!(inode_items(&img.path, other), Vec::<Key>::new());
    drop(e);
    verify_all(&img.path, &model, kernel, "after forget");
}

#[test]
fn orphans_in_a_subvolume_are_cleaned_unless_it_is_read_only() {
    let tag = "orphans_in_a_subvolume_are_cleaned_unless_it_is_read_only";
    if !common::kernel_available(tag) {
        return;
    }
    let img = Scratch::mkfs("orphan-subvol", 256 * MIB, &[]);
    {
        let mnt = Mount::new(&img.path, true);
        let out = Command::new("btrfs")
            .args(["subvolume", "create"])
            .arg(mnt.path("sub"))
            .output()
            .expect("btrfs subvolume create");
        assert!(out.status.success(), "subvolume create: {}", String::from_utf8_lossy(&out.stderr));
        mnt.umount();
    }
    let model = Model::load(&img.path);
    let sub = model.id("sub");
    assert_ne!(sub.root, FS_TREE_OBJECTID);
    let e = engine(&img);
    let id = e
        .write(|w| {
            let ino = w.create_file(sub.root, sub.ino, b"inner", &InodeAttrs::new(0o644))?;
            w.write_file(sub.root, ino, 0, &[3u8; 200_000])?;
            Ok(InodeId { root: sub.root, ino })
        })
        .expect("create in the subvolume");
    let f = e.open_file(id).expect("open");
    e.unlink(sub, b"inner").expect("unlink");
    // Read-only, the subvolume keeps its orphan (send relies on it never changing).
    e.write(|w| w.set_subvol_readonly(sub.root, true)).expect("flag read-only");
    e.commit().expect("commit");
    #[allow(clippy::mem_forget)] // the crash: the handle is never closed
    std::mem::forget(f);
    drop(e);
    assert_eq!(committed_orphans(&img.path, sub.root), vec![id.ino]);
    assert_check(&img.path, "orphan in a read-only subvolume");
    let mut w = img.writer();
    assert_eq!(
        w.orphans(sub.root).expect("orphans"),
        vec![id.ino],
        "a read-only subvolume is not cleaned"
    );
    w.set_subvol_readonly(sub.root, false).expect("flag writable");
    w.commit().expect("commit");
    drop(w);
    assert_eq!(committed_orphans(&img.path, sub.root), vec![id.ino]);
    // Writable again, its orphan goes at the next open.
    let mut w = img.writer();
    assert_eq!(w.orphans(sub.root).expect("orphans"), Vec::<u64>::new());
    w.commit().expect("commit the cleanup");
    drop(w);
    assert_eq!(committed_orphans(&img.path, sub.root), Vec::<u64>::new());
    assert_eq!(inode_items(&img.path, id), Vec::<Key>::new());
    verify_all(&img.path, &model, true, "after the subvolume's cleanup");
}

#[test]
fn a_large_unused_file_is_dropped_by_its_unlink_without_leaving_an_orphan() {
    let (img, kernel) = image("orphan-large");
    let mut model = Model::load(&img.path);
    let e = engine(&img);
    let top = model.id("");
    // Sparse: large by its size, cheap to write.
    let off = 2 * ubtrfs_core::inode::orphan::ORPHAN_FIRST_BYTES;
    let id = e
        .write(|w| {
            let ino = w.create_file(top.root, top.ino, b"large", &InodeAttrs::new(0o644))?;
            w.write_file(top.root, ino, 0, &[9u8; 20_000])?;
            w.write_file(top.root, ino, off, b"the end")?;
            Ok(InodeId { root: top.root, ino })
        })
        .expect("create");
    e.write(|w| {
        model.w_create(w, "small", 0o644, b"stays");
        Ok(())
    })
    .expect("create small");
    e.commit().expect("commit");
    let item = inode_item(&img.path, id).expect("inode");
    assert!(ubtrfs_core::inode::orphan::drop_spans_transactions(&item), "the file counts as large");
    let extents = disk_extents(&e, id);
    e.unlink(top, b"large").expect("unlink");
    e.write(|w| {
        assert_eq!(w.orphans(top.root)?, Vec::<u64>::new(), "the orphan item went with the drop");
        Ok(())
    })
    .expect("orphans");
    e.commit().expect("commit");
    assert_eq!(inode_items(&img.path, id), Vec::<Key>::new());
    for &b in &extents {
        assert_eq!(extent_items_at(&img.path, b), Vec::<Key>::new(), "data extent {b} is freed");
    }
    drop(e);
    verify_all(&img.path, &model, kernel, "after the large unlink");
}

#[test]
fn concurrent_opens_reads_closes_and_unlinks_leave_no_orphan_behind() {
    const FILES: usize = 24;
    const READERS: usize = 3;
    let (img, kernel) = image("orphan-threads");
    let model = Model::load(&img.path);
    let e = engine(&img);
    e.set_inode_cache_capacity(8);
    let top = model.id("");
    let mut rng = Rng::new(11);
    let files: Vec<(Vec<u8>, InodeId, Vec<u8>)> = (0..FILES)
        .map(|i| {
            let name = format!("t{i}").into_bytes();
            let len = rng.range(1, 60_000) as usize;
            let data = rng.bytes(len);
            let id = e
                .write(|w| {
                    let ino = w.create_file(top.root, top.ino, &name, &InodeAttrs::new(0o644))?;
                    w.write_file(top.root, ino, 0, &data)?;
                    Ok(InodeId { root: top.root, ino })
                })
                .expect("create");
            (name, id, data)
        })
        .collect();
    e.commit().expect("commit");
    let done = std::sync::atomic::AtomicBool::new(false);
    let kept_open = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..READERS {
            let (e, files, done) = (&e, &files, &done);
            s.spawn(move || {
                let mut rng = Rng::new(100 + t as u64);
                let mut held = Vec::new();
                let mut op = 0;
                while op < 100 || !done.load(std::sync::atomic::Ordering::Acquire) {
                    op += 1;
                    let (_, id, data) = &files[rng.below(FILES as u64) as usize];
                    match e.open_file(*id) {
                        Ok(f) => {
                            assert!(
                                read_all(&f, data.len()) == *data,
                                "reader {t} op {op}: {id} reads back its data"
                            );
                            if held.len() < 8 && rng.chance(60) {
                                held.push((f, data));
                            }
                        }
                        Err(err) => assert_eq!(
                            err.posix_kind(),
                            Some(PosixKind::NotFound),
                            "reader {t} op {op}: {id}: {err}"
                        ),
                    }
                    if rng.chance(30) && !held.is_empty() {
                        let (f, data) = held.swap_remove(rng.below(held.len() as u64) as usize);
                        assert!(
                            read_all(&f, data.len()) == *data,
                            "reader {t} op {op}: a held handle reads back its data"
                        );
                        f.close().unwrap_or_else(|err| panic!("reader {t} op {op}: close: {err}"));
                    }
                }
                for (f, data) in held {
                    assert!(
                        read_all(&f, data.len()) == *data,
                        "reader {t}: a held handle reads back its data at the end"
                    );
                    f.close().expect("close");
                }
            });
        }
        s.spawn(|| {
            let mut rng = Rng::new(99);
            for (name, id, _) in &files {
                std::thread::sleep(std::time::Duration::from_millis(rng.range(1, 8)));
                e.unlink(top, name).expect("unlink");
                // Still there: it was open at the unlink (or is being closed right now).
                if e.read(|live| Ok(live.load_inode(*id, Load::ITEM).is_ok())).expect("live view") {
                    kept_open.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                if rng.chance(30) {
                    e.commit().expect("commit");
                }
            }
            done.store(true, std::sync::atomic::Ordering::Release);
        });
    });
    let kept_open = kept_open.into_inner();
    eprintln!("{kept_open} of {FILES} unlinks met open files");
    assert!(kept_open > 0, "some unlinks met open files");
    e.inodes().check_invariants();
    assert_eq!(e.take_close_errors(), (Vec::new(), 0));
    e.write(|w| {
        assert_eq!(
            w.orphans(top.root)?,
            Vec::<u64>::new(),
            "every orphan went with its last close"
        );
        Ok(())
    })
    .expect("orphans");
    e.commit().expect("commit");
    for (_, id, _) in &files {
        assert_eq!(inode_items(&img.path, *id), Vec::<Key>::new(), "{id} is gone");
    }
    drop(e);
    verify_all(&img.path, &model, kernel, "after the threads");
}
