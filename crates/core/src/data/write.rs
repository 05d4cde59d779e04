//! Writing file data through the writer (`FsWriter::write_file`, `write_file_with`)
//! and the direct write the engine runs outside its lock (`begin_write`, then
//! `DirectWrite::write_data`, then `finish_write` or `cancel_write`): COW into new data
//! extents with checksums, inline for small files as the kernel does, in place for
//! NOCOW files (`data::nocow`), compressed where the policy says (`data::compress_write`).
//! Every route begins with the same checks (`prepare_write`).
//!
//! Invariant kept per change: every data sector written has a checksum (none for
//! NODATASUM files, as the kernel keeps them).

use crate::data::nocow::{InPlace, Piece};
use crate::data::read::FileRead;
use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{ExtentKind, FsRead, InodeId, Load};
use crate::inode::write::{iflags_allow, reg_extent_item, IflagOp, MAX_EXTENT_SIZE};
use crate::inode::writer::FsWriter;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;

/// Data is written to disk in pieces of this size.
const WRITE_CHUNK: usize = 4 << 20;

/// Who asks `prepare_write`: a new write, or the writeback of data written earlier,
/// whose checks were made when it was written (the kernel's writeback does not look at
/// the flags, so one set since must not keep that data from disk).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum WriteBy {
    Caller,
    Writeback,
}

/// The checks every data write makes before it changes anything, on every route (the
/// page cache, the direct write, the writer's own `write_file`; the kernel's
/// `btrfs_write_check` and `generic_write_checks`): a regular file, flags that allow
/// writing (immutable, fs-verity), an append-only file written at its end, and an end
/// that fits in 64 bits. `size` is the file's size as the writer sees it (the page
/// cache's, when it holds one). Returns the write's end.
///
/// # Errors
/// `Posix(IsDir)` for a directory, `Posix(Invalid)` for another file that is not
/// regular or an end past 2^64, `Posix(NotPermitted)` for the flags.
pub(crate) fn prepare_write(
    id: InodeId,
    ii: &InodeItem,
    size: u64,
    offset: u64,
    len: u64,
    by: WriteBy,
) -> Result<u64> {
    match ii.mode.get() & S_IFMT {
        S_IFREG => {}
        S_IFDIR => return Err(Error::posix(PosixKind::IsDir, id.to_string())),
        _ => return Err(Error::posix(PosixKind::Invalid, format!("{id} is not a regular file"))),
    }
    if by == WriteBy::Caller {
        iflags_allow(id, ii.flags.get(), IflagOp::Write, b"")?;
        if ii.flags.get() & INODE_APPEND != 0 && offset != size {
            return Err(Error::posix(
                PosixKind::NotPermitted,
                format!("{id} is append-only: writes must start at its size {size}, not {offset}"),
            ));
        }
    }
    offset
        .checked_add(len)
        .ok_or_else(|| Error::posix(PosixKind::Invalid, "write past the maximum file size"))
}

impl FsWriter {
    /// Who the data write under way is for `prepare_write` (`writing_back`).
    pub(crate) fn write_by(&self) -> WriteBy {
        if self.writing_back {
            WriteBy::Writeback
        } else {
            WriteBy::Caller
        }
    }
}

impl FsWriter {
    /// Write data to disk at `logical` (every copy).
    fn write_data(&mut self, logical: u64, buf: &[u8]) -> Result<()> {
        crate::volumes::write_logical(
            &self.info.chunk_map,
            &self.info.devices,
            logical,
            buf,
            crate::volumes::WriteKind::Data,
        )
    }

