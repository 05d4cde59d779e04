//! Block groups, read-only: the BLOCK_GROUP_ITEM of every chunk (the kernel's
//! `btrfs_read_block_groups`) and per-type usage sums like `btrfs filesystem df`.
//!
//! Block group items live in the block-group tree (11) when compat_ro BLOCK_GROUP_TREE
//! is set, else in the extent tree (2), interleaved with extent items. Either way each
//! chunk is looked up by its exact key `(logical, BLOCK_GROUP_ITEM, length)`, so the
//! cost is one search per chunk, not a walk of the extent tree.
//!
//! Invariants: every chunk has exactly one block group with the same start, length and
//! type/profile bits; a missing or mismatched one is corruption naming the chunk.
//! Neighbours: `volumes` (the chunk map these follow), `ctree` (search_slot).

use crate::disk_io::FsInfo;
use crate::error::Result;
use crate::ids::Logical;
use crate::tree::search::{Search, TreeView};
use crate::volumes::MapLookup;
use ubtrfs_format::features::COMPAT_RO_BLOCK_GROUP_TREE;
use ubtrfs_format::items::read_prefix;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::{Corrupt, CorruptWhere, Key};

/// One block group: a chunk's logical range and how much of it is allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockGroupInfo {
    /// Logical start (the chunk's logical address).
    pub start: u64,
    pub length: u64,
    /// Bytes allocated to extents inside the group.
    pub used: u64,
    /// `BLOCK_GROUP_*` type and profile bits.
    pub flags: u64,
}

/// Usage summed over all block groups of one type and profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpaceInfo {
    /// Type and profile bits (`BLOCK_GROUP_DATA | BLOCK_GROUP_RAID1`, ...).
    pub flags: u64,
    /// Sum of block group lengths (logical bytes).
    pub total: u64,
    /// Sum of block group `used` (logical bytes).
    pub used: u64,
    /// Device bytes the groups occupy (total times the profile's replication).
    pub raw_total: u64,
    /// Device bytes behind `used`.
    pub raw_used: u64,
}

/// Device bytes behind `logical` bytes of a chunk with `profile` and `num_stripes`.
///
/// Mirrored profiles multiply by their copy count; RAID5/6 add one or two parity
/// stripes per row. Saturates instead of overflowing on absurd values.
pub fn raw_bytes(logical: u64, profile: u64, num_stripes: usize) -> u64 {
    let n = num_stripes as u64;
    match profile & BLOCK_GROUP_PROFILE_MASK {
        BLOCK_GROUP_DUP | BLOCK_GROUP_RAID1 | BLOCK_GROUP_RAID10 => logical.saturating_mul(2),
        BLOCK_GROUP_RAID1C3 => logical.saturating_mul(3),
        BLOCK_GROUP_RAID1C4 => logical.saturating_mul(4),
        BLOCK_GROUP_RAID5 if n > 1 => {
            (u128::from(logical) * u128::from(n) / u128::from(n - 1)).try_into().unwrap_or(u64::MAX)
        }
        BLOCK_GROUP_RAID6 if n > 2 => {
            (u128::from(logical) * u128::from(n) / u128::from(n - 2)).try_into().unwrap_or(u64::MAX)
        }
        _ => logical,
    }
}

/// Order of types in usage tables: Data, Data+Metadata, System, Metadata (as `btrfs
/// filesystem df` lists them), unknown combinations last.
fn type_rank(flags: u64) -> u8 {
    match flags & BLOCK_GROUP_TYPE_MASK {
        BLOCK_GROUP_DATA => 0,
        x if x == BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA => 1,
        BLOCK_GROUP_SYSTEM => 2,
        BLOCK_GROUP_METADATA => 3,
        _ => 4,
    }
}

