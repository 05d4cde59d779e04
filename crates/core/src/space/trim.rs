//! FITRIM: tell the devices which space holds nothing (the kernel's `btrfs_trim_fs`,
//! fs/btrfs/extent-tree.c, with `btrfs_trim_block_group` of free-space-cache.c and
//! `btrfs_trim_free_extents`), so an image file gives that space back to the host
//! (holes punched) and an SSD learns which blocks it may erase.
//!
//! Two kinds of space are discarded, as on the kernel:
//! - the free space of every block group that meets `[start, start + len)`, as the
//!   allocator's free-space cache holds it (`FreeSpaceCtl`): extent entries and the
//!   runs of each bitmap, each clipped to the range and taken when at least `minlen`
//!   long. What the running transaction reserved, what it freed (pinned until its
//!   commit), what a commit in flight freed and what a reader's view still reads are
//!   never in that cache, and neither are superblock stripes. Each run is mapped to
//!   every copy on every device (a DUP or RAID1 run counts once per copy, as
//!   `btrfs_discard_extent` counts it);
//! - the unallocated space of every writable device that takes discards: from 1 MiB
//!   to the device's size, outside every dev extent and chunk stripe, whatever the
//!   range and `minlen` say (the kernel trims a device whole). Unallocated space
//!   trimmed once is remembered for as long as the filesystem is open
//!   (`TrimmedDevSpace`, the kernel's CHUNK_TRIMMED bits), so a second FITRIM
//!   discards only what chunks gave back since; block-group free space is discarded
//!   every time (the kernel's synchronous trim does not skip trimmed entries either).
//!
//! Every physical discard skips the superblock copies (4 KiB at 64 KiB, 64 MiB and
//! 256 GiB, as `btrfs_issue_discard` does) and is aligned to 512-byte sectors.
//!
//! Invariants: a trim never races an allocation (each block group, and the devices'
//! unallocated space, is trimmed under the engine's writer lock, taken once per group
//! so that writers wait at most one group's discards); a trim changes no tree and
//! begins no transaction; a filesystem opened read-only discards nothing (the kernel's
//! `ro` mount answers FITRIM with 0 bytes) and an aborted one refuses.
//!
//! Neighbours: `allocator` and `free_space_cache` (the free space), `volumes` (the
//! chunk map and the `BlockDevice::discard` seam); `Engine::fitrim` (engine/trim.rs) checks
//! the range and runs these steps, each under the writer lock.

use crate::error::{Error, PosixKind, Result};
use crate::ids::Logical;
use crate::ranges::merge_ranges;
use crate::space::free_space_cache::{EntryKind, FreeSpaceCtl};
use crate::transaction::Transaction;
use crate::volumes::device::BlockDevice;
use crate::volumes::MapLookup;
use std::collections::BTreeMap;
use ubtrfs_format::key::{DEV_EXTENT_KEY, DEV_TREE_OBJECTID};
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;

/// The device space below this is never discarded (`BTRFS_DEVICE_RANGE_RESERVED`: the
/// first superblock and what boot loaders keep there).
pub const DEVICE_RANGE_RESERVED: u64 = 1 << 20;

/// `struct fstrim_range`: the logical range to trim and the shortest free run worth a
/// discard. On return `len` holds the bytes discarded and `minlen` the minimum used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FstrimRange {
    pub start: u64,
    pub len: u64,
    pub minlen: u64,
}

/// The unallocated device space discarded since the filesystem was opened, per devid
/// (start -> end), which later trims skip. Space a chunk took since is forgotten at
/// the next trim (the kernel clears CHUNK_TRIMMED when it allocates a chunk).
#[derive(Default)]
pub struct TrimmedDevSpace {
    by_dev: BTreeMap<u64, BTreeMap<u64, u64>>,
}

/// What a trim step discarded, and the error that stopped it, if one did.
pub(crate) struct Step {
    pub(crate) bytes: u64,
    pub(crate) error: Option<Error>,
}

