//! The inode locks the engine's file operations take (the role of the kernel's
//! i_rwsem): shared for reads, exclusive for changes, two at once in `InodeId` order.
//! An operation takes the inode locks it needs, then the engine's lock, never the other
//! way round.

use crate::inode::inode_cache::Inode;
use std::sync::{RwLockReadGuard, RwLockWriteGuard};

/// The lock carries no data (the engine's lock protects the trees), so a holder's
/// panic leaves nothing half-changed behind it.
pub(crate) fn read_lock(i: &Inode) -> RwLockReadGuard<'_, ()> {
    i.lock.read().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn write_lock(i: &Inode) -> RwLockWriteGuard<'_, ()> {
    i.lock.write().unwrap_or_else(|p| p.into_inner())
}

/// Lock `a` and `b` exclusively in `InodeId` order (one lock if they are the same).
pub(crate) fn write_lock_two<'a>(
    a: &'a Inode,
    b: Option<&'a Inode>,
) -> (RwLockWriteGuard<'a, ()>, Option<RwLockWriteGuard<'a, ()>>) {
    match b {
        None => (write_lock(a), None),
        Some(b) if b.id == a.id => (write_lock(a), None),
        Some(b) if a.id < b.id => {
            let ga = write_lock(a);
            (ga, Some(write_lock(b)))
        }
        Some(b) => {
            let gb = write_lock(b);
            (write_lock(a), Some(gb))
        }
    }
}