    /// Write a new regular extent of at most `want` bytes (sector multiple) at file
    /// offset `file_off`, its data produced by `fill` in pieces. The extent is shorter
    /// when free space is (fragmentation, chunk size). Returns its length (= nbytes added).
    pub(crate) fn write_new_extent(
        &mut self,
        root: u64,
        ino: u64,
        file_off: u64,
        want: u64,
        nodatasum: bool,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<u64> {
        let ss = u64::from(self.sectorsize());
        assert!(want > 0 && want <= MAX_EXTENT_SIZE, "extent length {want}");
        assert_eq!(want / ss * ss, want, "extent length {want} not a multiple of the sector size");
        let (bytenr, len) = self.alloc_data_extent_upto(want, root, ino, file_off)?;
        let mut csums = Vec::with_capacity((len / ss) as usize * self.info.csum_type.size());
        // A page-aligned buffer lets the device write data with O_DIRECT; `fill`
        // writes every byte of each piece.
        let cap = WRITE_CHUNK.min(len as usize);
        crate::volumes::device::with_io_buf(cap, |buf| -> Result<()> {
            let mut done = 0u64;
            while done < len {
                let n = (len - done).min(buf.len() as u64) as usize;
                fill(&mut buf[..n])?;
                if !nodatasum {
                    crate::extent::csum_tree::append_sector_csums(
                        self.info.csum_type,
                        ss as usize,
                        &buf[..n],
                        &mut csums,
                    );
                }
                self.write_data(bytenr + done, &buf[..n])?;
                done += n as u64;
            }
            Ok(())
        })?;
        if !nodatasum {
            crate::extent::csum_tree::insert_csums(self, bytenr, &csums)?;
        }
        let fe = reg_extent_item(self.transid, bytenr, len);
        self.insert_item(root, &Key::new(ino, EXTENT_DATA_KEY, file_off), &fe)?;
        Ok(len)
    }

    /// Write `data` at `offset` of regular file `ino` (COW; small files inline).
    ///
    /// # Errors
    /// `Posix(NoSpace)`, tree and I/O failures (the caller aborts the transaction).
    pub fn write_file(&mut self, root: u64, ino: u64, offset: u64, data: &[u8]) -> Result<()> {
        let mut pos = 0usize;
        self.write_file_with(root, ino, offset, data.len() as u64, &mut |buf: &mut [u8]| {
            buf.copy_from_slice(&data[pos..pos + buf.len()]);
            pos += buf.len();
            Ok(())
        })
    }

    /// Read file data the write keeps around its range (read-modify-write of partial
    /// sectors, inline-to-regular conversion) through the live view: verified against
    /// the transaction's checksums, other copies tried for a bad sector, so old data
    /// never picks up a bad read under a fresh checksum. Bytes past EOF read as zeros.
    pub(crate) fn read_old_data(
        &self,
        root: u64,
        ino: u64,
        start: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let live = self.live();
        let v = live.load_inode(InodeId { root, ino }, Load { extents: true, ..Load::ITEM })?;
        let n = live.read_at(&v, start, buf)?;
        buf[n..].fill(0);
        Ok(())
    }

    /// Write `len` bytes produced by `fill` (called in order, in pieces) at `offset`.
    ///
    /// # Errors
    /// As `write_file`, plus errors from `fill`.
    pub fn write_file_with(
        &mut self,
        root: u64,
        ino: u64,
        offset: u64,
        len: u64,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        self.check_root_writable(root)?;
        if len == 0 {
            return Ok(());
        }
        let id = InodeId { root, ino };
        let ii = self.live().load_inode(id, Load::ITEM)?.item;
        let end = prepare_write(id, &ii, ii.size.get(), offset, len, self.write_by())?;
        // The inode, two split edges, the extents and their csums.
        let csum_leaf_bytes = u64::from(self.nodesize()) / 2;
        let csum_bytes =
            len.div_ceil(u64::from(self.sectorsize())) * self.info.csum_type.size() as u64;
        let items = 3 + len.div_ceil(MAX_EXTENT_SIZE) + csum_bytes.div_ceil(csum_leaf_bytes);
        // The data space first: ENOSPC before anything changes.
        let ss = u64::from(self.sectorsize());
        let max_inline = self.max_inline();
        if ii.size.get().max(end) > max_inline {
            let a_start = offset / ss * ss;
            let a_end = end.div_ceil(ss) * ss;
            // An inline file turning regular is written again from 0: its old bytes
            // need space too (but a write far past a small file's end reserves only
            // what it writes, not the hole before it).
            let inline_rewrite =
                if ii.size.get() <= max_inline { ii.size.get().div_ceil(ss) * ss } else { 0 };
            let what = format!("root={root} ino={ino}");
            if let Err(e) = crate::space::allocator::reserve_data(
                self,
                a_end - a_start + inline_rewrite.min(a_start),
                &what,
            ) {
                // What goes in place needs no new space (btrfs_check_nocow_lock, only
                // once the reservation failed, as the kernel asks).
                let in_place = match e.posix_kind() {
                    Some(PosixKind::NoSpace) => {
                        self.in_place_bytes(id, ii.flags.get(), a_start, a_end)?
                    }
                    _ => 0,
                };
                if in_place == 0 {
                    return Err(e);
                }
                crate::space::allocator::reserve_data(self, a_end - a_start - in_place, &what)?;
            }
        }
        self.transaction("write_file", items, |w| {
            w.write_file_inner(root, ino, offset, end, &ii, ii.size.get().max(end), fill)
        })
    }

    /// The write itself, inside the caller's handle. `final_size` is the size the file
    /// has once the caller's whole operation is done (a truncation or fallocate may set
    /// it after this write): an inline extent is made only when it is the whole file
    /// then.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_file_inner(
        &mut self,
        root: u64,
        ino: u64,
        offset: u64,
        end: u64,
        ii: &InodeItem,
        final_size: u64,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let id = InodeId { root, ino };
        let nodatasum = ii.flags.get() & INODE_NODATASUM != 0;
        let old_size = ii.size.get();
        let new_size = old_size.max(end);
        let ss = u64::from(self.sectorsize());
        let max_inline = self.max_inline();
        let prop = self.compression_prop(root, ino, ii)?;
        let choice = self.compress_choice(ii, prop);
        let added;
        let removed;
        let whole = final_size == new_size;
        // NOCOW-capable inodes never get inline extents: their writeback goes extent by
        // extent, in place or COWed into regular extents (`run_delalloc_nocow`).
        let nocow = crate::data::nocow::nocow_capable(ii.flags.get());
        if whole && !nocow && (new_size <= max_inline || (choice.is_some() && new_size <= ss)) {
            // The whole file fits in a sector: rewritten whole, inline as the kernel
            // keeps small files (compressed when that fits), else as one block.
            let mut content = vec![0u8; new_size as usize];
            self.read_old_data(root, ino, 0, &mut content[..old_size.min(new_size) as usize])?;
            fill(&mut content[offset as usize..end as usize])?;
            removed = self.drop_extents_inner(id, 0, u64::MAX)?;
            let mut next = choice;
            if let Some(c) = &choice {
                match self.try_compressed_inline(root, ino, c, &content)? {
                    crate::data::compress_write::InlineTry::Done => {
                        return self.update_written_inode(id, new_size, removed, new_size)
                    }
                    crate::data::compress_write::InlineTry::Regular => {}
                    crate::data::compress_write::InlineTry::Plain => next = None,
                }
            }
            if new_size <= max_inline {
                self.insert_inline(id, &content)?;
                added = new_size;
            } else {
                content.resize(ss as usize, 0);
                let mut pos = 0usize;
                added = self.write_range(
                    root,
                    ino,
                    0,
                    ss,
                    old_size,
                    nodatasum,
                    next.as_ref(),
                    &mut |b: &mut [u8]| {
                        b.copy_from_slice(&content[pos..pos + b.len()]);
                        pos += b.len();
                        Ok(())
                    },
                )?;
            }
        } else {
            // An inline extent must become regular: rewrite from 0.
            let mut has_inline = self
                .live()
                .file_extents(id, 0, 1)?
                .iter()
                .any(|f| matches!(f.kind, ExtentKind::Inline { .. }));
            if has_inline && offset >= ss {
                // The inline extent becomes a regular first block, as btrfs_cont_expand
                // makes it; the write then starts at its own block.
                self.inline_to_regular(root, ino, ii)?;
                has_inline = false;
            }
            let a_start = if has_inline { 0 } else { offset / ss * ss };
            let a_end = end.div_ceil(ss) * ss;
            let head_len = (offset - a_start) as usize;
            let mut head = vec![0u8; head_len];
            self.read_old_data(root, ino, a_start, &mut head)?;
            let tail_len = (a_end - end) as usize;
            let mut tail = vec![0u8; tail_len];
            if end < old_size {
                self.read_old_data(root, ino, end, &mut tail)?;
            }
            // A write past EOF first zeroes the old last block past the old end, as
            // btrfs_cont_expand does (the block is written, whatever it held).
            if offset > old_size
                && !old_size.is_multiple_of(ss)
                && old_size / ss * ss < a_start
                && !has_inline
            {
                self.zero_eof_block(id, ii, old_size)?;
            }
            // Stream head + data + tail through the extents.
            let total = a_end - a_start;
            let mut produced = 0u64;
            let mut stream = |buf: &mut [u8]| -> Result<()> {
                let mut i = 0usize;
                while i < buf.len() {
                    let p = produced as usize;
                    if p < head_len {
                        let k = (head_len - p).min(buf.len() - i);
                        buf[i..i + k].copy_from_slice(&head[p..p + k]);
                        i += k;
                        produced += k as u64;
                    } else if produced < total - tail_len as u64 {
                        let k = ((total - tail_len as u64 - produced) as usize).min(buf.len() - i);
                        fill(&mut buf[i..i + k])?;
                        i += k;
                        produced += k as u64;
                    } else {
                        let t = (produced - (total - tail_len as u64)) as usize;
                        let k = (tail_len - t).min(buf.len() - i);
                        buf[i..i + k].copy_from_slice(&tail[t..t + k]);
                        i += k;
                        produced += k as u64;
                    }
                }
                Ok(())
            };
            let plan = if nocow {
                self.nocow_plan(id, ii.flags.get(), a_start, a_end)?
            } else {
                vec![Piece::Cow { start: a_start, end: a_end }]
            };
            self.insert_hole_before(id, old_size, a_start)?;
            let (mut r, mut a) = (0, 0);
            for piece in plan {
                match piece {
                    Piece::Cow { start, end } => {
                        r += self.drop_extents_inner(id, start, end)?;
                        a += self.write_range(
                            root,
                            ino,
                            start,
                            end - start,
                            old_size,
                            nodatasum,
                            choice.as_ref(),
                            &mut stream,
                        )?;
                    }
                    Piece::InPlace(p) => {
                        self.write_piece_in_place(id, &p, nodatasum, &mut stream)?
                    }
                }
            }
            (removed, added) = (r, a);
        }
        self.update_written_inode(id, new_size, removed, added)
    }

