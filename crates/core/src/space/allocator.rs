//! Block groups and the allocator: the in-memory block-group cache with one free-space
//! cache (seed 000, `free_space_cache`) per group, extent allocation by type, the exact
//! `used` accounting written back to BLOCK_GROUP_ITEMs at commit, pinning of freed
//! extents until the commit, and chunk allocation when space runs out (`chunk`).
//!
//! Invariants: a byte of a block group is in exactly one of: free (in its cache),
//! reserved (allocated in this transaction, item not yet inserted), used (in the extent
//! tree), pinned (freed in this transaction), or a superblock stripe. `used` equals the
//! sum of extent lengths inside the group as the extent tree will say after the commit.

use crate::error::{Error, PosixKind, Result};
use crate::space::free_space_cache::{Alloc, FreeSpaceCtl};
use crate::transaction::FsWriter;
use crate::tree::search::TreeView;
use std::collections::BTreeMap;
use ubtrfs_format::features::COMPAT_RO_BLOCK_GROUP_TREE;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::{Corrupt, CorruptWhere, Key};

/// Damage in the free-space tree as the allocator loads it.
fn fst_corrupt(key: Key, reason: String) -> Error {
    Corrupt::new(CorruptWhere::Item, reason).root(FREE_SPACE_TREE_OBJECTID).key(key).into()
}

/// Bits per free-space-cache bitmap: one 4 KiB page, as on x86-64.
pub const DEFAULT_BITS_PER_BITMAP: u32 = 32768;

pub struct BlockGroup {
    pub start: u64,
    pub length: u64,
    pub flags: u64,
    pub used: u64,
    /// `used` changed: the item must be rewritten at commit.
    pub dirty: bool,
    /// Created in this transaction: its items are inserted at commit.
    pub new: bool,
    /// The free-space tree has no INFO for it yet (`BLOCK_GROUP_FLAG_NEEDS_FREE_SPACE`).
    pub needs_free_space: bool,
    /// Cached free-space-tree format (seed 003); None until first looked up.
    pub fst_bitmaps: Option<bool>,
    /// Free space, with the extents freed in this transaction pinned inside it.
    pub ctl: FreeSpaceCtl,
}

#[derive(Default)]
pub struct Allocator {
    pub groups: BTreeMap<u64, BlockGroup>,
    /// The device items, for `bytes_used` updates (devid -> item).
    pub dev_items: BTreeMap<u64, DevItem>,
    pub bg_tree: bool,
    pub bits_per_bitmap: u32,
    changed: bool,
}

