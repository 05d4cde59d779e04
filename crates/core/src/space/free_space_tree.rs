//! The free-space tree (tree 10): FREE_SPACE_INFO per block group plus
//! FREE_SPACE_EXTENT or FREE_SPACE_BITMAP items describing its free space, updated on
//! every allocation and free, converted between formats at the kernel's thresholds.
//!
//! The "using bitmaps" flag is cached in the in-memory block group (filled from INFO
//! when the group is cached) and kept current by the conversions, so an update never
//! looks up the INFO item just to learn the format (the 2025 kernel change); the INFO
//! item is only touched when extent_count changes.
//! Invariants: INFO.extent_count equals the number of maximal free runs in the group; a
//! group's items change only once the group is cached (`Group` is made by caching it),
//! so the allocator loads a group's free space from items nobody has changed yet.

use crate::error::Result;
#[cfg(any(test, feature = "test-hooks"))]
use crate::transaction::TransHandle;
use crate::transaction::Transaction;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::{FREE_SPACE_BITMAP_BITS, FREE_SPACE_USING_BITMAPS};
use ubtrfs_format::{Corrupt, CorruptWhere, Key};

const FST: u64 = FREE_SPACE_TREE_OBJECTID;

fn corrupt(r: String) -> crate::error::Error {
    Corrupt::new(CorruptWhere::Item, r).root(FST).into()
}

/// Conversion thresholds of a block group (`btrfs_set_free_space_tree_thresholds`).
pub fn thresholds(bg_len: u64, sectorsize: u32) -> (u32, u32) {
    let bitmap_range = u64::from(sectorsize) * FREE_SPACE_BITMAP_BITS;
    let num_bitmaps = bg_len.div_ceil(bitmap_range);
    let total_bitmap_size = num_bitmaps * (25 + FREE_SPACE_BITMAP_BITS / 8);
    let high = (total_bitmap_size / 25) as u32;
    let low = high.saturating_sub(100);
    (low, high)
}

/// A block group whose free-space-tree items may change: made only by `group_of`,
/// which caches the group first, so its in-memory free space was loaded from the items
/// before any of them changed.
struct Group {
    start: u64,
    len: u64,
}

fn group_of(w: &mut Transaction, bytenr: u64) -> Result<Group> {
    let g = w
        .alloc
        .group(bytenr)
        .ok_or_else(|| corrupt(format!("no block group contains {bytenr}")))?;
    let (start, len, cached) = (g.start, g.length, g.is_cached());
    if !cached {
        crate::space::allocator::cache_block_group(w, start)?;
    }
    Ok(Group { start, len })
}

/// The group [start, start+len) for a conversion, cached.
fn exact_group(w: &mut Transaction, start: u64, len: u64) -> Result<Group> {
    let g = group_of(w, start)?;
    if g.start != start || g.len != len {
        return Err(crate::error::Error::posix(
            crate::error::PosixKind::Invalid,
            format!("block group {start} +{len} (the group there is {} +{})", g.start, g.len),
        ));
    }
    Ok(g)
}

/// Read the INFO item: (extent_count, flags).
fn read_info(w: &mut Transaction, g: &Group) -> Result<(u32, u32)> {
    let key = Key::new(g.start, FREE_SPACE_INFO_KEY, g.len);
    let root = w.root(FST)?;
    match w.first_item_ge(&root, &key)? {
        Some((k, d)) if k == key => Ok((
            u32::from_le_bytes(d[0..4].try_into().expect("size checked by the tree checker")),
            u32::from_le_bytes(d[4..8].try_into().expect("size checked by the tree checker")),
        )),
        _ => Err(corrupt(format!("free space info for block group {} missing", g.start))),
    }
}

fn write_info(w: &mut Transaction, g: &Group, count: u32, flags: u32) -> Result<()> {
    let key = Key::new(g.start, FREE_SPACE_INFO_KEY, g.len);
    let (leaf, slot) = w
        .lookup_for_update(FST, &key, 0)?
        .ok_or_else(|| corrupt(format!("free space info for block group {} missing", g.start)))?;
    let d = w.item_data_mut(leaf, slot);
    d[0..4].copy_from_slice(&count.to_le_bytes());
    d[4..8].copy_from_slice(&flags.to_le_bytes());
    Ok(())
}

/// Where an update learns a group's format in place of the flag cached in the block
/// group (`TestHooks::fst_format_lookup`): given the group's start and length, whether
/// its free space is in bitmaps. A benchmark (crates/bench, seed003) installs the
/// kernel's lookup of the FREE_SPACE_INFO item on every update as its baseline;
/// production code never calls one.
#[cfg(feature = "test-hooks")]
pub type FstFormatFn = fn(w: &mut Transaction, start: u64, len: u64) -> Result<bool>;

