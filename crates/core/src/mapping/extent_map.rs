//! Extent maps: the in-memory cache of which disk range backs which file range, one tree
//! per in-memory inode (the kernel's `extent_map_tree`), so a read of a cached range
//! reads no fs-tree leaf.
//!
//! Semantics follow fs/btrfs/extent_map.c:
//! - An `ExtentMap` covers `[start, start + len)` of the file. `disk_bytenr` is a
//!   logical address or one of the markers `EXTENT_MAP_HOLE` / `EXTENT_MAP_INLINE`.
//!   `block_start()` is where the file range begins on disk (`disk_bytenr + offset`
//!   for plain extents, `disk_bytenr` for compressed ones, the marker otherwise).
//! - Adding merges with neighbours when both are mergeable (`can_merge`: not PINNED,
//!   not compressed, not LOGGING) and `mergeable` (adjacent in the file, equal flags but
//!   MERGED, adjacent on disk; holes with holes, inline with inline). The result takes
//!   the larger generation, gets MERGED and has its on-disk fields recomputed
//!   (`merge_ondisk_extents`). An overlapping add fails with `Exists`; the read path
//!   resolves that the way `btrfs_add_extent_mapping` does (`add_with_search`).
//! - `drop_extent_map_range` removes `[start, end)`, splitting maps at the edges; a
//!   split keeps its disk range and moves its `offset` (so a compressed piece still
//!   names the whole compressed extent).
//!
//! Invariants (`check_invariants`): maps are keyed by their start, have len > 0, end
//! without overflow and never overlap. The count of maps in a tree attached to the
//! shrinker (`extent_map_shrinker`) is counted there; every change goes through
//! `MapsGuard`, whose drop settles that count and the registry.
//!
//! The maps mirror the live fs tree: every EXTENT_DATA item change in `tree::modify`
//! drops the range it touches (`inode::get_extent::drop_for_item_change`, through the
//! transaction's `file_extents_changed`), under the engine's exclusive state, while
//! fills (`inode::get_extent::get_file_extents`) run under its shared side.
//!
//! Neighbours: `inode::inode_cache` (the tree lives in `InodeMapping`),
//! `extent_map_shrinker` (frees maps under a memory budget), `data::read` (the data
//! reads they serve).

use crate::ids::InodeId;
use crate::mapping::extent_map_shrinker::{ExtentMapShrinker, MapsOwner, Owner};
use crate::mapping::file_extent::{ExtentKind, FileExtentRec};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};

/// The last byte a real disk address may name; markers sit above it.
pub const EXTENT_MAP_LAST_BYTE: u64 = u64::MAX - 3;
/// `disk_bytenr` of a hole.
pub const EXTENT_MAP_HOLE: u64 = u64::MAX - 2;
/// `disk_bytenr` of an inline extent (its bytes live in the leaf).
pub const EXTENT_MAP_INLINE: u64 = u64::MAX - 1;

/// Under I/O or an incomplete ordered extent: neither merged nor freed by the shrinker.
pub const EXTENT_FLAG_PINNED: u32 = 1 << 0;
pub const EXTENT_FLAG_COMPRESS_ZLIB: u32 = 1 << 1;
pub const EXTENT_FLAG_COMPRESS_LZO: u32 = 1 << 2;
pub const EXTENT_FLAG_COMPRESS_ZSTD: u32 = 1 << 3;
pub const EXTENT_FLAG_PREALLOC: u32 = 1 << 4;
/// Being logged by fsync: not merged.
pub const EXTENT_FLAG_LOGGING: u32 = 1 << 5;
/// The result of a merge.
pub const EXTENT_FLAG_MERGED: u32 = 1 << 6;
const COMPRESS_MASK: u32 =
    EXTENT_FLAG_COMPRESS_ZLIB | EXTENT_FLAG_COMPRESS_LZO | EXTENT_FLAG_COMPRESS_ZSTD;

/// One cached mapping of a file range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtentMap {
    pub start: u64,
    pub len: u64,
    pub disk_bytenr: u64,
    pub disk_num_bytes: u64,
    pub offset: u64,
    pub ram_bytes: u64,
    pub generation: u64,
    pub flags: u32,
}

