//! `mkfs --shrink`: the filesystem no larger than it needs to be. Chunks are kept
//! small from the start (`CHUNK_CAPS`, so the last one's unused tail is small), and
//! once the tree is copied in, each device's size is cut to the end of its last dev
//! extent (`Engine::shrink_devices`); the caller then truncates an image file to
//! that size. Nothing is relocated: chunks are placed from the start of each device.

use ubtrfs_core::{Engine, Result};
use ubtrfs_format::structs::*;

/// The largest chunk per type with --shrink: data 64 MiB, metadata 32 MiB, system
/// 4 MiB (mkfs.btrfs makes 8 MiB system chunks; a shrunk filesystem needs less).
pub const CHUNK_CAPS: [(u64, u64); 3] =
    [(BLOCK_GROUP_DATA, 64 << 20), (BLOCK_GROUP_METADATA, 32 << 20), (BLOCK_GROUP_SYSTEM, 4 << 20)];

/// Cap new chunks (before any real chunk is made).
///
/// # Errors
/// As `Engine::set_max_chunk_size`.
pub fn cap_chunks(e: &Engine) -> Result<()> {
    for (ty, cap) in CHUNK_CAPS {
        e.set_max_chunk_size(Some((ty, cap)))?;
    }
    Ok(())
}
