//! The extent-map shrinker: frees extent maps when there are more than a memory budget
//! allows (the kernel's `btrfs_free_extent_maps` worker, driven here by
//! `Engine::set_extent_map_limit` instead of the VM's super shrinker, which userspace
//! does not have).
//!
//! The kernel walks every in-memory inode of a root under the root's inode-map lock and
//! write-trylocks each inode's tree only to find most of them empty (stat'ed
//! files and directories). Here the empty ones are never visited: a registry holds
//! exactly the inodes whose tree has maps, entered at the tree's first map and left at
//! its last (`Owner::settle`, called by the tree's write guard). A run:
//! - takes a batch of at most `BATCH` registry entries from the cursor under the
//!   registry lock and releases it, so the lock is never held across per-inode lock
//!   attempts, and create/evict (which enter and leave the registry) wait for at most
//!   one batch copy;
//! - for each: upgrades the weak reference (an inode being evicted is skipped),
//!   write-trylocks its tree (busy: skipped, someone is using the maps), re-checks it
//!   still has maps, and frees maps from its first on, leaving PINNED ones;
//! - resumes at the entry after the last inode it scanned (`last_ino + 1`); entries
//!   are ordered by (root, ino), so the walk goes on into the next root, and at the end
//!   wraps once to the start, stopping at a full circle;
//! - scans at most `nr_to_scan` maps and yields between batches. A request made while
//!   a run is pending is dropped, as the kernel's compare-and-swap on `nr_to_scan`
//!   does: the pending run frees for both.
//!
//! Invariants (`check_invariants`, quiescent): `evictable` equals the sum of the maps
//! of the registered inodes, and each registered inode has at least one. Every change
//! to an attached tree passes through `settle`, which adds its change to `evictable`,
//! so the equality also means no attached inode outside the registry has maps.
//!
//! Lock order: an inode's tree lock, then the registry lock (a leaf lock). The worker
//! takes them apart: the registry lock, released, then a tree's trylock.
//!
//! Neighbours: `extent_map` (the trees), `inode::inode_cache` (the inodes, each a
//! `MapsOwner`), `engine` (the budget).

use crate::ids::InodeId;
use crate::mapping::extent_map::ExtentMapTree;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Default budget: 262,144 maps (an extent map is under 100 bytes here; about 25 MiB).
pub const DEFAULT_EXTENT_MAP_LIMIT: u64 = 262_144;

/// Registry entries copied per lock hold: bounds the time create/evict wait on it.
pub const BATCH: usize = 64;

type RegKey = (InodeId, u64);

/// The counts a caller (tests, benches) can read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExtentMapStats {
    /// Maps in attached trees now.
    pub evictable: u64,
    /// Inodes in the registry now.
    pub registered: u64,
    /// Maps looked at by runs, freed or not.
    pub scanned: u64,
    pub freed: u64,
    /// Nanoseconds runs spent freeing maps (the rest of a run is finding them).
    pub free_ns: u64,
    /// Registry entries runs looked at.
    pub visited: u64,
    /// Inodes skipped because their tree was locked.
    pub busy: u64,
    pub runs: u64,
    /// Requests dropped because a run was pending.
    pub coalesced: u64,
    /// Reads the maps served, and reads that went to the fs tree.
    pub hits: u64,
    pub misses: u64,
}

/// The filesystem's extent-map accounting and worker.
#[derive(Debug)]
pub struct ExtentMapShrinker {
    registry: Mutex<BTreeMap<RegKey, Weak<dyn MapsOwner>>>,
    evictable: AtomicU64,
    limit: AtomicU64,
    nr_to_scan: AtomicU64,
    /// The next registry position a run starts at.
    cursor: Mutex<InodeId>,
    next_serial: AtomicU64,
    closing: AtomicBool,
    scanned: AtomicU64,
    freed: AtomicU64,
    free_ns: AtomicU64,
    visited: AtomicU64,
    busy: AtomicU64,
    runs: AtomicU64,
    coalesced: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl Default for ExtentMapShrinker {
    fn default() -> ExtentMapShrinker {
        ExtentMapShrinker {
            registry: Mutex::new(BTreeMap::new()),
            evictable: AtomicU64::new(0),
            limit: AtomicU64::new(DEFAULT_EXTENT_MAP_LIMIT),
            nr_to_scan: AtomicU64::new(0),
            cursor: Mutex::new(InodeId { root: 0, ino: 0 }),
            next_serial: AtomicU64::new(1),
            closing: AtomicBool::new(false),
            scanned: AtomicU64::new(0),
            freed: AtomicU64::new(0),
            free_ns: AtomicU64::new(0),
            visited: AtomicU64::new(0),
            busy: AtomicU64::new(0),
            runs: AtomicU64::new(0),
            coalesced: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }
}

/// What holds an extent map tree the shrinker frees from: the in-memory inode
/// (`inode::inode_cache::Inode`), held weakly, so an inode being evicted is skipped.
pub trait MapsOwner: Send + Sync {
    /// The inode it is.
    #[cfg(any(test, feature = "test-hooks"))]
    fn id(&self) -> InodeId;
    /// Its extent map tree.
    fn extent_maps(&self) -> &ExtentMapTree;
}

/// What ties a tree to the shrinker: the inode it belongs to, under a serial of its
/// own (an inode evicted and read again is a new registry entry).
pub struct Owner {
    shrinker: Arc<ExtentMapShrinker>,
    key: RegKey,
    inode: Weak<dyn MapsOwner>,
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Owner").field("id", &self.key.0).field("serial", &self.key.1).finish()
    }
}

impl Owner {
    pub(crate) fn new(
        shrinker: &Arc<ExtentMapShrinker>,
        id: InodeId,
        inode: Weak<dyn MapsOwner>,
    ) -> Owner {
        let serial = shrinker.next_serial.fetch_add(1, Ordering::Relaxed);
        Owner { shrinker: Arc::clone(shrinker), key: (id, serial), inode }
    }

