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
//!    extent size (`FsWriter::run_delalloc_range`, which at the first run also picks
//!    the route, below), each an ordered extent (`ordered`).
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

use crate::error::Result;
use crate::inode::filesystem::{ExtentKind, FsRead, InodeId};
use crate::inode::writer::FsWriter;
use crate::mapping::ordered::{OrderedExtent, OrderedTree};
use crate::mapping::page_cache::Folio;

/// How `extent_writepage` walks a folio's dirty blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SubmitMode {
    /// One ordered-extent lookup and one submission per block (the kernel's
    /// writeback before it went extent by extent).
    #[cfg(any(test, feature = "test-hooks"))]
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
        #[cfg(any(test, feature = "test-hooks"))]
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

impl FsWriter {
    /// Whether inode `ino` (item `ii`) of in-memory size `i_size` is written back
    /// through the direct path (see the module notes), decided once per writeback at
    /// its first delalloc (`run_delalloc_range`), as the kernel's `run_delalloc_range`
    /// picks nocow, compression, inline or plain COW.
    pub(crate) fn direct_route(
        &mut self,
        root: u64,
        ino: u64,
        ii: &ubtrfs_format::structs::InodeItem,
        i_size: u64,
    ) -> Result<bool> {
        if crate::data::nocow::may_write_in_place(ii.flags.get()) {
            return Ok(true);
        }
        if i_size <= self.max_inline() {
            return Ok(true);
        }
        let prop = self.compression_prop(root, ino, ii)?;
        if self.compress_choice(ii, prop).is_some() {
            return Ok(true);
        }
        // A file empty on disk has no extent, inline or not (most files a copy
        // writes back are new).
        if ii.size.get() == 0 {
            return Ok(false);
        }
        Ok(self
            .live()
            .file_extents(InodeId { root, ino }, 0, 1)?
            .iter()
            .any(|f| matches!(f.kind, ExtentKind::Inline { .. })))
    }
}