impl FsInfo {
    /// List every block group, in logical order, one per chunk.
    ///
    /// # Errors
    /// `Corrupt` naming the chunk when its block group item is missing or disagrees
    /// with the chunk; `Io`/`Corrupt` from reading the tree; `Posix(NotFound)` when the
    /// tree holding the items has no root item.
    pub fn block_groups(&self) -> Result<Vec<BlockGroupInfo>> {
        let tree_id = if self.super_copy().compat_ro_flags.get() & COMPAT_RO_BLOCK_GROUP_TREE != 0 {
            BLOCK_GROUP_TREE_OBJECTID
        } else {
            EXTENT_TREE_OBJECTID
        };
        let (root, _) = self.read_root(tree_id)?;
        let mut out = Vec::with_capacity(self.chunk_map.len());
        for chunk in self.chunk_map.iter() {
            let key = Key::new(chunk.logical, BLOCK_GROUP_ITEM_KEY, chunk.length);
            let search = self.search_slot(&root, &key)?;
            let missing = || {
                Corrupt::new(
                    CorruptWhere::Item,
                    format!(
                        "chunk {} length {} has no block group item",
                        chunk.logical, chunk.length
                    ),
                )
                .root(tree_id)
            };
            let Search::Found(path) = search else {
                return Err(missing().into());
            };
            let item = path.item().ok_or_else(missing)?;
            let bg: &BlockGroupItem = read_prefix(item.data(), "block group item")
                .map_err(|r| item_corrupt(tree_id, &item, r))?;
            let flags = bg.flags.get();
            check_matches_chunk(&chunk, flags).map_err(|r| item_corrupt(tree_id, &item, r))?;
            out.push(BlockGroupInfo {
                start: chunk.logical,
                length: chunk.length,
                used: bg.used.get(),
                flags,
            });
        }
        Ok(out)
    }

    /// Sum block groups per type and profile, like `btrfs filesystem df`.
    ///
    /// # Errors
    /// As `block_groups`.
    pub fn space_info(&self) -> Result<Vec<SpaceInfo>> {
        let mut out: Vec<SpaceInfo> = Vec::new();
        for bg in self.block_groups()? {
            let stripes =
                self.chunk_map.lookup(Logical(bg.start)).map(|c| c.stripes.len()).unwrap_or(1);
            let flags = bg.flags & (BLOCK_GROUP_TYPE_MASK | BLOCK_GROUP_PROFILE_MASK);
            let idx = match out.iter().position(|s| s.flags == flags) {
                Some(i) => i,
                None => {
                    out.push(SpaceInfo { flags, total: 0, used: 0, raw_total: 0, raw_used: 0 });
                    out.len() - 1
                }
            };
            let s = &mut out[idx];
            s.total = s.total.saturating_add(bg.length);
            s.used = s.used.saturating_add(bg.used);
            s.raw_total = s.raw_total.saturating_add(raw_bytes(bg.length, flags, stripes));
            s.raw_used = s.raw_used.saturating_add(raw_bytes(bg.used, flags, stripes));
        }
        out.sort_by_key(|s| (type_rank(s.flags), s.flags));
        Ok(out)
    }
}

fn item_corrupt(
    tree_id: u64,
    item: &crate::tree::search::ItemRef,
    reason: String,
) -> crate::error::Error {
    Corrupt::new(CorruptWhere::Item, reason)
        .root(tree_id)
        .block(item.eb.bytenr)
        .slot(item.slot as u32, item.key())
        .into()
}

/// The block group must describe the chunk it belongs to (type and profile bits).
fn check_matches_chunk(chunk: &MapLookup, bg_flags: u64) -> core::result::Result<(), String> {
    let mask = BLOCK_GROUP_TYPE_MASK | BLOCK_GROUP_PROFILE_MASK;
    if bg_flags & mask != chunk.type_ & mask {
        return Err(format!(
            "block group flags {bg_flags:#x} do not match chunk {} type {:#x}",
            chunk.logical, chunk.type_
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_factors() {
        assert_eq!(raw_bytes(100, 0, 1), 100);
        assert_eq!(raw_bytes(100, BLOCK_GROUP_RAID0, 4), 100);
        assert_eq!(raw_bytes(100, BLOCK_GROUP_DUP, 2), 200);
        assert_eq!(raw_bytes(100, BLOCK_GROUP_RAID1, 2), 200);
        assert_eq!(raw_bytes(100, BLOCK_GROUP_RAID10, 4), 200);
        assert_eq!(raw_bytes(100, BLOCK_GROUP_RAID1C3, 3), 300);
        assert_eq!(raw_bytes(100, BLOCK_GROUP_RAID1C4, 4), 400);
        assert_eq!(raw_bytes(300, BLOCK_GROUP_RAID5, 4), 400);
        assert_eq!(raw_bytes(200, BLOCK_GROUP_RAID6, 4), 400);
        assert_eq!(raw_bytes(u64::MAX, BLOCK_GROUP_RAID1C4, 4), u64::MAX);
    }

    #[test]
    fn df_order() {
        let mut v = [
            BLOCK_GROUP_METADATA,
            BLOCK_GROUP_SYSTEM,
            BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA,
            BLOCK_GROUP_DATA,
        ];
        v.sort_by_key(|f| type_rank(*f));
        assert_eq!(
            v,
            [
                BLOCK_GROUP_DATA,
                BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA,
                BLOCK_GROUP_SYSTEM,
                BLOCK_GROUP_METADATA
            ]
        );
    }
}
