//! What `mkfs` is asked for: sizes, checksum, identity, profiles and features, parsed
//! from the command line's words and checked against what the kernel and the engine
//! accept before anything is written.
//!
//! Invariants of a `MkfsOptions` that `validate` passed: sectorsize is 4096 or the
//! page size, nodesize a power of two in [sectorsize, 64 KiB] (equal to the sectorsize
//! with mixed block groups, whose data and metadata profiles are one), profiles
//! writable on the device count, the feature set one the engine writes. Neighbours: `bootstrap`
//! (writes the first filesystem from these), `mod.rs` (runs the engine on it).

use ubtrfs_core::{Error, PosixKind, Result, Sources};
use ubtrfs_format::features::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::CsumType;

/// The smallest device mkfs accepts: the first MiB (never allocated), the temporary
/// chunk, and room for SYSTEM, METADATA and DATA chunks of the kernel's 4 MiB minimum
/// (twice for DUP), with slack for the kernel's first writes.
pub const MIN_DEVICE_SIZE: u64 = 64 << 20;

/// Features beyond the fixed set; the default is mkfs.btrfs 6.2's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features {
    pub extref: bool,
    pub no_holes: bool,
    /// Block group items in their own tree (compat_ro BLOCK_GROUP_TREE).
    pub block_group_tree: bool,
    /// Data and metadata share DATA|METADATA block groups (incompat MIXED_GROUPS).
    pub mixed: bool,
}

impl Default for Features {
    fn default() -> Features {
        Features { extref: true, no_holes: true, block_group_tree: false, mixed: false }
    }
}

impl Features {
    /// The incompat bits: skinny metadata and mixed backrefs always (the writer needs them).
    pub fn incompat(&self) -> u64 {
        let mut f = INCOMPAT_MIXED_BACKREF | INCOMPAT_SKINNY_METADATA;
        if self.extref {
            f |= INCOMPAT_EXTENDED_IREF;
        }
        if self.no_holes {
            f |= INCOMPAT_NO_HOLES;
        }
        if self.mixed {
            f |= INCOMPAT_MIXED_GROUPS;
        }
        f
    }

    /// The compat_ro bits: a valid free-space tree always (the writer needs it).
    pub fn compat_ro(&self) -> u64 {
        let mut f = COMPAT_RO_FREE_SPACE_TREE | COMPAT_RO_FREE_SPACE_TREE_VALID;
        if self.block_group_tree {
            f |= COMPAT_RO_BLOCK_GROUP_TREE;
        }
        f
    }

    /// Apply a `--features` list (`block-group-tree,^no-holes`) to the defaults.
    ///
    /// # Errors
    /// `Posix(Invalid)` naming an unknown feature, one the writer cannot do without,
    /// or one not supported yet.
    pub fn parse(list: &str) -> Result<Features> {
        let mut f = Features::default();
        for word in list.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            let (on, name) = match word.strip_prefix('^') {
                Some(n) => (false, n),
                None => (true, word),
            };
            let bad = |why: &str| {
                Error::posix_detail(PosixKind::Invalid, format!("feature {name}"), why.to_string())
            };
            match name.to_ascii_lowercase().replace('_', "-").as_str() {
                "extref" => f.extref = on,
                "no-holes" => f.no_holes = on,
                "block-group-tree" | "bgt" => f.block_group_tree = on,
                "skinny-metadata" | "free-space-tree" | "fst" | "mixed-backref" if on => {}
                "skinny-metadata" | "free-space-tree" | "fst" | "mixed-backref" => return Err(bad("cannot be turned off: the ubtrfs writer needs it")),
                "mixed-bg" | "mixed" => f.mixed = on,
                "raid56" | "zoned" | "extent-tree-v2" | "raid-stripe-tree" | "squota" | "quota" => return Err(bad("not supported by ubtrfs mkfs yet")),
                _ => return Err(bad("unknown feature; known: extref, skinny-metadata, no-holes, free-space-tree, block-group-tree")),
            }
        }
        if f.block_group_tree && !f.no_holes {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                "feature block-group-tree",
                "needs no-holes: the kernel refuses to mount it without",
            ));
        }
        Ok(f)
    }
}

