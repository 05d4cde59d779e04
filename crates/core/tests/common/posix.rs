//! The differential POSIX test's machinery (tests/posix_diff.rs): a seeded generator of
//! namespace, attribute, xattr and data operations over a small namespace, two executors
//! that apply each operation to a kernel loop mount (real syscalls) and to the ubtrfs
//! engine, and walks of both resulting trees with xattrs and explicitly set times.
//!
//! The split between the two sides' code follows the kernel's: `Kernel` is syscalls only.
//! `Ubtrfs` stands in for the VFS (fs/namei.c, fs/open.c, fs/attr.c, fs/xattr.c) in
//! front of the engine, which plays the part of btrfs's inode operations. The stand-in
//! does what the VFS does before it calls a filesystem, and no more:
//! - path walks component by component (ENOENT, ENOTDIR; every symlink the generator
//!   makes dangles, so following one is ENOENT), the checks the VFS makes before the walk
//!   (`getname`'s PATH_MAX for symlink targets, `do_renameat2`'s flag rules, the xattr
//!   name and size limits, utimensat's "nothing to do" for two UTIME_OMITs), and
//!   `btrfs_lookup`'s ENAMETOOLONG for a name past 255 bytes;
//! - `open` by type (EISDIR, ENXIO for fifos and sockets without a peer, EACCES for
//!   devices on the `nodev` mount), `may_create_in_sticky` for O_CREAT of an existing
//!   file, O_TRUNC as a size change with mtime, `vfs_truncate`'s type checks,
//!   `vfs_link`'s EPERM for a directory (after filename_create's EEXIST);
//! - the attributes a new inode gets (`inode_init_owner`: the setgid directory rule,
//!   `vfs_mkdir` dropping S_ISUID/S_ISGID from the mode; a whiteout's owner).
//!
//! Everything else is the engine's, so the test checks it: EEXIST, ENOENT of the last
//! name, EISDIR/ENOTDIR/ENOTEMPTY of unlink, rmdir and rename, rename loops (EINVAL,
//! ENOTEMPTY), the same-inode rename, RENAME_NOREPLACE/EXCHANGE/WHITEOUT, chown's
//! set-ID clearing, setattr's time rules, the symlink length limit of the node size,
//! INODE_REF/INODE_EXTREF room and EMLINK, xattr namespaces, permissions (user.* only on
//! files and directories), flags and limits, fallocate's modes, SEEK_DATA/SEEK_HOLE. The results compared are the errno (or success) of every operation, what
//! reads return (lstat, data, xattrs), and the trees: type, mode, owner, size (a
//! directory's is twice its names' lengths), nlink, contents, symlink target, rdev,
//! xattrs, explicit times, readdir order.
//!
//! Invariants of the generated namespace: names come from a small pool (collisions are
//! the point), including one of 255 bytes and one of 256; symlink targets always start
//! with `zzq/`, a name that never exists, so following one never leaves the test's
//! mount; device nodes are only opened on the `nodev` kernel mount (EACCES), never
//! written. Explicit times (utimens) are before 2000, "now" is after, so the walks keep
//! a time only while it still is the explicit one: whether an operation updates mtime
//! is compared without comparing clocks. (ctime cannot be set, so it is not compared.)
//! Trailing slashes, `.` and `..` are not generated: they are the VFS's alone and never
//! reach the engine.
#![allow(dead_code)]

use crate::write_common::{hex, walk_kernel, walk_ubtrfs, Mount, Rec, Rng};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use ubtrfs_core::compression::CompressPolicy;
use ubtrfs_core::data::falloc::seek_in_file;
use ubtrfs_core::engine::Engine;
use ubtrfs_core::inode::attr::{SetAttr, TimeSet};
use ubtrfs_core::inode::filesystem::{DirEntry, FileKind, FsRead, InodeId, InodeView, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FileRead;
use ubtrfs_core::OpenOptions;
use ubtrfs_core::XattrRead;
use ubtrfs_format::structs::{rdev_decode, rdev_encode};

/// A path below the mount, as its components.
pub type P = Vec<Vec<u8>>;
pub type Errno = i32;

/// The longest name btrfs takes (BTRFS_NAME_LEN).
pub const NAME_MAX: usize = 255;
/// The VFS's limit for a path given to a syscall, NUL included.
pub const PATH_MAX: usize = 4096;
/// Times set explicitly are before this (2000-01-01); clocks are after it.
pub const EXPLICIT_BEFORE: i64 = 946_684_800;
const XATTR_NAME_MAX: usize = 255;
const XATTR_SIZE_MAX: usize = 65536;

pub fn long_name() -> Vec<u8> {
    let mut v = b"L".to_vec();
    v.resize(NAME_MAX, b'y');
    v
}

pub fn too_long_name() -> Vec<u8> {
    vec![b'T'; NAME_MAX + 1]
}

/// A time argument of utimensat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeArg {
    Set(i64, u32),
    Now,
    Omit,
}

/// One operation. Data and xattr values are made from `seed` on each side.
#[derive(Clone, Debug)]
pub enum Op {
    Create {
        path: P,
        mode: u32,
    },
    /// open(O_CREAT|O_TRUNC|O_WRONLY|O_NONBLOCK): creates, or truncates what is there.
    Creat {
        path: P,
        mode: u32,
    },
    Mkdir {
        path: P,
        mode: u32,
    },
    /// `mode` holds the type (S_IFIFO, S_IFCHR, S_IFBLK, S_IFSOCK).
    Mknod {
        path: P,
        mode: u32,
        rdev: (u32, u32),
    },
    Symlink {
        target: Vec<u8>,
        path: P,
    },
    Link {
        old: P,
        new: P,
    },
    /// `count` links of `old` in `dir`, named `link_name(tag, i)` (255 bytes each): past
    /// one INODE_REF item's room, into INODE_EXTREFs. Stops at the first failure.
    LinkMany {
        old: P,
        dir: P,
        tag: u8,
        count: u32,
    },
    Unlink {
        path: P,
    },
    /// Unlink `LinkMany`'s names `link_name(tag, 0..count)` in `dir`, all of them; the
    /// result is the first failure.
    UnlinkMany {
        dir: P,
        tag: u8,
        count: u32,
    },
    Rmdir {
        path: P,
    },
    Rename {
        old: P,
        new: P,
        flags: u32,
    },
    /// open(O_WRONLY|O_NONBLOCK), pwrite, close.
    Write {
        path: P,
        off: u64,
        len: usize,
        seed: u64,
    },
    Truncate {
        path: P,
        size: u64,
    },
    /// open(O_WRONLY|O_NONBLOCK), fallocate(mode), close.
    Fallocate {
        path: P,
        mode: i32,
        off: u64,
        len: u64,
    },
    /// open(O_RDONLY|O_NONBLOCK), lseek(SEEK_DATA or SEEK_HOLE), close.
    Seek {
        path: P,
        off: u64,
        whence: i32,
    },
    Chmod {
        path: P,
        mode: u32,
    },
    /// lchown; None is -1 (no change).
    Chown {
        path: P,
        uid: Option<u32>,
        gid: Option<u32>,
    },
    /// utimensat(AT_SYMLINK_NOFOLLOW).
    Utimens {
        path: P,
        atime: TimeArg,
        mtime: TimeArg,
    },
    Setxattr {
        path: P,
        name: Vec<u8>,
        len: usize,
        seed: u64,
        flags: i32,
    },
    Removexattr {
        path: P,
        name: Vec<u8>,
    },
    Getxattr {
        path: P,
        name: Vec<u8>,
    },
    Listxattr {
        path: P,
    },
    /// lstat.
    Stat {
        path: P,
    },
    /// open(O_RDONLY|O_NONBLOCK), pread, close.
    Read {
        path: P,
        off: u64,
        len: usize,
    },
    /// open(O_RDONLY|O_NONBLOCK|O_NOFOLLOW), FS_IOC_GETFLAGS, FS_IOC_SETFLAGS with `flag`
    /// (FS_IMMUTABLE_FL or FS_APPEND_FL) set or cleared, close: `chattr +i`, `-a`...
    /// What the flags refuse afterwards is where refusals meet the engine.
    Chattr {
        path: P,
        flag: u32,
        set: bool,
    },
    /// ubtrfs only: commit the running transaction.
    Commit,
    /// ubtrfs only: commit, drop the engine, open the image again.
    Reopen,
}

/// FS_IMMUTABLE_FL and FS_APPEND_FL (linux/fs.h).
pub const FS_IMMUTABLE_FL: u32 = 0x10;
pub const FS_APPEND_FL: u32 = 0x20;

/// Which operation, for weights and for gating operations the engine lacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OpKind {
    Create,
    Creat,
    Mkdir,
    Mknod,
    Symlink,
    Link,
    LinkMany,
    Unlink,
    UnlinkMany,
    Rmdir,
    Rename,
    /// rename with RENAME_WHITEOUT, kept apart: the engine may refuse it (EINVAL).
    RenameWhiteout,
    Write,
    Truncate,
    Fallocate,
    Seek,
    Chmod,
    Chown,
    Utimens,
    Setxattr,
    Removexattr,
    Getxattr,
    Listxattr,
    Stat,
    Read,
    Chattr,
    Commit,
    Reopen,
}

/// Relative weights (per mille) of each kind in a run.
pub const WEIGHTS: &[(OpKind, u32)] = &[
    (OpKind::Create, 90),
    (OpKind::Creat, 40),
    (OpKind::Mkdir, 70),
    (OpKind::Mknod, 30),
    (OpKind::Symlink, 40),
    (OpKind::Link, 55),
    (OpKind::LinkMany, 2),
    (OpKind::UnlinkMany, 2),
    (OpKind::Unlink, 110),
    (OpKind::Rmdir, 80),
    (OpKind::Rename, 120),
    (OpKind::RenameWhiteout, 5),
    (OpKind::Write, 120),
    (OpKind::Truncate, 40),
    (OpKind::Fallocate, 40),
    (OpKind::Seek, 20),
    (OpKind::Chmod, 25),
    (OpKind::Chown, 25),
    (OpKind::Utimens, 30),
    (OpKind::Setxattr, 55),
    (OpKind::Removexattr, 25),
    (OpKind::Getxattr, 25),
    (OpKind::Listxattr, 15),
    (OpKind::Stat, 30),
    (OpKind::Read, 20),
    (OpKind::Chattr, 30),
    (OpKind::Commit, 8),
    (OpKind::Reopen, 2),
];

impl Op {
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Create { .. } => OpKind::Create,
            Op::Creat { .. } => OpKind::Creat,
            Op::Mkdir { .. } => OpKind::Mkdir,
            Op::Mknod { .. } => OpKind::Mknod,
            Op::Symlink { .. } => OpKind::Symlink,
            Op::Link { .. } => OpKind::Link,
            Op::LinkMany { .. } => OpKind::LinkMany,
            Op::Unlink { .. } => OpKind::Unlink,
            Op::UnlinkMany { .. } => OpKind::UnlinkMany,
            Op::Rmdir { .. } => OpKind::Rmdir,
            Op::Rename { flags, .. } if flags & libc::RENAME_WHITEOUT != 0 => {
                OpKind::RenameWhiteout
            }
            Op::Rename { .. } => OpKind::Rename,
            Op::Write { .. } => OpKind::Write,
            Op::Truncate { .. } => OpKind::Truncate,
            Op::Fallocate { .. } => OpKind::Fallocate,
            Op::Seek { .. } => OpKind::Seek,
            Op::Chmod { .. } => OpKind::Chmod,
            Op::Chown { .. } => OpKind::Chown,
            Op::Utimens { .. } => OpKind::Utimens,
            Op::Setxattr { .. } => OpKind::Setxattr,
            Op::Removexattr { .. } => OpKind::Removexattr,
            Op::Getxattr { .. } => OpKind::Getxattr,
            Op::Listxattr { .. } => OpKind::Listxattr,
            Op::Stat { .. } => OpKind::Stat,
            Op::Read { .. } => OpKind::Read,
            Op::Chattr { .. } => OpKind::Chattr,
            Op::Commit => OpKind::Commit,
            Op::Reopen => OpKind::Reopen,
        }
    }

    /// The paths the operation names, for the known-disagreement predicates.
    pub fn paths(&self) -> Vec<&P> {
        match self {
            Op::Link { old, new } | Op::Rename { old, new, .. } => vec![old, new],
            Op::LinkMany { old, dir, .. } => vec![old, dir],
            Op::UnlinkMany { dir, .. } => vec![dir],
            Op::Create { path, .. }
            | Op::Creat { path, .. }
            | Op::Mkdir { path, .. }
            | Op::Mknod { path, .. }
            | Op::Symlink { path, .. }
            | Op::Unlink { path }
            | Op::Rmdir { path }
            | Op::Write { path, .. }
            | Op::Truncate { path, .. }
            | Op::Fallocate { path, .. }
            | Op::Seek { path, .. }
            | Op::Chmod { path, .. }
            | Op::Chown { path, .. }
            | Op::Utimens { path, .. }
            | Op::Setxattr { path, .. }
            | Op::Removexattr { path, .. }
            | Op::Chattr { path, .. }
            | Op::Getxattr { path, .. }
            | Op::Listxattr { path }
            | Op::Stat { path }
            | Op::Read { path, .. } => vec![path],
            Op::Commit | Op::Reopen => vec![],
        }
    }
}

