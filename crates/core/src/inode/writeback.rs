//! Writeback of the page cache: delalloc, `extent_writepage` and the completion of
//! ordered extents (the kernel's extent_io.c `extent_writepage`,
//! `extent_writepage_io`, `submit_extent_folio`, and inode.c's `cow_file_range`).
//!
//! Commit does NOT write dirty pages back: `Engine::commit` commits what the trees
//! hold. `Engine::sync` (writeback_all + commit) and `Engine::fsync` (one inode +
//! commit) are what make buffered data durable; a mount calls `writeback_all` before
//! each periodic commit.
//!
//! One inode's writeback (`Engine::writeback_inode`) holds the inode's lock
//! exclusively from delalloc to the last completion, so no buffered write, truncation
//! or other extent change meets a half-written range, and ordered extents never
//! outlive it:
//! 1. Delalloc: every run of dirty blocks gets data extents of at most the maximum
//!    extent size (`FsWriter::run_delalloc`), each an ordered extent (`ordered`).
//!    The runs are what writes dirtied, EOF or not: a truncation leaves the straddling
//!    folio's blocks past EOF dirty (`page_cache`).
//! 2. `extent_writepage` per folio with dirty blocks, extent by extent (the kernel's successor of `submit_one_sector`): each
//!    run of dirty blocks is cut at `round_up(i_size)` and at the end of its ordered
//!    extent, and submitted as one piece; a run past `round_up(i_size)` truncates
//!    *every* ordered extent in it and finishes its blocks without I/O; a block with no
//!    ordered extent is finished with an error alone and the walk goes on at the next
//!    block. `SubmitMode::BlockByBlock` is the pre-change kernel (one lookup and one
//!    submission per block), kept for the writeback benchmark and to test that both give
//!    the same bios.
//! 3. Bios (`BioCtrl`) grow while a piece is contiguous in file offset and on disk and
//!    inside the same ordered extent; they are written (and checksummed) when they
//!    close, and their completion clears writeback and counts down the ordered extent.
//! 4. Ordered extents with nothing left complete in file order (`finish_ordered`).
//!
//! Five invariants of writeback are asserted: (1) every dirty block
//! ends submitted, truncated or in error (`WritepageResult` sums, and no ordered
//! extent is left with bytes at the end); (2) dirty is cleared before writeback is set
//! (`Folio` never has both, `page_cache` checks); (3) bios split at ordered-extent
//! boundaries and grow only while contiguous in file offset and on disk
//! (`BioCtrl::add`); (4) nothing at or past `round_up(i_size)` becomes a file extent
//! item and (5) every file extent item written has checksums for all its sectors
//! (`finish_ordered`).
//!
//! Inodes whose data does not go through plain COW extents are written back through
//! the direct path (`Engine::write_file`'s, no ordered extents): NOCOW or PREALLOC
//! inodes (writes may go in place), compressed ones (the stream decides the extent),
//! and files that are or will be inline (size up to max_inline, or an inline extent
//! on disk).

use crate::engine::Engine;
use crate::error::Result;
use crate::inode::filesystem::{ExtentKind, FsRead, InodeId, Load};
use crate::inode::inode_cache::Inode;
use crate::inode::ordered::{OrderedExtent, OrderedTree};
use crate::inode::page_cache::{with_cache, Folio, FOLIO_SIZE};
use crate::transaction::FsWriter;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// How `extent_writepage` walks a folio's dirty blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SubmitMode {
    /// One ordered-extent lookup and one submission per block (the kernel's
    /// writeback before it went extent by extent).
    BlockByBlock,
    /// One lookup and one submission per contiguous piece.
    ExtentByExtent,
}

/// A submission: `len` bytes of file data at `file_offset`, to disk at `disk_bytenr`,
/// inside the ordered extent at `oe_start`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bio {
    pub file_offset: u64,
    pub disk_bytenr: u64,
    pub len: u64,
    pub oe_start: u64,
}

/// The bio being built and those closed (`btrfs_bio_ctrl`).
#[derive(Debug)]
pub struct BioCtrl {
    pub mode: SubmitMode,
    cur: Option<Bio>,
    len_to_oe_boundary: u64,
    /// Closed bios, ready for I/O.
    pub ready: Vec<Bio>,
    /// Ordered-extent lookups and `add` calls so far (the bench's counts).
    pub lookups: u64,
    pub adds: u64,
}

