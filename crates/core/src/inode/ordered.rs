//! Ordered extents: a data extent allocated for a dirty range at delalloc time, alive
//! until every byte of it is written or finished otherwise (the kernel's
//! `btrfs_ordered_extent`, ordered-data.c). Completion (`FsWriter::finish_ordered`)
//! puts the range into the trees: the EXTENT_DATA item (cut to `truncated_len` when
//! TRUNCATED, none when that is 0), the data checksums of what was written, the data
//! ref, the inode's nbytes and on-disk size; the space of a truncated tail goes back.
//!
//! Invariants (`OrderedTree::check_invariants`): extents are block-aligned, disjoint,
//! keyed by their file offset; `bytes_left <= num_bytes`; `truncated_len <= num_bytes`
//! and equal to it unless TRUNCATED; uncompressed, so `disk_num_bytes == num_bytes`;
//! the checksums of written blocks sit at their block's index.
//!
//! Neighbours: `writeback` creates them (`FsWriter::run_delalloc`), submits their
//! blocks and finishes them; `page_cache` keeps the tree of one inode.

use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{FsRead, InodeId, Load};
use crate::inode::write::{reg_extent_item, MAX_EXTENT_SIZE};
use crate::inode::writer::FsWriter;
use std::collections::BTreeMap;
use ubtrfs_format::key::EXTENT_DATA_KEY;
use ubtrfs_format::structs::{BLOCK_GROUP_DATA, S_IFMT, S_IFREG};
use ubtrfs_format::Key;

/// One ordered extent.
#[derive(Debug, Clone)]
pub struct OrderedExtent {
    pub file_offset: u64,
    pub num_bytes: u64,
    pub disk_bytenr: u64,
    pub disk_num_bytes: u64,
    /// Bytes not yet written or finished.
    pub bytes_left: u64,
    /// BTRFS_ORDERED_TRUNCATED: blocks past EOF were finished without a write.
    pub truncated: bool,
    /// With `truncated`: only [file_offset, file_offset + truncated_len) goes in the trees.
    pub truncated_len: u64,
    /// A block was finished with an error: the extent completes without an item.
    pub io_error: bool,
    pub nodatasum: bool,
    /// Checksums of the written blocks, `csum_size` bytes per block at its index.
    pub csums: Vec<u8>,
    /// Blocks whose checksum is in `csums`.
    pub csummed: Vec<bool>,
    /// Metadata reserved at delalloc for the completion's insertions.
    pub(crate) meta_rsv: u64,
}

impl OrderedExtent {
    pub fn new(
        file_offset: u64,
        num_bytes: u64,
        disk_bytenr: u64,
        blocksize: u32,
        csum_size: usize,
        nodatasum: bool,
    ) -> OrderedExtent {
        let bs = u64::from(blocksize);
        assert!(
            num_bytes > 0 && num_bytes.is_multiple_of(bs) && file_offset.is_multiple_of(bs),
            "ordered extent {file_offset}+{num_bytes} not block aligned"
        );
        let blocks = (num_bytes / bs) as usize;
        OrderedExtent {
            file_offset,
            num_bytes,
            disk_bytenr,
            disk_num_bytes: num_bytes,
            bytes_left: num_bytes,
            truncated: false,
            truncated_len: num_bytes,
            io_error: false,
            nodatasum,
            csums: vec![0; if nodatasum { 0 } else { blocks * csum_size }],
            csummed: vec![false; if nodatasum { 0 } else { blocks }],
            meta_rsv: 0,
        }
    }

    pub fn end(&self) -> u64 {
        self.file_offset + self.num_bytes
    }

    /// The length the trees get (`truncated_len` when TRUNCATED).
    pub fn logical_len(&self) -> u64 {
        if self.truncated {
            self.truncated_len
        } else {
            self.num_bytes
        }
    }

    /// Mark the extent TRUNCATED at `at` (a block past EOF): only what lies before it
    /// goes in the trees (`btrfs_mark_ordered_io_truncated`).
    pub fn truncate_at(&mut self, at: u64) {
        assert!(
            at >= self.file_offset && at <= self.end(),
            "truncating ordered extent {}+{} at {at}",
            self.file_offset,
            self.num_bytes
        );
        self.truncated = true;
        self.truncated_len = self.truncated_len.min(at - self.file_offset);
    }