    /// Account a change of the tree from `before` to `after` maps (the tree's write
    /// lock held): the evictable count, and the registry on the first map and the last.
    pub(crate) fn settle(&self, before: usize, after: usize) {
        let s = &self.shrinker;
        if after > before {
            s.evictable.fetch_add((after - before) as u64, Ordering::AcqRel);
        } else if before > after {
            let d = (before - after) as u64;
            let prev = s.evictable.fetch_sub(d, Ordering::AcqRel);
            assert!(
                prev >= d,
                "extent maps: {} frees {d} maps but only {prev} are counted",
                self.key.0
            );
        }
        if before == 0 && after > 0 {
            let old = s.lock_registry().insert(self.key, self.inode.clone());
            assert!(
                old.is_none(),
                "extent maps: {} serial {} registered twice",
                self.key.0,
                self.key.1
            );
        } else if before > 0 && after == 0 {
            let old = s.lock_registry().remove(&self.key);
            assert!(
                old.is_some(),
                "extent maps: {} serial {} had maps but was not registered",
                self.key.0,
                self.key.1
            );
        }
    }
}

fn after(id: InodeId) -> InodeId {
    match id.ino.checked_add(1) {
        Some(ino) => InodeId { root: id.root, ino },
        None => InodeId { root: id.root.saturating_add(1), ino: 0 },
    }
}

impl ExtentMapShrinker {
    fn lock_registry(&self) -> std::sync::MutexGuard<'_, BTreeMap<RegKey, Weak<dyn MapsOwner>>> {
        // Only failed assertions panic under it; the map itself stays whole.
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The budget (maps kept before a run frees some).
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    pub fn set_limit(&self, n: u64) {
        self.limit.store(n, Ordering::Relaxed);
    }

    /// Maps in attached trees now.
    pub fn evictable(&self) -> u64 {
        self.evictable.load(Ordering::Acquire)
    }

    pub(crate) fn count_hit(&self) {
        self.hits.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_miss(&self) {
        self.misses.fetch_add(1, Ordering::Relaxed);
    }

    /// Stop runs early (the filesystem is closing).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn set_closing(&self) {
        self.closing.store(true, Ordering::Release);
    }

    pub fn stats(&self) -> ExtentMapStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ExtentMapStats {
            evictable: self.evictable(),
            registered: self.lock_registry().len() as u64,
            scanned: l(&self.scanned),
            freed: l(&self.freed),
            free_ns: l(&self.free_ns),
            visited: l(&self.visited),
            busy: l(&self.busy),
            runs: l(&self.runs),
            coalesced: l(&self.coalesced),
            hits: l(&self.hits),
            misses: l(&self.misses),
        }
    }

    /// Run if the count is over the budget, to bring it back (the caller holds no tree
    /// lock and no engine lock). Returns whether this call ran.
    pub fn balance(&self) -> bool {
        let (n, limit) = (self.evictable(), self.limit());
        n > limit && self.free_extent_maps(n - limit)
    }

