//! Pass 3: space accounting. Block-group `used` against the extent items inside each
//! group, superblock `bytes_used` against the groups, chunks against block groups and
//! dev extents (one per stripe), dev extents against each other and their device, and
//! each DEV_ITEM's `bytes_used` against its dev extents.
//!
//! `used` counts extent items as btrfs does: a data EXTENT_ITEM by its length, a tree
//! block by nodesize; superblock mirror stripes are never allocated, so never counted,
//! and an extent overlapping one is reported.

use super::codes::*;
use super::walk::{ChunkRec, State};
use super::{Finding, Sink};
use ubtrfs_core::FsInfo;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;

/// Nothing may be allocated on a device below this (boot area and primary superblock).
const DEV_RESERVED: u64 = 1 << 20;

/// Bytes one stripe (one device's share) of a chunk covers.
pub(super) fn stripe_length(c: &ChunkRec) -> u64 {
    let n = c.stripes.len() as u64;
    match c.type_ & BLOCK_GROUP_PROFILE_MASK {
        BLOCK_GROUP_RAID0 if n > 0 => c.length / n,
        BLOCK_GROUP_RAID10 if n > 0 => c.length.saturating_mul(u64::from(c.sub_stripes.max(1))) / n,
        BLOCK_GROUP_RAID5 if n > 1 => c.length / (n - 1),
        BLOCK_GROUP_RAID6 if n > 2 => c.length / (n - 2),
        _ => c.length,
    }
}

/// Logical ranges of the chunk at `logical` that hold superblock copies on some device
/// (the kernel's `exclude_super_stripes`: one whole 64 KiB stripe per copy, plus
/// anything below the primary superblock's offset).
pub(super) fn super_stripes(logical: u64, c: &ChunkRec) -> Vec<(u64, u64)> {
    let end = logical.saturating_add(c.length);
    let mut out = Vec::new();
    if logical < SUPER_INFO_OFFSET {
        out.push((logical, SUPER_INFO_OFFSET.min(end)));
    }
    let per_dev = stripe_length(c);
    let n = c.stripes.len() as u64;
    let profile = c.type_ & BLOCK_GROUP_PROFILE_MASK;
    if profile & (BLOCK_GROUP_RAID5 | BLOCK_GROUP_RAID6) != 0 {
        return out;
    }
    for m in 0..SUPER_MIRROR_MAX {
        let sb = sb_offset(m);
        for (i, &(_, phys)) in c.stripes.iter().enumerate() {
            if sb < phys || sb >= phys.saturating_add(per_dev) {
                continue;
            }
            let mut nr = (sb - phys) / STRIPE_LEN;
            let i = i as u64;
            match profile {
                BLOCK_GROUP_RAID0 => nr = nr.saturating_mul(n).saturating_add(i),
                BLOCK_GROUP_RAID10 => {
                    let sub = u64::from(c.sub_stripes.max(1));
                    nr = nr.saturating_mul(n / sub).saturating_add(i / sub);
                }
                _ => {}
            }
            let s = logical.saturating_add(nr.saturating_mul(STRIPE_LEN));
            if s < end {
                out.push((s, s.saturating_add(STRIPE_LEN).min(end)));
            }
        }
    }
    super::merge_ranges(out)
}

