//! Keys, object ids and item types: the vocabulary every btrfs tree is sorted by.
//!
//! A key is `(objectid, type, offset)` compared lexicographically; on disk it is the
//! 17-byte packed `btrfs_disk_key`. The constants keep the kernel's names (minus the
//! `BTRFS_` prefix) so `dump-tree` output maps onto the code.

use core::fmt;
use zerocopy::little_endian::U64;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// The on-disk key (`btrfs_disk_key`), 17 bytes, packed little-endian.
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Default)]
#[repr(C)]
pub struct DiskKey {
    pub objectid: U64,
    pub type_: u8,
    pub offset: U64,
}
const _: () = assert!(core::mem::size_of::<DiskKey>() == 17);

/// A key in CPU form, ordered as btrfs orders items.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Key {
    pub objectid: u64,
    pub type_: u8,
    pub offset: u64,
}

impl Key {
    pub const MIN: Key = Key { objectid: 0, type_: 0, offset: 0 };
    pub const MAX: Key = Key { objectid: u64::MAX, type_: u8::MAX, offset: u64::MAX };

    pub const fn new(objectid: u64, type_: u8, offset: u64) -> Key {
        Key { objectid, type_, offset }
    }

    pub fn to_disk(&self) -> DiskKey {
        DiskKey { objectid: self.objectid.into(), type_: self.type_, offset: self.offset.into() }
    }
}

impl From<&DiskKey> for Key {
    fn from(d: &DiskKey) -> Key {
        Key { objectid: d.objectid.get(), type_: d.type_, offset: d.offset.get() }
    }
}

impl From<DiskKey> for Key {
    fn from(d: DiskKey) -> Key {
        Key::from(&d)
    }
}

impl fmt::Display for Key {
    /// Print like `btrfs inspect-internal dump-tree`: `(256 INODE_ITEM 0)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "({} {} {})",
            objectid_name(self.objectid, self.type_),
            item_type_name(self.type_),
            offset_str(self.type_, self.offset)
        )
    }
}

fn offset_str(type_: u8, offset: u64) -> String {
    match type_ {
        // Like btrfs-progs, print -1 for the "any offset" sentinel and uuid offsets in hex.
        UUID_KEY_SUBVOL | UUID_KEY_RECEIVED_SUBVOL => format!("{offset:#x}"),
        _ if offset == u64::MAX => "-1".to_string(),
        _ => offset.to_string(),
    }
}

// Tree object ids (root objectids).
pub const ROOT_TREE_OBJECTID: u64 = 1;
pub const EXTENT_TREE_OBJECTID: u64 = 2;
pub const CHUNK_TREE_OBJECTID: u64 = 3;
pub const DEV_TREE_OBJECTID: u64 = 4;
pub const FS_TREE_OBJECTID: u64 = 5;
pub const ROOT_TREE_DIR_OBJECTID: u64 = 6;
pub const CSUM_TREE_OBJECTID: u64 = 7;
pub const QUOTA_TREE_OBJECTID: u64 = 8;
pub const UUID_TREE_OBJECTID: u64 = 9;
pub const FREE_SPACE_TREE_OBJECTID: u64 = 10;
pub const BLOCK_GROUP_TREE_OBJECTID: u64 = 11;
pub const RAID_STRIPE_TREE_OBJECTID: u64 = 12;
pub const DEV_STATS_OBJECTID: u64 = 0;
pub const BALANCE_OBJECTID: u64 = (-4i64) as u64;
pub const ORPHAN_OBJECTID: u64 = (-5i64) as u64;
pub const TREE_LOG_OBJECTID: u64 = (-6i64) as u64;
pub const TREE_LOG_FIXUP_OBJECTID: u64 = (-7i64) as u64;
pub const TREE_RELOC_OBJECTID: u64 = (-8i64) as u64;
pub const DATA_RELOC_TREE_OBJECTID: u64 = (-9i64) as u64;
pub const EXTENT_CSUM_OBJECTID: u64 = (-10i64) as u64;
pub const FREE_SPACE_OBJECTID: u64 = (-11i64) as u64;
pub const FREE_INO_OBJECTID: u64 = (-12i64) as u64;
pub const MULTIPLE_OBJECTIDS: u64 = (-255i64) as u64;
pub const FIRST_FREE_OBJECTID: u64 = 256;
pub const LAST_FREE_OBJECTID: u64 = (-256i64) as u64;

