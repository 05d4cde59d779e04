//! The page cache: each inode's file data in memory, in folios of fs blocks, with the
//! kernel's per-block state (`btrfs_subpage`: uptodate, dirty, writeback bitmaps), and
//! the buffered read and write paths over it (`Engine::buffered_read`,
//! `Engine::buffered_write`).
//!
//! - A folio starts at a `FOLIO_SIZE`-aligned file offset (its slot) and holds a
//!   power-of-two number of whole blocks, up to `FOLIO_SIZE`: as small as the first
//!   access needs, grown when a later one reaches further (`FolioMap::slot_folio`), so
//!   small files keep small folios. (The writeback code takes any power-of-two folio
//!   of whole blocks; the bench uses 2 MiB ones.) Its
//!   blocks are uptodate when they hold the file's bytes, dirty when they hold bytes
//!   the trees do not have yet, under writeback while a submission carries them.
//! - The in-memory i_size (`PageCacheInner::i_size`) runs ahead of the on-disk one: a
//!   buffered write past EOF moves it at once, the INODE_ITEM's size moves when the
//!   ordered extents of the data complete (`disk_i_size`, the role of
//!   `btrfs_inode_safe_disk_i_size_write`). A truncation or size change goes to disk at
//!   once, so the on-disk size is never above the in-memory one.
//! - A truncation drops the folios wholly past the new size and zeroes the straddling
//!   folio past it, keeping its dirty bits (a folio is not split, as in the kernel):
//!   writeback then meets dirty blocks past EOF and truncates their ordered extents
//!   (`writeback`: no ordered extent past round_up(i_size) becomes a file extent
//!   item). If the size grows back first, those blocks are clean again (a hole).
//! - Every other change to a file's extents through the engine (direct writes,
//!   fallocate, punch, zero range) first writes the inode back and then drops the
//!   cached folios of the range it changes (`Engine::invalidate_for_change`), so the
//!   cache never shows bytes the trees no longer hold.
//!
//! Bounds (`Engine::set_page_cache_limits`, defaults `DEFAULT_CACHE_BYTES` and
//! `DEFAULT_DIRTY_BYTES`): past the dirty limit a writer writes inodes back before it
//! returns (the role of `balance_dirty_pages`), down to half the limit; past the cache
//! limit clean folios are dropped, least recently used inode first (LRU-ish: an inode's
//! folios go together, oldest folio first). Inodes with folios are held by the
//! engine's registry (`PageCacheGlobal`), so the inode cache never evicts an inode
//! with dirty data; an inode removed from disk has its folios discarded.
//!
//! Invariants (`PageCacheInner::check_invariants`, called by tests and debug builds):
//! dirty and writeback blocks are uptodate; no block is dirty and under writeback at
//! once (writeback holds the inode's lock exclusively from the clearing of the dirty
//! bits to the end of the I/O); bytes past i_size in uptodate blocks are zero; the
//! dirty-block count matches the bitmaps; the on-disk size is at most the in-memory
//! one; ordered extents are sane and disjoint (`ordered`).
//!
//! Locks: the inode's lock (i_rwsem) outside; each cache's mutex inside it and before
//! the engine's state (a miss is read from disk holding the mutex) and the registry's
//! mutex (a leaf: whoever holds it only *tries* a cache's mutex). The state lock is
//! never held while a cache's mutex is taken.

use crate::engine::Engine;
use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{FileKind, FsRead, InodeId, Load};
use crate::inode::inode_cache::Inode;
use crate::inode::ordered::OrderedTree;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Bytes of one cached folio: 16 blocks of 4 KiB, the size the kernel's large folios
/// reach for ordinary buffered writes.
pub const FOLIO_SIZE: u64 = 64 << 10;
/// Default bound on cached file data: a working set for a busy mount.
pub const DEFAULT_CACHE_BYTES: u64 = 512 << 20;
/// Default bound on dirty file data: what a crash may lose, and what one writer
/// stalls to write back at most.
pub const DEFAULT_DIRTY_BYTES: u64 = 128 << 20;

/// A fixed-size bitmap, one bit per block of a folio.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bitmap {
    words: Vec<u64>,
    nbits: u32,
}

fn range_mask(lo: u32, hi: u32) -> u64 {
    // Bits [lo, hi) of one word, 0 <= lo < hi <= 64.
    debug_assert!(lo < hi && hi <= 64, "range_mask({lo}, {hi})");
    let high = if hi == 64 { u64::MAX } else { (1u64 << hi) - 1 };
    high & !((1u64 << lo) - 1)
}

impl Bitmap {
    pub fn new(nbits: u32) -> Bitmap {
        Bitmap { words: vec![0; nbits.div_ceil(64) as usize], nbits }
    }

    /// The map with `nbits` bits, the new ones clear.
    pub fn grow(&mut self, nbits: u32) {
        assert!(nbits >= self.nbits, "bitmap of {} bits cannot grow to {nbits}", self.nbits);
        self.words.resize(nbits.div_ceil(64) as usize, 0);
        self.nbits = nbits;
    }

    pub fn len(&self) -> u32 {
        self.nbits
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    pub fn test(&self, bit: u32) -> bool {
        assert!(bit < self.nbits, "bit {bit} of a {}-bit map", self.nbits);
        self.words[(bit / 64) as usize] >> (bit % 64) & 1 == 1
    }

    /// `f(word index, mask)` for each word of bits [start, start + len) of a map of
    /// `nbits` bits.
    fn for_words(nbits: u32, start: u32, len: u32, mut f: impl FnMut(usize, u64)) {
        let end = start.checked_add(len).expect("bit range overflows");
        assert!(end <= nbits, "bits {start}+{len} of a {nbits}-bit map");
        let mut cur = start;
        while cur < end {
            let lo = cur % 64;
            let hi = (end - (cur - lo)).min(64);
            f((cur / 64) as usize, range_mask(lo, hi));
            cur += hi - lo;
        }
    }

    /// Set (`value`) or clear bits [start, start + len); returns how many changed.
    pub fn assign_range(&mut self, start: u32, len: u32, value: bool) -> u32 {
        self.set_range_where(start, len, None, value)
    }

    /// `assign_range` for the bits also set in `only` (all of them with `None`).
    fn set_range_where(&mut self, start: u32, len: u32, only: Option<&Bitmap>, value: bool) -> u32 {
        let mut changed = 0;
        let words = &mut self.words;
        Bitmap::for_words(self.nbits, start, len, |w, m| {
            let m = m & only.map_or(u64::MAX, |o| o.words[w]);
            let old = words[w];
            let new = if value { old | m } else { old & !m };
            changed += (old ^ new).count_ones();
            words[w] = new;
        });
        changed
    }

    /// Set bits in [start, start + len) are counted.
    pub fn count_range(&self, start: u32, len: u32) -> u32 {
        let mut n = 0;
        Bitmap::for_words(self.nbits, start, len, |w, m| n += (self.words[w] & m).count_ones());
        n
    }

    /// Clear every bit that is clear in `other`; returns how many were set.
    pub fn retain(&mut self, other: &Bitmap) -> u32 {
        assert_eq!(self.nbits, other.nbits, "bitmaps of {} and {} bits", self.nbits, other.nbits);
        let mut cleared = 0;
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            cleared += (*a & !b).count_ones();
            *a &= b;
        }
        cleared
    }

    pub fn set_range(&mut self, start: u32, len: u32) -> u32 {
        self.assign_range(start, len, true)
    }

    pub fn clear_range(&mut self, start: u32, len: u32) -> u32 {
        self.assign_range(start, len, false)
    }

    /// The first bit at or after `from` whose value is `value`, or `len()`.
    pub fn find_next(&self, from: u32, value: bool) -> u32 {
        let mut cur = from;
        while cur < self.nbits {
            let w = (cur / 64) as usize;
            let word = if value { self.words[w] } else { !self.words[w] };
            let masked = word & !((1u64 << (cur % 64)) - 1);
            if masked != 0 {
                return (w as u32 * 64 + masked.trailing_zeros()).min(self.nbits);
            }
            cur = (w as u32 + 1) * 64;
        }
        self.nbits
    }

    pub fn count(&self) -> u32 {
        self.words.iter().map(|w| w.count_ones()).sum()
    }

    /// Every bit set here is set in `other`.
    pub fn is_subset_of(&self, other: &Bitmap) -> bool {
        self.nbits == other.nbits && self.words.iter().zip(&other.words).all(|(a, b)| a & !b == 0)
    }

