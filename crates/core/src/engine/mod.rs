//! The engine as threads share it: one filesystem, opened once, used by many threads
//! at the same time (a mount's request workers, the tools' worker threads).
//!
//! Shape:
//! - Shared by every thread: `FsInfo` (`Arc`): devices, chunk map, committed
//!   superblock, node cache, the registry of readers' views, the abort state, and the
//!   in-memory inodes (`inode::inode_cache`), each with its lock (the role of
//!   i_rwsem), open and lookup counts, its attributes once read (`getattr` then reads
//!   no tree; the writer keeps the copy current) and a directory's next DIR_INDEX.
//!   Its changing parts sit behind leaf locks of their own.
//! - The running transaction: one `FsWriter` behind a reader-writer lock (`state`):
//!   dirty blocks, delayed refs, the allocator, pinned space, the roots.
//! - Readers (`read`) share `state` and see the live view (`FsWriter::live`): every
//!   change made through the engine, committed or not. They run in parallel with each
//!   other; a read sees either all of a change or none of it, because changes happen
//!   under the exclusive side (no torn directory). A committed block missing from the
//!   cache is read after dropping the lock, and the reader runs again.
//! - `read_file` finds a range's extents in the inode's extent maps
//!   (`mapping::extent_map`), filling them from EXTENT_DATA items on a miss; every
//!   change of those items drops the range it touches (`tree::modify`), and a budget
//!   bounds the maps (`set_extent_map_limit`, `mapping::extent_map_shrinker`).
//! - File data is read (`read_file`) and written (`write_file`, whole sectors) without
//!   `state`: the lookups and the extent reservations and insertions take it, the data
//!   I/O holds only the inode's lock. Space a reader may still read is not reused
//!   (`transaction::views`).
//! - Changes (`write`) take `state` exclusively, one at a time (writes are serialised
//!   at first). Each operation runs in a transaction handle (`transaction::handle`):
//!   it reserves its metadata before it begins (ENOSPC then, with nothing changed),
//!   records the blocks it COWed and keeps background writeback off them while it
//!   lives, and aborts the transaction if it fails or is dropped unended. The
//!   metadata writeback a change ends with is written after `state` is dropped.
//!   A direct write's reservation lives from `begin_write` to `finish_write`, across
//!   its data I/O, so changes in between count it as taken.
//! - `commit` holds `commit_lock` throughout, so commits are one at a time. It takes
//!   `state` exclusively twice, briefly: to seal the transaction (`start_commit`; the
//!   writer then runs the next transaction, and readers see the sealed blocks), and to
//!   finish it (`finish_commit`). All the commit's I/O (blocks, flushes, superblocks)
//!   runs between the two, holding neither side of `state`: readers and the next
//!   transaction's changes go on while it is written.
//! - Buffered file data (`mapping::page_cache`, `data::writeback`): `buffered_read`
//!   and `buffered_write` go through each inode's page cache; `writeback_inode`,
//!   `writeback_all`, `fsync` and `sync` put dirty data into the trees. `commit`
//!   does not write dirty pages back, and dropping the engine loses what is still
//!   dirty (as a crash would): callers `sync` first. `read_file` and `write_file` stay
//!   the direct path; `write_file`, `setattr` and `fallocate` keep the cache right.
//! - `committed` gives a view of the last committed generation that stays on it while
//!   the engine goes on (check, extract, later send and scrub).
//!
//! Lock order: inode locks (`inode::inode_cache`, two in inode order), then an
//! inode's page-cache mutex (then the page cache's registry, a leaf), then
//! `commit_lock`, then `state`, then `writeback_io` (a change's writeback holds it
//! shared from the end of the change through its I/O; a commit takes it alone, holding
//! nothing but `commit_lock`, before it returns freed space), then the leaf locks inside `FsInfo` (node cache, chunk
//! map, superblock copy, view registry, warnings), which are never held across a call
//! back into the engine. Open files: `inode::file`. Readers never do device I/O
//! under `state`. Neither do the engine's own changes (`write_retrying`: file writes,
//! unlinks) until they begin changing something: a block their lookups miss is read
//! without the lock and the change runs again. What remains under `state` is a
//! writer's reads once its change has begun (blocks it is about to change, old data of
//! partial-sector and inline writes) and the writeback of a large change between its
//! delayed-ref batches.
//!
//! A thread that panics while changing the filesystem leaves the lock poisoned; the
//! engine then refuses further changes and reads (the state may be half changed), with
//! a read-only error naming the panic, as an abort would.
//!
//! A client (the mount above all) changes the filesystem through one `Engine` method
//! per operation, naming inodes by `InodeId`: open files, unlink, rmdir, rename and
//! setattr (`file`), new inodes, links, xattrs and inode flags (`namespace`),
//! subvolumes (`subvol`), buffered I/O (`buffered`), clones (`reflink`). Each takes the
//! inode locks it needs and picks `write` or `write_retrying` itself; a client never
//! chooses the engine's locking. The offline tools' own calls (inodes made exactly as
//! named, chunk and device changes for mkfs) are engine methods too (`namespace`,
//! `volumes`); `write` and `write_retrying` hand out the writer only inside the crate
//! and to tests (the `test-hooks` feature).

