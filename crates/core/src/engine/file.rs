//! Open files and the namespace changes that must know about them, through the engine
//! (the kernel's file open and release, and the VFS side of unlink, lookup and forget).
//!
//! An `OpenFile` counts in its inode's open count (`inode_cache`) from `open_file` to
//! `close` (or its drop). While an inode is open or looked up it is *in use*, and an
//! unlink of its last name through `Engine::unlink` leaves it an orphan (nlink 0 plus an
//! ORPHAN_ITEM, see `orphan`) that reads and writes through the handle still reach;
//! the last close drops it. `FsWriter::unlink` called directly knows nothing of open
//! files and drops the inode at once: callers with open files use `Engine::unlink`.
//!
//! Locks: an operation takes the inode locks it needs (two in `InodeId` order), then the
//! engine's lock, never the other way round; the in-use check of an unlink and the
//! count changes of open, close and forget all happen under the inode's lock, so an
//! inode cannot be opened between an unlink's check and its drop.

use crate::data::write::WritePlan;
use crate::engine::Engine;
use crate::error::{Error, PosixKind, Result};
use crate::inode::file::{read_lock, write_lock, write_lock_two};
use crate::inode::filesystem::{DirEntry, FsRead, InodeId, Load};
use crate::inode::inode_cache::Inode;
use std::sync::Arc;

impl Engine {
    /// Write `data` at `offset` of regular file `id` (as `FsWriter::write_file`), holding
    /// the inode's lock throughout. A write that needs no old data (whole sectors, or
    /// running past EOF) and makes no inline file writes its data without the engine's
    /// lock (`FsWriter::begin_write`); readers and changes to other inodes go on
    /// meanwhile, and see the old contents until the new extents are in.
    ///
    /// # Errors
    /// As `FsWriter::write_file`; `Io` from the data write (the reserved space is given
    /// back, the file is unchanged).
    pub fn write_file(&self, id: InodeId, offset: u64, data: &[u8]) -> Result<()> {
        let _rsv = self.reserve_direct_write(id, offset, data.len())?;
        let inode = self.inodes.get(id);
        let _g = write_lock(&inode);
        self.write_file_locked(id, offset, data)
    }

