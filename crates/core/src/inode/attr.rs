//! Inode attributes: chmod, chown, utimens and truncate in one call (`setattr`, the
//! kernel's `notify_change` + `btrfs_setattr`), and the size change itself
//! (`btrfs_setsize`: `btrfs_cont_expand` up, `btrfs_truncate` down).
//!
//! Time rules, as the VFS keeps them: every change sets ctime to now; a new size sets
//! mtime to now unless the call gives mtime (the same size alone changes nothing); atime and mtime are set as asked,
//! to a time or to now.
//!
//! A chown, with ids or without (chown(path, -1, -1)), is `chown_common`'s
//! ATTR_CTIME | ATTR_KILL_SUID | ATTR_KILL_SGID | ATTR_KILL_PRIV: ctime moves, and
//! anything but a directory loses set-user-ID, set-group-ID when the group may
//! execute (`setattr_should_drop_sgid` for a caller who may keep it: the checks of who
//! may do what are `perm`'s), and its file capabilities (`cap_inode_killpriv`). The
//! immutable and append-only flags refuse a chown with ids but not one without (the
//! VFS checks the flags before the kill bits become a mode).
//!
//! Truncation keeps the file's data exact for a later extension: the block holding the
//! new end (down) or the old end (up) is rewritten with its bytes past the end zeroed,
//! as `btrfs_truncate_block` does, so no old byte reappears when the file grows again;
//! extents past the end go, the one across it is trimmed (compressed and shared ones
//! keep their disk extent and lose part of their reference). Without no-holes, growth
//! writes a hole extent over the new range.

use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{ExtentKind, FsRead, InodeId, Load};
use crate::inode::write::{iflags_allow, IflagOp};
use crate::inode::writer::FsWriter;
use ubtrfs_format::structs::*;

/// The largest file size (MAX_LFS_FILESIZE, the kernel's `s_maxbytes` for btrfs).
pub const MAX_FILE_SIZE: u64 = i64::MAX as u64;

/// A time to set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeSet {
    /// The engine's clock now (UTIME_NOW).
    Now,
    /// (seconds, nanoseconds).
    At(i64, u32),
}

/// What `setattr` changes; None leaves a field alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SetAttr {
    /// Permission bits (0o7777); the file type stays.
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// New size (regular files only).
    pub size: Option<u64>,
    pub atime: Option<TimeSet>,
    pub mtime: Option<TimeSet>,
    /// An explicit ctime (FUSE may send one); otherwise ctime becomes now.
    pub ctime: Option<(i64, u32)>,
    /// The call is a chown, also one without ids (chown(path, -1, -1), which FUSE sends
    /// as a SETATTR without FATTR_UID or FATTR_GID), or asks what FUSE's
    /// FATTR_KILL_SUIDGID asks: a non-directory loses set-user-ID, set-group-ID when the
    /// group may execute, and `security.capability` (see the module notes), after the
    /// new mode if there is one. `uid` or `gid` imply it.
    pub kill_privs: bool,
}

impl SetAttr {
    /// chown(2), lchown(2) or fchown(2) to `uid` and `gid`, None for -1 (that id
    /// stays): with or without ids, ctime moves and a non-directory loses its
    /// privileges (`kill_privs`).
    pub fn chown(uid: Option<u32>, gid: Option<u32>) -> SetAttr {
        SetAttr { uid, gid, kill_privs: true, ..SetAttr::default() }
    }

    /// Whether the call takes a non-directory's privileges (`kill_privs`, or an id).
    pub fn kills_privs(&self) -> bool {
        self.kill_privs || self.uid.is_some() || self.gid.is_some()
    }

