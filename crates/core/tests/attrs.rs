//! setattr against the kernel: chmod, chown (and the set-ID bits it clears), utimens,
//! and truncation down and up, through inline, regular, compressed and shared extents,
//! with and without no-holes. The kernel is the oracle for each rule: the same calls on
//! a loop mount give the same modes, owners, times, sizes and bytes; what ubtrfs
//! writes checks clean and reads back through the kernel as expected.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use ubtrfs_core::inode::attr::{SetAttr, TimeSet};
use ubtrfs_core::inode::filesystem::{FsRead, InodeId, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::inode::xattr::XattrRead;
use ubtrfs_core::FileRead;
use ubtrfs_core::FsWriter;
use ubtrfs_core::PosixKind;
use ubtrfs_format::structs::*;
use write_common::*;

fn c(p: &std::path::Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("path")
}

fn id(w: &FsWriter, path: &str) -> InodeId {
    w.live().resolve_id(&format!("/{path}"), false).unwrap_or_else(|e| panic!("/{path}: {e}"))
}

fn item(w: &FsWriter, path: &str) -> InodeItem {
    w.live().load_inode(id(w, path), Load::ITEM).expect("inode").item
}

fn read_all(w: &FsWriter, path: &str) -> Vec<u8> {
    let live = w.live();
    let v = live.load_inode(id(w, path), Load { extents: true, ..Load::ITEM }).expect("inode");
    let mut buf = vec![0u8; v.size() as usize];
    let n = live.read_at(&v, 0, &mut buf).expect("read");
    assert_eq!(n, buf.len(), "/{path}: short read");
    buf
}

/// Compare contents without printing them: the length and the first differing byte.
fn same_bytes(got: &[u8], want: &[u8], what: &str) {
    if got != want {
        let at = got.iter().zip(want).position(|(a, b)| a != b);
        panic!(
            "{what}: {} bytes read, {} expected; first difference at {at:?}",
            got.len(),
            want.len()
        );
    }
}

fn setattr(w: &mut FsWriter, path: &str, a: SetAttr) -> ubtrfs_core::Result<()> {
    let i = id(w, path);
    w.setattr(i, &a)
}

/// chown clears set-user-ID always and set-group-ID with group execute, on files, not
/// directories; chmod sets what it is given; explicit times land as given: the same
/// on both sides, field by field.
#[test]
fn chmod_chown_and_times_follow_the_kernel() {
    if !common::kernel_available("chmod_chown_and_times_follow_the_kernel") {
        return;
    }
    let k = Scratch::mkfs("attr-rules-k", 256 << 20, &[]);
    let u = Scratch::mkfs("attr-rules-u", 256 << 20, &[]);
    std::fs::copy(&k.path, &u.path).expect("copy");
    // (name, is_dir, mode set first, owner then given)
    let cases: [(&str, bool, u32, (u32, u32)); 7] = [
        ("suid", false, 0o4755, (1000, 1000)),
        ("sgid-x", false, 0o2775, (0, 1000)),
        ("sgid-nox", false, 0o2745, (0, 1000)),
        ("both", false, 0o6711, (7, 7)),
        ("dir-sgid", true, 0o2775, (1000, 1000)),
        ("same-owner", false, 0o4700, (0, 0)),
        ("plain", false, 0o640, (123, 456)),
    ];
    let mnt = Mount::new(&k.path, true);
    for (name, dir, mode, (uid, gid)) in cases {
        let p = mnt.path(name);
        if dir {
            std::fs::create_dir(&p).expect("mkdir");
        } else {
            std::fs::write(&p, b"x").expect("create");
        }
        // SAFETY: plain syscalls on a NUL-terminated path.
        unsafe {
            assert_eq!(libc::chmod(c(&p).as_ptr(), mode), 0, "chmod {name}");
            assert_eq!(libc::chown(c(&p).as_ptr(), uid, gid), 0, "chown {name}");
            let times = [
                libc::timespec { tv_sec: 1_000_000_007, tv_nsec: 123 },
                libc::timespec { tv_sec: 1_600_000_000, tv_nsec: 999_999_999 },
            ];
            assert_eq!(
                libc::utimensat(libc::AT_FDCWD, c(&p).as_ptr(), times.as_ptr(), 0),
                0,
                "utimens {name}"
            );
        }
    }
    mnt.umount();
    let mut w = u.writer();
    let top = w.live().root_dir();
    for (name, dir, mode, (uid, gid)) in cases {
        let ino = if dir {
            w.mkdir(top.root, top.ino, name.as_bytes(), &InodeAttrs::new(0o755)).expect("mkdir")
        } else {
            let ino = w
                .create_file(top.root, top.ino, name.as_bytes(), &InodeAttrs::new(0o644))
                .expect("create");
            w.write_file(top.root, ino, 0, b"x").expect("write");
            ino
        };
        w.setattr(
            InodeId { root: top.root, ino },
            &SetAttr { mode: Some(mode), ..Default::default() },
        )
        .expect("chmod");
        w.setattr(
            InodeId { root: top.root, ino },
            &SetAttr { uid: Some(uid), gid: Some(gid), ..Default::default() },
        )
        .expect("chown");
        w.setattr(
            InodeId { root: top.root, ino },
            &SetAttr {
                atime: Some(TimeSet::At(1_000_000_007, 123)),
                mtime: Some(TimeSet::At(1_600_000_000, 999_999_999)),
                ..Default::default()
            },
        )
        .expect("utimens");
    }
    w.commit().expect("commit");
    drop(w);
    assert_check(&u.path, "attributes");
    let (km, um) = (Mount::new(&k.path, false), Mount::new(&u.path, false));
    for (name, ..) in cases {
        let (a, b) = (
            std::fs::metadata(km.path(name)).expect("stat"),
            std::fs::metadata(um.path(name)).expect("stat"),
        );
        let f = |m: &std::fs::Metadata| {
            (m.mode(), m.uid(), m.gid(), m.atime(), m.atime_nsec(), m.mtime(), m.mtime_nsec())
        };
        assert_eq!(f(&b), f(&a), "{name}: (mode, uid, gid, atime, mtime) ubtrfs vs kernel");
    }
    km.umount();
    um.umount();
}

/// chown(path, -1, -1), which changes no id: `chown_common` moves ctime and takes a
/// non-directory's set-user-ID, set-group-ID (with group execute) and file
/// capabilities all the same, also through the immutable and append-only flags;
/// directories and their bits stay; the other times stay. The same calls on a kernel
/// mount and through ubtrfs, compared field by field (and the image checks clean).
#[test]
fn chown_without_ids_follows_the_kernel() {
    if !common::kernel_available("chown_without_ids_follows_the_kernel") {
        return;
    }
    // A revision 2 capability set (setcap cap_kill+ep).
    const CAPS: [u8; 20] = [1, 0, 0, 2, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    const CAP_NAME: &[u8] = b"security.capability";
    // (name, kind: 'f' file, 'd' dir, 'l' symlink, mode, FS_IOC_SETFLAGS flags, caps)
    let cases: [(&str, char, u32, u32, bool); 11] = [
        ("suid", 'f', 0o4755, 0, false),
        ("sgid-x", 'f', 0o2755, 0, false),
        ("sgid-nox", 'f', 0o2745, 0, false),
        ("both", 'f', 0o6777, 0, false),
        ("plain", 'f', 0o644, 0, false),
        ("caps", 'f', 0o755, 0, true),
        ("immutable", 'f', 0o4755, 0x10, false),
        ("append", 'f', 0o6755, 0x20, true),
        ("dir", 'd', 0o6755, 0, true),
        ("link", 'l', 0o777, 0, false),
        ("dir-immutable", 'd', 0o2755, 0x10, false),
    ];
    let img = Scratch::mkfs("attr-chown-ids", 256 << 20, &[]);
    let u = Scratch::mkfs("attr-chown-ids-u", 256 << 20, &[]);
    std::fs::copy(&img.path, &u.path).expect("copy");
    let m = Mount::new(&img.path, true);
    let mut kernel = Vec::new();
    for (name, kind, mode, flags, caps) in cases {
        let p = m.path(name);
        let cp = c(&p);
        // SAFETY: plain syscalls on NUL-terminated paths and live buffers.
        unsafe {
            match kind {
                'f' => std::fs::write(&p, b"x").expect("create"),
                'd' => std::fs::create_dir(&p).expect("mkdir"),
                _ => std::os::unix::fs::symlink("target", &p).expect("symlink"),
            }
            if kind != 'l' {
                assert_eq!(libc::chmod(cp.as_ptr(), mode), 0, "chmod {name}");
            }
            if caps {
                let n = CString::new(CAP_NAME).expect("name");
                assert_eq!(
                    libc::setxattr(cp.as_ptr(), n.as_ptr(), CAPS.as_ptr().cast(), CAPS.len(), 0),
                    0,
                    "setcap {name}: {}",
                    std::io::Error::last_os_error()
                );
            }
            let times = [
                libc::timespec { tv_sec: 1_000_000_007, tv_nsec: 123 },
                libc::timespec { tv_sec: 1_600_000_000, tv_nsec: 5 },
            ];
            assert_eq!(
                libc::utimensat(
                    libc::AT_FDCWD,
                    cp.as_ptr(),
                    times.as_ptr(),
                    libc::AT_SYMLINK_NOFOLLOW
                ),
                0,
                "utimens {name}"
            );
            if flags != 0 {
                let f = std::fs::File::open(&p).expect("open");
                let v: libc::c_int = flags as libc::c_int;
                // FS_IOC_SETFLAGS.
                assert_eq!(
                    libc::ioctl(std::os::unix::io::AsRawFd::as_raw_fd(&f), 0x4008_6602, &v),
                    0,
                    "chattr {name}: {}",
                    std::io::Error::last_os_error()
                );
            }
            let before = std::fs::symlink_metadata(&p).expect("lstat");
            std::thread::sleep(std::time::Duration::from_millis(2));
            assert_eq!(
                libc::lchown(cp.as_ptr(), u32::MAX, u32::MAX),
                0,
                "lchown {name} -1 -1: {}",
                std::io::Error::last_os_error()
            );
            let after = std::fs::symlink_metadata(&p).expect("lstat");
            let n = CString::new(CAP_NAME).expect("name");
            let has_caps = libc::lgetxattr(cp.as_ptr(), n.as_ptr(), std::ptr::null_mut(), 0) >= 0;
            kernel.push((
                after.mode(),
                (after.ctime(), after.ctime_nsec()) != (before.ctime(), before.ctime_nsec()),
                (after.mtime(), after.mtime_nsec(), after.atime(), after.atime_nsec()),
                has_caps,
            ));
            if flags != 0 {
                let f = std::fs::File::open(&p).expect("open");
                let v: libc::c_int = 0;
                assert_eq!(
                    libc::ioctl(std::os::unix::io::AsRawFd::as_raw_fd(&f), 0x4008_6602, &v),
                    0,
                    "chattr {name} back"
                );
            }
        }
    }
    m.umount();
    let mut w = u.writer();
    let top = w.live().root_dir();
    for (i, (name, kind, mode, flags, caps)) in cases.into_iter().enumerate() {
        let n = name.as_bytes();
        let ino = match kind {
            'f' => {
                let ino =
                    w.create_file(top.root, top.ino, n, &InodeAttrs::new(0o644)).expect("create");
                w.write_file(top.root, ino, 0, b"x").expect("write");
                ino
            }
            'd' => w.mkdir(top.root, top.ino, n, &InodeAttrs::new(0o755)).expect("mkdir"),
            _ => w
                .symlink(top.root, top.ino, n, b"target", &InodeAttrs::new(S_IFLNK | 0o777))
                .expect("symlink"),
        };
        if kind != 'l' {
            w.setattr(
                InodeId { root: top.root, ino },
                &SetAttr { mode: Some(mode), ..Default::default() },
            )
            .expect("chmod");
        }
        if caps {
            w.setxattr(InodeId { root: top.root, ino }, CAP_NAME, &CAPS, 0).expect("setcap");
        }
        w.setattr(
            InodeId { root: top.root, ino },
            &SetAttr {
                atime: Some(TimeSet::At(1_000_000_007, 123)),
                mtime: Some(TimeSet::At(1_600_000_000, 5)),
                ..Default::default()
            },
        )
        .expect("utimens");
        if flags != 0 {
            w.set_fsflags(InodeId { root: top.root, ino }, flags).expect("chattr");
        }
        let before = item(&w, name);
        std::thread::sleep(std::time::Duration::from_millis(2));
        w.setattr(InodeId { root: top.root, ino }, &SetAttr::chown(None, None))
            .unwrap_or_else(|e| panic!("chown {name} -1 -1: {e}"));
        let after = item(&w, name);
        let has_caps = w.live().getxattr(InodeId { root: top.root, ino }, CAP_NAME).is_ok();
        let t = |t: Timespec| (t.sec.get() as i64, i64::from(t.nsec.get()));
        let (mt, at) = (t(after.mtime), t(after.atime));
        let got = (
            after.mode.get(),
            t(after.ctime) != t(before.ctime),
            (mt.0, mt.1, at.0, at.1),
            has_caps,
        );
        assert_eq!(
            got, kernel[i],
            "{name}: (mode, ctime moved, (mtime, atime), has caps) ubtrfs vs kernel"
        );
        if flags != 0 {
            w.set_fsflags(InodeId { root: top.root, ino }, 0).expect("chattr back");
        }
    }
    w.commit().expect("commit");
    drop(w);
    assert_check(&u.path, "chown without ids");
}

/// The refusals of setattr, with the kernel's errno, changing nothing.
#[test]
fn setattr_refusals() {
    let img = if common::kernel_available("setattr_refusals") {
        Scratch::mkfs("attr-refuse", 256 << 20, &[])
    } else {
        return;
    };
    let mut w = img.writer();
    let top = w.live().root_dir();
    let mk = |w: &mut FsWriter, n: &str, flags: u64| {
        let ino = w
            .create_file(top.root, top.ino, n.as_bytes(), &InodeAttrs::new(0o644))
            .expect("create");
        w.write_file(top.root, ino, 0, b"data").expect("write");
        w.update_inode(InodeId { root: top.root, ino }, |i| i.flags = flags.into()).expect("flags");
    };
    mk(&mut w, "immutable", INODE_IMMUTABLE);
    mk(&mut w, "append", INODE_APPEND);
    w.mkdir(top.root, top.ino, b"dir", &InodeAttrs::new(0o755)).expect("mkdir");
    w.mknod(top.root, top.ino, b"fifo", &InodeAttrs::new(S_IFIFO | 0o644)).expect("mknod");
    w.commit().expect("commit");
    let at = Some(TimeSet::At(5, 5));
    let cases: [(&str, SetAttr, PosixKind); 9] = [
        ("immutable", SetAttr { mode: Some(0o600), ..Default::default() }, PosixKind::NotPermitted),
        ("immutable", SetAttr { uid: Some(1), ..Default::default() }, PosixKind::NotPermitted),
        (
            "immutable",
            SetAttr { mtime: Some(TimeSet::Now), atime: Some(TimeSet::Now), ..Default::default() },
            PosixKind::NotPermitted,
        ),
        ("immutable", SetAttr { size: Some(0), ..Default::default() }, PosixKind::NotPermitted),
        ("append", SetAttr { mtime: at, ..Default::default() }, PosixKind::NotPermitted),
        ("append", SetAttr { size: Some(1), ..Default::default() }, PosixKind::NotPermitted),
        ("dir", SetAttr { size: Some(0), ..Default::default() }, PosixKind::IsDir),
        ("fifo", SetAttr { size: Some(0), ..Default::default() }, PosixKind::Invalid),
        ("dir", SetAttr { size: Some(u64::MAX), ..Default::default() }, PosixKind::IsDir),
    ];
    for (path, a, kind) in cases {
        let before = format!("{:?}", item(&w, path).as_bytes_dbg());
        let e = setattr(&mut w, path, a).expect_err("refused");
        assert_eq!(e.posix_kind(), Some(kind), "{path} {a:?}: {e}");
        assert_eq!(
            before,
            format!("{:?}", item(&w, path).as_bytes_dbg()),
            "{path}: a refused setattr changed the inode"
        );
    }
    // A touch (both times now, utimensat(NULL): ATTR_TOUCH) of an append-only file is
    // allowed; any other set of times, one "now" included, is ATTR_TIMES_SET: EPERM.
    setattr(
        &mut w,
        "append",
        SetAttr { mtime: Some(TimeSet::Now), atime: Some(TimeSet::Now), ..Default::default() },
    )
    .expect("touch an append-only file");
    let e = setattr(&mut w, "append", SetAttr { mtime: Some(TimeSet::Now), ..Default::default() })
        .expect_err("mtime now alone");
    assert_eq!(e.posix_kind(), Some(PosixKind::NotPermitted), "{e}");
    let e = setattr(&mut w, "append", SetAttr { size: Some(u64::MAX), ..Default::default() })
        .expect_err("too big");
    assert_eq!(e.posix_kind(), Some(PosixKind::NotPermitted), "{e}");
    w.check_writable().expect("refusals do not abort");
    // The kernel agrees on each (as root, through syscalls).
    let m = Mount::new(&img.path, true);
    drop(w);
    let errno = |r: i32| {
        if r == 0 {
            0
        } else {
            std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
        }
    };
    // SAFETY: plain syscalls on NUL-terminated paths.
    unsafe {
        assert_eq!(errno(libc::chmod(c(&m.path("immutable")).as_ptr(), 0o600)), libc::EPERM);
        assert_eq!(errno(libc::truncate(c(&m.path("immutable")).as_ptr(), 0)), libc::EPERM);
        assert_eq!(errno(libc::truncate(c(&m.path("append")).as_ptr(), 1)), libc::EPERM);
        assert_eq!(errno(libc::truncate(c(&m.path("dir")).as_ptr(), 0)), libc::EISDIR);
        assert_eq!(
            errno(libc::utimensat(
                libc::AT_FDCWD,
                c(&m.path("immutable")).as_ptr(),
                std::ptr::null(),
                0
            )),
            libc::EPERM
        );
        let t =
            [libc::timespec { tv_sec: 5, tv_nsec: 5 }, libc::timespec { tv_sec: 5, tv_nsec: 5 }];
        assert_eq!(
            errno(libc::utimensat(libc::AT_FDCWD, c(&m.path("append")).as_ptr(), t.as_ptr(), 0)),
            libc::EPERM
        );
        assert_eq!(
            errno(libc::utimensat(
                libc::AT_FDCWD,
                c(&m.path("append")).as_ptr(),
                std::ptr::null(),
                0
            )),
            0
        );
        let omit_now = [
            libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT },
            libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_NOW },
        ];
        assert_eq!(
            errno(libc::utimensat(
                libc::AT_FDCWD,
                c(&m.path("append")).as_ptr(),
                omit_now.as_ptr(),
                0
            )),
            libc::EPERM
        );
    }
    m.umount();
}