impl BioCtrl {
    pub fn new(mode: SubmitMode) -> BioCtrl {
        BioCtrl { mode, cur: None, len_to_oe_boundary: 0, ready: Vec::new(), lookups: 0, adds: 0 }
    }

    /// Close the bio being built (`submit_one_bio`).
    pub fn submit(&mut self) {
        if let Some(b) = self.cur.take() {
            self.ready.push(b);
        }
    }

    /// Add `len` bytes at `file_offset` going to `disk` of ordered extent `oe`
    /// (`submit_extent_folio`): appended to the current bio when contiguous in both
    /// file offset and disk address and in the same ordered extent, else in a new bio;
    /// a bio reaching its ordered extent's end is closed. A bio never spans two.
    pub fn add(&mut self, file_offset: u64, disk: u64, len: u64, oe: &OrderedExtent) {
        self.adds += 1;
        assert!(
            file_offset >= oe.file_offset && file_offset + len <= oe.end(),
            "piece {file_offset}+{len} outside ordered extent {}+{}",
            oe.file_offset,
            oe.num_bytes
        );
        assert_eq!(
            disk,
            oe.disk_bytenr + (file_offset - oe.file_offset),
            "piece {file_offset}: disk address off its ordered extent's"
        );
        if let Some(b) = &mut self.cur {
            if b.file_offset + b.len == file_offset
                && b.disk_bytenr + b.len == disk
                && b.oe_start == oe.file_offset
            {
                assert!(
                    len <= self.len_to_oe_boundary,
                    "piece {file_offset}+{len} crosses the ordered extent boundary ({} left)",
                    self.len_to_oe_boundary
                );
                b.len += len;
                self.len_to_oe_boundary -= len;
                if self.len_to_oe_boundary == 0 {
                    self.submit();
                }
                return;
            }
            self.submit();
        }
        self.len_to_oe_boundary = oe.file_offset + oe.disk_num_bytes - file_offset;
        assert!(
            len <= self.len_to_oe_boundary,
            "piece {file_offset}+{len} crosses the ordered extent boundary"
        );
        self.len_to_oe_boundary -= len;
        self.cur = Some(Bio { file_offset, disk_bytenr: disk, len, oe_start: oe.file_offset });
        if self.len_to_oe_boundary == 0 {
            self.submit();
        }
    }
}

/// How a folio's dirty blocks ended (bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WritepageResult {
    pub submitted: u64,
    /// Past `round_up(i_size)`: their ordered extents truncated, finished uptodate.
    pub truncated: u64,
    /// No ordered extent: finished with an error.
    pub errors: u64,
    /// The first such block.
    pub first_error: Option<u64>,
    /// Dirty blocks cleared (all of them).
    pub cleared_blocks: u64,
}

/// Mark every ordered extent in [start, start + len) TRUNCATED at the first block of
/// it past EOF, and finish those bytes uptodate (`truncate_ordered_extents_beyond_eof`
/// then `btrfs_mark_ordered_io_finished`). Returns the bytes with no ordered extent.
fn truncate_beyond_eof(ordered: &mut OrderedTree, start: u64, len: u64) -> u64 {
    let end = start + len;
    let mut cur = start;
    let mut uncovered = 0;
    // Bounded: each round moves `cur` past an ordered extent or ends the walk.
    while cur < end {
        let Some(oe) = ordered.first_in_range(cur, end - cur) else {
            uncovered += end - cur;
            break;
        };
        if oe.file_offset > cur {
            uncovered += oe.file_offset - cur;
            cur = oe.file_offset;
        }
        let piece_end = oe.end().min(end);
        oe.truncate_at(cur);
        oe.finish_io(cur, piece_end - cur, true);
        cur = piece_end;
    }
    uncovered
}