impl ExtentMap {
    /// A plain (uncompressed, written) map.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn plain(
        start: u64,
        len: u64,
        disk_bytenr: u64,
        disk_num_bytes: u64,
        offset: u64,
    ) -> ExtentMap {
        ExtentMap {
            start,
            len,
            disk_bytenr,
            disk_num_bytes,
            offset,
            ram_bytes: disk_num_bytes,
            generation: 0,
            flags: 0,
        }
    }

    /// A hole.
    pub fn hole(start: u64, len: u64) -> ExtentMap {
        ExtentMap {
            start,
            len,
            disk_bytenr: EXTENT_MAP_HOLE,
            disk_num_bytes: 0,
            offset: 0,
            ram_bytes: len,
            generation: 0,
            flags: 0,
        }
    }

    pub fn end(&self) -> u64 {
        self.start.saturating_add(self.len)
    }

    /// The btrfs compression type (0 none, 1 zlib, 2 lzo, 3 zstd).
    pub fn compress_type(&self) -> u8 {
        match self.flags & COMPRESS_MASK {
            0 => 0,
            EXTENT_FLAG_COMPRESS_ZLIB => 1,
            EXTENT_FLAG_COMPRESS_LZO => 2,
            EXTENT_FLAG_COMPRESS_ZSTD => 3,
            f => panic!(
                "extent map [{}, {}) has several compression flags {f:#x}",
                self.start,
                self.end()
            ),
        }
    }

    /// The flag for btrfs compression type `t` (0 for none or unknown).
    pub fn compress_flag(t: u8) -> u32 {
        match t {
            1 => EXTENT_FLAG_COMPRESS_ZLIB,
            2 => EXTENT_FLAG_COMPRESS_LZO,
            3 => EXTENT_FLAG_COMPRESS_ZSTD,
            _ => 0,
        }
    }

    pub fn is_compressed(&self) -> bool {
        self.flags & COMPRESS_MASK != 0
    }

    pub fn is_marker(&self) -> bool {
        self.disk_bytenr >= EXTENT_MAP_LAST_BYTE
    }

    /// Where the file range begins on disk (the marker for holes and inline extents).
    pub fn block_start(&self) -> u64 {
        if self.is_marker() || self.is_compressed() {
            self.disk_bytenr
        } else {
            self.disk_bytenr.saturating_add(self.offset)
        }
    }

    /// The end of the disk range a plain map reads.
    fn block_end(&self) -> u64 {
        self.block_start().saturating_add(self.len)
    }

    /// Not pinned, compressed or being logged (`can_merge_extent_map`).
    fn can_merge(&self) -> bool {
        self.flags & (EXTENT_FLAG_PINNED | EXTENT_FLAG_LOGGING) == 0 && !self.is_compressed()
    }

    /// The piece `[from, to)` of this map, its `offset` moved (disk range kept).
    fn piece(&self, from: u64, to: u64) -> ExtentMap {
        assert!(
            self.start <= from,
            "piece [{from}, {to}) starts before map [{}, {})",
            self.start,
            self.end()
        );
        assert!(from < to, "empty piece [{from}, {to})");
        assert!(
            to <= self.end(),
            "piece [{from}, {to}) ends after map [{}, {})",
            self.start,
            self.end()
        );
        let mut p = *self;
        p.start = from;
        p.len = to - from;
        if !self.is_marker() {
            p.offset = self.offset + (from - self.start);
        }
        p
    }
}

/// Adjacent in the file, equal flags but MERGED, adjacent on disk (`mergeable_maps`).
fn mergeable(prev: &ExtentMap, next: &ExtentMap) -> bool {
    if prev.end() != next.start
        || (prev.flags & !EXTENT_FLAG_MERGED) != (next.flags & !EXTENT_FLAG_MERGED)
    {
        return false;
    }
    if next.is_marker() {
        next.disk_bytenr == prev.disk_bytenr
    } else {
        !prev.is_marker() && next.block_start() == prev.block_end()
    }
}