/// A name for messages: long ones shortened to their first byte and length.
pub fn show_name(n: &[u8]) -> String {
    if n.len() > 16 {
        format!("{}{{{}}}", n[0] as char, n.len())
    } else {
        String::from_utf8_lossy(n).into_owned()
    }
}

pub fn show(p: &P) -> String {
    p.iter().map(|c| show_name(c)).collect::<Vec<_>>().join("/")
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Op::Create { path, mode } => write!(f, "create {} {mode:o}", show(path)),
            Op::Creat { path, mode } => write!(f, "creat {} {mode:o}", show(path)),
            Op::Mkdir { path, mode } => write!(f, "mkdir {} {mode:o}", show(path)),
            Op::Mknod { path, mode, rdev } => {
                write!(f, "mknod {} {mode:o} {}:{}", show(path), rdev.0, rdev.1)
            }
            Op::Symlink { target, path } => {
                write!(f, "symlink {} -> {}", show(path), show_name(target))
            }
            Op::Link { old, new } => write!(f, "link {} {}", show(old), show(new)),
            Op::LinkMany { old, dir, tag, count } => write!(
                f,
                "link {} {count} times into {}/ as {}NNN...",
                show(old),
                show(dir),
                *tag as char
            ),
            Op::Unlink { path } => write!(f, "unlink {}", show(path)),
            Op::UnlinkMany { dir, tag, count } => {
                write!(f, "unlink {}/{}NNN... 0..{count}", show(dir), *tag as char)
            }
            Op::Rmdir { path } => write!(f, "rmdir {}", show(path)),
            Op::Rename { old, new, flags } => {
                write!(f, "rename {} {} flags={flags}", show(old), show(new))
            }
            Op::Write { path, off, len, seed } => {
                write!(f, "write {} off={off} len={len} seed={seed}", show(path))
            }
            Op::Truncate { path, size } => write!(f, "truncate {} {size}", show(path)),
            Op::Fallocate { path, mode, off, len } => {
                write!(f, "fallocate {} mode={mode:#x} off={off} len={len}", show(path))
            }
            Op::Seek { path, off, whence } => write!(
                f,
                "lseek {} {off} {}",
                show(path),
                if *whence == libc::SEEK_DATA { "SEEK_DATA" } else { "SEEK_HOLE" }
            ),
            Op::Chmod { path, mode } => write!(f, "chmod {} {mode:o}", show(path)),
            Op::Chown { path, uid, gid } => write!(f, "lchown {} {uid:?}:{gid:?}", show(path)),
            Op::Utimens { path, atime, mtime } => {
                write!(f, "utimens {} atime={atime:?} mtime={mtime:?}", show(path))
            }
            Op::Setxattr { path, name, len, seed, flags } => write!(
                f,
                "setxattr {} {} len={len} seed={seed} flags={flags}",
                show(path),
                show_name(name)
            ),
            Op::Removexattr { path, name } => {
                write!(f, "removexattr {} {}", show(path), show_name(name))
            }
            Op::Getxattr { path, name } => write!(f, "getxattr {} {}", show(path), show_name(name)),
            Op::Listxattr { path } => write!(f, "listxattr {}", show(path)),
            Op::Stat { path } => write!(f, "lstat {}", show(path)),
            Op::Read { path, off, len } => write!(f, "read {} off={off} len={len}", show(path)),
            Op::Chattr { path, flag, set } => write!(
                f,
                "chattr {}{} {}",
                if *set { '+' } else { '-' },
                if *flag == FS_IMMUTABLE_FL { 'i' } else { 'a' },
                show(path)
            ),
            Op::Commit => write!(f, "commit (ubtrfs)"),
            Op::Reopen => write!(f, "reopen (ubtrfs)"),
        }
    }
}

/// The 255-byte name of `LinkMany`'s link `i`.
pub fn link_name(tag: u8, i: u32) -> Vec<u8> {
    let mut n = format!("{}{i:03}", tag as char).into_bytes();
    n.resize(NAME_MAX, b'w');
    n
}

/// `LinkMany` as the links it makes.
fn link_many(op: &Op) -> Vec<Op> {
    let Op::LinkMany { old, dir, tag, count } = op else { unreachable!("link_many of {op}") };
    (0..*count)
        .map(|i| {
            let mut new = dir.clone();
            new.push(link_name(*tag, i));
            Op::Link { old: old.clone(), new }
        })
        .collect()
}

/// What `LinkMany` and `UnlinkMany` did: how many succeeded, and the first failure.
fn many_summary(n: usize, first_error: Option<Errno>) -> String {
    match first_error {
        Some(e) => format!("{n} done, first failure {}", errno_name(e)),
        None => format!("{n} done"),
    }
}

/// `UnlinkMany` as the unlinks it makes.
fn unlink_many(op: &Op) -> Vec<Op> {
    let Op::UnlinkMany { dir, tag, count } = op else { unreachable!("unlink_many of {op}") };
    (0..*count)
        .map(|i| {
            let mut path = dir.clone();
            path.push(link_name(*tag, i));
            Op::Unlink { path }
        })
        .collect()
}

/// The bytes a write or an xattr value carries.
pub fn data_of(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng::new(seed);
    // Some data compresses, some does not (for compressed mounts later).
    if seed.is_multiple_of(3) {
        let b = r.bytes(16);
        (0..len).map(|i| b[i % 16]).collect()
    } else {
        r.bytes(len)
    }
}

/// Which names a path's last component comes from.
#[derive(Clone, Copy)]
enum Pool {
    Dir,
    File,
    Any,
}

/// The seeded generator. It knows nothing of the state: which operations succeed is
/// the namespace's business, and the small name pool makes every outcome common.
pub struct Gen {
    rng: Rng,
    kinds: Vec<(OpKind, u32)>,
    total: u32,
    /// Paths recent operations made (whether or not they succeeded), reused as the
    /// paths of later ones: more of those find something there.
    recent: Vec<P>,
    /// The same for regular files (create), for the data operations.
    recent_files: Vec<P>,
}

/// How many made paths `Gen` remembers.
const RECENT: usize = 24;

fn remember(rng: &mut Rng, v: &mut Vec<P>, p: &P) {
    if v.len() == RECENT {
        let i = rng.below(RECENT as u64) as usize;
        v[i] = p.clone();
    } else {
        v.push(p.clone());
    }
}

impl Gen {
    pub fn new(seed: u64, avail: &[OpKind]) -> Gen {
        let kinds: Vec<(OpKind, u32)> =
            WEIGHTS.iter().copied().filter(|(k, _)| avail.contains(k)).collect();
        let total = kinds.iter().map(|k| k.1).sum();
        assert!(total > 0, "no operation available");
        Gen {
            rng: Rng::new(seed ^ 0x5EED_F905),
            kinds,
            total,
            recent: Vec::new(),
            recent_files: Vec::new(),
        }
    }

    /// A name from `pool`: the pools share `c` and the long names, so a file and a
    /// directory meet often enough.
    fn name(&mut self, pool: Pool) -> Vec<u8> {
        let x = self.rng.below(100);
        let (one, two) = match pool {
            Pool::Dir => (&b"a"[..], &b"b"[..]),
            Pool::File => (&b"e"[..], &b"f"[..]),
            Pool::Any if x.is_multiple_of(2) => (&b"a"[..], &b"e"[..]),
            Pool::Any => (&b"b"[..], &b"f"[..]),
        };
        match x {
            0..=34 => one.to_vec(),
            35..=69 => two.to_vec(),
            70..=84 => b"c".to_vec(),
            85..=96 => long_name(),
            _ => too_long_name(),
        }
    }

    /// A path of one to three names, the last from `pool`, the others mostly directory
    /// names.
    fn path(&mut self, pool: Pool) -> P {
        let depth = match self.rng.below(100) {
            0..=44 => 1,
            45..=84 => 2,
            _ => 3,
        };
        let mut p: P = (1..depth)
            .map(|_| if self.rng.chance(90) { self.name(Pool::Dir) } else { self.name(Pool::File) })
            .collect();
        p.push(self.name(pool));
        p
    }

    /// A path that may exist: half the time one a recent operation made.
    fn existing(&mut self, pool: Pool) -> P {
        if !self.recent.is_empty() && self.rng.chance(50) {
            let i = self.rng.below(self.recent.len() as u64) as usize;
            return self.recent[i].clone();
        }
        self.path(pool)
    }

    /// A path to make something at, remembered for `existing`.
    fn made(&mut self, pool: Pool) -> P {
        let p = self.path(pool);
        remember(&mut self.rng, &mut self.recent, &p);
        p
    }

    /// A path to create a regular file at, remembered for `file`.
    fn made_file(&mut self) -> P {
        let p = self.made(Pool::File);
        remember(&mut self.rng, &mut self.recent_files, &p);
        p
    }

    /// A path for a data operation: most of the time a recently created file's.
    fn file(&mut self) -> P {
        if !self.recent_files.is_empty() && self.rng.chance(60) {
            let i = self.rng.below(self.recent_files.len() as u64) as usize;
            return self.recent_files[i].clone();
        }
        self.existing(Pool::File)
    }

    fn perm(&mut self) -> u32 {
        *self
            .rng
            .pick(&[0o644, 0o600, 0o755, 0o700, 0o4755, 0o2755, 0o2775, 0o1777, 0o6711, 0, 0o7777])
            as u32
    }

    fn time(&mut self) -> TimeArg {
        match self.rng.below(100) {
            0..=69 => {
                let sec = self.rng.below(2_000_000_000) as i64 - 1_100_000_000;
                TimeArg::Set(sec.min(EXPLICIT_BEFORE - 1), self.rng.below(1_000_000_000) as u32)
            }
            70..=84 => TimeArg::Now,
            _ => TimeArg::Omit,
        }
    }

    fn id(&mut self) -> Option<u32> {
        *self.rng.pick(&[None, Some(0), Some(1000), Some(65534), Some(u32::MAX - 1)])
    }

    fn xattr_name(&mut self) -> Vec<u8> {
        match self.rng.below(100) {
            0..=34 => b"user.a".to_vec(),
            35..=59 => b"user.b".to_vec(),
            60..=74 => b"trusted.t".to_vec(),
            75..=81 => b"security.s".to_vec(),
            82..=89 => {
                let mut n = b"user.".to_vec();
                n.resize(XATTR_NAME_MAX, b'x');
                n
            }
            90..=93 => {
                let mut n = b"user.".to_vec();
                n.resize(XATTR_NAME_MAX + 1, b'x');
                n
            }
            94..=96 => b"user.".to_vec(),
            _ => b"other.o".to_vec(),
        }
    }

    fn xattr_len(&mut self) -> usize {
        match self.rng.below(100) {
            0..=9 => 0,
            10..=59 => self.rng.range(1, 64) as usize,
            60..=79 => self.rng.range(64, 2000) as usize,
            80..=89 => self.rng.range(2000, 16000) as usize,
            90..=95 => self.rng.range(16150, 16300) as usize,
            96..=97 => 20000,
            _ => XATTR_SIZE_MAX + 1,
        }
    }

