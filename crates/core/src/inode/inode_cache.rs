//! The in-memory inode (the kernel's `struct btrfs_inode` with the VFS inode's
//! `i_rwsem`, `i_count` and open files) and the bounded cache that holds them, keyed by
//! `InodeId { root, ino }`.
//!
//! What an `Inode` holds today:
//! - `lock`, with the role of `i_rwsem`: operations on one inode through the engine
//!   take it (shared to read or open, exclusive to write, unlink or close), so an open
//!   and an unlink of the same inode never interleave.
//! - The open count (open file handles) and the lookup count (the FUSE mount's
//!   `nlookup`, counted by `Engine::lookup` and dropped by `Engine::forget`). While
//!   either is nonzero the inode is *in use*: when its last name goes it stays on disk
//!   as an orphan (nlink 0 plus an ORPHAN_ITEM) until it is no longer in use.
//! - The attributes: a copy of the INODE_ITEM as the live view shows it, filled by
//!   `Engine::getattr` and kept current by the writer, which changes inode items in
//!   one place (`FsWriter::update_inode`; creation inserts, removal clears it). A
//!   `getattr` of a cached inode reads no tree.
//! - For a directory, the next DIR_INDEX (`btrfs_inode::index_cnt`), found from the
//!   last index item the first time a name is added and counted up from then on.
//! - `mapping`: the extent maps (`mapping::extent_map`) and the page cache
//!   (`mapping::page_cache`). An evicted inode's maps go with it (the trees rebuild them).
//!
//! The cache belongs to the writer (`FsWriter::inodes`), which keeps it in step with
//! the items; the engine shares it with its readers and open files. An evicted inode
//! loses only what the trees can rebuild.
//!
//! Lock order: inode locks (two of them in `InodeId` order) before the engine's lock;
//! the cache's own mutex is a leaf lock, never held while taking another lock or
//! calling into the engine.
//!
//! Invariants (`check_invariants`): the map holds the inodes of the LRU order (with the
//! same ages) and the pinned ones (in use when a shrink met them, off the LRU order
//! until `unpin`); the cache holds more than its capacity only by the inodes its last
//! shrink kept (pinned, held, or beyond its bounded pass). An inode is evicted only when nobody holds it:
//! not open, not looked up, and no other `Arc` to it (an operation holding its lock),
//! so two operations on one inode always share one lock.

use crate::ids::InodeId;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use ubtrfs_format::structs::InodeItem;

/// Default number of inodes kept in memory: enough for a working set of directories
/// and files of a busy mount, small next to the node cache (an unused inode is about
/// 100 bytes today; the page cache will make some much bigger, and is bounded apart).
pub const DEFAULT_INODE_CACHE_CAPACITY: usize = 8192;

/// The per-inode state of file data in memory: the extent map (file offset to extent,
/// `mapping::extent_map`, with its shrinker) and the page cache with its ordered extents
/// (`mapping::page_cache`).
#[derive(Debug, Default)]
pub struct InodeMapping {
    pub extent_map: crate::mapping::extent_map::ExtentMapTree,
    pub pages: crate::mapping::page_cache::PageCache,
}

/// An inode in memory.
pub struct Inode {
    pub id: InodeId,
    /// The role of `i_rwsem` (see the module notes for who takes it and how).
    pub(crate) lock: RwLock<()>,
    /// Open file handles (`OpenFile`).
    open: AtomicU32,
    /// The FUSE kernel's references (`nlookup`).
    lookups: AtomicU64,
    /// The INODE_ITEM as the live view shows it, once read through the engine (changed
    /// only under the engine's exclusive side, read under either), with the bytes
    /// writeback will add to its nbytes (see `Attrs`).
    attrs: Mutex<Attrs>,
    /// A directory's next DIR_INDEX; 0 until looked up (indexes start at 2).
    pub(crate) next_dir_index: AtomicU64,
    /// Someone may have read the times since a write last set them (the kernel's
    /// I_CTIME_QUERIED): the next write takes a fine time, so it shows as a change.
    /// Set after the attributes are read, taken before a write decides; true for an
    /// inode just loaded, as what read it before is not known.
    ctime_queried: AtomicBool,
    /// Extent map, io-tree and page cache.
    pub mapping: InodeMapping,
}

