//! Chunk removal (the kernel's `btrfs_relocate_chunk` in the one case mkfs needs, and
//! `btrfs_remove_chunk`): move the root leaves a chunk holds into other chunks by
//! COWing them, and, once a commit has freed them, remove the empty chunk whole: its
//! CHUNK_ITEM, DEV_EXTENTs, BLOCK_GROUP_ITEM, free-space-tree INFO and extents, its
//! sys_chunk_array entry, the in-memory block group, and the dev extents' bytes from
//! the device items.
//!
//! Invariants: a chunk is removed only when nothing is allocated in it (block group
//! `used` 0, no extent item inside it, no pending reference, no pinned or held range
//! inside it); removal refuses otherwise, before it changes anything. The chunk stays
//! in the in-memory chunk map until the filesystem is opened again (the map has no
//! removal); nothing maps into it any more. Neighbours: `chunk_alloc` (the inverse),
//! `allocator` (the block groups), the free-space tree.

use crate::error::{Error, PosixKind, Result};
use crate::ids::Logical;
use crate::transaction::Transaction;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::{Corrupt, CorruptWhere, Key};
use zerocopy::IntoBytes;

/// Every tree of the filesystem: root and chunk trees, and each ROOT_ITEM's.
fn all_trees(w: &mut Transaction) -> Result<Vec<u64>> {
    let mut ids = vec![ROOT_TREE_OBJECTID, CHUNK_TREE_OBJECTID];
    for (k, _) in w.items_in_range(ROOT_TREE_OBJECTID, &Key::MIN, &Key::MAX)? {
        if k.type_ == ROOT_ITEM_KEY && !ids.contains(&k.objectid) {
            ids.push(k.objectid);
        }
    }
    Ok(ids)
}

/// Move every tree whose root leaf lies in the chunk at `start` out of it, by COWing
/// the root in the running transaction (the new block comes from the other chunks of
/// its type). Returns how many trees moved. The old blocks are freed when the commit
/// runs their references; then `remove_chunk` can remove the chunk.
///
/// # Errors
/// `Incompatible` for a tree of more than one level rooted in the chunk (relocation
/// of whole trees is not implemented); `Posix(NoSpace)` when a moved root was given a
/// block in the same chunk again (no other chunk of its type had room); allocation
/// and read failures.
pub fn relocate_root_leaves(w: &mut Transaction, start: u64) -> Result<usize> {
    w.assert_in_handle("relocating root leaves");
    let map = w.info.chunk_map.lookup(Logical(start))?;
    assert_eq!(map.logical, start, "relocating chunk {start}, which starts at {}", map.logical);
    let end = start + map.length;
    let mut moved = 0;
    for id in all_trees(w)? {
        let r = w.root(id)?;
        if r.bytenr < start || r.bytenr >= end {
            continue;
        }
        if r.level != 0 {
            return Err(Error::Incompatible(format!("cannot move tree {id} out of chunk {start}: its root {} is at level {}, only root leaves are moved", r.bytenr, r.level)));
        }
        if w.roots.get(&id).and_then(|s| s.item).is_some_and(|i| i.refs.get() == 0) {
            return Err(Error::posix_detail(PosixKind::Busy, format!("tree {id}"), format!("it is a deleted subvolume rooted in chunk {start}, not yet dropped (`ubtrfs subvolume sync` drops it)")));
        }
        w.search_slot(id, &Key::MIN, 0)?;
        let now = w.root(id)?;
        assert_ne!(now.bytenr, r.bytenr, "tree {id}: COW of root {} kept it in place", r.bytenr);
        if now.bytenr >= start && now.bytenr < end {
            return Err(Error::posix_detail(
                PosixKind::NoSpace,
                format!("tree {id}"),
                format!(
                    "its root moved from {} to {}, still inside chunk {start}",
                    r.bytenr, now.bytenr
                ),
            ));
        }
        moved += 1;
    }
    Ok(moved)
}

