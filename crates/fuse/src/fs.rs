//! `UbtrfsFs`: FUSE requests onto the engine's operations, one to one.
//!
//! Each request names inodes by FUSE node ids (`ino::InoMap`), runs the engine
//! operation that the kernel's VFS would call on btrfs, and replies with the result or
//! the errno of `errno::errno_of`. Nothing here decides filesystem semantics: the
//! engine does (orphans of open or looked-up inodes, set-ID clearing, flags, limits).
//! What stays here is the FUSE side: lookup counts handed to the kernel
//! (`Engine::count_lookups` for each entry replied), open handles, directory stream
//! offsets, the uid/gid mapping, and the conversion of attributes.
//!
//! A handler never touches the mount itself (no stat, open or lookup of a path or
//! descriptor under it): that is a request to this process, which over io_uring only
//! the thread of the caller's CPU queue serves, and that thread is the one waiting. What
//! a handler needs to know of a caller's descriptors it reads from /proc (see
//! `subvol_of_fd`).
//!
//! Permission checks are the kernel's: the mount always passes `default_permissions`,
//! so the kernel checks modes before a request reaches us (see the README).
//!
//! Directory offsets: `.` is 1, `..` is 2, an entry is its DIR_INDEX + 2 (indexes
//! start at 2, so entries start at 4). An offset stays valid while the directory
//! changes: a readdir resumes after the last index it returned.
//!
//! Handles: a table from FUSE file handle to an `OpenFile` (which keeps an unlinked
//! inode readable until release). Directories have none: OPENDIR answers ENOSYS, which
//! the kernel takes as "no open needed" for the whole mount (zero-message opendir,
//! `fc->no_opendir`), saving an OPENDIR and a RELEASEDIR per listing; readdir works
//! from the directory alone (see `listing`).

use crate::errno::{errno_of, loggable};
use crate::ino::{FuseIno, InoMap, Placeholders};
use crate::options::{IdMap, MountOptions};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo, KernelConfig,
    OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus,
    ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyLseek, ReplyOpen, ReplyStatfs, ReplyStatx, ReplyWrite,
    ReplyXattr, Request, StatxExtra, TimeOrNow,
};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use ubtrfs_core::{
    DirEntry, Engine, Error, FsRead, InodeAttrs, InodeId, Load, OpenFile, PosixKind, Result,
    SetAttr, TimeSet, WriteOpts, XattrRead, XattrReply,
};
use ubtrfs_format::structs::*;

/// How long the kernel may keep entries and attributes without asking again. Every
/// change goes through this mount (the image is locked against other writers) and
/// its reply or the kernel's own invalidation keeps the kernel's copy right, so this
/// only bounds how stale a cache may get if we are wrong.
const TTL: Duration = Duration::from_secs(1);
/// Bytes per request (FUSE max_write, and the copy_file_range step).
pub const MAX_WRITE: u32 = 1 << 20;

/// How files open. FOPEN_NOFLUSH: close(2) sends no FLUSH, as ours has nothing to
/// do (no writeback cache to drain, no POSIX locks held here, writes are in the
/// engine's page cache once write(2) returns); one round trip less per file closed.
const FILE_OPEN: FopenFlags = FopenFlags::FOPEN_KEEP_CACHE.union(FopenFlags::FOPEN_NOFLUSH);

/// FS_IOC_GETFLAGS / FS_IOC_SETFLAGS as the kernel's FUSE driver sends them (the `long`
/// ioctls; the 32-bit forms are the same numbers with size 4).
const FS_IOC_GETFLAGS: u32 = 0x8008_6601;
const FS_IOC_SETFLAGS: u32 = 0x4008_6602;
const FS_IOC32_GETFLAGS: u32 = 0x8004_6601;
const FS_IOC32_SETFLAGS: u32 = 0x4004_6602;
/// FS_IOC_FSGETXATTR: `struct fsxattr` (28 bytes), which the kernel's fileattr code
/// may ask for instead of the flags.
const FS_IOC_FSGETXATTR: u32 = 0x801c_581f;
const FS_IOC_FSSETXATTR: u32 = 0x401c_5820;

/// An open file or directory.
struct Handle {
    file: OpenFile<'static>,
}

/// How many directories' listings `UbtrfsFs::listings` keeps at most.
const LISTINGS: usize = 256;

/// The stream entries of `list` after `offset`: (offset, entry), None for `.` and `..`.
fn dirents(list: &[DirEntry], offset: u64) -> impl Iterator<Item = (u64, Option<&DirEntry>)> {
    let start = list.partition_point(|e| e.index + 2 <= offset);
    [1u64, 2]
        .into_iter()
        .filter(move |&o| o > offset)
        .map(|o| (o, None))
        .chain(list[start..].iter().map(|e| (e.index + 2, Some(e))))
}

/// The filesystem the FUSE session serves.
pub struct UbtrfsFs {
    pub(crate) engine: Arc<Engine>,
    pub(crate) map: InoMap,
    /// Node ids of subvolume placeholders (see `Placeholders`).
    placeholders: Placeholders,
    pub(crate) opts: MountOptions,
    handles: Mutex<HashMap<u64, Arc<Handle>>>,
    next_fh: AtomicU64,
    sectorsize: u32,
    /// Where the mount is (the btrfs ioctls check a caller's descriptor against it).
    pub(crate) mountpoint: std::path::PathBuf,
    /// The session's notifier once it runs: entries changed by an ioctl are
    /// invalidated in the kernel's dentry cache.
    pub(crate) notifier: Arc<std::sync::OnceLock<fuser::Notifier>>,
    /// Wakes the mount's cleaner (a subvolume was deleted).
    cleaner: std::sync::mpsc::Sender<()>,
    /// Writable opens not yet released, as (caller's pid, inode, file handle), newest
    /// last, at most `RECENT_OPENS`: see `truncating_open`.
    recent_opens: Mutex<std::collections::VecDeque<(u32, InodeId, u64)>>,
    /// Directory listings in DIR_INDEX order by directory: read at every rewind (offset
    /// 0, where each stream starts) and used by the readdir calls that page on through
    /// it; dropped at the end of a stream, at most `LISTINGS` kept (see `listing`).
    listings: Mutex<HashMap<InodeId, Arc<Vec<DirEntry>>>>,
}

/// How many opens `recent_opens` remembers: an open(O_TRUNC)'s SETATTR follows its OPEN
/// at once, from the same thread, before any release; 64 covers as many other opens in
/// between.
const RECENT_OPENS: usize = 64;

fn now_or(t: TimeOrNow) -> TimeSet {
    match t {
        TimeOrNow::Now => TimeSet::Now,
        TimeOrNow::SpecificTime(t) => {
            let (s, n) = sent_timespec(t);
            TimeSet::At(s, n)
        }
    }
}

/// The (seconds, nanoseconds) the kernel sent in a SETATTR, from the `SystemTime`
/// fuser 0.18 made of them. For a time before 1970 the kernel's nanoseconds count
/// forward from its (negative) seconds, but fuser's `system_time_from_time` subtracts
/// them too (-5 s and 300 ns become 5.0000003 s before the epoch instead of
/// 4.9999997), so a touch -d 1960-... stored a time off by up to two seconds. Undone
/// here: the duration before the epoch holds the sent seconds and nanoseconds as they
/// came.
fn sent_timespec(t: SystemTime) -> (i64, u32) {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_nanos()),
        Err(e) => (-(e.duration().as_secs() as i64), e.duration().subsec_nanos()),
    }
}

