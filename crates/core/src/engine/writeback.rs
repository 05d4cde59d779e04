//! Writeback as the engine drives it: which inodes and ranges, under which locks, and
//! when (fsync, the dirty limit, commits, unmount); the folio-by-folio work and the
//! ordered extents are `data::writeback`'s.

use crate::data::delalloc::Delalloc;
use crate::data::writeback::{complete_bio, extent_writepage, Bio, BioCtrl, SubmitMode};
use crate::engine::buffered::with_cache;
use crate::engine::Engine;
use crate::error::Result;
use crate::inode::filesystem::InodeId;
use crate::inode::inode_cache::Inode;
use crate::mapping::ordered::OrderedExtent;
use crate::mapping::page_cache::FOLIO_SIZE;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Metadata a writeback reserves for one batch of ordered extents before it writes
/// them and gives the reservation back (a batch passes it by one run at most).
const BATCH_RESERVE: u64 = 64 << 20;

impl Engine {
    /// Write back every dirty block of file `id` (see the module notes): the trees
    /// then hold the file as the page cache shows it, in the running transaction.
    ///
    /// # Errors
    /// `Posix(NoSpace)` at delalloc (the data stays dirty); `Io` from the data writes
    /// (those blocks' data is lost, as after a failed kernel writeback); tree failures.
    pub fn writeback_inode(&self, id: InodeId) -> Result<()> {
        let inode = self.inodes().get(id);
        let _g = inode.lock.write().unwrap_or_else(|p| p.into_inner());
        self.writeback_locked(&inode)
    }