    /// Scan up to `nr` maps, freeing those not pinned (`btrfs_free_extent_maps`). A
    /// request while a run is pending is dropped (counted in `coalesced`); returns
    /// whether this call ran.
    pub fn free_extent_maps(&self, nr: u64) -> bool {
        if nr == 0 {
            return false;
        }
        if self.nr_to_scan.compare_exchange(0, nr, Ordering::AcqRel, Ordering::Acquire).is_err() {
            self.coalesced.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        self.run();
        let was = self.nr_to_scan.swap(0, Ordering::AcqRel);
        assert!(was > 0, "extent map shrinker: nr_to_scan cleared under a running worker");
        true
    }

    /// The worker (module notes).
    fn run(&self) {
        self.runs.fetch_add(1, Ordering::Relaxed);
        let target = self.nr_to_scan.load(Ordering::Acquire);
        let first = *self.cursor.lock().unwrap_or_else(|p| p.into_inner());
        let mut pos = first;
        let mut wrapped = false;
        let mut scanned = 0u64;
        'walk: while scanned < target && !self.closing.load(Ordering::Acquire) {
            std::thread::yield_now();
            let batch: Vec<(InodeId, Weak<dyn MapsOwner>)> = self
                .lock_registry()
                .range((pos, 0)..)
                .take(BATCH)
                .map(|(k, w)| (k.0, w.clone()))
                .collect();
            if batch.is_empty() {
                if wrapped || first == (InodeId { root: 0, ino: 0 }) {
                    break;
                }
                wrapped = true;
                pos = InodeId { root: 0, ino: 0 };
                continue;
            }
            for (id, weak) in batch {
                if wrapped && id >= first {
                    break 'walk;
                }
                pos = after(id);
                self.visited.fetch_add(1, Ordering::Relaxed);
                // Evicted meanwhile: its maps went with it.
                let Some(inode) = weak.upgrade() else { continue };
                let Some(mut g) = inode.extent_maps().try_write() else {
                    self.busy.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                if g.is_empty() {
                    continue;
                }
                let t = std::time::Instant::now();
                let (s, f) = g.shrink(target - scanned);
                drop(g);
                self.free_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                // Dropped outside the registry lock: the last reference's drop takes it.
                drop(inode);
                scanned += s;
                self.scanned.fetch_add(s, Ordering::Relaxed);
                self.freed.fetch_add(f, Ordering::Relaxed);
                if scanned >= target || self.closing.load(Ordering::Acquire) {
                    break 'walk;
                }
            }
        }
        *self.cursor.lock().unwrap_or_else(|p| p.into_inner()) = pos;
    }

    /// The position the next run starts at (the inode after the last one visited).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn cursor(&self) -> InodeId {
        *self.cursor.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The inodes registered now, in walk order.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn registered(&self) -> Vec<InodeId> {
        self.lock_registry().keys().map(|k| k.0).collect()
    }

    /// Check the invariants (module notes) while nobody changes maps; panics naming the
    /// first that fails.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn check_invariants(&self) {
        let entries: Vec<(RegKey, Weak<dyn MapsOwner>)> =
            self.lock_registry().iter().map(|(k, w)| (*k, w.clone())).collect();
        let mut sum = 0u64;
        for ((id, serial), w) in entries {
            let inode = w
                .upgrade()
                .unwrap_or_else(|| panic!("extent maps: registered {id} serial {serial} is gone"));
            assert_eq!(
                inode.id(),
                id,
                "extent maps: registry entry {id} holds inode {}",
                inode.id()
            );
            let n = inode.extent_maps().len() as u64;
            assert!(n >= 1, "extent maps: {id} serial {serial} is registered with no maps");
            inode.extent_maps().check_invariants();
            sum += n;
        }
        assert_eq!(
            sum,
            self.evictable(),
            "extent maps: registered inodes hold {sum} maps, the count says {}",
            self.evictable()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inode::inode_cache::{Inode, InodeCache};
    use crate::mapping::extent_map::{ExtentMap, EXTENT_FLAG_PINNED};

    const K: u64 = 4096;

    /// An inode of `cache` with `n` unmergeable 4K maps.
    fn with_maps(
        s: &Arc<ExtentMapShrinker>,
        cache: &InodeCache,
        root: u64,
        ino: u64,
        n: u64,
    ) -> Arc<Inode> {
        let inode = cache.get(InodeId { root, ino });
        inode.attach_extent_maps(s);
        for i in 0..n {
            // Every other disk block: never adjacent on disk, so never merged.
            inode
                .mapping
                .extent_map
                .add(ExtentMap::plain(i * K, K, (2 * i + 1) * K * 16, K, 0))
                .unwrap();
        }
        inode
    }

    #[test]
    fn registry_follows_first_and_last_map_and_eviction() {
        let s = Arc::new(ExtentMapShrinker::default());
        let cache = InodeCache::new(4);
        let a = with_maps(&s, &cache, 5, 257, 3);
        assert_eq!(s.registered(), vec![a.id]);
        assert_eq!(s.evictable(), 3);
        s.check_invariants();
        a.mapping.extent_map.drop_extent_map_range(0, u64::MAX, false);
        assert!(s.registered().is_empty());
        assert_eq!(s.evictable(), 0);
        with_maps(&s, &cache, 5, 258, 2);
        s.check_invariants();
        drop(a);
        // Evicting 258 (not held) takes its maps out of the count.
        for ino in 300..310 {
            drop(cache.get(InodeId { root: 5, ino }));
        }
        assert!(cache.lookup(InodeId { root: 5, ino: 258 }).is_none());
        assert_eq!(s.evictable(), 0);
        assert!(s.registered().is_empty());
        s.check_invariants();
    }

    #[test]
    fn a_run_frees_to_the_budget_skipping_pinned_busy_and_never_visiting_empty_inodes() {
        let s = Arc::new(ExtentMapShrinker::default());
        let cache = InodeCache::new(10_000);
        let mut keep = Vec::new();
        for ino in 256..1256 {
            keep.push(cache.get(InodeId { root: 5, ino }));
        }
        let a = with_maps(&s, &cache, 5, 2000, 10);
        let b = with_maps(&s, &cache, 5, 2001, 10);
        let c = with_maps(&s, &cache, 5, 2002, 10);
        assert!(a.mapping.extent_map.set_pinned(0, true));
        assert!(a.mapping.extent_map.set_pinned(K, true));
        s.check_invariants();
        s.set_limit(12);
        let busy = b.mapping.extent_map.write();
        assert!(s.balance());
        drop(busy);
        let st = s.stats();
        // 18 to scan (pinned maps count as scanned, as in the kernel): a: 10 scanned, 8
        // freed, 2 pinned kept; b busy, skipped; c: 8 scanned and freed.
        assert_eq!(a.mapping.extent_map.len(), 2);
        assert_eq!(b.mapping.extent_map.len(), 10);
        assert_eq!(c.mapping.extent_map.len(), 2);
        assert_eq!((st.scanned, st.freed, st.busy, st.evictable), (18, 16, 1, 14));
        assert_eq!(st.visited, 3, "1000 inodes without maps are never visited");
        s.check_invariants();
        // Unpinned and idle: the next run starts after c, wraps, and reaches the budget.
        assert!(a.mapping.extent_map.set_pinned(0, false));
        assert!(a.mapping.extent_map.set_pinned(K, false));
        assert!(s.balance());
        assert_eq!(s.evictable(), 12);
        assert_eq!(a.mapping.extent_map.len(), 0);
        assert_eq!(s.registered(), vec![b.id, c.id]);
        assert_eq!(s.stats().visited, 4);
        s.check_invariants();
    }

    #[test]
    fn runs_resume_after_the_last_inode_and_wrap_across_roots() {
        let s = Arc::new(ExtentMapShrinker::default());
        let cache = InodeCache::new(100);
        let mut held = Vec::new();
        for (root, ino) in [(5, 300), (5, 301), (256, 257), (257, 260)] {
            held.push(with_maps(&s, &cache, root, ino, 4));
        }
        // Two maps per run: each run frees half an inode, and the next resumes past it.
        assert!(s.free_extent_maps(2));
        assert_eq!(
            held.iter().map(|i| i.mapping.extent_map.len()).collect::<Vec<_>>(),
            vec![2, 4, 4, 4]
        );
        assert_eq!(s.cursor(), InodeId { root: 5, ino: 301 });
        assert!(s.free_extent_maps(6));
        assert_eq!(
            held.iter().map(|i| i.mapping.extent_map.len()).collect::<Vec<_>>(),
            vec![2, 0, 2, 4]
        );
        assert_eq!(s.cursor(), InodeId { root: 256, ino: 258 });
        // Past root 256 into 257, then wrapped to root 5.
        assert!(s.free_extent_maps(5));
        assert_eq!(
            held.iter().map(|i| i.mapping.extent_map.len()).collect::<Vec<_>>(),
            vec![1, 0, 2, 0]
        );
        assert_eq!(s.cursor(), InodeId { root: 5, ino: 301 });
        s.check_invariants();
        // A full circle at most: more than there is frees everything once and stops.
        assert!(s.free_extent_maps(1000));
        assert_eq!(s.evictable(), 0);
        s.check_invariants();
    }

    #[test]
    fn a_request_while_a_run_is_pending_is_coalesced() {
        let s = Arc::new(ExtentMapShrinker::default());
        let cache = InodeCache::new(100);
        let a = with_maps(&s, &cache, 5, 300, 4);
        s.nr_to_scan.store(4, Ordering::Release);
        assert!(!s.free_extent_maps(4), "a run is pending");
        assert_eq!(s.stats().coalesced, 1);
        assert_eq!(a.mapping.extent_map.len(), 4);
        s.nr_to_scan.store(0, Ordering::Release);
        assert!(s.free_extent_maps(4));
        assert_eq!(a.mapping.extent_map.len(), 0);
        let _ = EXTENT_FLAG_PINNED;
    }
}