    pub fn intersects(&self, other: &Bitmap) -> bool {
        self.words.iter().zip(&other.words).any(|(a, b)| a & b != 0)
    }
}

/// Freed buffers of full-size folios, for the next folios to take: a fresh allocation
/// costs a page fault per 4 KiB page at its first write, and a streaming write drops
/// and makes folios all the time. At most `FOLIO_POOL_BYTES`, shared by the engines
/// of the process.
static FOLIO_POOL: Mutex<Vec<Box<[u8]>>> = Mutex::new(Vec::new());

/// Bytes of freed folio buffers kept for reuse, beyond the cache's limit.
pub const FOLIO_POOL_BYTES: u64 = 32 << 20;

/// The buffer of a new folio of `size` bytes. Its bytes are whatever they were: only
/// uptodate blocks are ever read, and a block becomes uptodate by being filled. (Debug
/// builds fill new buffers with 0xa5, so a read of anything else shows in tests.)
fn folio_data(size: u64) -> Box<[u8]> {
    let pooled = if size == FOLIO_SIZE {
        FOLIO_POOL.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop()
    } else {
        None
    };
    let mut b = pooled.unwrap_or_else(|| vec![0u8; size as usize].into_boxed_slice());
    if cfg!(debug_assertions) {
        b.fill(0xa5);
    }
    b
}

/// One folio of a file: `data.len()` bytes from file offset `start`, in blocks of
/// `blocksize`.
#[derive(Debug)]
pub struct Folio {
    pub start: u64,
    pub blocksize: u32,
    pub data: Box<[u8]>,
    pub uptodate: Bitmap,
    pub dirty: Bitmap,
    pub writeback: Bitmap,
    /// Blocks made dirty over a hole (the kernel's EXTENT_DELALLOC_NEW): their
    /// writeback adds to the inode's nbytes, so st_blocks counts them already. The bit
    /// stays through writeback until the ordered extent completes.
    pub new: Bitmap,
    /// The tick of its last use (LRU order within the inode).
    pub(crate) last_use: u64,
}

impl Drop for Folio {
    fn drop(&mut self) {
        if self.data.len() as u64 == FOLIO_SIZE {
            let mut pool = FOLIO_POOL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if (pool.len() as u64 + 1) * FOLIO_SIZE <= FOLIO_POOL_BYTES {
                pool.push(std::mem::take(&mut self.data));
            }
        }
    }
}

impl Folio {
    /// A folio of `size` bytes (a power-of-two multiple of `blocksize`, aligned at
    /// `start`) with nothing uptodate.
    pub fn new(start: u64, size: u64, blocksize: u32) -> Folio {
        assert!(
            size.is_power_of_two() && size >= u64::from(blocksize),
            "folio size {size} for block size {blocksize}"
        );
        assert_eq!(start % size, 0, "folio at {start} not aligned to its size {size}");
        let n = (size / u64::from(blocksize)) as u32;
        Folio {
            start,
            blocksize,
            data: folio_data(size),
            uptodate: Bitmap::new(n),
            dirty: Bitmap::new(n),
            writeback: Bitmap::new(n),
            new: Bitmap::new(n),
            last_use: 0,
        }
    }

    pub fn size(&self) -> u64 {
        self.data.len() as u64
    }

    /// The folio with `size` bytes (a larger power of two, still aligned at its
    /// start): its bytes and block state stay, the new blocks are not uptodate.
    pub fn grow(&mut self, size: u64) {
        assert!(
            size.is_power_of_two() && size > self.size(),
            "folio {} of {} bytes cannot grow to {size}",
            self.start,
            self.size()
        );
        assert_eq!(self.start % size, 0, "folio at {} not aligned to {size}", self.start);
        let mut data = folio_data(size);
        data[..self.data.len()].copy_from_slice(&self.data);
        self.data = data;
        let n = (size / u64::from(self.blocksize)) as u32;
        self.uptodate.grow(n);
        self.dirty.grow(n);
        self.writeback.grow(n);
        self.new.grow(n);
    }

    pub fn end(&self) -> u64 {
        self.start + self.size()
    }

    pub fn nblocks(&self) -> u32 {
        self.uptodate.len()
    }

    /// Block index of file offset `off` (inside the folio).
    pub fn block_of(&self, off: u64) -> u32 {
        assert!(
            off >= self.start && off < self.end(),
            "offset {off} outside folio {}+{}",
            self.start,
            self.size()
        );
        ((off - self.start) / u64::from(self.blocksize)) as u32
    }

    /// Nothing dirty, nothing under writeback or waiting for its ordered extent to
    /// complete (`new`): the folio may be dropped.
    pub fn is_clean(&self) -> bool {
        self.dirty.is_empty() && self.writeback.is_empty() && self.new.is_empty()
    }
}

/// Page cache of one inode (the `pages` field of `InodeMapping`).
#[derive(Debug, Default)]
pub struct PageCache {
    inner: Mutex<PageCacheInner>,
}

impl PageCache {
    pub(crate) fn lock(&self) -> MutexGuard<'_, PageCacheInner> {
        // Only a failed assertion panics under this mutex; the caller's inode lock
        // keeps the folios' contents consistent with the writer that held it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Check the invariants of the module notes; panics naming the first that fails.
    pub fn check_invariants(&self) {
        self.lock().check_invariants();
    }
}

/// What a buffered write asks besides its data.
#[derive(Clone, Copy, Default)]
pub struct WriteOpts<'a> {
    /// The writer lacks CAP_FSETID (the VFS's `file_remove_privs`, FUSE's
    /// FUSE_WRITE_KILL_SUIDGID): the file loses its set-user-ID bits as
    /// `write::mode_without_privs` says. (File capabilities are the caller's: the VFS
    /// removes `security.capability` itself before the write.)
    pub kill_suidgid: bool,
    /// Whether the writer is in group `gid` (`in_group_p`), asked only for a
    /// set-group-ID file without group execute; None: in none.
    pub in_group: Option<&'a dyn Fn(u32) -> bool>,
}

impl std::fmt::Debug for WriteOpts<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteOpts")
            .field("kill_suidgid", &self.kill_suidgid)
            .field("in_group", &self.in_group.is_some())
            .finish()
    }
}

/// An inode's folios by file offset, with their total size kept as they come and go:
/// every cache change asks for it (`with_cache`), and a sum over the folios there made
/// a 4 KiB write into a large cached file cost a walk of all its folios. Reads go
/// through `Deref`; only the methods here add or drop folios (a `&mut Folio` cannot
/// change its size: `data` is never replaced).
#[derive(Debug, Default)]
pub struct FolioMap {
    map: BTreeMap<u64, Folio>,
    bytes: u64,
}

impl std::ops::Deref for FolioMap {
    type Target = BTreeMap<u64, Folio>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl FolioMap {
    /// The folio of the `FOLIO_SIZE` slot at `start`, reaching at least `end`: made
    /// with the smallest power-of-two size of whole blocks that reaches it, or grown
    /// to that size. A small file keeps small folios (a 1 KiB file takes one block,
    /// not a whole slot), as the kernel sizes a new folio by the write that makes it.
    pub(crate) fn slot_folio(&mut self, start: u64, end: u64, blocksize: u32) -> &mut Folio {
        assert_eq!(start % FOLIO_SIZE, 0, "page cache: folio slot at {start}");
        assert!(
            end > start && end - start <= FOLIO_SIZE,
            "page cache: [{start}, {end}) is not inside one folio slot"
        );
        let size = (end - start).next_power_of_two().max(u64::from(blocksize));
        let bytes = &mut self.bytes;
        let f = self.map.entry(start).or_insert_with(|| {
            *bytes += size;
            Folio::new(start, size, blocksize)
        });
        if f.size() < size {
            *bytes += size - f.size();
            f.grow(size);
        }
        f
    }

    pub(crate) fn get_mut(&mut self, start: &u64) -> Option<&mut Folio> {
        self.map.get_mut(start)
    }

    pub(crate) fn range_mut<R: std::ops::RangeBounds<u64>>(
        &mut self,
        r: R,
    ) -> std::collections::btree_map::RangeMut<'_, u64, Folio> {
        self.map.range_mut(r)
    }

    pub(crate) fn remove(&mut self, start: &u64) -> Option<Folio> {
        let f = self.map.remove(start)?;
        self.bytes -= f.size();
        Some(f)
    }

