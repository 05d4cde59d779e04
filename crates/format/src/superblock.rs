//! Superblock validation and the sys_chunk_array bootstrap list.
//!
//! `check_super` accepts a 4096-byte buffer only if its magic, checksum and geometry are
//! sane (the rules of the kernel's `btrfs_validate_super`), so later code can trust
//! sectorsize, nodesize, levels and the chunk array.

use crate::csum::CsumType;
use crate::error::{Corrupt, CorruptWhere, Result};
use crate::items::{chunk, ChunkView};
use crate::key::{DiskKey, Key, CHUNK_ITEM_KEY, FIRST_CHUNK_TREE_OBJECTID};
use crate::structs::*;
use zerocopy::FromBytes;

fn bad(reason: impl Into<String>) -> Corrupt {
    Corrupt::new(CorruptWhere::Super, reason)
}

/// Parse and validate a superblock read from `expect_bytenr`.
///
/// # Errors
/// `Corrupt` (where = Super) naming the first failed rule.
pub fn check_super(buf: &[u8], expect_bytenr: u64) -> Result<Superblock> {
    if buf.len() < SUPER_INFO_SIZE {
        return Err(bad(format!("short superblock read at {expect_bytenr}: {} bytes", buf.len())));
    }
    let sb = Superblock::read_from_bytes(&buf[..SUPER_INFO_SIZE]).expect("exact size");
    let sb_err = |r: String| bad(r).block(expect_bytenr);
    if sb.magic.get() != MAGIC {
        return Err(sb_err(format!("bad magic {:#018x}, expect {:#018x}", sb.magic.get(), MAGIC)));
    }
    let csum_type = CsumType::from_raw(sb.csum_type.get()).ok_or_else(|| sb_err(format!("unsupported checksum algorithm {}", sb.csum_type.get())))?;
    if !csum_type.verify(&buf[CSUM_SIZE..SUPER_INFO_SIZE], &sb.csum) {
        return Err(sb_err(format!("superblock checksum mismatch ({})", csum_type.name())));
    }
    if sb.bytenr.get() != expect_bytenr {
        return Err(sb_err(format!("superblock bytenr {} does not match its location {expect_bytenr}", sb.bytenr.get())));
    }
    let ss = sb.sectorsize.get();
    let ns = sb.nodesize.get();
    if !ss.is_power_of_two() || !(4096..=65536).contains(&ss) {
        return Err(sb_err(format!("invalid sectorsize {ss}")));
    }
    if !ns.is_power_of_two() || ns < ss || ns > 65536 {
        return Err(sb_err(format!("invalid nodesize {ns} (sectorsize {ss})")));
    }
    if sb.leafsize.get() != ns {
        return Err(sb_err(format!("leafsize {} != nodesize {ns}", sb.leafsize.get())));
    }
    for (name, v) in [("root", sb.root.get()), ("chunk_root", sb.chunk_root.get())] {
        if v == 0 || v % u64::from(ss) != 0 {
            return Err(sb_err(format!("{name} block {v} unaligned or zero")));
        }
    }
    if sb.log_root.get() % u64::from(ss) != 0 {
        return Err(sb_err(format!("log_root block {} unaligned", sb.log_root.get())));
    }
    for (name, l) in [("root_level", sb.root_level), ("chunk_root_level", sb.chunk_root_level), ("log_root_level", sb.log_root_level)] {
        if l >= MAX_LEVEL {
            return Err(sb_err(format!("{name} too big: {l} >= {MAX_LEVEL}")));
        }
    }
    let arr = sb.sys_chunk_array_size.get() as usize;
    if arr > SYSTEM_CHUNK_ARRAY_SIZE {
        return Err(sb_err(format!("system chunk array too big {arr} > {SYSTEM_CHUNK_ARRAY_SIZE}")));
    }
    if arr < core::mem::size_of::<DiskKey>() + chunk_item_min() {
        return Err(sb_err(format!("system chunk array too small {arr}")));
    }
    if sb.num_devices.get() == 0 {
        return Err(sb_err("number of devices is 0".to_string()));
    }
    if sb.num_devices.get() > 1 << 31 {
        return Err(sb_err(format!("number of devices {} is absurd", sb.num_devices.get())));
    }
    if sb.root_dir_objectid.get() != 6 {
        return Err(sb_err(format!("root_dir_objectid {} != 6", sb.root_dir_objectid.get())));
    }
    if sb.generation.get() < sb.chunk_root_generation.get() {
        // The kernel only warns here; btrfs-progs likewise. Keep it as information.
    }
    // The chunk array must parse.
    sys_chunk_array(&sb)?;
    Ok(sb)
}

fn chunk_item_min() -> usize {
    crate::items::chunk_item_size(1)
}

/// The SYSTEM chunks listed in the superblock.
///
/// # Errors
/// `Corrupt` (where = SysChunkArray) if an entry is not a chunk key or is truncated.
pub fn sys_chunk_array(sb: &Superblock) -> Result<Vec<(Key, ChunkView)>> {
    let n = sb.sys_chunk_array_size.get() as usize;
    let arr = &sb.sys_chunk_array[..n.min(SYSTEM_CHUNK_ARRAY_SIZE)];
    let mut out = Vec::new();
    let mut pos = 0usize;
    while pos < arr.len() {
        let at = pos;
        let bad = |r: String| Corrupt::new(CorruptWhere::SysChunkArray, format!("{r} at offset {at}"));
        let (dk, _) = DiskKey::ref_from_prefix(&arr[pos..]).map_err(|_| bad("truncated key".into()))?;
        let key = Key::from(dk);
        if key.objectid != FIRST_CHUNK_TREE_OBJECTID || key.type_ != CHUNK_ITEM_KEY {
            return Err(bad(format!("unexpected key {key}")));
        }
        pos += core::mem::size_of::<DiskKey>();
        let (c, used) = chunk(&arr[pos..]).map_err(&bad)?;
        crate::tree_checker::check_chunk(&c, key.offset, sb.sectorsize.get()).map_err(&bad)?;
        if c.type_ & BLOCK_GROUP_SYSTEM == 0 {
            return Err(bad(format!("chunk {} in the system array is not SYSTEM (type {:#x})", key.offset, c.type_)));
        }
        pos += used;
        out.push((key, c));
    }
    Ok(out)
}
