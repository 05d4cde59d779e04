//! Read-only subvolumes (ROOT_ITEM flag RDONLY) refuse every change with EROFS naming
//! the subvolume, before anything changes: the writer is not aborted, other subvolumes
//! stay writable in the same transaction, and the read-only tree is byte-for-byte what
//! it was. The snapshot is flagged read-only by ubtrfs (`set_subvol_readonly`) on a
//! copy of the kernel-made `snapshots` fixture, so this runs without root; as root the
//! kernel confirms the flag (`btrfs property get`) and `btrfs check` the image.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::process::Command;
use ubtrfs_core::inode::filesystem::InodeId;
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FsRead;
use ubtrfs_core::FsWriter;
use ubtrfs_core::{Error, PosixKind};
use ubtrfs_format::structs::FT_REG_FILE;
use write_common::*;

fn assert_erofs<T: std::fmt::Debug>(r: Result<T, Error>, what: &str) {
    match r {
        Err(e) => {
            assert_eq!(e.posix_kind(), Some(PosixKind::ReadOnly), "{what}: wrong error {e}");
            let msg = e.to_string();
            assert!(
                msg.contains("subvolume snap (id "),
                "{what}: error does not name the subvolume: {msg}"
            );
            assert_eq!(msg.matches("read-only").count(), 2, "{what}: {msg}");
        }
        Ok(v) => panic!("{what}: a change to a read-only subvolume succeeded: {v:?}"),
    }
}

/// Everything under /snap as the reader sees it.
fn snap_view(img: &std::path::Path) -> Tree {
    walk_ubtrfs(img).into_iter().filter(|(p, _)| p == "snap" || p.starts_with("snap/")).collect()
}

