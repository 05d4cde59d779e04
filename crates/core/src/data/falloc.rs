//! fallocate(2): preallocation (the default mode and KEEP_SIZE), PUNCH_HOLE and
//! ZERO_RANGE, as `btrfs_fallocate`, `btrfs_punch_hole` and `btrfs_zero_range` do them,
//! with the VFS's checks in front (`vfs_fallocate`). And SEEK_DATA / SEEK_HOLE.
//!
//! - Preallocation gives every hole in the range (and, past EOF, every range not
//!   preallocated yet) a PREALLOC extent: allocated, no checksums, read as zeros, in
//!   nbytes; the inode gets the PREALLOC flag; without KEEP_SIZE the size grows to the
//!   range's end. Data already in the range stays.
//! - PUNCH_HOLE (always with KEEP_SIZE) zeroes the partial blocks at the range's edges
//!   (rewriting them) and drops the extents of the whole blocks between (a hole extent
//!   without no-holes); nothing past EOF.
//! - ZERO_RANGE zeroes the partial edge blocks inside the file and replaces the whole
//!   blocks with PREALLOC extents (so the range reads zeros and stays allocated);
//!   without KEEP_SIZE the size grows to the range's end.
//!
//! The data space is found (or made) before anything changes: ENOSPC leaves the file
//! as it was.
//!
//! SEEK_DATA / SEEK_HOLE (`seek_data_hole`) answer as `find_desired_extent` does once
//! the kernel's dirty pages are extents: the engine writes extents at once, so its
//! layout is the kernel's after writeback, and the kernel counts delalloc as data.

use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{ExtentKind, FileExtentRec, FsRead, InodeId, Load};
use crate::inode::writer::FsWriter;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;

pub const FALLOC_FL_KEEP_SIZE: u32 = 0x01;
pub const FALLOC_FL_PUNCH_HOLE: u32 = 0x02;
pub const FALLOC_FL_COLLAPSE_RANGE: u32 = 0x08;
pub const FALLOC_FL_ZERO_RANGE: u32 = 0x10;
pub const FALLOC_FL_INSERT_RANGE: u32 = 0x20;
pub const FALLOC_FL_UNSHARE_RANGE: u32 = 0x40;
pub const FALLOC_FL_WRITE_ZEROES: u32 = 0x80;
/// What the VFS knows (others are EOPNOTSUPP there).
const VFS_MODES: u32 = FALLOC_FL_KEEP_SIZE
    | FALLOC_FL_PUNCH_HOLE
    | FALLOC_FL_COLLAPSE_RANGE
    | FALLOC_FL_ZERO_RANGE
    | FALLOC_FL_INSERT_RANGE
    | FALLOC_FL_UNSHARE_RANGE
    | FALLOC_FL_WRITE_ZEROES;
/// What btrfs does.
const BTRFS_MODES: u32 = FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE;
/// Largest preallocated extent (the kernel asks for at most 256 MiB at a time).
const MAX_PREALLOC: u64 = 256 << 20;

/// ZERO_RANGE's plan: byte ranges zeroed in place, and the range preallocated.
type ZeroPlan = (Vec<(u64, u64)>, Option<(u64, u64)>);

/// What the block at a ZERO_RANGE edge holds.
enum Boundary {
    Hole,
    Prealloc,
    Written,
}

/// `lseek` whence values.
pub const SEEK_DATA: i32 = 3;
pub const SEEK_HOLE: i32 = 4;