/// `prev` and `next` (mergeable) as one map.
fn merge(prev: &ExtentMap, next: &ExtentMap) -> ExtentMap {
    debug_assert!(mergeable(prev, next));
    let mut m = *prev;
    m.len = prev.len + next.len;
    m.generation = prev.generation.max(next.generation);
    m.flags |= EXTENT_FLAG_MERGED;
    if !prev.is_marker() {
        // merge_ondisk_extents: one disk range covering both, read from prev's start.
        let lo = prev.disk_bytenr.min(next.disk_bytenr);
        let hi =
            (prev.disk_bytenr + prev.disk_num_bytes).max(next.disk_bytenr + next.disk_num_bytes);
        m.disk_bytenr = lo;
        m.disk_num_bytes = hi - lo;
        m.offset = prev.block_start() - lo;
        m.ram_bytes = m.disk_num_bytes;
    } else {
        m.ram_bytes = m.len;
    }
    assert_eq!(
        m.block_start(),
        prev.block_start(),
        "merge moved the block start of [{}, {})",
        m.start,
        m.end()
    );
    m
}

/// An add that overlaps maps already there (the kernel's -EEXIST).
#[derive(Debug, PartialEq, Eq)]
pub struct Exists {
    pub start: u64,
    pub len: u64,
}

/// One inode's extent maps.
#[derive(Debug, Default)]
pub struct ExtentMapTree {
    maps: RwLock<BTreeMap<u64, ExtentMap>>,
    /// Set at the first add through the engine: the shrinker that counts these maps.
    owner: OnceLock<Owner>,
    /// The number of maps as of the last write guard's release, for the shrinker's
    /// unlocked peek (`len_unlocked`).
    nr: AtomicUsize,
}

/// The write side of a tree: every change goes through it; its drop settles the
/// shrinker's count and registry.
pub struct MapsGuard<'a> {
    maps: RwLockWriteGuard<'a, BTreeMap<u64, ExtentMap>>,
    owner: Option<&'a Owner>,
    nr: &'a AtomicUsize,
    before: usize,
}

impl Drop for MapsGuard<'_> {
    fn drop(&mut self) {
        self.nr.store(self.maps.len(), Ordering::Release);
        if let Some(o) = self.owner {
            o.settle(self.before, self.maps.len());
        }
    }
}

impl Drop for ExtentMapTree {
    fn drop(&mut self) {
        // An evicted inode's maps go with it: out of the count and the registry.
        let n = self.len();
        if n > 0 {
            if let Some(o) = self.owner.get() {
                o.settle(n, 0);
            }
        }
    }
}

impl ExtentMapTree {
    /// Attach the tree to `shrinker` as inode `id`'s, owned by `owner` (once; later
    /// calls are no-ops).
    pub fn attach(
        &self,
        shrinker: &Arc<ExtentMapShrinker>,
        id: InodeId,
        owner: Weak<dyn MapsOwner>,
    ) {
        if self.owner.get().is_some() {
            return;
        }
        let maps = self.lock_write();
        // Counted from here on: whatever is in it now joins the count.
        if self.owner.set(Owner::new(shrinker, id, owner)).is_ok() {
            let o = self.owner.get().expect("set just above");
            o.settle(0, maps.len());
        }
    }

    /// Whether the tree is attached to a shrinker (it has no maps until it is).
    pub fn is_attached(&self) -> bool {
        self.owner.get().is_some()
    }

