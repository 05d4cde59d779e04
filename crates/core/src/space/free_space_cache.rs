//! In-memory free-space cache of one block group: the kernel's `btrfs_free_space_ctl`
//! (fs/btrfs/free-space-cache.c). The allocator asks it for space
//! (`find_space_for_alloc`), freed extents are pinned until commit (`pin`) and then come
//! back through `unpin_all`, where stealing from bitmaps is the hot path.
//!
//! Free space lives in two kinds of entries. An *extent entry* is one free range
//! `[offset, offset + bytes)`. A *bitmap entry* owns `bits_per_bitmap` bits (one kernel
//! page: 32768 bits with 4 KiB pages, 131072 with 16 KiB pages) covering one aligned span
//! of `bits_per_bitmap × unit` bytes starting at `offset_to_bitmap(x)`; a set bit is a free
//! sector. Entries sit in two indexes, as in the kernel: the offset index (extent entries
//! and bitmap entries ordered by `(offset, kind)`, an extent entry before a bitmap entry at
//! the same offset) and the bytes index (largest first; a bitmap's key is its
//! `max_extent_size` when known, else its `bytes`; equal keys keep insertion order, as
//! `rb_add_cached` does).
//!
//! Invariants, checked by [`FreeSpaceCtl::check_invariants`] after every mutation in debug
//! builds: free space is never in two entries; entries lie inside the block group; bitmap
//! entries sit at `offset_to_bitmap` positions, are never empty and have
//! `bytes == popcount × unit`; `free_space`, `free_extents`, `total_bitmaps` and the bytes
//! index agree with the entries; `total_bitmaps <= max_bitmaps`; pinned ranges never overlap
//! free space.
//!
//! Choices where ubtrfs differs from, or narrows, the kernel (each says why):
//! - Stealing to the front scans backwards a word at a time: cost follows the
//!   run of free sectors below the entry, not the number of allocated sectors below it.
//!   The result equals the kernel's forward walk for every input (tests below).
//! - Caller input is validated before anything changes: adding space that is already free
//!   or pinned, removing space that is not free, or ranges outside the group or not
//!   sector-aligned return a [`FreeSpaceError`] and leave the cache untouched. The kernel
//!   trusts its callers (and e.g. silently double-counts a double free in a bitmap).
//! - `remove_free_space` looks up "the extent entry containing offset, else the bitmap at
//!   `offset_to_bitmap(offset)`" directly; with the invariants above this is what the
//!   kernel's `tree_search_offset` returns. Merging and allocation keep the kernel's search.
//! - Trim state is minimal: UNTRIMMED/TRIMMED with the kernel's merge and steal rules, no
//!   TRIMMING and no discard statistics (ubtrfs has no discard yet).
//! - No allocation clusters (ubtrfs's allocator does not build them), no `tree_lock`
//!   (`&mut self` is the lock), no v1 on-disk cache.
//! - A block group starting at 0 on a bitmap boundary never steals to the front; the
//!   kernel tests `offset == 0`, which is the same for such a group, and for other groups
//!   relies on a wrapped-around lookup that finds no bitmap.
//!
//! Neighbours: `block_group` (the groups this caches), the write engine's allocator (the
//! caller), the free-space tree (on-disk, elsewhere).

use std::cmp::{max, min, Reverse};
use std::collections::BTreeMap;
use std::ops::Bound::{Excluded, Unbounded};
use std::time::Instant;

/// Bits per bitmap with 4 KiB pages (`PAGE_SIZE × 8`, x86_64).
#[cfg(any(test, feature = "test-hooks"))]
pub const BITS_PER_BITMAP_4K_PAGE: u32 = 4096 * 8;
/// Bits per bitmap with 16 KiB pages (arm64 with 16K pages).
#[cfg(any(test, feature = "test-hooks"))]
pub const BITS_PER_BITMAP_16K_PAGE: u32 = 16384 * 8;
/// Memory budget for cache entries per GiB of block group (`MAX_CACHE_BYTES_PER_GIG`).
pub const MAX_CACHE_BYTES_PER_GIG: u64 = 64 * 1024;
/// Ranges this large always become extent entries (`FORCE_EXTENT_THRESHOLD`).
pub const FORCE_EXTENT_THRESHOLD: u64 = 1024 * 1024;
/// `sizeof(struct btrfs_free_space)` on 64-bit; it enters the thresholds.
pub const FREE_SPACE_ENTRY_SIZE: u64 = 104;
/// `extents_thresh` before the first recalculation: `(32 K / 2) / 104`.
pub const INITIAL_EXTENTS_THRESH: u64 = (32 * 1024 / 2) / FREE_SPACE_ENTRY_SIZE;

const SZ_1G: u64 = 1 << 30;

/// Most bitmap positions one group may have. The bitmap index is a slot array of this
/// many entries; btrfs data chunks are at most 10 GiB (80 bitmaps at 32768 bits), so this
/// only refuses nonsense geometry.
pub const MAX_BITMAP_SLOTS: u64 = 1 << 16;

/// Errors from caller input; the cache is unchanged when one is returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FreeSpaceError {
    #[error("block group {bg_start}: invalid free space cache geometry: {reason}")]
    Geometry { bg_start: u64, reason: String },
    #[error("block group {bg_start}: empty range at offset={offset}")]
    Empty { bg_start: u64, offset: u64 },
    #[error("block group {bg_start}: range offset={offset} bytes={bytes} is not aligned to sectorsize {unit}")]
    Unaligned { bg_start: u64, offset: u64, bytes: u64, unit: u64 },
    #[error("block group {bg_start}: range offset={offset} bytes={bytes} is outside the block group (length {bg_length})")]
    OutOfRange { bg_start: u64, bg_length: u64, offset: u64, bytes: u64 },
    /// EEXIST: part of the range is already free.
    #[error("block group {bg_start}: range offset={offset} bytes={bytes} is already free at offset={free_offset} bytes={free_bytes}")]
    AlreadyFree { bg_start: u64, offset: u64, bytes: u64, free_offset: u64, free_bytes: u64 },
    /// Part of the range is not in the cache (allocated or pinned).
    #[error("block group {bg_start}: range offset={offset} bytes={bytes} is not free at offset={hole_offset} bytes={hole_bytes}")]
    NotFree { bg_start: u64, offset: u64, bytes: u64, hole_offset: u64, hole_bytes: u64 },
    /// Part of the range is pinned (freed in this transaction, not reusable before commit).
    #[error("block group {bg_start}: range offset={offset} bytes={bytes} overlaps pinned offset={pinned_offset} bytes={pinned_bytes}")]
    Pinned { bg_start: u64, offset: u64, bytes: u64, pinned_offset: u64, pinned_bytes: u64 },
}

/// `enum btrfs_trim_state`, without TRIMMING (no discard in ubtrfs yet).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TrimState {
    Untrimmed,
    Trimmed,
}

/// The `use_bitmap` hook: when a new free range goes into a bitmap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BitmapPolicy {
    /// The kernel's `use_bitmap`: three rules (size, thresholds, block group size).
    Default,
    /// The kernel's debug "fragment" mode: rules 1 and 2 off, rule 3 kept.
    #[cfg(any(test, feature = "test-hooks"))]
    Fragment,
    /// Self-test policy: a bitmap whenever `free_extents > 0`.
    #[cfg(any(test, feature = "test-hooks"))]
    WhenFreeExtents,
    /// Self-test policy: always a bitmap.
    #[cfg(any(test, feature = "test-hooks"))]
    Always,
    /// Never a bitmap (tests of stealing).
    #[cfg(any(test, feature = "test-hooks"))]
    Never,
}

/// Which of the two entry kinds; the order is the offset index's order at equal offsets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EntryKind {
    Extent,
    Bitmap,
}

/// A snapshot of one cache entry, in offset-index order (see [`FreeSpaceCtl::entries`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EntryInfo {
    pub kind: EntryKind,
    pub offset: u64,
    /// Free bytes in the entry.
    pub bytes: u64,
    /// Bitmaps: longest free run when known, else 0. Extents: 0.
    pub max_extent_size: u64,
    /// Bitmaps: number of runs of set bits. Extents: 0.
    pub bitmap_extents: u32,
    pub trim_state: TrimState,
}

/// Result of [`FreeSpaceCtl::alloc`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Alloc {
    /// The range `[start, start + bytes)` was taken out of the cache.
    Found { start: u64, max_extent_size: u64 },
    /// Nothing fits; `max_extent_size` is the largest usable run seen.
    NoSpace { max_extent_size: u64 },
}

/// Summary of one [`FreeSpaceCtl::unpin_all`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg(any(test, feature = "test-hooks"))]
pub struct Unpinned {
    pub ranges: u64,
    pub bytes: u64,
}

/// Backward scan used by the front steal: index of the highest clear bit `<= bit`, or
/// `None` (the kernel's −1) when bits `0..=bit` are all set.
#[doc(hidden)]
pub type FrontScanFn = fn(words: &[u64], bit: usize) -> Option<usize>;

/// Bytes-index key: size descending, then insertion sequence (later after earlier).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct IndexKey {
    size: Reverse<u64>,
    seq: u64,
}

type Ref = (u64, EntryKind);

#[derive(Debug)]
struct ExtentEntry {
    bytes: u64,
    trim: TrimState,
    key: IndexKey,
}

#[derive(Debug)]
struct BitmapEntry {
    bytes: u64,
    max_extent_size: u64,
    bitmap_extents: u32,
    trim: TrimState,
    key: IndexKey,
    bits: Box<[u64]>,
}

/// An extent entry outside both indexes (the kernel's entry with cleared rb nodes).
#[derive(Clone, Copy, Debug)]
struct Detached {
    offset: u64,
    bytes: u64,
    trim: TrimState,
}

/// The bitmap half of the offset index. A bitmap can only sit at `start + k × span` for
/// `k < max_bitmaps`, so entries live in a slot array (O(1) lookup) and an occupancy
/// bitset answers the ordered neighbour queries of the kernel's rb-tree walks
/// (`rb_next`/`rb_prev` across kinds) in O(max_bitmaps / 64). Bounded by `max_bitmaps`.
#[derive(Debug)]
struct BitmapSlots {
    start: u64,
    span: u64,
    slots: Vec<Option<BitmapEntry>>,
    occupied: Vec<u64>,
    len: usize,
}

impl BitmapSlots {
    fn new(start: u64, span: u64, max_bitmaps: u64) -> BitmapSlots {
        let n = usize::try_from(max_bitmaps).expect("max_bitmaps fits in memory");
        BitmapSlots {
            start,
            span,
            slots: std::iter::repeat_with(|| None).take(n).collect(),
            occupied: vec![0; n.div_ceil(64)],
            len: 0,
        }
    }

    /// The slot of a bitmap at exactly `offset`, if `offset` is a bitmap position.
    fn slot(&self, offset: u64) -> Option<usize> {
        let d = offset.checked_sub(self.start)?;
        if d % self.span != 0 {
            return None;
        }
        usize::try_from(d / self.span).ok().filter(|&k| k < self.slots.len())
    }

    fn offset_of(&self, k: usize) -> u64 {
        self.start + k as u64 * self.span
    }

    fn get(&self, offset: &u64) -> Option<&BitmapEntry> {
        self.slot(*offset).and_then(|k| self.slots[k].as_ref())
    }

    fn get_mut(&mut self, offset: &u64) -> Option<&mut BitmapEntry> {
        let k = self.slot(*offset)?;
        self.slots[k].as_mut()
    }

    fn contains_key(&self, offset: &u64) -> bool {
        self.get(offset).is_some()
    }

    fn insert(&mut self, offset: u64, entry: BitmapEntry) -> Option<BitmapEntry> {
        let k = self
            .slot(offset)
            .unwrap_or_else(|| panic!("bitmap offset={offset} is not a bitmap position"));
        let old = self.slots[k].replace(entry);
        if old.is_none() {
            self.occupied[k / 64] |= 1 << (k % 64);
            self.len += 1;
        }
        old
    }

    fn remove(&mut self, offset: &u64) -> Option<BitmapEntry> {
        let k = self.slot(*offset)?;
        let old = self.slots[k].take();
        if old.is_some() {
            self.occupied[k / 64] &= !(1 << (k % 64));
            self.len -= 1;
        }
        old
    }

    fn len(&self) -> usize {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[cfg(any(test, feature = "test-hooks"))]
    fn clear(&mut self) {
        self.slots.iter_mut().for_each(|s| *s = None);
        self.occupied.fill(0);
        self.len = 0;
    }

    fn iter(&self) -> impl Iterator<Item = (u64, &BitmapEntry)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(k, s)| s.as_ref().map(|b| (self.offset_of(k), b)))
    }

    /// Lowest bitmap offset `>= x`.
    fn first_ge(&self, x: u64) -> Option<u64> {
        let from = match x.checked_sub(self.start) {
            None => 0,
            Some(d) => usize::try_from(d.div_ceil(self.span)).ok()?,
        };
        let n = self.slots.len();
        let k = find_next_set_bit(&self.occupied, n, from);
        (k < n).then(|| self.offset_of(k))
    }

    /// Lowest bitmap offset `> x`.
    fn first_gt(&self, x: u64) -> Option<u64> {
        self.first_ge(x.checked_add(1)?)
    }

    /// Highest bitmap offset `<= x`.
    fn last_le(&self, x: u64) -> Option<u64> {
        let d = x.checked_sub(self.start)?;
        let k = usize::try_from(d / self.span)
            .unwrap_or(usize::MAX)
            .min(self.slots.len().checked_sub(1)?);
        find_last_set_bit_upto(&self.occupied, k).map(|k| self.offset_of(k))
    }

    /// Highest bitmap offset `< x`.
    fn last_lt(&self, x: u64) -> Option<u64> {
        self.last_le(x.checked_sub(1)?)
    }

    fn first(&self) -> Option<u64> {
        self.first_ge(self.start)
    }
}

impl std::ops::Index<&u64> for BitmapSlots {
    type Output = BitmapEntry;
    fn index(&self, offset: &u64) -> &BitmapEntry {
        self.get(offset).unwrap_or_else(|| panic!("no bitmap entry at offset={offset}"))
    }
}

/// The free-space cache of one block group (`struct btrfs_free_space_ctl`).
pub struct FreeSpaceCtl {
    /// Block group start (`ctl->start`).
    start: u64,
    length: u64,
    /// Sectorsize (`ctl->unit`).
    unit: u64,
    bits_per_bitmap: u64,
    /// `bits_per_bitmap × unit`.
    bitmap_span: u64,
    /// Alignment of allocations (`block_group->full_stripe_len`; the sectorsize unless
    /// RAID5/6).
    full_stripe_len: u64,
    extents: BTreeMap<u64, ExtentEntry>,
    bitmaps: BitmapSlots,
    bytes_index: BTreeMap<IndexKey, Ref>,
    next_seq: u64,
    free_space: u64,
    free_extents: u64,
    total_bitmaps: u64,
    extents_thresh: u64,
    /// Whether `recalculate_thresholds` has run (else `extents_thresh` is the initial 157).
    thresholds_recalculated: bool,
    policy: BitmapPolicy,
    /// Pinned ranges, start → end, coalesced like EXTENT_DIRTY in `pinned_extents`.
    pinned: BTreeMap<u64, u64>,
    pinned_bytes: u64,
    debug_checks: bool,
    /// Internal restarts of `remove_free_space` (the kernel's EAGAIN), for tests.
    remove_restarts: u64,
    front_scan_override: Option<FrontScanFn>,
    front_steal_probe: Option<Vec<u32>>,
}

impl std::fmt::Debug for FreeSpaceCtl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FreeSpaceCtl")
            .field("start", &self.start)
            .field("length", &self.length)
            .field("unit", &self.unit)
            .field("bits_per_bitmap", &self.bits_per_bitmap)
            .field("free_space", &self.free_space)
            .field("free_extents", &self.free_extents)
            .field("total_bitmaps", &self.total_bitmaps)
            .field("extents_thresh", &self.extents_thresh)
            .field("pinned_bytes", &self.pinned_bytes)
            .finish_non_exhaustive()
    }
}

