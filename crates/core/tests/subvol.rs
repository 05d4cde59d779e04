//! Subvolume creation and the default subvolume, against the kernel: the same
//! subvolumes made by ubtrfs on one fresh image and by `btrfs subvolume create` on a
//! kernel mount of another give the same items (root refs both ways with the same
//! directory, index and name; the parent's entries pointing at the ROOT_ITEM; each new
//! tree's top directory; the root item's fields; the UUID tree's entries), check clean,
//! list the same in `btrfs subvolume list`, and take files from either side. The default
//! subvolume ubtrfs sets is what a plain kernel mount shows. With quotas on, the new
//! subvolume gets its qgroup and `btrfs check` finds the counts right.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::collections::BTreeMap;
use std::process::Command;
use ubtrfs_core::inode::filesystem::FsRead;
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FsWriter;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;
use write_common::*;
use zerocopy::FromBytes;

const MIB: u64 = 1 << 20;

/// What must match between the two sides, with ids, addresses, times, UUIDs and
/// generations left out.
fn shape(img: &std::path::Path) -> Vec<String> {
    let mut w = FsWriter::open(&ubtrfs_core::OpenOptions::new(img)).expect("open");
    let mut out = Vec::new();
    let mut subvols = Vec::new();
    for (k, d) in w.items_in_range(ROOT_TREE_OBJECTID, &Key::MIN, &Key::MAX).expect("root tree") {
        match k.type_ {
            ROOT_ITEM_KEY
                if k.objectid >= FIRST_FREE_OBJECTID && k.objectid <= LAST_FREE_OBJECTID =>
            {
                let r = RootItem::read_from_bytes(&d).expect("root item");
                assert_ne!(r.uuid, [0; 16], "subvolume {} has no uuid", k.objectid);
                assert_eq!(
                    r.ctransid.get(),
                    r.otransid.get(),
                    "subvolume {}: ctransid/otransid",
                    k.objectid
                );
                out.push(format!(
                    "root item {}: dirid {} flags {:#x} refs {} level {} last_snapshot {} inode gen {} size {} nlink {} nbytes {} mode {:o} stransid {} rtransid {} parent {:?} received {:?}",
                    k.objectid,
                    r.root_dirid.get(),
                    r.flags.get(),
                    r.refs.get(),
                    r.level,
                    r.last_snapshot.get(),
                    r.inode.generation.get(),
                    r.inode.size.get(),
                    r.inode.nlink.get(),
                    r.inode.nbytes.get(),
                    r.inode.mode.get(),
                    r.stransid.get(),
                    r.rtransid.get(),
                    r.parent_uuid,
                    r.received_uuid,
                ));
                subvols.push((k.objectid, r.uuid));
            }
            ROOT_REF_KEY | ROOT_BACKREF_KEY => {
                let (h, name) = RootRef::read_from_prefix(&d).expect("root ref");
                out.push(format!(
                    "{} ({}, {}): dirid {} sequence {} name {}",
                    if k.type_ == ROOT_REF_KEY { "ref" } else { "backref" },
                    k.objectid,
                    k.offset,
                    h.dirid.get(),
                    h.sequence.get(),
                    String::from_utf8_lossy(name)
                ));
            }
            _ => {}
        }
    }
    for (id, uuid) in &subvols {
        for (k, d) in w.items_in_range(*id, &Key::MIN, &Key::MAX).expect("subvolume tree") {
            let extra = match k.type_ {
                INODE_ITEM_KEY => {
                    let i = InodeItem::read_from_bytes(&d).expect("inode");
                    format!(
                        "mode {:o} nlink {} size {} flags {:#x}",
                        i.mode.get(),
                        i.nlink.get(),
                        i.size.get(),
                        i.flags.get()
                    )
                }
                _ => format!("{} bytes", d.len()),
            };
            if k.objectid == FIRST_FREE_OBJECTID
                && matches!(k.type_, INODE_ITEM_KEY | INODE_REF_KEY)
            {
                out.push(format!("tree {id}: {} {} {}: {extra}", k.objectid, k.type_, k.offset));
            }
        }
        let key = ubtrfs_core::inode::subvol::uuid_key(uuid, UUID_KEY_SUBVOL);
        let items = w.items_in_range(UUID_TREE_OBJECTID, &key, &key).expect("uuid tree");
        let ids: Vec<u64> = items
            .iter()
            .flat_map(|(_, d)| d.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())))
            .collect();
        out.push(format!("uuid of {id} -> {ids:?}"));
    }
    // Every directory entry that names a subvolume, and its directory's size.
    for (id, _) in std::iter::once((FS_TREE_OBJECTID, [0; 16])).chain(subvols.iter().copied()) {
        for (k, d) in w.items_in_range(id, &Key::MIN, &Key::MAX).expect("tree") {
            if matches!(k.type_, DIR_ITEM_KEY | DIR_INDEX_KEY) {
                let (di, name) = DirItem::read_from_prefix(&d).expect("dir item");
                let loc = Key::from(&di.location);
                if loc.type_ == ROOT_ITEM_KEY {
                    let dir = w
                        .live()
                        .load_inode(
                            ubtrfs_core::inode::filesystem::InodeId { root: id, ino: k.objectid },
                            ubtrfs_core::inode::filesystem::Load::ITEM,
                        )
                        .expect("dir")
                        .item;
                    out.push(format!(
                        "tree {id} dir {} (size {}): {} {} -> ({} ROOT_ITEM {}) type {} name {}",
                        k.objectid,
                        dir.size.get(),
                        k.type_,
                        if k.type_ == DIR_INDEX_KEY { k.offset } else { 0 },
                        loc.objectid,
                        loc.offset,
                        di.type_,
                        String::from_utf8_lossy(name)
                    ));
                }
            }
        }
    }
    out
}