impl FsWriter {
    /// fallocate(2) of `len` bytes at `offset` of file `id` with `mode` (FALLOC_FL_*).
    ///
    /// # Errors
    /// `Posix` as the kernel: Invalid for a zero length or an offset past the largest
    /// file offset; NotSupported for a combination of modes, PUNCH_HOLE without
    /// KEEP_SIZE, and the modes btrfs lacks (collapse, insert, unshare); NotPermitted
    /// for an immutable file, or an append-only one for anything but preallocation;
    /// NotSeekable for a fifo, IsDir, NoDevice for other non-regular files;
    /// FileTooBig past the largest file size; NoSpace.
    pub fn fallocate(&mut self, id: InodeId, mode: u32, offset: u64, len: u64) -> Result<()> {
        let what = id.to_string();
        if len == 0
            || offset > crate::inode::attr::MAX_FILE_SIZE
            || len > crate::inode::attr::MAX_FILE_SIZE
        {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                what,
                "fallocate needs a length and an offset within the largest file size",
            ));
        }
        if mode & !VFS_MODES != 0 {
            return Err(Error::posix_detail(
                PosixKind::NotSupported,
                what,
                format!("unknown fallocate mode {mode:#x}"),
            ));
        }
        // vfs_fallocate: one mode at a time; PUNCH_HOLE only with KEEP_SIZE; COLLAPSE,
        // INSERT and WRITE_ZEROES never with it.
        let ok = match mode & !FALLOC_FL_KEEP_SIZE {
            0 | FALLOC_FL_UNSHARE_RANGE | FALLOC_FL_ZERO_RANGE => true,
            FALLOC_FL_PUNCH_HOLE => mode & FALLOC_FL_KEEP_SIZE != 0,
            FALLOC_FL_COLLAPSE_RANGE | FALLOC_FL_INSERT_RANGE | FALLOC_FL_WRITE_ZEROES => {
                mode & FALLOC_FL_KEEP_SIZE == 0
            }
            _ => false,
        };
        if !ok {
            return Err(Error::posix_detail(
                PosixKind::NotSupported,
                what,
                format!("fallocate mode {mode:#x} is not one the kernel takes"),
            ));
        }
        self.check_root_writable(id.root)?;
        let ii = self.inode_item(id)?;
        let flags = ii.flags.get();
        if flags & INODE_IMMUTABLE != 0 {
            return Err(Error::posix_detail(
                PosixKind::NotPermitted,
                what,
                "the file is immutable",
            ));
        }
        // An fs-verity file opens for reading only (fsverity_file_open).
        if flags & INODE_RO_VERITY != 0 {
            return Err(Error::posix_detail(
                PosixKind::NotPermitted,
                what,
                "an fs-verity file's data cannot change",
            ));
        }
        if mode & !FALLOC_FL_KEEP_SIZE != 0 && flags & INODE_APPEND != 0 {
            return Err(Error::posix_detail(
                PosixKind::NotPermitted,
                what,
                "the file is append-only",
            ));
        }
        match ii.mode.get() & S_IFMT {
            S_IFREG => {}
            S_IFIFO => return Err(Error::posix(PosixKind::NotSeekable, what)),
            S_IFDIR => return Err(Error::posix(PosixKind::IsDir, what)),
            _ => {
                return Err(Error::posix_detail(
                    PosixKind::NoDevice,
                    what,
                    "only regular files take fallocate",
                ))
            }
        }
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= crate::inode::attr::MAX_FILE_SIZE)
            .ok_or_else(|| Error::posix(PosixKind::FileTooBig, id.to_string()))?;
        if mode & !BTRFS_MODES != 0 {
            return Err(Error::posix_detail(
                PosixKind::NotSupported,
                what,
                "btrfs has no collapse, insert, unshare or write-zeroes fallocate",
            ));
        }
        let keep = mode & FALLOC_FL_KEEP_SIZE != 0;
        if mode & FALLOC_FL_PUNCH_HOLE != 0 {
            return self.transaction("punch_hole", 8, |w| w.punch_hole_inner(id, offset, end));
        }
        let ss = u64::from(self.sectorsize());
        let zero = mode & FALLOC_FL_ZERO_RANGE != 0;
        // The space first: the ranges to preallocate and the edge blocks rewritten.
        let size = ii.size.get();
        let ranges = if zero {
            self.zero_range_plan(id, offset, end)?.1.into_iter().collect()
        } else {
            self.prealloc_ranges(id, offset, end, size)?
        };
        let need: u64 = ranges.iter().map(|r| r.1 - r.0).sum::<u64>() + 2 * ss;
        // Beside the data space promised to dirty data (`space::data_rsv`).
        let outstanding = self.data_rsv.outstanding();
        crate::space::allocator::reserve_data(self, need + outstanding, &what)?;
        let items = 6 + 2 * ranges.len() as u64 + need.div_ceil(MAX_PREALLOC);
        self.transaction(if zero { "zero_range" } else { "fallocate" }, items, |w| {
            w.falloc_inner(id, offset, end, keep, zero)
        })
    }

    /// The sector-aligned ranges of [offset, end) that preallocation fills: holes (and
    /// explicit hole extents), and past EOF anything but PREALLOC extents.
    fn prealloc_ranges(
        &mut self,
        id: InodeId,
        offset: u64,
        end: u64,
        size: u64,
    ) -> Result<Vec<(u64, u64)>> {
        let ss = u64::from(self.sectorsize());
        let (a, b) = (offset / ss * ss, end.div_ceil(ss) * ss);
        let eof = size.div_ceil(ss) * ss;
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut push = |s: u64, e: u64| {
            if s < e {
                match out.last_mut() {
                    Some(l) if l.1 == s => l.1 = e,
                    _ => out.push((s, e)),
                }
            }
        };
        let mut cur = a;
        for f in self.live().file_extents(id, a, b)? {
            // An inline extent's extent map covers its whole block.
            let f_end = if matches!(f.kind, ExtentKind::Inline { .. }) {
                f.end().div_ceil(ss) * ss
            } else {
                f.end()
            };
            let (fs, fe) = (f.file_offset.max(a), f_end.min(b));
            if fs >= fe {
                continue;
            }
            push(cur, fs);
            let prealloc = matches!(f.kind, ExtentKind::Regular { prealloc: true, .. });
            let hole = matches!(f.kind, ExtentKind::Regular { disk_bytenr: 0, .. });
            if hole || (!prealloc && fs >= eof) {
                push(fs, fe);
            }
            cur = fe;
        }
        push(cur, b);
        Ok(out)
    }

    /// What a block at `pos` holds, for ZERO_RANGE's edges
    /// (`btrfs_zero_range_check_range_boundary`).
    fn boundary(&mut self, id: InodeId, pos: u64) -> Result<Boundary> {
        let ss = u64::from(self.sectorsize());
        let b = pos / ss * ss;
        Ok(match self.live().file_extents(id, b, b + ss)?.into_iter().find(|f| f.end() > b) {
            None => Boundary::Hole,
            Some(f) => match f.kind {
                ExtentKind::Regular { prealloc: true, .. } => Boundary::Prealloc,
                ExtentKind::Regular { disk_bytenr: 0, .. } => Boundary::Hole,
                _ => Boundary::Written,
            },
        })
    }

    /// ZERO_RANGE as `btrfs_zero_range` plans it: the written edge blocks zeroed in
    /// place (ranges returned), hole edge blocks taken into the preallocated range,
    /// preallocated ones left alone; the range to drop and preallocate.
    fn zero_range_plan(&mut self, id: InodeId, offset: u64, end: u64) -> Result<ZeroPlan> {
        let ss = u64::from(self.sectorsize());
        let mut edges = Vec::new();
        if offset / ss == (end - 1) / ss {
            let b = offset / ss * ss;
            return Ok(match self.boundary(id, offset)? {
                Boundary::Prealloc => (edges, None),
                Boundary::Written if end - offset < ss => (vec![(offset, end)], None),
                _ => (edges, Some((b, b + ss))),
            });
        }
        let (mut a, mut b) = (offset.div_ceil(ss) * ss, end / ss * ss);
        if !offset.is_multiple_of(ss) {
            match self.boundary(id, offset)? {
                Boundary::Hole => a = offset / ss * ss,
                Boundary::Written => edges.push((offset, offset.div_ceil(ss) * ss)),
                Boundary::Prealloc => {}
            }
        }
        if !end.is_multiple_of(ss) {
            match self.boundary(id, end)? {
                Boundary::Hole => b = end.div_ceil(ss) * ss,
                Boundary::Written => edges.push((end / ss * ss, end)),
                Boundary::Prealloc => {}
            }
        }
        Ok((edges, (a < b).then_some((a, b))))
    }

    fn falloc_inner(
        &mut self,
        id: InodeId,
        offset: u64,
        end: u64,
        keep: bool,
        zero: bool,
    ) -> Result<()> {
        let InodeId { root, ino } = id;
        let ss = u64::from(self.sectorsize());
        let ii = self.inode_item(id)?;
        let size = ii.size.get();
        {
            // btrfs_cont_expand / btrfs_truncate_block, with or without KEEP_SIZE: the
            // old last block gets zeros past the old end (written, even over a hole),
            // and without no-holes hole extents cover a gap before the range. First:
            // ZERO_RANGE looks at its edge blocks after this (and after the writeback
            // that makes the EOF block an extent, inline for a small file).
            let start = offset / ss * ss;
            if end > size && size % ss != 0 {
                self.zero_eof_block(id, &ii, if keep { size } else { end })?;
            }
            if start > size {
                self.insert_hole_before(id, size, start)?;
            }
        }
        let mut zero_alloc = None;
        if zero {
            let (edges, alloc) = self.zero_range_plan(id, offset, end)?;
            for (s, e) in edges {
                if s < e.min(size) {
                    self.zero_in_file(id, s, e.min(size))?;
                }
            }
            zero_alloc = alloc;
        }
        let cur_size = self.inode_item(id)?.size.get();
        let ranges = if zero {
            zero_alloc.into_iter().collect()
        } else {
            self.prealloc_ranges(id, offset, end, cur_size)?
        };
        let mut removed = 0;
        let mut added = 0;
        for &(s, e) in &ranges {
            removed += self.drop_extents_inner(id, s, e)?;
            let mut cur = s;
            while cur < e {
                let (bytenr, got) = crate::space::allocator::alloc_extent_upto(
                    self,
                    BLOCK_GROUP_DATA,
                    (e - cur).min(MAX_PREALLOC),
                    ss,
                )?;
                self.delayed.add_data_ref(
                    bytenr,
                    got,
                    crate::extent::delayed_ref::RefKind::Data { root, ino, offset: cur },
                    1,
                    true,
                )?;
                let fe = crate::inode::write::extent_item(
                    self.transid,
                    FILE_EXTENT_PREALLOC,
                    bytenr,
                    got,
                );
                self.insert_item(root, &Key::new(ino, EXTENT_DATA_KEY, cur), &fe)?;
                added += got;
                cur += got;
            }
        }
        let t = self.now();
        let grow = !keep && end > cur_size;
        let changed = !ranges.is_empty() || grow;
        self.update_inode(id, |i| {
            i.nbytes = (i.nbytes.get() - removed.min(i.nbytes.get()) + added).into();
            if !ranges.is_empty() {
                i.flags = (i.flags.get() | INODE_PREALLOC).into();
            }
            if grow {
                i.size = end.into();
            }
            // file_modified(): every fallocate that gets this far moves both times.
            let _ = changed;
            i.mtime = t;
            i.ctime = t;
        })
    }

    /// Rewrite [s, e) of the file (inside one block, or up to EOF) as zeros, as
    /// `btrfs_truncate_block` does: the block is written whatever it held (a hole or a
    /// preallocated block becomes written zeros).
    fn zero_in_file(&mut self, id: InodeId, s: u64, e: u64) -> Result<()> {
        if s >= e {
            // Nothing of the file's bytes there (past EOF, or past an inline extent).
            return Ok(());
        }
        let ii = self.inode_item(id)?;
        let size = ii.size.get();
        self.write_file_inner(id.root, id.ino, s, e, &ii, size, &mut |b: &mut [u8]| {
            b.fill(0);
            Ok(())
        })
    }

    /// `btrfs_truncate_block` for [from, to) inside one block before `ino_size`: the
    /// block is written whatever it held (a hole or a preallocated block becomes data)
    /// with zeros over [from, to), also when that is past EOF in the EOF block.
    fn truncate_block(&mut self, id: InodeId, from: u64, to: u64) -> Result<()> {
        let ii = self.inode_item(id)?;
        let size = ii.size.get();
        if from < size {
            return self.zero_in_file(id, from, to.min(size));
        }
        self.zero_eof_block(id, &ii, size)
    }

    /// Rewrite the block holding EOF with zeros past EOF, the size staying
    /// (`btrfs_truncate_block` at i_size). An inline file keeps its extent when its
    /// size stays (`final_size`), and becomes a regular first block when it grows.
    pub(crate) fn zero_eof_block(
        &mut self,
        id: InodeId,
        ii: &InodeItem,
        final_size: u64,
    ) -> Result<()> {
        let InodeId { root, ino } = id;
        let ss = u64::from(self.sectorsize());
        let size = ii.size.get();
        if self
            .live()
            .file_extents(id, 0, 1)?
            .first()
            .is_some_and(|f| matches!(f.kind, ExtentKind::Inline { .. }))
        {
            if final_size == size {
                return Ok(());
            }
            return self.inline_to_regular(root, ino, ii);
        }
        self.write_file_inner(
            root,
            ino,
            size,
            size.div_ceil(ss) * ss,
            ii,
            size,
            &mut |b: &mut [u8]| {
                b.fill(0);
                Ok(())
            },
        )?;
        self.update_inode(id, |i| i.size = size.into())
    }

    /// When the block at `offset` is in a hole, where the hole the kernel sees for a
    /// lookup of `len` bytes there ends (`find_first_non_hole`'s one extent map): a
    /// hole extent to its end; a gap between extents to the next extent, but no further
    /// than the lookup's own range (from `offset` rounded down, `len` rounded up).
    ///
    /// That is the map a fresh `btrfs_get_extent` makes, as on a kernel just mounted.
    /// A long-mounted kernel may find a larger hole map in its extent map cache (one
    /// `btrfs_cont_expand` made over a whole gap, or read-ahead's merged ones) and, for
    /// a range all in a hole, do nothing where this goes on; the engine keeps no extent
    /// map cache yet (`InodeMapping`).
    pub(crate) fn hole_at(&mut self, id: InodeId, offset: u64, len: u64) -> Result<Option<u64>> {
        let ss = u64::from(self.sectorsize());
        let pos = offset / ss * ss;
        let limit = pos.saturating_add(len.div_ceil(ss) * ss);
        let ext = self.live().file_extents(id, pos, u64::MAX)?;
        match ext.iter().find(|f| f.end() > pos) {
            Some(f) if f.file_offset <= pos => {
                Ok(matches!(f.kind, ExtentKind::Regular { disk_bytenr: 0, .. }).then(|| f.end()))
            }
            Some(f) => Ok(Some(f.file_offset.min(limit))),
            None => Ok(Some(limit)),
        }
    }

    fn punch_hole_inner(&mut self, id: InodeId, offset: u64, end: u64) -> Result<()> {
        let ss = u64::from(self.sectorsize());
        let size = self.inode_item(id)?.size.get();
        let ino_size = size.div_ceil(ss) * ss;
        let orig = offset;
        // find_first_non_hole: a leading hole is skipped; a range that is all hole
        // (as `hole_at` sees it) changes nothing, not even the times. (Preallocated extents past EOF, which
        // KEEP_SIZE leaves, are not holes: they are punched too.)
        let mut offset = offset;
        if let Some(h) = self.hole_at(id, offset, end - offset)? {
            if h >= end {
                return Ok(());
            }
            offset = h;
        }
        let t = self.now();
        self.update_inode(id, |i| {
            i.mtime = t;
            i.ctime = t;
        })?;
        let same_block = offset / ss == (end - 1) / ss;
        if same_block && end - offset < ss {
            if offset < ino_size {
                self.truncate_block(id, offset, ((offset / ss + 1) * ss).min(end))?;
            }
            return Ok(());
        }
        let mut lockstart = offset.div_ceil(ss) * ss;
        let lockend = end / ss * ss;
        // The first block's part from `offset` on.
        if offset < ino_size && !offset.is_multiple_of(ss) {
            self.truncate_block(id, offset, lockstart)?;
        }
        if offset == orig {
            // After that, the aligned part may start in a hole.
            if let Some(h) = self.hole_at(id, lockstart, end - lockstart)? {
                if h >= end {
                    return Ok(());
                }
                lockstart = h.max(lockstart);
            }
        }
        // The last block's part before `end`, when that block is not a hole.
        if !end.is_multiple_of(ss)
            && lockend < ino_size
            && self.hole_at(id, lockend, end - lockend)?.is_none_or(|h| h < end)
        {
            self.zero_in_file(id, lockend, end.min(size))?;
        }
        if lockend <= lockstart {
            return Ok(());
        }
        // (An inline extent in the range goes whole: it lies in block 0, and the range
        // holds that block.)
        let removed = self.drop_extents_inner(id, lockstart, lockend)?;
        // Without no-holes, hole extents cover what was dropped inside the file.
        let hole_end = lockend.min(ino_size);
        if lockstart < hole_end
            && self.sb.incompat_flags.get() & ubtrfs_format::features::INCOMPAT_NO_HOLES == 0
        {
            let fe = crate::inode::write::reg_extent_item(self.transid, 0, hole_end - lockstart);
            self.insert_item(id.root, &Key::new(id.ino, EXTENT_DATA_KEY, lockstart), &fe)?;
        }
        self.update_inode(id, |i| i.nbytes = (i.nbytes.get() - removed.min(i.nbytes.get())).into())
    }
}