    /// Whether the call changes anything the immutable and append-only flags protect
    /// (`notify_change`: mode, owner, or times given to utimensat, ATTR_TIMES_SET).
    /// `vfs_utimes` turns a call whose two times are both UTIME_NOW into a plain touch
    /// (ATTR_TOUCH, which only immutability refuses); any other set of times, "now"
    /// ones included (UTIME_OMIT for one of them), is ATTR_TIMES_SET.
    fn touches_protected(&self) -> bool {
        let touch = matches!((self.atime, self.mtime), (Some(TimeSet::Now), Some(TimeSet::Now)));
        let times_set =
            (self.atime.is_some() || self.mtime.is_some()) && !touch && self.size.is_none();
        self.mode.is_some()
            || self.uid.is_some()
            || self.gid.is_some()
            || matches!(self.atime, Some(TimeSet::At(..)))
            || matches!(self.mtime, Some(TimeSet::At(..)))
            || times_set
    }
}

fn ts(sec: i64, nsec: u32) -> Timespec {
    Timespec { sec: (sec as u64).into(), nsec: nsec.into() }
}

fn id_of(root: u64, ino: u64) -> String {
    format!("root={root} ino={ino}")
}

impl FsWriter {
    /// Change inode `ino`'s attributes as `chmod`, `chown`, `utimensat` and
    /// `truncate` do (see the module documentation for the time rules and what a
    /// chown takes). Permission checks are the caller's (`perm::may_setattr`).
    ///
    /// # Errors
    /// `Posix`: NotPermitted for an immutable or append-only inode (mode, ids,
    /// explicit times, size), IsDir / Invalid for the size of a directory / other
    /// non-regular file, FileTooBig past `MAX_FILE_SIZE`, NoSpace; tree failures.
    pub fn setattr(&mut self, root: u64, ino: u64, a: &SetAttr) -> Result<()> {
        self.check_root_writable(root)?;
        // A placeholder's attributes are the kernel's in-memory inode's: its
        // `simple_setattr` succeeds and stores nothing. So do we.
        if (InodeId { root, ino }).is_placeholder() {
            return if a.size.is_some() {
                Err(Error::posix_detail(
                    PosixKind::IsDir,
                    id_of(root, ino),
                    "a directory has no size to set",
                ))
            } else {
                Ok(())
            };
        }
        let ii = self.live().load_inode(InodeId { root, ino }, Load::ITEM)?.item;
        let flags = ii.flags.get();
        if a.touches_protected() && flags & (INODE_IMMUTABLE | INODE_APPEND) != 0 {
            return Err(Error::posix_detail(
                PosixKind::NotPermitted,
                id_of(root, ino),
                "the inode is immutable or append-only",
            ));
        }
        if (a.atime.is_some() || a.mtime.is_some()) && flags & INODE_IMMUTABLE != 0 {
            return Err(Error::posix_detail(
                PosixKind::NotPermitted,
                id_of(root, ino),
                "the inode is immutable",
            ));
        }
        if let Some(size) = a.size {
            match ii.mode.get() & S_IFMT {
                S_IFREG => {}
                S_IFDIR => {
                    return Err(Error::posix_detail(
                        PosixKind::IsDir,
                        id_of(root, ino),
                        "a directory has no size to set",
                    ))
                }
                _ => {
                    return Err(Error::posix_detail(
                        PosixKind::Invalid,
                        id_of(root, ino),
                        "only a regular file's size can be set",
                    ))
                }
            }
            // vfs_truncate refuses these before the size is looked at.
            iflags_allow(root, ino, flags, IflagOp::Write, b"")?;
            if flags & INODE_APPEND != 0 {
                return Err(Error::posix_detail(
                    PosixKind::NotPermitted,
                    id_of(root, ino),
                    "an append-only file cannot be truncated",
                ));
            }
            if size > MAX_FILE_SIZE {
                return Err(Error::posix_detail(
                    PosixKind::FileTooBig,
                    id_of(root, ino),
                    format!("{size} is past the largest file size {MAX_FILE_SIZE}"),
                ));
            }
        }
        // truncate(2) to the size the file has: nothing changes, not even the times
        // (btrfs_setsize updates them only for a new size).
        if a.size == Some(ii.size.get()) && (SetAttr { size: None, ..*a }) == SetAttr::default() {
            return Ok(());
        }
        let is_dir = ii.mode.get() & S_IFMT == S_IFDIR;
        let kill = a.kills_privs() && !is_dir;
        if kill {
            // setattr_prepare's ATTR_KILL_PRIV, before the size changes.
            self.kill_file_caps(InodeId { root, ino })?;
        }
        let ss = u64::from(self.sectorsize());
        // Truncation rewrites one block and drops extents; growth may insert a hole.
        let items = if a.size.is_some() { 6 + u64::from(self.nodesize()) / ss } else { 1 };
        self.transaction("setattr", items, |w| {
            if let Some(size) = a.size {
                if size != ii.size.get() {
                    w.set_size_inner(root, ino, size)?;
                }
            }
            let now = w.now();
            let pick = |t: Option<TimeSet>| {
                t.map(|t| if let TimeSet::At(s, n) = t { ts(s, n) } else { now })
            };
            let (atime, mut mtime) = (pick(a.atime), pick(a.mtime));
            if a.size.is_some_and(|s| s != ii.size.get()) && mtime.is_none() {
                mtime = Some(now);
            }
            let ctime = a.ctime.map_or(now, |(s, n)| ts(s, n));
            w.update_inode(root, ino, |i| {
                let mut mode = i.mode.get();
                if let Some(m) = a.mode {
                    mode = (mode & S_IFMT) | (m & 0o7777);
                }
                if kill {
                    // chown_common: ATTR_KILL_SUID, and ATTR_KILL_SGID for a group that
                    // may execute (a set-group-ID without it marks mandatory locking,
                    // which a caller allowed to chown keeps).
                    mode = crate::inode::write::mode_without_privs(mode, i.gid.get(), &|_| true);
                }
                i.mode = mode.into();
                if let Some(u) = a.uid {
                    i.uid = u.into();
                }
                if let Some(g) = a.gid {
                    i.gid = g.into();
                }
                if let Some(t) = atime {
                    i.atime = t;
                }
                if let Some(t) = mtime {
                    i.mtime = t;
                }
                i.ctime = ctime;
            })?;
            if a.mode.is_some() || kill {
                // btrfs_setattr's posix_acl_chmod: the access ACL follows the mode.
                w.acl_chmod(InodeId { root, ino })?;
            }
            Ok(())
        })
    }