/// The free runs of a group's cache in `[start, end)` worth a discard: each extent
/// entry, and each run of set bits of each bitmap entry, clipped to the range and at
/// least `minlen` long (`trim_no_bitmap`, then `trim_bitmaps`).
fn free_runs(ctl: &FreeSpaceCtl, start: u64, end: u64, minlen: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut take = |s: u64, e: u64| {
        let (s, e) = (s.max(start), e.min(end));
        if e > s && e - s >= minlen {
            out.push((s, e - s));
        }
    };
    let unit = ctl.unit();
    let bits = ctl.bits_per_bitmap() as usize;
    for entry in ctl.entries() {
        match entry.kind {
            EntryKind::Extent => take(entry.offset, entry.offset + entry.bytes),
            EntryKind::Bitmap => {
                let Some(words) = ctl.bitmap_words(entry.offset) else { continue };
                let set = |i: usize| words[i / 64] & (1 << (i % 64)) != 0;
                let mut i = 0;
                while i < bits {
                    if !set(i) {
                        i += 1;
                        continue;
                    }
                    let j = (i..bits).find(|&j| !set(j)).unwrap_or(bits);
                    take(entry.offset + i as u64 * unit, entry.offset + j as u64 * unit);
                    i = j;
                }
            }
        }
    }
    out
}

/// Discard the free space of the group at `bg_start` inside `[start, end)`, caching
/// the group first (`btrfs_trim_block_group`).
pub(crate) fn trim_block_group(
    w: &mut Transaction,
    bg_start: u64,
    start: u64,
    end: u64,
    minlen: u64,
) -> Step {
    if let Err(e) = crate::space::allocator::cache_block_group(w, bg_start) {
        return Step { bytes: 0, error: Some(e) };
    }
    let Some(ctl) = w.alloc.group(bg_start).and_then(|g| g.ctl()) else {
        return Step { bytes: 0, error: None };
    };
    if ctl.free_space() < minlen {
        return Step { bytes: 0, error: None };
    }
    let unit = ctl.unit();
    let runs = free_runs(ctl, start, end, minlen);
    let mut bytes = 0;
    for (s, l) in runs {
        // The allocator cannot run while the lock is held: the run is still free,
        // to the whole sectors around it (the range may cut runs off-sector).
        debug_assert!(
            w.alloc
                .group(bg_start)
                .and_then(|g| g.ctl())
                .is_some_and(|c| c
                    .is_free(s / unit * unit, (s + l).next_multiple_of(unit) - s / unit * unit)),
            "trimming {s} +{l}, which is not free in block group {bg_start}"
        );
        match discard_logical(w, s, l) {
            Ok(n) => bytes += n,
            Err(e) => return Step { bytes, error: Some(e) },
        }
    }
    Step { bytes, error: None }
}

/// Device bytes each stripe of the chunk takes (its dev extent's length).
fn dev_stripe_len(c: &MapLookup) -> u64 {
    let n = (c.stripes.len() as u64).max(1);
    match c.profile() {
        BLOCK_GROUP_RAID0 => c.length / n,
        BLOCK_GROUP_RAID10 => c.length / n * u64::from(c.sub_stripes.max(1)),
        _ => c.length,
    }
}

/// Discard every copy of `[logical, logical + len)`, which lies in one chunk
/// (`btrfs_discard_extent`). Returns the bytes the devices discarded, summed over
/// the copies; a device missing or taking no discards counts nothing.
fn discard_logical(w: &Transaction, logical: u64, len: u64) -> Result<u64> {
    let c = w.info.chunk_map.lookup(Logical(logical))?;
    let end = logical + len;
    assert!(
        end <= c.logical + c.length,
        "discard {logical} +{len} crosses the end of chunk {} +{}",
        c.logical,
        c.length
    );
    let mut pieces: BTreeMap<u64, Vec<(u64, u64)>> = BTreeMap::new();
    for mirror in 0..c.num_copies() {
        let mut cur = logical;
        while cur < end {
            let (index, phys, contig) = c.map(cur, mirror);
            let n = contig.min(end - cur);
            pieces.entry(c.stripes[index].0).or_default().push((phys, n));
            cur += n;
        }
    }
    let mut bytes = 0;
    for (devid, ranges) in pieces {
        let Some(dev) = w.info.devices.by_id.get(&devid) else { continue };
        if dev.dev.discard_granularity().is_none() {
            continue;
        }
        for (s, e) in merge_ranges(ranges.into_iter().map(|(s, l)| (s, s + l)).collect()) {
            bytes += issue_discard(&*dev.dev, s, e - s)?;
        }
    }
    Ok(bytes)
}