    /// Account `len` bytes from `start` as done (written, or finished without a write);
    /// true when the extent has nothing left.
    pub fn finish_io(&mut self, start: u64, len: u64, uptodate: bool) -> bool {
        assert!(
            start >= self.file_offset && start + len <= self.end(),
            "finishing {start}+{len} of ordered extent {}+{}",
            self.file_offset,
            self.num_bytes
        );
        assert!(
            len <= self.bytes_left,
            "finishing {len} bytes of ordered extent {} with {} left",
            self.file_offset,
            self.bytes_left
        );
        self.bytes_left -= len;
        if !uptodate {
            self.io_error = true;
        }
        self.bytes_left == 0
    }

    fn check(&self, bs: u64) {
        let at = self.file_offset;
        assert!(self.num_bytes > 0, "ordered extent {at}: empty");
        assert_eq!(
            self.num_bytes % bs,
            0,
            "ordered extent {at}: length {} not block aligned",
            self.num_bytes
        );
        assert_eq!(
            self.disk_num_bytes, self.num_bytes,
            "ordered extent {at}: disk length {} for {} bytes (uncompressed)",
            self.disk_num_bytes, self.num_bytes
        );
        assert!(
            self.bytes_left <= self.num_bytes,
            "ordered extent {at}: {} bytes left of {}",
            self.bytes_left,
            self.num_bytes
        );
        assert!(
            self.truncated_len <= self.num_bytes,
            "ordered extent {at}: truncated to {} of {}",
            self.truncated_len,
            self.num_bytes
        );
        if !self.truncated {
            assert_eq!(
                self.truncated_len, self.num_bytes,
                "ordered extent {at}: truncated_len {} without TRUNCATED",
                self.truncated_len
            );
        }
        assert!(
            self.num_bytes <= MAX_EXTENT_SIZE,
            "ordered extent {at}: {} bytes, over the maximum extent size",
            self.num_bytes
        );
    }
}

/// The ordered extents of one inode, by file offset.
#[derive(Debug, Default)]
pub struct OrderedTree {
    map: BTreeMap<u64, OrderedExtent>,
    /// Block size, once an extent was added (for the checks).
    blocksize: u64,
}

