//! Extended attributes on the write engine against the kernel: every errno of
//! setxattr/removexattr (the same operations run through ubtrfs and through a kernel
//! loop mount of the same image, each failure leaving the trees untouched), names that
//! share one item through a hash collision, the size limits at the byte, a leaf-splitting
//! number of xattrs, ACLs folding into the mode, the `btrfs.compression` property (its
//! xattr, its inode flags, its incompat bit), and both directions of the round trip:
//! what ubtrfs sets, the kernel reads, and what the kernel sets, ubtrfs reads.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::collections::HashMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Command;
use ubtrfs_core::compression::CompressionType;
use ubtrfs_core::engine::Engine;
use ubtrfs_core::inode::filesystem::{Filesystem, InodeId, Load};
use ubtrfs_core::inode::xattr::{
    max_xattr_size, CompressionProperty, XattrReply, XATTR_CREATE, XATTR_REPLACE,
};
use ubtrfs_core::FsWriter;
use ubtrfs_core::{FsRead, OpenOptions, PosixKind, TreeView, XattrRead};
use ubtrfs_format::features::{INCOMPAT_COMPRESS_LZO, INCOMPAT_COMPRESS_ZSTD};
use ubtrfs_format::hash::name_hash;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;
use write_common::{assert_check, Mount, Scratch};

const MIB: u64 = 1 << 20;

/// Two `user.` names with the same name hash, found by brute force (a 32-bit hash
/// collides within about 2^16 names).
fn colliding_pair(prefix: &str) -> (Vec<u8>, Vec<u8>) {
    let mut seen: HashMap<u64, Vec<u8>> = HashMap::new();
    for i in 0u64.. {
        let n = format!("{prefix}{i}").into_bytes();
        let h = name_hash(&n);
        if let Some(prev) = seen.insert(h, n.clone()) {
            assert_eq!(name_hash(&prev), name_hash(&n));
            return (prev, n);
        }
    }
    unreachable!()
}

/// Every item of fs tree 5 as the running transaction sees it.
fn fs_items(w: &mut FsWriter) -> Vec<(Key, Vec<u8>)> {
    w.items_in_range(FS_TREE_OBJECTID, &Key::new(0, 0, 0), &Key::new(u64::MAX, u8::MAX, u64::MAX))
        .expect("fs tree items")
}

fn id_of(w: &FsWriter, path: &str) -> InodeId {
    w.live().resolve_id(path, false).unwrap_or_else(|e| panic!("resolve {path}: {e}"))
}

/// The errno of a result (0 for success).
fn errno_of(r: &ubtrfs_core::Result<()>) -> i32 {
    match r {
        Ok(()) => 0,
        Err(e) => e.posix_kind().unwrap_or_else(|| panic!("not a POSIX error: {e}")).errno(),
    }
}

fn errno_name(e: i32) -> String {
    if e == 0 {
        "ok".into()
    } else {
        format!("{} ({e})", std::io::Error::from_raw_os_error(e))
    }
}

/// An ACL's xattr bytes from (tag, perm, id) entries.
fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for &(t, p, i) in entries {
        v.extend_from_slice(&t.to_le_bytes());
        v.extend_from_slice(&p.to_le_bytes());
        v.extend_from_slice(&i.to_le_bytes());
    }
    v
}
const NOID: u32 = u32::MAX;

