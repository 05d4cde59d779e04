//! Buffered I/O as the engine serves it: reads through the page cache (filled from the
//! trees on a miss), writes into it with their data space reserved, truncation and
//! the limits that start writeback. The folios and their states are
//! `mapping::page_cache`'s.

use crate::engine::Engine;
use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{FileKind, FsRead, InodeId, Load};
use crate::inode::inode_cache::{lock_exclusive, lock_shared, Inode};
use crate::mapping::page_cache::{
    holes_between, shrink_target, PageCacheInner, PageCacheStats, WriteOpts, FOLIO_SIZE,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Engine {
    /// Set the page cache's bounds (see the module notes): at most `cache_bytes` of
    /// file data cached, at most `dirty_bytes` of it dirty (clamped to `cache_bytes`,
    /// at least one folio each). Applies at once: the cache shrinks and writers past
    /// the dirty limit write back at their next write.
    pub fn set_page_cache_limits(&self, cache_bytes: u64, dirty_bytes: u64) {
        let cache = cache_bytes.max(FOLIO_SIZE);
        self.pages.cache_limit.store(cache, Ordering::Release);
        self.pages.dirty_limit.store(dirty_bytes.clamp(FOLIO_SIZE, cache), Ordering::Release);
        if self.pages.cached.load(Ordering::Acquire) > cache {
            self.drop_clean_folios(shrink_target(cache));
        }
    }

    /// The page cache's totals and counters now.
    pub fn page_cache_stats(&self) -> PageCacheStats {
        let g = &self.pages;
        PageCacheStats {
            cached_bytes: g.cached.load(Ordering::Acquire),
            dirty_bytes: self.data_rsv.dirty(),
            cache_limit: g.cache_limit.load(Ordering::Acquire),
            dirty_limit: g.dirty_limit.load(Ordering::Acquire),
            inodes: g.registry().len() as u64,
            evicted_folios: g.evicted_folios.load(Ordering::Acquire),
            throttle_writebacks: g.throttle_writebacks.load(Ordering::Acquire),
            ordered_finished: g.ordered_finished.load(Ordering::Acquire),
            ordered_truncated: g.ordered_truncated.load(Ordering::Acquire),
        }
    }

    /// Check every cached inode's invariants and that the totals are their sums
    /// (callers make sure no buffered operation runs meanwhile).
    pub fn check_page_cache_invariants(&self) {
        let bs = self.info().sectorsize;
        let held: Vec<Arc<Inode>> =
            self.pages.registry().values().map(|(i, _)| i.clone()).collect();
        let (mut cached, mut dirty) = (0, 0);
        for inode in &held {
            let id = inode.id;
            let pc = inode.mapping.pages.lock();
            pc.check_invariants();
            assert!(
                !pc.folios.is_empty() || !pc.ordered.is_empty(),
                "page cache: registry holds {id} without folios"
            );
            // Outside a writeback (the callers' quiet), new blocks are dirty ones.
            for f in pc.folios.values() {
                assert!(
                    f.new.is_subset_of(&f.dirty),
                    "page cache: {id}: folio {} has new blocks that are not dirty",
                    f.start
                );
            }
            // And a dirty block inside the file is new exactly when the trees have no
            // extent under it.
            let bsz = u64::from(bs);
            let end = pc.i_size.unwrap_or(0).div_ceil(bsz) * bsz;
            let recs =
                self.read(|l| l.file_extents(id, 0, end)).expect("page cache check: file extents");
            let holes = holes_between(&recs, 0, end, bsz);
            for f in pc.folios.values() {
                for b in 0..f.nblocks() {
                    let off = f.start + u64::from(b) * bsz;
                    if off >= end || !f.dirty.test(b) {
                        continue;
                    }
                    let hole = holes.iter().any(|&(s, e)| s <= off && off < e);
                    assert_eq!(
                        f.new.test(b),
                        hole,
                        "page cache: {id}: dirty block {off} is new {} over a hole {hole}",
                        f.new.test(b)
                    );
                }
            }
            let nd = inode.new_delalloc();
            assert_eq!(
                nd,
                pc.new_blocks * u64::from(bs),
                "page cache: {id} counts {nd} new delalloc bytes but has {} new blocks",
                pc.new_blocks
            );
            cached += pc.cached_bytes();
            dirty += pc.dirty_bytes(bs);
        }
        assert_eq!(
            cached,
            self.pages.cached.load(Ordering::Acquire),
            "page cache: cached total differs from the inodes' sum"
        );
        assert_eq!(
            dirty,
            self.data_rsv.dirty(),
            "page cache: dirty total differs from the inodes' sum"
        );
    }

    /// The INODE_ITEM of regular file `id` for a buffered operation (`Posix(IsDir)` /
    /// `Posix(Invalid)` otherwise): the in-memory inode's copy when it has one (the
    /// writer keeps it current), else the tree's.
    fn regular_item(&self, inode: &Inode) -> Result<ubtrfs_format::structs::InodeItem> {
        use ubtrfs_format::structs::{S_IFMT, S_IFREG};
        if let Some(a) = inode.attrs().filter(|a| a.mode.get() & S_IFMT == S_IFREG) {
            return Ok(a);
        }
        let id = inode.id;
        self.read(|l| {
            let v = l.load_inode(id, Load::ITEM)?;
            match v.kind() {
                // Kept in the in-memory inode, as `getattr` keeps it (under the
                // engine's shared side, so it matches the live view): the writeback's
                // delalloc and completion read it there.
                FileKind::File => {
                    inode.set_attrs(Some(v.item));
                    Ok(v.item)
                }
                FileKind::Dir => Err(Error::posix(PosixKind::IsDir, id.to_string())),
                _ => Err(Error::posix(PosixKind::Invalid, format!("{id} is not a regular file"))),
            }
        })
    }

    /// Make the blocks of [start, end) of folio `fstart` uptodate, reading those that
    /// are not from the trees (bytes past the on-disk size read as zeros).
    fn fill_folio(
        &self,
        id: InodeId,
        pc: &mut PageCacheInner,
        fstart: u64,
        start: u64,
        end: u64,
    ) -> Result<()> {
        let bs = u64::from(self.info().sectorsize);
        let disk = pc.disk_i_size;
        let f = pc.folios.get_mut(&fstart).expect("folio present");
        let mut b = f.block_of(start);
        let last = ((end - f.start).div_ceil(bs)) as u32;
        while b < last {
            let s = f.uptodate.find_next(b, false);
            if s >= last {
                break;
            }
            let e = f.uptodate.find_next(s, true).min(last);
            let (off, len) = (u64::from(s) * bs, u64::from(e - s) * bs);
            let buf = &mut f.data[off as usize..(off + len) as usize];
            let n = if f.start + off < disk { self.read_file(id, f.start + off, buf)? } else { 0 };
            buf[n..].fill(0);
            f.uptodate.set_range(s, e - s);
            b = e;
        }
        Ok(())
    }

    /// Read file `id` at `offset` into `buf` through the page cache; returns the bytes
    /// read (short at the in-memory EOF). Dirty data is seen; misses are filled from
    /// the trees (`Engine::read_file`) and stay cached.
    ///
    /// # Errors
    /// `Posix(IsDir)` / `Posix(Invalid)` for a directory or another non-regular inode;
    /// as `Engine::read_file`.
    pub fn buffered_read(&self, id: InodeId, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let inode = self.inodes().get(id);
        let _g = lock_shared(&inode);
        let ii = self.regular_item(&inode)?;
        let bs = self.info().sectorsize;
        let r = with_cache(self, &inode, |pc| -> Result<usize> {
            if pc.i_size.is_none() {
                pc.i_size = Some(ii.size.get());
                pc.disk_i_size = ii.size.get();
                pc.new_from = ii.size.get();
            }
            let size = pc.i_size.expect("set above");
            if offset >= size || buf.is_empty() {
                return Ok(0);
            }
            let end = offset + (buf.len() as u64).min(size - offset);
            let mut cur = offset;
            while cur < end {
                let fstart = cur / FOLIO_SIZE * FOLIO_SIZE;
                let fend = (fstart + FOLIO_SIZE).min(end);
                pc.folios.slot_folio(fstart, fend, bs);
                self.fill_folio(id, pc, fstart, cur, fend)?;
                let f = pc.folios.get_mut(&fstart).expect("inserted above");
                f.last_use = self.pages.next_tick();
                let from = (cur - fstart) as usize;
                buf[(cur - offset) as usize..(fend - offset) as usize]
                    .copy_from_slice(&f.data[from..from + (fend - cur) as usize]);
                cur = fend;
            }
            Ok((end - offset) as usize)
        });
        drop(_g);
        // Reads make nothing dirty: they only drop clean folios (writers write back).
        let limit = self.pages.cache_limit.load(Ordering::Acquire);
        if self.pages.cached.load(Ordering::Acquire) > limit {
            self.drop_clean_folios(shrink_target(limit));
        }
        r
    }

    /// Write `data` at `offset` of regular file `id` into the page cache: the blocks
    /// become dirty and the in-memory size grows; the trees get the data at writeback
    /// (`writeback_inode`, `fsync`, `sync`, or a writer past the dirty limit, which
    /// this call may itself be). Checks what `FsWriter::write_file` checks first.
    ///
    /// # Errors
    /// `Posix(IsDir)` / `Posix(Invalid)` for a non-regular inode, `Posix(NotPermitted)`
    /// for an immutable file or an append-only one written elsewhere than at its end,
    /// `Posix(ReadOnly)` on a read-only subvolume or engine; reads of partial blocks;
    /// errors of the writeback the dirty limit forces.
    pub fn buffered_write(&self, id: InodeId, offset: u64, data: &[u8]) -> Result<()> {
        self.buffered_write_opts(id, offset, data, WriteOpts::default())
    }

    /// `buffered_write`, with what the writer asks besides the data (`WriteOpts`).
    ///
    /// # Errors
    /// As `buffered_write`.
    pub fn buffered_write_opts(
        &self,
        id: InodeId,
        offset: u64,
        data: &[u8],
        opts: WriteOpts,
    ) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let end = offset
            .checked_add(data.len() as u64)
            .ok_or_else(|| Error::posix(PosixKind::Invalid, "write past the maximum file size"))?;
        // The data space the blocks will take at writeback, before the inode's lock
        // (the slow path writes other inodes back). Blocks dirty already are counted
        // twice until the write is in, which only matters on a full filesystem, where
        // that path writes them back first.
        let bsz = u64::from(self.info().sectorsize);
        let _rsv = self.reserve_data_space(id, offset / bsz * bsz, end.div_ceil(bsz) * bsz)?;
        let inode = self.inodes().get(id);
        let g = lock_exclusive(&inode);
        let ii = self.regular_item(&inode)?;
        let bs = self.info().sectorsize;
        // The size cannot move while the inode's lock is held (an empty cache reads
        // it from the item, as below).
        let size = with_cache(self, &inode, |pc| pc.i_size).unwrap_or(ii.size.get());
        crate::data::write::prepare_write(
            id,
            &ii,
            size,
            offset,
            data.len() as u64,
            crate::data::write::WriteBy::Caller,
        )?;
        // The write's times, as the kernel's file_update_time sets them once the
        // write is allowed and before the data is copied (writeback leaves them
        // alone); refused on a read-only subvolume or engine.
        // A writer without CAP_FSETID takes set-user-ID (and set-group-ID where the
        // group may execute) in the same update (`file_remove_privs`).
        let mode = ii.mode.get();
        let kill = if opts.kill_suidgid && mode & 0o6000 != 0 {
            let in_group = |g: u32| opts.in_group.is_some_and(|f| f(g));
            Some(crate::inode::write::mode_without_privs(mode, ii.gid.get(), &in_group))
                .filter(|&m| m != mode)
        } else {
            None
        };
        // Multigrain times (the kernel's `inode_needs_update_time`): while nobody has
        // read them since the last write set them, the write takes the coarse clock,
        // and a write inside the same tick changes nothing, so a run of small writes
        // costs one inode update per tick, not one per write. Once they were read, the
        // write takes a fine time, so the reader sees it change.
        // A writer that sets the times itself (`WriteOpts::no_cmtime`) changes them
        // only to take privileges away.
        let keep_times = opts.no_cmtime && kill.is_none();
        let queried = !keep_times && inode.take_ctime_queried();
        let clock = &self.info().sources.clock;
        let now = if queried { clock.now() } else { clock.coarse_now() };
        let t = crate::inode::write::timespec(now);
        let same = |a: &ubtrfs_format::structs::Timespec| {
            zerocopy::IntoBytes::as_bytes(a) == zerocopy::IntoBytes::as_bytes(&t)
        };
        if !keep_times && (queried || kill.is_some() || !same(&ii.mtime) || !same(&ii.ctime)) {
            if let Err(e) = self.write_retrying(|w| w.file_update_time(id, kill, t)) {
                if queried {
                    inode.mark_ctime_queried();
                }
                return Err(e);
            }
        }
        // btrfs_cont_expand (btrfs_write_check, then btrfs_truncate_block): a write that
        // starts past EOF in a later block first zeroes the old last block from the old
        // EOF on and dirties it, whatever it held, so it is written as data (a hole
        // there becomes a block of zeros, as SEEK_DATA then finds on the kernel). Its
        // space is held here, under the lock (no flush may run): on a filesystem too
        // full for one more block, the block is left as it is.
        let eof_block = size / bsz * bsz;
        let eof_rsv =
            (offset > size && !size.is_multiple_of(bsz) && eof_block + bsz <= offset / bsz * bsz)
                .then(|| self.data_rsv.hold(bsz))
                .filter(|r| r.fits());
        with_cache(self, &inode, |pc| -> Result<()> {
            if pc.i_size.is_none() {
                pc.i_size = Some(ii.size.get());
                pc.disk_i_size = ii.size.get();
                pc.new_from = ii.size.get();
            }
            debug_assert_eq!(pc.i_size, Some(size), "{id}: the size moved under the inode's lock");
            if let Some(_held) = eof_rsv.as_ref() {
                self.dirty_eof_block(id, &inode, pc, ii.flags.get(), size)?;
            }
            if end > size {
                self.size_grew(pc, size, end);
            }
            let mut cur = offset;
            while cur < end {
                let fstart = cur / FOLIO_SIZE * FOLIO_SIZE;
                let fend = (fstart + FOLIO_SIZE).min(end);
                let fsize = pc.folios.slot_folio(fstart, fend, bs).size();
                // Partial blocks at the edges need their old bytes.
                let (a, z) = (cur / bsz * bsz, fend.div_ceil(bsz) * bsz);
                if a < cur {
                    self.fill_folio(id, pc, fstart, a, cur)?;
                }
                if z > fend {
                    self.fill_folio(id, pc, fstart, fend, z.min(fstart + fsize))?;
                }
                // Blocks about to become dirty over a hole are new (st_blocks counts
                // them now): past the allocated end every block is a hole, below it the
                // extent maps tell (`btrfs_find_new_delalloc_bytes`). A block dirty
                // already has its state (blocks a truncation left dirty past EOF are
                // clean again after `size_grew` above).
                let holes = if pc.has_clean_block(fstart, a, z) {
                    self.holes_in(&inode, pc, ii.flags.get(), a, z)?
                } else {
                    Vec::new()
                };
                let f = pc.folios.get_mut(&fstart).expect("inserted above");
                f.last_use = self.pages.next_tick();
                let from = (cur - fstart) as usize;
                f.data[from..from + (fend - cur) as usize]
                    .copy_from_slice(&data[(cur - offset) as usize..(fend - offset) as usize]);
                pc.mark_dirty(fstart, cur, fend - cur);
                pc.mark_new(&holes);
                cur = fend;
            }
            pc.i_size = Some(size.max(end));
            Ok(())
        })?;
        drop(g);
        self.balance_dirty_pages()?;
        self.shrink_page_cache()
    }

    /// Check that buffered writes of [offset, offset + len) of file `id` find data
    /// space now, as a single write of the range would (`reserve_data_space`, with its
    /// flush when it does not fit), holding nothing: a copy that writes a file in
    /// pieces refuses before its first piece, naming what the whole file needs,
    /// rather than part way. The caller holds no inode lock.
    ///
    /// # Errors
    /// As `reserve_data_space`.
    pub fn check_data_space(&self, id: InodeId, offset: u64, len: u64) -> Result<()> {
        let bsz = u64::from(self.info().sectorsize);
        let end = offset.saturating_add(len);
        if len == 0 {
            return Ok(());
        }
        self.reserve_data_space(id, offset / bsz * bsz, end.div_ceil(bsz) * bsz).map(drop)
    }

    /// Hold data space for the blocks [a, z) of file `id` about to become dirty
    /// (`space::data_rsv`; the kernel's `btrfs_check_data_free_space`), until the
    /// returned reservation drops, by which time the blocks are dirty and counted as
    /// such. When the space promised does not fit the free space: new data chunks,
    /// then a writeback of every dirty inode and a commit (which turns dirty data into
    /// extents and returns the space freed in the running transaction), as the
    /// kernel's data flush does; then what of [a, z) a nocow or preallocated file
    /// writes in place needs nothing. The caller holds no inode lock.
    ///
    /// # Errors
    /// `Posix(NoSpace)` naming the file when the data space cannot hold the write;
    /// errors of the writeback and commit.
    pub(crate) fn reserve_data_space(
        &self,
        id: InodeId,
        a: u64,
        z: u64,
    ) -> Result<crate::space::data_rsv::DataReservation<'_>> {
        let rsv = &self.data_rsv;
        // Named only on the slow paths (a write that fits says nothing), as the direct
        // write names it (a caller that knows a path for the inode says that instead).
        let what = || id.to_string();
        // Held, it fits; or new chunks make it fit, if the devices have room
        // (reserve_data makes them until the data groups hold everything promised).
        let try_hold = |bytes: u64| -> Result<
            std::result::Result<
                crate::space::data_rsv::DataReservation<'_>,
                crate::space::data_rsv::DataReservation<'_>,
            >,
        > {
            let held = rsv.hold(bytes);
            if held.fits() {
                return Ok(Ok(held));
            }
            match self
                .write(|w| crate::space::allocator::reserve_data(w, rsv.outstanding(), &what()))
            {
                Ok(()) if held.fits() => Ok(Ok(held)),
                Ok(()) => Ok(Err(held)),
                Err(e) if e.posix_kind() == Some(PosixKind::NoSpace) => Ok(Err(held)),
                Err(e) => Err(e),
            }
        };
        if let Ok(held) = try_hold(z - a)? {
            return Ok(held);
        }
        self.flush_data_space()?;
        let held = match try_hold(z - a)? {
            Ok(held) => return Ok(held),
            Err(held) => held,
        };
        // What goes in place takes no new space.
        let flags = self.read(|l| Ok(l.load_inode(id, Load::ITEM)?.item.flags.get()))?;
        let in_place = if crate::data::nocow::nocow_capable(flags) {
            self.write_retrying(|w| w.in_place_bytes(id, flags, a, z))?
        } else {
            0
        };
        let held = if in_place > 0 {
            drop(held);
            let held = rsv.hold(z - a - in_place);
            if held.fits() {
                return Ok(held);
            }
            held
        } else {
            held
        };
        let (free, others) = (rsv.free(), rsv.outstanding().saturating_sub(held.bytes()));
        Err(Error::posix_detail(PosixKind::NoSpace, what(), format!("{} bytes of data space are needed, {free} are free, and {others} of them are promised to data not yet written back", held.bytes())))
    }

    /// The kernel's data flush before an ENOSPC (`btrfs_reserve_data_bytes`: delalloc,
    /// then a commit, which a single-transaction engine leaves out): dirty data to extents, and the space the running transaction
    /// freed, pinned until its commit, back to the allocator. The caller holds no inode
    /// lock, and no reservation that would count against itself.
    ///
    /// # Errors
    /// Errors of the writeback and the commit.
    pub(crate) fn flush_data_space(&self) -> Result<()> {
        self.writeback_all()?;
        if self.single_transaction() {
            return Ok(());
        }
        self.commit().map(|_| ())
    }

    /// The holes of file `inode` (inode flags `flags`) in the block-aligned [a, z),
    /// sorted: everything past the blocks the trees allocated (`new_from`) unless the
    /// file has preallocated extents, and below that what the extent maps (or items)
    /// do not cover.
    fn holes_in(
        &self,
        inode: &Arc<Inode>,
        pc: &PageCacheInner,
        flags: u64,
        a: u64,
        z: u64,
    ) -> Result<Vec<(u64, u64)>> {
        let bs = u64::from(self.info().sectorsize);
        let known = if flags & ubtrfs_format::structs::INODE_PREALLOC != 0 {
            u64::MAX
        } else {
            pc.new_from.div_ceil(bs) * bs
        };
        let look = z.min(known);
        let mut out = Vec::new();
        if a < look {
            let recs = self
                .read(|l| {
                    crate::inode::get_extent::get_file_extents(l, &self.extent_maps, inode, a, look)
                })?
                .0;
            out = holes_between(&recs, a, look, bs);
        }
        let from = known.max(a);
        if from < z {
            match out.last_mut() {
                Some(l) if l.1 == from => l.1 = z,
                _ => out.push((from, z)),
            }
        }
        Ok(out)
    }

    /// The in-memory size of file `id` if its page cache knows one (it runs ahead of
    /// the INODE_ITEM's while data is dirty).
    pub fn cached_i_size(&self, id: InodeId) -> Option<u64> {
        let inode = self.inodes().lookup(id)?;
        let s = inode.mapping.pages.lock().i_size;
        s
    }

    /// Past the dirty limit, write inodes back (the one with most dirty data first)
    /// until the dirty total is at half the limit (the role of `balance_dirty_pages`).
    /// The caller holds no inode lock.
    fn balance_dirty_pages(&self) -> Result<()> {
        let limit = self.pages.dirty_limit.load(Ordering::Acquire);
        if self.data_rsv.dirty() <= limit {
            return Ok(());
        }
        // One look at the registry, most dirty first, then write back in that order:
        // many small dirty files (an untar) must not cost a scan per file.
        let bs = self.info().sectorsize;
        let held: Vec<(u64, Arc<Inode>)> =
            self.pages.registry().values().map(|(i, t)| (*t, i.clone())).collect();
        let mut victims: Vec<(u64, u64, Arc<Inode>)> = held
            .into_iter()
            .map(|(t, i)| {
                let d = i.mapping.pages.lock().dirty_bytes(bs);
                (d, t, i)
            })
            .filter(|(d, _, _)| *d > 0)
            .collect();
        // Ties in the least recently used order: the same writes, the same extents.
        victims.sort_unstable_by_key(|(d, t, _)| (std::cmp::Reverse(*d), *t));
        for (_, _, inode) in victims {
            if self.data_rsv.dirty() <= limit / 2 {
                break;
            }
            self.pages.throttle_writebacks.fetch_add(1, Ordering::Relaxed);
            self.writeback_inode(inode.id)?;
        }
        Ok(())
    }

    /// Over the cache limit with too few clean folios to drop (dirty folios hold the
    /// memory: many small files written and not yet written back), write back the
    /// least recently used dirty inodes until what is dirty fits in what must be
    /// freed, so their folios can go (the kernel writes back under memory pressure
    /// too). The caller holds no inode lock.
    fn writeback_for_memory(&self) -> Result<()> {
        let limit = self.pages.cache_limit.load(Ordering::Acquire);
        let cached = self.pages.cached.load(Ordering::Acquire);
        if cached <= limit {
            return Ok(());
        }
        let need = cached - shrink_target(limit);
        let mut order: Vec<(u64, Arc<Inode>)> =
            self.pages.registry().values().map(|(i, t)| (*t, i.clone())).collect();
        order.sort_unstable_by_key(|(t, _)| *t);
        let mut freed_dirty = 0u64;
        for (_, inode) in order {
            if freed_dirty >= need {
                break;
            }
            let (dirty, bytes) = {
                let pc = inode.mapping.pages.lock();
                (pc.dirty_blocks > 0, pc.cached_bytes())
            };
            if dirty {
                self.pages.throttle_writebacks.fetch_add(1, Ordering::Relaxed);
                self.writeback_inode(inode.id)?;
                freed_dirty += bytes;
            }
        }
        Ok(())
    }

    /// Past the cache limit, drop clean folios, least recently used inode first and
    /// oldest folio first within it, down to 7/8 of the limit (so that a cache at its
    /// limit is not walked again at every read or write); write dirty ones back first
    /// when the clean ones are not enough (`writeback_for_memory`).
    ///
    /// # Errors
    /// As `writeback_inode`, when dirty data had to be written back.
    pub(crate) fn shrink_page_cache(&self) -> Result<()> {
        let limit = self.pages.cache_limit.load(Ordering::Acquire);
        if self.pages.cached.load(Ordering::Acquire) <= limit {
            return Ok(());
        }
        // Clean folios are at most what is cached and not dirty: when that cannot
        // bring the cache to its target, the walk for them is skipped (a cache full
        // of small dirty files would be walked whole for nothing at every shrink).
        let (target, cached) = (shrink_target(limit), self.pages.cached.load(Ordering::Acquire));
        if cached.saturating_sub(self.data_rsv.dirty()) >= cached.saturating_sub(target) {
            self.drop_clean_folios(target);
        }
        if self.pages.cached.load(Ordering::Acquire) > limit {
            self.writeback_for_memory()?;
            self.drop_clean_folios(target);
        }
        Ok(())
    }

    /// Drop clean folios, least recently used inode first, until the cache holds at
    /// most `limit` bytes.
    fn drop_clean_folios(&self, limit: u64) {
        let mut reg = self.pages.registry();
        let mut order: Vec<(u64, InodeId)> = reg.iter().map(|(id, (_, t))| (*t, *id)).collect();
        order.sort_unstable();
        let bs = self.info().sectorsize;
        for (_, id) in order {
            if self.pages.cached.load(Ordering::Acquire) <= limit {
                break;
            }
            let inode = reg.get(&id).expect("listed above").0.clone();
            // A cache busy under its mutex (a reader filling, a writeback) is skipped.
            let Some(mut pc) = inode.mapping.pages.try_lock() else { continue };
            // Every cached byte dirty: no folio to drop.
            if pc.cached_bytes() <= pc.dirty_bytes(bs) {
                continue;
            }
            let before = (pc.cached_bytes(), pc.dirty_bytes(bs));
            let mut clean: Vec<(u64, u64)> = pc
                .folios
                .values()
                .filter(|f| f.is_clean())
                .map(|f| (f.last_use, f.start))
                .collect();
            clean.sort_unstable();
            let over = self.pages.cached.load(Ordering::Acquire).saturating_sub(limit);
            let mut freed = 0;
            for (_, s) in clean {
                if freed >= over {
                    break;
                }
                freed += pc.folios.remove(&s).expect("listed above").size();
                self.pages.evicted_folios.fetch_add(1, Ordering::Relaxed);
            }
            let after = (pc.cached_bytes(), pc.dirty_bytes(bs));
            let empty = pc.folios.is_empty() && pc.ordered.is_empty();
            if empty {
                // Nothing cached: the size is read again at the next use.
                pc.forget_sizes();
                reg.remove(&id);
            }
            self.pages.account(&self.data_rsv, before, after);
            drop(pc);
        }
    }

    /// SEEK_DATA / SEEK_HOLE (`whence`) from `offset` in file `id`, dirty data
    /// counting as data: a file with dirty blocks is written back first, then the
    /// trees answer (`falloc::seek_in_file`). Ok(None) is ENXIO.
    ///
    /// # Errors
    /// As `writeback_inode` and `falloc::seek_in_file`.
    pub fn seek_data_hole(&self, id: InodeId, offset: u64, whence: i32) -> Result<Option<u64>> {
        let inode = self.inodes().get(id);
        let _g = lock_exclusive(&inode);
        if inode.mapping.pages.lock().dirty_blocks > 0 {
            self.writeback_locked(&inode)?;
        }
        self.read(|l| crate::data::falloc::seek_in_file(l, id, offset, whence))
    }

    /// Drop every folio of inode `id` without writing it back (the inode is gone from
    /// disk: its last name was removed and nothing uses it). The caller holds no inode
    /// lock.
    pub(crate) fn discard_page_cache(&self, id: InodeId) {
        let Some(inode) = self.pages.registry().get(&id).map(|(i, _)| i.clone()) else { return };
        // A writeback of the inode (`writeback_all` from another thread) finishes first.
        let _g = lock_exclusive(&inode);
        with_cache(self, &inode, |pc| {
            assert!(
                pc.ordered.is_empty(),
                "page cache: discarding {id} with ordered extents alive"
            );
            pc.folios.clear();
            pc.dirty_blocks = 0;
            pc.new_blocks = 0;
            pc.forget_sizes();
        });
    }

    /// After a name of inode `id` was removed: discard its folios if the inode is gone
    /// from the trees (it was not in use and that was its last name).
    pub(crate) fn discard_if_gone(&self, id: InodeId) {
        if !self.pages.registry().contains_key(&id) {
            return;
        }
        let gone = matches!(self.read(|l| l.load_inode(id, Load::ITEM).map(|_| ())), Err(e) if e.posix_kind() == Some(PosixKind::NotFound));
        if gone {
            self.discard_page_cache(id);
        }
    }

    /// Before a change to file `id`'s extents through another path (direct write,
    /// fallocate, punch, zero range, size change): write its dirty data back. The
    /// caller holds the inode's lock exclusively. Returns whether the inode has a page
    /// cache to fix up afterwards (`after_extent_change`).
    pub(crate) fn before_extent_change(&self, inode: &Arc<Inode>) -> Result<bool> {
        if !self.pages.registry().contains_key(&inode.id) {
            return Ok(false);
        }
        self.writeback_locked(inode)?;
        Ok(true)
    }

    /// Run `change` on the extents of [start, end) of `inode` (its lock held
    /// exclusively) between `before_extent_change` and `after_extent_change`: the
    /// dirty data goes first, the folios of the range after.
    pub(crate) fn extent_change<T>(
        &self,
        inode: &Arc<Inode>,
        start: u64,
        end: u64,
        change: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let cached = self.before_extent_change(inode)?;
        let r = change();
        if cached {
            self.after_extent_change(inode, start, end)?;
        }
        r
    }

    /// After such a change: drop the cached folios of [start, end) and read the size
    /// again from the trees at the next use when nothing stays cached.
    pub(crate) fn after_extent_change(
        &self,
        inode: &Arc<Inode>,
        start: u64,
        end: u64,
    ) -> Result<()> {
        let size = self.read(|l| Ok(l.load_inode(inode.id, Load::ITEM)?.item.size.get()));
        with_cache(self, inode, |pc| {
            pc.drop_range(start, end);
            match &size {
                Ok(s) => {
                    // After a full writeback nothing is dirty: the trees' size is the size.
                    pc.truncate(*s);
                    pc.i_size = Some(*s);
                    pc.disk_i_size = *s;
                    pc.new_from = *s;
                }
                Err(_) => {
                    let (mut kept, mut new) = (0, 0);
                    pc.folios.retain(|_, f| {
                        kept += u64::from(f.dirty.count());
                        new += u64::from(f.new.count());
                        !f.is_clean()
                    });
                    pc.dirty_blocks = kept;
                    pc.new_blocks = new;
                }
            }
        });
        size.map(|_| ())
    }

    /// A size change of file `id` (truncate up or down) in its page cache, after the
    /// trees have it: folios past the new size go, the straddling one is zeroed past
    /// it, both sizes become `size`.
    pub(crate) fn truncate_page_cache(&self, inode: &Arc<Inode>, size: u64) {
        if !self.pages.registry().contains_key(&inode.id) {
            return;
        }
        with_cache(self, inode, |pc| {
            let old = pc.i_size.unwrap_or(0);
            // Growing, the trees wrote the block holding their old end (zeros past
            // it, `btrfs_truncate_block`), also over a hole: it has an extent now, and
            // dirty data there replaces it.
            let bs = u64::from(self.info().sectorsize);
            let d = pc.disk_i_size;
            if size > d && !d.is_multiple_of(bs) {
                pc.new_from = pc.new_from.max(d);
                pc.clear_new(d / bs * bs, bs);
            }
            pc.truncate(size);
            pc.i_size = Some(size);
            pc.disk_i_size = size;
            pc.new_from = pc.new_from.min(size);
            self.size_grew(pc, old, size);
        });
    }

    /// The size went from `old` up to `size`: blocks a truncation left dirty past the
    /// old EOF (zeros, see `truncate`) are inside the file again. The trees hold a hole
    /// there, which reads the same zeros, so they are clean again rather than written
    /// as data: the kernel here (4 KiB folios, which truncation drops whole) leaves a
    /// hole too, as SEEK_DATA and st_blocks show. A writeback between the truncation
    /// and the growth has already ended them (their ordered extents truncated).
    fn size_grew(&self, pc: &mut PageCacheInner, old: u64, size: u64) {
        let bs = u64::from(self.info().sectorsize);
        let (a, z) = (old.div_ceil(bs) * bs, size.div_ceil(bs) * bs);
        if a >= z {
            return;
        }
        // Only the folio that straddled the old EOF can hold such blocks.
        let Some((_, f)) = pc.folios.range_mut(..a).next_back() else { return };
        if f.end() <= a {
            return;
        }
        let (b0, b1) = (f.block_of(a), ((z.min(f.end()) - f.start) / bs) as u32);
        debug_assert!(f.new.find_next(b0, true) >= b1, "blocks past the old EOF {old} are not new");
        pc.dirty_blocks -= u64::from(f.dirty.clear_range(b0, b1 - b0));
    }

    /// Zero the block holding EOF `size` (not block-aligned) from `size` on and make it
    /// dirty, with its old bytes below `size` (`btrfs_truncate_block` of a write past
    /// EOF; see `buffered_write_opts`).
    fn dirty_eof_block(
        &self,
        id: InodeId,
        inode: &Arc<Inode>,
        pc: &mut PageCacheInner,
        flags: u64,
        size: u64,
    ) -> Result<()> {
        let bs = self.info().sectorsize;
        let bsz = u64::from(bs);
        let b = size / bsz * bsz;
        debug_assert_ne!(b, size, "{id}: EOF {size} is block-aligned");
        let fstart = b / FOLIO_SIZE * FOLIO_SIZE;
        pc.folios.slot_folio(fstart, b + bsz, bs);
        self.fill_folio(id, pc, fstart, b, size)?;
        let holes = if pc.has_clean_block(fstart, b, b + bsz) {
            self.holes_in(inode, pc, flags, b, b + bsz)?
        } else {
            Vec::new()
        };
        let f = pc.folios.get_mut(&fstart).expect("inserted above");
        f.data[(size - fstart) as usize..(b + bsz - fstart) as usize].fill(0);
        pc.mark_dirty(fstart, b, bsz);
        pc.mark_new(&holes);
        Ok(())
    }
}

