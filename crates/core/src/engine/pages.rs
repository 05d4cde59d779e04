//! The engine's side of the page cache (`mapping::page_cache` keeps each inode's): the
//! limits, the totals, and the registry of inodes with folios, which holds them so the
//! inode cache never evicts an inode with dirty data (the role of the kernel's
//! writeback lists of dirty inodes).

use crate::ids::InodeId;
use crate::inode::inode_cache::Inode;
use crate::mapping::page_cache::{DEFAULT_CACHE_BYTES, DEFAULT_DIRTY_BYTES};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

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
            max_extent: AtomicU64::new(crate::mapping::MAX_EXTENT_SIZE),
        }
    }
}

impl PageCacheGlobal {
    pub(crate) fn registry(&self) -> MutexGuard<'_, HashMap<InodeId, (Arc<Inode>, u64)>> {
        self.inodes.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn next_tick(&self) -> u64 {
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