    /// Write in-place part `p` of a NOCOW write from `src`, in pieces, and mark a
    /// preallocated part written.
    fn write_piece_in_place(
        &mut self,
        id: InodeId,
        p: &InPlace,
        nodatasum: bool,
        src: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let mut buf = vec![0u8; WRITE_CHUNK.min(p.len as usize)];
        let mut done = 0u64;
        while done < p.len {
            let n = (p.len - done).min(buf.len() as u64) as usize;
            src(&mut buf[..n])?;
            self.write_in_place(p.disk + done, &buf[..n], nodatasum, p.prealloc)?;
            done += n as u64;
        }
        if p.prealloc {
            self.mark_extent_written(id, p)?;
        }
        Ok(())
    }

    /// Rewrite a file's inline extent as a regular extent holding its first block
    /// (zero padded), for a write or size change that takes the file past the inline
    /// extent.
    pub(crate) fn inline_to_regular(&mut self, root: u64, ino: u64, ii: &InodeItem) -> Result<()> {
        let ss = u64::from(self.sectorsize());
        let size = ii.size.get();
        let mut content = vec![0u8; ss as usize];
        self.read_old_data(root, ino, 0, &mut content[..size.min(ss) as usize])?;
        let removed = self.drop_extents_inner(InodeId { root, ino }, 0, ss)?;
        let prop = self.compression_prop(root, ino, ii)?;
        let choice = self.compress_choice(ii, prop);
        let mut pos = 0usize;
        let nodatasum = ii.flags.get() & INODE_NODATASUM != 0;
        let added = self.write_range(
            root,
            ino,
            0,
            ss,
            size,
            nodatasum,
            choice.as_ref(),
            &mut |b: &mut [u8]| {
                b.copy_from_slice(&content[pos..pos + b.len()]);
                pos += b.len();
                Ok(())
            },
        )?;
        self.update_inode(InodeId { root, ino }, |i| {
            i.nbytes = (i.nbytes.get() - removed.min(i.nbytes.get()) + added).into()
        })
    }