fn system_time(t: &Timespec) -> SystemTime {
    let (s, n) = (t.sec.get() as i64, t.nsec.get().min(999_999_999));
    if s >= 0 {
        UNIX_EPOCH + Duration::new(s as u64, n)
    } else {
        UNIX_EPOCH - Duration::from_secs(s.unsigned_abs()) + Duration::from_nanos(u64::from(n))
    }
}

fn file_type(mode: u32) -> FileType {
    match mode & S_IFMT {
        S_IFDIR => FileType::Directory,
        S_IFLNK => FileType::Symlink,
        S_IFCHR => FileType::CharDevice,
        S_IFBLK => FileType::BlockDevice,
        S_IFIFO => FileType::NamedPipe,
        S_IFSOCK => FileType::Socket,
        _ => FileType::RegularFile,
    }
}

fn ft_type(ft: u8) -> FileType {
    match ft {
        FT_DIR => FileType::Directory,
        FT_SYMLINK => FileType::Symlink,
        FT_CHRDEV => FileType::CharDevice,
        FT_BLKDEV => FileType::BlockDevice,
        FT_FIFO => FileType::NamedPipe,
        FT_SOCK => FileType::Socket,
        _ => FileType::RegularFile,
    }
}

/// FUSE's rdev is the userspace dev_t (new_encode_dev); btrfs keeps major << 20 | minor.
fn rdev_to_fuse(rdev: u64) -> u32 {
    let (ma, mi) = rdev_decode(rdev);
    libc::makedev(ma, mi) as u32
}

fn rdev_from_fuse(rdev: u32) -> u64 {
    let d = libc::dev_t::from(rdev);
    rdev_encode(libc::major(d), libc::minor(d))
}

fn name_of(n: &OsStr) -> &[u8] {
    n.as_bytes()
}

impl UbtrfsFs {
    /// Serve `engine` with its directory `top` as the mount's root.
    pub fn new(
        engine: Arc<Engine>,
        top: InodeId,
        opts: MountOptions,
        mountpoint: &Path,
        notifier: Arc<std::sync::OnceLock<fuser::Notifier>>,
        cleaner: std::sync::mpsc::Sender<()>,
    ) -> UbtrfsFs {
        let sectorsize = engine.info().super_copy().sectorsize.get();
        let mountpoint =
            std::fs::canonicalize(mountpoint).unwrap_or_else(|_| mountpoint.to_path_buf());
        UbtrfsFs {
            engine,
            map: InoMap { top },
            placeholders: Placeholders::default(),
            opts,
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            sectorsize,
            mountpoint,
            notifier,
            cleaner,
            recent_opens: Mutex::new(std::collections::VecDeque::with_capacity(RECENT_OPENS)),
            listings: Mutex::new(HashMap::new()),
        }
    }

    /// Wake the cleaner: a subvolume was deleted.
    pub(crate) fn kick_cleaner(&self) {
        let _ = self.cleaner.send(());
    }

