//! NOCOW writes: data written in place of the extent it overwrites instead of into a
//! new one (the kernel's `run_delalloc_nocow`).
//!
//! A write to an inode with NODATACOW or PREALLOC goes extent by extent over its
//! sector-aligned range. A part lands in place when its extent passes
//! `can_nocow_file_extent`'s rules:
//! - a regular or preallocated extent on disk (not a hole, not inline), neither
//!   compressed nor encrypted nor otherwise encoded; a regular one only in a NODATACOW
//!   and NODATASUM inode (the others are the file's checksummed data);
//! - not made before the subvolume's last snapshot (the file extent's generation, and
//!   the extent item's, above `last_snapshot`: older ones may be shared with it);
//! - referenced by nothing but this file at this extent position: one inline
//!   EXTENT_DATA_REF whose count is all of the extent's references, and no pending
//!   reference change of another referrer (`btrfs_cross_ref_exist`);
//! - no data checksums in the range written (an extent's checksums are all valid or
//!   absent).
//!
//! Every other part is COWed as any write is, uncompressed (such inodes never
//! compress). An in-place write into a preallocated extent turns the part written into
//! a regular extent of the same disk extent, merged with a regular neighbour it
//! continues (`btrfs_mark_extent_written`), and gets checksums unless the inode is
//! NODATASUM; an in-place write into a regular extent changes no item at all.
//!
//! Crash semantics are NOCOW's: a crash during an in-place overwrite of a regular
//! extent may leave the old or the new data in each sector; a preallocated extent's
//! part reads as zeros until the transaction that marks it written commits.

use crate::error::Result;
use crate::extent::delayed_ref::RefKind;
use crate::inode::filesystem::{ExtentKind, FsRead, InodeId};
use crate::inode::writer::FsWriter;
use crate::tree::search::TreeView;
use ubtrfs_format::items::InlineRef;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;

/// A part of a write that lands in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InPlace {
    /// File range written (sector aligned).
    pub file_off: u64,
    pub len: u64,
    /// Where its first byte goes on disk (logical).
    pub disk: u64,
    /// The extent: its item's key offset, disk extent, and whether it is preallocated.
    pub item_off: u64,
    pub disk_bytenr: u64,
    pub disk_num_bytes: u64,
    pub prealloc: bool,
}

/// One part of a NOCOW-capable write, in file order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece {
    /// [start, end) is written as new extents.
    Cow {
        start: u64,
        end: u64,
    },
    InPlace(InPlace),
}

impl Piece {
    pub fn range(&self) -> (u64, u64) {
        match *self {
            Piece::Cow { start, end } => (start, end),
            Piece::InPlace(p) => (p.file_off, p.file_off + p.len),
        }
    }
}

/// Whether writes to an inode with `flags` may go in place (NOCOW, or preallocated
/// extents to fill): such an inode never gets an inline extent, and its writeback
/// takes the direct path.
pub(crate) fn may_write_in_place(flags: u64) -> bool {
    nocow_capable(flags) || flags & ubtrfs_format::structs::INODE_PREALLOC != 0
}

/// Whether writes to an inode with these flags try to go in place (`should_nocow`).
pub(crate) fn nocow_capable(flags: u64) -> bool {
    flags & (INODE_NODATACOW | INODE_PREALLOC) != 0
}