fn kernel_subvol_list(img: &std::path::Path) -> Vec<String> {
    let m = Mount::new(img, false);
    let out = Command::new("btrfs")
        .args(["subvolume", "list", "-p"])
        .arg(m.path(""))
        .output()
        .expect("btrfs subvolume list");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    m.umount();
    let mut v: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            // "ID 256 gen 7 parent 5 top level 5 path d/sub": drop the generation.
            let f: Vec<&str> = l.split_whitespace().collect();
            format!("{} {} parent {} top {} path {}", f[0], f[1], f[5], f[8], f[10..].join(" "))
        })
        .collect();
    v.sort();
    v
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn subvolumes_match_the_kernels() {
    if !common::kernel_available("subvolumes_match_the_kernels") {
        return;
    }
    let a = Scratch::mkfs("subvol-ours", 256 * MIB, &[]);
    let b = Scratch::mkfs("subvol-kernel", 256 * MIB, &[]);
    // Ours: /d, /d/sub, /top, /top/inner, and a file in /top/inner.
    let mut w = a.writer();
    let top = w.live().root_dir();
    let d = w.mkdir(top.root, top.ino, b"d", &InodeAttrs::new(0o755)).expect("mkdir");
    let sub = w.create_subvol(top.root, d, b"sub", &InodeAttrs::new(0o755)).expect("subvol d/sub");
    let t =
        w.create_subvol(top.root, top.ino, b"top", &InodeAttrs::new(0o755)).expect("subvol top");
    let inner = w
        .create_subvol(t, FIRST_FREE_OBJECTID, b"inner", &InodeAttrs::new(0o755))
        .expect("subvol top/inner");
    assert_eq!((sub, t, inner), (256, 257, 258), "subvolume ids");
    let e = w
        .create_subvol(top.root, top.ino, b"top", &InodeAttrs::new(0o755))
        .expect_err("a taken name");
    assert_eq!(e.posix_kind(), Some(ubtrfs_core::PosixKind::Exists), "{e}");
    let e = w
        .create_subvol(top.root, top.ino, &[b'x'; 256], &InodeAttrs::new(0o755))
        .expect_err("a long name");
    assert_eq!(e.posix_kind(), Some(ubtrfs_core::PosixKind::NameTooLong), "{e}");
    // Files inside the new trees, before the commit (the live view sees them).
    let f = w
        .create_file(inner, FIRST_FREE_OBJECTID, b"file", &InodeAttrs::new(0o644))
        .expect("create in a new subvolume");
    w.write_file(inner, f, 0, b"inside a subvolume ubtrfs made\n").expect("write");
    assert!(
        w.live().resolve_id("/top/inner/file", false).is_ok(),
        "the live view walks into new subvolumes"
    );
    w.commit().expect("commit");
    drop(w);
    assert_check(&a.path, "after creating subvolumes");
    // The kernel's.
    {
        let m = Mount::new(&b.path, true);
        std::fs::create_dir(m.path("d")).expect("mkdir");
        for p in ["d/sub", "top", "top/inner"] {
            run(Command::new("btrfs").args(["subvolume", "create"]).arg(m.path(p)));
        }
        std::fs::write(m.path("top/inner/file"), b"inside a subvolume ubtrfs made\n")
            .expect("write");
        m.umount();
    }
    let (ours, theirs) = (shape(&a.path), shape(&b.path));
    eprintln!("subvolume shape:\n{}", ours.join("\n"));
    assert!(ours.len() > 15, "{ours:?}");
    let diff: Vec<String> = ours
        .iter()
        .zip(&theirs)
        .filter(|(x, y)| x != y)
        .map(|(x, y)| format!("ours   {x}\nkernel {y}"))
        .collect();
    assert!(
        diff.is_empty() && ours.len() == theirs.len(),
        "subvolume items differ from the kernel's ({} vs {} lines):\n{}",
        ours.len(),
        theirs.len(),
        diff.join("\n")
    );
    assert_eq!(kernel_subvol_list(&a.path), kernel_subvol_list(&b.path), "btrfs subvolume list");
    // Both sides' trees read the same through the kernel.
    let (ta, tb) = {
        let ma = Mount::new(&a.path, false);
        let ta = walk_kernel(&ma.path(""));
        ma.umount();
        let mb = Mount::new(&b.path, false);
        let tb = walk_kernel(&mb.path(""));
        mb.umount();
        (ta, tb)
    };
    let strip = |t: Tree| -> BTreeMap<String, (char, u32, u64, String)> {
        t.into_iter().map(|(p, r)| (p, (r.kind, r.perm, r.size, r.content))).collect()
    };
    assert_eq!(strip(ta), strip(tb), "the kernel's walk of both images");
    // The kernel writes into a subvolume ubtrfs made; ubtrfs writes into one the
    // kernel made; both check clean.
    {
        let m = Mount::new(&a.path, true);
        std::fs::write(m.path("d/sub/k"), vec![7u8; 300_000]).expect("kernel write");
        m.umount();
    }
    assert_check(&a.path, "after the kernel wrote into our subvolume");
    let mut w = b.writer();
    let id = w.live().resolve_id("/d/sub", false).expect("resolve");
    let f = w.create_file(id.root, id.ino, b"u", &InodeAttrs::new(0o644)).expect("create");
    w.write_file(id.root, f, 0, &[9u8; 200_000]).expect("write");
    w.commit().expect("commit");
    drop(w);
    assert_check(&b.path, "after ubtrfs wrote into the kernel's subvolume");
}