impl FreeSpaceCtl {
    /// Create the empty cache of the block group `[start, start + length)`
    /// (`btrfs_init_free_space_ctl`).
    ///
    /// # Errors
    /// [`FreeSpaceError::Geometry`] when `unit` is not a power of two, `bits_per_bitmap` is
    /// not a positive multiple of 64, or the group is empty, unaligned or overflows.
    pub fn new(
        start: u64,
        length: u64,
        unit: u32,
        bits_per_bitmap: u32,
    ) -> Result<FreeSpaceCtl, FreeSpaceError> {
        let bad = |reason: String| FreeSpaceError::Geometry { bg_start: start, reason };
        let unit = u64::from(unit);
        let bits = u64::from(bits_per_bitmap);
        if unit == 0 || !unit.is_power_of_two() {
            return Err(bad(format!("sectorsize {unit} is not a power of two")));
        }
        if bits == 0 || bits % 64 != 0 {
            return Err(bad(format!("bits_per_bitmap {bits} is not a positive multiple of 64")));
        }
        if length == 0 || start & (unit - 1) != 0 || length & (unit - 1) != 0 {
            return Err(bad(format!(
                "start {start} length {length} not a non-empty multiple of sectorsize {unit}"
            )));
        }
        if start.checked_add(length).is_none() {
            return Err(bad(format!("start {start} + length {length} overflows")));
        }
        let Some(bitmap_span) = bits.checked_mul(unit) else {
            return Err(bad(format!("bitmap span {bits} x {unit} overflows")));
        };
        if length.div_ceil(bitmap_span) > MAX_BITMAP_SLOTS {
            return Err(bad(format!(
                "length {length} needs more than {MAX_BITMAP_SLOTS} bitmaps of {bitmap_span} bytes"
            )));
        }
        Ok(FreeSpaceCtl {
            start,
            length,
            unit,
            bits_per_bitmap: bits,
            bitmap_span,
            full_stripe_len: unit,
            extents: BTreeMap::new(),
            bitmaps: BitmapSlots::new(start, bitmap_span, max(1, length.div_ceil(bitmap_span))),
            bytes_index: BTreeMap::new(),
            next_seq: 0,
            free_space: 0,
            free_extents: 0,
            total_bitmaps: 0,
            extents_thresh: INITIAL_EXTENTS_THRESH,
            thresholds_recalculated: false,
            policy: BitmapPolicy::Default,
            pinned: BTreeMap::new(),
            pinned_bytes: 0,
            debug_checks: cfg!(debug_assertions),
            remove_restarts: 0,
            front_scan_override: None,
            front_steal_probe: None,
        })
    }

