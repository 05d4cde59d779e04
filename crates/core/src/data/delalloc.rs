//! Delalloc and the completion of ordered extents (`mapping::ordered`): the kernel's
//! `cow_file_range` (`FsWriter::run_delalloc`: data extents allocated for a dirty range,
//! an ordered extent each) and `btrfs_finish_ordered_io` (`FsWriter::finish_ordered`:
//! the EXTENT_DATA item, the checksums, the data ref, the inode's nbytes and on-disk
//! size), or their cancellation.

use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::InodeId;
use crate::inode::write::{reg_extent_item, MAX_EXTENT_SIZE};
use crate::inode::writer::FsWriter;
use crate::mapping::ordered::{Finished, OrderedExtent};
use ubtrfs_format::key::EXTENT_DATA_KEY;
use ubtrfs_format::structs::{BLOCK_GROUP_DATA, S_IFMT, S_IFREG};
use ubtrfs_format::Key;

/// How a writeback's dirty runs go to disk, as its first delalloc chose
/// (`FsWriter::run_delalloc_range`).
#[derive(Debug)]
pub enum Delalloc {
    /// Plain COW: the first run's ordered extents (the other runs take theirs from
    /// `run_delalloc`).
    Ordered(Vec<OrderedExtent>),
    /// Through the direct path, nothing allocated: nocow or preallocated files,
    /// compressed ones, and files that are or will be inline.
    Direct,
    /// The whole file went into the tree as an inline extent: written back.
    Inline,
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
        let ii = self.inode_item(InodeId { root, ino })?;
        self.run_delalloc_loaded(root, ino, &ii, start, len, max_extent)
    }

    /// The first delalloc of a writeback (the kernel's `run_delalloc_range`): the
    /// route for the whole writeback of `ino` (in-memory size `i_size`) is chosen here
    /// (`direct_route`: nocow, preallocated, compressed or inline files go through the
    /// direct path, `Delalloc::Direct`), else [start, start + len) is allocated as
    /// `run_delalloc` does. Nothing is allocated for the direct route or on failure.
    ///
    /// `whole`, when the caller has it, is the whole file's data (a file smaller than
    /// a block, dirty from 0): a file that fits inline goes into the tree here, as an
    /// inline extent (compressed if that fits), and the writeback is done
    /// (`Delalloc::Inline`; the kernel's `cow_file_range_inline`).
    ///
    /// # Errors
    /// As `run_delalloc`; tree failures of the inline write (which abort).
    #[allow(clippy::too_many_arguments)]
    pub fn run_delalloc_range(
        &mut self,
        root: u64,
        ino: u64,
        start: u64,
        len: u64,
        max_extent: u64,
        i_size: u64,
        whole: Option<&[u8]>,
    ) -> Result<Delalloc> {
        self.check_root_writable(root)?;
        let ii = self.inode_item(InodeId { root, ino })?;
        let flags = ii.flags.get();
        if let Some(data) = whole.filter(|d| d.len() as u64 == i_size) {
            if i_size > 0
                && i_size <= self.max_inline()
                && !crate::data::nocow::may_write_in_place(flags)
            {
                self.write_inline_back(root, ino, &ii, data)?;
                return Ok(Delalloc::Inline);
            }
        }
        if self.direct_route(root, ino, &ii, i_size)? {
            return Ok(Delalloc::Direct);
        }
        self.run_delalloc_loaded(root, ino, &ii, start, len, max_extent).map(Delalloc::Ordered)
    }

    /// Write back file `ino` (item `ii`), all of whose data is `data`, as one inline
    /// extent: what the direct path does for such a file, in one handle, the times
    /// left as the buffered writes set them.
    fn write_inline_back(
        &mut self,
        root: u64,
        ino: u64,
        ii: &ubtrfs_format::structs::InodeItem,
        data: &[u8],
    ) -> Result<()> {
        let len = data.len() as u64;
        // The inode, the extent item and the items an old extent leaves to drop.
        let items = 4;
        self.as_writeback(true, |w| {
            w.transaction("write_file", items, |w| {
                let mut pos = 0usize;
                w.write_file_inner(root, ino, 0, len, ii, len, &mut |b: &mut [u8]| {
                    b.copy_from_slice(&data[pos..pos + b.len()]);
                    pos += b.len();
                    Ok(())
                })
            })
        })
    }

    /// `run_delalloc` with the inode's item loaded.
    fn run_delalloc_loaded(
        &mut self,
        root: u64,
        ino: u64,
        ii: &ubtrfs_format::structs::InodeItem,
        start: u64,
        len: u64,
        max_extent: u64,
    ) -> Result<Vec<OrderedExtent>> {
        let bs = self.sectorsize();
        let ss = u64::from(bs);
        assert!(
            len > 0 && len.is_multiple_of(ss) && start.is_multiple_of(ss),
            "delalloc {start}+{len} not block aligned"
        );
        assert!(max_extent >= ss && max_extent.is_multiple_of(ss), "max extent {max_extent}");
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
        let id = InodeId { root, ino };
        let ii = match self.inode_item(id) {
            Ok(item) if item.mode.get() & S_IFMT == S_IFREG => item,
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
                w.insert_hole_before(id, old_size, oe.file_offset)?;
            }
            let removed = w.drop_extents_inner(id, oe.file_offset, oe.file_offset + len)?;
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
            w.update_written_back_inode(id, new_size, removed, len, settle)?;
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