/// Discard `[start, start + len)` of `dev` around the superblock copies, in 512-byte
/// sectors (`btrfs_issue_discard`): an unaligned start moves up to the next sector
/// and the length shrinks to whole sectors; the sector-rounded tail of an unaligned
/// length is counted as discarded, as the kernel counts it. Returns the bytes
/// discarded; a device that turns out to take no discards discards nothing.
fn issue_discard(dev: &dyn BlockDevice, start: u64, len: u64) -> Result<u64> {
    const SECTOR: u64 = 512;
    let (mut start, len) = match start.next_multiple_of(SECTOR) {
        a if a == start => (start, len),
        a => (a, len.saturating_sub(a - start) / SECTOR * SECTOR),
    };
    let end = start + len;
    let mut done = 0;
    let mut send = |s: u64, l: u64| -> Result<()> {
        let sectors = l / SECTOR * SECTOR;
        if sectors > 0 {
            match dev.discard(s, sectors) {
                Ok(()) => {}
                Err(e) if e.posix_kind() == Some(PosixKind::NotSupported) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        done += l;
        Ok(())
    };
    for mirror in 0..SUPER_MIRROR_MAX {
        let sb_start = sb_offset(mirror);
        let sb_end = sb_start + SUPER_INFO_SIZE as u64;
        if sb_end <= start || sb_start >= end {
            continue;
        }
        if sb_start > start {
            send(start, sb_start - start)?;
        }
        start = sb_end;
    }
    if end > start {
        send(start, end - start)?;
    }
    Ok(done)
}

/// Every device range of `devid` a chunk holds: its chunks' stripes (the chunk map
/// has the chunks of the running transaction too) and its committed DEV_EXTENTs,
/// sorted and merged.
fn allocated_on(w: &mut Transaction, devid: u64) -> Result<Vec<(u64, u64)>> {
    let mut used: Vec<(u64, u64)> = Vec::new();
    for c in w.info.chunk_map.iter() {
        let len = dev_stripe_len(&c);
        used.extend(c.stripes.iter().filter(|s| s.0 == devid).map(|s| (s.1, s.1 + len)));
    }
    for (k, d) in w.items_in_range(
        DEV_TREE_OBJECTID,
        &Key::new(devid, DEV_EXTENT_KEY, 0),
        &Key::new(devid, DEV_EXTENT_KEY, u64::MAX),
    )? {
        // The tree checker sized the item; a length past the address space is capped.
        let len = u64::from_le_bytes(
            d[24..32].try_into().expect("dev extent size checked by the tree checker"),
        );
        used.push((k.offset, k.offset + len.min(u64::MAX - k.offset)));
    }
    Ok(merge_ranges(used))
}

/// Discard the unallocated space of device `devid` that no trim since the open has
/// discarded (`btrfs_trim_free_extents`).
pub(crate) fn trim_free_dev_extents(w: &mut Transaction, devid: u64) -> Step {
    let none = Step { bytes: 0, error: None };
    let Some(dev) = w.info.devices.by_id.get(&devid).map(|d| d.dev.clone()) else { return none };
    let Some(item) = w.alloc.dev_item(devid) else { return none };
    if dev.discard_granularity().is_none() || item.total_bytes.get() <= item.bytes_used.get() {
        return none;
    }
    let allocated = match allocated_on(w, devid) {
        Ok(a) => a,
        Err(e) => return Step { bytes: 0, error: Some(e) },
    };
    let limit = item.total_bytes.get().min(dev.size());
    let trimmed = w.trimmed.by_dev.entry(devid).or_default();
    // A chunk allocated over space trimmed earlier makes it untrimmed again.
    for &(s, e) in &allocated {
        remove_range(trimmed, s, e);
    }
    let mut busy: Vec<(u64, u64)> = allocated.clone();
    busy.extend(trimmed.iter().map(|(&s, &e)| (s, e)));
    let busy = merge_ranges(busy);
    let mut bytes = 0;
    let mut pos = DEVICE_RANGE_RESERVED;
    for (s, e) in busy.into_iter().chain([(limit, limit)]) {
        let gap_end = s.min(limit);
        if gap_end > pos {
            debug_assert!(
                allocated.iter().all(|&(a, ae)| ae <= pos || a >= gap_end),
                "device {devid}: trimming {pos}..{gap_end}, which a chunk holds"
            );
            match issue_discard(&*dev, pos, gap_end - pos) {
                Ok(n) => {
                    // As the kernel marks it: the first `n` bytes of the gap (all of
                    // it unless a superblock copy sat inside).
                    if n > 0 {
                        add_range(trimmed, pos, pos + n);
                    }
                    bytes += n;
                }
                Err(e) => return Step { bytes, error: Some(e) },
            }
        }
        pos = pos.max(e);
        if pos >= limit {
            break;
        }
    }
    Step { bytes, error: None }
}

/// Add `[s, e)` to a set of ranges (start -> end), merging neighbours.
fn add_range(set: &mut BTreeMap<u64, u64>, mut s: u64, mut e: u64) {
    remove_range(set, s, e);
    if let Some((&ps, &pe)) = set.range(..s).next_back() {
        if pe == s {
            set.remove(&ps);
            s = ps;
        }
    }
    if let Some(ne) = set.remove(&e) {
        e = ne;
    }
    set.insert(s, e);
}

/// Take `[s, e)` out of a set of ranges (start -> end).
fn remove_range(set: &mut BTreeMap<u64, u64>, s: u64, e: u64) {
    let hit: Vec<(u64, u64)> =
        set.range(..e).filter(|&(_, &re)| re > s).map(|(&rs, &re)| (rs, re)).collect();
    for (rs, re) in hit {
        set.remove(&rs);
        if rs < s {
            set.insert(rs, s);
        }
        if re > e {
            set.insert(e, re);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volumes::device::MemDevice;

    #[test]
    fn ranges_add_and_remove() {
        let mut m = BTreeMap::new();
        add_range(&mut m, 10, 20);
        add_range(&mut m, 20, 30);
        add_range(&mut m, 40, 50);
        assert_eq!(m.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(), vec![(10, 30), (40, 50)]);
        remove_range(&mut m, 15, 45);
        assert_eq!(m.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(), vec![(10, 15), (45, 50)]);
        add_range(&mut m, 0, 100);
        assert_eq!(m.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(), vec![(0, 100)]);
    }

    #[test]
    fn issue_discard_skips_superblocks_and_aligns() {
        let dev = MemDevice::new(vec![0xaau8; 70 << 20], "d");
        // Across the copy at 64 MiB: the 4 KiB of the superblock stay.
        let n = issue_discard(&dev, (64 << 20) - 8192, 16384).unwrap();
        assert_eq!(n, 12288);
        assert_eq!(dev.discarded(), vec![((64 << 20) - 8192, 8192), ((64 << 20) + 4096, 4096)]);
        let mut sb = vec![0u8; 4096];
        dev.read_at(&mut sb, 64 << 20).unwrap();
        assert!(sb.iter().all(|&b| b == 0xaa), "the superblock copy was discarded");
        // Starting inside the first copy (64 KiB), unaligned: the start moves up to
        // 66048 and the length down to 18 sectors (to 75264), then past the copy.
        let dev = MemDevice::new(vec![0u8; 1 << 20], "d");
        assert_eq!(issue_discard(&dev, 65536 + 100, 10000).unwrap(), 75264 - 69632);
        assert_eq!(dev.discarded(), vec![(69632, 75264 - 69632)]);
        // An unaligned start moves up to the next sector, the length shrinks with it.
        let dev = MemDevice::new(vec![0u8; 1 << 20], "d");
        assert_eq!(issue_discard(&dev, (512 << 10) + 1, 4096).unwrap(), 3584);
        assert_eq!(dev.discarded(), vec![((512 << 10) + 512, 3584)]);
    }
}