/// Is `id` a subvolume-like tree (fs tree, subvolumes, snapshots, data-reloc, reloc)?
pub fn is_fstree(id: u64) -> bool {
    id == FS_TREE_OBJECTID
        || (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id)
        || id == DATA_RELOC_TREE_OBJECTID
        || id == TREE_RELOC_OBJECTID
}

/// The kernel's `btrfs_is_fstree`, which the tree checker's rules use: tree 5, or an id
/// from 256 that is a level-0 qgroup id (below 2^48). Unlike [`is_fstree`], neither
/// relocation tree counts.
pub(crate) fn btrfs_is_fstree(id: u64) -> bool {
    id == FS_TREE_OBJECTID || (FIRST_FREE_OBJECTID..1 << 48).contains(&id)
}

/// Tree 5 or a subvolume/snapshot tree: the trees snapshots share and quotas account
/// (not the relocation or data-relocation trees).
pub fn is_subvolume_tree(id: u64) -> bool {
    id == FS_TREE_OBJECTID || (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id)
}
pub const FIRST_CHUNK_TREE_OBJECTID: u64 = 256;
pub const DEV_ITEMS_OBJECTID: u64 = 1;
pub const BTREE_INODE_OBJECTID: u64 = 1;
pub const EMPTY_SUBVOL_DIR_OBJECTID: u64 = 2;
pub const DEV_REPLACE_DEVID: u64 = 0;

// Item types.
pub const INODE_ITEM_KEY: u8 = 1;
pub const INODE_REF_KEY: u8 = 12;
pub const INODE_EXTREF_KEY: u8 = 13;
pub const XATTR_ITEM_KEY: u8 = 24;
pub const VERITY_DESC_ITEM_KEY: u8 = 36;
pub const VERITY_MERKLE_ITEM_KEY: u8 = 37;
pub const ORPHAN_ITEM_KEY: u8 = 48;
pub const DIR_LOG_ITEM_KEY: u8 = 60;
pub const DIR_LOG_INDEX_KEY: u8 = 72;
pub const DIR_ITEM_KEY: u8 = 84;
pub const DIR_INDEX_KEY: u8 = 96;
pub const EXTENT_DATA_KEY: u8 = 108;
pub const CSUM_ITEM_KEY: u8 = 120;
pub const EXTENT_CSUM_KEY: u8 = 128;
pub const ROOT_ITEM_KEY: u8 = 132;
pub const ROOT_BACKREF_KEY: u8 = 144;
pub const ROOT_REF_KEY: u8 = 156;
pub const EXTENT_ITEM_KEY: u8 = 168;
pub const METADATA_ITEM_KEY: u8 = 169;
pub const EXTENT_OWNER_REF_KEY: u8 = 172;
pub const TREE_BLOCK_REF_KEY: u8 = 176;
pub const EXTENT_DATA_REF_KEY: u8 = 178;
pub const EXTENT_REF_V0_KEY: u8 = 180;
pub const SHARED_BLOCK_REF_KEY: u8 = 182;
pub const SHARED_DATA_REF_KEY: u8 = 184;
pub const BLOCK_GROUP_ITEM_KEY: u8 = 192;
pub const FREE_SPACE_INFO_KEY: u8 = 198;
pub const FREE_SPACE_EXTENT_KEY: u8 = 199;
pub const FREE_SPACE_BITMAP_KEY: u8 = 200;
pub const DEV_EXTENT_KEY: u8 = 204;
pub const DEV_ITEM_KEY: u8 = 216;
pub const CHUNK_ITEM_KEY: u8 = 228;
pub const RAID_STRIPE_KEY: u8 = 230;
pub const QGROUP_STATUS_KEY: u8 = 240;
pub const QGROUP_INFO_KEY: u8 = 242;
pub const QGROUP_LIMIT_KEY: u8 = 244;
pub const QGROUP_RELATION_KEY: u8 = 246;
pub const TEMPORARY_ITEM_KEY: u8 = 248;
pub const BALANCE_ITEM_KEY: u8 = 248;
pub const PERSISTENT_ITEM_KEY: u8 = 249;
pub const DEV_STATS_KEY: u8 = 249;
pub const DEV_REPLACE_KEY: u8 = 250;
pub const UUID_KEY_SUBVOL: u8 = 251;
pub const UUID_KEY_RECEIVED_SUBVOL: u8 = 252;
pub const STRING_ITEM_KEY: u8 = 253;

