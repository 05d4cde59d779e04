//! Checksums: the four algorithms btrfs uses for tree blocks, superblocks and data.
//!
//! Every checksum is stored in a 32-byte field, zero-padded; `csum_size` bytes matter.
//! crc32c is the standard one (seed !0, final inversion) stored little-endian.

use blake2::digest::consts::U32;
use blake2::{Blake2b, Digest};

pub const CSUM_SIZE_MAX: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CsumType {
    Crc32c,
    Xxhash64,
    Sha256,
    Blake2b,
}

impl CsumType {
    /// Decode the superblock's `csum_type`; `None` for an unknown algorithm.
    pub fn from_raw(v: u16) -> Option<CsumType> {
        Some(match v {
            0 => CsumType::Crc32c,
            1 => CsumType::Xxhash64,
            2 => CsumType::Sha256,
            3 => CsumType::Blake2b,
            _ => return None,
        })
    }

    pub fn raw(self) -> u16 {
        match self {
            CsumType::Crc32c => 0,
            CsumType::Xxhash64 => 1,
            CsumType::Sha256 => 2,
            CsumType::Blake2b => 3,
        }
    }

    pub fn size(self) -> usize {
        match self {
            CsumType::Crc32c => 4,
            CsumType::Xxhash64 => 8,
            CsumType::Sha256 | CsumType::Blake2b => 32,
        }
    }

    /// The name btrfs-progs uses (`mkfs.btrfs --csum NAME`).
    pub fn name(self) -> &'static str {
        match self {
            CsumType::Crc32c => "crc32c",
            CsumType::Xxhash64 => "xxhash64",
            CsumType::Sha256 => "sha256",
            CsumType::Blake2b => "blake2b",
        }
    }

    /// Compute the checksum of `data` into a zero-padded 32-byte array.
    pub fn compute(self, data: &[u8]) -> [u8; CSUM_SIZE_MAX] {
        let mut out = [0u8; CSUM_SIZE_MAX];
        match self {
            CsumType::Crc32c => out[..4].copy_from_slice(&crc32c::crc32c(data).to_le_bytes()),
            CsumType::Xxhash64 => {
                out[..8].copy_from_slice(&xxhash_rust::xxh64::xxh64(data, 0).to_le_bytes())
            }
            CsumType::Sha256 => out.copy_from_slice(&sha2::Sha256::digest(data)),
            CsumType::Blake2b => out.copy_from_slice(&Blake2b::<U32>::digest(data)),
        }
        out
    }

    /// Check `data` against a stored checksum (only the first `size()` bytes are compared).
    pub fn verify(self, data: &[u8], stored: &[u8]) -> bool {
        let n = self.size();
        stored.len() >= n && self.compute(data)[..n] == stored[..n]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vectors() {
        // crc32c("123456789") = 0xe3069283 (Castagnoli check value).
        assert_eq!(&CsumType::Crc32c.compute(b"123456789")[..4], &0xe3069283u32.to_le_bytes());
        // xxh64("", 0) = 0xef46db3751d8e999.
        assert_eq!(&CsumType::Xxhash64.compute(b"")[..8], &0xef46db3751d8e999u64.to_le_bytes());
        let sha = CsumType::Sha256.compute(b"abc");
        assert_eq!(sha[0..4], [0xba, 0x78, 0x16, 0xbf]);
        // BLAKE2b-256("abc") begins bd dd 81 3c.
        let b2 = CsumType::Blake2b.compute(b"abc");
        assert_eq!(b2[0..4], [0xbd, 0xdd, 0x81, 0x3c]);
        for t in [CsumType::Crc32c, CsumType::Xxhash64, CsumType::Sha256, CsumType::Blake2b] {
            assert_eq!(CsumType::from_raw(t.raw()), Some(t));
            let c = t.compute(b"data");
            assert!(t.verify(b"data", &c));
            assert!(!t.verify(b"datb", &c));
        }
        assert_eq!(CsumType::from_raw(4), None);
    }
}
