//! Feature flags: which bits we know, and what an unknown bit means.
//!
//! Unknown incompat bits refuse the filesystem; unknown compat_ro bits allow read-only
//! access; compat bits are informational.

pub const COMPAT_RO_FREE_SPACE_TREE: u64 = 1 << 0;
pub const COMPAT_RO_FREE_SPACE_TREE_VALID: u64 = 1 << 1;
pub const COMPAT_RO_VERITY: u64 = 1 << 2;
pub const COMPAT_RO_BLOCK_GROUP_TREE: u64 = 1 << 3;

pub const INCOMPAT_MIXED_BACKREF: u64 = 1 << 0;
pub const INCOMPAT_DEFAULT_SUBVOL: u64 = 1 << 1;
pub const INCOMPAT_MIXED_GROUPS: u64 = 1 << 2;
pub const INCOMPAT_COMPRESS_LZO: u64 = 1 << 3;
pub const INCOMPAT_COMPRESS_ZSTD: u64 = 1 << 4;
pub const INCOMPAT_BIG_METADATA: u64 = 1 << 5;
pub const INCOMPAT_EXTENDED_IREF: u64 = 1 << 6;
pub const INCOMPAT_RAID56: u64 = 1 << 7;
pub const INCOMPAT_SKINNY_METADATA: u64 = 1 << 8;
pub const INCOMPAT_NO_HOLES: u64 = 1 << 9;
pub const INCOMPAT_METADATA_UUID: u64 = 1 << 10;
pub const INCOMPAT_RAID1C34: u64 = 1 << 11;
pub const INCOMPAT_ZONED: u64 = 1 << 12;
pub const INCOMPAT_EXTENT_TREE_V2: u64 = 1 << 13;
pub const INCOMPAT_RAID_STRIPE_TREE: u64 = 1 << 14;
pub const INCOMPAT_SIMPLE_QUOTA: u64 = 1 << 16;

pub const COMPAT_RO_NAMES: &[(u64, &str)] = &[
    (COMPAT_RO_FREE_SPACE_TREE, "FREE_SPACE_TREE"),
    (COMPAT_RO_FREE_SPACE_TREE_VALID, "FREE_SPACE_TREE_VALID"),
    (COMPAT_RO_VERITY, "VERITY"),
    (COMPAT_RO_BLOCK_GROUP_TREE, "BLOCK_GROUP_TREE"),
];

pub const INCOMPAT_NAMES: &[(u64, &str)] = &[
    (INCOMPAT_MIXED_BACKREF, "MIXED_BACKREF"),
    (INCOMPAT_DEFAULT_SUBVOL, "DEFAULT_SUBVOL"),
    (INCOMPAT_MIXED_GROUPS, "MIXED_GROUPS"),
    (INCOMPAT_COMPRESS_LZO, "COMPRESS_LZO"),
    (INCOMPAT_COMPRESS_ZSTD, "COMPRESS_ZSTD"),
    (INCOMPAT_BIG_METADATA, "BIG_METADATA"),
    (INCOMPAT_EXTENDED_IREF, "EXTENDED_IREF"),
    (INCOMPAT_RAID56, "RAID56"),
    (INCOMPAT_SKINNY_METADATA, "SKINNY_METADATA"),
    (INCOMPAT_NO_HOLES, "NO_HOLES"),
    (INCOMPAT_METADATA_UUID, "METADATA_UUID"),
    (INCOMPAT_RAID1C34, "RAID1C34"),
    (INCOMPAT_ZONED, "ZONED"),
    (INCOMPAT_EXTENT_TREE_V2, "EXTENT_TREE_V2"),
    (INCOMPAT_RAID_STRIPE_TREE, "RAID_STRIPE_TREE"),
    (INCOMPAT_SIMPLE_QUOTA, "SIMPLE_QUOTA"),
];

/// Incompat bits ubtrfs can read. RAID56, zoned, extent-tree-v2 and the raid-stripe
/// tree change the layout in ways the read engine does not implement, so they refuse
/// by name rather than misread.
pub const INCOMPAT_SUPPORTED: u64 = INCOMPAT_MIXED_BACKREF
    | INCOMPAT_DEFAULT_SUBVOL
    | INCOMPAT_MIXED_GROUPS
    | INCOMPAT_COMPRESS_LZO
    | INCOMPAT_COMPRESS_ZSTD
    | INCOMPAT_BIG_METADATA
    | INCOMPAT_EXTENDED_IREF
    | INCOMPAT_SKINNY_METADATA
    | INCOMPAT_NO_HOLES
    | INCOMPAT_METADATA_UUID
    | INCOMPAT_RAID1C34
    | INCOMPAT_SIMPLE_QUOTA;

pub const COMPAT_RO_SUPPORTED: u64 = COMPAT_RO_FREE_SPACE_TREE
    | COMPAT_RO_FREE_SPACE_TREE_VALID
    | COMPAT_RO_VERITY
    | COMPAT_RO_BLOCK_GROUP_TREE;