    /// Set regular file `ino`'s size to `size` (`btrfs_setsize`), without the time
    /// updates (`setattr`'s).
    pub(super) fn set_size_inner(&mut self, root: u64, ino: u64, size: u64) -> Result<()> {
        let ss = u64::from(self.sectorsize());
        let id = InodeId { root, ino };
        let ii = self.live().load_inode(id, Load::ITEM)?.item;
        let old = ii.size.get();
        let first = self.live().file_extents(id, 0, 1)?;
        let inline = first.first().is_some_and(|f| matches!(f.kind, ExtentKind::Inline { .. }));
        let data_first = first.first().is_some_and(|f| f.file_offset == 0 && !f.is_hole_like());
        let max_inline = self.max_inline();
        if size < old && (inline || (old <= max_inline && data_first)) {
            // btrfs_truncate_inode_items cuts an inline extent to the new size. (A file
            // this small with data in regular extents is rewritten inline: the same
            // bytes, as the kernel's writeback of its dirty first block makes it. A hole
            // or a preallocated first block stays as it is.)
            let mut content = vec![0u8; size as usize];
            self.read_old_data(root, ino, 0, &mut content)?;
            let removed = self.drop_extents_inner(root, ino, 0, u64::MAX)?;
            if size > 0 {
                self.insert_inline(root, ino, &content)?;
            }
            return self.set_size_and_bytes(root, ino, size, removed, size);
        }
        if size < old {
            // The block holding the new end keeps zeros past it (btrfs_truncate_block).
            // (Only a block with data: the kernel leaves a hole or a preallocated
            // block alone here.)
            if !size.is_multiple_of(ss)
                && self
                    .live()
                    .file_extents(id, size / ss * ss, size / ss * ss + ss)?
                    .iter()
                    .any(|f| !f.is_hole_like())
            {
                let end = (size.div_ceil(ss) * ss).min(old);
                self.write_file_inner(root, ino, size, end, &ii, size, &mut |b: &mut [u8]| {
                    b.fill(0);
                    Ok(())
                })?;
            }
            let removed = self.drop_extents_inner(root, ino, size.div_ceil(ss) * ss, u64::MAX)?;
            return self.set_size_and_bytes(root, ino, size, removed, 0);
        }
        // Growth: the block holding the old end gets zeros past it, through the write
        // path (which also turns an inline extent into a regular one when the file
        // outgrows the inline limit); without no-holes a hole extent covers the rest.
        let mut cur = ii;
        if !old.is_multiple_of(ss) {
            let end = (old.div_ceil(ss) * ss).min(size);
            self.write_file_inner(root, ino, old, end, &ii, size, &mut |b: &mut [u8]| {
                b.fill(0);
                Ok(())
            })?;
            cur = self.live().load_inode(id, Load::ITEM)?.item;
        }
        self.insert_hole_before(root, ino, cur.size.get(), size.div_ceil(ss) * ss)?;
        self.set_size_and_bytes(root, ino, size, 0, 0)
    }