    pub fn start(&self) -> u64 {
        self.start
    }
    pub fn length(&self) -> u64 {
        self.length
    }
    /// Sectorsize (`ctl->unit`).
    pub fn unit(&self) -> u64 {
        self.unit
    }
    pub fn bits_per_bitmap(&self) -> u64 {
        self.bits_per_bitmap
    }
    /// Total free bytes in the cache (`ctl->free_space`).
    pub fn free_space(&self) -> u64 {
        self.free_space
    }
    /// Extent entries plus bitmap entries (`ctl->free_extents`).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn free_extents(&self) -> u64 {
        self.free_extents
    }
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn total_bitmaps(&self) -> u64 {
        self.total_bitmaps
    }
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn extents_thresh(&self) -> u64 {
        self.extents_thresh
    }
    /// Bitmap positions in the group: `max(1, ceil(length / span))`.
    pub fn max_bitmaps(&self) -> u64 {
        max(1, self.length.div_ceil(self.bitmap_span))
    }
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned_bytes
    }
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn policy(&self) -> BitmapPolicy {
        self.policy
    }
    /// Replace the `use_bitmap` hook (the self-tests swap `ctl->op`).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn set_policy(&mut self, policy: BitmapPolicy) {
        self.policy = policy;
    }
    /// Set the allocation alignment (`full_stripe_len`); it must be a multiple of the
    /// sectorsize, other values are ignored.
    pub fn set_full_stripe_len(&mut self, len: u64) {
        if len != 0 && self.aligned(len) {
            self.full_stripe_len = len;
        }
    }
    /// Turn the `check_invariants` run after every mutation on or off (on by default in
    /// debug builds; long-running tests may check at their own checkpoints instead).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn set_debug_checks(&mut self, on: bool) {
        self.debug_checks = on;
    }

    /// Replace the front-steal scan. Only the front-steal benchmark uses this, to measure
    /// the kernel's old forward walk; production code always runs the word scan.
    #[doc(hidden)]
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn set_front_scan_override(&mut self, scan: Option<FrontScanFn>) {
        self.front_scan_override = scan;
    }

    /// Record the wall time of every `steal_from_bitmap_to_front` call (benchmark only).
    #[doc(hidden)]
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn set_front_steal_probe(&mut self, on: bool) {
        self.front_steal_probe = on.then(Vec::new);
    }

    /// Take the recorded front-steal times, in nanoseconds.
    #[doc(hidden)]
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn take_front_steal_times(&mut self) -> Vec<u32> {
        self.front_steal_probe.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Start of the bitmap span holding `offset` (`offset_to_bitmap`); `offset` must not
    /// be below the group start.
    pub fn offset_to_bitmap(&self, offset: u64) -> u64 {
        debug_assert!(offset >= self.start, "offset={offset} start={}", self.start);
        self.start + (offset - self.start) / self.bitmap_span * self.bitmap_span
    }

    // ---------------------------------------------------------------- public operations

    /// Return `[offset, offset + bytes)` to the cache as untrimmed free space
    /// (`btrfs_add_free_space` → `__btrfs_add_free_space`).
    ///
    /// # Errors
    /// Empty, unaligned or out-of-group ranges, space already free (EEXIST) or pinned.
    pub fn add_free_space(&mut self, offset: u64, bytes: u64) -> Result<(), FreeSpaceError> {
        self.add_free_space_with_trim(offset, bytes, TrimState::Untrimmed)
    }

    /// Return a range with an explicit trim state (`__btrfs_add_free_space`).
    ///
    /// # Errors
    /// As [`FreeSpaceCtl::add_free_space`].
    pub fn add_free_space_with_trim(
        &mut self,
        offset: u64,
        bytes: u64,
        trim: TrimState,
    ) -> Result<(), FreeSpaceError> {
        let end = self.check_range(offset, bytes)?;
        self.check_not_free(offset, end)?;
        self.check_not_pinned(offset, end)?;
        self.add_inner(offset, bytes, trim);
        self.debug_check();
        Ok(())
    }

    /// Take `[offset, offset + bytes)` out of the cache (`btrfs_remove_free_space`).
    /// Zero bytes is a no-op, as in the kernel.
    ///
    /// # Errors
    /// Unaligned or out-of-group ranges, or any part of the range not free.
    pub fn remove_free_space(&mut self, offset: u64, bytes: u64) -> Result<(), FreeSpaceError> {
        if bytes == 0 {
            return Ok(());
        }
        let end = self.check_range(offset, bytes)?;
        if let Some((hole_offset, hole_bytes)) = self.first_gap_in(offset, end) {
            return Err(FreeSpaceError::NotFree {
                bg_start: self.start,
                offset,
                bytes,
                hole_offset,
                hole_bytes,
            });
        }
        self.remove_inner(offset, bytes);
        self.debug_check();
        Ok(())
    }

    /// Allocate `bytes` (`btrfs_find_space_for_alloc`): find an entry with a run of at least
    /// `bytes + empty_size`, take `bytes` from its start out of the cache and return
    /// `(start, max_extent_size)`, or `(0, max_extent_size)` when nothing fits.
    /// `offset == start()` walks the bytes index (largest first), any other `offset` walks
    /// the offset index from that offset's bitmap span (clamped into the group).
    /// A request of 0 bytes, or not a multiple of the sectorsize, finds nothing.
    ///
    /// A group starting at 0 cannot tell "allocated at 0" from "no space" here, as in the
    /// kernel; [`FreeSpaceCtl::alloc`] returns the answer as a type.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn find_space_for_alloc(&mut self, offset: u64, bytes: u64, empty_size: u64) -> (u64, u64) {
        match self.alloc(offset, bytes, empty_size) {
            Alloc::Found { start, max_extent_size } => (start, max_extent_size),
            Alloc::NoSpace { max_extent_size } => (0, max_extent_size),
        }
    }

    /// [`FreeSpaceCtl::find_space_for_alloc`] with the outcome as a type.
    pub fn alloc(&mut self, offset: u64, bytes: u64, empty_size: u64) -> Alloc {
        let Some(bytes_search) = bytes.checked_add(empty_size) else {
            return Alloc::NoSpace { max_extent_size: 0 };
        };
        if bytes == 0 || !self.aligned(bytes) || !self.aligned(empty_size) {
            return Alloc::NoSpace { max_extent_size: 0 };
        }
        let use_bytes_index = offset == self.start;
        let hint = offset.clamp(self.start, self.start + self.length - 1);
        let mut max_extent_size = 0;
        let found = self.find_free_space(hint, bytes_search, use_bytes_index, &mut max_extent_size);
        let Some((entry, start)) = found else {
            self.debug_check();
            return Alloc::NoSpace { max_extent_size };
        };
        match entry.1 {
            EntryKind::Bitmap => {
                self.bitmap_clear_bits(entry.0, start, bytes);
                self.free_bitmap_if_empty(entry.0);
            }
            EntryKind::Extent => {
                let mut e = self.unlink_extent(entry.0);
                let gap = e.offset;
                let gap_len = start - e.offset;
                assert!(
                    e.bytes >= bytes + gap_len,
                    "alloc: entry offset={} bytes={} too small for start={start} bytes={bytes}",
                    e.offset,
                    e.bytes
                );
                e.offset = start + bytes;
                e.bytes -= bytes + gap_len;
                if e.bytes > 0 {
                    self.link_extent(e);
                }
                if gap_len > 0 {
                    self.add_inner(gap, gap_len, e.trim);
                }
            }
        }
        self.debug_check();
        Alloc::Found { start, max_extent_size }
    }

    /// Record `[offset, offset + bytes)` as freed in the running transaction: it must not
    /// be reused before commit (`btrfs_pin_extent`). Adjacent pinned ranges coalesce.
    ///
    /// # Errors
    /// Empty, unaligned or out-of-group ranges, free space, or space already pinned.
    pub fn pin(&mut self, offset: u64, bytes: u64) -> Result<(), FreeSpaceError> {
        let end = self.check_range(offset, bytes)?;
        self.check_not_free(offset, end)?;
        self.check_not_pinned(offset, end)?;
        let mut new_start = offset;
        let mut new_end = end;
        if let Some((&s, &e)) = self.pinned.range(..offset).next_back() {
            if e == offset {
                self.pinned.remove(&s);
                new_start = s;
            }
        }
        if let Some(e) = self.pinned.remove(&end) {
            new_end = e;
        }
        self.pinned.insert(new_start, new_end);
        self.pinned_bytes += bytes;
        self.debug_check();
        Ok(())
    }

    /// Return every pinned range to the cache, lowest first, as the commit does
    /// (`btrfs_finish_extent_commit` → `unpin_extent_range` → `__btrfs_add_free_space`).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn unpin_all(&mut self) -> Unpinned {
        let pinned = std::mem::take(&mut self.pinned);
        self.pinned_bytes = 0;
        let mut done = Unpinned::default();
        for (start, end) in pinned {
            self.add_inner(start, end - start, TrimState::Untrimmed);
            done.ranges += 1;
            done.bytes += end - start;
            self.debug_check();
        }
        done
    }

    /// Take the pinned ranges out without making them free: from now on they are
    /// neither free nor pinned here (as allocated space is) until the caller gives them
    /// back with `add_free_space`, once their commit is on disk and no reader needs
    /// them (the kernel's per-transaction `pinned_extents`, unpinned after the commit).
    pub fn take_pinned(&mut self) -> Vec<(u64, u64)> {
        let pinned = std::mem::take(&mut self.pinned);
        self.pinned_bytes = 0;
        self.debug_check();
        pinned.into_iter().map(|(s, e)| (s, e - s)).collect()
    }

    /// Pinned ranges as `(offset, bytes)`, lowest first.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn pinned_ranges(&self) -> Vec<(u64, u64)> {
        self.pinned.iter().map(|(&s, &e)| (s, e - s)).collect()
    }

    /// Drop every entry (`__btrfs_remove_free_space_cache`); pinned ranges stay.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn remove_free_space_cache(&mut self) {
        self.extents.clear();
        self.bitmaps.clear();
        self.bytes_index.clear();
        self.free_space = 0;
        self.free_extents = 0;
        self.total_bitmaps = 0;
        if self.thresholds_recalculated {
            self.recalculate_thresholds();
        }
        self.debug_check();
    }

    // ---------------------------------------------------------------- queries

    /// Whether every byte of `[offset, offset + bytes)` is free (false for invalid ranges).
    pub fn is_free(&self, offset: u64, bytes: u64) -> bool {
        match self.check_range(offset, bytes) {
            Ok(end) => self.first_gap_in(offset, end).is_none(),
            Err(_) => false,
        }
    }

    /// Whether any byte of `[offset, offset + bytes)` is free (the self-tests' `exists`,
    /// exact rather than the kernel helper's approximation).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn any_free(&self, offset: u64, bytes: u64) -> bool {
        let lo = max(offset, self.start);
        let hi = min(offset.saturating_add(bytes), self.start + self.length);
        lo < hi && self.first_free_in(lo, hi).is_some()
    }

    /// All free space as coalesced `(offset, bytes)` ranges, lowest first.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn free_ranges(&self) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> =
            self.extents.iter().map(|(&o, e)| (o, o + e.bytes)).collect();
        for (bo, bm) in self.bitmaps.iter() {
            let n = self.bits_per_bitmap as usize;
            let mut i = find_next_set_bit(&bm.bits, n, 0);
            while i < n {
                let j = find_next_zero_bit(&bm.bits, n, i);
                runs.push((bo + i as u64 * self.unit, bo + j as u64 * self.unit));
                i = find_next_set_bit(&bm.bits, n, j);
            }
        }
        runs.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(runs.len());
        for (s, e) in runs {
            match out.last_mut() {
                Some(last) if last.0 + last.1 == s => last.1 += e - s,
                _ => out.push((s, e - s)),
            }
        }
        out
    }

    /// Every entry in offset-index order.
    pub fn entries(&self) -> Vec<EntryInfo> {
        let mut out = Vec::with_capacity(self.extents.len() + self.bitmaps.len());
        let mut cur = self.first_ref();
        while let Some(r) = cur {
            out.push(self.entry_info(r));
            cur = self.next_ref(r);
        }
        out
    }

    /// Entries in bytes-index order (largest first), as `(offset, kind)`.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn bytes_index_order(&self) -> Vec<(u64, EntryKind)> {
        self.bytes_index.values().copied().collect()
    }

    /// The set bits of the bitmap entry at `offset`, as words (bit b of word w is
    /// sector `offset + (64w + b) × unit`).
    pub fn bitmap_words(&self, offset: u64) -> Option<&[u64]> {
        self.bitmaps.get(&offset).map(|b| &b.bits[..])
    }

    /// Check every invariant listed in the module docs.
    ///
    /// # Panics
    /// On the first violated invariant, naming the entry and the operands (a bug).
    pub fn check_invariants(&self) {
        let end = self.start + self.length;
        let n = self.bits_per_bitmap as usize;
        let mut sum = 0u64;
        let mut prev_end: Option<u64> = None;
        for (&o, e) in &self.extents {
            assert!(e.bytes > 0, "extent entry offset={o} is empty");
            assert!(
                o % self.unit == 0 && e.bytes % self.unit == 0,
                "extent entry offset={o} bytes={} unaligned",
                e.bytes
            );
            assert!(o >= self.start, "extent entry offset={o} below group start {}", self.start);
            assert!(
                o + e.bytes <= end,
                "extent entry offset={o} bytes={} past group end {end}",
                e.bytes
            );
            if let Some(pe) = prev_end {
                assert!(pe <= o, "extent entry offset={o} overlaps previous ending at {pe}");
            }
            prev_end = Some(o + e.bytes);
            if let Some((lo, hi)) = self.first_bitmap_bit_in(o, o + e.bytes) {
                panic!(
                    "extent entry offset={o} bytes={} also in a bitmap at [{lo}, {hi})",
                    e.bytes
                );
            }
            self.check_key((o, EntryKind::Extent), e.key, e.bytes);
            sum += e.bytes;
        }
        for (bo, b) in self.bitmaps.iter() {
            assert_eq!(
                bo,
                self.offset_to_bitmap(bo),
                "bitmap offset={bo} not at a bitmap position"
            );
            assert!(
                bo >= self.start && bo < end,
                "bitmap offset={bo} outside group [{}, {end})",
                self.start
            );
            assert_eq!(b.bits.len() * 64, n, "bitmap offset={bo} has the wrong size");
            let pop: u64 = b.bits.iter().map(|w| u64::from(w.count_ones())).sum();
            assert_eq!(pop * self.unit, b.bytes, "bitmap offset={bo}: bytes != popcount x unit");
            assert!(b.bytes > 0, "bitmap offset={bo} is empty");
            let bits_in_group = ((end - bo) / self.unit).min(n as u64) as usize;
            assert!(
                find_next_set_bit(&b.bits, n, bits_in_group) >= n,
                "bitmap offset={bo} has free bits past group end {end}"
            );
            let (runs, longest) = bitmap_runs(&b.bits, n);
            assert_eq!(runs, u64::from(b.bitmap_extents), "bitmap offset={bo}: bitmap_extents");
            assert!(
                b.max_extent_size == 0 || b.max_extent_size >= longest * self.unit,
                "bitmap offset={bo}: max_extent_size {} below longest run {}",
                b.max_extent_size,
                longest * self.unit
            );
            self.check_key((bo, EntryKind::Bitmap), b.key, get_max_extent_size_bitmap(b));
            sum += b.bytes;
        }
        assert_eq!(sum, self.free_space, "free_space != sum of entries");
        let count = (self.extents.len() + self.bitmaps.len()) as u64;
        assert_eq!(count, self.free_extents, "free_extents != number of entries");
        assert_eq!(self.bitmaps.len() as u64, self.total_bitmaps, "total_bitmaps");
        assert!(
            self.total_bitmaps <= self.max_bitmaps(),
            "total_bitmaps {} > max_bitmaps {}",
            self.total_bitmaps,
            self.max_bitmaps()
        );
        assert_eq!(self.bytes_index.len() as u64, count, "bytes index size");
        let want_thresh = if self.thresholds_recalculated {
            self.thresholds_for(self.total_bitmaps)
        } else {
            INITIAL_EXTENTS_THRESH
        };
        assert_eq!(self.extents_thresh, want_thresh, "extents_thresh");
        let mut pinned_sum = 0;
        let mut prev_pin_end: Option<u64> = None;
        for (&s, &e) in &self.pinned {
            assert!(s < e && s >= self.start && e <= end, "pinned [{s}, {e}) outside group");
            if let Some(pe) = prev_pin_end {
                assert!(pe < s, "pinned [{s}, {e}) overlaps or touches previous ending at {pe}");
            }
            prev_pin_end = Some(e);
            if let Some((fo, fb)) = self.first_free_in(s, e) {
                panic!("pinned [{s}, {e}) overlaps free offset={fo} bytes={fb}");
            }
            pinned_sum += e - s;
        }
        assert_eq!(pinned_sum, self.pinned_bytes, "pinned_bytes");
    }

    fn check_key(&self, r: Ref, key: IndexKey, size: u64) {
        assert_eq!(key.size.0, size, "entry {r:?}: bytes-index key is stale");
        assert!(key.seq < self.next_seq, "entry {r:?}: bytes-index seq from the future");
        assert_eq!(self.bytes_index.get(&key), Some(&r), "entry {r:?} missing from bytes index");
    }

    fn debug_check(&self) {
        if self.debug_checks {
            self.check_invariants();
        }
    }

    // ---------------------------------------------------------------- validation

    /// Whether `x` is a multiple of the sectorsize (a power of two, checked by `new`).
    fn aligned(&self, x: u64) -> bool {
        x & (self.unit - 1) == 0
    }

    fn check_range(&self, offset: u64, bytes: u64) -> Result<u64, FreeSpaceError> {
        if bytes == 0 {
            return Err(FreeSpaceError::Empty { bg_start: self.start, offset });
        }
        if !self.aligned(offset) || !self.aligned(bytes) {
            return Err(FreeSpaceError::Unaligned {
                bg_start: self.start,
                offset,
                bytes,
                unit: self.unit,
            });
        }
        match offset.checked_add(bytes) {
            Some(end) if offset >= self.start && end <= self.start + self.length => Ok(end),
            _ => Err(FreeSpaceError::OutOfRange {
                bg_start: self.start,
                bg_length: self.length,
                offset,
                bytes,
            }),
        }
    }

    fn check_not_free(&self, offset: u64, end: u64) -> Result<(), FreeSpaceError> {
        // Fast path (every pin and add): the last extent starting before `end`, and the
        // bitmaps' bits. The lowest overlap is only worked out for the error.
        let extent_overlaps =
            matches!(self.extents.range(..end).next_back(), Some((&o, e)) if o + e.bytes > offset);
        if !extent_overlaps && self.first_bitmap_bit_in(offset, end).is_none() {
            return Ok(());
        }
        match self.first_free_in(offset, end) {
            None => Ok(()),
            Some((free_offset, free_bytes)) => Err(FreeSpaceError::AlreadyFree {
                bg_start: self.start,
                offset,
                bytes: end - offset,
                free_offset,
                free_bytes,
            }),
        }
    }

    fn check_not_pinned(&self, offset: u64, end: u64) -> Result<(), FreeSpaceError> {
        match self.pinned.range(..end).next_back() {
            Some((&s, &e)) if e > offset => Err(FreeSpaceError::Pinned {
                bg_start: self.start,
                offset,
                bytes: end - offset,
                pinned_offset: s,
                pinned_bytes: e - s,
            }),
            _ => Ok(()),
        }
    }

    /// The lowest free run overlapping `[offset, end)`, clipped to it (and, for bitmaps, to
    /// the bitmap's span).
    fn first_free_in(&self, offset: u64, end: u64) -> Option<(u64, u64)> {
        let mut best: Option<(u64, u64)> = None;
        if let Some((&o, e)) = self.extents.range(..=offset).next_back() {
            if o + e.bytes > offset {
                best = Some((offset, min(o + e.bytes, end) - offset));
            }
        }
        if best.is_none() {
            if let Some((&o, e)) = self.extents.range((Excluded(offset), Excluded(end))).next() {
                best = Some((o, min(o + e.bytes, end) - o));
            }
        }
        if let Some((lo, hi)) = self.first_bitmap_bit_in(offset, best.map_or(end, |b| b.0)) {
            return Some((lo, hi - lo));
        }
        best
    }

    /// The first run of set bitmap bits inside `[offset, end)`, as `[lo, hi)` clipped to the
    /// range and to one bitmap.
    fn first_bitmap_bit_in(&self, offset: u64, end: u64) -> Option<(u64, u64)> {
        if offset >= end {
            return None;
        }
        let n = self.bits_per_bitmap as usize;
        let first = self.offset_to_bitmap(offset);
        let mut next = self.bitmaps.first_ge(first);
        while let Some(bo) = next.filter(|&bo| bo < end) {
            next = self.bitmaps.first_gt(bo);
            let bm = &self.bitmaps[&bo];
            let lo = max(offset, bo);
            let hi = min(end, bo + self.bitmap_span);
            let limit = ((hi - bo) / self.unit) as usize;
            let i = find_next_set_bit(&bm.bits, n, ((lo - bo) / self.unit) as usize);
            if i < limit {
                let j = min(find_next_zero_bit(&bm.bits, n, i), limit);
                return Some((bo + i as u64 * self.unit, bo + j as u64 * self.unit));
            }
        }
        None
    }

    /// The lowest non-free part of `[offset, end)`, as `(offset, bytes)`.
    fn first_gap_in(&self, offset: u64, end: u64) -> Option<(u64, u64)> {
        let n = self.bits_per_bitmap as usize;
        let mut pos = offset;
        while pos < end {
            if let Some(e_end) = self.extent_containing(pos).map(|(o, b)| o + b) {
                pos = e_end;
                continue;
            }
            let bo = self.offset_to_bitmap(pos);
            if let Some(bm) = self.bitmaps.get(&bo) {
                let i = ((pos - bo) / self.unit) as usize;
                if test_bit(&bm.bits, i) {
                    pos = bo + find_next_zero_bit(&bm.bits, n, i) as u64 * self.unit;
                    continue;
                }
            }
            let gap_end = self.first_free_in(pos, end).map_or(end, |(s, _)| s);
            return Some((pos, gap_end - pos));
        }
        None
    }

    fn extent_containing(&self, pos: u64) -> Option<(u64, u64)> {
        match self.extents.range(..=pos).next_back() {
            Some((&o, e)) if o + e.bytes > pos => Some((o, e.bytes)),
            _ => None,
        }
    }

    // ---------------------------------------------------------------- offset index

    fn first_ref(&self) -> Option<Ref> {
        let e = self.extents.keys().next().map(|&o| (o, EntryKind::Extent));
        let b = self.bitmaps.first().map(|o| (o, EntryKind::Bitmap));
        min_ref(e, b)
    }

    /// `rb_next` in the offset index.
    fn next_ref(&self, r: Ref) -> Option<Ref> {
        let e = self.extents.range((Excluded(r.0), Unbounded)).next();
        let b = match r.1 {
            EntryKind::Extent => self.bitmaps.first_ge(r.0),
            EntryKind::Bitmap => self.bitmaps.first_gt(r.0),
        };
        min_ref(e.map(|(&o, _)| (o, EntryKind::Extent)), b.map(|o| (o, EntryKind::Bitmap)))
    }

    /// `rb_prev` in the offset index.
    fn prev_ref(&self, r: Ref) -> Option<Ref> {
        let e = match r.1 {
            EntryKind::Extent => self.extents.range(..r.0).next_back(),
            EntryKind::Bitmap => self.extents.range(..=r.0).next_back(),
        };
        let b = self.bitmaps.last_lt(r.0);
        max(e.map(|(&o, _)| (o, EntryKind::Extent)), b.map(|o| (o, EntryKind::Bitmap)))
    }

    fn ref_end(&self, r: Ref) -> u64 {
        match r.1 {
            EntryKind::Extent => r.0 + self.extents[&r.0].bytes,
            EntryKind::Bitmap => r.0 + self.bitmap_span,
        }
    }

    fn ref_bytes(&self, r: Ref) -> u64 {
        match r.1 {
            EntryKind::Extent => self.extents[&r.0].bytes,
            EntryKind::Bitmap => self.bitmaps[&r.0].bytes,
        }
    }

    /// `get_max_extent_size`: a bitmap's known longest run, else `bytes`.
    fn ref_max_extent_size(&self, r: Ref) -> u64 {
        match r.1 {
            EntryKind::Extent => self.extents[&r.0].bytes,
            EntryKind::Bitmap => get_max_extent_size_bitmap(&self.bitmaps[&r.0]),
        }
    }

    fn entry_info(&self, r: Ref) -> EntryInfo {
        match r.1 {
            EntryKind::Extent => {
                let e = &self.extents[&r.0];
                EntryInfo {
                    kind: r.1,
                    offset: r.0,
                    bytes: e.bytes,
                    max_extent_size: 0,
                    bitmap_extents: 0,
                    trim_state: e.trim,
                }
            }
            EntryKind::Bitmap => {
                let b = &self.bitmaps[&r.0];
                EntryInfo {
                    kind: r.1,
                    offset: r.0,
                    bytes: b.bytes,
                    max_extent_size: b.max_extent_size,
                    bitmap_extents: b.bitmap_extents,
                    trim_state: b.trim,
                }
            }
        }
    }

    /// `tree_search_offset(ctl, offset, bitmap_only = 0, fuzzy)`: the entry holding
    /// `offset` (an extent entry preferred over a bitmap covering it); with `fuzzy`, else
    /// the next entry ending after `offset`.
    fn tree_search_offset(&self, offset: u64, fuzzy: bool) -> Option<Ref> {
        let e = self.extents.range(..=offset).next_back().map(|(&o, _)| (o, EntryKind::Extent));
        if e.is_some_and(|e| e.0 == offset) {
            return e;
        }
        let b = self.bitmaps.last_le(offset).map(|o| (o, EntryKind::Bitmap));
        // An exact bitmap match, or else the last entry before offset.
        let entry = match max(e, b) {
            Some(r) => r,
            None => return if fuzzy { self.first_ref() } else { None },
        };
        if entry.1 == EntryKind::Bitmap {
            if let Some(p) = self.prev_ref(entry) {
                if p.1 == EntryKind::Extent && self.ref_end(p) > offset {
                    return Some(p);
                }
            }
        }
        if self.ref_end(entry) > offset {
            return Some(entry);
        }
        if !fuzzy {
            return None;
        }
        let mut cur = entry;
        loop {
            cur = self.next_ref(cur)?;
            if self.ref_end(cur) > offset {
                return Some(cur);
            }
        }
    }

    // ---------------------------------------------------------------- linking

    fn new_key(&mut self, size: u64) -> IndexKey {
        let key = IndexKey { size: Reverse(size), seq: self.next_seq };
        self.next_seq += 1;
        key
    }

    /// `link_free_space` for an extent entry.
    fn link_extent(&mut self, info: Detached) {
        assert!(info.bytes > 0, "link of empty extent entry at offset={}", info.offset);
        let key = self.new_key(info.bytes);
        let old = self
            .extents
            .insert(info.offset, ExtentEntry { bytes: info.bytes, trim: info.trim, key });
        assert!(old.is_none(), "two extent entries at offset={}", info.offset);
        self.bytes_index.insert(key, (info.offset, EntryKind::Extent));
        self.free_space += info.bytes;
        self.free_extents += 1;
    }

    /// `unlink_free_space` for an extent entry.
    fn unlink_extent(&mut self, offset: u64) -> Detached {
        let e = self
            .extents
            .remove(&offset)
            .unwrap_or_else(|| panic!("unlink of missing extent entry at offset={offset}"));
        let removed = self.bytes_index.remove(&e.key);
        assert_eq!(removed, Some((offset, EntryKind::Extent)), "bytes index out of step");
        self.free_space -= e.bytes;
        self.free_extents -= 1;
        Detached { offset, bytes: e.bytes, trim: e.trim }
    }

    /// `relink_bitmap_entry`: move a bitmap in the bytes index after its key changed.
    fn relink_bitmap(&mut self, bo: u64) {
        let bm = self.bitmaps.get(&bo).expect("relink of a bitmap that exists");
        let old = bm.key;
        let size = get_max_extent_size_bitmap(bm);
        let key = self.new_key(size);
        self.bytes_index.remove(&old);
        self.bytes_index.insert(key, (bo, EntryKind::Bitmap));
        if let Some(bm) = self.bitmaps.get_mut(&bo) {
            bm.key = key;
        }
    }

    /// `add_new_bitmap`: an empty bitmap entry at `offset_to_bitmap(offset)`.
    fn add_new_bitmap(&mut self, offset: u64) -> u64 {
        let bo = self.offset_to_bitmap(offset);
        let key = self.new_key(0);
        let words = (self.bits_per_bitmap / 64) as usize;
        let bm = BitmapEntry {
            bytes: 0,
            max_extent_size: 0,
            bitmap_extents: 0,
            trim: TrimState::Trimmed,
            key,
            bits: vec![0u64; words].into_boxed_slice(),
        };
        let old = self.bitmaps.insert(bo, bm);
        assert!(old.is_none(), "two bitmap entries at offset={bo}");
        self.bytes_index.insert(key, (bo, EntryKind::Bitmap));
        self.free_extents += 1;
        self.total_bitmaps += 1;
        self.recalculate_thresholds();
        bo
    }

    /// `free_bitmap` when the bitmap has no free bits left.
    fn free_bitmap_if_empty(&mut self, bo: u64) {
        if self.bitmaps[&bo].bytes != 0 {
            return;
        }
        let bm = self.bitmaps.remove(&bo).expect("bitmap present");
        self.bytes_index.remove(&bm.key);
        self.free_extents -= 1;
        self.total_bitmaps -= 1;
        self.recalculate_thresholds();
    }

    fn thresholds_for(&self, total_bitmaps: u64) -> u64 {
        let max_bytes = if self.length < SZ_1G {
            MAX_CACHE_BYTES_PER_GIG
        } else {
            MAX_CACHE_BYTES_PER_GIG * (self.length / SZ_1G)
        };
        // The kernel charges each bitmap one unit (sectorsize), not one page: a quirk kept
        // so that thresholds match the kernel's.
        let bitmap_bytes = total_bitmaps * self.unit;
        let extent_bytes = min(max_bytes.saturating_sub(bitmap_bytes), max_bytes / 2);
        extent_bytes / FREE_SPACE_ENTRY_SIZE
    }

    /// `recalculate_thresholds`, run when a bitmap is added or freed.
    fn recalculate_thresholds(&mut self) {
        assert!(
            self.total_bitmaps <= self.max_bitmaps(),
            "total_bitmaps {} > max_bitmaps {}",
            self.total_bitmaps,
            self.max_bitmaps()
        );
        self.extents_thresh = self.thresholds_for(self.total_bitmaps);
        self.thresholds_recalculated = true;
    }

    // ---------------------------------------------------------------- bitmap bits

    /// `bitmap_set_bits`.
    fn bitmap_set_bits(&mut self, bo: u64, offset: u64, bytes: u64) {
        let n = self.bits_per_bitmap as usize;
        let start = ((offset - bo) / self.unit) as usize;
        let count = (bytes / self.unit) as usize;
        let end = start + count;
        assert!(end <= n, "set bits [{start}, {end}) past bitmap end {n} at offset={bo}");
        let bm = self.bitmaps.get_mut(&bo).expect("bitmap present");
        set_bits(&mut bm.bits, start, count);
        bm.max_extent_size = 0;
        bm.bytes += bytes;
        let mut delta: i64 = 1;
        if start > 0 && test_bit(&bm.bits, start - 1) {
            delta -= 1;
        }
        if end < n && test_bit(&bm.bits, end) {
            delta -= 1;
        }
        bm.bitmap_extents = (i64::from(bm.bitmap_extents) + delta) as u32;
        self.free_space += bytes;
        self.relink_bitmap(bo);
    }

    /// `bitmap_clear_bits`.
    fn bitmap_clear_bits(&mut self, bo: u64, offset: u64, bytes: u64) {
        let n = self.bits_per_bitmap as usize;
        let unit = self.unit;
        let start = ((offset - bo) / unit) as usize;
        let count = (bytes / unit) as usize;
        let end = start + count;
        assert!(end <= n, "clear bits [{start}, {end}) past bitmap end {n} at offset={bo}");
        let bm = self.bitmaps.get_mut(&bo).expect("bitmap present");
        clear_bits(&mut bm.bits, start, count);
        assert!(bm.bytes >= bytes, "bitmap offset={bo} bytes={} clear {bytes}", bm.bytes);
        bm.bytes -= bytes;
        if bm.max_extent_size > unit {
            bm.max_extent_size = 0;
        }
        let mut delta: i64 = -1;
        if start > 0 && test_bit(&bm.bits, start - 1) {
            delta += 1;
        }
        if end < n && test_bit(&bm.bits, end) {
            delta += 1;
        }
        bm.bitmap_extents = (i64::from(bm.bitmap_extents) + delta) as u32;
        self.free_space -= bytes;
        self.relink_bitmap(bo);
    }

    /// `add_bytes_to_bitmap`: set as much of the range as the bitmap covers.
    fn add_bytes_to_bitmap(&mut self, bo: u64, offset: u64, bytes: u64, trim: TrimState) -> u64 {
        if trim == TrimState::Untrimmed {
            if let Some(bm) = self.bitmaps.get_mut(&bo) {
                bm.trim = TrimState::Untrimmed;
            }
        }
        let to_set = min(bo + self.bitmap_span - offset, bytes);
        self.bitmap_set_bits(bo, offset, to_set);
        to_set
    }

    /// `search_bitmap`: the first run at or after `offset` of at least `bytes` (any run
    /// when `for_alloc` and one sector is asked for). On failure the longest run seen is
    /// recorded as `max_extent_size` and returned as the error.
    fn search_bitmap(
        &mut self,
        bo: u64,
        offset: u64,
        bytes: u64,
        for_alloc: bool,
    ) -> Result<(u64, u64), u64> {
        let n = self.bits_per_bitmap as usize;
        let unit = self.unit;
        let bm = &self.bitmaps[&bo];
        if for_alloc && bm.max_extent_size != 0 && bm.max_extent_size < bytes {
            return Err(bm.max_extent_size);
        }
        let want = (bytes / unit) as usize;
        let mut max_bits = 0usize;
        let mut i = find_next_set_bit(&bm.bits, n, ((max(offset, bo) - bo) / unit) as usize);
        while i < n {
            if for_alloc && want == 1 {
                return Ok((bo + i as u64 * unit, unit));
            }
            let next_zero = find_next_zero_bit(&bm.bits, n, i);
            let run = next_zero - i;
            if run >= want {
                return Ok((bo + i as u64 * unit, run as u64 * unit));
            }
            max_bits = max(max_bits, run);
            i = find_next_set_bit(&bm.bits, n, next_zero);
        }
        let found = max_bits as u64 * unit;
        if let Some(bm) = self.bitmaps.get_mut(&bo) {
            bm.max_extent_size = found;
        }
        self.relink_bitmap(bo);
        Err(found)
    }

    // ---------------------------------------------------------------- adding

    /// `__btrfs_add_free_space` on a validated range.
    fn add_inner(&mut self, offset: u64, bytes: u64, trim: TrimState) {
        let mut info = Detached { offset, bytes, trim };
        if !self.try_merge_free_space(&mut info) && self.insert_into_bitmap(&info) {
            // The whole range went into bitmaps: no stealing on this path.
            return;
        }
        self.steal_from_bitmap(&mut info);
        self.link_extent(info);
    }

    /// `use_bitmap` and the test policies.
    fn use_bitmap(&self, bytes: u64) -> bool {
        let forced = match self.policy {
            #[cfg(any(test, feature = "test-hooks"))]
            BitmapPolicy::Always => return true,
            #[cfg(any(test, feature = "test-hooks"))]
            BitmapPolicy::Never => return false,
            #[cfg(any(test, feature = "test-hooks"))]
            BitmapPolicy::WhenFreeExtents => return self.free_extents > 0,
            BitmapPolicy::Default => false,
            #[cfg(any(test, feature = "test-hooks"))]
            BitmapPolicy::Fragment => true,
        };
        // Rule 1: large ranges stay extents (how big regions leave the bitmaps).
        if !forced && bytes >= FORCE_EXTENT_THRESHOLD {
            return false;
        }
        // Rule 2: below the threshold, extents unless small and the cache is filling.
        if !forced && self.free_extents < self.extents_thresh {
            if bytes > self.unit * 8 {
                return false;
            }
            if self.free_extents * 3 <= self.extents_thresh {
                return false;
            }
        }
        // Rule 3: small block groups never use bitmaps.
        self.bitmap_span / 2 <= self.length
    }

    /// `insert_into_bitmap`: true when the whole range went into bitmaps.
    fn insert_into_bitmap(&mut self, info: &Detached) -> bool {
        if !self.use_bitmap(info.bytes) {
            return false;
        }
        let mut offset = info.offset;
        let mut bytes = info.bytes;
        while bytes > 0 {
            let bo = self.offset_to_bitmap(offset);
            if !self.bitmaps.contains_key(&bo) {
                self.add_new_bitmap(offset);
            }
            let added = self.add_bytes_to_bitmap(bo, offset, bytes, info.trim);
            offset += added;
            bytes -= added;
        }
        true
    }

    /// `try_merge_free_space`: absorb the extent entries directly right and left of `info`.
    /// A trimmed range absorbs only trimmed neighbours; an untrimmed one absorbs any.
    fn try_merge_free_space(&mut self, info: &mut Detached) -> bool {
        let is_trimmed = info.trim == TrimState::Trimmed;
        let right = self.tree_search_offset(info.offset + info.bytes, false);
        let left = match right {
            Some(r) => self.prev_ref(r),
            None => info.offset.checked_sub(1).and_then(|o| self.tree_search_offset(o, false)),
        };
        let mut merged = false;
        if let Some((ro, EntryKind::Extent)) = right {
            let e = &self.extents[&ro];
            assert_eq!(ro, info.offset + info.bytes, "extent entry at {ro} overlaps added range");
            if !is_trimmed || e.trim == TrimState::Trimmed {
                let r = self.unlink_extent(ro);
                info.bytes += r.bytes;
                merged = true;
            }
        }
        if let Some((lo, EntryKind::Extent)) = left {
            let e = &self.extents[&lo];
            if lo + e.bytes == info.offset && (!is_trimmed || e.trim == TrimState::Trimmed) {
                let l = self.unlink_extent(lo);
                info.offset = l.offset;
                info.bytes += l.bytes;
                merged = true;
            }
        }
        merged
    }

    /// `steal_from_bitmap`: pull the free runs adjoining a detached extent entry out of the
    /// bitmaps, so one entry can serve an allocation of the whole run.
    fn steal_from_bitmap(&mut self, info: &mut Detached) {
        if self.total_bitmaps == 0 {
            return;
        }
        let stole_end = self.steal_from_bitmap_to_end(info);
        let mut stole_front = false;
        if self.total_bitmaps > 0 {
            let t0 = self.front_steal_probe.is_some().then(Instant::now);
            stole_front = self.steal_from_bitmap_to_front(info);
            if let (Some(t0), Some(probe)) = (t0, self.front_steal_probe.as_mut()) {
                probe.push(u32::try_from(t0.elapsed().as_nanos()).unwrap_or(u32::MAX));
            }
        }
        if stole_end || stole_front {
            self.try_merge_free_space(info);
        }
    }

    /// `steal_from_bitmap_to_end`: the run of set bits starting at the entry's end, in the
    /// one bitmap covering that end (word-wise next-zero search).
    fn steal_from_bitmap_to_end(&mut self, info: &mut Detached) -> bool {
        let end = info.offset + info.bytes;
        if end >= self.start + self.length {
            return false;
        }
        let bo = self.offset_to_bitmap(end);
        let Some(bm) = self.bitmaps.get(&bo) else {
            return false;
        };
        let n = self.bits_per_bitmap as usize;
        let i = ((end - bo) / self.unit) as usize;
        let j = find_next_zero_bit(&bm.bits, n, i);
        if j == i {
            return false;
        }
        let bytes = (j - i) as u64 * self.unit;
        info.bytes += bytes;
        if bm.trim == TrimState::Untrimmed {
            info.trim = TrimState::Untrimmed;
        }
        self.bitmap_clear_bits(bo, end, bytes);
        self.free_bitmap_if_empty(bo);
        true
    }

    /// `steal_from_bitmap_to_front`: the run of set bits ending just below the entry, found
    /// by scanning backwards a word at a time ([`find_last_clear_bit_upto`]).
    fn steal_from_bitmap_to_front(&mut self, info: &mut Detached) -> bool {
        let mut bo = self.offset_to_bitmap(info.offset);
        if bo == info.offset {
            // On a boundary the run would end in the previous bitmap, if there is one.
            if info.offset == self.start {
                return false;
            }
            bo = self.offset_to_bitmap(info.offset - 1);
        }
        let Some(bm) = self.bitmaps.get(&bo) else {
            return false;
        };
        let i = ((info.offset - bo) / self.unit - 1) as usize;
        let prev_j = match self.front_scan_override {
            None => find_last_clear_bit_upto(&bm.bits, i),
            Some(scan) => scan(&bm.bits, i),
        };
        if prev_j == Some(i) {
            return false;
        }
        let sectors = match prev_j {
            None => i as u64 + 1,
            Some(p) => (i - p) as u64,
        };
        let bytes = sectors * self.unit;
        info.offset -= bytes;
        info.bytes += bytes;
        if bm.trim == TrimState::Untrimmed {
            info.trim = TrimState::Untrimmed;
        }
        self.bitmap_clear_bits(bo, info.offset, bytes);
        self.free_bitmap_if_empty(bo);
        true
    }

    // ---------------------------------------------------------------- removing

    /// `btrfs_remove_free_space` on a range known to be free.
    fn remove_inner(&mut self, mut offset: u64, mut bytes: u64) {
        // Every pass either removes bytes or, after a restart, finds the entry that holds
        // `offset` and removes from it on the next pass.
        let mut passes_without_progress = 0;
        while bytes > 0 {
            let before = bytes;
            if let Some((eo, _)) = self.extent_containing(offset) {
                let mut info = self.unlink_extent(eo);
                if offset == info.offset {
                    let to_free = min(bytes, info.bytes);
                    info.bytes -= to_free;
                    info.offset += to_free;
                    if info.bytes > 0 {
                        self.link_extent(info);
                    }
                    offset += to_free;
                    bytes -= to_free;
                    continue;
                }
                let old_end = info.offset + info.bytes;
                let trim = info.trim;
                info.bytes = offset - info.offset;
                self.link_extent(info);
                if old_end < offset + bytes {
                    bytes -= old_end - offset;
                    offset = old_end;
                    continue;
                }
                if old_end > offset + bytes {
                    self.add_inner(offset + bytes, old_end - (offset + bytes), trim);
                }
                return;
            }
            let bo = self.offset_to_bitmap(offset);
            assert!(
                self.bitmaps.contains_key(&bo),
                "remove_free_space: no entry holds offset={offset} of a free range"
            );
            if self.remove_from_bitmap(bo, &mut offset, &mut bytes) {
                return;
            }
            // The kernel's -EAGAIN: the rest starts in an extent entry or another bitmap.
            self.remove_restarts += 1;
            passes_without_progress = if bytes == before { passes_without_progress + 1 } else { 0 };
            assert!(
                passes_without_progress < 2,
                "remove_free_space: no progress at offset={offset}"
            );
        }
    }

    /// `remove_from_bitmap`: clear the run at `offset`, following into the next bitmaps.
    /// Returns false (the kernel's -EAGAIN) when the rest must be searched for again.
    fn remove_from_bitmap(&mut self, mut bo: u64, offset: &mut u64, bytes: &mut u64) -> bool {
        loop {
            let span_end = bo + self.bitmap_span;
            let found = self.search_bitmap(bo, *offset, self.unit, false);
            let (start, run) = match found {
                Ok((start, run)) if start == *offset => (start, run),
                other => {
                    panic!("remove_from_bitmap: offset={offset} not free in bitmap {bo}: {other:?}")
                }
            };
            let n = min(min(run, *bytes), span_end - start);
            self.bitmap_clear_bits(bo, start, n);
            *offset += n;
            *bytes -= n;
            let next = (*bytes > 0).then(|| self.next_ref((bo, EntryKind::Bitmap)));
            self.free_bitmap_if_empty(bo);
            let Some(next) = next else {
                return true;
            };
            let Some(next) = next else {
                panic!(
                    "remove_from_bitmap: {bytes} bytes left at offset={offset} and no next entry"
                );
            };
            if next.1 == EntryKind::Extent {
                return false;
            }
            match self.search_bitmap(next.0, *offset, self.unit, false) {
                Ok((s, _)) if s == *offset => bo = next.0,
                _ => return false,
            }
        }
    }

    // ---------------------------------------------------------------- allocating

    /// `find_free_space`: the entry and start of a run of at least `bytes`, aligned to
    /// `full_stripe_len`; `max_extent_size` collects the largest usable run seen.
    fn find_free_space(
        &mut self,
        offset: u64,
        bytes: u64,
        use_bytes_index: bool,
        max_extent_size: &mut u64,
    ) -> Option<(Ref, u64)> {
        if self.extents.is_empty() && self.bitmaps.is_empty() {
            return None;
        }
        let align = self.full_stripe_len;
        'again: loop {
            // Cursor: a bytes-index key, or an offset-index entry.
            let mut cur_key: Option<IndexKey> = None;
            let mut cur_ref: Option<Ref> = None;
            if use_bytes_index {
                cur_key = self.bytes_index.keys().next().copied();
            } else {
                let bo = self.offset_to_bitmap(offset);
                cur_ref = Some(self.tree_search_offset(bo, true)?);
            }
            loop {
                let entry = if use_bytes_index {
                    let k = cur_key?;
                    self.bytes_index[&k]
                } else {
                    cur_ref?
                };
                let entry_bytes = self.ref_bytes(entry);
                if entry_bytes < bytes {
                    *max_extent_size = max(*max_extent_size, self.ref_max_extent_size(entry));
                    if use_bytes_index {
                        return None;
                    }
                    cur_ref = self.next_ref(entry);
                    continue;
                }
                let (tmp, align_off) = if bytes >= align {
                    let t = (entry.0 - self.start).div_ceil(align) * align + self.start;
                    (t, t - entry.0)
                } else {
                    (entry.0, 0)
                };
                if entry_bytes < bytes + align_off {
                    *max_extent_size = max(*max_extent_size, self.ref_max_extent_size(entry));
                    self.advance(use_bytes_index, entry, &mut cur_key, &mut cur_ref);
                    continue;
                }
                if entry.1 == EntryKind::Bitmap {
                    let old_next = cur_key.and_then(|k| self.next_in_bytes_index(k));
                    match self.search_bitmap(entry.0, tmp, bytes, true) {
                        Ok((start, _)) => return Some((entry, start)),
                        Err(_) => {
                            *max_extent_size =
                                max(*max_extent_size, self.ref_max_extent_size(entry));
                        }
                    }
                    if use_bytes_index {
                        // search_bitmap may have moved the entry; restart if that changed
                        // what follows it.
                        let k = self.bitmaps[&entry.0].key;
                        if self.next_in_bytes_index(k) != old_next {
                            continue 'again;
                        }
                        cur_key = Some(k);
                    }
                    self.advance(use_bytes_index, entry, &mut cur_key, &mut cur_ref);
                    continue;
                }
                return Some((entry, tmp));
            }
        }
    }

    fn next_in_bytes_index(&self, k: IndexKey) -> Option<Ref> {
        self.bytes_index.range((Excluded(k), Unbounded)).next().map(|(_, &r)| r)
    }

    fn advance(
        &self,
        use_bytes_index: bool,
        entry: Ref,
        key: &mut Option<IndexKey>,
        r: &mut Option<Ref>,
    ) {
        if use_bytes_index {
            let k = key.expect("bytes-index walk has a cursor");
            *key = self.bytes_index.range((Excluded(k), Unbounded)).next().map(|(&k, _)| k);
        } else {
            *r = self.next_ref(entry);
        }
    }

    #[cfg(test)]
    fn test_add_entry(&mut self, offset: u64, bytes: u64, bitmap: bool) {
        // The self-tests' test_add_free_space_entry: a raw extent entry (no merging, no
        // stealing) or bits set in bitmaps created as needed.
        let end = self.check_range(offset, bytes).expect("test range valid");
        self.check_not_free(offset, end).expect("test range not free");
        if !bitmap {
            self.link_extent(Detached { offset, bytes, trim: TrimState::Untrimmed });
        } else {
            let (mut offset, mut bytes) = (offset, bytes);
            while bytes > 0 {
                let bo = self.offset_to_bitmap(offset);
                if !self.bitmaps.contains_key(&bo) {
                    self.add_new_bitmap(offset);
                }
                let added = self.add_bytes_to_bitmap(bo, offset, bytes, TrimState::Untrimmed);
                offset += added;
                bytes -= added;
            }
        }
        self.debug_check();
    }
}

