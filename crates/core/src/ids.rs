//! Names shared by every layer: an inode's (`InodeId`), used by the read view, the
//! file-data structures in memory (`mapping`), the in-memory inodes and the writer;
//! a logical address (`Logical`), which the chunk map turns into device offsets; and a
//! transaction id (`Generation`). Each prints as the kernel's messages name it, so an
//! error built from one reads like the kernel's (`root=5 ino=257`, `bytenr=30408704`,
//! `gen=12`). The on-disk structs of ubtrfs-format keep raw integers; these types are
//! for the in-memory interfaces.

/// Names an inode: subvolume tree id and objectid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InodeId {
    pub root: u64,
    pub ino: u64,
}

impl InodeId {
    /// The empty directory the kernel shows where a snapshot holds the entry of a
    /// subvolume it does not contain (`new_simple_dir`: objectid
    /// BTRFS_EMPTY_SUBVOL_DIR_OBJECTID in the snapshot's tree). No item of a tree ever
    /// has this objectid, so nothing is read or written for it.
    pub fn placeholder(root: u64) -> InodeId {
        InodeId { root, ino: ubtrfs_format::key::EMPTY_SUBVOL_DIR_OBJECTID }
    }

    /// Whether this names a placeholder (see `placeholder`).
    pub fn is_placeholder(&self) -> bool {
        self.ino == ubtrfs_format::key::EMPTY_SUBVOL_DIR_OBJECTID
    }
}

impl std::fmt::Display for InodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "root={} ino={}", self.root, self.ino)
    }
}

/// A logical address: a byte of the filesystem's address space, which the chunk map
/// (`volumes::ChunkMap`) turns into a device and an offset on it. A tree block's
/// `bytenr` and a data extent's `disk_bytenr` are logical addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Logical(pub u64);

impl Logical {
    /// The address as the raw number the on-disk structs hold.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for Logical {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "bytenr={}", self.0)
    }
}

/// A transaction id: the generation a commit writes, and the one stamped on what a
/// transaction changes (tree blocks, inode items, file extents).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub u64);

impl Generation {
    /// The generation as the raw number the on-disk structs hold.
    pub fn get(self) -> u64 {
        self.0
    }

    /// The generation before this one (the last committed, for a running transaction).
    pub fn prev(self) -> Generation {
        Generation(self.0 - 1)
    }
}

impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "gen={}", self.0)
    }
}
