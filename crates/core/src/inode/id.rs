//! The name of an inode, shared by every layer that keeps inodes (the read view, the
//! in-memory inodes in `FsInfo`, the writer).

/// Names an inode: subvolume tree id and objectid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InodeId {
    pub root: u64,
    pub ino: u64,
}

impl std::fmt::Display for InodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "root={} ino={}", self.root, self.ino)
    }
}