#[derive(Clone, Debug)]
enum Op {
    Set { path: &'static str, name: Vec<u8>, value: Vec<u8>, flags: u32 },
    Remove { path: &'static str, name: Vec<u8> },
}

impl Op {
    fn path(&self) -> &'static str {
        match self {
            Op::Set { path, .. } | Op::Remove { path, .. } => path,
        }
    }
    fn describe(&self) -> String {
        match self {
            Op::Set { path, name, value, flags } => format!(
                "set {path} {} ({} bytes, flags {flags})",
                String::from_utf8_lossy(name),
                value.len()
            ),
            Op::Remove { path, name } => format!("remove {path} {}", String::from_utf8_lossy(name)),
        }
    }
    fn ubtrfs(&self, w: &mut FsWriter) -> ubtrfs_core::Result<()> {
        let id = id_of(w, self.path());
        match self {
            Op::Set { name, value, flags, .. } => w.setxattr(id, name, value, *flags),
            Op::Remove { name, .. } => w.removexattr(id, name),
        }
    }
    /// The same through the kernel: l*xattr(2) on the mount (symlinks not followed).
    fn kernel(&self, mnt: &Path) -> i32 {
        let p = CString::new(mnt.join(&self.path()[1..]).as_os_str().as_bytes()).expect("path");
        let r = match self {
            Op::Set { name, value, flags, .. } => {
                let n = CString::new(name.clone()).expect("name");
                // SAFETY: both strings are NUL-terminated and live across the call; the
                // value pointer and length describe one live buffer.
                unsafe {
                    libc::lsetxattr(
                        p.as_ptr(),
                        n.as_ptr(),
                        value.as_ptr().cast(),
                        value.len(),
                        *flags as i32,
                    )
                }
            }
            Op::Remove { name, .. } => {
                let n = CString::new(name.clone()).expect("name");
                // SAFETY: both strings are NUL-terminated and live across the call.
                unsafe { libc::lremovexattr(p.as_ptr(), n.as_ptr()) }
            }
        };
        if r == 0 {
            0
        } else {
            std::io::Error::last_os_error().raw_os_error().expect("errno")
        }
    }
}

/// The objects every operation table works on.
const PATHS: [&str; 10] = ["/f", "/g", "/h", "/i", "/a", "/c", "/d", "/l", "/p", "/e"];

/// An image holding a file of each kind the rules tell apart (made with
/// `mkfs.btrfs --rootdir`, no kernel needed), then through ubtrfs: `user.x` on /i, and
/// the flags immutable (/i), append-only (/a), nodatacow + nodatasum (/c).
fn objects_image(tag: &str) -> Scratch {
    let host =
        std::env::temp_dir().join(format!("ubtrfs-xattr-rootdir-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&host);
    std::fs::create_dir_all(host.join("d")).expect("rootdir");
    std::fs::create_dir_all(host.join("e")).expect("rootdir");
    for f in ["f", "g", "h", "i", "a", "c"] {
        std::fs::write(host.join(f), b"data").expect("rootdir file");
        std::fs::set_permissions(host.join(f), std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .expect("chmod");
    }
    std::os::unix::fs::symlink("f", host.join("l")).expect("symlink");
    let fifo = CString::new(host.join("p").as_os_str().as_bytes()).expect("path");
    assert_eq!(
        // SAFETY: a NUL-terminated path that lives across the call.
        unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) },
        0,
        "mkfifo: {}",
        std::io::Error::last_os_error()
    );
    let s = Scratch::mkfs(tag, 256 * MIB, &["--rootdir", host.to_str().expect("utf-8 temp dir")]);
    std::fs::remove_dir_all(&host).expect("remove rootdir");
    let mut w = s.writer();
    let i = id_of(&w, "/i");
    w.setxattr(i, b"user.x", b"1", 0).expect("user.x on /i");
    for (p, fl) in
        [("/i", INODE_IMMUTABLE), ("/a", INODE_APPEND), ("/c", INODE_NODATACOW | INODE_NODATASUM)]
    {
        let id = id_of(&w, p);
        w.update_inode(id, |ii| ii.flags = (ii.flags.get() | fl).into()).expect("flags");
    }
    w.commit().expect("commit");
    drop(w);
    s
}

/// The operation table, with the errno the kernel returns for each (0: success),
/// applied in order. The values and flags before each step are what earlier steps
/// left, on both sides.
fn op_table(nodesize: u32) -> Vec<(Op, i32)> {
    let set = |path, name: &[u8], value: &[u8], flags| Op::Set {
        path,
        name: name.to_vec(),
        value: value.to_vec(),
        flags,
    };
    let rm = |path, name: &[u8]| Op::Remove { path, name: name.to_vec() };
    let (n1, n2) = colliding_pair("user.c");
    let max = max_xattr_size(nodesize);
    let big = b"user.big";
    let long255 = [b"user.".as_slice(), &[b'a'; 250]].concat();
    let long256 = [b"user.".as_slice(), &[b'a'; 251]].concat();
    let acl_equiv = acl(&[(1, 7, NOID), (4, 4, NOID), (0x20, 0, NOID)]);
    let acl_named =
        acl(&[(1, 6, NOID), (2, 6, 1000), (4, 4, NOID), (0x10, 6, NOID), (0x20, 4, NOID)]);
    let acl_no_mask = acl(&[(1, 6, NOID), (2, 6, 1000), (4, 4, NOID), (0x20, 4, NOID)]);
    let acl_bad_tag = acl(&[(1, 6, NOID), (0x40, 4, NOID), (0x20, 4, NOID)]);
    let acl_bad_perm = acl(&[(1, 8, NOID), (4, 4, NOID), (0x20, 4, NOID)]);
    let mut acl_v3 = acl_equiv.clone();
    acl_v3[0] = 3;
    // The ids of unnamed entries are stored as -1 whatever the caller sent.
    let acl_named_odd_ids = acl(&[(1, 7, 5), (2, 6, 1000), (4, 5, 6), (0x10, 7, 7), (0x20, 1, 8)]);
    let (e, ok) = (libc::EEXIST, 0);
    vec![
        (set("/f", b"user.a", b"1", 0), ok),
        (set("/f", b"user.a", b"2", XATTR_CREATE), e),
        (set("/f", b"user.zz", b"2", XATTR_REPLACE), libc::ENODATA),
        (set("/f", b"user.a", b"22", XATTR_REPLACE), ok),
        (set("/f", b"user.a", b"3", 4), libc::EINVAL),
        (set("/f", b"", b"1", 0), libc::ERANGE),
        (set("/f", &long256, b"1", 0), libc::ERANGE),
        (set("/f", &long255, b"1", 0), ok),
        (set("/f", big, &vec![b'v'; 65537], 0), libc::E2BIG),
        (set("/f", big, &vec![b'v'; 65536], 0), libc::ENOSPC),
        (set("/f", big, &vec![b'v'; max - big.len() + 1], 0), libc::ENOSPC),
        (set("/f", big, &vec![b'v'; max - big.len()], 0), ok),
        (set("/f", b"user", b"1", 0), libc::EOPNOTSUPP),
        (set("/f", b"user.", b"1", 0), libc::EINVAL),
        (set("/f", b"foo.bar", b"1", 0), libc::EOPNOTSUPP),
        (set("/f", b"system.foo", b"1", 0), libc::EOPNOTSUPP),
        (set("/f", b"btrfs.foo", b"1", 0), libc::EINVAL),
        (set("/f", b"btrfs.", b"1", 0), libc::EINVAL),
        (set("/f", b"trusted.t", b"tv", 0), ok),
        (set("/f", b"security.s", b"sv", 0), ok),
        (set("/f", b"user.empty", b"", 0), ok),
        // File capabilities: the header is checked, before the inode's flags.
        (set("/f", b"security.capability", &[1], 0), libc::EINVAL),
        (
            set("/f", b"security.capability", &[[0, 0, 0, 2].as_slice(), &[0; 17]].concat(), 0),
            libc::EINVAL,
        ),
        (set("/i", b"security.capability", &[1], 0), libc::EINVAL),
        (
            set(
                "/f",
                b"security.capability",
                &[[1, 0, 0, 3].as_slice(), &[0xff; 16], &[0xff; 4]].concat(),
                0,
            ),
            libc::EINVAL,
        ),
        (set("/f", b"security.capability", &[[1, 0, 0, 2].as_slice(), &[7; 16]].concat(), 0), ok),
        (
            set(
                "/g",
                b"security.capability",
                &[[0x81, 0, 0, 3].as_slice(), &[9; 16], &[0xe8, 3, 0, 0]].concat(),
                0,
            ),
            libc::EINVAL,
        ),
        (
            set(
                "/g",
                b"security.capability",
                &[[1, 0, 0, 3].as_slice(), &[9; 16], &[0xe8, 3, 0, 0]].concat(),
                0,
            ),
            ok,
        ),
        (set("/p", b"user.a", b"1", 0), libc::EPERM),
        (set("/l", b"user.a", b"1", 0), libc::EPERM),
        (set("/l", b"trusted.t", b"1", 0), ok),
        (set("/p", b"trusted.t", b"1", 0), ok),
        (set("/l", b"security.s", b"1", 0), ok),
        (set("/d", b"user.dir", b"dv", 0), ok),
        (rm("/f", b"user.nope"), libc::ENODATA),
        (rm("/f", b"user.a"), ok),
        (rm("/p", b"user.a"), libc::EPERM),
        (rm("/f", b"user"), libc::EOPNOTSUPP),
        (rm("/f", b""), libc::ERANGE),
        // Immutable and append-only inodes refuse every xattr change, before the name
        // is even looked at.
        (set("/i", b"user.y", b"1", 0), libc::EPERM),
        (rm("/i", b"user.x"), libc::EPERM),
        (set("/i", b"btrfs.compression", b"zlib", 0), libc::EPERM),
        (set("/i", b"foo.bar", b"1", 0), libc::EPERM),
        (set("/a", b"user.y", b"1", 0), libc::EPERM),
        (set("/i", b"system.posix_acl_access", &acl_equiv, 0), libc::EPERM),
        // Hash collisions: two names in one item.
        (set("/f", &n1, b"one", 0), ok),
        (set("/f", &n2, b"two", 0), ok),
        (set("/f", &n1, b"ONE, longer", XATTR_REPLACE), ok),
        (set("/f", &n2, b"x", XATTR_CREATE), e),
        (rm("/f", &n1), ok),
        (set("/f", &n1, b"1", XATTR_CREATE), ok),
        (rm("/f", &n2), ok),
        (set("/f", &n2, b"again", 0), ok),
        (set("/f", &n1, b"", 0), ok),
        // A shared item holds at most one leaf item's bytes: a second name past that is
        // ENOSPC, and so is a value that would grow it past.
        (set("/g", &n1, &vec![b'1'; max - n1.len()], 0), ok),
        (set("/g", &n2, b"x", 0), libc::ENOSPC),
        (set("/g", &n1, b"small", XATTR_REPLACE), ok),
        (set("/g", &n2, b"x", 0), ok),
        (set("/g", &n2, &vec![b'2'; max - n2.len()], 0), libc::ENOSPC),
        (set("/g", &n2, &vec![b'2'; 1000], 0), ok),
        // The compression property.
        (set("/f", b"btrfs.compression", b"bad", 0), libc::EINVAL),
        (set("/f", b"btrfs.compression", b"zstd:3", 0), ok),
        (set("/f", b"btrfs.compression", b"zstdxyz", 0), ok),
        (set("/f", b"btrfs.compression", b"no", 0), ok),
        (set("/f", b"btrfs.compression", b"nox", 0), libc::EINVAL),
        (set("/f", b"btrfs.compression", b"", 0), ok),
        (rm("/f", b"btrfs.compression"), libc::ENODATA),
        (set("/f", b"btrfs.compression", b"", XATTR_REPLACE), libc::ENODATA),
        (set("/f", b"btrfs.compression", b"lzo", XATTR_CREATE), ok),
        (set("/g", b"btrfs.compression", b"zlib", 0), ok),
        (set("/h", b"btrfs.compression", b"none", 0), ok),
        (set("/c", b"btrfs.compression", b"zstd", 0), libc::EINVAL),
        (set("/c", b"btrfs.compression", b"no", 0), libc::EINVAL),
        (set("/c", b"btrfs.compression", b"", 0), ok),
        (set("/p", b"btrfs.compression", b"zlib", 0), ok),
        (rm("/p", b"btrfs.compression"), ok),
        (set("/d", b"btrfs.compression", b"zstd", 0), ok),
        (set("/e", b"btrfs.compression", b"zlib", 0), ok),
        (rm("/e", b"btrfs.compression"), ok),
        // POSIX ACLs.
        (set("/l", b"system.posix_acl_access", &acl_equiv, 0), libc::EOPNOTSUPP),
        (set("/f", b"system.posix_acl_default", &acl_equiv, 0), libc::EACCES),
        (set("/f", b"system.posix_acl_default", &acl(&[]), 0), ok),
        (set("/f", b"system.posix_acl_access", &[2, 0], 0), libc::EINVAL),
        (set("/f", b"system.posix_acl_access", &acl_v3, 0), libc::EOPNOTSUPP),
        (set("/f", b"system.posix_acl_access", &acl_no_mask, 0), libc::EINVAL),
        (set("/f", b"system.posix_acl_access", &acl_bad_tag, 0), libc::EINVAL),
        (set("/f", b"system.posix_acl_access", &acl_bad_perm, 0), libc::EINVAL),
        (set("/g", b"system.posix_acl_access", &acl_named, 0), ok),
        (set("/h", b"system.posix_acl_access", &acl_equiv, 0), ok),
        (rm("/h", b"system.posix_acl_access"), ok),
        (set("/d", b"system.posix_acl_default", &acl_named, 0), ok),
        (set("/d", b"system.posix_acl_access", &acl_named_odd_ids, XATTR_CREATE), ok),
        (set("/e", b"system.posix_acl_access", &acl_named, 0), ok),
        (rm("/e", b"system.posix_acl_access"), ok),
    ]
}

/// The on-disk xattr state of every object as ubtrfs's reader sees it: mode, inode
/// flags, and the (name, value) list in key order.
type State = Vec<(&'static str, u32, u64, Vec<(Vec<u8>, Vec<u8>)>)>;

fn state_of(img: &Path) -> (State, u64) {
    let fs = Filesystem::open(&OpenOptions::new(img))
        .unwrap_or_else(|e| panic!("{}: {e}", img.display()));
    let st = PATHS
        .iter()
        .map(|&p| {
            let v = fs
                .load_inode(
                    fs.resolve_id(p, false).expect("resolve"),
                    Load { xattrs: true, ..Load::ITEM },
                )
                .expect("load");
            (p, v.mode(), v.flags(), v.xattrs)
        })
        .collect();
    (st, fs.sb.incompat_flags.get())
}

/// A readable digest of an xattr list for failure messages: names, value lengths and
/// each value's first bytes.
fn summary(x: &[(Vec<u8>, Vec<u8>)]) -> String {
    x.iter()
        .map(|(n, v)| {
            format!(
                "{}={:?}{}",
                String::from_utf8_lossy(n),
                String::from_utf8_lossy(&v[..v.len().min(24)]),
                if v.len() > 24 { format!("..({} bytes)", v.len()) } else { String::new() }
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// What the kernel lists and reads for every object of a mount.
fn kernel_xattrs(mnt: &Path, rel: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
    let p = CString::new(mnt.join(rel).as_os_str().as_bytes()).expect("path");
    let mut buf = vec![0u8; 1 << 20];
    // SAFETY: NUL-terminated path; buf is a live buffer of the length passed.
    let n = unsafe { libc::llistxattr(p.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(n >= 0, "llistxattr {rel}: {}", std::io::Error::last_os_error());
    let mut out = Vec::new();
    for name in buf[..n as usize].split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let cn = CString::new(name).expect("name");
        let mut v = vec![0u8; 1 << 17];
        // SAFETY: NUL-terminated path and name; v is a live buffer of the length passed.
        let m = unsafe { libc::lgetxattr(p.as_ptr(), cn.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        assert!(
            m >= 0,
            "lgetxattr {rel} {}: {}",
            String::from_utf8_lossy(name),
            std::io::Error::last_os_error()
        );
        v.truncate(m as usize);
        out.push((name.to_vec(), v));
    }
    out
}

/// The operation table through ubtrfs: every errno as the table says, every failure
/// leaving the fs tree's items and the COWed block count as they were. With the
/// kernel: the same table on a loop mount of a copy gives the same errnos, both images
/// end identical (modes, inode flags, xattrs in order, incompat bits), both are
/// `btrfs check` clean, and the kernel reads exactly what ubtrfs wrote.
#[test]
fn every_errno_and_the_state_match_the_kernel() {
    let s = objects_image("xattr-ops");
    let ops = op_table(16384);
    let kernel = common::kernel_available("every_errno_and_the_state_match_the_kernel");
    let ks = kernel.then(|| {
        let k = Scratch {
            path: s.path.with_file_name(format!("xattr-ops-kernel-{}.img", std::process::id())),
        };
        std::fs::copy(&s.path, &k.path).expect("copy image");
        k
    });
    let mut w = s.writer();
    assert_eq!(w.nodesize(), 16384, "the table's sizes are for 16 KiB nodes");
    let mut wrong = Vec::new();
    for (op, want) in &ops {
        let before = fs_items(&mut w);
        let cowed = w.blocks_cowed();
        let r = op.ubtrfs(&mut w);
        let got = errno_of(&r);
        if got != *want {
            wrong.push(format!(
                "{}: ubtrfs {} ({:?}), kernel {}",
                op.describe(),
                errno_name(got),
                r.err().map(|e| e.to_string()),
                errno_name(*want)
            ));
        }
        if got != 0 {
            assert_eq!(w.blocks_cowed(), cowed, "{}: a refused change COWed blocks", op.describe());
            assert!(
                fs_items(&mut w) == before,
                "{}: a refused change changed the fs tree",
                op.describe()
            );
        }
    }
    assert!(
        wrong.is_empty(),
        "{} operations differ from the kernel:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    w.commit().expect("commit");
    drop(w);
    assert_check(&s.path, "after the operation table");
    let (ours, our_incompat) = state_of(&s.path);
    // What the table must have left, independent of the kernel.
    let find = |p: &str| ours.iter().find(|x| x.0 == p).expect("object").clone();
    let f = find("/f");
    assert_eq!(
        f.2 & (INODE_COMPRESS | INODE_NOCOMPRESS),
        INODE_COMPRESS,
        "/f: lzo property sets COMPRESS"
    );
    assert!(f.3.iter().any(|(n, v)| n == b"btrfs.compression" && v == b"lzo"), "/f: {:?}", f.3);
    assert_eq!(
        find("/h").2 & (INODE_COMPRESS | INODE_NOCOMPRESS),
        INODE_NOCOMPRESS,
        "/h: none sets NOCOMPRESS"
    );
    assert_eq!(find("/h").1 & 0o777, 0o740, "/h: an ACL the mode expresses becomes the mode");
    assert!(
        !find("/h").3.iter().any(|(n, _)| n == b"system.posix_acl_access"),
        "/h keeps no ACL: {}",
        summary(&find("/h").3)
    );
    assert_eq!(find("/g").1 & 0o777, 0o664, "/g: the mask is the group bits");
    assert_eq!(
        find("/e").2 & (INODE_COMPRESS | INODE_NOCOMPRESS),
        0,
        "/e: removing the property resets the flags"
    );
    assert_eq!(
        find("/p").3,
        vec![(b"trusted.t".to_vec(), b"1".to_vec())],
        "/p: trusted.t and no property on a fifo"
    );
    assert_ne!(
        our_incompat & INCOMPAT_COMPRESS_LZO,
        0,
        "an lzo property sets the LZO incompat bit"
    );
    let d = find("/d");
    let odd = d.3.iter().find(|(n, _)| n == b"system.posix_acl_access").expect("/d access ACL");
    assert_eq!(
        odd.1,
        acl(&[(1, 7, NOID), (2, 6, 1000), (4, 5, NOID), (0x10, 7, NOID), (0x20, 1, NOID)]),
        "unnamed ACL entries are stored with id -1"
    );
    let Some(k) = ks else { return };
    {
        let m = Mount::new(&k.path, true);
        let mut wrong = Vec::new();
        for (op, want) in &ops {
            let got = op.kernel(&m.dir);
            if got != *want {
                wrong.push(format!(
                    "{}: kernel {}, the table says {}",
                    op.describe(),
                    errno_name(got),
                    errno_name(*want)
                ));
            }
        }
        assert!(
            wrong.is_empty(),
            "the kernel disagrees with the table on {}:\n{}",
            wrong.len(),
            wrong.join("\n")
        );
        m.umount();
    }
    assert_check(&k.path, "kernel copy after the operation table");
    let (theirs, their_incompat) = state_of(&k.path);
    for (a, b) in ours.iter().zip(&theirs) {
        assert!(a == b, "{}: ubtrfs and the kernel differ:\n  ubtrfs mode {:o} flags {:#x} [{}]\n  kernel mode {:o} flags {:#x} [{}]", a.0, a.1, a.2, summary(&a.3), b.1, b.2, summary(&b.3));
    }
    // Only the compression bits: a kernel mount also sets BIG_METADATA for 16 KiB nodes.
    let bits = INCOMPAT_COMPRESS_LZO | INCOMPAT_COMPRESS_ZSTD;
    assert_eq!(our_incompat & bits, their_incompat & bits, "the compression incompat flags");
    // The kernel reads back exactly what ubtrfs wrote.
    let m = Mount::new(&s.path, false);
    for (p, _, _, x) in &ours {
        let k = kernel_xattrs(&m.dir, &p[1..]);
        assert!(
            &k == x,
            "{p}: the kernel reads [{}] where ubtrfs wrote [{}]",
            summary(&k),
            summary(x)
        );
    }
    m.umount();
}

/// Values at the exact limit on 4 KiB nodes (where the leaf, not the VFS, is the
/// bound): the largest fits, one more byte is ENOSPC; the value reads back whole
/// through the reader, after a commit through a fresh open, and through the kernel.
#[test]
fn the_largest_value_fits_and_one_more_byte_does_not() {
    let s = Scratch::mkfs("xattr-limit", 256 * MIB, &["-n", "4096"]);
    let mut w = s.writer();
    let root = w.live().root_dir();
    let f = w
        .create_file(root.root, root.ino, b"f", &ubtrfs_core::inode::write::InodeAttrs::new(0o644))
        .expect("create");
    let id = InodeId { root: root.root, ino: f };
    let name = b"user.max";
    let max = max_xattr_size(4096);
    assert_eq!(max, 3940);
    let before = fs_items(&mut w);
    let r = w.setxattr(id, name, &vec![7u8; max - name.len() + 1], 0);
    assert_eq!(r.as_ref().map_err(|e| e.posix_kind()), Err(Some(PosixKind::NoSpace)), "{r:?}");
    assert!(fs_items(&mut w) == before, "a refused set changed the tree");
    let value: Vec<u8> = (0..max - name.len()).map(|i| (i % 251) as u8).collect();
    w.setxattr(id, name, &value, 0).expect("the largest value");
    // Replaced by itself, grown from a small one, and shrunk again.
    w.setxattr(id, name, b"small", XATTR_REPLACE).expect("shrink");
    w.setxattr(id, name, &value, XATTR_REPLACE).expect("grow to the limit");
    assert_eq!(w.live().getxattr(id, name).expect("get"), value);
    w.commit().expect("commit");
    drop(w);
    assert_check(&s.path, "after the largest xattr");
    assert_eq!(s.reader().getxattr(id, name).expect("get after reopen"), value);
    if common::kernel_available("the_largest_value_fits_and_one_more_byte_does_not") {
        let m = Mount::new(&s.path, false);
        let k = kernel_xattrs(&m.dir, "f");
        assert!(k == vec![(name.to_vec(), value)], "the kernel reads [{}]", summary(&k));
        m.umount();
    }
}

/// Two thousand xattrs on one inode split its items over many leaves; half removed and
/// a sixth replaced by longer values, the rest is exactly what listxattr and getxattr
/// give, through ubtrfs and through the kernel, in the same order.
#[test]
fn many_xattrs_split_leaves_and_read_back() {
    let s = Scratch::mkfs("xattr-many", 256 * MIB, &[]);
    let mut w = s.writer();
    let root = w.live().root_dir();
    let f = w
        .create_file(
            root.root,
            root.ino,
            b"many",
            &ubtrfs_core::inode::write::InodeAttrs::new(0o644),
        )
        .expect("create");
    let id = InodeId { root: root.root, ino: f };
    let val = |i: usize, gen: usize| {
        format!("value {i} generation {gen} {}", "x".repeat((i * 7) % 90)).into_bytes()
    };
    let mut want: std::collections::BTreeMap<Vec<u8>, Vec<u8>> = Default::default();
    for i in 0..2000 {
        let n = format!("user.attr{i:05}").into_bytes();
        w.setxattr(id, &n, &val(i, 0), XATTR_CREATE).expect("set");
        want.insert(n, val(i, 0));
    }
    // The items (with their 25-byte headers) fill more than ten 16 KiB leaves.
    let items = w
        .items_in_range(
            root.root,
            &Key::new(f, XATTR_ITEM_KEY, 0),
            &Key::new(f, XATTR_ITEM_KEY, u64::MAX),
        )
        .expect("items");
    assert!(items.len() >= 1990, "{} xattr items for 2000 names", items.len());
    let bytes: usize = items.iter().map(|(_, d)| d.len() + 25).sum();
    assert!(bytes > 16384 * 10, "the xattrs take {bytes} bytes, fewer than ten leaves");
    for i in (0..2000).step_by(2) {
        let n = format!("user.attr{i:05}").into_bytes();
        w.removexattr(id, &n).expect("remove");
        want.remove(&n);
    }
    for i in (1..2000).step_by(6) {
        let n = format!("user.attr{i:05}").into_bytes();
        w.setxattr(id, &n, &val(i, 1), XATTR_REPLACE).expect("replace");
        want.insert(n, val(i, 1));
    }
    w.check_invariants(root.root).expect("fs tree invariants");
    w.commit().expect("commit");
    drop(w);
    assert_check(&s.path, "after many xattrs");
    let fs = s.reader();
    let names = fs.listxattr(id).expect("list");
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(sorted, want.keys().cloned().collect::<Vec<_>>(), "listxattr names");
    let ours: Vec<(Vec<u8>, Vec<u8>)> =
        names.iter().map(|n| (n.clone(), fs.getxattr(id, n).expect("get"))).collect();
    for (n, v) in &ours {
        assert_eq!(Some(v), want.get(n), "{}", String::from_utf8_lossy(n));
    }
    if common::kernel_available("many_xattrs_split_leaves_and_read_back") {
        let m = Mount::new(&s.path, false);
        let k = kernel_xattrs(&m.dir, "many");
        assert!(
            k == ours,
            "the kernel lists and reads [{}], ubtrfs [{}]",
            summary(&k),
            summary(&ours)
        );
        m.umount();
    }
}

/// Every change moves ctime (and only a failed one leaves it); reads work on the
/// committed view, the live view and through the engine, with the size protocol.
#[test]
fn ctime_and_the_read_views() {
    use ubtrfs_core::sources::{Sources, Time};
    let s = Scratch::mkfs("xattr-views", 256 * MIB, &[]);
    let mut opts = OpenOptions::new(&s.path);
    opts.sources = Sources::deterministic(Time { sec: 1_800_000_000, nsec: 0 }, 7);
    let mut w = FsWriter::open(&opts).expect("open");
    let root = w.live().root_dir();
    let f = w
        .create_file(root.root, root.ino, b"f", &ubtrfs_core::inode::write::InodeAttrs::new(0o644))
        .expect("create");
    let id = InodeId { root: root.root, ino: f };
    let ctime = |w: &FsWriter| {
        let t = w.live().load_inode(id, Load::ITEM).expect("inode").item.ctime;
        (t.sec.get(), t.nsec.get())
    };
    let t0 = ctime(&w);
    w.setxattr(id, b"user.a", b"hello", 0).expect("set");
    let t1 = ctime(&w);
    assert!(t1 > t0, "set moves ctime: {t0:?} -> {t1:?}");
    assert!(w.setxattr(id, b"user.a", b"x", XATTR_CREATE).is_err());
    assert_eq!(ctime(&w), t1, "a refused set leaves ctime");
    w.removexattr(id, b"user.a").expect("remove");
    let t2 = ctime(&w);
    assert!(t2 > t1, "remove moves ctime");
    w.setxattr(id, b"user.a", b"hello", 0).expect("set");
    w.setxattr(id, b"user.b", b"", 0).expect("set");
    assert_eq!(w.live().getxattr_sized(id, b"user.a", 0).expect("size"), XattrReply::Size(5));
    assert_eq!(
        w.live().getxattr_sized(id, b"user.a", 5).expect("data"),
        XattrReply::Data(b"hello".to_vec())
    );
    assert_eq!(
        w.live().getxattr_sized(id, b"user.a", 4).map_err(|e| e.posix_kind()),
        Err(Some(PosixKind::Range))
    );
    assert_eq!(w.live().listxattr_sized(id, 0).expect("list size"), XattrReply::Size(14));
    assert_eq!(
        w.live().listxattr_sized(id, 13).map_err(|e| e.posix_kind()),
        Err(Some(PosixKind::Range))
    );
    assert_eq!(
        w.live().getxattr(id, b"user.nope").map_err(|e| e.posix_kind()),
        Err(Some(PosixKind::NoData))
    );
    assert_eq!(
        w.live().getxattr(id, b"foo.bar").map_err(|e| e.posix_kind()),
        Err(Some(PosixKind::NotSupported))
    );
    w.setxattr(id, b"btrfs.compression", b"zstd:7", 0).expect("property");
    assert_eq!(
        w.live().compression_property(id).expect("prop"),
        Some(CompressionProperty { kind: CompressionType::Zstd, level: Some(7) })
    );
    w.commit().expect("commit");
    let engine = Engine::from_writer(w);
    assert_eq!(engine.read(|l| l.getxattr(id, b"user.a")).expect("engine read"), b"hello");
    engine.write(|w| w.setxattr(id, b"user.c", b"through the engine", 0)).expect("engine write");
    let mut names = engine.read(|l| l.listxattr(id)).expect("engine list");
    names.sort();
    assert_eq!(
        names,
        vec![
            b"btrfs.compression".to_vec(),
            b"user.a".to_vec(),
            b"user.b".to_vec(),
            b"user.c".to_vec()
        ]
    );
    // The committed view does not see the uncommitted change.
    let committed = engine.committed().expect("committed");
    assert_eq!(
        committed.getxattr(id, b"user.c").map_err(|e| e.posix_kind()),
        Err(Some(PosixKind::NoData))
    );
    drop(committed);
    engine.commit().expect("commit");
    drop(engine);
    assert_check(&s.path, "after the views test");
    assert_eq!(s.reader().getxattr(id, b"user.c").expect("committed"), b"through the engine");
}

/// The reverse direction: xattrs, ACLs and the compression property the kernel set
/// (setfattr, setfacl, `btrfs property set`), names sharing an item among them, read
/// back by ubtrfs exactly as the kernel lists and reads them.
#[test]
fn xattrs_the_kernel_set_read_back() {
    if !common::kernel_available_with(
        "xattrs_the_kernel_set_read_back",
        &["/usr/bin/setfattr", "/usr/bin/setfacl"],
    ) {
        return;
    }
    let s = Scratch::mkfs("xattr-kernel-set", 256 * MIB, &[]);
    let (n1, n2) = colliding_pair("user.k");
    let expect;
    {
        let m = Mount::new(&s.path, true);
        let run = |args: &[&str]| {
            let o =
                Command::new(args[0]).args(&args[1..]).current_dir(&m.dir).output().expect("run");
            assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        };
        std::fs::write(m.path("f"), b"data").expect("write");
        std::fs::create_dir(m.path("d")).expect("mkdir");
        let n1s = String::from_utf8(n1.clone()).expect("ascii");
        let n2s = String::from_utf8(n2.clone()).expect("ascii");
        run(&["setfattr", "-n", "user.plain", "-v", "a value", "f"]);
        run(&["setfattr", "-n", &n1s, "-v", "first", "f"]);
        run(&["setfattr", "-n", &n2s, "-v", "second", "f"]);
        run(&["setfattr", "-n", "trusted.t", "-v", "0x00ff00", "f"]);
        run(&["setfattr", "-n", "security.s", "-v", "sec", "d"]);
        run(&["setfacl", "-m", "u:1000:rw", "f"]);
        run(&["setfacl", "-d", "-m", "g:100:rx", "d"]);
        run(&["btrfs", "property", "set", "f", "compression", "zstd"]);
        run(&["btrfs", "property", "set", "d", "compression", "lzo"]);
        expect = [("f", kernel_xattrs(&m.dir, "f")), ("d", kernel_xattrs(&m.dir, "d"))];
        m.umount();
    }
    let key = Key::new(0, XATTR_ITEM_KEY, name_hash(&n1));
    let fs = s.reader();
    for (p, want) in &expect {
        let id = fs.resolve_id(&format!("/{p}"), false).expect("resolve");
        let names = fs.listxattr(id).expect("list");
        let got: Vec<(Vec<u8>, Vec<u8>)> =
            names.iter().map(|n| (n.clone(), fs.getxattr(id, n).expect("get"))).collect();
        assert!(
            &got == want,
            "/{p}: ubtrfs reads [{}], the kernel [{}]",
            summary(&got),
            summary(want)
        );
        let v = fs.load_inode(id, Load::ITEM).expect("inode");
        assert_ne!(v.flags() & INODE_COMPRESS, 0, "/{p}: the property's flag");
        if *p == "f" {
            assert_eq!(
                fs.compression_property(id).expect("prop"),
                Some(CompressionProperty { kind: CompressionType::Zstd, level: None })
            );
            let root = fs.fs_root(id.root).expect("root");
            let items = fs
                .items_in_range(
                    &root,
                    &Key::new(id.ino, key.type_, key.offset),
                    &Key::new(id.ino, key.type_, key.offset),
                )
                .expect("items");
            assert_eq!(items.len(), 1, "the colliding names share one item");
        } else {
            assert_eq!(
                fs.compression_property(id).expect("prop").map(|c| c.kind),
                Some(CompressionType::Lzo)
            );
        }
    }
    assert_ne!(fs.sb.incompat_flags.get() & (INCOMPAT_COMPRESS_LZO | INCOMPAT_COMPRESS_ZSTD), 0);
    // And ubtrfs changes them in place: drop one colliding name, the kernel agrees.
    drop(fs);
    let mut w = s.writer();
    let f = id_of(&w, "/f");
    w.removexattr(f, &n1).expect("remove a colliding name");
    w.setxattr(f, b"btrfs.compression", b"", 0).expect("reset the property");
    w.commit().expect("commit");
    drop(w);
    assert_check(&s.path, "after ubtrfs changed kernel-made xattrs");
    let m = Mount::new(&s.path, false);
    let names: Vec<Vec<u8>> = kernel_xattrs(&m.dir, "f").into_iter().map(|(n, _)| n).collect();
    assert!(!names.contains(&n1) && names.contains(&n2), "{names:?}");
    assert!(!names.iter().any(|n| n == b"btrfs.compression"), "{names:?}");
    let o = Command::new("lsattr").arg("-d").arg(m.path("f")).output().expect("lsattr");
    let attrs = String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    assert!(!attrs.contains('c') && !attrs.contains('m'), "lsattr after the reset: {attrs}");
    m.umount();
}

/// The property ubtrfs sets is the one `btrfs property get` shows on a kernel mount,
/// with the flag lsattr shows.
#[test]
fn btrfs_property_get_sees_what_ubtrfs_set() {
    if !common::kernel_available_with(
        "btrfs_property_get_sees_what_ubtrfs_set",
        &["/usr/bin/lsattr"],
    ) {
        return;
    }
    let s = Scratch::mkfs("xattr-propget", 256 * MIB, &[]);
    let mut w = s.writer();
    let root = w.live().root_dir();
    let mk = |w: &mut FsWriter, n: &[u8]| {
        w.create_file(root.root, root.ino, n, &ubtrfs_core::inode::write::InodeAttrs::new(0o644))
            .expect("create")
    };
    let z = mk(&mut w, b"z");
    let n = mk(&mut w, b"n");
    w.setxattr(InodeId { root: root.root, ino: z }, b"btrfs.compression", b"zstd", 0)
        .expect("zstd");
    w.setxattr(InodeId { root: root.root, ino: n }, b"btrfs.compression", b"no", 0).expect("no");
    w.commit().expect("commit");
    drop(w);
    assert_check(&s.path, "after setting properties");
    let m = Mount::new(&s.path, false);
    let prop = |f: &str| {
        let o = Command::new("btrfs")
            .args(["property", "get"])
            .arg(m.path(f))
            .arg("compression")
            .output()
            .expect("btrfs property get");
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    let lsattr = |f: &str| {
        let o = Command::new("lsattr").arg(m.path(f)).output().expect("lsattr");
        String::from_utf8_lossy(&o.stdout).split_whitespace().next().unwrap_or_default().to_string()
    };
    assert_eq!(prop("z"), "compression=zstd");
    assert_eq!(prop("n"), "compression=no");
    assert!(lsattr("z").contains('c') && !lsattr("z").contains('m'), "z: {}", lsattr("z"));
    assert!(lsattr("n").contains('m') && !lsattr("n").contains('c'), "n: {}", lsattr("n"));
    m.umount();
}

/// A read-only subvolume (and an aborted filesystem) takes no xattr change: EROFS,
/// nothing changed; reads still work.
#[test]
fn a_read_only_subvolume_refuses_xattr_changes() {
    let s = Scratch::mkfs("xattr-rosubvol", 256 * MIB, &[]);
    let mut w = s.writer();
    let root = w.live().root_dir();
    let f = w
        .create_file(root.root, root.ino, b"f", &ubtrfs_core::inode::write::InodeAttrs::new(0o644))
        .expect("create");
    let id = InodeId { root: root.root, ino: f };
    w.setxattr(id, b"user.a", b"1", 0).expect("set");
    w.set_subvol_readonly(root.root, true).expect("read-only");
    let before = fs_items(&mut w);
    for r in [
        w.setxattr(id, b"user.b", b"1", 0),
        w.removexattr(id, b"user.a"),
        w.setxattr(id, b"btrfs.compression", b"zstd", 0),
    ] {
        assert_eq!(r.as_ref().map_err(|e| e.posix_kind()), Err(Some(PosixKind::ReadOnly)), "{r:?}");
    }
    assert!(fs_items(&mut w) == before, "a refused change changed the tree");
    assert_eq!(w.live().getxattr(id, b"user.a").expect("read"), b"1");
}

/// New inodes take their directory's compression property as the kernel's
/// `btrfs_inode_inherit_props` gives it: the algorithm without the level, on regular
/// files and directories, with the COMPRESS flag; "no" passes on no xattr.
#[test]
fn new_inodes_inherit_the_compression_property() {
    use ubtrfs_core::inode::write::InodeAttrs;
    let s = Scratch::mkfs("xattr-inherit", 256 * MIB, &[]);
    let mut w = s.writer();
    let top = w.live().root_dir();
    let r = top.root;
    let pd = w.mkdir(r, top.ino, b"pd", &InodeAttrs::new(0o755)).expect("mkdir");
    let pn = w.mkdir(r, top.ino, b"pn", &InodeAttrs::new(0o755)).expect("mkdir");
    w.setxattr(InodeId { root: r, ino: pd }, b"btrfs.compression", b"zstd:3", 0).expect("property");
    w.setxattr(InodeId { root: r, ino: pn }, b"btrfs.compression", b"no", 0).expect("property");
    let mut made = Vec::new();
    for (dir, name, is_dir) in [(pd, &b"x"[..], false), (pd, b"y", true), (pn, b"x", false)] {
        let ino = if is_dir {
            w.mkdir(r, dir, name, &InodeAttrs::new(0o755))
        } else {
            w.create_file(r, dir, name, &InodeAttrs::new(0o644))
        }
        .expect("create");
        let ctime =
            w.live().load_inode(InodeId { root: r, ino }, Load::ITEM).expect("inode").item.ctime;
        w.inherit_props(r, dir, ino).expect("inherit");
        let after =
            w.live().load_inode(InodeId { root: r, ino }, Load::ITEM).expect("inode").item.ctime;
        assert_eq!(
            (ctime.sec.get(), ctime.nsec.get()),
            (after.sec.get(), after.nsec.get()),
            "inheriting leaves the new inode's times"
        );
        made.push(ino);
    }
    // mknod of a regular file inherits as create does; a fifo takes no property.
    for (name, mode) in [(&b"m"[..], libc::S_IFREG | 0o644), (b"f", libc::S_IFIFO | 0o644)] {
        made.push(w.mknod(r, pd, name, &InodeAttrs::new(mode)).expect("mknod"));
    }
    w.commit().expect("commit");
    drop(w);
    assert_check(&s.path, "after inheriting properties");
    let fs = s.reader();
    let xattrs = |ino| {
        fs.load_inode(InodeId { root: r, ino }, Load { xattrs: true, ..Load::ITEM }).expect("inode")
    };
    for &ino in &made[..2] {
        let v = xattrs(ino);
        assert_eq!(
            v.xattrs,
            vec![(b"btrfs.compression".to_vec(), b"zstd".to_vec())],
            "ino {ino}: what the kernel gives pd/x and pd/y"
        );
        assert_eq!(v.flags() & (INODE_COMPRESS | INODE_NOCOMPRESS), INODE_COMPRESS, "ino {ino}");
    }
    let m = xattrs(made[3]);
    assert_eq!(
        m.xattrs,
        vec![(b"btrfs.compression".to_vec(), b"zstd".to_vec())],
        "pd/m (mknod S_IFREG) inherits"
    );
    assert_eq!(m.flags() & (INODE_COMPRESS | INODE_NOCOMPRESS), INODE_COMPRESS, "pd/m");
    assert!(xattrs(made[4]).xattrs.is_empty(), "pd/f (a fifo) takes no property");
    let v = xattrs(made[2]);
    assert!(v.xattrs.is_empty(), "pn/x: {}", summary(&v.xattrs));
    assert_eq!(
        v.flags() & (INODE_COMPRESS | INODE_NOCOMPRESS),
        INODE_NOCOMPRESS,
        "pn/x: the flag comes from the directory's flags"
    );
    if common::kernel_available("new_inodes_inherit_the_compression_property") {
        // The kernel, doing the same on a mount, ends with the same xattrs and flags.
        let k = Scratch::mkfs("xattr-inherit-kernel", 256 * MIB, &[]);
        {
            let m = Mount::new(&k.path, true);
            for (d, v) in [("pd", "zstd:3"), ("pn", "no")] {
                std::fs::create_dir(m.path(d)).expect("mkdir");
                let o = Command::new("setfattr")
                    .args(["-n", "btrfs.compression", "-v", v])
                    .arg(m.path(d))
                    .output()
                    .expect("setfattr");
                assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            }
            std::fs::write(m.path("pd/x"), b"").expect("create");
            std::fs::create_dir(m.path("pd/y")).expect("mkdir");
            std::fs::write(m.path("pn/x"), b"").expect("create");
            for (name, mode) in [("pd/m", libc::S_IFREG | 0o644), ("pd/f", libc::S_IFIFO | 0o644)] {
                let c = std::ffi::CString::new(m.path(name).as_os_str().as_encoded_bytes())
                    .expect("path");
                assert_eq!(
                    // SAFETY: a valid NUL-terminated path; mknod reads nothing else.
                    unsafe { libc::mknod(c.as_ptr(), mode, 0) },
                    0,
                    "mknod {name}: {}",
                    std::io::Error::last_os_error()
                );
            }
            m.umount();
        }
        let kfs = k.reader();
        for (p, &ino) in ["/pd/x", "/pd/y", "/pn/x", "/pd/m", "/pd/f"].iter().zip(&made) {
            let kv = kfs
                .load_inode(
                    kfs.resolve_id(p, false).expect("resolve"),
                    Load { xattrs: true, ..Load::ITEM },
                )
                .expect("inode");
            let ov = xattrs(ino);
            assert!(
                kv.xattrs == ov.xattrs,
                "{p}: kernel [{}], ubtrfs [{}]",
                summary(&kv.xattrs),
                summary(&ov.xattrs)
            );
            assert_eq!(kv.flags(), ov.flags(), "{p}: inode flags");
        }
    }
}

/// Random sets, replaces and removes (names sharing items among them) against a map of
/// what each name should hold: every errno and every read as the model says, the tree's
/// invariants kept, commits along the way, `btrfs check` clean, and the kernel reading
/// the same at the end.
#[test]
fn random_operations_against_a_model() {
    let s = Scratch::mkfs("xattr-model", 256 * MIB, &[]);
    let mut w = s.writer();
    let top = w.live().root_dir();
    let f = w
        .create_file(top.root, top.ino, b"m", &ubtrfs_core::inode::write::InodeAttrs::new(0o644))
        .expect("create");
    let id = InodeId { root: top.root, ino: f };
    let mut names: Vec<Vec<u8>> = (0..10).map(|i| format!("user.n{i}").into_bytes()).collect();
    for p in ["user.p", "user.q", "user.r"] {
        let (a, b) = colliding_pair(p);
        names.push(a);
        names.push(b);
    }
    let mut model: std::collections::BTreeMap<Vec<u8>, Vec<u8>> = Default::default();
    let mut rng = write_common::Rng::new(0x5eed);
    for step in 0..3000 {
        let name = rng.pick(&names).clone();
        let exists = model.contains_key(&name);
        if rng.chance(30) {
            let r = w.removexattr(id, &name);
            let want = if exists { 0 } else { libc::ENODATA };
            assert_eq!(
                errno_of(&r),
                want,
                "step {step}: remove {}: {r:?}",
                String::from_utf8_lossy(&name)
            );
            model.remove(&name);
        } else {
            let len = if rng.chance(5) { rng.range(1000, 3000) } else { rng.below(200) } as usize;
            let value = rng.bytes(len);
            let flags = *rng.pick(&[0, 0, XATTR_CREATE, XATTR_REPLACE]);
            let r = w.setxattr(id, &name, &value, flags);
            let want = match (flags, exists) {
                (XATTR_CREATE, true) => libc::EEXIST,
                (XATTR_REPLACE, false) => libc::ENODATA,
                _ => 0,
            };
            assert_eq!(
                errno_of(&r),
                want,
                "step {step}: set {} flags {flags}: {r:?}",
                String::from_utf8_lossy(&name)
            );
            if want == 0 {
                model.insert(name, value);
            }
        }
        if step % 500 == 499 {
            w.check_invariants(id.root).expect("fs tree invariants");
            let mut listed = w.live().listxattr(id).expect("list");
            listed.sort();
            assert_eq!(listed, model.keys().cloned().collect::<Vec<_>>(), "step {step}: names");
            for (n, v) in &model {
                assert!(
                    &w.live().getxattr(id, n).expect("get") == v,
                    "step {step}: {}",
                    String::from_utf8_lossy(n)
                );
            }
            if step % 1000 == 999 {
                w.commit().expect("commit");
            }
        }
    }
    w.commit().expect("commit");
    drop(w);
    assert_check(&s.path, "after random xattr operations");
    let fs = s.reader();
    let ours: Vec<(Vec<u8>, Vec<u8>)> = fs
        .listxattr(id)
        .expect("list")
        .into_iter()
        .map(|n| (n.clone(), fs.getxattr(id, &n).expect("get")))
        .collect();
    let mut sorted = ours.clone();
    sorted.sort();
    assert!(
        sorted == model.clone().into_iter().collect::<Vec<_>>(),
        "the committed image holds the model"
    );
    if common::kernel_available("random_operations_against_a_model") {
        let m = Mount::new(&s.path, false);
        let k = kernel_xattrs(&m.dir, "m");
        assert!(k == ours, "the kernel reads [{}], ubtrfs [{}]", summary(&k), summary(&ours));
        m.umount();
    }
}

/// New inodes made through the engine (`Engine::create_file`, `mkdir`, `mknod`,
/// `symlink`, `tmpfile`) are owned, moded and given ACLs as the kernel's VFS makes them
/// on btrfs: the umask only where the directory has no default ACL, a default ACL
/// inherited otherwise (and kept as the default of a new directory), a set-group-ID
/// directory's group and bit; a refusal changes nothing and aborts nothing.
#[test]
fn new_inodes_through_the_engine_inherit_acls_and_the_group() {
    use ubtrfs_core::inode::write::InodeAttrs;
    use ubtrfs_core::inode::xattr::{XATTR_POSIX_ACL_ACCESS, XATTR_POSIX_ACL_DEFAULT};
    let s = Scratch::mkfs("xattr-engine-acl", 256 * MIB, &[]);
    let engine = Engine::from_writer(s.writer());
    let top = engine.read(|l| Ok(l.root_dir())).expect("root");
    let by = |mode: u32, uid: u32, gid: u32| {
        let mut a = InodeAttrs::new(mode);
        a.uid = uid;
        a.gid = gid;
        a
    };
    let mode = |id: InodeId| engine.getattr(id).expect("getattr").mode.get();
    let xattr = |id: InodeId, name: &[u8]| engine.read(|l| l.getxattr(id, name)).ok();

    // No default ACL: the umask applies.
    let d = engine.mkdir(top, b"d", &by(0o777, 1000, 1000), 0o022).expect("mkdir d");
    assert_eq!(mode(d), S_IFDIR | 0o755);
    assert_eq!(xattr(d, XATTR_POSIX_ACL_ACCESS), None);
    let named = acl(&[(1, 6, NOID), (2, 6, 1000), (4, 4, NOID), (0x10, 6, NOID), (0x20, 4, NOID)]);
    engine.setxattr(d, XATTR_POSIX_ACL_DEFAULT, &named, 0, false).expect("default ACL");

    // A default ACL: inherited, the umask ignored, the mode folded into it.
    let f = engine.create_file(d, b"f", &by(0o666, 1000, 1000), 0o077).expect("create f");
    assert_eq!(mode(f), S_IFREG | 0o664);
    assert_eq!(xattr(f, XATTR_POSIX_ACL_ACCESS), Some(named.clone()));
    assert_eq!(xattr(f, XATTR_POSIX_ACL_DEFAULT), None, "only directories keep the default");
    let sub = engine.mkdir(d, b"sub", &by(0o777, 1000, 1000), 0o077).expect("mkdir sub");
    assert_eq!(mode(sub), S_IFDIR | 0o664);
    assert_eq!(xattr(sub, XATTR_POSIX_ACL_ACCESS), Some(named.clone()));
    assert_eq!(xattr(sub, XATTR_POSIX_ACL_DEFAULT), Some(named.clone()));
    let fifo = engine.mknod(d, b"p", &by(S_IFIFO | 0o666, 1000, 1000), 0o077).expect("mknod");
    assert_eq!(mode(fifo), S_IFIFO | 0o664);
    let t = engine.tmpfile(d, &by(0o600, 1000, 1000), 0o077).expect("tmpfile");
    assert_eq!(mode(t), S_IFREG | 0o600);
    assert_eq!(engine.getattr(t).expect("getattr").nlink.get(), 0);
    engine.link(t, d, b"t").expect("link the tmpfile");
    assert_eq!(engine.getattr(t).expect("getattr").nlink.get(), 1);
    let l = engine.symlink(d, b"l", b"f", &by(0o600, 1000, 1000)).expect("symlink");
    assert_eq!(mode(l), S_IFLNK | 0o777);
    assert_eq!(xattr(l, XATTR_POSIX_ACL_ACCESS), None, "a symlink has no ACLs");

    // A refusal changes nothing and leaves the filesystem writable.
    let again = engine.create_file(d, b"f", &by(0o666, 1000, 1000), 0).map(|_| ());
    assert_eq!(again.map_err(|e| e.posix_kind()), Err(Some(PosixKind::Exists)));
    let still = engine.read(|l| l.lookup(d, b"f")).expect("lookup").map(|e| e.target);
    assert_eq!(still, Some(f));

    // A set-group-ID directory gives its group, and to a directory its bit.
    let g = engine.mkdir(top, b"g", &by(S_ISGID | 0o775, 1000, 100), 0).expect("mkdir g");
    let gd = engine.mkdir(g, b"x", &by(0o755, 1001, 1001), 0).expect("mkdir g/x");
    let gf = engine.create_file(g, b"y", &by(0o644, 1001, 1001), 0).expect("create g/y");
    for (id, want) in [(gd, S_IFDIR | S_ISGID | 0o755), (gf, S_IFREG | 0o644)] {
        let a = engine.getattr(id).expect("getattr");
        assert_eq!((a.mode.get(), a.uid.get(), a.gid.get()), (want, 1001, 100), "{id}");
    }

    engine.removexattr(f, XATTR_POSIX_ACL_ACCESS).expect("remove the access ACL");
    assert_eq!(xattr(f, XATTR_POSIX_ACL_ACCESS), None);
    engine.commit().expect("commit");
    drop(engine);
    assert_check(&s.path, "after the engine's creates");
}