/// Write back the dirty blocks of `folio` (`extent_writepage` + `extent_writepage_io`,
/// after delalloc made the ordered extents): see the module notes. The submissions go
/// to `ctrl`; the caller writes its closed bios and completes them (`complete_bio`).
pub fn extent_writepage(
    folio: &mut Folio,
    ordered: &mut OrderedTree,
    i_size: u64,
    ctrl: &mut BioCtrl,
) -> WritepageResult {
    let bs = u64::from(folio.blocksize);
    let rounded_isize = i_size.div_ceil(bs) * bs;
    let mut res = WritepageResult::default();
    // Zero the folio past EOF: those bytes must not reach disk as file data.
    if folio.start < i_size && i_size < folio.end() {
        let from = (i_size - folio.start) as usize;
        folio.data[from..].fill(0);
    }
    let submit_bitmap = folio.dirty.clone();
    let dirty_before = u64::from(submit_bitmap.count());
    let n = folio.nblocks();
    let at = |b: u32| folio.start + u64::from(b) * bs;
    match ctrl.mode {
        SubmitMode::ExtentByExtent => {
            let mut b = 0;
            while b < n {
                let s = submit_bitmap.find_next(b, true);
                if s >= n {
                    break;
                }
                let e = submit_bitmap.find_next(s, false);
                let cur = at(s);
                let mut blocks = e - s;
                if cur >= rounded_isize {
                    let len = u64::from(blocks) * bs;
                    let uncovered = truncate_beyond_eof(ordered, cur, len);
                    folio.dirty.clear_range(s, blocks);
                    res.truncated += len - uncovered;
                    res.errors += uncovered;
                    if uncovered > 0 && res.first_error.is_none() {
                        res.first_error = Some(cur);
                    }
                    b = e;
                    continue;
                }
                if cur + u64::from(blocks) * bs > rounded_isize {
                    blocks = ((rounded_isize - cur) / bs) as u32;
                }
                ctrl.lookups += 1;
                let Some(oe) = ordered.lookup(cur) else {
                    // The pending bio may go on in other folios: close it so it
                    // completes normally, then finish this one block with an error.
                    ctrl.submit();
                    folio.dirty.clear_range(s, 1);
                    folio.writeback.set_range(s, 1);
                    folio.writeback.clear_range(s, 1);
                    res.errors += bs;
                    res.first_error.get_or_insert(cur);
                    b = s + 1;
                    continue;
                };
                let len = (u64::from(blocks) * bs).min(oe.end() - cur);
                let nb = (len / bs) as u32;
                let disk = oe.disk_bytenr + (cur - oe.file_offset);
                let cleared = folio.dirty.clear_range(s, nb);
                debug_assert_eq!(cleared, nb, "blocks of a dirty run were not dirty");
                folio.writeback.set_range(s, nb);
                ctrl.add(cur, disk, len, oe);
                res.submitted += len;
                b = s + nb;
            }
        }
        SubmitMode::BlockByBlock => {
            let mut b = submit_bitmap.find_next(0, true);
            while b < n {
                let cur = at(b);
                if cur >= i_size {
                    let uncovered = truncate_beyond_eof(ordered, cur, bs);
                    folio.dirty.clear_range(b, 1);
                    res.truncated += bs - uncovered;
                    res.errors += uncovered;
                    if uncovered > 0 && res.first_error.is_none() {
                        res.first_error = Some(cur);
                    }
                } else {
                    ctrl.lookups += 1;
                    match ordered.lookup(cur) {
                        None => {
                            ctrl.submit();
                            folio.dirty.clear_range(b, 1);
                            res.errors += bs;
                            res.first_error.get_or_insert(cur);
                        }
                        Some(oe) => {
                            let disk = oe.disk_bytenr + (cur - oe.file_offset);
                            folio.dirty.clear_range(b, 1);
                            folio.writeback.set_range(b, 1);
                            ctrl.add(cur, disk, bs, oe);
                            res.submitted += bs;
                        }
                    }
                }
                b = submit_bitmap.find_next(b + 1, true);
            }
        }
    }
    // Invariant 1: every dirty block ended exactly one way.
    assert!(folio.dirty.is_empty(), "folio {}: dirty blocks left after writepage", folio.start);
    res.cleared_blocks = dirty_before;
    assert_eq!(
        res.submitted + res.truncated + res.errors,
        dirty_before * bs,
        "folio {}: {res:?} does not account for {dirty_before} dirty blocks",
        folio.start
    );
    res
}

/// Complete bio `b` (its I/O done, `ok` or not) on `folio`'s blocks it covers:
/// writeback cleared, its ordered extent counted down.
pub fn complete_bio(
    folio: &mut Folio,
    ordered: &mut OrderedTree,
    b: &Bio,
    start: u64,
    len: u64,
    ok: bool,
) {
    let s = folio.block_of(start);
    let nb = (len / u64::from(folio.blocksize)) as u32;
    let cleared = folio.writeback.clear_range(s, nb);
    assert_eq!(
        cleared, nb,
        "bio {}+{}: blocks of folio {} were not under writeback",
        b.file_offset, b.len, folio.start
    );
    let oe = ordered
        .lookup_mut(start)
        .expect("a submitted block has its ordered extent until the bio completes");
    assert_eq!(
        oe.file_offset, b.oe_start,
        "bio {} completes in another ordered extent",
        b.file_offset
    );
    oe.finish_io(start, len, ok);
}

