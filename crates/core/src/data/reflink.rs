//! Sharing extents between files: clone range (FICLONE / FICLONERANGE, the kernel's
//! `btrfs_clone_files`) and dedupe range (FIDEDUPERANGE, `btrfs_extent_same`).
//!
//! A clone points the destination's file extent items at the source's disk extents
//! (each shared extent gains an EXTENT_DATA_REF for the destination, through the
//! delayed refs like every other ref change), after dropping what the destination
//! held in the range. Checksums are keyed by disk address, so they are shared with
//! the data. Holes stay holes (explicit hole items where the filesystem lacks
//! no-holes); preallocated extents stay preallocated; compressed extents are shared
//! compressed. An inline source extent cannot be shared: its bytes are copied,
//! through the write path, as the kernel copies them.
//!
//! The checks are the kernel's (`btrfs_remap_file_range_prep`,
//! `generic_remap_checks`): offsets on block boundaries, a length on one too unless
//! the range ends at the source's EOF (and then it may not end inside the
//! destination's data), no overlap within one file, no mix of checksummed and
//! unchecksummed files, a writable, not immutable destination.
//!
//! The page cache is the engine's business (`Engine::clone_range` writes both files
//! back first and drops the destination's cached range after); here the trees hold
//! the files whole.

use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{ExtentKind, FsRead, InodeId, Load};
use crate::inode::write::{iflags_allow, IflagOp};
use crate::inode::writer::FsWriter;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;

/// Extents cloned per transaction handle (each takes a few items: the destination's
/// item, an edge split, the ref).
const EXTENTS_PER_HANDLE: usize = 64;

/// Most bytes one dedupe compares and shares per call, as the kernel's
/// `BTRFS_MAX_DEDUPE_LEN` limits each FIDEDUPERANGE (a longer request does that much).
pub const MAX_DEDUPE_LEN: u64 = 16 << 20;

/// What a dedupe found (`FILE_DEDUPE_RANGE_SAME` / `_DIFFERS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dedupe {
    /// The ranges were equal and now share their extents: this many bytes.
    Same(u64),
    /// The bytes differ; nothing changed.
    Differs,
}

/// One destination item of a clone: at file offset `at`; `shares`, for an extent
/// (not a hole): its disk bytenr and length, the ref's offset (file offset of the
/// extent's start, wrapping as the kernel's does), and the bytes nbytes counts.
struct Piece {
    at: u64,
    /// Where it ends in the destination.
    end: u64,
    item: Vec<u8>,
    shares: Option<(u64, u64, u64, u64)>,
}

/// A clone or dedupe request, checked (`check_remap`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Remap {
    src: InodeId,
    src_off: u64,
    dst: InodeId,
    dst_off: u64,
    /// Bytes of file the destination gets (to the source's EOF when it ends there).
    pub(crate) len: u64,
    /// `len` rounded up to a block: the extents' span.
    span: u64,
}

fn invalid(what: String, why: &str) -> Error {
    Error::posix_detail(PosixKind::Invalid, what, why.to_string())
}

impl FsWriter {
    /// Check a remap of `len` bytes from `src` at `src_off` to `dst` at `dst_off` (len
    /// 0: to the source's EOF, as FICLONERANGE takes it) and return it with its
    /// length settled. `dedupe` takes the dedupe rules for the EOF case.
    pub(crate) fn check_remap(
        &mut self,
        src: InodeId,
        src_off: u64,
        len: u64,
        dst: InodeId,
        dst_off: u64,
        dedupe: bool,
    ) -> Result<Remap> {
        // The request, named in a refusal (formatted only then: this runs per 4 KiB
        // dedupe).
        let what = || {
            format!(
                "{} of {src} at {src_off} +{len} to {dst} at {dst_off}",
                if dedupe { "dedupe" } else { "clone" }
            )
        };
        self.check_root_writable(dst.root)?;
        let si = self.live().load_inode(src, Load::ITEM)?.item;
        let di = self.live().load_inode(dst, Load::ITEM)?.item;
        for (id, ii) in [(src, &si), (dst, &di)] {
            match ii.mode.get() & S_IFMT {
                S_IFREG => {}
                S_IFDIR => {
                    return Err(Error::posix(
                        PosixKind::IsDir,
                        format!("{}: {id} is a directory", what()),
                    ))
                }
                _ => return Err(invalid(what(), "both files must be regular files")),
            }
        }
        iflags_allow(dst, di.flags.get(), IflagOp::Write, b"")?;
        if di.flags.get() & INODE_APPEND != 0 {
            return Err(Error::posix(
                PosixKind::NotPermitted,
                format!("{}: {dst} is append-only", what()),
            ));
        }
        // Half the destination checksummed would fail the checker (the kernel's rule).
        if (si.flags.get() ^ di.flags.get()) & INODE_NODATASUM != 0 {
            return Err(invalid(what(), "one file has data checksums and the other has not"));
        }
        let bs = u64::from(self.sectorsize());
        let (ssize, dsize) = (si.size.get(), di.size.get());
        if !src_off.is_multiple_of(bs) || !dst_off.is_multiple_of(bs) {
            return Err(invalid(what(), "the offsets must be multiples of the block size"));
        }
        if src_off > ssize {
            return Err(invalid(what(), "the source range starts past its end"));
        }
        let mut len = if len == 0 { ssize - src_off } else { len };
        if dedupe {
            // A dedupe is shortened to what both files hold, and to whole blocks
            // unless it reaches both ends (REMAP_FILE_CAN_SHORTEN).
            if dst_off > dsize {
                return Err(invalid(what(), "the destination range starts past its end"));
            }
            len = len.min(ssize - src_off).min(dsize - dst_off);
            if !(src_off + len == ssize && dst_off + len == dsize) {
                len = len / bs * bs;
            }
        }
        let end = src_off.checked_add(len).ok_or_else(|| invalid(what(), "the range overflows"))?;
        if end > ssize {
            return Err(invalid(what(), "the source range ends past its end"));
        }
        dst_off
            .checked_add(len)
            .filter(|&e| e <= i64::MAX as u64)
            .ok_or_else(|| invalid(what(), "the destination range overflows"))?;
        if !len.is_multiple_of(bs) {
            // Only a range to the source's EOF ends inside a block, and then only at or
            // past the destination's EOF (a dedupe: exactly at it): it cannot leave a
            // partial block inside the destination's data.
            let at_eof = end == ssize;
            let dst_ok = if dedupe { dst_off + len == dsize } else { dst_off + len >= dsize };
            if !at_eof || !dst_ok {
                return Err(invalid(what(), "the length must be a multiple of the block size unless the range ends at both files' end"));
            }
        }
        let span = len.div_ceil(bs) * bs;
        if src == dst && src_off < dst_off + span && dst_off < src_off + span {
            return Err(invalid(what(), "the ranges overlap in one file"));
        }
        Ok(Remap { src, src_off, dst, dst_off, len, span })
    }