/// Where SEEK_DATA / SEEK_HOLE from `offset` lands in regular file `ii` whose extents
/// are `ext` (as `FsRead::file_extents` lists them, in file order), as the kernel's
/// `find_desired_extent` answers for a file with no dirty pages (the engine keeps none:
/// what it writes is in extents at once, as the kernel's delalloc is after writeback).
///
/// - Data: regular extents with a disk extent, compressed or not, and inline extents,
///   which count to the end of their sector (`btrfs_file_extent_end`). Holes: hole
///   extents, preallocated extents (zeros until written), file ranges without an
///   extent (no-holes), and whatever follows the last extent up to EOF.
/// - SEEK_DATA lands at `offset` inside data, else where the next data starts; SEEK_HOLE
///   at `offset` inside a hole, else where the data run holding it ends; never past EOF,
///   which counts as a hole.
/// - SEEK_HOLE in a file without the PREALLOC flag whose nbytes equal its size lands at
///   EOF without a look at the extents (the kernel's shortcut: nbytes counts every
///   block with data, so such a file has no hole).
///
/// None is ENXIO: an empty file, `offset` at or past EOF, or SEEK_DATA with no data
/// from `offset` to EOF. `sectorsize` is the filesystem's.
pub fn seek_data_hole(
    ii: &InodeItem,
    sectorsize: u32,
    ext: &[FileExtentRec],
    offset: u64,
    whence: i32,
) -> Option<u64> {
    let size = ii.size.get();
    if offset >= size {
        return None;
    }
    let hole = whence != SEEK_DATA;
    if hole && ii.flags.get() & INODE_PREALLOC == 0 && ii.nbytes.get() == size {
        return Some(size);
    }
    let ss = u64::from(sectorsize);
    // `pos` only grows, from `offset`: a gap, hole or data run that starts before it
    // starts there for the answer.
    let mut pos = offset;
    for f in ext {
        if pos >= size {
            break;
        }
        let end = match f.kind {
            ExtentKind::Inline { .. } => f.end().div_ceil(ss).saturating_mul(ss),
            ExtentKind::Regular { .. } => f.end(),
        };
        if end <= pos {
            continue;
        }
        // No extent between `pos` and this one: an implicit hole.
        if hole && f.file_offset > pos {
            return Some(pos);
        }
        let data = !f.is_hole_like();
        if data && !hole {
            let at = f.file_offset.max(pos);
            return (at < size).then_some(at);
        }
        if !data && hole {
            return Some(f.file_offset.max(pos).min(size));
        }
        pos = end;
    }
    hole.then_some(pos.min(size))
}

/// `seek_data_hole` of inode `id` as view `v` has it: lseek(2)'s SEEK_DATA or SEEK_HOLE
/// (`whence`) from `offset` in a regular file. Ok(None) is ENXIO.
///
/// # Errors
/// `Posix(Invalid)` for another `whence`; read failures.
pub fn seek_in_file<V: FsRead>(
    v: &V,
    id: InodeId,
    offset: u64,
    whence: i32,
) -> Result<Option<u64>> {
    if whence != SEEK_DATA && whence != SEEK_HOLE {
        return Err(Error::posix_detail(
            PosixKind::Invalid,
            id.to_string(),
            format!("lseek whence {whence} is neither SEEK_DATA nor SEEK_HOLE"),
        ));
    }
    let ii = v.load_inode(id, Load::ITEM)?.item;
    if offset >= ii.size.get() {
        return Ok(None);
    }
    let ext = v.file_extents(id, 0, ii.size.get())?;
    Ok(seek_data_hole(&ii, v.info().sectorsize, &ext, offset, whence))
}