/// Metadata a writeback reserves for one batch of ordered extents before it writes
/// them and gives the reservation back (a batch passes it by one run at most).
const BATCH_RESERVE: u64 = 64 << 20;

/// Test hook and bench knob: the largest ordered extent delalloc makes.
pub(crate) fn max_ordered_extent(e: &Engine) -> u64 {
    e.pages.max_extent.load(Ordering::Acquire)
}

impl FsWriter {
    /// Whether inode `ino` of size `i_size` is written back through the direct path
    /// (see the module notes).
    pub fn writeback_through_direct_path(
        &mut self,
        root: u64,
        ino: u64,
        i_size: u64,
    ) -> Result<bool> {
        let ii = self.live().load_inode(InodeId { root, ino }, Load::ITEM)?.item;
        let flags = ii.flags.get();
        if crate::inode::nocow::nocow_capable(flags)
            || flags & ubtrfs_format::structs::INODE_PREALLOC != 0
        {
            return Ok(true);
        }
        if i_size <= self.max_inline() {
            return Ok(true);
        }
        let prop = self.compression_prop(root, ino, &ii)?;
        if self.compress_choice(&ii, prop).is_some() {
            return Ok(true);
        }
        Ok(self
            .live()
            .file_extents(InodeId { root, ino }, 0, 1)?
            .iter()
            .any(|f| matches!(f.kind, ExtentKind::Inline { .. })))
    }
}

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

    /// Write back every inode with dirty data.
    ///
    /// # Errors
    /// The first error of `writeback_inode`; the other inodes are written back still.
    pub fn writeback_all(&self) -> Result<()> {
        let held: Vec<InodeId> = self.pages.registry().keys().copied().collect();
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

    /// Make file `id` durable: write it back, then commit. Returns the generation on disk.
    ///
    /// # Errors
    /// As `writeback_inode` and `commit`.
    pub fn fsync(&self, id: InodeId) -> Result<u64> {
        self.writeback_inode(id)?;
        self.commit()
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

    /// `writeback_inode` with the inode's lock held exclusively.
    pub(crate) fn writeback_locked(&self, inode: &Arc<Inode>) -> Result<()> {
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
        if self.write_retrying(|w| w.writeback_through_direct_path(id.root, id.ino, i_size))? {
            return self.writeback_direct(inode, i_size, &runs);
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
                match self.write(|w| w.run_delalloc(id.root, id.ino, s, l, max)) {
                    Ok(v) => {
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
            let d = inode.mapping.pages.lock().disk_i_size;
            assert_eq!(d, i_size, "{id}: on-disk size after a clean writeback differs from i_size");
        }
        first_err.map_or(Ok(()), Err)
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
        // The direct path stamps its writes' times; writeback must not (the buffered
        // writes set them): put back what they were.
        let before = self.read(|l| l.load_inode(id, Load::ITEM))?.item;
        let r = self.writeback_direct_runs(inode, i_size, runs);
        self.write_retrying(|w| {
            w.update_inode(id.root, id.ino, |i| {
                i.mtime = before.mtime;
                i.ctime = before.ctime;
            })
        })?;
        r
    }

    fn writeback_direct_runs(
        &self,
        inode: &Arc<Inode>,
        i_size: u64,
        runs: &[(u64, u64)],
    ) -> Result<()> {
        let id = inode.id;
        // Each run in pieces gathered in the thread's I/O buffer (aligned, so the
        // write goes from it without another copy).
        let piece = (crate::volumes::device::IO_BUF_KEEP as u64)
            / u64::from(self.info().sectorsize)
            * u64::from(self.info().sectorsize);
        for &(rs, rl) in runs {
            let mut s = rs;
            while s < rs + rl {
                let l = (rs + rl - s).min(piece);
                let end = (s + l).min(i_size);
                let n = end.saturating_sub(s) as usize;
                crate::volumes::device::with_io_buf(n, |data| -> Result<()> {
                    // The blocks stop being dirty before their extents exist: their data
                    // space stays promised until the write has allocated it.
                    let _held = self.info().data_rsv.hold(l);
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