impl Inode {
    /// Attach the inode's extent map tree to `shrinker` (once; later calls are no-ops).
    pub fn attach_extent_maps(
        self: &Arc<Inode>,
        shrinker: &Arc<crate::mapping::extent_map_shrinker::ExtentMapShrinker>,
    ) {
        let owner: std::sync::Weak<dyn crate::mapping::extent_map_shrinker::MapsOwner> =
            Arc::downgrade(self) as _;
        self.mapping.extent_map.attach(shrinker, self.id, owner);
    }
}

impl crate::mapping::extent_map_shrinker::MapsOwner for Inode {
    #[cfg(any(test, feature = "test-hooks"))]
    fn id(&self) -> InodeId {
        self.id
    }
    fn extent_maps(&self) -> &crate::mapping::extent_map::ExtentMapTree {
        &self.mapping.extent_map
    }
}

/// An inode's attributes and the delalloc bytes that st_blocks counts with them, under
/// one mutex so a reader never sees the one changed and the other not.
#[derive(Default)]
struct Attrs {
    item: Option<InodeItem>,
    /// Dirty bytes over blocks the file has no extent for (the kernel's
    /// `new_delalloc_bytes`): the page cache's `new` blocks. The completion of an
    /// ordered extent moves its share into `item.nbytes` in the same step
    /// (`set_attrs_settling`).
    new_delalloc: u64,
}

impl std::fmt::Debug for Inode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inode")
            .field("id", &self.id)
            .field("open", &self.open_count())
            .field("lookups", &self.lookup_count())
            .field("attrs_cached", &self.lock_attrs().item.is_some())
            .field("next_dir_index", &self.next_dir_index.load(Ordering::Relaxed))
            .finish()
    }
}

impl Inode {
    fn new(id: InodeId) -> Inode {
        Inode {
            id,
            lock: RwLock::new(()),
            open: AtomicU32::new(0),
            lookups: AtomicU64::new(0),
            attrs: Mutex::new(Attrs::default()),
            next_dir_index: AtomicU64::new(0),
            ctime_queried: AtomicBool::new(true),
            mapping: InodeMapping::default(),
        }
    }

    fn lock_attrs(&self) -> std::sync::MutexGuard<'_, Attrs> {
        self.attrs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cached attributes, if any.
    pub fn attrs(&self) -> Option<InodeItem> {
        self.lock_attrs().item
    }

    /// The new delalloc bytes.
    pub(crate) fn new_delalloc(&self) -> u64 {
        self.lock_attrs().new_delalloc
    }

    /// The cached attributes and the new delalloc bytes, read together.
    pub(crate) fn attrs_and_new_delalloc(&self) -> (Option<InodeItem>, u64) {
        let a = self.lock_attrs();
        (a.item, a.new_delalloc)
    }

    /// Set (or, with `None`, drop) the cached attributes; the caller holds the engine's
    /// state so that they match the live view.
    pub(crate) fn set_attrs(&self, item: Option<InodeItem>) {
        self.lock_attrs().item = item;
    }

    /// `set_attrs` for an item whose nbytes took `settled` new delalloc bytes (an
    /// ordered extent's completion), which leave the delalloc count in the same step.
    pub(crate) fn set_attrs_settling(&self, item: Option<InodeItem>, settled: u64) {
        // Saturating: only a completion whose transaction aborted after the update can
        // be counted twice, and an aborted engine writes nothing more.
        let mut a = self.lock_attrs();
        a.item = item;
        a.new_delalloc = a.new_delalloc.saturating_sub(settled);
    }

    /// The page cache's new blocks changed: `add` bytes more, `sub` bytes fewer
    /// (`Engine::check_page_cache_invariants` checks the count against the blocks).
    pub(crate) fn adjust_new_delalloc(&self, add: u64, sub: u64) {
        let mut a = self.lock_attrs();
        a.new_delalloc = (a.new_delalloc + add).saturating_sub(sub);
    }

    /// The times were handed out (a getattr); call after reading them.
    pub(crate) fn mark_ctime_queried(&self) {
        self.ctime_queried.store(true, Ordering::Release);
    }

    /// Whether the times may have been read since the last write set them, clearing
    /// the mark (the write about to set them takes it).
    pub(crate) fn take_ctime_queried(&self) -> bool {
        self.ctime_queried.swap(false, Ordering::AcqRel)
    }

    /// Open file handles now.
    pub fn open_count(&self) -> u32 {
        self.open.load(Ordering::Acquire)
    }

    /// Lookups the FUSE kernel holds now.
    pub fn lookup_count(&self) -> u64 {
        self.lookups.load(Ordering::Acquire)
    }

