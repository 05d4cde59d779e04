//! Block groups and the allocator: the in-memory block-group cache with one free-space
//! cache (`free_space_cache`) per group, loaded from the free-space tree the
//! first time the group is used (the kernel's caching, `cache_block_group`), extent
//! allocation by type, the exact `used` accounting written back to BLOCK_GROUP_ITEMs at
//! commit, pinning of freed extents until the commit, and chunk allocation when space
//! runs out (`chunk`).
//!
//! Invariants: a byte of a block group is in exactly one of: free (in its cache),
//! reserved (allocated in this transaction, item not yet inserted), used (in the extent
//! tree), pinned (freed in this transaction), or a superblock stripe. `used` equals the
//! sum of extent lengths inside the group as the extent tree will say after the commit.
//! Only a cached group has a free-space cache (`Caching::Finished` owns it), and
//! everything that changes a group's free space or its free-space-tree items caches it
//! first, so a group that is not cached has nothing reserved or pinned and its items are
//! as committed: its free space is `length - used - superblock stripes`, and loading it
//! later from the live tree gives what loading it at open would have.
//!
//! Neighbours: `block_group` (the items read at open), `free_space_tree` (the on-disk
//! side, which caches a group before changing its items), `chunk_alloc` (new groups,
//! cached from birth).

use crate::error::{Error, PosixKind, Result};
use crate::ids::Generation;
use crate::space::free_space_cache::{Alloc, FreeSpaceCtl};
use crate::transaction::Transaction;
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

/// Where a group's free-space cache stands, without the cache (the kernel's
/// `btrfs_caching_type`; loading is synchronous here, so there is no STARTED).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CachingState {
    /// BTRFS_CACHE_NO: not loaded; nothing in the group changed in memory.
    No,
    /// BTRFS_CACHE_FINISHED: loaded, or created in this session.
    Finished,
    /// BTRFS_CACHE_ERROR: loading found damage; the group is never allocated from.
    Error,
}

/// The caching state with what it holds: only a cached group has a cache.
enum Caching {
    No,
    /// Boxed: most groups of a large filesystem are never cached.
    Finished(Box<FreeSpaceCtl>),
    /// The damage loading found, returned again to every later use of the group.
    Error(Box<Corrupt>),
}

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
    /// Cached free-space-tree format (the INFO item's USING_BITMAPS flag, so an
    /// update need not search for it): filled from INFO when the group is
    /// cached, kept current by the conversions; None before.
    pub fst_bitmaps: Option<bool>,
    /// Bytes of superblock stripes inside the group (the kernel's `bytes_super`): never
    /// free, never used.
    super_bytes: u64,
    /// Free space, with the extents freed in this transaction pinned inside it, once
    /// loaded.
    caching: Caching,
}

impl BlockGroup {
    /// The group's caching state.
    pub fn caching_state(&self) -> CachingState {
        match self.caching {
            Caching::No => CachingState::No,
            Caching::Finished(_) => CachingState::Finished,
            Caching::Error(_) => CachingState::Error,
        }
    }

    /// Whether the group is cached (`CachingState::Finished`).
    pub fn is_cached(&self) -> bool {
        matches!(self.caching, Caching::Finished(_))
    }

    /// The free-space cache, if the group is cached.
    pub fn ctl(&self) -> Option<&FreeSpaceCtl> {
        match &self.caching {
            Caching::Finished(c) => Some(c),
            _ => None,
        }
    }

    fn ctl_mut(&mut self) -> Option<&mut FreeSpaceCtl> {
        match &mut self.caching {
            Caching::Finished(c) => Some(c),
            _ => None,
        }
    }

    /// Bytes allocatable now: the cache's count when cached; otherwise the counters the
    /// kernel's space_info keeps (length - used - reserved - pinned - super), where an
    /// uncached group has nothing reserved or pinned; nothing for a group whose cache
    /// failed to load.
    pub fn free_space(&self) -> u64 {
        match &self.caching {
            Caching::Finished(c) => c.free_space(),
            Caching::No => self.length.saturating_sub(self.used).saturating_sub(self.super_bytes),
            Caching::Error(_) => 0,
        }
    }

    /// Bytes taken now: used, plus (when cached) what this transaction reserved or
    /// pinned and its delayed refs have not yet counted in `used`; superblock stripes
    /// not included.
    pub fn taken(&self) -> u64 {
        match &self.caching {
            Caching::Finished(c) => self
                .length
                .saturating_sub(self.super_bytes)
                .saturating_sub(c.free_space())
                .max(self.used),
            _ => self.used,
        }
    }

    /// Check the group's bookkeeping (debug builds and tests, after caching).
    pub fn check_invariants(&self) {
        assert!(self.length > 0, "block group {}: length 0", self.start);
        assert!(
            self.super_bytes <= self.length,
            "block group {}: super stripes {} > length {}",
            self.start,
            self.super_bytes,
            self.length
        );
        if let Some(c) = self.ctl() {
            assert_eq!(c.start(), self.start, "block group {}: cache start", self.start);
            assert_eq!(c.length(), self.length, "block group {}: cache length", self.start);
            assert!(
                c.free_space() <= self.length,
                "block group {}: free {} > length {}",
                self.start,
                c.free_space(),
                self.length
            );
        } else {
            assert!(
                self.fst_bitmaps.is_none() || self.caching_state() == CachingState::Error,
                "block group {}: format flag cached before the group",
                self.start
            );
        }
    }
}

#[derive(Default)]
pub struct Allocator {
    pub groups: BTreeMap<u64, BlockGroup>,
    /// The device items, for `bytes_used` updates (devid -> item).
    pub dev_items: BTreeMap<u64, DevItem>,
    pub bg_tree: bool,
    pub bits_per_bitmap: u32,
    changed: bool,
    /// Metadata bytes reserved by live handles and pending direct writes and not yet
    /// used (the metadata space_info's `bytes_may_use`): every reservation counts them
    /// as taken.
    pub(crate) meta_may_use: u64,
    /// Profile bits new chunks of a type get (type -> profile), when set
    /// (`Transaction::set_alloc_profile`); otherwise `chunk_alloc::alloc_profile` picks.
    pub(crate) target_profiles: BTreeMap<u64, u64>,
    /// Mixed block groups (INCOMPAT_MIXED_GROUPS): data and metadata share groups
    /// flagged DATA|METADATA, and share their space.
    pub(crate) mixed: bool,
    /// Largest new chunk per block-group type, when set (`Transaction::set_max_chunk_size`),
    /// below the kernel's own limits.
    pub(crate) chunk_caps: BTreeMap<u64, u64>,
    /// Free space may have moved since the last `publish_data_free` (an allocation,
    /// a release, pins returned, a group added, removed or cached).
    pub(crate) space_moved: bool,
}