    /// A direct write's data space, held beside what dirty data was promised (the
    /// write itself checks only that its own bytes are free).
    pub(crate) fn reserve_direct_write(
        &self,
        id: InodeId,
        offset: u64,
        len: usize,
    ) -> Result<Option<crate::space::data_rsv::DataReservation<'_>>> {
        let bs = u64::from(self.info().sectorsize);
        match offset.checked_add(len as u64) {
            Some(end) if len > 0 => {
                Ok(Some(self.reserve_data_space(id, offset / bs * bs, end.div_ceil(bs) * bs)?))
            }
            // Nothing to hold; the write reports a bad range itself.
            _ => Ok(None),
        }
    }

    /// `write_file` with the inode's lock held: a file with a page cache is written
    /// back first and the folios of the range are dropped after.
    pub(crate) fn write_file_locked(&self, id: InodeId, offset: u64, data: &[u8]) -> Result<()> {
        let inode = self.inodes.get(id);
        let end = offset.saturating_add(data.len() as u64);
        self.extent_change(&inode, offset, end, || self.write_file_raw(id, offset, data, false))
    }

    /// The direct write itself (the inode's lock held, the page cache not looked at).
    pub(crate) fn write_file_raw(
        &self,
        id: InodeId,
        offset: u64,
        data: &[u8],
        writing_back: bool,
    ) -> Result<()> {
        // Both runs read what they miss without the lock until they begin a change.
        let plan = self.write_retrying(|w| {
            w.as_writeback(writing_back, |w| {
                w.begin_write(id.root, id.ino, offset, data.len() as u64)
            })
        })?;
        let mut dw = match plan {
            WritePlan::Locked => {
                return self.write_retrying(|w| {
                    w.as_writeback(writing_back, |w| w.write_file(id.root, id.ino, offset, data))
                })
            }
            WritePlan::Direct(dw) => dw,
        };
        // Neither side of the engine's lock is held here; the inode's lock is.
        match dw.write_data(self.info(), data) {
            Ok(()) => self.write(|w| w.as_writeback(writing_back, |w| w.finish_write(dw))),
            Err(e) => {
                self.write(|w| {
                    w.cancel_write(dw);
                    Ok(())
                })?;
                Err(e)
            }
        }
    }

    /// Open inode `id` (the kernel's file open): counts in its open count until the
    /// handle is closed. An inode with no name left that is not in use is on its way
    /// out and cannot be opened.
    ///
    /// # Errors
    /// `Posix(NotFound)` for no such inode, or an unlinked one; read failures.
    pub fn open_file(&self, id: InodeId) -> Result<OpenFile<'_>> {
        let inode = self.open_inode(id)?;
        Ok(OpenFile { engine: EngineRef::Borrowed(self), inode: Some(inode) })
    }

    /// `open_file` on a shared engine: the handle keeps the engine alive and borrows
    /// nothing.
    ///
    /// # Errors
    /// As `open_file`.
    pub fn open_file_shared(self: &Arc<Self>, id: InodeId) -> Result<OpenFile<'static>> {
        let inode = self.open_inode(id)?;
        Ok(OpenFile { engine: EngineRef::Shared(self.clone()), inode: Some(inode) })
    }

    fn open_inode(&self, id: InodeId) -> Result<Arc<Inode>> {
        let inode = self.inodes.get(id);
        {
            let _g = read_lock(&inode);
            let nlink = self.read(|live| Ok(live.load_inode(id, Load::ITEM)?.nlink()))?;
            if nlink == 0 && !inode.in_use() {
                return Err(Error::posix_detail(
                    PosixKind::NotFound,
                    id.to_string(),
                    "the inode is unlinked and waits for its removal",
                ));
            }
            inode.get_open();
        }
        Ok(inode)
    }

    /// Count `n` more lookups of inode `id`, as the FUSE kernel counts `nlookup` for
    /// every entry it is given (a create, mkdir, mknod, symlink or link reply, each
    /// readdirplus entry); `forget` drops them. `lookup` counts its own.
    pub fn count_lookups(&self, id: InodeId, n: u64) {
        if n > 0 {
            self.inodes.get(id).get_lookups(n);
        }
    }

    /// Remove name `name` from directory `dir`, as `FsWriter::unlink` does, except that
    /// an inode in use (open or looked up) whose last name this is stays as an orphan
    /// until it is no longer in use.
    ///
    /// # Errors
    /// As `FsWriter::unlink`; `Posix(Busy)` if the name kept changing target under us.
    pub fn unlink(&self, dir: InodeId, name: &[u8]) -> Result<()> {
        self.remove_entry(dir, name, false)
    }

    /// Remove the empty directory `name` from `dir`, as `FsWriter::rmdir` does, with
    /// the inode locks `unlink` takes.
    ///
    /// # Errors
    /// As `FsWriter::rmdir`; `Posix(Busy)` as `unlink`.
    pub fn rmdir(&self, dir: InodeId, name: &[u8]) -> Result<()> {
        self.remove_entry(dir, name, true)
    }

    fn remove_entry(&self, dir_id: InodeId, name: &[u8], rmdir: bool) -> Result<()> {
        let InodeId { root, ino: dir } = dir_id;
        for _ in 0..UNLINK_ATTEMPTS {
            let Some(entry) = self.read(|live| live.lookup(dir_id, name))? else {
                return Err(Error::posix(PosixKind::NotFound, crate::quote::name(name)));
            };
            let dir_inode = self.inodes.get(dir_id);
            // A subvolume's entry is refused by the unlink itself; its root directory
            // is not this operation's to lock.
            let child = (!entry.is_subvol).then(|| self.inodes.get(entry.target));
            let done = {
                let _locks = write_lock_two(&dir_inode, child.as_deref());
                self.write_retrying(|w| {
                    let now = w.live().lookup(dir_id, name)?;
                    if now.map(|e| e.target) != Some(entry.target) {
                        return Ok(false);
                    }
                    if rmdir {
                        w.rmdir(root, dir, name)?;
                    } else {
                        w.unlink(root, dir, name)?;
                    }
                    Ok(true)
                })?
            };
            if done {
                drop(child);
                self.discard_if_gone(entry.target);
                self.inodes.forget_unused(entry.target);
                return Ok(());
            }
        }
        Err(Error::posix_detail(
            PosixKind::Busy,
            crate::quote::name(name),
            "the name kept changing while it was being removed",
        ))
    }

    /// Inode `id` was read (data, entries, link target): move its atime as `opts`
    /// say (`FsWriter::file_accessed`). Returns whether it moved. The common case, no
    /// update, is decided on the live view without the engine's write side.
    ///
    /// # Errors
    /// As `FsWriter::file_accessed`.
    pub fn file_accessed(&self, id: InodeId, opts: crate::inode::atime::AtimeOpts) -> Result<bool> {
        let t = self.info().sources.clock.now();
        let now =
            ubtrfs_format::structs::Timespec { sec: (t.sec as u64).into(), nsec: t.nsec.into() };
        if !self.read(|live| {
            Ok(crate::inode::atime::atime_needs_update(
                &live.load_inode(id, Load::ITEM)?.item,
                now,
                opts,
            ))
        })? {
            return Ok(false);
        }
        self.write_retrying(|w| w.file_accessed(id, opts))
    }

    /// Change inode `id`'s attributes, as `FsWriter::setattr` does, holding its lock:
    /// a truncation waits for the file's writes in flight, and they for it.
    ///
    /// # Errors
    /// As `FsWriter::setattr`.
    pub fn setattr(&self, id: InodeId, a: &crate::inode::attr::SetAttr) -> Result<()> {
        let inode = self.inodes.get(id);
        let _g = write_lock(&inode);
        // The size the file has is the page cache's when it knows one: a new size
        // moves mtime (btrfs_setsize), also when the trees' size already is the new
        // one (an open(O_TRUNC) of a file whose data is all dirty).
        // The size it already has changes nothing, not even the times, also when the
        // trees do not have it yet (data written and not yet written back): the size
        // is left to writeback, and a truncate(2) asking nothing else is done.
        let mut a = *a;
        let cached = inode.mapping.pages.lock().i_size;
        if let (Some(new), Some(cur)) = (a.size, cached) {
            if new != cur && a.mtime.is_none() {
                a.mtime = Some(crate::inode::attr::TimeSet::Now);
            }
            if new == cur {
                a.size = None;
                if a == crate::inode::attr::SetAttr::default() {
                    return Ok(());
                }
            }
        }
        let a = &a;
        self.write_retrying(|w| w.setattr(id, a))?;
        if let Some(size) = a.size {
            // The trees have the new size: the cache follows (see `page_cache`).
            self.truncate_page_cache(&inode, size);
        }
        Ok(())
    }

    /// Preallocate, punch or zero a range of file `id`, as `FsWriter::fallocate` does,
    /// holding the inode's lock: the file's writes in flight finish first.
    ///
    /// # Errors
    /// As `FsWriter::fallocate`.
    pub fn fallocate(&self, id: InodeId, mode: u32, offset: u64, len: u64) -> Result<()> {
        match self.fallocate_once(id, mode, offset, len) {
            // As a buffered write does (an rm of a big file just before frees what
            // only a commit gives back). A refused fallocate changed nothing.
            Err(e) if e.posix_kind() == Some(PosixKind::NoSpace) => {
                self.flush_data_space()?;
                self.fallocate_once(id, mode, offset, len)
            }
            r => r,
        }
    }

    fn fallocate_once(&self, id: InodeId, mode: u32, offset: u64, len: u64) -> Result<()> {
        let inode = self.inodes.get(id);
        let _g = write_lock(&inode);
        self.extent_change(&inode, offset, offset.saturating_add(len), || {
            self.write_retrying(|w| w.fallocate(id, mode, offset, len))
        })
    }

    /// Rename, as `FsWriter::rename` does, holding the locks of the inodes involved
    /// (both directories, the source, and a target it replaces or swaps with), taken in
    /// inode order, so no data write to a replaced file runs across its removal.
    ///
    /// # Errors
    /// `Posix(CrossDevice)` for directories in two subvolumes; as `FsWriter::rename`;
    /// `Posix(Busy)` if the names kept changing under us.
    pub fn rename(
        &self,
        od: InodeId,
        old_name: &[u8],
        nd: InodeId,
        new_name: &[u8],
        flags: u32,
    ) -> Result<()> {
        if od.root != nd.root {
            return Err(Error::posix(PosixKind::CrossDevice, "rename across subvolumes"));
        }
        let (root, old_dir, new_dir) = (od.root, od.ino, nd.ino);
        for _ in 0..UNLINK_ATTEMPTS {
            let (src, dst) =
                self.read(|live| Ok((live.lookup(od, old_name)?, live.lookup(nd, new_name)?)))?;
            let mut ids = vec![od, nd];
            ids.extend(src.iter().chain(dst.iter()).filter(|e| !e.is_subvol).map(|e| e.target));
            ids.sort();
            ids.dedup();
            let inodes: Vec<Arc<Inode>> = ids.iter().map(|&id| self.inodes.get(id)).collect();
            let done = {
                let _locks: Vec<_> = inodes.iter().map(|i| write_lock(i)).collect();
                self.write_retrying(|w| {
                    let now = (
                        w.live().lookup(od, old_name)?.map(|e| e.target),
                        w.live().lookup(nd, new_name)?.map(|e| e.target),
                    );
                    if now != (src.as_ref().map(|e| e.target), dst.as_ref().map(|e| e.target)) {
                        return Ok(false);
                    }
                    w.rename(root, old_dir, old_name, new_dir, new_name, flags)?;
                    Ok(true)
                })?
            };
            if done {
                drop(inodes);
                if let Some(d) = dst {
                    self.discard_if_gone(d.target);
                    self.inodes.forget_unused(d.target);
                }
                return Ok(());
            }
        }
        Err(Error::posix_detail(
            PosixKind::Busy,
            crate::quote::name(old_name),
            "the names kept changing while it was being renamed",
        ))
    }

    /// Look `name` up in directory `dir` and count one lookup of the inode found, as the
    /// FUSE kernel counts `nlookup`: the inode is in use until `forget` drops the count.
    ///
    /// # Errors
    /// As `FsRead::lookup`.
    pub fn lookup(&self, dir: InodeId, name: &[u8]) -> Result<Option<DirEntry>> {
        // btrfs_lookup: no name is longer than BTRFS_NAME_LEN.
        if name.len() > ubtrfs_format::structs::NAME_LEN {
            return Err(Error::posix(PosixKind::NameTooLong, crate::quote::name(name)));
        }
        let d = self.inodes.get(dir);
        let _g = read_lock(&d);
        let e = self.read(|live| live.lookup(dir, name))?;
        if let Some(e) = &e {
            self.inodes.get(e.target).get_lookups(1);
        }
        Ok(e)
    }

    /// Look inode `id` itself up (FUSE's lookup of `.`, which the kernel sends to
    /// decode a file handle of an inode it no longer holds) and count one lookup. What
    /// `btrfs_get_dentry` would not find is gone: no INODE_ITEM, an inode with no name
    /// left that is not in use (an orphan waiting for its removal), or an inode of a
    /// deleted subvolume (ROOT_ITEM refs 0, which `btrfs_get_fs_root` refuses).
    ///
    /// # Errors
    /// `Posix(NotFound)` for an inode that is gone; read failures.
    pub fn lookup_inode(&self, id: InodeId) -> Result<()> {
        let inode = self.inodes.get(id);
        // Under the inode's lock, as `open_inode`: an unlink of its last name comes
        // wholly before (and then it is gone unless in use) or after (and sees it in use).
        let _g = read_lock(&inode);
        let (refs, nlink) = self.read(|live| {
            Ok((
                crate::tree::search::TreeView::read_root(live, id.root)?.1.refs.get(),
                live.load_inode(id, Load::ITEM)?.nlink(),
            ))
        })?;
        if refs == 0 || (nlink == 0 && !inode.in_use()) {
            return Err(Error::posix_detail(
                PosixKind::NotFound,
                id.to_string(),
                "the inode is unlinked or its subvolume deleted",
            ));
        }
        inode.get_lookups(1);
        Ok(())
    }

    /// Inode `id`'s attributes (its INODE_ITEM) as the live view shows them. The first
    /// call reads the item and keeps it in the in-memory inode; later calls read no tree
    /// while the inode stays cached (the writer keeps the copy current).
    ///
    /// # Errors
    /// `Posix(NotFound)` for no such inode; as `FsRead::load_inode`.
    pub fn getattr(&self, id: InodeId) -> Result<ubtrfs_format::structs::InodeItem> {
        let inode = self.inodes.get(id);
        // A page cache's in-memory size runs ahead of the INODE_ITEM's, and its dirty
        // blocks over holes count in the bytes (st_blocks) as the kernel's new delalloc
        // bytes do (read with the item: a completion moves them into nbytes).
        let cached_size = inode.mapping.pages.lock().i_size;
        let with_size = |mut a: ubtrfs_format::structs::InodeItem, delalloc: u64| {
            if let Some(s) = cached_size {
                a.size = s.into();
            }
            a.nbytes = (a.nbytes.get() + delalloc).into();
            a
        };
        // The times are handed out: the next write must show as a change, so it takes
        // a fine time (marked after the read, so a write in between cannot take the
        // mark this reading needs).
        if let (Some(a), delalloc) = inode.attrs_and_new_delalloc() {
            inode.mark_ctime_queried();
            return Ok(with_size(a, delalloc));
        }
        let a = self.read(|live| {
            let item = live.load_inode(id, Load::ITEM)?.item;
            // Under the engine's shared side: no change can come between the read and
            // the copy (nor a completion's move of delalloc bytes into nbytes).
            inode.set_attrs(Some(item));
            Ok(with_size(item, inode.new_delalloc()))
        })?;
        inode.mark_ctime_queried();
        Ok(a)
    }

    /// Drop `n` lookups of inode `id` (FUSE's forget). When it is no longer in use and
    /// has no name left, it is dropped.
    ///
    /// # Errors
    /// As `FsWriter::evict_if_unlinked`.
    pub fn forget(&self, id: InodeId, n: u64) -> Result<()> {
        let Some(inode) = self.inodes.lookup(id) else { return Ok(()) };
        let dropped = {
            let _g = write_lock(&inode);
            inode.put_lookups(n);
            if inode.in_use() {
                false
            } else {
                self.write(|w| w.evict_if_unlinked(id))?
            }
        };
        drop(inode);
        if dropped {
            self.discard_page_cache(id);
            self.inodes.forget_unused(id);
        } else {
            // No longer in use: evictable again.
            self.inodes.unpin(id);
        }
        Ok(())
    }

    /// Drop every lookup the FUSE kernel holds, as `forget` does for each: at the end
    /// of a mount's session the kernel holds nothing, and it does not always say so (a
    /// FUSE superblock that goes without DESTROY, after a lazy unmount, aborts the
    /// connection with its last FORGETs unsent). An inode with no name left that is not
    /// open either (an O_TMPFILE file never linked, a file unlinked while open) is then
    /// dropped, as the kernel's btrfs drops it at its last iput. Every inode is tried;
    /// the first error is returned.
    ///
    /// # Errors
    /// As `forget`.
    pub fn forget_all(&self) -> Result<()> {
        let mut first = Ok(());
        for (id, n) in self.inodes.looked_up() {
            if let Err(e) = self.forget(id, n) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    /// Errors of handles dropped without `close`, oldest first, and how many more were
    /// not kept; clears them.
    pub fn take_close_errors(&self) -> (Vec<String>, u64) {
        self.inodes.close_errors.take()
    }

    /// Set how many inodes not in use stay in memory (`DEFAULT_INODE_CACHE_CAPACITY`).
    pub fn set_inode_cache_capacity(&self, n: usize) {
        self.inodes.set_capacity(n);
    }
}

/// Attempts of an unlink whose name changed target between its lookup and its locks
/// (another writer replaced it) before it gives up with EBUSY.
const UNLINK_ATTEMPTS: usize = 16;

/// An open file (or directory): reads and writes reach its inode even after its last
/// name is gone. Close it with `close`; a drop closes too, recording any error in the
/// engine (`Engine::take_close_errors`).
pub struct OpenFile<'a> {
    engine: EngineRef<'a>,
    /// None once closed.
    inode: Option<Arc<Inode>>,
}