#[test]
fn readonly_snapshot_refuses_every_change() {
    let kernel = common::kernel_available("readonly_snapshot_refuses_every_change");
    let img = Scratch::fixture("snapshots", "ro-subvol");
    let snap = img.reader().resolve("/snap", true).expect("snap").id.root;
    let sv = img.reader().resolve("/sv", true).expect("sv").id.root;
    {
        let mut w = img.writer();
        w.set_subvol_readonly(snap, true).expect("set ro");
        w.commit().expect("commit");
    }
    if kernel {
        assert_check(&img.path, "after set_subvol_readonly");
        let m = Mount::new(&img.path, false);
        let out = Command::new("btrfs")
            .args(["property", "get", "-ts"])
            .arg(m.path("snap"))
            .arg("ro")
            .output()
            .expect("run btrfs property");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "ro=true",
            "kernel view of the flag: {out:?}"
        );
        m.umount();
    }
    let before = snap_view(&img.path);
    let sha_before = img.sha256();

    let mut w = img.writer();
    let top = w.live().resolve_id("/snap", false).expect("resolve snap");
    assert_eq!(top.root, snap);
    let file = w.live().resolve_id("/snap/file-0001", false).expect("resolve file");
    let dir_attrs = InodeAttrs::new(0o755);
    let file_attrs = InodeAttrs::new(0o644);
    assert_erofs(w.mkdir(snap, top.ino, b"newdir", &dir_attrs), "mkdir");
    assert_erofs(w.create_file(snap, top.ino, b"newfile", &file_attrs), "create_file");
    assert_erofs(w.create_inode(snap, &file_attrs), "create_inode");
    assert_erofs(w.link(snap, top.ino, b"newlink", file.ino, FT_REG_FILE), "link");
    assert_erofs(w.unlink(snap, top.ino, b"file-0001"), "unlink");
    assert_erofs(w.write_file(snap, file.ino, 0, b"changed"), "write_file");
    assert_erofs(w.write_file(snap, file.ino, 1 << 20, b"appended"), "write_file past EOF");
    assert_erofs(
        w.update_inode(InodeId { root: snap, ino: file.ino }, |ii| ii.mode = 0o777.into()),
        "update_inode",
    );
    assert_erofs(
        w.drop_extents(InodeId { root: snap, ino: file.ino }, 0, u64::MAX),
        "drop_extents",
    );
    assert_erofs(w.remove_inode(InodeId { root: snap, ino: file.ino }), "remove_inode");
    let src = std::env::temp_dir().join(format!("ubtrfs-ro-src-{}", std::process::id()));
    std::fs::create_dir_all(src.join("sub")).expect("source dir");
    std::fs::write(src.join("sub/f"), b"data").expect("source file");
    // put and rm are clients of the engine, as programs on a mount are.
    let e = ubtrfs_tools::offline_engine(ubtrfs_core::Engine::from_writer(w));
    assert_erofs(
        ubtrfs_tools::put::put(&e, &[&src.join("sub/f")], "/snap/x", &Default::default()),
        "put file",
    );
    assert_erofs(
        ubtrfs_tools::put::put(
            &e,
            &[&src],
            "/snap/tree",
            &ubtrfs_tools::put::PutOptions { recursive: true, ..Default::default() },
        ),
        "put -r",
    );
    assert_erofs(ubtrfs_tools::put::remove(&e, "/snap/file-0002", false), "rm file");
    assert_erofs(ubtrfs_tools::put::remove(&e, "/snap/big-3", false), "rm big file");
    let mut w = e.into_writer().expect("engine intact");
    // The raw tree operations (a test hook) refuse the read-only tree up front too.
    let e = w
        .raw_tree()
        .insert_item(
            snap,
            &ubtrfs_format::Key::new(file.ino, ubtrfs_format::key::XATTR_ITEM_KEY, 1),
            b"x",
        )
        .expect_err("raw insert into a read-only tree");
    assert_eq!(e.posix_kind(), Some(PosixKind::ReadOnly), "{e}");
    // None of the refusals aborted the transaction: the writable subvolume still
    // takes a change, and the commit carries only that.
    w.check_writable().expect("a refused change must not abort the writer");
    let e = ubtrfs_tools::offline_engine(ubtrfs_core::Engine::from_writer(w));
    ubtrfs_tools::put::put(&e, &[&src.join("sub/f")], "/sv/after-refusals", &Default::default())
        .expect("write to the writable subvolume");
    e.sync().expect("commit");
    drop(e);
    let _ = std::fs::remove_dir_all(&src);

    assert_ne!(img.sha256(), sha_before, "the writable subvolume's change was committed");
    let after = snap_view(&img.path);
    assert_same(&before, &after, "read-only snapshot after refused changes");
    let fs = img.reader();
    let v = fs.resolve("/sv/after-refusals", true).expect("the change to sv landed");
    assert_eq!(v.size(), 4);
    assert_eq!(fs.resolve("/sv", true).unwrap().id.root, sv);
    // A reader holds the image's shared lock; a writer needs it alone.
    drop(fs);

    // Flagged writable again, the same subvolume takes changes.
    let mut w = img.writer();
    w.set_subvol_readonly(snap, false).expect("set rw");
    let top = w.live().resolve_id("/snap", false).expect("resolve snap");
    w.create_file(snap, top.ino, b"now-writable", &InodeAttrs::new(0o644))
        .expect("create in a writable snapshot");
    w.commit().expect("commit");
    drop(w);
    assert!(img.reader().resolve("/snap/now-writable", true).is_ok());
    if kernel {
        assert_check(&img.path, "after the refused changes and the rw round");
        let m = Mount::new(&img.path, false);
        assert!(
            m.path("snap/now-writable").exists(),
            "kernel sees the file created after ro was cleared"
        );
        assert!(m.path("sv/after-refusals").exists(), "kernel sees the change to sv");
        m.umount();
    }
}

#[test]
fn set_subvol_readonly_refuses_non_subvolumes() {
    let img = Scratch::fixture("snapshots", "ro-nonsubvol");
    let mut w: FsWriter = img.writer();
    let e = w.set_subvol_readonly(2, true).expect_err("the extent tree is no subvolume");
    assert_eq!(e.posix_kind(), Some(PosixKind::Invalid), "{e}");
    // The top-level subvolume can be flagged too (the kernel allows it).
    w.set_subvol_readonly(5, true).expect("fs tree ro");
    let top = w.live().resolve_id("/", false).expect("top");
    let e = w
        .create_file(5, top.ino, b"x", &InodeAttrs::new(0o644))
        .expect_err("top-level is read-only now");
    assert_eq!(e.posix_kind(), Some(PosixKind::ReadOnly), "{e}");
    assert!(e.to_string().contains("subvolume id 5"), "{e}");
}