trait Dbg {
    fn as_bytes_dbg(&self) -> Vec<u8>;
}
impl Dbg for InodeItem {
    fn as_bytes_dbg(&self) -> Vec<u8> {
        zerocopy::IntoBytes::as_bytes(self).to_vec()
    }
}

/// Random writes and truncations of a few files, checked against an in-memory copy
/// after every step, then through a commit, `btrfs check` and the kernel; with and
/// without no-holes, on 4 KiB and 64 KiB... sector sizes the kernel mounts here.
#[test]
fn truncation_keeps_every_byte() {
    if !common::kernel_available("truncation_keeps_every_byte") {
        return;
    }
    for (tag, args) in [("attr-trunc", &[][..]), ("attr-trunc-holes", &["-O", "^no-holes"][..])] {
        let img = Scratch::mkfs(tag, 512 << 20, args);
        let mut w = img.writer();
        let top = w.live().root_dir();
        let mut rng = Rng::new(7);
        let names = ["a", "b", "c", "d"];
        let mut model: Vec<Vec<u8>> = Vec::new();
        for n in names {
            w.create_file(top.root, top.ino, n.as_bytes(), &InodeAttrs::new(0o644))
                .expect("create");
            model.push(Vec::new());
        }
        let sizes =
            [0u64, 1, 100, 2047, 2048, 4095, 4096, 4097, 8191, 12288, 65535, 300_000, 1 << 20];
        for step in 0..240 {
            let f = rng.below(names.len() as u64) as usize;
            let path = names[f];
            if rng.chance(45) {
                let size = if rng.chance(50) { *rng.pick(&sizes) } else { rng.below(1 << 20) };
                setattr(&mut w, path, SetAttr { size: Some(size), ..Default::default() })
                    .unwrap_or_else(|e| {
                        panic!("{tag} step {step}: truncate /{path} to {size}: {e}")
                    });
                model[f].resize(size as usize, 0);
            } else {
                let off = if rng.chance(30) {
                    model[f].len() as u64 + rng.below(10_000)
                } else {
                    rng.below(model[f].len() as u64 + 1)
                };
                let len = if rng.chance(30) { rng.range(1, 3000) } else { rng.range(1, 200_000) };
                let data = rng.bytes(len as usize);
                let i = id(&w, path);
                w.write_file(i.root, i.ino, off, &data)
                    .unwrap_or_else(|e| panic!("{tag} step {step}: write /{path}: {e}"));
                model_write(&mut model[f], off, &data);
            }
            same_bytes(&read_all(&w, path), &model[f], &format!("{tag} step {step}: /{path}"));
            assert_eq!(
                item(&w, path).size.get(),
                model[f].len() as u64,
                "{tag} step {step}: /{path} size"
            );
            if rng.chance(10) {
                w.commit().expect("commit");
            }
        }
        w.commit().expect("commit");
        drop(w);
        assert_check(&img.path, tag);
        let m = Mount::new(&img.path, false);
        for (i, n) in names.iter().enumerate() {
            assert!(
                std::fs::read(m.path(n)).expect("kernel read") == model[i],
                "{tag}: /{n} as the kernel reads it"
            );
        }
        m.umount();
    }
}