/// Whether the group's free space is in bitmaps: the cached flag, looked up once.
fn using_bitmaps(w: &mut Transaction, g: &Group) -> Result<bool> {
    #[cfg(feature = "test-hooks")]
    if let Some(lookup) = w.hooks.fst_format_lookup {
        let b = lookup(w, g.start, g.len)?;
        w.alloc.set_fst_bitmaps(g.start, b);
        return Ok(b);
    }
    if let Some(b) = w.alloc.fst_bitmaps(g.start) {
        return Ok(b);
    }
    let (_, flags) = read_info(w, g)?;
    let b = flags & FREE_SPACE_USING_BITMAPS != 0;
    w.alloc.set_fst_bitmaps(g.start, b);
    Ok(b)
}

/// Give a group created in this transaction its INFO item and one free extent
/// covering the whole group (`add_block_group_free_space`), if not done yet.
///
/// # Errors
/// Tree modification failures.
/// In the handle `h` (the public form; the engine's own changes call `add_block_group_free_space_in`).
#[cfg(any(test, feature = "test-hooks"))]
pub fn add_block_group_free_space(h: &mut TransHandle<'_>, start: u64) -> Result<()> {
    add_block_group_free_space_in(h, start)
}

pub(crate) fn add_block_group_free_space_in(w: &mut Transaction, start: u64) -> Result<()> {
    let g = group_of(w, start)?;
    ensure_group_added(w, &g)
}

/// A group created in this transaction gets its INFO and one free extent first.
fn ensure_group_added(w: &mut Transaction, g: &Group) -> Result<()> {
    if !w.alloc.take_needs_free_space(g.start) {
        return Ok(());
    }
    let mut info = [0u8; 8];
    info[0..4].copy_from_slice(&1u32.to_le_bytes());
    w.insert_item(FST, &Key::new(g.start, FREE_SPACE_INFO_KEY, g.len), &info)?;
    w.insert_item(FST, &Key::new(g.start, FREE_SPACE_EXTENT_KEY, g.len), &[])?;
    w.alloc.set_fst_bitmaps(g.start, false);
    Ok(())
}

/// Mark [start, start+len) allocated in the free-space tree.
///
/// # Errors
/// `Corrupt` if the range is not entirely free in the tree.
/// In the handle `h` (the public form; the engine's own changes call `remove_from_free_space_tree_in`).
#[cfg(any(test, feature = "test-hooks"))]
pub fn remove_from_free_space_tree(h: &mut TransHandle<'_>, start: u64, len: u64) -> Result<()> {
    remove_from_free_space_tree_in(h, start, len)
}

pub(crate) fn remove_from_free_space_tree_in(
    w: &mut Transaction,
    start: u64,
    len: u64,
) -> Result<()> {
    let t0 = timing_start(w);
    let r = update_free_space(w, start, len, false);
    record_timing(w, t0);
    r
}

/// Mark [start, start+len) free in the free-space tree.
///
/// # Errors
/// `Corrupt` if part of the range is already free.
/// In the handle `h` (the public form; the engine's own changes call `add_to_free_space_tree_in`).
#[cfg(any(test, feature = "test-hooks"))]
pub fn add_to_free_space_tree(h: &mut TransHandle<'_>, start: u64, len: u64) -> Result<()> {
    add_to_free_space_tree_in(h, start, len)
}

pub(crate) fn add_to_free_space_tree_in(w: &mut Transaction, start: u64, len: u64) -> Result<()> {
    let t0 = timing_start(w);
    let r = update_free_space(w, start, len, true);
    record_timing(w, t0);
    r
}

/// Add (`free`) or remove [start, start+len) in whichever format the group uses.
fn update_free_space(w: &mut Transaction, start: u64, len: u64, free: bool) -> Result<()> {
    let g = group_of(w, start)?;
    ensure_group_added(w, &g)?;
    let delta = match (using_bitmaps(w, &g)?, free) {
        (true, _) => modify_bitmaps(w, &g, start, len, free)?,
        (false, true) => add_extent(w, &g, start, len)?,
        (false, false) => remove_extent(w, &g, start, len)?,
    };
    update_extent_count(w, &g, delta)
}