    fn lock_write(&self) -> RwLockWriteGuard<'_, BTreeMap<u64, ExtentMap>> {
        self.maps.write().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn lock_read(&self) -> RwLockReadGuard<'_, BTreeMap<u64, ExtentMap>> {
        self.maps.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The tree's write side.
    pub fn write(&self) -> MapsGuard<'_> {
        let maps = self.lock_write();
        let before = maps.len();
        MapsGuard { maps, owner: self.owner.get(), nr: &self.nr, before }
    }

    /// The tree's write side if nobody holds the tree now (the shrinker's trylock).
    pub fn try_write(&self) -> Option<MapsGuard<'_>> {
        let maps = match self.maps.try_write() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        let before = maps.len();
        Some(MapsGuard { maps, owner: self.owner.get(), nr: &self.nr, before })
    }

    /// The number of maps without taking the tree's lock (the shrinker's unlocked
    /// emptiness test): it changes only when a write guard is released, so a reader may see the
    /// count from just before a concurrent change. Good for a hint (a false "empty"
    /// defers the inode to a later scan), never for a decision that needs the truth.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn len_unlocked(&self) -> usize {
        self.nr.load(Ordering::Acquire)
    }

    /// Maps now.
    pub fn len(&self) -> usize {
        self.lock_read().len()
    }

    #[cfg(any(test, feature = "test-hooks"))]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every map, in file order.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn maps(&self) -> Vec<ExtentMap> {
        self.lock_read().values().copied().collect()
    }

    /// The first map overlapping `[start, start + len)` (`lookup_extent_mapping`).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn lookup(&self, start: u64, len: u64) -> Option<ExtentMap> {
        lookup_in(&self.lock_read(), start, start.saturating_add(len))
    }

    /// Add `em` with merging (`add_extent_mapping`).
    ///
    /// # Errors
    /// `Exists` when it overlaps a map already there.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn add(&self, em: ExtentMap) -> std::result::Result<(), Exists> {
        self.write().add(em)
    }

    /// `btrfs_add_extent_mapping`: add `em`, which was looked up for
    /// `[search_start, search_start + search_len)`; when it overlaps maps already there,
    /// return the existing map covering `search_start`, or add the part of `em` in the
    /// gap around `search_start` (`merge_extent_mapping`). Returns the map that now
    /// covers `search_start`.
    ///
    /// # Errors
    /// `Exists` when `search_start` is outside `em` and overlaps nothing.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn add_with_search(
        &self,
        em: ExtentMap,
        search_start: u64,
        search_len: u64,
    ) -> std::result::Result<ExtentMap, Exists> {
        self.write().add_with_search(em, search_start, search_len)
    }

    /// Drop `[start, end)`, splitting maps at the edges; with `skip_pinned`, pinned maps
    /// stay whole.
    pub fn drop_extent_map_range(&self, start: u64, end: u64, skip_pinned: bool) {
        self.write().drop_range(start, end, skip_pinned);
    }

    /// Set or clear PINNED on the map starting at `start`; false when there is none.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn set_pinned(&self, start: u64, pinned: bool) -> bool {
        let mut g = self.write();
        let Some(m) = g.maps.get_mut(&start) else { return false };
        if pinned {
            m.flags |= EXTENT_FLAG_PINNED;
        } else {
            m.flags &= !EXTENT_FLAG_PINNED;
        }
        true
    }

    /// Check the tree's invariants (module notes); panics naming the first that fails.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn check_invariants(&self) {
        check_maps(&self.lock_read());
    }
}

fn check_maps(maps: &BTreeMap<u64, ExtentMap>) {
    let mut prev_end = 0u64;
    for (k, m) in maps {
        assert_eq!(*k, m.start, "extent map keyed {k} starts at {}", m.start);
        assert!(m.len > 0, "extent map at {} is empty", m.start);
        assert!(
            m.start.checked_add(m.len).is_some(),
            "extent map at {} len {} overflows",
            m.start,
            m.len
        );
        assert!(
            m.start >= prev_end,
            "extent map at {} overlaps the previous one ending at {prev_end}",
            m.start
        );
        prev_end = m.end();
    }
}

fn lookup_in(maps: &BTreeMap<u64, ExtentMap>, start: u64, end: u64) -> Option<ExtentMap> {
    if let Some((_, m)) = maps.range(..=start).next_back() {
        if m.end() > start {
            return Some(*m);
        }
    }
    maps.range(start..end).next().map(|(_, m)| *m)
}

