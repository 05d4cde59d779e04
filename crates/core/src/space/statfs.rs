//! What statfs(2) reports for the filesystem, as the kernel's `btrfs_statfs` computes it
//! from the space infos and the devices' unallocated space.
//!
//! - `blocks`: the filesystem's total bytes divided by the data profile's copies.
//! - `bfree`: that minus everything used (all types, by their copies), minus the
//!   global block reserve.
//! - `bavail`: free space inside data block groups, plus what the devices' unallocated
//!   space could still give data chunks of the data profile
//!   (`btrfs_calc_avail_data_space`), by the data profile's copies.
//! - No inode counts (btrfs has no inode table): files and ffree are 0.
//!
//! It reads the writer's in-memory block groups and device items, so it counts the
//! running transaction's allocations (`BlockGroup::taken`: used, plus what was
//! reserved or pinned since the last commit), as the kernel's space infos count them
//! once their delayed refs run; space freed in the running transaction stays taken
//! until it commits. Differences from
//! the kernel, bounded and named: the global reserve is ubtrfs's metadata reserve
//! (`allocator::metadata_reserve`, 256 tree blocks, within a few MiB of the kernel's),
//! and the kernel's "metadata space info is full" (set when a metadata chunk
//! allocation failed) is read here as "the devices' unallocated space cannot give a
//! metadata chunk of the metadata profile any more".
//! - `bavail` is 0 when metadata is exhausted, as the kernel guesses it: no metadata
//!   chunk can be allocated and the free metadata space (every copy counted) is under
//!   4 MiB or under that plus the reserve. Never on mixed block groups.

use crate::space::chunk_alloc::raid_attr;
use crate::transaction::Transaction;
use ubtrfs_format::structs::*;

/// The numbers statfs(2) reports, in `bsize` blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
}

/// BTRFS_STRIPE_LEN.
const STRIPE_LEN: u64 = 64 << 10;
/// The first MiB of every device is never allocated.
const DEVICE_SKIP: u64 = 1 << 20;

/// `btrfs_calc_avail_data_space`: raw bytes (every copy counted; divide by the
/// profile's copies for data) that new chunks of
/// `profile` could take from the devices' unallocated space (`avail`, per device).
pub fn calc_avail_data_space(mut avail: Vec<u64>, profile: u64) -> u64 {
    let Some(ra) = raid_attr(profile) else { return 0 };
    avail = avail
        .into_iter()
        .map(|a| a - a % STRIPE_LEN)
        .filter(|&a| a > DEVICE_SKIP)
        .map(|a| a - DEVICE_SKIP)
        .collect();
    let n = avail.len();
    let mut num_stripes = if profile & BLOCK_GROUP_RAID0 != 0 {
        n
    } else if profile & (BLOCK_GROUP_RAID1 | BLOCK_GROUP_RAID1C3 | BLOCK_GROUP_RAID1C4) != 0 {
        ra.ncopies
    } else if profile & BLOCK_GROUP_RAID10 != 0 {
        4
    } else {
        1
    };
    let min_stripes = ra.devs_min.max(1);
    let min_stripe_size = ra.dev_stripes as u64 * STRIPE_LEN;
    // Largest first: each round takes the smallest device's room from the
    // `num_stripes` devices just above it, as one more chunk would.
    avail.sort_unstable_by(|a, b| b.cmp(a));
    let mut total = 0u64;
    let mut nr = n;
    while nr >= min_stripes && nr > 0 {
        num_stripes = num_stripes.min(nr);
        let i = nr - 1;
        let take = avail[i];
        if take >= min_stripe_size && num_stripes > 0 {
            total = total.saturating_add(take.saturating_mul(num_stripes as u64));
            for a in &mut avail[i + 1 - num_stripes..=i] {
                *a -= take.min(*a);
            }
        }
        nr -= 1;
    }
    total
}

/// The kernel's threshold under which free metadata space counts as exhausted (the
/// delta observed when writes started failing was about 2 MiB).
const META_EXHAUSTED_THRESH: u64 = 4 << 20;

/// `btrfs_statfs`'s guess that metadata is exhausted, so nothing more can be written:
/// no new metadata chunk fits in the unallocated space (`meta_chunk_room`, raw bytes)
/// and the free metadata space (raw) is under the threshold, or under it plus the
/// global reserve.
fn metadata_exhausted(meta_chunk_room: u64, free_meta: u64, reserve: u64) -> bool {
    meta_chunk_room == 0
        && (free_meta < META_EXHAUSTED_THRESH || free_meta - META_EXHAUSTED_THRESH < reserve)
}