    /// The engine served.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    fn id(&self, n: INodeNo) -> Result<InodeId> {
        if Placeholders::is_placeholder_number(n.0) {
            return self.placeholders.id(FuseIno(n.0));
        }
        self.map.from_fuse(FuseIno(n.0))
    }

    /// The node id of entry `e` of directory `dir`: its inode's, or a placeholder's own.
    fn node_of(&self, dir: InodeId, e: &DirEntry) -> Result<u64> {
        match e.placeholder_of {
            Some(subvol) => Ok(self.placeholders.node(dir, subvol)?.0),
            None => Ok(self.map.to_fuse(e.target)?.0),
        }
    }

    /// Reply with `e`'s errno, logging what is not a plain POSIX answer.
    fn fail(&self, what: &str, e: &Error) -> Errno {
        if loggable(e) {
            crate::log::log(&format!("{what}: {e}"));
        }
        errno_of(e)
    }

    fn attr_of(&self, id: InodeId, ii: &InodeItem) -> Result<FileAttr> {
        let n = if id == self.map.top { InoMap::encode(id)? } else { self.map.to_fuse(id)?.0 };
        Ok(self.attr_with_number(n, ii))
    }

    /// The attributes of node id `n` (also its `st_ino`), whose item is `ii`.
    fn attr_with_number(&self, n: u64, ii: &InodeItem) -> FileAttr {
        let mode = ii.mode.get();
        FileAttr {
            ino: INodeNo(n),
            size: ii.size.get(),
            // btrfs_getattr: the bytes rounded up to the block size, in 512-byte units.
            blocks: ii.nbytes.get().div_ceil(u64::from(self.sectorsize))
                * u64::from(self.sectorsize)
                / 512,
            atime: system_time(&ii.atime),
            mtime: system_time(&ii.mtime),
            ctime: system_time(&ii.ctime),
            crtime: system_time(&ii.otime),
            kind: file_type(mode),
            perm: (mode & 0o7777) as u16,
            nlink: ii.nlink.get(),
            uid: IdMap::show(self.opts.uid, ii.uid.get()),
            gid: IdMap::show(self.opts.gid, ii.gid.get()),
            rdev: rdev_to_fuse(ii.rdev.get()),
            blksize: self.sectorsize,
            flags: 0,
        }
    }

    fn getattr_of(&self, id: InodeId) -> Result<(FileAttr, u64)> {
        let ii = self.engine.getattr(id)?;
        Ok((self.attr_of(id, &ii)?, ii.generation.get()))
    }

    /// `getattr_of` for the inode the kernel knows as node id `n` (a placeholder's
    /// number is its own, not its inode's).
    fn getattr_node(&self, n: INodeNo, id: InodeId) -> Result<(FileAttr, u64)> {
        if !id.is_placeholder() {
            return self.getattr_of(id);
        }
        let ii = self.engine.getattr(id)?;
        Ok((self.attr_with_number(n.0, &ii), ii.generation.get()))
    }

    /// `getattr_node` for entry `e` of directory `dir`.
    fn getattr_entry(&self, dir: InodeId, e: &DirEntry) -> Result<(FileAttr, u64)> {
        if !e.is_placeholder() {
            return self.getattr_of(e.target);
        }
        let n = self.node_of(dir, e)?;
        self.getattr_node(INodeNo(n), e.target)
    }

    /// Reply to an entry-making request for `id`, counting the lookup the kernel now
    /// holds. The count is taken before the reply so a forget can never come first.
    fn entry(&self, id: InodeId, reply: ReplyEntry) {
        match self.getattr_of(id) {
            Ok((attr, generation)) => {
                if id != self.map.top {
                    self.engine.count_lookups(id, 1);
                }
                reply.entry(&TTL, &attr, Generation(generation))
            }
            Err(e) => reply.error(self.fail("entry", &e)),
        }
    }

    /// Reply to a lookup of `.` or `..` that leads to the mount's root: node id 1,
    /// generation 0 (the kernel made its root inode with generation 0, checks a
    /// handle's generation against that, and warns of any other). fuser takes the node
    /// id from the attributes' `ino`, so this reply says 1 where the root's `st_ino`
    /// is the top directory's own number; the attributes come with no validity, so the
    /// next stat asks again (getattr) and shows the right one.
    fn reply_root(&self, reply: ReplyEntry) {
        match self.engine.getattr(self.map.top) {
            Ok(ii) => reply.entry_with_ttls(
                &Duration::ZERO,
                &TTL,
                &self.attr_with_number(FuseIno::ROOT.0, &ii),
                Generation(0),
            ),
            Err(e) => reply.error(self.fail("lookup", &e)),
        }
    }

    /// FUSE_LOOKUP of `.` in node `n`: the kernel's `fuse_get_dentry` decoding a file
    /// handle (node id, generation) of an inode it does not hold. The reply is the
    /// inode itself, counted as a lookup; the kernel then compares the generation we
    /// give with the handle's and answers ESTALE when they differ (an inode number
    /// used again), and turns our ENOENT for an inode that is gone into ESTALE.
    /// Measured on a 6.18 kernel btrfs: open_by_handle_at after drop_caches opens a
    /// file, a hard link, a directory, files in a subvolume and in a snapshot, and an
    /// unlinked file still open (nlink 0); it is ESTALE for a file or directory
    /// removed and no longer open, for a reused inode number (new generation), for
    /// an inode of a deleted snapshot, and for a snapshot's subvolume placeholder.
    fn lookup_dot(&self, n: INodeNo, reply: ReplyEntry) {
        if n.0 == FuseIno::ROOT.0 {
            return self.reply_root(reply);
        }
        let r = self.id(n).and_then(|id| {
            // A placeholder is not found, as on the kernel's btrfs, whose handle of
            // one names objectid 2, which has no inode item (measured: ESTALE). Its
            // number is only this mount's, too: after a remount it may be another
            // entry's. The root is node id 1 alone, so its encoded number is not one.
            if id == self.map.top || id.is_placeholder() {
                return Err(Error::posix_detail(
                    PosixKind::NotFound,
                    format!("node id {}", n.0),
                    "no inode a file handle can name has this FUSE number",
                ));
            }
            self.engine.lookup_inode(id)?;
            let r = self.getattr_of(id).and_then(|(attr, generation)| {
                // The kernel asks only for an inode it no longer holds, so no file of
                // it is open: an inode without links is gone for a handle (ESTALE, as
                // on the kernel's btrfs), even while the RELEASE of its last close,
                // which the kernel sends without waiting, has not reached us yet.
                if attr.nlink == 0 {
                    return Err(Error::posix_detail(
                        PosixKind::NotFound,
                        id.to_string(),
                        "the inode has no links left",
                    ));
                }
                Ok((attr, generation))
            });
            r.inspect_err(|_| {
                let _ = self.engine.forget(id, 1);
            })
        });
        match r {
            Ok((attr, generation)) => reply.entry(&TTL, &attr, Generation(generation)),
            Err(e) => reply.error(self.fail("lookup", &e)),
        }
    }

    /// FUSE_LOOKUP of `..` in directory node `n`: the kernel's `fuse_get_parent`,
    /// walking a decoded directory up to the mount's root (`reconnect_path`). The
    /// reply is the directory holding it, as `btrfs_get_parent` finds it: its
    /// INODE_REF's parent, or for a subvolume's top directory the directory that
    /// names it (ROOT_BACKREF); a placeholder's is the directory its entry is in. The
    /// mount's root is its own parent: the walk ends there. ENOENT (the kernel's
    /// ESTALE) where nothing holds the directory: the top-level tree's top when the
    /// mount shows a subvolume, a deleted subvolume.
    fn lookup_dotdot(&self, n: INodeNo, reply: ReplyEntry) {
        let r = self.id(n).and_then(|id| {
            if n.0 == FuseIno::ROOT.0 || id == self.map.top {
                return Ok(None);
            }
            let parent = if Placeholders::is_placeholder_number(n.0) {
                self.placeholders.parent(FuseIno(n.0))?
            } else {
                if self.engine.getattr(id)?.mode.get() & S_IFMT != S_IFDIR {
                    return Err(Error::posix(PosixKind::NotDir, id.to_string()));
                }
                // A directory's parent cannot go while it holds the directory; a
                // rename racing with this may move `id` away and let the old parent
                // go, and then getattr below fails (ENOENT: ESTALE) or the kernel's
                // reconnect finds no name for `id` there (ESTALE), as it would race on
                // any filesystem.
                self.engine.read(|v| v.lookup_parent(id))?.ok_or_else(|| {
                    Error::posix_detail(
                        PosixKind::NotFound,
                        id.to_string(),
                        "no directory holds it",
                    )
                })?
            };
            if parent == self.map.top {
                return Ok(None);
            }
            self.engine.count_lookups(parent, 1);
            self.getattr_of(parent)
                .inspect_err(|_| {
                    let _ = self.engine.forget(parent, 1);
                })
                .map(Some)
        });
        match r {
            Ok(None) => self.reply_root(reply),
            Ok(Some((attr, generation))) => reply.entry(&TTL, &attr, Generation(generation)),
            Err(e) => reply.error(self.fail("lookup", &e)),
        }
    }

    /// Whether the caller of `req`, with supplementary groups `groups`, is in stored
    /// group `gid` (`in_group_p`: its group or a supplementary one, through the gid=
    /// mapping).
    fn caller_in_group(&self, req: &Request, groups: &[u32], gid: u32) -> bool {
        let map = |g: u32| IdMap::store(self.opts.gid, g);
        map(req.gid()) == gid || groups.iter().any(|&g| map(g) == gid)
    }

    /// The mode `id` is left with by a truncation or fallocate of the caller of `req`
    /// when that takes set-user-ID bits (`should_remove_suid`: a caller without
    /// CAP_FSETID); None when nothing changes. Ours to do under
    /// FUSE_HANDLE_KILLPRIV_V2.
    fn mode_without_privs(&self, req: &Request, id: InodeId) -> Result<Option<u32>> {
        let item = self.engine.read(|l| l.load_inode(id, Load::ITEM))?.item;
        let mode = item.mode.get();
        if mode & S_IFMT != S_IFREG || mode & 0o6000 == 0 {
            return Ok(None);
        }
        let (fsetid, groups) = caller_creds(req.pid());
        if fsetid {
            return Ok(None);
        }
        let m = ubtrfs_core::mode_without_privs(mode, item.gid.get(), &|g| {
            self.caller_in_group(req, &groups, g)
        });
        Ok(Some(m & 0o7777).filter(|_| m != mode))
    }

    /// Whether setting access ACL `value` on `id` by the caller of `req` takes the
    /// set-group-ID bit: `posix_acl_update_mode` clears it when the caller is neither
    /// in the file's group nor has CAP_FSETID. The kernel's FUSE sends that decision as
    /// FUSE_SETXATTR_ACL_KILL_SGID only with FUSE_SETXATTR_EXT, which fuser does not
    /// speak, so the daemon makes it from the caller's credentials.
    fn acl_kills_sgid(
        &self,
        req: &Request,
        id: InodeId,
        name: &[u8],
        value: &[u8],
    ) -> Result<bool> {
        if name != b"system.posix_acl_access" || value.is_empty() {
            return Ok(false);
        }
        let item = self.engine.read(|l| l.load_inode(id, Load::ITEM))?.item;
        if item.mode.get() & S_ISGID == 0 {
            return Ok(false);
        }
        let (fsetid, groups) = caller_creds(req.pid());
        Ok(!fsetid && !self.caller_in_group(req, &groups, item.gid.get()))
    }

    /// `file_modified` for a request that changes `id`'s data without carrying the
    /// kernel's decision on the set-user-ID bits (fallocate, copy_file_range): a caller
    /// without CAP_FSETID takes them (ours to take under FUSE_HANDLE_KILLPRIV_V2). The
    /// kernel's cached mode is told: it keeps set-group-ID, or both bits, otherwise.
    fn file_modified(&self, req: &Request, id: InodeId) -> Result<()> {
        if let Some(m) = self.mode_without_privs(req, id)? {
            self.engine.setattr(id, &SetAttr { mode: Some(m), ..SetAttr::default() })?;
            self.invalidate_attrs(id);
        }
        Ok(())
    }

    /// Whether a SETATTR of size 0 alone, by the caller of `req`, on `id`, is the
    /// truncation of an open(O_TRUNC). The kernel's btrfs moves mtime and ctime for one
    /// also when the file is already empty (the VFS's handle_truncate asks for
    /// ATTR_MTIME and ATTR_CTIME), where truncate(2) to the size a file has changes
    /// nothing. Without the writeback cache the kernel's FUSE sends neither time, and
    /// without FUSE_ATOMIC_O_TRUNC (see `open`) neither O_TRUNC, nor a file handle
    /// (fuse_do_setattr drops it for ATTR_OPEN), so the two look alike; what tells
    /// them apart is the OPEN of that inode by that caller just before, not yet
    /// released. A truncate(2) to 0 of an empty file by a process that holds it open
    /// for writing, from an open that truncated nothing yet, moves the times too:
    /// the one difference left.
    fn truncating_open(&self, req: &Request, id: InodeId) -> bool {
        let mut opens = self.recent_opens.lock().expect("no panic while held");
        match opens.iter().rposition(|&(pid, i, _)| (pid, i) == (req.pid(), id)) {
            Some(i) => {
                opens.remove(i);
                true
            }
            None => false,
        }
    }

    /// The attributes the caller of `req` asks for a new inode of `mode` (type and
    /// permission bits): its fsuid and fsgid through the uid= and gid= mappings. The
    /// engine settles the rest from the directory (`inode_init_owner`, inherited ACLs).
    fn new_attrs(&self, req: &Request, mode: u32) -> InodeAttrs {
        let mut a = InodeAttrs::new(mode);
        a.uid = IdMap::store(self.opts.uid, req.uid());
        a.gid = IdMap::store(self.opts.gid, req.gid());
        a
    }

    /// Make a regular file in directory node `parent` with `make` (an engine call given
    /// the directory) and open it: create and O_TMPFILE. With FUSE_POSIX_ACL and
    /// FUSE_DONT_MASK the kernel leaves the umask to the engine, which applies it only
    /// where the directory has no default ACL. The lookup is counted before the open,
    /// since an inode without a name that nobody holds cannot be opened (it waits for
    /// its removal); if the open fails the kernel never hears of the inode, and the
    /// count goes again.
    fn make_and_open(
        &self,
        parent: INodeNo,
        make: impl FnOnce(InodeId) -> Result<InodeId>,
    ) -> Result<(FileAttr, u64, u64)> {
        self.writable()?;
        let id = make(self.id(parent)?)?;
        self.engine.count_lookups(id, 1);
        let opened = self.engine.open_file_shared(id).and_then(|f| Ok((self.getattr_of(id)?, f)));
        match opened {
            Ok(((attr, generation), f)) => Ok((attr, generation, self.add_handle(f))),
            Err(e) => {
                let _ = self.engine.forget(id, 1);
                Err(e)
            }
        }
    }

    fn reply_created(&self, reply: ReplyCreate, what: &str, r: Result<(FileAttr, u64, u64)>) {
        match r {
            Ok((attr, generation, fh)) => {
                reply.created(&TTL, &attr, Generation(generation), FileHandle(fh), FILE_OPEN)
            }
            Err(e) => reply.error(self.fail(what, &e)),
        }
    }

    /// Make an inode in directory node `parent` with `make` (an engine call given the
    /// directory), and reply with its entry.
    fn make(
        &self,
        what: &str,
        parent: INodeNo,
        reply: ReplyEntry,
        make: impl FnOnce(InodeId) -> Result<InodeId>,
    ) {
        let r = self.id(parent).and_then(|dir| {
            self.writable()?;
            make(dir)
        });
        match r {
            Ok(id) => self.entry(id, reply),
            Err(e) => reply.error(self.fail(what, &e)),
        }
    }

    /// unlink and rmdir: `remove` (the engine's) of `name` in `parent`.
    fn remove(
        &self,
        what: &str,
        parent: INodeNo,
        name: &OsStr,
        reply: ReplyEmpty,
        remove: fn(&Engine, InodeId, &[u8]) -> Result<()>,
    ) {
        let r = self.id(parent).and_then(|dir| {
            self.writable()?;
            remove(&self.engine, dir, name_of(name))
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail(what, &e)),
        }
    }

    pub(crate) fn writable(&self) -> Result<()> {
        if self.opts.is_read_only() {
            return Err(Error::posix(PosixKind::ReadOnly, "the mount is read-only"));
        }
        Ok(())
    }

    fn add_handle(&self, file: OpenFile<'static>) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let h = Arc::new(Handle { file });
        self.handles.lock().unwrap_or_else(|p| p.into_inner()).insert(fh, h);
        fh
    }

    fn handle(&self, fh: FileHandle) -> Result<Arc<Handle>> {
        self.handles.lock().unwrap_or_else(|p| p.into_inner()).get(&fh.0).cloned().ok_or_else(
            || Error::posix_detail(PosixKind::Invalid, format!("file handle {}", fh.0), "not open"),
        )
    }

    fn release_handle(&self, fh: FileHandle) -> Result<()> {
        let h = self.handles.lock().unwrap_or_else(|p| p.into_inner()).remove(&fh.0);
        let Some(h) = h else { return Ok(()) };
        self.recent_opens.lock().expect("no panic while held").retain(|&(_, _, f)| f != fh.0);
        match Arc::try_unwrap(h) {
            Ok(h) => h.file.close(),
            // A request still using it: its drop closes it (errors are kept by the
            // engine and printed at unmount).
            Err(_) => Ok(()),
        }
    }

    /// Close every handle still open (at unmount).
    pub fn close_all(&self) {
        let all: Vec<Arc<Handle>> = self
            .handles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .map(|(_, h)| h)
            .collect();
        for h in all {
            if let Ok(h) = Arc::try_unwrap(h) {
                if let Err(e) = h.file.close() {
                    crate::log::log(&format!("close at unmount: {e}"));
                }
            }
        }
    }

    /// The listing of directory handle `fh`, read afresh at offset 0.
    /// Directory `ino`'s listing for a readdir at `offset`: read afresh at a rewind
    /// (offset 0), else the one the stream's earlier calls read, or a fresh one if it
    /// is no longer kept. Offsets are DIR_INDEX + 2, so any listing pages on correctly
    /// from any offset: entries made or removed since a stream began may show or not,
    /// as POSIX allows.
    fn listing(&self, ino: INodeNo, offset: u64) -> Result<(InodeId, Arc<Vec<DirEntry>>)> {
        let id = self.id(ino)?;
        let mut kept = self.listings.lock().unwrap_or_else(|p| p.into_inner());
        if offset != 0 {
            if let Some(l) = kept.get(&id) {
                return Ok((id, l.clone()));
            }
        }
        drop(kept);
        let l = Arc::new(self.engine.read(|v| v.readdir(id))?);
        kept = self.listings.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() >= LISTINGS && !kept.contains_key(&id) {
            if let Some(k) = kept.keys().next().copied() {
                kept.remove(&k);
            }
        }
        kept.insert(id, l.clone());
        Ok((id, l))
    }

    /// A readdir that returned nothing reached the end of its stream: its listing goes.
    fn listing_done(&self, id: InodeId) {
        self.listings.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    }

    /// Move `id`'s atime after a read or a listing. The kernel's FUSE drops its cached
    /// atime after each (`fuse_invalidate_atime`), so the next `stat` asks us.
    fn atime(&self, id: InodeId) {
        if self.opts.read_only || self.opts.state.remounted_ro() {
            return;
        }
        if let Err(e) = self.engine.file_accessed(id, self.opts.atime) {
            let _ = self.fail("atime update", &e);
        }
    }

    /// How file `ino` opens: its pages stay cached (FOPEN_KEEP_CACHE) unless a read
    /// now would move its atime; then the kernel drops them at this open and the reads
    /// reach us and move it, as `touch_atime` does on a kernel mount. Under relatime
    /// that is the first open after a change, under strictatime every open.
    fn open_flags(&self, ino: INodeNo) -> FopenFlags {
        let t = self.engine.info().sources.clock.now();
        let now = Timespec { sec: (t.sec as u64).into(), nsec: t.nsec.into() };
        let moves = |ii: InodeItem| ubtrfs_core::atime_needs_update(&ii, now, self.opts.atime);
        let stale = !self.opts.read_only
            && !self.opts.state.remounted_ro()
            && self.id(ino).and_then(|id| self.engine.getattr(id)).is_ok_and(moves);
        if stale {
            FopenFlags::FOPEN_NOFLUSH
        } else {
            FILE_OPEN
        }
    }

    /// Tell the kernel that inode `id`'s attributes changed in a way its own FUSE
    /// code does not expect after the request it sent (the next `stat` asks us). The
    /// kernel handles this without the inode's lock or its pages (attributes only), so
    /// it may be sent from inside a request on that inode. An inode the kernel does not
    /// hold is no error.
    pub(crate) fn invalidate_attrs(&self, id: InodeId) {
        if let (Some(n), Ok(ino)) = (self.notifier.get(), self.map.to_fuse(id)) {
            let _ = n.inval_inode(INodeNo(ino.0), -1, 0);
        }
    }

    /// The flags ioctls. The kernel's FUSE fileattr code sends FS_IOC_GETFLAGS and
    /// FS_IOC_SETFLAGS with an `unsigned int` (4 bytes), whatever size the command
    /// number encodes; the reply is as long as `out_size` asks, at most 8 bytes.
    fn flags_ioctl(&self, id: InodeId, cmd: u32, in_data: &[u8], out_size: u32) -> Result<Vec<u8>> {
        match cmd {
            // A placeholder has no fileattr operations (EOPNOTSUPP, as chattr reports
            // on the kernel's).
            FS_IOC_GETFLAGS | FS_IOC32_GETFLAGS | FS_IOC_FSGETXATTR if id.is_placeholder() => {
                Err(Error::posix_detail(
                    PosixKind::NotSupported,
                    id.to_string(),
                    "an empty subvolume placeholder has no flags",
                ))
            }
            FS_IOC_GETFLAGS | FS_IOC32_GETFLAGS => {
                let ii = self.engine.getattr(id)?;
                let f = ubtrfs_core::fsflags_of(ii.flags.get());
                Ok(u64::from(f).to_le_bytes()[..(out_size as usize).min(8)].to_vec())
            }
            FS_IOC_SETFLAGS | FS_IOC32_SETFLAGS => {
                self.writable()?;
                let f = in_data.get(..4).ok_or_else(|| {
                    Error::posix_detail(
                        PosixKind::Invalid,
                        id.to_string(),
                        "FS_IOC_SETFLAGS without its flags",
                    )
                })?;
                let f = u32::from_le_bytes(f.try_into().expect("four bytes"));
                self.engine.set_fsflags(id, f)?;
                // The kernel's FUSE fileattr_set keeps its cached attributes, and the
                // ctime moved (S_IMMUTABLE and S_APPEND are not FUSE inode flags).
                self.invalidate_attrs(id);
                Ok(Vec::new())
            }
            FS_IOC_FSSETXATTR => {
                self.writable()?;
                let x = in_data.get(..28).ok_or_else(|| {
                    Error::posix_detail(
                        PosixKind::Invalid,
                        id.to_string(),
                        "FS_IOC_FSSETXATTR without its struct fsxattr",
                    )
                })?;
                let word = |i: usize| {
                    u32::from_le_bytes(x[i * 4..i * 4 + 4].try_into().expect("four bytes"))
                };
                // struct fsxattr: fsx_xflags, fsx_extsize, fsx_nextents, fsx_projid,
                // fsx_cowextsize. btrfs takes only the flags FS_IOC_SETFLAGS knows
                // (btrfs_fileattr_set: EOPNOTSUPP for anything `fileattr_has_fsx`
                // finds: other xflags, an extent size, a project id).
                let (xflags, extsize, projid, cowextsize) = (word(0), word(1), word(3), word(4));
                if xflags & !FS_XFLAG_COMMON != 0 || extsize != 0 || projid != 0 || cowextsize != 0
                {
                    return Err(Error::posix_detail(
                        PosixKind::NotSupported,
                        id.to_string(),
                        "btrfs keeps no XFS attributes beyond the common inode flags",
                    ));
                }
                // vfs_fileattr_set: the flags fsxattr cannot say (nocow, compression,
                // dirsync...) stay as they are.
                let old = ubtrfs_core::fsflags_of(self.engine.getattr(id)?.flags.get());
                let f = (old & !FS_COMMON_FL) | fs_flags_of_xflags(xflags);
                self.engine.set_fsflags(id, f)?;
                self.invalidate_attrs(id);
                Ok(Vec::new())
            }
            FS_IOC_FSGETXATTR => {
                // struct fsxattr: fsx_xflags, fsx_extsize, fsx_nextents, fsx_projid,
                // fsx_cowextsize, 8 bytes of padding.
                let ii = self.engine.getattr(id)?;
                let x = fs_xflags(ubtrfs_core::fsflags_of(ii.flags.get()));
                let mut out = vec![0u8; 28];
                out[..4].copy_from_slice(&x.to_le_bytes());
                out.truncate(out_size as usize);
                Ok(out)
            }
            _ => Err(Error::posix_detail(
                PosixKind::NotSupported,
                id.to_string(),
                format!("ioctl {cmd:#x}"),
            )),
        }
    }
}