    /// Open or looked up: its last unlink leaves an orphan, not a removal.
    pub fn in_use(&self) -> bool {
        self.open_count() > 0 || self.lookup_count() > 0
    }

    /// Count one more open handle (caller holds `lock`).
    pub(crate) fn get_open(&self) {
        let prev = self.open.fetch_add(1, Ordering::AcqRel);
        assert!(prev < u32::MAX, "{}: open count overflows", self.id);
    }

    /// Drop an open handle (caller holds `lock` exclusively); true when it was the last
    /// one.
    pub(crate) fn put_open(&self) -> bool {
        let prev = self.open.fetch_sub(1, Ordering::AcqRel);
        assert!(prev > 0, "{}: closed more often than opened", self.id);
        prev == 1
    }

    /// Count `n` more lookups.
    pub(crate) fn get_lookups(&self, n: u64) {
        let prev = self.lookups.fetch_add(n, Ordering::AcqRel);
        assert!(prev.checked_add(n).is_some(), "{}: lookup count {prev} + {n} overflows", self.id);
    }

    /// Drop `n` lookups (caller holds `lock` exclusively), at most as many as are held;
    /// returns the count left.
    pub(crate) fn put_lookups(&self, n: u64) -> u64 {
        let mut cur = self.lookups.load(Ordering::Acquire);
        loop {
            let next = cur.saturating_sub(n);
            match self.lookups.compare_exchange(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return next,
                Err(c) => cur = c,
            }
        }
    }
}

/// The inodes in memory, bounded (see `DEFAULT_INODE_CACHE_CAPACITY`).
#[derive(Debug)]
pub struct InodeCache {
    inner: Mutex<CacheInner>,
    /// Errors of handles dropped without `close`.
    pub(crate) close_errors: CloseErrors,
}

#[derive(Debug)]
struct CacheInner {
    capacity: usize,
    /// Each inode and its age (the tick of its last use), or `PINNED`.
    map: HashMap<InodeId, (Arc<Inode>, u64)>,
    /// Ages, oldest first: the LRU order of the inodes that may be evicted.
    lru: BTreeMap<u64, InodeId>,
    /// Inodes a shrink found in use (open or looked up): off the LRU order, as the
    /// kernel keeps referenced inodes off its LRU list, until `unpin` puts them back
    /// when their last open or lookup goes. So a cache full of inodes in use costs
    /// nothing per new inode (a mount with more inodes looked up than the capacity).
    pinned: usize,
    /// Inodes shrink passes looked at (their cost).
    visits: u64,
    next_tick: u64,
    /// Inodes in use the last shrink had to keep although the cache was over capacity.
    kept_over: usize,
    evictions: u64,
}

/// Errors of closes nobody could be told about (a handle dropped without `close`):
/// the first ones are kept, the rest counted.
const MAX_CLOSE_ERRORS: usize = 64;