impl MapsGuard<'_> {
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn len(&self) -> usize {
        self.maps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }

    /// See `ExtentMapTree::add`.
    ///
    /// # Errors
    /// `Exists` on overlap.
    pub fn add(&mut self, em: ExtentMap) -> std::result::Result<(), Exists> {
        assert!(em.len > 0, "adding an empty extent map at {}", em.start);
        assert!(
            em.start.checked_add(em.len).is_some(),
            "extent map at {} len {} overflows",
            em.start,
            em.len
        );
        if lookup_in(&self.maps, em.start, em.end()).is_some() {
            return Err(Exists { start: em.start, len: em.len });
        }
        let mut em = em;
        if em.can_merge() {
            if let Some((&ps, prev)) = self.maps.range(..em.start).next_back() {
                if prev.can_merge() && mergeable(prev, &em) {
                    em = merge(prev, &em);
                    self.maps.remove(&ps);
                }
            }
            if let Some(next) = self.maps.get(&em.end()).copied() {
                if next.can_merge() && mergeable(&em, &next) {
                    self.maps.remove(&next.start);
                    em = merge(&em, &next);
                }
            }
        }
        self.maps.insert(em.start, em);
        Ok(())
    }

    /// See `ExtentMapTree::add_with_search`.
    ///
    /// # Errors
    /// As there.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn add_with_search(
        &mut self,
        em: ExtentMap,
        search_start: u64,
        search_len: u64,
    ) -> std::result::Result<ExtentMap, Exists> {
        let err = match self.add(em) {
            Ok(()) => {
                return Ok(lookup_in(&self.maps, search_start, search_start + 1)
                    .expect("just added over the search start"))
            }
            Err(e) => e,
        };
        // The map nearest the search range: overlapping it, else the one before, else after.
        let search_end = search_start.saturating_add(search_len.max(1));
        let existing = lookup_in(&self.maps, search_start, search_end)
            .or_else(|| self.maps.range(..search_start).next_back().map(|(_, m)| *m))
            .or_else(|| self.maps.range(search_start..).next().map(|(_, m)| *m))
            .ok_or(err)?;
        if existing.start <= search_start && search_start < existing.end() {
            return Ok(existing);
        }
        // merge_extent_mapping: the part of `em` between the neighbours of the search start.
        if search_start < em.start || search_start >= em.end() {
            return Err(Exists { start: em.start, len: em.len });
        }
        let (prev, next) = if existing.start > search_start {
            (self.maps.range(..existing.start).next_back().map(|(_, m)| *m), Some(existing))
        } else {
            (Some(existing), self.maps.range(existing.end()..).next().map(|(_, m)| *m))
        };
        let start = prev.map_or(em.start, |p| p.end()).max(em.start);
        let end = next.map_or(em.end(), |n| n.start).min(em.end());
        if start >= end {
            return Err(Exists { start: em.start, len: em.len });
        }
        let piece = em.piece(start, end);
        self.add(piece)?;
        Ok(lookup_in(&self.maps, search_start, search_start + 1)
            .expect("the piece covers the search start"))
    }

    /// See `ExtentMapTree::drop_extent_map_range`.
    pub fn drop_range(&mut self, start: u64, end: u64, skip_pinned: bool) {
        if start >= end {
            return;
        }
        let mut hit: Vec<ExtentMap> = Vec::new();
        if let Some((_, m)) = self.maps.range(..start).next_back() {
            if m.end() > start {
                hit.push(*m);
            }
        }
        hit.extend(self.maps.range(start..end).map(|(_, m)| *m));
        for m in hit {
            if skip_pinned && m.flags & EXTENT_FLAG_PINNED != 0 {
                continue;
            }
            self.maps.remove(&m.start);
            let inline = m.disk_bytenr == EXTENT_MAP_INLINE;
            if m.start < start && !inline {
                let left = m.piece(m.start, start);
                self.maps.insert(left.start, left);
            }
            if m.end() > end && !inline {
                let right = m.piece(end, m.end());
                self.maps.insert(right.start, right);
            }
        }
        if cfg!(debug_assertions) && self.maps.len() <= 64 {
            check_maps(&self.maps);
        }
    }

    /// Remove up to `budget` maps from the first on, leaving pinned ones (the
    /// shrinker's `scan_inode`). Returns (scanned, freed).
    pub fn shrink(&mut self, budget: u64) -> (u64, u64) {
        let mut scanned = 0;
        let mut doomed = Vec::new();
        for (k, m) in self.maps.iter() {
            if scanned >= budget {
                break;
            }
            scanned += 1;
            if m.flags & EXTENT_FLAG_PINNED == 0 {
                doomed.push(*k);
            }
        }
        for k in &doomed {
            self.maps.remove(k);
        }
        (scanned, doomed.len() as u64)
    }
}

/// The extents of `[from, to)` from `maps` if they cover it without a gap or an inline map.
pub(crate) fn from_maps(
    maps: &BTreeMap<u64, ExtentMap>,
    from: u64,
    to: u64,
) -> Option<Vec<FileExtentRec>> {
    let mut out = Vec::new();
    let mut pos = from;
    let first = maps.range(..=from).next_back().map_or(from, |(k, _)| *k);
    for m in maps.range(first..to).map(|(_, m)| m) {
        if m.end() <= pos {
            continue;
        }
        if m.start > pos || m.disk_bytenr == EXTENT_MAP_INLINE {
            return None;
        }
        if m.disk_bytenr != EXTENT_MAP_HOLE {
            out.push(FileExtentRec {
                file_offset: m.start,
                generation: m.generation,
                kind: ExtentKind::Regular {
                    disk_bytenr: m.disk_bytenr,
                    disk_num_bytes: m.disk_num_bytes,
                    offset: m.offset,
                    num_bytes: m.len,
                    ram_bytes: m.ram_bytes,
                    compression: m.compress_type(),
                    prealloc: m.flags & EXTENT_FLAG_PREALLOC != 0,
                },
            });
        }
        pos = m.end();
        if pos >= to {
            return Some(out);
        }
    }
    None
}