/// Truncations through extents the kernel made: compressed (zstd, zlib, lzo) and
/// shared (a reflink copy): cut in the middle of a compressed extent, at an unaligned
/// size, then grown again; the copy sharing the extents keeps its bytes; the kernel
/// reads both and overwrites what is left; the image checks clean throughout.
#[test]
fn truncation_cuts_compressed_and_shared_extents() {
    if !common::kernel_available("truncation_cuts_compressed_and_shared_extents") {
        return;
    }
    let img = Scratch::mkfs("attr-trunc-comp", 512 << 20, &[]);
    let mut rng = Rng::new(11);
    // Compressible: text-like bytes.
    let text: Vec<u8> = (0..1_000_000u32)
        .map(|i| {
            b"btrfs ubtrfs truncate compressed extents\n"[(i as usize * 7 + (i as usize / 97)) % 41]
        })
        .collect();
    let mut expect = std::collections::BTreeMap::new();
    for alg in ["zstd", "zlib", "lzo"] {
        let m = Mount::new_with(&img.path, &format!("loop,compress-force={alg}"));
        std::fs::write(m.path(alg), &text).expect("write compressed");
        m.umount();
        expect.insert(alg.to_string(), text.clone());
    }
    {
        let m = Mount::new(&img.path, true);
        let random = rng.bytes(700_000);
        std::fs::write(m.path("orig"), &random).expect("write");
        let ok = std::process::Command::new("cp")
            .arg("--reflink=always")
            .arg(m.path("orig"))
            .arg(m.path("copy"))
            .status()
            .expect("cp")
            .success();
        assert!(ok, "cp --reflink");
        m.umount();
        expect.insert("orig".into(), random.clone());
        expect.insert("copy".into(), random);
    }
    let mut w = img.writer();
    for (name, size) in
        [("zstd", 200_001u64), ("zlib", 131_072 + 5), ("lzo", 4097), ("orig", 300_333)]
    {
        setattr(&mut w, name, SetAttr { size: Some(size), ..Default::default() })
            .unwrap_or_else(|e| panic!("truncate {name}: {e}"));
        let e = expect.get_mut(name).expect("name");
        e.truncate(size as usize);
        same_bytes(&read_all(&w, name), e, &format!("{name} after the cut"));
    }
    for (name, size) in [("zstd", 400_000u64), ("lzo", 10_000), ("orig", 800_000)] {
        setattr(&mut w, name, SetAttr { size: Some(size), ..Default::default() })
            .unwrap_or_else(|e| panic!("grow {name}: {e}"));
        let e = expect.get_mut(name).expect("name");
        e.resize(size as usize, 0);
        same_bytes(&read_all(&w, name), e, &format!("{name} grown again"));
    }
    w.commit().expect("commit");
    drop(w);
    assert_check(&img.path, "after the cuts");
    let m = Mount::new(&img.path, true);
    for (name, e) in &expect {
        assert!(
            &std::fs::read(m.path(name)).expect("kernel read") == e,
            "/{name} as the kernel reads it"
        );
    }
    // The kernel overwrites the cut files' ends and the shared copy.
    for name in expect.keys() {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(m.path(name)).expect("open");
        f.write_all_at(b"kernel was here", 4000).expect("write");
    }
    m.umount();
    assert_check(&img.path, "after the kernel's overwrites");
}