/// A block-group profile as `-d`/`-m` name it.
///
/// # Errors
/// `Posix(Invalid)` for an unknown name, or RAID5/6 (not written by ubtrfs).
pub fn parse_profile(name: &str) -> Result<u64> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "single" => 0,
        "dup" => BLOCK_GROUP_DUP,
        "raid0" => BLOCK_GROUP_RAID0,
        "raid1" => BLOCK_GROUP_RAID1,
        "raid1c3" => BLOCK_GROUP_RAID1C3,
        "raid1c4" => BLOCK_GROUP_RAID1C4,
        "raid10" => BLOCK_GROUP_RAID10,
        "raid5" | "raid6" => {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                format!("profile {name}"),
                "RAID5/6 are not supported for writing",
            ))
        }
        _ => {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                format!("profile {name}"),
                "unknown profile; known: single, dup, raid0, raid1, raid1c3, raid1c4, raid10",
            ))
        }
    })
}

/// The fewest devices `profile` needs (the kernel's `devs_min`).
pub fn profile_min_devices(profile: u64) -> usize {
    ubtrfs_core::raid_attr(profile).map_or(usize::MAX, |a| a.devs_min)
}

/// A checksum algorithm as `--csum` names it.
///
/// # Errors
/// `Posix(Invalid)` for an unknown name.
pub fn parse_csum(name: &str) -> Result<CsumType> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "crc32c" => CsumType::Crc32c,
        "xxhash" | "xxhash64" => CsumType::Xxhash64,
        "sha256" => CsumType::Sha256,
        "blake2" | "blake2b" => CsumType::Blake2b,
        _ => {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                format!("checksum {name}"),
                "unknown algorithm; known: crc32c, xxhash, sha256, blake2",
            ))
        }
    })
}

/// Parse a UUID written as 32 hex digits with or without the four dashes.
///
/// # Errors
/// `Posix(Invalid)` naming the text.
pub fn parse_uuid(s: &str) -> Result<[u8; 16]> {
    let hex: String = s.chars().filter(|&c| c != '-').collect();
    let bad = || {
        Error::posix_detail(
            PosixKind::Invalid,
            format!("uuid {s}"),
            "not a UUID, expected xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx",
        )
    };
    if hex.len() != 32 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    let mut u = [0u8; 16];
    for (i, b) in u.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    if u == [0u8; 16] {
        return Err(Error::posix_detail(
            PosixKind::Invalid,
            format!("uuid {s}"),
            "the nil UUID cannot name a filesystem",
        ));
    }
    Ok(u)
}

/// The default profiles (data, metadata) for `ndevs` devices, as mkfs.btrfs 6.2 picks
/// them: data SINGLE; metadata DUP on one device, RAID1 on several; with mixed block
/// groups SINGLE for both.
pub fn default_profiles(ndevs: usize, mixed: bool) -> (u64, u64) {
    match (mixed, ndevs) {
        (true, _) => (0, 0),
        (false, 0 | 1) => (0, BLOCK_GROUP_DUP),
        (false, _) => (0, BLOCK_GROUP_RAID1),
    }
}

/// Everything mkfs is asked for.
#[derive(Clone)]
pub struct MkfsOptions {
    pub nodesize: u32,
    pub sectorsize: u32,
    pub csum: CsumType,
    /// At most 255 bytes.
    pub label: Vec<u8>,
    /// The filesystem UUID; random (from `sources`) when None.
    pub fsid: Option<[u8; 16]>,
    /// Profile bits (0: SINGLE).
    pub data_profile: u64,
    pub metadata_profile: u64,
    pub features: Features,
    /// Time and new UUIDs.
    pub sources: Sources,
    /// Make the filesystem no larger than it needs (`--shrink`): small chunks, and the
    /// device's size cut to the end of its last chunk once filled.
    pub shrink: bool,
}