mod buffered;
mod file;
mod namespace;
mod pages;
pub use file::OpenFile;
mod reflink;
mod subvol;
mod trim;
mod volumes;
mod writeback;
pub use namespace::NewInode;
pub use volumes::DeadRoot;

use crate::data::read::{DataView, FileRead};
use crate::disk_io::{FsInfo, OpenOptions};
use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{FileKind, Filesystem, FsRead, InodeId, Load};
use crate::inode::inode_cache::InodeCache;
use crate::inode::writer::FsWriter;
use crate::transaction::views::ViewGuard;
use crate::transaction::{Live, ReadMisses};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockWriteGuard};

/// A committed generation held as a view (`Engine::committed`); read it as a
/// `Filesystem`.
pub struct Committed {
    fs: Filesystem,
    _view: ViewGuard,
}

impl std::ops::Deref for Committed {
    type Target = Filesystem;
    fn deref(&self) -> &Filesystem {
        &self.fs
    }
}

/// A filesystem shared by threads.
pub struct Engine {
    info: Arc<FsInfo>,
    state: RwLock<FsWriter>,
    /// Held through a whole commit (see the module documentation).
    commit_lock: Mutex<()>,
    /// The log sync in flight and the loggings made durable (`writeback::fsync`).
    pub(crate) log_sync: Mutex<LogSyncState>,
    /// Signalled when a log sync ends.
    pub(crate) log_synced: std::sync::Condvar,
    /// Held shared by each change's writeback while its I/O runs, and taken exclusively
    /// by a commit before it returns freed space: a block freed while its writeback was
    /// still writing it is pinned, and its space must not come back before that write
    /// has landed.
    writeback_io: RwLock<()>,
    /// The page cache's limits, totals and inodes (`pages`).
    pub(crate) pages: pages::PageCacheGlobal,
    /// The writer's in-memory inodes, which readers and open files share.
    pub(crate) inodes: Arc<crate::inode::inode_cache::InodeCache>,
    /// The count of extent maps and the worker that frees them past their budget
    /// (`mapping::extent_map_shrinker`).
    pub(crate) extent_maps: Arc<crate::mapping::extent_map_shrinker::ExtentMapShrinker>,
    /// Data space promised to dirty page-cache data (`space::data_rsv`), the writer's.
    pub(crate) data_rsv: Arc<crate::space::data_rsv::DataReservations>,
    /// Readers' views of older generations (`transaction::views`), the writer's.
    pub(crate) views: Arc<crate::transaction::views::Views>,
    /// Commit only when a caller asks (`set_single_transaction`).
    single_transaction: std::sync::atomic::AtomicBool,
}

/// Where the log's syncs are (`Engine::fsync`).
#[derive(Default)]
pub(crate) struct LogSyncState {
    /// A sync's second half (flush, superblocks) is running without the writer or
    /// `commit_lock`: no other sync is prepared and no commit starts until it ends.
    pub(crate) in_flight: bool,
    /// Every logging up to this one is durable (`LogState::seq`).
    pub(crate) synced: u64,
    /// Fsyncs that reached the log, and log syncs written: many fsyncs waiting on one
    /// sync make one write (`log_stats`).
    pub(crate) fsyncs: u64,
    pub(crate) syncs: u64,
    /// Fsyncs that committed instead, and the last one's reason.
    pub(crate) commits: u64,
    pub(crate) last_commit: Option<&'static str>,
}

/// How fsyncs used the log (`Engine::log_stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogStats {
    /// Fsyncs that logged their inode.
    pub fsyncs: u64,
    /// Log syncs (each a flush, the superblocks, a flush) written for them.
    pub syncs: u64,
    /// Fsyncs that committed because the log could not hold them, and why the last
    /// one did.
    pub commits: u64,
    pub last_commit: Option<&'static str>,
}

