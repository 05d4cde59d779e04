//! Namespace operations (unlink, rmdir, symlink, mknod, link, rename with its flags)
//! against the kernel: what ubtrfs writes checks clean and mounts with the expected
//! tree; every refusal has the kernel's errno and changes nothing; directory indexes,
//! sizes and link counts come out as the kernel's for the same sequence; the INODE_REF
//! room before INODE_EXTREF (or EMLINK without extref) is the kernel's to the name.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use ubtrfs_core::inode::filesystem::{FsRead, InodeId, Load};
use ubtrfs_core::inode::namespace::{RENAME_EXCHANGE, RENAME_NOREPLACE, RENAME_WHITEOUT};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FsWriter;
use ubtrfs_core::PosixKind;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;
use write_common::*;

const MIB: u64 = 1 << 20;

/// One operation, by paths relative to the top of the filesystem.
#[derive(Clone, Debug)]
enum Op {
    Mkdir(&'static str),
    Create(&'static str),
    Unlink(&'static str),
    Rmdir(&'static str),
    Symlink(String, Vec<u8>),
    Mknod(&'static str, u32, u32, u32),
    Link(&'static str, String),
    Rename(String, String, u32),
    /// chattr +i / +a (kernel side; ubtrfs side through the inode flags).
    Flags(&'static str, u64),
}

fn c(p: &std::path::Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("no NUL in test paths")
}

fn errno_of(r: libc::c_int) -> i32 {
    if r == 0 {
        0
    } else {
        std::io::Error::last_os_error().raw_os_error().expect("an errno")
    }
}

/// Run `op` on the kernel mount; 0 or the errno.
fn kernel_op(m: &Mount, op: &Op) -> i32 {
    // SAFETY: (every call below) plain syscalls on NUL-terminated paths that live
    // across the call.
    unsafe {
        match op {
            Op::Mkdir(p) => errno_of(libc::mkdir(c(&m.path(p)).as_ptr(), 0o755)),
            Op::Create(p) => {
                let fd = libc::open(
                    c(&m.path(p)).as_ptr(),
                    libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY,
                    0o644,
                );
                if fd < 0 {
                    errno_of(-1)
                } else {
                    libc::close(fd);
                    0
                }
            }
            Op::Unlink(p) => errno_of(libc::unlink(c(&m.path(p)).as_ptr())),
            Op::Rmdir(p) => errno_of(libc::rmdir(c(&m.path(p)).as_ptr())),
            Op::Symlink(p, t) => errno_of(libc::symlink(
                CString::new(t.clone()).expect("target").as_ptr(),
                c(&m.path(p)).as_ptr(),
            )),
            Op::Mknod(p, mode, ma, mi) => {
                errno_of(libc::mknod(c(&m.path(p)).as_ptr(), *mode, libc::makedev(*ma, *mi)))
            }
            Op::Link(from, to) => {
                errno_of(libc::link(c(&m.path(from)).as_ptr(), c(&m.path(to)).as_ptr()))
            }
            Op::Rename(from, to, flags) => errno_of(libc::syscall(
                libc::SYS_renameat2,
                libc::AT_FDCWD,
                c(&m.path(from)).as_ptr(),
                libc::AT_FDCWD,
                c(&m.path(to)).as_ptr(),
                *flags,
            ) as libc::c_int),
            Op::Flags(p, f) => {
                let arg = if *f & INODE_IMMUTABLE != 0 { "+i" } else { "+a" };
                let ok = std::process::Command::new("chattr")
                    .arg(arg)
                    .arg(m.path(p))
                    .status()
                    .expect("chattr")
                    .success();
                assert!(ok, "chattr {arg} {p}");
                0
            }
        }
    }
}

fn split(p: &str) -> (&str, &[u8]) {
    match p.rfind('/') {
        Some(i) => (&p[..i], &p.as_bytes()[i + 1..]),
        None => ("", p.as_bytes()),
    }
}

/// The directory at `p`, resolved as the kernel's path walk would.
fn dir_of(w: &FsWriter, p: &str) -> ubtrfs_core::Result<InodeId> {
    let id = w.live().resolve_id(&format!("/{p}"), true)?;
    if w.live().load_inode(id, Load::ITEM)?.item.mode.get() & S_IFMT != S_IFDIR {
        return Err(ubtrfs_core::Error::posix(PosixKind::NotDir, p.to_string()));
    }
    Ok(id)
}

/// Run `op` through ubtrfs; 0 or the errno.
fn ubtrfs_op(w: &mut FsWriter, op: &Op) -> i32 {
    let r = (|| -> ubtrfs_core::Result<()> {
        match op {
            Op::Mkdir(p) => {
                let (d, n) = split(p);
                let d = dir_of(w, d)?;
                w.mkdir(d.root, d.ino, n, &InodeAttrs::new(0o755)).map(drop)
            }
            Op::Create(p) => {
                let (d, n) = split(p);
                let d = dir_of(w, d)?;
                w.create_file(d.root, d.ino, n, &InodeAttrs::new(0o644)).map(drop)
            }
            Op::Unlink(p) => {
                let (d, n) = split(p);
                let d = dir_of(w, d)?;
                w.unlink(d.root, d.ino, n)
            }
            Op::Rmdir(p) => {
                let (d, n) = split(p);
                let d = dir_of(w, d)?;
                w.rmdir(d.root, d.ino, n)
            }
            Op::Symlink(p, t) => {
                let (d, n) = split(p);
                let d = dir_of(w, d)?;
                w.symlink(d.root, d.ino, n, t, &InodeAttrs::new(0o777)).map(drop)
            }
            Op::Mknod(p, mode, ma, mi) => {
                let (d, n) = split(p);
                let d = dir_of(w, d)?;
                w.mknod(
                    d.root,
                    d.ino,
                    n,
                    &InodeAttrs { rdev: rdev_encode(*ma, *mi), ..InodeAttrs::new(*mode) },
                )
                .map(drop)
            }
            Op::Link(from, to) => {
                let id = w.live().resolve_id(&format!("/{from}"), false)?;
                let (d, n) = split(to);
                let d = dir_of(w, d)?;
                let ft = ubtrfs_format::structs::ft_from_mode(
                    w.live().load_inode(id, Load::ITEM)?.item.mode.get(),
                );
                w.link(d.root, d.ino, n, id.ino, ft)
            }
            Op::Rename(from, to, flags) => {
                let ((od, on), (nd, nn)) = (split(from), split(to));
                let (od, nd) = (dir_of(w, od)?, dir_of(w, nd)?);
                w.rename(od.root, od.ino, on, nd.ino, nn, *flags)
            }
            Op::Flags(p, f) => {
                let id = w.live().resolve_id(&format!("/{p}"), false)?;
                w.update_inode(id, |i| i.flags = (i.flags.get() | f).into())
            }
        }
    })();
    match r {
        Ok(()) => 0,
        Err(e) => {
            e.posix_kind().unwrap_or_else(|| panic!("{op:?}: not a POSIX error: {e}")).errno()
        }
    }
}

fn errname(e: i32) -> String {
    if e == 0 {
        "ok".into()
    } else {
        std::io::Error::from_raw_os_error(e).to_string()
    }
}

/// A tree both sides start from.
fn base_ops() -> Vec<Op> {
    vec![
        Op::Mkdir("a"),
        Op::Mkdir("a/b"),
        Op::Mkdir("a/b/c"),
        Op::Mkdir("empty"),
        Op::Mkdir("full"),
        Op::Create("full/f"),
        Op::Create("file"),
        Op::Create("other"),
        Op::Link("file", "hard".into()),
        Op::Mkdir("frozen"),
        Op::Create("frozen/in"),
        Op::Flags("frozen", INODE_IMMUTABLE),
        Op::Mkdir("log"),
        Op::Create("log/in"),
        Op::Flags("log", INODE_APPEND),
        Op::Create("locked"),
        Op::Flags("locked", INODE_IMMUTABLE),
    ]
}

fn long(n: usize) -> String {
    "n".repeat(n)
}

/// Every refusal below (and a few successes at the edges): the kernel's errno, and
/// ubtrfs's; then, with the successes replayed on both, the same tree.
fn refusal_ops() -> Vec<Op> {
    let r = |a: &str, b: &str, f: u32| Op::Rename(a.into(), b.into(), f);
    vec![
        Op::Unlink("missing"),
        Op::Unlink("empty"),
        Op::Unlink("missing/x"),
        Op::Unlink("file/x"),
        Op::Rmdir("file"),
        Op::Rmdir("full"),
        Op::Rmdir("missing"),
        Op::Mkdir("file"),
        Op::Mkdir("empty"),
        Op::Create("file/x"),
        Op::Create("frozen/new"),
        Op::Unlink("frozen/in"),
        Op::Unlink("log/in"),
        Op::Create("log/new"),
        Op::Unlink("locked"),
        Op::Symlink("s-empty".into(), Vec::new()),
        Op::Symlink("s-path-max".into(), vec![b'x'; 4096]),
        Op::Symlink("s-longest".into(), vec![b'y'; 4095]),
        Op::Symlink("file".into(), b"t".to_vec()),
        Op::Symlink(long(256), b"t".to_vec()),
        Op::Link("empty", "empty-link".into()),
        Op::Link("file", "other".into()),
        Op::Link("locked", "locked-link".into()),
        Op::Link("missing", "x".into()),
        Op::Mknod("m-dir", libc::S_IFDIR | 0o755, 0, 0),
        Op::Mknod("m-bad", 0o170000, 0, 0),
        Op::Mknod("m-fifo", libc::S_IFIFO | 0o600, 0, 0),
        Op::Mknod("m-reg", 0o640, 0, 0),
        r("missing", "x", 0),
        r("a", "file", 0),
        r("file", "empty", 0),
        r("a", "full", 0),
        r("a", "a/b/inside", 0),
        r("a", "a/inside", 0),
        r("a/b/c", "a", 0),
        r("a/b", "a/b/c/d", RENAME_EXCHANGE),
        r("a/b/c", "a", RENAME_EXCHANGE),
        r("file", "other", RENAME_NOREPLACE),
        r("file", "nothing", RENAME_EXCHANGE),
        r("file", "other", RENAME_EXCHANGE | RENAME_NOREPLACE),
        r("file", "other", RENAME_EXCHANGE | RENAME_WHITEOUT),
        r("file", "other", 8),
        r("file", &long(256), 0),
        r(&long(256), "x", 0),
        r("frozen/in", "out", 0),
        r("file", "frozen/in", 0),
        r("log/in", "out", 0),
        r("locked", "unlocked", 0),
        r("file", "hard", 0),
        r("hard", "hard", 0),
        r("missing/x", "y", 0),
        r("file", "missing/y", 0),
        r("file", "other/y", 0),
    ]
}

/// Apply `ops` to a kernel mount of `kimg` and through ubtrfs to `uimg` (one commit),
/// comparing each result; a failing op must leave the ubtrfs tree unchanged.
fn run_both(kimg: &std::path::Path, uimg: &Scratch, ops: &[Op], what: &str) {
    let mnt = Mount::new(kimg, true);
    let mut w = uimg.writer();
    let mut bad = Vec::new();
    for op in ops {
        let k = kernel_op(&mnt, op);
        let before = fs_items(&mut w);
        let u = ubtrfs_op(&mut w, op);
        if u != 0 {
            assert!(
                before == fs_items(&mut w),
                "{what}: {op:?} failed ({}) but changed the tree",
                errname(u)
            );
        }
        if k != u {
            bad.push(format!("{op:?}: kernel {}, ubtrfs {}", errname(k), errname(u)));
        }
    }
    w.commit().expect("commit");
    drop(w);
    mnt.umount();
    assert!(
        bad.is_empty(),
        "{what}: {} results differ from the kernel's:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

/// Every fs-tree item with its data, less what differs between equal trees made at
/// other times: inode items (times, transids) are compared as the fields that matter.
fn fs_items(w: &mut FsWriter) -> Vec<(Key, Vec<u8>)> {
    w.items_in_range(FS_TREE_OBJECTID, &Key::new(0, 0, 0), &Key::new(u64::MAX, u8::MAX, u64::MAX))
        .expect("fs tree")
}

/// What two trees made by the same operations must share: for each item, its key
/// (inode numbers included: both allocate the next free one) and, for inode items, the
/// mode, owner, size, nbytes, nlink, rdev and flags; for dir entries and refs their
/// bytes without transids; for inline extents the data.
fn comparable(img: &std::path::Path) -> BTreeMap<(u64, u8, u64), String> {
    let mut w = FsWriter::open(&ubtrfs_core::OpenOptions::new(img)).expect("open");
    let mut out = BTreeMap::new();
    for (k, d) in fs_items(&mut w) {
        let v = match k.type_ {
            INODE_ITEM_KEY => {
                let (ii, _) =
                    <InodeItem as zerocopy::FromBytes>::read_from_prefix(&d).expect("inode item");
                format!(
                    "mode {:o} uid {} gid {} size {} nbytes {} nlink {} rdev {:#x} flags {:#x}",
                    ii.mode.get(),
                    ii.uid.get(),
                    ii.gid.get(),
                    ii.size.get(),
                    ii.nbytes.get(),
                    ii.nlink.get(),
                    ii.rdev.get(),
                    ii.flags.get()
                )
            }
            DIR_ITEM_KEY | DIR_INDEX_KEY => {
                let mut v = Vec::new();
                for e in ubtrfs_format::items::dir_entries(&d) {
                    let e = e.expect("dir entry");
                    v.push(format!(
                        "{} -> {} type {}",
                        String::from_utf8_lossy(e.name),
                        e.location.objectid,
                        e.type_
                    ));
                }
                v.join(", ")
            }
            EXTENT_DATA_KEY if d.get(20) == Some(&FILE_EXTENT_INLINE) => {
                format!("inline {}", hex(&d[21..]))
            }
            EXTENT_DATA_KEY => format!("extent {}", hex(&d[8..])),
            _ => hex(&d),
        };
        out.insert((k.objectid, k.type_, k.offset), v);
    }
    out
}

fn assert_same_items(kimg: &std::path::Path, uimg: &std::path::Path, what: &str) {
    let (k, u) = (comparable(kimg), comparable(uimg));
    let mut d = Vec::new();
    for (key, kv) in &k {
        match u.get(key) {
            None => d.push(format!("only the kernel has {key:?}: {kv}")),
            Some(uv) if uv != kv => d.push(format!("{key:?}:\n    kernel {kv}\n    ubtrfs {uv}")),
            _ => {}
        }
    }
    for (key, uv) in &u {
        if !k.contains_key(key) {
            d.push(format!("only ubtrfs has {key:?}: {uv}"));
        }
    }
    assert!(
        d.is_empty(),
        "{what}: {} differences:\n{}",
        d.len(),
        d.iter().take(30).cloned().collect::<Vec<_>>().join("\n")
    );
}

/// The kernel's and ubtrfs's images after the same operations, both from one mkfs.
fn twin_images(tag: &str, mkfs_args: &[&str], base: &[Op]) -> (Scratch, Scratch) {
    let k = Scratch::mkfs(&format!("{tag}-kernel"), 256 * MIB, mkfs_args);
    let u = Scratch::mkfs(&format!("{tag}-ubtrfs"), 256 * MIB, mkfs_args);
    std::fs::copy(&k.path, &u.path).expect("copy the image");
    run_both(&k.path, &u, base, &format!("{tag}: base tree"));
    (k, u)
}

#[test]
fn refusals_have_the_kernels_errno_and_change_nothing() {
    if !common::kernel_available("refusals_have_the_kernels_errno_and_change_nothing") {
        return;
    }
    let (k, u) = twin_images("ns-refusals", &[], &base_ops());
    run_both(&k.path, &u, &refusal_ops(), "refusals");
    assert_check(&u.path, "after the refusals");
    assert_same_items(&k.path, &u.path, "after the refusals");
}

/// The same renames, links and removals on both sides give the same items: the same
/// inode numbers, DIR_INDEX numbers, directory sizes, link counts and refs.
#[test]
fn renames_and_links_number_entries_as_the_kernel_does() {
    if !common::kernel_available("renames_and_links_number_entries_as_the_kernel_does") {
        return;
    }
    let (k, u) = twin_images("ns-numbering", &[], &base_ops());
    let r = |a: &str, b: &str, f: u32| Op::Rename(a.into(), b.into(), f);
    let ops = vec![
        Op::Create("a/x"),
        Op::Create("a/b/y"),
        Op::Symlink("a/sym".into(), b"../file".to_vec()),
        Op::Mknod("a/fifo", libc::S_IFIFO | 0o644, 0, 0),
        Op::Mknod("a/chr", libc::S_IFCHR | 0o600, 1, 3),
        Op::Mknod("a/blk", libc::S_IFBLK | 0o600, 259, 70000),
        Op::Mknod("a/sock", libc::S_IFSOCK | 0o755, 0, 0),
        // Over a file with two names, over a file with one, across directories.
        r("a/x", "file", 0),
        r("other", "a/b/y", 0),
        r("a/b/y", "a/y2", 0),
        // A directory over an empty one, into another, and back.
        r("a/b/c", "empty", 0),
        r("empty", "a/b/moved", 0),
        r("a/b/moved", "top-again", 0),
        // Same directory, new name; onto a free name with NOREPLACE.
        r("a/sym", "a/sym2", 0),
        r("a/fifo", "a/fifo2", RENAME_NOREPLACE),
        // Exchanges: file with directory across directories, within one directory.
        r("a/y2", "full", RENAME_EXCHANGE),
        r("a/chr", "a/blk", RENAME_EXCHANGE),
        // A whiteout left behind.
        r("a/sock", "sock-moved", RENAME_WHITEOUT),
        Op::Link("a/full", "a/full-link".into()),
        Op::Unlink("hard"),
        Op::Rmdir("top-again"),
    ];
    run_both(&k.path, &u, &ops, "renames");
    assert_check(&u.path, "after the renames");
    assert_same_items(&k.path, &u.path, "after the renames");
    // And what the kernel sees of ubtrfs's image is what it made itself.
    let kt = {
        let m = Mount::new(&k.path, false);
        let t = walk_kernel(&m.dir);
        m.umount();
        t
    };
    let ut = {
        let m = Mount::new(&u.path, false);
        let t = walk_kernel(&m.dir);
        m.umount();
        t
    };
    assert_same(&kt, &ut, "kernel walks of the two images");
}

/// Names of 252-253 bytes fill a file's INODE_REF for one directory, then go to
/// INODE_EXTREF; without the extref feature the first name that does not fit is
/// EMLINK. The item may grow to a whole leaf less its header (BTRFS_MAX_ITEM_SIZE);
/// the number of names that fit is the kernel's, and the kernel reads and removes
/// every name ubtrfs made.
#[test]
fn inode_ref_room_is_the_kernels() {
    if !common::kernel_available("inode_ref_room_is_the_kernels") {
        return;
    }
    // Name lengths chosen so that one item header more or less in the limit changes
    // the count: after the first name's 11 bytes, 4 KiB leaves take 15 entries of 263
    // bytes (3945 of 3959; 14 with 25 bytes less), 16 KiB leaves 62 of 262 (16244 of
    // 16247).
    for (tag, args, len, nodesize) in [
        ("ns-ref-room", &["-O", "^extref", "-n", "4096"][..], 253usize, 4096usize),
        ("ns-ref-room-16k", &["-O", "^extref", "-n", "16384"][..], 252, 16384),
    ] {
        let (k, u) = twin_images(tag, args, &[Op::Create("f")]);
        let entry = 10 + len;
        let room = nodesize - 101 - 25 - 11;
        assert_ne!(
            room / entry,
            (room - 25) / entry,
            "{tag}: the name length makes one header count"
        );
        // One op list, run on both: links until EMLINK.
        let names: Vec<String> =
            (0..80).map(|i| format!("{i:03}{}", "l".repeat(len - 3))).collect();
        let ops: Vec<Op> = names.iter().map(|n| Op::Link("f", n.clone())).collect();
        let mnt = Mount::new(&k.path, true);
        let kres: Vec<i32> = ops.iter().map(|o| kernel_op(&mnt, o)).collect();
        mnt.umount();
        let mut w = u.writer();
        let ures: Vec<i32> = ops.iter().map(|o| ubtrfs_op(&mut w, o)).collect();
        w.commit().expect("commit");
        drop(w);
        let fit = |r: &[i32]| r.iter().take_while(|&&e| e == 0).count();
        let (kfit, ufit) = (fit(&kres), fit(&ures));
        assert_eq!(kfit, room / entry, "{tag}: the kernel's room");
        assert_eq!(ures, kres, "{tag}: ubtrfs fits {ufit} names, the kernel {kfit}");
        assert_check(&u.path, tag);
        assert_same_items(&k.path, &u.path, tag);
        // The kernel sees every name, and removes them all.
        let mnt = Mount::new(&u.path, true);
        assert_eq!(std::fs::metadata(mnt.path("f")).expect("stat").len(), 0);
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(mnt.path("f")).expect("stat").nlink(), 1 + ufit as u64);
        for n in &names[..ufit] {
            std::fs::remove_file(mnt.path(n))
                .unwrap_or_else(|e| panic!("{tag}: kernel unlink {n}: {e}"));
        }
        mnt.umount();
        assert_check(&u.path, &format!("{tag}: after the kernel's unlinks"));
    }
    // With extref, the same names all go in: the overflow lands in INODE_EXTREFs.
    let (k, u) = twin_images("ns-extref", &["-n", "4096"], &[Op::Create("f"), Op::Mkdir("d")]);
    let ops: Vec<Op> = (0..40)
        .flat_map(|i| {
            [
                Op::Link("f", format!("{i:03}{}", "e".repeat(252))),
                Op::Link("f", format!("d/{i:03}{}", "e".repeat(252))),
            ]
        })
        .collect();
    run_both(&k.path, &u, &ops, "extref links");
    let ops: Vec<Op> = (0..40)
        .step_by(3)
        .map(|i| Op::Unlink(Box::leak(format!("{i:03}{}", "e".repeat(252)).into_boxed_str())))
        .collect();
    run_both(&k.path, &u, &ops, "extref unlinks");
    assert_check(&u.path, "extref links");
    assert_same_items(&k.path, &u.path, "extref links");
    let mut w = u.writer();
    let f = w.live().resolve_id("/f", false).expect("f");
    let extrefs = w
        .items_in_range(
            5,
            &Key::new(f.ino, INODE_EXTREF_KEY, 0),
            &Key::new(f.ino, INODE_EXTREF_KEY, u64::MAX),
        )
        .expect("extrefs");
    assert!(!extrefs.is_empty(), "the overflow went to INODE_EXTREF");
}

/// At the kernel's link limit, one more link is EMLINK and changes nothing.
#[test]
fn link_limit_is_emlink() {
    let img = if common::kernel_available("link_limit_is_emlink") {
        Scratch::mkfs("ns-emlink", 256 * MIB, &[])
    } else {
        Scratch::fixture("plain", "ns-emlink")
    };
    let mut w = img.writer();
    let top = w.live().root_dir();
    let ino = w.create_file(top.root, top.ino, b"many", &InodeAttrs::new(0o644)).expect("create");
    w.update_inode(InodeId { root: top.root, ino }, |i| {
        i.nlink = (ubtrfs_core::inode::write::LINK_MAX - 1).into()
    })
    .expect("set nlink");
    w.link(top.root, top.ino, b"one-more", ino, FT_REG_FILE).expect("the last link that fits");
    let before = fs_items(&mut w);
    let e = w.link(top.root, top.ino, b"too-many", ino, FT_REG_FILE).expect_err("past LINK_MAX");
    assert_eq!(e.posix_kind(), Some(PosixKind::TooManyLinks), "{e}");
    assert!(before == fs_items(&mut w), "the refused link changed the tree");
}

/// A round trip of every new kind through the model: symlinks up to the longest
/// target, special files, renames of each sort, then the kernel reads it all, changes
/// it, and the image checks clean again.
#[test]
fn symlinks_special_files_and_renames_round_trip() {
    let kernel = common::kernel_available("symlinks_special_files_and_renames_round_trip");
    let img = if kernel { Scratch::mkfs("ns-round", 256 * MIB, &["-n", "4096"]) } else { return };
    let mut m = Model::load(&img.path);
    let mut w = img.writer();
    let longest = ubtrfs_core::inode::namespace::max_symlink_len(4096);
    assert_eq!(longest, 3949);
    m.w_mkdir(&mut w, "d", 0o755);
    m.w_mkdir(&mut w, "d/e", 0o700);
    m.w_create(&mut w, "d/f", 0o644, b"file data");
    m.w_symlink(&mut w, "d/short", b"f");
    m.w_symlink(&mut w, "d/longest", &vec![b'z'; longest]);
    let top = w.live().root_dir();
    let e = w
        .symlink(top.root, top.ino, b"too-long", &vec![b'z'; longest + 1], &InodeAttrs::new(0o777))
        .expect_err("past the inline room");
    assert_eq!(e.posix_kind(), Some(PosixKind::NameTooLong), "{e}");
    m.w_mknod(&mut w, "d/fifo", S_IFIFO | 0o644, 0);
    m.w_mknod(&mut w, "d/null", S_IFCHR | 0o666, rdev_encode(1, 3));
    m.w_mknod(&mut w, "d/disk", S_IFBLK | 0o660, rdev_encode(259, 70000));
    m.w_mknod(&mut w, "d/sock", S_IFSOCK | 0o755, 0);
    m.w_create(&mut w, "g", 0o600, &vec![7u8; 100_000]);
    m.w_rename(&mut w, "g", "d/f", 0);
    m.w_rename(&mut w, "d/e", "e", 0);
    m.w_rename(&mut w, "d/short", "e", RENAME_EXCHANGE);
    m.w_rename(&mut w, "d/fifo", "fifo", RENAME_WHITEOUT);
    m.w_rename(&mut w, "d/null", "null", RENAME_NOREPLACE);
    w.commit().expect("commit");
    drop(w);
    verify_all(&img.path, &m, true, "ubtrfs's namespace");
    // The kernel renames and removes what ubtrfs made.
    {
        let mnt = Mount::new(&img.path, true);
        std::fs::rename(mnt.path("d/longest"), mnt.path("longest")).expect("kernel rename");
        m.rename("d/longest", "longest", 0);
        std::fs::remove_file(mnt.path("d/fifo")).expect("kernel removes the whiteout");
        m.record_unlink("d/fifo");
        std::fs::remove_dir(mnt.path("d/short")).expect("kernel rmdir of the exchanged directory");
        m.record_unlink("d/short");
        mnt.umount();
    }
    assert_check(&img.path, "after the kernel's changes");
    verify_kernel(&img.path, &m, "after the kernel's changes");
    verify_ubtrfs(&img.path, &m, "after the kernel's changes");
}

/// The engine's calls for names, flags and subvolumes (`Engine::link`,
/// `rename_with_owner`, `set_fsflags`, `create_subvol`, `set_default_subvol`,
/// `set_subvol_readonly`, `abort`): each is one call by `InodeId`; names never cross a
/// subvolume (EXDEV); a RENAME_WHITEOUT leaves a whiteout owned by the caller; a
/// subvolume flagged read-only refuses changes; after an abort every change is EROFS.
#[test]
fn names_flags_and_subvolumes_through_the_engine() {
    use ubtrfs_core::engine::Engine;
    use ubtrfs_core::error::Error;
    use ubtrfs_core::inode::attr::fsflags;
    let img = Scratch::mkfs("ns-engine", 256 * MIB, &[]);
    let engine = Engine::from_writer(img.writer());
    let top = engine.read(|l| Ok(l.root_dir())).expect("root");
    let kind = |r: ubtrfs_core::Result<()>| r.map_err(|e| e.posix_kind());
    let a = InodeAttrs::new(0o644);
    let f = engine.create_file(top, b"f", &a, 0).expect("create");
    let d = engine.mkdir(top, b"d", &InodeAttrs::new(0o755), 0).expect("mkdir");

    engine.link(f, d, b"f-link").expect("link");
    assert_eq!(engine.getattr(f).expect("getattr").nlink.get(), 2);
    engine.rename_with_owner(d, b"f-link", top, b"g", 0, (0, 0)).expect("rename");
    engine.rename_with_owner(top, b"g", d, b"h", RENAME_WHITEOUT, (1000, 100)).expect("whiteout");
    let w = engine.read(|l| l.lookup(top, b"g")).expect("lookup").expect("the whiteout");
    let wa = engine.getattr(w.target).expect("getattr");
    assert_eq!((wa.mode.get(), wa.rdev.get(), wa.uid.get(), wa.gid.get()), (S_IFCHR, 0, 1000, 100));

    engine.set_fsflags(f, fsflags::NOATIME).expect("chattr +A");
    assert_ne!(engine.getattr(f).expect("getattr").flags.get() & INODE_NOATIME, 0);
    assert_eq!(
        kind(engine.set_fsflags(f, fsflags::COMPR | fsflags::NOCOMP)),
        Err(Some(PosixKind::Invalid))
    );
    engine.setxattr(f, b"user.a", b"1", 0, false).expect("setxattr");
    engine.removexattr(f, b"user.a").expect("removexattr");
    assert_eq!(kind(engine.removexattr(f, b"user.a")), Err(Some(PosixKind::NoData)));

    let sv = engine.create_subvol(top, b"sv", &InodeAttrs::new(0o755)).expect("subvolume");
    let sv_top = InodeId { root: sv, ino: FIRST_FREE_OBJECTID };
    assert_eq!(kind(engine.link(f, sv_top, b"x")), Err(Some(PosixKind::CrossDevice)));
    assert_eq!(
        kind(engine.rename_with_owner(top, b"f", sv_top, b"x", 0, (0, 0))),
        Err(Some(PosixKind::CrossDevice))
    );
    engine.set_default_subvol(sv).expect("default");
    assert_eq!(engine.read(|l| Ok(FsRead::default_subvol(l))).expect("read"), sv);
    engine.set_subvol_readonly(sv, true).expect("read-only");
    let refused = engine.create_file(sv_top, b"x", &a, 0).map(|_| ());
    assert_eq!(kind(refused), Err(Some(PosixKind::ReadOnly)));
    engine.set_subvol_readonly(sv, false).expect("writable again");
    engine.create_file(sv_top, b"x", &a, 0).expect("create in the subvolume");
    engine.commit().expect("commit");

    engine.abort("test", &Error::posix(PosixKind::Busy, "the test aborts")).expect("abort");
    assert_eq!(kind(engine.setxattr(f, b"user.b", b"1", 0, false)), Err(Some(PosixKind::ReadOnly)));
    drop(engine);
    assert_check(&img.path, "after the engine's names, flags and subvolumes");
}