/// Remove the empty chunk at `start` (see the module docs), in the running
/// transaction.
///
/// # Errors
/// `Posix(NotEmpty)` when anything is still allocated in the chunk; `Posix(Busy)` when
/// references are pending or freed space in it is not yet given back (commit first);
/// `Posix(Invalid)` for an address that is not a chunk start; `Corrupt` when one of the
/// chunk's items is missing. All are returned before anything changes.
pub fn remove_chunk(w: &mut Transaction, start: u64) -> Result<()> {
    w.assert_in_handle("chunk removal");
    let what = format!("chunk {start}");
    let map = w.info.chunk_map.lookup(Logical(start))?;
    if map.logical != start {
        return Err(Error::posix_detail(
            PosixKind::Invalid,
            what,
            format!("not a chunk start (the chunk there starts at {})", map.logical),
        ));
    }
    let (len, flags) = (map.length, map.type_);
    let end = start + len;
    let Some(g) = w.alloc.groups.get(&start) else {
        return Err(Corrupt::new(CorruptWhere::Item, format!("chunk {start} has no block group"))
            .root(EXTENT_TREE_OBJECTID)
            .into());
    };
    if g.used != 0 {
        return Err(Error::posix_detail(
            PosixKind::NotEmpty,
            what,
            format!("its block group still has {} bytes used", g.used),
        ));
    }
    if g.new || w.pending_chunks.iter().any(|p| p.map.logical == start) {
        return Err(Error::posix_detail(
            PosixKind::Busy,
            what,
            "created in this transaction (commit first)",
        ));
    }
    // Space freed in the chunk comes back to its group at the commit, or once no
    // reader's view still reads it (the handle's start gave back what it could).
    let pinned = g.ctl().map_or(0, |c| c.pinned_bytes());
    if pinned != 0 {
        return Err(Error::posix_detail(
            PosixKind::Busy,
            what,
            format!("{pinned} bytes freed in it are pinned until the commit"),
        ));
    }
    if !w.delayed.is_empty() {
        return Err(Error::posix_detail(
            PosixKind::Busy,
            what,
            "extent references are pending (commit first)",
        ));
    }
    for (k, _) in w.items_in_range(
        EXTENT_TREE_OBJECTID,
        &Key::new(start, 0, 0),
        &Key::new(end - 1, u8::MAX, u64::MAX),
    )? {
        if k.type_ == EXTENT_ITEM_KEY || k.type_ == METADATA_ITEM_KEY {
            return Err(Error::posix_detail(
                PosixKind::NotEmpty,
                what,
                format!("extent {} is still allocated in it", k.objectid),
            ));
        }
    }
    let views = w.views.count();
    if views != 0 {
        return Err(Error::posix_detail(
            PosixKind::Busy,
            what,
            format!("{views} readers' views may still read space freed in it"),
        ));
    }
    // Items first looked up, so a missing one refuses before anything changes.
    let chunk_key = Key::new(FIRST_CHUNK_TREE_OBJECTID, CHUNK_ITEM_KEY, start);
    let missing = |root: u64, key: Key| -> Error {
        Corrupt::new(CorruptWhere::Item, format!("{key} of chunk {start} missing"))
            .root(root)
            .key(key)
            .into()
    };
    if w.items_in_range(CHUNK_TREE_OBJECTID, &chunk_key, &chunk_key)?.is_empty() {
        return Err(missing(CHUNK_TREE_OBJECTID, chunk_key));
    }
    let mut dev_extents: Vec<(u64, Key, u64)> = Vec::new();
    for &(devid, off, _) in &map.stripes {
        let k = Key::new(devid, DEV_EXTENT_KEY, off);
        let found = w.items_in_range(DEV_TREE_OBJECTID, &k, &k)?;
        let Some((_, d)) = found.first() else { return Err(missing(DEV_TREE_OBJECTID, k)) };
        let length = u64::from_le_bytes(
            d[24..32].try_into().expect("dev extent size checked by the tree checker"),
        );
        dev_extents.push((devid, k, length));
    }
    let bg_tree = if w.alloc.bg_tree { BLOCK_GROUP_TREE_OBJECTID } else { EXTENT_TREE_OBJECTID };
    let bg_key = Key::new(start, BLOCK_GROUP_ITEM_KEY, len);
    if w.items_in_range(bg_tree, &bg_key, &bg_key)?.is_empty() {
        return Err(missing(bg_tree, bg_key));
    }
    let fst: Vec<Key> = w
        .items_in_range(
            FREE_SPACE_TREE_OBJECTID,
            &Key::new(start, 0, 0),
            &Key::new(end - 1, u8::MAX, u64::MAX),
        )?
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    for &(devid, _, length) in &dev_extents {
        let used = w.alloc.dev_items.get(&devid).map(|d| d.bytes_used.get());
        if used.is_none_or(|u| u < length) {
            return Err(Corrupt::new(CorruptWhere::Item, format!("device {devid} has {used:?} bytes used, less than chunk {start}'s dev extent of {length}")).root(CHUNK_TREE_OBJECTID).into());
        }
    }
    // From here on the removal changes the trees; a failure aborts the transaction.
    w.alloc.groups.remove(&start);
    w.alloc.space_moved = true;
    w.delete_item(CHUNK_TREE_OBJECTID, &chunk_key)?;
    for &(devid, k, length) in &dev_extents {
        w.delete_item(DEV_TREE_OBJECTID, &k)?;
        let d = w.alloc.dev_items.get_mut(&devid).expect("checked above");
        d.bytes_used = (d.bytes_used.get() - length).into();
    }
    w.delete_item(bg_tree, &bg_key)?;
    for k in fst {
        w.delete_item(FREE_SPACE_TREE_OBJECTID, &k)?;
    }
    let devids: Vec<u64> = dev_extents.iter().map(|d| d.0).collect();
    for devid in devids {
        let d = w.alloc.dev_items[&devid];
        let key = Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, devid);
        let Some((leaf, slot)) = w.lookup_for_update(CHUNK_TREE_OBJECTID, &key, 0)? else {
            return Err(missing(CHUNK_TREE_OBJECTID, key));
        };
        w.item_data_mut(leaf, slot).copy_from_slice(d.as_bytes());
    }
    if flags & BLOCK_GROUP_SYSTEM != 0 {
        remove_from_sys_chunk_array(&mut w.sb, start);
    }
    #[cfg(debug_assertions)]
    w.alloc.check_invariants();
    Ok(())
}