/// The map of one file extent record (None for an empty or overflowing one).
fn map_of(rec: &FileExtentRec, sectorsize: u32) -> Option<ExtentMap> {
    let start = rec.file_offset;
    let em = match rec.kind {
        ExtentKind::Inline { .. } => ExtentMap {
            start,
            len: u64::from(sectorsize),
            disk_bytenr: EXTENT_MAP_INLINE,
            disk_num_bytes: 0,
            offset: 0,
            ram_bytes: rec.len(),
            generation: rec.generation,
            flags: 0,
        },
        ExtentKind::Regular { disk_bytenr: 0, num_bytes, .. } => {
            ExtentMap { generation: rec.generation, ..ExtentMap::hole(start, num_bytes) }
        }
        ExtentKind::Regular {
            disk_bytenr,
            disk_num_bytes,
            offset,
            num_bytes,
            ram_bytes,
            compression,
            prealloc,
        } => {
            let mut flags = ExtentMap::compress_flag(compression);
            if prealloc {
                flags |= EXTENT_FLAG_PREALLOC;
            }
            if disk_bytenr >= EXTENT_MAP_LAST_BYTE
                || disk_bytenr.checked_add(disk_num_bytes).is_none()
            {
                return None;
            }
            ExtentMap {
                start,
                len: num_bytes,
                disk_bytenr,
                disk_num_bytes,
                offset,
                ram_bytes,
                generation: rec.generation,
                flags,
            }
        }
    };
    (em.len > 0 && em.start.checked_add(em.len).is_some()).then_some(em)
}