    pub(crate) fn clear(&mut self) {
        self.map.clear();
        self.bytes = 0;
    }

    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&u64, &mut Folio) -> bool) {
        let bytes = &mut self.bytes;
        self.map.retain(|k, f| {
            let k2 = keep(k, f);
            if !k2 {
                *bytes -= f.size();
            }
            k2
        });
    }

    /// The kept total is the folios' sizes.
    fn check_invariants(&self) {
        let sum: u64 = self.map.values().map(Folio::size).sum();
        assert_eq!(
            self.bytes, sum,
            "page cache: folio bytes kept as {} but the folios hold {sum}",
            self.bytes
        );
    }
}

/// The state behind a `PageCache`'s mutex.
#[derive(Debug, Default)]
pub struct PageCacheInner {
    /// Folios by file offset.
    pub(crate) folios: FolioMap,
    /// In-memory size, once known (read from the INODE_ITEM at first use).
    pub(crate) i_size: Option<u64>,
    /// The INODE_ITEM's size as the trees have it (known when `i_size` is).
    pub(crate) disk_i_size: u64,
    /// Where the blocks the trees allocated for the file end, as far as the cache
    /// knows (the size when the cache was filled, lowered by truncation, raised by
    /// writeback; a size grown by truncate adds a hole, not blocks): blocks past it
    /// are holes unless the file has preallocated extents.
    pub(crate) new_from: u64,
    /// Dirty blocks over all folios.
    pub(crate) dirty_blocks: u64,
    /// `new` blocks over all folios; `with_cache` moves each change to the in-memory
    /// inode's new delalloc bytes.
    pub(crate) new_blocks: u64,
    /// Of the `new` blocks a change clears, the bytes an ordered extent's completion
    /// already moved into nbytes (`Inode::set_attrs_settling`).
    pub(crate) settled_new: u64,
    /// Ordered extents alive (only during the inode's writeback).
    pub(crate) ordered: OrderedTree,
}

/// What a shrink of a cache over `limit` brings it down to.
fn shrink_target(limit: u64) -> u64 {
    limit - limit / 8
}

impl PageCacheInner {
    pub(crate) fn cached_bytes(&self) -> u64 {
        self.folios.bytes
    }

    /// Nothing cached any more: the sizes are read again from the trees at the next
    /// use, so changes made meanwhile by paths that skip uncached inodes are seen.
    pub(crate) fn forget_sizes(&mut self) {
        self.i_size = None;
        self.disk_i_size = 0;
        self.new_from = 0;
    }

    pub(crate) fn dirty_bytes(&self, blocksize: u32) -> u64 {
        self.dirty_blocks * u64::from(blocksize)
    }

    /// The folios over [start, end), each with the blocks of it inside the range:
    /// (folio start, first block, block count).
    fn blocks_of(&self, start: u64, end: u64) -> Vec<(u64, u32, u32)> {
        let first = self.folios.range(..=start).next_back().map_or(start, |(&k, _)| k);
        self.folios
            .range(first..end)
            .map(|(_, f)| f)
            .filter_map(|f| {
                let bs = u64::from(f.blocksize);
                let (a, z) = (start.max(f.start), end.min(f.end()));
                if a >= z {
                    return None;
                }
                let (b0, b1) = (((a - f.start) / bs) as u32, ((z - f.start).div_ceil(bs)) as u32);
                Some((f.start, b0, b1 - b0))
            })
            .collect()
    }

    /// Copy the cached bytes of [start, start + buf.len()) into `buf`; returns how far
    /// from `start` folios covered it without a gap (the caller's range is dirty or
    /// under writeback, so cached whole).
    pub(crate) fn copy_out(&self, start: u64, buf: &mut [u8]) -> u64 {
        let end = start + buf.len() as u64;
        let mut cur = start;
        for (k, b, n) in self.blocks_of(start, end) {
            let f = &self.folios[&k];
            let (a, z) = (
                (f.start + u64::from(b) * u64::from(f.blocksize)).max(start),
                (f.start + u64::from(b + n) * u64::from(f.blocksize)).min(end),
            );
            if a != cur {
                break;
            }
            buf[(a - start) as usize..(z - start) as usize]
                .copy_from_slice(&f.data[(a - f.start) as usize..(z - f.start) as usize]);
            cur = z;
        }
        cur - start
    }

    /// Copy [start, start + buf.len()) out of the cache if every block of it is
    /// cached and uptodate; false (`buf` then unspecified) if any is not.
    pub(crate) fn copy_uptodate(&self, start: u64, buf: &mut [u8]) -> bool {
        let end = start + buf.len() as u64;
        let uptodate = self
            .blocks_of(start, end)
            .into_iter()
            .all(|(k, b, n)| self.folios[&k].uptodate.count_range(b, n) == n);
        uptodate && self.copy_out(start, buf) == buf.len() as u64
    }

    /// Bytes of `new` blocks in [start, start + len).
    pub(crate) fn new_bytes_in(&self, start: u64, len: u64) -> u64 {
        self.blocks_of(start, start + len)
            .into_iter()
            .map(|(k, b, n)| {
                u64::from(self.folios[&k].new.count_range(b, n))
                    * u64::from(self.folios[&k].blocksize)
            })
            .sum()
    }

    pub fn check_invariants(&self) {
        let mut dirty = 0u64;
        let mut new = 0u64;
        let i_size = self.i_size.unwrap_or(0);
        if self.i_size.is_none() {
            assert!(
                self.folios.is_empty(),
                "page cache: {} folios while the size is unknown",
                self.folios.len()
            );
        }
        assert!(
            self.disk_i_size <= i_size,
            "page cache: on-disk size {} above the in-memory size {i_size}",
            self.disk_i_size
        );
        self.folios.check_invariants();
        let mut prev_end = 0;
        for (&start, f) in self.folios.iter() {
            assert_eq!(start, f.start, "page cache: folio keyed {start} starts at {}", f.start);
            assert!(
                start >= prev_end,
                "page cache: folio {start} overlaps the one before (ending {prev_end})"
            );
            prev_end = f.end();
            assert!(
                f.dirty.is_subset_of(&f.uptodate),
                "page cache: folio {start} has dirty blocks that are not uptodate"
            );
            assert!(
                f.writeback.is_subset_of(&f.uptodate),
                "page cache: folio {start} has blocks under writeback that are not uptodate"
            );
            assert!(
                !f.dirty.intersects(&f.writeback),
                "page cache: folio {start} has blocks both dirty and under writeback"
            );
            dirty += u64::from(f.dirty.count());
            new += u64::from(f.new.count());
            let bs = u64::from(f.blocksize);
            let past =
                i_size.div_ceil(bs).saturating_sub(f.start / bs).min(u64::from(f.nblocks())) as u32;
            assert!(
                f.new.find_next(past, true) >= f.nblocks(),
                "page cache: folio {start} has new blocks past i_size {i_size}"
            );
            for b in 0..f.nblocks() {
                let bstart = f.start + u64::from(b) * bs;
                if !f.uptodate.test(b) || bstart + bs <= i_size {
                    continue;
                }
                let from = i_size.saturating_sub(bstart) as usize;
                let off = (bstart - f.start) as usize;
                let tail = &f.data[off + from..off + bs as usize];
                assert!(
                    tail.iter().all(|&x| x == 0),
                    "page cache: block at {bstart} holds non-zero bytes past i_size {i_size}"
                );
            }
        }
        assert_eq!(
            dirty, self.dirty_blocks,
            "page cache: dirty count {} but the bitmaps hold {dirty}",
            self.dirty_blocks
        );
        assert_eq!(
            new, self.new_blocks,
            "page cache: new count {} but the bitmaps hold {new}",
            self.new_blocks
        );
        self.ordered.check_invariants();
    }

    /// Drop folios wholly at or past `size` and zero the straddling one past it (dirty
    /// bits stay: see the module notes; blocks past the size are no longer new).
    /// Returns the bytes of folios dropped.
    pub(crate) fn truncate(&mut self, size: u64) -> u64 {
        let gone: Vec<u64> = self.folios.range(size..).map(|(&s, _)| s).collect();
        let mut dropped = 0;
        for s in gone {
            let f = self.folios.remove(&s).expect("listed just above");
            assert!(f.writeback.is_empty(), "page cache: truncating folio {s} under writeback");
            self.dirty_blocks -= u64::from(f.dirty.count());
            self.new_blocks -= u64::from(f.new.count());
            dropped += f.size();
        }
        if let Some((_, f)) = self.folios.range_mut(..size).next_back() {
            if f.end() > size {
                let from = (size - f.start) as usize;
                f.data[from..].fill(0);
                let b = (size - f.start).div_ceil(u64::from(f.blocksize)) as u32;
                let n = f.nblocks() - b;
                self.new_blocks -= u64::from(f.new.clear_range(b, n));
            }
        }
        dropped
    }