    fn target(&mut self) -> Vec<u8> {
        let len = match self.rng.below(100) {
            0..=59 => self.rng.range(5, 40) as usize,
            60..=74 => self.rng.range(40, 300) as usize,
            75..=81 => self.rng.range(300, 2000) as usize,
            82..=89 => PATH_MAX - 1,
            90..=96 => PATH_MAX,
            _ => 0,
        };
        let mut t = b"zzq/".to_vec();
        let mut i = 0u8;
        while t.len() < len {
            // Components of up to 200 bytes, never reached (zzq does not exist).
            t.push(if t.len().is_multiple_of(200) { b'/' } else { b'a' + i % 26 });
            i = i.wrapping_add(1);
        }
        t.truncate(len);
        t
    }

    pub fn next_op(&mut self) -> Op {
        let mut x = self.rng.below(u64::from(self.total)) as u32;
        let mut kind = self.kinds[0].0;
        for &(k, w) in &self.kinds {
            if x < w {
                kind = k;
                break;
            }
            x -= w;
        }
        match kind {
            OpKind::Create => Op::Create { path: self.made_file(), mode: self.perm() },
            OpKind::Creat => {
                let path = if self.rng.chance(50) { self.file() } else { self.made_file() };
                Op::Creat { path, mode: self.perm() }
            }
            OpKind::Mkdir => Op::Mkdir { path: self.made(Pool::Dir), mode: self.perm() },
            OpKind::Mknod => {
                let t =
                    *self.rng.pick(&[libc::S_IFIFO, libc::S_IFCHR, libc::S_IFBLK, libc::S_IFSOCK]);
                let rdev = if t == libc::S_IFCHR || t == libc::S_IFBLK {
                    *self.rng.pick(&[(1, 3), (8, 1), (240, 77), (4095, 0xfffff), (0, 0)])
                } else {
                    (0, 0)
                };
                Op::Mknod { path: self.made(Pool::File), mode: t | self.perm(), rdev }
            }
            OpKind::Symlink => Op::Symlink { target: self.target(), path: self.made(Pool::File) },
            OpKind::UnlinkMany => {
                let dir = if self.rng.chance(30) { Vec::new() } else { self.existing(Pool::Dir) };
                let tag = *self.rng.pick(b"XYZ");
                Op::UnlinkMany { dir, tag, count: self.rng.range(20, 120) as u32 }
            }
            OpKind::LinkMany => {
                let old = self.file();
                let dir = if self.rng.chance(30) { Vec::new() } else { self.existing(Pool::Dir) };
                let tag = *self.rng.pick(b"XYZ");
                Op::LinkMany { old, dir, tag, count: self.rng.range(40, 120) as u32 }
            }
            OpKind::Link => Op::Link { old: self.existing(Pool::File), new: self.made(Pool::File) },
            OpKind::Unlink => Op::Unlink { path: self.existing(Pool::File) },
            OpKind::Rmdir => Op::Rmdir { path: self.existing(Pool::Dir) },
            OpKind::Rename | OpKind::RenameWhiteout => {
                let old = self.existing(Pool::Any);
                let new = if self.rng.chance(12) {
                    // Into its own subtree (EINVAL), or onto an ancestor (ENOTEMPTY).
                    let mut n = old.clone();
                    if self.rng.chance(70) || n.len() == 1 {
                        n.push(self.name(Pool::Any));
                    } else {
                        n.pop();
                    }
                    n
                } else {
                    self.made(Pool::Any)
                };
                let flags = if kind == OpKind::RenameWhiteout {
                    libc::RENAME_WHITEOUT
                } else {
                    match self.rng.below(100) {
                        0..=69 => 0,
                        70..=83 => libc::RENAME_NOREPLACE,
                        84..=97 => libc::RENAME_EXCHANGE,
                        _ => libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE,
                    }
                };
                Op::Rename { old, new, flags }
            }
            OpKind::Write => {
                let off = match self.rng.below(100) {
                    0..=19 => 0,
                    20..=44 => self.rng.below(4096),
                    45..=79 => self.rng.below(300 << 10),
                    _ => self.rng.below(256) * 4096,
                };
                let len = match self.rng.below(100) {
                    0..=19 => self.rng.range(1, 64),
                    20..=44 => self.rng.range(64, 3000),
                    45..=54 => 4096,
                    55..=84 => self.rng.range(1, 70000),
                    _ => self.rng.range(70000, 300_000),
                } as usize;
                let seed = self.rng.next_u64();
                Op::Write { path: self.file(), off, len, seed }
            }
            OpKind::Truncate => {
                let size = match self.rng.below(100) {
                    0..=19 => 0,
                    20..=49 => self.rng.below(4096),
                    50..=79 => self.rng.below(300 << 10),
                    _ => self.rng.below(1536 << 10),
                };
                Op::Truncate { path: self.file(), size }
            }
            OpKind::Fallocate => {
                let mode = match self.rng.below(100) {
                    0..=39 => 0,
                    40..=59 => libc::FALLOC_FL_KEEP_SIZE,
                    60..=79 => libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    80..=89 => libc::FALLOC_FL_ZERO_RANGE,
                    90..=94 => libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                    95..=96 => libc::FALLOC_FL_PUNCH_HOLE,
                    97 => libc::FALLOC_FL_COLLAPSE_RANGE,
                    _ => {
                        libc::FALLOC_FL_PUNCH_HOLE
                            | libc::FALLOC_FL_ZERO_RANGE
                            | libc::FALLOC_FL_KEEP_SIZE
                    }
                };
                let off = match self.rng.below(100) {
                    0..=19 => 0,
                    20..=49 => self.rng.below(8192),
                    50..=79 => self.rng.below(400 << 10),
                    _ => self.rng.below(256) * 4096,
                };
                let len = match self.rng.below(100) {
                    0..=1 => 0,
                    2..=29 => self.rng.range(1, 4096),
                    30..=49 => 4096 * self.rng.range(1, 16),
                    _ => self.rng.range(1, 300_000),
                };
                Op::Fallocate { path: self.file(), mode, off, len }
            }
            OpKind::Seek => {
                let off = if self.rng.chance(30) {
                    self.rng.below(8192)
                } else {
                    self.rng.below(1536 << 10)
                };
                let whence = if self.rng.chance(50) { libc::SEEK_DATA } else { libc::SEEK_HOLE };
                Op::Seek { path: self.file(), off, whence }
            }
            OpKind::Chmod => {
                let mode =
                    if self.rng.chance(50) { self.rng.below(0o10000) as u32 } else { self.perm() };
                Op::Chmod { path: self.existing(Pool::Any), mode }
            }
            OpKind::Chown => {
                Op::Chown { path: self.existing(Pool::Any), uid: self.id(), gid: self.id() }
            }
            OpKind::Utimens => Op::Utimens {
                path: self.existing(Pool::Any),
                atime: self.time(),
                mtime: self.time(),
            },
            OpKind::Setxattr => {
                let flags = match self.rng.below(100) {
                    0..=69 => 0,
                    70..=81 => libc::XATTR_CREATE,
                    82..=93 => libc::XATTR_REPLACE,
                    _ => libc::XATTR_CREATE | libc::XATTR_REPLACE,
                };
                Op::Setxattr {
                    path: self.existing(Pool::Any),
                    name: self.xattr_name(),
                    len: self.xattr_len(),
                    seed: self.rng.next_u64(),
                    flags,
                }
            }
            OpKind::Removexattr => {
                Op::Removexattr { path: self.existing(Pool::Any), name: self.xattr_name() }
            }
            OpKind::Getxattr => {
                Op::Getxattr { path: self.existing(Pool::Any), name: self.xattr_name() }
            }
            OpKind::Listxattr => Op::Listxattr { path: self.existing(Pool::Any) },
            OpKind::Stat => Op::Stat { path: self.existing(Pool::Any) },
            OpKind::Read => {
                let off = self.rng.below(400 << 10);
                let len = self.rng.range(1, 100_000) as usize;
                Op::Read { path: self.file(), off, len }
            }
            OpKind::Chattr => {
                let flag = if self.rng.chance(50) { FS_IMMUTABLE_FL } else { FS_APPEND_FL };
                // Cleared more often than set, so most of the namespace stays changeable.
                Op::Chattr { path: self.existing(Pool::Any), flag, set: self.rng.chance(40) }
            }
            OpKind::Commit => Op::Commit,
            OpKind::Reopen => Op::Reopen,
        }
    }
}

/// What an operation returns besides success.
#[derive(Clone, PartialEq, Eq)]
pub enum Out {
    Done,
    Data(Vec<u8>),
    Names(Vec<Vec<u8>>),
    Stat(StatRec),
    /// An lseek position.
    Pos(u64),
}

impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Out::Done => write!(f, "ok"),
            Out::Data(d) => {
                write!(f, "{} bytes sha256 {}", d.len(), &hex(&Sha256::digest(d))[..16])
            }
            Out::Names(n) => write!(f, "{:?}", n.iter().map(|n| show_name(n)).collect::<Vec<_>>()),
            Out::Stat(s) => write!(f, "{s:?}"),
            Out::Pos(p) => write!(f, "position {p}"),
        }
    }
}

/// lstat's answer, with times kept only while explicit (see the module documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatRec {
    pub kind: char,
    pub perm: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub nlink: u32,
    pub rdev: (u32, u32),
    pub atime: Option<(i64, u32)>,
    pub mtime: Option<(i64, u32)>,
}

pub type Outcome = Result<Out, Errno>;

pub fn explicit(sec: i64, nsec: u32) -> Option<(i64, u32)> {
    (sec < EXPLICIT_BEFORE).then_some((sec, nsec))
}

fn kind_of_mode(mode: u32) -> char {
    match mode & libc::S_IFMT {
        libc::S_IFREG => 'f',
        libc::S_IFDIR => 'd',
        libc::S_IFLNK => 'l',
        libc::S_IFIFO => 'p',
        libc::S_IFCHR => 'c',
        libc::S_IFBLK => 'b',
        libc::S_IFSOCK => 's',
        m => panic!("unknown file type {m:o}"),
    }
}

fn errno() -> Errno {
    std::io::Error::last_os_error().raw_os_error().expect("an OS error has an errno")
}

fn ck(r: libc::c_int) -> Outcome {
    if r < 0 {
        Err(errno())
    } else {
        Ok(Out::Done)
    }
}

fn cstr(b: &[u8]) -> CString {
    CString::new(b).expect("generated names hold no NUL")
}

fn timespec(t: TimeArg) -> libc::timespec {
    match t {
        TimeArg::Set(s, n) => {
            libc::timespec { tv_sec: s as libc::time_t, tv_nsec: n as libc::c_long }
        }
        TimeArg::Now => libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_NOW },
        TimeArg::Omit => libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT },
    }
}

/// The kernel side: each operation is its syscalls on the mount.
pub struct Kernel {
    pub dir: PathBuf,
    /// The mkfs options of the image (for the known-disagreement predicates).
    pub mkfs: &'static [&'static str],
    /// Whether the mount compresses (likewise).
    pub compress: bool,
}

impl Kernel {
    fn c(&self, p: &P) -> CString {
        let mut b = self.dir.as_os_str().as_bytes().to_vec();
        for c in p {
            b.push(b'/');
            b.extend_from_slice(c);
        }
        cstr(&b)
    }

    /// lstat's file type of `p`, None when it cannot be stat'ed.
    pub fn kind(&self, p: &P) -> Option<char> {
        let c = self.c(p);
        // SAFETY: `st` is written by lstat before it is read; `c` is NUL-terminated.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        (unsafe { libc::lstat(c.as_ptr(), &mut st) } == 0).then(|| kind_of_mode(st.st_mode))
    }

    /// lstat of `p` (its inode number included) for the predicates.
    pub fn lstat(&self, p: &P) -> Option<libc::stat> {
        let c = self.c(p);
        // SAFETY: as in `kind`.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        (unsafe { libc::lstat(c.as_ptr(), &mut st) } == 0).then_some(st)
    }

