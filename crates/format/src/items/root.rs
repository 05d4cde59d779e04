//! The root tree's ROOT_ITEM, ROOT_REF and ROOT_BACKREF, and the items that index
//! subvolumes elsewhere: the UUID tree's and the quota tree's.

use super::{aligned, read_prefix, CheckResult, ItemCtx, ParseResult};
use crate::key::*;
use crate::structs::*;
use zerocopy::FromBytes;

/// A ROOT_REF / ROOT_BACKREF body.
#[derive(Clone, Copy, Debug)]
pub struct RootRefEntry<'a> {
    pub dirid: u64,
    pub sequence: u64,
    pub name: &'a [u8],
}

pub fn root_ref(data: &[u8]) -> ParseResult<RootRefEntry<'_>> {
    let rr: &RootRef = read_prefix(data, "root ref")?;
    let hdr = core::mem::size_of::<RootRef>();
    let n = rr.name_len.get() as usize;
    if hdr + n != data.len() {
        return Err(format!("invalid root ref name len {n}, item size {}", data.len()));
    }
    Ok(RootRefEntry { dirid: rr.dirid.get(), sequence: rr.sequence.get(), name: &data[hdr..] })
}

/// A parsed ROOT_ITEM, accepting the old 239-byte form (v2 fields then read as zero).
#[derive(Clone, Copy)]
pub struct RootItemView {
    pub item: RootItem,
    /// True when generation_v2 matches generation, i.e. the v2 fields are valid.
    pub v2_valid: bool,
}

pub fn root_item(data: &[u8]) -> ParseResult<RootItemView> {
    let full = core::mem::size_of::<RootItem>();
    if data.len() != full && data.len() != ROOT_ITEM_V1_SIZE {
        return Err(format!(
            "invalid root item size, have {} expect {} or {}",
            data.len(),
            ROOT_ITEM_V1_SIZE,
            full
        ));
    }
    let mut buf = [0u8; core::mem::size_of::<RootItem>()];
    buf[..data.len()].copy_from_slice(data);
    let item = RootItem::read_from_bytes(&buf).expect("buffer has the exact size");
    let v2_valid = item.generation_v2.get() == item.generation.get();
    Ok(RootItemView { item, v2_valid })
}

/// As check_root_item with check_root_key.
pub(crate) fn check_root_item(key: &Key, data: &[u8], ctx: &ItemCtx) -> CheckResult {
    if key.objectid == TREE_RELOC_OBJECTID && !btrfs_is_fstree(key.offset) {
        return Err(format!(
            "invalid reloc tree for root {}, root id is not a subvolume tree",
            key.offset as i64
        ));
    }
    if key.objectid == 0 {
        return Err("invalid root id 0".into());
    }
    let v = root_item(data)?;
    ctx.gen_ok(v.item.generation.get(), "root")?;
    ctx.gen_ok(v.item.generation_v2.get(), "root v2")?;
    ctx.gen_ok(v.item.last_snapshot.get(), "root last_snapshot")?;
    if !aligned(v.item.bytenr.get(), ctx.sectorsize) {
        return Err(format!(
            "invalid root bytenr, have {} expect to be aligned to {}",
            v.item.bytenr.get(),
            ctx.sectorsize
        ));
    }
    if v.item.level >= MAX_LEVEL {
        return Err(format!(
            "invalid root level, have {} expect [0, {}]",
            v.item.level,
            MAX_LEVEL - 1
        ));
    }
    if v.item.drop_level >= MAX_LEVEL {
        return Err(format!(
            "invalid root drop_level, have {} expect [0, {}]",
            v.item.drop_level,
            MAX_LEVEL - 1
        ));
    }
    let valid = ROOT_SUBVOL_RDONLY | ROOT_SUBVOL_DEAD;
    if v.item.flags.get() & !valid != 0 {
        return Err(format!(
            "invalid root flags, have {:#x} expect mask {valid:#x}",
            v.item.flags.get()
        ));
    }
    Ok(())
}

/// The kernel has no rule for ROOT_REF and ROOT_BACKREF; kept: the item holds its
/// header and name (what `root_ref` hands its readers).
pub(crate) fn check_root_ref(data: &[u8]) -> CheckResult {
    root_ref(data)?;
    Ok(())
}

/// Iterate the UUID tree item's u64 subvolume ids.
pub fn uuid_item_ids(data: &[u8]) -> ParseResult<Vec<u64>> {
    if !data.len().is_multiple_of(8) {
        return Err(format!("invalid uuid item size {}, not a multiple of 8", data.len()));
    }
    Ok(data.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
}

/// The kernel has no rule for UUID items; kept: their size (what their reader takes).
pub(crate) fn check_uuid_item(data: &[u8]) -> CheckResult {
    uuid_item_ids(data)?;
    Ok(())
}

/// The `flags` of a QGROUP_STATUS item (32 bytes, or 40 with simple quotas).
pub fn qgroup_status_flags(data: &[u8]) -> ParseResult<u64> {
    if data.len() < QGROUP_STATUS_SIZE_V1 {
        return Err(format!(
            "qgroup status item of {} bytes, expect at least {QGROUP_STATUS_SIZE_V1}",
            data.len()
        ));
    }
    Ok(u64::from_le_bytes(data[16..24].try_into().expect("8 bytes")))
}

/// The kernel has no rule for qgroup items; kept: their sizes (what their readers take).
/// Kernels before simple quotas wrote a 32-byte status item (no enable_gen).
pub(crate) fn check_qgroup_item(key: &Key, data: &[u8]) -> CheckResult {
    match key.type_ {
        QGROUP_STATUS_KEY if data.len() != 40 && data.len() != 32 => {
            Err(format!("invalid qgroup status item size {}", data.len()))
        }
        QGROUP_INFO_KEY | QGROUP_LIMIT_KEY if data.len() != 40 => {
            Err(format!("invalid qgroup item size {}", data.len()))
        }
        _ => Ok(()),
    }
}