impl Allocator {
    /// The block-group type that serves allocations of type `ty`: DATA|METADATA for
    /// both on a mixed filesystem, else `ty`.
    pub fn space_type(&self, ty: u64) -> u64 {
        if self.mixed && ty & (BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA) != 0 {
            BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA
        } else {
            ty
        }
    }

    /// Read every block group and the device items; no free space is loaded (each
    /// group is cached on first use, `cache_block_group`).
    ///
    /// # Errors
    /// Read failures; `Corrupt` for impossible group geometry.
    pub fn load(w: &Transaction) -> Result<Allocator> {
        let sb = w.info.super_copy();
        let mut a = Allocator {
            bg_tree: sb.compat_ro_flags.get() & COMPAT_RO_BLOCK_GROUP_TREE != 0,
            mixed: sb.incompat_flags.get() & ubtrfs_format::features::INCOMPAT_MIXED_GROUPS != 0,
            bits_per_bitmap: DEFAULT_BITS_PER_BITMAP,
            ..Default::default()
        };
        let stripes = super_stripes(w);
        for bg in w.info.block_groups()? {
            // The geometry a cache of the group will need, checked now as before.
            new_ctl(
                bg.start,
                bg.length,
                bg.flags,
                w.info.sectorsize,
                w.info.nodesize,
                a.bits_per_bitmap,
            )?;
            let super_bytes = super_bytes_in(&stripes, bg.start, bg.length);
            a.groups.insert(
                bg.start,
                BlockGroup {
                    start: bg.start,
                    length: bg.length,
                    flags: bg.flags,
                    used: bg.used,
                    dirty: false,
                    new: false,
                    needs_free_space: false,
                    fst_bitmaps: None,
                    super_bytes,
                    caching: Caching::No,
                },
            );
        }
        // Device items, from the chunk tree.
        let root = w.info.chunk_root();
        let mut it = w.info.iter(&root, Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, 0))?;
        while let Some(item) = it.next_item()? {
            let k = item.key();
            if k.objectid != DEV_ITEMS_OBJECTID || k.type_ != DEV_ITEM_KEY {
                break;
            }
            let d = <DevItem as zerocopy::FromBytes>::read_from_bytes(item.data())
                .expect("size checked by the tree checker");
            a.dev_items.insert(k.offset, d);
        }
        a.space_moved = true;
        Ok(a)
    }

    pub fn group_mut(&mut self, bytenr: u64) -> Option<&mut BlockGroup> {
        self.groups
            .range_mut(..=bytenr)
            .next_back()
            .map(|(_, g)| g)
            .filter(|g| bytenr < g.start + g.length)
    }

    pub fn group(&self, bytenr: u64) -> Option<&BlockGroup> {
        self.groups
            .range(..=bytenr)
            .next_back()
            .map(|(_, g)| g)
            .filter(|g| bytenr < g.start + g.length)
    }

    /// (start, length) of the group containing `bytenr`.
    pub fn group_range(&self, bytenr: u64) -> Option<(u64, u64)> {
        self.group(bytenr).map(|g| (g.start, g.length))
    }

    pub fn fst_bitmaps(&self, start: u64) -> Option<bool> {
        self.groups.get(&start).and_then(|g| g.fst_bitmaps)
    }
    /// Record the group's free-space-tree format; the group is cached (its items are
    /// read or changed only after caching).
    pub fn set_fst_bitmaps(&mut self, start: u64, v: bool) {
        if let Some(g) = self.groups.get_mut(&start) {
            assert_eq!(
                g.caching_state(),
                CachingState::Finished,
                "block group {start}: format recorded before caching"
            );
            g.fst_bitmaps = Some(v);
        }
    }
    /// Clear and return the group's NEEDS_FREE_SPACE flag.
    pub fn take_needs_free_space(&mut self, start: u64) -> bool {
        self.groups
            .get_mut(&start)
            .map(|g| std::mem::take(&mut g.needs_free_space))
            .unwrap_or(false)
    }

    pub fn total_used(&self) -> u64 {
        self.groups.values().map(|g| g.used).sum()
    }

    pub fn has_changes(&self) -> bool {
        self.changed
            || self
                .groups
                .values()
                .any(|g| g.dirty || g.new || g.ctl().is_some_and(|c| c.pinned_bytes() > 0))
    }

    pub fn dev_item(&self, devid: u64) -> Option<DevItem> {
        self.dev_items.get(&devid).copied()
    }

    /// Take every group's pinned ranges at the start of a commit: they stay out of the
    /// allocator (neither free nor pinned) until `release_pinned` after the commit,
    /// while the next transaction pins what it frees apart from them. Only cached
    /// groups pin.
    pub fn take_pinned(&mut self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for c in self.groups.values_mut().filter_map(BlockGroup::ctl_mut) {
            out.extend(c.take_pinned());
        }
        self.changed = false;
        out
    }

    /// Give back ranges taken by `take_pinned`: their commit is on disk, and no reader
    /// holds a view that still uses them.
    pub fn release_pinned(&mut self, ranges: &[(u64, u64)]) {
        self.space_moved = true;
        for &(s, l) in ranges {
            // Taken from this group's pins, and nothing else returns them: a bug if not.
            let g = self.group_mut(s).unwrap_or_else(|| {
                panic!("released pinned range {s} +{l} outside every block group")
            });
            let start = g.start;
            // A group that pinned was cached, and a cached group stays cached.
            let c = g.ctl_mut().unwrap_or_else(|| {
                panic!("released pinned range {s} +{l}: block group {start} is not cached")
            });
            c.add_free_space(s, l)
                .unwrap_or_else(|e| panic!("releasing pinned range {s} +{l}: {e}"));
        }
    }

    /// Bytes free (allocatable now) per type flag, cached or not (`BlockGroup::free_space`).
    pub fn free_bytes(&self, ty: u64) -> u64 {
        let ty = self.space_type(ty);
        self.groups
            .values()
            .filter(|g| g.flags & BLOCK_GROUP_TYPE_MASK == ty)
            .map(BlockGroup::free_space)
            .sum()
    }

    /// Check every group's bookkeeping (debug builds and tests).
    pub fn check_invariants(&self) {
        for (&s, g) in &self.groups {
            assert_eq!(s, g.start, "block group keyed {s} starts at {}", g.start);
            g.check_invariants();
        }
        for (a, b) in self.groups.values().zip(self.groups.values().skip(1)) {
            assert!(
                a.start + a.length <= b.start,
                "block groups {} +{} and {} overlap",
                a.start,
                a.length,
                b.start
            );
        }
    }
}

