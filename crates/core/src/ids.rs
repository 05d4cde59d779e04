//! Names shared by every layer: an inode's (`InodeId`), used by the read view, the
//! file-data structures in memory (`mapping`), the in-memory inodes and the writer.

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
