//! Key hashes: DIR_ITEM/XATTR name hash, INODE_EXTREF hash and the EXTENT_DATA_REF hash.
//!
//! These use raw crc32c (no final inversion), unlike the block checksum.

/// Raw crc32c update: `crc32c` with a caller seed and without the final inversion.
fn crc32c_raw(seed: u32, data: &[u8]) -> u32 {
    // crc32c::crc32c_append(c, d) computes !update(!c, d); so feed !seed and invert.
    !crc32c::crc32c_append(!seed, data)
}

/// Hash a name for DIR_ITEM and XATTR_ITEM keys.
pub fn name_hash(name: &[u8]) -> u64 {
    u64::from(crc32c_raw(!1u32, name))
}

/// Hash (parent, name) for INODE_EXTREF keys.
pub fn extref_hash(parent_ino: u64, name: &[u8]) -> u64 {
    u64::from(crc32c_raw(parent_ino as u32, name))
}

/// Hash (root, ino, offset) for keyed and inline EXTENT_DATA_REF ordering.
pub fn hash_extent_data_ref(root: u64, ino: u64, offset: u64) -> u64 {
    let high = crc32c_raw(!0u32, &root.to_le_bytes());
    let low = crc32c_raw(!0u32, &ino.to_le_bytes());
    let low = crc32c_raw(low, &offset.to_le_bytes());
    (u64::from(high) << 31) ^ u64::from(low)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_name_hash() {
        // The root tree's DIR_ITEM for "default" has key offset 0x8dbfc2d2 in every mkfs image.
        assert_eq!(name_hash(b"default"), 2378154706);
    }
}
