//! The items that map the filesystem onto devices: CHUNK_ITEM (also in the superblock's
//! sys_chunk_array), DEV_ITEM, DEV_EXTENT and BLOCK_GROUP_ITEM.

use super::{aligned, exact, read_prefix, CheckResult, ItemCtx, ParseResult};
use crate::key::*;
use crate::structs::*;
use zerocopy::FromBytes;

/// A chunk: its header and stripes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkView {
    pub length: u64,
    pub owner: u64,
    pub stripe_len: u64,
    pub type_: u64,
    pub io_align: u32,
    pub io_width: u32,
    pub sector_size: u32,
    pub sub_stripes: u16,
    pub stripes: Vec<(u64, u64, [u8; UUID_SIZE])>,
}

/// Byte size of a chunk item with `num_stripes` stripes (48 + 32 n).
pub fn chunk_item_size(num_stripes: usize) -> usize {
    core::mem::size_of::<ChunkHeader>() + num_stripes * core::mem::size_of::<Stripe>()
}

/// Parse a chunk item from the front of `data`; returns the chunk and the bytes used.
/// Structural checks only (counts and sizes); `check_chunk` checks values.
pub fn chunk(data: &[u8]) -> ParseResult<(ChunkView, usize)> {
    let ch: &ChunkHeader = read_prefix(data, "chunk item")?;
    let n = ch.num_stripes.get() as usize;
    if n == 0 {
        return Err("invalid chunk num_stripes, have 0".to_string());
    }
    // btrfs_chunk embeds the first stripe; its 48-byte header here excludes it.
    let size = core::mem::size_of::<ChunkHeader>() + n * core::mem::size_of::<Stripe>();
    if data.len() < size {
        return Err(format!(
            "invalid chunk item size, have {} expect {} for {} stripes",
            data.len(),
            size,
            n
        ));
    }
    let mut stripes = Vec::with_capacity(n);
    for i in 0..n {
        let off = core::mem::size_of::<ChunkHeader>() + i * core::mem::size_of::<Stripe>();
        let s = Stripe::ref_from_prefix(&data[off..]).expect("size checked above").0;
        stripes.push((s.devid.get(), s.offset.get(), s.dev_uuid));
    }
    Ok((
        ChunkView {
            length: ch.length.get(),
            owner: ch.owner.get(),
            stripe_len: ch.stripe_len.get(),
            type_: ch.type_.get(),
            io_align: ch.io_align.get(),
            io_width: ch.io_width.get(),
            sector_size: ch.sector_size.get(),
            sub_stripes: ch.sub_stripes.get(),
            stripes,
        },
        size,
    ))
}

/// Check a chunk's values (shared by the chunk tree and the sys_chunk_array).
///
/// # Errors
/// A reason string naming the bad field.
pub fn check_chunk(
    c: &ChunkView,
    logical: u64,
    sectorsize: u32,
) -> core::result::Result<(), String> {
    // The sys_chunk_array is parsed from superblocks not yet validated (fuzz: superblock).
    if !sectorsize.is_power_of_two() {
        return Err(format!("invalid sectorsize {sectorsize} for chunk {logical}"));
    }
    if c.length == 0 || !aligned(c.length, sectorsize) {
        return Err(format!("invalid chunk length {}", c.length));
    }
    if !aligned(logical, sectorsize) || logical.checked_add(c.length).is_none() {
        return Err(format!("invalid chunk logical {logical}"));
    }
    if c.stripe_len != STRIPE_LEN {
        return Err(format!("invalid chunk stripe length {}", c.stripe_len));
    }
    if c.sector_size != sectorsize {
        return Err(format!(
            "invalid chunk sectorsize, have {} expect {sectorsize}",
            c.sector_size
        ));
    }
    // Stripe numbers must fit in 32 bits (btrfs_stripe_nr_to_offset(U32_MAX)).
    if c.length >= u64::from(u32::MAX) * STRIPE_LEN {
        return Err(format!(
            "chunk length too large: have {} limit {}",
            c.length,
            u64::from(u32::MAX) * STRIPE_LEN
        ));
    }
    if c.type_ & !(BLOCK_GROUP_TYPE_MASK | BLOCK_GROUP_PROFILE_MASK) != 0 {
        return Err(format!(
            "unrecognized chunk type: {:#x}",
            c.type_ & !(BLOCK_GROUP_TYPE_MASK | BLOCK_GROUP_PROFILE_MASK)
        ));
    }
    check_bg_type(c.type_)?;
    let n = c.stripes.len();
    let p = c.type_ & BLOCK_GROUP_PROFILE_MASK;
    let ok = match p {
        0 => n == 1,
        BLOCK_GROUP_DUP => n == 2,
        BLOCK_GROUP_RAID1 => n == 2,
        BLOCK_GROUP_RAID1C3 => n == 3,
        BLOCK_GROUP_RAID1C4 => n == 4,
        BLOCK_GROUP_RAID0 => n >= 1,
        // valid_stripe_count asks only for sub_stripes 2 (and ncopies, 2, stripes);
        // an odd stripe is left unused by the mapping.
        BLOCK_GROUP_RAID10 => n >= 2 && c.sub_stripes == 2,
        BLOCK_GROUP_RAID5 => n >= 2,
        BLOCK_GROUP_RAID6 => n >= 3,
        _ => false,
    };
    if !ok {
        return Err(format!(
            "invalid num_stripes {n} (sub_stripes {}) for profile {}",
            c.sub_stripes,
            profile_name(c.type_)
        ));
    }
    // A stripe's devid is not checked (a missing device is found when the chunk is
    // mapped). Kept beyond btrfs_check_chunk_valid: the stripe's physical end, which
    // the mapping adds unchecked; the kernel refuses such a chunk at mount too, finding
    // no dev extent for it (btrfs_verify_dev_extents).
    for &(_, off, _) in &c.stripes {
        if off.checked_add(c.length).is_none() {
            return Err(format!("chunk stripe offset {off} overflows"));
        }
    }
    Ok(())
}

