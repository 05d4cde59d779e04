//! What a device already holds: the signatures of the filesystems and containers
//! mkfs must not overwrite unless forced (mkfs.btrfs asks libblkid; these are the
//! same magic numbers at the same offsets, for the kinds people actually have lying
//! on their disks).
//!
//! Order matters where one format carries another's bytes: a GPT disk also has a
//! protective MBR, and a FAT volume the MBR boot signature, so GPT and FAT are
//! looked for before the bare MBR.

use std::os::unix::fs::FileExt;
use ubtrfs_core::{Error, Result};
use ubtrfs_format::structs::{MAGIC, SUPER_INFO_OFFSET};

/// Bytes read from the start of the device: everything up to the btrfs magic.
const PROBE_BYTES: usize = 72 * 1024;

fn at(buf: &[u8], off: usize, magic: &[u8]) -> bool {
    buf.get(off..off + magic.len()) == Some(magic)
}

/// Name the filesystem or container whose signature the first bytes `buf` carry
/// (`btrfs`, `ext4`, `xfs`, ...), if any.
pub fn identify(buf: &[u8]) -> Option<&'static str> {
    let btrfs_at = SUPER_INFO_OFFSET as usize + 64;
    if at(buf, btrfs_at, &MAGIC.to_le_bytes()) {
        return Some("btrfs");
    }
    if at(buf, 1080, &[0x53, 0xef]) {
        // The ext2/3/4 superblock at 1024; the journal and extents features tell them apart.
        let compat = buf
            .get(1024 + 92..1024 + 96)
            .map_or(0, |b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
        let incompat = buf
            .get(1024 + 96..1024 + 100)
            .map_or(0, |b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
        return Some(if incompat & 0x40 != 0 {
            "ext4"
        } else if compat & 0x4 != 0 {
            "ext3"
        } else {
            "ext2"
        });
    }
    if at(buf, 0, b"XFSB") {
        return Some("xfs");
    }
    let page = super::options::page_size() as usize;
    if at(buf, 4086, b"SWAPSPACE2")
        || at(buf, 4086, b"SWAP-SPACE")
        || at(buf, page - 10, b"SWAPSPACE2")
    {
        return Some("swap");
    }
    if at(buf, 0, b"LUKS\xba\xbe") {
        return Some("crypto_LUKS");
    }
    if at(buf, 512, b"EFI PART") {
        return Some("a GPT partition table");
    }
    if at(buf, 32769, b"CD001") {
        return Some("iso9660");
    }
    if at(buf, 510, &[0x55, 0xaa]) {
        if at(buf, 54, b"FAT") || at(buf, 82, b"FAT32") {
            return Some("vfat");
        }
        // Four 16-byte partition entries at 446: any non-empty one is a DOS table.
        if buf[446..510].iter().any(|&b| b != 0) {
            return Some("a DOS partition table");
        }
    }
    None
}

/// Look for a signature on the open device or file `dev` of `size` bytes.
///
/// # Errors
/// `Io` naming `name` when the device cannot be read.
pub fn probe(dev: &std::fs::File, name: &str, size: u64) -> Result<Option<&'static str>> {
    let n = PROBE_BYTES.min(usize::try_from(size).unwrap_or(PROBE_BYTES));
    let mut buf = vec![0u8; PROBE_BYTES];
    dev.read_exact_at(&mut buf[..n], 0)
        .map_err(|e| Error::io(format!("{name}: reading for signatures"), e))?;
    Ok(identify(&buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_signature() {
        let blank = vec![0u8; PROBE_BYTES];
        assert_eq!(identify(&blank), None);
        let with = |off: usize, m: &[u8]| {
            let mut b = blank.clone();
            b[off..off + m.len()].copy_from_slice(m);
            b
        };
        assert_eq!(identify(&with(65536 + 64, b"_BHRfS_M")), Some("btrfs"));
        assert_eq!(identify(&with(1080, &[0x53, 0xef])), Some("ext2"));
        let mut e4 = with(1080, &[0x53, 0xef]);
        e4[1024 + 96] = 0x40;
        assert_eq!(identify(&e4), Some("ext4"));
        assert_eq!(identify(&with(0, b"XFSB")), Some("xfs"));
        assert_eq!(identify(&with(4086, b"SWAPSPACE2")), Some("swap"));
        assert_eq!(identify(&with(0, b"LUKS\xba\xbe")), Some("crypto_LUKS"));
        assert_eq!(identify(&with(512, b"EFI PART")), Some("a GPT partition table"));
        assert_eq!(identify(&with(32769, b"CD001")), Some("iso9660"));
        let mut fat = with(510, &[0x55, 0xaa]);
        fat[82..87].copy_from_slice(b"FAT32");
        assert_eq!(identify(&fat), Some("vfat"));
        let mut mbr = with(510, &[0x55, 0xaa]);
        assert_eq!(identify(&mbr), None, "a boot signature without partitions or FAT is nothing");
        mbr[446 + 4] = 0x83;
        assert_eq!(identify(&mbr), Some("a DOS partition table"));
    }
}