fn poisoned<T>(_: PoisonError<T>) -> Error {
    Error::posix_detail(
        PosixKind::ReadOnly,
        "engine",
        "a thread panicked while changing the filesystem; its state is not trusted",
    )
}

impl Engine {
    /// Open the image(s) in `opts` for reading and writing.
    ///
    /// # Errors
    /// As `FsWriter::open`.
    pub fn open(opts: &OpenOptions) -> Result<Engine> {
        Ok(Engine::from_writer(FsWriter::open(opts)?))
    }

    /// Open the image(s) in `opts` read-only (`FsWriter::open_read_only`): every read,
    /// and every change refused with `Posix(ReadOnly)`.
    ///
    /// # Errors
    /// As `FsWriter::open_read_only`.
    pub fn open_read_only(opts: &OpenOptions) -> Result<Engine> {
        Ok(Engine::from_writer(FsWriter::open_read_only(opts)?))
    }

    /// Share an opened writer.
    fn from_writer_inner(mut w: FsWriter) -> Engine {
        w.defer_writeback = true;
        // fsync goes through the log tree: the writer records what it must copy there.
        w.set_log_tracking(w.read_only.is_none());
        Engine {
            info: w.info.clone(),
            inodes: w.inodes().clone(),
            extent_maps: Default::default(),
            data_rsv: w.data_rsv.clone(),
            views: w.views.clone(),
            state: RwLock::new(w),
            commit_lock: Mutex::new(()),
            log_sync: Mutex::new(LogSyncState::default()),
            log_synced: std::sync::Condvar::new(),
            writeback_io: RwLock::new(()),
            pages: Default::default(),
            single_transaction: Default::default(),
        }
    }

    /// Keep every change in the running transaction until a caller commits (`commit`,
    /// `sync`, `fsync`): the engine's own commits, the data-space flush before an
    /// ENOSPC, write dirty data back and no more. An offline command that is one
    /// atomic change (`put`, `mkfs --rootdir`) runs so: a failure part way leaves the
    /// committed filesystem as it was. Space freed in the transaction stays pinned
    /// until its commit, so such a change cannot reuse it.
    pub fn set_single_transaction(&self, on: bool) {
        self.single_transaction.store(on, std::sync::atomic::Ordering::Release);
        // One transaction, committed by its caller: nothing is logged.
        if let Ok(mut w) = self.state.write() {
            let track = !on && w.read_only.is_none();
            w.set_log_tracking(track);
        }
    }

