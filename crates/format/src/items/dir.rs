//! DIR_ITEM, DIR_INDEX and XATTR_ITEM: the packed entries of a name (or an xattr) and
//! the rules each entry must meet (the kernel's check_dir_item).

use super::{packed_entries, read_prefix, CheckResult, ItemCtx, ParseResult};
use crate::hash::name_hash;
use crate::key::*;
use crate::node::{HEADER_SIZE, ITEM_SIZE};
use crate::structs::*;

/// One entry of a DIR_ITEM, DIR_INDEX or XATTR_ITEM.
#[derive(Clone, Copy, Debug)]
pub struct DirEntry<'a> {
    pub location: Key,
    pub transid: u64,
    pub type_: u8,
    pub name: &'a [u8],
    pub data: &'a [u8],
}

/// Iterate the packed entries of a DIR_ITEM / DIR_INDEX / XATTR_ITEM body.
pub fn dir_entries(data: &[u8]) -> impl Iterator<Item = ParseResult<DirEntry<'_>>> {
    packed_entries(data, |rest| {
        let di: &DirItem = read_prefix(rest, "dir item")?;
        let hdr = core::mem::size_of::<DirItem>();
        let name_len = di.name_len.get() as usize;
        let data_len = di.data_len.get() as usize;
        let total = hdr + name_len + data_len;
        if total > rest.len() {
            return Err(format!("invalid dir item name or data len, name_len={name_len} data_len={data_len} item left={}", rest.len()));
        }
        let e = DirEntry {
            location: Key::from(&di.location),
            transid: di.transid.get(),
            type_: di.type_,
            name: &rest[hdr..hdr + name_len],
            data: &rest[hdr + name_len..total],
        };
        Ok((e, total))
    })
}

/// As check_dir_item. Not checked, as by the kernel: the entry's `transid`
/// (btrfs-convert writes garbage there), empty names, how many entries an item holds (a
/// DIR_INDEX is read through its first; an empty item has none).
pub(crate) fn check_dir_item(key: &Key, data: &[u8], ctx: &ItemCtx) -> CheckResult {
    let is_xattr = key.type_ == XATTR_ITEM_KEY;
    for e in dir_entries(data) {
        let e = e?;
        check_dir_location(is_xattr, &e.location)?;
        let ftype = e.type_ & !FT_ENCRYPTED;
        if ftype == FT_UNKNOWN || ftype >= FT_MAX {
            return Err(format!("invalid dir item type, have {ftype} expect (0, {FT_MAX})"));
        }
        if is_xattr && ftype != FT_XATTR {
            return Err(format!(
                "invalid dir item type for XATTR key, have {ftype} expect {FT_XATTR}"
            ));
        }
        if !is_xattr && ftype == FT_XATTR {
            return Err("xattr dir type found for non-XATTR key".into());
        }
        // XATTR_NAME_MAX and BTRFS_NAME_LEN are both 255.
        if e.name.len() > NAME_LEN {
            return Err(format!(
                "dir item name len too long, have {} max {NAME_LEN}",
                e.name.len()
            ));
        }
        // BTRFS_MAX_XATTR_SIZE: what one item can hold after its dir item header.
        let max = (ctx.nodesize as usize)
            .saturating_sub(HEADER_SIZE + ITEM_SIZE + core::mem::size_of::<DirItem>());
        if e.name.len() + e.data.len() > max {
            return Err(format!(
                "dir item name and data len too long, have {} max {max}",
                e.name.len() + e.data.len()
            ));
        }
        if !is_xattr && !e.data.is_empty() {
            return Err(format!("dir item with invalid data len, have {} expect 0", e.data.len()));
        }
        if key.type_ != DIR_INDEX_KEY && name_hash(e.name) != key.offset {
            return Err(format!(
                "name hash mismatch with key, have {:#018x} expect {:#018x}",
                name_hash(e.name),
                key.offset
            ));
        }
    }
    Ok(())
}

/// A dir item entry's location key (check_dir_item with check_root_key and
/// check_inode_key): a subvolume root, or an inode (type INODE_ITEM or 0) of this tree;
/// an xattr's location is all zeros.
fn check_dir_location(is_xattr: bool, loc: &Key) -> core::result::Result<(), String> {
    match loc.type_ {
        ROOT_ITEM_KEY => {
            if loc.objectid == 0 {
                return Err("invalid location key root id 0".into());
            }
            if !btrfs_is_fstree(loc.objectid) {
                return Err(format!(
                    "invalid location key objectid, have {} expect [{FIRST_FREE_OBJECTID}, {}]",
                    loc.objectid,
                    (1u64 << 48) - 1
                ));
            }
        }
        INODE_ITEM_KEY | 0 if is_xattr => {
            if *loc != Key::new(0, 0, 0) {
                return Err(format!("invalid location key {loc} for an xattr, expect all zeros"));
            }
        }
        INODE_ITEM_KEY | 0 => {
            let ok = (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&loc.objectid)
                || loc.objectid == ROOT_TREE_DIR_OBJECTID
                || loc.objectid == FREE_INO_OBJECTID;
            if !ok {
                return Err(format!("invalid location key objectid: has {}", loc.objectid));
            }
            if loc.offset != 0 {
                return Err(format!("invalid location key offset: has {} expect 0", loc.offset));
            }
        }
        t => {
            return Err(format!(
                "invalid location key type, have {t}, expect {ROOT_ITEM_KEY} or {INODE_ITEM_KEY}"
            ))
        }
    }
    Ok(())
}