impl Allocator {
    /// Read every block group and build its free-space cache from the free-space tree.
    ///
    /// # Errors
    /// Read failures, or a free-space tree that disagrees with the group layout.
    pub fn load(w: &FsWriter) -> Result<Allocator> {
        let mut a = Allocator { bg_tree: w.info.super_copy().compat_ro_flags.get() & COMPAT_RO_BLOCK_GROUP_TREE != 0, bits_per_bitmap: DEFAULT_BITS_PER_BITMAP, ..Default::default() };
        for bg in w.info.block_groups()? {
            let ctl = new_ctl(bg.start, bg.length, bg.flags, w.info.sectorsize, w.info.nodesize, a.bits_per_bitmap)?;
            a.groups.insert(bg.start, BlockGroup { start: bg.start, length: bg.length, flags: bg.flags, used: bg.used, dirty: false, new: false, needs_free_space: false, fst_bitmaps: None, ctl });
        }
        // Device items, from the chunk tree.
        let root = w.info.chunk_root();
        let mut it = w.info.iter(&root, Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, 0))?;
        while let Some(item) = it.next_item()? {
            let k = item.key();
            if k.objectid != DEV_ITEMS_OBJECTID || k.type_ != DEV_ITEM_KEY {
                break;
            }
            let d = <DevItem as zerocopy::FromBytes>::read_from_bytes(item.data()).expect("size checked by the tree checker");
            a.dev_items.insert(k.offset, d);
        }
        // Free space, from the free-space tree; superblock stripes are never free.
        let fst = w.info.read_root(FREE_SPACE_TREE_OBJECTID)?.0;
        let mut it = w.info.iter(&fst, Key::MIN)?;
        let ss = u64::from(w.info.sectorsize);
        let mut free: Vec<(u64, u64)> = Vec::new();
        while let Some(item) = it.next_item()? {
            let k = item.key();
            if matches!(k.type_, FREE_SPACE_EXTENT_KEY | FREE_SPACE_BITMAP_KEY) && k.objectid.checked_add(k.offset).is_none() {
                return Err(fst_corrupt(k, format!("free space {} +{} runs past the end of the address space", k.objectid, k.offset)));
            }
            match k.type_ {
                FREE_SPACE_EXTENT_KEY => free.push((k.objectid, k.offset)),
                FREE_SPACE_BITMAP_KEY => {
                    // The tree checker sized the bitmap by the key: one bit per sector.
                    let d = item.data();
                    for b in 0..(k.offset / ss) as usize {
                        if d[b / 8] & (1 << (b % 8)) != 0 {
                            let p = k.objectid + b as u64 * ss;
                            // Extend only a run of this item: the previous item may be
                            // the last free extent of the block group before this one.
                            match free.last_mut() {
                                Some((s, l)) if *s >= k.objectid && *s + *l == p => *l += ss,
                                _ => free.push((p, ss)),
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        for (s, l) in free {
            // mkfs.btrfs 6.2 leaves the items of its removed temporary chunks behind;
            // the kernel ignores free space outside block groups, and so do we.
            let Some(g) = a.group_mut(s) else { continue };
            // Checked above: no free-space item runs past the address space.
            if s + l > g.start + g.length {
                return Err(Corrupt::new(CorruptWhere::Item, format!("free space {s} +{l} crosses the end of block group {}", g.start)).root(FREE_SPACE_TREE_OBJECTID).into());
            }
            g.ctl.add_free_space(s, l).map_err(|e| Error::from(Corrupt::new(CorruptWhere::Item, format!("free space tree: {e}")).root(FREE_SPACE_TREE_OBJECTID)))?;
        }
        let stripes = super_stripes(w);
        for (s, l) in stripes {
            if let Some(g) = a.group_mut(s) {
                remove_if_free(&mut g.ctl, s, l);
            }
        }
        Ok(a)
    }

    pub fn group_mut(&mut self, bytenr: u64) -> Option<&mut BlockGroup> {
        self.groups.range_mut(..=bytenr).next_back().map(|(_, g)| g).filter(|g| bytenr < g.start + g.length)
    }

    pub fn group(&self, bytenr: u64) -> Option<&BlockGroup> {
        self.groups.range(..=bytenr).next_back().map(|(_, g)| g).filter(|g| bytenr < g.start + g.length)
    }

    /// (start, length) of the group containing `bytenr`.
    pub fn group_range(&self, bytenr: u64) -> Option<(u64, u64)> {
        self.group(bytenr).map(|g| (g.start, g.length))
    }

    pub fn fst_bitmaps(&self, start: u64) -> Option<bool> {
        self.groups.get(&start).and_then(|g| g.fst_bitmaps)
    }
    pub fn set_fst_bitmaps(&mut self, start: u64, v: bool) {
        if let Some(g) = self.groups.get_mut(&start) {
            g.fst_bitmaps = Some(v);
        }
    }
    /// Clear and return the group's NEEDS_FREE_SPACE flag.
    pub fn take_needs_free_space(&mut self, start: u64) -> bool {
        self.groups.get_mut(&start).map(|g| std::mem::take(&mut g.needs_free_space)).unwrap_or(false)
    }

    pub fn total_used(&self) -> u64 {
        self.groups.values().map(|g| g.used).sum()
    }

    pub fn has_changes(&self) -> bool {
        self.changed || self.groups.values().any(|g| g.dirty || g.new || g.ctl.pinned_bytes() > 0)
    }

    pub fn dev_item(&self, devid: u64) -> Option<DevItem> {
        self.dev_items.get(&devid).copied()
    }

    /// Take every group's pinned ranges at the start of a commit: they stay out of the
    /// allocator (neither free nor pinned) until `release_pinned` after the commit,
    /// while the next transaction pins what it frees apart from them.
    pub fn take_pinned(&mut self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for g in self.groups.values_mut() {
            out.extend(g.ctl.take_pinned());
        }
        self.changed = false;
        out
    }

    /// Give back ranges taken by `take_pinned`: their commit is on disk, and no reader
    /// holds a view that still uses them.
    pub fn release_pinned(&mut self, ranges: &[(u64, u64)]) {
        for &(s, l) in ranges {
            // Taken from this group's pins, and nothing else returns them: a bug if not.
            let g = self.group_mut(s).unwrap_or_else(|| panic!("released pinned range {s} +{l} outside every block group"));
            g.ctl.add_free_space(s, l).unwrap_or_else(|e| panic!("releasing pinned range {s} +{l}: {e}"));
        }
    }

    /// Bytes free (allocatable now) per type flag.
    pub fn free_bytes(&self, ty: u64) -> u64 {
        self.groups.values().filter(|g| g.flags & BLOCK_GROUP_TYPE_MASK == ty).map(|g| g.ctl.free_space()).sum()
    }
}

/// The free-space cache of a group; tree-block groups allocate nodesize-aligned.
///
/// # Errors
/// `Corrupt` for impossible group geometry.
pub fn new_ctl(start: u64, length: u64, flags: u64, sectorsize: u32, nodesize: u32, bits: u32) -> Result<FreeSpaceCtl> {
    let mut ctl = FreeSpaceCtl::new(start, length, sectorsize, bits).map_err(|e| Error::from(ubtrfs_format::Corrupt::new(ubtrfs_format::CorruptWhere::Item, format!("block group {start}: {e}"))))?;
    if flags & BLOCK_GROUP_DATA == 0 {
        ctl.set_full_stripe_len(u64::from(nodesize));
    }
    Ok(ctl)
}

fn remove_if_free(ctl: &mut FreeSpaceCtl, s: u64, l: u64) {
    // Remove sector by sector what is free: the stripe may be partly allocated already.
    let unit = ctl.unit();
    let mut p = s;
    while p < s + l {
        let _ = ctl.remove_free_space(p, unit);
        p += unit;
    }
}

/// Logical ranges (64 KiB stripes) that hold superblock copies, per chunk stripe.
pub fn super_stripes(w: &FsWriter) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for c in w.info.chunk_map.iter() {
        for m in 1..SUPER_MIRROR_MAX {
            let phys = sb_offset(m);
            for &(_, off, _) in &c.stripes {
                let per_stripe = match c.profile() {
                    BLOCK_GROUP_RAID0 => c.length / c.stripes.len() as u64,
                    BLOCK_GROUP_RAID10 => c.length * u64::from(c.sub_stripes.max(1)) / c.stripes.len() as u64,
                    _ => c.length,
                };
                if phys >= off && phys < off + per_stripe && matches!(c.profile(), 0 | BLOCK_GROUP_DUP | BLOCK_GROUP_RAID1 | BLOCK_GROUP_RAID1C3 | BLOCK_GROUP_RAID1C4) {
                    let nr = (phys - off) / STRIPE_LEN;
                    let logical = c.logical + nr * STRIPE_LEN;
                    let len = STRIPE_LEN.min(c.logical + c.length - logical);
                    out.push((logical, len));
                }
            }
        }
    }
    out
}

/// Allocate `num_bytes` of type `ty` (DATA, METADATA or SYSTEM), making a new chunk if
/// every group of that type is full.
///
/// # Errors
/// `Posix(NoSpace)` naming the type when no space can be found or made.
pub fn alloc_extent(w: &mut FsWriter, ty: u64, num_bytes: u64) -> Result<u64> {
    for attempt in 0..2 {
        let starts: Vec<u64> = w.alloc.groups.values().filter(|g| g.flags & BLOCK_GROUP_TYPE_MASK == ty).map(|g| g.start).collect();
        for s in starts {
            let g = w.alloc.groups.get_mut(&s).expect("listed above");
            if let Alloc::Found { start, .. } = g.ctl.alloc(g.start, num_bytes, 0) {
                w.alloc.changed = true;
                return Ok(start);
            }
        }
        // A data request that only failed for want of one contiguous run is answered by
        // the caller asking for less (`alloc_extent_upto`), not by a new chunk: otherwise
        // every large write would add a chunk while the existing ones have room.
        if attempt == 0 && (ty != BLOCK_GROUP_DATA || w.alloc.free_bytes(ty) < num_bytes) {
            crate::space::chunk_alloc::alloc_chunk(w, ty)?;
        } else {
            break;
        }
    }
    Err(Error::posix(PosixKind::NoSpace, format!("no {} space for {num_bytes} bytes", block_group_flags_str(ty).split(',').next().unwrap_or("?"))))
}

/// Allocate between `min` and `num_bytes` bytes (multiples of `min`) of type `ty`: the
/// whole request if one run (or a new chunk) holds it, else successively halved
/// requests, as the kernel's `btrfs_reserve_extent` does. Returns (start, length).
///
/// # Errors
/// `Posix(NoSpace)` when not even `min` bytes can be found or made.
pub fn alloc_extent_upto(w: &mut FsWriter, ty: u64, num_bytes: u64, min: u64) -> Result<(u64, u64)> {
    assert!(min > 0, "alloc_extent_upto: min 0");
    assert!(num_bytes >= min && num_bytes / min * min == num_bytes, "alloc_extent_upto({num_bytes}, min {min})");
    let mut want = num_bytes;
    loop {
        match alloc_extent(w, ty, want) {
            Ok(start) => return Ok((start, want)),
            Err(e) if e.posix_kind() == Some(PosixKind::NoSpace) && want > min => {
                want = (want / 2 / min * min).max(min);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Tree height the kernel charges every reserved item for (`BTRFS_MAX_LEVEL`).
const MAX_LEVEL: u64 = 8;

/// Metadata kept back from operations that add items, so that deleting (which COWs
/// paths too) and committing always find tree blocks once the device has no room for
/// another metadata chunk (the kernel's global block reserve): 256 tree blocks, at most
/// a quarter of the metadata block groups.
pub fn metadata_reserve(w: &FsWriter) -> u64 {
    let total: u64 = w.alloc.groups.values().filter(|g| g.flags & BLOCK_GROUP_TYPE_MASK == BLOCK_GROUP_METADATA).map(|g| g.length).sum();
    (256 * u64::from(w.nodesize())).min(total / 4)
}

/// Before an operation that adds about `items` items begins: make sure metadata space
/// holds them (charged as the kernel's `btrfs_calc_insert_metadata_size`, a COW of a
/// full-height path per item) on top of `metadata_reserve`, allocating a metadata chunk
/// if that helps. Refusing here, before anything changes, keeps a full filesystem
/// writable for deletions instead of wedging it with every tree block in use.
///
/// # Errors
/// `Posix(NoSpace)` when the space cannot be found or made; chunk allocation failures.
pub fn reserve_metadata(w: &mut FsWriter, items: u64) -> Result<()> {
    let want = metadata_reserve(w) + items * 2 * MAX_LEVEL * u64::from(w.nodesize());
    if w.alloc.free_bytes(BLOCK_GROUP_METADATA) >= want {
        return Ok(());
    }
    match crate::space::chunk_alloc::alloc_chunk(w, BLOCK_GROUP_METADATA) {
        Ok(()) => {}
        Err(e) if e.posix_kind() == Some(PosixKind::NoSpace) => {}
        Err(e) => return Err(e),
    }
    let free = w.alloc.free_bytes(BLOCK_GROUP_METADATA);
    if free >= want {
        return Ok(());
    }
    Err(Error::posix(PosixKind::NoSpace, format!("metadata space is low: {free} bytes free, {want} needed for {items} items and the reserve kept for deletions and commits")))
}

/// Give back space reserved in this transaction that never reached disk.
///
/// Both failures are bugs, not damage: the range came from `alloc_extent` in this
/// transaction (inside a group, and groups are never removed), it left the cache then,
/// and nothing returns it before this call. A pin (a committed extent freed) cannot
/// cover it either: the free-space tree still calls the range free until this head
/// runs, so dropping an extent that overlaps it fails there first (`add_to_free_space_tree`).
pub fn unreserve(w: &mut FsWriter, bytenr: u64, num_bytes: u64) {
    let g = w.alloc.group_mut(bytenr).unwrap_or_else(|| panic!("unreserve {bytenr} +{num_bytes} outside every block group"));
    g.ctl.add_free_space(bytenr, num_bytes).unwrap_or_else(|e| panic!("unreserve {bytenr} +{num_bytes}: {e}"));
}

/// Pin a freed committed extent until the commit.
///
/// # Errors
/// `Corrupt` if the range is outside every group, free, or already pinned (the extent
/// tree said it was allocated).
pub fn pin(w: &mut FsWriter, bytenr: u64, num_bytes: u64) -> Result<()> {
    let g = w.alloc.group_mut(bytenr).ok_or_else(|| Error::from(ubtrfs_format::Corrupt::new(ubtrfs_format::CorruptWhere::Item, format!("freed extent {bytenr} outside every block group"))))?;
    g.ctl
        .pin(bytenr, num_bytes)
        .map_err(|e| Error::from(ubtrfs_format::Corrupt::new(ubtrfs_format::CorruptWhere::Item, format!("freeing extent {bytenr} +{num_bytes}: {e}")).root(EXTENT_TREE_OBJECTID)))?;
    w.alloc.changed = true;
    Ok(())
}

/// Account an extent inserted into (`alloc`) or removed from the extent tree.
///
/// # Errors
/// `Corrupt` if the extent lies outside every group, or `used` would go below zero or
/// past the group's length: the BLOCK_GROUP_ITEM disagrees with the extent and free
/// space trees (the tree checker only bounds `used` by the length).
pub fn update_used(w: &mut FsWriter, bytenr: u64, num_bytes: u64, alloc: bool) -> Result<()> {
    let bg_tree = if w.alloc.bg_tree { BLOCK_GROUP_TREE_OBJECTID } else { EXTENT_TREE_OBJECTID };
    let g = w.alloc.group_mut(bytenr).ok_or_else(|| Error::from(Corrupt::new(CorruptWhere::Item, format!("extent {bytenr} outside every block group")).root(EXTENT_TREE_OBJECTID)))?;
    let item = |reason: String| -> Error { Corrupt::new(CorruptWhere::Item, reason).root(bg_tree).key(Key::new(g.start, BLOCK_GROUP_ITEM_KEY, g.length)).into() };
    let used = if alloc {
        g.used
            .checked_add(num_bytes)
            .filter(|u| *u <= g.length)
            .ok_or_else(|| item(format!("block group {} would have {} + {num_bytes} bytes used adding extent {bytenr}, more than its length {}", g.start, g.used, g.length)))?
    } else {
        g.used.checked_sub(num_bytes).ok_or_else(|| item(format!("block group {} used {} below zero freeing extent {bytenr} +{num_bytes}", g.start, g.used)))?
    };
    g.used = used;
    g.dirty = true;
    Ok(())
}

/// Write changed BLOCK_GROUP_ITEMs (and the items of groups created in this
/// transaction). Returns whether anything was written.
///
/// # Errors
/// Tree modification failures.
pub fn write_dirty_block_groups(w: &mut FsWriter) -> Result<bool> {
    let mut any = crate::space::chunk_alloc::insert_pending_chunks(w)?;
    let tree = if w.alloc.bg_tree { BLOCK_GROUP_TREE_OBJECTID } else { EXTENT_TREE_OBJECTID };
    loop {
        let next = w.alloc.groups.values().find(|g| g.dirty && !g.new).map(|g| (g.start, g.length, g.used, g.flags));
        let Some((start, length, used, flags)) = next else { break };
        w.alloc.groups.get_mut(&start).expect("found above").dirty = false;
        let key = Key::new(start, BLOCK_GROUP_ITEM_KEY, length);
        let mut body = Vec::with_capacity(24);
        body.extend_from_slice(&used.to_le_bytes());
        body.extend_from_slice(&FIRST_CHUNK_TREE_OBJECTID.to_le_bytes());
        body.extend_from_slice(&flags.to_le_bytes());
        match w.lookup_for_update(tree, &key, 0)? {
            Some((leaf, slot)) => w.item_data_mut(leaf, slot).copy_from_slice(&body),
            None => return Err(ubtrfs_format::Corrupt::new(ubtrfs_format::CorruptWhere::Item, format!("block group item {key} missing")).root(tree).into()),
        }
        any = true;
    }
    Ok(any)
}

/// Test hooks (feature `test-hooks`): in-memory block groups that no chunk backs, for
/// exercising the free-space tree on ranges nothing else touches (the kernel
/// self-tests' dummy groups).
#[cfg(feature = "test-hooks")]
impl FsWriter {
    /// Add an in-memory block group [start, start+len) with `NEEDS_FREE_SPACE` set and an
    /// empty free-space cache (so the allocator never hands out its space). It has no
    /// chunk or BLOCK_GROUP_ITEM: remove it (`remove_test_group`) before committing.
    ///
    /// # Errors
    /// `Corrupt` for impossible geometry; `Posix(Exists)` if it overlaps a group.
    pub fn insert_test_group(&mut self, start: u64, len: u64, flags: u64) -> Result<()> {
        if self.alloc.group(start).is_some() || self.alloc.groups.range(start..start.saturating_add(len)).next().is_some() {
            return Err(Error::posix(PosixKind::Exists, format!("test block group {start} +{len} overlaps a block group")));
        }
        let ctl = new_ctl(start, len, flags, self.sectorsize(), self.nodesize(), self.alloc.bits_per_bitmap)?;
        self.alloc.groups.insert(start, BlockGroup { start, length: len, flags, used: 0, dirty: false, new: false, needs_free_space: true, fst_bitmaps: None, ctl });
        Ok(())
    }

    /// Drop a group added by `insert_test_group` (its free-space-tree items are the
    /// caller's to remove). Returns whether it existed.
    pub fn remove_test_group(&mut self, start: u64) -> bool {
        self.alloc.groups.remove(&start).is_some()
    }

    /// The free-space-tree format cached for the group at `start` (None: not cached).
    pub fn fst_cached_bitmaps(&self, start: u64) -> Option<bool> {
        self.alloc.fst_bitmaps(start)
    }
}