/// Benchmark hook (`TestHooks::fst_timings`): the start of one timed update.
#[cfg(feature = "test-hooks")]
fn timing_start(w: &Transaction) -> Option<std::time::Instant> {
    w.hooks.fst_timings.is_some().then(std::time::Instant::now)
}
#[cfg(not(feature = "test-hooks"))]
fn timing_start(_: &Transaction) -> Option<std::time::Instant> {
    None
}

/// Benchmark hook (`TestHooks::fst_timings`): append the duration of one update.
#[cfg(feature = "test-hooks")]
fn record_timing(w: &mut Transaction, t0: Option<std::time::Instant>) {
    if let (Some(t0), Some(v)) = (t0, w.hooks.fst_timings.as_mut()) {
        v.push(u32::try_from(t0.elapsed().as_nanos()).unwrap_or(u32::MAX));
    }
}
#[cfg(not(feature = "test-hooks"))]
fn record_timing(_: &mut Transaction, _: Option<std::time::Instant>) {}

/// Conversion thresholds (low, high) of group `g`: the kernel's, unless a test set
/// its own (`TestHooks::fst_thresholds_override`).
fn group_thresholds(w: &Transaction, g: &Group) -> (u32, u32) {
    #[cfg(feature = "test-hooks")]
    if let Some(t) = w.hooks.fst_thresholds_override {
        return t;
    }
    thresholds(g.len, w.sectorsize())
}

fn remove_extent(w: &mut Transaction, g: &Group, start: u64, len: u64) -> Result<i64> {
    let end = start + len;
    let found = w.last_item_le(FST, &Key::new(start, FREE_SPACE_EXTENT_KEY, u64::MAX))?;
    let (a, l) = match found {
        Some((k, _))
            if k.type_ == FREE_SPACE_EXTENT_KEY
                && k.objectid >= g.start
                && k.objectid <= start
                && k.objectid + k.offset >= end =>
        {
            (k.objectid, k.offset)
        }
        other => {
            return Err(corrupt(format!(
                "removing [{start}, {end}) which is not free in the free space tree (found {:?})",
                other.map(|(k, _)| k)
            )))
        }
    };
    w.delete_item(FST, &Key::new(a, FREE_SPACE_EXTENT_KEY, l))?;
    let mut delta = -1;
    if a < start {
        w.insert_item(FST, &Key::new(a, FREE_SPACE_EXTENT_KEY, start - a), &[])?;
        delta += 1;
    }
    if end < a + l {
        w.insert_item(FST, &Key::new(end, FREE_SPACE_EXTENT_KEY, a + l - end), &[])?;
        delta += 1;
    }
    Ok(delta)
}

fn add_extent(w: &mut Transaction, g: &Group, start: u64, len: u64) -> Result<i64> {
    let end = start + len;
    let mut new_start = start;
    let mut new_end = end;
    let mut delta = 1;
    if start > g.start {
        if let Some((k, _)) =
            w.last_item_le(FST, &Key::new(start - 1, FREE_SPACE_EXTENT_KEY, u64::MAX))?
        {
            if k.type_ == FREE_SPACE_EXTENT_KEY && k.objectid >= g.start {
                let kend = k.objectid + k.offset;
                if kend > start {
                    return Err(corrupt(format!(
                        "adding [{start}, {end}) overlaps free extent {k}"
                    )));
                }
                if kend == start {
                    w.delete_item(FST, &k)?;
                    new_start = k.objectid;
                    delta -= 1;
                }
            }
        }
    }
    if end < g.start + g.len {
        let root = w.root(FST)?;
        if let Some((k, _)) = w.first_item_ge(&root, &Key::new(start, FREE_SPACE_EXTENT_KEY, 0))? {
            if k.type_ == FREE_SPACE_EXTENT_KEY && k.objectid < end {
                return Err(corrupt(format!("adding [{start}, {end}) overlaps free extent {k}")));
            }
            if k.type_ == FREE_SPACE_EXTENT_KEY && k.objectid == end {
                w.delete_item(FST, &k)?;
                new_end = end + k.offset;
                delta -= 1;
            }
        }
    }
    w.insert_item(FST, &Key::new(new_start, FREE_SPACE_EXTENT_KEY, new_end - new_start), &[])?;
    Ok(delta)
}

fn bitmap_range(w: &Transaction) -> u64 {
    u64::from(w.sectorsize()) * FREE_SPACE_BITMAP_BITS
}

/// Key of the bitmap item covering `pos`.
fn bitmap_key(w: &Transaction, g: &Group, pos: u64) -> Key {
    let r = bitmap_range(w);
    let s = g.start + (pos - g.start) / r * r;
    Key::new(s, FREE_SPACE_BITMAP_KEY, r.min(g.start + g.len - s))
}