/// The default subvolume ubtrfs sets is what a mount without subvol= shows, and what
/// `btrfs subvolume get-default` reports.
#[test]
fn the_default_subvolume_is_the_kernels_mount() {
    if !common::kernel_available("the_default_subvolume_is_the_kernels_mount") {
        return;
    }
    let a = Scratch::mkfs("subvol-default", 256 * MIB, &[]);
    let mut w = a.writer();
    let top = w.live().root_dir();
    let id =
        w.create_subvol(top.root, top.ino, b"rootfs", &InodeAttrs::new(0o755)).expect("subvol");
    let f = w
        .create_file(id, FIRST_FREE_OBJECTID, b"etc-release", &InodeAttrs::new(0o644))
        .expect("create");
    w.write_file(id, f, 0, b"the default\n").expect("write");
    w.set_default_subvol(id).expect("set default");
    let e = w.set_default_subvol(999).expect_err("no such subvolume");
    assert_eq!(e.posix_kind(), Some(ubtrfs_core::PosixKind::NotFound), "{e}");
    w.commit().expect("commit");
    drop(w);
    assert_check(&a.path, "after setting the default");
    let m = Mount::new(&a.path, false);
    assert_eq!(
        std::fs::read(m.path("etc-release")).expect("the default subvolume's file"),
        b"the default\n"
    );
    let out = Command::new("btrfs")
        .args(["subvolume", "get-default"])
        .arg(m.path(""))
        .output()
        .expect("get-default");
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with(&format!("ID {id} ")),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    m.umount();
    let fs = a.reader();
    assert_eq!(fs.root_dir().root, id, "ubtrfs's reader starts at the default too");
}

/// With quotas on, a new subvolume gets its level-0 qgroup, and its counts are right
/// at the commit (`btrfs check` verifies them).
#[test]
fn a_new_subvolume_gets_its_qgroup() {
    if !common::kernel_available("a_new_subvolume_gets_its_qgroup") {
        return;
    }
    let a = Scratch::mkfs("subvol-quota", 256 * MIB, &[]);
    {
        let m = Mount::new(&a.path, true);
        run(Command::new("btrfs").args(["quota", "enable"]).arg(m.path("")));
        run(Command::new("btrfs").args(["quota", "rescan", "-w"]).arg(m.path("")));
        m.umount();
    }
    let mut w = a.writer();
    let top = w.live().root_dir();
    let id = w.create_subvol(top.root, top.ino, b"q", &InodeAttrs::new(0o755)).expect("subvol");
    let f =
        w.create_file(id, FIRST_FREE_OBJECTID, b"data", &InodeAttrs::new(0o644)).expect("create");
    w.write_file(id, f, 0, &[1u8; 1 << 20]).expect("write");
    w.commit().expect("commit");
    drop(w);
    assert_check(&a.path, "quotas after a new subvolume");
    let m = Mount::new(&a.path, false);
    let out = Command::new("btrfs")
        .args(["qgroup", "show", "--raw"])
        .arg(m.path(""))
        .output()
        .expect("qgroup show");
    m.umount();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("0/{id} ")))
        .unwrap_or_else(|| panic!("no qgroup 0/{id}:\n{text}"));
    let rfer: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(rfer >= 1 << 20, "qgroup 0/{id} references {rfer} bytes: {line}");
}
