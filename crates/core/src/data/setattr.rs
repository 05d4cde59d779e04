//! `setattr` (the kernel's `notify_change` + `btrfs_setattr`): chmod, chown, utimens
//! and truncate in one call, and the size change itself (`btrfs_setsize`:
//! `btrfs_cont_expand` up, `btrfs_truncate` down), which rewrites file data. The
//! attribute types and rules it applies (`SetAttr`, the time rules, what a chown takes)
//! are `inode::attr`'s.
//!
//! Truncation keeps the file's data exact for a later extension: the block holding the
//! new end (down) or the old end (up) is rewritten with its bytes past the end zeroed,
//! as `btrfs_truncate_block` does, so no old byte reappears when the file grows again;
//! extents past the end go, the one across it is trimmed (compressed and shared ones
//! keep their disk extent and lose part of their reference). Without no-holes, growth
//! writes a hole extent over the new range.

use crate::error::{Error, PosixKind, Result};
use crate::inode::attr::{ts, SetAttr, TimeSet, MAX_FILE_SIZE};
use crate::inode::filesystem::{ExtentKind, FsRead, InodeId};
use crate::inode::write::{iflags_allow, IflagOp};
use crate::inode::writer::FsWriter;
use ubtrfs_format::structs::*;

impl FsWriter {
    /// Change inode `id`'s attributes as `chmod`, `chown`, `utimensat` and
    /// `truncate` do (see the module documentation for the time rules and what a
    /// chown takes). Permission checks are the caller's (`perm::may_setattr`).
    ///
    /// # Errors
    /// `Posix`: NotPermitted for an immutable or append-only inode (mode, ids,
    /// explicit times, size), IsDir / Invalid for the size of a directory / other
    /// non-regular file, FileTooBig past `MAX_FILE_SIZE`, NoSpace; tree failures.
    pub fn setattr(&mut self, id: InodeId, a: &SetAttr) -> Result<()> {
        self.check_root_writable(id.root)?;
        // A placeholder's attributes are the kernel's in-memory inode's: its
        // `simple_setattr` succeeds and stores nothing. So do we.
        if id.is_placeholder() {
            return if a.size.is_some() {
                Err(Error::posix_detail(
                    PosixKind::IsDir,
                    id.to_string(),
                    "a directory has no size to set",
                ))
            } else {
                Ok(())
            };
        }
        let ii = self.inode_item(id)?;
        let flags = ii.flags.get();
        if a.touches_protected() && flags & (INODE_IMMUTABLE | INODE_APPEND) != 0 {
            return Err(Error::posix_detail(
                PosixKind::NotPermitted,
                id.to_string(),
                "the inode is immutable or append-only",
            ));
        }
        if (a.atime.is_some() || a.mtime.is_some()) && flags & INODE_IMMUTABLE != 0 {
            return Err(Error::posix_detail(
                PosixKind::NotPermitted,
                id.to_string(),
                "the inode is immutable",
            ));
        }
        if let Some(size) = a.size {
            match ii.mode.get() & S_IFMT {
                S_IFREG => {}
                S_IFDIR => {
                    return Err(Error::posix_detail(
                        PosixKind::IsDir,
                        id.to_string(),
                        "a directory has no size to set",
                    ))
                }
                _ => {
                    return Err(Error::posix_detail(
                        PosixKind::Invalid,
                        id.to_string(),
                        "only a regular file's size can be set",
                    ))
                }
            }
            // vfs_truncate refuses these before the size is looked at.
            iflags_allow(id, flags, IflagOp::Write, b"")?;
            if flags & INODE_APPEND != 0 {
                return Err(Error::posix_detail(
                    PosixKind::NotPermitted,
                    id.to_string(),
                    "an append-only file cannot be truncated",
                ));
            }
            if size > MAX_FILE_SIZE {
                return Err(Error::posix_detail(
                    PosixKind::FileTooBig,
                    id.to_string(),
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
            self.kill_file_caps(id)?;
        }
        let ss = u64::from(self.sectorsize());
        // Truncation rewrites one block and drops extents; growth may insert a hole.
        let items = if a.size.is_some() { 6 + u64::from(self.nodesize()) / ss } else { 1 };
        self.transaction("setattr", items, |w| {
            if let Some(size) = a.size {
                if size != ii.size.get() {
                    w.set_size_inner(id, size)?;
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
            w.update_inode(id, |i| {
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
                w.acl_chmod(id)?;
            }
            Ok(())
        })
    }

    /// Set regular file `id`'s size to `size` (`btrfs_setsize`), without the time
    /// updates (`setattr`'s).
    pub(crate) fn set_size_inner(&mut self, id: InodeId, size: u64) -> Result<()> {
        let InodeId { root, ino } = id;
        let ss = u64::from(self.sectorsize());
        let ii = self.inode_item(id)?;
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
            let removed = self.drop_extents_inner(id, 0, u64::MAX)?;
            if size > 0 {
                self.insert_inline(id, &content)?;
            }
            return self.set_size_and_bytes(id, size, removed, size);
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
            let removed = self.drop_extents_inner(id, size.div_ceil(ss) * ss, u64::MAX)?;
            return self.set_size_and_bytes(id, size, removed, 0);
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
            cur = self.inode_item(id)?;
        }
        self.insert_hole_before(id, cur.size.get(), size.div_ceil(ss) * ss)?;
        self.set_size_and_bytes(id, size, 0, 0)
    }

    fn set_size_and_bytes(
        &mut self,
        id: InodeId,
        size: u64,
        removed: u64,
        added: u64,
    ) -> Result<()> {
        self.update_inode(id, |i| {
            i.size = size.into();
            i.nbytes = (i.nbytes.get() - removed.min(i.nbytes.get()) + added).into();
        })
    }
}