/// A cache mutation of one inode under its mutex, with the totals kept right: `f`
/// runs on the inner state, the usage change goes to the engine's totals, and an
/// inode left without folios leaves the registry (one with folios joins it).
pub(super) fn with_cache<T>(
    e: &Engine,
    inode: &Arc<Inode>,
    f: impl FnOnce(&mut PageCacheInner) -> T,
) -> T {
    let g = &e.pages;
    let bs = e.info().sectorsize;
    let mut pc = inode.mapping.pages.lock();
    let before = (pc.cached_bytes(), pc.dirty_bytes(bs));
    let new_before = pc.new_blocks;
    let r = f(&mut pc);
    let after = (pc.cached_bytes(), pc.dirty_bytes(bs));
    // New blocks change the inode's new delalloc bytes (under the cache's mutex, so
    // the two move in the cache's order), less what completions already moved.
    let settled = std::mem::take(&mut pc.settled_new);
    if pc.new_blocks != new_before || settled > 0 {
        let bsz = u64::from(bs);
        let (add, sub) = (
            pc.new_blocks.saturating_sub(new_before) * bsz,
            new_before.saturating_sub(pc.new_blocks) * bsz,
        );
        assert!(settled <= sub, "{}: {settled} settled new bytes but {sub} cleared", inode.id);
        inode.adjust_new_delalloc(add, sub - settled);
    }
    let empty = pc.folios.is_empty() && pc.ordered.is_empty();
    if empty {
        pc.forget_sizes();
    }
    if cfg!(debug_assertions) && pc.folios.len() <= 64 {
        pc.check_invariants();
    }
    // The cache's mutex, then the registry's (holders of the registry only try the
    // caches' mutexes).
    let mut reg = g.registry();
    g.account(&e.data_rsv, before, after);
    if empty {
        reg.remove(&inode.id);
    } else {
        let tick = g.next_tick();
        reg.insert(inode.id, (inode.clone(), tick));
    }
    drop(reg);
    drop(pc);
    r
}
