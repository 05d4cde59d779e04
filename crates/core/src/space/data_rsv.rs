//! Data space promised to buffered writes before writeback allocates it (the data
//! space_info's `bytes_may_use` in the kernel, which `btrfs_check_data_free_space`
//! charges at write(2) time).
//!
//! Every dirty page-cache block takes a new data extent at writeback (COW; a nocow
//! or preallocated block may go in place, which only the slow path asks about). So
//! a buffered write is admitted only while the dirty bytes, plus what writes under
//! way have reserved, fit in the free space of the data block groups: a write the
//! filesystem cannot hold fails with ENOSPC at write(2), not later at a writeback
//! that would lose it. The dirty total moves with the page cache (`delalloc`); the
//! free space is published by the writer when a change moved data space (`free`),
//! so the check at write time takes no lock.
//!
//! Writeback keeps the count conservative: delalloc allocates a run's extents
//! while its blocks are still dirty, and the direct path holds an in-flight
//! reservation across the moment its blocks stop being dirty and their extents
//! exist.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct DataReservations {
    /// Dirty page-cache bytes: the page cache's dirty total (its one counter).
    delalloc: AtomicU64,
    /// Bytes held by writes under way (`DataReservation`).
    inflight: AtomicU64,
    /// Data bytes allocatable as of the last change that moved data space.
    free: AtomicU64,
}

impl DataReservations {
    /// Bytes promised: dirty plus in flight.
    pub fn outstanding(&self) -> u64 {
        self.delalloc.load(Ordering::Acquire) + self.inflight.load(Ordering::Acquire)
    }

    /// The free data space last published.
    pub fn free(&self) -> u64 {
        self.free.load(Ordering::Acquire)
    }

    pub(crate) fn publish_free(&self, bytes: u64) {
        self.free.store(bytes, Ordering::Release);
    }

    /// The page cache's dirty total moved from `before` to `after` bytes for one inode.
    pub(crate) fn dirty_moved(&self, before: u64, after: u64) {
        if after >= before {
            self.delalloc.fetch_add(after - before, Ordering::AcqRel);
        } else {
            let prev = self.delalloc.fetch_sub(before - after, Ordering::AcqRel);
            assert!(
                prev >= before - after,
                "data reservations: delalloc {prev} below a release of {}",
                before - after
            );
        }
    }

    /// Dirty page-cache bytes.
    pub(crate) fn dirty(&self) -> u64 {
        self.delalloc.load(Ordering::Acquire)
    }

    /// Hold `bytes` in flight; whether everything promised still fits the free space.
    pub(crate) fn hold(&self, bytes: u64) -> DataReservation<'_> {
        self.inflight.fetch_add(bytes, Ordering::AcqRel);
        DataReservation { rsv: self, bytes }
    }
}

/// Bytes held in flight until dropped: by a write until its blocks are dirty (which
/// counts them from then on), or by a writeback until their extents are allocated.
#[derive(Debug)]
pub struct DataReservation<'a> {
    rsv: &'a DataReservations,
    bytes: u64,
}

impl DataReservation<'_> {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether everything promised, this included, fits the published free space.
    pub(crate) fn fits(&self) -> bool {
        self.rsv.outstanding() <= self.rsv.free()
    }
}

impl Drop for DataReservation<'_> {
    fn drop(&mut self) {
        let prev = self.rsv.inflight.fetch_sub(self.bytes, Ordering::AcqRel);
        assert!(
            prev >= self.bytes,
            "data reservations: {prev} in flight below a release of {}",
            self.bytes
        );
    }
}
