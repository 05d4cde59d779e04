//! Compression on write, as the kernel's `inode_need_compress` and
//! `compress_file_range` decide it.
//!
//! Whether a file's writes are compressed, and with what:
//! - never for NODATACOW or NODATASUM files (compressed extents need checksums);
//! - always (whenever it shrinks) with `compress-force`: no heuristic, no marking;
//! - not for a file marked NOCOMPRESS (`chattr +m`, or an earlier range that did not
//!   shrink);
//! - else with `compress`, the file's COMPRESS flag (`chattr +c`) or its
//!   `btrfs.compression` property, after the heuristic says the range is worth it.
//!   The property's algorithm wins over the mount's; a COMPRESS flag alone means zlib.
//!
//! How: the range is cut into pieces of 128 KiB of file data (BTRFS_MAX_UNCOMPRESSED),
//! each compressed on its own into one extent (`ram_bytes` = `num_bytes` = the piece,
//! `disk_num_bytes` = the compressed stream rounded up to a sector, checksums over the
//! disk bytes). A piece is kept compressed only if that saves at least one sector;
//! otherwise the file is marked NOCOMPRESS (unless forced or by property) and the rest
//! is written plain. A range of one sector or less that is not the whole file is not
//! worth trying. A whole file of at most one sector that compresses to at most
//! `max_inline` bytes becomes a compressed inline extent.
//!
//! The first zstd or lzo extent sets the filesystem's COMPRESS_ZSTD / COMPRESS_LZO
//! incompat bit, as the kernel does, so older kernels refuse what they cannot read.

use crate::compression::{
    compress_with_level, heuristic, CompressPolicy, CompressionType, BTRFS_MAX_UNCOMPRESSED,
};
use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::InodeId;
use crate::inode::writer::FsWriter;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;
use zerocopy::IntoBytes;

/// How one write is compressed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Choice {
    pub kind: CompressionType,
    pub level: Option<i32>,
    /// Ask the heuristic first (not with compress-force).
    pub heuristic: bool,
    /// Mark the file NOCOMPRESS when a range does not shrink (neither forced nor by
    /// property).
    pub mark: bool,
}

/// What `try_compressed_inline` did.
pub(crate) enum InlineTry {
    /// The file is a compressed inline extent now.
    Done,
    /// It compresses, but not into an inline extent: compress it as a regular one.
    Regular,
    /// Do not compress it (the heuristic, or a compression that did not shrink).
    Plain,
}

/// Pieces compressed together (32 x 128 KiB = 4 MiB of file data).
const COMPRESS_BATCH: usize = 32;

/// What compression makes of one piece.
enum Verdict {
    /// A sector or less, not the whole file: not worth trying.
    Small,
    /// The heuristic said no.
    TurnedDown,
    /// Compressed, and it saves at least a sector.
    Compressed(Vec<u8>),
    /// Compressed, and it does not save a sector (or did not shrink at all).
    NoWin,
}