/// Cache the extents `recs` read for `[from, to)`, with hole maps for the gaps between
/// them inside the range. A record that does not fit (a hostile image's overlaps) is
/// not cached; the read goes on from the records.
pub(crate) fn fill(
    tree: &ExtentMapTree,
    sectorsize: u32,
    recs: &[FileExtentRec],
    from: u64,
    to: u64,
) {
    let mut maps = Vec::with_capacity(recs.len() + 1);
    let mut pos = from;
    for rec in recs {
        let Some(em) = map_of(rec, sectorsize) else { return };
        if em.start > pos {
            maps.push(ExtentMap::hole(pos, em.start - pos));
        }
        pos = pos.max(em.end());
        maps.push(em);
    }
    if pos < to {
        maps.push(ExtentMap::hole(pos, to - pos));
    }
    let (Some(lo), Some(hi)) = (maps.first().map(|m| m.start), maps.iter().map(|m| m.end()).max())
    else {
        return;
    };
    let mut g = tree.write();
    // What is there mirrors the same items; replace it rather than merge into it.
    g.drop_range(lo, hi, false);
    for em in maps {
        if g.add(em).is_err() {
            g.drop_range(lo, hi, false);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const K: u64 = 1024;

    fn compressed(start: u64, len: u64, disk: u64) -> ExtentMap {
        ExtentMap {
            start,
            len,
            disk_bytenr: disk,
            disk_num_bytes: len,
            offset: 0,
            ram_bytes: len,
            generation: 0,
            flags: EXTENT_FLAG_COMPRESS_ZLIB,
        }
    }

    fn ranges(t: &ExtentMapTree) -> Vec<(u64, u64)> {
        t.maps().iter().map(|m| (m.start / K, m.end() / K)).collect()
    }

    #[test]
    fn adjacent_plain_maps_merge_and_recompute_the_disk_range() {
        let t = ExtentMapTree::default();
        t.add(ExtentMap { generation: 7, ..ExtentMap::plain(0, 4 * K, 100 * K, 4 * K, 0) })
            .unwrap();
        t.add(ExtentMap { generation: 9, ..ExtentMap::plain(4 * K, 8 * K, 104 * K, 8 * K, 0) })
            .unwrap();
        let m = t.maps();
        assert_eq!(m.len(), 1, "{m:?}");
        let m = m[0];
        assert_eq!(
            (
                m.start,
                m.len,
                m.block_start(),
                m.disk_bytenr,
                m.disk_num_bytes,
                m.offset,
                m.ram_bytes
            ),
            (0, 12 * K, 100 * K, 100 * K, 12 * K, 0, 12 * K)
        );
        assert_eq!(m.generation, 9);
        assert_ne!(m.flags & EXTENT_FLAG_MERGED, 0);
        // Not adjacent on disk: no merge.
        t.add(ExtentMap::plain(12 * K, 4 * K, 500 * K, 4 * K, 0)).unwrap();
        // Holes merge with holes, not with data.
        t.add(ExtentMap::hole(16 * K, 4 * K)).unwrap();
        t.add(ExtentMap::hole(20 * K, 4 * K)).unwrap();
        assert_eq!(ranges(&t), vec![(0, 12), (12, 16), (16, 24)]);
        assert_eq!(t.len_unlocked(), 3, "the unlocked count follows each released guard");
        assert_eq!(
            t.add(ExtentMap::hole(22 * K, 4 * K)),
            Err(Exists { start: 22 * K, len: 4 * K })
        );
        // A split merged map keeps reading the same disk bytes.
        t.drop_extent_map_range(4 * K, 8 * K, false);
        let m = t.maps();
        assert_eq!((m[0].start, m[0].len, m[0].block_start()), (0, 4 * K, 100 * K));
        assert_eq!((m[1].start, m[1].len, m[1].block_start()), (8 * K, 4 * K, 108 * K));
        t.check_invariants();
    }

    #[test]
    fn case1_add_over_an_existing_map_returns_it() {
        let t = ExtentMapTree::default();
        t.add(ExtentMap::plain(0, 16 * K, 0, 16 * K, 0)).unwrap();
        t.add(ExtentMap::plain(16 * K, 4 * K, 32 * K, 4 * K, 0)).unwrap();
        assert_eq!(t.len(), 2, "not adjacent on disk: {:?}", t.maps());
        let em = t.add_with_search(ExtentMap::plain(0, 8 * K, 0, 8 * K, 0), 0, 8 * K).unwrap();
        assert_eq!((em.start, em.len, em.disk_bytenr, em.block_start()), (0, 16 * K, 0, 0));
        t.check_invariants();
    }

    #[test]
    fn case2_inline_readd_returns_the_inline_map() {
        let t = ExtentMapTree::default();
        let inline = ExtentMap {
            start: 0,
            len: 4 * K,
            disk_bytenr: EXTENT_MAP_INLINE,
            disk_num_bytes: 0,
            offset: 0,
            ram_bytes: K,
            generation: 0,
            flags: 0,
        };
        t.add(inline).unwrap();
        t.add(ExtentMap::plain(4 * K, 4 * K, 4 * K, 4 * K, 0)).unwrap();
        assert_eq!(t.len(), 2);
        let em = t.add_with_search(inline, 0, 4 * K).unwrap();
        assert_eq!((em.start, em.end(), em.disk_bytenr), (0, 4 * K, EXTENT_MAP_INLINE));
    }

    #[test]
    fn case3_add_fills_the_gap_around_the_search_start() {
        for s in [0, 8 * K, 12 * K] {
            let t = ExtentMapTree::default();
            t.add(ExtentMap::plain(4 * K, 4 * K, 4 * K, 4 * K, 0)).unwrap();
            let em =
                t.add_with_search(ExtentMap::plain(0, 16 * K, 0, 16 * K, 0), s, 4 * K).unwrap();
            assert!(em.start <= s && em.end() >= s + 4 * K, "search {s}: {em:?}");
            assert_eq!(em.start, em.block_start(), "search {s}: {em:?}");
            t.check_invariants();
        }
    }

    #[test]
    fn case4_add_returns_the_existing_map_covering_the_search() {
        for (s, l) in [(0, 4 * K), (4 * K, 4 * K)] {
            let t = ExtentMapTree::default();
            t.add(ExtentMap::plain(0, 8 * K, 0, 8 * K, 0)).unwrap();
            t.add(ExtentMap::plain(8 * K, 24 * K, 16 * K, 24 * K, 0)).unwrap();
            let em = t.add_with_search(ExtentMap::plain(0, 32 * K, 0, 32 * K, 0), s, l).unwrap();
            assert!(em.start <= s && em.end() >= s + l, "search [{s}, +{l}): {em:?}");
            assert_eq!(t.len(), 2);
        }
    }

    #[test]
    fn case5_drop_range_splits_compressed_maps() {
        let t = ExtentMapTree::default();
        for (s, e) in [(0, 12), (12, 24), (24, 36), (36, 40), (40, 64)] {
            t.add(compressed(s * K, (e - s) * K, 1024 * K + s * K)).unwrap();
        }
        assert_eq!(t.len(), 5, "compressed maps never merge");
        t.drop_extent_map_range(8 * K, 12 * K, false);
        assert_eq!(ranges(&t), vec![(0, 8), (12, 24), (24, 36), (36, 40), (40, 64)]);
        t.drop_extent_map_range(12 * K, 20 * K, false);
        assert_eq!(ranges(&t), vec![(0, 8), (20, 24), (24, 36), (36, 40), (40, 64)]);
        t.drop_extent_map_range(28 * K, 32 * K, false);
        assert_eq!(ranges(&t), vec![(0, 8), (20, 24), (24, 28), (32, 36), (36, 40), (40, 64)]);
        t.drop_extent_map_range(32 * K, 64 * K, false);
        assert_eq!(ranges(&t), vec![(0, 8), (20, 24), (24, 28)]);
        // The pieces keep the whole compressed extent and move their offset.
        let m = t.lookup(20 * K, 4 * K).unwrap();
        assert_eq!(
            (m.disk_bytenr, m.disk_num_bytes, m.offset, m.block_start()),
            (1036 * K, 12 * K, 8 * K, 1036 * K)
        );
        t.check_invariants();
    }

    #[test]
    fn case6_no_map_between_compressed_neighbours() {
        let t = ExtentMapTree::default();
        t.add(compressed(0, 4 * K, 0)).unwrap();
        t.add(compressed(4 * K, 4 * K, 4 * K)).unwrap();
        let em = t.add_with_search(compressed(0, 8 * K, 0), 0, 8 * K).unwrap();
        assert_eq!((em.start, em.len), (0, 4 * K));
        assert_eq!(ranges(&t), vec![(0, 4), (4, 8)]);
    }

    #[test]
    fn case7_drop_skips_pinned_and_splits_the_rest() {
        let t = ExtentMapTree::default();
        t.add(ExtentMap {
            flags: EXTENT_FLAG_PINNED | EXTENT_FLAG_COMPRESS_ZLIB,
            ..compressed(0, 16 * K, 0)
        })
        .unwrap();
        t.add(ExtentMap::plain(32 * K, 16 * K, 32 * K, 16 * K, 0)).unwrap();
        t.drop_extent_map_range(0, 36 * K, true);
        let m = t.lookup(0, 16 * K).unwrap();
        assert_eq!((m.start, m.len), (0, 16 * K));
        assert!(t.lookup(16 * K, 16 * K).is_none());
        let m = t.lookup(36 * K, 12 * K).unwrap();
        assert_eq!((m.start, m.len, m.block_start()), (36 * K, 12 * K, 36 * K));
        assert!(t.lookup(48 * K, u64::MAX - 48 * K).is_none());
        t.check_invariants();
    }

    #[test]
    fn case8_compressed_add_is_trimmed_with_its_offset() {
        let t = ExtentMapTree::default();
        t.add(compressed(120 * K, 8 * K, 120 * K)).unwrap();
        let em = t.add_with_search(compressed(108 * K, 36 * K, 108 * K), 140 * K, 4 * K).unwrap();
        assert_eq!((em.start, em.len, em.offset), (128 * K, 16 * K, 20 * K));
        t.check_invariants();
    }

    #[test]
    fn maps_serve_a_range_only_when_they_cover_it() {
        let t = ExtentMapTree::default();
        t.add(ExtentMap::plain(0, 8 * K, 100 * K, 8 * K, 0)).unwrap();
        t.add(ExtentMap::hole(8 * K, 8 * K)).unwrap();
        let g = t.lock_read();
        let recs = from_maps(&g, 4 * K, 16 * K).expect("covered");
        assert_eq!(recs.len(), 1, "the hole is left out");
        assert_eq!(recs[0].file_offset, 0);
        assert!(from_maps(&g, 4 * K, 20 * K).is_none(), "a gap at 16K");
    }
}