impl Transaction {
    /// What statfs(2) reports (see the module notes).
    pub fn statfs(&self) -> StatFs {
        let bits = self.sectorsize().trailing_zeros();
        let (mut total_used, mut free_data, mut free_meta, mut factor) = (0u64, 0u64, 0u64, 1u64);
        for g in self.alloc.groups.values() {
            let copies =
                raid_attr(g.flags & BLOCK_GROUP_PROFILE_MASK).map_or(1, |a| a.ncopies as u64);
            let taken = g.taken();
            total_used = total_used.saturating_add(taken.saturating_mul(copies));
            if g.flags & BLOCK_GROUP_DATA != 0 {
                free_data =
                    free_data.saturating_add(g.length.saturating_sub(taken).saturating_mul(copies));
                factor = copies;
            }
            if g.flags & BLOCK_GROUP_METADATA != 0 {
                free_meta =
                    free_meta.saturating_add(g.length.saturating_sub(taken).saturating_mul(copies));
            }
        }
        let sb = &self.sb;
        let blocks = (sb.total_bytes.get() / factor) >> bits;
        let rsv = crate::space::allocator::metadata_reserve(self) >> bits;
        let bfree = blocks.saturating_sub((total_used / factor) >> bits).saturating_sub(rsv);
        let unallocated: Vec<u64> = self
            .alloc
            .dev_items
            .values()
            .map(|d| d.total_bytes.get().saturating_sub(d.bytes_used.get()))
            .collect();
        let data_profile = crate::space::chunk_alloc::alloc_profile(self, BLOCK_GROUP_DATA);
        let mut bavail = (free_data / factor
            + calc_avail_data_space(unallocated.clone(), data_profile) / factor)
            >> bits;
        if !self.alloc.mixed {
            let meta_profile = crate::space::chunk_alloc::alloc_profile(self, BLOCK_GROUP_METADATA);
            if metadata_exhausted(
                calc_avail_data_space(unallocated, meta_profile),
                free_meta,
                rsv << bits,
            ) {
                bavail = 0;
            }
        }
        StatFs {
            blocks,
            bfree,
            bavail,
            files: 0,
            ffree: 0,
            bsize: self.sectorsize(),
            namelen: NAME_LEN as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_exhausted_as_the_kernel_guesses() {
        const M: u64 = 1 << 20;
        // Room for another metadata chunk: never exhausted.
        assert!(!metadata_exhausted(64 << 10, 0, 8 * M));
        // No room: exhausted under 4 MiB free, or under 4 MiB plus the reserve.
        assert!(metadata_exhausted(0, 4 * M - 1, 0));
        assert!(!metadata_exhausted(0, 4 * M, 0));
        assert!(metadata_exhausted(0, 11 * M, 8 * M));
        assert!(!metadata_exhausted(0, 12 * M, 8 * M));
    }

    const G: u64 = 1 << 30;
    const M: u64 = 1 << 20;

    #[test]
    fn avail_data_space_per_profile() {
        // SINGLE: every device's room past its first MiB.
        assert_eq!(calc_avail_data_space(vec![10 * G, 4 * G], 0), 14 * G - 2 * M);
        // RAID1 over 10 and 4 GiB: 4 GiB of pairs (8 GiB raw); the rest has no partner.
        assert_eq!(calc_avail_data_space(vec![10 * G + M, 4 * G + M], BLOCK_GROUP_RAID1), 8 * G);
        // RAID1 over three equal devices: the kernel's estimate pairs the smallest
        // with its neighbour once and stops (8 GiB raw), short of the 12 a real
        // allocation would reach; df on the kernel shows the same.
        assert_eq!(calc_avail_data_space(vec![4 * G + M; 3], BLOCK_GROUP_RAID1), 8 * G);
        // RAID0 over 3 and 1 GiB: two devices x 1 GiB, then 2 GiB on the larger alone.
        assert_eq!(calc_avail_data_space(vec![3 * G + M, G + M], BLOCK_GROUP_RAID0), 4 * G);
        // DUP: the raw room (statfs divides by the two copies).
        assert_eq!(calc_avail_data_space(vec![2 * G + M], BLOCK_GROUP_DUP), 2 * G);
        // Too few devices for the profile: nothing.
        assert_eq!(calc_avail_data_space(vec![2 * G], BLOCK_GROUP_RAID1C3), 0);
        // A device with under a MiB free counts for nothing.
        assert_eq!(calc_avail_data_space(vec![M / 2], 0), 0);
    }
}