fn min_ref(a: Option<Ref>, b: Option<Ref>) -> Option<Ref> {
    match (a, b) {
        (Some(a), Some(b)) => Some(min(a, b)),
        (a, None) => a,
        (None, b) => b,
    }
}

fn get_max_extent_size_bitmap(b: &BitmapEntry) -> u64 {
    if b.max_extent_size != 0 {
        b.max_extent_size
    } else {
        b.bytes
    }
}

// -------------------------------------------------------------------- bit operations

/// Highest clear bit at or below `bit`, or `None` when bits `0..=bit` are all set: the
/// backward word scan of front stealing. Mask off the bits above `bit` in its word and take the
/// highest zero; if there is none, step back one word at a time. Cost O(1 + run / 64) where
/// run is the length of the run of set bits ending at `bit`. `bit` is clamped to the last
/// bit; an empty slice gives `None`.
pub fn find_last_clear_bit_upto(words: &[u64], bit: usize) -> Option<usize> {
    if words.is_empty() {
        return None;
    }
    let bit = min(bit, words.len() * 64 - 1);
    let mut idx = bit / 64;
    let keep = bit % 64;
    let mask = if keep == 63 { u64::MAX } else { (1u64 << (keep + 1)) - 1 };
    let mut clear = !words[idx] & mask;
    while clear == 0 {
        if idx == 0 {
            return None;
        }
        idx -= 1;
        clear = !words[idx];
    }
    Some(idx * 64 + 63 - clear.leading_zeros() as usize)
}