    fn set_size_and_bytes(
        &mut self,
        root: u64,
        ino: u64,
        size: u64,
        removed: u64,
        added: u64,
    ) -> Result<()> {
        self.update_inode(root, ino, |i| {
            i.size = size.into();
            i.nbytes = (i.nbytes.get() - removed.min(i.nbytes.get()) + added).into();
        })
    }
}

/// FS_IOC_GETFLAGS / SETFLAGS bits (`include/uapi/linux/fs.h`), the ones btrfs keeps.
pub mod fsflags {
    pub const SYNC: u32 = 0x0000_0008;
    pub const IMMUTABLE: u32 = 0x0000_0010;
    pub const APPEND: u32 = 0x0000_0020;
    pub const NODUMP: u32 = 0x0000_0040;
    pub const NOATIME: u32 = 0x0000_0080;
    pub const COMPR: u32 = 0x0000_0004;
    pub const NOCOMP: u32 = 0x0000_0400;
    pub const DIRSYNC: u32 = 0x0001_0000;
    pub const NOCOW: u32 = 0x0080_0000;
    /// What btrfs_fileattr_set takes; anything else is EOPNOTSUPP.
    pub const SETTABLE: u32 =
        SYNC | IMMUTABLE | APPEND | NODUMP | NOATIME | COMPR | NOCOMP | DIRSYNC | NOCOW;
}

/// The inode flags that map one to one onto FS_IOC_GETFLAGS bits (NOCOW and the
/// compression pair have rules of their own).
const PLAIN_FLAGS: [(u64, u32); 6] = [
    (INODE_SYNC, fsflags::SYNC),
    (INODE_IMMUTABLE, fsflags::IMMUTABLE),
    (INODE_APPEND, fsflags::APPEND),
    (INODE_NODUMP, fsflags::NODUMP),
    (INODE_NOATIME, fsflags::NOATIME),
    (INODE_DIRSYNC, fsflags::DIRSYNC),
];

/// The FS_IOC_GETFLAGS view of btrfs inode flags (`btrfs_inode_flags_to_fsflags`).
pub fn fsflags_of(flags: u64) -> u32 {
    let mut f = 0;
    for (b, fs) in PLAIN_FLAGS.into_iter().chain([(INODE_NODATACOW, fsflags::NOCOW)]) {
        if flags & b != 0 {
            f |= fs;
        }
    }
    if flags & INODE_NOCOMPRESS != 0 {
        f |= fsflags::NOCOMP;
    } else if flags & INODE_COMPRESS != 0 {
        f |= fsflags::COMPR;
    }
    f
}

