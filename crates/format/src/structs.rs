//! Every on-disk structure, declared once: packed, little-endian, kernel field names,
//! with a compile-time size assertion. Variable-length items (dir entries, refs, chunk
//! stripes, inline extents) are parsed by the item iterators in `items`.

use crate::key::DiskKey;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

macro_rules! ondisk {
    ($(#[$m:meta])* pub struct $name:ident ($size:expr) { $($(#[$fm:meta])* pub $f:ident : $t:ty),* $(,)? }) => {
        $(#[$m])*
        #[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy)]
        #[repr(C)]
        pub struct $name { $($(#[$fm])* pub $f: $t),* }
        const _: () = assert!(core::mem::size_of::<$name>() == $size);
    };
}

pub const SUPER_INFO_OFFSET: u64 = 64 * 1024;
pub const SUPER_INFO_SIZE: usize = 4096;
pub const SUPER_MIRROR_MAX: usize = 3;
pub const SUPER_MIRROR_SHIFT: u32 = 12;
pub const MAGIC: u64 = 0x4D5F_5366_5248_425F; // "_BHRfS_M"
pub const MAGIC_TEMPORARY: u64 = 0x4D5F_5366_5248_4221; // "!BHRfS_M"
pub const SYSTEM_CHUNK_ARRAY_SIZE: usize = 2048;
pub const NUM_BACKUP_ROOTS: usize = 4;
pub const LABEL_SIZE: usize = 256;
pub const UUID_SIZE: usize = 16;
pub const FSID_SIZE: usize = 16;
pub const CSUM_SIZE: usize = 32;
pub const MAX_LEVEL: u8 = 8;
pub const STRIPE_LEN: u64 = 64 * 1024;
pub const NAME_LEN: usize = 255;
pub const MAX_XATTR_SIZE_LIMIT: usize = 65535;

/// Byte offset of superblock copy `mirror` (0: 64 KiB, 1: 64 MiB, 2: 256 GiB).
pub fn sb_offset(mirror: usize) -> u64 {
    if mirror == 0 {
        SUPER_INFO_OFFSET
    } else {
        (16 * 1024u64) << (SUPER_MIRROR_SHIFT * mirror as u32)
    }
}

ondisk! {
    /// `btrfs_dev_item`: a device, in the chunk tree and copied into the superblock.
    pub struct DevItem (98) {
        pub devid: U64,
        pub total_bytes: U64,
        pub bytes_used: U64,
        pub io_align: U32,
        pub io_width: U32,
        pub sector_size: U32,
        pub type_: U64,
        pub generation: U64,
        pub start_offset: U64,
        pub dev_group: U32,
        pub seek_speed: u8,
        pub bandwidth: u8,
        pub uuid: [u8; UUID_SIZE],
        pub fsid: [u8; UUID_SIZE],
    }
}

ondisk! {
    /// `btrfs_root_backup`: one of the four backup root sets in the superblock.
    pub struct RootBackup (168) {
        pub tree_root: U64,
        pub tree_root_gen: U64,
        pub chunk_root: U64,
        pub chunk_root_gen: U64,
        pub extent_root: U64,
        pub extent_root_gen: U64,
        pub fs_root: U64,
        pub fs_root_gen: U64,
        pub dev_root: U64,
        pub dev_root_gen: U64,
        pub csum_root: U64,
        pub csum_root_gen: U64,
        pub total_bytes: U64,
        pub bytes_used: U64,
        pub num_devices: U64,
        pub unused_64: [U64; 4],
        pub tree_root_level: u8,
        pub chunk_root_level: u8,
        pub extent_root_level: u8,
        pub fs_root_level: u8,
        pub dev_root_level: u8,
        pub csum_root_level: u8,
        pub unused_8: [u8; 10],
    }
}

ondisk! {
    /// `btrfs_super_block`, 4096 bytes.
    pub struct Superblock (4096) {
        pub csum: [u8; CSUM_SIZE],
        pub fsid: [u8; FSID_SIZE],
        pub bytenr: U64,
        pub flags: U64,
        pub magic: U64,
        pub generation: U64,
        pub root: U64,
        pub chunk_root: U64,
        pub log_root: U64,
        pub log_root_transid: U64,
        pub total_bytes: U64,
        pub bytes_used: U64,
        pub root_dir_objectid: U64,
        pub num_devices: U64,
        pub sectorsize: U32,
        pub nodesize: U32,
        pub leafsize: U32,
        pub stripesize: U32,
        pub sys_chunk_array_size: U32,
        pub chunk_root_generation: U64,
        pub compat_flags: U64,
        pub compat_ro_flags: U64,
        pub incompat_flags: U64,
        pub csum_type: U16,
        pub root_level: u8,
        pub chunk_root_level: u8,
        pub log_root_level: u8,
        pub dev_item: DevItem,
        pub label: [u8; LABEL_SIZE],
        pub cache_generation: U64,
        pub uuid_tree_generation: U64,
        pub metadata_uuid: [u8; FSID_SIZE],
        pub nr_global_roots: U64,
        pub reserved: [U64; 27],
        pub sys_chunk_array: [u8; SYSTEM_CHUNK_ARRAY_SIZE],
        pub super_roots: [RootBackup; NUM_BACKUP_ROOTS],
        pub padding: [u8; 565],
    }
}

ondisk! {
    /// `btrfs_header`: the first 101 bytes of every tree block.
    pub struct Header (101) {
        pub csum: [u8; CSUM_SIZE],
        pub fsid: [u8; FSID_SIZE],
        pub bytenr: U64,
        pub flags: U64,
        pub chunk_tree_uuid: [u8; UUID_SIZE],
        pub generation: U64,
        pub owner: U64,
        pub nritems: U32,
        pub level: u8,
    }
}

pub const HEADER_FLAG_WRITTEN: u64 = 1 << 0;
pub const HEADER_FLAG_RELOC: u64 = 1 << 1;
pub const BACKREF_REV_SHIFT: u32 = 56;
pub const MIXED_BACKREF_REV: u64 = 1;
pub const OLD_BACKREF_REV: u64 = 0;

ondisk! {
    /// `btrfs_item`: a leaf's item header; `offset` is relative to the end of the header.
    pub struct Item (25) {
        pub key: DiskKey,
        pub offset: U32,
        pub size: U32,
    }
}

ondisk! {
    /// `btrfs_key_ptr`: a node's child pointer.
    pub struct KeyPtr (33) {
        pub key: DiskKey,
        pub blockptr: U64,
        pub generation: U64,
    }
}

ondisk! {
    /// `btrfs_stripe`: one stripe of a chunk.
    pub struct Stripe (32) {
        pub devid: U64,
        pub offset: U64,
        pub dev_uuid: [u8; UUID_SIZE],
    }
}

ondisk! {
    /// `btrfs_chunk` without its stripes (the first stripe follows; item size 48 + 32 n).
    pub struct ChunkHeader (48) {
        pub length: U64,
        pub owner: U64,
        pub stripe_len: U64,
        pub type_: U64,
        pub io_align: U32,
        pub io_width: U32,
        pub sector_size: U32,
        pub num_stripes: U16,
        pub sub_stripes: U16,
    }
}

ondisk! {
    pub struct Timespec (12) {
        pub sec: U64,
        pub nsec: U32,
    }
}

ondisk! {
    /// `btrfs_inode_item`, 160 bytes.
    pub struct InodeItem (160) {
        pub generation: U64,
        pub transid: U64,
        pub size: U64,
        pub nbytes: U64,
        pub block_group: U64,
        pub nlink: U32,
        pub uid: U32,
        pub gid: U32,
        pub mode: U32,
        pub rdev: U64,
        pub flags: U64,
        pub sequence: U64,
        pub reserved: [U64; 4],
        pub atime: Timespec,
        pub ctime: Timespec,
        pub mtime: Timespec,
        pub otime: Timespec,
    }
}

ondisk! {
    /// `btrfs_inode_ref` header; the name follows.
    pub struct InodeRef (10) {
        pub index: U64,
        pub name_len: U16,
    }
}

ondisk! {
    /// `btrfs_inode_extref` header; the name follows.
    pub struct InodeExtref (18) {
        pub parent_objectid: U64,
        pub index: U64,
        pub name_len: U16,
    }
}

ondisk! {
    /// `btrfs_dir_item` header; name then data (xattr value) follow.
    pub struct DirItem (30) {
        pub location: DiskKey,
        pub transid: U64,
        pub data_len: U16,
        pub name_len: U16,
        pub type_: u8,
    }
}

ondisk! {
    /// `btrfs_root_item`, current 439-byte form. Old filesystems may carry the
    /// 239-byte form that ends before `generation_v2`.
    pub struct RootItem (439) {
        pub inode: InodeItem,
        pub generation: U64,
        pub root_dirid: U64,
        pub bytenr: U64,
        pub byte_limit: U64,
        pub bytes_used: U64,
        pub last_snapshot: U64,
        pub flags: U64,
        pub refs: U32,
        pub drop_progress: DiskKey,
        pub drop_level: u8,
        pub level: u8,
        pub generation_v2: U64,
        pub uuid: [u8; UUID_SIZE],
        pub parent_uuid: [u8; UUID_SIZE],
        pub received_uuid: [u8; UUID_SIZE],
        pub ctransid: U64,
        pub otransid: U64,
        pub stransid: U64,
        pub rtransid: U64,
        pub ctime: Timespec,
        pub otime: Timespec,
        pub stime: Timespec,
        pub rtime: Timespec,
        pub reserved: [U64; 8],
    }
}
pub const ROOT_ITEM_V1_SIZE: usize = 239;
pub const ROOT_SUBVOL_RDONLY: u64 = 1 << 0;
pub const ROOT_SUBVOL_DEAD: u64 = 1 << 48;

ondisk! {
    /// `btrfs_root_ref` header (ROOT_REF and ROOT_BACKREF); the name follows.
    pub struct RootRef (18) {
        pub dirid: U64,
        pub sequence: U64,
        pub name_len: U16,
    }
}

ondisk! {
    /// `btrfs_file_extent_item` up to and including `type` (inline data follows).
    pub struct FileExtentHeader (21) {
        pub generation: U64,
        pub ram_bytes: U64,
        pub compression: u8,
        pub encryption: u8,
        pub other_encoding: U16,
        pub type_: u8,
    }
}

ondisk! {
    /// The rest of a REG/PREALLOC `btrfs_file_extent_item`.
    pub struct FileExtentBody (32) {
        pub disk_bytenr: U64,
        pub disk_num_bytes: U64,
        pub offset: U64,
        pub num_bytes: U64,
    }
}
pub const FILE_EXTENT_INLINE: u8 = 0;
pub const FILE_EXTENT_REG: u8 = 1;
pub const FILE_EXTENT_PREALLOC: u8 = 2;
pub const FILE_EXTENT_INLINE_DATA_START: usize = 21;
pub const FILE_EXTENT_REG_SIZE: usize = 53;

ondisk! {
    /// `btrfs_extent_item` header (EXTENT_ITEM, METADATA_ITEM); inline refs follow.
    pub struct ExtentItem (24) {
        pub refs: U64,
        pub generation: U64,
        pub flags: U64,
    }
}
pub const EXTENT_FLAG_DATA: u64 = 1 << 0;
pub const EXTENT_FLAG_TREE_BLOCK: u64 = 1 << 1;
pub const BLOCK_FLAG_FULL_BACKREF: u64 = 1 << 8;

ondisk! {
    /// `btrfs_tree_block_info`, after a non-skinny tree block EXTENT_ITEM.
    pub struct TreeBlockInfo (18) {
        pub key: DiskKey,
        pub level: u8,
    }
}

ondisk! {
    /// `btrfs_extent_data_ref` (inline after the type byte, or a keyed item's body).
    pub struct ExtentDataRef (28) {
        pub root: U64,
        pub objectid: U64,
        pub offset: U64,
        pub count: U32,
    }
}

ondisk! {
    /// `btrfs_shared_data_ref` body.
    pub struct SharedDataRef (4) {
        pub count: U32,
    }
}

ondisk! {
    /// `btrfs_extent_ref_v0` (pre-2.6.31 filesystems).
    pub struct ExtentRefV0 (28) {
        pub root: U64,
        pub generation: U64,
        pub objectid: U64,
        pub count: U32,
    }
}

ondisk! {
    /// `btrfs_block_group_item`.
    pub struct BlockGroupItem (24) {
        pub used: U64,
        pub chunk_objectid: U64,
        pub flags: U64,
    }
}

ondisk! {
    /// `btrfs_dev_extent`.
    pub struct DevExtent (48) {
        pub chunk_tree: U64,
        pub chunk_objectid: U64,
        pub chunk_offset: U64,
        pub length: U64,
        pub chunk_tree_uuid: [u8; UUID_SIZE],
    }
}

ondisk! {
    /// `btrfs_free_space_info`.
    pub struct FreeSpaceInfo (8) {
        pub extent_count: U32,
        pub flags: U32,
    }
}
pub const FREE_SPACE_USING_BITMAPS: u32 = 1 << 0;
pub const FREE_SPACE_BITMAP_BITS: u64 = 2048;

ondisk! {
    /// `btrfs_free_space_header` (v1 space cache, root tree).
    pub struct FreeSpaceHeader (41) {
        pub location: DiskKey,
        pub generation: U64,
        pub num_entries: U64,
        pub num_bitmaps: U64,
    }
}

pub const QGROUP_STATUS_FLAG_ON: u64 = 1 << 0;
pub const QGROUP_STATUS_FLAG_RESCAN: u64 = 1 << 1;
pub const QGROUP_STATUS_FLAG_INCONSISTENT: u64 = 1 << 2;
pub const QGROUP_STATUS_FLAG_SIMPLE_MODE: u64 = 1 << 3;
pub const QGROUP_STATUS_FLAG_NAMES: &[(u64, &str)] = &[
    (QGROUP_STATUS_FLAG_ON, "ON"),
    (QGROUP_STATUS_FLAG_RESCAN, "RESCAN"),
    (QGROUP_STATUS_FLAG_INCONSISTENT, "INCONSISTENT"),
    (QGROUP_STATUS_FLAG_SIMPLE_MODE, "SIMPLE_MODE"),
];
/// Bytes of a QGROUP_STATUS item without simple quotas' `enable_gen`.
pub const QGROUP_STATUS_SIZE_V1: usize = 32;

ondisk! {
    /// `btrfs_qgroup_status_item`.
    pub struct QgroupStatusItem (40) {
        pub version: U64,
        pub generation: U64,
        pub flags: U64,
        pub rescan: U64,
        pub enable_gen: U64,
    }
}

ondisk! {
    /// `btrfs_qgroup_info_item`.
    pub struct QgroupInfoItem (40) {
        pub generation: U64,
        pub rfer: U64,
        pub rfer_cmpr: U64,
        pub excl: U64,
        pub excl_cmpr: U64,
    }
}

ondisk! {
    /// `btrfs_qgroup_limit_item`.
    pub struct QgroupLimitItem (40) {
        pub flags: U64,
        pub max_rfer: U64,
        pub max_excl: U64,
        pub rsv_rfer: U64,
        pub rsv_excl: U64,
    }
}

ondisk! {
    /// `btrfs_dev_replace_item`, the one item (0 DEV_REPLACE 0) of the dev tree: the
    /// state of a device replace. The cursors are physical offsets on the source
    /// device: below `cursor_left` the target (devid 0) holds a copy of the source.
    pub struct DevReplaceItem (72) {
        pub src_devid: U64,
        pub cursor_left: U64,
        pub cursor_right: U64,
        /// `DEV_REPLACE_ITEM_CONT_READING_FROM_SRCDEV_MODE_*`.
        pub cont_reading_from_srcdev_mode: U64,
        /// `DEV_REPLACE_STATE_*`.
        pub replace_state: U64,
        /// Seconds since the epoch.
        pub time_started: U64,
        pub time_stopped: U64,
        pub num_write_errors: U64,
        pub num_uncorrectable_read_errors: U64,
    }
}

/// Read from the source device of a replace whenever it has the data.
pub const DEV_REPLACE_ITEM_CONT_READING_FROM_SRCDEV_MODE_ALWAYS: u64 = 0;
/// Read from the source device only when no other copy has the data.
pub const DEV_REPLACE_ITEM_CONT_READING_FROM_SRCDEV_MODE_AVOID: u64 = 1;

/// `DevReplaceItem::replace_state` (the kernel's `BTRFS_IOCTL_DEV_REPLACE_STATE_*`).
pub const DEV_REPLACE_STATE_NEVER_STARTED: u64 = 0;
pub const DEV_REPLACE_STATE_STARTED: u64 = 1;
pub const DEV_REPLACE_STATE_FINISHED: u64 = 2;
pub const DEV_REPLACE_STATE_CANCELED: u64 = 3;
pub const DEV_REPLACE_STATE_SUSPENDED: u64 = 4;

/// The name btrfs-progs prints for a replace state.
pub fn dev_replace_state_name(state: u64) -> Option<&'static str> {
    Some(match state {
        DEV_REPLACE_STATE_NEVER_STARTED => "NEVER_STARTED",
        DEV_REPLACE_STATE_STARTED => "STARTED",
        DEV_REPLACE_STATE_FINISHED => "FINISHED",
        DEV_REPLACE_STATE_CANCELED => "CANCELED",
        DEV_REPLACE_STATE_SUSPENDED => "SUSPENDED",
        _ => return None,
    })
}

ondisk! {
    /// `btrfs_disk_balance_args`.
    pub struct BalanceArgs (136) {
        pub profiles: U64,
        pub usage: U64,
        pub devid: U64,
        pub pstart: U64,
        pub pend: U64,
        pub vstart: U64,
        pub vend: U64,
        pub target: U64,
        pub flags: U64,
        pub limit: U64,
        pub stripes_min: U32,
        pub stripes_max: U32,
        pub unused: [U64; 6],
    }
}

ondisk! {
    /// `btrfs_balance_item`.
    pub struct BalanceItem (448) {
        pub flags: U64,
        pub data: BalanceArgs,
        pub meta: BalanceArgs,
        pub sys: BalanceArgs,
        pub unused: [U64; 4],
    }
}

ondisk! {
    /// `btrfs_verity_descriptor_item`.
    pub struct VerityDescriptorItem (25) {
        pub size: U64,
        pub reserved: [U64; 2],
        pub encryption: u8,
    }
}

ondisk! {
    /// `btrfs_stripe_extent` entry of the raid-stripe tree.
    pub struct RaidStride (16) {
        pub devid: U64,
        pub physical: U64,
    }
}

/// Number of dev_stats counters stored in the persistent DEV_STATS item.
pub const DEV_STAT_VALUES_MAX: usize = 5;

// Block group / chunk type flags.
pub const BLOCK_GROUP_DATA: u64 = 1 << 0;
pub const BLOCK_GROUP_SYSTEM: u64 = 1 << 1;
pub const BLOCK_GROUP_METADATA: u64 = 1 << 2;
pub const BLOCK_GROUP_RAID0: u64 = 1 << 3;
pub const BLOCK_GROUP_RAID1: u64 = 1 << 4;
pub const BLOCK_GROUP_DUP: u64 = 1 << 5;
pub const BLOCK_GROUP_RAID10: u64 = 1 << 6;
pub const BLOCK_GROUP_RAID5: u64 = 1 << 7;
pub const BLOCK_GROUP_RAID6: u64 = 1 << 8;
pub const BLOCK_GROUP_RAID1C3: u64 = 1 << 9;
pub const BLOCK_GROUP_RAID1C4: u64 = 1 << 10;
pub const BLOCK_GROUP_TYPE_MASK: u64 = BLOCK_GROUP_DATA | BLOCK_GROUP_SYSTEM | BLOCK_GROUP_METADATA;
pub const BLOCK_GROUP_PROFILE_MASK: u64 = BLOCK_GROUP_RAID0
    | BLOCK_GROUP_RAID1
    | BLOCK_GROUP_DUP
    | BLOCK_GROUP_RAID10
    | BLOCK_GROUP_RAID5
    | BLOCK_GROUP_RAID6
    | BLOCK_GROUP_RAID1C3
    | BLOCK_GROUP_RAID1C4;

/// Name a block group's type and profile like `btrfs filesystem df` (`Data, RAID1`).
pub fn block_group_flags_str(flags: u64) -> String {
    let t = match flags & BLOCK_GROUP_TYPE_MASK {
        BLOCK_GROUP_DATA => "Data",
        BLOCK_GROUP_SYSTEM => "System",
        BLOCK_GROUP_METADATA => "Metadata",
        x if x == BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA => "Data+Metadata",
        _ => "Unknown",
    };
    format!("{t}, {}", profile_name(flags))
}

/// Name a profile (`single`, `DUP`, `RAID1`, ...).
pub fn profile_name(flags: u64) -> &'static str {
    match flags & BLOCK_GROUP_PROFILE_MASK {
        0 => "single",
        BLOCK_GROUP_RAID0 => "RAID0",
        BLOCK_GROUP_RAID1 => "RAID1",
        BLOCK_GROUP_DUP => "DUP",
        BLOCK_GROUP_RAID10 => "RAID10",
        BLOCK_GROUP_RAID5 => "RAID5",
        BLOCK_GROUP_RAID6 => "RAID6",
        BLOCK_GROUP_RAID1C3 => "RAID1C3",
        BLOCK_GROUP_RAID1C4 => "RAID1C4",
        _ => "mixed-profile",
    }
}

// Directory entry file types.
pub const FT_UNKNOWN: u8 = 0;
pub const FT_REG_FILE: u8 = 1;
pub const FT_DIR: u8 = 2;
pub const FT_CHRDEV: u8 = 3;
pub const FT_BLKDEV: u8 = 4;
pub const FT_FIFO: u8 = 5;
pub const FT_SOCK: u8 = 6;
pub const FT_SYMLINK: u8 = 7;
pub const FT_XATTR: u8 = 8;
pub const FT_MAX: u8 = 9;
pub const FT_ENCRYPTED: u8 = 0x80;

// Inode flags (`btrfs_inode_item.flags`).
pub const INODE_NODATASUM: u64 = 1 << 0;
pub const INODE_NODATACOW: u64 = 1 << 1;
pub const INODE_READONLY: u64 = 1 << 2;
pub const INODE_NOCOMPRESS: u64 = 1 << 3;
pub const INODE_PREALLOC: u64 = 1 << 4;
pub const INODE_SYNC: u64 = 1 << 5;
pub const INODE_IMMUTABLE: u64 = 1 << 6;
pub const INODE_APPEND: u64 = 1 << 7;
pub const INODE_NODUMP: u64 = 1 << 8;
pub const INODE_NOATIME: u64 = 1 << 9;
pub const INODE_DIRSYNC: u64 = 1 << 10;
pub const INODE_COMPRESS: u64 = 1 << 11;
pub const INODE_ROOT_ITEM_INIT: u64 = 1 << 31;
/// Flags in the upper 32 bits (`ro_flags`), e.g. VERITY.
pub const INODE_RO_VERITY: u64 = 1 << 32;
pub const INODE_FLAGS_MASK: u64 = 0xfff | INODE_ROOT_ITEM_INIT | INODE_RO_VERITY;

// POSIX file type bits of `mode`.
pub const S_IFMT: u32 = 0o170000;
pub const S_IFSOCK: u32 = 0o140000;
pub const S_IFLNK: u32 = 0o120000;
pub const S_IFREG: u32 = 0o100000;
pub const S_IFBLK: u32 = 0o060000;
pub const S_IFDIR: u32 = 0o040000;
pub const S_IFCHR: u32 = 0o020000;
pub const S_IFIFO: u32 = 0o010000;
// The set-id bits of `mode`.
pub const S_ISUID: u32 = 0o4000;
pub const S_ISGID: u32 = 0o2000;

/// The dir-entry file type that matches an inode mode.
pub fn ft_from_mode(mode: u32) -> u8 {
    match mode & S_IFMT {
        S_IFREG => FT_REG_FILE,
        S_IFDIR => FT_DIR,
        S_IFCHR => FT_CHRDEV,
        S_IFBLK => FT_BLKDEV,
        S_IFIFO => FT_FIFO,
        S_IFSOCK => FT_SOCK,
        S_IFLNK => FT_SYMLINK,
        _ => FT_UNKNOWN,
    }
}

/// Decode `rdev` into (major, minor). btrfs stores the kernel's internal dev_t,
/// `major << 20 | minor`.
pub fn rdev_decode(rdev: u64) -> (u32, u32) {
    ((rdev >> 20) as u32 & 0xfff, (rdev & 0xfffff) as u32)
}

/// Encode (major, minor) as btrfs stores it.
pub fn rdev_encode(major: u32, minor: u32) -> u64 {
    (u64::from(major) << 20) | u64::from(minor & 0xfffff)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn offsets() {
        assert_eq!(sb_offset(0), 65536);
        assert_eq!(sb_offset(1), 64 << 20);
        assert_eq!(sb_offset(2), 256 << 30);
        assert_eq!(core::mem::offset_of!(Superblock, sys_chunk_array), 811);
        assert_eq!(core::mem::offset_of!(Superblock, super_roots), 2859);
        assert_eq!(core::mem::offset_of!(Superblock, dev_item), 201);
        assert_eq!(core::mem::offset_of!(Superblock, label), 299);
        assert_eq!(core::mem::offset_of!(Superblock, metadata_uuid), 571);
        assert_eq!(core::mem::offset_of!(Superblock, csum_type), 196);
        assert_eq!(rdev_decode((1 << 20) | 3), (1, 3));
        assert_eq!(rdev_decode(rdev_encode(259, 70000)), (259, 70000));
    }
}