    /// Whether FIEMAP shows anything in [start, end) of `p`: data, preallocated
    /// extents or delalloc (dirty pages); false when it cannot be opened. Without the
    /// SYNC flag, so the page cache stays as it is.
    pub fn has_extent_in(&self, p: &P, start: u64, end: u64) -> bool {
        /// `struct fiemap` with room for one `struct fiemap_extent` (linux/fiemap.h).
        #[repr(C)]
        struct Fiemap {
            fm_start: u64,
            fm_length: u64,
            fm_flags: u32,
            fm_mapped_extents: u32,
            fm_extent_count: u32,
            fm_reserved: u32,
            fm_extent: [u64; 7],
        }
        /// _IOWR('f', 11, struct fiemap).
        const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
        if end <= start {
            return false;
        }
        let c = self.c(p);
        let mut fm = Fiemap {
            fm_start: start,
            fm_length: end - start,
            fm_flags: 0,
            fm_mapped_extents: 0,
            fm_extent_count: 1,
            fm_reserved: 0,
            fm_extent: [0; 7],
        };
        // SAFETY: a NUL-terminated path; `fm` has room for the one extent asked for;
        // the descriptor is closed once.
        unsafe {
            let fd = libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC);
            if fd < 0 {
                return false;
            }
            let r = libc::ioctl(fd, FS_IOC_FIEMAP, &mut fm as *mut Fiemap);
            libc::close(fd);
            r == 0 && fm.fm_mapped_extents > 0
        }
    }

    /// FS_IOC_GETFLAGS of `p` (not followed); 0 when it cannot be opened or asked.
    pub fn fsflags(&self, p: &P) -> u32 {
        const GET: libc::c_ulong = 0x8008_6601;
        let c = self.c(p);
        // SAFETY: a NUL-terminated path; the flags are written by the ioctl into a
        // long; the descriptor is closed once.
        unsafe {
            let fd = libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            );
            if fd < 0 {
                return 0;
            }
            let mut fl: libc::c_long = 0;
            let r = libc::ioctl(fd, GET, &mut fl as *mut libc::c_long);
            libc::close(fd);
            if r == 0 {
                fl as u32
            } else {
                0
            }
        }
    }

    /// The length of xattr `name` of `p` (not followed), None when it has none.
    pub fn xattr_len(&self, p: &P, name: &[u8]) -> Option<usize> {
        let c = self.c(p);
        // SAFETY: a size query (NULL buffer, size 0) of NUL-terminated strings.
        let n =
            unsafe { libc::lgetxattr(c.as_ptr(), cstr(name).as_ptr(), std::ptr::null_mut(), 0) };
        (n >= 0).then_some(n as usize)
    }

    pub fn apply(&self, op: &Op) -> Outcome {
        if let Op::LinkMany { .. } = op {
            let n = link_many(op).iter().map(|l| self.apply(l)).take_while(|r| r.is_ok()).count();
            let r = link_many(op).get(n).map(|l| self.apply(l));
            return Ok(Out::Data(many_summary(n, r.and_then(|r| r.err())).into_bytes()));
        }
        if let Op::UnlinkMany { .. } = op {
            let rs: Vec<Outcome> = unlink_many(op).iter().map(|u| self.apply(u)).collect();
            return Ok(Out::Data(
                many_summary(
                    rs.iter().filter(|r| r.is_ok()).count(),
                    rs.iter().find_map(|r| r.clone().err()),
                )
                .into_bytes(),
            ));
        }
        // SAFETY: (every call below) the paths are NUL-terminated CStrings that outlive
        // the call; buffers are passed with their true lengths; descriptors are closed
        // once.
        unsafe {
            match op {
                Op::Create { path, mode } => {
                    let fd = libc::open(
                        self.c(path).as_ptr(),
                        libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_CLOEXEC,
                        *mode as libc::c_uint,
                    );
                    if fd < 0 {
                        return Err(errno());
                    }
                    libc::close(fd);
                    Ok(Out::Done)
                }
                Op::Creat { path, mode } => {
                    let fd = libc::open(
                        self.c(path).as_ptr(),
                        libc::O_CREAT
                            | libc::O_TRUNC
                            | libc::O_WRONLY
                            | libc::O_NONBLOCK
                            | libc::O_CLOEXEC,
                        *mode as libc::c_uint,
                    );
                    if fd < 0 {
                        return Err(errno());
                    }
                    libc::close(fd);
                    Ok(Out::Done)
                }
                Op::Mkdir { path, mode } => ck(libc::mkdir(self.c(path).as_ptr(), *mode)),
                Op::Mknod { path, mode, rdev } => {
                    ck(libc::mknod(self.c(path).as_ptr(), *mode, libc::makedev(rdev.0, rdev.1)))
                }
                Op::Symlink { target, path } => {
                    ck(libc::symlink(cstr(target).as_ptr(), self.c(path).as_ptr()))
                }
                Op::Link { old, new } => ck(libc::linkat(
                    libc::AT_FDCWD,
                    self.c(old).as_ptr(),
                    libc::AT_FDCWD,
                    self.c(new).as_ptr(),
                    0,
                )),
                Op::Unlink { path } => ck(libc::unlink(self.c(path).as_ptr())),
                Op::Rmdir { path } => ck(libc::rmdir(self.c(path).as_ptr())),
                Op::Rename { old, new, flags } => ck(libc::renameat2(
                    libc::AT_FDCWD,
                    self.c(old).as_ptr(),
                    libc::AT_FDCWD,
                    self.c(new).as_ptr(),
                    *flags,
                )),
                Op::Write { path, off, len, seed } => {
                    let fd = libc::open(
                        self.c(path).as_ptr(),
                        libc::O_WRONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
                    );
                    if fd < 0 {
                        return Err(errno());
                    }
                    let data = data_of(*seed, *len);
                    let mut done = 0;
                    let mut r = Ok(Out::Done);
                    while done < data.len() {
                        let n = libc::pwrite(
                            fd,
                            data[done..].as_ptr().cast(),
                            data.len() - done,
                            (*off + done as u64) as libc::off_t,
                        );
                        if n < 0 {
                            r = Err(errno());
                            break;
                        }
                        done += n as usize;
                    }
                    libc::close(fd);
                    r
                }
                Op::Truncate { path, size } => {
                    ck(libc::truncate(self.c(path).as_ptr(), *size as libc::off_t))
                }
                Op::Fallocate { path, mode, off, len } => {
                    let fd = libc::open(
                        self.c(path).as_ptr(),
                        libc::O_WRONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
                    );
                    if fd < 0 {
                        return Err(errno());
                    }
                    let r =
                        ck(libc::fallocate(fd, *mode, *off as libc::off_t, *len as libc::off_t));
                    libc::close(fd);
                    r
                }
                Op::Seek { path, off, whence } => {
                    let fd = libc::open(
                        self.c(path).as_ptr(),
                        libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
                    );
                    if fd < 0 {
                        return Err(errno());
                    }
                    let r = libc::lseek(fd, *off as libc::off_t, *whence);
                    let r = if r < 0 { Err(errno()) } else { Ok(Out::Pos(r as u64)) };
                    libc::close(fd);
                    r
                }
                Op::Chmod { path, mode } => ck(libc::chmod(self.c(path).as_ptr(), *mode)),
                Op::Chown { path, uid, gid } => ck(libc::lchown(
                    self.c(path).as_ptr(),
                    uid.unwrap_or(u32::MAX),
                    gid.unwrap_or(u32::MAX),
                )),
                Op::Utimens { path, atime, mtime } => {
                    let ts = [timespec(*atime), timespec(*mtime)];
                    ck(libc::utimensat(
                        libc::AT_FDCWD,
                        self.c(path).as_ptr(),
                        ts.as_ptr(),
                        libc::AT_SYMLINK_NOFOLLOW,
                    ))
                }
                Op::Setxattr { path, name, len, seed, flags } => {
                    let v = data_of(*seed, *len);
                    ck(libc::lsetxattr(
                        self.c(path).as_ptr(),
                        cstr(name).as_ptr(),
                        v.as_ptr().cast(),
                        v.len(),
                        *flags,
                    ))
                }
                Op::Removexattr { path, name } => {
                    ck(libc::lremovexattr(self.c(path).as_ptr(), cstr(name).as_ptr()))
                }
                Op::Getxattr { path, name } => {
                    let mut buf = vec![0u8; XATTR_SIZE_MAX];
                    let n = libc::lgetxattr(
                        self.c(path).as_ptr(),
                        cstr(name).as_ptr(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                    );
                    if n < 0 {
                        return Err(errno());
                    }
                    buf.truncate(n as usize);
                    Ok(Out::Data(buf))
                }
                Op::Listxattr { path } => {
                    let mut buf = vec![0u8; XATTR_SIZE_MAX];
                    let n =
                        libc::llistxattr(self.c(path).as_ptr(), buf.as_mut_ptr().cast(), buf.len());
                    if n < 0 {
                        return Err(errno());
                    }
                    buf.truncate(n as usize);
                    let mut names: Vec<Vec<u8>> = buf
                        .split(|&b| b == 0)
                        .filter(|n| !n.is_empty())
                        .map(|n| n.to_vec())
                        .collect();
                    names.sort();
                    Ok(Out::Names(names))
                }
                Op::Chattr { path, flag, set } => {
                    /// FS_IOC_GETFLAGS / FS_IOC_SETFLAGS (the `long` ioctls).
                    const GET: libc::c_ulong = 0x8008_6601;
                    const SET: libc::c_ulong = 0x4008_6602;
                    let fd = libc::open(
                        self.c(path).as_ptr(),
                        libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                    );
                    if fd < 0 {
                        return Err(errno());
                    }
                    let mut fl: libc::c_long = 0;
                    let mut r = libc::ioctl(fd, GET, &mut fl as *mut libc::c_long);
                    if r == 0 {
                        fl = if *set {
                            fl | *flag as libc::c_long
                        } else {
                            fl & !(*flag as libc::c_long)
                        };
                        r = libc::ioctl(fd, SET, &fl as *const libc::c_long);
                    }
                    let e = errno();
                    libc::close(fd);
                    if r < 0 {
                        Err(e)
                    } else {
                        Ok(Out::Done)
                    }
                }
                Op::Stat { path } => {
                    let c = self.c(path);
                    let mut st: libc::stat = std::mem::zeroed();
                    if libc::lstat(c.as_ptr(), &mut st) < 0 {
                        return Err(errno());
                    }
                    Ok(Out::Stat(stat_rec(&st)))
                }
                Op::Read { path, off, len } => {
                    let fd = libc::open(
                        self.c(path).as_ptr(),
                        libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
                    );
                    if fd < 0 {
                        return Err(errno());
                    }
                    let mut buf = vec![0u8; *len];
                    let mut done = 0;
                    let mut r = Ok(());
                    while done < buf.len() {
                        let n = libc::pread(
                            fd,
                            buf[done..].as_mut_ptr().cast(),
                            buf.len() - done,
                            (*off + done as u64) as libc::off_t,
                        );
                        if n < 0 {
                            r = Err(errno());
                            break;
                        }
                        if n == 0 {
                            break;
                        }
                        done += n as usize;
                    }
                    libc::close(fd);
                    r?;
                    buf.truncate(done);
                    Ok(Out::Data(buf))
                }
                Op::Commit | Op::Reopen => Ok(Out::Done),
                Op::LinkMany { .. } | Op::UnlinkMany { .. } => unreachable!("applied as its links"),
            }
        }
    }
}

fn stat_rec(st: &libc::stat) -> StatRec {
    let kind = kind_of_mode(st.st_mode);
    let rdev = if kind == 'c' || kind == 'b' {
        (libc::major(st.st_rdev), libc::minor(st.st_rdev))
    } else {
        (0, 0)
    };
    StatRec {
        kind,
        perm: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        size: st.st_size as u64,
        nlink: st.st_nlink as u32,
        rdev,
        atime: explicit(st.st_atime, st.st_atime_nsec as u32),
        mtime: explicit(st.st_mtime, st.st_mtime_nsec as u32),
    }
}

/// Why the ubtrfs side did not succeed: a POSIX error (compared with the kernel's), or
/// anything else, which is a bug whatever the kernel said.
#[derive(Debug)]
pub enum Fail {
    Errno(Errno),
    Bug(String),
}