impl FsWriter {
    /// Split [start, end) (sector aligned) of inode `id` with `flags` into parts
    /// written in place and parts COWed. A write covering no extent that qualifies is
    /// one COW part.
    pub(crate) fn nocow_plan(
        &mut self,
        id: InodeId,
        flags: u64,
        start: u64,
        end: u64,
    ) -> Result<Vec<Piece>> {
        let InodeId { root, ino } = id;
        let ss = u64::from(self.sectorsize());
        assert!(
            start.is_multiple_of(ss) && end.is_multiple_of(ss) && start < end,
            "unaligned NOCOW range [{start}, {end})"
        );
        let mut pieces: Vec<Piece> = Vec::new();
        let push_cow = |pieces: &mut Vec<Piece>, s: u64, e: u64| {
            if s >= e {
                return;
            }
            if let Some(Piece::Cow { end: pe, .. }) = pieces.last_mut() {
                if *pe == s {
                    *pe = e;
                    return;
                }
            }
            pieces.push(Piece::Cow { start: s, end: e });
        };
        if !nocow_capable(flags) {
            return Ok(vec![Piece::Cow { start, end }]);
        }
        let nodatacow = flags & INODE_NODATACOW != 0;
        let nodatasum = flags & INODE_NODATASUM != 0;
        let last_snapshot = self.live().read_root(root)?.1.last_snapshot.get();
        let mut cur = start;
        for f in self.live().file_extents(id, start, end)? {
            let (fs, fe) = (f.file_offset.max(start), f.end().min(end));
            if fs >= fe {
                continue;
            }
            push_cow(&mut pieces, cur, fs);
            cur = fe;
            let ExtentKind::Regular {
                disk_bytenr,
                disk_num_bytes,
                offset,
                compression,
                prealloc,
                ..
            } = f.kind
            else {
                push_cow(&mut pieces, fs, fe);
                continue;
            };
            // A regular extent goes in place only without checksums to keep: in a
            // NODATASUM inode (NODATACOW files are, unless the image was made oddly).
            if disk_bytenr == 0 || compression != 0 || !(prealloc || (nodatacow && nodatasum)) {
                push_cow(&mut pieces, fs, fe);
                continue;
            }
            // Encrypted or otherwise encoded extents never get here: reading the item
            // refuses them.
            if f.generation <= last_snapshot {
                push_cow(&mut pieces, fs, fe);
                continue;
            }
            let ref_offset = f.file_offset.wrapping_sub(offset);
            if self.extent_shared(
                root,
                ino,
                ref_offset,
                disk_bytenr,
                disk_num_bytes,
                last_snapshot,
            )? {
                push_cow(&mut pieces, fs, fe);
                continue;
            }
            let disk = disk_bytenr + offset + (fs - f.file_offset);
            let csums = crate::data::read::lookup_csums(&self.live(), disk, fe - fs)?;
            if csums.present.iter().any(|&p| p) {
                push_cow(&mut pieces, fs, fe);
                continue;
            }
            pieces.push(Piece::InPlace(InPlace {
                file_off: fs,
                len: fe - fs,
                disk,
                item_off: f.file_offset,
                disk_bytenr,
                disk_num_bytes,
                prealloc,
            }));
        }
        push_cow(&mut pieces, cur, end);
        debug_assert!(
            pieces.windows(2).all(|w| w[0].range().1 == w[1].range().0),
            "NOCOW plan not contiguous: {pieces:?}"
        );
        Ok(pieces)
    }

    /// How many bytes of [start, end) (sector aligned) a write would put in place.
    pub(crate) fn in_place_bytes(
        &mut self,
        id: InodeId,
        flags: u64,
        start: u64,
        end: u64,
    ) -> Result<u64> {
        if !nocow_capable(flags) || start >= end {
            return Ok(0);
        }
        Ok(self
            .nocow_plan(id, flags, start, end)?
            .iter()
            .map(|p| if let Piece::InPlace(p) = p { p.len } else { 0 })
            .sum())
    }

    /// Whether data extent `bytenr` may be referenced by anything but file `ino` of
    /// `root` at extent position `ref_offset` (`btrfs_cross_ref_exist`, with the
    /// last-snapshot heuristic of a buffered write).
    fn extent_shared(
        &mut self,
        root: u64,
        ino: u64,
        ref_offset: u64,
        bytenr: u64,
        num_bytes: u64,
        last_snapshot: u64,
    ) -> Result<bool> {
        let ours = RefKind::Data { root, ino, offset: ref_offset };
        if let Some(h) = self.delayed.head_of(bytenr) {
            if h.refs.iter().any(|(k, &d)| d != 0 && *k != ours) {
                return Ok(true);
            }
            if h.must_insert.is_some() {
                // Allocated in this transaction: no extent item yet, and only ours.
                return Ok(false);
            }
        }
        let key = Key::new(bytenr, EXTENT_ITEM_KEY, num_bytes);
        let extent_root = self.root(EXTENT_TREE_OBJECTID)?;
        let Some((k, data)) = self.first_item_ge(&extent_root, &key)? else { return Ok(true) };
        if k != key {
            // No extent item where the file extent points: COW, whose reference drop
            // then names the damage.
            return Ok(true);
        }
        let Ok(ei) = ubtrfs_format::items::extent_item(&data, false) else { return Ok(true) };
        if ei.generation <= last_snapshot {
            return Ok(true);
        }
        match ei.inline_refs.as_slice() {
            [InlineRef::ExtentData { root: r, objectid, offset, count }] => Ok(!(*r == root
                && *objectid == ino
                && *offset == ref_offset
                && u64::from(*count) == ei.refs)),
            _ => Ok(true),
        }
    }

    /// Write `data` (a sector multiple) in place at `disk`, with its checksums when
    /// the inode has them (only a preallocated extent's part can: a regular extent
    /// written in place has none, see `nocow_plan`).
    pub(crate) fn write_in_place(
        &mut self,
        disk: u64,
        data: &[u8],
        nodatasum: bool,
        prealloc: bool,
    ) -> Result<()> {
        crate::volumes::write_logical(
            &self.info.chunk_map,
            &self.info.devices,
            disk,
            data,
            crate::volumes::WriteKind::Data,
        )?;
        if nodatasum {
            return Ok(());
        }
        assert!(prealloc, "in-place write with checksums into a regular extent at {disk}");
        let ss = self.sectorsize() as usize;
        let cs = self.info.csum_type.size();
        let mut csums = Vec::with_capacity(data.len() / ss * cs);
        crate::extent::csum_tree::append_sector_csums(self.info.csum_type, ss, data, &mut csums);
        crate::extent::csum_tree::insert_csums(self, disk, &csums)
    }