impl InodeCache {
    /// A cache of at most `capacity` inodes not in use (at least 1).
    pub fn new(capacity: usize) -> InodeCache {
        let inner = CacheInner {
            capacity: capacity.max(1),
            map: HashMap::new(),
            lru: BTreeMap::new(),
            pinned: 0,
            visits: 0,
            next_tick: 0,
            kept_over: 0,
            evictions: 0,
        };
        InodeCache { inner: Mutex::new(inner), close_errors: CloseErrors::default() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheInner> {
        // Only a failed assertion (a bug) panics under this mutex; the maps stay memory
        // safe, and recovering keeps the closes that drops run from panicking again.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The in-memory inode `id`, made on first use (the kernel's `btrfs_iget` for the
    /// in-memory part; the on-disk item is read by whoever needs it).
    pub fn get(&self, id: InodeId) -> Arc<Inode> {
        let mut c = self.lock();
        let tick = c.bump();
        if let Some((inode, age)) = c.map.get_mut(&id) {
            if *age == PINNED {
                return Arc::clone(inode);
            }
            let old = std::mem::replace(age, tick);
            let inode = Arc::clone(inode);
            assert_eq!(
                c.lru.get(&old),
                Some(&id),
                "inode cache: age {old} of {id} missing from the LRU order"
            );
            c.lru.remove(&old);
            c.lru.insert(tick, id);
            return inode;
        }
        let inode = Arc::new(Inode::new(id));
        c.map.insert(id, (Arc::clone(&inode), tick));
        c.lru.insert(tick, id);
        c.shrink(Pass::Step);
        if cfg!(debug_assertions) && c.map.len() <= DEBUG_CHECK_MAX {
            c.check();
        }
        inode
    }

    /// The in-memory inode `id` if it is cached (an inode not cached is not in use).
    pub fn lookup(&self, id: InodeId) -> Option<Arc<Inode>> {
        self.lock().map.get(&id).map(|(i, _)| Arc::clone(i))
    }

    /// An open inode of tree `root`, if there is one: a subvolume with one is not
    /// deleted.
    pub fn open_in_root(&self, root: u64) -> Option<InodeId> {
        self.lock()
            .map
            .iter()
            .find(|(id, (i, _))| id.root == root && i.open_count() > 0)
            .map(|(id, _)| *id)
    }

    /// The inodes the FUSE kernel holds lookups of, with their counts.
    pub fn looked_up(&self) -> Vec<(InodeId, u64)> {
        self.lock()
            .map
            .iter()
            .map(|(id, (i, _))| (*id, i.lookup_count()))
            .filter(|&(_, n)| n > 0)
            .collect()
    }

    /// Drop `id` from the cache if nobody holds it (after its removal from disk).
    pub fn forget_unused(&self, id: InodeId) {
        let mut c = self.lock();
        let Some((inode, age)) = c.map.get(&id) else { return };
        if Arc::strong_count(inode) == 1 && !inode.in_use() {
            let age = *age;
            c.map.remove(&id);
            if age == PINNED {
                c.pinned -= 1;
            } else {
                c.lru.remove(&age);
            }
        }
    }

    /// Put `id` back in the LRU order if a shrink pinned it and it is no longer in
    /// use (called after its last open or lookup went).
    pub(crate) fn unpin(&self, id: InodeId) {
        let mut c = self.lock();
        let tick = c.bump();
        let Some((inode, age)) = c.map.get_mut(&id) else { return };
        if *age != PINNED || inode.in_use() {
            return;
        }
        *age = tick;
        c.pinned -= 1;
        c.lru.insert(tick, id);
        c.shrink(Pass::Step);
    }

    /// Change the capacity (at least 1); shrinks at once if it is now over.
    pub fn set_capacity(&self, capacity: usize) {
        let mut c = self.lock();
        c.capacity = capacity.max(1);
        c.shrink(Pass::Full);
    }

    #[cfg(any(test, feature = "test-hooks"))]
    pub fn capacity(&self) -> usize {
        self.lock().capacity
    }

    /// Inodes in memory now.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    #[cfg(any(test, feature = "test-hooks"))]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Inodes evicted so far.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn evictions(&self) -> u64 {
        self.lock().evictions
    }

    /// Check the cache's invariants (see the module notes); panics naming the first
    /// that fails.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn check_invariants(&self) {
        self.lock().check();
    }
}

/// The age of a pinned inode (in use, off the LRU order).
const PINNED: u64 = u64::MAX;

/// How many inodes a shrink may visit beyond those it has to evict.
const SHRINK_SLACK: usize = 16;

/// How far a shrink goes (see `CacheInner::shrink`).
#[derive(Clone, Copy, Debug)]
enum Pass {
    /// After one insertion or unpin: a bounded step.
    Step,
    /// After a change of capacity: down to it, as far as nothing holds the inodes.
    Full,
}

/// Debug builds check the cache after each insertion while it is this small (the check
/// walks every inode); tests call `check_invariants` at any size.
const DEBUG_CHECK_MAX: usize = 256;

impl CacheInner {
    fn check(&self) {
        let c = self;
        assert_eq!(
            c.map.len(),
            c.lru.len() + c.pinned,
            "inode cache: the map holds other than the LRU order plus the pinned"
        );
        assert_eq!(
            c.map.values().filter(|(_, a)| *a == PINNED).count(),
            c.pinned,
            "inode cache: pinned count"
        );
        for (age, id) in &c.lru {
            let (inode, a) = c
                .map
                .get(id)
                .unwrap_or_else(|| panic!("inode cache: LRU names {id}, which the map lacks"));
            assert_eq!(
                a, age,
                "inode cache: {id} has age {a} in the map and {age} in the LRU order"
            );
            assert_eq!(inode.id, *id, "inode cache: entry {id} holds inode {}", inode.id);
            assert!(
                *age < c.next_tick,
                "inode cache: {id} has age {age} from the future (next tick {})",
                c.next_tick
            );
        }
        let over = c.map.len().saturating_sub(c.capacity);
        assert!(
            over <= c.kept_over,
            "inode cache: {} inodes for capacity {}, but the last shrink kept only {} in use",
            c.map.len(),
            c.capacity,
            c.kept_over
        );
    }
}

impl Default for InodeCache {
    fn default() -> InodeCache {
        InodeCache::new(DEFAULT_INODE_CACHE_CAPACITY)
    }
}

impl CacheInner {
    fn bump(&mut self) -> u64 {
        let t = self.next_tick;
        self.next_tick += 1;
        t
    }