thread_local! {
    /// The message of the last engine error turned into an errno, for the report.
    static LAST_ERROR: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

fn fail(e: ubtrfs_core::Error) -> Fail {
    LAST_ERROR.with(|l| *l.borrow_mut() = e.to_string());
    match e.posix_kind() {
        Some(k) => Fail::Errno(k.errno()),
        None => Fail::Bug(e.to_string()),
    }
}

impl From<ubtrfs_core::Error> for Fail {
    fn from(e: ubtrfs_core::Error) -> Fail {
        fail(e)
    }
}

type UResult<T> = Result<T, Fail>;

fn en(errno: Errno) -> Fail {
    Fail::Errno(errno)
}

/// `btrfs_lookup`: ENAMETOOLONG before any search.
fn lookup<V: FileRead>(l: &V, dir: InodeId, name: &[u8]) -> UResult<Option<DirEntry>> {
    if name.len() > NAME_MAX {
        return Err(en(libc::ENAMETOOLONG));
    }
    Ok(l.lookup(dir, name)?)
}

/// The VFS walk of every component but the last: the directory it ends at.
fn walk_parent<V: FileRead>(l: &V, top: InodeId, p: &P) -> UResult<InodeId> {
    let mut cur = top;
    for c in &p[..p.len() - 1] {
        let e = lookup(l, cur, c)?.ok_or(en(libc::ENOENT))?;
        cur = match e.ftype {
            ubtrfs_format::structs::FT_DIR => e.target,
            // Every generated target starts with a name that never exists.
            ubtrfs_format::structs::FT_SYMLINK => return Err(en(libc::ENOENT)),
            _ => return Err(en(libc::ENOTDIR)),
        };
    }
    Ok(cur)
}

/// The whole walk: the inode `p` names (the last symlink followed if `follow`).
fn resolve<V: FileRead>(l: &V, top: InodeId, p: &P, follow: bool) -> UResult<InodeView> {
    let dir = walk_parent(l, top, p)?;
    let e = lookup(l, dir, p.last().expect("paths have a name"))?.ok_or(en(libc::ENOENT))?;
    let v = l.load_inode(e.target, Load::ITEM)?;
    if follow && v.kind() == FileKind::Symlink {
        let t = l.readlink(e.target)?;
        assert!(t.starts_with(b"zzq/"), "a generated symlink target: {}", show_name(&t));
        return Err(en(libc::ENOENT));
    }
    Ok(v)
}

fn last(p: &P) -> &[u8] {
    p.last().expect("paths have a name")
}

fn file_kind_char(k: FileKind) -> char {
    match k {
        FileKind::File => 'f',
        k => k.letter(),
    }
}

fn stat_of(v: &InodeView) -> StatRec {
    let kind = file_kind_char(v.kind());
    let rdev = if kind == 'c' || kind == 'b' { rdev_decode(v.item.rdev.get()) } else { (0, 0) };
    StatRec {
        kind,
        perm: v.mode() & 0o7777,
        uid: v.item.uid.get(),
        gid: v.item.gid.get(),
        size: v.size(),
        nlink: v.nlink(),
        rdev,
        atime: explicit(v.item.atime.sec.get() as i64, v.item.atime.nsec.get()),
        mtime: explicit(v.item.mtime.sec.get() as i64, v.item.mtime.nsec.get()),
    }
}

/// `inode_init_owner` for a new inode in directory `dir` made by root: the group and
/// the setgid bit of a setgid directory pass on.
fn new_attrs<V: FileRead>(l: &V, dir: InodeId, mode: u32) -> UResult<InodeAttrs> {
    let d = l.load_inode(dir, Load::ITEM)?;
    let mut a = InodeAttrs::new(mode);
    if d.mode() & libc::S_ISGID != 0 {
        a.gid = d.item.gid.get();
        if mode & libc::S_IFMT == libc::S_IFDIR {
            a.mode |= libc::S_ISGID;
        }
    }
    Ok(a)
}

/// The ubtrfs side: the VFS stand-in over an engine on the image.
pub struct Ubtrfs {
    pub img: PathBuf,
    engine: Option<Engine>,
    top: InodeId,
    compress: Option<(&'static str, bool)>,
    pub commits: u64,
    pub reopens: u64,
}

/// Open the engine on `img` with the mount-wide compression `compress` (the kernel
/// side's `compress=` or `compress-force=`: (ALG[:LEVEL], force)).
fn open_engine(img: &Path, compress: Option<(&str, bool)>) -> Engine {
    let opts = OpenOptions { writable: true, ..OpenOptions::new(img) };
    let e = Engine::open(&opts).unwrap_or_else(|e| panic!("{}: Engine::open: {e}", img.display()));
    if let Some((alg, force)) = compress {
        let p = CompressPolicy::parse(alg, force).unwrap_or_else(|e| panic!("compress {alg}: {e}"));
        e.write(|w| {
            w.set_compress(p);
            Ok(())
        })
        .expect("set the compression");
    }
    e
}

impl Ubtrfs {
    pub fn open(img: &Path, compress: Option<(&'static str, bool)>) -> Ubtrfs {
        let engine = open_engine(img, compress);
        let top = engine.read(|l| Ok(l.root_dir())).expect("root dir");
        Ubtrfs {
            img: img.to_path_buf(),
            engine: Some(engine),
            top,
            compress,
            commits: 0,
            reopens: 0,
        }
    }

    pub fn engine(&self) -> &Engine {
        self.engine.as_ref().expect("the engine is open between operations")
    }

    pub fn commit(&mut self) -> UResult<()> {
        self.engine().commit()?;
        self.commits += 1;
        Ok(())
    }

    /// Commit, drop the engine and open the image again.
    pub fn reopen(&mut self) -> UResult<()> {
        self.commit()?;
        let e = self.engine.take().expect("open");
        let (errors, more) = e.take_close_errors();
        assert!(errors.is_empty() && more == 0, "close errors: {errors:?} and {more} more");
        drop(e);
        self.engine = Some(open_engine(&self.img, self.compress));
        self.reopens += 1;
        Ok(())
    }

    /// Commit and close (the image is then the ubtrfs side's final state).
    pub fn close(mut self) -> UResult<()> {
        self.commit()?;
        drop(self.engine.take());
        Ok(())
    }

    /// A change under the engine's lock: `f` returns the operation's own result.
    fn change<T>(&self, f: impl FnOnce(&mut ubtrfs_core::FsWriter) -> UResult<T>) -> UResult<T> {
        let mut inner = None;
        let r = self.engine().write(|w| {
            inner = Some(f(w));
            Ok(())
        });
        r?;
        inner.expect("write ran the change")
    }

    /// A lookup-only step: `f` may run more than once (`Engine::read`).
    fn look<T>(
        &self,
        mut f: impl FnMut(&ubtrfs_core::transaction::Live<'_>) -> UResult<T>,
    ) -> UResult<T> {
        let r = self.engine().read(|l| Ok(f(l)));
        r?
    }

    pub fn apply(&mut self, op: &Op) -> UResult<Out> {
        if let Op::LinkMany { .. } = op {
            let mut n = 0;
            for l in link_many(op) {
                match self.apply(&l) {
                    Ok(_) => n += 1,
                    Err(Fail::Errno(e)) => {
                        return Ok(Out::Data(many_summary(n, Some(e)).into_bytes()))
                    }
                    Err(b) => return Err(b),
                }
            }
            return Ok(Out::Data(many_summary(n, None).into_bytes()));
        }
        if let Op::UnlinkMany { .. } = op {
            let (mut n, mut first) = (0, None);
            for u in unlink_many(op) {
                match self.apply(&u) {
                    Ok(_) => n += 1,
                    Err(Fail::Errno(e)) => first = first.or(Some(e)),
                    Err(b) => return Err(b),
                }
            }
            return Ok(Out::Data(many_summary(n, first).into_bytes()));
        }
        let top = self.top;
        let root = top.root;
        match op {
            Op::Create { path, mode } => self.change(|w| {
                let dir = walk_parent(&w.live(), top, path)?;
                lookup_len(last(path))?;
                let a = new_attrs(&w.live(), dir, libc::S_IFREG | (mode & 0o7777))?;
                w.create_file(root, dir.ino, last(path), &a)?;
                Ok(Out::Done)
            }),
            Op::Creat { path, mode } => {
                let dir = self.look(|l| {
                    let dir = walk_parent(l, top, path)?;
                    Ok(lookup(l, dir, last(path))?.map(|_| dir))
                })?;
                let Some(dir) = dir else {
                    return self.apply(&Op::Create { path: path.clone(), mode: *mode });
                };
                // An existing name: the last symlink is followed (O_CREAT without O_EXCL).
                let (d, v) = self
                    .look(|l| Ok((l.load_inode(dir, Load::ITEM)?, resolve(l, top, path, true)?)))?;
                if v.kind() == FileKind::Dir {
                    return Err(en(libc::EISDIR));
                }
                may_create_in_sticky(&d, &v)?;
                open_check(&v, true)?;
                // handle_truncate: ATTR_SIZE with ATTR_MTIME | ATTR_CTIME.
                self.engine().setattr(
                    v.id,
                    &SetAttr { size: Some(0), mtime: Some(TimeSet::Now), ..SetAttr::default() },
                )?;
                Ok(Out::Done)
            }
            Op::Mkdir { path, mode } => self.change(|w| {
                let dir = walk_parent(&w.live(), top, path)?;
                lookup_len(last(path))?;
                // vfs_mkdir: S_IRWXUGO | S_ISVTX only.
                let a = new_attrs(&w.live(), dir, libc::S_IFDIR | (mode & 0o1777))?;
                w.mkdir(root, dir.ino, last(path), &a)?;
                Ok(Out::Done)
            }),
            Op::Unlink { path } => {
                let dir = self.look(|l| {
                    let dir = walk_parent(l, top, path)?;
                    lookup_len(last(path))?;
                    Ok(dir)
                })?;
                self.engine().unlink(InodeId { root, ino: dir.ino }, last(path))?;
                Ok(Out::Done)
            }
            Op::Link { old, new } => self.change(|w| {
                let v = resolve(&w.live(), top, old, false)?;
                let dir = walk_parent(&w.live(), top, new)?;
                if v.kind() == FileKind::Dir {
                    // vfs_link: EEXIST (filename_create) before EPERM.
                    return Err(match lookup(&w.live(), dir, last(new))? {
                        Some(_) => en(libc::EEXIST),
                        None => en(libc::EPERM),
                    });
                }
                lookup_len(last(new))?;
                w.link(
                    root,
                    dir.ino,
                    last(new),
                    v.id.ino,
                    ubtrfs_format::structs::ft_from_mode(v.mode()),
                )?;
                Ok(Out::Done)
            }),
            Op::Write { path, off, len, seed } => {
                let v = self.look(|l| resolve(l, top, path, true))?;
                open_check(&v, true)?;
                if *len > 0 {
                    let data = data_of(*seed, *len);
                    // Half through an open file (Engine::write_file: data written
                    // without the engine's lock when it can be), half as one change.
                    if seed % 4 < 2 {
                        let f = self.engine().open_file(v.id)?;
                        f.write_at(*off, &data)?;
                        f.close()?;
                    } else {
                        self.change(|w| Ok(w.write_file(v.id.root, v.id.ino, *off, &data)?))?;
                    }
                }
                Ok(Out::Done)
            }
            Op::Mknod { path, mode, rdev } => self.change(|w| {
                let dir = walk_parent(&w.live(), top, path)?;
                lookup_len(last(path))?;
                let a = dev_attrs(new_attrs(&w.live(), dir, *mode)?, *rdev);
                w.mknod(root, dir.ino, last(path), &a)?;
                Ok(Out::Done)
            }),
            Op::Symlink { target, path } => {
                // getname copies the target in before the walk.
                if target.is_empty() {
                    return Err(en(libc::ENOENT));
                }
                if target.len() >= PATH_MAX {
                    return Err(en(libc::ENAMETOOLONG));
                }
                self.change(|w| {
                    let dir = walk_parent(&w.live(), top, path)?;
                    lookup_len(last(path))?;
                    let a = new_attrs(&w.live(), dir, libc::S_IFLNK | 0o777)?;
                    w.symlink(root, dir.ino, last(path), target, &a)?;
                    Ok(Out::Done)
                })
            }
            Op::Rmdir { path } => {
                let dir = self.look(|l| {
                    let dir = walk_parent(l, top, path)?;
                    lookup_len(last(path))?;
                    Ok(dir)
                })?;
                self.engine().rmdir(InodeId { root, ino: dir.ino }, last(path))?;
                Ok(Out::Done)
            }
            Op::Rename { old, new, flags } => {
                // do_renameat2 checks the flags before the walks.
                let (nr, ex, wo) =
                    (libc::RENAME_NOREPLACE, libc::RENAME_EXCHANGE, libc::RENAME_WHITEOUT);
                if flags & !(nr | ex | wo) != 0 || (flags & (nr | wo) != 0 && flags & ex != 0) {
                    return Err(en(libc::EINVAL));
                }
                let (od, nd) = self.look(|l| {
                    let od = walk_parent(l, top, old)?;
                    let nd = walk_parent(l, top, new)?;
                    // The source is looked up (and must exist) before the target.
                    lookup(l, od, last(old))?.ok_or(en(libc::ENOENT))?;
                    lookup_len(last(new))?;
                    Ok((od, nd))
                })?;
                if flags & wo != 0 {
                    // The whiteout is a new inode in the old directory (inode_init_owner).
                    self.change(|w| {
                        let a = new_attrs(&w.live(), od, libc::S_IFCHR)?;
                        w.rename_with_owner(
                            root,
                            od.ino,
                            last(old),
                            nd.ino,
                            last(new),
                            *flags,
                            (a.uid, a.gid),
                        )?;
                        Ok(Out::Done)
                    })
                } else {
                    self.engine().rename(
                        InodeId { root, ino: od.ino },
                        last(old),
                        InodeId { root, ino: nd.ino },
                        last(new),
                        *flags,
                    )?;
                    Ok(Out::Done)
                }
            }
            Op::Truncate { path, size } => {
                let v = self.look(|l| resolve(l, top, path, true))?;
                // vfs_truncate.
                match v.kind() {
                    FileKind::Dir => return Err(en(libc::EISDIR)),
                    FileKind::File => {}
                    _ => return Err(en(libc::EINVAL)),
                }
                self.engine()
                    .setattr(v.id, &SetAttr { size: Some(*size), ..SetAttr::default() })?;
                Ok(Out::Done)
            }
            Op::Fallocate { path, mode, off, len } => {
                let v = self.look(|l| resolve(l, top, path, true))?;
                open_check(&v, true)?;
                self.change(|w| Ok(w.fallocate(v.id, *mode as u32, *off, *len)?))?;
                Ok(Out::Done)
            }
            Op::Seek { path, off, whence } => {
                let v = self.look(|l| resolve(l, top, path, true))?;
                open_check(&v, false)?;
                let size = v.size();
                let at = match v.kind() {
                    FileKind::Fifo => return Err(en(libc::ESPIPE)),
                    // generic_file_llseek_size over the directory's i_size.
                    FileKind::Dir => (*off < size).then_some(if *whence == libc::SEEK_DATA {
                        *off
                    } else {
                        size
                    }),
                    _ => self.look(|l| Ok(seek_in_file(l, v.id, *off, *whence)?))?,
                };
                at.map(Out::Pos).ok_or(en(libc::ENXIO))
            }
            Op::Chmod { path, mode } => {
                let v = self.look(|l| resolve(l, top, path, true))?;
                self.engine()
                    .setattr(v.id, &SetAttr { mode: Some(mode & 0o7777), ..SetAttr::default() })?;
                Ok(Out::Done)
            }
            Op::Chown { path, uid, gid } => {
                let v = self.look(|l| resolve(l, top, path, false))?;
                self.engine().setattr(v.id, &SetAttr::chown(*uid, *gid))?;
                Ok(Out::Done)
            }
            Op::Utimens { path, atime, mtime } => {
                // utimensat: "nothing to do, we must not even check the path".
                if *atime == TimeArg::Omit && *mtime == TimeArg::Omit {
                    return Ok(Out::Done);
                }
                let v = self.look(|l| resolve(l, top, path, false))?;
                let t = |t: TimeArg| match t {
                    TimeArg::Set(s, n) => Some(TimeSet::At(s, n)),
                    TimeArg::Now => Some(TimeSet::Now),
                    TimeArg::Omit => None,
                };
                self.engine().setattr(
                    v.id,
                    &SetAttr { atime: t(*atime), mtime: t(*mtime), ..SetAttr::default() },
                )?;
                Ok(Out::Done)
            }
            Op::Setxattr { path, name, len, seed, flags } => {
                // setxattr_copy takes the name and the value in before the walk.
                xattr_name_len(name)?;
                if *len > XATTR_SIZE_MAX {
                    return Err(en(libc::E2BIG));
                }
                let v = self.look(|l| resolve(l, top, path, false))?;
                let value = data_of(*seed, *len);
                self.change(|w| {
                    w.setxattr(InodeId { root, ino: v.id.ino }, name, &value, *flags as u32)?;
                    Ok(Out::Done)
                })
            }
            Op::Removexattr { path, name } => {
                xattr_name_len(name)?;
                let v = self.look(|l| resolve(l, top, path, false))?;
                self.change(|w| {
                    w.removexattr(InodeId { root, ino: v.id.ino }, name)?;
                    Ok(Out::Done)
                })
            }
            Op::Getxattr { path, name } => {
                xattr_name_len(name)?;
                self.look(|l| {
                    let v = resolve(l, top, path, false)?;
                    Ok(Out::Data(l.getxattr(v.id, name)?))
                })
            }
            Op::Listxattr { path } => self.look(|l| {
                let v = resolve(l, top, path, false)?;
                let mut names = l.listxattr(v.id)?;
                names.sort();
                Ok(Out::Names(names))
            }),
            Op::Stat { path } => {
                self.look(|l| Ok(Out::Stat(stat_of(&resolve(l, top, path, false)?))))
            }
            Op::Chattr { path, flag, set } => {
                // open(O_NOFOLLOW): a symlink is ELOOP; the open's own checks; a fifo's
                // ioctl is the pipe's (ENOTTY).
                let v = self.look(|l| resolve(l, top, path, false))?;
                if v.kind() == FileKind::Symlink {
                    return Err(en(libc::ELOOP));
                }
                open_check(&v, false)?;
                if v.kind() == FileKind::Fifo {
                    return Err(en(libc::ENOTTY));
                }
                let cur = ubtrfs_core::inode::attr::fsflags_of(v.flags());
                let new = if *set { cur | flag } else { cur & !flag };
                self.change(|w| Ok(w.set_fsflags(v.id, new)?))?;
                Ok(Out::Done)
            }
            Op::Read { path, off, len } => {
                let v = self.look(|l| resolve(l, top, path, true))?;
                open_check(&v, false)?;
                match v.kind() {
                    FileKind::Dir => Err(en(libc::EISDIR)),
                    // pread on a pipe.
                    FileKind::Fifo => Err(en(libc::ESPIPE)),
                    _ => {
                        let f = self.engine().open_file(v.id)?;
                        let mut buf = vec![0u8; *len];
                        let mut done = 0;
                        while done < buf.len() {
                            let n = f.read_at(*off + done as u64, &mut buf[done..])?;
                            if n == 0 {
                                break;
                            }
                            done += n;
                        }
                        f.close()?;
                        buf.truncate(done);
                        Ok(Out::Data(buf))
                    }
                }
            }
            Op::Commit => {
                self.commit()?;
                Ok(Out::Done)
            }
            Op::Reopen => {
                self.reopen()?;
                Ok(Out::Done)
            }
            op => unreachable!("{op}: not available on the ubtrfs side yet (AVAILABLE)"),
        }
    }
}

/// An xattr name as the syscalls copy it in: 1 to 255 bytes, else ERANGE.
fn xattr_name_len(name: &[u8]) -> UResult<()> {
    if name.is_empty() || name.len() > XATTR_NAME_MAX {
        return Err(en(libc::ERANGE));
    }
    Ok(())
}

/// The name-length half of `btrfs_lookup`, for a last name the engine looks up itself.
fn lookup_len(name: &[u8]) -> UResult<()> {
    if name.len() > NAME_MAX {
        return Err(en(libc::ENAMETOOLONG));
    }
    Ok(())
}

/// A `/proc/sys/fs` protection setting (0 when unreadable).
fn sysctl_fs(name: &str) -> u32 {
    std::fs::read_to_string(format!("/proc/sys/fs/{name}"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// `may_create_in_sticky` for root opening an existing `v` with O_CREAT in directory
/// `d`: in a sticky directory, a file owned neither by the directory's owner nor by
/// the caller is refused (regular files and fifos only as the protected_regular and
/// protected_fifos sysctls say; every other type always).
fn may_create_in_sticky(d: &InodeView, v: &InodeView) -> UResult<()> {
    let dmode = d.mode();
    if dmode & libc::S_ISVTX == 0 {
        return Ok(());
    }
    let (reg, fifo) = (v.kind() == FileKind::File, v.kind() == FileKind::Fifo);
    let (pregular, pfifos) = (sysctl_fs("protected_regular"), sysctl_fs("protected_fifos"));
    if (reg && pregular == 0) || (fifo && pfifos == 0) {
        return Ok(());
    }
    let uid = v.item.uid.get();
    if uid == d.item.uid.get() || uid == 0 {
        return Ok(());
    }
    if dmode & 0o002 != 0
        || (dmode & 0o020 != 0 && ((fifo && pfifos >= 2) || (reg && pregular >= 2)))
    {
        return Err(en(libc::EACCES));
    }
    Ok(())
}

/// `may_open` and the open of special files, on the `nodev` mount, with O_NONBLOCK
/// and without O_APPEND: the type first, then MAY_WRITE's EPERM for an immutable inode
/// and may_open's for an append-only one, then (in the fifo's own open) a writer
/// without a reader.
fn open_check(v: &InodeView, write: bool) -> UResult<()> {
    match v.kind() {
        FileKind::Dir if write => return Err(en(libc::EISDIR)),
        FileKind::CharDev | FileKind::BlockDev => return Err(en(libc::EACCES)),
        FileKind::Socket => return Err(en(libc::ENXIO)),
        _ => {}
    }
    use ubtrfs_format::structs::{INODE_APPEND, INODE_IMMUTABLE};
    if write && v.flags() & (INODE_IMMUTABLE | INODE_APPEND) != 0 {
        return Err(en(libc::EPERM));
    }
    match v.kind() {
        // A fifo opened to write with no reader.
        FileKind::Fifo if write => Err(en(libc::ENXIO)),
        _ => Ok(()),
    }
}

/// Per path: the walk's record, the xattrs (name -> "len:sha256 prefix") and the times
/// that are still explicit.
#[derive(Clone, PartialEq, Eq)]
pub struct XRec {
    pub rec: Rec,
    pub xattrs: BTreeMap<Vec<u8>, String>,
    pub atime: Option<(i64, u32)>,
    pub mtime: Option<(i64, u32)>,
    /// A directory's names in readdir order (DIR_INDEX order on both sides).
    pub order: Vec<Vec<u8>>,
    /// A regular file's data runs as SEEK_DATA / SEEK_HOLE find them from 0: where the
    /// layouts of data, holes and preallocation must agree (the contents alone do not
    /// tell a hole from written zeros).
    pub runs: Vec<(u64, u64)>,
}

/// The data runs [data, hole) of a file of `size` bytes, found by SEEK_DATA and
/// SEEK_HOLE (`seek(offset, whence)`, None for ENXIO) from 0 to EOF.
fn seek_runs<E>(
    size: u64,
    mut seek: impl FnMut(u64, i32) -> Result<Option<u64>, E>,
) -> Result<Vec<(u64, u64)>, E> {
    let mut runs = Vec::new();
    let mut pos = 0;
    while pos < size {
        let Some(d) = seek(pos, libc::SEEK_DATA)? else { break };
        let h = seek(d, libc::SEEK_HOLE)?.unwrap_or(size);
        assert!(d >= pos && h > d, "seek runs: SEEK_DATA {pos} -> {d}, SEEK_HOLE {d} -> {h}");
        runs.push((d, h));
        pos = h;
    }
    Ok(runs)
}

impl std::fmt::Debug for XRec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = &self.rec;
        write!(
            f,
            "{} {:04o} {}:{} size={} nlink={} content={:?}",
            r.kind,
            r.perm,
            r.uid,
            r.gid,
            r.size,
            r.nlink,
            if r.kind == 'l' {
                show_name(r.content.as_bytes())
            } else {
                r.content.chars().take(16).collect()
            }
        )?;
        if !self.xattrs.is_empty() {
            write!(
                f,
                " xattrs={:?}",
                self.xattrs
                    .iter()
                    .map(|(n, v)| format!("{}={v}", show_name(n)))
                    .collect::<Vec<_>>()
            )?;
        }
        if self.atime.is_some() || self.mtime.is_some() {
            write!(f, " atime={:?} mtime={:?}", self.atime, self.mtime)?;
        }
        if !self.order.is_empty() {
            write!(f, " order={:?}", self.order.iter().map(|n| show_name(n)).collect::<Vec<_>>())?;
        }
        if !self.runs.is_empty() {
            write!(f, " data={:?}", self.runs)?;
        }
        Ok(())
    }
}

pub type XTree = BTreeMap<String, XRec>;

fn value_digest(v: &[u8]) -> String {
    format!("{}:{}", v.len(), &hex(&Sha256::digest(v))[..16])
}

/// `walk_kernel` with xattrs and explicit times, from the mount at `root`.
pub fn xwalk_kernel(root: &Path) -> XTree {
    let mut out = XTree::new();
    // A file's contents hashed once however many names it has (LinkMany).
    let mut hashed: std::collections::HashMap<u64, String> = std::collections::HashMap::new();
    let mut stack = vec![(String::new(), root.to_path_buf())];
    while let Some((path, full)) = stack.pop() {
        let c = cstr(full.as_os_str().as_bytes());
        // SAFETY: as in `Kernel::apply`.
        let (xattrs, st) = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            assert!(
                libc::lstat(c.as_ptr(), &mut st) == 0,
                "lstat {}: {}",
                full.display(),
                std::io::Error::last_os_error()
            );
            let mut buf = vec![0u8; XATTR_SIZE_MAX];
            let n = libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len());
            assert!(n >= 0, "llistxattr {}: {}", full.display(), std::io::Error::last_os_error());
            buf.truncate(n as usize);
            let mut x = BTreeMap::new();
            for name in buf.split(|&b| b == 0).filter(|n| !n.is_empty()) {
                let mut v = vec![0u8; XATTR_SIZE_MAX];
                let m = libc::lgetxattr(
                    c.as_ptr(),
                    cstr(name).as_ptr(),
                    v.as_mut_ptr().cast(),
                    v.len(),
                );
                assert!(
                    m >= 0,
                    "lgetxattr {} {}: {}",
                    full.display(),
                    show_name(name),
                    std::io::Error::last_os_error()
                );
                v.truncate(m as usize);
                x.insert(name.to_vec(), value_digest(&v));
            }
            (x, st)
        };
        let s = stat_rec(&st);
        let content = match s.kind {
            'f' => hashed
                .entry(st.st_ino)
                .or_insert_with(|| {
                    let mut h = Sha256::new();
                    let mut f = std::fs::File::open(&full)
                        .unwrap_or_else(|e| panic!("kernel walk: open {}: {e}", full.display()));
                    std::io::copy(&mut f, &mut h)
                        .unwrap_or_else(|e| panic!("kernel walk: read {}: {e}", full.display()));
                    hex(&h.finalize())
                })
                .clone(),
            'l' => String::from_utf8_lossy(
                std::fs::read_link(&full).expect("readlink").as_os_str().as_bytes(),
            )
            .into_owned(),
            'c' | 'b' => format!("{}:{}", s.rdev.0, s.rdev.1),
            _ => String::new(),
        };
        let mut order = Vec::new();
        if s.kind == 'd' {
            order = std::fs::read_dir(&full)
                .unwrap_or_else(|e| panic!("readdir {}: {e}", full.display()))
                .map(|e| e.expect("dir entry").file_name().as_bytes().to_vec())
                .collect();
            for n in &order {
                let child = if path.is_empty() {
                    String::from_utf8_lossy(n).into_owned()
                } else {
                    format!("{path}/{}", String::from_utf8_lossy(n))
                };
                stack.push((child, full.join(std::ffi::OsStr::from_bytes(n))));
            }
        }
        let runs = if s.kind == 'f' {
            let f = std::fs::File::open(&full)
                .unwrap_or_else(|e| panic!("kernel walk: open {}: {e}", full.display()));
            seek_runs(s.size, |off, whence| {
                use std::os::unix::io::AsRawFd;
                // SAFETY: lseek on an open descriptor.
                let r = unsafe { libc::lseek(f.as_raw_fd(), off as libc::off_t, whence) };
                if r >= 0 {
                    Ok(Some(r as u64))
                } else if errno() == libc::ENXIO {
                    Ok(None)
                } else {
                    Err(std::io::Error::last_os_error())
                }
            })
            .unwrap_or_else(|e| panic!("kernel walk: lseek {}: {e}", full.display()))
        } else {
            Vec::new()
        };
        let rec = Rec {
            kind: s.kind,
            perm: s.perm,
            uid: s.uid,
            gid: s.gid,
            size: s.size,
            nlink: s.nlink,
            content,
        };
        out.insert(path, XRec { rec, xattrs, atime: s.atime, mtime: s.mtime, order, runs });
    }
    out
}

/// `xwalk_kernel`, checked against `walk_kernel` (the write tests' walk) once.
pub fn xwalk_kernel_checked(root: &Path) -> XTree {
    let x = xwalk_kernel(root);
    let recs: BTreeMap<String, Rec> = x.iter().map(|(p, r)| (p.clone(), r.rec.clone())).collect();
    assert!(
        recs == walk_kernel(root),
        "xwalk_kernel and walk_kernel disagree on {}",
        root.display()
    );
    x
}

/// The namespace as a ubtrfs view (`Live` or a `Filesystem`) shows it, like
/// `walk_ubtrfs` with xattrs and explicit times. Errors propagate (a live reader's run
/// stops at a block missing from the cache and runs again).
pub fn xwalk_fs<V: FileRead>(fs: &V) -> ubtrfs_core::Result<XTree> {
    let mut out = XTree::new();
    let mut hashed: std::collections::HashMap<InodeId, String> = std::collections::HashMap::new();
    let mut stack = vec![(String::new(), fs.root_dir())];
    while let Some((path, id)) = stack.pop() {
        let v = fs.load_inode(id, Load::ALL)?;
        let kind = file_kind_char(v.kind());
        let content = match v.kind() {
            FileKind::File if hashed.contains_key(&id) => hashed[&id].clone(),
            FileKind::File => {
                let mut h = Sha256::new();
                let mut buf = vec![0u8; 1 << 20];
                let mut pos = 0u64;
                loop {
                    let n = fs.read_at(&v, pos, &mut buf)?;
                    if n == 0 {
                        break;
                    }
                    h.update(&buf[..n]);
                    pos += n as u64;
                }
                assert_eq!(pos, v.size(), "ubtrfs walk: /{path}: read length");
                let d = hex(&h.finalize());
                hashed.insert(id, d.clone());
                d
            }
            FileKind::Symlink => String::from_utf8_lossy(&fs.readlink(id)?).into_owned(),
            FileKind::CharDev | FileKind::BlockDev => {
                let (ma, mi) = rdev_decode(v.item.rdev.get());
                format!("{ma}:{mi}")
            }
            _ => String::new(),
        };
        let s = stat_of(&v);
        let rec = Rec {
            kind,
            perm: s.perm,
            uid: s.uid,
            gid: s.gid,
            size: s.size,
            nlink: s.nlink,
            content,
        };
        let xattrs = v.xattrs.iter().map(|(n, val)| (n.clone(), value_digest(val))).collect();
        if v.kind() == FileKind::Dir {
            for e in &v.entries {
                let child = if path.is_empty() {
                    String::from_utf8_lossy(&e.name).into_owned()
                } else {
                    format!("{path}/{}", String::from_utf8_lossy(&e.name))
                };
                stack.push((child, e.target));
            }
        }
        let order = v.entries.iter().map(|e| e.name.clone()).collect();
        let runs = if v.kind() == FileKind::File {
            seek_runs(v.size(), |off, whence| seek_in_file(fs, id, off, whence))?
        } else {
            Vec::new()
        };
        out.insert(path, XRec { rec, xattrs, atime: s.atime, mtime: s.mtime, order, runs });
    }
    Ok(out)
}

/// `xwalk_fs` of a closed image, and a check that its records are `walk_ubtrfs`'s.
pub fn xwalk_image(img: &Path) -> XTree {
    let fs = ubtrfs_core::inode::filesystem::Filesystem::open(&OpenOptions::new(img))
        .unwrap_or_else(|e| panic!("{}: open: {e}", img.display()));
    let x = xwalk_fs(&fs).unwrap_or_else(|e| panic!("{}: walk: {e}", img.display()));
    drop(fs);
    let base = walk_ubtrfs(img);
    let recs: BTreeMap<String, Rec> = x.iter().map(|(p, r)| (p.clone(), r.rec.clone())).collect();
    assert!(recs == base, "xwalk_fs and walk_ubtrfs disagree on {}", img.display());
    x
}

/// Differences between two extended walks, at most `max` lines.
pub fn diff_xtrees(expected: &XTree, actual: &XTree, max: usize) -> Vec<String> {
    let mut d = Vec::new();
    for (p, e) in expected {
        match actual.get(p) {
            None => d.push(format!("missing /{p}: expected {e:?}")),
            Some(a) if a != e => d.push(format!(
                "differs /{}:\n    expected {e:?}\n    actual   {a:?}",
                short_path(p)
            )),
            _ => {}
        }
    }
    for (p, a) in actual {
        if !expected.contains_key(p) {
            d.push(format!("unexpected /{}: {a:?}", short_path(p)));
        }
    }
    let n = d.len();
    d.truncate(max);
    if n > max {
        d.push(format!("... and {} more", n - max));
    }
    d
}

fn short_path(p: &str) -> String {
    p.split('/').map(|c| show_name(c.as_bytes())).collect::<Vec<_>>().join("/")
}

/// A disagreement between the kernel and ubtrfs already reported, kept out of the runs:
/// an operation it matches is not applied to either side (and counted).
#[derive(Clone, Copy)]
pub struct Known {
    pub name: &'static str,
    pub matches: fn(&Op, &Kernel) -> bool,
}

/// Disagreements with the kernel found, reported, and kept out of the runs until
/// fixed, for the engine's test (posix_diff.rs) and the mount's (mount_diff.rs) alike.
/// The seeds and operation numbers quoted are those of the commit that added the
/// entry: the generator's stream changes whenever the available kinds or `WEIGHTS` do.
pub const KNOWN: &[Known] = &[
    // Replacing an xattr with a larger value: the kernel's do_setxattr replaces in place
    // and needs the growth free in the item's leaf (ENOSPC otherwise), which depends on
    // the kernel's leaf layout; the engine has room whenever the item fits a leaf.
    // Skipped when the value grows to more than 1 KiB or by more than 512 bytes (a large
    // value's leaf has little room left).
    Known {
        name: "xattr-replace-growth-needs-leaf-room (kernel: ENOSPC when the value grows past its leaf's free space)",
        matches: |op, k| match op {
            Op::Setxattr { path, name, len, .. } => k.xattr_len(path, name).is_some_and(|old| *len > old && (*len > 1024 || *len > old + 512)),
            _ => false,
        },
    },
    // fallocate(PUNCH_HOLE) of a range with no extent in it: btrfs_punch_hole asks
    // find_first_non_hole for the extent map at the range's first block, and that is
    // whatever the inode's extent map cache holds (btrfs_get_extent looks there first).
    // A hole map made earlier (btrfs_cont_expand makes one over the whole gap of a write
    // past EOF, a read merges the per-page ones) covers the range, and the kernel
    // returns early ("already in a large hole"): no times, no block written. A fresh
    // lookup covers only the range's first block rounded to the length, and the kernel
    // goes on: times move, and a last block that starts in the hole is zeroed and
    // written (it becomes data). The engine has no extent map cache (the inode's
    // `mapping` is to come) and does what a freshly mounted kernel does. Seed 20 op
    // 1496 (the times), seeds 1000, 1079, 1151, 1288 (SEEK_DATA finds the zeroed
    // block); seed 2040 op 4928 the other way (a punch of [0, 8192) in a 139-byte file
    // with no extent: a fresh lookup covers the range, but the kernel had a cached hole
    // map of block 0 only, from a read, went on and moved the times). Skipped when
    // FIEMAP shows nothing in the range from its first block on.
    Known {
        name: "punch-hole-in-a-hole-depends-on-the-extent-map-cache (kernel: a cached hole map decides between an early return and a zeroed block with new times)",
        matches: |op, k| match op {
            Op::Fallocate { path, mode, off, len } if mode & libc::FALLOC_FL_PUNCH_HOLE != 0 => {
                k.lstat(path).is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFREG) && !k.has_extent_in(path, off / 4096 * 4096, off.saturating_add(*len))
            }
            _ => false,
        },
    },
    // A kernel bug, not ubtrfs's: on a filesystem without extref, RENAME_EXCHANGE that
    // gives an inode a name in a directory where its INODE_REF item is full aborts the
    // kernel's transaction (btrfs_rename_exchange, "Transaction aborted (error -31)",
    // the mount turns read-only) instead of failing with EMLINK first. Found by seed
    // 3227 op 5370 (rename a/L{255} e RENAME_EXCHANGE, after 100 links with 255-byte
    // names in a). Skipped when either inode has more than 16 links there.
    Known {
        name: "kernel-rename-exchange-aborts-without-extref (kernel bug: transaction abort -EMLINK, then EROFS)",
        matches: |op, k| match op {
            Op::Rename { old, new, flags } if flags & libc::RENAME_EXCHANGE != 0 && k.mkfs.contains(&"^extref") => [old, new].iter().any(|p| k.lstat(p).is_some_and(|st| st.st_nlink > 16)),
            _ => false,
        },
    },
];

/// What a run did.
#[derive(Default, Debug)]
pub struct Stats {
    pub ops: u64,
    pub failed: u64,
    pub skipped: BTreeMap<&'static str, u64>,
    pub kernel: Duration,
    pub ubtrfs: Duration,
    pub checks: u64,
    pub commits: u64,
    pub reopens: u64,
    pub by_errno: BTreeMap<(OpKind, Errno), u64>,
    pub ok: BTreeMap<OpKind, u64>,
}

impl Stats {
    pub fn add(&mut self, o: &Stats) {
        self.ops += o.ops;
        self.failed += o.failed;
        for (k, v) in &o.skipped {
            *self.skipped.entry(k).or_default() += v;
        }
        self.kernel += o.kernel;
        self.ubtrfs += o.ubtrfs;
        self.checks += o.checks;
        self.commits += o.commits;
        self.reopens += o.reopens;
        for (k, v) in &o.by_errno {
            *self.by_errno.entry(*k).or_default() += v;
        }
        for (k, v) in &o.ok {
            *self.ok.entry(*k).or_default() += v;
        }
    }
}

/// One seed's run.
pub struct Run<'a> {
    pub seed: u64,
    pub ops: u64,
    /// Compare the whole trees (kernel mount against the engine's live view) this often.
    pub check_every: u64,
    pub avail: &'a [OpKind],
    pub known: &'a [Known],
    /// Log a mismatch and go on instead of failing (the trees are then compared anyway).
    pub keep_going: bool,
    /// Where the images go.
    pub dir: PathBuf,
}

/// The errno's symbolic name (the ones the tests meet), else its number.
pub fn errno_name(e: Errno) -> String {
    let names = [
        (libc::EPERM, "EPERM"),
        (libc::ENOENT, "ENOENT"),
        (libc::ENXIO, "ENXIO"),
        (libc::E2BIG, "E2BIG"),
        (libc::EACCES, "EACCES"),
        (libc::EBUSY, "EBUSY"),
        (libc::EEXIST, "EEXIST"),
        (libc::EXDEV, "EXDEV"),
        (libc::ENOTDIR, "ENOTDIR"),
        (libc::EISDIR, "EISDIR"),
        (libc::EINVAL, "EINVAL"),
        (libc::EFBIG, "EFBIG"),
        (libc::ENOSPC, "ENOSPC"),
        (libc::ESPIPE, "ESPIPE"),
        (libc::EROFS, "EROFS"),
        (libc::EMLINK, "EMLINK"),
        (libc::ERANGE, "ERANGE"),
        (libc::ENAMETOOLONG, "ENAMETOOLONG"),
        (libc::ENOTEMPTY, "ENOTEMPTY"),
        (libc::ELOOP, "ELOOP"),
        (libc::ENODATA, "ENODATA"),
        (libc::EOPNOTSUPP, "EOPNOTSUPP"),
    ];
    names
        .iter()
        .find(|(n, _)| *n == e)
        .map(|(_, s)| s.to_string())
        .unwrap_or_else(|| format!("errno {e}"))
}

/// The image a seed starts from: mkfs's defaults for five seeds in eight, else one of
/// the variants that move the engine's limits (4 KiB nodes: shorter symlinks, smaller
/// xattrs and INODE_REF items; no extref: EMLINK once the INODE_REF item is full; no
/// no-holes: hole extents written).
pub fn mkfs_args(seed: u64) -> &'static [&'static str] {
    match seed % 8 {
        1 => &["-n", "4096"],
        3 => &["-O", "^extref"],
        5 => &["-O", "^no-holes"],
        _ => &[],
    }
}