/// Drop chunk `start`'s entry from the superblock's sys_chunk_array, keeping the
/// others in order.
fn remove_from_sys_chunk_array(sb: &mut Superblock, start: u64) {
    const KEY: usize = core::mem::size_of::<ubtrfs_format::key::DiskKey>();
    let n = sb.sys_chunk_array_size.get() as usize;
    let old = sb.sys_chunk_array[..n].to_vec();
    let mut kept = Vec::with_capacity(n);
    let mut pos = 0;
    let mut found = false;
    // The array was checked when the superblock was read and by every append since.
    while pos < n {
        let k = Key::from(
            <ubtrfs_format::key::DiskKey as zerocopy::FromBytes>::read_from_bytes(
                &old[pos..pos + KEY],
            )
            .expect("17-byte key"),
        );
        let stripes = u16::from_le_bytes([old[pos + KEY + 44], old[pos + KEY + 45]]) as usize;
        let size = KEY + ubtrfs_format::items::chunk_item_size(stripes);
        if k.offset == start {
            found = true;
        } else {
            kept.extend_from_slice(&old[pos..pos + size]);
        }
        pos += size;
    }
    assert!(found, "SYSTEM chunk {start} not in the sys_chunk_array");
    assert!(!kept.is_empty(), "removing SYSTEM chunk {start} would leave no SYSTEM chunk");
    sb.sys_chunk_array.fill(0);
    sb.sys_chunk_array[..kept.len()].copy_from_slice(&kept);
    sb.sys_chunk_array_size = (kept.len() as u32).into();
}