fn bit_is_free(w: &mut Transaction, g: &Group, pos: u64) -> Result<bool> {
    let key = bitmap_key(w, g, pos);
    let root = w.root(FST)?;
    match w.first_item_ge(&root, &key)? {
        Some((k, d)) if k == key => {
            let bit = ((pos - k.objectid) / u64::from(w.sectorsize())) as usize;
            Ok(d[bit / 8] & (1 << (bit % 8)) != 0)
        }
        _ => Err(corrupt(format!("free space bitmap {key} missing"))),
    }
}

/// Set (`free`) or clear bits for [start, start+len); returns the extent_count delta.
fn modify_bitmaps(w: &mut Transaction, g: &Group, start: u64, len: u64, free: bool) -> Result<i64> {
    let end = start + len;
    let ss = u64::from(w.sectorsize());
    let prev = if start > g.start { bit_is_free(w, g, start - ss)? } else { false };
    let next = if end < g.start + g.len { bit_is_free(w, g, end)? } else { false };
    let mut pos = start;
    while pos < end {
        let key = bitmap_key(w, g, pos);
        let (leaf, slot) = w
            .lookup_for_update(FST, &key, 0)?
            .ok_or_else(|| corrupt(format!("free space bitmap {key} missing")))?;
        let item_end = key.objectid + key.offset;
        let stop = end.min(item_end);
        let d = w.item_data_mut(leaf, slot);
        let mut p = pos;
        while p < stop {
            let bit = ((p - key.objectid) / ss) as usize;
            let was = d[bit / 8] & (1 << (bit % 8)) != 0;
            if was == free {
                return Err(corrupt(format!(
                    "free space bitmap bit for {p} already {}",
                    if free { "free" } else { "allocated" }
                )));
            }
            d[bit / 8] ^= 1 << (bit % 8);
            p += ss;
        }
        pos = stop;
    }
    let n = i64::from(prev) + i64::from(next);
    Ok(if free { 1 - n } else { n - 1 })
}

fn update_extent_count(w: &mut Transaction, g: &Group, delta: i64) -> Result<()> {
    if delta == 0 {
        return Ok(());
    }
    let (count, flags) = read_info(w, g)?;
    let new = i64::from(count) + delta;
    if new < 0 {
        return Err(corrupt(format!(
            "free space extent count of block group {} would become {new}",
            g.start
        )));
    }
    let new = new as u32;
    write_info(w, g, new, flags)?;
    let (low, high) = group_thresholds(w, g);
    let bitmaps = flags & FREE_SPACE_USING_BITMAPS != 0;
    if !bitmaps && new > high {
        convert_to_bitmaps_in(w, g.start, g.len)?;
    } else if bitmaps && new < low {
        convert_to_extents_in(w, g.start, g.len)?;
    }
    Ok(())
}

/// Free runs of the group as the tree holds them (either format).
///
/// # Errors
/// Read failures.
pub fn free_runs(w: &mut Transaction, start: u64, len: u64) -> Result<Vec<(u64, u64)>> {
    let items = w.items_in_range(
        FST,
        &Key::new(start, FREE_SPACE_INFO_KEY + 1, 0),
        &Key::new(start + len - 1, u8::MAX, u64::MAX),
    )?;
    let ss = u64::from(w.sectorsize());
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (k, d) in items {
        match k.type_ {
            FREE_SPACE_EXTENT_KEY => runs.push((k.objectid, k.offset)),
            FREE_SPACE_BITMAP_KEY => {
                let bits = k.offset / ss;
                for b in 0..bits as usize {
                    if d[b / 8] & (1 << (b % 8)) != 0 {
                        let p = k.objectid + b as u64 * ss;
                        match runs.last_mut() {
                            Some((s, l)) if *s + *l == p => *l += ss,
                            _ => runs.push((p, ss)),
                        }
                    }
                }
            }
            _ => {}
        }
    }
    // Merge runs that touch across bitmap items.
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (s, l) in runs {
        match out.last_mut() {
            Some((ps, pl)) if *ps + *pl == s => *pl += l,
            _ => out.push((s, l)),
        }
    }
    Ok(out)
}