/// (FS_*_FL, FS_XFLAG_*) pairs the kernel converts (`fileattr_fill_flags`,
/// `fileattr_fill_xflags`): immutable, append, sync, nodump, noatime, DAX,
/// project inherit.
const FL_XFLAG_PAIRS: [(u32, u32); 7] = [
    (0x10, 0x8),
    (0x20, 0x10),
    (0x8, 0x20),
    (0x40, 0x80),
    (0x80, 0x40),
    (0x0200_0000, 0x8000),
    (0x2000_0000, 0x200),
];
/// FS_COMMON_FL and FS_XFLAG_COMMON: the flags both ioctls can say.
const FS_COMMON_FL: u32 = 0x10 | 0x20 | 0x8 | 0x40 | 0x80 | 0x0200_0000 | 0x2000_0000;
const FS_XFLAG_COMMON: u32 = 0x8 | 0x10 | 0x20 | 0x80 | 0x40 | 0x8000 | 0x200;

/// FS_XFLAG_* for FS_*_FL flags (the kernel's `fileattr_fill_flags`).
fn fs_xflags(fl: u32) -> u32 {
    FL_XFLAG_PAIRS.iter().filter(|(f, _)| fl & f != 0).fold(0, |x, (_, xf)| x | xf)
}

/// FS_*_FL flags for FS_XFLAG_* flags (the kernel's `fileattr_fill_xflags`).
fn fs_flags_of_xflags(x: u32) -> u32 {
    FL_XFLAG_PAIRS.iter().filter(|(_, xf)| x & xf != 0).fold(0, |f, (fl, _)| f | fl)
}