/// An fs-verity file (INODE_RO_VERITY, which the kernel sets when `fsverity enable`
/// seals a file) keeps its data: writes, truncations, fallocate and clones into it are
/// EPERM (`fsverity_file_open` refuses writers, `fsverity_prepare_setattr` a new
/// size), nothing changes and the filesystem stays writable; chmod and renames go on.
/// (The kernel here is built without fs-verity, so the flag is set through the engine.)
#[test]
fn fs_verity_files_refuse_data_changes() {
    if !mkfs_tools("fs_verity_files_refuse_data_changes") {
        return;
    }
    let s = Scratch::mkfs("verity", 256 << 20, &[]);
    let mut w = s.writer();
    let ino = w.create_file(5, 256, b"sealed", &InodeAttrs::new(0o644)).unwrap();
    w.write_file(5, ino, 0, &vec![7u8; 10_000]).unwrap();
    let src = w.create_file(5, 256, b"src", &InodeAttrs::new(0o644)).unwrap();
    w.write_file(5, src, 0, &vec![9u8; 8192]).unwrap();
    w.update_inode(InodeId { root: 5, ino }, |i| {
        i.flags = (i.flags.get() | INODE_RO_VERITY).into()
    })
    .unwrap();
    w.commit().unwrap();
    let before = item(&w, "sealed");
    let refused = |r: ubtrfs_core::Result<()>, what: &str| {
        let e = r.expect_err(what);
        assert_eq!(e.posix_kind(), Some(PosixKind::NotPermitted), "{what}: {e}");
    };
    refused(w.write_file(5, ino, 0, b"x").map(drop), "write");
    refused(w.write_file(5, ino, 10_000, b"x").map(drop), "append");
    refused(setattr(&mut w, "sealed", SetAttr { size: Some(0), ..SetAttr::default() }), "truncate");
    refused(w.fallocate(InodeId { root: 5, ino }, 0, 0, 1 << 20), "fallocate");
    refused(
        w.clone_range(InodeId { root: 5, ino: src }, 0, 4096, InodeId { root: 5, ino }, 0)
            .map(drop),
        "clone into it",
    );
    assert_eq!(read_all(&w, "sealed"), vec![7u8; 10_000]);
    assert_eq!(item(&w, "sealed").size.get(), before.size.get());
    // What fs-verity does not protect.
    setattr(&mut w, "sealed", SetAttr { mode: Some(0o600), ..SetAttr::default() })
        .expect("chmod of a verity file");
    w.rename(5, 256, b"sealed", 256, b"sealed2", 0).expect("rename of a verity file");
    w.commit().unwrap();
    drop(w);
    let e = ubtrfs_core::engine::Engine::open(&ubtrfs_core::OpenOptions::new(&s.path)).unwrap();
    let vid = e.read(|l| l.resolve_id("/sealed2", false)).unwrap();
    let r = e.buffered_write(vid, 0, b"y").expect_err("a buffered write");
    assert_eq!(r.posix_kind(), Some(PosixKind::NotPermitted), "{r}");
}