/// The free-space cache of a group; tree-block groups allocate nodesize-aligned.
///
/// # Errors
/// `Corrupt` for impossible group geometry.
pub fn new_ctl(
    start: u64,
    length: u64,
    flags: u64,
    sectorsize: u32,
    nodesize: u32,
    bits: u32,
) -> Result<FreeSpaceCtl> {
    let mut ctl = FreeSpaceCtl::new(start, length, sectorsize, bits).map_err(|e| {
        Error::from(ubtrfs_format::Corrupt::new(
            ubtrfs_format::CorruptWhere::Item,
            format!("block group {start}: {e}"),
        ))
    })?;
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

/// Take the superblock stripes that start inside the cache's group out of its free space.
fn exclude_super_stripes(ctl: &mut FreeSpaceCtl, stripes: &[(u64, u64)]) {
    let (start, end) = (ctl.start(), ctl.start() + ctl.length());
    for &(s, l) in stripes {
        if s >= start && s < end {
            remove_if_free(ctl, s, l);
        }
    }
}

/// Bytes of [start, start+length) the stripes cover, each byte counted once (a DUP
/// chunk's two copies may map the same logical stripe).
fn super_bytes_in(stripes: &[(u64, u64)], start: u64, length: u64) -> u64 {
    let end = start + length;
    let mut r: Vec<(u64, u64)> = stripes
        .iter()
        .filter(|&&(s, _)| s >= start && s < end)
        .map(|&(s, l)| (s, (s + l).min(end)))
        .collect();
    r.sort_unstable();
    let (mut total, mut reach) = (0u64, start);
    for (s, e) in r {
        let s = s.max(reach);
        if e > s {
            total += e - s;
            reach = e;
        }
    }
    total
}

/// Logical ranges (64 KiB stripes) that hold superblock copies, per chunk stripe (the
/// kernel's `btrfs_rmap_block`): on a striped profile the device row is spread over
/// the chunk's stripes.
pub fn super_stripes(w: &Transaction) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for c in w.info.chunk_map.iter() {
        let n = c.stripes.len() as u64;
        let sub = u64::from(c.sub_stripes.max(1));
        for m in 1..SUPER_MIRROR_MAX {
            let phys = sb_offset(m);
            for (i, &(_, off, _)) in c.stripes.iter().enumerate() {
                let per_stripe = match c.profile() {
                    BLOCK_GROUP_RAID0 => c.length / n,
                    BLOCK_GROUP_RAID10 => c.length * sub / n,
                    _ => c.length,
                };
                if phys >= off
                    && phys < off + per_stripe
                    && matches!(
                        c.profile(),
                        0 | BLOCK_GROUP_DUP
                            | BLOCK_GROUP_RAID1
                            | BLOCK_GROUP_RAID1C3
                            | BLOCK_GROUP_RAID1C4
                            | BLOCK_GROUP_RAID0
                            | BLOCK_GROUP_RAID10
                    )
                {
                    let row = (phys - off) / STRIPE_LEN;
                    let nr = match c.profile() {
                        BLOCK_GROUP_RAID0 | BLOCK_GROUP_RAID10 => (row * n + i as u64) / sub,
                        _ => row,
                    };
                    let logical = c.logical + nr * STRIPE_LEN;
                    let len = STRIPE_LEN.min(c.logical + c.length - logical);
                    out.push((logical, len));
                }
            }
        }
    }
    out
}

