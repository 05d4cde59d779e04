//! The in-memory inode's attributes and a directory's next DIR_INDEX: kept in the
//! shared inode cache, current with every change, rebuilt after eviction.

mod common;
#[path = "common/write.rs"]
mod write_common;

use ubtrfs_core::engine::Engine;
use ubtrfs_core::inode::filesystem::{InodeId, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::{Filesystem, FsRead, OpenOptions, PosixKind, TreeView};
use ubtrfs_format::key::{DIR_INDEX_KEY, FS_TREE_OBJECTID};
use ubtrfs_format::Key;
use write_common::*;
use zerocopy::IntoBytes;

const ROOT: u64 = FS_TREE_OBJECTID;
const ROOT_DIR: u64 = 256;

#[test]
fn getattr_is_cached_and_follows_every_change() {
    let img = Scratch::fixture("blake2", "inode-attrs");
    let e = Engine::from_writer(img.writer());
    let id = e
        .write(|w| {
            w.create_file(ROOT, ROOT_DIR, b"f", &InodeAttrs::new(0o600))
                .map(|ino| InodeId { root: ROOT, ino })
        })
        .expect("create");
    let live = |e: &Engine| e.read(|l| Ok(l.load_inode(id, Load::ITEM)?.item)).expect("live inode");
    let a = e.getattr(id).expect("getattr");
    assert_eq!(a.mode.get() & 0o7777, 0o600);
    assert!(
        e.inodes().lookup(id).and_then(|i| i.attrs()).is_some(),
        "the first getattr keeps the item in the inode"
    );
    // A write changes size, nbytes and times through the writer: the copy follows.
    e.write_file(id, 0, &vec![3u8; 10_000]).expect("write");
    let b = e.getattr(id).expect("getattr after the write");
    assert_eq!(b.size.get(), 10_000, "getattr shows the write's size");
    assert_eq!(b.as_bytes(), live(&e).as_bytes(), "the cached attributes equal the live item");
    e.write(|w| {
        w.update_inode(InodeId { root: ROOT, ino: id.ino }, |i| {
            i.mode = (i.mode.get() & !0o7777 | 0o640).into()
        })
    })
    .expect("chmod");
    assert_eq!(e.getattr(id).expect("getattr").mode.get() & 0o7777, 0o640, "a chmod shows");
    // A second name and its removal change nlink.
    e.write(|w| w.link(ROOT, ROOT_DIR, b"g", id.ino, ubtrfs_format::structs::FT_REG_FILE))
        .expect("link");
    assert_eq!(e.getattr(id).expect("getattr").nlink.get(), 2);
    e.unlink(InodeId { root: ROOT, ino: ROOT_DIR }, b"g").expect("unlink g");
    assert_eq!(e.getattr(id).expect("getattr").nlink.get(), 1);
    assert_eq!(e.getattr(id).expect("getattr").as_bytes(), live(&e).as_bytes());
    // Its last name goes: the inode is removed and its copy with it.
    e.unlink(InodeId { root: ROOT, ino: ROOT_DIR }, b"f").expect("unlink f");
    let Err(err) = e.getattr(id) else { panic!("a removed inode has no attributes") };
    assert_eq!(err.posix_kind(), Some(PosixKind::NotFound), "{err}");
}

/// Indexes come from the directory's in-memory inode; evicting it rebuilds the count
/// from the last index item, so the numbering stays dense and unique.
#[test]
fn dir_index_survives_eviction_of_the_directory() {
    let img = Scratch::fixture("blake2", "inode-dir-index");
    let e = Engine::from_writer(img.writer());
    let dir = e.write(|w| w.mkdir(ROOT, ROOT_DIR, b"d", &InodeAttrs::new(0o755))).expect("mkdir");
    let d = InodeId { root: ROOT, ino: dir };
    for i in 0..40 {
        if i == 20 {
            // Room for one inode, taken by another: the directory's counter goes with
            // its eviction.
            e.set_inode_cache_capacity(1);
            e.getattr(InodeId { root: ROOT, ino: ROOT_DIR }).expect("getattr of the top directory");
            assert!(e.inodes().lookup(d).is_none(), "the directory was evicted");
            e.set_inode_cache_capacity(1024);
        }
        e.write(|w| {
            w.create_file(ROOT, dir, format!("f{i:02}").as_bytes(), &InodeAttrs::new(0o644))
        })
        .expect("create");
    }
    e.commit().expect("commit");
    drop(e);
    let fs = Filesystem::open(&OpenOptions::new(&img.path)).expect("reader");
    let root = fs.read_root(ROOT).expect("fs tree").0;
    let idx: Vec<u64> = fs
        .items_in_range(
            &root,
            &Key::new(dir, DIR_INDEX_KEY, 0),
            &Key::new(dir, DIR_INDEX_KEY, u64::MAX),
        )
        .expect("index items")
        .into_iter()
        .map(|i| i.key().offset)
        .collect();
    assert_eq!(idx, (2..42).collect::<Vec<u64>>(), "DIR_INDEX numbering across the eviction");
    drop(fs);
    if common::kernel_available("dir_index_survives_eviction_of_the_directory: btrfs check") {
        assert_check(&img.path, "after creates across an eviction");
    }
}