/// Data written before `chattr +i` or `+a` reaches the disk: the page cache's writeback
/// does not look at the flags (it was refused for a flag set after the write, so the
/// data of a small, inline, preallocated or compressed file stayed dirty forever and was
/// lost at unmount). Small and large files, immutable and append-only, written back
/// after the flag is set; what the kernel reads back is what was written.
#[test]
fn writeback_ignores_flags_set_after_the_write() {
    if !common::kernel_available("writeback_ignores_flags_set_after_the_write") {
        return;
    }
    let s = Scratch::mkfs("flags-writeback", 256 << 20, &[]);
    let e = ubtrfs_core::engine::Engine::open(&ubtrfs_core::OpenOptions::new(&s.path)).unwrap();
    let mut want = Vec::new();
    for (i, (len, flag)) in [
        (100usize, 0x10u32),
        (100, 0x20),
        (3000, 0x10),
        (200_000, 0x10),
        (200_000, 0x20),
        (5000, 0x20),
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("f{i}");
        let ino =
            e.write(|w| w.create_file(5, 256, name.as_bytes(), &InodeAttrs::new(0o644))).unwrap();
        let id = InodeId { root: 5, ino };
        if i == 5 {
            // Preallocated: written back through the direct path.
            e.fallocate(id, 0, 0, 8192).unwrap();
        }
        let data: Vec<u8> = (0..len).map(|b| (b * 7 + i) as u8).collect();
        e.buffered_write(id, 0, &data).unwrap();
        e.write(|w| w.set_fsflags(InodeId { root: 5, ino }, flag)).unwrap();
        let mut data = data;
        if i == 5 {
            // The preallocation set the size.
            data.resize(8192, 0);
        }
        want.push((name, data));
    }
    e.sync().expect("writeback and commit with the flags set");
    drop(e);
    assert_check(&s.path, "after the writeback of flagged files");
    let m = Mount::new(&s.path, false);
    for (name, data) in &want {
        assert!(
            std::fs::read(m.path(name)).unwrap() == *data,
            "{name}: the kernel reads other data"
        );
    }
    m.umount();
}