/// The INFO item's extent count, which must equal the free runs the group's items
/// hold before a conversion rewrites them (the kernel checks both directions too).
///
/// # Errors
/// `Corrupt` naming the group when they differ; read failures.
fn counted_info(w: &mut Transaction, g: &Group, runs: usize) -> Result<(u32, u32)> {
    let (count, flags) = read_info(w, g)?;
    if count as usize != runs {
        return Err(Corrupt::new(
            CorruptWhere::Item,
            format!(
                "incorrect extent count for block group {}; counted {runs}, expected {count}",
                g.start
            ),
        )
        .root(FST)
        .key(Key::new(g.start, FREE_SPACE_INFO_KEY, g.len))
        .into());
    }
    Ok((count, flags))
}

fn delete_group_items(w: &mut Transaction, g: &Group, ty: u8) -> Result<()> {
    let items = w.items_in_range(
        FST,
        &Key::new(g.start, ty, 0),
        &Key::new(g.start + g.len - 1, ty, u64::MAX),
    )?;
    for (k, _) in items {
        if k.type_ == ty {
            w.delete_item(FST, &k)?;
        }
    }
    Ok(())
}

/// Rewrite the group's free space as bitmaps (`convert_free_space_to_bitmaps`).
///
/// # Errors
/// `Corrupt` when the INFO item's extent count disagrees with the free runs, or from
/// caching the group; `Posix(Invalid)` when no group is [start, start+len); tree
/// modification failures.
/// In the handle `h` (the public form; the engine's own changes call `convert_to_bitmaps_in`).
#[cfg(any(test, feature = "test-hooks"))]
pub fn convert_to_bitmaps(h: &mut TransHandle<'_>, start: u64, len: u64) -> Result<()> {
    convert_to_bitmaps_in(h, start, len)
}

pub(crate) fn convert_to_bitmaps_in(w: &mut Transaction, start: u64, len: u64) -> Result<()> {
    let g = exact_group(w, start, len)?;
    let runs = free_runs(w, g.start, g.len)?;
    let (count, flags) = counted_info(w, &g, runs.len())?;
    delete_group_items(w, &g, FREE_SPACE_EXTENT_KEY)?;
    let r = bitmap_range(w);
    let ss = u64::from(w.sectorsize());
    let mut s = g.start;
    while s < g.start + g.len {
        let l = r.min(g.start + g.len - s);
        let mut bits = vec![0u8; (l / ss).div_ceil(8) as usize];
        for &(rs, rl) in &runs {
            let a = rs.max(s);
            let b = (rs + rl).min(s + l);
            let mut p = a;
            while p < b {
                let bit = ((p - s) / ss) as usize;
                bits[bit / 8] |= 1 << (bit % 8);
                p += ss;
            }
        }
        w.insert_item(FST, &Key::new(s, FREE_SPACE_BITMAP_KEY, l), &bits)?;
        s += l;
    }
    write_info(w, &g, count, flags | FREE_SPACE_USING_BITMAPS)?;
    w.alloc.set_fst_bitmaps(g.start, true);
    Ok(())
}

/// Rewrite the group's free space as extents (`convert_free_space_to_extents`).
///
/// # Errors
/// `Corrupt` when the INFO item's extent count disagrees with the free runs, or from
/// caching the group; `Posix(Invalid)` when no group is [start, start+len); tree
/// modification failures.
/// In the handle `h` (the public form; the engine's own changes call `convert_to_extents_in`).
#[cfg(any(test, feature = "test-hooks"))]
pub fn convert_to_extents(h: &mut TransHandle<'_>, start: u64, len: u64) -> Result<()> {
    convert_to_extents_in(h, start, len)
}

pub(crate) fn convert_to_extents_in(w: &mut Transaction, start: u64, len: u64) -> Result<()> {
    let g = exact_group(w, start, len)?;
    let runs = free_runs(w, g.start, g.len)?;
    let (count, flags) = counted_info(w, &g, runs.len())?;
    delete_group_items(w, &g, FREE_SPACE_BITMAP_KEY)?;
    for (s, l) in &runs {
        w.insert_item(FST, &Key::new(*s, FREE_SPACE_EXTENT_KEY, *l), &[])?;
    }
    write_info(w, &g, count, flags & !FREE_SPACE_USING_BITMAPS)?;
    w.alloc.set_fst_bitmaps(g.start, false);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn kernel_thresholds() {
        let k = 4096u32;
        assert_eq!(thresholds(4 << 20, k), (0, 11));
        assert_eq!(thresholds(8 << 20, k), (0, 11));
        assert_eq!(thresholds(256 << 20, k), (259, 359));
        assert_eq!(thresholds(1 << 30, k), (1338, 1438));
        assert_eq!(thresholds(10 << 30, k), (14287, 14387));
    }
}