/// Highest set bit at or below `bit` (`bit` < 64 × words), or `None`.
fn find_last_set_bit_upto(words: &[u64], bit: usize) -> Option<usize> {
    let mut idx = bit / 64;
    let keep = bit % 64;
    let mask = if keep == 63 { u64::MAX } else { (1u64 << (keep + 1)) - 1 };
    let mut set = words[idx] & mask;
    while set == 0 {
        if idx == 0 {
            return None;
        }
        idx -= 1;
        set = words[idx];
    }
    Some(idx * 64 + 63 - set.leading_zeros() as usize)
}

/// First clear bit at or after `from`, or `nbits` (`find_next_zero_bit`). Public for
/// the front-steal benchmark's baseline, which walks clear bits with it.
pub fn find_next_zero_bit(words: &[u64], nbits: usize, from: usize) -> usize {
    if from >= nbits {
        return nbits;
    }
    let mut idx = from / 64;
    let mut w = !words[idx] & (u64::MAX << (from % 64));
    loop {
        if w != 0 {
            return min(idx * 64 + w.trailing_zeros() as usize, nbits);
        }
        idx += 1;
        if idx * 64 >= nbits {
            return nbits;
        }
        w = !words[idx];
    }
}

/// First set bit at or after `from`, or `nbits` (`find_next_bit`).
fn find_next_set_bit(words: &[u64], nbits: usize, from: usize) -> usize {
    if from >= nbits {
        return nbits;
    }
    let mut idx = from / 64;
    let mut w = words[idx] & (u64::MAX << (from % 64));
    loop {
        if w != 0 {
            return min(idx * 64 + w.trailing_zeros() as usize, nbits);
        }
        idx += 1;
        if idx * 64 >= nbits {
            return nbits;
        }
        w = words[idx];
    }
}

fn test_bit(words: &[u64], bit: usize) -> bool {
    words[bit / 64] >> (bit % 64) & 1 == 1
}

fn range_masks(start: usize, count: usize) -> impl Iterator<Item = (usize, u64)> {
    let end = start + count;
    let mut pos = start;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let idx = pos / 64;
        let lo = pos % 64;
        let hi = min(end - idx * 64, 64);
        let mask = if hi - lo == 64 { u64::MAX } else { ((1u64 << (hi - lo)) - 1) << lo };
        pos = idx * 64 + hi;
        Some((idx, mask))
    })
}

fn set_bits(words: &mut [u64], start: usize, count: usize) {
    for (idx, mask) in range_masks(start, count) {
        words[idx] |= mask;
    }
}

fn clear_bits(words: &mut [u64], start: usize, count: usize) {
    for (idx, mask) in range_masks(start, count) {
        words[idx] &= !mask;
    }
}