    /// After a writeback of the folios at `starts`: their written blocks are no longer
    /// new; `settled` bytes of them the completions already moved into nbytes.
    pub(crate) fn clear_new_written(&mut self, starts: &[u64], settled: u64) {
        for s in starts {
            if let Some(f) = self.folios.get_mut(s) {
                self.new_blocks -= u64::from(f.new.retain(&f.dirty));
            }
        }
        self.settled_new += settled;
    }

    /// Drop the clean folios that intersect [start, end) (after a writeback, every
    /// folio is clean). Returns the bytes dropped.
    pub(crate) fn drop_range(&mut self, start: u64, end: u64) -> u64 {
        let first = start / FOLIO_SIZE * FOLIO_SIZE;
        let gone: Vec<u64> = self
            .folios
            .range(first..end)
            .filter(|(_, f)| f.end() > start && f.is_clean())
            .map(|(&s, _)| s)
            .collect();
        gone.iter().map(|s| self.folios.remove(s).expect("listed just above").size()).sum()
    }

    /// Whether some block of [a, z) (inside the folio at `fstart`) is not dirty.
    fn has_clean_block(&self, fstart: u64, a: u64, z: u64) -> bool {
        let f = &self.folios[&fstart];
        let bs = u64::from(f.blocksize);
        let (b0, b1) = (
            ((a.max(f.start) - f.start) / bs) as u32,
            ((z.min(f.end()) - f.start).div_ceil(bs)) as u32,
        );
        b0 < b1 && f.dirty.find_next(b0, false) < b1
    }

    /// Mark blocks [off, off + len) of the folio at `fstart` dirty (and uptodate).
    fn mark_dirty(&mut self, fstart: u64, off: u64, len: u64) {
        let f = self.folios.get_mut(&fstart).expect("folio present");
        let bs = u64::from(f.blocksize);
        let b0 = f.block_of(off);
        let b1 = ((off + len - f.start).div_ceil(bs)) as u32;
        f.uptodate.set_range(b0, b1 - b0);
        self.dirty_blocks += u64::from(f.dirty.set_range(b0, b1 - b0));
    }

    /// The blocks of [start, start + len) are not dirty.
    pub(crate) fn clear_dirty(&mut self, start: u64, len: u64) {
        for (k, b, n) in self.blocks_of(start, start + len) {
            let f = self.folios.get_mut(&k).expect("listed above");
            self.dirty_blocks -= u64::from(f.dirty.clear_range(b, n));
        }
    }

    /// The blocks of [start, start + len) are not new.
    pub(crate) fn clear_new(&mut self, start: u64, len: u64) {
        for (k, b, n) in self.blocks_of(start, start + len) {
            let f = self.folios.get_mut(&k).expect("listed above");
            self.new_blocks -= u64::from(f.new.clear_range(b, n));
        }
    }

    /// The dirty blocks inside the block-aligned ranges `holes` become new.
    fn mark_new(&mut self, holes: &[(u64, u64)]) {
        for &(hs, he) in holes {
            for (k, b, n) in self.blocks_of(hs, he) {
                let f = self.folios.get_mut(&k).expect("listed above");
                self.new_blocks += u64::from(f.new.set_range_where(b, n, Some(&f.dirty), true));
            }
        }
    }
}

/// What the page cache holds now, and what its bounds did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageCacheStats {
    pub cached_bytes: u64,
    pub dirty_bytes: u64,
    pub cache_limit: u64,
    pub dirty_limit: u64,
    /// Inodes with folios.
    pub inodes: u64,
    /// Clean folios dropped for the cache limit.
    pub evicted_folios: u64,
    /// Inodes a writer wrote back because the dirty limit was passed.
    pub throttle_writebacks: u64,
    /// Ordered extents completed, and those of them truncated (in part or whole).
    pub ordered_finished: u64,
    pub ordered_truncated: u64,
}

/// The engine's side of the page cache: limits, totals and the inodes with folios.
#[derive(Debug)]
pub struct PageCacheGlobal {
    pub(crate) cache_limit: AtomicU64,
    pub(crate) dirty_limit: AtomicU64,
    pub(crate) cached: AtomicU64,
    /// Inodes with folios, held (so the inode cache keeps them) with the tick of
    /// their last use.
    pub(crate) inodes: Mutex<HashMap<InodeId, (Arc<Inode>, u64)>>,
    pub(crate) tick: AtomicU64,
    pub(crate) evicted_folios: AtomicU64,
    pub(crate) throttle_writebacks: AtomicU64,
    pub(crate) ordered_finished: AtomicU64,
    pub(crate) ordered_truncated: AtomicU64,
    /// Largest ordered extent delalloc makes (`MAX_EXTENT_SIZE` but in tests).
    pub(crate) max_extent: AtomicU64,
}

impl Default for PageCacheGlobal {
    fn default() -> PageCacheGlobal {
        PageCacheGlobal {
            cache_limit: AtomicU64::new(DEFAULT_CACHE_BYTES),
            dirty_limit: AtomicU64::new(DEFAULT_DIRTY_BYTES),
            cached: AtomicU64::new(0),
            inodes: Mutex::new(HashMap::new()),
            tick: AtomicU64::new(1),
            evicted_folios: AtomicU64::new(0),
            throttle_writebacks: AtomicU64::new(0),
            ordered_finished: AtomicU64::new(0),
            ordered_truncated: AtomicU64::new(0),
            max_extent: AtomicU64::new(crate::inode::write::MAX_EXTENT_SIZE),
        }
    }
}

impl PageCacheGlobal {
    pub(crate) fn registry(&self) -> MutexGuard<'_, HashMap<InodeId, (Arc<Inode>, u64)>> {
        self.inodes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn next_tick(&self) -> u64 {
        self.tick.fetch_add(1, Ordering::Relaxed)
    }

    /// Apply a change of one inode's usage from `before` to `after` (cached, dirty).
    /// The dirty total is kept by the data reservations (`rsv`): dirty bytes hold data
    /// space until writeback allocates it, so the one counter serves both.
    pub(crate) fn account(
        &self,
        rsv: &crate::space::data_rsv::DataReservations,
        before: (u64, u64),
        after: (u64, u64),
    ) {
        rsv.dirty_moved(before.1, after.1);
        if after.0 >= before.0 {
            self.cached.fetch_add(after.0 - before.0, Ordering::AcqRel);
        } else {
            let prev = self.cached.fetch_sub(before.0 - after.0, Ordering::AcqRel);
            assert!(
                prev >= before.0 - after.0,
                "page cache: cached total {prev} below a release of {}",
                before.0 - after.0
            );
        }
    }
}

/// The parts of the block-aligned [a, z) that the file extents `recs` (sorted, as
/// `FsRead::file_extents` gives them) leave uncovered: the holes, explicit hole
/// extents included. An inline extent takes its whole block.
fn holes_between(
    recs: &[crate::inode::filesystem::FileExtentRec],
    a: u64,
    z: u64,
    bs: u64,
) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut pos = a;
    for r in recs.iter().filter(|r| {
        !matches!(r.kind, crate::inode::filesystem::ExtentKind::Regular { disk_bytenr: 0, .. })
    }) {
        let (s, e) = (r.file_offset / bs * bs, r.end().div_ceil(bs) * bs);
        if s > pos {
            out.push((pos, s.min(z)));
        }
        pos = pos.max(e);
        if pos >= z {
            return out;
        }
    }
    if pos < z {
        out.push((pos, z));
    }
    out
}

/// A cache mutation of one inode under its mutex, with the totals kept right: `f`
/// runs on the inner state, the usage change goes to the engine's totals, and an
/// inode left without folios leaves the registry (one with folios joins it).
pub(crate) fn with_cache<T>(
    e: &Engine,
    inode: &Arc<Inode>,
    f: impl FnOnce(&mut PageCacheInner) -> T,
) -> T {
    let g = &e.pages;
    let bs = e.info().sectorsize;
    let mut pc = inode.mapping.pages.lock();
    let before = (pc.cached_bytes(), pc.dirty_bytes(bs));
    let new_before = pc.new_blocks;
    let r = f(&mut pc);
    let after = (pc.cached_bytes(), pc.dirty_bytes(bs));
    // New blocks change the inode's new delalloc bytes (under the cache's mutex, so
    // the two move in the cache's order), less what completions already moved.
    let settled = std::mem::take(&mut pc.settled_new);
    if pc.new_blocks != new_before || settled > 0 {
        let bsz = u64::from(bs);
        let (add, sub) = (
            pc.new_blocks.saturating_sub(new_before) * bsz,
            new_before.saturating_sub(pc.new_blocks) * bsz,
        );
        assert!(settled <= sub, "{}: {settled} settled new bytes but {sub} cleared", inode.id);
        inode.adjust_new_delalloc(add, sub - settled);
    }
    let empty = pc.folios.is_empty() && pc.ordered.is_empty();
    if empty {
        pc.forget_sizes();
    }
    if cfg!(debug_assertions) && pc.folios.len() <= 64 {
        pc.check_invariants();
    }
    // The cache's mutex, then the registry's (holders of the registry only try the
    // caches' mutexes).
    let mut reg = g.registry();
    g.account(&e.info().data_rsv, before, after);
    if empty {
        reg.remove(&inode.id);
    } else {
        let tick = g.next_tick();
        reg.insert(inode.id, (inode.clone(), tick));
    }
    drop(reg);
    drop(pc);
    r
}