/// Name an item type as btrfs-progs prints it.
pub fn item_type_name(t: u8) -> String {
    let s = match t {
        0 => "UNKNOWN.0",
        INODE_ITEM_KEY => "INODE_ITEM",
        INODE_REF_KEY => "INODE_REF",
        INODE_EXTREF_KEY => "INODE_EXTREF",
        XATTR_ITEM_KEY => "XATTR_ITEM",
        VERITY_DESC_ITEM_KEY => "VERITY_DESC_ITEM",
        VERITY_MERKLE_ITEM_KEY => "VERITY_MERKLE_ITEM",
        ORPHAN_ITEM_KEY => "ORPHAN_ITEM",
        DIR_LOG_ITEM_KEY => "DIR_LOG_ITEM",
        DIR_LOG_INDEX_KEY => "DIR_LOG_INDEX",
        DIR_ITEM_KEY => "DIR_ITEM",
        DIR_INDEX_KEY => "DIR_INDEX",
        EXTENT_DATA_KEY => "EXTENT_DATA",
        CSUM_ITEM_KEY => "CSUM_ITEM",
        EXTENT_CSUM_KEY => "EXTENT_CSUM",
        ROOT_ITEM_KEY => "ROOT_ITEM",
        ROOT_BACKREF_KEY => "ROOT_BACKREF",
        ROOT_REF_KEY => "ROOT_REF",
        EXTENT_ITEM_KEY => "EXTENT_ITEM",
        METADATA_ITEM_KEY => "METADATA_ITEM",
        EXTENT_OWNER_REF_KEY => "EXTENT_OWNER_REF",
        TREE_BLOCK_REF_KEY => "TREE_BLOCK_REF",
        EXTENT_DATA_REF_KEY => "EXTENT_DATA_REF",
        EXTENT_REF_V0_KEY => "EXTENT_REF_V0",
        SHARED_BLOCK_REF_KEY => "SHARED_BLOCK_REF",
        SHARED_DATA_REF_KEY => "SHARED_DATA_REF",
        BLOCK_GROUP_ITEM_KEY => "BLOCK_GROUP_ITEM",
        FREE_SPACE_INFO_KEY => "FREE_SPACE_INFO",
        FREE_SPACE_EXTENT_KEY => "FREE_SPACE_EXTENT",
        FREE_SPACE_BITMAP_KEY => "FREE_SPACE_BITMAP",
        DEV_EXTENT_KEY => "DEV_EXTENT",
        DEV_ITEM_KEY => "DEV_ITEM",
        CHUNK_ITEM_KEY => "CHUNK_ITEM",
        RAID_STRIPE_KEY => "RAID_STRIPE",
        QGROUP_STATUS_KEY => "QGROUP_STATUS",
        QGROUP_INFO_KEY => "QGROUP_INFO",
        QGROUP_LIMIT_KEY => "QGROUP_LIMIT",
        QGROUP_RELATION_KEY => "QGROUP_RELATION",
        TEMPORARY_ITEM_KEY => "TEMPORARY_ITEM",
        PERSISTENT_ITEM_KEY => "PERSISTENT_ITEM",
        DEV_REPLACE_KEY => "DEV_REPLACE",
        UUID_KEY_SUBVOL => "UUID_KEY_SUBVOL",
        UUID_KEY_RECEIVED_SUBVOL => "UUID_KEY_RECEIVED_SUBVOL",
        STRING_ITEM_KEY => "STRING_ITEM",
        _ => return format!("UNKNOWN.{t}"),
    };
    s.to_string()
}