    /// Evict the least recently used inodes nobody holds until the cache is within its
    /// capacity. Inodes in use met on the way leave the LRU order (pinned); inodes
    /// only held for a moment (an operation's `Arc`, a page cache's) get a second
    /// chance at the young end. A `Pass::Step` visits at most `2 * SHRINK_SLACK`
    /// inodes, so each new or unpinned inode costs O(1) whatever the cache holds: the
    /// cache stays over capacity by the inodes it kept, and later steps evict them once
    /// they are let go. A visit budget of the whole excess instead made every insertion
    /// walk all the held inodes again (the page cache holds each inode with dirty data:
    /// the writeback of 40,000 untarred files at unmount took 11 s, nearly all of it
    /// here). `Pass::Full` (a new capacity) visits up to the whole excess.
    fn shrink(&mut self, pass: Pass) {
        let over = self.map.len().saturating_sub(self.capacity);
        let budget = match pass {
            Pass::Step => over.min(SHRINK_SLACK) + SHRINK_SLACK,
            Pass::Full => over + SHRINK_SLACK,
        }
        .min(self.lru.len());
        let mut visited = 0;
        while self.map.len() > self.capacity && visited < budget {
            visited += 1;
            self.visits += 1;
            let (age, id) = self.lru.pop_first().expect("budget bounded by the LRU order's length");
            let (inode, _) = self.map.get(&id).expect("the map holds every inode of the LRU order");
            if Arc::strong_count(inode) == 1 && !inode.in_use() {
                self.map.remove(&id);
                self.evictions += 1;
            } else if inode.in_use() {
                self.map.get_mut(&id).expect("present just above").1 = PINNED;
                self.pinned += 1;
            } else {
                let tick = self.bump();
                debug_assert!(tick > age);
                self.map.get_mut(&id).expect("present just above").1 = tick;
                self.lru.insert(tick, id);
            }
        }
        self.kept_over = self.map.len().saturating_sub(self.capacity);
    }
}

/// Close errors recorded for handles dropped without `close` (bounded).
#[derive(Debug, Default)]
pub(crate) struct CloseErrors {
    inner: Mutex<(Vec<String>, u64)>,
}

impl CloseErrors {
    pub(crate) fn record(&self, msg: String) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if g.0.len() < MAX_CLOSE_ERRORS {
            g.0.push(msg);
        } else {
            g.1 += 1;
        }
    }