    /// Whether the engine commits only when a caller asks (`set_single_transaction`).
    pub(crate) fn single_transaction(&self) -> bool {
        self.single_transaction.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The shared filesystem.
    pub fn info(&self) -> &Arc<FsInfo> {
        &self.info
    }

    /// The extent maps' count and shrinker (for tests that check their invariants).
    #[cfg(feature = "test-hooks")]
    pub fn extent_maps(&self) -> &crate::mapping::extent_map_shrinker::ExtentMapShrinker {
        &self.extent_maps
    }

    /// Run `f` on the live view (read-your-writes), sharing the engine with other
    /// readers.
    ///
    /// # Errors
    /// `f`'s errors; `Posix(ReadOnly)` after a panic in a writer.
    ///
    /// A committed tree block that is not cached is not read under the lock: the run of
    /// `f` stops there, the lock is dropped, the block is read, and `f` runs again from
    /// the start (what the kernel's `read_block_for_search` does for one search). So `f`
    /// must only read; its result from a run that stopped is discarded.
    pub fn read<T>(&self, mut f: impl FnMut(&Live<'_>) -> Result<T>) -> Result<T> {
        let misses = ReadMisses::default();
        loop {
            let r = {
                let g = self.state.read().map_err(poisoned)?;
                f(&g.live_dropping_misses(&misses))
            };
            let Some((bytenr, expect)) = misses.take_wanted() else {
                debug_assert!(
                    !r.as_ref().is_err_and(Error::is_cache_miss),
                    "a cache miss left a reader run with no block wanted"
                );
                return r;
            };
            drop(r);
            // Neither side of the lock is held here.
            match self.info.read_tree_block(bytenr, &expect) {
                Ok(eb) => misses.keep(eb),
                // The reader meets the error itself, under the lock, as it would have.
                Err(_) => misses.read_under_lock(),
            }
        }
    }

    /// Read file data at `offset` into `buf` as the live view shows it; returns the bytes
    /// read (short at EOF). Only the lookups run under the lock (the inode, the extents
    /// of the range, their data checksums); the data is read from the devices, verified
    /// and decompressed without it, while changes go on. Meanwhile the space those
    /// extents occupy is not handed out again, even if a change frees it
    /// (`transaction::views`).
    ///
    /// # Errors
    /// `Posix(IsDir)` / `Posix(Invalid)` for a directory or another non-regular inode;
    /// as `FsRead::read_at`.
    pub fn read_file(&self, id: InodeId, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let len = buf.len() as u64;
        let mem = self.inodes.get(id);
        let (inode, csums, _view, default_subvol) = self.read(|l| {
            let mut v = l.load_inode(id, Load::ITEM)?;
            match v.kind() {
                FileKind::File => {}
                FileKind::Dir => return Err(Error::posix(PosixKind::IsDir, id.to_string())),
                _ => {
                    return Err(Error::posix(
                        PosixKind::Invalid,
                        format!("{id} is not a regular file"),
                    ))
                }
            }
            let end = offset.saturating_add(len).min(v.size());
            // From the extent maps, or the EXTENT_DATA items (then cached in the maps).
            v.extents = crate::inode::get_extent::get_file_extents(
                l,
                &self.extent_maps,
                &mem,
                offset,
                end,
            )?
            .0;
            let csums = crate::data::read::prefetch_csums(l, &v, offset, end)?;
            // A view of the running transaction: what it frees from now on is held.
            let view = self.views.register(l.transid().prev());
            Ok((v, csums, view, l.default_subvol()))
        })?;
        drop(mem);
        // Past the budget: free maps now, holding no lock.
        self.extent_maps.balance();
        let d = DataView { info: &self.info, default_subvol, csums };
        d.read_at(&inode, offset, buf)
    }

    /// Keep at most `n` extent maps (default `DEFAULT_EXTENT_MAP_LIMIT`): past it, a
    /// shrinker run frees maps (`mapping::extent_map_shrinker`); runs at once if over.
    pub fn set_extent_map_limit(&self, n: u64) {
        self.extent_maps.set_limit(n);
        self.extent_maps.balance();
    }

    /// The extent maps' counts (maps, registry, shrinker runs, map hits and misses).
    pub fn extent_map_stats(&self) -> crate::mapping::extent_map_shrinker::ExtentMapStats {
        self.extent_maps.stats()
    }

    /// The last committed generation as a view of its own: it reads that generation
    /// however long it lives, while the engine goes on changing and committing (check,
    /// extract, a future send or scrub). The space it reads is not reused while it lives.
    ///
    /// # Errors
    /// `Posix(ReadOnly)` after a panic in a writer; `Corrupt`/`Io` reading the default
    /// subvolume entry.
    pub fn committed(&self) -> Result<Committed> {
        let (sb, view) = {
            // Under the shared side: a commit cannot finish (and return the space this
            // generation uses) between reading the superblock and registering the view.
            let _g = self.state.read().map_err(poisoned)?;
            let sb = self.info.super_copy();
            let view = self.views.register(crate::ids::Generation(sb.generation.get()));
            (sb, view)
        };
        Ok(Committed { fs: Filesystem::at(self.info.clone(), sb)?, _view: view })
    }

    /// Run `f` with the engine to itself, to change the filesystem.
    ///
    /// # Errors
    /// `f`'s errors; `Posix(ReadOnly)` after a panic in a writer.
    ///
    /// The writeback a change ends with (past the dirty-metadata limit) is written after
    /// the lock is dropped: the blocks are sealed under it, readers find them in the
    /// writer's `writing` set meanwhile, and they join the node cache afterwards. A
    /// failed write aborts the filesystem and is returned.
    fn write_inner<T>(&self, f: impl FnOnce(&mut FsWriter) -> Result<T>) -> Result<T> {
        let mut g = self.state.write().map_err(poisoned)?;
        let r = f(&mut g);
        self.finish_change(g, r)
    }

    /// End a change made under `g`: write the writeback it sealed, if any, after
    /// dropping `g`, then return its result `r`.
    fn finish_change<T>(&self, mut g: RwLockWriteGuard<'_, FsWriter>, r: Result<T>) -> Result<T> {
        // The write-time data checks see the space this change left (`space::data_rsv`).
        crate::space::allocator::publish_data_free(&mut g);
        // Taken before `state` is dropped, so no commit can finish between the sealing
        // of these blocks and their write.
        let wb = g
            .take_writeback()
            .map(|wb| (wb, self.writeback_io.read().unwrap_or_else(|p| p.into_inner())));
        drop(g);
        if let Some((wb, writing)) = wb {
            // Neither side of `state` is held here.
            let io = wb.write(&self.info);
            drop(writing);
            let mut g = self.state.write().map_err(poisoned)?;
            match io {
                Ok(()) => g.finish_writeback(wb),
                Err(e) => {
                    g.abort("metadata writeback", &e);
                    return Err(e);
                }
            }
        }
        r
    }

    /// `write` for a change that may be run more than once: while a run has changed
    /// nothing yet (its lookups and checks), a committed tree block missing from the
    /// cache is not read under the lock. The run fails at it, the lock is dropped, the
    /// block is read, and `f` runs again (at most 32 times per call, then misses are
    /// read under the lock), as readers do. Once a run begins a change (a handle
    /// starts, space is reserved), it is not run again and reads what it misses under
    /// the lock. A run that missed may not begin a change, so a miss that `f` swallows
    /// changes nothing. Every change `f` makes must go through the writer's operations.
    ///
    /// # Errors
    /// `f`'s errors; `Posix(ReadOnly)` after a panic in a writer.
    fn write_retrying_inner<T>(&self, mut f: impl FnMut(&mut FsWriter) -> Result<T>) -> Result<T> {
        let misses = Arc::new(ReadMisses::default());
        loop {
            let missed = {
                let mut g = self.state.write().map_err(poisoned)?;
                g.set_probe(Some(misses.clone()));
                let r = f(&mut g);
                let spoiled = g.probe_spoiled();
                g.set_probe(None);
                match misses.take_wanted() {
                    // Nothing changed (a miss forbids beginning a change): run again.
                    Some(want) => {
                        debug_assert!(!spoiled, "a probed run changed something after a miss");
                        drop(r);
                        want
                    }
                    // The run ran to its end: finish as `write` does (its writeback).
                    None => {
                        debug_assert!(
                            !r.as_ref().is_err_and(Error::is_cache_miss),
                            "a cache miss left a probed run with no block wanted"
                        );
                        return self.finish_change(g, r);
                    }
                }
            };
            let (bytenr, expect) = missed;
            // Neither side of `state` is held here.
            match self.info.read_tree_block(bytenr, &expect) {
                Ok(eb) => misses.keep(eb),
                Err(_) => misses.read_under_lock(),
            }
        }
    }

    /// Commit the running transaction. Returns the generation now on disk.
    ///
    /// # Errors
    /// As `FsWriter::commit`.
    pub fn commit(&self) -> Result<u64> {
        let one_at_a_time = self.commit_lock.lock().unwrap_or_else(|p| p.into_inner());
        self.commit_locked(&one_at_a_time)
    }

    /// `commit`, with the commit lock held by the caller.
    pub(crate) fn commit_locked(
        &self,
        _one_at_a_time: &std::sync::MutexGuard<'_, ()>,
    ) -> Result<u64> {
        // A log sync's superblocks must be down before the commit's: its second half
        // runs without `commit_lock`, and none starts while the lock is held.
        drop(self.wait_log_sync(|s| !s.in_flight));
        let io = match self.write(|w| w.start_commit())? {
            Some(io) => io,
            None => return self.read(|l| Ok(l.committed_generation().get())),
        };
        // Neither side of `state` is held: readers and the next transaction go on.
        if let Err(e) = io.write(&self.info) {
            self.abort("commit", &e)?;
            return Err(e);
        }
        // Every writeback that may still be writing a block this commit frees has landed.
        drop(self.writeback_io.write().unwrap_or_else(|p| p.into_inner()));
        self.write(|w| Ok(w.finish_commit(io)))
    }

    /// Turn the filesystem read-only after failure `err` at `at` (`FsWriter::abort`,
    /// the kernel's `btrfs_abort_transaction`): later changes are refused, the running
    /// transaction is never committed.
    ///
    /// # Errors
    /// `Posix(ReadOnly)` after a panic in a writer (changes are refused already).
    pub fn abort(&self, at: &str, err: &Error) -> Result<()> {
        self.write(|w| {
            w.abort(at, err);
            Ok(())
        })
    }

    /// Compress file data written from now on as `p` says (the mount's compress= and
    /// compress-force= options, `FsWriter::set_compress`).
    ///
    /// # Errors
    /// `Posix(ReadOnly)` after a panic in a writer.
    pub fn set_compress(&self, p: crate::compression::CompressPolicy) -> Result<()> {
        self.write(|w| {
            w.set_compress(p);
            Ok(())
        })
    }

    /// What statfs(2) reports, counting the running transaction (`FsWriter::statfs`).
    ///
    /// # Errors
    /// `Posix(ReadOnly)` after a panic in a writer.
    pub fn statfs(&self) -> Result<crate::space::statfs::StatFs> {
        let mut s = self.state.read().map_err(poisoned)?.statfs();
        // Dirty pages will take data space at writeback: count them as taken now, as
        // a kernel mount's `df` after `sync` shows them (sync(2) never reaches a FUSE
        // daemon, so the mount cannot wait for it).
        let dirty = self.page_cache_stats().dirty_bytes >> s.bsize.trailing_zeros();
        s.bfree = s.bfree.saturating_sub(dirty);
        s.bavail = s.bavail.saturating_sub(dirty);
        Ok(s)
    }

    /// Take the writer back (all other users are gone: the engine is owned). Dirty
    /// data of the page cache is written back first (the writer alone never writes
    /// it), into the running transaction.
    ///
    /// # Errors
    /// As `writeback_all`; `Posix(ReadOnly)` after a panic in a writer.
    #[cfg(feature = "test-hooks")]
    pub fn into_writer(self) -> Result<FsWriter> {
        self.writeback_all()?;
        assert_eq!(self.data_rsv.dirty(), 0, "dirty data left in the page cache after writeback");
        let mut w = self.state.into_inner().map_err(poisoned)?;
        w.defer_writeback = false;
        Ok(w)
    }
}

/// The calls that hand out the writer or its innards, each forwarding to the method
/// that does the work: the crate's own, and public with the `test-hooks` feature for
/// core's integration tests, the benchmarks and the fuzz targets (see the crate's
/// notes). Written twice, once per visibility, since a method's visibility cannot
/// follow a feature otherwise; the bodies live once, in the methods they forward to.
#[cfg(feature = "test-hooks")]
impl Engine {
    /// Share an opened writer (`from_writer_inner`).
    pub fn from_writer(w: FsWriter) -> Engine {
        Engine::from_writer_inner(w)
    }

    /// Run `f` with the engine to itself, to change the filesystem (`write_inner`).
    ///
    /// # Errors
    /// `f`'s errors; `Posix(ReadOnly)` after a panic in a writer.
    pub fn write<T>(&self, f: impl FnOnce(&mut FsWriter) -> Result<T>) -> Result<T> {
        self.write_inner(f)
    }

    /// `write` for a change that may be run more than once (`write_retrying_inner`).
    ///
    /// # Errors
    /// `f`'s errors; `Posix(ReadOnly)` after a panic in a writer.
    pub fn write_retrying<T>(&self, f: impl FnMut(&mut FsWriter) -> Result<T>) -> Result<T> {
        self.write_retrying_inner(f)
    }

    /// The in-memory inodes.
    pub fn inodes(&self) -> &InodeCache {
        &self.inodes
    }
}

/// The same calls inside the crate, without the `test-hooks` feature.
#[cfg(not(feature = "test-hooks"))]
impl Engine {
    /// Share an opened writer (`from_writer_inner`).
    pub(crate) fn from_writer(w: FsWriter) -> Engine {
        Engine::from_writer_inner(w)
    }

    /// Run `f` with the engine to itself, to change the filesystem (`write_inner`).
    ///
    /// # Errors
    /// `f`'s errors; `Posix(ReadOnly)` after a panic in a writer.
    pub(crate) fn write<T>(&self, f: impl FnOnce(&mut FsWriter) -> Result<T>) -> Result<T> {
        self.write_inner(f)
    }

    /// `write` for a change that may be run more than once (`write_retrying_inner`).
    ///
    /// # Errors
    /// `f`'s errors; `Posix(ReadOnly)` after a panic in a writer.
    pub(crate) fn write_retrying<T>(&self, f: impl FnMut(&mut FsWriter) -> Result<T>) -> Result<T> {
        self.write_retrying_inner(f)
    }

    /// The in-memory inodes.
    pub(crate) fn inodes(&self) -> &InodeCache {
        &self.inodes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn engine_is_shared_between_threads() {
        assert_send_sync::<Engine>();
    }
}