/// Name an objectid as btrfs-progs prints it (context: the item type).
pub fn objectid_name(objectid: u64, type_: u8) -> String {
    if type_ == UUID_KEY_SUBVOL || type_ == UUID_KEY_RECEIVED_SUBVOL {
        return format!("{objectid:#x}");
    }
    if type_ == PERSISTENT_ITEM_KEY && objectid == DEV_STATS_OBJECTID {
        return "DEV_STATS".to_string();
    }
    if type_ == DEV_EXTENT_KEY
        || type_ == QGROUP_RELATION_KEY
        || type_ == QGROUP_INFO_KEY
        || type_ == QGROUP_LIMIT_KEY
        || type_ == UUID_KEY_SUBVOL
        || type_ == UUID_KEY_RECEIVED_SUBVOL
    {
        return objectid.to_string();
    }
    if type_ == DEV_ITEM_KEY && objectid == DEV_ITEMS_OBJECTID {
        return "DEV_ITEMS".to_string();
    }
    if type_ == CHUNK_ITEM_KEY && objectid == FIRST_CHUNK_TREE_OBJECTID {
        return "FIRST_CHUNK_TREE".to_string();
    }
    let s = match objectid {
        ROOT_TREE_OBJECTID => "ROOT_TREE",
        EXTENT_TREE_OBJECTID => "EXTENT_TREE",
        CHUNK_TREE_OBJECTID => "CHUNK_TREE",
        DEV_TREE_OBJECTID => "DEV_TREE",
        FS_TREE_OBJECTID => "FS_TREE",
        ROOT_TREE_DIR_OBJECTID => "ROOT_TREE_DIR",
        CSUM_TREE_OBJECTID => "CSUM_TREE",
        QUOTA_TREE_OBJECTID => "QUOTA_TREE",
        UUID_TREE_OBJECTID => "UUID_TREE",
        FREE_SPACE_TREE_OBJECTID => "FREE_SPACE_TREE",
        BLOCK_GROUP_TREE_OBJECTID => "BLOCK_GROUP_TREE",
        RAID_STRIPE_TREE_OBJECTID => "RAID_STRIPE_TREE",
        BALANCE_OBJECTID => "BALANCE",
        ORPHAN_OBJECTID => "ORPHAN",
        TREE_LOG_OBJECTID => "TREE_LOG",
        TREE_LOG_FIXUP_OBJECTID => "TREE_LOG_FIXUP",
        TREE_RELOC_OBJECTID => "TREE_RELOC",
        DATA_RELOC_TREE_OBJECTID => "DATA_RELOC_TREE",
        EXTENT_CSUM_OBJECTID => "EXTENT_CSUM",
        FREE_SPACE_OBJECTID => "FREE_SPACE",
        FREE_INO_OBJECTID => "FREE_INO",
        MULTIPLE_OBJECTIDS => "MULTIPLE",
        _ => return objectid.to_string(),
    };
    // DEV_STATS (objectid 0) is only named for its persistent item.
    if objectid == 0 {
        return "0".to_string();
    }
    s.to_string()
}

/// Resolve a tree name (as accepted by `--tree`) to its objectid.
pub fn tree_id_from_name(name: &str) -> Option<u64> {
    let n = name.to_ascii_lowercase().replace('-', "_");
    let id = match n.trim_end_matches("_tree") {
        "root" => ROOT_TREE_OBJECTID,
        "extent" => EXTENT_TREE_OBJECTID,
        "chunk" => CHUNK_TREE_OBJECTID,
        "dev" | "device" => DEV_TREE_OBJECTID,
        "fs" => FS_TREE_OBJECTID,
        "csum" | "checksum" => CSUM_TREE_OBJECTID,
        "quota" => QUOTA_TREE_OBJECTID,
        "uuid" => UUID_TREE_OBJECTID,
        "free_space" | "fst" => FREE_SPACE_TREE_OBJECTID,
        "block_group" | "bg" => BLOCK_GROUP_TREE_OBJECTID,
        "raid_stripe" => RAID_STRIPE_TREE_OBJECTID,
        "data_reloc" => DATA_RELOC_TREE_OBJECTID,
        "log" | "tree_log" => TREE_LOG_OBJECTID,
        _ => return name.parse().ok(),
    };
    Some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_order_is_lexicographic() {
        let a = Key::new(256, INODE_ITEM_KEY, 0);
        let b = Key::new(256, INODE_REF_KEY, 0);
        let c = Key::new(257, 0, 0);
        assert!(a < b && b < c);
        assert_eq!(Key::from(a.to_disk()), a);
        assert_eq!(a.to_string(), "(256 INODE_ITEM 0)");
        assert_eq!(Key::new(5, ROOT_ITEM_KEY, u64::MAX).to_string(), "(FS_TREE ROOT_ITEM -1)");
    }

    #[test]
    fn tree_names() {
        assert_eq!(tree_id_from_name("fs"), Some(5));
        assert_eq!(tree_id_from_name("FREE_SPACE_TREE"), Some(10));
        assert_eq!(tree_id_from_name("257"), Some(257));
        assert_eq!(tree_id_from_name("nope"), None);
    }
}