    /// [start, start + total) of file `ino` (sector aligned) written from `src`,
    /// compressed as `choice` says or plain; returns the bytes added to nbytes.
    #[allow(clippy::too_many_arguments)]
    fn write_range(
        &mut self,
        root: u64,
        ino: u64,
        start: u64,
        total: u64,
        old_size: u64,
        nodatasum: bool,
        choice: Option<&crate::data::compress_write::Choice>,
        src: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<u64> {
        if let Some(c) = choice {
            return self.write_extents_compressed(root, ino, start, total, old_size, c, src);
        }
        self.write_plain(root, ino, start, total, nodatasum, src)
    }
}

/// A write whose data goes to disk without the engine's lock (the kernel's delalloc
/// and ordered extents, in one call): `begin_write` checks the inode and reserves
/// metadata and data space under the lock, `DirectWrite::write_data` writes and
/// checksums the data without it, and `finish_write` inserts the file extents and
/// checksums under the lock again (`cancel_write` gives the space back if the data
/// write failed). Until `finish_write`, readers see the file as it was; a commit in
/// between records nothing of the write (its space is reserved in memory only, and
/// free in the committed state), so a crash loses the write and nothing else.
#[must_use = "a direct write ends with finish_write or cancel_write, which give back its reservations"]
pub struct DirectWrite {
    root: u64,
    ino: u64,
    /// File range written: sector-aligned start, and the end of the data.
    offset: u64,
    end: u64,
    nodatasum: bool,
    /// Where the data goes: (file offset, disk bytenr, length, how), in file order,
    /// covering `offset` up to `end` rounded up to a sector. `None` is a reserved new
    /// extent; `Some` a part written in place (NOCOW), which reserved nothing.
    extents: Vec<(u64, u64, u64, Option<InPlace>)>,
    /// Data checksums of each extent, filled by `write_data`.
    csums: Vec<Vec<u8>>,
    /// Metadata bytes reserved for the insertions (`reserve_metadata`), which the
    /// handle of `finish_write` takes over.
    meta_rsv: u64,
}

/// How `begin_write` wants a write done.
pub enum WritePlan {
    /// Under the lock, as `FsWriter::write_file` does: the write needs old data (a
    /// partial sector inside the file, an inline extent) or makes an inline file.
    Locked,
    /// Data written without the lock.
    Direct(DirectWrite),
}

impl FsWriter {
    /// Start a write of `len` bytes at `offset` of regular file `ino`: the checks of
    /// `write_file`, and for a write that needs no old data, the reservation of its
    /// metadata and its data extents.
    ///
    /// # Errors
    /// As `write_file`: `Posix` for a wrong inode or flags, `Posix(NoSpace)`.
    pub fn begin_write(&mut self, root: u64, ino: u64, offset: u64, len: u64) -> Result<WritePlan> {
        self.check_root_writable(root)?;
        let id = InodeId { root, ino };
        let ii = self.live().load_inode(id, Load::ITEM)?.item;
        let end = prepare_write(id, &ii, ii.size.get(), offset, len, self.write_by())?;
        let ss = u64::from(self.sectorsize());
        let old_size = ii.size.get();
        let max_inline = self.max_inline();
        // (A write past an unaligned EOF rewrites the old last block too, as
        // btrfs_cont_expand does: the locked path does that.)
        let needs_old_data = !offset.is_multiple_of(ss)
            || (!end.is_multiple_of(ss) && end < old_size)
            || (offset > old_size && !old_size.is_multiple_of(ss));
        let append_only = ii.flags.get() & INODE_APPEND != 0;
        if len == 0 || append_only || needs_old_data || old_size.max(end) <= max_inline {
            return Ok(WritePlan::Locked);
        }
        if self
            .live()
            .file_extents(InodeId { root, ino }, 0, 1)?
            .iter()
            .any(|f| matches!(f.kind, ExtentKind::Inline { .. }))
        {
            return Ok(WritePlan::Locked);
        }
        // Compressed writes compress under the lock (the stream's size decides the
        // extent's).
        let prop = self.compression_prop(root, ino, &ii)?;
        if self.compress_choice(&ii, prop).is_some() {
            return Ok(WritePlan::Locked);
        }
        let csum_leaf_bytes = u64::from(self.nodesize()) / 2;
        let csum_bytes = len.div_ceil(ss) * self.info.csum_type.size() as u64;
        let items = 3 + len.div_ceil(MAX_EXTENT_SIZE) + csum_bytes.div_ceil(csum_leaf_bytes);
        let meta_rsv = crate::space::allocator::reserve_metadata(self, items)?;
        self.write_rsv += meta_rsv;
        let a_end = end.div_ceil(ss) * ss;
        // The parts of a NOCOW-capable inode that go in place need no extent; the
        // caller holds the inode's lock, so they stay as planned until finish_write.
        let plan = self.nocow_plan(id, ii.flags.get(), offset, a_end)?;
        let mut extents = Vec::new();
        for piece in plan {
            let (mut cur, pend) = match piece {
                Piece::InPlace(p) => {
                    extents.push((p.file_off, p.disk, p.len, Some(p)));
                    continue;
                }
                Piece::Cow { start, end } => (start, end),
            };
            while cur < pend {
                let want = (pend - cur).min(MAX_EXTENT_SIZE);
                match crate::space::allocator::alloc_extent_upto(self, BLOCK_GROUP_DATA, want, ss) {
                    Ok((bytenr, got)) => {
                        extents.push((cur, bytenr, got, None));
                        cur += got;
                    }
                    Err(e) => {
                        for &(_, b, l, how) in &extents {
                            if how.is_none() {
                                crate::space::allocator::unreserve(self, b, l, false);
                            }
                        }
                        self.write_rsv -= meta_rsv;
                        crate::space::allocator::release_metadata(self, meta_rsv);
                        return Err(e);
                    }
                }
            }
        }
        Ok(WritePlan::Direct(DirectWrite {
            root,
            ino,
            offset,
            end,
            nodatasum: ii.flags.get() & INODE_NODATASUM != 0,
            extents,
            csums: Vec::new(),
            meta_rsv,
        }))
    }