/// A chunk tree item: the chunk's values, and nothing after its stripes.
pub(crate) fn check_chunk_item(key: &Key, data: &[u8], ctx: &ItemCtx) -> CheckResult {
    let (c, used) = chunk(data)?;
    if used != data.len() {
        return Err(format!("invalid chunk item size, have {} expect {used}", data.len()));
    }
    check_chunk(&c, key.offset, ctx.sectorsize)?;
    Ok(())
}

/// As check_dev_item.
pub(crate) fn check_dev_item(key: &Key, data: &[u8]) -> CheckResult {
    if key.objectid != DEV_ITEMS_OBJECTID {
        return Err(format!("invalid objectid: has={} expect={DEV_ITEMS_OBJECTID}", key.objectid));
    }
    exact::<DevItem>(data, "dev")?;
    let d: &DevItem = read_prefix(data, "dev")?;
    if d.devid.get() != key.offset {
        return Err(format!("devid mismatch, key has {} item has {}", key.offset, d.devid.get()));
    }
    if d.bytes_used.get() > d.total_bytes.get() {
        return Err(format!(
            "invalid bytes used {} > total {}",
            d.bytes_used.get(),
            d.total_bytes.get()
        ));
    }
    Ok(())
}

/// As check_dev_extent_item; kept beyond it: the item size (readers take the struct).
pub(crate) fn check_dev_extent(key: &Key, data: &[u8], ctx: &ItemCtx) -> CheckResult {
    exact::<DevExtent>(data, "dev extent")?;
    let d: &DevExtent = read_prefix(data, "dev extent")?;
    if d.chunk_tree.get() != CHUNK_TREE_OBJECTID {
        return Err(format!(
            "invalid dev extent chunk tree id, has {} expect {CHUNK_TREE_OBJECTID}",
            d.chunk_tree.get()
        ));
    }
    if d.chunk_objectid.get() != FIRST_CHUNK_TREE_OBJECTID {
        return Err(format!(
            "invalid dev extent chunk objectid, has {} expect {FIRST_CHUNK_TREE_OBJECTID}",
            d.chunk_objectid.get()
        ));
    }
    for (what, v) in [
        ("key.offset", key.offset),
        ("chunk offset", d.chunk_offset.get()),
        ("length", d.length.get()),
    ] {
        if !aligned(v, ctx.sectorsize) {
            return Err(format!(
                "invalid dev extent {what}, has {v} not aligned to {}",
                ctx.sectorsize
            ));
        }
    }
    Ok(())
}

/// As check_block_group_item.
pub(crate) fn check_block_group_item(key: &Key, data: &[u8]) -> CheckResult {
    exact::<BlockGroupItem>(data, "block group")?;
    let b: &BlockGroupItem = read_prefix(data, "block group")?;
    if key.offset == 0 {
        return Err("invalid block group size 0".into());
    }
    if b.used.get() > key.offset {
        return Err(format!(
            "invalid block group used, have {} expect [0, {}]",
            b.used.get(),
            key.offset
        ));
    }
    if b.chunk_objectid.get() != FIRST_CHUNK_TREE_OBJECTID {
        return Err(format!("invalid block group chunk objectid {}", b.chunk_objectid.get()));
    }
    // As check_block_group_item: type and profile, no rule on other bits
    // (unknown ones are refused in the chunk item).
    check_bg_type(b.flags.get())?;
    Ok(())
}

/// A block group's or chunk's type and profile bits (check_block_group_item).
fn check_bg_type(flags: u64) -> core::result::Result<(), String> {
    let t = flags & BLOCK_GROUP_TYPE_MASK;
    if !(t == BLOCK_GROUP_DATA
        || t == BLOCK_GROUP_SYSTEM
        || t == BLOCK_GROUP_METADATA
        || t == BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA)
    {
        return Err(format!("invalid block group type flags {flags:#x}"));
    }
    let p = flags & BLOCK_GROUP_PROFILE_MASK;
    if p.count_ones() > 1 {
        return Err(format!("invalid profile flags {flags:#x}"));
    }
    Ok(())
}