/// Judge and compress `pieces` (file offset, bytes) on every core; the first piece of
/// the range (`start`) passed the heuristic already.
fn judge_pieces(
    c: &Choice,
    ss: usize,
    start: u64,
    old_size: u64,
    pieces: &[(u64, Vec<u8>)],
) -> Result<Vec<Verdict>> {
    let judge = |(at, piece): &(u64, Vec<u8>)| -> Result<Verdict> {
        let n = piece.len();
        if n <= ss && (*at > 0 || *at + (n as u64) < old_size) {
            return Ok(Verdict::Small);
        }
        if c.heuristic && *at != start && !heuristic::worth_compressing(piece) {
            return Ok(Verdict::TurnedDown);
        }
        let z = compress_with_level(c.kind, piece, ss, c.level)
            .map_err(|e| Error::Incompatible(format!("cannot compress with {}: {e}", c.kind)))?;
        Ok(match z {
            // It must save at least one sector once rounded up.
            Some(z) if z.len().div_ceil(ss) * ss + ss <= n.div_ceil(ss) * ss => {
                Verdict::Compressed(z)
            }
            _ => Verdict::NoWin,
        })
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(pieces.len());
    if threads <= 1 {
        return pieces.iter().map(judge).collect();
    }
    let mut out: Vec<Option<Result<Verdict>>> = (0..pieces.len()).map(|_| None).collect();
    std::thread::scope(|s| {
        let per = pieces.len().div_ceil(threads);
        let handles: Vec<_> = pieces
            .chunks(per)
            .map(|chunk| s.spawn(move || chunk.iter().map(judge).collect::<Vec<_>>()))
            .collect();
        let mut i = 0;
        for h in handles {
            for v in h.join().expect("a compression thread panicked") {
                out[i] = Some(v);
                i += 1;
            }
        }
    });
    out.into_iter().map(|v| v.expect("every piece judged")).collect()
}

impl FsWriter {
    /// Set the mount-wide compression.
    pub fn set_compress(&mut self, p: CompressPolicy) {
        self.compress = p;
    }

    /// The mount-wide compression.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn compress_policy(&self) -> CompressPolicy {
        self.compress
    }

    /// How a write to a file with inode item `ii` and compression property `prop` is
    /// compressed (see the module documentation), or None.
    pub(crate) fn compress_choice(
        &self,
        ii: &InodeItem,
        prop: Option<(CompressionType, Option<i32>)>,
    ) -> Option<Choice> {
        let flags = ii.flags.get();
        // NODATACOW and NODATASUM files cannot compress (`btrfs_inode_can_compress`);
        // a PREALLOC file's writeback goes the NOCOW way, whose COW parts are plain.
        if flags & (INODE_NODATACOW | INODE_NODATASUM | INODE_PREALLOC) != 0 {
            return None;
        }
        let p = self.compress;
        if p.force {
            let (kind, level) = prop.unwrap_or((p.alg?, p.level));
            return Some(Choice {
                kind,
                level: level.or(if Some(kind) == p.alg { p.level } else { None }),
                heuristic: false,
                mark: false,
            });
        }
        if flags & INODE_NOCOMPRESS != 0 {
            return None;
        }
        if let Some((kind, level)) = prop {
            return Some(Choice {
                kind,
                level: level.or(if Some(kind) == p.alg { p.level } else { None }),
                heuristic: true,
                mark: false,
            });
        }
        if let Some(kind) = p.alg {
            return Some(Choice { kind, level: p.level, heuristic: true, mark: true });
        }
        if flags & INODE_COMPRESS != 0 {
            return Some(Choice {
                kind: CompressionType::Zlib,
                level: None,
                heuristic: true,
                mark: true,
            });
        }
        None
    }

    /// Compress `data` for an extent; None when it is not worth it or does not shrink.
    fn try_compress(&self, c: &Choice, data: &[u8]) -> Result<Option<Vec<u8>>> {
        let ss = self.sectorsize() as usize;
        compress_with_level(c.kind, data, ss, c.level)
            .map_err(|e| Error::Incompatible(format!("cannot compress with {}: {e}", c.kind)))
    }

    /// Set the incompat bit a `kind` extent needs.
    fn note_compression(&mut self, kind: CompressionType) {
        let bit = match kind {
            CompressionType::Lzo => ubtrfs_format::features::INCOMPAT_COMPRESS_LZO,
            CompressionType::Zstd => ubtrfs_format::features::INCOMPAT_COMPRESS_ZSTD,
            _ => 0,
        };
        let f = self.sb.incompat_flags.get();
        if f & bit != bit {
            self.sb.incompat_flags = (f | bit).into();
        }
    }

    /// Mark file `ino` NOCOMPRESS (a range did not shrink).
    fn mark_incompressible(&mut self, root: u64, ino: u64) -> Result<()> {
        let id = InodeId { root, ino };
        self.update_inode(id, |i| i.flags = (i.flags.get() | INODE_NOCOMPRESS).into())
    }

    /// The whole file `content` (at most a sector) as a compressed inline extent, if
    /// the compression decides so and the result fits. A compression that was tried
    /// and did not shrink marks the file as the choice says.
    pub(crate) fn try_compressed_inline(
        &mut self,
        root: u64,
        ino: u64,
        c: &Choice,
        content: &[u8],
    ) -> Result<InlineTry> {
        let ss = self.sectorsize() as usize;
        let max_inline =
            (crate::inode::write::MAX_INLINE as usize).min(self.nodesize() as usize / 2);
        if content.is_empty() || content.len() > ss {
            return Ok(InlineTry::Plain);
        }
        // The heuristic sees the sector the kernel's page holds (zeros past EOF); the
        // compression, the file's bytes.
        let mut padded = content.to_vec();
        padded.resize(ss, 0);
        if c.heuristic && !heuristic::worth_compressing(&padded) {
            return Ok(InlineTry::Plain);
        }
        match self.try_compress(c, content)? {
            Some(z) if z.len() <= max_inline && z.len() < ss => {
                let id = InodeId { root, ino };
                self.insert_inline_item(id, content.len() as u64, c.kind as u8, &z)?;
                self.note_compression(c.kind);
                Ok(InlineTry::Done)
            }
            Some(z) if z.len().div_ceil(ss) * ss + ss <= content.len().div_ceil(ss) * ss => {
                Ok(InlineTry::Regular)
            }
            _ => {
                // Not a win: the kernel's mark_incompressible.
                if c.mark {
                    self.mark_incompressible(root, ino)?;
                }
                Ok(InlineTry::Plain)
            }
        }
    }

    /// The file's `btrfs.compression` property as the write path uses it: the
    /// algorithm (the kernel keeps no level from it), None when absent or "no"/"none"
    /// (which set NOCOMPRESS instead).
    pub(crate) fn compression_prop(
        &mut self,
        root: u64,
        ino: u64,
        ii: &InodeItem,
    ) -> Result<Option<(CompressionType, Option<i32>)>> {
        use crate::inode::xattr::XattrRead;
        // Setting the property sets the COMPRESS flag (props.c does the same), so a file
        // without the flag has no property to look up.
        if ii.flags.get() & INODE_COMPRESS == 0 {
            return Ok(None);
        }
        let p = self.live().compression_property(InodeId { root, ino })?;
        Ok(p.filter(|p| p.kind != CompressionType::None).map(|p| (p.kind, None)))
    }

    /// Write [start, start + total) of file `ino` (sector aligned) from `src`, with
    /// compression `c` (see the module documentation); `old_size` is the file's size
    /// before the write. Returns the bytes added to nbytes.
    ///
    /// As the kernel's delalloc runs it: the heuristic first looks at the range's
    /// first 128 KiB, and if that is not worth compressing the whole range is written
    /// plain, in large extents. Otherwise each 128 KiB piece is tried; a piece the
    /// heuristic turns down sends the rest of its 512 KiB chunk plain, and a piece
    /// that does not shrink marks the file NOCOMPRESS (as the choice says) and sends
    /// the rest of the range plain. Consecutive plain pieces become one extent.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_extents_compressed(
        &mut self,
        root: u64,
        ino: u64,
        start: u64,
        total: u64,
        old_size: u64,
        c: &Choice,
        src: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<u64> {
        const CHUNK: u64 = 512 * 1024;
        let ss = u64::from(self.sectorsize());
        let end = start + total;
        let piece_len = |at: u64| (end - at).min(BTRFS_MAX_UNCOMPRESSED as u64);
        let mut first = vec![0u8; piece_len(start) as usize];
        src(&mut first)?;
        let worth = !c.heuristic || heuristic::worth_compressing(&first);
        let mut first_pos = 0usize;
        // The source, with the first piece (read for the heuristic) put back in front.
        let mut next = |b: &mut [u8]| -> Result<()> {
            let k = (first.len() - first_pos).min(b.len());
            b[..k].copy_from_slice(&first[first_pos..first_pos + k]);
            first_pos += k;
            if k < b.len() {
                src(&mut b[k..])?;
            }
            Ok(())
        };
        if !worth {
            return self.write_plain(root, ino, start, total, false, &mut next);
        }
        let mut added = 0;
        let mut cur = start;
        // Plain bytes not written yet: [plain_at, plain_at + plain.len()).
        let mut plain: Vec<u8> = Vec::new();
        let mut plain_at = start;
        let mut plain_until = start;
        let ss_us = ss as usize;
        while cur < end {
            // A batch of pieces, read in order, then judged and compressed on every
            // core at once (the kernel's async compression workers); the decisions
            // below are taken in file order, as if one piece at a time.
            let mut batch: Vec<(u64, Vec<u8>)> = Vec::new();
            let mut at = cur;
            while at < end && batch.len() < COMPRESS_BATCH {
                let n = piece_len(at);
                let mut piece = vec![0u8; n as usize];
                next(&mut piece)?;
                batch.push((at, piece));
                at += n;
            }
            let judged = judge_pieces(c, ss_us, start, old_size, &batch)?;
            for ((at, piece), verdict) in batch.into_iter().zip(judged) {
                let n = piece.len() as u64;
                let z = if at < plain_until {
                    None
                } else {
                    match verdict {
                        Verdict::Small => None,
                        Verdict::TurnedDown => {
                            plain_until = start + (at - start) / CHUNK * CHUNK + CHUNK;
                            None
                        }
                        Verdict::Compressed(z) => Some(z),
                        Verdict::NoWin if c.mark => {
                            // The file is NOCOMPRESS from now on: the rest goes plain.
                            self.mark_incompressible(root, ino)?;
                            plain_until = end;
                            None
                        }
                        Verdict::NoWin => None,
                    }
                };
                let z = match z {
                    Some(z) => {
                        added += self.flush_plain(root, ino, plain_at, &mut plain)?;
                        plain_at = at;
                        match self.write_compressed_extent(root, ino, at, n, c.kind, &z)? {
                            Some(got) => {
                                added += got;
                                plain_at = at + n;
                                Some(())
                            }
                            // No room for the extent whole, even in a new chunk: the
                            // range goes plain, which fits in pieces
                            // (submit_uncompressed_range).
                            None => None,
                        }
                    }
                    None => None,
                };
                match z {
                    Some(()) => {}
                    None => {
                        if plain.is_empty() {
                            plain_at = at;
                        }
                        plain.extend_from_slice(&piece);
                        if plain.len() as u64 >= crate::inode::write::MAX_EXTENT_SIZE.min(32 << 20)
                        {
                            added += self.flush_plain(root, ino, plain_at, &mut plain)?;
                            plain_at = at + n;
                        }
                    }
                }
            }
            cur = at;
        }
        added += self.flush_plain(root, ino, plain_at, &mut plain)?;
        Ok(added)
    }

    /// Write the buffered plain bytes at `at` (in as few extents as free space allows).
    fn flush_plain(&mut self, root: u64, ino: u64, at: u64, plain: &mut Vec<u8>) -> Result<u64> {
        if plain.is_empty() {
            return Ok(0);
        }
        let mut pos = 0usize;
        let n = plain.len() as u64;
        let added = self.write_plain(root, ino, at, n, false, &mut |b: &mut [u8]| {
            b.copy_from_slice(&plain[pos..pos + b.len()]);
            pos += b.len();
            Ok(())
        })?;
        plain.clear();
        Ok(added)
    }

    /// [at, at + n) written plain (`write_new_extent` in extents of at most
    /// MAX_EXTENT_SIZE).
    pub(crate) fn write_plain(
        &mut self,
        root: u64,
        ino: u64,
        at: u64,
        n: u64,
        nodatasum: bool,
        src: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<u64> {
        let mut cur = at;
        let end = at + n;
        let mut added = 0;
        while cur < end {
            let want = (end - cur).min(crate::inode::write::MAX_EXTENT_SIZE);
            let got = self.write_new_extent(root, ino, cur, want, nodatasum, src)?;
            added += got;
            cur += got;
        }
        Ok(added)
    }

    /// One compressed extent of `n` file bytes at `file_off`, holding stream `z`; `None`
    /// (nothing changed) when the data space has no run of its size, even after a new
    /// chunk, so the caller writes the range plain.
    fn write_compressed_extent(
        &mut self,
        root: u64,
        ino: u64,
        file_off: u64,
        n: u64,
        kind: CompressionType,
        z: &[u8],
    ) -> Result<Option<u64>> {
        let ss = u64::from(self.sectorsize());
        let disk = (z.len() as u64).div_ceil(ss) * ss;
        let (bytenr, got) =
            match crate::space::allocator::alloc_extent_upto(self, BLOCK_GROUP_DATA, disk, disk) {
                Ok(r) => r,
                Err(e) if e.posix_kind() == Some(PosixKind::NoSpace) => return Ok(None),
                Err(e) => return Err(e),
            };
        debug_assert_eq!(got, disk, "a compressed extent is allocated whole");
        self.delayed.add_data_ref(
            bytenr,
            disk,
            crate::extent::delayed_ref::RefKind::Data { root, ino, offset: file_off },
            1,
            true,
        )?;
        let mut padded = vec![0u8; disk as usize];
        padded[..z.len()].copy_from_slice(z);
        let cs = self.info.csum_type.size();
        let mut csums = Vec::with_capacity((disk / ss) as usize * cs);
        crate::extent::csum_tree::append_sector_csums(
            self.info.csum_type,
            ss as usize,
            &padded,
            &mut csums,
        );
        crate::volumes::write_logical(
            &self.info.chunk_map,
            &self.info.devices,
            bytenr,
            &padded,
            crate::volumes::WriteKind::Data,
        )?;
        crate::extent::csum_tree::insert_csums(self, bytenr, &csums)?;
        let mut fe = Vec::with_capacity(FILE_EXTENT_REG_SIZE);
        fe.extend_from_slice(
            FileExtentHeader {
                generation: self.transid.into(),
                ram_bytes: n.into(),
                compression: kind as u8,
                encryption: 0,
                other_encoding: 0.into(),
                type_: FILE_EXTENT_REG,
            }
            .as_bytes(),
        );
        fe.extend_from_slice(
            FileExtentBody {
                disk_bytenr: bytenr.into(),
                disk_num_bytes: disk.into(),
                offset: 0.into(),
                num_bytes: n.into(),
            }
            .as_bytes(),
        );
        self.insert_item(root, &Key::new(ino, EXTENT_DATA_KEY, file_off), &fe)?;
        self.note_compression(kind);
        Ok(Some(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_parsing() {
        assert_eq!(
            CompressPolicy::parse("zstd", false).unwrap(),
            CompressPolicy { alg: Some(CompressionType::Zstd), level: None, force: false }
        );
        assert_eq!(
            CompressPolicy::parse("zstd:-5", true).unwrap(),
            CompressPolicy { alg: Some(CompressionType::Zstd), level: Some(-5), force: true }
        );
        assert_eq!(CompressPolicy::parse("zlib:9", false).unwrap().level, Some(9));
        assert_eq!(CompressPolicy::parse("no", false).unwrap(), CompressPolicy::default());
        for bad in ["zlib:0", "zlib:10", "zstd:0", "zstd:16", "lzo:1", "gzip", "zstd:x", ""] {
            assert!(CompressPolicy::parse(bad, false).is_err(), "{bad}");
        }
    }
}