    /// The recorded errors, and how many more were dropped; clears them.
    pub(crate) fn take(&self) -> (Vec<String>, u64) {
        std::mem::take(&mut *self.inner.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// Take inode `i`'s lock (the role of i_rwsem) exclusively.
pub(crate) fn lock_exclusive(i: &Inode) -> std::sync::RwLockWriteGuard<'_, ()> {
    i.lock.write().unwrap_or_else(|p| p.into_inner())
}

/// Take inode `i`'s lock shared.
pub(crate) fn lock_shared(i: &Inode) -> std::sync::RwLockReadGuard<'_, ()> {
    i.lock.read().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(ino: u64) -> InodeId {
        InodeId { root: 5, ino }
    }

    #[test]
    fn unused_inodes_are_evicted_oldest_first() {
        let c = InodeCache::new(3);
        for ino in 256..262 {
            drop(c.get(id(ino)));
            c.check_invariants();
        }
        assert_eq!(c.len(), 3);
        assert_eq!(c.evictions(), 3);
        for ino in 256..259 {
            assert!(c.lookup(id(ino)).is_none(), "ino {ino} should have been evicted");
        }
        for ino in 259..262 {
            assert!(c.lookup(id(ino)).is_some(), "ino {ino} should still be cached");
        }
    }

    #[test]
    fn a_recent_use_keeps_an_inode() {
        let c = InodeCache::new(2);
        drop(c.get(id(256)));
        drop(c.get(id(257)));
        drop(c.get(id(256)));
        drop(c.get(id(258)));
        c.check_invariants();
        assert!(c.lookup(id(256)).is_some());
        assert!(c.lookup(id(257)).is_none());
    }

    #[test]
    fn open_looked_up_or_held_inodes_are_never_evicted() {
        let c = InodeCache::new(2);
        let open = c.get(id(256));
        open.get_open();
        drop(open);
        let looked = c.get(id(257));
        looked.get_lookups(2);
        drop(looked);
        let held = c.get(id(258));
        for ino in 300..310 {
            drop(c.get(id(ino)));
            c.check_invariants();
        }
        assert!(c.lookup(id(256)).is_some_and(|i| i.open_count() == 1));
        assert!(c.lookup(id(257)).is_some_and(|i| i.lookup_count() == 2));
        assert!(
            c.lookup(id(258)).is_some_and(|i| Arc::ptr_eq(&i, &held)),
            "a held inode keeps its one lock"
        );
        // Over capacity only by the inodes in use.
        assert!(c.len() <= 2 + 3, "{} cached", c.len());
        // Released, they go at the next shrink.
        let o = c.lookup(id(256)).expect("cached");
        assert!(o.put_open());
        drop(o);
        let l = c.lookup(id(257)).expect("cached");
        assert_eq!(l.put_lookups(5), 0);
        drop(l);
        drop(held);
        // Pinned while in use, they come back to the LRU order when released (the
        // engine's close and forget say so).
        c.set_capacity(1);
        assert!(
            c.lookup(id(256)).is_some() && c.lookup(id(257)).is_some(),
            "pinned inodes are not evicted before unpin"
        );
        c.unpin(id(256));
        c.unpin(id(257));
        c.set_capacity(1);
        c.check_invariants();
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn inodes_in_use_beyond_the_capacity_cost_o1_each() {
        // A mount that looked up far more inodes than the capacity: each new one must
        // not walk those in use (a full pass each made 20,000 creates quadratic).
        let c = InodeCache::new(64);
        for ino in 0..20_000u64 {
            let i = c.get(id(1000 + ino));
            i.get_lookups(1);
        }
        let visits = c.lock().visits;
        assert!(
            visits < 20_000 * (1 + SHRINK_SLACK as u64),
            "{visits} shrink visits for 20,000 inodes in use"
        );
        assert_eq!(c.len(), 20_000, "every inode in use stays");
        c.check_invariants();
        // Forgotten, they are evicted down to the capacity again.
        for ino in 0..20_000u64 {
            let i = c.lookup(id(1000 + ino)).expect("cached");
            assert_eq!(i.put_lookups(1), 0);
            drop(i);
            c.unpin(id(1000 + ino));
        }
        assert_eq!(c.len(), 64);
        c.check_invariants();
    }

    #[test]
    fn held_inodes_beyond_the_capacity_cost_o1_each() {
        // Inodes held (a page cache's Arc for each file with dirty data) but not in use
        // go back to the young end at each visit: each new inode must not walk them
        // all again (the writeback of every untarred file at unmount was quadratic).
        let c = InodeCache::new(64);
        let n = 5_000u64;
        let held: Vec<_> = (0..n).map(|ino| c.get(id(1000 + ino))).collect();
        let visits = c.lock().visits;
        assert!(
            visits <= n * 2 * SHRINK_SLACK as u64,
            "{visits} shrink visits for {n} held inodes"
        );
        assert_eq!(c.len(), n as usize, "every held inode stays");
        c.check_invariants();
        // Let go, they are evicted by later insertions, a bounded step each.
        drop(held);
        for ino in 0..n {
            drop(c.get(id(100_000 + ino)));
        }
        assert_eq!(c.len(), 64);
        c.check_invariants();
        let visits = c.lock().visits;
        assert!(
            visits <= 2 * n * 2 * SHRINK_SLACK as u64,
            "{visits} shrink visits for {n} held and {n} new inodes"
        );
    }

    #[test]
    fn forget_unused_drops_only_unheld_inodes() {
        let c = InodeCache::new(8);
        let a = c.get(id(256));
        c.forget_unused(id(256));
        assert!(c.lookup(id(256)).is_some(), "held: kept");
        drop(a);
        c.forget_unused(id(256));
        assert!(c.lookup(id(256)).is_none());
        c.check_invariants();
    }
}