/// Add the free runs of one free-space-tree item to `free`, validated as before: an
/// extent or bitmap that runs past the end of the address space is damage.
fn push_item_runs(k: Key, data: &[u8], ss: u64, free: &mut Vec<(u64, u64)>) -> Result<()> {
    if matches!(k.type_, FREE_SPACE_EXTENT_KEY | FREE_SPACE_BITMAP_KEY)
        && k.objectid.checked_add(k.offset).is_none()
    {
        return Err(fst_corrupt(
            k,
            format!(
                "free space {} +{} runs past the end of the address space",
                k.objectid, k.offset
            ),
        ));
    }
    match k.type_ {
        FREE_SPACE_EXTENT_KEY => free.push((k.objectid, k.offset)),
        FREE_SPACE_BITMAP_KEY => {
            // The tree checker sized the bitmap by the key: one bit per sector.
            for b in 0..(k.offset / ss) as usize {
                if data[b / 8] & (1 << (b % 8)) != 0 {
                    let p = k.objectid + b as u64 * ss;
                    // Extend only a run of this item: the previous item may be the last
                    // free extent of the block group before this one.
                    match free.last_mut() {
                        Some((s, l)) if *s >= k.objectid && *s + *l == p => *l += ss,
                        _ => free.push((p, ss)),
                    }
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// Put the group's free runs into its cache: each must end inside the group, and the
/// cache refuses overlaps.
fn add_runs(ctl: &mut FreeSpaceCtl, free: &[(u64, u64)]) -> Result<()> {
    let (start, end) = (ctl.start(), ctl.start() + ctl.length());
    for &(s, l) in free {
        // Checked by `push_item_runs`: no free-space item runs past the address space.
        if s + l > end {
            return Err(Corrupt::new(
                CorruptWhere::Item,
                format!("free space {s} +{l} crosses the end of block group {start}"),
            )
            .root(FREE_SPACE_TREE_OBJECTID)
            .into());
        }
        ctl.add_free_space(s, l).map_err(|e| {
            Error::from(
                Corrupt::new(CorruptWhere::Item, format!("free space tree: {e}"))
                    .root(FREE_SPACE_TREE_OBJECTID),
            )
        })?;
    }
    Ok(())
}

/// Read the group's free space from the free-space tree as the running transaction
/// sees it (the kernel's `load_free_space_tree`): its INFO item (the format flag) and
/// the extent and bitmap items in [start, start+length), superblock stripes removed.
/// Returns the cache and whether the group uses bitmaps.
fn load_free_space(
    w: &mut Transaction,
    start: u64,
    length: u64,
    flags: u64,
) -> Result<(FreeSpaceCtl, bool)> {
    let mut ctl =
        new_ctl(start, length, flags, w.sectorsize(), w.nodesize(), w.alloc.bits_per_bitmap)?;
    let ss = u64::from(w.sectorsize());
    // Block groups follow chunks, which were checked not to overflow when read.
    let end = start + length;
    let info_key = Key::new(start, FREE_SPACE_INFO_KEY, length);
    let root = w.root(FREE_SPACE_TREE_OBJECTID)?;
    let mut bitmaps = None;
    let mut extent_count = 0u32;
    let mut free: Vec<(u64, u64)> = Vec::new();
    {
        let live = w.live();
        let mut it = live.iter(&root, Key::new(start, 0, 0))?;
        while let Some(item) = it.next_item()? {
            let k = item.key();
            if k.objectid >= end {
                break;
            }
            if k == info_key {
                let d = item.data();
                extent_count = u32::from_le_bytes(
                    d[0..4].try_into().expect("size checked by the tree checker"),
                );
                let f = u32::from_le_bytes(
                    d[4..8].try_into().expect("size checked by the tree checker"),
                );
                bitmaps = Some(f & FREE_SPACE_USING_BITMAPS != 0);
                continue;
            }
            push_item_runs(k, item.data(), ss, &mut free)?;
        }
    }
    let bitmaps = bitmaps.ok_or_else(|| {
        Error::from(
            Corrupt::new(
                CorruptWhere::Item,
                format!("free space info for block group {start} missing"),
            )
            .root(FREE_SPACE_TREE_OBJECTID),
        )
    })?;
    // The kernel's load refuses a group whose free extents disagree with the INFO
    // count (every later update would keep it wrong): EXTENT items one each, set bits
    // as maximal runs across the bitmap items.
    let runs = if bitmaps {
        free.iter()
            .enumerate()
            .filter(|&(i, &(s, _))| i == 0 || free[i - 1].0 + free[i - 1].1 != s)
            .count()
    } else {
        free.len()
    };
    if runs != extent_count as usize {
        return Err(Corrupt::new(CorruptWhere::Item, format!("incorrect extent count for block group {start}; counted {runs}, expected {extent_count}"))
            .root(FREE_SPACE_TREE_OBJECTID)
            .key(info_key)
            .into());
    }
    add_runs(&mut ctl, &free)?;
    exclude_super_stripes(&mut ctl, &super_stripes(w));
    Ok((ctl, bitmaps))
}

/// Load the free-space cache of the uncached group starting at `start` (the kernel's
/// `btrfs_cache_block_group`, synchronous). Damage makes the group's state `Error`,
/// and every later call returns the same error.
///
/// # Errors
/// `Corrupt` naming the group and the item for a free-space tree that disagrees with
/// the group (an item past the address space or across the group's end, overlapping
/// free space, no INFO item); read failures (the group stays uncached: they may pass).
fn load_group(w: &mut Transaction, start: u64) -> Result<()> {
    let g = w
        .alloc
        .groups
        .get(&start)
        .unwrap_or_else(|| panic!("caching block group {start}, which does not exist"));
    let (length, flags) = match &g.caching {
        Caching::Finished(_) => return Ok(()),
        Caching::Error(c) => return Err(Error::from((**c).clone())),
        Caching::No => (g.length, g.flags),
    };
    let loaded = load_free_space(w, start, length, flags);
    w.alloc.space_moved = true;
    let g = w.alloc.groups.get_mut(&start).expect("looked up above");
    match loaded {
        Ok((ctl, bitmaps)) => {
            g.caching = Caching::Finished(Box::new(ctl));
            g.fst_bitmaps = Some(bitmaps);
            #[cfg(debug_assertions)]
            g.check_invariants();
            Ok(())
        }
        Err(Error::Corrupt(mut c)) => {
            c.reason = format!("caching block group {start}: {}", c.reason);
            g.caching = Caching::Error(c.clone());
            Err(Error::Corrupt(c))
        }
        Err(e) => Err(e),
    }
}

/// The free-space cache of the group starting at `start`, caching it first (see
/// `load_group`).
///
/// # Errors
/// As `load_group`.
fn cached_ctl(w: &mut Transaction, start: u64) -> Result<&mut FreeSpaceCtl> {
    if !w.alloc.groups.get(&start).is_some_and(BlockGroup::is_cached) {
        load_group(w, start)?;
    }
    Ok(w.alloc.groups.get_mut(&start).and_then(BlockGroup::ctl_mut).expect("cached above"))
}

/// Make sure the group containing `bytenr` is cached (see `load_group`).
///
/// # Errors
/// `Posix(NotFound)` when no group contains `bytenr`; the caching errors.
pub fn cache_block_group(w: &mut Transaction, bytenr: u64) -> Result<()> {
    match w.alloc.group(bytenr) {
        Some(g) if g.is_cached() => Ok(()),
        Some(g) => {
            let start = g.start;
            load_group(w, start)
        }
        None => Err(Error::posix(PosixKind::NotFound, format!("block group containing {bytenr}"))),
    }
}

/// Create the in-memory group of a chunk made in this transaction: cached from birth,
/// all free but its superblock stripes.
///
/// # Errors
/// `Corrupt` for impossible geometry; `Posix(Invalid)` if the cache refuses the range.
pub(super) fn add_new_block_group(
    w: &mut Transaction,
    logical: u64,
    length: u64,
    flags: u64,
) -> Result<()> {
    let mut ctl =
        new_ctl(logical, length, flags, w.sectorsize(), w.nodesize(), w.alloc.bits_per_bitmap)?;
    ctl.add_free_space(logical, length)
        .map_err(|e| Error::posix(PosixKind::Invalid, format!("new block group {logical}: {e}")))?;
    let stripes = super_stripes(w);
    for &(s, l) in &stripes {
        if s >= logical && s < logical + length {
            // All free: each stripe comes out whole.
            let _ = ctl.remove_free_space(s, l);
        }
    }
    let super_bytes = super_bytes_in(&stripes, logical, length);
    w.alloc.space_moved = true;
    w.alloc.groups.insert(
        logical,
        BlockGroup {
            start: logical,
            length,
            flags,
            used: 0,
            dirty: false,
            new: true,
            needs_free_space: true,
            fst_bitmaps: None,
            super_bytes,
            caching: Caching::Finished(Box::new(ctl)),
        },
    );
    Ok(())
}

/// Try the groups of type `ty` for `num_bytes` the way the kernel's `find_free_extent`
/// walks them: cached groups first, then each uncached one, caching it, until one has
/// the room. A group whose caching fails is skipped, and the first such error kept for
/// the caller (the kernel's `cache_block_group_error`).
fn find_free_extent(
    w: &mut Transaction,
    ty: u64,
    num_bytes: u64,
    cache_error: &mut Option<Error>,
) -> Result<Option<u64>> {
    let ty = w.alloc.space_type(ty);
    for g in w.alloc.groups.values_mut().filter(|g| g.flags & BLOCK_GROUP_TYPE_MASK == ty) {
        let start = g.start;
        if let Some(c) = g.ctl_mut() {
            if let Alloc::Found { start, .. } = c.alloc(start, num_bytes, 0) {
                w.alloc.changed = true;
                return Ok(Some(start));
            }
        }
    }
    let uncached: Vec<u64> = w
        .alloc
        .groups
        .values()
        .filter(|g| g.flags & BLOCK_GROUP_TYPE_MASK == ty && !g.is_cached())
        .map(|g| g.start)
        .collect();
    for s in uncached {
        match cached_ctl(w, s) {
            Ok(c) => {
                if let Alloc::Found { start, .. } = c.alloc(s, num_bytes, 0) {
                    w.alloc.changed = true;
                    return Ok(Some(start));
                }
            }
            Err(e) => {
                cache_error.get_or_insert(e);
            }
        }
    }
    Ok(None)
}

/// Allocate `num_bytes` of type `ty` (DATA, METADATA or SYSTEM), making a new chunk if
/// every group of that type is full.
///
/// # Errors
/// `Posix(NoSpace)` naming the type when no space can be found or made; when a group
/// that could not be cached was skipped, its caching error instead (the kernel returns
/// that rather than ENOSPC, since the space may be in the damaged group).
pub(crate) fn alloc_extent(w: &mut Transaction, ty: u64, num_bytes: u64) -> Result<u64> {
    w.begin_change()?;
    let mut cache_error = None;
    for attempt in 0..2 {
        if let Some(start) = find_free_extent(w, ty, num_bytes, &mut cache_error)? {
            w.alloc.space_moved = true;
            return Ok(start);
        }
        // A data request that only failed for want of one contiguous run is answered by
        // the caller asking for less (`alloc_extent_upto`), not by a new chunk: otherwise
        // every large write would add a chunk while the existing ones have room.
        if attempt == 0 && (ty != BLOCK_GROUP_DATA || w.alloc.free_bytes(ty) < num_bytes) {
            match crate::space::chunk_alloc::alloc_chunk_in(w, ty) {
                Ok(()) => {}
                Err(e) if e.posix_kind() == Some(PosixKind::NoSpace) => {
                    return Err(cache_error.unwrap_or(e))
                }
                Err(e) => return Err(e),
            }
        } else {
            break;
        }
    }
    Err(cache_error.unwrap_or_else(|| {
        Error::posix(
            PosixKind::NoSpace,
            format!(
                "no {} space for {num_bytes} bytes",
                block_group_flags_str(ty).split(',').next().unwrap_or("?")
            ),
        )
    }))
}

/// Allocate between `min` and `num_bytes` bytes (multiples of `min`) of type `ty`: the
/// whole request if one run (or a new chunk) holds it, else successively halved
/// requests, as the kernel's `btrfs_reserve_extent` does. Returns (start, length).
///
/// # Errors
/// `Posix(NoSpace)` when not even `min` bytes can be found or made.
pub(crate) fn alloc_extent_upto(
    w: &mut Transaction,
    ty: u64,
    num_bytes: u64,
    min: u64,
) -> Result<(u64, u64)> {
    w.begin_change()?;
    assert!(min > 0, "alloc_extent_upto: min 0");
    assert!(
        num_bytes >= min && num_bytes / min * min == num_bytes,
        "alloc_extent_upto({num_bytes}, min {min})"
    );
    let mut want = num_bytes;
    loop {
        match alloc_extent(w, ty, want) {
            Ok(start) => return Ok((start, want)),
            Err(e) if e.posix_kind() == Some(PosixKind::NoSpace) && want > min => {
                want = (want / 2 / min * min).max(min);
            }
            // Not even `min` in one run, though the data groups hold that much in
            // pieces (`alloc_extent` leaves that case to us): a new chunk, as the
            // kernel's find_free_extent forces one at LOOP_ALLOC_CHUNK. This is where a
            // compressed extent, which cannot be split, lands on fragmented free space.
            Err(e)
                if e.posix_kind() == Some(PosixKind::NoSpace)
                    && ty == BLOCK_GROUP_DATA
                    && w.alloc.free_bytes(ty) >= min =>
            {
                match crate::space::chunk_alloc::alloc_chunk_in(w, ty) {
                    Ok(()) => {}
                    Err(c) if c.posix_kind() == Some(PosixKind::NoSpace) => return Err(e),
                    Err(c) => return Err(c),
                }
                let start = alloc_extent(w, ty, min)?;
                return Ok((start, min));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Make sure `bytes` of data space can be allocated before a change that writes them
/// begins (the kernel's `btrfs_check_data_free_space`): free space in the data block
/// groups, or new data chunks made now, each in its own small transaction handle. So
/// a write the filesystem cannot hold fails with ENOSPC before anything changed, and
/// the space it found stays there for the change (writes are serialised). Space freed
/// in the running transaction is pinned until its commit, and does not count.
///
/// # Errors
/// `Posix(NoSpace)` naming `what` and the shortfall; chunk allocation failures.
pub(crate) fn reserve_data(w: &mut Transaction, bytes: u64, what: &str) -> Result<()> {
    loop {
        // Mixed groups: the metadata reserved by changes under way and kept back for
        // deletions and commits comes out of the same space.
        let free = data_free(w);
        if free >= bytes {
            return Ok(());
        }
        let mut h = w.start_transaction("reserve_data", 4)?;
        match crate::space::chunk_alloc::alloc_chunk_in(&mut h, BLOCK_GROUP_DATA) {
            Ok(()) => h.end()?,
            Err(e) if e.posix_kind() == Some(PosixKind::NoSpace) => {
                // Nothing changed: the chunk allocation looks for room first.
                h.end()?;
                return Err(Error::posix_detail(
                    PosixKind::NoSpace,
                    what.to_string(),
                    format!("{bytes} bytes of data space are needed, {free} are free, and the devices have no room for another data chunk"),
                ));
            }
            Err(e) => return h.end_with(Err(e)),
        }
    }
}

/// The data bytes a new reservation may count on: the data groups' free space, less
/// (on mixed groups, which share it) the metadata reserved and kept back.
pub(crate) fn data_free(w: &Transaction) -> u64 {
    let free = w.alloc.free_bytes(BLOCK_GROUP_DATA);
    if w.alloc.mixed {
        free.saturating_sub(w.alloc.meta_may_use + metadata_reserve(w))
    } else {
        free
    }
}

/// Publish the data space free now for the write-time checks (`space::data_rsv`), if
/// anything moved it since the last time. Mixed groups always publish: every
/// metadata reservation moves their data space.
pub(crate) fn publish_data_free(w: &mut Transaction) {
    if std::mem::take(&mut w.alloc.space_moved) || w.alloc.mixed {
        w.data_rsv.publish_free(data_free(w));
    }
}

/// Tree height the kernel charges every reserved item for (`BTRFS_MAX_LEVEL`).
const MAX_LEVEL: u64 = 8;

/// Metadata kept back from operations that add items, so that deleting (which COWs
/// paths too) and committing always find tree blocks once the device has no room for
/// another metadata chunk (the kernel's global block reserve): 256 tree blocks, at most
/// a quarter of the metadata block groups.
pub fn metadata_reserve(w: &Transaction) -> u64 {
    let meta = w.alloc.space_type(BLOCK_GROUP_METADATA);
    let total: u64 = w
        .alloc
        .groups
        .values()
        .filter(|g| g.flags & BLOCK_GROUP_TYPE_MASK == meta)
        .map(|g| g.length)
        .sum();
    (256 * u64::from(w.nodesize())).min(total / 4)
}

/// Metadata bytes a change of `items` items is charged (the kernel's
/// `btrfs_calc_insert_metadata_size`: a COW of a full-height path per item).
pub(crate) fn metadata_size(w: &Transaction, items: u64) -> u64 {
    items * 2 * MAX_LEVEL * u64::from(w.nodesize())
}

/// Reserve metadata space for an operation that adds about `items` items, before it
/// begins (`btrfs_block_rsv_add`): the space must hold it on top of what other
/// reservations hold and of `metadata_reserve`, allocating a metadata chunk if that
/// helps. Refusing here, before anything changes, keeps a full filesystem writable for
/// deletions instead of wedging it with every tree block in use. Returns the bytes
/// reserved, which the caller's handle uses up or gives back (`release_metadata`).
///
/// # Errors
/// `Posix(NoSpace)` when the space cannot be found or made; chunk allocation failures.
pub(crate) fn reserve_metadata(w: &mut Transaction, items: u64) -> Result<u64> {
    if items == 0 {
        return Ok(0);
    }
    // Caching groups below swallows their errors (a group that fails to load counts as
    // full): a probed run must not get there with a miss it would misread.
    w.begin_change()?;
    let bytes = metadata_size(w, items);
    let want = metadata_reserve(w) + w.alloc.meta_may_use + bytes;
    let take = |w: &mut Transaction| {
        w.alloc.meta_may_use += bytes;
        Ok(bytes)
    };
    if w.alloc.free_bytes(BLOCK_GROUP_METADATA) >= want {
        return take(w);
    }
    // The counters of uncached groups come from their items and may disagree with the
    // free-space tree: before adding a chunk, ask the caches (a group that fails to
    // load counts as full; the allocation that would need it reports the damage).
    let meta = w.alloc.space_type(BLOCK_GROUP_METADATA);
    let uncached: Vec<u64> = w
        .alloc
        .groups
        .values()
        .filter(|g| {
            g.flags & BLOCK_GROUP_TYPE_MASK == meta && g.caching_state() == CachingState::No
        })
        .map(|g| g.start)
        .collect();
    for s in uncached {
        let _ = cached_ctl(w, s);
    }
    if w.alloc.free_bytes(BLOCK_GROUP_METADATA) >= want {
        return take(w);
    }
    // The chunk goes in under a handle of its own (joined to the caller's, if any). No
    // room for one is not a failure of anything begun: nothing has changed then.
    {
        let mut h = w.join_transaction("metadata chunk allocation")?;
        match crate::space::chunk_alloc::alloc_chunk_in(&mut h, BLOCK_GROUP_METADATA) {
            Ok(()) => h.end()?,
            Err(e) if e.posix_kind() == Some(PosixKind::NoSpace) => h.end()?,
            Err(e) => return h.end_with(Err(e)),
        }
    }
    let free = w.alloc.free_bytes(BLOCK_GROUP_METADATA);
    if free >= want {
        return take(w);
    }
    let held = w.alloc.meta_may_use;
    Err(Error::posix(
        PosixKind::NoSpace,
        format!("metadata space is low: {free} bytes free, {want} needed for {items} items, the reservations of changes under way ({held}) and the reserve kept for deletions and commits"),
    ))
}

/// Give back `bytes` of a metadata reservation (unused, or used up by tree blocks
/// allocated under it).
pub(crate) fn release_metadata(w: &mut Transaction, bytes: u64) {
    assert!(
        bytes <= w.alloc.meta_may_use,
        "releasing {bytes} metadata bytes with {} reserved",
        w.alloc.meta_may_use
    );
    w.alloc.meta_may_use -= bytes;
}

/// Give back space reserved in this transaction that never reached disk.
///
/// Both failures are bugs, not damage: the range came from `alloc_extent` in this
/// transaction (inside a cached group, and groups are never removed), it left the cache
/// then, and nothing returns it before this call. A pin (a committed extent freed)
/// cannot cover it either: the free-space tree still calls the range free until this
/// head runs, so dropping an extent that overlaps it fails there first
/// (`add_to_free_space_tree`).
///
/// While a reader reads data of the running transaction without the engine's lock
/// (`Engine::read_file`), the space is pinned instead: that reader may still read it,
/// so it must not be handed out again before the commit and the reader's end. So is a
/// tree block whose early writeback may still be writing it (`still_written`): the
/// next allocation there could otherwise be overwritten by that write. This is the
/// one place that decides between giving the space back and pinning it.
pub(crate) fn unreserve(w: &mut Transaction, bytenr: u64, num_bytes: u64, still_written: bool) {
    w.alloc.space_moved = true;
    if still_written || !w.views.may_reuse(Generation(w.transid)) {
        // Allocated in this transaction and not free: pinning cannot fail but for a bug.
        pin(w, bytenr, num_bytes).unwrap_or_else(|e| {
            panic!("unreserve {bytenr} +{num_bytes} while it may still be read or written: {e}")
        });
        return;
    }
    let g = w
        .alloc
        .group_mut(bytenr)
        .unwrap_or_else(|| panic!("unreserve {bytenr} +{num_bytes} outside every block group"));
    let start = g.start;
    let c = g.ctl_mut().unwrap_or_else(|| panic!("unreserve {bytenr} +{num_bytes}: block group {start} is not cached, so nothing was reserved in it"));
    c.add_free_space(bytenr, num_bytes)
        .unwrap_or_else(|e| panic!("unreserve {bytenr} +{num_bytes}: {e}"));
}

/// Take `[bytenr, bytenr + num_bytes)`, free in the committed filesystem, out of the
/// free space for a log replay (the kernel's `btrfs_pin_extent_for_log_replay` and
/// `btrfs_exclude_logged_extents`): a log tree block stays unallocated on disk but must
/// not be handed out while the replay still reads it (`pin_until_commit`: it comes back
/// free when the replay's commit ends); a data extent only the log uses stays out until
/// its replay inserts its extent item (`add_logged_data_extent`), or comes back with
/// `return_excluded` if nothing replays it.
///
/// # Errors
/// `Corrupt` naming the range when it is outside every block group or not wholly free
/// (the log claims space the committed filesystem uses); the group's caching errors.
pub(crate) fn exclude_logged(
    w: &mut Transaction,
    bytenr: u64,
    num_bytes: u64,
    pin_until_commit: bool,
    what: &str,
) -> Result<()> {
    let bad = |why: String| -> Error {
        Error::from(ubtrfs_format::Corrupt::new(
            ubtrfs_format::CorruptWhere::Item,
            format!("log tree: {what} {bytenr} +{num_bytes} {why}"),
        ))
    };
    let (start, len) =
        w.alloc.group_range(bytenr).ok_or_else(|| bad("lies outside every block group".into()))?;
    if bytenr.checked_add(num_bytes).is_none_or(|e| e > start + len) {
        return Err(bad(format!("crosses the end of block group {start}")));
    }
    let c = cached_ctl(w, start)?;
    if !c.is_free(bytenr, num_bytes) {
        return Err(bad("is space the committed filesystem uses".into()));
    }
    c.remove_free_space(bytenr, num_bytes).map_err(|e| bad(e.to_string()))?;
    if pin_until_commit {
        c.pin(bytenr, num_bytes).map_err(|e| bad(e.to_string()))?;
    }
    w.alloc.changed = true;
    Ok(())
}

/// Pin a block of this transaction's log trees, which the allocator handed out and no
/// extent item records, until the commit that makes the log obsolete is on disk.
pub(crate) fn pin_log_block(w: &mut Transaction, bytenr: u64, num_bytes: u64) {
    let g = w
        .alloc
        .group_mut(bytenr)
        .unwrap_or_else(|| panic!("log block {bytenr} outside every block group"));
    let c = g.ctl_mut().expect("a group that handed out a block is cached");
    c.pin(bytenr, num_bytes).unwrap_or_else(|e| panic!("pin log block {bytenr}: {e}"));
    w.alloc.changed = true;
}

/// Give back a range `exclude_logged` took without pinning, which no replayed file
/// extent came to use.
pub(crate) fn return_excluded(w: &mut Transaction, bytenr: u64, num_bytes: u64) {
    let g = w
        .alloc
        .group_mut(bytenr)
        .unwrap_or_else(|| panic!("excluded {bytenr} +{num_bytes} outside every block group"));
    let c = g.ctl_mut().expect("cached when excluded");
    c.add_free_space(bytenr, num_bytes)
        .unwrap_or_else(|e| panic!("return excluded {bytenr} +{num_bytes}: {e}"));
}

/// Pin a freed committed extent until the commit, caching its group first.
///
/// # Errors
/// `Corrupt` if the range is outside every group, free, or already pinned (the extent
/// tree said it was allocated); the group's caching errors.
pub fn pin(w: &mut Transaction, bytenr: u64, num_bytes: u64) -> Result<()> {
    let (start, _) = w.alloc.group_range(bytenr).ok_or_else(|| {
        Error::from(ubtrfs_format::Corrupt::new(
            ubtrfs_format::CorruptWhere::Item,
            format!("freed extent {bytenr} outside every block group"),
        ))
    })?;
    cached_ctl(w, start)?.pin(bytenr, num_bytes).map_err(|e| {
        Error::from(
            ubtrfs_format::Corrupt::new(
                ubtrfs_format::CorruptWhere::Item,
                format!("freeing extent {bytenr} +{num_bytes}: {e}"),
            )
            .root(EXTENT_TREE_OBJECTID),
        )
    })?;
    w.alloc.changed = true;
    Ok(())
}

/// Account an extent inserted into (`alloc`) or removed from the extent tree. The
/// group is cached first (the kernel's `btrfs_update_block_group` does so for frees, so
/// that the space comes back at unpin; an allocated extent's group is cached already).
///
/// # Errors
/// `Corrupt` if the extent lies outside every group, or `used` would go below zero or
/// past the group's length: the BLOCK_GROUP_ITEM disagrees with the extent and free
/// space trees (the tree checker only bounds `used` by the length); the group's caching
/// errors.
pub fn update_used(w: &mut Transaction, bytenr: u64, num_bytes: u64, alloc: bool) -> Result<()> {
    let bg_tree = if w.alloc.bg_tree { BLOCK_GROUP_TREE_OBJECTID } else { EXTENT_TREE_OBJECTID };
    let g = w.alloc.group(bytenr).ok_or_else(|| {
        Error::from(
            Corrupt::new(CorruptWhere::Item, format!("extent {bytenr} outside every block group"))
                .root(EXTENT_TREE_OBJECTID),
        )
    })?;
    let (start, cached) = (g.start, g.is_cached());
    if !cached {
        load_group(w, start)?;
    }
    let g = w.alloc.groups.get_mut(&start).expect("found above");
    let item = |reason: String| -> Error {
        Corrupt::new(CorruptWhere::Item, reason)
            .root(bg_tree)
            .key(Key::new(g.start, BLOCK_GROUP_ITEM_KEY, g.length))
            .into()
    };
    let used = if alloc {
        g.used
            .checked_add(num_bytes)
            .filter(|u| *u <= g.length)
            .ok_or_else(|| item(format!("block group {} would have {} + {num_bytes} bytes used adding extent {bytenr}, more than its length {}", g.start, g.used, g.length)))?
    } else {
        g.used.checked_sub(num_bytes).ok_or_else(|| {
            item(format!(
                "block group {} used {} below zero freeing extent {bytenr} +{num_bytes}",
                g.start, g.used
            ))
        })?
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
pub(crate) fn write_dirty_block_groups(w: &mut Transaction) -> Result<bool> {
    let mut any = crate::space::chunk_alloc::insert_pending_chunks(w)?;
    let tree = if w.alloc.bg_tree { BLOCK_GROUP_TREE_OBJECTID } else { EXTENT_TREE_OBJECTID };
    loop {
        let next = w
            .alloc
            .groups
            .values()
            .find(|g| g.dirty && !g.new)
            .map(|g| (g.start, g.length, g.used, g.flags));
        let Some((start, length, used, flags)) = next else { break };
        w.alloc.groups.get_mut(&start).expect("found above").dirty = false;
        let key = Key::new(start, BLOCK_GROUP_ITEM_KEY, length);
        let mut body = Vec::with_capacity(24);
        body.extend_from_slice(&used.to_le_bytes());
        body.extend_from_slice(&FIRST_CHUNK_TREE_OBJECTID.to_le_bytes());
        body.extend_from_slice(&flags.to_le_bytes());
        match w.lookup_for_update(tree, &key, 0)? {
            Some((leaf, slot)) => w.item_data_mut(leaf, slot).copy_from_slice(&body),
            None => {
                return Err(ubtrfs_format::Corrupt::new(
                    ubtrfs_format::CorruptWhere::Item,
                    format!("block group item {key} missing"),
                )
                .root(tree)
                .into())
            }
        }
        any = true;
    }
    Ok(any)
}

/// Test hooks (feature `test-hooks`): in-memory block groups that no chunk backs, for
/// exercising the free-space tree on ranges nothing else touches (the kernel
/// self-tests' dummy groups); the caching state; and the loader that filled every
/// group's cache at open before caching was lazy, kept to compare against.
#[cfg(feature = "test-hooks")]
impl Transaction {
    /// Add an in-memory block group [start, start+len) with `NEEDS_FREE_SPACE` set and an
    /// empty free-space cache (so the allocator never hands out its space). It has no
    /// chunk or BLOCK_GROUP_ITEM: remove it (`remove_test_group`) before committing.
    ///
    /// # Errors
    /// `Corrupt` for impossible geometry; `Posix(Exists)` if it overlaps a group.
    pub fn insert_test_group(&mut self, start: u64, len: u64, flags: u64) -> Result<()> {
        if self.alloc.group(start).is_some()
            || self.alloc.groups.range(start..start.saturating_add(len)).next().is_some()
        {
            return Err(Error::posix(
                PosixKind::Exists,
                format!("test block group {start} +{len} overlaps a block group"),
            ));
        }
        let ctl = new_ctl(
            start,
            len,
            flags,
            self.sectorsize(),
            self.nodesize(),
            self.alloc.bits_per_bitmap,
        )?;
        self.alloc.groups.insert(
            start,
            BlockGroup {
                start,
                length: len,
                flags,
                used: 0,
                dirty: false,
                new: false,
                needs_free_space: true,
                fst_bitmaps: None,
                super_bytes: 0,
                caching: Caching::Finished(Box::new(ctl)),
            },
        );
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

    /// The in-memory block group at `start`.
    pub fn block_group(&self, start: u64) -> Option<&BlockGroup> {
        self.alloc.groups.get(&start)
    }

    /// Starts of the cached groups, in order.
    pub fn cached_block_groups(&self) -> Vec<u64> {
        self.alloc.groups.values().filter(|g| g.is_cached()).map(|g| g.start).collect()
    }

    /// Check the allocator's bookkeeping.
    pub fn check_allocator(&self) {
        self.alloc.check_invariants();
    }

    /// Cache every uncached group the way the writable open did before caching was
    /// lazy: one walk of the whole committed free-space tree, each item's runs given to
    /// the group holding its start (items outside every group ignored), then the
    /// superblock stripes removed. The format flags stay unknown, as they did. For
    /// comparisons and the open-time benchmark only; call it right after opening.
    ///
    /// # Errors
    /// As the old open: read failures and the `Corrupt` errors of `cache_block_group`
    /// (without the group prefix).
    pub fn cache_all_block_groups_eagerly(&mut self) -> Result<()> {
        assert!(
            self.dirty.is_empty(),
            "the eager load reads the committed free-space tree: call it before changing anything"
        );
        let ss = u64::from(self.sectorsize());
        let fst = self.info.read_root(FREE_SPACE_TREE_OBJECTID)?.0;
        let mut it = self.info.iter(&fst, Key::MIN)?;
        let mut free: Vec<(u64, u64)> = Vec::new();
        while let Some(item) = it.next_item()? {
            push_item_runs(item.key(), item.data(), ss, &mut free)?;
        }
        drop(it);
        let mut ctls: BTreeMap<u64, FreeSpaceCtl> = BTreeMap::new();
        for g in self.alloc.groups.values().filter(|g| g.caching_state() == CachingState::No) {
            ctls.insert(
                g.start,
                new_ctl(
                    g.start,
                    g.length,
                    g.flags,
                    self.sectorsize(),
                    self.nodesize(),
                    self.alloc.bits_per_bitmap,
                )?,
            );
        }
        let mut per_group: BTreeMap<u64, Vec<(u64, u64)>> = BTreeMap::new();
        for (s, l) in free {
            // mkfs.btrfs 6.2 leaves the items of its removed temporary chunks behind;
            // the kernel ignores free space outside block groups, and so do we.
            if let Some((gs, _)) = self.alloc.group_range(s) {
                per_group.entry(gs).or_default().push((s, l));
            }
        }
        for (gs, runs) in per_group {
            if let Some(c) = ctls.get_mut(&gs) {
                add_runs(c, &runs)?;
            }
        }
        let stripes = super_stripes(self);
        for (gs, mut c) in ctls {
            exclude_super_stripes(&mut c, &stripes);
            self.alloc.groups.get_mut(&gs).expect("listed above").caching =
                Caching::Finished(Box::new(c));
        }
        Ok(())
    }
}