    /// Insert a direct write's extents and checksums (its data is on disk) and update
    /// the inode, under the abort guard.
    ///
    /// # Errors
    /// `Posix(NotFound)` when the inode went away meanwhile (its space is given back);
    /// tree failures (which abort).
    pub fn finish_write(&mut self, mut dw: DirectWrite) -> Result<()> {
        let (root, ino) = (dw.root, dw.ino);
        let ii = match self.live().load_inode(InodeId { root, ino }, Load::ITEM) {
            Ok(v) if v.item.mode.get() & S_IFMT == S_IFREG => v.item,
            Ok(_) | Err(_) => {
                self.cancel_write(dw);
                return Err(Error::posix(
                    PosixKind::NotFound,
                    format!("root={root} ino={ino} went away while its data was written"),
                ));
            }
        };
        let rsv = std::mem::take(&mut dw.meta_rsv);
        self.write_rsv -= rsv;
        let mut h = self.start_transaction_reserved("write_file", rsv)?;
        let r = h.finish_write_inner(dw, &ii);
        h.end_with(r)
    }

    fn finish_write_inner(&mut self, dw: DirectWrite, ii: &InodeItem) -> Result<()> {
        let (root, ino) = (dw.root, dw.ino);
        let id = InodeId { root, ino };
        let ss = u64::from(self.sectorsize());
        let old_size = ii.size.get();
        let new_size = old_size.max(dw.end);
        let a_end = dw.end.div_ceil(ss) * ss;
        debug_assert_eq!(
            dw.extents.last().map(|e| e.0 + e.2),
            Some(a_end),
            "a direct write's extents end at its aligned end"
        );
        self.insert_hole_before(id, old_size, dw.offset)?;
        let (mut removed, mut added) = (0, 0);
        for (i, &(file_off, bytenr, len, how)) in dw.extents.iter().enumerate() {
            if let Some(p) = how {
                // In place: the data is there; a preallocated part gets its checksums
                // and turns regular.
                if p.prealloc {
                    if !dw.nodatasum {
                        crate::extent::csum_tree::insert_csums(self, bytenr, &dw.csums[i])?;
                    }
                    self.mark_extent_written(id, &p)?;
                }
                continue;
            }
            removed += self.drop_extents_inner(id, file_off, file_off + len)?;
            self.delayed.add_data_ref(
                bytenr,
                len,
                crate::extent::delayed_ref::RefKind::Data { root, ino, offset: file_off },
                1,
                true,
            )?;
            if !dw.nodatasum {
                crate::extent::csum_tree::insert_csums(self, bytenr, &dw.csums[i])?;
            }
            let fe = reg_extent_item(self.transid, bytenr, len);
            self.insert_item(root, &Key::new(ino, EXTENT_DATA_KEY, file_off), &fe)?;
            added += len;
        }
        self.update_written_inode(id, new_size, removed, added)
    }