impl fuser::Filesystem for UbtrfsFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(MAX_WRITE);
        let _ = config.set_max_readahead(MAX_WRITE);
        let _ = config.set_max_background(64);
        // Not FUSE_WRITEBACK_CACHE: with it the kernel holds written pages and times
        // the engine cannot see, so SEEK_DATA misses data just written and ctime
        // checks after rename or open(O_TRUNC) read stale cached times (pjdfstest
        // and the workload test fail with it).
        // FUSE_HANDLE_KILLPRIV_V2: we take the set-user-ID bits on write, truncate
        // and chown (see write and setattr), and in exchange the kernel stops asking
        // for security.capability before every write (it marks inodes S_NOSEC): one
        // request per write instead of two.
        // FUSE_EXPORT_SUPPORT: file handles (name_to_handle_at, open_by_handle_at, an
        // NFS export) decode also when the kernel no longer holds the inode: it asks
        // us with lookups of `.` and `..` (see `lookup_dot`). Without it the kernel
        // answers ESTALE for every inode it has evicted. Node ids are fixed by (tree,
        // objectid), so handles stay valid across remounts, as btrfs's own do.
        for cap in [
            fuser::InitFlags::FUSE_DO_READDIRPLUS,
            fuser::InitFlags::FUSE_READDIRPLUS_AUTO,
            fuser::InitFlags::FUSE_PARALLEL_DIROPS,
            fuser::InitFlags::FUSE_POSIX_ACL,
            fuser::InitFlags::FUSE_DONT_MASK,
            fuser::InitFlags::FUSE_HANDLE_KILLPRIV_V2,
            fuser::InitFlags::FUSE_EXPORT_SUPPORT,
        ] {
            let _ = config.add_capabilities(cap);
        }
        // FUSE_OVER_IO_URING (offered when the fuse module's `enable_uring` is on): each
        // request is served by a thread on the CPU that made it, with no wake-up of
        // another CPU (the session makes the rings; see fuser's `uring` module).
        if self.opts.io_uring {
            let _ = config.add_capabilities(fuser::InitFlags::FUSE_OVER_IO_URING);
        }
        Ok(())
    }

    fn destroy(&mut self) {
        self.close_all();
        // The kernel holds no inode any more, whatever FORGETs it sent: an unlinked one
        // it held goes now, not at the next mount's orphan cleanup.
        if !self.opts.read_only {
            if let Err(e) = self.engine.forget_all() {
                crate::log::log(&format!("forget at unmount: {e}"));
            }
        }
        crate::session::last_commit(&self.engine, self.opts.read_only);
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        // The VFS resolves `.` and `..` itself; the kernel sends them only to decode
        // file handles (no btrfs directory holds such names).
        match name.as_bytes() {
            b"." => return self.lookup_dot(parent, reply),
            b".." => return self.lookup_dotdot(parent, reply),
            _ => {}
        }
        let r = self.id(parent).and_then(|dir| Ok((dir, self.engine.lookup(dir, name_of(name))?)));
        match r {
            Ok((dir, Some(e))) => match self.getattr_entry(dir, &e) {
                // Engine::lookup counted the lookup.
                Ok((attr, generation)) => reply.entry(&TTL, &attr, Generation(generation)),
                Err(err) => {
                    let _ = self.engine.forget(e.target, 1);
                    reply.error(self.fail("lookup", &err))
                }
            },
            Ok((_, None)) => reply.error(Errno::ENOENT),
            Err(e) => reply.error(self.fail("lookup", &e)),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        if let Ok(id) = self.id(ino) {
            if id == self.map.top {
                return;
            }
            if let Err(e) = self.engine.forget(id, nlookup) {
                let _ = self.fail("forget", &e);
            }
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.id(ino).and_then(|id| self.getattr_node(ino, id)) {
            Ok((attr, _)) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(self.fail("getattr", &e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let r = self.id(ino).and_then(|id| {
            self.writable()?;
            let a = SetAttr {
                mode: mode.map(|m| m & 0o7777),
                uid: uid.map(|u| IdMap::store(self.opts.uid, u)),
                gid: gid.map(|g| IdMap::store(self.opts.gid, g)),
                size,
                atime: atime.map(now_or),
                mtime: mtime.map(now_or),
                // An explicit ctime, when the kernel sends one.
                ctime: ctime.map(sent_timespec),
                // With FUSE_HANDLE_KILLPRIV_V2 the kernel leaves the set-user-ID bits
                // to us (its FATTR_KILL_SUIDGID, which fuser does not pass on): a
                // chown, with ids or without, and a truncation by a caller without
                // CAP_FSETID (`should_remove_suid`) take them. chown(path, -1, -1)
                // arrives as a SETATTR of ctime alone, or (kernel 6.18 without the
                // writeback cache, which sends no FATTR_CTIME) of nothing at all; no
                // other call makes an empty one (utimensat with two UTIME_OMITs stops
                // in the VFS).
                kill_privs: uid.is_some()
                    || gid.is_some()
                    || (mode.is_none() && size.is_none() && atime.is_none() && mtime.is_none()),
            };
            // A truncation by a caller without CAP_FSETID: `should_remove_suid`'s mode
            // (the kernel's FATTR_KILL_SUIDGID, which fuser does not pass on).
            let a = if size.is_some() && mode.is_none() {
                SetAttr { mode: self.mode_without_privs(req, id)?, ..a }
            } else {
                a
            };
            let a = if size == Some(0)
                && _fh.is_none()
                && a.mtime.is_none()
                && self.truncating_open(req, id)
            {
                SetAttr { mtime: Some(TimeSet::Now), ..a }
            } else {
                a
            };
            self.engine.setattr(id, &a)?;
            self.getattr_node(ino, id)
        });
        match r {
            Ok((attr, _)) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(self.fail("setattr", &e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.id(ino).and_then(|id| self.engine.read(|l| l.readlink(id))) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(self.fail("readlink", &e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let mut a = self.new_attrs(req, mode);
        a.rdev = rdev_from_fuse(rdev);
        self.make("mknod", parent, reply, |dir| self.engine.mknod(dir, name_of(name), &a, umask));
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let a = self.new_attrs(req, S_IFDIR | (mode & 0o7777));
        self.make("mkdir", parent, reply, |dir| self.engine.mkdir(dir, name_of(name), &a, umask));
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove("unlink", parent, name, reply, Engine::unlink);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove("rmdir", parent, name, reply, Engine::rmdir);
        // (It may have been an empty subvolume's.)
        self.kick_cleaner();
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let (name, target) = (name_of(link_name), target.as_os_str().as_bytes());
        let a = self.new_attrs(req, S_IFLNK | 0o777);
        self.make("symlink", parent, reply, |dir| self.engine.symlink(dir, name, target, &a));
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let r = (|| {
            self.writable()?;
            let (od, nd) = (self.id(parent)?, self.id(newparent)?);
            // A RENAME_WHITEOUT's whiteout is the caller's (its fsuid and fsgid).
            let owner =
                (IdMap::store(self.opts.uid, req.uid()), IdMap::store(self.opts.gid, req.gid()));
            self.engine.rename_with_owner(
                od,
                name_of(name),
                nd,
                name_of(newname),
                flags.bits(),
                owner,
            )
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("rename", &e)),
        }
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let r = (|| {
            self.writable()?;
            let (id, dir) = (self.id(ino)?, self.id(newparent)?);
            self.engine.link(id, dir, name_of(newname))?;
            Ok(id)
        })();
        match r {
            Ok(id) => self.entry(id, reply),
            Err(e) => reply.error(self.fail("link", &e)),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let r = self.id(ino).and_then(|id| {
            let acc = flags.0 & libc::O_ACCMODE;
            if acc != libc::O_RDONLY || flags.0 & libc::O_TRUNC != 0 {
                self.writable()?;
                // may_open and inode_permission's MAY_WRITE: the kernel checks the
                // inode flags, which a FUSE inode does not carry, so they are ours.
                let fl = self.engine.getattr(id)?.flags.get();
                if fl & INODE_IMMUTABLE != 0 {
                    return Err(Error::posix_detail(
                        PosixKind::NotPermitted,
                        id.to_string(),
                        "the file is immutable",
                    ));
                }
                // fsverity_file_open.
                if fl & INODE_RO_VERITY != 0 {
                    return Err(Error::posix_detail(
                        PosixKind::NotPermitted,
                        id.to_string(),
                        "an fs-verity file is read-only",
                    ));
                }
                if fl & INODE_APPEND != 0
                    && (flags.0 & libc::O_APPEND == 0 || flags.0 & libc::O_TRUNC != 0)
                {
                    return Err(Error::posix_detail(
                        PosixKind::NotPermitted,
                        id.to_string(),
                        "the file is append-only: open it with O_APPEND and without O_TRUNC",
                    ));
                }
            }
            // No FUSE_ATOMIC_O_TRUNC: with it the truncation would come here, before the
            // kernel's own checks that follow the open (a running executable's
            // ETXTBSY), and a refused open(O_TRUNC) would still have emptied the file.
            // The kernel truncates through setattr once those checks pass.
            let f = self.engine.open_file_shared(id)?;
            let fh = self.add_handle(f);
            if acc != libc::O_RDONLY {
                let mut opens = self.recent_opens.lock().expect("no panic while held");
                if opens.len() == RECENT_OPENS {
                    opens.pop_front();
                }
                opens.push_back((req.pid(), id, fh));
            }
            Ok(fh)
        });
        match r {
            Ok(fh) => reply.opened(FileHandle(fh), self.open_flags(ino)),
            Err(e) => reply.error(self.fail("open", &e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyData,
    ) {
        let r = self.handle(fh).and_then(|h| {
            let mut buf = vec![0u8; size as usize];
            let n = self.engine.buffered_read(h.file.id(), offset, &mut buf)?;
            buf.truncate(n);
            Ok((h.file.id(), buf))
        });
        match r {
            Ok((id, buf)) => {
                // Before the reply, as touch_atime runs inside read(2): a stat right
                // after the read sees the new atime.
                self.atime(id);
                reply.data(&buf);
            }
            Err(e) => reply.error(self.fail("read", &e)),
        }
    }

    fn write(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: fuser::WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyWrite,
    ) {
        // FUSE_HANDLE_KILLPRIV_V2: the kernel flags writes by callers without
        // CAP_FSETID, and the set-user-ID bits are ours to take.
        // Asked only for a set-group-ID file without group execute.
        let in_group = |g: u32| self.caller_in_group(req, &caller_creds(req.pid()).1, g);
        let opts = WriteOpts {
            kill_suidgid: write_flags.contains(fuser::WriteFlags::FUSE_WRITE_KILL_SUIDGID),
            in_group: Some(&in_group),
            no_cmtime: false,
        };
        let r = self.writable().and_then(|()| self.handle(fh)).and_then(|h| {
            self.engine.buffered_write_opts(h.file.id(), offset, data, opts).map(|()| h.file.id())
        });
        match r {
            Ok(id) => {
                // The kernel's cached mode keeps what it thinks stays (set-group-ID
                // without group execute): tell it what the write took.
                if opts.kill_suidgid {
                    self.invalidate_attrs(id);
                }
                reply.written(data.len() as u32)
            }
            Err(e) => reply.error(self.fail("write", &e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: fuser::LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        match self.release_handle(fh) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("release", &e)),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // The file's dirty pages, then the log tree, or a commit where the log cannot
        // hold the file (Engine::fsync). fdatasync logs the same as fsync.
        let r = if self.opts.read_only {
            Ok(())
        } else {
            self.id(ino).and_then(|id| self.engine.fsync(id).map(|_| ()))
        };
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("fsync", &e)),
        }
    }

    fn opendir(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        // ENOSYS: the kernel opens directories without asking from now on
        // (`fc->no_opendir`), with the flags we would give (FOPEN_KEEP_CACHE |
        // FOPEN_CACHE_DIR), and sends no RELEASEDIR; readdir needs no handle.
        reply.error(Errno::ENOSYS);
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        match self.listing(ino, offset) {
            Ok((id, list)) => {
                let mut any = false;
                for (off, e) in dirents(&list, offset) {
                    any = true;
                    let (n, kind, name): (u64, FileType, &[u8]) = match e {
                        None => (ino.0, FileType::Directory, if off == 1 { b"." } else { b".." }),
                        Some(e) => match self.node_of(id, e) {
                            Ok(f) => (f, ft_type(e.ftype), &e.name),
                            Err(err) => {
                                let _ = self.fail("readdir", &err);
                                continue;
                            }
                        },
                    };
                    if reply.add(INodeNo(n), off, kind, OsStr::from_bytes(name)) {
                        break;
                    }
                }
                if !any {
                    self.listing_done(id);
                }
                reply.ok();
                self.atime(id);
            }
            Err(e) => reply.error(self.fail("readdir", &e)),
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        match self.listing(ino, offset) {
            Ok((id, list)) => {
                let mut any = false;
                for (off, e) in dirents(&list, offset) {
                    any = true;
                    let Some(e) = e else {
                        // `.` and `..` carry no attributes the kernel keeps: it looks
                        // them up itself.
                        let attr = match self.getattr_node(ino, id) {
                            Ok((a, _)) => a,
                            Err(err) => {
                                reply.error(self.fail("readdirplus", &err));
                                return;
                            }
                        };
                        let zero = Duration::ZERO;
                        if reply.add(
                            INodeNo(0),
                            off,
                            if off == 1 { "." } else { ".." },
                            &zero,
                            &attr,
                            Generation(0),
                        ) {
                            break;
                        }
                        continue;
                    };
                    let (attr, generation) = match self.getattr_entry(id, e) {
                        Ok(x) => x,
                        Err(err) => {
                            let _ = self.fail("readdirplus", &err);
                            continue;
                        }
                    };
                    // The kernel holds a lookup for every entry it takes.
                    self.engine.count_lookups(e.target, 1);
                    if reply.add(
                        attr.ino,
                        off,
                        OsStr::from_bytes(&e.name),
                        &TTL,
                        &attr,
                        Generation(generation),
                    ) {
                        // Not sent: the kernel never saw it.
                        let _ = self.engine.forget(e.target, 1);
                        break;
                    }
                }
                if !any {
                    self.listing_done(id);
                }
                reply.ok();
                self.atime(id);
            }
            Err(e) => reply.error(self.fail("readdirplus", &e)),
        }
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        match self.release_handle(fh) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("releasedir", &e)),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // The directory's changed entries and what their replay needs go into the log
        // tree, or a commit where the log cannot hold them (Engine::fsync): the new
        // files named are logged as existing, empty unless fsynced themselves, as the
        // kernel's directory fsync leaves them.
        let r = if self.opts.read_only {
            Ok(())
        } else {
            self.id(ino).and_then(|id| self.engine.fsync(id).map(|_| ()))
        };
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("fsyncdir", &e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match self.engine.statfs() {
            Ok(s) => reply
                .statfs(s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.bsize),
            Err(e) => reply.error(self.fail("statfs", &e)),
        }
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let r = self.id(ino).and_then(|id| {
            self.writable()?;
            let kill_sgid = self.acl_kills_sgid(req, id, name_of(name), value)?;
            self.engine.setxattr(id, name_of(name), value, flags as u32, kill_sgid)
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("setxattr", &e)),
        }
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        match self
            .id(ino)
            .and_then(|id| self.engine.read(|l| l.getxattr_sized(id, name_of(name), size as usize)))
        {
            Ok(XattrReply::Size(n)) => reply.size(n as u32),
            Ok(XattrReply::Data(d)) => reply.data(&d),
            Err(e) => reply.error(self.fail("getxattr", &e)),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        match self.id(ino).and_then(|id| self.engine.read(|l| l.listxattr_sized(id, size as usize)))
        {
            Ok(XattrReply::Size(n)) => reply.size(n as u32),
            Ok(XattrReply::Data(d)) => reply.data(&d),
            Err(e) => reply.error(self.fail("listxattr", &e)),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = self.id(ino).and_then(|id| {
            self.writable()?;
            self.engine.removexattr(id, name_of(name))
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("removexattr", &e)),
        }
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        // default_permissions: the kernel has checked.
        reply.ok();
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let a = self.new_attrs(req, S_IFREG | (mode & 0o7777));
        let r = self
            .make_and_open(parent, |dir| self.engine.create_file(dir, name_of(name), &a, umask));
        self.reply_created(reply, "create", r);
    }

    /// open(O_TMPFILE): `Engine::tmpfile` (nlink 0 and an orphan item until a link
    /// names it), owned, moded and given ACLs as `create` makes a file, and opened. The
    /// reply's nlink 0 is what the kernel's FUSE keeps (it instantiates the inode as it
    /// is, where btrfs's own `d_tmpfile` takes the count from 1 to 0), and its VFS then
    /// allows a linkat of it unless it was opened with O_EXCL (ENOENT, as on btrfs).
    fn tmpfile(
        &self,
        req: &Request,
        parent: INodeNo,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let a = self.new_attrs(req, S_IFREG | (mode & 0o7777));
        let r = self.make_and_open(parent, |dir| self.engine.tmpfile(dir, &a, umask));
        self.reply_created(reply, "tmpfile", r);
    }

    /// statx(2) beyond the basic stats: GETATTR's attributes and the birth time, the
    /// inode item's otime (`btrfs_getattr`'s STATX_BTIME). The kernel's btrfs also
    /// reports stx_attributes and STATX_SUBVOL, which the kernel's FUSE (6.18) does not
    /// carry; it fills STATX_MNT_ID itself.
    fn statx(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: Option<FileHandle>,
        _flags: u32,
        _mask: u32,
        reply: ReplyStatx,
    ) {
        match self.id(ino).and_then(|id| self.getattr_node(ino, id)) {
            Ok((attr, _)) => reply.statx(&TTL, &attr, &StatxExtra { btime: Some(attr.crtime) }),
            Err(e) => reply.error(self.fail("statx", &e)),
        }
    }

    fn ioctl(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: fuser::IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: ReplyIoctl,
    ) {
        let r = self.id(ino).and_then(|id| {
            if (cmd >> 8) & 0xff == crate::subvol_ioctl::BTRFS_IOCTL_MAGIC {
                self.btrfs_ioctl(req, id, cmd, in_data, out_size)
            } else if cmd == crate::trim_ioctl::FITRIM {
                self.fitrim_ioctl(req, in_data, out_size)
            } else {
                self.flags_ioctl(id, cmd, in_data, out_size)
            }
        });
        match r {
            Ok(out) => reply.ioctl(0, &out),
            Err(e) => reply.error(self.fail("ioctl", &e)),
        }
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let r = self.id(ino).and_then(|id| {
            self.writable()?;
            self.file_modified(req, id)?;
            self.engine.fallocate(id, mode as u32, offset, length)
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("fallocate", &e)),
        }
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let r = self.id(ino).and_then(|id| {
            // Only SEEK_DATA and SEEK_HOLE reach us; the kernel's btrfs (6.18, measured)
            // seeks from 0 for a negative offset: SEEK_DATA finds the first data,
            // SEEK_HOLE the first hole or EOF.
            self.engine.seek_data_hole(id, u64::try_from(offset).unwrap_or(0), whence)
        });
        match r {
            Ok(Some(at)) => reply.offset(at as i64),
            Ok(None) => reply.error(Errno::ENXIO),
            Err(e) => reply.error(self.fail("lseek", &e)),
        }
    }

    fn copy_file_range(
        &self,
        req: &Request,
        _ino_in: INodeNo,
        fh_in: FileHandle,
        offset_in: u64,
        _ino_out: INodeNo,
        fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: fuser::CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        // A clone where the range allows one (the kernel's btrfs shares extents for
        // copy_file_range too), else a copy through the engine.
        let r = (|| {
            self.writable()?;
            let (src, dst) = (self.handle(fh_in)?, self.handle(fh_out)?);
            self.file_modified(req, dst.file.id())?;
            // One reply carries at most u32::MAX bytes; the caller loops for more.
            let len = len.min(u64::from(u32::MAX) / MAX_WRITE as u64 * MAX_WRITE as u64);
            if let Some(n) = self.engine.clone_for_copy(
                src.file.id(),
                offset_in,
                len,
                dst.file.id(),
                offset_out,
            )? {
                return Ok(n as u32);
            }
            let mut buf = vec![0u8; len.min(u64::from(MAX_WRITE)) as usize];
            let mut done = 0u64;
            while done < len {
                let want = (len - done).min(buf.len() as u64) as usize;
                let n =
                    self.engine.buffered_read(src.file.id(), offset_in + done, &mut buf[..want])?;
                if n == 0 {
                    break;
                }
                self.engine.buffered_write(dst.file.id(), offset_out + done, &buf[..n])?;
                done += n as u64;
            }
            Ok(done as u32)
        })();
        match r {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(self.fail("copy_file_range", &e)),
        }
    }
}

/// What /proc says of a caller: whether it holds CAP_FSETID in its effective set
/// (`capable(CAP_FSETID)`), and its supplementary groups. A process gone or unreadable
/// holds nothing: its set-user-ID bits are taken, as for any caller the kernel cannot
/// vouch for.
pub(crate) fn caller_creds(pid: u32) -> (bool, Vec<u32>) {
    const CAP_FSETID: u32 = 4;
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return (false, Vec::new());
    };
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
    let fsetid = field("CapEff:")
        .and_then(|v| u64::from_str_radix(v, 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_FSETID) != 0);
    let groups = field("Groups:")
        .map(|v| v.split_whitespace().filter_map(|g| g.parse().ok()).collect())
        .unwrap_or_default();
    (fsetid, groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_before_1970_keep_the_kernels_seconds_and_nanoseconds() {
        // What fuser 0.18 makes of a SETATTR time of -5 s and 300 ns.
        let from_fuser = UNIX_EPOCH - Duration::new(5, 300);
        assert_eq!(sent_timespec(from_fuser), (-5, 300));
        assert_eq!(sent_timespec(UNIX_EPOCH + Duration::new(7, 9)), (7, 9));
        // And the reply: -5 s + 300 ns is 4.9999997 s before the epoch.
        let t = Timespec { sec: ((-5i64) as u64).into(), nsec: 300.into() };
        assert_eq!(
            UNIX_EPOCH.duration_since(system_time(&t)).unwrap(),
            Duration::new(4, 999_999_700)
        );
    }
}
