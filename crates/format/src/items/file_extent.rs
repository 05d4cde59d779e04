//! EXTENT_DATA and EXTENT_CSUM: a file's extents and the checksums of data extents.

use super::{aligned, read_prefix, CheckResult, ItemCtx, ParseResult};
use crate::key::*;
use crate::structs::*;
use zerocopy::FromBytes;

/// A file extent item, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileExtent<'a> {
    Inline {
        generation: u64,
        ram_bytes: u64,
        compression: u8,
        data: &'a [u8],
    },
    /// REG or PREALLOC; `disk_bytenr == 0` is an explicit hole.
    Regular {
        generation: u64,
        ram_bytes: u64,
        compression: u8,
        prealloc: bool,
        disk_bytenr: u64,
        disk_num_bytes: u64,
        offset: u64,
        num_bytes: u64,
    },
}

pub fn file_extent(data: &[u8]) -> ParseResult<FileExtent<'_>> {
    let h: &FileExtentHeader = read_prefix(data, "file extent")?;
    // As check_extent_data_item: encryption must be 0; other_encoding is never read.
    if h.encryption != 0 {
        return Err(format!("invalid encryption for file extent, have {} expect 0", h.encryption));
    }
    match h.type_ {
        FILE_EXTENT_INLINE => Ok(FileExtent::Inline {
            generation: h.generation.get(),
            ram_bytes: h.ram_bytes.get(),
            compression: h.compression,
            data: &data[FILE_EXTENT_INLINE_DATA_START..],
        }),
        FILE_EXTENT_REG | FILE_EXTENT_PREALLOC => {
            if data.len() != FILE_EXTENT_REG_SIZE {
                return Err(format!(
                    "invalid file extent item size, have {} expect {}",
                    data.len(),
                    FILE_EXTENT_REG_SIZE
                ));
            }
            let b = FileExtentBody::ref_from_bytes(&data[FILE_EXTENT_INLINE_DATA_START..])
                .expect("size checked");
            Ok(FileExtent::Regular {
                generation: h.generation.get(),
                ram_bytes: h.ram_bytes.get(),
                compression: h.compression,
                prealloc: h.type_ == FILE_EXTENT_PREALLOC,
                disk_bytenr: b.disk_bytenr.get(),
                disk_num_bytes: b.disk_num_bytes.get(),
                offset: b.offset.get(),
                num_bytes: b.num_bytes.get(),
            })
        }
        t => Err(format!("invalid file extent type {t}")),
    }
}

/// The two parts of a REG/PREALLOC file extent item (`FILE_EXTENT_REG_SIZE` bytes), for
/// editing an item in place; `None` for any other size (an inline extent).
pub fn file_extent_reg_mut(
    data: &mut [u8],
) -> Option<(&mut FileExtentHeader, &mut FileExtentBody)> {
    if data.len() != FILE_EXTENT_REG_SIZE {
        return None;
    }
    let (h, b) = data.split_at_mut(FILE_EXTENT_INLINE_DATA_START);
    Some((
        FileExtentHeader::mut_from_bytes(h).expect("header size"),
        FileExtentBody::mut_from_bytes(b).expect("body size"),
    ))
}

/// A REG or PREALLOC file extent item from its parts.
pub fn file_extent_reg_item(h: &FileExtentHeader, b: &FileExtentBody) -> Vec<u8> {
    use zerocopy::IntoBytes;
    let mut d = Vec::with_capacity(FILE_EXTENT_REG_SIZE);
    d.extend_from_slice(h.as_bytes());
    d.extend_from_slice(b.as_bytes());
    d
}

/// As check_extent_data_item. Not checked, as by the kernel: the generation, how large a
/// compressed inline extent claims to be (the reader bounds what it decompresses), sums
/// of fields (the readers add them checked).
pub(crate) fn check_file_extent(key: &Key, data: &[u8], ctx: &ItemCtx) -> CheckResult {
    if !aligned(key.offset, ctx.sectorsize) {
        return Err(format!(
            "unaligned file_offset for file extent, have {} should be aligned to {}",
            key.offset, ctx.sectorsize
        ));
    }
    match file_extent(data)? {
        FileExtent::Inline { ram_bytes, compression, data: inline, .. } => {
            if compression > 3 {
                return Err(format!(
                    "invalid compression for file extent, have {compression} expect range [0, 3]"
                ));
            }
            if key.offset != 0 {
                return Err(format!(
                    "invalid file_offset for inline file extent, have {} expect 0",
                    key.offset
                ));
            }
            if compression == 0 && ram_bytes != inline.len() as u64 {
                return Err(format!(
                    "invalid ram_bytes for uncompressed inline extent, have {} expect {ram_bytes}",
                    inline.len()
                ));
            }
        }
        FileExtent::Regular {
            compression,
            disk_bytenr,
            disk_num_bytes,
            offset,
            num_bytes,
            ram_bytes,
            ..
        } => {
            if compression > 3 {
                return Err(format!(
                    "invalid compression for file extent, have {compression} expect range [0, 3]"
                ));
            }
            for (n, v) in [
                ("ram_bytes", ram_bytes),
                ("disk_bytenr", disk_bytenr),
                ("disk_num_bytes", disk_num_bytes),
                ("offset", offset),
                ("num_bytes", num_bytes),
            ] {
                if !aligned(v, ctx.sectorsize) {
                    return Err(format!(
                        "invalid {n} for file extent, have {v}, should be aligned to {}",
                        ctx.sectorsize
                    ));
                }
            }
            if key.offset.checked_add(num_bytes).is_none() {
                return Err(format!(
                    "extent end overflow, have file offset {} extent num bytes {num_bytes}",
                    key.offset
                ));
            }
        }
    }
    Ok(())
}

/// As check_csum_item (an empty item covers nothing).
pub(crate) fn check_csum_item(key: &Key, data: &[u8], ctx: &ItemCtx) -> CheckResult {
    if key.objectid != EXTENT_CSUM_OBJECTID {
        return Err(format!(
            "invalid key objectid for csum item, have {} expect {EXTENT_CSUM_OBJECTID}",
            key.objectid
        ));
    }
    if !aligned(key.offset, ctx.sectorsize) {
        return Err(format!(
            "unaligned key offset for csum item, have {} should be aligned to {}",
            key.offset, ctx.sectorsize
        ));
    }
    if !data.len().is_multiple_of(ctx.csum_type.size()) {
        return Err(format!(
            "unaligned item size for csum item, have {} should be aligned to {}",
            data.len(),
            ctx.csum_type.size()
        ));
    }
    Ok(())
}
