//! Ordered extents: a data extent allocated for a dirty range at delalloc time, alive
//! until every byte of it is written or finished otherwise (the kernel's
//! `btrfs_ordered_extent`, ordered-data.c). Completion (`data::delalloc`, `FsWriter::finish_ordered`)
//! puts the range into the trees: the EXTENT_DATA item (cut to `truncated_len` when
//! TRUNCATED, none when that is 0), the data checksums of what was written, the data
//! ref, the inode's nbytes and on-disk size; the space of a truncated tail goes back.
//!
//! Invariants (`OrderedTree::check_invariants`): extents are block-aligned, disjoint,
//! keyed by their file offset; `bytes_left <= num_bytes`; `truncated_len <= num_bytes`
//! and equal to it unless TRUNCATED; uncompressed, so `disk_num_bytes == num_bytes`;
//! the checksums of written blocks sit at their block's index.
//!
//! Neighbours: `data::delalloc` creates them (`FsWriter::run_delalloc`), `writeback` submits their
//! blocks and finishes them; `page_cache` keeps the tree of one inode.

use crate::mapping::MAX_EXTENT_SIZE;
use std::collections::BTreeMap;

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
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn new(blocksize: u32) -> OrderedTree {
        OrderedTree { map: BTreeMap::new(), blocksize: u64::from(blocksize) }
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    #[cfg(any(test, feature = "test-hooks"))]
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
    #[cfg(any(test, feature = "test-hooks"))]
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