impl FsWriter {
    /// FS_IOC_SETFLAGS (`chattr`), as `btrfs_fileattr_set` does it: the flags above,
    /// NOCOW only on a directory or an empty regular file (a non-empty file keeps its
    /// COW state, silently), COMPR setting the `btrfs.compression` property to the
    /// mount's algorithm (zlib without one), NOCOMP and neither clearing it; ctime moves.
    /// Who may change IMMUTABLE and APPEND (CAP_LINUX_IMMUTABLE) is the caller's check.
    ///
    /// # Errors
    /// `Posix`: NotSupported for other flags, Invalid for COMPR with NOCOMP (or a
    /// compression property the file cannot take), ReadOnly; tree failures.
    pub fn set_fsflags(&mut self, root: u64, ino: u64, fs: u32) -> Result<()> {
        let what = id_of(root, ino);
        if fs & !fsflags::SETTABLE != 0 {
            return Err(Error::posix_detail(
                PosixKind::NotSupported,
                what,
                format!("btrfs does not keep flags {:#x}", fs & !fsflags::SETTABLE),
            ));
        }
        if fs & fsflags::COMPR != 0 && fs & fsflags::NOCOMP != 0 {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                what,
                "compress and no-compress exclude each other",
            ));
        }
        self.check_root_writable(root)?;
        if (InodeId { root, ino }).is_placeholder() {
            return Err(Error::posix_detail(
                PosixKind::NotSupported,
                what,
                "an empty subvolume placeholder has no flags",
            ));
        }
        let ii = self.live().load_inode(InodeId { root, ino }, Load::ITEM)?.item;
        let mut f = ii.flags.get();
        for (b, fsb) in PLAIN_FLAGS {
            if fs & fsb != 0 {
                f |= b;
            } else {
                f &= !b;
            }
        }
        let regular = ii.mode.get() & S_IFMT == S_IFREG;
        if fs & fsflags::NOCOW != 0 {
            if !regular {
                f |= INODE_NODATACOW;
            } else if ii.size.get() == 0 {
                f |= INODE_NODATACOW | INODE_NODATASUM;
            }
        } else if !regular {
            f &= !INODE_NODATACOW;
        } else if ii.size.get() == 0 {
            f &= !(INODE_NODATACOW | INODE_NODATASUM);
        }
        let comp: Option<&[u8]> = if fs & fsflags::NOCOMP != 0 {
            f = (f & !INODE_COMPRESS) | INODE_NOCOMPRESS;
            None
        } else if fs & fsflags::COMPR != 0 {
            f = (f | INODE_COMPRESS) & !INODE_NOCOMPRESS;
            Some(match self.compress.alg {
                Some(crate::compression::CompressionType::Lzo) => b"lzo",
                Some(crate::compression::CompressionType::Zstd) => b"zstd",
                _ => b"zlib",
            })
        } else {
            f &= !(INODE_COMPRESS | INODE_NOCOMPRESS);
            None
        };
        // The property first, when it changes (setxattr checks everything before it
        // changes anything, so a refusal leaves the inode as it was), then the flags as
        // asked; both land in the same commit.
        use crate::inode::xattr::{XattrRead, XATTR_BTRFS_COMPRESSION};
        let cur = self.live().getxattr(InodeId { root, ino }, XATTR_BTRFS_COMPRESSION).ok();
        match comp {
            Some(v) if cur.as_deref() != Some(v) => {
                self.setxattr(root, ino, XATTR_BTRFS_COMPRESSION, v, 0)?
            }
            None if cur.is_some() => self.removexattr(root, ino, XATTR_BTRFS_COMPRESSION)?,
            _ => {}
        }
        self.transaction("set_fsflags", 1, |w| {
            let t = w.now();
            w.update_inode(root, ino, |i| {
                i.flags = f.into();
                i.ctime = t;
            })
        })
    }
}