pub(super) fn check_space(fs: &FsInfo, st: &State, sink: &mut Sink) {
    let bgt = st.bg_tree;
    let mask = BLOCK_GROUP_TYPE_MASK | BLOCK_GROUP_PROFILE_MASK;

    // Chunks <-> block groups.
    for (&logical, c) in &st.chunks {
        match st.block_groups.get(&logical) {
            None => sink.push(
                Finding::new(
                    CHUNK_NO_BLOCK_GROUP,
                    format!(
                        "chunk [{logical}, {}) type {} has no block group item",
                        logical.saturating_add(c.length),
                        block_group_flags_str(c.type_)
                    ),
                )
                .root(CHUNK_TREE_OBJECTID)
                .bytenr(logical),
            ),
            Some(b) => {
                if b.len != c.length || b.flags & mask != c.type_ & mask {
                    sink.push(
                        Finding::new(
                            BLOCK_GROUP_MISMATCH,
                            format!(
                                "block group length {} flags {:#x}, chunk length {} type {:#x}",
                                b.len, b.flags, c.length, c.type_
                            ),
                        )
                        .root(bgt)
                        .bytenr(logical),
                    );
                }
            }
        }
    }
    for (&start, b) in &st.block_groups {
        if !st.chunks.contains_key(&start) {
            sink.push(
                Finding::new(
                    BLOCK_GROUP_NO_CHUNK,
                    format!(
                        "block group [{start}, {}) flags {} has no chunk",
                        start.saturating_add(b.len),
                        block_group_flags_str(b.flags)
                    ),
                )
                .root(bgt)
                .bytenr(start),
            );
        }
    }

    // Block group used, from the extent items inside each group.
    let mut total_used = 0u64;
    for (&start, b) in &st.block_groups {
        let end = start.saturating_add(b.len);
        let used: u64 = st.extents.range(start..end).map(|(_, r)| r.len).sum();
        total_used += used;
        if used != b.used {
            sink.push(
                Finding::new(
                    BG_USED_MISMATCH,
                    format!(
                        "block group [{start}, {end}) used {}, extent items inside use {used}",
                        b.used
                    ),
                )
                .root(bgt)
                .bytenr(start),
            );
        }
        if let Some(c) = st.chunks.get(&start) {
            for (s, e) in super_stripes(start, c) {
                if let Some((&xs, x)) =
                    st.extents.range(..e).next_back().filter(|(xs, x)| xs.saturating_add(x.len) > s)
                {
                    sink.push(
                        Finding::new(
                            EXTENT_IN_SUPER_STRIPE,
                            format!(
                                "extent [{xs}, {}) overlaps superblock stripe [{s}, {e})",
                                xs.saturating_add(x.len)
                            ),
                        )
                        .root(EXTENT_TREE_OBJECTID)
                        .bytenr(xs)
                        .key(x.key),
                    );
                }
            }
        }
    }
    let sb_used = fs.super_copy().bytes_used.get();
    if sb_used != total_used {
        sink.push(Finding::new(
            SUPER_BYTES_USED,
            format!("superblock bytes_used {sb_used}, block groups use {total_used}"),
        ));
    }

    // Chunk stripes <-> dev extents.
    let mut matched = std::collections::HashSet::new();
    for (&logical, c) in &st.chunks {
        let len = stripe_length(c);
        for &(devid, phys) in &c.stripes {
            if !st.devices.contains_key(&devid) {
                sink.push(
                    Finding::new(
                        DEV_ITEM_MISSING,
                        format!("chunk stripe on devid {devid} at {phys}, which has no DEV_ITEM"),
                    )
                    .root(CHUNK_TREE_OBJECTID)
                    .bytenr(logical),
                );
            }
            match st.dev_extents.get(&(devid, phys)) {
                Some(d) if d.chunk_offset == logical && d.length == len => {
                    matched.insert((devid, phys));
                }
                Some(d) => sink.push(
                    Finding::new(DEV_EXTENT_MISSING, format!("chunk stripe devid {devid} physical {phys} length {len}: dev extent there has chunk_offset {} length {}", d.chunk_offset, d.length))
                        .root(DEV_TREE_OBJECTID)
                        .bytenr(logical),
                ),
                None => sink.push(Finding::new(DEV_EXTENT_MISSING, format!("chunk stripe devid {devid} physical {phys} length {len} has no dev extent")).root(DEV_TREE_OBJECTID).bytenr(logical)),
            }
        }
    }
    let mut prev: Option<(u64, u64)> = None;
    let mut per_dev: std::collections::BTreeMap<u64, u64> = std::collections::BTreeMap::new();
    for (&(devid, phys), d) in &st.dev_extents {
        let key = ubtrfs_format::Key::new(devid, DEV_EXTENT_KEY, phys);
        if !matched.contains(&(devid, phys)) {
            sink.push(
                Finding::new(DEV_EXTENT_ORPHAN, format!("dev extent devid {devid} physical {phys} length {} for chunk {} matches no chunk stripe", d.length, d.chunk_offset))
                    .root(DEV_TREE_OBJECTID)
                    .key(key),
            );
        }
        *per_dev.entry(devid).or_default() += d.length;
        if phys < DEV_RESERVED
            && phys == 0
            && d.chunk_offset == 0
            && st.chunks.get(&0).is_some_and(|c| c.stripes == [(devid, 0)])
        {
            // mkfs.btrfs before 4.x mapped its first chunk 1:1 at physical 0; the kernel
            // accepts it (the superblock copies inside are excluded from allocation).
            sink.note(format!(
                "devid {devid} has the legacy first chunk at physical 0 (old mkfs.btrfs layout)"
            ));
        } else if phys < DEV_RESERVED {
            sink.push(
                Finding::new(
                    DEV_EXTENT_RESERVED,
                    format!("dev extent devid {devid} starts at {phys}, below 1 MiB"),
                )
                .root(DEV_TREE_OBJECTID)
                .key(key),
            );
        }
        if let Some((pd, pe)) = prev {
            if pd == devid && phys < pe {
                sink.push(Finding::new(DEV_EXTENT_OVERLAP, format!("dev extent devid {devid} at {phys} overlaps the previous one ending at {pe}")).root(DEV_TREE_OBJECTID).key(key));
            }
        }
        let end = phys.saturating_add(d.length);
        prev = match prev {
            Some((pd, pe)) if pd == devid => Some((devid, pe.max(end))),
            _ => Some((devid, end)),
        };
        match st.devices.get(&devid) {
            Some(dev) if end > dev.total_bytes => sink.push(
                Finding::new(DEV_EXTENT_BEYOND_DEVICE, format!("dev extent devid {devid} [{phys}, {end}) ends past the device's total_bytes {}", dev.total_bytes)).root(DEV_TREE_OBJECTID).key(key),
            ),
            Some(_) => {}
            None => sink.push(Finding::new(DEV_ITEM_MISSING, format!("dev extent on devid {devid}, which has no DEV_ITEM")).root(DEV_TREE_OBJECTID).key(key)),
        }
    }
    for (&devid, dev) in &st.devices {
        let sum = per_dev.get(&devid).copied().unwrap_or(0);
        if sum != dev.bytes_used {
            sink.push(
                Finding::new(
                    DEV_BYTES_USED,
                    format!(
                        "devid {devid} bytes_used {}, its dev extents total {sum}",
                        dev.bytes_used
                    ),
                )
                .root(CHUNK_TREE_OBJECTID)
                .key(ubtrfs_format::Key::new(
                    DEV_ITEMS_OBJECTID,
                    DEV_ITEM_KEY,
                    devid,
                )),
            );
        }
    }
    let nd = fs.super_copy().num_devices.get();
    if !st.devices.is_empty() && nd != st.devices.len() as u64 {
        sink.push(Finding::new(
            SUPER_NUM_DEVICES,
            format!("superblock num_devices {nd}, chunk tree has {} DEV_ITEMs", st.devices.len()),
        ));
    }
    let dev_total: u64 = st.devices.values().map(|d| d.total_bytes).sum();
    let sb_total = fs.super_copy().total_bytes.get();
    if sb_total < dev_total {
        sink.push(Finding::new(
            SUPER_TOTAL_BYTES,
            format!(
                "superblock total_bytes {sb_total} is smaller than the devices' total {dev_total}"
            ),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dup_super_stripe() {
        // The default fixture's METADATA|DUP chunk: the 64 MiB mirror lies in stripe 0.
        let c = ChunkRec {
            length: 33554432,
            type_: BLOCK_GROUP_METADATA | BLOCK_GROUP_DUP,
            sub_stripes: 1,
            stripes: vec![(1, 38797312), (1, 72351744)],
        };
        assert_eq!(super_stripes(30408704, &c), vec![(58720256, 58720256 + 65536)]);
        let single = ChunkRec {
            length: 8 << 20,
            type_: BLOCK_GROUP_DATA,
            sub_stripes: 1,
            stripes: vec![(1, 13631488)],
        };
        assert!(super_stripes(13631488, &single).is_empty());
        let raid0 = ChunkRec {
            length: 4 << 20,
            type_: BLOCK_GROUP_DATA | BLOCK_GROUP_RAID0,
            sub_stripes: 1,
            stripes: vec![(1, 63 << 20), (2, 63 << 20)],
        };
        // Physical 64 MiB is row 16 of each device: stripes 32 (dev 1) and 33 (dev 2).
        assert_eq!(
            super_stripes(1 << 30, &raid0),
            vec![((1 << 30) + 32 * 65536, (1 << 30) + 34 * 65536)]
        );
    }
}