/// Number of runs of set bits and the longest run, in bits.
fn bitmap_runs(words: &[u64], nbits: usize) -> (u64, u64) {
    let (mut runs, mut longest) = (0u64, 0u64);
    let mut i = find_next_set_bit(words, nbits, 0);
    while i < nbits {
        let j = find_next_zero_bit(words, nbits, i);
        runs += 1;
        longest = max(longest, (j - i) as u64);
        i = find_next_set_bit(words, nbits, j);
    }
    (runs, longest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const K: u64 = 1024;
    const M: u64 = 1024 * 1024;
    const S: u64 = 4096;
    const BITS: [u32; 2] = [BITS_PER_BITMAP_4K_PAGE, BITS_PER_BITMAP_16K_PAGE];

    /// B: the bytes one bitmap covers (128 M at 32768 bits, 512 M at 131072 bits).
    fn span(bits: u32) -> u64 {
        u64::from(bits) * S
    }

    /// The kernel harness uses a group of B + page size, but its scenarios put free space
    /// up to 2B (the kernel never checks). ubtrfs refuses space outside the group, so the
    /// harness group is 2B, which has the same max_bitmaps, thresholds and use_bitmap
    /// verdicts (`harness_group_matches_kernel_harness`).
    fn harness(bits: u32) -> FreeSpaceCtl {
        FreeSpaceCtl::new(0, 2 * span(bits), 4096, bits).unwrap()
    }

    fn kernel_harness(bits: u32) -> FreeSpaceCtl {
        FreeSpaceCtl::new(0, span(bits) + u64::from(bits) / 8, 4096, bits).unwrap()
    }

    fn counts(c: &FreeSpaceCtl) -> (u64, u64) {
        (c.free_extents(), c.total_bitmaps())
    }

    /// Old linear definition: highest clear bit <= i, visiting every bit from 0.
    fn linear_last_clear(words: &[u64], i: usize) -> Option<usize> {
        let mut prev = None;
        for j in 0..=i {
            if !test_bit(words, j) {
                prev = Some(j);
            }
        }
        prev
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            // splitmix64
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    // ------------------------------------------------------------ geometry and thresholds

    #[test]
    fn geometry_errors() {
        assert!(matches!(
            FreeSpaceCtl::new(0, 1 << 30, 3000, 32768),
            Err(FreeSpaceError::Geometry { .. })
        ));
        assert!(matches!(
            FreeSpaceCtl::new(0, 1 << 30, 4096, 100),
            Err(FreeSpaceError::Geometry { .. })
        ));
        assert!(matches!(
            FreeSpaceCtl::new(0, 0, 4096, 32768),
            Err(FreeSpaceError::Geometry { .. })
        ));
        assert!(matches!(
            FreeSpaceCtl::new(100, 1 << 30, 4096, 32768),
            Err(FreeSpaceError::Geometry { .. })
        ));
        assert!(matches!(
            FreeSpaceCtl::new(u64::MAX - 4095, 8192, 4096, 32768),
            Err(FreeSpaceError::Geometry { .. })
        ));
        assert!(matches!(
            FreeSpaceCtl::new(0, 1 << 50, 4096, 64),
            Err(FreeSpaceError::Geometry { .. })
        ));
        assert!(FreeSpaceCtl::new(0, MAX_BITMAP_SLOTS * 256 * 4096, 4096, 256).is_ok());
    }

    #[test]
    fn thresholds_follow_the_kernel() {
        let mut c = FreeSpaceCtl::new(0, 1 << 30, 4096, 32768).unwrap();
        assert_eq!(c.extents_thresh(), 157);
        assert_eq!(c.max_bitmaps(), 8);
        c.test_add_entry(0, S, true);
        assert_eq!(c.extents_thresh(), 315, "1 G group with one bitmap");
        let mut c = FreeSpaceCtl::new(0, 10 << 30, 4096, 32768).unwrap();
        c.test_add_entry(0, S, true);
        assert_eq!(c.extents_thresh(), 3150, "10 G group");
        // Removing the last bitmap recalculates again.
        c.remove_free_space(0, S).unwrap();
        assert_eq!(c.extents_thresh(), 3150);
        // 16 G at 131072 bits: 512 K of extents budget.
        let mut c = FreeSpaceCtl::new(0, 16 << 30, 4096, 131072).unwrap();
        c.test_add_entry(0, S, true);
        assert_eq!(c.extents_thresh(), 512 * 1024 / 104);
        assert_eq!(c.max_bitmaps(), 32);
    }

    #[test]
    fn thresholds_charge_one_unit_per_bitmap() {
        // 64 K sectors, 1 G group: one bitmap costs 64 K (a unit) of the 64 K budget, so
        // no extent entries are "allowed"; charging a 4 K page would give 315.
        let mut c = FreeSpaceCtl::new(0, 1 << 30, 65536, 32768).unwrap();
        c.test_add_entry(0, 65536, true);
        assert_eq!(c.extents_thresh(), 0);
        assert_eq!(c.thresholds_for(1), 0);
        assert_eq!(c.thresholds_for(0), 315);
    }

    #[test]
    fn default_policy_three_rules() {
        let mut c = FreeSpaceCtl::new(0, 1 << 30, 4096, 32768).unwrap();
        // Rule 1: 1 M and more is always an extent.
        assert!(!c.use_bitmap(M));
        // Rule 2, below the threshold: over 8 sectors -> extent; small -> extent while
        // free_extents * 3 <= thresh.
        assert!(!c.use_bitmap(9 * S));
        assert!(!c.use_bitmap(S));
        c.free_extents = 53; // 53 * 3 = 159 > 157
        assert!(c.use_bitmap(S));
        assert!(c.use_bitmap(8 * S));
        assert!(!c.use_bitmap(9 * S));
        c.free_extents = 157;
        assert!(c.use_bitmap(9 * S), "at the threshold everything small goes to bitmaps");
        // free_extents * 3 == thresh still keeps small ranges as extents (thresh 315).
        let mut d = FreeSpaceCtl::new(0, 1 << 30, 4096, 32768).unwrap();
        d.test_add_entry(0, S, true);
        assert_eq!(d.extents_thresh(), 315);
        d.free_extents = 105;
        assert!(!d.use_bitmap(S));
        d.free_extents = 106;
        assert!(d.use_bitmap(S));
        assert!(!c.use_bitmap(M));
        c.free_extents = 0;
        // Rule 3: groups smaller than half a bitmap never use bitmaps, even in fragment mode.
        let mut small = FreeSpaceCtl::new(0, 32 * M, 4096, 32768).unwrap();
        small.free_extents = 1000;
        assert!(!small.use_bitmap(S));
        small.set_policy(BitmapPolicy::Fragment);
        assert!(!small.use_bitmap(S));
        let mut c = FreeSpaceCtl::new(0, 64 * M, 4096, 32768).unwrap();
        c.set_policy(BitmapPolicy::Fragment);
        assert!(c.use_bitmap(2 * M), "fragment mode ignores rules 1 and 2");
        c.set_policy(BitmapPolicy::WhenFreeExtents);
        assert!(!c.use_bitmap(S));
        c.free_extents = 1;
        assert!(c.use_bitmap(S));
        c.set_policy(BitmapPolicy::Always);
        assert!(c.use_bitmap(100 * M));
        c.set_policy(BitmapPolicy::Never);
        assert!(!c.use_bitmap(S));
    }

    #[test]
    fn harness_group_matches_kernel_harness() {
        for bits in BITS {
            let a = kernel_harness(bits);
            let b = harness(bits);
            assert_eq!(a.max_bitmaps(), 2);
            assert_eq!(b.max_bitmaps(), 2);
            for t in 0..=2 {
                assert_eq!(
                    a.thresholds_for(t),
                    b.thresholds_for(t),
                    "bits={bits} total_bitmaps={t}"
                );
            }
            for bytes in [S, 8 * S, 9 * S, M] {
                assert_eq!(a.use_bitmap(bytes), b.use_bitmap(bytes));
            }
            // And the kernel harness's straddling range really is outside B + page.
            let mut a = a;
            let err = a.test_add_entry_checked(span(bits) - 2 * M, 4 * M);
            assert!(matches!(err, Err(FreeSpaceError::OutOfRange { .. })), "{err:?}");
        }
    }

    impl FreeSpaceCtl {
        fn test_add_entry_checked(
            &mut self,
            offset: u64,
            bytes: u64,
        ) -> Result<(), FreeSpaceError> {
            self.check_range(offset, bytes).map(|_| ())
        }
    }

    #[test]
    fn bitmap_slots_neighbour_queries_match_a_btreeset() {
        use std::collections::BTreeSet;
        let (start, span) = (1u64 << 30, 128 * M);
        let mut rng = Rng(11);
        for slots in [1u64, 2, 63, 64, 65, 130] {
            let mut b = BitmapSlots::new(start, span, slots);
            let mut set = BTreeSet::new();
            for round in 0..400 {
                let k = rng.below(slots);
                let o = start + k * span;
                if rng.below(2) == 0 {
                    let e = BitmapEntry {
                        bytes: 0,
                        max_extent_size: 0,
                        bitmap_extents: 0,
                        trim: TrimState::Trimmed,
                        key: IndexKey { size: Reverse(0), seq: 0 },
                        bits: Box::new([]),
                    };
                    assert_eq!(b.insert(o, e).is_some(), !set.insert(o));
                } else {
                    assert_eq!(b.remove(&o).is_some(), set.remove(&o));
                }
                assert_eq!(b.len(), set.len());
                for _ in 0..20 {
                    let x = match rng.below(4) {
                        0 => start + rng.below(slots) * span,
                        1 => rng.below(start + (slots + 2) * span),
                        2 => start + rng.below(slots + 1) * span - 1,
                        _ => [0, start - 1, start, u64::MAX, u64::MAX - 1][rng.below(5) as usize],
                    };
                    let ctx = format!("slots={slots} round={round} x={x}");
                    assert_eq!(b.first_ge(x), set.range(x..).next().copied(), "{ctx}");
                    assert_eq!(
                        b.first_gt(x),
                        set.range((Excluded(x), Unbounded)).next().copied(),
                        "{ctx}"
                    );
                    assert_eq!(b.last_le(x), set.range(..=x).next_back().copied(), "{ctx}");
                    assert_eq!(b.last_lt(x), set.range(..x).next_back().copied(), "{ctx}");
                    assert_eq!(b.contains_key(&x), set.contains(&x), "{ctx}");
                }
                assert_eq!(b.first(), set.first().copied());
                assert_eq!(
                    b.iter().map(|(o, _)| o).collect::<Vec<_>>(),
                    set.iter().copied().collect::<Vec<_>>()
                );
            }
        }
    }

    // ------------------------------------------------------------ kernel self-tests (7.1)

    fn selftest_extents(c: &mut FreeSpaceCtl) {
        c.add_free_space(0, 4 * M).unwrap();
        c.remove_free_space(0, 4 * M).unwrap();
        assert!(!c.any_free(0, 4 * M), "full remove left some lingering space");
        assert_eq!(counts(c), (0, 0));
        c.add_free_space(0, 4 * M).unwrap();
        c.remove_free_space(3 * M, M).unwrap();
        c.remove_free_space(0, M).unwrap();
        c.remove_free_space(2 * M, 4096).unwrap();
        assert!(!c.any_free(0, M), "still have space at the front");
        assert!(!c.any_free(2 * M, 4096), "still have space in the middle");
        assert!(!c.any_free(3 * M, M), "still have space at the end");
        assert_eq!(c.free_ranges(), vec![(M, M), (2 * M + S, M - S)]);
        assert_eq!(counts(c), (2, 0));
        c.remove_free_space_cache();
    }

    fn selftest_bitmaps_within(c: &mut FreeSpaceCtl) {
        c.test_add_entry(0, 4 * M, true);
        c.remove_free_space(0, 4 * M).unwrap();
        assert!(!c.any_free(0, 4 * M), "left some space in bitmap");
        assert_eq!(counts(c), (0, 0));
        c.test_add_entry(0, 4 * M, true);
        c.remove_free_space(M, 2 * M).unwrap();
        assert!(!c.any_free(M, 2 * M));
        assert_eq!(c.free_ranges(), vec![(0, M), (3 * M, M)]);
        assert_eq!(counts(c), (1, 1));
    }

    fn selftest_bitmaps(c: &mut FreeSpaceCtl, b: u64) {
        selftest_bitmaps_within(c);
        // Straddling two bitmaps.
        c.test_add_entry(b - 2 * M, 4 * M, true);
        assert_eq!(counts(c), (2, 2));
        c.remove_free_space(b - M, 2 * M).unwrap();
        assert!(!c.any_free(b - M, 2 * M), "left some space when removing overlapping");
        assert_eq!(c.free_ranges(), vec![(0, M), (3 * M, M), (b - 2 * M, M), (b + M, M)]);
        c.remove_free_space_cache();
    }

    fn selftest_bitmaps_and_extents_abc_e(c: &mut FreeSpaceCtl) {
        // (a) extent and bitmap at the same offset; remove the extent, then the bitmap.
        c.test_add_entry(4 * M, M, true);
        c.test_add_entry(0, M, false);
        let kinds: Vec<_> = c.entries().iter().map(|e| (e.offset, e.kind)).collect();
        assert_eq!(
            kinds,
            vec![(0, EntryKind::Extent), (0, EntryKind::Bitmap)],
            "extent sorts first"
        );
        c.remove_free_space(0, M).unwrap();
        assert!(!c.any_free(0, M), "left remnants after our remove");
        c.test_add_entry(0, M, false);
        c.remove_free_space(4 * M, M).unwrap();
        assert!(!c.any_free(4 * M, M), "left remnants in the bitmap");
        assert_eq!(counts(c), (1, 0));
        // (b) extent [0, 1M) + bitmap [1M, 5M); remove across both.
        c.test_add_entry(M, 4 * M, true);
        c.remove_free_space(512 * K, 3 * M).unwrap();
        assert!(!c.any_free(512 * K, 3 * M), "left over pieces after removing overlapping");
        assert_eq!(c.free_ranges(), vec![(0, 512 * K), (512 * K + 3 * M, M + 512 * K)]);
        c.remove_free_space_cache();
        // (c) extent inside the bitmap's span.
        c.test_add_entry(4 * M, 4 * M, true);
        c.test_add_entry(2 * M, 2 * M, false);
        c.remove_free_space(3 * M, 4 * M).unwrap();
        assert!(!c.any_free(3 * M, 4 * M), "left something behind when removing space");
        assert_eq!(c.free_ranges(), vec![(2 * M, M), (7 * M, M)]);
        c.remove_free_space_cache();
        // (e) part in a bitmap, the rest in an extent: the internal EAGAIN restarts.
        c.test_add_entry(M, 2 * M, true);
        c.test_add_entry(3 * M, M, false);
        let restarts = c.remove_restarts;
        c.remove_free_space(M, 3 * M).unwrap();
        assert_eq!(c.remove_restarts, restarts + 1, "the bitmap pass hands over to the extent");
        assert!(!c.any_free(M, 3 * M));
        assert_eq!(counts(c), (0, 0));
        c.remove_free_space_cache();
    }

    fn selftest_bitmaps_and_extents(c: &mut FreeSpaceCtl, b: u64) {
        selftest_bitmaps_and_extents_abc_e(c);
        // (d) extent starts before the bitmap; remove inside both.
        c.test_add_entry(b + 4 * M, 4 * M, true);
        c.test_add_entry(b - M, 5 * M, false);
        c.remove_free_space(b + M, 5 * M).unwrap();
        assert!(!c.any_free(b + M, 5 * M), "left stuff over");
        assert_eq!(c.free_ranges(), vec![(b - M, 2 * M), (b + 6 * M, 2 * M)]);
        c.remove_free_space_cache();
    }

    fn selftest_steal_to_end(c: &mut FreeSpaceCtl, b: u64) {
        c.set_policy(BitmapPolicy::WhenFreeExtents);
        c.test_add_entry(b - 256 * K, 128 * K, false);
        c.test_add_entry(b + 512 * K, b - 512 * K, true);
        assert_eq!(counts(c), (2, 1));
        c.remove_free_space(b + 768 * K, b - 768 * K).unwrap();
        assert!(c.is_free(b - 256 * K, 128 * K));
        assert!(c.is_free(b + 512 * K, 256 * K));
        assert!(!c.any_free(b + 768 * K, b - 768 * K));
        assert!(!c.any_free(b + 256 * K, 256 * K));
        assert!(!c.any_free(b, 256 * K));
        // Into the bitmap, not a new extent entry.
        c.add_free_space(b, 512 * K).unwrap();
        assert!(c.is_free(b, 512 * K));
        assert_eq!(counts(c), (2, 1));
        c.add_free_space(b + 16 * M, S).unwrap();
        assert_eq!(counts(c), (2, 1));
        // Merge with the extent and steal [b, b + 768K) from the bitmap, but not the
        // sector at b + 16M.
        c.add_free_space(b - 128 * K, 128 * K).unwrap();
        assert!(c.is_free(b - 128 * K, 128 * K));
        assert_eq!(counts(c), (2, 1));
        assert!(c.is_free(b - 256 * K, M));
        assert_eq!(c.free_space(), M + S);
        let e = &c.entries()[0];
        assert_eq!((e.kind, e.offset, e.bytes), (EntryKind::Extent, b - 256 * K, M));
        assert_eq!(c.find_space_for_alloc(0, M, 0).0, b - 256 * K);
        assert_eq!(counts(c), (1, 1));
        assert_eq!(c.free_space(), S);
        assert_eq!(c.find_space_for_alloc(0, S, 0).0, b + 16 * M);
        check_cache_empty(c);
        c.set_policy(BitmapPolicy::Default);
        c.remove_free_space_cache();
    }

    fn selftest_steal_to_front(c: &mut FreeSpaceCtl, b: u64) {
        c.set_policy(BitmapPolicy::WhenFreeExtents);
        c.test_add_entry(b + 128 * K, 128 * K, false);
        c.test_add_entry(0, b - 512 * K, true);
        assert_eq!(counts(c), (2, 1));
        c.remove_free_space(0, b - 768 * K).unwrap();
        assert!(c.is_free(b + 128 * K, 128 * K));
        assert!(c.is_free(b - 768 * K, 256 * K));
        assert!(!c.any_free(0, b - 768 * K));
        assert!(!c.any_free(b - 512 * K, 512 * K));
        c.add_free_space(b - 512 * K, 512 * K).unwrap();
        assert!(c.is_free(b - 512 * K, 512 * K));
        assert_eq!(counts(c), (2, 1));
        c.add_free_space(32 * M, 2 * S).unwrap();
        // Merge right, then steal from the previous bitmap: the entry starts on the
        // boundary b, so the scan starts at its last bit.
        c.add_free_space(b, 128 * K).unwrap();
        assert!(c.is_free(b, 128 * K));
        assert_eq!(counts(c), (2, 1));
        assert!(c.is_free(b - 768 * K, M));
        assert_eq!(c.free_space(), M + 2 * S);
        let e = c.entries().into_iter().find(|e| e.kind == EntryKind::Extent).unwrap();
        assert_eq!((e.offset, e.bytes), (b - 768 * K, M));
        assert_eq!(c.find_space_for_alloc(0, M, 0).0, b - 768 * K);
        assert_eq!(counts(c), (1, 1));
        assert_eq!(c.free_space(), 2 * S);
        assert_eq!(c.find_space_for_alloc(0, 2 * S, 0).0, 32 * M);
        check_cache_empty(c);
        c.set_policy(BitmapPolicy::Default);
        c.remove_free_space_cache();
    }

    fn check_cache_empty(c: &mut FreeSpaceCtl) {
        assert_eq!(c.free_space(), 0);
        assert_eq!(c.find_space_for_alloc(0, 4096, 0).0, 0);
        assert_eq!(counts(c), (0, 0));
    }

    fn selftest_bytes_index(c: &mut FreeSpaceCtl, b: u64) {
        let mut off = 0;
        for i in 0..10 {
            c.add_free_space(off, (i + 1) * M).unwrap();
            off += (i + 1) * M + S;
        }
        let sizes: Vec<u64> = c
            .bytes_index_order()
            .iter()
            .map(|&(o, _)| c.entries().iter().find(|e| e.offset == o).unwrap().bytes)
            .collect();
        assert_eq!(sizes, (1..=10).rev().map(|i| i * M).collect::<Vec<_>>());
        c.remove_free_space_cache();
        c.test_add_entry(0, M, true);
        c.test_add_entry(b, 2 * M, true);
        assert_eq!(c.bytes_index_order(), vec![(b, EntryKind::Bitmap), (0, EntryKind::Bitmap)]);
        c.remove_free_space_cache();

        c.set_policy(BitmapPolicy::Always);
        c.add_free_space(0, S).unwrap();
        for k in 1..=9 {
            c.add_free_space(2 * k * S, S).unwrap();
        }
        c.add_free_space(b, S).unwrap();
        c.add_free_space(b + S, S).unwrap();
        assert_eq!(counts(c), (2, 2));
        assert_eq!(c.bytes_index_order()[0], (0, EntryKind::Bitmap));
        let (start, max_extent_size) = c.find_space_for_alloc(0, 3 * S, 0);
        assert_eq!((start, max_extent_size), (0, 2 * S));
        assert_eq!(c.bytes_index_order()[0], (b, EntryKind::Bitmap));
        assert_eq!(c.entries()[0].max_extent_size, S, "the failed search recorded A's longest run");
        c.add_free_space(b - S, S).unwrap();
        assert_eq!(c.entries()[0].bytes, 11 * S);
        assert_eq!(c.entries()[0].max_extent_size, 0, "setting bits forgets the longest run");
        assert_eq!(c.bytes_index_order()[0], (0, EntryKind::Bitmap));
        assert_eq!(c.find_space_for_alloc(0, 2 * S, 0).0, b);
        c.set_policy(BitmapPolicy::Default);
        c.remove_free_space_cache();
    }

    #[test]
    fn selftest_1_extents() {
        for bits in BITS {
            selftest_extents(&mut harness(bits));
            selftest_extents(&mut kernel_harness(bits));
        }
    }

    #[test]
    fn selftest_2_bitmaps() {
        for bits in BITS {
            selftest_bitmaps(&mut harness(bits), span(bits));
            selftest_bitmaps_within(&mut kernel_harness(bits));
        }
    }

    #[test]
    fn selftest_3_bitmaps_and_extents() {
        for bits in BITS {
            selftest_bitmaps_and_extents(&mut harness(bits), span(bits));
            selftest_bitmaps_and_extents_abc_e(&mut kernel_harness(bits));
        }
    }

    #[test]
    fn selftest_4_steal_to_end() {
        for bits in BITS {
            selftest_steal_to_end(&mut harness(bits), span(bits));
        }
    }

    #[test]
    fn selftest_4_steal_to_front() {
        for bits in BITS {
            selftest_steal_to_front(&mut harness(bits), span(bits));
        }
    }

    #[test]
    fn selftest_5_bytes_index_order() {
        for bits in BITS {
            selftest_bytes_index(&mut harness(bits), span(bits));
        }
    }

    #[test]
    fn selftests_in_sequence_on_one_cache() {
        // The kernel runs all scenarios on one block group, emptying it in between.
        for bits in BITS {
            let b = span(bits);
            let mut c = harness(bits);
            selftest_extents(&mut c);
            selftest_bitmaps(&mut c, b);
            selftest_bitmaps_and_extents(&mut c, b);
            selftest_steal_to_end(&mut c, b);
            selftest_steal_to_front(&mut c, b);
            selftest_bytes_index(&mut c, b);
        }
    }

    // ------------------------------------------------------------ backward word scan

    #[test]
    fn backward_scan_edge_cases() {
        let n = 256;
        let words = |set: &[(usize, usize)]| {
            let mut w = vec![0u64; n / 64];
            for &(a, b) in set {
                set_bits(&mut w, a, b - a);
            }
            w
        };
        // Empty bitmap (all allocated): bit i itself.
        let empty = words(&[]);
        for i in 0..n {
            assert_eq!(find_last_clear_bit_upto(&empty, i), Some(i));
        }
        // Full bitmap: -1 everywhere.
        let full = words(&[(0, n)]);
        for i in 0..n {
            assert_eq!(find_last_clear_bit_upto(&full, i), None);
        }
        // i at bit 0 of a word.
        assert_eq!(find_last_clear_bit_upto(&words(&[(0, 1)]), 0), None);
        assert_eq!(find_last_clear_bit_upto(&words(&[(1, 2)]), 0), Some(0));
        assert_eq!(find_last_clear_bit_upto(&words(&[(0, 65)]), 64), None);
        assert_eq!(find_last_clear_bit_upto(&words(&[(64, 65)]), 64), Some(63));
        assert_eq!(find_last_clear_bit_upto(&words(&[(10, 65)]), 64), Some(9));
        // i at bit 63.
        assert_eq!(find_last_clear_bit_upto(&words(&[(0, 64)]), 63), None);
        assert_eq!(find_last_clear_bit_upto(&words(&[(5, 64)]), 63), Some(4));
        assert_eq!(find_last_clear_bit_upto(&words(&[(0, 63)]), 63), Some(63));
        // Bits above i never count, even in i's word.
        assert_eq!(find_last_clear_bit_upto(&words(&[(0, 10)]), 9), None);
        // The last bit, and bits 0..=i set.
        assert_eq!(find_last_clear_bit_upto(&words(&[(100, n)]), n - 1), Some(99));
        assert_eq!(find_last_clear_bit_upto(&full, n - 1), None);
        // Bit i clear: i itself (no steal).
        assert_eq!(find_last_clear_bit_upto(&words(&[(0, 200)]), 200), Some(200));
        // Out-of-range i is clamped to the last bit, as the patch does.
        assert_eq!(find_last_clear_bit_upto(&words(&[(100, n)]), 10 * n), Some(99));
        assert_eq!(find_last_clear_bit_upto(&[], 0), None);
    }

    #[test]
    fn backward_scan_exhaustive_256() {
        let n = 256;
        let mut rng = Rng(7);
        let mut patterns: Vec<Vec<u64>> = Vec::new();
        for p in 0..n {
            let mut w = vec![u64::MAX; 4];
            clear_bits(&mut w, p, 1);
            patterns.push(w);
            let mut w = vec![0u64; 4];
            set_bits(&mut w, p, 1);
            patterns.push(w);
        }
        for _ in 0..200 {
            patterns.push((0..4).map(|_| rng.next() & rng.next()).collect());
            patterns.push((0..4).map(|_| rng.next() | rng.next()).collect());
        }
        for w in &patterns {
            for i in 0..n {
                assert_eq!(
                    find_last_clear_bit_upto(w, i),
                    linear_last_clear(w, i),
                    "i={i} words={w:x?}"
                );
            }
        }
    }

    fn pattern_words(n: usize, pattern: u8, seed: u64, density: u32) -> Vec<u64> {
        let mut rng = Rng(seed);
        let mut w = vec![0u64; n / 64];
        match pattern {
            0 => {}
            1 => w.fill(u64::MAX),
            2 => {
                // Random bits, set with probability density/64.
                for x in w.iter_mut() {
                    for b in 0..64 {
                        if (rng.below(64) as u32) < density {
                            *x |= 1 << b;
                        }
                    }
                }
            }
            3 => {
                // Long runs alternating set / clear.
                let mut pos = 0;
                let mut set = rng.below(2) == 0;
                while pos < n {
                    let len = min(1 + rng.below(5000) as usize, n - pos);
                    if set {
                        set_bits(&mut w, pos, len);
                    }
                    pos += len;
                    set = !set;
                }
            }
            4 => {
                // Mostly free with sparse allocated sectors.
                w.fill(u64::MAX);
                for _ in 0..(1 + density as usize) {
                    let p = rng.below(n as u64) as usize;
                    clear_bits(&mut w, p, 1);
                }
            }
            _ => {
                // Runs that start and end next to word boundaries.
                let mut pos = 0;
                let mut set = true;
                while pos < n {
                    let words = 1 + rng.below(8) as usize;
                    let jitter = rng.below(3) as usize;
                    let len = min((words * 64 + jitter).saturating_sub(1).max(1), n - pos);
                    if set {
                        set_bits(&mut w, pos, len);
                    }
                    pos += len;
                    set = !set;
                }
            }
        }
        w
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

        /// The word scan equals the linear definition on bitmaps of the sizes that
        /// matter (256, 32768, 131072 bits): empty, full, random, long runs, word edges.
        #[test]
        fn backward_scan_matches_linear(size in 0usize..3, pattern in 0u8..6, seed: u64, density in 1u32..64) {
            let n = [256usize, 32768, 131072][size];
            let w = pattern_words(n, pattern, seed, density);
            // The linear definition, swept once over all i.
            let mut reference = Vec::with_capacity(n);
            let mut last = None;
            for j in 0..n {
                if !test_bit(&w, j) {
                    last = Some(j);
                }
                reference.push(last);
            }
            let mut rng = Rng(seed ^ 0x5eed);
            let mut is: Vec<usize> = vec![0, 1, 62, 63, 64, 65, 127, 128, n / 2, n - 65, n - 64, n - 2, n - 1];
            is.extend((0..200).map(|_| rng.below(n as u64) as usize));
            for &i in &is {
                prop_assert_eq!(find_last_clear_bit_upto(&w, i), reference[i], "i={} n={} pattern={}", i, n, pattern);
            }
            for &i in is.iter().take(16) {
                prop_assert_eq!(linear_last_clear(&w, i), reference[i]);
            }
        }
    }

    // ------------------------------------------------------------ stealing edge cases

    /// Group of two bitmaps at `start`, policy Never (added ranges become extent entries
    /// and steal); set the given sector ranges in bitmaps, add one extent of `len` sectors
    /// at sector `at`, and compare the resulting entry with the linear definition.
    fn steal_case(bits: u32, start: u64, set: &[(u64, u64)], at: u64, len: u64) -> (u64, u64) {
        let n = u64::from(bits);
        let mut c = FreeSpaceCtl::new(start, 2 * span(bits), 4096, bits).unwrap();
        c.set_policy(BitmapPolicy::Never);
        for &(a, b) in set {
            c.test_add_entry(start + a * S, (b - a) * S, true);
        }
        let offset = start + at * S;
        let end = offset + len * S;
        // Expected end steal: the run of set bits from the end, in the bitmap there.
        let mut want_end = end;
        if end < start + 2 * span(bits) {
            let bo = c.offset_to_bitmap(end);
            if let Some(w) = c.bitmap_words(bo) {
                let mut j = (end - bo) / S;
                while j < n && test_bit(w, j as usize) {
                    j += 1;
                }
                want_end = bo + j * S;
            }
        }
        // Expected front steal, from the linear definition.
        let mut want_start = offset;
        let mut bo = c.offset_to_bitmap(offset);
        let on_boundary = bo == offset;
        if on_boundary && offset != start {
            bo = c.offset_to_bitmap(offset - 1);
        }
        if !(on_boundary && offset == start) {
            if let Some(w) = c.bitmap_words(bo) {
                let i = ((offset - bo) / S - 1) as usize;
                match linear_last_clear(w, i) {
                    Some(p) if p == i => {}
                    Some(p) => want_start = offset - (i - p) as u64 * S,
                    None => want_start = offset - (i as u64 + 1) * S,
                }
            }
        }
        let free_before = c.free_space();
        c.add_free_space(offset, len * S).unwrap();
        let e = c.entries().into_iter().find(|e| e.kind == EntryKind::Extent).unwrap();
        assert_eq!(
            (e.offset, e.offset + e.bytes),
            (want_start, want_end),
            "bits={bits} start={start} at={at}"
        );
        assert_eq!(c.free_space(), free_before + len * S);
        c.check_invariants();
        ((offset - e.offset) / S, (e.offset + e.bytes - end) / S)
    }

    #[test]
    fn steal_to_front_edge_cases() {
        for bits in BITS {
            let n = u64::from(bits);
            for start in [0, 1 << 30] {
                // i at bit 0 of word 0: bit 0 set -> -1 -> steal 1 sector.
                assert_eq!(steal_case(bits, start, &[(0, 1)], 1, 1), (1, 0));
                // i at bit 0, bit 0 clear: no steal.
                assert_eq!(steal_case(bits, start, &[(10, 12)], 1, 1), (0, 0));
                // i at bit 63.
                assert_eq!(steal_case(bits, start, &[(10, 64)], 64, 1), (54, 0));
                assert_eq!(steal_case(bits, start, &[(0, 64)], 64, 1), (64, 0));
                // i at bit 0 of word 1.
                assert_eq!(steal_case(bits, start, &[(0, 65)], 65, 1), (65, 0));
                assert_eq!(steal_case(bits, start, &[(64, 65)], 65, 1), (1, 0));
                // Bits 0..=i set, i far into the bitmap: -1.
                assert_eq!(steal_case(bits, start, &[(0, 5001)], 5001, 3), (5001, 0));
                // Bit i clear: nothing to steal.
                assert_eq!(steal_case(bits, start, &[(0, 4999)], 5000, 1), (0, 0));
                // A long run over many words, stopping at one clear bit.
                assert_eq!(
                    steal_case(bits, start, &[(0, 99), (100, n - 10)], n - 10, 2),
                    (n - 110, 0)
                );
                // On a boundary: the previous bitmap, scanned from its last bit.
                assert_eq!(steal_case(bits, start, &[(n - 100, n)], n, 1), (100, 0));
                assert_eq!(steal_case(bits, start, &[(5, 7), (n - 1, n)], n, 1), (1, 0));
                // The whole previous bitmap: -1, and the bitmap goes away.
                assert_eq!(steal_case(bits, start, &[(0, n)], n, 1), (n, 0));
                // Previous bitmap's last bit clear: nothing.
                assert_eq!(steal_case(bits, start, &[(0, n - 1)], n, 1), (0, 0));
                // The group's first sector is a boundary with no previous bitmap; only the
                // end steals.
                assert_eq!(steal_case(bits, start, &[(1, 50)], 0, 1), (0, 49));
                // Both sides at once.
                assert_eq!(steal_case(bits, start, &[(100, 200), (201, 300)], 200, 1), (100, 99));
                // To end: only the one bitmap covering the end is looked at.
                assert_eq!(steal_case(bits, start, &[(n - 5, n + 5)], n - 10, 5), (0, 5));
                // To end: a run to the end of the bitmap.
                assert_eq!(steal_case(bits, start, &[(n + 10, 2 * n)], n + 5, 5), (0, n - 10));
            }
        }
    }

    #[test]
    fn bitmap_bookkeeping_on_set_and_clear() {
        let mut c = harness(BITS_PER_BITMAP_4K_PAGE);
        c.set_policy(BitmapPolicy::Always);
        let runs = |c: &FreeSpaceCtl| c.entries()[0].bitmap_extents;
        let mes = |c: &FreeSpaceCtl| c.entries()[0].max_extent_size;
        for (sector, want_runs) in [(0, 1), (1, 1), (2, 1), (5, 2), (4, 2), (3, 1), (10, 2)] {
            c.add_free_space(sector * S, S).unwrap();
            assert_eq!(runs(&c), want_runs, "after adding sector {sector}");
        }
        // A bitmap with too few bytes is skipped unsearched.
        assert_eq!(c.find_space_for_alloc(0, 8 * S, 0), (0, 7 * S));
        assert_eq!(mes(&c), 0);
        // A failed search records the longest run and keys the bitmap by it.
        assert_eq!(c.find_space_for_alloc(0, 7 * S, 0), (0, 6 * S));
        assert_eq!(mes(&c), 6 * S);
        assert_eq!(c.bitmaps[&0].key.size.0, 6 * S);
        // Clearing forgets a known longest run above one unit.
        c.remove_free_space(0, S).unwrap();
        assert_eq!((mes(&c), runs(&c)), (0, 2));
        assert_eq!(c.bitmaps[&0].key.size.0, 6 * S);
        c.remove_free_space(3 * S, S).unwrap();
        assert_eq!(runs(&c), 3);
        c.remove_free_space(S, S).unwrap();
        c.remove_free_space(4 * S, S).unwrap();
        assert_eq!(c.find_space_for_alloc(0, 2 * S, 0), (0, S));
        assert_eq!(mes(&c), S);
        // ...but keeps one of exactly one unit (it stays an upper bound).
        c.remove_free_space(2 * S, S).unwrap();
        assert_eq!((mes(&c), runs(&c)), (S, 2));
        // Setting bits always forgets it.
        c.add_free_space(100 * S, S).unwrap();
        assert_eq!((mes(&c), runs(&c)), (0, 3));
    }

    #[test]
    fn whole_bitmap_stolen_frees_it() {
        let bits = BITS_PER_BITMAP_4K_PAGE;
        let n = u64::from(bits);
        let mut c = harness(bits);
        c.set_policy(BitmapPolicy::Never);
        c.test_add_entry(0, n * S, true);
        c.add_free_space(n * S, S).unwrap();
        assert_eq!(counts(&c), (1, 0));
        assert_eq!(c.free_ranges(), vec![(0, (n + 1) * S)]);
        assert_eq!(c.extents_thresh(), c.thresholds_for(0), "freeing the bitmap recalculates");
        // Where the cap does not hide it: 64 K sectors, one bitmap costs the whole budget.
        let mut c = FreeSpaceCtl::new(0, 1 << 30, 65536, 32768).unwrap();
        c.set_policy(BitmapPolicy::Never);
        c.test_add_entry(0, 65536, true);
        assert_eq!(c.extents_thresh(), 0);
        c.add_free_space(65536, 65536).unwrap();
        assert_eq!(counts(&c), (1, 0));
        assert_eq!(c.extents_thresh(), 315);
    }

    // ------------------------------------------------------------ errors and other rules

    #[test]
    fn caller_errors_leave_the_cache_unchanged() {
        let mut c = FreeSpaceCtl::new(1 << 30, 256 * M, 4096, 32768).unwrap();
        let g = 1u64 << 30;
        c.add_free_space(g, 4 * M).unwrap();
        c.test_add_entry(g + 8 * M, M, true);
        let before = (c.entries(), c.free_ranges());
        // EEXIST in an extent, at the exact same offset, and in a bitmap.
        let e = c.add_free_space(g + M, S).unwrap_err();
        assert_eq!(
            e,
            FreeSpaceError::AlreadyFree {
                bg_start: g,
                offset: g + M,
                bytes: S,
                free_offset: g + M,
                free_bytes: S
            }
        );
        assert!(matches!(c.add_free_space(g, S), Err(FreeSpaceError::AlreadyFree { .. })));
        let e = c.add_free_space(g + 7 * M, 2 * M).unwrap_err();
        assert_eq!(
            e,
            FreeSpaceError::AlreadyFree {
                bg_start: g,
                offset: g + 7 * M,
                bytes: 2 * M,
                free_offset: g + 8 * M,
                free_bytes: M
            }
        );
        // Removing space that is not free names the hole.
        let e = c.remove_free_space(g + 3 * M, 2 * M).unwrap_err();
        assert_eq!(
            e,
            FreeSpaceError::NotFree {
                bg_start: g,
                offset: g + 3 * M,
                bytes: 2 * M,
                hole_offset: g + 4 * M,
                hole_bytes: M
            }
        );
        assert_eq!(e.to_string(), "block group 1073741824: range offset=1076887552 bytes=2097152 is not free at offset=1077936128 bytes=1048576");
        assert!(matches!(
            c.remove_free_space(g + 8 * M, 2 * M),
            Err(FreeSpaceError::NotFree { .. })
        ));
        // Outside the group, unaligned, empty, overflowing.
        assert!(matches!(c.add_free_space(g - S, S), Err(FreeSpaceError::OutOfRange { .. })));
        assert!(matches!(c.add_free_space(g + 256 * M, S), Err(FreeSpaceError::OutOfRange { .. })));
        assert!(matches!(
            c.add_free_space(u64::MAX - S + 1, S),
            Err(FreeSpaceError::OutOfRange { .. })
        ));
        assert!(matches!(c.add_free_space(g + 100, S), Err(FreeSpaceError::Unaligned { .. })));
        assert!(matches!(c.remove_free_space(g, 100), Err(FreeSpaceError::Unaligned { .. })));
        assert!(matches!(c.add_free_space(g + 20 * M, 0), Err(FreeSpaceError::Empty { .. })));
        assert_eq!(c.remove_free_space(g + 20 * M, 0), Ok(()));
        // Pinned space can be neither added nor pinned again, free space cannot be pinned.
        c.pin(g + 20 * M, M).unwrap();
        let after_pin = (c.entries(), c.free_ranges());
        assert!(matches!(c.add_free_space(g + 20 * M + S, S), Err(FreeSpaceError::Pinned { .. })));
        assert!(matches!(c.pin(g + 20 * M, S), Err(FreeSpaceError::Pinned { .. })));
        assert!(matches!(c.pin(g, S), Err(FreeSpaceError::AlreadyFree { .. })));
        assert!(matches!(c.remove_free_space(g + 20 * M, S), Err(FreeSpaceError::NotFree { .. })));
        // Nonsense allocation requests find nothing.
        assert_eq!(c.find_space_for_alloc(g, 0, 0), (0, 0));
        assert_eq!(c.find_space_for_alloc(g, 100, 0), (0, 0));
        assert_eq!(c.find_space_for_alloc(g, S, u64::MAX), (0, 0));
        assert_eq!(before, after_pin);
        assert_eq!(before, (c.entries(), c.free_ranges()));
    }

    #[test]
    fn trim_state_merge_rule() {
        let mut c = harness(BITS_PER_BITMAP_4K_PAGE);
        c.add_free_space(0, M).unwrap();
        // A trimmed range does not absorb an untrimmed neighbour.
        c.add_free_space_with_trim(M, M, TrimState::Trimmed).unwrap();
        assert_eq!(counts(&c), (2, 0));
        // A trimmed range absorbs a trimmed one.
        c.add_free_space_with_trim(2 * M, M, TrimState::Trimmed).unwrap();
        let e = c.entries();
        assert_eq!((e[1].offset, e[1].bytes, e[1].trim_state), (M, 2 * M, TrimState::Trimmed));
        // An untrimmed range absorbs both and the result is untrimmed.
        c.remove_free_space(8 * M, 0).unwrap();
        c.add_free_space_with_trim(3 * M, M, TrimState::Trimmed).unwrap();
        c.add_free_space(10 * M, M).unwrap();
        c.remove_free_space(M, M).unwrap();
        c.add_free_space(M, M).unwrap();
        let e = c.entries();
        assert_eq!(e.len(), 2);
        assert_eq!((e[0].offset, e[0].bytes, e[0].trim_state), (0, 4 * M, TrimState::Untrimmed));
        // Stealing from an untrimmed bitmap makes a trimmed entry untrimmed.
        let mut c = harness(BITS_PER_BITMAP_4K_PAGE);
        c.test_add_entry(0, 16 * S, true);
        c.set_policy(BitmapPolicy::Never);
        c.add_free_space_with_trim(16 * S, M, TrimState::Trimmed).unwrap();
        let e = c.entries();
        assert_eq!((e[0].offset, e[0].trim_state), (0, TrimState::Untrimmed));
    }

    #[test]
    fn remove_in_the_middle_re_adds_the_tail() {
        let mut c = harness(BITS_PER_BITMAP_4K_PAGE);
        c.add_free_space(0, 10 * M).unwrap();
        c.remove_free_space(4 * M, M).unwrap();
        assert_eq!(c.free_ranges(), vec![(0, 4 * M), (5 * M, 5 * M)]);
        assert_eq!(counts(&c), (2, 0));
        // An extent entry spanning several bitmap spans, with bitmaps on both sides.
        let b = span(BITS_PER_BITMAP_4K_PAGE);
        let mut c = FreeSpaceCtl::new(0, 4 * b, 4096, BITS_PER_BITMAP_4K_PAGE).unwrap();
        c.test_add_entry(b / 2, S, true);
        c.test_add_entry(3 * b + M, S, true);
        c.test_add_entry(b / 2 + M, 2 * b, false);
        c.remove_free_space(2 * b + M, M).unwrap();
        assert_eq!(
            c.free_ranges(),
            vec![(b / 2, S), (b / 2 + M, 3 * b / 2), (2 * b + 2 * M, b / 2 - M), (3 * b + M, S)]
        );
    }

    #[test]
    fn alloc_alignment_gap_is_re_added() {
        let mut c = FreeSpaceCtl::new(1 << 30, 256 * M, 4096, 32768).unwrap();
        let g = 1u64 << 30;
        c.set_full_stripe_len(64 * K);
        c.add_free_space(g + S, M).unwrap();
        let (start, _) = c.find_space_for_alloc(g, 64 * K, 0);
        assert_eq!(start, g + 64 * K);
        assert_eq!(c.free_ranges(), vec![(g + S, 60 * K), (g + 128 * K, M + S - 128 * K)]);
        // empty_size asks for more than it takes.
        let mut c = FreeSpaceCtl::new(g, 256 * M, 4096, 32768).unwrap();
        c.add_free_space(g, 16 * S).unwrap();
        assert_eq!(c.find_space_for_alloc(g, 8 * S, 9 * S), (0, 16 * S));
        assert_eq!(c.find_space_for_alloc(g, 8 * S, 8 * S), (g, 0));
        assert_eq!(c.free_ranges(), vec![(g + 8 * S, 8 * S)]);
        assert_eq!(c.alloc(g, 16 * S, 0), Alloc::NoSpace { max_extent_size: 8 * S });
    }

    #[test]
    fn bytes_index_equal_keys_keep_insertion_order() {
        // rb_add_cached puts a node after the equal ones: the oldest equal entry wins.
        for first in [0, 10 * M] {
            let second = 10 * M - first;
            let mut c = harness(BITS_PER_BITMAP_4K_PAGE);
            c.add_free_space(first, M).unwrap();
            c.add_free_space(second, M).unwrap();
            assert_eq!(c.find_space_for_alloc(0, M, 0).0, first);
        }
        // A bitmap moved in the index goes behind an equal extent.
        let mut c = harness(BITS_PER_BITMAP_4K_PAGE);
        c.test_add_entry(0, 2 * S, true);
        c.add_free_space(20 * M, 2 * S).unwrap();
        assert_eq!(c.bytes_index_order()[0], (0, EntryKind::Bitmap));
        c.remove_free_space(0, S).unwrap();
        c.test_add_entry(0, S, true);
        assert_eq!(c.bytes_index_order()[0], (20 * M, EntryKind::Extent));
    }

    #[test]
    fn alloc_by_offset_walks_from_the_hint() {
        let b = span(BITS_PER_BITMAP_4K_PAGE);
        let mut c = FreeSpaceCtl::new(0, 4 * b, 4096, BITS_PER_BITMAP_4K_PAGE).unwrap();
        c.add_free_space(M, 8 * M).unwrap();
        c.add_free_space(2 * b + M, 2 * M).unwrap();
        // The bytes index would pick the larger entry; the hint starts at its bitmap span.
        assert_eq!(c.find_space_for_alloc(2 * b + 5 * M, M, 0).0, 2 * b + M);
        // Nothing at or after the hint: fail, even though space exists below it.
        assert_eq!(c.find_space_for_alloc(3 * b, M, 0).0, 0);
        assert_eq!(c.find_space_for_alloc(0, M, 0).0, M);
        // Out-of-group hints are clamped.
        assert_eq!(c.find_space_for_alloc(u64::MAX, S, 0).0, 0);
    }

    #[test]
    fn pin_coalesces_and_unpin_returns_space_lowest_first() {
        let mut c = FreeSpaceCtl::new(1 << 30, 256 * M, 4096, 32768).unwrap();
        let g = 1u64 << 30;
        c.add_free_space(g, 256 * M).unwrap();
        let a = c.find_space_for_alloc(g, 3 * M, 0).0;
        assert_eq!(a, g);
        c.pin(g + M, M).unwrap();
        c.pin(g, M).unwrap();
        c.pin(g + 2 * M, 4 * K).unwrap();
        assert_eq!(c.pinned_ranges(), vec![(g, 2 * M + 4 * K)]);
        assert_eq!(c.pinned_bytes(), 2 * M + 4 * K);
        // Pinned space is not allocatable.
        assert!(!c.any_free(g, 3 * M));
        let u = c.unpin_all();
        assert_eq!(u, Unpinned { ranges: 1, bytes: 2 * M + 4 * K });
        assert_eq!(c.pinned_bytes(), 0);
        assert_eq!(c.free_ranges(), vec![(g, 2 * M + 4 * K), (g + 3 * M, 253 * M)]);
    }

    // ------------------------------------------------------------ model test

    /// Interval set in sector units.
    #[derive(Clone, Debug, Default, PartialEq)]
    struct Intervals(BTreeMap<u64, u64>);

    impl Intervals {
        fn overlaps(&self, a: u64, b: u64) -> bool {
            matches!(self.0.range(..b).next_back(), Some((_, &e)) if e > a)
        }
        fn contains(&self, a: u64, b: u64) -> bool {
            matches!(self.0.range(..=a).next_back(), Some((_, &e)) if e >= b)
        }
        fn insert(&mut self, a: u64, b: u64) {
            assert!(!self.overlaps(a, b));
            let (mut s, mut e) = (a, b);
            if let Some((&ls, &le)) = self.0.range(..a).next_back() {
                if le == a {
                    self.0.remove(&ls);
                    s = ls;
                }
            }
            if let Some(re) = self.0.remove(&b) {
                e = re;
            }
            self.0.insert(s, e);
        }
        fn remove(&mut self, a: u64, b: u64) {
            let (&s, &e) = self.0.range(..=a).next_back().expect("contained");
            assert!(e >= b);
            self.0.remove(&s);
            if s < a {
                self.0.insert(s, a);
            }
            if b < e {
                self.0.insert(b, e);
            }
        }
        fn ranges(&self, base: u64, unit: u64) -> Vec<(u64, u64)> {
            self.0.iter().map(|(&s, &e)| (base + s * unit, (e - s) * unit)).collect()
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Add(u64, u64),
        AddTrimmed(u64, u64),
        Remove(u64, u64),
        Alloc { at_hint: Option<u64>, len: u64, empty: u64 },
        Pin(u64, u64),
        UnpinAll,
        Policy(u8),
    }

    fn op_strategy(total: u64, span_sectors: u64) -> impl Strategy<Value = Op> {
        let total_c = total;
        let sector = prop_oneof![
            0..64u64,
            (span_sectors.saturating_sub(64))..(span_sectors + 64).min(total_c),
            total_c.saturating_sub(64)..total_c,
            0..total_c,
        ];
        let len = prop_oneof![4 => 1..8u64, 3 => 1..80u64, 1 => 250..300u64, 1 => 1..total_c + 8];
        prop_oneof![
            6 => (sector.clone(), len.clone()).prop_map(|(s, l)| Op::Add(s, l)),
            1 => (sector.clone(), len.clone()).prop_map(|(s, l)| Op::AddTrimmed(s, l)),
            4 => (sector.clone(), len.clone()).prop_map(|(s, l)| Op::Remove(s, l)),
            4 => (proptest::option::of(sector.clone()), 1..40u64, prop_oneof![3 => Just(0u64), 1 => 1..8u64])
                .prop_map(|(at_hint, len, empty)| Op::Alloc { at_hint, len, empty }),
            3 => (sector, len).prop_map(|(s, l)| Op::Pin(s, l)),
            1 => Just(Op::UnpinAll),
            1 => (0u8..5).prop_map(Op::Policy),
        ]
    }

    fn run_model(start: u64, length: u64, bits: u32, ops: &[Op]) -> Result<(), TestCaseError> {
        let mut c = FreeSpaceCtl::new(start, length, 4096, bits).unwrap();
        c.set_debug_checks(true);
        let total = length / S;
        let mut free = Intervals::default();
        let mut pinned = Intervals::default();
        let valid = |s: u64, l: u64| l > 0 && s + l <= total;
        for op in ops {
            match *op {
                Op::Add(s, l) | Op::AddTrimmed(s, l) => {
                    let trim = if matches!(op, Op::Add(..)) {
                        TrimState::Untrimmed
                    } else {
                        TrimState::Trimmed
                    };
                    let r = c.add_free_space_with_trim(start + s * S, l * S, trim);
                    let ok = valid(s, l) && !free.overlaps(s, s + l) && !pinned.overlaps(s, s + l);
                    prop_assert_eq!(r.is_ok(), ok, "{:?} -> {:?}", op, r);
                    if ok {
                        free.insert(s, s + l);
                    }
                }
                Op::Remove(s, l) => {
                    let r = c.remove_free_space(start + s * S, l * S);
                    let ok = valid(s, l) && free.contains(s, s + l);
                    prop_assert_eq!(r.is_ok(), ok, "{:?} -> {:?}", op, r);
                    if ok {
                        free.remove(s, s + l);
                    }
                }
                Op::Alloc { at_hint, len, empty } => {
                    let hint = at_hint.map_or(start, |h| start + h * S);
                    match c.alloc(hint, len * S, empty * S) {
                        Alloc::Found { start: got, .. } => {
                            prop_assert_eq!(got % S, 0);
                            let s = (got - start) / S;
                            prop_assert!(
                                free.contains(s, s + len),
                                "{:?} returned unfree {}",
                                op,
                                got
                            );
                            free.remove(s, s + len);
                        }
                        Alloc::NoSpace { .. } => {
                            if hint == start {
                                // The bytes-index walk only fails when no single entry has a
                                // run of len + empty sectors.
                                let want = (len + empty) * S;
                                for e in c.extents.values() {
                                    prop_assert!(
                                        e.bytes < want,
                                        "{:?} failed with an extent of {}",
                                        op,
                                        e.bytes
                                    );
                                }
                                for (bo, b) in c.bitmaps.iter() {
                                    let (_, longest) = bitmap_runs(&b.bits, bits as usize);
                                    prop_assert!(
                                        longest * S < want,
                                        "{:?} failed with bitmap {} run {}",
                                        op,
                                        bo,
                                        longest
                                    );
                                }
                            }
                        }
                    }
                }
                Op::Pin(s, l) => {
                    let r = c.pin(start + s * S, l * S);
                    let ok = valid(s, l) && !free.overlaps(s, s + l) && !pinned.overlaps(s, s + l);
                    prop_assert_eq!(r.is_ok(), ok, "{:?} -> {:?}", op, r);
                    if ok {
                        pinned.insert(s, s + l);
                    }
                }
                Op::UnpinAll => {
                    c.unpin_all();
                    for (&s, &e) in &pinned.0 {
                        free.insert(s, e);
                    }
                    pinned = Intervals::default();
                }
                Op::Policy(p) => c.set_policy(
                    [
                        BitmapPolicy::Default,
                        BitmapPolicy::Fragment,
                        BitmapPolicy::WhenFreeExtents,
                        BitmapPolicy::Always,
                        BitmapPolicy::Never,
                    ][p as usize],
                ),
            }
            prop_assert_eq!(c.free_ranges(), free.ranges(start, S), "after {:?}", op);
            prop_assert_eq!(c.pinned_ranges(), pinned.ranges(start, S));
            prop_assert_eq!(c.free_space(), free.0.iter().map(|(s, e)| (e - s) * S).sum::<u64>());
            c.check_invariants();
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 384, failure_persistence: None, ..ProptestConfig::default() })]

        /// Small bitmaps (256 bits, 1 M spans), a group not a multiple of the span.
        #[test]
        fn model_small_bitmaps(ops in proptest::collection::vec(op_strategy(5 * 256 + 7, 256), 1..80)) {
            run_model(1 << 30, (5 * 256 + 7) * S, 256, &ops)?;
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

        /// 32768-bit bitmaps (4 KiB pages), two spans and a bit.
        #[test]
        fn model_4k_page_bitmaps(ops in proptest::collection::vec(op_strategy(2 * 32768 + 3, 32768), 1..60)) {
            run_model(3 * 4096 * 1000, (2 * 32768 + 3) * S, 32768, &ops)?;
        }

        /// 131072-bit bitmaps (16 KiB pages), one span and a bit.
        #[test]
        fn model_16k_page_bitmaps(ops in proptest::collection::vec(op_strategy(131072 + 64, 131072), 1..60)) {
            run_model(1 << 30, (131072 + 64) * S, 131072, &ops)?;
        }
    }
}