    /// Write back every inode with dirty data, least recently used first.
    ///
    /// # Errors
    /// The first error of `writeback_inode`; the other inodes are written back still.
    pub fn writeback_all(&self) -> Result<()> {
        // Least recently used first, as the kernel's dirty list is written oldest
        // first: one order for one history of writes, so the same writes give the
        // same extents (a reproducible mkfs --rootdir).
        let mut held: Vec<(u64, InodeId)> =
            self.pages.registry().iter().map(|(id, (_, t))| (*t, *id)).collect();
        held.sort_unstable();
        let held: Vec<InodeId> = held.into_iter().map(|(_, id)| id).collect();
        let mut first = Ok(());
        for id in held {
            if let Err(e) = self.writeback_inode(id) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    /// Make inode `id` durable: write a file back, then log it in its subvolume's log
    /// tree (`FsWriter::log_inode`) and sync the log, or commit where the log cannot
    /// hold it. For a directory, its names: its changed entries, with the new inodes
    /// they name (a new file empty unless fsynced itself: no other file's data is
    /// written back, as the kernel's directory fsync writes none).
    /// Returns the generation committed on disk (a logged fsync does not change it).
    ///
    /// Concurrent fsyncs share log syncs, as the kernel's do: the logging into the
    /// log's items takes the writer briefly, and a sync's flushes and superblock run
    /// without it, so the fsyncs that log meanwhile wait for that sync to end and then
    /// one of them syncs for all (`sync_log_to`).
    ///
    /// # Errors
    /// As `writeback_inode`, `FsWriter::log_inode` and `commit`; `Io` from the log's
    /// flushes and superblocks (the filesystem is then aborted).
    pub fn fsync(&self, id: InodeId) -> Result<u64> {
        use crate::inode::log_writer::LogOutcome;
        self.writeback_inode(id)?;
        let (transid, seq) = {
            // No commit runs while the inode is logged: the log holds the changes
            // since the last commit on disk.
            let one_at_a_time = self.commit_lock.lock().unwrap_or_else(|p| p.into_inner());
            match self.write(|w| w.log_inode(id))? {
                LogOutcome::Durable => return self.read(|l| Ok(l.committed_generation().get())),
                LogOutcome::Commit(why) => {
                    self.note_log_commit(why);
                    return self.commit_locked(&one_at_a_time);
                }
                LogOutcome::Logged { transid, seq } => (transid, seq),
            }
        };
        self.log_sync.lock().unwrap_or_else(|p| p.into_inner()).fsyncs += 1;
        self.sync_log_to(transid, seq)
    }

    /// How fsyncs used the log since the engine opened.
    pub fn log_stats(&self) -> crate::engine::LogStats {
        let s = self.log_sync.lock().unwrap_or_else(|p| p.into_inner());
        crate::engine::LogStats {
            fsyncs: s.fsyncs,
            syncs: s.syncs,
            commits: s.commits,
            last_commit: s.last_commit,
        }
    }

    /// Count an fsync that commits because the log cannot hold it (`why`).
    fn note_log_commit(&self, why: &'static str) {
        let mut s = self.log_sync.lock().unwrap_or_else(|p| p.into_inner());
        s.commits += 1;
        s.last_commit = Some(why);
    }

    /// Wait until `done` holds of the log's sync state; returns it locked.
    pub(crate) fn wait_log_sync(
        &self,
        done: impl Fn(&crate::engine::LogSyncState) -> bool,
    ) -> std::sync::MutexGuard<'_, crate::engine::LogSyncState> {
        let s = self.log_sync.lock().unwrap_or_else(|p| p.into_inner());
        self.log_synced.wait_while(s, |s| !done(s)).unwrap_or_else(|p| p.into_inner())
    }

    /// Make logging `seq` of transaction `transid` durable: nothing when a sync since
    /// has carried it or the transaction has committed; else wait for the sync in
    /// flight, then sync the log (every logging so far) or commit where it cannot.
    fn sync_log_to(&self, transid: u64, seq: u64) -> Result<u64> {
        use crate::inode::log_writer::LogSync;
        let committed = || self.read(|l| Ok(l.committed_generation().get()));
        loop {
            if self.wait_log_sync(|s| !s.in_flight || s.synced >= seq).synced >= seq {
                return committed();
            }
            let one_at_a_time = self.commit_lock.lock().unwrap_or_else(|p| p.into_inner());
            let generation = committed()?;
            if generation >= transid {
                return Ok(generation);
            }
            {
                let mut s = self.log_sync.lock().unwrap_or_else(|p| p.into_inner());
                if s.synced >= seq {
                    return Ok(generation);
                }
                if s.in_flight {
                    // Another sync began between the wait and the lock: wait for it.
                    continue;
                }
                s.in_flight = true;
            }
            // Whatever happens, the sync is no longer in flight when this returns.
            let flight = InFlight { e: self, synced: None };
            match self.write(|w| w.prepare_log_sync())? {
                LogSync::Commit(why) => {
                    drop(flight);
                    self.note_log_commit(why);
                    return self.commit_locked(&one_at_a_time);
                }
                LogSync::Write(lw) => {
                    // The flushes and superblocks run without the writer and without
                    // `commit_lock`: other fsyncs log their inodes meanwhile.
                    drop(one_at_a_time);
                    if let Err(e) = lw.finish(self.info()) {
                        self.abort("log sync", &e)?;
                        return Err(e);
                    }
                    let mut flight = flight;
                    flight.synced = Some(lw.seq);
                    drop(flight);
                    return Ok(generation);
                }
            }
        }
    }

    /// Make everything durable: write back every inode, then commit. The commit runs
    /// also when some inode's writeback failed: what was written back is kept (the
    /// failed inode's data stays dirty, or is lost after an I/O error, as after the
    /// kernel's failed writeback), and the writeback's error is reported after it.
    ///
    /// # Errors
    /// As `writeback_all` and `commit`.
    pub fn sync(&self) -> Result<u64> {
        let wb = self.writeback_all();
        let generation = self.commit()?;
        wb.map(|()| generation)
    }

    /// Set the largest ordered extent delalloc makes (default `MAX_EXTENT_SIZE`; a
    /// multiple of the block size), to test writeback across many ordered extents.
    #[cfg(feature = "test-hooks")]
    pub fn set_max_ordered_extent(&self, bytes: u64) {
        let bs = u64::from(self.info().sectorsize);
        let b = (bytes / bs * bs).clamp(bs, crate::inode::write::MAX_EXTENT_SIZE);
        self.pages.max_extent.store(b, Ordering::Release);
    }

    /// `writeback_inode` with the inode's lock held exclusively. An offline engine
    /// (`set_single_transaction`) drops the inode's folios once they are clean: its
    /// clients (put, mkfs --rootdir) write each file once and never read it back, so a
    /// written-back folio is memory held for nothing, and the cache stays as small as
    /// the dirty data.
    pub(crate) fn writeback_locked(&self, inode: &Arc<Inode>) -> Result<()> {
        self.writeback_runs(inode)?;
        if self.single_transaction() {
            with_cache(self, inode, |pc| {
                let clean = pc.dirty_blocks == 0 && pc.new_blocks == 0 && pc.ordered.is_empty();
                if clean && !pc.folios.is_empty() {
                    pc.folios.clear();
                }
            });
        }
        Ok(())
    }

    /// Write back the dirty runs of `inode` (its lock held exclusively).
    fn writeback_runs(&self, inode: &Arc<Inode>) -> Result<()> {
        let id = inode.id;
        let bs = self.info().sectorsize;
        let bsz = u64::from(bs);
        let (i_size, runs) = {
            let pc = inode.mapping.pages.lock();
            let Some(i_size) = pc.i_size else { return Ok(()) };
            assert!(pc.ordered.is_empty(), "{id}: ordered extents alive outside a writeback");
            // Nothing dirty: no walk over the folios (a clean cached file is written
            // back before every clone or dedupe of it).
            if pc.dirty_blocks == 0 {
                return Ok(());
            }
            let mut runs: Vec<(u64, u64)> = Vec::new();
            for f in pc.folios.values() {
                let mut b = 0;
                while b < f.nblocks() {
                    let s = f.dirty.find_next(b, true);
                    if s >= f.nblocks() {
                        break;
                    }
                    let e = f.dirty.find_next(s, false);
                    let (start, len) = (f.start + u64::from(s) * bsz, u64::from(e - s) * bsz);
                    match runs.last_mut() {
                        Some(r) if r.0 + r.1 == start => r.1 += len,
                        _ => runs.push((start, len)),
                    }
                    b = e;
                }
            }
            (i_size, runs)
        };
        if runs.is_empty() {
            return Ok(());
        }
        // In batches of runs, each whole folios: delalloc for the batch's runs (its
        // metadata reserved), then its I/O and completions, which give the
        // reservation back before the next batch takes one. A writeback of many small
        // runs (random writes over a large file) would otherwise reserve for all of
        // them at once and fail for want of metadata space it never needs together.
        let max = max_ordered_extent(self);
        // Whether run k starts in the folio slot run k - 1 ends in.
        let shares_folio = |runs: &[(u64, u64)], k: usize| {
            (runs[k].0 / FOLIO_SIZE) == (runs[k - 1].0 + runs[k - 1].1 - 1) / FOLIO_SIZE
        };
        let mut runs = runs;
        let mut first_err: Option<crate::error::Error> = None;
        let mut next = 0;
        // The first delalloc picks the route (`run_delalloc_range`); the direct one
        // takes every run at once, before anything was allocated.
        let mut routed = false;
        while next < runs.len() {
            // 1. Delalloc, run by run, until the batch's reservation is large or the
            // space runs out.
            let mut oes: Vec<OrderedExtent> = Vec::new();
            let mut per_run: Vec<usize> = Vec::new();
            let mut reserved = 0u64;
            let mut stop: Option<crate::error::Error> = None;
            let mut k = next;
            while k < runs.len() {
                // A batch ends only where a folio does.
                let boundary = k > next && !shares_folio(&runs, k);
                if boundary && reserved >= BATCH_RESERVE {
                    break;
                }
                let (s, l) = runs[k];
                let delalloc = if routed {
                    self.write(|w| w.run_delalloc(id.root, id.ino, s, l, max))
                        .map(Delalloc::Ordered)
                } else {
                    self.first_delalloc(inode, &runs, max, i_size)
                };
                match delalloc {
                    Ok(Delalloc::Inline) => {
                        with_cache(self, inode, |pc| {
                            pc.clear_dirty(0, l);
                            pc.disk_i_size = i_size;
                            pc.new_from = i_size;
                        });
                        return Ok(());
                    }
                    Ok(Delalloc::Direct) => {
                        assert!(oes.is_empty() && next == 0, "{id}: direct route after delalloc");
                        return self.writeback_direct(inode, i_size, &runs);
                    }
                    Ok(Delalloc::Ordered(v)) => {
                        routed = true;
                        reserved += v.iter().map(|o| o.meta_rsv).sum::<u64>();
                        per_run.push(v.len());
                        oes.extend(v);
                        k += 1;
                    }
                    Err(e) => {
                        stop = Some(e);
                        break;
                    }
                }
            }
            // Out of space part way: the batch ends at the last folio boundary before
            // the run that failed, and what was reserved past it goes back.
            let mut j = k;
            if stop.is_some() {
                while j > next && shares_folio(&runs, j) {
                    j -= 1;
                }
            }
            let keep: usize = per_run[..j - next].iter().sum();
            let back: Vec<OrderedExtent> = oes.drain(keep..).collect();
            if !back.is_empty() {
                self.write(|w| {
                    for o in back {
                        w.cancel_ordered(o);
                    }
                    Ok(())
                })?;
            }
            if j == next {
                let stop = stop.expect("a batch ends empty only on an error");
                // One run too long for the metadata its extents need at once (free
                // data space in many pieces takes an extent, and its reservation,
                // each): it goes in two parts, split where a folio slot ends.
                let (s, l) = runs[next];
                let mid =
                    ((s + l / 2) / FOLIO_SIZE * FOLIO_SIZE).max((s / FOLIO_SIZE + 1) * FOLIO_SIZE);
                if stop.posix_kind() == Some(crate::error::PosixKind::NoSpace) && mid < s + l {
                    runs[next] = (s, mid - s);
                    runs.insert(next + 1, (mid, s + l - mid));
                    continue;
                }
                // Nothing of the next batch fits: its data stays dirty.
                return Err(stop);
            }
            let (lo, hi) = (runs[next].0, runs[j - 1].0 + runs[j - 1].1);
            if let Err(e) = self.writeback_batch(inode, i_size, oes, lo, hi) {
                first_err.get_or_insert(e);
            }
            next = j;
        }
        if first_err.is_none() {
            // Unless the cache let the inode go meanwhile: once its folios are clean,
            // another thread's eviction may drop them all and forget the sizes
            // (`forget_sizes`), to read them from the trees at the next use.
            let pc = inode.mapping.pages.lock();
            assert!(
                pc.i_size.is_none() || pc.disk_i_size == i_size,
                "{id}: on-disk size {} after a clean writeback differs from i_size {i_size}",
                pc.disk_i_size
            );
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The first delalloc of a writeback, which picks its route
    /// (`FsWriter::run_delalloc_range`). A file within its first block whose one
    /// dirty block is that block takes its bytes along, to be written inline at once
    /// when they fit; the block stops being new as its data goes in (a getattr in
    /// between would count it twice in st_blocks), and is new again if it did not.
    fn first_delalloc(
        &self,
        inode: &Arc<Inode>,
        runs: &[(u64, u64)],
        max: u64,
        i_size: u64,
    ) -> Result<Delalloc> {
        let id = inode.id;
        let bsz = u64::from(self.info().sectorsize);
        let (s, l) = runs[0];
        let whole = (runs.len() == 1 && s == 0 && l == bsz && i_size < bsz)
            .then(|| {
                with_cache(self, inode, |pc| {
                    let mut b = vec![0u8; i_size as usize];
                    if pc.copy_out(0, &mut b) != i_size {
                        return None;
                    }
                    let before = pc.new_blocks;
                    pc.clear_new(0, l);
                    Some((b, before != pc.new_blocks))
                })
            })
            .flatten();
        let r = self.write(|w| {
            w.run_delalloc_range(
                id.root,
                id.ino,
                s,
                l,
                max,
                i_size,
                whole.as_ref().map(|w| &w.0[..]),
            )
        });
        if let Some((_, true)) = whole {
            if !matches!(r, Ok(Delalloc::Inline)) {
                with_cache(self, inode, |pc| pc.mark_new(&[(0, l)]));
            }
        }
        r
    }

    /// Steps 2 to 4 of a writeback for the folios over [lo, hi), whose dirty blocks
    /// the ordered extents `oes` cover: writepage each, write the bios as they close,
    /// then complete the ordered extents in file order.
    fn writeback_batch(
        &self,
        inode: &Arc<Inode>,
        i_size: u64,
        oes: Vec<OrderedExtent>,
        lo: u64,
        hi: u64,
    ) -> Result<()> {
        let id = inode.id;
        let bs = self.info().sectorsize;
        with_cache(self, inode, |pc| {
            for o in oes {
                pc.ordered.insert(o, bs);
            }
        });
        // 2 and 3. Writepage each folio, writing bios as they close.
        let first = lo / FOLIO_SIZE * FOLIO_SIZE;
        let starts: Vec<u64> = inode
            .mapping
            .pages
            .lock()
            .folios
            .range(first..hi)
            .map(|(_, f)| f)
            .filter(|f| !f.dirty.is_empty())
            .map(|f| f.start)
            .collect();
        let mut ctrl = BioCtrl::new(SubmitMode::ExtentByExtent);
        let mut first_err: Option<crate::error::Error> = None;
        for (i, fstart) in starts.iter().enumerate() {
            let res = with_cache(self, inode, |pc| {
                let f = pc
                    .folios
                    .get_mut(fstart)
                    .expect("a dirty folio stays while its inode's lock is held");
                let r = extent_writepage(f, &mut pc.ordered, i_size, &mut ctrl);
                pc.dirty_blocks -= r.cleared_blocks;
                r
            });
            if let Some(at) = res.first_error {
                first_err.get_or_insert_with(|| {
                    crate::error::Error::io(
                        format!("writeback {id}"),
                        std::io::Error::other(format!("no ordered extent for offset {at}")),
                    )
                });
            }
            if i + 1 == starts.len() {
                ctrl.submit();
            }
            for b in std::mem::take(&mut ctrl.ready) {
                if let Err(e) = self.write_bio(inode, &b) {
                    first_err.get_or_insert(e);
                }
            }
        }
        // 4. Complete, in file order.
        let done = with_cache(self, inode, |pc| {
            let left: Vec<(u64, u64)> = pc
                .ordered
                .iter()
                .filter(|o| o.bytes_left > 0)
                .map(|o| (o.file_offset, o.bytes_left))
                .collect();
            assert!(
                left.is_empty(),
                "{id}: ordered extents with bytes left after writeback: {left:?}"
            );
            let done = pc.ordered.take_finished();
            done.into_iter()
                .map(|oe| {
                    let new = pc.new_bytes_in(oe.file_offset, oe.logical_len());
                    (oe, new)
                })
                .collect::<Vec<_>>()
        });
        let mut disk = None;
        let mut settled = 0;
        for (oe, new) in done {
            let truncated = oe.truncated;
            match self.write(|w| w.finish_ordered(id.root, id.ino, oe, i_size, new)) {
                Ok(f) => {
                    disk = Some(f.disk_i_size);
                    settled += f.settled;
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
            self.pages.ordered_finished.fetch_add(1, Ordering::Relaxed);
            if truncated {
                self.pages.ordered_truncated.fetch_add(1, Ordering::Relaxed);
            }
        }
        with_cache(self, inode, |pc| {
            if let Some(d) = disk {
                pc.disk_i_size = d;
                pc.new_from = d;
            }
            // Every written block leaves the new ones, whether its extent went in (its
            // bytes are in nbytes now) or not (an I/O error lost them).
            pc.clear_new_written(&starts, settled);
        });
        first_err.map_or(Ok(()), Err)
    }

    /// Write bio `b` of `inode`: copy its bytes out of the cache, checksum them into
    /// its ordered extent, write every copy, then complete it on its folios.
    fn write_bio(&self, inode: &Arc<Inode>, b: &Bio) -> Result<()> {
        let ss = self.info().sectorsize as usize;
        let nodatasum = inode
            .mapping
            .pages
            .lock()
            .ordered
            .lookup(b.file_offset)
            .expect("a bio's ordered extent is alive")
            .nodatasum;
        let mut csums = Vec::new();
        // In pieces through the thread's I/O buffer: one buffer the size of a large
        // bio would cost a page fault per page.
        let chunk = (crate::volumes::device::IO_BUF_KEEP / ss * ss) as u64;
        let io =
            crate::volumes::device::with_io_buf(b.len.min(chunk) as usize, |raw| -> Result<()> {
                let mut done = 0u64;
                while done < b.len {
                    let n = (b.len - done).min(chunk);
                    let (start, buf) = (b.file_offset + done, &mut raw[..n as usize]);
                    let got = inode.mapping.pages.lock().copy_out(start, buf);
                    assert_eq!(
                        got, n,
                        "bio {}+{}: folios missing under writeback at {start}",
                        b.file_offset, b.len
                    );
                    if !nodatasum {
                        crate::extent::csum_tree::append_sector_csums(
                            self.info().csum_type,
                            ss,
                            buf,
                            &mut csums,
                        );
                    }
                    crate::volumes::write_logical(
                        &self.info().chunk_map,
                        &self.info().devices,
                        b.disk_bytenr + done,
                        buf,
                        crate::volumes::WriteKind::Data,
                    )?;
                    done += n;
                }
                Ok(())
            });
        let ok = io.is_ok();
        with_cache(self, inode, |pc| {
            if ok && !nodatasum {
                let oe =
                    pc.ordered.lookup_mut(b.file_offset).expect("a bio's ordered extent is alive");
                let cs = self.info().csum_type.size();
                let first = ((b.file_offset - oe.file_offset) / ss as u64) as usize;
                oe.csums[first * cs..first * cs + csums.len()].copy_from_slice(&csums);
                for c in &mut oe.csummed[first..first + csums.len() / cs] {
                    *c = true;
                }
            }
            let starts: Vec<u64> = pc
                .folios
                .range(..b.file_offset + b.len)
                .rev()
                .take_while(|(_, f)| f.end() > b.file_offset)
                .map(|(&s, _)| s)
                .collect();
            for s in starts {
                let f = pc.folios.get_mut(&s).expect("listed above");
                let (st, e) = (f.start.max(b.file_offset), f.end().min(b.file_offset + b.len));
                complete_bio(f, &mut pc.ordered, b, st, e - st, ok);
            }
        });
        io
    }

    /// Write back runs of dirty blocks through the direct path (`write_file`'s), for
    /// the inodes the module notes name. Dirty bits go first; blocks past EOF are
    /// dropped.
    fn writeback_direct(&self, inode: &Arc<Inode>, i_size: u64, runs: &[(u64, u64)]) -> Result<()> {
        let id = inode.id;
        // Each run in pieces gathered in an I/O buffer (aligned, so the write goes from
        // it without another copy); a piece's plain data goes into one extent. A mount
        // uses the thread's kept buffer (8 MiB): its runs are cut by the dirty limit
        // anyway, and in place (preallocated, NOCOW) the extents are there already. An
        // offline engine writes each file back once, whole: pieces of a max-size
        // extent, a buffer of their own, give the extents the direct write of the same
        // data makes (8 MiB pieces cut a large incompressible file of a compressed
        // inode, or new data of a NOCOW one, into extents of that size), for a copy of
        // at most `MAX_EXTENT_SIZE` held beside the folios.
        let bs = u64::from(self.info().sectorsize);
        let piece = if self.single_transaction() {
            crate::inode::write::MAX_EXTENT_SIZE / bs * bs
        } else {
            crate::volumes::device::IO_BUF_KEEP as u64 / bs * bs
        };
        for &(rs, rl) in runs {
            let mut s = rs;
            while s < rs + rl {
                let l = (rs + rl - s).min(piece);
                let end = (s + l).min(i_size);
                let n = end.saturating_sub(s) as usize;
                crate::volumes::device::with_io_buf(n, |data| -> Result<()> {
                    // The blocks stop being dirty before their extents exist: their data
                    // space stays promised until the write has allocated it.
                    let _held = self.data_rsv.hold(l);
                    with_cache(self, inode, |pc| {
                        let got = pc.copy_out(s, data);
                        assert_eq!(got, n as u64, "{id}: dirty run {s}+{l} not cached whole");
                        // The direct path sets nbytes itself: the blocks stop being new
                        // as their data leaves (a getattr in between misses them for a
                        // moment).
                        pc.clear_dirty(s, l);
                        pc.clear_new(s, l);
                    });
                    if n > 0 {
                        self.write_file_raw(id, s, data, true)?;
                    }
                    Ok(())
                })?;
                s += l;
            }
        }
        with_cache(self, inode, |pc| {
            pc.disk_i_size = i_size.max(pc.disk_i_size).min(i_size);
            pc.new_from = pc.disk_i_size;
        });
        Ok(())
    }
}

/// Test hook and bench knob: the largest ordered extent delalloc makes.
fn max_ordered_extent(e: &Engine) -> u64 {
    e.pages.max_extent.load(Ordering::Acquire)
}

/// A log sync in flight: its end (with the logging it made durable, if it did) is
/// recorded and signalled when this is dropped.
struct InFlight<'a> {
    e: &'a Engine,
    synced: Option<u64>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut s = self.e.log_sync.lock().unwrap_or_else(|p| p.into_inner());
        s.in_flight = false;
        if let Some(seq) = self.synced {
            s.synced = s.synced.max(seq);
            s.syncs += 1;
        }
        drop(s);
        self.e.log_synced.notify_all();
    }
}