/// The mount-wide compression of a seed (on both sides, for three seeds in eight):
/// (ALG[:LEVEL], compress-force).
pub fn compress_of(seed: u64) -> Option<(&'static str, bool)> {
    match seed % 8 {
        2 => Some(("zstd", false)),
        6 => Some(("zlib:3", true)),
        7 => Some(("lzo", false)),
        _ => None,
    }
}

/// The kernel side's mount options for a seed.
pub fn mount_opts(seed: u64) -> String {
    let mut o = "loop,nodev,noatime".to_string();
    if let Some((alg, force)) = compress_of(seed) {
        o.push_str(&format!(",{}={alg}", if force { "compress-force" } else { "compress" }));
    }
    o
}

/// A disagreement, with everything needed to replay it.
pub fn mismatch(seed: u64, i: u64, op: &Op, k: &Outcome, u: &Outcome) -> String {
    let name = |r: &Outcome| match r {
        Ok(o) => format!("{o:?}"),
        Err(e) => errno_name(*e),
    };
    let said = if u.is_err() {
        LAST_ERROR.with(|l| format!(" (the engine said: {})", l.borrow()))
    } else {
        String::new()
    };
    format!(
        "seed {seed} (mkfs {:?}, mount {}) op {i}: {op}\n    kernel: {}\n    ubtrfs: {}{said}",
        mkfs_args(seed),
        mount_opts(seed),
        name(k),
        name(u)
    )
}