impl OrderedTree {
    pub fn new(blocksize: u32) -> OrderedTree {
        OrderedTree { map: BTreeMap::new(), blocksize: u64::from(blocksize) }
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn insert(&mut self, oe: OrderedExtent, blocksize: u32) {
        self.blocksize = u64::from(blocksize);
        if let Some((_, prev)) = self.map.range(..oe.end()).next_back() {
            assert!(
                prev.end() <= oe.file_offset,
                "ordered extent {}+{} overlaps {}+{}",
                oe.file_offset,
                oe.num_bytes,
                prev.file_offset,
                prev.num_bytes
            );
        }
        self.map.insert(oe.file_offset, oe);
    }

    /// The ordered extent holding file offset `off` (`btrfs_lookup_ordered_extent`).
    pub fn lookup(&self, off: u64) -> Option<&OrderedExtent> {
        self.map.range(..=off).next_back().map(|(_, o)| o).filter(|o| off < o.end())
    }

    pub fn lookup_mut(&mut self, off: u64) -> Option<&mut OrderedExtent> {
        self.map.range_mut(..=off).next_back().map(|(_, o)| o).filter(|o| off < o.end())
    }

    /// The first ordered extent that intersects [start, start + len)
    /// (`btrfs_lookup_first_ordered_range`).
    pub fn first_in_range(&mut self, start: u64, len: u64) -> Option<&mut OrderedExtent> {
        let end = start + len;
        if self.lookup(start).is_some() {
            return self.lookup_mut(start);
        }
        self.map.range_mut(start..end).next().map(|(_, o)| o)
    }

    /// Remove and return the extent at file offset `start`.
    pub fn remove(&mut self, start: u64) -> Option<OrderedExtent> {
        self.map.remove(&start)
    }

    /// Extents with nothing left, in file order (ready to complete).
    pub fn take_finished(&mut self) -> Vec<OrderedExtent> {
        let done: Vec<u64> =
            self.map.values().filter(|o| o.bytes_left == 0).map(|o| o.file_offset).collect();
        done.iter().map(|s| self.map.remove(s).expect("listed just above")).collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = &OrderedExtent> {
        self.map.values()
    }

    pub fn check_invariants(&self) {
        let mut prev_end = 0;
        for (&k, o) in &self.map {
            assert_eq!(
                k, o.file_offset,
                "ordered tree: extent keyed {k} starts at {}",
                o.file_offset
            );
            assert!(
                k >= prev_end,
                "ordered tree: extent {k} overlaps the one before (ending {prev_end})"
            );
            prev_end = o.end();
            if self.blocksize > 0 {
                o.check(self.blocksize);
            }
        }
    }
}

/// What a completion did, for the caller's size and counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    /// The INODE_ITEM's size afterwards.
    pub disk_i_size: u64,
    /// Bytes that went in the trees as a file extent (0: no item).
    pub inserted: u64,
    /// New delalloc bytes the inode's nbytes took (`settle`, or 0 with no item).
    pub settled: u64,
}

/// Metadata items a completion of `len` bytes inserts or changes: the inode, a hole
/// before it, two split edges, the extent and its checksum leaves.
fn finish_items(w: &FsWriter, len: u64) -> u64 {
    let csum_leaf_bytes = u64::from(w.nodesize()) / 2;
    let csum_bytes = len.div_ceil(u64::from(w.sectorsize())) * w.info.csum_type.size() as u64;
    5 + csum_bytes.div_ceil(csum_leaf_bytes)
}

impl FsWriter {
    /// Delalloc for dirty range [start, start + len) of `ino` (`cow_file_range`):
    /// allocate data extents of at most `max_extent` bytes each (shorter when free
    /// space is fragmented) and return an ordered extent for each, with the metadata
    /// its completion needs reserved. Nothing is allocated on failure.
    ///
    /// # Errors
    /// `Posix(NoSpace)` for data or metadata space.
    pub fn run_delalloc(
        &mut self,
        root: u64,
        ino: u64,
        start: u64,
        len: u64,
        max_extent: u64,
    ) -> Result<Vec<OrderedExtent>> {
        self.check_root_writable(root)?;
        let bs = self.sectorsize();
        let ss = u64::from(bs);
        assert!(
            len > 0 && len.is_multiple_of(ss) && start.is_multiple_of(ss),
            "delalloc {start}+{len} not block aligned"
        );
        assert!(max_extent >= ss && max_extent.is_multiple_of(ss), "max extent {max_extent}");
        let ii = self.live().load_inode(InodeId { root, ino }, Load::ITEM)?.item;
        let nodatasum = ii.flags.get() & ubtrfs_format::structs::INODE_NODATASUM != 0;
        crate::space::allocator::reserve_data(self, len, &format!("root={root} ino={ino}"))?;
        let mut out: Vec<OrderedExtent> = Vec::new();
        let mut cur = start;
        let end = start + len;
        let undo = |w: &mut FsWriter, out: &[OrderedExtent]| {
            for o in out {
                crate::space::allocator::unreserve(w, o.disk_bytenr, o.disk_num_bytes, false);
                w.write_rsv -= o.meta_rsv;
                crate::space::allocator::release_metadata(w, o.meta_rsv);
            }
        };
        while cur < end {
            let want = (end - cur).min(max_extent).min(MAX_EXTENT_SIZE);
            let (bytenr, got) = match crate::space::allocator::alloc_extent_upto(
                self,
                BLOCK_GROUP_DATA,
                want,
                ss,
            ) {
                Ok(x) => x,
                Err(e) => {
                    undo(self, &out);
                    return Err(e);
                }
            };
            let mut oe =
                OrderedExtent::new(cur, got, bytenr, bs, self.info.csum_type.size(), nodatasum);
            let items = finish_items(self, got);
            match crate::space::allocator::reserve_metadata(self, items) {
                Ok(rsv) => {
                    self.write_rsv += rsv;
                    oe.meta_rsv = rsv;
                }
                Err(e) => {
                    crate::space::allocator::unreserve(self, bytenr, got, false);
                    undo(self, &out);
                    return Err(e);
                }
            }
            out.push(oe);
            cur += got;
        }
        Ok(out)
    }

