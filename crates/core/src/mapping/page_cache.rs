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

use crate::mapping::ordered::OrderedTree;
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

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
    words: Words,
    nbits: u32,
}

/// A bitmap's words: one kept inline for a folio of up to 64 blocks (every folio of
/// `FOLIO_SIZE` or less), else on the heap (larger folios, as the bench's). A folio
/// has four bitmaps, and a small file a folio: four heap allocations per file written
/// otherwise.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Words {
    One([u64; 1]),
    Many(Vec<u64>),
}

impl Words {
    fn zeroed(n: usize) -> Words {
        if n <= 1 {
            Words::One([0])
        } else {
            Words::Many(vec![0; n])
        }
    }

    /// Grow to `n` words, the new ones zero.
    fn grow(&mut self, n: usize) {
        match self {
            Words::One(w) if n > 1 => {
                let mut v = vec![0; n];
                v[0] = w[0];
                *self = Words::Many(v);
            }
            Words::One(_) => {}
            Words::Many(v) => v.resize(n.max(v.len()), 0),
        }
    }
}

impl std::ops::Deref for Words {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        match self {
            Words::One(w) => w,
            Words::Many(v) => v,
        }
    }
}

impl std::ops::DerefMut for Words {
    fn deref_mut(&mut self) -> &mut [u64] {
        match self {
            Words::One(w) => w,
            Words::Many(v) => v,
        }
    }
}

fn range_mask(lo: u32, hi: u32) -> u64 {
    // Bits [lo, hi) of one word, 0 <= lo < hi <= 64.
    debug_assert!(lo < hi && hi <= 64, "range_mask({lo}, {hi})");
    let high = if hi == 64 { u64::MAX } else { (1u64 << hi) - 1 };
    high & !((1u64 << lo) - 1)
}

impl Bitmap {
    pub fn new(nbits: u32) -> Bitmap {
        Bitmap { words: Words::zeroed(nbits.div_ceil(64) as usize), nbits }
    }

    /// The map with `nbits` bits, the new ones clear.
    pub fn grow(&mut self, nbits: u32) {
        assert!(nbits >= self.nbits, "bitmap of {} bits cannot grow to {nbits}", self.nbits);
        self.words.grow(nbits.div_ceil(64) as usize);
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
        for (a, b) in self.words.iter_mut().zip(other.words.iter()) {
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
        self.nbits == other.nbits
            && self.words.iter().zip(other.words.iter()).all(|(a, b)| a & !b == 0)
    }

    pub fn intersects(&self, other: &Bitmap) -> bool {
        self.words.iter().zip(other.words.iter()).any(|(a, b)| a & b != 0)
    }
}

/// Freed folio buffers, by size (each a power of two up to `FOLIO_SIZE`, at the index
/// of its bit), for the next folios of that size to take: a fresh allocation costs a
/// page fault per 4 KiB page at its first write, a streaming write drops and makes
/// full folios all the time, and a copy of many small files a small folio each. At
/// most `FOLIO_POOL_BYTES` in all, shared by the engines of the process.
static FOLIO_POOL: Mutex<FolioPool> =
    Mutex::new(FolioPool { free: [const { Vec::new() }; FOLIO_CLASSES], bytes: 0 });

/// Size classes of pooled folio buffers: 1 byte to `FOLIO_SIZE`, by bit.
const FOLIO_CLASSES: usize = FOLIO_SIZE.trailing_zeros() as usize + 1;

struct FolioPool {
    free: [Vec<Box<[u8]>>; FOLIO_CLASSES],
    bytes: u64,
}

/// Bytes of freed folio buffers kept for reuse, beyond the cache's limit.
pub const FOLIO_POOL_BYTES: u64 = 32 << 20;

/// The pool class of a folio buffer of `size` bytes, if it is pooled.
fn folio_class(size: u64) -> Option<usize> {
    (size.is_power_of_two() && size <= FOLIO_SIZE).then_some(size.trailing_zeros() as usize)
}

/// The buffer of a new folio of `size` bytes. Its bytes are whatever they were: only
/// uptodate blocks are ever read, and a block becomes uptodate by being filled. (Debug
/// builds fill new buffers with 0xa5, so a read of anything else shows in tests.)
fn folio_data(size: u64) -> Box<[u8]> {
    let pooled = folio_class(size).and_then(|c| {
        let mut pool = FOLIO_POOL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let b = pool.free[c].pop()?;
        pool.bytes -= size;
        Some(b)
    });
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
        let size = self.data.len() as u64;
        if let Some(c) = folio_class(size) {
            let mut pool = FOLIO_POOL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if pool.bytes + size <= FOLIO_POOL_BYTES {
                pool.bytes += size;
                pool.free[c].push(std::mem::take(&mut self.data));
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
    /// The cache's state if no one holds it now (the shrinker skips a busy cache).
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, PageCacheInner>> {
        self.inner.try_lock().ok()
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, PageCacheInner> {
        // Only a failed assertion panics under this mutex; the caller's inode lock
        // keeps the folios' contents consistent with the writer that held it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Check the invariants of the module notes; panics naming the first that fails.
    #[cfg(any(test, feature = "test-hooks"))]
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
    /// Leave mtime and ctime alone (the kernel's `FMODE_NOCMTIME`, which
    /// `file_modified` honours after removing privileges): for a copy that sets the
    /// times itself once the data is in, as `put` does.
    pub no_cmtime: bool,
}

impl std::fmt::Debug for WriteOpts<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteOpts")
            .field("kill_suidgid", &self.kill_suidgid)
            .field("in_group", &self.in_group.is_some())
            .field("no_cmtime", &self.no_cmtime)
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
pub(crate) fn shrink_target(limit: u64) -> u64 {
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
    pub(crate) fn has_clean_block(&self, fstart: u64, a: u64, z: u64) -> bool {
        let f = &self.folios[&fstart];
        let bs = u64::from(f.blocksize);
        let (b0, b1) = (
            ((a.max(f.start) - f.start) / bs) as u32,
            ((z.min(f.end()) - f.start).div_ceil(bs)) as u32,
        );
        b0 < b1 && f.dirty.find_next(b0, false) < b1
    }

    /// Mark blocks [off, off + len) of the folio at `fstart` dirty (and uptodate).
    pub(crate) fn mark_dirty(&mut self, fstart: u64, off: u64, len: u64) {
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
    pub(crate) fn mark_new(&mut self, holes: &[(u64, u64)]) {
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

/// The parts of the block-aligned [a, z) that the file extents `recs` (sorted, as
/// `FsRead::file_extents` gives them) leave uncovered: the holes, explicit hole
/// extents included. An inline extent takes its whole block.
pub(crate) fn holes_between(
    recs: &[crate::mapping::file_extent::FileExtentRec],
    a: u64,
    z: u64,
    bs: u64,
) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut pos = a;
    for r in recs.iter().filter(|r| {
        !matches!(r.kind, crate::mapping::file_extent::ExtentKind::Regular { disk_bytenr: 0, .. })
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
