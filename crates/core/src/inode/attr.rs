//! Inode attributes: what a `setattr` (`data::setattr`, which also changes the size)
//! asks for and the rules it applies, and the inode flags (`set_fsflags`, chattr).
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

use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{FsRead, InodeId, Load};
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
    pub(crate) fn touches_protected(&self) -> bool {
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

pub(crate) fn ts(sec: i64, nsec: u32) -> Timespec {
    Timespec { sec: (sec as u64).into(), nsec: nsec.into() }
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
    pub fn set_fsflags(&mut self, id: InodeId, fs: u32) -> Result<()> {
        let what = id.to_string();
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
        self.check_root_writable(id.root)?;
        if id.is_placeholder() {
            return Err(Error::posix_detail(
                PosixKind::NotSupported,
                what,
                "an empty subvolume placeholder has no flags",
            ));
        }
        let ii = self.live().load_inode(id, Load::ITEM)?.item;
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
        let cur = self.live().getxattr(id, XATTR_BTRFS_COMPRESSION).ok();
        match comp {
            Some(v) if cur.as_deref() != Some(v) => {
                self.setxattr(id, XATTR_BTRFS_COMPRESSION, v, 0)?
            }
            None if cur.is_some() => self.removexattr(id, XATTR_BTRFS_COMPRESSION)?,
            _ => {}
        }
        self.transaction("set_fsflags", 1, |w| {
            let t = w.now();
            w.update_inode(id, |i| {
                i.flags = f.into();
                i.ctime = t;
            })
        })
    }
}