    /// A part of a preallocated extent now holds data: the item is split around it,
    /// the part becomes regular and merges with a regular neighbour of the same disk
    /// extent it continues (`btrfs_mark_extent_written`). The extent's reference
    /// count follows the number of items pointing at it.
    pub(crate) fn mark_extent_written(&mut self, id: InodeId, p: &InPlace) -> Result<()> {
        let InodeId { root, ino } = id;
        let err = |r: String| crate::inode::write::ino_err(id, r);
        let (s, e) = (p.file_off, p.file_off + p.len);
        // The regular or preallocated extent item at `at`, if it is one: (extent
        // offset, length, preallocated, ram_bytes, of the same disk extent).
        let item_at =
            |w: &mut FsWriter, at: u64, within: u64| -> Result<Option<(u64, u64, bool, u64)>> {
                Ok(w.live()
                    .file_extents(id, within, within + 1)?
                    .into_iter()
                    .find(|f| f.file_offset == at)
                    .and_then(|f| match f.kind {
                        ExtentKind::Regular {
                            disk_bytenr,
                            disk_num_bytes,
                            offset,
                            num_bytes,
                            ram_bytes,
                            compression: 0,
                            prealloc,
                        } if disk_bytenr == p.disk_bytenr && disk_num_bytes == p.disk_num_bytes => {
                            Some((offset, num_bytes, prealloc, ram_bytes))
                        }
                        _ => None,
                    }))
            };
        let key = Key::new(ino, EXTENT_DATA_KEY, p.item_off);
        let (off, len, prealloc, ram_bytes) = item_at(self, p.item_off, s)?
            .ok_or_else(|| err(format!("preallocated extent {key} vanished")))?;
        if !prealloc {
            return Err(err(format!("file extent {key} is no longer preallocated")));
        }
        let ke = p.item_off + len;
        assert!(
            p.item_off <= s && e <= ke,
            "written range [{s}, {e}) outside its extent [{}, {ke})",
            p.item_off
        );
        // Segments (file offset, type, extent offset, length) replacing the old items.
        let mut old: Vec<Key> = vec![key];
        let mut segs: Vec<(u64, u8, u64, u64)> = Vec::new();
        if s == p.item_off && s > 0 {
            // The regular item ending at `s`, continuing into this part.
            let prev = self
                .live()
                .file_extents(id, s - 1, s)?
                .into_iter()
                .find(|f| f.end() == s && f.file_offset < s)
                .map(|f| f.file_offset);
            if let Some(po) = prev {
                if let Some((eo, n, false, _)) = item_at(self, po, s - 1)? {
                    if eo + n == off {
                        old.insert(0, Key::new(ino, EXTENT_DATA_KEY, po));
                        segs.push((po, FILE_EXTENT_REG, eo, n));
                    }
                }
            }
        }
        if s > p.item_off {
            segs.push((p.item_off, FILE_EXTENT_PREALLOC, off, s - p.item_off));
        }
        segs.push((s, FILE_EXTENT_REG, off + (s - p.item_off), e - s));
        if e < ke {
            segs.push((e, FILE_EXTENT_PREALLOC, off + (e - p.item_off), ke - e));
        } else if let Some((eo, n, false, _)) = item_at(self, ke, ke)? {
            if eo == off + (ke - p.item_off) {
                old.push(Key::new(ino, EXTENT_DATA_KEY, ke));
                segs.push((ke, FILE_EXTENT_REG, eo, n));
            }
        }
        // Merge neighbouring regular segments.
        let mut merged: Vec<(u64, u8, u64, u64)> = Vec::with_capacity(segs.len());
        for sg in segs {
            match merged.last_mut() {
                Some(m)
                    if m.1 == FILE_EXTENT_REG
                        && sg.1 == FILE_EXTENT_REG
                        && m.0 + m.3 == sg.0
                        && m.2 + m.3 == sg.2 =>
                {
                    m.3 += sg.3
                }
                _ => merged.push(sg),
            }
        }
        for k in &old {
            self.delete_item(root, k)?;
        }
        for &(fo, type_, eo, n) in &merged {
            let d = ubtrfs_format::items::file_extent_reg_item(
                &FileExtentHeader {
                    generation: self.transid.into(),
                    ram_bytes: ram_bytes.into(),
                    compression: 0,
                    encryption: 0,
                    other_encoding: 0.into(),
                    type_,
                },
                &FileExtentBody {
                    disk_bytenr: p.disk_bytenr.into(),
                    disk_num_bytes: p.disk_num_bytes.into(),
                    offset: eo.into(),
                    num_bytes: n.into(),
                },
            );
            self.insert_item(root, &Key::new(ino, EXTENT_DATA_KEY, fo), &d)?;
        }
        let delta = merged.len() as i64 - old.len() as i64;
        if delta != 0 {
            self.data_ref(
                p.disk_bytenr,
                p.disk_num_bytes,
                root,
                ino,
                p.item_off.wrapping_sub(off),
                delta,
            )?;
        }
        Ok(())
    }
}