/// The engine an `OpenFile` uses: borrowed (`Engine::open_file`), or shared
/// (`Engine::open_file_shared`), for a handle that lives in a table of its own, as a
/// mount's file handles do.
enum EngineRef<'a> {
    Borrowed(&'a Engine),
    Shared(Arc<Engine>),
}

impl std::ops::Deref for EngineRef<'_> {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        match self {
            EngineRef::Borrowed(e) => e,
            EngineRef::Shared(e) => e,
        }
    }
}

impl std::fmt::Debug for OpenFile<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenFile").field("inode", &self.inode.as_ref().map(|i| i.id)).finish()
    }
}

impl OpenFile<'_> {
    fn inode(&self) -> &Arc<Inode> {
        self.inode.as_ref().expect("an OpenFile is usable until it is closed, which consumes it")
    }

    /// The inode this handle has open.
    pub fn id(&self) -> InodeId {
        self.inode().id
    }

    /// Read up to `buf.len()` bytes at `offset`; returns how many (0 at or past EOF).
    ///
    /// # Errors
    /// `Posix(IsDir)` / `Posix(Invalid)` for a directory or another non-regular inode;
    /// read failures.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let inode = self.inode();
        let _g = read_lock(inode);
        self.engine.read_file(inode.id, offset, buf)
    }

    /// Write `data` at `offset` (as `FsWriter::write_file`).
    ///
    /// # Errors
    /// As `FsWriter::write_file`.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        let _rsv = self.engine.reserve_direct_write(self.inode().id, offset, data.len())?;
        let inode = self.inode();
        let _g = write_lock(inode);
        self.engine.write_file_locked(inode.id, offset, data)
    }

    /// Close the handle. The last close of an inode with no name left, not looked up
    /// either, drops it with everything it owns and deletes its orphan item.
    ///
    /// # Errors
    /// As `FsWriter::evict_if_unlinked`: the handle is closed all the same, and the
    /// orphan stays on disk for the next writable open to clean.
    pub fn close(mut self) -> Result<()> {
        self.release()
    }

    fn release(&mut self) -> Result<()> {
        let Some(inode) = self.inode.take() else { return Ok(()) };
        let id = inode.id;
        let dropped = {
            let _g = write_lock(&inode);
            if inode.put_open() && !inode.in_use() {
                self.engine.write(|w| w.evict_if_unlinked(id))
            } else {
                Ok(false)
            }
        };
        drop(inode);
        if let Ok(true) = dropped {
            self.engine.discard_page_cache(id);
            self.engine.inodes.forget_unused(id);
        } else {
            self.engine.inodes.unpin(id);
        }
        dropped.map(|_| ()).map_err(|e| e.at(format!("close {id}")))
    }
}

impl Drop for OpenFile<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            self.engine.inodes.close_errors.record(e.to_string());
        }
    }
}