impl Default for MkfsOptions {
    fn default() -> MkfsOptions {
        MkfsOptions {
            nodesize: 16384,
            sectorsize: 4096,
            csum: CsumType::Crc32c,
            label: Vec::new(),
            fsid: None,
            data_profile: 0,
            metadata_profile: BLOCK_GROUP_DUP,
            features: Features::default(),
            sources: Sources::default(),
            shrink: false,
        }
    }
}

/// The host's page size (the other sector size the kernel mounts).
pub fn page_size() -> u32 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u32::try_from(p).ok().filter(|p| p.is_power_of_two()).unwrap_or(4096)
}

impl MkfsOptions {
    /// Check the options on their own and against one device of `size` bytes of a
    /// filesystem of `ndevs` devices (called for each).
    ///
    /// # Errors
    /// `Posix(Invalid)` naming the option and the accepted values; `Posix(NoSpace)`
    /// for a device below `MIN_DEVICE_SIZE`.
    pub fn validate(&self, image: &str, size: u64, ndevs: usize) -> Result<()> {
        let ss = self.sectorsize;
        let page = page_size();
        if ss != 4096 && ss != page {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                format!("sectorsize {ss}"),
                format!("the kernel mounts sectorsize 4096 or the page size, {page}, only"),
            ));
        }
        let ns = self.nodesize;
        if ns < ss {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                format!("nodesize {ns}"),
                format!("smaller than the sectorsize {ss}"),
            ));
        }
        if !ns.is_power_of_two() || !(4096..=65536).contains(&ns) {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                format!("nodesize {ns}"),
                "a power of two from 4096 to 65536",
            ));
        }
        if self.label.len() >= LABEL_SIZE {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                "label",
                format!("{} bytes, at most {} allowed", self.label.len(), LABEL_SIZE - 1),
            ));
        }
        if self.label.contains(&0) {
            return Err(Error::posix_detail(PosixKind::Invalid, "label", "contains a NUL byte"));
        }
        if self.features.mixed {
            if ns != ss {
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    format!("nodesize {ns}"),
                    format!("mixed block groups need it equal to the sectorsize {ss}"),
                ));
            }
            if self.data_profile != self.metadata_profile {
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    "profiles",
                    "with mixed block groups data and metadata profiles must be the same",
                ));
            }
        }
        for (what, p) in [("data", self.data_profile), ("metadata", self.metadata_profile)] {
            let need = profile_min_devices(p);
            if need > ndevs {
                let name = block_group_flags_str(BLOCK_GROUP_DATA | p);
                let name = name.split(", ").nth(1).unwrap_or("?").to_ascii_lowercase();
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    format!("{what} profile {name}"),
                    format!("needs at least {need} devices, {ndevs} given"),
                ));
            }
        }
        if size < MIN_DEVICE_SIZE {
            return Err(Error::posix_detail(
                PosixKind::NoSpace,
                image.to_string(),
                format!(
                    "{size} bytes is too small for a filesystem, at least {} MiB are needed",
                    MIN_DEVICE_SIZE >> 20
                ),
            ));
        }
        Ok(())
    }
}