fn lock_exclusive(i: &Inode) -> std::sync::RwLockWriteGuard<'_, ()> {
    i.lock.write().unwrap_or_else(|p| p.into_inner())
}

fn lock_shared(i: &Inode) -> std::sync::RwLockReadGuard<'_, ()> {
    i.lock.read().unwrap_or_else(|p| p.into_inner())
}

impl Engine {
    /// Set the page cache's bounds (see the module notes): at most `cache_bytes` of
    /// file data cached, at most `dirty_bytes` of it dirty (clamped to `cache_bytes`,
    /// at least one folio each). Applies at once: the cache shrinks and writers past
    /// the dirty limit write back at their next write.
    pub fn set_page_cache_limits(&self, cache_bytes: u64, dirty_bytes: u64) {
        let cache = cache_bytes.max(FOLIO_SIZE);
        self.pages.cache_limit.store(cache, Ordering::Release);
        self.pages.dirty_limit.store(dirty_bytes.clamp(FOLIO_SIZE, cache), Ordering::Release);
        if self.pages.cached.load(Ordering::Acquire) > cache {
            self.drop_clean_folios(shrink_target(cache));
        }
    }

    /// The page cache's totals and counters now.
    pub fn page_cache_stats(&self) -> PageCacheStats {
        let g = &self.pages;
        PageCacheStats {
            cached_bytes: g.cached.load(Ordering::Acquire),
            dirty_bytes: self.info().data_rsv.dirty(),
            cache_limit: g.cache_limit.load(Ordering::Acquire),
            dirty_limit: g.dirty_limit.load(Ordering::Acquire),
            inodes: g.registry().len() as u64,
            evicted_folios: g.evicted_folios.load(Ordering::Acquire),
            throttle_writebacks: g.throttle_writebacks.load(Ordering::Acquire),
            ordered_finished: g.ordered_finished.load(Ordering::Acquire),
            ordered_truncated: g.ordered_truncated.load(Ordering::Acquire),
        }
    }

    /// Check every cached inode's invariants and that the totals are their sums
    /// (callers make sure no buffered operation runs meanwhile).
    pub fn check_page_cache_invariants(&self) {
        let bs = self.info().sectorsize;
        let held: Vec<Arc<Inode>> =
            self.pages.registry().values().map(|(i, _)| i.clone()).collect();
        let (mut cached, mut dirty) = (0, 0);
        for inode in &held {
            let id = inode.id;
            let pc = inode.mapping.pages.lock();
            pc.check_invariants();
            assert!(
                !pc.folios.is_empty() || !pc.ordered.is_empty(),
                "page cache: registry holds {id} without folios"
            );
            // Outside a writeback (the callers' quiet), new blocks are dirty ones.
            for f in pc.folios.values() {
                assert!(
                    f.new.is_subset_of(&f.dirty),
                    "page cache: {id}: folio {} has new blocks that are not dirty",
                    f.start
                );
            }
            // And a dirty block inside the file is new exactly when the trees have no
            // extent under it.
            let bsz = u64::from(bs);
            let end = pc.i_size.unwrap_or(0).div_ceil(bsz) * bsz;
            let recs =
                self.read(|l| l.file_extents(id, 0, end)).expect("page cache check: file extents");
            let holes = holes_between(&recs, 0, end, bsz);
            for f in pc.folios.values() {
                for b in 0..f.nblocks() {
                    let off = f.start + u64::from(b) * bsz;
                    if off >= end || !f.dirty.test(b) {
                        continue;
                    }
                    let hole = holes.iter().any(|&(s, e)| s <= off && off < e);
                    assert_eq!(
                        f.new.test(b),
                        hole,
                        "page cache: {id}: dirty block {off} is new {} over a hole {hole}",
                        f.new.test(b)
                    );
                }
            }
            let nd = inode.new_delalloc();
            assert_eq!(
                nd,
                pc.new_blocks * u64::from(bs),
                "page cache: {id} counts {nd} new delalloc bytes but has {} new blocks",
                pc.new_blocks
            );
            cached += pc.cached_bytes();
            dirty += pc.dirty_bytes(bs);
        }
        assert_eq!(
            cached,
            self.pages.cached.load(Ordering::Acquire),
            "page cache: cached total differs from the inodes' sum"
        );
        assert_eq!(
            dirty,
            self.info().data_rsv.dirty(),
            "page cache: dirty total differs from the inodes' sum"
        );
    }

    /// The INODE_ITEM of regular file `id` for a buffered operation (`Posix(IsDir)` /
    /// `Posix(Invalid)` otherwise): the in-memory inode's copy when it has one (the
    /// writer keeps it current), else the tree's.
    fn regular_item(&self, inode: &Inode) -> Result<ubtrfs_format::structs::InodeItem> {
        use ubtrfs_format::structs::{S_IFMT, S_IFREG};
        if let Some(a) = inode.attrs().filter(|a| a.mode.get() & S_IFMT == S_IFREG) {
            return Ok(a);
        }
        let id = inode.id;
        self.read(|l| {
            let v = l.load_inode(id, Load::ITEM)?;
            match v.kind() {
                FileKind::File => Ok(v.item),
                FileKind::Dir => Err(Error::posix(PosixKind::IsDir, id.to_string())),
                _ => Err(Error::posix(PosixKind::Invalid, format!("{id} is not a regular file"))),
            }
        })
    }

    /// Make the blocks of [start, end) of folio `fstart` uptodate, reading those that
    /// are not from the trees (bytes past the on-disk size read as zeros).
    fn fill_folio(
        &self,
        id: InodeId,
        pc: &mut PageCacheInner,
        fstart: u64,
        start: u64,
        end: u64,
    ) -> Result<()> {
        let bs = u64::from(self.info().sectorsize);
        let disk = pc.disk_i_size;
        let f = pc.folios.get_mut(&fstart).expect("folio present");
        let mut b = f.block_of(start);
        let last = ((end - f.start).div_ceil(bs)) as u32;
        while b < last {
            let s = f.uptodate.find_next(b, false);
            if s >= last {
                break;
            }
            let e = f.uptodate.find_next(s, true).min(last);
            let (off, len) = (u64::from(s) * bs, u64::from(e - s) * bs);
            let buf = &mut f.data[off as usize..(off + len) as usize];
            let n = if f.start + off < disk { self.read_file(id, f.start + off, buf)? } else { 0 };
            buf[n..].fill(0);
            f.uptodate.set_range(s, e - s);
            b = e;
        }
        Ok(())
    }

    /// Read file `id` at `offset` into `buf` through the page cache; returns the bytes
    /// read (short at the in-memory EOF). Dirty data is seen; misses are filled from
    /// the trees (`Engine::read_file`) and stay cached.
    ///
    /// # Errors
    /// `Posix(IsDir)` / `Posix(Invalid)` for a directory or another non-regular inode;
    /// as `Engine::read_file`.
    pub fn buffered_read(&self, id: InodeId, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let inode = self.inodes().get(id);
        let _g = lock_shared(&inode);
        let ii = self.regular_item(&inode)?;
        let bs = self.info().sectorsize;
        let r = with_cache(self, &inode, |pc| -> Result<usize> {
            if pc.i_size.is_none() {
                pc.i_size = Some(ii.size.get());
                pc.disk_i_size = ii.size.get();
                pc.new_from = ii.size.get();
            }
            let size = pc.i_size.expect("set above");
            if offset >= size || buf.is_empty() {
                return Ok(0);
            }
            let end = offset + (buf.len() as u64).min(size - offset);
            let mut cur = offset;
            while cur < end {
                let fstart = cur / FOLIO_SIZE * FOLIO_SIZE;
                let fend = (fstart + FOLIO_SIZE).min(end);
                pc.folios.slot_folio(fstart, fend, bs);
                self.fill_folio(id, pc, fstart, cur, fend)?;
                let f = pc.folios.get_mut(&fstart).expect("inserted above");
                f.last_use = self.pages.next_tick();
                let from = (cur - fstart) as usize;
                buf[(cur - offset) as usize..(fend - offset) as usize]
                    .copy_from_slice(&f.data[from..from + (fend - cur) as usize]);
                cur = fend;
            }
            Ok((end - offset) as usize)
        });
        drop(_g);
        // Reads make nothing dirty: they only drop clean folios (writers write back).
        let limit = self.pages.cache_limit.load(Ordering::Acquire);
        if self.pages.cached.load(Ordering::Acquire) > limit {
            self.drop_clean_folios(shrink_target(limit));
        }
        r
    }