/// Superblock `flags` bits.
pub const SUPER_FLAG_ERROR: u64 = 1 << 2;
pub const SUPER_FLAG_SEEDING: u64 = 1 << 32;
pub const SUPER_FLAG_METADUMP: u64 = 1 << 33;
pub const SUPER_FLAG_METADUMP_V2: u64 = 1 << 34;
pub const SUPER_FLAG_CHANGING_FSID: u64 = 1 << 35;
pub const SUPER_FLAG_CHANGING_FSID_V2: u64 = 1 << 36;
pub const SUPER_FLAG_CHANGING_BG_TREE: u64 = 1 << 38;
pub const SUPER_FLAG_CHANGING_DATA_CSUM: u64 = 1 << 39;
pub const SUPER_FLAG_CHANGING_META_CSUM: u64 = 1 << 40;

pub const SUPER_FLAG_NAMES: &[(u64, &str)] = &[
    (1 << 0, "WRITTEN"),
    (1 << 1, "RELOC"),
    (SUPER_FLAG_ERROR, "ERROR"),
    (SUPER_FLAG_SEEDING, "SEEDING"),
    (SUPER_FLAG_METADUMP, "METADUMP"),
    (SUPER_FLAG_METADUMP_V2, "METADUMP_V2"),
    (SUPER_FLAG_CHANGING_FSID, "CHANGING_FSID"),
    (SUPER_FLAG_CHANGING_FSID_V2, "CHANGING_FSID_V2"),
    (SUPER_FLAG_CHANGING_BG_TREE, "CHANGING_BG_TREE"),
    (SUPER_FLAG_CHANGING_DATA_CSUM, "CHANGING_DATA_CSUM"),
    (SUPER_FLAG_CHANGING_META_CSUM, "CHANGING_META_CSUM"),
];

/// Superblock flags under which the image must not be written: a seed device
/// (read-only by design), a btrfs-image metadump (no data), or an interrupted
/// btrfstune conversion.
pub const SUPER_FLAGS_NO_WRITE: u64 = SUPER_FLAG_SEEDING
    | SUPER_FLAG_METADUMP
    | SUPER_FLAG_METADUMP_V2
    | SUPER_FLAG_CHANGING_FSID
    | SUPER_FLAG_CHANGING_FSID_V2
    | SUPER_FLAG_CHANGING_BG_TREE
    | SUPER_FLAG_CHANGING_DATA_CSUM
    | SUPER_FLAG_CHANGING_META_CSUM;

/// Render set bits with names, unknown ones as `0x...`: `SKINNY_METADATA|NO_HOLES`.
pub fn flag_names(bits: u64, table: &[(u64, &str)]) -> String {
    let mut parts = Vec::new();
    let mut rest = bits;
    for &(bit, name) in table {
        if bits & bit != 0 {
            parts.push(name.to_string());
            rest &= !bit;
        }
    }
    if rest != 0 {
        parts.push(format!("unknown({rest:#x})"));
    }
    parts.join("|")
}

/// What the feature bits allow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeatureVerdict {
    ReadWrite,
    /// Unknown compat_ro bits: reading is safe, writing is not.
    ReadOnly {
        unknown_compat_ro: u64,
    },
    /// Incompat bits we do not implement (named), or unknown ones.
    Refuse {
        unsupported_incompat: u64,
    },
}

/// Decide from `incompat_flags` and `compat_ro_flags` what ubtrfs may do.
pub fn check_features(incompat: u64, compat_ro: u64) -> FeatureVerdict {
    let bad = incompat & !INCOMPAT_SUPPORTED;
    if bad != 0 {
        return FeatureVerdict::Refuse { unsupported_incompat: bad };
    }
    let ro = compat_ro & !COMPAT_RO_SUPPORTED;
    if ro != 0 {
        return FeatureVerdict::ReadOnly { unknown_compat_ro: ro };
    }
    FeatureVerdict::ReadWrite
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn verdicts() {
        assert_eq!(check_features(0x361, 0x3), FeatureVerdict::ReadWrite);
        assert_eq!(
            check_features(1 << 40, 0),
            FeatureVerdict::Refuse { unsupported_incompat: 1 << 40 }
        );
        assert_eq!(
            check_features(INCOMPAT_RAID56, 0),
            FeatureVerdict::Refuse { unsupported_incompat: INCOMPAT_RAID56 }
        );
        assert_eq!(
            check_features(0, 1 << 20),
            FeatureVerdict::ReadOnly { unknown_compat_ro: 1 << 20 }
        );
        assert_eq!(
            flag_names(0x301 | (1 << 40), INCOMPAT_NAMES),
            "MIXED_BACKREF|SKINNY_METADATA|NO_HOLES|unknown(0x10000000000)"
        );
    }
}