    /// Clone `len` bytes (0: to the source's EOF) of file `src` at `src_off` into file
    /// `dst` at `dst_off` (see the module notes). The destination's times change.
    /// Returns the bytes cloned.
    ///
    /// # Errors
    /// `Posix(Invalid)` for a range the kernel refuses, `Posix(IsDir)`,
    /// `Posix(NotPermitted)` for an immutable or append-only destination,
    /// `Posix(ReadOnly)` for a read-only destination subvolume; tree failures.
    pub fn clone_range(
        &mut self,
        src: InodeId,
        src_off: u64,
        len: u64,
        dst: InodeId,
        dst_off: u64,
    ) -> Result<u64> {
        let r = self.check_remap(src, src_off, len, dst, dst_off, false)?;
        self.remap(r, true)?;
        Ok(r.len)
    }

    /// Dedupe without a page cache (the offline writer's `FIDEDUPERANGE`): compare
    /// `len` bytes (at most `MAX_DEDUPE_LEN`) of `src` at `src_off` with `dst` at
    /// `dst_off` as the trees hold them; when equal, share the source's extents into
    /// the destination (no times change), else change nothing.
    ///
    /// # Errors
    /// As `clone_range`, with the dedupe rules for ranges at EOF; read errors.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn dedupe_range(
        &mut self,
        src: InodeId,
        src_off: u64,
        len: u64,
        dst: InodeId,
        dst_off: u64,
    ) -> Result<Dedupe> {
        let r = self.check_remap(src, src_off, len.min(MAX_DEDUPE_LEN), dst, dst_off, true)?;
        if r.len == 0 {
            return Ok(Dedupe::Same(0));
        }
        // Two buffers kept per thread (a dedupe tool calls this for every 16 MiB);
        // every byte of each is read over.
        thread_local! {
            static BUFS: std::cell::RefCell<(Vec<u8>, Vec<u8>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
        }
        let same = BUFS.with(|c| -> Result<bool> {
            let (a, b) = &mut *c.borrow_mut();
            a.resize(r.len as usize, 0);
            b.resize(r.len as usize, 0);
            self.read_old_data(src.root, src.ino, src_off, a)?;
            self.read_old_data(dst.root, dst.ino, dst_off, b)?;
            Ok(a == b)
        })?;
        if !same {
            return Ok(Dedupe::Differs);
        }
        self.remap(r, false)?;
        Ok(Dedupe::Same(r.len))
    }

    /// Share `r`'s source extents into its destination. `times`: a clone's mtime and
    /// ctime update (a dedupe changes no content, and no times).
    pub(crate) fn remap(&mut self, r: Remap, times: bool) -> Result<()> {
        if r.len == 0 {
            return Ok(());
        }
        let Remap { src, src_off, dst, dst_off, len, span } = r;
        // Past the destination's EOF first: its last block zeroed past the end, hole
        // items without no-holes (the kernel's btrfs_cont_expand).
        let dsize = self.live().load_inode(dst, Load::ITEM)?.item.size.get();
        if dst_off > dsize {
            self.transaction("clone: expand", 8, |w| w.set_size_inner(dst, dst_off))?;
        }
        // (After the expansion, which may rewrite the source's last block when both
        // are one file.)
        let recs = self.live().file_extents(src, src_off, src_off + span)?;
        let no_holes =
            self.sb.incompat_flags.get() & ubtrfs_format::features::INCOMPAT_NO_HOLES != 0;
        let new_size = dsize.max(dst_off + len);
        let bs = u64::from(self.sectorsize());
        // The destination's range is emptied, then filled extent by extent, a few
        // dozen per handle; the size and times go in with the last batch.
        let mut inline: Vec<(u64, u64)> = Vec::new();
        let mut pieces: Vec<Piece> = Vec::new();
        let mut cur = src_off;
        let hole_item = |w: &FsWriter, at: u64, to: u64| -> Option<Piece> {
            // Without no-holes every gap inside the new size is an explicit hole.
            let to = to.min(new_size.div_ceil(bs) * bs);
            (!no_holes && at < to).then(|| Piece {
                at,
                end: to,
                item: crate::inode::write::reg_extent_item(w.transid, 0, to - at),
                shares: None,
            })
        };
        for f in &recs {
            let (s, t) = (f.file_offset.max(src_off), f.end().min(src_off + span));
            if s >= t {
                continue;
            }
            if cur < s {
                pieces.extend(hole_item(self, dst_off + (cur - src_off), dst_off + (s - src_off)));
            }
            cur = t;
            let d = dst_off + (s - src_off);
            match &f.kind {
                ExtentKind::Inline { .. } => inline.push((s, t.min(src_off + len))),
                ExtentKind::Regular { disk_bytenr: 0, .. } => {
                    pieces.extend(hole_item(self, d, dst_off + (t - src_off)))
                }
                ExtentKind::Regular {
                    disk_bytenr,
                    disk_num_bytes,
                    offset,
                    ram_bytes,
                    compression,
                    prealloc,
                    ..
                } => {
                    let item = ubtrfs_format::items::file_extent_reg_item(
                        &FileExtentHeader {
                            generation: self.transid.into(),
                            ram_bytes: (*ram_bytes).into(),
                            compression: *compression,
                            encryption: 0,
                            other_encoding: 0.into(),
                            type_: if *prealloc { FILE_EXTENT_PREALLOC } else { FILE_EXTENT_REG },
                        },
                        &FileExtentBody {
                            disk_bytenr: (*disk_bytenr).into(),
                            disk_num_bytes: (*disk_num_bytes).into(),
                            offset: (offset + (s - f.file_offset)).into(),
                            num_bytes: (t - s).into(),
                        },
                    );
                    let ext_off = offset + (s - f.file_offset);
                    pieces.push(Piece {
                        at: d,
                        end: d + (t - s),
                        item,
                        shares: Some((
                            *disk_bytenr,
                            *disk_num_bytes,
                            d.wrapping_sub(ext_off),
                            t - s,
                        )),
                    });
                }
            }
        }
        if cur < src_off + span {
            pieces.extend(hole_item(self, dst_off + (cur - src_off), dst_off + span));
        }
        // One handle per batch of extents (one in all for a small clone, as the
        // kernel's btrfs_clone takes about one per extent): the first drops the
        // destination's range, each inserts its items and refs and moves nbytes, the
        // last sets the size and times.
        let t = self.now();
        let batches: Vec<&[Piece]> =
            if pieces.is_empty() { vec![&[]] } else { pieces.chunks(EXTENTS_PER_HANDLE).collect() };
        let last = batches.len() - 1;
        for (i, batch) in batches.into_iter().enumerate() {
            let items = 3 * batch.len() as u64 + 4;
            self.transaction("clone", items, |w| {
                let removed =
                    if i == 0 { w.drop_extents_inner(dst, dst_off, dst_off + span)? } else { 0 };
                let mut added = 0;
                for p in batch {
                    w.insert_item(dst.root, &Key::new(dst.ino, EXTENT_DATA_KEY, p.at), &p.item)?;
                    if let Some((bytenr, num, ref_off, bytes)) = p.shares {
                        w.data_ref(bytenr, num, dst.root, dst.ino, ref_off, 1)?;
                        added += bytes;
                    }
                }
                w.update_inode(dst, |ii| {
                    ii.nbytes = (ii.nbytes.get() - removed.min(ii.nbytes.get()) + added).into();
                    // The size grows with each batch (never past the clone's end), so a
                    // clone cut short by an error leaves no extent past EOF.
                    let reach = if i == last {
                        new_size
                    } else {
                        batch.last().map_or(0, |p| p.end).min(new_size)
                    };
                    if ii.size.get() < reach {
                        ii.size = reach.into();
                    }
                    if i == last && times {
                        ii.mtime = t;
                        ii.ctime = t;
                    }
                })
            })?;
        }
        // An inline source extent: its bytes, copied.
        for (s, t) in inline {
            let mut buf = vec![0u8; (t - s) as usize];
            self.read_old_data(src.root, src.ino, s, &mut buf)?;
            self.write_file(dst.root, dst.ino, dst_off + (s - src_off), &buf)?;
        }
        Ok(())
    }
}