    /// Complete ordered extent `oe` of `(root, ino)` (`btrfs_finish_one_ordered`): the
    /// file extent item for its logical length (none when 0 or after an I/O error),
    /// its checksums, the data ref, nbytes, and the on-disk size moved towards the
    /// in-memory `i_size` (never past it, never back). The unused tail's space goes back.
    /// `settle` is the new delalloc bytes of its range (the page cache's `new` blocks),
    /// which leave the in-memory inode's count as nbytes takes them
    /// (`Finished::settled` says whether they did).
    ///
    /// # Errors
    /// `Posix(NotFound)` when the inode went away (the space goes back); tree failures
    /// (which abort).
    pub fn finish_ordered(
        &mut self,
        root: u64,
        ino: u64,
        mut oe: OrderedExtent,
        i_size: u64,
        settle: u64,
    ) -> Result<Finished> {
        assert_eq!(
            oe.bytes_left, 0,
            "completing ordered extent {} with {} bytes left",
            oe.file_offset, oe.bytes_left
        );
        let ss = u64::from(self.sectorsize());
        let rsv = std::mem::take(&mut oe.meta_rsv);
        self.write_rsv -= rsv;
        let ii = match self.live().load_inode(InodeId { root, ino }, Load::ITEM) {
            Ok(v) if v.item.mode.get() & S_IFMT == S_IFREG => v.item,
            _ => {
                crate::space::allocator::unreserve(self, oe.disk_bytenr, oe.disk_num_bytes, false);
                crate::space::allocator::release_metadata(self, rsv);
                return Err(Error::posix(
                    PosixKind::NotFound,
                    format!("root={root} ino={ino} went away while its data was written back"),
                ));
            }
        };
        let old_size = ii.size.get();
        let len = if oe.io_error { 0 } else { oe.logical_len() };
        assert!(
            len.is_multiple_of(ss),
            "ordered extent {}: logical length {len} not block aligned",
            oe.file_offset
        );
        if len == 0 {
            crate::space::allocator::unreserve(self, oe.disk_bytenr, oe.disk_num_bytes, false);
            crate::space::allocator::release_metadata(self, rsv);
            return Ok(Finished { disk_i_size: old_size, inserted: 0, settled: 0 });
        }
        // Writeback invariant (4) (writeback.rs): nothing at or past round_up(i_size) becomes an extent.
        assert!(
            oe.file_offset + len <= i_size.div_ceil(ss) * ss,
            "ordered extent {}+{len} reaches past EOF {i_size}",
            oe.file_offset
        );
        if len < oe.disk_num_bytes {
            crate::space::allocator::unreserve(
                self,
                oe.disk_bytenr + len,
                oe.disk_num_bytes - len,
                false,
            );
        }
        let blocks = (len / ss) as usize;
        let cs = self.info.csum_type.size();
        if !oe.nodatasum {
            // Invariant 5: every block of the item has its checksum.
            let missing = oe.csummed[..blocks].iter().position(|c| !c);
            assert!(
                missing.is_none(),
                "ordered extent {}+{len}: block {missing:?} has no checksum",
                oe.file_offset
            );
        }
        let mut h = self.start_transaction_reserved("finish_ordered", rsv)?;
        let r = (|| -> Result<Finished> {
            let w = &mut *h;
            if oe.file_offset > old_size {
                w.insert_hole_before(root, ino, old_size, oe.file_offset)?;
            }
            let removed = w.drop_extents_inner(root, ino, oe.file_offset, oe.file_offset + len)?;
            w.delayed.add_data_ref(
                oe.disk_bytenr,
                len,
                crate::extent::delayed_ref::RefKind::Data { root, ino, offset: oe.file_offset },
                1,
                true,
            )?;
            if !oe.nodatasum {
                crate::extent::csum_tree::insert_csums(
                    w,
                    oe.disk_bytenr,
                    &oe.csums[..blocks * cs],
                )?;
            }
            let fe = reg_extent_item(w.transid, oe.disk_bytenr, len);
            w.insert_item(root, &Key::new(ino, EXTENT_DATA_KEY, oe.file_offset), &fe)?;
            let new_size = old_size.max((oe.file_offset + len).min(i_size));
            w.update_written_back_inode(root, ino, new_size, removed, len, settle)?;
            Ok(Finished { disk_i_size: new_size, inserted: len, settled: settle })
        })();
        h.end_with(r)
    }

    /// Give back an ordered extent that will not complete (its delalloc failed part
    /// way, or its inode is being discarded).
    pub fn cancel_ordered(&mut self, oe: OrderedExtent) {
        crate::space::allocator::unreserve(self, oe.disk_bytenr, oe.disk_num_bytes, false);
        self.write_rsv -= oe.meta_rsv;
        crate::space::allocator::release_metadata(self, oe.meta_rsv);
    }
}
