//! Superblock validation and the sys_chunk_array bootstrap list.
//!
//! `check_super` accepts a 4096-byte buffer only if its magic, checksum and geometry are
//! sane (the rules of the kernel's `btrfs_validate_super`), so later code can trust
//! sectorsize, nodesize, levels and the chunk array.

use crate::csum::CsumType;
use crate::error::{Corrupt, CorruptWhere, Result};
use crate::items::{chunk, ChunkView};
use crate::key::{DiskKey, Key, CHUNK_ITEM_KEY};
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
    let csum_type = CsumType::from_raw(sb.csum_type.get())
        .ok_or_else(|| sb_err(format!("unsupported checksum algorithm {}", sb.csum_type.get())))?;
    if !csum_type.verify(&buf[CSUM_SIZE..SUPER_INFO_SIZE], &sb.csum) {
        return Err(sb_err(format!("superblock checksum mismatch ({})", csum_type.name())));
    }
    if sb.bytenr.get() != expect_bytenr {
        return Err(sb_err(format!(
            "superblock bytenr {} does not match its location {expect_bytenr}",
            sb.bytenr.get()
        )));
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
    // As btrfs_validate_super: alignment only (a root at 0 fails when it is read).
    for (name, v) in [
        ("tree_root", sb.root.get()),
        ("chunk_root", sb.chunk_root.get()),
        ("log_root", sb.log_root.get()),
    ] {
        if v % u64::from(ss) != 0 {
            return Err(sb_err(format!("{name} block unaligned: {v}")));
        }
    }
    for (name, l) in [
        ("root_level", sb.root_level),
        ("chunk_root_level", sb.chunk_root_level),
        ("log_root_level", sb.log_root_level),
    ] {
        if l >= MAX_LEVEL {
            return Err(sb_err(format!("{name} too big: {l} >= {MAX_LEVEL}")));
        }
    }
    let arr = sb.sys_chunk_array_size.get() as usize;
    if arr > SYSTEM_CHUNK_ARRAY_SIZE {
        return Err(sb_err(format!(
            "system chunk array too big {arr} > {SYSTEM_CHUNK_ARRAY_SIZE}"
        )));
    }
    if arr < core::mem::size_of::<DiskKey>() + chunk_item_min() {
        return Err(sb_err(format!("system chunk array too small {arr}")));
    }
    if sb.num_devices.get() == 0 {
        return Err(sb_err("number of devices is 0".to_string()));
    }
    // Not refused, as by btrfs_validate_super: a suspicious number of devices (the
    // kernel warns; opening warns when the count differs from the devices given), the
    // root_dir objectid (the kernel never reads it), a generation older than the chunk
    // root's (the kernel warns).
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
        let bad =
            |r: String| Corrupt::new(CorruptWhere::SysChunkArray, format!("{r} at offset {at}"));
        let (dk, _) =
            DiskKey::ref_from_prefix(&arr[pos..]).map_err(|_| bad("truncated key".into()))?;
        let key = Key::from(dk);
        // validate_sys_chunk_array checks the key type only.
        if key.type_ != CHUNK_ITEM_KEY {
            return Err(bad(format!("unexpected item type {} in sys_array", key.type_)));
        }
        pos += core::mem::size_of::<DiskKey>();
        let (c, used) = chunk(&arr[pos..]).map_err(&bad)?;
        crate::items::check_chunk(&c, key.offset, sb.sectorsize.get()).map_err(&bad)?;
        if c.type_ & BLOCK_GROUP_SYSTEM == 0 {
            return Err(bad(format!(
                "chunk {} in the system array is not SYSTEM (type {:#x})",
                key.offset, c.type_
            )));
        }
        pos += used;
        out.push((key, c));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::structs::{ChunkHeader, Stripe, BLOCK_GROUP_SYSTEM, STRIPE_LEN};
    use zerocopy::{FromZeros, IntoBytes};

    const AT: u64 = 65536;

    /// A minimal valid superblock at `AT`, edited by `edit` before its checksum.
    fn sb(edit: impl FnOnce(&mut Superblock)) -> Vec<u8> {
        let mut sb = Superblock::new_zeroed();
        sb.magic = MAGIC.into();
        sb.bytenr = AT.into();
        sb.sectorsize = 4096.into();
        sb.nodesize = 16384.into();
        sb.leafsize = 16384.into();
        sb.root = (1u64 << 22).into();
        sb.chunk_root = (1u64 << 21).into();
        sb.num_devices = 1.into();
        sb.root_dir_objectid = 6.into();
        let key = Key::new(256, CHUNK_ITEM_KEY, 1 << 20).to_disk();
        let ch = ChunkHeader {
            length: (4u64 << 20).into(),
            owner: 2.into(),
            stripe_len: STRIPE_LEN.into(),
            type_: BLOCK_GROUP_SYSTEM.into(),
            io_align: 65536.into(),
            io_width: 65536.into(),
            sector_size: 4096.into(),
            num_stripes: 1.into(),
            sub_stripes: 1.into(),
        };
        let st = Stripe { devid: 1.into(), offset: (1u64 << 20).into(), dev_uuid: [3; 16] };
        let arr = [key.as_bytes(), ch.as_bytes(), st.as_bytes()].concat();
        sb.sys_chunk_array[..arr.len()].copy_from_slice(&arr);
        sb.sys_chunk_array_size = (arr.len() as u32).into();
        edit(&mut sb);
        let mut buf = sb.as_bytes().to_vec();
        let c = CsumType::Crc32c.compute(&buf[CSUM_SIZE..SUPER_INFO_SIZE]);
        buf[..CSUM_SIZE].copy_from_slice(&c);
        buf
    }

    #[test]
    fn as_strict_as_btrfs_validate_super() {
        check_super(&sb(|_| {}), AT).expect("valid superblock");
        // What the kernel only warns about or never reads.
        check_super(&sb(|s| s.num_devices = (1u64 << 40).into()), AT)
            .expect("a suspicious number of devices");
        check_super(&sb(|s| s.root_dir_objectid = 0.into()), AT).expect("root_dir objectid");
        check_super(&sb(|s| s.chunk_root_generation = 9.into()), AT)
            .expect("generation older than the chunk root's");
        check_super(&sb(|s| s.root = 0.into()), AT).expect("tree root at 0 (fails when read)");
        check_super(&sb(|s| s.sys_chunk_array[0] = 7), AT).expect("sys array key objectid");
        // The kernel's rules.
        let refused = |buf: Vec<u8>, needle: &str| {
            let Err(e) = check_super(&buf, AT) else { panic!("accepted: {needle}") };
            let e = e.to_string();
            assert!(e.contains(needle), "{e} does not say {needle:?}");
        };
        refused(sb(|s| s.root = 4097.into()), "tree_root block unaligned");
        refused(sb(|s| s.log_root = 4097.into()), "log_root block unaligned");
        refused(sb(|s| s.num_devices = 0.into()), "number of devices is 0");
        refused(sb(|s| s.sys_chunk_array[8] = 0), "unexpected item type 0");
        refused(sb(|s| s.root_level = MAX_LEVEL), "root_level too big");
        refused(sb(|s| s.leafsize = 4096.into()), "leafsize");
    }
}
