//! `mkfs --shrink`: the filesystem no larger than it needs to be. Chunks are kept
//! small from the start (`CHUNK_CAPS`, so the last one's unused tail is small), and
//! once the tree is copied in, each device's size is cut to the end of its last dev
//! extent (`FsWriter::set_device_size`); the caller then truncates an image file to
//! that size. Nothing is relocated: chunks are placed from the start of each device.

use ubtrfs_core::error::Result;
use ubtrfs_core::FsWriter;
use ubtrfs_format::structs::*;

/// The largest chunk per type with --shrink: data 64 MiB, metadata 32 MiB, system
/// 4 MiB (mkfs.btrfs makes 8 MiB system chunks; a shrunk filesystem needs less).
pub const CHUNK_CAPS: [(u64, u64); 3] =
    [(BLOCK_GROUP_DATA, 64 << 20), (BLOCK_GROUP_METADATA, 32 << 20), (BLOCK_GROUP_SYSTEM, 4 << 20)];

/// Cap new chunks (before any real chunk is made).
///
/// # Errors
/// As `FsWriter::set_max_chunk_size`.
pub fn cap_chunks(w: &mut FsWriter) -> Result<()> {
    for (ty, cap) in CHUNK_CAPS {
        w.set_max_chunk_size(ty, cap)?;
    }
    Ok(())
}

/// Cut every device to the end of its last dev extent; returns (devid, new size).
///
/// # Errors
/// As `FsWriter::set_device_size`.
pub fn shrink_devices(w: &mut FsWriter) -> Result<Vec<(u64, u64)>> {
    let devids: Vec<u64> = w.info.devices.by_id.keys().copied().collect();
    let mut out = Vec::with_capacity(devids.len());
    let ss = u64::from(w.info.sectorsize);
    for d in devids {
        let end = w.device_used_end(d)?.div_ceil(ss) * ss;
        w.set_device_size(d, end)?;
        out.push((d, end));
    }
    Ok(out)
}