impl Run<'_> {
    /// Run the seed; Err with the first disagreement (or all, with `keep_going`).
    pub fn run(&self) -> Result<Stats, String> {
        let tag = format!(
            "posixdiff-{}-{}-{:?}",
            self.seed,
            std::process::id(),
            std::thread::current().id()
        )
        .replace(['(', ')'], "");
        let a = self.dir.join(format!("{tag}-kernel.img"));
        let b = self.dir.join(format!("{tag}-ubtrfs.img"));
        let _cleanup = Cleanup(vec![a.clone(), b.clone()]);
        std::fs::File::create(&a).and_then(|f| f.set_len(256 << 20)).expect("create image");
        let out = Command::new("mkfs.btrfs")
            .args(["-q", "-f"])
            .args(mkfs_args(self.seed))
            .arg(&a)
            .output()
            .expect("run mkfs.btrfs");
        assert!(out.status.success(), "mkfs.btrfs: {}", String::from_utf8_lossy(&out.stderr));
        let ok = Command::new("cp")
            .arg("--sparse=always")
            .arg(&a)
            .arg(&b)
            .status()
            .expect("cp")
            .success();
        assert!(ok, "cp image");

        let mnt = Mount::new_with(&a, &mount_opts(self.seed));
        let k = Kernel {
            dir: mnt.dir.clone(),
            mkfs: mkfs_args(self.seed),
            compress: compress_of(self.seed).is_some(),
        };
        let mut u = Ubtrfs::open(&b, compress_of(self.seed));
        let mut st = Stats::default();
        let mut errors = Vec::new();
        let mut g = Gen::new(self.seed, self.avail);
        for i in 0..self.ops {
            let op = g.next_op();
            if let Some(kn) = self.known.iter().find(|kn| (kn.matches)(&op, &k)) {
                *st.skipped.entry(kn.name).or_default() += 1;
                continue;
            }
            let t0 = Instant::now();
            let kr = k.apply(&op);
            let t1 = Instant::now();
            let ur = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| u.apply(&op))) {
                Ok(r) => r,
                Err(p) => {
                    let m = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    return Err(format!("seed {} (mkfs {:?}) op {i}: {op}\n    kernel: {kr:?}\n    ubtrfs panicked: {m}", self.seed, mkfs_args(self.seed)));
                }
            };
            st.ubtrfs += t1.elapsed();
            st.kernel += t1 - t0;
            st.ops += 1;
            let ur = match ur {
                Ok(o) => Ok(o),
                Err(Fail::Errno(e)) => Err(e),
                Err(Fail::Bug(b)) => return Err(format!("seed {} op {i}: {op}\n    kernel: {kr:?}\n    ubtrfs failed with a non-POSIX error: {b}", self.seed)),
            };
            if std::env::var_os("UBTRFS_POSIX_TRACE").is_some() {
                eprintln!("seed {} op {i}: {op} -> {kr:?}", self.seed);
            }
            if kr.is_ok() {
                *st.ok.entry(op.kind()).or_default() += 1;
            }
            if let Err(e) = kr {
                st.failed += 1;
                *st.by_errno.entry((op.kind(), e)).or_default() += 1;
            }
            if kr != ur {
                let m = mismatch(self.seed, i, &op, &kr, &ur);
                if !self.keep_going {
                    return Err(m);
                }
                eprintln!("{m}");
                errors.push(m);
            }
            if self.check_every > 0 && (i + 1) % self.check_every == 0 {
                st.checks += 1;
                let kt = xwalk_kernel(&k.dir);
                let ut = u
                    .engine()
                    .read(|l| xwalk_fs(l))
                    .map_err(|e| format!("seed {} after op {i}: live walk: {e}", self.seed))?;
                let d = diff_xtrees(&kt, &ut, 20);
                if !d.is_empty() {
                    let m = format!(
                        "seed {} after op {i} ({op}; last check after op {}): the trees differ (kernel expected, ubtrfs live actual):\n{}",
                        self.seed,
                        (i + 1).saturating_sub(self.check_every + 1),
                        d.join("\n")
                    );
                    if !self.keep_going {
                        return Err(m);
                    }
                    errors.push(m);
                }
            }
        }
        st.commits = u.commits;
        st.reopens = u.reopens;
        // The end: the ubtrfs image, committed and closed, against the kernel's tree;
        // then btrfs check, and the kernel's own view of the ubtrfs image.
        u.close().map_err(|e| format!("seed {}: final commit: {e:?}", self.seed))?;
        let kt = xwalk_kernel_checked(&k.dir);
        mnt.umount();
        let ut = xwalk_image(&b);
        let d = diff_xtrees(&kt, &ut, 20);
        if !d.is_empty() {
            errors.push(format!(
                "seed {}: the final trees differ (kernel expected, ubtrfs image actual):\n{}",
                self.seed,
                d.join("\n")
            ));
        }
        if let Err(t) = crate::write_common::btrfs_check(&b) {
            errors.push(format!("seed {}: btrfs check of the ubtrfs image:\n{t}", self.seed));
        }
        let m2 = Mount::new_with(&b, "loop,ro");
        let kt2 = xwalk_kernel(&m2.dir);
        m2.umount();
        let d = diff_xtrees(&kt, &kt2, 20);
        if !d.is_empty() {
            errors.push(format!("seed {}: the kernel's view of the ubtrfs image differs from the kernel's tree:\n{}", self.seed, d.join("\n")));
        }
        if errors.is_empty() {
            Ok(st)
        } else {
            Err(errors.join("\n"))
        }
    }
}

struct Cleanup(Vec<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        if crate::write_common::keep() {
            for p in &self.0 {
                eprintln!("kept {}", p.display());
            }
        } else {
            for p in &self.0 {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// An InodeAttrs with an encoded rdev, for mknod.
pub fn dev_attrs(mut a: InodeAttrs, rdev: (u32, u32)) -> InodeAttrs {
    a.rdev = rdev_encode(rdev.0, rdev.1);
    a
}