/// Parse a byte count with an optional binary suffix: `268435456`, `256M`, `16k`,
/// `1GiB`, `2T`.
///
/// # Errors
/// `Posix(Invalid)` naming `what` and the text.
pub fn parse_size(what: &str, s: &str) -> Result<u64> {
    let bad = || {
        Error::posix_detail(
            PosixKind::Invalid,
            format!("{what} {s}"),
            "not a size, expected a number with an optional K, M, G, T, P or E suffix",
        )
    };
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix("ib"))
        .or_else(|| t.strip_suffix('B'))
        .or_else(|| t.strip_suffix('b'))
        .unwrap_or(t);
    let (num, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_lowercase() {
                'k' => 10,
                'm' => 20,
                'g' => 30,
                't' => 40,
                'p' => 50,
                'e' => 60,
                _ => return Err(bad()),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: u64 = num.parse().map_err(|_| bad())?;
    n.checked_mul(1u64 << shift).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_profiles_features() {
        assert_eq!(parse_size("size", "256M").unwrap(), 256 << 20);
        assert_eq!(parse_size("size", "16k").unwrap(), 16384);
        assert_eq!(parse_size("size", "1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("size", "4096").unwrap(), 4096);
        assert!(parse_size("size", "12Q").is_err());
        assert!(parse_size("size", "99999999E").is_err());
        assert_eq!(parse_profile("DUP").unwrap(), BLOCK_GROUP_DUP);
        assert!(parse_profile("raid5").unwrap_err().to_string().contains("RAID5/6"));
        assert_eq!(parse_csum("xxhash").unwrap(), CsumType::Xxhash64);
        assert!(parse_csum("md5").is_err());
        let f = Features::parse("block-group-tree,^extref").unwrap();
        assert!(f.block_group_tree && f.no_holes && !f.extref);
        assert!(Features::parse("nope").unwrap_err().to_string().contains("unknown feature"));
        assert!(Features::parse("block-group-tree,^no-holes")
            .unwrap_err()
            .to_string()
            .contains("needs no-holes"));
        assert!(Features::parse("^free-space-tree")
            .unwrap_err()
            .to_string()
            .contains("cannot be turned off"));
        assert_eq!(parse_uuid("0f4c5390-03e1-46a1-a376-89233a9a63a8").unwrap()[..2], [0x0f, 0x4c]);
        assert!(parse_uuid("0f4c5390").is_err());
    }

    #[test]
    fn validation() {
        let o = MkfsOptions::default();
        o.validate("x", 256 << 20, 1).unwrap();
        assert!(o.validate("x", 16 << 20, 1).unwrap_err().to_string().contains("too small"));
        let o2 = MkfsOptions { nodesize: 4096, sectorsize: 8192, ..MkfsOptions::default() };
        assert!(o2
            .validate("x", 256 << 20, 1)
            .unwrap_err()
            .to_string()
            .contains("sectorsize 8192"));
        let mixed = Features { mixed: true, ..Features::default() };
        let m = MkfsOptions { features: mixed, ..MkfsOptions::default() };
        assert!(m
            .validate("x", 256 << 20, 1)
            .unwrap_err()
            .to_string()
            .contains("equal to the sectorsize"));
        let m = MkfsOptions { features: mixed, nodesize: 4096, ..MkfsOptions::default() };
        assert!(m
            .validate("x", 256 << 20, 1)
            .unwrap_err()
            .to_string()
            .contains("must be the same"));
        MkfsOptions {
            features: mixed,
            nodesize: 4096,
            metadata_profile: 0,
            ..MkfsOptions::default()
        }
        .validate("x", 256 << 20, 1)
        .unwrap();
        let o3 = MkfsOptions { data_profile: BLOCK_GROUP_RAID1, ..MkfsOptions::default() };
        let e = o3.validate("x", 256 << 20, 1).unwrap_err().to_string();
        assert!(
            e.contains("data profile raid1") && e.contains("needs at least 2 devices, 1 given"),
            "{e}"
        );
        o3.validate("x", 256 << 20, 2).unwrap();
        let o4 = MkfsOptions { metadata_profile: BLOCK_GROUP_RAID1C4, ..MkfsOptions::default() };
        let e = o4.validate("x", 256 << 20, 3).unwrap_err().to_string();
        assert!(
            e.contains("metadata profile raid1c4")
                && e.contains("needs at least 4 devices, 3 given"),
            "{e}"
        );
        // DUP keeps both copies on one device, on any number of them.
        MkfsOptions { data_profile: BLOCK_GROUP_DUP, ..MkfsOptions::default() }
            .validate("x", 256 << 20, 3)
            .unwrap();
    }
}