    /// Give back a direct write's reserved space (its data write failed).
    pub fn cancel_write(&mut self, dw: DirectWrite) {
        for &(_, b, l, how) in &dw.extents {
            if how.is_none() {
                crate::space::allocator::unreserve(self, b, l, false);
            }
        }
        self.write_rsv -= dw.meta_rsv;
        crate::space::allocator::release_metadata(self, dw.meta_rsv);
    }
}

impl DirectWrite {
    /// Write the data (zero-padded to the last sector) to the reserved extents, every
    /// copy, and checksum it. Needs only the shared `FsInfo`.
    ///
    /// # Errors
    /// `Io` from the devices.
    pub fn write_data(&mut self, info: &crate::disk_io::FsInfo, data: &[u8]) -> Result<()> {
        assert_eq!(
            data.len() as u64,
            self.end - self.offset,
            "write_data with other data than begin_write was given"
        );
        let ss = info.sectorsize as usize;
        let cs = info.csum_type.size();
        self.csums.clear();
        // Data that is aligned already (a writeback's gathered run) goes from where it
        // is; other pieces through a page-aligned buffer, so the device can write them
        // with O_DIRECT.
        let align = crate::volumes::device::DIRECT_IO_ALIGN;
        for &(file_off, bytenr, len, _) in &self.extents {
            let mut csums = Vec::with_capacity((len as usize / ss) * cs);
            let mut done = 0u64;
            while done < len {
                let n = (len - done).min(WRITE_CHUNK as u64) as usize;
                let from = (file_off + done - self.offset) as usize;
                let have = data.len().saturating_sub(from).min(n);
                let mut put = |piece: &[u8]| -> Result<()> {
                    if !self.nodatasum {
                        crate::extent::csum_tree::append_sector_csums(
                            info.csum_type,
                            ss,
                            piece,
                            &mut csums,
                        );
                    }
                    crate::volumes::write_logical(
                        &info.chunk_map,
                        &info.devices,
                        bytenr + done,
                        piece,
                        crate::volumes::WriteKind::Data,
                    )
                };
                if have == n && (data[from..].as_ptr() as usize).is_multiple_of(align) {
                    put(&data[from..from + n])?;
                } else {
                    crate::volumes::device::with_io_buf(n, |buf| {
                        buf[..have].copy_from_slice(&data[from..from + have]);
                        buf[have..].fill(0);
                        put(buf)
                    })?;
                }
                done += n as u64;
            }
            self.csums.push(csums);
        }
        Ok(())
    }
}