    /// Write `data` at `offset` of regular file `id` into the page cache: the blocks
    /// become dirty and the in-memory size grows; the trees get the data at writeback
    /// (`writeback_inode`, `fsync`, `sync`, or a writer past the dirty limit, which
    /// this call may itself be). Checks what `FsWriter::write_file` checks first.
    ///
    /// # Errors
    /// `Posix(IsDir)` / `Posix(Invalid)` for a non-regular inode, `Posix(NotPermitted)`
    /// for an immutable file or an append-only one written elsewhere than at its end,
    /// `Posix(ReadOnly)` on a read-only subvolume or engine; reads of partial blocks;
    /// errors of the writeback the dirty limit forces.
    pub fn buffered_write(&self, id: InodeId, offset: u64, data: &[u8]) -> Result<()> {
        self.buffered_write_opts(id, offset, data, WriteOpts::default())
    }

    /// `buffered_write`, with what the writer asks besides the data (`WriteOpts`).
    ///
    /// # Errors
    /// As `buffered_write`.
    pub fn buffered_write_opts(
        &self,
        id: InodeId,
        offset: u64,
        data: &[u8],
        opts: WriteOpts,
    ) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let end = offset
            .checked_add(data.len() as u64)
            .ok_or_else(|| Error::posix(PosixKind::Invalid, "write past the maximum file size"))?;
        // The data space the blocks will take at writeback, before the inode's lock
        // (the slow path writes other inodes back). Blocks dirty already are counted
        // twice until the write is in, which only matters on a full filesystem, where
        // that path writes them back first.
        let bsz = u64::from(self.info().sectorsize);
        let _rsv = self.reserve_data_space(id, offset / bsz * bsz, end.div_ceil(bsz) * bsz)?;
        let inode = self.inodes().get(id);
        let g = lock_exclusive(&inode);
        let ii = self.regular_item(&inode)?;
        crate::inode::write::iflags_allow(
            id.root,
            id.ino,
            ii.flags.get(),
            crate::inode::write::IflagOp::Write,
            b"",
        )?;
        let bs = self.info().sectorsize;
        // The size cannot move while the inode's lock is held (an empty cache reads
        // it from the item, as below).
        let size = with_cache(self, &inode, |pc| pc.i_size).unwrap_or(ii.size.get());
        if ii.flags.get() & ubtrfs_format::structs::INODE_APPEND != 0 && offset != size {
            return Err(Error::posix(
                PosixKind::NotPermitted,
                format!("{id} is append-only: writes must start at its size {size}, not {offset}"),
            ));
        }
        // The write's times, as the kernel's file_update_time sets them once the
        // write is allowed and before the data is copied (writeback leaves them
        // alone); refused on a read-only subvolume or engine.
        // A writer without CAP_FSETID takes set-user-ID (and set-group-ID where the
        // group may execute) in the same update (`file_remove_privs`).
        let mode = ii.mode.get();
        let kill = if opts.kill_suidgid && mode & 0o6000 != 0 {
            let in_group = |g: u32| opts.in_group.is_some_and(|f| f(g));
            Some(crate::inode::write::mode_without_privs(mode, ii.gid.get(), &in_group))
                .filter(|&m| m != mode)
        } else {
            None
        };
        // Multigrain times (the kernel's `inode_needs_update_time`): while nobody has
        // read them since the last write set them, the write takes the coarse clock,
        // and a write inside the same tick changes nothing, so a run of small writes
        // costs one inode update per tick, not one per write. Once they were read, the
        // write takes a fine time, so the reader sees it change.
        let queried = inode.take_ctime_queried();
        let clock = &self.info().sources.clock;
        let now = if queried { clock.now() } else { clock.coarse_now() };
        let t = crate::inode::write::timespec(now);
        let same = |a: &ubtrfs_format::structs::Timespec| {
            zerocopy::IntoBytes::as_bytes(a) == zerocopy::IntoBytes::as_bytes(&t)
        };
        if queried || kill.is_some() || !same(&ii.mtime) || !same(&ii.ctime) {
            if let Err(e) = self.write_retrying(|w| w.file_update_time(id.root, id.ino, kill, t)) {
                if queried {
                    inode.mark_ctime_queried();
                }
                return Err(e);
            }
        }
        // btrfs_cont_expand (btrfs_write_check, then btrfs_truncate_block): a write that
        // starts past EOF in a later block first zeroes the old last block from the old
        // EOF on and dirties it, whatever it held, so it is written as data (a hole
        // there becomes a block of zeros, as SEEK_DATA then finds on the kernel). Its
        // space is held here, under the lock (no flush may run): on a filesystem too
        // full for one more block, the block is left as it is.
        let eof_block = size / bsz * bsz;
        let eof_rsv =
            (offset > size && !size.is_multiple_of(bsz) && eof_block + bsz <= offset / bsz * bsz)
                .then(|| self.info().data_rsv.hold(bsz))
                .filter(|r| r.fits());
        with_cache(self, &inode, |pc| -> Result<()> {
            if pc.i_size.is_none() {
                pc.i_size = Some(ii.size.get());
                pc.disk_i_size = ii.size.get();
                pc.new_from = ii.size.get();
            }
            debug_assert_eq!(pc.i_size, Some(size), "{id}: the size moved under the inode's lock");
            if let Some(_held) = eof_rsv.as_ref() {
                self.dirty_eof_block(id, &inode, pc, ii.flags.get(), size)?;
            }
            if end > size {
                self.size_grew(pc, size, end);
            }
            let mut cur = offset;
            while cur < end {
                let fstart = cur / FOLIO_SIZE * FOLIO_SIZE;
                let fend = (fstart + FOLIO_SIZE).min(end);
                let fsize = pc.folios.slot_folio(fstart, fend, bs).size();
                // Partial blocks at the edges need their old bytes.
                let (a, z) = (cur / bsz * bsz, fend.div_ceil(bsz) * bsz);
                if a < cur {
                    self.fill_folio(id, pc, fstart, a, cur)?;
                }
                if z > fend {
                    self.fill_folio(id, pc, fstart, fend, z.min(fstart + fsize))?;
                }
                // Blocks about to become dirty over a hole are new (st_blocks counts
                // them now): past the allocated end every block is a hole, below it the
                // extent maps tell (`btrfs_find_new_delalloc_bytes`). A block dirty
                // already has its state (blocks a truncation left dirty past EOF are
                // clean again after `size_grew` above).
                let holes = if pc.has_clean_block(fstart, a, z) {
                    self.holes_in(&inode, pc, ii.flags.get(), a, z)?
                } else {
                    Vec::new()
                };
                let f = pc.folios.get_mut(&fstart).expect("inserted above");
                f.last_use = self.pages.next_tick();
                let from = (cur - fstart) as usize;
                f.data[from..from + (fend - cur) as usize]
                    .copy_from_slice(&data[(cur - offset) as usize..(fend - offset) as usize]);
                pc.mark_dirty(fstart, cur, fend - cur);
                pc.mark_new(&holes);
                cur = fend;
            }
            pc.i_size = Some(size.max(end));
            Ok(())
        })?;
        drop(g);
        self.balance_dirty_pages()?;
        self.shrink_page_cache()
    }

    /// Hold data space for the blocks [a, z) of file `id` about to become dirty
    /// (`space::data_rsv`; the kernel's `btrfs_check_data_free_space`), until the
    /// returned reservation drops, by which time the blocks are dirty and counted as
    /// such. When the space promised does not fit the free space: new data chunks,
    /// then a writeback of every dirty inode and a commit (which turns dirty data into
    /// extents and returns the space freed in the running transaction), as the
    /// kernel's data flush does; then what of [a, z) a nocow or preallocated file
    /// writes in place needs nothing. The caller holds no inode lock.
    ///
    /// # Errors
    /// `Posix(NoSpace)` naming the file when the data space cannot hold the write;
    /// errors of the writeback and commit.
    pub(crate) fn reserve_data_space(
        &self,
        id: InodeId,
        a: u64,
        z: u64,
    ) -> Result<crate::space::data_rsv::DataReservation<'_>> {
        let rsv = &self.info().data_rsv;
        let what = format!("write to {id} at {a}..{z}");
        // Held, it fits; or new chunks make it fit, if the devices have room
        // (reserve_data makes them until the data groups hold everything promised).
        let try_hold = |bytes: u64| -> Result<
            std::result::Result<
                crate::space::data_rsv::DataReservation<'_>,
                crate::space::data_rsv::DataReservation<'_>,
            >,
        > {
            let held = rsv.hold(bytes);
            if held.fits() {
                return Ok(Ok(held));
            }
            match self.write(|w| crate::space::allocator::reserve_data(w, rsv.outstanding(), &what))
            {
                Ok(()) if held.fits() => Ok(Ok(held)),
                Ok(()) => Ok(Err(held)),
                Err(e) if e.posix_kind() == Some(PosixKind::NoSpace) => Ok(Err(held)),
                Err(e) => Err(e),
            }
        };
        if let Ok(held) = try_hold(z - a)? {
            return Ok(held);
        }
        self.flush_data_space()?;
        let held = match try_hold(z - a)? {
            Ok(held) => return Ok(held),
            Err(held) => held,
        };
        // What goes in place takes no new space.
        let flags = self.read(|l| Ok(l.load_inode(id, Load::ITEM)?.item.flags.get()))?;
        let in_place = if crate::inode::nocow::nocow_capable(flags) {
            self.write_retrying(|w| w.in_place_bytes(id.root, id.ino, flags, a, z))?
        } else {
            0
        };
        let held = if in_place > 0 {
            drop(held);
            let held = rsv.hold(z - a - in_place);
            if held.fits() {
                return Ok(held);
            }
            held
        } else {
            held
        };
        let (free, others) = (rsv.free(), rsv.outstanding().saturating_sub(held.bytes()));
        Err(Error::posix_detail(PosixKind::NoSpace, what, format!("{} bytes of data space are needed, {free} are free, and {others} of them are promised to data not yet written back", held.bytes())))
    }

    /// The kernel's data flush before an ENOSPC (`btrfs_reserve_data_bytes`: delalloc,
    /// then a commit): dirty data to extents, and the space the running transaction
    /// freed, pinned until its commit, back to the allocator. The caller holds no inode
    /// lock, and no reservation that would count against itself.
    ///
    /// # Errors
    /// Errors of the writeback and the commit.
    pub(crate) fn flush_data_space(&self) -> Result<()> {
        self.writeback_all()?;
        self.commit().map(|_| ())
    }

    /// The holes of file `inode` (inode flags `flags`) in the block-aligned [a, z),
    /// sorted: everything past the blocks the trees allocated (`new_from`) unless the
    /// file has preallocated extents, and below that what the extent maps (or items)
    /// do not cover.
    fn holes_in(
        &self,
        inode: &Arc<Inode>,
        pc: &PageCacheInner,
        flags: u64,
        a: u64,
        z: u64,
    ) -> Result<Vec<(u64, u64)>> {
        let bs = u64::from(self.info().sectorsize);
        let known = if flags & ubtrfs_format::structs::INODE_PREALLOC != 0 {
            u64::MAX
        } else {
            pc.new_from.div_ceil(bs) * bs
        };
        let look = z.min(known);
        let mut out = Vec::new();
        if a < look {
            let recs = self
                .read(|l| {
                    crate::inode::extent_map::get_file_extents(
                        l,
                        &self.info().extent_maps,
                        inode,
                        a,
                        look,
                    )
                })?
                .0;
            out = holes_between(&recs, a, look, bs);
        }
        let from = known.max(a);
        if from < z {
            match out.last_mut() {
                Some(l) if l.1 == from => l.1 = z,
                _ => out.push((from, z)),
            }
        }
        Ok(out)
    }

    /// The in-memory size of file `id` if its page cache knows one (it runs ahead of
    /// the INODE_ITEM's while data is dirty).
    pub fn cached_i_size(&self, id: InodeId) -> Option<u64> {
        let inode = self.inodes().lookup(id)?;
        let s = inode.mapping.pages.lock().i_size;
        s
    }

    /// Past the dirty limit, write inodes back (the one with most dirty data first)
    /// until the dirty total is at half the limit (the role of `balance_dirty_pages`).
    /// The caller holds no inode lock.
    fn balance_dirty_pages(&self) -> Result<()> {
        let limit = self.pages.dirty_limit.load(Ordering::Acquire);
        if self.info().data_rsv.dirty() <= limit {
            return Ok(());
        }
        // One look at the registry, most dirty first, then write back in that order:
        // many small dirty files (an untar) must not cost a scan per file.
        let bs = self.info().sectorsize;
        let held: Vec<Arc<Inode>> =
            self.pages.registry().values().map(|(i, _)| i.clone()).collect();
        let mut victims: Vec<(u64, Arc<Inode>)> = held
            .into_iter()
            .map(|i| {
                let d = i.mapping.pages.lock().dirty_bytes(bs);
                (d, i)
            })
            .filter(|(d, _)| *d > 0)
            .collect();
        victims.sort_unstable_by_key(|(d, _)| std::cmp::Reverse(*d));
        for (_, inode) in victims {
            if self.info().data_rsv.dirty() <= limit / 2 {
                break;
            }
            self.pages.throttle_writebacks.fetch_add(1, Ordering::Relaxed);
            self.writeback_inode(inode.id)?;
        }
        Ok(())
    }

    /// Over the cache limit with too few clean folios to drop (dirty folios hold the
    /// memory: many small files written and not yet written back), write back the
    /// least recently used dirty inodes until what is dirty fits in what must be
    /// freed, so their folios can go (the kernel writes back under memory pressure
    /// too). The caller holds no inode lock.
    fn writeback_for_memory(&self) -> Result<()> {
        let limit = self.pages.cache_limit.load(Ordering::Acquire);
        let cached = self.pages.cached.load(Ordering::Acquire);
        if cached <= limit {
            return Ok(());
        }
        let need = cached - shrink_target(limit);
        let mut order: Vec<(u64, Arc<Inode>)> =
            self.pages.registry().values().map(|(i, t)| (*t, i.clone())).collect();
        order.sort_unstable_by_key(|(t, _)| *t);
        let mut freed_dirty = 0u64;
        for (_, inode) in order {
            if freed_dirty >= need {
                break;
            }
            let (dirty, bytes) = {
                let pc = inode.mapping.pages.lock();
                (pc.dirty_blocks > 0, pc.cached_bytes())
            };
            if dirty {
                self.pages.throttle_writebacks.fetch_add(1, Ordering::Relaxed);
                self.writeback_inode(inode.id)?;
                freed_dirty += bytes;
            }
        }
        Ok(())
    }

    /// Past the cache limit, drop clean folios, least recently used inode first and
    /// oldest folio first within it, down to 7/8 of the limit (so that a cache at its
    /// limit is not walked again at every read or write); write dirty ones back first
    /// when the clean ones are not enough (`writeback_for_memory`).
    ///
    /// # Errors
    /// As `writeback_inode`, when dirty data had to be written back.
    pub(crate) fn shrink_page_cache(&self) -> Result<()> {
        let limit = self.pages.cache_limit.load(Ordering::Acquire);
        if self.pages.cached.load(Ordering::Acquire) <= limit {
            return Ok(());
        }
        self.drop_clean_folios(shrink_target(limit));
        if self.pages.cached.load(Ordering::Acquire) > limit {
            self.writeback_for_memory()?;
            self.drop_clean_folios(shrink_target(limit));
        }
        Ok(())
    }

    /// Drop clean folios, least recently used inode first, until the cache holds at
    /// most `limit` bytes.
    fn drop_clean_folios(&self, limit: u64) {
        let mut reg = self.pages.registry();
        let mut order: Vec<(u64, InodeId)> = reg.iter().map(|(id, (_, t))| (*t, *id)).collect();
        order.sort_unstable();
        let bs = self.info().sectorsize;
        for (_, id) in order {
            if self.pages.cached.load(Ordering::Acquire) <= limit {
                break;
            }
            let inode = reg.get(&id).expect("listed above").0.clone();
            // A cache busy under its mutex (a reader filling, a writeback) is skipped.
            let Ok(mut pc) = inode.mapping.pages.inner.try_lock() else { continue };
            let before = (pc.cached_bytes(), pc.dirty_bytes(bs));
            let mut clean: Vec<(u64, u64)> = pc
                .folios
                .values()
                .filter(|f| f.is_clean())
                .map(|f| (f.last_use, f.start))
                .collect();
            clean.sort_unstable();
            let over = self.pages.cached.load(Ordering::Acquire).saturating_sub(limit);
            let mut freed = 0;
            for (_, s) in clean {
                if freed >= over {
                    break;
                }
                freed += pc.folios.remove(&s).expect("listed above").size();
                self.pages.evicted_folios.fetch_add(1, Ordering::Relaxed);
            }
            let after = (pc.cached_bytes(), pc.dirty_bytes(bs));
            let empty = pc.folios.is_empty() && pc.ordered.is_empty();
            if empty {
                // Nothing cached: the size is read again at the next use.
                pc.forget_sizes();
                reg.remove(&id);
            }
            self.pages.account(&self.info().data_rsv, before, after);
            drop(pc);
        }
    }

    /// SEEK_DATA / SEEK_HOLE (`whence`) from `offset` in file `id`, dirty data
    /// counting as data: a file with dirty blocks is written back first, then the
    /// trees answer (`falloc::seek_in_file`). Ok(None) is ENXIO.
    ///
    /// # Errors
    /// As `writeback_inode` and `falloc::seek_in_file`.
    pub fn seek_data_hole(&self, id: InodeId, offset: u64, whence: i32) -> Result<Option<u64>> {
        let inode = self.inodes().get(id);
        let _g = lock_exclusive(&inode);
        if inode.mapping.pages.lock().dirty_blocks > 0 {
            self.writeback_locked(&inode)?;
        }
        self.read(|l| crate::inode::falloc::seek_in_file(l, id, offset, whence))
    }

    /// Drop every folio of inode `id` without writing it back (the inode is gone from
    /// disk: its last name was removed and nothing uses it). The caller holds no inode
    /// lock.
    pub(crate) fn discard_page_cache(&self, id: InodeId) {
        let Some(inode) = self.pages.registry().get(&id).map(|(i, _)| i.clone()) else { return };
        // A writeback of the inode (`writeback_all` from another thread) finishes first.
        let _g = lock_exclusive(&inode);
        with_cache(self, &inode, |pc| {
            assert!(
                pc.ordered.is_empty(),
                "page cache: discarding {id} with ordered extents alive"
            );
            pc.folios.clear();
            pc.dirty_blocks = 0;
            pc.new_blocks = 0;
            pc.forget_sizes();
        });
    }

    /// After a name of inode `id` was removed: discard its folios if the inode is gone
    /// from the trees (it was not in use and that was its last name).
    pub(crate) fn discard_if_gone(&self, id: InodeId) {
        if !self.pages.registry().contains_key(&id) {
            return;
        }
        let gone = matches!(self.read(|l| l.load_inode(id, Load::ITEM).map(|_| ())), Err(e) if e.posix_kind() == Some(PosixKind::NotFound));
        if gone {
            self.discard_page_cache(id);
        }
    }

    /// Before a change to file `id`'s extents through another path (direct write,
    /// fallocate, punch, zero range, size change): write its dirty data back. The
    /// caller holds the inode's lock exclusively. Returns whether the inode has a page
    /// cache to fix up afterwards (`after_extent_change`).
    pub(crate) fn before_extent_change(&self, inode: &Arc<Inode>) -> Result<bool> {
        if !self.pages.registry().contains_key(&inode.id) {
            return Ok(false);
        }
        self.writeback_locked(inode)?;
        Ok(true)
    }

    /// After such a change: drop the cached folios of [start, end) and read the size
    /// again from the trees at the next use when nothing stays cached.
    pub(crate) fn after_extent_change(
        &self,
        inode: &Arc<Inode>,
        start: u64,
        end: u64,
    ) -> Result<()> {
        let size = self.read(|l| Ok(l.load_inode(inode.id, Load::ITEM)?.item.size.get()));
        with_cache(self, inode, |pc| {
            pc.drop_range(start, end);
            match &size {
                Ok(s) => {
                    // After a full writeback nothing is dirty: the trees' size is the size.
                    pc.truncate(*s);
                    pc.i_size = Some(*s);
                    pc.disk_i_size = *s;
                    pc.new_from = *s;
                }
                Err(_) => {
                    let (mut kept, mut new) = (0, 0);
                    pc.folios.retain(|_, f| {
                        kept += u64::from(f.dirty.count());
                        new += u64::from(f.new.count());
                        !f.is_clean()
                    });
                    pc.dirty_blocks = kept;
                    pc.new_blocks = new;
                }
            }
        });
        size.map(|_| ())
    }

    /// A size change of file `id` (truncate up or down) in its page cache, after the
    /// trees have it: folios past the new size go, the straddling one is zeroed past
    /// it, both sizes become `size`.
    pub(crate) fn truncate_page_cache(&self, inode: &Arc<Inode>, size: u64) {
        if !self.pages.registry().contains_key(&inode.id) {
            return;
        }
        with_cache(self, inode, |pc| {
            let old = pc.i_size.unwrap_or(0);
            // Growing, the trees wrote the block holding their old end (zeros past
            // it, `btrfs_truncate_block`), also over a hole: it has an extent now, and
            // dirty data there replaces it.
            let bs = u64::from(self.info().sectorsize);
            let d = pc.disk_i_size;
            if size > d && !d.is_multiple_of(bs) {
                pc.new_from = pc.new_from.max(d);
                pc.clear_new(d / bs * bs, bs);
            }
            pc.truncate(size);
            pc.i_size = Some(size);
            pc.disk_i_size = size;
            pc.new_from = pc.new_from.min(size);
            self.size_grew(pc, old, size);
        });
    }

    /// The size went from `old` up to `size`: blocks a truncation left dirty past the
    /// old EOF (zeros, see `truncate`) are inside the file again. The trees hold a hole
    /// there, which reads the same zeros, so they are clean again rather than written
    /// as data: the kernel here (4 KiB folios, which truncation drops whole) leaves a
    /// hole too, as SEEK_DATA and st_blocks show. A writeback between the truncation
    /// and the growth has already ended them (their ordered extents truncated).
    fn size_grew(&self, pc: &mut PageCacheInner, old: u64, size: u64) {
        let bs = u64::from(self.info().sectorsize);
        let (a, z) = (old.div_ceil(bs) * bs, size.div_ceil(bs) * bs);
        if a >= z {
            return;
        }
        // Only the folio that straddled the old EOF can hold such blocks.
        let Some((_, f)) = pc.folios.range_mut(..a).next_back() else { return };
        if f.end() <= a {
            return;
        }
        let (b0, b1) = (f.block_of(a), ((z.min(f.end()) - f.start) / bs) as u32);
        debug_assert!(f.new.find_next(b0, true) >= b1, "blocks past the old EOF {old} are not new");
        pc.dirty_blocks -= u64::from(f.dirty.clear_range(b0, b1 - b0));
    }

    /// Zero the block holding EOF `size` (not block-aligned) from `size` on and make it
    /// dirty, with its old bytes below `size` (`btrfs_truncate_block` of a write past
    /// EOF; see `buffered_write_opts`).
    fn dirty_eof_block(
        &self,
        id: InodeId,
        inode: &Arc<Inode>,
        pc: &mut PageCacheInner,
        flags: u64,
        size: u64,
    ) -> Result<()> {
        let bs = self.info().sectorsize;
        let bsz = u64::from(bs);
        let b = size / bsz * bsz;
        debug_assert_ne!(b, size, "{id}: EOF {size} is block-aligned");
        let fstart = b / FOLIO_SIZE * FOLIO_SIZE;
        pc.folios.slot_folio(fstart, b + bsz, bs);
        self.fill_folio(id, pc, fstart, b, size)?;
        let holes = if pc.has_clean_block(fstart, b, b + bsz) {
            self.holes_in(inode, pc, flags, b, b + bsz)?
        } else {
            Vec::new()
        };
        let f = pc.folios.get_mut(&fstart).expect("inserted above");
        f.data[(size - fstart) as usize..(b + bsz - fstart) as usize].fill(0);
        pc.mark_dirty(fstart, b, bsz);
        pc.mark_new(&holes);
        Ok(())
    }
}
