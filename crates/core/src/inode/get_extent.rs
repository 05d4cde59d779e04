//! The inode layer's side of extent maps (`mapping::extent_map`): filling them from the
//! EXTENT_DATA items a read meets (`get_file_extents`, the kernel's `btrfs_get_extent`)
//! and dropping what a change to those items makes stale (`drop_for_item_change`, which
//! the writer runs for every such change through `Transaction::file_extents_changed`).

use crate::error::Result;
use crate::ids::InodeId;
use crate::inode::filesystem::{FileExtentRec, FsRead};
use crate::inode::inode_cache::{Inode, InodeCache};
use crate::mapping::extent_map::{fill, from_maps};
use crate::mapping::extent_map_shrinker::ExtentMapShrinker;
use std::sync::Arc;

/// The file extents of inode `id` overlapping `[from, to)` as `FsRead::file_extents`
/// returns them, served from the inode's extent maps when they cover the range (and
/// none is inline, whose bytes are in the leaf), read from EXTENT_DATA items and cached
/// otherwise (`btrfs_get_extent`). Holes are left out (the reader zero-fills gaps).
/// Returns the extents and whether the maps served them.
///
/// # Errors
/// As `FsRead::file_extents`.
pub fn get_file_extents<V: FsRead>(
    fs: &V,
    shrinker: &Arc<ExtentMapShrinker>,
    inode: &Arc<Inode>,
    from: u64,
    to: u64,
) -> Result<(Vec<FileExtentRec>, bool)> {
    let id = inode.id;
    let tree = &inode.mapping.extent_map;
    if from >= to {
        return Ok((Vec::new(), true));
    }
    if let Some(recs) = from_maps(&tree.lock_read(), from, to) {
        shrinker.count_hit();
        return Ok((recs, true));
    }
    shrinker.count_miss();
    let recs = fs.file_extents(id, from, to)?;
    inode.attach_extent_maps(shrinker);
    fill(tree, fs.info().sectorsize, &recs, from, to);
    Ok((recs, false))
}

/// Drop the maps an EXTENT_DATA item change at file offset `offset` of `id` may have
/// made stale, `[offset, end)`, if the inode is in memory.
pub(crate) fn drop_for_item_change(inodes: &InodeCache, id: InodeId, offset: u64, end: u64) {
    if let Some(inode) = inodes.lookup(id) {
        let tree = &inode.mapping.extent_map;
        // The engine attaches a tree before its first map: a tree never attached has
        // none, and is not locked.
        if tree.is_attached() {
            tree.drop_extent_map_range(offset, end, false);
        }
    }
}
